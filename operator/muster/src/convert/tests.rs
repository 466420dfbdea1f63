use super::*;
use serde_json::json;

fn pod_spec(value: serde_json::Value) -> PodSpec {
    serde_json::from_value(value).expect("valid pod spec")
}

#[test]
fn pod_requests_count_sidecars_init_containers_and_overhead() {
    let spec = pod_spec(json!({
        "containers": [
            {"name": "a", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
            {"name": "b", "resources": {"limits": {"cpu": "500m", "example.com/nic": "1"}}},
        ],
        "initContainers": [
            {"name": "sidecar", "restartPolicy": "Always", "resources": {"requests": {"cpu": "250m"}}},
            {"name": "init", "resources": {"requests": {"cpu": "4", "memory": "512Mi"}}},
        ],
        "overhead": {"cpu": "100m"},
    }));
    let r = pod_requests("Pod ns/p", &spec).unwrap();
    // Init phase: 4 + 0.25 (sidecar running) = 4.25 > 1 + 0.5 + 0.25 = 1.75; plus overhead.
    assert_eq!(r.cpu_millis, 4350);
    assert_eq!(r.memory, 1 << 30);
    assert_eq!(r.other["example.com/nic"], 1, "requests default to limits");
    assert_eq!(r.pods, 1);
}

#[test]
fn pod_level_requests_replace_cpu_and_memory() {
    let spec = pod_spec(json!({
        "containers": [{"name": "a", "resources": {"requests": {"cpu": "1"}}}],
        "resources": {"requests": {"cpu": "3", "memory": "2Gi"}},
    }));
    let r = pod_requests("Pod ns/p", &spec).unwrap();
    assert_eq!((r.cpu_millis, r.memory), (3000, 2 << 30));
}

#[test]
fn a_resizing_pod_holds_the_larger_of_its_spec_and_what_it_was_given() {
    let pod = |spec_cpu: &str, allocated: &str, running: &str, condition: Option<&str>| -> Pod {
        let mut status = json!({"containerStatuses": [{
            "name": "a", "image": "x", "imageID": "", "ready": true, "restartCount": 0,
            "allocatedResources": {"cpu": allocated},
            "resources": {"requests": {"cpu": running}},
        }]});
        if let Some(reason) = condition {
            status["conditions"] = json!([{"type": "PodResizePending", "status": "True", "reason": reason}]);
        }
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"nodeName": "n1", "containers": [{"name": "a", "resources": {"requests": {"cpu": spec_cpu}}}]},
            "status": status,
        }))
        .unwrap()
    };
    let cpu = |pod: &Pod| pod_requests_in_use("Pod ns/p", pod).unwrap().cpu_millis;
    // Shrinking from 4 to 2: 4 until the kubelet has done it.
    assert_eq!(cpu(&pod("2", "4", "4", None)), 4000);
    // Growing from 2 to 8, deferred: the spec's 8 counts already.
    assert_eq!(cpu(&pod("8", "2", "2", Some("Deferred"))), 8000);
    // Infeasible: what it runs with, not the spec.
    assert_eq!(cpu(&pod("8", "2", "3", Some("Infeasible"))), 3000);
    // Done: all agree.
    assert_eq!(cpu(&pod("2", "2", "2", None)), 2000);
    let entry = pod_entry(&pod("2", "4", "4", None)).unwrap().unwrap();
    assert_eq!(entry.requests.cpu_millis, 4000, "what the node holds for it");
}

#[test]
fn bad_quantities_name_the_object_and_field() {
    let spec = pod_spec(json!({"containers": [{"name": "a", "resources": {"requests": {"cpu": "lots"}}}]}));
    let e = pod_requests("Pod ns/p", &spec).unwrap_err();
    assert_eq!(e.object, "Pod ns/p");
    assert!(
        e.message.starts_with("container a.cpu: quantities must match"),
        "{}",
        e.message
    );
}

#[test]
fn nodes_keep_labels_taints_and_allocatable() {
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": "n1", "labels": {"rack": "r1"}},
        "spec": {"unschedulable": true, "taints": [{"key": "gpu", "value": "yes", "effect": "NoSchedule"}]},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"}},
    }))
    .unwrap();
    let n = super::node(&node).unwrap();
    assert_eq!(n.labels["rack"], "r1");
    assert!(n.unschedulable);
    assert_eq!(n.taints[0].effect, NodeTaintEffect::NoSchedule);
    assert_eq!(
        (
            n.allocatable.cpu_millis,
            n.allocatable.pods,
            n.allocatable.other["nvidia.com/gpu"]
        ),
        (64000, 110, 8)
    );
}

