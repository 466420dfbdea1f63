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
    for line in text.lines().filter(|l| l.starts_with("apiserver_request_total{")) {
        let Some((labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(&format!("{name}=\""))
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .unwrap_or("")
                .to_string()
        };
        if !matches!(label("verb").as_str(), "POST" | "PUT" | "PATCH" | "DELETE" | "APPLY") {
            continue;
        }
        let mut resource = label("resource");
        let subresource = label("subresource");
        if !subresource.is_empty() {
            resource = format!("{resource}/{subresource}");
        }
        *out.entry(resource).or_default() += value.parse::<f64>().unwrap_or(0.0);
    }
    Ok(out)
}

/// `after - before`, per key.
pub fn delta(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v > 0.0)
        .collect()
}
