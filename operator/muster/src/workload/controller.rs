//! The Workload controller: creates a gang's gated pods, its ResourceClaims and its
//! headless Service, and reports status. It never places pods; admission does.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use muster_api::conditions;
use muster_api::labels::{self, FIELD_MANAGER};
use muster_api::v1alpha1::{Workload, WorkloadPhase};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::cache::cluster::Index;
use crate::cache::gang_objects::{GangStores, GangWatches};
use crate::kube_ops;
use crate::workload::charge;
use crate::workload::extended::ExtendedResources;
use crate::workload::gang::{self, ClaimSource, Gang};
use crate::workload::membership;
use crate::workload::pacing::{self, StatusPacer};
use crate::workload::status::{self, Progress};
use crate::workload::terminating::TerminatingNamespaces;

/// Errors of one reconcile. All are retried with backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API request failed: {0}")]
    Kube(#[from] kube::Error),
    #[error("{kind} {name} exists but does not belong to this Workload")]
    NotOwned { kind: &'static str, name: String },
    /// The namespace is being deleted: the API server refuses new objects in it, and the
    /// Workload goes with it.
    #[error("namespace {namespace} is being deleted")]
    NamespaceTerminating { namespace: String },
    /// A deleted Workload still has pods or claims of its own; not a failure.
    #[error("waiting for {pods} pods and {claims} claims to go")]
    CleanupPending { pods: usize, claims: usize },
    #[error("finalizer: {0}")]
    Finalizer(String),
}

impl Error {
    /// A stable label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::NotOwned { .. } => "not_owned",
            Error::NamespaceTerminating { .. } => "namespace_terminating",
            Error::CleanupPending { .. } => "cleanup_pending",
            Error::Finalizer(_) => "finalizer",
        }
    }
}

/// How soon a deleted Workload whose pods or claims are still going is looked at again,
/// should their deletion events not come.
const CLEANUP_RECHECK: Duration = Duration::from_secs(5);

/// Settings of the Workload controller.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Parallel create requests per Workload.
    pub create_parallelism: usize,
    /// Workloads reconciled at the same time.
    pub concurrency: u16,
    /// With leader election: whether this process still leads, checked before a
    /// reconcile writes.
    pub lease: Option<crate::ops::leader::LeaseGuard>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            create_parallelism: 32,
            concurrency: 8,
            lease: None,
        }
    }
}

/// Shared state of the controller.
pub struct Context {
    client: Client,
    recorder: Recorder,
    stores: GangStores,
    /// The cluster's DeviceClasses, for the extended resources they map.
    index: Arc<Index>,
    settings: Settings,
    failures: Mutex<HashMap<ObjectRef<Workload>, u32>>,
    /// Told after every reconcile, so the admission loop looks at the gang.
    admission: Arc<tokio::sync::Notify>,
    /// Puts off status writes that can wait.
    pacer: StatusPacer,
    /// What was told once already (refused pods, an ignored queue change).
    told: Mutex<HashSet<String>>,
    /// Namespaces that refused a create because they are being deleted.
    terminating: TerminatingNamespaces,
    /// Creates in flight, across every reconcile: a burst of large gangs does not take
    /// the client's whole burst from the admission loop's writes.
    create_slots: tokio::sync::Semaphore,
}

/// At most this many creates in flight at once, of every reconcile together.
const CREATE_SLOTS: usize = 128;

/// Things told once, remembered at most this many at a time.
const MAX_TOLD: usize = 10_000;

impl Context {
    /// Whether `key` is told for the first time (and remembers it).
    fn first_time(&self, key: String) -> bool {
        let mut told = self.told.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if told.len() > MAX_TOLD {
            told.clear();
        }
        told.insert(key)
    }
}

/// The Workload a gang object names in its `muster.dev/workload` label.
fn labelled_workload<K: Resource>(object: K) -> Option<ObjectRef<Workload>> {
    let name = object.labels().get(labels::WORKLOAD)?;
    Some(ObjectRef::new(name).within(&object.namespace()?))
}

/// The Workload controller, ready to run; [`WorkloadController::store`] gives its cache
/// of Workloads.
pub struct WorkloadController {
    controller: Controller<Workload>,
    context: Arc<Context>,
}

impl WorkloadController {
    pub fn new(
        client: Client,
        settings: Settings,
        stores: GangStores,
        index: Arc<Index>,
        watches: GangWatches,
        admission: Arc<tokio::sync::Notify>,
    ) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        // The Workloads' own watch, which records each changed Workload as touched for
        // the admission loop as soon as its cache has it.
        let (store, writer) = kube::runtime::reflector::store();
        let touched = index.touched.clone();
        let workloads = watcher(Api::<Workload>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .reflect(writer)
            .inspect(move |event| match event {
                Ok(watcher::Event::Apply(w) | watcher::Event::InitApply(w) | watcher::Event::Delete(w)) => {
                    touched.gang(&w.namespace().unwrap_or_default(), &w.name_any());
                }
                Ok(watcher::Event::InitDone) => touched.everything(),
                Ok(watcher::Event::Init) | Err(_) => {}
            })
            .touched_objects();
        let controller = Controller::for_stream(workloads, store)
            // Pods and claims may belong to other controllers (a Job's pods, the claims
            // kube-controller-manager makes for them): they find their Workload by label.
            .watches_stream(watches.pods, labelled_workload)
            .watches_stream(watches.claims, labelled_workload)
            .owns_stream(watches.services)
            .with_config(kube::runtime::controller::Config::default().concurrency(settings.concurrency));
        let context = Arc::new(Context {
            client: client.clone(),
            recorder: Recorder::new(client, reporter),
            stores,
            index,
            settings,
            failures: Mutex::default(),
            admission,
            pacer: StatusPacer::default(),
            told: Mutex::default(),
            terminating: TerminatingNamespaces::default(),
            create_slots: tokio::sync::Semaphore::new(CREATE_SLOTS),
        });
        WorkloadController { controller, context }
    }

    /// The controller's cache of Workloads.
    pub fn store(&self) -> Store<Workload> {
        self.controller.store()
    }

    /// Runs until the process is asked to stop.
    pub async fn run(self) {
        // Every Workload is reconciled once the stores have filled (a reconcile before
        // that does nothing, see `reconcile`).
        let stores = self.context.stores.clone();
        let index = self.context.index.clone();
        // Pods are built knowing the DeviceClasses: one made before they are listed would
        // ask a device plugin for what a DeviceClass serves.
        let ready = async move {
            stores.wait_until_ready().await;
            index.wait_ready().await;
        };
        self.controller
            .shutdown_on_signal()
            .reconcile_all_on(stream::once(ready))
            .run(reconcile, error_policy, self.context)
            .for_each(|result| async move {
                match result {
                    // A Workload deleted while queued: nothing to do.
                    Err(kube::runtime::controller::Error::ObjectNotFound(_)) | Ok(_) => {}
                    // Waiting for a deleted Workload's objects to go is not a failure.
                    Err(kube::runtime::controller::Error::ReconcilerFailed(Error::CleanupPending { .. }, _)) => {}
                    Err(e) => warn!(error = %e, "reconcile failed"),
                }
            })
            .await;
    }
}

