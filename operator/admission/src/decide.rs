//! The next step of a placed gang, for every recorded state.

use std::collections::{BTreeMap, BTreeSet};

use crate::failure::{self, Failure, FailureAction, FailureKind};
use crate::ownership;
use crate::refusal::{self, Refusal};
use crate::{
    Condition, ConditionType, Disruption, Effect, EventKind, Gang, Journal, Millis, NodeHealth, Phase, Pin, PlannedPod,
    PodView, Reason, Record, Restarts, Settings, State, Step,
};

/// What to do next for a gang, from what is observed. A gang without a journal is
/// queued: placing it is the planner's business, not the state machine's.
///
/// Must not be called for a gang whose commit is under way in this process: a
/// `Reserving` journal is taken for one a stopped operator left behind and undone.
pub fn decide(gang: &Gang, settings: &Settings) -> Step {
    let Some(journal) = gang.journal else {
        // A job that ended before its gang was placed is never placed.
        if gang.spec.job_ended.is_some() {
            return job_ended(gang, &Journal::finished(gang.now));
        }
        return queued(gang);
    };
    // A commit released pods once its reservation was whole and checked, and stopped
    // before it recorded so: it is finished as a reservation is, never undone.
    let finishing_commit;
    let journal = if crate::commit::released_any(journal, |name| gang.current_pod(name)) {
        finishing_commit = Journal {
            state: State::Reserved,
            ..journal.clone()
        };
        &finishing_commit
    } else {
        journal
    };
    match journal.state {
        State::Finished => expire(gang),
        State::Finishing => finishing(gang, journal),
        State::Suspending => suspending(gang, journal, settings),
        // An unchecked reservation is undone as such (it releases no pod); a suspended
        // gang then stays out of the queue.
        State::Reserving => undo_reserving(gang, journal),
        _ if gang.spec.job_ended.is_some() => job_ended(gang, journal),
        _ if gang.spec.stopped() => {
            let message = if gang.spec.suspend {
                "spec.suspend is true: giving back the gang's pods and devices"
            } else {
                "Kueue took the gang back: giving back its pods and devices"
            };
            Step::effects(vec![record(
                Some(journal.moved(State::Suspending, gang.now)),
                vec![admitted(false, Reason::Suspended, message.into())],
            )])
        }
        // An owner muster suspended while the gang is placed again (a deposed leader's
        // suspend that landed late): resumed, so that its pods come back.
        State::Reserved | State::Released if gang.owners.marked => Step::effects(vec![Effect::ResumeOwners]),
        // A device of the gang is allocated to another claim as well: the gang gives
        // way, since muster can only take back what it allocated.
        State::Reserved | State::Released if !gang.conflicted.is_empty() => {
            let message = format!(
                "a device of claim {} is allocated to another claim as well; taking the gang apart to place it again",
                gang.conflicted.join(", ")
            );
            tear_down(gang, journal, Reason::Conflict, message, EventKind::RolledBack)
        }
        State::Reserved => reserved(gang, journal, settings),
        State::Released => {
            let step = released(gang, journal, settings);
            // The oldest vacancy's bound is looked at when it is due.
            match journal.vacancies.iter().map(|v| v.since).min() {
                Some(since) if step.record().is_none() => {
                    step.then_recheck_in(since + settings.schedule_timeout - gang.now)
                }
                _ => step,
            }
        }
        State::TearingDown => tearing_down(gang, journal, settings),
        State::Restarting => restarting(gang, journal, settings),
    }
}

/// The pods' controller says their job ended: the gang ends as it says, and what still
/// runs stops and every claim is given back, as for any end.
fn job_ended(gang: &Gang, journal: &Journal) -> Step {
    let Some(end) = &gang.spec.job_ended else {
        return Step::idle();
    };
    // Held nothing: finished at once.
    let next = if journal.state == State::Finished {
        journal.clone()
    } else {
        journal.moved(State::Finishing, gang.now)
    };
    let (type_, reason, kind) = if end.succeeded {
        (ConditionType::Succeeded, Reason::JobCompleted, EventKind::Succeeded)
    } else {
        (ConditionType::Failed, Reason::JobFailed, EventKind::Failed)
    };
    Step::effects(vec![
        record(Some(next), vec![condition(type_, true, reason, end.message.clone())]),
        event(kind, !end.succeeded, "Finish", end.message.clone()),
    ])
}

/// muster's own pods labelled with an attempt before the current one (made while the
/// Workload controller still saw the old restart count): they go, and come back with
/// the current attempt.
fn stale<'g>(gang: &'g Gang) -> impl Iterator<Item = &'g PodView> {
    gang.pods
        .iter()
        .filter(|p| p.attempt.is_some_and(|a| a < gang.restarts))
}

/// A queued gang holds nothing. Pods of an old attempt that still wait at the gate go,
/// and so does a pod of muster's that no reservation released (a deposed leader's
/// release that landed after its successor gave the gang back) while it has not started
/// or has ended: the gang could never be admitted again with it there. A running one
/// is left alone: a journal lost from outside must not kill a running gang.
///
/// An owner muster suspended to requeue the gang is resumed, unless the Workload is
/// suspended: its controller makes the pods again, behind the gate (under Kueue, they
/// wait there for Kueue's next admission).
fn queued(gang: &Gang) -> Step {
    let released = gang
        .pods
        .iter()
        .filter(|p| p.attempt.is_some() && !p.gated && p.phase != Phase::Running);
    let mut effects = resume_owners(gang);
    effects.extend(delete(
        gang,
        stale(gang).filter(|p| p.gated).chain(released),
        Disruption::Termination,
    ));
    Step::effects(effects)
}

/// Resumes the owners muster suspended for the gang, unless the Workload itself is
/// suspended (then they wait for its resume).
fn resume_owners(gang: &Gang) -> Vec<Effect> {
    if gang.owners.marked && !gang.spec.suspend {
        vec![Effect::ResumeOwners]
    } else {
        Vec::new()
    }
}

