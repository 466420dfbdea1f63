//! The adoption controller: for every labelled JobSet and Job, the Workload it stands for
//! ([`derive`]), owned by the job so that deleting the job deletes the Workload (and the
//! Workload controller gives its claims back). It keeps the Workload's `suspend` equal
//! to the job's, refuses a change of the job's shape, and tells the job object what
//! happens to its gang: created, queued in Kueue, admitted, unplaceable, invalid.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use muster_api::v1alpha1::Workload;
use muster_api::{conditions, labels};
use serde_json::{Value, json};
use tracing::{info, warn};

use crate::cache::cluster::Index;
use crate::frameworks::derive::derive;
use crate::frameworks::{Framework, is_gang_root};
use crate::kube_ops;

/// Field manager of the adoption controller's writes.
pub const FIELD_MANAGER: &str = "muster-frameworks";

// Events on the job object.
/// The job's gang Workload was created.
pub const EVENT_GANG_CREATED: &str = "GangCreated";
/// The job cannot be a gang; the note names the field.
pub const EVENT_INVALID: &str = "InvalidGang";
/// The job queues in Kueue through its gang Workload, and muster admits it.
pub const EVENT_QUEUED_IN_KUEUE: &str = "GangQueuedInKueue";
/// The gang was admitted: every claim reserved, pods released.
pub const EVENT_ADMITTED: &str = "GangAdmitted";
/// The gang does not fit; the note says why, with numbers.
pub const EVENT_UNSCHEDULABLE: &str = "GangUnschedulable";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API request failed: {0}")]
    Kube(#[from] kube::Error),
    #[error("the derived Workload does not serialise: {0}")]
    Serde(#[from] serde_json::Error),
}

struct Context {
    client: Client,
    recorder: Recorder,
    index: Arc<Index>,
    framework: Framework,
    resource: ApiResource,
    lease: Option<crate::ops::leader::LeaseGuard>,
}

/// Whether the cluster serves `framework`'s kind (JobSet is a CRD).
pub async fn served(client: &Client, framework: Framework) -> bool {
    let resource = framework.resource();
    match client.list_api_group_resources(&resource.api_version).await {
        Ok(list) => list.resources.iter().any(|r| r.name == resource.plural),
        Err(e) => {
            if !kube_ops::is_not_found(&e) {
                warn!(error = %e, kind = %resource.kind, "cannot tell whether the cluster serves it; not adopting it");
            }
            false
        }
    }
}

/// Runs the adoption controller of `framework` until the process stops.
pub async fn run(
    client: Client,
    framework: Framework,
    index: Arc<Index>,
    lease: Option<crate::ops::leader::LeaseGuard>,
) {
    let resource = framework.resource();
    let reporter = Reporter {
        controller: FIELD_MANAGER.into(),
        instance: std::env::var("POD_NAME").ok(),
    };
    let context = Arc::new(Context {
        recorder: Recorder::new(client.clone(), reporter),
        client: client.clone(),
        index: index.clone(),
        framework,
        resource: resource.clone(),
        lease,
    });
    // Node labels decide whether a topology key is known: wait for them.
    index.wait_ready().await;
    let labelled = watcher::Config::default().labels(labels::ADOPT);
    Controller::new_with(
        Api::<DynamicObject>::all_with(client.clone(), &resource),
        labelled,
        resource,
    )
    .owns(Api::<Workload>::all(client), watcher::Config::default())
    .shutdown_on_signal()
    .run(reconcile, error_policy, context)
    .for_each(|result| async move {
        if let Err(e) = result
            && !matches!(e, kube::runtime::controller::Error::ObjectNotFound(_))
        {
            warn!(error = %e, "adopting a job failed");
        }
    })
    .await;
}

fn error_policy(_: Arc<DynamicObject>, error: &Error, _: Arc<Context>) -> Action {
    warn!(%error, "adopting a job failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

/// Whether some node has label `key` (a hostname always exists).
fn known_level(index: &Index, key: &str) -> bool {
    key == "kubernetes.io/hostname" || index.snapshot().nodes().any(|n| n.labels.contains_key(key))
}

async fn reconcile(job: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, Error> {
    if let Some(lease) = &ctx.lease {
        lease.exit_unless_held();
    }
    let object = serde_json::to_value(job.as_ref())?;
    if job.metadata.deletion_timestamp.is_some()
        || !is_gang_root(ctx.framework, &object)
        || crate::frameworks::labelled(&object) != Some(labels::ADOPT_VALUE)
    {
        return Ok(Action::await_change());
    }
    let namespace = job.namespace().unwrap_or_default();
    let desired = derive(ctx.framework, &object, &|key| known_level(&ctx.index, key));
    let name = desired.name_any();
    let workloads: Api<Workload> = Api::namespaced(ctx.client.clone(), &namespace);
    let invalid = |w: &Workload| w.annotations().get(labels::INVALID).cloned();

    let Some(existing) = workloads.get_opt(&name).await? else {
        match workloads
            .create(
                &PostParams {
                    field_manager: Some(FIELD_MANAGER.into()),
                    ..PostParams::default()
                },
                &desired,
            )
            .await
        {
            Ok(_) => {}
            // Made meanwhile: the next reconcile sees it.
            Err(e) if kube_ops::is_conflict(&e) => return Ok(Action::requeue(Duration::from_secs(1))),
            Err(e) => return Err(e.into()),
        }
        info!(%namespace, job = %job.name_any(), workload = %name, "a job became a gang");
        let note = format!(
            "muster runs this {} as one gang: Workload {name} (kubectl get mw {name})",
            ctx.framework.kind()
        );
        publish(&ctx, &job, EventType::Normal, EVENT_GANG_CREATED, note).await;
        if let Some(queue) = desired.labels().get(crate::kueue::QUEUE_LABEL) {
            let note = format!(
                "Kueue decides this {}'s quota in LocalQueue {queue} through Workload {name}, and muster admits it once every device is reserved; Kueue's own {} integration does not manage it (its queue label moved to the annotation {})",
                ctx.framework.kind(),
                ctx.framework.kind(),
                labels::QUEUE_NAME
            );
            publish(&ctx, &job, EventType::Normal, EVENT_QUEUED_IN_KUEUE, note).await;
        }
        if let Some(problems) = invalid(&desired) {
            publish(&ctx, &job, EventType::Warning, EVENT_INVALID, problems).await;
        }
        return Ok(Action::await_change());
    };
    if !existing
        .owner_references()
        .iter()
        .any(|o| Some(&o.uid) == job.metadata.uid.as_ref())
    {
        // A Workload of that name belongs to someone else (or to a deleted job of the same
        // name, still going): nothing is touched; the job waits.
        let note = format!(
            "Workload {name} exists and does not belong to this {}",
            ctx.framework.kind()
        );
        publish(&ctx, &job, EventType::Warning, EVENT_INVALID, note).await;
        return Ok(Action::requeue(Duration::from_secs(30)));
    }

    // The groups cannot change (the Workload's podGroups are immutable, and a gang has a
    // fixed shape): a change of the job's shape holds the gang and says which field.
    let mut problems = invalid(&desired);
    if let Some(change) = shape_change(ctx.framework, &object, &existing, &desired) {
        problems = Some(problems.map_or(change.clone(), |p| format!("{change}; {p}")));
    }
    let suspend = ctx.framework.suspended(&object) || problems.is_some();
    let mut patch = json!({});
    if existing.spec.suspend.unwrap_or(false) != suspend {
        patch["spec"] = json!({"suspend": suspend});
    }
    if invalid(&existing) != problems {
        patch["metadata"] = json!({"annotations": {labels::INVALID: problems}});
    }
    if patch != json!({}) {
        workloads
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        if let Some(problems) = &problems
            && invalid(&existing).as_ref() != Some(problems)
        {
            publish(&ctx, &job, EventType::Warning, EVENT_INVALID, problems.clone()).await;
        }
    }
    report_admission(&ctx, &job, &existing).await?;
    Ok(Action::await_change())
}

/// A change of a replicated job's (or the Job's) pod count or of the groups since the
/// Workload was made, named by field.
fn shape_change(framework: Framework, object: &Value, existing: &Workload, desired: &Workload) -> Option<String> {
    let sets = framework.pod_sets(object);
    let had: Vec<(&str, i32)> = existing
        .spec
        .pod_groups
        .iter()
        .map(|g| (g.name.as_str(), g.replicas))
        .collect();
    let want: Vec<(&str, i32)> = desired
        .spec
        .pod_groups
        .iter()
        .map(|g| (g.name.as_str(), g.replicas))
        .collect();
    if had == want {
        return None;
    }
    let field = sets
        .iter()
        .zip(&want)
        .find(|(_, w)| !had.contains(w))
        .map_or_else(|| "spec".to_string(), |(s, _)| s.at.clone());
    Some(format!(
        "{field}: the {} changed its shape from {had:?} to {want:?} pods; muster gangs a fixed shape (elastic replicas are not supported): delete the {} and create it again",
        framework.kind(),
        framework.kind()
    ))
}

/// Tells the job when its gang is admitted or cannot be placed, once per change of the
/// Workload's `Admitted` condition (remembered on the Workload, so a restart does not
/// tell it again).
async fn report_admission(ctx: &Context, job: &DynamicObject, workload: &Workload) -> Result<(), Error> {
    let Some(admitted) = workload
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == conditions::ADMITTED))
    else {
        return Ok(());
    };
    let (type_, reason) = match (admitted.status.as_str(), admitted.reason.as_str()) {
        ("True", _) => (EventType::Normal, EVENT_ADMITTED),
        (_, conditions::REASON_UNSCHEDULABLE) => (EventType::Warning, EVENT_UNSCHEDULABLE),
        (_, conditions::REASON_INVALID_REQUEST) => (EventType::Warning, EVENT_INVALID),
        _ => return Ok(()),
    };
    let key = format!("{}/{}", admitted.status, admitted.reason);
    if workload.annotations().get(labels::REPORTED) == Some(&key) {
        return Ok(());
    }
    let note = format!("Workload {}: {}", workload.name_any(), admitted.message);
    publish(ctx, job, type_, reason, note).await;
    let patch = json!({"metadata": {"annotations": {labels::REPORTED: key}}});
    let api: Api<Workload> = Api::namespaced(ctx.client.clone(), &workload.namespace().unwrap_or_default());
    kube_ops::done_if_gone(
        api.patch(&workload.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ()),
    )?;
    Ok(())
}

async fn publish(ctx: &Context, job: &DynamicObject, type_: EventType, reason: &str, note: String) {
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(note.chars().take(1000).collect()),
        action: "Adopt".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &job.object_ref(&ctx.resource)).await {
        warn!(error = %e, "publishing an event on a job failed");
    }
}
