//! The adoption controller: for every labelled JobSet and Job, the Workload it stands for
//! ([`derive`]), owned by the job so that deleting the job deletes the Workload (and the
//! Workload controller gives its claims back). It keeps the Workload in step with the
//! job, and tells the job object what happens to its gang: created, queued in Kueue,
//! admitted, unplaceable, invalid.
//!
//! - **The derived spec is compared whole.** A job edited before its gang is admitted
//!   gets a new Workload (the old one goes, the job's gated pods join the new one); once
//!   admitted, the gang keeps what it was admitted with, and the job is told, once, that
//!   its change waits for a new job. An admitted gang is never suspended for it.
//! - **Suspend goes both ways.** The job's `spec.suspend` suspends the gang; a user who
//!   suspends the Workload suspends the job (whose controller then takes its pods away
//!   without counting them as failures). The job's suspend last seen is kept on the
//!   Workload ([`labels::JOB_SUSPEND`]) to tell which side changed.
//! - Jobs in namespaces the webhook's `namespaceSelector` leaves out are not muster's.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use muster_api::v1alpha1::{AdmissionState, Workload};
use muster_api::{conditions, labels};
use serde_json::{Value, json};
use tracing::{debug, info, warn};

use crate::cache::cluster::Index;
use crate::frameworks::derive::{Cluster, derive};
use crate::frameworks::{Framework, controller_of, is_gang_root};
use crate::kube_ops;
use crate::kueue::QUEUE_LABEL;

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
/// The job changed before its gang was admitted: its Workload is made again.
pub const EVENT_RECREATED: &str = "GangRecreated";
/// The job changed after its gang was admitted: the change waits for a new job.
pub const EVENT_CHANGE_IGNORED: &str = "GangChangeIgnored";
/// The job makes no pods (every replicated job or Job of it has none): it needs no gang.
pub const EVENT_NO_PODS: &str = "GangNotNeeded";

