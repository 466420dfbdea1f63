//! Differential fidelity: randomised single-pod cases go both to muster's engine and to a
//! real kube-scheduler, and any disagreement fails the test. A case is a DRA half (devices,
//! classes, a claim) and a scene (`differential/scene.rs`): pods already on nodes, volumes
//! and claims, and the pod's labels, inter-pod (anti-)affinity, topology spread, node
//! selection, host ports and volumes.
//!
//! Every case publishes fresh ResourceSlices (fresh pool names) for the fleet's nodes,
//! fresh DeviceClasses, a standalone ResourceClaim and a pod using it. Sometimes other
//! pods first take a few devices with claims that kube-scheduler allocates. The engine
//! plans the pod from the objects read back from the API server (with the claim as a
//! claim shared by name and as the pod's own claim, on the whole cluster and on each
//! node alone); then kube-scheduler gets the pod, and its first verdict counts: bound,
//! or `PodScheduled=False` (unschedulable, or an error such as a CEL runtime error; an
//! engine error counts as "not scheduled" too). Both must agree on whether the pod
//! fits; when kube-scheduler binds it, the engine must fit it on that node alone; and
//! when the engine fits it on exactly one node alone, kube-scheduler must pick that one.
//!
//! kube-scheduler works from informer caches. Before it gets the pods of a case, a fence
//! pod must be bound whose device, class, claim, PersistentVolumeClaim and
//! PersistentVolume were written after every other object of the case (and which comes
//! after the case's pods): each informer delivers events in order, so the scheduler then
//! knows the whole case. StorageClasses and CSINodes are written once, before any case.
//!
//! `MUSTER_DIFF_SEED` (decimal or 0x-hex) and `MUSTER_DIFF_CASES` override the seed and
//! the number of cases; `MUSTER_DIFF_ONLY=<case>` runs one case of the seed (each case
//! draws from its own generator, seeded by the seed and the case number).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{LimitRange, Namespace, Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use muster::snapshot::Objects;
use muster_e2e::rng::Rng;
use muster_e2e::storage::static_class;
use muster_e2e::testing::{delete_namespace, namespace, shared_cluster};
use muster_engine::claim::ClaimSpec;
use muster_engine::key::{ClaimKey, PodKey};
use muster_engine::placement::{self, Outcome, PlanOptions};
use muster_engine::request::{GangRequest, GroupRequest, PodClaim, PodInstance, SharedClaim};
use muster_local_cluster::fleet::{FleetSpec, create_or_keep};
use muster_local_cluster::wait;
use serde_json::{Map, Value, json};

/// The driver of the generated devices, and the domain of most of their attributes.
const DRIVER: &str = "dra.example.com";
/// A second attribute domain (fully qualified attribute names).
const TOPO: &str = "topo.example.com";
/// The driver of the fence devices.
const FENCE_DRIVER: &str = "fence.example.com";
/// The fence's ResourceSlice, rewritten by every case.
const FENCE_SLICE: &str = "differential-fence";
/// The class of the devices other pods take, by their `uid` attribute.
const ANY_CLASS: &str = "differential-any";
/// Label of every object a case creates; its value is the case prefix.
const CASE_LABEL: &str = "e2e.muster.dev/case";
/// Keeps a case's pods readable until the next case: kube-controller-manager evicts a
/// pod whose device has a NoExecute taint its claim does not tolerate explicitly, maybe
/// before the verdict is read.
const KEEP_FINALIZER: &str = "e2e.muster.dev/keep";

#[path = "differential/admitted.rs"]
mod admitted;
#[path = "differential/scene.rs"]
mod scene;

const DEFAULT_SEED: u64 = 0x6d75_7374_6572_0001;
const DEFAULT_CASES: usize = 400;
const NODES: usize = 4;
/// How long kube-scheduler may take for one verdict.
const VERDICT_TIMEOUT: Duration = Duration::from_secs(60);

// ---- case generation ----

const MODELS: &[&str] = &["a100", "h100", "l4", "mi300"];
const VERSIONS: &[&str] = &["0.9.12", "1.2.3", "1.10.0", "2.0.0-rc.1", "2.0.0", "2.1.0+build.5"];
const MEMORY: &[&str] = &["8Gi", "16Gi", "24Gi", "40Gi", "80Gi", "81920Mi", "500M"];
const CORES: &[&str] = &["2", "4", "8", "16", "1500m"];
const MATCH_ATTRIBUTES: &[&str] = &[
    "dra.example.com/model",
    "dra.example.com/numa",
    "dra.example.com/pcie",
    "dra.example.com/fw",
    "dra.example.com/ecc",
    "dra.example.com/mixed",
    "topo.example.com/rack",
];
const DISTINCT_ATTRIBUTES: &[&str] = &[
    "dra.example.com/uid",
    "dra.example.com/index",
    "dra.example.com/numa",
    "dra.example.com/pcie",
    "dra.example.com/model",
    "topo.example.com/rack",
];

/// One generated case: the objects it creates, in creation order.
struct Case {
    number: usize,
    /// Name prefix of the case's objects, and the value of [`CASE_LABEL`].
    prefix: String,
    classes: Vec<Value>,
    slices: Vec<Value>,
    /// Claims and pods that take devices before the pod under test.
    blockers: Vec<(Value, Value)>,
    /// The pod's DRA claim, if it has one.
    claim: Option<Value>,
    pod: Value,
    scene: scene::Scene,
    /// The LimitRange and RuntimeClass the pod under test is stored with.
    admission: admitted::Admission,
}

fn labels(prefix: &str) -> Value {
    json!({ CASE_LABEL: prefix })
}

