//! Planning gangs on a synthetic 5,000-node, 40,000-device cluster: racks of 16 nodes,
//! blocks of 80 racks (1,280 nodes), 8 GPUs per node, about a fifth of the GPUs already
//! taken. Goals (DESIGN.md): 4 pods ≤ 1 ms, 1,024 pods ≤ 200 ms.
//!
//! A 1,024-node gang cannot fit in one 16-node rack: its required level is the block,
//! with the rack preferred. A sliced gang keeps each run of 8 pods within one rack.
//!
//! Pod constraints: the 1,024-pod gang with anti-affinity that keeps one pod per node,
//! and the 64-pod gang with a claim per pod that binds at the first consumer to one of
//! 100 static volumes per zone (a block is a zone); each against the same gang without.
//!
//! Preemption: a full 1,000-node cluster run by 100 gangs of 10 whole nodes each, of
//! priorities 0 to 4; a gang of priority 3 that needs a rack, or 32 nodes anywhere.
//!
//! A burst as the operator plans it (issue 38): 200 gangs of 4 whole nodes, each bound
//! to a rack of 8 nodes and its pods labelled with its own name, planned one after the
//! other on 1,000 nodes, each on a snapshot of the state that is copied once before the
//! gang's plan is assumed in it (a watch event while the snapshot is in use).

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use muster_engine::cluster::{ClusterState, PlanId};
use muster_engine::fixtures::{
    HOSTNAME, ZONE, device_result, gpu_cluster, gpu_gang, gpu_pod, local_class, run_gang, term, volume,
    with_volume_per_pod,
};
use muster_engine::key::ObjectKey;
use muster_engine::placement::{Outcome, PlanOptions, plan};
use muster_engine::preemption::{
    Preemption, PreemptionCandidate, PreemptionOptions, PreemptionPolicy, Preemptor, preempt,
};
use muster_engine::request::{GangRequest, GroupRequest, GroupTopology, SliceRequest};

const NODES: usize = 5_000;
const RACK: &str = "example.com/rack";
const BLOCK: &str = "example.com/block";

fn loaded_cluster() -> ClusterState {
    let mut cluster = gpu_cluster(NODES, 8, 16, 80);
    // Each block is a zone, with 100 static volumes of a class that binds at the first
    // consumer.
    let nodes: Vec<_> = cluster.nodes().cloned().collect();
    for mut node in nodes {
        let zone = node.labels[BLOCK].replace("block", "zone");
        node.labels.insert(ZONE.into(), zone);
        cluster.upsert_node(node);
    }
    cluster.storage_mut().upsert_class(local_class("zonal", true));
    for zone in 0..NODES.div_ceil(16 * 80) {
        for i in 0..100 {
            let zone = format!("zone-{zone:03}");
            cluster
                .storage_mut()
                .upsert_volume(volume(&format!("{zone}-pv-{i:03}"), "zonal", "1Ti", ZONE, &zone));
        }
    }
    // Every fifth node has half its GPUs taken, as other workloads would.
    for i in (0..NODES).step_by(5) {
        let node = format!("node-{i:05}");
        let devices = (0..4).map(|g| device_result("r", &node, &format!("gpu-{g}"))).collect();
        cluster.set_claim_allocation(&format!("load/{node}").into(), Some(devices));
    }
    cluster
}

/// Two groups of 16 pods with 4 GPUs, one of 40 cores a pod, one of 36, in one rack:
/// every node has room for a pod of either group, so the bounds pass in every rack, but
/// no node has the cores for two, so exact placement fails: first fit, then the
/// backtracking search.
fn past_the_bounds_gang() -> GangRequest {
    let mut gang = gpu_gang("g32", 16, 4, Some(RACK), None);
    gang.groups[0].shape = gpu_pod(4, 40, 64);
    gang.groups
        .push(GroupRequest::uniform("g32-others", "ns", 16, 16, gpu_pod(4, 36, 64)));
    gang
}

