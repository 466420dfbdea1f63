//! The queue of gangs waiting for admission: which are admissible, in which order, how
//! each is planned against the engine's snapshot (with the starvation rule's held
//! nodes), and how a failed attempt waits before the next.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::runtime::events::EventType;
use muster_api::conditions;
use muster_api::v1alpha1::Workload;
use muster_engine::key::{ClaimKey, ObjectKey};
use muster_engine::placement::{self, Outcome, Plan, PlanOptions};
use muster_engine::request::GangRequest;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::admission::request::{ClaimSources, RequestError, gang_request};
use crate::ops::metrics::{self, OutcomeLabel};
use crate::workload::admitted::PodDefaults;
use crate::workload::extended::ExtendedResources;
use crate::workload::membership;
use crate::workload::observe::{condition, finished};

use super::gang_priority;
use super::preempt::nomination_of;
use super::waiting::{Ended, Held, HoldReason, Waiting};
use super::{Admission, CommitError, key, placement_of};

/// How long Kueue waits before it gives quota again to a gang whose devices muster could
/// not reserve inside Kueue's decision.
pub(super) const KUEUE_RETRY_SECONDS: i64 = 15;
/// How long Kueue may hold quota for a gang whose request waits for an object to
/// appear (its pods, a claim) before muster gives the quota back for a while.
pub(super) const KUEUE_WAIT_GRACE: std::time::Duration = std::time::Duration::from_secs(60);
/// Kueue's first requeue for a gang that would not fit even on the emptied cluster as
/// it is now, or whose request the cluster may still mend; later ones back off.
pub(super) const KUEUE_RETRY_NEVER_FIT_SECONDS: i64 = 60;

/// What came of planning a queued gang: a plan, and what the starvation rule needs to
/// know when it does not fit.
#[derive(Clone)]
pub(super) struct Planned {
    pub(super) outcome: Outcome,
    /// The nodes it could use on the cluster with nothing else on it, if it would fit
    /// there.
    pub(super) reach: Option<Arc<BTreeSet<String>>>,
    /// It would have fit but for nodes held for gangs that waited longest.
    pub(super) held_back: bool,
}

/// What a gang that has waited longest holds, given its plan on the emptied cluster:
/// every node it could use, or every node at all if it needs devices that are not tied
/// to one node (a network-attached pool serves many nodes, and holding nodes would not
/// keep others off those devices).
pub(super) fn reach(
    empty: &muster_engine::cluster::ClusterState,
    request: &GangRequest,
    plan: &Plan,
    options: &PlanOptions,
) -> BTreeSet<String> {
    if node_local(plan) {
        placement::reachable_nodes(empty, request, options)
    } else {
        empty.nodes().map(|n| n.name.clone()).collect()
    }
}

/// Whether every device a plan takes is tied to one of its nodes.
fn node_local(plan: &Plan) -> bool {
    let planned: BTreeSet<String> = plan.nodes().into_iter().collect();
    plan.claims.iter().all(|c| {
        c.allocation.node_selector.as_ref().is_some_and(|s| {
            planned
                .iter()
                .any(|n| *s == muster_engine::selector::NodeSelector::for_node(n))
        })
    })
}

/// What decides whether a gang fits, without the names of its pods and claims: two
/// gangs with one signature fit or do not fit alike.
pub(super) fn shape_signature(request: &GangRequest) -> String {
    let groups: Vec<String> = request
        .groups
        .iter()
        .map(|g| {
            let allocations: Vec<Vec<_>> = g
                .pods
                .iter()
                .map(|p| p.claims.iter().map(|c| &c.allocation).collect())
                .collect();
            format!("{}/{}/{:?}/{allocations:?}", g.min_count, g.pods.len(), g.shape)
        })
        .collect();
    let shared: Vec<_> = request.shared_claims.iter().map(|c| (&c.spec, &c.allocation)).collect();
    format!("{groups:?}|{shared:?}|{:?}", request.topology)
}

/// How planning a gang ended.
pub(super) enum Attempt {
    /// It fits: commit this plan.
    Placed {
        request: Box<GangRequest>,
        plan: Box<Plan>,
    },
    /// Not planned: the caches are behind the index on one of its claims.
    Stale,
    /// It would fit but for nodes kept for gangs whose commit did not go through: they
    /// try again shortly, so it writes nothing, answers Kueue nothing, preempts nobody.
    HeldForRetry,
    Done(Admit),
}

