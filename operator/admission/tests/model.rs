//! A model test of the state machine: an in-memory API server with resource versions,
//! caches that lag behind it (each kind on its own), an operator that runs the core's
//! decisions and commits one write at a time, and a cluster around it: a controller
//! that makes gated pods, a scheduler that binds a released pod only once every claim
//! of it is allocated, a kubelet, kube-controller-manager's cleanup of `reservedFor`,
//! Kueue that admits, evicts and admits again, users who suspend, resume and delete
//! pods, nodes that vanish, and intruders: pods outside muster that take free devices,
//! join claims that gangs share (kube-scheduler allocates one that is not, and protects
//! it, so kube-controller-manager deallocates it with its last pod), or allocate a device
//! a gang holds after its commit's conflict check (so the gang must see the conflict and
//! give way).
//!
//! A claim another allocator made lists the gang's pods from the gang's hold on it (and
//! its release) until the gang lets go of it, which takes out the pods still behind the
//! gate (deallocating it, as kube-controller-manager would, if that empties a protected
//! claim); Kueue hears "Ready" only once a fresh read shows every such claim allocated.
//!
//! The operator follows muster's rules: gangs of two priorities; claims shared between
//! gangs and with pods outside them, held by every gang whose journal names them and
//! cleared only by their last holder (or by the collector once no journal names them
//! and no pod uses them); preemption that records a nomination, evicts whole gangs of
//! lower priority that hold what it counts on, and plans as if nominations of lower
//! priority were not there. Writes fail at random and the operator crashes at random,
//! between any two writes, and starts again from caches that list one kind at a time
//! while the cluster moves on; a stalled leader's writes may land after its successor
//! took over.
//!
//! When a record lands: a gang lets go of an allocation muster wrote only to another gang
//! or to a pod outside it (never for a pod of its own that is gone while its uid is still
//! in `reservedFor`); a claim held as it is never takes a device a nomination of at least
//! the gang's priority counts on.
//!
//! After every step: no device is allocated twice (but by an intruder that allocated
//! after the check, until the gang gives way); no pod that may still run has lost a
//! device it was started with; no pod of a gang is released while a claim of it is not
//! allocated. When they land: a gang is torn down for a conflict only if a device of it
//! was allocated twice, evicted only by a nomination of higher priority that names it
//! (but by a deposed leader's eviction landing after its successor dropped the
//! nomination, which is counted),
//! and Kueue hears "Ready" only while the gang holds every claim of its journal.
//!
//! Some gangs are a Job's pods (`restartedBy: PodController`): the Job controller makes
//! them under new names, replaces a pod that failed or went, and takes them away, without
//! counting a failure, when the Job is suspended. muster must never delete such a pod
//! while it has not suspended the Job (the Job would count it as failed), must resume
//! what it suspended, and must not keep a vacated place past its bound.
//!
//! After the chaos, a calm phase must bring every gang to rest (running, finished,
//! suspended, or queued holding nothing of its own and not fitting) within a bounded
//! number of steps, and no gang may stay in one transitional state for long: no wedge,
//! no leak, no nomination left.
//!
//! `MUSTER_MODEL_SCHEDULES` sets the number of schedules (default 10,000), from seed
//! `MUSTER_MODEL_FIRST_SEED` on (default 0); `MUSTER_MODEL_SEED` replays one; `MUSTER_MODEL_LOG` sets how much of its log a
//! failure shows; `MUSTER_MODEL_KEEP_GOING` runs on past a violation, printing each and
//! a count every 100,000 schedules, and fails at the end.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use muster_admission::commit::{self, Placement};
use muster_admission::failure;
use muster_admission::ownership;
use muster_admission::refusal::{Refusal, Unscheduled};
use muster_admission::{
    ClaimView, ConditionType, Consumer, Effect, Gang, GroupSpec, Journal, NodeHealth, Owners, Phase, PlannedPod,
    PodView, Reason, Record, Settings, Spec, State, decide,
};

type Dev = u32;
const DEVICES_PER_NODE: u32 = 2;
const NODES: usize = 3;
/// User claims that gangs (and pods outside them) may share, one device each.
const SHARED: [&str; 2] = ["s0", "s1"];
/// How long a nomination holds its devices while its gang still does not fit.
const NOMINATION_LIFETIME: i64 = 60_000;
/// How many looks a double allocation must last before the gang gives way (the
/// operator's caches may show a deallocation after the allocation that followed it).
const CONFLICT_SIGHTINGS: u32 = 2;
/// Steps of the calm phase a gang may spend in one transitional state.
const TRANSITION_BOUND: usize = 3000;
/// Steps of the calm phase within which every gang must come to rest.
const CALM_STEPS: usize = 8000;

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[derive(Clone, Debug)]
struct PodObj {
    uid: String,
    workload: Option<String>,
    group: String,
    attempt: Option<i32>,
    /// Its index in its group (a Job's completion index).
    index: Option<i32>,
    gated: bool,
    pin: Option<String>,
    phase: Phase,
    node: Option<String>,
    deleting: bool,
    claims: Vec<String>,
    /// Devices its containers were started with.
    using: Vec<Dev>,
    /// kube-scheduler's `PodScheduled=False` condition while it does not bind the pod.
    unscheduled: Option<Unscheduled>,
    rv: u64,
}

#[derive(Clone, Debug)]
struct ClaimObj {
    /// The `muster.dev/workload` label: the Workload that brought it into muster's
    /// caches (the first that joined a shared claim).
    label: Option<String>,
    allocation: Option<Vec<Dev>>,
    /// muster's finalizer: muster wrote the allocation.
    ours: bool,
    reserved_for: Vec<String>,
    rv: u64,
    /// An intruder's claim that took a device a gang held, after the gang's check.
    late: bool,
    /// Since its allocation, one of its devices was in another allocation too.
    doubled: bool,
    /// muster's allocation passed its commit's conflict check.
    checked: bool,
    /// kube-controller-manager's delete-protection: it deallocates the claim when its own
    /// sync takes the last pod out of `reservedFor`.
    protected: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Nomination {
    since: i64,
    victims: Vec<String>,
    /// The devices the proving plan takes.
    devices: Vec<Dev>,
}

/// A gang's Kueue Workload, as muster and Kueue write it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Kueue {
    /// Kueue reserved quota and asked muster to reserve the devices.
    quota: bool,
    /// muster answered its check: every claim is reserved.
    ready: bool,
    /// Kueue admitted the gang: its pods may go.
    admitted: bool,
    /// Kueue evicted the gang: it gives everything back and queues again.
    evicted: bool,
}

/// The Job whose pods make up a gang of `restartedBy: PodController`, as its controller
/// and muster write it.
#[derive(Clone, Debug, Default)]
struct JobObj {
    /// `spec.suspend`.
    suspended: bool,
    /// muster's mark: muster suspended it to requeue the gang, and resumes it.
    marked: bool,
    rv: u64,
    /// Pods made so far, for the names of the next.
    made: u32,
}

#[derive(Clone, Debug)]
struct WorkloadObj {
    /// Its pods are a Job's (template-less, restarted by the Job).
    job: Option<JobObj>,
    spec: Spec,
    replicas: i32,
    /// The user claim its pods share, if any.
    shared: Option<String>,
    priority: i32,
    kueue: Option<Kueue>,
    journal: Option<Journal>,
    nomination: Option<Nomination>,
    restarts: i32,
    /// Of `restarts`, those counted against `maxRestarts`.
    counted_restarts: i32,
    finished_at: Option<i64>,
    /// `status.schedulerRefusals`.
    refusals: Vec<Refusal>,
    rv: u64,
    /// `status.admissionRevision`: the count of the admission loop's own status writes,
    /// which each of them is conditioned on.
    revision: u64,
}

#[derive(Clone, Debug, Default)]
struct World {
    nodes: BTreeMap<String, bool>,
    pods: BTreeMap<String, PodObj>,
    claims: BTreeMap<String, ClaimObj>,
    workloads: BTreeMap<String, WorkloadObj>,
    rv: u64,
    uids: u64,
    /// Every pod uid ever made, with its pod's name and Workload (`None`: no gang's):
    /// what the API server knows of a `reservedFor` entry whose pod is gone.
    uid_owners: BTreeMap<String, (String, Option<String>)>,
    now: i64,
    /// Nodes where kube-scheduler refuses gangs' pods for a reason muster does not model
    /// (a scheduler plugin, a field a webhook added).
    refusing: BTreeSet<String>,
}

/// A claim's allocation cleared (with `reservedFor`, as the API requires).
fn deallocate(claim: &mut ClaimObj) {
    claim.allocation = None;
    claim.reserved_for.clear();
    claim.doubled = false;
}

fn node_of(dev: Dev) -> String {
    format!("n{}", dev / DEVICES_PER_NODE)
}

fn pod_name(gang: &str, index: i32) -> String {
    format!("{gang}-w-{index}")
}

fn pod_claim(pod: &str) -> String {
    format!("{pod}-gpu")
}

/// Whether a journal state holds claims (a finished gang holds nothing).
fn holding(journal: &Option<Journal>) -> Option<&Journal> {
    journal.as_ref().filter(|j| j.state != State::Finished)
}

impl World {
    fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn devices(&self) -> Vec<Dev> {
        (0..(NODES as u32 * DEVICES_PER_NODE))
            .filter(|d| self.nodes.get(&node_of(*d)).copied().unwrap_or(false))
            .collect()
    }

    /// Pods of no gang: someone else's.
    fn intruders(&self) -> Vec<String> {
        self.pods
            .iter()
            .filter(|(_, p)| p.workload.is_none())
            .map(|(n, _)| n.clone())
            .collect()
    }

    fn allocated(&self) -> BTreeSet<Dev> {
        self.claims
            .values()
            .flat_map(|c| c.allocation.iter().flatten().copied())
            .collect()
    }

    /// The gangs whose journal names `claim`.
    fn holders(&self, claim: &str) -> Vec<&str> {
        self.workloads
            .iter()
            .filter(|(_, w)| holding(&w.journal).is_some_and(|j| j.claims.iter().any(|c| c == claim)))
            .map(|(n, _)| n.as_str())
            .collect()
    }
}

/// Kinds the operator caches, each listed and watched on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Pods,
    Claims,
    Workloads,
    Nodes,
}

const KINDS: [Kind; 4] = [Kind::Pods, Kind::Claims, Kind::Workloads, Kind::Nodes];

/// What the operator does next: one API write (or read) at a time.
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
enum Op {
    Record {
        gang: String,
        expected: Option<Journal>,
        /// The admission revision the record was decided on.
        revision: u64,
        record: Record,
    },
    Delete {
        name: String,
        uid: String,
        /// The version the deletion was decided on.
        rv: u64,
        immediately: bool,
    },
    Deallocate {
        claim: String,
        idle: Vec<String>,
    },
    /// Before giving claims back: the gang's planned pods still behind the gate, each
    /// as seen (name, version), are fenced, so that a deposed leader's release of one
    /// cannot land after its claims went.
    FencePods {
        pods: Vec<(String, u64)>,
    },
    Release {
        gang: String,
        pod: String,
        uid: String,
        node: String,
    },
    Allocate {
        claim: String,
        devices: Vec<Dev>,
        expect_rv: u64,
        /// The gang's pods that name it, as the cache shows them: reserved in the same
        /// write.
        reserved: Vec<String>,
    },
    /// A claim the gang found allocated and holds from its commit on: still as planned,
    /// and fenced (its version moves). One another allocator made lists the gang's pods
    /// that name it, as the cache shows them, in the same write: kube-controller-manager
    /// keeps it allocated while a pod it lists exists and has not ended.
    Hold {
        claim: String,
        devices: Vec<Dev>,
        expect_rv: u64,
        listed: Vec<String>,
    },
    Check {
        planned: BTreeMap<Dev, String>,
    },
    DeleteWorkload {
        gang: String,
    },
    /// The commit's undo of its own writes, each conditional on the version it wrote;
    /// its record is conditioned on the admission revision its first record left.
    UndoOwn {
        gang: String,
        reason: Reason,
        revision: u64,
    },
    EndCommit {
        gang: String,
    },
    Nominate {
        gang: String,
        nomination: Nomination,
    },
    Evict {
        victim: String,
        expected: Journal,
        preemptor: String,
    },
    DropNomination {
        gang: String,
    },
    /// The collector: clear an allocation muster wrote that no journal names, while no
    /// pod but those in `finished` reserves it, and remove muster's finalizer.
    Collect {
        claim: String,
        finished: Vec<String>,
    },
    KueueReady {
        gang: String,
    },
    KueueRequeue {
        gang: String,
    },
    /// The Job of a gang's pods suspended and marked as muster's, against the version
    /// read just before.
    SuspendOwner {
        gang: String,
    },
    /// The Job muster marked resumed and unmarked, against the version the cache showed.
    ResumeOwner {
        gang: String,
        rv: u64,
    },
}

impl Op {
    /// A line for the log.
    fn describe(&self) -> String {
        match self {
            Op::Record {
                gang, expected, record, ..
            } => format!(
                "record {gang}: {:?} -> {:?}",
                expected.as_ref().map(|j| j.state),
                record.journal.as_ref().map(|j| j.state)
            ),
            Op::Delete { name, .. } => format!("delete {name}"),
            Op::Deallocate { claim, .. } => format!("deallocate {claim}"),
            Op::FencePods { pods } => format!("fence {pods:?}"),
            Op::Release { pod, node, .. } => format!("release {pod} to {node}"),
            Op::Allocate { claim, devices, .. } => format!("allocate {claim} {devices:?}"),
            Op::Hold { claim, listed, .. } => format!("hold {claim}, listing {listed:?}"),
            Op::Check { planned } => format!("check {planned:?}"),
            Op::DeleteWorkload { gang } => format!("delete workload {gang}"),
            Op::UndoOwn { gang, .. } => format!("undo {gang}'s writes"),
            Op::EndCommit { gang } => format!("end {gang}'s commit"),
            Op::Nominate { gang, .. } => format!("nominate {gang}"),
            Op::Evict { victim, preemptor, .. } => format!("{preemptor} evicts {victim}"),
            Op::DropNomination { gang } => format!("drop {gang}'s nomination"),
            Op::Collect { claim, .. } => format!("collect {claim}"),
            Op::KueueReady { gang } => format!("tell Kueue {gang} is reserved"),
            Op::KueueRequeue { gang } => format!("give {gang}'s admission back to Kueue"),
            Op::SuspendOwner { gang } => format!("suspend {gang}'s Job"),
            Op::ResumeOwner { gang, .. } => format!("resume {gang}'s Job"),
        }
    }
}

