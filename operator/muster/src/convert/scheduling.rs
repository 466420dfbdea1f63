//! What kube-scheduler reads of a pod beyond resources, node selection and DRA claims,
//! in the engine's terms: labels, inter-pod (anti-)affinity, topology spread, host ports
//! and PersistentVolumeClaims.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{self as core, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;
use muster_engine::key::ObjectKey;
use muster_engine::labels::{LabelOperator, LabelRequirement, LabelSelector};
use muster_engine::pod::{
    AffinityTerm, HostPort, PodRules, PodTraits, SpreadConstraint, WeightedTerm, WhenUnsatisfiable,
};

use super::{ConvertError, err};

/// `metav1.LabelSelectorAsSelector`: unset selects nothing, empty everything.
pub fn label_selector(object: &str, selector: Option<&meta::LabelSelector>) -> Result<LabelSelector, ConvertError> {
    let Some(selector) = selector else {
        return Ok(LabelSelector::Nothing);
    };
    let mut requirements: Vec<LabelRequirement> = selector
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| LabelRequirement::new(k, LabelOperator::In, &[v]))
        .collect();
    for expression in selector.match_expressions.iter().flatten() {
        let operator = match expression.operator.as_str() {
            "In" => LabelOperator::In,
            "NotIn" => LabelOperator::NotIn,
            "Exists" => LabelOperator::Exists,
            "DoesNotExist" => LabelOperator::DoesNotExist,
            other => return Err(err(object, format!("unknown label selector operator {other:?}"))),
        };
        requirements.push(LabelRequirement {
            key: expression.key.clone(),
            operator,
            values: expression.values.clone().unwrap_or_default(),
        });
    }
    Ok(LabelSelector::Requirements(requirements))
}

/// The label pairs of `keys` the pod has.
fn pairs_of(labels: &BTreeMap<String, String>, keys: Option<&Vec<String>>) -> Vec<(String, String)> {
    keys.into_iter()
        .flatten()
        .filter_map(|k| labels.get(k).map(|v| (k.clone(), v.clone())))
        .collect()
}

/// A `PodAffinityTerm` of a pod with `labels`, its `matchLabelKeys` and
/// `mismatchLabelKeys` merged into the selector as the API server does.
fn affinity_term(
    object: &str,
    term: &core::PodAffinityTerm,
    labels: &BTreeMap<String, String>,
) -> Result<AffinityTerm, ConvertError> {
    let selector = label_selector(object, term.label_selector.as_ref())?
        .with_pairs(&pairs_of(labels, term.match_label_keys.as_ref()), false)
        .with_pairs(&pairs_of(labels, term.mismatch_label_keys.as_ref()), true);
    Ok(AffinityTerm {
        selector,
        namespaces: term.namespaces.clone().unwrap_or_default(),
        namespace_selector: term
            .namespace_selector
            .as_ref()
            .map(|s| label_selector(object, Some(s)))
            .transpose()?,
        topology_key: term.topology_key.clone(),
    })
}

fn terms(
    object: &str,
    list: Option<&Vec<core::PodAffinityTerm>>,
    labels: &BTreeMap<String, String>,
) -> Result<Vec<AffinityTerm>, ConvertError> {
    list.into_iter()
        .flatten()
        .map(|t| affinity_term(object, t, labels))
        .collect()
}

fn weighted(
    object: &str,
    list: Option<&Vec<core::WeightedPodAffinityTerm>>,
    labels: &BTreeMap<String, String>,
) -> Result<Vec<WeightedTerm>, ConvertError> {
    list.into_iter()
        .flatten()
        .map(|w| {
            Ok(WeightedTerm {
                weight: w.weight,
                term: affinity_term(object, &w.pod_affinity_term, labels)?,
            })
        })
        .collect()
}

fn spread_constraint(
    object: &str,
    constraint: &core::TopologySpreadConstraint,
    labels: &BTreeMap<String, String>,
) -> Result<SpreadConstraint, ConvertError> {
    let when_unsatisfiable = match constraint.when_unsatisfiable.as_str() {
        "DoNotSchedule" => WhenUnsatisfiable::DoNotSchedule,
        "ScheduleAnyway" => WhenUnsatisfiable::ScheduleAnyway,
        other => return Err(err(object, format!("unknown whenUnsatisfiable {other:?}"))),
    };
    // kube-scheduler merges matchLabelKeys only into a selector that is set.
    let selector = label_selector(object, constraint.label_selector.as_ref())?
        .with_pairs(&pairs_of(labels, constraint.match_label_keys.as_ref()), false);
    Ok(SpreadConstraint {
        max_skew: constraint.max_skew,
        topology_key: constraint.topology_key.clone(),
        when_unsatisfiable,
        selector,
        min_domains: constraint.min_domains.unwrap_or(1),
        honor_node_affinity: constraint.node_affinity_policy.as_deref() != Some("Ignore"),
        honor_node_taints: constraint.node_taints_policy.as_deref() == Some("Honor"),
    })
}

/// The host ports of a pod (`GetHostPorts`): of its containers and restartable init
/// containers; with `hostNetwork`, a container port without a host port is one (the API
/// server's defaulting, done here for pods not created yet).
pub fn host_ports(spec: &PodSpec) -> Vec<HostPort> {
    let sidecars = spec
        .init_containers
        .iter()
        .flatten()
        .filter(|c| c.restart_policy.as_deref() == Some("Always"));
    sidecars
        .chain(&spec.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|p| {
            let host_port = match p.host_port {
                Some(port) if port > 0 => port,
                _ if spec.host_network == Some(true) => p.container_port,
                _ => return None,
            };
            (host_port > 0).then(|| {
                HostPort::new(
                    p.host_ip.as_deref().unwrap_or_default(),
                    p.protocol.as_deref().unwrap_or_default(),
                    host_port,
                )
            })
        })
        .collect()
}

