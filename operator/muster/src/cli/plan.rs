//! `muster plan`: the offline what-if. Plans Workloads against a cluster snapshot with
//! the same engine the operator uses, one after the other (each fitting Workload's
//! placement is assumed before the next is planned), and reports placements or reasons.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use muster_api::Workload;
use muster_engine::cluster::{ClusterState, PlanId};
use muster_engine::key::{ClaimKey, ObjectKey};
use muster_engine::placement::{self, Outcome, PlanOptions};
use muster_engine::preemption::{
    Preemption, PreemptionCandidate, PreemptionOptions, PreemptionPolicy, Preemptor, preempt,
};
use muster_engine::request::GangRequest;
use serde::Serialize;

use crate::admission::fencing::Fencing;
use crate::admission::preemption_scope::PreemptionScope;
use crate::admission::request::{ClaimSources, gang_request};
use crate::convert;
use crate::snapshot::Objects;
use crate::workload::admitted::PodDefaults;
use crate::workload::extended::ExtendedResources;

/// The report `muster plan -o json` prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub workloads: Vec<WorkloadReport>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WorkloadReport {
    pub name: String,
    pub feasible: bool,
    /// Why it does not fit; `null` when it does.
    pub reason: Option<String>,
    pub pods: Vec<PodReport>,
    /// For a Workload that does not fit: the gangs of lower priority it would evict
    /// to fit, if the engine proves it would fit then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preemption: Option<PreemptionReport>,
    /// What the plan may have missed about its pods (defaults of objects the snapshot
    /// does not hold).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PreemptionReport {
    /// Evicted whole, as `namespace/name`.
    pub victims: Vec<String>,
    /// The value of the required topology label it would go to.
    pub domain: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PodReport {
    pub name: String,
    pub node: String,
    pub devices: Vec<DeviceReport>,
    /// Static PersistentVolumes chosen for claims that bind at the first consumer.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceReport {
    pub claim: String,
    pub request: String,
    pub driver: String,
    pub pool: String,
    pub device: String,
}

/// Extra facts for the human output.
#[derive(Debug, Clone, Default)]
pub struct Details {
    /// Per workload: `key=value` of the required topology level, and preferred values.
    pub topology: BTreeMap<String, String>,
    /// Per workload: pods beyond minCount that did not fit.
    pub unplaced: BTreeMap<String, Vec<String>>,
}

