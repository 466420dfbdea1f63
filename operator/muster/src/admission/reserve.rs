//! Committing a plan: record it, allocate every claim of the gang, check that no device
//! went twice, and undo what was written when any of it fails; giving allocations back
//! once a gang no longer needs them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use muster_admission::commit;
use muster_admission::{ConditionType, Journal, Reason, Record};
use muster_api::labels;
use muster_api::v1alpha1::Workload;
use muster_engine::cluster::PlanId;
use muster_engine::key::{ClaimKey, ObjectKey, PodKey};
use muster_engine::placement::Plan;
use muster_engine::request::{GangRequest, PodClaim};
use serde_json::json;
use tracing::{Instrument, info_span, warn};

use crate::convert;
use crate::kube_ops;
use crate::ops::metrics::{self};
use crate::workload::observe::{self};

use super::{Admission, CommitError, claim_writes, conflicts, key, now, ownership, version};
pub use crate::ops::faults::{FailWrite, FaultPoint};

/// How long the commit's conflict check waits for the claim watch before it lists.
pub(super) const CONFLICT_CHECK_WAIT: Duration = Duration::from_secs(5);

/// A commit's record of its progress: the journal, and `Admitted` false while reserving.
pub(super) fn reserving_record(journal: Journal, message: &str) -> Record {
    Record {
        journal: Some(journal),
        conditions: vec![muster_admission::Condition {
            type_: ConditionType::Admitted,
            status: false,
            reason: Reason::Reserving,
            message: message.into(),
        }],
        restarts: None,
        refusals: None,
    }
}

/// Claims of the planned pods that the gang found allocated and plans on as they are
/// (shared with another gang or with pods outside muster): it holds them as well.
pub(crate) fn found_allocated<'r>(request: &'r GangRequest, plan: &Plan) -> Vec<&'r ClaimKey> {
    let planned: BTreeSet<&PodKey> = plan.pods.iter().map(|p| &p.pod).collect();
    let own = request
        .groups
        .iter()
        .flat_map(|g| &g.pods)
        .filter(|p| planned.contains(&p.key))
        .flat_map(|p| &p.claims)
        .filter(|c| c.allocation.is_some())
        .map(|c| &c.key);
    let used_shared: BTreeSet<usize> = request
        .groups
        .iter()
        .filter(|g| g.pods.iter().any(|p| planned.contains(&p.key)))
        .flat_map(|g| g.shape.shared.iter().copied())
        .collect();
    let shared = request
        .shared_claims
        .iter()
        .enumerate()
        .filter(|(i, c)| used_shared.contains(i) && c.allocation.is_some())
        .map(|(_, c)| &c.key);
    let mut found: Vec<&ClaimKey> = own.chain(shared).collect();
    found.dedup();
    found
}

/// The engine's plan in the state machine's terms: an extra's own claims go with it, and
/// the claims the gang found allocated are named with those it allocates. With
/// `record_devices` (a gang whose controller replaces its pods), each pod's own devices
/// are recorded, for the vacancy its loss leaves.
pub(crate) fn core_placement(request: &GangRequest, plan: &Plan, record_devices: bool) -> commit::Placement {
    let own_claims: BTreeMap<&PodKey, &Vec<PodClaim>> = request
        .groups
        .iter()
        .flat_map(|g| &g.pods)
        .map(|p| (&p.key, &p.claims))
        .collect();
    let shared: BTreeSet<&str> = request.shared_claims.iter().map(|c| c.key.as_str()).collect();
    commit::Placement {
        pods: plan
            .pods
            .iter()
            .map(|p| {
                let extra = request.is_extra(&p.group, &p.pod);
                muster_admission::PlannedPod {
                    name: p.pod.name().to_string(),
                    node: p.node.clone(),
                    group: Some(p.group.clone()),
                    extra,
                    released_at: None,
                    claims: if extra {
                        own_claims
                            .get(&p.pod)
                            .into_iter()
                            .flat_map(|c| c.iter())
                            .filter(|c| !shared.contains(c.key.as_str()))
                            .map(|c| c.key.name().to_string())
                            .collect()
                    } else {
                        Vec::new()
                    },
                    devices: if record_devices {
                        let own: BTreeSet<&str> = own_claims
                            .get(&p.pod)
                            .into_iter()
                            .flat_map(|c| c.iter())
                            .filter(|c| !shared.contains(c.key.as_str()))
                            .map(|c| c.key.as_str())
                            .collect();
                        plan.claims
                            .iter()
                            .filter(|c| own.contains(c.claim.as_str()))
                            .flat_map(|c| c.allocation.devices.iter().map(|d| d.device_id().to_string()))
                            .collect()
                    } else {
                        Vec::new()
                    },
                }
            })
            .collect(),
        claims: {
            let mut claims: Vec<String> = plan.claims.iter().map(|c| c.claim.name().to_string()).collect();
            for found in found_allocated(request, plan) {
                if !claims.iter().any(|c| c == found.name()) {
                    claims.push(found.name().to_string());
                }
            }
            claims
        },
        topology_value: plan.topology_value.clone(),
        devices: plan.device_count() as i32,
    }
}

