//! Gang placement: at least `minCount` pods of every group, or nothing, within one value
//! of the required topology label, preferably within one value of the preferred label,
//! and otherwise where the gang fits most tightly, so that large holes stay free for
//! large gangs. Every pod's claims are allocated with the DRA allocator on its node,
//! claims shared by several pods once.
//!
//! The search runs in two stages. A cheap upper bound of how many pods of each group
//! every node can take (free resources, free matching devices) ranks the topology
//! domains; then exact placement (real allocations, first fit over nodes ordered
//! tightest first) runs on the best domains until one holds the gang. Where first fit
//! fails, a bounded search revisits earlier pods' nodes and devices (`search.rs`), so
//! a group whose selectors accept more than another's cannot starve it. Everything is
//! ordered deterministically: the same input gives the same plan.

use std::collections::{BTreeMap, BTreeSet};

use std::sync::Arc;

use crate::allocator::{self, AllocationError, ClaimRef, Matcher, NoFit, NodeFit, WorkingSet};
use crate::claim::{Allocation, AllocationMode, ClaimSpec, DeviceRequest};
use crate::cluster::{CachedRoom, ClusterState, Node};
use crate::key::{ClaimKey, PodKey};
use crate::pod::PodTraits;
use crate::pools;
use crate::request::{GangRequest, PodShape};
use crate::resources::Resources;
use crate::selector::{self, NodeTaintEffect, Taint};

/// Limits of one planning call.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// Allocator search steps for the whole call.
    pub step_budget: u64,
    /// Topology domains tried with exact placement before giving up.
    pub max_domains: usize,
    /// Allocator search steps for the one-pod trial that tightens each candidate node's
    /// room bound. Apart from [`PlanOptions::step_budget`], so that one hard node cannot
    /// starve the others; when spent, the node keeps its cheap bound.
    pub trial_step_budget: u64,
    /// Values of the preferred topology label whose nodes could hold the gang alone,
    /// tried one at a time (tightest first) in a required domain before the gang is
    /// spread over several: each try is an exact placement attempt.
    pub max_preferred_domains: usize,
    /// Placement attempts (one pod tried on one node, that node's devices allocated anew
    /// for all its pods) the backtracking search may make in one planning call. It runs
    /// only where first-fit placement failed, so gangs that fit greedily never spend it;
    /// when it runs out the gang is reported as not placed for want of search budget,
    /// not as not fitting. 0 turns backtracking off.
    pub backtrack_budget: u64,
    /// Nodes the plan must not use: held for a gang that has waited longest.
    pub excluded_nodes: std::sync::Arc<BTreeSet<String>>,
    /// Only this value of the gang's required topology label: the plan stays in that
    /// one domain (to prove a gang fits there once other gangs are evicted, say).
    /// Ignored when the gang has no required label.
    pub required_value: Option<String>,
    /// Nodes the gang, or some of its pods, must not use (where kube-scheduler refused
    /// them before, say), with why.
    pub avoid: Arc<Avoid>,
    /// Pods to put back where their predecessors were, if all of them fit there: tried
    /// before any fresh plan.
    pub previous: Arc<PreviousPlaces>,
}

/// Nodes to keep a gang or single pods off, each with the reason explanations give.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Avoid {
    /// No pod of the gang goes to these nodes.
    pub nodes: BTreeMap<String, String>,
    /// This pod does not go to these nodes.
    pub pod_nodes: BTreeMap<PodKey, BTreeMap<String, String>>,
}

impl Avoid {
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty() && self.pod_nodes.is_empty()
    }
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            step_budget: 20_000_000,
            max_domains: 32,
            trial_step_budget: 20_000,
            max_preferred_domains: 4,
            backtrack_budget: 500,
            excluded_nodes: Default::default(),
            required_value: None,
            avoid: Default::default(),
            previous: Default::default(),
        }
    }
}

/// The values of one topology level a plan uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LevelValues {
    pub key: String,
    /// Sorted.
    pub values: Vec<String>,
}

/// Where a group with a topology of its own went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupPlacement {
    pub group: String,
    /// The group's required label and the value all its pods share.
    pub required: Option<(String, String)>,
    /// The slice label and, per slice in pod order, the value its pods share.
    pub slices: Option<(String, Vec<String>)>,
}

/// A pod and its node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodPlacement {
    pub group: String,
    pub pod: PodKey,
    pub node: String,
}

/// A static PersistentVolume the plan chose for a pod's claim that binds at the first
/// consumer (kube-scheduler binds it when it binds the pod).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeChoice {
    pub pod: PodKey,
    pub volume: String,
}

/// A new allocation for a claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimAllocation {
    pub claim: ClaimKey,
    pub allocation: Allocation,
}

/// Where the gang goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub gang: String,
    /// The value of the required topology label shared by every node.
    pub topology_value: Option<String>,
    /// Values of the preferred label used, sorted.
    pub preferred_values: Vec<String>,
    /// Values of each finer preferred level used, coarse to fine.
    pub preferred_levels: Vec<LevelValues>,
    /// Groups with a topology of their own: the values their pods and slices got.
    pub group_topology: Vec<GroupPlacement>,
    /// Placed pods, groups in request order, pods in index order.
    pub pods: Vec<PodPlacement>,
    /// New allocations, shared claims first.
    pub claims: Vec<ClaimAllocation>,
    /// Pods beyond `minCount` that did not fit.
    pub unplaced: Vec<PodKey>,
    /// Static volumes chosen for claims that bind at the first consumer, by pod.
    pub volumes: Vec<VolumeChoice>,
}

pub use crate::cluster::{AssumedClaim, AssumedPod};

impl Plan {
    /// The plan's pods and claims in the form [`ClusterState::assume`] takes, so the next
    /// plan sees them as taken before the cluster shows them.
    pub fn assumption(&self, request: &GangRequest) -> (Vec<AssumedPod>, Vec<AssumedClaim>) {
        let pods = self
            .pods
            .iter()
            .map(|p| {
                let group = request.groups.iter().find(|g| g.name == p.group);
                let requests = group.map(|g| g.shape.requests.clone()).unwrap_or_default();
                let volumes = group
                    .and_then(|g| g.pods.iter().find(|i| i.key == p.pod))
                    .map(|i| i.volumes.as_slice())
                    .unwrap_or_default();
                let taken = self
                    .volumes
                    .iter()
                    .filter(|v| v.pod == p.pod)
                    .map(|v| v.volume.clone())
                    .collect();
                let traits = group
                    .map(|g| PodTraits::planned(&g.shape.rules, volumes, taken))
                    .filter(|t| !t.is_empty())
                    .map(Arc::new)
                    .unwrap_or_default();
                AssumedPod {
                    pod: p.pod.clone(),
                    node: p.node.clone(),
                    requests,
                    traits,
                }
            })
            .collect();
        let claims = self
            .claims
            .iter()
            .map(|c| AssumedClaim {
                claim: c.claim.clone(),
                devices: c.allocation.devices.clone(),
            })
            .collect();
        (pods, claims)
    }

    /// Number of devices the plan allocates.
    pub fn device_count(&self) -> usize {
        self.claims.iter().map(|c| c.allocation.devices.len()).sum()
    }

    /// Nodes used, sorted and deduplicated.
    pub fn nodes(&self) -> Vec<String> {
        self.pods
            .iter()
            .map(|p| p.node.clone())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    }
}

/// The gang does not fit now; the reasons say why, with numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unschedulable {
    pub reasons: Vec<String>,
}

impl std::fmt::Display for Unschedulable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.reasons.join("; "))
    }
}

/// The result of planning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Placed(Plan),
    Unschedulable(Unschedulable),
}

impl Outcome {
    pub fn plan(&self) -> Option<&Plan> {
        match self {
            Outcome::Placed(plan) => Some(plan),
            Outcome::Unschedulable(_) => None,
        }
    }
}

fn unschedulable(reasons: Vec<String>) -> Outcome {
    Outcome::Unschedulable(Unschedulable { reasons })
}

/// Plans `gang` against `cluster`.
pub fn plan(cluster: &ClusterState, gang: &GangRequest, options: &PlanOptions) -> Outcome {
    match Planner::new(cluster, gang, options).and_then(|p| p.run()) {
        Ok(outcome) => outcome,
        Err(e) => unschedulable(vec![e.message]),
    }
}

/// Every node that could take at least one pod of the gang as the cluster is now, in
/// name order: its reach. On [`ClusterState::emptied`], every node it could ever use.
pub fn reachable_nodes(cluster: &ClusterState, gang: &GangRequest, options: &PlanOptions) -> BTreeSet<String> {
    match Planner::new(cluster, gang, options) {
        Ok(planner) => planner.candidates.iter().map(|c| c.node.name.clone()).collect(),
        Err(_) => BTreeSet::new(),
    }
}

