//! Names muster puts on the objects it creates and recognises on objects it adopts.

/// Scheduling gate that holds a gang's pods until muster has reserved the whole gang.
pub const GANG_GATE: &str = "muster.dev/gang";
/// Label: name of the Workload a pod or claim belongs to.
pub const WORKLOAD: &str = "muster.dev/workload";
/// Label: name of the pod group a pod belongs to.
pub const POD_GROUP: &str = "muster.dev/pod-group";
/// Label: index of a pod within its pod group, from 0.
pub const POD_INDEX: &str = "muster.dev/pod-index";
/// Label: the gang attempt a pod belongs to (how many restarts came before it).
pub const ATTEMPT: &str = "muster.dev/attempt";
/// Label on claims: the claim name the pods use for it (`spec.resourceClaims[].name`).
pub const CLAIM_NAME: &str = "muster.dev/claim";
/// Field manager for every write muster makes.
pub const FIELD_MANAGER: &str = "muster";
/// Field manager of the admission loop (it owns `status.placement` and `Admitted`).
pub const ADMISSION_FIELD_MANAGER: &str = "muster-admission";
/// Finalizer on every claim muster may allocate: muster clears the allocation before the
/// claim goes (kube-controller-manager only deallocates claims it protects itself).
pub const CLAIM_FINALIZER: &str = "muster.dev/allocation";
/// kube-controller-manager's finalizer on claims it deallocates itself: once the last
/// pod in `reservedFor` ends or goes, it clears the allocation in the same write that
/// takes the pod out. muster sets it on the claims of gangs that never restart onto
/// their reservation, and keeps it off the others' (see docs/architecture.md).
pub const DELETE_PROTECTION_FINALIZER: &str = "resource.kubernetes.io/delete-protection";
/// Annotation moved on a claim a gang lets go of, so that an allocation prepared
/// against an older version of the claim (by a deposed leader) cannot land.
pub const CLAIM_RELEASED_AT: &str = "muster.dev/released-at";
/// Annotation moved on a claim a gang found allocated and holds from its commit on (a
/// claim it shares), so that a deallocation prepared against an older version of the
/// claim (by a deposed leader) cannot land.
pub const CLAIM_HELD_AT: &str = "muster.dev/held-at";
/// Annotation moved on a gang's pod still behind the gate when the gang stops
/// releasing it (taken apart, suspended, an extra dropped), so that a release prepared
/// against an older version of the pod (by a deposed leader) cannot land.
pub const POD_RELEASE_FENCED_AT: &str = "muster.dev/release-fenced-at";
/// Node taint that fences devices from pods outside muster; muster's pods tolerate it.
pub const FENCE_TAINT: &str = "muster.dev/fenced";
/// Finalizer on every Workload: muster releases its devices and deletes its objects
/// before the Workload goes, even if the operator was down at the time of the delete.
pub const WORKLOAD_FINALIZER: &str = "muster.dev/cleanup";
/// Annotation on pods and claims: the extended resources (resource, count, DeviceClass,
/// container, device request) muster turned into the pod's `extended-resources` claim,
/// as JSON. It records the choice, so a later change of DeviceClasses does not alter it.
pub const EXTENDED_RESOURCES: &str = "muster.dev/extended-resources";

/// Label on a JobSet, TrainJob (`spec.labels`) or Job: muster runs it as a gang. The only
/// value is `"true"`.
pub const ADOPT: &str = "muster.dev/gang";
/// The value of [`ADOPT`].
pub const ADOPT_VALUE: &str = "true";

// Gang settings on an adopted job object, named after Kueue's per-pod-set annotations.
/// Annotation on the job object: node label key every pod of the gang shares one value of
/// (a Workload's `spec.topology.required`).
pub const REQUIRED_TOPOLOGY: &str = "muster.dev/required-topology";
/// Annotation on the job object: `spec.topology.preferred`.
pub const PREFERRED_TOPOLOGY: &str = "muster.dev/preferred-topology";
/// Annotation on the job object: `spec.topology.preferredLevels`, comma-separated.
pub const PREFERRED_LEVELS: &str = "muster.dev/preferred-levels";
/// Annotation muster does not read: a job's gang takes the priority of its pod templates'
/// `priorityClassName` (which the API server's admission governs), never one the job
/// names for itself. A job that carries it is held, with the field named.
pub const PRIORITY_CLASS: &str = "muster.dev/priority-class";
/// Annotation on the job object: the Kueue LocalQueue the gang queues in; the derived
/// Workload carries it as Kueue's queue label. The job itself never carries Kueue's
/// label (muster's webhook refuses it): Kueue's own job integration would take the job.
pub const QUEUE_NAME: &str = "muster.dev/queue-name";
/// Annotation on a pod template (a Job's, or a JobSet replicated job's): node label key
/// every pod of that group shares one value of (a group's `topology.required`).
pub const PODSET_REQUIRED_TOPOLOGY: &str = "muster.dev/podset-required-topology";
/// Annotation on a pod template: node label key of the group's slices.
pub const PODSET_SLICE_REQUIRED_TOPOLOGY: &str = "muster.dev/podset-slice-required-topology";
/// Annotation on a pod template: pods per slice.
pub const PODSET_SLICE_SIZE: &str = "muster.dev/podset-slice-size";
/// Annotation on a pod template: the group's minCount.
pub const PODSET_MIN_COUNT: &str = "muster.dev/podset-min-count";
/// Annotation on a Workload muster derived from a job object: why the job cannot be a
/// gang, naming the field. While it is set the Workload holds nothing and says why.
pub const INVALID: &str = "muster.dev/invalid";
/// Annotation on a derived Workload: the last `Admitted` change told on its job object as
/// an event (`status/reason`), so that a restarted operator does not tell it again.
pub const REPORTED: &str = "muster.dev/reported";
/// Annotation on a derived Workload: the job's `suspend` as the adoption controller last
/// saw or wrote it, so that it tells a change of the job's suspend from a change of the
/// Workload's (a user suspending the gang), and carries each to the other.
pub const JOB_SUSPEND: &str = "muster.dev/job-suspend";
/// Annotation on a derived Workload: the job change last told on the job object as
/// ignored (an edit after the gang was admitted), so that it is told once.
pub const IGNORED_CHANGE: &str = "muster.dev/ignored-change";
/// Annotation on a derived Workload: how its job ended, as the job's own status says
/// (`Succeeded: <why>` or `Failed: <why>`). The gang ends with it.
pub const JOB_ENDED: &str = "muster.dev/job-ended";
/// Label on a Job, JobSet or TrainJob that muster suspended to requeue a gang of its pods
/// (value `true`): muster watches what it marked, and resumes it once the gang gave
/// every device back.
pub const REQUEUED: &str = "muster.dev/requeued";
/// Annotation beside [`REQUEUED`]: `<uid>/<name>` of the Workload whose gang it is.
pub const REQUEUED_FOR: &str = "muster.dev/requeued-for";
