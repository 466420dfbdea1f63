//! What the chart ships for monitoring holds up against a running operator: every query
//! of the Grafana dashboard and of the PrometheusRule is valid PromQL and reads only
//! metrics muster serves, and the live gauges describe the gangs as they are.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use muster_e2e::chart::{self, RenderOptions};
use muster_e2e::rbac::metrics;
use muster_e2e::scenario::{assert_runs_as_planned, gang, with_test};
use muster_local_cluster::wait;
use promql_parser::parser::{self, Expr};
use promql_parser::util::{ExprVisitor, walk_expr};
use serde_json::Value;

/// Every query of the dashboard, with where it is, Grafana's variables filled in as a
/// Prometheus would receive them.
fn dashboard_queries() -> Result<Vec<(String, String)>> {
    let path = chart::repo_root().join("charts/muster/dashboards/muster.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().context("panels")? {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().context("a target without expr")?;
            queries.push((format!("dashboard panel {:?}", panel["title"]), expr.to_string()));
        }
    }
    for variable in dashboard["templating"]["list"].as_array().into_iter().flatten() {
        if let Some(query) = variable["query"]["query"].as_str()
            && let Some(inner) = query.strip_prefix("label_values(")
        {
            // label_values(metric, label) is Grafana's, not PromQL: check its metric.
            let metric = inner.split(',').next().unwrap_or_default().trim();
            queries.push((format!("dashboard variable {:?}", variable["name"]), metric.to_string()));
        }
    }
    Ok(queries
        .into_iter()
        .map(|(at, q)| {
            let q = q
                .replace("$__rate_interval", "5m")
                .replace("\"$namespace\"", "\".*\"")
                .replace("$namespace", ".*");
            (at, q)
        })
        .collect())
}

/// Every alert expression of the chart's PrometheusRule.
fn alert_queries() -> Result<Vec<(String, String)>> {
    let objects = chart::render_with(&RenderOptions {
        set: &[("metrics.prometheusRule.enabled", "true")],
        api_versions: &["monitoring.coreos.com/v1"],
        ..RenderOptions::default()
    })?;
    let rules = chart::of_kind(&objects, "PrometheusRule");
    ensure!(rules.len() == 1, "the chart renders one PrometheusRule");
    let mut queries = Vec::new();
    for group in rules[0]["spec"]["groups"].as_array().context("groups")? {
        for rule in group["rules"].as_array().context("rules")? {
            queries.push((
                format!("alert {}", rule["alert"].as_str().unwrap_or("?")),
                rule["expr"].as_str().context("an alert without expr")?.to_string(),
            ));
        }
    }
    Ok(queries)
}

#[derive(Default)]
struct MetricNames(BTreeSet<String>);

impl ExprVisitor for MetricNames {
    type Error = std::convert::Infallible;

    fn pre_visit(&mut self, expr: &Expr) -> Result<bool, Self::Error> {
        let selector = match expr {
            Expr::VectorSelector(selector) => Some(selector),
            Expr::MatrixSelector(matrix) => Some(&matrix.vs),
            _ => None,
        };
        if let Some(name) = selector.and_then(|s| s.name.clone()) {
            self.0.insert(name);
        }
        Ok(true)
    }
}

/// The metrics a query reads; an error if it is not PromQL.
fn metrics_read(at: &str, query: &str) -> Result<BTreeSet<String>> {
    let expr = parser::parse(query).map_err(|e| anyhow::anyhow!("{at}: {query:?} is not valid PromQL: {e}"))?;
    let mut names = MetricNames::default();
    let _ = walk_expr(&mut names, &expr);
    Ok(names.0)
}

/// Families a metrics page describes (`# TYPE name type`), and the sample names each
/// one serves.
fn served(page: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in page.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            continue;
        };
        match kind {
            "counter" => {
                names.insert(format!("{name}_total"));
            }
            "histogram" => {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
            _ => {
                names.insert(name.to_string());
            }
        }
    }
    names
}

#[test]
fn every_dashboard_and_alert_query_is_promql() -> Result<()> {
    let queries: Vec<_> = dashboard_queries()?.into_iter().chain(alert_queries()?).collect();
    ensure!(queries.len() >= 30, "only {} queries found", queries.len());
    for (at, query) in &queries {
        let names = metrics_read(at, query)?;
        ensure!(!names.is_empty(), "{at}: {query:?} reads no metric");
        for name in names {
            ensure!(
                name.starts_with("muster_"),
                "{at}: {query:?} reads {name}, not a muster metric"
            );
        }
    }
    Ok(())
}

#[tokio::test]
async fn the_dashboard_and_alerts_read_only_metrics_the_operator_serves_and_gauges_follow_the_gangs() -> Result<()> {
    let queries: Vec<_> = dashboard_queries()?.into_iter().chain(alert_queries()?).collect();
    with_test("monitoring", &[], &[], move |test| {
        Box::pin(async move {
            test.create(gang("runs", 1, None)).await?;
            assert_runs_as_planned(test, "runs").await?;
            // 64 workers of 8 GPUs in one rack: never fits, so it waits.
            test.create(gang("waits", 64, None)).await?;
            test.wait_admitted_reason("waits", "Unschedulable", Duration::from_secs(60))
                .await?;
            let operator = test.operator.as_ref().context("operator")?;

            let ns = test.ns.clone();
            let pending = format!("muster_pending_gangs{{namespace=\"{ns}\",reason=\"Unschedulable\"}}");
            let seen = wait::until("the gauges to show both gangs", Duration::from_secs(30), || {
                let pending = pending.clone();
                async move {
                    let seen = metrics(operator).await?;
                    Ok((seen.get(&pending) == Some(&1.0)
                        && seen
                            .get("muster_gang_states{state=\"Released\"}")
                            .is_some_and(|n| *n >= 1.0))
                    .then_some(seen))
                }
            })
            .await?;
            for (sample, at_least) in [
                (
                    format!("muster_pending_gangs_longest_wait_seconds{{namespace=\"{ns}\"}}"),
                    0.0,
                ),
                (
                    "muster_reserved_devices_by_class{device_class=\"gpu.example.com\"}".to_string(),
                    8.0,
                ),
                (
                    "muster_devices{driver=\"gpu.example.com\",state=\"in_use\"}".to_string(),
                    8.0,
                ),
                (
                    "muster_devices{driver=\"gpu.example.com\",state=\"free\"}".to_string(),
                    1.0,
                ),
                ("muster_admission_pass_duration_seconds_count".to_string(), 1.0),
            ] {
                let value = seen
                    .get(&sample)
                    .copied()
                    .with_context(|| format!("{sample} is not served"))?;
                ensure!(value >= at_least, "{sample} is {value}, expected at least {at_least}");
            }

            let (status, page) = operator.get("/metrics").await?;
            ensure!(status == 200, "/metrics answered {status}");
            let served = served(&page);
            let mut missing = Vec::new();
            for (at, query) in &queries {
                for name in metrics_read(at, query)? {
                    if !served.contains(&name) {
                        missing.push(format!("{at} reads {name}"));
                    }
                }
            }
            if !missing.is_empty() {
                bail!("metrics the operator does not serve:\n  {}", missing.join("\n  "));
            }

            // Deleting the waiting gang takes it off the gauge.
            test.workloads()
                .delete("waits", &Default::default())
                .await
                .context("deleting the waiting gang")?;
            wait::until("the waiting gang to leave the gauge", Duration::from_secs(30), || {
                let pending = pending.clone();
                async move { Ok((!metrics(operator).await?.contains_key(&pending)).then_some(())) }
            })
            .await?;
            Ok(())
        })
    })
    .await
}
