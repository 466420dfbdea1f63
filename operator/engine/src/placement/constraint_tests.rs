//! Inter-pod affinity, topology spread, host ports and volumes in gang plans.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::tests::{placed, reasons};
use super::*;
use crate::cluster::{PlanId, PodEntry};
use crate::fixtures::*;
use crate::key::ObjectKey;
use crate::labels::LabelSelector;
use crate::pod::{HostPort, PodRules, PodTraits, SpreadConstraint, WeightedTerm, WhenUnsatisfiable};
use crate::request::{GroupRequest, TopologyRequest};
use crate::storage::{AccessModes, CsiNode};

const RACK: &str = "example.com/rack";

/// `pods` CPU-only pods labelled `app=worker` in one group of gang `ns/g`.
fn workers(pods: usize, rules: PodRules) -> GangRequest {
    let mut shape = gpu_pod(0, 4, 16);
    shape.rules = PodRules {
        labels: [("app".to_string(), "worker".to_string())].into(),
        ..rules
    };
    GangRequest {
        name: "ns/g".into(),
        groups: vec![GroupRequest::uniform("worker", "ns", pods, pods, shape)],
        ..GangRequest::default()
    }
}

fn one_per_node() -> PodRules {
    PodRules {
        anti_affinity: vec![term(HOSTNAME, &[("app", "worker")])],
        ..PodRules::default()
    }
}

/// Gives node `i` the zone `zones[i % zones.len()]`.
fn zoned(mut cluster: ClusterState, zones: &[&str]) -> ClusterState {
    let nodes: Vec<Node> = cluster.nodes().cloned().collect();
    for (i, mut node) in nodes.into_iter().enumerate() {
        node.labels.insert(ZONE.into(), zones[i % zones.len()].into());
        cluster.upsert_node(node);
    }
    cluster
}

/// A running pod `other/<name>` on `node` with `labels` and `traits`.
fn run_pod(cluster: &mut ClusterState, name: &str, node: &str, traits: PodTraits) {
    cluster.place_pod(
        &PodKey::new("ns", name),
        PodEntry {
            node: node.into(),
            requests: gpu_pod(0, 1, 1).requests,
            traits: Arc::new(traits),
        },
    );
}

fn labelled(pairs: &[(&str, &str)]) -> PodTraits {
    PodTraits {
        labels: pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        ..PodTraits::default()
    }
}

#[test]
fn one_per_node_anti_affinity_spreads_the_gang_and_explains_with_numbers() {
    // 4 nodes per rack, room for 16 CPU-only pods each.
    let cluster = gpu_cluster(8, 0, 4, 2);
    let mut gang = workers(4, one_per_node());
    gang.topology.required = Some(RACK.into());
    let first = placed(&plan(&cluster, &gang, &PlanOptions::default())).clone();
    assert_eq!(first.nodes().len(), 4, "one pod per node: {:?}", first.pods);

    let gang = {
        let mut g = workers(5, one_per_node());
        g.topology.required = Some(RACK.into());
        g
    };
    let why = reasons(&plan(&cluster, &gang, &PlanOptions::default()));
    assert!(
        why.contains(
            "the best, rack-0000, has room for 4: 4 nodes there have room for 20 pods, but anti-affinity on kubernetes.io/hostname leaves 4 for 5 pods of group worker"
        ),
        "{why}"
    );
}

#[test]
fn anti_affinity_on_a_coarser_key_allows_one_pod_per_value() {
    let cluster = gpu_cluster(8, 0, 2, 2);
    let rules = PodRules {
        anti_affinity: vec![term(RACK, &[("app", "worker")])],
        ..PodRules::default()
    };
    let plan = placed(&plan(&cluster, &workers(4, rules.clone()), &PlanOptions::default())).clone();
    let racks: BTreeSet<String> = plan
        .pods
        .iter()
        .map(|p| cluster.node(&p.node).unwrap().labels[RACK].clone())
        .collect();
    assert_eq!(racks.len(), 4, "{:?}", plan.pods);
    let why = reasons(&plan_of(&cluster, &workers(5, rules)));
    assert!(
        why.contains("anti-affinity on example.com/rack leaves 4 for 5 pods"),
        "{why}"
    );
}

fn plan_of(cluster: &ClusterState, gang: &GangRequest) -> Outcome {
    plan(cluster, gang, &PlanOptions::default())
}

#[test]
fn running_pods_repel_and_are_repelled() {
    let mut cluster = gpu_cluster(3, 0, 3, 1);
    // A running worker on node 0: the gang's anti-affinity keeps off that node.
    run_pod(&mut cluster, "old-worker", "node-00000", labelled(&[("app", "worker")]));
    // A running pod whose own anti-affinity selects workers keeps them off node 1.
    run_pod(
        &mut cluster,
        "loner",
        "node-00001",
        PodTraits {
            anti_affinity: vec![term(HOSTNAME, &[("app", "worker")])],
            ..PodTraits::default()
        },
    );
    let outcome = plan_of(&cluster, &workers(1, one_per_node()));
    assert_eq!(placed(&outcome).nodes(), ["node-00002"]);
    let why = reasons(&plan_of(&cluster, &workers(2, one_per_node())));
    assert!(
        why.contains("1 anti-affinity on kubernetes.io/hostname with running pods"),
        "{why}"
    );
    assert!(
        why.contains("1 anti-affinity of running pods on kubernetes.io/hostname"),
        "{why}"
    );
}

