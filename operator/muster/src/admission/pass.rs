//! One pass of the admission loop: every placed gang takes a step of its state machine,
//! then waiting gangs are planned in priority-then-age order. Each planned gang's commit
//! starts at once and runs while the pass goes on planning the next ones against the
//! plans assumed (a bounded number in flight, with no barrier between them).

use crate::cache::gang_index::GangIndex;
use crate::convert;
use crate::workload::observe;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use muster_admission::Journal;
use muster_api::v1alpha1::{AdmissionState, Workload};
use muster_engine::cluster::PlanId;
use muster_engine::key::ObjectKey;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::warn;

use super::extras::ExtrasPlan;
use super::ownership::Holders;
use super::queue::{Admit, Attempt, Planned, PlannedGang};
use super::waiting::{Held, HoldReason, Waiting};
use super::{Admission, key, placement_of, record_phases};

/// How soon a gang or extras kept off nodes held for a retry look again: the hold ends
/// with no watch event to say so.
const RETRY_HOLD_POLL: Duration = Duration::from_millis(500);

impl Admission {
    /// One look at every gang. Returns how long to wait at most before the next pass.
    pub(super) async fn pass(&mut self) -> Duration {
        // A safety net: every event wakes the loop anyway.
        let mut next = Duration::from_secs(5);
        if self.schema_is_outdated() {
            tracing::error!("admission stopped: the Workload CRD is older than this operator (see the first error)");
            return Duration::from_secs(60);
        }
        // What changed, taken before anything is read: a change recorded later is
        // stepped by the next pass, never lost between a read and the take.
        let changes = self.index.touched.take();
        let workloads = self.current_workloads();
        self.answered_retry.lock().unwrap_or_else(|p| p.into_inner()).clear();
        *self.gangs.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(GangIndex::of(&self.stores));
        *self.holders() = Holders::of(&workloads);
        self.reconcile_assumptions(&workloads);
        self.hold_nominations(&workloads).await;
        self.prune_conflicts(&workloads);
        self.places.keep_only(&workloads.iter().map(|w| key(w)).collect());
        self.work().keep_only(&workloads.iter().map(|w| key(w)).collect());
        // Only gangs queued or being undone keep nodes for a retry: one whose commit went
        // through after all (the state machine finished it) keeps nothing.
        self.retry_holds().keep_only(
            &workloads
                .iter()
                .filter(|w| {
                    placement_of(w)
                        .and_then(|p| p.state)
                        .is_none_or(|s| s == AdmissionState::Reserving)
                })
                .map(|w| key(w))
                .collect(),
        );
        let strays = self.relabel_stray_claims().await;
        self.collect_claims(strays).await;
        let keys = |store: Vec<Arc<Pod>>| -> BTreeSet<ObjectKey> {
            store.iter().map(|p| convert::object_key(p.as_ref())).collect()
        };
        let pods = keys(self.stores.pods.state());
        self.own_pods.prune(|k| pods.contains(k));
        let claims: BTreeSet<ObjectKey> = self
            .stores
            .claims
            .state()
            .iter()
            .map(|c| convert::object_key(c.as_ref()))
            .collect();
        self.own_claims.prune(|k| claims.contains(k));

        // The gangs something happened to take a step (see `work`).
        let selection = {
            let cluster = self.index.cluster();
            let holders = self.holders();
            self.work()
                .select(changes, &workloads, &holders, &cluster, Instant::now())
        };
        // Released gangs that may have extras waiting: placed in the queue below.
        let mut with_extras: HashMap<ObjectKey, Journal> = HashMap::new();
        // Released gangs not stepped whose extras wait: tried this pass if the cluster
        // changed since (decided below, on the pass's one count of changes).
        let mut extras_waiting: Vec<(ObjectKey, Journal)> = Vec::new();
        for workload in workloads.iter().filter(|w| w.metadata.deletion_timestamp.is_none()) {
            let gang = key(workload);
            if !selection.contains(&gang) {
                if self.work().extras_waiting(&gang)
                    && let Some(journal) = observe::journal(workload)
                    && self.may_place_extras(workload, &journal)
                {
                    extras_waiting.push((gang, journal));
                }
                continue;
            }
            let mut asked = Duration::MAX;
            // Its newest copy: a write earlier in this pass (an eviction) may be its.
            let stepped = self.advance(&self.newest(workload), &mut asked).await;
            let recheck = (asked < Duration::MAX).then(|| Instant::now() + asked);
            next = next.min(asked);
            match stepped {
                Ok((idle, extras_of)) => {
                    self.work().stepped(&gang, !idle, recheck);
                    match extras_of {
                        Some(journal) => {
                            with_extras.insert(gang, journal);
                        }
                        // A step that wrote says nothing of its extras: those waiting
                        // keep waiting (room that comes free is still theirs first).
                        None if !idle && self.work().extras_waiting(&gang) => {
                            let current = self.newest(workload);
                            if let Some(journal) = observe::journal(&current)
                                && self.may_place_extras(&current, &journal)
                            {
                                extras_waiting.push((gang, journal));
                            }
                        }
                        None => self.work().extras_placed_or_gone(&gang),
                    }
                }
                Err(e) => {
                    warn!(workload = %gang, error = %e, "admission step failed; retrying");
                    let retry = Instant::now() + Duration::from_secs(2);
                    self.work()
                        .stepped(&gang, false, Some(recheck.map_or(retry, |at| at.min(retry))));
                    next = next.min(Duration::from_secs(2));
                }
            }
        }
        // Gangs that asked to be looked at by a time, stepped this pass or not.
        if let Some(at) = self.work().next_recheck() {
            next = next.min(at.saturating_duration_since(Instant::now()));
        }
        if self.work().busy() {
            next = Duration::ZERO;
        }
        // Kueue hears where each gang stands after its step, not before.
        self.sync_kueue().await;

        // The one count of cluster changes this pass looks at, after the steps (whose
        // writes free room): whatever comes later is room that appeared during the pass
        // (see `room_goes_to_passed_over`).
        let changes = self.index.changes();
        // Extras that did not fit are tried again once the cluster changed. Those that
        // saw the cluster as it is are not, but room that appears during the pass is
        // theirs before a gang of lower priority takes it.
        let mut standing_extras: HashMap<ObjectKey, Journal> = HashMap::new();
        for (gang, journal) in extras_waiting {
            if self.work().extras_due(&gang, changes) {
                with_extras.insert(gang, journal);
            } else {
                standing_extras.insert(gang, journal);
            }
        }

        let created = |w: &Workload| {
            w.metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0)
                .unwrap_or(Timestamp::UNIX_EPOCH)
        };
        // Waiting gangs, and the waiting extras of released ones, each at its gang's
        // priority: room goes by priority whether a gang or a gang's extras would take it.
        let mut queue: Vec<Entry> = workloads
            .iter()
            .filter(|w| match self.not_admissible(w) {
                None => true,
                Some(why) => {
                    tracing::debug!(workload = %key(w), why, "gang not queued");
                    false
                }
            })
            .map(|w| Entry {
                priority: self.priority(w),
                created: created(w),
                name: key(w),
                workload: w.clone(),
                extras_of: None,
            })
            .collect();
        let gangs_queued = queue.len();
        queue.extend(workloads.iter().filter_map(|w| {
            let journal = with_extras.remove(&key(w))?;
            Some(Entry {
                priority: self.priority(w),
                created: created(w),
                name: key(w),
                workload: w.clone(),
                extras_of: Some(journal),
            })
        }));
        // Within a priority: replacements for vacated places first, then waiting gangs,
        // then extras (see `Standing`).
        queue.sort_by(|a, b| {
            b.priority
                .cmp(&a.priority)
                .then(a.standing().cmp(&b.standing()))
                .then(a.created.cmp(&b.created))
                .then(a.name.cmp(&b.name))
        });
        record_phases(&workloads, gangs_queued);
        // Only gangs in the queue wait; a suspended or finished one starts afresh.
        let queued: BTreeSet<ObjectKey> = queue
            .iter()
            .filter(|e| e.extras_of.is_none())
            .map(|e| e.name.clone())
            .collect();
        self.waiting().retain(|k, _| queued.contains(k));
        // A gang back in the queue after its failed commit was undone keeps its backoff.
        {
            let mut waiting = self.waiting();
            let holds = self.retry_holds();
            let now = Instant::now();
            for gang in &queued {
                if !waiting.contains_key(gang)
                    && let Some(at) = holds.next_try(gang)
                {
                    waiting.insert(gang.clone(), Waiting::retrying(now, at));
                }
            }
        }