async fn reconcile(workload: Arc<Workload>, ctx: Arc<Context>) -> Result<Action, Error> {
    // The controller starts reconciling as soon as its Workloads are listed, before the
    // pods and claims are: a reconcile then would find a gang without its pods, write
    // Created=False and take it out of the admission queue for a moment (or try to
    // make its pods again). Not waited for here: this controller's own streams fill
    // those caches, and reconciles that wait could keep it from polling them; every
    // Workload is reconciled once they are filled (`reconcile_all_on` in `run`).
    if !ctx.stores.is_ready() || !ctx.index.is_ready() {
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    let result = reconcile_inner(&workload, &ctx).await;
    ctx.admission.notify_one();
    if result.is_ok() {
        ctx.failures
            .lock()
            .expect("failure map")
            .remove(&ObjectRef::from_obj(workload.as_ref()));
    }
    result
}

/// Stops the process before a write once the Lease may be someone else's (see
/// `Admission::ensure_leading`): every write of the controller checks it first.
fn ensure_leading(ctx: &Context) {
    if let Some(lease) = &ctx.settings.lease {
        lease.exit_unless_held();
    }
}

async fn reconcile_inner(workload: &Arc<Workload>, ctx: &Context) -> Result<Action, Error> {
    ensure_leading(ctx);
    // The finalizer keeps a deleted Workload until its gang objects are gone, so that its
    // devices are given back even when the operator was down during the delete.
    let api: Api<Workload> = Api::namespaced(ctx.client.clone(), &workload.namespace().unwrap_or_default());
    // A new Workload gets its finalizer and its gang's objects in one reconcile: waiting
    // for the watch to bring the finalizer back would put a whole queue's turn between
    // a Workload's create and its pods'.
    let workload = if workload.metadata.deletion_timestamp.is_none()
        && !workload.finalizers().iter().any(|f| f == labels::WORKLOAD_FINALIZER)
    {
        ensure_leading(ctx);
        match kube_ops::add_finalizer(&api, workload.as_ref().clone(), labels::WORKLOAD_FINALIZER).await {
            Ok(written) => Arc::new(written),
            // Gone, or changed since the cached copy: the watch event of that change
            // brings it back.
            Err(e) if kube_ops::is_not_found(&e) || kube_ops::is_conflict(&e) => return Ok(Action::await_change()),
            Err(e) => return Err(e.into()),
        }
    } else {
        workload.clone()
    };
    let outcome = finalizer::finalizer(&api, labels::WORKLOAD_FINALIZER, workload, |event| async move {
        match event {
            finalizer::Event::Apply(workload) => apply(&workload, ctx).await,
            finalizer::Event::Cleanup(workload) => clean_up(&workload, ctx).await,
        }
    })
    .await;
    match outcome {
        Ok(action) => Ok(action),
        Err(finalizer::Error::ApplyFailed(e) | finalizer::Error::CleanupFailed(e)) => Err(e),
        // The Workload is gone, or its finalizers changed since the cached copy (the
        // removal's test failed): the watch event of that change brings it back. (The
        // finalizer was added above: the helper never adds it.)
        Err(finalizer::Error::AddFinalizer(e) | finalizer::Error::RemoveFinalizer(e))
            if kube_ops::is_not_found(&e) || kube_ops::is_test_failed(&e) =>
        {
            Ok(Action::await_change())
        }
        Err(finalizer::Error::AddFinalizer(e) | finalizer::Error::RemoveFinalizer(e)) => Err(e.into()),
        Err(e @ (finalizer::Error::UnnamedObject | finalizer::Error::InvalidFinalizer)) => {
            Err(Error::Finalizer(e.to_string()))
        }
    }
}

/// A Workload that is not being deleted, with its finalizer in place.
async fn apply(workload: &Workload, ctx: &Context) -> Result<Action, Error> {
    let name = workload.name_any();
    let namespace = workload.namespace().unwrap_or_default();

    // A job muster cannot gang: its Workload holds nothing and says why.
    if let Some(message) = workload.annotations().get(labels::INVALID) {
        let progress = Progress::Invalid {
            message: message.clone(),
        };
        let put_off = write_status(workload, ctx, &progress).await?;
        return Ok(requeue(put_off, None));
    }
    let mut extended = ExtendedResources::of_cluster(&ctx.index.snapshot());
    extended.record_existing(
        ctx.stores.pods_of(&namespace, &name).iter().map(AsRef::as_ref),
        ctx.stores.claims_of(&namespace, &name).iter().map(AsRef::as_ref),
    );
    let gang = match gang::build(workload, &extended) {
        Ok(gang) => gang,
        Err(e) if e.is_cluster_problem() => {
            let progress = Progress::Waiting {
                reason: conditions::REASON_EXTENDED_RESOURCE_AMBIGUOUS,
                message: e.to_string(),
            };
            let put_off = write_status(workload, ctx, &progress).await?;
            // Nothing here watches DeviceClasses: look again after a while.
            return Ok(requeue(put_off, Some(Duration::from_secs(15))));
        }
        Err(e) => {
            let progress = Progress::Invalid { message: e.to_string() };
            let put_off = write_status(workload, ctx, &progress).await?;
            return Ok(requeue(put_off, None));
        }
    };
    if crate::workload::observe::finished(workload) {
        // A finished gang is not run again, nor queued again in Kueue (its Kueue Workload,
        // once told, may go with Kueue's retention); its pods stay for their logs.
        release_unqueued_kueue_workload(workload, ctx).await?;
        let put_off = write_status(workload, ctx, &Progress::AllCreated).await?;
        return Ok(requeue(put_off, None));
    }
    // A namespace being deleted makes nothing new: asked again (at every deletion of a
    // pod of its gangs), it would only refuse again.
    if let Some(left) = ctx
        .terminating
        .quiet_for(&namespace, std::time::Instant::now(), created_at(workload))
    {
        return Ok(Action::requeue(left));
    }
    tell_refused_pods(workload, ctx).await;
    let suspended = workload.spec.suspend == Some(true);
    let kueue = match ensure_kueue_workload(workload, ctx).await {
        Err(Error::NamespaceTerminating { namespace }) => {
            ctx.terminating.refused_now(&namespace);
            return Ok(Action::await_change());
        }
        other => other?,
    };
    let kueue_again = match kueue {
        Kueue::Waiting(waiting) if !suspended => {
            let put_off = write_status(workload, ctx, &waiting).await?;
            return Ok(requeue(put_off, Some(Duration::from_secs(15))));
        }
        // Suspended, it holds nothing either way; what it waits for is told once resumed.
        Kueue::Waiting(_) => Some(Duration::from_secs(15)),
        Kueue::Kept { again } => again,
    };
    if suspended {
        // Hold nothing: gated pods muster made go now. Released pods are the admission
        // loop's: it records the suspension first, deletes them, then gives their devices
        // back. Pods another controller made are its own to take away (the adoption
        // controller suspends a job whose gang is suspended): deleting them would count
        // as their failures, and race a job that is resumed.
        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
        let uid = workload.uid().unwrap_or_default();
        for pod in ctx
            .stores
            .pods_of(&namespace, &name)
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && status::is_gated(p))
            .filter(|p| p.owner_references().iter().any(|o| o.uid == uid))
        {
            // Only the pod as seen, still gated: never one released meanwhile.
            let params = DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    uid: pod.uid(),
                    resource_version: pod.metadata.resource_version.clone(),
                }),
                ..DeleteParams::default()
            };
            ensure_leading(ctx);
            kube_ops::done_if_gone_or_changed(pods.delete(&pod.name_any(), &params).await)?;
        }
        let put_off = write_status(workload, ctx, &Progress::Suspended).await?;
        return Ok(requeue(put_off, kueue_again));
    }

    let outcome = match create_missing(workload, &namespace, &gang, ctx).await {
        Ok(outcome) => outcome,
        // Nothing can be made there any more; the namespace's deletion reaches the
        // Workload and its objects soon, and that is reconciled then.
        Err(Error::NamespaceTerminating { namespace }) => {
            ctx.terminating.refused_now(&namespace);
            return Ok(Action::await_change());
        }
        Err(e @ Error::NotOwned { .. }) => {
            let progress = Progress::Waiting {
                reason: conditions::REASON_NAME_CONFLICT,
                message: e.to_string(),
            };
            let put_off = write_status(workload, ctx, &progress).await?;
            return Ok(requeue(put_off, Some(Duration::from_secs(60))));
        }
        Err(e) => return Err(e),
    };
    if outcome.created_pods + outcome.created_claims + outcome.created_services > 0 {
        let note = format!(
            "Created {} pods, {} ResourceClaims and {} Service for the gang",
            outcome.created_pods, outcome.created_claims, outcome.created_services
        );
        info!(workload = %name, namespace = %namespace, "{note}");
        publish(
            ctx,
            workload,
            EventType::Normal,
            conditions::EVENT_CREATED,
            "Create",
            note,
        )
        .await;
    }
    for failure in &outcome.failures {
        publish(
            ctx,
            workload,
            EventType::Warning,
            conditions::EVENT_CREATE_FAILED,
            "Create",
            failure.clone(),
        )
        .await;
    }

    let joined = join_claims(workload, &namespace, &gang, ctx).await?;
    let progress = if let Some(waiting) = outcome.waiting.clone().or(joined) {
        waiting
    } else if outcome.missing() > 0 {
        Progress::Creating {
            missing: outcome.missing(),
        }
    } else {
        Progress::AllCreated
    };
    let put_off = write_status(workload, ctx, &progress).await?;
    let again = match progress {
        // Nothing watches templates: look again after a while.
        Progress::Waiting { .. } => Some(Duration::from_secs(15)),
        _ if !outcome.failures.is_empty() => Some(Duration::from_secs(10)),
        _ => None,
    };
    let again = match (again, kueue_again) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    Ok(requeue(put_off, again))
}

