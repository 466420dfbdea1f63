//! The engine's picture of the cluster: nodes, the resources pods use on them,
//! ResourceSlices, DeviceClasses and the devices claims hold. Kept up to date
//! incrementally (`upsert_*` / `remove_*`), so a decision never rebuilds it.
//!
//! Plans not yet visible in the cluster are *assumed*: their pods and allocations are
//! entered under the same keys the watch will later report, so assuming and then seeing
//! the real objects never counts anything twice, and `forget` undoes an assumption.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rustc_hash::FxHashMap;

use crate::claim::{DeviceId, DeviceResult, DeviceTaint, OpaqueConfig};
use crate::device::{Attributes, Capacities};
use crate::key::{ClaimKey, ObjectKey, PodKey};
use crate::ledger::{DeviceLedger, holds_device};
use crate::pod::PodTraits;
use crate::quantity::Quantity;
use crate::resources::Resources;
use crate::selector::{NodeSelector, Taint};
use crate::storage::Storage;

/// A node.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Node {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
    pub unschedulable: bool,
    pub allocatable: Resources,
}

/// Which nodes a slice's devices are available on.
#[derive(Clone, Debug, PartialEq)]
pub enum SliceNodes {
    /// `nodeName`: devices local to one node.
    Node(String),
    /// `nodeSelector` (one term).
    Selector(NodeSelector),
    /// `allNodes: true`.
    All,
    /// `perDeviceNodeSelection: true`: each device says.
    PerDevice,
}

/// Per-device node selection, with `perDeviceNodeSelection`.
#[derive(Clone, Debug, PartialEq)]
pub enum DeviceNodes {
    Node(String),
    Selector(NodeSelector),
    All,
}

/// A set of counters a pool shares among partitionable devices.
#[derive(Clone, Debug, PartialEq)]
pub struct CounterSet {
    pub name: String,
    pub counters: BTreeMap<String, Quantity>,
}

/// Counters a device consumes from one counter set.
#[derive(Clone, Debug, PartialEq)]
pub struct CounterConsumption {
    pub counter_set: String,
    pub counters: BTreeMap<String, Quantity>,
}

/// A device as published in a slice.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Device {
    pub name: String,
    pub attributes: Attributes,
    pub capacity: Capacities,
    pub consumes_counters: Vec<CounterConsumption>,
    /// Only with [`SliceNodes::PerDevice`].
    pub nodes: Option<DeviceNodes>,
    pub taints: Vec<DeviceTaint>,
    pub binds_to_node: bool,
    pub binding_conditions: Vec<String>,
    pub binding_failure_conditions: Vec<String>,
    pub allow_multiple_allocations: bool,
}

/// A ResourceSlice.
#[derive(Clone, Debug, PartialEq)]
pub struct Slice {
    pub name: String,
    pub driver: String,
    pub pool: String,
    pub generation: i64,
    pub resource_slice_count: i64,
    pub nodes: SliceNodes,
    pub devices: Vec<Device>,
    pub shared_counters: Vec<CounterSet>,
}

/// A DeviceClass.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct DeviceClass {
    pub name: String,
    pub selectors: Vec<String>,
    pub config: Vec<OpaqueConfig>,
    /// `spec.extendedResourceName`: the extended resource pods may ask for to get
    /// devices of this class (besides the implicit `deviceclass.resource.kubernetes.io/<name>`).
    pub extended_resource_name: Option<String>,
}

/// Devices one claim holds.
#[derive(Clone, Debug, PartialEq, Default)]
struct HeldDevices {
    devices: Vec<DeviceResult>,
}

/// Whether a device matched a selector set, or the evaluation error.
pub(crate) type MatchOutcome = Result<bool, String>;

/// A slice's version, and how each of its devices matched a selector set on it.
type LearnedMatches = (u64, Vec<Option<MatchOutcome>>);

/// How a slice's devices matched selectors before, for the version of the slice they
/// were learned on (see [`ClusterState::slice_version`]): an entry of another version
/// is not used, and is replaced by the next one learned.
#[derive(Default, Debug, Clone)]
pub(crate) struct MatchCache {
    /// Selector set → slice name → slice version and, per device: matches, or the
    /// evaluation error.
    entries: FxHashMap<usize, FxHashMap<String, LearnedMatches>>,
    /// Interned selector sets.
    sets: FxHashMap<Vec<String>, usize>,
}

impl MatchCache {
    pub(crate) fn set_id(&mut self, selectors: &[String]) -> usize {
        if let Some(id) = self.sets.get(selectors) {
            return *id;
        }
        let id = self.sets.len();
        self.sets.insert(selectors.to_vec(), id);
        id
    }

    pub(crate) fn get(&self, set: usize, slice: &str, version: u64, device: usize) -> Option<Result<bool, String>> {
        let (learned_on, devices) = self.entries.get(&set)?.get(slice)?;
        if *learned_on != version {
            return None;
        }
        devices.get(device)?.clone()
    }

    pub(crate) fn put(
        &mut self,
        set: usize,
        slice: &str,
        version: u64,
        devices: usize,
        device: usize,
        result: Result<bool, String>,
    ) {
        let by_slice = self.entries.entry(set).or_default();
        if by_slice.get(slice).is_none_or(|(learned_on, _)| *learned_on != version) {
            by_slice.insert(slice.to_string(), (version, vec![None; devices]));
        }
        if let Some(slot) = by_slice.get_mut(slice).and_then(|(_, v)| v.get_mut(device)) {
            *slot = Some(result);
        }
    }

    fn forget_slice(&mut self, slice: &str) {
        for by_slice in self.entries.values_mut() {
            by_slice.remove(slice);
        }
    }
}

/// What the planner learned about a node for one pod shape, valid while the node's
/// version is unchanged.
#[derive(Clone, Debug)]
pub(crate) struct CachedRoom {
    pub(crate) version: (u64, u64),
    pub(crate) room: usize,
    pub(crate) free_devices: usize,
    pub(crate) rejection: Option<String>,
    /// An allocator error on this node (a CEL runtime error, say): kube-scheduler fails
    /// the pod if any node reports one.
    pub(crate) error: Option<String>,
}

/// Change counters: a node's own (by node id), and one for everything shared by all
/// nodes.
#[derive(Debug, Default, Clone)]
struct Versions {
    /// The last version given out, shared by a state and every copy made of it: no two
    /// changes in any of them get one number, so a version two copies show for a node
    /// means the same state of it in both (the room cache they share relies on it).
    tick: Arc<AtomicU64>,
    nodes: Vec<u64>,
    shared: u64,
}

