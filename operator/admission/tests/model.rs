//! A model test of the state machine: an in-memory API server with resource versions,
//! caches that lag behind it (each kind on its own), an operator that runs the core's
//! decisions and commits one write at a time, and a cluster around it: a controller
//! that makes gated pods, a scheduler and kubelet, kube-controller-manager's cleanup
//! of `reservedFor`, users who suspend, resume and delete pods, nodes that vanish, and
//! intruders that take free devices or join a gang's shared claim. Writes fail at
//! random and the operator crashes at random, between any two writes.
//!
//! After every step: no device is allocated twice, and no pod that may still run has
//! lost a device it was started with. After the chaos, a calm phase must bring every
//! gang to rest (running, finished, suspended or queued without holding anything)
//! within a bounded number of steps: no wedge, no leak.
//!
//! `MUSTER_MODEL_SCHEDULES` sets the number of schedules (default 10,000);
//! `MUSTER_MODEL_SEED` replays one.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use muster_admission::commit::{self, Placement};
use muster_admission::{
    ClaimView, ConditionType, Effect, Gang, GroupSpec, Journal, NodeHealth, Phase, PlannedPod, PodView, Reason, Record,
    Settings, Spec, State, decide,
};

type Dev = u32;
const DEVICES_PER_NODE: u32 = 3;
const NODES: usize = 3;

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
    gated: bool,
    pin: Option<String>,
    phase: Phase,
    node: Option<String>,
    deleting: bool,
    claims: Vec<String>,
    /// Devices its containers were started with.
    using: Vec<Dev>,
    rv: u64,
}

#[derive(Clone, Debug)]
struct ClaimObj {
    workload: Option<String>,
    allocation: Option<Vec<Dev>>,
    reserved_for: Vec<String>,
    rv: u64,
}

#[derive(Clone, Debug)]
struct WorkloadObj {
    spec: Spec,
    replicas: i32,
    shared: bool,
    journal: Option<Journal>,
    restarts: i32,
    finished_at: Option<i64>,
    rv: u64,
}

#[derive(Clone, Debug, Default)]
struct World {
    nodes: BTreeMap<String, bool>,
    pods: BTreeMap<String, PodObj>,
    claims: BTreeMap<String, ClaimObj>,
    workloads: BTreeMap<String, WorkloadObj>,
    rv: u64,
    uids: u64,
    now: i64,
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

fn shared_claim(gang: &str) -> String {
    format!("{gang}-shared")
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
}

/// What the operator does next: one API write (or read) at a time.
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
enum Op {
    Record {
        gang: String,
        expected: Option<Journal>,
        record: Record,
    },
    Delete {
        name: String,
        uid: String,
        immediately: bool,
    },
    Deallocate {
        claim: String,
        finished: Vec<String>,
    },
    Release {
        pod: String,
        uid: String,
        node: String,
    },
    Allocate {
        gang: String,
        claim: String,
        devices: Vec<Dev>,
        expect_rv: u64,
    },
    Check {
        planned: BTreeMap<Dev, String>,
    },
    DeleteWorkload {
        gang: String,
    },
    /// The commit's undo of its own writes, each conditional on the version it wrote.
    UndoOwn {
        gang: String,
        reason: Reason,
    },
    EndCommit {
        gang: String,
    },
}

#[derive(Default)]
struct Operator {
    cache: World,
    own_workloads: BTreeMap<String, WorkloadObj>,
    own_claims: BTreeMap<String, ClaimObj>,
    own_pods: BTreeMap<String, PodObj>,
    queue: VecDeque<Op>,
    live: Option<String>,
    /// Claims the live commit allocated, with the version each write returned.
    written: Vec<(String, u64)>,
    assumed: BTreeMap<String, Vec<Dev>>,
    cursor: usize,
}

impl Operator {
    fn restart(&mut self, world: &World) {
        *self = Operator {
            cache: world.clone(),
            ..Operator::default()
        };
    }

