//! The Workload status muster reports, computed from what it observes. Pure.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use muster_api::conditions;
use muster_api::labels;
use muster_api::v1alpha1::{AdmissionState, PodGroupStatus, Workload, WorkloadPhase, WorkloadStatus};

use crate::kube_ops::label;

/// Where the controller stands with a Workload, as far as status is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Some pods, claims or the Service do not exist yet.
    Creating { missing: usize },
    /// Everything exists; the pods wait behind the gang gate until admitted.
    AllCreated,
    /// Waiting on something outside muster, such as a missing ResourceClaimTemplate.
    Waiting { reason: &'static str, message: String },
    /// `spec.suspend` is true.
    Suspended,
    /// The spec cannot be turned into pods.
    Invalid { message: String },
}

/// The part of the status the controller owns (the admission loop owns `placement` and
/// the `Admitted` condition). Conditions keep their `lastTransitionTime` while their
/// status does not change.
/// `refused`: how many pods labelled for a template-less group are not its members, and
/// the first of them with why.
pub fn compute(
    workload: &Workload,
    pods: &[&Pod],
    progress: &Progress,
    refused: Option<(usize, &str)>,
    now: &Time,
) -> WorkloadStatus {
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
            .filter(|p| label(**p, labels::POD_GROUP) == Some(group.name.as_str()))
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
    let all_ready = workload
        .spec
        .pod_groups
        .iter()
        .zip(&groups)
        // Another controller does not run a pod that succeeded again (a Job's completed
        // index): it counts toward the group's minimum as Kueue's PodsReady counts it.
        .all(|(spec, counts)| {
            let done = if spec.template.is_none() { counts.succeeded } else { 0 };
            counts.ready + done >= spec.min_count()
        });

    let (created, reason, message) = match progress {
        Progress::Creating { missing } => {
            (false, conditions::REASON_CREATING, format!("creating the gang's objects; {missing} still missing"))
        }
        Progress::AllCreated => (
            true,
            conditions::REASON_ALL_CREATED,
            "every pod and claim exists; pods are held by the muster.dev/gang scheduling gate until the gang is admitted"
                .to_string(),
        ),
        Progress::Waiting { reason, message } => (false, *reason, message.clone()),
        Progress::Suspended => {
            (false, conditions::REASON_SUSPENDED, "spec.suspend is true: the gang holds nothing".to_string())
        }
        Progress::Invalid { message } => (false, conditions::REASON_INVALID_SPEC, message.clone()),
    };
    let admission = previous.placement.as_ref().and_then(|p| p.state);
    let holds = |type_: &str| {
        previous
            .conditions
            .iter()
            .any(|c| c.type_ == type_ && c.status == "True")
    };
    let phase = match (progress, admission) {
        _ if holds(conditions::SUCCEEDED) => WorkloadPhase::Succeeded,
        _ if holds(conditions::FAILED) => WorkloadPhase::Failed,
        (Progress::Suspended, _) => WorkloadPhase::Suspended,
        (_, Some(AdmissionState::Released)) if all_ready => WorkloadPhase::Running,
        (_, Some(AdmissionState::Released)) => WorkloadPhase::Admitted,
        (_, Some(_)) => WorkloadPhase::Pending,
        (Progress::AllCreated, None) => WorkloadPhase::Queued,
        _ => WorkloadPhase::Pending,
    };

    let mut owned: Vec<Condition> = previous.conditions.iter().filter(|c| is_owned(c)).cloned().collect();
    set_condition(
        &mut owned,
        conditions::CREATED,
        created,
        reason,
        &message,
        generation,
        now,
    );
    let ready_pods: i32 = groups.iter().map(|g| g.ready).sum();
    let total: i32 = workload.spec.pod_groups.iter().map(|g| g.replicas).sum();
    let (ready_reason, ready_message) = if all_ready {
        (
            conditions::REASON_PODS_READY,
            format!("{ready_pods} of {total} pods are ready"),
        )
    } else {
        (
            conditions::REASON_PODS_NOT_READY,
            format!("{ready_pods} of {total} pods are ready; every group needs minCount"),
        )
    };
    set_condition(
        &mut owned,
        conditions::PODS_READY,
        all_ready,
        ready_reason,
        &ready_message,
        generation,
        now,
    );

    match refused {
        Some((count, first)) => set_condition(
            &mut owned,
            conditions::PODS_REFUSED,
            true,
            conditions::REASON_NOT_MEMBERS,
            &format!("{count} pods labelled for the gang are not its members; the first: {first}"),
            generation,
            now,
        ),
        None if owned.iter().any(|c| c.type_ == conditions::PODS_REFUSED) => set_condition(
            &mut owned,
            conditions::PODS_REFUSED,
            false,
            conditions::REASON_NONE_REFUSED,
            "every pod labelled for the gang is one of its members",
            generation,
            now,
        ),
        None => {}
    }

    WorkloadStatus {
        observed_generation: generation,
        phase: Some(phase),
        conditions: owned,
        pods: total,
        ready_pods,
        pod_groups: groups,
        placement: None,
        restarts: previous.restarts,
        restarts_count_towards_max: previous.restarts_count_towards_max,
        nomination: None,
        scheduler_refusals: Vec::new(),
        admission_revision: None,
    }
}

