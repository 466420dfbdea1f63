//! One gang in a line: where it stands, since when, and what it holds.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use muster_api::conditions;
use muster_api::v1alpha1::{AdmissionState, Workload, WorkloadPhase};
use serde::Serialize;

/// A gang as `kubectl muster status` shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GangSummary {
    pub namespace: String,
    pub name: String,
    pub phase: WorkloadPhase,
    /// The admission state recorded in `status.placement`, when the gang has a placement.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<AdmissionState>,
    /// How long the gang has been in `state`.
    #[serde(skip_serializing_if = "Option::is_none", with = "seconds")]
    pub in_state: Option<Duration>,
    /// Why a gang that is not admitted waits: the reason of its Admitted condition (or of
    /// Created while its objects are made).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The message that goes with `reason`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// How long a waiting gang has waited for admission.
    #[serde(skip_serializing_if = "Option::is_none", with = "seconds")]
    pub waiting: Option<Duration>,
    /// Devices reserved for the gang.
    pub devices: i32,
    /// Nodes of its placement.
    pub nodes: Vec<String>,
    pub pods: i32,
    pub ready_pods: i32,
    pub restarts: i32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority_class: Option<String>,
    /// The LocalQueue of a gang queued in Kueue.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
}

impl GangSummary {
    /// Whether the gang waits for admission: not admitted, not suspended, not done.
    pub fn is_pending(&self) -> bool {
        matches!(self.phase, WorkloadPhase::Pending | WorkloadPhase::Queued)
    }

    /// Whether the gang is in a state it should pass through quickly: a commit, a
    /// teardown, a restart, a suspend or a finish under way.
    pub fn in_transition(&self) -> bool {
        matches!(
            self.state,
            Some(
                AdmissionState::Reserving
                    | AdmissionState::Reserved
                    | AdmissionState::TearingDown
                    | AdmissionState::Restarting
                    | AdmissionState::Suspending
                    | AdmissionState::Finishing
            )
        )
    }
}

/// The name of an admission state as the API spells it.
pub fn state_name(state: AdmissionState) -> &'static str {
    match state {
        AdmissionState::Reserving => "Reserving",
        AdmissionState::Reserved => "Reserved",
        AdmissionState::Released => "Released",
        AdmissionState::TearingDown => "TearingDown",
        AdmissionState::Restarting => "Restarting",
        AdmissionState::Suspending => "Suspending",
        AdmissionState::Finishing => "Finishing",
        AdmissionState::Finished => "Finished",
    }
}

/// The name of a phase as the API spells it.
pub fn phase_name(phase: WorkloadPhase) -> &'static str {
    match phase {
        WorkloadPhase::Pending => "Pending",
        WorkloadPhase::Queued => "Queued",
        WorkloadPhase::Admitted => "Admitted",
        WorkloadPhase::Running => "Running",
        WorkloadPhase::Succeeded => "Succeeded",
        WorkloadPhase::Failed => "Failed",
        WorkloadPhase::Suspended => "Suspended",
    }
}

fn since(time: &Time, now: Timestamp) -> Duration {
    now.duration_since(time.0).unsigned_abs()
}

/// Summarises `workload` as seen at `now`.
pub fn summarize(workload: &Workload, now: Timestamp) -> GangSummary {
    let status = workload.status.as_ref();
    let phase = status.and_then(|s| s.phase).unwrap_or_default();
    let placement = status.and_then(|s| s.placement.as_ref());
    let condition = |kind: &str| {
        status
            .into_iter()
            .flat_map(|s| s.conditions.iter())
            .find(|c| c.type_ == kind)
    };
    let mut summary = GangSummary {
        namespace: workload.namespace().unwrap_or_default(),
        name: workload.name_any(),
        phase,
        state: placement.and_then(|p| p.state),
        in_state: placement.and_then(|p| p.since.as_ref()).map(|t| since(t, now)),
        reason: None,
        message: None,
        waiting: None,
        devices: placement.map_or(0, |p| p.devices),
        nodes: placement.map(|p| p.nodes.clone()).unwrap_or_default(),
        pods: status.map_or(0, |s| s.pods),
        ready_pods: status.map_or(0, |s| s.ready_pods),
        restarts: status.map_or(0, |s| s.restarts),
        priority_class: workload.spec.priority_class_name.clone(),
        queue: workload.labels().get(crate::kueue::QUEUE_LABEL).cloned(),
    };
    if summary.is_pending() {
        let admitted = condition(conditions::ADMITTED).filter(|c| c.status == "False");
        let created = condition(conditions::CREATED).filter(|c| c.status == "False");
        let why = admitted.or(created);
        summary.reason = why.map(|c| c.reason.clone());
        summary.message = why.map(|c| c.message.clone()).filter(|m| !m.is_empty());
        // A gang queued again (after a teardown, an eviction) waits since its Admitted
        // condition turned False; a new one since it was created.
        let waiting_since = admitted
            .map(|c| c.last_transition_time.clone())
            .or_else(|| workload.metadata.creation_timestamp.clone());
        summary.waiting = waiting_since.map(|t| since(&t, now));
        if summary.reason.is_none() {
            summary.reason = Some(conditions::REASON_WAITING_FOR_OBJECTS.to_string());
        }
    }
    summary
}