#[derive(Default)]
struct Operator {
    cache: World,
    /// Kinds a (re)started operator has not listed yet: it acts once all are listed.
    unlisted: BTreeSet<Kind>,
    /// Steps until a restarted operator has listed everything.
    down: usize,
    own_workloads: BTreeMap<String, WorkloadObj>,
    own_claims: BTreeMap<String, ClaimObj>,
    own_pods: BTreeMap<String, PodObj>,
    queue: VecDeque<Op>,
    live: Option<String>,
    /// The admission revision the live commit's first record left.
    live_revision: u64,
    /// Claims the live commit allocated, with the version each write returned.
    written: Vec<(String, u64)>,
    /// What commits under way take (the engine's assumed plans), by gang.
    assumed: BTreeMap<String, Vec<(String, Vec<Dev>)>>,
    /// Nominations the engine's state holds, by preemptor.
    nominated: BTreeMap<String, Vec<Dev>>,
    /// How many looks in a row each (gang, claim) looked doubly allocated.
    sightings: BTreeMap<(String, String), u32>,
    cursor: usize,
    /// The pass's start (nominations, the collector) is done for this round.
    pass_started: bool,
}

impl Operator {
    /// A (re)started operator: nothing in memory; it lists each kind in turn while
    /// the cluster moves on.
    fn restart(&mut self, down: usize) {
        *self = Operator {
            unlisted: KINDS.into_iter().collect(),
            down,
            ..Operator::default()
        };
    }

    fn list(&mut self, kind: Kind, world: &World) {
        match kind {
            Kind::Pods => self.cache.pods = world.pods.clone(),
            Kind::Claims => self.cache.claims = world.claims.clone(),
            Kind::Workloads => self.cache.workloads = world.workloads.clone(),
            Kind::Nodes => self.cache.nodes = world.nodes.clone(),
        }
        self.unlisted.remove(&kind);
    }

    fn ready(&self) -> bool {
        self.unlisted.is_empty()
    }

    fn workload(&self, name: &str) -> Option<WorkloadObj> {
        let cached = self.cache.workloads.get(name)?;
        match self.own_workloads.get(name) {
            Some(own) if own.rv > cached.rv => Some(own.clone()),
            _ => Some(cached.clone()),
        }
    }

    fn workloads(&self) -> BTreeMap<String, WorkloadObj> {
        self.cache
            .workloads
            .keys()
            .filter_map(|n| Some((n.clone(), self.workload(n)?)))
            .collect()
    }

    /// The pod cache with the operator's own writes that it does not show yet.
    fn pods(&self) -> BTreeMap<String, PodObj> {
        let mut pods = self.cache.pods.clone();
        for (name, own) in &self.own_pods {
            if let Some(p) = pods.get_mut(name)
                && p.uid == own.uid
                && p.rv < own.rv
            {
                *p = own.clone();
            }
        }
        pods
    }

    fn claims(&self) -> BTreeMap<String, ClaimObj> {
        let mut claims = self.cache.claims.clone();
        for (name, own) in &self.own_claims {
            match claims.get(name) {
                Some(c) if c.rv >= own.rv => {}
                _ => {
                    claims.insert(name.clone(), own.clone());
                }
            }
        }
        claims
    }

    /// What it sees now, taken once for a step.
    fn view(&self) -> View {
        let workloads = self.workloads();
        View {
            holders: holders_of(&workloads),
            workloads,
            claims: self.claims(),
            pods: self.pods(),
        }
    }

    /// Devices the engine's state holds for commits under way.
    fn assumed_devices(&self) -> BTreeSet<Dev> {
        self.assumed
            .values()
            .flatten()
            .flat_map(|(_, d)| d.iter().copied())
            .collect()
    }
}

/// The operator's caches with its own newer writes, and which gangs hold which claim.
struct View {
    workloads: BTreeMap<String, WorkloadObj>,
    claims: BTreeMap<String, ClaimObj>,
    pods: BTreeMap<String, PodObj>,
    holders: BTreeMap<String, BTreeSet<String>>,
}

const SETTINGS: Settings = Settings {
    schedule_timeout: 20_000,
    release_timeout: 20_000,
    refusal_grace: 1_000,
    owner_stop_timeout: 10_000,
};

/// How often the schedules took the paths the model is for.
#[derive(Clone, Copy, Debug, Default)]
struct Stats {
    commits: u64,
    shared_holds: u64,
    let_go: u64,
    /// Gated pods of a gang taken out of `reservedFor` of a claim another allocator made,
    /// as the gang let go of it.
    listings_undone: u64,
    /// Looks at a claim still reserved by a pod of the gang that is gone (or by a
    /// consumer the operator's caches cannot place).
    gone_consumers: u64,
    collected: u64,
    conflict_teardowns: u64,
    nominations: u64,
    evictions: u64,
    kueue_evictions: u64,
    kueue_readmissions: u64,
    restarts: u64,
    deposed_writes: u64,
    refusal_teardowns: u64,
    /// Evictions a deposed leader wrote after the nomination behind them was dropped.
    deposed_evictions: u64,
    /// Protected claims kube-controller-manager deallocated with their last pod.
    controller_deallocations: u64,
    /// Looks at a `Reserving` gang whose commit released some planned pods and stopped
    /// before the rest: the state machine finishes the release.
    commits_finished_after_a_partial_release: u64,
    /// Jobs muster suspended to requeue their gang, and resumed.
    job_suspends: u64,
    job_resumes: u64,
    /// Pods of a suspended Job muster deleted because its controller did not in time.
    owner_stop_deletions: u64,
    /// Places of a Job's gang vacated for a replacement.
    vacancies: u64,
}

impl std::ops::AddAssign for Stats {
    fn add_assign(&mut self, o: Stats) {
        self.commits += o.commits;
        self.shared_holds += o.shared_holds;
        self.let_go += o.let_go;
        self.listings_undone += o.listings_undone;
        self.gone_consumers += o.gone_consumers;
        self.collected += o.collected;
        self.conflict_teardowns += o.conflict_teardowns;
        self.nominations += o.nominations;
        self.evictions += o.evictions;
        self.kueue_evictions += o.kueue_evictions;
        self.kueue_readmissions += o.kueue_readmissions;
        self.restarts += o.restarts;
        self.deposed_writes += o.deposed_writes;
        self.refusal_teardowns += o.refusal_teardowns;
        self.deposed_evictions += o.deposed_evictions;
        self.controller_deallocations += o.controller_deallocations;
        self.commits_finished_after_a_partial_release += o.commits_finished_after_a_partial_release;
        self.job_suspends += o.job_suspends;
        self.job_resumes += o.job_resumes;
        self.owner_stop_deletions += o.owner_stop_deletions;
        self.vacancies += o.vacancies;
    }
}

