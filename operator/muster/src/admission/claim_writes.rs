//! The shapes of muster's writes to a claim's status: the allocation together with the
//! reservation for the gang's pods, and the deallocation guarded by content tests
//! instead of a resourceVersion.
//!
//! Why these shapes (see docs/architecture.md, "A claim's writes"):
//! - kube-scheduler's PreBind writes `reservedFor` for every claim of a pod that does not
//!   list the pod yet. Writing the planned pods in the allocation's own write leaves it
//!   nothing to write.
//! - kube-controller-manager rewrites `reservedFor` of an allocated claim while one of its
//!   pods has ended and is still there (it drops the pod, then reserves for it again,
//!   kubernetes#141274). A deallocation conditioned on the resourceVersion loses to every
//!   one of those writes; one that tests the uid, the allocation it judged and the
//!   `reservedFor` it read is applied by the API server to the newest object, fails only
//!   when what it was decided on changed, and is tried again at once.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimConsumerReference};
use kube::ResourceExt;
use serde_json::{Value, json};

use muster_api::labels::{CLAIM_FINALIZER, CLAIM_HELD_AT, DELETE_PROTECTION_FINALIZER};

use crate::workload::membership::generated_claim;

/// At most this many entries fit in `reservedFor` (the API server's limit).
pub const RESERVED_FOR_MAX: usize = 256;

/// The `reservedFor` entries of each claim the pods named in `planned` use: every such
/// pod that exists and is not being deleted, by the claim it names (directly, or the one
/// kube-controller-manager generated from its template). A claim whose consumers would
/// not fit in `reservedFor` gets none here: kube-scheduler reserves it pod by pod and
/// refuses the pods beyond the limit, as it does without muster.
pub fn planned_consumers(
    pods: &[Arc<Pod>],
    planned: &BTreeSet<&str>,
) -> BTreeMap<String, Vec<ResourceClaimConsumerReference>> {
    let mut consumers: BTreeMap<String, Vec<ResourceClaimConsumerReference>> = BTreeMap::new();
    for pod in pods {
        let name = pod.name_any();
        let Some(uid) = pod.uid() else { continue };
        if !planned.contains(name.as_str()) || pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        for claim in claim_names(pod) {
            let list = consumers.entry(claim.to_string()).or_default();
            if !list.iter().any(|c| c.uid == uid) {
                list.push(ResourceClaimConsumerReference {
                    api_group: None,
                    resource: "pods".into(),
                    name: name.clone(),
                    uid: uid.clone(),
                });
            }
        }
    }
    consumers.retain(|_, list| list.len() <= RESERVED_FOR_MAX);
    consumers
}

/// The finalizers a claim must carry, if `current` is not that already: muster's always;
/// kube-controller-manager's delete-protection exactly when `protect`. A claim is
/// committed unprotected, and protected when its gang's pods are released:
/// kube-controller-manager then deallocates it in the very write that drops its last
/// ended pod, instead of dropping and reserving the pod again in a loop; before the
/// release, a gated pod made again would take the allocation with its old entry.
pub fn commit_finalizers(current: &[String], protect: bool) -> Option<Vec<String>> {
    let mut wanted: Vec<String> = current
        .iter()
        .filter(|f| protect || *f != DELETE_PROTECTION_FINALIZER)
        .cloned()
        .collect();
    for finalizer in [CLAIM_FINALIZER, DELETE_PROTECTION_FINALIZER] {
        let needed = finalizer == CLAIM_FINALIZER || protect;
        if needed && !wanted.iter().any(|f| f == finalizer) {
            wanted.push(finalizer.to_string());
        }
    }
    (wanted != current).then_some(wanted)
}

/// The `muster.dev/held-at` fence a gang that holds `claim` as it found it put on it,
/// if one did.
pub fn held_at(claim: &ResourceClaim) -> Option<&String> {
    claim.metadata.annotations.as_ref()?.get(CLAIM_HELD_AT)
}

