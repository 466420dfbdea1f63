//! A Grafana dashboard's JSON as far as the picture needs it: the panels with their
//! place on the 24-column grid, queries, legends, units and thresholds, and the
//! variables Grafana fills into queries before it sends them to Prometheus.

use anyhow::{Context, Result, bail};
use serde_json::Value;

pub struct Dashboard {
    pub title: String,
    pub panels: Vec<Panel>,
    /// `$name` and the text it stands for when every value is selected.
    pub variables: Vec<(String, String)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Row,
    Stat,
    TimeSeries,
}

/// A place on the grid: columns `x..x + w` of 24, rows `y..y + h`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GridPos {
    pub x: u32,
    pub y: u32,
    pub w: u32,
    pub h: u32,
}

pub struct Target {
    pub expr: String,
    pub legend: String,
}

pub struct Panel {
    pub kind: Kind,
    pub title: String,
    pub grid: GridPos,
    pub targets: Vec<Target>,
    pub unit: Option<String>,
    pub decimals: Option<usize>,
    /// Threshold steps, lowest first: from the value on (the first from -Inf), the color.
    pub thresholds: Vec<(f64, String)>,
}

/// Grafana's thresholds for a panel that sets none: green, red from 80.
fn default_thresholds() -> Vec<(f64, String)> {
    vec![(f64::NEG_INFINITY, "green".into()), (80.0, "red".into())]
}

impl Dashboard {
    pub fn parse(json: &str) -> Result<Self> {
        let dashboard: Value = serde_json::from_str(json).context("the dashboard is not JSON")?;
        let mut panels = Vec::new();
        for panel in dashboard["panels"].as_array().context("the dashboard has no panels")? {
            panels.push(Panel::parse(panel)?);
            // A collapsed row keeps its panels inside it, hidden.
            if panel["collapsed"].as_bool() != Some(true) {
                for inner in panel["panels"].as_array().into_iter().flatten() {
                    panels.push(Panel::parse(inner)?);
                }
            }
        }
        let variables = dashboard["templating"]["list"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|v| v["type"] == "query" || v["type"] == "custom")
            .filter_map(|v| {
                let name = v["name"].as_str()?.to_string();
                let all = v["allValue"].as_str().unwrap_or(".*").to_string();
                Some((name, all))
            })
            .collect();
        Ok(Dashboard {
            title: dashboard["title"].as_str().unwrap_or("dashboard").to_string(),
            panels,
            variables,
        })
    }

    /// `expr` as Grafana sends it: every variable set to all its values, the rate
    /// interval and interval set for a query of `step_seconds` over data scraped every
    /// `scrape_seconds` (Grafana's `$__rate_interval` is the larger of four scrape
    /// intervals and one step plus one scrape interval).
    pub fn interpolate(&self, expr: &str, step_seconds: u64, scrape_seconds: u64) -> String {
        let rate_interval = (4 * scrape_seconds).max(step_seconds + scrape_seconds);
        let mut expr = expr
            .replace("$__rate_interval", &format!("{rate_interval}s"))
            .replace("${__rate_interval}", &format!("{rate_interval}s"))
            .replace("$__interval", &format!("{step_seconds}s"))
            .replace("${__interval}", &format!("{step_seconds}s"));
        for (name, all) in &self.variables {
            expr = expr
                .replace(&format!("${{{name}}}"), all)
                .replace(&format!("${name}"), all);
        }
        expr
    }
}

impl Panel {
    fn parse(panel: &Value) -> Result<Self> {
        let title = panel["title"].as_str().unwrap_or_default().to_string();
        let kind = match panel["type"].as_str() {
            Some("row") => Kind::Row,
            Some("stat") => Kind::Stat,
            Some("timeseries") => Kind::TimeSeries,
            other => bail!("panel {title:?}: type {other:?} is not drawn (row, stat and timeseries are)"),
        };
        let grid = &panel["gridPos"];
        let cell = |key: &str| {
            grid[key]
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .with_context(|| format!("panel {title:?} has no gridPos.{key}"))
        };
        let grid = GridPos {
            x: cell("x")?,
            y: cell("y")?,
            w: cell("w")?,
            h: cell("h")?,
        };
        let mut targets = Vec::new();
        for target in panel["targets"].as_array().into_iter().flatten() {
            if target["hide"].as_bool() == Some(true) {
                continue;
            }
            targets.push(Target {
                expr: target["expr"]
                    .as_str()
                    .with_context(|| format!("panel {title:?} has a target without expr"))?
                    .to_string(),
                legend: target["legendFormat"].as_str().unwrap_or_default().to_string(),
            });
        }
        let defaults = &panel["fieldConfig"]["defaults"];
        let thresholds = match defaults["thresholds"]["steps"].as_array() {
            Some(steps) if !steps.is_empty() => steps
                .iter()
                .map(|s| {
                    (
                        s["value"].as_f64().unwrap_or(f64::NEG_INFINITY),
                        s["color"].as_str().unwrap_or("green").to_string(),
                    )
                })
                .collect(),
            _ => default_thresholds(),
        };
        Ok(Panel {
            kind,
            title,
            grid,
            targets,
            unit: defaults["unit"].as_str().map(str::to_string),
            decimals: defaults["decimals"].as_u64().map(|d| d as usize),
            thresholds,
        })
    }

