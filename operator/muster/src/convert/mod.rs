//! Conversions between Kubernetes objects and the engine's model. Pure.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{self as core, Node, Pod, PodSpec};
use k8s_openapi::api::resource::v1 as resource;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as KubeQuantity;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use muster_engine::claim::{
    AllocatedConfig, Allocation, AllocationMode, ClaimConfig, ClaimSpec, ConfigSource, ConstraintKind,
    DeviceConstraint, DeviceRequest, DeviceRequestSpec, DeviceResult, DeviceTaint, DeviceToleration, OpaqueConfig,
    TaintEffect, TolerationOperator,
};
use muster_engine::cluster::{self as model, CounterConsumption, CounterSet, DeviceNodes, SliceNodes};
use muster_engine::device::{AttributeValue, Capacity, RequestPolicy, ValidRange};
use muster_engine::key::{ClaimKey, ObjectKey, PodKey};
use muster_engine::quantity::Quantity;
use muster_engine::resources::Resources;
use muster_engine::selector::{NodeSelector, NodeTaintEffect, Operator, Requirement, Taint, Term, Toleration};

/// An object the engine cannot use, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{object}: {message}")]
pub struct ConvertError {
    /// `Kind namespace/name`.
    pub object: String,
    pub message: String,
}

fn err(object: &str, message: impl Into<String>) -> ConvertError {
    ConvertError {
        object: object.to_string(),
        message: message.into(),
    }
}

fn quantity(object: &str, field: &str, q: &KubeQuantity) -> Result<Quantity, ConvertError> {
    Quantity::parse(&q.0).map_err(|e| err(object, format!("{field}: {e}")))
}

pub mod scheduling;
pub mod storage;

// ---- nodes and pods ----

/// A Node as the engine sees it.
pub fn node(node: &Node) -> Result<model::Node, ConvertError> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let object = format!("Node {name}");
    let spec = node.spec.clone().unwrap_or_default();
    let taints = spec
        .taints
        .unwrap_or_default()
        .into_iter()
        .filter_map(|t| {
            let effect = match t.effect.as_str() {
                "NoSchedule" => NodeTaintEffect::NoSchedule,
                "PreferNoSchedule" => NodeTaintEffect::PreferNoSchedule,
                "NoExecute" => NodeTaintEffect::NoExecute,
                _ => return None,
            };
            Some(Taint {
                key: t.key,
                value: t.value.unwrap_or_default(),
                effect,
            })
        })
        .collect();
    let allocatable = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.clone())
        .unwrap_or_default();
    Ok(model::Node {
        labels: node.metadata.labels.clone().unwrap_or_default(),
        taints,
        unschedulable: spec.unschedulable.unwrap_or(false),
        allocatable: resource_list(&object, "status.allocatable", &allocatable)?,
        name,
    })
}

/// Converts a resource list: CPU in milli-cores, everything else in units (rounded up).
pub(crate) fn resource_list(
    object: &str,
    field: &str,
    list: &BTreeMap<String, KubeQuantity>,
) -> Result<Resources, ConvertError> {
    let mut resources = Resources::default();
    for (name, value) in list {
        let q = quantity(object, &format!("{field}.{name}"), value)?;
        let clamp = |v: i128| v.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
        match name.as_str() {
            "cpu" => resources.cpu_millis = clamp(q.milli_value()),
            "memory" => resources.memory = clamp(q.value()),
            "ephemeral-storage" => resources.ephemeral_storage = clamp(q.value()),
            "pods" => resources.pods = clamp(q.value()),
            _ => {
                resources.other.insert(name.clone(), clamp(q.value()));
            }
        }
    }
    Ok(resources)
}

