//! Claims another allocator made (kube-scheduler, for a pod outside any gang) that a gang
//! holds as it found them.
//!
//! kube-scheduler gives a claim it allocates delete-protection, so kube-controller-manager
//! deallocates it in the write that takes its last pod out of `reservedFor`. A gang that
//! holds such a claim is no entry there until kube-scheduler binds one of its pods: the
//! last pod outside the gang ending first would take the allocation from under the gang,
//! and kube-scheduler would then allocate the claim itself, outside the gang's plan. So:
//! - the gang's hold on it (its commit) and each release list the gang's pods in
//!   `reservedFor`, on condition the claim still holds the devices read
//!   ([`claim_writes::found_claim_listing`]): kube-controller-manager keeps the entry of a
//!   pod that exists and has not ended;
//! - the gang letting go of it fences it (a listing a deposed leader prepared fails),
//!   takes its pods still behind the gate out again (nothing else would while they
//!   exist), and, as the claim's last holder, deallocates a protected claim that this
//!   leaves with no entry, as kube-controller-manager would have
//!   ([`claim_writes::gated_removal`]). The entries of released pods go with the pods,
//!   by kube-controller-manager's cleanup;
//! - a released gang's pods that are not bound yet and that such a claim does not list
//!   (kube-scheduler's Unreserve takes an entry out whoever wrote it) are listed again on
//!   a later look.
//!
//! A claim being deleted takes no new entry (the API server refuses it, and
//! kube-scheduler refuses pods on such a claim): the gang gives it up (see
//! `workload::observe::claim`) instead of trying again.

use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimConsumerReference};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use muster_api::labels;
use muster_api::v1alpha1::Workload;
use muster_engine::key::ObjectKey;
use serde_json::json;

use crate::kube_ops;
use crate::workload::observe;

use super::{Admission, CommitError, claim_writes, key};

/// How many times a listing or removal is tried on a claim that other writers move.
const ATTEMPTS: usize = 3;

/// The devices a claim's allocation holds (driver, pool, device), as read.
pub(super) fn devices(claim: &ResourceClaim) -> Option<Vec<(String, String, String)>> {
    let allocation = claim.status.as_ref()?.allocation.as_ref()?;
    Some(
        allocation
            .devices
            .iter()
            .flat_map(|d| d.results.iter().flatten())
            .map(|r| (r.driver.clone(), r.pool.clone(), r.device.clone()))
            .collect(),
    )
}

impl Admission {
    /// Lists `consumers` (pods of the gang) in `reservedFor` of `claim`, a claim another
    /// allocator made, on condition it still holds the devices it held as read. A claim
    /// moved meanwhile by another writer is read again and tried again; one deallocated,
    /// allocated elsewhere, being deleted or gone fails with a conflict, and the next
    /// look at the gang sees why.
    pub(super) async fn list_on_found(
        &self,
        api: &Api<ResourceClaim>,
        claim: &ResourceClaim,
        consumers: &[ResourceClaimConsumerReference],
    ) -> Result<Option<ResourceClaim>, CommitError> {
        let name = claim.name_any();
        let planned = devices(claim);
        let mut seen = claim.clone();
        for attempt in 1..=ATTEMPTS {
            if seen.metadata.deletion_timestamp.is_some() {
                return Err(CommitError::Conflict(format!(
                    "ResourceClaim {name} is being deleted: its pods cannot use it"
                )));
            }
            if planned.is_none() || devices(&seen) != planned || seen.metadata.uid != claim.metadata.uid {
                return Err(CommitError::Conflict(format!(
                    "ResourceClaim {name} lost its allocation before the gang's pods were listed on it; looking again"
                )));
            }
            let Some(patch) = claim_writes::found_claim_listing(&seen, consumers) else {
                return Ok(None);
            };
            let patch: json_patch::Patch = serde_json::from_value(patch).map_err(kube::Error::SerdeError)?;
            self.ensure_leading();
            match api
                .patch_status(&name, &PatchParams::default(), &Patch::Json::<()>(patch))
                .await
            {
                Ok(written) => return Ok(Some(written)),
                Err(e) if kube_ops::is_test_failed(&e) && attempt < ATTEMPTS => {}
                Err(e) if kube_ops::is_test_failed(&e) || kube_ops::is_not_found(&e) => break,
                Err(e) => return Err(e.into()),
            }
            self.ensure_leading();
            match api.get_opt(&name).await? {
                Some(current) => seen = current,
                None => break,
            }
        }
        Err(CommitError::Conflict(format!(
            "ResourceClaim {name} kept changing while the gang's pods were listed on it; looking again"
        )))
    }