        // A gang of lower priority is not planned while one of higher priority, waiting
        // for capacity, has not looked at the same change yet: that one is due as well.
        // Extras are looked at every pass.
        let due: Vec<bool> = queue
            .iter()
            .map(|e| e.extras_of.is_some() || self.waiting().get(&e.name).is_none_or(|w| w.due(changes)))
            .collect();
        let lower_due = due_below(&queue.iter().map(|e| e.priority).collect::<Vec<_>>(), &due);
        let due: Vec<bool> = queue
            .iter()
            .enumerate()
            .map(|(i, e)| {
                due[i]
                    || (lower_due[i]
                        && self
                            .waiting()
                            .get(&e.name)
                            .is_some_and(|w| w.reach.is_some() && w.changes_seen != changes))
            })
            .collect();
        // Nodes kept for gangs whose commit did not go through, queued or being undone.
        let per_namespace = self.settings.preemption_scope == super::preemption_scope::PreemptionScope::Namespace;
        let mut held = Held::new(per_namespace);
        self.retry_holds().hold_into(&mut held, Instant::now());
        // Commits under way, and those that ended while the pass was busy elsewhere.
        let this = &*self;
        let commit = |gang: PlannedGang| async move {
            let outcome = this.commit_planned(&gang.workload, &gang.request, &gang.plan).await;
            (gang, outcome)
        };
        let mut in_flight = FuturesUnordered::new();
        let mut ended = Vec::new();
        // Whether room appeared during the pass that no watch event tells of: a commit
        // that did not go through gave back what its plan had taken.
        let mut room_freed = false;
        // Within a pass the cluster only fills up: a gang shaped like one that did not
        // fit does not fit either, and is not planned again.
        let mut unfit: HashMap<String, (String, Planned)> = HashMap::new();
        // The gangs, and gangs' extras, this pass found no room for (or did not try).
        let mut passed_over: Vec<PassedOver> = workloads
            .iter()
            .filter_map(|w| {
                let journal = standing_extras.remove(&key(w))?;
                Some(PassedOver::new(self.priority(w), w.clone(), Some(journal)))
            })
            .collect();
        for (entry, due) in queue.into_iter().zip(due) {
            let Entry {
                priority,
                name,
                workload,
                extras_of,
                ..
            } = entry;
            if let Some(journal) = extras_of {
                let current = self.current_workload(&name).unwrap_or(workload);
                // Only on the journal the gang was last seen with: the pass may have
                // written its status since (a victim evicted), and the extras' record
                // would be made over that.
                if observe::journal(&current).as_ref() != Some(&journal) || !self.may_place_extras(&current, &journal) {
                    self.work().extras_wait(&name, changes.wrapping_sub(1));
                    continue;
                }
                let planned = alongside(&mut in_flight, &mut ended, self.plan_extras(&current, &journal, &held)).await;
                room_freed |= self.settle_commits(&mut ended, changes, &mut held, &mut next);
                match planned {
                    Ok(ExtrasPlan::Fit(planned)) => {
                        // Room that appeared during the pass goes to a gang of higher
                        // priority the pass passed over, if it fits now: next pass, before
                        // these extras. Looked at after the extras' plan, so on a view at
                        // least as new as theirs: any room they would take, it has seen.
                        if self
                            .room_goes_to_passed_over(
                                &passed_over,
                                priority,
                                &held,
                                room_freed,
                                changes,
                                &mut in_flight,
                                &mut ended,
                            )
                            .await
                        {
                            next = Duration::ZERO;
                            break;
                        }
                        // A commit that failed meanwhile keeps the nodes it planned.
                        let held_now = held.against(priority, &name);
                        if planned.nodes().any(|n| held_now.contains(n)) {
                            self.work().extras_wait(&name, changes.wrapping_sub(1));
                            next = next.min(RETRY_HOLD_POLL);
                            continue;
                        }
                        match alongside(
                            &mut in_flight,
                            &mut ended,
                            self.commit_extras(&current, &journal, *planned),
                        )
                        .await
                        {
                            // Those that did not fit yet still wait: they look again next
                            // pass, and room that appears during this one is theirs before a
                            // gang of lower priority takes it.
                            Ok(()) => {
                                self.work().extras_wait(&name, changes.wrapping_sub(1));
                                if let Some(current) = self.current_workload(&name)
                                    && let Some(journal) = observe::journal(&current)
                                {
                                    passed_over.push(PassedOver::new(priority, current, Some(journal)));
                                }
                            }
                            Err(e) => {
                                warn!(workload = %name, error = %e, "placing extras failed; retrying");
                                self.work().extras_wait(&name, changes.wrapping_sub(1));
                                next = next.min(Duration::from_secs(2));
                            }
                        }
                    }
                    Ok(ExtrasPlan::NoneWaiting) => self.work().extras_placed_or_gone(&name),
                    // Room that appears later in the pass is theirs before a gang of
                    // lower priority takes it; later passes try them once the cluster
                    // changed.
                    Ok(ExtrasPlan::Wait) => {
                        // Nodes kept for a retry come free with no change to tell of it.
                        if held.retrying_against(priority, &name) {
                            self.work().extras_wait(&name, changes.wrapping_sub(1));
                            next = next.min(RETRY_HOLD_POLL);
                        } else {
                            self.work().extras_wait(&name, changes);
                        }
                        passed_over.push(PassedOver::new(priority, current, Some(journal)));
                    }
                    Err(e) => {
                        warn!(workload = %name, error = %e, "placing extras failed; retrying");
                        self.work().extras_wait(&name, changes.wrapping_sub(1));
                        next = next.min(Duration::from_secs(2));
                    }
                }
                room_freed |= self.settle_commits(&mut ended, changes, &mut held, &mut next);
                continue;
            }
            // The cache may not show this pass's own commits yet.
            if self
                .written
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&name)
                .is_some_and(|w| placement_of(w).and_then(|p| p.state).is_some())
            {
                continue;
            }
            // Its newest copy: an earlier step of this pass may have written its status.
            let workload = self.current_workload(&name).unwrap_or(workload);
            // The queue is in priority order: every gang holding nodes so far has at
            // least this one's priority.
            let waiting = self.waiting().get(&name).cloned();
            if let Some(waiting) = waiting
                && !due
            {
                let wake = waiting.lapse.map_or(waiting.next_try, |l| l.min(waiting.next_try));
                next = next.min(
                    wake.saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(100)),
                );
                if waiting.since.elapsed() > self.settings.starvation_after
                    && let Some(reach) = &waiting.reach
                {
                    held.hold(priority, &name, reach, HoldReason::WaitedLongest);
                }
                continue;
            }
            let tried = alongside(
                &mut in_flight,
                &mut ended,
                self.try_plan(&workload, priority, &held, &mut unfit),
            )
            .await;
            room_freed |= self.settle_commits(&mut ended, changes, &mut held, &mut next);
            let outcome = match tried {
                Ok(Attempt::Placed { request, plan }) => {
                    // Room can appear while a pass runs (kube-controller-manager frees a
                    // protected claim when its pod ends): a gang of higher priority this
                    // pass passed over may fit now, and goes first, in the next pass.
                    if self
                        .room_goes_to_passed_over(
                            &passed_over,
                            priority,
                            &held,
                            room_freed,
                            changes,
                            &mut in_flight,
                            &mut ended,
                        )
                        .await
                    {
                        next = Duration::ZERO;
                        break;
                    }
                    // It tried again: what it kept for that is its plan's now.
                    held.release_retrying(&name);
                    // The gangs planned after this one must see its devices and pods as
                    // taken. Its nomination, if it has one, holds on beside its plan until
                    // it is released: the plan may use only some of the nominated devices,
                    // and a commit that fails gives the rest back to nobody else.
                    let (pods, claims) = plan.assumption(&request);
                    self.index
                        .update(|c| c.assume(&PlanId::Gang(name.clone()), &pods, &claims));
                    in_flight.push(commit(PlannedGang {
                        name,
                        priority,
                        workload,
                        request: *request,
                        plan: *plan,
                    }));
                    // At most so many at once: the next gang is planned once one ends.
                    if in_flight.len() >= self.settings.commit_parallelism.max(1)
                        && let Some(done) = in_flight.next().await
                    {
                        ended.push(done);
                    }
                    room_freed |= self.settle_commits(&mut ended, changes, &mut held, &mut next);
                    continue;
                }
                Ok(Attempt::HeldForRetry) => {
                    // Planned again once the gangs keeping nodes for a retry have tried.
                    next = next.min(RETRY_HOLD_POLL);
                    continue;
                }
                Ok(Attempt::Stale) => {
                    tracing::debug!(workload = %name, "gang uses a claim allocated meanwhile; planned next pass");
                    // It uses a claim that a planned commit allocates, or that the index
                    // shows allocated before the cache does: planned again next pass.
                    // The gangs behind it go on (a claim's cache may lag for long).
                    next = next.min(Duration::from_millis(100));
                    continue;
                }
                Ok(Attempt::Done(admit)) => {
                    // A gang that would fit an emptied cluster may evict gangs of lower
                    // priority, unless Kueue manages it (its own preemption decides).
                    let preempted = if matches!(&admit, Admit::DoesNotFit { reach: Some(_) })
                        && self.kueue_object(&workload).is_not_queued()
                    {
                        // On its newest copy: planning may just have written its status.
                        let current = self.current_workload(&name).unwrap_or_else(|| workload.clone());
                        alongside(&mut in_flight, &mut ended, self.try_preempt(&current, priority)).await
                    } else {
                        Ok(())
                    };
                    room_freed |= self.settle_commits(&mut ended, changes, &mut held, &mut next);
                    // A preemption that failed is tried again after a backoff, whether
                    // or not the cluster changes meanwhile.
                    preempted.map(|()| admit)
                }
                Err(e) => Err(e),
            };
            let fits_nowhere = matches!(outcome, Ok(Admit::DoesNotFit { .. }));
            if fits_nowhere {
                passed_over.push(PassedOver::new(priority, workload.clone(), None));
            }
            self.settle_attempt(&name, priority, outcome, None, changes, &mut held, &mut next);
            // Kept off nodes by refusals: tried again once the first lapses, even if
            // nothing else changes by then.
            if fits_nowhere
                && let Some(lapse) = super::refusals::lapses_in(&workload, crate::workload::observe::now_millis())
                && let Some(waiting) = self.waiting().get_mut(&name)
            {
                waiting.lapse = Some(Instant::now() + lapse);
                next = next.min(lapse + Duration::from_millis(100));
            }
        }
        while let Some(done) = in_flight.next().await {
            ended.push(done);
        }
        drop(in_flight);
        // Room a failed commit gave back goes to the gangs passed over, next pass at once.
        if self.settle_commits(&mut ended, changes, &mut held, &mut next) && !passed_over.is_empty() {
            self.make_due(&passed_over, changes);
            next = Duration::ZERO;
        }
        next
    }
}