/// What a pod asks of its node (the scheduler's `PodRequests`): containers plus
/// restartable init containers (sidecars), or the largest init container phase if more,
/// plus overhead; pod-level requests replace CPU and memory when set. Requests missing
/// where limits are set default to the limits, as the API server does.
pub fn pod_requests(object: &str, spec: &PodSpec) -> Result<Resources, ConvertError> {
    let containers = containers_requests(object, spec, |c| {
        let resources = c.resources.clone().unwrap_or_default();
        let mut list = resources.limits.unwrap_or_default();
        list.extend(resources.requests.unwrap_or_default());
        Some(list)
    })?;
    with_pod_level(object, spec, containers)
}

/// What a pod on a node holds there, as kube-scheduler counts it: while a resize is
/// under way, the larger of what its spec asks, what the kubelet allocated and what
/// the containers run with (only the latter two when the resize is infeasible).
pub fn pod_requests_in_use(object: &str, pod: &Pod) -> Result<Resources, ConvertError> {
    let spec = pod.spec.clone().unwrap_or_default();
    let status = pod.status.clone().unwrap_or_default();
    let statuses: Vec<&core::ContainerStatus> = status
        .container_statuses
        .iter()
        .flatten()
        .chain(status.init_container_statuses.iter().flatten())
        .collect();
    if statuses
        .iter()
        .all(|s| s.allocated_resources.is_none() && s.resources.as_ref().and_then(|r| r.requests.as_ref()).is_none())
    {
        return pod_requests(object, &spec);
    }
    let infeasible = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "PodResizePending" && c.reason.as_deref() == Some("Infeasible"));
    let status_of = |c: &core::Container| statuses.iter().find(|s| s.name == c.name).copied();
    let spec_list = |c: &core::Container| {
        let resources = c.resources.clone().unwrap_or_default();
        let mut list = resources.limits.unwrap_or_default();
        list.extend(resources.requests.unwrap_or_default());
        list
    };
    let allocated = |c: &core::Container| match status_of(c).and_then(|s| s.allocated_resources.clone()) {
        Some(list) => Some(list),
        None if infeasible => None,
        None => Some(spec_list(c)),
    };
    let actuated = |c: &core::Container| {
        let status = status_of(c);
        match status.and_then(|s| s.resources.as_ref()?.requests.clone()) {
            Some(list) => Some(list),
            None => allocated(c),
        }
    };
    let mut containers = max_of(
        &containers_requests(object, &spec, allocated)?,
        &containers_requests(object, &spec, actuated)?,
    );
    if !infeasible {
        containers = max_of(
            &containers,
            &containers_requests(object, &spec, |c| Some(spec_list(c)))?,
        );
    }
    with_pod_level(object, &spec, containers)
}

/// The containers' requests as kube-scheduler adds them up, each container's from
/// `requests_of` (`None`: nothing).
fn containers_requests(
    object: &str,
    spec: &PodSpec,
    requests_of: impl Fn(&core::Container) -> Option<BTreeMap<String, KubeQuantity>>,
) -> Result<Resources, ConvertError> {
    let container_requests = |c: &core::Container| -> Result<Resources, ConvertError> {
        let list = requests_of(c).unwrap_or_default();
        resource_list(object, &format!("container {}", c.name), &list)
    };
    let mut total = Resources::default();
    for container in &spec.containers {
        total.add(&container_requests(container)?);
    }
    let mut sidecars = Resources::default();
    let mut init_peak = Resources::default();
    for container in spec.init_containers.iter().flatten() {
        let requests = container_requests(container)?;
        let phase = if container.restart_policy.as_deref() == Some("Always") {
            total.add(&requests);
            sidecars.add(&requests);
            sidecars.clone()
        } else {
            let mut phase = requests;
            phase.add(&sidecars);
            phase
        };
        init_peak = max_of(&init_peak, &phase);
    }
    Ok(max_of(&total, &init_peak))
}