/// Reconcile again after `again` (or on a change), and no later than a status write
/// that was put off is due.
fn requeue(put_off: Option<Duration>, again: Option<Duration>) -> Action {
    match (put_off, again) {
        (Some(a), Some(b)) => Action::requeue(a.min(b)),
        (Some(d), None) | (None, Some(d)) => Action::requeue(d),
        (None, None) => Action::await_change(),
    }
}

/// Tells each pod labelled for the gang that is not one of its members why, once.
async fn tell_refused_pods(workload: &Workload, ctx: &Context) {
    let namespace = workload.namespace().unwrap_or_default();
    let pods = ctx.stores.pods_of(&namespace, &workload.name_any());
    for (pod, why) in membership::reported_refusals(workload, &pods) {
        if !ctx.first_time(format!("{}/refused", pod.uid().unwrap_or_default())) {
            continue;
        }
        let event = Event {
            type_: EventType::Warning,
            reason: conditions::EVENT_NOT_A_MEMBER.into(),
            note: Some(
                format!(
                    "not a member of Workload {}'s gang: {why}; it stays at the gate muster.dev/gang",
                    workload.name_any()
                )
                .chars()
                .take(1000)
                .collect(),
            ),
            action: "Join".into(),
            secondary: Some(workload.object_ref(&())),
        };
        if let Err(e) = ctx.recorder.publish(&event, &pod.object_ref(&())).await {
            warn!(error = %e, "publishing an event on a pod failed");
        }
    }
}

/// A finished gang that no longer carries a queue label (removed once it ended, when
/// the admission policy allows it) gives its Kueue Workload back: nothing would tell
/// Kueue it finished, and its quota would stay charged.
async fn release_unqueued_kueue_workload(workload: &Workload, ctx: &Context) -> Result<(), Error> {
    if crate::kueue::queue_of(workload).is_some() {
        return Ok(());
    }
    let Some(existing) = ctx.stores.kueue_workload(workload) else {
        return Ok(());
    };
    if existing.metadata.deletion_timestamp.is_some() || crate::kueue::Verdict::of(&existing).finished {
        return Ok(());
    }
    let api: Api<kube::api::DynamicObject> = Api::namespaced_with(
        ctx.client.clone(),
        &existing.namespace().unwrap_or_default(),
        &crate::kueue::api_resource(),
    );
    kube_ops::remove_finalizer(&api, &existing, crate::kueue::RESOURCE_IN_USE).await?;
    ensure_leading(ctx);
    kube_ops::done_if_gone(api.delete(&existing.name_any(), &DeleteParams::default()).await)?;
    info!(workload = %workload.name_any(), "the finished gang left its LocalQueue: its Kueue Workload is given back");
    Ok(())
}

/// Where a gang stands with its Kueue Workload.
enum Kueue {
    /// What the gang waits for before it can be charged (reported as its `Created`
    /// condition).
    Waiting(Progress),
    /// Kept in step (or none needed); `again`: look again then, for what Kueue does
    /// next does not wake the Workload.
    Kept { again: Option<Duration> },
}

/// A Workload that queues in Kueue has a Kueue Workload asking for its quota. It is
/// active unless the Workload is suspended, and then only once the gang holds nothing:
/// the quota stays charged while its devices are still being given back.
async fn ensure_kueue_workload(workload: &Workload, ctx: &Context) -> Result<Kueue, Error> {
    Ok(match charge_in_kueue(workload, ctx).await? {
        Ok(again) => Kueue::Kept { again },
        Err(waiting) => Kueue::Waiting(waiting),
    })
}

