//! `kubectl muster status` (or `top`): every gang in a line — phase, admission state,
//! devices held, how long it has waited and why.

use std::time::Duration;

use anyhow::Result;
use comfy_table::{Table, presets};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};
use muster_api::v1alpha1::Workload;

use super::{Output, StatusArgs, serialized};
use crate::report::summary::{GangSummary, phase_name, state_name, summarize};

pub(super) async fn run(args: &StatusArgs) -> Result<String> {
    let client = args.target.client().await?;
    let api: Api<Workload> = if args.all_namespaces {
        Api::all(client.clone())
    } else {
        Api::namespaced(client.clone(), &args.target.namespace(&client))
    };
    let now = Timestamp::now();
    let mut gangs: Vec<GangSummary> = api
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .map(|w| summarize(w, now))
        .collect();
    gangs.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    match args.output {
        Output::Json | Output::Yaml => serialized(&serde_json::json!({"gangs": gangs}), args.output),
        Output::Table | Output::Wide => Ok(table(&gangs, args.all_namespaces, args.output == Output::Wide)),
    }
}

/// Columns as kubectl prints them: upper-case headers, no borders, three spaces apart.
pub(super) fn plain_table(header: Vec<&str>) -> Table {
    let mut table = Table::new();
    table.load_style(presets::NOTHING);
    table.set_header(header);
    for column in table.column_iter_mut() {
        column.set_padding((0, 3));
    }
    table
}

fn table(gangs: &[GangSummary], namespaces: bool, wide: bool) -> String {
    if gangs.is_empty() {
        return "No gangs found.\n".into();
    }
    let mut header = Vec::new();
    if namespaces {
        header.push("NAMESPACE");
    }
    header.extend(["NAME", "PHASE", "STATE", "DEVICES", "WAITING", "REASON"]);
    if wide {
        header.extend(["READY", "NODES", "RESTARTS", "IN STATE", "PRIORITY", "QUEUE", "MESSAGE"]);
    }
    let mut table = plain_table(header);
    for gang in gangs {
        let mut row = Vec::new();
        if namespaces {
            row.push(gang.namespace.clone());
        }
        row.extend([
            gang.name.clone(),
            phase_name(gang.phase).to_string(),
            gang.state.map_or("-".into(), |s| state_name(s).to_string()),
            gang.devices.to_string(),
            gang.waiting.map_or("-".into(), human_duration),
            gang.reason.clone().unwrap_or_else(|| "-".into()),
        ]);
        if wide {
            row.extend([
                format!("{}/{}", gang.ready_pods, gang.pods),
                gang.nodes.len().to_string(),
                gang.restarts.to_string(),
                gang.in_state.map_or("-".into(), human_duration),
                gang.priority_class.clone().unwrap_or_else(|| "-".into()),
                gang.queue.clone().unwrap_or_else(|| "-".into()),
                gang.message.clone().unwrap_or_else(|| "-".into()),
            ]);
        }
        table.add_row(row);
    }
    let mut text = table.trim_fmt();
    text.push('\n');
    text
}

/// A duration as kubectl prints ages: `45s`, `3m12s`, `25m`, `2h5m`, `9h`, `3d4h`, `12d`.
pub(super) fn human_duration(duration: Duration) -> String {
    let s = duration.as_secs();
    let (m, h, d) = (s / 60, s / 3600, s / 86400);
    match s {
        0..120 => format!("{s}s"),
        120..600 => format!("{m}m{}s", s % 60),
        600..10_800 => format!("{m}m"),
        10_800..28_800 => format!("{h}h{}m", m % 60),
        28_800..172_800 => format!("{h}h"),
        172_800..691_200 => format!("{d}d{}h", h % 24),
        _ => format!("{d}d"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_api::v1alpha1::{AdmissionState, WorkloadPhase};

    #[test]
    fn durations_read_as_kubectl_ages() {
        let cases = [
            (45, "45s"),
            (192, "3m12s"),
            (1500, "25m"),
            (7500, "125m"),
            (11_100, "3h5m"),
            (32_400, "9h"),
            (273_600, "3d4h"),
            (1_036_800, "12d"),
        ];
        for (seconds, text) in cases {
            assert_eq!(human_duration(Duration::from_secs(seconds)), text);
        }
    }

    fn gang(name: &str, phase: WorkloadPhase) -> GangSummary {
        GangSummary {
            namespace: "team-a".into(),
            name: name.into(),
            phase,
            state: None,
            in_state: None,
            reason: None,
            message: None,
            waiting: None,
            devices: 0,
            nodes: vec![],
            pods: 4,
            ready_pods: 0,
            restarts: 0,
            priority_class: None,
            queue: None,
        }
    }

    #[test]
    fn the_table_has_kubectl_columns_and_wide_adds_more() {
        let mut running = gang("llama", WorkloadPhase::Running);
        running.state = Some(AdmissionState::Released);
        running.devices = 32;
        running.ready_pods = 4;
        let mut waiting = gang("mistral", WorkloadPhase::Queued);
        waiting.reason = Some("Unschedulable".into());
        waiting.waiting = Some(Duration::from_secs(200));
        waiting.message = Some("needs 8 in one rack".into());
        let text = table(&[running.clone(), waiting.clone()], false, false);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with("NAME"), "{text}");
        assert!(
            !lines[0].contains("NAMESPACE") && !lines[0].contains("MESSAGE"),
            "{text}"
        );
        let llama: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(llama, ["llama", "Running", "Released", "32", "-", "-"], "{text}");
        let mistral: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(
            mistral,
            ["mistral", "Queued", "-", "0", "3m20s", "Unschedulable"],
            "{text}"
        );

        let wide = table(&[running, waiting], true, true);
        let header = wide.lines().next().unwrap_or_default();
        assert!(header.starts_with("NAMESPACE") && header.ends_with("MESSAGE"), "{wide}");
        assert!(wide.contains("needs 8 in one rack") && wide.contains("4/4"), "{wide}");
    }

    #[test]
    fn no_gangs_says_so() {
        assert_eq!(table(&[], false, false), "No gangs found.\n");
    }
}