/// `containers` with pod-level requests in their place, and the overhead.
fn with_pod_level(object: &str, spec: &PodSpec, containers: Resources) -> Result<Resources, ConvertError> {
    let mut total = containers;
    if let Some(level) = spec.resources.as_ref().and_then(|r| r.requests.clone()) {
        let level = resource_list(object, "spec.resources.requests", &level)?;
        if level.cpu_millis > 0 {
            total.cpu_millis = level.cpu_millis;
        }
        if level.memory > 0 {
            total.memory = level.memory;
        }
    }
    if let Some(overhead) = &spec.overhead {
        total.add(&resource_list(object, "spec.overhead", overhead)?);
    }
    total.pods = 1;
    Ok(total)
}

fn max_of(a: &Resources, b: &Resources) -> Resources {
    let mut m = Resources {
        cpu_millis: a.cpu_millis.max(b.cpu_millis),
        memory: a.memory.max(b.memory),
        ephemeral_storage: a.ephemeral_storage.max(b.ephemeral_storage),
        pods: a.pods.max(b.pods),
        other: a.other.clone(),
    };
    for (name, value) in &b.other {
        let entry = m.other.entry(name.clone()).or_default();
        *entry = (*entry).max(*value);
    }
    m
}

/// The node a pod uses resources on: bound, nominated by preemption, or — released by
/// muster but not bound yet — pinned to exactly one node by its required node affinity.
/// Finished pods use nothing.
pub fn pod_node(pod: &Pod) -> Option<String> {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded") | Some("Failed")) {
        return None;
    }
    let spec = pod.spec.as_ref()?;
    spec.node_name
        .clone()
        .or_else(|| pod.status.as_ref().and_then(|s| s.nominated_node_name.clone()))
        .filter(|n| !n.is_empty())
        .or_else(|| pinned_node(spec))
}

/// The single node an ungated pod's required node affinity allows by name, if any.
fn pinned_node(spec: &PodSpec) -> Option<String> {
    if spec.scheduling_gates.as_ref().is_some_and(|g| !g.is_empty()) {
        return None;
    }
    let terms = &spec
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()?
        .node_selector_terms;
    let mut pinned: Option<&String> = None;
    for term in terms {
        let names = term
            .match_fields
            .iter()
            .flatten()
            .find(|r| r.key == "metadata.name" && r.operator == "In")?;
        match names.values.as_deref() {
            Some([node]) if pinned.is_none_or(|p| p == node) => pinned = Some(node),
            _ => return None,
        }
    }
    pinned.cloned()
}

/// The identity of a namespaced object.
pub fn object_key<K: kube::Resource>(object: &K) -> ObjectKey {
    let meta = object.meta();
    ObjectKey::new(
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default(),
    )
}

pub fn pod_key(pod: &Pod) -> PodKey {
    object_key(pod).into()
}

pub fn claim_key(claim: &resource::ResourceClaim) -> ClaimKey {
    object_key(claim).into()
}

pub fn tolerations(list: &[core::Toleration]) -> Vec<Toleration> {
    list.iter()
        .map(|t| Toleration {
            key: t.key.clone().unwrap_or_default(),
            exists: t.operator.as_deref() == Some("Exists"),
            value: t.value.clone().unwrap_or_default(),
            effect: match t.effect.as_deref() {
                Some("NoSchedule") => Some(NodeTaintEffect::NoSchedule),
                Some("PreferNoSchedule") => Some(NodeTaintEffect::PreferNoSchedule),
                Some("NoExecute") => Some(NodeTaintEffect::NoExecute),
                _ => None,
            },
        })
        .collect()
}

pub fn node_selector(object: &str, selector: &core::NodeSelector) -> Result<NodeSelector, ConvertError> {
    let requirements = |list: &Option<Vec<core::NodeSelectorRequirement>>| -> Result<Vec<Requirement>, ConvertError> {
        list.iter()
            .flatten()
            .map(|r| {
                Ok(Requirement {
                    key: r.key.clone(),
                    operator: Operator::parse(&r.operator)
                        .ok_or_else(|| err(object, format!("unknown node selector operator {:?}", r.operator)))?,
                    values: r.values.clone().unwrap_or_default(),
                })
            })
            .collect()
    };
    Ok(NodeSelector {
        terms: selector
            .node_selector_terms
            .iter()
            .map(|t| {
                Ok(Term {
                    match_expressions: requirements(&t.match_expressions)?,
                    match_fields: requirements(&t.match_fields)?,
                })
            })
            .collect::<Result<_, ConvertError>>()?,
    })
}

