//! `muster uninstall`: what the chart's pre-delete hook runs before `helm uninstall`
//! removes muster, so that nothing is lost with it.
//!
//! 1. The operator is scaled to none (and waited for), so that nothing of muster's adds
//!    a finalizer or allocates a device behind the clean-up.
//! 2. Every claim's `reservedFor` entries of pods still behind muster's gate go (the
//!    commit listed them; they would keep a claim allocated for pods that never start).
//! 3. Every claim muster allocated is handed over or given back: one a released pod
//!    that has not ended uses keeps its allocation, with kube-controller-manager's
//!    delete-protection so that the allocation goes with its last pod, as for a claim
//!    kube-scheduler allocated; any other is deallocated. Then muster's finalizer goes.
//! 4. Every Workload loses muster's finalizer, so a namespace with Workloads does not
//!    hang in Terminating once muster is gone.
//! 5. Nothing is ungated silently: pods still behind the gate stay there (releasing them
//!    would start a gang's pods without its devices), jobs muster suspended to requeue
//!    their gang stay suspended (without muster's mark), and the report names both.
//!
//! Each write is conditioned on what was read; a run that stops part-way can be run
//! again.

pub mod claims;

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use muster_api::labels;
use muster_api::v1alpha1::Workload;
use serde_json::json;
use tracing::info;

use crate::kube_ops;
use crate::owners::{OwnerKind, mark_of};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API request failed: {0}")]
    Kube(#[from] kube::Error),
    #[error("the operator's Deployment {0} still runs pods after {1:?}")]
    OperatorStillRuns(String, Duration),
}

/// What to stop first: the operator's Deployment.
#[derive(Clone, Debug)]
pub struct Settings {
    /// `namespace/name` of the operator's Deployment; `None`: it is stopped already.
    pub deployment: Option<(String, String)>,
    /// How long the operator's pods may take to go.
    pub wait: Duration,
}

/// What the clean-up did and what it left, for the hook's log.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub workloads_released: usize,
    pub claims_handed_over: usize,
    pub claims_deallocated: usize,
    pub entries_of_gated_pods_removed: usize,
    /// `namespace/name` of pods still behind muster's gate.
    pub gated_pods: Vec<String>,
    /// `Kind namespace/name` of jobs muster suspended, left suspended.
    pub suspended_jobs: Vec<String>,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "muster's finalizers removed from {} Workloads; {} claims handed over to kube-controller-manager (their pods run on), {} deallocated; {} reservations of pods behind the gate removed",
            self.workloads_released,
            self.claims_handed_over,
            self.claims_deallocated,
            self.entries_of_gated_pods_removed
        )?;
        if !self.gated_pods.is_empty() {
            writeln!(
                f,
                "{} pods stay behind the scheduling gate {} (muster does not start a gang's pods without its devices): install muster again, or delete them or remove the gate yourself: {}",
                self.gated_pods.len(),
                labels::GANG_GATE,
                shown(&self.gated_pods)
            )?;
        }
        if !self.suspended_jobs.is_empty() {
            writeln!(
                f,
                "{} jobs muster suspended to requeue their gang stay suspended: resume them once muster runs again: {}",
                self.suspended_jobs.len(),
                shown(&self.suspended_jobs)
            )?;
        }
        Ok(())
    }
}

fn shown(names: &[String]) -> String {
    let mut text = names.iter().take(20).cloned().collect::<Vec<_>>().join(", ");
    if names.len() > 20 {
        text.push_str(&format!(", and {} more", names.len() - 20));
    }
    text
}