/// The test that the `muster.dev/held-at` fence is as read: a gang that holds the claim
/// as found, or lets go of it, moves it, so a write a deposed leader prepared before
/// fails. (A path through a map that is not there fails a test: the map itself is
/// tested then.)
fn held_at_test(claim: &ResourceClaim) -> Value {
    match &claim.metadata.annotations {
        None => json!({"op": "test", "path": "/metadata/annotations", "value": null}),
        Some(annotations) => {
            let path = format!(
                "/metadata/annotations/{}",
                CLAIM_HELD_AT.replace('~', "~0").replace('/', "~1")
            );
            json!({"op": "test", "path": path, "value": annotations.get(CLAIM_HELD_AT)})
        }
    }
}

/// The JSON patch that adds `consumers` to the `reservedFor` of `claim` where they are not
/// listed yet: before a claim is given delete-protection at its pods' release, every pod
/// released onto it is listed (a pod made again since the commit is listed under its old
/// uid, whose entry kube-controller-manager takes out, and the allocation with it once
/// protected). The patch tests the uid and the allocation's timestamp as read, so it
/// fails (422) once the claim was deallocated; `None` if the claim as read is not
/// allocated, or lists every consumer already.
pub fn reservation_addition(claim: &ResourceClaim, consumers: &[ResourceClaimConsumerReference]) -> Option<Value> {
    let allocation = claim.status.as_ref()?.allocation.as_ref()?;
    let timestamp = serde_json::to_value(&allocation.allocation_timestamp).ok()?;
    let tests = vec![json!({"op": "test", "path": "/status/allocation/allocationTimestamp", "value": timestamp})];
    addition(claim, consumers, tests)
}

/// Like [`reservation_addition`], for a released pod that kube-scheduler's Unreserve
/// took out of a claim muster allocated: it also tests `reservedFor` as read, so that a
/// cache older than the claim (which may not show an entry already there) never adds a
/// pod twice.
pub fn relisting(claim: &ResourceClaim, consumers: &[ResourceClaimConsumerReference]) -> Option<Value> {
    let status = claim.status.as_ref()?;
    let timestamp = serde_json::to_value(&status.allocation.as_ref()?.allocation_timestamp).ok()?;
    let mut tests = vec![json!({"op": "test", "path": "/status/allocation/allocationTimestamp", "value": timestamp})];
    // An empty list is stored as none: the addition tests that itself.
    if let Some(listed) = status.reserved_for.as_ref().filter(|l| !l.is_empty()) {
        tests.push(json!({"op": "test", "path": "/status/reservedFor", "value": listed}));
    }
    addition(claim, consumers, tests)
}

/// Like [`reservation_addition`], for a claim another allocator made (kube-scheduler,
/// for a pod outside any gang): a gang that holds it lists its pods there from its
/// commit on, so that kube-controller-manager does not deallocate it when the last pod
/// outside the gang ends (it keeps an entry whose pod exists and has not ended). Such an
/// allocation may carry no timestamp, so the patch tests each device the allocation
/// holds as read instead (their driver, pool, device and share: fields every version
/// has), and fails (422) once the claim was deallocated or allocated elsewhere. It tests
/// the `held-at` fence as read too, which a gang letting go of the claim moves: a listing
/// a deposed leader prepared cannot land after its successor let go.
pub fn found_claim_listing(claim: &ResourceClaim, consumers: &[ResourceClaimConsumerReference]) -> Option<Value> {
    let status = claim.status.as_ref()?;
    let allocation = status.allocation.as_ref()?;
    let listed: Vec<&str> = status.reserved_for.iter().flatten().map(|c| c.uid.as_str()).collect();
    let mut adding: Vec<&str> = consumers
        .iter()
        .map(|c| c.uid.as_str())
        .filter(|u| !listed.contains(u))
        .collect();
    adding.sort_unstable();
    adding.dedup();
    // No room: kube-scheduler lists the pods itself and refuses those beyond the limit.
    if listed.len() + adding.len() > RESERVED_FOR_MAX {
        return None;
    }
    let mut tests = vec![held_at_test(claim)];
    tests.extend(device_tests(allocation));
    addition(claim, consumers, tests)
}

