//! What the API server's admission makes of a pod muster builds before it stores it:
//! the LimitRanger plugin's default requests and limits, the DefaultTolerationSeconds
//! plugin's tolerations, and the RuntimeClass plugin's overhead and scheduling. The operator plans from the pods as stored (they exist,
//! gated, before the plan); `muster plan` and `kubectl muster why` plan pods that may
//! not exist yet, and apply the same defaults from the objects they were given.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, LimitRange, Pod, PodSpec, Toleration};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::convert;

/// A pod the API server refuses to store, as its admission plugin says.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error("spec.runtimeClassName: RuntimeClass {0:?} not found")]
    MissingRuntimeClass(String),
    #[error("spec.nodeSelector[{key}] is {pod:?}, but RuntimeClass {class} schedules its pods with {key}={runtime:?}")]
    NodeSelectorConflict {
        class: String,
        key: String,
        pod: String,
        runtime: String,
    },
    #[error("spec.overhead differs from the overhead RuntimeClass {0} defines")]
    OverheadMismatch(String),
}

/// The LimitRanges and RuntimeClasses admission applies to new pods.
#[derive(Debug, Clone, Default)]
pub struct PodDefaults {
    /// Per namespace, its LimitRanges in name order.
    limit_ranges: BTreeMap<String, Vec<LimitRange>>,
    runtime_classes: BTreeMap<String, RuntimeClass>,
    /// Whether RuntimeClasses were given at all: without them, a pod's class is taken
    /// as it is (planned without overhead) rather than refused as missing.
    runtime_classes_known: bool,
}

impl PodDefaults {
    /// Defaults from these objects; `runtime_classes_known` says whether the cluster's
    /// RuntimeClasses are all among them.
    pub fn new(
        limit_ranges: impl IntoIterator<Item = LimitRange>,
        runtime_classes: impl IntoIterator<Item = RuntimeClass>,
        runtime_classes_known: bool,
    ) -> Self {
        let mut by_namespace: BTreeMap<String, Vec<LimitRange>> = BTreeMap::new();
        for range in limit_ranges {
            let namespace = range.metadata.namespace.clone().unwrap_or_default();
            by_namespace.entry(namespace).or_default().push(range);
        }
        for ranges in by_namespace.values_mut() {
            ranges.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        }
        PodDefaults {
            limit_ranges: by_namespace,
            runtime_classes: runtime_classes
                .into_iter()
                .map(|c| (c.metadata.name.clone().unwrap_or_default(), c))
                .collect(),
            runtime_classes_known,
        }
    }

    /// Whether `namespace` has a LimitRange among these.
    pub fn has_limit_ranges(&self, namespace: &str) -> bool {
        self.limit_ranges.get(namespace).is_some_and(|r| !r.is_empty())
    }

    /// `pod` as the API server would store it in `namespace`.
    pub fn apply(&self, namespace: &str, pod: &mut Pod) -> Result<(), AdmissionError> {
        let Some(spec) = pod.spec.as_mut() else {
            return Ok(());
        };
        for range in self.limit_ranges.get(namespace).into_iter().flatten() {
            let (requests, limits) = container_defaults(range);
            for container in spec
                .containers
                .iter_mut()
                .chain(spec.init_containers.iter_mut().flatten())
            {
                merge_defaults(container, &requests, &limits);
            }
        }
        add_default_tolerations(spec);
        let Some(class_name) = spec.runtime_class_name.clone().filter(|n| !n.is_empty()) else {
            return Ok(());
        };
        let Some(class) = self.runtime_classes.get(&class_name) else {
            if self.runtime_classes_known {
                return Err(AdmissionError::MissingRuntimeClass(class_name));
            }
            return Ok(());
        };
        if let Some(fixed) = class.overhead.as_ref().and_then(|o| o.pod_fixed.clone()) {
            if let Some(own) = spec.overhead.as_ref().filter(|o| !o.is_empty())
                && !same_amounts(own, &fixed)
            {
                return Err(AdmissionError::OverheadMismatch(class_name));
            }
            spec.overhead = Some(fixed);
        }
        if let Some(scheduling) = &class.scheduling {
            for (key, runtime) in scheduling.node_selector.iter().flatten() {
                let selector = spec.node_selector.get_or_insert_with(BTreeMap::new);
                match selector.get(key) {
                    Some(pod_value) if pod_value != runtime => {
                        return Err(AdmissionError::NodeSelectorConflict {
                            class: class_name,
                            key: key.clone(),
                            pod: pod_value.clone(),
                            runtime: runtime.clone(),
                        });
                    }
                    _ => {
                        selector.insert(key.clone(), runtime.clone());
                    }
                }
            }
            // Appending is what merging amounts to for scheduling: a toleration already
            // covered tolerates nothing more.
            if let Some(extra) = scheduling.tolerations.as_ref().filter(|t| !t.is_empty()) {
                spec.tolerations
                    .get_or_insert_with(Vec::new)
                    .extend(extra.iter().cloned());
            }
        }
        Ok(())
    }
}

