//! The account of which devices allocations hold: kept once for the allocations the
//! cluster shows ([`crate::cluster::ClusterState`]) and once for those of a plan being
//! built ([`crate::allocator::WorkingSet`]), so both count alike.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use crate::claim::{DeviceId, DeviceResult};
use crate::quantity::Quantity;

/// Whether an allocation result holds its device: admin access only looks at it.
pub(crate) fn holds_device(result: &DeviceResult) -> bool {
    result.admin_access != Some(true)
}

/// Devices held by a set of allocation results. A result with a share ID holds a share
/// of a device that allows several, and the capacity it consumes; any other result
/// (admin access aside) holds its device exclusively.
#[derive(Clone, Debug, Default)]
pub(crate) struct DeviceLedger {
    /// Results holding each device exclusively.
    dedicated: DeviceCounts,
    /// Shared results per device, with or without consumed capacity.
    shared: FxHashMap<DeviceId, u32>,
    /// Capacity consumed by the shared results of each device. Its keys are always those
    /// of `shared`: the entry goes with the device's last share.
    consumed: FxHashMap<DeviceId, BTreeMap<String, Quantity>>,
}

impl DeviceLedger {
    pub(crate) fn hold(&mut self, result: &DeviceResult) {
        if !holds_device(result) {
            return;
        }
        let id = result.device_id();
        if result.share_id.is_none() {
            self.dedicated.increment(&id);
            return;
        }
        *self.shared.entry(id.clone()).or_default() += 1;
        let consumed = self.consumed.entry(id).or_default();
        for (name, value) in &result.consumed_capacity {
            let total = consumed.entry(name.clone()).or_insert(Quantity::ZERO);
            *total = total.checked_add(value).unwrap_or(*total);
        }
    }

    /// Gives back what [`DeviceLedger::hold`] took for `result`. Releasing what is not
    /// held changes nothing.
    pub(crate) fn release(&mut self, result: &DeviceResult) {
        if !holds_device(result) {
            return;
        }
        let id = result.device_id();
        if result.share_id.is_none() {
            self.dedicated.decrement(&id);
            return;
        }
        let Some(count) = self.shared.get_mut(&id) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            self.shared.remove(&id);
            self.consumed.remove(&id);
            return;
        }
        if let Some(consumed) = self.consumed.get_mut(&id) {
            for (name, value) in &result.consumed_capacity {
                if let Some(total) = consumed.get_mut(name) {
                    *total = total.checked_sub(value).unwrap_or(*total);
                }
            }
        }
    }

    /// How many results hold a device exclusively: more than one is a double allocation,
    /// which the API server does not prevent. By names, so a lookup allocates nothing.
    pub(crate) fn exclusive_holders(&self, driver: &str, pool: &str, device: &str) -> u32 {
        self.dedicated.get(driver, pool, device)
    }

    pub(crate) fn held_exclusively(&self, id: &DeviceId) -> bool {
        self.exclusive_holders(&id.driver, &id.pool, &id.device) > 0
    }

    /// Shared results hold the device.
    pub(crate) fn shared(&self, id: &DeviceId) -> bool {
        self.shared.contains_key(id)
    }

    /// Held in any way: exclusively or shared.
    pub(crate) fn in_any_use(&self, id: &DeviceId) -> bool {
        self.held_exclusively(id) || self.shared(id)
    }

    /// Capacity the shared results of a device consume.
    pub(crate) fn consumed_capacity(&self, id: &DeviceId) -> Option<&BTreeMap<String, Quantity>> {
        self.consumed.get(id)
    }

    /// Number of devices held exclusively.
    pub(crate) fn exclusive_device_count(&self) -> usize {
        self.dedicated.len()
    }
}

/// Counts per device, looked up by borrowed names (no allocation on the hot path).
#[derive(Debug, Default, Clone)]
struct DeviceCounts(FxHashMap<String, FxHashMap<String, FxHashMap<String, u32>>>);

