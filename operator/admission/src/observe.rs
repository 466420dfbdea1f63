//! What the operator observes about a gang, in the core's own terms.

use std::collections::BTreeMap;

use crate::{Journal, Millis};

/// Timeouts of the state machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// How long released pods may stay unscheduled before the gang (or an extra) is
    /// taken apart and placed again.
    pub schedule_timeout: Millis,
    /// How long a reserved gang may wait for its planned pods to exist before its
    /// reservation is given back.
    pub release_timeout: Millis,
    /// How long a refusal must have stood, and the pod been released, before
    /// kube-scheduler's refusal of it takes the gang apart (see [`crate::refusal`]).
    pub refusal_grace: Millis,
    /// How long a teardown waits for the controller of a suspended owner to take its pods
    /// away before muster deletes them itself (the controller is not running, or another
    /// manages the object).
    pub owner_stop_timeout: Millis,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            schedule_timeout: 120_000,
            release_timeout: 120_000,
            refusal_grace: 15_000,
            owner_stop_timeout: 60_000,
        }
    }
}

/// The part of the Workload spec the state machine reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Spec {
    /// The Workload's `spec.suspend`.
    pub suspend: bool,
    /// Kueue took the gang back (evicted it, or its admission went): it is taken apart
    /// as for a suspend, but its pods' owners may make their pods again at once, to wait
    /// behind the gate for Kueue's next admission.
    pub evicted: bool,
    pub groups: Vec<GroupSpec>,
    /// Groups whose success is the gang's (empty: every group).
    pub success_groups: Vec<String>,
    pub max_restarts: i32,
    /// `failurePolicy.rules`, in order.
    pub failure_rules: Vec<crate::failure::FailureRule>,
    /// `failurePolicy.restartBackoff`.
    pub restart_backoff: Option<crate::failure::Backoff>,
    pub ttl_seconds_after_finished: Option<i64>,
    /// `failurePolicy.restartedBy: PodController`: the pods' controller replaces failed
    /// and lost pods; muster never restarts the gang (see [`crate::decide`]).
    pub restarted_by_pod_controller: bool,
    /// How the pods' controller says their job ended, once it did.
    pub job_ended: Option<JobEnd>,
}

/// The end of the job whose pods make up the gang, as its controller reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobEnd {
    pub succeeded: bool,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    pub name: String,
    pub min_count: i32,
    /// muster makes the group's pods (it has a template); otherwise another controller
    /// does, and its pods carry no attempt label.
    pub managed: bool,
}

impl Spec {
    /// The gang must hold nothing: suspended, or evicted by Kueue.
    pub fn stopped(&self) -> bool {
        self.suspend || self.evicted
    }

    pub fn group(&self, name: &str) -> Option<&GroupSpec> {
        self.groups.iter().find(|g| g.name == name)
    }

    pub fn has_external_groups(&self) -> bool {
        self.groups.iter().any(|g| !g.managed)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Pending,
    Running,
    Succeeded,
    Failed,
    Unknown,
}

impl Phase {
    pub fn terminal(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed)
    }
}

/// A pod carrying the gang's label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodView {
    pub name: String,
    pub uid: String,
    pub group: Option<String>,
    /// Its index within its group, where it carries one (a Job's completion index).
    pub index: Option<i32>,
    /// The attempt label of muster's own pods; `None` for other controllers' pods.
    pub attempt: Option<i32>,
    /// Still behind muster's scheduling gate.
    pub gated: bool,
    pub phase: Phase,
    /// The node it is bound to.
    pub node: Option<String>,
    /// Being deleted (its containers may still run).
    pub deleting: bool,
    /// Why it failed, if it says.
    pub message: Option<String>,
    /// How it failed, when the pod says more than that a container did: evicted,
    /// preempted, past its deadline.
    pub failure_kind: Option<crate::failure::FailureKind>,
    /// Exit codes of its terminated containers, by container name.
    pub exit_codes: Vec<(String, i32)>,
    /// Its conditions, `(type, status)`.
    pub conditions: Vec<(String, String)>,
    /// kube-scheduler's `PodScheduled=False` condition, while it has not bound the pod.
    pub unscheduled: Option<Unscheduled>,
    /// Made by an object muster can suspend (a Job, a JobSet, a TrainJob): muster stops it
    /// by suspending that object, whose controller then takes it away without counting a
    /// failure, never by deleting it (see [`Owners`]).
    pub owned: bool,
}

impl PodView {
    pub fn reference(&self) -> crate::PodRef {
        crate::PodRef {
            name: self.name.clone(),
            uid: self.uid.clone(),
        }
    }
}

/// A consumer in a claim's `status.reservedFor` (see [`crate::ownership`] for whose it
/// is).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Consumer {
    pub name: String,
    pub uid: String,
    /// The operator's caches show this consumer, and it is not one of the gang's pods: a
    /// pod of another gang, a pod outside muster, or something that is not a pod.
    pub known_outside: bool,
}

