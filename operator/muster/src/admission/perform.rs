//! Performing the state machine: each pass, every placed gang is observed, handed to
//! `muster_admission::decide`, and the effects it returns are written in order, each
//! conditional, with a fault point after every write so tests can stop the operator
//! between any two.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::events::EventType;
use muster_admission::{ClaimView, Disruption, Effect, EventKind, Gang, Journal, NodeHealth, PodView, State};
use muster_api::v1alpha1::{AdmissionState, Workload};
use muster_api::{conditions, labels};
use muster_engine::cluster::PlanId;
use muster_engine::key::ObjectKey;
use serde_json::json;
use tracing::warn;

use crate::kube_ops;
use crate::ops::faults::Write;
use crate::ops::metrics::{self};
use crate::owners;
use crate::workload::membership;
use crate::workload::observe::{self};

use super::reserve::deallocate;
use super::status::event_reason;
use super::{
    Admission, CommitError, claim_writes, conflicts, key, ownership, placement_of, release, reservation_health,
};
pub use crate::ops::faults::{FailWrite, FaultPoint};

/// How long a double allocation of a released gang's device must last before the gang
/// gives way.
pub(super) const CONFLICT_SETTLE: Duration = Duration::from_secs(2);

pub(super) fn write_of(effect: &Effect) -> Option<Write> {
    match effect {
        Effect::Record(_) => Some(Write::Record),
        Effect::DeletePods { .. } => Some(Write::Delete),
        Effect::Deallocate { .. } => Some(Write::Deallocate),
        Effect::Release { .. } => Some(Write::Release),
        Effect::SuspendOwners => Some(Write::Suspend),
        Effect::ResumeOwners => Some(Write::Resume),
        Effect::DeleteWorkload | Effect::Event { .. } => None,
    }
}

impl Admission {
    pub(super) fn fault(&self, point: FaultPoint) {
        if crate::ops::faults::COMPILED_IN && self.settings.fault == Some(point) {
            eprintln!("fault point {} reached: aborting", point.name());
            std::process::abort();
        }
    }