impl Admission {
    /// Settles the commits that ended (see `settle_attempt`). Returns whether one of them
    /// did not commit: what it had taken is free again, with no watch event to say so.
    /// A gang whose commit failed keeps the nodes its plan took until it tries again
    /// (see `super::waiting::RetryHolds`).
    fn settle_commits(
        &self,
        ended: &mut Vec<(PlannedGang, Result<Admit, super::CommitError>)>,
        changes: u64,
        held: &mut Held,
        next: &mut Duration,
    ) -> bool {
        let mut freed = false;
        for (gang, outcome) in ended.drain(..) {
            freed |= !matches!(outcome, Ok(Admit::Committed));
            self.settle_attempt(
                &gang.name,
                gang.priority,
                outcome,
                Some(&gang.plan),
                changes,
                held,
                next,
            );
        }
        freed
    }

    /// Whether room that appeared since the pass began (`room_freed`, or a watch event
    /// past `changes`) goes first to a gang of higher priority than `priority` the pass
    /// passed over (or its extras), because it fits now: the pass then stops, and they
    /// are due at once in the next. Commits in flight go on meanwhile.
    #[allow(clippy::too_many_arguments)]
    async fn room_goes_to_passed_over<C: Future>(
        &self,
        passed_over: &[PassedOver],
        priority: i32,
        held: &Held,
        room_freed: bool,
        changes: u64,
        in_flight: &mut FuturesUnordered<C>,
        ended: &mut Vec<C::Output>,
    ) -> bool {
        if !room_freed && self.index.changes() == changes {
            return false;
        }
        if !alongside(
            in_flight,
            ended,
            self.one_passed_over_fits(passed_over, priority, held, room_freed),
        )
        .await
        {
            return false;
        }
        self.make_due(passed_over, changes);
        true
    }