/// How exact placement of the gang on some nodes ended.
enum Placement {
    Placed(Plan),
    /// A pod the gang needs fits on none of the nodes: why, in words.
    NoFit(String),
    /// The call's search budget ran out while placing this pod.
    BudgetSpent {
        pod: PodKey,
    },
    /// First fit failed and backtracking ran out of attempts before it found a placement
    /// or ruled one out: why, in words.
    SearchExhausted(String),
}

fn budget_spent_on(pod: &PodKey) -> String {
    format!("search budget exhausted while placing pod {pod}")
}

/// What first fit has done so far; cloned before a topology value is tried, to go back
/// to if the value cannot hold its pods.
#[derive(Clone)]
struct FirstFit {
    usage: WorkingSet,
    /// Per candidate: what the plan's pods take of the node's resources.
    used: BTreeMap<usize, Resources>,
    shared: Vec<Option<Allocation>>,
    new_claims: Vec<(usize, ClaimAllocation)>,
    placed: Vec<Vec<Option<String>>>,
    /// Per group: candidates where its pods no longer fit.
    full: Vec<BTreeSet<usize>>,
    /// The gang's pods placed so far, as the pod constraints count them.
    occupancy: Occupancy,
    /// Why the constraints refused nodes to the pod last tried, with counts.
    refusals: BTreeMap<String, usize>,
}

/// How first fit of one pod ended.
enum PodFit {
    Placed,
    Nowhere,
    BudgetSpent,
}

/// How first fit of a group's required pods ended.
enum Fitted {
    All,
    /// Why not, in words.
    Short(String),
    BudgetSpent(PodKey),
}

/// The node labels a group's topology names: its pods only go to nodes that have them.
fn group_labels(group: &crate::request::GroupRequest) -> impl Iterator<Item = &str> {
    let topology = &group.topology;
    topology
        .required
        .iter()
        .chain(topology.slice.as_ref().map(|s| &s.key))
        .map(String::as_str)
}

/// What allocating one pod's claims on a node, for real, says about the node.
enum Trial {
    /// The pod's devices fit (or it needs none).
    Fits,
    /// They do not: only pods whose claims are allocated already can go there.
    DoesNotFit,
    /// The trial's search budget ran out: the cheap bound stands.
    Inconclusive,
}

struct Candidate {
    node: std::sync::Arc<Node>,
    /// The node's id in the cluster state.
    id: usize,
    /// Index of the node's value of the required label in the node index.
    domain: usize,
}

struct Domain<'a> {
    value: Option<String>,
    nodes: Vec<usize>,
    capacity: Vec<usize>,
    leftover: u64,
    _marker: std::marker::PhantomData<&'a ()>,
}

struct Planner<'a> {
    cluster: &'a ClusterState,
    gang: &'a GangRequest,
    options: &'a PlanOptions,
    /// Inter-pod affinity, spread, host ports and volumes.
    constraints: Constraints<'a>,
    candidates: Vec<Candidate>,
    /// Per candidate and group (row-major): room for pods of the group (an upper bound),
    /// and free matching devices (for tightest-first ordering).
    rooms: Vec<usize>,
    /// The same rooms before the pod constraints bounded them, and the constraint that
    /// did, for explanations.
    raw_rooms: Vec<usize>,
    capped_by: Vec<Option<Arc<str>>>,
    free_devices: Vec<usize>,
    index: std::sync::Arc<crate::cluster::NodeIndex>,
    /// Why nodes were left out, with counts, for explanations.
    rejections: BTreeMap<String, usize>,
    /// Per group: why candidates (nodes other groups can use) take none of its pods.
    group_rejections: Vec<BTreeMap<String, usize>>,
    /// The first allocator error on any candidate node: like kube-scheduler, planning
    /// fails with it.
    errors: Option<String>,
    /// Devices per pod, per group (weights for tightness).
    weights: Vec<u64>,
    /// What is left of [`PlanOptions::backtrack_budget`] for this call.
    backtrack_left: std::cell::Cell<u64>,
}

impl<'a> Planner<'a> {
    fn new(
        cluster: &'a ClusterState,
        gang: &'a GangRequest,
        options: &'a PlanOptions,
    ) -> Result<Self, AllocationError> {
        validate(cluster, gang)?;
        let constraints =
            Constraints::new(cluster, gang, &options.avoid).map_err(|message| AllocationError { message })?;
        let weights = gang
            .groups
            .iter()
            .map(|g| devices_per_pod(&g.shape).max(1) as u64)
            .collect();
        let index = cluster.nodes_by_label(gang.topology.required.as_deref());
        let mut planner = Planner {
            cluster,
            gang,
            options,
            constraints,
            candidates: Vec::new(),
            rooms: Vec::new(),
            raw_rooms: Vec::new(),
            capped_by: Vec::new(),
            free_devices: Vec::new(),
            index,
            rejections: BTreeMap::new(),
            group_rejections: vec![BTreeMap::new(); gang.groups.len()],
            errors: None,
            weights,
            backtrack_left: std::cell::Cell::new(options.backtrack_budget),
        };
        planner.find_candidates()?;
        if let Some(error) = planner.errors.take() {
            return Err(AllocationError { message: error });
        }
        Ok(planner)
    }

    fn room(&self, candidate: usize, group: usize) -> usize {
        self.rooms[candidate * self.gang.groups.len() + group]
    }

    /// Records a candidate's room for the next group: bounded, before the bound, and why.
    #[inline]
    fn push_room(&mut self, room: usize, raw: usize, free_devices: usize, capped_by: Option<Arc<str>>) {
        self.rooms.push(room);
        self.raw_rooms.push(raw);
        self.capped_by.push(capped_by);
        self.free_devices.push(free_devices);
    }

    fn reject(&mut self, reason: String) {
        *self.rejections.entry(reason).or_default() += 1;
    }

