//! The state machine's transitions, one rule at a time.

use std::collections::BTreeMap;

use muster_admission::failure;
use muster_admission::refusal::{self, Refusal, Unscheduled};
use muster_admission::{
    ClaimView, ConditionType, Consumer, Disruption, Effect, Gang, GroupSpec, Journal, NodeHealth, Owners, Phase,
    PlannedPod, PodView, Reason, Restarts, Settings, Spec, State, Step, decide,
};

const SETTINGS: Settings = Settings {
    schedule_timeout: 120_000,
    release_timeout: 120_000,
    refusal_grace: 5_000,
    owner_stop_timeout: 60_000,
};

fn spec(min_count: i32, managed: bool) -> Spec {
    Spec {
        suspend: false,
        evicted: false,
        groups: vec![GroupSpec {
            name: "w".into(),
            min_count,
            managed,
        }],
        success_groups: vec![],
        max_restarts: 3,
        failure_rules: vec![],
        restart_backoff: None,
        ttl_seconds_after_finished: None,
        restarted_by_pod_controller: false,
        job_ended: None,
    }
}

fn planned(name: &str, extra: bool, released_at: Option<i64>) -> PlannedPod {
    PlannedPod {
        name: name.into(),
        node: "n1".into(),
        group: Some("w".into()),
        extra,
        released_at,
        claims: if extra { vec![format!("{name}-gpu")] } else { vec![] },
        devices: vec![],
    }
}

fn journal(state: State, since: i64, pods: Vec<PlannedPod>, claims: &[&str]) -> Journal {
    Journal {
        state,
        since,
        pods,
        claims: claims.iter().map(|c| c.to_string()).collect(),
        released_at: Some(0),
        reuse_reservation: false,
        retired: vec![],
        cause: None,
        topology_value: None,
        nodes: vec!["n1".into()],
        devices: 1,
        vacancies: vec![],
    }
}

fn pod(name: &str, uid: &str, attempt: Option<i32>, gated: bool, phase: Phase, bound: bool) -> PodView {
    PodView {
        name: name.into(),
        uid: uid.into(),
        group: Some("w".into()),
        index: None,
        attempt,
        gated,
        phase,
        node: bound.then(|| "n1".to_string()),
        deleting: false,
        message: None,
        failure_kind: None,
        exit_codes: vec![],
        conditions: vec![],
        unscheduled: None,
        owned: false,
    }
}

/// A claim muster allocated; `reserved_for` holds uids, those starting with `outside`
/// are pods the operator knows outside the gang.
fn claim(name: &str, allocated: bool, reserved_for: &[&str]) -> ClaimView {
    ClaimView {
        name: name.into(),
        allocated,
        ours: true,
        held_elsewhere: false,
        devices: vec![format!("gpu/n1/{name}")],
        used_by: Vec::new(),
        protected: false,
        reserved_for: reserved_for
            .iter()
            .map(|u| Consumer {
                name: format!("pod-{u}"),
                uid: u.to_string(),
                known_outside: u.starts_with("outside"),
            })
            .collect(),
    }
}

fn step(spec: &Spec, journal: &Journal, restarts: i32, pods: &[PodView], claims: &[ClaimView], now: i64) -> Step {
    step_remembering(spec, journal, restarts, pods, claims, &[], now)
}

fn step_remembering(
    spec: &Spec,
    journal: &Journal,
    restarts: i32,
    pods: &[PodView],
    claims: &[ClaimView],
    refusals: &[Refusal],
    now: i64,
) -> Step {
    let nodes: BTreeMap<String, NodeHealth> = [("n1".to_string(), NodeHealth::Ready)].into();
    let gang = Gang {
        spec,
        journal: Some(journal),
        restarts,
        counted_restarts: 0,
        finished_at: None,
        pods,
        claims,
        nodes: &nodes,
        devices_published: true,
        reuse_problems: Some(&[]),
        conflicted: &[],
        refusals,
        owners: Owners::default(),
        now,
    };
    decide(&gang, &SETTINGS)
}

fn recorded_state(step: &Step) -> Option<Option<State>> {
    step.record().map(|r| r.journal.as_ref().map(|j| j.state))
}

fn deallocates(step: &Step) -> Vec<String> {
    step.effects
        .iter()
        .flat_map(|e| match e {
            Effect::Deallocate { claims, .. } => claims.clone(),
            _ => vec![],
        })
        .collect()
}

#[test]
fn an_extra_released_long_after_the_gang_does_not_tear_it_down() {
    // Admitted at 0; an extra released at 500 s, still waiting for the scheduler at 501 s.
    let j = journal(
        State::Released,
        0,
        vec![planned("g-w-0", false, Some(0)), planned("g-w-1", true, Some(500_000))],
        &["g-w-0-gpu", "g-w-1-gpu"],
    );
    let pods = [
        pod("g-w-0", "u0", Some(0), false, Phase::Running, true),
        pod("g-w-1", "u1", Some(0), false, Phase::Pending, false),
    ];
    let s = step(&spec(1, true), &j, 0, &pods, &[], 501_000);
    assert_eq!(recorded_state(&s), None, "{s:?}");
    assert_eq!(s.recheck_in, Some(119_000));
    // Past its own timeout the extra alone is dropped, not the gang.
    let s = step(&spec(1, true), &j, 0, &pods, &[], 621_000);
    let record = s.record().expect("a record");
    let kept = record.journal.as_ref().expect("journal");
    assert_eq!(kept.state, State::Released);
    assert_eq!(kept.planned("g-w-1").and_then(|p| p.released_at), None);
}

/// Issue 23: a claim whose pods have all succeeded is given back while the gang runs on
/// (kube-controller-manager rewrites an allocated claim of an ended pod in a loop), one
/// still used by a running pod, shared with a pod outside, or not muster's, is not.
#[test]
fn a_claim_whose_pods_all_succeeded_is_given_back_while_the_gang_runs_on() {
    let j = journal(
        State::Released,
        0,
        vec![planned("g-w-0", false, Some(0)), planned("g-w-1", false, Some(0))],
        &["g-w-0-gpu", "g-w-1-gpu", "g-shared", "g-outside", "g-foreign"],
    );
    let pods = [
        pod("g-w-0", "u0", Some(0), false, Phase::Succeeded, true),
        pod("g-w-1", "u1", Some(0), false, Phase::Running, true),
    ];
    let used = |mut c: ClaimView, by: &[&str]| {
        c.used_by = by.iter().map(|u| u.to_string()).collect();
        c
    };
    let mut foreign = used(claim("g-foreign", true, &["u0"]), &["u0"]);
    foreign.ours = false;
    let claims = [
        used(claim("g-w-0-gpu", true, &["u0"]), &["u0"]),
        used(claim("g-w-1-gpu", true, &["u1"]), &["u1"]),
        used(claim("g-shared", true, &["u0", "u1"]), &["u0", "u1"]),
        used(claim("g-outside", true, &["u0", "outside-pod"]), &["u0"]),
        foreign,
    ];
    let s = step(&spec(2, true), &j, 0, &pods, &claims, 1000);
    assert_eq!(recorded_state(&s), None, "the gang runs on: {s:?}");
    assert_eq!(deallocates(&s), vec!["g-w-0-gpu".to_string()]);
    // The storm's other half: kube-controller-manager has just taken the ended pod out.
    let claims = [used(claim("g-w-0-gpu", true, &[]), &["u0"])];
    let s = step(&spec(2, true), &j, 0, &pods, &claims, 1000);
    assert_eq!(deallocates(&s), vec!["g-w-0-gpu".to_string()]);
    // Given back: nothing more to do.
    let claims = [used(claim("g-w-0-gpu", false, &[]), &["u0"])];
    let s = step(&spec(2, true), &j, 0, &pods, &claims, 1000);
    assert!(deallocates(&s).is_empty(), "{s:?}");
}