pub fn node_selector_to_kube(selector: &NodeSelector) -> core::NodeSelector {
    let requirements = |list: &[Requirement]| -> Option<Vec<core::NodeSelectorRequirement>> {
        (!list.is_empty()).then(|| {
            list.iter()
                .map(|r| core::NodeSelectorRequirement {
                    key: r.key.clone(),
                    operator: r.operator.as_str().to_string(),
                    values: (!r.values.is_empty()).then(|| r.values.clone()),
                })
                .collect()
        })
    };
    core::NodeSelector {
        node_selector_terms: selector
            .terms
            .iter()
            .map(|t| core::NodeSelectorTerm {
                match_expressions: requirements(&t.match_expressions),
                match_fields: requirements(&t.match_fields),
            })
            .collect(),
    }
}

/// Required node affinity of a pod spec.
pub fn required_affinity(object: &str, spec: &PodSpec) -> Result<Option<NodeSelector>, ConvertError> {
    spec.affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| n.required_during_scheduling_ignored_during_execution.as_ref())
        .map(|s| node_selector(object, s))
        .transpose()
}

// ---- DRA ----

fn attribute(value: &resource::DeviceAttribute) -> Option<AttributeValue> {
    if let Some(v) = value.int {
        Some(AttributeValue::Int(v))
    } else if let Some(v) = value.bool {
        Some(AttributeValue::Bool(v))
    } else if let Some(v) = &value.string {
        Some(AttributeValue::String(v.clone()))
    } else {
        value.version.as_ref().map(|v| AttributeValue::Version(v.clone()))
    }
}

fn device_taint(t: &resource::DeviceTaint) -> DeviceTaint {
    DeviceTaint {
        key: t.key.clone(),
        value: t.value.clone(),
        effect: match t.effect.as_str() {
            "NoSchedule" => TaintEffect::NoSchedule,
            "NoExecute" => TaintEffect::NoExecute,
            _ => TaintEffect::Other,
        },
    }
}

fn counters(
    object: &str,
    map: &BTreeMap<String, resource::Counter>,
) -> Result<BTreeMap<String, Quantity>, ConvertError> {
    map.iter()
        .map(|(k, c)| Ok((k.clone(), quantity(object, &format!("counter {k}"), &c.value)?)))
        .collect()
}

fn capacity(object: &str, name: &str, c: &resource::DeviceCapacity) -> Result<Capacity, ConvertError> {
    let field = format!("capacity {name}");
    let request_policy = c
        .request_policy
        .as_ref()
        .map(|p| {
            Ok::<_, ConvertError>(RequestPolicy {
                default: p.default.as_ref().map(|q| quantity(object, &field, q)).transpose()?,
                valid_values: p
                    .valid_values
                    .iter()
                    .flatten()
                    .map(|q| quantity(object, &field, q))
                    .collect::<Result<_, _>>()?,
                valid_range: p
                    .valid_range
                    .as_ref()
                    .map(|r| {
                        Ok::<_, ConvertError>(ValidRange {
                            min: quantity(object, &field, &r.min)?,
                            max: r.max.as_ref().map(|q| quantity(object, &field, q)).transpose()?,
                            step: r.step.as_ref().map(|q| quantity(object, &field, q)).transpose()?,
                        })
                    })
                    .transpose()?,
            })
        })
        .transpose()?;
    Ok(Capacity {
        value: quantity(object, &field, &c.value)?,
        request_policy: request_policy.map(Box::new),
    })
}