/// `pods` pods of 8 GPUs in one block, in slices of 8 pods each within one rack (about
/// 12 whole nodes free per rack: one slice per rack).
fn sliced_gang(pods: usize) -> GangRequest {
    let mut gang = gpu_gang(&format!("s{pods}"), pods, 8, Some(BLOCK), None);
    gang.groups[0].topology = GroupTopology {
        required: None,
        slice: Some(SliceRequest {
            key: RACK.into(),
            size: 8,
        }),
    };
    gang
}

/// The 1,024-pod gang, each pod's anti-affinity keeping the gang's pods one per node.
fn one_per_node_gang() -> GangRequest {
    let mut gang = gpu_gang("g1024", 1024, 8, Some(BLOCK), Some(RACK));
    let rules = &mut gang.groups[0].shape.rules;
    rules.labels = [("app".to_string(), "g1024".to_string())].into();
    rules.anti_affinity = vec![term(HOSTNAME, &[("app", "g1024")])];
    gang
}

/// The 64-pod gang, each pod with a 100Gi claim of the zonal class.
fn zonal_volumes_gang(cluster: &mut ClusterState) -> GangRequest {
    let mut gang = gpu_gang("z64", 64, 8, Some(BLOCK), Some(RACK));
    with_volume_per_pod(cluster, &mut gang, "zonal", "100Gi");
    gang
}

fn bench(c: &mut Criterion) {
    let mut cluster = loaded_cluster();
    let zonal = zonal_volumes_gang(&mut cluster);
    let cluster = cluster;
    let options = PlanOptions::default();
    let cases = [
        ("4 pods, rack, feasible", gpu_gang("g4", 4, 8, Some(RACK), None), true),
        (
            "4 pods, rack, infeasible (17 pods)",
            gpu_gang("g17", 17, 8, Some(RACK), None),
            false,
        ),
        (
            "64 pods, block+rack, feasible",
            gpu_gang("g64", 64, 8, Some(BLOCK), Some(RACK)),
            true,
        ),
        (
            "64 pods, rack, infeasible",
            gpu_gang("g64r", 64, 8, Some(RACK), None),
            false,
        ),
        (
            "1024 pods, block+rack, feasible",
            gpu_gang("g1024", 1024, 8, Some(BLOCK), Some(RACK)),
            true,
        ),
        (
            "1024 pods, block+rack, one per node by anti-affinity, feasible",
            one_per_node_gang(),
            true,
        ),
        ("64 pods, block+rack, a zonal volume each, feasible", zonal, true),
        (
            "1024 pods, block+rack, infeasible (1300 pods)",
            gpu_gang("g1300", 1300, 8, Some(BLOCK), Some(RACK)),
            false,
        ),
        (
            "32 pods in 2 groups, rack, infeasible past the bounds",
            past_the_bounds_gang(),
            false,
        ),
        (
            "256 pods, block, slices of 8 per rack, feasible",
            sliced_gang(256),
            true,
        ),
        (
            "1024 pods, block, slices of 8 per rack, infeasible (128 racks)",
            sliced_gang(1024),
            false,
        ),
    ];
    let mut group = c.benchmark_group("plan 5000 nodes 40000 devices");
    group.sample_size(20);
    for (name, gang, feasible) in &cases {
        // Check the outcome once, outside the timing.
        let outcome = plan(&cluster, gang, &options);
        assert_eq!(matches!(outcome, Outcome::Placed(_)), *feasible, "{name}: {outcome:?}");
        group.bench_function(*name, |b| {
            b.iter(|| black_box(plan(&cluster, black_box(gang), &options)))
        });
    }
    group.finish();

    // The first plan on a new cluster state evaluates every device's selectors and every
    // node's room; later plans reuse what did not change.
    let mut cold = c.benchmark_group("first plan on a fresh state, 5000 nodes");
    cold.sample_size(10);
    for (name, gang, _) in cases
        .iter()
        .filter(|(name, _, feasible)| *feasible && !name.starts_with("64") && !name.contains("anti-affinity"))
    {
        cold.bench_function(*name, |b| {
            b.iter_batched(
                loaded_cluster,
                // The state is handed back so that dropping it is not timed.
                |cluster| {
                    let outcome = black_box(plan(&cluster, gang, &options));
                    (cluster, outcome)
                },
                BatchSize::LargeInput,
            )
        });
    }
    cold.finish();
}