/// Whether the request takes a claim as unallocated that the index holds allocated: a
/// gang committed in this pass allocates it, or the claim cache has not caught up with
/// an allocation yet. Planned on that view, the claim would be allocated twice.
pub(super) fn uses_a_claim_allocated_meanwhile(
    request: &GangRequest,
    cluster: &muster_engine::cluster::ClusterState,
) -> bool {
    let shared = request
        .shared_claims
        .iter()
        .filter(|c| c.allocation.is_none())
        .map(|c| &c.key);
    let own = request
        .groups
        .iter()
        .flat_map(|g| &g.pods)
        .flat_map(|p| p.claims.iter().filter(|c| c.allocation.is_none()).map(|c| &c.key));
    shared.chain(own).any(|key| cluster.claim_allocated(key))
}

/// A claim the request would hold as it is (allocated already) whose devices are held
/// against the rules (see [`super::conflicts`]).
pub(super) fn doubly_held_claim<'r>(
    request: &'r GangRequest,
    cluster: &muster_engine::cluster::ClusterState,
) -> Option<&'r muster_engine::key::ClaimKey> {
    found_allocations(request)
        .find(|(_, allocation)| {
            allocation
                .devices
                .iter()
                .filter(|d| d.admin_access != Some(true))
                .any(|d| super::conflicts::doubly_held(cluster, &d.device_id(), d.share_id.is_some()))
        })
        .map(|(key, _)| key)
}

/// A claim the request would hold as it is whose device a nomination in `cluster` (one
/// the gang may not plan through: its own and those of lower priority are left out of
/// its view) holds for another claim. A fresh allocation could not take that device;
/// holding the found claim would keep it from the preemptor as well.
pub(super) fn nominated_found_claim<'r>(
    request: &'r GangRequest,
    cluster: &muster_engine::cluster::ClusterState,
) -> Option<&'r ClaimKey> {
    found_allocations(request)
        .find(|(key, allocation)| {
            allocation
                .devices
                .iter()
                .filter(|d| d.admin_access != Some(true))
                .any(|d| {
                    super::conflicts::nomination_counts_on(cluster, &d.device_id(), d.share_id.is_some(), key.as_str())
                })
        })
        .map(|(key, _)| key)
}

/// The claims of the request that are allocated already (it would hold them as they
/// are), with their allocations.
fn found_allocations(request: &GangRequest) -> impl Iterator<Item = (&ClaimKey, &muster_engine::claim::Allocation)> {
    let shared = request
        .shared_claims
        .iter()
        .filter_map(|c| Some((&c.key, c.allocation.as_ref()?)));
    let own = request
        .groups
        .iter()
        .flat_map(|g| &g.pods)
        .flat_map(|p| &p.claims)
        .filter_map(|c| Some((&c.key, c.allocation.as_ref()?)));
    shared.chain(own)
}

fn found_claims(request: &GangRequest) -> impl Iterator<Item = &ClaimKey> {
    found_allocations(request).map(|(key, _)| key)
}

/// A gang planned in this pass, waiting for its commit.
pub(super) struct PlannedGang {
    pub(super) name: ObjectKey,
    pub(super) priority: i32,
    pub(super) workload: Arc<Workload>,
    pub(super) request: GangRequest,
    pub(super) plan: Plan,
}

pub(super) enum Admit {
    Committed,
    /// The commit found a conflict or failed, and was undone.
    RolledBack,
    /// Not now; `reach`: the nodes it could use on the cluster with nothing else on
    /// it, if it would fit there.
    DoesNotFit {
        reach: Option<Arc<BTreeSet<String>>>,
    },
    /// The request is wrong for this cluster (the condition says why).
    Invalid,
}