impl Versions {
    fn next(&self) -> u64 {
        self.tick.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// What the planner learned of nodes: pod shape → node id → room.
pub(crate) type RoomCache = FxHashMap<String, Vec<Option<CachedRoom>>>;

/// Nodes grouped by the value of a label, with their ids.
pub(crate) type NodeIndex = Vec<(String, Vec<(usize, Arc<Node>)>)>;

/// Label key → the node-set version an index was built at, and the index.
type LabelIndexes = FxHashMap<String, (u64, Arc<NodeIndex>)>;

/// The cluster as the engine knows it. It is `Send + Sync` and cheap to share: a
/// planner can work on a snapshot while the watches move on (see [`Clone`]).
#[derive(Debug, Default)]
pub struct ClusterState {
    nodes: Arc<BTreeMap<String, Arc<Node>>>,
    /// Requests of pods bound or nominated to each node.
    node_usage: FxHashMap<String, Resources>,
    pods: FxHashMap<PodKey, PodEntry>,
    /// The pods on each node, in no order.
    pods_on_node: FxHashMap<String, Vec<PodKey>>,
    /// Pods with required anti-affinity terms, which every plan checks.
    anti_affinity_pods: rustc_hash::FxHashSet<PodKey>,
    /// How many pods on nodes use each PersistentVolumeClaim.
    claim_users: FxHashMap<ObjectKey, u32>,
    /// PersistentVolumes planned pods took for claims not bound yet, with how many.
    volumes_taken: FxHashMap<String, u32>,
    /// Namespace labels, for affinity terms' namespace selectors.
    namespaces: Arc<FxHashMap<String, BTreeMap<String, String>>>,
    storage: Arc<Storage>,
    slices: Arc<BTreeMap<String, Arc<Slice>>>,
    slices_by_node: Arc<FxHashMap<String, BTreeSet<String>>>,
    shared_slices: Arc<BTreeSet<String>>,
    slices_by_pool: Arc<FxHashMap<(String, String), BTreeSet<String>>>,
    classes: Arc<BTreeMap<String, DeviceClass>>,
    /// DeviceTaintRules by name: taints on every device they select.
    taint_rules: Arc<BTreeMap<String, DeviceTaintRule>>,
    claims: FxHashMap<ClaimKey, HeldDevices>,
    /// The devices those claims hold.
    devices: DeviceLedger,
    /// Shared by a state and its copies: what a planner learns on a snapshot serves the
    /// state the watches moved on, for every slice still at the version it learned on.
    pub(crate) match_cache: Arc<Mutex<MatchCache>>,
    /// A version per slice, given out on each change from the counter shared with the
    /// copies (see [`Versions`]), so one number means one content of the slice in all.
    slice_versions: Arc<FxHashMap<String, u64>>,
    /// Compiled CEL selectors by expression text.
    programs: Mutex<FxHashMap<String, Result<crate::cel::Program, String>>>,
    /// Claims assumed by plans, and the pods they placed.
    assumed: FxHashMap<PlanId, AssumedPlan>,
    versions: Versions,
    /// Dense ids for node names, so hot per-node state lives in vectors.
    node_ids: Arc<FxHashMap<String, usize>>,
    /// Pod shape → node id → room, see [`CachedRoom`]. Shared by a state and its copies:
    /// an entry holds the version of the node it was learned at, and versions are never
    /// given out twice among copies (see [`Versions`]), so what a planner learns on a
    /// snapshot serves the state the watches have moved on.
    pub(crate) room_cache: Arc<Mutex<RoomCache>>,
    /// Label key → value → nodes with it, for topology domains; with the node-set
    /// version it was built at. Shared by a state and its copies like the room cache: a
    /// node-set version is never given out twice among them, so an index built on a
    /// snapshot serves the state the watches moved on as long as its nodes are the same.
    label_index: Arc<Mutex<LabelIndexes>>,
    node_set_version: u64,
}

/// A DeviceTaintRule (`resource.k8s.io`): its taint applies to every device the selector
/// matches, as if the driver had published it in the ResourceSlice. An unset field
/// matches everything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceTaintRule {
    pub driver: Option<String>,
    pub pool: Option<String>,
    pub device: Option<String>,
    pub taint: DeviceTaint,
}

impl DeviceTaintRule {
    fn selects(&self, driver: &str, pool: &str, device: &str) -> bool {
        self.driver.as_deref().is_none_or(|d| d == driver)
            && self.pool.as_deref().is_none_or(|p| p == pool)
            && self.device.as_deref().is_none_or(|d| d == device)
    }
}

/// A planned pod as [`ClusterState::assume`] takes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AssumedPod {
    pub pod: PodKey,
    pub node: String,
    /// What the pod takes from the node.
    pub requests: Resources,
    /// What it holds against other pods: labels, anti-affinity, ports, volumes.
    pub traits: Arc<PodTraits>,
}

/// A pod on a node: where, what it takes, and what it holds against others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodEntry {
    pub node: String,
    pub requests: Resources,
    pub traits: Arc<PodTraits>,
}

/// Names a plan [`ClusterState::assume`] entered: a gang's, the one for the pods
/// beyond its minimum that it commits later, while its first plan stands, or the
/// devices and nodes held for a preemptor while its victims go.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PlanId {
    Gang(ObjectKey),
    Extras(ObjectKey),
    Nomination(ObjectKey),
}

/// A planned claim allocation as [`ClusterState::assume`] takes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AssumedClaim {
    pub claim: ClaimKey,
    pub devices: Vec<DeviceResult>,
}

/// What [`ClusterState::evict`] took out of the state, for [`ClusterState::restore`].
#[derive(Debug, Default, Clone)]
pub struct Evicted {
    /// Pods with their node, requests and traits.
    pods: Vec<(PodKey, PodEntry)>,
    /// Claims with the devices they held.
    claims: Vec<(ClaimKey, Vec<DeviceResult>)>,
    plans: Vec<(PlanId, AssumedPlan)>,
}

impl Evicted {
    /// Nothing was taken.
    pub fn is_empty(&self) -> bool {
        self.pods.is_empty() && self.claims.is_empty() && self.plans.is_empty()
    }
}