/// Case `number` of `seed` on the fleet's `nodes`, in namespace `main` (with `other` the
/// second namespace of the run).
fn generate(seed: u64, number: usize, nodes: &[String], main: &str, other: &str) -> Case {
    let mut rng = Rng::for_case(seed, number);
    let prefix = format!("c{number:04}");

    // Devices, per node.
    let sparse = rng.chance(35);
    let mode = Mode {
        shared: rng.chance(25),
        counters: rng.chance(20),
    };
    let mut inventory: Vec<NodeDevices> = Vec::new();
    let mut slices = Vec::new();
    for node in nodes {
        let weights: &[u64] = if sparse {
            &[40, 20, 15, 10, 5, 5, 5]
        } else {
            &[8, 14, 20, 20, 14, 12, 12]
        };
        let count = rng.weighted(weights);
        let pool = format!("{prefix}-{node}");
        // A partitionable pool: devices share counters of one set.
        let counters = (mode.counters && count > 0 && rng.chance(60)).then(|| *rng.pick(&[40, 64, 80]));
        let (devices, infos): (Vec<Value>, Vec<DeviceInfo>) = (0..count)
            .map(|i| device(&mut rng, node, i, mode, counters.is_some()))
            .unzip();
        inventory.push(NodeDevices {
            devices: infos,
            counters,
        });
        if count == 0 && rng.chance(50) {
            continue; // no slice at all
        }
        let parts: Vec<Vec<Value>> = if count >= 2 && rng.chance(20) {
            let cut = rng.range(1, count - 1);
            vec![devices[..cut].to_vec(), devices[cut..].to_vec()]
        } else {
            vec![devices]
        };
        let total = parts.len() + usize::from(counters.is_some());
        let slice = |name: String, content: (&str, Value)| {
            let mut spec = json!({
                "driver": DRIVER,
                "nodeName": node,
                "pool": {"name": pool, "generation": number + 1, "resourceSliceCount": total},
            });
            spec[content.0] = content.1;
            json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": name, "labels": labels(&prefix)},
                "spec": spec,
            })
        };
        let split = parts.len() > 1;
        for (i, part) in parts.into_iter().enumerate() {
            let name = if split {
                format!("{pool}-{}", ["a", "b"][i])
            } else {
                pool.clone()
            };
            slices.push(slice(name, ("devices", json!(part))));
        }
        if let Some(total) = counters {
            let sets = json!([{"name": "mem", "counters": {"memory": {"value": format!("{total}Gi")}}}]);
            slices.push(slice(format!("{pool}-counters"), ("sharedCounters", sets)));
        }
    }

    // Classes: every one selects the driver first, some select more.
    let class_names: Vec<String> = (0..if rng.chance(40) { 2 } else { 1 })
        .map(|i| format!("{prefix}-{}", ["x", "y"][i]))
        .collect();
    let classes = class_names
        .iter()
        .map(|name| {
            let mut selectors = vec![json!({"cel": {"expression": format!("device.driver == '{DRIVER}'")}})];
            if rng.chance(35) {
                selectors.push(json!({"cel": {"expression": selector(&mut rng, nodes, 3)}}));
            }
            json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": name, "labels": labels(&prefix)},
                "spec": {"selectors": selectors},
            })
        })
        .collect();

    // The claim under test.
    let mut requests = Vec::new();
    let mut names: Vec<(String, Vec<String>)> = Vec::new();
    for r in 0..if rng.chance(35) { 2 } else { 1 } {
        let name = format!("r{r}");
        if rng.chance(30) {
            let subs: Vec<String> = (0..rng.range(2, 3)).map(|s| format!("s{s}")).collect();
            let subrequests: Vec<Value> = subs
                .iter()
                .map(|s| {
                    let mut spec = request_spec(&mut rng, &class_names, nodes, mode);
                    spec.insert("name".into(), json!(s));
                    Value::Object(spec)
                })
                .collect();
            requests.push(json!({"name": name, "firstAvailable": subrequests}));
            names.push((name, subs));
        } else {
            requests.push(json!({"name": name, "exactly": request_spec(&mut rng, &class_names, nodes, mode)}));
            names.push((name, vec![]));
        }
    }
    let mut devices = json!({"requests": requests});
    if rng.chance(35) {
        let constraints: Vec<Value> = (0..rng.range(1, 2)).map(|_| constraint(&mut rng, &names)).collect();
        devices["constraints"] = json!(constraints);
    }
    let claim_name = format!("{prefix}-claim");
    let claim = json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": claim_name, "labels": labels(&prefix)},
        "spec": {"devices": devices},
    });

    // Other pods' claims, each taking one or two devices of one node by their uid (and
    // part of a shareable device's capacity), always allocatable.
    let mut blockers = Vec::new();
    if rng.chance(if mode.shared { 60 } else { 35 }) {
        let mut taken: BTreeSet<String> = BTreeSet::new();
        let mut counters_left: Vec<Option<u64>> = inventory.iter().map(|n| n.counters).collect();
        for b in 0..if rng.chance(30) { 2 } else { 1 } {
            let fits = |node: usize, d: &DeviceInfo, left: &[Option<u64>], taken: &BTreeSet<String>| {
                !taken.contains(&d.uid) && left[node].is_none_or(|l| d.consumes <= l)
            };
            let candidates: Vec<usize> = (0..inventory.len())
                .filter(|n| {
                    inventory[*n]
                        .devices
                        .iter()
                        .any(|d| fits(*n, d, &counters_left, &taken))
                })
                .collect();
            if candidates.is_empty() {
                break;
            }
            let node = *rng.pick(&candidates);
            let mut requests = Vec::new();
            for _ in 0..rng.range(1, 2) {
                let mut free: Vec<&DeviceInfo> = inventory[node]
                    .devices
                    .iter()
                    .filter(|d| fits(node, d, &counters_left, &taken))
                    .collect();
                if free.is_empty() {
                    break;
                }
                if free.iter().any(|d| d.shareable) && rng.chance(70) {
                    free.retain(|d| d.shareable);
                }
                let d = *rng.pick(&free);
                taken.insert(d.uid.clone());
                if let Some(left) = &mut counters_left[node] {
                    *left -= d.consumes;
                }
                let mut request = json!({
                    "deviceClassName": ANY_CLASS,
                    "selectors": [{"cel": {"expression": format!("device.attributes['{DRIVER}'].uid == '{}'", d.uid)}}],
                    "tolerations": [
                        {"operator": "Exists", "effect": "NoSchedule"},
                        {"operator": "Exists", "effect": "NoExecute"},
                    ],
                });
                if d.shareable && rng.chance(70) {
                    let wanted = if !d.cores || rng.chance(60) {
                        json!({"memory": rng.pick(&["8Gi", "40Gi"])})
                    } else {
                        json!({"cores": rng.pick(&["500m", "1200m"])})
                    };
                    request["capacity"] = json!({"requests": wanted});
                }
                requests.push(json!({"name": format!("b{}", requests.len()), "exactly": request}));
            }
            let name = format!("{prefix}-b{b}");
            let blocker_claim = json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "labels": labels(&prefix)},
                "spec": {"devices": {"requests": requests}},
            });
            blockers.push((blocker_claim, pod_object(&prefix, &name, Some(&name))));
        }
    }

    let mut scene = scene::generate(seed, number, nodes, main, other);
    let claim = scene.with_claim.then_some(claim);
    let mut pod = pod_object(
        &prefix,
        &format!("{prefix}-pod"),
        claim.as_ref().map(|_| claim_name.as_str()),
    );
    for (key, value) in &scene.labels {
        pod["metadata"]["labels"][key] = value.clone();
    }
    for (key, value) in &scene.spec {
        pod["spec"][key] = value.clone();
    }
    if !scene.ports.is_empty() {
        pod["spec"]["containers"][0]["ports"] = json!(scene.ports);
    }
    let admission = admitted::generate(
        seed,
        number,
        &prefix,
        &mut pod,
        &mut scene.residents,
        &mut scene.features,
    );
    Case {
        number,
        prefix,
        classes,
        slices,
        blockers,
        claim,
        pod,
        scene,
        admission,
    }
}

/// Features a case uses beyond plain devices.
#[derive(Clone, Copy)]
struct Mode {
    /// Devices that several claims share by capacity, and requests for capacity.
    shared: bool,
    /// Partitionable devices that consume shared counters.
    counters: bool,
}

/// What the generator remembers of a device, to take it with another pod's claim.
struct DeviceInfo {
    uid: String,
    shareable: bool,
    /// Has a `cores` capacity.
    cores: bool,
    /// GiB of the pool's `mem` counter it consumes.
    consumes: u64,
}

struct NodeDevices {
    devices: Vec<DeviceInfo>,
    /// GiB in the pool's `mem` counter set, if it has one.
    counters: Option<u64>,
}