/// How often the cluster is asked again whether it serves JobSets.
const SERVED_RECHECK: Duration = Duration::from_secs(60);
/// How long a namespace's labels are trusted before they are read again.
const NAMESPACE_LABELS_FOR: Duration = Duration::from_secs(5);
/// Reasons told once per object, remembered at most this many at a time.
const MAX_TOLD: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API request failed: {0}")]
    Kube(#[from] kube::Error),
    #[error("the derived Workload does not serialise: {0}")]
    Serde(#[from] serde_json::Error),
}

/// Settings of the adoption controllers.
#[derive(Clone)]
pub struct Settings {
    /// Whether muster integrates with Kueue: a job that names a LocalQueue is held
    /// otherwise, rather than run uncharged.
    pub kueue: bool,
    /// The webhook's `namespaceSelector`: jobs elsewhere never pass muster's webhook and
    /// are not muster's.
    pub namespace_selector: Option<LabelSelector>,
    /// The cluster's PriorityClasses.
    pub priorities: Store<PriorityClass>,
    pub lease: Option<crate::ops::leader::LeaseGuard>,
    /// What the admission loop suspended to requeue gangs: a job it suspended (or whose
    /// TrainJob it did) is the admission loop's to resume, not a user's suspend.
    pub owners: Arc<crate::owners::watch::Marked>,
}

/// A namespace's labels and when they were read.
type NamespaceLabels = (Instant, BTreeMap<String, String>);

struct Context {
    client: Client,
    recorder: Recorder,
    index: Arc<Index>,
    framework: Framework,
    resource: ApiResource,
    settings: Settings,
    namespaces: Mutex<HashMap<String, NamespaceLabels>>,
    /// `uid/reason` of what was told once already.
    told: Mutex<HashSet<String>>,
}

/// Whether the cluster serves `framework`'s kind (JobSet is a CRD).
pub async fn served(client: &Client, framework: Framework) -> bool {
    let resource = framework.resource();
    match client.list_api_group_resources(&resource.api_version).await {
        Ok(list) => list.resources.iter().any(|r| r.name == resource.plural),
        Err(e) => {
            if !kube_ops::is_not_found(&e) {
                warn!(error = %e, kind = %resource.kind, "cannot tell whether the cluster serves it; asking again later");
            }
            false
        }
    }
}

/// Runs the adoption controllers until the process stops: Jobs at once, JobSets as soon
/// as the cluster serves them (asked again every minute, so a JobSet installed after
/// muster is adopted without a restart).
pub async fn run_all(client: Client, index: Arc<Index>, settings: Settings) {
    // Deriving reads node labels and PriorityClasses: both must be listed, or a gang
    // would be judged on an empty cluster.
    index.wait_ready().await;
    let _ = settings.priorities.wait_until_ready().await;
    let mut running: FuturesUnordered<futures::future::BoxFuture<'static, ()>> = FuturesUnordered::new();
    running.push(Box::pin(run(
        client.clone(),
        Framework::Job,
        index.clone(),
        settings.clone(),
    )));
    let mut jobsets = false;
    let mut recheck = tokio::time::interval(SERVED_RECHECK);
    info!(kueue = settings.kueue, "running labelled jobs as gangs");
    loop {
        tokio::select! {
            _ = recheck.tick(), if !jobsets => {
                if served(&client, Framework::JobSet).await {
                    jobsets = true;
                    info!("the cluster serves JobSets: labelled JobSets (and TrainJobs) run as gangs");
                    // Members of JobSet groups are verified against the JobSets' Jobs: the
                    // JobSet controller starts once they are listed (without holding up
                    // the Job controller meanwhile).
                    let (client, index, settings) = (client.clone(), index.clone(), settings.clone());
                    running.push(Box::pin(async move {
                        let adopt = run(client.clone(), Framework::JobSet, index, settings);
                        match crate::frameworks::jobs::follow(client).await {
                            Some(keep) => {
                                tokio::select! {
                                    () = keep => {}
                                    () = adopt => {}
                                }
                            }
                            None => adopt.await,
                        }
                    }));
                }
            }
            Some(()) = running.next() => return,
        }
    }
}

/// Runs the adoption controller of `framework` until the process stops.
async fn run(client: Client, framework: Framework, index: Arc<Index>, settings: Settings) {
    let resource = framework.resource();
    let reporter = Reporter {
        controller: FIELD_MANAGER.into(),
        instance: std::env::var("POD_NAME").ok(),
    };
    let context = Arc::new(Context {
        recorder: Recorder::new(client.clone(), reporter),
        client: client.clone(),
        index,
        framework,
        resource: resource.clone(),
        settings,
        namespaces: Mutex::default(),
        told: Mutex::default(),
    });
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

/// Whether `selector` selects an object with `labels`.
pub fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let by_labels = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let by_expressions = selector.match_expressions.iter().flatten().all(|e| {
        let value = labels.get(&e.key);
        let values = e.values.as_deref().unwrap_or_default();
        match e.operator.as_str() {
            "In" => value.is_some_and(|v| values.contains(v)),
            "NotIn" => value.is_none_or(|v| !values.contains(v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            _ => false,
        }
    });
    by_labels && by_expressions
}

/// The admission state of a Workload's journal, if it holds one.
fn journal(workload: &Workload) -> Option<AdmissionState> {
    workload.status.as_ref()?.placement.as_ref()?.state
}

/// Whether the gang succeeded or failed for good.
fn finished(workload: &Workload) -> bool {
    workload.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| (c.type_ == conditions::SUCCEEDED || c.type_ == conditions::FAILED) && c.status == "True")
    })
}

/// What a derived Workload's job decides: the spec but its suspend, the queue, and the
/// problems. Two Workloads alike in this stand for the same gang.
fn derived_part(workload: &Workload) -> Value {
    let mut spec = serde_json::to_value(&workload.spec).unwrap_or(Value::Null);
    if let Some(spec) = spec.as_object_mut() {
        spec.remove("suspend");
    }
    json!({
        "spec": spec,
        "queue": workload.labels().get(QUEUE_LABEL),
        "invalid": workload.annotations().get(labels::INVALID),
    })
}

