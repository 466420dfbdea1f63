//! What a DRA device says about itself: attributes and capacities, as published in a
//! ResourceSlice (`resource.k8s.io/v1` `Device`).

use crate::name_map::NameMap;
use crate::quantity::Quantity;

/// A device attribute value (`DeviceAttribute`: exactly one of int, bool, string,
/// version).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AttributeValue {
    Int(i64),
    Bool(bool),
    String(String),
    /// A semantic version string (semver 2.0.0), kept as published. It is parsed where it
    /// is used: CEL turns an unparsable version into a runtime error, as upstream does.
    Version(String),
}

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

impl Capacity {
    pub fn new(value: Quantity) -> Self {
        Capacity {
            value,
            request_policy: None,
        }
    }
}

/// Attributes keyed by the name as published: `domain/id`, or a bare `id` that belongs
/// to the driver's own domain.
pub type Attributes = NameMap<AttributeValue>;
/// Capacities keyed like [`Attributes`].
pub type Capacities = NameMap<Capacity>;

/// Splits a qualified name into (domain, id); a bare id belongs to `driver`.
pub fn qualify<'a>(name: &'a str, driver: &'a str) -> (&'a str, &'a str) {
    match name.split_once('/') {
        Some((domain, id)) => (domain, id),
        None => (driver, name),
    }
}

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