fn device(rng: &mut Rng, node: &str, index: usize, mode: Mode, counters: bool) -> (Value, DeviceInfo) {
    let mut attributes = Map::new();
    attributes.insert("uid".into(), json!({"string": format!("{node}-d{index}")}));
    attributes.insert("index".into(), json!({"int": index}));
    if rng.chance(85) {
        attributes.insert("model".into(), json!({"string": rng.pick(MODELS)}));
    }
    if rng.chance(70) {
        attributes.insert("ecc".into(), json!({"bool": rng.chance(50)}));
    }
    if rng.chance(80) {
        attributes.insert("fw".into(), json!({"version": rng.pick(VERSIONS)}));
    }
    if rng.chance(80) {
        attributes.insert("numa".into(), json!({"int": rng.below(2)}));
    }
    if rng.chance(60) {
        attributes.insert("pcie".into(), json!({"string": rng.pick(&["p0", "p1", "p2"])}));
    }
    if rng.chance(15) {
        // The same name with different types on different devices.
        let value = if rng.chance(50) {
            json!({"int": 1})
        } else {
            json!({"string": "1"})
        };
        attributes.insert("mixed".into(), value);
    }
    if rng.chance(50) {
        attributes.insert(format!("{TOPO}/rack"), json!({"string": rng.pick(&["r0", "r1"])}));
    }
    let shareable = mode.shared && rng.chance(60);
    let mut capacity = Map::new();
    if shareable {
        // Consumable capacity, with each kind of request policy.
        let memory = match rng.below(4) {
            0 => json!({"value": "80Gi"}),
            1 => json!({"value": "80Gi", "requestPolicy": {"default": "10Gi"}}),
            2 => json!({"value": "80Gi", "requestPolicy": {
                "default": "8Gi",
                "validRange": {"min": "4Gi", "max": "80Gi", "step": "4Gi"},
            }}),
            _ => json!({"value": "80Gi", "requestPolicy": {
                "default": "16Gi",
                "validValues": ["8Gi", "16Gi", "40Gi", "80Gi"],
            }}),
        };
        capacity.insert("memory".into(), memory);
        if rng.chance(60) {
            let cores = if rng.chance(50) {
                json!({"value": "2", "requestPolicy": {"default": "500m", "validRange": {"min": "500m", "step": "500m"}}})
            } else {
                json!({"value": "4"})
            };
            capacity.insert("cores".into(), cores);
        }
    } else {
        if rng.chance(90) {
            capacity.insert("memory".into(), json!({"value": rng.pick(MEMORY)}));
        }
        if rng.chance(60) {
            capacity.insert("cores".into(), json!({"value": rng.pick(CORES)}));
        }
    }
    let mut device = json!({"name": format!("d{index}"), "attributes": attributes, "capacity": capacity});
    if shareable {
        device["allowMultipleAllocations"] = json!(true);
    }
    let mut consumes = 0;
    if counters && rng.chance(75) {
        consumes = *rng.pick(&[16, 24, 40]);
        device["consumesCounters"] = json!([{
            "counterSet": "mem",
            "counters": {"memory": {"value": format!("{consumes}Gi")}},
        }]);
    }
    if rng.chance(20) {
        let mut taint = json!({
            "key": rng.pick(&["maint", "flaky"]),
            "effect": rng.pick(&["NoSchedule", "NoExecute", "NoSchedule", "NoExecute", "None"]),
        });
        if rng.chance(50) {
            taint["value"] = json!("true");
        }
        device["taints"] = json!([taint]);
    }
    let info = DeviceInfo {
        uid: format!("{node}-d{index}"),
        shareable,
        cores: device["capacity"].get("cores").is_some(),
        consumes,
    };
    (device, info)
}

/// `exactly` or a `firstAvailable` entry, without the name.
fn request_spec(rng: &mut Rng, classes: &[String], nodes: &[String], mode: Mode) -> Map<String, Value> {
    let mut spec = Map::new();
    spec.insert("deviceClassName".into(), json!(rng.pick(classes)));
    let selectors: Vec<Value> = (0..rng.weighted(&[40, 45, 15]))
        .map(|_| json!({"cel": {"expression": selector(rng, nodes, 5)}}))
        .collect();
    if !selectors.is_empty() {
        spec.insert("selectors".into(), json!(selectors));
    }
    if rng.chance(12) {
        spec.insert("allocationMode".into(), json!("All"));
    } else {
        let count = [1, 2, 3][rng.weighted(&[60, 28, 12])];
        if count > 1 || rng.chance(50) {
            spec.insert("count".into(), json!(count));
        }
        if rng.chance(20) {
            spec.insert("allocationMode".into(), json!("ExactCount"));
        }
    }
    if rng.chance(30) {
        let options = [
            json!({"operator": "Exists"}),
            json!({"key": "maint", "operator": "Exists"}),
            json!({"key": "flaky", "operator": "Equal", "value": "true"}),
            json!({"key": "maint", "operator": "Exists", "effect": "NoExecute"}),
            json!({"key": "flaky", "operator": "Exists", "effect": "NoSchedule"}),
            json!({"key": "maint", "value": "true", "effect": "NoSchedule"}),
        ];
        let tolerations: Vec<Value> = (0..rng.range(1, 2)).map(|_| rng.pick(&options).clone()).collect();
        spec.insert("tolerations".into(), json!(tolerations));
    }
    if mode.shared && rng.chance(50) {
        let mut wanted = Map::new();
        if rng.chance(75) {
            let memory = rng.pick(&["4Gi", "10Gi", "16Gi", "33Gi", "80Gi", "100Gi"]);
            wanted.insert("memory".into(), json!(memory));
        }
        if wanted.is_empty() || rng.chance(40) {
            wanted.insert("cores".into(), json!(rng.pick(&["500m", "1", "1200m", "2"])));
        }
        spec.insert("capacity".into(), json!({"requests": wanted}));
    }
    spec
}

fn constraint(rng: &mut Rng, requests: &[(String, Vec<String>)]) -> Value {
    let mut constraint = if rng.chance(55) {
        json!({"matchAttribute": rng.pick(MATCH_ATTRIBUTES)})
    } else {
        json!({"distinctAttribute": rng.pick(DISTINCT_ATTRIBUTES)})
    };
    if rng.chance(50) {
        let mut names = Vec::new();
        for (name, subs) in requests {
            if !rng.chance(60) {
                continue;
            }
            if !subs.is_empty() && rng.chance(40) {
                names.push(format!("{name}/{}", rng.pick(subs)));
            } else {
                names.push(name.clone());
            }
        }
        if names.is_empty() {
            names.push(rng.pick(requests).0.clone());
        }
        constraint["requests"] = json!(names);
    }
    constraint
}

/// A CEL selector over the generated attributes. Most guard against missing attributes;
/// `unguarded` % do not, and fail at runtime on devices without the attribute.
fn selector(rng: &mut Rng, nodes: &[String], unguarded: u64) -> String {
    let expression = atom(rng, nodes, unguarded);
    match rng.weighted(&[72, 10, 10, 8]) {
        1 => format!("{expression} && {}", atom(rng, nodes, unguarded)),
        2 => format!("{expression} || {}", atom(rng, nodes, unguarded)),
        3 => format!("!({expression})"),
        _ => expression,
    }
}

fn atom(rng: &mut Rng, nodes: &[String], unguarded: u64) -> String {
    let d = format!("device.attributes['{DRIVER}']");
    let c = format!("device.capacity['{DRIVER}']");
    if rng.chance(unguarded) {
        return match rng.below(6) {
            0 => format!("{d}.model == '{}'", rng.pick(MODELS)),
            1 => format!("{d}.fw.isLessThan(semver('{}'))", rng.pick(VERSIONS)),
            2 => format!("{c}.memory.isGreaterThan(quantity('{}'))", rng.pick(MEMORY)),
            3 => format!("{d}.ecc"),
            4 => format!("{d}.mixed > 0"),
            _ => format!("{d}.numa == 1"),
        };
    }
    match rng.below(24) {
        0 => format!("{d}.?model.orValue('') == '{}'", rng.pick(MODELS)),
        1 => format!(
            "has({d}.model) && {d}.model in ['{}', '{}']",
            rng.pick(MODELS),
            rng.pick(MODELS)
        ),
        2 => format!("{d}.index {} {}", rng.pick(&[">=", "<", "==", "!=", ">"]), rng.below(6)),
        3 => [
            format!("{d}.?ecc.orValue(false)"),
            format!("!{d}.?ecc.orValue(true)"),
            format!("{d}.?ecc.orValue(false) == true"),
        ][rng.below(3)]
        .clone(),
        4 => format!("has({d}.fw) && {d}.fw.isGreaterThan(semver('{}'))", rng.pick(VERSIONS)),
        5 => format!("has({d}.fw) && {d}.fw.compareTo(semver('{}')) <= 0", rng.pick(VERSIONS)),
        6 => format!("has({d}.fw) && {d}.fw == semver('{}')", rng.pick(VERSIONS)),
        7 => format!(
            "has({c}.memory) && {c}.memory.compareTo(quantity('{}')) >= 0",
            rng.pick(MEMORY)
        ),
        8 => format!(
            "{c}.?memory.orValue(quantity('0')).isGreaterThan(quantity('{}'))",
            rng.pick(MEMORY)
        ),
        9 => format!(
            "{c}.?cores.orValue(quantity('0')).isLessThan(quantity('{}'))",
            rng.pick(CORES)
        ),
        10 => format!("{d}.uid.startsWith('{}')", rng.pick(nodes)),
        11 => format!("{d}.uid.endsWith('d{}')", rng.below(6)),
        12 => format!(
            "has({d}.model) && {d}.model.contains('{}')",
            rng.pick(&["1", "00", "l", "x"])
        ),
        13 => format!(
            "has({d}.model) && {d}.model.upperAscii() == '{}'",
            rng.pick(MODELS).to_uppercase()
        ),
        14 => format!("has({d}.model) && {d}.model.matches('^[ah]')"),
        15 => format!("{d}.?numa.orValue(-1) == {}", rng.below(2)),
        16 => format!("'{}' in {d}", rng.pick(&["ecc", "fw", "model", "mixed", "pcie"])),
        17 => format!(
            "device.attributes['{TOPO}'].?rack.orValue('') == '{}'",
            rng.pick(&["r0", "r1"])
        ),
        18 => format!("has({d}.fw) && {d}.fw.major() >= 2"),
        19 => format!("{d}.?pcie.orValue('') in ['p0', 'p2']"),
        20 => format!("size({d}) >= {}", rng.range(3, 8)),
        21 => format!(
            "{c}.?cores.orValue(quantity('0')).asInteger() >= {}",
            rng.pick(&[2, 4, 8])
        ),
        22 => format!("{d}.?mixed.orValue(0) == 1"),
        _ => ["device.allowMultipleAllocations", "!device.allowMultipleAllocations"][rng.below(2)].to_string(),
    }
}