/// A ResourceSlice as the engine sees it.
pub fn slice(slice: &resource::ResourceSlice) -> Result<model::Slice, ConvertError> {
    let name = slice.metadata.name.clone().unwrap_or_default();
    let object = format!("ResourceSlice {name}");
    let spec = &slice.spec;
    let nodes = if let Some(node) = spec.node_name.clone().filter(|n| !n.is_empty()) {
        SliceNodes::Node(node)
    } else if spec.all_nodes == Some(true) {
        SliceNodes::All
    } else if let Some(selector) = &spec.node_selector {
        SliceNodes::Selector(node_selector(&object, selector)?)
    } else if spec.per_device_node_selection == Some(true) {
        SliceNodes::PerDevice
    } else if spec.shared_counters.is_some() {
        // A slice holding only counters offers no devices of its own.
        SliceNodes::Selector(NodeSelector::default())
    } else {
        return Err(err(
            &object,
            "none of nodeName, nodeSelector, allNodes and perDeviceNodeSelection is set",
        ));
    };
    let devices = spec
        .devices
        .iter()
        .flatten()
        .map(|d| {
            let device_nodes = if let Some(node) = d.node_name.clone() {
                Some(DeviceNodes::Node(node))
            } else if d.all_nodes == Some(true) {
                Some(DeviceNodes::All)
            } else {
                d.node_selector
                    .as_ref()
                    .map(|s| node_selector(&object, s).map(DeviceNodes::Selector))
                    .transpose()?
            };
            Ok(model::Device {
                name: d.name.clone(),
                attributes: d
                    .attributes
                    .iter()
                    .flatten()
                    .filter_map(|(k, v)| Some((k.clone(), attribute(v)?)))
                    .collect(),
                capacity: d
                    .capacity
                    .iter()
                    .flatten()
                    .map(|(k, c)| Ok((k.clone(), capacity(&object, k, c)?)))
                    .collect::<Result<_, ConvertError>>()?,
                consumes_counters: d
                    .consumes_counters
                    .iter()
                    .flatten()
                    .map(|c| {
                        Ok(CounterConsumption {
                            counter_set: c.counter_set.clone(),
                            counters: counters(&object, &c.counters)?,
                        })
                    })
                    .collect::<Result<_, ConvertError>>()?,
                nodes: device_nodes,
                taints: d.taints.iter().flatten().map(device_taint).collect(),
                binds_to_node: d.binds_to_node.unwrap_or(false),
                binding_conditions: d.binding_conditions.clone().unwrap_or_default(),
                binding_failure_conditions: d.binding_failure_conditions.clone().unwrap_or_default(),
                allow_multiple_allocations: d.allow_multiple_allocations.unwrap_or(false),
            })
        })
        .collect::<Result<_, ConvertError>>()?;
    Ok(model::Slice {
        name,
        driver: spec.driver.clone(),
        pool: spec.pool.name.clone(),
        generation: spec.pool.generation,
        resource_slice_count: spec.pool.resource_slice_count,
        nodes,
        devices,
        shared_counters: spec
            .shared_counters
            .iter()
            .flatten()
            .map(|c| {
                Ok(CounterSet {
                    name: c.name.clone(),
                    counters: counters(&object, &c.counters)?,
                })
            })
            .collect::<Result<_, ConvertError>>()?,
    })
}

fn raw_json(raw: &RawExtension) -> String {
    serde_json::to_string(&raw.0).unwrap_or_default()
}

/// A DeviceClass as the engine sees it.
/// A DeviceTaintRule: its selector (unset fields select everything) and its taint.
pub fn taint_rule(rule: &resource::DeviceTaintRule) -> muster_engine::cluster::DeviceTaintRule {
    let selector = rule.spec.device_selector.clone().unwrap_or_default();
    muster_engine::cluster::DeviceTaintRule {
        driver: selector.driver,
        pool: selector.pool,
        device: selector.device,
        taint: device_taint(&rule.spec.taint),
    }
}

