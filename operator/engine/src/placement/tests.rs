use super::*;
use crate::claim::{DeviceId, DeviceResult};
use crate::cluster::{PlanId, locked};
use crate::fixtures::*;
use crate::request::{GroupRequest, SharedClaim, TopologyRequest};
use crate::selector::Toleration;
use std::collections::BTreeSet;

const RACK: &str = "example.com/rack";
const BLOCK: &str = "example.com/block";

pub(super) fn placed(outcome: &Outcome) -> &Plan {
    match outcome {
        Outcome::Placed(plan) => plan,
        Outcome::Unschedulable(u) => panic!("expected a plan, got: {u}"),
    }
}

pub(super) fn reasons(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Placed(plan) => panic!("expected no fit, got a plan on {:?}", plan.nodes()),
        Outcome::Unschedulable(u) => u.to_string(),
    }
}

fn all_devices(plan: &Plan) -> Vec<DeviceId> {
    plan.claims
        .iter()
        .flat_map(|c| c.allocation.devices.iter().map(DeviceResult::device_id))
        .collect()
}

/// Takes `count` GPUs of `node` with a claim, as another workload would.
fn occupy(cluster: &mut ClusterState, node: &str, count: usize) {
    let devices = (0..count)
        .map(|i| device_result("x", node, &format!("gpu-{i}")))
        .collect();
    cluster.set_claim_allocation(&format!("other/{node}").into(), Some(devices));
}

#[test]
fn a_gang_lands_in_one_rack_with_distinct_devices() {
    // 8 nodes, 2 per rack, 8 GPUs each.
    let cluster = gpu_cluster(8, 8, 2, 2);
    let outcome = plan(
        &cluster,
        &gpu_gang("g", 2, 8, Some(RACK), None),
        &PlanOptions::default(),
    );
    let plan = placed(&outcome);
    assert_eq!(plan.pods.len(), 2);
    assert_eq!(plan.topology_value.as_deref(), Some("rack-0000"));
    assert_eq!(plan.nodes(), ["node-00000", "node-00001"]);
    let devices = all_devices(plan);
    assert_eq!(devices.len(), 16);
    assert_eq!(devices.iter().collect::<BTreeSet<_>>().len(), 16, "no device twice");
    for (pod, claim) in plan.pods.iter().zip(&plan.claims) {
        assert!(
            claim.allocation.devices.iter().all(|d| d.pool == pod.node),
            "devices on the pod's node"
        );
        assert_eq!(
            claim.allocation.node_selector,
            Some(crate::selector::NodeSelector::for_node(&pod.node))
        );
    }
}

#[test]
fn a_gang_too_big_for_any_rack_is_explained_with_numbers() {
    let cluster = gpu_cluster(8, 8, 2, 2);
    let outcome = plan(
        &cluster,
        &gpu_gang("big", 3, 8, Some(RACK), None),
        &PlanOptions::default(),
    );
    let why = reasons(&outcome);
    assert!(
        why.contains("group big-workers needs 3 pods (8 gpu.example.com devices each, 8 CPU, 65536Mi memory) in one example.com/rack, but the best, rack-0000, has room for 2"),
        "{why}"
    );
    // Without the rack constraint it fits.
    assert!(
        plan(&cluster, &gpu_gang("big", 3, 8, None, None), &PlanOptions::default())
            .plan()
            .is_some()
    );
}

#[test]
fn tightest_rack_wins_and_keeps_big_holes_free() {
    let mut cluster = gpu_cluster(8, 8, 2, 2);
    // rack-0001 has 4 GPUs taken on one node; rack-0002 has 7 taken on one node.
    occupy(&mut cluster, "node-00002", 4);
    occupy(&mut cluster, "node-00004", 7);
    // 2 pods of 4 GPUs: fits in every rack; the tightest is rack-0001 (one partial node
    // with 4 free + a full one → leftover 8) vs rack-0002 (1 + 8 free → leftover 4... but
    // the partial node fits no pod, so its room is 2 pods: leftover 0).
    let outcome = plan(
        &cluster,
        &gpu_gang("small", 2, 4, Some(RACK), None),
        &PlanOptions::default(),
    );
    let plan = placed(&outcome);
    assert_eq!(plan.topology_value.as_deref(), Some("rack-0002"));
    assert_eq!(plan.nodes(), ["node-00005"], "both pods share the free node");
}

#[test]
fn preferred_level_keeps_the_gang_together_when_it_can() {
    // Blocks of 2 racks of 2 nodes; a 2-pod gang must stay in a block, preferably a rack.
    let mut cluster = gpu_cluster(8, 8, 2, 2);
    occupy(&mut cluster, "node-00000", 8);
    occupy(&mut cluster, "node-00003", 8);
    // block-000: rack-0000 has node-00001, rack-0001 has node-00002 → must spread.
    // block-001: racks 2 and 3 are free → one rack possible, but leftover is larger.
    let outcome = plan(
        &cluster,
        &gpu_gang("g", 2, 8, Some(BLOCK), Some(RACK)),
        &PlanOptions::default(),
    );
    let first = placed(&outcome);
    assert_eq!(first.topology_value.as_deref(), Some("block-000"), "tightest block");
    assert_eq!(first.preferred_values, ["rack-0000", "rack-0001"]);

    // With block-000 too full, block-001 is used and one rack suffices.
    occupy(&mut cluster, "node-00001", 8);
    let outcome = plan(
        &cluster,
        &gpu_gang("g", 2, 8, Some(BLOCK), Some(RACK)),
        &PlanOptions::default(),
    );
    let plan = placed(&outcome);
    assert_eq!(plan.topology_value.as_deref(), Some("block-001"));
    assert_eq!(plan.preferred_values.len(), 1, "{:?}", plan.preferred_values);
}