/// A pod of a case, with the DRA claim `claim` if given.
fn pod_object(prefix: &str, name: &str, claim: Option<&str>) -> Value {
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels(prefix), "finalizers": [KEEP_FINALIZER]},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "busybox"}],
        },
    });
    if let Some(claim) = claim {
        pod["spec"]["containers"][0]["resources"] = json!({"claims": [{"name": "dev"}]});
        pod["spec"]["resourceClaims"] = json!([{"name": "dev", "resourceClaimName": claim}]);
    }
    pod
}

/// What admission defaults of a pod: its containers' resources, overhead, node selector
/// and tolerations, as text to compare.
fn admitted_fields(pod: &Pod) -> String {
    let spec = pod.spec.clone().unwrap_or_default();
    let resources: Vec<Value> = spec
        .containers
        .iter()
        .map(|c| {
            let r = c.resources.clone().unwrap_or_default();
            json!({"requests": r.requests.unwrap_or_default(), "limits": r.limits.unwrap_or_default()})
        })
        .collect();
    json!({
        "resources": resources,
        "overhead": spec.overhead.unwrap_or_default(),
        "nodeSelector": spec.node_selector.unwrap_or_default(),
        "tolerations": spec.tolerations.unwrap_or_default().len(),
    })
    .to_string()
}

// ---- verdicts ----

/// kube-scheduler's first verdict on a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Scheduler {
    Bound(String),
    Unschedulable(String),
    Error(String),
}

impl Scheduler {
    fn of(pod: &Pod) -> Option<Scheduler> {
        if let Some(node) = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .filter(|n| !n.is_empty())
        {
            return Some(Scheduler::Bound(node));
        }
        let conditions = pod.status.as_ref()?.conditions.as_ref()?;
        let scheduled = conditions
            .iter()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False")?;
        let message = scheduled.message.clone().unwrap_or_default();
        match scheduled.reason.as_deref() {
            Some("Unschedulable") => Some(Scheduler::Unschedulable(message)),
            Some("SchedulerError") => Some(Scheduler::Error(message)),
            _ => None,
        }
    }
}

impl fmt::Display for Scheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scheduler::Bound(node) => write!(f, "bound to {node}"),
            Scheduler::Unschedulable(m) => write!(f, "unschedulable: {m}"),
            Scheduler::Error(m) => write!(f, "scheduler error: {m}"),
        }
    }
}

/// The engine's answer for the pod.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Engine {
    Fits {
        node: String,
        devices: Vec<String>,
    },
    NoFit(String),
    /// A CEL runtime error or another error that aborts allocation everywhere.
    Error(String),
}

impl Engine {
    fn of(outcome: &Outcome) -> Engine {
        match outcome {
            Outcome::Placed(plan) => Engine::Fits {
                node: plan.pods.first().map(|p| p.node.clone()).unwrap_or_default(),
                devices: plan
                    .claims
                    .iter()
                    .flat_map(|c| &c.allocation.devices)
                    .map(|d| format!("{}={}/{}", d.request, d.pool, d.device))
                    .collect(),
            },
            Outcome::Unschedulable(u) => {
                let text = u.to_string();
                let fatal = u.reasons.iter().any(|r| {
                    r.contains("CEL runtime error")
                        || r.contains("CEL compile error")
                        || r.starts_with("claim ")
                        || r.starts_with("class ")
                        || r.starts_with("invalid resource pool")
                });
                if fatal {
                    Engine::Error(text)
                } else {
                    Engine::NoFit(text)
                }
            }
        }
    }

    fn fits(&self) -> bool {
        matches!(self, Engine::Fits { .. })
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Engine::Fits { node, devices } => write!(f, "fits on {node} [{}]", devices.join(", ")),
            Engine::NoFit(m) => write!(f, "no fit: {m}"),
            Engine::Error(m) => write!(f, "error: {m}"),
        }
    }
}

/// How the engine is given the claim: as the operator gives a claim a pod refers to by
/// name, or as a claim of the pod's own (as claims from templates are).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    Shared,
    Own,
}

impl fmt::Display for Form {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Form::Shared => "claim shared by name",
            Form::Own => "pod's own claim",
        })
    }
}

/// The engine's answers for one form: on the whole cluster and on each node alone.
struct EngineView {
    form: Form,
    whole: Engine,
    per_node: Vec<(String, Engine)>,
}

impl EngineView {
    fn fitting_nodes(&self) -> Vec<&str> {
        self.per_node
            .iter()
            .filter(|(_, e)| e.fits())
            .map(|(n, _)| n.as_str())
            .collect()
    }
}

fn engine_views(
    objects: &Objects,
    claim: Option<&ResourceClaim>,
    pod: &Pod,
    nodes: &[String],
) -> Result<Vec<EngineView>> {
    let cluster = objects.clone().take_cluster_state()?;
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
    let pod_key = PodKey::new(&namespace, pod_name);
    let claim = claim
        .map(|claim| -> Result<(ClaimKey, ClaimSpec)> {
            let key = ClaimKey::new(&namespace, claim.metadata.name.as_deref().unwrap_or_default());
            let spec =
                muster::convert::claim_spec(&format!("ResourceClaim {key}"), &claim.spec.clone().unwrap_or_default())?;
            Ok((key, spec))
        })
        .transpose()?;
    let shape = muster::convert::pod_shape(&format!("Pod {pod_key}"), pod)?;
    let volumes =
        muster::convert::scheduling::volume_claims(&namespace, pod_name, &pod.spec.clone().unwrap_or_default());
    let mut views = Vec::new();
    // Without a claim both forms are the same request.
    let forms: &[Form] = if claim.is_some() {
        &[Form::Shared, Form::Own]
    } else {
        &[Form::Own]
    };
    for &form in forms {
        let mut shape = shape.clone();
        let mut instance = PodInstance::new(pod_key.clone(), vec![]);
        instance.volumes = volumes.clone();
        let mut shared = vec![];
        match (&claim, form) {
            (Some((key, spec)), Form::Shared) => {
                shape.shared = vec![0];
                shared.push(SharedClaim {
                    key: key.clone(),
                    spec: spec.clone(),
                    allocation: None,
                });
            }
            (Some((key, spec)), Form::Own) => {
                shape.claims = vec![spec.clone()];
                instance.claims = vec![PodClaim::unallocated(key.clone())];
            }
            (None, _) => {}
        }
        let gang = GangRequest {
            name: pod_key.to_string(),
            groups: vec![GroupRequest {
                name: "pod".into(),
                min_count: 1,
                shape,
                pods: vec![instance],
                topology: Default::default(),
                assigned: Vec::new(),
            }],
            shared_claims: shared,
            topology: Default::default(),
        };
        // On one node alone: every other node is held back, so the pod's own node
        // selection (and what topology spread counts with it) stays as it is.
        let only = |node: Option<&str>| PlanOptions {
            excluded_nodes: std::sync::Arc::new(
                nodes
                    .iter()
                    .filter(|n| Some(n.as_str()) != node && node.is_some())
                    .cloned()
                    .collect::<BTreeSet<_>>(),
            ),
            ..PlanOptions::default()
        };
        let whole = Engine::of(&placement::plan(&cluster, &gang, &only(None)));
        let per_node = nodes
            .iter()
            .map(|n| (n.clone(), Engine::of(&placement::plan(&cluster, &gang, &only(Some(n))))))
            .collect();
        views.push(EngineView { form, whole, per_node });
    }
    Ok(views)
}

