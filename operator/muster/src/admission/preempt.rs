//! Gang-aware priority preemption, for Workloads Kueue does not manage (with Kueue, its
//! own preemption decides). A queued gang that does not fit asks the engine's
//! [`preempt`] which admitted gangs of strictly lower priority to evict; only an
//! `Evict`, whose plan proves the gang fits once they are gone, is acted on.
//!
//! The transition, each step recorded before the next:
//! 1. the preemptor's `status.nomination` records the victims and the nodes and devices
//!    of the proving plan, before any victim is touched;
//! 2. each victim's journal moves to `TearingDown` with the cause `Preempted` (the state
//!    machine then deletes its pods with their grace period, gives its claims back and
//!    queues it again);
//! 3. the preemptor commits as any gang does; its commit's first record clears the
//!    nomination.
//!
//! Until then, every pass assumes the nomination in the engine's cluster state under
//! [`PlanId::Nomination`], rebuilt from the status after a restart, so that no other
//! gang plans onto the freed devices; the preemptor plans without its own. A
//! nomination is dropped when the preemptor is suspended or deleted, or when it still
//! does not fit [`NOMINATION_LIFETIME`] after it was made and its victims are gone (at
//! most [`NOMINATION_LIFETIME_WHILE_VICTIMS_LEAVE`] while they still leave).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::runtime::events::EventType;
use muster_admission::{Condition, ConditionType, Reason, Record, State};
use muster_api::conditions;
use muster_api::v1alpha1::{AdmissionState, NominatedClaim, NominatedDevice, NominatedPod, NominationStatus, Workload};
use muster_engine::claim::{DeviceId, DeviceResult};
use muster_engine::cluster::{AssumedClaim, AssumedPod, ClusterState, Node, PlanId};
use muster_engine::key::{ClaimKey, ObjectKey, PodKey};
use muster_engine::preemption::{
    Preemption, PreemptionCandidate, PreemptionOptions, PreemptionPolicy, Preemptor, preempt,
};
use muster_engine::quantity::Quantity;
use muster_engine::resources::Resources;
use tracing::{info, warn};

use super::preemption_scope::PreemptionScope;
use crate::ops::faults::FaultPoint;
use crate::workload::observe;

use super::status::{NominationUpdate, StatusUpdate};
use super::{Admission, CommitError, conflicts, key, placement_of};

/// How long a nomination holds its devices while the preemptor still does not fit
/// (its victims' pods may take their termination grace).
pub(super) const NOMINATION_LIFETIME: Duration = Duration::from_secs(300);

/// Trial placements of one preemption decision.
const MAX_PLAN_CALLS: u32 = 256;

pub(crate) fn nomination_of(workload: &Workload) -> Option<&NominationStatus> {
    workload.status.as_ref()?.nomination.as_ref()
}

/// How long a nomination may hold its devices at most while its victims still leave:
/// a victim stuck in its teardown (a pod that never terminates) does not hold them for
/// good.
pub(super) const NOMINATION_LIFETIME_WHILE_VICTIMS_LEAVE: Duration = Duration::from_secs(1800);

/// Whether a nomination has lapsed: it outlived [`NOMINATION_LIFETIME`] with none of its
/// victims still leaving, or [`NOMINATION_LIFETIME_WHILE_VICTIMS_LEAVE`] whatever they do.
/// While a victim leaves, what it still holds is what the nomination counts on: dropping
/// the nomination then would have the next plan evict more gangs in its victims' place.
fn lapsed(nominated: &NominationStatus, victims_leaving: bool) -> bool {
    let age = nominated
        .since
        .as_ref()
        .map(|t| observe::now_millis() - observe::millis(t))
        .unwrap_or(i64::MAX);
    let lifetime = if victims_leaving {
        NOMINATION_LIFETIME_WHILE_VICTIMS_LEAVE
    } else {
        NOMINATION_LIFETIME
    };
    age > lifetime.as_millis() as i64
}