impl DeviceCounts {
    fn get(&self, driver: &str, pool: &str, device: &str) -> u32 {
        self.0
            .get(driver)
            .and_then(|p| p.get(pool))
            .and_then(|d| d.get(device))
            .copied()
            .unwrap_or(0)
    }

    fn increment(&mut self, id: &DeviceId) {
        let devices = self
            .0
            .entry(id.driver.clone())
            .or_default()
            .entry(id.pool.clone())
            .or_default();
        *devices.entry(id.device.clone()).or_default() += 1;
    }

    fn decrement(&mut self, id: &DeviceId) {
        let Some(pools) = self.0.get_mut(&id.driver) else {
            return;
        };
        let Some(devices) = pools.get_mut(&id.pool) else { return };
        if let Some(count) = devices.get_mut(&id.device) {
            *count -= 1;
            if *count == 0 {
                devices.remove(&id.device);
            }
        }
    }

    fn len(&self) -> usize {
        self.0.values().flat_map(|p| p.values()).map(FxHashMap::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(share: Option<&str>, memory: &str) -> DeviceResult {
        DeviceResult {
            request: "r".into(),
            driver: "d".into(),
            pool: "p".into(),
            device: "g0".into(),
            admin_access: None,
            tolerations: vec![],
            binding_conditions: vec![],
            binding_failure_conditions: vec![],
            share_id: share.map(Into::into),
            consumed_capacity: [("memory".to_string(), Quantity::parse(memory).unwrap())].into(),
        }
    }

    fn memory(ledger: &DeviceLedger) -> Option<Quantity> {
        let id = result(None, "0").device_id();
        ledger.consumed_capacity(&id).map(|c| c["memory"])
    }

    #[test]
    fn releasing_a_share_gives_back_its_capacity_and_the_last_share_frees_the_device() {
        let id = result(None, "0").device_id();
        let mut ledger = DeviceLedger::default();
        ledger.hold(&result(Some("a"), "10Gi"));
        ledger.hold(&result(Some("b"), "5Gi"));
        assert_eq!(memory(&ledger), Some(Quantity::parse("15Gi").unwrap()));

        ledger.release(&result(Some("a"), "10Gi"));
        assert!(ledger.shared(&id) && !ledger.held_exclusively(&id));
        assert_eq!(memory(&ledger), Some(Quantity::parse("5Gi").unwrap()));

        ledger.release(&result(Some("b"), "5Gi"));
        assert!(!ledger.in_any_use(&id));
        assert_eq!(memory(&ledger), None, "no consumed capacity outlives the last share");

        // A release of what is not held is no underflow, and leaves nothing behind.
        ledger.release(&result(Some("b"), "5Gi"));
        assert!(!ledger.in_any_use(&id) && memory(&ledger).is_none());
        ledger.hold(&result(Some("c"), "3Gi"));
        assert_eq!(memory(&ledger), Some(Quantity::parse("3Gi").unwrap()));
    }

    #[test]
    fn exclusive_holders_are_counted_and_admin_access_holds_nothing() {
        let id = result(None, "0").device_id();
        let mut ledger = DeviceLedger::default();
        ledger.hold(&result(None, "0"));
        ledger.hold(&result(None, "0"));
        assert_eq!(ledger.exclusive_holders("d", "p", "g0"), 2);
        assert_eq!(ledger.exclusive_device_count(), 1);
        ledger.release(&result(None, "0"));
        assert!(ledger.held_exclusively(&id));
        ledger.release(&result(None, "0"));
        ledger.release(&result(None, "0"));
        assert!(!ledger.in_any_use(&id));
        assert_eq!(ledger.exclusive_device_count(), 0);

        let mut admin = result(None, "0");
        admin.admin_access = Some(true);
        ledger.hold(&admin);
        assert!(!ledger.in_any_use(&id));
    }
}
