//! ResourceClaims as the engine sees them: what a claim asks for (`spec.devices`) and
//! what an allocation gives (`status.allocation`), mirroring `resource.k8s.io/v1`.

use std::collections::BTreeMap;

use crate::key::ClaimKey;
use crate::quantity::Quantity;
use crate::selector::NodeSelector;

/// Most devices one claim may be allocated (`AllocationResultsMaxSize`).
pub const MAX_ALLOCATION_RESULTS: usize = 32;

/// `DeviceAllocationMode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AllocationMode {
    #[default]
    ExactCount,
    All,
}

/// Operator of a device toleration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TolerationOperator {
    #[default]
    Equal,
    Exists,
}

/// Effect of a device taint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaintEffect {
    NoSchedule,
    NoExecute,
    /// `None` and effects this engine does not know: never prevent allocation.
    Other,
}

/// A device taint (`DeviceTaint`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DeviceTaint {
    pub key: String,
    pub value: Option<String>,
    pub effect: TaintEffect,
}

/// A device toleration (`DeviceToleration`); copied into allocation results.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceToleration {
    pub key: Option<String>,
    pub operator: TolerationOperator,
    pub value: Option<String>,
    /// `None` tolerates every effect.
    pub effect: Option<TaintEffect>,
    pub toleration_seconds: Option<i64>,
}

impl DeviceToleration {
    /// Whether this toleration tolerates `taint` (upstream `ToleratesTaint`).
    pub fn tolerates(&self, taint: &DeviceTaint) -> bool {
        if self.effect.is_some_and(|effect| effect != taint.effect) {
            return false;
        }
        let key = self.key.as_deref().unwrap_or("");
        if !key.is_empty() && key != taint.key {
            return false;
        }
        match self.operator {
            // An empty key with Exists matches every taint.
            TolerationOperator::Exists => true,
            TolerationOperator::Equal => self.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""),
        }
    }
}

/// What one request (or `firstAvailable` subrequest) asks for.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct DeviceRequestSpec {
    pub name: String,
    pub device_class_name: String,
    /// CEL expressions, all of which must hold.
    pub selectors: Vec<String>,
    pub allocation_mode: AllocationMode,
    /// For ExactCount; defaults to 1.
    pub count: u32,
    pub admin_access: bool,
    pub tolerations: Vec<DeviceToleration>,
    /// Consumable capacity requests (`capacity.requests`).
    pub capacity: BTreeMap<String, Quantity>,
}

/// A request of a claim: `exactly` one spec, or `firstAvailable` alternatives in order.
#[derive(Clone, Debug, PartialEq)]
pub enum DeviceRequest {
    Exactly(DeviceRequestSpec),
    FirstAvailable {
        name: String,
        subrequests: Vec<DeviceRequestSpec>,
    },
}

impl DeviceRequest {
    pub fn name(&self) -> &str {
        match self {
            DeviceRequest::Exactly(spec) => &spec.name,
            DeviceRequest::FirstAvailable { name, .. } => name,
        }
    }
}

/// `DeviceConstraint`: one of matchAttribute and distinctAttribute.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConstraintKind {
    /// All constrained devices have the same value of this fully qualified attribute.
    MatchAttribute(String),
    /// All constrained devices have different values of this attribute.
    DistinctAttribute(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceConstraint {
    /// Request names (`req` or `req/sub`) the constraint applies to; empty: all.
    pub requests: Vec<String>,
    pub kind: ConstraintKind,
}

/// Opaque driver configuration (`OpaqueDeviceConfiguration`); parameters as JSON text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpaqueConfig {
    pub driver: String,
    pub parameters: String,
}

/// `DeviceClaimConfiguration`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimConfig {
    pub requests: Vec<String>,
    pub opaque: OpaqueConfig,
}

/// A claim's `spec.devices`.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct ClaimSpec {
    pub requests: Vec<DeviceRequest>,
    pub constraints: Vec<DeviceConstraint>,
    pub config: Vec<ClaimConfig>,
}

/// A claim to allocate.
#[derive(Clone, Debug, PartialEq)]
pub struct Claim {
    pub key: ClaimKey,
    pub spec: ClaimSpec,
}

/// Identifies a device cluster-wide.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    pub driver: String,
    pub pool: String,
    pub device: String,
}

impl std::fmt::Display for DeviceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.driver, self.pool, self.device)
    }
}

/// One allocated device (`DeviceRequestAllocationResult`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceResult {
    /// `req` or `req/sub`.
    pub request: String,
    pub driver: String,
    pub pool: String,
    pub device: String,
    pub admin_access: Option<bool>,
    pub tolerations: Vec<DeviceToleration>,
    pub binding_conditions: Vec<String>,
    pub binding_failure_conditions: Vec<String>,
    /// Set for devices that allow multiple allocations.
    pub share_id: Option<String>,
    pub consumed_capacity: BTreeMap<String, Quantity>,
}

impl DeviceResult {
    pub fn device_id(&self) -> DeviceId {
        DeviceId {
            driver: self.driver.clone(),
            pool: self.pool.clone(),
            device: self.device.clone(),
        }
    }

    /// Whether the result is for device `id`: `device_id() == *id` without building one.
    pub fn is_for(&self, id: &DeviceId) -> bool {
        self.device == id.device && self.pool == id.pool && self.driver == id.driver
    }
}

/// Where a configuration entry of an allocation comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigSource {
    FromClass,
    FromClaim,
}

/// `DeviceAllocationConfiguration`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocatedConfig {
    pub source: ConfigSource,
    /// Empty: applies to every request.
    pub requests: Vec<String>,
    pub opaque: OpaqueConfig,
}

/// `AllocationResult` (without the timestamp, which the writer adds).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Allocation {
    pub devices: Vec<DeviceResult>,
    pub config: Vec<AllocatedConfig>,
    /// `None`: usable on every node.
    pub node_selector: Option<NodeSelector>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taint(key: &str, value: Option<&str>, effect: TaintEffect) -> DeviceTaint {
        DeviceTaint {
            key: key.into(),
            value: value.map(Into::into),
            effect,
        }
    }

    fn toleration(
        key: Option<&str>,
        operator: TolerationOperator,
        value: Option<&str>,
        effect: Option<TaintEffect>,
    ) -> DeviceToleration {
        DeviceToleration {
            key: key.map(Into::into),
            operator,
            value: value.map(Into::into),
            effect,
            toleration_seconds: None,
        }
    }

    #[test]
    fn toleration_matching_follows_upstream() {
        let t = taint("muster.dev/fenced", Some("true"), TaintEffect::NoSchedule);
        use TolerationOperator::*;
        assert!(toleration(Some("muster.dev/fenced"), Equal, Some("true"), None).tolerates(&t));
        assert!(!toleration(Some("muster.dev/fenced"), Equal, Some("false"), None).tolerates(&t));
        assert!(toleration(Some("muster.dev/fenced"), Exists, None, Some(TaintEffect::NoSchedule)).tolerates(&t));
        assert!(!toleration(Some("muster.dev/fenced"), Exists, None, Some(TaintEffect::NoExecute)).tolerates(&t));
        assert!(
            toleration(None, Exists, None, None).tolerates(&t),
            "empty key + Exists tolerates all"
        );
        assert!(
            toleration(None, Equal, Some("true"), None).tolerates(&t),
            "empty key + Equal compares values only"
        );
        assert!(!toleration(None, Equal, Some("x"), None).tolerates(&t));
        assert!(!toleration(Some("other"), Exists, None, None).tolerates(&t));
    }
}
