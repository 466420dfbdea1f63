//! Property-based tests of the placement engine on random clusters and random gangs.
//!
//! Clusters are described by small plain specs ([`ClusterSpec`], [`GangSpec`]) that are
//! turned into engine objects, so the same input can be rebuilt from scratch, and so
//! the checks can judge a plan against what the test itself put into the cluster
//! rather than against the engine's own bookkeeping.
//!
//! Each property runs a modest number of cases; set `PROPTEST_CASES` to run more.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use muster_engine::allocator::{self, ClaimRef, NoFit, NodeFit, WorkingSet};
use muster_engine::cel::{self, DeviceView};
use muster_engine::claim::{
    Allocation, ClaimSpec, ConstraintKind, DeviceConstraint, DeviceId, DeviceRequest, DeviceRequestSpec, DeviceResult,
};
use muster_engine::cluster::{ClusterState, Device, DeviceClass, Node, PlanId, Slice, SliceNodes};
use muster_engine::device::{AttributeValue, lookup_attribute};
use muster_engine::fixtures::{self, GPU};
use muster_engine::placement::{self, Outcome, Plan, PlanOptions};
use muster_engine::request::{
    GangRequest, GroupRequest, GroupTopology, PodShape, SharedClaim, SliceRequest, TopologyRequest,
};
use muster_engine::resources::Resources;
use muster_engine::selector::{NodeSelector, NodeTaintEffect, Operator, Requirement, Taint, Term, Toleration};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

const RACK: &str = "example.com/rack";
const BLOCK: &str = "example.com/block";
/// A second class of the test driver: only devices of one model (H100 at first).
const H100_CLASS: &str = "h100.example.com";
const TAINT_KEY: &str = "example.com/dedicated";
/// The pool of the slice shared by several nodes.
const FABRIC: &str = "fabric";
const MODELS: [&str; 3] = ["H100", "A100", "L40S"];

// ---- what the test puts into the cluster ----

#[derive(Clone, Debug)]
struct DeviceSpec {
    model: usize,
    /// `None`: the device does not publish `nvlinkDomain`.
    nvlink: Option<i64>,
    /// Already allocated to a claim outside the gang.
    taken: bool,
}

#[derive(Clone, Copy, Debug)]
enum Labels {
    /// `rack-N` and `block-(N/2)`.
    RackAndBlock(u8),
    BlockOnly(u8),
    Unlabelled,
}

#[derive(Clone, Debug)]
struct NodeSpec {
    labels: Labels,
    cpu_cores: i64,
    memory_gib: i64,
    pods: i64,
    used_cpu_millis: i64,
    used_memory_gib: i64,
    used_pods: i64,
    taint: Option<NodeTaintEffect>,
    unschedulable: bool,
    devices: Vec<DeviceSpec>,
}

/// Which nodes the shared slice offers its devices to.
#[derive(Clone, Copy, Debug)]
enum SharedNodes {
    All,
    Rack(u8),
    Block(u8),
}

#[derive(Clone, Debug)]
struct SharedSpec {
    nodes: SharedNodes,
    devices: Vec<DeviceSpec>,
}

#[derive(Clone, Debug)]
struct ClusterSpec {
    nodes: Vec<NodeSpec>,
    shared: Option<SharedSpec>,
    /// The model [`H100_CLASS`] selects: H100 unless a change made it another.
    class_model: usize,
}

// ---- what the gang asks for ----

/// A device selector, with its CEL text and the test's own reading of it.
#[derive(Clone, Copy, Debug)]
enum Sel {
    ModelIs(usize),
    ModelIsNot(usize),
    IndexAtLeast(i64),
    IndexBelow(i64),
    /// Guarded with `has()`: false on devices without the attribute.
    NvlinkGuarded(i64),
    /// Optional chaining with a default.
    NvlinkOptional(i64),
    /// Not guarded: a CEL runtime error on devices without the attribute.
    NvlinkUnguarded(i64),
}

const ATTRS: &str = "device.attributes[\"gpu.example.com\"]";

impl Sel {
    fn cel(&self) -> String {
        match *self {
            Sel::ModelIs(m) => format!("{ATTRS}.model == \"{}\"", MODELS[m]),
            Sel::ModelIsNot(m) => format!("{ATTRS}.model != \"{}\"", MODELS[m]),
            Sel::IndexAtLeast(i) => format!("{ATTRS}.index >= {i}"),
            Sel::IndexBelow(i) => format!("{ATTRS}.index < {i}"),
            Sel::NvlinkGuarded(d) => format!("has({ATTRS}.nvlinkDomain) && {ATTRS}.nvlinkDomain == {d}"),
            Sel::NvlinkOptional(d) => format!("{ATTRS}.?nvlinkDomain.orValue(-1) == {d}"),
            Sel::NvlinkUnguarded(d) => format!("{ATTRS}.nvlinkDomain == {d}"),
        }
    }

    /// The test's reading of the selector; `Err` for a runtime error.
    fn eval(&self, device: &Device) -> Result<bool, ()> {
        let int = |name: &str| match device.attributes.get(name) {
            Some(AttributeValue::Int(v)) => Some(*v),
            _ => None,
        };
        let model = match device.attributes.get("model") {
            Some(AttributeValue::String(m)) => m.as_str(),
            _ => "",
        };
        Ok(match *self {
            Sel::ModelIs(m) => model == MODELS[m],
            Sel::ModelIsNot(m) => model != MODELS[m],
            Sel::IndexAtLeast(i) => int("index").ok_or(())? >= i,
            Sel::IndexBelow(i) => int("index").ok_or(())? < i,
            Sel::NvlinkGuarded(d) | Sel::NvlinkOptional(d) => int("nvlinkDomain") == Some(d),
            Sel::NvlinkUnguarded(d) => int("nvlinkDomain").ok_or(())? == d,
        })
    }
}

#[derive(Clone, Debug)]
struct SubSpec {
    h100_class: bool,
    count: u32,
    selectors: Vec<Sel>,
}

#[derive(Clone, Debug)]
enum ReqSpec {
    Exactly(SubSpec),
    FirstAvailable(Vec<SubSpec>),
}

#[derive(Clone, Copy, Debug)]
enum Attr {
    Model,
    Nvlink,
    Index,
}

impl Attr {
    fn id(self) -> &'static str {
        match self {
            Attr::Model => "model",
            Attr::Nvlink => "nvlinkDomain",
            Attr::Index => "index",
        }
    }
}

#[derive(Clone, Debug)]
struct ConSpec {
    distinct: bool,
    attr: Attr,
    /// (request, subrequest) picks, taken modulo what the claim has; empty: all.
    requests: Vec<(usize, Option<usize>)>,
}

#[derive(Clone, Debug)]
struct ClaimGen {
    requests: Vec<ReqSpec>,
    constraints: Vec<ConSpec>,
}

#[derive(Clone, Debug)]
struct GroupSpec {
    replicas: usize,
    min_count: usize,
    cpu_millis: i64,
    memory_gib: i64,
    tolerate: bool,
    claims: Vec<ClaimGen>,
}

/// A claim shared by the pods of some groups.
#[derive(Clone, Debug)]
struct SharedGen {
    claim: ClaimGen,
    /// Groups whose pods use it (indices modulo the number of groups).
    users: Vec<usize>,
}

#[derive(Clone, Debug)]
struct GangSpec {
    groups: Vec<GroupSpec>,
    shared: Vec<SharedGen>,
    required: Option<&'static str>,
    preferred: Option<&'static str>,
}

// ---- building engine objects ----

fn node_name(i: usize) -> String {
    format!("node-{i:02}")
}

fn labels_of(labels: Labels) -> Vec<(String, String)> {
    match labels {
        Labels::RackAndBlock(r) => vec![
            (RACK.to_string(), format!("rack-{r}")),
            (BLOCK.to_string(), format!("block-{}", r / 2)),
        ],
        Labels::BlockOnly(b) => vec![(BLOCK.to_string(), format!("block-{b}"))],
        Labels::Unlabelled => vec![],
    }
}

fn device_of(name: String, index: usize, spec: &DeviceSpec) -> Device {
    let mut device = fixtures::gpu(index, MODELS[spec.model]);
    device.name = name;
    match spec.nvlink {
        Some(domain) => {
            device
                .attributes
                .insert("nvlinkDomain".into(), AttributeValue::Int(domain));
        }
        None => {
            device.attributes.remove("nvlinkDomain");
        }
    }
    device
}

fn node_devices(spec: &NodeSpec) -> Vec<Device> {
    spec.devices
        .iter()
        .enumerate()
        .map(|(i, d)| device_of(format!("gpu-{i}"), i, d))
        .collect()
}

fn shared_devices(spec: &SharedSpec) -> Vec<Device> {
    spec.devices
        .iter()
        .enumerate()
        .map(|(i, d)| device_of(format!("fab-{i}"), i, d))
        .collect()
}

fn engine_node(i: usize, spec: &NodeSpec) -> Node {
    let labels = labels_of(spec.labels);
    let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut node = fixtures::node(&node_name(i), spec.cpu_cores, spec.memory_gib, &labels);
    node.allocatable.pods = spec.pods;
    node.unschedulable = spec.unschedulable;
    node.taints = spec
        .taint
        .map(|effect| Taint {
            key: TAINT_KEY.into(),
            value: "true".into(),
            effect,
        })
        .into_iter()
        .collect();
    node
}

fn usage_of(spec: &NodeSpec) -> Resources {
    Resources {
        cpu_millis: spec.used_cpu_millis,
        memory: spec.used_memory_gib << 30,
        pods: spec.used_pods,
        ..Default::default()
    }
}

fn shared_slice(spec: &SharedSpec) -> Slice {
    let selector = |key: &str, value: String| {
        SliceNodes::Selector(NodeSelector {
            terms: vec![Term {
                match_expressions: vec![Requirement::new(key, Operator::In, &[value.as_str()])],
                match_fields: vec![],
            }],
        })
    };
    Slice {
        name: format!("{FABRIC}-slice"),
        driver: GPU.into(),
        pool: FABRIC.into(),
        generation: 1,
        resource_slice_count: 1,
        nodes: match spec.nodes {
            SharedNodes::All => SliceNodes::All,
            SharedNodes::Rack(r) => selector(RACK, format!("rack-{r}")),
            SharedNodes::Block(b) => selector(BLOCK, format!("block-{b}")),
        },
        devices: shared_devices(spec),
        shared_counters: vec![],
    }
}

fn model_class(model: usize) -> DeviceClass {
    DeviceClass {
        name: H100_CLASS.into(),
        selectors: vec![
            format!("device.driver == '{GPU}'"),
            format!("{ATTRS}.model == \"{}\"", MODELS[model]),
        ],
        config: vec![],
        extended_resource_name: None,
    }
}