/// Stops `pods` for a teardown, a suspend or a restart recorded at `since`: what an
/// object muster can suspend makes, by suspending that object (its controller takes the
/// pods away without counting a failure; one that ended stays, holding nothing), the
/// rest by deleting it, another controller's with the `DisruptionTarget` condition
/// first. An owner's pod is deleted so too once the owner is suspended and its controller
/// has not taken it away within `owner_stop_timeout` of the transition (it is not
/// running, another manages the object, or the pod's node is gone and the pod garbage
/// collector is slow). `None`
/// once nothing is left to stop; the effects are empty while the owners' controllers are
/// at it.
fn stop<'p>(
    gang: &Gang,
    pods: impl IntoIterator<Item = &'p PodView>,
    disruption: Disruption,
    since: Millis,
    settings: &Settings,
) -> Option<Vec<Effect>> {
    let pods: Vec<&PodView> = pods.into_iter().filter(|p| !(p.owned && p.phase.terminal())).collect();
    if pods.is_empty() {
        return None;
    }
    // Only once the owners are seen suspended: until then muster asks for the suspend.
    let given_up = gang.owners.suspended && gang.now - since >= settings.owner_stop_timeout;
    let mut effects = Vec::new();
    if !gang.owners.suspended && pods.iter().any(|p| p.owned && !p.deleting) {
        effects.push(Effect::SuspendOwners);
    }
    effects.extend(delete(
        gang,
        pods.iter().copied().filter(|p| !p.owned || given_up),
        disruption,
    ));
    Some(effects)
}

fn record(journal: Option<Journal>, conditions: Vec<Condition>) -> Effect {
    Effect::Record(Record {
        journal,
        conditions,
        restarts: None,
        refusals: None,
    })
}

fn condition(type_: ConditionType, status: bool, reason: Reason, message: String) -> Condition {
    Condition {
        type_,
        status,
        reason,
        message,
    }
}

fn admitted(status: bool, reason: Reason, message: String) -> Condition {
    condition(ConditionType::Admitted, status, reason, message)
}

fn event(kind: EventKind, warning: bool, action: &'static str, note: String) -> Effect {
    Effect::Event {
        kind,
        warning,
        action,
        note,
    }
}

/// When to look again at a teardown that waits for an owner's controller: when the
/// bound of [`stop`] is due (at the latest a second from now).
fn owner_stop_due(gang: &Gang, journal: &Journal, settings: &Settings) -> Millis {
    (journal.since + settings.owner_stop_timeout - gang.now).max(1000)
}

/// Deletes the pods not already being deleted: at once where their node is gone (no
/// kubelet will confirm the end), with their grace period elsewhere. Another
/// controller's pods are given the `DisruptionTarget` condition (`disruption`) first.
fn delete<'p>(gang: &Gang, pods: impl IntoIterator<Item = &'p PodView>, disruption: Disruption) -> Vec<Effect> {
    let mut groups: BTreeMap<(bool, bool), Vec<crate::PodRef>> = BTreeMap::new();
    for pod in pods.into_iter().filter(|p| !p.deleting) {
        let gone = pod.node.as_deref().is_some_and(|n| gang.node(n) == NodeHealth::Gone);
        let others = pod.attempt.is_none();
        groups.entry((!gone, others)).or_default().push(pod.reference());
    }
    groups
        .into_iter()
        .map(|((graceful, others), pods)| Effect::DeletePods {
            pods,
            immediately: !graceful,
            disruption: others.then_some(disruption),
        })
        .collect()
}

/// Where a set of claims stands in being given back.
enum Claims {
    /// The gang holds none of them any more: each is unallocated, or left to another
    /// holder.
    Free,
    /// Some still need the gang: deallocate those no running pod uses (if any); the
    /// others wait.
    Held(Option<Box<Effect>>),
}

/// Gives back `claims`, by the ownership rule of [`crate::ClaimView`] and
/// [`crate::ownership`]: a claim another gang holds, one muster did not allocate, and
/// one a consumer known to be outside the gang keeps are let go as they are; the others
/// are deallocated once nothing reserves them but pods of the gang that cannot use the
/// devices. A pod of the gang that may still run (one being deleted may), one that is
/// gone while its entry is still in `reservedFor`, and a consumer the caches cannot place
/// keep the claim held: the gang waits.
fn give_back<'c>(gang: &Gang, claims: impl IntoIterator<Item = &'c String>) -> Claims {
    let idle: Vec<String> = gang
        .pods
        .iter()
        .filter(|p| ownership::idle(p))
        .map(|p| p.uid.clone())
        .collect();
    let mut free_now = Vec::new();
    let mut held = false;
    for name in claims {
        let Some(claim) = gang.claim(name).filter(|c| c.allocated) else {
            continue;
        };
        if claim.held_elsewhere || !claim.ours {
            continue;
        }
        let users = ownership::users(claim, gang.pods, gang.journal);
        if users.own_active || users.unknown {
            held = true;
            continue;
        }
        if users.outside {
            continue;
        }
        held = true;
        free_now.push(name.clone());
    }
    if !held {
        return Claims::Free;
    }
    if free_now.is_empty() {
        return Claims::Held(None);
    }
    Claims::Held(Some(Box::new(Effect::Deallocate { claims: free_now, idle })))
}

/// Gives back, while the gang runs on, the claims whose every pod of the gang has
/// succeeded: kube-controller-manager rewrites the `reservedFor` of an allocated claim in
/// a loop while one of its pods has ended and is still there (kubernetes#141274), so such
/// a claim is not kept until the whole gang ends. Only a claim [`give_back`] would clear
/// (muster's, no other holder, no other user); a restart after this places the gang
/// again, as its reservation is no longer whole.
fn give_back_spent(gang: &Gang, journal: &Journal) -> Option<Effect> {
    let succeeded = |uid: &String| {
        gang.pods
            .iter()
            .any(|p| &p.uid == uid && p.phase == Phase::Succeeded && !p.gated)
    };
    let spent: Vec<&String> = journal
        .claims
        .iter()
        // kube-controller-manager deallocates a protected claim itself when it takes the
        // ended pod out; muster does only if nothing is left for it to take out.
        .filter(|name| {
            gang.claim(name).is_some_and(|c| {
                c.allocated
                    && !c.used_by.is_empty()
                    && c.used_by.iter().all(succeeded)
                    && (!c.protected || c.reserved_for.is_empty())
            })
        })
        .collect();
    if spent.is_empty() {
        return None;
    }
    match give_back(gang, spent) {
        Claims::Held(effect) => effect.map(|e| *e),
        Claims::Free => None,
    }
}