    /// Nodes that can take at least one pod of some group, with their room. What a
    /// node offers one pod shape is cached until something about the node changes.
    fn find_candidates(&mut self) -> Result<(), AllocationError> {
        let cluster = self.cluster;
        let gang = self.gang;
        let signatures: Vec<String> = gang.groups.iter().map(|g| self.signature(g)).collect();
        let matchers: Vec<Vec<Vec<RequestMatcher<'a>>>> = gang
            .groups
            .iter()
            .map(|g| request_matchers(cluster, g))
            .collect::<Result<_, _>>()?;
        if let Some(key) = &gang.topology.required {
            let labelled: usize = self.index.iter().map(|(_, nodes)| nodes.len()).sum();
            let missing = cluster.node_count() - labelled;
            if missing > 0 {
                *self.rejections.entry(format!("no {key} label")).or_default() += missing;
            }
        }
        let index = self.index.clone();
        let only = gang
            .topology
            .required
            .as_ref()
            .and(self.options.required_value.as_deref());
        // The shapes' entries are taken out for the plan and put back after it, each
        // under a short lock: a planner on another copy of the state is never held up
        // (it finds no entry for a shape taken out meanwhile, and learns it itself).
        let mut by_shape: Vec<Vec<Option<CachedRoom>>> = {
            let mut cache = crate::cluster::locked(&cluster.room_cache);
            if cache.len() > 64 {
                cache.clear();
            }
            signatures.iter().map(|s| cache.remove(s).unwrap_or_default()).collect()
        };
        let groups = gang.groups.len();
        // Why each group cannot use the node at hand; reused from node to node.
        let mut group_why: Vec<Option<String>> = vec![None; groups];
        let nodes = cluster.node_count() * groups;
        self.rooms.reserve(nodes);
        self.raw_rooms.reserve(nodes);
        self.capped_by.reserve(nodes);
        self.free_devices.reserve(nodes);
        let result = (|| {
            if let (Some(key), Some(value)) = (&gang.topology.required, only) {
                let outside: usize = index
                    .iter()
                    .filter(|(v, _)| v != value)
                    .map(|(_, nodes)| nodes.len())
                    .sum();
                if outside > 0 {
                    *self.rejections.entry(format!("outside {key}={value}")).or_default() += outside;
                }
            }
            for (domain, (id, node)) in index
                .iter()
                .enumerate()
                .filter(|(_, (value, _))| only.is_none_or(|only| only == value))
                .flat_map(|(d, (_, nodes))| nodes.iter().map(move |n| (d, n)))
            {
                if self.options.excluded_nodes.contains(&node.name) {
                    self.reject("held for a gang that has waited longest".into());
                    continue;
                }
                if let Some(why) = self.options.avoid.nodes.get(&node.name) {
                    self.reject(why.clone());
                    continue;
                }
                let version = cluster.node_version(*id);
                let start = self.rooms.len();
                let mut why_not = None;
                group_why.iter_mut().for_each(|why| *why = None);
                for (g, group) in gang.groups.iter().enumerate() {
                    if let Some(key) = group_labels(group).find(|key| !node.labels.contains_key(*key)) {
                        why_not.get_or_insert_with(|| format!("no {key} label"));
                        group_why[g] = Some(format!("no {key} label"));
                        self.push_room(0, 0, 0, None);
                        continue;
                    }
                    // kube-scheduler runs the pod filters before DRA's: a node they refuse
                    // never gets to allocate devices, so never reports an allocator error.
                    let constrained = if self.constraints.active() && self.node_filter(&group.shape, node).is_ok() {
                        match self.constraints.node_room(g, *id, node) {
                            Ok(room) => Some(room),
                            Err(reason) => {
                                why_not.get_or_insert_with(|| reason.clone());
                                group_why[g] = Some(reason);
                                self.push_room(0, 0, 0, None);
                                continue;
                            }
                        }
                    } else {
                        None
                    };
                    let slots = &mut by_shape[g];
                    if slots.len() <= *id {
                        slots.resize(*id + 1, None);
                    }
                    let entry = match &slots[*id] {
                        // An allocator error names the claim it came from: another
                        // gang of the same shape assesses the node for its own.
                        Some(entry) if entry.version == version && entry.error.is_none() => entry,
                        _ => {
                            let entry = self.assess(node, group, &matchers[g], version)?;
                            slots[*id] = Some(entry);
                            slots[*id].as_ref().expect("just set")
                        }
                    };
                    if let Some(reason) = &entry.rejection {
                        why_not.get_or_insert_with(|| reason.clone());
                        group_why[g] = Some(reason.clone());
                    }
                    if let Some(error) = &entry.error {
                        self.errors.get_or_insert_with(|| error.clone());
                    }
                    let (room, free_devices) = (entry.room, entry.free_devices);
                    if room == 0 {
                        self.push_room(0, 0, free_devices, None);
                        continue;
                    }
                    if !self.constraints.active() {
                        self.push_room(room, room, free_devices, None);
                        continue;
                    }
                    match constrained.map_or_else(|| self.constraints.node_room(g, *id, node), Ok) {
                        Ok(NodeRoom { cap, why }) if cap < room => {
                            if cap == 0 {
                                let reason = format!("no room left by {}", why.as_deref().unwrap_or("pod constraints"));
                                why_not.get_or_insert_with(|| reason.clone());
                                group_why[g] = Some(reason);
                            }
                            self.push_room(cap, room, free_devices, why);
                        }
                        Ok(_) => self.push_room(room, room, free_devices, None),
                        Err(reason) => {
                            why_not.get_or_insert_with(|| reason.clone());
                            group_why[g] = Some(reason);
                            self.push_room(0, 0, free_devices, None);
                        }
                    }
                }
                if self.rooms[start..start + groups].iter().all(|r| *r == 0) {
                    self.rooms.truncate(start);
                    self.raw_rooms.truncate(start);
                    self.capped_by.truncate(start);
                    self.free_devices.truncate(start);
                    self.reject(why_not.unwrap_or_else(|| "no room".into()));
                    continue;
                }
                for (g, why) in group_why.iter_mut().enumerate() {
                    if let Some(why) = why.take() {
                        *self.group_rejections[g].entry(why).or_default() += 1;
                    }
                }
                self.candidates.push(Candidate {
                    node: node.clone(),
                    id: *id,
                    domain,
                });
            }
            Ok(())
        })();
        let mut cache = crate::cluster::locked(&cluster.room_cache);
        for (signature, map) in signatures.into_iter().zip(by_shape) {
            cache.insert(signature, map);
        }
        result
    }