fn held(pool: &str, device: &str) -> DeviceResult {
    fixtures::device_result("other", pool, device)
}

fn taken_in(pool: &str, prefix: &str, devices: &[DeviceSpec]) -> Vec<DeviceResult> {
    devices
        .iter()
        .enumerate()
        .filter(|(_, d)| d.taken)
        .map(|(i, _)| held(pool, &format!("{prefix}-{i}")))
        .collect()
}

/// One object entered into a state.
type Step<'a> = Box<dyn Fn(&mut ClusterState) + 'a>;

/// Builds the cluster; `reversed` enters the same objects in another order.
fn build_cluster(spec: &ClusterSpec, reversed: bool) -> ClusterState {
    let mut cluster = ClusterState::new();
    let mut steps: Vec<Step<'_>> = Vec::new();
    steps.push(Box::new(|c| c.upsert_class(fixtures::gpu_class())));
    steps.push(Box::new(|c| c.upsert_class(model_class(spec.class_model))));
    for (i, node) in spec.nodes.iter().enumerate() {
        steps.push(Box::new(move |c| c.upsert_node(engine_node(i, node))));
        steps.push(Box::new(move |c| {
            c.upsert_slice(fixtures::node_slice(&node_name(i), node_devices(node)))
        }));
        let usage = usage_of(node);
        if usage != Resources::default() {
            steps.push(Box::new(move |c| {
                c.upsert_pod(
                    &format!("other/{}-pod", node_name(i)).into(),
                    &node_name(i),
                    usage.clone(),
                )
            }));
        }
        let taken = taken_in(&node_name(i), "gpu", &node.devices);
        if !taken.is_empty() {
            steps.push(Box::new(move |c| {
                c.set_claim_allocation(&format!("other/{}", node_name(i)).into(), Some(taken.clone()))
            }));
        }
    }
    if let Some(shared) = &spec.shared {
        steps.push(Box::new(move |c| c.upsert_slice(shared_slice(shared))));
        let taken = taken_in(FABRIC, "fab", &shared.devices);
        if !taken.is_empty() {
            steps.push(Box::new(move |c| {
                c.set_claim_allocation(&format!("other/{FABRIC}").into(), Some(taken.clone()))
            }));
        }
    }
    if reversed {
        steps.reverse();
    }
    for step in steps {
        step(&mut cluster);
    }
    cluster
}

fn sub_request(name: &str, spec: &SubSpec) -> DeviceRequestSpec {
    let mut request = fixtures::request(name, spec.count);
    if spec.h100_class {
        request.device_class_name = H100_CLASS.into();
    }
    request.selectors = spec.selectors.iter().map(Sel::cel).collect();
    request
}

fn claim_spec(claim: &ClaimGen) -> ClaimSpec {
    let requests: Vec<DeviceRequest> = claim
        .requests
        .iter()
        .enumerate()
        .map(|(i, request)| match request {
            ReqSpec::Exactly(spec) => DeviceRequest::Exactly(sub_request(&format!("r{i}"), spec)),
            ReqSpec::FirstAvailable(subs) => DeviceRequest::FirstAvailable {
                name: format!("r{i}"),
                subrequests: subs
                    .iter()
                    .enumerate()
                    .map(|(j, s)| sub_request(&format!("s{j}"), s))
                    .collect(),
            },
        })
        .collect();
    let constraints = claim
        .constraints
        .iter()
        .map(|c| {
            let names: BTreeSet<String> = c
                .requests
                .iter()
                .map(|(r, sub)| {
                    let r = r % claim.requests.len();
                    match (&claim.requests[r], sub) {
                        (ReqSpec::FirstAvailable(subs), Some(s)) => format!("r{r}/s{}", s % subs.len()),
                        _ => format!("r{r}"),
                    }
                })
                .collect();
            let attribute = format!("{GPU}/{}", c.attr.id());
            DeviceConstraint {
                requests: names.into_iter().collect(),
                kind: if c.distinct {
                    ConstraintKind::DistinctAttribute(attribute)
                } else {
                    ConstraintKind::MatchAttribute(attribute)
                },
            }
        })
        .collect();
    ClaimSpec {
        requests,
        constraints,
        config: vec![],
    }
}

fn toleration() -> Toleration {
    Toleration {
        key: TAINT_KEY.into(),
        exists: true,
        value: String::new(),
        effect: None,
    }
}

fn shape_of(group: &GroupSpec) -> PodShape {
    PodShape {
        requests: Resources {
            cpu_millis: group.cpu_millis,
            memory: group.memory_gib << 30,
            pods: 1,
            ..Default::default()
        },
        tolerations: if group.tolerate { vec![toleration()] } else { vec![] },
        claims: group.claims.iter().map(claim_spec).collect(),
        ..PodShape::default()
    }
}

fn build_gang(name: &str, spec: &GangSpec) -> GangRequest {
    let mut groups: Vec<GroupRequest> = spec
        .groups
        .iter()
        .enumerate()
        .map(|(k, g)| GroupRequest::uniform(&format!("{name}-g{k}"), "ns", g.replicas, g.min_count, shape_of(g)))
        .collect();
    for (s, shared) in spec.shared.iter().enumerate() {
        let users: BTreeSet<usize> = shared.users.iter().map(|u| u % groups.len()).collect();
        for u in users {
            groups[u].shape.shared.push(s);
        }
    }
    GangRequest {
        name: format!("ns/{name}"),
        groups,
        shared_claims: spec
            .shared
            .iter()
            .enumerate()
            .map(|(s, shared)| SharedClaim {
                key: format!("ns/{name}-shared-{s}").into(),
                spec: claim_spec(&shared.claim),
                allocation: None,
            })
            .collect(),
        topology: TopologyRequest {
            required: spec.required.map(Into::into),
            preferred: spec.preferred.map(Into::into),
            ..Default::default()
        },
    }
}

// ---- generators ----

/// How often the rarer features show up.
#[derive(Clone, Copy)]
struct Mix {
    /// Weight of devices without `nvlinkDomain` (against 6).
    no_nvlink: u32,
    /// Weight of unguarded selectors (against 24 for the others).
    unguarded: u32,
}

const GENERAL: Mix = Mix {
    no_nvlink: 1,
    unguarded: 1,
};
const TINY: Mix = Mix {
    no_nvlink: 2,
    unguarded: 4,
};

fn device_spec(mix: Mix) -> impl Strategy<Value = DeviceSpec> {
    (
        prop_oneof![3 => Just(0usize), 2 => Just(1usize), 1 => Just(2usize)],
        prop_oneof![6 => (0i64..3).prop_map(Some), mix.no_nvlink => Just(None)],
        prop::bool::weighted(0.2),
    )
        .prop_map(|(model, nvlink, taken)| DeviceSpec { model, nvlink, taken })
}

fn labels_strategy() -> impl Strategy<Value = Labels> {
    prop_oneof![
        16 => (0u8..6).prop_map(Labels::RackAndBlock),
        1 => (0u8..3).prop_map(Labels::BlockOnly),
        2 => Just(Labels::Unlabelled),
    ]
}

fn node_spec(max_devices: usize, mix: Mix) -> impl Strategy<Value = NodeSpec> {
    (
        labels_strategy(),
        prop_oneof![Just(16i64), Just(32i64), Just(64i64)],
        prop_oneof![Just(128i64), Just(512i64)],
        prop_oneof![4 => Just(110i64), 1 => 1i64..=4],
        prop_oneof![2 => Just(0i64), 1 => 0i64..=100],
        prop_oneof![2 => Just(0i64), 1 => 0i64..=100],
        0i64..=2,
        prop_oneof![
            6 => Just(None),
            1 => Just(Some(NodeTaintEffect::NoSchedule)),
            1 => Just(Some(NodeTaintEffect::NoExecute)),
            1 => Just(Some(NodeTaintEffect::PreferNoSchedule)),
        ],
        prop::bool::weighted(0.04),
        prop::collection::vec(device_spec(mix), 0..=max_devices),
    )
        .prop_map(
            |(labels, cpu_cores, memory_gib, pods, cpu_pct, mem_pct, used_pods, taint, unschedulable, devices)| {
                NodeSpec {
                    labels,
                    cpu_cores,
                    memory_gib,
                    pods,
                    used_cpu_millis: cpu_cores * 1000 * cpu_pct / 100,
                    used_memory_gib: memory_gib * mem_pct / 100,
                    used_pods: used_pods.min(pods),
                    taint,
                    unschedulable,
                    devices,
                }
            },
        )
}

fn shared_spec(max_devices: usize, mix: Mix) -> impl Strategy<Value = SharedSpec> {
    (
        prop_oneof![
            Just(SharedNodes::All),
            (0u8..6).prop_map(SharedNodes::Rack),
            (0u8..3).prop_map(SharedNodes::Block),
        ],
        prop::collection::vec(device_spec(mix), 0..=max_devices),
    )
        .prop_map(|(nodes, devices)| SharedSpec { nodes, devices })
}

fn cluster_spec(
    nodes: std::ops::RangeInclusive<usize>,
    devices: usize,
    mix: Mix,
) -> impl Strategy<Value = ClusterSpec> {
    (
        prop::collection::vec(node_spec(devices, mix), nodes),
        prop::option::weighted(0.4, shared_spec(devices.min(4), mix)),
    )
        .prop_map(|(nodes, shared)| ClusterSpec {
            nodes,
            shared,
            class_model: 0,
        })
}

fn selector(mix: Mix) -> impl Strategy<Value = Sel> {
    prop_oneof![
        6 => (0usize..3).prop_map(Sel::ModelIs),
        4 => (0usize..3).prop_map(Sel::ModelIsNot),
        4 => (0i64..6).prop_map(Sel::IndexAtLeast),
        4 => (1i64..8).prop_map(Sel::IndexBelow),
        4 => (0i64..3).prop_map(Sel::NvlinkGuarded),
        2 => (0i64..3).prop_map(Sel::NvlinkOptional),
        mix.unguarded => (0i64..3).prop_map(Sel::NvlinkUnguarded),
    ]
}

fn sub_spec(mix: Mix) -> impl Strategy<Value = SubSpec> {
    (
        prop::bool::weighted(0.2),
        prop_oneof![6 => Just(1u32), 3 => Just(2u32), 1 => 3u32..=4],
        prop_oneof![3 => Just(vec![]), 2 => prop::collection::vec(selector(mix), 1..=2)],
    )
        .prop_map(|(h100_class, count, selectors)| SubSpec {
            h100_class,
            count,
            selectors,
        })
}