fn held(effect: Option<Box<Effect>>) -> Step {
    Step::effects(effect.map(|e| *e).into_iter().collect())
}

/// A commit no live operator finishes: give back what it allocated, then queue.
fn undo_reserving(gang: &Gang, journal: &Journal) -> Step {
    match give_back(gang, &journal.claims) {
        Claims::Held(effect) => held(effect),
        Claims::Free => {
            let (reason, message) = journal.cause.clone().unwrap_or((
                Reason::RolledBack,
                "a commit interrupted while reserving devices was undone; the gang is queued again".into(),
            ));
            Step::effects(vec![
                record(None, vec![admitted(false, reason, message.clone())]),
                event(EventKind::RolledBack, true, "Reserve", message),
            ])
        }
    }
}

/// Takes an admitted gang apart to queue it again.
fn tear_down(gang: &Gang, journal: &Journal, reason: Reason, message: String, kind: EventKind) -> Step {
    let mut tearing = journal.moved(State::TearingDown, gang.now);
    tearing.cause = Some((reason, message.clone()));
    Step::effects(vec![
        record(Some(tearing), vec![admitted(false, reason, message.clone())]),
        event(kind, true, "TearDown", message),
    ])
}

/// Every claim allocated: release the planned pods once they all exist.
fn reserved(gang: &Gang, journal: &Journal, settings: &Settings) -> Step {
    if let Some(lost) = journal
        .claims
        .iter()
        .find(|c| !gang.claim(c).is_some_and(|c| c.allocated))
    {
        let message = format!("claim {lost} lost its allocation before the gang was released; placing it again");
        return tear_down(gang, journal, Reason::RolledBack, message, EventKind::RolledBack);
    }
    let missing: Vec<&str> = journal
        .pods
        .iter()
        .filter(|p| gang.current_pod(&p.name).is_none())
        .map(|p| p.name.as_str())
        .collect();
    if !missing.is_empty() {
        let waited = gang.now - journal.since;
        if waited < settings.release_timeout {
            return Step::idle().then_recheck_in(settings.release_timeout - waited);
        }
        let message = format!(
            "{} planned pods did not appear within {}s ({}); giving the reservation back",
            missing.len(),
            settings.release_timeout / 1000,
            first(&missing)
        );
        return tear_down(gang, journal, Reason::ReleaseTimeout, message, EventKind::RolledBack);
    }
    let gated: Vec<Pin> = crate::commit::pins(journal, |name| gang.current_pod(name));
    if !gated.is_empty() {
        return Step::effects(vec![Effect::Release { pods: gated }]);
    }
    let mut released = journal.moved(State::Released, gang.now);
    released.released_at = Some(gang.now);
    released.cause = None;
    for pod in &mut released.pods {
        pod.released_at = Some(gang.now);
    }
    let message = match &journal.topology_value {
        Some(value) => format!(
            "reserved {} devices on {} nodes ({value}); pods released to the scheduler",
            journal.devices,
            journal.nodes.len()
        ),
        None => format!(
            "reserved {} devices on {} nodes; pods released to the scheduler",
            journal.devices,
            journal.nodes.len()
        ),
    };
    Step::effects(vec![
        record(Some(released), vec![admitted(true, Reason::Admitted, message.clone())]),
        event(EventKind::Admitted, false, "Admit", message),
    ])
}

fn first(names: &[&str]) -> String {
    let mut shown = names.iter().take(5).copied().collect::<Vec<_>>().join(", ");
    if names.len() > 5 {
        shown.push_str(", ...");
    }
    shown
}

/// Every pod of the success groups succeeded (at least minCount, none still running).
/// Where the pods' controller replaces failed pods, a failed pod that left the journal
/// was replaced and no longer counts.
fn succeeded(gang: &Gang, journal: &Journal) -> Option<String> {
    let groups: Vec<&str> = if gang.spec.success_groups.is_empty() {
        gang.spec.groups.iter().map(|g| g.name.as_str()).collect()
    } else {
        gang.spec.success_groups.iter().map(String::as_str).collect()
    };
    let all = gang
        .spec
        .groups
        .iter()
        .filter(|g| groups.contains(&g.name.as_str()))
        .all(|g| {
            let replaced = |p: &PodView| {
                gang.spec.restarted_by_pod_controller && p.phase == Phase::Failed && journal.planned(&p.name).is_none()
            };
            let members: Vec<&PodView> = gang
                .current_pods()
                .filter(|p| p.group.as_deref() == Some(g.name.as_str()) && !replaced(p))
                .collect();
            let done = members.iter().filter(|p| p.phase == Phase::Succeeded).count();
            // A pod at the gate is an extra that never ran, save where it is a
            // replacement the pods' controller made: that one is still to run.
            let never_ran = |p: &PodView| p.gated && !p.deleting && !gang.spec.restarted_by_pod_controller;
            let settled = members.iter().all(|p| never_ran(p) || p.phase == Phase::Succeeded);
            done as i32 >= g.min_count && settled
        });
    all.then(|| format!("every pod of {} succeeded", groups.join(", ")))
}

