//! What Kueue charges a template-less group by. Its pods are made by another controller,
//! and anyone who may create pods in the namespace can make one that carries the group's
//! labels, so a member's pod is not a safe measure:
//!
//! - a group made by the Workload's own job (a JobSet's replicated job, a Job) is charged
//!   by the job's pod template, from which its controller makes every pod (a job's
//!   resources cannot change once it exists);
//! - any other template-less group (a hand-written Workload) is charged by its largest
//!   member, and its Kueue Workload is made again when the members no longer match it.
//!
//! Pure: the caller fetches the owning job.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use muster_api::v1alpha1::{PodGroup, Workload};
use serde_json::{Value, json};

use crate::frameworks::{Framework, JOBSET_UID, REPLICATED_JOB};

/// A job's pod template as the template Kueue charges: as its controller makes pods
/// from it (claims from templates included), without muster's gate or a node of its own.
/// Its node selector and affinity stay, so that Kueue assigns flavors and topology
/// domains the pods can use, as Kueue's own job integrations do.
pub fn chargeable(spec: &Value) -> Value {
    without(spec, &["schedulingGates", "nodeName"])
}

/// A member pod's spec as the template Kueue charges: like [`chargeable`], and without
/// its affinity, where a released pod carries muster's pin to its node. Its node
/// selector, which muster never writes, stays.
fn chargeable_member(spec: &Value) -> Value {
    without(spec, &["schedulingGates", "nodeName", "affinity"])
}

fn without(spec: &Value, fields: &[&str]) -> Value {
    let mut spec = spec.clone();
    if let Some(spec) = spec.as_object_mut() {
        for field in fields {
            spec.remove(*field);
        }
    }
    json!({"spec": spec})
}

/// The controller owner of `workload` that may have made its template-less groups: a
/// JobSet or Job, as `(framework, name, uid)`.
pub fn owning_job(workload: &Workload) -> Option<(Framework, String, String)> {
    let owner = workload
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))?;
    let framework = Framework::of(&owner.api_version, &owner.kind)?;
    Some((framework, owner.name.clone(), owner.uid.clone()))
}

/// Whether `group`'s members are the pods of `job` (of `framework`) made from its pod set
/// of replicated job `replicated_job`.
fn made_by(group: &PodGroup, framework: Framework, job_uid: &str, replicated_job: &str) -> bool {
    let Some(members) = &group.members else {
        return false;
    };
    match framework {
        Framework::Job => members.controller_uid.as_deref() == Some(job_uid),
        Framework::JobSet => {
            members.match_labels.get(JOBSET_UID).map(String::as_str) == Some(job_uid)
                && members.match_labels.get(REPLICATED_JOB).map(String::as_str) == Some(replicated_job)
        }
    }
}

/// For each template-less group the owning job `job` (of `framework`) makes, the pod
/// template it makes the group's pods from.
pub fn job_templates(workload: &Workload, framework: Framework, job: &Value) -> BTreeMap<String, Value> {
    let uid = job["metadata"]["uid"].as_str().unwrap_or_default();
    let sets = framework.pod_sets(job);
    workload
        .spec
        .pod_groups
        .iter()
        .filter(|g| g.template.is_none())
        .filter_map(|group| {
            let set = sets
                .iter()
                .find(|s| made_by(group, framework, uid, &s.replicated_job))?;
            let template = job.pointer(&set.template)?;
            Some((group.name.clone(), chargeable(&template["spec"])))
        })
        .collect()
}

/// Whether Kueue charges `group` by a job's template rather than by its members.
pub fn made_by_job(workload: &Workload, group: &PodGroup) -> bool {
    owning_job(workload).is_some_and(|(framework, _, uid)| match framework {
        Framework::Job => made_by(group, framework, &uid, ""),
        Framework::JobSet => group
            .members
            .as_ref()
            .and_then(|m| m.match_labels.get(REPLICATED_JOB))
            .is_some_and(|r| made_by(group, framework, &uid, r)),
    })
}

/// How much a charged pod asks for, to tell the largest: its claims first (devices),
/// then extended resources, CPU and memory.
fn size(spec: &Value) -> (usize, i64, i64, i64) {
    let claims = spec["resourceClaims"].as_array().map_or(0, Vec::len);
    let parsed: Option<k8s_openapi::api::core::v1::PodSpec> = serde_json::from_value(spec.clone()).ok();
    let requests = parsed
        .and_then(|s| crate::convert::pod_requests("pod", &s).ok())
        .unwrap_or_default();
    (
        claims,
        requests.other.values().sum(),
        requests.cpu_millis,
        requests.memory,
    )
}

/// The largest of `members` as Kueue charges it (see [`chargeable_member`]).
pub fn largest_member(members: &[&Pod]) -> Option<Value> {
    members
        .iter()
        .map(|p| chargeable_member(&serde_json::to_value(p.spec.clone().unwrap_or_default()).unwrap_or(Value::Null)))
        .max_by_key(|t| size(&t["spec"]))
}

