//! The device a selector is evaluated against: its driver, attributes and capacities, as
//! published in a ResourceSlice (`resource.k8s.io/v1` `Device`).

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

/// Attributes keyed by the name as published: `domain/id`, or a bare `id` that belongs
/// to the driver's own domain.
pub type Attributes = NameMap<AttributeValue>;

/// Splits a qualified name into (domain, id); a bare id belongs to `driver`.
pub fn qualify<'a>(name: &'a str, driver: &'a str) -> (&'a str, &'a str) {
    match name.split_once('/') {
        Some((domain, id)) => (domain, id),
        None => (driver, name),
    }
}

/// A device's capacities keyed like [`Attributes`], however their owner stores what else
/// it knows about them (a placement engine also keeps request policies).
pub trait CapacityTable {
    /// The capacity published under `name`, exactly as keyed.
    fn quantity(&self, name: &str) -> Option<&Quantity>;
    /// Every published name.
    fn names(&self) -> Box<dyn Iterator<Item = &str> + '_>;
}

impl<C: AsRef<Quantity>> CapacityTable for NameMap<C> {
    fn quantity(&self, name: &str) -> Option<&Quantity> {
        self.get(name).map(AsRef::as_ref)
    }

    fn names(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        Box::new(self.keys().map(String::as_str))
    }
}

/// The device a selector is evaluated against.
#[derive(Clone, Copy)]
pub struct DeviceView<'a> {
    pub driver: &'a str,
    pub attributes: &'a Attributes,
    pub capacity: &'a dyn CapacityTable,
    pub allow_multiple_allocations: bool,
}

impl std::fmt::Debug for DeviceView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceView")
            .field("driver", &self.driver)
            .field("attributes", &self.attributes)
            .field("capacity", &self.capacity.names().collect::<Vec<_>>())
            .field("allow_multiple_allocations", &self.allow_multiple_allocations)
            .finish()
    }
}
