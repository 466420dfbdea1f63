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

use crate::allocator::{self, AllocationError, ClaimRef, Matcher, NoFit, NodeFit, WorkingSet};
use crate::claim::{Allocation, AllocationMode, ClaimSpec, DeviceRequest};
use crate::cluster::{CachedRoom, ClusterState, Node};
use crate::key::{ClaimKey, PodKey};
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
        }
    }
}

/// A pod and its node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodPlacement {
    pub group: String,
    pub pod: PodKey,
    pub node: String,
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
    /// Placed pods, groups in request order, pods in index order.
    pub pods: Vec<PodPlacement>,
    /// New allocations, shared claims first.
    pub claims: Vec<ClaimAllocation>,
    /// Pods beyond `minCount` that did not fit.
    pub unplaced: Vec<PodKey>,
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
                let requests = request
                    .groups
                    .iter()
                    .find(|g| g.name == p.group)
                    .map(|g| g.shape.requests.clone())
                    .unwrap_or_default();
                AssumedPod {
                    pod: p.pod.clone(),
                    node: p.node.clone(),
                    requests,
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
    candidates: Vec<Candidate>,
    /// Per candidate and group (row-major): room for pods of the group (an upper bound),
    /// and free matching devices (for tightest-first ordering).
    rooms: Vec<usize>,
    free_devices: Vec<usize>,
    index: std::sync::Arc<crate::cluster::NodeIndex>,
    /// Why nodes were left out, with counts, for explanations.
    rejections: BTreeMap<String, usize>,
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
            candidates: Vec::new(),
            rooms: Vec::new(),
            free_devices: Vec::new(),
            index,
            rejections: BTreeMap::new(),
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
        let mut cache = crate::cluster::locked(&cluster.room_cache);
        if cache.len() > 64 {
            cache.clear();
        }
        let mut by_shape: Vec<Vec<Option<CachedRoom>>> =
            signatures.iter().map(|s| cache.remove(s).unwrap_or_default()).collect();
        let groups = gang.groups.len();
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
                let version = cluster.node_version(*id);
                let start = self.rooms.len();
                let mut why_not = None;
                for (g, group) in gang.groups.iter().enumerate() {
                    let slots = &mut by_shape[g];
                    if slots.len() <= *id {
                        slots.resize(*id + 1, None);
                    }
                    let entry = match &slots[*id] {
                        Some(entry) if entry.version == version => entry,
                        _ => {
                            let entry = self.assess(node, group, &matchers[g], version)?;
                            slots[*id] = Some(entry);
                            slots[*id].as_ref().expect("just set")
                        }
                    };
                    if let Some(reason) = &entry.rejection {
                        why_not.get_or_insert_with(|| reason.clone());
                    }
                    if let Some(error) = &entry.error {
                        self.errors.get_or_insert_with(|| error.clone());
                    }
                    self.rooms.push(entry.room);
                    self.free_devices.push(entry.free_devices);
                }
                if self.rooms[start..start + groups].iter().all(|r| *r == 0) {
                    self.rooms.truncate(start);
                    self.free_devices.truncate(start);
                    self.reject(why_not.unwrap_or_else(|| "no room".into()));
                    continue;
                }
                self.candidates.push(Candidate {
                    node: node.clone(),
                    domain,
                });
            }
            Ok(())
        })();
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
    /// included, as a cached room depends on it).
    fn signature(&self, group: &crate::request::GroupRequest) -> String {
        let shared: Vec<_> = group
            .shape
            .shared
            .iter()
            .map(|s| &self.gang.shared_claims[*s].allocation)
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
            "{:?}|{}|{:?}|{:?}|{:?}|{}",
            group.shape,
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
        let mut domains = self.domains();
        if domains.is_empty() {
            return Ok(unschedulable(self.explain_no_domain(&[])));
        }
        let feasible: Vec<usize> = (0..domains.len())
            .filter(|i| {
                domains[*i]
                    .capacity
                    .iter()
                    .zip(&self.gang.groups)
                    .all(|(c, g)| *c >= g.min_count)
            })
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
                Placement::BudgetSpent { pod } => budget_spent_on(&pod),
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
                let capacity: Vec<usize> = (0..self.gang.groups.len())
                    .map(|g| nodes.iter().map(|n| self.room(*n, g)).sum())
                    .collect();
                let leftover = capacity
                    .iter()
                    .zip(&self.gang.groups)
                    .zip(&self.weights)
                    .map(|((c, g), w)| (c.saturating_sub(g.min_count) as u64) * w)
                    .sum();
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

    /// Exact placement within one domain.
    fn place_in_domain(&self, domain: &Domain<'a>, budget: &mut u64) -> Result<Placement, AllocationError> {
        let Some(preferred) = &self.gang.topology.preferred else {
            return self.place_on(domain, std::slice::from_ref(&domain.nodes), budget);
        };
        // Sub-domains by the preferred label; nodes without it come last.
        let mut by_value: BTreeMap<Option<String>, Vec<usize>> = BTreeMap::new();
        for n in &domain.nodes {
            by_value
                .entry(self.candidates[*n].node.labels.get(preferred).cloned())
                .or_default()
                .push(*n);
        }
        let sub_capacity = |nodes: &[usize]| -> Vec<usize> {
            (0..self.gang.groups.len())
                .map(|g| nodes.iter().map(|n| self.room(*n, g)).sum())
                .collect()
        };
        let fits = |capacity: &[usize]| capacity.iter().zip(&self.gang.groups).all(|(c, g)| *c >= g.min_count);
        let mut whole: Vec<(u64, Option<String>)> = Vec::new();
        for (value, nodes) in &by_value {
            let capacity = sub_capacity(nodes);
            if value.is_some() && fits(&capacity) {
                let leftover = capacity
                    .iter()
                    .zip(&self.gang.groups)
                    .zip(&self.weights)
                    .map(|((c, g), w)| (c.saturating_sub(g.min_count) as u64) * w)
                    .sum();
                whole.push((leftover, value.clone()));
            }
        }
        whole.sort();
        for (_, value) in whole.iter().take(self.options.max_preferred_domains) {
            if let placed @ Placement::Placed(_) = self.place_on(domain, &[by_value[value].clone()], budget)? {
                return Ok(placed);
            }
        }
        // Spread over as few sub-domains as possible: the roomiest first.
        let mut spread: Vec<(Option<String>, Vec<usize>)> = by_value.into_iter().collect();
        spread.sort_by(|(va, a), (vb, b)| {
            let (ca, cb) = (sub_capacity(a), sub_capacity(b));
            let total = |c: &[usize]| c.iter().zip(&self.weights).map(|(c, w)| *c as u64 * w).sum::<u64>();
            (va.is_none(), std::cmp::Reverse(total(&ca)), va).cmp(&(vb.is_none(), std::cmp::Reverse(total(&cb)), vb))
        });
        let buckets: Vec<Vec<usize>> = spread.into_iter().map(|(_, nodes)| nodes).collect();
        self.place_on(domain, &buckets, budget)
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
                    nodes.sort_by(|a, b| {
                        let key = |n: usize| (self.room(n, g), self.free_devices[n * self.gang.groups.len() + g]);
                        key(*a)
                            .cmp(&key(*b))
                            .then_with(|| self.candidates[*a].node.name.cmp(&self.candidates[*b].node.name))
                    });
                    order.extend(nodes);
                }
                order
            })
            .collect()
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
        let mut usage = WorkingSet::default();
        let mut used: BTreeMap<&str, Resources> = BTreeMap::new();
        let mut shared: Vec<Option<Allocation>> = gang.shared_claims.iter().map(|c| c.allocation.clone()).collect();
        let mut new_claims: Vec<(usize, crate::placement::ClaimAllocation)> = Vec::new();
        let mut placed: Vec<Vec<Option<String>>> = gang.groups.iter().map(|g| vec![None; g.pods.len()]).collect();

        // Big pods first: they are the hardest to fit.
        let mut group_order: Vec<usize> = (0..gang.groups.len()).collect();
        group_order.sort_by_key(|g| {
            let shape = &gang.groups[*g].shape;
            (
                std::cmp::Reverse(self.weights[*g]),
                std::cmp::Reverse(shape.requests.cpu_millis),
                *g,
            )
        });

        let mut full: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); gang.groups.len()];
        for phase in 0..2 {
            for &g in &group_order {
                let group = &gang.groups[g];
                let range = if phase == 0 {
                    0..group.min_count
                } else {
                    group.min_count..group.pods.len()
                };
                for index in range {
                    let pod = &group.pods[index];
                    let mut outcome = None;
                    for &n in &orders[g] {
                        if full[g].contains(&n) {
                            continue;
                        }
                        let node: &Node = &self.candidates[n].node;
                        let mut free = self.cluster.free_resources(node);
                        if let Some(u) = used.get(node.name.as_str()) {
                            free.sub(u);
                        }
                        if !group.shape.requests.fits_in(&free) {
                            full[g].insert(n);
                            continue;
                        }
                        if !fixed_allocations_allow(pod, node) {
                            continue;
                        }
                        let shared_now: Vec<usize> = group
                            .shape
                            .shared
                            .iter()
                            .copied()
                            .filter(|s| shared[*s].is_none())
                            .collect();
                        if group.shape.shared.iter().any(|s| {
                            shared[*s]
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
                            match allocator::allocate(self.cluster, &usage, node, &refs, budget)? {
                                NodeFit::Placed(allocations) => allocations,
                                NodeFit::NoFit(NoFit::BudgetExhausted) => {
                                    return Ok(Placement::BudgetSpent { pod: pod.key.clone() });
                                }
                                NodeFit::NoFit(NoFit::NoSolution) => {
                                    full[g].insert(n);
                                    continue;
                                }
                            }
                        };
                        for (i, allocation) in allocations.into_iter().enumerate() {
                            usage.hold(&allocation.devices);
                            if i < own.len() {
                                new_claims.push((
                                    1,
                                    ClaimAllocation {
                                        claim: pod.claims[own[i]].key.clone(),
                                        allocation,
                                    },
                                ));
                            } else {
                                let s = shared_now[i - own.len()];
                                new_claims.push((
                                    0,
                                    ClaimAllocation {
                                        claim: gang.shared_claims[s].key.clone(),
                                        allocation: allocation.clone(),
                                    },
                                ));
                                shared[s] = Some(allocation);
                            }
                        }
                        if !shared_now.is_empty() {
                            // Nodes that failed with the shared claims may fit without them.
                            full.iter_mut().for_each(BTreeSet::clear);
                        }
                        used.entry(node.name.as_str()).or_default().add(&group.shape.requests);
                        outcome = Some(node.name.clone());
                        break;
                    }
                    match outcome {
                        Some(node) => placed[g][index] = Some(node),
                        None if phase == 0 => {
                            let done = placed[g].iter().filter(|p| p.is_some()).count();
                            return Ok(Placement::NoFit(format!(
                                "placed {done} of {} pods of group {} ({}); pod {} fits on none of the {} candidate nodes",
                                group.min_count,
                                group.name,
                                describe_shape(&group.shape),
                                pod.key,
                                orders[g].len()
                            )));
                        }
                        None => break,
                    }
                }
            }
        }

        new_claims.sort_by_key(|(order, _)| *order);
        Ok(Placement::Placed(self.assemble(
            domain,
            &placed,
            new_claims.into_iter().map(|(_, c)| c).collect(),
        )))
    }

    /// The plan for pods placed on the nodes named (`None`: not placed).
    fn assemble(&self, domain: &Domain<'a>, placed: &[Vec<Option<String>>], claims: Vec<ClaimAllocation>) -> Plan {
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
        Plan {
            gang: gang.name.clone(),
            topology_value: domain.value.clone(),
            preferred_values,
            pods,
            claims,
            unplaced,
        }
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
            reasons.push(format!(
                "group {} needs {} pods ({}) {scope}, but {where_}",
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

mod search;

#[cfg(test)]
mod tests;