#[test]
fn mixed_shapes_launcher_and_workers() {
    let cluster = gpu_cluster(8, 8, 2, 2);
    let mut gang = gpu_gang("train", 2, 8, Some(RACK), None);
    gang.groups
        .insert(0, GroupRequest::uniform("launcher", "ns", 1, 1, gpu_pod(0, 2, 4)));
    let plan = placed(&plan(&cluster, &gang, &PlanOptions::default())).clone();
    assert_eq!(plan.pods.len(), 3);
    let rack = plan.topology_value.clone().unwrap();
    for pod in &plan.pods {
        assert_eq!(
            cluster.node(&pod.node).unwrap().labels[RACK],
            rack,
            "every pod in the rack"
        );
    }
    assert_eq!(plan.pods[0].group, "launcher", "groups in request order");
    assert_eq!(plan.claims.len(), 2, "only workers have claims");
}

#[test]
fn cpu_shortage_is_respected_and_explained() {
    let mut cluster = gpu_cluster(4, 8, 2, 2);
    // node-00000 has its CPU used up by another pod.
    cluster.upsert_pod(
        &"other/hog".into(),
        "node-00000",
        Resources {
            cpu_millis: 60_000,
            pods: 1,
            ..Default::default()
        },
    );
    let outcome = plan(
        &cluster,
        &gpu_gang("g", 2, 8, Some(RACK), None),
        &PlanOptions::default(),
    );
    assert_eq!(placed(&outcome).topology_value.as_deref(), Some("rack-0001"));
    cluster.upsert_pod(
        &"other/hog2".into(),
        "node-00002",
        Resources {
            cpu_millis: 60_000,
            pods: 1,
            ..Default::default()
        },
    );
    let why = reasons(&plan(
        &cluster,
        &gpu_gang("g", 2, 8, Some(RACK), None),
        &PlanOptions::default(),
    ));
    assert!(why.contains("has room for 1"), "{why}");
    assert!(
        why.contains("2 of 4 nodes cannot take any pod of the gang: 2 insufficient cpu"),
        "{why}"
    );
}

#[test]
fn taints_and_selectors_filter_nodes() {
    let mut cluster = gpu_cluster(4, 8, 4, 1);
    for name in ["node-00000", "node-00001"] {
        let mut n = cluster.node(name).unwrap().clone();
        n.taints.push(Taint {
            key: "maintenance".into(),
            value: "true".into(),
            effect: NodeTaintEffect::NoSchedule,
        });
        cluster.upsert_node(n);
    }
    let outcome = plan(&cluster, &gpu_gang("g", 2, 8, None, None), &PlanOptions::default());
    assert_eq!(placed(&outcome).nodes(), ["node-00002", "node-00003"]);
    let why = reasons(&plan(
        &cluster,
        &gpu_gang("g", 3, 8, None, None),
        &PlanOptions::default(),
    ));
    assert!(why.contains("2 untolerated taint maintenance=true:NoSchedule"), "{why}");
    let mut gang = gpu_gang("g", 3, 8, None, None);
    gang.groups[0].shape.tolerations.push(Toleration {
        key: "maintenance".into(),
        exists: true,
        value: String::new(),
        effect: None,
    });
    assert!(plan(&cluster, &gang, &PlanOptions::default()).plan().is_some());
    gang.groups[0]
        .shape
        .node_selector
        .insert("example.com/rack".into(), "rack-9999".into());
    let why = reasons(&plan(&cluster, &gang, &PlanOptions::default()));
    assert!(why.contains("4 node selector does not match"), "{why}");
}

#[test]
fn min_count_below_replicas_places_extras_that_fit() {
    let cluster = gpu_cluster(4, 8, 2, 2);
    let mut gang = gpu_gang("elastic", 3, 8, Some(RACK), None);
    gang.groups[0].min_count = 2;
    let plan = placed(&plan(&cluster, &gang, &PlanOptions::default())).clone();
    assert_eq!(plan.pods.len(), 2, "the rack holds two");
    assert_eq!(plan.unplaced, ["ns/elastic-workers-2"]);
    gang.topology.required = None;
    let plan = placed(&crate::placement::plan(&cluster, &gang, &PlanOptions::default())).clone();
    assert_eq!(plan.pods.len(), 3);
    assert!(plan.unplaced.is_empty());
}

