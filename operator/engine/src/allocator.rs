//! The DRA allocator for one node: given the claims of one pod, find devices for all of
//! them on that node, or report that there are none. It follows kube-scheduler's
//! structured allocator (the variant used with the default features of 1.36 and 1.37):
//! a depth-first search over claims, requests and device slots, trying pools (by
//! driver and name), slices (by name) and devices (in slice order), devices of one
//! request as combinations; first complete solution wins. Constraints, counters,
//! consumable capacity, taints, admin access and `firstAvailable` behave as upstream.
//!
//! Two additions: a step budget, so a hopeless request fails fast with a reason, and
//! deterministic share IDs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

// A fast hasher for the maps on the search's hot path, keyed by device ids and names.
use rustc_hash::FxHashMap;

use crate::cel::{self, DeviceView};
use crate::claim::{
    AllocatedConfig, Allocation, AllocationMode, ClaimSpec, ConfigSource, ConstraintKind, DeviceId, DeviceRequest,
    DeviceRequestSpec, DeviceResult, MAX_ALLOCATION_RESULTS, TaintEffect,
};
use crate::cluster::{ClusterState, Device, DeviceClass, Node, Slice, SliceNodes};
use crate::device::{AttributeValue, Capacity, lookup_attribute};
use crate::ledger::DeviceLedger;
use crate::pools::{self, Pool};
use crate::quantity::Quantity;
use crate::selector::{NodeSelector, Term};

/// A problem with the input that makes allocation impossible on any node (upstream
/// returns these as errors, not as "does not fit").
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct AllocationError {
    pub message: String,
}

fn error(message: impl Into<String>) -> AllocationError {
    AllocationError {
        message: message.into(),
    }
}

/// Why a node offers no solution, for explanations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoFit {
    /// The search ended without a solution.
    NoSolution,
    /// The search used its step budget.
    BudgetExhausted,
}

/// Devices taken by allocations that the cluster does not show yet (the plan being
/// built), on top of [`ClusterState`].
#[derive(Clone, Debug, Default)]
pub struct WorkingSet {
    held: DeviceLedger,
    /// While set, only these devices may be taken (a pod going back onto the devices it
    /// had): every other device counts as taken.
    only: Option<Arc<BTreeSet<DeviceId>>>,
}

impl WorkingSet {
    /// Takes the devices of an allocation.
    pub fn hold(&mut self, results: &[DeviceResult]) {
        for result in results {
            self.held.hold(result);
        }
    }

    /// Gives back the devices of an allocation taken with [`WorkingSet::hold`].
    pub fn release(&mut self, results: &[DeviceResult]) {
        for result in results {
            self.held.release(result);
        }
    }

    /// Confines what may be taken to `devices` (`None`: any free device).
    pub fn confine(&mut self, devices: Option<Arc<BTreeSet<DeviceId>>>) {
        self.only = devices;
    }

    fn permits(&self, id: &DeviceId) -> bool {
        self.only.as_ref().is_none_or(|only| only.contains(id))
    }

    fn allocated(&self, cluster: &ClusterState, id: &DeviceId) -> bool {
        self.held.held_exclusively(id) || cluster.device_allocated(id)
    }

    fn capacity_in_use(&self, cluster: &ClusterState, id: &DeviceId) -> bool {
        self.held.shared(id) || cluster.device_shared(id)
    }

    fn in_any_use(&self, cluster: &ClusterState, id: &DeviceId) -> bool {
        self.held.in_any_use(id) || cluster.device_in_any_use(id)
    }

    fn consumed(&self, cluster: &ClusterState, id: &DeviceId) -> BTreeMap<String, Quantity> {
        let mut total = cluster.consumed_capacity(id).cloned().unwrap_or_default();
        if let Some(extra) = self.held.consumed_capacity(id) {
            for (name, value) in extra {
                let t = total.entry(name.clone()).or_insert(Quantity::ZERO);
                *t = t.checked_add(value).unwrap_or(*t);
            }
        }
        total
    }
}

/// A claim to allocate on a node: its key (for share IDs and messages) and spec.
#[derive(Clone, Copy, Debug)]
pub struct ClaimRef<'a> {
    pub key: &'a str,
    pub spec: &'a ClaimSpec,
}

/// What [`allocate`] found on one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeFit {
    /// Devices for every claim: one allocation per claim, in the order given.
    Placed(Vec<Allocation>),
    /// No devices for these claims here.
    NoFit(NoFit),
}