/// Plans every Workload of `workloads` against `snapshot` as the operator would with
/// `fencing`. Objects without a namespace are taken to be in `namespace`. The snapshot's
/// nodes and slices move into the engine's state.
pub fn plan(
    mut snapshot: Objects,
    workloads: &Objects,
    namespace: &str,
    fencing: Fencing,
    scope: PreemptionScope,
) -> Result<(Report, Details), anyhow::Error> {
    let mut cluster = snapshot.take_cluster_state()?;
    // DeviceClasses that come with the Workloads (one mapping an extended resource, say)
    // count as applied with them.
    for class in &workloads.classes {
        cluster.upsert_class(crate::convert::device_class(class));
    }
    // Storage that comes with them too.
    for claim in &workloads.volume_claims {
        let mut claim = claim.clone();
        if claim.key.namespace().is_empty() {
            claim.key = ObjectKey::new(namespace, claim.key.name());
        }
        cluster.storage_mut().upsert_claim(claim);
    }
    for volume in &workloads.volumes {
        cluster.storage_mut().upsert_volume(volume.clone());
    }
    for (class, _) in &workloads.storage_classes {
        cluster.storage_mut().upsert_class(class.clone());
    }
    let default_class = workloads
        .default_storage_class()
        .or(snapshot.default_storage_class())
        .map(str::to_string);
    let mut templates = std::mem::take(&mut snapshot.templates);
    templates.extend(workloads.templates.iter().cloned());
    let mut claims = std::mem::take(&mut snapshot.claims);
    claims.extend(workloads.claims.iter().cloned());
    for meta in templates
        .iter_mut()
        .map(|t| &mut t.metadata)
        .chain(claims.iter_mut().map(|c| &mut c.metadata))
    {
        meta.namespace.get_or_insert_with(|| namespace.to_string());
    }
    let sources = ClaimSources::new(&templates, &claims);
    let mut classes = std::mem::take(&mut snapshot.priority_classes);
    classes.extend(workloads.priority_classes.iter().cloned());
    // What the API server's admission would give pods not stored yet.
    let runtime_classes: Vec<_> = std::mem::take(&mut snapshot.runtime_classes)
        .into_iter()
        .chain(workloads.runtime_classes.iter().cloned())
        .collect();
    let runtime_classes_known = !runtime_classes.is_empty();
    let defaults = PodDefaults::new(
        std::mem::take(&mut snapshot.limit_ranges)
            .into_iter()
            .chain(workloads.limit_ranges.iter().cloned()),
        runtime_classes,
        runtime_classes_known,
    );

    let mut report = Report { workloads: Vec::new() };
    let mut details = Details::default();
    for workload in &workloads.workloads {
        let mut workload = workload.clone();
        workload.metadata.namespace.get_or_insert_with(|| namespace.to_string());
        // Pods and claims are owned by the Workload; a file has no uid yet.
        workload.metadata.uid.get_or_insert_with(|| "planned".to_string());
        let name = workload.metadata.name.clone().unwrap_or_default();
        // Pods another controller made for the Workload's template-less groups.
        let external: Vec<Arc<Pod>> = workloads
            .pods
            .iter()
            .chain(snapshot.pods.iter().filter(|p| crate::workload::status::is_gated(p)))
            .filter(|p| {
                p.metadata.namespace.as_deref().unwrap_or(namespace)
                    == workload.metadata.namespace.as_deref().unwrap_or_default()
            })
            .filter(|p| {
                p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(muster_api::labels::WORKLOAD))
                    == Some(&name)
            })
            .map(|p| Arc::new(p.clone()))
            .collect();
        let mut extended = ExtendedResources::of_cluster(&cluster);
        extended.record_existing(external.iter().map(AsRef::as_ref), []);
        let warnings = missing_defaults(&workload, &external, &defaults);
        let mut request = match gang_request(&workload, &extended, &sources, &external, &defaults) {
            Ok(request) => request,
            Err(e) => {
                report.workloads.push(WorkloadReport {
                    name,
                    feasible: false,
                    reason: Some(e.to_string()),
                    pods: vec![],
                    preemption: None,
                    warnings,
                });
                continue;
            }
        };
        fencing.apply(&mut request);
        // Inside Kueue's decision, as the admission loop plans a gang Kueue admitted.
        if let Some(object) = workloads
            .kueue_workloads
            .iter()
            .find(|o| crate::kueue::made_for(o, &workload))
        {
            let flavors = crate::kueue::flavor_node_labels(workloads.kueue_flavors.iter().cloned());
            let nodes: Vec<(&str, &BTreeMap<String, String>)> =
                cluster.nodes().map(|n| (n.name.as_str(), &n.labels)).collect();
            crate::kueue::apply_assignment(&mut request, &workload, object, &flavors, &nodes);
        }
        // The claims kube-controller-manager will make for the pods' ephemeral volumes.
        for claim in ephemeral_claims(&workload, &request, default_class.as_deref())? {
            if cluster.storage().claim(&claim.key).is_none() {
                cluster.storage_mut().upsert_claim(claim);
            }
        }
        match placement::plan(&cluster, &request, &PlanOptions::default()) {
            Outcome::Unschedulable(why) => {
                let preemption = would_preempt(&cluster, &snapshot, &claims, &classes, &workload, &request, scope);
                let mut reason = why.to_string();
                if let Some(kueue) = crate::kueue::explain(&request) {
                    reason = format!("{kueue}: {reason}");
                }
                report.workloads.push(WorkloadReport {
                    name,
                    feasible: false,
                    reason: Some(reason),
                    pods: vec![],
                    preemption,
                    warnings,
                })
            }
            Outcome::Placed(plan) => {
                // Devices per claim key, shared claims included.
                let by_claim: BTreeMap<&ClaimKey, &muster_engine::claim::Allocation> =
                    plan.claims.iter().map(|c| (&c.claim, &c.allocation)).collect();
                let mut pods = Vec::new();
                for placed in &plan.pods {
                    let group = request.groups.iter().find(|g| g.name == placed.group);
                    let instance = group.and_then(|g| g.pods.iter().find(|p| p.key == placed.pod));
                    let mut claim_keys: Vec<&ClaimKey> = instance
                        .map(|p| p.claims.iter().map(|c| &c.key).collect())
                        .unwrap_or_default();
                    if let Some(group) = group {
                        claim_keys.extend(group.shape.shared.iter().map(|s| &request.shared_claims[*s].key));
                    }
                    let devices = claim_keys
                        .iter()
                        .filter_map(|key| by_claim.get(key).map(|a| (key, a)))
                        .flat_map(|(key, allocation)| {
                            let claim = key.name().to_string();
                            allocation.devices.iter().map(move |d| DeviceReport {
                                claim: claim.clone(),
                                request: d.request.clone(),
                                driver: d.driver.clone(),
                                pool: d.pool.clone(),
                                device: d.device.clone(),
                            })
                        })
                        .collect();
                    pods.push(PodReport {
                        name: placed.pod.name().to_string(),
                        node: placed.node.clone(),
                        devices,
                        volumes: plan
                            .volumes
                            .iter()
                            .filter(|v| v.pod == placed.pod)
                            .map(|v| v.volume.clone())
                            .collect(),
                    });
                }
                let mut topology = String::new();
                if let (Some(key), Some(value)) = (&request.topology.required, &plan.topology_value) {
                    topology = format!("{key}={value}");
                }
                if let Some(key) = &request.topology.preferred {
                    let values = plan.preferred_values.join(",");
                    if !topology.is_empty() {
                        topology.push_str(", ");
                    }
                    let _ = write!(topology, "{key}: {values}");
                }
                for level in &plan.preferred_levels {
                    let _ = write!(topology, ", {}: {}", level.key, level.values.join(","));
                }
                for group in &plan.group_topology {
                    let mut parts = Vec::new();
                    if let Some((key, value)) = &group.required {
                        parts.push(format!("{key}={value}"));
                    }
                    if let Some((key, values)) = &group.slices {
                        parts.push(format!("{} slices by {key}: {}", values.len(), values.join(",")));
                    }
                    if !topology.is_empty() {
                        topology.push_str("; ");
                    }
                    let _ = write!(topology, "group {}: {}", group.group, parts.join(", "));
                }
                details.topology.insert(name.clone(), topology);
                if !plan.unplaced.is_empty() {
                    details
                        .unplaced
                        .insert(name.clone(), plan.unplaced.iter().map(|p| p.to_string()).collect());
                }
                // The next Workload sees this one as placed.
                let (assumed_pods, assumed_claims) = plan.assumption(&request);
                cluster.assume(
                    &PlanId::Gang(convert::object_key(&workload)),
                    &assumed_pods,
                    &assumed_claims,
                );
                report.workloads.push(WorkloadReport {
                    name,
                    feasible: true,
                    reason: None,
                    pods,
                    preemption: None,
                    warnings,
                });
            }
        }
    }
    Ok((report, details))
}

