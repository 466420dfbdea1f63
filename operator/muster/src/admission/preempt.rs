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
//! does not fit once its victims are gone or after [`NOMINATION_LIFETIME`].

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::ResourceExt;
use kube::runtime::events::EventType;
use muster_admission::{Condition, ConditionType, Reason, Record, State};
use muster_api::conditions;
use muster_api::v1alpha1::{AdmissionState, NominatedClaim, NominatedDevice, NominatedPod, NominationStatus, Workload};
use muster_engine::claim::{DeviceId, DeviceResult};
use muster_engine::cluster::{AssumedClaim, AssumedPod, ClusterState, PlanId};
use muster_engine::key::{ClaimKey, ObjectKey, PodKey};
use muster_engine::preemption::{
    Preemption, PreemptionCandidate, PreemptionOptions, PreemptionPolicy, Preemptor, preempt,
};
use tracing::{info, warn};

use crate::ops::faults::FaultPoint;
use crate::workload::observe;

use super::status::{NominationUpdate, StatusUpdate};
use super::{Admission, CommitError, key, placement_of};

/// How long a nomination holds its devices while the preemptor still does not fit
/// (its victims' pods may take their termination grace).
pub(super) const NOMINATION_LIFETIME: Duration = Duration::from_secs(300);

/// Trial placements of one preemption decision.
const MAX_PLAN_CALLS: u32 = 256;

pub(crate) fn nomination_of(workload: &Workload) -> Option<&NominationStatus> {
    workload.status.as_ref()?.nomination.as_ref()
}