    /// What `node` offers pods of `shape`: filters, free resources, free devices.
    fn assess(
        &self,
        node: &Node,
        group: &crate::request::GroupRequest,
        matchers: &[Vec<RequestMatcher<'a>>],
        version: (u64, u64),
    ) -> Result<CachedRoom, AllocationError> {
        let shape = &group.shape;
        let limit = group.pods.len();
        let rejected = |reason: String| CachedRoom {
            version,
            room: 0,
            free_devices: 0,
            rejection: Some(reason),
            error: None,
        };
        if let Err(reason) = self.node_filter(shape, node) {
            return Ok(rejected(reason));
        }
        let free = self.cluster.free_resources(node);
        let by_resources = free.copies_of(&shape.requests, limit);
        if by_resources == 0 {
            let short = free.shortfall(&shape.requests).map(|s| s.resource).unwrap_or_default();
            return Ok(rejected(format!("insufficient {short}")));
        }
        // Pods whose claims are all allocated already need no devices, only room on the
        // node their allocations pin them to.
        let is_fixed = |p: &&crate::request::PodInstance| p.claims_all_allocated();
        let fixed = group
            .pods
            .iter()
            .filter(is_fixed)
            .filter(|p| fixed_allocations_allow(p, node))
            .count();
        let open = limit - group.pods.iter().filter(is_fixed).count();
        let (by_devices, free_devices) = if open == 0 {
            (0, 0)
        } else {
            device_room(self.cluster, node, matchers, open)?
        };
        let mut room = by_resources.min(by_devices + fixed);
        // One pod's claims, allocated for real on this node as kube-scheduler's filter
        // would: a tighter bound, and the allocator errors upstream reports.
        if open > 0 {
            match self.trial(node, group) {
                Ok(Trial::Fits) => room = room.max(1).min(by_resources),
                Ok(Trial::DoesNotFit) => room = room.min(fixed),
                Ok(Trial::Inconclusive) => {}
                Err(e) => {
                    return Ok(CachedRoom {
                        version,
                        room: 0,
                        free_devices: 0,
                        rejection: Some("allocation error".into()),
                        error: Some(e.message),
                    });
                }
            }
        }
        let rejection = (room == 0).then(|| "not enough free matching devices".to_string());
        Ok(CachedRoom {
            version,
            room,
            free_devices,
            rejection,
            error: None,
        })
    }

    /// Allocates the claims of the group's first pod that needs devices (with the gang's
    /// unallocated shared claims) on `node`: whether they fit, or the allocator's error.
    fn trial(&self, node: &Node, group: &crate::request::GroupRequest) -> Result<Trial, AllocationError> {
        let Some(pod) = group.pods.iter().find(|p| !p.claims_all_allocated()) else {
            return Ok(Trial::Fits);
        };
        let mut refs: Vec<ClaimRef<'_>> = (0..group.shape.claims.len())
            .filter(|c| pod.claims.get(*c).is_none_or(|claim| claim.allocation.is_none()))
            .map(|c| ClaimRef {
                key: pod.claims[c].key.as_str(),
                spec: &group.shape.claims[c],
            })
            .collect();
        refs.extend(
            group
                .shape
                .shared
                .iter()
                .map(|s| &self.gang.shared_claims[*s])
                .filter(|c| c.allocation.is_none())
                .map(|c| ClaimRef {
                    key: c.key.as_str(),
                    spec: &c.spec,
                }),
        );
        if refs.is_empty() {
            return Ok(Trial::Fits);
        }
        let mut budget = self.options.trial_step_budget;
        Ok(
            match allocator::allocate(self.cluster, &WorkingSet::default(), node, &refs, &mut budget)? {
                NodeFit::Placed(_) => Trial::Fits,
                NodeFit::NoFit(NoFit::NoSolution) => Trial::DoesNotFit,
                NodeFit::NoFit(NoFit::BudgetExhausted) => Trial::Inconclusive,
            },
        )
    }

    /// Everything about a group that decides what a node offers it (the trial's budget
    /// included, as a cached room depends on it). The pods' rules (labels, inter-pod
    /// terms, spread, host ports) are left out: the pod constraints apply them apart
    /// from the cached room, and the labels name the gang, so with them no two gangs
    /// would share what they learned of a node. The shared claims are named, as a
    /// cached refusal names the claim allocated elsewhere.
    fn signature(&self, group: &crate::request::GroupRequest) -> String {
        let PodShape {
            requests,
            node_selector,
            affinity,
            tolerations,
            claims,
            shared,
            rules: _,
        } = &group.shape;
        let shared: Vec<_> = shared
            .iter()
            .map(|s| {
                let claim = &self.gang.shared_claims[*s];
                (&claim.key, &claim.allocation)
            })
            .collect();
        let fixed: Vec<_> = group
            .pods
            .iter()
            .map(|p| {
                p.claims
                    .iter()
                    .map(|c| c.allocation.as_ref().map(|a| &a.node_selector))
                    .collect::<Vec<_>>()
            })
            .collect();
        format!(
            "{:?}|{:?}|{:?}|{:?}|{:?}|{}|{:?}|{:?}|{:?}|{}",
            requests,
            node_selector,
            affinity,
            tolerations,
            claims,
            group.pods.len(),
            shared,
            open_claims(group),
            fixed,
            self.options.trial_step_budget
        )
    }

    /// The scheduler's node filters for a pod of `shape` (resources aside).
    fn node_filter(&self, shape: &PodShape, node: &Node) -> Result<(), String> {
        if node.unschedulable {
            let unschedulable = Taint {
                key: "node.kubernetes.io/unschedulable".into(),
                value: String::new(),
                effect: NodeTaintEffect::NoSchedule,
            };
            if !shape.tolerations.iter().any(|t| t.tolerates(&unschedulable)) {
                return Err("unschedulable".into());
            }
        }
        if let Some(taint) = selector::untolerated(&shape.tolerations, &node.taints) {
            return Err(format!(
                "untolerated taint {}={}:{:?}",
                taint.key, taint.value, taint.effect
            ));
        }
        if shape.node_selector.iter().any(|(k, v)| node.labels.get(k) != Some(v)) {
            return Err("node selector does not match".into());
        }
        if shape
            .affinity
            .as_ref()
            .is_some_and(|a| !a.matches(&node.name, &node.labels))
        {
            return Err("node affinity does not match".into());
        }
        for index in &shape.shared {
            let claim = &self.gang.shared_claims[*index];
            if let Some(selector) = claim.allocation.as_ref().and_then(|a| a.node_selector.as_ref())
                && !selector.matches(&node.name, &node.labels)
            {
                return Err(format!("claim {} is allocated elsewhere", claim.key));
            }
        }
        Ok(())
    }

    fn run(self) -> Result<Outcome, AllocationError> {
        if self.gang.groups.iter().all(|g| g.pods.is_empty()) {
            let empty = Domain {
                value: None,
                nodes: vec![],
                capacity: vec![],
                leftover: 0,
                _marker: Default::default(),
            };
            let mut budget = 0;
            return Ok(match self.place_on(&empty, &[], &mut budget)? {
                Placement::Placed(plan) => Outcome::Placed(plan),
                Placement::NoFit(reason) => unschedulable(vec![reason]),
                Placement::BudgetSpent { pod } => unschedulable(vec![budget_spent_on(&pod)]),
                Placement::SearchExhausted(reason) => unschedulable(vec![reason]),
            });
        }
        if let Some(plan) = self.place_as_before()? {
            return Ok(Outcome::Placed(plan));
        }
        let mut domains = self.domains();
        if domains.is_empty() {
            return Ok(unschedulable(self.explain_no_domain(&[])));
        }
        let feasible: Vec<usize> = (0..domains.len())
            .filter(|i| self.holds_gang(&domains[*i].capacity))
            .collect();
        if feasible.is_empty() {
            return Ok(unschedulable(self.explain_no_domain(&domains)));
        }
        let mut order = feasible;
        order.sort_by(|a, b| {
            let (a, b) = (&domains[*a], &domains[*b]);
            a.leftover.cmp(&b.leftover).then_with(|| a.value.cmp(&b.value))
        });
        let mut budget = self.options.step_budget;
        let mut first_failure: Option<String> = None;
        // Whether a domain ended for want of search budget, not for want of room.
        let mut search_exhausted = false;
        for index in order.into_iter().take(self.options.max_domains.max(1)) {
            let domain = std::mem::replace(
                &mut domains[index],
                Domain {
                    value: None,
                    nodes: vec![],
                    capacity: vec![],
                    leftover: 0,
                    _marker: Default::default(),
                },
            );
            let failure = match self.place_in_domain(&domain, &mut budget)? {
                Placement::Placed(plan) => return Ok(Outcome::Placed(plan)),
                Placement::NoFit(reason) => reason,
                Placement::BudgetSpent { pod } => {
                    search_exhausted = true;
                    budget_spent_on(&pod)
                }
                Placement::SearchExhausted(reason) => {
                    search_exhausted = true;
                    reason
                }
            };
            first_failure.get_or_insert(match &domain.value {
                Some(value) => format!(
                    "{}={value}: {failure}",
                    self.gang.topology.required.as_deref().unwrap_or_default()
                ),
                None => failure,
            });
            if budget == 0 {
                break;
            }
        }
        let mut reasons = vec![if search_exhausted {
            format!(
                "gang {} was not placed: the bounds allowed it, but the search budget ran out before exact placement found a plan or ruled one out",
                self.gang.name
            )
        } else {
            format!(
                "gang {} does not fit: the bounds allowed it, but exact placement failed",
                self.gang.name
            )
        }];
        reasons.extend(first_failure);
        if budget == 0 {
            reasons.push(format!("search budget of {} steps exhausted", self.options.step_budget));
        }
        Ok(unschedulable(reasons))
    }

    /// Candidates grouped by the required label (or all in one domain), with the room
    /// for each group and how much would be left over.
    fn domains(&self) -> Vec<Domain<'a>> {
        // Candidates come in index order: consecutive runs share a domain.
        let mut by_value: Vec<(Option<&str>, Vec<usize>)> = Vec::new();
        for (i, candidate) in self.candidates.iter().enumerate() {
            let value = self
                .gang
                .topology
                .required
                .as_ref()
                .map(|_| self.index[candidate.domain].0.as_str());
            match by_value.last_mut() {
                Some((v, nodes)) if *v == value => nodes.push(i),
                _ => by_value.push((value, vec![i])),
            }
        }
        by_value
            .into_iter()
            .map(|(value, nodes)| {
                let capacity = self.capacity(&nodes);
                let leftover = self.leftover(&capacity);
                Domain {
                    value: value.map(str::to_string),
                    nodes,
                    capacity,
                    leftover,
                    _marker: Default::default(),
                }
            })
            .collect()
    }

    /// Exact placement within one domain: in one value of the finest preferred level that
    /// can hold the gang (tightest first), then of coarser ones, and otherwise spread
    /// over as few values of each level as the gang needs.
    fn place_in_domain(&self, domain: &Domain<'a>, budget: &mut u64) -> Result<Placement, AllocationError> {
        let levels = self.gang.topology.preferences();
        if levels.is_empty() {
            return self.place_on(domain, std::slice::from_ref(&domain.nodes), budget);
        }
        for level in levels.iter().rev() {
            let by_value = self.by_label(&domain.nodes, level);
            let mut whole: Vec<(u64, &String)> = by_value
                .iter()
                .filter_map(|(value, nodes)| {
                    let value = value.as_ref()?;
                    let capacity = self.capacity(nodes);
                    self.holds_gang(&capacity).then(|| (self.leftover(&capacity), value))
                })
                .collect();
            whole.sort();
            for (_, value) in whole.into_iter().take(self.options.max_preferred_domains) {
                let nodes = by_value[&Some(value.clone())].clone();
                if let placed @ Placement::Placed(_) = self.place_on(domain, &[nodes], budget)? {
                    return Ok(placed);
                }
            }
        }
        let mut buckets = Vec::new();
        self.spread(domain.nodes.clone(), &levels, &mut buckets);
        self.place_on(domain, &buckets, budget)
    }

    /// `nodes` by their value of `key`; nodes without it under `None`, which sorts first.
    fn by_label(&self, nodes: &[usize], key: &str) -> BTreeMap<Option<String>, Vec<usize>> {
        let mut by_value: BTreeMap<Option<String>, Vec<usize>> = BTreeMap::new();
        for n in nodes {
            by_value
                .entry(self.candidates[*n].node.labels.get(key).cloned())
                .or_default()
                .push(*n);
        }
        by_value
    }

    /// Room for each group on `nodes`, as the groups' topology allows.
    fn capacity(&self, nodes: &[usize]) -> Vec<usize> {
        (0..self.gang.groups.len())
            .map(|g| self.group_capacity(nodes, g))
            .collect()
    }

    fn holds_gang(&self, capacity: &[usize]) -> bool {
        capacity.iter().zip(&self.gang.groups).all(|(c, g)| *c >= g.min_count)
    }

    /// Room left over (in devices) after the gang's required pods: less is tighter.
    fn leftover(&self, capacity: &[usize]) -> u64 {
        capacity
            .iter()
            .zip(&self.gang.groups)
            .zip(&self.weights)
            .map(|((c, g), w)| (c.saturating_sub(g.min_count) as u64) * w)
            .sum()
    }