/// What the pods of a group built from `pod` ask for: its labels, (anti-)affinity,
/// spread and host ports.
pub fn pod_rules(object: &str, pod: &Pod) -> Result<PodRules, ConvertError> {
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let spec = pod.spec.clone().unwrap_or_default();
    let affinity = spec.affinity.as_ref();
    let pod_affinity = affinity.and_then(|a| a.pod_affinity.as_ref());
    let anti = affinity.and_then(|a| a.pod_anti_affinity.as_ref());
    Ok(PodRules {
        affinity: terms(
            object,
            pod_affinity.and_then(|a| a.required_during_scheduling_ignored_during_execution.as_ref()),
            &labels,
        )?,
        anti_affinity: terms(
            object,
            anti.and_then(|a| a.required_during_scheduling_ignored_during_execution.as_ref()),
            &labels,
        )?,
        preferred_affinity: weighted(
            object,
            pod_affinity.and_then(|a| a.preferred_during_scheduling_ignored_during_execution.as_ref()),
            &labels,
        )?,
        preferred_anti_affinity: weighted(
            object,
            anti.and_then(|a| a.preferred_during_scheduling_ignored_during_execution.as_ref()),
            &labels,
        )?,
        spread: spec
            .topology_spread_constraints
            .iter()
            .flatten()
            .map(|c| spread_constraint(object, c, &labels))
            .collect::<Result<_, _>>()?,
        host_ports: host_ports(&spec),
        labels,
    })
}

/// The PersistentVolumeClaims of a pod's volumes, `namespace/name`: those it names, and
/// `<pod>-<volume>` for its generic ephemeral volumes.
pub fn volume_claims(namespace: &str, pod_name: &str, spec: &PodSpec) -> Vec<ObjectKey> {
    spec.volumes
        .iter()
        .flatten()
        .filter_map(|v| {
            if let Some(claim) = &v.persistent_volume_claim {
                Some(ObjectKey::new(namespace, &claim.claim_name))
            } else if v.ephemeral.is_some() {
                Some(ObjectKey::new(namespace, &format!("{pod_name}-{}", v.name)))
            } else {
                None
            }
        })
        .collect()
}

/// What a pod on a node holds against other pods.
pub fn pod_traits(pod: &Pod) -> Result<PodTraits, ConvertError> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let object = format!("Pod {namespace}/{name}");
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(PodTraits {
            labels,
            ..PodTraits::default()
        });
    };
    let anti = spec
        .affinity
        .as_ref()
        .and_then(|a| a.pod_anti_affinity.as_ref())
        .and_then(|a| a.required_during_scheduling_ignored_during_execution.as_ref());
    Ok(PodTraits {
        anti_affinity: terms(&object, anti, &labels)?,
        host_ports: host_ports(spec),
        volumes: volume_claims(namespace, name, spec),
        volumes_taken: Vec::new(),
        terminating: pod.metadata.deletion_timestamp.is_some(),
        labels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(yaml: &str) -> Pod {
        serde_saphyr::from_str(yaml).unwrap()
    }

    #[test]
    fn rules_merge_label_keys_and_default_host_network_ports() {
        let p = pod(r#"
metadata: {name: w-0, namespace: team, labels: {app: w, job: j1}}
spec:
  hostNetwork: true
  containers:
  - name: c
    ports: [{containerPort: 29500}, {containerPort: 8080, hostPort: 18080, protocol: UDP}]
  initContainers:
  - {name: side, restartPolicy: Always, ports: [{containerPort: 9000}]}
  - {name: once, ports: [{containerPort: 9100}]}
  affinity:
    podAntiAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
      - {topologyKey: kubernetes.io/hostname, labelSelector: {matchLabels: {app: w}}, matchLabelKeys: [job]}
  topologySpreadConstraints:
  - {maxSkew: 1, topologyKey: topology.kubernetes.io/zone, whenUnsatisfiable: DoNotSchedule, labelSelector: {matchLabels: {app: w}}, minDomains: 3, nodeAffinityPolicy: Ignore}
"#);
        let rules = pod_rules("Pod team/w-0", &p).unwrap();
        let ports: Vec<String> = rules.host_ports.iter().map(ToString::to_string).collect();
        assert_eq!(ports, ["9000/TCP", "29500/TCP", "18080/UDP"]);
        assert_eq!(rules.anti_affinity[0].selector.to_string(), "app=w,job=j1");
        let spread = &rules.spread[0];
        assert_eq!(
            (spread.min_domains, spread.honor_node_affinity, spread.honor_node_taints),
            (3, false, false)
        );
        let traits = pod_traits(&p).unwrap();
        assert_eq!(traits.anti_affinity.len(), 1);
        assert!(traits.volumes.is_empty());
    }

    #[test]
    fn volumes_name_their_claims_and_ephemeral_ones_are_per_pod() {
        let p = pod(r#"
metadata: {name: w-1, namespace: team}
spec:
  containers: [{name: c}]
  volumes:
  - {name: data, persistentVolumeClaim: {claimName: shared}}
  - {name: scratch, ephemeral: {volumeClaimTemplate: {spec: {accessModes: [ReadWriteOnce]}}}}
  - {name: cfg, configMap: {name: x}}
"#);
        let claims: Vec<String> = volume_claims("team", "w-1", p.spec.as_ref().unwrap())
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(claims, ["team/shared", "team/w-1-scratch"]);
        assert_eq!(label_selector("x", None).unwrap(), LabelSelector::Nothing);
        assert!(
            label_selector("x", Some(&meta::LabelSelector::default()))
                .unwrap()
                .is_empty()
        );
    }
}