/// Why the gang's core (its pods within minCount) cannot go on, if it cannot: the first
/// core pod whose loss ends the attempt gives the reason and the words; what the failure
/// policy's rules match on is known of every core pod that failed or was lost.
fn core_failure(gang: &Gang, journal: &Journal) -> Option<(Reason, String, Vec<Failure>)> {
    let mut first: Option<(Reason, String)> = None;
    let mut failures = Vec::new();
    for planned in journal.core() {
        let pod = gang.current_pods().find(|p| p.name == planned.name);
        // A pod gone, deleted or replaced on a node that is gone lost its node.
        let node_gone = gang.node(&planned.node) == NodeHealth::Gone;
        let lost = if node_gone {
            FailureKind::NodeLost
        } else {
            FailureKind::PodLost
        };
        let seen = |p: &PodView, kind: FailureKind| Failure {
            group: p.group.clone(),
            kind: Some(p.failure_kind.unwrap_or(kind)),
            exit_codes: p.exit_codes.clone(),
            conditions: p.conditions.clone(),
        };
        let (reason, message, failure) = match pod {
            None => (
                Reason::PodLost,
                format!("pod {} disappeared", planned.name),
                Failure {
                    kind: Some(lost),
                    ..Failure::default()
                },
            ),
            // A pod that failed and is being deleted failed first.
            Some(p) if p.phase == Phase::Failed && !p.gated => {
                let why = p.message.as_deref().unwrap_or_default();
                let message = format!("pod {} failed {why}", planned.name);
                (
                    Reason::PodFailed,
                    message.trim().to_string(),
                    seen(p, FailureKind::PodFailed),
                )
            }
            Some(p) if p.deleting => (
                Reason::PodLost,
                format!("pod {} is being deleted", planned.name),
                seen(p, lost),
            ),
            // What the replacement shows says nothing of how its predecessor ended.
            Some(p) if p.gated => (
                Reason::PodLost,
                format!("pod {} was replaced", planned.name),
                Failure {
                    group: p.group.clone(),
                    kind: Some(lost),
                    ..Failure::default()
                },
            ),
            Some(p) => match p.node.as_deref().filter(|n| gang.node(n) == NodeHealth::Gone) {
                Some(node) => (
                    Reason::NodeLost,
                    format!("node {node} of pod {} is gone", planned.name),
                    Failure {
                        kind: Some(FailureKind::NodeLost),
                        ..seen(p, FailureKind::NodeLost)
                    },
                ),
                None => continue,
            },
        };
        first.get_or_insert((reason, message));
        failures.push(failure);
    }
    first.map(|(reason, message)| (reason, message, failures))
}

/// A released gang: success, failure and restarts, extras, and the scheduler's pace.
fn released(gang: &Gang, journal: &Journal, settings: &Settings) -> Step {
    if let Some(message) = succeeded(gang, journal) {
        let finishing = journal.moved(State::Finishing, gang.now);
        return Step::effects(vec![
            record(
                Some(finishing),
                vec![condition(
                    ConditionType::Succeeded,
                    true,
                    Reason::SucceededPodGroups,
                    message.clone(),
                )],
            ),
            event(EventKind::Succeeded, false, "Finish", message),
        ]);
    }
    if gang.spec.restarted_by_pod_controller {
        // The bound first: a vacancy past it is acted on whatever else is under way.
        if let Some(step) = vacancies_overdue(gang, journal, settings) {
            return step;
        }
        if let Some(step) = vacate(gang, journal) {
            return step;
        }
    } else if let Some((reason, message, failures)) = core_failure(gang, journal) {
        return fail_or_restart(gang, journal, reason, message, &failures);
    }
    let (refused, refusal_due) = refused_pods(gang, settings, in_place(gang, journal));
    if !refused.is_empty() {
        return refused_tear_down(gang, journal, refused);
    }
    let mut step = extras(gang, journal, settings);
    if step.record().is_some() {
        return step;
    }
    step.effects.extend(give_back_spent(gang, journal));
    if let Some(due) = refusal_due {
        step = step.then_recheck_in(due);
    }

    // Waiting for the scheduler to bind every released core pod, each from its own
    // release (a replacement placed into a running gang comes later than the gang).
    let unbound: Vec<(&str, Millis)> = in_place(gang, journal)
        .filter(|(p, _)| gang.current_pod(&p.name).is_some_and(|pod| pod.node.is_none()))
        .map(|(p, released_at)| (p.name.as_str(), released_at))
        .collect();
    let Some(latest) = unbound.iter().map(|(_, at)| *at).max() else {
        return step;
    };
    let earliest = unbound.iter().map(|(_, at)| *at).min().unwrap_or(latest);
    let waited = gang.now - earliest;
    if waited < settings.schedule_timeout {
        return step.then_recheck_in(settings.schedule_timeout - waited);
    }
    let unbound: Vec<&str> = unbound.into_iter().map(|(name, _)| name).collect();
    let message = format!(
        "{} of {} released pods were not scheduled within {}s ({}); tearing the gang down to place it again",
        unbound.len(),
        journal.core().count(),
        settings.schedule_timeout / 1000,
        first(&unbound)
    );
    tear_down(
        gang,
        journal,
        Reason::ScheduleTimeout,
        message,
        EventKind::ScheduleTimeout,
    )
}

/// The core pods in place, each with when it was released: every core pod, save those
/// leaving a place their controller fills again (see [`vacate`]).
fn in_place<'j>(gang: &Gang, journal: &'j Journal) -> impl Iterator<Item = (&'j PlannedPod, Millis)> {
    let gang_release = journal.released_at.unwrap_or(journal.since);
    let vacating = gang.spec.restarted_by_pod_controller;
    journal.core().filter_map(move |p| match p.released_at {
        Some(at) => Some((p, at.max(gang_release))),
        None if vacating => None,
        None => Some((p, gang_release)),
    })
}

