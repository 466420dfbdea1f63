//! A PromQL evaluator for the part of the language muster's dashboard uses, over scraped
//! samples, with Prometheus's semantics: vector selectors with label matchers (a
//! five-minute lookback, staleness markers ending a series at once), `rate` and
//! `increase` over range selectors, `sum`/`min`/`max`/`avg`/`count` with `by` or
//! `without`, `histogram_quantile` over classic buckets, and arithmetic and comparisons
//! with scalars. Anything else is refused by name rather than evaluated wrongly.
//! Expressions are parsed by `promql-parser`.

pub mod functions;
pub mod store;

use std::collections::BTreeMap;

use promql_parser::label::Matchers;
use promql_parser::parser::{self, AggregateExpr, BinaryExpr, Call, Expr, LabelModifier, Offset, VectorSelector};

use self::functions::{KahanSum, bucket_quantile, extrapolated_rate};
use self::store::Store;

/// A series' labels, the metric name under [`NAME`].
pub type Labels = BTreeMap<String, String>;

pub const NAME: &str = "__name__";
const BUCKET: &str = "le";

/// How far back an instant selector looks for a series' latest sample.
pub const LOOKBACK_MS: i64 = 5 * 60 * 1000;

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("{query:?} is not PromQL: {reason}")]
    Parse { query: String, reason: String },
    #[error("{0} is not supported by this evaluator")]
    Unsupported(String),
    #[error("{0}")]
    Invalid(String),
}

/// One series of a range query's result: its labels and a value per step that has one.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub labels: Labels,
    pub points: Vec<(i64, f64)>,
}

/// An instant vector: one value per label set.
pub type Vector = Vec<(Labels, f64)>;

#[derive(Debug)]
pub enum Value {
    Scalar(f64),
    Vector(Vector),
}

/// Evaluates `query` at `start`, `start + step`, ... up to `end` (milliseconds), as
/// Prometheus's range query API does.
pub fn query_range(store: &Store, query: &str, start: i64, end: i64, step: i64) -> Result<Vec<Series>, EvalError> {
    if step <= 0 {
        return Err(EvalError::Invalid(format!("step {step} ms is not positive")));
    }
    let expr = parse(query)?;
    let mut series: BTreeMap<Labels, Vec<(i64, f64)>> = BTreeMap::new();
    let mut t = start;
    while t <= end {
        match eval(store, &expr, t)? {
            Value::Scalar(v) => series.entry(Labels::new()).or_default().push((t, v)),
            Value::Vector(vector) => {
                for (labels, v) in vector {
                    let points = series.entry(labels.clone()).or_default();
                    // Prometheus refuses a result with one label set twice.
                    if points.last().is_some_and(|(at, _)| *at == t) {
                        return Err(EvalError::Invalid(format!(
                            "{query:?} yields two series with the labels {labels:?}"
                        )));
                    }
                    points.push((t, v));
                }
            }
        }
        t += step;
    }
    Ok(series
        .into_iter()
        .map(|(labels, points)| Series { labels, points })
        .collect())
}

/// Evaluates `query` at `t` (milliseconds).
pub fn query(store: &Store, query: &str, t: i64) -> Result<Value, EvalError> {
    eval(store, &parse(query)?, t)
}

fn parse(query: &str) -> Result<Expr, EvalError> {
    parser::parse(query).map_err(|reason| EvalError::Parse {
        query: query.to_string(),
        reason,
    })
}

fn eval(store: &Store, expr: &Expr, t: i64) -> Result<Value, EvalError> {
    match expr {
        Expr::NumberLiteral(number) => Ok(Value::Scalar(number.val)),
        Expr::Paren(paren) => eval(store, &paren.expr, t),
        Expr::Unary(unary) => Ok(match eval(store, &unary.expr, t)? {
            Value::Scalar(v) => Value::Scalar(-v),
            Value::Vector(vector) => Value::Vector(
                vector
                    .into_iter()
                    .map(|(labels, v)| (without_name(labels), -v))
                    .collect(),
            ),
        }),
        Expr::VectorSelector(selector) => Ok(Value::Vector(instant_selector(store, selector, t)?)),
        Expr::Call(call) => call_function(store, call, t).map(Value::Vector),
        Expr::Aggregate(aggregate) => aggregate_vector(store, aggregate, t).map(Value::Vector),
        Expr::Binary(binary) => binary_op(store, binary, t),
        Expr::MatrixSelector(_) => Err(EvalError::Invalid(
            "a range selector outside rate() or increase()".into(),
        )),
        Expr::StringLiteral(_) => Err(EvalError::Unsupported("a string literal".into())),
        Expr::Subquery(_) => Err(EvalError::Unsupported("a subquery".into())),
        Expr::Extension(_) => Err(EvalError::Unsupported("an extension expression".into())),
    }
}

