//! The admission loop: the one place where gangs are placed and where their devices
//! are given back. Each pass, every placed gang takes one step of its state machine
//! (`muster-admission`'s `decide`): the loop observes the gang — journal, pods, claims,
//! node health — and performs the writes the machine returns, each conditional (the
//! recorded journal, a pod's uid, a fresh read of a claim), reading its own writes until
//! the caches show them. Then waiting gangs are planned in priority-then-age order
//! against the engine's picture of the cluster; a gang that fits is committed: the plan
//! is recorded on the Workload, every claim of the gang is allocated, the allocations
//! are checked against the cluster, and only then is every pod released (gate removed,
//! pinned to its planned node). A commit that fails before release undoes its own
//! writes; whatever is left, a restarted operator finds in the journal and undoes or
//! finishes. With leader election, nothing is written once the Lease may have passed.
//!
//! Starvation rule: gangs are tried in priority-then-age order and a smaller gang may be
//! admitted past a larger one that does not fit (backfill), except that once a gang that
//! would fit an empty cluster has waited longer than `starvation_after`, no gang of the
//! same or lower priority queued behind it is admitted until it is.

pub mod extras;
pub mod fencing;
pub mod kueue;
pub mod release;
pub mod request;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::events::{EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use muster_admission::commit;
use muster_admission::{
    ClaimView, ConditionType, Effect, EventKind, Gang, Journal, NodeHealth, PodView, Reason, Record, State,
};
use muster_api::v1alpha1::{AdmissionState, PlacementStatus, Workload, WorkloadPhase};
use muster_api::{conditions, labels};
use muster_engine::cluster::PlanId;
use muster_engine::key::{ObjectKey, PodKey};
use muster_engine::placement::{self, Outcome, Plan, PlanOptions};
use muster_engine::request::{GangRequest, PodClaim};
use serde_json::json;
use tokio::sync::Notify;
use tracing::{Instrument, info, info_span, warn};

use crate::admission::fencing::Fencing;
use crate::admission::request::{ClaimSources, RequestError, gang_request};
use crate::cache::cluster::Index;
use crate::cache::gang_index::GangIndex;
use crate::cache::gang_objects::GangStores;
use crate::convert;
use crate::kube_ops;
use crate::ops::faults::Write;
use crate::ops::leader::LeaseGuard;
use crate::ops::metrics::{self, OutcomeLabel, PhaseLabel, ReasonLabel};
use crate::workload::membership;
use crate::workload::observe::{self, condition, finished};

pub use crate::ops::faults::{FaultPoint, Pause};

/// Workloads by phase, and the queue, for the metrics.
fn record_phases(workloads: &[Arc<Workload>], queued: usize) {
    let m = metrics::get();
    let mut counts: BTreeMap<String, i64> = [
        WorkloadPhase::Pending,
        WorkloadPhase::Queued,
        WorkloadPhase::Admitted,
        WorkloadPhase::Running,
        WorkloadPhase::Succeeded,
        WorkloadPhase::Failed,
        WorkloadPhase::Suspended,
    ]
    .iter()
    .map(|p| (format!("{p:?}"), 0))
    .collect();
    for workload in workloads {
        let phase = workload.status.as_ref().and_then(|s| s.phase).unwrap_or_default();
        *counts.entry(format!("{phase:?}")).or_default() += 1;
    }
    for (phase, count) in counts {
        m.workloads.get_or_create(&PhaseLabel { phase }).set(count);
    }
    m.queue_length.set(queued as i64);
}

/// Settings of the admission loop.
#[derive(Clone, Debug)]
pub struct Settings {
    /// How long released pods may take to be scheduled before the gang is torn down.
    pub schedule_timeout: Duration,
    /// After this long waiting, a gang blocks gangs of equal or lower priority behind it.
    pub starvation_after: Duration,
    /// Parallel writes while reserving and releasing.
    pub write_parallelism: usize,
    /// Gangs committed at once. Each is planned with the ones before it assumed, so
    /// their devices and node resources never overlap.
    pub commit_parallelism: usize,
    /// Test-only: abort after this step.
    pub fault: Option<FaultPoint>,
    /// Test-only: hold after this step.
    pub pause: Option<Pause>,
    pub plan: PlanOptions,
    /// How pods outside muster are kept off the devices it plans with.
    pub fencing: Fencing,
    /// With leader election: whether this process still leads, checked before every
    /// write.
    pub lease: Option<LeaseGuard>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            schedule_timeout: Duration::from_secs(120),
            starvation_after: Duration::from_secs(600),
            write_parallelism: 64,
            commit_parallelism: 16,
            fault: None,
            pause: None,
            plan: PlanOptions::default(),
            fencing: Fencing::default(),
            lease: None,
        }
    }
}

/// What the loop remembers about a gang that does not fit.
struct Waiting {
    since: Instant,
    next_try: Instant,
    failures: u32,
    changes_seen: u64,
    /// The nodes it could use on the cluster with nothing else on it, if it would fit
    /// there: only such a gang may hold the queue back once it has waited long (the
    /// starvation rule), and only on these nodes.
    reach: Option<Arc<BTreeSet<String>>>,
}

/// Nodes held for gangs that have waited longest (the starvation rule): gangs of equal
/// or lower priority are planned without them.
#[derive(Clone, Default)]
struct Held {
    /// Each holder's priority, name and nodes.
    holders: Vec<(i32, ObjectKey, Arc<BTreeSet<String>>)>,
}

impl Held {
    fn hold(&mut self, priority: i32, gang: &ObjectKey, reach: &Arc<BTreeSet<String>>) {
        self.holders.push((priority, gang.clone(), reach.clone()));
    }

    /// The nodes held against a gang of `priority`.
    fn against(&self, priority: i32) -> BTreeSet<String> {
        self.holders
            .iter()
            .filter(|(p, _, _)| *p >= priority)
            .flat_map(|(_, _, nodes)| nodes.iter().cloned())
            .collect()
    }

    /// "a has waited longest", "a and b have waited longest" ...
    fn message(&self, priority: i32) -> String {
        let by: Vec<&str> = self
            .holders
            .iter()
            .filter(|(p, _, _)| *p >= priority)
            .map(|(_, g, _)| g.as_str())
            .collect();
        match by.as_slice() {
            [one] => format!("{one} has waited longest and keeps the nodes it could use (starvation rule)"),
            many => format!(
                "{} have waited longest and keep the nodes they could use (starvation rule)",
                many.join(", ")
            ),
        }
    }
}

/// Why a commit or a step stopped.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("Kubernetes API request failed: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Conflict(String),
    #[error("planning stopped: {0}")]
    Planning(String),
}

/// Objects this loop wrote, by `namespace/name`, until the cache shows them: the loop
/// reads its own writes, so it never acts on a copy older than what it did.
struct OwnWrites<K> {
    objects: std::sync::Mutex<HashMap<ObjectKey, Arc<K>>>,
}

impl<K> Default for OwnWrites<K> {
    fn default() -> Self {
        OwnWrites {
            objects: std::sync::Mutex::default(),
        }
    }
}

/// How long Kueue waits before it gives quota again to a gang whose devices muster could
/// not reserve inside Kueue's decision.
const KUEUE_RETRY_SECONDS: i64 = 15;

/// How long the commit's conflict check waits for the claim watch before it lists.
const CONFLICT_CHECK_WAIT: Duration = Duration::from_secs(5);

fn version<K: kube::Resource>(object: &K) -> u64 {
    object
        .meta()
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

impl<K: kube::Resource> OwnWrites<K> {
    fn remember(&self, object: K) {
        let key = convert::object_key(&object);
        self.objects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, Arc::new(object));
    }

    /// `cached`, or this loop's newer write of the same object.
    fn overlay(&self, cached: Arc<K>) -> Arc<K> {
        let key = convert::object_key(cached.as_ref());
        let mut objects = self.objects.lock().unwrap_or_else(|p| p.into_inner());
        match objects.get(&key) {
            Some(own) if own.meta().uid == cached.meta().uid && version(own.as_ref()) > version(cached.as_ref()) => {
                own.clone()
            }
            Some(_) => {
                objects.remove(&key);
                cached
            }
            None => cached,
        }
    }

    /// Forgets writes of objects the cache no longer has.
    fn prune(&self, exists: impl Fn(&ObjectKey) -> bool) {
        self.objects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|key, _| exists(key));
    }
}

pub struct Admission {
    pub(crate) client: Client,
    pub(crate) index: Arc<Index>,
    workloads: Store<Workload>,
    pub(crate) stores: GangStores,
    priorities: Store<PriorityClass>,
    recorder: Recorder,
    pub(crate) settings: Settings,
    wake: Arc<Notify>,
    waiting: HashMap<ObjectKey, Waiting>,
    /// Nodes held by the starvation rule as of the last pass.
    held: Held,
    /// Workloads as returned by this loop's own status writes, until the cache shows them.
    written: std::sync::Mutex<HashMap<ObjectKey, Arc<Workload>>>,
    own_pods: OwnWrites<Pod>,
    own_claims: OwnWrites<ResourceClaim>,
    /// Fault points already passed (each aborts at its first write).
    passed: std::sync::Mutex<BTreeSet<String>>,
    /// The gang objects of the caches, grouped once per pass.
    gangs: std::sync::Mutex<Arc<GangIndex>>,
    /// Since when a gang's claim has looked doubly allocated, by (gang, claim).
    conflicts_seen: std::sync::Mutex<HashMap<(ObjectKey, String), Instant>>,
}