#[test]
fn the_launcher_goes_to_the_rack_of_the_workers() {
    let cluster = gpu_cluster(8, 8, 2, 4);
    let mut gang = gpu_gang("job", 2, 8, None, None);
    gang.groups[0].shape.rules.labels = [("role".to_string(), "worker".to_string())].into();
    let mut launcher = gpu_pod(0, 2, 4);
    launcher.rules = PodRules {
        labels: [("role".to_string(), "launcher".to_string())].into(),
        affinity: vec![term(RACK, &[("role", "worker")])],
        ..PodRules::default()
    };
    // The launcher comes first in the request; its affinity is met by the workers only.
    gang.groups
        .insert(0, GroupRequest::uniform("launcher", "ns", 1, 1, launcher));
    let outcome = plan_of(&cluster, &gang);
    let plan = placed(&outcome);
    let rack_of = |node: &str| cluster.node(node).unwrap().labels[RACK].clone();
    let worker_racks: BTreeSet<String> = plan
        .pods
        .iter()
        .filter(|p| p.group != "launcher")
        .map(|p| rack_of(&p.node))
        .collect();
    let launcher = plan.pods.iter().find(|p| p.group == "launcher").unwrap();
    assert!(worker_racks.contains(&rack_of(&launcher.node)), "{:?}", plan.pods);
}

/// Whether kube-scheduler takes every pod of `plan` on its node when they bind in
/// `order`, for a required affinity on `key` that `affine` pods have and `matching`
/// pods match (the affine ones among them): a pod of such a term may go anywhere only
/// while no pod it selects is bound, else it needs one in its domain.
fn binds_in_order(cluster: &ClusterState, plan: &Plan, order: &[usize], affine: &str, key: &str) -> bool {
    let domain = |i: usize| cluster.node(&plan.pods[i].node).unwrap().labels.get(key).cloned();
    let mut bound: Vec<usize> = Vec::new();
    for &i in order {
        if plan.pods[i].group == affine && !bound.is_empty() && !bound.iter().any(|b| domain(*b) == domain(i)) {
            return false;
        }
        bound.push(i);
    }
    true
}

fn orders(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    let mut all = Vec::new();
    for order in orders(n - 1) {
        for at in 0..=order.len() {
            let mut next = order.clone();
            next.insert(at, n - 1);
            all.push(next);
        }
    }
    all
}

/// Issue 36, item 3: workers "in the rack of job=x", labelled job=x themselves, and a
/// launcher labelled job=x too. kube-scheduler lets the first worker go anywhere only
/// while no job=x pod is bound: the launcher must share the workers' rack, or a launcher
/// bound first would keep the workers off their planned rack for good.
#[test]
fn pods_a_self_matching_affinity_selects_share_its_domain_in_any_bind_order() {
    let mut cluster = gpu_cluster(8, 8, 4, 2);
    // The launcher fits tightest in rack-0000, where the workers may not go.
    for node in ["node-00000", "node-00001", "node-00002", "node-00003"] {
        let mut busy = labelled(&[("app", "busy")]);
        busy.labels.insert("on".into(), node.into());
        cluster.place_pod(
            &PodKey::new("ns", &format!("busy-{node}")),
            PodEntry {
                node: node.into(),
                requests: gpu_pod(0, 60, 1).requests,
                traits: Arc::new(busy),
            },
        );
    }
    let job = [("job", "x")];
    let mut gang = gpu_gang("job", 2, 8, None, None);
    gang.groups[0].shape.rules.labels = [("job".to_string(), "x".to_string())].into();
    gang.groups[0].shape.rules.affinity = vec![term(RACK, &job)];
    gang.groups[0].shape.node_selector = [(RACK.to_string(), "rack-0001".to_string())].into();
    let mut launcher = gpu_pod(0, 2, 4);
    launcher.rules.labels = [("job".to_string(), "x".to_string())].into();
    gang.groups
        .push(GroupRequest::uniform("launcher", "ns", 1, 1, launcher));
    let plan = placed(&plan_of(&cluster, &gang)).clone();
    let racks: BTreeSet<String> = plan
        .pods
        .iter()
        .map(|p| cluster.node(&p.node).unwrap().labels[RACK].clone())
        .collect();
    assert_eq!(racks, BTreeSet::from(["rack-0001".to_string()]), "{:?}", plan.pods);
    let affine = &gang.groups[0].name;
    for order in orders(plan.pods.len()) {
        assert!(
            binds_in_order(&cluster, &plan, &order, affine, RACK),
            "refused in order {order:?}"
        );
    }
    // The check itself tells a bad plan: the launcher in rack-0000.
    let mut apart = plan.clone();
    let launcher = apart.pods.iter_mut().find(|p| p.group == "launcher").unwrap();
    launcher.node = "node-00000".into();
    let launcher_at = apart.pods.iter().position(|p| p.group == "launcher").unwrap();
    let mut first = vec![launcher_at];
    first.extend((0..apart.pods.len()).filter(|i| *i != launcher_at));
    assert!(!binds_in_order(&cluster, &apart, &first, affine, RACK));
}

#[test]
fn affinity_to_a_running_pod_picks_its_domain_and_nothing_else() {
    let mut cluster = gpu_cluster(8, 0, 2, 4);
    run_pod(&mut cluster, "cache", "node-00005", labelled(&[("app", "cache")]));
    let rules = PodRules {
        affinity: vec![term(RACK, &[("app", "cache")])],
        ..PodRules::default()
    };
    let plan = placed(&plan_of(&cluster, &workers(2, rules.clone()))).clone();
    for pod in &plan.pods {
        assert_eq!(cluster.node(&pod.node).unwrap().labels[RACK], "rack-0002");
    }
    let why = reasons(&plan_of(&cluster, &workers(40, rules)));
    assert!(
        why.contains("6 pod affinity on example.com/rack: no matching pod there"),
        "{why}"
    );
    // Nothing matches anywhere, and the pods do not match themselves.
    let lonely = PodRules {
        affinity: vec![term(RACK, &[("app", "nobody")])],
        ..PodRules::default()
    };
    let why = reasons(&plan_of(&cluster, &workers(1, lonely)));
    assert!(why.contains("its pod affinity finds no matching pod"), "{why}");
}

