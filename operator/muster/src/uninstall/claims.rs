//! What the uninstall does with each claim, decided from what was read.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use muster_api::labels;
use serde_json::{Value, json};

/// What becomes of a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Not muster's: left as it is.
    Nothing,
    /// Allocated by muster for a pod that may run: it keeps its devices, with
    /// kube-controller-manager's delete-protection so that they go with its last pod.
    HandOver,
    /// Allocated by muster, used by no pod that may run: its devices are given back.
    Deallocate,
    /// Muster's, not allocated: only muster's finalizer goes.
    ReleaseFinalizer,
}

fn ended(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// What becomes of `claim`, used by `users` (the pods whose spec names it).
pub fn hand_over(claim: &ResourceClaim, users: &[&Pod]) -> Action {
    if !claim.finalizers().iter().any(|f| f == labels::CLAIM_FINALIZER) {
        return Action::Nothing;
    }
    if claim.status.as_ref().and_then(|s| s.allocation.as_ref()).is_none() {
        return Action::ReleaseFinalizer;
    }
    let may_run = |p: &&&Pod| !crate::workload::status::is_gated(p) && !ended(p);
    if users.iter().any(|p| may_run(&p)) {
        Action::HandOver
    } else {
        Action::Deallocate
    }
}

/// How many of `claim`'s `reservedFor` entries are pods behind muster's gate.
pub fn gated_entries(claim: &ResourceClaim, gated: &dyn Fn(&str) -> bool) -> usize {
    claim
        .status
        .iter()
        .flat_map(|s| s.reserved_for.iter().flatten())
        .filter(|r| gated(&r.uid))
        .count()
}

/// The JSON patch that takes the entries of pods behind muster's gate out of `claim`'s
/// `reservedFor`, each tested at its index; `None` if there are none.
pub fn without_gated_entries(claim: &ResourceClaim, gated: &dyn Fn(&str) -> bool) -> Option<Value> {
    let entries = claim.status.as_ref()?.reserved_for.as_ref()?;
    let at: Vec<usize> = entries
        .iter()
        .enumerate()
        .filter(|(_, r)| gated(&r.uid))
        .map(|(i, _)| i)
        .collect();
    if at.is_empty() {
        return None;
    }
    let mut operations = Vec::new();
    if let Some(uid) = claim.uid() {
        operations.push(json!({"op": "test", "path": "/metadata/uid", "value": uid}));
    }
    for i in at.iter().rev() {
        operations
            .push(json!({"op": "test", "path": format!("/status/reservedFor/{i}/uid"), "value": entries[*i].uid}));
        operations.push(json!({"op": "remove", "path": format!("/status/reservedFor/{i}")}));
    }
    Some(Value::Array(operations))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(finalizers: &[&str], allocated: bool, reserved: &[&str]) -> ResourceClaim {
        let mut status = json!({});
        if allocated {
            status["allocation"] =
                json!({"devices": {"results": [{"request": "r", "driver": "d", "pool": "p", "device": "g0"}]}});
        }
        if !reserved.is_empty() {
            status["reservedFor"] = json!(
                reserved
                    .iter()
                    .map(|u| json!({"resource": "pods", "name": format!("pod-{u}"), "uid": u}))
                    .collect::<Vec<_>>()
            );
        }
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "c-uid", "finalizers": finalizers},
            "spec": {"devices": {}},
            "status": status,
        }))
        .unwrap()
    }

    fn pod(gated: bool, phase: &str) -> Pod {
        let mut spec = json!({"containers": []});
        if gated {
            spec["schedulingGates"] = json!([{"name": labels::GANG_GATE}]);
        }
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec, "status": {"phase": phase}})).unwrap()
    }

    #[test]
    fn a_claim_a_running_pod_uses_is_handed_over_and_any_other_given_back() {
        let ours = [labels::CLAIM_FINALIZER];
        let running = pod(false, "Running");
        let waiting = pod(true, "Pending");
        let done = pod(false, "Succeeded");
        assert_eq!(hand_over(&claim(&ours, true, &[]), &[&running]), Action::HandOver);
        assert_eq!(
            hand_over(&claim(&ours, true, &[]), &[&waiting, &done]),
            Action::Deallocate
        );
        assert_eq!(hand_over(&claim(&ours, true, &[]), &[]), Action::Deallocate);
        assert_eq!(
            hand_over(&claim(&ours, false, &[]), &[&running]),
            Action::ReleaseFinalizer
        );
        assert_eq!(hand_over(&claim(&[], true, &[]), &[]), Action::Nothing, "not muster's");
    }

    #[test]
    fn entries_of_gated_pods_are_taken_out_each_tested_at_its_index() {
        let c = claim(&[labels::CLAIM_FINALIZER], true, &["a", "g1", "b", "g2"]);
        let gated = |uid: &str| uid.starts_with('g');
        assert_eq!(gated_entries(&c, &gated), 2);
        let patch = without_gated_entries(&c, &gated).expect("a patch");
        let paths: Vec<&str> = patch
            .as_array()
            .unwrap()
            .iter()
            .filter(|op| op["op"] == "remove")
            .map(|op| op["path"].as_str().unwrap())
            .collect();
        assert_eq!(
            paths,
            ["/status/reservedFor/3", "/status/reservedFor/1"],
            "the last first"
        );
        assert_eq!(without_gated_entries(&c, &|_| false), None);
    }
}
