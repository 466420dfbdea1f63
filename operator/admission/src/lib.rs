//! The state machine of a gang that muster has placed: what to write next, decided from
//! what is observed. Pure and synchronous: no Kubernetes client, no clock (time is a
//! parameter), no I/O. The operator observes a Workload, its pods and its claims, calls
//! [`decide`], performs the returned [`Effect`]s in order (stopping at the first that
//! fails) and observes again.
//!
//! Every transition that writes more than once records its intent first: the
//! [`Journal`] (the Workload's `status.placement`) names the state, and each state's
//! writes are idempotent and derived from the journal and the observation, so an operator
//! that stops anywhere finishes or undoes the transition when it observes again. Writes
//! carry preconditions: the journal is written against the observed Workload version,
//! and a claim is deallocated only against a fresh read that shows no consumer but the
//! gang's finished pods.
//!
//! The commit of a plan (record, reserve, check, release) is a fixed sequence of
//! effects, [`commit::sequence`]; a commit that stops part-way leaves the journal in
//! `Reserving` or `Reserved`, which [`decide`] undoes or finishes.
#![forbid(unsafe_code)]

pub mod commit;
mod decide;
mod effect;
pub mod failure;
mod journal;
mod observe;
pub mod ownership;
pub mod refusal;

pub use decide::decide;
pub use effect::{
    Condition, ConditionType, Disruption, Effect, EventKind, Pin, PodRef, Reason, Record, Restarts, Step,
};
pub use journal::{Journal, PlannedPod, State, Vacancy};
pub use observe::{ClaimView, Consumer, Gang, GroupSpec, JobEnd, NodeHealth, Owners, Phase, PodView, Settings, Spec};

/// Wall-clock time in milliseconds since the Unix epoch, as recorded in the journal.
pub type Millis = i64;