/// `failurePolicy.restartedBy: PodController`: the pods' controller replaces a core pod
/// that failed or went, and muster restarts nothing and deletes nothing. The pod's place
/// is vacated in steps, each recorded:
/// 1. its entry is marked as leaving (`released_at` cleared), with an event;
/// 2. once every leaving pod has ended or gone, the claims no pod still in place uses are
///    given back (kube-controller-manager clears the protected ones with their pod);
/// 3. the leaving entries and those claims leave the journal.
///
/// The controller's replacements then wait at the gate like extras, and the admission
/// loop places all of a group's missing core pods at once, back onto the nodes and
/// devices their predecessors had where these are free.
fn vacate(gang: &Gang, journal: &Journal) -> Option<Step> {
    let pod_of = |planned: &PlannedPod| gang.current_pods().find(|p| p.name == planned.name);
    // A pod that succeeded stays in its place (nothing replaces it) unless it is being
    // deleted (a JobSet restarting its Jobs makes it again).
    let gone = |planned: &PlannedPod| match pod_of(planned) {
        None => true,
        Some(p) if p.phase == Phase::Succeeded && !p.gated => p.deleting,
        Some(p) => {
            p.gated
                || p.deleting
                || p.phase == Phase::Failed
                || p.node.as_deref().is_some_and(|n| gang.node(n) == NodeHealth::Gone)
        }
    };
    // A pod marked leaving that turns out in place after all (its node was only missing
    // from the cache for a while) takes its place back.
    let back: Vec<&str> = journal
        .core()
        .filter(|p| p.released_at.is_none() && pod_of(p).is_some() && !gone(p))
        .map(|p| p.name.as_str())
        .collect();
    if !back.is_empty() {
        let mut restored = journal.clone();
        for pod in restored.pods.iter_mut().filter(|p| back.contains(&p.name.as_str())) {
            pod.released_at = journal.released_at;
        }
        restored.vacancies.retain(|v| !back.contains(&v.pod.as_str()));
        return Some(Step::effects(vec![record(Some(restored), vec![])]));
    }
    let newly: Vec<&str> = journal
        .core()
        .filter(|p| p.released_at.is_some() && gone(p))
        .map(|p| p.name.as_str())
        .collect();
    if !newly.is_empty() {
        let mut leaving = journal.clone();
        for pod in leaving.pods.iter_mut().filter(|p| newly.contains(&p.name.as_str())) {
            pod.released_at = None;
        }
        // Where each replacement goes back to, and since when the gang is short of it:
        // recorded before anything is given back (the devices go with the claims).
        for planned in journal.core().filter(|p| newly.contains(&p.name.as_str())) {
            let pod = pod_of(planned);
            // As the commit recorded them, else as its own claims show them still.
            let devices: Vec<String> = if planned.devices.is_empty() {
                pod.map(|pod| {
                    gang.claims
                        .iter()
                        .filter(|c| c.allocated && c.used_by.iter().all(|u| u == &pod.uid) && !c.used_by.is_empty())
                        .flat_map(|c| c.devices.iter().cloned())
                        .collect()
                })
                .unwrap_or_default()
            } else {
                planned.devices.clone()
            };
            leaving.vacancies.push(crate::Vacancy {
                pod: planned.name.clone(),
                group: planned.group.clone().or_else(|| pod.and_then(|p| p.group.clone())),
                index: pod.and_then(|p| p.index),
                node: planned.node.clone(),
                devices,
                since: gang.now,
            });
        }
        let message = format!(
            "{} core pods failed or went ({}); their controller replaces them, and muster gives back what they held and places the replacements, onto the same nodes and devices where these are free",
            newly.len(),
            first(&newly)
        );
        return Some(Step::effects(vec![
            record(Some(leaving), vec![]),
            event(EventKind::Restarting, true, "Vacate", message),
        ]));
    }
    let leaving: Vec<&PlannedPod> = journal.core().filter(|p| p.released_at.is_none()).collect();
    if leaving.is_empty() {
        return None;
    }
    // A pod still stopping still uses its devices.
    if leaving
        .iter()
        .any(|p| pod_of(p).is_some_and(|pod| !pod.gated && !pod.phase.terminal()))
    {
        return None;
    }
    let staying: BTreeSet<&str> = journal
        .pods
        .iter()
        .filter(|p| p.extra || p.released_at.is_some())
        .filter_map(|p| pod_of(p).map(|pod| pod.uid.as_str()))
        .collect();
    let extras_own: BTreeSet<&String> = journal
        .pods
        .iter()
        .filter(|p| p.extra)
        .flat_map(|p| &p.claims)
        .collect();
    let orphaned: Vec<&String> = journal
        .claims
        .iter()
        .filter(|c| !extras_own.contains(c))
        .filter(|c| {
            gang.claim(c)
                .is_none_or(|view| !view.used_by.iter().any(|u| staying.contains(u.as_str())))
        })
        .collect();
    match give_back(gang, orphaned.iter().copied()) {
        Claims::Held(effect) => Some(held(effect)),
        Claims::Free => {
            let mut kept = journal.clone();
            kept.pods.retain(|p| p.extra || p.released_at.is_some());
            kept.claims.retain(|c| !orphaned.contains(&c));
            // With no pod left, the replacements are placed as a whole gang again.
            if kept.pods.is_empty() {
                kept.topology_value = None;
                kept.devices = 0;
            }
            let mut nodes: Vec<String> = kept.pods.iter().map(|p| p.node.clone()).collect();
            nodes.sort();
            nodes.dedup();
            kept.nodes = nodes;
            Some(Step::effects(vec![record(Some(kept), vec![])]))
        }
    }
}