/// What was compared in one case.
struct Report {
    scheduler: Scheduler,
    views: Vec<EngineView>,
    /// Disagreements: each fails the test.
    problems: Vec<String>,
    /// Differences that are no disagreement (for example which kind of "no").
    notes: Vec<String>,
    blockers: usize,
}

impl Report {
    /// Whether either side reports an error (a CEL runtime error, a constraint that an
    /// "all devices" request cannot meet, ...) rather than a plain fit or no fit.
    fn involves_error(&self) -> bool {
        matches!(self.scheduler, Scheduler::Error(_))
            || self
                .views
                .iter()
                .flat_map(|v| std::iter::once(&v.whole).chain(v.per_node.iter().map(|(_, e)| e)))
                .any(|e| matches!(e, Engine::Error(_)))
    }
}

fn compare(scheduler: &Scheduler, views: &[EngineView]) -> (Vec<String>, Vec<String>) {
    let mut problems = Vec::new();
    let mut notes = Vec::new();
    let bound = match scheduler {
        Scheduler::Bound(node) => Some(node.as_str()),
        _ => None,
    };
    for view in views {
        let form = view.form;
        if view.whole.fits() != bound.is_some() {
            problems.push(format!(
                "engine ({form}) {}, but kube-scheduler: {scheduler}",
                if view.whole.fits() { "fits" } else { "does not fit" }
            ));
        }
        let fitting = view.fitting_nodes();
        if let Some(node) = bound {
            match view.per_node.iter().find(|(n, _)| n == node) {
                Some((_, e)) if !e.fits() => problems.push(format!(
                    "kube-scheduler bound the pod to {node}, where the engine ({form}) finds no fit"
                )),
                None => problems.push(format!("kube-scheduler bound the pod to {node}, not a fleet node")),
                _ => {}
            }
            if fitting.len() == 1 && fitting[0] != node {
                problems.push(format!(
                    "the engine ({form}) fits the pod only on {}, kube-scheduler bound it to {node}",
                    fitting[0]
                ));
            }
        }
        if view.whole.fits() == fitting.is_empty() {
            notes.push(format!(
                "engine ({form}): whole cluster says {}, but it fits on nodes {fitting:?} alone",
                view.whole
            ));
        }
        match (&view.whole, scheduler) {
            (Engine::Error(_), Scheduler::Unschedulable(_)) => notes.push(format!(
                "engine ({form}) reports an error, kube-scheduler \"unschedulable\""
            )),
            (Engine::NoFit(_), Scheduler::Error(_)) => {
                notes.push(format!("engine ({form}) reports no fit, kube-scheduler an error"))
            }
            _ => {}
        }
    }
    if views.len() == 2 && views[0].whole.fits() != views[1].whole.fits() {
        problems.push(format!(
            "the engine answers differently for a {} ({}) and a {} ({})",
            views[0].form, views[0].whole, views[1].form, views[1].whole
        ));
    }
    (problems, notes)
}

// ---- the cluster side ----

struct Harness {
    client: kube::Client,
    ns: String,
    /// A second namespace, for pods that inter-pod terms reach by name or by label.
    other_ns: String,
    nodes: Vec<String>,
    node_api: Api<Node>,
    pods: Api<Pod>,
    other_pods: Api<Pod>,
    all_pods: Api<Pod>,
    volume_claims: Api<PersistentVolumeClaim>,
    volumes: Api<PersistentVolume>,
    claims: Api<ResourceClaim>,
    all_claims: Api<ResourceClaim>,
    slices: Api<ResourceSlice>,
    classes: Api<DeviceClass>,
    limit_ranges: Api<LimitRange>,
    runtime_classes: Api<RuntimeClass>,
}