    /// Room for pods of group `g` on `nodes` (an upper bound): within one value of the
    /// group's required label, and in whole slices, each within one value of its label.
    fn group_capacity(&self, nodes: &[usize], g: usize) -> usize {
        let topology = &self.gang.groups[g].topology;
        let within = |nodes: &[usize]| -> usize {
            let room = self.slice_room(nodes, g);
            match self.domain_bound(nodes, g) {
                Some((bound, _)) => room.min(bound),
                None => room,
            }
        };
        match &topology.required {
            None => within(nodes),
            Some(key) => self
                .by_label(nodes, key)
                .into_iter()
                .filter(|(value, _)| value.is_some())
                .map(|(_, nodes)| within(&nodes))
                .max()
                .unwrap_or(0),
        }
    }

    /// What the constraints that span nodes allow group `g` on those of `nodes` where it
    /// has room, with the constraint.
    fn domain_bound(&self, nodes: &[usize], g: usize) -> Option<(usize, constraints::DomainBound<'_>)> {
        if !self.constraints.active() {
            return None;
        }
        let with_room: Vec<(usize, &Node)> = nodes
            .iter()
            .filter(|n| self.room(**n, g) > 0)
            .map(|n| (self.candidates[*n].id, self.candidates[*n].node.as_ref()))
            .collect();
        self.constraints.domain_room(g, &with_room)
    }

    /// Room for pods of group `g` on `nodes` in whole slices of its slice level.
    fn slice_room(&self, nodes: &[usize], g: usize) -> usize {
        let topology = &self.gang.groups[g].topology;
        {
            match &topology.slice {
                None => nodes.iter().map(|n| self.room(*n, g)).sum(),
                Some(slice) => {
                    // Whole slices, and one partial slice (of fewer than `size` pods) when
                    // the group's count is not a multiple of it.
                    let size = slice.size.max(1);
                    let rooms = self.room_by_label(nodes, g, &slice.key);
                    let total: usize = rooms.values().sum();
                    let whole: usize = rooms.values().map(|room| room / size * size).sum();
                    let partial = match self.gang.groups[g].min_count % size {
                        0 => 0,
                        _ => rooms.values().max().map_or(0, |room| (*room).min(size - 1)),
                    };
                    total.min(whole + partial)
                }
            }
        }
    }

    /// Room for pods of group `g` per value of `key` among `nodes`.
    fn room_by_label(&self, nodes: &[usize], g: usize, key: &str) -> BTreeMap<&str, usize> {
        let mut rooms: BTreeMap<&str, usize> = BTreeMap::new();
        for n in nodes {
            if let Some(value) = self.candidates[*n].node.labels.get(key) {
                *rooms.entry(value.as_str()).or_default() += self.room(*n, g);
            }
        }
        rooms
    }

    /// Buckets of `nodes` to fill one after the other: by value of the first level,
    /// roomiest first (nodes without the label last), each split the same way by the
    /// next level, so the gang spans as few values of every level as it must.
    fn spread(&self, nodes: Vec<usize>, levels: &[&str], buckets: &mut Vec<Vec<usize>>) {
        let Some((level, finer)) = levels.split_first() else {
            buckets.push(nodes);
            return;
        };
        let total = |nodes: &[usize]| -> u64 {
            (0..self.gang.groups.len())
                .map(|g| nodes.iter().map(|n| self.room(*n, g) as u64).sum::<u64>() * self.weights[g])
                .sum()
        };
        let mut values: Vec<(Option<String>, Vec<usize>)> = self.by_label(&nodes, level).into_iter().collect();
        values.sort_by_cached_key(|(value, nodes)| (value.is_none(), std::cmp::Reverse(total(nodes)), value.clone()));
        for (_, nodes) in values {
            self.spread(nodes, finer, buckets);
        }
    }

    /// Placement of every pod over `buckets` of nodes: first fit, and where that fails,
    /// a bounded search that revisits earlier pods' choices.
    fn place_on(
        &self,
        domain: &Domain<'a>,
        buckets: &[Vec<usize>],
        budget: &mut u64,
    ) -> Result<Placement, AllocationError> {
        let orders = self.node_orders(buckets);
        let reason = match self.place_first_fit(domain, &orders, budget)? {
            Placement::NoFit(reason) => reason,
            other => return Ok(other),
        };
        if !self.can_backtrack() {
            return Ok(Placement::NoFit(reason));
        }
        self.place_by_search(domain, &orders, budget, reason)
    }

    /// Per group: nodes with room over `buckets` in the order given (sub-domains to fill
    /// one after the other), within a bucket tightest first (least room, fewest free
    /// devices).
    fn node_orders(&self, buckets: &[Vec<usize>]) -> Vec<Vec<usize>> {
        (0..self.gang.groups.len())
            .map(|g| {
                let mut order = Vec::new();
                for bucket in buckets {
                    let mut nodes: Vec<usize> = bucket.iter().copied().filter(|n| self.room(*n, g) > 0).collect();
                    // Tightest first; with hints (preferred terms, ScheduleAnyway
                    // spread), the preferred first.
                    let tightest = |a: &usize, b: &usize| {
                        let key = |n: usize| (self.room(n, g), self.free_devices[n * self.gang.groups.len() + g]);
                        key(*a)
                            .cmp(&key(*b))
                            .then_with(|| self.candidates[*a].node.name.cmp(&self.candidates[*b].node.name))
                    };
                    if self.constraints.has_hints() {
                        let hints: BTreeMap<usize, i64> = nodes
                            .iter()
                            .map(|n| (*n, self.constraints.hint(g, &self.candidates[*n].node)))
                            .collect();
                        nodes.sort_by(|a, b| hints[b].cmp(&hints[a]).then_with(|| tightest(a, b)));
                    } else {
                        nodes.sort_by(tightest);
                    }
                    order.extend(nodes);
                }
                order
            })
            .collect()
    }

    /// First fit before any pod is placed: the gang's shared claims as they are allocated.
    fn first_fit_start(&self) -> FirstFit {
        let gang = self.gang;
        FirstFit {
            usage: WorkingSet::default(),
            used: BTreeMap::new(),
            shared: gang.shared_claims.iter().map(|c| c.allocation.clone()).collect(),
            new_claims: Vec::new(),
            placed: gang.groups.iter().map(|g| vec![None; g.pods.len()]).collect(),
            full: vec![BTreeSet::new(); gang.groups.len()],
            occupancy: self.constraints.occupancy(),
            refusals: BTreeMap::new(),
        }
    }

    /// The order first fit places groups in: big pods first (the hardest to fit), groups
    /// whose affinity only pods of other groups meet after those, and groups held to
    /// fewer assigned nodes before the others, which could take those nodes' room.
    fn group_order(&self) -> Vec<usize> {
        let gang = self.gang;
        let mut order: Vec<usize> = (0..gang.groups.len()).collect();
        order.sort_by_key(|g| {
            let group = &gang.groups[*g];
            let shape = &group.shape;
            let assigned_nodes = if group.assigned.is_empty() {
                usize::MAX
            } else {
                group.assigned.iter().map(|d| d.nodes.len()).sum()
            };
            (
                self.constraints.follows_others(*g),
                assigned_nodes,
                std::cmp::Reverse(self.weights[*g]),
                std::cmp::Reverse(shape.requests.cpu_millis),
                *g,
            )
        });
        order
    }

    /// Every pod as first fit places them, as (group, index): each group's pods within
    /// minCount in [`Planner::group_order`], then the extras. Checks of a placement made
    /// earlier enter pods in this order, so that a pod whose affinity needs another
    /// group's pods finds them entered, as it did when it was planned.
    fn pod_order(&self) -> Vec<(usize, usize)> {
        let order = self.group_order();
        let groups = &self.gang.groups;
        let core = order
            .iter()
            .flat_map(|&g| (0..groups[g].pods.len().min(groups[g].min_count)).map(move |i| (g, i)));
        let extras = order
            .iter()
            .flat_map(|&g| (groups[g].min_count..groups[g].pods.len()).map(move |i| (g, i)));
        core.chain(extras).collect()
    }

