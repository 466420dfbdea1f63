//! The Workload controller: creates a gang's gated pods, its ResourceClaims and its
//! headless Service, and reports status. It never places pods; admission does.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use muster_api::conditions;
use muster_api::labels::{self, FIELD_MANAGER};
use muster_api::v1alpha1::Workload;
use serde_json::json;
use tracing::{info, warn};

use crate::gang::{self, ClaimSource, Gang};
use crate::status::{self, Progress};

/// Errors of one reconcile. All are retried with backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API request failed: {0}")]
    Kube(#[from] kube::Error),
    #[error("{kind} {name} exists but does not belong to this Workload")]
    NotOwned { kind: &'static str, name: String },
}

impl Error {
    /// A stable label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::NotOwned { .. } => "not_owned",
        }
    }
}

/// Settings of the Workload controller.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Parallel create requests per Workload.
    pub create_parallelism: usize,
    /// Workloads reconciled at the same time.
    pub concurrency: u16,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            create_parallelism: 32,
            concurrency: 8,
        }
    }
}

/// Shared state of the controller.
pub struct Context {
    client: Client,
    recorder: Recorder,
    pods: Store<Pod>,
    claims: Store<ResourceClaim>,
    services: Store<Service>,
    settings: Settings,
    failures: Mutex<HashMap<ObjectRef<Workload>, u32>>,
}

/// Runs the Workload controller until the process is asked to stop.
pub async fn run(client: Client, settings: Settings) {
    let workloads: Api<Workload> = Api::all(client.clone());
    let gang_objects = watcher::Config::default().labels(labels::WORKLOAD);

    let (pods, pods_writer) = reflector::store();
    let pod_events = watcher(Api::<Pod>::all(client.clone()), gang_objects.clone())
        .default_backoff()
        .modify(|pod| pod.managed_fields_mut().clear())
        .reflect(pods_writer)
        .touched_objects();
    let (claims, claims_writer) = reflector::store();
    let claim_events = watcher(Api::<ResourceClaim>::all(client.clone()), gang_objects.clone())
        .default_backoff()
        .modify(|claim| claim.managed_fields_mut().clear())
        .reflect(claims_writer)
        .touched_objects();
    let (services, services_writer) = reflector::store();
    let service_events = watcher(Api::<Service>::all(client.clone()), gang_objects)
        .default_backoff()
        .reflect(services_writer)
        .touched_objects();

    let reporter = Reporter {
        controller: FIELD_MANAGER.into(),
        instance: std::env::var("POD_NAME").ok(),
    };
    let context = Arc::new(Context {
        client: client.clone(),
        recorder: Recorder::new(client, reporter),
        pods: pods.clone(),
        claims: claims.clone(),
        services: services.clone(),
        settings: settings.clone(),
        failures: Mutex::default(),
    });

    let controller = Controller::new(workloads, watcher::Config::default())
        .owns_stream(pod_events)
        .owns_stream(claim_events)
        .owns_stream(service_events)
        .with_config(kube::runtime::controller::Config::default().concurrency(settings.concurrency))
        .shutdown_on_signal();
    // Reconciles read the stores: let them fill before the first one.
    let (a, b, c) = (pods.clone(), claims.clone(), services.clone());
    let ready = async move {
        let _ = tokio::join!(a.wait_until_ready(), b.wait_until_ready(), c.wait_until_ready());
    };
    controller
        .reconcile_all_on(stream::once(ready))
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            if let Err(e) = result {
                warn!(error = %e, "reconcile failed");
            }
        })
        .await;
}

async fn reconcile(workload: Arc<Workload>, ctx: Arc<Context>) -> Result<Action, Error> {
    let result = reconcile_inner(&workload, &ctx).await;
    if result.is_ok() {
        ctx.failures
            .lock()
            .expect("failure map")
            .remove(&ObjectRef::from_obj(workload.as_ref()));
    }
    result
}

