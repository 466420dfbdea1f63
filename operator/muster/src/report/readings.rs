//! The live gauges of `/metrics`, read fresh at each scrape: gangs waiting by namespace
//! and reason, gangs by admission state and how long the oldest has been in it, devices
//! muster reserved by DeviceClass, and devices in use or free by driver.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::jiff::Timestamp;
use muster_api::labels;
use muster_api::v1alpha1::Workload;
use muster_engine::claim::DeviceId;
use muster_engine::cluster::ClusterState;

use super::summary::{state_name, summarize};
use crate::ops::metrics::live::Readings;

/// Reads the gauges from the Workloads, the claims muster made for them, and the
/// cluster model.
pub fn read<'a>(
    workloads: impl IntoIterator<Item = &'a Workload>,
    gang_claims: impl IntoIterator<Item = &'a ResourceClaim>,
    cluster: &ClusterState,
    now: Timestamp,
) -> Readings {
    let mut readings = Readings::default();
    for workload in workloads {
        let summary = summarize(workload, now);
        if summary.is_pending() {
            let reason = summary.reason.clone().unwrap_or_default();
            *readings.pending.entry((summary.namespace.clone(), reason)).or_default() += 1;
            let longest = readings
                .pending_longest_wait
                .entry(summary.namespace.clone())
                .or_default();
            *longest = longest.max(summary.waiting.map_or(0.0, |w| w.as_secs_f64()));
        }
        if let Some(state) = summary.state {
            let name = state_name(state).to_string();
            *readings.states.entry(name.clone()).or_default() += 1;
            let longest = readings.state_longest.entry(name).or_default();
            *longest = longest.max(summary.in_state.map_or(0.0, |d| d.as_secs_f64()));
        }
    }
    for claim in gang_claims {
        let held_by_muster = claim
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f == labels::CLAIM_FINALIZER));
        if !held_by_muster {
            continue;
        }
        let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
            continue;
        };
        for result in allocation.devices.iter().flat_map(|d| d.results.iter().flatten()) {
            *readings
                .reserved_by_class
                .entry(request_class(claim, &result.request).unwrap_or_default())
                .or_default() += 1;
        }
    }
    // Slices of older generations of a pool are on their way out: count the newest.
    let mut newest: BTreeMap<(&str, &str), i64> = BTreeMap::new();
    for slice in cluster.slices() {
        let generation = newest.entry((&slice.driver, &slice.pool)).or_insert(slice.generation);
        *generation = (*generation).max(slice.generation);
    }
    for slice in cluster.slices() {
        if newest.get(&(slice.driver.as_str(), slice.pool.as_str())) != Some(&slice.generation) {
            continue;
        }
        let counts = readings.devices_by_driver.entry(slice.driver.clone()).or_default();
        for device in &slice.devices {
            let id = DeviceId {
                driver: slice.driver.clone(),
                pool: slice.pool.clone(),
                device: device.name.clone(),
            };
            if cluster.device_in_any_use(&id) {
                counts.in_use += 1;
            } else {
                counts.free += 1;
            }
        }
    }
    readings
}

/// The DeviceClass of the request (or subrequest, `request/sub`) a result came from.
fn request_class(claim: &ResourceClaim, request: &str) -> Option<String> {
    let (name, sub) = match request.split_once('/') {
        Some((name, sub)) => (name, Some(sub)),
        None => (request, None),
    };
    let request = claim
        .spec
        .as_ref()?
        .devices
        .as_ref()?
        .requests
        .as_ref()?
        .iter()
        .find(|r| r.name == name)?;
    match sub {
        None => request.exactly.as_ref().map(|e| e.device_class_name.clone()),
        Some(sub) => request
            .first_available
            .as_ref()?
            .iter()
            .find(|s| s.name == sub)
            .map(|s| s.device_class_name.clone()),
    }
}

/// The leader's caches, read at each scrape.
pub struct CacheSource {
    pub workloads: kube::runtime::reflector::Store<Workload>,
    pub claims: kube::runtime::reflector::Store<ResourceClaim>,
    pub cluster: std::sync::Arc<crate::cache::cluster::Index>,
}