fn spread(key: &str, max_skew: i32, min_domains: i32) -> SpreadConstraint {
    SpreadConstraint {
        max_skew,
        topology_key: key.into(),
        when_unsatisfiable: WhenUnsatisfiable::DoNotSchedule,
        selector: LabelSelector::of_labels(&[("app", "worker")]),
        min_domains,
        honor_node_affinity: true,
        honor_node_taints: false,
    }
}

fn zones_of(cluster: &ClusterState, plan: &Plan) -> BTreeMap<String, usize> {
    let mut zones = BTreeMap::new();
    for pod in &plan.pods {
        *zones
            .entry(cluster.node(&pod.node).unwrap().labels[ZONE].clone())
            .or_default() += 1;
    }
    zones
}

#[test]
fn spread_over_zones_counts_running_pods_and_the_gangs_own() {
    let mut cluster = zoned(gpu_cluster(4, 0, 4, 1), &["a", "b"]);
    let rules = PodRules {
        spread: vec![spread(ZONE, 1, 1)],
        ..PodRules::default()
    };
    let plan = placed(&plan_of(&cluster, &workers(4, rules.clone()))).clone();
    assert_eq!(zones_of(&cluster, &plan), [("a".into(), 2), ("b".into(), 2)].into());
    // Two workers already run in zone a: a gang of two goes to zone b.
    run_pod(&mut cluster, "w1", "node-00000", labelled(&[("app", "worker")]));
    run_pod(&mut cluster, "w2", "node-00002", labelled(&[("app", "worker")]));
    let plan = placed(&plan_of(&cluster, &workers(2, rules.clone()))).clone();
    assert_eq!(zones_of(&cluster, &plan), [("b".into(), 2)].into());
    // Zone b cordoned: it still counts as a domain, so zone a cannot take a third.
    for name in ["node-00001", "node-00003"] {
        let mut node = cluster.node(name).unwrap().clone();
        node.unschedulable = true;
        cluster.upsert_node(node);
    }
    let why = reasons(&plan_of(&cluster, &workers(1, rules)));
    assert!(
        why.contains(
            "topology spread on topology.kubernetes.io/zone: 2 matching pods in a, 0 in the emptiest domain, maxSkew 1"
        ),
        "{why}"
    );
}

#[test]
fn min_domains_above_the_domains_there_are_counts_the_emptiest_as_zero() {
    let cluster = zoned(gpu_cluster(4, 0, 4, 1), &["a", "b"]);
    // Three domains wanted, two exist: every zone stays at maxSkew (2) pods or fewer.
    let rules = PodRules {
        spread: vec![spread(ZONE, 2, 3)],
        ..PodRules::default()
    };
    let plan = placed(&plan_of(&cluster, &workers(4, rules.clone()))).clone();
    assert_eq!(zones_of(&cluster, &plan), [("a".into(), 2), ("b".into(), 2)].into());
    assert!(reasons(&plan_of(&cluster, &workers(5, rules))).contains("topology spread"));
}

#[test]
fn schedule_anyway_is_a_hint_not_a_filter() {
    let mut cluster = zoned(gpu_cluster(4, 0, 4, 1), &["a", "b"]);
    run_pod(&mut cluster, "w1", "node-00000", labelled(&[("app", "worker")]));
    let mut soft = spread(ZONE, 1, 1);
    soft.when_unsatisfiable = WhenUnsatisfiable::ScheduleAnyway;
    let rules = PodRules {
        spread: vec![soft],
        ..PodRules::default()
    };
    let plan = placed(&plan_of(&cluster, &workers(1, rules.clone()))).clone();
    assert_eq!(
        zones_of(&cluster, &plan),
        [("b".into(), 1)].into(),
        "the emptier zone first"
    );
    placed(&plan_of(&cluster, &workers(30, rules)));
}

#[test]
fn preferred_affinity_orders_nodes() {
    let mut cluster = gpu_cluster(4, 0, 1, 4);
    run_pod(&mut cluster, "cache", "node-00003", labelled(&[("app", "cache")]));
    let rules = PodRules {
        preferred_affinity: vec![WeightedTerm {
            weight: 50,
            term: term(HOSTNAME, &[("app", "cache")]),
        }],
        ..PodRules::default()
    };
    assert_eq!(placed(&plan_of(&cluster, &workers(1, rules))).nodes(), ["node-00003"]);
}

#[test]
fn host_ports_keep_off_nodes_using_them_and_one_pod_per_node() {
    let mut cluster = gpu_cluster(3, 0, 3, 1);
    run_pod(
        &mut cluster,
        "web",
        "node-00001",
        PodTraits {
            host_ports: vec![HostPort::new("", "TCP", 8080)],
            ..PodTraits::default()
        },
    );
    let rules = PodRules {
        host_ports: vec![HostPort::new("", "", 8080)],
        ..PodRules::default()
    };
    let plan = placed(&plan_of(&cluster, &workers(2, rules.clone()))).clone();
    assert_eq!(plan.nodes(), ["node-00000", "node-00002"]);
    let why = reasons(&plan_of(&cluster, &workers(3, rules)));
    assert!(why.contains("1 host port 8080/TCP in use"), "{why}");
    assert!(why.contains("host port 8080/TCP leaves 2 for 3 pods"), "{why}");
}

