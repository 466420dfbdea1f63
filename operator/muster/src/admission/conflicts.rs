//! Whether a device a gang's claim holds is held by another claim as well: the API
//! server does not stop two writers giving one device away twice, so the commit checks
//! after writing, and a placed gang keeps checking while it holds its devices.
//!
//! A device held exclusively may have no other holder, exclusive or shared; a device
//! shared (a result with a share ID, consumable capacity) may have no exclusive holder,
//! and the shares together may not consume more of a capacity than the device has.
//! Nominations hold devices in the engine's state for a preemptor; they are plans, not
//! allocations, and never make a conflict.

use std::collections::BTreeMap;

use muster_api::labels;
use muster_engine::claim::{DeviceId, DeviceResult, TaintEffect};
use muster_engine::cluster::{ClusterState, Device, DeviceReach};
use muster_engine::key::{ClaimKey, ObjectKey, PodKey};
use muster_engine::quantity::Quantity;
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

/// Whether more than `limit` claims hold `id` exclusively, nominations' holds left out.
fn exclusive_holders_exceed(cluster: &ClusterState, id: &DeviceId, limit: u32) -> bool {
    let all = cluster.exclusive_holders(&id.driver, &id.pool, &id.device);
    // Leaving holds out only lowers the count: no more than `limit` in all decides it.
    if all <= limit {
        return false;
    }
    // Names are a scan of every claim: only where the count alone does not decide (a
    // device held against the rules, or held by a nomination as well).
    let nominated = cluster
        .exclusive_holder_names(id)
        .into_iter()
        .filter(|name| is_nomination_hold(name))
        .count() as u32;
    all - nominated.min(all) > limit
}

/// Device `id` as the newest generation of its pool publishes it.
fn published_device<'c>(cluster: &'c ClusterState, id: &DeviceId) -> Option<&'c Device> {
    let slices: Vec<_> = cluster
        .slices()
        .filter(|s| s.driver == id.driver && s.pool == id.pool)
        .collect();
    let newest = slices.iter().map(|s| s.generation).max();
    slices
        .into_iter()
        .filter(|s| Some(s.generation) == newest)
        .flat_map(|s| &s.devices)
        .find(|d| d.name == id.device)
}

/// Whether `consumed` is more of one of device `id`'s capacities than it has.
fn exceeds(cluster: &ClusterState, id: &DeviceId, consumed: &BTreeMap<String, Quantity>) -> bool {
    published_device(cluster, id).is_some_and(|device| {
        consumed
            .iter()
            .any(|(name, total)| device.capacity.get(name).is_some_and(|c| *total > c.value))
    })
}

/// The results for `id` of the claims (by `namespace/name`) that `counted` names. A scan
/// of every claim.
fn results_for<'c>(
    cluster: &'c ClusterState,
    id: &'c DeviceId,
    counted: impl Fn(&str) -> bool + 'c,
) -> impl Iterator<Item = &'c DeviceResult> + 'c {
    cluster
        .holder_names(id)
        .into_iter()
        .filter(move |name| counted(name))
        .flat_map(move |name| cluster.claim_devices(&ClaimKey::from(name)).unwrap_or_default())
        .filter(move |result| result.is_for(id))
}

/// What the shares of `id` consume together, leaving out those of the claims (by
/// `namespace/name`) `left_out` says, and adding `extra`. A scan of every claim.
fn consumed_without(
    cluster: &ClusterState,
    id: &DeviceId,
    left_out: impl Fn(&str) -> bool,
    extra: &BTreeMap<String, Quantity>,
) -> BTreeMap<String, Quantity> {
    let mut total = extra.clone();
    let shares = results_for(cluster, id, move |name| !left_out(name)).filter(|result| result.share_id.is_some());
    for share in shares {
        for (name, value) in &share.consumed_capacity {
            let sum = total.entry(name.clone()).or_insert(Quantity::ZERO);
            *sum = sum.checked_add(value).unwrap_or(*sum);
        }
    }
    total
}