/// The parts of the derived Workload that differ, for messages.
fn differences(had: &Value, want: &Value) -> Vec<String> {
    let mut fields: Vec<String> = Vec::new();
    let keys: std::collections::BTreeSet<&String> = had["spec"]
        .as_object()
        .into_iter()
        .chain(want["spec"].as_object())
        .flat_map(|o| o.keys())
        .collect();
    for key in keys {
        if had["spec"][key] != want["spec"][key] {
            fields.push(format!("spec.{key}"));
        }
    }
    if had["queue"] != want["queue"] {
        fields.push("the queue".into());
    }
    if had["invalid"] != want["invalid"] {
        fields.push("its problems".into());
    }
    fields
}

/// A short stable digest of `value`, to remember what was told.
fn digest(value: &Value) -> String {
    let text = value.to_string();
    let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{hash:016x}")
}

impl Context {
    fn cluster_facts<R>(&self, f: impl FnOnce(&Cluster<'_>) -> R) -> R {
        let classes = self.settings.priorities.state();
        let priority = |name: &str| {
            classes
                .iter()
                .find(|c| c.metadata.name.as_deref() == Some(name))
                .map(|c| c.value.unwrap_or(0))
        };
        let known = |key: &str| known_level(&self.index, key);
        let cluster = Cluster {
            known_level: &known,
            priority: &priority,
            default_priority: classes
                .iter()
                .find(|c| c.global_default == Some(true))
                .map(|c| c.value.unwrap_or(0)),
            kueue: self.settings.kueue,
        };
        f(&cluster)
    }

    /// Whether the webhook's namespaceSelector takes `namespace`.
    async fn selected(&self, namespace: &str) -> Result<bool, Error> {
        let Some(selector) = &self.settings.namespace_selector else {
            return Ok(true);
        };
        let cached = self
            .namespaces
            .lock()
            .ok()
            .and_then(|c| c.get(namespace).cloned())
            .filter(|(at, _)| at.elapsed() < NAMESPACE_LABELS_FOR);
        let labels = match cached {
            Some((_, labels)) => labels,
            None => {
                let api: Api<Namespace> = Api::all(self.client.clone());
                let labels = api
                    .get_opt(namespace)
                    .await?
                    .map(|n| n.labels().clone())
                    .unwrap_or_default();
                if let Ok(mut cache) = self.namespaces.lock() {
                    if cache.len() > MAX_TOLD {
                        cache.clear();
                    }
                    cache.insert(namespace.to_string(), (Instant::now(), labels.clone()));
                }
                labels
            }
        };
        // The API server adds this label to every namespace; selectors often use it.
        let mut labels = labels;
        labels
            .entry("kubernetes.io/metadata.name".into())
            .or_insert_with(|| namespace.to_string());
        Ok(selects(selector, &labels))
    }

    /// Whether `key` is told for the first time (and remembers it).
    fn first_time(&self, key: String) -> bool {
        let Ok(mut told) = self.told.lock() else {
            return true;
        };
        if told.len() > MAX_TOLD {
            told.clear();
        }
        told.insert(key)
    }
}

/// Stops the process unless it still holds the Lease: checked before every write, as a
/// leader stalled between its check and its write must not write after a successor took
/// over.
fn ensure_leading(ctx: &Context) {
    if let Some(lease) = &ctx.settings.lease {
        lease.exit_unless_held();
    }
}

async fn reconcile(job: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, Error> {
    ensure_leading(&ctx);
    let object = serde_json::to_value(job.as_ref())?;
    if job.metadata.deletion_timestamp.is_some() || crate::frameworks::labelled(&object) != Some(labels::ADOPT_VALUE) {
        return Ok(Action::await_change());
    }
    let uid = job.uid().unwrap_or_default();
    if !is_gang_root(ctx.framework, &object) {
        // A JobSet's Job: the JobSet's gang, unless the JobSet is not labelled (its
        // template then has no gate), when the Job's pods run outside any gang.
        let gated = object["spec"]["template"]["spec"]["schedulingGates"]
            .as_array()
            .is_some_and(|g| g.iter().any(|g| g["name"] == labels::GANG_GATE));
        if !gated && ctx.first_time(format!("{uid}/unlabelled-jobset")) {
            let jobset = controller_of(&object).map(|(_, _, name)| name).unwrap_or_default();
            let note = format!(
                "this Job is labelled {}, but JobSet {jobset}, which made it, is not: its pods run outside any gang; label the JobSet when it is created (for a TrainJob, through spec.runtimePatches[].trainingRuntimeSpec.template.metadata.labels, or its runtime's template)",
                labels::ADOPT
            );
            publish(&ctx, &job, EventType::Warning, EVENT_INVALID, note).await;
        }
        return Ok(Action::await_change());
    }
    let namespace = job.namespace().unwrap_or_default();
    if !ctx.selected(&namespace).await? {
        debug!(%namespace, job = %job.name_any(), "outside the webhook's namespaceSelector: not muster's");
        return Ok(Action::requeue(Duration::from_secs(300)));
    }
    let desired = ctx.cluster_facts(|cluster| derive(ctx.framework, &object, cluster));
    let name = desired.name_any();
    if ctx.framework.makes_no_pods(&object) {
        // Nothing to start together, and no pod to wait for (the shape cannot change).
        if ctx.first_time(format!("{uid}/no-pods")) {
            let note = format!(
                "the {} makes no pods (its replicas, parallelism or completions are 0): there is nothing to run as a gang, so muster makes no Workload for it",
                ctx.framework.kind()
            );
            publish(&ctx, &job, EventType::Normal, EVENT_NO_PODS, note).await;
        }
        return Ok(Action::await_change());
    }
    let workloads: Api<Workload> = Api::namespaced(ctx.client.clone(), &namespace);

    let Some(existing) = workloads.get_opt(&name).await? else {
        return create(&ctx, &job, &workloads, &desired).await;
    };
    if existing.metadata.deletion_timestamp.is_some() {
        // Going (made again below once it is gone): its deletion event brings us back.
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    if !existing.owner_references().iter().any(|o| o.uid == uid) {
        return not_ours(&ctx, &job, &workloads, &existing, &desired).await;
    }
    if finished(&existing) {
        report_admission(&ctx, &job, &existing).await?;
        return Ok(Action::await_change());
    }
    // The job's own end (its policy decided, not muster's): the gang ends with it.
    if let Some((succeeded, why)) = ctx.framework.finished(&object) {
        let ended = format!("{}: {why}", if succeeded { "Succeeded" } else { "Failed" });
        if existing.annotations().get(labels::JOB_ENDED) != Some(&ended) {
            // The uid makes the patch conditional on this Workload (not one made again
            // under its name meanwhile).
            let patch = json!({"metadata": {"uid": existing.uid(), "annotations": {labels::JOB_ENDED: ended}}});
            ensure_leading(&ctx);
            kube_ops::done_if_gone(
                workloads
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(|_| ()),
            )?;
        }
        return Ok(Action::await_change());
    }
    let admitted = journal(&existing).is_some();
    let (had, want) = (derived_part(&existing), derived_part(&desired));
    if had != want {
        let changed = differences(&had, &want).join(", ");
        if !admitted {
            // Nothing is held yet: the job's gang is made again as the job now says.
            // Conditional on the version read: a gang admitted meanwhile stays.
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: existing.uid(),
                    resource_version: existing.resource_version(),
                }),
                ..DeleteParams::default()
            };
            ensure_leading(&ctx);
            match workloads.delete(&name, &params).await {
                Ok(_) => {
                    let note = format!(
                        "the {} changed ({changed}) before its gang was admitted: Workload {name} is made again",
                        ctx.framework.kind()
                    );
                    info!(%namespace, job = %job.name_any(), workload = %name, %changed, "a job changed: its Workload is made again");
                    publish(&ctx, &job, EventType::Normal, EVENT_RECREATED, note).await;
                }
                Err(e) if kube_ops::is_conflict(&e) || kube_ops::is_not_found(&e) => {}
                Err(e) => return Err(e.into()),
            }
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
        tell_ignored_change(&ctx, &job, &workloads, &existing, &desired, &want, &changed).await?;
    }
    follow_suspend(&ctx, &job, &object, &workloads, &existing, admitted).await?;
    report_admission(&ctx, &job, &existing).await?;
    // Cluster facts (node labels, PriorityClasses) change without the job: look again.
    let held = existing.annotations().contains_key(labels::INVALID);
    Ok(if held {
        Action::requeue(Duration::from_secs(60))
    } else {
        Action::await_change()
    })
}

/// Creates the job's Workload and tells the job.
async fn create(
    ctx: &Context,
    job: &DynamicObject,
    workloads: &Api<Workload>,
    desired: &Workload,
) -> Result<Action, Error> {
    let name = desired.name_any();
    let kind = ctx.framework.kind();
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PostParams::default()
    };
    // The job's suspend as seen now, so that a later change tells which side moved.
    let mut desired = desired.clone();
    desired.annotations_mut().insert(
        labels::JOB_SUSPEND.into(),
        ctx.framework.suspended(&serde_json::to_value(job)?).to_string(),
    );
    ensure_leading(ctx);
    match workloads.create(&params, &desired).await {
        Ok(_) => {}
        // Made meanwhile: the next reconcile sees it.
        Err(e) if kube_ops::is_conflict(&e) => return Ok(Action::requeue(Duration::from_secs(1))),
        // Refused (a ResourceQuota on Workloads, a policy): the job is told why.
        Err(kube::Error::Api(status)) if status.code == 403 || status.code == 422 => {
            let uid = job.uid().unwrap_or_default();
            if ctx.first_time(format!("{uid}/refused/{}", status.message)) {
                warn!(namespace = ?job.namespace(), job = %job.name_any(), workload = %name, refusal = %status.message, "the API server refused a job's Workload; trying again every minute");
                let note = format!(
                    "muster cannot create Workload {name}, the gang of this {kind}: {}",
                    status.message
                );
                publish(ctx, job, EventType::Warning, EVENT_INVALID, note).await;
            }
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
        Err(e) => return Err(e.into()),
    }
    info!(namespace = ?job.namespace(), job = %job.name_any(), workload = %name, "a job became a gang");
    let note = format!("muster runs this {kind} as one gang: Workload {name} (kubectl get mw {name})");
    publish(ctx, job, EventType::Normal, EVENT_GANG_CREATED, note).await;
    let invalid = desired.annotations().get(labels::INVALID).cloned();
    if let Some(queue) = desired.labels().get(QUEUE_LABEL)
        && ctx.settings.kueue
        && invalid.is_none()
    {
        let note = format!(
            "Kueue decides this {kind}'s quota in LocalQueue {queue} through Workload {name}, and muster admits it once every device is reserved; Kueue's own {kind} integration does not manage it (it carries no queue label of Kueue's)"
        );
        publish(ctx, job, EventType::Normal, EVENT_QUEUED_IN_KUEUE, note).await;
    }
    if let Some(problems) = invalid {
        publish(ctx, job, EventType::Warning, EVENT_INVALID, problems).await;
    }
    Ok(Action::await_change())
}

/// A Workload of the job's name that is not the job's: adopted back when it was left
/// without an owner and stands for the same gang; otherwise the job is told what to do.
async fn not_ours(
    ctx: &Context,
    job: &DynamicObject,
    workloads: &Api<Workload>,
    existing: &Workload,
    desired: &Workload,
) -> Result<Action, Error> {
    let name = existing.name_any();
    let kind = ctx.framework.kind();
    let ownerless = existing.owner_references().is_empty();
    if ownerless && derived_part(existing) == derived_part(desired) {
        let patch = json!({"metadata": {
            "ownerReferences": desired.metadata.owner_references,
            "resourceVersion": existing.resource_version(),
        }});
        ensure_leading(ctx);
        match workloads
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => info!(workload = %name, job = %job.name_any(), "adopted an ownerless Workload of the same gang"),
            Err(e) if kube_ops::is_conflict(&e) || kube_ops::is_not_found(&e) => {}
            Err(e) => return Err(e.into()),
        }
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    let uid = job.uid().unwrap_or_default();
    if ctx.first_time(format!("{uid}/not-ours/{}", existing.uid().unwrap_or_default())) {
        let note = if ownerless {
            format!(
                "Workload {name} has no owner (its job was deleted with --cascade=orphan, say) and is not this {kind}'s gang; delete it (kubectl delete mw {name} -n {}) and muster makes this {kind}'s",
                existing.namespace().unwrap_or_default()
            )
        } else {
            format!(
                "Workload {name} exists and belongs to another object (or to a deleted {kind} of this name, still going); this {kind} waits for it to go"
            )
        };
        publish(ctx, job, EventType::Warning, EVENT_INVALID, note).await;
    }
    Ok(Action::requeue(Duration::from_secs(30)))
}

/// An admitted gang keeps what it was admitted with: the job is told, once per change,
/// that its change waits for a new job, with any problem of its new settings.
async fn tell_ignored_change(
    ctx: &Context,
    job: &DynamicObject,
    workloads: &Api<Workload>,
    existing: &Workload,
    desired: &Workload,
    want: &Value,
    changed: &str,
) -> Result<(), Error> {
    let key = digest(want);
    if existing.annotations().get(labels::IGNORED_CHANGE) == Some(&key) {
        return Ok(());
    }
    let kind = ctx.framework.kind();
    let mut note = format!(
        "the {kind} changed ({changed}) after its gang was admitted: the gang runs on as admitted; delete the {kind} and create it again for the change to take effect"
    );
    if let Some(problems) = desired.annotations().get(labels::INVALID) {
        note.push_str(&format!("; the new settings would not be valid either: {problems}"));
    }
    publish(ctx, job, EventType::Warning, EVENT_CHANGE_IGNORED, note).await;
    let patch = json!({"metadata": {"annotations": {labels::IGNORED_CHANGE: key}}});
    ensure_leading(ctx);
    kube_ops::done_if_gone(
        workloads
            .patch(&existing.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
            .await,
    )?;
    Ok(())
}

/// Carries a change of suspend from the job to the Workload, or from the Workload to the
/// job, whichever side changed since [`labels::JOB_SUSPEND`] was written. A held gang
/// (invalid, not admitted) stays suspended whatever the job says.
async fn follow_suspend(
    ctx: &Context,
    job: &DynamicObject,
    object: &Value,
    workloads: &Api<Workload>,
    existing: &Workload,
    admitted: bool,
) -> Result<(), Error> {
    let job_suspended = ctx.framework.suspended(object);
    if job_suspended && requeued_by_muster(ctx, job, existing).await? {
        // The admission loop suspended it to requeue the gang, and resumes it: no user
        // moved, and the gang stays as it is.
        return Ok(());
    }
    let held = existing.annotations().contains_key(labels::INVALID) && !admitted;
    let seen = existing.annotations().get(labels::JOB_SUSPEND).map(|v| v == "true");
    let workload_suspended = existing.spec.suspend == Some(true);
    let name = existing.name_any();
    let params = PatchParams::default();
    if seen != Some(job_suspended) {
        // The job moved (or was never seen): the gang follows.
        let mut patch = json!({"metadata": {"annotations": {labels::JOB_SUSPEND: job_suspended.to_string()}}});
        let want = job_suspended || held;
        if want != workload_suspended {
            patch["spec"] = json!({"suspend": want});
        }
        ensure_leading(ctx);
        kube_ops::done_if_gone(workloads.patch(&name, &params, &Patch::Merge(&patch)).await)?;
        return Ok(());
    }
    if held || workload_suspended == job_suspended {
        return Ok(());
    }
    // The Workload moved (a user suspended or resumed the gang): the job follows, and its
    // controller stops or starts its pods.
    let jobs: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), &job.namespace().unwrap_or_default(), &ctx.resource);
    ensure_leading(ctx);
    jobs.patch(
        &job.name_any(),
        &params,
        &Patch::Merge(&ctx.framework.suspend_patch(workload_suspended)),
    )
    .await?;
    info!(job = %job.name_any(), suspend = workload_suspended, "the gang's Workload was suspended or resumed: so is its job");
    let patch = json!({"metadata": {"annotations": {labels::JOB_SUSPEND: workload_suspended.to_string()}}});
    ensure_leading(ctx);
    kube_ops::done_if_gone(workloads.patch(&name, &params, &Patch::Merge(&patch)).await)?;
    Ok(())
}