/// The patch that clears a claim's allocation, and `reservedFor` with it (the API allows
/// clearing the allocation only together with an empty `reservedFor`), conditional on
/// the version read.
pub(super) fn deallocation(claim: &ResourceClaim) -> serde_json::Value {
    json!({
        "metadata": {"resourceVersion": claim.resource_version()},
        "status": {"allocation": null, "reservedFor": null},
    })
}

/// How often a commit reads a claim it found allocated again when the claim changed
/// between its read and its fence, before the commit gives up.
const HOLD_FOUND_ATTEMPTS: usize = 4;

/// How often a deallocation reads the claim again and retries at once when the claim
/// changed between its read and its write, before it leaves the claim to the next pass.
const DEALLOCATION_ATTEMPTS: usize = 4;

/// Clears a claim's allocation after a fresh read, unless a pod other than those in
/// `finished` reserves it: a pod that may still run keeps its devices. With `uid`, only
/// that object is touched: a claim made again under the same name is another gang's.
/// Returns the claim as it is now (`None`: gone, or not the object meant). `leading` runs
/// between the read and the write, so a leader deposed before it cannot clear an
/// allocation its successor made.
///
/// The write tests what it was decided on (see [`claim_writes::deallocation`]) instead of
/// the resourceVersion, so writes of others that change nothing it relies on do not make
/// it fail; when the claim did change, it is read and judged again at once. The last
/// attempt falls back to a write conditioned on the resourceVersion.
pub(crate) async fn deallocate(
    api: &Api<ResourceClaim>,
    name: &str,
    uid: Option<&str>,
    finished: &[String],
    leading: &(dyn Fn() + Sync),
) -> Result<Option<ResourceClaim>, kube::Error> {
    let mut last = None;
    for attempt in 1..=DEALLOCATION_ATTEMPTS {
        let Some(claim) = api.get_opt(name).await? else {
            return Ok(None);
        };
        if uid.is_some_and(|uid| claim.metadata.uid.as_deref() != Some(uid)) {
            return Ok(None);
        }
        let Some(status) = claim.status.as_ref().filter(|s| s.allocation.is_some()) else {
            return Ok(Some(claim));
        };
        let in_use = status.reserved_for.iter().flatten().any(|r| !finished.contains(&r.uid));
        if in_use {
            return Ok(Some(claim));
        }
        let tested = claim_writes::deallocation(&claim)
            .filter(|_| attempt < DEALLOCATION_ATTEMPTS)
            .map(serde_json::from_value::<json_patch::Patch>)
            .transpose()
            .map_err(kube::Error::SerdeError)?;
        leading();
        let written = match tested {
            Some(patch) => {
                api.patch_status(name, &PatchParams::default(), &Patch::Json::<()>(patch))
                    .await
            }
            None => {
                api.patch_status(name, &PatchParams::default(), &Patch::Merge(&deallocation(&claim)))
                    .await
            }
        };
        match written {
            Ok(claim) => return Ok(Some(claim)),
            // Changed between the read and the write: read and judge it again.
            Err(e) if kube_ops::is_test_failed(&e) || kube_ops::is_conflict(&e) => last = Some(claim),
            Err(e) if kube_ops::is_not_found(&e) => return Ok(None),
            Err(e) => return Err(e),
        }
    }
    // Still changing: looked at again in the next pass.
    Ok(last)
}

