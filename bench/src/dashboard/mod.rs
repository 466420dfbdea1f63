//! A picture of muster's Grafana dashboard drawn from its JSON with real data: the
//! operator's `/metrics` recorded while a mix of gangs runs on a local control plane
//! ([`mix`]), every panel's PromQL evaluated over that recording as Prometheus would
//! ([`promql`]), the panels laid out and drawn as an SVG ([`svg`]).
//! `cargo run --release -p muster-bench --bin dashboard` writes `docs/dashboard.svg`.
//!
//! The evaluator is held to Prometheus's own engine on demand: `--values FILE` writes
//! the samples, the queries and their results, and `bench/promql-check` (a Go program
//! on Prometheus's `promql` and `tsdb` packages) evaluates the same queries over the same
//! samples and compares every point.

pub mod exposition;
pub mod mix;
pub mod model;
pub mod promql;
pub mod recording;
pub mod svg;
pub mod units;

use anyhow::{Context, Result};

use self::model::{Dashboard, legend_name};
use self::recording::Recording;
use self::svg::{Line, Picture};

/// Data points a panel is as wide as, about: Grafana asks for one point per pixel at
/// most, and never more often than the scrape interval.
const MAX_DATA_POINTS: i64 = 780;

/// The queries' time range and step for a recording: the step is Grafana's interval
/// (the scrape interval, or longer for a recording too long for the panels' width),
/// the range the whole recording on step boundaries.
pub fn time_range(first: i64, last: i64, scrape_interval_ms: i64) -> (i64, i64, i64) {
    let scrape = scrape_interval_ms.max(1000);
    let wanted = ((last - first) / MAX_DATA_POINTS).max(scrape);
    // Whole seconds, so that `$__interval` and `$__rate_interval` can be written.
    let step = (wanted + 999) / 1000 * 1000;
    let start = (first + step - 1).div_euclid(step) * step;
    let end = last.div_euclid(step) * step;
    (start, end.max(start), step)
}

/// One query of a panel as sent, its legend, and its result.
pub struct Query {
    pub expr: String,
    pub legend: String,
    pub series: Vec<promql::Series>,
}

/// Every panel's queries evaluated over a recording.
pub struct Evaluation {
    pub store: promql::store::Store,
    pub start: i64,
    pub end: i64,
    pub step: i64,
    /// Per panel, in the dashboard's order.
    pub panels: Vec<Vec<Query>>,
}

/// Evaluates every panel's queries over `recording`, as Grafana would ask Prometheus.
pub fn evaluate(dashboard: &Dashboard, recording: &Recording) -> Result<Evaluation> {
    let store = recording.store()?;
    let (first, last) = store.span().context("the recording holds no sample")?;
    let (start, end, step) = time_range(first, last, recording.scrape_interval_ms);
    let scrape_seconds = (recording.scrape_interval_ms.max(1000) / 1000) as u64;
    let mut panels = Vec::new();
    for panel in &dashboard.panels {
        let mut queries = Vec::new();
        for target in &panel.targets {
            let expr = dashboard.interpolate(&target.expr, (step / 1000) as u64, scrape_seconds);
            let series = promql::query_range(&store, &expr, start, end, step)
                .with_context(|| format!("panel {:?}", panel.title))?;
            queries.push(Query {
                expr,
                legend: target.legend.clone(),
                series,
            });
        }
        panels.push(queries);
    }
    Ok(Evaluation {
        store,
        start,
        end,
        step,
        panels,
    })
}

/// Draws the dashboard with the evaluated lines.
pub fn draw(dashboard: &Dashboard, evaluation: &Evaluation, note: &str) -> String {
    let lines: Vec<Vec<Line>> = evaluation
        .panels
        .iter()
        .map(|queries| {
            queries
                .iter()
                .flat_map(|q| {
                    q.series.iter().map(|series| Line {
                        name: legend_name(&q.legend, &series.labels, &q.expr),
                        points: series.points.clone(),
                    })
                })
                .collect()
        })
        .collect();
    svg::render(&Picture {
        dashboard,
        lines: &lines,
        start: evaluation.start,
        end: evaluation.end,
        step: evaluation.step,
        note,
    })
}