#[test]
fn a_bound_zonal_volume_pins_its_pod_to_the_zone() {
    let mut cluster = zoned(gpu_cluster(4, 0, 4, 1), &["a", "b"]);
    cluster.storage_mut().upsert_class(local_class("zonal", false));
    let mut gang = workers(2, PodRules::default());
    for (i, pod) in gang.groups[0].pods.iter_mut().enumerate() {
        let mut claim = volume_claim("ns", &format!("data-{i}"), "zonal", "10Gi");
        let mut pv = volume(&format!("pv-{i}"), "zonal", "10Gi", ZONE, "b");
        pv.labels.insert(ZONE.into(), "b".into());
        bind(&mut claim, &mut pv);
        pod.volumes.push(claim.key.clone());
        cluster.storage_mut().upsert_claim(claim);
        cluster.storage_mut().upsert_volume(pv);
    }
    let plan = placed(&plan_of(&cluster, &gang)).clone();
    assert_eq!(zones_of(&cluster, &plan), [("b".into(), 2)].into());
}

#[test]
fn late_binding_claims_get_distinct_volumes_and_run_out_with_numbers() {
    let mut cluster = zoned(gpu_cluster(8, 0, 4, 2), &["a", "b"]);
    cluster.storage_mut().upsert_class(local_class("local", true));
    // Three volumes in zone a, one in b.
    for (i, zone) in ["a", "a", "a", "b"].iter().enumerate() {
        cluster
            .storage_mut()
            .upsert_volume(volume(&format!("pv-{i}"), "local", "100Gi", ZONE, zone));
    }
    let mut gang = workers(3, PodRules::default());
    gang.topology.required = Some(ZONE.into());
    with_volume_per_pod(&mut cluster, &mut gang, "local", "50Gi");
    let plan = placed(&plan_of(&cluster, &gang)).clone();
    assert_eq!(zones_of(&cluster, &plan), [("a".into(), 3)].into());
    let (pods, claims) = plan.assumption(&gang);
    let volumes: BTreeSet<_> = pods.iter().map(|p| p.traits.volumes.clone()).collect();
    assert_eq!(volumes.len(), 3, "each pod has its own claim");
    let chosen: BTreeSet<&str> = plan.volumes.iter().map(|v| v.volume.as_str()).collect();
    assert_eq!(chosen, ["pv-0", "pv-1", "pv-2"].into());
    // Until kube-scheduler binds them, the assumed plan holds its volumes: another gang
    // finds zone a without any.
    let mut holding = cluster.clone();
    holding.assume(&PlanId::Gang(ObjectKey::new("ns", "g")), &pods, &claims);
    let mut other = workers(1, PodRules::default());
    other.groups[0].pods[0].key = PodKey::new("ns", "other-0");
    other.topology.required = Some(ZONE.into());
    with_volume_per_pod(&mut holding, &mut other, "local", "50Gi");
    let later = placed(&plan_of(&holding, &other)).clone();
    assert_eq!(zones_of(&holding, &later), [("b".into(), 1)].into());
    assert_eq!(later.volumes[0].volume, "pv-3");
    // The gang planned again (its assumption still there) gets its own volumes back.
    assert_eq!(placed(&plan_of(&holding, &gang)).volumes.len(), 3);

    let mut gang = workers(4, PodRules::default());
    gang.topology.required = Some(ZONE.into());
    with_volume_per_pod(&mut cluster, &mut gang, "local", "50Gi");
    let why = reasons(&plan_of(&cluster, &gang));
    assert!(
        why.contains("the best, a, has room for 3: 4 nodes there have room for 16 pods, but the 3 free PersistentVolumes of class \"local\" there leaves 3 for 4 pods of group worker"),
        "{why}"
    );
}

#[test]
fn a_claim_that_binds_at_once_makes_the_gang_wait() {
    let mut cluster = gpu_cluster(2, 0, 2, 1);
    cluster.storage_mut().upsert_class(local_class("now", false));
    let mut gang = workers(1, PodRules::default());
    with_volume_per_pod(&mut cluster, &mut gang, "now", "1Gi");
    let why = reasons(&plan_of(&cluster, &gang));
    assert!(
        why.contains("pod ns/worker-0 waits for its PersistentVolumeClaim ns/worker-0-data to be bound"),
        "{why}"
    );
    let mut missing = workers(1, PodRules::default());
    missing.groups[0].pods[0].volumes.push(ObjectKey::new("ns", "gone"));
    assert!(reasons(&plan_of(&cluster, &missing)).contains("PersistentVolumeClaim ns/gone not found"));
}

#[test]
fn a_claim_that_names_its_volume_before_the_binding_completes_says_so() {
    let mut cluster = gpu_cluster(2, 0, 2, 1);
    cluster.storage_mut().upsert_class(local_class("local", true));
    let mut claim = volume_claim("ns", "prebound", "local", "1Gi");
    claim.volume_name = Some("pv-7".into());
    cluster.storage_mut().upsert_claim(claim.clone());
    let mut gang = workers(1, PodRules::default());
    gang.groups[0].pods[0].volumes.push(claim.key.clone());
    let why = reasons(&plan_of(&cluster, &gang));
    assert!(
        why.contains("it names PersistentVolume pv-7, but kube-controller-manager has not completed the binding"),
        "{why}"
    );
    assert!(!why.contains("binds at once"), "{why}");
}