pub fn device_class(class: &resource::DeviceClass) -> model::DeviceClass {
    let spec = class.spec.clone().unwrap_or_default();
    model::DeviceClass {
        name: class.metadata.name.clone().unwrap_or_default(),
        selectors: spec
            .selectors
            .iter()
            .flatten()
            .filter_map(|s| s.cel.as_ref().map(|c| c.expression.clone()))
            .collect(),
        config: spec
            .config
            .iter()
            .flatten()
            .filter_map(|c| c.opaque.as_ref())
            .map(|o| OpaqueConfig {
                driver: o.driver.clone(),
                parameters: raw_json(&o.parameters),
            })
            .collect(),
        extended_resource_name: spec.extended_resource_name,
    }
}

pub fn device_toleration(t: &resource::DeviceToleration) -> DeviceToleration {
    DeviceToleration {
        key: t.key.clone(),
        operator: if t.operator.as_deref() == Some("Exists") {
            TolerationOperator::Exists
        } else {
            TolerationOperator::Equal
        },
        value: t.value.clone(),
        effect: match t.effect.as_deref() {
            Some("NoSchedule") => Some(TaintEffect::NoSchedule),
            Some("NoExecute") => Some(TaintEffect::NoExecute),
            Some(_) => Some(TaintEffect::Other),
            None => None,
        },
        toleration_seconds: t.toleration_seconds,
    }
}

fn device_toleration_to_kube(t: &DeviceToleration) -> resource::DeviceToleration {
    resource::DeviceToleration {
        key: t.key.clone(),
        operator: Some(match t.operator {
            TolerationOperator::Exists => "Exists".into(),
            TolerationOperator::Equal => "Equal".into(),
        }),
        value: t.value.clone(),
        effect: t.effect.map(|e| match e {
            TaintEffect::NoSchedule => "NoSchedule".into(),
            TaintEffect::NoExecute => "NoExecute".into(),
            TaintEffect::Other => "None".into(),
        }),
        toleration_seconds: t.toleration_seconds,
    }
}

#[allow(clippy::too_many_arguments)]
fn request_spec(
    object: &str,
    name: &str,
    class: &str,
    selectors: &Option<Vec<resource::DeviceSelector>>,
    mode: &Option<String>,
    count: Option<i64>,
    admin: Option<bool>,
    tolerations: &Option<Vec<resource::DeviceToleration>>,
    capacity: &Option<resource::CapacityRequirements>,
) -> Result<DeviceRequestSpec, ConvertError> {
    let allocation_mode = match mode.as_deref() {
        None | Some("") | Some("ExactCount") => AllocationMode::ExactCount,
        Some("All") => AllocationMode::All,
        Some(other) => return Err(err(object, format!("request {name}: unknown allocationMode {other:?}"))),
    };
    let count = count.unwrap_or(1);
    if allocation_mode == AllocationMode::ExactCount && !(1..=i64::from(u32::MAX)).contains(&count) {
        return Err(err(object, format!("request {name}: count {count} is out of range")));
    }
    Ok(DeviceRequestSpec {
        name: name.to_string(),
        device_class_name: class.to_string(),
        selectors: selectors
            .iter()
            .flatten()
            .filter_map(|s| s.cel.as_ref().map(|c| c.expression.clone()))
            .collect(),
        allocation_mode,
        count: count.clamp(0, i64::from(u32::MAX)) as u32,
        admin_access: admin.unwrap_or(false),
        tolerations: tolerations.iter().flatten().map(device_toleration).collect(),
        capacity: capacity
            .as_ref()
            .and_then(|c| c.requests.as_ref())
            .into_iter()
            .flatten()
            .map(|(k, q)| Ok((k.clone(), quantity(object, &format!("request {name} capacity {k}"), q)?)))
            .collect::<Result<_, ConvertError>>()?,
    })
}

