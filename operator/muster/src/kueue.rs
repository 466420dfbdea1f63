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
use serde_json::{Value, json};

/// The label that puts a Workload in a Kueue LocalQueue.
pub const QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// The label Kueue's job controllers put on the Workloads they own.
const JOB_UID_LABEL: &str = "kueue.x-k8s.io/job-uid";
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
/// (the values of `levels`, one list per domain) when Kueue placed it with TAS.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Assignment {
    pub pod_set: String,
    pub flavors: BTreeMap<String, String>,
    pub levels: Vec<String>,
    pub domains: Vec<Vec<String>>,
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
        for slice in topology["slices"].as_array().into_iter().flatten() {
            let count = slice["domainCount"].as_u64().unwrap_or(0) as usize;
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

/// The first of the gang's planned pods (`(pod, node, group)`) on a node outside Kueue's
/// decision — not among the `allowed` nodes of the assigned domains, or without a label
/// of its group's flavors — in words. A node no longer known is not judged here.
pub fn placed_outside<'n>(
    pods: impl IntoIterator<Item = (&'n str, &'n str, Option<&'n str>)>,
    node_labels: impl Fn(&str) -> Option<&'n BTreeMap<String, String>>,
    allowed: Option<&BTreeSet<String>>,
    selectors: &BTreeMap<String, BTreeMap<String, String>>,
) -> Option<String> {
    pods.into_iter().find_map(|(pod, node, group)| {
        let labels = node_labels(node)?;
        if allowed.is_some_and(|a| !a.contains(node)) {
            return Some(format!(
                "pod {pod} runs on node {node}, outside the topology domains Kueue assigns now; placing the gang again"
            ));
        }
        let wanted = selectors.get(group?)?;
        let (key, value) = wanted.iter().find(|(k, v)| labels.get(*k) != Some(*v))?;
        Some(format!(
            "pod {pod} runs on node {node}, outside the flavor Kueue assigns its group now ({key}={value}); placing \
             the gang again"
        ))
    })
}

/// The nodes inside Kueue's topology decision: under TAS, those lying in one of the
/// assigned topology domains. `None`: no topology assignment restricts the nodes. (The
/// flavors restrict each group on its own: [`flavor_selectors`].)
pub fn allowed_nodes<'n>(
    assignments: &[Assignment],
    nodes: impl Iterator<Item = (&'n str, &'n BTreeMap<String, String>)>,
) -> Option<BTreeSet<String>> {
    let domains: Vec<(&[String], &[String])> = assignments
        .iter()
        .flat_map(|a| a.domains.iter().map(move |d| (a.levels.as_slice(), d.as_slice())))
        .collect();
    if domains.is_empty() {
        return None;
    }
    Some(
        nodes
            .filter(|(name, labels)| {
                domains.iter().any(|(levels, values)| {
                    levels.iter().zip(values.iter()).all(|(level, value)| {
                        labels.get(level) == Some(value)
                            || (level.as_str() == "kubernetes.io/hostname" && *name == value.as_str())
                    })
                })
            })
            .map(|(name, _)| name.to_string())
            .collect(),
    )
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
        let allowed = allowed_nodes(&decoded, nodes.iter().map(|(n, l)| (n.as_str(), l)));
        assert_eq!(
            allowed,
            Some(["node-3".to_string(), "node-4".to_string()].into()),
            "in a domain"
        );
        assert_eq!(
            flavor_selectors(&decoded, &flavors),
            [("workers".to_string(), [("gpu".to_string(), "h100".to_string())].into())].into(),
            "and on the nodes of its flavor"
        );
        let plain = object(json!({"status": {"admission": {"podSetAssignments": [{"name": "w", "flavors": {}}]}}}));
        assert_eq!(
            allowed_nodes(&assignments(&plain), nodes.iter().map(|(n, l)| (n.as_str(), l))),
            None
        );
    }

    #[test]
    fn a_placement_outside_the_current_assignment_is_named() {
        let labels = |rack: &str| -> BTreeMap<String, String> { [("rack".to_string(), rack.to_string())].into() };
        let nodes: BTreeMap<String, BTreeMap<String, String>> =
            [("n1".to_string(), labels("r1")), ("n2".to_string(), labels("r2"))].into();
        let selectors: BTreeMap<String, BTreeMap<String, String>> = [("workers".to_string(), labels("r2"))].into();
        let lookup = |n: &str| nodes.get(n);
        let pods = [("w-0", "n2", Some("workers")), ("w-1", "n1", Some("workers"))];
        let outside = placed_outside(pods, lookup, None, &selectors).expect("w-1 is outside");
        assert!(
            outside.contains("pod w-1 runs on node n1") && outside.contains("rack=r2"),
            "{outside}"
        );
        assert_eq!(placed_outside([pods[0]], lookup, None, &selectors), None);
        let allowed: BTreeSet<String> = ["n1".to_string()].into();
        let outside = placed_outside([pods[0]], lookup, Some(&allowed), &selectors).expect("n2 not allowed");
        assert!(outside.contains("topology domains"), "{outside}");
        // A group Kueue gives no flavor labels, or a node gone, is not judged.
        assert_eq!(
            placed_outside([("l-0", "n1", Some("launcher"))], lookup, None, &selectors),
            None
        );
        assert_eq!(
            placed_outside([("w-0", "gone", Some("workers"))], lookup, None, &selectors),
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