    /// Lets go of `claim` (read afresh), a claim another allocator made: first fences it
    /// (moves its `held-at` fence, against the version read), so that a listing a deposed
    /// leader prepared fails instead of landing after the gang let go; then takes the
    /// gang's pods still behind the gate out of `reservedFor`, deallocating it if that
    /// leaves a protected claim with no entry and no other live gang holds it, and then
    /// takes kube-controller-manager's delete-protection off it,
    /// as kube-controller-manager does after its own deallocation. A claim moved meanwhile
    /// is read again and tried again; one that keeps moving fails with a conflict, so the
    /// record that lets go waits for the next look. Call it only once the gang's pods the
    /// record stops releasing are fenced: a pod released after all (a deposed leader's
    /// release) must not count as gated.
    pub(super) async fn let_go_of_found(
        &self,
        workload: &Workload,
        api: &Api<ResourceClaim>,
        claim: ResourceClaim,
    ) -> Result<(), CommitError> {
        let name = claim.name_any();
        let claim_key = ObjectKey::new(&claim.namespace().unwrap_or_default(), &name);
        let changing = || {
            CommitError::Conflict(format!(
                "claim {name} kept changing while {} let go of it; looking again",
                key(workload)
            ))
        };
        let Some(mut seen) = self.fence_held_at(api, claim).await? else {
            return Ok(());
        };
        for _ in 0..ATTEMPTS {
            // As the caches show them now: a commit beside this one may have changed who
            // holds the claim since the last try.
            let gated: BTreeSet<String> = self
                .gang_pods(workload)
                .iter()
                .filter(|p| crate::workload::status::is_gated(p))
                .filter_map(|p| p.uid())
                .collect();
            let gated: BTreeSet<&str> = gated.iter().map(String::as_str).collect();
            let last_holder = !self.holders().held_by_another_live_gang(&claim_key, &key(workload));
            let Some(removal) = claim_writes::gated_removal(&seen, &gated, last_holder) else {
                self.own_claims.remember(seen);
                return Ok(());
            };
            let patch: json_patch::Patch = serde_json::from_value(removal.patch).map_err(kube::Error::SerdeError)?;
            self.ensure_leading();
            match api
                .patch_status(&name, &PatchParams::default(), &Patch::Json::<()>(patch))
                .await
            {
                Ok(written) if removal.deallocates => {
                    tracing::info!(
                        workload = %key(workload), claim = %name,
                        "the gang's pods were the last entries of a claim another allocator made: deallocated, as kube-controller-manager would have"
                    );
                    self.unprotect_deallocated(api, written).await?;
                    return Ok(());
                }
                Ok(written) => {
                    self.own_claims.remember(written);
                    return Ok(());
                }
                Err(e) if kube_ops::is_not_found(&e) => return Ok(()),
                Err(e) if kube_ops::is_test_failed(&e) => {}
                Err(e) => return Err(e.into()),
            }
            // Fenced already: a fresh read is enough.
            self.ensure_leading();
            match api.get_opt(&name).await? {
                Some(current) => seen = current,
                None => return Ok(()),
            }
        }
        Err(changing())
    }