/// 1,000 nodes of 8 GPUs in racks of 16, every one taken by one of 100 gangs of 10
/// nodes (gang `i` on nodes `10i..10i+10`, priority `i % 5`, admitted at `i`).
fn full_cluster_and_running_gangs() -> (ClusterState, Vec<PreemptionCandidate>) {
    let mut cluster = gpu_cluster(1_000, 8, 16, 8);
    let candidates = (0..100i32)
        .map(|i| {
            let nodes: Vec<String> = (10 * i..10 * i + 10).map(|n| format!("node-{n:05}")).collect();
            let placements: Vec<(&str, usize)> = nodes.iter().map(|n| (n.as_str(), 8)).collect();
            let name = format!("running-{i:03}");
            let (pods, claims) = run_gang(&mut cluster, "ns", &name, &placements);
            PreemptionCandidate {
                workload: ObjectKey::new("ns", &name),
                priority: i % 5,
                admitted_at_seconds: i64::from(i),
                pods,
                claims,
                assumed_plans: vec![],
            }
        })
        .collect();
    (cluster, candidates)
}

fn bench_preemption(c: &mut Criterion) {
    let (cluster, candidates) = full_cluster_and_running_gangs();
    let preemptor = Preemptor {
        priority: 3,
        policy: PreemptionPolicy::PreemptLowerPriority,
    };
    let options = PreemptionOptions::default();
    let cases = [
        ("16 pods, rack", gpu_gang("p16", 16, 8, Some(RACK), None)),
        ("32 pods, anywhere", gpu_gang("p32", 32, 8, None, None)),
    ];
    let mut group = c.benchmark_group("preempt 1000 nodes 100 gangs");
    group.sample_size(10);
    for (name, gang) in &cases {
        // The decision once, outside the timing.
        match preempt(&cluster, gang, &preemptor, &candidates, &options) {
            Preemption::Evict(eviction) => println!(
                "{name}: evicts {} gang(s) up to priority {} in {:?} after {} trial placements (every domain weighed: {})",
                eviction.victims.len(),
                eviction.cost.highest_priority,
                eviction.domain,
                eviction.plan_calls,
                eviction.every_domain_weighed
            ),
            other => panic!("{name}: expected an eviction, got: {other}"),
        }
        group.bench_function(*name, |b| {
            b.iter(|| black_box(preempt(&cluster, black_box(gang), &preemptor, &candidates, &options)))
        });
    }
    group.finish();
}

/// 200 gangs planned as the operator plans a burst (see the module's header).
fn burst(mut live: ClusterState) -> ClusterState {
    for i in 0..200 {
        let name = format!("b{i:03}");
        let mut gang = gpu_gang(&name, 4, 8, Some(RACK), None);
        gang.groups[0].shape.rules.labels = [("example.com/gang".to_string(), name.clone())].into();
        let snapshot = Arc::new(live.clone());
        let Outcome::Placed(planned) = plan(&snapshot, &gang, &PlanOptions::default()) else {
            panic!("gang {name} of the burst does not fit");
        };
        let (pods, claims) = planned.assumption(&gang);
        live.assume(&PlanId::Gang(ObjectKey::new("ns", &name)), &pods, &claims);
    }
    live
}

fn bench_burst(c: &mut Criterion) {
    let mut group = c.benchmark_group("burst on 1000 nodes");
    group.sample_size(10);
    group.bench_function("200 rack-bound 4-pod gangs, one after the other", |b| {
        b.iter_batched(
            || gpu_cluster(1_000, 8, 8, 4),
            // The state is handed back so that dropping it is not timed.
            |cluster| black_box(burst(cluster)),
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group!(benches, bench, bench_preemption, bench_burst);
criterion_main!(benches);
