//! The admission loop: the one place where gangs are placed. Waiting gangs are planned
//! in priority-then-age order against the engine's picture of the cluster; a gang that
//! fits is committed: the plan is recorded on the Workload, every claim of the gang is
//! allocated, the allocations are checked against the cluster, and only then is every
//! pod released (gate removed, pinned to its planned node). Any failure before release
//! undoes the writes made so far. A restarted operator finds half-done commits in the
//! recorded plan and undoes or finishes them. Released gangs whose pods are not all
//! scheduled in time are torn down as a unit and queued again.
//!
//! Starvation rule: gangs are tried in priority-then-age order and a smaller gang may be
//! admitted past a larger one that does not fit (backfill), except that once a gang has
//! waited longer than `starvation_after`, no gang of the same or lower priority queued
//! behind it is admitted until it is.

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
use muster_api::v1alpha1::{AdmissionState, PlacementStatus, PlannedPod, Workload, WorkloadPhase};
use muster_api::{conditions, labels};
use muster_engine::placement::{self, Outcome, Plan, PlanOptions};
use muster_engine::request::GangRequest;
use serde_json::json;
use tokio::sync::Notify;
use tracing::{Instrument, info, info_span, warn};

use crate::controller::GangStores;
use crate::convert;
use crate::fencing::Fencing;
use crate::index::Index;
use crate::metrics::{self, OutcomeLabel, PhaseLabel, ReasonLabel};
use crate::release;
use crate::request::{ClaimSources, RequestError, gang_request};

/// Steps after which a test may abort the process (`MUSTER_FAULT_POINT`), to prove that
/// a restart converges, or hold the commit until a file exists (`MUSTER_PAUSE_POINT`,
/// `MUSTER_PAUSE_UNTIL`), to change the cluster in the middle of a commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultPoint {
    AfterPlanRecorded,
    AfterFirstClaim,
    AfterAllClaims,
    AfterReserved,
    AfterFirstRelease,
}

impl FaultPoint {
    pub const ALL: [FaultPoint; 5] = [
        FaultPoint::AfterPlanRecorded,
        FaultPoint::AfterFirstClaim,
        FaultPoint::AfterAllClaims,
        FaultPoint::AfterReserved,
        FaultPoint::AfterFirstRelease,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultPoint::AfterPlanRecorded => "after-plan-recorded",
            FaultPoint::AfterFirstClaim => "after-first-claim",
            FaultPoint::AfterAllClaims => "after-all-claims",
            FaultPoint::AfterReserved => "after-reserved",
            FaultPoint::AfterFirstRelease => "after-first-release",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == text)
    }
}

/// Test-only: hold the commit at `point` until the file `until` exists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pause {
    pub point: FaultPoint,
    pub until: std::path::PathBuf,
}

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
    /// Test-only: abort after this step.
    pub fault: Option<FaultPoint>,
    /// Test-only: hold after this step.
    pub pause: Option<Pause>,
    pub plan: PlanOptions,
    /// How pods outside muster are kept off the devices it plans with.
    pub fencing: Fencing,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            schedule_timeout: Duration::from_secs(120),
            starvation_after: Duration::from_secs(600),
            write_parallelism: 64,
            fault: None,
            pause: None,
            plan: PlanOptions::default(),
            fencing: Fencing::default(),
        }
    }
}

/// What the loop remembers about a gang that does not fit.
struct Waiting {
    since: Instant,
    next_try: Instant,
    failures: u32,
    changes_seen: u64,
}

/// Why a commit stopped.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("Kubernetes API request failed: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Conflict(String),
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
    waiting: HashMap<String, Waiting>,
    /// Workloads as returned by this loop's own status writes, until the cache shows them.
    written: std::sync::Mutex<HashMap<String, Arc<Workload>>>,
    /// Claims deallocated when a gang's commit was undone, by gang, until the cache shows
    /// them free: planning before that would take their stale allocations as the gang's.
    deallocated: std::sync::Mutex<HashMap<String, BTreeSet<String>>>,
}

/// Conditions the admission loop owns.
const ADMISSION_CONDITIONS: [&str; 4] = [
    conditions::ADMITTED,
    conditions::RESTARTING,
    conditions::SUCCEEDED,
    conditions::FAILED,
];

