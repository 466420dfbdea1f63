//! The Workload status muster reports, computed from what it observes. Pure.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use muster_api::conditions;
use muster_api::labels;
use muster_api::v1alpha1::{PodGroupStatus, Workload, WorkloadPhase, WorkloadStatus};

/// Where the controller stands with a Workload, as far as status is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Some pods, claims or the Service do not exist yet.
    Creating { missing: usize },
    /// Everything exists; the pods wait behind the gang gate.
    WaitingForAdmission,
    /// Waiting on something outside muster, such as a missing ResourceClaimTemplate.
    Waiting { reason: &'static str, message: String },
    /// `spec.suspend` is true.
    Suspended,
    /// The spec cannot be turned into pods.
    Invalid { message: String },
}

/// The status for `workload`, given its pods and the controller's progress. Conditions
/// keep their `lastTransitionTime` while their status does not change.
pub fn compute(workload: &Workload, pods: &[&Pod], progress: &Progress, now: &Time) -> WorkloadStatus {
    let previous = workload.status.clone().unwrap_or_default();
    let generation = workload.metadata.generation;

    let mut groups = Vec::new();
    for group in &workload.spec.pod_groups {
        let mut counts = PodGroupStatus {
            name: group.name.clone(),
            replicas: group.replicas,
            ..Default::default()
        };
        for pod in pods
            .iter()
            .filter(|p| label(p, labels::POD_GROUP) == Some(group.name.as_str()))
        {
            if pod.metadata.deletion_timestamp.is_some() {
                continue;
            }
            counts.created += 1;
            if is_gated(pod) {
                counts.gated += 1;
            }
            match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
                Some("Succeeded") => counts.succeeded += 1,
                Some("Failed") => counts.failed += 1,
                _ if is_ready(pod) => counts.ready += 1,
                _ => {}
            }
        }
        groups.push(counts);
    }

    let (phase, admitted) = match progress {
        Progress::Creating { missing } => (
            WorkloadPhase::Pending,
            (false, conditions::REASON_CREATING, format!("creating the gang's objects; {missing} still missing")),
        ),
        Progress::WaitingForAdmission => (
            WorkloadPhase::Pending,
            (
                false,
                conditions::REASON_WAITING_FOR_ADMISSION,
                "pods and claims exist and are held by the muster.dev/gang scheduling gate until the whole gang is reserved".to_string(),
            ),
        ),
        Progress::Waiting { reason, message } => (WorkloadPhase::Pending, (false, *reason, message.clone())),
        Progress::Suspended => (
            WorkloadPhase::Suspended,
            (false, conditions::REASON_SUSPENDED, "spec.suspend is true: the gang holds nothing".to_string()),
        ),
        Progress::Invalid { message } => (WorkloadPhase::Pending, (false, conditions::REASON_INVALID_SPEC, message.clone())),
    };

    let mut conditions = previous.conditions.clone();
    let (status, reason, message) = admitted;
    set_condition(
        &mut conditions,
        conditions::ADMITTED,
        status,
        reason,
        &message,
        generation,
        now,
    );

    WorkloadStatus {
        observed_generation: generation,
        phase: Some(phase),
        conditions,
        pods: workload.spec.pod_groups.iter().map(|g| g.replicas).sum(),
        ready_pods: groups.iter().map(|g| g.ready).sum(),
        pod_groups: groups,
        placement: previous.placement,
        restarts: previous.restarts,
    }
}

/// Sets a condition, keeping `lastTransitionTime` when the status is unchanged.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: &Time,
) {
    let status = if status { "True" } else { "False" }.to_string();
    let existing = conditions.iter_mut().find(|c| c.type_ == type_);
    let last_transition_time = match &existing {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => now.clone(),
    };
    let condition = Condition {
        type_: type_.to_string(),
        status,
        reason: reason.to_string(),
        message: message.to_string(),
        observed_generation: generation,
        last_transition_time,
    };
    match existing {
        Some(c) => *c = condition,
        None => conditions.push(condition),
    }
}

/// Whether the pod still carries muster's scheduling gate.
pub fn is_gated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|gates| gates.iter().any(|g| g.name == labels::GANG_GATE))
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn label<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn workload() -> Workload {
        let mut w: Workload = serde_saphyr::from_str(
            "apiVersion: muster.dev/v1alpha1\nkind: Workload\nmetadata: {name: w, generation: 3}\nspec:\n  podGroups:\n  - {name: a, replicas: 2}\n  - {name: b, replicas: 1}\n",
        )
        .unwrap();
        w.metadata.namespace = Some("ns".into());
        w
    }

    fn pod(group: &str, gated: bool, phase: &str, ready: bool) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "labels": {labels::POD_GROUP: group}},
            "spec": {"containers": [], "schedulingGates": if gated { serde_json::json!([{"name": labels::GANG_GATE}]) } else { serde_json::json!([]) }},
            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
        }))
        .unwrap()
    }

    fn at(seconds: i64) -> Time {
        Time(Timestamp::from_second(seconds).unwrap())
    }

    #[test]
    fn counts_pods_per_group() {
        let pods = [
            pod("a", true, "Pending", false),
            pod("a", false, "Running", true),
            pod("b", false, "Failed", false),
        ];
        let refs: Vec<&Pod> = pods.iter().collect();
        let status = compute(&workload(), &refs, &Progress::WaitingForAdmission, &at(10));
        assert_eq!(status.pods, 3);
        assert_eq!(status.ready_pods, 1);
        assert_eq!(status.observed_generation, Some(3));
        assert_eq!(
            status.pod_groups[0],
            PodGroupStatus {
                name: "a".into(),
                replicas: 2,
                created: 2,
                gated: 1,
                ready: 1,
                succeeded: 0,
                failed: 0
            }
        );
        assert_eq!(status.pod_groups[1].failed, 1);
        assert_eq!(status.phase, Some(WorkloadPhase::Pending));
        let admitted = &status.conditions[0];
        assert_eq!(
            (admitted.type_.as_str(), admitted.status.as_str()),
            ("Admitted", "False")
        );
        assert_eq!(admitted.reason, "WaitingForAdmission");
    }

    #[test]
    fn transition_time_moves_only_when_status_changes() {
        let mut w = workload();
        let first = compute(&w, &[], &Progress::Creating { missing: 3 }, &at(10));
        w.status = Some(first);
        let second = compute(&w, &[], &Progress::WaitingForAdmission, &at(20));
        assert_eq!(
            second.conditions[0].last_transition_time,
            at(10),
            "still False: time kept"
        );
        assert_eq!(second.conditions[0].reason, "WaitingForAdmission");

        let mut conditions = second.conditions.clone();
        set_condition(&mut conditions, "Admitted", true, "Admitted", "ok", Some(3), &at(30));
        assert_eq!(conditions[0].last_transition_time, at(30));
        assert_eq!(conditions.len(), 1);
    }

    #[test]
    fn suspended_and_invalid_phases() {
        let s = compute(&workload(), &[], &Progress::Suspended, &at(1));
        assert_eq!(s.phase, Some(WorkloadPhase::Suspended));
        let s = compute(&workload(), &[], &Progress::Invalid { message: "bad".into() }, &at(1));
        assert_eq!(
            (s.conditions[0].reason.as_str(), s.conditions[0].message.as_str()),
            ("InvalidSpec", "bad")
        );
    }
}