#[test]
fn slices_and_claims_convert_every_field_the_allocator_uses() {
    let slice: resource::ResourceSlice = serde_json::from_value(json!({
        "metadata": {"name": "n1-gpu"},
        "spec": {
            "driver": "gpu.example.com",
            "nodeName": "n1",
            "pool": {"name": "n1", "generation": 3, "resourceSliceCount": 1},
            "devices": [{
                "name": "gpu-0",
                "attributes": {"model": {"string": "H100"}, "index": {"int": 0}, "driverVersion": {"version": "1.2.3"}, "ok": {"bool": true}},
                "capacity": {"memory": {"value": "80Gi", "requestPolicy": {"default": "10Gi", "validRange": {"min": "10Gi", "step": "10Gi"}}}},
                "taints": [{"key": "k", "value": "v", "effect": "NoExecute"}],
                "allowMultipleAllocations": true,
            }],
        },
    }))
    .unwrap();
    let s = super::slice(&slice).unwrap();
    assert_eq!((s.generation, s.nodes.clone()), (3, SliceNodes::Node("n1".into())));
    let d = &s.devices[0];
    assert_eq!(d.attributes["driverVersion"], AttributeValue::Version("1.2.3".into()));
    assert_eq!(d.attributes["ok"], AttributeValue::Bool(true));
    assert_eq!(
        d.capacity["memory"]
            .request_policy
            .as_ref()
            .unwrap()
            .valid_range
            .as_ref()
            .unwrap()
            .step,
        Some(Quantity::parse("10Gi").unwrap())
    );
    assert_eq!(d.taints[0].effect, TaintEffect::NoExecute);
    assert!(d.allow_multiple_allocations);

    let spec: resource::ResourceClaimSpec = serde_json::from_value(json!({
        "devices": {
            "requests": [
                {"name": "gpus", "exactly": {"deviceClassName": "gpu.example.com", "count": 4, "selectors": [{"cel": {"expression": "true"}}]}},
                {"name": "nic", "firstAvailable": [
                    {"name": "fast", "deviceClassName": "nic", "allocationMode": "All"},
                    {"name": "slow", "deviceClassName": "nic", "tolerations": [{"operator": "Exists"}]},
                ]},
            ],
            "constraints": [{"requests": ["gpus"], "matchAttribute": "gpu.example.com/nvlinkDomain"}],
            "config": [{"requests": ["gpus"], "opaque": {"driver": "gpu.example.com", "parameters": {"mode": "fast"}}}],
        },
    }))
    .unwrap();
    let c = claim_spec("ResourceClaim ns/c", &spec).unwrap();
    let DeviceRequest::Exactly(gpus) = &c.requests[0] else {
        panic!("exactly")
    };
    assert_eq!((gpus.count, gpus.selectors.len()), (4, 1));
    let DeviceRequest::FirstAvailable { subrequests, .. } = &c.requests[1] else {
        panic!("firstAvailable")
    };
    assert_eq!(subrequests[0].allocation_mode, AllocationMode::All);
    assert_eq!(subrequests[1].tolerations[0].operator, TolerationOperator::Exists);
    assert_eq!(
        c.constraints[0].kind,
        ConstraintKind::MatchAttribute("gpu.example.com/nvlinkDomain".into())
    );
    assert_eq!(c.config[0].opaque.parameters, r#"{"mode":"fast"}"#);
}

#[test]
fn allocations_round_trip() {
    let kube: resource::AllocationResult = serde_json::from_value(json!({
        "devices": {
            "results": [{"request": "gpus", "driver": "gpu.example.com", "pool": "n1", "device": "gpu-0",
                         "shareID": "0c3f", "consumedCapacity": {"memory": "10Gi"}}],
            "config": [{"source": "FromClass", "opaque": {"driver": "gpu.example.com", "parameters": {"a": 1}}}],
        },
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]},
    }))
    .unwrap();
    let engine = allocation("ResourceClaim ns/c", &kube).unwrap();
    assert_eq!(engine.node_selector, Some(NodeSelector::for_node("n1")));
    assert_eq!(
        engine.devices[0].consumed_capacity["memory"],
        Quantity::parse("10Gi").unwrap()
    );
    let back = allocation_to_kube(&engine);
    assert_eq!(back, kube);
}

#[test]
fn released_pods_pinned_to_one_node_count_there() {
    let pod = |spec: serde_json::Value| -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec})).unwrap()
    };
    let pinned = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}}});
    assert_eq!(
        pod_node(&pod(json!({"containers": [], "affinity": pinned}))),
        Some("n1".into())
    );
    let gated = json!({"containers": [], "affinity": pinned, "schedulingGates": [{"name": "x"}]});
    assert_eq!(pod_node(&pod(gated)), None, "a gated pod is not going anywhere yet");
    assert_eq!(pod_node(&pod(json!({"containers": []}))), None);
    assert_eq!(
        pod_node(&pod(json!({"containers": [], "nodeName": "n2", "affinity": pinned}))),
        Some("n2".into())
    );
}