/// A claim's spec as the engine sees it. `object` names the claim or template.
pub fn claim_spec(object: &str, spec: &resource::ResourceClaimSpec) -> Result<ClaimSpec, ConvertError> {
    let devices = spec.devices.clone().unwrap_or_default();
    let requests = devices
        .requests
        .iter()
        .flatten()
        .map(|r| match (&r.exactly, &r.first_available) {
            (Some(e), _) => Ok(DeviceRequest::Exactly(request_spec(
                object,
                &r.name,
                &e.device_class_name,
                &e.selectors,
                &e.allocation_mode,
                e.count,
                e.admin_access,
                &e.tolerations,
                &e.capacity,
            )?)),
            (None, Some(subs)) => Ok(DeviceRequest::FirstAvailable {
                name: r.name.clone(),
                subrequests: subs
                    .iter()
                    .map(|s| {
                        request_spec(
                            object,
                            &s.name,
                            &s.device_class_name,
                            &s.selectors,
                            &s.allocation_mode,
                            s.count,
                            None,
                            &s.tolerations,
                            &s.capacity,
                        )
                    })
                    .collect::<Result<_, _>>()?,
            }),
            (None, None) => Err(err(
                object,
                format!("request {} has neither exactly nor firstAvailable", r.name),
            )),
        })
        .collect::<Result<_, _>>()?;
    let constraints = devices
        .constraints
        .iter()
        .flatten()
        .map(|c| {
            let kind = match (&c.match_attribute, &c.distinct_attribute) {
                (Some(a), _) => ConstraintKind::MatchAttribute(a.clone()),
                (None, Some(a)) => ConstraintKind::DistinctAttribute(a.clone()),
                (None, None) => {
                    return Err(err(
                        object,
                        "a constraint has neither matchAttribute nor distinctAttribute",
                    ));
                }
            };
            Ok(DeviceConstraint {
                requests: c.requests.clone().unwrap_or_default(),
                kind,
            })
        })
        .collect::<Result<_, _>>()?;
    let config = devices
        .config
        .iter()
        .flatten()
        .filter_map(|c| {
            c.opaque.as_ref().map(|o| ClaimConfig {
                requests: c.requests.clone().unwrap_or_default(),
                opaque: OpaqueConfig {
                    driver: o.driver.clone(),
                    parameters: raw_json(&o.parameters),
                },
            })
        })
        .collect();
    Ok(ClaimSpec {
        requests,
        constraints,
        config,
    })
}

/// The devices of an existing allocation.
pub fn allocation_devices(
    object: &str,
    allocation: &resource::AllocationResult,
) -> Result<Vec<DeviceResult>, ConvertError> {
    allocation
        .devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
        .map(|r| {
            Ok(DeviceResult {
                request: r.request.clone(),
                driver: r.driver.clone(),
                pool: r.pool.clone(),
                device: r.device.clone(),
                admin_access: r.admin_access,
                tolerations: r.tolerations.iter().flatten().map(device_toleration).collect(),
                binding_conditions: r.binding_conditions.clone().unwrap_or_default(),
                binding_failure_conditions: r.binding_failure_conditions.clone().unwrap_or_default(),
                share_id: r.share_id.clone(),
                consumed_capacity: r
                    .consumed_capacity
                    .iter()
                    .flatten()
                    .map(|(k, q)| Ok((k.clone(), quantity(object, "consumedCapacity", q)?)))
                    .collect::<Result<_, ConvertError>>()?,
            })
        })
        .collect()
}

/// An existing allocation in the engine's terms.
pub fn allocation(object: &str, allocation: &resource::AllocationResult) -> Result<Allocation, ConvertError> {
    Ok(Allocation {
        devices: allocation_devices(object, allocation)?,
        config: allocation
            .devices
            .iter()
            .flat_map(|d| d.config.iter().flatten())
            .filter_map(|c| {
                c.opaque.as_ref().map(|o| AllocatedConfig {
                    source: if c.source == "FromClass" {
                        ConfigSource::FromClass
                    } else {
                        ConfigSource::FromClaim
                    },
                    requests: c.requests.clone().unwrap_or_default(),
                    opaque: OpaqueConfig {
                        driver: o.driver.clone(),
                        parameters: raw_json(&o.parameters),
                    },
                })
            })
            .collect(),
        node_selector: allocation
            .node_selector
            .as_ref()
            .map(|s| node_selector(object, s))
            .transpose()?,
    })
}

