//! What the state machine asks the operator to do.

use crate::{Journal, Millis};

/// Status conditions the admission side of muster owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ConditionType {
    Admitted,
    Restarting,
    Succeeded,
    Failed,
}

/// Condition and event reasons of the state machine (PascalCase when written).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    Reserving,
    Admitted,
    RolledBack,
    Conflict,
    ScheduleTimeout,
    ReleaseTimeout,
    Suspended,
    PodFailed,
    PodLost,
    NodeLost,
    MaxRestartsExceeded,
    SucceededPodGroups,
    Restarted,
    /// Evicted whole so that a gang of higher priority fits.
    Preempted,
    /// A rule of the failure policy failed the gang at once.
    FailedByRule,
    /// kube-scheduler refused a released pod on its planned node.
    SchedulerRefused,
    /// A core pod failed or went, and its controller replaces it (`restartedBy:
    /// PodController`).
    PodReplaced,
    /// The pods' controller says their job completed.
    JobCompleted,
    /// The pods' controller says their job failed.
    JobFailed,
    /// A replacement its controller makes was not placed within the schedule timeout:
    /// the gang is requeued whole rather than hold its other members' devices.
    ReplacementTimeout,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Reserving => "Reserving",
            Reason::Admitted => "Admitted",
            Reason::RolledBack => "RolledBack",
            Reason::Conflict => "Conflict",
            Reason::ScheduleTimeout => "ScheduleTimeout",
            Reason::ReleaseTimeout => "ReleaseTimeout",
            Reason::Suspended => "Suspended",
            Reason::PodFailed => "PodFailed",
            Reason::PodLost => "PodLost",
            Reason::NodeLost => "NodeLost",
            Reason::MaxRestartsExceeded => "MaxRestartsExceeded",
            Reason::SucceededPodGroups => "SucceededPodGroups",
            Reason::Restarted => "Restarted",
            Reason::Preempted => "Preempted",
            Reason::FailedByRule => "FailedByRule",
            Reason::SchedulerRefused => "SchedulerRefused",
            Reason::PodReplaced => "PodReplaced",
            Reason::JobCompleted => "JobCompleted",
            Reason::JobFailed => "JobFailed",
            Reason::ReplacementTimeout => "ReplacementTimeout",
        }
    }

    pub fn parse(text: &str) -> Option<Reason> {
        const ALL: [Reason; 20] = [
            Reason::Reserving,
            Reason::Admitted,
            Reason::RolledBack,
            Reason::Conflict,
            Reason::ScheduleTimeout,
            Reason::ReleaseTimeout,
            Reason::Suspended,
            Reason::PodFailed,
            Reason::PodLost,
            Reason::NodeLost,
            Reason::MaxRestartsExceeded,
            Reason::SucceededPodGroups,
            Reason::Restarted,
            Reason::Preempted,
            Reason::FailedByRule,
            Reason::SchedulerRefused,
            Reason::PodReplaced,
            Reason::JobCompleted,
            Reason::JobFailed,
            Reason::ReplacementTimeout,
        ];
        ALL.into_iter().find(|r| r.as_str() == text)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    pub type_: ConditionType,
    pub status: bool,
    pub reason: Reason,
    pub message: String,
}

/// A write of the Workload's status, conditional on the version observed: the journal
/// (`None` removes it: the gang is queued), conditions to set, the restart counts, the
/// refusals the gang remembers (`None` keeps them as they are).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub journal: Option<Journal>,
    pub conditions: Vec<Condition>,
    pub restarts: Option<Restarts>,
    pub refusals: Option<Vec<crate::refusal::Refusal>>,
}

/// The gang's restarts: every one (the attempt its pods carry), and those that count
/// against `failurePolicy.maxRestarts`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Restarts {
    pub total: i32,
    pub counted: i32,
}

/// Events muster publishes about a Workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Admitted,
    RolledBack,
    ScheduleTimeout,
    SchedulerRefused,
    Restarting,
    Succeeded,
    Failed,
    Expired,
}

/// A pod as observed: a write to it is conditional on its uid, so that a pod made
/// again under the same name is never taken for the one observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRef {
    pub name: String,
    pub uid: String,
}

/// A pod to release onto its planned node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pin {
    pub pod: PodRef,
    pub node: String,
}

/// Why muster deletes pods another controller made and cannot suspend: the
/// `DisruptionTarget` condition it gives them first, as kube-scheduler's preemption does,
/// so that a `podFailurePolicy` rule on `DisruptionTarget` can ignore the loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disruption {
    /// A gang of higher priority takes the devices.
    Preemption,
    /// Any other teardown (a schedule timeout, a refusal, a conflict, a suspend).
    Termination,
}

impl Disruption {
    /// The condition's reason.
    pub fn reason(self) -> &'static str {
        match self {
            Disruption::Preemption => "PreemptionByMuster",
            Disruption::Termination => "TerminationByMuster",
        }
    }
}

// A step has a handful of effects: boxing the record would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Write the status (see [`Record`]).
    Record(Record),
    /// Delete these pods with their grace period, or at once when their node is gone
    /// (no kubelet will confirm the end); pods another controller made get the
    /// `DisruptionTarget` condition first (`disruption`).
    DeletePods {
        pods: Vec<PodRef>,
        immediately: bool,
        disruption: Option<Disruption>,
    },
    /// Suspend every object that makes the gang's pods and that muster can suspend,
    /// marked as muster's (see [`crate::Owners`]): their controllers take the pods away.
    SuspendOwners,
    /// Resume the objects muster marked as suspended for this gang, taking the mark off:
    /// their controllers make the pods again, behind the gate.
    ResumeOwners,
    /// Clear the allocation of these claims, each against a fresh read, and only while
    /// its `reservedFor` lists no pod but those in `idle` (uids of the gang's pods that
    /// cannot use the devices: terminated, or never released): a pod that may still run
    /// keeps its devices.
    Deallocate { claims: Vec<String>, idle: Vec<String> },
    /// Remove the gang gate of these pods, pinning each to its node.
    Release { pods: Vec<Pin> },
    /// Delete the Workload (its TTL after finishing ran out).
    DeleteWorkload,
    /// Publish an event.
    Event {
        kind: EventKind,
        warning: bool,
        action: &'static str,
        note: String,
    },
}

/// What to do now, and when to look again at the latest if nothing changes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    pub effects: Vec<Effect>,
    pub recheck_in: Option<Millis>,
}

impl Step {
    pub fn idle() -> Step {
        Step::default()
    }

    pub fn effects(effects: Vec<Effect>) -> Step {
        Step {
            effects,
            recheck_in: None,
        }
    }

    pub fn then_recheck_in(mut self, millis: Millis) -> Step {
        self.recheck_in = Some(self.recheck_in.map_or(millis, |m| m.min(millis)).max(0));
        self
    }

    /// The status write among the effects, if any.
    pub fn record(&self) -> Option<&Record> {
        self.effects.iter().find_map(|e| match e {
            Effect::Record(r) => Some(r),
            _ => None,
        })
    }
}