/// [`ensure_kueue_workload`]'s work: `Err` is a wait, with why.
async fn charge_in_kueue(workload: &Workload, ctx: &Context) -> Result<Result<Option<Duration>, Progress>, Error> {
    let Some(queue) = crate::kueue::queue_of(workload) else {
        return Ok(Ok(None));
    };
    if ctx.stores.kueue.is_none() {
        return Ok(Err(Progress::Waiting {
            reason: conditions::REASON_KUEUE_UNAVAILABLE,
            message: format!(
                "the gang asks for Kueue's LocalQueue {queue} (label {}), but this muster does not work with Kueue (the cluster does not serve kueue.x-k8s.io/v1beta2, or muster may not read it: the chart's rbac.kueue); it is held rather than run uncharged",
                crate::kueue::QUEUE_LABEL
            ),
        }));
    }
    let namespace = workload.namespace().unwrap_or_default();
    let resource = crate::kueue::api_resource();
    let api: Api<kube::api::DynamicObject> = Api::namespaced_with(ctx.client.clone(), &namespace, &resource);
    if let Some(existing) = ctx.stores.kueue_workload(workload) {
        return Ok(Ok(keep_kueue_workload(workload, ctx, &api, &existing, queue).await?));
    }
    // Template-less groups are charged by their job's templates, or their members.
    let charges = match charges(workload, ctx).await? {
        Ok(charges) => charges,
        Err(Some(waiting)) => return Ok(Err(waiting)),
        Err(None) => return Ok(Ok(None)),
    };
    // No Kueue webhook runs for muster's Workloads: the priority is filled in here.
    let priority = match &workload.spec.priority_class_name {
        Some(class) => {
            let classes: Api<k8s_openapi::api::scheduling::v1::PriorityClass> = Api::all(ctx.client.clone());
            let value = classes.get_opt(class).await?.and_then(|c| c.value).unwrap_or(0);
            // Never above its pods' (muster holds such a gang): Kueue must not preempt
            // for it at the class's priority either, nor before the pods exist.
            let pods = ctx.stores.pods_of(&namespace, &workload.name_any());
            let members = crate::admission::gang_priority::members(workload, pods.iter().map(AsRef::as_ref));
            let members = crate::admission::gang_priority::lowest(members);
            let charged = charged_priority(&classes, &charges).await?;
            let bound = [Some(value), members.map(|(lowest, _)| lowest), charged];
            Some((class.as_str(), bound.into_iter().flatten().min().unwrap_or(value)))
        }
        None => None,
    };
    let topology = match workload.spec.topology.as_ref().and_then(|t| t.required.as_deref()) {
        Some(level) => queue_knows_level(ctx, &namespace, queue, level).await?,
        None => false,
    };
    // Existing claims are charged through templates that mirror them, owned by the
    // Workload; a claim not there yet is waited for.
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(ctx.client.clone(), &namespace);
    let claims: Api<ResourceClaim> = Api::namespaced(ctx.client.clone(), &namespace);
    let owner = gang::owner_reference(workload).map_err(|_| Error::NotOwned {
        kind: "Workload",
        name: workload.name_any(),
    })?;
    for (index, name) in crate::kueue::named_claims(workload, &charges).iter().enumerate() {
        let Some(claim) = claims.get_opt(name).await? else {
            return Ok(Err(Progress::Waiting {
                reason: conditions::REASON_CLAIM_NOT_FOUND,
                message: format!(
                    "ResourceClaim {namespace}/{name} does not exist: Kueue cannot charge the gang for it, so the gang does not queue in LocalQueue {queue} until it does"
                ),
            }));
        };
        let template_name = crate::kueue::accounting_template_name(workload, index);
        let template: ResourceClaimTemplate = serde_json::from_value(json!({
            "metadata": {"name": template_name, "ownerReferences": [owner]},
            "spec": {"spec": claim.spec},
        }))
        .map_err(|e| Error::Kube(kube::Error::SerdeError(e)))?;
        ensure_leading(ctx);
        match templates.create(&PostParams::default(), &template).await {
            Ok(_) => {}
            // Ours already, or one of a deleted Workload of the same name still going:
            // that one would charge the old claim, so this is tried again later.
            Err(e) if kube_ops::is_conflict(&e) => {
                let owned = templates.get_opt(&template_name).await?.is_some_and(|t| {
                    t.owner_references()
                        .iter()
                        .any(|o| Some(&o.uid) == workload.metadata.uid.as_ref())
                });
                if !owned {
                    return Ok(Err(Progress::Waiting {
                        reason: conditions::REASON_NAME_CONFLICT,
                        message: format!(
                            "ResourceClaimTemplate {namespace}/{template_name}, through which Kueue charges the claim {name}, exists and does not belong to this Workload"
                        ),
                    }));
                }
            }
            Err(e) => return Err(refused_create(e, &namespace)),
        }
    }
    let Some(desired) = crate::kueue::desired(workload, queue, priority, topology, &charges) else {
        return Ok(Ok(None));
    };
    let object: kube::api::DynamicObject =
        serde_json::from_value(desired).map_err(|e| Error::Kube(kube::Error::SerdeError(e)))?;
    ensure_leading(ctx);
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => {
            info!(workload = %workload.name_any(), %namespace, queue, "queued in Kueue");
            Ok(Ok(None))
        }
        // Made already (the cache shows it soon), or one of a deleted Workload of the same
        // name is still going: muster lets go of it, and this is tried again.
        Err(e) if kube_ops::is_conflict(&e) => Err(Error::NotOwned {
            kind: "Kueue Workload",
            name: crate::kueue::object_name(workload),
        }),
        // Kueue's API refuses it (a limit of its own): no retry can help until the
        // Workload changes, so the gang says why rather than the log.
        Err(kube::Error::Api(status)) if status.code == 422 || status.code == 400 => Ok(Err(Progress::Waiting {
            reason: conditions::REASON_KUEUE_REFUSED,
            message: format!(
                "Kueue refused the Workload that asks for the gang's quota in LocalQueue {queue}: {}",
                status.message
            ),
        })),
        Err(e) => Err(refused_create(e, &namespace)),
    }
}

/// What Kueue charges each template-less group by: the owning job's pod template for the
/// groups the job makes, the largest member for the others. `Err(None)`: a group has no
/// member yet (the Kueue Workload waits); `Err(Some(_))`: waiting, with why.
/// The lowest priority the pods of template-less groups will be admitted with, from the
/// templates they are charged by (their `priorityClassName`, or the default class the
/// API server gives a pod that names none); `None` without such groups.
async fn charged_priority(
    classes: &Api<k8s_openapi::api::scheduling::v1::PriorityClass>,
    charges: &BTreeMap<String, serde_json::Value>,
) -> Result<Option<i32>, Error> {
    if charges.is_empty() {
        return Ok(None);
    }
    let mut lowest: Option<i32> = None;
    let mut default: Option<i32> = None;
    for template in charges.values() {
        let value = match template["spec"]["priorityClassName"].as_str().filter(|c| !c.is_empty()) {
            Some(class) => classes.get_opt(class).await?.and_then(|c| c.value).unwrap_or(0),
            None => match default {
                Some(value) => value,
                None => {
                    let all = classes.list(&kube::api::ListParams::default()).await?;
                    let value = all
                        .items
                        .iter()
                        .find(|c| c.global_default == Some(true))
                        .and_then(|c| c.value)
                        .unwrap_or(0);
                    *default.insert(value)
                }
            },
        };
        lowest = Some(lowest.map_or(value, |l| l.min(value)));
    }
    Ok(lowest)
}

async fn charges(
    workload: &Workload,
    ctx: &Context,
) -> Result<Result<BTreeMap<String, serde_json::Value>, Option<Progress>>, Error> {
    let namespace = workload.namespace().unwrap_or_default();
    let mut charges = BTreeMap::new();
    if let Some((framework, job_name, job_uid)) = charge::owning_job(workload)
        && workload
            .spec
            .pod_groups
            .iter()
            .any(|g| charge::made_by_job(workload, g))
    {
        let jobs: Api<kube::api::DynamicObject> =
            Api::namespaced_with(ctx.client.clone(), &namespace, &framework.resource());
        let job = jobs.get_opt(&job_name).await?;
        let Some(job) = job.filter(|j| j.uid().as_deref() == Some(job_uid.as_str())) else {
            // The job is gone (its Workload goes with it) or not seen yet.
            return Ok(Err(Some(Progress::Waiting {
                reason: conditions::REASON_WAITING_FOR_PODS,
                message: format!(
                    "{} {job_name}, whose pod templates Kueue charges the gang by, cannot be read",
                    framework.kind()
                ),
            })));
        };
        let job = serde_json::to_value(&job).map_err(|e| Error::Kube(kube::Error::SerdeError(e)))?;
        charges.extend(charge::job_templates(workload, framework, &job));
    }
    let pods = ctx.stores.pods_of(&namespace, &workload.name_any());
    for group in workload.spec.pod_groups.iter().filter(|g| g.template.is_none()) {
        if charges.contains_key(&group.name) {
            continue;
        }
        match charge::largest_member(&membership::external_members(&pods, group)) {
            Some(largest) => {
                charges.insert(group.name.clone(), largest);
            }
            None => return Ok(Err(None)),
        }
    }
    Ok(Ok(charges))
}