struct Sim {
    stats: Stats,
    world: World,
    /// The restart count each gang has in the Workload controller's cache, which lags.
    controller_sees: BTreeMap<String, i32>,
    op: Operator,
    /// A deposed leader: stalled past its Lease while writes were under way, it wakes
    /// after another took over, and those writes (at most the number given) still land
    /// before its Lease check stops it. Each was read for before that check: it is
    /// conditional on the objects as they were when the leader stalled (the world kept).
    stale: Option<(Operator, usize, World)>,
    rng: Rng,
    /// Percent chance that a write fails (conflict, timeout).
    fail_rate: u64,
    chaos: bool,
    /// An invariant a write broke when it landed.
    violation: Option<String>,
    /// A deposed leader's write landed in this schedule.
    deposed_wrote: bool,
    /// The write under way is a deposed leader's.
    deposed_writing: bool,
    /// Claims the operator saw holding a device another claim held too.
    seen_doubled: BTreeSet<String>,
    /// (pod, node) pairs kube-scheduler refused.
    refused: BTreeSet<(String, String)>,
    log: Vec<String>,
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut rng = Rng(seed);
        let mut world = World::default();
        for n in 0..NODES {
            world.nodes.insert(format!("n{n}"), true);
        }
        for claim in SHARED {
            let rv = world.bump();
            world.claims.insert(
                claim.to_string(),
                ClaimObj {
                    label: None,
                    allocation: None,
                    ours: false,
                    reserved_for: vec![],
                    rv,
                    late: false,
                    doubled: false,
                    checked: false,
                    protected: false,
                },
            );
        }
        let gangs = 1 + rng.below(3) as usize;
        for g in 0..gangs {
            let name = format!("g{g}");
            let replicas = 1 + rng.below(3) as i32;
            let min_count = 1 + rng.below(replicas as u64) as i32;
            let shared = rng
                .chance(45)
                .then(|| SHARED[rng.below(SHARED.len() as u64) as usize].to_string());
            let priority = i32::from(rng.chance(40));
            let kueue = rng.chance(25).then(Kueue::default);
            let spec = Spec {
                suspend: false,
                evicted: false,
                groups: vec![GroupSpec {
                    name: "w".into(),
                    min_count,
                    managed: true,
                }],
                success_groups: vec![],
                max_restarts: rng.below(3) as i32,
                // Some gangs restart without counting when a pod is lost, some fail at
                // once when one fails, some wait before each restart.
                failure_rules: failure_rules(&mut rng),
                restart_backoff: rng.chance(30).then(|| failure::Backoff {
                    initial: 500 + rng.below(2000) as i64,
                    max: 4000,
                }),
                ttl_seconds_after_finished: None,
                restarted_by_pod_controller: false,
                job_ended: None,
            };
            // Some gangs are a Job's pods: the Job makes and replaces them, and a teardown
            // suspends the Job rather than delete them.
            let job = rng.chance(30).then(JobObj::default);
            let (spec, min_count) = match &job {
                Some(_) => (
                    Spec {
                        groups: vec![GroupSpec {
                            name: "w".into(),
                            min_count: replicas,
                            managed: false,
                        }],
                        max_restarts: 0,
                        failure_rules: vec![],
                        restart_backoff: None,
                        restarted_by_pod_controller: true,
                        ..spec
                    },
                    replicas,
                ),
                None => (spec, min_count),
            };
            let _ = min_count;
            let rv = world.bump();
            let is_job = job.is_some();
            world.workloads.insert(
                name.clone(),
                WorkloadObj {
                    job,
                    spec,
                    replicas,
                    shared,
                    priority,
                    kueue,
                    journal: None,
                    nomination: None,
                    restarts: 0,
                    counted_restarts: 0,
                    finished_at: None,
                    refusals: vec![],
                    rv,
                    revision: 0,
                },
            );
            for i in (0..replicas).filter(|_| !is_job) {
                let rv = world.bump();
                world.claims.insert(
                    pod_claim(&pod_name(&name, i)),
                    ClaimObj {
                        label: Some(name.clone()),
                        allocation: None,
                        ours: false,
                        reserved_for: vec![],
                        rv,
                        late: false,
                        doubled: false,
                        checked: false,
                        protected: false,
                    },
                );
            }
        }
        let mut op = Operator::default();
        op.restart(0);
        for kind in KINDS {
            op.list(kind, &world);
        }
        Sim {
            stats: Stats::default(),
            world,
            controller_sees: BTreeMap::new(),
            op,
            stale: None,
            rng,
            fail_rate: 0,
            chaos: true,
            violation: None,
            deposed_wrote: false,
            deposed_writing: false,
            seen_doubled: BTreeSet::new(),
            refused: BTreeSet::new(),
            log: Vec::new(),
        }
    }

    fn note(&mut self, what: String) {
        if self.log.len() > 4000 {
            self.log.drain(..1000);
        }
        self.log.push(format!("t={} {what}", self.world.now));
    }

    fn fails(&mut self) -> bool {
        self.fail_rate > 0 && self.rng.chance(self.fail_rate)
    }

    fn violated(&mut self, what: String) {
        self.note(format!("VIOLATION: {what}"));
        self.violation.get_or_insert(what);
    }

    // ---- the cluster around the operator ----

    /// The Workload controller: the current attempt's pods exist, gated; a suspended or
    /// finished gang gets none, and its gated pods go (each as seen: never one released
    /// meanwhile). A shared claim takes the label of the first Workload that joins it.
    fn controller(&mut self) {
        let names: Vec<String> = self.world.workloads.keys().cloned().collect();
        for gang in names {
            let w = self.world.workloads[&gang].clone();
            if !self.chaos || self.rng.chance(50) {
                self.controller_sees.insert(gang.clone(), w.restarts);
            }
            if let Some(shared) = &w.shared
                && let Some(c) = self.world.claims.get(shared)
                && c.label.is_none()
            {
                let rv = self.world.bump();
                let c = self.world.claims.get_mut(shared).expect("claim");
                c.label = Some(gang.clone());
                c.rv = rv;
            }
            if w.job.is_some() {
                self.job_controller(&gang);
                continue;
            }
            let attempt = self.controller_sees.get(&gang).copied().unwrap_or(0);
            let finished = w.finished_at.is_some();
            let evicted = w.kueue.as_ref().is_some_and(|k| k.evicted);
            if w.spec.suspend || finished {
                let gated: Vec<String> = self
                    .world
                    .pods
                    .iter()
                    .filter(|(_, p)| p.workload.as_deref() == Some(gang.as_str()) && p.gated && !p.deleting)
                    .map(|(n, _)| n.clone())
                    .collect();
                for name in gated {
                    self.world.pods.remove(&name);
                }
                continue;
            }
            let _ = evicted;
            for i in 0..w.replicas {
                let name = pod_name(&gang, i);
                if self.world.pods.contains_key(&name) {
                    continue;
                }
                self.world.uids += 1;
                let uid = format!("u{}", self.world.uids);
                let mut claims = vec![pod_claim(&name)];
                claims.extend(w.shared.iter().cloned());
                self.world
                    .uid_owners
                    .insert(uid.clone(), (name.clone(), Some(gang.clone())));
                let rv = self.world.bump();
                self.world.pods.insert(
                    name,
                    PodObj {
                        uid,
                        workload: Some(gang.clone()),
                        group: "w".into(),
                        attempt: Some(attempt),
                        index: Some(i),
                        gated: true,
                        pin: None,
                        phase: Phase::Pending,
                        node: None,
                        deleting: false,
                        claims,
                        using: vec![],
                        unscheduled: None,
                        rv,
                    },
                );
            }
        }
    }

    /// The Job controller of a Job's gang: while the Job runs, every index has a pod (a
    /// failed or deleted one is replaced under a new name, with a claim of its own, as
    /// kube-controller-manager makes it from the pod's template); the webhook gated them.
    /// Suspended, its pods go without a failure counted (gated ones at once). Once its
    /// job ended, it makes no more.
    fn job_controller(&mut self, gang: &str) {
        let w = self.world.workloads[gang].clone();
        let Some(job) = w.job.clone() else { return };
        let own: Vec<(String, PodObj)> = self
            .world
            .pods
            .iter()
            .filter(|(_, p)| p.workload.as_deref() == Some(gang))
            .map(|(n, p)| (n.clone(), p.clone()))
            .collect();
        if job.suspended {
            for (name, pod) in own.iter().filter(|(_, p)| !p.phase.terminal() && !p.deleting) {
                if pod.gated {
                    self.world.pods.remove(name);
                } else {
                    let rv = self.world.bump();
                    let p = self.world.pods.get_mut(name).expect("pod");
                    p.deleting = true;
                    p.rv = rv;
                }
            }
            return;
        }
        if w.finished_at.is_some() || w.spec.job_ended.is_some() {
            return;
        }
        for i in 0..w.replicas {
            let live = own
                .iter()
                .any(|(_, p)| p.index == Some(i) && !p.deleting && p.phase != Phase::Failed);
            if live {
                continue;
            }
            let made = {
                let j = self
                    .world
                    .workloads
                    .get_mut(gang)
                    .and_then(|w| w.job.as_mut())
                    .expect("job");
                j.made += 1;
                j.made
            };
            let name = format!("{gang}-w-{i}-{made}");
            self.world.uids += 1;
            let uid = format!("u{}", self.world.uids);
            let claim = pod_claim(&name);
            let rv = self.world.bump();
            self.world.claims.insert(
                claim.clone(),
                ClaimObj {
                    label: Some(gang.to_string()),
                    allocation: None,
                    ours: false,
                    reserved_for: vec![],
                    rv,
                    late: false,
                    doubled: false,
                    checked: false,
                    protected: false,
                },
            );
            let mut claims = vec![claim];
            claims.extend(w.shared.iter().cloned());
            self.world
                .uid_owners
                .insert(uid.clone(), (name.clone(), Some(gang.to_string())));
            let rv = self.world.bump();
            self.world.pods.insert(
                name,
                PodObj {
                    uid,
                    workload: Some(gang.to_string()),
                    group: "w".into(),
                    attempt: None,
                    index: Some(i),
                    gated: true,
                    pin: None,
                    phase: Phase::Pending,
                    node: None,
                    deleting: false,
                    claims,
                    using: vec![],
                    unscheduled: None,
                    rv,
                },
            );
        }
    }

    /// kube-scheduler binds a released pod to its pinned node once every claim of it
    /// is allocated (it would otherwise allocate them itself, outside muster's plan:
    /// it refuses here, and the invariants catch a pod released too early); it adds the
    /// pod to `reservedFor`. The kubelet starts it with the devices of its claims.
    fn schedule(&mut self, name: &str) {
        let Some(pod) = self.world.pods.get(name).cloned() else {
            return;
        };
        if pod.gated || pod.node.is_some() || pod.deleting || pod.workload.is_none() {
            return;
        }
        let Some(node) = pod.pin.clone() else { return };
        if !self.world.nodes.get(&node).copied().unwrap_or(false) {
            return;
        }
        // A constraint muster does not model comes or goes on the node.
        if self.chaos && self.rng.chance(6) {
            if !self.world.refusing.remove(&node) {
                self.world.refusing.insert(node.clone());
            }
            let refusing = self.world.refusing.contains(&node);
            self.note(format!("node {node} refusing={refusing}"));
        }
        if self.world.refusing.contains(&node) {
            self.refused.insert((name.to_string(), node.clone()));
            self.note(format!("kube-scheduler refuses {name} on {node}"));
            self.write_pod(name, |p| {
                p.unscheduled = Some(Unscheduled {
                    reason: "Unschedulable".into(),
                    message: format!("0/3 nodes are available: 1 node(s) refused {node}"),
                    nominated: false,
                    since: None,
                })
            });
            return;
        }
        if self.chaos && self.rng.chance(20) {
            // Not now: kube-scheduler has not tried it yet, or preempts for it.
            let waiting = match self.rng.below(3) {
                0 => None,
                1 => Some(Unscheduled {
                    reason: "SchedulingGated".into(),
                    message: "Scheduling is blocked due to non-empty scheduling gates".into(),
                    nominated: false,
                    since: None,
                }),
                _ => Some(Unscheduled {
                    reason: "Unschedulable".into(),
                    message: "0/3 nodes are available: 1 Insufficient cpu".into(),
                    nominated: true,
                    since: None,
                }),
            };
            if pod.unscheduled.is_none() {
                self.write_pod(name, |p| p.unscheduled = waiting);
            }
            return;
        }
        let mut using = Vec::new();
        for claim in &pod.claims {
            let Some(devices) = self.world.claims.get(claim).and_then(|c| c.allocation.clone()) else {
                return;
            };
            using.extend(devices);
        }
        for claim in &pod.claims {
            let rv = self.world.bump();
            let c = self.world.claims.get_mut(claim).expect("claim");
            if !c.reserved_for.contains(&pod.uid) {
                c.reserved_for.push(pod.uid.clone());
                c.rv = rv;
            }
        }
        let rv = self.world.bump();
        let p = self.world.pods.get_mut(name).expect("pod");
        p.node = Some(node);
        p.using = using;
        p.phase = Phase::Running;
        p.unscheduled = None;
        p.rv = rv;
    }

    /// kube-controller-manager: pods that are gone or done (ended, or being deleted before
    /// they were bound) leave `reservedFor`; a protected claim whose last pod this takes
    /// out is deallocated in the same write.
    fn kcm(&mut self) {
        let live: BTreeSet<String> = self
            .world
            .pods
            .values()
            .filter(|p| !(p.phase.terminal() || p.deleting && p.node.is_none()))
            .map(|p| p.uid.clone())
            .collect();
        let names: Vec<String> = self.world.claims.keys().cloned().collect();
        for name in names {
            let stale = self.world.claims[&name].reserved_for.iter().any(|u| !live.contains(u));
            if stale {
                let rv = self.world.bump();
                let c = self.world.claims.get_mut(&name).expect("claim");
                c.reserved_for.retain(|u| live.contains(u));
                c.rv = rv;
                if c.reserved_for.is_empty() && c.protected && c.allocation.is_some() {
                    deallocate(c);
                    c.protected = false;
                    self.stats.controller_deallocations += 1;
                    self.note(format!("kube-controller-manager deallocates {name}"));
                }
            }
        }
    }

    /// Kueue: it reserves quota for a gang that queues there, admits it once muster
    /// says its claims are reserved, and (while the chaos lasts) evicts admitted gangs.
    fn kueue(&mut self) {
        let names: Vec<String> = self.world.workloads.keys().cloned().collect();
        for gang in names {
            let evict = self.chaos && self.rng.chance(3);
            let Some(k) = self.world.workloads.get_mut(&gang).and_then(|w| w.kueue.as_mut()) else {
                continue;
            };
            if k.evicted {
                continue;
            }
            if !k.quota {
                k.quota = true;
            } else if k.ready && !k.admitted {
                k.admitted = true;
            } else if evict {
                k.evicted = true;
                self.stats.kueue_evictions += 1;
                self.note(format!("Kueue evicts {gang}"));
            }
        }
    }

    /// Marks claims whose devices are in another allocation too.
    fn mark_doubles(&mut self) {
        let mut count = [0u8; NODES * DEVICES_PER_NODE as usize];
        for c in self.world.claims.values() {
            for d in c.allocation.iter().flatten() {
                count[*d as usize] += 1;
            }
        }
        if count.iter().all(|c| *c < 2) {
            return;
        }
        for c in self.world.claims.values_mut() {
            if c.allocation.iter().flatten().any(|d| count[*d as usize] > 1) {
                c.doubled = true;
            }
        }
    }

    fn environment(&mut self) {
        let roll = self.rng.below(100);
        let pods: Vec<String> = self.world.pods.keys().cloned().collect();
        let pick = |rng: &mut Rng, v: &[String]| -> Option<String> {
            (!v.is_empty()).then(|| v[rng.below(v.len() as u64) as usize].clone())
        };
        match roll {
            0..=12 => self.controller(),
            13..=32 => {
                if let Some(p) = pick(&mut self.rng, &pods) {
                    self.schedule(&p);
                }
            }
            33..=40 => self.kcm(),
            41..=44 => self.kueue(),
            45..=53 => {
                // A pod being deleted ends (its grace period is over).
                if let Some(p) = pick(&mut self.rng, &pods).filter(|p| self.world.pods[p].deleting) {
                    self.note(format!("pod {p} is gone"));
                    self.world.pods.remove(&p);
                }
            }
            54..=63 => {
                // Time passes; slowly once calm, so that the scheduler keeps up.
                let most = if self.chaos { 8000 } else { 300 };
                self.world.now += 100 + self.rng.below(most) as i64;
            }
            64..=78 => {
                // A cache catches up, one kind at a time (a restarted operator lists).
                let kind = KINDS[self.rng.below(4) as usize];
                self.op.list(kind, &self.world);
            }
            79..=83 if self.chaos => {
                // A container ends.
                if let Some(p) = pick(&mut self.rng, &pods) {
                    // A Job's pod only fails here (its Job replaces it): a Job's index that
                    // succeeds is not run again, and a requeue could not bring such a gang
                    // back whole; the Job's own end is below.
                    let by_job = self.world.pods[&p]
                        .workload
                        .as_ref()
                        .and_then(|g| self.world.workloads.get(g))
                        .is_some_and(|w| w.job.is_some());
                    let succeeds = !by_job && self.rng.chance(50);
                    let pod = self.world.pods.get_mut(&p).expect("pod");
                    if pod.phase == Phase::Running && pod.workload.is_some() {
                        pod.phase = if succeeds { Phase::Succeeded } else { Phase::Failed };
                        self.note(format!("pod {p} ends {:?}", self.world.pods[&p].phase));
                    }
                }
            }
            84..=85 if self.chaos => {
                // A user deletes a pod.
                if let Some(p) = pick(&mut self.rng, &pods) {
                    self.note(format!("user deletes pod {p}"));
                    self.world.pods.get_mut(&p).expect("pod").deleting = true;
                }
            }
            86..=88 if self.chaos => {
                // A user toggles suspend.
                let names: Vec<String> = self.world.workloads.keys().cloned().collect();
                if let Some(g) = pick(&mut self.rng, &names) {
                    let rv = self.world.bump();
                    let w = self.world.workloads.get_mut(&g).expect("workload");
                    w.spec.suspend = !w.spec.suspend;
                    w.rv = rv;
                    let s = w.spec.suspend;
                    self.note(format!("user sets suspend={s} on {g}"));
                }
            }
            89 if self.chaos => {
                // The Workload controller writes its own part of the status.
                let names: Vec<String> = self.world.workloads.keys().cloned().collect();
                if let Some(g) = pick(&mut self.rng, &names) {
                    let rv = self.world.bump();
                    self.world.workloads.get_mut(&g).expect("workload").rv = rv;
                }
            }
            90 if self.chaos => {
                // A node goes (rarely) or comes back.
                let n = format!("n{}", self.rng.below(NODES as u64));
                let up = !self.world.nodes[&n];
                self.note(format!("node {n} up={up}"));
                self.world.nodes.insert(n.clone(), up);
                if !up {
                    // Pods on it are lost: the node lifecycle controller deletes them.
                    for pod in self.world.pods.values_mut() {
                        if pod.node.as_deref() == Some(n.as_str()) {
                            pod.deleting = true;
                        }
                    }
                }
            }
            91..=94 if self.chaos => self.intrude(),
            96 if self.chaos => {
                // A Job's gang runs to its end: every pod succeeds, and the adoption
                // controller writes the Job's end on the Workload.
                let names: Vec<String> = self
                    .world
                    .workloads
                    .iter()
                    .filter(|(_, w)| w.job.is_some() && w.spec.job_ended.is_none())
                    .map(|(n, _)| n.clone())
                    .collect();
                if let Some(g) = pick(&mut self.rng, &names) {
                    let running: Vec<String> = self
                        .world
                        .pods
                        .iter()
                        .filter(|(_, p)| p.workload.as_deref() == Some(g.as_str()) && p.phase == Phase::Running)
                        .map(|(n, _)| n.clone())
                        .collect();
                    let replicas = self.world.workloads[&g].replicas as usize;
                    if running.len() == replicas {
                        for name in &running {
                            self.world.pods.get_mut(name).expect("pod").phase = Phase::Succeeded;
                        }
                        let rv = self.world.bump();
                        let w = self.world.workloads.get_mut(&g).expect("workload");
                        w.spec.job_ended = Some(muster_admission::JobEnd {
                            succeeded: true,
                            message: "the Job completed".into(),
                        });
                        w.rv = rv;
                        self.note(format!("{g}'s Job completes"));
                    }
                }
            }
            95 if self.chaos => {
                let world = self.world.clone();
                let down = self.rng.below(30) as usize;
                if self.stale.is_none() && !self.op.queue.is_empty() && self.rng.chance(50) {
                    let in_flight = 1 + self.rng.below(3) as usize;
                    self.note(format!(
                        "operator stalls with {in_flight} writes under way; another takes over"
                    ));
                    let mut successor = Operator::default();
                    successor.restart(down);
                    self.stale = Some((std::mem::replace(&mut self.op, successor), in_flight, world));
                } else {
                    self.note("operator crashes".into());
                    self.stats.restarts += 1;
                    self.op.restart(down);
                }
            }
            _ => {}
        }
    }

    /// Someone else's pod: it takes a free device through its own claim, joins a claim
    /// that gangs share (kube-scheduler allocates it, if it is not, from a free device),
    /// or allocates a device a checked gang holds (kube-scheduler decided in memory
    /// before muster's write reached it). It may end later.
    fn intrude(&mut self) {
        if self.rng.chance(25) {
            if let Some(p) = self.world.intruders().first() {
                self.note(format!("intruder {p} ends"));
                self.world.pods.remove(p);
            }
            return;
        }
        self.world.uids += 1;
        let uid = format!("u{}", self.world.uids);
        let name = format!("intruder-{uid}");
        let taken = self.world.allocated();
        let free: Vec<Dev> = self
            .world
            .devices()
            .into_iter()
            .filter(|d| !taken.contains(d))
            .collect();
        let roll = self.rng.below(100);
        let (claim, devices) = if roll < 40 {
            let claim = SHARED[self.rng.below(SHARED.len() as u64) as usize].to_string();
            let devices = match self.world.claims[&claim].allocation.clone() {
                Some(devices) => devices,
                None => {
                    let Some(d) = free.get(self.rng.below(free.len().max(1) as u64) as usize).copied() else {
                        return;
                    };
                    let rv = self.world.bump();
                    let c = self.world.claims.get_mut(&claim).expect("claim");
                    c.allocation = Some(vec![d]);
                    c.ours = false;
                    c.doubled = false;
                    // kube-scheduler gives a claim it allocates delete-protection:
                    // kube-controller-manager deallocates it with its last pod.
                    c.protected = true;
                    c.rv = rv;
                    vec![d]
                }
            };
            (claim, devices)
        } else {
            // A device of a gang's checked claim, or a free one.
            let checked: Vec<Dev> = self
                .world
                .workloads
                .values()
                .filter_map(|w| w.journal.as_ref())
                .filter(|j| matches!(j.state, State::Reserved | State::Released))
                .flat_map(|j| j.claims.iter())
                .filter_map(|c| self.world.claims.get(c)?.allocation.clone())
                .flatten()
                .collect();
            let late = roll < 55 && !checked.is_empty();
            let pool = if late { &checked } else { &free };
            let Some(d) = pool.get(self.rng.below(pool.len().max(1) as u64) as usize).copied() else {
                return;
            };
            let claim = format!("{name}-claim");
            let rv = self.world.bump();
            self.world.claims.insert(
                claim.clone(),
                ClaimObj {
                    label: None,
                    allocation: Some(vec![d]),
                    ours: false,
                    reserved_for: vec![],
                    rv,
                    late,
                    doubled: false,
                    checked: false,
                    protected: false,
                },
            );
            (claim, vec![d])
        };
        let node = devices.first().map(|d| node_of(*d));
        self.world.uid_owners.insert(uid.clone(), (name.clone(), None));
        let rv = self.world.bump();
        let c = self.world.claims.get_mut(&claim).expect("claim");
        c.reserved_for.push(uid.clone());
        c.rv = rv;
        self.note(format!("intruder {name} uses {claim} {devices:?}"));
        let rv = self.world.bump();
        self.world.pods.insert(
            name,
            PodObj {
                uid,
                workload: None,
                group: String::new(),
                attempt: None,
                index: None,
                gated: false,
                pin: node.clone(),
                phase: Phase::Running,
                node,
                deleting: false,
                claims: vec![claim],
                using: devices,
                unscheduled: None,
                rv,
            },
        );
    }

    // ---- the operator ----

    fn operator(&mut self) {
        if self.op.down > 0 {
            self.op.down -= 1;
            return;
        }
        if !self.op.ready() {
            for kind in self.op.unlisted.clone() {
                self.op.list(kind, &self.world);
            }
        }
        if let Some(op) = self.op.queue.pop_front() {
            self.execute(op);
            return;
        }
        let names: Vec<String> = self.op.cache.workloads.keys().cloned().collect();
        if names.is_empty() {
            return;
        }
        if self.op.cursor.is_multiple_of(names.len()) && !self.op.pass_started {
            self.op.pass_started = true;
            self.pass_start();
            if !self.op.queue.is_empty() {
                return;
            }
        }
        let gang = names[self.op.cursor % names.len()].clone();
        self.op.cursor += 1;
        self.op.pass_started = false;
        self.advance(&gang);
    }
}