    fn workload(&self, name: &str) -> Option<WorkloadObj> {
        let cached = self.cache.workloads.get(name)?;
        match self.own_workloads.get(name) {
            Some(own) if own.rv > cached.rv => Some(own.clone()),
            _ => Some(cached.clone()),
        }
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
}

const SETTINGS: Settings = Settings {
    schedule_timeout: 20_000,
    release_timeout: 20_000,
};

struct Sim {
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
    log: Vec<String>,
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut rng = Rng(seed);
        let mut world = World::default();
        for n in 0..NODES {
            world.nodes.insert(format!("n{n}"), true);
        }
        let gangs = 1 + rng.below(2) as usize;
        for g in 0..gangs {
            let name = format!("g{g}");
            let replicas = 1 + rng.below(3) as i32;
            let min_count = 1 + rng.below(replicas as u64) as i32;
            let shared = rng.chance(40);
            let spec = Spec {
                suspend: false,
                groups: vec![GroupSpec {
                    name: "w".into(),
                    min_count,
                    managed: true,
                }],
                success_groups: vec![],
                max_restarts: rng.below(3) as i32,
                ttl_seconds_after_finished: None,
            };
            let rv = world.bump();
            world.workloads.insert(
                name.clone(),
                WorkloadObj {
                    spec,
                    replicas,
                    shared,
                    journal: None,
                    restarts: 0,
                    finished_at: None,
                    rv,
                },
            );
            let mut claims: Vec<String> = (0..replicas).map(|i| pod_claim(&pod_name(&name, i))).collect();
            if shared {
                claims.push(shared_claim(&name));
            }
            for claim in claims {
                let rv = world.bump();
                world.claims.insert(
                    claim,
                    ClaimObj {
                        workload: Some(name.clone()),
                        allocation: None,
                        reserved_for: vec![],
                        rv,
                    },
                );
            }
        }
        let mut op = Operator::default();
        op.restart(&world);
        Sim {
            world,
            controller_sees: BTreeMap::new(),
            op,
            stale: None,
            rng,
            fail_rate: 0,
            chaos: true,
            log: Vec::new(),
        }
    }

    fn note(&mut self, what: String) {
        if self.log.len() > 4000 {
            self.log.remove(0);
        }
        self.log.push(format!("t={} {what}", self.world.now));
    }

    fn fails(&mut self) -> bool {
        self.fail_rate > 0 && self.rng.chance(self.fail_rate)
    }

    // ---- the cluster around the operator ----

    /// The Workload controller: the current attempt's pods exist, gated; a suspended or
    /// finished gang gets none, and its gated pods go.
    fn controller(&mut self) {
        let names: Vec<String> = self.world.workloads.keys().cloned().collect();
        for gang in names {
            let w = self.world.workloads[&gang].clone();
            if !self.chaos || self.rng.chance(50) {
                self.controller_sees.insert(gang.clone(), w.restarts);
            }
            let attempt = self.controller_sees.get(&gang).copied().unwrap_or(0);
            let finished = w.finished_at.is_some();
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
            for i in 0..w.replicas {
                let name = pod_name(&gang, i);
                if self.world.pods.contains_key(&name) {
                    continue;
                }
                self.world.uids += 1;
                let uid = format!("u{}", self.world.uids);
                let mut claims = vec![pod_claim(&name)];
                if w.shared {
                    claims.push(shared_claim(&gang));
                }
                let rv = self.world.bump();
                self.world.pods.insert(
                    name,
                    PodObj {
                        uid,
                        workload: Some(gang.clone()),
                        group: "w".into(),
                        attempt: Some(attempt),
                        gated: true,
                        pin: None,
                        phase: Phase::Pending,
                        node: None,
                        deleting: false,
                        claims,
                        using: vec![],
                        rv,
                    },
                );
            }
        }
    }