/// The controller-owned part of a status as it is (for comparison with [`compute`]).
pub fn owned_part(status: &WorkloadStatus) -> WorkloadStatus {
    WorkloadStatus {
        conditions: status.conditions.iter().filter(|c| is_owned(c)).cloned().collect(),
        placement: None,
        nomination: None,
        scheduler_refusals: Vec::new(),
        admission_revision: None,
        ..status.clone()
    }
}

/// Whether the Workload controller owns `condition` (the admission loop owns the rest).
fn is_owned(condition: &Condition) -> bool {
    [conditions::CREATED, conditions::PODS_READY, conditions::PODS_REFUSED].contains(&condition.type_.as_str())
}

/// `status` with the fields the Workload controller owns taken from `mine`: what this
/// process last wrote, while the cache has not caught up with it.
pub fn overlay_owned(status: &mut WorkloadStatus, mine: &WorkloadStatus) {
    status.observed_generation = mine.observed_generation;
    status.phase = mine.phase;
    status.pods = mine.pods;
    status.ready_pods = mine.ready_pods;
    status.pod_groups = mine.pod_groups.clone();
    status.conditions.retain(|c| !is_owned(c));
    status
        .conditions
        .extend(mine.conditions.iter().filter(|c| is_owned(c)).cloned());
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;
    use muster_api::v1alpha1::PlacementStatus;

    fn workload() -> Workload {
        let mut w: Workload = serde_saphyr::from_str(
            "apiVersion: muster.dev/v1alpha1\nkind: Workload\nmetadata: {name: w, generation: 3}\nspec:\n  podGroups:\n  - {name: a, replicas: 2}\n  - {name: b, replicas: 1}\n",
        )
        .unwrap();
        w.metadata.namespace = Some("ns".into());
        w
    }

    fn pod(group: &str, gated: bool, phase: &str, ready: bool) -> Pod {
        let gates = if gated {
            serde_json::json!([{"name": labels::GANG_GATE}])
        } else {
            serde_json::json!([])
        };
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "labels": {labels::POD_GROUP: group}},
            "spec": {"containers": [], "schedulingGates": gates},
            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
        }))
        .unwrap()
    }

    fn at(seconds: i64) -> Time {
        Time(Timestamp::from_second(seconds).unwrap())
    }

    #[test]
    fn refused_pods_are_counted_and_cleared() {
        let mut w = workload();
        let refused = compute(
            &w,
            &[],
            &Progress::AllCreated,
            Some((2, "pod x: it has no controller")),
            &at(1),
        );
        let condition = refused
            .conditions
            .iter()
            .find(|c| c.type_ == conditions::PODS_REFUSED)
            .unwrap();
        assert_eq!(
            (condition.status.as_str(), condition.reason.as_str()),
            ("True", "NotMembers")
        );
        assert!(
            condition
                .message
                .starts_with("2 pods labelled for the gang are not its members; the first: pod x")
        );
        w.status = Some(refused);
        let cleared = compute(&w, &[], &Progress::AllCreated, None, &at(2));
        assert!(
            cleared
                .conditions
                .iter()
                .any(|c| c.type_ == conditions::PODS_REFUSED && c.status == "False")
        );
        let never = compute(&workload(), &[], &Progress::AllCreated, None, &at(2));
        assert!(!never.conditions.iter().any(|c| c.type_ == conditions::PODS_REFUSED));
    }

    #[test]
    fn counts_pods_per_group() {
        let pods = [
            pod("a", true, "Pending", false),
            pod("a", false, "Running", true),
            pod("b", false, "Failed", false),
        ];
        let refs: Vec<&Pod> = pods.iter().collect();
        let status = compute(&workload(), &refs, &Progress::AllCreated, None, &at(10));
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
        assert_eq!(status.phase, Some(WorkloadPhase::Queued));
        let created = &status.conditions[0];
        assert_eq!(
            (created.type_.as_str(), created.status.as_str(), created.reason.as_str()),
            ("Created", "True", "AllCreated")
        );
        let ready = &status.conditions[1];
        assert_eq!(
            (ready.type_.as_str(), ready.status.as_str(), ready.reason.as_str()),
            ("PodsReady", "False", "PodsNotReady")
        );
    }

    #[test]
    fn transition_time_moves_only_when_status_changes() {
        let mut w = workload();
        let first = compute(&w, &[], &Progress::Creating { missing: 3 }, None, &at(10));
        w.status = Some(first);
        let second = compute(
            &w,
            &[],
            &Progress::Waiting {
                reason: "X",
                message: "m".into(),
            },
            None,
            &at(20),
        );
        assert_eq!(
            second.conditions[0].last_transition_time,
            at(10),
            "still False: time kept"
        );
        assert_eq!(second.conditions[0].reason, "X");
        let mut conditions = second.conditions.clone();
        set_condition(&mut conditions, "Created", true, "AllCreated", "ok", Some(3), &at(30));
        assert_eq!(conditions[0].last_transition_time, at(30));
        assert_eq!(conditions.len(), 2);
    }

    #[test]
    fn suspended_and_invalid_phases() {
        let s = compute(&workload(), &[], &Progress::Suspended, None, &at(1));
        assert_eq!(s.phase, Some(WorkloadPhase::Suspended));
        let s = compute(
            &workload(),
            &[],
            &Progress::Invalid { message: "bad".into() },
            None,
            &at(1),
        );
        assert_eq!(
            (s.conditions[0].reason.as_str(), s.conditions[0].message.as_str()),
            ("InvalidSpec", "bad")
        );
    }

    #[test]
    fn phase_follows_admission_and_admitted_stays_with_the_admission_loop() {
        let mut w = workload();
        let placement = |state| {
            Some(PlacementStatus {
                state: Some(state),
                ..Default::default()
            })
        };
        let admitted = Condition {
            type_: "Admitted".into(),
            status: "True".into(),
            reason: "Admitted".into(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: at(0),
        };
        w.status = Some(WorkloadStatus {
            placement: placement(AdmissionState::Reserving),
            ..Default::default()
        });
        assert_eq!(
            compute(&w, &[], &Progress::AllCreated, None, &at(1)).phase,
            Some(WorkloadPhase::Pending)
        );
        w.status = Some(WorkloadStatus {
            placement: placement(AdmissionState::Released),
            conditions: vec![admitted],
            ..Default::default()
        });
        assert_eq!(
            compute(&w, &[], &Progress::AllCreated, None, &at(1)).phase,
            Some(WorkloadPhase::Admitted)
        );
        let pods = [
            pod("a", false, "Running", true),
            pod("a", false, "Running", true),
            pod("b", false, "Running", true),
        ];
        let refs: Vec<&Pod> = pods.iter().collect();
        let s = compute(&w, &refs, &Progress::AllCreated, None, &at(1));
        assert_eq!(s.phase, Some(WorkloadPhase::Running));
        assert_eq!(s.conditions[1].status, "True");
        assert!(s.placement.is_none(), "placement belongs to the admission loop");
        assert!(s.conditions.iter().all(|c| c.type_ != "Admitted"));
        assert_eq!(owned_part(w.status.as_ref().unwrap()).conditions.len(), 0);

        // A pod of another controller's group that succeeded (a Job's completed index)
        // still counts: the gang runs; one of muster's own groups needs its pods ready.
        let pods = [
            pod("a", false, "Succeeded", false),
            pod("a", false, "Running", true),
            pod("b", false, "Running", true),
        ];
        let refs: Vec<&Pod> = pods.iter().collect();
        let s = compute(&w, &refs, &Progress::AllCreated, None, &at(1));
        assert_eq!(s.phase, Some(WorkloadPhase::Running));
        let mut own = w.clone();
        own.spec.pod_groups[0].template = Some(Default::default());
        let s = compute(&own, &refs, &Progress::AllCreated, None, &at(1));
        assert_eq!(s.phase, Some(WorkloadPhase::Admitted));
    }
}