    /// Makes the gangs (and extras) the pass passed over due in the next pass, whether or
    /// not the cluster shows a change by then: room appeared that they may fit in (a
    /// commit that did not go through leaves no watch event).
    fn make_due(&self, passed_over: &[PassedOver], changes: u64) {
        for over in passed_over {
            let name = key(&over.workload);
            if over.extras_of.is_some() {
                self.work().extras_wait(&name, changes.wrapping_sub(1));
            } else if let Some(waiting) = self.waiting().get_mut(&name) {
                waiting.next_try = Instant::now();
                waiting.changes_seen = changes.wrapping_sub(1);
            }
        }
    }

    /// Whether a gang of higher priority than `priority` that this pass found no room for,
    /// or the waiting extras of one, fits the cluster as it is now (planned again, with
    /// no shortcut by shape).
    async fn one_passed_over_fits(
        &self,
        passed_over: &[PassedOver],
        priority: i32,
        held: &Held,
        room_freed: bool,
    ) -> bool {
        for higher in passed_over.iter().filter(|p| p.priority > priority) {
            // Planned again only once the cluster moved since it last did not fit.
            let seen = (self.index.changes(), room_freed);
            if higher.checked.get() == Some(seen) {
                continue;
            }
            let workload = &self
                .current_workload(&key(&higher.workload))
                .unwrap_or_else(|| higher.workload.clone());
            let fits = match &higher.extras_of {
                // Only extras the pass would place: on the journal they were seen with.
                Some(journal) => {
                    observe::journal(workload).as_ref() == Some(journal)
                        && self.may_place_extras(workload, journal)
                        && matches!(self.plan_extras(workload, journal, held).await, Ok(ExtrasPlan::Fit(_)))
                }
                None => matches!(
                    self.try_plan(workload, higher.priority, held, &mut HashMap::new())
                        .await,
                    Ok(Attempt::Placed { .. })
                ),
            };
            if fits {
                return true;
            }
            higher.checked.set(Some(seen));
        }
        false
    }
}