async fn reconcile_inner(workload: &Workload, ctx: &Context) -> Result<Action, Error> {
    if workload.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let name = workload.name_any();
    let namespace = workload.namespace().unwrap_or_default();

    let gang = match gang::build(workload) {
        Ok(gang) => gang,
        Err(e) => {
            let progress = Progress::Invalid { message: e.to_string() };
            write_status(workload, ctx, &progress).await?;
            return Ok(Action::await_change());
        }
    };
    if workload.spec.suspend == Some(true) {
        write_status(workload, ctx, &Progress::Suspended).await?;
        return Ok(Action::await_change());
    }

    let outcome = match create_missing(workload, &namespace, &gang, ctx).await {
        Ok(outcome) => outcome,
        Err(e @ Error::NotOwned { .. }) => {
            let progress = Progress::Waiting {
                reason: conditions::REASON_NAME_CONFLICT,
                message: e.to_string(),
            };
            write_status(workload, ctx, &progress).await?;
            return Ok(Action::requeue(Duration::from_secs(60)));
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

    let progress = if let Some(waiting) = outcome.waiting.clone() {
        waiting
    } else if outcome.missing() > 0 {
        Progress::Creating {
            missing: outcome.missing(),
        }
    } else {
        Progress::WaitingForAdmission
    };
    write_status(workload, ctx, &progress).await?;
    Ok(match progress {
        // Nothing watches templates: look again after a while.
        Progress::Waiting { .. } => Action::requeue(Duration::from_secs(15)),
        _ if !outcome.failures.is_empty() => Action::requeue(Duration::from_secs(10)),
        _ => Action::await_change(),
    })
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
    let mut outcome = CreateOutcome::default();
    let uid = workload.uid().unwrap_or_default();

    let service_ref = ObjectRef::new(&workload.name_any()).within(namespace);
    match ctx.services.get(&service_ref) {
        Some(existing) => ensure_owned(existing.as_ref(), &uid, "Service")?,
        None => {
            let api: Api<Service> = Api::namespaced(ctx.client.clone(), namespace);
            if create(&api, &gang.service, &uid, "Service").await? {
                outcome.created_services += 1;
            }
        }
    }

    // Claims before pods, so a pod never refers to a claim muster has not created yet.
    let claims_api: Api<ResourceClaim> = Api::namespaced(ctx.client.clone(), namespace);
    let templates_api: Api<ResourceClaimTemplate> = Api::namespaced(ctx.client.clone(), namespace);
    let mut templates: BTreeMap<String, Option<ResourceClaimTemplate>> = BTreeMap::new();
    let mut to_create = Vec::new();
    for claim in &gang.claims {
        let ClaimSource::Template(template_name) = &claim.source else {
            continue;
        };
        let claim_ref = ObjectRef::new(&claim.object_name).within(namespace);
        if let Some(existing) = ctx.claims.get(&claim_ref) {
            ensure_owned(existing.as_ref(), &uid, "ResourceClaim")?;
            continue;
        }
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
    let results = create_all(
        &claims_api,
        to_create,
        &uid,
        "ResourceClaim",
        ctx.settings.create_parallelism,
    )
    .await;
    tally(results, &mut outcome, |o| &mut o.created_claims)?;

    let pods_api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    let mut to_create = Vec::new();
    for pod in &gang.pods {
        let pod_ref = ObjectRef::new(pod.metadata.name.as_deref().unwrap_or_default()).within(namespace);
        match ctx.pods.get(&pod_ref) {
            Some(existing) => ensure_owned(existing.as_ref(), &uid, "Pod")?,
            None => to_create.push(pod.clone()),
        }
    }
    let results = create_all(&pods_api, to_create, &uid, "Pod", ctx.settings.create_parallelism).await;
    tally(results, &mut outcome, |o| &mut o.created_pods)?;
    Ok(outcome)
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
    parallelism: usize,
) -> Vec<Result<bool, Error>>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    stream::iter(objects)
        .map(|object| async move { create(api, &object, uid, kind).await })
        .buffer_unordered(parallelism.max(1))
        .collect()
        .await
}

/// Creates `object`; `Ok(false)` when it already exists and belongs to the Workload
/// (a store that lags behind, or a restart).
async fn create<K>(api: &Api<K>, object: &K, uid: &str, kind: &'static str) -> Result<bool, Error>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PostParams::default()
    };
    match api.create(&params, object).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 409 => {
            let name = object.meta().name.clone().unwrap_or_default();
            match api.get_opt(&name).await? {
                Some(existing) => ensure_owned(&existing, uid, kind).map(|()| false),
                None => Ok(false),
            }
        }
        Err(e) => Err(e.into()),
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

fn pods_of<'a>(store: &'a [Arc<Pod>], namespace: &str, workload: &str) -> Vec<&'a Pod> {
    store
        .iter()
        .filter(|p| p.metadata.namespace.as_deref() == Some(namespace))
        .filter(|p| p.labels().get(labels::WORKLOAD).map(String::as_str) == Some(workload))
        .map(Arc::as_ref)
        .collect()
}

async fn write_status(workload: &Workload, ctx: &Context, progress: &Progress) -> Result<(), Error> {
    let namespace = workload.namespace().unwrap_or_default();
    let name = workload.name_any();
    let all_pods = ctx.pods.state();
    let pods = pods_of(&all_pods, &namespace, &name);
    let now = Time(Timestamp::now());
    let desired = status::compute(workload, &pods, progress, &now);
    if workload.status.as_ref() == Some(&desired) {
        return Ok(());
    }
    let previous_reason = admitted_reason(workload.status.as_ref());
    let api: Api<Workload> = Api::namespaced(ctx.client.clone(), &namespace);
    let patch = json!({"apiVersion": "muster.dev/v1alpha1", "kind": "Workload", "status": desired});
    api.patch_status(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch))
        .await?;
    let reason = admitted_reason(Some(&desired));
    if let Progress::Invalid { message } | Progress::Waiting { message, .. } = progress
        && previous_reason != reason
    {
        let reason = reason.unwrap_or_default();
        publish(ctx, workload, EventType::Warning, &reason, "Reconcile", message.clone()).await;
    }
    Ok(())
}

fn admitted_reason(status: Option<&muster_api::WorkloadStatus>) -> Option<String> {
    status?
        .conditions
        .iter()
        .find(|c| c.type_ == conditions::ADMITTED)
        .map(|c| c.reason.clone())
}

async fn publish(ctx: &Context, workload: &Workload, type_: EventType, reason: &str, action: &str, note: String) {
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: action.into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &workload.object_ref(&())).await {
        warn!(error = %e, "publishing an event failed");
    }
}

fn error_policy(workload: Arc<Workload>, error: &Error, ctx: Arc<Context>) -> Action {
    let key = ObjectRef::from_obj(workload.as_ref());
    let mut failures = ctx.failures.lock().expect("failure map");
    let count = failures.entry(key).or_insert(0);
    *count = count.saturating_add(1);
    // 1 s, 2 s, 4 s ... capped at 5 minutes.
    let delay = Duration::from_secs(1u64 << (*count - 1).min(8)).min(Duration::from_secs(300));
    warn!(workload = %workload.name_any(), namespace = ?workload.namespace(), error = %error, kind = error.metric_label(), retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}