    /// First-fit placement of every pod, groups with big pods first, each pod on the
    /// first node of its group's order where it fits.
    fn place_first_fit(
        &self,
        domain: &Domain<'a>,
        orders: &[Vec<usize>],
        budget: &mut u64,
    ) -> Result<Placement, AllocationError> {
        let gang = self.gang;
        let mut state = self.first_fit_start();

        let group_order = self.group_order();

        for &g in &group_order {
            match self.fit_group(&mut state, g, &orders[g], budget)? {
                Fitted::All => {}
                Fitted::Short(reason) => return Ok(Placement::NoFit(reason)),
                Fitted::BudgetSpent(pod) => return Ok(Placement::BudgetSpent { pod }),
            }
        }
        // Pods beyond minCount, where there is room: in the value of the group's required
        // label its other pods have. A sliced group places whole slices only: its extras
        // wait (the API gives sliced groups none).
        for &g in &group_order {
            let group = &gang.groups[g];
            if group.topology.slice.is_some() {
                continue;
            }
            for index in group.min_count..group.pods.len() {
                // Without required pods, the first extra placed fixes the group's value.
                let value = self.required_value(g, &state.placed[g]);
                let allowed = |n: usize| self.in_value(n, group.topology.required.as_deref(), value.as_deref());
                match self.fit_pod(&mut state, g, index, &orders[g], &allowed, budget)? {
                    PodFit::Placed => {}
                    PodFit::Nowhere => break,
                    PodFit::BudgetSpent => {
                        return Ok(Placement::BudgetSpent {
                            pod: group.pods[index].key.clone(),
                        });
                    }
                }
            }
        }

        state.new_claims.sort_by_key(|(order, _)| *order);
        Ok(Placement::Placed(self.assemble(
            domain,
            &state.placed,
            state.new_claims.into_iter().map(|(_, c)| c).collect(),
            &state.occupancy,
        )))
    }

    /// The group's required pods, by first fit, within one value of its required label
    /// (tightest first) and in slices each within one value of the slice label.
    fn fit_group(
        &self,
        state: &mut FirstFit,
        g: usize,
        order: &[usize],
        budget: &mut u64,
    ) -> Result<Fitted, AllocationError> {
        let group = &self.gang.groups[g];
        let Some(key) = group.topology.required.as_deref() else {
            return self.fit_slices(state, g, order, &|_| true, budget);
        };
        let mut values: Vec<(usize, &str)> = self
            .room_by_label(order, g, key)
            .into_iter()
            .filter(|(_, room)| *room >= group.min_count)
            .map(|(value, room)| (room, value))
            .collect();
        values.sort();
        let tried = values.len();
        let mut first_failure = None;
        for (_, value) in values {
            let before = state.clone();
            let allowed = |n: usize| self.in_value(n, Some(key), Some(value));
            match self.fit_slices(state, g, order, &allowed, budget)? {
                Fitted::Short(reason) => {
                    *state = before;
                    first_failure.get_or_insert(format!("{key}={value}: {reason}"));
                }
                done => return Ok(done),
            }
        }
        Ok(Fitted::Short(match first_failure {
            Some(failure) => format!(
                "group {} ({} pods, {}) fits in none of the {tried} values of {key} with room for it; first, {failure}",
                group.name,
                group.min_count,
                describe_shape(&group.shape)
            ),
            None => format!(
                "group {} needs {} pods ({}) in one {key}, and no {key} of the domain has room for them",
                group.name,
                group.min_count,
                describe_shape(&group.shape)
            ),
        }))
    }

    /// The group's required pods on nodes `allowed` lets it use: one after the other, or
    /// slice by slice, each slice in the tightest value of its label that holds it.
    fn fit_slices(
        &self,
        state: &mut FirstFit,
        g: usize,
        order: &[usize],
        allowed: &dyn Fn(usize) -> bool,
        budget: &mut u64,
    ) -> Result<Fitted, AllocationError> {
        let group = &self.gang.groups[g];
        let Some(slice) = &group.topology.slice else {
            for index in 0..group.min_count {
                match self.fit_pod(state, g, index, order, allowed, budget)? {
                    PodFit::Placed => {}
                    PodFit::BudgetSpent => return Ok(Fitted::BudgetSpent(group.pods[index].key.clone())),
                    PodFit::Nowhere => {
                        let nodes = order.iter().filter(|n| allowed(**n)).count();
                        return Ok(Fitted::Short(format!(
                            "placed {index} of {} pods of group {} ({}); pod {} fits on none of the {nodes} candidate nodes{}",
                            group.min_count,
                            group.name,
                            describe_shape(&group.shape),
                            group.pods[index].key,
                            refusals_note(&state.refusals),
                        )));
                    }
                }
            }
            return Ok(Fitted::All);
        };
        let size = slice.size.max(1);
        let usable: Vec<usize> = order.iter().copied().filter(|n| allowed(*n)).collect();
        // Per value: the room bound left, and the smallest slice it failed to hold. The
        // state only fills up, so a value that failed once is not tried again for a slice
        // as big: each value fails at most once per size.
        let mut values: Vec<(usize, &str, usize)> = self
            .room_by_label(&usable, g, &slice.key)
            .into_iter()
            .map(|(value, room)| (room, value, usize::MAX))
            .collect();
        let slices = group.min_count.div_ceil(size);
        for s in 0..slices {
            let pods = s * size..((s + 1) * size).min(group.min_count);
            // Tightest first, by what is left.
            values.sort();
            let mut fitted = false;
            for (room, value, fails_from) in values.iter_mut() {
                if *room < pods.len() || pods.len() >= *fails_from {
                    continue;
                }
                let before = state.clone();
                let mut outcome = PodFit::Placed;
                for index in pods.clone() {
                    let in_slice = |n: usize| allowed(n) && self.in_value(n, Some(&slice.key), Some(value));
                    outcome = self.fit_pod(state, g, index, order, &in_slice, budget)?;
                    if !matches!(outcome, PodFit::Placed) {
                        break;
                    }
                }
                match outcome {
                    PodFit::Placed => {
                        *room -= pods.len();
                        fitted = true;
                        break;
                    }
                    PodFit::BudgetSpent => return Ok(Fitted::BudgetSpent(group.pods[pods.start].key.clone())),
                    PodFit::Nowhere => {
                        *state = before;
                        *fails_from = pods.len();
                    }
                }
            }
            if !fitted {
                let tried = values.iter().filter(|(_, _, fails)| *fails <= pods.len()).count();
                return Ok(Fitted::Short(format!(
                    "placed {s} of {slices} slices of group {} ({} pods each, {}, each in one {}); slice {s} fits in none of the {} values of {}: {tried} tried, the others without room left",
                    group.name,
                    size,
                    describe_shape(&group.shape),
                    slice.key,
                    values.len(),
                    slice.key,
                )));
            }
        }
        Ok(Fitted::All)
    }

    /// Whether candidate `n` has `value` for `key` (any node when either is unset).
    fn in_value(&self, n: usize, key: Option<&str>, value: Option<&str>) -> bool {
        match (key, value) {
            (Some(key), Some(value)) => self.candidates[n].node.labels.get(key).map(String::as_str) == Some(value),
            _ => true,
        }
    }

    /// The value of group `g`'s required label on the nodes its placed pods have.
    fn required_value(&self, g: usize, placed: &[Option<String>]) -> Option<String> {
        let key = self.gang.groups[g].topology.required.as_deref()?;
        let node = placed.iter().flatten().next()?;
        self.cluster.node(node)?.labels.get(key).cloned()
    }