/// Whether the shares of a device together consume more of one of its capacities than
/// the device has (in the newest generation of its pool). A nomination's share is
/// counted on, not allocated: what it consumes is left out.
fn over_capacity(cluster: &ClusterState, id: &DeviceId) -> bool {
    let Some(consumed) = cluster.consumed_capacity(id) else {
        return false;
    };
    // The scan only once the device looks over capacity with nominations in.
    exceeds(cluster, id, consumed)
        && exceeds(
            cluster,
            id,
            &consumed_without(cluster, id, is_nomination_hold, &BTreeMap::new()),
        )
}

/// Whether a share consuming `share` still fits on device `id` beside the shares of
/// the claims `left_out` does not name.
pub(crate) fn share_fits(
    cluster: &ClusterState,
    id: &DeviceId,
    share: &BTreeMap<String, Quantity>,
    left_out: impl Fn(&str) -> bool,
) -> bool {
    !exceeds(cluster, id, &consumed_without(cluster, id, left_out, share))
}

/// Whether a nomination for another claim than `claim` (`namespace/name`) counts on
/// device `id`, which `claim` holds as it was found (a share of it, if `shared`): a
/// nomination holds it whole, or `claim` holds it whole beside a nomination's share,
/// or the shares with the nominations' are more than the device has. A scan of every
/// claim.
pub(crate) fn nomination_counts_on(cluster: &ClusterState, id: &DeviceId, shared: bool, claim: &str) -> bool {
    let mut nominated = results_for(cluster, id, |name| {
        nominated_claim(name).is_some_and(|nominated| nominated != claim)
    })
    .peekable();
    if nominated.peek().is_none() {
        return false;
    }
    if !shared {
        return true;
    }
    let holds_whole = nominated.any(|result| result.share_id.is_none());
    holds_whole
        || cluster
            .consumed_capacity(id)
            .is_some_and(|consumed| exceeds(cluster, id, consumed))
}

/// Whether a claim (a nomination's hold left out) holds a share of `id`.
fn shared_outside_nominations(cluster: &ClusterState, id: &DeviceId) -> bool {
    // Names are a scan of every claim: only where a share could be a nomination's.
    cluster.device_shared(id)
        && results_for(cluster, id, |name| !is_nomination_hold(name)).any(|result| result.share_id.is_some())
}

