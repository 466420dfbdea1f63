//! What the admission state machine sees: a Workload, its pods and its claims in the
//! core's terms, and the journal (`status.placement`) converted both ways.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimConsumerReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use muster_admission::failure::{Backoff, ExitCodes, FailureAction, FailureKind, FailureRule};
use muster_admission::refusal::{Refusal, Unscheduled};
use muster_admission::{
    ClaimView, Consumer, Journal, Millis, Phase, PlannedPod as CorePlannedPod, PodView, Reason, Spec, State,
};
use muster_api::conditions;
use muster_api::labels;
use muster_api::v1alpha1::{self, AdmissionState, PlacementStatus, PlannedPod, Workload};

use crate::kube_ops;

pub fn millis(time: &Time) -> Millis {
    time.0.as_millisecond()
}

pub fn time(millis: Millis) -> Time {
    Time(Timestamp::from_millisecond(millis).unwrap_or(Timestamp::UNIX_EPOCH))
}

/// The time now as Kubernetes writes it in conditions (RFC 3339, seconds).
pub fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .map_or_else(|_| k8s_openapi::jiff::Timestamp::now().to_string(), |t| t.to_string())
}

pub fn now_millis() -> Millis {
    Timestamp::now().as_millisecond()
}

fn state(state: AdmissionState) -> State {
    match state {
        AdmissionState::Reserving => State::Reserving,
        AdmissionState::Reserved => State::Reserved,
        AdmissionState::Released => State::Released,
        AdmissionState::TearingDown => State::TearingDown,
        AdmissionState::Restarting => State::Restarting,
        AdmissionState::Suspending => State::Suspending,
        AdmissionState::Finishing => State::Finishing,
        AdmissionState::Finished => State::Finished,
    }
}

fn admission_state(state: State) -> AdmissionState {
    match state {
        State::Reserving => AdmissionState::Reserving,
        State::Reserved => AdmissionState::Reserved,
        State::Released => AdmissionState::Released,
        State::TearingDown => AdmissionState::TearingDown,
        State::Restarting => AdmissionState::Restarting,
        State::Suspending => AdmissionState::Suspending,
        State::Finishing => AdmissionState::Finishing,
        State::Finished => AdmissionState::Finished,
    }
}

/// Reasons a gang being taken apart reports when it is queued again.
const CAUSES: [Reason; 7] = [
    Reason::RolledBack,
    Reason::Conflict,
    Reason::ScheduleTimeout,
    Reason::ReleaseTimeout,
    Reason::Preempted,
    Reason::SchedulerRefused,
    Reason::ReplacementTimeout,
];

/// The journal of a Workload, if it has one. The cause of a teardown or a failed
/// commit is the `Admitted` condition written with it.
pub fn journal(workload: &Workload) -> Option<Journal> {
    let placement = workload.status.as_ref()?.placement.as_ref()?;
    let state = state(placement.state?);
    let cause = condition(workload, conditions::ADMITTED)
        .filter(|_| matches!(state, State::Reserving | State::TearingDown))
        .and_then(|c| Some((Reason::parse(&c.reason)?, c.message.clone())))
        .filter(|(reason, _)| CAUSES.contains(reason));
    let released_at = placement.released_at.as_ref().map(millis);
    Some(Journal {
        state,
        since: placement
            .since
            .as_ref()
            .map(millis)
            .or(released_at)
            .unwrap_or_else(now_millis),
        pods: placement
            .pods
            .iter()
            .map(|p| CorePlannedPod {
                name: p.name.clone(),
                node: p.node.clone(),
                group: p.group.clone(),
                extra: p.extra,
                // Before extras carried their own release time (journals without
                // `since`), the gang's stood for it; a core pod released with the gang
                // has the gang's, and one leaving its place none.
                released_at: match p.released_at.as_ref().map(millis) {
                    Some(at) => Some(at),
                    None if p.extra => released_at.filter(|_| placement.since.is_none()),
                    None if p.leaving => None,
                    None => released_at.filter(|_| state == State::Released),
                },
                claims: p.claims.clone(),
                devices: p.devices.clone(),
            })
            .collect(),
        claims: placement.claims.clone(),
        released_at,
        reuse_reservation: placement.reuse_reservation,
        retired: placement.retired_pods.clone(),
        cause,
        topology_value: placement.topology_value.clone(),
        nodes: placement.nodes.clone(),
        devices: placement.devices,
        vacancies: placement
            .vacancies
            .iter()
            .map(|v| muster_admission::Vacancy {
                pod: v.pod.clone(),
                group: v.group.clone(),
                index: v.index,
                node: v.node.clone(),
                devices: v.devices.clone(),
                since: millis(&v.since),
            })
            .collect(),
    })
}

