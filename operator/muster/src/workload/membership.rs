//! Which pods make up a gang's groups, in which order, and which of them are its core
//! (the first `minCount` of each group). muster's own pods carry their index as a label;
//! pods another controller made for a template-less group (a Job's, for example) carry
//! a Job completion index or none, and are ordered by name after the indexed ones.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use muster_api::labels;
use muster_api::v1alpha1::{PodGroup, Workload};

use crate::kube_ops::label;

/// Index of an Indexed Job's pod (label since Kubernetes 1.28, annotation before).
pub const JOB_COMPLETION_INDEX: &str = "batch.kubernetes.io/job-completion-index";

/// The gang's current attempt: how many times it was restarted as a unit. Its pods
/// carry it as a label, and their rendezvous environment says it.
pub fn attempt(workload: &Workload) -> i32 {
    workload.status.as_ref().map_or(0, |s| s.restarts)
}

/// Whether `pod` belongs to attempt `attempt`. A pod without the label (one another
/// controller made) belongs to every attempt.
pub fn of_attempt(pod: &Pod, attempt: i32) -> bool {
    label(pod, labels::ATTEMPT).is_none_or(|a| a.parse() == Ok(attempt))
}

/// The pod's index within its group, where it carries one.
pub fn pod_index(pod: &Pod) -> Option<i32> {
    let annotation = || {
        pod.metadata
            .annotations
            .as_ref()?
            .get(JOB_COMPLETION_INDEX)
            .map(String::as_str)
    };
    label(pod, labels::POD_INDEX)
        .or_else(|| label(pod, JOB_COMPLETION_INDEX))
        .or_else(annotation)
        .and_then(|i| i.parse().ok())
}

/// The group a pod belongs to, from its label.
pub fn group_of<'w>(workload: &'w Workload, pod: &Pod) -> Option<&'w PodGroup> {
    let name = label(pod, labels::POD_GROUP)?;
    workload.spec.pod_groups.iter().find(|g| g.name == name)
}

/// Whether losing this pod breaks the gang: it is among the first `minCount` of its
/// group. A pod without an index cannot be told apart from the core, so it counts as core.
pub fn is_core(workload: &Workload, pod: &Pod) -> bool {
    let Some(group) = group_of(workload, pod) else {
        return true;
    };
    pod_index(pod).is_none_or(|i| i < group.min_count())
}

/// The pods another controller made for template-less group `group`, in gang order
/// (by index, then by name), at most `replicas` of them; pods being deleted or failed
/// (their controller replaces them) are not members.
pub fn external_members<'p>(pods: &'p [Arc<Pod>], group: &PodGroup) -> Vec<&'p Pod> {
    let mut members: Vec<&Pod> = pods
        .iter()
        .map(AsRef::as_ref)
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Failed"))
        .filter(|p| label(*p, labels::POD_GROUP) == Some(group.name.as_str()))
        .collect();
    members.sort_by_key(|p| (pod_index(p).is_none(), pod_index(p), p.metadata.name.clone()));
    members.truncate(usize::try_from(group.replicas).unwrap_or(0));
    members
}

/// The name of the claim kube-controller-manager generated for the pod's claim entry
/// `claim` (from a ResourceClaimTemplate), once it has.
pub fn generated_claim<'p>(pod: &'p Pod, claim: &str) -> Option<&'p str> {
    pod.status
        .as_ref()?
        .resource_claim_statuses
        .as_ref()?
        .iter()
        .find(|s| s.name == claim)?
        .resource_claim_name
        .as_deref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, index: Option<&str>) -> Arc<Pod> {
        let mut labels = json!({"muster.dev/workload": "w", "muster.dev/pod-group": "workers"});
        if let Some(i) = index {
            labels[JOB_COMPLETION_INDEX] = json!(i);
        }
        Arc::new(serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap())
    }

    fn workload() -> Workload {
        serde_json::from_value(json!({
            "apiVersion": "muster.dev/v1alpha1", "kind": "Workload", "metadata": {"name": "w"},
            "spec": {"podGroups": [{"name": "workers", "replicas": 3, "minCount": 2}]}
        }))
        .unwrap()
    }

    #[test]
    fn external_pods_are_ordered_by_index_then_name_and_capped_at_replicas() {
        let pods = [
            pod("job-z", None),
            pod("job-b", Some("1")),
            pod("job-a", None),
            pod("job-c", Some("0")),
        ];
        let w = workload();
        let members: Vec<_> = external_members(&pods, &w.spec.pod_groups[0])
            .iter()
            .map(|p| p.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(members, ["job-c", "job-b", "job-a"]);
    }

    #[test]
    fn the_core_is_the_first_min_count_and_unindexed_pods_count_as_core() {
        let w = workload();
        assert!(is_core(&w, &pod("a", Some("1"))));
        assert!(!is_core(&w, &pod("a", Some("2"))));
        assert!(is_core(&w, &pod("a", None)));
    }

    #[test]
    fn a_pod_belongs_to_the_attempt_on_its_label_or_to_every_attempt_without_one() {
        let mut w = workload();
        assert_eq!(attempt(&w), 0);
        w.status = Some(muster_api::WorkloadStatus {
            restarts: 2,
            ..Default::default()
        });
        assert_eq!(attempt(&w), 2);
        let mut labelled = (*pod("a", None)).clone();
        labelled
            .metadata
            .labels
            .get_or_insert_default()
            .insert(labels::ATTEMPT.into(), "2".into());
        assert!(of_attempt(&labelled, 2));
        assert!(!of_attempt(&labelled, 1));
        assert!(of_attempt(&pod("b", None), 1));
    }
}
