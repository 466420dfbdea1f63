//! Kueue as the queue in front of muster, through Kueue's external-framework protocol
//! (`integrations.externalFrameworks: ["Workload.v1alpha1.muster.dev"]`): for a Workload
//! labelled `kueue.x-k8s.io/queue-name`, muster keeps one Kueue `Workload` that asks for
//! the gang's quota, holds the gang until Kueue admits it, takes the gang apart when
//! Kueue evicts it, and reports back what Kueue expects of a job controller (`PodsReady`,
//! `Finished`, the admission cleared after an eviction). Kueue decides quota, fairness and
//! preemption; muster still plans and reserves the devices.
//!
//! Off unless the cluster serves `kueue.x-k8s.io/v1beta2` Workloads.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::{Resource, ResourceExt};
use muster_api::labels;
use muster_api::v1alpha1::Workload;
use muster_engine::request::AssignedDomain;
use serde_json::{Value, json};

/// The label that puts a Workload in a Kueue LocalQueue.
pub const QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// The label Kueue's job controllers put on the Workloads they own.
pub const JOB_UID_LABEL: &str = "kueue.x-k8s.io/job-uid";
/// Kueue's finalizer on a Workload whose quota is in use.
pub const RESOURCE_IN_USE: &str = "kueue.x-k8s.io/resource-in-use";
/// The `spec.controllerName` of AdmissionChecks muster answers: Kueue reserves quota,
/// then waits for muster to reserve every device inside that decision.
pub const CHECK_CONTROLLER: &str = "muster.dev/dra-reservation";

/// Kueue's Workload, `kueue.x-k8s.io/v1beta2`.
pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", "Workload"),
        "workloads",
    )
}

/// Kueue's AdmissionCheck, cluster-scoped.
pub fn admission_check_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", "AdmissionCheck"),
        "admissionchecks",
    )
}

/// Kueue's ResourceFlavor, cluster-scoped.
pub fn flavor_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", "ResourceFlavor"),
        "resourceflavors",
    )
}

/// The LocalQueue a Workload asks for, if any.
pub fn queue_of(workload: &Workload) -> Option<&str> {
    workload
        .labels()
        .get(QUEUE_LABEL)
        .map(String::as_str)
        .filter(|q| !q.is_empty())
}

/// The podSet through which Kueue charges a gang's shared claims once.
pub const SHARED_POD_SET: &str = "shared-claims";

/// Annotation on a Kueue Workload: the `spec.suspend` muster last turned into
/// `spec.active`. Kueue deactivates Workloads itself (a rejected check, too many
/// requeues); muster changes `active` only when the user's suspend changes.
pub const SUSPEND_WRITTEN: &str = "muster.dev/suspend";

/// Whether `object` was made for this very Workload (its job-uid label).
pub fn made_for(object: &DynamicObject, workload: &Workload) -> bool {
    workload
        .uid()
        .is_some_and(|uid| object.labels().get(JOB_UID_LABEL) == Some(&uid))
}

/// The suspend muster last wrote into `object`'s `active`, if any.
pub fn suspend_written(object: &DynamicObject) -> Option<bool> {
    object.annotations().get(SUSPEND_WRITTEN).map(|v| v == "true")
}

/// The name of the Kueue Workload that stands for `workload`.
pub fn object_name(workload: &Workload) -> String {
    format!("muster-{}", workload.name_any())
}

/// Kueue's LocalQueue, ClusterQueue and Topology.
pub fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", kind), plural)
}

/// The Kueue Workload for `workload`: one podSet per pod group, the group's template as
/// it is (Kueue charges the devices of its ResourceClaimTemplates through
/// `deviceClassMappings`) plus the toleration of muster's fence that its pods get at
/// release, owned by the Workload. `priority`: the PriorityClass and its value; no Kueue
/// webhook runs to fill them in. `topology`: ask Kueue's Topology-Aware Scheduling for
/// one domain of `spec.topology.required` (only where the queue's flavors know that
/// level: a flavor without TAS cannot admit a podSet that asks for it).
/// Claims that exist already (`resourceClaimName`, in `spec.resourceClaims`, a pod
/// template, or the template a template-less group is charged by), each once: Kueue
/// refuses them in a podSet, so each is charged through a ResourceClaimTemplate that
/// mirrors it ([`accounting_template_name`]), as the gang's shared claims are.
pub fn named_claims(workload: &Workload, charges: &BTreeMap<String, Value>) -> Vec<String> {
    let mut names: Vec<String> = workload
        .spec
        .resource_claims
        .iter()
        .filter_map(|c| c.resource_claim_name.clone())
        .collect();
    for group in &workload.spec.pod_groups {
        let claims = group
            .template
            .as_ref()
            .and_then(|t| t.spec.as_ref())
            .and_then(|s| s.resource_claims.as_ref());
        names.extend(
            claims
                .into_iter()
                .flatten()
                .filter_map(|c| c.resource_claim_name.clone()),
        );
    }
    for charged in charges.values() {
        names.extend(
            charged["spec"]["resourceClaims"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c["resourceClaimName"].as_str().map(str::to_string)),
        );
    }
    names.sort();
    names.dedup();
    names
}

/// The ResourceClaimTemplate, owned by the Workload, through which Kueue charges the
/// existing claim `claim` (the `index`th of [`named_claims`]).
pub fn accounting_template_name(workload: &Workload, index: usize) -> String {
    format!("{}-quota-{index}", object_name(workload))
}

/// A group's pod template as its podSet carries it: with the toleration of muster's
/// fence that its pods get at release, and without the existing claims it names (Kueue
/// refuses them in a podSet; each is charged once beside, see [`named_claims`]).
pub fn pod_set_template(mut template: Value) -> Value {
    if let Some(tolerations) = template["spec"]
        .as_object_mut()
        .map(|spec| spec.entry("tolerations").or_insert_with(|| json!([])))
        .and_then(Value::as_array_mut)
    {
        tolerations.push(json!({"key": labels::FENCE_TAINT, "operator": "Exists"}));
    }
    if let Some(claims) = template["spec"]["resourceClaims"].as_array_mut() {
        claims.retain(|c| c["resourceClaimTemplateName"].is_string());
    }
    template
}