/// How long a double allocation of a released gang's device must last before the gang
/// gives way.
const CONFLICT_SETTLE: Duration = Duration::from_secs(2);

/// Conditions the admission loop owns.
const ADMISSION_CONDITIONS: [&str; 4] = [
    conditions::ADMITTED,
    conditions::RESTARTING,
    conditions::SUCCEEDED,
    conditions::FAILED,
];

/// One condition the admission loop sets.
pub(crate) struct ConditionUpdate {
    pub(crate) type_: &'static str,
    pub(crate) status: bool,
    pub(crate) reason: String,
    pub(crate) message: String,
}

/// A change to the admission loop's part of the status: the conditions it sets (the
/// others it owns are kept), the placement (`None` removes it), and the restart count
/// (`None` keeps it).
pub(crate) struct StatusUpdate {
    pub(crate) conditions: Vec<ConditionUpdate>,
    pub(crate) placement: Option<PlacementStatus>,
    pub(crate) restarts: Option<i32>,
}

/// A Workload's identity, as logs and messages name the gang.
pub(crate) fn key(workload: &Workload) -> ObjectKey {
    convert::object_key(workload)
}

pub(crate) fn placement_of(workload: &Workload) -> Option<&PlacementStatus> {
    workload.status.as_ref()?.placement.as_ref()
}

pub(crate) fn now() -> Time {
    Time(Timestamp::now())
}

fn condition_type(type_: ConditionType) -> &'static str {
    match type_ {
        ConditionType::Admitted => conditions::ADMITTED,
        ConditionType::Restarting => conditions::RESTARTING,
        ConditionType::Succeeded => conditions::SUCCEEDED,
        ConditionType::Failed => conditions::FAILED,
    }
}

fn event_reason(kind: EventKind) -> &'static str {
    match kind {
        EventKind::Admitted => conditions::EVENT_ADMITTED,
        EventKind::RolledBack => conditions::EVENT_ROLLED_BACK,
        EventKind::ScheduleTimeout => conditions::EVENT_SCHEDULE_TIMEOUT,
        EventKind::Restarting => conditions::EVENT_RESTARTING,
        EventKind::Succeeded => conditions::EVENT_SUCCEEDED,
        EventKind::Failed => conditions::EVENT_FAILED,
        EventKind::Expired => conditions::EVENT_EXPIRED,
    }
}

fn write_of(effect: &Effect) -> Option<Write> {
    match effect {
        Effect::Record(_) => Some(Write::Record),
        Effect::DeletePods { .. } => Some(Write::Delete),
        Effect::Deallocate { .. } => Some(Write::Deallocate),
        Effect::Release { .. } => Some(Write::Release),
        Effect::DeleteWorkload | Effect::Event { .. } => None,
    }
}

impl Admission {
    pub fn new(
        client: Client,
        index: Arc<Index>,
        workloads: Store<Workload>,
        stores: GangStores,
        priorities: Store<PriorityClass>,
        settings: Settings,
        wake: Arc<Notify>,
    ) -> Self {
        let reporter = Reporter {
            controller: labels::ADMISSION_FIELD_MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Admission {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            index,
            workloads,
            stores,
            priorities,
            settings,
            wake,
            waiting: HashMap::new(),
            held: Held::default(),
            written: std::sync::Mutex::default(),
            own_pods: OwnWrites::default(),
            own_claims: OwnWrites::default(),
            passed: std::sync::Mutex::default(),
            conflicts_seen: std::sync::Mutex::default(),
            gangs: std::sync::Mutex::default(),
        }
    }

    /// Stops the process before a write once the Lease may be someone else's: a leader
    /// that was stalled (a long pause, a stopped process) must not write after a
    /// follower could have taken over.
    pub(crate) fn ensure_leading(&self) {
        if let Some(lease) = &self.settings.lease {
            lease.exit_unless_held();
        }
    }

    fn core_settings(&self) -> muster_admission::Settings {
        let timeout = self.settings.schedule_timeout.as_millis() as i64;
        muster_admission::Settings {
            schedule_timeout: timeout,
            release_timeout: timeout,
        }
    }

    /// Runs until the process stops.
    pub async fn run(mut self) {
        self.index.wait_ready().await;
        self.stores.wait_until_ready().await;
        let _ = self.workloads.wait_until_ready().await;
        let _ = self.priorities.wait_until_ready().await;
        info!("admission loop started");
        loop {
            let started = Instant::now();
            let next = self.pass().await;
            // At most ten passes a second, however busy the cluster is.
            let pause = Duration::from_millis(100).saturating_sub(started.elapsed());
            tokio::time::sleep(pause).await;
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = self.index.changed.notified() => {}
                _ = tokio::time::sleep(next) => {}
            }
        }
    }

    fn gangs(&self) -> Arc<GangIndex> {
        self.gangs.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The gang's pods: the cache (as grouped for this pass), with this loop's own
    /// newer writes.
    pub(crate) fn gang_pods(&self, workload: &Workload) -> Vec<Arc<Pod>> {
        let namespace = workload.namespace().unwrap_or_default();
        self.gangs()
            .pods(&namespace, &workload.name_any())
            .iter()
            .map(|p| self.own_pods.overlay(p.clone()))
            .collect()
    }

    /// The gang's claims: the cache (as grouped for this pass), with this loop's own
    /// newer writes.
    pub(crate) fn gang_claims(&self, workload: &Workload) -> Vec<Arc<ResourceClaim>> {
        let namespace = workload.namespace().unwrap_or_default();
        self.gangs()
            .claims(&namespace, &workload.name_any())
            .iter()
            .map(|c| self.own_claims.overlay(c.clone()))
            .collect()
    }

    /// One look at every gang. Returns how long to wait at most before the next pass.
    async fn pass(&mut self) -> Duration {
        // A safety net: every event wakes the loop anyway.
        let mut next = Duration::from_secs(5);
        let workloads = self.current_workloads();
        *self.gangs.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(GangIndex::of(&self.stores));
        self.reconcile_assumptions(&workloads);
        self.prune_conflicts(&workloads);
        self.collect_claims().await;
        let keys = |store: Vec<Arc<Pod>>| -> BTreeSet<ObjectKey> {
            store.iter().map(|p| convert::object_key(p.as_ref())).collect()
        };
        let pods = keys(self.stores.pods.state());
        self.own_pods.prune(|k| pods.contains(k));
        let claims: BTreeSet<ObjectKey> = self
            .stores
            .claims
            .state()
            .iter()
            .map(|c| convert::object_key(c.as_ref()))
            .collect();
        self.own_claims.prune(|k| claims.contains(k));

        for workload in workloads.iter().filter(|w| w.metadata.deletion_timestamp.is_none()) {
            if let Err(e) = self.advance(workload, &mut next).await {
                warn!(workload = %key(workload), error = %e, "admission step failed; retrying");
                next = next.min(Duration::from_secs(2));
            }
        }
        self.sync_kueue(&workloads).await;

        let mut queue: Vec<(i32, Timestamp, ObjectKey, Arc<Workload>)> = workloads
            .iter()
            .filter(|w| self.admissible(w))
            .map(|w| {
                let created = w
                    .metadata
                    .creation_timestamp
                    .as_ref()
                    .map(|t| t.0)
                    .unwrap_or(Timestamp::UNIX_EPOCH);
                (self.priority(w), created, key(w), w.clone())
            })
            .collect();
        queue.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        record_phases(&workloads, queue.len());
        // Only gangs in the queue wait; a suspended or finished one starts afresh.
        let queued: BTreeSet<ObjectKey> = queue.iter().map(|(_, _, k, _)| k.clone()).collect();
        self.waiting.retain(|k, _| queued.contains(k));

        let changes = self.index.changes();
        let mut held = Held::default();
        let mut planned: Vec<PlannedGang> = Vec::new();
        // Within a pass the cluster only fills up: a gang shaped like one that did not
        // fit does not fit either, and is not planned again.
        let mut unfit: HashMap<String, (String, Planned)> = HashMap::new();
        for (priority, _, name, workload) in queue {
            // The cache may not show this pass's own commits yet.
            if self
                .written
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&name)
                .is_some_and(|w| placement_of(w).and_then(|p| p.state).is_some())
            {
                continue;
            }
            // The queue is in priority order: every gang holding nodes so far has at
            // least this one's priority.
            if let Some(waiting) = self.waiting.get(&name) {
                let due = Instant::now() >= waiting.next_try
                    && (waiting.changes_seen != changes || waiting.next_try.elapsed() > Duration::from_secs(300));
                if !due {
                    next = next.min(
                        waiting
                            .next_try
                            .saturating_duration_since(Instant::now())
                            .max(Duration::from_millis(100)),
                    );
                    if waiting.since.elapsed() > self.settings.starvation_after
                        && let Some(reach) = &waiting.reach
                    {
                        held.hold(priority, &name, reach);
                    }
                    continue;
                }
            }
            let outcome = match self.try_plan(&workload, priority, &held, &mut unfit).await {
                Ok(Attempt::Placed { request, plan }) => {
                    // The gangs planned after this one must see its devices and pods as
                    // taken.
                    let (pods, claims) = plan.assumption(&request);
                    self.index
                        .update(|c| c.assume(&PlanId::Gang(name.clone()), &pods, &claims));
                    planned.push(PlannedGang {
                        name,
                        priority,
                        workload,
                        request: *request,
                        plan: *plan,
                    });
                    // A batch of planned gangs is committed at once; the next batch is
                    // planned on what this one left.
                    if planned.len() >= self.settings.commit_parallelism.max(1) {
                        self.commit_batch(std::mem::take(&mut planned), changes, &mut held, &mut next)
                            .await;
                    }
                    continue;
                }
                Ok(Attempt::Stale) => {
                    // It uses a claim that a planned commit allocates, or that the index
                    // shows allocated before the cache does. Planned again next pass,
                    // and no gang behind it goes first meanwhile.
                    next = next.min(Duration::from_millis(100));
                    break;
                }
                Ok(Attempt::Done(admit)) => Ok(admit),
                Err(e) => Err(e),
            };
            self.settle_attempt(&name, priority, outcome, changes, &mut held, &mut next);
        }
        self.commit_batch(planned, changes, &mut held, &mut next).await;
        // Extras of running gangs keep off them too, until the next pass says again.
        self.held = held;
        next
    }

