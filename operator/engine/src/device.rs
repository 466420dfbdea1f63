//! What a DRA device says about itself: attributes and capacities, as published in a
//! ResourceSlice (`resource.k8s.io/v1` `Device`).

use crate::name_map::NameMap;
use crate::quantity::Quantity;

pub use muster_cel::device::{AttributeValue, Attributes, qualify};

/// How much of a capacity one allocation may consume (`CapacityRequestPolicy`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestPolicy {
    /// Consumed when a request does not ask for this capacity.
    pub default: Option<Quantity>,
    /// Allowed amounts, sorted ascending; a request is rounded up to the next one.
    pub valid_values: Vec<Quantity>,
    /// Allowed range: at least `min`, at most `max`, in whole `step`s above `min`.
    pub valid_range: Option<ValidRange>,
}

/// `CapacityRequestPolicyRange`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidRange {
    pub min: Quantity,
    pub max: Option<Quantity>,
    pub step: Option<Quantity>,
}

/// One capacity of a device (`DeviceCapacity`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub value: Quantity,
    /// Boxed: most devices publish none, and a capacity is held per device.
    pub request_policy: Option<Box<RequestPolicy>>,
}

impl AsRef<Quantity> for Capacity {
    fn as_ref(&self) -> &Quantity {
        &self.value
    }
}

impl Capacity {
    pub fn new(value: Quantity) -> Self {
        Capacity {
            value,
            request_policy: None,
        }
    }
}

/// Capacities keyed like [`Attributes`].
pub type Capacities = NameMap<Capacity>;

/// Looks up an attribute by fully qualified name (`domain/id`), also finding a bare id
/// published by a driver whose name is the domain (upstream `lookupAttribute`).
pub fn lookup_attribute<'a>(attributes: &'a Attributes, driver: &str, qualified: &str) -> Option<&'a AttributeValue> {
    if let Some(value) = attributes.get(qualified) {
        return Some(value);
    }
    match qualified.split_once('/') {
        Some((domain, id)) if domain == driver => attributes.get(id),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_names_belong_to_the_driver() {
        assert_eq!(qualify("model", "gpu.example.com"), ("gpu.example.com", "model"));
        assert_eq!(qualify("k8s.io/pcieRoot", "gpu.example.com"), ("k8s.io", "pcieRoot"));
        let attrs = Attributes::from([("model".to_string(), AttributeValue::Int(1))]);
        assert_eq!(
            lookup_attribute(&attrs, "gpu.example.com", "gpu.example.com/model"),
            Some(&AttributeValue::Int(1))
        );
        assert_eq!(
            lookup_attribute(&attrs, "other.example.com", "gpu.example.com/model"),
            None
        );
    }
}