impl Harness {
    async fn start() -> Result<Harness> {
        // Four racks of one node, two blocks, two zones.
        let fleet = FleetSpec {
            nodes: NODES,
            gpus_per_node: 0,
            nodes_per_rack: 1,
            racks_per_block: 2,
            blocks_per_zone: 1,
            ..FleetSpec::default()
        };
        let cluster = shared_cluster(fleet).await?;
        let client = cluster.control_plane.client().await?;
        let ns = namespace(&client, "differential").await?;
        let other_ns = namespace(&client, "differential-other").await?;
        let namespaces: Api<Namespace> = Api::all(client.clone());
        for (name, team) in [(&ns, "main"), (&other_ns, "other")] {
            let team: Patch<Value> = Patch::Merge(json!({"metadata": {"labels": {scene::TEAM_LABEL: team}}}));
            namespaces.patch(name, &PatchParams::default(), &team).await?;
        }
        let harness = Harness {
            nodes: cluster.nodes.iter().map(|n| n.name.clone()).collect(),
            node_api: Api::all(client.clone()),
            pods: Api::namespaced(client.clone(), &ns),
            other_pods: Api::namespaced(client.clone(), &other_ns),
            volume_claims: Api::namespaced(client.clone(), &ns),
            volumes: Api::all(client.clone()),
            all_pods: Api::all(client.clone()),
            claims: Api::namespaced(client.clone(), &ns),
            all_claims: Api::all(client.clone()),
            slices: Api::all(client.clone()),
            classes: Api::all(client.clone()),
            limit_ranges: Api::namespaced(client.clone(), &ns),
            runtime_classes: Api::all(client.clone()),
            client,
            ns,
            other_ns,
        };
        let storage_classes: Api<StorageClass> = Api::all(harness.client.clone());
        for (name, mode) in [
            (scene::LATE_CLASS, "WaitForFirstConsumer"),
            (scene::NOW_CLASS, "Immediate"),
        ] {
            create_or_keep(&storage_classes, &static_class(name, mode)?).await?;
        }
        // Attach limits of the CSI driver, one per node.
        let csi_nodes: Api<CSINode> = Api::all(harness.client.clone());
        for (i, node) in harness.nodes.iter().enumerate() {
            let mut driver = json!({"name": scene::CSI_DRIVER, "nodeID": node});
            if let Some(count) = scene::attach_limit(i) {
                driver["allocatable"] = json!({"count": count});
            }
            create_or_keep(
                &csi_nodes,
                &serde_json::from_value(json!({"metadata": {"name": node}, "spec": {"drivers": [driver]}}))?,
            )
            .await?;
        }
        create_or_keep(
            &harness.classes,
            &serde_json::from_value(json!({
                "metadata": {"name": ANY_CLASS},
                "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{DRIVER}'")}}]},
            }))?,
        )
        .await?;
        // Nodes must be ready and untainted, or the scheduler and the engine would see
        // them change during the cases.
        let node_api = harness.node_api.clone();
        let names = harness.nodes.clone();
        wait::until("the fleet's nodes to be ready", Duration::from_secs(120), || {
            let (node_api, names) = (node_api.clone(), names.clone());
            async move {
                for name in &names {
                    let node = node_api.get(name).await?;
                    let ready = node
                        .status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                    let tainted = node
                        .spec
                        .as_ref()
                        .and_then(|s| s.taints.as_ref())
                        .is_some_and(|t| !t.is_empty());
                    if !ready || tainted {
                        return Ok(None);
                    }
                }
                Ok(Some(()))
            }
        })
        .await?;
        Ok(harness)
    }

    /// Deletes every object of earlier cases: claims first (kube-scheduler does not
    /// allocate claims being deleted), then pods, slices and classes, then volume claims
    /// (kept while a pod uses them) and volumes.
    async fn clear(&self) -> Result<()> {
        let all = ListParams::default().labels(CASE_LABEL);
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        };
        self.claims.delete_collection(&now, &all).await?;
        for pods in [&self.pods, &self.other_pods] {
            for pod in pods.list(&all).await?.items {
                if pod.metadata.finalizers.as_ref().is_some_and(|f| !f.is_empty()) {
                    let name = pod.metadata.name.unwrap_or_default();
                    let keep: Patch<Value> = Patch::Merge(json!({"metadata": {"finalizers": null}}));
                    pods.patch(&name, &PatchParams::default(), &keep).await?;
                }
            }
            pods.delete_collection(&now, &all).await?;
        }
        self.slices.delete_collection(&now, &all).await?;
        self.classes.delete_collection(&now, &all).await?;
        self.limit_ranges.delete_collection(&now, &all).await?;
        self.runtime_classes.delete_collection(&now, &all).await?;
        for pods in [self.pods.clone(), self.other_pods.clone()] {
            wait::until("the pods of the last case to be gone", Duration::from_secs(60), || {
                let pods = pods.clone();
                async move {
                    let left = pods.list(&ListParams::default().labels(CASE_LABEL)).await?;
                    Ok(left.items.is_empty().then_some(()))
                }
            })
            .await?;
        }
        self.volume_claims.delete_collection(&now, &all).await?;
        self.volumes.delete_collection(&now, &all).await?;
        Ok(())
    }

    /// Creates the case's LimitRange and RuntimeClass, and applies muster's admission
    /// defaults to `pod`. A difference from what the API server would store (a dry run
    /// of the pod, once admission sees the new objects) is a disagreement.
    async fn admit(&self, case: &Case, pod: &mut Pod) -> Result<Option<String>> {
        let admission = &case.admission;
        if admission.limit_range.is_none() && admission.runtime_class.is_none() {
            return Ok(None);
        }
        let limit_range: Option<LimitRange> = admission.limit_range.clone().map(serde_json::from_value).transpose()?;
        let runtime_class: Option<RuntimeClass> = admission
            .runtime_class
            .clone()
            .map(serde_json::from_value)
            .transpose()?;
        if let Some(range) = &limit_range {
            self.limit_ranges.create(&PostParams::default(), range).await?;
        }
        if let Some(class) = &runtime_class {
            self.runtime_classes.create(&PostParams::default(), class).await?;
        }
        let mut limit_range = limit_range;
        if let Some(range) = &mut limit_range {
            range.metadata.namespace = Some(self.ns.clone());
        }
        let defaults = muster::workload::admitted::PodDefaults::new(limit_range, runtime_class, true);
        defaults.apply(&self.ns, pod)?;
        let expected = admitted_fields(pod);
        // Admission reads LimitRanges and RuntimeClasses from caches: wait until a dry
        // run of the pod shows they are there (the overhead set, a default request).
        let dry_run = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        let given: Pod = serde_json::from_value(case.pod.clone())?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let stored = self.pods.create(&dry_run, &given).await?;
            let got = admitted_fields(&stored);
            if got == expected {
                return Ok(None);
            }
            if Instant::now() > deadline {
                return Ok(Some(format!(
                    "admission stores {got}, muster's defaults give {expected}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn create_pod(&self, pod: &Value) -> Result<()> {
        self.pods
            .create(&PostParams::default(), &serde_json::from_value(pod.clone())?)
            .await?;
        Ok(())
    }

    async fn create_claim(&self, claim: &Value) -> Result<()> {
        self.claims
            .create(&PostParams::default(), &serde_json::from_value(claim.clone())?)
            .await
            .with_context(|| format!("creating claim {}", claim["metadata"]["name"]))?;
        Ok(())
    }

    /// Waits for kube-scheduler's first verdict on a pod.
    async fn verdict(&self, name: &str) -> Result<Scheduler> {
        let seen = tokio::time::timeout(
            VERDICT_TIMEOUT,
            kube::runtime::wait::await_condition(self.pods.clone(), name, |p: Option<&Pod>| {
                p.is_none_or(|p| Scheduler::of(p).is_some())
            }),
        )
        .await
        .with_context(|| format!("no verdict on pod {name} within {VERDICT_TIMEOUT:?}"))??;
        seen.as_ref()
            .and_then(Scheduler::of)
            .with_context(|| format!("pod {name} is gone"))
    }

    /// Waits until a pod is bound; a verdict other than bound fails.
    async fn bound(&self, name: &str, retry_unschedulable: bool) -> Result<String> {
        let seen = tokio::time::timeout(
            VERDICT_TIMEOUT,
            kube::runtime::wait::await_condition(self.pods.clone(), name, |p: Option<&Pod>| {
                p.is_none_or(|p| match Scheduler::of(p) {
                    Some(Scheduler::Bound(_)) => true,
                    Some(_) => !retry_unschedulable,
                    None => false,
                })
            }),
        )
        .await
        .with_context(|| format!("pod {name} not bound within {VERDICT_TIMEOUT:?}"))??;
        match seen.as_ref().and_then(Scheduler::of) {
            Some(Scheduler::Bound(node)) => Ok(node),
            other => bail!("pod {name} was not bound: {other:?}"),
        }
    }

    /// Makes sure kube-scheduler has seen every object written so far: a device, a class
    /// and a claim written now must be usable by a pod.
    async fn fence(&self, case: &Case) -> Result<()> {
        let prefix = &case.prefix;
        let slice: ResourceSlice = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": FENCE_SLICE},
            "spec": {
                "driver": FENCE_DRIVER,
                "nodeName": self.nodes[0],
                "pool": {"name": "fence", "generation": case.number + 1, "resourceSliceCount": 1},
                "devices": [{"name": format!("f{}", case.number), "attributes": {"case": {"int": case.number}}}],
            },
        }))?;
        self.slices
            .patch(
                FENCE_SLICE,
                &PatchParams::apply("muster-differential").force(),
                &Patch::Apply(&slice),
            )
            .await?;
        let name = format!("{prefix}-fence");
        self.classes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": name, "labels": labels(prefix)},
                    "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{FENCE_DRIVER}'")}}]},
                }))?,
            )
            .await?;
        self.create_claim(&json!({
            "metadata": {"name": name, "labels": labels(prefix)},
            "spec": {"devices": {"requests": [{"name": "f", "exactly": {
                "deviceClassName": name,
                "selectors": [{"cel": {"expression": format!(
                    "device.attributes['{FENCE_DRIVER}'].case == {}", case.number
                )}}],
            }}]}},
        }))
        .await?;
        // A volume and its claim, bound to each other: written after the case's.
        let volume = format!("{name}-pv");
        self.volumes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": volume, "labels": labels(prefix)},
                    "spec": {
                        "storageClassName": "",
                        "capacity": {"storage": "1Gi"},
                        "accessModes": ["ReadWriteOnce"],
                        "hostPath": {"path": format!("/tmp/{volume}")},
                        "claimRef": {"namespace": self.ns, "name": name},
                    },
                }))?,
            )
            .await?;
        self.volume_claims
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": name, "labels": labels(prefix)},
                    "spec": {
                        "storageClassName": "",
                        "volumeName": volume,
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "1Gi"}},
                    },
                }))?,
            )
            .await?;
        let mut pod = pod_object(prefix, &name, Some(&name));
        pod["spec"]["volumes"] = json!([{"name": "fence", "persistentVolumeClaim": {"claimName": name}}]);
        self.create_pod(&pod).await?;
        self.bound(&name, true).await.context("the fence pod")?;
        Ok(())
    }

    /// Waits until the volume controller has bound the claims `names`.
    async fn claims_bound(&self, names: &[String]) -> Result<()> {
        for name in names {
            let claims = self.volume_claims.clone();
            wait::until(
                &format!("PersistentVolumeClaim {name} to be bound"),
                Duration::from_secs(60),
                || {
                    let claims = claims.clone();
                    async move {
                        let claim = claims.get(name).await?;
                        let bound = claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
                            && claim
                                .metadata
                                .annotations
                                .as_ref()
                                .is_some_and(|a| a.contains_key("pv.kubernetes.io/bind-completed"));
                        Ok(bound.then_some(()))
                    }
                },
            )
            .await?;
        }
        Ok(())
    }

    /// Removes what the cases left behind.
    async fn finish(&self) -> Result<()> {
        self.clear().await?;
        self.slices.delete(FENCE_SLICE, &DeleteParams::default()).await?;
        self.classes.delete(ANY_CLASS, &DeleteParams::default()).await?;
        delete_namespace(&self.client, &self.other_ns).await?;
        delete_namespace(&self.client, &self.ns).await
    }

    /// Everything the engine reads, as the API server has it.
    async fn objects(&self) -> Result<Objects> {
        let all = ListParams::default();
        let mut objects = Objects {
            classes: self.classes.list(&all).await?.items,
            claims: self.all_claims.list(&all).await?.items,
            ..Objects::default()
        };
        for node in self.node_api.list(&all).await?.items {
            objects.add_node(&node)?;
        }
        for slice in self.slices.list(&all).await?.items {
            objects.add_slice(&slice)?;
        }
        for pod in self.all_pods.list(&all).await?.items {
            objects.add_pod(pod)?;
        }
        for claim in self.volume_claims.list(&all).await?.items {
            objects.volume_claims.push(muster::convert::storage::claim(&claim)?);
        }
        for volume in self.volumes.list(&all).await?.items {
            objects.volumes.push(muster::convert::storage::volume(&volume)?);
        }
        let storage_classes: Api<StorageClass> = Api::all(self.client.clone());
        for class in storage_classes.list(&all).await?.items {
            let default = muster::convert::storage::is_default_class(&class);
            objects
                .storage_classes
                .push((muster::convert::storage::storage_class(&class), default));
        }
        let csi_nodes: Api<CSINode> = Api::all(self.client.clone());
        for node in csi_nodes.list(&all).await?.items {
            let name = node.metadata.name.clone().unwrap_or_default();
            objects
                .csi_nodes
                .push((name, muster::convert::storage::csi_node(&node)));
        }
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        for namespace in namespaces.list(&all).await?.items {
            objects.namespaces.push((
                namespace.metadata.name.unwrap_or_default(),
                namespace.metadata.labels.unwrap_or_default(),
            ));
        }
        Ok(objects)
    }

    async fn run(&self, case: &Case) -> Result<Report> {
        self.clear().await?;
        for class in &case.classes {
            self.classes
                .create(&PostParams::default(), &serde_json::from_value(class.clone())?)
                .await
                .with_context(|| format!("creating class {}", class["metadata"]["name"]))?;
        }
        for slice in &case.slices {
            self.slices
                .create(&PostParams::default(), &serde_json::from_value(slice.clone())?)
                .await
                .with_context(|| format!("creating slice {}", slice["metadata"]["name"]))?;
        }
        for volume in &case.scene.volumes {
            self.volumes
                .create(&PostParams::default(), &serde_json::from_value(volume.clone())?)
                .await
                .with_context(|| format!("creating volume {}", volume["metadata"]["name"]))?;
        }
        for claim in &case.scene.claims {
            self.volume_claims
                .create(&PostParams::default(), &serde_json::from_value(claim.clone())?)
                .await
                .with_context(|| format!("creating volume claim {}", claim["metadata"]["name"]))?;
        }
        self.claims_bound(&case.scene.bound).await?;
        // Pods already on nodes, before the fence pod.
        for (pod, other) in &case.scene.residents {
            let pods = if *other { &self.other_pods } else { &self.pods };
            pods.create(&PostParams::default(), &serde_json::from_value(pod.clone())?)
                .await
                .with_context(|| format!("creating resident {}", pod["metadata"]["name"]))?;
        }
        for (claim, _) in &case.blockers {
            self.create_claim(claim).await?;
        }
        if let Some(claim) = &case.claim {
            self.create_claim(claim).await?;
        }
        self.fence(case).await?;

        // Other pods take their devices first.
        for (_, pod) in &case.blockers {
            self.create_pod(pod).await?;
        }
        for (_, pod) in &case.blockers {
            let name = pod["metadata"]["name"].as_str().unwrap_or_default();
            self.bound(name, false)
                .await
                .with_context(|| format!("pod {name} taking devices"))?;
        }

        // The engine plans from what the API server has now ...
        let objects = self.objects().await?;
        let claim = match &case.claim {
            Some(claim) => Some(
                self.claims
                    .get(claim["metadata"]["name"].as_str().unwrap_or_default())
                    .await?,
            ),
            None => None,
        };
        let pod: Pod = serde_json::from_value(case.pod.clone())?;
        let mut pod_in_ns = pod.clone();
        pod_in_ns.metadata.namespace = Some(self.ns.clone());
        // The pod as admission will store it, by muster's reckoning.
        let mut problems = Vec::new();
        if let Some(problem) = self.admit(case, &mut pod_in_ns).await? {
            problems.push(problem);
        }
        let views = engine_views(&objects, claim.as_ref(), &pod_in_ns, &self.nodes)?;

        // ... then kube-scheduler gets the pod.
        self.create_pod(&case.pod).await?;
        let scheduler = self.verdict(pod.metadata.name.as_deref().unwrap_or_default()).await?;
        let (compared, notes) = compare(&scheduler, &views);
        problems.extend(compared);
        Ok(Report {
            scheduler,
            views,
            problems,
            notes,
            blockers: case.blockers.len(),
        })
    }

    /// The case's objects as the API server has them now, as YAML documents.
    async fn dump(&self, case: &Case) -> Result<String> {
        let selector = ListParams::default().labels(&format!("{CASE_LABEL}={}", case.prefix));
        let mut documents: Vec<Value> = Vec::new();
        let mut add = |kind: &str, api_version: &str, value: Value| {
            let mut value = value;
            value["kind"] = json!(kind);
            value["apiVersion"] = json!(api_version);
            if let Some(metadata) = value.get_mut("metadata").and_then(Value::as_object_mut) {
                for noise in [
                    "managedFields",
                    "uid",
                    "resourceVersion",
                    "creationTimestamp",
                    "generation",
                ] {
                    metadata.remove(noise);
                }
            }
            documents.push(value);
        };
        for class in self.classes.list(&selector).await?.items {
            add("DeviceClass", "resource.k8s.io/v1", serde_json::to_value(class)?);
        }
        for slice in self.slices.list(&selector).await?.items {
            add("ResourceSlice", "resource.k8s.io/v1", serde_json::to_value(slice)?);
        }
        for claim in self.claims.list(&selector).await?.items {
            add("ResourceClaim", "resource.k8s.io/v1", serde_json::to_value(claim)?);
        }
        for volume in self.volumes.list(&selector).await?.items {
            add("PersistentVolume", "v1", serde_json::to_value(volume)?);
        }
        for range in self.limit_ranges.list(&selector).await?.items {
            add("LimitRange", "v1", serde_json::to_value(range)?);
        }
        for class in self.runtime_classes.list(&selector).await?.items {
            add("RuntimeClass", "node.k8s.io/v1", serde_json::to_value(class)?);
        }
        for claim in self.volume_claims.list(&selector).await?.items {
            add("PersistentVolumeClaim", "v1", serde_json::to_value(claim)?);
        }
        for pods in [&self.pods, &self.other_pods] {
            for pod in pods.list(&selector).await?.items {
                let mut value = serde_json::to_value(&pod)?;
                if let Some(status) = value.get_mut("status").and_then(Value::as_object_mut) {
                    status.retain(|k, _| k == "conditions" || k == "phase");
                }
                add("Pod", "v1", value);
            }
        }
        Ok(serde_saphyr::to_string_multiple(&documents)?)
    }
}