/// A gang waiting to be placed, or (`extras_of`: its journal) a released gang's waiting
/// extras.
struct Entry {
    priority: i32,
    created: Timestamp,
    name: ObjectKey,
    workload: Arc<Workload>,
    extras_of: Option<Journal>,
}

/// Where an entry of the queue stands among those of its priority, first to last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Standing {
    /// The waiting pods of a running gang short of a member its controller replaces: the
    /// gang holds its other members' devices meanwhile (for at most the schedule
    /// timeout), so its replacements go before a gang that holds nothing yet.
    Replacements,
    /// A gang waiting to be placed.
    Gang,
    /// The pods beyond a running gang's minCount: they yield to a gang that cannot start
    /// (and to the nodes it keeps).
    Extras,
}

impl Standing {
    fn of(extras_of: Option<&Journal>) -> Standing {
        match extras_of {
            None => Standing::Gang,
            Some(journal) if !journal.vacancies.is_empty() => Standing::Replacements,
            Some(_) => Standing::Extras,
        }
    }
}

impl Entry {
    fn standing(&self) -> Standing {
        Standing::of(self.extras_of.as_ref())
    }
}

/// A gang (or, with `extras_of`, a released gang's waiting extras) the pass found no
/// room for.
struct PassedOver {
    priority: i32,
    /// The count of cluster changes, and whether a failed commit had freed room, when
    /// it was last found not to fit during the pass: not planned again until either
    /// moves.
    checked: std::cell::Cell<Option<(u64, bool)>>,
    workload: Arc<Workload>,
    extras_of: Option<Journal>,
}