/// Whether a nomination has outlived [`NOMINATION_LIFETIME`].
fn expired(nominated: &NominationStatus) -> bool {
    let age = nominated
        .since
        .as_ref()
        .map(|t| observe::now_millis() - observe::millis(t))
        .unwrap_or(i64::MAX);
    age > NOMINATION_LIFETIME.as_millis() as i64
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
        let class: Option<&Arc<PriorityClass>> = match &workload.spec.priority_class_name {
            Some(name) => classes.iter().find(|p| p.metadata.name.as_deref() == Some(name)),
            None => classes.iter().find(|p| p.global_default == Some(true)),
        };
        match class.and_then(|c| c.preemption_policy.as_deref()) {
            Some("Never") => PreemptionPolicy::Never,
            _ => PreemptionPolicy::PreemptLowerPriority,
        }
    }

    /// The cluster as gang `gang` plans on it: without its own nomination.
    pub(super) fn planning_view(&self, gang: &ObjectKey) -> Arc<ClusterState> {
        let snapshot = self.index.snapshot();
        let id = PlanId::Nomination(gang.clone());
        if !snapshot.assumed_plans().any(|p| *p == id) {
            return snapshot;
        }
        let mut view = (*snapshot).clone();
        view.forget(&id);
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
            if workload.metadata.deletion_timestamp.is_some() || placement_of(workload).and_then(|p| p.state).is_some()
            {
                continue;
            }
            // Whatever the gang's plan says now (it may no longer be valid, or fit no
            // cluster at all), a nomination ends: its devices are never held for good.
            let ends = if workload.spec.suspend == Some(true) {
                Some("suspended: its nomination is dropped")
            } else if !self.kueue_object(workload).is_not_queued() {
                Some("Kueue manages it now: Kueue's preemption decides")
            } else if expired(nominated) {
                Some("it has not fit within the nomination's lifetime")
            } else {
                None
            };
            if let Some(message) = ends {
                if let Err(e) = self.drop_nomination(workload, message).await {
                    warn!(workload = %key(workload), error = %e, "dropping a nomination failed");
                }
                continue;
            }
            let gang = key(workload);
            let id = PlanId::Nomination(gang.clone());
            if !self.index.cluster().assumed_plans().any(|p| *p == id) {
                self.assume_nomination(workload, nominated);
            }
            holding.insert(gang);
            if let Err(e) = self.evict_victims(workload, nominated).await {
                warn!(workload = %key(workload), error = %e, "evicting a victim failed; retrying");
            }
        }
        let stale: Vec<PlanId> = self
            .index
            .cluster()
            .assumed_plans()
            .filter(|p| matches!(p, PlanId::Nomination(g) if !holding.contains(g)))
            .cloned()
            .collect();
        for plan in stale {
            self.index.update(|c| c.forget(&plan));
        }
    }

    /// Assumes the nominated placement under the preemptor's nomination plan.
    fn assume_nomination(&self, workload: &Workload, nominated: &NominationStatus) {
        let namespace = workload.namespace().unwrap_or_default();
        // The pods' node requests, as the gang asks for them now.
        let request = self.request(workload).ok();
        let pods: Vec<AssumedPod> = nominated
            .pods
            .iter()
            .map(|p| {
                let pod: PodKey = ObjectKey::new(&namespace, &p.name).into();
                let requests = request
                    .iter()
                    .flat_map(|r| &r.groups)
                    .find(|g| g.pods.iter().any(|gp| gp.key == pod))
                    .map(|g| g.shape.requests.clone())
                    .unwrap_or_default();
                AssumedPod {
                    pod,
                    node: p.node.clone(),
                    requests,
                    traits: Default::default(),
                }
            })
            .collect();
        let claims: Vec<AssumedClaim> = nominated
            .claims
            .iter()
            .map(|c| AssumedClaim {
                claim: ClaimKey::from(ObjectKey::new(&namespace, &c.name)),
                devices: c
                    .devices
                    .iter()
                    .map(|d| DeviceResult {
                        request: d.request.clone(),
                        driver: d.driver.clone(),
                        pool: d.pool.clone(),
                        device: d.device.clone(),
                        admin_access: None,
                        tolerations: Vec::new(),
                        binding_conditions: Vec::new(),
                        binding_failure_conditions: Vec::new(),
                        share_id: None,
                        consumed_capacity: Default::default(),
                    })
                    .collect(),
            })
            .collect();
        let id = PlanId::Nomination(key(workload));
        self.index.update(|c| c.assume(&id, &pods, &claims));
    }

    /// Moves every victim the nomination names that still holds its reservation (made
    /// before the nomination) to `TearingDown`, with the cause `Preempted`.
    async fn evict_victims(&self, preemptor: &Workload, nominated: &NominationStatus) -> Result<(), CommitError> {
        let since = nominated.since.as_ref().map(observe::millis).unwrap_or(i64::MAX);
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
            // Admitted again after the nomination: not what the nomination evicts.
            if journal.released_at.unwrap_or(journal.since) > since {
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
                },
            )
            .await?;
            info!(workload = %key(&workload), preemptor = %key(preemptor), "gang preempted");
            crate::ops::metrics::get().preemptions.inc();
            self.event(
                &workload,
                EventType::Warning,
                conditions::EVENT_PREEMPTED,
                "Preempt",
                message,
            )
            .await;
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
            },
        )
        .await?;
        self.index.update(|c| c.forget(&PlanId::Nomination(key(workload))));
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
            let view = self.planning_view(&key(workload));
            let devices_free = nominated.claims.iter().flat_map(|c| &c.devices).all(|d| {
                !view.device_allocated(&DeviceId {
                    driver: d.driver.clone(),
                    pool: d.pool.clone(),
                    device: d.device.clone(),
                })
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
        if policy == PreemptionPolicy::Never {
            return Ok(());
        }
        let request = match self.request(workload) {
            Ok(request) => request,
            Err(_) => return Ok(()),
        };
        let gang = key(workload);
        let cluster = self.index.snapshot();
        let assumed: std::collections::HashSet<PlanId> = cluster.assumed_plans().cloned().collect();
        let candidates: Vec<PreemptionCandidate> = self
            .current_workloads()
            .iter()
            .filter(|w| w.metadata.deletion_timestamp.is_none() && key(w) != gang)
            .filter(|w| evictable(w) && self.kueue_object(w).is_not_queued())
            .filter(|w| self.priority(w) < priority)
            .map(|w| {
                let namespace = w.namespace().unwrap_or_default();
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
                    claims: placement
                        .claims
                        .iter()
                        .map(|c| ClaimKey::from(ObjectKey::new(&namespace, c)))
                        .collect(),
                    assumed_plans: plans,
                }
            })
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        let options = PreemptionOptions {
            plan: self.settings.plan.clone(),
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
        )
        .await;
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
}