    /// kube-scheduler binds a released pod to its pinned node, allocating a claim that
    /// has no allocation itself (from devices no claim holds); the kubelet starts it
    /// with the devices of its claims.
    fn schedule(&mut self, name: &str) {
        let Some(pod) = self.world.pods.get(name).cloned() else {
            return;
        };
        if pod.gated || pod.node.is_some() || pod.deleting {
            return;
        }
        let Some(node) = pod.pin.clone() else { return };
        if !self.world.nodes.get(&node).copied().unwrap_or(false) {
            return;
        }
        if self.chaos && self.rng.chance(20) {
            return; // not now: some other pod took the CPU
        }
        let mut using = Vec::new();
        for claim in &pod.claims {
            let taken = self.world.allocated();
            let Some(c) = self.world.claims.get(claim) else { return };
            let devices = match &c.allocation {
                Some(d) => d.clone(),
                None => {
                    let free: Vec<Dev> = self
                        .world
                        .devices()
                        .into_iter()
                        .filter(|d| !taken.contains(d) && node_of(*d) == node)
                        .collect();
                    let Some(d) = free.first() else { return };
                    vec![*d]
                }
            };
            using.extend(devices.iter().copied());
            let rv = self.world.bump();
            let c = self.world.claims.get_mut(claim).expect("claim");
            c.allocation = Some(devices);
            if !c.reserved_for.contains(&pod.uid) {
                c.reserved_for.push(pod.uid.clone());
            }
            c.rv = rv;
        }
        let rv = self.world.bump();
        let p = self.world.pods.get_mut(name).expect("pod");
        p.node = Some(node);
        p.using = using;
        p.phase = Phase::Running;
        p.rv = rv;
    }

    /// kube-controller-manager: pods that are gone or done leave `reservedFor`.
    fn kcm(&mut self) {
        let live: BTreeSet<String> = self
            .world
            .pods
            .values()
            .filter(|p| !p.phase.terminal())
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
            0..=14 => self.controller(),
            15..=34 => {
                if let Some(p) = pick(&mut self.rng, &pods) {
                    self.schedule(&p);
                }
            }
            35..=44 => self.kcm(),
            45..=54 => {
                // A pod being deleted ends (its grace period is over).
                if let Some(p) = pick(&mut self.rng, &pods).filter(|p| self.world.pods[p].deleting) {
                    self.note(format!("pod {p} is gone"));
                    self.world.pods.remove(&p);
                }
            }
            55..=64 => {
                // Time passes; slowly once calm, so that the scheduler keeps up.
                let most = if self.chaos { 8000 } else { 300 };
                self.world.now += 100 + self.rng.below(most) as i64;
            }
            65..=79 => {
                // A cache catches up, one kind at a time.
                match self.rng.below(4) {
                    0 => self.op.cache.pods = self.world.pods.clone(),
                    1 => self.op.cache.claims = self.world.claims.clone(),
                    2 => self.op.cache.workloads = self.world.workloads.clone(),
                    _ => self.op.cache.nodes = self.world.nodes.clone(),
                }
            }
            80..=84 if self.chaos => {
                // A container ends.
                if let Some(p) = pick(&mut self.rng, &pods) {
                    let pod = self.world.pods.get_mut(&p).expect("pod");
                    if pod.phase == Phase::Running {
                        pod.phase = if self.rng.chance(50) {
                            Phase::Failed
                        } else {
                            Phase::Succeeded
                        };
                        self.note(format!("pod {p} ends {:?}", self.world.pods[&p].phase));
                    }
                }
            }
            85..=86 if self.chaos => {
                // A user deletes a pod.
                if let Some(p) = pick(&mut self.rng, &pods) {
                    self.note(format!("user deletes pod {p}"));
                    self.world.pods.get_mut(&p).expect("pod").deleting = true;
                }
            }
            87..=89 if self.chaos => {
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
            90 if self.chaos => {
                // The Workload controller writes its own part of the status.
                let names: Vec<String> = self.world.workloads.keys().cloned().collect();
                if let Some(g) = pick(&mut self.rng, &names) {
                    let rv = self.world.bump();
                    self.world.workloads.get_mut(&g).expect("workload").rv = rv;
                }
            }
            91 if self.chaos => {
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
            92..=94 if self.chaos => self.intrude(),
            95 if self.chaos => {
                let world = self.world.clone();
                if self.stale.is_none() && !self.op.queue.is_empty() && self.rng.chance(50) {
                    let in_flight = 1 + self.rng.below(3) as usize;
                    self.note(format!(
                        "operator stalls with {in_flight} writes under way; another takes over"
                    ));
                    let mut successor = Operator::default();
                    successor.restart(&world);
                    self.stale = Some((std::mem::replace(&mut self.op, successor), in_flight, world));
                } else {
                    self.note("operator crashes".into());
                    self.op.restart(&world);
                }
            }
            _ => {}
        }
    }

    /// Someone else's pod: it takes a free device through its own claim, or joins a
    /// gang's shared claim once it is allocated. It may end later.
    fn intrude(&mut self) {
        if self.rng.chance(30) {
            if let Some(p) = self.world.intruders().first() {
                self.note(format!("intruder {p} ends"));
                self.world.pods.remove(p);
            }
            return;
        }
        self.world.uids += 1;
        let uid = format!("u{}", self.world.uids);
        let name = format!("intruder-{uid}");
        let joined = self
            .world
            .claims
            .iter()
            .find(|(n, c)| n.ends_with("-shared") && c.allocation.is_some())
            .map(|(n, _)| n.clone());
        let (claim, devices) = match joined.filter(|_| self.rng.chance(50)) {
            Some(claim) => {
                let devices = self.world.claims[&claim].allocation.clone().unwrap_or_default();
                (claim, devices)
            }
            None => {
                let taken = self.world.allocated();
                let free: Vec<Dev> = self
                    .world
                    .devices()
                    .into_iter()
                    .filter(|d| !taken.contains(d))
                    .collect();
                let Some(d) = free.get(self.rng.below(free.len().max(1) as u64) as usize).copied() else {
                    return;
                };
                let claim = format!("{name}-claim");
                let rv = self.world.bump();
                self.world.claims.insert(
                    claim.clone(),
                    ClaimObj {
                        workload: None,
                        allocation: Some(vec![d]),
                        reserved_for: vec![],
                        rv,
                    },
                );
                (claim, vec![d])
            }
        };
        let node = devices.first().map(|d| node_of(*d));
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
                gated: false,
                pin: node.clone(),
                phase: Phase::Running,
                node,
                deleting: false,
                claims: vec![claim],
                using: devices,
                rv,
            },
        );
    }