mod seconds {
    use std::time::Duration;

    use serde::Serializer;

    pub fn serialize<S: Serializer>(value: &Option<Duration>, serializer: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(duration) => serializer.serialize_u64(duration.as_secs()),
            None => serializer.serialize_none(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
    use muster_api::v1alpha1::{PlacementStatus, WorkloadStatus};

    fn workload(phase: WorkloadPhase) -> Workload {
        let mut workload: Workload = serde_json::from_value(serde_json::json!({
            "apiVersion": "muster.dev/v1alpha1",
            "kind": "Workload",
            "metadata": {
                "name": "llama", "namespace": "team-a",
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "labels": {"kueue.x-k8s.io/queue-name": "gpus"},
            },
            "spec": {"priorityClassName": "training", "podGroups": [
                {"name": "workers", "replicas": 2, "template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}}
            ]},
        }))
        .expect("a valid Workload");
        workload.status = Some(WorkloadStatus {
            phase: Some(phase),
            pods: 2,
            ..WorkloadStatus::default()
        });
        workload
    }

    fn at(text: &str) -> Timestamp {
        text.parse().expect("a timestamp")
    }

    fn condition(kind: &str, status: &str, reason: &str, message: &str, when: &str) -> Condition {
        Condition {
            type_: kind.into(),
            status: status.into(),
            reason: reason.into(),
            message: message.into(),
            last_transition_time: Time(at(when)),
            observed_generation: None,
        }
    }

    #[test]
    fn a_queued_gang_waits_since_its_admitted_condition_turned_false() {
        let mut gang = workload(WorkloadPhase::Queued);
        gang.status.as_mut().unwrap().conditions = vec![condition(
            conditions::ADMITTED,
            "False",
            conditions::REASON_UNSCHEDULABLE,
            "needs 8 devices, best rack has 4",
            "2026-01-01T00:10:00Z",
        )];
        let summary = summarize(&gang, at("2026-01-01T00:15:00Z"));
        assert!(summary.is_pending());
        assert_eq!(summary.reason.as_deref(), Some("Unschedulable"));
        assert_eq!(summary.message.as_deref(), Some("needs 8 devices, best rack has 4"));
        assert_eq!(summary.waiting, Some(Duration::from_secs(300)));
        assert_eq!(summary.queue.as_deref(), Some("gpus"));
        assert_eq!(summary.priority_class.as_deref(), Some("training"));
    }

    #[test]
    fn a_new_gang_without_conditions_waits_since_creation_for_its_objects() {
        let summary = summarize(&workload(WorkloadPhase::Pending), at("2026-01-01T00:01:00Z"));
        assert_eq!(summary.reason.as_deref(), Some("WaitingForObjects"));
        assert_eq!(summary.waiting, Some(Duration::from_secs(60)));
    }

    #[test]
    fn a_running_gang_reports_its_state_devices_and_nodes_and_no_wait() {
        let mut gang = workload(WorkloadPhase::Running);
        gang.status.as_mut().unwrap().placement = Some(PlacementStatus {
            state: Some(AdmissionState::Released),
            since: Some(Time(at("2026-01-01T00:02:00Z"))),
            devices: 16,
            nodes: vec!["node-1".into(), "node-2".into()],
            ..PlacementStatus::default()
        });
        let summary = summarize(&gang, at("2026-01-01T00:03:00Z"));
        assert!(!summary.is_pending());
        assert!(!summary.in_transition());
        assert_eq!(summary.state, Some(AdmissionState::Released));
        assert_eq!(summary.in_state, Some(Duration::from_secs(60)));
        assert_eq!(summary.devices, 16);
        assert_eq!(summary.waiting, None);
        assert_eq!(summary.reason, None);
    }

    #[test]
    fn a_teardown_is_a_transition() {
        let mut gang = workload(WorkloadPhase::Queued);
        gang.status.as_mut().unwrap().placement = Some(PlacementStatus {
            state: Some(AdmissionState::TearingDown),
            ..PlacementStatus::default()
        });
        assert!(summarize(&gang, at("2026-01-01T00:03:00Z")).in_transition());
    }
}
