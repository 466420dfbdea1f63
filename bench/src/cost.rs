//! What a phase costs: CPU seconds and peak memory per process from /proc, and write
//! requests served by kube-apiserver from its metrics.

use std::collections::BTreeMap;

use anyhow::{Context, Result};

/// CPU seconds (user + system) a process has used so far.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / clock_ticks_per_second())
}

fn clock_ticks_per_second() -> f64 {
    // USER_HZ is 100 on every Linux architecture this runs on.
    100.0
}

/// Peak resident memory of a process so far, in MiB (VmHWM).
pub fn peak_rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// CPU seconds of each named process.
pub fn cpu_by_process(pids: &[(String, u32)]) -> BTreeMap<String, f64> {
    pids.iter()
        .filter_map(|(name, pid)| cpu_seconds(*pid).map(|s| (name.clone(), s)))
        .collect()
}

/// Write requests (create, update, patch, delete) kube-apiserver has served, by
/// resource, from `apiserver_request_total`.
pub async fn apiserver_writes(client: &kube::Client) -> Result<BTreeMap<String, f64>> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    let text = client
        .request_text(request)
        .await
        .context("reading kube-apiserver metrics")?;
    let mut out = BTreeMap::new();
    for (label, value) in counters(&text, "apiserver_request_total") {
        if !matches!(label("verb"), "POST" | "PUT" | "PATCH" | "DELETE" | "APPLY") {
            continue;
        }
        let mut resource = label("resource").to_string();
        let subresource = label("subresource");
        if !subresource.is_empty() {
            resource = format!("{resource}/{subresource}");
        }
        *out.entry(resource).or_default() += value;
    }
    Ok(out)
}

/// The samples of counter `name` in a Prometheus text exposition: a label lookup (empty
/// when absent) and the value of each.
pub fn counters<'t>(text: &'t str, name: &str) -> impl Iterator<Item = (impl Fn(&str) -> &'t str, f64)> {
    let prefix = format!("{name}{{");
    text.lines().filter(move |l| l.starts_with(&prefix)).filter_map(|line| {
        let (labels, value) = line.rsplit_once(' ')?;
        let label = move |key: &str| {
            labels
                .split(&format!("{key}=\""))
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .unwrap_or("")
        };
        Some((label, value.parse::<f64>().unwrap_or(0.0)))
    })
}

/// `after - before`, per key.
pub fn delta(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v > 0.0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_read_with_their_labels() {
        let text = "# HELP muster_api_requests_total Requests\n\
                    muster_api_requests_total{verb=\"patch\",resource=\"pods\"} 4\n\
                    muster_api_requests_total_other{verb=\"get\"} 9\n\
                    muster_api_requests_total{verb=\"create\",resource=\"resourceclaims.resource.k8s.io\"} 2.5\n";
        let read: Vec<(String, String, f64)> = counters(text, "muster_api_requests_total")
            .map(|(label, value)| (label("verb").to_string(), label("resource").to_string(), value))
            .collect();
        assert_eq!(
            read,
            [
                ("patch".into(), "pods".into(), 4.0),
                ("create".into(), "resourceclaims.resource.k8s.io".into(), 2.5)
            ]
        );
        let (label, _) = counters(text, "muster_api_requests_total").next().unwrap();
        assert_eq!(label("subresource"), "", "absent labels are empty");
    }
}