/// The journal as the Workload's `status.placement`.
pub fn placement(journal: &Journal) -> PlacementStatus {
    PlacementStatus {
        state: Some(admission_state(journal.state)),
        since: Some(time(journal.since)),
        topology_value: journal.topology_value.clone(),
        nodes: journal.nodes.clone(),
        devices: journal.devices,
        pods: journal
            .pods
            .iter()
            .map(|p| PlannedPod {
                name: p.name.clone(),
                node: p.node.clone(),
                group: p.group.clone(),
                extra: p.extra,
                // A core pod released with the gang goes without a time of its own.
                released_at: p
                    .released_at
                    .filter(|at| p.extra || Some(*at) != journal.released_at)
                    .map(time),
                leaving: !p.extra
                    && p.released_at.is_none()
                    && journal.state == State::Released
                    && journal.released_at.is_some(),
                claims: p.claims.clone(),
                devices: p.devices.clone(),
            })
            .collect(),
        claims: journal.claims.clone(),
        released_at: journal.released_at.map(time),
        reuse_reservation: journal.reuse_reservation,
        retired_pods: journal.retired.clone(),
        vacancies: journal
            .vacancies
            .iter()
            .map(|v| muster_api::v1alpha1::Vacancy {
                pod: v.pod.clone(),
                group: v.group.clone(),
                index: v.index,
                node: v.node.clone(),
                devices: v.devices.clone(),
                since: time(v.since),
            })
            .collect(),
    }
}

/// The job's end its adoption controller wrote on a derived Workload.
pub fn job_ended(workload: &Workload) -> Option<muster_admission::JobEnd> {
    let text = workload.annotations().get(muster_api::labels::JOB_ENDED)?;
    let (outcome, message) = text.split_once(':').unwrap_or((text.as_str(), ""));
    let succeeded = match outcome.trim() {
        "Succeeded" => true,
        "Failed" => false,
        _ => return None,
    };
    Some(muster_admission::JobEnd {
        succeeded,
        message: message.trim().to_string(),
    })
}

/// The part of the spec the state machine reads.
pub fn spec(workload: &Workload) -> Spec {
    Spec {
        suspend: workload.spec.suspend == Some(true),
        // What Kueue says is the admission loop's to tell.
        evicted: false,
        groups: workload
            .spec
            .pod_groups
            .iter()
            .map(|g| muster_admission::GroupSpec {
                name: g.name.clone(),
                min_count: g.min_count(),
                managed: g.template.is_some(),
            })
            .collect(),
        success_groups: workload
            .spec
            .success_policy
            .as_ref()
            .and_then(|p| p.pod_groups.clone())
            .unwrap_or_default(),
        max_restarts: workload.spec.failure_policy.as_ref().map_or(0, |p| p.max_restarts),
        failure_rules: workload
            .spec
            .failure_policy
            .iter()
            .flat_map(|p| p.rules.iter())
            .map(failure_rule)
            .collect(),
        restart_backoff: workload
            .spec
            .failure_policy
            .as_ref()
            .and_then(|p| p.restart_backoff.as_ref())
            .map(|b| Backoff {
                initial: i64::from(b.initial_seconds) * 1000,
                max: i64::from(b.max_seconds) * 1000,
            }),
        ttl_seconds_after_finished: workload.spec.ttl_seconds_after_finished.map(i64::from),
        restarted_by_pod_controller: workload.spec.failure_policy.as_ref().and_then(|p| p.restarted_by)
            == Some(muster_api::v1alpha1::RestartedBy::PodController),
        job_ended: job_ended(workload),
    }
}