/// The DefaultTolerationSeconds plugin: a pod that does not tolerate a node being not
/// ready or unreachable (`NoExecute`) does so for 300 s.
fn add_default_tolerations(spec: &mut PodSpec) {
    let tolerations = spec.tolerations.get_or_insert_with(Vec::new);
    for key in [NOT_READY, UNREACHABLE] {
        let tolerated = tolerations.iter().any(|t| {
            let t_key = t.key.as_deref().unwrap_or_default();
            let effect = t.effect.as_deref().unwrap_or_default();
            (t_key == key || t_key.is_empty()) && (effect == "NoExecute" || effect.is_empty())
        });
        if !tolerated {
            tolerations.push(Toleration {
                key: Some(key.into()),
                operator: Some("Exists".into()),
                effect: Some("NoExecute".into()),
                toleration_seconds: Some(300),
                value: None,
            });
        }
    }
}

const NOT_READY: &str = "node.kubernetes.io/not-ready";
const UNREACHABLE: &str = "node.kubernetes.io/unreachable";

type ResourceList = BTreeMap<String, Quantity>;

/// A LimitRange's default requests and limits for containers, as the API server
/// defaults the object: a missing default limit is the max, a missing default request
/// the default limit, else the min.
fn container_defaults(range: &LimitRange) -> (ResourceList, ResourceList) {
    let mut requests = ResourceList::new();
    let mut limits = ResourceList::new();
    for item in range.spec.as_ref().map(|s| s.limits.as_slice()).unwrap_or_default() {
        if item.type_ != "Container" {
            continue;
        }
        let mut default = item.default.clone().unwrap_or_default();
        for (key, value) in item.max.iter().flatten() {
            default.entry(key.clone()).or_insert_with(|| value.clone());
        }
        let mut default_request = item.default_request.clone().unwrap_or_default();
        for (key, value) in default.iter().chain(item.min.iter().flatten()) {
            default_request.entry(key.clone()).or_insert_with(|| value.clone());
        }
        requests.extend(default_request);
        limits.extend(default);
    }
    (requests, limits)
}

/// Sets each default the container does not set itself.
fn merge_defaults(container: &mut Container, requests: &ResourceList, limits: &ResourceList) {
    if requests.is_empty() && limits.is_empty() {
        return;
    }
    let resources = container.resources.get_or_insert_with(Default::default);
    let own_limits = resources.limits.get_or_insert_with(BTreeMap::new);
    for (key, value) in limits {
        own_limits.entry(key.clone()).or_insert_with(|| value.clone());
    }
    let own_requests = resources.requests.get_or_insert_with(BTreeMap::new);
    for (key, value) in requests {
        own_requests.entry(key.clone()).or_insert_with(|| value.clone());
    }
}