/// The gangs whose journal names each claim, among `workloads`.
fn holders_of(workloads: &BTreeMap<String, WorkloadObj>) -> BTreeMap<String, BTreeSet<String>> {
    {
        let mut holders: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (gang, w) in workloads {
            for claim in holding(&w.journal).iter().flat_map(|j| &j.claims) {
                holders.entry(claim.clone()).or_default().insert(gang.clone());
            }
        }
        holders
    }
}

impl Sim {
    /// Every pass: the nominations are held (rebuilt from the status), their victims
    /// evicted, and ended ones dropped; then the collector looks at every claim.
    fn pass_start(&mut self) {
        let view = self.op.view();
        let (workloads, claims) = (&view.workloads, &view.claims);
        let now = self.world.now;
        let mut holding_now = BTreeSet::new();
        for (gang, w) in workloads {
            let Some(n) = &w.nomination else { continue };
            match w.journal.as_ref().map(|j| j.state) {
                None => {}
                // A commit under way or being undone: its nomination holds on until
                // the gang is released.
                Some(State::Reserving) => {
                    holding_now.insert(gang.clone());
                    self.op
                        .nominated
                        .entry(gang.clone())
                        .or_insert_with(|| n.devices.clone());
                    continue;
                }
                Some(_) => continue,
            }
            let evicted = w.kueue.as_ref().is_some_and(|k| k.evicted);
            let expired = now - n.since > NOMINATION_LIFETIME;
            // A device it holds taken by a claim neither its own nor one its victims
            // give back (a victim's claim another gang holds too stays allocated).
            let only_victims = |c: &String| {
                view.holders
                    .get(c)
                    .is_none_or(|h| h.iter().all(|g| n.victims.contains(g)))
            };
            let mine: BTreeSet<String> = (0..w.replicas)
                .map(|i| pod_claim(&pod_name(gang, i)))
                .chain(w.shared.iter().cloned())
                .chain(
                    n.victims
                        .iter()
                        .filter_map(|v| workloads.get(v)?.journal.clone())
                        .flat_map(|j| j.claims)
                        .filter(only_victims),
                )
                .collect();
            let taken = claims
                .iter()
                .filter(|(name, _)| !mine.contains(*name))
                .any(|(_, c)| c.allocation.iter().flatten().any(|d| n.devices.contains(d)));
            if w.spec.suspend || evicted || expired || taken {
                let why = format!(
                    "suspend={} evicted={evicted} expired={expired} taken={taken}",
                    w.spec.suspend
                );
                self.note(format!("{gang}'s nomination ends: {why}"));
                self.op.queue.push_back(Op::DropNomination { gang: gang.clone() });
                // Held until the drop lands: its status still says it stands.
                holding_now.insert(gang.clone());
                continue;
            }
            holding_now.insert(gang.clone());
            self.op
                .nominated
                .entry(gang.clone())
                .or_insert_with(|| n.devices.clone());
            for victim in &n.victims {
                let Some(v) = workloads.get(victim) else { continue };
                let Some(j) = v.journal.clone().filter(|j| j.state == State::Released) else {
                    continue;
                };
                let holds = j
                    .claims
                    .iter()
                    .filter_map(|c| claims.get(c)?.allocation.clone())
                    .flatten()
                    .any(|d| n.devices.contains(&d));
                if holds && !v.spec.suspend {
                    self.op.queue.push_back(Op::Evict {
                        victim: victim.clone(),
                        expected: j,
                        preemptor: gang.clone(),
                    });
                }
            }
        }
        self.op.nominated.retain(|g, _| holding_now.contains(g));

        // The collector.
        let holders = &view.holders;
        let finished: Vec<String> = view
            .pods
            .values()
            .filter(|p| p.phase.terminal())
            .map(|p| p.uid.clone())
            .collect();
        let gated: BTreeMap<&String, (&String, u64)> = view
            .pods
            .iter()
            .filter(|(_, p)| p.gated && p.node.is_none())
            .map(|(name, p)| (&p.uid, (name, p.rv)))
            .collect();
        for (name, c) in claims {
            if !c.ours || c.allocation.is_none() || holders.contains_key(name) {
                continue;
            }
            if c.reserved_for
                .iter()
                .all(|u| finished.contains(u) || gated.contains_key(u))
            {
                // Pods still behind the gate use nothing: fenced first, they count as idle.
                let fenced: Vec<(String, u64)> = c
                    .reserved_for
                    .iter()
                    .filter_map(|u| gated.get(u))
                    .map(|(pod, rv)| ((*pod).clone(), *rv))
                    .collect();
                let mut idle = finished.clone();
                idle.extend(c.reserved_for.iter().filter(|u| gated.contains_key(u)).cloned());
                if !fenced.is_empty() {
                    self.op.queue.push_back(Op::FencePods { pods: fenced });
                }
                self.op.queue.push_back(Op::Collect {
                    claim: name.clone(),
                    finished: idle,
                });
            }
        }
    }

    /// One gang's step: observe, decide, perform; a queued gang is planned, a released
    /// one's extras placed; then Kueue hears where the gang stands now.
    fn advance(&mut self, gang: &str) {
        let view = self.op.view();
        let Some(w) = view.workloads.get(gang).cloned() else {
            return;
        };
        let (claims, pods_view) = (&view.claims, &view.pods);
        let pods = Self::pod_views(gang, &view);
        let journal = w.journal.clone();
        let named: BTreeSet<&String> = journal.iter().flat_map(|j| &j.claims).collect();
        let claim_views: Vec<ClaimView> = claims
            .iter()
            .filter(|(name, c)| c.label.as_deref() == Some(gang) || named.contains(name))
            .map(|(name, c)| self.claim_view(gang, name, c, &view))
            .collect();
        let gone = claim_views
            .iter()
            .flat_map(|c| &c.reserved_for)
            .filter(|u| !u.known_outside && !pods.iter().any(|p| p.uid == u.uid))
            .count();
        self.stats.gone_consumers += gone as u64;
        let nodes: BTreeMap<String, NodeHealth> = self
            .op
            .cache
            .nodes
            .iter()
            .filter(|(_, up)| **up)
            .map(|(n, _)| (n.clone(), NodeHealth::Ready))
            .collect();
        let devices_published = named
            .iter()
            .filter_map(|c| claims.get(*c)?.allocation.clone())
            .flatten()
            .all(|d| nodes.contains_key(&node_of(d)));
        // A journal's claim whose device another claim holds too, for long enough.
        let mut conflicted = Vec::new();
        for name in &named {
            let key = (gang.to_string(), (*name).clone());
            let mine = claims.get(*name).and_then(|c| c.allocation.clone()).unwrap_or_default();
            let doubled = claims
                .iter()
                .any(|(other, c)| other != *name && c.allocation.iter().flatten().any(|d| mine.contains(d)));
            if doubled {
                self.seen_doubled.insert((*name).clone());
                let seen = self.op.sightings.entry(key).or_default();
                *seen += 1;
                if *seen >= CONFLICT_SIGHTINGS {
                    conflicted.push((*name).clone());
                }
            } else {
                self.op.sightings.remove(&key);
            }
        }
        let mut spec = w.spec.clone();
        spec.evicted = w.kueue.as_ref().is_some_and(|k| k.evicted);
        let gang_view = Gang {
            spec: &spec,
            journal: journal.as_ref(),
            restarts: w.restarts,
            counted_restarts: w.counted_restarts,
            finished_at: w.finished_at,
            pods: &pods,
            claims: &claim_views,
            nodes: &nodes,
            devices_published,
            reuse_problems: Some(&[]),
            conflicted: &conflicted,
            refusals: &w.refusals,
            owners: w.job.as_ref().map_or(Owners::default(), |j| Owners {
                suspended: j.suspended && j.marked,
                marked: j.marked,
            }),
            now: self.world.now,
        };
        if let Some(j) = journal.as_ref()
            && commit::released_any(j, |name| gang_view.current_pod(name))
            && !commit::pins(j, |name| gang_view.current_pod(name)).is_empty()
        {
            self.stats.commits_finished_after_a_partial_release += 1;
        }
        let step = decide(&gang_view, &SETTINGS);
        if journal.is_none() && !step.effects.is_empty() {
            self.note(format!("queued {gang}: {} effects", step.effects.len()));
        }
        let release_held = w.kueue.as_ref().is_some_and(|k| !k.admitted || k.evicted);
        for effect in step.effects {
            match effect {
                Effect::Record(record) => self.op.queue.push_back(Op::Record {
                    gang: gang.to_string(),
                    expected: journal.clone(),
                    revision: w.revision,
                    record,
                }),
                Effect::DeletePods { pods, immediately, .. } => {
                    for pod in pods {
                        let rv = pods_view.get(&pod.name).map_or(0, |p| p.rv);
                        self.op.queue.push_back(Op::Delete {
                            name: pod.name,
                            uid: pod.uid,
                            rv,
                            immediately,
                        });
                    }
                }
                Effect::Deallocate { claims, idle } => {
                    let pods: Vec<(String, u64)> = pods_view
                        .iter()
                        .filter(|(n, p)| {
                            p.workload.as_deref() == Some(gang)
                                && p.gated
                                && journal.as_ref().is_some_and(|j| j.planned(n).is_some())
                        })
                        .map(|(n, p)| (n.clone(), p.rv))
                        .collect();
                    if !pods.is_empty() {
                        self.op.queue.push_back(Op::FencePods { pods });
                    }
                    for claim in claims {
                        self.op.queue.push_back(Op::Deallocate {
                            claim,
                            idle: idle.clone(),
                        });
                    }
                }
                // Reserved for a gang Kueue has not admitted yet: its pods wait.
                Effect::Release { .. } if release_held => {}
                Effect::Release { pods } => {
                    for pin in pods {
                        self.op.queue.push_back(Op::Release {
                            gang: gang.to_string(),
                            pod: pin.pod.name,
                            uid: pin.pod.uid,
                            node: pin.node,
                        });
                    }
                }
                Effect::DeleteWorkload => self.op.queue.push_back(Op::DeleteWorkload { gang: gang.to_string() }),
                Effect::SuspendOwners | Effect::ResumeOwners if w.job.is_none() => {
                    self.violated(format!("{gang}: its pods have no owner to suspend or resume"));
                }
                Effect::SuspendOwners => self.op.queue.push_back(Op::SuspendOwner { gang: gang.to_string() }),
                Effect::ResumeOwners => self.op.queue.push_back(Op::ResumeOwner {
                    gang: gang.to_string(),
                    rv: w.job.as_ref().map_or(0, |j| j.rv),
                }),
                Effect::Event { .. } => {}
            }
        }
        if !self.op.queue.is_empty() {
            return;
        }
        // Kueue hears where the gang stands now, after its step.
        if let Some(k) = &w.kueue {
            let reserved = journal
                .as_ref()
                .is_some_and(|j| matches!(j.state, State::Reserved | State::Released));
            if reserved && k.quota && !k.ready && !k.evicted {
                self.op.queue.push_back(Op::KueueReady { gang: gang.to_string() });
                return;
            }
            if k.evicted && journal.is_none() {
                self.op.queue.push_back(Op::KueueRequeue { gang: gang.to_string() });
                return;
            }
        }
        match journal.map(|j| j.state) {
            None => self.plan(gang, &w, &view),
            Some(State::Released) => self.extras(gang, &w, &view),
            Some(_) => {}
        }
    }

    /// A claim as gang `gang` sees it: `reservedFor` entries carry the pod's name (the
    /// API server keeps it with the uid); one is known outside the gang when the
    /// operator's pod cache shows that uid on a pod of no gang or of another.
    fn claim_view(&self, gang: &str, name: &str, c: &ClaimObj, view: &View) -> ClaimView {
        ClaimView {
            name: name.to_string(),
            devices: c.allocation.iter().flatten().map(|d| d.to_string()).collect(),
            allocated: c.allocation.is_some(),
            ours: c.ours,
            held_elsewhere: view.holders.get(name).is_some_and(|h| h.iter().any(|g| g != gang)),
            used_by: view
                .pods
                .values()
                .filter(|p| p.workload.as_deref() == Some(gang) && p.claims.iter().any(|n| n == name))
                .map(|p| p.uid.clone())
                .collect(),
            protected: c.protected,
            reserved_for: c
                .reserved_for
                .iter()
                .map(|uid| Consumer {
                    name: self
                        .world
                        .uid_owners
                        .get(uid)
                        .map(|(n, _)| n.clone())
                        .unwrap_or_default(),
                    uid: uid.clone(),
                    known_outside: view
                        .pods
                        .values()
                        .any(|p| &p.uid == uid && p.workload.as_deref() != Some(gang)),
                })
                .collect(),
        }
    }