/// Whether the device of a claim's result is held against the rules: `shared` says
/// whether the result is a share (it has a share ID); the claim itself is counted in
/// the cluster's state. Nominations' holds, exclusive or shares, are left out: they are
/// what a preemptor counts on, not allocations.
pub(crate) fn doubly_held(cluster: &ClusterState, id: &DeviceId, shared: bool) -> bool {
    if shared {
        exclusive_holders_exceed(cluster, id, 0) || over_capacity(cluster, id)
    } else {
        exclusive_holders_exceed(cluster, id, 1) || shared_outside_nominations(cluster, id)
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

    /// Preemptor `ns/high` nominates `result` for its claim `claim`.
    fn nominate(cluster: &mut ClusterState, claim: &str, result: DeviceResult) {
        let preemptor = ObjectKey::new("ns", "high");
        cluster.assume(
            &PlanId::Nomination(preemptor.clone()),
            &[],
            &[AssumedClaim {
                claim: nomination_hold("ns", claim, &preemptor),
                devices: vec![result],
            }],
        );
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
        nominate(&mut cluster, "high-0-gpu", result("gpu-1", None, None));
        assert!(!doubly_held(&cluster, &id("gpu-1"), false));
        assert!(
            !cluster.claim_allocated(&ClaimKey::from(ObjectKey::new("ns", "high-0-gpu"))),
            "the nominated claim itself does not look allocated"
        );
        hold(&mut cluster, "other", vec![result("gpu-1", None, None)]);
        assert!(doubly_held(&cluster, &id("gpu-1"), false));
    }

    /// A nomination holds a share of a device for its preemptor while the victims still
    /// hold theirs: what it counts on is no allocation, so neither the victims' shares
    /// nor an innocent gang's are over capacity because of it, and an exclusive holder
    /// beside it is not a share beside an exclusive hold.
    #[test]
    fn a_nominations_share_is_no_conflict() {
        let mut cluster = cluster();
        hold(&mut cluster, "victim", vec![result("gpu-0", Some("s1"), Some(60))]);
        hold(&mut cluster, "innocent", vec![result("gpu-0", Some("s2"), Some(30))]);
        nominate(&mut cluster, "high-0-nic", result("gpu-0", Some("s3"), Some(70)));
        assert!(
            !doubly_held(&cluster, &id("gpu-0"), true),
            "160 of 100, but 70 only nominated"
        );
        hold(&mut cluster, "intruder", vec![result("gpu-0", Some("s4"), Some(20))]);
        assert!(doubly_held(&cluster, &id("gpu-0"), true), "110 of 100 allocated");

        let mut cluster = ClusterState::new();
        cluster.upsert_node(fixtures::node("node-0", 64, 512, &[]));
        cluster.upsert_slice(fixtures::node_slice("node-0", vec![fixtures::gpu(1, "H100")]));
        hold(&mut cluster, "mine", vec![result("gpu-1", None, None)]);
        nominate(&mut cluster, "high-0-gpu", result("gpu-1", Some("s5"), None));
        assert!(
            !doubly_held(&cluster, &id("gpu-1"), false),
            "only a nomination shares it"
        );
        hold(&mut cluster, "other", vec![result("gpu-1", Some("s6"), None)]);
        assert!(doubly_held(&cluster, &id("gpu-1"), false), "a claim shares it");
    }

    /// A claim found allocated and held as it is keeps its device from a nomination
    /// that counts on it: one holding the device whole, or a share of it beside a
    /// claim holding it whole, or shares that do not all fit beside the found one.
    #[test]
    fn a_found_claim_sees_a_nomination_counting_on_its_device_whole_or_shared() {
        // A share found beside a nomination's share, room for both.
        let mut cluster = cluster();
        hold(&mut cluster, "found", vec![result("gpu-0", Some("s1"), Some(40))]);
        assert!(
            !nomination_counts_on(&cluster, &id("gpu-0"), true, "ns/found"),
            "no nomination"
        );
        nominate(&mut cluster, "high-0-nic", result("gpu-0", Some("s2"), Some(60)));
        assert!(
            !nomination_counts_on(&cluster, &id("gpu-0"), true, "ns/found"),
            "100 of 100"
        );
        // Not room for both: the nomination counts on the found share going.
        nominate(&mut cluster, "high-0-nic", result("gpu-0", Some("s2"), Some(70)));
        assert!(
            nomination_counts_on(&cluster, &id("gpu-0"), true, "ns/found"),
            "110 of 100"
        );
        // The nomination of the found claim itself counts on nothing it takes away.
        assert!(!nomination_counts_on(&cluster, &id("gpu-0"), true, "ns/high-0-nic"));
        // A device found held whole, nominated as a share.
        let mut whole = self::cluster();
        hold(&mut whole, "found", vec![result("gpu-1", None, None)]);
        nominate(&mut whole, "high-0-nic", result("gpu-1", Some("s3"), None));
        assert!(nomination_counts_on(&whole, &id("gpu-1"), false, "ns/found"));
    }

    #[test]
    fn a_share_fits_beside_the_shares_it_is_not_told_to_leave_out() {
        let mut cluster = cluster();
        hold(&mut cluster, "victim", vec![result("gpu-0", Some("s1"), Some(60))]);
        hold(&mut cluster, "other", vec![result("gpu-0", Some("s2"), Some(30))]);
        let share: BTreeMap<String, Quantity> = [("bandwidth".to_string(), quantity(40))].into();
        assert!(!share_fits(&cluster, &id("gpu-0"), &share, |_| false), "130 of 100");
        assert!(
            share_fits(&cluster, &id("gpu-0"), &share, |name| name == "ns/victim"),
            "70 of 100 once the victim goes"
        );
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