#[test]
fn shared_claims_are_allocated_once_for_the_gang() {
    let mut cluster = gpu_cluster(4, 8, 4, 1);
    let mut fabric = node_slice("fabric", vec![gpu(0, "IMEX")]);
    fabric.nodes = crate::cluster::SliceNodes::All;
    fabric.driver = "imex.example.com".into();
    fabric.name = "fabric".into();
    cluster.upsert_slice(fabric);
    cluster.upsert_class(crate::cluster::DeviceClass {
        name: "imex.example.com".into(),
        selectors: vec!["device.driver == 'imex.example.com'".into()],
        config: vec![],
        extended_resource_name: None,
    });
    let mut gang = gpu_gang("g", 3, 8, None, None);
    let mut spec = gpu_claim(1);
    if let DeviceRequest::Exactly(r) = &mut spec.requests[0] {
        r.device_class_name = "imex.example.com".into();
    }
    gang.shared_claims.push(SharedClaim {
        key: "ns/g-fabric".into(),
        spec,
        allocation: None,
    });
    gang.groups[0].shape.shared.push(0);
    let plan = placed(&plan(&cluster, &gang, &PlanOptions::default())).clone();
    let fabric: Vec<_> = plan.claims.iter().filter(|c| c.claim == "ns/g-fabric").collect();
    assert_eq!(fabric.len(), 1, "allocated once");
    assert_eq!(plan.claims[0].claim, "ns/g-fabric", "shared claims first");
    assert_eq!(fabric[0].allocation.node_selector, None, "an all-nodes device");
    assert_eq!(plan.pods.len(), 3);
}

#[test]
fn the_same_input_gives_the_same_plan() {
    let mut cluster = gpu_cluster(32, 8, 4, 2);
    occupy(&mut cluster, "node-00005", 3);
    occupy(&mut cluster, "node-00013", 5);
    let gang = gpu_gang("g", 6, 4, Some(BLOCK), Some(RACK));
    let first = plan(&cluster, &gang, &PlanOptions::default());
    for _ in 0..3 {
        assert_eq!(plan(&cluster, &gang, &PlanOptions::default()), first);
    }
    // A fresh cluster state (no warm caches) gives the same plan too.
    let mut again = gpu_cluster(32, 8, 4, 2);
    occupy(&mut again, "node-00005", 3);
    occupy(&mut again, "node-00013", 5);
    assert_eq!(plan(&again, &gang, &PlanOptions::default()), first);
}

#[test]
fn copies_of_a_state_share_what_a_plan_learns_without_mistaking_one_for_another() {
    // Two nodes of 8 GPUs; a gang of 3 pods of 4 GPUs needs room on both.
    let base = gpu_cluster(2, 8, 2, 1);
    let gang = gpu_gang("g", 3, 4, None, None);
    let (mut full, mut busy) = (base.clone(), base.clone());
    // Each copy changes node-00000 once, differently: a pod takes every core of it in the
    // first, one core in the second.
    let cores = |n: i64| crate::resources::Resources {
        cpu_millis: n * 1000,
        ..Default::default()
    };
    full.upsert_pod(&"other/p".into(), "node-00000", cores(64));
    busy.upsert_pod(&"other/p".into(), "node-00000", cores(1));
    // Planned on the first copy, node-00000 is learned to have no room...
    reasons(&plan(&full, &gang, &PlanOptions::default()));
    // ...which the second copy, whose node-00000 still has room, must not take for its
    // own.
    let plan_busy = placed(&plan(&busy, &gang, &PlanOptions::default())).clone();
    let mut fresh = gpu_cluster(2, 8, 2, 1);
    fresh.upsert_pod(&"other/p".into(), "node-00000", cores(1));
    assert_eq!(plan_busy, placed(&plan(&fresh, &gang, &PlanOptions::default())).clone());
    // What a plan on a copy learned serves the state it was copied from.
    let snapshot = base.clone();
    placed(&plan(&snapshot, &gang, &PlanOptions::default()));
    assert!(!locked(&base.room_cache).is_empty(), "the copies share one room cache");
}

#[test]
fn gangs_that_differ_only_in_their_pods_labels_share_what_a_plan_learns_of_nodes() {
    let cluster = gpu_cluster(8, 8, 2, 2);
    let labelled = |name: &str| {
        let mut gang = gpu_gang(name, 2, 8, Some(RACK), None);
        gang.groups[0]
            .shape
            .rules
            .labels
            .insert("example.com/gang".into(), name.into());
        gang
    };
    let first = placed(&plan(&cluster, &labelled("a"), &PlanOptions::default())).clone();
    let second = placed(&plan(&cluster, &labelled("b"), &PlanOptions::default())).clone();
    assert_eq!(first.nodes(), second.nodes());
    assert_eq!(locked(&cluster.room_cache).len(), 1, "one pod shape for both gangs");
}

#[test]
fn bad_requests_are_reported_not_panicked() {
    let cluster = gpu_cluster(2, 8, 2, 1);
    let mut gang = gpu_gang("g", 1, 8, None, None);
    if let DeviceRequest::Exactly(r) = &mut gang.groups[0].shape.claims[0].requests[0] {
        r.device_class_name = "missing.example.com".into();
    }
    let why = reasons(&plan(&cluster, &gang, &PlanOptions::default()));
    assert!(
        why.contains("could not retrieve device class missing.example.com"),
        "{why}"
    );
    let mut gang = gpu_gang("g", 1, 8, None, None);
    gang.groups[0].min_count = 5;
    assert!(reasons(&plan(&cluster, &gang, &PlanOptions::default())).contains("minCount 5 exceeds its 1 pods"));
    let empty = crate::request::GangRequest {
        name: "ns/empty".into(),
        topology: TopologyRequest::default(),
        ..Default::default()
    };
    assert!(
        plan(&cluster, &empty, &PlanOptions::default())
            .plan()
            .is_some_and(|p| p.pods.is_empty())
    );
}