fn request_spec(mix: Mix) -> impl Strategy<Value = ReqSpec> {
    prop_oneof![
        4 => sub_spec(mix).prop_map(ReqSpec::Exactly),
        1 => prop::collection::vec(sub_spec(mix), 1..=3).prop_map(ReqSpec::FirstAvailable),
    ]
}

fn constraint_spec() -> impl Strategy<Value = ConSpec> {
    (
        any::<bool>(),
        prop_oneof![Just(Attr::Model), Just(Attr::Nvlink), Just(Attr::Index)],
        prop_oneof![
            2 => Just(vec![]),
            1 => prop::collection::vec((0usize..3, prop::option::of(0usize..3)), 1..=2),
        ],
    )
        .prop_map(|(distinct, attr, requests)| ConSpec {
            distinct,
            attr,
            requests,
        })
}

fn claim_gen(mix: Mix) -> impl Strategy<Value = ClaimGen> {
    (
        prop_oneof![
            6 => prop::collection::vec(request_spec(mix), 1..=1),
            3 => prop::collection::vec(request_spec(mix), 2..=2),
            1 => prop::collection::vec(request_spec(mix), 3..=3),
        ],
        prop_oneof![1 => Just(vec![]), 1 => prop::collection::vec(constraint_spec(), 1..=2)],
    )
        .prop_map(|(requests, constraints)| ClaimGen { requests, constraints })
}

fn group_spec(
    replicas: std::ops::RangeInclusive<usize>,
    claims: std::ops::RangeInclusive<usize>,
    mix: Mix,
) -> impl Strategy<Value = GroupSpec> {
    (
        replicas,
        any::<prop::sample::Index>(),
        prop_oneof![Just(0i64), Just(500i64), Just(4000i64), Just(16000i64)],
        prop_oneof![Just(0i64), Just(8i64), Just(64i64)],
        prop::bool::weighted(0.3),
        prop::collection::vec(claim_gen(mix), claims),
    )
        .prop_map(|(replicas, min, cpu_millis, memory_gib, tolerate, claims)| GroupSpec {
            replicas,
            min_count: 1 + min.index(replicas),
            cpu_millis,
            memory_gib,
            tolerate,
            claims,
        })
}

fn topology() -> impl Strategy<Value = (Option<&'static str>, Option<&'static str>)> {
    let level = || prop_oneof![2 => Just(None), 1 => Just(Some(RACK)), 1 => Just(Some(BLOCK))];
    (level(), level())
}

fn shared_gen() -> impl Strategy<Value = SharedGen> {
    (claim_gen(GENERAL), prop::collection::vec(0usize..3, 1..=2)).prop_map(|(claim, users)| SharedGen { claim, users })
}

fn gang_spec() -> impl Strategy<Value = GangSpec> {
    (
        prop::collection::vec(group_spec(1..=6, 0..=2, GENERAL), 1..=3),
        prop_oneof![4 => Just(vec![]), 1 => prop::collection::vec(shared_gen(), 1..=1)],
        topology(),
    )
        .prop_map(|(groups, shared, (required, preferred))| GangSpec {
            groups,
            shared,
            required,
            preferred,
        })
}

fn scenario() -> impl Strategy<Value = (ClusterSpec, GangSpec)> {
    (cluster_spec(1..=24, 8, GENERAL), gang_spec())
}

/// A gang of one pod with one claim.
fn single_pod_gang(claims: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = GangSpec> {
    (group_spec(1..=1, claims, TINY), topology()).prop_map(|(group, (required, preferred))| GangSpec {
        groups: vec![group],
        shared: vec![],
        required,
        preferred,
    })
}

fn config(cases: u32) -> ProptestConfig {
    let defaults = ProptestConfig::default();
    ProptestConfig {
        cases: if std::env::var_os("PROPTEST_CASES").is_some() {
            defaults.cases
        } else {
            cases
        },
        failure_persistence: None,
        ..defaults
    }
}

// ---- judging a plan ----

/// The cluster as the test built it, plus what assumed plans added.
struct World<'a> {
    cluster: &'a ClusterState,
    /// Devices held by claims outside the plan being judged.
    taken: BTreeSet<DeviceId>,
    /// Resources used on each node outside the plan being judged.
    usage: BTreeMap<String, Resources>,
    /// Every device by id, with its slice.
    devices: BTreeMap<DeviceId, (Arc<Slice>, usize)>,
}

impl<'a> World<'a> {
    fn new(cluster: &'a ClusterState, spec: &ClusterSpec) -> Self {
        let mut taken = BTreeSet::new();
        let mut usage = BTreeMap::new();
        for (i, node) in spec.nodes.iter().enumerate() {
            for d in taken_in(&node_name(i), "gpu", &node.devices) {
                taken.insert(d.device_id());
            }
            usage.insert(node_name(i), usage_of(node));
        }
        if let Some(shared) = &spec.shared {
            for d in taken_in(FABRIC, "fab", &shared.devices) {
                taken.insert(d.device_id());
            }
        }
        let mut devices = BTreeMap::new();
        for slice in cluster.slices() {
            for (index, device) in slice.devices.iter().enumerate() {
                let id = DeviceId {
                    driver: slice.driver.clone(),
                    pool: slice.pool.clone(),
                    device: device.name.clone(),
                };
                devices.insert(id, (slice.clone(), index));
            }
        }
        World {
            cluster,
            taken,
            usage,
            devices,
        }
    }

    /// Counts an earlier plan's pods and devices as used.
    fn add_plan(&mut self, gang: &GangRequest, plan: &Plan) {
        for claim in &plan.claims {
            self.taken
                .extend(claim.allocation.devices.iter().map(DeviceResult::device_id));
        }
        for pod in &plan.pods {
            let group = gang
                .groups
                .iter()
                .find(|g| g.name == pod.group)
                .expect("group of a placed pod");
            self.usage
                .entry(pod.node.clone())
                .or_default()
                .add(&group.shape.requests);
        }
    }

    fn node(&self, name: &str) -> Result<&Node, String> {
        self.cluster.node(name).ok_or_else(|| format!("unknown node {name}"))
    }
}

type Check = Result<(), String>;

/// Whose a claim of the gang is.
#[derive(Clone, Copy)]
enum Owner {
    /// (group, pod index, claim index).
    Pod(usize, usize, usize),
    /// Index into the gang's shared claims.
    Shared(usize),
}

fn claim_owners(gang: &GangRequest) -> BTreeMap<&str, Owner> {
    let mut owners = BTreeMap::new();
    for (g, group) in gang.groups.iter().enumerate() {
        for (p, pod) in group.pods.iter().enumerate() {
            for (c, claim) in pod.claims.iter().enumerate() {
                owners.insert(claim.key.as_str(), Owner::Pod(g, p, c));
            }
        }
    }
    for (s, shared) in gang.shared_claims.iter().enumerate() {
        owners.insert(shared.key.as_str(), Owner::Shared(s));
    }
    owners
}

fn owner_spec(gang: &GangRequest, owner: Owner) -> &ClaimSpec {
    match owner {
        Owner::Pod(g, _, c) => &gang.groups[g].shape.claims[c],
        Owner::Shared(s) => &gang.shared_claims[s].spec,
    }
}

/// The placed pods that use a claim, with their nodes.
fn users<'p>(gang: &'p GangRequest, plan: &'p Plan, owner: Owner) -> Vec<(&'p str, &'p str)> {
    let nodes = placed_nodes(plan);
    let pods: Vec<&str> = match owner {
        Owner::Pod(g, p, _) => vec![gang.groups[g].pods[p].key.as_str()],
        Owner::Shared(s) => gang
            .groups
            .iter()
            .filter(|g| g.shape.shared.contains(&s))
            .flat_map(|g| g.pods.iter().map(|p| p.key.as_str()))
            .collect(),
    };
    pods.into_iter()
        .filter_map(|pod| nodes.get(pod).map(|node| (pod, *node)))
        .collect()
}

fn placed_nodes(plan: &Plan) -> BTreeMap<&str, &str> {
    plan.pods.iter().map(|p| (p.pod.as_str(), p.node.as_str())).collect()
}

fn split_request(name: &str) -> (&str, Option<&str>) {
    match name.split_once('/') {
        Some((base, sub)) => (base, Some(sub)),
        None => (name, None),
    }
}

/// The spec a result's request name refers to.
fn resolve<'s>(claim: &'s ClaimSpec, name: &str) -> Option<&'s DeviceRequestSpec> {
    let (base, sub) = split_request(name);
    claim.requests.iter().find_map(|request| match (request, sub) {
        (DeviceRequest::Exactly(spec), None) if spec.name == base => Some(spec),
        (DeviceRequest::FirstAvailable { name, subrequests }, Some(sub)) if name == base => {
            subrequests.iter().find(|s| s.name == sub)
        }
        _ => None,
    })
}

fn slice_usable(slice: &Slice, node: &Node) -> bool {
    match &slice.nodes {
        SliceNodes::Node(name) => *name == node.name,
        SliceNodes::All => true,
        SliceNodes::Selector(selector) => selector.matches(&node.name, &node.labels),
        SliceNodes::PerDevice => false,
    }
}

/// Property 1 on a set of allocations: no device twice, none already held.
fn check_devices_unique<'x>(
    world: &World<'_>,
    allocations: impl IntoIterator<Item = (&'x str, &'x Allocation)>,
) -> Check {
    let mut seen: BTreeMap<DeviceId, &str> = BTreeMap::new();
    for (claim, allocation) in allocations {
        for device in &allocation.devices {
            if device.admin_access == Some(true) || device.share_id.is_some() {
                continue;
            }
            let id = device.device_id();
            if world.taken.contains(&id) {
                return Err(format!("{id} given to {claim} is already allocated to another claim"));
            }
            if let Some(other) = seen.insert(id.clone(), claim) {
                return Err(format!("{id} is given to both {other} and {claim}"));
            }
        }
    }
    Ok(())
}