impl Admission {
    /// Remembers how an attempt to admit gang `name` ended (see [`Waiting::settle`]): a
    /// committed gang stops waiting; any other waits, and holds its nodes once it has
    /// waited past the starvation limit. A gang whose commit (`planned`) did not go
    /// through keeps the nodes its plan took until it tries again (see
    /// [`super::waiting::RetryHolds`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn settle_attempt(
        &self,
        name: &ObjectKey,
        priority: i32,
        outcome: Result<Admit, CommitError>,
        planned: Option<&Plan>,
        changes: u64,
        held: &mut Held,
        next: &mut Duration,
    ) {
        let now = Instant::now();
        if let Err(e) = &outcome {
            warn!(workload = %name, error = %e, "admission failed");
        }
        let commit_failed = planned.is_some() && matches!(outcome, Ok(Admit::RolledBack) | Err(_));
        let in_a_row = match planned {
            Some(plan) if commit_failed => {
                let nodes = self.kept_for_retry(plan);
                self.retry_holds().failed(name, priority, Some(nodes), now)
            }
            // A commit that went through, or a gang that tried again and waits: what it
            // kept is free. (An error before a plan, a status write say, leaves it be.)
            _ if outcome.is_ok() => {
                self.retry_holds().tried(name);
                held.release_retrying(name);
                0
            }
            _ => 0,
        };
        let mut waiting = self.waiting();
        let ended = match outcome {
            Ok(Admit::Committed) => {
                waiting.remove(name);
                return;
            }
            Ok(Admit::DoesNotFit { reach: Some(reach) }) => Ended::WaitsForCapacity(reach),
            // An invalid request waits like a gang that never fits: it never holds the
            // queue back.
            Ok(Admit::DoesNotFit { reach: None } | Admit::Invalid) => Ended::NeverFits,
            Ok(Admit::RolledBack) | Err(_) if commit_failed => Ended::Failed { in_a_row },
            Ok(Admit::RolledBack) | Err(_) => Ended::Errored,
        };
        let entry = waiting.entry(name.clone()).or_insert_with(|| Waiting::new(now));
        let backoff = entry.settle(ended, changes, now);
        *next = (*next).min(backoff);
        if commit_failed {
            let mut holds = self.retry_holds();
            holds.retry_at(name, entry.next_try);
            holds.hold_into(held, now);
        }
        if entry.since.elapsed() > self.settings.starvation_after
            && let Some(reach) = &entry.reach
        {
            held.hold(priority, name, reach, HoldReason::WaitedLongest);
        }
    }

    /// The nodes a gang whose commit failed keeps until it tries again: those its plan
    /// took, or every node if its plan takes devices not tied to one node (holding
    /// nodes would not keep others off those).
    fn kept_for_retry(&self, plan: &Plan) -> Arc<BTreeSet<String>> {
        if node_local(plan) {
            Arc::new(plan.nodes().into_iter().collect())
        } else {
            Arc::new(self.index.cluster().nodes().map(|n| n.name.clone()).collect())
        }
    }

    /// Why a gang is not waiting for admission, if it is not (every object exists, not
    /// suspended, not being deleted): a log says it when a pass leaves the gang out.
    pub(super) fn not_admissible(&self, workload: &Workload) -> Option<&'static str> {
        if workload.metadata.deletion_timestamp.is_some() {
            return Some("being deleted");
        }
        if workload.spec.suspend == Some(true) {
            return Some("suspended");
        }
        if finished(workload) {
            return Some("finished");
        }
        // Its job ended: the state machine finishes it, nothing is placed.
        if crate::workload::observe::job_ended(workload).is_some() {
            return Some("its job ended");
        }
        if placement_of(workload).and_then(|p| p.state).is_some() {
            return Some("placed");
        }
        if self.held_by_kueue(workload) {
            return Some("held by Kueue");
        }
        if self
            .answered_retry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&key(workload))
        {
            return Some("Kueue was answered Retry this pass");
        }
        let created = condition(workload, conditions::CREATED)
            .is_some_and(|c| c.status == "True" && c.observed_generation == workload.metadata.generation);
        if !created {
            return Some("its objects are not created at its current generation");
        }
        let expected: i32 = workload
            .spec
            .pod_groups
            .iter()
            .filter(|g| g.template.is_some())
            .map(|g| g.replicas)
            .sum();
        let pods = self.gang_pods(workload);
        let attempt = membership::attempt(workload);
        let gated = pods
            .iter()
            .filter(|p| crate::workload::status::is_gated(p) && p.metadata.deletion_timestamp.is_none())
            .filter(|p| membership::of_attempt(p, attempt))
            .count();
        // Pods of template-less groups: at least minCount, all waiting at the gate but
        // those that succeeded already (their controller runs them no more; they count).
        let external_ready = workload
            .spec
            .pod_groups
            .iter()
            .filter(|g| g.template.is_none())
            .all(|g| {
                let members = crate::workload::membership::external_members(&pods, g);
                members.len() as i32 >= g.min_count()
                    && members.iter().any(|p| crate::workload::status::is_gated(p))
                    && members
                        .iter()
                        .all(|p| crate::workload::status::is_gated(p) || membership::succeeded(p))
            });
        if (gated as i32) < expected {
            return Some("not all pods of its templates wait at the gate");
        }
        if !external_ready {
            return Some("too few pods of another controller wait at the gate");
        }
        None
    }

    /// The gang's priority: its class's, never above its pods' ([`gang_priority`]). A
    /// Workload naming a class above its pods is refused when planned
    /// ([`Self::priority_refusal`]); until then it counts at its pods' priority.
    pub(super) fn priority(&self, workload: &Workload) -> i32 {
        match self.checked_priority(workload) {
            Ok(priority) => priority,
            Err(e) => e.pod_priority,
        }
    }

    /// The gang's priority, or why the class it names is above its pods'.
    pub(super) fn checked_priority(&self, workload: &Workload) -> Result<i32, gang_priority::AboveMembers> {
        let classes = self.priorities.state();
        let default = gang_priority::value(gang_priority::class(&classes, None));
        let class = workload
            .spec
            .priority_class_name
            .as_deref()
            .map(|name| (name, gang_priority::value(gang_priority::class(&classes, Some(name)))));
        let namespace = workload.namespace().unwrap_or_default();
        let gangs = self.gangs();
        let pods = gangs.pods(&namespace, &workload.name_any());
        let members = gang_priority::members(workload, pods.iter().map(AsRef::as_ref));
        gang_priority::of_gang(class, default, gang_priority::lowest(members))
    }

    /// The gang request for a Workload whose objects exist: claims from the cluster.
    pub(crate) fn request(&self, workload: &Workload) -> Result<GangRequest, RequestError> {
        let namespace = workload.namespace().unwrap_or_default();
        // A claim this loop deallocated that the cache still shows allocated would be
        // planned as the gang's own: wait until the cache catches up.
        let gangs = self.gangs();
        let claims = gangs.claims(&namespace, &workload.name_any());
        let named = gangs.namespace_claims(&namespace).iter().filter(|c| {
            let name = c.metadata.name.as_deref().unwrap_or_default();
            workload_names_claim(workload, name)
        });
        for claim in claims.iter().chain(named) {
            if !Arc::ptr_eq(&self.own_claims.overlay(claim.clone()), claim) {
                return Err(RequestError::DeallocationNotSeen(claim.name_any()));
            }
        }
        // Claims muster made or joined carry a gang's label; one the Workload shares with
        // another carries the other's.
        let sources = ClaimSources::from_claims(gangs.namespace_claims(&namespace).iter().map(AsRef::as_ref));
        // The pods as made: their extended resources as they were turned into claims.
        let pods = self.gang_pods(workload);
        let mut extended = ExtendedResources::of_cluster(&self.index.snapshot());
        extended.record_existing(pods.iter().map(AsRef::as_ref), claims.iter().map(AsRef::as_ref));
        // The pods exist, as the API server stored them, before a gang is planned: no
        // defaults of its own to apply.
        let mut request = gang_request(workload, &extended, &sources, &pods, &PodDefaults::default())?;
        // muster's pods or claims tolerate the fence that keeps others off the devices.
        self.settings.fencing.apply(&mut request);
        self.apply_kueue_assignment(workload, &mut request);
        Ok(request)
    }

    /// Plans a gang of `priority`, without the nodes `held` against it for gangs that
    /// have waited longest, and commits it if it fits.
    /// Plans gang `workload`: a plan to commit, or how the attempt ended (its status and
    /// Kueue's check already say why).
    pub(super) async fn try_plan(
        &self,
        workload: &Workload,
        priority: i32,
        held: &Held,
        unfit: &mut HashMap<String, (String, Planned)>,
    ) -> Result<Attempt, CommitError> {
        if let Err(e) = self.checked_priority(workload) {
            let message = e.to_string();
            if condition(workload, conditions::ADMITTED).map(|c| c.message.as_str()) != Some(message.as_str()) {
                self.set_admitted(workload, false, conditions::REASON_PRIORITY_ABOVE_PODS, &message, None)
                    .await?;
            }
            let retry_after = self.never_fit_retry_after(workload, KUEUE_RETRY_NEVER_FIT_SECONDS);
            self.answer_check(workload, "Retry", &message, Some(retry_after))
                .await?;
            return Ok(Attempt::Done(Admit::Invalid));
        }
        let request = match self.request(workload) {
            Ok(request) => request,
            Err(e) if e.is_waiting() => {
                debug!(workload = %key(workload), reason = %e, "gang waits for an object");
                return Ok(Attempt::Done(Admit::DoesNotFit { reach: None }));
            }
            Err(e) => {
                let message = e.to_string();
                if condition(workload, conditions::ADMITTED).map(|c| c.message.as_str()) != Some(message.as_str()) {
                    self.set_admitted(workload, false, conditions::REASON_INVALID_REQUEST, &message, None)
                        .await?;
                }
                // Kueue would hold the quota for it with the check pending, for ever.
                // Rejected deactivates the Kueue Workload for good: only for a spec that
                // is wrong; anything the cluster may still mend is retried.
                if e.is_permanent() {
                    self.answer_check(workload, "Rejected", &message, None).await?;
                } else {
                    let retry_after = self.never_fit_retry_after(workload, KUEUE_RETRY_NEVER_FIT_SECONDS);
                    self.answer_check(workload, "Retry", &message, Some(retry_after))
                        .await?;
                }
                return Ok(Attempt::Done(Admit::Invalid));
            }
        };
        let started = Instant::now();
        // Kueue's decision (flavors, topology domains) is in each group's request.
        let excluded = held.against(priority, &key(workload));
        // Its own nomination is not in its way.
        let cluster = self.planning_view(&key(workload), priority);
        if uses_a_claim_allocated_meanwhile(&request, &cluster) {
            return Ok(Attempt::Stale);
        }
        // A claim it would hold as it is that it may not hold now: the gang waits.
        if let Some(message) = self.found_claims_wait(workload, &request, &cluster) {
            return self.wait_on_claim(workload, &message).await;
        }
        // Nodes kube-scheduler refused its pods on lately.
        let avoid = super::refusals::avoid(workload, &request, crate::workload::observe::now_millis());
        // Kueue's decision differs per gang; otherwise the shape, the priority and the
        // held nodes decide the outcome.
        // A gang's own nomination, or nodes it keeps off, make its view differ from the
        // others'.
        let shape =
            (self.kueue_object(workload).is_not_queued() && nomination_of(workload).is_none() && avoid.is_empty())
                .then(|| format!("{priority}|{excluded:?}|{}", shape_signature(&request)));
        let planned = match shape.as_ref().and_then(|s| unfit.get(s)) {
            Some((planned_gang, known)) => {
                // The reasons name the gang that was planned: name this one instead.
                let mut planned = known.clone();
                if let Outcome::Unschedulable(why) = &mut planned.outcome {
                    for reason in &mut why.reasons {
                        *reason = reason.replace(planned_gang.as_str(), &request.name);
                    }
                }
                planned
            }
            None => {
                let planned = self
                    .plan_off_runtime(workload, cluster.clone(), request.clone(), excluded, avoid)
                    .await?;
                if let Some(shape) = shape
                    && matches!(planned.outcome, Outcome::Unschedulable(_))
                {
                    unfit.insert(shape, (request.name.clone(), planned.clone()));
                }
                planned
            }
        };
        let (outcome, reach) = (planned.outcome, planned.reach);
        let planned_in = started.elapsed();
        let label = OutcomeLabel {
            outcome: if matches!(outcome, Outcome::Placed(_)) {
                "placed"
            } else {
                "unschedulable"
            },
        };
        metrics::get()
            .plan_duration
            .get_or_create(&label)
            .observe(metrics::seconds(planned_in));
        match outcome {
            Outcome::Unschedulable(_) if planned.held_back && held.only_retrying_against(priority, &key(workload)) => {
                Ok(Attempt::HeldForRetry)
            }
            Outcome::Unschedulable(why) => {
                let mut message = why.to_string();
                if let Some(kueue) = crate::kueue::explain(&request) {
                    message = format!("{kueue}: {message}");
                }
                if reach.is_none() {
                    message.push_str("; it would not fit even on an empty cluster");
                }
                let reason = if planned.held_back {
                    message = format!("{}; elsewhere: {message}", held.message(priority, &key(workload)));
                    conditions::REASON_WAITING_BEHIND
                } else {
                    conditions::REASON_UNSCHEDULABLE
                };
                let previous = condition(workload, conditions::ADMITTED).map(|c| (c.reason.clone(), c.message.clone()));
                if previous != Some((reason.to_string(), message.clone())) {
                    info!(workload = %key(workload), reason = %message, "gang does not fit");
                    self.set_admitted(workload, false, reason, &message, None).await?;
                    self.event(
                        workload,
                        EventType::Normal,
                        conditions::EVENT_UNSCHEDULABLE,
                        "Plan",
                        message.clone(),
                    );
                }
                // Kueue reserved quota and asked: not now (it requeues the gang and
                // frees the quota meanwhile). Not even on the emptied cluster is judged
                // on the nodes, slices and taints of the moment — a driver rollout, a
                // drained pool or a maintenance taint passes — so it is retried too,
                // less often; Rejected would deactivate the gang for good.
                // A gang Kueue split over domains it must run in one of (its podSets
                // placed together in one of them still did not fit) is likely to be
                // split the same way again: that backs off too.
                let retry_after = if reach.is_some() && !self.kueue_split(workload) {
                    KUEUE_RETRY_SECONDS
                } else {
                    self.never_fit_retry_after(workload, KUEUE_RETRY_NEVER_FIT_SECONDS)
                };
                self.answer_check(workload, "Retry", &message, Some(retry_after))
                    .await?;
                Ok(Attempt::Done(Admit::DoesNotFit { reach }))
            }
            Outcome::Placed(plan) => {
                info!(workload = %key(workload), pods = plan.pods.len(), devices = plan.device_count(), planned_ms = planned_in.as_millis() as u64, "gang fits; committing");
                Ok(Attempt::Placed {
                    request: Box::new(request),
                    plan: Box::new(plan),
                })
            }
        }
    }

    /// Why the gang may not hold a claim it would hold as it is (allocated already), if
    /// it may not: its device is held by another claim too (the gang waits until the
    /// holders give way or the collector clears it, rather than hold a conflict and give
    /// way in turn); a nomination of at least its priority counts on its device (a fresh
    /// allocation of that device would wait too); or muster allocated it and no gang
    /// holds it nor any consumer known to be outside keeps it (a gang let go of it, or
    /// the Workload that named it went: the collector clears it, and held again as it
    /// is it would keep devices that Kueue and preemption count as given back).
    pub(super) fn found_claims_wait(
        &self,
        workload: &Workload,
        request: &GangRequest,
        cluster: &muster_engine::cluster::ClusterState,
    ) -> Option<String> {
        if let Some(claim) = doubly_held_claim(request, cluster) {
            return Some(format!(
                "a device of ResourceClaim {claim}, which the gang would share as it is, is allocated to another \
                 claim as well; waiting until that is resolved"
            ));
        }
        if let Some(claim) = nominated_found_claim(request, cluster) {
            return Some(format!(
                "a device of ResourceClaim {claim}, which the gang would share as it is, is nominated for a gang \
                 that preempts to fit; waiting until that gang is placed"
            ));
        }
        self.leftover_claim(workload, request).map(|claim| {
            format!(
                "ResourceClaim {claim} is still allocated by muster for a gang that let go of it; waiting until it is \
                 cleared"
            )
        })
    }

    /// A gang that waits on a claim it would hold as it is: it says why, and Kueue hears
    /// "not now".
    async fn wait_on_claim(&self, workload: &Workload, message: &str) -> Result<Attempt, CommitError> {
        if condition(workload, conditions::ADMITTED).map(|c| c.message.as_str()) != Some(message) {
            self.set_admitted(workload, false, conditions::REASON_UNSCHEDULABLE, message, None)
                .await?;
        }
        self.answer_check(workload, "Retry", message, Some(KUEUE_RETRY_SECONDS))
            .await?;
        Ok(Attempt::Done(Admit::DoesNotFit { reach: None }))
    }

    /// A claim the request would hold as it is that muster allocated, that no gang's
    /// journal names, and that no consumer known to be outside the gang reserves (see
    /// [`muster_admission::ownership`]): what the collector is to clear.
    fn leftover_claim(&self, workload: &Workload, request: &GangRequest) -> Option<ClaimKey> {
        let gangs = self.gangs();
        found_claims(request).find_map(|key| {
            let claim = self
                .own_claims
                .overlay(gangs.claim(key.namespace(), key.name())?.clone());
            // (The holders' lock is let go before `claim_view` takes it again.)
            let held = self
                .holders()
                .of_claim(&ObjectKey::new(key.namespace(), key.name()))
                .next()
                .is_some();
            let leftover = super::ownership::muster_allocated(&claim)
                && !held
                && !self
                    .claim_view(workload, &claim)
                    .reserved_for
                    .iter()
                    .any(|c| c.known_outside);
            leftover.then(|| key.clone())
        })
    }

    /// Commits a planned gang whose plan the index already assumes.
    pub(super) async fn commit_planned(
        &self,
        workload: &Workload,
        request: &GangRequest,
        plan: &Plan,
    ) -> Result<Admit, CommitError> {
        let started = Instant::now();
        let committed = self
            .commit(workload, request, plan)
            .instrument(info_span!("commit", workload = %key(workload)))
            .await;
        let outcome = if matches!(committed, Ok(true)) {
            "committed"
        } else {
            "failed"
        };
        metrics::get()
            .commit_duration
            .get_or_create(&OutcomeLabel { outcome })
            .observe(metrics::seconds(started.elapsed()));
        Ok(if committed? {
            Admit::Committed
        } else {
            Admit::RolledBack
        })
    }

    /// Plans on a snapshot of the cluster, on a blocking thread: watches go on meanwhile,
    /// and the commit's conflict check catches what they show too late. `held` nodes
    /// are left out, and each pod keeps off the nodes `avoid` names for it. Whether it
    /// would fit an emptied cluster is asked without `avoid`: refusals lapse.
    pub(super) async fn plan_off_runtime(
        &self,
        workload: &Workload,
        cluster: Arc<muster_engine::cluster::ClusterState>,
        request: GangRequest,
        held: BTreeSet<String>,
        avoid: muster_engine::placement::Avoid,
    ) -> Result<Planned, CommitError> {
        let empty_options = self.settings.plan.clone();
        // A gang placed again after a restart goes back where its pods ran, if it can.
        let previous = if crate::workload::membership::attempt(workload) > 0 {
            self.places.previous(workload, &self.gang_pods(workload), &request)
        } else {
            Default::default()
        };
        let unlimited = PlanOptions {
            avoid: Arc::new(avoid),
            previous: Arc::new(previous),
            ..empty_options.clone()
        };
        let options = PlanOptions {
            excluded_nodes: Arc::new(held),
            ..unlimited.clone()
        };
        let span = info_span!("plan", workload = %key(workload));
        tokio::task::spawn_blocking(move || {
            let _span = span.entered();
            let outcome = placement::plan(&cluster, &request, &options);
            if matches!(outcome, Outcome::Placed(_)) {
                return Planned {
                    outcome,
                    reach: None,
                    held_back: false,
                };
            }
            let held_back = !options.excluded_nodes.is_empty()
                && matches!(placement::plan(&cluster, &request, &unlimited), Outcome::Placed(_));
            let empty = cluster.emptied();
            let reach = match placement::plan(&empty, &request, &empty_options) {
                Outcome::Placed(plan) => Some(Arc::new(reach(&empty, &request, &plan, &empty_options))),
                Outcome::Unschedulable(_) => None,
            };
            Planned {
                outcome,
                reach,
                held_back,
            }
        })
        .await
        .map_err(|e| CommitError::Planning(e.to_string()))
    }
}

/// Whether a pod template of `workload`, or its gang-wide claims, name the existing
/// claim `name` (a claim it may share with another Workload, whose label it carries).
fn workload_names_claim(workload: &Workload, name: &str) -> bool {
    let spec = &workload.spec;
    spec.resource_claims
        .iter()
        .any(|c| c.resource_claim_name.as_deref() == Some(name))
        || spec.pod_groups.iter().any(|g| {
            g.template
                .as_ref()
                .and_then(|t| t.spec.as_ref())
                .and_then(|s| s.resource_claims.as_ref())
                .into_iter()
                .flatten()
                .any(|c| c.resource_claim_name.as_deref() == Some(name))
        })
}
