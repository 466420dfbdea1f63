//! Scraped samples as Prometheus stores them: one series per label set, and a staleness
//! marker where a series that the last scrape had is missing from the next one (or the
//! scrape failed), so that instant queries stop returning it at once instead of for the
//! whole lookback window.

use std::collections::{BTreeMap, BTreeSet};

use super::Labels;

/// One stored sample at `t` (milliseconds); `None` is a staleness marker.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    pub t: i64,
    pub value: Option<f64>,
}

#[derive(Default)]
pub struct Store {
    series: BTreeMap<Labels, Vec<Point>>,
    /// Series the last scrape returned.
    live: BTreeSet<Labels>,
}

impl Store {
    /// Appends one scrape at `t`, which must be later than the last: its samples, or
    /// `None` if the scrape failed.
    pub fn append_scrape(&mut self, t: i64, samples: Option<&[(Labels, f64)]>) {
        let mut seen = BTreeSet::new();
        for (labels, value) in samples.unwrap_or_default() {
            // Prometheus keeps the first of duplicate samples in one scrape.
            if !seen.insert(labels.clone()) {
                continue;
            }
            self.series
                .entry(labels.clone())
                .or_default()
                .push(Point { t, value: Some(*value) });
        }
        for gone in self.live.difference(&seen) {
            if let Some(points) = self.series.get_mut(gone) {
                points.push(Point { t, value: None });
            }
        }
        self.live = seen;
    }

    /// Every series with its points in time order.
    pub fn series(&self) -> impl Iterator<Item = (&Labels, &[Point])> {
        self.series.iter().map(|(labels, points)| (labels, points.as_slice()))
    }

    /// The time of the first and of the last sample, if any.
    pub fn span(&self) -> Option<(i64, i64)> {
        let first = self.series.values().filter_map(|p| p.first()).map(|p| p.t).min()?;
        let last = self.series.values().filter_map(|p| p.last()).map(|p| p.t).max()?;
        Some((first, last))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(name: &str) -> Labels {
        Labels::from([(super::super::NAME.to_string(), name.to_string())])
    }

    #[test]
    fn a_series_missing_from_a_scrape_or_a_failed_scrape_is_marked_stale() {
        let mut store = Store::default();
        store.append_scrape(1_000, Some(&[(labels("a"), 1.0), (labels("b"), 2.0)]));
        store.append_scrape(2_000, Some(&[(labels("a"), 1.5)]));
        store.append_scrape(3_000, None);
        store.append_scrape(4_000, Some(&[(labels("b"), 4.0)]));
        let series: BTreeMap<_, _> = store
            .series()
            .map(|(l, p)| (l[super::super::NAME].clone(), p.to_vec()))
            .collect();
        let point = |t, v| Point { t, value: v };
        assert_eq!(
            series["a"],
            vec![point(1_000, Some(1.0)), point(2_000, Some(1.5)), point(3_000, None)]
        );
        assert_eq!(
            series["b"],
            vec![point(1_000, Some(2.0)), point(2_000, None), point(4_000, Some(4.0))]
        );
        assert_eq!(store.span(), Some((1_000, 4_000)));
    }
}