/// A place vacated for its controller's replacement longer than the schedule timeout:
/// the gang is requeued whole (its owners suspended, every device given back) rather
/// than hold its other members' devices for a replacement that does not come or does
/// not fit. Otherwise, when to look again.
///
/// The gang is requeued only where that brings it back whole: each overdue place's
/// replacement exists and waits at the gate (it did not fit), and no core pod of the gang
/// has succeeded (a controller does not run a succeeded index again, so the gang could
/// never be placed whole). Otherwise the places are no longer held: the gang runs on with
/// what it has, and a replacement that comes later is placed as any waiting pod (its
/// controller may never make one: an index it gave up on).
fn vacancies_overdue(gang: &Gang, journal: &Journal, settings: &Settings) -> Option<Step> {
    let overdue: Vec<&crate::Vacancy> = journal
        .vacancies
        .iter()
        .filter(|v| gang.now - v.since >= settings.schedule_timeout)
        .collect();
    let oldest = overdue.iter().min_by_key(|v| v.since)?;
    let waiting = |v: &crate::Vacancy| {
        gang.current_pods().any(|p| {
            p.gated && !p.deleting && journal.planned(&p.name).is_none() && (v.group.is_none() || p.group == v.group)
        })
    };
    let core_succeeded = journal.core().any(|planned| {
        gang.current_pod(&planned.name)
            .is_some_and(|p| p.phase == Phase::Succeeded)
    });
    let seconds = settings.schedule_timeout / 1000;
    if !core_succeeded && overdue.iter().all(|v| waiting(v)) {
        let message = format!(
            "{} vacated places were not filled within {seconds}s (the first on {}): their replacements do not fit; requeueing the whole gang rather than hold the devices of its other pods",
            overdue.len(),
            oldest.node
        );
        return Some(tear_down(
            gang,
            journal,
            Reason::ReplacementTimeout,
            message,
            EventKind::RolledBack,
        ));
    }
    let mut kept = journal.clone();
    kept.vacancies
        .retain(|v| gang.now - v.since < settings.schedule_timeout);
    let why = if core_succeeded {
        "a pod of the gang succeeded, so a requeue could not bring it back whole"
    } else {
        "their controller has not made every replacement"
    };
    let message = format!(
        "{} vacated places were not filled within {seconds}s (the first on {}) and {why}: their devices are no longer held, and the gang runs on with what it has",
        overdue.len(),
        oldest.node
    );
    Some(Step::effects(vec![
        record(Some(kept), vec![]),
        event(EventKind::Restarting, true, "Vacate", message),
    ]))
}

/// Of `planned` (each with the time it was released), the pods kube-scheduler refused on
/// their planned node and that have been released for the grace (see [`refusal`]), as
/// refusals made now; and how long until a refusal still within its grace is due.
fn refused_pods<'j>(
    gang: &Gang,
    settings: &Settings,
    planned: impl Iterator<Item = (&'j PlannedPod, Millis)>,
) -> (Vec<Refusal>, Option<Millis>) {
    let mut refused = Vec::new();
    let mut due: Option<Millis> = None;
    for (planned, released_at) in planned {
        let Some(pod) = gang.current_pod(&planned.name) else {
            continue;
        };
        let Some(message) = refusal::refused(pod) else {
            continue;
        };
        // The grace runs from the later of the release and the first sight of the
        // refusal: one that comes late (after a failed bind, say) gets its own.
        let since = pod
            .unscheduled
            .as_ref()
            .and_then(|u| u.since)
            .map_or(released_at, |s| s.max(released_at));
        let left = since + settings.refusal_grace - gang.now;
        if left > 0 {
            due = Some(due.map_or(left, |d| d.min(left)));
            continue;
        }
        refused.push(Refusal {
            group: pod.group.clone(),
            pod: planned.name.clone(),
            node: planned.node.clone(),
            message: message.to_string(),
            at: gang.now,
        });
    }
    (refused, due)
}

/// kube-scheduler refused core pods: the gang is taken apart at once (as for a schedule
/// timeout), and the refusals are recorded with the intent, in the same write, so that
/// the plans after it keep each pod's group off its node.
fn refused_tear_down(gang: &Gang, journal: &Journal, refused: Vec<Refusal>) -> Step {
    let message = format!(
        "{}; taking the gang apart to place it again",
        refusal::describe(&refused)
    );
    let mut step = tear_down(
        gang,
        journal,
        Reason::SchedulerRefused,
        message,
        EventKind::SchedulerRefused,
    );
    for effect in &mut step.effects {
        if let Effect::Record(record) = effect {
            record.refusals = Some(refusal::remember(gang.refusals, refused.clone(), gang.now));
        }
    }
    step
}

/// The gang fails for good: what still runs stops, every claim is given back.
fn fail(journal: &Journal, now: Millis, reason: Reason, message: String) -> Step {
    let finishing = journal.moved(State::Finishing, now);
    Step::effects(vec![
        record(
            Some(finishing),
            vec![condition(ConditionType::Failed, true, reason, message.clone())],
        ),
        event(EventKind::Failed, true, "Finish", message),
    ])
}

/// A core pod failed or was lost: the failure policy's first matching rule decides
/// whether the gang fails at once, restarts counting against `maxRestarts`, or restarts
/// without counting; with no rule matching, the restart counts.
fn fail_or_restart(gang: &Gang, journal: &Journal, reason: Reason, message: String, failures: &[Failure]) -> Step {
    let restarts = gang.restarts;
    let counted = gang.counted_restarts;
    let max = gang.spec.max_restarts;
    let (action, rule) = failure::action_for(&gang.spec.failure_rules, failures);
    let by_rule = rule.map(|r| format!(" (failure policy rule {r})")).unwrap_or_default();
    match action {
        FailureAction::FailGang => {
            let message = format!("{message}; the failure policy fails the gang{by_rule}");
            return fail(journal, gang.now, Reason::FailedByRule, message);
        }
        FailureAction::RestartGang if counted >= max => {
            let uncounted = if restarts > counted {
                format!(" ({} more not counted)", restarts - counted)
            } else {
                String::new()
            };
            let message = format!(
                "{message}; the gang was restarted {counted} times{uncounted} and failurePolicy.maxRestarts is {max}"
            );
            return fail(journal, gang.now, Reason::MaxRestartsExceeded, message);
        }
        FailureAction::RestartGang | FailureAction::RestartUncounted => {}
    }
    let counted_after = if action == FailureAction::RestartGang {
        counted + 1
    } else {
        counted
    };
    // Claims kube-controller-manager made for another controller's pods go with them.
    let reuse = !gang.spec.has_external_groups() && reservation_healthy(gang, journal);
    let mut restarting = journal.moved(State::Restarting, gang.now);
    restarting.reuse_reservation = reuse;
    restarting.released_at = None;
    restarting.retired = gang.pods.iter().map(|p| p.uid.clone()).collect();
    let how = if reuse {
        "onto the same nodes and devices"
    } else {
        "after placing the gang again"
    };
    let uncounted = if action == FailureAction::RestartUncounted {
        ", not counted against maxRestarts"
    } else {
        ""
    };
    let wait = gang
        .spec
        .restart_backoff
        .map(|b| format!(" after a backoff of {}s", b.before_restart(restarts) / 1000))
        .unwrap_or_default();
    let note = format!(
        "{message}; restarting the gang (restart {}{uncounted}{by_rule}) {how}{wait}",
        restarts + 1
    );
    Step::effects(vec![
        Effect::Record(Record {
            journal: Some(restarting),
            conditions: vec![condition(ConditionType::Restarting, true, reason, note.clone())],
            restarts: Some(Restarts {
                total: restarts + 1,
                counted: counted_after,
            }),
            refusals: None,
        }),
        event(EventKind::Restarting, true, "Restart", note),
    ])
}