/// Property 2 for one claim's allocation used on `node`.
fn check_allocation_satisfies(
    world: &World<'_>,
    key: &str,
    spec: &ClaimSpec,
    allocation: &Allocation,
    node: &Node,
) -> Check {
    for device in &allocation.devices {
        let id = device.device_id();
        let Some((slice, index)) = world.devices.get(&id) else {
            return Err(format!("{key}: {id} does not exist"));
        };
        if !slice_usable(slice, node) {
            return Err(format!("{key}: {id} is not available on {}", node.name));
        }
        let Some(request) = resolve(spec, &device.request) else {
            return Err(format!(
                "{key}: {id} is allocated for unknown request {}",
                device.request
            ));
        };
        let class = world
            .cluster
            .class(&request.device_class_name)
            .ok_or_else(|| format!("{key}: unknown class {}", request.device_class_name))?;
        let attributes = &slice.devices[*index];
        let view = DeviceView {
            driver: &slice.driver,
            attributes: &attributes.attributes,
            capacity: &attributes.capacity,
            allow_multiple_allocations: attributes.allow_multiple_allocations,
        };
        for expression in class.selectors.iter().chain(&request.selectors) {
            let program = cel::compile(expression).map_err(|e| format!("{key}: {expression}: {e}"))?;
            match program.evaluate(&view) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(format!(
                        "{key}: {id} for {} does not satisfy {expression}",
                        device.request
                    ));
                }
                Err(e) => return Err(format!("{key}: {id} for {}: {expression} fails: {e}", device.request)),
            }
        }
    }
    for request in &spec.requests {
        match request {
            DeviceRequest::Exactly(s) => {
                let n = allocation.devices.iter().filter(|d| d.request == s.name).count();
                if n != s.count as usize {
                    return Err(format!(
                        "{key}: request {} got {n} devices, asked for {}",
                        s.name, s.count
                    ));
                }
            }
            DeviceRequest::FirstAvailable { name, subrequests } => {
                let used: BTreeSet<&str> = allocation
                    .devices
                    .iter()
                    .filter_map(|d| match split_request(&d.request) {
                        (base, Some(sub)) if base == name => Some(sub),
                        _ => None,
                    })
                    .collect();
                if used.len() != 1 {
                    return Err(format!("{key}: request {name} used subrequests {used:?}"));
                }
                let sub = used.iter().next().expect("one subrequest");
                let spec = subrequests.iter().find(|s| s.name == *sub).expect("resolved above");
                let n = allocation
                    .devices
                    .iter()
                    .filter(|d| d.request == format!("{name}/{sub}"))
                    .count();
                if n != spec.count as usize {
                    return Err(format!(
                        "{key}: request {name}/{sub} got {n} devices, asked for {}",
                        spec.count
                    ));
                }
            }
        }
    }
    if let Some(selector) = &allocation.node_selector
        && !selector.matches(&node.name, &node.labels)
    {
        return Err(format!("{key}: allocation's node selector excludes {}", node.name));
    }
    Ok(())
}