/// Issue 23 review: a claim with kube-controller-manager's delete-protection goes with
/// its pods: a restart never counts on it (the spec may have allowed restarts only after
/// the commit), and muster leaves its deallocation to kube-controller-manager while an
/// ended pod is still listed for it to take out.
#[test]
fn a_protected_claim_is_neither_restarted_onto_nor_raced_for() {
    let mut restartable = spec(1, true);
    restartable.max_restarts = 2;
    let j = journal(
        State::Released,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    let failed = pod("g-w-0", "u0", Some(0), false, Phase::Failed, true);
    let mut protected = claim("g-w-0-gpu", true, &["u0"]);
    protected.protected = true;
    let s = step(
        &restartable,
        &j,
        0,
        std::slice::from_ref(&failed),
        std::slice::from_ref(&protected),
        1000,
    );
    let restarting = s.record().and_then(|r| r.journal.as_ref()).expect("a restart");
    assert_eq!(restarting.state, State::Restarting);
    assert!(!restarting.reuse_reservation, "the claim goes with the failed pod");
    let unprotected = claim("g-w-0-gpu", true, &["u0"]);
    let s = step(&restartable, &j, 0, std::slice::from_ref(&failed), &[unprotected], 1000);
    let restarting = s.record().and_then(|r| r.journal.as_ref()).expect("a restart");
    assert!(restarting.reuse_reservation);

    // Spent: listed, it is kube-controller-manager's to deallocate; unlisted, muster's.
    let two = journal(
        State::Released,
        0,
        vec![planned("g-w-0", false, Some(0)), planned("g-w-1", false, Some(0))],
        &["g-w-0-gpu"],
    );
    let pods = [
        pod("g-w-0", "u0", Some(0), false, Phase::Succeeded, true),
        pod("g-w-1", "u1", Some(0), false, Phase::Running, true),
    ];
    protected.used_by = vec!["u0".into()];
    let s = step(&spec(2, true), &two, 0, &pods, std::slice::from_ref(&protected), 1000);
    assert!(deallocates(&s).is_empty(), "{s:?}");
    protected.reserved_for.clear();
    let s = step(&spec(2, true), &two, 0, &pods, &[protected], 1000);
    assert_eq!(deallocates(&s), vec!["g-w-0-gpu".to_string()]);
}

#[test]
fn a_claim_reserved_by_a_pod_outside_the_gang_is_left_to_it() {
    let j = journal(
        State::Finishing,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-shared"],
    );
    let pods = [pod("g-w-0", "u0", Some(0), false, Phase::Succeeded, true)];
    let claims = [claim("g-shared", true, &["u0", "outside-pod"])];
    let s = step(&spec(1, true), &j, 0, &pods, &claims, 1000);
    assert!(deallocates(&s).is_empty(), "{s:?}");
    assert_eq!(
        recorded_state(&s),
        Some(Some(State::Finished)),
        "the gang lets go of the claim the outside pod uses, and finishes"
    );
    // Only the gang's finished pod reserves it: the gang gives it back.
    let claims = [claim("g-shared", true, &["u0"])];
    let s = step(&spec(1, true), &j, 0, &pods, &claims, 1000);
    assert_eq!(deallocates(&s), vec!["g-shared".to_string()]);
}

#[test]
fn a_claim_another_gang_holds_is_let_go_as_it_is() {
    let j = journal(
        State::TearingDown,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu", "shared"],
    );
    let mut shared = claim("shared", true, &[]);
    shared.held_elsewhere = true;
    let claims = [claim("g-w-0-gpu", true, &[]), shared.clone()];
    let s = step(&spec(1, true), &j, 0, &[], &claims, 1000);
    assert_eq!(deallocates(&s), vec!["g-w-0-gpu".to_string()], "only its own claim");
    let claims = [claim("g-w-0-gpu", false, &[]), shared];
    let s = step(&spec(1, true), &j, 0, &[], &claims, 2000);
    assert_eq!(
        recorded_state(&s),
        Some(None),
        "queued, the shared claim left to its other holder"
    );
}

#[test]
fn an_allocation_muster_did_not_write_is_never_cleared() {
    let j = journal(
        State::TearingDown,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["users"],
    );
    let mut users = claim("users", true, &[]);
    users.ours = false;
    let s = step(&spec(1, true), &j, 0, &[], &[users], 1000);
    assert!(deallocates(&s).is_empty(), "{s:?}");
    assert_eq!(recorded_state(&s), Some(None));
}

#[test]
fn a_pod_still_behind_the_gate_does_not_keep_a_claim() {
    // A reservation the commit wrote for pods that were never released.
    let j = journal(State::Reserving, 0, vec![planned("g-w-0", false, None)], &["g-w-0-gpu"]);
    let pods = [pod("g-w-0", "u0", Some(0), true, Phase::Pending, false)];
    let claims = [claim("g-w-0-gpu", true, &["u0"])];
    let s = step(&spec(1, true), &j, 0, &pods, &claims, 1000);
    assert_eq!(deallocates(&s), vec!["g-w-0-gpu".to_string()]);
    let idle = s.effects.iter().find_map(|e| match e {
        Effect::Deallocate { idle, .. } => Some(idle.clone()),
        _ => None,
    });
    assert_eq!(idle, Some(vec!["u0".to_string()]));
}

#[test]
fn pods_being_deleted_keep_their_devices() {
    let j = journal(
        State::TearingDown,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    let mut terminating = pod("g-w-0", "u0", Some(0), false, Phase::Running, true);
    terminating.deleting = true;
    let claims = [claim("g-w-0-gpu", true, &["u0"])];
    let s = step(&spec(1, true), &j, 0, &[terminating], &claims, 1000);
    assert!(s.effects.is_empty(), "waits for the pod to be gone: {s:?}");
}

#[test]
fn suspend_is_recorded_first_and_a_quick_resume_fails_nothing() {
    let j = journal(
        State::Released,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    let running = pod("g-w-0", "u0", Some(0), false, Phase::Running, true);
    let mut suspended = spec(1, true);
    suspended.suspend = true;
    let claims = [claim("g-w-0-gpu", true, &["u0"])];
    let s = step(&suspended, &j, 0, std::slice::from_ref(&running), &claims, 1000);
    assert_eq!(recorded_state(&s), Some(Some(State::Suspending)));

    // Resumed while the pod still terminates: the suspension finishes, nothing failed.
    let suspending = journal(State::Suspending, 1000, j.pods.clone(), &["g-w-0-gpu"]);
    let mut terminating = running.clone();
    terminating.deleting = true;
    let s = step(&spec(1, true), &suspending, 0, &[terminating], &claims, 2000);
    assert!(s.effects.is_empty(), "{s:?}");
    let free = [claim("g-w-0-gpu", false, &[])];
    let s = step(&spec(1, true), &suspending, 0, &[], &free, 3000);
    let record = s.record().expect("a record");
    assert_eq!(record.journal, None);
    assert!(
        record
            .conditions
            .iter()
            .all(|c| c.type_ == ConditionType::Admitted && c.reason == Reason::Suspended)
    );
}

#[test]
fn a_gang_of_another_controllers_pods_restarts_by_uid() {
    let j = journal(
        State::Released,
        0,
        vec![planned("job-a", false, Some(0))],
        &["job-a-gpu"],
    );
    let failed = pod("job-a", "u-old", None, false, Phase::Failed, true);
    let claims = [claim("job-a-gpu", true, &["u-old"])];
    let s = step(&spec(1, false), &j, 0, std::slice::from_ref(&failed), &claims, 1000);
    let record = s.record().expect("a record");
    let restarting = record.journal.as_ref().expect("journal");
    assert_eq!(restarting.state, State::Restarting);
    assert_eq!(restarting.retired, vec!["u-old".to_string()]);
    assert!(
        !restarting.reuse_reservation,
        "other controllers' claims go with their pods"
    );
    assert_eq!(record.restarts.map(|r| r.total), Some(1));

    // The Job's replacement (a new uid, no attempt label) is not deleted; the old one is.
    let replacement = pod("job-b", "u-new", None, true, Phase::Pending, false);
    let s = step(
        &spec(1, false),
        restarting,
        1,
        &[failed.clone(), replacement.clone()],
        &claims,
        2000,
    );
    let deleted: Vec<&str> = s
        .effects
        .iter()
        .flat_map(|e| match e {
            Effect::DeletePods { pods, .. } => pods.iter().map(|p| p.uid.as_str()).collect(),
            _ => vec![],
        })
        .collect();
    assert_eq!(deleted, vec!["u-old"]);
}

#[test]
fn a_restart_without_reuse_gives_the_claims_back_before_it_forgets_them() {
    let mut j = journal(
        State::Restarting,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    j.retired = vec!["u0".into()];
    let claims = [claim("g-w-0-gpu", true, &[])];
    let s = step(&spec(1, true), &j, 1, &[], &claims, 1000);
    assert_eq!(deallocates(&s), vec!["g-w-0-gpu".to_string()]);
    assert_eq!(recorded_state(&s), None, "the journal stays until the claim is free");
    let s = step(&spec(1, true), &j, 1, &[], &[claim("g-w-0-gpu", false, &[])], 2000);
    assert_eq!(recorded_state(&s), Some(None));
}

#[test]
fn a_reservation_whose_pods_never_appear_is_given_back() {
    let j = journal(State::Reserved, 0, vec![planned("g-w-0", false, None)], &["g-w-0-gpu"]);
    let claims = [claim("g-w-0-gpu", true, &[])];
    let s = step(&spec(1, true), &j, 0, &[], &claims, 60_000);
    assert!(s.effects.is_empty());
    assert_eq!(s.recheck_in, Some(60_000));
    let s = step(&spec(1, true), &j, 0, &[], &claims, 120_000);
    let record = s.record().expect("a record");
    let tearing = record.journal.as_ref().expect("journal");
    assert_eq!(tearing.state, State::TearingDown);
    assert_eq!(tearing.cause.as_ref().map(|c| c.0), Some(Reason::ReleaseTimeout));
}

/// A commit releases its pods once every claim is allocated and checked, recording
/// nothing in between: a commit stopped in the middle of its release (one pod out of
/// the gate, one still behind it) is finished, and a failed one, or one that released
/// nothing, is undone.
#[test]
fn a_commit_stopped_in_its_release_is_finished_not_undone() {
    let j = journal(
        State::Reserving,
        0,
        vec![planned("g-w-0", false, None), planned("g-w-1", false, None)],
        &["g-w-0-gpu", "g-w-1-gpu"],
    );
    let claims = [claim("g-w-0-gpu", true, &["u0"]), claim("g-w-1-gpu", true, &["u1"])];
    let half = [
        pod("g-w-0", "u0", Some(0), false, Phase::Pending, false),
        pod("g-w-1", "u1", Some(0), true, Phase::Pending, false),
    ];
    let s = step(&spec(2, true), &j, 0, &half, &claims, 1000);
    assert!(deallocates(&s).is_empty(), "{s:?}");
    let released: Vec<&str> = s
        .effects
        .iter()
        .flat_map(|e| match e {
            Effect::Release { pods } => pods.iter().map(|p| p.pod.name.as_str()).collect(),
            _ => vec![],
        })
        .collect();
    assert_eq!(released, ["g-w-1"], "the rest is released: {s:?}");

    let all = [
        pod("g-w-0", "u0", Some(0), false, Phase::Pending, false),
        pod("g-w-1", "u1", Some(0), false, Phase::Pending, false),
    ];
    let s = step(&spec(2, true), &j, 0, &all, &claims, 1000);
    assert_eq!(recorded_state(&s), Some(Some(State::Released)), "{s:?}");

    // A claim lost before the record: taken apart as a reservation would be.
    let lost = [claim("g-w-0-gpu", true, &["u0"]), claim("g-w-1-gpu", false, &[])];
    let s = step(&spec(2, true), &j, 0, &half, &lost, 1000);
    assert_eq!(recorded_state(&s), Some(Some(State::TearingDown)), "{s:?}");

    // Nothing released: undone.
    let gated = [
        pod("g-w-0", "u0", Some(0), true, Phase::Pending, false),
        pod("g-w-1", "u1", Some(0), true, Phase::Pending, false),
    ];
    let s = step(&spec(2, true), &j, 0, &gated, &claims, 1000);
    assert_eq!(deallocates(&s).len(), 2, "{s:?}");

    // A commit recorded as failed released nothing, whatever the pods show.
    let mut failed = j.clone();
    failed.cause = Some((Reason::Conflict, "undone".into()));
    let s = step(&spec(2, true), &failed, 0, &half, &claims, 1000);
    assert!(s.effects.iter().all(|e| !matches!(e, Effect::Release { .. })), "{s:?}");
}

#[test]
fn an_interrupted_commit_is_undone_even_when_suspended() {
    let j = journal(State::Reserving, 0, vec![planned("g-w-0", false, None)], &["g-w-0-gpu"]);
    let mut suspended = spec(1, true);
    suspended.suspend = true;
    let claims = [claim("g-w-0-gpu", true, &[])];
    let s = step(&suspended, &j, 0, &[], &claims, 1000);
    assert_eq!(deallocates(&s), vec!["g-w-0-gpu".to_string()]);
    assert_eq!(recorded_state(&s), None);
}

#[test]
fn pods_of_an_old_attempt_go_while_the_gang_is_queued_or_restarting() {
    let stale = pod("g-w-0", "u0", Some(0), true, Phase::Pending, false);
    let current = pod("g-w-1", "u1", Some(1), true, Phase::Pending, false);
    let nodes: BTreeMap<String, NodeHealth> = BTreeMap::new();
    let spec = spec(1, true);
    let pods = [stale.clone(), current.clone()];
    let queued = Gang {
        spec: &spec,
        journal: None,
        restarts: 1,
        counted_restarts: 0,
        finished_at: None,
        pods: &pods,
        claims: &[],
        nodes: &nodes,
        devices_published: true,
        reuse_problems: Some(&[]),
        conflicted: &[],
        refusals: &[],
        owners: Owners::default(),
        now: 0,
    };
    let s = decide(&queued, &SETTINGS);
    assert_eq!(
        s.effects,
        vec![Effect::DeletePods {
            pods: vec![stale.reference()],
            immediately: false,
            disruption: None,
        }]
    );
    // Restarting: a pod made for the old attempt after the restart was recorded goes too.
    let mut j = journal(
        State::Restarting,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    j.reuse_reservation = true;
    let s = step(&spec, &j, 1, &pods, &[claim("g-w-0-gpu", true, &[])], 1000);
    assert_eq!(recorded_state(&s), None, "{s:?}");
    assert!(matches!(&s.effects[..], [Effect::DeletePods { pods, .. }] if pods == &vec![stale.reference()]));
}

/// Found by the model with a deposed leader: its release of a pod landed after the
/// successor had given the gang back, and the queued gang could never be admitted
/// again with a released pod in it.
#[test]
fn a_queued_gangs_pod_that_no_reservation_released_goes() {
    let orphan = pod("g-w-0", "u0", Some(0), false, Phase::Succeeded, true);
    let waiting = pod("g-w-1", "u1", Some(0), true, Phase::Pending, false);
    let joined = PodView {
        attempt: None,
        ..pod("job-x", "u2", None, false, Phase::Running, true)
    };
    // A running one stays: a journal lost from outside must not kill a running gang.
    let running = pod("g-w-2", "u3", Some(0), false, Phase::Running, true);
    let nodes: BTreeMap<String, NodeHealth> = [("n1".to_string(), NodeHealth::Ready)].into();
    let spec = spec(1, true);
    let pods = [orphan.clone(), waiting, joined, running];
    let queued = Gang {
        spec: &spec,
        journal: None,
        restarts: 0,
        counted_restarts: 0,
        finished_at: None,
        pods: &pods,
        claims: &[],
        nodes: &nodes,
        devices_published: true,
        reuse_problems: Some(&[]),
        conflicted: &[],
        refusals: &[],
        owners: Owners::default(),
        now: 0,
    };
    // Only muster's own released pod that is not running goes: not the gated one, not
    // another controller's.
    assert_eq!(
        decide(&queued, &SETTINGS).effects,
        vec![Effect::DeletePods {
            pods: vec![orphan.reference()],
            immediately: false,
            disruption: None,
        }]
    );
}

#[test]
fn a_released_gang_whose_device_another_claim_also_holds_gives_way() {
    let j = journal(
        State::Released,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    let pods = [pod("g-w-0", "u0", Some(0), false, Phase::Running, true)];
    let claims = [claim("g-w-0-gpu", true, &["u0"])];
    let nodes: BTreeMap<String, NodeHealth> = [("n1".to_string(), NodeHealth::Ready)].into();
    let conflicted = vec!["g-w-0-gpu".to_string()];
    let spec = spec(1, true);
    let gang = Gang {
        spec: &spec,
        journal: Some(&j),
        restarts: 0,
        counted_restarts: 0,
        finished_at: None,
        pods: &pods,
        claims: &claims,
        nodes: &nodes,
        devices_published: true,
        reuse_problems: Some(&[]),
        conflicted: &conflicted,
        refusals: &[],
        owners: Owners::default(),
        now: 1000,
    };
    let s = decide(&gang, &SETTINGS);
    let record = s.record().expect("a record");
    let tearing = record.journal.as_ref().expect("journal");
    assert_eq!(tearing.state, State::TearingDown);
    assert_eq!(tearing.cause.as_ref().map(|c| c.0), Some(Reason::Conflict));
}

#[test]
fn a_preempted_gang_is_taken_apart_like_any_teardown_and_queued_saying_why() {
    let mut j = journal(
        State::TearingDown,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    j.cause = Some((Reason::Preempted, "preempted by ns/high".into()));
    let running = pod("g-w-0", "u0", Some(0), false, Phase::Running, true);
    let claims = [claim("g-w-0-gpu", true, &["u0"])];
    let s = step(&spec(1, true), &j, 0, std::slice::from_ref(&running), &claims, 1000);
    assert!(
        matches!(&s.effects[..], [Effect::DeletePods { immediately: false, .. }]),
        "its pods go first, with their grace period: {s:?}"
    );

    // The pod is gone, and no longer reserves the claim.
    let s = step(&spec(1, true), &j, 0, &[], &[claim("g-w-0-gpu", true, &[])], 2000);
    assert_eq!(deallocates(&s), vec!["g-w-0-gpu".to_string()]);

    let s = step(&spec(1, true), &j, 0, &[], &[claim("g-w-0-gpu", false, &[])], 3000);
    assert_eq!(recorded_state(&s), Some(None), "queued again");
    let admitted = &s.record().expect("a record").conditions[0];
    assert_eq!(
        (admitted.type_, admitted.status, admitted.reason),
        (ConditionType::Admitted, false, Reason::Preempted)
    );
    assert_eq!(admitted.message, "preempted by ns/high");
}

/// A released gang of one pod, `restarts` restarts made and `counted` of them counted,
/// whose pod has just failed with `failed`'s exit codes and conditions.
fn failed_step(spec: &Spec, restarts: i32, counted: i32, failed: PodView) -> Step {
    failed_step_on(spec, restarts, counted, failed, NodeHealth::Ready)
}

fn failed_step_on(spec: &Spec, restarts: i32, counted: i32, failed: PodView, node: NodeHealth) -> Step {
    let j = journal(
        State::Released,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    let nodes: BTreeMap<String, NodeHealth> = match node {
        NodeHealth::Gone => BTreeMap::new(),
        health => [("n1".to_string(), health)].into(),
    };
    let pods = [failed];
    let claims = [claim("g-w-0-gpu", true, &["u0"])];
    let gang = Gang {
        spec,
        journal: Some(&j),
        restarts,
        counted_restarts: counted,
        finished_at: None,
        pods: &pods,
        claims: &claims,
        nodes: &nodes,
        devices_published: true,
        reuse_problems: Some(&[]),
        conflicted: &[],
        refusals: &[],
        owners: Owners::default(),
        now: 5000,
    };
    decide(&gang, &SETTINGS)
}

fn rule(action: failure::FailureAction) -> failure::FailureRule {
    failure::FailureRule {
        name: Some("r".into()),
        action,
        exit_codes: None,
        conditions: vec![],
        kinds: vec![],
        groups: vec![],
    }
}

#[test]
fn a_failure_rule_on_an_exit_code_fails_the_gang_at_once() {
    let mut spec = spec(1, true);
    spec.failure_rules = vec![failure::FailureRule {
        exit_codes: Some(failure::ExitCodes {
            container: None,
            within: true,
            values: vec![42],
        }),
        ..rule(failure::FailureAction::FailGang)
    }];
    let mut failed = pod("g-w-0", "u0", Some(0), false, Phase::Failed, true);
    failed.exit_codes = vec![("main".into(), 42)];
    let s = failed_step(&spec, 0, 0, failed.clone());
    let record = s.record().expect("a record");
    assert_eq!(recorded_state(&s), Some(Some(State::Finishing)));
    assert!(
        record
            .conditions
            .iter()
            .any(|c| c.type_ == ConditionType::Failed && c.status && c.reason == Reason::FailedByRule),
        "{record:?}"
    );
    assert_eq!(record.restarts, None, "no restart was made");
    // Another code restarts as before, counting.
    failed.exit_codes = vec![("main".into(), 1)];
    let s = failed_step(&spec, 0, 0, failed);
    let record = s.record().expect("a record");
    assert_eq!(recorded_state(&s), Some(Some(State::Restarting)));
    assert_eq!(record.restarts, Some(Restarts { total: 1, counted: 1 }));
}

#[test]
fn a_disruption_restarts_without_counting_even_with_no_restarts_left() {
    let mut spec = spec(1, true);
    spec.failure_rules = vec![failure::FailureRule {
        conditions: vec![("DisruptionTarget".into(), "True".into())],
        ..rule(failure::FailureAction::RestartUncounted)
    }];
    let mut evicted = pod("g-w-0", "u0", Some(3), false, Phase::Failed, true);
    evicted.conditions = vec![("DisruptionTarget".into(), "True".into())];
    // maxRestarts 3, all three used: a disruption still restarts, and is not counted.
    let s = failed_step(&spec, 3, 3, evicted);
    let record = s.record().expect("a record");
    assert_eq!(recorded_state(&s), Some(Some(State::Restarting)), "{s:?}");
    assert_eq!(record.restarts, Some(Restarts { total: 4, counted: 3 }));
    // An application failure then fails the gang: its restarts are used up.
    let s = failed_step(&spec, 4, 3, pod("g-w-0", "u0", Some(4), false, Phase::Failed, true));
    let record = s.record().expect("a record");
    assert_eq!(recorded_state(&s), Some(Some(State::Finishing)));
    assert!(
        record
            .conditions
            .iter()
            .any(|c| c.reason == Reason::MaxRestartsExceeded)
    );
}

#[test]
fn a_pod_deleted_with_its_node_gone_lost_its_node_and_a_failed_pod_failed_first() {
    let mut spec = spec(1, true);
    spec.failure_rules = vec![
        failure::FailureRule {
            kinds: vec![failure::FailureKind::NodeLost],
            ..rule(failure::FailureAction::RestartUncounted)
        },
        failure::FailureRule {
            kinds: vec![failure::FailureKind::PodFailed],
            ..rule(failure::FailureAction::FailGang)
        },
    ];
    // Deleted by the taint manager or pod garbage collection once its node went away.
    let mut deleted = pod("g-w-0", "u0", Some(0), false, Phase::Running, true);
    deleted.deleting = true;
    let s = failed_step_on(&spec, 0, 0, deleted, NodeHealth::Gone);
    assert_eq!(recorded_state(&s), Some(Some(State::Restarting)), "{s:?}");
    assert_eq!(s.record().unwrap().restarts, Some(Restarts { total: 1, counted: 0 }));
    // A failed pod being deleted on a healthy node failed: the PodFailed rule applies.
    let mut failed = pod("g-w-0", "u0", Some(0), false, Phase::Failed, true);
    failed.deleting = true;
    let s = failed_step(&spec, 0, 0, failed);
    assert_eq!(recorded_state(&s), Some(Some(State::Finishing)), "{s:?}");
}

#[test]
fn a_restart_waits_its_backoff_from_the_failure_holding_the_reservation() {
    let mut spec = spec(1, true);
    spec.restart_backoff = Some(failure::Backoff {
        initial: 10_000,
        max: 60_000,
    });
    let mut j = journal(
        State::Restarting,
        100_000,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    j.retired = vec!["u0".into()];
    j.reuse_reservation = true;
    let claims = [claim("g-w-0-gpu", true, &[])];
    // The second restart (attempt 2) waits 20 s from the failure at 100 s (and a second
    // more: the recorded time has whole seconds).
    let s = step(&spec, &j, 2, &[], &claims, 105_000);
    assert!(s.effects.is_empty(), "{s:?}");
    assert_eq!(s.recheck_in, Some(16_000));
    let s = step(&spec, &j, 2, &[], &claims, 121_000);
    assert_eq!(recorded_state(&s), Some(Some(State::Reserved)), "{s:?}");
    assert!(deallocates(&s).is_empty(), "the reservation is reused");
}

fn unscheduled(mut pod: PodView, reason: &str, message: &str, nominated: bool) -> PodView {
    pod.unscheduled = Some(Unscheduled {
        reason: reason.into(),
        message: message.into(),
        nominated,
        since: None,
    });
    pod
}

const REFUSED: &str = "0/3 nodes are available: 1 node(s) had untolerated taint {gpu: broken}.";

/// Issue 21, item 3: a released pod kube-scheduler refuses takes the gang apart within
/// the grace, not after the schedule timeout: the intent (TearingDown, its cause quoting
/// kube-scheduler) and the refusal to remember go in one write; the teardown's undo then
/// runs as for any other cause, and the gang is queued saying why.
#[test]
fn a_refused_pod_takes_the_gang_apart_at_once_and_is_remembered_with_the_intent() {
    let j = journal(
        State::Released,
        0,
        vec![planned("g-w-0", false, Some(0)), planned("g-w-1", false, Some(0))],
        &["g-w-0-gpu", "g-w-1-gpu"],
    );
    let pods = [
        unscheduled(
            pod("g-w-0", "u0", Some(0), false, Phase::Pending, false),
            "Unschedulable",
            REFUSED,
            false,
        ),
        pod("g-w-1", "u1", Some(0), false, Phase::Running, true),
    ];
    // Within the grace: only a look again when it is over.
    let s = step(&spec(2, true), &j, 0, &pods, &[], 2_000);
    assert_eq!(recorded_state(&s), None, "{s:?}");
    assert_eq!(s.recheck_in, Some(3_000));
    // Past it: taken apart, long before the 120 s schedule timeout.
    let s = step(&spec(2, true), &j, 0, &pods, &[], 5_000);
    assert_eq!(recorded_state(&s), Some(Some(State::TearingDown)), "{s:?}");
    let record = s.record().expect("a record");
    let cause = record.journal.as_ref().and_then(|j| j.cause.clone()).expect("a cause");
    assert_eq!(cause.0, Reason::SchedulerRefused);
    assert!(
        cause.1.contains("untolerated taint {gpu: broken}") && cause.1.contains("g-w-0"),
        "{}",
        cause.1
    );
    let condition = &record.conditions[0];
    assert_eq!(
        (condition.type_, condition.status, condition.reason),
        (ConditionType::Admitted, false, Reason::SchedulerRefused)
    );
    assert!(
        condition.message.contains(REFUSED.trim_end_matches('.')),
        "{}",
        condition.message
    );
    let remembered = record.refusals.clone().expect("refusals recorded with the intent");
    assert_eq!(remembered.len(), 1);
    assert_eq!(
        (
            remembered[0].group.as_deref(),
            remembered[0].pod.as_str(),
            remembered[0].node.as_str(),
            remembered[0].at
        ),
        (Some("w"), "g-w-0", "n1", 5_000)
    );

    // The undo: released pods go (the bound one too), then the claims, then it is queued
    // with the cause read back.
    let mut tearing = record.journal.clone().expect("journal");
    tearing.since = 5_000;
    let s = step(&spec(2, true), &tearing, 0, &pods, &[], 5_100);
    let deleted: Vec<String> = s
        .effects
        .iter()
        .flat_map(|e| match e {
            Effect::DeletePods { pods, .. } => pods.iter().map(|p| p.name.clone()).collect(),
            _ => vec![],
        })
        .collect();
    assert_eq!(deleted, ["g-w-0", "g-w-1"]);
    let claims = [claim("g-w-0-gpu", true, &[]), claim("g-w-1-gpu", true, &[])];
    let s = step(&spec(2, true), &tearing, 0, &[], &claims, 5_200);
    assert_eq!(deallocates(&s), ["g-w-0-gpu", "g-w-1-gpu"]);
    let s = step(&spec(2, true), &tearing, 0, &[], &[], 5_300);
    let record = s.record().expect("queued");
    assert_eq!(record.journal, None);
    assert_eq!(record.conditions[0].reason, Reason::SchedulerRefused);
    assert_eq!(record.refusals, None, "the queueing write keeps what was remembered");
}

/// A pod that merely waits is no refusal: still marked SchedulingGated (kube-scheduler
/// has not tried it yet), without the condition, or with a nominated node (it preempts
/// for it). Such a gang waits for the schedule timeout as before.
#[test]
fn a_pod_that_merely_waits_is_not_taken_for_a_refusal() {
    let j = journal(
        State::Released,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    let waiting = pod("g-w-0", "u0", Some(0), false, Phase::Pending, false);
    for pod in [
        unscheduled(
            waiting.clone(),
            "SchedulingGated",
            "Scheduling is blocked due to non-empty scheduling gates",
            false,
        ),
        waiting.clone(),
        unscheduled(waiting.clone(), "Unschedulable", REFUSED, true),
        unscheduled(waiting.clone(), "", "", false),
    ] {
        let s = step(&spec(1, true), &j, 0, std::slice::from_ref(&pod), &[], 60_000);
        assert_eq!(recorded_state(&s), None, "{pod:?}: {s:?}");
        assert_eq!(s.recheck_in, Some(60_000), "{pod:?}");
    }
    // A scheduler error (a failed API call, a plugin error) is retried by kube-scheduler:
    // the gang waits for the schedule timeout.
    let errored = unscheduled(waiting.clone(), "SchedulerError", "running PreBind plugin: boom", false);
    let s = step(&spec(1, true), &j, 0, &[errored], &[], 60_000);
    assert_eq!(recorded_state(&s), None, "{s:?}");
    // A refusal first seen late gets its own grace, counted from when it was seen.
    let mut late = unscheduled(waiting, "Unschedulable", REFUSED, false);
    late.unscheduled.as_mut().unwrap().since = Some(58_000);
    let s = step(&spec(1, true), &j, 0, std::slice::from_ref(&late), &[], 60_000);
    assert_eq!(recorded_state(&s), None, "{s:?}");
    assert_eq!(s.recheck_in, Some(3_000), "{s:?}");
    let s = step(&spec(1, true), &j, 0, &[late], &[], 63_000);
    assert_eq!(recorded_state(&s), Some(Some(State::TearingDown)), "{s:?}");
}

/// An extra kube-scheduler refuses is dropped at once (the gang runs on) and remembered.
#[test]
fn a_refused_extra_is_dropped_at_once_and_remembered() {
    let j = journal(
        State::Released,
        0,
        vec![planned("g-w-0", false, Some(0)), planned("g-w-1", true, Some(10_000))],
        &["g-w-0-gpu", "g-w-1-gpu"],
    );
    let pods = [
        pod("g-w-0", "u0", Some(0), false, Phase::Running, true),
        unscheduled(
            pod("g-w-1", "u1", Some(0), false, Phase::Pending, false),
            "Unschedulable",
            REFUSED,
            false,
        ),
    ];
    let s = step(&spec(1, true), &j, 0, &pods, &[], 12_000);
    assert_eq!(recorded_state(&s), None, "within the extra's own grace: {s:?}");
    let s = step(&spec(1, true), &j, 0, &pods, &[], 15_000);
    let record = s.record().expect("a record");
    let kept = record.journal.as_ref().expect("journal");
    assert_eq!(kept.state, State::Released);
    assert_eq!(kept.planned("g-w-1").and_then(|p| p.released_at), None);
    let remembered = record.refusals.clone().expect("remembered");
    assert_eq!(remembered[0].pod, "g-w-1");
}

/// What a gang remembers: one refusal per (group, node), the newest; none older than
/// the memory; at most a bounded number.
#[test]
fn refusals_are_remembered_for_a_while_one_per_group_and_node() {
    let at = |node: &str, at: i64| Refusal {
        group: Some("w".into()),
        pod: "g-w-0".into(),
        node: node.into(),
        message: "refused".into(),
        at,
    };
    let known = vec![at("n1", 0), at("n2", 10_000)];
    let now = refusal::MEMORY + 5_000;
    let kept = refusal::remember(&known, vec![at("n2", now)], now);
    assert_eq!(kept, vec![at("n2", now)], "n1 lapsed; n2 once, the newest");
    let many: Vec<Refusal> = (0..40).map(|i| at(&format!("n{i}"), now)).collect();
    let kept = refusal::remember(&[], many, now);
    assert_eq!(kept.len(), refusal::KEPT);
    assert_eq!(kept.last().map(|r| r.node.as_str()), Some("n39"));
    // A refusal keeps its group off the node for the memory, not longer.
    assert!(at("n1", 0).active(refusal::MEMORY - 1));
    assert!(!at("n1", 0).active(refusal::MEMORY));
}

/// Review of issue 22: a pod of the gang that is gone while kube-controller-manager has
/// not yet taken its uid out of `reservedFor` is still the gang's own, not a consumer
/// outside it: the gang neither lets go of the claim (it would stay allocated for no
/// one while the gang is queued again) nor clears it under the pod, but waits.
#[test]
fn issue22_review_a_deleted_pod_of_the_gang_is_no_consumer_outside_it() {
    let j = journal(
        State::TearingDown,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    // The entry names the gang's planned pod (gone from the caches), not a stranger.
    let mut own = claim("g-w-0-gpu", true, &["u0"]);
    own.reserved_for[0].name = "g-w-0".into();
    let claims = [own];
    let s = step(&spec(1, true), &j, 0, &[], &claims, 1000);
    assert_eq!(recorded_state(&s), None, "the gang keeps naming its claim: {s:?}");
    assert!(deallocates(&s).is_empty(), "{s:?}");

    // The same after a restart: the retired attempt's pod is gone, its uid stays.
    let mut restarting = journal(
        State::Restarting,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    restarting.retired = vec!["u0".into()];
    let s = step(&spec(1, true), &restarting, 1, &[], &claims, 1000);
    assert_eq!(recorded_state(&s), None, "{s:?}");
    assert!(deallocates(&s).is_empty(), "{s:?}");

    // Once the uid leaves `reservedFor`, the claim is given back, then forgotten.
    let s = step(&spec(1, true), &j, 0, &[], &[claim("g-w-0-gpu", true, &[])], 2000);
    assert_eq!(deallocates(&s), vec!["g-w-0-gpu".to_string()]);
}

/// Review of issue 22: a consumer the caches cannot place (a pod not seen yet, or one
/// that is gone) is never someone the gang may leave its claim to, nor one it may clear
/// the claim under: the gang holds the claim until the caches tell.
#[test]
fn issue22_review_an_unknown_consumer_keeps_the_claim_held() {
    let j = journal(
        State::TearingDown,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    for reserved in [&["stranger"][..], &["stranger", "outside-pod"][..]] {
        let s = step(&spec(1, true), &j, 0, &[], &[claim("g-w-0-gpu", true, reserved)], 1000);
        assert!(s.effects.is_empty(), "{reserved:?}: {s:?}");
    }
    // Known to be outside the gang, and nothing else: left to it.
    let s = step(
        &spec(1, true),
        &j,
        0,
        &[],
        &[claim("g-w-0-gpu", true, &["outside-pod"])],
        1000,
    );
    assert_eq!(recorded_state(&s), Some(None), "{s:?}");
    // A pod of the gang made again under the same name: the old entry is the gang's.
    let mut old = claim("g-w-0-gpu", true, &["u-old"]);
    old.reserved_for[0].name = "g-w-0".into();
    let s = step(&spec(1, true), &j, 0, &[], &[old], 1000);
    assert!(s.effects.is_empty(), "{s:?}");
}

fn replaced_by_controller(min_count: i32) -> Spec {
    Spec {
        groups: vec![GroupSpec {
            name: "w".into(),
            min_count,
            managed: false,
        }],
        max_restarts: 0,
        restarted_by_pod_controller: true,
        ..spec(min_count, false)
    }
}

fn deletes(step: &Step) -> usize {
    step.effects
        .iter()
        .filter(|e| matches!(e, Effect::DeletePods { .. }))
        .count()
}

/// Issue 20: where the pods' controller restarts them, a failed core pod neither
/// restarts nor fails the gang, and muster deletes nothing: the pod's place is vacated
/// (recorded), its claims are given back once it ended, and then it leaves the journal,
/// while the other pods run on.
#[test]
fn a_failed_pod_that_its_controller_replaces_leaves_its_place_and_nothing_is_deleted() {
    let spec = replaced_by_controller(2);
    let j = journal(
        State::Released,
        0,
        vec![planned("job-0", false, Some(0)), planned("job-1", false, Some(0))],
        &["job-0-gpu", "job-1-gpu"],
    );
    let pods = [
        pod("job-0", "u0", None, false, Phase::Failed, true),
        pod("job-1", "u1", None, false, Phase::Running, true),
    ];
    let used = |mut c: ClaimView, by: &str| {
        c.used_by = vec![by.to_string()];
        c
    };
    let claims = [
        used(claim("job-0-gpu", true, &["u0"]), "u0"),
        used(claim("job-1-gpu", true, &["u1"]), "u1"),
    ];
    // 1. The place is marked as leaving; nothing is deleted, the gang stays Released.
    let s = step(&spec, &j, 0, &pods, &claims, 1000);
    assert_eq!(deletes(&s), 0, "{s:?}");
    let leaving = s.record().and_then(|r| r.journal.clone()).expect("a journal");
    assert_eq!(leaving.state, State::Released);
    assert_eq!(leaving.planned("job-0").and_then(|p| p.released_at), None);
    assert_eq!(leaving.planned("job-1").and_then(|p| p.released_at), Some(0));
    // 2. The failed pod's claim is given back, the running pod's is not.
    let s = step(&spec, &leaving, 0, &pods, &claims, 2000);
    assert_eq!(deletes(&s), 0, "{s:?}");
    assert_eq!(deallocates(&s), vec!["job-0-gpu".to_string()]);
    // 3. Once it is free, the entry and its claim leave the journal.
    let claims = [
        used(claim("job-0-gpu", false, &[]), "u0"),
        used(claim("job-1-gpu", true, &["u1"]), "u1"),
    ];
    let s = step(&spec, &leaving, 0, &pods, &claims, 3000);
    let kept = s.record().and_then(|r| r.journal.clone()).expect("a journal");
    assert_eq!(kept.state, State::Released);
    assert_eq!(kept.pods.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["job-1"]);
    assert_eq!(kept.claims, ["job-1-gpu"]);
    // 4. Then the gang just runs; the replaced failed pod does not stop its success.
    let done = [
        pod("job-0", "u0", None, false, Phase::Failed, true),
        pod("job-1", "u1", None, false, Phase::Succeeded, true),
        pod("job-0-again", "u2", None, false, Phase::Succeeded, true),
    ];
    let mut refilled = kept.clone();
    refilled.pods.push(planned("job-0-again", false, Some(4000)));
    let s = step(&spec, &refilled, 0, &done, &[], 5000);
    assert_eq!(recorded_state(&s), Some(Some(State::Finishing)), "{s:?}");
}

/// Issue 20: all pods gone at once (a JobSet restarting its Jobs): each place is
/// vacated only after its pod is gone, and a pod still stopping keeps its claim.
#[test]
fn pods_being_deleted_by_their_controller_keep_their_places_until_they_are_gone() {
    let spec = replaced_by_controller(1);
    let j = journal(State::Released, 0, vec![planned("js-0", false, Some(0))], &["js-0-gpu"]);
    let mut stopping = pod("js-0", "u0", None, false, Phase::Running, true);
    stopping.deleting = true;
    let mut c = claim("js-0-gpu", true, &["u0"]);
    c.used_by = vec!["u0".into()];
    let s = step(
        &spec,
        &j,
        0,
        std::slice::from_ref(&stopping),
        std::slice::from_ref(&c),
        1000,
    );
    let leaving = s.record().and_then(|r| r.journal.clone()).expect("a journal");
    assert_eq!(deletes(&s), 0);
    let s = step(
        &spec,
        &leaving,
        0,
        std::slice::from_ref(&stopping),
        std::slice::from_ref(&c),
        2000,
    );
    assert!(
        s.record().is_none() && deallocates(&s).is_empty(),
        "still stopping: {s:?}"
    );
    // Gone, its claim deleted with it: the place is free.
    let s = step(&spec, &leaving, 0, &[], &[], 3000);
    let kept = s.record().and_then(|r| r.journal.clone()).expect("a journal");
    assert!(kept.pods.is_empty() && kept.claims.is_empty(), "{kept:?}");
    assert_eq!(kept.state, State::Released);
}

/// Issue 20: the job's own end ends the gang, as the job says.
#[test]
fn the_end_its_controller_reports_ends_the_gang() {
    let mut spec = replaced_by_controller(1);
    spec.job_ended = Some(muster_admission::JobEnd {
        succeeded: false,
        message: "the JobSet failed: reached max restarts".into(),
    });
    let j = journal(State::Released, 0, vec![planned("js-0", false, Some(0))], &[]);
    let pods = [pod("js-0", "u0", None, false, Phase::Running, true)];
    let s = step(&spec, &j, 0, &pods, &[], 1000);
    let record = s.record().expect("a record");
    assert_eq!(record.journal.as_ref().map(|j| j.state), Some(State::Finishing));
    assert!(
        record
            .conditions
            .iter()
            .any(|c| c.reason == Reason::JobFailed && c.message.contains("max restarts")),
        "{record:?}"
    );
}

/// Review of issue 20: a job that ended before its gang was placed finishes the gang at
/// once; nothing is ever placed for it.
#[test]
fn a_job_that_ended_before_its_gang_was_placed_finishes_it() {
    let mut spec = replaced_by_controller(1);
    spec.job_ended = Some(muster_admission::JobEnd {
        succeeded: false,
        message: "the JobSet failed: deadline exceeded".into(),
    });
    let nodes = BTreeMap::new();
    let gang = Gang {
        spec: &spec,
        journal: None,
        restarts: 0,
        counted_restarts: 0,
        finished_at: None,
        pods: &[],
        claims: &[],
        nodes: &nodes,
        devices_published: true,
        reuse_problems: Some(&[]),
        conflicted: &[],
        refusals: &[],
        owners: Owners::default(),
        now: 1000,
    };
    let s = decide(&gang, &SETTINGS);
    let record = s.record().expect("a record");
    assert_eq!(record.journal.as_ref().map(|j| j.state), Some(State::Finished));
    assert!(record.conditions.iter().any(|c| c.reason == Reason::JobFailed));
}

/// Review of issue 20: a pod marked leaving because its node was missing for a while
/// takes its place back once it shows running there; a pod that succeeded keeps its
/// place (nothing replaces it).
#[test]
fn a_pod_wrongly_taken_for_gone_takes_its_place_back_and_a_succeeded_one_keeps_it() {
    let spec = replaced_by_controller(2);
    let mut leaving = journal(
        State::Released,
        0,
        vec![planned("job-0", false, None), planned("job-1", false, Some(0))],
        &[],
    );
    leaving.released_at = Some(0);
    let pods = [
        pod("job-0", "u0", None, false, Phase::Running, true),
        pod("job-1", "u1", None, false, Phase::Succeeded, true),
    ];
    let s = step(&spec, &leaving, 0, &pods, &[], 1000);
    let restored = s.record().and_then(|r| r.journal.clone()).expect("a journal");
    assert_eq!(restored.planned("job-0").and_then(|p| p.released_at), Some(0));
    let s = step(&spec, &restored, 0, &pods, &[], 2000);
    assert!(s.record().is_none(), "the succeeded pod stays in place: {s:?}");
}

/// Review of issue 21: a restart that cannot go back onto its reservation decides so
/// once, saying why, before anything is given back; while the check is not known yet
/// it waits.
#[test]
fn a_restart_that_cannot_reuse_its_reservation_decides_once_and_says_why() {
    let mut j = journal(
        State::Restarting,
        0,
        vec![planned("g-w-0", false, Some(0))],
        &["g-w-0-gpu"],
    );
    j.reuse_reservation = true;
    let mut c = claim("g-w-0-gpu", true, &[]);
    c.used_by = vec![];
    let nodes: BTreeMap<String, NodeHealth> = [("n1".to_string(), NodeHealth::Ready)].into();
    let spec = spec(1, true);
    let problems =
        vec!["pod ns/g-w-0 on node n1: anti-affinity on kubernetes.io/hostname with running pods".to_string()];
    let decide_with = |reuse_problems: Option<&[String]>| {
        let claims = [c.clone()];
        let g = Gang {
            spec: &spec,
            journal: Some(&j),
            restarts: 1,
            counted_restarts: 1,
            finished_at: None,
            pods: &[],
            claims: &claims,
            nodes: &nodes,
            devices_published: true,
            reuse_problems,
            conflicted: &[],
            refusals: &[],
            owners: Owners::default(),
            now: 1000,
        };
        decide(&g, &SETTINGS)
    };
    let waiting = decide_with(None);
    assert!(
        waiting.effects.is_empty() && waiting.recheck_in.is_some(),
        "{waiting:?}"
    );
    let decided = decide_with(Some(&problems));
    let record = decided.record().expect("a record");
    let journal = record.journal.as_ref().expect("a journal");
    assert!(!journal.reuse_reservation && journal.state == State::Restarting);
    assert!(
        deallocates(&decided).is_empty(),
        "nothing given back before the decision is recorded"
    );
    assert!(
        decided
            .effects
            .iter()
            .any(|e| matches!(e, Effect::Event { note, .. } if note.contains("anti-affinity"))),
        "{decided:?}"
    );
    let reused = decide_with(Some(&[]));
    assert_eq!(recorded_state(&reused), Some(Some(State::Reserved)));
}

/// A gang's step with `owners`, for the tests of the owner's suspend.
fn step_with_owners(
    spec: &Spec,
    journal: Option<&Journal>,
    pods: &[PodView],
    claims: &[ClaimView],
    owners: Owners,
) -> Step {
    let nodes: BTreeMap<String, NodeHealth> = [("n1".to_string(), NodeHealth::Ready)].into();
    let gang = Gang {
        spec,
        journal,
        restarts: 0,
        counted_restarts: 0,
        finished_at: None,
        pods,
        claims,
        nodes: &nodes,
        devices_published: true,
        reuse_problems: Some(&[]),
        conflicted: &[],
        refusals: &[],
        owners,
        now: 10_000,
    };
    decide(&gang, &SETTINGS)
}

/// A pod a Job (or JobSet, TrainJob) makes.
fn owned(name: &str, uid: &str, phase: Phase) -> PodView {
    PodView {
        owned: true,
        ..pod(name, uid, None, false, phase, true)
    }
}

fn suspends_owners(step: &Step) -> bool {
    step.effects.iter().any(|e| matches!(e, Effect::SuspendOwners))
}

fn resumes_owners(step: &Step) -> bool {
    step.effects.iter().any(|e| matches!(e, Effect::ResumeOwners))
}

const MARKED: Owners = Owners {
    suspended: true,
    marked: true,
};

/// Issue 33: a preempted gang of a Job's pods suspends the Job (its controller takes the
/// pods away without counting a failure) rather than delete them; once the pods are gone
/// and the claims given back, the Job is resumed and the gang queued; its pods come
/// back behind the gate.
#[test]
fn a_teardown_suspends_the_pods_owner_waits_for_its_controller_and_resumes_it_once_queued() {
    let spec = replaced_by_controller(2);
    let mut j = journal(
        State::TearingDown,
        0,
        vec![planned("job-0", false, Some(0)), planned("job-1", false, Some(0))],
        &["job-0-gpu", "job-1-gpu"],
    );
    j.cause = Some((Reason::Preempted, "preempted by ns/high".into()));
    let pods = [
        owned("job-0", "u0", Phase::Running),
        owned("job-1", "u1", Phase::Running),
    ];
    let claims = [claim("job-0-gpu", true, &["u0"]), claim("job-1-gpu", true, &["u1"])];

    // 1. The owner is suspended; nothing is deleted.
    let s = step_with_owners(&spec, Some(&j), &pods, &claims, Owners::default());
    assert_eq!(s.effects, vec![Effect::SuspendOwners], "{s:?}");
    // 2. Suspended (as the caches show or the operator remembers): the gang waits for the
    //    owner's controller, asking nothing again.
    let s = step_with_owners(&spec, Some(&j), &pods, &claims, MARKED);
    assert!(s.effects.is_empty(), "{s:?}");
    let stopping: Vec<PodView> = pods
        .iter()
        .map(|p| PodView {
            deleting: true,
            ..p.clone()
        })
        .collect();
    let s = step_with_owners(&spec, Some(&j), &stopping, &claims, MARKED);
    assert!(s.effects.is_empty(), "{s:?}");
    // 3. The pods are gone: the claims are given back.
    let emptied = [claim("job-0-gpu", true, &[]), claim("job-1-gpu", true, &[])];
    let s = step_with_owners(&spec, Some(&j), &[], &emptied, MARKED);
    assert_eq!(deallocates(&s).len(), 2, "{s:?}");
    assert!(!resumes_owners(&s), "not while a claim is held: {s:?}");
    // 4. Everything given back: the owner is resumed, then the gang is queued.
    let free = [claim("job-0-gpu", false, &[]), claim("job-1-gpu", false, &[])];
    let s = step_with_owners(&spec, Some(&j), &[], &free, MARKED);
    assert!(matches!(s.effects[0], Effect::ResumeOwners), "{s:?}");
    assert_eq!(recorded_state(&s), Some(None), "{s:?}");
    assert_eq!(deletes(&s), 0);
}

/// A queued gang whose owner muster suspended resumes it (a restart between the two
/// writes above), also while Kueue has it evicted (the pods wait at the gate for Kueue),
/// but not while the Workload itself is suspended.
#[test]
fn a_queued_gang_resumes_the_owner_it_suspended_unless_the_workload_is_suspended() {
    let spec = replaced_by_controller(1);
    let s = step_with_owners(&spec, None, &[], &[], MARKED);
    assert_eq!(s.effects, vec![Effect::ResumeOwners]);
    let evicted = Spec {
        evicted: true,
        ..spec.clone()
    };
    let s = step_with_owners(&evicted, None, &[], &[], MARKED);
    assert_eq!(s.effects, vec![Effect::ResumeOwners]);
    let suspended = Spec {
        suspend: true,
        ..spec.clone()
    };
    let s = step_with_owners(&suspended, None, &[], &[], MARKED);
    assert!(s.effects.is_empty(), "{s:?}");
    let s = step_with_owners(&spec, None, &[], &[], Owners::default());
    assert!(s.effects.is_empty(), "{s:?}");
}

/// A user's suspend of the Workload suspends the owner too, and the gang stays queued
/// with the owner suspended until the Workload is resumed.
#[test]
fn a_suspended_workload_suspends_the_owner_and_keeps_it_suspended() {
    let spec = Spec {
        suspend: true,
        ..replaced_by_controller(1)
    };
    let j = journal(
        State::Suspending,
        0,
        vec![planned("job-0", false, Some(0))],
        &["job-0-gpu"],
    );
    let pods = [owned("job-0", "u0", Phase::Running)];
    let s = step_with_owners(
        &spec,
        Some(&j),
        &pods,
        &[claim("job-0-gpu", true, &["u0"])],
        Owners::default(),
    );
    assert_eq!(s.effects, vec![Effect::SuspendOwners]);
    let s = step_with_owners(&spec, Some(&j), &[], &[claim("job-0-gpu", false, &[])], MARKED);
    assert!(!resumes_owners(&s), "{s:?}");
    assert_eq!(recorded_state(&s), Some(None));
}

/// A pod its owner's controller ended stays (a suspended Job keeps what succeeded or
/// failed); it holds no device, so the teardown does not wait for it.
#[test]
fn an_owned_pod_that_ended_is_left_to_its_controller() {
    let spec = replaced_by_controller(2);
    let j = journal(
        State::TearingDown,
        0,
        vec![planned("job-0", false, Some(0)), planned("job-1", false, Some(0))],
        &["job-0-gpu"],
    );
    let pods = [
        owned("job-0", "u0", Phase::Succeeded),
        owned("job-1", "u1", Phase::Failed),
    ];
    let s = step_with_owners(
        &spec,
        Some(&j),
        &pods,
        &[claim("job-0-gpu", true, &["u0"])],
        Owners::default(),
    );
    assert!(!suspends_owners(&s), "{s:?}");
    assert_eq!(deletes(&s), 0, "{s:?}");
    assert_eq!(deallocates(&s), vec!["job-0-gpu".to_string()]);
}

/// Issue 33: pods of a controller muster cannot suspend are deleted with the
/// `DisruptionTarget` condition first, `PreemptionByMuster` for a preemption and
/// `TerminationByMuster` otherwise; muster's own pods get none.
#[test]
fn another_controllers_pods_are_marked_disrupted_before_they_go() {
    let mut j = journal(
        State::TearingDown,
        0,
        vec![planned("sts-0", false, Some(0)), planned("g-w-1", false, Some(0))],
        &[],
    );
    j.cause = Some((Reason::Preempted, "preempted by ns/high".into()));
    let pods = [
        pod("sts-0", "u0", None, false, Phase::Running, true),
        pod("g-w-1", "u1", Some(0), false, Phase::Running, true),
    ];
    let s = step_with_owners(&spec(2, false), Some(&j), &pods, &[], Owners::default());
    let mut by_disruption: Vec<(Option<Disruption>, Vec<String>)> = s
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::DeletePods { pods, disruption, .. } => {
                Some((*disruption, pods.iter().map(|p| p.name.clone()).collect()))
            }
            _ => None,
        })
        .collect();
    by_disruption.sort_by_key(|(d, _)| d.is_some());
    assert_eq!(
        by_disruption,
        vec![
            (None, vec!["g-w-1".to_string()]),
            (Some(Disruption::Preemption), vec!["sts-0".to_string()])
        ]
    );
    assert_eq!(Disruption::Preemption.reason(), "PreemptionByMuster");
    j.cause = Some((Reason::ScheduleTimeout, "late".into()));
    let s = step_with_owners(&spec(2, false), Some(&j), &pods[..1], &[], Owners::default());
    assert!(
        matches!(
            &s.effects[..],
            [Effect::DeletePods {
                disruption: Some(Disruption::Termination),
                ..
            }]
        ),
        "{s:?}"
    );
}

/// An owner suspended for the gang while it is placed (a deposed leader's suspend that
/// landed after its successor placed the gang again) is resumed.
#[test]
fn a_placed_gangs_owner_found_suspended_by_muster_is_resumed() {
    let spec = replaced_by_controller(1);
    let j = journal(
        State::Released,
        0,
        vec![planned("job-0", false, Some(0))],
        &["job-0-gpu"],
    );
    let pods = [owned("job-0", "u0", Phase::Running)];
    let s = step_with_owners(&spec, Some(&j), &pods, &[claim("job-0-gpu", true, &["u0"])], MARKED);
    assert_eq!(s.effects, vec![Effect::ResumeOwners]);
}

/// Issue 33: a vacated place is recorded in the journal (where its replacement goes back
/// to: node, devices, since when), so that it survives an operator restart; a
/// replacement not placed within the schedule timeout requeues the whole gang, which
/// then gives back every device its other members held.
#[test]
fn a_vacancy_is_recorded_and_bounds_how_long_the_gang_holds_its_other_members_devices() {
    let spec = replaced_by_controller(2);
    let j = journal(
        State::Released,
        0,
        vec![planned("job-0", false, Some(0)), planned("job-1", false, Some(0))],
        &["job-0-gpu", "job-1-gpu"],
    );
    let failed = PodView {
        index: Some(0),
        ..owned("job-0", "u0", Phase::Failed)
    };
    let pods = [failed, owned("job-1", "u1", Phase::Running)];
    let used = |mut c: ClaimView, by: &str| {
        c.used_by = vec![by.to_string()];
        c
    };
    let claims = [
        used(claim("job-0-gpu", true, &["u0"]), "u0"),
        used(claim("job-1-gpu", true, &["u1"]), "u1"),
    ];
    let s = step_with_owners(&spec, Some(&j), &pods, &claims, Owners::default());
    let leaving = s.record().and_then(|r| r.journal.clone()).expect("a journal");
    assert_eq!(leaving.vacancies.len(), 1, "{leaving:?}");
    let vacancy = &leaving.vacancies[0];
    assert_eq!(
        (
            vacancy.pod.as_str(),
            vacancy.group.as_deref(),
            vacancy.index,
            vacancy.node.as_str()
        ),
        ("job-0", Some("w"), Some(0), "n1")
    );
    assert_eq!(
        vacancy.devices,
        vec!["gpu/n1/job-0-gpu".to_string()],
        "only the leaving pod's own claim"
    );
    assert_eq!(vacancy.since, 10_000);

    // The place is given back and leaves the journal; the vacancy stays.
    let mut vacant = leaving.clone();
    vacant.pods.retain(|p| p.name != "job-0");
    vacant.claims.retain(|c| c != "job-0-gpu");
    // The Job made the replacement; it waits at the gate (it does not fit).
    let replacement = PodView {
        gated: true,
        node: None,
        phase: Phase::Pending,
        ..owned("job-0-again", "u2", Phase::Pending)
    };
    let running = [owned("job-1", "u1", Phase::Running), replacement];
    let held = [used(claim("job-1-gpu", true, &["u1"]), "u1")];
    let nodes: BTreeMap<String, NodeHealth> = [("n1".to_string(), NodeHealth::Ready)].into();
    let at = |now: i64| {
        let gang = Gang {
            spec: &spec,
            journal: Some(&vacant),
            restarts: 0,
            counted_restarts: 0,
            finished_at: None,
            pods: &running,
            claims: &held,
            nodes: &nodes,
            devices_published: true,
            reuse_problems: Some(&[]),
            conflicted: &[],
            refusals: &[],
            owners: Owners::default(),
            now,
        };
        decide(&gang, &SETTINGS)
    };
    // Within the bound: looked at again when it is due.
    let s = at(10_000 + 60_000);
    assert!(s.record().is_none(), "{s:?}");
    assert!(s.recheck_in.is_some_and(|r| r <= 60_000), "{s:?}");
    // Past it: the whole gang is requeued.
    let s = at(10_000 + SETTINGS.schedule_timeout);
    let tearing = s.record().and_then(|r| r.journal.clone()).expect("a journal");
    assert_eq!(tearing.state, State::TearingDown);
    assert_eq!(tearing.cause.map(|c| c.0), Some(Reason::ReplacementTimeout));
}

/// The replacement's commit fills its group's vacancy once it is reserved (not before:
/// a commit that stops leaves the vacancy and its bound), and a pod wrongly taken for
/// gone takes its place and its vacancy back.
#[test]
fn a_placed_replacement_fills_its_vacancy_and_a_pod_back_in_place_takes_its_own_back() {
    let mut j = journal(
        State::Released,
        0,
        vec![planned("job-1", false, Some(0))],
        &["job-1-gpu"],
    );
    j.vacancies = vec![muster_admission::Vacancy {
        pod: "job-0".into(),
        group: Some("w".into()),
        index: Some(0),
        node: "n1".into(),
        devices: vec![],
        since: 5,
    }];
    let replacement = muster_admission::commit::Placement {
        pods: vec![planned("job-0-again", false, None)],
        claims: vec!["job-0-again-gpu".into()],
        topology_value: None,
        devices: 1,
    };
    let grown = muster_admission::commit::with_extras(&j, &replacement);
    assert_eq!(
        grown.vacancies.len(),
        1,
        "still vacant while the replacement's commit runs"
    );
    let released = muster_admission::commit::extras_released(&grown, &replacement, 100);
    assert!(released.vacancies.is_empty(), "{released:?}");

    // Taken for gone while its node was missing from the cache, and back.
    let spec = replaced_by_controller(2);
    let mut leaving = journal(
        State::Released,
        0,
        vec![planned("job-0", false, None), planned("job-1", false, Some(0))],
        &["job-0-gpu", "job-1-gpu"],
    );
    leaving.vacancies = j.vacancies.clone();
    let pods = [
        owned("job-0", "u0", Phase::Running),
        owned("job-1", "u1", Phase::Running),
    ];
    let s = step_with_owners(&spec, Some(&leaving), &pods, &[], Owners::default());
    let back = s.record().and_then(|r| r.journal.clone()).expect("a journal");
    assert!(back.vacancies.is_empty(), "{back:?}");
    assert_eq!(back.planned("job-0").and_then(|p| p.released_at), Some(0));
}

/// Review of issue 33: a gang requeued past its vacancy's bound must come back whole.
/// Where a core pod succeeded (its controller does not run that index again), or the
/// controller made no replacement (an index it gave up on), the places are no longer
/// held instead, and the gang runs on.
#[test]
fn an_overdue_vacancy_the_gang_could_not_come_back_from_is_let_go_rather_than_requeued() {
    let spec = replaced_by_controller(3);
    let mut j = journal(
        State::Released,
        0,
        vec![planned("job-1", false, Some(0)), planned("job-2", false, Some(0))],
        &["job-1-gpu"],
    );
    j.vacancies = vec![muster_admission::Vacancy {
        pod: "job-0".into(),
        group: Some("w".into()),
        index: Some(0),
        node: "n1".into(),
        devices: vec!["gpu/n1/g0".into()],
        since: 0,
    }];
    let replacement = PodView {
        gated: true,
        node: None,
        ..owned("job-0-again", "u9", Phase::Pending)
    };
    let overdue = SETTINGS.schedule_timeout + 1;
    let decide_at = |pods: &[PodView]| {
        let nodes: BTreeMap<String, NodeHealth> = [("n1".to_string(), NodeHealth::Ready)].into();
        let gang = Gang {
            spec: &spec,
            journal: Some(&j),
            restarts: 0,
            counted_restarts: 0,
            finished_at: None,
            pods,
            claims: &[],
            nodes: &nodes,
            devices_published: true,
            reuse_problems: Some(&[]),
            conflicted: &[],
            refusals: &[],
            owners: Owners::default(),
            now: overdue,
        };
        decide(&gang, &SETTINGS)
    };
    // A core pod succeeded: no requeue, the hold goes.
    let s = decide_at(&[
        owned("job-1", "u1", Phase::Succeeded),
        owned("job-2", "u2", Phase::Running),
        replacement.clone(),
    ]);
    let kept = s.record().and_then(|r| r.journal.clone()).expect("a journal");
    assert_eq!(kept.state, State::Released, "{s:?}");
    assert!(kept.vacancies.is_empty());
    // No replacement was made: the hold goes too.
    let s = decide_at(&[
        owned("job-1", "u1", Phase::Running),
        owned("job-2", "u2", Phase::Running),
    ]);
    let kept = s.record().and_then(|r| r.journal.clone()).expect("a journal");
    assert_eq!((kept.state, kept.vacancies.len()), (State::Released, 0));
    // Its replacement waits and nothing succeeded: the whole gang is requeued.
    let s = decide_at(&[
        owned("job-1", "u1", Phase::Running),
        owned("job-2", "u2", Phase::Running),
        replacement,
    ]);
    assert_eq!(recorded_state(&s), Some(Some(State::TearingDown)), "{s:?}");
}

/// Review of issue 33: a teardown does not wait for ever on an owner's controller: once
/// the owner is suspended, a pod its controller has not taken away within the bound (the
/// controller is down, or the node is gone and the pod garbage collector slow) is
/// deleted, with `DisruptionTarget`.
#[test]
fn a_teardown_deletes_an_owners_pods_its_controller_does_not_take_away_in_time() {
    let spec = replaced_by_controller(2);
    let j = journal(
        State::TearingDown,
        0,
        vec![planned("job-0", false, Some(0)), planned("job-1", false, Some(0))],
        &[],
    );
    let on_gone_node = PodView {
        node: Some("gone".into()),
        ..owned("job-1", "u1", Phase::Running)
    };
    let pods = [owned("job-0", "u0", Phase::Running), on_gone_node];
    let nodes: BTreeMap<String, NodeHealth> = [("n1".to_string(), NodeHealth::Ready)].into();
    let at = |now: i64, owners: Owners| {
        let gang = Gang {
            spec: &spec,
            journal: Some(&j),
            restarts: 0,
            counted_restarts: 0,
            finished_at: None,
            pods: &pods,
            claims: &[],
            nodes: &nodes,
            devices_published: true,
            reuse_problems: Some(&[]),
            conflicted: &[],
            refusals: &[],
            owners,
            now,
        };
        decide(&gang, &SETTINGS)
    };
    let deleted = |s: &Step| -> Vec<(String, bool, Option<Disruption>)> {
        s.effects
            .iter()
            .flat_map(|e| match e {
                Effect::DeletePods {
                    pods,
                    immediately,
                    disruption,
                } => pods
                    .iter()
                    .map(|p| (p.name.clone(), *immediately, *disruption))
                    .collect(),
                _ => vec![],
            })
            .collect()
    };
    // Early: the owner is suspended, nothing deleted (its controller deletes a pod whose
    // node is gone without counting it, and the pod garbage collector finishes it).
    let s = at(1_000, Owners::default());
    assert!(suspends_owners(&s), "{s:?}");
    assert!(deleted(&s).is_empty(), "{s:?}");
    // Past the bound but the owner not seen suspended: muster still only asks.
    let s = at(SETTINGS.owner_stop_timeout, Owners::default());
    assert!(suspends_owners(&s) && deleted(&s).is_empty(), "{s:?}");
    // Past the bound, the owner suspended but its pods still there: muster deletes them,
    // the one whose node is gone at once.
    let s = at(SETTINGS.owner_stop_timeout, MARKED);
    assert!(!suspends_owners(&s), "{s:?}");
    let gone = deleted(&s);
    assert!(
        gone.contains(&("job-0".to_string(), false, Some(Disruption::Termination))),
        "{s:?}"
    );
    assert!(
        gone.contains(&("job-1".to_string(), true, Some(Disruption::Termination))),
        "{s:?}"
    );
}