impl Evaluation {
    /// The samples (a staleness marker as `null`), every query with its range, and
    /// every result (NaN and infinities as strings), to check the picture's numbers
    /// against another PromQL engine.
    pub fn to_json(&self) -> serde_json::Value {
        let number = |v: f64| {
            if v.is_finite() {
                serde_json::json!(v)
            } else {
                serde_json::json!(v.to_string())
            }
        };
        let series: Vec<_> = self
            .store
            .series()
            .map(|(labels, points)| {
                let points: Vec<_> = points
                    .iter()
                    .map(|p| serde_json::json!({"t": p.t, "v": p.value}))
                    .collect();
                serde_json::json!({"labels": labels, "points": points})
            })
            .collect();
        let queries: Vec<_> = self.panels.iter().flatten().collect();
        serde_json::json!({
            "series": series,
            "queries": queries
                .iter()
                .map(|q| serde_json::json!({"expr": q.expr, "start": self.start, "end": self.end, "step": self.step}))
                .collect::<Vec<_>>(),
            "results": queries
                .iter()
                .map(|q| serde_json::json!({
                    "expr": q.expr,
                    "series": q.series.iter().map(|s| serde_json::json!({
                        "labels": s.labels,
                        "points": s.points.iter().map(|(t, v)| serde_json::json!([t, number(*v)])).collect::<Vec<_>>(),
                    })).collect::<Vec<_>>(),
                }))
                .collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dashboard::recording::Scrape;

    fn dashboard() -> Dashboard {
        Dashboard::parse(include_str!("../../../charts/muster/dashboards/muster.json")).unwrap()
    }

    #[test]
    fn every_query_of_the_dashboard_is_in_the_evaluator_s_subset() {
        let dashboard = dashboard();
        let store = promql::store::Store::default();
        for panel in &dashboard.panels {
            for target in &panel.targets {
                let expr = dashboard.interpolate(&target.expr, 5, 5);
                promql::query_range(&store, &expr, 0, 0, 5_000).unwrap_or_else(|e| panic!("{}: {e}", panel.title));
            }
        }
    }

    #[test]
    fn the_range_covers_the_recording_on_step_boundaries() {
        assert_eq!(time_range(1_200, 61_300, 5_000), (5_000, 60_000, 5_000));
        // Ten hours at 5 s: one point per 47 s or so, whole seconds.
        let (_, _, step) = time_range(0, 36_000_000, 5_000);
        assert_eq!(step, 47_000);
    }

    #[test]
    fn the_picture_shows_the_recorded_values() {
        let page = |waiting: u32, reservations: u32| {
            format!(
                "muster_leader 1\n\
                 muster_pending_gangs{{namespace=\"research\",reason=\"Unschedulable\"}} {waiting}\n\
                 muster_reservations_total {reservations}\n# EOF\n"
            )
        };
        let recording = Recording {
            scrape_interval_ms: 5_000,
            scrapes: (0..=24)
                .map(|i| Scrape {
                    at_ms: 1_000_000 + i * 5_000,
                    page: Some(page(if i < 12 { 2 } else { 7 }, 3 * i as u32)),
                })
                .collect(),
        };
        let dashboard = dashboard();
        let evaluation = evaluate(&dashboard, &recording).unwrap();
        let svg = draw(&dashboard, &evaluation, "a note");
        // "Gangs waiting" ends at 7, "Leader" at 1; the queue depth line is named by
        // its namespace; panels without data say so.
        assert!(svg.contains(">7</text>"), "{svg}");
        assert!(svg.contains(">1</text>"));
        assert!(svg.contains(">research</text>"));
        assert!(svg.contains(">Unschedulable</text>"));
        assert!(svg.contains("No data"));
        assert!(svg.contains("a note"));
    }
}