#[test]
fn a_read_write_once_pod_claim_in_use_refuses_the_pod() {
    let mut cluster = gpu_cluster(2, 0, 2, 1);
    cluster.storage_mut().upsert_class(local_class("local", true));
    let mut claim = volume_claim("ns", "exclusive", "local", "1Gi");
    claim.access_modes = AccessModes::READ_WRITE_ONCE_POD;
    let mut pv = volume("pv", "local", "1Gi", HOSTNAME, "node-00000");
    pv.access_modes = AccessModes::READ_WRITE_ONCE_POD;
    bind(&mut claim, &mut pv);
    cluster.storage_mut().upsert_claim(claim.clone());
    cluster.storage_mut().upsert_volume(pv);
    let mut gang = workers(1, PodRules::default());
    gang.groups[0].pods[0].volumes.push(claim.key.clone());
    assert_eq!(placed(&plan_of(&cluster, &gang)).nodes(), ["node-00000"]);
    // Two pods of the gang share it: the second cannot join.
    let mut two = workers(2, PodRules::default());
    for pod in &mut two.groups[0].pods {
        pod.volumes.push(claim.key.clone());
    }
    assert!(reasons(&plan_of(&cluster, &two)).contains("(ReadWriteOncePod) used by another pod of the gang"));
    run_pod(
        &mut cluster,
        "holder",
        "node-00000",
        PodTraits {
            volumes: vec![claim.key.clone()],
            ..PodTraits::default()
        },
    );
    assert!(reasons(&plan_of(&cluster, &gang)).contains("with access mode ReadWriteOncePod is in use by another pod"));
}

#[test]
fn attach_limits_bound_the_new_volumes_per_node() {
    let mut cluster = gpu_cluster(2, 0, 2, 1);
    let mut class = local_class("csi", true);
    class.provisioner = "csi.example.com".into();
    cluster.storage_mut().upsert_class(class);
    for node in ["node-00000", "node-00001"] {
        cluster.storage_mut().upsert_csi_node(
            node,
            CsiNode {
                limits: [("csi.example.com".to_string(), Some(2))].into(),
            },
        );
    }
    let mut gang = workers(4, PodRules::default());
    with_volume_per_pod(&mut cluster, &mut gang, "csi", "1Gi");
    let plan = placed(&plan_of(&cluster, &gang)).clone();
    let per_node: BTreeMap<&str, usize> = plan.pods.iter().fold(BTreeMap::new(), |mut m, p| {
        *m.entry(p.node.as_str()).or_default() += 1;
        m
    });
    assert_eq!(per_node.values().copied().collect::<Vec<_>>(), [2, 2]);
    let mut gang = workers(5, PodRules::default());
    with_volume_per_pod(&mut cluster, &mut gang, "csi", "1Gi");
    let why = reasons(&plan_of(&cluster, &gang));
    assert!(
        why.contains("the attach limit of csi.example.com leaves 4 for 5 pods"),
        "{why}"
    );
}

#[test]
fn nodes_to_avoid_for_the_gang_or_one_pod_are_avoided() {
    let cluster = gpu_cluster(3, 0, 3, 1);
    let gang = workers(2, one_per_node());
    let mut avoid = Avoid::default();
    avoid
        .pod_nodes
        .entry(PodKey::new("ns", "worker-0"))
        .or_default()
        .insert("node-00000".into(), "refused by kube-scheduler".into());
    avoid
        .nodes
        .insert("node-00002".into(), "refused by kube-scheduler before".into());
    let options = PlanOptions {
        avoid: Arc::new(avoid),
        ..PlanOptions::default()
    };
    let placement = placed(&plan(&cluster, &gang, &options)).clone();
    let on: BTreeMap<String, String> = placement
        .pods
        .iter()
        .map(|p| (p.pod.to_string(), p.node.clone()))
        .collect();
    assert_eq!(on["ns/worker-0"], "node-00001");
    assert_eq!(on["ns/worker-1"], "node-00000");
    let why = reasons(&plan(&cluster, &workers(3, one_per_node()), &options));
    assert!(why.contains("1 refused by kube-scheduler before"), "{why}");
}

#[test]
fn an_assumed_plan_holds_its_pods_traits_for_the_next_plan() {
    let mut cluster = gpu_cluster(4, 0, 4, 1);
    let first = workers(2, one_per_node());
    let plan = placed(&plan_of(&cluster, &first)).clone();
    let (pods, claims) = plan.assumption(&first);
    cluster.assume(&PlanId::Gang(ObjectKey::new("ns", "g")), &pods, &claims);
    let mut second = workers(3, one_per_node());
    second.name = "ns/h".into();
    for (i, pod) in second.groups[0].pods.iter_mut().enumerate() {
        pod.key = PodKey::new("ns", &format!("other-{i}"));
    }
    let why = reasons(&plan_of(&cluster, &second));
    assert!(
        why.contains("2 anti-affinity of running pods on kubernetes.io/hostname"),
        "{why}"
    );
}

#[test]
fn constraints_leave_plans_without_them_alone() {
    let cluster = gpu_cluster(16, 8, 4, 2);
    let gang = gpu_gang("g", 4, 8, Some(RACK), None);
    let mut with_labels = gang.clone();
    with_labels.groups[0].shape.rules.labels = [("app".to_string(), "x".to_string())].into();
    assert_eq!(
        placed(&plan_of(&cluster, &gang)).pods,
        placed(&plan_of(&cluster, &with_labels)).pods
    );
    let _ = TopologyRequest::default();
}

