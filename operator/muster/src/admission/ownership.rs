//! Who holds a claim. One rule, applied alike when planning, observing, tearing down,
//! preempting and collecting:
//!
//! - every gang whose journal (`status.placement.claims`) names a claim holds it, whether
//!   muster allocated the claim for that gang or the gang found it allocated (a claim
//!   shared with another gang, or with pods outside muster); the claim's
//!   `muster.dev/workload` label only says which Workload brought it into muster's
//!   caches, and confers nothing;
//! - a gang that lets go of a claim clears the allocation only when it is the claim's
//!   last holder, muster wrote the allocation (the claim carries muster's finalizer), and
//!   nothing reserves it but pods of the gang that cannot use the devices; it stops
//!   naming the claim as it is only when another gang holds it, muster did not allocate
//!   it, or a consumer known to be outside the gang keeps it — a pod of the gang that is
//!   gone (its entry not yet out of `reservedFor`) or a consumer the caches cannot place
//!   makes it wait (`muster_admission::ownership`, which the state machine, the record's
//!   fence and preemption share);
//! - the collector clears an allocation muster wrote once no journal names the claim and
//!   no pod that may still run reserves it.
//!
//! `reservedFor` is only ever the guard that a pod may still run on the devices, never
//! the owner: a gang restarts onto the same devices with new pods, and it keeps its
//! claims between attempts because its journal names them.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use muster_api::labels;
use muster_api::v1alpha1::{AdmissionState, Workload};
use muster_engine::key::ObjectKey;

use super::{key, placement_of};

/// The gangs whose journal names each claim, by `namespace/name` of the claim.
#[derive(Default)]
pub(crate) struct Holders {
    by_claim: HashMap<ObjectKey, BTreeSet<Holder>>,
    by_gang: HashMap<ObjectKey, Vec<ObjectKey>>,
}

/// A gang that holds a claim; `deleting`: its Workload is being deleted (its journal no
/// longer moves, and its objects go with it).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Holder {
    pub(crate) gang: ObjectKey,
    pub(crate) deleting: bool,
}

/// The claims the journal of `workload` names, while it holds any (a finished gang
/// holds nothing).
fn named(workload: &Workload) -> Vec<ObjectKey> {
    let Some(placement) = placement_of(workload) else {
        return Vec::new();
    };
    if matches!(placement.state, None | Some(AdmissionState::Finished)) {
        return Vec::new();
    }
    let namespace = workload.namespace().unwrap_or_default();
    placement.claims.iter().map(|c| ObjectKey::new(&namespace, c)).collect()
}

impl Holders {
    pub(crate) fn of(workloads: &[Arc<Workload>]) -> Self {
        let mut holders = Holders::default();
        for workload in workloads {
            holders.follow(workload);
        }
        holders
    }

    /// Takes the journal of `workload` as it is now (after a write of its status).
    pub(crate) fn follow(&mut self, workload: &Workload) {
        let gang = key(workload);
        for claim in self.by_gang.remove(&gang).unwrap_or_default() {
            if let Some(set) = self.by_claim.get_mut(&claim) {
                set.retain(|h| h.gang != gang);
                if set.is_empty() {
                    self.by_claim.remove(&claim);
                }
            }
        }
        let claims = named(workload);
        if claims.is_empty() {
            return;
        }
        let holder = Holder {
            gang: gang.clone(),
            deleting: workload.metadata.deletion_timestamp.is_some(),
        };
        for claim in &claims {
            self.by_claim.entry(claim.clone()).or_default().insert(holder.clone());
        }
        self.by_gang.insert(gang, claims);
    }

    /// The gangs holding `claim`.
    pub(crate) fn of_claim(&self, claim: &ObjectKey) -> impl Iterator<Item = &Holder> {
        self.by_claim.get(claim).into_iter().flatten()
    }

    /// A gang other than `gang` holds `claim`.
    pub(crate) fn held_elsewhere(&self, claim: &ObjectKey, gang: &ObjectKey) -> bool {
        self.of_claim(claim).any(|h| h.gang != *gang)
    }

    /// A gang other than `gang` whose Workload is not being deleted holds `claim`: one
    /// being deleted takes no more steps, so it never lets go of a claim it did not
    /// allocate (its pods' entries go with its pods).
    pub(crate) fn held_by_another_live_gang(&self, claim: &ObjectKey, gang: &ObjectKey) -> bool {
        self.of_claim(claim).any(|h| h.gang != *gang && !h.deleting)
    }
}

/// muster wrote the claim's allocation: its finalizer is on the claim.
pub(crate) fn muster_allocated(claim: &ResourceClaim) -> bool {
    claim.finalizers().iter().any(|f| f == labels::CLAIM_FINALIZER)
}

