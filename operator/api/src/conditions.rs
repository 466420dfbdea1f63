//! Status condition types and reasons, and event reasons (all PascalCase).
//!
//! The Workload controller owns `Created` and `PodsReady`; the admission loop owns
//! `Admitted`. Each writes only its own conditions (server-side apply, conditions keyed
//! by type), so neither overwrites the other.

/// Condition: every pod and claim of the gang exists.
pub const CREATED: &str = "Created";
/// Condition: the gang's devices are reserved and its pods released.
pub const ADMITTED: &str = "Admitted";
/// Condition: at least minCount pods of every group are ready.
pub const PODS_READY: &str = "PodsReady";
/// Condition: the gang is being restarted as a unit after a failure.
pub const RESTARTING: &str = "Restarting";
/// Condition: the gang succeeded.
pub const SUCCEEDED: &str = "Succeeded";
/// Condition: the gang failed for good.
pub const FAILED: &str = "Failed";
/// Condition of a Workload with template-less groups: pods labelled for a group were
/// refused as members (not the group's controller, a second pod of an index, a bare pod).
pub const PODS_REFUSED: &str = "PodsRefused";

// Created
/// Everything exists; the pods wait behind the gang gate for admission.
pub const REASON_ALL_CREATED: &str = "AllCreated";
/// muster is still creating the gang's pods and claims.
pub const REASON_CREATING: &str = "Creating";
/// The Workload cannot be turned into pods (for example a claim name used twice).
pub const REASON_INVALID_SPEC: &str = "InvalidSpec";
/// A ResourceClaimTemplate the gang refers to does not exist (yet).
pub const REASON_TEMPLATE_NOT_FOUND: &str = "ResourceClaimTemplateNotFound";
/// An extended resource the gang asks for is mapped by more than one DeviceClass.
pub const REASON_EXTENDED_RESOURCE_AMBIGUOUS: &str = "ExtendedResourceAmbiguous";
/// An object muster would create exists and belongs to someone else.
pub const REASON_NAME_CONFLICT: &str = "NameConflict";
/// A template-less group has fewer than minCount pods from its controller, or their
/// claims do not exist yet.
pub const REASON_WAITING_FOR_PODS: &str = "WaitingForPods";
/// A ResourceClaim the gang names does not exist.
pub const REASON_CLAIM_NOT_FOUND: &str = "ResourceClaimNotFound";
/// `spec.suspend` is true: nothing is created and nothing is held.
pub const REASON_SUSPENDED: &str = "Suspended";
/// The gang queues in Kueue, and Kueue refused the Kueue Workload that asks for its quota.
pub const REASON_KUEUE_REFUSED: &str = "KueueWorkloadRefused";
/// The gang carries Kueue's queue label, but this muster does not integrate with Kueue
/// (the cluster does not serve Kueue, or muster may not read it): it would run uncharged.
pub const REASON_KUEUE_UNAVAILABLE: &str = "KueueUnavailable";

// PodsRefused
/// Some pods labelled for a template-less group are not members; the message counts
/// them and gives the first reason.
pub const REASON_NOT_MEMBERS: &str = "NotMembers";
/// Every pod labelled for a template-less group is a member.
pub const REASON_NONE_REFUSED: &str = "NoneRefused";

// Admitted
/// Waiting for its pods and claims to exist.
pub const REASON_WAITING_FOR_OBJECTS: &str = "WaitingForObjects";
/// Queued: the gang does not fit now; the message says why, with numbers.
pub const REASON_UNSCHEDULABLE: &str = "Unschedulable";
/// Held back: a gang of equal or higher priority has waited past the starvation limit
/// and is admitted first.
pub const REASON_WAITING_BEHIND: &str = "WaitingBehind";
/// Admitted=False: the gang queues in Kueue, which has not admitted it (or evicted it).
pub const REASON_WAITING_FOR_KUEUE: &str = "WaitingForKueue";
/// The plan is recorded and claims are being allocated.
pub const REASON_RESERVING: &str = "Reserving";
/// Every claim is allocated and every pod released to the scheduler.
pub const REASON_ADMITTED: &str = "Admitted";
/// A commit failed part-way and was undone; the gang is queued again.
pub const REASON_ROLLED_BACK: &str = "RolledBack";
/// Another claim took a planned device while the gang was being reserved.
pub const REASON_CONFLICT: &str = "Conflict";
/// Released pods were not all scheduled in time; the gang was torn down and queued.
pub const REASON_SCHEDULE_TIMEOUT: &str = "ScheduleTimeout";
/// kube-scheduler refused a released pod on its planned node; the gang was taken apart
/// and queued, and its next plans keep the pod's group off that node for a while.
pub const REASON_SCHEDULER_REFUSED: &str = "SchedulerRefused";
/// Reserved, but the planned pods did not all appear in time; the reservation was given
/// back and the gang queued again.
pub const REASON_RELEASE_TIMEOUT: &str = "ReleaseTimeout";
/// The gang's request is invalid for the cluster (unknown DeviceClass, CEL error...).
pub const REASON_INVALID_REQUEST: &str = "InvalidRequest";
/// The Workload's `priorityClassName` is worth more than one of its pods' priority.
pub const REASON_PRIORITY_ABOVE_PODS: &str = "PriorityAbovePods";

