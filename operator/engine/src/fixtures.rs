//! Builders for tests and benchmarks: nodes, GPU slices, classes and claims in a few
//! lines each.

use crate::name_map::NameMap;

use crate::claim::DeviceResult;
use crate::claim::{AllocationMode, ClaimSpec, ConstraintKind, DeviceConstraint, DeviceRequest, DeviceRequestSpec};
use crate::cluster::{ClusterState, Device, DeviceClass, Node, Slice, SliceNodes};
use crate::device::{AttributeValue, Capacity};
use crate::key::{ClaimKey, ObjectKey, PodKey};
use crate::labels::LabelSelector;
use crate::pod::AffinityTerm;
use crate::quantity::Quantity;
use crate::request::{GangRequest, GroupRequest, PodShape, TopologyRequest};
use crate::resources::Resources;
use crate::selector::{NodeSelector, Operator, Requirement, Term};
use crate::storage::{AccessModes, BindingMode, Pv, Pvc, StorageClass};

/// The test DRA driver (and its DeviceClass).
pub const GPU: &str = "gpu.example.com";
/// The node label with the node's name.
pub const HOSTNAME: &str = "kubernetes.io/hostname";
/// The zone label.
pub const ZONE: &str = "topology.kubernetes.io/zone";

/// A node with CPU (cores), memory (GiB), pods 110, and labels.
pub fn node(name: &str, cpu: i64, memory_gib: i64, labels: &[(&str, &str)]) -> Node {
    Node {
        name: name.into(),
        labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        taints: vec![],
        unschedulable: false,
        allocatable: Resources {
            cpu_millis: cpu * 1000,
            memory: memory_gib << 30,
            pods: 110,
            ..Default::default()
        },
    }
}

/// A device of the test driver on `pool`, as an allocation result for `request`.
pub fn device_result(request: &str, pool: &str, device: &str) -> DeviceResult {
    DeviceResult {
        request: request.into(),
        driver: GPU.into(),
        pool: pool.into(),
        device: device.into(),
        admin_access: None,
        tolerations: vec![],
        binding_conditions: vec![],
        binding_failure_conditions: vec![],
        share_id: None,
        consumed_capacity: Default::default(),
    }
}

/// A GPU device with `index`, `model` and `nvlinkDomain` attributes and memory capacity.
pub fn gpu(index: usize, model: &str) -> Device {
    Device {
        name: format!("gpu-{index}"),
        attributes: NameMap::from([
            ("index".to_string(), AttributeValue::Int(index as i64)),
            ("model".to_string(), AttributeValue::String(model.into())),
            ("nvlinkDomain".to_string(), AttributeValue::Int(index as i64 / 4)),
        ]),
        capacity: NameMap::from([(
            "memory".to_string(),
            Capacity::new(Quantity::from_units(80 << 30, crate::quantity::Format::BinarySI)),
        )]),
        ..Device::default()
    }
}

/// A node-local slice of the test driver with the given devices (pool = node name).
pub fn node_slice(node: &str, devices: Vec<Device>) -> Slice {
    Slice {
        name: format!("{node}-{GPU}"),
        driver: GPU.into(),
        pool: node.into(),
        generation: 1,
        resource_slice_count: 1,
        nodes: SliceNodes::Node(node.into()),
        devices,
        shared_counters: vec![],
    }
}

/// The DeviceClass selecting every device of the test driver.
pub fn gpu_class() -> DeviceClass {
    DeviceClass {
        name: GPU.into(),
        selectors: vec![format!("device.driver == '{GPU}'")],
        config: vec![],
        extended_resource_name: None,
    }
}

/// A request for `count` devices of the test class.
pub fn request(name: &str, count: u32) -> DeviceRequestSpec {
    DeviceRequestSpec {
        name: name.into(),
        device_class_name: GPU.into(),
        count,
        allocation_mode: AllocationMode::ExactCount,
        ..DeviceRequestSpec::default()
    }
}

/// A claim with one `exactly` request for `count` GPUs.
pub fn gpu_claim(count: u32) -> ClaimSpec {
    ClaimSpec {
        requests: vec![DeviceRequest::Exactly(request("gpus", count))],
        ..ClaimSpec::default()
    }
}

/// A claim's constraint that all its devices share an attribute value.
pub fn match_attribute(attribute: &str) -> DeviceConstraint {
    DeviceConstraint {
        requests: vec![],
        kind: ConstraintKind::MatchAttribute(attribute.into()),
    }
}

/// A cluster of `nodes` GPU nodes with `gpus` devices each, labelled with `rack`
/// (nodes_per_rack per rack) and `block` (racks_per_block racks per block).
pub fn gpu_cluster(nodes: usize, gpus: usize, nodes_per_rack: usize, racks_per_block: usize) -> ClusterState {
    let mut cluster = ClusterState::new();
    cluster.upsert_class(gpu_class());
    for i in 0..nodes {
        let name = format!("node-{i:05}");
        let rack = i / nodes_per_rack.max(1);
        let block = rack / racks_per_block.max(1);
        let labels = [
            ("example.com/rack", format!("rack-{rack:04}")),
            ("example.com/block", format!("block-{block:03}")),
            (HOSTNAME, name.clone()),
        ];
        let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
        cluster.upsert_node(node(&name, 64, 512, &labels));
        cluster.upsert_slice(node_slice(&name, (0..gpus).map(|g| gpu(g, "H100")).collect()));
    }
    cluster
}

