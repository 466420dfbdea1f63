//! `kubectl muster why WORKLOAD`: where the gang stands, and for a gang that waits, a
//! plan against the live cluster read now — the engine the operator uses, on a fresh
//! read — with why it does not fit (per group and per topology level, with numbers)
//! and what preemption would do.

use std::fmt::Write;

use anyhow::{Context, Result};
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use muster_api::v1alpha1::Workload;
use serde::Serialize;

use super::status::human_duration;
use super::{Output, WhyArgs, live, serialized};
use crate::cli::plan::{self, WorkloadReport};
use crate::report::summary::{GangSummary, phase_name, state_name, summarize};
use crate::snapshot::Objects;

/// `-o json|yaml`: the gang's summary and, for a waiting gang, the plan.
#[derive(Serialize)]
struct Answer {
    gang: GangSummary,
    #[serde(skip_serializing_if = "Option::is_none")]
    plan: Option<WorkloadReport>,
}

pub(super) async fn run(args: &WhyArgs) -> Result<String> {
    let client = args.target.client().await?;
    let namespace = args.target.namespace(&client);
    let workloads: Api<Workload> = Api::namespaced(client.clone(), &namespace);
    let workload = workloads
        .get_opt(&args.workload)
        .await?
        .with_context(|| format!("Workload {namespace}/{} not found", args.workload))?;
    let gang = summarize(&workload, Timestamp::now());
    // Only a gang that waits is planned: one that holds devices would be in its own way.
    let plan = if gang.is_pending() {
        let (cluster, templates) = tokio::try_join!(live::cluster(&client), live::templates(&client, &namespace))?;
        let (kueue_workloads, kueue_flavors) = kueue_decision(&client, &namespace, &workload).await;
        let (limit_ranges, runtime_classes) = live::pod_defaults(&client, &namespace).await;
        let mut asked = Objects {
            templates,
            limit_ranges,
            runtime_classes,
            kueue_workloads,
            kueue_flavors,
            ..Objects::default()
        };
        asked.workloads.push(workload);
        let (report, details) = plan::plan(cluster, &asked, &namespace, args.fencing, args.preemption_scope)?;
        report
            .workloads
            .into_iter()
            .next()
            .map(|w| (w.clone(), plan::human(&plan::Report { workloads: vec![w] }, &details)))
    } else {
        None
    };
    match args.output {
        Output::Json | Output::Yaml => serialized(
            &Answer {
                gang,
                plan: plan.map(|(report, _)| report),
            },
            args.output,
        ),
        Output::Table | Output::Wide => Ok(human(
            &gang,
            plan.as_ref().map(|(report, text)| (report, text.as_str())),
        )),
    }
}

/// For a gang behind a Kueue queue: its Kueue Workload and the ResourceFlavors, so that
/// it is planned inside Kueue's decision as the operator plans it. Nothing when Kueue is
/// not there or may not be read: the plan is then the cluster's alone.
async fn kueue_decision(
    client: &kube::Client,
    namespace: &str,
    workload: &Workload,
) -> (Vec<kube::api::DynamicObject>, Vec<kube::api::DynamicObject>) {
    if crate::kueue::queue_of(workload).is_none() {
        return (Vec::new(), Vec::new());
    }
    let workloads: Api<kube::api::DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &crate::kueue::api_resource());
    let flavors: Api<kube::api::DynamicObject> = Api::all_with(client.clone(), &crate::kueue::flavor_resource());
    let object = workloads
        .get_opt(&crate::kueue::object_name(workload))
        .await
        .ok()
        .flatten()
        // A decision Kueue is taking back does not hold the next plan.
        .filter(|o| crate::kueue::Verdict::of(o).evicted.is_none());
    let Some(object) = object else {
        return (Vec::new(), Vec::new());
    };
    // Half a decision (domains without the flavors' labels) would mislead: all or none.
    match flavors.list(&Default::default()).await {
        Ok(list) => (vec![object], list.items),
        Err(_) => (Vec::new(), Vec::new()),
    }
}

fn human(gang: &GangSummary, plan: Option<(&WorkloadReport, &str)>) -> String {
    let mut out = String::new();
    let name = format!("{}/{}", gang.namespace, gang.name);
    let phase = phase_name(gang.phase);
    match gang.state {
        Some(state) if !gang.is_pending() => {
            let _ = writeln!(
                out,
                "{name} is {phase} ({}{}): {} devices on {} nodes, {}/{} pods ready",
                state_name(state),
                gang.in_state
                    .map(|d| format!(" for {}", human_duration(d)))
                    .unwrap_or_default(),
                gang.devices,
                gang.nodes.len(),
                gang.ready_pods,
                gang.pods
            );
        }
        _ => {
            let _ = writeln!(
                out,
                "{name} is {phase}{}{}",
                gang.waiting
                    .map(|d| format!(", waiting for {}", human_duration(d)))
                    .unwrap_or_default(),
                gang.queue
                    .as_ref()
                    .map(|q| format!(" in LocalQueue {q}"))
                    .unwrap_or_default()
            );
        }
    }
    if let Some(reason) = &gang.reason {
        let _ = writeln!(
            out,
            "  muster says: {reason}{}",
            gang.message.as_ref().map(|m| format!(": {m}")).unwrap_or_default()
        );
    }
    if let Some((report, text)) = plan {
        let _ = writeln!(out, "Planned against the cluster as it is now:");
        for line in text.lines() {
            let _ = writeln!(out, "  {line}");
        }
        if report.feasible {
            let _ = writeln!(
                out,
                "It fits now; muster admits it on its next pass unless something else holds it (Kueue, the starvation rule, a nomination)."
            );
        }
    }
    out
}
