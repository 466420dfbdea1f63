//! The arithmetic of the functions the dashboard calls, as Prometheus computes it:
//! `rate`/`increase` with counter resets and extrapolation to the window's edges,
//! `histogram_quantile` over classic buckets, and compensated summation for `sum`.

/// `rate` (per second, `per_second`) or `increase` of a counter over the window
/// `(end - range, end]` (milliseconds), from the float samples in it. `None` with fewer
/// than two samples: Prometheus returns nothing then.
///
/// A drop in value is a counter reset: the value before it is added back. The result
/// is extrapolated from the first and last sample towards the window's edges, all the
/// way if a sample sits within 1.1 average intervals of the edge, else by half an
/// average interval (the series starts or ends inside the window). It is never
/// extrapolated below zero at the start.
pub fn extrapolated_rate(points: &[(i64, f64)], end: i64, range: i64, per_second: bool) -> Option<f64> {
    let (&(first_t, first_v), &(last_t, last_v)) = (points.first()?, points.last()?);
    if points.len() < 2 {
        return None;
    }
    let mut result = last_v - first_v;
    for pair in points.windows(2) {
        if pair[1].1 < pair[0].1 {
            result += pair[0].1;
        }
    }
    let start = end - range;
    let mut to_start = (first_t - start) as f64 / 1000.0;
    let mut to_end = (end - last_t) as f64 / 1000.0;
    let sampled = (last_t - first_t) as f64 / 1000.0;
    let average = sampled / (points.len() - 1) as f64;
    let threshold = average * 1.1;
    if to_start >= threshold {
        to_start = average / 2.0;
    }
    // The counter's zero point, if it is nearer than the start: no negative counts.
    let mut to_zero = to_start;
    if result > 0.0 && first_v >= 0.0 {
        to_zero = sampled * (first_v / result);
    }
    if to_zero < to_start {
        to_start = to_zero;
    }
    if to_end >= threshold {
        to_end = average / 2.0;
    }
    let mut factor = if sampled != 0.0 {
        (sampled + to_start + to_end) / sampled
    } else {
        1.0
    };
    if per_second {
        factor /= range as f64 / 1000.0;
    }
    Some(result * factor)
}

/// Relative differences between adjacent buckets below this are float noise.
const SMALL_DELTA_TOLERANCE: f64 = 1e-12;