// ---- the test ----

fn env_number(name: &str) -> Result<Option<u64>> {
    let Ok(text) = std::env::var(name) else {
        return Ok(None);
    };
    let text = text.trim().replace('_', "");
    let value = match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    }
    .with_context(|| format!("{name}={text}: not a number"))?;
    Ok(Some(value))
}

#[derive(Default)]
struct Stats {
    compared: usize,
    bound: usize,
    unschedulable: usize,
    scheduler_errors: usize,
    single_node: usize,
    several_nodes: usize,
    engine_errors: usize,
    with_blockers: usize,
    notes: usize,
    slowest: Duration,
    /// Cases whose pod uses a scene feature (pod affinity, spread, ports, volumes), and
    /// how many use each.
    with_scene: usize,
    features: BTreeMap<&'static str, usize>,
}

#[tokio::test]
async fn engine_and_kube_scheduler_agree_on_random_dra_cases() -> Result<()> {
    let seed = env_number("MUSTER_DIFF_SEED")?.unwrap_or(DEFAULT_SEED);
    let count = env_number("MUSTER_DIFF_CASES")?.map_or(DEFAULT_CASES, |n| n as usize);
    let only = env_number("MUSTER_DIFF_ONLY")?.map(|n| n as usize);
    let numbers: Vec<usize> = match only {
        Some(n) => vec![n],
        None => (0..count).collect(),
    };
    println!(
        "differential: seed {seed:#x}, {} case(s) (set MUSTER_DIFF_SEED, MUSTER_DIFF_CASES, MUSTER_DIFF_ONLY to change)",
        numbers.len()
    );

    let start = Instant::now();
    let harness = Harness::start().await?;
    println!("differential: control plane ready after {:.1?}", start.elapsed());

    let started = Instant::now();
    let mut stats = Stats::default();
    let mut failures: Vec<String> = Vec::new();
    let mut error_failures = 0;
    for &number in &numbers {
        let case = generate(seed, number, &harness.nodes, &harness.ns, &harness.other_ns);
        let case_start = Instant::now();
        let report = match harness.run(&case).await {
            Ok(report) => report,
            Err(e) => {
                let dump = harness
                    .dump(&case)
                    .await
                    .unwrap_or_else(|e| format!("(no dump: {e:#})"));
                let claim = serde_saphyr::to_string(&case.claim).unwrap_or_default();
                bail!(
                    "seed {seed:#x}, case {number}: the harness failed: {e:#}\nrerun: MUSTER_DIFF_SEED={seed:#x} MUSTER_DIFF_ONLY={number}\nclaim under test:\n{claim}objects:\n{dump}"
                );
            }
        };
        stats.slowest = stats.slowest.max(case_start.elapsed());
        stats.compared += 1;
        match &report.scheduler {
            Scheduler::Bound(_) => stats.bound += 1,
            Scheduler::Unschedulable(_) => stats.unschedulable += 1,
            Scheduler::Error(_) => stats.scheduler_errors += 1,
        }
        match report.views[0].fitting_nodes().len() {
            0 => {}
            1 => stats.single_node += 1,
            _ => stats.several_nodes += 1,
        }
        if matches!(report.views[0].whole, Engine::Error(_)) {
            stats.engine_errors += 1;
        }
        if report.blockers > 0 {
            stats.with_blockers += 1;
        }
        if !case.scene.features.is_empty() {
            stats.with_scene += 1;
        }
        for feature in &case.scene.features {
            *stats.features.entry(feature).or_default() += 1;
        }
        stats.notes += usize::from(!report.notes.is_empty());

        if !report.problems.is_empty() || only.is_some() {
            let mut text = format!(
                "=== seed {seed:#x}, case {number} (rerun: MUSTER_DIFF_SEED={seed:#x} MUSTER_DIFF_ONLY={number}) ===\n"
            );
            for problem in &report.problems {
                text.push_str(&format!("DISAGREEMENT: {problem}\n"));
            }
            for note in &report.notes {
                text.push_str(&format!("note: {note}\n"));
            }
            text.push_str(&format!("kube-scheduler: {}\n", report.scheduler));
            for view in &report.views {
                text.push_str(&format!("engine ({}): {}\n", view.form, view.whole));
                for (node, e) in &view.per_node {
                    text.push_str(&format!("  on {node} alone: {e}\n"));
                }
            }
            let dump = harness
                .dump(&case)
                .await
                .unwrap_or_else(|e| format!("(no dump: {e:#})"));
            text.push_str("objects:\n");
            text.push_str(&dump);
            println!("{text}");
            if !report.problems.is_empty() {
                failures.push(text);
                error_failures += usize::from(report.involves_error());
            }
        }
        if stats.compared.is_multiple_of(25) {
            println!(
                "differential: {} cases in {:.1?}, {} disagreement(s)",
                stats.compared,
                started.elapsed(),
                failures.len()
            );
        }
    }
    harness.finish().await?;

    println!(
        "differential: seed {seed:#x}: {} cases compared in {:.1?} (slowest {:.1?}); kube-scheduler bound {}, \
         unschedulable {}, scheduler error {}; engine fits on exactly one node {}, on several {}, \
         engine errors {}; cases with devices taken by other pods {}; cases with notes {}; disagreements {} \
         ({} where a side reports an error)",
        stats.compared,
        started.elapsed(),
        stats.slowest,
        stats.bound,
        stats.unschedulable,
        stats.scheduler_errors,
        stats.single_node,
        stats.several_nodes,
        stats.engine_errors,
        stats.with_blockers,
        stats.notes,
        failures.len(),
        error_failures
    );
    println!(
        "differential: {} cases used scene features: {:?}",
        stats.with_scene, stats.features
    );
    ensure!(
        failures.is_empty(),
        "{} of {} cases disagree (seed {seed:#x}):\n{}",
        failures.len(),
        stats.compared,
        failures.join("\n")
    );
    Ok(())
}