impl crate::ops::metrics::live::Source for CacheSource {
    fn read(&self) -> Readings {
        let workloads = self.workloads.state();
        let claims = self.claims.state();
        let cluster = self.cluster.snapshot();
        read(
            workloads.iter().map(|w| w.as_ref()),
            claims.iter().map(|c| c.as_ref()),
            &cluster,
            Timestamp::now(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_engine::fixtures::{device_result, gpu_cluster};
    use muster_engine::key::ClaimKey;

    fn workload(name: &str, namespace: &str, status: serde_json::Value) -> Workload {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "muster.dev/v1alpha1",
            "kind": "Workload",
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"podGroups": [
                {"name": "workers", "replicas": 2, "template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}}
            ]},
            "status": status,
        }))
        .expect("a valid Workload")
    }

    fn claim(finalizer: bool, results: &[(&str, &str)]) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "c", "namespace": "a",
                "finalizers": if finalizer { vec![labels::CLAIM_FINALIZER] } else { vec![] },
            },
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com", "count": 1}},
                {"name": "any", "firstAvailable": [{"name": "big", "deviceClassName": "big-gpu.example.com"}]},
            ]}},
            "status": {"allocation": {"devices": {"results": results.iter().map(|(request, device)| serde_json::json!({
                "request": request, "driver": "gpu.example.com", "pool": "node-00000", "device": device,
            })).collect::<Vec<_>>()}}},
        }))
        .expect("a valid claim")
    }

    #[test]
    fn gangs_waiting_are_counted_by_namespace_and_reason_and_states_by_state() {
        let unschedulable = serde_json::json!({"phase": "Queued", "conditions": [{
            "type": "Admitted", "status": "False", "reason": "Unschedulable", "message": "m",
            "lastTransitionTime": "2026-01-01T00:01:00Z",
        }]});
        let workloads = [
            workload("a1", "a", unschedulable.clone()),
            workload("a2", "a", serde_json::json!({"phase": "Pending"})),
            workload("b1", "b", unschedulable),
            workload(
                "r",
                "b",
                serde_json::json!({"phase": "Running", "placement": {
                    "state": "Released", "since": "2026-01-01T00:02:00Z", "devices": 4,
                }}),
            ),
            workload(
                "t",
                "b",
                serde_json::json!({"phase": "Queued", "placement": {
                    "state": "TearingDown", "since": "2026-01-01T00:09:00Z",
                }}),
            ),
        ];
        let now: Timestamp = "2026-01-01T00:10:00Z".parse().unwrap();
        let readings = read(workloads.iter(), [], &ClusterState::new(), now);
        assert_eq!(readings.pending[&("a".into(), "Unschedulable".into())], 1);
        assert_eq!(readings.pending[&("a".into(), "WaitingForObjects".into())], 1);
        assert_eq!(readings.pending[&("b".into(), "Unschedulable".into())], 1);
        // The tearing-down gang is queued too, and has no Admitted condition.
        assert_eq!(readings.pending[&("b".into(), "WaitingForObjects".into())], 1);
        // a2 waits since creation (10 min), a1 since its condition (9 min).
        assert_eq!(readings.pending_longest_wait["a"], 600.0);
        assert_eq!(readings.states["Released"], 1);
        assert_eq!(readings.states["TearingDown"], 1);
        assert_eq!(readings.state_longest["Released"], 480.0);
        assert_eq!(readings.state_longest["TearingDown"], 60.0);
    }

    #[test]
    fn devices_are_counted_by_class_for_muster_claims_and_by_driver_for_the_cluster() {
        let claims = [
            claim(true, &[("gpu", "gpu-0"), ("gpu", "gpu-1"), ("any/big", "gpu-2")]),
            // Not reserved by muster: not counted as muster's.
            claim(false, &[("gpu", "gpu-3")]),
        ];
        let mut cluster = gpu_cluster(2, 4, 2, 1);
        cluster.set_claim_allocation(
            &ClaimKey::new("a", "c"),
            Some(vec![
                device_result("gpu", "node-00000", "gpu-0"),
                device_result("gpu", "node-00000", "gpu-1"),
                device_result("gpu", "node-00000", "gpu-2"),
            ]),
        );
        let readings = read([], claims.iter(), &cluster, Timestamp::now());
        assert_eq!(readings.reserved_by_class["gpu.example.com"], 2);
        assert_eq!(readings.reserved_by_class["big-gpu.example.com"], 1);
        assert_eq!(readings.reserved_by_class.len(), 2);
        let devices = readings.devices_by_driver.values().next().expect("one driver");
        assert_eq!((devices.in_use, devices.free), (3, 5));
    }
}