/// Undoes an allocation this loop wrote, only while the claim is as the write left it.
pub(super) async fn undo_allocation(
    api: &Api<ResourceClaim>,
    written: &ResourceClaim,
) -> Result<Option<ResourceClaim>, kube::Error> {
    match api
        .patch_status(
            &written.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&deallocation(written)),
        )
        .await
    {
        Ok(claim) => Ok(Some(claim)),
        Err(e) if kube_ops::is_not_found(&e) || kube_ops::is_conflict(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

impl Admission {
    /// Commits a plan: record, reserve, check, then release through the state machine.
    /// `Ok(false)`: the commit was undone.
    /// Records the plan, reserves every claim and releases the pods. The index assumes
    /// the plan already (the caller did, before planning the next gang); a commit that
    /// stops before its plan is recorded forgets the assumption.
    pub(super) async fn commit(
        &self,
        workload: &Workload,
        request: &GangRequest,
        plan: &Plan,
    ) -> Result<bool, CommitError> {
        let gang = key(workload);
        let placement = core_placement(request, plan, super::places::restarted_by_pod_controller(workload));
        let journal = commit::reserving(&placement, observe::now_millis());
        let written = match self.injected_failure(FailWrite::PlanRecord) {
            Ok(()) => {
                self.record(
                    workload,
                    reserving_record(journal.clone(), "reserving the gang's devices"),
                )
                .await
            }
            Err(e) => Err(e),
        };
        let recorded = match written {
            Ok(recorded) => recorded,
            Err(e) => {
                // Its nomination, if it has one, still holds its devices (see `pass`).
                self.index.update(|c| c.forget(&PlanId::Gang(gang.clone())));
                return Err(e);
            }
        };
        self.checkpoint(FaultPoint::AfterPlanRecorded).await;

        let reserved = async {
            self.injected_failure(FailWrite::ClaimReservation)
                .map_err(|e| (e, Vec::new()))?;
            self.hold_found(workload, request, plan).await?;
            self.reserve(workload, plan).await
        };
        if let Err(e) = reserved
            .instrument(info_span!("reserve", workload = %gang, claims = plan.claims.len()))
            .await
        {
            // Forgotten once its own writes are undone: until then its devices are still
            // taken, and a gang planned meanwhile would fail its conflict check on them.
            let failed = self.fail_commit(&recorded, &journal, e).await;
            self.index.update(|c| c.forget(&PlanId::Gang(gang.clone())));
            failed?;
            return Ok(false);
        }
        metrics::get().reservations.inc();
        metrics::get().reserved_devices.inc_by(plan.device_count() as u64);
        self.places.remember(workload, &self.gang_pods(workload), request, plan);
        let mut next = Duration::MAX;
        let pods: Vec<muster_admission::PodView> = self.gang_pods(&recorded).iter().map(|p| observe::pod(p)).collect();
        let attempt = crate::workload::membership::attempt(&recorded);
        let pins = commit::pins(&journal, |name| {
            pods.iter()
                .find(|p| p.name == name && !p.deleting && p.attempt.is_none_or(|a| a == attempt))
        });
        let waiting_for = if self.release_held_by_kueue(&recorded) {
            // Kueue admits the gang only once it reads muster's answer, which rests on a
            // recorded reservation.
            Some("every claim is allocated; waiting for Kueue to admit the gang")
        } else if pins.is_empty() {
            // Its planned pods are being made again: they are released as they come,
            // for as long as the state machine lets a reservation wait for its pods.
            Some("every claim is allocated; waiting for the planned pods")
        } else {
            None
        };
        if let Some(message) = waiting_for {
            self.record(
                &recorded,
                reserving_record(commit::reserved(&journal, observe::now_millis()), message),
            )
            .await?;
            self.checkpoint(FaultPoint::AfterReserved).await;
            return Ok(true);
        }
        self.checkpoint(FaultPoint::AfterReserved).await;
        // Every claim is allocated and checked: the pods go at once, with nothing recorded
        // in between. A planned pod out of the gate is itself the record that the commit
        // came this far (`muster_admission::decide` finishes such a commit, and undoes
        // one that released nothing); the state machine then records the gang released.
        async {
            self.execute(&recorded, None, vec![muster_admission::Effect::Release { pods: pins }])
                .await?;
            let current = self.current_workload(&gang).unwrap_or(recorded.clone());
            self.step(&current, &mut next).await.map(|_| ())
        }
        .instrument(info_span!("release", workload = %gang, pods = plan.pods.len()))
        .await?;
        Ok(true)
    }

    /// A commit that failed before every claim was allocated and checked: undo its own
    /// writes and record the cause; the state machine gives back whatever is left.
    pub(super) async fn fail_commit(
        &self,
        recorded: &Workload,
        journal: &Journal,
        failure: (CommitError, Vec<ResourceClaim>),
    ) -> Result<(), CommitError> {
        let (error, written) = failure;
        let conflict = matches!(error, CommitError::Conflict(_));
        if conflict {
            metrics::get().conflicts.inc();
        }
        let reason = if conflict { Reason::Conflict } else { Reason::RolledBack };
        let message = format!("reserving failed and was undone: {error}");
        let namespace = recorded.namespace().unwrap_or_default();
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
        self.undo_allocations(&api, written).await?;
        // Whatever is left the state machine gives back by the ownership rule: a claim
        // someone else allocated meanwhile, or that another gang holds, is let go as it is.
        let failed = commit::failed(journal, reason, message.clone());
        self.record(
            recorded,
            Record {
                journal: Some(failed),
                conditions: vec![muster_admission::Condition {
                    type_: ConditionType::Admitted,
                    status: false,
                    reason,
                    message: message.clone(),
                }],
                restarts: None,
                refusals: None,
            },
        )
        .await?;
        warn!(workload = %key(recorded), "{message}");
        Ok(())
    }

    /// Undoes allocations a commit wrote, each only while the claim is as the commit
    /// left it: whatever changed it since is not the commit's to undo.
    pub(crate) async fn undo_allocations(
        &self,
        api: &Api<ResourceClaim>,
        written: Vec<ResourceClaim>,
    ) -> Result<(), CommitError> {
        for claim in written {
            self.ensure_leading();
            if let Some(claim) = undo_allocation(api, &claim).await? {
                self.own_claims.remember(claim);
            }
        }
        Ok(())
    }

    /// The claims the gang found allocated and holds from now on (those its journal does
    /// not name yet: an extras commit's gang holds its shared claims already): each must
    /// still be allocated as the plan saw it, and is fenced (its version moves), so that
    /// a deallocation a deposed leader prepared against an older version cannot land.
    pub(super) async fn hold_found(
        &self,
        workload: &Workload,
        request: &GangRequest,
        plan: &Plan,
    ) -> Result<(), (CommitError, Vec<ResourceClaim>)> {
        let gang = key(workload);
        // The gang's planned pods, by the claim each names, to list on a claim another
        // allocator made: found once, when the first such claim comes.
        let mut consumers = None;
        let held: BTreeSet<&str> = super::placement_of(workload)
            .iter()
            .filter(|p| p.state.is_some())
            .flat_map(|p| &p.claims)
            .map(String::as_str)
            .collect();
        for found in found_allocated(request, plan)
            .into_iter()
            .filter(|f| !held.contains(f.name()))
        {
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), found.namespace());
            let planned = request
                .shared_claims
                .iter()
                .find(|c| c.key == *found)
                .and_then(|c| c.allocation.as_ref())
                .or_else(|| {
                    request
                        .groups
                        .iter()
                        .flat_map(|g| &g.pods)
                        .flat_map(|p| &p.claims)
                        .find(|c| c.key == *found)
                        .and_then(|c| c.allocation.as_ref())
                });
            // Another gang holding the same claim (a commit running beside this one)
            // moves its version as well: read and check it again then.
            let mut attempts = 0;
            let fenced = loop {
                if let Some(fenced) = self
                    .fence_found(&api, found, planned, &gang)
                    .await
                    .map_err(|e| (e, Vec::new()))?
                {
                    break fenced;
                }
                attempts += 1;
                if attempts >= HOLD_FOUND_ATTEMPTS {
                    return Err((
                        CommitError::Conflict(format!(
                            "ResourceClaim {found}, which {gang} shares, keeps changing; looking again"
                        )),
                        Vec::new(),
                    ));
                }
            };
            // One another allocator made lists the gang's pods from now on, so that
            // kube-controller-manager keeps it allocated when the pods outside end.
            if !ownership::muster_allocated(&fenced) {
                let consumers = consumers.get_or_insert_with(|| {
                    let planned: BTreeSet<&str> = plan.pods.iter().map(|p| p.pod.name()).collect();
                    claim_writes::planned_consumers(&self.gang_pods(workload), &planned)
                });
                let listing = consumers.get(found.name()).map(Vec::as_slice).unwrap_or_default();
                if let Some(listed) = self
                    .list_on_found(&api, &fenced, listing)
                    .await
                    .map_err(|e| (e, Vec::new()))?
                {
                    self.own_claims.remember(listed);
                }
            }
        }
        Ok(())
    }

    /// Fences one claim a gang found allocated and holds from its commit on, after a
    /// fresh read shows it still allocated as planned (`planned`: the allocation the
    /// plan saw), returning the claim as fenced. `Ok(None)`: the claim changed between
    /// the read and the write, and is to be read and checked again.
    async fn fence_found(
        &self,
        api: &Api<ResourceClaim>,
        found: &ClaimKey,
        planned: Option<&muster_engine::claim::Allocation>,
        gang: &ObjectKey,
    ) -> Result<Option<ResourceClaim>, CommitError> {
        let name = found.name();
        self.ensure_leading();
        let current = api.get_opt(name).await?;
        let still = current
            .as_ref()
            .and_then(|c| c.status.as_ref()?.allocation.as_ref())
            .map(|a| convert::allocation(&format!("ResourceClaim {found}"), a));
        let (Some(current), Some(Ok(still))) = (current, still) else {
            return Err(CommitError::Conflict(format!(
                "ResourceClaim {found}, which {gang} shares, lost its allocation meanwhile"
            )));
        };
        if planned.is_some_and(|p| p.devices != still.devices) {
            return Err(CommitError::Conflict(format!(
                "ResourceClaim {found}, which {gang} shares, was allocated again meanwhile"
            )));
        }
        let mut fence = json!({
            "metadata": {
                "resourceVersion": current.resource_version(),
                "annotations": {labels::CLAIM_HELD_AT: observe::now_millis().to_string()},
            },
        });
        // A claim of muster's that kube-controller-manager would deallocate when the
        // pods of the gang that allocated it end: held by this gang too, it is
        // muster's to give back when its last holder lets go (see `commit_finalizers`).
        let finalizers = current.finalizers();
        let protected = finalizers.iter().any(|f| f == labels::DELETE_PROTECTION_FINALIZER);
        if ownership::muster_allocated(&current) && protected {
            let kept: Vec<&String> = finalizers
                .iter()
                .filter(|f| *f != labels::DELETE_PROTECTION_FINALIZER)
                .collect();
            fence["metadata"]["finalizers"] = json!(kept);
        }
        let params = PatchParams {
            field_manager: Some(labels::ADMISSION_FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        self.ensure_leading();
        match api.patch(name, &params, &Patch::Merge(&fence)).await {
            Ok(fenced) => {
                self.own_claims.remember(fenced.clone());
                Ok(Some(fenced))
            }
            Err(e) if kube_ops::is_conflict(&e) => Ok(None),
            Err(e) if kube_ops::is_not_found(&e) => Err(CommitError::Conflict(format!(
                "ResourceClaim {found}, which {gang} shares, was deleted meanwhile"
            ))),
            Err(e) => Err(e.into()),
        }
    }

    /// Moves the version of a pod still behind the gate, against the version seen, so that
    /// a release a deposed leader prepared cannot land after the pod's claims are given
    /// back. `false`: the pod changed meanwhile (looked at again next pass).
    pub(super) async fn fence_gated_pod(&self, pod: &Pod) -> Result<bool, kube::Error> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
        let fence = json!({
            "metadata": {
                "resourceVersion": pod.resource_version(),
                "annotations": {labels::POD_RELEASE_FENCED_AT: observe::now_millis().to_string()},
            },
        });
        let params = PatchParams {
            field_manager: Some(labels::ADMISSION_FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        self.ensure_leading();
        match api.patch(&pod.name_any(), &params, &Patch::Merge(&fence)).await {
            Ok(fenced) => {
                self.own_pods.remember(fenced);
                Ok(true)
            }
            Err(e) if kube_ops::is_not_found(&e) || kube_ops::is_conflict(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Allocates every planned claim, each only if it is still unallocated, and reserves
    /// it for the gang's planned pods that name it in the same write (see
    /// [`claim_writes::planned_consumers`]); then checks that no other claim holds any of
    /// the devices. On error, the claims written so far come back with it.
    pub(crate) async fn reserve(
        &self,
        workload: &Workload,
        plan: &Plan,
    ) -> Result<(), (CommitError, Vec<ResourceClaim>)> {
        let timestamp = now();
        let planned: BTreeSet<&str> = plan.pods.iter().map(|p| p.pod.name()).collect();
        let consumers = claim_writes::planned_consumers(&self.gang_pods(workload), &planned);
        let gangs = self.gangs();
        let written = std::sync::Mutex::new(Vec::new());
        let result = self
            .write_all(&plan.claims, FaultPoint::AfterFirstClaim, |claim| {
                let (namespace, name) = (claim.claim.namespace(), claim.claim.name());
                let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), namespace);
                let mut allocation = convert::allocation_to_kube(&claim.allocation);
                allocation.allocation_timestamp = Some(timestamp.clone());
                let reserved_for = consumers.get(name).cloned();
                let cached = gangs
                    .claim(namespace, name)
                    .map(|c| (*self.own_claims.overlay(c.clone())).clone());
                let written = &written;
                async move {
                    let claim = self.allocate(&api, name, cached, allocation, reserved_for).await?;
                    self.own_claims.remember(claim.clone());
                    written.lock().unwrap_or_else(|p| p.into_inner()).push(claim);
                    Ok(())
                }
            })
            .await;
        let written = written.into_inner().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = result {
            return Err((e, written));
        }
        self.checkpoint(FaultPoint::AfterAllClaims).await;
        let newest = written.iter().map(version).max().unwrap_or(0);
        match self.check_conflicts(plan, newest).await {
            Ok(()) => Ok(()),
            Err(e) => Err((e, written)),
        }
    }

    /// Writes one claim's allocation and reservation, conditioned on the version seen:
    /// first as the cache shows the claim (no read on the way), and if that was behind,
    /// once more after a fresh read. The Lease is checked between the look and each write,
    /// so a leader deposed after its check writes against a version older than its
    /// successor's fence (see `fence_dropped_claims`) and fails.
    async fn allocate(
        &self,
        api: &Api<ResourceClaim>,
        name: &str,
        cached: Option<ResourceClaim>,
        allocation: k8s_openapi::api::resource::v1::AllocationResult,
        reserved_for: Option<Vec<k8s_openapi::api::resource::v1::ResourceClaimConsumerReference>>,
    ) -> Result<ResourceClaim, CommitError> {
        let params = PatchParams {
            field_manager: Some(labels::ADMISSION_FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        let mut seen = cached;
        let mut fresh = false;
        loop {
            let current = match seen.take() {
                Some(cached) => cached,
                None => {
                    fresh = true;
                    self.ensure_leading();
                    api.get(name).await?
                }
            };
            let retry = |e: &kube::Error| !fresh && kube_ops::is_conflict(e);
            // Allocated already: nothing of the claim is muster's to touch (not even its
            // finalizers, which say who deallocates it).
            if current.status.as_ref().is_some_and(|s| s.allocation.is_some()) {
                if !fresh {
                    continue;
                }
                return Err(CommitError::Conflict(format!(
                    "ResourceClaim {name} was allocated by someone else meanwhile"
                )));
            }
            self.ensure_leading();
            // Unprotected until its pods are released (see `list_released_pods`).
            let current = match claim_writes::commit_finalizers(current.finalizers(), false) {
                None => current,
                Some(finalizers) => {
                    let patch = json!({
                        "metadata": {"finalizers": finalizers, "resourceVersion": current.resource_version()},
                    });
                    match api.patch(name, &params, &Patch::Merge(&patch)).await {
                        Ok(current) => current,
                        Err(e) if retry(&e) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
            };
            let mut status = json!({"allocation": allocation});
            if let Some(consumers) = &reserved_for {
                status["reservedFor"] = json!(consumers);
            }
            let patch = json!({
                "metadata": {"resourceVersion": current.resource_version()},
                "status": status,
            });
            self.ensure_leading();
            match api.patch_status(name, &params, &Patch::Merge(&patch)).await {
                Ok(claim) => return Ok(claim),
                Err(e) if retry(&e) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// No claim outside the gang holds a planned device against the rules (see
    /// [`conflicts`]), as of a moment after the gang's last claim write (`written`, its
    /// resourceVersion). The index answers once its claim watch has come that far; a
    /// fresh list of every claim if it lags.
    pub(super) async fn check_conflicts(&self, plan: &Plan, written: u64) -> Result<(), CommitError> {
        let ours: BTreeSet<&str> = plan.claims.iter().map(|c| c.claim.as_str()).collect();
        let planned: BTreeMap<muster_engine::claim::DeviceId, (&str, bool)> = plan
            .claims
            .iter()
            .flat_map(|c| {
                c.allocation
                    .devices
                    .iter()
                    .filter(|d| d.admin_access != Some(true))
                    .map(move |d| (d.device_id(), (c.claim.as_str(), d.share_id.is_some())))
            })
            .collect();
        // Where the fence keeps every other allocator off the planned devices, only a
        // claim the index shows already could hold one: no need to wait for the watch
        // to come as far as the commit's writes (muster's own commits are planned one
        // after the other against each other's assumptions). Only while the index holds
        // every claim: one it could not read is seen by a list alone.
        let fenced = self.index.claims_usable() && {
            let cluster = self.index.cluster();
            planned
                .keys()
                .all(|id| conflicts::fenced(&cluster, self.settings.fencing, id))
        };
        if written > 0 && (fenced || self.index.wait_for_claims(written, CONFLICT_CHECK_WAIT).await) {
            let cluster = self.index.cluster();
            for (id, (mine, shared)) in &planned {
                if conflicts::doubly_held(&cluster, id, *shared) {
                    let others: Vec<&str> = cluster
                        .exclusive_holder_names(id)
                        .into_iter()
                        .filter(|c| !ours.contains(c) && !conflicts::is_nomination_hold(c))
                        .collect();
                    let others = if others.is_empty() {
                        "other claims beyond its capacity".to_string()
                    } else {
                        others.join(", ")
                    };
                    return Err(CommitError::Conflict(format!(
                        "device {id} planned for {mine} is allocated to {others}"
                    )));
                }
            }
            return Ok(());
        }
        // The index lags: the same rules on a fresh list, the shares' capacity checked
        // against the devices the index knows.
        let all: Api<ResourceClaim> = Api::all(self.client.clone());
        let claims = all.list(&ListParams::default()).await?;
        let mut shares = muster_engine::cluster::ClusterState::new();
        {
            let cluster = self.index.cluster();
            for slice in cluster.slices() {
                if slice.devices.iter().any(|d| d.allow_multiple_allocations) {
                    shares.upsert_slice((**slice).clone());
                }
            }
        }
        for claim in claims.items {
            let claim_key = convert::claim_key(&claim);
            let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
                continue;
            };
            let Ok(held) = convert::allocation(&format!("ResourceClaim {claim_key}"), allocation) else {
                continue;
            };
            if !ours.contains(claim_key.as_str()) {
                for result in held.devices.iter().filter(|r| r.admin_access != Some(true)) {
                    if let Some((mine, shared)) = planned.get(&result.device_id())
                        && (!shared || result.share_id.is_none())
                    {
                        return Err(CommitError::Conflict(format!(
                            "device {} planned for {mine} is allocated to {claim_key}",
                            result.device_id()
                        )));
                    }
                }
            }
            shares.set_claim_allocation(&claim_key, Some(held.devices));
        }
        for (id, (mine, shared)) in &planned {
            if *shared && conflicts::doubly_held(&shares, id, true) {
                return Err(CommitError::Conflict(format!(
                    "device {id} planned for {mine} is shared beyond its capacity"
                )));
            }
        }
        Ok(())
    }

    /// The collector (see [`ownership::collect`]): claims carrying muster's finalizer that
    /// no live gang holds and that are being deleted, belong to a Workload that is gone,
    /// or are allocated while no journal names them. Each is deallocated once no pod that
    /// may run uses it, then muster's finalizer goes. `strays`: such claims that lost
    /// their gang label, which the gang caches no longer show.
    pub(super) async fn collect_claims(&self, strays: Vec<Arc<ResourceClaim>>) {
        let finished: Vec<String> = self
            .stores
            .pods
            .state()
            .iter()
            .filter(|p| {
                matches!(
                    p.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Succeeded" | "Failed")
                )
            })
            .filter_map(|p| p.uid())
            .collect();
        // Pods still behind the gate use no device (the commit lists a gang's pods in
        // `reservedFor` before their release): fenced first, they count as idle.
        let gated: BTreeMap<String, Arc<Pod>> = self
            .stores
            .pods
            .state()
            .into_iter()
            .filter(|p| crate::workload::status::is_gated(p) && p.spec.as_ref().is_none_or(|s| s.node_name.is_none()))
            .filter_map(|p| Some((p.uid()?, p)))
            .collect();
        let mut fenced: BTreeSet<String> = BTreeSet::new();
        let workloads: BTreeSet<ObjectKey> = self.current_workloads().iter().map(|w| key(w)).collect();
        for claim in self.stores.claims.state().into_iter().chain(strays) {
            let claim = self.own_claims.overlay(claim);
            if !ownership::muster_allocated(&claim) {
                continue;
            }
            let namespace = claim.namespace().unwrap_or_default();
            let workload_exists = claim
                .labels()
                .get(labels::WORKLOAD)
                .is_some_and(|w| workloads.contains(&ObjectKey::new(&namespace, w)));
            if ownership::collect(&claim, &self.holders(), workload_exists) == ownership::Collect::Keep {
                continue;
            }
            // A pod that may still run keeps it: look again once the cache says otherwise.
            let reserved: Vec<&String> = claim
                .status
                .as_ref()
                .and_then(|s| s.reserved_for.as_ref())
                .into_iter()
                .flatten()
                .map(|c| &c.uid)
                .collect();
            if reserved
                .iter()
                .any(|uid| !finished.contains(uid) && !gated.contains_key(*uid))
            {
                continue;
            }
            self.ensure_leading();
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
            let result = async {
                let mut idle = finished.clone();
                for uid in reserved.iter().filter(|uid| gated.contains_key(**uid)) {
                    // Once a pass: a pod naming several claims is fenced for all of them.
                    if !fenced.contains(*uid) {
                        if !self
                            .fence_gated_pod(&self.own_pods.overlay(gated[*uid].clone()))
                            .await?
                        {
                            return Ok(());
                        }
                        fenced.insert((*uid).clone());
                    }
                    idle.push((*uid).clone());
                }
                let uid = claim.metadata.uid.as_deref();
                match deallocate(&api, &claim.name_any(), uid, &idle, &|| self.ensure_leading()).await? {
                    Some(current) if current.status.as_ref().is_none_or(|s| s.allocation.is_none()) => {
                        self.own_claims.remember(current.clone());
                        self.ensure_leading();
                        kube_ops::remove_finalizer(&api, &current, labels::CLAIM_FINALIZER).await
                    }
                    _ => Ok(()),
                }
            }
            .await;
            if let Err(e) = result {
                warn!(claim = %claim.name_any(), error = %e, "releasing a claim no gang holds failed; retrying");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use muster_api::v1alpha1::Workload;
    use muster_engine::cluster::PlanId;
    use muster_engine::fixtures;
    use muster_engine::key::ObjectKey;
    use muster_engine::placement::{self, Outcome, PlanOptions};
    use serde_json::json;

    use crate::admission::preempt::nomination_of;
    use crate::cache::cluster::Index;

    /// Workload `ns/high` as it is once it nominated `plan`.
    fn nominating(plan: &placement::Plan) -> Workload {
        let nominated = super::super::preempt::tests_support::nomination_of_plan(plan);
        serde_json::from_value(json!({
            "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
            "metadata": {"name": "high", "namespace": "ns", "resourceVersion": "7"},
            "spec": {"podGroups": [{"name": "workers", "replicas": 1}]},
            "status": {"nomination": nominated},
        }))
        .expect("workload")
    }

    /// Issue 22, defect 3: when a preemptor's commit fails (here its first record), its
    /// nomination must still hold the devices, or a gang planned after it in the same
    /// pass takes them, and is torn down for a conflict with the nomination the next pass
    /// assumes again. The nomination holds beside the plan until the gang is released.
    #[tokio::test]
    async fn a_failed_plan_record_holds_the_nomination_again() {
        let index = Arc::new(Index::default());
        index.update(|c| *c = fixtures::gpu_cluster(2, 8, 2, 1));
        let admission = crate::admission::test_support::unreachable(index.clone());
        let request = fixtures::gpu_gang("high", 1, 8, None, None);
        let Outcome::Placed(plan) = placement::plan(&index.snapshot(), &request, &PlanOptions::default()) else {
            panic!("the gang fits");
        };
        let workload = nominating(&plan);
        let gang = ObjectKey::new("ns", "high");
        admission.assume_nomination(&workload, nomination_of(&workload).expect("nomination"));
        // As the pass does when the gang is placed: its plan is assumed beside its
        // nomination.
        let (pods, claims) = plan.assumption(&request);
        index.update(|c| c.assume(&PlanId::Gang(gang.clone()), &pods, &claims));

        assert!(
            admission.commit(&workload, &request, &plan).await.is_err(),
            "the record cannot be written"
        );
        let plans: Vec<PlanId> = index.cluster().assumed_plans().cloned().collect();
        assert_eq!(
            plans,
            [PlanId::Nomination(gang.clone())],
            "the nomination holds the devices again"
        );
        let devices = plan.claims.iter().flat_map(|c| &c.allocation.devices);
        for device in devices {
            assert!(index.cluster().device_allocated(&device.device_id()), "{device:?} held");
        }
        // And the nodes' resources: the plan's pods, gone with its assumption, were
        // entered under the same names as the nominated ones.
        for pod in &plan.pods {
            let hold = crate::admission::conflicts::nomination_pod_hold("ns", pod.pod.name(), &gang);
            assert_eq!(
                index.cluster().pod_node(&hold),
                Some(pod.node.as_str()),
                "{} held on its node",
                pod.pod.name()
            );
        }
    }

    /// Issue 22, finding 7: a nomination that takes one share of a device that allows
    /// several allocations holds that share and what it consumes, not the whole device:
    /// the rest stays free for other claims, as it will once the preemptor is allocated.
    #[tokio::test]
    async fn a_nominated_share_of_a_device_holds_only_that_share() {
        let index = Arc::new(Index::default());
        index.update(|c| *c = fixtures::gpu_cluster(1, 1, 1, 1));
        let admission = crate::admission::test_support::unreachable(index.clone());
        let mut share = fixtures::device_result("nic", "node-0", "gpu-0");
        share.share_id = Some("9a4c3f3e-5b7a-4c43-9a53-0d6c7e1f2a10".into());
        share.consumed_capacity = [(
            "bandwidth".to_string(),
            muster_engine::quantity::Quantity::parse("40G").expect("quantity"),
        )]
        .into();
        let plan = placement::Plan {
            gang: "ns/high".into(),
            topology_value: None,
            preferred_values: vec![],
            preferred_levels: vec![],
            group_topology: vec![],
            pods: vec![],
            claims: vec![placement::ClaimAllocation {
                claim: ObjectKey::new("ns", "high-nic").into(),
                allocation: muster_engine::claim::Allocation {
                    devices: vec![share.clone()],
                    config: vec![],
                    node_selector: None,
                },
            }],
            unplaced: vec![],
            volumes: vec![],
        };
        let workload = nominating(&plan);
        // As stored: the share and its capacity survive the status's round trip.
        let stored = &nomination_of(&workload).expect("nomination").claims[0].devices[0];
        assert_eq!(stored.share_id, share.share_id);
        assert_eq!(
            stored.consumed_capacity.get("bandwidth").map(String::as_str),
            Some("40G")
        );

        admission.assume_nomination(&workload, nomination_of(&workload).expect("nomination"));
        let cluster = index.cluster();
        let id = share.device_id();
        assert!(!cluster.device_allocated(&id), "the device is not held whole");
        assert!(cluster.device_shared(&id), "the nomination holds a share of it");
        assert_eq!(
            cluster.consumed_capacity(&id).and_then(|c| c.get("bandwidth")),
            share.consumed_capacity.get("bandwidth"),
            "and what the share consumes"
        );
    }
}