/// A rule of the failure policy in the state machine's terms.
fn failure_rule(rule: &v1alpha1::FailureRule) -> FailureRule {
    FailureRule {
        name: rule.name.clone(),
        action: match rule.action {
            v1alpha1::FailureAction::FailGang => FailureAction::FailGang,
            v1alpha1::FailureAction::RestartGang => FailureAction::RestartGang,
            v1alpha1::FailureAction::RestartGangAndIgnoreMaxRestarts => FailureAction::RestartUncounted,
        },
        exit_codes: rule.on_exit_codes.as_ref().map(|c| ExitCodes {
            container: c.container_name.clone(),
            within: c.operator == v1alpha1::ExitCodeOperator::In,
            values: c.values.clone(),
        }),
        conditions: rule
            .on_pod_conditions
            .iter()
            .flatten()
            .map(|c| {
                let status = match c.status {
                    v1alpha1::ConditionStatus::True => "True",
                    v1alpha1::ConditionStatus::False => "False",
                    v1alpha1::ConditionStatus::Unknown => "Unknown",
                };
                (c.type_.clone(), status.to_string())
            })
            .collect(),
        kinds: rule
            .on_reasons
            .iter()
            .flatten()
            .map(|r| match r {
                v1alpha1::FailureReason::PodFailed => FailureKind::PodFailed,
                v1alpha1::FailureReason::Evicted => FailureKind::Evicted,
                v1alpha1::FailureReason::Preempted => FailureKind::Preempted,
                v1alpha1::FailureReason::DeadlineExceeded => FailureKind::DeadlineExceeded,
                v1alpha1::FailureReason::NodeLost => FailureKind::NodeLost,
                v1alpha1::FailureReason::PodLost => FailureKind::PodLost,
            })
            .collect(),
        groups: rule.pod_groups.clone().unwrap_or_default(),
    }
}

/// `status.restartsCountTowardsMax`; a status written before it existed counted every
/// restart.
pub fn counted_restarts(workload: &Workload) -> i32 {
    workload
        .status
        .as_ref()
        .map_or(0, |s| s.restarts_count_towards_max.unwrap_or(s.restarts))
}

/// How a pod's failure came about, where the pod says more than that a container
/// failed: the kubelet's or the Eviction API's eviction, kube-scheduler's preemption,
/// its deadline.
fn failure_kind(pod: &Pod) -> Option<FailureKind> {
    let status = pod.status.as_ref()?;
    let disruption = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "DisruptionTarget" && c.status == "True");
    match (status.reason.as_deref(), disruption.and_then(|c| c.reason.as_deref())) {
        (_, Some("PreemptionByScheduler")) => Some(FailureKind::Preempted),
        (Some("Evicted"), _) | (_, Some("EvictionByEvictionAPI" | "TerminationByKubelet")) => {
            Some(FailureKind::Evicted)
        }
        (Some("DeadlineExceeded"), _) => Some(FailureKind::DeadlineExceeded),
        // The taint manager deletes pods of a node that stays NotReady or unreachable,
        // and pod garbage collection those of a node that is gone.
        (_, Some("DeletionByTaintManager" | "DeletionByPodGC")) => Some(FailureKind::NodeLost),
        _ => None,
    }
}

pub(crate) fn condition<'a>(workload: &'a Workload, type_: &str) -> Option<&'a Condition> {
    workload.status.as_ref()?.conditions.iter().find(|c| c.type_ == type_)
}

/// Whether a Workload finished (succeeded or failed for good).
pub fn finished(workload: &Workload) -> bool {
    finished_at(workload).is_some()
}