#[test]
fn a_placement_made_earlier_is_checked_against_the_cluster_as_it_is_now() {
    use crate::claim::{DeviceTaint, TaintEffect};
    use crate::cluster::DeviceTaintRule;
    use crate::selector::{NodeTaintEffect, Taint};

    let mut cluster = gpu_cluster(4, 8, 4, 1);
    let mut gang = gpu_gang("g", 2, 8, None, None);
    gang.groups[0].shape.rules = one_per_node();
    gang.groups[0].shape.rules.labels = [("app".to_string(), "worker".to_string())].into();
    let plan = placed(&plan_of(&cluster, &gang)).clone();
    // The reservation kept: each pod's claim holds the devices the plan gave it.
    for (pod, claim) in gang.groups[0].pods.iter_mut().zip(&plan.claims) {
        pod.claims[0].allocation = Some(claim.allocation.clone());
    }
    let options = PlanOptions::default();
    assert_eq!(
        verify(&cluster, &gang, &plan.pods, &options).expect("a request that can be checked"),
        Vec::<String>::new()
    );

    // A running pod the gang's anti-affinity selects joins the first node.
    let first = plan.pods[0].node.clone();
    let mut changed = cluster.clone();
    run_pod(&mut changed, "intruder", &first, labelled(&[("app", "worker")]));
    let problems = verify(&changed, &gang, &plan.pods, &options).expect("a request that can be checked");
    assert!(
        problems[0].contains("anti-affinity on kubernetes.io/hostname with running pods"),
        "{problems:?}"
    );

    // The node went NotReady: the node controller's NoExecute taint.
    let mut node = cluster.node(&first).unwrap().clone();
    node.taints.push(Taint {
        key: "node.kubernetes.io/not-ready".into(),
        value: String::new(),
        effect: NodeTaintEffect::NoExecute,
    });
    let mut not_ready = cluster.clone();
    not_ready.upsert_node(node);
    let problems = verify(&not_ready, &gang, &plan.pods, &options).expect("a request that can be checked");
    assert!(
        problems[0].contains("untolerated taint node.kubernetes.io/not-ready"),
        "{problems:?}"
    );

    // A device of the second pod got a NoExecute taint from a DeviceTaintRule.
    let device = &plan.claims[1].allocation.devices[0];
    cluster.upsert_taint_rule(
        "drain",
        DeviceTaintRule {
            driver: Some(device.driver.clone()),
            pool: Some(device.pool.clone()),
            device: Some(device.device.clone()),
            taint: DeviceTaint {
                key: "maintenance".into(),
                value: Some("true".into()),
                effect: TaintEffect::NoExecute,
            },
        },
    );
    let problems = verify(&cluster, &gang, &plan.pods, &options).expect("a request that can be checked");
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("has the taint maintenance=true:NoExecute"),
        "{problems:?}"
    );
}

#[test]
fn nodes_that_refuse_one_group_only_are_named_in_its_reason() {
    let mut cluster = gpu_cluster(4, 0, 4, 1);
    cluster.storage_mut().upsert_class(local_class("local", true));
    cluster
        .storage_mut()
        .upsert_volume(volume("pv-0", "local", "100Gi", HOSTNAME, "node-00000"));
    let mut gang = workers(2, PodRules::default());
    with_volume_per_pod(&mut cluster, &mut gang, "local", "10Gi");
    gang.groups
        .insert(0, GroupRequest::uniform("launcher", "ns", 1, 1, gpu_pod(0, 1, 1)));
    let why = reasons(&plan_of(&cluster, &gang));
    assert!(
        why.contains("(of the nodes other groups can use, 3 take none of its pods: 3 no free PersistentVolume of class \"local\")"),
        "{why}"
    );
}

#[test]
fn each_pod_goes_where_its_own_bound_volume_is() {
    // Pod i's claim is bound to a local volume on node 3 - i: the pods differ, and a node
    // one pod cannot use stays open to the others.
    let mut cluster = gpu_cluster(4, 8, 4, 1);
    cluster.storage_mut().upsert_class(local_class("local", true));
    let mut gang = gpu_gang("g", 3, 8, None, None);
    for (i, pod) in gang.groups[0].pods.iter_mut().enumerate() {
        let node = format!("node-{:05}", 3 - i);
        let mut claim = volume_claim("ns", &format!("data-{i}"), "local", "10Gi");
        let mut pv = volume(&format!("pv-{i}"), "local", "10Gi", HOSTNAME, &node);
        bind(&mut claim, &mut pv);
        pod.volumes.push(claim.key.clone());
        cluster.storage_mut().upsert_claim(claim);
        cluster.storage_mut().upsert_volume(pv);
    }
    // First fit alone, without the search to fall back on.
    let options = PlanOptions {
        backtrack_budget: 0,
        ..PlanOptions::default()
    };
    let plan = placed(&plan(&cluster, &gang, &options)).clone();
    let on: BTreeMap<String, String> = plan.pods.iter().map(|p| (p.pod.to_string(), p.node.clone())).collect();
    assert_eq!(on["ns/g-workers-0"], "node-00003", "{on:?}");
    assert_eq!(on["ns/g-workers-1"], "node-00002", "{on:?}");
    assert_eq!(on["ns/g-workers-2"], "node-00001", "{on:?}");
}