/// Keeps a gang's Kueue Workload in step with it: its LocalQueue, what it charges the
/// groups charged by their members, and `active`.
async fn keep_kueue_workload(
    workload: &Workload,
    ctx: &Context,
    api: &Api<kube::api::DynamicObject>,
    existing: &kube::api::DynamicObject,
    queue: &str,
) -> Result<Option<Duration>, Error> {
    let verdict = crate::kueue::Verdict::of(existing);
    let reserved = verdict.quota_reserved || verdict.holds_quota;
    let name = existing.name_any();

    // The queue label moved: Kueue's Workload follows while it holds no quota (as
    // Kueue's own integrations do); once it does, the gang stays charged where it was
    // admitted, and says so.
    let charged_in = existing.data["spec"]["queueName"].as_str().unwrap_or_default();
    if charged_in != queue && !verdict.finished {
        if !reserved {
            let patch =
                json!({"metadata": {"resourceVersion": existing.resource_version()}, "spec": {"queueName": queue}});
            ensure_leading(ctx);
            match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                Ok(_) => {
                    info!(workload = %workload.name_any(), from = charged_in, to = queue, "the gang moved to another LocalQueue")
                }
                // Kueue changed it meanwhile (nothing of that wakes the Workload).
                Err(e) if kube_ops::is_conflict(&e) => return Ok(Some(Duration::from_secs(1))),
                Err(e) if kube_ops::is_not_found(&e) => {}
                Err(e) => return Err(e.into()),
            }
        } else if ctx.first_time(format!("{}/queue/{queue}", workload.uid().unwrap_or_default())) {
            let note = format!(
                "the label {} changed to {queue} while Kueue holds quota for the gang in LocalQueue {charged_in}: the gang stays charged there until it is suspended or ends",
                crate::kueue::QUEUE_LABEL
            );
            publish(
                ctx,
                workload,
                EventType::Warning,
                conditions::EVENT_QUEUE_CHANGE_IGNORED,
                "Queue",
                note,
            )
            .await;
        }
    }

    // Groups charged by their members: when the members no longer match what Kueue
    // charges, its Workload is made again (taken back first if Kueue admitted it).
    if !verdict.finished && members_outgrew_charge(workload, ctx, existing) {
        if reserved {
            if verdict.active {
                let patch = json!({"spec": {"active": false}});
                ensure_leading(ctx);
                api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
                let note = "the pods of a group charged by its members changed since Kueue charged them: Kueue's Workload is deactivated, then made again for them".to_string();
                publish(
                    ctx,
                    workload,
                    EventType::Warning,
                    conditions::EVENT_KUEUE_WORKLOAD_REBUILT,
                    "Charge",
                    note,
                )
                .await;
            }
            // Kueue evicts it and the gang gives its admission back; nothing of that
            // wakes the Workload.
            return Ok(Some(Duration::from_secs(2)));
        } else {
            kube_ops::remove_finalizer(api, existing, crate::kueue::RESOURCE_IN_USE).await?;
            let params = DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    uid: existing.uid(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            ensure_leading(ctx);
            kube_ops::done_if_gone_or_changed(api.delete(&name, &params).await)?;
            let note = "the pods of a group charged by its members changed since Kueue charged them: Kueue's Workload is made again".to_string();
            publish(
                ctx,
                workload,
                EventType::Normal,
                conditions::EVENT_KUEUE_WORKLOAD_REBUILT,
                "Charge",
                note,
            )
            .await;
            return Ok(Some(Duration::from_secs(1)));
        }
    }

    // Only the user's suspend moves `active`: Kueue deactivates on its own too (a
    // rejected check, too many requeues), and muster must not undo that. A suspended
    // gang keeps its quota until it holds nothing.
    let suspend = workload.spec.suspend == Some(true);
    let holds = workload
        .status
        .as_ref()
        .and_then(|s| s.placement.as_ref())
        .and_then(|p| p.state)
        .is_some();
    if crate::kueue::suspend_written(existing) != Some(suspend) && !(suspend && holds) {
        let patch = json!({
            "metadata": {"annotations": {crate::kueue::SUSPEND_WRITTEN: suspend.to_string()}},
            "spec": {"active": !suspend},
        });
        ensure_leading(ctx);
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    }
    Ok(None)
}

/// Whether a group charged by its members has a member larger than (or unlike) what its
/// podSet in `existing` charges.
fn members_outgrew_charge(workload: &Workload, ctx: &Context, existing: &kube::api::DynamicObject) -> bool {
    let namespace = workload.namespace().unwrap_or_default();
    let pods = ctx.stores.pods_of(&namespace, &workload.name_any());
    workload
        .spec
        .pod_groups
        .iter()
        .filter(|g| g.template.is_none() && !charge::made_by_job(workload, g))
        .any(|group| {
            let Some(largest) = charge::largest_member(&membership::external_members(&pods, group)) else {
                return false;
            };
            let charged = existing.data["spec"]["podSets"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["name"] == group.name.as_str());
            let largest = crate::kueue::pod_set_template(largest);
            charged.is_some_and(|p| charge::charge_key(&p["template"]) != charge::charge_key(&largest))
        })
}