/// The claims of the generic ephemeral volumes of a Workload's pods, as they will be
/// made (`<pod>-<volume>`, the default StorageClass when the template names none).
fn ephemeral_claims(
    workload: &muster_api::Workload,
    request: &GangRequest,
    default_class: Option<&str>,
) -> Result<Vec<muster_engine::storage::Pvc>, anyhow::Error> {
    let mut claims = Vec::new();
    for group in &workload.spec.pod_groups {
        let Some(spec) = group.template.as_ref().and_then(|t| t.spec.as_ref()) else {
            continue;
        };
        let Some(pods) = request.groups.iter().find(|g| g.name == group.name).map(|g| &g.pods) else {
            continue;
        };
        for volume in spec.volumes.iter().flatten() {
            let Some(template) = volume.ephemeral.as_ref().and_then(|e| e.volume_claim_template.as_ref()) else {
                continue;
            };
            for pod in pods {
                let key = ObjectKey::new(pod.key.namespace(), &format!("{}-{}", pod.key.name(), volume.name));
                let object = format!("PersistentVolumeClaim {key}");
                let class = template
                    .spec
                    .storage_class_name
                    .clone()
                    .or_else(|| default_class.map(str::to_string));
                claims.push(convert::storage::claim_spec(&object, key, &template.spec, class)?);
            }
        }
    }
    Ok(claims)
}

/// What a PriorityClass named by `name` (or the global default) is worth, and whether
/// it may preempt.
fn class_of(classes: &[PriorityClass], name: Option<&str>) -> Preemptor {
    let class = match name {
        Some(name) => classes.iter().find(|c| c.metadata.name.as_deref() == Some(name)),
        None => classes.iter().find(|c| c.global_default == Some(true)),
    };
    Preemptor {
        priority: class.and_then(|c| c.value).unwrap_or(0),
        policy: match class.and_then(|c| c.preemption_policy.as_deref()) {
            Some("Never") => PreemptionPolicy::Never,
            _ => PreemptionPolicy::PreemptLowerPriority,
        },
    }
}