/// What of a charged template decides the charge, so that a template Kueue's API server
/// stored with defaults still compares equal.
pub fn charge_key(template: &Value) -> Value {
    let spec = &template["spec"];
    let containers = |key: &str| -> Vec<Value> {
        spec[key]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                json!([
                    c["resources"]["requests"],
                    c["resources"]["limits"],
                    c["resources"]["claims"],
                    c["restartPolicy"]
                ])
            })
            .collect()
    };
    json!({
        "containers": containers("containers"),
        "init": containers("initContainers"),
        "claims": spec["resourceClaims"],
        "overhead": spec["overhead"],
        "resources": spec["resources"],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(cpu: &str, claims: usize) -> Pod {
        let claims: Vec<Value> = (0..claims)
            .map(|i| json!({"name": format!("c{i}"), "resourceClaimTemplateName": "gpu"}))
            .collect();
        serde_json::from_value(json!({"spec": {
            "schedulingGates": [{"name": "muster.dev/gang"}],
            "containers": [{"name": "c", "image": "i", "resources": {"requests": {"cpu": cpu}}}],
            "resourceClaims": claims,
        }}))
        .unwrap()
    }

    #[test]
    fn the_largest_member_is_charged_devices_first() {
        let (small, big, devices) = (pod("1", 0), pod("64", 0), pod("1", 1));
        let largest = largest_member(&[&small, &big, &devices]).unwrap();
        assert_eq!(largest["spec"]["resourceClaims"].as_array().map(Vec::len), Some(1));
        assert!(largest["spec"].get("schedulingGates").is_none());
        // A released member's pin (its affinity) is not charged; its own selector is.
        let mut released = pod("1", 1);
        let spec = released.spec.as_mut().unwrap();
        spec.scheduling_gates = None;
        spec.node_selector = Some([("example.com/gpu".to_string(), "h100".to_string())].into());
        spec.affinity = Some(serde_json::from_value(json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}]}}})).unwrap());
        let charged = largest_member(&[&released]).unwrap();
        assert!(charged["spec"].get("affinity").is_none());
        assert_eq!(charged["spec"]["nodeSelector"]["example.com/gpu"], "h100");
        let largest = largest_member(&[&small, &big]).unwrap();
        assert_eq!(largest["spec"]["containers"][0]["resources"]["requests"]["cpu"], "64");
        assert_ne!(charge_key(&largest), charge_key(&largest_member(&[&small]).unwrap()));
    }

    #[test]
    fn a_jobs_own_groups_are_charged_by_its_templates() {
        let workload: Workload = serde_json::from_value(json!({
            "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
            "metadata": {"name": "jobset-train", "namespace": "team", "ownerReferences": [
                {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": "train", "uid": "js-uid", "controller": true}]},
            "spec": {"podGroups": [
                {"name": "workers", "replicas": 2, "members": {"matchLabels": {JOBSET_UID: "js-uid", REPLICATED_JOB: "workers"}, "podsPerJob": 1}},
                {"name": "stray", "replicas": 1, "members": {"matchLabels": {JOBSET_UID: "other", REPLICATED_JOB: "launcher"}}},
            ]},
        }))
        .unwrap();
        let jobset = json!({
            "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": "train", "uid": "js-uid"},
            "spec": {"replicatedJobs": [{"name": "workers", "replicas": 2, "template": {"spec": {"template": {"spec": {
                "schedulingGates": [{"name": "muster.dev/gang"}],
                "nodeSelector": {"example.com/gpu": "h100"},
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "example.com/rack", "operator": "In", "values": ["r1"]}]}]}}},
                "containers": [{"name": "c", "resources": {"requests": {"cpu": "16"}}}],
            }}}}}]},
        });
        let (framework, name, uid) = owning_job(&workload).unwrap();
        assert_eq!(
            (framework, name.as_str(), uid.as_str()),
            (Framework::JobSet, "train", "js-uid")
        );
        let templates = job_templates(&workload, framework, &jobset);
        assert_eq!(
            templates.keys().collect::<Vec<_>>(),
            ["workers"],
            "only the JobSet's own groups"
        );
        assert_eq!(
            templates["workers"]["spec"]["containers"][0]["resources"]["requests"]["cpu"],
            "16"
        );
        assert!(templates["workers"]["spec"].get("schedulingGates").is_none());
        // Kueue assigns flavors and domains by the pods' own node selection.
        assert_eq!(templates["workers"]["spec"]["nodeSelector"]["example.com/gpu"], "h100");
        assert!(templates["workers"]["spec"]["affinity"]["nodeAffinity"].is_object());
        assert!(made_by_job(&workload, &workload.spec.pod_groups[0]));
        assert!(!made_by_job(&workload, &workload.spec.pod_groups[1]));
    }
}
