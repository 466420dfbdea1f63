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
//!
//! Its parts: `pass` is one pass; `perform` performs the state machine's effects;
//! `queue` orders and plans waiting gangs; `reserve` commits a plan and gives
//! allocations back; `status` writes the loop's part of a Workload's status; `extras`,
//! `release`, `fencing` and `kueue` are the steps they share; `found_claims` keeps the
//! claims another allocator made that a gang holds listing the gang's pods.

pub(crate) mod claim_writes;
mod conflicts;
pub mod extras;
pub mod fencing;
mod found_claims;
pub mod gang_priority;
pub mod kueue;
mod ownership;
mod pass;
mod perform;
mod places;
mod preempt;
pub mod preemption_scope;
mod queue;
mod refusals;
pub mod release;
pub mod request;
mod reservation_health;
mod reserve;
mod status;
mod status_patch;
mod stray_claims;
#[cfg(test)]
mod test_support;
mod waiting;
mod work;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use muster_api::labels;
use muster_api::v1alpha1::{PlacementStatus, Workload, WorkloadPhase};
use muster_engine::key::ObjectKey;
use muster_engine::placement::PlanOptions;
use tokio::sync::Notify;
use tracing::info;

use crate::admission::fencing::Fencing;
use crate::admission::ownership::Holders;
use crate::admission::waiting::{RetryHolds, Waiting};
use crate::cache::cluster::Index;
use crate::cache::gang_index::GangIndex;
use crate::cache::gang_objects::GangStores;
use crate::convert;
use crate::ops::leader::LeaseGuard;
use crate::ops::metrics::{self, PhaseLabel};

pub use crate::ops::faults::{FailWrite, FaultPoint, Pause};

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
    /// Test-only: this write fails once.
    pub fail: Option<FailWrite>,
    pub plan: PlanOptions,
    /// How pods outside muster are kept off the devices it plans with.
    pub fencing: Fencing,
    /// Which gangs a gang of higher priority may evict.
    pub preemption_scope: preemption_scope::PreemptionScope,
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
            fail: None,
            plan: PlanOptions::default(),
            fencing: Fencing::default(),
            preemption_scope: preemption_scope::PreemptionScope::default(),
            lease: None,
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
    /// What this loop suspended to requeue gangs of a job's pods (see `owners`).
    owners: Arc<crate::owners::watch::Marked>,
    priorities: Store<PriorityClass>,
    recorder: Recorder,
    pub(crate) settings: Settings,
    wake: Arc<Notify>,
    /// Gangs waiting to be tried again (a lock only so that commits in flight can share
    /// the loop while it goes on planning; never held across an await).
    waiting: std::sync::Mutex<HashMap<ObjectKey, Waiting>>,
    /// Gangs whose last commit did not go through, and the nodes they keep meanwhile.
    retry_holds: std::sync::Mutex<RetryHolds>,
    /// Workloads as returned by this loop's own status writes, until the cache shows them.
    written: std::sync::Mutex<HashMap<ObjectKey, Arc<Workload>>>,
    /// Gangs whose Kueue check this pass answered Retry: the cache still shows the check
    /// pending, so they would otherwise be planned, and committed, in the same pass.
    answered_retry: std::sync::Mutex<std::collections::HashSet<ObjectKey>>,
    own_pods: OwnWrites<Pod>,
    own_claims: OwnWrites<ResourceClaim>,
    /// Fault points already passed (each aborts at its first write).
    passed: std::sync::Mutex<BTreeSet<String>>,
    /// The gang objects of the caches, grouped once per pass.
    gangs: std::sync::Mutex<Arc<GangIndex>>,
    /// Since when a gang's claim has looked doubly allocated, by (gang, claim).
    conflicts_seen: std::sync::Mutex<HashMap<(ObjectKey, String), Instant>>,
    /// Which gangs hold which claims, from their journals: taken at the start of each
    /// pass and kept up with this loop's own status writes.
    holders: std::sync::Mutex<Holders>,
    /// Claims muster allocated that lost their gang label, as last looked at.
    stray_claims: stray_claims::StrayClaims,
    /// Where the members of gangs whose pods their controller restarts ran last.
    places: places::Places,
    /// The Workload CRD drops the loop's write count: nothing more is written.
    schema_outdated: std::sync::atomic::AtomicBool,
    /// Which gangs take a step in a pass.
    work: std::sync::Mutex<work::Work>,
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

/// The caches the admission loop reads, besides the cluster index.
pub struct Caches {
    pub workloads: Store<Workload>,
    pub stores: GangStores,
    /// What the loop suspended to requeue gangs of a job's pods.
    pub owners: Arc<crate::owners::watch::Marked>,
    pub priorities: Store<PriorityClass>,
}