/// The gangs of the snapshot a Workload that does not fit would evict: the running
/// gangs are the bound pods labelled with a Workload (their priority as Kubernetes
/// resolved it) and the allocated claims labelled with it.
fn would_preempt(
    cluster: &ClusterState,
    snapshot: &Objects,
    claims: &[ResourceClaim],
    classes: &[PriorityClass],
    workload: &muster_api::Workload,
    request: &GangRequest,
    scope: PreemptionScope,
) -> Option<PreemptionReport> {
    let preemptor = class_of(classes, workload.spec.priority_class_name.as_deref());
    let own_namespace = workload.metadata.namespace.as_deref().unwrap_or_default();
    let gang_of = |meta: &ObjectMeta| -> Option<ObjectKey> {
        let name = meta.labels.as_ref()?.get(muster_api::labels::WORKLOAD)?;
        Some(ObjectKey::new(meta.namespace.as_deref().unwrap_or_default(), name))
    };
    let own = convert::object_key(workload);
    let mut candidates: BTreeMap<ObjectKey, PreemptionCandidate> = BTreeMap::new();
    for pod in snapshot.pods.iter().filter(|p| convert::pod_node(p).is_some()) {
        let Some(gang) = gang_of(&pod.metadata).filter(|g| {
            *g != own && scope.allows(own_namespace, pod.metadata.namespace.as_deref().unwrap_or_default())
        }) else {
            continue;
        };
        let priority = pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
        let started = pod
            .status
            .as_ref()
            .and_then(|s| s.start_time.as_ref())
            .map_or(0, |t| t.0.as_second());
        let candidate = candidates.entry(gang.clone()).or_insert_with(|| PreemptionCandidate {
            workload: gang,
            priority,
            admitted_at_seconds: started,
            pods: Vec::new(),
            claims: Vec::new(),
            assumed_plans: Vec::new(),
        });
        candidate.priority = candidate.priority.max(priority);
        candidate.admitted_at_seconds = candidate.admitted_at_seconds.min(started);
        candidate.pods.push(convert::pod_key(pod));
    }
    for claim in claims {
        let allocated = claim.status.as_ref().is_some_and(|s| s.allocation.is_some());
        if let Some(candidate) = gang_of(&claim.metadata).and_then(|g| candidates.get_mut(&g))
            && allocated
        {
            candidate.claims.push(convert::claim_key(claim));
        }
    }
    let candidates: Vec<PreemptionCandidate> = candidates.into_values().collect();
    match preempt(cluster, request, &preemptor, &candidates, &PreemptionOptions::default()) {
        Preemption::Evict(eviction) => Some(PreemptionReport {
            victims: eviction.victims.iter().map(|v| v.as_str().to_string()).collect(),
            domain: eviction.domain.clone(),
        }),
        _ => None,
    }
}

/// The report for people: per Workload, the placement or the reasons.
/// Warnings for pods planned before they exist, in a namespace the given objects hold no
/// LimitRange of: a container that leaves its CPU or memory request out may get one
/// from a LimitRange the plan does not know.
fn missing_defaults(workload: &Workload, stored: &[Arc<Pod>], defaults: &PodDefaults) -> Vec<String> {
    let namespace = workload.metadata.namespace.as_deref().unwrap_or_default();
    if defaults.has_limit_ranges(namespace) {
        return Vec::new();
    }
    let stored_group = |group: &str| {
        stored.iter().any(|p| {
            p.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(muster_api::labels::POD_GROUP))
                .map(String::as_str)
                == Some(group)
        })
    };
    let mut warnings = Vec::new();
    for group in &workload.spec.pod_groups {
        let Some(spec) = group.template.as_ref().and_then(|t| t.spec.as_ref()) else {
            continue;
        };
        if stored_group(&group.name) {
            continue;
        }
        let unset = spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
            .find(|c| {
                let resources = c.resources.as_ref();
                let set = |key: &str| {
                    resources.is_some_and(|r| {
                        r.requests.as_ref().is_some_and(|l| l.contains_key(key))
                            || r.limits.as_ref().is_some_and(|l| l.contains_key(key))
                    })
                };
                !set("cpu") || !set("memory")
            });
        let pod_level = spec.resources.as_ref().and_then(|r| r.requests.as_ref()).is_some();
        if let (Some(container), false) = (unset, pod_level) {
            warnings.push(format!(
                "pod group {}: container {} sets no CPU or memory request, and no LimitRange of namespace \
                 {namespace} was given: if it has one, its defaults are not planned (add `kubectl get \
                 limitranges -n {namespace} -o yaml` to the snapshot)",
                group.name, container.name
            ));
        }
    }
    warnings
}