/// `charges`: for each template-less group, the template Kueue charges it by
/// ([`crate::workload::charge`]), for all `replicas` pods muster may place. Without one,
/// `None`: the Kueue Workload waits for it.
pub fn desired(
    workload: &Workload,
    queue: &str,
    priority: Option<(&str, i32)>,
    topology: bool,
    charges: &BTreeMap<String, Value>,
) -> Option<Value> {
    let owner = workload.controller_owner_ref(&())?;
    let uid = workload.uid()?;
    // Kueue's TAS groups podSets only as a leader (one pod) and its workers.
    let groups = &workload.spec.pod_groups;
    let leader_and_workers = groups.len() == 2 && groups.iter().any(|g| g.replicas == 1);
    let pod_sets: Vec<Value> = groups
        .iter()
        .map(|group| -> Option<Value> {
            let template = pod_set_template(match &group.template {
                Some(template) => serde_json::to_value(template).unwrap_or(Value::Null),
                // Another controller's pods: charged by what they are made from.
                None => charges.get(&group.name)?.clone(),
            });
            // As many pods as muster may place: minCount and the extras beyond it.
            let count = group.replicas;
            let mut pod_set = json!({"name": group.name, "count": count, "template": template});
            if topology && let Some(level) = workload.spec.topology.as_ref().and_then(|t| t.required.as_ref()) {
                pod_set["topologyRequest"] = json!({"required": level});
                if leader_and_workers {
                    // Both in one domain.
                    pod_set["topologyRequest"]["podSetGroupName"] = json!("gang");
                }
            }
            Some(pod_set)
        })
        .collect::<Option<_>>()?;
    // The gang's shared claims made from templates, charged once: a podSet of one pod
    // that asks for nothing but them.
    let mut shared: Vec<Value> = workload
        .spec
        .resource_claims
        .iter()
        .filter_map(|c| {
            let template = c.resource_claim_template_name.as_ref()?;
            Some(json!({"name": c.name, "resourceClaimTemplateName": template}))
        })
        .collect();
    shared.extend((0..named_claims(workload, charges).len()).map(
        |i| json!({"name": format!("muster-quota-{i}"), "resourceClaimTemplateName": accounting_template_name(workload, i)}),
    ));
    let mut pod_sets = pod_sets;
    if !shared.is_empty() {
        let name = (0..)
            .map(|i| {
                if i == 0 {
                    SHARED_POD_SET.to_string()
                } else {
                    format!("{SHARED_POD_SET}-{i}")
                }
            })
            .find(|n| !groups.iter().any(|g| &g.name == n))
            .unwrap_or_default();
        let mut pod_set = json!({
            "name": name,
            "count": 1,
            // Never placed: it tolerates every taint, so that no flavor or node is
            // refused for it.
            "template": {"spec": {
                "containers": [{"name": "shared-claims", "image": "none"}],
                "resourceClaims": shared,
                "tolerations": [{"operator": "Exists"}],
            }},
        });
        if topology {
            pod_set["topologyRequest"] = json!({"unconstrained": true});
        }
        pod_sets.push(pod_set);
    }
    let mut spec = json!({
        "queueName": queue,
        "active": workload.spec.suspend != Some(true),
        "podSets": pod_sets,
    });
    if let Some((class, value)) = priority {
        spec["priorityClassRef"] = json!({"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": class});
        spec["priority"] = json!(value);
    }
    Some(json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {
            "name": object_name(workload),
            "namespace": workload.namespace(),
            "labels": {JOB_UID_LABEL: uid, labels::WORKLOAD: workload.name_any()},
            "annotations": {SUSPEND_WRITTEN: (workload.spec.suspend == Some(true)).to_string()},
            "finalizers": [RESOURCE_IN_USE],
            "ownerReferences": [owner],
        },
        "spec": spec,
    }))
}

/// What Kueue says of a gang.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Quota reserved and every admission check ready: the gang may run.
    pub admitted: bool,
    /// Kueue evicted the gang (`Evicted=True`), with the reason.
    pub evicted: Option<String>,
    /// `status.admission` is set: the quota is still counted as the gang's.
    pub holds_quota: bool,
    pub finished: bool,
    pub active: bool,
    /// Quota reserved (`QuotaReserved=True`), admitted or not yet.
    pub quota_reserved: bool,
    /// The admission checks on the Workload and their states.
    pub checks: Vec<(String, String)>,
}

fn conditions(object: &DynamicObject) -> Vec<Value> {
    object.data["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn condition_true<'c>(conditions: &'c [Value], type_: &str) -> Option<&'c Value> {
    conditions.iter().find(|c| c["type"] == type_ && c["status"] == "True")
}

impl Verdict {
    pub fn of(object: &DynamicObject) -> Verdict {
        let conditions = conditions(object);
        Verdict {
            admitted: condition_true(&conditions, "Admitted").is_some(),
            evicted: condition_true(&conditions, "Evicted")
                .map(|c| c["reason"].as_str().unwrap_or("Evicted").to_string()),
            holds_quota: !object.data["status"]["admission"].is_null(),
            finished: condition_true(&conditions, "Finished").is_some(),
            active: object.data["spec"]["active"].as_bool() != Some(false),
            quota_reserved: condition_true(&conditions, "QuotaReserved").is_some(),
            checks: object.data["status"]["admissionChecks"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| Some((c["name"].as_str()?.to_string(), c["state"].as_str()?.to_string())))
                .collect(),
        }
    }

    /// The state of the first of `ours` among the Workload's admission checks.
    pub fn our_check<'v>(&'v self, ours: &BTreeSet<String>) -> Option<(&'v str, &'v str)> {
        self.checks
            .iter()
            .find(|(name, _)| ours.contains(name))
            .map(|(n, s)| (n.as_str(), s.as_str()))
    }

    /// Kueue reserved quota and waits for muster's check: muster may plan and reserve,
    /// but not release.
    pub fn awaits_reservation(&self, ours: &BTreeSet<String>) -> bool {
        !self.finished
            && self.evicted.is_none()
            && self.quota_reserved
            && self
                .our_check(ours)
                .is_some_and(|(_, state)| state != "Retry" && state != "Rejected")
    }

    /// The gang must give everything back: evicted, or its admission taken away.
    pub fn must_stop(&self, ours: &BTreeSet<String>) -> bool {
        !self.finished && (self.evicted.is_some() || !(self.admitted || self.awaits_reservation(ours)))
    }
}

/// What Kueue assigned to one podSet: flavor per resource, and the topology domains
/// (the values of `levels`, one list per domain) with the pods Kueue counted in each
/// (`counts`, aligned with `domains`) when Kueue placed it with TAS.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Assignment {
    pub pod_set: String,
    pub flavors: BTreeMap<String, String>,
    pub levels: Vec<String>,
    pub domains: Vec<Vec<String>>,
    pub counts: Vec<usize>,
}

/// Kueue's assignments, decoded: a slice's values per level are either one value for
/// every domain or `prefix + root + suffix` per domain.
pub fn assignments(object: &DynamicObject) -> Vec<Assignment> {
    let mut out = Vec::new();
    for a in object.data["status"]["admission"]["podSetAssignments"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let flavors = a["flavors"]
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(r, f)| Some((r.clone(), f.as_str()?.to_string())))
            .collect();
        let topology = &a["topologyAssignment"];
        let levels: Vec<String> = topology["levels"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l.as_str().map(String::from))
            .collect();
        let mut domains = Vec::new();
        let mut counts = Vec::new();
        for slice in topology["slices"].as_array().into_iter().flatten() {
            let count = slice["domainCount"].as_u64().unwrap_or(0) as usize;
            let pods = &slice["podCounts"];
            counts.extend((0..count).map(|d| {
                pods["universal"]
                    .as_u64()
                    .or_else(|| pods["individual"][d].as_u64())
                    .unwrap_or(0) as usize
            }));
            let mut values = vec![Vec::with_capacity(levels.len()); count];
            for level in slice["valuesPerLevel"].as_array().into_iter().flatten() {
                for (d, domain) in values.iter_mut().enumerate() {
                    let value = if let Some(universal) = level["universal"].as_str() {
                        universal.to_string()
                    } else {
                        let individual = &level["individual"];
                        let root = individual["roots"][d].as_str().unwrap_or_default();
                        format!(
                            "{}{root}{}",
                            individual["prefix"].as_str().unwrap_or_default(),
                            individual["suffix"].as_str().unwrap_or_default()
                        )
                    };
                    domain.push(value);
                }
            }
            domains.extend(values);
        }
        out.push(Assignment {
            pod_set: a["name"].as_str().unwrap_or_default().to_string(),
            flavors,
            levels,
            domains,
            counts,
        });
    }
    out
}