/// The planned nodes exist and can take the pods, and every claim still holds its
/// devices, which their drivers still publish, and none goes with the pods that are
/// retired (delete-protection: the spec allowed no restart when it was committed).
fn reservation_healthy(gang: &Gang, journal: &Journal) -> bool {
    journal.nodes.iter().all(|n| gang.node(n) == NodeHealth::Ready)
        && gang.devices_published
        && gang.reuse_problems.is_none_or(<[String]>::is_empty)
        && journal
            .claims
            .iter()
            .all(|c| gang.claim(c).is_some_and(|c| c.allocated && !c.protected))
}

/// Extras of a running gang: an extra that failed, was lost or replaced, or was not
/// scheduled in time is dropped (its reservation given back; it is placed again like
/// any waiting extra). Dropping is recorded first (`released_at` cleared), then the pod
/// is deleted, then its claims deallocated, then it leaves the journal.
fn extras(gang: &Gang, journal: &Journal, settings: &Settings) -> Step {
    let mut to_drop = BTreeSet::new();
    // Extras kube-scheduler refused: dropped at once, and remembered.
    let released = journal
        .pods
        .iter()
        .filter(|p| p.extra)
        .filter_map(|p| Some((p, p.released_at?)));
    let (refused, mut recheck) = refused_pods(gang, settings, released);
    to_drop.extend(refused.iter().map(|r| r.pod.clone()));
    for extra in journal.pods.iter().filter(|p| p.extra) {
        let Some(released_at) = extra.released_at else {
            continue;
        };
        let pod = gang.current_pods().find(|p| p.name == extra.name);
        let drop = match pod {
            // muster makes its own pods again under the same name; another controller's
            // replacement has a new name and is placed as a new extra.
            None => gang.spec.has_external_groups(),
            Some(p) if p.deleting => false,
            Some(p) if p.gated || p.phase == Phase::Failed => true,
            Some(p) => match p.node.as_deref() {
                Some(node) => gang.node(node) == NodeHealth::Gone,
                None => {
                    let waited = gang.now - released_at;
                    if waited < settings.schedule_timeout {
                        let left = settings.schedule_timeout - waited;
                        recheck = Some(recheck.map_or(left, |r| r.min(left)));
                    }
                    waited >= settings.schedule_timeout
                }
            },
        };
        if drop {
            to_drop.insert(extra.name.clone());
        }
    }
    if !to_drop.is_empty() {
        let mut dropping = journal.clone();
        for pod in dropping.pods.iter_mut().filter(|p| to_drop.contains(&p.name)) {
            pod.released_at = None;
        }
        let remembered = (!refused.is_empty()).then(|| refusal::remember(gang.refusals, refused, gang.now));
        return Step::effects(vec![Effect::Record(Record {
            journal: Some(dropping),
            conditions: vec![],
            restarts: None,
            refusals: remembered,
        })]);
    }

    // Extras being dropped: pod first, then claims, then the journal.
    let mut effects = Vec::new();
    let mut gone = BTreeSet::new();
    for extra in journal.pods.iter().filter(|p| p.extra && p.released_at.is_none()) {
        let pod = gang.current_pods().find(|p| p.name == extra.name);
        if let Some(pod) = pod.filter(|p| !p.gated) {
            effects.extend(delete(gang, [pod], Disruption::Termination));
            continue;
        }
        match give_back(gang, &extra.claims) {
            Claims::Free => {
                gone.insert(extra.name.clone());
            }
            Claims::Held(effect) => effects.extend(effect.map(|e| *e)),
        }
    }
    if !gone.is_empty() {
        let mut kept = journal.clone();
        let claims: BTreeSet<&String> = journal
            .pods
            .iter()
            .filter(|p| gone.contains(&p.name))
            .flat_map(|p| &p.claims)
            .collect();
        kept.pods.retain(|p| !gone.contains(&p.name));
        kept.claims.retain(|c| !claims.contains(c));
        kept.nodes = kept
            .pods
            .iter()
            .map(|p| p.node.clone())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        effects.insert(0, record(Some(kept), vec![]));
    }
    let step = Step::effects(effects);
    match recheck {
        Some(r) => step.then_recheck_in(r),
        None => step,
    }
}

/// Released pods not all scheduled in time, a reservation given back, or pods that
/// never appeared: stop the released pods (suspending their owners where muster can),
/// give the claims back, resume the owners, queue.
fn tearing_down(gang: &Gang, journal: &Journal, settings: &Settings) -> Step {
    let planned: BTreeSet<&str> = journal.pods.iter().map(|p| p.name.as_str()).collect();
    let left = gang
        .current_pods()
        .filter(|p| planned.contains(p.name.as_str()) && !p.gated);
    let disruption = match journal.cause {
        Some((Reason::Preempted, _)) => Disruption::Preemption,
        _ => Disruption::Termination,
    };
    if let Some(effects) = stop(gang, left, disruption, journal.since, settings) {
        return Step::effects(effects).then_recheck_in(owner_stop_due(gang, journal, settings));
    }
    match give_back(gang, &journal.claims) {
        Claims::Held(effect) => held(effect),
        Claims::Free => {
            let (reason, message) = journal
                .cause
                .clone()
                .unwrap_or((Reason::ScheduleTimeout, "the gang was taken apart".into()));
            let mut effects = resume_owners(gang);
            effects.push(record(None, vec![admitted(false, reason, message)]));
            Step::effects(effects)
        }
    }
}