pub fn human(report: &Report, details: &Details) -> String {
    let mut out = String::new();
    for workload in &report.workloads {
        for warning in &workload.warnings {
            let _ = writeln!(out, "{}: warning: {warning}", workload.name);
        }
        if !workload.feasible {
            let _ = writeln!(out, "{}: does not fit", workload.name);
            for reason in workload.reason.iter().flat_map(|r| r.split("; ")) {
                let _ = writeln!(out, "  - {reason}");
            }
            if let Some(preemption) = &workload.preemption {
                let domain = preemption
                    .domain
                    .as_ref()
                    .map(|d| format!(" (in {d})"))
                    .unwrap_or_default();
                let _ = writeln!(
                    out,
                    "  would fit by preempting{domain}: {}",
                    preemption.victims.join(", ")
                );
            }
            continue;
        }
        let topology = details.topology.get(&workload.name).filter(|t| !t.is_empty());
        let _ = writeln!(
            out,
            "{}: fits{}",
            workload.name,
            topology.map(|t| format!(" ({t})")).unwrap_or_default()
        );
        let mut pods = crate::cli::table::plain(vec!["POD", "NODE", "DEVICES"]);
        for pod in &workload.pods {
            let volumes = if pod.volumes.is_empty() {
                String::new()
            } else {
                format!("; volumes: {}", pod.volumes.join(", "))
            };
            pods.add_row(vec![
                pod.name.clone(),
                pod.node.clone(),
                format!("{}{volumes}", summarize(&pod.devices)),
            ]);
        }
        out.push_str(&crate::cli::table::indented(&pods, "  "));
        if let Some(unplaced) = details.unplaced.get(&workload.name) {
            let _ = writeln!(out, "  not placed (beyond minCount): {}", unplaced.join(", "));
        }
    }
    out
}

/// "gpus: 8 × gpu.example.com on node-1 (gpu-0 … gpu-7)" per claim.
fn summarize(devices: &[DeviceReport]) -> String {
    if devices.is_empty() {
        return "-".into();
    }
    let mut by_claim: BTreeMap<(&str, &str, &str), Vec<&str>> = BTreeMap::new();
    for d in devices {
        by_claim
            .entry((&d.claim, &d.driver, &d.pool))
            .or_default()
            .push(&d.device);
    }
    by_claim
        .into_iter()
        .map(|((claim, driver, pool), names)| {
            let list = if names.len() > 3 {
                format!("{} … {}", names[0], names[names.len() - 1])
            } else {
                names.join(", ")
            };
            format!("{claim}: {} × {driver}/{pool} ({list})", names.len())
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SNAPSHOT: &str = r#"
apiVersion: v1
kind: List
items:
- apiVersion: resource.k8s.io/v1
  kind: DeviceClass
  metadata: {name: gpu.example.com}
  spec: {selectors: [{cel: {expression: "device.driver == 'gpu.example.com'"}}]}
- apiVersion: v1
  kind: Node
  metadata: {name: n1, labels: {rack: r1}}
  status: {allocatable: {cpu: "32", memory: 256Gi, pods: "110"}}
- apiVersion: v1
  kind: Node
  metadata: {name: n2, labels: {rack: r2}}
  status: {allocatable: {cpu: "32", memory: 256Gi, pods: "110"}}
- apiVersion: resource.k8s.io/v1
  kind: ResourceSlice
  metadata: {name: n1-gpus}
  spec:
    driver: gpu.example.com
    nodeName: n1
    pool: {name: n1, generation: 1, resourceSliceCount: 1}
    devices: [{name: gpu-0}, {name: gpu-1}]
- apiVersion: resource.k8s.io/v1
  kind: ResourceSlice
  metadata: {name: n2-gpus}
  spec:
    driver: gpu.example.com
    nodeName: n2
    pool: {name: n2, generation: 1, resourceSliceCount: 1}
    devices: [{name: gpu-0}, {name: gpu-1}]
"#;

    const WORKLOADS: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: two}
spec: {spec: {devices: {requests: [{name: gpus, exactly: {deviceClassName: gpu.example.com, count: 2}}]}}}
---
apiVersion: muster.dev/v1alpha1
kind: Workload
metadata: {name: first}
spec:
  topology: {required: rack}
  podGroups:
  - name: w
    replicas: 1
    template: {spec: {containers: [{name: c}], resourceClaims: [{name: gpus, resourceClaimTemplateName: two}]}}
---
apiVersion: muster.dev/v1alpha1
kind: Workload
metadata: {name: second}
spec:
  topology: {required: rack}
  podGroups:
  - name: w
    replicas: 2
    template: {spec: {containers: [{name: c}], resourceClaims: [{name: gpus, resourceClaimTemplateName: two}]}}
"#;

    #[test]
    fn plans_in_order_assuming_earlier_workloads() {
        let snapshot = Objects::parse("snap.yaml", SNAPSHOT).unwrap();
        let workloads = Objects::parse("w.yaml", WORKLOADS).unwrap();
        let (report, details) = plan(
            snapshot,
            &workloads,
            "default",
            Fencing::Taint,
            PreemptionScope::Cluster,
        )
        .unwrap();
        let first = &report.workloads[0];
        assert!(first.feasible);
        assert_eq!(first.pods[0].name, "first-w-0");
        assert_eq!(first.pods[0].node, "n1");
        assert_eq!(first.pods[0].devices[0].claim, "first-w-0-gpus");
        assert_eq!(first.pods[0].devices.len(), 2);
        let second = &report.workloads[1];
        assert!(
            !second.feasible,
            "n1's GPUs are taken by the first, and one rack holds one pod"
        );
        assert!(
            second.reason.as_deref().unwrap().contains("group w needs 2 pods"),
            "{:?}",
            second.reason
        );
        let text = human(&report, &details);
        assert!(text.contains("first: fits (rack=r1)"), "{text}");
        assert!(text.contains("gpus: 2 × gpu.example.com/n1 (gpu-0, gpu-1)"), "{text}");
        assert!(text.contains("second: does not fit"), "{text}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["workloads"][0]["pods"][0]["devices"][0]["device"], "gpu-0");
        assert_eq!(json["workloads"][0]["reason"], serde_json::Value::Null);
    }

    #[test]
    fn limit_ranges_and_runtime_classes_of_the_snapshot_shape_pods_not_made_yet() {
        // Two pods of one GPU each: alone they share n1; with 20 CPUs from a LimitRange
        // (or a RuntimeClass's overhead) each, they need a node each.
        let workload = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one}
spec: {spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.example.com}}]}}}
---
apiVersion: muster.dev/v1alpha1
kind: Workload
metadata: {name: pair}
spec:
  podGroups:
  - name: w
    replicas: 2
    template: {spec: {RUNTIME containers: [{name: c}], resourceClaims: [{name: gpu, resourceClaimTemplateName: one}]}}