/// The node labels of each podSet's assigned flavors (`flavor_labels`: each flavor's
/// `spec.nodeLabels`), by podSet: each group is planned on the nodes of its own flavors,
/// so that two groups charged to different flavors run where they are charged.
pub fn flavor_selectors(
    assignments: &[Assignment],
    flavor_labels: &BTreeMap<String, BTreeMap<String, String>>,
) -> BTreeMap<String, BTreeMap<String, String>> {
    assignments
        .iter()
        .map(|a| {
            let labels = a
                .flavors
                .values()
                .flat_map(|f| flavor_labels.get(f).into_iter().flatten())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            (a.pod_set.clone(), labels)
        })
        .filter(|(_, labels): &(String, BTreeMap<String, String>)| !labels.is_empty())
        .collect()
}

/// The first of the gang's planned pods (`(pod, node, group)`) outside Kueue's
/// decision — on a node outside the topology domains `assigned` to its group's podSet,
/// one pod more in a domain than Kueue counted there, or on a node without a label of its
/// group's flavors — in words. A node no longer known is not judged here.
pub fn placed_outside<'n>(
    pods: impl IntoIterator<Item = (&'n str, &'n str, Option<&'n str>)>,
    node_labels: impl Fn(&str) -> Option<&'n BTreeMap<String, String>>,
    assigned: &BTreeMap<String, Vec<AssignedDomain>>,
    selectors: &BTreeMap<String, BTreeMap<String, String>>,
) -> Option<String> {
    let mut counted: BTreeMap<(&str, usize), usize> = BTreeMap::new();
    pods.into_iter().find_map(|(pod, node, group)| {
        let labels = node_labels(node)?;
        let group = group?;
        if let Some(domains) = assigned.get(group) {
            let Some(d) = domains.iter().position(|d| d.nodes.contains(node)) else {
                return Some(format!(
                    "pod {pod} runs on node {node}, outside the topology domains Kueue assigns its group now; placing the \
                     gang again"
                ));
            };
            let here = counted.entry((group, d)).or_default();
            *here += 1;
            if *here > domains[d].pods {
                return Some(format!(
                    "pod {pod} is pod {here} of group {group} in {}, where Kueue counts {}; placing the gang again",
                    domains[d].name, domains[d].pods
                ));
            }
        }
        let wanted = selectors.get(group)?;
        let (key, value) = wanted.iter().find(|(k, v)| labels.get(*k) != Some(*v))?;
        Some(format!(
            "pod {pod} runs on node {node}, outside the flavor Kueue assigns its group now ({key}={value}); placing \
             the gang again"
        ))
    })
}

/// Each podSet's topology domains as the engine plans a group in them: the nodes of
/// each domain and the pods Kueue counted there. Kueue charges its TAS usage per domain,
/// so each group goes only where its own podSet was assigned, as many pods per domain
/// as Kueue counted. `coarsen(podSet)`: a level of the assignment to hold that podSet to
/// instead of the finest (the domains of that level Kueue's lie in, their counts summed),
/// for pods that need what Kueue's TAS does not count. PodSets without a topology
/// assignment are left out.
pub fn assigned_domains<'a>(
    assignments: &[Assignment],
    nodes: &[(&str, &BTreeMap<String, String>)],
    coarsen: impl Fn(&str) -> Option<&'a str>,
) -> BTreeMap<String, Vec<AssignedDomain>> {
    assignments
        .iter()
        .filter(|a| !a.domains.is_empty())
        .map(|a| {
            let leaves = leaf_domains(a, nodes);
            let domains = match coarsen(&a.pod_set) {
                Some(level) => coarser_domains(a, leaves, nodes, level),
                None => leaves,
            };
            (a.pod_set.clone(), domains)
        })
        .collect()
}

/// The domains of an assignment as Kueue wrote them, with their nodes: one pass over
/// the nodes, each node's values of the levels naming its domain.
fn leaf_domains(a: &Assignment, nodes: &[(&str, &BTreeMap<String, String>)]) -> Vec<AssignedDomain> {
    let mut domains: Vec<AssignedDomain> = a
        .domains
        .iter()
        .zip(&a.counts)
        .map(|(values, pods)| AssignedDomain {
            name: a
                .levels
                .iter()
                .zip(values)
                .map(|(level, value)| format!("{level}={value}"))
                .collect::<Vec<_>>()
                .join(","),
            nodes: BTreeSet::new(),
            pods: *pods,
        })
        .collect();
    let by_values: BTreeMap<&[String], usize> = a.domains.iter().enumerate().map(|(d, v)| (v.as_slice(), d)).collect();
    for (name, labels) in nodes {
        let values: Option<Vec<String>> = a
            .levels
            .iter()
            .map(|level| match labels.get(level) {
                Some(value) => Some(value.clone()),
                None => (level.as_str() == "kubernetes.io/hostname").then(|| name.to_string()),
            })
            .collect();
        if let Some(d) = values.and_then(|v| by_values.get(v.as_slice()).copied()) {
            domains[d].nodes.insert(name.to_string());
        }
    }
    domains
}

/// The domains of `level` the `leaves` lie in, each with all its nodes and the pods
/// Kueue counted in its leaves. Kueue leaves out of an assignment the levels its finest
/// one implies (a hostname implies the rack), so a leaf's value of `level` is read from
/// the assignment if there, else from its nodes' labels.
fn coarser_domains(
    a: &Assignment,
    leaves: Vec<AssignedDomain>,
    nodes: &[(&str, &BTreeMap<String, String>)],
    level: &str,
) -> Vec<AssignedDomain> {
    let at = a.levels.iter().position(|l| l == level);
    let labels_of: BTreeMap<&str, &BTreeMap<String, String>> = nodes.iter().copied().collect();
    let mut kept: Vec<(String, usize)> = Vec::new();
    for (d, leaf) in leaves.iter().enumerate() {
        let value = match at {
            Some(at) => a.domains[d].get(at).cloned(),
            None => leaf
                .nodes
                .iter()
                .find_map(|n| labels_of.get(n.as_str())?.get(level).cloned()),
        };
        // A leaf whose nodes are gone, or carry no such label, takes no pod.
        let Some(value) = value else { continue };
        match kept.iter_mut().find(|(v, _)| *v == value) {
            Some((_, sum)) => *sum += leaf.pods,
            None => kept.push((value, leaf.pods)),
        }
    }
    kept.into_iter()
        .map(|(value, pods)| level_domain(nodes, level, &value, pods))
        .collect()
}

/// The domain of `level`=`value`: every node with that label, taking `pods` pods.
fn level_domain(nodes: &[(&str, &BTreeMap<String, String>)], level: &str, value: &str, pods: usize) -> AssignedDomain {
    AssignedDomain {
        name: format!("{level}={value}"),
        nodes: nodes
            .iter()
            .filter(|(_, labels)| labels.get(level).map(String::as_str) == Some(value))
            .map(|(name, _)| name.to_string())
            .collect(),
        pods,
    }
}

/// Kueue can put a leader and its workers in one domain, but no more podSets than
/// that: each other podSet gets a domain of the required level of its own. When the
/// groups' `assigned` domains lie in different values of `level`, the gang cannot run in
/// one of Kueue's choices each as its spec requires; in words, with each group's values.
pub fn split_across_domains(
    assigned: &BTreeMap<String, Vec<AssignedDomain>>,
    node_labels: impl Fn(&str) -> Option<String>,
    level: &str,
) -> Option<String> {
    let values: BTreeMap<&str, BTreeSet<String>> = assigned
        .iter()
        .map(|(group, domains)| {
            let values = domains
                .iter()
                .filter_map(|d| d.nodes.iter().find_map(|n| node_labels(n)))
                .collect();
            (group.as_str(), values)
        })
        .collect();
    let all: BTreeSet<&String> = values.values().flatten().collect();
    (all.len() > 1).then(|| {
        let each: Vec<String> = values
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(group, v)| format!("{group} in {}", v.iter().cloned().collect::<Vec<_>>().join("+")))
            .collect();
        format!(
            "Kueue assigned the groups to different values of {level} ({}), and the gang requires one",
            each.join(", ")
        )
    })
}