    // ---- the operator ----

    fn operator(&mut self) {
        if let Some(op) = self.op.queue.pop_front() {
            self.execute(op);
            return;
        }
        let names: Vec<String> = self.op.cache.workloads.keys().cloned().collect();
        if names.is_empty() {
            return;
        }
        let gang = names[self.op.cursor % names.len()].clone();
        self.op.cursor += 1;
        let Some(w) = self.op.workload(&gang) else { return };
        let claims = self.op.claims();
        let pods: Vec<PodView> = self
            .op
            .pods()
            .iter()
            .filter(|(_, p)| p.workload.as_deref() == Some(gang.as_str()))
            .map(|(name, p)| PodView {
                name: name.clone(),
                uid: p.uid.clone(),
                group: Some(p.group.clone()),
                attempt: p.attempt,
                gated: p.gated,
                phase: p.phase,
                node: p.node.clone(),
                deleting: p.deleting,
                message: None,
            })
            .collect();
        let claim_views: Vec<ClaimView> = claims
            .iter()
            .filter(|(_, c)| c.workload.as_deref() == Some(gang.as_str()))
            .map(|(name, c)| ClaimView {
                name: name.clone(),
                allocated: c.allocation.is_some(),
                reserved_for: c.reserved_for.clone(),
            })
            .collect();
        let nodes: BTreeMap<String, NodeHealth> = self
            .op
            .cache
            .nodes
            .iter()
            .filter(|(_, up)| **up)
            .map(|(n, _)| (n.clone(), NodeHealth::Ready))
            .collect();
        let journal = w.journal.clone();
        let devices_published = claims
            .values()
            .filter(|c| c.workload.as_deref() == Some(gang.as_str()))
            .flat_map(|c| c.allocation.iter().flatten())
            .all(|d| nodes.contains_key(&node_of(*d)));
        let view = Gang {
            spec: &w.spec,
            journal: journal.as_ref(),
            restarts: w.restarts,
            finished_at: w.finished_at,
            pods: &pods,
            claims: &claim_views,
            nodes: &nodes,
            devices_published,
            conflicted: &[],
            now: self.world.now,
        };
        let step = decide(&view, &SETTINGS);
        if journal.is_none() && !step.effects.is_empty() {
            self.note(format!("queued {gang}: {:?}", step.effects));
        }
        if journal.as_ref().is_some_and(|j| j.state == State::Released) {
            self.op.assumed.remove(&gang);
        }
        for effect in step.effects {
            match effect {
                Effect::Record(record) => self.op.queue.push_back(Op::Record {
                    gang: gang.clone(),
                    expected: journal.clone(),
                    record,
                }),
                Effect::DeletePods { pods, immediately } => {
                    for pod in pods {
                        self.op.queue.push_back(Op::Delete {
                            name: pod.name,
                            uid: pod.uid,
                            immediately,
                        });
                    }
                }
                Effect::Deallocate { claims, finished } => {
                    for claim in claims {
                        self.op.queue.push_back(Op::Deallocate {
                            claim,
                            finished: finished.clone(),
                        });
                    }
                }
                Effect::Release { pods } => {
                    for pin in pods {
                        self.op.queue.push_back(Op::Release {
                            pod: pin.pod.name,
                            uid: pin.pod.uid,
                            node: pin.node,
                        });
                    }
                }
                Effect::DeleteWorkload => self.op.queue.push_back(Op::DeleteWorkload { gang: gang.clone() }),
                Effect::Event { .. } => {}
            }
        }
        if !self.op.queue.is_empty() {
            return;
        }
        match journal.map(|j| j.state) {
            None => self.plan(&gang, &w),
            Some(State::Released) => self.extras(&gang, &w),
            Some(_) => {}
        }
    }