/// Runs the clean-up (see the module's comment).
pub async fn run(client: Client, settings: &Settings) -> Result<Report, Error> {
    if let Some((namespace, name)) = &settings.deployment {
        stop_operator(&client, namespace, name, settings.wait).await?;
    }
    let mut report = Report::default();
    let pods: Vec<Pod> = Api::<Pod>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let gated: BTreeMap<String, &Pod> = pods
        .iter()
        .filter(|p| crate::workload::status::is_gated(p))
        .filter_map(|p| Some((p.uid()?, p)))
        .collect();
    report.gated_pods = gated
        .values()
        .map(|p| format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()))
        .collect();
    report.gated_pods.sort();

    let claims: Vec<ResourceClaim> = Api::<ResourceClaim>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    for claim in claims {
        let namespace = claim.namespace().unwrap_or_default();
        let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &namespace);
        let users: Vec<&Pod> = pods
            .iter()
            .filter(|p| p.namespace().as_deref() == Some(namespace.as_str()))
            .filter(|p| crate::admission::claim_writes::names_claim(p, &claim.name_any()))
            .collect();
        let mut claim = claim;
        if let Some(patch) = claims::without_gated_entries(&claim, &|uid| gated.contains_key(uid)) {
            let removed = claims::gated_entries(&claim, &|uid| gated.contains_key(uid));
            let patch: json_patch::Patch = serde_json::from_value(patch).map_err(kube::Error::SerdeError)?;
            match kube_ops::found(
                api.patch_status(&claim.name_any(), &PatchParams::default(), &Patch::Json::<()>(patch))
                    .await,
            )? {
                Some(patched) => {
                    report.entries_of_gated_pods_removed += removed;
                    claim = patched;
                }
                None => continue,
            }
        }
        match claims::hand_over(&claim, &users) {
            claims::Action::Nothing => continue,
            claims::Action::HandOver => {
                kube_ops::add_finalizer(&api, claim.clone(), labels::DELETE_PROTECTION_FINALIZER).await?;
                report.claims_handed_over += 1;
            }
            claims::Action::Deallocate => {
                if let Some(patch) = crate::admission::claim_writes::deallocation(&claim) {
                    let patch: json_patch::Patch = serde_json::from_value(patch).map_err(kube::Error::SerdeError)?;
                    kube_ops::found(
                        api.patch_status(&claim.name_any(), &PatchParams::default(), &Patch::Json::<()>(patch))
                            .await,
                    )?;
                    report.claims_deallocated += 1;
                }
            }
            claims::Action::ReleaseFinalizer => {}
        }
        let Some(current) = api.get_opt(&claim.name_any()).await? else {
            continue;
        };
        kube_ops::remove_finalizer(&api, &current, labels::CLAIM_FINALIZER).await?;
    }

    let workloads: Vec<Workload> = Api::<Workload>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    for workload in workloads {
        if !workload.finalizers().iter().any(|f| f == labels::WORKLOAD_FINALIZER) {
            continue;
        }
        let api: Api<Workload> = Api::namespaced(client.clone(), &workload.namespace().unwrap_or_default());
        kube_ops::remove_finalizer(&api, &workload, labels::WORKLOAD_FINALIZER).await?;
        report.workloads_released += 1;
    }

    for kind in OwnerKind::ALL {
        let resource = kind.resource();
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
        let marked = match api.list(&ListParams::default().labels(labels::REQUEUED)).await {
            Ok(list) => list.items,
            // Not served here.
            Err(e) if kube_ops::is_not_found(&e) => continue,
            Err(e) => return Err(e.into()),
        };
        for object in marked.iter().filter(|o| mark_of(*o).is_some()) {
            let namespace = object.namespace().unwrap_or_default();
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &resource);
            let patch = json!({"metadata": {
                "resourceVersion": object.resource_version(),
                "labels": {labels::REQUEUED: null},
                "annotations": {labels::REQUEUED_FOR: null},
            }});
            kube_ops::done_if_gone_or_changed(
                api.patch(&object.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
                    .await,
            )?;
            if object.data["spec"]["suspend"] == true {
                report
                    .suspended_jobs
                    .push(format!("{} {namespace}/{}", resource.kind, object.name_any()));
            }
        }
    }
    report.suspended_jobs.sort();
    Ok(report)
}

/// Scales the operator's Deployment to none and waits until its pods are gone.
async fn stop_operator(client: &Client, namespace: &str, name: &str, wait: Duration) -> Result<(), Error> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let patch = json!({"spec": {"replicas": 0}});
    if kube_ops::found(
        deployments
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await,
    )?
    .is_none()
    {
        return Ok(());
    }
    info!(%namespace, %name, "scaled the operator to none; waiting for its pods to go");
    let deadline = tokio::time::Instant::now() + wait;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    loop {
        let Some(deployment) = deployments.get_opt(name).await? else {
            return Ok(());
        };
        // Its pods, terminating ones too (they may still write until they exit).
        let selector = deployment
            .spec
            .selector
            .match_labels
            .as_ref()
            .map(|labels| {
                labels
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default();
        let left = if selector.is_empty() {
            deployment.status.and_then(|s| s.replicas).unwrap_or(0) as usize
        } else {
            // Only the Deployment's own (a ReplicaSet's): not this hook's pod.
            pods.list(&ListParams::default().labels(&selector))
                .await?
                .items
                .iter()
                .filter(|p| p.owner_references().iter().any(|o| o.kind == "ReplicaSet"))
                .count()
        };
        if left == 0 {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::OperatorStillRuns(format!("{namespace}/{name}"), wait));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