/// The Workload's admission check `check` set to `state`, the others kept. `None`:
/// already so.
pub fn check_patch(
    object: &DynamicObject,
    check: &str,
    state: &str,
    message: &str,
    requeue_after_seconds: Option<i64>,
    now: &str,
) -> Option<Value> {
    let mut checks: Vec<Value> = object.data["status"]["admissionChecks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let entry = checks.iter_mut().find(|c| c["name"] == check)?;
    if entry["state"] == state && entry["message"] == message {
        return None;
    }
    // Kueue's own fields (retryCount, podSetUpdates) stay as they are.
    if entry["state"] != state {
        entry["lastTransitionTime"] = json!(now);
    }
    entry["state"] = json!(state);
    entry["message"] = json!(message);
    match requeue_after_seconds {
        Some(seconds) => entry["requeueAfterSeconds"] = json!(seconds),
        None => {
            if let Some(map) = entry.as_object_mut() {
                map.remove("requeueAfterSeconds");
            }
        }
    }
    Some(status_patch(object, json!({"admissionChecks": checks})))
}

/// Each ResourceFlavor's `spec.nodeLabels`, by flavor.
pub fn flavor_node_labels(
    flavors: impl IntoIterator<Item = DynamicObject>,
) -> BTreeMap<String, BTreeMap<String, String>> {
    flavors
        .into_iter()
        .map(|f| {
            let labels = f.data["spec"]["nodeLabels"]
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect();
            (f.name_any(), labels)
        })
        .collect()
}

/// Puts each group of `request` inside what Kueue assigned to its own podSet in
/// `object`, the gang's Kueue Workload (`flavor_labels`: each flavor's node labels;
/// `nodes`: every node's name and labels):
/// - the node labels of its flavors join the group's node selector, as Kueue's job
///   integrations inject them into a pod set's template. A label the group selects
///   with another value leaves it nowhere to go, which [`flavor_conflicts`] then says;
/// - under TAS, its pods go only to the podSet's topology domains, as many per domain
///   as Kueue counted there, so that Kueue's usage per domain is what runs there. Kueue's
///   TAS counts the pods' container requests on each node, nothing else: a group that
///   needs devices, volumes, room among other pods or a topology of its own is held to
///   the domains of the level the gang requires, not pod for pod to Kueue's nodes, which
///   may not have what it needs; without such a level, it is not held at all.
/// - Kueue groups no more than a leader and its workers: the other podSets may get
///   different domains of the level the gang requires one of. Then every group may go
///   to any of those domains, as many pods as Kueue counted for it in all: the gang runs
///   in one of them as its spec requires, and Kueue's quota stays exact (only its usage
///   per domain differs from what runs there). Holding each to its own would leave the
///   gang unable to run, and Kueue would decide the same again.
pub fn apply_assignment(
    request: &mut muster_engine::request::GangRequest,
    workload: &Workload,
    object: &DynamicObject,
    flavor_labels: &BTreeMap<String, BTreeMap<String, String>>,
    nodes: &[(&str, &BTreeMap<String, String>)],
) {
    let assignments = assignments(object);
    let selectors = flavor_selectors(&assignments, flavor_labels);
    let required = workload.spec.topology.as_ref().and_then(|t| t.required.as_deref());
    let coarse: BTreeSet<&str> = request
        .groups
        .iter()
        .filter(|g| !counts_all_it_needs(workload, g))
        .map(|g| g.name.as_str())
        .collect();
    let mut domains = assigned_domains(&assignments, nodes, |pod_set| {
        required.filter(|_| coarse.contains(pod_set))
    });
    // Only the gangs' own podSets: not the one that charges shared claims.
    domains.retain(|pod_set, _| request.groups.iter().any(|g| &g.name == pod_set));
    match required {
        None => domains.retain(|pod_set, _| !coarse.contains(pod_set.as_str())),
        Some(level) => {
            let labels: BTreeMap<&str, &BTreeMap<String, String>> = nodes.iter().copied().collect();
            let value_of = |node: &str| labels.get(node)?.get(level).cloned();
            if split_across_domains(&domains, value_of, level).is_some() {
                let values: BTreeSet<String> = domains
                    .values()
                    .flatten()
                    .filter_map(|d| d.nodes.iter().find_map(|n| value_of(n)))
                    .collect();
                for assigned in domains.values_mut() {
                    let pods = assigned.iter().map(|d| d.pods).sum();
                    *assigned = values
                        .iter()
                        .map(|value| level_domain(nodes, level, value, pods))
                        .collect();
                }
            }
        }
    }
    for group in &mut request.groups {
        group.assigned = domains.remove(&group.name).unwrap_or_default();
        for (key, value) in selectors.get(&group.name).into_iter().flatten() {
            match group.shape.node_selector.get(key) {
                Some(own) if own != value => {
                    let conflict = flavor_conflict(own, value);
                    group.shape.node_selector.insert(key.clone(), conflict);
                }
                _ => {
                    group.shape.node_selector.insert(key.clone(), value.clone());
                }
            }
        }
    }
}

/// Whether Kueue put `workload`'s podSets (in `object`) in different domains of the
/// level its spec requires one of (`nodes`: every node's name and labels).
pub fn split_by_kueue(
    workload: &Workload,
    object: &DynamicObject,
    nodes: &[(&str, &BTreeMap<String, String>)],
) -> bool {
    let Some(level) = workload.spec.topology.as_ref().and_then(|t| t.required.as_deref()) else {
        return false;
    };
    let mut domains = assigned_domains(&assignments(object), nodes, |_| Some(level));
    domains.retain(|pod_set, _| workload.spec.pod_groups.iter().any(|g| &g.name == pod_set));
    let labels: BTreeMap<&str, &BTreeMap<String, String>> = nodes.iter().copied().collect();
    split_across_domains(&domains, |node| labels.get(node)?.get(level).cloned(), level).is_some()
}

/// What in Kueue's decision keeps a gang from fitting, in words, with `request`
/// planned inside it ([`apply_assignment`]): a group's own node selector at odds with
/// its flavor.
pub fn explain(request: &muster_engine::request::GangRequest) -> Option<String> {
    let why = flavor_conflicts(request);
    (!why.is_empty()).then(|| why.join("; "))
}

/// Whether Kueue's Topology-Aware Scheduling counts everything the group's pods need
/// from a node: their container requests only — no devices, no volumes, no pod
/// (anti-)affinity, spread or host ports, no topology of the group's own (its podSet asks
/// Kueue for the gang's level only), and no node affinity Kueue was not shown (a group
/// charged by a member pod is charged without its affinity, where muster's pin is).
fn counts_all_it_needs(workload: &Workload, group: &muster_engine::request::GroupRequest) -> bool {
    let template_less = workload
        .spec
        .pod_groups
        .iter()
        .any(|g| g.name == group.name && g.template.is_none());
    group.topology.is_empty()
        && !(template_less && group.shape.affinity.is_some())
        && group.shape.claims.is_empty()
        && group.shape.shared.is_empty()
        && group.shape.rules.affinity.is_empty()
        && group.shape.rules.anti_affinity.is_empty()
        && group.shape.rules.spread.is_empty()
        && group.shape.rules.host_ports.is_empty()
        && group.pods.iter().all(|p| p.volumes.is_empty() && p.claims.is_empty())
}

/// Joins a group's own value of a node label and its flavor's other value into one no
/// node can have (label values hold no spaces); [`flavor_conflicts`] takes it apart.
const FLAVOR_CONFLICT: &str = " and ";

/// A group's node selector value `own` for a label its flavor sets to `flavor`: a value
/// no node has, so the plan finds no node and [`flavor_conflicts`] says why.
pub fn flavor_conflict(own: &str, flavor: &str) -> String {
    format!("{own}{FLAVOR_CONFLICT}{flavor}")
}

/// The groups whose own node selector is at odds with their flavor's labels, in words.
pub fn flavor_conflicts(request: &muster_engine::request::GangRequest) -> Vec<String> {
    request
        .groups
        .iter()
        .flat_map(|g| {
            g.shape.node_selector.iter().filter_map(|(key, value)| {
                let (own, flavor) = value.split_once(FLAVOR_CONFLICT)?;
                Some(format!(
                    "group {} selects {key}={own}, and the flavor Kueue assigned it sets {key}={flavor}",
                    g.name
                ))
            })
        })
        .collect()
}

/// When muster's check `check` on `object` last changed state (`lastTransitionTime`).
pub fn check_changed_at<'o>(object: &'o DynamicObject, check: &str) -> Option<&'o str> {
    check_entry(object, check)?["lastTransitionTime"].as_str()
}