/// The `status.allocation` to write for an engine allocation (timestamp added by the
/// writer).
pub fn allocation_to_kube(allocation: &Allocation) -> resource::AllocationResult {
    let quantity = |q: &Quantity| KubeQuantity(q.to_string());
    resource::AllocationResult {
        allocation_timestamp: None,
        devices: Some(resource::DeviceAllocationResult {
            results: Some(
                allocation
                    .devices
                    .iter()
                    .map(|d| resource::DeviceRequestAllocationResult {
                        request: d.request.clone(),
                        driver: d.driver.clone(),
                        pool: d.pool.clone(),
                        device: d.device.clone(),
                        admin_access: d.admin_access,
                        tolerations: (!d.tolerations.is_empty())
                            .then(|| d.tolerations.iter().map(device_toleration_to_kube).collect()),
                        binding_conditions: (!d.binding_conditions.is_empty()).then(|| d.binding_conditions.clone()),
                        binding_failure_conditions: (!d.binding_failure_conditions.is_empty())
                            .then(|| d.binding_failure_conditions.clone()),
                        share_id: d.share_id.clone(),
                        consumed_capacity: (!d.consumed_capacity.is_empty()).then(|| {
                            d.consumed_capacity
                                .iter()
                                .map(|(k, q)| (k.clone(), quantity(q)))
                                .collect()
                        }),
                        skip_node_operations: None,
                    })
                    .collect(),
            ),
            config: (!allocation.config.is_empty()).then(|| {
                allocation
                    .config
                    .iter()
                    .map(|c| resource::DeviceAllocationConfiguration {
                        source: match c.source {
                            ConfigSource::FromClass => "FromClass".into(),
                            ConfigSource::FromClaim => "FromClaim".into(),
                        },
                        requests: (!c.requests.is_empty()).then(|| c.requests.clone()),
                        opaque: Some(resource::OpaqueDeviceConfiguration {
                            driver: c.opaque.driver.clone(),
                            parameters: RawExtension(serde_json::from_str(&c.opaque.parameters).unwrap_or_default()),
                        }),
                    })
                    .collect()
            }),
        }),
        node_selector: allocation.node_selector.as_ref().map(node_selector_to_kube),
    }
}

/// What a pod asks of a node: resources, node selector, required affinity,
/// tolerations, and its labels, inter-pod (anti-)affinity, spread and host ports
/// (claims are added by the caller).
pub fn pod_shape(object: &str, pod: &Pod) -> Result<muster_engine::request::PodShape, ConvertError> {
    let spec = pod.spec.clone().unwrap_or_default();
    Ok(muster_engine::request::PodShape {
        requests: pod_requests(object, &spec)?,
        node_selector: spec.node_selector.clone().unwrap_or_default(),
        affinity: required_affinity(object, &spec)?,
        tolerations: tolerations(spec.tolerations.as_deref().unwrap_or_default()),
        claims: Vec::new(),
        shared: Vec::new(),
        rules: scheduling::pod_rules(object, pod)?,
    })
}

/// A pod bound or nominated to a node as the engine keeps it; `None` for a pod on no node.
pub fn pod_entry(pod: &Pod) -> Result<Option<muster_engine::cluster::PodEntry>, ConvertError> {
    let (Some(node), Some(_)) = (pod_node(pod), pod.spec.as_ref()) else {
        return Ok(None);
    };
    let object = format!("Pod {}", pod_key(pod));
    let traits = scheduling::pod_traits(pod)?;
    Ok(Some(muster_engine::cluster::PodEntry {
        node,
        requests: pod_requests_in_use(&object, pod)?,
        traits: if traits.is_empty() {
            Default::default()
        } else {
            std::sync::Arc::new(traits)
        },
    }))
}

#[cfg(test)]
mod tests;
