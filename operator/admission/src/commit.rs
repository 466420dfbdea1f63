//! Committing a plan: the journal entries a commit writes. The operator runs the
//! commit as one sequence:
//!
//! 1. record [`reserving`] (the intent: these claims may be allocated);
//! 2. allocate every claim, each conditional on the version the plan saw;
//! 3. check that no other claim took a planned device;
//! 4. release every planned pod ([`pins`]), with nothing recorded before: a planned pod
//!    out of the gate is the record that the commit came this far, and
//!    [`crate::decide`] finishes a `Reserving` gang that shows one as it does a
//!    `Reserved` one (releases the rest, records `Released`);
//! 5. record `Released`, off the pods' path, through [`crate::decide`].
//!
//! A gang whose release waits for Kueue's admission records [`reserved`] after step 3
//! instead and releases nothing: Kueue admits on the recorded reservation.
//!
//! A commit that fails before step 4 deallocates what it wrote and records [`failed`]
//! (still `Reserving`, with the cause); [`crate::decide`] then gives back whatever is
//! still allocated and queues the gang. Extras of a running gang are committed the same
//! way, with [`with_extras`] and [`extras_released`].

use crate::{Journal, Millis, Pin, PlannedPod, PodView, Reason, State};

/// What a plan places: pods on nodes, claims to allocate, for the status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub pods: Vec<PlannedPod>,
    pub claims: Vec<String>,
    pub topology_value: Option<String>,
    pub devices: i32,
}

impl Placement {
    fn nodes(&self) -> Vec<String> {
        let mut nodes: Vec<String> = self.pods.iter().map(|p| p.node.clone()).collect();
        nodes.sort();
        nodes.dedup();
        nodes
    }
}

/// Step 1: the plan, recorded before any claim is written.
pub fn reserving(placement: &Placement, now: Millis) -> Journal {
    Journal {
        state: State::Reserving,
        since: now,
        nodes: placement.nodes(),
        pods: placement
            .pods
            .iter()
            .map(|p| PlannedPod {
                released_at: None,
                ..p.clone()
            })
            .collect(),
        claims: placement.claims.clone(),
        released_at: None,
        reuse_reservation: false,
        retired: Vec::new(),
        cause: None,
        topology_value: placement.topology_value.clone(),
        devices: placement.devices,
        vacancies: Vec::new(),
    }
}

/// Step 4: every claim is allocated and checked.
pub fn reserved(journal: &Journal, now: Millis) -> Journal {
    journal.moved(State::Reserved, now)
}

/// The planned pods still behind the gate, each pinned to its planned node: what a
/// commit whose reservation is whole and checked releases. `current_pod` finds the pod
/// of a planned name in the gang's current attempt (not one being deleted).
pub fn pins<'p>(journal: &Journal, current_pod: impl Fn(&str) -> Option<&'p PodView>) -> Vec<Pin> {
    journal
        .pods
        .iter()
        .filter_map(|p| {
            let pod = current_pod(&p.name).filter(|pod| pod.gated)?;
            Some(Pin {
                pod: pod.reference(),
                node: p.node.clone(),
            })
        })
        .collect()
}

/// Whether a `Reserving` commit released a planned pod: then every claim was allocated
/// and checked (step 4 comes after the check and nothing else releases a planned pod),
/// and the commit is to be finished, not undone. A commit recorded as failed released
/// nothing.
pub fn released_any<'p>(journal: &Journal, current_pod: impl Fn(&str) -> Option<&'p PodView>) -> bool {
    journal.state == State::Reserving
        && journal.cause.is_none()
        && journal
            .pods
            .iter()
            .any(|p| current_pod(&p.name).is_some_and(|pod| !pod.gated))
}

/// A commit that failed before every claim was allocated and checked: still
/// `Reserving`, so that whatever is still allocated is given back before the gang is
/// queued, with the reason it reports then.
pub fn failed(journal: &Journal, reason: Reason, message: String) -> Journal {
    Journal {
        cause: Some((reason, message)),
        ..journal.clone()
    }
}

/// Extras placed while the gang runs, recorded (not yet released) before their claims
/// are written. If their commit stops, [`crate::decide`] drops them. Core pods among
/// them (replacements for places their controller vacated, `restartedBy: PodController`)
/// are recorded as extras until [`extras_released`], so that a commit that stops drops
/// them as it drops extras.
pub fn with_extras(journal: &Journal, extras: &Placement) -> Journal {
    let mut grown = journal.clone();
    // Placed into a gang none of whose pods was left: the placement's domain is the gang's.
    if grown.pods.is_empty() {
        grown.topology_value = extras.topology_value.clone();
    }
    grown.pods.extend(extras.pods.iter().map(|p| PlannedPod {
        released_at: None,
        extra: true,
        ..p.clone()
    }));
    for claim in &extras.claims {
        // A claim the extras share with the gang is named once.
        if !grown.claims.contains(claim) {
            grown.claims.push(claim.clone());
        }
    }
    grown.devices += extras.devices;
    let mut nodes: Vec<String> = grown.pods.iter().map(|p| p.node.clone()).collect();
    nodes.sort();
    nodes.dedup();
    grown.nodes = nodes;
    grown
}

/// Extras whose claims are allocated and checked, about to be released.
/// Replacements of core pods (placed as core) become core pods of the gang here, and
/// fill the vacancies of their group, oldest first (a vacancy whose group is not known
/// is filled by any replacement).
pub fn extras_released(journal: &Journal, extras: &Placement, now: Millis) -> Journal {
    let mut released = journal.clone();
    for pod in released.pods.iter_mut() {
        if let Some(placed) = extras.pods.iter().find(|p| p.name == pod.name) {
            pod.released_at = Some(now);
            if !placed.extra {
                pod.extra = false;
                pod.claims.clear();
            }
        }
    }
    released.vacancies.sort_by_key(|v| v.since);
    for replacement in extras.pods.iter().filter(|p| !p.extra) {
        let filled = released
            .vacancies
            .iter()
            .position(|v| v.group.is_some() && v.group == replacement.group)
            .or_else(|| {
                released
                    .vacancies
                    .iter()
                    .position(|v| v.group.is_none() || replacement.group.is_none())
            });
        if let Some(at) = filled {
            released.vacancies.remove(at);
        }
    }
    released
}