impl PassedOver {
    fn new(priority: i32, workload: Arc<Workload>, extras_of: Option<Journal>) -> Self {
        PassedOver {
            priority,
            checked: Default::default(),
            workload,
            extras_of,
        }
    }
}

/// Runs `work` while the commits `in_flight` go on, keeping those that end in `ended`.
async fn alongside<W: Future, C: Future>(
    in_flight: &mut FuturesUnordered<C>,
    ended: &mut Vec<C::Output>,
    work: W,
) -> W::Output {
    let mut work = std::pin::pin!(work);
    loop {
        tokio::select! {
            biased;
            out = &mut work => return out,
            Some(done) = in_flight.next(), if !in_flight.is_empty() => ended.push(done),
        }
    }
}

/// For each gang of a queue in priority order (`priorities`, highest first): whether a
/// gang of lower priority behind it is `due`.
fn due_below(priorities: &[i32], due: &[bool]) -> Vec<bool> {
    let mut below = vec![false; priorities.len()];
    // Whether some gang from here to the end is due, and whether one of a priority
    // lower than the current block's is.
    let mut any_due = false;
    let mut lower = false;
    let mut i = priorities.len();
    while i > 0 {
        // One block of equal priority, from its end.
        let end = i;
        let priority = priorities[i - 1];
        while i > 0 && priorities[i - 1] == priority {
            i -= 1;
        }
        for flag in &mut below[i..end] {
            *flag = lower;
        }
        any_due |= due[i..end].iter().any(|d| *d);
        lower = any_due;
    }
    below
}