/// Whether the admission loop suspended `job` to requeue `workload`'s gang: the job
/// carries its mark, or the TrainJob that made it (a JobSet) does.
async fn requeued_by_muster(ctx: &Context, job: &DynamicObject, workload: &Workload) -> Result<bool, Error> {
    let ours = |object: &DynamicObject| {
        crate::owners::mark_of(object).and_then(crate::owners::marked_workload) == Some(workload.name_any().as_str())
    };
    if ours(job) {
        return Ok(true);
    }
    let Some(trainjob) = job
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .filter(|o| {
            crate::owners::OwnerKind::of_reference(&o.api_version, &o.kind) == Some(crate::owners::OwnerKind::TrainJob)
        })
    else {
        return Ok(false);
    };
    // Trainer applies the JobSet again a moment after its TrainJob is resumed.
    if ctx.settings.owners.just_resumed(&trainjob.uid)
        || ctx
            .settings
            .owners
            .of(workload)
            .iter()
            .any(|m| m.owner.uid == trainjob.uid && m.suspended)
    {
        return Ok(true);
    }
    // The cache of what muster marked may not have listed yet (a restart, a new leader):
    // the TrainJob itself says.
    let api: Api<DynamicObject> = Api::namespaced_with(
        ctx.client.clone(),
        &job.namespace().unwrap_or_default(),
        &crate::owners::OwnerKind::TrainJob.resource(),
    );
    Ok(api.get_opt(&trainjob.name).await?.is_some_and(|t| {
        t.uid().as_deref() == Some(trainjob.uid.as_str()) && ours(&t) && t.data["spec"]["suspend"] == true
    }))
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
    ensure_leading(ctx);
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    #[test]
    fn a_namespace_selector_selects_as_the_api_server_does() {
        let labels: BTreeMap<String, String> = [("team".to_string(), "ml".to_string())].into();
        let selector = |match_labels: &[(&str, &str)], expressions: Vec<(&str, &str, Vec<&str>)>| LabelSelector {
            match_labels: Some(
                match_labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            match_expressions: Some(
                expressions
                    .into_iter()
                    .map(|(key, operator, values)| LabelSelectorRequirement {
                        key: key.into(),
                        operator: operator.into(),
                        values: Some(values.into_iter().map(String::from).collect()),
                    })
                    .collect(),
            ),
        };
        assert!(selects(&selector(&[("team", "ml")], vec![]), &labels));
        assert!(!selects(&selector(&[("team", "web")], vec![]), &labels));
        assert!(selects(&selector(&[], vec![("team", "In", vec!["ml", "x"])]), &labels));
        assert!(!selects(&selector(&[], vec![("team", "NotIn", vec!["ml"])]), &labels));
        assert!(selects(&selector(&[], vec![("skip", "DoesNotExist", vec![])]), &labels));
        assert!(!selects(&selector(&[], vec![("skip", "Exists", vec![])]), &labels));
        assert!(selects(&LabelSelector::default(), &labels), "empty selects everything");
    }

    #[test]
    fn the_derived_part_leaves_out_suspend_and_names_what_changed() {
        let mut a: Workload = serde_json::from_value(json!({
            "apiVersion": "muster.dev/v1alpha1", "kind": "Workload", "metadata": {"name": "job-x"},
            "spec": {"suspend": false, "podGroups": [{"name": "main", "replicas": 2}]},
        }))
        .unwrap();
        let mut b = a.clone();
        b.spec.suspend = Some(true);
        assert_eq!(derived_part(&a), derived_part(&b));
        b.spec.topology = Some(muster_api::v1alpha1::Topology {
            required: Some("example.com/rack".into()),
            ..Default::default()
        });
        a.annotations_mut().insert(labels::INVALID.into(), "typo".into());
        assert_eq!(
            differences(&derived_part(&a), &derived_part(&b)),
            ["spec.topology", "its problems"]
        );
        assert_ne!(digest(&derived_part(&a)), digest(&derived_part(&b)));
    }
}
