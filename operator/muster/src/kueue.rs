//! Kueue as the queue in front of muster, through Kueue's external-framework protocol
//! (`integrations.externalFrameworks: ["Workload.v1alpha1.muster.dev"]`): for a Workload
//! labelled `kueue.x-k8s.io/queue-name`, muster keeps one Kueue `Workload` that asks for
//! the gang's quota, holds the gang until Kueue admits it, takes the gang apart when
//! Kueue evicts it, and reports back what Kueue expects of a job controller (`PodsReady`,
//! `Finished`, the admission cleared after an eviction). Kueue decides quota, fairness and
//! preemption; muster still plans and reserves the devices.
//!
//! Off unless the cluster serves `kueue.x-k8s.io/v1beta2` Workloads.

use std::collections::BTreeMap;

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

/// Kueue's Workload, `kueue.x-k8s.io/v1beta2`.
pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", "Workload"),
        "workloads",
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

/// The name of the Kueue Workload that stands for `workload`.
pub fn object_name(workload: &Workload) -> String {
    format!("muster-{}", workload.name_any())
}

/// The Kueue Workload for `workload`: one podSet per pod group, the group's template as
/// it is (Kueue charges the devices of its ResourceClaimTemplates through
/// `deviceClassMappings`), owned by the Workload. `priority`: the PriorityClass and its
/// value; no Kueue webhook runs to fill them in.
pub fn desired(workload: &Workload, queue: &str, priority: Option<(&str, i32)>) -> Option<Value> {
    let owner = workload.controller_owner_ref(&())?;
    let uid = workload.uid()?;
    let pod_sets: Vec<Value> = workload
        .spec
        .pod_groups
        .iter()
        .map(|group| {
            let template = match &group.template {
                Some(template) => serde_json::to_value(template).unwrap_or(Value::Null),
                // Another controller's pods: Kueue counts them, with no requests of their own.
                None => json!({"spec": {"containers": [{"name": "member", "image": "member"}]}}),
            };
            let count = if group.template.is_some() {
                group.replicas
            } else {
                group.min_count()
            };
            json!({"name": group.name, "count": count, "template": template})
        })
        .collect();
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
        }
    }

    /// The gang must give everything back: evicted, or its admission taken away.
    pub fn must_stop(&self) -> bool {
        !self.finished && (self.evicted.is_some() || !self.admitted)
    }
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

/// `PodsReady` as Kueue's waitForPodsReady reads it: True once `ready` (every pod the
/// gang needs runs and is ready), False while it waits. `None`: already so.
pub fn pods_ready_patch(object: &DynamicObject, ready: bool, now: &str) -> Option<Value> {
    let generation = object.metadata.generation;
    let new = if ready {
        condition(
            "PodsReady",
            true,
            "Started",
            "All pods reached readiness",
            generation,
            now,
        )
    } else {
        let reason = if condition_true(&conditions(object), "PodsReady").is_some() {
            "WaitForRecovery"
        } else {
            "WaitForStart"
        };
        condition(
            "PodsReady",
            false,
            reason,
            "Not all pods are ready or succeeded",
            generation,
            now,
        )
    };
    let conditions = with_condition(&conditions(object), new)?;
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
    ] {
        if let Some(next) = with_condition(&conditions, new) {
            conditions = next;
        }
    }
    status_patch(object, json!({"admission": null, "conditions": conditions}))
}

/// Whether every pod the gang needs is running and ready: `min_counts` by group.
pub fn gang_ready(pods: &[std::sync::Arc<Pod>], min_counts: &BTreeMap<String, i32>) -> bool {
    min_counts.iter().all(|(group, min)| {
        let ready = pods
            .iter()
            .filter(|p| p.labels().get(labels::POD_GROUP) == Some(group))
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| {
                p.status
                    .as_ref()
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
        assert!(v.admitted && v.holds_quota && v.active && !v.must_stop());
        let evicted = object(json!({"status": {
            "admission": {"clusterQueue": "cq"},
            "conditions": [{"type": "Admitted", "status": "True"}, {"type": "Evicted", "status": "True", "reason": "Preempted"}],
        }}));
        let v = Verdict::of(&evicted);
        assert_eq!(v.evicted.as_deref(), Some("Preempted"));
        assert!(v.must_stop());
        assert!(Verdict::of(&object(json!({}))).must_stop(), "pending: not admitted");
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
    }
}