#[test]
fn an_assumed_plan_is_seen_by_the_next_plan() {
    let mut cluster = gpu_cluster(8, 8, 2, 2);
    let gang = gpu_gang("g", 2, 8, Some(RACK), None);
    let first = placed(&plan(&cluster, &gang, &PlanOptions::default())).clone();
    let (pods, claims) = first.assumption(&gang);
    cluster.assume(&PlanId::Gang("ns/g".into()), &pods, &claims);
    let second = placed(&plan(&cluster, &gang, &PlanOptions::default())).clone();
    assert_ne!(second.topology_value, first.topology_value, "the first rack is taken");
    let overlap: Vec<_> = all_devices(&second)
        .into_iter()
        .filter(|d| all_devices(&first).contains(d))
        .collect();
    assert!(overlap.is_empty(), "no device twice: {overlap:?}");
    cluster.forget(&PlanId::Gang("ns/g".into()));
    assert_eq!(
        placed(&plan(&cluster, &gang, &PlanOptions::default())),
        &first,
        "forgotten: the rack is free again"
    );
}

#[test]
fn excluded_nodes_are_not_used_and_the_reason_says_why() {
    let cluster = gpu_cluster(4, 8, 2, 2);
    let held: BTreeSet<String> = ["node-00000", "node-00001"].into_iter().map(String::from).collect();
    let options = PlanOptions {
        excluded_nodes: std::sync::Arc::new(held),
        ..PlanOptions::default()
    };
    let outcome = plan(&cluster, &gpu_gang("g", 2, 8, Some(RACK), None), &options);
    assert_eq!(placed(&outcome).nodes(), ["node-00002", "node-00003"]);
    let why = reasons(&plan(&cluster, &gpu_gang("g", 3, 8, None, None), &options));
    assert!(why.contains("held for a gang that has waited longest"), "{why}");
}

#[test]
fn a_required_value_keeps_the_plan_in_that_domain() {
    // 4 racks of 2 nodes; rack-0000 is the tightest, but only rack-0002 is allowed.
    let mut cluster = gpu_cluster(8, 8, 2, 2);
    occupy(&mut cluster, "node-00000", 4);
    let gang = gpu_gang("g", 2, 4, Some(RACK), None);
    let options = PlanOptions {
        required_value: Some("rack-0002".into()),
        ..PlanOptions::default()
    };
    let outcome = plan(&cluster, &gang, &options);
    assert_eq!(placed(&outcome).topology_value.as_deref(), Some("rack-0002"));
    let why = reasons(&plan(&cluster, &gpu_gang("g", 3, 8, Some(RACK), None), &options));
    assert!(why.contains("6 outside example.com/rack=rack-0002"), "{why}");
    // Without a required label there is one domain, and the value is ignored.
    assert!(
        plan(&cluster, &gpu_gang("g", 3, 8, None, None), &options)
            .plan()
            .is_some()
    );
}

#[test]
fn a_gang_reaches_only_the_nodes_it_could_use() {
    let mut cluster = gpu_cluster(4, 8, 2, 2);
    occupy(&mut cluster, "node-00003", 8);
    let gang = gpu_gang("g", 1, 8, Some(RACK), None);
    let now = reachable_nodes(&cluster, &gang, &PlanOptions::default());
    assert_eq!(
        now.iter().map(String::as_str).collect::<Vec<_>>(),
        ["node-00000", "node-00001", "node-00002"]
    );
    let ever = reachable_nodes(&cluster.emptied(), &gang, &PlanOptions::default());
    assert_eq!(ever.len(), 4);
    // A pod needing more GPUs than any node has reaches nothing.
    assert!(
        reachable_nodes(
            &cluster.emptied(),
            &gpu_gang("g", 1, 9, None, None),
            &PlanOptions::default()
        )
        .is_empty()
    );
}

/// Nodes whose GPUs a device plugin advertises (`nvidia.com/gpu` allocatable, no slices)
/// beside DRA nodes: gangs asking the device-plugin way land on the former, and one that
/// does not fit is explained in the resource it asked for.
#[test]
fn device_plugin_gpus_are_node_resources_beside_dra_devices() {
    let mut cluster = gpu_cluster(4, 8, 2, 2);
    for (i, rack) in [(0, "rack-dp-0"), (1, "rack-dp-0"), (2, "rack-dp-1")] {
        let mut dp = node(&format!("dp-{i}"), 64, 512, &[(RACK, rack)]);
        dp.allocatable.other.insert("nvidia.com/gpu".into(), 8);
        cluster.upsert_node(dp);
    }
    let plugin_pod = |gpus: i64| {
        let mut shape = gpu_pod(0, 16, 64);
        shape.claims.clear();
        shape.requests.other.insert("nvidia.com/gpu".into(), gpus);
        shape
    };
    let plugin_gang = |name: &str, pods: usize| GangRequest {
        name: name.into(),
        groups: vec![GroupRequest::uniform("workers", "ns", pods, pods, plugin_pod(8))],
        topology: TopologyRequest {
            required: Some(RACK.into()),
            preferred: None,
            ..Default::default()
        },
        ..GangRequest::default()
    };
    let outcome = plan(&cluster, &plugin_gang("plugin", 2), &PlanOptions::default());
    let plan_ = placed(&outcome);
    assert_eq!(plan_.nodes(), ["dp-0", "dp-1"]);
    assert!(
        plan_.claims.is_empty(),
        "no claims: the kubelet's device plugin assigns the GPUs"
    );

    // A mixed gang: DRA workers and device-plugin workers.
    let mut mixed = gpu_gang("mixed", 2, 8, None, None);
    mixed
        .groups
        .push(GroupRequest::uniform("plugin-workers", "ns", 1, 1, plugin_pod(8)));
    let outcome = plan(&cluster, &mixed, &PlanOptions::default());
    let plan_ = placed(&outcome);
    let plugin_nodes: Vec<&str> = plan_
        .pods
        .iter()
        .filter(|p| p.group == "plugin-workers")
        .map(|p| p.node.as_str())
        .collect();
    assert_eq!(plugin_nodes.len(), 1);
    assert!(plugin_nodes[0].starts_with("dp-"), "{plugin_nodes:?}");
    assert!(
        plan_
            .pods
            .iter()
            .filter(|p| p.group != "plugin-workers")
            .all(|p| p.node.starts_with("node-"))
    );

    // Three device-plugin pods do not fit in any rack; the reason names the GPUs.
    let why = reasons(&plan(&cluster, &plugin_gang("big", 3), &PlanOptions::default()));
    assert!(
        why.contains("group workers needs 3 pods (16 CPU, 65536Mi memory, 8 nvidia.com/gpu) in one example.com/rack"),
        "{why}"
    );
}