/// Property 3 for one claim's allocation.
fn check_constraints(world: &World<'_>, key: &str, spec: &ClaimSpec, allocation: &Allocation) -> Check {
    for constraint in &spec.constraints {
        let applies = |request: &str| {
            let (base, sub) = split_request(request);
            constraint.requests.is_empty()
                || constraint
                    .requests
                    .iter()
                    .any(|r| r == base || sub.is_some_and(|s| *r == format!("{base}/{s}")))
        };
        let attribute = match &constraint.kind {
            ConstraintKind::MatchAttribute(a) | ConstraintKind::DistinctAttribute(a) => a,
        };
        let mut values = Vec::new();
        for device in allocation.devices.iter().filter(|d| applies(&d.request)) {
            let id = device.device_id();
            let (slice, index) = &world.devices[&id];
            let value = lookup_attribute(&slice.devices[*index].attributes, &slice.driver, attribute)
                .ok_or_else(|| format!("{key}: {id} has no {attribute} but is constrained by it"))?;
            values.push((id, value));
        }
        match &constraint.kind {
            ConstraintKind::MatchAttribute(_) => {
                if let Some((first, value)) = values.first()
                    && let Some((other, v)) = values.iter().find(|(_, v)| v != value)
                {
                    return Err(format!(
                        "{key}: matchAttribute {attribute}: {first} has {value:?}, {other} has {v:?}"
                    ));
                }
            }
            ConstraintKind::DistinctAttribute(_) => {
                for (i, (a, va)) in values.iter().enumerate() {
                    if let Some((b, _)) = values[i + 1..].iter().find(|(_, vb)| vb == va) {
                        return Err(format!(
                            "{key}: distinctAttribute {attribute}: {a} and {b} both have {va:?}"
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

fn property_1_devices_unique(world: &World<'_>, plan: &Plan) -> Check {
    check_devices_unique(world, plan.claims.iter().map(|c| (c.claim.as_str(), &c.allocation)))
}

/// Property 2: every new allocation belongs to a claim of a placed pod, exactly the
/// claims of placed pods are allocated, and each device satisfies its request on the
/// node of every pod that uses the claim.
fn property_2_devices_satisfy(world: &World<'_>, gang: &GangRequest, plan: &Plan) -> Check {
    let owners = claim_owners(gang);
    let mut allocated = BTreeSet::new();
    for claim in &plan.claims {
        let owner = *owners
            .get(claim.claim.as_str())
            .ok_or_else(|| format!("allocation for unknown claim {}", claim.claim))?;
        if !allocated.insert(claim.claim.as_str()) {
            return Err(format!("claim {} is allocated twice", claim.claim));
        }
        let users = users(gang, plan, owner);
        if users.is_empty() {
            return Err(format!("claim {} is allocated, but no placed pod uses it", claim.claim));
        }
        for (pod, node) in users {
            let node = world.node(node)?;
            check_allocation_satisfies(
                world,
                claim.claim.as_str(),
                owner_spec(gang, owner),
                &claim.allocation,
                node,
            )
            .map_err(|e| format!("{e} (pod {pod})"))?;
        }
    }
    for (key, &owner) in &owners {
        let preallocated = match owner {
            Owner::Pod(g, p, c) => gang.groups[g].pods[p].claims[c].allocation.is_some(),
            Owner::Shared(s) => gang.shared_claims[s].allocation.is_some(),
        };
        if !preallocated && !users(gang, plan, owner).is_empty() && !allocated.contains(key) {
            return Err(format!("claim {key} of a placed pod has no allocation"));
        }
    }
    Ok(())
}

fn property_3_constraints(world: &World<'_>, gang: &GangRequest, plan: &Plan) -> Check {
    let owners = claim_owners(gang);
    for claim in &plan.claims {
        let owner = *owners
            .get(claim.claim.as_str())
            .ok_or_else(|| format!("allocation for unknown claim {}", claim.claim))?;
        check_constraints(world, claim.claim.as_str(), owner_spec(gang, owner), &claim.allocation)?;
    }
    Ok(())
}

fn property_4_topology(world: &World<'_>, gang: &GangRequest, plan: &Plan) -> Check {
    match &gang.topology.required {
        Some(key) => {
            let value = plan
                .topology_value
                .as_ref()
                .ok_or_else(|| format!("required {key} but the plan has no topology value"))?;
            for pod in &plan.pods {
                let node = world.node(&pod.node)?;
                if node.labels.get(key) != Some(value) {
                    return Err(format!(
                        "pod {} is on {} with {key}={:?}, the plan says {value}",
                        pod.pod,
                        node.name,
                        node.labels.get(key)
                    ));
                }
            }
        }
        None => {
            if plan.topology_value.is_some() {
                return Err(format!(
                    "no required topology, yet topology value {:?}",
                    plan.topology_value
                ));
            }
        }
    }
    let expected: Vec<String> = match &gang.topology.preferred {
        Some(key) => {
            let mut values = BTreeSet::new();
            for pod in &plan.pods {
                if let Some(v) = world.node(&pod.node)?.labels.get(key) {
                    values.insert(v.clone());
                }
            }
            values.into_iter().collect()
        }
        None => vec![],
    };
    if plan.preferred_values != expected {
        return Err(format!(
            "preferred values {:?}, the pods' nodes have {expected:?}",
            plan.preferred_values
        ));
    }
    Ok(())
}

fn property_5_gang(gang: &GangRequest, plan: &Plan) -> Check {
    let mut seen = BTreeSet::new();
    for pod in &plan.pods {
        if !seen.insert(pod.pod.as_str()) {
            return Err(format!("pod {} placed twice", pod.pod));
        }
        let group = gang
            .groups
            .iter()
            .find(|g| g.pods.iter().any(|p| p.key == pod.pod))
            .ok_or_else(|| format!("unknown pod {} placed", pod.pod))?;
        if group.name != pod.group {
            return Err(format!(
                "pod {} is in group {}, the plan says {}",
                pod.pod, group.name, pod.group
            ));
        }
    }
    for group in &gang.groups {
        let placed: Vec<bool> = group.pods.iter().map(|p| seen.contains(p.key.as_str())).collect();
        let n = placed.iter().filter(|p| **p).count();
        if n < group.min_count || n > group.pods.len() {
            return Err(format!(
                "group {}: {n} pods placed, minCount {}",
                group.name, group.min_count
            ));
        }
        if let Some(i) = placed[..group.min_count].iter().position(|p| !p) {
            return Err(format!(
                "group {}: core pod {} not placed",
                group.name, group.pods[i].key
            ));
        }
    }
    let expected: Vec<&str> = gang
        .groups
        .iter()
        .flat_map(|g| &g.pods)
        .map(|p| p.key.as_str())
        .filter(|p| !seen.contains(p))
        .collect();
    let unplaced: Vec<&str> = plan.unplaced.iter().map(|p| p.as_str()).collect();
    if unplaced != expected {
        return Err(format!(
            "unplaced lists {unplaced:?}, the pods not placed are {expected:?}"
        ));
    }
    Ok(())
}

/// Property 6: node resources, and the node filters (taints, unschedulable).
fn property_6_nodes(world: &World<'_>, gang: &GangRequest, plan: &Plan) -> Check {
    let mut totals: BTreeMap<&str, Resources> = BTreeMap::new();
    for pod in &plan.pods {
        let group = gang
            .groups
            .iter()
            .find(|g| g.name == pod.group)
            .ok_or_else(|| format!("unknown group {}", pod.group))?;
        let node = world.node(&pod.node)?;
        if node.unschedulable {
            return Err(format!("pod {} placed on unschedulable node {}", pod.pod, node.name));
        }
        for taint in node
            .taints
            .iter()
            .filter(|t| t.effect != NodeTaintEffect::PreferNoSchedule)
        {
            let tolerated = group
                .shape
                .tolerations
                .iter()
                .any(|t| t.key == taint.key && (t.exists || t.value == taint.value));
            if !tolerated {
                return Err(format!(
                    "pod {} placed on {} despite taint {taint:?}",
                    pod.pod, node.name
                ));
            }
        }
        totals.entry(pod.node.as_str()).or_default().add(&group.shape.requests);
    }
    for (name, placed) in totals {
        let node = world.node(name)?;
        let mut total = world.usage.get(name).cloned().unwrap_or_default();
        total.add(&placed);
        let a = &node.allocatable;
        if total.cpu_millis > a.cpu_millis || total.memory > a.memory || total.pods > a.pods {
            return Err(format!("{name} is overcommitted: {total:?} of {a:?}"));
        }
    }
    Ok(())
}

fn check_plan(world: &World<'_>, gang: &GangRequest, plan: &Plan) -> Check {
    property_1_devices_unique(world, plan)?;
    property_2_devices_satisfy(world, gang, plan)?;
    property_3_constraints(world, gang, plan)?;
    property_4_topology(world, gang, plan)?;
    property_5_gang(gang, plan)?;
    property_6_nodes(world, gang, plan)
}

fn fail(message: String) -> TestCaseError {
    TestCaseError::fail(message)
}

/// Plans the scenario and applies `check` to a plan.
fn run_property(
    cluster_spec: &ClusterSpec,
    gang_spec: &GangSpec,
    check: impl Fn(&World<'_>, &GangRequest, &Plan) -> Check,
) -> Result<(), TestCaseError> {
    let cluster = build_cluster(cluster_spec, false);
    let gang = build_gang("g", gang_spec);
    let outcome = placement::plan(&cluster, &gang, &PlanOptions::default());
    match &outcome {
        Outcome::Placed(plan) => {
            let world = World::new(&cluster, cluster_spec);
            check(&world, &gang, plan).map_err(fail)
        }
        Outcome::Unschedulable(u) => {
            prop_assert!(!u.reasons.is_empty(), "an unschedulable outcome without reasons");
            Ok(())
        }
    }
}

// ---- the brute-force oracle ----

/// A device as the oracle sees it.
struct OracleDevice {
    device: Device,
    taken: bool,
}

/// Devices usable on node `i`: its own, and the shared slice's if it targets the node.
fn oracle_devices(spec: &ClusterSpec, i: usize) -> Vec<OracleDevice> {
    let node = &spec.nodes[i];
    let mut devices: Vec<OracleDevice> = node_devices(node)
        .into_iter()
        .zip(&node.devices)
        .map(|(device, d)| OracleDevice { device, taken: d.taken })
        .collect();
    if let Some(shared) = &spec.shared {
        let labels: BTreeMap<String, String> = labels_of(node.labels).into_iter().collect();
        let targets = match shared.nodes {
            SharedNodes::All => true,
            SharedNodes::Rack(r) => labels.get(RACK) == Some(&format!("rack-{r}")),
            SharedNodes::Block(b) => labels.get(BLOCK) == Some(&format!("block-{b}")),
        };
        if targets {
            devices.extend(
                shared_devices(shared)
                    .into_iter()
                    .zip(&shared.devices)
                    .map(|(device, d)| OracleDevice { device, taken: d.taken }),
            );
        }
    }
    devices
}

/// The class and request selectors, in the order the engine evaluates them: the
/// first false wins, the first error is an error.
fn oracle_matches(sub: &SubSpec, device: &Device) -> Result<bool, ()> {
    let model_is_h100 = device.attributes.get("model") == Some(&AttributeValue::String("H100".into()));
    if sub.h100_class && !model_is_h100 {
        return Ok(false);
    }
    for selector in &sub.selectors {
        if !selector.eval(device)? {
            return Ok(false);
        }
    }
    Ok(true)
}

fn options(request: &ReqSpec) -> Vec<(Option<usize>, &SubSpec)> {
    match request {
        ReqSpec::Exactly(s) => vec![(None, s)],
        ReqSpec::FirstAvailable(subs) => subs.iter().enumerate().map(|(j, s)| (Some(j), s)).collect(),
    }
}

/// One chosen device: (device, request index, subrequest index).
type Pick = (usize, usize, Option<usize>);

fn oracle_constraints_hold(claim: &ClaimSpec, devices: &[OracleDevice], picks: &[Pick]) -> bool {
    claim.constraints.iter().all(|constraint| {
        let applies = |r: usize, sub: Option<usize>| {
            constraint.requests.is_empty()
                || constraint.requests.contains(&format!("r{r}"))
                || sub.is_some_and(|s| constraint.requests.contains(&format!("r{r}/s{s}")))
        };
        let (attribute, distinct) = match &constraint.kind {
            ConstraintKind::MatchAttribute(a) => (a, false),
            ConstraintKind::DistinctAttribute(a) => (a, true),
        };
        let id = attribute
            .strip_prefix(&format!("{GPU}/"))
            .expect("constraints on the test driver");
        let values: Option<Vec<&AttributeValue>> = picks
            .iter()
            .filter(|(_, r, s)| applies(*r, *s))
            .map(|(d, _, _)| devices[*d].device.attributes.get(id))
            .collect();
        let Some(values) = values else { return false };
        if distinct {
            values.iter().enumerate().all(|(i, v)| !values[i + 1..].contains(v))
        } else {
            values.windows(2).all(|w| w[0] == w[1])
        }
    })
}

/// Exhaustive search: can every claim be satisfied from `devices`?
struct Oracle<'a> {
    claims: &'a [ClaimGen],
    specs: Vec<ClaimSpec>,
    devices: &'a [OracleDevice],
    used: Vec<bool>,
    picks: Vec<Pick>,
}

impl Oracle<'_> {
    fn solve(&mut self, claim: usize, request: usize) -> bool {
        if claim == self.claims.len() {
            return true;
        }
        if request == self.claims[claim].requests.len() {
            if !oracle_constraints_hold(&self.specs[claim], self.devices, &self.picks) {
                return false;
            }
            let saved = std::mem::take(&mut self.picks);
            let found = self.solve(claim + 1, 0);
            self.picks = saved;
            return found;
        }
        for (sub, spec) in options(&self.claims[claim].requests[request]) {
            let candidates: Vec<usize> = (0..self.devices.len())
                .filter(|d| {
                    !self.devices[*d].taken
                        && !self.used[*d]
                        && oracle_matches(spec, &self.devices[*d].device) == Ok(true)
                })
                .collect();
            if self.choose(claim, request, sub, &candidates, spec.count as usize) {
                return true;
            }
        }
        false
    }

    /// Tries every `count`-subset of `candidates` for one request.
    fn choose(&mut self, claim: usize, request: usize, sub: Option<usize>, candidates: &[usize], count: usize) -> bool {
        if count == 0 {
            return self.solve(claim, request + 1);
        }
        for (i, &d) in candidates.iter().enumerate() {
            if candidates.len() - i < count {
                break;
            }
            self.used[d] = true;
            self.picks.push((d, request, sub));
            let found = self.choose(claim, request, sub, &candidates[i + 1..], count - 1);
            self.picks.pop();
            self.used[d] = false;
            if found {
                return true;
            }
        }
        false
    }
}

/// What the oracle says about one node for one pod.
#[derive(Debug)]
struct Verdict {
    /// Labels, taints and free resources admit the pod.
    filters_pass: bool,
    /// The pod's claims can be satisfied from the node's free devices.
    devices_fit: bool,
    /// Some selector of the pod fails with a runtime error on a device the node sees.
    cel_error: bool,
}

fn oracle_verdict(spec: &ClusterSpec, i: usize, gang: &GangSpec) -> Verdict {
    assert_eq!(spec.class_model, 0, "the oracle knows the class as selecting H100");
    let node = &spec.nodes[i];
    let group = &gang.groups[0];
    let labels: BTreeMap<String, String> = labels_of(node.labels).into_iter().collect();
    let tolerated = match node.taint {
        None | Some(NodeTaintEffect::PreferNoSchedule) => true,
        Some(_) => group.tolerate,
    };
    let free_cpu = node.cpu_cores * 1000 - node.used_cpu_millis;
    let free_memory = node.memory_gib - node.used_memory_gib;
    let free_pods = node.pods - node.used_pods;
    let resources = group.cpu_millis <= free_cpu && group.memory_gib <= free_memory && 1 <= free_pods;
    let filters_pass =
        gang.required.is_none_or(|key| labels.contains_key(key)) && !node.unschedulable && tolerated && resources;
    let devices = oracle_devices(spec, i);
    let cel_error = group
        .claims
        .iter()
        .flat_map(|c| &c.requests)
        .flat_map(options)
        .any(|(_, sub)| devices.iter().any(|d| oracle_matches(sub, &d.device).is_err()));
    let mut oracle = Oracle {
        claims: &group.claims,
        specs: group.claims.iter().map(claim_spec).collect(),
        devices: &devices,
        used: vec![false; devices.len()],
        picks: vec![],
    };
    let devices_fit = oracle.solve(0, 0);
    Verdict {
        filters_pass,
        devices_fit,
        cel_error,
    }
}

fn is_cel_error(outcome: &Outcome) -> bool {
    matches!(outcome, Outcome::Unschedulable(u) if u.reasons.iter().any(|r| r.contains("CEL runtime error")))
}

// ---- the properties ----

proptest! {
    #![proptest_config(config(192))]

    /// Property 1: across the plan and the devices already allocated, no device twice.
    #[test]
    fn no_device_is_allocated_twice((cluster, gang) in scenario()) {
        run_property(&cluster, &gang, |world, _, plan| property_1_devices_unique(world, plan))?;
    }

    /// Property 2: every allocated device exists where the pod runs and satisfies its
    /// request: class and request selectors, exact counts, the allocation's node selector.
    #[test]
    fn every_device_satisfies_its_request((cluster, gang) in scenario()) {
        run_property(&cluster, &gang, property_2_devices_satisfy)?;
    }

    /// Property 3: matchAttribute and distinctAttribute hold within each claim.
    #[test]
    fn claim_constraints_hold((cluster, gang) in scenario()) {
        run_property(&cluster, &gang, property_3_constraints)?;
    }

    /// Property 4: with a required key, all pods share its value, the plan's value.
    #[test]
    fn required_topology_holds((cluster, gang) in scenario()) {
        run_property(&cluster, &gang, property_4_topology)?;
    }

    /// Property 5: at least minCount pods of every group, each pod at most once, and
    /// `unplaced` lists exactly the others.
    #[test]
    fn min_count_is_honoured_and_every_pod_accounted_for((cluster, gang) in scenario()) {
        run_property(&cluster, &gang, |_, gang, plan| property_5_gang(gang, plan))?;
    }

    /// Property 6: placed pods plus existing usage fit each node; filters hold.
    #[test]
    fn node_resources_are_never_overcommitted((cluster, gang) in scenario()) {
        run_property(&cluster, &gang, property_6_nodes)?;
    }

    /// Property 7: the same input gives the same outcome: twice on one state, on a fresh
    /// identical state, on one built in another order, and after caches were warmed by
    /// planning other gangs.
    #[test]
    fn planning_is_deterministic((cluster_spec, gang_spec) in scenario(), other in gang_spec()) {
        let options = PlanOptions::default();
        let gang = build_gang("g", &gang_spec);
        let cluster = build_cluster(&cluster_spec, false);
        let first = placement::plan(&cluster, &gang, &options);
        prop_assert_eq!(&placement::plan(&cluster, &gang, &options), &first, "planned twice");
        let fresh = build_cluster(&cluster_spec, false);
        prop_assert_eq!(&placement::plan(&fresh, &gang, &options), &first, "fresh state");
        let reversed = build_cluster(&cluster_spec, true);
        prop_assert_eq!(&placement::plan(&reversed, &gang, &options), &first, "built in reverse order");
        let warmed = build_cluster(&cluster_spec, false);
        let _ = placement::plan(&warmed, &build_gang("o", &other), &options);
        let _ = placement::plan(&warmed, &build_gang("g", &other), &options);
        prop_assert_eq!(&placement::plan(&warmed, &gang, &options), &first, "after other plans");
    }

    /// Property 7, continued: the search limits only cut the search short. A plan found
    /// within a small step budget or few domains is valid, and is the plan found
    /// without those limits.
    #[test]
    fn search_limits_only_cut_the_search_short(
        (cluster_spec, gang_spec) in scenario(),
        step_budget in prop_oneof![1u64..50, 50u64..2_000],
        max_domains in 1usize..=3,
    ) {
        let cluster = build_cluster(&cluster_spec, false);
        let gang = build_gang("g", &gang_spec);
        let limited = placement::plan(&cluster, &gang, &PlanOptions {
                step_budget,
                max_domains,
                ..PlanOptions::default()
            });
        if let Outcome::Placed(plan) = &limited {
            let world = World::new(&cluster, &cluster_spec);
            check_plan(&world, &gang, plan).map_err(fail)?;
            let fresh = build_cluster(&cluster_spec, false);
            prop_assert_eq!(&placement::plan(&fresh, &gang, &PlanOptions::default()), &limited);
        }
    }

    /// The test's reading of its selectors agrees with the engine's CEL.
    #[test]
    fn selector_model_agrees_with_cel(device in device_spec(TINY), index in 0usize..8, sel in selector(TINY)) {
        let device = device_of("gpu-x".into(), index, &device);
        let program = cel::compile(&sel.cel()).map_err(|e| fail(e.to_string()))?;
        let view = DeviceView {
            driver: GPU,
            attributes: &device.attributes,
            capacity: &device.capacity,
            allow_multiple_allocations: false,
        };
        prop_assert_eq!(program.evaluate(&view).map_err(|_| ()), sel.eval(&device), "{}", sel.cel());
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Property 8: for a one-pod gang on up to 3 nodes with up to 4 devices each and one
    /// claim, the engine places it iff an exhaustive search finds a node for it. A
    /// selector that fails at run time on a device of a node the pod could use makes
    /// the outcome a "CEL runtime error", as kube-scheduler's is an error.
    #[test]
    fn single_pod_fits_iff_brute_force_finds_a_node(
        cluster_spec in cluster_spec(1..=3, 4, TINY),
        gang_spec in single_pod_gang(1..=1),
    ) {
        let cluster = build_cluster(&cluster_spec, false);
        let gang = build_gang("g", &gang_spec);
        let outcome = placement::plan(&cluster, &gang, &PlanOptions::default());
        let verdicts: Vec<Verdict> = (0..cluster_spec.nodes.len())
            .map(|i| oracle_verdict(&cluster_spec, i, &gang_spec))
            .collect();
        let error_expected = verdicts.iter().any(|v| v.filters_pass && v.cel_error);
        let admitting: Vec<String> = verdicts
            .iter()
            .enumerate()
            .filter(|(_, v)| v.filters_pass && v.devices_fit)
            .map(|(i, _)| node_name(i))
            .collect();
        if error_expected {
            // Selectors are evaluated lazily, as upstream: a device in use or excluded by
            // its class is never evaluated, so a failing selector is possible here, not
            // certain (the differential suite checks the exact cases against
            // kube-scheduler).
            return Ok(());
        }
        prop_assert!(!is_cel_error(&outcome), "no selector can fail, yet {outcome:?}");
        match &outcome {
            Outcome::Placed(plan) => {
                prop_assert_eq!(plan.pods.len(), 1);
                prop_assert!(
                    admitting.contains(&plan.pods[0].node),
                    "placed on {}, the search admits only {admitting:?}; verdicts {verdicts:?}",
                    plan.pods[0].node
                );
                let world = World::new(&cluster, &cluster_spec);
                check_plan(&world, &gang, plan).map_err(fail)?;
            }
            Outcome::Unschedulable(u) => {
                prop_assert!(admitting.is_empty(), "unschedulable ({u}), yet the search admits it on {admitting:?}");
            }
        }
    }

    /// Property 8, node by node: the allocator finds devices for a pod's claims on a
    /// node iff the exhaustive search does; what it returns satisfies the claims.
    #[test]
    fn allocator_agrees_with_brute_force_per_node(
        cluster_spec in cluster_spec(1..=3, 4, TINY),
        gang_spec in single_pod_gang(1..=2),
    ) {
        let cluster = build_cluster(&cluster_spec, false);
        let gang = build_gang("g", &gang_spec);
        let world = World::new(&cluster, &cluster_spec);
        let pod = &gang.groups[0].pods[0];
        let shape = &gang.groups[0].shape;
        let refs: Vec<ClaimRef<'_>> = pod
            .claims
            .iter()
            .zip(&shape.claims)
            .map(|(claim, spec)| ClaimRef { key: claim.key.as_str(), spec })
            .collect();
        for i in 0..cluster_spec.nodes.len() {
            let node = cluster.node(&node_name(i)).expect("node");
            let verdict = oracle_verdict(&cluster_spec, i, &gang_spec);
            let mut budget = PlanOptions::default().step_budget;
            match allocator::allocate(&cluster, &WorkingSet::default(), node, &refs, &mut budget) {
                Ok(NodeFit::Placed(allocations)) => {
                    prop_assert!(verdict.devices_fit, "{}: allocated {allocations:?}, the search finds nothing", node.name);
                    prop_assert_eq!(allocations.len(), refs.len());
                    check_devices_unique(&world, refs.iter().map(|r| r.key).zip(&allocations)).map_err(fail)?;
                    for ((r, allocation), spec) in refs.iter().zip(&allocations).zip(&shape.claims) {
                        check_allocation_satisfies(&world, r.key, spec, allocation, node).map_err(fail)?;
                        check_constraints(&world, r.key, spec, allocation).map_err(fail)?;
                    }
                }
                Ok(NodeFit::NoFit(NoFit::NoSolution)) => {
                    prop_assert!(!verdict.devices_fit, "{}: no solution, the search finds one", node.name);
                }
                Ok(NodeFit::NoFit(NoFit::BudgetExhausted)) => prop_assert!(false, "{}: budget exhausted on a tiny input", node.name),
                Err(e) => {
                    prop_assert!(verdict.cel_error && e.message.contains("CEL runtime error"), "{}: {e}", node.name);
                }
            }
        }
    }
}

/// Takes away what could make a re-plan fail for want of CPU, memory or pod slots, so
/// that the devices alone decide.
fn without_resource_contention(mut cluster: ClusterSpec, mut gang: GangSpec) -> (ClusterSpec, GangSpec) {
    for node in &mut cluster.nodes {
        node.pods = 110;
    }
    for group in &mut gang.groups {
        group.cpu_millis = 0;
        group.memory_gib = 0;
    }
    (cluster, gang)
}

proptest! {
    #![proptest_config(config(128))]

    /// Property 5, continued: a gang whose claims a plan allocated keeps fitting once
    /// those allocations are recorded in the cluster (as the watch reports them) and
    /// handed back as the claims' existing allocations: the previous plan is a witness.
    /// The pods are placed where their allocations allow, and the allocated claims are
    /// not allocated again.
    #[test]
    fn a_gang_with_allocated_claims_still_fits(
        (cluster_spec, gang_spec) in scenario().prop_map(|(c, g)| without_resource_contention(c, g)),
    ) {
        let options = PlanOptions::default();
        let mut cluster = build_cluster(&cluster_spec, false);
        let mut gang = build_gang("g", &gang_spec);
        let Outcome::Placed(first) = placement::plan(&cluster, &gang, &options) else {
            return Ok(());
        };
        let mut world_taken = BTreeSet::new();
        for claim in &first.claims {
            cluster.set_claim_allocation(&claim.claim, Some(claim.allocation.devices.clone()));
            world_taken.extend(claim.allocation.devices.iter().map(DeviceResult::device_id));
            for shared in &mut gang.shared_claims {
                if shared.key == claim.claim {
                    shared.allocation = Some(claim.allocation.clone());
                }
            }
            for pod in gang.groups.iter_mut().flat_map(|g| &mut g.pods) {
                if let Some(own) = pod.claims.iter_mut().find(|own| own.key == claim.claim) {
                    own.allocation = Some(claim.allocation.clone());
                }
            }
        }
        let again = placement::plan(&cluster, &gang, &options);
        // Selectors are evaluated lazily, as kube-scheduler's are: with some devices
        // taken, the allocator may reach a device the first plan never looked at, and a
        // runtime error there fails the plan as it fails kube-scheduler's filter.
        if is_cel_error(&again) {
            return Ok(());
        }
        let Outcome::Placed(plan) = &again else {
            return Err(fail(format!("placed before on {:?}, now {again:?}", first.nodes())));
        };
        let mut world = World::new(&cluster, &cluster_spec);
        world.taken.extend(world_taken);
        check_plan(&world, &gang, plan).map_err(fail)?;
        let placed = placed_nodes(plan);
        for group in &gang.groups {
            for pod in &group.pods[..group.min_count] {
                let node = placed.get(pod.key.as_str()).ok_or_else(|| fail(format!("core pod {} not placed", pod.key)))?;
                let node = cluster.node(node).expect("placed on a known node");
                for allocation in pod.claims.iter().filter_map(|c| c.allocation.as_ref()) {
                    let admits = allocation.node_selector.as_ref().is_none_or(|s| s.matches(&node.name, &node.labels));
                    prop_assert!(admits, "pod {} placed on {}, its allocation says otherwise", pod.key, node.name);
                }
            }
        }
        let reallocated: Vec<&str> = plan
            .claims
            .iter()
            .map(|c| c.claim.as_str())
            .filter(|c| first.claims.iter().any(|f| f.claim == *c))
            .collect();
        prop_assert!(reallocated.is_empty(), "allocated again: {reallocated:?}");
    }
}

/// The smallest case of the bug above: one node with one GPU, one pod asking for it.
#[test]
fn a_pod_whose_claim_is_allocated_still_fits_on_its_node() {
    let mut cluster = fixtures::gpu_cluster(1, 1, 1, 1);
    let mut gang = fixtures::gpu_gang("g", 1, 1, None, None);
    let first = placement::plan(&cluster, &gang, &PlanOptions::default());
    let claim = &first.plan().expect("fits on the empty cluster").claims[0];
    cluster.set_claim_allocation(&claim.claim, Some(claim.allocation.devices.clone()));
    gang.groups[0].pods[0].claims[0].allocation = Some(claim.allocation.clone());
    let again = placement::plan(&cluster, &gang, &PlanOptions::default());
    let plan = again.plan().unwrap_or_else(|| panic!("{again:?}"));
    assert_eq!(plan.nodes(), ["node-00000"]);
    assert!(plan.claims.is_empty(), "nothing new to allocate");
}

/// A change the watch could report, applied to the spec and to a live state alike.
#[derive(Clone, Debug)]
enum Change {
    /// Another pod's usage of a node changes.
    Usage {
        node: usize,
        cpu_pct: i64,
        memory_pct: i64,
        pods: i64,
    },
    /// The other claim of a node takes or releases one of its devices.
    Take { node: usize, device: usize, taken: bool },
    /// A node's labels, taint or CPU change.
    Node {
        node: usize,
        labels: Labels,
        taint: Option<NodeTaintEffect>,
        cpu_cores: i64,
    },
    /// A node's slice is republished with other devices.
    Devices { node: usize, devices: Vec<DeviceSpec> },
    /// A node's slice is deleted, and the other claim releases its devices.
    DropSlice { node: usize },
    /// A node is deleted and comes back as it was.
    Recreate { node: usize },
    /// A node is cordoned or uncordoned.
    Cordon { node: usize, unschedulable: bool },
    /// The one-model class selects another model.
    Class { model: usize },
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        (any::<usize>(), 0i64..=100, 0i64..=100, 0i64..=2).prop_map(|(node, cpu_pct, memory_pct, pods)| {
            Change::Usage {
                node,
                cpu_pct,
                memory_pct,
                pods,
            }
        }),
        (any::<usize>(), any::<usize>(), any::<bool>()).prop_map(|(node, device, taken)| Change::Take {
            node,
            device,
            taken
        }),
        (
            any::<usize>(),
            labels_strategy(),
            prop::option::of(Just(NodeTaintEffect::NoSchedule)),
            prop_oneof![Just(16i64), Just(64i64)],
        )
            .prop_map(|(node, labels, taint, cpu_cores)| Change::Node {
                node,
                labels,
                taint,
                cpu_cores,
            }),
        (any::<usize>(), prop::collection::vec(device_spec(GENERAL), 0..=8))
            .prop_map(|(node, devices)| Change::Devices { node, devices }),
        any::<usize>().prop_map(|node| Change::DropSlice { node }),
        any::<usize>().prop_map(|node| Change::Recreate { node }),
        (any::<usize>(), any::<bool>()).prop_map(|(node, unschedulable)| Change::Cordon { node, unschedulable }),
        (0usize..3).prop_map(|model| Change::Class { model }),
    ]
}

/// Applies `change` to the spec, and to `cluster` the way the watch would.
fn apply(spec: &mut ClusterSpec, cluster: &mut ClusterState, change: &Change) {
    let i = match change {
        Change::Class { model } => {
            spec.class_model = *model;
            cluster.upsert_class(model_class(*model));
            return;
        }
        Change::Usage { node, .. }
        | Change::Take { node, .. }
        | Change::Node { node, .. }
        | Change::Devices { node, .. }
        | Change::DropSlice { node }
        | Change::Recreate { node }
        | Change::Cordon { node, .. } => node % spec.nodes.len(),
    };
    let name = node_name(i);
    let node = &mut spec.nodes[i];
    match change {
        Change::Usage {
            cpu_pct,
            memory_pct,
            pods,
            ..
        } => {
            node.used_cpu_millis = node.cpu_cores * 1000 * cpu_pct / 100;
            node.used_memory_gib = node.memory_gib * memory_pct / 100;
            node.used_pods = (*pods).min(node.pods);
            cluster.upsert_pod(&format!("other/{name}-pod").into(), &name, usage_of(node));
        }
        Change::Take { device, taken, .. } => {
            if node.devices.is_empty() {
                return;
            }
            let d = device % node.devices.len();
            node.devices[d].taken = *taken;
            let held = taken_in(&name, "gpu", &node.devices);
            cluster.set_claim_allocation(&format!("other/{name}").into(), (!held.is_empty()).then_some(held));
        }
        Change::Node {
            labels,
            taint,
            cpu_cores,
            ..
        } => {
            node.labels = *labels;
            node.taint = *taint;
            node.cpu_cores = *cpu_cores;
            node.used_cpu_millis = node.used_cpu_millis.min(cpu_cores * 1000);
            cluster.upsert_node(engine_node(i, node));
            cluster.upsert_pod(&format!("other/{name}-pod").into(), &name, usage_of(node));
        }
        Change::Devices { devices, .. } => {
            node.devices = devices.clone();
            cluster.upsert_slice(fixtures::node_slice(&name, node_devices(node)));
            let held = taken_in(&name, "gpu", &node.devices);
            cluster.set_claim_allocation(&format!("other/{name}").into(), (!held.is_empty()).then_some(held));
        }
        Change::DropSlice { .. } => {
            node.devices.clear();
            cluster.remove_slice(&format!("{name}-{GPU}"));
            cluster.set_claim_allocation(&format!("other/{name}").into(), None);
        }
        Change::Recreate { .. } => {
            cluster.remove_node(&name);
            cluster.upsert_node(engine_node(i, node));
        }
        Change::Cordon { unschedulable, .. } => {
            node.unschedulable = *unschedulable;
            cluster.upsert_node(engine_node(i, node));
        }
        Change::Class { .. } => {}
    }
}

proptest! {
    #![proptest_config(config(96))]

    /// Property 7, continued: a state kept up to date change by change, and planned
    /// between the changes, plans like one built from scratch.
    #[test]
    fn an_updated_state_plans_like_a_fresh_one(
        (spec, gang_spec) in scenario(),
        changes in prop::collection::vec(change(), 1..=6),
    ) {
        let options = PlanOptions::default();
        let gang = build_gang("g", &gang_spec);
        let mut spec = spec;
        let mut live = build_cluster(&spec, false);
        let _ = placement::plan(&live, &gang, &options);
        for (step, change) in changes.iter().enumerate() {
            apply(&mut spec, &mut live, change);
            let fresh = build_cluster(&spec, false);
            prop_assert_eq!(
                placement::plan(&live, &gang, &options),
                placement::plan(&fresh, &gang, &options),
                "after change {} ({:?})",
                step,
                change
            );
        }
    }
}

fn devices_of(plan: &Plan) -> BTreeSet<DeviceId> {
    plan.claims
        .iter()
        .flat_map(|c| c.allocation.devices.iter().map(DeviceResult::device_id))
        .collect()
}

fn second_gang() -> impl Strategy<Value = (GangSpec, GangSpec)> {
    gang_spec().prop_flat_map(|first| {
        let same = Just(first.clone());
        (Just(first), prop_oneof![same, gang_spec()])
    })
}

proptest! {
    #![proptest_config(config(128))]

    /// Property 9: a plan entered with `assume` is respected by the next plan (no
    /// device twice, its pods' resources counted) exactly as if the cluster showed it,
    /// and after `forget` planning gives what it gave before.
    #[test]
    fn assumed_plans_are_respected_and_forgotten(
        cluster_spec in cluster_spec(1..=24, 8, GENERAL),
        (a_spec, b_spec) in second_gang(),
    ) {
        let options = PlanOptions::default();
        let (a, b) = (build_gang("a", &a_spec), build_gang("b", &b_spec));
        let mut cluster = build_cluster(&cluster_spec, false);
        let a_before = placement::plan(&cluster, &a, &options);
        let b_alone = placement::plan(&cluster, &b, &options);
        let Outcome::Placed(a_plan) = &a_before else {
            cluster.forget(&PlanId::Gang("ns/a".into()));
            prop_assert_eq!(&placement::plan(&cluster, &b, &options), &b_alone);
            return Ok(());
        };
        let (pods, claims) = a_plan.assumption(&a);
        cluster.assume(&PlanId::Gang("ns/a".into()), &pods, &claims);

        let b_outcome = placement::plan(&cluster, &b, &options);
        if let Outcome::Placed(b_plan) = &b_outcome {
            let mut world = World::new(&cluster, &cluster_spec);
            world.add_plan(&a, a_plan);
            let reused: Vec<_> = devices_of(b_plan).intersection(&devices_of(a_plan)).cloned().collect();
            prop_assert!(reused.is_empty(), "b reuses a's devices {reused:?}");
            check_plan(&world, &b, b_plan).map_err(fail)?;
        }
        // The same as a state that shows a's pods and claims for real.
        let mut shown = build_cluster(&cluster_spec, false);
        for assumed in &pods {
            shown.upsert_pod(&assumed.pod, &assumed.node, assumed.requests.clone());
        }
        for assumed in &claims {
            shown.set_claim_allocation(&assumed.claim, Some(assumed.devices.clone()));
        }
        prop_assert_eq!(&placement::plan(&shown, &b, &options), &b_outcome, "assumed vs shown");

        cluster.forget(&PlanId::Gang("ns/a".into()));
        prop_assert_eq!(&placement::plan(&cluster, &a, &options), &a_before, "a after forget");
        prop_assert_eq!(&placement::plan(&cluster, &b, &options), &b_alone, "b after forget");
    }
}

// ---- found by exploring the properties ----

/// When no single value of the preferred label holds the gang, `place_in_domain` orders
/// the nodes to spread over as few values as possible (roomiest first), but `place_on`
/// sorts them again tightest first per group, so that order is lost. Here rack-0 has
/// room for two of the three pods and any other rack for the third: two racks suffice,
/// yet the gang lands on three.
#[test]
fn a_gang_spread_over_preferred_values_uses_as_few_as_it_can() {
    let mut cluster = ClusterState::new();
    cluster.upsert_class(fixtures::gpu_class());
    for (name, rack, gpus) in [("a", "rack-0", 8), ("b", "rack-1", 4), ("c", "rack-2", 4)] {
        cluster.upsert_node(fixtures::node(name, 64, 512, &[(RACK, rack)]));
        cluster.upsert_slice(fixtures::node_slice(
            name,
            (0..gpus).map(|g| fixtures::gpu(g, "H100")).collect(),
        ));
    }
    let gang = fixtures::gpu_gang("g", 3, 4, None, Some(RACK));
    let outcome = placement::plan(&cluster, &gang, &PlanOptions::default());
    let plan = outcome.plan().expect("the gang fits");
    assert_eq!(
        plan.preferred_values.len(),
        2,
        "pods on {:?}",
        plan.pods.iter().map(|p| &p.node).collect::<Vec<_>>()
    );
}

// ---- gangs whose groups compete for devices ----

/// Nodes for [`overlapping_gang`]: unlabelled, untainted, 1 to 4 cores, up to 4 free
/// devices of the first two models; at most 4 nodes, so at most 16 devices.
fn competing_cluster() -> impl Strategy<Value = ClusterSpec> {
    let device = (0usize..2).prop_map(|model| DeviceSpec {
        model,
        nvlink: Some(0),
        taken: false,
    });
    let node = (1i64..=4, prop::collection::vec(device, 0..=4)).prop_map(|(cpu_cores, devices)| NodeSpec {
        labels: Labels::Unlabelled,
        cpu_cores,
        memory_gib: 16,
        pods: 110,
        used_cpu_millis: 0,
        used_memory_gib: 0,
        used_pods: 0,
        taint: None,
        unschedulable: false,
        devices,
    });
    prop::collection::vec(node, 1..=4).prop_map(|nodes| ClusterSpec {
        nodes,
        shared: None,
        class_model: 0,
    })
}

/// 2 or 3 groups of 1 or 2 pods, each pod with one claim for 1 to 3 devices of any
/// model (a superset of the others' choices), of one model, or of any but one; 0.5 to 2
/// cores each.
fn overlapping_gang() -> impl Strategy<Value = GangSpec> {
    let selectors = prop_oneof![
        Just(vec![]),
        (0usize..2).prop_map(|m| vec![Sel::ModelIs(m)]),
        (0usize..2).prop_map(|m| vec![Sel::ModelIsNot(m)]),
    ];
    let group = (
        1usize..=2,
        1u32..=3,
        selectors,
        prop_oneof![Just(500i64), Just(1000), Just(2000)],
    )
        .prop_map(|(pods, count, selectors, cpu_millis)| GroupSpec {
            replicas: pods,
            min_count: pods,
            cpu_millis,
            memory_gib: 1,
            tolerate: false,
            claims: vec![ClaimGen {
                requests: vec![ReqSpec::Exactly(SubSpec {
                    h100_class: false,
                    count,
                    selectors,
                })],
                constraints: vec![],
            }],
        });
    prop::collection::vec(group, 2..=3).prop_map(|groups| GangSpec {
        groups,
        shared: vec![],
        required: None,
        preferred: None,
    })
}

/// Exhaustive search over every pod's node: a node takes its pods if their CPU,
/// memory and pod slots fit and the claims of all of them can be satisfied together
/// from its devices (every device choice tried, by [`Oracle`]).
fn brute_force_gang_fits(cluster: &ClusterSpec, gang: &GangSpec) -> bool {
    brute_force_gang_fits_where(cluster, gang, |_| true)
}

/// As [`brute_force_gang_fits`], counting only assignments (node per required pod,
/// groups in order) that `allowed` accepts.
fn brute_force_gang_fits_where(cluster: &ClusterSpec, gang: &GangSpec, allowed: impl Fn(&[usize]) -> bool) -> bool {
    let pods: Vec<&GroupSpec> = gang
        .groups
        .iter()
        .flat_map(|g| std::iter::repeat_n(g, g.min_count))
        .collect();
    let mut nodes_of = vec![0usize; pods.len()];
    loop {
        let node_takes = |i: usize| {
            let node = &cluster.nodes[i];
            let on_node: Vec<&GroupSpec> = pods
                .iter()
                .zip(&nodes_of)
                .filter(|(_, n)| **n == i)
                .map(|(p, _)| *p)
                .collect();
            let cpu: i64 = on_node.iter().map(|p| p.cpu_millis).sum();
            let memory: i64 = on_node.iter().map(|p| p.memory_gib).sum();
            if cpu > node.cpu_cores * 1000 - node.used_cpu_millis
                || memory > node.memory_gib - node.used_memory_gib
                || on_node.len() as i64 > node.pods - node.used_pods
            {
                return false;
            }
            let claims: Vec<ClaimGen> = on_node.iter().flat_map(|p| p.claims.iter().cloned()).collect();
            let devices = oracle_devices(cluster, i);
            let mut oracle = Oracle {
                claims: &claims,
                specs: claims.iter().map(claim_spec).collect(),
                devices: &devices,
                used: vec![false; devices.len()],
                picks: vec![],
            };
            oracle.solve(0, 0)
        };
        if allowed(&nodes_of) && (0..cluster.nodes.len()).all(node_takes) {
            return true;
        }
        // The next assignment, counting in base (number of nodes).
        let mut digit = 0;
        loop {
            if digit == nodes_of.len() {
                return false;
            }
            nodes_of[digit] += 1;
            if nodes_of[digit] < cluster.nodes.len() {
                break;
            }
            nodes_of[digit] = 0;
            digit += 1;
        }
    }
}

proptest! {
    #![proptest_config(config(512))]

    /// Property 10: on up to 4 nodes and 16 devices, a gang of 2 or 3 groups whose
    /// selectors overlap (one may accept a superset of what another needs) is placed
    /// whenever an exhaustive search over every pod's node and devices finds a
    /// placement, and only then; every plan is valid.
    #[test]
    fn a_gang_is_placed_whenever_brute_force_places_it(
        cluster_spec in competing_cluster(),
        gang_spec in overlapping_gang(),
    ) {
        let cluster = build_cluster(&cluster_spec, false);
        let gang = build_gang("g", &gang_spec);
        let outcome = placement::plan(&cluster, &gang, &PlanOptions::default());
        let fits = brute_force_gang_fits(&cluster_spec, &gang_spec);
        match &outcome {
            Outcome::Placed(plan) => {
                prop_assert!(fits, "placed, yet the exhaustive search finds no placement: {plan:?}");
                let world = World::new(&cluster, &cluster_spec);
                check_plan(&world, &gang, plan).map_err(fail)?;
            }
            Outcome::Unschedulable(u) => {
                prop_assert!(!fits, "the exhaustive search places the gang, the engine does not: {u}");
            }
        }
    }
}

// ---- groups with levels of their own ----

/// A group's own levels in [`levelled_gang`]: all in one block, and slices of
/// `slice` pods each in one rack.
#[derive(Clone, Copy, Debug)]
struct GroupLevels {
    one_block: bool,
    slice: Option<usize>,
}

/// [`competing_cluster`] with every node in a rack (0 to 3) and so a block (rack / 2).
fn levelled_cluster() -> impl Strategy<Value = ClusterSpec> {
    (competing_cluster(), prop::collection::vec(0u8..4, 4)).prop_map(|(mut cluster, racks)| {
        for (node, rack) in cluster.nodes.iter_mut().zip(racks) {
            node.labels = Labels::RackAndBlock(rack);
        }
        cluster
    })
}

/// [`overlapping_gang`] with 1 to 3 groups, each with or without its own block, and
/// with or without slices of 1 or 2 pods.
fn levelled_gang() -> impl Strategy<Value = (GangSpec, Vec<GroupLevels>)> {
    let levels =
        (any::<bool>(), prop::option::of(1usize..=2)).prop_map(|(one_block, slice)| GroupLevels { one_block, slice });
    (overlapping_gang(), prop::collection::vec(levels, 3)).prop_map(|(mut gang, levels)| {
        gang.groups.truncate(levels.len());
        (gang, levels)
    })
}

fn with_levels(mut gang: GangRequest, levels: &[GroupLevels]) -> GangRequest {
    for (group, levels) in gang.groups.iter_mut().zip(levels) {
        group.topology = GroupTopology {
            required: levels.one_block.then(|| BLOCK.to_string()),
            slice: levels.slice.map(|size| SliceRequest {
                key: RACK.to_string(),
                size,
            }),
        };
    }
    gang
}

/// Whether pods `nodes` (node per pod, in pod order) keep `levels`.
fn keeps_levels(cluster: &ClusterSpec, nodes: &[usize], levels: GroupLevels) -> bool {
    let label = |n: usize, key: &str| -> Option<String> {
        labels_of(cluster.nodes[n].labels)
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    };
    let same = |nodes: &[usize], key: &str| {
        nodes
            .iter()
            .all(|n| label(*n, key).is_some() && label(*n, key) == label(nodes[0], key))
    };
    (!levels.one_block || same(nodes, BLOCK))
        && levels
            .slice
            .is_none_or(|size| nodes.chunks(size).all(|chunk| same(chunk, RACK)))
}

proptest! {
    #![proptest_config(config(384))]

    /// Property 11: a gang whose groups keep to one block or to slices each in one rack
    /// is placed whenever an exhaustive search over every pod's node and devices finds a
    /// placement that keeps those levels, and every plan keeps them.
    #[test]
    fn a_gang_with_group_levels_is_placed_whenever_brute_force_places_it(
        cluster_spec in levelled_cluster(),
        (gang_spec, levels) in levelled_gang(),
    ) {
        let cluster = build_cluster(&cluster_spec, false);
        let gang = with_levels(build_gang("g", &gang_spec), &levels);
        let outcome = placement::plan(&cluster, &gang, &PlanOptions::default());
        let fits = brute_force_gang_fits_where(&cluster_spec, &gang_spec, |nodes_of| {
            let mut start = 0;
            gang_spec.groups.iter().zip(&levels).all(|(group, levels)| {
                let nodes = &nodes_of[start..start + group.min_count];
                start += group.min_count;
                keeps_levels(&cluster_spec, nodes, *levels)
            })
        });
        match &outcome {
            Outcome::Placed(plan) => {
                prop_assert!(fits, "placed, yet the exhaustive search finds no placement: {plan:?}");
                let world = World::new(&cluster, &cluster_spec);
                check_plan(&world, &gang, plan).map_err(fail)?;
                for (group, levels) in gang.groups.iter().zip(&levels) {
                    let nodes: Vec<usize> = group
                        .pods
                        .iter()
                        .filter_map(|p| plan.pods.iter().find(|placed| placed.pod == p.key))
                        .map(|placed| cluster_spec.nodes.iter().enumerate().position(|(i, _)| node_name(i) == placed.node).expect("a node of the cluster"))
                        .collect();
                    prop_assert!(keeps_levels(&cluster_spec, &nodes, *levels), "group {} does not keep {levels:?}: {plan:?}", group.name);
                }
            }
            Outcome::Unschedulable(u) => {
                prop_assert!(!fits, "the exhaustive search places the gang, the engine does not: {u}");
            }
        }
    }
}