// Restarting, Succeeded, Failed
/// A pod of the gang failed.
pub const REASON_POD_FAILED: &str = "PodFailed";
/// A pod of the gang disappeared or was replaced.
pub const REASON_POD_LOST: &str = "PodLost";
/// The node of a pod of the gang is gone.
pub const REASON_NODE_LOST: &str = "NodeLost";
/// The gang failed more often than `failurePolicy.maxRestarts` allows.
pub const REASON_MAX_RESTARTS: &str = "MaxRestartsExceeded";
/// A rule of `failurePolicy.rules` with action `FailGang` matched the failed pod.
pub const REASON_FAILED_BY_RULE: &str = "FailedByRule";
/// Every pod of the success groups succeeded.
pub const REASON_SUCCEEDED: &str = "SucceededPodGroups";
/// A restart finished: the new attempt runs.
pub const REASON_RESTARTED: &str = "Restarted";

// PodsReady
pub const REASON_PODS_READY: &str = "PodsReady";
pub const REASON_PODS_NOT_READY: &str = "PodsNotReady";

// Events
/// Objects of the gang were created.
pub const EVENT_CREATED: &str = "Created";
/// Creating an object of the gang failed.
pub const EVENT_CREATE_FAILED: &str = "CreateFailed";
/// The gang was admitted.
pub const EVENT_ADMITTED: &str = "Admitted";
/// A commit was rolled back.
pub const EVENT_ROLLED_BACK: &str = "RolledBack";
/// A gang was torn down because its pods were not scheduled in time.
pub const EVENT_SCHEDULE_TIMEOUT: &str = "ScheduleTimeout";
/// A gang was taken apart because kube-scheduler refused one of its released pods.
pub const EVENT_SCHEDULER_REFUSED: &str = "SchedulerRefused";
/// The gang is restarted as a unit.
pub const EVENT_RESTARTING: &str = "Restarting";
/// The gang succeeded.
pub const EVENT_SUCCEEDED: &str = "Succeeded";
/// The gang failed.
pub const EVENT_FAILED: &str = "Failed";
/// A finished Workload was deleted after its TTL.
pub const EVENT_EXPIRED: &str = "Expired";
/// The gang does not fit (reported when the reason changes).
pub const EVENT_UNSCHEDULABLE: &str = "Unschedulable";
/// Event: the gang was evicted whole for a gang of higher priority (the note names it);
/// also the `Admitted` reason it reports while queued again.
pub const EVENT_PREEMPTED: &str = "Preempted";
/// Event: muster suspended the Job, JobSet or TrainJob that makes the gang's pods, to
/// requeue the gang without a failure counted against the job.
pub const EVENT_JOB_SUSPENDED: &str = "JobSuspended";
/// Event: muster resumed the job it suspended; its pods wait behind the gate.
pub const EVENT_JOB_RESUMED: &str = "JobResumed";
/// Event: a claim muster allocated for the gang had lost its `muster.dev/workload` label;
/// muster put it back, since the gang's caches find its claims by it.
pub const EVENT_CLAIM_RELABELLED: &str = "ClaimRelabelled";
pub const REASON_PREEMPTED: &str = "Preempted";
/// Event: the gang evicts gangs of lower priority and holds their devices meanwhile.
pub const EVENT_NOMINATED: &str = "Nominated";
/// Event on a pod labelled for a gang that is not one of its members; the note says why.
pub const EVENT_NOT_A_MEMBER: &str = "NotAGangMember";
/// Event: the queue label changed while Kueue held quota for the gang; it stays charged
/// in the LocalQueue it was admitted from.
pub const EVENT_QUEUE_CHANGE_IGNORED: &str = "QueueChangeIgnored";
/// Event: the pods of a template-less group changed since Kueue's Workload charged them;
/// it is made again.
pub const EVENT_KUEUE_WORKLOAD_REBUILT: &str = "KueueWorkloadRebuilt";