    /// Moves the `muster.dev/held-at` fence of `claim`, against the version read (once
    /// more on a fresh read if another writer moved it), so that a listing or removal a
    /// deposed leader prepared against the fence as it was fails. Returns the claim as
    /// fenced; `None` if it is gone.
    pub(super) async fn fence_held_at(
        &self,
        api: &Api<ResourceClaim>,
        claim: ResourceClaim,
    ) -> Result<Option<ResourceClaim>, CommitError> {
        let name = claim.name_any();
        let params = PatchParams {
            field_manager: Some(labels::ADMISSION_FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        let mut seen = claim;
        for _ in 0..ATTEMPTS {
            let fence = json!({
                "metadata": {
                    "resourceVersion": seen.resource_version(),
                    "annotations": {labels::CLAIM_HELD_AT: observe::now_millis().to_string()},
                },
            });
            self.ensure_leading();
            match api.patch(&name, &params, &Patch::Merge(&fence)).await {
                Ok(written) => return Ok(Some(written)),
                Err(e) if kube_ops::is_not_found(&e) => return Ok(None),
                Err(e) if kube_ops::is_conflict(&e) => {}
                Err(e) => return Err(e.into()),
            }
            self.ensure_leading();
            match api.get_opt(&name).await? {
                Some(current) => seen = current,
                None => return Ok(None),
            }
        }
        Err(CommitError::Conflict(format!(
            "claim {name} kept changing while it was fenced; looking again"
        )))
    }

    /// Takes kube-controller-manager's delete-protection off `claim`, which muster just
    /// deallocated, on condition it is still unallocated and unreserved: kube-scheduler
    /// may allocate it again meanwhile and keep the finalizer as it finds it, and that
    /// allocation's protection must stay. If the claim changed, the finalizer is left as it
    /// is (kube-controller-manager takes it off when the claim is deleted).
    async fn unprotect_deallocated(&self, api: &Api<ResourceClaim>, claim: ResourceClaim) -> Result<(), CommitError> {
        let Some(position) = claim
            .finalizers()
            .iter()
            .position(|f| f == labels::DELETE_PROTECTION_FINALIZER)
        else {
            self.own_claims.remember(claim);
            return Ok(());
        };
        let path = format!("/metadata/finalizers/{position}");
        let patch = json!([
            {"op": "test", "path": "/metadata/uid", "value": claim.uid()},
            {"op": "test", "path": "/status/allocation", "value": null},
            {"op": "test", "path": "/status/reservedFor", "value": null},
            {"op": "test", "path": path, "value": labels::DELETE_PROTECTION_FINALIZER},
            {"op": "remove", "path": path},
        ]);
        let patch: json_patch::Patch = serde_json::from_value(patch).map_err(kube::Error::SerdeError)?;
        self.ensure_leading();
        match api
            .patch(&claim.name_any(), &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
        {
            Ok(written) => self.own_claims.remember(written),
            Err(e) if kube_ops::is_test_failed(&e) || kube_ops::is_not_found(&e) => self.own_claims.remember(claim),
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// Whether every claim of the gang's journal that another allocator made is, read
    /// afresh, still the claim the caches show, allocated to the same devices and not
    /// being deleted: kube-controller-manager may have deallocated one behind the caches
    /// (the pods of the gang listed there went). Kueue hears "Ready" only then.
    pub(super) async fn found_claims_still_allocated(&self, workload: &Workload) -> Result<bool, CommitError> {
        let named: Vec<String> = super::placement_of(workload)
            .map(|p| p.claims.clone())
            .unwrap_or_default();
        let cached = self.gang_claims(workload);
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
        for name in named {
            let seen = cached
                .iter()
                .find(|c| c.metadata.name.as_deref() == Some(name.as_str()));
            if seen.is_some_and(|c| super::ownership::muster_allocated(c)) {
                continue;
            }
            self.ensure_leading();
            let Some(current) = api.get_opt(&name).await? else {
                return Ok(false);
            };
            let same = seen.is_none_or(|c| c.metadata.uid == current.metadata.uid && devices(c) == devices(&current));
            if !same {
                return Ok(false);
            }
            if super::ownership::muster_allocated(&current) {
                continue;
            }
            if current.metadata.deletion_timestamp.is_some() || !super::ownership::allocated(&current) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// A released gang's pods that a claim of its journal does not list (a release that
    /// stopped before its listing, or kube-scheduler's Unreserve after a failed bind,
    /// which takes the entry out whoever wrote it): listed now, while they are released,
    /// alive and not bound, so that kube-controller-manager cannot deallocate the claim
    /// under them when the last pod listed (of the gang, or outside it) ends. On a claim
    /// muster allocated, the listing tests the allocation's timestamp as read, as the
    /// release's own does; on a found one, its devices and fence.
    pub(super) async fn relist_released_on_found(&self, workload: &Workload) -> Result<(), CommitError> {
        let named: BTreeSet<String> = super::placement_of(workload)
            .map(|p| p.claims.iter().cloned().collect())
            .unwrap_or_default();
        let pods = self.gang_pods(workload);
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
        for claim in self.gang_claims(workload) {
            let name = claim.name_any();
            if !named.contains(&name)
                || !super::ownership::allocated(&claim)
                || claim.metadata.deletion_timestamp.is_some()
            {
                continue;
            }
            let waiting: Vec<ResourceClaimConsumerReference> = pods
                .iter()
                .filter(|p| {
                    let ended = matches!(
                        p.status.as_ref().and_then(|s| s.phase.as_deref()),
                        Some("Succeeded" | "Failed")
                    );
                    let bound = p.spec.as_ref().is_some_and(|s| s.node_name.is_some());
                    !crate::workload::status::is_gated(p)
                        && !bound
                        && !ended
                        && p.metadata.deletion_timestamp.is_none()
                        && claim_writes::names_claim(p, &name)
                })
                .filter_map(|p| {
                    Some(ResourceClaimConsumerReference {
                        api_group: None,
                        resource: "pods".into(),
                        name: p.name_any(),
                        uid: p.uid()?,
                    })
                })
                .collect();
            if waiting.is_empty() {
                continue;
            }
            if super::ownership::muster_allocated(&claim) {
                self.relist_on_own(&api, &claim, &waiting).await?;
                continue;
            }
            if claim_writes::found_claim_listing(&claim, &waiting).is_none() {
                continue;
            }
            if let Some(listed) = self.list_on_found(&api, &claim, &waiting).await? {
                self.own_claims.remember(listed);
            }
        }
        Ok(())
    }

    /// Lists `waiting` on `claim`, a claim muster allocated, against the allocation and
    /// the entries as read: a claim given back, allocated again or listed differently
    /// meanwhile is left alone (the gang's next step reads it again).
    async fn relist_on_own(
        &self,
        api: &Api<ResourceClaim>,
        claim: &ResourceClaim,
        waiting: &[ResourceClaimConsumerReference],
    ) -> Result<(), CommitError> {
        let Some(patch) = claim_writes::relisting(claim, waiting) else {
            return Ok(());
        };
        let patch: json_patch::Patch = serde_json::from_value(patch).map_err(kube::Error::SerdeError)?;
        self.ensure_leading();
        match api
            .patch_status(&claim.name_any(), &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
        {
            Ok(written) => {
                tracing::info!(claim = %claim.name_any(), "a released pod the claim no longer listed (kube-scheduler's Unreserve) is listed again");
                self.own_claims.remember(written);
                Ok(())
            }
            Err(e) if kube_ops::is_test_failed(&e) || kube_ops::is_not_found(&e) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}