    /// The pods of gang `gang` in the operator's view, as the state machine sees them.
    fn pod_views(gang: &str, view: &View) -> Vec<PodView> {
        let by_job = view.workloads.get(gang).is_some_and(|w| w.job.is_some());
        view.pods
            .iter()
            .filter(|(_, p)| p.workload.as_deref() == Some(gang))
            .map(|(name, p)| PodView {
                name: name.clone(),
                uid: p.uid.clone(),
                group: Some(p.group.clone()),
                index: p.index,
                attempt: p.attempt,
                gated: p.gated,
                phase: p.phase,
                node: p.node.clone(),
                deleting: p.deleting,
                message: None,
                failure_kind: None,
                exit_codes: vec![],
                conditions: vec![],
                unscheduled: p.unscheduled.clone(),
                owned: by_job && p.attempt.is_none(),
            })
            .collect()
    }

    /// Devices gang `gang` of `priority` sees free: no claim holds them in the
    /// operator's view, no commit under way assumes them, no nomination of another gang
    /// of at least its priority holds them (a gang plans as if nominations of lower
    /// priority were not there), and their node is up. Its own nomination's devices
    /// come first.
    fn free_devices(&self, gang: &str, priority: i32, view: &View) -> Vec<Dev> {
        let (claims, workloads) = (&view.claims, &view.workloads);
        let mut taken: BTreeSet<Dev> = claims
            .values()
            .flat_map(|c| c.allocation.iter().flatten().copied())
            .collect();
        taken.extend(self.op.assumed_devices());
        for (owner, devices) in &self.op.nominated {
            if owner != gang && workloads.get(owner).is_none_or(|w| w.priority >= priority) {
                taken.extend(devices.iter().copied());
            }
        }
        let own: Vec<Dev> = self.op.nominated.get(gang).cloned().unwrap_or_default();
        // Nodes kube-scheduler refused the gang's group on lately.
        let now = self.world.now;
        let refused: BTreeSet<String> = workloads
            .get(gang)
            .into_iter()
            .flat_map(|w| &w.refusals)
            .filter(|r| r.active(now))
            .map(|r| r.node.clone())
            .collect();
        let mut free: Vec<Dev> = (0..(NODES as u32 * DEVICES_PER_NODE))
            .filter(|d| self.op.cache.nodes.get(&node_of(*d)).copied().unwrap_or(false) && !taken.contains(d))
            .filter(|d| !refused.contains(&node_of(*d)))
            .collect();
        free.sort_by_key(|d| !own.contains(d));
        free
    }

    /// A queued gang whose current attempt's pods all wait at the gate is planned on
    /// the devices it sees free: one per pod, one more for its shared claim unless the
    /// claim is allocated already (then the gang holds it as it is). One that does not
    /// fit may preempt.
    fn plan(&mut self, gang: &str, w: &WorkloadObj, view: &View) {
        if w.spec.suspend || w.finished_at.is_some() || self.op.live.is_some() {
            return;
        }
        if w.kueue.as_ref().is_some_and(|k| !k.quota || k.evicted) {
            return;
        }
        let cached = &view.pods;
        let pods: Vec<String> = Self::members(gang, w, view)
            .into_iter()
            .filter(|name| {
                cached.get(name).is_some_and(|pod| {
                    pod.gated && !pod.deleting && (pod.attempt == Some(w.restarts) || w.job.is_some())
                })
            })
            .collect();
        if (pods.len() as i32) < w.replicas {
            return;
        }
        let claims = &view.claims;
        // Claims the view still shows allocated belong to someone: wait.
        if pods
            .iter()
            .any(|n| claims.get(&pod_claim(n)).is_some_and(|c| c.allocation.is_some()))
        {
            return;
        }
        let shared = w
            .shared
            .as_ref()
            .map(|c| (c.clone(), claims.get(c).and_then(|c| c.allocation.clone())));
        // A shared claim a commit under way allocates: planned again later (the others
        // go on meanwhile).
        if let Some((claim, None)) = &shared
            && self.op.assumed.values().flatten().any(|(c, _)| c == claim)
        {
            return;
        }
        // One allocated whose device another claim holds too: not held as it is, but
        // waited for, until its holders give way or the collector clears it.
        if let Some((claim, Some(held))) = &shared
            && claims
                .iter()
                .any(|(other, c)| other != claim && c.allocation.iter().flatten().any(|d| held.contains(d)))
        {
            return;
        }
        // One whose device a nomination of at least its priority counts on: it waits,
        // as a fresh allocation of that device would.
        if let Some((_, Some(held))) = &shared
            && self.op.nominated.iter().any(|(owner, devices)| {
                owner != gang
                    && view.workloads.get(owner).is_none_or(|o| o.priority >= w.priority)
                    && devices.iter().any(|d| held.contains(d))
            })
        {
            return;
        }
        // One muster allocated that no journal names and that no consumer known to be
        // outside keeps: left for the collector to clear, not held again as it is.
        if let Some((claim, Some(_))) = &shared
            && let Some(c) = claims.get(claim).filter(|c| c.ours)
            && !view.holders.contains_key(claim)
            && !self
                .claim_view(gang, claim, c, view)
                .reserved_for
                .iter()
                .any(|u| u.known_outside)
        {
            return;
        }
        let min = w.spec.groups[0].min_count;
        let free = self.free_devices(gang, w.priority, view);
        let for_shared = usize::from(matches!(shared, Some((_, None))));
        let fit = free.len().saturating_sub(for_shared).min(pods.len());
        if (fit as i32) < min {
            self.preempt(gang, w, free.len(), min as usize + for_shared, view);
            return;
        }
        let mut devices = free.into_iter();
        let mut placement = Placement {
            pods: vec![],
            claims: vec![],
            topology_value: None,
            devices: 0,
        };
        let mut allocations = Vec::new();
        let mut found = Vec::new();
        for (i, name) in pods.iter().take(fit).enumerate() {
            let d = devices.next().expect("counted");
            placement.pods.push(PlannedPod {
                name: name.clone(),
                node: node_of(d),
                group: Some("w".into()),
                devices: vec![],
                extra: i as i32 >= min,
                released_at: None,
                claims: if i as i32 >= min { vec![pod_claim(name)] } else { vec![] },
            });
            placement.claims.push(pod_claim(name));
            allocations.push((pod_claim(name), vec![d]));
        }
        match shared {
            Some((claim, None)) => {
                let d = devices.next().expect("counted");
                placement.claims.push(claim.clone());
                allocations.push((claim, vec![d]));
            }
            Some((claim, Some(held))) => {
                placement.claims.push(claim.clone());
                found.push((claim, held));
            }
            None => {}
        }
        placement.devices = allocations.len() as i32;
        // Its nomination holds on beside its plan until it is released.
        let journal = commit::reserving(&placement, self.world.now);
        self.commit(
            gang,
            (w.journal.clone(), w.revision),
            journal,
            allocations,
            found,
            claims,
        );
    }

    /// A gang that does not fit, outside Kueue: with a nomination, it waits (dropping
    /// it once its victims are gone and its devices free, yet it still does not fit);
    /// without, it nominates the devices of gangs of lower priority whose teardown gives
    /// back enough, and evicts them.
    fn preempt(&mut self, gang: &str, w: &WorkloadObj, free: usize, needed: usize, view: &View) {
        if w.kueue.is_some() {
            return;
        }
        let (workloads, claims) = (&view.workloads, &view.claims);
        if let Some(n) = &w.nomination {
            let victims_left = n
                .victims
                .iter()
                .any(|v| workloads.get(v).is_some_and(|w| w.journal.is_some()));
            let devices_free = n
                .devices
                .iter()
                .all(|d| !claims.values().any(|c| c.allocation.iter().flatten().any(|x| x == d)));
            if !victims_left && devices_free {
                self.note(format!(
                    "{gang}'s nomination ends: its victims are gone and it does not fit ({free} free, {needed} needed)"
                ));
                self.op.queue.push_back(Op::DropNomination { gang: gang.into() });
            }
            return;
        }
        let mut freed: Vec<(String, Vec<Dev>, bool)> = Vec::new();
        for (name, v) in workloads {
            if name == gang || v.priority >= w.priority || v.kueue.is_some() {
                continue;
            }
            let Some(j) = v.journal.as_ref().filter(|j| j.state == State::Released) else {
                continue;
            };
            let own = Self::pod_views(name, view);
            // Only what its teardown gives back.
            let given: Vec<&String> = j
                .claims
                .iter()
                .filter(|c| {
                    claims.get(*c).is_some_and(|claim| {
                        let seen = self.claim_view(name, c, claim, view);
                        ownership::freed_by_giving_back(&seen, &own, Some(j))
                    })
                })
                .collect();
            // Devices on nodes the preemptor keeps off free nothing for it.
            let now = self.world.now;
            let devices: Vec<Dev> = given
                .iter()
                .filter_map(|c| claims.get(*c)?.allocation.clone())
                .flatten()
                .filter(|d| !w.refusals.iter().any(|r| r.active(now) && r.node == node_of(*d)))
                .collect();
            // The claim it shares with the victim comes back unallocated: it needs a
            // device of its own then.
            let frees_shared = w.shared.as_ref().is_some_and(|s| given.contains(&s));
            if !devices.is_empty() {
                freed.push((name.clone(), devices, frees_shared));
            }
        }
        let mut victims = Vec::new();
        let mut got = free;
        let mut needed = needed;
        for (victim, devices, frees_shared) in &freed {
            if got >= needed {
                break;
            }
            victims.push(victim.clone());
            got += devices.len();
            needed += usize::from(*frees_shared);
        }
        if got < needed || victims.is_empty() {
            return;
        }
        let mut devices: Vec<Dev> = self.free_devices(gang, w.priority, view);
        // The victims' devices in any order: the planner may count on any of them.
        let mut given: Vec<Dev> = freed
            .iter()
            .filter(|(v, ..)| victims.contains(v))
            .flat_map(|(_, d, _)| d.iter().copied())
            .collect();
        for i in (1..given.len()).rev() {
            given.swap(i, self.rng.below(i as u64 + 1) as usize);
        }
        devices.extend(given);
        devices.truncate(needed);
        let nomination = Nomination {
            since: self.world.now,
            victims: victims.clone(),
            devices,
        };
        self.note(format!("{gang} nominates {nomination:?}"));
        self.op.queue.push_back(Op::Nominate {
            gang: gang.into(),
            nomination,
        });
    }

    fn commit(
        &mut self,
        gang: &str,
        (expected, revision): (Option<Journal>, u64),
        journal: Journal,
        allocations: Vec<(String, Vec<Dev>)>,
        found: Vec<(String, Vec<Dev>)>,
        claims: &BTreeMap<String, ClaimObj>,
    ) {
        self.note(format!("commit {gang}: {allocations:?}, holding {found:?}"));
        // A claim held as it is takes its devices as an allocation does: never one a
        // nomination of at least the gang's priority counts on.
        let priority = self.world.workloads.get(gang).map_or(0, |w| w.priority);
        for (claim, devices) in &found {
            let nominated = self.world.workloads.iter().find(|(owner, w)| {
                owner.as_str() != gang
                    && w.priority >= priority
                    && w.nomination
                        .as_ref()
                        .is_some_and(|n| n.devices.iter().any(|d| devices.contains(d)))
            });
            if let Some((owner, _)) = nominated
                && !self.deposed_wrote
            {
                let owner = owner.clone();
                self.violated(format!(
                    "{gang} holds {claim} as it is, on a device {owner}'s nomination counts on"
                ));
            }
        }
        self.stats.commits += 1;
        self.stats.shared_holds += found.len() as u64;
        self.op.live = Some(gang.to_string());
        self.op.written.clear();
        self.op.assumed.insert(gang.to_string(), allocations.clone());
        let planned: BTreeMap<Dev, String> = allocations
            .iter()
            .flat_map(|(c, ds)| ds.iter().map(move |d| (*d, c.clone())))
            .collect();
        let reserved = if journal.state == State::Reserving {
            commit::reserved(&journal, self.world.now)
        } else {
            journal.clone()
        };
        self.op.queue.push_back(Op::Record {
            gang: gang.into(),
            expected,
            revision,
            record: Record {
                journal: Some(journal.clone()),
                conditions: vec![],
                restarts: None,
                refusals: None,
            },
        });
        // What the commit's own writes are conditioned on once its first record landed.
        self.op.live_revision = revision + 1;
        for (claim, devices) in found {
            let expect_rv = claims.get(&claim).map_or(0, |c| c.rv);
            // The planned pods, as the operator's `planned_consumers` picks them.
            let listed = self
                .op
                .cache
                .pods
                .iter()
                .filter(|(name, p)| {
                    p.workload.as_deref() == Some(gang)
                        && !p.deleting
                        && p.claims.contains(&claim)
                        && journal.planned(name).is_some()
                })
                .map(|(_, p)| p.uid.clone())
                .collect();
            self.op.queue.push_back(Op::Hold {
                claim,
                devices,
                expect_rv,
                listed,
            });
        }
        for (claim, devices) in allocations {
            let expect_rv = claims.get(&claim).map_or(0, |c| c.rv);
            let reserved = self
                .op
                .cache
                .pods
                .values()
                .filter(|p| p.workload.as_deref() == Some(gang) && !p.deleting && p.claims.contains(&claim))
                .map(|p| p.uid.clone())
                .collect();
            self.op.queue.push_back(Op::Allocate {
                claim,
                devices,
                expect_rv,
                reserved,
            });
        }
        self.op.queue.push_back(Op::Check { planned });
        let release_held = self
            .world
            .workloads
            .get(gang)
            .and_then(|w| w.kueue.as_ref())
            .is_some_and(|k| !k.admitted || k.evicted);
        if journal.state == State::Reserving && !release_held {
            // Checked: the pods go at once, nothing recorded in between (the state
            // machine finishes a commit that released a pod, and records it released).
            let cached = &self.op.cache.pods;
            let releases: Vec<Op> = journal
                .pods
                .iter()
                .filter_map(|p| {
                    let pod = cached.get(&p.name).filter(|pod| pod.gated && !pod.deleting)?;
                    Some(Op::Release {
                        gang: gang.into(),
                        pod: p.name.clone(),
                        uid: pod.uid.clone(),
                        node: p.node.clone(),
                    })
                })
                .collect();
            self.op.queue.extend(releases);
        } else {
            self.op.queue.push_back(Op::Record {
                gang: gang.into(),
                expected: Some(journal),
                revision: revision + 1,
                record: Record {
                    journal: Some(reserved),
                    conditions: vec![],
                    restarts: None,
                    refusals: None,
                },
            });
        }
        self.op.queue.push_back(Op::EndCommit { gang: gang.into() });
    }

