//! Who uses a claim a gang holds, from its `status.reservedFor`, and what the gang may do
//! with the claim because of it.
//!
//! Each entry is one of three:
//! - **the gang's own**: a pod of the gang (by uid, or by name: a pod made again under
//!   the same name), or one its journal names (a planned pod, a retired attempt's) —
//!   also once the pod is gone, until kube-controller-manager takes its entry out;
//! - **outside**: a pod the operator knows and that is not the gang's (another gang's, a
//!   pod outside muster), or a consumer that is not a pod;
//! - **unknown**: neither. It may be a pod the caches have not shown yet, or one that is
//!   gone: the gang holds the claim and waits until the caches tell, or the entry leaves
//!   `reservedFor` (kube-controller-manager removes the entries of pods that are gone).
//!
//! An own pod that is gone, or may still run, keeps the claim allocated; an unknown one
//! does too, and never counts as someone the gang may leave the claim to.

use crate::{ClaimView, Consumer, Journal, PodView};

/// Who reserves a claim, as one gang sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Users {
    /// A pod of the gang that may still run reserves it, or one that is gone while its
    /// entry is still there.
    pub own_active: bool,
    /// A consumer known to be outside the gang reserves it.
    pub outside: bool,
    /// A consumer neither known to be the gang's nor known to be outside reserves it.
    pub unknown: bool,
}

/// Whether `consumer` is one of the gang's pods (`pods`, and those `journal` names).
fn own(consumer: &Consumer, pods: &[PodView], journal: Option<&Journal>) -> bool {
    pods.iter().any(|p| p.uid == consumer.uid || p.name == consumer.name)
        || journal.is_some_and(|j| j.retired.contains(&consumer.uid) || j.planned(&consumer.name).is_some())
}

/// A pod of the gang that cannot use devices: terminated, or never released.
pub(crate) fn idle(pod: &PodView) -> bool {
    pod.phase.terminal() || (pod.gated && pod.node.is_none())
}

/// Who reserves `claim`, seen from the gang whose pods are `pods` and journal `journal`.
pub fn users(claim: &ClaimView, pods: &[PodView], journal: Option<&Journal>) -> Users {
    let mut users = Users::default();
    for consumer in &claim.reserved_for {
        if own(consumer, pods, journal) {
            let pod = pods.iter().find(|p| p.uid == consumer.uid);
            users.own_active |= pod.is_none_or(|p| !idle(p));
        } else if consumer.known_outside {
            users.outside = true;
        } else {
            users.unknown = true;
        }
    }
    users
}

/// Whether the gang may stop naming `claim` as it is: it is not allocated, muster did
/// not allocate it, another gang holds it, or a consumer known to be outside the gang
/// keeps it while none of the gang's own may still use it and none is unknown.
/// Otherwise the gang must give it back (deallocate it) first, or wait.
pub fn may_let_go(claim: &ClaimView, pods: &[PodView], journal: Option<&Journal>) -> bool {
    if !claim.allocated || !claim.ours || claim.held_elsewhere {
        return true;
    }
    let users = users(claim, pods, journal);
    users.outside && !users.own_active && !users.unknown
}

/// Whether taking the gang apart gives `claim`'s devices back: muster allocated it, no
/// other gang holds it, and nothing but the gang's own pods reserves it (what preemption
/// may count as freed).
pub fn freed_by_giving_back(claim: &ClaimView, pods: &[PodView], journal: Option<&Journal>) -> bool {
    if !claim.allocated || !claim.ours || claim.held_elsewhere {
        return false;
    }
    let users = users(claim, pods, journal);
    !users.outside && !users.unknown
}