/// Whether `victim`, evicted for `nominated`, is still leaving: its placement from before
/// the nomination is being given back (its teardown under way). Queued again, done, or
/// admitted again since, it holds nothing the nomination counts on; still released (its
/// eviction not landed, or never made because it holds nothing nominated) or going back
/// onto its own reservation, it is not leaving, and the nomination keeps its lifetime.
fn victim_leaving(victim: &Workload, nominated: &NominationStatus) -> bool {
    let Some(placement) = placement_of(victim) else {
        return false;
    };
    if placement.reuse_reservation {
        return false;
    }
    let placed_before = match (placement.released_at.as_ref(), nominated.since.as_ref()) {
        (Some(released), Some(since)) => observe::millis(released) <= observe::millis(since),
        // Not released: being undone before its release, or a restart; it still holds.
        _ => true,
    };
    placed_before
        && matches!(
            placement.state,
            Some(
                AdmissionState::TearingDown
                    | AdmissionState::Restarting
                    | AdmissionState::Suspending
                    | AdmissionState::Finishing
            )
        )
}

/// A gang that holds a reservation another gang may take by preemption: a released
/// one. A gang still `Reserved` is released a moment later, which would look like an
/// admission after the nomination and spare it from the eviction its nomination counted
/// on; it is left alone until then.
fn evictable(workload: &Workload) -> bool {
    matches!(
        placement_of(workload).and_then(|p| p.state),
        Some(AdmissionState::Released)
    )
}