    /// Runs `write` for every item, `--write-parallelism` at a time, and fails with the
    /// first error once all have run. A test may abort after the first success (`first`).
    pub(super) async fn write_all<'i, T, F, Fut, R>(
        &self,
        items: &'i [T],
        first: FaultPoint,
        write: F,
    ) -> Result<Vec<R>, CommitError>
    where
        F: Fn(&'i T) -> Fut,
        Fut: std::future::Future<Output = Result<R, CommitError>>,
    {
        let first_done = std::sync::atomic::AtomicBool::new(false);
        let results: Vec<Result<R, CommitError>> = stream::iter(items)
            .map(|item| {
                let written = write(item);
                let first_done = &first_done;
                async move {
                    let result = written.await?;
                    if !first_done.swap(true, std::sync::atomic::Ordering::SeqCst) {
                        self.checkpoint(first).await;
                    }
                    Ok(result)
                }
            })
            .buffer_unordered(self.settings.write_parallelism.max(1))
            .collect()
            .await;
        let mut done = Vec::with_capacity(results.len());
        let mut failed = None;
        for result in results {
            match result {
                Ok(r) => done.push(r),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// A test's injected failure of `write`, the first time it is reached.
    pub(super) fn injected_failure(&self, write: FailWrite) -> Result<(), CommitError> {
        if !crate::ops::faults::COMPILED_IN
            || self.settings.fail != Some(write)
            || !self
                .passed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(format!("fail-{}", write.name()))
        {
            return Ok(());
        }
        warn!("failing the write {} once, as the test asked", write.name());
        Err(CommitError::Conflict(format!("injected failure of {}", write.name())))
    }

    /// [`Self::fault`], then a test's pause at `point`, if either is set.
    pub(super) async fn checkpoint(&self, point: FaultPoint) {
        self.fault(point);
        if !crate::ops::faults::COMPILED_IN {
            return;
        }
        let Some(pause) = self.settings.pause.as_ref().filter(|p| p.point == point) else {
            return;
        };
        warn!(until = %pause.until.display(), "pause point {} reached: waiting", point.name());
        while !pause.until.exists() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every assumption ends with the commit that made it: confirmed once the gang is
    /// released, forgotten once it holds nothing or is gone. A commit whose final record
    /// failed (or a Workload deleted mid-commit) would otherwise leave one behind, and
    /// devices would look taken for good.
    pub(super) fn reconcile_assumptions(&self, workloads: &[Arc<Workload>]) {
        let states: HashMap<ObjectKey, Option<AdmissionState>> = workloads
            .iter()
            .filter(|w| w.metadata.deletion_timestamp.is_none())
            .map(|w| (key(w), placement_of(w).and_then(|p| p.state)))
            .collect();
        let plans: Vec<PlanId> = self.index.cluster().assumed_plans().cloned().collect();
        for plan in plans {
            let gang = match &plan {
                PlanId::Gang(gang) => gang,
                // An extras commit ends within the call that made it.
                PlanId::Extras(_) => {
                    self.index.update(|c| c.forget(&plan));
                    continue;
                }
                // A nomination lasts as long as the preemptor's status records it.
                PlanId::Nomination(_) => continue,
            };
            match states.get(gang) {
                Some(Some(AdmissionState::Reserving | AdmissionState::Reserved)) => {}
                Some(Some(AdmissionState::Released | AdmissionState::Restarting)) => {
                    self.index.update(|c| c.confirm(&plan))
                }
                // A commit that gave up, or a gang gone: its room is free again.
                _ => {
                    self.index.update(|c| c.forget(&plan));
                    self.index.note_room_freed();
                }
            }
        }
    }

    /// Forgets double-allocation sightings of gangs that are gone.
    pub(super) fn prune_conflicts(&self, workloads: &[Arc<Workload>]) {
        let live: BTreeSet<ObjectKey> = workloads.iter().map(|w| key(w)).collect();
        self.conflicts_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(gang, _), _| live.contains(gang));
    }

    /// Of `seen` (the gang's claims whose devices another claim holds too, as the
    /// index shows now), those seen so continuously for [`CONFLICT_SETTLE`].
    /// The second value: whether some are still settling.
    pub(super) fn lasting_conflicts(&self, workload: &Workload, seen: Vec<String>) -> (Vec<String>, bool) {
        let gang = key(workload);
        let mut since = self.conflicts_seen.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        since.retain(|(g, claim), _| *g != gang || seen.contains(claim));
        let settling = !seen.is_empty();
        let lasting: Vec<String> = seen
            .into_iter()
            .filter(|claim| {
                let first = *since.entry((gang.clone(), claim.clone())).or_insert(now);
                now.duration_since(first) >= CONFLICT_SETTLE
            })
            .collect();
        let settling = settling && lasting.is_empty();
        (lasting, settling)
    }

    /// The core's picture of a placed gang, and its next step.
    pub(super) fn observe_and_decide(&self, workload: &Workload) -> (Option<Journal>, muster_admission::Step) {
        let journal = observe::journal(workload);
        // An eviction by Kueue takes the gang apart as a suspend does; the Workload
        // controller keeps its gated pods for the next admission.
        let mut spec = observe::spec(workload);
        spec.evicted = self.evicted_by_kueue(workload);
        let pods = self.gang_pods(workload);
        let pod_owners: Vec<owners::Owner> = pods.iter().filter_map(|p| owners::of_pod(p)).collect();
        let pod_views: Vec<PodView> = pods
            .iter()
            .map(|p| PodView {
                owned: owners::of_pod(p).is_some(),
                index: membership::group_of(workload, p).and_then(|g| match g.template {
                    Some(_) => membership::pod_index(p),
                    None => membership::member_index(p, g),
                }),
                ..observe::pod(p)
            })
            .collect();
        let claims = self.gang_claims(workload);
        // A claim of the journal the gang's view misses while the index knows it as
        // muster's (its label taken off and not yet put back): the step would take it for
        // lost; it waits a while instead.
        let namespace = workload.namespace().unwrap_or_default();
        let hidden = journal.iter().flat_map(|j| &j.claims).any(|name| {
            !claims.iter().any(|c| c.metadata.name.as_ref() == Some(name))
                && self.index.muster_claim(&ObjectKey::new(&namespace, name))
        });
        if self.stray_claims.wait_for_hidden(&key(workload), hidden) {
            tracing::debug!(workload = %key(workload), "a claim of the journal is hidden from the gang's caches; waiting");
            return (journal, muster_admission::Step::idle().then_recheck_in(500));
        }
        let mut users = claim_writes::claim_users(&pods);
        let claim_views: Vec<ClaimView> = claims
            .iter()
            .map(|c| self.claim_view_used_by(workload, c, users.remove(&c.name_any()).unwrap_or_default()))
            .collect();
        let in_journal = |claim: &ResourceClaim| {
            journal
                .iter()
                .flat_map(|j| &j.claims)
                .any(|name| Some(name) == claim.metadata.name.as_ref())
        };
        let (nodes, devices_published, conflicted, settling) = {
            let cluster = self.index.cluster();
            let names: BTreeSet<&str> = journal
                .iter()
                .flat_map(|j| &j.nodes)
                .map(String::as_str)
                .chain(pod_views.iter().filter_map(|p| p.node.as_deref()))
                .collect();
            let fence: Vec<_> = self
                .settings
                .fencing
                .tolerates_node_fence()
                .then(super::fencing::node_fence_toleration)
                .into_iter()
                .collect();
            let tolerations = reservation_health::group_tolerations(workload, &fence);
            let groups = journal
                .as_ref()
                .map(|j| reservation_health::groups_by_node(workload, j))
                .unwrap_or_default();
            let nodes: BTreeMap<String, NodeHealth> = names
                .into_iter()
                .filter_map(|n| {
                    let health = reservation_health::planned_node_health(
                        cluster.node(n),
                        self.index.node_unreadable(n),
                        groups.get(n),
                        &tolerations,
                    )?;
                    Some((n.to_string(), health))
                })
                .collect();
            let conflicted: Vec<String> = claims
                .iter()
                .filter(|c| in_journal(c))
                .filter(|c| {
                    c.status
                        .as_ref()
                        .and_then(|s| s.allocation.as_ref())
                        .into_iter()
                        .flat_map(|a| a.devices.iter().flat_map(|d| d.results.iter().flatten()))
                        .filter(|r| r.admin_access != Some(true))
                        .any(|r| conflicts::doubly_held(&cluster, &conflicts::result_device(r), r.share_id.is_some()))
                })
                .map(|c| c.name_any())
                .collect();
            // The index can lag (a deallocation seen after the allocation that followed
            // it): only an overlap that lasts is a conflict.
            let (conflicted, settling) = self.lasting_conflicts(workload, conflicted);
            let published = claims
                .iter()
                .filter(|c| in_journal(c))
                .filter_map(|c| c.status.as_ref()?.allocation.as_ref())
                .flat_map(|a| a.devices.iter().flat_map(|d| d.results.iter().flatten()))
                .all(|r| reservation_health::device_usable(&cluster, r));
            (nodes, published, conflicted, settling)
        };
        let refusals = observe::refusals(workload);
        let reuse_problems = self.reuse_problems(workload, journal.as_ref(), &pods);
        let gang = Gang {
            spec: &spec,
            journal: journal.as_ref(),
            restarts: membership::attempt(workload),
            counted_restarts: observe::counted_restarts(workload),
            finished_at: observe::finished_at(workload),
            pods: &pod_views,
            claims: &claim_views,
            nodes: &nodes,
            devices_published,
            reuse_problems: reuse_problems.as_deref(),
            conflicted: &conflicted,
            refusals: &refusals,
            owners: self.owners.owners(workload, &pod_owners),
            now: observe::now_millis(),
        };
        let mut step = muster_admission::decide(&gang, &self.core_settings());
        if settling {
            step = step.then_recheck_in(500);
        }
        (journal, step)
    }

    /// One step of a placed gang's state machine. Returns whether there was nothing to
    /// do, and then, for a released gang, its journal: its waiting extras, if any, are
    /// placed in the queue at the gang's priority (see `pass`), not here, before gangs of
    /// higher priority.
    pub(super) async fn advance(
        &self,
        workload: &Workload,
        next: &mut Duration,
    ) -> Result<(bool, Option<Journal>), CommitError> {
        let (journal, idle) = self.step(workload, next).await?;
        if idle && journal.as_ref().is_some_and(|j| j.state == State::Released) {
            self.protect_released(workload).await?;
            self.relist_released_on_found(workload).await?;
        }
        let extras_of = journal.filter(|j| idle && self.may_place_extras(workload, j));
        Ok((idle, extras_of))
    }

    /// A released gang's claims that its release left unprotected (the protection
    /// failed, the process stopped before it landed, or the gang was released by a
    /// version of muster that did not protect them): protected now, where it is safe as
    /// at a release. A claim muster allocated that no other gang holds, allocated, every
    /// pod of the gang naming it released, alive and listed in `reservedFor`.
    async fn protect_released(&self, workload: &Workload) -> Result<(), CommitError> {
        let pods = self.gang_pods(workload);
        let named: BTreeSet<String> = placement_of(workload)
            .map(|p| p.claims.iter().cloned().collect())
            .unwrap_or_default();
        let unprotected: Vec<Arc<ResourceClaim>> = self
            .gang_claims(workload)
            .into_iter()
            .filter(|c| named.contains(&c.name_any()) && ownership::muster_allocated(c) && ownership::allocated(c))
            .filter(|c| !c.finalizers().iter().any(|f| f == labels::DELETE_PROTECTION_FINALIZER))
            .filter(|c| !self.claim_view_used_by(workload, c, Vec::new()).held_elsewhere)
            .filter(|c| {
                let name = c.name_any();
                let listed: BTreeSet<&str> = c
                    .status
                    .iter()
                    .flat_map(|s| s.reserved_for.iter().flatten())
                    .map(|r| r.uid.as_str())
                    .collect();
                let users: Vec<&Arc<Pod>> = pods.iter().filter(|p| claim_writes::names_claim(p, &name)).collect();
                !users.is_empty()
                    && users.iter().all(|p| {
                        let alive = p.metadata.deletion_timestamp.is_none()
                            && !matches!(
                                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                                Some("Succeeded" | "Failed")
                            );
                        alive
                            && !crate::workload::status::is_gated(p)
                            && p.uid().is_some_and(|uid| listed.contains(uid.as_str()))
                    })
            })
            .collect();
        if unprotected.is_empty() {
            return Ok(());
        }
        self.protect_listed(workload, unprotected).await
    }

    /// Whether a gang may have extras placed now: released, not suspended or evicted.
    pub(super) fn may_place_extras(&self, workload: &Workload, journal: &Journal) -> bool {
        journal.state == State::Released && workload.spec.suspend != Some(true) && !self.evicted_by_kueue(workload)
    }

    /// One step of a placed gang's state machine, extras left alone (a commit takes its
    /// steps while the pass plans other gangs, and extras are planned by the pass only).
    /// Returns the journal observed and whether there was nothing to do.
    pub(super) async fn step(
        &self,
        workload: &Workload,
        next: &mut Duration,
    ) -> Result<(Option<Journal>, bool), CommitError> {
        let (journal, step) = self.observe_and_decide(workload);
        let state = journal.as_ref().map(|j| j.state);
        if !step.effects.is_empty() {
            tracing::debug!(workload = %key(workload), ?state, effects = ?step.effects, "state machine step");
        }
        if let Some(millis) = step.recheck_in {
            *next = (*next).min(Duration::from_millis(millis.max(0) as u64 + 100));
        }
        let wrote = self.execute(workload, state, step.effects).await?;
        Ok((journal, !wrote))
    }

    /// Performs the state machine's effects in order, stopping at the first that fails.
    /// Returns whether it wrote anything (a release Kueue holds, an unchanged record and
    /// events are no writes).
    pub(super) async fn execute(
        &self,
        workload: &Workload,
        state: Option<State>,
        effects: Vec<Effect>,
    ) -> Result<bool, CommitError> {
        let namespace = workload.namespace().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        let claims: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
        let mut wrote = false;
        for effect in effects {
            self.ensure_leading();
            let mut write = write_of(&effect);
            match effect {
                // A record that changes nothing is not written: a decision can never spin
                // on it.
                Effect::Record(record)
                    if record.conditions.is_empty()
                        && record.restarts.is_none()
                        && record.refusals.is_none()
                        && record.journal == observe::journal(workload) =>
                {
                    warn!(workload = %key(workload), "the state machine asked to record the journal unchanged; skipped");
                    write = None;
                }
                Effect::Record(record) => {
                    self.record(workload, record).await?;
                }
                Effect::DeletePods {
                    pods: targets,
                    immediately,
                    disruption,
                } => {
                    let going: BTreeSet<&str> = targets.iter().map(|t| t.uid.as_str()).collect();
                    self.unprotect_claims(workload, &going).await?;
                    let seen = self.gang_pods(workload);
                    for target in targets {
                        // The pod as it was when the deletion was decided: a leader
                        // deposed since cannot delete one its successor changed (a
                        // pod released again onto a new reservation).
                        let version = seen
                            .iter()
                            .find(|p| p.uid().as_deref() == Some(target.uid.as_str()))
                            .and_then(|p| p.metadata.resource_version.clone());
                        // Best effort: a pod that cannot take the condition (a policy
                        // refuses, or no permission) still goes.
                        if let Some(disruption) = disruption
                            && let Err(e) = self.mark_disrupted(&pods, &target, disruption).await
                        {
                            warn!(workload = %key(workload), pod = %target.name, error = %e, "marking a pod DisruptionTarget failed; deleting it all the same");
                        }
                        self.ensure_leading();
                        let params = DeleteParams {
                            grace_period_seconds: immediately.then_some(0),
                            preconditions: Some(kube::api::Preconditions {
                                uid: Some(target.uid.clone()),
                                resource_version: version,
                            }),
                            ..DeleteParams::default()
                        };
                        match pods.delete(&target.name, &params).await {
                            Ok(either) => {
                                if let Some(pod) = either.left() {
                                    self.own_pods.remember(pod);
                                }
                            }
                            Err(e) => kube_ops::done_if_gone_or_changed(Err::<(), _>(e))?,
                        }
                    }
                }
                Effect::Deallocate { claims: names, idle } => {
                    // The claims go on the understanding that the gang's planned pods
                    // still behind the gate stay there: a release a deposed leader
                    // prepared (an interrupted commit's) must not land after them.
                    let journal = observe::journal(workload);
                    self.fence_gated(workload, |pod| {
                        journal.as_ref().is_some_and(|j| j.planned(pod).is_some())
                    })
                    .await?;
                    // Each claim on its own: they go in parallel, `--write-parallelism` at
                    // a time, and one that fails does not hold back the others.
                    let leading = || self.ensure_leading();
                    let given_back: Vec<Result<Option<ResourceClaim>, kube::Error>> = stream::iter(&names)
                        .map(|name| {
                            self.ensure_leading();
                            deallocate(&claims, name, None, &idle, &leading)
                        })
                        .buffer_unordered(self.settings.write_parallelism.max(1))
                        .collect()
                        .await;
                    self.remember_claims(given_back)?;
                }
                // Reserved for a gang Kueue has not admitted yet: the pods wait until
                // Kueue reads muster's answer to its check.
                Effect::Release { .. } if self.release_held_by_kueue(workload) => {
                    tracing::debug!(workload = %key(workload), "reserved; waiting for Kueue to admit before releasing");
                    write = None;
                }
                Effect::Release { pods: pins } => self.release_pins(workload, &pins).await?,
                Effect::SuspendOwners => {
                    let targets: BTreeSet<owners::Owner> = self
                        .gang_pods(workload)
                        .iter()
                        .filter_map(|p| owners::of_pod(p))
                        .collect();
                    let suspended =
                        owners::writes::suspend(&self.client, workload, &targets, &|| self.ensure_leading()).await?;
                    self.owners.suspended_now(workload, &suspended);
                    for owner in suspended {
                        let note = format!(
                            "suspended {} {} to requeue the gang: its controller takes the pods away without counting a failure, and muster resumes it once every device is given back",
                            owner.kind.resource().kind,
                            owner.name
                        );
                        self.event(
                            workload,
                            EventType::Normal,
                            conditions::EVENT_JOB_SUSPENDED,
                            "Requeue",
                            note,
                        );
                    }
                }
                Effect::ResumeOwners => {
                    let marked = self.owners.of(workload);
                    // An owner this process suspended that the cache does not show marked
                    // yet, or one that kept changing: the step stops here and is taken
                    // again, so the gang is never queued before its owners are resumed.
                    let unseen = self
                        .owners
                        .own_suspended(workload)
                        .is_some_and(|own| own.iter().any(|uid| !marked.iter().any(|m| m.owner.uid == *uid)));
                    if unseen {
                        return Err(CommitError::Conflict(
                            "an owner muster suspended is not in the cache as marked yet".into(),
                        ));
                    }
                    let outcome = owners::writes::resume(&self.client, &marked, &|| self.ensure_leading()).await?;
                    let resumed = outcome.owners;
                    self.owners.resumed_now(workload, &resumed);
                    if outcome.still_changing {
                        return Err(CommitError::Conflict(
                            "an owner muster suspended kept changing while it was resumed".into(),
                        ));
                    }
                    if resumed.is_empty() {
                        // Nothing written (changed meanwhile): no step to take again at once.
                        write = None;
                    }
                    for owner in &resumed {
                        let note = format!(
                            "resumed {} {}: its pods wait behind the gate until the gang is placed again",
                            owner.owner.kind.resource().kind,
                            owner.owner.name
                        );
                        self.event(
                            workload,
                            EventType::Normal,
                            conditions::EVENT_JOB_RESUMED,
                            "Requeue",
                            note,
                        );
                    }
                }
                Effect::DeleteWorkload => {
                    let api: Api<Workload> = Api::namespaced(self.client.clone(), &namespace);
                    kube_ops::done_if_gone_or_changed(
                        api.delete(&workload.name_any(), &DeleteParams::default()).await,
                    )?;
                }
                Effect::Event {
                    kind,
                    warning,
                    action,
                    note,
                } => {
                    if kind == EventKind::ScheduleTimeout {
                        metrics::get().schedule_timeouts.inc();
                    }
                    if kind == EventKind::SchedulerRefused {
                        metrics::get().scheduler_refusals.inc();
                    }
                    let type_ = if warning { EventType::Warning } else { EventType::Normal };
                    self.event(workload, type_, event_reason(kind), action, note);
                }
            }
            wrote |= write.is_some();
            if let (Some(state), Some(write)) = (state, write) {
                self.transition_checkpoint(FaultPoint::After(state, write)).await;
            }
        }
        Ok(wrote)
    }

    /// Gives `target` the `DisruptionTarget` condition before muster deletes it, as
    /// kube-scheduler's preemption does, so that a `podFailurePolicy` rule on
    /// `DisruptionTarget` can ignore its loss. Conditional on its uid.
    async fn mark_disrupted(
        &self,
        pods: &Api<Pod>,
        target: &muster_admission::PodRef,
        disruption: Disruption,
    ) -> Result<(), CommitError> {
        let message = match disruption {
            Disruption::Preemption => "muster: preempted to make room for a gang of higher priority",
            Disruption::Termination => "muster: the gang is taken apart to be placed again",
        };
        let patch = json!({
            "metadata": {"uid": target.uid},
            "status": {"conditions": [{
                "type": "DisruptionTarget",
                "status": "True",
                "reason": disruption.reason(),
                "message": message,
                "lastTransitionTime": super::now(),
            }]},
        });
        self.ensure_leading();
        kube_ops::done_if_gone_or_changed(
            pods.patch_status(&target.name, &PatchParams::default(), &Patch::Strategic(&patch))
                .await,
        )?;
        Ok(())
    }

    /// Releases the gang's planned pods `pins`, each pinned to its node, all at once: the
    /// claims that must list a pod first are listed (and protected) before, those that
    /// list every pod already are protected meanwhile (see [`Self::list_released_pods`]).
    pub(super) async fn release_pins(
        &self,
        workload: &Workload,
        pins: &[muster_admission::Pin],
    ) -> Result<(), CommitError> {
        let namespace = workload.namespace().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        // Claims that list every pod already are protected while the pods go.
        let listed = self.list_released_pods(workload, pins).await?;
        let protected = self.protect_listed(workload, listed);
        let released = self.write_all(pins, FaultPoint::AfterFirstRelease, |pin| {
            let api = pods.clone();
            let cached = self
                .gang_pods(workload)
                .into_iter()
                .find(|p| p.uid().as_deref() == Some(pin.pod.uid.as_str()));
            async move {
                self.ensure_leading();
                release::release(
                    &api,
                    &pin.pod.name,
                    &pin.pod.uid,
                    &pin.node,
                    cached.as_deref(),
                    self.settings.fencing,
                    &|| self.ensure_leading(),
                )
                .await
                .map_err(CommitError::from)
            }
        });
        let (released, protected) = futures::join!(released, protected);
        if let Err(e) = protected {
            // Protected on a later look at the released gang (`protect_released`).
            warn!(workload = %key(workload), error = %e, "protecting a released gang's claims failed");
        }
        for pod in released?.into_iter().flatten() {
            self.own_pods.remember(pod);
        }
        Ok(())
    }

    /// Claims a record stops naming (every one, when the gang is queued again): a fresh
    /// read must show each unallocated, or allocated for someone the gang may leave it to
    /// (see [`muster_admission::ownership::may_let_go`]: never a pod of the gang that is
    /// gone, nor one the caches cannot place), so that a cache behind an allocation never
    /// lets one leak. One another allocator made no longer lists the gang's pods still
    /// behind the gate ([`Self::let_go_of_found`]). Each unallocated one is then fenced: its resourceVersion
    /// moves, so an allocation a deposed leader prepared against an older version (it
    /// reads a claim before its last Lease check) fails instead of landing after the gang
    /// let go.
    pub(super) async fn fence_dropped_claims(
        &self,
        workload: &Workload,
        next: Option<&Journal>,
        api: &Api<ResourceClaim>,
    ) -> Result<(), CommitError> {
        let kept: BTreeSet<&str> = next.iter().flat_map(|j| &j.claims).map(String::as_str).collect();
        let named = placement_of(workload).map(|p| p.claims.clone()).unwrap_or_default();
        let gang = key(workload);
        let pods: Vec<PodView> = self.gang_pods(workload).iter().map(|p| observe::pod(p)).collect();
        let journal = observe::journal(workload);
        for name in named.iter().filter(|c| !kept.contains(c.as_str())) {
            let Some(claim) = api.get_opt(name).await? else {
                continue;
            };
            if ownership::allocated(&claim) {
                let seen = self.claim_view(workload, &claim);
                if muster_admission::ownership::may_let_go(&seen, &pods, journal.as_ref()) {
                    // One another allocator made no longer lists the gang's gated pods.
                    if !ownership::muster_allocated(&claim) {
                        self.let_go_of_found(workload, api, claim).await?;
                    }
                    continue;
                }
                return Err(CommitError::Conflict(format!(
                    "claim {name} is still allocated; looking again before {gang} lets go of it"
                )));
            }
            let fence = json!({
                "metadata": {
                    "resourceVersion": claim.resource_version(),
                    "annotations": {labels::CLAIM_RELEASED_AT: observe::now_millis().to_string()},
                },
            });
            self.ensure_leading();
            let params = PatchParams {
                field_manager: Some(labels::ADMISSION_FIELD_MANAGER.into()),
                ..PatchParams::default()
            };
            match api.patch(name, &params, &Patch::Merge(&fence)).await {
                Ok(fenced) => self.own_claims.remember(fenced),
                Err(e) if kube_ops::is_not_found(&e) => {}
                Err(e) if kube_ops::is_conflict(&e) => {
                    return Err(CommitError::Conflict(format!(
                        "claim {name} changed while {gang} let go of it; looking again"
                    )));
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Planned pods a record stops releasing that still wait at the gate — every one
    /// when the gang leaves `Reserved` or `Released` for a state that releases nothing,
    /// an extra being dropped — are fenced: each is patched against the version this loop saw, so
    /// that a release a deposed leader prepared against that version fails instead of
    /// landing after the gang let go of the pod's claims, and a pod released after all
    /// (the cache behind) makes the record wait for a fresher look.
    pub(super) async fn fence_unreleased_pods(
        &self,
        workload: &Workload,
        next: Option<&Journal>,
    ) -> Result<(), CommitError> {
        let Some(current) = observe::journal(workload) else {
            return Ok(());
        };
        let stops = current.may_release() && !next.is_some_and(Journal::may_release);
        let dropped: BTreeSet<&str> = current
            .pods
            .iter()
            .filter(|p| p.released_at.is_some())
            .filter(|p| {
                next.and_then(|n| n.planned(&p.name))
                    .is_none_or(|n| n.released_at.is_none())
            })
            .map(|p| p.name.as_str())
            .collect();
        if !stops && dropped.is_empty() {
            return Ok(());
        }
        self.fence_gated(workload, |name| {
            current.planned(name).is_some() && (stops || dropped.contains(name))
        })
        .await
    }

    /// Fences the gang's pods still behind the gate that `pick` names: each is patched
    /// against the version this loop saw, so that a release a deposed leader prepared
    /// against that version fails; a pod changed since (released after all, the cache
    /// behind) fails the fence, and the caller looks again.
    pub(super) async fn fence_gated(
        &self,
        workload: &Workload,
        pick: impl Fn(&str) -> bool,
    ) -> Result<(), CommitError> {
        for pod in self.gang_pods(workload) {
            let name = pod.name_any();
            if !crate::workload::status::is_gated(&pod) || !pick(&name) {
                continue;
            }
            if !self.fence_gated_pod(&pod).await? {
                return Err(CommitError::Conflict(format!(
                    "pod {name} changed while {} stopped releasing it; looking again",
                    key(workload)
                )));
            }
        }
        Ok(())
    }

    /// Before pods are released onto the claims of a gang, each claim lists them in
    /// `reservedFor` (see [`claim_writes::reservation_addition`]; for a claim another
    /// allocator made, [`Self::list_on_found`]), and a claim muster allocated that no other
    /// gang holds then gets delete-protection, so that kube-controller-manager deallocates
    /// it with its last pod (see [`claim_writes::commit_finalizers`]) instead of reserving
    /// it again and again for an ended pod. One with more consumers than `reservedFor`
    /// holds is neither listed nor protected. A claim that
    /// lost its allocation meanwhile stops the release; the next look sees it and places
    /// the gang again. Returns the claims that list every pod already (the commit listed
    /// them): they need protection only, which may land while the pods go
    /// ([`Self::protect_listed`]), since kube-controller-manager cannot take a claim
    /// from under a listed pod that exists.
    async fn list_released_pods(
        &self,
        workload: &Workload,
        pins: &[muster_admission::Pin],
    ) -> Result<Vec<Arc<ResourceClaim>>, CommitError> {
        let pods = self.gang_pods(workload);
        let claims: BTreeMap<String, Arc<ResourceClaim>> = self
            .gang_claims(workload)
            .into_iter()
            .map(|c| (c.name_any(), c))
            .collect();
        // Per claim: whether it is to be protected, and the pods released onto it.
        type Consumers = Vec<k8s_openapi::api::resource::v1::ResourceClaimConsumerReference>;
        let mut consumers: BTreeMap<String, (bool, Consumers)> = BTreeMap::new();
        for pin in pins {
            let Some(pod) = pods.iter().find(|p| p.uid().as_deref() == Some(pin.pod.uid.as_str())) else {
                continue;
            };
            for name in claim_writes::claim_names(pod) {
                let Some(claim) = claims.get(name) else { continue };
                // Only claims of muster's that no other gang holds are protected. Every
                // claim lists the pod, on condition it is still allocated: one not
                // protected by this release (another gang holds it too, or another
                // allocator made it) may be deallocated by kube-controller-manager with
                // its last pod before kube-scheduler lists this one, and kube-scheduler
                // would then allocate it itself, outside the plan.
                let to_protect = ownership::muster_allocated(claim)
                    && !self.claim_view_used_by(workload, claim, Vec::new()).held_elsewhere;
                let entry = consumers.entry(name.to_string()).or_insert((to_protect, Vec::new()));
                entry
                    .1
                    .push(k8s_openapi::api::resource::v1::ResourceClaimConsumerReference {
                        api_group: None,
                        resource: "pods".into(),
                        name: pin.pod.name.clone(),
                        uid: pin.pod.uid.clone(),
                    });
            }
        }
        // The gang's pods released onto a claim earlier are listed with these: one may not
        // be bound yet (kube-scheduler lists a pod when it binds it), and a protected
        // claim must not be deallocated under it when the pods listed so far end.
        for (name, (_, listed)) in consumers.iter_mut() {
            for pod in &pods {
                let ended = matches!(
                    pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Succeeded" | "Failed")
                );
                let Some(uid) = pod.uid() else { continue };
                if crate::workload::status::is_gated(pod)
                    || ended
                    || !claim_writes::names_claim(pod, name)
                    || listed.iter().any(|c| c.uid == uid)
                {
                    continue;
                }
                listed.push(k8s_openapi::api::resource::v1::ResourceClaimConsumerReference {
                    api_group: None,
                    resource: "pods".into(),
                    name: pod.name_any(),
                    uid,
                });
            }
        }
        // A claim whose consumers would not fit in `reservedFor` is left to kube-scheduler,
        // which refuses the pods beyond the limit (as the commit leaves it).
        consumers.retain(|name, (_, pods)| {
            let listed = claims[name].status.as_ref().and_then(|s| s.reserved_for.as_ref());
            let listed: Vec<&str> = listed.into_iter().flatten().map(|c| c.uid.as_str()).collect();
            let missing = pods.iter().filter(|p| !listed.contains(&p.uid.as_str())).count();
            listed.len() + missing <= claim_writes::RESERVED_FOR_MAX
        });
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
        // Listed already: protected while the pods go.
        let mut listed = Vec::new();
        consumers.retain(|name, (to_protect, pods)| {
            let claim = &claims[name];
            // One another allocator made always goes on, to be fenced.
            if ownership::muster_allocated(claim)
                && claim_writes::reservation_addition(claim, pods).is_none()
                && claim.status.as_ref().is_some_and(|s| s.allocation.is_some())
            {
                if !*to_protect {
                    return false;
                }
                listed.push(claim.clone());
                false
            } else {
                true
            }
        });
        if consumers.is_empty() {
            return Ok(listed);
        }
        let results: Vec<Result<Option<ResourceClaim>, CommitError>> = stream::iter(consumers)
            .map(|(name, (to_protect, consumers))| {
                let api = api.clone();
                let claim = claims[&name].clone();
                async move {
                    // One another allocator made is fenced first, listed or not: a
                    // removal a deposed leader prepared (a record that let go of it, which
                    // this leader did not follow) cannot land under pods released now.
                    if !ownership::muster_allocated(&claim) {
                        let fenced = self.fence_held_at(&api, (*claim).clone()).await?;
                        let Some(fenced) = fenced.filter(|f| {
                            f.metadata.uid == claim.metadata.uid
                                && super::found_claims::devices(f) == super::found_claims::devices(&claim)
                        }) else {
                            return Err(CommitError::Conflict(format!(
                                "claim {name} lost its allocation before its pods were released; looking again"
                            )));
                        };
                        let listed = self.list_on_found(&api, &fenced, &consumers).await?;
                        return Ok(Some(listed.unwrap_or(fenced)));
                    }
                    let mut current = None;
                    if let Some(patch) = claim_writes::reservation_addition(&claim, &consumers) {
                        let patch: json_patch::Patch =
                            serde_json::from_value(patch).map_err(kube::Error::SerdeError)?;
                        self.ensure_leading();
                        match api
                            .patch_status(&name, &PatchParams::default(), &Patch::Json::<()>(patch))
                            .await
                        {
                            Ok(written) => current = Some(written),
                            Err(e) if kube_ops::is_test_failed(&e) || kube_ops::is_not_found(&e) => {
                                return Err(CommitError::Conflict(format!(
                                    "claim {name} changed before its pods were released; looking again"
                                )));
                            }
                            Err(e) => return Err(e.into()),
                        }
                    } else if claim.status.as_ref().is_none_or(|s| s.allocation.is_none()) {
                        return Err(CommitError::Conflict(format!(
                            "claim {name} lost its allocation before its pods were released; looking again"
                        )));
                    }
                    let seen = current.as_ref().unwrap_or(&claim);
                    // Another gang that held it meanwhile fenced it (`held-at`): it is
                    // that gang's to give back then, not kube-controller-manager's.
                    let still_ours = claim_writes::held_at(seen) == claim_writes::held_at(&claim);
                    let finalizers =
                        claim_writes::commit_finalizers(seen.finalizers(), true).filter(|_| to_protect && still_ours);
                    if let Some(finalizers) = finalizers {
                        // Against the version just written or seen: a claim changed since
                        // is looked at again.
                        let patch = json!({
                            "metadata": {"finalizers": finalizers, "resourceVersion": seen.resource_version()},
                        });
                        self.ensure_leading();
                        match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                            Ok(written) => current = Some(written),
                            Err(e) if kube_ops::is_conflict(&e) || kube_ops::is_not_found(&e) => {
                                return Err(CommitError::Conflict(format!(
                                    "claim {name} changed before its pods were released; looking again"
                                )));
                            }
                            Err(e) => return Err(e.into()),
                        }
                    }
                    Ok(current)
                }
            })
            .buffer_unordered(self.settings.write_parallelism.max(1))
            .collect()
            .await;
        self.remember_claims(results)?;
        Ok(listed)
    }

    /// Gives delete-protection to `claims`, which list every pod of the gang released
    /// onto them (see [`Self::list_released_pods`]), each against the version seen.
    async fn protect_listed(&self, workload: &Workload, claims: Vec<Arc<ResourceClaim>>) -> Result<(), CommitError> {
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
        let results: Vec<Result<Option<ResourceClaim>, CommitError>> = stream::iter(claims)
            .map(|claim| {
                let api = api.clone();
                async move {
                    let name = claim.name_any();
                    let mut seen = (*claim).clone();
                    // Against the version seen; once more on a fresh read if another
                    // writer moved it (the protection does not depend on what changed,
                    // as long as the claim is still the allocation the pods were
                    // released onto).
                    let allocation = |c: &ResourceClaim| c.status.as_ref().and_then(|s| s.allocation.clone());
                    let listing = |c: &ResourceClaim| -> BTreeSet<String> {
                        c.status
                            .iter()
                            .flat_map(|s| s.reserved_for.iter().flatten())
                            .map(|r| r.uid.clone())
                            .collect()
                    };
                    for fresh in [false, true] {
                        if fresh {
                            self.ensure_leading();
                            match api.get_opt(&name).await? {
                                // Still the allocation the pods were released onto, listing
                                // every pod it did, and no other gang's since.
                                Some(current)
                                    if current.metadata.uid == claim.metadata.uid
                                        && allocation(&current) == allocation(&claim)
                                        && listing(&claim).is_subset(&listing(&current))
                                        && claim_writes::held_at(&current) == claim_writes::held_at(&claim) =>
                                {
                                    seen = current
                                }
                                _ => return Ok(None),
                            }
                        }
                        let Some(finalizers) = claim_writes::commit_finalizers(seen.finalizers(), true) else {
                            return Ok(None);
                        };
                        let patch = json!({
                            "metadata": {"finalizers": finalizers, "resourceVersion": seen.resource_version()},
                        });
                        self.ensure_leading();
                        match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                            Ok(written) => return Ok(Some(written)),
                            Err(e) if kube_ops::is_conflict(&e) && !fresh => {}
                            Err(e) if kube_ops::is_conflict(&e) || kube_ops::is_not_found(&e) => {
                                return Err(CommitError::Conflict(format!(
                                    "claim {name} changed while its pods were released"
                                )));
                            }
                            Err(e) => return Err(e.into()),
                        }
                    }
                    Ok(None)
                }
            })
            .buffer_unordered(self.settings.write_parallelism.max(1))
            .collect()
            .await;
        self.remember_claims(results)
    }

    /// Remembers every claim a batch of parallel writes left, then tells the first
    /// failure, if any: what landed is known before the error is.
    fn remember_claims<E>(&self, results: Vec<Result<Option<ResourceClaim>, E>>) -> Result<(), CommitError>
    where
        CommitError: From<E>,
    {
        let mut failed = None;
        for result in results {
            match result {
                Ok(Some(claim)) => self.own_claims.remember(claim),
                Ok(None) => {}
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        failed.map_or(Ok(()), |e| Err(e.into()))
    }

    /// Before muster deletes pods of a gang, its claims lose delete-protection: muster
    /// gives them back itself once the pods are gone, as the state machine orders it,
    /// rather than kube-controller-manager freeing each as its pod goes, at moments the
    /// admission loop's priority order does not see (a victim's devices would go to
    /// whichever gang plans first after the event). Protection is for pods that end by
    /// themselves.
    ///
    /// Only the claims the pods being deleted (`going`, by uid) leave with no other pod of
    /// the gang: a claim a pod that stays uses too is not freed by this deletion, and
    /// keeps its protection for when that pod ends (an extra dropped leaves the core's
    /// claims as they are).
    async fn unprotect_claims(&self, workload: &Workload, going: &BTreeSet<&str>) -> Result<(), CommitError> {
        let named: BTreeSet<String> = placement_of(workload)
            .map(|p| p.claims.iter().cloned().collect())
            .unwrap_or_default();
        let pods = self.gang_pods(workload);
        let freed = |claim: &ResourceClaim| {
            let name = claim.name_any();
            let users: Vec<String> = pods
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none() && claim_writes::names_claim(p, &name))
                .filter_map(|p| p.uid())
                .collect();
            users.iter().all(|u| going.contains(u.as_str()))
        };
        let protected: Vec<Arc<ResourceClaim>> = self
            .gang_claims(workload)
            .into_iter()
            .filter(|c| named.contains(&c.name_any()) && ownership::muster_allocated(c))
            .filter(|c| c.finalizers().iter().any(|f| f == labels::DELETE_PROTECTION_FINALIZER))
            .filter(|c| freed(c))
            .collect();
        if protected.is_empty() {
            return Ok(());
        }
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
        let results: Vec<Result<(), kube::Error>> = stream::iter(&protected)
            .map(|claim| {
                self.ensure_leading();
                kube_ops::remove_finalizer(&api, claim.as_ref(), labels::DELETE_PROTECTION_FINALIZER)
            })
            .buffer_unordered(self.settings.write_parallelism.max(1))
            .collect()
            .await;
        for result in results {
            match result {
                Ok(()) => {}
                // Changed meanwhile (the finalizer moved or went): looked at again.
                Err(e) if kube_ops::is_test_failed(&e) => {
                    return Err(CommitError::Conflict(format!(
                        "a claim of {} changed while its protection was taken off; looking again",
                        key(workload)
                    )));
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// A state machine's fault point: aborts (or pauses) at its first write only, so a
    /// restarted operator can get past it.
    pub(super) async fn transition_checkpoint(&self, point: FaultPoint) {
        if !crate::ops::faults::COMPILED_IN
            || (self.settings.fault != Some(point) && self.settings.pause.as_ref().is_none_or(|p| p.point != point))
        {
            return;
        }
        if self
            .passed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(point.name())
        {
            self.checkpoint(point).await;
        }
    }
}