    /// Devices the operator believes free: no claim holds them in its view, no commit
    /// of its own assumes them, and their node is up.
    fn free_devices(&self) -> Vec<Dev> {
        let claims = self.op.claims();
        let taken: BTreeSet<Dev> = claims
            .values()
            .flat_map(|c| c.allocation.iter().flatten().copied())
            .chain(self.op.assumed.values().flatten().copied())
            .collect();
        (0..(NODES as u32 * DEVICES_PER_NODE))
            .filter(|d| self.op.cache.nodes.get(&node_of(*d)).copied().unwrap_or(false) && !taken.contains(d))
            .collect()
    }

    /// A queued gang whose current attempt's pods all wait at the gate is planned on
    /// the free devices: one per pod, one more for the shared claim.
    fn plan(&mut self, gang: &str, w: &WorkloadObj) {
        if w.spec.suspend || w.finished_at.is_some() {
            return;
        }
        let cached = self.op.pods();
        let pods: Vec<(String, &PodObj)> = (0..w.replicas)
            .filter_map(|i| {
                let name = pod_name(gang, i);
                let pod = cached.get(&name)?;
                (pod.gated && !pod.deleting && pod.attempt == Some(w.restarts)).then_some((name, pod))
            })
            .collect();
        let min = w.spec.groups[0].min_count;
        if (pods.len() as i32) < w.replicas {
            return;
        }
        let claims = self.op.claims();
        // Claims the view still shows allocated belong to someone: wait.
        if pods
            .iter()
            .any(|(n, _)| claims.get(&pod_claim(n)).is_some_and(|c| c.allocation.is_some()))
        {
            return;
        }
        let free = self.free_devices();
        let shared = w.shared && claims.get(&shared_claim(gang)).is_some_and(|c| c.allocation.is_none());
        if w.shared && !shared {
            return;
        }
        let needed_for_shared = usize::from(shared);
        let fit = free.len().saturating_sub(needed_for_shared).min(pods.len());
        if (fit as i32) < min {
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
        for (i, (name, _)) in pods.iter().take(fit).enumerate() {
            let d = devices.next().expect("counted");
            placement.pods.push(PlannedPod {
                name: name.clone(),
                node: node_of(d),
                extra: i as i32 >= min,
                released_at: None,
                claims: if i as i32 >= min { vec![pod_claim(name)] } else { vec![] },
            });
            placement.claims.push(pod_claim(name));
            allocations.push((pod_claim(name), vec![d]));
        }
        if shared {
            let d = devices.next().expect("counted");
            placement.claims.push(shared_claim(gang));
            allocations.push((shared_claim(gang), vec![d]));
        }
        placement.devices = allocations.len() as i32;
        let journal = commit::reserving(&placement, self.world.now);
        self.commit(gang, w.journal.clone(), journal, allocations, claims);
    }

    fn commit(
        &mut self,
        gang: &str,
        expected: Option<Journal>,
        journal: Journal,
        allocations: Vec<(String, Vec<Dev>)>,
        claims: BTreeMap<String, ClaimObj>,
    ) {
        self.note(format!("commit {gang}: {allocations:?}"));
        self.op.live = Some(gang.to_string());
        self.op.written.clear();
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
            record: Record {
                journal: Some(journal.clone()),
                conditions: vec![],
                restarts: None,
            },
        });
        for (claim, devices) in allocations {
            let expect_rv = claims.get(&claim).map_or(0, |c| c.rv);
            self.op.queue.push_back(Op::Allocate {
                gang: gang.into(),
                claim,
                devices,
                expect_rv,
            });
        }
        self.op.queue.push_back(Op::Check { planned });
        self.op.queue.push_back(Op::Record {
            gang: gang.into(),
            expected: Some(journal),
            record: Record {
                journal: Some(reserved),
                conditions: vec![],
                restarts: None,
            },
        });
        self.op.queue.push_back(Op::EndCommit { gang: gang.into() });
    }

    /// Waiting extras of a released gang that now fit: committed like a gang.
    fn extras(&mut self, gang: &str, w: &WorkloadObj) {
        let Some(journal) = w.journal.clone() else { return };
        if !self.op.queue.is_empty() || w.spec.suspend {
            return;
        }
        let claims = self.op.claims();
        let cached = self.op.pods();
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
        let free = self.free_devices();
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
        self.op.assumed.insert(
            format!("{gang}+extras"),
            allocations.iter().flat_map(|(_, d)| d.clone()).collect(),
        );
        self.commit(gang, Some(journal), grown.clone(), allocations, claims);
        // The commit's last record makes the extras released; then release them.
        if let Some(Op::Record { record, .. }) = self.op.queue.iter_mut().rev().nth(1) {
            record.journal = Some(released.clone());
        }
        let end = self.op.queue.pop_back();
        for p in &placement.pods {
            let uid = cached.get(&p.name).map_or(String::new(), |pod| pod.uid.clone());
            self.op.queue.push_back(Op::Release {
                pod: p.name.clone(),
                uid,
                node: p.node.clone(),
            });
        }
        self.op.queue.extend(end);
        self.op.queue.push_back(Op::EndCommit {
            gang: format!("{gang}+extras"),
        });
    }

    /// One operator write. A failure drops the rest of the batch (a commit undoes its
    /// own writes first).
    fn execute(&mut self, op: Op) {
        let ok = self.try_execute(op.clone());
        if ok {
            return;
        }
        self.note(format!("failed: {op:?}"));
        let commit = self.op.live.clone();
        self.op.queue.clear();
        if let Some(gang) = commit {
            let reason = if matches!(op, Op::Check { .. }) {
                Reason::Conflict
            } else {
                Reason::RolledBack
            };
            match op {
                Op::Allocate { .. } | Op::Check { .. } => {
                    self.op.queue.push_back(Op::UndoOwn {
                        gang: gang.clone(),
                        reason,
                    });
                }
                _ => {}
            }
            self.op.queue.push_back(Op::EndCommit { gang: gang.clone() });
            self.op.queue.push_back(Op::EndCommit {
                gang: format!("{gang}+extras"),
            });
        }
    }

    fn try_execute(&mut self, op: Op) -> bool {
        let injected = !matches!(op, Op::EndCommit { .. } | Op::UndoOwn { .. }) && self.fails();
        if injected {
            return false;
        }
        match op {
            Op::Record { gang, expected, record } => {
                let Some(w) = self.world.workloads.get(&gang) else {
                    return false;
                };
                // The journal is compared and swapped: other writers' status changes
                // do not count.
                if w.journal != expected {
                    return false;
                }
                // Claims the journal stops naming (all, when the gang is queued again):
                // a fresh read shows each free, and each is fenced (its version moved),
                // so that a deposed leader's allocation prepared before now cannot land
                // after.
                {
                    let kept: BTreeSet<&String> = record.journal.iter().flat_map(|j| &j.claims).collect();
                    let named = expected
                        .iter()
                        .flat_map(|j| j.claims.clone())
                        .filter(|c| !kept.contains(c))
                        .collect::<Vec<_>>();
                    if named
                        .iter()
                        .any(|c| self.world.claims.get(c).is_some_and(|c| c.allocation.is_some()))
                    {
                        return false;
                    }
                    for claim in named {
                        if self.world.claims.contains_key(&claim) {
                            let rv = self.world.bump();
                            let c = self.world.claims.get_mut(&claim).expect("claim");
                            c.rv = rv;
                            let copy = c.clone();
                            self.op.own_claims.insert(claim, copy);
                        }
                    }
                }
                match &record.journal {
                    Some(j) if j.state == State::Reserving && expected.is_none() => {
                        self.op.assumed.entry(gang.clone()).or_default();
                    }
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
                if let Some(r) = record.restarts {
                    w.restarts = r;
                }
                if record
                    .conditions
                    .iter()
                    .any(|c| matches!(c.type_, ConditionType::Succeeded | ConditionType::Failed) && c.status)
                {
                    w.finished_at = Some(now);
                }
                w.rv = rv;
                let copy = w.clone();
                self.note(format!("record {gang}: {:?}", record.journal.as_ref().map(|j| j.state)));
                self.op.own_workloads.insert(gang, copy);
                true
            }
            Op::Delete { name, uid, immediately } => {
                if self.world.pods.get(&name).is_none_or(|p| p.uid != uid) {
                    return true;
                }
                self.note(format!("delete {name} immediately={immediately}"));
                if immediately {
                    self.world.pods.remove(&name);
                } else {
                    let rv = self.world.bump();
                    let pod = self.world.pods.get_mut(&name).expect("pod");
                    pod.deleting = true;
                    pod.rv = rv;
                    let copy = pod.clone();
                    self.op.own_pods.insert(name, copy);
                }
                true
            }
            Op::Deallocate { claim, finished } => {
                let Some(c) = self.world.claims.get(&claim) else {
                    return true;
                };
                if c.allocation.is_none() {
                    return true;
                }
                if !c.reserved_for.iter().all(|u| finished.contains(u)) {
                    return true; // in use: not now
                }
                let rv = self.world.bump();
                let c = self.world.claims.get_mut(&claim).expect("claim");
                c.allocation = None;
                c.reserved_for.clear();
                c.rv = rv;
                let copy = c.clone();
                self.note(format!("deallocate {claim}"));
                self.op.own_claims.insert(claim, copy);
                true
            }
            Op::Release { pod, uid, node } => {
                if self.world.pods.get(&pod).is_none_or(|p| p.uid != uid) {
                    return false;
                }
                let rv = self.world.bump();
                let p = self.world.pods.get_mut(&pod).expect("pod");
                if p.gated {
                    p.gated = false;
                    p.pin = Some(node);
                    p.rv = rv;
                    let copy = p.clone();
                    self.op.own_pods.insert(pod.clone(), copy);
                    self.note(format!("release {pod}"));
                }
                true
            }
            Op::Allocate {
                gang,
                claim,
                devices,
                expect_rv,
            } => {
                let Some(c) = self.world.claims.get(&claim) else {
                    return false;
                };
                if c.rv != expect_rv {
                    return false;
                }
                let rv = self.world.bump();
                let c = self.world.claims.get_mut(&claim).expect("claim");
                c.allocation = Some(devices.clone());
                c.rv = rv;
                let copy = c.clone();
                self.op.own_claims.insert(claim.clone(), copy);
                self.op.written.push((claim, rv));
                self.op.assumed.entry(gang).or_default().extend(devices);
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
                true
            }
            Op::UndoOwn { gang, reason } => {
                for (claim, rv) in std::mem::take(&mut self.op.written) {
                    let Some(c) = self.world.claims.get(&claim) else {
                        continue;
                    };
                    if c.rv != rv {
                        continue;
                    }
                    let rv = self.world.bump();
                    let c = self.world.claims.get_mut(&claim).expect("claim");
                    c.allocation = None;
                    c.reserved_for.clear();
                    c.rv = rv;
                    let copy = c.clone();
                    self.op.own_claims.insert(claim, copy);
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
                        record: Record {
                            journal: Some(failed),
                            conditions: vec![],
                            restarts: None,
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
                let done = gang.ends_with("+extras")
                    || self
                        .world
                        .workloads
                        .get(&gang)
                        .is_none_or(|w| w.journal.as_ref().is_none_or(|j| j.state == State::Reserving));
                if done {
                    self.op.assumed.remove(&gang);
                }
                true
            }
        }
    }

    // ---- invariants ----

    fn check_always(&self) -> Result<(), String> {
        // A commit may write a device someone took meanwhile: its conflict check (or a
        // restarted operator) undoes that before any pod is released. So a device may be
        // in two allocations only while one is an unchecked reservation.
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
        let mut holder: BTreeMap<Dev, &str> = BTreeMap::new();
        for (name, c) in &self.world.claims {
            for d in c.allocation.iter().flatten() {
                if let Some(other) = holder.insert(*d, name)
                    && !unchecked(other)
                    && !unchecked(name)
                {
                    return Err(format!("device {d} is allocated to {other} and {name}"));
                }
            }
        }
        for (name, pod) in &self.world.pods {
            if pod.phase.terminal() || pod.node.is_none() {
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

    /// At rest: every gang runs, finished, is suspended or waits in the queue, and a
    /// gang holds allocations only while its journal names them.
    fn at_rest(&self) -> Result<(), String> {
        for (gang, w) in &self.world.workloads {
            let held: Vec<&String> = self
                .world
                .claims
                .iter()
                .filter(|(_, c)| c.workload.as_deref() == Some(gang.as_str()) && c.allocation.is_some())
                .map(|(n, _)| n)
                .collect();
            match &w.journal {
                None => {
                    if !held.is_empty() {
                        return Err(format!("queued gang {gang} holds {held:?}"));
                    }
                    // Waiting is right only while its minimum does not fit.
                    let free = self.world.devices().len() - self.world.allocated().len();
                    let needed = w.spec.groups[0].min_count as usize + usize::from(w.shared);
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
                        let claims: Vec<String> = self
                            .op
                            .claims()
                            .iter()
                            .filter(|(_, c)| c.workload.as_deref() == Some(gang.as_str()))
                            .map(|(n, c)| format!("{n} {:?} {:?}", c.allocation, c.reserved_for))
                            .collect();
                        return Err(format!(
                            "queued gang {gang} would fit ({free} devices free) but is not admitted; restarts {}, \
                             replicas {}, pods {pods:?}, claims as the operator sees them {claims:?}, free as it sees \
                             them {:?}",
                            w.restarts,
                            w.replicas,
                            self.free_devices()
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
    }

    /// The deposed leader's next write lands; after its last one it exits.
    fn stale_writes(&mut self) {
        let Some((mut stale, left, then)) = self.stale.take() else {
            return;
        };
        let Some(op) = stale.queue.pop_front() else { return };
        // Deallocations and releases read the object before the Lease check and write
        // against that read; allocations and records carry their own preconditions.
        let read_before = match &op {
            Op::Deallocate { claim, .. } => {
                then.claims.get(claim).map(|c| c.rv) == self.world.claims.get(claim).map(|c| c.rv)
            }
            Op::Release { pod, .. } => then.pods.get(pod).map(|p| p.rv) == self.world.pods.get(pod).map(|p| p.rv),
            _ => true,
        };
        if read_before {
            self.note(format!("deposed leader writes: {op:?}"));
            std::mem::swap(&mut self.op, &mut stale);
            self.execute(op);
            std::mem::swap(&mut self.op, &mut stale);
        } else {
            self.note(format!("deposed leader's write fails its precondition: {op:?}"));
        }
        if left > 1 && !stale.queue.is_empty() {
            self.stale = Some((stale, left - 1, then));
        }
    }
}

fn run(seed: u64) -> Result<(usize, usize), String> {
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
    // Calm: no more faults, failures, suspend toggles or intruders; everything that
    // ran out of time may do so now.
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
    for up in sim.world.nodes.values_mut() {
        *up = true;
    }
    let mut calm = 0;
    let mut rested = false;
    while calm < 6000 {
        sim.step();
        calm += 1;
        sim.check_always().map_err(|e| fail(&sim, e))?;
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
    Ok((chaos_steps, calm))
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
    let started = std::time::Instant::now();
    let mut steps = 0;
    for seed in 0..schedules {
        match run(seed) {
            Ok((chaos, calm)) => steps += chaos + calm,
            Err(e) => panic!("{e}"),
        }
    }
    println!(
        "model: {schedules} schedules, {steps} steps, 0 violations, in {:.1}s",
        started.elapsed().as_secs_f64()
    );
}