/// The nomination of a plan, as recorded in the preemptor's status.
fn nomination(victims: &[ObjectKey], plan: &muster_engine::placement::Plan) -> NominationStatus {
    NominationStatus {
        since: Some(super::now()),
        victims: victims.iter().map(|v| v.as_str().to_string()).collect(),
        pods: plan
            .pods
            .iter()
            .map(|p| NominatedPod {
                name: p.pod.name().to_string(),
                node: p.node.clone(),
            })
            .collect(),
        claims: plan
            .claims
            .iter()
            .map(|c| NominatedClaim {
                name: c.claim.name().to_string(),
                devices: c
                    .allocation
                    .devices
                    .iter()
                    .map(|d| NominatedDevice {
                        request: d.request.clone(),
                        driver: d.driver.clone(),
                        pool: d.pool.clone(),
                        device: d.device.clone(),
                        share_id: d.share_id.clone(),
                        consumed_capacity: d
                            .consumed_capacity
                            .iter()
                            .map(|(name, value)| (name.clone(), value.to_string()))
                            .collect(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

impl Admission {
    /// The preemption policy of the gang's PriorityClass.
    fn preemption_policy(&self, workload: &Workload) -> PreemptionPolicy {
        let classes = self.priorities.state();
        let class = super::gang_priority::class(&classes, workload.spec.priority_class_name.as_deref());
        match class.and_then(|c| c.preemption_policy.as_deref()) {
            Some("Never") => PreemptionPolicy::Never,
            _ => PreemptionPolicy::PreemptLowerPriority,
        }
    }

    /// The cluster as gang `gang` of `priority` plans on it: without its own nomination,
    /// and without the nominations of gangs of lower priority, as kube-scheduler treats
    /// nominated pods: a nomination holds devices only against gangs that could not
    /// preempt its owner. Where preemption stays inside a namespace, a nomination holds
    /// nothing against gangs of other namespaces.
    pub(super) fn planning_view(&self, gang: &ObjectKey, priority: i32) -> Arc<ClusterState> {
        let snapshot = self.index.snapshot();
        let per_namespace = self.settings.preemption_scope == PreemptionScope::Namespace;
        let ignored: Vec<PlanId> = snapshot
            .assumed_plans()
            .filter(|plan| match plan {
                PlanId::Nomination(owner) => {
                    owner == gang
                        || (per_namespace && owner.namespace() != gang.namespace())
                        || self
                            .current_workload(owner)
                            .is_some_and(|w| self.priority(&w) < priority)
                }
                PlanId::Gang(_) | PlanId::Extras(_) => false,
            })
            .cloned()
            .collect();
        if ignored.is_empty() {
            return snapshot;
        }
        let mut view = (*snapshot).clone();
        for plan in &ignored {
            view.forget(plan);
        }
        Arc::new(view)
    }

    /// Every pass: holds the nominated nodes and devices of each nominating gang in the
    /// engine's state (rebuilt from the status after a restart), finishes the
    /// evictions it recorded, and drops nominations of gangs that are suspended,
    /// deleted or committed.
    pub(super) async fn hold_nominations(&self, workloads: &[Arc<Workload>]) {
        let mut holding = BTreeSet::new();
        for workload in workloads {
            let Some(nominated) = nomination_of(workload) else {
                continue;
            };
            if workload.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let gang = key(workload);
            let id = PlanId::Nomination(gang.clone());
            match placement_of(workload).and_then(|p| p.state) {
                None => {}
                // A commit under way, or one undone: the nomination still holds the
                // devices for the gang until it is released (a commit that failed, or
                // used only some of them, must not lose the rest to gangs of lower
                // priority while it is undone and tried again).
                Some(AdmissionState::Reserving) => {
                    if !self.index.cluster().assumed_plans().any(|p| *p == id) {
                        self.assume_nomination(workload, nominated);
                    }
                    holding.insert(gang);
                    continue;
                }
                Some(_) => continue,
            }
            // Whatever the gang's plan says now (it may no longer be valid, or fit no
            // cluster at all), a nomination ends: its devices are never held for good.
            let ends = if workload.spec.suspend == Some(true) {
                Some("suspended: its nomination is dropped")
            } else if !self.kueue_object(workload).is_not_queued() {
                Some("Kueue manages it now: Kueue's preemption decides")
            } else if lapsed(nominated, self.victims_leaving(nominated)) {
                Some("it has not fit within the nomination's lifetime")
            } else {
                None
            };
            if let Some(message) = ends {
                if let Err(e) = self.drop_nomination(workload, message).await {
                    // Held until it is dropped: its status still says it stands.
                    warn!(workload = %key(workload), error = %e, "dropping a nomination failed");
                    holding.insert(gang);
                }
                continue;
            }
            if !self.index.cluster().assumed_plans().any(|p| *p == id) {
                self.assume_nomination(workload, nominated);
            }
            // A gang that planned without this nomination (one of higher priority, or
            // another allocator) took a device it held: it no longer proves a fit.
            if let Some(taken) = self.nominated_device_taken(workload, nominated) {
                let message = format!("its device {taken} was allocated to another claim");
                if let Err(e) = self.drop_nomination(workload, &message).await {
                    warn!(workload = %key(workload), error = %e, "dropping a nomination failed");
                    holding.insert(gang);
                }
                continue;
            }
            holding.insert(gang);
            if let Err(e) = self.evict_victims(workload, nominated).await {
                warn!(workload = %key(workload), error = %e, "evicting a victim failed; retrying");
            }
        }
        // Running gangs whose pods their controller replaces hold their vacant places
        // the same way (a placed gang has no nomination of its own).
        holding.extend(self.hold_vacant_places(workloads));
        let stale: Vec<PlanId> = self
            .index
            .cluster()
            .assumed_plans()
            .filter(|p| matches!(p, PlanId::Nomination(g) if !holding.contains(g)))
            .cloned()
            .collect();
        // A hold that ends frees its room without a watch event to say so.
        if !stale.is_empty() {
            self.index.note_room_freed();
        }
        for plan in stale {
            self.index.update(|c| c.forget(&plan));
        }
    }

    /// Whether a victim of `nominated` is still leaving ([`victim_leaving`]).
    fn victims_leaving(&self, nominated: &NominationStatus) -> bool {
        nominated.victims.iter().any(|victim| {
            self.current_workload(&ObjectKey::from(victim.as_str()))
                .is_some_and(|w| victim_leaving(&w, nominated))
        })
    }

    /// Assumes the nominated placement under the preemptor's nomination plan: its pods on
    /// their nodes, its devices under names of their own (no claim looks allocated for
    /// it, see [`conflicts::nomination_hold`]).
    pub(super) fn assume_nomination(&self, workload: &Workload, nominated: &NominationStatus) {
        let namespace = workload.namespace().unwrap_or_default();
        let gang = key(workload);
        // The pods' node requests: from the pods themselves, else as the gang asks for
        // them now, else the whole node (never nothing).
        let request = self.request(workload).ok();
        let pods_now = self.gang_pods(workload);
        let cluster = self.index.cluster();
        let pods: Vec<AssumedPod> = nominated
            .pods
            .iter()
            .map(|p| {
                let pod: PodKey = ObjectKey::new(&namespace, &p.name).into();
                let object = pods_now.iter().find(|o| o.name_any() == p.name);
                let requested = request
                    .iter()
                    .flat_map(|r| &r.groups)
                    .find(|g| g.pods.iter().any(|gp| gp.key == pod))
                    .map(|g| g.shape.requests.clone());
                let requests = nominated_pod_requests(object.map(AsRef::as_ref), requested, cluster.node(&p.node))
                    .unwrap_or_else(|| {
                        warn!(workload = %gang, pod = %p.name, node = %p.node, "the nominated pod's requests are unknown; holding its whole node");
                        Resources::default()
                    });
                AssumedPod {
                    pod: conflicts::nomination_pod_hold(&namespace, &p.name, &gang),
                    node: p.node.clone(),
                    requests,
                    traits: Default::default(),
                }
            })
            .collect();
        drop(cluster);
        let claims: Vec<AssumedClaim> = nominated
            .claims
            .iter()
            .map(|c| AssumedClaim {
                claim: conflicts::nomination_hold(&namespace, &c.name, &gang),
                devices: c.devices.iter().map(nominated_result).collect(),
            })
            .collect();
        let id = PlanId::Nomination(gang);
        self.index.update(|c| c.assume(&id, &pods, &claims));
    }

    /// A nominated device some claim holds that is neither the preemptor's nor one its
    /// victims give back, if any. A victim's claim that a gang other than the victims
    /// holds too (one that found it allocated and holds it as it is) stays allocated
    /// when the victims go: it counts as taken, as a fresh allocation would.
    fn nominated_device_taken(&self, preemptor: &Workload, nominated: &NominationStatus) -> Option<DeviceId> {
        let namespace = preemptor.namespace().unwrap_or_default();
        let mut expected: BTreeSet<String> = nominated
            .claims
            .iter()
            .map(|c| format!("{namespace}/{}", c.name))
            .collect();
        let victims: BTreeSet<ObjectKey> = nominated.victims.iter().map(|v| ObjectKey::from(v.as_str())).collect();
        let mut victim_claims = Vec::new();
        for victim in &victims {
            let Some(workload) = self.current_workload(victim) else {
                continue;
            };
            let victim_namespace = workload.namespace().unwrap_or_default();
            for claim in placement_of(&workload).iter().flat_map(|p| &p.claims) {
                victim_claims.push(ObjectKey::new(&victim_namespace, claim));
            }
        }
        let holders = self.holders();
        for claim in victim_claims {
            if holders.of_claim(&claim).all(|h| victims.contains(&h.gang)) {
                expected.insert(claim.as_str().to_string());
            }
        }
        drop(holders);
        let cluster = self.index.cluster();
        nominated_results(nominated).find_map(|held| {
            // The nomination's own hold is one of the exclusive holders, unless it holds
            // a share of the device.
            let own = u32::from(held.share_id.is_none());
            let id = held.device_id();
            let outside = |name: &str| !conflicts::is_nomination_hold(name) && !expected.contains(name);
            let taken_whole = cluster.exclusive_holders(&id.driver, &id.pool, &id.device) > own
                && cluster.exclusive_holder_names(&id).into_iter().any(outside);
            // A share is taken too when the shares of others leave it no room (a scan of
            // every claim: only for a shared device).
            let no_room = held.share_id.is_some()
                && !conflicts::share_fits(&cluster, &id, &held.consumed_capacity, |name| !outside(name));
            (taken_whole || no_room).then_some(id)
        })
    }

    /// Moves every victim the nomination names that still holds its reservation (made
    /// before the nomination) to `TearingDown`, with the cause `Preempted`.
    async fn evict_victims(&self, preemptor: &Workload, nominated: &NominationStatus) -> Result<(), CommitError> {
        // Devices nominated whole, and devices of which the nomination takes a share.
        let (shares, whole): (Vec<DeviceResult>, Vec<DeviceResult>) =
            nominated_results(nominated).partition(|d| d.share_id.is_some());
        let whole: BTreeSet<DeviceId> = whole.iter().map(DeviceResult::device_id).collect();
        let shares: BTreeSet<DeviceId> = shares.iter().map(DeviceResult::device_id).collect();
        let nodes: BTreeSet<&str> = nominated.pods.iter().map(|p| p.node.as_str()).collect();
        let mut first = true;
        for victim in &nominated.victims {
            let Some(workload) = self.current_workload(&ObjectKey::from(victim.as_str())) else {
                continue;
            };
            if workload.metadata.deletion_timestamp.is_some() || !evictable(&workload) {
                continue;
            }
            let Some(journal) = observe::journal(&workload) else {
                continue;
            };
            // Only a gang holding what the nomination counts on: admitted again elsewhere
            // after its eviction, it is not what the nomination evicts; back on the same
            // devices (a restart onto its reservation), it still is. What it counts on
            // is devices, and the CPU, memory and pods of the nominated nodes: a gang
            // admitted there before the nomination holds those (one admitted there
            // since was planned around the nomination, on what it leaves free). So it
            // is with a device of which the nomination takes a share: a gang admitted
            // onto another share of it since left room for the nomination's.
            let admitted_before = journal
                .released_at
                .zip(nominated.since.as_ref())
                .is_some_and(|(released, since)| released <= observe::millis(since));
            let holds_nominated = self
                .gang_claims(&workload)
                .iter()
                .filter(|c| journal.claims.contains(&c.name_any()))
                .filter_map(|c| c.status.as_ref()?.allocation.as_ref())
                .flat_map(|a| a.devices.iter().flat_map(|d| d.results.iter().flatten()))
                .map(conflicts::result_device)
                .any(|id| whole.contains(&id) || (admitted_before && shares.contains(&id)));
            let on_nominated_nodes = admitted_before && journal.pods.iter().any(|p| nodes.contains(p.node.as_str()));
            if !holds_nominated && !on_nominated_nodes {
                continue;
            }
            let message = format!(
                "preempted by {} (priority {}): taking the gang apart to queue it again",
                key(preemptor),
                self.priority(preemptor)
            );
            let mut tearing = journal.moved(State::TearingDown, observe::now_millis());
            tearing.cause = Some((Reason::Preempted, message.clone()));
            self.record(
                &workload,
                Record {
                    journal: Some(tearing),
                    conditions: vec![Condition {
                        type_: ConditionType::Admitted,
                        status: false,
                        reason: Reason::Preempted,
                        message: message.clone(),
                    }],
                    restarts: None,
                    refusals: None,
                },
            )
            .await?;
            info!(workload = %key(&workload), preemptor = %key(preemptor), "gang preempted");
            crate::ops::metrics::get().count_preemption("Priority");
            self.event(
                &workload,
                EventType::Warning,
                conditions::EVENT_PREEMPTED,
                "Preempt",
                message,
            );
            if first {
                first = false;
                self.checkpoint(FaultPoint::AfterFirstVictim).await;
            }
        }
        Ok(())
    }

    /// Clears a nomination and the devices it holds.
    async fn drop_nomination(&self, workload: &Workload, why: &str) -> Result<(), CommitError> {
        info!(workload = %key(workload), why, "nomination dropped");
        self.write_status(
            workload,
            StatusUpdate {
                conditions: Vec::new(),
                placement: None,
                restarts: None,
                nomination: NominationUpdate::Clear,
                refusals: None,
            },
        )
        .await?;
        self.index.update(|c| c.forget(&PlanId::Nomination(key(workload))));
        self.index.note_room_freed();
        Ok(())
    }

    /// A queued gang of `priority` that does not fit (and that Kueue does not manage):
    /// nominates it and evicts gangs of lower priority when the engine proves it fits
    /// then; a nomination it already has stays until it fits, or is dropped once its
    /// victims are gone or it has lasted too long.
    pub(super) async fn try_preempt(&self, workload: &Workload, priority: i32) -> Result<(), CommitError> {
        if let Some(nominated) = nomination_of(workload) {
            let victims_left = nominated.victims.iter().any(|v| {
                self.current_workload(&ObjectKey::from(v.as_str()))
                    .is_some_and(|w| placement_of(&w).and_then(|p| p.state).is_some())
            });
            // The caches may not show every freed device yet when the last victim is
            // queued: only a nomination whose devices look free is known not to help.
            let view = self.planning_view(&key(workload), priority);
            let devices_free = nominated_results(nominated).all(|held| {
                let id = held.device_id();
                !view.device_allocated(&id)
                    && (held.share_id.is_none()
                        || conflicts::share_fits(&view, &id, &held.consumed_capacity, conflicts::is_nomination_hold))
            });
            // Its lifetime is kept every pass, by `hold_nominations`.
            if !victims_left && devices_free {
                self.drop_nomination(workload, "its victims are gone and it still does not fit")
                    .await?;
            }
            return Ok(());
        }
        let policy = self.preemption_policy(workload);
        let preemptor = Preemptor { priority, policy };
        let scope = self.settings.preemption_scope;
        if policy == PreemptionPolicy::Never || scope == PreemptionScope::Off {
            return Ok(());
        }
        let namespace = workload.namespace().unwrap_or_default();
        let request = match self.request(workload) {
            Ok(request) => request,
            Err(_) => return Ok(()),
        };
        let gang = key(workload);
        let cluster = self.planning_view(&gang, priority);
        let assumed: std::collections::HashSet<PlanId> = cluster.assumed_plans().cloned().collect();
        let candidates: Vec<PreemptionCandidate> = self
            .current_workloads()
            .iter()
            .filter(|w| w.metadata.deletion_timestamp.is_none() && key(w) != gang)
            .filter(|w| scope.allows(&namespace, w.metadata.namespace.as_deref().unwrap_or_default()))
            .filter(|w| evictable(w) && self.kueue_object(w).is_not_queued())
            .filter(|w| self.priority(w) < priority)
            .map(|w| {
                let placement = placement_of(w).cloned().unwrap_or_default();
                let admitted = placement.released_at.as_ref().or(placement.since.as_ref());
                let plans = [PlanId::Gang(key(w)), PlanId::Extras(key(w))]
                    .into_iter()
                    .filter(|p| assumed.contains(p))
                    .collect();
                PreemptionCandidate {
                    workload: key(w),
                    priority: self.priority(w),
                    admitted_at_seconds: admitted.map_or(0, |t| observe::millis(t) / 1000),
                    pods: self
                        .gang_pods(w)
                        .iter()
                        .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
                        .map(|p| crate::convert::pod_key(p))
                        .collect(),
                    claims: self.claims_given_back(w, &placement.claims),
                    assumed_plans: plans,
                }
            })
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        // Victims are chosen for a plan that keeps off the nodes the gang was refused on.
        let avoid = super::refusals::avoid(workload, &request, observe::now_millis());
        let options = PreemptionOptions {
            plan: muster_engine::placement::PlanOptions {
                avoid: std::sync::Arc::new(avoid),
                ..self.settings.plan.clone()
            },
            max_plan_calls: MAX_PLAN_CALLS,
        };
        let decision =
            tokio::task::spawn_blocking(move || preempt(&cluster, &request, &preemptor, &candidates, &options))
                .await
                .map_err(|e| CommitError::Planning(e.to_string()))?;
        let eviction = match decision {
            Preemption::Evict(eviction) => eviction,
            other => {
                info!(workload = %gang, decision = %other, "no preemption");
                return Ok(());
            }
        };
        let nominated = nomination(&eviction.victims, &eviction.plan);
        let written = self
            .write_status(
                workload,
                StatusUpdate {
                    conditions: Vec::new(),
                    placement: None,
                    restarts: None,
                    nomination: NominationUpdate::Set(nominated.clone()),
                    refusals: None,
                },
            )
            .await?;
        self.checkpoint(FaultPoint::AfterNominated).await;
        self.assume_nomination(&written, &nominated);
        let victims = nominated.victims.join(", ");
        info!(workload = %gang, victims = %victims, "gang nominated; evicting gangs of lower priority");
        self.event(
            workload,
            EventType::Normal,
            conditions::EVENT_NOMINATED,
            "Preempt",
            format!("evicting {victims} (lower priority) to fit; their devices are held for this gang"),
        );
        // As recorded and as it is now: a gang suspended or deleted meanwhile evicts
        // nothing (the next pass drops its nomination).
        let Some(current) = self.current_workload(&gang) else {
            return Ok(());
        };
        if current.spec.suspend == Some(true) || current.metadata.deletion_timestamp.is_some() {
            return Ok(());
        }
        match nomination_of(&current) {
            Some(recorded) => self.evict_victims(&current, recorded).await,
            None => Ok(()),
        }
    }

    /// Of the claims a victim's journal names, those its teardown gives back (see
    /// [`muster_admission::ownership::freed_by_giving_back`]): what preemption may count
    /// as freed.
    fn claims_given_back(&self, victim: &Workload, named: &[String]) -> Vec<ClaimKey> {
        let namespace = victim.namespace().unwrap_or_default();
        let pods: Vec<muster_admission::PodView> = self.gang_pods(victim).iter().map(|p| observe::pod(p)).collect();
        let journal = observe::journal(victim);
        let claims = self.gang_claims(victim);
        named
            .iter()
            .filter(|name| {
                claims.iter().find(|c| c.name_any() == **name).is_some_and(|claim| {
                    let seen = self.claim_view(victim, claim);
                    muster_admission::ownership::freed_by_giving_back(&seen, &pods, journal.as_ref())
                })
            })
            .map(|c| ClaimKey::from(ObjectKey::new(&namespace, c)))
            .collect()
    }
}

/// Every device of a nomination as the engine holds it (see [`nominated_result`]).
fn nominated_results(nominated: &NominationStatus) -> impl Iterator<Item = DeviceResult> + '_ {
    nominated.claims.iter().flat_map(|c| &c.devices).map(nominated_result)
}

/// A nominated device as the engine holds it: the share the plan took of a device that
/// allows several allocations, with what it consumes, else the whole device. A share
/// whose capacity cannot be read holds the whole device (too much rather than too
/// little).
fn nominated_result(d: &NominatedDevice) -> DeviceResult {
    let mut result = conflicts::held_device(&d.request, &d.driver, &d.pool, &d.device);
    let Some(share) = &d.share_id else {
        return result;
    };
    let consumed: Result<BTreeMap<String, Quantity>, _> = d
        .consumed_capacity
        .iter()
        .map(|(name, value)| Quantity::parse(value).map(|q| (name.clone(), q)))
        .collect();
    match consumed {
        Ok(consumed) => {
            result.share_id = Some(share.clone());
            result.consumed_capacity = consumed;
        }
        Err(e) => {
            warn!(device = %d.device, pool = %d.pool, error = %e, "a nominated share's capacity cannot be read; holding the whole device")
        }
    }
    result
}

/// What a nominated pod takes from its node: what its own spec requests, else what the
/// gang's request says for it, else (`node` known) the whole node, so that a pod whose
/// requests cannot be told holds too much rather than nothing. `None`: the node is not
/// known either (nothing can be placed there anyway).
pub(super) fn nominated_pod_requests(
    pod: Option<&Pod>,
    requested: Option<Resources>,
    node: Option<&Node>,
) -> Option<Resources> {
    let own = pod.and_then(|p| {
        let spec = p.spec.as_ref()?;
        crate::convert::pod_requests(&p.name_any(), spec).ok()
    });
    own.or(requested).or_else(|| node.map(|n| n.allocatable.clone()))
}

/// For tests elsewhere in the loop: a nomination as recorded for a plan.
#[cfg(test)]
pub(super) mod tests_support {
    pub(in crate::admission) fn nomination_of_plan(
        plan: &muster_engine::placement::Plan,
    ) -> muster_api::v1alpha1::NominationStatus {
        super::nomination(&[], plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn nominated_since(seconds_ago: i64) -> NominationStatus {
        let since = k8s_openapi::jiff::Timestamp::from_millisecond(observe::now_millis() - seconds_ago * 1000)
            .expect("timestamp");
        NominationStatus {
            since: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(since)),
            victims: vec!["ns/low".into()],
            ..Default::default()
        }
    }

    fn victim(state: Option<&str>, released_seconds_ago: i64) -> Workload {
        let released_at =
            k8s_openapi::jiff::Timestamp::from_millisecond(observe::now_millis() - released_seconds_ago * 1000)
                .expect("timestamp");
        let mut status = json!({});
        if let Some(state) = state {
            status = json!({"placement": {"state": state, "releasedAt": released_at.to_string()}});
        }
        serde_json::from_value(json!({
            "apiVersion": "muster.dev/v1alpha1",
            "kind": "Workload",
            "metadata": {"name": "low", "namespace": "ns"},
            "spec": {"podGroups": []},
            "status": status,
        }))
        .expect("workload")
    }

    /// Victims with a long grace period (a checkpoint) or pods hanging on a lost node
    /// still hold what the nomination counts on after its lifetime: it lives while they
    /// leave, else the next plan evicts more gangs in their place. Not for ever.
    #[test]
    fn a_nomination_lives_while_its_victims_leave() {
        let young = nominated_since(10);
        let old = nominated_since(NOMINATION_LIFETIME.as_secs() as i64 + 10);
        let ancient = nominated_since(NOMINATION_LIFETIME_WHILE_VICTIMS_LEAVE.as_secs() as i64 + 10);
        assert!(!lapsed(&young, false));
        assert!(lapsed(&old, false));
        assert!(!lapsed(&old, true));
        assert!(lapsed(&ancient, true));
    }

    #[test]
    fn a_victim_leaves_until_its_teardown_is_done() {
        let nominated = nominated_since(400);
        for state in ["TearingDown", "Restarting", "Suspending", "Finishing"] {
            assert!(victim_leaving(&victim(Some(state), 1000), &nominated), "{state}");
        }
        // Not evicted (yet): the nomination keeps its own lifetime.
        assert!(!victim_leaving(&victim(Some("Released"), 1000), &nominated));
        // Queued again, or done: it holds nothing.
        assert!(!victim_leaving(&victim(None, 1000), &nominated));
        assert!(!victim_leaving(&victim(Some("Finished"), 1000), &nominated));
        // Admitted again after the nomination and leaving: not what the nomination evicted.
        assert!(!victim_leaving(&victim(Some("TearingDown"), 100), &nominated));
        // Going back onto its own reservation: it gives nothing back.
        let mut restarting = victim(Some("Restarting"), 1000);
        if let Some(p) = restarting.status.as_mut().and_then(|s| s.placement.as_mut()) {
            p.reuse_reservation = true;
        }
        assert!(!victim_leaving(&restarting, &nominated));
    }

    #[test]
    fn a_nominated_pod_never_holds_nothing() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "high-workers-0", "namespace": "ns"},
            "spec": {"containers": [{"name": "main", "resources": {"requests": {"cpu": "16", "memory": "64Gi"}}}]},
        }))
        .expect("pod");
        let node = muster_engine::fixtures::node("node-0", 64, 512, &[]);
        // The gang's request cannot be built (a claim not seen yet): the pod says.
        let requests = nominated_pod_requests(Some(&pod), None, Some(&node)).expect("requests");
        assert_eq!(requests.cpu_millis, 16_000);
        assert_eq!(requests.memory, 64 << 30);
        // Neither the pod nor the request: the whole node is held.
        let requests = nominated_pod_requests(None, None, Some(&node)).expect("requests");
        assert_eq!(requests.cpu_millis, 64_000);
    }
}