"#;
        let limit_range = r#"
apiVersion: v1
kind: LimitRange
metadata: {name: defaults, namespace: default}
spec: {limits: [{type: Container, defaultRequest: {cpu: "20"}}]}
"#;
        let runtime_class = r#"
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: sandbox}
handler: sandbox
overhead: {podFixed: {cpu: "20"}}
"#;
        let nodes_of = |extra: &str, runtime: &str| {
            let snapshot = Objects::parse("snap.yaml", &format!("{SNAPSHOT}---\n{extra}")).unwrap();
            let workloads = Objects::parse("w.yaml", &workload.replace("RUNTIME", runtime)).unwrap();
            let (report, _) = plan(
                snapshot,
                &workloads,
                "default",
                Fencing::Taint,
                PreemptionScope::Cluster,
            )
            .unwrap();
            let pair = report.workloads[0].clone();
            let nodes: std::collections::BTreeSet<String> = pair.pods.iter().map(|p| p.node.clone()).collect();
            (pair, nodes.len())
        };
        let (pair, nodes) = nodes_of("", "");
        assert_eq!(nodes, 1);
        assert!(
            pair.warnings[0].contains("no LimitRange of namespace default was given"),
            "{:?}",
            pair.warnings
        );
        let (pair, nodes) = nodes_of(limit_range, "");
        assert_eq!((nodes, pair.warnings.len()), (2, 0), "{pair:?}");
        let (_, nodes) = nodes_of(runtime_class, "runtimeClassName: sandbox,");
        assert_eq!(nodes, 2);
        let (pair, _) = nodes_of(runtime_class, "runtimeClassName: kata,");
        assert!(!pair.feasible);
        assert!(
            pair.reason
                .as_deref()
                .unwrap()
                .contains("RuntimeClass \"kata\" not found"),
            "{:?}",
            pair.reason
        );
    }

    /// The Kueue Workload standing for `workload`, admitted with `assignment` for podSet
    /// `w`, and flavor `f` setting `labels`.
    fn kueue_decision(
        workload: &muster_api::v1alpha1::Workload,
        assignment: serde_json::Value,
        labels: serde_json::Value,
    ) -> (kube::api::DynamicObject, kube::api::DynamicObject) {
        let uid = workload.metadata.uid.clone().unwrap_or_else(|| "planned".into());
        let object = serde_json::from_value(serde_json::json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": "muster-first", "labels": {crate::kueue::JOB_UID_LABEL: uid}},
            "status": {"admission": {"podSetAssignments": [assignment]}},
        }))
        .unwrap();
        let flavor = serde_json::from_value(serde_json::json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
            "metadata": {"name": "f"}, "spec": {"nodeLabels": labels},
        }))
        .unwrap();
        (object, flavor)
    }

    #[test]
    fn a_gang_kueue_admitted_is_planned_inside_its_decision_and_told_why_not() {
        let snapshot = Objects::parse("snap.yaml", SNAPSHOT).unwrap();
        let mut workloads = Objects::parse("w.yaml", WORKLOADS).unwrap();
        workloads.workloads.truncate(1);
        // Left alone, the first workload goes to n1; Kueue's TAS put it on n2.
        let (object, flavor) = kueue_decision(
            &workloads.workloads[0],
            serde_json::json!({"name": "w", "flavors": {"cpu": "f"}, "topologyAssignment": {
                "levels": ["kubernetes.io/hostname"],
                "slices": [{"domainCount": 1, "podCounts": {"universal": 1}, "valuesPerLevel": [{"universal": "n2"}]}],
            }}),
            serde_json::json!({}),
        );
        workloads.kueue_workloads = vec![object];
        workloads.kueue_flavors = vec![flavor];
        let (report, _) = plan(
            snapshot.clone(),
            &workloads,
            "default",
            Fencing::Taint,
            PreemptionScope::Cluster,
        )
        .unwrap();
        assert_eq!(report.workloads[0].pods[0].node, "n2", "inside Kueue's rack");

        // A flavor whose label the group selects otherwise: no node, and why.
        workloads.workloads[0].spec.pod_groups[0]
            .template
            .as_mut()
            .and_then(|t| t.spec.as_mut())
            .unwrap()
            .node_selector = Some([("rack".to_string(), "r1".to_string())].into());
        let (object, flavor) = kueue_decision(
            &workloads.workloads[0],
            serde_json::json!({"name": "w", "flavors": {"cpu": "f"}}),
            serde_json::json!({"rack": "r2"}),
        );
        workloads.kueue_workloads = vec![object];
        workloads.kueue_flavors = vec![flavor];
        let (report, _) = plan(
            snapshot,
            &workloads,
            "default",
            Fencing::Taint,
            PreemptionScope::Cluster,
        )
        .unwrap();
        let reason = report.workloads[0].reason.clone().unwrap_or_default();
        assert!(
            reason.contains("group w selects rack=r1, and the flavor Kueue assigned it sets rack=r2"),
            "{reason}"
        );
    }

    #[test]
    fn device_taint_rules_and_the_fencing_mode_decide_what_fits() {
        let fence = r#"
apiVersion: resource.k8s.io/v1
kind: DeviceTaintRule
metadata: {name: fence}
spec:
  deviceSelector: {driver: gpu.example.com, pool: n1}
  taint: {key: muster.dev/fenced, value: "true", effect: NoSchedule}
"#;
        let mut snapshot = Objects::parse("snap.yaml", SNAPSHOT).unwrap();
        snapshot.extend(Objects::parse("rule.yaml", fence).unwrap());
        let workloads = Objects::parse("w.yaml", WORKLOADS).unwrap();
        let (by_node, _) = plan(
            snapshot.clone(),
            &workloads,
            "default",
            Fencing::Taint,
            PreemptionScope::Cluster,
        )
        .unwrap();
        assert_eq!(by_node.workloads[0].pods[0].node, "n2", "n1's GPUs are fenced off");
        let (by_device, _) = plan(
            snapshot,
            &workloads,
            "default",
            Fencing::DeviceTaint,
            PreemptionScope::Cluster,
        )
        .unwrap();
        assert_eq!(
            by_device.workloads[0].pods[0].node, "n1",
            "muster's claims tolerate the fence"
        );
    }

    #[test]
    fn volumes_and_anti_affinity_from_the_snapshot_shape_the_plan() {
        let storage = r#"
- apiVersion: storage.k8s.io/v1
  kind: StorageClass
  metadata: {name: local, annotations: {storageclass.kubernetes.io/is-default-class: "true"}}
  provisioner: kubernetes.io/no-provisioner
  volumeBindingMode: WaitForFirstConsumer
- apiVersion: v1
  kind: PersistentVolume
  metadata: {name: pv-r2}
  spec:
    storageClassName: local
    capacity: {storage: 100Gi}
    accessModes: [ReadWriteOnce]
    nodeAffinity: {required: {nodeSelectorTerms: [{matchExpressions: [{key: rack, operator: In, values: [r2]}]}]}}
  status: {phase: Available}
"#;
        let snapshot = Objects::parse("snap.yaml", &format!("{SNAPSHOT}{storage}")).unwrap();
        let workloads = r#"
apiVersion: muster.dev/v1alpha1
kind: Workload
metadata: {name: data}
spec:
  podGroups:
  - name: w
    replicas: 1
    template:
      metadata: {labels: {app: data}}
      spec:
        containers: [{name: c}]
        volumes: [{name: scratch, ephemeral: {volumeClaimTemplate: {spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 10Gi}}}}}}]
