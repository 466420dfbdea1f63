//! Whether a device a gang's claim holds is held by another claim as well: the API
//! server does not stop two writers giving one device away twice, so the commit checks
//! after writing, and a placed gang keeps checking while it holds its devices.
//!
//! A device held exclusively may have no other holder, exclusive or shared; a device
//! shared (a result with a share ID, consumable capacity) may have no exclusive holder,
//! and the shares together may not consume more of a capacity than the device has.
//! Nominations hold devices in the engine's state for a preemptor; they are plans, not
//! allocations, and never make a conflict.

use muster_api::labels;
use muster_engine::claim::{DeviceId, TaintEffect};
use muster_engine::cluster::{ClusterState, DeviceReach};
use muster_engine::key::{ClaimKey, ObjectKey, PodKey};
use muster_engine::selector::NodeTaintEffect;

use super::fencing::Fencing;

/// The name under which a nomination holds `claim`'s devices for `preemptor` in the
/// engine's state. It is no claim's name (`@` cannot be in one), so a nomination never
/// makes a claim look allocated, and its hold is told apart from real allocations.
pub(crate) fn nomination_hold(namespace: &str, claim: &str, preemptor: &ObjectKey) -> ClaimKey {
    ClaimKey::from(ObjectKey::new(namespace, &format!("{claim}@{}", preemptor.as_str())))
}

/// The name under which a nomination holds the node resources of `pod` for
/// `preemptor`: no pod's (`@` cannot be in one), so the preemptor's own plan, which
/// enters its pods under their names, and the nomination beside it never overwrite or
/// remove each other's.
pub(crate) fn nomination_pod_hold(namespace: &str, pod: &str, preemptor: &ObjectKey) -> PodKey {
    PodKey::from(ObjectKey::new(namespace, &format!("{pod}@{}", preemptor.as_str())))
}

/// A device a hold takes for request `request`, exclusively, as the engine holds it.
pub(crate) fn held_device(request: &str, driver: &str, pool: &str, device: &str) -> muster_engine::claim::DeviceResult {
    muster_engine::claim::DeviceResult {
        request: request.to_string(),
        driver: driver.to_string(),
        pool: pool.to_string(),
        device: device.to_string(),
        admin_access: None,
        tolerations: Vec::new(),
        binding_conditions: Vec::new(),
        binding_failure_conditions: Vec::new(),
        share_id: None,
        consumed_capacity: Default::default(),
    }
}

/// Whether `claim` (`namespace/name`) is a nomination's hold.
pub(crate) fn is_nomination_hold(claim: &str) -> bool {
    claim.contains('@')
}

/// The claim (`namespace/name`) a nomination's hold stands for, if `hold` is one.
pub(crate) fn nominated_claim(hold: &str) -> Option<&str> {
    hold.split_once('@').map(|(claim, _)| claim)
}

/// The device of an allocation result as the API shows it.
pub(crate) fn result_device(result: &k8s_openapi::api::resource::v1::DeviceRequestAllocationResult) -> DeviceId {
    DeviceId {
        driver: result.driver.clone(),
        pool: result.pool.clone(),
        device: result.device.clone(),
    }
}

/// Claims that hold `id` exclusively, nominations' holds left out.
fn exclusive_holders(cluster: &ClusterState, id: &DeviceId) -> u32 {
    let all = cluster.exclusive_holders(&id.driver, &id.pool, &id.device);
    if all == 0 {
        return 0;
    }
    // Names are a scan of every claim: only where a hold could be a nomination's.
    let nominated = cluster
        .exclusive_holder_names(id)
        .into_iter()
        .filter(|name| is_nomination_hold(name))
        .count() as u32;
    all - nominated.min(all)
}

/// Whether the shares of a device together consume more of one of its capacities than
/// the device has (in the newest generation of its pool).
fn over_capacity(cluster: &ClusterState, id: &DeviceId) -> bool {
    let Some(consumed) = cluster.consumed_capacity(id) else {
        return false;
    };
    let slices: Vec<_> = cluster
        .slices()
        .filter(|s| s.driver == id.driver && s.pool == id.pool)
        .collect();
    let newest = slices.iter().map(|s| s.generation).max();
    let Some(device) = slices
        .into_iter()
        .filter(|s| Some(s.generation) == newest)
        .flat_map(|s| &s.devices)
        .find(|d| d.name == id.device)
    else {
        return false;
    };
    consumed
        .iter()
        .any(|(name, total)| device.capacity.get(name).is_some_and(|c| *total > c.value))
}

/// Whether the device of a claim's result is held against the rules: `shared` says
/// whether the result is a share (it has a share ID); the claim itself is counted in
/// the cluster's state.
pub(crate) fn doubly_held(cluster: &ClusterState, id: &DeviceId, shared: bool) -> bool {
    if shared {
        exclusive_holders(cluster, id) > 0 || over_capacity(cluster, id)
    } else {
        exclusive_holders(cluster, id) > 1 || cluster.device_shared(id)
    }
}