/// A change to the admission loop's part of the status: conditions as (type, status,
/// reason, message); `placement`: `None` keeps it, `Some(None)` removes it; `restarts`:
/// `None` keeps it.
pub(crate) struct StatusUpdate {
    pub(crate) conditions: Vec<(&'static str, bool, String, String)>,
    pub(crate) placement: Option<Option<PlacementStatus>>,
    pub(crate) restarts: Option<i32>,
}

impl StatusUpdate {
    /// Only the placement changes.
    pub(crate) fn placement(placement: PlacementStatus) -> Self {
        StatusUpdate {
            conditions: vec![],
            placement: Some(Some(placement)),
            restarts: None,
        }
    }
}

impl Admission {
    /// The gang's claims in the cache, by name.
    pub(crate) fn claims_by_name(&self, workload: &Workload) -> BTreeMap<String, Arc<ResourceClaim>> {
        let namespace = workload.namespace().unwrap_or_default();
        self.stores
            .claims_of(&namespace, &workload.name_any())
            .into_iter()
            .map(|c| (c.name_any(), c))
            .collect()
    }
}

pub(crate) fn key(workload: &Workload) -> String {
    convert::key(
        workload.metadata.namespace.as_deref(),
        workload.metadata.name.as_deref(),
    )
}

pub(crate) fn placement_of(workload: &Workload) -> Option<&PlacementStatus> {
    workload.status.as_ref()?.placement.as_ref()
}

pub(crate) fn condition<'a>(workload: &'a Workload, type_: &str) -> Option<&'a Condition> {
    workload.status.as_ref()?.conditions.iter().find(|c| c.type_ == type_)
}