    /// Commits planned gangs at once: each commit is a chain of round trips, and their
    /// plans cannot overlap, each planned with the ones before it assumed.
    async fn commit_batch(&mut self, batch: Vec<PlannedGang>, changes: u64, held: &mut Held, next: &mut Duration) {
        if batch.is_empty() {
            return;
        }
        let this = &*self;
        let parallelism = batch.len();
        let committed: Vec<(PlannedGang, Result<Admit, CommitError>)> = stream::iter(batch)
            .map(|gang| async move {
                let outcome = this.commit_planned(&gang.workload, &gang.request, &gang.plan).await;
                (gang, outcome)
            })
            .buffer_unordered(parallelism)
            .collect()
            .await;
        for (gang, outcome) in committed {
            self.settle_attempt(&gang.name, gang.priority, outcome, changes, held, next);
        }
    }

    /// Remembers how an attempt to admit gang `name` ended: a committed gang stops
    /// waiting; any other waits with a growing backoff, and holds its nodes once it has
    /// waited past the starvation limit.
    fn settle_attempt(
        &mut self,
        name: &ObjectKey,
        priority: i32,
        outcome: Result<Admit, CommitError>,
        changes: u64,
        held: &mut Held,
        next: &mut Duration,
    ) {
        if matches!(outcome, Ok(Admit::Committed)) {
            self.waiting.remove(name);
            return;
        }
        let reach = match &outcome {
            Ok(Admit::DoesNotFit { reach }) => reach.clone(),
            // A commit that failed, or an invalid request, waits like a gang that does
            // not fit, but never holds the queue back.
            Ok(Admit::Committed | Admit::RolledBack | Admit::Invalid) | Err(_) => None,
        };
        if let Err(e) = &outcome {
            warn!(workload = %name, error = %e, "admission failed");
        }
        let entry = self.waiting.entry(name.clone()).or_insert(Waiting {
            since: Instant::now(),
            next_try: Instant::now(),
            failures: 0,
            changes_seen: 0,
            reach: None,
        });
        entry.failures += 1;
        entry.changes_seen = changes;
        // A gang that would fit an emptied cluster waits for capacity: it is tried again
        // as soon as the cluster changes, at most once a second. Anything else (a failed
        // commit, a gang too big for the cluster) backs off: 1 s, 2 s, 4 s ... at most a
        // minute between attempts.
        let backoff = if reach.is_some() {
            Duration::from_secs(1)
        } else {
            Duration::from_secs(1u64 << entry.failures.min(7).saturating_sub(1)).min(Duration::from_secs(60))
        };
        entry.reach = reach;
        entry.next_try = Instant::now() + backoff;
        *next = (*next).min(backoff);
        if entry.since.elapsed() > self.settings.starvation_after
            && let Some(reach) = &entry.reach
        {
            held.hold(priority, name, reach);
        }
    }

    /// Waiting for admission: every object exists, not suspended, not being deleted.
    fn admissible(&self, workload: &Workload) -> bool {
        if workload.metadata.deletion_timestamp.is_some() || workload.spec.suspend == Some(true) {
            return false;
        }
        if finished(workload) {
            return false;
        }
        if placement_of(workload).and_then(|p| p.state).is_some() {
            return false;
        }
        if self.held_by_kueue(workload) {
            return false;
        }
        let created = condition(workload, conditions::CREATED)
            .is_some_and(|c| c.status == "True" && c.observed_generation == workload.metadata.generation);
        if !created {
            return false;
        }
        let expected: i32 = workload
            .spec
            .pod_groups
            .iter()
            .filter(|g| g.template.is_some())
            .map(|g| g.replicas)
            .sum();
        let pods = self.gang_pods(workload);
        let attempt = membership::attempt(workload);
        let gated = pods
            .iter()
            .filter(|p| crate::workload::status::is_gated(p) && p.metadata.deletion_timestamp.is_none())
            .filter(|p| membership::of_attempt(p, attempt))
            .count();
        // Pods of template-less groups: at least minCount, all waiting at the gate.
        let external_ready = workload
            .spec
            .pod_groups
            .iter()
            .filter(|g| g.template.is_none())
            .all(|g| {
                let members = crate::workload::membership::external_members(&pods, g);
                members.len() as i32 >= g.min_count() && members.iter().all(|p| crate::workload::status::is_gated(p))
            });
        gated as i32 >= expected && external_ready
    }

    /// Nodes held by the starvation rule (as of the last pass) against `workload`.
    pub(crate) fn held_against(&self, workload: &Workload) -> BTreeSet<String> {
        self.held.against(self.priority(workload))
    }