fn eval_vector(store: &Store, expr: &Expr, t: i64) -> Result<Vector, EvalError> {
    match eval(store, expr, t)? {
        Value::Vector(vector) => Ok(vector),
        Value::Scalar(_) => Err(EvalError::Invalid(format!("{expr} is a scalar, a vector was expected"))),
    }
}

fn eval_scalar(store: &Store, expr: &Expr, t: i64) -> Result<f64, EvalError> {
    match eval(store, expr, t)? {
        Value::Scalar(v) => Ok(v),
        Value::Vector(_) => Err(EvalError::Invalid(format!("{expr} is a vector, a scalar was expected"))),
    }
}

/// The time a selector reads at: `t` less its offset; `@` is not supported.
fn selector_time(selector: &VectorSelector, t: i64) -> Result<i64, EvalError> {
    if selector.at.is_some() {
        return Err(EvalError::Unsupported("the @ modifier".into()));
    }
    Ok(match &selector.offset {
        None => t,
        Some(Offset::Pos(d)) => t - d.as_millis() as i64,
        Some(Offset::Neg(d)) => t + d.as_millis() as i64,
    })
}

fn matches(selector: &VectorSelector, labels: &Labels) -> Result<bool, EvalError> {
    let Matchers { matchers, or_matchers } = &selector.matchers;
    if !or_matchers.is_empty() {
        return Err(EvalError::Unsupported("'or' within a label selector".into()));
    }
    if let Some(name) = &selector.name
        && labels.get(NAME) != Some(name)
    {
        return Ok(false);
    }
    // A label a series lacks matches as the empty string; regular expressions are
    // anchored at both ends by the parser.
    Ok(matchers
        .iter()
        .all(|m| m.is_match(labels.get(&m.name).map_or("", String::as_str))))
}

/// Each matching series' latest sample in `(t - 5m, t]`, unless that sample is a
/// staleness marker.
fn instant_selector(store: &Store, selector: &VectorSelector, t: i64) -> Result<Vector, EvalError> {
    let at = selector_time(selector, t)?;
    let mut out = Vec::new();
    for (labels, points) in store.series() {
        if !matches(selector, labels)? {
            continue;
        }
        let upto = points.partition_point(|p| p.t <= at);
        if let Some(latest) = upto.checked_sub(1).map(|i| points[i])
            && latest.t > at - LOOKBACK_MS
            && let Some(v) = latest.value
        {
            out.push((labels.clone(), v));
        }
    }
    Ok(out)
}

fn call_function(store: &Store, call: &Call, t: i64) -> Result<Vector, EvalError> {
    let args = &call.args.args;
    match call.func.name {
        name @ ("rate" | "increase") => {
            let [arg] = args.as_slice() else {
                return Err(EvalError::Invalid(format!("{name} takes one argument")));
            };
            let Expr::MatrixSelector(matrix) = arg.as_ref() else {
                return Err(EvalError::Unsupported(format!(
                    "{name} of anything but a range selector"
                )));
            };
            let end = selector_time(&matrix.vs, t)?;
            let range = matrix.range.as_millis() as i64;
            let mut out = Vec::new();
            for (labels, points) in store.series() {
                if !matches(&matrix.vs, labels)? {
                    continue;
                }
                // The window is (end - range, end]; staleness markers are not samples.
                let window: Vec<(i64, f64)> = points
                    .iter()
                    .filter(|p| p.t > end - range && p.t <= end)
                    .filter_map(|p| p.value.map(|v| (p.t, v)))
                    .collect();
                if let Some(v) = extrapolated_rate(&window, end, range, name == "rate") {
                    out.push((without_name(labels.clone()), v));
                }
            }
            Ok(out)
        }
        "histogram_quantile" => {
            let [q, buckets] = args.as_slice() else {
                return Err(EvalError::Invalid("histogram_quantile takes two arguments".into()));
            };
            let q = eval_scalar(store, q, t)?;
            // One histogram per label set without `le` (the metric name still tells
            // histograms apart; the result drops it).
            let mut histograms: BTreeMap<Labels, Vec<(f64, f64)>> = BTreeMap::new();
            for (mut labels, count) in eval_vector(store, buckets, t)? {
                // A series without a parsable bound is skipped, as Prometheus does.
                let Some(bound) = labels.remove(BUCKET).and_then(|le| parse_float(&le)) else {
                    continue;
                };
                histograms.entry(labels).or_default().push((bound, count));
            }
            Ok(histograms
                .into_iter()
                .map(|(labels, mut buckets)| (without_name(labels), bucket_quantile(q, &mut buckets)))
                .collect())
        }
        other => Err(EvalError::Unsupported(format!("the function {other}()"))),
    }
}