/// Allocates every claim of `claims` on `node`, all or nothing. `budget` counts search
/// steps and is decremented by the steps used. An error is a problem with the input,
/// not with the node.
pub fn allocate(
    cluster: &ClusterState,
    usage: &WorkingSet,
    node: &Node,
    claims: &[ClaimRef<'_>],
    budget: &mut u64,
) -> Result<NodeFit, AllocationError> {
    let pools = pools::gather(cluster, node);
    let mut search = Search::new(cluster, usage, node, claims, pools)?;
    search.steps_left = *budget;
    let found = search.allocate_one(Position::default(), false, Location::default());
    *budget = search.steps_left;
    match found {
        Ok(true) => Ok(NodeFit::Placed(search.build_results())),
        Ok(false) => {
            if let Some(pool) = search.pools.iter().find(|p| p.invalid.is_some()) {
                return Err(error(format!(
                    "invalid resource pool {}/{}: {}",
                    pool.driver,
                    pool.name,
                    pool.invalid.as_deref().unwrap_or_default()
                )));
            }
            Ok(NodeFit::NoFit(NoFit::NoSolution))
        }
        Err(Stop::Budget) => Ok(NodeFit::NoFit(NoFit::BudgetExhausted)),
        Err(Stop::MaxResults) => Ok(NodeFit::NoFit(NoFit::NoSolution)),
        Err(Stop::Fatal(e)) => Err(e),
    }
}

/// The selectors of one request (its class's, then its own), compiled, with their
/// results cached per device across plans.
pub(crate) struct Matcher {
    set: usize,
    programs: Vec<cel::Program>,
    class_selectors: usize,
    class_name: String,
}

impl Matcher {
    /// Looks up the request's class and compiles the selectors.
    pub(crate) fn new(
        cluster: &ClusterState,
        claim_key: &str,
        request_name: &str,
        spec: &DeviceRequestSpec,
    ) -> Result<(Matcher, DeviceClass), AllocationError> {
        if spec.device_class_name.is_empty() {
            return Err(error(format!(
                "claim {claim_key}, request {request_name}: missing device class name"
            )));
        }
        let class = cluster.class(&spec.device_class_name).cloned().ok_or_else(|| {
            error(format!(
                "claim {claim_key}, request {request_name}: could not retrieve device class {}: not found",
                spec.device_class_name
            ))
        })?;
        let mut all = class.selectors.clone();
        all.extend(spec.selectors.iter().cloned());
        let mut programs = Vec::with_capacity(all.len());
        for (i, expression) in all.iter().enumerate() {
            let program = cluster.program(expression).map_err(|e| {
                if i < class.selectors.len() {
                    error(format!("class {}: selector #{i}: CEL compile error: {e}", class.name))
                } else {
                    error(format!(
                        "claim {claim_key}: selector #{}: CEL compile error: {e}",
                        i - class.selectors.len()
                    ))
                }
            })?;
            programs.push(program);
        }
        let set = crate::cluster::locked(&cluster.match_cache).set_id(&all);
        let matcher = Matcher {
            set,
            programs,
            class_selectors: class.selectors.len(),
            class_name: class.name.clone(),
        };
        Ok((matcher, class))
    }

    /// Whether the device passes the selectors and, for per-device node selection, is
    /// available on `node`. A CEL runtime error is an error, as upstream.
    pub(crate) fn matches(
        &self,
        cluster: &ClusterState,
        claim_key: &str,
        slice: &Slice,
        device_index: usize,
        node: &Node,
    ) -> Result<bool, AllocationError> {
        let version = cluster.slice_version(&slice.name);
        let cached = crate::cluster::locked(&cluster.match_cache).get(self.set, &slice.name, version, device_index);
        let outcome = match cached {
            Some(outcome) => outcome,
            None => {
                let outcome = self.evaluate(slice, device_index);
                crate::cluster::locked(&cluster.match_cache).put(
                    self.set,
                    &slice.name,
                    version,
                    slice.devices.len(),
                    device_index,
                    outcome.clone(),
                );
                outcome
            }
        };
        match outcome {
            Ok(false) => Ok(false),
            Ok(true) => {
                Ok(!matches!(slice.nodes, SliceNodes::PerDevice)
                    || pools::device_targets_node(slice, device_index, node))
            }
            Err(encoded) => Err(self.runtime_error(claim_key, slice, device_index, &encoded)),
        }
    }

    fn evaluate(&self, slice: &Slice, device_index: usize) -> Result<bool, String> {
        let device = &slice.devices[device_index];
        let view = DeviceView {
            driver: &slice.driver,
            attributes: &device.attributes,
            capacity: &device.capacity,
            allow_multiple_allocations: device.allow_multiple_allocations,
        };
        for (i, program) in self.programs.iter().enumerate() {
            match program.evaluate(&view) {
                Ok(true) => {}
                Ok(false) => return Ok(false),
                Err(e) => return Err(format!("{i}\u{0}{}", e.message)),
            }
        }
        Ok(true)
    }

    fn runtime_error(&self, claim_key: &str, slice: &Slice, device_index: usize, encoded: &str) -> AllocationError {
        let (index, message) = encoded.split_once('\u{0}').unwrap_or(("0", encoded));
        let index: usize = index.parse().unwrap_or(0);
        let id = format!("{}/{}/{}", slice.driver, slice.pool, slice.devices[device_index].name);
        let hint = "consider using CEL optional chaining (.? followed by orValue()) or guarding the check with has()";
        if index < self.class_selectors {
            error(format!(
                "class {}: selector #{index} on device {id}: CEL runtime error: {message}; {hint}",
                self.class_name
            ))
        } else {
            error(format!(
                "claim {claim_key}: selector #{} on device {id}: CEL runtime error: {message}; {hint}",
                index - self.class_selectors
            ))
        }
    }
}

enum Stop {
    Budget,
    MaxResults,
    Fatal(AllocationError),
}

impl From<AllocationError> for Stop {
    fn from(e: AllocationError) -> Self {
        Stop::Fatal(e)
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct RequestKey {
    claim: usize,
    request: usize,
    sub: usize,
}

#[derive(Clone, Copy, Debug, Default)]
struct Position {
    claim: usize,
    request: usize,
    sub: usize,
    device: usize,
}

#[derive(Clone, Copy, Debug, Default)]
struct Location {
    pool: usize,
    slice: usize,
    device: usize,
}

struct RequestData<'a> {
    spec: &'a DeviceRequestSpec,
    /// Name of the enclosing request for a `firstAvailable` subrequest.
    parent: Option<&'a str>,
    class: DeviceClass,
    matcher: Matcher,
    num_devices: usize,
    /// For allocation mode All: the devices, fixed up front.
    all_devices: Vec<(usize, usize, usize)>,
}

impl RequestData<'_> {
    fn name(&self) -> String {
        match self.parent {
            Some(parent) => format!("{parent}/{}", self.spec.name),
            None => self.spec.name.clone(),
        }
    }
}

struct Chosen {
    request: String,
    base_request: String,
    sub_request: Option<String>,
    id: DeviceId,
    slice: Arc<Slice>,
    device_index: usize,
    admin_access: bool,
    share_id: Option<String>,
    consumed: BTreeMap<String, Quantity>,
    counters_reserved: bool,
    key: RequestKey,
}

enum ConstraintState {
    Match {
        requests: BTreeSet<String>,
        attribute: String,
        value: Option<AttributeValue>,
        count: usize,
    },
    Distinct {
        requests: BTreeSet<String>,
        attribute: String,
        values: Vec<AttributeValue>,
    },
}

impl ConstraintState {
    fn applies(requests: &BTreeSet<String>, base: &str, sub: Option<&str>) -> bool {
        requests.is_empty()
            || requests.contains(base)
            || sub.is_some_and(|sub| requests.contains(&format!("{base}/{sub}")))
    }

    fn add(&mut self, base: &str, sub: Option<&str>, driver: &str, device: &Device) -> bool {
        match self {
            ConstraintState::Match {
                requests,
                attribute,
                value,
                count,
            } => {
                if !Self::applies(requests, base, sub) {
                    return true;
                }
                let Some(found) = lookup_attribute(&device.attributes, driver, attribute) else {
                    return false;
                };
                if *count == 0 {
                    *value = Some(found.clone());
                    *count = 1;
                    return true;
                }
                if value.as_ref() != Some(found) {
                    return false;
                }
                *count += 1;
                true
            }
            ConstraintState::Distinct {
                requests,
                attribute,
                values,
            } => {
                if !Self::applies(requests, base, sub) {
                    return true;
                }
                let Some(found) = lookup_attribute(&device.attributes, driver, attribute) else {
                    return false;
                };
                if values.contains(found) {
                    return false;
                }
                values.push(found.clone());
                true
            }
        }
    }

    fn remove(&mut self, base: &str, sub: Option<&str>) {
        match self {
            ConstraintState::Match { requests, count, .. } => {
                if Self::applies(requests, base, sub) {
                    *count -= 1;
                }
            }
            ConstraintState::Distinct { requests, values, .. } => {
                if Self::applies(requests, base, sub) {
                    values.pop();
                }
            }
        }
    }
}

struct Search<'a> {
    cluster: &'a ClusterState,
    usage: &'a WorkingSet,
    node: &'a Node,
    claims: &'a [ClaimRef<'a>],
    pools: Vec<Pool>,
    requests: FxHashMap<RequestKey, RequestData<'a>>,
    selected_sub: FxHashMap<(usize, usize), usize>,
    constraints: Vec<Vec<ConstraintState>>,
    /// Devices taken exclusively by this search, and by which claims.
    allocating: FxHashMap<DeviceId, BTreeSet<usize>>,
    allocating_capacity: FxHashMap<DeviceId, BTreeMap<String, Quantity>>,
    consumed_counters: FxHashMap<usize, BTreeMap<String, BTreeMap<String, Quantity>>>,
    available_counters: FxHashMap<usize, BTreeMap<String, BTreeMap<String, Quantity>>>,
    results: Vec<Vec<Chosen>>,
    steps_left: u64,
}