#[test]
fn volumes_a_plan_took_are_let_go_once_the_claims_bind() {
    let mut cluster = gpu_cluster(2, 0, 2, 1);
    cluster.storage_mut().upsert_class(local_class("local", true));
    cluster
        .storage_mut()
        .upsert_volume(volume("pv-a", "local", "10Gi", HOSTNAME, "node-00000"));
    cluster
        .storage_mut()
        .upsert_volume(volume("pv-b", "local", "10Gi", HOSTNAME, "node-00000"));
    let mut gang = workers(1, PodRules::default());
    with_volume_per_pod(&mut cluster, &mut gang, "local", "1Gi");
    let plan = placed(&plan_of(&cluster, &gang)).clone();
    let (pods, claims) = plan.assumption(&gang);
    let taken = plan.volumes[0].volume.clone();
    cluster.assume(&PlanId::Gang(ObjectKey::new("ns", "g")), &pods, &claims);
    assert!(cluster.volume_taken(&taken));
    // The watch shows the released pod on its node: its claim is not bound yet.
    let released = PodEntry {
        node: pods[0].node.clone(),
        requests: pods[0].requests.clone(),
        traits: Arc::new(PodTraits {
            volumes: pods[0].traits.volumes.clone(),
            ..PodTraits::default()
        }),
    };
    cluster.observe_pod_bound(&pods[0].pod, released.clone());
    assert!(cluster.volume_taken(&taken), "held until the claim binds");
    // kube-scheduler bound the claim to the other volume, then the pod.
    let other = if taken == "pv-a" { "pv-b" } else { "pv-a" };
    let key = pods[0].traits.volumes[0].clone();
    let mut claim = cluster.storage().claim(&key).unwrap().clone();
    let mut volume = cluster.storage().volume(other).unwrap().clone();
    bind(&mut claim, &mut volume);
    cluster.storage_mut().upsert_claim(claim);
    cluster.storage_mut().upsert_volume(volume);
    cluster.observe_pod_bound(&pods[0].pod, released);
    assert!(!cluster.volume_taken(&taken), "the volume it did not get is free again");
}

#[test]
fn a_node_the_pod_filters_refuse_never_reports_an_allocator_error() {
    // node-00001's GPUs lack the attribute the selector reads: allocating there is a CEL
    // runtime error, which fails the pod, unless an earlier filter refuses the node, as
    // kube-scheduler's host ports filter does here.
    let mut cluster = gpu_cluster(2, 2, 2, 1);
    let mut bare = gpu(0, "H100");
    bare.attributes.remove("index");
    cluster.upsert_slice(node_slice("node-00001", vec![bare]));
    run_pod(
        &mut cluster,
        "web",
        "node-00001",
        PodTraits {
            host_ports: vec![HostPort::new("", "TCP", 8080)],
            ..PodTraits::default()
        },
    );
    let mut gang = gpu_gang("g", 1, 1, None, None);
    if let crate::claim::DeviceRequest::Exactly(spec) = &mut gang.groups[0].shape.claims[0].requests[0] {
        spec.selectors = vec!["device.attributes['gpu.example.com'].index >= 0".into()];
    }
    let unguarded = reasons(&plan_of(&cluster, &gang));
    assert!(unguarded.contains("CEL runtime error"), "{unguarded}");
    gang.groups[0].shape.rules.host_ports = vec![HostPort::new("", "TCP", 8080)];
    assert_eq!(placed(&plan_of(&cluster, &gang)).nodes(), ["node-00000"]);
}

/// Issue 21, item 4: the check a restart onto its reservation makes sees the gang's own
/// claims allocated in the cluster (the reservation is kept): those devices are the
/// pods' own, not taken.
#[test]
fn a_kept_reservation_whose_claims_the_cluster_shows_allocated_still_takes_its_pods() {
    let mut cluster = gpu_cluster(4, 8, 4, 1);
    let mut gang = gpu_gang("g", 2, 8, None, None);
    gang.groups[0].shape.rules = one_per_node();
    gang.groups[0].shape.rules.labels = [("app".to_string(), "worker".to_string())].into();
    let plan = placed(&plan_of(&cluster, &gang)).clone();
    for (pod, claim) in gang.groups[0].pods.iter_mut().zip(&plan.claims) {
        pod.claims[0].allocation = Some(claim.allocation.clone());
        cluster.set_claim_allocation(&claim.claim, Some(claim.allocation.devices.clone()));
    }
    let options = PlanOptions::default();
    assert_eq!(
        verify(&cluster, &gang, &plan.pods, &options).expect("a request that can be checked"),
        Vec::<String>::new()
    );
    // A pod another workload runs meanwhile that the anti-affinity selects is seen.
    let first = plan.pods[0].node.clone();
    run_pod(&mut cluster, "intruder", &first, labelled(&[("app", "worker")]));
    let problems = verify(&cluster, &gang, &plan.pods, &options).expect("a request that can be checked");
    assert!(problems.iter().any(|p| p.contains("anti-affinity")), "{problems:?}");
}

/// Review of issue 21: a placement is checked in the order it was planned in. Workers
/// listed first whose affinity needs the launcher (listed after them) in their rack were
/// planned after it; checked in list order, no launcher was there yet and every restart
/// of such a gang would have been placed afresh.
#[test]
fn a_placement_is_checked_in_the_order_it_was_planned_in() {
    let cluster = gpu_cluster(8, 8, 4, 2);
    let mut gang = gpu_gang("g", 2, 8, None, None);
    gang.groups[0].shape.rules.affinity = vec![term(RACK, &[("app", "launcher")])];
    let mut launcher = GroupRequest::uniform("g-launcher", "ns", 1, 1, gpu_pod(0, 2, 4));
    launcher.shape.rules.labels = [("app".to_string(), "launcher".to_string())].into();
    gang.groups.push(launcher);
    let planned = placed(&plan_of(&cluster, &gang)).clone();
    let options = PlanOptions::default();
    let mut kept = gang.clone();
    for pod in kept.groups.iter_mut().flat_map(|g| g.pods.iter_mut()) {
        for claim in &mut pod.claims {
            claim.allocation = planned
                .claims
                .iter()
                .find(|c| c.claim == claim.key)
                .map(|c| c.allocation.clone());
        }
    }
    assert_eq!(
        verify(&cluster, &kept, &planned.pods, &options).expect("a request that can be checked"),
        Vec::<String>::new()
    );
    // And a gang whose predecessors ran there goes back the same way.
    let previous: PreviousPlaces = planned
        .pods
        .iter()
        .map(|p| {
            let devices = planned
                .claims
                .iter()
                .filter(|c| c.claim.as_str().starts_with(p.pod.as_str()))
                .flat_map(|c| c.allocation.devices.iter().map(|d| d.device_id()))
                .collect();
            (
                p.pod.clone(),
                PreviousPlace {
                    node: p.node.clone(),
                    devices,
                },
            )
        })
        .collect();
    let again = PlanOptions {
        previous: Arc::new(previous),
        ..PlanOptions::default()
    };
    assert_eq!(placed(&plan(&cluster, &gang, &again)).pods, planned.pods);
}