/// Whether a flavor of the ClusterQueue behind LocalQueue `queue` has a Kueue Topology
/// with the node label `level`: only then may the gang ask Kueue for one domain of it.
async fn queue_knows_level(ctx: &Context, namespace: &str, queue: &str, level: &str) -> Result<bool, Error> {
    use crate::kueue::resource;
    let client = ctx.client.clone();
    let local_queues: Api<kube::api::DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &resource("LocalQueue", "localqueues"));
    let Some(local) = local_queues.get_opt(queue).await? else {
        return Ok(false);
    };
    let Some(cluster_queue) = local.data["spec"]["clusterQueue"].as_str() else {
        return Ok(false);
    };
    let cluster_queues: Api<kube::api::DynamicObject> =
        Api::all_with(client.clone(), &resource("ClusterQueue", "clusterqueues"));
    let Some(cluster_queue) = cluster_queues.get_opt(cluster_queue).await? else {
        return Ok(false);
    };
    let flavors: Vec<String> = cluster_queue.data["spec"]["resourceGroups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["flavors"].as_array().into_iter().flatten())
        .filter_map(|f| f["name"].as_str().map(String::from))
        .collect();
    let topologies: Api<kube::api::DynamicObject> = Api::all_with(client.clone(), &resource("Topology", "topologies"));
    let flavor_api: Api<kube::api::DynamicObject> = Api::all_with(client, &crate::kueue::flavor_resource());
    for flavor in flavors {
        let cached = ctx
            .stores
            .kueue_flavors
            .as_ref()
            .and_then(|s| s.state().into_iter().find(|f| f.name_any() == flavor));
        // A flavor made a moment ago may not be cached yet: the podSets' topology
        // requests cannot be added once the Kueue Workload exists, so it is read.
        let object = match cached {
            Some(cached) => Some((*cached).clone()),
            // Unreadable (gone, or a chart without the right): not known, as before.
            None => flavor_api.get_opt(&flavor).await.unwrap_or_else(|e| {
                tracing::debug!(%flavor, error = %e, "reading a ResourceFlavor not cached yet failed");
                None
            }),
        };
        let topology = object.and_then(|f| f.data["spec"]["topologyName"].as_str().map(String::from));
        let Some(topology) = topology else { continue };
        if let Some(topology) = topologies.get_opt(&topology).await?
            && topology.data["spec"]["levels"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|l| l["nodeLabel"] == level)
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Claims the gang uses without having created them — ResourceClaims named by the
/// Workload and those kube-controller-manager generated for pods of template-less groups
/// — get the Workload label, so muster sees them (its claim watch selects that label).
/// Also reports a template-less group still short of its minCount pods or of their
/// claims.
async fn join_claims(
    workload: &Workload,
    namespace: &str,
    gang: &Gang,
    ctx: &Context,
) -> Result<Option<Progress>, Error> {
    let name = workload.name_any();
    let created: BTreeSet<&str> = gang
        .claims
        .iter()
        .filter(|c| !matches!(c.source, ClaimSource::Existing))
        .map(|c| c.object_name.as_str())
        .collect();
    let mut named: BTreeSet<String> = gang
        .pods
        .iter()
        .filter_map(|p| p.spec.as_ref())
        .flat_map(|s| s.resource_claims.iter().flatten())
        .filter_map(|c| c.resource_claim_name.clone())
        .filter(|n| !created.contains(n.as_str()))
        .collect();
    let pods = ctx.stores.pods_of(namespace, &name);
    let mut waiting: Option<Progress> = None;
    for group in workload.spec.pod_groups.iter().filter(|g| g.template.is_none()) {
        let members = membership::external_members(&pods, group);
        if (members.len() as i32) < group.min_count() {
            waiting.get_or_insert(Progress::Waiting {
                reason: conditions::REASON_WAITING_FOR_PODS,
                message: format!(
                    "pod group {} has {} of its {} pods; its pods come from another controller and join with the labels {}={name} and {}={}",
                    group.name,
                    members.len(),
                    group.min_count(),
                    labels::WORKLOAD,
                    labels::POD_GROUP,
                    group.name
                ),
            });
        }
        // A member that succeeded needs its claims no more (kube-controller-manager
        // deletes the ones it made): it is not placed again.
        for pod in members.into_iter().filter(|p| !membership::succeeded(p)) {
            for claim in pod
                .spec
                .as_ref()
                .and_then(|s| s.resource_claims.as_ref())
                .into_iter()
                .flatten()
            {
                if let Some(object) = &claim.resource_claim_name {
                    named.insert(object.clone());
                    continue;
                }
                match membership::generated_claim(pod, &claim.name) {
                    Some(object) => {
                        named.insert(object.to_string());
                    }
                    None => {
                        waiting.get_or_insert(Progress::Waiting {
                            reason: conditions::REASON_WAITING_FOR_PODS,
                            message: format!(
                                "waiting for kube-controller-manager to create the ResourceClaim {} of pod {}",
                                claim.name,
                                pod.name_any()
                            ),
                        });
                    }
                }
            }
        }
    }
    let api: Api<ResourceClaim> = Api::namespaced(ctx.client.clone(), namespace);
    for object in named {
        if ctx
            .stores
            .claims
            .get(&ObjectRef::new(&object).within(namespace))
            .is_some()
        {
            continue;
        }
        let patch = json!({"metadata": {"labels": {labels::WORKLOAD: name}}});
        ensure_leading(ctx);
        match api.patch(&object, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => info!(workload = %name, namespace, claim = %object, "ResourceClaim joins the gang"),
            Err(e) if kube_ops::is_not_found(&e) => {
                waiting.get_or_insert(Progress::Waiting {
                    reason: conditions::REASON_CLAIM_NOT_FOUND,
                    message: format!("ResourceClaim {namespace}/{object} does not exist"),
                });
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(waiting)
}

#[derive(Default)]
struct CreateOutcome {
    created_pods: usize,
    created_claims: usize,
    created_services: usize,
    /// Objects still missing after this pass (failed or waiting).
    still_missing: usize,
    failures: Vec<String>,
    waiting: Option<Progress>,
}

impl CreateOutcome {
    fn missing(&self) -> usize {
        self.still_missing
    }
}

async fn create_missing(
    workload: &Workload,
    namespace: &str,
    gang: &Gang,
    ctx: &Context,
) -> Result<CreateOutcome, Error> {
    let uid = workload.uid().unwrap_or_default();

    // The Service and the claims at once: only the pods must wait for their claims.
    // The first error ends both, as one after the other did: a Service that is not the
    // gang's, or a namespace being deleted, stops the claims.
    let (created_services, mut outcome) = futures::try_join!(
        create_service(workload, namespace, gang, &uid, ctx),
        create_claims(workload, namespace, gang, &uid, ctx)
    )?;
    outcome.created_services = created_services;

    let pods_api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    let mut to_create = Vec::new();
    for pod in &gang.pods {
        let pod_ref = ObjectRef::new(pod.metadata.name.as_deref().unwrap_or_default()).within(namespace);
        match ctx.stores.pods.get(&pod_ref) {
            Some(existing) => ensure_owned(existing.as_ref(), &uid, "Pod")?,
            None => to_create.push(pod.clone()),
        }
    }
    let results = create_all(&pods_api, to_create, &uid, "Pod", ctx).await;
    tally(results, &mut outcome, |o| &mut o.created_pods)?;
    Ok(outcome)
}

/// Makes the gang's headless Service unless it exists: 1 if made.
async fn create_service(
    workload: &Workload,
    namespace: &str,
    gang: &Gang,
    uid: &str,
    ctx: &Context,
) -> Result<usize, Error> {
    let service_ref = ObjectRef::new(&workload.name_any()).within(namespace);
    // The Service gives muster's own pods their hostnames, unless the spec does without
    // them; a gang of other controllers' pods has theirs (a JobSet's Service has the
    // JobSet's name).
    let own_pods = workload.spec.pod_groups.iter().any(|g| g.template.is_some());
    match (ctx.stores.services.get(&service_ref), &gang.service) {
        (Some(existing), _) => ensure_owned(existing.as_ref(), uid, "Service").map(|()| 0),
        (None, Some(service)) if own_pods => {
            let api: Api<Service> = Api::namespaced(ctx.client.clone(), namespace);
            Ok(usize::from(create(&api, service, uid, "Service", ctx).await?))
        }
        (None, _) => Ok(0),
    }
}

/// Makes the gang's claims that muster makes and that do not exist yet, from their
/// templates: the outcome's claim counts, failures and waits.
async fn create_claims(
    workload: &Workload,
    namespace: &str,
    gang: &Gang,
    uid: &str,
    ctx: &Context,
) -> Result<CreateOutcome, Error> {
    let mut outcome = CreateOutcome::default();
    let templates_api: Api<ResourceClaimTemplate> = Api::namespaced(ctx.client.clone(), namespace);
    let mut templates: BTreeMap<String, Option<ResourceClaimTemplate>> = BTreeMap::new();
    let mut to_create = Vec::new();
    for claim in &gang.claims {
        if matches!(claim.source, ClaimSource::Existing) {
            continue;
        }
        let claim_ref = ObjectRef::new(&claim.object_name).within(namespace);
        if let Some(existing) = ctx.stores.claims.get(&claim_ref) {
            ensure_owned(existing.as_ref(), uid, "ResourceClaim")?;
            continue;
        }
        let template_name = match &claim.source {
            ClaimSource::Extended(requests) => {
                match gang::claim_for_extended(workload, claim, requests) {
                    Ok(object) => to_create.push(object),
                    Err(e) => outcome.failures.push(e.to_string()),
                }
                continue;
            }
            ClaimSource::Template(template_name) => template_name,
            ClaimSource::Existing => continue,
        };
        if !templates.contains_key(template_name) {
            templates.insert(template_name.clone(), templates_api.get_opt(template_name).await?);
        }
        match templates.get(template_name).and_then(Option::as_ref) {
            Some(template) => {
                match gang::claim_from_template(workload, claim, &template.spec.clone().unwrap_or_default()) {
                    Ok(object) => to_create.push(object),
                    Err(e) => outcome.failures.push(e.to_string()),
                }
            }
            None => {
                outcome.still_missing += 1;
                outcome.waiting = Some(Progress::Waiting {
                    reason: conditions::REASON_TEMPLATE_NOT_FOUND,
                    message: format!("ResourceClaimTemplate {namespace}/{template_name} does not exist"),
                });
            }
        }
    }
    let claims_api: Api<ResourceClaim> = Api::namespaced(ctx.client.clone(), namespace);
    let results = create_all(&claims_api, to_create, uid, "ResourceClaim", ctx).await;
    tally(results, &mut outcome, |o| &mut o.created_claims)?;
    Ok(outcome)
}

/// The API server's answer to a create in a namespace that is being deleted (its
/// `NamespaceTerminating` cause; the status carries no machine-readable cause here).
fn is_namespace_terminating(status: &kube::core::Status) -> bool {
    status.code == 403 && status.message.contains("because it is being terminated")
}

/// A failed create as this controller's error: a terminating namespace's refusal told
/// apart.
fn refused_create(error: kube::Error, namespace: &str) -> Error {
    match error {
        kube::Error::Api(status) if is_namespace_terminating(&status) => Error::NamespaceTerminating {
            namespace: namespace.to_string(),
        },
        other => Error::Kube(other),
    }
}

/// When the API server made `workload`, as this process's clock reads it.
fn created_at(workload: &Workload) -> Option<std::time::SystemTime> {
    let created = workload.metadata.creation_timestamp.as_ref()?;
    let since_epoch = created.0.duration_since(Timestamp::UNIX_EPOCH).unsigned_abs();
    std::time::SystemTime::UNIX_EPOCH.checked_add(since_epoch)
}

/// Counts creations; failures the API refused as invalid are kept as messages (retrying
/// cannot help), other errors abort the reconcile for a retry.
fn tally(
    results: Vec<Result<bool, Error>>,
    outcome: &mut CreateOutcome,
    counter: impl Fn(&mut CreateOutcome) -> &mut usize,
) -> Result<(), Error> {
    for result in results {
        match result {
            Ok(true) => *counter(outcome) += 1,
            Ok(false) => {}
            Err(Error::Kube(kube::Error::Api(status))) if status.code == 422 || status.code == 403 => {
                outcome.still_missing += 1;
                if !outcome.failures.contains(&status.message) {
                    outcome.failures.push(status.message.clone());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn create_all<K>(
    api: &Api<K>,
    objects: Vec<K>,
    uid: &str,
    kind: &'static str,
    ctx: &Context,
) -> Vec<Result<bool, Error>>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    stream::iter(objects)
        .map(|object| async move { create(api, &object, uid, kind, ctx).await })
        .buffer_unordered(ctx.settings.create_parallelism.max(1))
        .collect()
        .await
}

/// Creates `object`; `Ok(false)` when it already exists and belongs to the Workload
/// (a store that lags behind, or a restart).
async fn create<K>(api: &Api<K>, object: &K, uid: &str, kind: &'static str, ctx: &Context) -> Result<bool, Error>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PostParams::default()
    };
    // Never closed: an error would only mean no limit.
    let _slot = ctx.create_slots.acquire().await.ok();
    ensure_leading(ctx);
    match api.create(&params, object).await {
        Ok(_) => Ok(true),
        Err(e) if kube_ops::is_conflict(&e) => {
            let name = object.meta().name.clone().unwrap_or_default();
            match api.get_opt(&name).await? {
                Some(existing) => ensure_owned(&existing, uid, kind).map(|()| false),
                None => Ok(false),
            }
        }
        Err(e) => Err(refused_create(
            e,
            object.meta().namespace.as_deref().unwrap_or_default(),
        )),
    }
}

fn ensure_owned<K: Resource>(object: &K, uid: &str, kind: &'static str) -> Result<(), Error> {
    let owned = object.meta().owner_references.iter().flatten().any(|o| o.uid == uid);
    if owned {
        Ok(())
    } else {
        Err(Error::NotOwned {
            kind,
            name: object.meta().name.clone().unwrap_or_default(),
        })
    }
}

/// Writes the part of the status this controller owns, if it changed. A change that can
/// wait ([`pacing::can_wait`]) is put off while the Workload's status was written less
/// than [`pacing::INTERVAL`] ago: the wait is returned, and the
/// caller reconciles again by then.
async fn write_status(workload: &Workload, ctx: &Context, progress: &Progress) -> Result<Option<Duration>, Error> {
    let namespace = workload.namespace().unwrap_or_default();
    let name = workload.name_any();
    let uid = workload.uid().unwrap_or_default();
    // Decide against what this process wrote last while the cache still lags behind it:
    // the stale copy would have the same change written again, or judged wrongly.
    let mut seen = std::borrow::Cow::Borrowed(workload);
    if let Some(mine) = ctx
        .pacer
        .newer_than_cache(&uid, workload.metadata.resource_version.as_deref())
    {
        status::overlay_owned(seen.to_mut().status.get_or_insert_with(Default::default), &mine);
    }
    let workload = seen.as_ref();
    let all_pods = ctx.stores.pods_of(&namespace, &name);
    let refusals = membership::reported_refusals(workload, &all_pods);
    let first = refusals
        .first()
        .map(|(pod, why)| format!("pod {}: {why}", pod.name_any()));
    let refused = first.as_deref().map(|first| (refusals.len(), first));
    let pods: Vec<&Pod> = all_pods.iter().map(Arc::as_ref).collect();
    let now = Time(Timestamp::now());
    let desired = status::compute(workload, &pods, progress, refused, &now);
    let current = workload.status.as_ref().map(status::owned_part);
    if current.as_ref() == Some(&desired) {
        return Ok(None);
    }
    if current.as_ref().is_some_and(|c| pacing::can_wait(c, &desired))
        && let Some(wait) = ctx.pacer.wait(&uid, std::time::Instant::now())
    {
        ctx.pacer.put_off(&uid);
        return Ok(Some(wait));
    }
    let previous_reason = created_reason(current.as_ref());
    let api: Api<Workload> = Api::namespaced(ctx.client.clone(), &namespace);
    let patch = owned_status_patch(&desired);
    ensure_leading(ctx);
    let written = api
        .patch_status(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch))
        .await?;
    ctx.pacer.wrote(
        &uid,
        std::time::Instant::now(),
        written.metadata.resource_version.as_deref(),
        &desired,
    );
    let was_running = current.as_ref().and_then(|c| c.phase) == Some(WorkloadPhase::Running);
    let first_attempt = workload.status.as_ref().is_none_or(|s| s.restarts == 0);
    if desired.phase == Some(WorkloadPhase::Running)
        && !was_running
        && first_attempt
        && let Some(created) = &workload.metadata.creation_timestamp
    {
        let took = Timestamp::now().duration_since(created.0).unsigned_abs();
        crate::ops::metrics::get().observe_submit_to_running(workload.spec.priority_class_name.as_deref(), took);
    }
    let reason = created_reason(Some(&desired));
    if let Progress::Invalid { message } | Progress::Waiting { message, .. } = progress
        && previous_reason != reason
    {
        let reason = reason.unwrap_or_default();
        publish(ctx, workload, EventType::Warning, &reason, "Reconcile", message.clone()).await;
    }
    Ok(None)
}

fn created_reason(status: Option<&muster_api::WorkloadStatus>) -> Option<String> {
    status?
        .conditions
        .iter()
        .find(|c| c.type_ == conditions::CREATED)
        .map(|c| c.reason.clone())
}

/// A deleted Workload: delete its pods, claims and Service (the admission loop clears
/// claim allocations once no pod uses them), then let the Workload go.
async fn clean_up(workload: &Workload, ctx: &Context) -> Result<Action, Error> {
    let namespace = workload.namespace().unwrap_or_default();
    let name = workload.name_any();
    let pods = ctx.stores.pods_of(&namespace, &name);
    let claims = ctx.stores.claims_of(&namespace, &name);
    let service = ctx.stores.services.get(&ObjectRef::new(&name).within(&namespace));
    let pods_api: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    // Pods another controller made are its to delete (it would only make them again).
    let uid = workload.uid().unwrap_or_default();
    let pods: Vec<&Arc<Pod>> = pods
        .iter()
        .filter(|p| p.owner_references().iter().any(|r| r.uid == uid))
        .collect();
    for pod in pods.iter().filter(|p| p.metadata.deletion_timestamp.is_none()) {
        ensure_leading(ctx);
        kube_ops::done_if_gone(pods_api.delete(&pod.name_any(), &DeleteParams::default()).await)?;
    }
    let claims_api: Api<ResourceClaim> = Api::namespaced(ctx.client.clone(), &namespace);
    // Claims the gang only joined stay: their owner (a pod, or the user) decides; the
    // admission loop clears what muster allocated once no pod uses it.
    let uid = workload.uid().unwrap_or_default();
    let owned = |o: &&Arc<ResourceClaim>| o.owner_references().iter().any(|r| r.uid == uid);
    let claims: Vec<&Arc<ResourceClaim>> = claims.iter().filter(owned).collect();
    for claim in claims.iter().filter(|c| c.metadata.deletion_timestamp.is_none()) {
        ensure_leading(ctx);
        kube_ops::done_if_gone(claims_api.delete(&claim.name_any(), &DeleteParams::default()).await)?;
    }
    if let Some(service) = service.filter(|s| s.metadata.deletion_timestamp.is_none()) {
        let services: Api<Service> = Api::namespaced(ctx.client.clone(), &namespace);
        ensure_leading(ctx);
        kube_ops::done_if_gone(services.delete(&service.name_any(), &DeleteParams::default()).await)?;
    }
    if !pods.is_empty() || !claims.is_empty() {
        // Keeps the finalizer; their deletion events bring us back.
        return Err(Error::CleanupPending {
            pods: pods.len(),
            claims: claims.len(),
        });
    }
    // The finalizer's removal follows.
    ensure_leading(ctx);
    Ok(Action::await_change())
}

async fn publish(ctx: &Context, workload: &Workload, type_: EventType, reason: &str, action: &str, note: String) {
    ensure_leading(ctx);
    publish_event(&ctx.recorder, workload, type_, reason, action, note).await;
}

/// Records an event about `workload`; a note longer than an event holds is cut. A failure
/// is logged, never fatal.
pub(crate) async fn publish_event(
    recorder: &Recorder,
    workload: &Workload,
    type_: EventType,
    reason: &str,
    action: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(note.chars().take(1000).collect()),
        action: action.into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, &workload.object_ref(&())).await {
        warn!(error = %e, "publishing an event failed");
    }
}

fn error_policy(workload: Arc<Workload>, error: &Error, ctx: Arc<Context>) -> Action {
    if let Error::CleanupPending { .. } = error {
        debug!(workload = %workload.name_any(), namespace = ?workload.namespace(), %error, "deleting");
        return Action::requeue(CLEANUP_RECHECK);
    }
    let key = ObjectRef::from_obj(workload.as_ref());
    let mut failures = ctx.failures.lock().expect("failure map");
    let count = failures.entry(key).or_insert(0);
    *count = count.saturating_add(1);
    // 1 s, 2 s, 4 s ... capped at 5 minutes; sooner if a status write was put off.
    let mut delay = crate::ops::backoff::exponential(*count, Duration::from_secs(300));
    if let Some(due) = ctx
        .pacer
        .put_off_due(&workload.uid().unwrap_or_default(), std::time::Instant::now())
    {
        delay = delay.min(due.max(Duration::from_millis(100)));
    }
    crate::ops::metrics::get()
        .reconcile_errors
        .get_or_create(&crate::ops::metrics::KindLabel {
            kind: error.metric_label(),
        })
        .inc();
    warn!(workload = %workload.name_any(), namespace = ?workload.namespace(), error = %error, kind = error.metric_label(), retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// The status patch of this controller: only the fields it owns. The admission loop owns
/// the placement and the restart counts; a forced apply of a stale copy of them from
/// this controller's cache would move them backwards.
/// Status fields the admission loop writes (with its conditions), never this controller.
const ADMISSION_FIELDS: [&str; 6] = [
    "placement",
    "restarts",
    "restartsCountTowardsMax",
    "nomination",
    "schedulerRefusals",
    "admissionRevision",
];

fn owned_status_patch(desired: &muster_api::WorkloadStatus) -> serde_json::Value {
    let mut owned = serde_json::to_value(desired).unwrap_or_default();
    if let Some(map) = owned.as_object_mut() {
        for field in ADMISSION_FIELDS {
            map.remove(field);
        }
    }
    json!({"apiVersion": "muster.dev/v1alpha1", "kind": "Workload", "status": owned})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_patch_never_carries_what_the_admission_loop_owns() {
        let status = muster_api::WorkloadStatus {
            restarts: 1,
            restarts_count_towards_max: Some(1),
            placement: Some(Default::default()),
            nomination: Some(Default::default()),
            admission_revision: Some(3),
            ..Default::default()
        };
        let patch = owned_status_patch(&status);
        let owned = patch["status"].as_object().expect("a status");
        for field in ADMISSION_FIELDS {
            assert!(!owned.contains_key(field), "{field} in {patch}");
        }
    }

    #[test]
    fn gang_objects_of_any_owner_find_their_workload_by_label() {
        let job_pod: Pod = serde_json::from_value(json!({"metadata": {
            "name": "trainers-0-abcde",
            "namespace": "team",
            "labels": {labels::WORKLOAD: "trainers"},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "trainers", "uid": "1"}],
        }}))
        .unwrap();
        assert_eq!(
            labelled_workload(job_pod),
            Some(ObjectRef::<Workload>::new("trainers").within("team"))
        );
        let stranger: Pod = serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "team"}})).unwrap();
        assert_eq!(labelled_workload(stranger), None);
    }

    #[test]
    fn a_create_refused_in_a_terminating_namespace_is_told_apart() {
        let refused = |code: u16, message: &str| kube::core::Status::failure(message, "Forbidden").with_code(code);
        assert!(is_namespace_terminating(&refused(
            403,
            "pods \"w-a-0\" is forbidden: unable to create new content in namespace team because it is being terminated"
        )));
        assert!(!is_namespace_terminating(&refused(
            403,
            "pods \"w-a-0\" is forbidden: exceeded quota: gpus"
        )));
    }
}