/// Whether two resource lists name the same amounts (`1000m` is `1`).
fn same_amounts(a: &ResourceList, b: &ResourceList) -> bool {
    let amounts = |list: &ResourceList| convert::resource_list("RuntimeClass", "overhead", list).ok();
    a.keys().eq(b.keys()) && amounts(a).is_some() && amounts(a) == amounts(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "team"}, "spec": spec})).unwrap()
    }

    fn limit_range(namespace: &str, name: &str, item: serde_json::Value) -> LimitRange {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"limits": [item]},
        }))
        .unwrap()
    }

    fn requests_of(pod: &Pod, container: usize) -> BTreeMap<String, String> {
        let c = &pod.spec.as_ref().unwrap().containers[container];
        let r = c
            .resources
            .as_ref()
            .and_then(|r| r.requests.clone())
            .unwrap_or_default();
        r.into_iter().map(|(k, v)| (k, v.0)).collect()
    }

    #[test]
    fn limit_range_defaults_fill_only_what_a_container_leaves_out() {
        let defaults = PodDefaults::new(
            [
                limit_range(
                    "team",
                    "a",
                    json!({"type": "Container", "defaultRequest": {"cpu": "40"}, "default": {"memory": "8Gi"}}),
                ),
                // A later range does not override what an earlier one set.
                limit_range(
                    "team",
                    "b",
                    json!({"type": "Container", "defaultRequest": {"cpu": "1"}}),
                ),
                limit_range(
                    "other",
                    "c",
                    json!({"type": "Container", "defaultRequest": {"cpu": "7"}}),
                ),
                limit_range("team", "d", json!({"type": "Pod", "max": {"cpu": "100"}})),
            ],
            [],
            true,
        );
        let mut p = pod(json!({"containers": [
            {"name": "gpu", "resources": {"claims": [{"name": "gpu"}]}},
            {"name": "side", "resources": {"requests": {"cpu": "2"}}},
        ]}));
        defaults.apply("team", &mut p).unwrap();
        // The default limit is the default request where none is given.
        assert_eq!(
            requests_of(&p, 0),
            BTreeMap::from([("cpu".into(), "40".into()), ("memory".into(), "8Gi".into())])
        );
        assert_eq!(
            requests_of(&p, 1),
            BTreeMap::from([("cpu".into(), "2".into()), ("memory".into(), "8Gi".into())])
        );
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(
            spec.containers[0]
                .resources
                .as_ref()
                .unwrap()
                .claims
                .as_ref()
                .unwrap()
                .len(),
            1
        );
        let requests = convert::pod_requests("p", spec).unwrap();
        assert_eq!(requests.cpu_millis, 42_000);
        assert!(!defaults.has_limit_ranges("elsewhere"));
    }

    #[test]
    fn a_max_or_min_stands_in_for_missing_defaults() {
        let defaults = PodDefaults::new(
            [limit_range(
                "team",
                "a",
                json!({"type": "Container", "max": {"cpu": "4"}, "min": {"memory": "1Gi"}}),
            )],
            [],
            true,
        );
        let mut p = pod(json!({"containers": [{"name": "c"}]}));
        defaults.apply("team", &mut p).unwrap();
        assert_eq!(
            requests_of(&p, 0),
            BTreeMap::from([("cpu".into(), "4".into()), ("memory".into(), "1Gi".into())])
        );
    }

    fn runtime_class(value: serde_json::Value) -> RuntimeClass {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn a_runtime_class_adds_its_overhead_node_selector_and_tolerations() {
        let defaults = PodDefaults::new(
            [],
            [runtime_class(json!({
                "metadata": {"name": "kata"},
                "handler": "kata",
                "overhead": {"podFixed": {"cpu": "250m", "memory": "160Mi"}},
                "scheduling": {"nodeSelector": {"sandbox": "yes"}, "tolerations": [{"key": "sandbox", "operator": "Exists"}]},
            }))],
            true,
        );
        let mut p = pod(json!({"runtimeClassName": "kata", "nodeSelector": {"zone": "a"},
            "containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}]}));
        defaults.apply("team", &mut p).unwrap();
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(convert::pod_requests("p", spec).unwrap().cpu_millis, 1_250);
        assert_eq!(
            spec.node_selector.as_ref().unwrap().get("sandbox").map(String::as_str),
            Some("yes")
        );
        assert_eq!(spec.node_selector.as_ref().unwrap().len(), 2);
        // The two of DefaultTolerationSeconds, then the class's.
        assert_eq!(spec.tolerations.as_ref().unwrap().len(), 3);

        let mut clash = pod(json!({"runtimeClassName": "kata", "nodeSelector": {"sandbox": "no"}, "containers": []}));
        assert!(matches!(
            defaults.apply("team", &mut clash),
            Err(AdmissionError::NodeSelectorConflict { .. })
        ));
        let mut same =
            pod(json!({"runtimeClassName": "kata", "overhead": {"cpu": "0.25", "memory": "160Mi"}, "containers": []}));
        defaults.apply("team", &mut same).unwrap();
        let mut other = pod(json!({"runtimeClassName": "kata", "overhead": {"cpu": "1"}, "containers": []}));
        assert_eq!(
            defaults.apply("team", &mut other),
            Err(AdmissionError::OverheadMismatch("kata".into()))
        );
        let mut missing = pod(json!({"runtimeClassName": "gvisor", "containers": []}));
        let error = defaults.apply("team", &mut missing).unwrap_err();
        assert_eq!(
            error.to_string(),
            "spec.runtimeClassName: RuntimeClass \"gvisor\" not found"
        );
        // Classes not given at all: the pod is planned as it is.
        PodDefaults::default().apply("team", &mut missing).unwrap();
    }
}