impl Admission {
    pub fn new(client: Client, index: Arc<Index>, caches: Caches, settings: Settings, wake: Arc<Notify>) -> Self {
        let Caches {
            workloads,
            stores,
            owners,
            priorities,
        } = caches;
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
            owners,
            priorities,
            settings,
            wake,
            waiting: std::sync::Mutex::default(),
            retry_holds: std::sync::Mutex::default(),
            written: std::sync::Mutex::default(),
            answered_retry: std::sync::Mutex::default(),
            own_pods: OwnWrites::default(),
            own_claims: OwnWrites::default(),
            passed: std::sync::Mutex::default(),
            conflicts_seen: std::sync::Mutex::default(),
            gangs: std::sync::Mutex::default(),
            holders: std::sync::Mutex::default(),
            stray_claims: stray_claims::StrayClaims::default(),
            places: places::Places::default(),
            schema_outdated: std::sync::atomic::AtomicBool::new(false),
            work: std::sync::Mutex::default(),
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
            ..muster_admission::Settings::default()
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
            crate::ops::metrics::get()
                .pass_duration
                .observe(started.elapsed().as_secs_f64());
            // Stopped for an outdated CRD: looked at once a minute, whatever happens.
            if self.schema_is_outdated() {
                tokio::time::sleep(next).await;
                continue;
            }
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

    /// The gang's claims: those carrying its label and those its journal names (a claim
    /// it shares carries the label of the Workload that joined it first), from the
    /// cache as grouped for this pass, with this loop's own newer writes.
    pub(crate) fn gang_claims(&self, workload: &Workload) -> Vec<Arc<ResourceClaim>> {
        let namespace = workload.namespace().unwrap_or_default();
        let gangs = self.gangs();
        let mut claims: Vec<Arc<ResourceClaim>> = gangs.claims(&namespace, &workload.name_any()).to_vec();
        for name in placement_of(workload).iter().flat_map(|p| &p.claims) {
            if claims.iter().any(|c| c.metadata.name.as_deref() == Some(name.as_str())) {
                continue;
            }
            if let Some(claim) = gangs.claim(&namespace, name) {
                claims.push(claim.clone());
            }
        }
        claims.into_iter().map(|c| self.own_claims.overlay(c)).collect()
    }

    /// A claim of `workload`'s gang as the state machine sees it: whether another gang
    /// holds it, and which `reservedFor` entries the caches show outside the gang — a
    /// pod of another gang, a pod outside muster that the cluster index shows on a node,
    /// a consumer that is not a pod. Any other entry is the gang's own or unknown (see
    /// [`muster_admission::ownership`]).
    pub(crate) fn claim_view(&self, workload: &Workload, claim: &ResourceClaim) -> muster_admission::ClaimView {
        let claim_name = claim.name_any();
        let used_by = self
            .gang_pods(workload)
            .iter()
            .filter(|p| claim_writes::names_claim(p, &claim_name))
            .filter_map(|p| p.uid())
            .collect();
        self.claim_view_used_by(workload, claim, used_by)
    }

    /// [`Self::claim_view`], with the uids of the gang's pods that name the claim known.
    pub(crate) fn claim_view_used_by(
        &self,
        workload: &Workload,
        claim: &ResourceClaim,
        used_by: Vec<String>,
    ) -> muster_admission::ClaimView {
        let namespace = workload.namespace().unwrap_or_default();
        let name = workload.name_any();
        let held_elsewhere = self
            .holders()
            .held_elsewhere(&ObjectKey::new(&namespace, &claim.name_any()), &key(workload));
        let gangs = self.gangs();
        let cluster = self.index.cluster();
        crate::workload::observe::claim(claim, held_elsewhere, used_by, |consumer| {
            if consumer.resource != "pods" || consumer.api_group.as_deref().is_some_and(|g| !g.is_empty()) {
                return true;
            }
            match gangs.pod_workload(&consumer.uid) {
                Some(workload) => workload != name,
                None => cluster
                    .pod_node(&muster_engine::key::PodKey::new(&namespace, &consumer.name))
                    .is_some(),
            }
        })
    }

    /// Which gangs hold which claims, as of this loop's last look and writes.
    pub(crate) fn holders(&self) -> std::sync::MutexGuard<'_, Holders> {
        self.holders.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Which gangs take a step, and what became of their last one.
    fn work(&self) -> std::sync::MutexGuard<'_, work::Work> {
        self.work.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The gangs waiting to be tried again.
    fn waiting(&self) -> std::sync::MutexGuard<'_, HashMap<ObjectKey, Waiting>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The gangs whose last commit did not go through.
    fn retry_holds(&self) -> std::sync::MutexGuard<'_, RetryHolds> {
        self.retry_holds.lock().unwrap_or_else(|p| p.into_inner())
    }
}