/// The `q` quantile of classic histogram buckets `(upper bound, cumulative count)`, in
/// any order, by linear interpolation within the bucket the rank falls into.
///
/// As Prometheus: NaN for a NaN `q`, -Inf below 0, +Inf above 1; NaN without a `+Inf`
/// bucket, with fewer than two buckets or no observations; the upper bound of the
/// highest finite bucket if the rank falls into `+Inf`; the first bucket starts at 0
/// (or is returned whole if its upper bound is not positive). Buckets of the same
/// bound are added; counts that decrease are raised to stay monotonic.
pub fn bucket_quantile(q: f64, buckets: &mut Vec<(f64, f64)>) -> f64 {
    if q.is_nan() {
        return f64::NAN;
    }
    if q < 0.0 {
        return f64::NEG_INFINITY;
    }
    if q > 1.0 {
        return f64::INFINITY;
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    if buckets.last().is_none_or(|b| b.0 != f64::INFINITY) {
        return f64::NAN;
    }
    buckets.dedup_by(|later, earlier| {
        let same = later.0 == earlier.0;
        if same {
            earlier.1 += later.1;
        }
        same
    });
    ensure_monotonic(buckets);
    if buckets.len() < 2 {
        return f64::NAN;
    }
    let observations = buckets[buckets.len() - 1].1;
    if observations == 0.0 {
        return f64::NAN;
    }
    let mut rank = q * observations;
    // The first bucket (the last excluded, as Go's sort.Search over len-1) whose
    // count reaches the rank.
    let b = buckets[..buckets.len() - 1].partition_point(|bucket| bucket.1 < rank);
    if b == buckets.len() - 1 {
        return buckets[buckets.len() - 2].0;
    }
    if b == 0 && buckets[0].0 <= 0.0 {
        return buckets[0].0;
    }
    let bucket_end = buckets[b].0;
    let mut count = buckets[b].1;
    let mut bucket_start = 0.0;
    if b > 0 {
        bucket_start = buckets[b - 1].0;
        count -= buckets[b - 1].1;
        rank -= buckets[b - 1].1;
    }
    bucket_start + (bucket_end - bucket_start) * (rank / count)
}

/// Ignores numerically insignificant differences between adjacent buckets, then
/// removes every decrease, as Prometheus does before searching the buckets.
fn ensure_monotonic(buckets: &mut [(f64, f64)]) {
    let Some(first) = buckets.first() else {
        return;
    };
    let mut previous = first.1;
    for bucket in buckets.iter_mut().skip(1) {
        let current = bucket.1;
        if current == previous {
            continue;
        }
        if almost_equal(previous, current, SMALL_DELTA_TOLERANCE) || current < previous {
            bucket.1 = previous;
            continue;
        }
        previous = current;
    }
}

/// Whether `a` and `b` differ by less than their sum times `epsilon` (Prometheus's
/// `almost.Equal`, with NaN equal to NaN).
fn almost_equal(a: f64, b: f64, epsilon: f64) -> bool {
    if a.is_nan() && b.is_nan() {
        return true;
    }
    if a == b {
        return true;
    }
    let min_normal = f64::MIN_POSITIVE;
    let sum = a.abs() + b.abs();
    let difference = (a - b).abs();
    if a == 0.0 || b == 0.0 || sum < min_normal {
        return difference < epsilon * min_normal;
    }
    difference / sum.min(f64::MAX) < epsilon
}

/// A sum with Neumaier's compensation, as Prometheus's `sum` and `avg` keep it.
#[derive(Clone, Copy, Default)]
pub struct KahanSum {
    sum: f64,
    compensation: f64,
}

impl KahanSum {
    pub fn add(&mut self, increment: f64) {
        let total = self.sum + increment;
        if total.is_infinite() {
            self.compensation = 0.0;
        } else if self.sum.abs() >= increment.abs() {
            self.compensation += (self.sum - total) + increment;
        } else {
            self.compensation += (increment - total) + self.sum;
        }
        self.sum = total;
    }

    pub fn value(self) -> f64 {
        self.sum + self.compensation
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn rate_over_a_window_the_samples_cover_is_extrapolated_to_its_edges() {
        // Every 10 s, +10 per sample, from 100 at t=10s to 150 at t=60s; window (0, 60].
        let points: Vec<_> = (1..=6).map(|i| (i * 10_000, 90.0 + 10.0 * i as f64)).collect();
        // 50 over 50 s sampled; the first sample is 10 s (<= 1.1 x 10 s) after the
        // start: extrapolated over 60 s, 60 in all, 1 per second.
        let increase = extrapolated_rate(&points, 60_000, 60_000, false).unwrap();
        assert!(close(increase, 60.0), "{increase}");
        let rate = extrapolated_rate(&points, 60_000, 60_000, true).unwrap();
        assert!(close(rate, 1.0), "{rate}");
    }

    #[test]
    fn a_counter_reset_adds_the_value_before_it() {
        // 10, 20, 5 (a reset: the 20 before it is added), 15: (15 - 10) + 20 = 25 over
        // the 30 s sampled, in the window (-1 ms, 30 s]: the first sample is 1 ms after
        // the window's start, the last at its end, so 0.001 s is added to 30 s.
        let points = [(0, 10.0), (10_000, 20.0), (20_000, 5.0), (30_000, 15.0)];
        let increase = extrapolated_rate(&points, 30_000, 30_001, false).unwrap();
        assert!(close(increase, 25.0 * 30.001 / 30.0), "{increase}");
    }

    #[test]
    fn a_series_that_starts_inside_the_window_is_extrapolated_by_half_an_interval() {
        // Samples at 40, 50, 60 s (values 100, 110, 120) in the window (0, 60]: the
        // first is 40 s from the start, past 1.1 x 10 s, so only 5 s are added there;
        // but the zero point (100 / 20 x 20 s = 100 s away) is further, so 5 s it is.
        let points = [(40_000, 100.0), (50_000, 110.0), (60_000, 120.0)];
        let increase = extrapolated_rate(&points, 60_000, 60_000, false).unwrap();
        assert!(close(increase, 20.0 * 25.0 / 20.0), "{increase}");
        // A counter that starts at 0 inside the window is not extrapolated below zero:
        // from 2 at 40 s to 22 at 60 s the zero point is 2 s before the first sample.
        let points = [(40_000, 2.0), (50_000, 12.0), (60_000, 22.0)];
        let increase = extrapolated_rate(&points, 60_000, 60_000, false).unwrap();
        assert!(close(increase, 20.0 * 22.0 / 20.0), "{increase}");
    }

    #[test]
    fn a_series_that_ends_inside_the_window_is_extrapolated_by_half_an_interval() {
        // 10, 20, 30 at 10, 20, 30 s in the window (0, 60]: 10 s to the start (under
        // 11 s; the zero point is as far), 30 s to the end, past 11 s, so 5 s there:
        // 20 x (20 + 10 + 5) / 20.
        let points = [(10_000, 10.0), (20_000, 20.0), (30_000, 30.0)];
        let increase = extrapolated_rate(&points, 60_000, 60_000, false).unwrap();
        assert!(close(increase, 35.0), "{increase}");
    }

    #[test]
    fn rate_needs_two_samples() {
        assert_eq!(extrapolated_rate(&[(1_000, 5.0)], 60_000, 60_000, true), None);
        assert_eq!(extrapolated_rate(&[], 60_000, 60_000, true), None);
    }

    #[test]
    fn quantile_interpolates_within_the_bucket_of_the_rank() {
        // 10 observations: 4 at most 1, 8 at most 2, 10 at most 4.
        let mut buckets = vec![(1.0, 4.0), (2.0, 8.0), (4.0, 10.0), (f64::INFINITY, 10.0)];
        // Median: rank 5, in (1, 2] which holds 4: 1 + 1 x (1 / 4).
        assert!(close(bucket_quantile(0.5, &mut buckets.clone()), 1.25));
        // p90: rank 9, in (2, 4] which holds 2: 2 + 2 x (1 / 2).
        assert!(close(bucket_quantile(0.9, &mut buckets.clone()), 3.0));
        // p20: rank 2, in the first bucket, which starts at 0: 1 x 2 / 4.
        assert!(close(bucket_quantile(0.2, &mut buckets), 0.5));
    }

    #[test]
    fn quantile_edge_cases_are_prometheus_s() {
        let buckets = vec![(1.0, 1.0), (2.0, 2.0), (f64::INFINITY, 4.0)];
        // Rank 3.6 falls into +Inf: the highest finite bound.
        assert_eq!(bucket_quantile(0.9, &mut buckets.clone()), 2.0);
        assert!(bucket_quantile(f64::NAN, &mut buckets.clone()).is_nan());
        assert_eq!(bucket_quantile(-0.1, &mut buckets.clone()), f64::NEG_INFINITY);
        assert_eq!(bucket_quantile(1.1, &mut buckets.clone()), f64::INFINITY);
        // No +Inf bucket, one bucket, or no observations: NaN.
        assert!(bucket_quantile(0.5, &mut vec![(1.0, 1.0), (2.0, 2.0)]).is_nan());
        assert!(bucket_quantile(0.5, &mut vec![(f64::INFINITY, 2.0)]).is_nan());
        assert!(bucket_quantile(0.5, &mut vec![(1.0, 0.0), (f64::INFINITY, 0.0)]).is_nan());
        // A first bucket with a bound at or below zero is returned as it is.
        assert_eq!(
            bucket_quantile(0.1, &mut vec![(-1.0, 5.0), (f64::INFINITY, 10.0)]),
            -1.0
        );
        // Unsorted, duplicated and non-monotonic buckets are repaired: (1, 4), (2, 4)
        // (was 3), (+Inf, 8).
        let mut messy = vec![(f64::INFINITY, 8.0), (2.0, 3.0), (1.0, 2.0), (1.0, 2.0)];
        // Rank 0.5 x 8 = 4 is reached by the first bucket: its upper bound.
        assert_eq!(bucket_quantile(0.5, &mut messy), 1.0);
        // Quantile 0 is the first bucket's lower end, 0.
        let mut buckets = vec![(1.0, 2.0), (2.0, 3.0), (f64::INFINITY, 3.0)];
        assert_eq!(bucket_quantile(0.0, &mut buckets), 0.0);
        // An empty first bucket that the rank 0 reaches divides 0 by 0, as in Prometheus.
        let mut buckets = vec![(1.0, 0.0), (2.0, 3.0), (f64::INFINITY, 3.0)];
        assert!(bucket_quantile(0.0, &mut buckets).is_nan());
    }

    #[test]
    fn compensated_sum_keeps_small_terms() {
        let mut sum = KahanSum::default();
        for term in [1e16, 1.0, -1e16] {
            sum.add(term);
        }
        assert_eq!(sum.value(), 1.0);
    }
}