/// The retired attempt's pods go; then the gang goes back onto its reservation or
/// gives it back and is queued.
fn restarting(gang: &Gang, journal: &Journal, settings: &Settings) -> Step {
    let left = gang
        .pods
        .iter()
        .filter(|p| journal.retired.contains(&p.uid))
        .chain(stale(gang));
    if let Some(effects) = stop(gang, left, Disruption::Termination, journal.since, settings) {
        return Step::effects(effects).then_recheck_in(owner_stop_due(gang, journal, settings));
    }
    let attempt = gang.restarts;
    // The backoff runs from the failure (when Restarting was recorded); the gang keeps
    // its reservation meanwhile, so that the next attempt can go back onto it. The
    // recorded time has whole seconds only: a second more keeps the wait at least as
    // long as asked.
    if let Some(backoff) = gang.spec.restart_backoff {
        let due = journal.since + backoff.before_restart(attempt - 1) + 1000;
        if gang.now < due {
            return Step::idle().then_recheck_in(due - gang.now);
        }
    }
    if journal.reuse_reservation {
        // Whether the pods would pass kube-scheduler's filters there is not known yet.
        if gang.reuse_problems.is_none() {
            return Step::idle().then_recheck_in(500);
        }
        if reservation_healthy(gang, journal) {
            let mut reserved = journal.moved(State::Reserved, gang.now);
            reserved.reuse_reservation = false;
            reserved.retired.clear();
            let message = format!("attempt {attempt} goes onto the same nodes and devices");
            return Step::effects(vec![record(
                Some(reserved),
                vec![condition(ConditionType::Restarting, false, Reason::Restarted, message)],
            )]);
        }
        // Decided once, and told with why, before anything is given back: once the
        // claims go, the why goes with them.
        let why = match gang.reuse_problems.and_then(<[String]>::first) {
            Some(problem) => format!("its reservation no longer takes its pods: {problem}"),
            None => "a node, device or claim of its reservation no longer holds".to_string(),
        };
        let mut decided = journal.clone();
        decided.reuse_reservation = false;
        let message =
            format!("attempt {attempt} does not go back onto its nodes and devices ({why}); it is placed again");
        return Step::effects(vec![
            record(Some(decided), vec![]),
            event(EventKind::Restarting, true, "Restart", message),
        ]);
    }
    match give_back(gang, &journal.claims) {
        Claims::Held(effect) => held(effect),
        Claims::Free => {
            let message = format!("attempt {attempt} is queued to be placed again");
            let mut effects = resume_owners(gang);
            effects.push(record(
                None,
                vec![
                    condition(ConditionType::Restarting, false, Reason::Restarted, message.clone()),
                    admitted(false, Reason::Restarted, message),
                ],
            ));
            Step::effects(effects)
        }
    }
}

/// `spec.suspend`, or Kueue took the gang back: the released pods go (suspending their
/// owners where muster can), then the claims are given back. A resume in the middle
/// finishes the suspension first; then the gang is queued, its owners resumed unless
/// the Workload is suspended.
fn suspending(gang: &Gang, journal: &Journal, settings: &Settings) -> Step {
    let left = gang.pods.iter().filter(|p| !p.gated);
    if let Some(effects) = stop(gang, left, Disruption::Termination, journal.since, settings) {
        return Step::effects(effects).then_recheck_in(owner_stop_due(gang, journal, settings));
    }
    match give_back(gang, &journal.claims) {
        Claims::Held(effect) => held(effect),
        Claims::Free => {
            let message = if gang.spec.suspend {
                "spec.suspend is true: the gang holds nothing"
            } else if gang.spec.evicted {
                "Kueue took the gang back: it holds nothing and waits for Kueue to admit it again"
            } else {
                "the gang was suspended and gave everything back; resumed, it is queued again"
            };
            let mut effects = resume_owners(gang);
            effects.push(record(None, vec![admitted(false, Reason::Suspended, message.into())]));
            Step::effects(effects)
        }
    }
}

/// Succeeded or failed: stop what still runs, give every claim back, hold nothing.
/// A released pod kube-scheduler has not bound yet keeps the claims until it is being
/// deleted (kube-scheduler never binds such a pod): its deletion may fail on a pod that
/// changed meanwhile (kube-scheduler writes why it does not bind it), and bound later,
/// it would find its claims unallocated and allocate them itself.
fn finishing(gang: &Gang, journal: &Journal) -> Step {
    let running: Vec<&PodView> = gang.pods.iter().filter(|p| !p.phase.terminal()).collect();
    let mut effects = delete(gang, running, Disruption::Termination);
    let may_be_bound = gang
        .pods
        .iter()
        .any(|p| !p.gated && p.node.is_none() && !p.deleting && !p.phase.terminal());
    if may_be_bound {
        return Step::effects(effects);
    }
    match give_back(gang, &journal.claims) {
        Claims::Held(effect) => effects.extend(effect.map(|e| *e)),
        Claims::Free => {
            // A job that ended while muster had it suspended keeps nothing of muster's.
            effects.extend(resume_owners(gang));
            effects.push(record(Some(journal.moved(State::Finished, gang.now)), vec![]));
        }
    }
    Step::effects(effects)
}

/// A finished gang with `ttlSecondsAfterFinished`: deleted when the time is up.
fn expire(gang: &Gang) -> Step {
    let (Some(ttl), Some(finished_at)) = (gang.spec.ttl_seconds_after_finished, gang.finished_at) else {
        return Step::idle();
    };
    let due = finished_at + ttl.max(0) * 1000;
    if gang.now < due {
        return Step::idle().then_recheck_in(due - gang.now);
    }
    let note = format!("deleted {ttl}s after it finished (ttlSecondsAfterFinished)");
    Step::effects(vec![
        event(EventKind::Expired, false, "Delete", note),
        Effect::DeleteWorkload,
    ])
}
