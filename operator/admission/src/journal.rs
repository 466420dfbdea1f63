//! The journal: what muster recorded about a gang's placement, before acting on it.

use crate::{Millis, Reason};

/// Where a placed gang stands. Each state names the writes that may be under way, so
/// that whoever observes it next can finish or undo them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum State {
    /// The plan is recorded; claims are being allocated. No pod is released.
    Reserving,
    /// Every claim is allocated; the planned pods are being released.
    Reserved,
    /// Every planned pod was released to the scheduler.
    Released,
    /// The gang is being taken apart to be queued again: its released pods are deleted,
    /// then its claims deallocated.
    TearingDown,
    /// A pod failed or was lost: the attempt's pods (`retired`) are being deleted; then
    /// the gang goes back onto its reservation or into the queue.
    Restarting,
    /// `spec.suspend` was set: the released pods are deleted and the claims
    /// deallocated; then the gang holds nothing.
    Suspending,
    /// The gang succeeded or failed: what still runs is stopped and the claims are
    /// deallocated.
    Finishing,
    /// Nothing is held any more.
    Finished,
}

/// A pod and the node it was planned on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedPod {
    pub name: String,
    pub node: String,
    /// Its group, where the plan recorded it (journals written before did not).
    pub group: Option<String>,
    /// Beyond its group's minCount: its loss does not restart the gang.
    pub extra: bool,
    /// When an extra was released; `None` while its reservation is being made (a plan
    /// recorded but not released yet, undone if no live commit finishes it).
    pub released_at: Option<Millis>,
    /// An extra's own claims (not shared with the gang), given back when it is dropped.
    pub claims: Vec<String>,
    /// The devices of its own claims (`driver/pool/device`), recorded where its
    /// controller replaces it: kube-controller-manager may deallocate them before muster
    /// sees it went, and its [`Vacancy`] keeps them for its replacement.
    pub devices: Vec<String>,
}

/// A place of the gang whose core pod failed or went, kept for the replacement its
/// controller makes (`restartedBy: PodController`): where the replacement goes back to,
/// and since when the gang is short of it. The gang holds its other members' devices for
/// at most the schedule timeout from `since`; then it is requeued whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vacancy {
    /// The pod that left it.
    pub pod: String,
    /// The member it was: its group and its index in the group, where known.
    pub group: Option<String>,
    pub index: Option<i32>,
    pub node: String,
    /// The devices its own claims held (`driver/pool/device`).
    pub devices: Vec<String>,
    /// When the place became vacant.
    pub since: Millis,
}

/// The recorded placement of a gang (`status.placement`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Journal {
    pub state: State,
    /// When `state` was entered.
    pub since: Millis,
    pub pods: Vec<PlannedPod>,
    /// The claims the gang holds (or is reserving): those muster allocates for it and
    /// those it found allocated and shares (see [`crate::ClaimView`] for who clears them).
    pub claims: Vec<String>,
    /// When the gang's core pods were released.
    pub released_at: Option<Millis>,
    /// While restarting: the next attempt goes onto the same reservation.
    pub reuse_reservation: bool,
    /// While restarting: the uids of the attempt's pods that must be gone first.
    pub retired: Vec<String>,
    /// Why the gang is being taken apart (TearingDown, or a Reserving commit that
    /// failed): the reason the gang reports when it is queued again.
    pub cause: Option<(Reason, String)>,
    /// Carried for the status: the topology value, node list and device count.
    pub topology_value: Option<String>,
    pub nodes: Vec<String>,
    pub devices: i32,
    /// Places vacated for replacements not placed yet.
    pub vacancies: Vec<Vacancy>,
}

impl Journal {
    /// The journal of a gang that finished without holding anything.
    pub fn finished(now: Millis) -> Journal {
        Journal {
            state: State::Finished,
            since: now,
            pods: Vec::new(),
            claims: Vec::new(),
            released_at: None,
            reuse_reservation: false,
            retired: Vec::new(),
            cause: None,
            topology_value: None,
            nodes: Vec::new(),
            devices: 0,
            vacancies: Vec::new(),
        }
    }

    /// The same journal in `state`, entered at `now`. Vacated places are held only while
    /// the gang runs (`Released`): any other state gives them up.
    pub fn moved(&self, state: State, now: Millis) -> Journal {
        Journal {
            state,
            since: now,
            vacancies: if state == State::Released {
                self.vacancies.clone()
            } else {
                Vec::new()
            },
            ..self.clone()
        }
    }

    /// Whether pods of the plan may be released in this state: reserved or released, or
    /// a commit that has not failed (it releases its pods once its check passed, with
    /// nothing recorded in between). A record that leaves such a state fences the
    /// planned pods still behind the gate first.
    pub fn may_release(&self) -> bool {
        match self.state {
            State::Reserved | State::Released => true,
            State::Reserving => self.cause.is_none(),
            _ => false,
        }
    }

    pub fn planned(&self, name: &str) -> Option<&PlannedPod> {
        self.pods.iter().find(|p| p.name == name)
    }

    /// The planned pods within their group's minCount.
    pub fn core(&self) -> impl Iterator<Item = &PlannedPod> {
        self.pods.iter().filter(|p| !p.extra)
    }
}