/// Tests that the allocation is still the one read: each result's device.
fn device_tests(allocation: &k8s_openapi::api::resource::v1::AllocationResult) -> Vec<Value> {
    let results = allocation.devices.iter().flat_map(|d| d.results.iter().flatten());
    let mut tests = Vec::new();
    for (i, result) in results.enumerate() {
        for (field, value) in [
            ("driver", Some(&result.driver)),
            ("pool", Some(&result.pool)),
            ("device", Some(&result.device)),
            ("shareID", result.share_id.as_ref()),
        ] {
            let path = format!("/status/allocation/devices/results/{i}/{field}");
            tests.push(json!({"op": "test", "path": path, "value": value}));
        }
    }
    tests
}

/// The patch adding `consumers` that `claim` does not list yet, after the uid test and
/// `tests` of its allocation.
fn addition(claim: &ResourceClaim, consumers: &[ResourceClaimConsumerReference], tests: Vec<Value>) -> Option<Value> {
    let status = claim.status.as_ref()?;
    let listed: Vec<&ResourceClaimConsumerReference> = status.reserved_for.iter().flatten().collect();
    let mut missing: Vec<&ResourceClaimConsumerReference> = Vec::new();
    for consumer in consumers {
        if !listed.iter().chain(&missing).any(|c| c.uid == consumer.uid) {
            missing.push(consumer);
        }
    }
    if missing.is_empty() {
        return None;
    }
    let mut operations = Vec::new();
    if let Some(uid) = claim.uid() {
        operations.push(json!({"op": "test", "path": "/metadata/uid", "value": uid}));
    }
    operations.extend(tests);
    if listed.is_empty() {
        operations.push(json!({"op": "test", "path": "/status/reservedFor", "value": null}));
        operations.push(json!({"op": "add", "path": "/status/reservedFor", "value": missing}));
    } else {
        for consumer in missing {
            operations.push(json!({"op": "add", "path": "/status/reservedFor/-", "value": consumer}));
        }
    }
    Some(Value::Array(operations))
}

/// The claims `pod` names: directly, or the one kube-controller-manager generated from
/// its template (once it has).
pub fn claim_names(pod: &Pod) -> impl Iterator<Item = &str> {
    let entries = pod.spec.iter().flat_map(|s| s.resource_claims.iter().flatten());
    entries.filter_map(|entry| match &entry.resource_claim_name {
        Some(claim) => Some(claim.as_str()),
        None => generated_claim(pod, &entry.name),
    })
}

/// The uids of `pods` that name each claim, by claim name.
pub fn claim_users(pods: &[Arc<Pod>]) -> BTreeMap<String, Vec<String>> {
    let mut users: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for pod in pods {
        let Some(uid) = pod.uid() else { continue };
        for claim in claim_names(pod) {
            users.entry(claim.to_string()).or_default().push(uid.clone());
        }
    }
    users
}

/// Whether `pod` names the claim `claim`.
pub fn names_claim(pod: &Pod, claim: &str) -> bool {
    claim_names(pod).any(|c| c == claim)
}

/// The JSON patch that clears `claim`'s allocation and `reservedFor` as read: it tests the
/// object's uid, the allocation's timestamp, `reservedFor` exactly as read and the fence a
/// gang that holds the claim as found moved (`muster.dev/held-at`), so it fails (422) if
/// the claim was made again, allocated again, reserved for anyone else or taken on by
/// another gang meanwhile: a deallocation a deposed leader prepared cannot land after its
/// successor let a gang hold the claim. (The devices are not tested: a field this client
/// does not know would make the test fail for ever.) `None` if the claim as read is not
/// allocated.
pub fn deallocation(claim: &ResourceClaim) -> Option<Value> {
    let status = claim.status.as_ref()?;
    let allocation = status.allocation.as_ref()?;
    let mut operations = Vec::new();
    if let Some(uid) = claim.uid() {
        operations.push(json!({"op": "test", "path": "/metadata/uid", "value": uid}));
    }
    operations.push(held_at_test(claim));
    let timestamp = serde_json::to_value(&allocation.allocation_timestamp).ok()?;
    operations.push(json!({"op": "test", "path": "/status/allocation/allocationTimestamp", "value": timestamp}));
    let reserved = status.reserved_for.as_ref().filter(|r| !r.is_empty());
    let reserved_value = serde_json::to_value(reserved).ok()?;
    operations.push(json!({"op": "test", "path": "/status/reservedFor", "value": reserved_value}));
    operations.push(json!({"op": "remove", "path": "/status/allocation"}));
    if reserved.is_some() {
        operations.push(json!({"op": "remove", "path": "/status/reservedFor"}));
    }
    Some(Value::Array(operations))
}

