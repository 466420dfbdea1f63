//! The evaluator against values worked out by hand from Prometheus's definitions.

use super::*;
use crate::dashboard::exposition;

const S: i64 = 1000;

/// A store of scrapes every 10 s from 0 to `until` seconds, each page written by `page`
/// for the scrape's second.
fn scraped(until: i64, page: impl Fn(i64) -> String) -> Store {
    let mut store = Store::default();
    for second in (0..=until).step_by(10) {
        let samples = exposition::parse(&page(second)).unwrap();
        store.append_scrape(second * S, Some(&samples));
    }
    store
}

fn vector(store: &Store, q: &str, t: i64) -> Vec<(Labels, f64)> {
    match query(store, q, t).unwrap() {
        Value::Vector(v) => v,
        Value::Scalar(s) => panic!("{q} gave the scalar {s}"),
    }
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

fn assert_values(got: &[(Labels, f64)], expected: &[(Labels, f64)]) {
    let mut got = got.to_vec();
    got.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(got.len(), expected.len(), "{got:?} against {expected:?}");
    for ((gl, gv), (el, ev)) in got.iter().zip(expected) {
        assert_eq!(gl, el);
        assert!(
            close(*gv, *ev) || (gv.is_nan() && ev.is_nan()),
            "{gl:?}: {gv} against {ev}"
        );
    }
}

fn gauges(_: i64) -> String {
    "g{ns=\"a\"} 1\ng{ns=\"b\"} 2\ng{ns=\"c\",extra=\"x\"} 3\n".into()
}

#[test]
fn matchers_select_by_equality_regex_and_negated_regex() {
    let store = scraped(0, gauges);
    let names = |q: &str| {
        let mut ns: Vec<String> = vector(&store, q, 0).into_iter().map(|(l, _)| l["ns"].clone()).collect();
        ns.sort();
        ns
    };
    assert_eq!(names("g{ns=\"a\"}"), ["a"]);
    assert_eq!(names("g{ns=~\"a|b\"}"), ["a", "b"]);
    assert_eq!(names("g{ns=~\".*\"}"), ["a", "b", "c"]);
    // Anchored: "a" does not match "ab"-like partial values, and !~ excludes.
    assert_eq!(names("g{ns=~\"\"}"), Vec::<String>::new());
    assert_eq!(names("g{ns!~\"a\"}"), ["b", "c"]);
    // A label a series lacks is the empty string.
    assert_eq!(names("g{extra=\"\"}"), ["a", "b"]);
    assert_eq!(names("g{ns!=\"a\"}"), ["b", "c"]);
    // The metric name is kept by a selector.
    assert_eq!(vector(&store, "g{ns=\"a\"}", 0)[0].0[NAME], "g");
}

#[test]
fn a_sample_is_seen_for_five_minutes_unless_a_staleness_marker_ends_it() {
    let mut store = Store::default();
    let page = exposition::parse("up 1\ngone 1\n").unwrap();
    store.append_scrape(0, Some(&page));
    // Within the lookback, the last sample holds; at exactly 5 minutes it is out
    // (the window is open at its start).
    assert_eq!(vector(&store, "up", 4 * 60 * S).len(), 1);
    assert_eq!(vector(&store, "up", 5 * 60 * S - 1).len(), 1);
    assert_eq!(vector(&store, "up", 5 * 60 * S).len(), 0);
    // Before the first sample there is nothing.
    assert_eq!(vector(&store, "up", -1).len(), 0);
    // A series missing from the next scrape ends there.
    store.append_scrape(10 * S, Some(&exposition::parse("up 1\n").unwrap()));
    assert_eq!(vector(&store, "gone", 10 * S - 1).len(), 1);
    assert_eq!(vector(&store, "gone", 10 * S).len(), 0);
    assert_eq!(vector(&store, "up", 10 * S).len(), 1);
}

/// A counter `c` that grows by 10 per 10 s scrape from 0, and `r`, which is reset
/// after its fourth scrape: 0, 10, 20, 30, 5, 15, 25.
fn counters(second: i64) -> String {
    let reset = [0, 10, 20, 30, 5, 15, 25][(second / 10) as usize];
    format!("c_total{{ns=\"a\"}} {second}\nr_total {reset}\n")
}

#[test]
fn rate_and_increase_extrapolate_to_the_window() {
    let store = scraped(60, counters);
    // (30 s, 60 s] holds 40, 50, 60: +20 over 20 s sampled; the first sample is 10 s
    // (less than 1.1 intervals) after the start, so the increase covers 30 s: 30.
    assert_values(
        &vector(&store, "increase(c_total[30s])", 60 * S),
        &[(labels(&[("ns", "a")]), 30.0)],
    );
    assert_values(
        &vector(&store, "rate(c_total[30s])", 60 * S),
        &[(labels(&[("ns", "a")]), 1.0)],
    );
    // The sample at the window's start is not in it: at 59 s, (29 s, 59 s] holds 30,
    // 40, 50: +20 over 20 s, 1 s to the start, 9 s to the end (both under 11 s):
    // 20 x 30 / 20.
    assert_values(
        &vector(&store, "increase(c_total[30s])", 59 * S),
        &[(labels(&[("ns", "a")]), 30.0)],
    );
    // One sample is not enough.
    assert!(vector(&store, "rate(c_total[10s])", 60 * S).is_empty());
}

#[test]
fn a_counter_reset_is_counted_and_extrapolation_stops_at_zero() {
    let store = scraped(60, counters);
    // (0, 60 s] holds 10, 20, 30, 5, 15, 25: 25 - 10 + 30 (the reset) = 45 over 50 s
    // sampled; 10 s to the start (under 11 s, and the zero point is 50 x 10 / 45 =
    // 11.1 s away, further), 0 s to the end: 45 x 60 / 50 = 54.
    assert_values(
        &vector(&store, "increase(r_total[1m])", 60 * S),
        &[(Labels::new(), 54.0)],
    );
    // (20 s, 50 s] holds 30, 5, 15: 15 - 30 + 30 = 15 over 20 s; 10 s to the start, and
    // the zero point 20 x 30 / 15 = 40 s away: 15 x 30 / 20 = 22.5.
    assert_values(
        &vector(&store, "increase(r_total[30s])", 50 * S),
        &[(Labels::new(), 22.5)],
    );
    // A counter first seen inside the window, at 40 s with 2, then 12, 22: the zero
    // point is 2 s before it, nearer than half an interval (5 s): 20 x 22 / 20 = 22.
    let mut store = Store::default();
    store.append_scrape(30 * S, Some(&[]));
    for (second, v) in [(40, 2.0), (50, 12.0), (60, 22.0)] {
        store.append_scrape(second * S, Some(&[(labels(&[(NAME, "n_total")]), v)]));
    }
    assert_values(
        &vector(&store, "increase(n_total[1m])", 60 * S),
        &[(Labels::new(), 22.0)],
    );
}

#[test]
fn aggregations_group_by_the_labels_named() {
    let store = scraped(60, |second| {
        format!(
            "c_total{{ns=\"a\",pod=\"1\"}} {}\nc_total{{ns=\"a\",pod=\"2\"}} {}\nc_total{{ns=\"b\",pod=\"3\"}} {}\n",
            second,
            2 * second,
            3 * second
        )
    });
    let at = 60 * S;
    assert_values(
        &vector(&store, "sum by (ns) (rate(c_total[30s]))", at),
        &[(labels(&[("ns", "a")]), 3.0), (labels(&[("ns", "b")]), 3.0)],
    );
    assert_values(
        &vector(&store, "max by (ns) (rate(c_total[30s]))", at),
        &[(labels(&[("ns", "a")]), 2.0), (labels(&[("ns", "b")]), 3.0)],
    );
    assert_values(&vector(&store, "sum(rate(c_total[30s]))", at), &[(Labels::new(), 6.0)]);
    assert_values(&vector(&store, "min(c_total)", at), &[(Labels::new(), 60.0)]);
    assert_values(&vector(&store, "avg(c_total)", at), &[(Labels::new(), 120.0)]);
    assert_values(&vector(&store, "count(c_total)", at), &[(Labels::new(), 3.0)]);
    // `without` drops the named labels and the metric name.
    assert_values(
        &vector(&store, "sum without (pod) (c_total)", at),
        &[(labels(&[("ns", "a")]), 180.0), (labels(&[("ns", "b")]), 180.0)],
    );
    // Grouping by a label no series has gives one group without it.
    assert_values(
        &vector(&store, "sum by (nope) (c_total)", at),
        &[(Labels::new(), 360.0)],
    );
    // Aggregating nothing gives nothing.
    assert!(vector(&store, "sum(missing)", at).is_empty());
}

#[test]
fn max_passes_over_nan_unless_every_value_is_nan() {
    assert_eq!(fold("max", &[f64::NAN, 1.0, 3.0, 2.0]), 3.0);
    assert_eq!(fold("min", &[2.0, f64::NAN, 1.0]), 1.0);
    assert!(fold("max", &[f64::NAN, f64::NAN]).is_nan());
}

/// A histogram of buckets 1, 2 and +Inf per priority class; per 10 s class x observes
/// one value up to 1, two in (1, 2] and one above; class y one in (1, 2] and three above.
fn histograms(second: i64) -> String {
    let n = second / 10;
    let mut page = String::new();
    for (class, per_scrape) in [("x", [1, 3, 4]), ("y", [0, 1, 4])] {
        for (le, count) in ["1", "2", "+Inf"].iter().zip(per_scrape) {
            page.push_str(&format!("h_bucket{{class=\"{class}\",le=\"{le}\"}} {}\n", n * count));
        }
    }
    page
}

#[test]
fn histogram_quantile_of_summed_bucket_rates() {
    let store = scraped(60, histograms);
    let at = 60 * S;
    // By class: x has rates 0.1, 0.3, 0.4 per second; the median's rank 0.2 falls in
    // (1, 2], which holds 0.2: 1 + 1 x (0.2 - 0.1) / 0.2 = 1.5. y has 0, 0.1, 0.4: the
    // rank 0.2 is past the 2 bucket, in +Inf: the highest finite bound, 2.
    assert_values(
        &vector(
            &store,
            "histogram_quantile(0.5, sum by (le, class) (rate(h_bucket[30s])))",
            at,
        ),
        &[(labels(&[("class", "x")]), 1.5), (labels(&[("class", "y")]), 2.0)],
    );
    // Summed over classes: 0.1, 0.4, 0.8; p25's rank 0.2 in (1, 2] holding 0.3:
    // 1 + (0.2 - 0.1) / 0.3.
    assert_values(
        &vector(
            &store,
            "histogram_quantile(0.25, sum by (le) (rate(h_bucket[30s])))",
            at,
        ),
        &[(Labels::new(), 1.0 + 0.1 / 0.3)],
    );
    // p5: rank 0.04 in the first bucket, from 0: 1 x 0.04 / 0.1.
    assert_values(
        &vector(
            &store,
            "histogram_quantile(0.05, sum by (le) (rate(h_bucket[30s])))",
            at,
        ),
        &[(Labels::new(), 0.4)],
    );
    // Without observations in the window the quantile is NaN.
    let idle = scraped(60, |_| "h_bucket{le=\"1\"} 5\nh_bucket{le=\"+Inf\"} 5\n".into());
    let result = vector(&idle, "histogram_quantile(0.5, rate(h_bucket[30s]))", at);
    assert_eq!(result.len(), 1);
    assert!(result[0].1.is_nan());
}

#[test]
fn arithmetic_and_comparisons_with_scalars() {
    let store = scraped(0, gauges);
    match query(&store, "1 + 2 * 3 ^ 2", 0).unwrap() {
        Value::Scalar(v) => assert_eq!(v, 19.0),
        other => panic!("{other:?}"),
    }
    // Arithmetic drops the metric name.
    assert_values(&vector(&store, "g{ns=\"b\"} * 2", 0), &[(labels(&[("ns", "b")]), 4.0)]);
    assert_values(&vector(&store, "10 - g{ns=\"b\"}", 0), &[(labels(&[("ns", "b")]), 8.0)]);
    assert_values(&vector(&store, "-g{ns=\"b\"}", 0), &[(labels(&[("ns", "b")]), -2.0)]);
    // A comparison filters and keeps the vector's values and name, on either side.
    let kept = vector(&store, "g > 1", 0);
    assert_eq!(kept.len(), 2);
    assert!(kept.iter().all(|(l, v)| l[NAME] == "g" && *v > 1.0));
    assert_values(&vector(&store, "2 < sum(g)", 0), &[(Labels::new(), 6.0)]);
    // With bool it answers 0 or 1 for each.
    assert_values(
        &vector(&store, "g{ns=~\"a|b\"} >= bool 2", 0),
        &[(labels(&[("ns", "a")]), 0.0), (labels(&[("ns", "b")]), 1.0)],
    );
}

#[test]
fn anything_else_is_refused_by_name() {
    let store = scraped(0, gauges);
    for (q, what) in [
        ("topk(1, g)", "topk"),
        ("g and g", "and"),
        ("irate(g[1m])", "irate"),
        ("g{ns=\"a\"} + g{ns=\"b\"}", "two vectors"),
        ("g @ 10", "@"),
        ("rate(g[1m:10s])", "rate of anything but a range selector"),
    ] {
        match query(&store, q, 0) {
            Err(EvalError::Unsupported(message)) => assert!(message.contains(what), "{q}: {message}"),
            other => panic!("{q}: {other:?}"),
        }
    }
    assert!(matches!(query(&store, "sum(", 0), Err(EvalError::Parse { .. })));
}

#[test]
fn a_range_query_steps_through_time_and_refuses_duplicate_series() {
    let store = scraped(30, |second| {
        let mut page = "g 1\n".to_string();
        if second >= 20 {
            page.push_str("late 5\n");
        }
        page
    });
    let series = query_range(&store, "g", 0, 30 * S, 10 * S).unwrap();
    assert_eq!(series.len(), 1);
    assert_eq!(
        series[0].points,
        vec![(0, 1.0), (10 * S, 1.0), (20 * S, 1.0), (30 * S, 1.0)]
    );
    let series = query_range(&store, "late", 0, 30 * S, 10 * S).unwrap();
    assert_eq!(series[0].points, vec![(20 * S, 5.0), (30 * S, 5.0)]);
    // Two metrics that differ only by name collide once arithmetic drops it.
    let error = query_range(&store, "{__name__=~\"g|late\"} * 2", 20 * S, 30 * S, 10 * S).unwrap_err();
    assert!(error.to_string().contains("two series"), "{error}");
}
