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

/// Suspends `owners`, each marked for `workload`, against its uid. A JobSet that a
/// TrainJob made is suspended through the TrainJob (Trainer applies the JobSet again, and
/// would undo a suspend of the JobSet's own). One that is gone needs nothing.
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
    let patch = |uid: &str| {
        json!({
            "metadata": {
                "uid": uid,
                "labels": {labels::REQUEUED: "true"},
                "annotations": {labels::REQUEUED_FOR: mark(workload)},
            },
            "spec": {"suspend": true},
        })
    };
    let mut suspended = Vec::new();
    for target in targets {
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &target.kind.resource());
        leading();
        let patched = kube_ops::found(
            api.patch(
                &target.name,
                &PatchParams::default(),
                &Patch::Merge(&patch(&target.uid)),
            )
            .await,
        )?;
        if patched.is_some() {
            info!(workload = %workload.name_any(), %namespace, kind = %target.kind.resource().kind, name = %target.name, "suspended the owner of a gang's pods to requeue the gang");
            suspended.push(target);
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

/// Resumes what `marked` names and takes the mark off, each against the version the
/// cache shows (so a mark a user or another gang changed meanwhile is read again first).
pub async fn resume(client: &Client, marked: &[MarkedOwner], leading: &(dyn Fn() + Sync)) -> Result<(), kube::Error> {
    for owner in marked {
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), &owner.namespace, &owner.owner.kind.resource());
        let patch = json!({
            "metadata": {
                "resourceVersion": owner.resource_version,
                "labels": {labels::REQUEUED: null},
                "annotations": {labels::REQUEUED_FOR: null},
            },
            "spec": {"suspend": false},
        });
        leading();
        kube_ops::done_if_gone_or_changed(
            api.patch(&owner.owner.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await,
        )?;
        info!(namespace = %owner.namespace, kind = %owner.owner.kind.resource().kind, name = %owner.owner.name, "resumed the owner muster suspended: its pods come back behind the gate");
    }
    Ok(())
}