/// What taking a gang's pods out of a claim another allocator made does.
#[derive(Debug, PartialEq)]
pub struct Removal {
    /// The JSON patch for the claim's status.
    pub patch: Value,
    /// It takes out the last entry of a claim with kube-controller-manager's
    /// delete-protection, and deallocates the claim in the same write, as
    /// kube-controller-manager does when its own cleanup takes the last pod out.
    pub deallocates: bool,
}

/// The patch that takes the entries of `gated` (uids of the gang's pods still behind the
/// gate) out of `reservedFor` of `claim`, a claim another allocator made that the gang
/// lets go of: its hold or a release listed them, and nothing else takes out the entry of
/// a pod that exists and has not ended. Each entry is tested at its index before it goes,
/// so an entry added or removed meanwhile before it fails the patch (422) instead of
/// taking out another. If no entry would be left on a protected claim and the gang is its
/// last holder (`last_holder`), the whole list is tested as read and the allocation goes
/// with it: without the gang's entries, kube-controller-manager would have deallocated
/// it when its last pod went (a claim another gang holds is that gang's to let go of).
/// The patch tests the uid, the `held-at` fence, the finalizers, the allocation's
/// timestamp and its devices as read, so a removal a deposed leader prepared fails once
/// its successor let go of the claim (moving the fence) or muster allocated it afresh.
/// `None` if the claim as read is not allocated, or there is nothing to do.
pub fn gated_removal(claim: &ResourceClaim, gated: &BTreeSet<&str>, last_holder: bool) -> Option<Removal> {
    let status = claim.status.as_ref()?;
    let allocation = status.allocation.as_ref()?;
    let listed: Vec<&ResourceClaimConsumerReference> = status.reserved_for.iter().flatten().collect();
    let going: Vec<usize> = (0..listed.len())
        .filter(|i| gated.contains(listed[*i].uid.as_str()))
        .collect();
    let protected = claim.finalizers().iter().any(|f| f == DELETE_PROTECTION_FINALIZER);
    let deallocates = last_holder && protected && going.len() == listed.len();
    if going.is_empty() && !deallocates {
        return None;
    }
    let mut operations = Vec::new();
    if let Some(uid) = claim.uid() {
        operations.push(json!({"op": "test", "path": "/metadata/uid", "value": uid}));
    }
    operations.push(held_at_test(claim));
    let finalizers = serde_json::to_value(claim.metadata.finalizers.as_ref().filter(|f| !f.is_empty())).ok()?;
    operations.push(json!({"op": "test", "path": "/metadata/finalizers", "value": finalizers}));
    let timestamp = serde_json::to_value(&allocation.allocation_timestamp).ok()?;
    operations.push(json!({"op": "test", "path": "/status/allocation/allocationTimestamp", "value": timestamp}));
    operations.extend(device_tests(allocation));
    if deallocates {
        let value = serde_json::to_value(Some(&listed).filter(|l| !l.is_empty())).ok()?;
        operations.push(json!({"op": "test", "path": "/status/reservedFor", "value": value}));
        if !listed.is_empty() {
            operations.push(json!({"op": "remove", "path": "/status/reservedFor"}));
        }
        operations.push(json!({"op": "remove", "path": "/status/allocation"}));
    } else {
        for i in going.into_iter().rev() {
            let path = format!("/status/reservedFor/{i}");
            operations.push(json!({"op": "test", "path": format!("{path}/uid"), "value": listed[i].uid}));
            operations.push(json!({"op": "remove", "path": path}));
        }
    }
    Some(Removal {
        patch: Value::Array(operations),
        deallocates,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(reserved: &[&str], protected: bool) -> ResourceClaim {
        let finalizers: Vec<&str> = if protected {
            vec![DELETE_PROTECTION_FINALIZER]
        } else {
            vec![]
        };
        serde_json::from_value(json!({
            "metadata": {"name": "s", "namespace": "ns", "uid": "su", "finalizers": finalizers},
            "spec": {"devices": {}},
            "status": {
                "allocation": {"devices": {"results": [{"request": "gpu", "driver": "d", "pool": "p", "device": "g3"}]}},
                "reservedFor": reserved.iter().map(|u| json!({"resource": "pods", "name": u, "uid": u})).collect::<Vec<_>>(),
            },
        }))
        .expect("claim")
    }

    fn consumer(uid: &str) -> ResourceClaimConsumerReference {
        ResourceClaimConsumerReference {
            api_group: None,
            resource: "pods".into(),
            name: uid.into(),
            uid: uid.into(),
        }
    }

    #[test]
    fn a_claim_another_allocator_made_lists_the_gang_on_condition_of_its_devices() {
        let claim = found(&["outsider"], true);
        assert_eq!(
            found_claim_listing(&claim, &[consumer("w0"), consumer("outsider")]),
            Some(json!([
                {"op": "test", "path": "/metadata/uid", "value": "su"},
                {"op": "test", "path": "/metadata/annotations", "value": null},
                {"op": "test", "path": "/status/allocation/devices/results/0/driver", "value": "d"},
                {"op": "test", "path": "/status/allocation/devices/results/0/pool", "value": "p"},
                {"op": "test", "path": "/status/allocation/devices/results/0/device", "value": "g3"},
                {"op": "test", "path": "/status/allocation/devices/results/0/shareID", "value": null},
                {"op": "add", "path": "/status/reservedFor/-", "value": {"resource": "pods", "name": "w0", "uid": "w0"}},
            ]))
        );
        assert_eq!(
            found_claim_listing(&found(&["w0"], true), &[consumer("w0")]),
            None,
            "listed"
        );
        let mut free = claim.clone();
        free.status.as_mut().expect("status").allocation = None;
        free.status.as_mut().expect("status").reserved_for = None;
        assert_eq!(found_claim_listing(&free, &[consumer("w0")]), None, "not allocated");
        let full: Vec<String> = (0..RESERVED_FOR_MAX).map(|i| format!("p{i}")).collect();
        let full: Vec<&str> = full.iter().map(String::as_str).collect();
        assert_eq!(
            found_claim_listing(&found(&full, true), &[consumer("w0")]),
            None,
            "no room in reservedFor: kube-scheduler refuses the pods beyond the limit"
        );
    }

    /// Issue 35, item 1: a released pod kube-scheduler's Unreserve took out of a claim
    /// muster allocated is listed again on condition of the allocation and of the entries
    /// as read (a stale cache must not list it twice).
    #[test]
    fn a_pod_unreserved_from_a_claim_muster_allocated_is_listed_again_against_the_entries_read() {
        let claim = found(&["w0"], true);
        assert_eq!(
            relisting(&claim, &[consumer("w0"), consumer("w1")]),
            Some(json!([
                {"op": "test", "path": "/metadata/uid", "value": "su"},
                {"op": "test", "path": "/status/allocation/allocationTimestamp", "value": null},
                {"op": "test", "path": "/status/reservedFor", "value": [{"resource": "pods", "name": "w0", "uid": "w0"}]},
                {"op": "add", "path": "/status/reservedFor/-", "value": {"resource": "pods", "name": "w1", "uid": "w1"}},
            ]))
        );
        assert_eq!(relisting(&claim, &[consumer("w0")]), None, "listed");
        let mut emptied = found(&[], true);
        emptied.status.as_mut().expect("status").reserved_for = None;
        assert_eq!(
            relisting(&emptied, &[consumer("w1")]),
            Some(json!([
                {"op": "test", "path": "/metadata/uid", "value": "su"},
                {"op": "test", "path": "/status/allocation/allocationTimestamp", "value": null},
                {"op": "test", "path": "/status/reservedFor", "value": null},
                {"op": "add", "path": "/status/reservedFor", "value": [{"resource": "pods", "name": "w1", "uid": "w1"}]},
            ]))
        );
        let mut free = claim;
        free.status.as_mut().expect("status").allocation = None;
        assert_eq!(relisting(&free, &[consumer("w1")]), None, "not allocated");
    }

    #[test]
    fn letting_go_takes_out_only_gated_pods_and_deallocates_as_kube_controller_manager_would() {
        let gated = BTreeSet::from(["w0", "w1"]);
        // The pod outside stays: each gated entry goes at its index, tested first, after
        // the claim is tested as read.
        let removal = gated_removal(&found(&["w0", "outsider", "w1"], true), &gated, true).expect("a removal");
        assert!(!removal.deallocates);
        let operations = removal.patch.as_array().expect("array").clone();
        assert_eq!(
            operations[..4],
            [
                json!({"op": "test", "path": "/metadata/uid", "value": "su"}),
                json!({"op": "test", "path": "/metadata/annotations", "value": null}),
                json!({"op": "test", "path": "/metadata/finalizers", "value": [DELETE_PROTECTION_FINALIZER]}),
                json!({"op": "test", "path": "/status/allocation/allocationTimestamp", "value": null}),
            ]
        );
        assert_eq!(
            operations[8..],
            [
                json!({"op": "test", "path": "/status/reservedFor/2/uid", "value": "w1"}),
                json!({"op": "remove", "path": "/status/reservedFor/2"}),
                json!({"op": "test", "path": "/status/reservedFor/0/uid", "value": "w0"}),
                json!({"op": "remove", "path": "/status/reservedFor/0"}),
            ]
        );
        // Only gated pods were left (the pod outside ended): a protected claim goes.
        let removal = gated_removal(&found(&["w0", "w1"], true), &gated, true).expect("a removal");
        assert!(removal.deallocates);
        let operations = removal.patch.as_array().expect("array").clone();
        assert_eq!(
            operations[8..],
            [
                json!({"op": "test", "path": "/status/reservedFor", "value": [
                    {"resource": "pods", "name": "w0", "uid": "w0"},
                    {"resource": "pods", "name": "w1", "uid": "w1"},
                ]}),
                json!({"op": "remove", "path": "/status/reservedFor"}),
                json!({"op": "remove", "path": "/status/allocation"}),
            ]
        );
        // Another gang holds it too: only the gang's own entries go.
        let removal = gated_removal(&found(&["w0", "w1"], true), &gated, false).expect("a removal");
        assert!(!removal.deallocates);
        // The last holder of a protected claim no pod lists any more gives it back.
        let removal = gated_removal(&found(&[], true), &gated, true).expect("a deallocation");
        assert!(removal.deallocates);
        let operations = removal.patch.as_array().expect("array").clone();
        assert_eq!(
            operations[8..],
            [
                json!({"op": "test", "path": "/status/reservedFor", "value": null}),
                json!({"op": "remove", "path": "/status/allocation"}),
            ]
        );
        // Unprotected, nobody deallocates it: it stays allocated, as it was found.
        let removal = gated_removal(&found(&["w0"], false), &gated, true).expect("a removal");
        assert!(!removal.deallocates);
        assert_eq!(
            gated_removal(&found(&["outsider"], true), &gated, true),
            None,
            "none listed"
        );
        assert_eq!(gated_removal(&found(&[], false), &gated, true), None, "nothing to do");
    }

    fn pod(name: &str, uid: &str, claims: Value, statuses: Value) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ns", "uid": uid},
                "spec": {"containers": [], "resourceClaims": claims},
                "status": {"resourceClaimStatuses": statuses},
            }))
            .expect("pod"),
        )
    }

    #[test]
    fn each_claim_lists_the_planned_pods_that_name_it() {
        let pods = vec![
            pod(
                "w-0",
                "u0",
                json!([{"name": "gpus", "resourceClaimName": "w-0-gpus"}, {"name": "s", "resourceClaimName": "shared"}]),
                json!([]),
            ),
            pod(
                "w-1",
                "u1",
                json!([{"name": "gpus", "resourceClaimTemplateName": "t"}, {"name": "s", "resourceClaimName": "shared"}]),
                json!([{"name": "gpus", "resourceClaimName": "w-1-gpus-abcde"}]),
            ),
            // Not in the plan: not listed.
            pod(
                "w-2",
                "u2",
                json!([{"name": "s", "resourceClaimName": "shared"}]),
                json!([]),
            ),
            // A template whose claim is not made yet: nothing to list.
            pod(
                "w-3",
                "u3",
                json!([{"name": "gpus", "resourceClaimTemplateName": "t"}]),
                json!([]),
            ),
        ];
        let planned = BTreeSet::from(["w-0", "w-1", "w-3"]);
        let consumers = planned_consumers(&pods, &planned);
        let names = |claim: &str| -> Vec<(String, String)> {
            consumers[claim]
                .iter()
                .map(|c| (c.name.clone(), c.uid.clone()))
                .collect()
        };
        assert_eq!(consumers.len(), 3, "{consumers:?}");
        assert_eq!(names("w-0-gpus"), [("w-0".to_string(), "u0".to_string())]);
        assert_eq!(names("w-1-gpus-abcde"), [("w-1".to_string(), "u1".to_string())]);
        assert_eq!(
            names("shared"),
            [
                ("w-0".to_string(), "u0".to_string()),
                ("w-1".to_string(), "u1".to_string())
            ]
        );
        let entry = serde_json::to_value(&consumers["w-0-gpus"][0]).expect("json");
        assert_eq!(
            entry,
            json!({"resource": "pods", "name": "w-0", "uid": "u0"}),
            "no apiGroup"
        );
    }

    #[test]
    fn a_claim_with_more_consumers_than_reserved_for_holds_gets_none() {
        let pods: Vec<Arc<Pod>> = (0..=RESERVED_FOR_MAX)
            .map(|i| {
                pod(
                    &format!("w-{i}"),
                    &format!("u{i}"),
                    json!([{"name": "s", "resourceClaimName": "big"}]),
                    json!([]),
                )
            })
            .collect();
        let names: Vec<String> = (0..=RESERVED_FOR_MAX).map(|i| format!("w-{i}")).collect();
        let planned: BTreeSet<&str> = names.iter().map(String::as_str).collect();
        assert!(planned_consumers(&pods, &planned).is_empty());
    }

    #[test]
    fn a_released_pod_is_added_to_a_protected_claim_it_is_not_listed_in() {
        let mut claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "cu"},
            "spec": {"devices": {}},
            "status": {
                "allocation": {"allocationTimestamp": "2026-11-24T18:00:00Z", "devices": {}},
                "reservedFor": [{"resource": "pods", "name": "w-0", "uid": "old"}],
            },
        }))
        .expect("claim");
        let new = ResourceClaimConsumerReference {
            api_group: None,
            resource: "pods".into(),
            name: "w-0".into(),
            uid: "new".into(),
        };
        assert_eq!(
            reservation_addition(&claim, std::slice::from_ref(&new)),
            Some(json!([
                {"op": "test", "path": "/metadata/uid", "value": "cu"},
                {"op": "test", "path": "/status/allocation/allocationTimestamp", "value": "2026-11-24T18:00:00Z"},
                {"op": "add", "path": "/status/reservedFor/-", "value": {"resource": "pods", "name": "w-0", "uid": "new"}},
            ]))
        );
        claim.status.as_mut().expect("status").reserved_for = None;
        let patch = reservation_addition(&claim, &[new.clone(), new.clone()]).expect("a patch");
        assert!(
            patch
                .as_array()
                .expect("array")
                .contains(&json!({"op": "add", "path": "/status/reservedFor",
                "value": [{"resource": "pods", "name": "w-0", "uid": "new"}]})),
            "each consumer once: {patch}"
        );
        assert!(
            patch
                .as_array()
                .expect("array")
                .contains(&json!({"op": "test", "path": "/status/reservedFor", "value": null}))
        );
        claim.status.as_mut().expect("status").reserved_for = Some(vec![new.clone()]);
        assert_eq!(
            reservation_addition(&claim, std::slice::from_ref(&new)),
            None,
            "listed already"
        );
        claim.status.as_mut().expect("status").allocation = None;
        claim.status.as_mut().expect("status").reserved_for = None;
        assert_eq!(
            reservation_addition(&claim, std::slice::from_ref(&new)),
            None,
            "not allocated"
        );
    }

    #[test]
    fn a_committed_claim_carries_delete_protection_exactly_when_asked() {
        let list = |f: &[&str]| f.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            commit_finalizers(&[], true),
            Some(list(&[CLAIM_FINALIZER, DELETE_PROTECTION_FINALIZER]))
        );
        assert_eq!(commit_finalizers(&[], false), Some(list(&[CLAIM_FINALIZER])));
        assert_eq!(commit_finalizers(&list(&[CLAIM_FINALIZER]), false), None);
        assert_eq!(
            commit_finalizers(&list(&["other", DELETE_PROTECTION_FINALIZER, CLAIM_FINALIZER]), false),
            Some(list(&["other", CLAIM_FINALIZER])),
            "another's finalizer stays; delete-protection goes"
        );
        assert_eq!(
            commit_finalizers(&list(&[DELETE_PROTECTION_FINALIZER, CLAIM_FINALIZER]), true),
            None
        );
    }

    #[test]
    fn a_deallocation_tests_what_it_was_decided_on() {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "cu"},
            "spec": {"devices": {}},
            "status": {
                "allocation": {
                    "allocationTimestamp": "2026-11-24T18:00:00Z",
                    "devices": {"results": [{"request": "gpu", "driver": "d", "pool": "p", "device": "g0"}]},
                },
                "reservedFor": [{"resource": "pods", "name": "w-0", "uid": "u0"}],
            },
        }))
        .expect("claim");
        assert_eq!(
            deallocation(&claim),
            Some(json!([
                {"op": "test", "path": "/metadata/uid", "value": "cu"},
                {"op": "test", "path": "/metadata/annotations", "value": null},
                {"op": "test", "path": "/status/allocation/allocationTimestamp", "value": "2026-11-24T18:00:00Z"},
                {"op": "test", "path": "/status/reservedFor",
                 "value": [{"resource": "pods", "name": "w-0", "uid": "u0"}]},
                {"op": "remove", "path": "/status/allocation"},
                {"op": "remove", "path": "/status/reservedFor"},
            ]))
        );
        let mut unreserved = claim.clone();
        unreserved.status.as_mut().expect("status").reserved_for = Some(vec![]);
        let patch = deallocation(&unreserved).expect("allocated");
        let operations = patch.as_array().expect("array");
        assert!(operations.contains(&json!({"op": "test", "path": "/status/reservedFor", "value": null})));
        assert!(!operations.contains(&json!({"op": "remove", "path": "/status/reservedFor"})));
        let mut held = claim.clone();
        held.metadata.annotations = Some([(CLAIM_HELD_AT.to_string(), "17".to_string())].into());
        let patch = deallocation(&held).expect("allocated");
        assert!(
            patch
                .as_array()
                .expect("array")
                .contains(&json!({"op": "test", "path": "/metadata/annotations/muster.dev~1held-at", "value": "17"})),
            "{patch}"
        );
        let mut free = claim;
        free.status.as_mut().expect("status").allocation = None;
        assert_eq!(deallocation(&free), None);
    }
}