    /// The gang's pods, one per index: muster's own by name; a Job's, the newest of each
    /// index that is not being deleted and has not failed (as the Workload controller's
    /// membership picks them).
    fn members(gang: &str, w: &WorkloadObj, view: &View) -> Vec<String> {
        if w.job.is_none() {
            return (0..w.replicas).map(|i| pod_name(gang, i)).collect();
        }
        (0..w.replicas)
            .filter_map(|i| {
                view.pods
                    .iter()
                    .filter(|(_, p)| p.workload.as_deref() == Some(gang) && p.index == Some(i))
                    .filter(|(_, p)| !p.deleting && p.phase != Phase::Failed)
                    .max_by_key(|(_, p)| p.rv)
                    .map(|(n, _)| n.clone())
            })
            .collect()
    }

    /// Waiting extras of a released gang that now fit: committed like a gang. (A Job's
    /// replacements are not placed here: their places' bound requeues the gang.)
    fn extras(&mut self, gang: &str, w: &WorkloadObj, view: &View) {
        if w.job.is_some() {
            return;
        }
        let Some(journal) = w.journal.clone() else { return };
        if !self.op.queue.is_empty() || w.spec.suspend || self.op.live.is_some() {
            return;
        }
        if w.kueue.as_ref().is_some_and(|k| !k.admitted || k.evicted) {
            return;
        }
        let (claims, cached) = (&view.claims, &view.pods);
        let waiting: Vec<String> = (0..w.replicas)
            .map(|i| pod_name(gang, i))
            .filter(|n| journal.planned(n).is_none())
            .filter(|n| {
                cached
                    .get(n)
                    .is_some_and(|p| p.gated && !p.deleting && p.attempt == Some(w.restarts))
            })
            .filter(|n| claims.get(&pod_claim(n)).is_some_and(|c| c.allocation.is_none()))
            .collect();
        let free = self.free_devices(gang, w.priority, view);
        if waiting.is_empty() || free.is_empty() {
            return;
        }
        let mut placement = Placement {
            pods: vec![],
            claims: vec![],
            topology_value: None,
            devices: 0,
        };
        let mut allocations = Vec::new();
        for (name, d) in waiting.iter().zip(free) {
            placement.pods.push(PlannedPod {
                name: name.clone(),
                node: node_of(d),
                group: Some("w".into()),
                devices: vec![],
                extra: true,
                released_at: None,
                claims: vec![pod_claim(name)],
            });
            placement.claims.push(pod_claim(name));
            allocations.push((pod_claim(name), vec![d]));
        }
        placement.devices = allocations.len() as i32;
        let grown = commit::with_extras(&journal, &placement);
        let released = commit::extras_released(&grown, &placement, self.world.now);
        let extras = format!("{gang}+extras");
        self.commit(&extras, (Some(journal), w.revision), grown, allocations, vec![], claims);
        // The commit records against the gang; its last record makes the extras
        // released; then they are released.
        for op in self.op.queue.iter_mut() {
            if let Op::Record { gang: g, .. } = op {
                *g = gang.to_string();
            }
        }
        if let Some(Op::Record { record, .. }) = self.op.queue.iter_mut().rev().nth(1) {
            record.journal = Some(released.clone());
        }
        let end = self.op.queue.pop_back();
        for p in &placement.pods {
            let uid = cached.get(&p.name).map_or(String::new(), |pod| pod.uid.clone());
            self.op.queue.push_back(Op::Release {
                gang: gang.to_string(),
                pod: p.name.clone(),
                uid,
                node: p.node.clone(),
            });
        }
        self.op.queue.extend(end);
    }

    /// One operator write. A failure drops the rest of the batch (a commit undoes its
    /// own writes first).
    fn execute(&mut self, op: Op) {
        let ok = self.try_execute(op.clone());
        if ok {
            return;
        }
        self.note(format!("failed: {}", op.describe()));
        let commit = self.op.live.clone();
        self.op.queue.clear();
        let Some(live) = commit else { return };
        match &op {
            Op::Allocate { .. } | Op::Check { .. } | Op::Hold { .. } => {
                let reason = if matches!(op, Op::Check { .. }) {
                    Reason::Conflict
                } else {
                    Reason::RolledBack
                };
                self.op.queue.push_back(Op::UndoOwn {
                    gang: live.clone(),
                    reason,
                    revision: self.op.live_revision,
                });
            }
            _ => {}
        }
        self.op.queue.push_back(Op::EndCommit { gang: live });
    }

    /// The operator writes claim `claim`: its version moves, and the operator reads its
    /// own write until its cache shows it.
    fn write_claim(&mut self, claim: &str, change: impl FnOnce(&mut ClaimObj)) {
        let rv = self.world.bump();
        let Some(c) = self.world.claims.get_mut(claim) else {
            return;
        };
        change(c);
        c.rv = rv;
        let copy = c.clone();
        self.op.own_claims.insert(claim.to_string(), copy);
    }

    /// The operator writes pod `name` (if it exists): its version moves, and the
    /// operator reads its own write until its cache shows it.
    fn write_pod(&mut self, name: &str, change: impl FnOnce(&mut PodObj)) {
        if !self.world.pods.contains_key(name) {
            return;
        }
        let rv = self.world.bump();
        let p = self.world.pods.get_mut(name).expect("pod");
        change(p);
        p.rv = rv;
        let copy = p.clone();
        self.op.own_pods.insert(name.to_string(), copy);
    }

    /// Claims a record stops naming must be unallocated (then each is fenced: its
    /// version moves, so a deposed leader's allocation prepared before cannot land), or
    /// allocated for someone the gang may leave them to: muster did not allocate it,
    /// another gang (as the operator sees them) holds it, or a pod outside the gang
    /// uses it. Pods the record stops releasing that still wait at the gate are fenced
    /// too, so that a deposed leader's release prepared before cannot land.
    fn fence(&mut self, gang: &str, expected: &Option<Journal>, next: &Option<Journal>) -> bool {
        let kept: BTreeSet<&String> = next.iter().flat_map(|j| &j.claims).collect();
        let dropped: Vec<String> = expected
            .iter()
            .flat_map(|j| j.claims.clone())
            .filter(|c| !kept.contains(c))
            .collect();
        let view = self.op.view();
        let holders = &view.holders;
        let own_pods = Self::pod_views(gang, &view);
        for claim in &dropped {
            let Some(c) = self.world.claims.get(claim) else {
                continue;
            };
            let fresh = self.claim_view(gang, claim, c, &view);
            if !ownership::may_let_go(&fresh, &own_pods, expected.as_ref()) {
                return false;
            }
        }
        // Pods the record stops releasing, as the operator sees them: each is fenced
        // against the version seen, and one changed since (released after all) makes
        // the record wait for a fresher look.
        let stops =
            expected.as_ref().is_some_and(Journal::may_release) && !next.as_ref().is_some_and(Journal::may_release);
        let dropped_extras: BTreeSet<&String> = expected
            .iter()
            .flat_map(|j| &j.pods)
            .filter(|p| p.released_at.is_some())
            .filter(|p| {
                next.as_ref()
                    .and_then(|n| n.planned(&p.name))
                    .is_none_or(|n| n.released_at.is_none())
            })
            .map(|p| &p.name)
            .collect();
        let gated: BTreeSet<String> = view
            .pods
            .values()
            .filter(|p| p.workload.as_deref() == Some(gang) && p.gated)
            .map(|p| p.uid.clone())
            .collect();
        let fenced: Vec<(String, PodObj)> = view
            .pods
            .into_iter()
            .filter(|(n, p)| {
                let planned = expected.as_ref().is_some_and(|j| j.planned(n).is_some());
                planned && p.workload.as_deref() == Some(gang) && p.gated && (stops || dropped_extras.contains(n))
            })
            .collect();
        for (name, seen) in &fenced {
            if self
                .world
                .pods
                .get(name)
                .is_some_and(|p| p.uid == seen.uid && p.rv != seen.rv)
            {
                return false;
            }
        }
        for (pod, _) in fenced {
            self.write_pod(&pod, |_| {});
        }
        for claim in &dropped {
            // A gang lets go of an allocation muster wrote only to someone who keeps
            // it: another gang, or a pod outside the gang (by what the API server
            // knows of every uid, a pod that is gone included).
            let Some(c) = self
                .world
                .claims
                .get(claim)
                .filter(|c| c.ours && c.allocation.is_some())
            else {
                continue;
            };
            let elsewhere = holders.get(claim).is_some_and(|h| h.iter().any(|g| g != gang))
                || self.world.holders(claim).iter().any(|g| *g != gang);
            let outside = c.reserved_for.iter().any(|u| {
                self.world
                    .uid_owners
                    .get(u)
                    .is_none_or(|(_, w)| w.as_deref() != Some(gang))
            });
            if !elsewhere && !outside {
                let reserved = c.reserved_for.clone();
                self.violated(format!(
                    "{gang} lets go of {claim}, which muster allocated, while only its own pods reserve it \
                     ({reserved:?}): it stays allocated for no one"
                ));
            }
        }
        // A claim another allocator made that the gang lets go of no longer lists the
        // gang's pods still behind the gate (its hold or a release listed them): nothing
        // else would take them out while the pods exist. Its last holder (as the operator
        // sees the gangs) deallocates a protected one left with no entry, as
        // kube-controller-manager does when it takes the last pod out.
        for claim in &dropped {
            let Some(c) = self
                .world
                .claims
                .get(claim)
                .filter(|c| !c.ours && c.allocation.is_some())
            else {
                continue;
            };
            let last_holder = !holders.get(claim).is_some_and(|h| h.iter().any(|g| g != gang));
            let listed_gated = c.reserved_for.iter().any(|u| gated.contains(u));
            let left_empty = c.reserved_for.iter().all(|u| gated.contains(u));
            if !(listed_gated || last_holder && c.protected && left_empty) {
                continue;
            }
            self.stats.listings_undone += 1;
            let claim_name = claim.clone();
            let mut emptied = false;
            self.write_claim(claim, |c| {
                c.reserved_for.retain(|u| !gated.contains(u));
                if c.reserved_for.is_empty() && c.protected && last_holder {
                    deallocate(c);
                    c.protected = false;
                    emptied = true;
                }
            });
            if emptied {
                self.note(format!(
                    "{gang} takes its last gated pod out of {claim_name}, deallocating it"
                ));
            }
        }
        for claim in dropped {
            let allocated = self.world.claims.get(&claim).is_some_and(|c| c.allocation.is_some());
            if allocated {
                self.stats.let_go += 1;
            }
            if !allocated {
                self.write_claim(&claim, |_| {});
            }
        }
        true
    }