/// The nodes of `names`, as one assigned domain taking `pods` pods.
fn assigned_domain(names: &[&str], pods: usize) -> crate::request::AssignedDomain {
    crate::request::AssignedDomain {
        name: format!("{HOSTNAME}={}", names.join("+")),
        nodes: names.iter().map(|n| n.to_string()).collect(),
        pods,
    }
}

/// Pods per node of group `group`.
fn group_nodes(plan: &Plan, gang: &GangRequest, group: usize) -> BTreeMap<String, usize> {
    let mut by_node = BTreeMap::new();
    for pod in &plan.pods {
        if gang.groups[group].pods.iter().any(|p| p.key == pod.pod) {
            *by_node.entry(pod.node.clone()).or_default() += 1;
        }
    }
    by_node
}

#[test]
fn each_group_lands_in_the_domains_assigned_to_it_with_their_pod_counts() {
    // 8 nodes of 8 GPUs, 4 per rack. Left alone, the gang packs onto node-00000 and
    // node-00001; the assignment spreads it over other nodes of rack-0000, as Kueue's
    // Topology-Aware Scheduling might, and the plan must follow it pod for pod.
    let cluster = gpu_cluster(8, 8, 4, 2);
    let mut gang = GangRequest {
        name: "ns/g".into(),
        groups: vec![
            GroupRequest::uniform("driver", "ns", 1, 1, gpu_pod(0, 1, 1)),
            GroupRequest::uniform("ps", "ns", 2, 2, gpu_pod(2, 1, 1)),
            GroupRequest::uniform("workers", "ns", 4, 4, gpu_pod(2, 1, 1)),
        ],
        topology: TopologyRequest {
            required: Some(RACK.into()),
            ..TopologyRequest::default()
        },
        ..GangRequest::default()
    };
    let free = placed(&plan(&cluster, &gang, &PlanOptions::default())).clone();
    assert_eq!(
        free.nodes(),
        ["node-00000", "node-00001"],
        "unassigned, the gang packs: {:?}",
        free.pods
    );

    gang.groups[0].assigned = vec![assigned_domain(&["node-00003"], 1)];
    gang.groups[1].assigned = vec![assigned_domain(&["node-00002"], 1), assigned_domain(&["node-00003"], 1)];
    gang.groups[2].assigned = vec![assigned_domain(&["node-00001"], 1), assigned_domain(&["node-00002"], 3)];
    let outcome = plan(&cluster, &gang, &PlanOptions::default());
    let plan_ = placed(&outcome);
    assert_eq!(
        group_nodes(plan_, &gang, 0),
        BTreeMap::from([("node-00003".to_string(), 1)])
    );
    assert_eq!(
        group_nodes(plan_, &gang, 1),
        BTreeMap::from([("node-00002".to_string(), 1), ("node-00003".to_string(), 1)])
    );
    assert_eq!(
        group_nodes(plan_, &gang, 2),
        BTreeMap::from([("node-00001".to_string(), 1), ("node-00002".to_string(), 3)])
    );
    // What the plan decided passes the check a restart makes of it.
    let problems = verify(&cluster, &gang, &plan_.pods, &PlanOptions::default()).expect("verify runs");
    assert!(problems.is_empty(), "{problems:?}");

    // Domains that take fewer pods than the group has: no plan, and the reason says so.
    gang.groups[2].assigned = vec![assigned_domain(&["node-00001"], 1), assigned_domain(&["node-00002"], 2)];
    let why = reasons(&plan(&cluster, &gang, &PlanOptions::default()));
    assert!(why.contains("assigned"), "{why}");

    // Groups assigned to different racks cannot share the rack the gang requires.
    gang.groups[2].assigned = vec![assigned_domain(&["node-00004", "node-00005"], 4)];
    let why = reasons(&plan(&cluster, &gang, &PlanOptions::default()));
    assert!(why.contains("assigned"), "{why}");
}

#[test]
fn a_group_held_to_few_assigned_nodes_is_placed_before_groups_that_could_take_their_room() {
    // The leader may use node-00000 only; the workers (devices first in the usual order)
    // the whole rack, and would fill node-00000's CPUs first.
    let cluster = gpu_cluster(4, 8, 4, 1);
    let mut gang = GangRequest {
        name: "ns/g".into(),
        groups: vec![
            GroupRequest::uniform("leader", "ns", 1, 1, gpu_pod(0, 2, 1)),
            GroupRequest::uniform("workers", "ns", 2, 2, gpu_pod(1, 32, 1)),
        ],
        ..GangRequest::default()
    };
    gang.groups[0].assigned = vec![assigned_domain(&["node-00000"], 1)];
    gang.groups[1].assigned = vec![assigned_domain(
        &["node-00000", "node-00001", "node-00002", "node-00003"],
        2,
    )];
    // First fit alone, no search to repair its order.
    let options = PlanOptions {
        backtrack_budget: 0,
        ..PlanOptions::default()
    };
    let outcome = plan(&cluster, &gang, &options);
    assert_eq!(
        group_nodes(placed(&outcome), &gang, 0),
        BTreeMap::from([("node-00000".to_string(), 1)])
    );
}