#[cfg(test)]
mod tests {
    use super::{Standing, due_below};

    #[test]
    fn replacements_go_before_waiting_gangs_and_extras_after_them() {
        let mut journal = muster_admission::Journal::finished(0);
        assert_eq!(Standing::of(None), Standing::Gang);
        assert_eq!(Standing::of(Some(&journal)), Standing::Extras);
        journal.vacancies.push(muster_admission::Vacancy {
            pod: "job-0".into(),
            group: None,
            index: None,
            node: "n1".into(),
            devices: vec![],
            since: 0,
        });
        assert_eq!(Standing::of(Some(&journal)), Standing::Replacements);
        assert!(Standing::Replacements < Standing::Gang && Standing::Gang < Standing::Extras);
    }

    #[test]
    fn a_gang_is_due_when_one_of_lower_priority_behind_it_is() {
        let priorities = [9, 9, 5, 5, 1];
        assert_eq!(
            due_below(&priorities, &[false, false, false, false, true]),
            [true, true, true, true, false]
        );
        assert_eq!(
            due_below(&priorities, &[false, false, false, true, false]),
            [true, true, false, false, false],
            "one of equal priority does not count"
        );
        assert_eq!(due_below(&priorities, &[true, false, false, false, false]), [false; 5]);
    }
}