    /// The color of the highest threshold step `value` reaches.
    pub fn threshold_color(&self, value: f64) -> &str {
        self.thresholds
            .iter()
            .rev()
            .find(|(from, _)| value >= *from)
            .or(self.thresholds.first())
            .map_or("green", |(_, color)| color.as_str())
    }
}

/// A series' name in the legend: `legend` with each `{{label}}` replaced by the
/// series' value of it (empty if it has none), or the labels as Prometheus writes them
/// if the legend is empty.
pub fn legend_name(legend: &str, labels: &crate::dashboard::promql::Labels, expr: &str) -> String {
    if legend.is_empty() || legend == "__auto" {
        let name = labels.get(crate::dashboard::promql::NAME).cloned().unwrap_or_default();
        let rest: Vec<String> = labels
            .iter()
            .filter(|(k, _)| *k != crate::dashboard::promql::NAME)
            .map(|(k, v)| format!("{k}=\"{v}\""))
            .collect();
        return match (name.is_empty(), rest.is_empty()) {
            (true, true) => expr.to_string(),
            (_, true) => name,
            _ => format!("{name}{{{}}}", rest.join(", ")),
        };
    }
    let mut out = String::new();
    let mut rest = legend;
    while let Some(open) = rest.find("{{") {
        out.push_str(&rest[..open]);
        let Some(close) = rest[open..].find("}}") else {
            break;
        };
        let label = rest[open + 2..open + close].trim();
        out.push_str(labels.get(label).map_or("", String::as_str));
        rest = &rest[open + close + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dashboard::promql::Labels;

    #[test]
    fn muster_s_dashboard_parses_and_its_queries_are_interpolated() {
        let json = include_str!("../../../charts/muster/dashboards/muster.json");
        let dashboard = Dashboard::parse(json).unwrap();
        assert!(dashboard.panels.iter().any(|p| p.kind == Kind::Row));
        assert!(dashboard.panels.iter().any(|p| p.kind == Kind::Stat));
        for panel in &dashboard.panels {
            assert!(panel.grid.x + panel.grid.w <= 24, "{}", panel.title);
            for target in &panel.targets {
                let expr = dashboard.interpolate(&target.expr, 5, 5);
                assert!(!expr.contains('$'), "{expr}");
            }
        }
        let expr = dashboard.interpolate(
            "rate(x{namespace=~\"$namespace\"}[$__rate_interval]) + ${namespace}",
            5,
            5,
        );
        assert_eq!(expr, "rate(x{namespace=~\".*\"}[20s]) + .*");
        // A step longer than three scrape intervals sets the rate interval.
        assert_eq!(dashboard.interpolate("[$__rate_interval]", 60, 15), "[75s]");
    }

    #[test]
    fn legends_fill_in_labels() {
        let labels: Labels = [("__name__", "m"), ("driver", "gpu"), ("state", "free")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(legend_name("{{driver}} {{ state }}", &labels, "q"), "gpu free");
        assert_eq!(legend_name("p99 {{missing}}", &labels, "q"), "p99 ");
        assert_eq!(legend_name("", &labels, "q"), "m{driver=\"gpu\", state=\"free\"}");
        assert_eq!(legend_name("", &Labels::new(), "sum(x)"), "sum(x)");
    }

    #[test]
    fn thresholds_pick_the_highest_step_reached() {
        let panel = Panel::parse(&serde_json::json!({
            "type": "stat", "title": "t", "gridPos": {"x": 0, "y": 0, "w": 4, "h": 4},
        }))
        .unwrap();
        assert_eq!(panel.threshold_color(3.0), "green");
        assert_eq!(panel.threshold_color(80.0), "red");
    }
}
