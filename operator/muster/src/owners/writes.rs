//! The writes that suspend and resume a gang's owners.

use std::collections::BTreeSet;

use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use muster_api::labels;
use muster_api::v1alpha1::Workload;
use serde_json::json;
use tracing::info;

use super::watch::MarkedOwner;
use super::{Owner, OwnerKind, mark};
use crate::kube_ops;

/// How often a suspend reads an owner again when it changed between the read and the
/// write (a Job's status changes with its pods).
const SUSPEND_ATTEMPTS: usize = 3;

/// Suspends `owners`, each marked for `workload`, against the version read just before
/// (so a suspend a deposed leader prepared fails once its successor moved the object on).
/// A JobSet that a TrainJob made is suspended through the TrainJob (Trainer applies the
/// JobSet again, and would undo a suspend of the JobSet's own). One that is gone, or made
/// again under its name, needs nothing. Returns those it suspended.
pub async fn suspend(
    client: &Client,
    workload: &Workload,
    owners: &BTreeSet<Owner>,
    leading: &(dyn Fn() + Sync),
) -> Result<Vec<Owner>, kube::Error> {
    let namespace = workload.namespace().unwrap_or_default();
    let mut targets = BTreeSet::new();
    for owner in owners {
        targets.insert(
            through_trainjob(client, &namespace, owner)
                .await?
                .unwrap_or_else(|| owner.clone()),
        );
    }
    let mut suspended = Vec::new();
    for target in targets {
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &target.kind.resource());
        for attempt in 1..=SUSPEND_ATTEMPTS {
            let Some(current) = api.get_opt(&target.name).await? else {
                break;
            };
            if current.uid().as_deref() != Some(target.uid.as_str()) {
                break;
            }
            if current.data["spec"]["suspend"] == true && super::mark_of(&current) == Some(mark(workload).as_str()) {
                break;
            }
            let patch = json!({
                "metadata": {
                    "resourceVersion": current.resource_version(),
                    "labels": {labels::REQUEUED: "true"},
                    "annotations": {labels::REQUEUED_FOR: mark(workload)},
                },
                "spec": {"suspend": true},
            });
            leading();
            match api
                .patch(&target.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    info!(workload = %workload.name_any(), %namespace, kind = %target.kind.resource().kind, name = %target.name, "suspended the owner of a gang's pods to requeue the gang");
                    suspended.push(target.clone());
                    break;
                }
                Err(e) if kube_ops::is_not_found(&e) => break,
                Err(e) if kube_ops::is_conflict(&e) && attempt < SUSPEND_ATTEMPTS => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(suspended)
}

/// The TrainJob that made JobSet `owner`, if one did.
async fn through_trainjob(client: &Client, namespace: &str, owner: &Owner) -> Result<Option<Owner>, kube::Error> {
    if owner.kind != OwnerKind::JobSet {
        return Ok(None);
    }
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &OwnerKind::JobSet.resource());
    let listed = api
        .list(&ListParams::default().fields(&format!("metadata.name={}", owner.name)))
        .await?;
    let Some(jobset) = listed
        .items
        .into_iter()
        .find(|j| j.uid().as_deref() == Some(owner.uid.as_str()))
    else {
        return Ok(None);
    };
    Ok(jobset
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .filter(|o| OwnerKind::of_reference(&o.api_version, &o.kind) == Some(OwnerKind::TrainJob))
        .map(|o| Owner {
            kind: OwnerKind::TrainJob,
            name: o.name.clone(),
            uid: o.uid.clone(),
        }))
}

/// What a resume did.
#[derive(Debug, Default)]
pub struct Resumed {
    pub owners: Vec<MarkedOwner>,
    /// An owner changed under every attempt: it is still to be resumed.
    pub still_changing: bool,
}

/// Resumes what `marked` names and takes the mark off, each against the version the
/// cache shows; one that changed since (a Job's status moves with its pods while they
/// go) is read again and resumed against that version while it still carries a mark for
/// the same gang (a mark a user or another gang changed meanwhile is left alone).
/// Returns those it resumed, and whether one kept changing under every attempt (it is
/// still to be resumed).
pub async fn resume(
    client: &Client,
    marked: &[MarkedOwner],
    leading: &(dyn Fn() + Sync),
) -> Result<Resumed, kube::Error> {
    let mut resumed = Resumed::default();
    for owner in marked {
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), &owner.namespace, &owner.owner.kind.resource());
        let mut version = owner.resource_version.clone();
        for attempt in 1..=SUSPEND_ATTEMPTS {
            let patch = json!({
                "metadata": {
                    "resourceVersion": version,
                    "labels": {labels::REQUEUED: null},
                    "annotations": {labels::REQUEUED_FOR: null},
                },
                "spec": {"suspend": false},
            });
            leading();
            match api
                .patch(&owner.owner.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    info!(namespace = %owner.namespace, kind = %owner.owner.kind.resource().kind, name = %owner.owner.name, "resumed the owner muster suspended: its pods come back behind the gate");
                    resumed.owners.push(MarkedOwner {
                        resource_version: version,
                        ..owner.clone()
                    });
                    break;
                }
                Err(e) if kube_ops::is_not_found(&e) => break,
                Err(e) if kube_ops::is_conflict(&e) && attempt < SUSPEND_ATTEMPTS => {
                    let Some(current) = api.get_opt(&owner.owner.name).await? else {
                        break;
                    };
                    let same_gang =
                        super::mark_of(&current).and_then(super::marked_workload) == Some(owner.workload.as_str());
                    if current.uid().as_deref() != Some(owner.owner.uid.as_str()) || !same_gang {
                        break;
                    }
                    version = current.resource_version();
                }
                // Still changing: looked at again from a fresh copy on the next step.
                Err(e) if kube_ops::is_conflict(&e) => {
                    resumed.still_changing = true;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
    }
    Ok(resumed)
}