#[test]
fn cases_are_reproducible_and_cover_every_feature() {
    let nodes: Vec<String> = (0..NODES).map(|i| format!("node-{i:05}")).collect();
    let a = generate(7, 42, &nodes, "main", "other");
    let b = generate(7, 42, &nodes, "main", "other");
    assert_eq!(
        (a.classes, a.slices, a.claim, a.pod, a.blockers),
        (b.classes, b.slices, b.claim, b.pod, b.blockers)
    );
    let features = [
        "\"firstAvailable\"",
        "\"All\"",
        "\"matchAttribute\"",
        "\"distinctAttribute\"",
        "\"tolerations\"",
        "\"taints\"",
        "\"NoExecute\"",
        "\"version\"",
        "\"allowMultipleAllocations\"",
        "\"validRange\"",
        "\"validValues\"",
        "\"sharedCounters\"",
        "\"consumesCounters\"",
        "\"capacity\":{\"requests\"",
        "orValue(",
        "has(",
        "semver(",
        "quantity(",
        "startsWith(",
    ];
    let mut seen: BTreeMap<&str, usize> = features.iter().map(|f| (*f, 0)).collect();
    let mut with_blockers = 0;
    let mut scenes: BTreeMap<&str, usize> = BTreeMap::new();
    let mut with_scene = 0;
    for number in 0..200 {
        let case = generate(1, number, &nodes, "main", "other");
        with_blockers += usize::from(!case.blockers.is_empty());
        with_scene += usize::from(!case.scene.features.is_empty());
        for feature in &case.scene.features {
            *scenes.entry(feature).or_default() += 1;
        }
        let text = serde_json::to_string(&(&case.classes, &case.slices, &case.claim)).unwrap();
        for feature in features {
            *seen.get_mut(feature).unwrap() += usize::from(text.contains(feature));
        }
    }
    let missing: Vec<_> = seen.iter().filter(|(_, n)| **n == 0).map(|(f, _)| *f).collect();
    assert!(missing.is_empty(), "features no case uses: {missing:?}");
    assert!(with_blockers > 20, "{with_blockers} cases take devices first");
    let expected = [
        "pod affinity",
        "pod anti-affinity",
        "anti-affinity of residents",
        "topology spread",
        "minDomains",
        "host ports",
        "hostNetwork",
        "bound volume",
        "late binding",
        "unbound immediate claim",
        "ReadWriteOncePod in use",
        "attach limits",
        "LimitRange defaults",
        "RuntimeClass overhead",
        "RuntimeClass scheduling",
        "residents using CPU",
    ];
    let missing: Vec<_> = expected.iter().filter(|f| !scenes.contains_key(**f)).collect();
    assert!(
        missing.is_empty(),
        "scene features no case uses: {missing:?} (seen {scenes:?})"
    );
    assert!(with_scene > 120, "{with_scene} of 200 cases use scene features");
}
