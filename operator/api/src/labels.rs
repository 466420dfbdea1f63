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