pub(crate) fn allocated(claim: &ResourceClaim) -> bool {
    claim.status.as_ref().is_some_and(|s| s.allocation.is_some())
}

/// What the collector does with a claim carrying muster's finalizer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Collect {
    /// A live gang holds it, or it is not garbage yet.
    Keep,
    /// Clear the allocation once no pod that may run reserves it, then remove the
    /// finalizer.
    Release,
}

/// The collector's rule: a claim no live gang holds is released when it is being
/// deleted, when the Workload whose label it carries is gone, or when it is allocated
/// and named by no journal at all. (A Workload being deleted keeps what its journal
/// names until its own objects go.)
pub(crate) fn collect(claim: &ResourceClaim, holders: &Holders, workload_exists: bool) -> Collect {
    let claim_key = ObjectKey::new(&claim.namespace().unwrap_or_default(), &claim.name_any());
    let mut named_by_deleting = false;
    for holder in holders.of_claim(&claim_key) {
        if !holder.deleting {
            return Collect::Keep;
        }
        named_by_deleting = true;
    }
    let deleting = claim.metadata.deletion_timestamp.is_some();
    let orphaned = claim.labels().contains_key(labels::WORKLOAD) && !workload_exists;
    if deleting || orphaned || (allocated(claim) && !named_by_deleting) {
        Collect::Release
    } else {
        Collect::Keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn workload(name: &str, state: &str, claims: &[&str], deleting: bool) -> Arc<Workload> {
        let mut metadata = json!({"name": name, "namespace": "ns"});
        if deleting {
            metadata["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
                "metadata": metadata,
                "spec": {"podGroups": [{"name": "w", "replicas": 1}]},
                "status": {"placement": {"state": state, "claims": claims}},
            }))
            .expect("workload"),
        )
    }

    fn claim(name: &str, label: &str, ours: bool, allocated: bool, reserved: &[&str]) -> ResourceClaim {
        let finalizers: Vec<&str> = if ours { vec![labels::CLAIM_FINALIZER] } else { vec![] };
        let mut status = json!({});
        if allocated {
            status["allocation"] = json!({"devices": {"results": []}});
            status["reservedFor"] = json!(
                reserved
                    .iter()
                    .map(|u| json!({"resource": "pods", "name": u, "uid": u}))
                    .collect::<Vec<_>>()
            );
        }
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "labels": {labels::WORKLOAD: label}, "finalizers": finalizers},
            "spec": {"devices": {"requests": []}},
            "status": status,
        }))
        .expect("claim")
    }

    #[test]
    fn every_gang_whose_journal_names_a_claim_holds_it() {
        let a = workload("a", "Released", &["scratch", "a-0-gpu"], false);
        let b = workload("b", "TearingDown", &["scratch"], false);
        let done = workload("c", "Finished", &["scratch"], false);
        let mut holders = Holders::of(&[a, b.clone(), done]);
        let scratch = ObjectKey::new("ns", "scratch");
        assert!(holders.held_elsewhere(&scratch, &ObjectKey::new("ns", "b")));
        let gangs: Vec<&str> = holders.of_claim(&scratch).map(|h| h.gang.as_str()).collect();
        assert_eq!(gangs, ["ns/a", "ns/b"], "a finished journal holds nothing");
        // a lets go of it.
        holders.follow(&workload("a", "Released", &["a-0-gpu"], false));
        assert!(!holders.held_elsewhere(&scratch, &ObjectKey::new("ns", "b")));
    }

    #[test]
    fn the_collector_keeps_what_a_live_gang_names_whatever_the_label() {
        let holder = workload("b", "Released", &["scratch"], false);
        let holders = Holders::of(&[holder]);
        // Labelled for a Workload that is gone, held by b.
        let orphan = claim("scratch", "a", true, true, &[]);
        assert_eq!(collect(&orphan, &holders, false), Collect::Keep);
        // Named by no journal: released.
        let holders = Holders::of(&[]);
        assert_eq!(collect(&orphan, &holders, false), Collect::Release);
        assert_eq!(
            collect(&claim("left", "a", true, true, &["outsider"]), &holders, true),
            Collect::Release
        );
        assert_eq!(
            collect(&claim("free", "a", true, false, &[]), &holders, true),
            Collect::Keep
        );
        // A Workload being deleted keeps its own until they go.
        let going = Holders::of(&[workload("a", "Released", &["a-0-gpu"], true)]);
        assert_eq!(
            collect(&claim("a-0-gpu", "a", true, true, &[]), &going, true),
            Collect::Keep
        );
    }
}
