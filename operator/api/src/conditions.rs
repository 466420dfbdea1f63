//! Status condition types and reasons, and event reasons (all PascalCase).

/// Condition: the gang's devices are reserved and its pods released.
pub const ADMITTED: &str = "Admitted";
/// Condition: the pods of the gang are ready.
pub const PODS_READY: &str = "PodsReady";

/// Reason: pods and claims exist and are held by the gang gate, waiting for admission.
pub const REASON_WAITING_FOR_ADMISSION: &str = "WaitingForAdmission";
/// Reason: muster is still creating the gang's pods and claims.
pub const REASON_CREATING: &str = "Creating";
/// Reason: the Workload cannot be turned into pods (for example a missing template).
pub const REASON_INVALID_SPEC: &str = "InvalidSpec";
/// Reason: the Workload is suspended.
pub const REASON_SUSPENDED: &str = "Suspended";

/// Event reason: objects of the gang were created.
pub const EVENT_CREATED: &str = "Created";
/// Event reason: creating an object of the gang failed.
pub const EVENT_CREATE_FAILED: &str = "CreateFailed";
/// Reason: a ResourceClaimTemplate the gang refers to does not exist (yet).
pub const REASON_TEMPLATE_NOT_FOUND: &str = "ResourceClaimTemplateNotFound";
/// Reason: an object muster would create exists and belongs to someone else.
pub const REASON_NAME_CONFLICT: &str = "NameConflict";