/// Check `check`'s entry in `object`'s `status.admissionChecks`.
fn check_entry<'o>(object: &'o DynamicObject, check: &str) -> Option<&'o Value> {
    object.data["status"]["admissionChecks"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == check)
}

/// The longest Kueue is asked to wait before it gives quota again to a gang the
/// cluster cannot take as it is now.
pub const NEVER_FIT_BACKOFF_MAX_SECONDS: i64 = 30 * 60;

/// How long Kueue waits before it gives quota again to a gang that would not fit even
/// on the emptied cluster as it is now: `base`, doubled from the last delay muster asked
/// on check `check` when that was such a wait too (Kueue keeps it across its requeue;
/// muster's shorter "not now" answers and its Ready clear the streak), at most
/// [`NEVER_FIT_BACKOFF_MAX_SECONDS`]. A gang that waits out a maintenance window or a
/// driver rollout is then not given quota — nor preempts others for it — every minute,
/// and a gang that fitted since starts again from `base`.
pub fn never_fit_backoff(object: &DynamicObject, check: &str, base: i64) -> i64 {
    let previous = check_entry(object, check)
        .and_then(|c| c["requeueAfterSeconds"].as_i64())
        .unwrap_or(0);
    if previous >= base {
        previous.saturating_mul(2).min(NEVER_FIT_BACKOFF_MAX_SECONDS)
    } else {
        base
    }
}