/// When the Workload succeeded or failed for good, if it did.
pub fn finished_at(workload: &Workload) -> Option<Millis> {
    [conditions::SUCCEEDED, conditions::FAILED]
        .iter()
        .filter_map(|t| condition(workload, t).filter(|c| c.status == "True"))
        .map(|c| millis(&c.last_transition_time))
        .next()
}

pub fn pod(pod: &Pod) -> PodView {
    let status = pod.status.as_ref();
    let phase = match status.and_then(|s| s.phase.as_deref()) {
        Some("Pending") | None => Phase::Pending,
        Some("Running") => Phase::Running,
        Some("Succeeded") => Phase::Succeeded,
        Some("Failed") => Phase::Failed,
        Some(_) => Phase::Unknown,
    };
    PodView {
        name: pod.name_any(),
        uid: pod.uid().unwrap_or_default(),
        group: kube_ops::label(pod, labels::POD_GROUP).map(str::to_string),
        attempt: kube_ops::label(pod, labels::ATTEMPT).and_then(|a| a.parse().ok()),
        gated: crate::workload::status::is_gated(pod),
        phase,
        node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        deleting: pod.metadata.deletion_timestamp.is_some(),
        message: status.and_then(|s| s.reason.clone().or(s.message.clone())),
        failure_kind: failure_kind(pod),
        exit_codes: status
            .iter()
            .flat_map(|s| {
                // An init container that failed fails the pod as well.
                s.container_statuses
                    .iter()
                    .flatten()
                    .chain(s.init_container_statuses.iter().flatten())
            })
            .filter_map(|c| {
                let code = c.state.as_ref()?.terminated.as_ref()?.exit_code;
                Some((c.name.clone(), code))
            })
            .collect(),
        conditions: status
            .iter()
            .flat_map(|s| s.conditions.iter().flatten())
            .map(|c| (c.type_.clone(), c.status.clone()))
            .collect(),
        unscheduled: unscheduled(pod),
        // The member's index and whose pods they are are the admission loop's to tell.
        index: None,
        owned: false,
    }
}

/// kube-scheduler's `PodScheduled=False` condition of a pod, and whether it nominated a
/// node for it.
fn unscheduled(pod: &Pod) -> Option<Unscheduled> {
    let status = pod.status.as_ref()?;
    let condition = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False");
    let uid = pod.uid().unwrap_or_default();
    let Some(condition) = condition else {
        first_seen::forget(&uid);
        return None;
    };
    let reason = condition.reason.clone().unwrap_or_default();
    let nominated = status.nominated_node_name.as_deref().is_some_and(|n| !n.is_empty());
    // The condition's transition time does not move from SchedulingGated to
    // Unschedulable (both False): when this state began is what this process saw.
    let since = first_seen::since(&uid, &format!("{reason}/{nominated}"), now_millis());
    Some(Unscheduled {
        reason,
        message: condition.message.clone().unwrap_or_default(),
        nominated,
        since: Some(since),
    })
}

/// When this process first saw each pod in its current not-scheduled state, by uid.
mod first_seen {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    use muster_admission::Millis;

    /// Beyond this many pods, states older than [`STALE`] are dropped.
    const BOUND: usize = 8192;
    const STALE: Millis = 600_000;

    fn states() -> &'static Mutex<HashMap<String, (String, Millis)>> {
        static STATES: OnceLock<Mutex<HashMap<String, (String, Millis)>>> = OnceLock::new();
        STATES.get_or_init(Default::default)
    }

    /// When the pod `uid` was first seen in `state` (now, if it just entered it).
    pub fn since(uid: &str, state: &str, now: Millis) -> Millis {
        let mut states = states().lock().unwrap_or_else(|p| p.into_inner());
        if let Some((known, at)) = states.get(uid)
            && known == state
        {
            return *at;
        }
        if states.len() >= BOUND {
            states.retain(|_, (_, at)| now - *at < STALE);
        }
        states.insert(uid.to_string(), (state.to_string(), now));
        now
    }

    /// The pod `uid` is scheduled, or its state is unknown: nothing to remember.
    pub fn forget(uid: &str) {
        states().lock().unwrap_or_else(|p| p.into_inner()).remove(uid);
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn a_state_keeps_its_first_sight_until_it_changes() {
            assert_eq!(super::since("u-first-seen", "Unschedulable/false", 1_000), 1_000);
            assert_eq!(super::since("u-first-seen", "Unschedulable/false", 9_000), 1_000);
            assert_eq!(super::since("u-first-seen", "Unschedulable/true", 9_500), 9_500);
            super::forget("u-first-seen");
            assert_eq!(super::since("u-first-seen", "Unschedulable/true", 12_000), 12_000);
        }
    }
}