pub(crate) fn now() -> Time {
    Time(Timestamp::now())
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
            written: std::sync::Mutex::default(),
            deallocated: std::sync::Mutex::default(),
        }
    }

    /// Runs until the process stops.
    pub async fn run(mut self) {
        self.index.wait_ready().await;
        self.stores.wait_until_ready().await;
        let _ = self.workloads.wait_until_ready().await;
        let _ = self.priorities.wait_until_ready().await;
        info!("admission loop started");
        self.recover().await;
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

    /// Finishes or undoes commits a previous run left half done.
    async fn recover(&mut self) {
        for workload in self.current_workloads() {
            let Some(state) = placement_of(&workload).and_then(|p| p.state) else {
                continue;
            };
            let result = match state {
                AdmissionState::Reserving => {
                    info!(workload = %key(&workload), "undoing a commit interrupted while reserving");
                    self.undo(
                        &workload,
                        conditions::REASON_ROLLED_BACK,
                        "a restarted operator undid a commit that was interrupted while reserving devices".into(),
                    )
                    .await
                }
                AdmissionState::Reserved => {
                    info!(workload = %key(&workload), "finishing a commit interrupted while releasing");
                    self.finish_release(&workload).await
                }
                AdmissionState::Released
                | AdmissionState::TearingDown
                | AdmissionState::Restarting
                | AdmissionState::Finishing
                | AdmissionState::Finished => Ok(()),
            };
            if let Err(e) = result {
                warn!(workload = %key(&workload), error = %e, "recovery failed; retrying in the next pass");
            }
        }
    }

    /// One look at every gang. Returns how long to wait at most before the next pass.
    async fn pass(&mut self) -> Duration {
        // A safety net: every event wakes the loop anyway.
        let mut next = Duration::from_secs(5);
        let workloads = self.current_workloads();
        self.collect_claims().await;

        for workload in workloads.iter().filter(|w| w.metadata.deletion_timestamp.is_none()) {
            let state = placement_of(workload).and_then(|p| p.state);
            let suspended = workload.spec.suspend == Some(true);
            let result = match state {
                Some(AdmissionState::Finished) => self.expire(workload, &mut next).await,
                Some(AdmissionState::Finishing) => self.finish_step(workload).await,
                Some(_) if suspended => self.suspend_step(workload).await,
                Some(AdmissionState::Released) => self.supervise(workload, &mut next).await,
                Some(AdmissionState::TearingDown) => self.tear_down(workload).await,
                Some(AdmissionState::Restarting) => self.restart_step(workload).await,
                Some(AdmissionState::Reserved) => self.finish_release(workload).await,
                // A live commit finishes or rolls back before the pass continues; this is
                // left over from an earlier failure.
                Some(AdmissionState::Reserving) => {
                    self.undo(
                        workload,
                        conditions::REASON_ROLLED_BACK,
                        "undid an unfinished commit".into(),
                    )
                    .await
                }
                None => Ok(()),
            };
            if let Err(e) = result {
                warn!(workload = %key(workload), error = %e, "admission step failed; retrying");
                next = next.min(Duration::from_secs(2));
            }
        }

        let mut queue: Vec<(i32, Timestamp, String, Arc<Workload>)> = workloads
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
        let live: BTreeSet<String> = workloads.iter().map(|w| key(w)).collect();
        self.waiting.retain(|k, _| live.contains(k));

        let changes = self.index.changes();
        let mut blocking: Option<(i32, String)> = None;
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
            if let Some((_, starving)) = blocking.as_ref().filter(|(p, _)| priority <= *p) {
                let message = format!("{starving} has waited longest and is admitted first (starvation rule)");
                let current =
                    condition(&workload, conditions::ADMITTED).map(|c| (c.reason.as_str(), c.message.as_str()));
                if current != Some((conditions::REASON_WAITING_BEHIND, message.as_str())) {
                    let result = self
                        .set_admitted(&workload, false, conditions::REASON_WAITING_BEHIND, &message, None)
                        .await;
                    if let Err(e) = result {
                        warn!(workload = %name, error = %e, "writing status failed");
                    }
                }
                continue;
            }
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
                    if waiting.since.elapsed() > self.settings.starvation_after {
                        blocking = Some((priority, name.clone()));
                    }
                    continue;
                }
            }
            match self.try_admit(&workload).await {
                Ok(true) => {
                    self.waiting.remove(&name);
                }
                Ok(false) => {
                    let entry = self.waiting.entry(name.clone()).or_insert(Waiting {
                        since: Instant::now(),
                        next_try: Instant::now(),
                        failures: 0,
                        changes_seen: 0,
                    });
                    entry.failures += 1;
                    entry.changes_seen = changes;
                    // 1 s, 2 s, 4 s ... at most a minute between attempts.
                    let backoff = Duration::from_secs(1u64 << entry.failures.min(6).saturating_sub(1))
                        .min(Duration::from_secs(60));
                    entry.next_try = Instant::now() + backoff;
                    next = next.min(backoff);
                    if entry.since.elapsed() > self.settings.starvation_after {
                        blocking = Some((priority, name));
                    }
                }
                Err(e) => {
                    warn!(workload = %key(&workload), error = %e, "admission failed");
                    next = next.min(Duration::from_secs(2));
                }
            }
        }
        next
    }

    /// Waiting for admission: every object exists, not suspended, not being deleted.
    fn admissible(&self, workload: &Workload) -> bool {
        if workload.metadata.deletion_timestamp.is_some() || workload.spec.suspend == Some(true) {
            return false;
        }
        if crate::lifecycle::finished(workload) {
            return false;
        }
        if placement_of(workload).and_then(|p| p.state).is_some() {
            return false;
        }
        let created = condition(workload, conditions::CREATED)
            .is_some_and(|c| c.status == "True" && c.observed_generation == workload.metadata.generation);
        if !created {
            return false;
        }
        let namespace = workload.namespace().unwrap_or_default();
        let name = workload.name_any();
        let expected: i32 = workload
            .spec
            .pod_groups
            .iter()
            .filter(|g| g.template.is_some())
            .map(|g| g.replicas)
            .sum();
        let pods = self.stores.pods_of(&namespace, &name);
        let gated = pods.iter().filter(|p| crate::status::is_gated(p)).count();
        // Pods of template-less groups: at least minCount, all waiting at the gate.
        let external_ready = workload
            .spec
            .pod_groups
            .iter()
            .filter(|g| g.template.is_none())
            .all(|g| {
                let members = crate::membership::external_members(&pods, g);
                members.len() as i32 >= g.min_count() && members.iter().all(|p| crate::status::is_gated(p))
            });
        gated as i32 >= expected && external_ready
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
        let claims: Vec<ResourceClaim> = self
            .stores
            .claims
            .state()
            .iter()
            .filter(|c| c.metadata.namespace.as_deref() == Some(&namespace))
            .map(|c| (**c).clone())
            .collect();
        self.check_deallocations_seen(workload, &claims)?;
        let sources = ClaimSources::new(&[], &claims);
        let pods = if crate::membership::has_external_groups(workload) {
            self.stores.pods_of(&namespace, &workload.name_any())
        } else {
            Vec::new()
        };
        let mut request = gang_request(workload, &sources, &pods)?;
        // muster's pods or claims tolerate the fence that keeps others off the devices.
        self.settings.fencing.apply(&mut request);
        Ok(request)
    }

    /// Plans a gang and commits it if it fits. `Ok(false)`: it does not fit now.
    async fn try_admit(&mut self, workload: &Workload) -> Result<bool, CommitError> {
        let request = match self.request(workload) {
            Ok(request) => request,
            Err(e) if e.is_waiting() => return Ok(false),
            Err(e) => {
                self.set_admitted(
                    workload,
                    false,
                    conditions::REASON_INVALID_REQUEST,
                    &e.to_string(),
                    None,
                )
                .await?;
                return Ok(false);
            }
        };
        let started = Instant::now();
        let outcome = {
            let _span = info_span!("plan", workload = %key(workload)).entered();
            let cluster = self.index.cluster();
            placement::plan(&cluster, &request, &self.settings.plan)
        };
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
                let message = why.to_string();
                let previous = condition(workload, conditions::ADMITTED).map(|c| (c.reason.clone(), c.message.clone()));
                if previous != Some((conditions::REASON_UNSCHEDULABLE.to_string(), message.clone())) {
                    info!(workload = %key(workload), reason = %message, "gang does not fit");
                    self.set_admitted(workload, false, conditions::REASON_UNSCHEDULABLE, &message, None)
                        .await?;
                    self.event(
                        workload,
                        EventType::Normal,
                        conditions::EVENT_UNSCHEDULABLE,
                        "Plan",
                        message,
                    )
                    .await;
                }
                Ok(false)
            }
            Outcome::Placed(plan) => {
                info!(workload = %key(workload), pods = plan.pods.len(), devices = plan.device_count(), planned_ms = planned_in.as_millis() as u64, "gang fits; committing");
                let started = Instant::now();
                let committed = self
                    .commit(workload, &request, &plan)
                    .instrument(info_span!("commit", workload = %key(workload)))
                    .await;
                let outcome = if committed.is_ok() { "committed" } else { "failed" };
                metrics::get()
                    .commit_duration
                    .get_or_create(&OutcomeLabel { outcome })
                    .observe(metrics::seconds(started.elapsed()));
                committed?;
                Ok(true)
            }
        }
    }

    fn fault(&self, point: FaultPoint) {
        if self.settings.fault == Some(point) {
            eprintln!("fault point {} reached: aborting", point.name());
            std::process::abort();
        }
    }

    /// Runs `write` for every item, `--write-parallelism` at a time, and fails with the
    /// first error once all have run. A test may abort after the first success (`first`).
    async fn write_all<'i, T, F, Fut>(&self, items: &'i [T], first: FaultPoint, write: F) -> Result<(), CommitError>
    where
        F: Fn(&'i T) -> Fut,
        Fut: std::future::Future<Output = Result<(), kube::Error>>,
    {
        let first_done = std::sync::atomic::AtomicBool::new(false);
        let results: Vec<Result<(), kube::Error>> = stream::iter(items)
            .map(|item| {
                let written = write(item);
                let first_done = &first_done;
                async move {
                    written.await?;
                    if !first_done.swap(true, std::sync::atomic::Ordering::SeqCst) {
                        self.fault(first);
                    }
                    Ok(())
                }
            })
            .buffer_unordered(self.settings.write_parallelism.max(1))
            .collect()
            .await;
        match results.into_iter().find(Result::is_err) {
            Some(Err(e)) => Err(e.into()),
            _ => Ok(()),
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

    async fn commit(&mut self, workload: &Workload, request: &GangRequest, plan: &Plan) -> Result<(), CommitError> {
        let gang = key(workload);
        let placement = PlacementStatus {
            state: Some(AdmissionState::Reserving),
            topology_value: plan.topology_value.clone(),
            nodes: plan.nodes(),
            devices: plan.device_count() as i32,
            pods: plan
                .pods
                .iter()
                .map(|p| PlannedPod {
                    name: p.pod.split_once('/').map_or(p.pod.clone(), |(_, n)| n.to_string()),
                    node: p.node.clone(),
                    extra: request.is_extra(&p.group, &p.pod),
                })
                .collect(),
            claims: plan
                .claims
                .iter()
                .map(|c| c.claim.split_once('/').map_or(c.claim.clone(), |(_, n)| n.to_string()))
                .collect(),
            released_at: None,
            reuse_reservation: false,
        };
        self.set_admitted(
            workload,
            false,
            conditions::REASON_RESERVING,
            "reserving the gang's devices",
            Some(&placement),
        )
        .await?;
        self.checkpoint(FaultPoint::AfterPlanRecorded).await;

        // The next plan must see these devices and pods as taken.
        let (pods, claims) = plan.assumption(request);
        self.index.cluster().assume(&gang, &pods, &claims);

        match self
            .reserve(workload, plan)
            .instrument(info_span!("reserve", workload = %gang, claims = plan.claims.len()))
            .await
        {
            Ok(()) => {
                metrics::get().reservations.inc();
                metrics::get().reserved_devices.inc_by(plan.device_count() as u64);
            }
            Err(e) => {
                if matches!(e, CommitError::Conflict(_)) {
                    metrics::get().conflicts.inc();
                }
                let message = format!("reserving failed and was undone: {e}");
                let reason = if matches!(e, CommitError::Conflict(_)) {
                    conditions::REASON_CONFLICT
                } else {
                    conditions::REASON_ROLLED_BACK
                };
                self.index.cluster().forget(&gang);
                let claims: BTreeSet<String> = placement.claims.iter().cloned().collect();
                self.undo_claims(workload, &claims, reason, message.clone()).await?;
                self.event(
                    workload,
                    EventType::Warning,
                    conditions::EVENT_ROLLED_BACK,
                    "Reserve",
                    message,
                )
                .await;
                return Ok(());
            }
        }
        let mut placement = placement;
        placement.state = Some(AdmissionState::Reserved);
        self.set_admitted(
            workload,
            false,
            conditions::REASON_RESERVING,
            "every claim is allocated; releasing pods",
            Some(&placement),
        )
        .await?;
        self.checkpoint(FaultPoint::AfterReserved).await;
        self.release_all(workload, &placement)
            .instrument(info_span!("release", workload = %gang, pods = placement.pods.len()))
            .await?;
        self.index.cluster().confirm(&gang);
        Ok(())
    }

    /// Allocates every planned claim, then checks that no other claim holds any of the
    /// devices. On error, the caller undoes what was written.
    pub(crate) async fn reserve(&self, workload: &Workload, plan: &Plan) -> Result<(), CommitError> {
        let timestamp = now();
        self.write_all(&plan.claims, FaultPoint::AfterFirstClaim, |claim| {
            let (namespace, name) = claim.claim.split_once('/').unwrap_or(("", &claim.claim));
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), namespace);
            let mut allocation = convert::allocation_to_kube(&claim.allocation);
            allocation.allocation_timestamp = Some(timestamp.clone());
            async move {
                ensure_finalizer(&api, name).await?;
                let patch = json!({"status": {"allocation": allocation}});
                let params = PatchParams {
                    field_manager: Some(labels::ADMISSION_FIELD_MANAGER.into()),
                    ..PatchParams::default()
                };
                api.patch_status(name, &params, &Patch::Merge(&patch)).await?;
                Ok(())
            }
        })
        .await?;
        self.checkpoint(FaultPoint::AfterAllClaims).await;
        self.check_conflicts(workload, plan).await
    }

    /// A fresh read of every claim: no claim outside the gang holds a planned device.
    async fn check_conflicts(&self, workload: &Workload, plan: &Plan) -> Result<(), CommitError> {
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
        let all: Api<ResourceClaim> = Api::all(self.client.clone());
        let claims = all.list(&ListParams::default()).await?;
        for claim in claims.items {
            let claim_key = convert::key(claim.metadata.namespace.as_deref(), claim.metadata.name.as_deref());
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
                        "device {id} planned for {mine} is allocated to {claim_key}; workload {}",
                        key(workload)
                    )));
                }
            }
        }
        Ok(())
    }

    /// Releases every planned pod not yet released, then records the gang as admitted.
    async fn release_all(&self, workload: &Workload, placement: &PlacementStatus) -> Result<(), CommitError> {
        let namespace = workload.namespace().unwrap_or_default();
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        let pods: BTreeMap<String, Arc<Pod>> = self
            .stores
            .pods_of(&namespace, &workload.name_any())
            .into_iter()
            .map(|p| (p.name_any(), p))
            .collect();
        self.write_all(&placement.pods, FaultPoint::AfterFirstRelease, |planned| {
            let api = api.clone();
            let cached = pods.get(&planned.name).cloned();
            async move {
                release::release(
                    &api,
                    &planned.name,
                    &planned.node,
                    cached.as_deref(),
                    self.settings.fencing,
                )
                .await
            }
        })
        .await?;
        let mut released = placement.clone();
        released.state = Some(AdmissionState::Released);
        released.released_at = Some(now());
        let message = match &placement.topology_value {
            Some(value) => format!(
                "reserved {} devices on {} nodes ({value}); pods released to the scheduler",
                placement.devices,
                placement.nodes.len()
            ),
            None => format!(
                "reserved {} devices on {} nodes; pods released to the scheduler",
                placement.devices,
                placement.nodes.len()
            ),
        };
        self.set_admitted(workload, true, conditions::REASON_ADMITTED, &message, Some(&released))
            .await?;
        if workload.status.as_ref().is_none_or(|s| s.restarts == 0)
            && let Some(created) = &workload.metadata.creation_timestamp
        {
            let waited = Timestamp::now().duration_since(created.0).unsigned_abs();
            metrics::get().submit_to_admitted.observe(waited.as_secs_f64());
        }
        self.event(
            workload,
            EventType::Normal,
            conditions::EVENT_ADMITTED,
            "Admit",
            message,
        )
        .await;
        Ok(())
    }

    async fn finish_release(&self, workload: &Workload) -> Result<(), CommitError> {
        let Some(placement) = placement_of(workload).cloned() else {
            return Ok(());
        };
        // Every claim must still hold its allocation; otherwise start over.
        let namespace = workload.namespace().unwrap_or_default();
        let claims = self.claims_by_name(workload);
        let intact = placement.claims.iter().all(|c| {
            claims
                .get(c)
                .is_some_and(|claim| claim.status.as_ref().is_some_and(|s| s.allocation.is_some()))
        });
        if !intact {
            return self
                .undo(
                    workload,
                    conditions::REASON_ROLLED_BACK,
                    "a reserved claim lost its allocation; starting over".into(),
                )
                .await;
        }
        // After a restart, the controller recreates the pods: release them once all exist.
        let attempt = workload.status.as_ref().map_or(0, |s| s.restarts).to_string();
        let pods: BTreeMap<String, Arc<Pod>> = self
            .stores
            .pods_of(&namespace, &workload.name_any())
            .into_iter()
            .map(|p| (p.name_any(), p))
            .collect();
        let ready = placement.pods.iter().all(|planned| {
            pods.get(&planned.name).is_some_and(|p| {
                p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(labels::ATTEMPT))
                    .is_none_or(|a| *a == attempt)
                    && p.metadata.deletion_timestamp.is_none()
            })
        });
        if !ready {
            return Ok(());
        }
        self.release_all(workload, &placement).await
    }

    /// Clears the allocations of the gang's claims (all of them, whoever wrote them) and
    /// the recorded plan; the gang is queued again.
    pub(crate) async fn undo(&self, workload: &Workload, reason: &str, message: String) -> Result<(), CommitError> {
        let claims: BTreeSet<String> = placement_of(workload)
            .map(|p| p.claims.iter().cloned().collect())
            .unwrap_or_default();
        self.undo_claims(workload, &claims, reason, message).await
    }

    /// [`Self::undo`] for the planned `claims` (names in the Workload's namespace), for a
    /// commit whose `workload` copy predates the recorded placement.
    async fn undo_claims(
        &self,
        workload: &Workload,
        claims: &BTreeSet<String>,
        reason: &str,
        message: String,
    ) -> Result<(), CommitError> {
        let namespace = workload.namespace().unwrap_or_default();
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
        for name in claims {
            deallocate(&api, name).await?;
        }
        if !claims.is_empty() {
            self.deallocated
                .lock()
                .expect("deallocated claims")
                .insert(key(workload), claims.clone());
        }
        self.index.cluster().forget(&key(workload));
        self.set_admitted(workload, false, reason, &message, None).await?;
        metrics::get()
            .rollbacks
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
        Ok(())
    }

    /// Fails with a waiting error while a claim deallocated by an undone commit of this
    /// gang still shows an allocation in `claims` (the cache).
    fn check_deallocations_seen(&self, workload: &Workload, claims: &[ResourceClaim]) -> Result<(), RequestError> {
        let gang = key(workload);
        let mut deallocated = self.deallocated.lock().expect("deallocated claims");
        let Some(names) = deallocated.get(&gang) else {
            return Ok(());
        };
        let stale = claims
            .iter()
            .find(|c| names.contains(&c.name_any()) && c.status.as_ref().is_some_and(|s| s.allocation.is_some()));
        if let Some(claim) = stale {
            return Err(RequestError::DeallocationNotSeen(claim.name_any()));
        }
        deallocated.remove(&gang);
        Ok(())
    }

    /// Released pods not all bound: after the schedule timeout, the gang is torn down.
    pub(crate) async fn check_schedule_timeout(
        &self,
        workload: &Workload,
        placement: &PlacementStatus,
        bound: &BTreeSet<&str>,
        next: &mut Duration,
    ) -> Result<(), CommitError> {
        let released_at = placement.released_at.as_ref().map(|t| t.0).unwrap_or(Timestamp::now());
        let waited = Timestamp::now().duration_since(released_at).unsigned_abs();
        if waited < self.settings.schedule_timeout {
            *next = (*next).min(self.settings.schedule_timeout - waited + Duration::from_millis(100));
            return Ok(());
        }
        let unbound: Vec<&str> = placement
            .pods
            .iter()
            .filter(|p| !bound.contains(p.name.as_str()))
            .map(|p| p.name.as_str())
            .collect();
        let message = format!(
            "{} of {} released pods were not scheduled within {}s ({}); tearing the gang down to place it again",
            unbound.len(),
            placement.pods.len(),
            self.settings.schedule_timeout.as_secs(),
            unbound.iter().take(5).copied().collect::<Vec<_>>().join(", ")
        );
        warn!(workload = %key(workload), "{message}");
        metrics::get().schedule_timeouts.inc();
        let mut tearing = placement.clone();
        tearing.state = Some(AdmissionState::TearingDown);
        self.set_admitted(
            workload,
            false,
            conditions::REASON_SCHEDULE_TIMEOUT,
            &message,
            Some(&tearing),
        )
        .await?;
        self.event(
            workload,
            EventType::Warning,
            conditions::EVENT_SCHEDULE_TIMEOUT,
            "TearDown",
            message,
        )
        .await;
        Ok(())
    }

    /// Deletes the gang's pods (the controller recreates them gated), deallocates its
    /// claims once no pod uses them, then queues the gang again.
    async fn tear_down(&self, workload: &Workload) -> Result<(), CommitError> {
        let Some(placement) = placement_of(workload) else {
            return Ok(());
        };
        let namespace = workload.namespace().unwrap_or_default();
        let name = workload.name_any();
        let pods_api: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        let planned: BTreeSet<&str> = placement.pods.iter().map(|p| p.name.as_str()).collect();
        let mut old_pods_left = false;
        for pod in self.stores.pods_of(&namespace, &name) {
            // Pods still gated were recreated already; the rest belong to the attempt.
            if crate::status::is_gated(&pod) || !planned.contains(pod.name_any().as_str()) {
                continue;
            }
            old_pods_left = true;
            if pod.metadata.deletion_timestamp.is_none() {
                match pods_api
                    .delete(
                        &pod.name_any(),
                        &DeleteParams {
                            grace_period_seconds: Some(0),
                            ..DeleteParams::default()
                        },
                    )
                    .await
                {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        if old_pods_left {
            return Ok(());
        }
        let reason = condition(workload, conditions::ADMITTED).map(|c| (c.reason.clone(), c.message.clone()));
        let (reason, message) = reason.unwrap_or_else(|| (conditions::REASON_SCHEDULE_TIMEOUT.into(), String::new()));
        self.undo(workload, &reason, message).await
    }

    /// Claims being deleted, and claims a deleted Workload only joined (a user's): clear
    /// the allocation muster wrote once no pod uses them, then let go.
    async fn collect_claims(&self) {
        // Terminating pods may still use their devices: only pods that are gone free them.
        let live: BTreeSet<String> = self.stores.pods.state().iter().filter_map(|p| p.uid()).collect();
        let workloads: BTreeSet<String> = self.current_workloads().iter().map(|w| key(w)).collect();
        for claim in self.stores.claims.state() {
            let has_finalizer = claim.finalizers().iter().any(|f| f == labels::CLAIM_FINALIZER);
            let namespace = claim.namespace().unwrap_or_default();
            let orphaned = claim
                .labels()
                .get(labels::WORKLOAD)
                .is_some_and(|w| !workloads.contains(&format!("{namespace}/{w}")));
            if !has_finalizer || (claim.metadata.deletion_timestamp.is_none() && !orphaned) {
                continue;
            }
            let in_use = claim
                .status
                .as_ref()
                .and_then(|s| s.reserved_for.as_ref())
                .is_some_and(|r| r.iter().any(|c| live.contains(&c.uid)));
            if in_use {
                continue;
            }
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
            let result = async {
                match deallocate(&api, &claim.name_any()).await? {
                    Some(current) => remove_finalizer(&api, &current).await,
                    None => Ok(()),
                }
            }
            .await;
            if let Err(e) = result {
                warn!(claim = %claim.name_any(), error = %e, "releasing a deleted claim failed; retrying");
            }
        }
    }

    /// Writes the `Admitted` condition, and `placement` (removed when `None`).
    async fn set_admitted(
        &self,
        workload: &Workload,
        admitted: bool,
        reason: &str,
        message: &str,
        placement: Option<&PlacementStatus>,
    ) -> Result<(), kube::Error> {
        let update = StatusUpdate {
            conditions: vec![(conditions::ADMITTED, admitted, reason.to_string(), message.to_string())],
            placement: Some(placement.cloned()),
            restarts: None,
        };
        self.write_status(workload, update).await
    }

    /// Applies the admission loop's part of the status: every condition it owns, the
    /// restart count and the placement, each taken from `update` or kept as it is. (A
    /// server-side apply that left an owned field out would remove it.)
    pub(crate) async fn write_status(&self, workload: &Workload, update: StatusUpdate) -> Result<(), kube::Error> {
        let current = workload.status.clone().unwrap_or_default();
        let mut owned: Vec<Condition> = current
            .conditions
            .iter()
            .filter(|c| ADMISSION_CONDITIONS.contains(&c.type_.as_str()))
            .cloned()
            .collect();
        for (type_, status, reason, message) in &update.conditions {
            crate::status::set_condition(
                &mut owned,
                type_,
                *status,
                reason,
                message,
                workload.metadata.generation,
                &now(),
            );
        }
        let placement = update.placement.unwrap_or(current.placement);
        let restarts = update.restarts.unwrap_or(current.restarts);
        let mut status = json!({"conditions": owned, "restarts": restarts});
        if let Some(placement) = placement {
            status["placement"] = serde_json::to_value(placement).unwrap_or_default();
        }
        let patch = json!({"apiVersion": "muster.dev/v1alpha1", "kind": "Workload", "status": status});
        let api: Api<Workload> = Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
        let written = api
            .patch_status(
                &workload.name_any(),
                &PatchParams::apply(labels::ADMISSION_FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await?;
        self.written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key(&written), Arc::new(written));
        Ok(())
    }

    /// The Workloads as the loop last saw them: the cache, or what its own last write
    /// returned where the cache has not caught up yet (acting on a stale copy could
    /// commit a gang twice).
    pub(crate) fn current_workloads(&self) -> Vec<Arc<Workload>> {
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        let version = |w: &Workload| {
            w.metadata
                .resource_version
                .as_deref()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let cached = self.workloads.state();
        let live: BTreeSet<String> = cached.iter().map(|w| key(w)).collect();
        written.retain(|k, _| live.contains(k));
        cached
            .into_iter()
            .map(|w| {
                let k = key(&w);
                match written.get(&k) {
                    Some(mine) if version(mine) > version(&w) => mine.clone(),
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
        crate::controller::publish_event(&self.recorder, workload, type_, reason, action, note).await;
    }
}

/// Adds muster's finalizer to a claim that lacks it (claims muster did not create).
async fn ensure_finalizer(api: &Api<ResourceClaim>, name: &str) -> Result<(), kube::Error> {
    let claim = api.get(name).await?;
    if claim.finalizers().iter().any(|f| f == labels::CLAIM_FINALIZER) {
        return Ok(());
    }
    let mut finalizers = claim.finalizers().to_vec();
    finalizers.push(labels::CLAIM_FINALIZER.into());
    let patch = json!({"metadata": {"finalizers": finalizers, "resourceVersion": claim.resource_version()}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(())
}

/// Clears a claim's allocation, and `reservedFor` with it (the API allows clearing the
/// allocation only together with an empty `reservedFor`). Returns the claim as it is now.
pub(crate) async fn deallocate(api: &Api<ResourceClaim>, name: &str) -> Result<Option<ResourceClaim>, kube::Error> {
    let Some(claim) = api.get_opt(name).await? else {
        return Ok(None);
    };
    if claim.status.as_ref().and_then(|s| s.allocation.as_ref()).is_none() {
        return Ok(Some(claim));
    }
    let patch = json!({"status": {"allocation": null, "reservedFor": null}});
    Ok(Some(
        api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?,
    ))
}

/// Removes muster's finalizer, guarded by a test of its position in the list.
async fn remove_finalizer(api: &Api<ResourceClaim>, claim: &ResourceClaim) -> Result<(), kube::Error> {
    let Some(position) = claim.finalizers().iter().position(|f| f == labels::CLAIM_FINALIZER) else {
        return Ok(());
    };
    let path = format!("/metadata/finalizers/{position}");
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": path, "value": labels::CLAIM_FINALIZER},
        {"op": "remove", "path": path},
    ]))
    .map_err(kube::Error::SerdeError)?;
    match api
        .patch(&claim.name_any(), &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}