    /// First fit of one pod over `order`, on nodes `allowed` lets it use.
    fn fit_pod(
        &self,
        state: &mut FirstFit,
        g: usize,
        index: usize,
        order: &[usize],
        allowed: &dyn Fn(usize) -> bool,
        budget: &mut u64,
    ) -> Result<PodFit, AllocationError> {
        let gang = self.gang;
        let group = &gang.groups[g];
        let pod = &group.pods[index];
        state.refusals.clear();
        for &n in order {
            if state.full[g].contains(&n) || !allowed(n) {
                continue;
            }
            let node: &Node = &self.candidates[n].node;
            let mut free = self.cluster.free_resources(node);
            if let Some(u) = state.used.get(&n) {
                free.sub(u);
            }
            if !group.shape.requests.fits_in(&free) {
                state.full[g].insert(n);
                continue;
            }
            if !fixed_allocations_allow(pod, node) {
                continue;
            }
            let chosen_volumes = match self
                .constraints
                .admit(&state.occupancy, g, index, self.candidates[n].id, node)
            {
                Ok(chosen) => chosen,
                Err(refusal) => {
                    if refusal.lasting {
                        state.full[g].insert(n);
                    }
                    *state.refusals.entry(refusal.reason).or_default() += 1;
                    continue;
                }
            };
            let shared_now: Vec<usize> = group
                .shape
                .shared
                .iter()
                .copied()
                .filter(|s| state.shared[*s].is_none())
                .collect();
            if group.shape.shared.iter().any(|s| {
                state.shared[*s]
                    .as_ref()
                    .and_then(|a| a.node_selector.as_ref())
                    .is_some_and(|sel| !sel.matches(&node.name, &node.labels))
            }) {
                continue;
            }
            // This pod's claims that still need devices, then shared ones.
            let own: Vec<usize> = (0..group.shape.claims.len())
                .filter(|c| pod.claims[*c].allocation.is_none())
                .collect();
            let mut refs: Vec<ClaimRef<'_>> = own
                .iter()
                .map(|c| ClaimRef {
                    key: pod.claims[*c].key.as_str(),
                    spec: &group.shape.claims[*c],
                })
                .collect();
            refs.extend(shared_now.iter().map(|s| ClaimRef {
                key: gang.shared_claims[*s].key.as_str(),
                spec: &gang.shared_claims[*s].spec,
            }));
            let allocations = if refs.is_empty() {
                Vec::new()
            } else {
                match allocator::allocate(self.cluster, &state.usage, node, &refs, budget)? {
                    NodeFit::Placed(allocations) => allocations,
                    NodeFit::NoFit(NoFit::BudgetExhausted) => return Ok(PodFit::BudgetSpent),
                    NodeFit::NoFit(NoFit::NoSolution) => {
                        state.full[g].insert(n);
                        continue;
                    }
                }
            };
            for (i, allocation) in allocations.into_iter().enumerate() {
                state.usage.hold(&allocation.devices);
                if i < own.len() {
                    state.new_claims.push((
                        1,
                        ClaimAllocation {
                            claim: pod.claims[own[i]].key.clone(),
                            allocation,
                        },
                    ));
                } else {
                    let s = shared_now[i - own.len()];
                    state.new_claims.push((
                        0,
                        ClaimAllocation {
                            claim: gang.shared_claims[s].key.clone(),
                            allocation: allocation.clone(),
                        },
                    ));
                    state.shared[s] = Some(allocation);
                }
            }
            if !shared_now.is_empty() {
                // Nodes that failed with the shared claims may fit without them.
                state.full.iter_mut().for_each(BTreeSet::clear);
            }
            state.used.entry(n).or_default().add(&group.shape.requests);
            state.placed[g][index] = Some(node.name.clone());
            self.constraints
                .enter(&mut state.occupancy, g, index, node, chosen_volumes);
            return Ok(PodFit::Placed);
        }
        Ok(PodFit::Nowhere)
    }

    /// The plan for pods placed on the nodes named (`None`: not placed).
    fn assemble(
        &self,
        domain: &Domain<'a>,
        placed: &[Vec<Option<String>>],
        claims: Vec<ClaimAllocation>,
        occupancy: &Occupancy,
    ) -> Plan {
        let gang = self.gang;
        let mut pods = Vec::new();
        let mut unplaced = Vec::new();
        for (g, group) in gang.groups.iter().enumerate() {
            for (i, pod) in group.pods.iter().enumerate() {
                match &placed[g][i] {
                    Some(node) => pods.push(PodPlacement {
                        group: group.name.clone(),
                        pod: pod.key.clone(),
                        node: node.clone(),
                    }),
                    None => unplaced.push(pod.key.clone()),
                }
            }
        }
        let preferred_values = match &gang.topology.preferred {
            Some(key) => pods
                .iter()
                .filter_map(|p| self.cluster.node(&p.node).and_then(|n| n.labels.get(key)).cloned())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect(),
            None => vec![],
        };
        let label_of = |node: &str, key: &str| -> Option<String> { self.cluster.node(node)?.labels.get(key).cloned() };
        let preferred_levels = gang
            .topology
            .preferred_levels
            .iter()
            .map(|key| LevelValues {
                key: key.clone(),
                values: pods
                    .iter()
                    .filter_map(|p| label_of(&p.node, key))
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .collect(),
            })
            .collect();
        let group_topology = gang
            .groups
            .iter()
            .zip(placed)
            .filter(|(group, _)| !group.topology.is_empty())
            .map(|(group, nodes)| {
                let first_value = |key: &str, nodes: &[Option<String>]| {
                    nodes
                        .iter()
                        .flatten()
                        .find_map(|node| label_of(node, key))
                        .unwrap_or_default()
                };
                GroupPlacement {
                    group: group.name.clone(),
                    required: group
                        .topology
                        .required
                        .as_ref()
                        .map(|key| (key.clone(), first_value(key, nodes))),
                    slices: group.topology.slice.as_ref().map(|slice| {
                        let placed_pods = nodes.iter().take_while(|n| n.is_some()).count();
                        let values = nodes[..placed_pods]
                            .chunks(slice.size.max(1))
                            .map(|chunk| first_value(&slice.key, chunk))
                            .collect();
                        (slice.key.clone(), values)
                    }),
                }
            })
            .collect();
        Plan {
            gang: gang.name.clone(),
            topology_value: domain.value.clone(),
            preferred_values,
            preferred_levels,
            group_topology,
            pods,
            claims,
            unplaced,
            volumes: self.constraints.volume_choices(occupancy),
        }
    }

    /// Why the pod constraints leave group `g` only `room` pods in `domain`, if they do:
    /// "3 nodes have room for 6 pods, but anti-affinity on kubernetes.io/hostname leaves 3".
    fn constrained_note(&self, domain: &Domain<'a>, g: usize, room: usize) -> Option<String> {
        let groups = self.gang.groups.len();
        let raw_nodes: Vec<usize> = domain
            .nodes
            .iter()
            .copied()
            .filter(|n| self.raw_rooms[n * groups + g] > 0)
            .collect();
        let raw: usize = raw_nodes.iter().map(|n| self.raw_rooms[n * groups + g]).sum();
        if raw <= room {
            return None;
        }
        // A bound over the domain says more than the nodes' own.
        let why: BTreeSet<String> = match self.domain_bound(&domain.nodes, g) {
            Some((bound, constraint)) if bound < self.slice_room(&domain.nodes, g) => {
                [constraint.describe(bound)].into()
            }
            _ => domain
                .nodes
                .iter()
                .filter_map(|n| self.capped_by[n * groups + g].as_deref())
                .map(str::to_string)
                .collect(),
        };
        if why.is_empty() {
            return None;
        }
        let constraints = why.into_iter().collect::<Vec<_>>().join(" and ");
        let group = &self.gang.groups[g];
        Some(format!(
            "{} node{} there have room for {raw} pods, but {constraints} leaves {room} for {} pods of group {}",
            raw_nodes.len(),
            if raw_nodes.len() == 1 { "" } else { "s" },
            group.min_count,
            group.name
        ))
    }