/// A claim of the gang: one its pods use, or one its journal names.
///
/// Ownership of a shared claim: every gang whose journal names the claim holds it,
/// whether it allocated the claim or found it allocated. A gang that lets go of a claim
/// clears the allocation only if it is the last holder, muster wrote the allocation, and
/// nothing reserves it but pods of the gang that cannot use the devices; it stops naming
/// the claim as it is only when another gang holds it, muster did not allocate it, or a
/// consumer known to be outside the gang keeps it (see [`crate::ownership`]): then the
/// allocation is left to the other holders, to the pod outside, or to the operator's
/// collector (which clears what muster allocated once no journal names it and no pod
/// uses it). A pod of the gang that is gone, and a consumer the caches cannot place,
/// make the gang wait.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimView {
    pub name: String,
    pub allocated: bool,
    /// muster wrote the allocation (the claim carries its finalizer): only such an
    /// allocation is muster's to clear.
    pub ours: bool,
    /// The journal of another gang names the claim: that gang holds it too.
    pub held_elsewhere: bool,
    /// `status.reservedFor` (see [`crate::ownership`] for whose each entry is).
    pub reserved_for: Vec<Consumer>,
    /// Uids of the gang's pods whose spec names the claim.
    pub used_by: Vec<String>,
    /// It carries kube-controller-manager's delete-protection: its allocation goes with
    /// the last pod in `reservedFor`, so no restart may count on it.
    pub protected: bool,
    /// The devices of its allocation (`driver/pool/device`).
    pub devices: Vec<String>,
}

/// The objects whose controllers make the gang's pods, where muster can suspend them (a
/// Job, a JobSet, a TrainJob). A teardown suspends them, marked as muster's, rather than
/// delete their pods: their controllers then take the pods away without counting a
/// failure against `backoffLimit`, `podFailurePolicy` or `maxRestarts`; once every claim
/// is given back, muster resumes what it marked, and the controllers make the pods again
/// behind muster's gate, where they wait to be placed again (as Kueue requeues a job).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Owners {
    /// Every such object of the gang carries muster's mark for this gang and is
    /// suspended (or is known to have just been made so).
    pub suspended: bool,
    /// Some such object carries muster's mark for this gang: muster suspended it, and
    /// muster resumes it.
    pub marked: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeHealth {
    Ready,
    /// Cordoned: running pods keep running, nothing new should go there.
    Unschedulable,
    Gone,
}

/// Everything observed about one gang.
#[derive(Clone, Debug)]
pub struct Gang<'a> {
    pub spec: &'a Spec,
    /// `status.placement`; `None` while the gang is queued (or never placed).
    pub journal: Option<&'a Journal>,
    /// `status.restarts`: the attempt muster's pods of the current attempt carry.
    pub restarts: i32,
    /// Of those, the restarts that count against `maxRestarts`.
    pub counted_restarts: i32,
    /// When the gang succeeded or failed for good, if it did.
    pub finished_at: Option<Millis>,
    pub pods: &'a [PodView],
    pub claims: &'a [ClaimView],
    /// Health of the nodes the journal names; a node not listed is gone.
    pub nodes: &'a BTreeMap<String, NodeHealth>,
    /// Every device the gang's claims hold is still published by its driver and carries
    /// no `NoExecute` taint its allocation does not tolerate.
    pub devices_published: bool,
    /// Why the planned pods could not go back onto their nodes now, as kube-scheduler
    /// would filter them there (resources, pod affinity and spread, host ports, volumes):
    /// asked only of a gang restarting onto its reservation once it may go. Empty: they
    /// could; `None`: not known yet (the attempt's pods still show somewhere), wait.
    pub reuse_problems: Option<&'a [String]>,
    /// The gang's claims that hold a device some other claim holds too: an allocation
    /// written after the commit's conflict check (kube-scheduler decides in memory and
    /// writes later).
    pub conflicted: &'a [String],
    /// `status.schedulerRefusals`: refusals the gang remembers.
    pub refusals: &'a [Refusal],
    /// The objects that make the gang's pods, where muster can suspend them.
    pub owners: Owners,
    pub now: Millis,
}

impl Gang<'_> {
    pub fn node(&self, name: &str) -> NodeHealth {
        self.nodes.get(name).copied().unwrap_or(NodeHealth::Gone)
    }

    pub fn claim(&self, name: &str) -> Option<&ClaimView> {
        self.claims.iter().find(|c| c.name == name)
    }

    pub fn pod(&self, name: &str) -> Option<&PodView> {
        self.pods.iter().find(|p| p.name == name)
    }

    /// The pods of the current attempt: muster's with the current attempt label, other
    /// controllers' that are not retired.
    pub fn current_pods(&self) -> impl Iterator<Item = &PodView> {
        let retired: &[String] = self.journal.map_or(&[], |j| &j.retired);
        self.pods.iter().filter(move |p| match p.attempt {
            Some(a) => a == self.restarts,
            None => !retired.contains(&p.uid),
        })
    }

    /// The current attempt's pod of this name, unless it is being deleted.
    pub fn current_pod(&self, name: &str) -> Option<&PodView> {
        self.current_pods().find(|p| p.name == name && !p.deleting)
    }
}

/// kube-scheduler's word on a released pod it has not bound: its `PodScheduled=False`
/// condition.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Unscheduled {
    pub reason: String,
    pub message: String,
    /// kube-scheduler nominated a node for the pod (`status.nominatedNodeName`): it is
    /// preempting for it.
    pub nominated: bool,
    /// When the operator first saw the pod in this state (its process's memory: after a
    /// restart the wait starts again), if it knows.
    pub since: Option<Millis>,
}

/// A pod refused on the node it was planned on, as remembered in the status (see
/// [`crate::refusal`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The pod's group (`None`: the pod carried none, and only it keeps off the node).
    pub group: Option<String>,
    pub pod: String,
    pub node: String,
    pub message: String,
    /// When muster acted on it.
    pub at: Millis,
}