/// `status.schedulerRefusals` in the state machine's terms.
pub fn refusals(workload: &Workload) -> Vec<Refusal> {
    workload
        .status
        .iter()
        .flat_map(|s| &s.scheduler_refusals)
        .map(|r| Refusal {
            group: r.pod_group.clone(),
            pod: r.pod.clone(),
            node: r.node.clone(),
            message: r.message.clone(),
            at: millis(&r.at),
        })
        .collect()
}

/// Refusals as `status.schedulerRefusals`.
pub fn scheduler_refusals(refusals: &[Refusal]) -> Vec<v1alpha1::SchedulerRefusal> {
    refusals
        .iter()
        .map(|r| v1alpha1::SchedulerRefusal {
            pod_group: r.group.clone(),
            pod: r.pod.clone(),
            node: r.node.clone(),
            message: r.message.clone(),
            at: time(r.at),
        })
        .collect()
}

/// A claim as the state machine sees it; `held_elsewhere`: another gang's journal names
/// it; `known_outside`: whether the caches show a `reservedFor` entry as a consumer
/// outside the gang (see [`muster_admission::ownership`]).
pub fn claim(
    claim: &ResourceClaim,
    held_elsewhere: bool,
    used_by: Vec<String>,
    known_outside: impl Fn(&ResourceClaimConsumerReference) -> bool,
) -> ClaimView {
    let status = claim.status.as_ref();
    let ours = claim.finalizers().iter().any(|f| f == labels::CLAIM_FINALIZER);
    // A claim another allocator made that is being deleted is nothing to build on:
    // kube-scheduler refuses new pods on it and the API server new `reservedFor` entries.
    // (muster's own keep counting as allocated until muster gives them back.)
    let usable = ours || claim.metadata.deletion_timestamp.is_none();
    ClaimView {
        name: claim.name_any(),
        allocated: usable && status.is_some_and(|s| s.allocation.is_some()),
        devices: status
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .into_iter()
            .flat_map(|d| d.results.iter().flatten())
            .map(|r| format!("{}/{}/{}", r.driver, r.pool, r.device))
            .collect(),
        ours,
        held_elsewhere,
        used_by,
        protected: claim
            .finalizers()
            .iter()
            .any(|f| f == labels::DELETE_PROTECTION_FINALIZER),
        reserved_for: status
            .and_then(|s| s.reserved_for.as_ref())
            .into_iter()
            .flatten()
            .map(|r| Consumer {
                name: r.name.clone(),
                uid: r.uid.clone(),
                known_outside: known_outside(r),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_journal_survives_the_status_round_trip() {
        let journal = Journal {
            state: State::Restarting,
            since: 1_700_000_000_000,
            pods: vec![
                CorePlannedPod {
                    name: "g-w-0".into(),
                    node: "n1".into(),
                    group: Some("w".into()),
                    extra: false,
                    released_at: None,
                    claims: vec![],
                    devices: vec![],
                },
                CorePlannedPod {
                    name: "g-w-1".into(),
                    node: "n2".into(),
                    group: Some("w".into()),
                    extra: true,
                    released_at: Some(1_700_000_001_000),
                    claims: vec!["g-w-1-gpus".into()],
                    devices: vec![],
                },
                // Being dropped (or not released yet): stays so, not the gang's time.
                CorePlannedPod {
                    name: "g-w-2".into(),
                    node: "n2".into(),
                    group: None,
                    extra: true,
                    released_at: None,
                    claims: vec!["g-w-2-gpus".into()],
                    devices: vec![],
                },
            ],
            claims: vec!["g-w-0-gpus".into(), "g-w-1-gpus".into()],
            released_at: Some(1_700_000_000_500),
            reuse_reservation: true,
            retired: vec!["uid-1".into()],
            cause: None,
            topology_value: Some("rack-1".into()),
            nodes: vec!["n1".into(), "n2".into()],
            devices: 16,
            vacancies: vec![muster_admission::Vacancy {
                pod: "g-w-3".into(),
                group: Some("w".into()),
                index: Some(3),
                node: "n3".into(),
                devices: vec!["gpu.example.com/n3/gpu-0".into()],
                since: 1_700_000_002_000,
            }],
        };
        let mut workload: Workload = serde_json::from_value(serde_json::json!({
            "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
            "metadata": {"name": "g", "namespace": "ns"},
            "spec": {"podGroups": [{"name": "w", "replicas": 2, "minCount": 1}]},
        }))
        .expect("workload");
        workload.status = Some(muster_api::v1alpha1::WorkloadStatus {
            placement: Some(placement(&journal)),
            ..Default::default()
        });
        assert_eq!(self::journal(&workload), Some(journal));
    }

    /// Issue 22, defect 5: the cause of a teardown is read back from the status, a
    /// preemption's too, so the gang reports it when it is queued again.
    #[test]
    fn a_teardown_reads_its_cause_back_from_the_status_preemption_too() {
        let mut workload: Workload = serde_json::from_value(serde_json::json!({
            "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
            "metadata": {"name": "low", "namespace": "ns"},
            "spec": {"podGroups": [{"name": "w", "replicas": 1}]},
            "status": {
                "placement": {"state": "TearingDown", "claims": ["low-w-0-gpus"]},
                "conditions": [{
                    "type": "Admitted", "status": "False", "reason": "Preempted",
                    "message": "preempted by ns/high (priority 1000)",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }],
            },
        }))
        .expect("workload");
        let journal = journal(&workload).expect("journal");
        assert_eq!(
            journal.cause,
            Some((Reason::Preempted, "preempted by ns/high (priority 1000)".to_string()))
        );
        // A reason that is no cause of a teardown is not taken for one.
        if let Some(status) = workload.status.as_mut() {
            status.conditions[0].reason = "Admitted".into();
        }
        assert_eq!(self::journal(&workload).expect("journal").cause, None);
    }

    #[test]
    fn reasons_match_the_api_constants() {
        for (reason, constant) in [
            (Reason::Reserving, conditions::REASON_RESERVING),
            (Reason::Admitted, conditions::REASON_ADMITTED),
            (Reason::RolledBack, conditions::REASON_ROLLED_BACK),
            (Reason::Conflict, conditions::REASON_CONFLICT),
            (Reason::ScheduleTimeout, conditions::REASON_SCHEDULE_TIMEOUT),
            (Reason::ReleaseTimeout, conditions::REASON_RELEASE_TIMEOUT),
            (Reason::Suspended, conditions::REASON_SUSPENDED),
            (Reason::PodFailed, conditions::REASON_POD_FAILED),
            (Reason::PodLost, conditions::REASON_POD_LOST),
            (Reason::NodeLost, conditions::REASON_NODE_LOST),
            (Reason::MaxRestartsExceeded, conditions::REASON_MAX_RESTARTS),
            (Reason::SucceededPodGroups, conditions::REASON_SUCCEEDED),
            (Reason::Restarted, conditions::REASON_RESTARTED),
            (Reason::Preempted, conditions::REASON_PREEMPTED),
            (Reason::FailedByRule, conditions::REASON_FAILED_BY_RULE),
            (Reason::SchedulerRefused, conditions::REASON_SCHEDULER_REFUSED),
        ] {
            assert_eq!(reason.as_str(), constant);
            assert_eq!(Reason::parse(constant), Some(reason));
        }
    }
}