/// When Kueue last reserved quota for `object` (`QuotaReserved=True`'s transition).
pub fn quota_reserved_at(object: &DynamicObject) -> Option<&str> {
    object.data["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "QuotaReserved" && c["status"] == "True")?["lastTransitionTime"]
        .as_str()
}

/// `Active=True` on an AdmissionCheck muster answers, which Kueue needs before a
/// ClusterQueue using it is active. `None`: already so.
pub fn active_patch(check: &DynamicObject, now: &str) -> Option<Value> {
    let new = condition(
        "Active",
        true,
        "Active",
        "muster reserves the devices of admitted gangs",
        check.metadata.generation,
        now,
    );
    let conditions = with_condition(&conditions(check), new)?;
    Some(status_patch(check, json!({"conditions": conditions})))
}

/// A condition as Kueue writes them.
fn condition(type_: &str, status: bool, reason: &str, message: &str, generation: Option<i64>, now: &str) -> Value {
    let mut c = json!({
        "type": type_,
        "status": if status { "True" } else { "False" },
        "reason": reason,
        "message": message,
        "lastTransitionTime": now,
    });
    if let Some(generation) = generation {
        c["observedGeneration"] = json!(generation);
    }
    c
}

/// `conditions` with `new` in place of the one of its type; the transition time kept when
/// the status does not change. `None` when nothing changes.
fn with_condition(conditions: &[Value], mut new: Value) -> Option<Vec<Value>> {
    let mut out = Vec::with_capacity(conditions.len() + 1);
    let mut found = false;
    for c in conditions {
        if c["type"] == new["type"] {
            found = true;
            if c["status"] == new["status"] && c["reason"] == new["reason"] && c["message"] == new["message"] {
                return None;
            }
            if c["status"] == new["status"] {
                new["lastTransitionTime"] = c["lastTransitionTime"].clone();
            }
            out.push(new.clone());
        } else {
            out.push(c.clone());
        }
    }
    if !found {
        out.push(new);
    }
    Some(out)
}

/// A status patch, conditional on the version read.
fn status_patch(object: &DynamicObject, status: Value) -> Value {
    json!({"metadata": {"resourceVersion": object.resource_version()}, "status": status})
}

/// `PodsReady` as Kueue's waitForPodsReady reads it, with the reasons Kueue's own job
/// integrations give: True once `ready` (every pod the gang needs runs and is ready),
/// `Started` the first time and `Recovered` after a recovery; False while it waits,
/// `WaitForStart` before it first ran and `WaitForRecovery` from the moment it stopped
/// running until it runs again — a reason that sticks, since Kueue times `WaitForStart`
/// from the admission and would evict a gang admitted long ago at once. `None`: already
/// so.
pub fn pods_ready_patch(object: &DynamicObject, ready: bool, now: &str) -> Option<Value> {
    let generation = object.metadata.generation;
    let current = conditions(object);
    let previous = current.iter().find(|c| c["type"] == "PodsReady");
    let reason_was = |reasons: &[&str]| previous.is_some_and(|c| reasons.iter().any(|r| c["reason"] == *r));
    let new = if ready {
        let reason = if reason_was(&["WaitForRecovery", "Recovered"]) {
            "Recovered"
        } else {
            "Started"
        };
        condition("PodsReady", true, reason, "All pods reached readiness", generation, now)
    } else {
        let recovering = condition_true(&current, "PodsReady").is_some() || reason_was(&["WaitForRecovery"]);
        let (reason, message) = if recovering {
            ("WaitForRecovery", "At least one pod has failed, waiting for recovery")
        } else {
            ("WaitForStart", "Not all pods are ready or succeeded")
        };
        condition("PodsReady", false, reason, message, generation, now)
    };
    let conditions = with_condition(&current, new)?;
    Some(status_patch(object, json!({"conditions": conditions})))
}

/// `Finished=True` with `Succeeded` or `Failed`, which gives the quota back.
pub fn finished_patch(object: &DynamicObject, succeeded: bool, message: &str, now: &str) -> Option<Value> {
    let reason = if succeeded { "Succeeded" } else { "Failed" };
    let new = condition("Finished", true, reason, message, object.metadata.generation, now);
    let conditions = with_condition(&conditions(object), new)?;
    Some(status_patch(object, json!({"conditions": conditions})))
}

/// After an eviction, once the gang holds nothing: the admission cleared, as Kueue's own
/// job controllers do, so that the quota goes to whoever waits for it. The gang is
/// requeued unless it was deactivated or stopped.
pub fn requeue_patch(object: &DynamicObject, evicted_reason: &str, now: &str) -> Value {
    let generation = object.metadata.generation;
    let mut conditions = conditions(object);
    let requeued = matches!(evicted_reason, "Preempted" | "NodeFailures");
    for new in [
        condition(
            "QuotaReserved",
            false,
            "Pending",
            &format!("The workload was evicted ({evicted_reason}) and gave everything back"),
            generation,
            now,
        ),
        condition(
            "Admitted",
            false,
            "NoReservation",
            "The workload has no reservation",
            generation,
            now,
        ),
        condition(
            "Requeued",
            requeued,
            evicted_reason,
            &format!("Evicted: {evicted_reason}"),
            generation,
            now,
        ),
        // The next admission starts waiting for the pods afresh.
        condition(
            "PodsReady",
            false,
            "WaitForStart",
            "Not all pods are ready or succeeded",
            generation,
            now,
        ),
    ] {
        if let Some(next) = with_condition(&conditions, new) {
            conditions = next;
        }
    }
    status_patch(object, json!({"admission": null, "conditions": conditions}))
}

/// Whether every pod the gang needs is running and ready, or has succeeded:
/// `min_counts` by group.
pub fn gang_ready(pods: &[std::sync::Arc<Pod>], min_counts: &BTreeMap<String, i32>) -> bool {
    min_counts.iter().all(|(group, min)| {
        let ready = pods
            .iter()
            .filter(|p| p.labels().get(labels::POD_GROUP) == Some(group))
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| {
                let status = p.status.as_ref();
                status.and_then(|s| s.phase.as_deref()) == Some("Succeeded")
                    || status
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .count();
        ready as i32 >= *min
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(data: Value) -> DynamicObject {
        let mut o = DynamicObject::new("muster-w", &api_resource()).within("ns");
        o.metadata.resource_version = Some("7".into());
        o.metadata.generation = Some(1);
        o.data = data;
        o
    }

    #[test]
    fn a_verdict_reads_admission_eviction_and_finish() {
        let admitted = object(json!({"spec": {"active": true}, "status": {
            "admission": {"clusterQueue": "cq"},
            "conditions": [{"type": "QuotaReserved", "status": "True"}, {"type": "Admitted", "status": "True"}],
        }}));
        let v = Verdict::of(&admitted);
        assert!(v.admitted && v.holds_quota && v.active && !v.must_stop(&BTreeSet::new()));
        let evicted = object(json!({"status": {
            "admission": {"clusterQueue": "cq"},
            "conditions": [{"type": "Admitted", "status": "True"}, {"type": "Evicted", "status": "True", "reason": "Preempted"}],
        }}));
        let v = Verdict::of(&evicted);
        assert_eq!(v.evicted.as_deref(), Some("Preempted"));
        assert!(v.must_stop(&BTreeSet::new()));
        assert!(
            Verdict::of(&object(json!({}))).must_stop(&BTreeSet::new()),
            "pending: not admitted"
        );
    }

    #[test]
    fn a_requeue_clears_the_admission_and_requeues_only_after_preemption() {
        let evicted = object(json!({"status": {
            "admission": {"clusterQueue": "cq"},
            "conditions": [
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "", "lastTransitionTime": "t0"},
                {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "", "lastTransitionTime": "t0"},
            ],
        }}));
        let patch = requeue_patch(&evicted, "Preempted", "t1");
        assert_eq!(patch["metadata"]["resourceVersion"], "7");
        assert!(patch["status"]["admission"].is_null());
        let conditions = patch["status"]["conditions"].as_array().unwrap();
        let find = |t: &str| conditions.iter().find(|c| c["type"] == t).unwrap();
        assert_eq!(find("QuotaReserved")["status"], "False");
        assert_eq!(find("QuotaReserved")["reason"], "Pending");
        assert_eq!(find("Requeued")["status"], "True");
        assert_eq!(find("Evicted")["status"], "True", "Kueue's own condition is kept");
        let deactivated = requeue_patch(&evicted, "Deactivated", "t1");
        let conditions = deactivated["status"]["conditions"].as_array().unwrap();
        assert_eq!(
            conditions.iter().find(|c| c["type"] == "Requeued").unwrap()["status"],
            "False"
        );
    }

    #[test]
    fn topology_assignments_decode_and_restrict_the_nodes() {
        let admitted = object(json!({"status": {"admission": {"podSetAssignments": [
            {"name": "workers", "flavors": {"example.com/gpu": "h100"}, "topologyAssignment": {
                "levels": ["example.com/rack", "kubernetes.io/hostname"],
                "slices": [{
                    "domainCount": 2,
                    "valuesPerLevel": [
                        {"universal": "rack-1"},
                        {"individual": {"prefix": "node-", "suffix": "", "roots": ["3", "4"]}},
                    ],
                    "podCounts": {"universal": 1},
                }],
            }},
        ]}}}));
        let decoded = assignments(&admitted);
        assert_eq!(decoded[0].domains, [["rack-1", "node-3"], ["rack-1", "node-4"]]);
        assert_eq!(decoded[0].counts, [1, 1]);
        let flavors: BTreeMap<String, BTreeMap<String, String>> =
            [("h100".to_string(), [("gpu".to_string(), "h100".to_string())].into())].into();
        let labels = |rack: &str, gpu: &str| -> BTreeMap<String, String> {
            [
                ("example.com/rack".to_string(), rack.to_string()),
                ("gpu".to_string(), gpu.to_string()),
            ]
            .into()
        };
        let nodes = [
            ("node-3".to_string(), labels("rack-1", "h100")),
            ("node-4".to_string(), labels("rack-1", "a100")),
            ("node-5".to_string(), labels("rack-1", "h100")),
        ];
        assert_eq!(
            flavor_selectors(&decoded, &flavors),
            [("workers".to_string(), [("gpu".to_string(), "h100".to_string())].into())].into(),
            "and on the nodes of its flavor"
        );
        let listed: Vec<(&str, &BTreeMap<String, String>)> = nodes.iter().map(|(n, l)| (n.as_str(), l)).collect();
        let domains = assigned_domains(&decoded, &listed, |_| None);
        assert_eq!(
            domains["workers"],
            [
                AssignedDomain {
                    name: "example.com/rack=rack-1,kubernetes.io/hostname=node-3".into(),
                    nodes: ["node-3".to_string()].into(),
                    pods: 1,
                },
                AssignedDomain {
                    name: "example.com/rack=rack-1,kubernetes.io/hostname=node-4".into(),
                    nodes: ["node-4".to_string()].into(),
                    pods: 1,
                },
            ],
            "each domain with the pods Kueue counted there"
        );
        let racks = assigned_domains(&decoded, &listed, |_| Some("example.com/rack"));
        assert_eq!(
            racks["workers"],
            [AssignedDomain {
                name: "example.com/rack=rack-1".into(),
                nodes: ["node-3".to_string(), "node-4".to_string(), "node-5".to_string()].into(),
                pods: 2,
            }],
            "held to the racks only: their nodes, the pods Kueue counted in them summed"
        );
        let plain = object(json!({"status": {"admission": {"podSetAssignments": [{"name": "w", "flavors": {}}]}}}));
        assert!(assigned_domains(&assignments(&plain), &listed, |_| None).is_empty());
    }

    #[test]
    fn each_group_is_held_to_its_podsets_domains_as_far_as_kueue_counts_what_it_needs() {
        use muster_engine::request::{GangRequest, GroupRequest};
        let workload = |required: Option<&str>| -> Workload {
            let mut spec = json!({"podGroups": [
                {"name": "driver", "replicas": 1, "template": {"spec": {"containers": [{"name": "c"}]}}},
                {"name": "workers", "replicas": 2, "template": {"spec": {"containers": [{"name": "c"}]}}},
            ]});
            if let Some(level) = required {
                spec["topology"] = json!({"required": level});
            }
            serde_json::from_value(json!({
                "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
                "metadata": {"name": "w", "namespace": "ns"}, "spec": spec,
            }))
            .unwrap()
        };
        let request = || GangRequest {
            groups: vec![
                GroupRequest::uniform("driver", "ns", 1, 1, muster_engine::fixtures::gpu_pod(0, 1, 1)),
                GroupRequest::uniform("workers", "ns", 2, 2, muster_engine::fixtures::gpu_pod(1, 1, 1)),
            ],
            ..GangRequest::default()
        };
        let podset = |name: &str, host: &str, pods: u64| {
            json!({"name": name, "flavors": {}, "topologyAssignment": {
                "levels": ["kubernetes.io/hostname"],
                "slices": [{"domainCount": 1, "podCounts": {"universal": pods}, "valuesPerLevel": [{"universal": host}]}],
            }})
        };
        let decided = |driver: &str, workers: &str| {
            object(json!({"status": {"admission": {"podSetAssignments": [
                podset("driver", driver, 1), podset("workers", workers, 2), podset("shared-claims", "n4", 1),
            ]}}}))
        };
        let rack = |r: &str| -> BTreeMap<String, String> { [("rack".to_string(), r.to_string())].into() };
        let labels = [
            ("n1", rack("r0")),
            ("n2", rack("r1")),
            ("n3", rack("r1")),
            ("n4", rack("r0")),
        ];
        let nodes: Vec<(&str, &BTreeMap<String, String>)> = labels.iter().map(|(n, l)| (*n, l)).collect();
        let nodes_of = |d: &AssignedDomain| d.nodes.iter().cloned().collect::<Vec<_>>();

        // One rack: the driver (CPU only) on Kueue's very node, the workers (devices) in
        // Kueue's rack, the pods counted there summed.
        let mut one_rack = request();
        apply_assignment(
            &mut one_rack,
            &workload(Some("rack")),
            &decided("n2", "n3"),
            &BTreeMap::new(),
            &nodes,
        );
        assert_eq!(one_rack.groups[0].assigned.len(), 1);
        assert_eq!(nodes_of(&one_rack.groups[0].assigned[0]), ["n2"]);
        assert_eq!(nodes_of(&one_rack.groups[1].assigned[0]), ["n2", "n3"]);
        assert_eq!(one_rack.groups[1].assigned[0].pods, 2);

        // Split over two racks: each group may go to either, as many pods as Kueue
        // counted for it, so that the gang can run in one.
        let mut split = request();
        apply_assignment(
            &mut split,
            &workload(Some("rack")),
            &decided("n1", "n3"),
            &BTreeMap::new(),
            &nodes,
        );
        for group in &split.groups {
            let racks: Vec<&str> = group.assigned.iter().map(|d| d.name.as_str()).collect();
            assert_eq!(racks, ["rack=r0", "rack=r1"], "{}", group.name);
        }
        assert_eq!(split.groups[0].assigned[0].pods, 1);
        assert_eq!(split.groups[1].assigned[1].pods, 2);

        // No level the gang requires: the workers, whose devices Kueue does not count, are
        // not held to Kueue's nodes at all; the driver is.
        let mut no_level = request();
        apply_assignment(
            &mut no_level,
            &workload(None),
            &decided("n1", "n3"),
            &BTreeMap::new(),
            &nodes,
        );
        assert_eq!(nodes_of(&no_level.groups[0].assigned[0]), ["n1"]);
        assert!(no_level.groups[1].assigned.is_empty());

        // Split is what a failed plan of such a gang backs off for.
        assert!(split_by_kueue(&workload(Some("rack")), &decided("n1", "n3"), &nodes));
        assert!(!split_by_kueue(&workload(Some("rack")), &decided("n2", "n3"), &nodes));
        assert!(!split_by_kueue(&workload(None), &decided("n1", "n3"), &nodes));
    }

    #[test]
    fn a_group_selecting_against_its_flavor_is_explained() {
        let mut request = muster_engine::request::GangRequest::default();
        let mut group = muster_engine::request::GroupRequest {
            name: "workers".into(),
            ..Default::default()
        };
        group
            .shape
            .node_selector
            .insert("rack".into(), flavor_conflict("r1", "r0"));
        group.shape.node_selector.insert("zone".into(), "z1".into());
        request.groups.push(group);
        assert_eq!(
            flavor_conflicts(&request),
            ["group workers selects rack=r1, and the flavor Kueue assigned it sets rack=r0"]
        );
    }

    #[test]
    fn a_gang_that_never_fits_is_retried_less_and_less_often() {
        let asked_before = |seconds: Option<i64>| {
            let mut check = json!({"name": "dra", "state": "Pending", "retryCount": 7});
            if let Some(s) = seconds {
                check["requeueAfterSeconds"] = json!(s);
            }
            object(json!({"status": {"admissionChecks": [check]}}))
        };
        assert_eq!(never_fit_backoff(&asked_before(None), "dra", 60), 60);
        // After a never-fit wait: twice as long, up to the cap.
        assert_eq!(never_fit_backoff(&asked_before(Some(60)), "dra", 60), 120);
        assert_eq!(never_fit_backoff(&asked_before(Some(480)), "dra", 60), 960);
        assert_eq!(
            never_fit_backoff(&asked_before(Some(1500)), "dra", 60),
            NEVER_FIT_BACKOFF_MAX_SECONDS
        );
        // After a short "not now" (15 s): the streak starts again, whatever Kueue's
        // retry count says.
        assert_eq!(never_fit_backoff(&asked_before(Some(15)), "dra", 60), 60);
        assert_eq!(never_fit_backoff(&asked_before(Some(480)), "other", 60), 60);
    }

    #[test]
    fn podsets_kueue_put_in_different_racks_are_named() {
        // Kueue writes only the hostname level when it is the finest: the rack is the
        // nodes'.
        let podset = |name: &str, hosts: &[&str], counts: &[u64]| {
            json!({"name": name, "flavors": {}, "topologyAssignment": {
                "levels": ["kubernetes.io/hostname"],
                "slices": [{
                    "domainCount": hosts.len(),
                    "valuesPerLevel": [{"individual": {"roots": hosts}}],
                    "podCounts": {"individual": counts},
                }],
            }})
        };
        let split = object(json!({"status": {"admission": {"podSetAssignments": [
            podset("driver", &["n1"], &[1]),
            podset("workers", &["n2", "n3"], &[2, 2]),
        ]}}}));
        let decoded = assignments(&split);
        assert_eq!(decoded[1].counts, [2, 2]);
        let rack = |r: &str| -> BTreeMap<String, String> { [("rack".to_string(), r.to_string())].into() };
        let labels: Vec<(String, BTreeMap<String, String>)> = vec![
            ("n1".into(), rack("r0")),
            ("n2".into(), rack("r1")),
            ("n3".into(), rack("r1")),
            ("n4".into(), rack("r1")),
        ];
        let listed: Vec<(&str, &BTreeMap<String, String>)> = labels.iter().map(|(n, l)| (n.as_str(), l)).collect();
        let coarse = assigned_domains(&decoded, &listed, |_| Some("rack"));
        assert_eq!(
            coarse["workers"],
            [AssignedDomain {
                name: "rack=r1".into(),
                nodes: ["n2".to_string(), "n3".to_string(), "n4".to_string()].into(),
                pods: 4,
            }],
            "the rack of Kueue's nodes, every node of it, the pods counted summed"
        );
        let rack_of = |n: &str| labels.iter().find(|(name, _)| name == n)?.1.get("rack").cloned();
        let why = split_across_domains(&coarse, rack_of, "rack").expect("split");
        assert!(why.contains("driver in r0, workers in r1"), "{why}");
        let leaves = assigned_domains(&decoded, &listed, |_| None);
        assert!(split_across_domains(&leaves, rack_of, "rack").is_some(), "leaves too");
        let one: BTreeMap<String, Vec<AssignedDomain>> =
            coarse.into_iter().filter(|(group, _)| group == "workers").collect();
        assert_eq!(split_across_domains(&one, rack_of, "rack"), None);
    }

    #[test]
    fn a_placement_outside_the_current_assignment_is_named() {
        let labels = |rack: &str| -> BTreeMap<String, String> { [("rack".to_string(), rack.to_string())].into() };
        let nodes: BTreeMap<String, BTreeMap<String, String>> =
            [("n1".to_string(), labels("r1")), ("n2".to_string(), labels("r2"))].into();
        let selectors: BTreeMap<String, BTreeMap<String, String>> = [("workers".to_string(), labels("r2"))].into();
        let lookup = |n: &str| nodes.get(n);
        let pods = [("w-0", "n2", Some("workers")), ("w-1", "n1", Some("workers"))];
        let none = BTreeMap::new();
        let outside = placed_outside(pods, lookup, &none, &selectors).expect("w-1 is outside");
        assert!(
            outside.contains("pod w-1 runs on node n1") && outside.contains("rack=r2"),
            "{outside}"
        );
        assert_eq!(placed_outside([pods[0]], lookup, &none, &selectors), None);
        let domain = |nodes: &[&str], pods: usize| AssignedDomain {
            name: format!("rack={}", nodes.join("+")),
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            pods,
        };
        let assigned: BTreeMap<String, Vec<AssignedDomain>> =
            [("workers".to_string(), vec![domain(&["n1"], 2)])].into();
        let outside = placed_outside([pods[0]], lookup, &assigned, &selectors).expect("n2 not assigned");
        assert!(outside.contains("topology domains"), "{outside}");
        // One pod more in a domain than Kueue counted there.
        let assigned: BTreeMap<String, Vec<AssignedDomain>> =
            [("workers".to_string(), vec![domain(&["n2"], 1)])].into();
        let outside = placed_outside([pods[0], ("w-2", "n2", Some("workers"))], lookup, &assigned, &selectors)
            .expect("one too many in n2");
        assert!(outside.contains("pod w-2 is pod 2 of group workers"), "{outside}");
        // A group Kueue gives no flavor labels or domains, or a node gone, is not judged.
        assert_eq!(
            placed_outside([("l-0", "n1", Some("launcher"))], lookup, &assigned, &selectors),
            None
        );
        assert_eq!(
            placed_outside([("w-0", "gone", Some("workers"))], lookup, &assigned, &selectors),
            None
        );
    }

    #[test]
    fn each_podset_keeps_its_own_flavors_labels() {
        // Two groups charged on different flavors that set the same key: each keeps its
        // own value rather than the last one overwriting the first (issue 25, item 3).
        let admitted = object(json!({"status": {"admission": {"podSetAssignments": [
            {"name": "trainers", "flavors": {"example.com/gpu": "h100"}},
            {"name": "evaluators", "flavors": {"example.com/gpu": "a100"}},
            {"name": "shared-claims", "flavors": {"example.com/gpu": "a100"}},
        ]}}}));
        let flavors: BTreeMap<String, BTreeMap<String, String>> = [
            ("h100".to_string(), [("gpu".to_string(), "h100".to_string())].into()),
            ("a100".to_string(), [("gpu".to_string(), "a100".to_string())].into()),
        ]
        .into();
        let selectors = flavor_selectors(&assignments(&admitted), &flavors);
        assert_eq!(selectors["trainers"]["gpu"], "h100");
        assert_eq!(selectors["evaluators"]["gpu"], "a100");
    }

    #[test]
    fn a_template_less_group_is_charged_by_its_charge_for_every_pod_muster_places() {
        let workload: Workload = serde_json::from_value(json!({
            "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
            "metadata": {"name": "job-sweep", "namespace": "team", "uid": "w-uid"},
            "spec": {"podGroups": [{"name": "main", "replicas": 4, "minCount": 2}]},
        }))
        .unwrap();
        assert_eq!(
            desired(&workload, "q", None, false, &BTreeMap::new()),
            None,
            "waits for a member"
        );
        let spec = json!({
            "schedulingGates": [{"name": "muster.dev/gang"}],
            "containers": [{"name": "c", "image": "i", "resources": {"requests": {"cpu": "4"}, "claims": [{"name": "gpus"}, {"name": "fabric"}]}}],
            "resourceClaims": [
                {"name": "gpus", "resourceClaimTemplateName": "four-gpus"},
                {"name": "fabric", "resourceClaimName": "shared-fabric"},
            ],
        });
        let charges = BTreeMap::from([("main".to_string(), crate::workload::charge::chargeable(&spec))]);
        let object = desired(&workload, "q", None, false, &charges).unwrap();
        // The existing claim its pods share is charged once, as shared claims are.
        assert_eq!(named_claims(&workload, &charges), ["shared-fabric"]);
        let shared = &object["spec"]["podSets"][1];
        assert_eq!(shared["name"], SHARED_POD_SET);
        assert_eq!(
            shared["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"],
            "muster-job-sweep-quota-0"
        );
        let pod_set = &object["spec"]["podSets"][0];
        assert_eq!(pod_set["count"], 4, "replicas, not minCount");
        assert_eq!(
            pod_set["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"],
            "four-gpus"
        );
        assert_eq!(
            pod_set["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"],
            "4"
        );
        assert!(pod_set["template"]["spec"].get("schedulingGates").is_none());
        assert_eq!(
            pod_set["template"]["spec"]["resourceClaims"].as_array().map(Vec::len),
            Some(1),
            "not the existing claim, charged once beside"
        );
    }

    #[test]
    fn pods_ready_is_written_once_per_change() {
        let fresh = object(json!({"status": {"conditions": []}}));
        let waiting = pods_ready_patch(&fresh, false, "t1").unwrap();
        assert_eq!(waiting["status"]["conditions"][0]["reason"], "WaitForStart");
        let written = object(json!({"status": {"conditions": waiting["status"]["conditions"].clone()}}));
        assert!(pods_ready_patch(&written, false, "t2").is_none(), "unchanged: no write");
        let ready = pods_ready_patch(&written, true, "t3").unwrap();
        assert_eq!(ready["status"]["conditions"][0]["status"], "True");
        let started = object(json!({"status": {"conditions": ready["status"]["conditions"].clone()}}));
        let lost = pods_ready_patch(&started, false, "t4").unwrap();
        assert_eq!(lost["status"]["conditions"][0]["reason"], "WaitForRecovery");
        // Still not ready on the next pass: the reason sticks (Kueue would time
        // WaitForStart from the admission, long past, and evict at once).
        let recovering = object(json!({"status": {"conditions": lost["status"]["conditions"].clone()}}));
        assert!(
            pods_ready_patch(&recovering, false, "t5").is_none(),
            "unchanged: no write"
        );
        let recovered = pods_ready_patch(&recovering, true, "t6").unwrap();
        assert_eq!(recovered["status"]["conditions"][0]["reason"], "Recovered");
    }
}