    fn try_execute(&mut self, op: Op) -> bool {
        let injected = !matches!(op, Op::EndCommit { .. } | Op::UndoOwn { .. }) && self.fails();
        if injected {
            return false;
        }
        match op {
            Op::Record {
                gang,
                expected,
                revision,
                record,
            } => {
                let Some(w) = self.world.workloads.get(&gang) else {
                    return false;
                };
                // Conditioned on the admission revision (and the journal) it was decided
                // on: other writers' status changes do not count, and no admission write
                // lands over one it has not seen.
                if w.journal != expected || w.revision != revision {
                    return false;
                }
                if !self.fence(&gang, &expected, &record.journal) {
                    return false;
                }
                if let Some(j) = &record.journal
                    && j.state == State::TearingDown
                    && j.cause.as_ref().is_some_and(|c| c.0 == Reason::Conflict)
                    && expected.as_ref().is_some_and(|e| e.state != State::TearingDown)
                {
                    // Allocated twice, or shown so by the claims the operator sees (a
                    // cache may lag for longer than the sightings last): never by a
                    // nomination or a plan, which are no allocations.
                    let doubled = j
                        .claims
                        .iter()
                        .any(|c| self.seen_doubled.contains(c) || self.world.claims.get(c).is_some_and(|c| c.doubled));
                    self.stats.conflict_teardowns += 1;
                    if !doubled {
                        let claims: Vec<String> = self
                            .world
                            .claims
                            .iter()
                            .filter(|(_, c)| c.allocation.is_some())
                            .map(|(n, c)| format!("{n} {:?}", c.allocation))
                            .collect();
                        self.violated(format!(
                            "{gang} is torn down for a conflict, but no device of it was allocated twice: {claims:?}"
                        ));
                    }
                }
                let before = expected.as_ref().map_or(0, |j| j.vacancies.len());
                if record.journal.as_ref().map_or(0, |j| j.vacancies.len()) > before {
                    self.stats.vacancies += 1;
                }
                let known = self.world.workloads[&gang].refusals.clone();
                if let Some(refusals) = &record.refusals {
                    // Each refusal it remembers anew, kube-scheduler made: a pod that
                    // merely waits is never taken for one.
                    for r in refusals.iter().filter(|r| !known.contains(r)) {
                        if !self.refused.contains(&(r.pod.clone(), r.node.clone())) {
                            self.violated(format!(
                                "{gang} remembers a refusal of {} on {} that kube-scheduler never made",
                                r.pod, r.node
                            ));
                        }
                    }
                    if record.journal.as_ref().is_some_and(|j| j.state == State::TearingDown) {
                        self.stats.refusal_teardowns += 1;
                    }
                }
                // A plan (by a live leader) keeps each pod off the nodes its group was
                // refused on lately.
                if let Some(j) = record.journal.as_ref().filter(|_| !self.deposed_writing) {
                    let fresh: Vec<&muster_admission::PlannedPod> = j
                        .pods
                        .iter()
                        .filter(|p| expected.as_ref().is_none_or(|e| e.planned(&p.name).is_none()))
                        .collect();
                    let now = self.world.now;
                    if let Some(p) = fresh
                        .iter()
                        .find(|p| known.iter().any(|r| r.node == p.node && r.active(now)))
                    {
                        self.violated(format!(
                            "{gang} plans {} onto {}, where kube-scheduler refused its group lately",
                            p.name, p.node
                        ));
                    }
                }
                match &record.journal {
                    // As the operator does: a gang queued again, or released, assumes
                    // nothing any more (the cache shows what it holds).
                    None => {
                        self.op.assumed.remove(&gang);
                    }
                    Some(j) if j.state == State::Released && self.op.live.as_deref() != Some(gang.as_str()) => {
                        self.op.assumed.remove(&gang);
                    }
                    _ => {}
                }
                let rv = self.world.bump();
                let now = self.world.now;
                let w = self.world.workloads.get_mut(&gang).expect("workload");
                w.journal = record.journal.clone();
                // The record of a whole, checked reservation (or of any state past it)
                // ends the nomination, in the same write.
                if record.journal.as_ref().is_some_and(|j| j.state != State::Reserving) {
                    w.nomination = None;
                }
                if let Some(r) = record.restarts {
                    w.restarts = r.total;
                    w.counted_restarts = r.counted;
                }
                if let Some(refusals) = &record.refusals {
                    w.refusals = refusals.clone();
                }
                if record
                    .conditions
                    .iter()
                    .any(|c| matches!(c.type_, ConditionType::Succeeded | ConditionType::Failed) && c.status)
                {
                    w.finished_at = Some(now);
                }
                w.rv = rv;
                w.revision += 1;
                let copy = w.clone();
                self.note(format!("record {gang}: {:?}", record.journal.as_ref().map(|j| j.state)));
                self.op.own_workloads.insert(gang, copy);
                true
            }
            Op::Delete {
                name,
                uid,
                rv,
                immediately,
            } => {
                // Only the pod as seen when the deletion was decided; one changed since
                // is looked at again.
                if self.world.pods.get(&name).is_none_or(|p| p.uid != uid || p.rv != rv) {
                    return true;
                }
                // muster never deletes a pod of a Job it runs, which would count against the
                // Job's backoffLimit: it suspends the Job instead. Only a pod whose node is
                // gone, a pod of a Job that muster suspended and whose controller did not
                // take it away in time, and one of a Job that ended may go.
                let pod = self.world.pods[&name].clone();
                if let Some(gang) = pod.workload.as_deref()
                    && let Some(w) = self.world.workloads.get(gang)
                    && let Some(job) = &w.job
                    && pod.attempt.is_none()
                {
                    let node_gone = pod
                        .node
                        .as_deref()
                        .is_some_and(|n| !self.world.nodes.get(n).copied().unwrap_or(false));
                    if job.suspended && job.marked {
                        self.stats.owner_stop_deletions += 1;
                    } else if !node_gone && w.spec.job_ended.is_none() && !pod.phase.terminal() {
                        self.violated(format!(
                            "muster deletes {name}, a pod of {gang}'s Job, which it did not suspend: the Job counts it as failed"
                        ));
                    }
                }
                self.note(format!("delete {name} immediately={immediately}"));
                if immediately {
                    self.world.pods.remove(&name);
                } else {
                    self.write_pod(&name, |p| p.deleting = true);
                }
                true
            }
            Op::Deallocate { claim, idle } => {
                let Some(c) = self.world.claims.get(&claim) else {
                    return true;
                };
                if c.allocation.is_none() {
                    return true;
                }
                if !c.reserved_for.iter().all(|u| idle.contains(u)) {
                    return true; // in use: not now
                }
                self.note(format!("deallocate {claim}"));
                self.write_claim(&claim, deallocate);
                true
            }
            Op::FencePods { pods } => {
                if pods
                    .iter()
                    .any(|(name, rv)| self.world.pods.get(name).is_some_and(|p| p.rv != *rv))
                {
                    return false;
                }
                for (name, _) in pods {
                    self.write_pod(&name, |_| {});
                }
                true
            }
            Op::Collect { claim, finished } => {
                let Some(c) = self.world.claims.get(&claim) else {
                    return true;
                };
                if !c.reserved_for.iter().all(|u| finished.contains(u)) {
                    return true;
                }
                self.note(format!("collect {claim}"));
                self.stats.collected += 1;
                self.write_claim(&claim, |c| {
                    deallocate(c);
                    c.ours = false;
                });
                true
            }
            Op::Release { gang, pod, uid, node } => {
                if self.world.pods.get(&pod).is_none_or(|p| p.uid != uid) {
                    return false;
                }
                // A gang that can never restart onto its reservation: each claim of the
                // pod muster allocated and no other gang holds lists it, then is protected
                // (writes before the release); a protected claim lists it too. One that
                // lost its allocation stops the release.
                for claim in self.world.pods[&pod].claims.clone() {
                    let held_elsewhere = self.world.workloads.iter().any(|(other, w)| {
                        other != &gang && w.journal.as_ref().is_some_and(|j| j.claims.contains(&claim))
                    });
                    let Some(c) = self.world.claims.get(&claim) else {
                        continue;
                    };
                    let to_protect = c.ours && !held_elsewhere;
                    // Every claim lists the pods, on condition it is still allocated
                    // (kube-controller-manager could otherwise deallocate one with its last
                    // pod before kube-scheduler lists this one); only one the gang is to
                    // protect is protected.
                    if c.allocation.is_none() {
                        return false;
                    }
                    // Every pod of the gang released onto it, as the operator sees them,
                    // is listed with this one before it is protected: one released
                    // earlier may not be bound (and listed by kube-scheduler) yet.
                    let mut listed: Vec<String> = self
                        .op
                        .view()
                        .pods
                        .values()
                        .filter(|p| {
                            p.workload.as_deref() == Some(gang.as_str())
                                && !p.gated
                                && !p.phase.terminal()
                                && p.claims.contains(&claim)
                        })
                        .map(|p| p.uid.clone())
                        .collect();
                    listed.push(uid.clone());
                    // Written only if something changes, as the operator's listing is.
                    if listed.iter().all(|u| c.reserved_for.contains(u)) && (c.protected || !to_protect) {
                        continue;
                    }
                    self.write_claim(&claim, |c| {
                        for uid in listed {
                            if !c.reserved_for.contains(&uid) {
                                c.reserved_for.push(uid);
                            }
                        }
                        c.protected |= to_protect;
                    });
                }
                if self.world.workloads[&gang].kueue.as_ref().is_some_and(|k| !k.admitted) {
                    self.violated(format!("{pod} is released before Kueue admitted {gang}"));
                }
                if self.world.pods[&pod].gated {
                    self.write_pod(&pod, |p| {
                        p.gated = false;
                        p.pin = Some(node);
                    });
                    self.note(format!("release {pod}"));
                }
                true
            }
            Op::Allocate {
                claim,
                devices,
                expect_rv,
                reserved,
            } => {
                let Some(c) = self.world.claims.get(&claim) else {
                    return false;
                };
                if c.rv != expect_rv || c.allocation.is_some() {
                    return false;
                }
                self.write_claim(&claim, |c| {
                    c.allocation = Some(devices);
                    c.reserved_for = reserved;
                    c.protected = false;
                    c.ours = true;
                    c.doubled = false;
                    c.checked = false;
                });
                let rv = self.world.rv;
                self.op.written.push((claim, rv));
                true
            }
            Op::Hold {
                claim,
                devices,
                expect_rv,
                listed,
            } => {
                let Some(c) = self.world.claims.get(&claim) else {
                    return false;
                };
                if c.rv != expect_rv || c.allocation.as_ref() != Some(&devices) {
                    return false;
                }
                // Held by a second gang, a claim of muster's is muster's to give back;
                // one another allocator made lists the gang's pods.
                self.note(format!("hold {claim}, listing {listed:?}"));
                self.write_claim(&claim, |c| {
                    if c.ours {
                        c.protected = false;
                    } else {
                        for uid in listed {
                            if !c.reserved_for.contains(&uid) {
                                c.reserved_for.push(uid);
                            }
                        }
                    }
                });
                true
            }
            Op::Check { planned } => {
                for (name, c) in &self.world.claims {
                    for d in c.allocation.iter().flatten() {
                        if planned.get(d).is_some_and(|mine| mine != name) {
                            return false;
                        }
                    }
                }
                for claim in planned.values() {
                    if let Some(c) = self.world.claims.get_mut(claim) {
                        c.checked = true;
                    }
                }
                true
            }
            Op::UndoOwn { gang, reason, revision } => {
                for (claim, rv) in std::mem::take(&mut self.op.written) {
                    let Some(c) = self.world.claims.get(&claim) else {
                        continue;
                    };
                    if c.rv != rv {
                        continue;
                    }
                    self.write_claim(&claim, deallocate);
                }
                // Still Reserving, now with the cause: the state machine finishes the undo.
                let base = gang.trim_end_matches("+extras").to_string();
                if let Some(w) = self.world.workloads.get(&base).cloned()
                    && let Some(j) = w.journal.as_ref().filter(|j| j.state == State::Reserving)
                {
                    let failed = commit::failed(j, reason, "undone".into());
                    self.op.queue.push_front(Op::Record {
                        gang: base,
                        expected: Some(j.clone()),
                        revision,
                        record: Record {
                            journal: Some(failed),
                            conditions: vec![],
                            restarts: None,
                            refusals: None,
                        },
                    });
                }
                true
            }
            Op::DeleteWorkload { gang } => {
                self.world.workloads.remove(&gang);
                true
            }
            Op::EndCommit { gang } => {
                if self.op.live.as_deref() == Some(gang.as_str()) {
                    self.op.live = None;
                }
                // An extras commit's assumption ends with it; a gang's once it is
                // released (or was never recorded).
                let base = gang.trim_end_matches("+extras");
                let world = &self.world;
                let released_any = |j: &Journal| {
                    j.cause.is_none()
                        && j.pods
                            .iter()
                            .any(|p| world.pods.get(&p.name).is_some_and(|pod| !pod.gated))
                };
                let done = gang.ends_with("+extras")
                    || world.workloads.get(base).is_none_or(|w| {
                        w.journal
                            .as_ref()
                            .is_none_or(|j| j.state == State::Reserving && !released_any(j))
                    });
                if done {
                    self.op.assumed.remove(&gang);
                }
                true
            }
            Op::Nominate { gang, nomination } => {
                let Some(w) = self.world.workloads.get_mut(&gang) else {
                    return false;
                };
                if w.journal.is_some() || w.nomination.is_some() {
                    return false;
                }
                w.nomination = Some(nomination.clone());
                let rv = self.world.bump();
                let w = self.world.workloads.get_mut(&gang).expect("workload");
                w.rv = rv;
                w.revision += 1;
                let copy = w.clone();
                self.op.own_workloads.insert(gang.clone(), copy);
                self.op.nominated.insert(gang, nomination.devices);
                self.stats.nominations += 1;
                true
            }
            Op::Evict {
                victim,
                expected,
                preemptor,
            } => {
                let Some(v) = self.world.workloads.get(&victim) else {
                    return false;
                };
                if v.journal.as_ref() != Some(&expected) {
                    return false;
                }
                let priority = v.priority;
                let named = self.world.workloads.get(&preemptor).is_some_and(|p| {
                    p.priority > priority && p.nomination.as_ref().is_some_and(|n| n.victims.contains(&victim))
                });
                // A deposed leader's eviction was decided under a nomination its successor
                // may have dropped since (the victim's version, its only precondition, did
                // not move): the victim is queued again for nothing, and loses nothing.
                if !named && self.deposed_writing {
                    self.stats.deposed_evictions += 1;
                } else if !named {
                    self.violated(format!(
                        "{victim} is evicted without a nomination of higher priority naming it"
                    ));
                }
                let mut tearing = expected.moved(State::TearingDown, self.world.now);
                tearing.cause = Some((Reason::Preempted, format!("preempted by {preemptor}")));
                let next = Some(tearing);
                if !self.fence(&victim, &Some(expected), &next) {
                    return false;
                }
                let rv = self.world.bump();
                let v = self.world.workloads.get_mut(&victim).expect("workload");
                v.journal = next;
                v.rv = rv;
                v.revision += 1;
                let copy = v.clone();
                self.note(format!("{preemptor} evicts {victim}"));
                self.stats.evictions += 1;
                self.op.own_workloads.insert(victim, copy);
                true
            }
            Op::DropNomination { gang } => {
                let Some(w) = self.world.workloads.get_mut(&gang) else {
                    return true;
                };
                w.nomination = None;
                let rv = self.world.bump();
                let w = self.world.workloads.get_mut(&gang).expect("workload");
                w.rv = rv;
                w.revision += 1;
                let copy = w.clone();
                self.op.own_workloads.insert(gang.clone(), copy);
                self.op.nominated.remove(&gang);
                self.note(format!("{gang}'s nomination dropped"));
                true
            }
            Op::KueueReady { gang } => {
                let Some(w) = self.world.workloads.get(&gang) else {
                    return true;
                };
                // The claims another allocator made are read afresh first: one
                // kube-controller-manager deallocated behind the caches (the gang's pods it
                // listed went) holds the answer back, and the next look sees it.
                let lost_found = holding(&w.journal).is_some_and(|j| {
                    j.claims.iter().any(|c| {
                        self.world
                            .claims
                            .get(c)
                            .is_none_or(|c| !c.ours && c.allocation.is_none())
                    })
                });
                if lost_found {
                    self.note(format!(
                        "{gang}'s answer to Kueue waits: a claim it found lost its allocation"
                    ));
                    return true;
                }
                let holds_all = |journal: &Option<Journal>, claims: &BTreeMap<String, ClaimObj>| {
                    journal.as_ref().is_some_and(|j| {
                        matches!(j.state, State::Reserved | State::Released)
                            && j.claims
                                .iter()
                                .all(|c| claims.get(c).is_some_and(|c| c.allocation.is_some()))
                    })
                };
                // Kueue's object takes no precondition on the gang's: only a deposed
                // leader's record, which the operator cannot know of, may make it wrong.
                if !self.deposed_wrote && !holds_all(&w.journal, &self.world.claims) {
                    self.violated(format!("Kueue hears that {gang} is reserved while it is not"));
                }
                if let Some(k) = self.world.workloads.get_mut(&gang).and_then(|w| w.kueue.as_mut()) {
                    k.ready = true;
                }
                true
            }
            Op::KueueRequeue { gang } => {
                let Some(w) = self.world.workloads.get_mut(&gang) else {
                    return true;
                };
                if w.journal.is_some() {
                    return false;
                }
                if let Some(k) = w.kueue.as_mut() {
                    *k = Kueue::default();
                    self.stats.kueue_readmissions += 1;
                }
                true
            }
            Op::SuspendOwner { gang } => {
                let rv = self.world.bump();
                let Some(w) = self.world.workloads.get_mut(&gang) else {
                    return true;
                };
                let Some(job) = w.job.as_mut() else { return true };
                if job.suspended && job.marked {
                    return true;
                }
                job.suspended = true;
                job.marked = true;
                job.rv = rv;
                w.rv = rv;
                let copy = w.clone();
                self.stats.job_suspends += 1;
                self.note(format!("suspend {gang}'s Job"));
                self.op.own_workloads.insert(gang, copy);
                true
            }
            Op::ResumeOwner { gang, rv: seen } => {
                let rv = self.world.bump();
                let Some(w) = self.world.workloads.get_mut(&gang) else {
                    return true;
                };
                let Some(job) = w.job.as_mut() else { return true };
                // Against the version the cache showed: a mark changed since is read again.
                if job.rv != seen {
                    return false;
                }
                job.suspended = false;
                job.marked = false;
                job.rv = rv;
                w.rv = rv;
                let copy = w.clone();
                self.stats.job_resumes += 1;
                self.note(format!("resume {gang}'s Job"));
                self.op.own_workloads.insert(gang, copy);
                true
            }
        }
    }

    // ---- invariants ----