---
apiVersion: muster.dev/v1alpha1
kind: Workload
metadata: {name: spread}
spec:
  podGroups:
  - name: w
    replicas: 3
    template:
      metadata: {labels: {app: spread}}
      spec:
        containers: [{name: c}]
        affinity:
          podAntiAffinity:
            requiredDuringSchedulingIgnoredDuringExecution:
            - {topologyKey: rack, labelSelector: {matchLabels: {app: spread}}}
"#;
        let workloads = Objects::parse("w.yaml", workloads).unwrap();
        let (report, details) = plan(
            snapshot,
            &workloads,
            "default",
            Fencing::Taint,
            PreemptionScope::Cluster,
        )
        .unwrap();
        let data = &report.workloads[0];
        assert!(data.feasible, "{:?}", data.reason);
        assert_eq!(
            (data.pods[0].node.as_str(), data.pods[0].volumes.as_slice()),
            ("n2", &["pv-r2".to_string()][..])
        );
        assert!(human(&report, &details).contains("volumes: pv-r2"));
        let spread = &report.workloads[1];
        let reason = spread.reason.as_deref().unwrap_or_default();
        assert!(
            reason.contains(
                "2 nodes there have room for 6 pods, but anti-affinity on rack leaves 2 for 3 pods of group w"
            ),
            "{reason}"
        );
    }

    /// A running gang: one bound pod of `priority` on `node` with its claim holding both
    /// of the node's GPUs.
    fn running(name: &str, node: &str, priority: i32) -> String {
        format!(
            r#"
- apiVersion: v1
  kind: Pod
  metadata: {{name: {name}-w-0, namespace: default, labels: {{muster.dev/workload: {name}}}}}
  spec: {{nodeName: {node}, priority: {priority}, containers: [{{name: c}}]}}
  status: {{phase: Running, startTime: "2026-01-01T00:00:00Z"}}
- apiVersion: resource.k8s.io/v1
  kind: ResourceClaim
  metadata: {{name: {name}-w-0-gpus, namespace: default, labels: {{muster.dev/workload: {name}}}}}
  spec: {{devices: {{requests: [{{name: gpus, exactly: {{deviceClassName: gpu.example.com, count: 2}}}}]}}}}
  status:
    allocation:
      devices:
        results:
        - {{request: gpus, driver: gpu.example.com, pool: {node}, device: gpu-0}}
        - {{request: gpus, driver: gpu.example.com, pool: {node}, device: gpu-1}}
"#
        )
    }

    #[test]
    fn a_workload_that_does_not_fit_shows_the_gangs_it_would_preempt() {
        let text = format!("{SNAPSHOT}{}{}", running("low", "n1", 10), running("busy", "n2", 5000));
        let snapshot_again = || Objects::parse("snap.yaml", &text).unwrap();
        let snapshot = snapshot_again();
        let workloads = r#"
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: urgent}
value: 1000
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: two}
spec: {spec: {devices: {requests: [{name: gpus, exactly: {deviceClassName: gpu.example.com, count: 2}}]}}}
---
apiVersion: muster.dev/v1alpha1
kind: Workload
metadata: {name: urgent}
spec:
  priorityClassName: urgent
  topology: {required: rack}
  podGroups:
  - name: w
    replicas: 1
    template: {spec: {containers: [{name: c}], resourceClaims: [{name: gpus, resourceClaimTemplateName: two}]}}