fn aggregate_vector(store: &Store, aggregate: &AggregateExpr, t: i64) -> Result<Vector, EvalError> {
    let op = aggregate.op.to_string();
    if aggregate.param.is_some() || !matches!(op.as_str(), "sum" | "min" | "max" | "avg" | "count") {
        return Err(EvalError::Unsupported(format!("the aggregation {op}")));
    }
    let mut groups: BTreeMap<Labels, Vec<f64>> = BTreeMap::new();
    for (labels, v) in eval_vector(store, &aggregate.expr, t)? {
        let key = match &aggregate.modifier {
            None => Labels::new(),
            Some(LabelModifier::Include(by)) => labels
                .into_iter()
                .filter(|(name, _)| by.labels.contains(name))
                .collect(),
            Some(LabelModifier::Exclude(without)) => labels
                .into_iter()
                .filter(|(name, _)| name != NAME && !without.labels.contains(name))
                .collect(),
        };
        groups.entry(key).or_default().push(v);
    }
    Ok(groups
        .into_iter()
        .map(|(labels, values)| (labels, fold(&op, &values)))
        .collect())
}

/// One group's aggregate, NaN handled as Prometheus does (`min`/`max` pass over NaN
/// unless every value is NaN).
fn fold(op: &str, values: &[f64]) -> f64 {
    match op {
        "sum" | "avg" => {
            let mut sum = KahanSum::default();
            values.iter().for_each(|v| sum.add(*v));
            if op == "sum" {
                sum.value()
            } else {
                sum.value() / values.len() as f64
            }
        }
        "count" => values.len() as f64,
        _ => values
            .iter()
            .copied()
            .reduce(|kept, v| {
                let better = if op == "max" { kept < v } else { kept > v };
                if better || kept.is_nan() { v } else { kept }
            })
            .unwrap_or(f64::NAN),
    }
}

fn binary_op(store: &Store, binary: &BinaryExpr, t: i64) -> Result<Value, EvalError> {
    let op = binary.op.to_string();
    if binary.op.is_set_operator() || op == "atan2" {
        return Err(EvalError::Unsupported(format!("the operator {op}")));
    }
    let comparison = binary.op.is_comparison_operator();
    let return_bool = binary.return_bool();
    let lhs = eval(store, &binary.lhs, t)?;
    let rhs = eval(store, &binary.rhs, t)?;
    let apply = |l: f64, r: f64| -> Result<f64, EvalError> {
        Ok(match op.as_str() {
            "+" => l + r,
            "-" => l - r,
            "*" => l * r,
            "/" => l / r,
            "%" => l % r,
            "^" => l.powf(r),
            "==" => f64::from(u8::from(l == r)),
            "!=" => f64::from(u8::from(l != r)),
            ">" => f64::from(u8::from(l > r)),
            "<" => f64::from(u8::from(l < r)),
            ">=" => f64::from(u8::from(l >= r)),
            "<=" => f64::from(u8::from(l <= r)),
            other => return Err(EvalError::Unsupported(format!("the operator {other}"))),
        })
    };
    let (vector, scalar, vector_on_left) = match (lhs, rhs) {
        (Value::Scalar(l), Value::Scalar(r)) => return apply(l, r).map(Value::Scalar),
        (Value::Vector(v), Value::Scalar(s)) => (v, s, true),
        (Value::Scalar(s), Value::Vector(v)) => (v, s, false),
        (Value::Vector(_), Value::Vector(_)) => {
            return Err(EvalError::Unsupported(format!("{op} between two vectors")));
        }
    };
    let mut out = Vec::new();
    for (labels, v) in vector {
        let (l, r) = if vector_on_left { (v, scalar) } else { (scalar, v) };
        let result = apply(l, r)?;
        if !comparison || return_bool {
            out.push((without_name(labels), result));
        } else if result == 1.0 {
            // A comparison filters: the vector's own sample is kept as it is.
            out.push((labels, v));
        }
    }
    Ok(Value::Vector(out))
}

/// A number as Prometheus reads sample values and bucket bounds: `+Inf`, `-Inf` and
/// `NaN` included.
pub fn parse_float(text: &str) -> Option<f64> {
    match text {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => text.parse().ok(),
    }
}

fn without_name(mut labels: Labels) -> Labels {
    labels.remove(NAME);
    labels
}

#[cfg(test)]
mod tests;