    fn check_always(&self) -> Result<(), String> {
        if let Some(v) = &self.violation {
            return Err(v.clone());
        }
        // A commit may write a device someone took meanwhile: its conflict check (or a
        // restarted operator) undoes that before any pod is released. So a device may be
        // in two allocations only while one is an unchecked reservation (or muster's
        // allocation that never passed its check, left as it is to a pod outside muster
        // that joined it meanwhile, until that pod ends), or one is an intruder's that
        // came after the check (the gang then gives way).
        let unchecked = |claim: &str| {
            self.world.workloads.values().any(|w| {
                w.journal.as_ref().is_some_and(|j| {
                    (j.state == State::Reserving && j.claims.iter().any(|c| c == claim))
                        || j.pods
                            .iter()
                            .any(|p| p.extra && p.released_at.is_none() && p.claims.iter().any(|c| c == claim))
                })
            })
        };
        let late = |claim: &str| {
            self.world
                .claims
                .get(claim)
                .is_some_and(|c| c.late || (c.ours && !c.checked))
        };
        let mut holder: BTreeMap<Dev, &str> = BTreeMap::new();
        for (name, c) in &self.world.claims {
            for d in c.allocation.iter().flatten() {
                if let Some(other) = holder.insert(*d, name)
                    && !unchecked(other)
                    && !unchecked(name)
                    && !late(other)
                    && !late(name)
                {
                    return Err(format!("device {d} is allocated to {other} and {name}"));
                }
            }
        }
        for (name, pod) in &self.world.pods {
            if pod.phase.terminal() {
                continue;
            }
            // No pod of a gang is released while a claim of it is not allocated (one
            // being deleted before it was bound never will be).
            if pod.workload.is_some() && !pod.gated && !(pod.deleting && pod.node.is_none()) {
                for claim in &pod.claims {
                    if self.world.claims.get(claim).is_none_or(|c| c.allocation.is_none()) {
                        return Err(format!(
                            "pod {name} is released, but its claim {claim} is not allocated"
                        ));
                    }
                }
            }
            if pod.node.is_none() {
                continue;
            }
            for d in &pod.using {
                let still = pod.claims.iter().any(|c| {
                    self.world
                        .claims
                        .get(c)
                        .is_some_and(|c| c.allocation.iter().flatten().any(|x| x == d))
                });
                if !still {
                    return Err(format!(
                        "pod {name} may still run on device {d}, but its claim gave the device back"
                    ));
                }
            }
        }
        Ok(())
    }

    /// At rest: every gang runs, finished, is suspended or waits in the queue without
    /// fitting; a gang holds what muster allocated only while a journal names it, and
    /// what muster allocated that no journal names is used by a pod; no nomination is
    /// left and no device is allocated twice.
    fn at_rest(&self) -> Result<(), String> {
        let allocated = self.world.allocated();
        let mut seen = BTreeSet::new();
        for (name, c) in &self.world.claims {
            for d in c.allocation.iter().flatten() {
                if !seen.insert(*d) {
                    return Err(format!("device {d} is allocated twice at rest ({name})"));
                }
            }
            let live: Vec<&String> = c
                .reserved_for
                .iter()
                .filter(|u| self.world.pods.values().any(|p| &p.uid == *u && !p.phase.terminal()))
                .collect();
            if c.ours && c.allocation.is_some() && self.world.holders(name).is_empty() && live.is_empty() {
                return Err(format!(
                    "claim {name} is allocated by muster, held by no gang and used by no pod"
                ));
            }
        }
        let nominations = self.world.workloads.values().any(|w| w.nomination.is_some());
        if nominations {
            return Err("a nomination is left".into());
        }
        for (gang, w) in &self.world.workloads {
            let own: Vec<String> = match &w.job {
                None => (0..w.replicas).map(|i| pod_claim(&pod_name(gang, i))).collect(),
                Some(_) => self
                    .world
                    .claims
                    .iter()
                    .filter(|(n, c)| c.label.as_deref() == Some(gang.as_str()) && !SHARED.contains(&n.as_str()))
                    .map(|(n, _)| n.clone())
                    .collect(),
            };
            // A Job muster suspended to requeue its gang is resumed: its pods come back.
            if w.job.as_ref().is_some_and(|j| j.marked && j.suspended)
                && !w.spec.suspend
                && w.finished_at.is_none()
                && w.spec.job_ended.is_none()
            {
                return Err(format!("{gang}'s Job is left suspended by muster"));
            }
            // No gang keeps a vacated place past its bound.
            if let Some(j) = &w.journal
                && let Some(v) = j
                    .vacancies
                    .iter()
                    .find(|v| self.world.now - v.since > SETTINGS.schedule_timeout + 5_000)
            {
                return Err(format!(
                    "{gang} holds the place of {} vacated at {} past its bound (now {})",
                    v.pod, v.since, self.world.now
                ));
            }
            let held: Vec<&String> = own
                .iter()
                .filter(|c| self.world.claims.get(*c).is_some_and(|c| c.allocation.is_some()))
                .collect();
            match &w.journal {
                None => {
                    if !held.is_empty() {
                        return Err(format!("queued gang {gang} holds {held:?}"));
                    }
                    // Waiting is right only while its minimum does not fit (off the nodes
                    // it was refused on lately).
                    let now = self.world.now;
                    let free = self
                        .world
                        .devices()
                        .into_iter()
                        .filter(|d| !allocated.contains(d))
                        .filter(|d| !w.refusals.iter().any(|r| r.active(now) && r.node == node_of(*d)))
                        .count();
                    let shared_free = w
                        .shared
                        .as_ref()
                        .is_some_and(|c| self.world.claims.get(c).is_some_and(|c| c.allocation.is_none()));
                    let needed = w.spec.groups[0].min_count as usize + usize::from(shared_free);
                    if !w.spec.suspend && w.finished_at.is_none() && free >= needed {
                        let pods: Vec<String> = self
                            .world
                            .pods
                            .iter()
                            .filter(|(_, p)| p.workload.as_deref() == Some(gang.as_str()))
                            .map(|(n, p)| {
                                format!("{n} attempt={:?} gated={} deleting={}", p.attempt, p.gated, p.deleting)
                            })
                            .collect();
                        return Err(format!(
                            "queued gang {gang} would fit ({free} devices free) but is not admitted; restarts {}, \
                             replicas {}, pods {pods:?}, kueue {:?}",
                            w.restarts, w.replicas, w.kueue
                        ));
                    }
                }
                Some(j) => {
                    match j.state {
                        State::Released if !w.spec.suspend => {
                            for p in j.core() {
                                let running = self
                                    .world
                                    .pods
                                    .get(&p.name)
                                    .is_some_and(|pod| pod.node.is_some() && !pod.gated);
                                if !running {
                                    return Err(format!("released gang {gang}: pod {} does not run", p.name));
                                }
                            }
                        }
                        State::Finished => {
                            if !held.is_empty() {
                                return Err(format!("finished gang {gang} holds {held:?}"));
                            }
                        }
                        state => return Err(format!("gang {gang} is stuck in {state:?}: {j:?}")),
                    }
                    for c in held {
                        if !j.claims.contains(c) {
                            return Err(format!("gang {gang} holds {c}, which its journal does not name"));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn step(&mut self) {
        if self.stale.is_some() && self.rng.chance(10) {
            self.stale_writes();
        } else if self.rng.chance(45) {
            self.operator();
        } else {
            self.environment();
        }
        self.mark_doubles();
    }

    /// The deposed leader's next write lands; after its last one it exits.
    fn stale_writes(&mut self) {
        let Some((mut stale, left, then)) = self.stale.take() else {
            return;
        };
        let Some(op) = stale.queue.pop_front() else { return };
        // Deallocations, the collector's and releases read the object before the
        // Lease check and write against that read; deletions are conditional on the
        // version decided on; allocations and records carry their own preconditions.
        let read_before = match &op {
            Op::Deallocate { claim, .. } | Op::Collect { claim, .. } => {
                then.claims.get(claim).map(|c| c.rv) == self.world.claims.get(claim).map(|c| c.rv)
            }
            Op::Release { pod, .. } => then.pods.get(pod).map(|p| p.rv) == self.world.pods.get(pod).map(|p| p.rv),
            // The suspend reads the Job just before its Lease check, and writes against
            // that version.
            Op::SuspendOwner { gang } => {
                let rv = |world: &World| world.workloads.get(gang).and_then(|w| w.job.as_ref()).map(|j| j.rv);
                rv(&then) == rv(&self.world)
            }
            _ => true,
        };
        if read_before {
            self.note(format!("deposed leader writes: {}", op.describe()));
            self.deposed_wrote = true;
            self.stats.deposed_writes += 1;
            std::mem::swap(&mut self.op, &mut stale);
            self.deposed_writing = true;
            self.execute(op);
            self.deposed_writing = false;
            std::mem::swap(&mut self.op, &mut stale);
        } else {
            self.note(format!(
                "deposed leader's write fails its precondition: {}",
                op.describe()
            ));
        }
        if left > 1 && !stale.queue.is_empty() {
            self.stale = Some((stale, left - 1, then));
        }
    }
}

fn run(seed: u64) -> Result<(usize, usize, Stats), String> {
    let mut sim = Sim::new(seed);
    sim.fail_rate = sim.rng.below(15);
    let chaos_steps = 150 + sim.rng.below(250) as usize;
    let fail = |sim: &Sim, e: String| {
        let tail = sim
            .log
            .iter()
            .rev()
            .take(
                std::env::var("MUSTER_MODEL_LOG")
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(40),
            )
            .rev()
            .cloned()
            .collect::<Vec<_>>()
            .join("\n");
        format!("seed {seed}: {e}\n{tail}")
    };
    for _ in 0..chaos_steps {
        sim.step();
        sim.check_always().map_err(|e| fail(&sim, e))?;
    }
    // Calm: no more faults, failures, suspend toggles, evictions or intruders;
    // everything that ran out of time may do so now.
    sim.chaos = false;
    sim.fail_rate = 0;
    while sim.stale.is_some() {
        sim.stale_writes();
        sim.check_always().map_err(|e| fail(&sim, e))?;
    }
    for w in sim.world.workloads.values_mut() {
        w.spec.suspend = false;
    }
    for p in sim.world.intruders() {
        sim.world.pods.remove(&p);
    }
    sim.world.claims.retain(|name, _| !name.starts_with("intruder-"));
    for up in sim.world.nodes.values_mut() {
        *up = true;
    }
    sim.world.refusing.clear();
    // How long each gang has been in its state since the chaos ended.
    let mut since: BTreeMap<String, (Option<State>, usize)> = BTreeMap::new();
    let mut calm = 0;
    let mut rested = false;
    while calm < CALM_STEPS {
        sim.step();
        calm += 1;
        sim.check_always().map_err(|e| fail(&sim, e))?;
        for (gang, w) in &sim.world.workloads {
            let state = w.journal.as_ref().map(|j| j.state);
            let entry = since.entry(gang.clone()).or_insert((state, calm));
            if entry.0 != state {
                *entry = (state, calm);
            }
            let transitional = state.is_some_and(|s| !matches!(s, State::Released | State::Finished));
            if transitional && calm - entry.1 > TRANSITION_BOUND {
                return Err(fail(
                    &sim,
                    format!(
                        "gang {gang} stayed {:?} for {} steps after the chaos ended",
                        state,
                        calm - entry.1
                    ),
                ));
            }
        }
        if calm % 200 == 0 && sim.op.queue.is_empty() && sim.at_rest().is_ok() {
            rested = true;
            break;
        }
    }
    if !rested {
        return Err(fail(
            &sim,
            sim.at_rest().err().unwrap_or_else(|| "never at rest".into()),
        ));
    }
    Ok((chaos_steps, calm, sim.stats))
}

#[test]
fn every_schedule_keeps_the_invariants_and_comes_to_rest() {
    if let Some(seed) = std::env::var("MUSTER_MODEL_SEED").ok().and_then(|s| s.parse().ok()) {
        if let Err(e) = run(seed) {
            panic!("{e}");
        }
        return;
    }
    let schedules: u64 = std::env::var("MUSTER_MODEL_SCHEDULES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    // On demand, a long run goes on past a violation, prints each, and fails at the end.
    let keep_going = std::env::var_os("MUSTER_MODEL_KEEP_GOING").is_some();
    // A long run may be split across processes, each from its own first seed.
    let first: u64 = std::env::var("MUSTER_MODEL_FIRST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let started = std::time::Instant::now();
    let mut steps = 0;
    let mut stats = Stats::default();
    let mut violations: Vec<u64> = Vec::new();
    for seed in first..first + schedules {
        match run(seed) {
            Ok((chaos, calm, seen)) => {
                steps += chaos + calm;
                stats += seen;
            }
            Err(e) if keep_going => {
                println!("model: violation: {}", e.lines().next().unwrap_or_default());
                violations.push(seed);
            }
            Err(e) => panic!("{e}"),
        }
        if keep_going && (seed + 1 - first).is_multiple_of(100_000) {
            println!(
                "model: {} schedules, {} violations, {:.0}s",
                seed + 1 - first,
                violations.len(),
                started.elapsed().as_secs_f64()
            );
        }
    }
    println!(
        "model: {schedules} schedules, {steps} steps, {} violations, in {:.1}s\nmodel: {stats:?}",
        violations.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(violations.is_empty(), "violations at seeds {violations:?}");
    assert!(
        schedules < 1000 || stats.controller_deallocations > 0,
        "the schedules reach kube-controller-manager's deallocation of protected claims: {stats:?}"
    );
    assert!(
        schedules < 1000 || stats.commits_finished_after_a_partial_release > 0,
        "the schedules reach a commit stopped in the middle of its release: {stats:?}"
    );
    assert!(
        schedules < 1000 || (stats.job_suspends > 0 && stats.job_resumes > 0 && stats.vacancies > 0),
        "the schedules reach a Job's gang requeued by its suspend, and a vacated place: {stats:?}"
    );
}

/// Schedules that found a defect beyond the first 10,000 (in runs of 1,000,000), each
/// replayed on every run: a pod released onto a claim of muster's that
/// kube-controller-manager deallocated behind the caches (488537), a nomination
/// outliving a gang suspended after its release (13903), a deposed leader's record over
/// its successor's (49514), a nomination no longer held while its drop had not landed
/// (128397), protection listing only the pods released now (141848), and a pod released
/// onto a claim another allocator made, which kube-controller-manager deallocated with
/// the last pod outside the gang before kube-scheduler listed the gang's (304452,
/// 492994).
#[test]
fn schedules_that_found_defects_stay_clean() {
    for seed in [13_903, 49_514, 128_397, 141_848, 304_452, 488_537, 492_994] {
        if let Err(e) = run(seed) {
            panic!("{e}");
        }
    }
}

/// A gang's failure policy rules, drawn at random: none, a lost pod restarting without
/// counting, a failed pod failing the gang at once.
fn failure_rules(rng: &mut Rng) -> Vec<failure::FailureRule> {
    let rule = |action, kinds| failure::FailureRule {
        name: None,
        action,
        exit_codes: None,
        conditions: vec![],
        kinds,
        groups: vec![],
    };
    let mut rules = Vec::new();
    if rng.chance(30) {
        rules.push(rule(
            failure::FailureAction::RestartUncounted,
            vec![failure::FailureKind::PodLost, failure::FailureKind::NodeLost],
        ));
    }
    if rng.chance(15) {
        rules.push(rule(
            failure::FailureAction::FailGang,
            vec![failure::FailureKind::PodFailed],
        ));
    }
    rules
}