impl<'a> Search<'a> {
    fn new(
        cluster: &'a ClusterState,
        usage: &'a WorkingSet,
        node: &'a Node,
        claims: &'a [ClaimRef<'a>],
        pools: Vec<Pool>,
    ) -> Result<Self, AllocationError> {
        let mut search = Search {
            cluster,
            usage,
            node,
            claims,
            pools,
            requests: FxHashMap::default(),
            selected_sub: FxHashMap::default(),
            constraints: Vec::new(),
            allocating: FxHashMap::default(),
            allocating_capacity: FxHashMap::default(),
            consumed_counters: FxHashMap::default(),
            available_counters: FxHashMap::default(),
            results: claims.iter().map(|_| Vec::new()).collect(),
            steps_left: 0,
        };
        for (claim_index, claim) in claims.iter().enumerate() {
            let mut min_devices = 0usize;
            for (request_index, request) in claim.spec.requests.iter().enumerate() {
                let key = RequestKey {
                    claim: claim_index,
                    request: request_index,
                    sub: 0,
                };
                let min_for_request = match request {
                    DeviceRequest::Exactly(spec) => {
                        let data = search.request_data(claim, spec, None)?;
                        let n = data.num_devices;
                        search.requests.insert(key, data);
                        n
                    }
                    DeviceRequest::FirstAvailable { name, subrequests } => {
                        let mut min = usize::MAX;
                        for (sub, spec) in subrequests.iter().enumerate() {
                            let key = RequestKey { sub, ..key };
                            let data = search.request_data(claim, spec, Some(name))?;
                            min = min.min(data.num_devices);
                            search.requests.insert(key, data);
                        }
                        if subrequests.is_empty() { 0 } else { min }
                    }
                };
                if min_for_request > MAX_ALLOCATION_RESULTS.saturating_sub(min_devices) {
                    return Err(error(format!(
                        "claim {}: number of requested devices {} exceeds the claim limit of {MAX_ALLOCATION_RESULTS}",
                        claim.key,
                        min_devices + min_for_request
                    )));
                }
                min_devices += min_for_request;
            }
            let constraints = claim
                .spec
                .constraints
                .iter()
                .map(|c| {
                    let requests = c.requests.iter().cloned().collect();
                    match &c.kind {
                        ConstraintKind::MatchAttribute(attribute) => ConstraintState::Match {
                            requests,
                            attribute: attribute.clone(),
                            value: None,
                            count: 0,
                        },
                        ConstraintKind::DistinctAttribute(attribute) => ConstraintState::Distinct {
                            requests,
                            attribute: attribute.clone(),
                            values: Vec::new(),
                        },
                    }
                })
                .collect();
            search.constraints.push(constraints);
        }
        Ok(search)
    }

    fn request_data(
        &mut self,
        claim: &ClaimRef<'a>,
        spec: &'a DeviceRequestSpec,
        parent: Option<&'a str>,
    ) -> Result<RequestData<'a>, AllocationError> {
        let request_name = parent
            .map(|p| format!("{p}/{}", spec.name))
            .unwrap_or_else(|| spec.name.clone());
        if spec.device_class_name.is_empty() {
            return Err(error(format!(
                "claim {}, request {request_name}: missing device class name",
                claim.key
            )));
        }
        let (matcher, class) = Matcher::new(self.cluster, claim.key, &request_name, spec)?;
        let mut data = RequestData {
            spec,
            parent,
            class,
            matcher,
            num_devices: 0,
            all_devices: Vec::new(),
        };
        match spec.allocation_mode {
            AllocationMode::ExactCount => data.num_devices = spec.count.max(1) as usize,
            AllocationMode::All => {
                for (pool_index, pool) in self.pools.iter().enumerate() {
                    if pool.incomplete {
                        return Err(error(format!(
                            "claim {}, request {request_name}: asks for all devices, but resource pool {}/{} is currently being updated",
                            claim.key, pool.driver, pool.name
                        )));
                    }
                    if let Some(reason) = &pool.invalid {
                        return Err(error(format!(
                            "claim {}, request {request_name}: asks for all devices, but resource pool {}/{} is currently invalid: {reason}",
                            claim.key, pool.driver, pool.name
                        )));
                    }
                    for (slice_index, slice) in pool.slices.iter().enumerate() {
                        for device_index in 0..slice.devices.len() {
                            if !data
                                .matcher
                                .matches(self.cluster, claim.key, slice, device_index, self.node)?
                            {
                                continue;
                            }
                            let device = &slice.devices[device_index];
                            if !capacity_fits(&BTreeMap::new(), &spec.capacity, device, &BTreeMap::new())? {
                                continue;
                            }
                            data.all_devices.push((pool_index, slice_index, device_index));
                        }
                    }
                }
                data.num_devices = data.all_devices.len();
            }
        }
        Ok(data)
    }

    fn device_in_use(&self, id: &DeviceId) -> bool {
        self.usage.allocated(self.cluster, id) || self.allocating.get(id).is_some_and(|c| !c.is_empty())
    }

    fn allocating_for_claim(&self, id: &DeviceId, claim: usize) -> bool {
        self.allocating.get(id).is_some_and(|c| c.contains(&claim))
    }

    fn allocate_one(&mut self, r: Position, allocate_sub: bool, start: Location) -> Result<bool, Stop> {
        if self.steps_left == 0 {
            return Err(Stop::Budget);
        }
        self.steps_left -= 1;

        if r.claim >= self.claims.len() {
            return Ok(true);
        }
        let claim = self.claims[r.claim];
        if r.request >= claim.spec.requests.len() {
            return match self.allocate_one(
                Position {
                    claim: r.claim + 1,
                    ..Default::default()
                },
                false,
                Location::default(),
            ) {
                Err(Stop::MaxResults) => Ok(false),
                other => other,
            };
        }
        let key = RequestKey {
            claim: r.claim,
            request: r.request,
            sub: r.sub,
        };
        let is_sub = self.requests.get(&key).is_some_and(|d| d.parent.is_some());
        if !allocate_sub && is_sub {
            let mut all_exceeded = true;
            for sub in 0.. {
                if !self.requests.contains_key(&RequestKey { sub, ..key }) {
                    return if all_exceeded { Err(Stop::MaxResults) } else { Ok(false) };
                }
                match self.allocate_one(Position { sub, ..r }, true, Location::default()) {
                    Err(Stop::MaxResults) => continue,
                    Err(e) => return Err(e),
                    Ok(found) => {
                        all_exceeded = false;
                        if found {
                            self.selected_sub.insert((r.claim, r.request), sub);
                            return Ok(true);
                        }
                    }
                }
            }
        }

        let (num_devices, all_mode) = {
            let data = &self.requests[&key];
            (data.num_devices, data.spec.allocation_mode == AllocationMode::All)
        };
        if all_mode && num_devices == 0 {
            return Ok(false);
        }
        if r.device >= num_devices {
            return self.allocate_one(
                Position {
                    claim: r.claim,
                    request: r.request + 1,
                    ..Default::default()
                },
                false,
                Location::default(),
            );
        }
        let remaining = num_devices - r.device;
        let available = MAX_ALLOCATION_RESULTS - self.results[r.claim].len();
        if remaining > available {
            return Err(Stop::MaxResults);
        }

        let next = Position {
            device: r.device + 1,
            ..r
        };
        if all_mode {
            let (pool_index, slice_index, device_index) = self.requests[&key].all_devices[r.device];
            if !self.allocate_device(r, key, pool_index, slice_index, device_index, true)? {
                return Ok(false);
            }
            let done = self.allocate_one(next, allocate_sub, Location::default());
            if !matches!(done, Ok(true)) {
                self.undo_last(r.claim);
            }
            return done;
        }

        let admin = self.requests[&key].spec.admin_access;
        for pool_index in start.pool..self.pools.len() {
            let pool = &self.pools[pool_index];
            if pool.incomplete || pool.invalid.is_some() {
                continue;
            }
            let slice_start = if pool_index == start.pool { start.slice } else { 0 };
            for slice_index in slice_start..self.pools[pool_index].slices.len() {
                let slice = self.pools[pool_index].slices[slice_index].clone();
                let device_start = if pool_index == start.pool && slice_index == start.slice {
                    start.device
                } else {
                    0
                };
                for device_index in device_start..slice.devices.len() {
                    let id = DeviceId {
                        driver: slice.driver.clone(),
                        pool: slice.pool.clone(),
                        device: slice.devices[device_index].name.clone(),
                    };
                    if admin && self.allocating_for_claim(&id, r.claim) {
                        continue;
                    }
                    if !admin && self.device_in_use(&id) {
                        continue;
                    }
                    let selectable = self.requests[&key].matcher.matches(
                        self.cluster,
                        claim.key,
                        &slice,
                        device_index,
                        self.node,
                    )?;
                    if !selectable {
                        continue;
                    }
                    let consumed = self.current_consumption(&id);
                    let fits = capacity_fits(
                        &consumed,
                        &self.requests[&key].spec.capacity,
                        &slice.devices[device_index],
                        self.allocating_capacity.get(&id).unwrap_or(&BTreeMap::new()),
                    )?;
                    if !fits {
                        continue;
                    }
                    if !self.allocate_device(r, key, pool_index, slice_index, device_index, false)? {
                        continue;
                    }
                    let location = Location {
                        pool: pool_index,
                        slice: slice_index,
                        device: device_index + 1,
                    };
                    match self.allocate_one(next, allocate_sub, location) {
                        Ok(true) => return Ok(true),
                        Ok(false) => self.undo_last(r.claim),
                        Err(e) => {
                            self.undo_last(r.claim);
                            return Err(e);
                        }
                    }
                }
            }
        }
        Ok(false)
    }

    /// Capacity consumed on a device by the cluster and earlier plan steps (not this
    /// search, which [`Search::allocating_capacity`] tracks).
    fn current_consumption(&self, id: &DeviceId) -> BTreeMap<String, Quantity> {
        self.usage.consumed(self.cluster, id)
    }

    /// Takes one device for a request. `must`: the request wants all devices (mode All),
    /// where a constraint that rejects a device is an error, as upstream.
    fn allocate_device(
        &mut self,
        r: Position,
        key: RequestKey,
        pool_index: usize,
        slice_index: usize,
        device_index: usize,
        must: bool,
    ) -> Result<bool, Stop> {
        let slice = self.pools[pool_index].slices[slice_index].clone();
        let device = &slice.devices[device_index];
        let id = DeviceId {
            driver: slice.driver.clone(),
            pool: slice.pool.clone(),
            device: device.name.clone(),
        };
        let (admin, base, sub, request_name, tolerations_ok, capacity_request) = {
            let data = &self.requests[&key];
            let (base, sub) = match data.parent {
                Some(parent) => (parent.to_string(), Some(data.spec.name.clone())),
                None => (data.spec.name.clone(), None),
            };
            let tolerated = device
                .taints
                .iter()
                .chain(self.cluster.rule_taints(&slice.driver, &slice.pool, &device.name))
                .filter(|t| matches!(t.effect, TaintEffect::NoSchedule | TaintEffect::NoExecute))
                .all(|t| data.spec.tolerations.iter().any(|tol| tol.tolerates(t)));
            (
                data.spec.admin_access,
                base,
                sub,
                data.name(),
                tolerated,
                data.spec.capacity.clone(),
            )
        };
        if !self.usage.permits(&id) {
            return Ok(false);
        }
        let multiple = device.allow_multiple_allocations;
        if !multiple && admin && self.allocating_for_claim(&id, r.claim) {
            return Ok(false);
        }
        if !admin && self.device_in_use(&id) {
            return Ok(false);
        }

        let skip_counters = multiple && self.capacity_in_use(&id);
        let mut counters_reserved = false;
        if !skip_counters && !device.consumes_counters.is_empty() {
            if !self.reserve_counters(pool_index, device) {
                return Ok(false);
            }
            counters_reserved = true;
        }
        let rollback_counters = |search: &mut Self| {
            if counters_reserved {
                search.release_counters(pool_index, device);
            }
        };

        if !tolerations_ok {
            rollback_counters(self);
            return Ok(false);
        }

        let mut added = 0;
        let mut rejected = false;
        for constraint in &mut self.constraints[r.claim] {
            if !constraint.add(&base, sub.as_deref(), &slice.driver, device) {
                rejected = true;
                break;
            }
            added += 1;
        }
        if rejected {
            for constraint in self.constraints[r.claim][..added].iter_mut().rev() {
                constraint.remove(&base, sub.as_deref());
            }
            rollback_counters(self);
            if must {
                // A claim whose constraint prevents getting all devices makes no sense:
                // upstream treats it as an error.
                return Err(Stop::Fatal(error(format!(
                    "claim {}, request {}: cannot add device {id} because a claim constraint would not be satisfied",
                    self.claims[r.claim].key, self.requests[&key].spec.name
                ))));
            }
            return Ok(false);
        }

        if !multiple {
            self.allocating.entry(id.clone()).or_default().insert(r.claim);
        }
        let mut consumed = BTreeMap::new();
        let mut share_id = None;
        let consumption = self.current_consumption(&id);
        let fits = capacity_fits(
            &consumption,
            &capacity_request,
            device,
            self.allocating_capacity.get(&id).unwrap_or(&BTreeMap::new()),
        );
        match fits {
            Ok(true) => {}
            other => {
                if !multiple && let Some(claims) = self.allocating.get_mut(&id) {
                    claims.remove(&r.claim);
                }
                for constraint in self.constraints[r.claim].iter_mut().rev() {
                    constraint.remove(&base, sub.as_deref());
                }
                rollback_counters(self);
                return other.map_err(Stop::from);
            }
        }
        if multiple {
            consumed = consumed_from_request(&capacity_request, &device.capacity)?;
            let entry = self.allocating_capacity.entry(id.clone()).or_default();
            for (name, value) in &consumed {
                let t = entry.entry(name.clone()).or_insert(Quantity::ZERO);
                *t = t.checked_add(value).unwrap_or(*t);
            }
            share_id = Some(share_id_for(self.claims[r.claim].key, &id, self.results[r.claim].len()));
        }
        self.results[r.claim].push(Chosen {
            request: request_name,
            base_request: base,
            sub_request: sub,
            id,
            slice: slice.clone(),
            device_index,
            admin_access: admin,
            share_id,
            consumed,
            counters_reserved,
            key,
        });
        Ok(true)
    }

    /// Undoes the last [`Search::allocate_device`] of a claim.
    fn undo_last(&mut self, claim: usize) {
        let Some(chosen) = self.results[claim].pop() else {
            return;
        };
        let device = &chosen.slice.devices[chosen.device_index];
        if device.allow_multiple_allocations {
            if let Some(entry) = self.allocating_capacity.get_mut(&chosen.id) {
                for (name, value) in &chosen.consumed {
                    if let Some(t) = entry.get_mut(name) {
                        *t = t.checked_sub(value).unwrap_or(*t);
                    }
                }
                if self.results.iter().flatten().all(|c| c.id != chosen.id) {
                    self.allocating_capacity.remove(&chosen.id);
                }
            }
        } else if let Some(claims) = self.allocating.get_mut(&chosen.id) {
            claims.remove(&claim);
        }
        for constraint in self.constraints[claim].iter_mut().rev() {
            constraint.remove(&chosen.base_request, chosen.sub_request.as_deref());
        }
        if chosen.counters_reserved {
            let pool_index = self
                .pools
                .iter()
                .position(|p| p.driver == chosen.id.driver && p.name == chosen.id.pool);
            if let Some(pool_index) = pool_index {
                self.release_counters(pool_index, device);
            }
        }
    }

    fn capacity_in_use(&self, id: &DeviceId) -> bool {
        self.usage.capacity_in_use(self.cluster, id) || self.allocating_capacity.contains_key(id)
    }

    fn available_counters(&mut self, pool_index: usize) -> BTreeMap<String, BTreeMap<String, Quantity>> {
        if let Some(available) = self.available_counters.get(&pool_index) {
            return available.clone();
        }
        let pool = &self.pools[pool_index];
        let mut available: BTreeMap<String, BTreeMap<String, Quantity>> = pool
            .counter_sets
            .iter()
            .map(|(name, set)| (name.clone(), set.counters.clone()))
            .collect();
        for slice in pool.slices.iter().chain(pool.other_slices.iter()) {
            for device in &slice.devices {
                let id = DeviceId {
                    driver: slice.driver.clone(),
                    pool: slice.pool.clone(),
                    device: device.name.clone(),
                };
                if !self.usage.in_any_use(self.cluster, &id) {
                    continue;
                }
                for consumption in &device.consumes_counters {
                    if let Some(set) = available.get_mut(&consumption.counter_set) {
                        for (name, value) in &consumption.counters {
                            if let Some(counter) = set.get_mut(name) {
                                *counter = counter.checked_sub(value).unwrap_or(*counter);
                            }
                        }
                    }
                }
            }
        }
        self.available_counters.insert(pool_index, available.clone());
        available
    }

    fn reserve_counters(&mut self, pool_index: usize, device: &Device) -> bool {
        let available = self.available_counters(pool_index);
        let consumed = self.consumed_counters.entry(pool_index).or_default();
        for consumption in &device.consumes_counters {
            let set = consumed.entry(consumption.counter_set.clone()).or_default();
            for (name, value) in &consumption.counters {
                let t = set.entry(name.clone()).or_insert(Quantity::ZERO);
                *t = t.checked_add(value).unwrap_or(*t);
            }
        }
        let fits = available.iter().all(|(set_name, counters)| {
            counters.iter().all(|(name, value)| {
                let used = consumed
                    .get(set_name)
                    .and_then(|s| s.get(name))
                    .copied()
                    .unwrap_or(Quantity::ZERO);
                *value >= used
            })
        });
        if !fits {
            self.release_counters(pool_index, device);
        }
        fits
    }

    fn release_counters(&mut self, pool_index: usize, device: &Device) {
        if let Some(consumed) = self.consumed_counters.get_mut(&pool_index) {
            for consumption in &device.consumes_counters {
                if let Some(set) = consumed.get_mut(&consumption.counter_set) {
                    for (name, value) in &consumption.counters {
                        if let Some(t) = set.get_mut(name) {
                            *t = t.checked_sub(value).unwrap_or(*t);
                        }
                    }
                }
            }
        }
    }

    fn build_results(&self) -> Vec<Allocation> {
        let mut allocations = Vec::with_capacity(self.claims.len());
        for (claim_index, claim) in self.claims.iter().enumerate() {
            let chosen = &self.results[claim_index];
            let devices: Vec<DeviceResult> = chosen
                .iter()
                .map(|c| {
                    let device = &c.slice.devices[c.device_index];
                    let data = &self.requests[&c.key];
                    DeviceResult {
                        request: c.request.clone(),
                        driver: c.id.driver.clone(),
                        pool: c.id.pool.clone(),
                        device: c.id.device.clone(),
                        admin_access: c.admin_access.then_some(true),
                        tolerations: data.spec.tolerations.clone(),
                        binding_conditions: device.binding_conditions.clone(),
                        binding_failure_conditions: device.binding_failure_conditions.clone(),
                        share_id: c.share_id.clone(),
                        consumed_capacity: c.consumed.clone(),
                    }
                })
                .collect();

            // Class configuration first, once per class, then the claim's.
            let mut config: Vec<AllocatedConfig> = Vec::new();
            let mut class_ranges: FxHashMap<String, (usize, usize)> = FxHashMap::default();
            for (request_index, _) in claim.spec.requests.iter().enumerate() {
                let sub = self
                    .selected_sub
                    .get(&(claim_index, request_index))
                    .copied()
                    .unwrap_or(0);
                let Some(data) = self.requests.get(&RequestKey {
                    claim: claim_index,
                    request: request_index,
                    sub,
                }) else {
                    continue;
                };
                let name = data.name();
                if let Some((start, end)) = class_ranges.get(&data.class.name) {
                    for entry in &mut config[*start..*end] {
                        entry.requests.push(name.clone());
                    }
                    continue;
                }
                let start = config.len();
                for opaque in &data.class.config {
                    config.push(AllocatedConfig {
                        source: ConfigSource::FromClass,
                        requests: vec![name.clone()],
                        opaque: opaque.clone(),
                    });
                }
                class_ranges.insert(data.class.name.clone(), (start, config.len()));
            }
            for entry in &claim.spec.config {
                if entry.requests.is_empty() {
                    config.push(AllocatedConfig {
                        source: ConfigSource::FromClaim,
                        requests: vec![],
                        opaque: entry.opaque.clone(),
                    });
                    continue;
                }
                for (request_index, request) in claim.spec.requests.iter().enumerate() {
                    let applies = entry.requests.iter().any(|r| r == request.name())
                        || match request {
                            DeviceRequest::FirstAvailable { name, subrequests } => {
                                let sub = self
                                    .selected_sub
                                    .get(&(claim_index, request_index))
                                    .copied()
                                    .unwrap_or(0);
                                subrequests
                                    .get(sub)
                                    .is_some_and(|s| entry.requests.contains(&format!("{name}/{}", s.name)))
                            }
                            DeviceRequest::Exactly(_) => false,
                        };
                    if applies {
                        config.push(AllocatedConfig {
                            source: ConfigSource::FromClaim,
                            requests: entry.requests.clone(),
                            opaque: entry.opaque.clone(),
                        });
                        break;
                    }
                }
            }
            for entry in &mut config {
                if entry.requests.is_empty() {
                    continue;
                }
                let all = claim.spec.requests.iter().enumerate().all(|(request_index, request)| {
                    entry.requests.iter().any(|r| r == request.name())
                        || match request {
                            DeviceRequest::FirstAvailable { name, subrequests } => {
                                let sub = self
                                    .selected_sub
                                    .get(&(claim_index, request_index))
                                    .copied()
                                    .unwrap_or(0);
                                subrequests
                                    .get(sub)
                                    .is_some_and(|s| entry.requests.contains(&format!("{name}/{}", s.name)))
                            }
                            DeviceRequest::Exactly(_) => false,
                        }
                });
                if all {
                    entry.requests.clear();
                }
            }

            allocations.push(Allocation {
                devices,
                config,
                node_selector: self.node_selector(chosen),
            });
        }
        allocations
    }

    /// upstream `createNodeSelector`.
    fn node_selector(&self, chosen: &[Chosen]) -> Option<NodeSelector> {
        let mut term = Term::default();
        for c in chosen {
            let device = &c.slice.devices[c.device_index];
            let (node_name, selector) = match (&c.slice.nodes, &device.nodes) {
                (SliceNodes::PerDevice, Some(crate::cluster::DeviceNodes::Node(n))) => (Some(n.clone()), None),
                (SliceNodes::PerDevice, Some(crate::cluster::DeviceNodes::Selector(s))) => (None, Some(s.clone())),
                (SliceNodes::PerDevice, _) => (None, None),
                (SliceNodes::Node(n), _) => (Some(n.clone()), None),
                (SliceNodes::Selector(s), _) => (None, Some(s.clone())),
                (SliceNodes::All, _) => (None, None),
            };
            if node_name.is_some() || device.binds_to_node {
                return Some(NodeSelector::for_node(&self.node.name));
            }
            if let Some(first) = selector.as_ref().and_then(|s| s.terms.first()) {
                {
                    for requirement in &first.match_fields {
                        if !term.match_fields.iter().any(|r| r.equivalent(requirement)) {
                            term.match_fields.push(requirement.clone());
                        }
                    }
                    for requirement in &first.match_expressions {
                        if !term.match_expressions.iter().any(|r| r.equivalent(requirement)) {
                            term.match_expressions.push(requirement.clone());
                        }
                    }
                }
            }
        }
        (!term.match_fields.is_empty() || !term.match_expressions.is_empty())
            .then(|| NodeSelector { terms: vec![term] })
    }
}