/// A cluster of nodes with 8 GPUs each, the models given per node (in device order).
fn cluster_of_models(nodes: &[&[&str]]) -> ClusterState {
    let mut cluster = ClusterState::new();
    cluster.upsert_class(gpu_class());
    for (i, models) in nodes.iter().enumerate() {
        let name = format!("node-{i:05}");
        cluster.upsert_node(node(&name, 64, 512, &[]));
        let devices = models.iter().enumerate().map(|(g, model)| gpu(g, model)).collect();
        cluster.upsert_slice(node_slice(&name, devices));
    }
    cluster
}

/// A group of `pods` pods with `gpus` GPUs each, of `model` only if given.
fn model_group(name: &str, pods: usize, gpus: u32, model: Option<&str>) -> GroupRequest {
    let mut shape = gpu_pod(gpus, 1, 1);
    if let (Some(model), DeviceRequest::Exactly(spec)) = (model, &mut shape.claims[0].requests[0]) {
        spec.selectors
            .push(format!("device.attributes['{GPU}'].model == '{model}'"));
    }
    GroupRequest::uniform(name, "ns", pods, pods, shape)
}

fn gang_of(groups: Vec<GroupRequest>) -> GangRequest {
    GangRequest {
        name: "ns/g".into(),
        groups,
        shared_claims: vec![],
        topology: TopologyRequest::default(),
    }
}

#[test]
fn a_broad_group_does_not_starve_a_narrow_one_on_the_same_node() {
    // Greedily, "any" (first in request order) takes the four A100s, and "a100" finds
    // none left although the H100s would have served "any".
    let cluster = cluster_of_models(&[&["A100", "A100", "A100", "A100", "H100", "H100", "H100", "H100"]]);
    let gang = gang_of(vec![
        model_group("any", 1, 4, None),
        model_group("a100", 1, 4, Some("A100")),
    ]);
    let outcome = plan(&cluster, &gang, &PlanOptions::default());
    let plan = placed(&outcome);
    assert_eq!(plan.pods.len(), 2);
    let devices = all_devices(plan);
    assert_eq!(devices.iter().collect::<BTreeSet<_>>().len(), 8, "no device twice");
    let a100 = plan.claims.iter().find(|c| c.claim.as_str().contains("a100")).unwrap();
    let names: Vec<&str> = a100.allocation.devices.iter().map(|d| d.device.as_str()).collect();
    assert_eq!(names, ["gpu-0", "gpu-1", "gpu-2", "gpu-3"], "the A100s");
}

#[test]
fn a_broad_group_does_not_take_the_only_node_a_narrow_one_can_use() {
    let cluster = cluster_of_models(&[&["A100"; 8], &["H100"; 8]]);
    let gang = gang_of(vec![
        model_group("any", 1, 8, None),
        model_group("a100", 1, 8, Some("A100")),
    ]);
    let plan = placed(&plan(&cluster, &gang, &PlanOptions::default())).clone();
    let node_of = |group: &str| plan.pods.iter().find(|p| p.group == group).unwrap().node.clone();
    assert_eq!(node_of("a100"), "node-00000");
    assert_eq!(node_of("any"), "node-00001");
}

#[test]
fn a_spent_backtracking_budget_is_reported_as_such_not_as_no_fit() {
    let cluster = cluster_of_models(&[&["A100", "A100", "A100", "A100", "H100", "H100", "H100", "H100"]]);
    let gang = gang_of(vec![
        model_group("any", 1, 4, None),
        model_group("a100", 1, 4, Some("A100")),
    ]);
    let options = PlanOptions {
        backtrack_budget: 1,
        ..PlanOptions::default()
    };
    let why = reasons(&plan(&cluster, &gang, &options));
    assert!(why.contains("search budget exhausted"), "{why}");
    assert!(!why.contains("does not fit"), "{why}");

    let off = PlanOptions {
        backtrack_budget: 0,
        ..PlanOptions::default()
    };
    let why = reasons(&plan(&cluster, &gang, &off));
    assert!(
        why.contains("does not fit"),
        "without backtracking, first fit decides: {why}"
    );
}