    fn priority(&self, workload: &Workload) -> i32 {
        let Some(class) = &workload.spec.priority_class_name else {
            // The global default class, if one is marked default.
            return self
                .priorities
                .state()
                .iter()
                .find(|p| p.global_default == Some(true))
                .map_or(0, |p| p.value.unwrap_or(0));
        };
        self.priorities
            .state()
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(class))
            .map_or(0, |p| p.value.unwrap_or(0))
    }

    /// The gang request for a Workload whose objects exist: claims from the cluster.
    pub(crate) fn request(&self, workload: &Workload) -> Result<GangRequest, RequestError> {
        let namespace = workload.namespace().unwrap_or_default();
        // A claim this loop deallocated that the cache still shows allocated would be
        // planned as the gang's own: wait until the cache catches up.
        let gangs = self.gangs();
        let claims = gangs.claims(&namespace, &workload.name_any());
        for claim in claims {
            if !Arc::ptr_eq(&self.own_claims.overlay(claim.clone()), claim) {
                return Err(RequestError::DeallocationNotSeen(claim.name_any()));
            }
        }
        // Claims muster made or joined carry a gang's label; one the Workload shares with
        // another carries the other's.
        let sources = ClaimSources::from_claims(gangs.namespace_claims(&namespace).iter().map(AsRef::as_ref));
        let pods = if crate::workload::membership::has_external_groups(workload) {
            self.gang_pods(workload)
        } else {
            Vec::new()
        };
        let mut request = gang_request(workload, &sources, &pods)?;
        // muster's pods or claims tolerate the fence that keeps others off the devices.
        self.settings.fencing.apply(&mut request);
        Ok(request)
    }

    /// Plans a gang of `priority`, without the nodes `held` against it for gangs that
    /// have waited longest, and commits it if it fits.
    /// Plans gang `workload`: a plan to commit, or how the attempt ended (its status and
    /// Kueue's check already say why).
    async fn try_plan(
        &self,
        workload: &Workload,
        priority: i32,
        held: &Held,
        unfit: &mut HashMap<String, (String, Planned)>,
    ) -> Result<Attempt, CommitError> {
        let request = match self.request(workload) {
            Ok(request) => request,
            Err(e) if e.is_waiting() => return Ok(Attempt::Done(Admit::DoesNotFit { reach: None })),
            Err(e) => {
                let message = e.to_string();
                if condition(workload, conditions::ADMITTED).map(|c| c.message.as_str()) != Some(message.as_str()) {
                    self.set_admitted(workload, false, conditions::REASON_INVALID_REQUEST, &message, None)
                        .await?;
                }
                // Kueue would hold the quota for it with the check pending, for ever.
                self.answer_check(workload, "Rejected", &message, None).await?;
                return Ok(Attempt::Done(Admit::Invalid));
            }
        };
        let started = Instant::now();
        // Inside Kueue's decision: the nodes of its flavors and topology domains.
        let mut excluded = held.against(priority);
        let cluster = self.index.snapshot();
        if uses_a_claim_allocated_meanwhile(&request, &cluster) {
            return Ok(Attempt::Stale);
        }
        if let Some(allowed) = self.kueue_allowed_nodes(workload, &cluster) {
            excluded.extend(cluster.nodes().map(|n| n.name.clone()).filter(|n| !allowed.contains(n)));
        }
        drop(cluster);
        // Kueue's decision differs per gang; otherwise the shape, the priority and the
        // held nodes decide the outcome.
        let shape = self
            .kueue_object(workload)
            .is_not_queued()
            .then(|| format!("{priority}|{excluded:?}|{}", shape_signature(&request)));
        let planned = match shape.as_ref().and_then(|s| unfit.get(s)) {
            Some((planned_gang, known)) => {
                // The reasons name the gang that was planned: name this one instead.
                let mut planned = known.clone();
                if let Outcome::Unschedulable(why) = &mut planned.outcome {
                    for reason in &mut why.reasons {
                        *reason = reason.replace(planned_gang.as_str(), &request.name);
                    }
                }
                planned
            }
            None => {
                let planned = self.plan_off_runtime(workload, request.clone(), excluded).await?;
                if let Some(shape) = shape
                    && matches!(planned.outcome, Outcome::Unschedulable(_))
                {
                    unfit.insert(shape, (request.name.clone(), planned.clone()));
                }
                planned
            }
        };
        let (outcome, reach) = (planned.outcome, planned.reach);
        let planned_in = started.elapsed();
        let label = OutcomeLabel {
            outcome: if matches!(outcome, Outcome::Placed(_)) {
                "placed"
            } else {
                "unschedulable"
            },
        };
        metrics::get()
            .plan_duration
            .get_or_create(&label)
            .observe(metrics::seconds(planned_in));
        match outcome {
            Outcome::Unschedulable(why) => {
                let mut message = why.to_string();
                if reach.is_none() {
                    message.push_str("; it would not fit even on an empty cluster");
                }
                let reason = if planned.held_back {
                    message = format!("{}; elsewhere: {message}", held.message(priority));
                    conditions::REASON_WAITING_BEHIND
                } else {
                    conditions::REASON_UNSCHEDULABLE
                };
                let previous = condition(workload, conditions::ADMITTED).map(|c| (c.reason.clone(), c.message.clone()));
                if previous != Some((reason.to_string(), message.clone())) {
                    info!(workload = %key(workload), reason = %message, "gang does not fit");
                    self.set_admitted(workload, false, reason, &message, None).await?;
                    self.event(
                        workload,
                        EventType::Normal,
                        conditions::EVENT_UNSCHEDULABLE,
                        "Plan",
                        message.clone(),
                    )
                    .await;
                }
                // Kueue reserved quota and asked: not now (it requeues the gang and
                // frees the quota meanwhile), or never.
                if reach.is_some() {
                    self.answer_check(workload, "Retry", &message, Some(KUEUE_RETRY_SECONDS))
                        .await?;
                } else {
                    self.answer_check(workload, "Rejected", &message, None).await?;
                }
                Ok(Attempt::Done(Admit::DoesNotFit { reach }))
            }
            Outcome::Placed(plan) => {
                info!(workload = %key(workload), pods = plan.pods.len(), devices = plan.device_count(), planned_ms = planned_in.as_millis() as u64, "gang fits; committing");
                Ok(Attempt::Placed {
                    request: Box::new(request),
                    plan: Box::new(plan),
                })
            }
        }
    }

    /// Commits a planned gang whose plan the index already assumes.
    async fn commit_planned(
        &self,
        workload: &Workload,
        request: &GangRequest,
        plan: &Plan,
    ) -> Result<Admit, CommitError> {
        let started = Instant::now();
        let committed = self
            .commit(workload, request, plan)
            .instrument(info_span!("commit", workload = %key(workload)))
            .await;
        let outcome = if matches!(committed, Ok(true)) {
            "committed"
        } else {
            "failed"
        };
        metrics::get()
            .commit_duration
            .get_or_create(&OutcomeLabel { outcome })
            .observe(metrics::seconds(started.elapsed()));
        Ok(if committed? {
            Admit::Committed
        } else {
            Admit::RolledBack
        })
    }

    /// Plans on a snapshot of the cluster, on a blocking thread: watches go on meanwhile,
    /// and the commit's conflict check catches what they show too late. `held` nodes
    /// are left out.
    async fn plan_off_runtime(
        &self,
        workload: &Workload,
        request: GangRequest,
        held: BTreeSet<String>,
    ) -> Result<Planned, CommitError> {
        let cluster = self.index.snapshot();
        let unlimited = self.settings.plan.clone();
        let options = PlanOptions {
            excluded_nodes: Arc::new(held),
            ..unlimited.clone()
        };
        let span = info_span!("plan", workload = %key(workload));
        tokio::task::spawn_blocking(move || {
            let _span = span.entered();
            let outcome = placement::plan(&cluster, &request, &options);
            if matches!(outcome, Outcome::Placed(_)) {
                return Planned {
                    outcome,
                    reach: None,
                    held_back: false,
                };
            }
            let held_back = !options.excluded_nodes.is_empty()
                && matches!(placement::plan(&cluster, &request, &unlimited), Outcome::Placed(_));
            let empty = cluster.emptied();
            let reach = match placement::plan(&empty, &request, &unlimited) {
                Outcome::Placed(plan) => Some(Arc::new(reach(&empty, &request, &plan, &unlimited))),
                Outcome::Unschedulable(_) => None,
            };
            Planned {
                outcome,
                reach,
                held_back,
            }
        })
        .await
        .map_err(|e| CommitError::Planning(e.to_string()))
    }

    fn fault(&self, point: FaultPoint) {
        if self.settings.fault == Some(point) {
            eprintln!("fault point {} reached: aborting", point.name());
            std::process::abort();
        }
    }

    /// Runs `write` for every item, `--write-parallelism` at a time, and fails with the
    /// first error once all have run. A test may abort after the first success (`first`).
    async fn write_all<'i, T, F, Fut, R>(
        &self,
        items: &'i [T],
        first: FaultPoint,
        write: F,
    ) -> Result<Vec<R>, CommitError>
    where
        F: Fn(&'i T) -> Fut,
        Fut: std::future::Future<Output = Result<R, CommitError>>,
    {
        let first_done = std::sync::atomic::AtomicBool::new(false);
        let results: Vec<Result<R, CommitError>> = stream::iter(items)
            .map(|item| {
                let written = write(item);
                let first_done = &first_done;
                async move {
                    let result = written.await?;
                    if !first_done.swap(true, std::sync::atomic::Ordering::SeqCst) {
                        self.checkpoint(first).await;
                    }
                    Ok(result)
                }
            })
            .buffer_unordered(self.settings.write_parallelism.max(1))
            .collect()
            .await;
        let mut done = Vec::with_capacity(results.len());
        let mut failed = None;
        for result in results {
            match result {
                Ok(r) => done.push(r),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// [`Self::fault`], then a test's pause at `point`, if either is set.
    async fn checkpoint(&self, point: FaultPoint) {
        self.fault(point);
        let Some(pause) = self.settings.pause.as_ref().filter(|p| p.point == point) else {
            return;
        };
        warn!(until = %pause.until.display(), "pause point {} reached: waiting", point.name());
        while !pause.until.exists() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every assumption ends with the commit that made it: confirmed once the gang is
    /// released, forgotten once it holds nothing or is gone. A commit whose final record
    /// failed (or a Workload deleted mid-commit) would otherwise leave one behind, and
    /// devices would look taken for good.
    fn reconcile_assumptions(&self, workloads: &[Arc<Workload>]) {
        let states: HashMap<ObjectKey, Option<AdmissionState>> = workloads
            .iter()
            .filter(|w| w.metadata.deletion_timestamp.is_none())
            .map(|w| (key(w), placement_of(w).and_then(|p| p.state)))
            .collect();
        let plans: Vec<PlanId> = self.index.cluster().assumed_plans().cloned().collect();
        for plan in plans {
            let gang = match &plan {
                PlanId::Gang(gang) => gang,
                // An extras commit ends within the call that made it.
                PlanId::Extras(_) => {
                    self.index.update(|c| c.forget(&plan));
                    continue;
                }
            };
            match states.get(gang) {
                Some(Some(AdmissionState::Reserving | AdmissionState::Reserved)) => {}
                Some(Some(AdmissionState::Released | AdmissionState::Restarting)) => {
                    self.index.update(|c| c.confirm(&plan))
                }
                _ => self.index.update(|c| c.forget(&plan)),
            }
        }
    }

    /// Forgets double-allocation sightings of gangs that are gone.
    fn prune_conflicts(&self, workloads: &[Arc<Workload>]) {
        let live: BTreeSet<ObjectKey> = workloads.iter().map(|w| key(w)).collect();
        self.conflicts_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(gang, _), _| live.contains(gang));
    }

    /// Of `seen` (the gang's claims whose devices another claim holds too, as the
    /// index shows now), those seen so continuously for [`CONFLICT_SETTLE`].
    /// The second value: whether some are still settling.
    fn lasting_conflicts(&self, workload: &Workload, seen: Vec<String>) -> (Vec<String>, bool) {
        let gang = key(workload);
        let mut since = self.conflicts_seen.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        since.retain(|(g, claim), _| *g != gang || seen.contains(claim));
        let settling = !seen.is_empty();
        let lasting: Vec<String> = seen
            .into_iter()
            .filter(|claim| {
                let first = *since.entry((gang.clone(), claim.clone())).or_insert(now);
                now.duration_since(first) >= CONFLICT_SETTLE
            })
            .collect();
        let settling = settling && lasting.is_empty();
        (lasting, settling)
    }

    /// The core's picture of a placed gang, and its next step.
    fn observe_and_decide(&self, workload: &Workload) -> (Option<Journal>, muster_admission::Step) {
        let journal = observe::journal(workload);
        let mut spec = observe::spec(workload);
        // An eviction by Kueue takes the gang apart as a suspend does; the Workload
        // controller keeps its gated pods for the next admission.
        spec.suspend |= self.evicted_by_kueue(workload);
        let pods = self.gang_pods(workload);
        let pod_views: Vec<PodView> = pods.iter().map(|p| observe::pod(p)).collect();
        let claims = self.gang_claims(workload);
        let claim_views: Vec<ClaimView> = claims.iter().map(|c| observe::claim(c)).collect();
        let (nodes, devices_published, conflicted, settling) = {
            let cluster = self.index.cluster();
            let names: BTreeSet<&str> = journal
                .iter()
                .flat_map(|j| &j.nodes)
                .map(String::as_str)
                .chain(pod_views.iter().filter_map(|p| p.node.as_deref()))
                .collect();
            let nodes: BTreeMap<String, NodeHealth> = names
                .into_iter()
                .filter_map(|n| {
                    let node = cluster.node(n)?;
                    let health = if node.unschedulable {
                        NodeHealth::Unschedulable
                    } else {
                        NodeHealth::Ready
                    };
                    Some((n.to_string(), health))
                })
                .collect();
            let conflicted: Vec<String> = claims
                .iter()
                .filter(|c| {
                    journal
                        .iter()
                        .flat_map(|j| &j.claims)
                        .any(|name| Some(name) == c.metadata.name.as_ref())
                })
                .filter(|c| {
                    c.status
                        .as_ref()
                        .and_then(|s| s.allocation.as_ref())
                        .into_iter()
                        .flat_map(|a| a.devices.iter().flat_map(|d| d.results.iter().flatten()))
                        .filter(|r| r.admin_access != Some(true) && r.share_id.is_none())
                        .any(|r| cluster.exclusive_holders(&r.driver, &r.pool, &r.device) > 1)
                })
                .map(|c| c.name_any())
                .collect();
            // The index can lag (a deallocation seen after the allocation that followed
            // it): only an overlap that lasts is a conflict.
            let (conflicted, settling) = self.lasting_conflicts(workload, conflicted);
            let published = claims
                .iter()
                .filter(|c| {
                    journal
                        .iter()
                        .flat_map(|j| &j.claims)
                        .any(|name| Some(name) == c.metadata.name.as_ref())
                })
                .filter_map(|c| c.status.as_ref()?.allocation.as_ref())
                .flat_map(|a| a.devices.iter().flat_map(|d| d.results.iter().flatten()))
                .all(|r| cluster.device_published(&r.driver, &r.pool, &r.device));
            (nodes, published, conflicted, settling)
        };
        let gang = Gang {
            spec: &spec,
            journal: journal.as_ref(),
            restarts: membership::attempt(workload),
            finished_at: observe::finished_at(workload),
            pods: &pod_views,
            claims: &claim_views,
            nodes: &nodes,
            devices_published,
            conflicted: &conflicted,
            now: observe::now_millis(),
        };
        let mut step = muster_admission::decide(&gang, &self.core_settings());
        if settling {
            step = step.then_recheck_in(500);
        }
        (journal, step)
    }

    /// One step of a placed gang's state machine; a released gang's waiting extras are
    /// placed when nothing else is to be done.
    async fn advance(&self, workload: &Workload, next: &mut Duration) -> Result<(), CommitError> {
        let (journal, step) = self.observe_and_decide(workload);
        let state = journal.as_ref().map(|j| j.state);
        if !step.effects.is_empty() {
            tracing::debug!(workload = %key(workload), ?state, effects = ?step.effects, "state machine step");
        }
        if let Some(millis) = step.recheck_in {
            *next = (*next).min(Duration::from_millis(millis.max(0) as u64 + 100));
        }
        let idle = step.effects.is_empty();
        self.execute(workload, state, step.effects).await?;
        if let Some(journal) = journal.filter(|j| idle && j.state == State::Released)
            && workload.spec.suspend != Some(true)
            && !self.evicted_by_kueue(workload)
        {
            self.place_extras(workload, &journal).await?;
        }
        Ok(())
    }

    /// Performs the state machine's effects in order, stopping at the first that fails.
    async fn execute(
        &self,
        workload: &Workload,
        state: Option<State>,
        effects: Vec<Effect>,
    ) -> Result<(), CommitError> {
        let namespace = workload.namespace().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        let claims: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
        for effect in effects {
            self.ensure_leading();
            let write = write_of(&effect);
            match effect {
                // A record that changes nothing is not written: a decision can never spin
                // on it.
                Effect::Record(record)
                    if record.conditions.is_empty()
                        && record.restarts.is_none()
                        && record.journal == observe::journal(workload) =>
                {
                    warn!(workload = %key(workload), "the state machine asked to record the journal unchanged; skipped");
                }
                Effect::Record(record) => {
                    self.fence_dropped_claims(workload, record.journal.as_ref(), &claims)
                        .await?;
                    self.record(workload, record).await?;
                }
                Effect::DeletePods {
                    pods: targets,
                    immediately,
                } => {
                    for target in targets {
                        self.ensure_leading();
                        let params = DeleteParams {
                            grace_period_seconds: immediately.then_some(0),
                            preconditions: Some(kube::api::Preconditions {
                                uid: Some(target.uid.clone()),
                                resource_version: None,
                            }),
                            ..DeleteParams::default()
                        };
                        match pods.delete(&target.name, &params).await {
                            Ok(either) => {
                                if let Some(pod) = either.left() {
                                    self.own_pods.remember(pod);
                                }
                            }
                            Err(e) => kube_ops::done_if_gone_or_changed(Err::<(), _>(e))?,
                        }
                    }
                }
                Effect::Deallocate {
                    claims: names,
                    finished,
                } => {
                    for name in names {
                        self.ensure_leading();
                        if let Some(claim) = deallocate(&claims, &name, &finished, &|| self.ensure_leading()).await? {
                            self.own_claims.remember(claim);
                        }
                    }
                }
                // Reserved for a gang Kueue has not admitted yet: the pods wait until
                // Kueue reads muster's answer to its check.
                Effect::Release { .. } if self.release_held_by_kueue(workload) => {
                    tracing::debug!(workload = %key(workload), "reserved; waiting for Kueue to admit before releasing");
                }
                Effect::Release { pods: pins } => {
                    let released = self
                        .write_all(&pins, FaultPoint::AfterFirstRelease, |pin| {
                            let api = pods.clone();
                            let cached = self
                                .gang_pods(workload)
                                .into_iter()
                                .find(|p| p.uid().as_deref() == Some(pin.pod.uid.as_str()));
                            async move {
                                self.ensure_leading();
                                release::release(
                                    &api,
                                    &pin.pod.name,
                                    &pin.pod.uid,
                                    &pin.node,
                                    cached.as_deref(),
                                    self.settings.fencing,
                                    &|| self.ensure_leading(),
                                )
                                .await
                                .map_err(CommitError::from)
                            }
                        })
                        .await?;
                    for pod in released.into_iter().flatten() {
                        self.own_pods.remember(pod);
                    }
                }
                Effect::DeleteWorkload => {
                    let api: Api<Workload> = Api::namespaced(self.client.clone(), &namespace);
                    kube_ops::done_if_gone_or_changed(
                        api.delete(&workload.name_any(), &DeleteParams::default()).await,
                    )?;
                }
                Effect::Event {
                    kind,
                    warning,
                    action,
                    note,
                } => {
                    if kind == EventKind::ScheduleTimeout {
                        metrics::get().schedule_timeouts.inc();
                    }
                    let type_ = if warning { EventType::Warning } else { EventType::Normal };
                    self.event(workload, type_, event_reason(kind), action, note).await;
                }
            }
            if let (Some(state), Some(write)) = (state, write) {
                self.transition_checkpoint(FaultPoint::After(state, write)).await;
            }
        }
        Ok(())
    }

    /// Claims a record stops naming (every one, when the gang is queued again): a fresh
    /// read must show each unallocated, so that a cache behind an allocation never lets
    /// one leak. Each is then fenced: its resourceVersion moves, so an allocation a
    /// deposed leader prepared against an older version (it reads a claim before its
    /// last Lease check) fails instead of landing after the gang let go.
    async fn fence_dropped_claims(
        &self,
        workload: &Workload,
        next: Option<&Journal>,
        api: &Api<ResourceClaim>,
    ) -> Result<(), CommitError> {
        let kept: BTreeSet<&str> = next.iter().flat_map(|j| &j.claims).map(String::as_str).collect();
        let named = placement_of(workload).map(|p| p.claims.clone()).unwrap_or_default();
        for name in named.iter().filter(|c| !kept.contains(c.as_str())) {
            let Some(claim) = api.get_opt(name).await? else {
                continue;
            };
            if claim.status.as_ref().is_some_and(|s| s.allocation.is_some()) {
                return Err(CommitError::Conflict(format!(
                    "claim {name} is still allocated; looking again before {} lets go of it",
                    key(workload)
                )));
            }
            let fence = json!({
                "metadata": {
                    "resourceVersion": claim.resource_version(),
                    "annotations": {labels::CLAIM_RELEASED_AT: observe::now_millis().to_string()},
                },
            });
            self.ensure_leading();
            let params = PatchParams {
                field_manager: Some(labels::ADMISSION_FIELD_MANAGER.into()),
                ..PatchParams::default()
            };
            match api.patch(name, &params, &Patch::Merge(&fence)).await {
                Ok(fenced) => self.own_claims.remember(fenced),
                Err(e) if kube_ops::is_not_found(&e) => {}
                Err(e) if kube_ops::is_conflict(&e) => {
                    return Err(CommitError::Conflict(format!(
                        "claim {name} changed while {} let go of it; looking again",
                        key(workload)
                    )));
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// A state machine's fault point: aborts (or pauses) at its first write only, so a
    /// restarted operator can get past it.
    async fn transition_checkpoint(&self, point: FaultPoint) {
        if self.settings.fault != Some(point) && self.settings.pause.as_ref().is_none_or(|p| p.point != point) {
            return;
        }
        if self
            .passed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(point.name())
        {
            self.checkpoint(point).await;
        }
    }

    /// Writes a status record of the state machine (against the journal observed), and
    /// keeps the metrics and the cluster model in step with it.
    pub(crate) async fn record(&self, workload: &Workload, record: Record) -> Result<Arc<Workload>, CommitError> {
        let update = StatusUpdate {
            conditions: record
                .conditions
                .iter()
                .map(|c| ConditionUpdate {
                    type_: condition_type(c.type_),
                    status: c.status,
                    reason: c.reason.as_str().to_string(),
                    message: c.message.clone(),
                })
                .collect(),
            placement: record.journal.as_ref().map(observe::placement),
            restarts: record.restarts,
        };
        let written = self.write_status(workload, update).await?;
        let gang = key(workload);
        if record
            .journal
            .as_ref()
            .is_some_and(|j| j.state == State::TearingDown && j.cause.as_ref().is_some_and(|c| c.0 == Reason::Conflict))
        {
            metrics::get().conflicts.inc();
        }
        for c in &record.conditions {
            match (c.type_, c.status) {
                (ConditionType::Restarting, true) => {
                    metrics::get()
                        .restarts
                        .get_or_create(&ReasonLabel {
                            reason: c.reason.as_str().to_string(),
                        })
                        .inc();
                }
                (ConditionType::Admitted, true) => {
                    self.index.update(|c| c.confirm(&PlanId::Gang(gang.clone())));
                    if workload.status.as_ref().is_none_or(|s| s.restarts == 0)
                        && let Some(created) = &workload.metadata.creation_timestamp
                    {
                        let waited = Timestamp::now().duration_since(created.0).unsigned_abs();
                        metrics::get().submit_to_admitted.observe(waited.as_secs_f64());
                    }
                }
                (ConditionType::Admitted, false) if record.journal.is_none() => {
                    self.index.update(|c| c.forget(&PlanId::Gang(gang.clone())));
                    metrics::get()
                        .rollbacks
                        .get_or_create(&ReasonLabel {
                            reason: c.reason.as_str().to_string(),
                        })
                        .inc();
                }
                _ => {}
            }
        }
        Ok(written)
    }

    /// Commits a plan: record, reserve, check, then release through the state machine.
    /// `Ok(false)`: the commit was undone.
    /// Records the plan, reserves every claim and releases the pods. The index assumes
    /// the plan already (the caller did, before planning the next gang); a commit that
    /// stops before its plan is recorded forgets the assumption.
    async fn commit(&self, workload: &Workload, request: &GangRequest, plan: &Plan) -> Result<bool, CommitError> {
        let gang = key(workload);
        let placement = core_placement(request, plan);
        let journal = commit::reserving(&placement, observe::now_millis());
        let recorded = match self
            .record(
                workload,
                reserving_record(journal.clone(), "reserving the gang's devices"),
            )
            .await
        {
            Ok(recorded) => recorded,
            Err(e) => {
                self.index.update(|c| c.forget(&PlanId::Gang(gang.clone())));
                return Err(e);
            }
        };
        self.checkpoint(FaultPoint::AfterPlanRecorded).await;

        if let Err(e) = self
            .reserve(plan)
            .instrument(info_span!("reserve", workload = %gang, claims = plan.claims.len()))
            .await
        {
            self.index.update(|c| c.forget(&PlanId::Gang(gang.clone())));
            self.fail_commit(&recorded, &journal, e).await?;
            return Ok(false);
        }
        metrics::get().reservations.inc();
        metrics::get().reserved_devices.inc_by(plan.device_count() as u64);
        let reserved = self
            .record(
                &recorded,
                reserving_record(
                    commit::reserved(&journal, observe::now_millis()),
                    "every claim is allocated; releasing pods",
                ),
            )
            .await?;
        self.checkpoint(FaultPoint::AfterReserved).await;
        // The state machine releases the pods, then records the gang as released.
        let mut next = Duration::MAX;
        async {
            self.advance(&reserved, &mut next).await?;
            let current = self.current_workload(&gang).unwrap_or(reserved.clone());
            self.advance(&current, &mut next).await
        }
        .instrument(info_span!("release", workload = %gang, pods = plan.pods.len()))
        .await?;
        Ok(true)
    }

    /// A commit that failed before every claim was allocated and checked: undo its own
    /// writes and record the cause; the state machine gives back whatever is left.
    async fn fail_commit(
        &self,
        recorded: &Workload,
        journal: &Journal,
        failure: (CommitError, Vec<ResourceClaim>),
    ) -> Result<(), CommitError> {
        let (error, written) = failure;
        let conflict = matches!(error, CommitError::Conflict(_));
        if conflict {
            metrics::get().conflicts.inc();
        }
        let reason = if conflict { Reason::Conflict } else { Reason::RolledBack };
        let message = format!("reserving failed and was undone: {error}");
        let namespace = recorded.namespace().unwrap_or_default();
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
        let written_names: BTreeSet<String> = written.iter().map(|c| c.name_any()).collect();
        self.undo_allocations(&api, written).await?;
        // Only the claims this commit allocated are left to give back: a claim someone
        // else allocated meanwhile is not the gang's to clear.
        let mut failed = commit::failed(journal, reason, message.clone());
        failed.claims.retain(|c| written_names.contains(c));
        self.record(
            recorded,
            Record {
                journal: Some(failed),
                conditions: vec![muster_admission::Condition {
                    type_: ConditionType::Admitted,
                    status: false,
                    reason,
                    message: message.clone(),
                }],
                restarts: None,
            },
        )
        .await?;
        warn!(workload = %key(recorded), "{message}");
        Ok(())
    }

    /// Undoes allocations a commit wrote, each only while the claim is as the commit
    /// left it: whatever changed it since is not the commit's to undo.
    pub(crate) async fn undo_allocations(
        &self,
        api: &Api<ResourceClaim>,
        written: Vec<ResourceClaim>,
    ) -> Result<(), CommitError> {
        for claim in written {
            self.ensure_leading();
            if let Some(claim) = undo_allocation(api, &claim).await? {
                self.own_claims.remember(claim);
            }
        }
        Ok(())
    }

    pub(crate) fn remember_pod(&self, pod: Pod) {
        self.own_pods.remember(pod);
    }

    /// Allocates every planned claim, each only if it is still unallocated, then checks
    /// that no other claim holds any of the devices. On error, the claims written so
    /// far come back with it.
    pub(crate) async fn reserve(&self, plan: &Plan) -> Result<(), (CommitError, Vec<ResourceClaim>)> {
        let timestamp = now();
        let written = std::sync::Mutex::new(Vec::new());
        let result = self
            .write_all(&plan.claims, FaultPoint::AfterFirstClaim, |claim| {
                let (namespace, name) = (claim.claim.namespace(), claim.claim.name());
                let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), namespace);
                let mut allocation = convert::allocation_to_kube(&claim.allocation);
                allocation.allocation_timestamp = Some(timestamp.clone());
                let written = &written;
                async move {
                    // Read, then check the Lease, then write against what was read: a
                    // leader deposed after its check writes against a version older
                    // than the successor's fence (see `fence_dropped_claims`).
                    self.ensure_leading();
                    let current = kube_ops::add_finalizer(&api, api.get(name).await?, labels::CLAIM_FINALIZER).await?;
                    self.ensure_leading();
                    if current.status.as_ref().is_some_and(|s| s.allocation.is_some()) {
                        return Err(CommitError::Conflict(format!(
                            "ResourceClaim {name} was allocated by someone else meanwhile"
                        )));
                    }
                    let patch = json!({
                        "metadata": {"resourceVersion": current.resource_version()},
                        "status": {"allocation": allocation},
                    });
                    let params = PatchParams {
                        field_manager: Some(labels::ADMISSION_FIELD_MANAGER.into()),
                        ..PatchParams::default()
                    };
                    let claim = api.patch_status(name, &params, &Patch::Merge(&patch)).await?;
                    self.own_claims.remember(claim.clone());
                    written.lock().unwrap_or_else(|p| p.into_inner()).push(claim);
                    Ok(())
                }
            })
            .await;
        let written = written.into_inner().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = result {
            return Err((e, written));
        }
        self.checkpoint(FaultPoint::AfterAllClaims).await;
        let newest = written.iter().map(version).max().unwrap_or(0);
        match self.check_conflicts(plan, newest).await {
            Ok(()) => Ok(()),
            Err(e) => Err((e, written)),
        }
    }

    /// No claim outside the gang holds a planned device, as of a moment after the
    /// gang's last claim write (`written`, its resourceVersion). The index answers once
    /// its claim watch has come that far; a fresh list of every claim if it lags.
    async fn check_conflicts(&self, plan: &Plan, written: u64) -> Result<(), CommitError> {
        let ours: BTreeSet<&str> = plan.claims.iter().map(|c| c.claim.as_str()).collect();
        let planned: BTreeMap<muster_engine::claim::DeviceId, &str> = plan
            .claims
            .iter()
            .flat_map(|c| {
                c.allocation
                    .devices
                    .iter()
                    .filter(|d| d.share_id.is_none() && d.admin_access != Some(true))
                    .map(move |d| (d.device_id(), c.claim.as_str()))
            })
            .collect();
        if written > 0 && self.index.wait_for_claims(written, CONFLICT_CHECK_WAIT).await {
            // Each of the gang's claims holds its own devices once: a second holder is
            // another claim.
            let cluster = self.index.cluster();
            for (id, mine) in &planned {
                if cluster.exclusive_holders(&id.driver, &id.pool, &id.device) > 1 {
                    let others: Vec<&str> = cluster
                        .exclusive_holder_names(id)
                        .into_iter()
                        .filter(|c| !ours.contains(c))
                        .collect();
                    return Err(CommitError::Conflict(format!(
                        "device {id} planned for {mine} is allocated to {}",
                        others.join(", ")
                    )));
                }
            }
            return Ok(());
        }
        let all: Api<ResourceClaim> = Api::all(self.client.clone());
        let claims = all.list(&ListParams::default()).await?;
        for claim in claims.items {
            let claim_key = convert::claim_key(&claim);
            if ours.contains(claim_key.as_str()) {
                continue;
            }
            let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
                continue;
            };
            for result in allocation.devices.iter().flat_map(|d| d.results.iter().flatten()) {
                if result.admin_access == Some(true) || result.share_id.is_some() {
                    continue;
                }
                let id = muster_engine::claim::DeviceId {
                    driver: result.driver.clone(),
                    pool: result.pool.clone(),
                    device: result.device.clone(),
                };
                if let Some(mine) = planned.get(&id) {
                    return Err(CommitError::Conflict(format!(
                        "device {id} planned for {mine} is allocated to {claim_key}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Claims being deleted, and claims a deleted Workload only joined (a user's): clear
    /// the allocation muster wrote once no pod that may run uses them, then let go.
    async fn collect_claims(&self) {
        let finished: Vec<String> = self
            .stores
            .pods
            .state()
            .iter()
            .filter(|p| {
                matches!(
                    p.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Succeeded" | "Failed")
                )
            })
            .filter_map(|p| p.uid())
            .collect();
        let workloads: BTreeSet<ObjectKey> = self.current_workloads().iter().map(|w| key(w)).collect();
        for claim in self.stores.claims.state() {
            let has_finalizer = claim.finalizers().iter().any(|f| f == labels::CLAIM_FINALIZER);
            let namespace = claim.namespace().unwrap_or_default();
            let orphaned = claim
                .labels()
                .get(labels::WORKLOAD)
                .is_some_and(|w| !workloads.contains(&ObjectKey::new(&namespace, w)));
            if !has_finalizer || (claim.metadata.deletion_timestamp.is_none() && !orphaned) {
                continue;
            }
            // A pod that may still run keeps it: look again once the cache says otherwise.
            let in_use = claim
                .status
                .as_ref()
                .and_then(|s| s.reserved_for.as_ref())
                .is_some_and(|r| r.iter().any(|c| !finished.contains(&c.uid)));
            if in_use {
                continue;
            }
            self.ensure_leading();
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
            let result = async {
                match deallocate(&api, &claim.name_any(), &finished, &|| self.ensure_leading()).await? {
                    Some(current) if current.status.as_ref().is_none_or(|s| s.allocation.is_none()) => {
                        self.ensure_leading();
                        kube_ops::remove_finalizer(&api, &current, labels::CLAIM_FINALIZER).await
                    }
                    _ => Ok(()),
                }
            }
            .await;
            if let Err(e) = result {
                warn!(claim = %claim.name_any(), error = %e, "releasing a deleted claim failed; retrying");
            }
        }
    }

    /// Writes the `Admitted` condition, and `placement` (removed when `None`).
    pub(crate) async fn set_admitted(
        &self,
        workload: &Workload,
        admitted: bool,
        reason: &str,
        message: &str,
        placement: Option<&PlacementStatus>,
    ) -> Result<(), CommitError> {
        let update = StatusUpdate {
            conditions: vec![ConditionUpdate {
                type_: conditions::ADMITTED,
                status: admitted,
                reason: reason.to_string(),
                message: message.to_string(),
            }],
            placement: placement.cloned(),
            restarts: None,
        };
        self.write_status(workload, update).await.map(|_| ())
    }

    /// Applies the admission loop's part of the status: every condition it owns and the
    /// restart count, each taken from `update` or kept as it is, and the placement of
    /// `update`. (A server-side apply that left an owned field out would remove it.)
    ///
    /// The write is conditional on the journal `workload` shows: it is made against
    /// that resourceVersion, and when another writer changed the object meanwhile, it is
    /// made again against a fresh read only if the journal there is still the same.
    pub(crate) async fn write_status(
        &self,
        workload: &Workload,
        update: StatusUpdate,
    ) -> Result<Arc<Workload>, CommitError> {
        let api: Api<Workload> = Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
        let expected = placement_of(workload).cloned();
        let mut base = workload.clone();
        for _ in 0..10 {
            self.ensure_leading();
            let current = base.status.clone().unwrap_or_default();
            let mut owned: Vec<Condition> = current
                .conditions
                .iter()
                .filter(|c| ADMISSION_CONDITIONS.contains(&c.type_.as_str()))
                .cloned()
                .collect();
            for condition in &update.conditions {
                crate::workload::status::set_condition(
                    &mut owned,
                    condition.type_,
                    condition.status,
                    &condition.reason,
                    &condition.message,
                    base.metadata.generation,
                    &now(),
                );
            }
            let placement = update.placement.clone();
            let restarts = update.restarts.unwrap_or(current.restarts);
            let mut status = json!({"conditions": owned, "restarts": restarts});
            if let Some(placement) = placement {
                status["placement"] = serde_json::to_value(placement).unwrap_or_default();
            }
            let patch = json!({
                "apiVersion": "muster.dev/v1alpha1",
                "kind": "Workload",
                "metadata": {"resourceVersion": base.resource_version()},
                "status": status,
            });
            match api
                .patch_status(
                    &workload.name_any(),
                    &PatchParams::apply(labels::ADMISSION_FIELD_MANAGER).force(),
                    &Patch::Apply(&patch),
                )
                .await
            {
                Ok(written) => {
                    let written = Arc::new(written);
                    self.written
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(key(&written), written.clone());
                    return Ok(written);
                }
                // Another writer (the Workload controller, say) changed the object: try
                // again against the newest copy the cache has, if its journal is still
                // the one this write was decided on. (No read: muster may only patch.)
                Err(e) if kube_ops::is_conflict(&e) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let Some(fresh) = self.current_workload(&key(workload)) else {
                        return Err(CommitError::Conflict(format!("{} is gone", key(workload))));
                    };
                    if placement_of(&fresh) != expected.as_ref() {
                        return Err(CommitError::Conflict(format!(
                            "the placement of {} changed meanwhile; looking again",
                            key(workload)
                        )));
                    }
                    base = (*fresh).clone();
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(CommitError::Conflict(format!(
            "the status of {} kept changing; looking again",
            key(workload)
        )))
    }

    /// The Workload as this loop last saw it.
    fn current_workload(&self, gang: &ObjectKey) -> Option<Arc<Workload>> {
        self.current_workloads().into_iter().find(|w| key(w) == *gang)
    }

    /// The Workloads as the loop last saw them: the cache, or what its own last write
    /// returned where the cache has not caught up yet (acting on a stale copy could
    /// commit a gang twice).
    pub(crate) fn current_workloads(&self) -> Vec<Arc<Workload>> {
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        let cached = self.workloads.state();
        let live: BTreeSet<ObjectKey> = cached.iter().map(|w| key(w)).collect();
        written.retain(|k, _| live.contains(k));
        cached
            .into_iter()
            .map(|w| {
                let k = key(&w);
                match written.get(&k) {
                    Some(mine) if version(mine.as_ref()) > version(w.as_ref()) => mine.clone(),
                    Some(_) => {
                        written.remove(&k);
                        w
                    }
                    None => w,
                }
            })
            .collect()
    }

    pub(crate) async fn event(&self, workload: &Workload, type_: EventType, reason: &str, action: &str, note: String) {
        crate::workload::controller::publish_event(&self.recorder, workload, type_, reason, action, note).await;
    }
}

/// A commit's record of its progress: the journal, and `Admitted` false while reserving.
fn reserving_record(journal: Journal, message: &str) -> Record {
    Record {
        journal: Some(journal),
        conditions: vec![muster_admission::Condition {
            type_: ConditionType::Admitted,
            status: false,
            reason: Reason::Reserving,
            message: message.into(),
        }],
        restarts: None,
    }
}

/// What came of trying to admit a queued gang.
/// A plan, and what the starvation rule needs to know when it does not fit.
#[derive(Clone)]
struct Planned {
    outcome: Outcome,
    /// The nodes it could use on the cluster with nothing else on it, if it would fit
    /// there.
    reach: Option<Arc<BTreeSet<String>>>,
    /// It would have fit but for nodes held for gangs that waited longest.
    held_back: bool,
}

/// What a gang that has waited longest holds, given its plan on the emptied cluster:
/// every node it could use, or every node at all if it needs devices that are not tied
/// to one node (a network-attached pool serves many nodes, and holding nodes would not
/// keep others off those devices).
fn reach(
    empty: &muster_engine::cluster::ClusterState,
    request: &GangRequest,
    plan: &Plan,
    options: &PlanOptions,
) -> BTreeSet<String> {
    let planned: BTreeSet<String> = plan.nodes().into_iter().collect();
    let node_local = plan.claims.iter().all(|c| {
        c.allocation.node_selector.as_ref().is_some_and(|s| {
            planned
                .iter()
                .any(|n| *s == muster_engine::selector::NodeSelector::for_node(n))
        })
    });
    if node_local {
        placement::reachable_nodes(empty, request, options)
    } else {
        empty.nodes().map(|n| n.name.clone()).collect()
    }
}

/// What decides whether a gang fits, without the names of its pods and claims: two
/// gangs with one signature fit or do not fit alike.
fn shape_signature(request: &GangRequest) -> String {
    let groups: Vec<String> = request
        .groups
        .iter()
        .map(|g| {
            let allocations: Vec<Vec<_>> = g
                .pods
                .iter()
                .map(|p| p.claims.iter().map(|c| &c.allocation).collect())
                .collect();
            format!("{}/{}/{:?}/{allocations:?}", g.min_count, g.pods.len(), g.shape)
        })
        .collect();
    let shared: Vec<_> = request.shared_claims.iter().map(|c| (&c.spec, &c.allocation)).collect();
    format!("{groups:?}|{shared:?}|{:?}", request.topology)
}

/// How planning a gang ended.
enum Attempt {
    /// It fits: commit this plan.
    Placed {
        request: Box<GangRequest>,
        plan: Box<Plan>,
    },
    /// Not planned: the caches are behind the index on one of its claims.
    Stale,
    Done(Admit),
}

/// Whether the request takes a claim as unallocated that the index holds allocated: a
/// gang committed in this pass allocates it, or the claim cache has not caught up with
/// an allocation yet. Planned on that view, the claim would be allocated twice.
fn uses_a_claim_allocated_meanwhile(request: &GangRequest, cluster: &muster_engine::cluster::ClusterState) -> bool {
    let shared = request
        .shared_claims
        .iter()
        .filter(|c| c.allocation.is_none())
        .map(|c| &c.key);
    let own = request
        .groups
        .iter()
        .flat_map(|g| &g.pods)
        .flat_map(|p| p.claims.iter().filter(|c| c.allocation.is_none()).map(|c| &c.key));
    shared.chain(own).any(|key| cluster.claim_allocated(key))
}

/// A gang planned in this pass, waiting for its commit.
struct PlannedGang {
    name: ObjectKey,
    priority: i32,
    workload: Arc<Workload>,
    request: GangRequest,
    plan: Plan,
}

enum Admit {
    Committed,
    /// The commit found a conflict or failed, and was undone.
    RolledBack,
    /// Not now; `reach`: the nodes it could use on the cluster with nothing else on
    /// it, if it would fit there.
    DoesNotFit {
        reach: Option<Arc<BTreeSet<String>>>,
    },
    /// The request is wrong for this cluster (the condition says why).
    Invalid,
}

/// The engine's plan in the state machine's terms: an extra's own claims go with it.
pub(crate) fn core_placement(request: &GangRequest, plan: &Plan) -> commit::Placement {
    let own_claims: BTreeMap<&PodKey, &Vec<PodClaim>> = request
        .groups
        .iter()
        .flat_map(|g| &g.pods)
        .map(|p| (&p.key, &p.claims))
        .collect();
    let shared: BTreeSet<&str> = request.shared_claims.iter().map(|c| c.key.as_str()).collect();
    commit::Placement {
        pods: plan
            .pods
            .iter()
            .map(|p| {
                let extra = request.is_extra(&p.group, &p.pod);
                muster_admission::PlannedPod {
                    name: p.pod.name().to_string(),
                    node: p.node.clone(),
                    extra,
                    released_at: None,
                    claims: if extra {
                        own_claims
                            .get(&p.pod)
                            .into_iter()
                            .flat_map(|c| c.iter())
                            .filter(|c| !shared.contains(c.key.as_str()))
                            .map(|c| c.key.name().to_string())
                            .collect()
                    } else {
                        Vec::new()
                    },
                }
            })
            .collect(),
        claims: plan.claims.iter().map(|c| c.claim.name().to_string()).collect(),
        topology_value: plan.topology_value.clone(),
        devices: plan.device_count() as i32,
    }
}

/// The patch that clears a claim's allocation, and `reservedFor` with it (the API allows
/// clearing the allocation only together with an empty `reservedFor`), conditional on
/// the version read.
fn deallocation(claim: &ResourceClaim) -> serde_json::Value {
    json!({
        "metadata": {"resourceVersion": claim.resource_version()},
        "status": {"allocation": null, "reservedFor": null},
    })
}

/// Clears a claim's allocation after a fresh read, unless a pod other than those in
/// `finished` reserves it: a pod that may still run keeps its devices. Returns the claim
/// as it is now (`None`: gone). `leading` runs between the read and the write, so a
/// leader deposed before it cannot clear an allocation its successor made.
pub(crate) async fn deallocate(
    api: &Api<ResourceClaim>,
    name: &str,
    finished: &[String],
    leading: &(dyn Fn() + Sync),
) -> Result<Option<ResourceClaim>, kube::Error> {
    let Some(claim) = api.get_opt(name).await? else {
        return Ok(None);
    };
    let Some(status) = claim.status.as_ref().filter(|s| s.allocation.is_some()) else {
        return Ok(Some(claim));
    };
    let in_use = status.reserved_for.iter().flatten().any(|r| !finished.contains(&r.uid));
    if in_use {
        return Ok(Some(claim));
    }
    leading();
    match api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&deallocation(&claim)))
        .await
    {
        Ok(claim) => Ok(Some(claim)),
        // Changed meanwhile: looked at again in the next pass.
        Err(e) if kube_ops::is_conflict(&e) => Ok(Some(claim)),
        Err(e) if kube_ops::is_not_found(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Undoes an allocation this loop wrote, only while the claim is as the write left it.
async fn undo_allocation(
    api: &Api<ResourceClaim>,
    written: &ResourceClaim,
) -> Result<Option<ResourceClaim>, kube::Error> {
    match api
        .patch_status(
            &written.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&deallocation(written)),
        )
        .await
    {
        Ok(claim) => Ok(Some(claim)),
        Err(e) if kube_ops::is_not_found(&e) || kube_ops::is_conflict(&e) => Ok(None),
        Err(e) => Err(e),
    }
}