    fn explain_no_domain(&self, domains: &[Domain<'a>]) -> Vec<String> {
        let gang = self.gang;
        let total_nodes = self.cluster.node_count();
        let mut reasons = Vec::new();
        let scope = match &gang.topology.required {
            Some(key) => format!("in one {key}"),
            None => "in the cluster".to_string(),
        };
        for (g, group) in gang.groups.iter().enumerate() {
            let best = domains
                .iter()
                .max_by(|a, b| a.capacity[g].cmp(&b.capacity[g]).then_with(|| b.value.cmp(&a.value)));
            let best_room = best.map(|d| d.capacity[g]).unwrap_or(0);
            if best_room >= group.min_count {
                continue;
            }
            let where_ = match best.and_then(|d| d.value.as_ref()) {
                Some(value) => format!("the best, {value}, has room for {best_room}"),
                None => format!("there is room for {best_room}"),
            };
            let where_ = match best.and_then(|d| self.constrained_note(d, g, best_room)) {
                Some(note) => format!("{where_}: {note}"),
                None => where_,
            };
            // A group's own levels: which one failed, and what the level above offered.
            let (group_scope, level_note) = match (&group.topology.required, &group.topology.slice) {
                (None, None) => (String::new(), String::new()),
                (required, slice) => {
                    let mut scope = String::new();
                    if let Some(key) = required {
                        scope.push_str(&format!(", all in one {key}"));
                    }
                    if let Some(slice) = slice {
                        scope.push_str(&format!(", in slices of {} each in one {}", slice.size, slice.key));
                    }
                    let raw: usize = best
                        .map(|d| d.nodes.iter().map(|n| self.room(*n, g)).sum())
                        .unwrap_or(0);
                    (scope, format!(" when placed so ({raw} without the group's levels)"))
                }
            };
            let refused = match self.group_rejections[g].values().sum::<usize>() {
                0 => String::new(),
                nodes => {
                    let details: Vec<String> = self.group_rejections[g]
                        .iter()
                        .map(|(why, n)| format!("{n} {why}"))
                        .collect();
                    format!(
                        " (of the nodes other groups can use, {nodes} take none of its pods: {})",
                        details.join(", ")
                    )
                }
            };
            reasons.push(format!(
                "group {} needs {} pods ({}) {scope}{group_scope}, but {where_}{level_note}{refused}",
                group.name,
                group.min_count,
                describe_shape(&group.shape)
            ));
        }
        if reasons.is_empty() {
            reasons.push(format!("gang {} does not fit {scope}", gang.name));
        }
        let rejected: usize = self.rejections.values().sum();
        if rejected > 0 {
            let details: Vec<String> = self.rejections.iter().map(|(why, n)| format!("{n} {why}")).collect();
            reasons.push(format!(
                "{rejected} of {total_nodes} nodes cannot take any pod of the gang: {}",
                details.join(", ")
            ));
        }
        reasons
    }
}

/// ", constraints refused: 12 anti-affinity on ..., 3 ..." for messages.
fn refusals_note(refusals: &BTreeMap<String, usize>) -> String {
    if refusals.is_empty() {
        return String::new();
    }
    let mut by_count: Vec<(&String, &usize)> = refusals.iter().collect();
    by_count.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    let parts: Vec<String> = by_count.iter().map(|(why, n)| format!("{n} {why}")).collect();
    format!(" (refused by pod constraints: {})", parts.join(", "))
}

/// Pre-existing allocations of the pod's own claims pin it to their nodes.
fn fixed_allocations_allow(pod: &crate::request::PodInstance, node: &Node) -> bool {
    pod.claims
        .iter()
        .filter_map(|c| c.allocation.as_ref()?.node_selector.as_ref())
        .all(|s| s.matches(&node.name, &node.labels))
}

fn devices_per_pod(shape: &PodShape) -> usize {
    shape
        .claims
        .iter()
        .flat_map(|c| &c.requests)
        .map(|r| match r {
            DeviceRequest::Exactly(spec) => spec.count.max(1) as usize,
            DeviceRequest::FirstAvailable { subrequests, .. } => {
                subrequests.iter().map(|s| s.count.max(1) as usize).min().unwrap_or(0)
            }
        })
        .sum()
}

/// "8 devices of gpu.example.com, 16 CPU, 128Gi memory" for messages.
fn describe_shape(shape: &PodShape) -> String {
    let mut parts = Vec::new();
    let mut devices: BTreeMap<&str, usize> = BTreeMap::new();
    for request in shape.claims.iter().flat_map(|c| &c.requests) {
        match request {
            DeviceRequest::Exactly(spec) => {
                *devices.entry(&spec.device_class_name).or_default() += spec.count.max(1) as usize
            }
            DeviceRequest::FirstAvailable { subrequests, .. } => {
                if let Some(first) = subrequests.first() {
                    *devices.entry(&first.device_class_name).or_default() += first.count.max(1) as usize;
                }
            }
        }
    }
    for (class, count) in devices {
        parts.push(format!(
            "{count} {class} device{} each",
            if count == 1 { "" } else { "s" }
        ));
    }
    if shape.requests.cpu_millis > 0 {
        let cpu = shape.requests.cpu_millis;
        parts.push(if cpu % 1000 == 0 {
            format!("{} CPU", cpu / 1000)
        } else {
            format!("{cpu}m CPU")
        });
    }
    if shape.requests.memory > 0 {
        parts.push(format!("{}Mi memory", shape.requests.memory >> 20));
    }
    // Extended resources, such as GPUs a device plugin advertises.
    for (name, amount) in shape.requests.other.iter().filter(|(_, amount)| **amount > 0) {
        parts.push(format!("{amount} {name}"));
    }
    if parts.is_empty() {
        "no resources".to_string()
    } else {
        parts.join(", ")
    }
}

/// The compiled selectors of one request spec (or subrequest) of a pod shape.
struct RequestMatcher<'a> {
    spec: &'a crate::claim::DeviceRequestSpec,
    matcher: Matcher,
}

/// Claims of a group some pod still needs devices for: a claim every pod already holds
/// an allocation for asks nothing more of the nodes.
fn open_claims(group: &crate::request::GroupRequest) -> Vec<usize> {
    (0..group.shape.claims.len())
        .filter(|c| {
            group.pods.is_empty()
                || group
                    .pods
                    .iter()
                    .any(|p| p.claims.get(*c).is_none_or(|claim| claim.allocation.is_none()))
        })
        .collect()
}

/// Per open claim, per request: the matchers of its spec or of each `firstAvailable`
/// option.
fn request_matchers<'a>(
    cluster: &ClusterState,
    group: &'a crate::request::GroupRequest,
) -> Result<Vec<Vec<RequestMatcher<'a>>>, AllocationError> {
    let mut all = Vec::new();
    for claim in open_claims(group).into_iter().map(|c| &group.shape.claims[c]) {
        for request in &claim.requests {
            let specs: Vec<&crate::claim::DeviceRequestSpec> = match request {
                DeviceRequest::Exactly(spec) => vec![spec],
                DeviceRequest::FirstAvailable { subrequests, .. } => subrequests.iter().collect(),
            };
            let mut options = Vec::with_capacity(specs.len());
            for spec in specs {
                let (matcher, _) = Matcher::new(cluster, "", request.name(), spec)?;
                options.push(RequestMatcher { spec, matcher });
            }
            all.push(options);
        }
    }
    Ok(all)
}

/// Upper bound of how many pods the node's devices allow (at most `limit`), and how many
/// matching devices are free (for ordering).
fn device_room(
    cluster: &ClusterState,
    node: &Node,
    requests: &[Vec<RequestMatcher<'_>>],
    limit: usize,
) -> Result<(usize, usize), AllocationError> {
    if requests.is_empty() {
        return Ok((limit, 0));
    }
    let pools = pools::gather(cluster, node);
    let mut room = limit;
    let mut free_total = 0;
    for options in requests {
        let mut best = 0;
        for RequestMatcher { spec, matcher } in options {
            if spec.admin_access {
                best = limit;
                continue;
            }
            let (mut matching, mut free) = (0usize, 0usize);
            for pool in pools.iter().filter(|p| !p.incomplete && p.invalid.is_none()) {
                for slice in &pool.slices {
                    for (index, device) in slice.devices.iter().enumerate() {
                        // A bound, not a decision: a selector that fails to evaluate
                        // counts as matching; the allocator decides, lazily as upstream,
                        // whether the failure matters.
                        if !matcher.matches(cluster, "", slice, index, node).unwrap_or(true) {
                            continue;
                        }
                        matching += 1;
                        if device.allow_multiple_allocations
                            || !cluster.device_allocated_by_name(&slice.driver, &slice.pool, &device.name)
                        {
                            free += 1;
                        }
                    }
                }
            }
            free_total += free;
            let copies = match spec.allocation_mode {
                AllocationMode::All => usize::from(matching > 0 && free == matching),
                AllocationMode::ExactCount => free / spec.count.max(1) as usize,
            };
            best = best.max(copies);
        }
        room = room.min(best);
    }
    Ok((room, free_total))
}

/// Problems with the gang itself: unknown classes and selectors that do not compile.
fn validate(cluster: &ClusterState, gang: &GangRequest) -> Result<(), AllocationError> {
    let specs = gang
        .groups
        .iter()
        .flat_map(|g| {
            g.shape
                .claims
                .iter()
                .map(move |c| (g.pods.first().and_then(|p| p.claims.first()).map(|c| c.key.clone()), c))
        })
        .chain(gang.shared_claims.iter().map(|c| (Some(c.key.clone()), &c.spec)));
    for (key, claim) in specs {
        check_claim(
            cluster,
            key.as_ref().map_or(gang.name.as_str(), ClaimKey::as_str),
            claim,
        )?;
    }
    for group in &gang.groups {
        if group.min_count > group.pods.len() {
            return Err(AllocationError {
                message: format!(
                    "group {}: minCount {} exceeds its {} pods",
                    group.name,
                    group.min_count,
                    group.pods.len()
                ),
            });
        }
        for s in &group.shape.shared {
            if *s >= gang.shared_claims.len() {
                return Err(AllocationError {
                    message: format!("group {}: unknown shared claim #{s}", group.name),
                });
            }
        }
    }
    Ok(())
}

fn check_claim(cluster: &ClusterState, key: &str, claim: &ClaimSpec) -> Result<(), AllocationError> {
    for request in &claim.requests {
        let specs: Vec<&crate::claim::DeviceRequestSpec> = match request {
            DeviceRequest::Exactly(spec) => vec![spec],
            DeviceRequest::FirstAvailable { subrequests, .. } => subrequests.iter().collect(),
        };
        for spec in specs {
            Matcher::new(cluster, key, request.name(), spec)?;
        }
    }
    Ok(())
}

mod assigned;
mod constraints;
mod previous;
mod search;
mod verify;
mod volumes;

pub use verify::verify;

use constraints::{Constraints, NodeRoom, Occupancy};
pub use previous::{PreviousPlace, PreviousPlaces};

#[cfg(test)]
mod constraint_tests;
#[cfg(test)]
mod tests;