#[test]
fn a_gang_that_cannot_fit_any_way_is_still_reported_as_not_fitting() {
    // Each group alone fits the node, so the bounds allow the gang; ten GPUs on eight
    // do not.
    let cluster = cluster_of_models(&[&["A100", "A100", "A100", "A100", "H100", "H100", "H100", "H100"]]);
    let gang = gang_of(vec![
        model_group("any", 1, 6, None),
        model_group("a100", 1, 4, Some("A100")),
    ]);
    let why = reasons(&plan(&cluster, &gang, &PlanOptions::default()));
    assert!(why.contains("does not fit"), "{why}");
    assert!(why.contains("no other choice of nodes and devices"), "{why}");
}

const NVLINK: &str = "example.com/nvlink-domain";
const HOSTNAME: &str = "kubernetes.io/hostname";

/// A node's name, its free GPUs of 8 (the others taken by a claim outside the gang), and
/// its labels.
type FreeNode<'a> = (&'a str, usize, &'a [(&'a str, &'a str)]);

fn cluster_with_free(nodes: &[FreeNode<'_>]) -> ClusterState {
    let mut cluster = ClusterState::new();
    cluster.upsert_class(gpu_class());
    for (name, free, labels) in nodes {
        let mut labels = labels.to_vec();
        labels.push((HOSTNAME, name));
        cluster.upsert_node(node(name, 64, 512, &labels));
        cluster.upsert_slice(node_slice(name, (0..8).map(|g| gpu(g, "H100")).collect()));
        occupy(&mut cluster, name, 8 - free);
    }
    cluster
}

#[test]
fn a_finer_preferred_level_packs_the_gang_onto_one_node() {
    // Tightest first would take the two half-full nodes; the hostname level prefers the
    // one node that holds the whole gang.
    let cluster = cluster_with_free(&[
        ("node-a", 4, &[(RACK, "r0")]),
        ("node-b", 4, &[(RACK, "r0")]),
        ("node-c", 8, &[(RACK, "r0")]),
    ]);
    let mut gang = gpu_gang("g", 2, 4, None, Some(RACK));
    let spread = plan(&cluster, &gang, &PlanOptions::default());
    assert_eq!(placed(&spread).nodes(), ["node-a", "node-b"]);

    gang.topology.preferred_levels = vec![HOSTNAME.into()];
    let packed = plan(&cluster, &gang, &PlanOptions::default());
    let packed = placed(&packed);
    assert_eq!(packed.nodes(), ["node-c"]);
    assert_eq!(packed.preferred_values, ["r0"]);
    assert_eq!(
        packed.preferred_levels,
        [LevelValues {
            key: HOSTNAME.into(),
            values: vec!["node-c".into()]
        }]
    );
}

#[test]
fn the_finest_preferred_level_that_holds_the_gang_wins() {
    // Rack r0 is the tighter rack, but only r1 has one NVLink domain for the whole gang.
    let cluster = cluster_with_free(&[
        ("a-0", 4, &[(RACK, "r0"), (NVLINK, "n0")]),
        ("a-1", 4, &[(RACK, "r0"), (NVLINK, "n1")]),
        ("b-0", 8, &[(RACK, "r1"), (NVLINK, "n2")]),
        ("b-1", 8, &[(RACK, "r1"), (NVLINK, "n3")]),
    ]);
    let mut gang = gpu_gang("g", 2, 4, None, Some(RACK));
    assert_eq!(
        placed(&plan(&cluster, &gang, &PlanOptions::default())).nodes(),
        ["a-0", "a-1"]
    );
    gang.topology.preferred_levels = vec![NVLINK.into()];
    let outcome = plan(&cluster, &gang, &PlanOptions::default());
    let plan_ = placed(&outcome);
    assert_eq!(
        plan_
            .pods
            .iter()
            .map(|p| p.node.as_str())
            .collect::<BTreeSet<_>>()
            .len(),
        1
    );
    assert_eq!(plan_.preferred_levels[0].values.len(), 1, "{plan_:?}");
}

fn launcher_and_workers(workers: usize, required: Option<&str>, slice: Option<usize>) -> GangRequest {
    let mut gang = gang_of(vec![
        GroupRequest::uniform("launcher", "ns", 1, 1, gpu_pod(0, 1, 1)),
        GroupRequest::uniform("workers", "ns", workers, workers, gpu_pod(4, 1, 1)),
    ]);
    gang.groups[1].topology = crate::request::GroupTopology {
        required: required.map(Into::into),
        slice: slice.map(|size| crate::request::SliceRequest {
            key: NVLINK.into(),
            size,
        }),
    };
    gang
}

#[test]
fn a_group_keeps_to_one_value_of_its_own_level_and_others_go_anywhere() {
    let cluster = cluster_with_free(&[
        ("a-0", 8, &[(RACK, "r0")]),
        ("b-0", 4, &[(RACK, "r1")]),
        ("b-1", 4, &[(RACK, "r1")]),
        ("b-2", 8, &[(RACK, "r1")]),
        ("c-0", 0, &[]),
    ]);
    let gang = launcher_and_workers(4, Some(RACK), None);
    let outcome = plan(&cluster, &gang, &PlanOptions::default());
    let plan_ = placed(&outcome);
    let workers: BTreeSet<&str> = plan_
        .pods
        .iter()
        .filter(|p| p.group == "workers")
        .map(|p| p.node.as_str())
        .collect();
    assert_eq!(workers, BTreeSet::from(["b-0", "b-1", "b-2"]), "{plan_:?}");
    assert_eq!(
        plan_.group_topology,
        [GroupPlacement {
            group: "workers".into(),
            required: Some((RACK.into(), "r1".into())),
            slices: None,
        }]
    );

    // Five workers fit in the cluster (6 by GPUs) but in no single rack.
    let outcome = plan(
        &cluster,
        &launcher_and_workers(5, Some(RACK), None),
        &PlanOptions::default(),
    );
    let Outcome::Unschedulable(why) = outcome else {
        panic!("placed across racks: {outcome:?}")
    };
    assert!(
        why.reasons[0].contains("group workers needs 5 pods")
            && why.reasons[0].contains(&format!("all in one {RACK}"))
            && why.reasons[0].contains("room for 4")
            && why.reasons[0].contains("when placed so (6 without the group's levels)"),
        "{why}"
    );
}

#[test]
fn slices_each_keep_to_one_value_of_their_level() {
    // Alternating domains in name order: first fit alone would split every slice.
    let cluster = cluster_with_free(&[
        ("n-0", 4, &[(NVLINK, "x")]),
        ("n-1", 4, &[(NVLINK, "y")]),
        ("n-2", 4, &[(NVLINK, "x")]),
        ("n-3", 4, &[(NVLINK, "y")]),
    ]);
    let gang = launcher_and_workers(4, None, Some(2));
    let outcome = plan(&cluster, &gang, &PlanOptions::default());
    let plan_ = placed(&outcome);
    let node_of = |pod: &str| &plan_.pods.iter().find(|p| p.pod.name() == pod).expect("placed").node;
    let domain = |node: &str| if ["n-0", "n-2"].contains(&node) { "x" } else { "y" };
    assert_eq!(domain(node_of("workers-0")), domain(node_of("workers-1")), "{plan_:?}");
    assert_eq!(domain(node_of("workers-2")), domain(node_of("workers-3")), "{plan_:?}");
    let slices = &plan_.group_topology[0].slices.as_ref().expect("slices").1;
    assert_eq!(slices.len(), 2);

    // Slices of 3: no NVLink domain has room for one.
    let outcome = plan(
        &cluster,
        &launcher_and_workers(3, None, Some(3)),
        &PlanOptions::default(),
    );
    let Outcome::Unschedulable(why) = outcome else {
        panic!("placed a slice across domains: {outcome:?}")
    };
    assert!(
        why.reasons[0].contains(&format!("in slices of 3 each in one {NVLINK}"))
            && why.reasons[0].contains("room for 0 when placed so (4 without the group's levels)"),
        "{why}"
    );
}

#[test]
fn slices_stay_inside_the_groups_own_level() {
    // Two racks, each with two NVLink domains of one free pod each: two slices of one pod
    // fit in either rack, but slices of the workers' own rack only there.
    let cluster = cluster_with_free(&[
        ("a-0", 4, &[(RACK, "r0"), (NVLINK, "n0")]),
        ("a-1", 4, &[(RACK, "r0"), (NVLINK, "n1")]),
        ("b-0", 8, &[(RACK, "r1"), (NVLINK, "n2")]),
        ("b-1", 0, &[(RACK, "r1"), (NVLINK, "n3")]),
    ]);
    let outcome = plan(
        &cluster,
        &launcher_and_workers(2, Some(RACK), Some(1)),
        &PlanOptions::default(),
    );
    let plan_ = placed(&outcome);
    let group = &plan_.group_topology[0];
    let rack = &group.required.as_ref().expect("a rack").1;
    let workers: BTreeSet<&str> = plan_
        .pods
        .iter()
        .filter(|p| p.group == "workers")
        .map(|p| p.node.as_str())
        .collect();
    match rack.as_str() {
        "r0" => assert_eq!(workers, BTreeSet::from(["a-0", "a-1"])),
        _ => assert_eq!(workers, BTreeSet::from(["b-0"])),
    }
}

/// 40 one-GPU workers in one rack, and 40 pods pinned to rack r0 of two 40-GPU racks:
/// first fit puts the workers in r0 (the tie goes by name), and the search must move
/// them to r1.
fn workers_and_pinned(pods: usize, nodes_per_rack: usize) -> (ClusterState, GangRequest) {
    let mut cluster = ClusterState::new();
    cluster.upsert_class(gpu_class());
    for i in 0..2 * nodes_per_rack {
        let name = format!("node-{i:03}");
        let rack = if i < nodes_per_rack { "r0" } else { "r1" };
        cluster.upsert_node(node(&name, 64, 512, &[(RACK, rack)]));
        cluster.upsert_slice(node_slice(&name, (0..8).map(|g| gpu(g, "H100")).collect()));
    }
    let mut workers = GroupRequest::uniform("workers", "ns", pods, pods, gpu_pod(1, 1, 1));
    workers.topology.required = Some(RACK.into());
    let mut pinned_shape = gpu_pod(1, 1, 1);
    pinned_shape.node_selector.insert(RACK.into(), "r0".into());
    let pinned = GroupRequest::uniform("pinned", "ns", pods, pods, pinned_shape);
    (cluster, gang_of(vec![workers, pinned]))
}

#[test]
fn the_search_moves_a_group_to_another_value_of_its_level() {
    let (cluster, gang) = workers_and_pinned(40, 5);
    let outcome = plan(&cluster, &gang, &PlanOptions::default());
    let plan_ = placed(&outcome);
    assert!(
        plan_
            .pods
            .iter()
            .filter(|p| p.group == "workers")
            .all(|p| cluster.node(&p.node).expect("a node").labels[RACK] == "r1"),
        "{plan_:?}"
    );
}

#[test]
fn extras_of_a_group_without_required_pods_keep_to_one_value() {
    let cluster = cluster_with_free(&[("a", 8, &[(RACK, "r0")]), ("b", 8, &[(RACK, "r1")])]);
    let mut gang = gpu_gang("g", 2, 8, None, None);
    gang.groups[0].min_count = 0;
    gang.groups[0].topology.required = Some(RACK.into());
    let outcome = plan(&cluster, &gang, &PlanOptions::default());
    let plan_ = placed(&outcome);
    assert_eq!(plan_.pods.len(), 1, "one extra fits in one rack: {plan_:?}");
    assert_eq!(plan_.unplaced.len(), 1);
}

/// The places a plan gave its pods, for the same pods under `gang`'s keys.
fn places_of(plan: &Plan, gang: &GangRequest) -> PreviousPlaces {
    let claims_of = |pod: &PodKey| -> BTreeSet<DeviceId> {
        let instance = gang
            .groups
            .iter()
            .flat_map(|g| &g.pods)
            .find(|p| p.key == *pod)
            .unwrap();
        plan.claims
            .iter()
            .filter(|c| instance.claims.iter().any(|own| own.key == c.claim))
            .flat_map(|c| c.allocation.devices.iter().map(DeviceResult::device_id))
            .collect()
    };
    plan.pods
        .iter()
        .map(|p| {
            let place = PreviousPlace {
                node: p.node.clone(),
                devices: claims_of(&p.pod),
            };
            (p.pod.clone(), place)
        })
        .collect()
}

#[test]
fn replacements_go_back_onto_their_predecessors_devices_when_they_are_free() {
    // 4 nodes, 8 GPUs each; pods of 4 GPUs, so a fresh plan would pack the first node.
    let mut cluster = gpu_cluster(4, 8, 2, 2);
    let gang = gpu_gang("g", 2, 4, Some(RACK), None);
    // The predecessors ran on node 3 and node 2, on their last GPUs.
    let mut previous = PreviousPlaces::new();
    for (pod, node) in gang.groups[0].pods.iter().zip(["node-00003", "node-00002"]) {
        let devices = (4..8)
            .map(|i| DeviceId {
                driver: "gpu.example.com".into(),
                pool: node.into(),
                device: format!("gpu-{i}"),
            })
            .collect();
        previous.insert(
            pod.key.clone(),
            PreviousPlace {
                node: node.into(),
                devices,
            },
        );
    }
    let options = PlanOptions {
        previous: Arc::new(previous.clone()),
        ..PlanOptions::default()
    };
    let back = placed(&plan(&cluster, &gang, &options)).clone();
    assert_eq!(
        places_of(&back, &gang),
        previous,
        "each pod back on its node and devices"
    );
    assert_eq!(back.topology_value.as_deref(), Some("rack-0001"));

    // Without the places, the same gang is packed as usual.
    let fresh = placed(&plan_fresh(&cluster, &gang)).clone();
    assert_ne!(places_of(&fresh, &gang), previous);

    // One device of a predecessor taken meanwhile: planned afresh, never half back.
    cluster.set_claim_allocation(
        &"other/taken".into(),
        Some(vec![device_result("x", "node-00002", "gpu-5")]),
    );
    let afresh = placed(&plan(&cluster, &gang, &options)).clone();
    assert!(
        all_devices(&afresh)
            .iter()
            .all(|d| !(d.pool == "node-00002" && d.device == "gpu-5")),
        "the taken device is not given twice"
    );
    assert_ne!(places_of(&afresh, &gang), previous);
}

#[test]
fn replacements_are_not_put_back_across_a_required_level_that_changed() {
    let mut cluster = gpu_cluster(4, 8, 2, 2);
    let gang = gpu_gang("g", 2, 8, Some(RACK), None);
    let first = placed(&plan_fresh(&cluster, &gang)).clone();
    let previous = places_of(&first, &gang);
    assert_ne!(first.pods[0].node, first.pods[1].node);
    // The second node moved to another rack while its pod was away.
    let moved = first.pods[1].node.clone();
    let mut node = cluster.node(&moved).unwrap().clone();
    node.labels.insert(RACK.into(), "rack-9999".into());
    cluster.upsert_node(node);
    let options = PlanOptions {
        previous: Arc::new(previous.clone()),
        ..PlanOptions::default()
    };
    let again = placed(&plan(&cluster, &gang, &options)).clone();
    let values: BTreeSet<_> = again
        .pods
        .iter()
        .map(|p| cluster.node(&p.node).unwrap().labels.get(RACK).cloned())
        .collect();
    assert_eq!(values.len(), 1, "one rack: {:?}", again.pods);
    assert_ne!(places_of(&again, &gang), previous);
}

fn plan_fresh(cluster: &ClusterState, gang: &GangRequest) -> Outcome {
    plan(cluster, gang, &PlanOptions::default())
}