/// Where a device can be used, as [`ClusterState::device_reach`] finds it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DeviceReach<'a> {
    Node(&'a str),
    Selector(&'a NodeSelector),
    All,
}

#[derive(Debug, Default, Clone)]
struct AssumedPlan {
    pods: Vec<PodKey>,
    claims: Vec<ClaimKey>,
    /// What the watch last reported about the assumed claims meanwhile (absent: no
    /// report), restored by [`ClusterState::forget`].
    observed_claims: FxHashMap<ClaimKey, Option<Vec<DeviceResult>>>,
    /// Likewise for the assumed pods: `Some` bound, `None` not.
    observed_pods: FxHashMap<PodKey, Option<PodEntry>>,
}

/// A cache behind a lock: a poisoned lock only means a planner panicked mid-update,
/// and every cache entry is checked against versions before use.
pub(crate) fn locked<T>(cache: &Mutex<T>) -> MutexGuard<'_, T> {
    cache.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A copy of a cache, or an empty one while a planner is using it: caches only save work.
fn copy_of<T: Clone + Default>(cache: &Mutex<T>) -> Mutex<T> {
    Mutex::new(match cache.try_lock() {
        Ok(guard) => guard.clone(),
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().clone(),
        Err(std::sync::TryLockError::WouldBlock) => T::default(),
    })
}

/// A copy, so that one side can change while the other plans. What seldom changes
/// (nodes, slices, classes, storage) is shared until one side changes it; the match,
/// label and room caches are shared for good, each entry tied to a version no two
/// copies give out for different contents; the compiled selectors come along when free
/// (in use by a planner, the copy starts without them).
impl Clone for ClusterState {
    fn clone(&self) -> Self {
        ClusterState {
            nodes: self.nodes.clone(),
            node_usage: self.node_usage.clone(),
            pods: self.pods.clone(),
            pods_on_node: self.pods_on_node.clone(),
            anti_affinity_pods: self.anti_affinity_pods.clone(),
            claim_users: self.claim_users.clone(),
            volumes_taken: self.volumes_taken.clone(),
            namespaces: self.namespaces.clone(),
            storage: self.storage.clone(),
            slices: self.slices.clone(),
            slices_by_node: self.slices_by_node.clone(),
            shared_slices: self.shared_slices.clone(),
            slices_by_pool: self.slices_by_pool.clone(),
            classes: self.classes.clone(),
            taint_rules: self.taint_rules.clone(),
            claims: self.claims.clone(),
            devices: self.devices.clone(),
            match_cache: self.match_cache.clone(),
            slice_versions: self.slice_versions.clone(),
            programs: copy_of(&self.programs),
            assumed: self.assumed.clone(),
            versions: self.versions.clone(),
            node_ids: self.node_ids.clone(),
            room_cache: self.room_cache.clone(),
            label_index: self.label_index.clone(),
            node_set_version: self.node_set_version,
        }
    }
}

impl ClusterState {
    pub fn new() -> Self {
        Self::default()
    }

    /// The same nodes, devices, classes and taint rules with nothing running and nothing
    /// allocated: what a gang could have if it had the cluster to itself.
    pub fn emptied(&self) -> ClusterState {
        let mut empty = ClusterState::new();
        for node in self.nodes.values() {
            empty.upsert_node((**node).clone());
        }
        for slice in self.slices.values() {
            empty.upsert_slice((**slice).clone());
        }
        for class in self.classes.values() {
            empty.upsert_class(class.clone());
        }
        for (name, rule) in self.taint_rules.iter() {
            empty.upsert_taint_rule(name, rule.clone());
        }
        empty.namespaces = self.namespaces.clone();
        empty.storage = self.storage.clone();
        empty
    }

    // ---- nodes ----

    pub fn upsert_node(&mut self, node: Node) {
        if self.nodes.get(&node.name).is_some_and(|old| **old == node) {
            return;
        }
        self.bump_node(&node.name);
        self.node_set_version = self.versions.next();
        Arc::make_mut(&mut self.nodes).insert(node.name.clone(), Arc::new(node));
    }

    pub fn remove_node(&mut self, name: &str) {
        self.bump_node(name);
        if Arc::make_mut(&mut self.nodes).remove(name).is_some() {
            self.node_set_version = self.versions.next();
        }
    }

    fn node_id(&mut self, node: &str) -> usize {
        if let Some(id) = self.node_ids.get(node) {
            return *id;
        }
        let id = self.node_ids.len();
        Arc::make_mut(&mut self.node_ids).insert(node.to_string(), id);
        self.versions.nodes.push(0);
        id
    }

    fn bump_node(&mut self, node: &str) {
        let id = self.node_id(node);
        self.versions.nodes[id] = self.versions.next();
    }

    fn bump_shared(&mut self) {
        self.versions.shared = self.versions.next();
    }

    /// One past the largest node id given out: per-node vectors of this length hold
    /// every node.
    pub(crate) fn node_id_bound(&self) -> usize {
        self.node_ids.len()
    }

    /// Changes when anything that decides what fits on `node` changes.
    pub(crate) fn node_version(&self, id: usize) -> (u64, u64) {
        (self.versions.nodes.get(id).copied().unwrap_or(0), self.versions.shared)
    }

    /// Nodes by value of a label (sorted by value, then name), built once per change of
    /// the nodes. `None` as key: every node, in one group.
    pub(crate) fn nodes_by_label(&self, key: Option<&str>) -> Arc<NodeIndex> {
        let cache_key = key.unwrap_or("").to_string();
        if let Some((version, index)) = locked(&self.label_index).get(&cache_key)
            && *version == self.node_set_version
        {
            return index.clone();
        }
        let mut groups: BTreeMap<&str, Vec<(usize, Arc<Node>)>> = BTreeMap::new();
        for node in self.nodes.values() {
            let id = self.node_ids[&node.name];
            match key {
                Some(key) => {
                    if let Some(value) = node.labels.get(key) {
                        groups.entry(value).or_default().push((id, node.clone()));
                    }
                }
                None => groups.entry("").or_default().push((id, node.clone())),
            }
        }
        let index = Arc::new(
            groups
                .into_iter()
                .map(|(v, nodes)| (v.to_string(), nodes))
                .collect::<NodeIndex>(),
        );
        locked(&self.label_index).insert(cache_key, (self.node_set_version, index.clone()));
        index
    }

    /// Nodes whose devices or resources a device of this pool affects.
    fn bump_pool(&mut self, driver: &str, pool: &str) {
        let mut nodes = Vec::new();
        let mut shared = false;
        for slice in self.pool_slices(driver, pool) {
            match &slice.nodes {
                SliceNodes::Node(node) => nodes.push(node.clone()),
                _ => shared = true,
            }
        }
        for node in nodes {
            self.bump_node(&node);
        }
        if shared {
            self.bump_shared();
        }
    }

    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.get(name).map(Arc::as_ref)
    }

    pub fn nodes(&self) -> impl Iterator<Item = &Node> {
        self.nodes.values().map(Arc::as_ref)
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Resources requested by pods on `node`.
    pub fn node_usage(&self, node: &str) -> Option<&Resources> {
        self.node_usage.get(node)
    }

    /// Allocatable minus requested.
    pub fn free_resources(&self, node: &Node) -> Resources {
        let mut free = node.allocatable.clone();
        if let Some(used) = self.node_usage.get(&node.name) {
            free.sub(used);
        }
        free
    }

    // ---- pods ----

    /// A pod bound or nominated to `node` uses `requests` there (and holds nothing
    /// against other pods).
    pub fn upsert_pod(&mut self, key: &PodKey, node: &str, requests: Resources) {
        self.place_pod(
            key,
            PodEntry {
                node: node.to_string(),
                requests,
                traits: Arc::default(),
            },
        );
    }

    /// A pod bound or nominated to its node, with what it holds against other pods.
    /// Volumes a plan took for the pod stay taken when the watch reports it on the same
    /// node while some of its claims are not bound yet; once kube-scheduler has bound
    /// them (before it binds the pod), the volumes they got speak for themselves.
    pub fn place_pod(&mut self, key: &PodKey, mut entry: PodEntry) {
        if let Some(old) = self.pods.get(key)
            && old.node == entry.node
            && !old.traits.volumes_taken.is_empty()
            && entry.traits.volumes_taken.is_empty()
            && old
                .traits
                .volumes
                .iter()
                .any(|c| self.storage.claim(c).is_none_or(|claim| !claim.is_bound()))
        {
            let mut traits = (*entry.traits).clone();
            traits.volumes_taken = old.traits.volumes_taken.clone();
            entry.traits = Arc::new(traits);
        }
        self.remove_pod(key);
        self.bump_node(&entry.node);
        self.node_usage
            .entry(entry.node.clone())
            .or_default()
            .add(&entry.requests);
        self.pods_on_node
            .entry(entry.node.clone())
            .or_default()
            .push(key.clone());
        if !entry.traits.anti_affinity.is_empty() {
            self.anti_affinity_pods.insert(key.clone());
        }
        for claim in &entry.traits.volumes {
            *self.claim_users.entry(claim.clone()).or_default() += 1;
        }
        for volume in &entry.traits.volumes_taken {
            *self.volumes_taken.entry(volume.clone()).or_default() += 1;
        }
        self.pods.insert(key.clone(), entry);
    }

    pub fn remove_pod(&mut self, key: &PodKey) {
        if let Some(entry) = self.pods.remove(key) {
            if let Some(usage) = self.node_usage.get_mut(&entry.node) {
                usage.sub(&entry.requests);
            }
            if let Some(keys) = self.pods_on_node.get_mut(&entry.node) {
                keys.retain(|k| k != key);
                if keys.is_empty() {
                    self.pods_on_node.remove(&entry.node);
                }
            }
            self.anti_affinity_pods.remove(key);
            for claim in &entry.traits.volumes {
                if let Some(users) = self.claim_users.get_mut(claim) {
                    *users -= 1;
                    if *users == 0 {
                        self.claim_users.remove(claim);
                    }
                }
            }
            for volume in &entry.traits.volumes_taken {
                if let Some(users) = self.volumes_taken.get_mut(volume) {
                    *users -= 1;
                    if *users == 0 {
                        self.volumes_taken.remove(volume);
                    }
                }
            }
            self.bump_node(&entry.node);
        }
    }

    /// The node a pod uses resources on.
    pub fn pod_node(&self, key: &PodKey) -> Option<&str> {
        self.pods.get(key).map(|entry| entry.node.as_str())
    }

    /// A pod on a node.
    pub fn pod(&self, key: &PodKey) -> Option<&PodEntry> {
        self.pods.get(key)
    }

    /// Every pod on a node, in no particular order.
    pub fn pods(&self) -> impl Iterator<Item = (&PodKey, &PodEntry)> {
        self.pods.iter()
    }

    /// The pods on `node`, in no particular order.
    pub fn pods_on(&self, node: &str) -> impl Iterator<Item = (&PodKey, &PodEntry)> {
        self.pods_on_node
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|key| self.pods.get(key).map(|entry| (key, entry)))
    }

    /// Pods with required anti-affinity terms, in no particular order.
    pub fn pods_with_anti_affinity(&self) -> impl Iterator<Item = (&PodKey, &PodEntry)> {
        self.anti_affinity_pods
            .iter()
            .filter_map(|key| self.pods.get(key).map(|entry| (key, entry)))
    }

    /// Whether any pod on a node uses the PersistentVolumeClaim.
    pub fn claim_in_use(&self, claim: &ObjectKey) -> bool {
        self.claim_users.contains_key(claim)
    }

    /// Whether a planned pod took the PersistentVolume for a claim not bound yet.
    pub fn volume_taken(&self, volume: &str) -> bool {
        self.volumes_taken.contains_key(volume)
    }

    // ---- namespaces and storage ----

    pub fn upsert_namespace(&mut self, name: &str, labels: BTreeMap<String, String>) {
        Arc::make_mut(&mut self.namespaces).insert(name.to_string(), labels);
    }

    pub fn remove_namespace(&mut self, name: &str) {
        Arc::make_mut(&mut self.namespaces).remove(name);
    }

    /// A namespace's labels (none for a namespace the engine does not know).
    pub fn namespace_labels(&self, name: &str) -> &BTreeMap<String, String> {
        static NONE: BTreeMap<String, String> = BTreeMap::new();
        self.namespaces.get(name).unwrap_or(&NONE)
    }

    /// Every namespace with its labels.
    pub fn namespaces(&self) -> impl Iterator<Item = (&String, &BTreeMap<String, String>)> {
        self.namespaces.iter()
    }

    /// PersistentVolumeClaims, PersistentVolumes, StorageClasses and CSINodes.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    pub fn storage_mut(&mut self) -> &mut Storage {
        Arc::make_mut(&mut self.storage)
    }

    // ---- slices ----

    pub fn upsert_slice(&mut self, slice: Slice) {
        self.remove_slice(&slice.name);
        match &slice.nodes {
            SliceNodes::Node(node) => {
                self.bump_node(node);
                Arc::make_mut(&mut self.slices_by_node)
                    .entry(node.clone())
                    .or_default()
                    .insert(slice.name.clone());
            }
            _ => {
                self.bump_shared();
                Arc::make_mut(&mut self.shared_slices).insert(slice.name.clone());
            }
        }
        Arc::make_mut(&mut self.slices_by_pool)
            .entry((slice.driver.clone(), slice.pool.clone()))
            .or_default()
            .insert(slice.name.clone());
        let version = self.versions.next();
        Arc::make_mut(&mut self.slice_versions).insert(slice.name.clone(), version);
        Arc::make_mut(&mut self.slices).insert(slice.name.clone(), Arc::new(slice));
    }

    /// The version of slice `name` as this state has it (0 for one it does not have).
    pub(crate) fn slice_version(&self, name: &str) -> u64 {
        self.slice_versions.get(name).copied().unwrap_or(0)
    }

    pub fn remove_slice(&mut self, name: &str) {
        let Some(old) = Arc::make_mut(&mut self.slices).remove(name) else {
            return;
        };
        if let SliceNodes::Node(node) = &old.nodes {
            if let Some(set) = Arc::make_mut(&mut self.slices_by_node).get_mut(node) {
                set.remove(name);
            }
            self.bump_node(node);
        } else {
            self.bump_shared();
        }
        Arc::make_mut(&mut self.shared_slices).remove(name);
        if let Some(set) = Arc::make_mut(&mut self.slices_by_pool).get_mut(&(old.driver.clone(), old.pool.clone())) {
            set.remove(name);
        }
        Arc::make_mut(&mut self.slice_versions).remove(name);
        locked(&self.match_cache).forget_slice(name);
    }

    pub fn slice(&self, name: &str) -> Option<&Arc<Slice>> {
        self.slices.get(name)
    }

    pub fn slices(&self) -> impl Iterator<Item = &Arc<Slice>> {
        self.slices.values()
    }

    /// Slices that may offer devices on `node`: its own, and every shared one.
    pub(crate) fn slices_for_node(&self, node: &str) -> impl Iterator<Item = &Arc<Slice>> {
        self.slices_by_node
            .get(node)
            .into_iter()
            .flatten()
            .chain(self.shared_slices.iter())
            .filter_map(|name| self.slices.get(name))
    }

    /// Whether a device is published in the newest generation of its pool.
    pub fn device_published(&self, driver: &str, pool: &str, device: &str) -> bool {
        let newest = self.pool_slices(driver, pool).map(|s| s.generation).max();
        self.pool_slices(driver, pool)
            .filter(|s| Some(s.generation) == newest)
            .any(|s| s.devices.iter().any(|d| d.name == device))
    }

    /// Every slice of a pool, any generation.
    pub(crate) fn pool_slices(&self, driver: &str, pool: &str) -> impl Iterator<Item = &Arc<Slice>> {
        self.slices_by_pool
            .get(&(driver.to_string(), pool.to_string()))
            .into_iter()
            .flatten()
            .filter_map(|name| self.slices.get(name))
    }

    // ---- classes ----

    /// Cached selector matches stay valid when a class changes: they are keyed by the
    /// selector text.
    pub fn upsert_class(&mut self, class: DeviceClass) {
        if self.classes.get(&class.name) != Some(&class) {
            self.bump_shared();
        }
        Arc::make_mut(&mut self.classes).insert(class.name.clone(), class);
    }

    pub fn remove_class(&mut self, name: &str) {
        if Arc::make_mut(&mut self.classes).remove(name).is_some() {
            self.bump_shared();
        }
    }

    pub fn upsert_taint_rule(&mut self, name: &str, rule: DeviceTaintRule) {
        if self.taint_rules.get(name) != Some(&rule) {
            self.bump_shared();
        }
        Arc::make_mut(&mut self.taint_rules).insert(name.to_string(), rule);
    }

    pub fn remove_taint_rule(&mut self, name: &str) {
        if Arc::make_mut(&mut self.taint_rules).remove(name).is_some() {
            self.bump_shared();
        }
    }

    /// Every taint of a device of the newest generation of its pool: its slice's and
    /// those DeviceTaintRules put on it.
    pub fn device_taints(&self, driver: &str, pool: &str, device: &str) -> Vec<DeviceTaint> {
        let newest = self.pool_slices(driver, pool).map(|s| s.generation).max();
        self.pool_slices(driver, pool)
            .filter(|s| Some(s.generation) == newest)
            .flat_map(|s| s.devices.iter().filter(|d| d.name == device))
            .flat_map(|d| d.taints.iter().cloned())
            .chain(self.rule_taints(driver, pool, device).cloned())
            .collect()
    }

    /// Taints DeviceTaintRules put on a device, besides those of its slice.
    pub(crate) fn rule_taints<'a>(
        &'a self,
        driver: &'a str,
        pool: &'a str,
        device: &'a str,
    ) -> impl Iterator<Item = &'a DeviceTaint> + 'a {
        self.taint_rules
            .values()
            .filter(move |r| r.selects(driver, pool, device))
            .map(|r| &r.taint)
    }

    pub fn class(&self, name: &str) -> Option<&DeviceClass> {
        self.classes.get(name)
    }

    /// Every DeviceClass, by name.
    pub fn classes(&self) -> impl Iterator<Item = &DeviceClass> {
        self.classes.values()
    }

    /// The compiled selector for `expression` (compiled once, errors included).
    pub(crate) fn program(&self, expression: &str) -> Result<crate::cel::Program, String> {
        if let Some(cached) = locked(&self.programs).get(expression) {
            return cached.clone();
        }
        // Stored selectors, as kube-scheduler compiles them: no cost estimate.
        let compiled = crate::cel::compile_stored(expression).map_err(|e| e.message);
        locked(&self.programs).insert(expression.to_string(), compiled.clone());
        compiled
    }

    // ---- claims ----

    /// Records the devices an allocated claim holds (`None`: not allocated, or gone).
    pub fn set_claim_allocation(&mut self, key: &ClaimKey, devices: Option<Vec<DeviceResult>>) {
        if let Some(old) = self.claims.remove(key) {
            for device in &old.devices {
                self.release(device);
            }
        }
        if let Some(devices) = devices {
            for device in &devices {
                self.hold(device);
            }
            self.claims.insert(key.clone(), HeldDevices { devices });
        }
    }

    /// What a watch reports about a claim. While a plan assumes the claim, a report of
    /// no allocation before the watch showed any is older than the plan's own write and
    /// is ignored: only an allocation the cluster shows, or [`ClusterState::forget`],
    /// replaces the assumed one. Once the watch showed an allocation, a report of none is
    /// newer (the claim was given back since) and applies.
    pub fn observe_claim_allocation(&mut self, key: &ClaimKey, devices: Option<Vec<DeviceResult>>) {
        if let Some(plan) = self.assumed.values_mut().find(|p| p.claims.iter().any(|c| c == key)) {
            let seen_allocated = matches!(plan.observed_claims.get(key), Some(Some(_)));
            plan.observed_claims.insert(key.clone(), devices.clone());
            if devices.is_none() && !seen_allocated {
                return;
            }
        }
        self.set_claim_allocation(key, devices);
    }

    /// What a watch reports about a bound pod.
    pub fn observe_pod_bound(&mut self, key: &PodKey, entry: PodEntry) {
        if let Some(plan) = self.assumed.values_mut().find(|p| p.pods.iter().any(|pod| pod == key)) {
            plan.observed_pods.insert(key.clone(), Some(entry.clone()));
        }
        self.place_pod(key, entry);
    }

    /// What a watch reports about a pod that is not bound (or gone): its usage is
    /// dropped, unless a plan assumes the pod on its node and the watch has not shown it
    /// bound yet (once it has, the pod went since, and its usage goes).
    pub fn observe_pod_unbound(&mut self, key: &PodKey) {
        if let Some(plan) = self.assumed.values_mut().find(|p| p.pods.iter().any(|pod| pod == key)) {
            let seen_bound = matches!(plan.observed_pods.get(key), Some(Some(_)));
            plan.observed_pods.insert(key.clone(), None);
            if !seen_bound {
                return;
            }
        }
        self.remove_pod(key);
    }

    /// Whether the engine knows `key` as allocated.
    pub fn claim_allocated(&self, key: &ClaimKey) -> bool {
        self.claims.contains_key(key)
    }

    fn hold(&mut self, device: &DeviceResult) {
        if holds_device(device) {
            self.bump_pool(&device.driver, &device.pool);
        }
        self.devices.hold(device);
    }

    fn release(&mut self, device: &DeviceResult) {
        if holds_device(device) {
            self.bump_pool(&device.driver, &device.pool);
        }
        self.devices.release(device);
    }

    /// Held exclusively by some claim.
    pub fn device_allocated(&self, id: &DeviceId) -> bool {
        self.devices.held_exclusively(id)
    }

    /// How many claims hold a device exclusively: more than one is a double
    /// allocation, which the API server does not prevent.
    pub fn exclusive_holders(&self, driver: &str, pool: &str, device: &str) -> u32 {
        self.devices.exclusive_holders(driver, pool, device)
    }

    /// The claims holding a device exclusively, in name order. A scan of every claim:
    /// for explaining a conflict, not for planning.
    pub fn exclusive_holder_names(&self, id: &DeviceId) -> Vec<&str> {
        self.holder_names_where(id, |d| d.share_id.is_none())
    }

    /// Every claim holding a device, exclusively or a share of it, in name order. A scan
    /// of every claim, like [`ClusterState::exclusive_holder_names`].
    pub fn holder_names(&self, id: &DeviceId) -> Vec<&str> {
        self.holder_names_where(id, |_| true)
    }

    /// The claims with a result for `id` (admin access left out) that `counts`, in name
    /// order.
    fn holder_names_where(&self, id: &DeviceId, counts: impl Fn(&DeviceResult) -> bool) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .claims
            .iter()
            .filter(|(_, held)| {
                held.devices
                    .iter()
                    .any(|d| d.admin_access != Some(true) && counts(d) && d.is_for(id))
            })
            .map(|(name, _)| name.as_str())
            .collect();
        names.sort_unstable();
        names
    }

    /// [`ClusterState::device_allocated`] by names.
    pub fn device_allocated_by_name(&self, driver: &str, pool: &str, device: &str) -> bool {
        self.devices.exclusive_holders(driver, pool, device) > 0
    }

    /// Held in any way (exclusively, shared, or with consumed capacity): the test
    /// upstream uses for counter accounting.
    pub fn device_in_any_use(&self, id: &DeviceId) -> bool {
        self.devices.in_any_use(id)
    }

    /// Capacity consumed by shared allocations of a device.
    pub fn consumed_capacity(&self, id: &DeviceId) -> Option<&BTreeMap<String, Quantity>> {
        self.devices.consumed_capacity(id)
    }

    /// Shared allocations of a device exist.
    pub fn device_shared(&self, id: &DeviceId) -> bool {
        self.devices.shared(id)
    }

    /// Number of devices held exclusively.
    pub fn allocated_device_count(&self) -> usize {
        self.devices.exclusive_device_count()
    }

    // ---- assumed plans ----

    /// Enters a plan's pods and allocations before the cluster shows them. `plan` names
    /// it for [`ClusterState::forget`] and [`ClusterState::confirm`].
    pub fn assume(&mut self, plan: &PlanId, pods: &[AssumedPod], claims: &[AssumedClaim]) {
        self.forget(plan);
        for AssumedPod {
            pod,
            node,
            requests,
            traits,
        } in pods
        {
            self.place_pod(
                pod,
                PodEntry {
                    node: node.clone(),
                    requests: requests.clone(),
                    traits: traits.clone(),
                },
            );
        }
        for AssumedClaim { claim, devices } in claims {
            self.set_claim_allocation(claim, Some(devices.clone()));
        }
        self.assumed.insert(
            plan.clone(),
            AssumedPlan {
                pods: pods.iter().map(|p| p.pod.clone()).collect(),
                claims: claims.iter().map(|c| c.claim.clone()).collect(),
                ..AssumedPlan::default()
            },
        );
    }

    /// Undoes [`ClusterState::assume`]: what the plan entered goes, and what the watch
    /// reported meanwhile takes its place.
    pub fn forget(&mut self, plan: &PlanId) {
        if let Some(mut plan) = self.assumed.remove(plan) {
            for pod in &plan.pods {
                match plan.observed_pods.remove(pod).flatten() {
                    Some(entry) => self.place_pod(pod, entry),
                    None => self.remove_pod(pod),
                }
            }
            for claim in &plan.claims {
                let observed = plan.observed_claims.remove(claim).flatten();
                self.set_claim_allocation(claim, observed);
            }
        }
    }

    /// Drops the record of an assumption once the cluster shows its objects, keeping
    /// what it entered (now owned by the watch).
    pub fn confirm(&mut self, plan: &PlanId) {
        self.assumed.remove(plan);
    }

    pub fn assumed_plans(&self) -> impl Iterator<Item = &PlanId> {
        self.assumed.keys()
    }

    /// The pods and claims an assumed plan entered.
    pub fn assumed_plan_members(&self, plan: &PlanId) -> Option<(&[PodKey], &[ClaimKey])> {
        self.assumed.get(plan).map(|p| (p.pods.as_slice(), p.claims.as_slice()))
    }

    // ---- eviction ----

    /// Takes a gang out as if it were deleted: its pods' node resources, its claims'
    /// devices (with consumed capacity and counters) and its assumed plans, with the
    /// pods and claims those plans entered. Costs in proportion to what it takes, and
    /// [`ClusterState::restore`] puts it back exactly, so a search can try eviction
    /// sets on one copy of the state.
    pub fn evict(&mut self, pods: &[PodKey], claims: &[ClaimKey], plans: &[PlanId]) -> Evicted {
        let mut evicted = Evicted::default();
        for plan in plans {
            if let Some(assumed) = self.assumed.remove(plan) {
                for pod in &assumed.pods {
                    self.evict_pod(pod, &mut evicted);
                }
                for claim in &assumed.claims {
                    self.evict_claim(claim, &mut evicted);
                }
                evicted.plans.push((plan.clone(), assumed));
            }
        }
        for pod in pods {
            self.evict_pod(pod, &mut evicted);
        }
        for claim in claims {
            self.evict_claim(claim, &mut evicted);
        }
        evicted
    }

    fn evict_pod(&mut self, pod: &PodKey, evicted: &mut Evicted) {
        if let Some(entry) = self.pods.get(pod).cloned() {
            self.remove_pod(pod);
            evicted.pods.push((pod.clone(), entry));
        }
    }

    fn evict_claim(&mut self, claim: &ClaimKey, evicted: &mut Evicted) {
        if let Some(held) = self.claims.get(claim) {
            let devices = held.devices.clone();
            self.set_claim_allocation(claim, None);
            evicted.claims.push((claim.clone(), devices));
        }
    }

    /// Puts back what [`ClusterState::evict`] took.
    pub fn restore(&mut self, evicted: Evicted) {
        for (pod, entry) in evicted.pods {
            self.place_pod(&pod, entry);
        }
        for (claim, devices) in evicted.claims {
            self.set_claim_allocation(&claim, Some(devices));
        }
        for (plan, assumed) in evicted.plans {
            self.assumed.insert(plan, assumed);
        }
    }

    /// The devices the engine knows an allocated claim holds.
    pub fn claim_devices(&self, key: &ClaimKey) -> Option<&[DeviceResult]> {
        self.claims.get(key).map(|held| held.devices.as_slice())
    }

    /// Which nodes a device of the newest generation of its pool is available on, as
    /// its slice (or, with per-device node selection, the device itself) says; `None`
    /// for a device no slice publishes.
    pub fn device_reach(&self, driver: &str, pool: &str, device: &str) -> Option<DeviceReach<'_>> {
        let newest = self.pool_slices(driver, pool).map(|s| s.generation).max()?;
        let (slice, published) = self
            .pool_slices(driver, pool)
            .filter(|s| s.generation == newest)
            .find_map(|s| s.devices.iter().find(|d| d.name == device).map(|d| (s, d)))?;
        Some(match (&slice.nodes, &published.nodes) {
            (SliceNodes::Node(node), _) | (SliceNodes::PerDevice, Some(DeviceNodes::Node(node))) => {
                DeviceReach::Node(node)
            }
            (SliceNodes::Selector(selector), _) | (SliceNodes::PerDevice, Some(DeviceNodes::Selector(selector))) => {
                DeviceReach::Selector(selector)
            }
            (SliceNodes::All, _) | (SliceNodes::PerDevice, Some(DeviceNodes::All) | None) => DeviceReach::All,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The match cache is shared with snapshots: what a planner learned on a slice that
    /// changed since is not used for the slice as it is now.
    #[test]
    fn matches_learned_on_a_snapshot_never_serve_a_changed_slice() {
        use crate::fixtures::{GPU, gpu, gpu_cluster, gpu_gang, node_slice};
        use crate::placement::{Outcome, PlanOptions, plan};
        let mut live = gpu_cluster(1, 8, 1, 1);
        let mut class = crate::fixtures::gpu_class();
        class
            .selectors
            .push(format!("device.attributes['{GPU}'].model == 'H100'"));
        live.upsert_class(class);
        let gang = gpu_gang("g", 1, 8, None, None);
        let snapshot = Arc::new(live.clone());
        assert!(matches!(
            plan(&snapshot, &gang, &PlanOptions::default()),
            Outcome::Placed(_)
        ));
        // The driver republishes the node's devices as another model.
        live.upsert_slice(node_slice("node-00000", (0..8).map(|g| gpu(g, "A100")).collect()));
        assert!(
            matches!(plan(&live, &gang, &PlanOptions::default()), Outcome::Unschedulable(_)),
            "the devices are A100s now"
        );
        // And the snapshot, still on the H100s, is not misled by what the live state learned.
        assert!(matches!(
            plan(&snapshot, &gang, &PlanOptions::default()),
            Outcome::Placed(_)
        ));
    }

    fn result(device: &str, share: Option<&str>, consumed: &[(&str, &str)]) -> DeviceResult {
        DeviceResult {
            request: "r".into(),
            driver: "d".into(),
            pool: "p".into(),
            device: device.into(),
            admin_access: None,
            tolerations: vec![],
            binding_conditions: vec![],
            binding_failure_conditions: vec![],
            share_id: share.map(Into::into),
            consumed_capacity: consumed
                .iter()
                .map(|(k, v)| (k.to_string(), Quantity::parse(v).unwrap()))
                .collect(),
        }
    }

    fn id(device: &str) -> DeviceId {
        DeviceId {
            driver: "d".into(),
            pool: "p".into(),
            device: device.into(),
        }
    }

    #[test]
    fn claims_hold_and_release_devices() {
        let mut c = ClusterState::new();
        c.set_claim_allocation(
            &"ns/a".into(),
            Some(vec![
                result("g0", None, &[]),
                result("g1", Some("s1"), &[("mem", "10Gi")]),
            ]),
        );
        assert!(c.device_allocated(&id("g0")));
        assert!(!c.device_allocated(&id("g1")));
        assert!(c.device_shared(&id("g1")));
        c.set_claim_allocation(&"ns/b".into(), Some(vec![result("g1", Some("s2"), &[("mem", "5Gi")])]));
        assert_eq!(
            c.consumed_capacity(&id("g1")).unwrap()["mem"],
            Quantity::parse("15Gi").unwrap()
        );
        c.set_claim_allocation(&"ns/a".into(), None);
        assert!(!c.device_allocated(&id("g0")));
        assert_eq!(
            c.consumed_capacity(&id("g1")).unwrap()["mem"],
            Quantity::parse("5Gi").unwrap()
        );
        c.set_claim_allocation(&"ns/b".into(), None);
        assert!(!c.device_in_any_use(&id("g1")));
        let mut admin = result("g2", None, &[]);
        admin.admin_access = Some(true);
        c.set_claim_allocation(&"ns/c".into(), Some(vec![admin]));
        assert!(!c.device_in_any_use(&id("g2")), "admin access holds nothing");
    }

    /// Pod `pod` on node `n`.
    fn assumed_pod(pod: &str, requests: &Resources) -> AssumedPod {
        AssumedPod {
            pod: pod.into(),
            node: "n".into(),
            requests: requests.clone(),
            traits: Arc::default(),
        }
    }

    /// Claim `claim` holding device `device` exclusively.
    fn plan_id() -> PlanId {
        PlanId::Gang("ns/plan".into())
    }

    fn assumed_claim(claim: &str, device: &str) -> AssumedClaim {
        AssumedClaim {
            claim: claim.into(),
            devices: vec![result(device, None, &[])],
        }
    }

    /// A state with node `n` (8 CPUs, 10 pods) and a 2-CPU pod request.
    fn one_node_and_a_pod_request() -> (ClusterState, Node, Resources) {
        let mut c = ClusterState::new();
        let node = Node {
            name: "n".into(),
            allocatable: Resources {
                cpu_millis: 8000,
                pods: 10,
                ..Default::default()
            },
            ..Default::default()
        };
        c.upsert_node(node.clone());
        let req = Resources {
            cpu_millis: 2000,
            pods: 1,
            ..Default::default()
        };
        (c, node, req)
    }

    #[test]
    fn pods_use_node_resources_once_per_key() {
        let (mut c, node, req) = one_node_and_a_pod_request();
        c.upsert_pod(&"ns/p".into(), "n", req.clone());
        c.upsert_pod(&"ns/p".into(), "n", req.clone());
        assert_eq!(c.free_resources(&node).cpu_millis, 6000);
        c.assume(
            &plan_id(),
            &[assumed_pod("ns/q", &req)],
            &[assumed_claim("ns/claim", "g0")],
        );
        assert_eq!(c.free_resources(&node).cpu_millis, 4000);
        assert!(c.device_allocated(&id("g0")));
        // The watch reports the same pod: still counted once.
        c.upsert_pod(&"ns/q".into(), "n", req);
        assert_eq!(c.free_resources(&node).cpu_millis, 4000);
        c.forget(&plan_id());
        assert_eq!(c.free_resources(&node).cpu_millis, 6000);
        assert!(!c.device_allocated(&id("g0")));
    }

    #[test]
    fn an_evicted_gang_gives_back_everything_and_restore_puts_it_back() {
        let (mut c, node, req) = one_node_and_a_pod_request();
        c.upsert_pod(&"ns/running".into(), "n", req.clone());
        c.set_claim_allocation(
            &"ns/running-claim".into(),
            Some(vec![
                result("g0", None, &[]),
                result("g1", Some("s1"), &[("mem", "10Gi")]),
            ]),
        );
        c.set_claim_allocation(
            &"ns/other".into(),
            Some(vec![result("g1", Some("s2"), &[("mem", "5Gi")])]),
        );
        c.assume(
            &plan_id(),
            &[assumed_pod("ns/q", &req)],
            &[assumed_claim("ns/claim", "g2")],
        );
        assert_eq!(c.free_resources(&node).cpu_millis, 4000);

        let evicted = c.evict(&["ns/running".into()], &["ns/running-claim".into()], &[plan_id()]);
        assert_eq!(
            c.free_resources(&node).cpu_millis,
            8000,
            "both pods' resources are free"
        );
        assert!(!c.device_allocated(&id("g0")) && !c.device_allocated(&id("g2")));
        assert_eq!(
            c.consumed_capacity(&id("g1")).unwrap()["mem"],
            Quantity::parse("5Gi").unwrap(),
            "only the other claim's share is left"
        );
        assert_eq!(c.assumed_plans().count(), 0, "the assumed plan is gone");

        c.restore(evicted);
        assert_eq!(c.free_resources(&node).cpu_millis, 4000);
        assert!(c.device_allocated(&id("g0")) && c.device_allocated(&id("g2")));
        assert_eq!(
            c.consumed_capacity(&id("g1")).unwrap()["mem"],
            Quantity::parse("15Gi").unwrap()
        );
        // The assumption is back, and still undone by forget.
        c.forget(&plan_id());
        assert_eq!(c.free_resources(&node).cpu_millis, 6000);
        assert!(!c.device_allocated(&id("g2")));
        assert!(
            c.evict(&["ns/gone".into()], &["ns/gone".into()], &[plan_id()])
                .is_empty()
        );
    }

    #[test]
    fn a_stale_watch_event_does_not_erase_an_assumption() {
        let (mut c, node, req) = one_node_and_a_pod_request();
        c.assume(
            &plan_id(),
            &[assumed_pod("ns/q", &req)],
            &[assumed_claim("ns/claim", "g0")],
        );
        // Events older than the plan's writes: the claim unallocated, the pod unbound.
        c.observe_claim_allocation(&"ns/claim".into(), None);
        c.observe_pod_unbound(&"ns/q".into());
        assert!(c.device_allocated(&id("g0")), "the assumed allocation stays");
        assert_eq!(c.free_resources(&node).cpu_millis, 6000, "the assumed pod stays");
        // The cluster's own allocation replaces it; once confirmed, the watch rules.
        c.observe_claim_allocation(&"ns/claim".into(), Some(vec![result("g1", None, &[])]));
        assert!(c.device_allocated(&id("g1")) && !c.device_allocated(&id("g0")));
        // Forgetting restores what the watch reported meanwhile.
        c.assume(
            &PlanId::Gang("ns/other".into()),
            &[],
            &[assumed_claim("ns/second", "g2")],
        );
        c.observe_claim_allocation(&"ns/second".into(), Some(vec![result("g3", None, &[])]));
        c.forget(&PlanId::Gang("ns/other".into()));
        assert!(c.device_allocated(&id("g3")) && !c.device_allocated(&id("g2")));
        c.confirm(&plan_id());
        c.observe_claim_allocation(&"ns/claim".into(), None);
        c.observe_pod_unbound(&"ns/q".into());
        assert!(!c.device_allocated(&id("g1")));
        assert_eq!(c.free_resources(&node).cpu_millis, 8000);
    }

    /// Found by the e2e test of a gang deleted right after its release: once the watch
    /// has shown the plan's own write, a later report that the claim is unallocated (or
    /// the pod gone) is newer than that write and applies at once; the confirmation that
    /// follows must not keep the assumed devices and pod for good.
    #[test]
    fn a_report_after_the_plans_own_write_is_newer_and_applies_before_the_confirmation() {
        let (mut c, node, req) = one_node_and_a_pod_request();
        c.assume(
            &plan_id(),
            &[assumed_pod("ns/q", &req)],
            &[assumed_claim("ns/claim", "g0")],
        );
        // The watch shows the plan's writes (the allocation, the pod bound)...
        c.observe_claim_allocation(&"ns/claim".into(), Some(vec![result("g0", None, &[])]));
        c.observe_pod_bound(
            &"ns/q".into(),
            PodEntry {
                node: "n1".into(),
                requests: req.clone(),
                traits: Default::default(),
            },
        );
        // ...then the claim deallocated and the pod gone, before the gang's release is
        // confirmed.
        c.observe_claim_allocation(&"ns/claim".into(), None);
        c.observe_pod_unbound(&"ns/q".into());
        c.confirm(&plan_id());
        assert!(!c.device_allocated(&id("g0")), "the device is free again");
        assert_eq!(c.free_resources(&node).cpu_millis, 8000, "the pod's CPU is free again");
    }
}