/// Whether the fence keeps every other allocator off `id`, so that no claim outside
/// muster can be given the device while muster's own commits are planned one after the
/// other: with the node fence, the device is local to a node that carries the fence
/// taint (only pods that tolerate it land there, and a claim of a pod is allocated where
/// it lands); with the device fence, the device carries the fence taint. A pod that
/// tolerates every taint still gets through: the placed gang's standing conflict check
/// catches that (see [`doubly_held`]).
pub(crate) fn fenced(cluster: &ClusterState, fencing: Fencing, id: &DeviceId) -> bool {
    let keeps_off = |key: &str, schedule: bool| key == labels::FENCE_TAINT && schedule;
    match fencing {
        Fencing::Taint => match cluster.device_reach(&id.driver, &id.pool, &id.device) {
            Some(DeviceReach::Node(node)) => cluster.node(node).is_some_and(|n| {
                n.taints.iter().any(|t| {
                    keeps_off(
                        &t.key,
                        matches!(t.effect, NodeTaintEffect::NoSchedule | NodeTaintEffect::NoExecute),
                    )
                })
            }),
            _ => false,
        },
        Fencing::DeviceTaint => cluster.device_taints(&id.driver, &id.pool, &id.device).iter().any(|t| {
            keeps_off(
                &t.key,
                matches!(t.effect, TaintEffect::NoSchedule | TaintEffect::NoExecute),
            )
        }),
        Fencing::None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_engine::claim::DeviceResult;
    use muster_engine::cluster::{AssumedClaim, PlanId};
    use muster_engine::device::Capacity;
    use muster_engine::fixtures;
    use muster_engine::quantity::Quantity;

    fn result(device: &str, share: Option<&str>, bandwidth: Option<i64>) -> DeviceResult {
        let mut result = fixtures::device_result("r", "node-0", device);
        result.share_id = share.map(str::to_string);
        if let Some(b) = bandwidth {
            result.consumed_capacity = [("bandwidth".to_string(), quantity(b))].into();
        }
        result
    }

    fn quantity(value: i64) -> Quantity {
        Quantity::parse(&value.to_string()).expect("quantity")
    }

    fn id(device: &str) -> DeviceId {
        result(device, None, None).device_id()
    }

    /// One node whose `gpu-0` allows several allocations and has 100 of bandwidth.
    fn cluster() -> ClusterState {
        let mut cluster = ClusterState::new();
        cluster.upsert_node(fixtures::node("node-0", 64, 512, &[]));
        let mut shared = fixtures::gpu(0, "H100");
        shared.allow_multiple_allocations = true;
        shared
            .capacity
            .insert("bandwidth".to_string(), Capacity::new(quantity(100)));
        cluster.upsert_slice(fixtures::node_slice("node-0", vec![shared, fixtures::gpu(1, "H100")]));
        cluster
    }

    fn hold(cluster: &mut ClusterState, claim: &str, results: Vec<DeviceResult>) {
        cluster.set_claim_allocation(&ClaimKey::from(ObjectKey::new("ns", claim)), Some(results));
    }

    #[test]
    fn shares_beyond_a_devices_capacity_are_a_conflict() {
        let mut cluster = cluster();
        hold(&mut cluster, "a", vec![result("gpu-0", Some("s1"), Some(60))]);
        assert!(!doubly_held(&cluster, &id("gpu-0"), true));
        hold(&mut cluster, "b", vec![result("gpu-0", Some("s2"), Some(40))]);
        assert!(!doubly_held(&cluster, &id("gpu-0"), true), "exactly full");
        hold(&mut cluster, "c", vec![result("gpu-0", Some("s3"), Some(10))]);
        assert!(
            doubly_held(&cluster, &id("gpu-0"), true),
            "over-committed by another allocator"
        );
    }

    #[test]
    fn a_share_and_an_exclusive_hold_of_one_device_are_a_conflict() {
        let mut cluster = cluster();
        hold(&mut cluster, "a", vec![result("gpu-0", Some("s1"), Some(10))]);
        hold(&mut cluster, "b", vec![result("gpu-0", None, None)]);
        assert!(doubly_held(&cluster, &id("gpu-0"), true));
        assert!(doubly_held(&cluster, &id("gpu-0"), false));
    }

    #[test]
    fn a_nominations_hold_is_no_conflict() {
        let mut cluster = cluster();
        hold(&mut cluster, "mine", vec![result("gpu-1", None, None)]);
        assert!(!doubly_held(&cluster, &id("gpu-1"), false));
        let preemptor = ObjectKey::new("ns", "high");
        cluster.assume(
            &PlanId::Nomination(preemptor.clone()),
            &[],
            &[AssumedClaim {
                claim: nomination_hold("ns", "high-0-gpu", &preemptor),
                devices: vec![result("gpu-1", None, None)],
            }],
        );
        assert!(!doubly_held(&cluster, &id("gpu-1"), false));
        assert!(
            !cluster.claim_allocated(&ClaimKey::from(ObjectKey::new("ns", "high-0-gpu"))),
            "the nominated claim itself does not look allocated"
        );
        hold(&mut cluster, "other", vec![result("gpu-1", None, None)]);
        assert!(doubly_held(&cluster, &id("gpu-1"), false));
    }

    #[test]
    fn a_device_is_fenced_only_where_the_fence_taint_keeps_others_off() {
        let mut cluster = cluster();
        assert!(
            !fenced(&cluster, Fencing::Taint, &id("gpu-1")),
            "the node carries no fence"
        );
        let mut node = fixtures::node("node-0", 64, 512, &[]);
        node.taints.push(muster_engine::selector::Taint {
            key: labels::FENCE_TAINT.into(),
            value: "true".into(),
            effect: NodeTaintEffect::NoSchedule,
        });
        cluster.upsert_node(node);
        assert!(fenced(&cluster, Fencing::Taint, &id("gpu-1")));
        assert!(!fenced(&cluster, Fencing::Taint, &id("gpu-9")), "no slice publishes it");
        assert!(!fenced(&cluster, Fencing::None, &id("gpu-1")));
        assert!(
            !fenced(&cluster, Fencing::DeviceTaint, &id("gpu-1")),
            "a node taint is no device taint"
        );
    }
}