/// The shape of a pod with `gpus` GPUs in one claim (none: no claim), `cpu` cores and
/// `memory_gib` GiB.
pub fn gpu_pod(gpus: u32, cpu: i64, memory_gib: i64) -> PodShape {
    PodShape {
        requests: Resources {
            cpu_millis: cpu * 1000,
            memory: memory_gib << 30,
            pods: 1,
            ..Default::default()
        },
        claims: if gpus > 0 { vec![gpu_claim(gpus)] } else { vec![] },
        ..PodShape::default()
    }
}

/// A gang of one group of `pods` pods with `gpus` GPUs each, all required.
pub fn gpu_gang(name: &str, pods: usize, gpus: u32, required: Option<&str>, preferred: Option<&str>) -> GangRequest {
    GangRequest {
        name: format!("ns/{name}"),
        groups: vec![GroupRequest::uniform(
            &format!("{name}-workers"),
            "ns",
            pods,
            pods,
            gpu_pod(gpus, 8, 64),
        )],
        shared_claims: vec![],
        topology: TopologyRequest {
            required: required.map(Into::into),
            preferred: preferred.map(Into::into),
            ..Default::default()
        },
    }
}

/// Enters a running gang as the watches show it: per `(node, gpus)`, a pod
/// `<namespace>/<name>-<i>` with 8 cores and 64 GiB on the node, whose claim
/// `<pod>-gpu` holds the first `gpus` free GPUs of the node's test slice.
pub fn run_gang(
    cluster: &mut ClusterState,
    namespace: &str,
    name: &str,
    placements: &[(&str, usize)],
) -> (Vec<PodKey>, Vec<ClaimKey>) {
    let mut pods = Vec::new();
    let mut claims = Vec::new();
    for (i, (node, gpus)) in placements.iter().enumerate() {
        let pod = PodKey::new(namespace, &format!("{name}-{i}"));
        cluster.upsert_pod(&pod, node, gpu_pod(0, 8, 64).requests);
        let free: Vec<String> = cluster
            .slice(&format!("{node}-{GPU}"))
            .map(|s| s.devices.iter().map(|d| d.name.clone()).collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .filter(|d| !cluster.device_allocated_by_name(GPU, node, d))
            .take(*gpus)
            .collect();
        assert_eq!(free.len(), *gpus, "{node} has {gpus} free GPUs");
        if *gpus > 0 {
            let claim = ClaimKey::new(namespace, &format!("{name}-{i}-gpu"));
            let devices = free
                .into_iter()
                .map(|device| device_result("gpus", node, &device))
                .collect();
            cluster.set_claim_allocation(&claim, Some(devices));
            claims.push(claim);
        }
        pods.push(pod);
    }
    (pods, claims)
}

/// A required (anti-)affinity term selecting pods with `labels` in the pod's own namespace.
pub fn term(key: &str, labels: &[(&str, &str)]) -> AffinityTerm {
    AffinityTerm {
        selector: LabelSelector::of_labels(labels),
        namespaces: vec![],
        namespace_selector: None,
        topology_key: key.into(),
    }
}

/// A StorageClass without a provisioner that binds at the first consumer, or at once.
pub fn local_class(name: &str, late: bool) -> StorageClass {
    StorageClass {
        name: name.into(),
        provisioner: crate::storage::NO_PROVISIONER.into(),
        binding_mode: Some(if late {
            BindingMode::WaitForFirstConsumer
        } else {
            BindingMode::Immediate
        }),
        allowed_topologies: vec![],
    }
}

/// An available ReadWriteOnce volume of `class` and `size` reachable from nodes with
/// `label=value`.
pub fn volume(name: &str, class: &str, size: &str, label: &str, value: &str) -> Pv {
    Pv {
        name: name.into(),
        class: class.into(),
        capacity: Some(Quantity::parse(size).expect("a quantity")),
        access_modes: AccessModes::READ_WRITE_ONCE,
        available: true,
        node_affinity: Some(NodeSelector {
            terms: vec![Term {
                match_expressions: vec![Requirement::new(label, Operator::In, &[value])],
                match_fields: vec![],
            }],
        }),
        ..Pv::default()
    }
}

/// An unbound ReadWriteOnce claim `namespace/name` of `class` for `size`.
pub fn volume_claim(namespace: &str, name: &str, class: &str, size: &str) -> Pvc {
    Pvc {
        key: ObjectKey::new(namespace, name),
        uid: format!("uid-{namespace}-{name}"),
        class: class.into(),
        access_modes: AccessModes::READ_WRITE_ONCE,
        request: Some(Quantity::parse(size).expect("a quantity")),
        ..Pvc::default()
    }
}

/// Binds `claim` to `volume` for good, as the volume controller does.
pub fn bind(claim: &mut Pvc, volume: &mut Pv) {
    claim.volume_name = Some(volume.name.clone());
    claim.bind_completed = true;
    volume.available = false;
    volume.claim_ref = Some(crate::storage::ClaimRef {
        namespace: claim.key.namespace().into(),
        name: claim.key.name().into(),
        uid: claim.uid.clone(),
    });
}

/// Gives every pod of the gang's groups one claim `<pod>-data` of `class` for `size`,
/// entered into the cluster.
pub fn with_volume_per_pod(cluster: &mut ClusterState, gang: &mut GangRequest, class: &str, size: &str) {
    for group in &mut gang.groups {
        for pod in &mut group.pods {
            let claim = volume_claim(pod.key.namespace(), &format!("{}-data", pod.key.name()), class, size);
            pod.volumes.push(claim.key.clone());
            cluster.storage_mut().upsert_claim(claim);
        }
    }
}
