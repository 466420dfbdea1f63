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
//! - the gang letting go of it takes its pods still behind the gate out again (nothing
//!   else would while they exist), and deallocates a protected claim if that leaves no
//!   entry, as kube-controller-manager would have ([`claim_writes::gated_removal`]). The
//!   entries of released pods go with the pods, by kube-controller-manager's cleanup.
//!
//! A claim being deleted takes no new entry (the API server refuses it, and
//! kube-scheduler refuses pods on such a claim): the gang gives it up (see
//! `workload::observe::claim`) instead of trying again.

use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimConsumerReference};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use muster_api::v1alpha1::Workload;

use crate::kube_ops;

use super::{Admission, CommitError, claim_writes, key};

/// How many times a listing or removal is tried on a claim that other writers move.
const ATTEMPTS: usize = 3;

/// The devices a claim's allocation holds (driver, pool, device), as read.
fn devices(claim: &ResourceClaim) -> Option<Vec<(String, String, String)>> {
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

    /// Takes the gang's pods still behind the gate out of `reservedFor` of `claim` (read
    /// afresh), a claim another allocator made that the gang lets go of, deallocating it
    /// if that leaves a protected claim with no entry. A claim moved meanwhile is read
    /// again and tried again; one that keeps moving fails with a conflict, so the record
    /// that lets go waits for the next look.
    pub(super) async fn unlist_from_found(
        &self,
        workload: &Workload,
        api: &Api<ResourceClaim>,
        claim: ResourceClaim,
    ) -> Result<(), CommitError> {
        let name = claim.name_any();
        let pods = self.gang_pods(workload);
        let gated: BTreeSet<String> = pods
            .iter()
            .filter(|p| crate::workload::status::is_gated(p))
            .filter_map(|p| p.uid())
            .collect();
        let gated: BTreeSet<&str> = gated.iter().map(String::as_str).collect();
        let mut seen = claim;
        for attempt in 1..=ATTEMPTS {
            let Some(removal) = claim_writes::gated_removal(&seen, &gated) else {
                return Ok(());
            };
            let patch: json_patch::Patch = serde_json::from_value(removal.patch).map_err(kube::Error::SerdeError)?;
            self.ensure_leading();
            match api
                .patch_status(&name, &PatchParams::default(), &Patch::Json::<()>(patch))
                .await
            {
                Ok(written) => {
                    if removal.deallocates {
                        tracing::info!(
                            workload = %key(workload), claim = %name,
                            "the last entry of a claim another allocator made was the gang's: deallocated, as kube-controller-manager would have"
                        );
                    }
                    self.own_claims.remember(written);
                    return Ok(());
                }
                Err(e) if kube_ops::is_not_found(&e) => return Ok(()),
                Err(e) if kube_ops::is_test_failed(&e) && attempt < ATTEMPTS => {}
                Err(e) if kube_ops::is_test_failed(&e) => break,
                Err(e) => return Err(e.into()),
            }
            self.ensure_leading();
            match api.get_opt(&name).await? {
                Some(current) => seen = current,
                None => return Ok(()),
            }
        }
        Err(CommitError::Conflict(format!(
            "claim {name} kept changing while {} took its gated pods out of it; looking again",
            key(workload)
        )))
    }

    /// Whether every claim of the gang's journal that another allocator made is, read
    /// afresh, still allocated and not being deleted: kube-controller-manager may have
    /// deallocated one behind the caches (the pods of the gang listed there went). Kueue
    /// hears "Ready" only then.
    pub(super) async fn found_claims_still_allocated(&self, workload: &Workload) -> Result<bool, CommitError> {
        let named: BTreeSet<String> = super::placement_of(workload)
            .map(|p| p.claims.iter().cloned().collect())
            .unwrap_or_default();
        let found: Vec<String> = self
            .gang_claims(workload)
            .iter()
            .filter(|c| named.contains(&c.name_any()) && !super::ownership::muster_allocated(c))
            .map(|c| c.name_any())
            .collect();
        if found.is_empty() {
            return Ok(true);
        }
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
        for name in found {
            self.ensure_leading();
            let Some(current) = api.get_opt(&name).await? else {
                return Ok(false);
            };
            if current.metadata.deletion_timestamp.is_some() || !super::ownership::allocated(&current) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}