"#;
        let workloads = Objects::parse("w.yaml", workloads).unwrap();
        let (report, details) = plan(snapshot, &workloads, "default", Fencing::None, PreemptionScope::Cluster).unwrap();
        let urgent = &report.workloads[0];
        assert!(!urgent.feasible, "every GPU is taken");
        let preemption = urgent.preemption.as_ref().expect("a preemption");
        assert_eq!(
            preemption.victims,
            vec!["default/low".to_string()],
            "busy has a higher priority"
        );
        assert_eq!(preemption.domain.as_deref(), Some("r1"));
        let text = human(&report, &details);
        assert!(text.contains("would fit by preempting (in r1): default/low"), "{text}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["workloads"][0]["preemption"]["victims"][0], "default/low");
        // Kept to its namespace, or off, preemption reaches no one here: the victim is
        // in the snapshot's namespace, the preemptor in another.
        for scope in [PreemptionScope::Namespace, PreemptionScope::Off] {
            let (report, _) = plan(snapshot_again(), &workloads, "team-b", Fencing::None, scope).unwrap();
            assert!(report.workloads[0].preemption.is_none(), "{scope:?}");
        }
        let (report, _) = plan(
            snapshot_again(),
            &workloads,
            "default",
            Fencing::None,
            PreemptionScope::Namespace,
        )
        .unwrap();
        assert!(report.workloads[0].preemption.is_some(), "same namespace");
    }
}