/// A deterministic UID-shaped share ID for a shared allocation of `device` to a claim.
fn share_id_for(claim: &str, device: &DeviceId, index: usize) -> String {
    let text = format!("{claim}\u{0}{device}\u{0}{index}");
    let (a, b) = (
        fnv(text.as_bytes(), 0xcbf2_9ce4_8422_2325),
        fnv(text.as_bytes(), 0x8422_2325_cbf2_9ce4),
    );
    let hex = format!("{a:016x}{b:016x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

fn fnv(bytes: &[u8], seed: u64) -> u64 {
    bytes
        .iter()
        .fold(seed, |hash, b| (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

// ---- consumable capacity (upstream consumable_capacity.go) ----

/// Whether a device can take `request` on top of what is consumed (`consumed` by
/// others, `allocating` by this search).
fn capacity_fits(
    consumed: &BTreeMap<String, Quantity>,
    request: &BTreeMap<String, Quantity>,
    device: &Device,
    allocating: &BTreeMap<String, Quantity>,
) -> Result<bool, AllocationError> {
    if request.keys().any(|name| !device.capacity.contains_key(name)) {
        return Ok(false);
    }
    for (name, capacity) in &device.capacity {
        let wanted =
            consumed_amount(request.get(name), capacity).map_err(|e| error(format!("capacity {name:?}: {e}")))?;
        if wanted.sign() < 0 {
            return Err(error(format!("capacity {name:?}: capacity value is negative")));
        }
        if violates_policy(&wanted, capacity) {
            return Ok(false);
        }
        let mut total = consumed.get(name).copied().unwrap_or(Quantity::ZERO);
        total = total.checked_add(&wanted).map_err(|e| error(e.to_string()))?;
        if let Some(extra) = allocating.get(name) {
            total = total.checked_add(extra).map_err(|e| error(e.to_string()))?;
        }
        if total > capacity.value {
            return Ok(false);
        }
    }
    Ok(true)
}

fn consumed_from_request(
    request: &BTreeMap<String, Quantity>,
    capacities: &crate::device::Capacities,
) -> Result<BTreeMap<String, Quantity>, AllocationError> {
    capacities
        .iter()
        .map(|(name, capacity)| {
            consumed_amount(request.get(name), capacity)
                .map(|q| (name.clone(), q))
                .map_err(|e| error(format!("capacity {name:?}: {e}")))
        })
        .collect()
}

/// What a request consumes of one capacity: the policy default (or everything) when
/// not asked, otherwise the request rounded up to the policy's valid values or range.
fn consumed_amount(requested: Option<&Quantity>, capacity: &Capacity) -> Result<Quantity, String> {
    let Some(requested) = requested else {
        return Ok(capacity
            .request_policy
            .as_ref()
            .and_then(|p| p.default)
            .unwrap_or(capacity.value));
    };
    let Some(policy) = &capacity.request_policy else {
        return Ok(*requested);
    };
    if let Some(range) = &policy.valid_range {
        if *requested < range.min {
            return Ok(range.min);
        }
        let Some(step) = range.step else { return Ok(*requested) };
        if step.sign() <= 0 {
            return Err("capacity request cannot be represented in the device's range arithmetic".into());
        }
        // Whole units, rounded up, as upstream does without fractional ranges.
        let (req, min, step) = (requested.value(), range.min.value(), step.value());
        if step <= 0 {
            return Err("capacity request cannot be represented in the device's range arithmetic".into());
        }
        let added = req - min;
        let mut n = added / step;
        if added % step != 0 {
            n += 1;
        }
        let units = i64::try_from(min + step * n).map_err(|_| "rounding passes the integer range".to_string())?;
        return Ok(Quantity::from_units(
            units,
            range
                .step
                .map(|s| s.format())
                .unwrap_or(crate::quantity::Format::DecimalSI),
        ));
    }
    if !policy.valid_values.is_empty() {
        return Ok(policy
            .valid_values
            .iter()
            .find(|v| *requested <= **v)
            .copied()
            .unwrap_or(*requested));
    }
    Ok(*requested)
}

fn violates_policy(amount: &Quantity, capacity: &Capacity) -> bool {
    let Some(policy) = &capacity.request_policy else {
        return false;
    };
    if policy.default.as_ref() == Some(amount) {
        return false;
    }
    if let Some(range) = &policy.valid_range {
        if range.max.is_some_and(|max| *amount > max) {
            return true;
        }
        if let Some(step) = range.step {
            let step = step.value();
            if step > 0 && (amount.value() - range.min.value()) % step != 0 {
                return true;
            }
        }
        return false;
    }
    if !policy.valid_values.is_empty() {
        return !policy.valid_values.contains(amount);
    }
    false
}

#[cfg(test)]
mod tests;
