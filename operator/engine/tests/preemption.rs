//! Property-based tests of preemption on small random clusters: racks of 4-GPU nodes,
//! a few running gangs of random priorities (some only assumed), and a gang that does
//! not fit as things are.
//!
//! Each property runs a modest number of cases; set `PROPTEST_CASES` to run more.

use muster_engine::cluster::{AssumedClaim, AssumedPod, ClusterState, PlanId};
use muster_engine::fixtures::{self, GPU};
use muster_engine::key::ObjectKey;
use muster_engine::placement::{self, Outcome, PlanOptions};
use muster_engine::preemption::{
    Preemption, PreemptionCandidate, PreemptionOptions, PreemptionPolicy, Preemptor, preempt,
};
use muster_engine::request::GangRequest;
use proptest::prelude::*;

const RACK: &str = "example.com/rack";
const GPUS_PER_NODE: usize = 4;

#[derive(Clone, Debug)]
struct RunningSpec {
    priority: i32,
    admitted_at_seconds: i64,
    /// Per pod: node index (modulo the node count) and GPUs.
    pods: Vec<(usize, usize)>,
    /// Entered as an assumed plan rather than as the watches show it.
    assumed: bool,
}

#[derive(Clone, Debug)]
struct Scenario {
    nodes: usize,
    racks: usize,
    running: Vec<RunningSpec>,
    preemptor_pods: usize,
    preemptor_gpus: u32,
    preemptor_priority: i32,
    required: bool,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    let running = (
        0i32..=4,
        0i64..=1000,
        prop::collection::vec((0usize..6, 1usize..=GPUS_PER_NODE), 1..=4),
        any::<bool>(),
    )
        .prop_map(|(priority, admitted_at_seconds, pods, assumed)| RunningSpec {
            priority,
            admitted_at_seconds,
            pods,
            assumed,
        });
    (
        2usize..=6,
        1usize..=3,
        prop::collection::vec(running, 1..=8),
        1usize..=3,
        1u32..=4,
        0i32..=5,
        any::<bool>(),
    )
        .prop_map(
            |(nodes, racks, running, preemptor_pods, preemptor_gpus, preemptor_priority, required)| Scenario {
                nodes,
                racks,
                running,
                preemptor_pods,
                preemptor_gpus,
                preemptor_priority,
                required,
            },
        )
}

fn node_name(i: usize) -> String {
    format!("node-{i}")
}

/// The cluster, and the running gangs as candidates. A pod asks for no more GPUs than
/// its node has free, and is left out when the node's CPUs are taken.
fn build(scenario: &Scenario) -> (ClusterState, Vec<PreemptionCandidate>) {
    let mut cluster = ClusterState::new();
    cluster.upsert_class(fixtures::gpu_class());
    for i in 0..scenario.nodes {
        let name = node_name(i);
        let rack = format!("rack-{}", i % scenario.racks);
        cluster.upsert_node(fixtures::node(&name, 16, 256, &[(RACK, rack.as_str())]));
        cluster.upsert_slice(fixtures::node_slice(
            &name,
            (0..GPUS_PER_NODE).map(|g| fixtures::gpu(g, "H100")).collect(),
        ));
    }
    let mut candidates = Vec::new();
    for (g, spec) in scenario.running.iter().enumerate() {
        let name = format!("running-{g}");
        let mut placements: Vec<(String, usize)> = Vec::new();
        for &(node, gpus) in &spec.pods {
            let node = node_name(node % scenario.nodes);
            let pods_there = placements.iter().filter(|(n, _)| *n == node).count() as i64;
            let free_cpu = cluster.node(&node).map_or(0, |n| cluster.free_resources(n).cpu_millis);
            if free_cpu - pods_there * 8000 < 8000 {
                continue;
            }
            let taken_here: usize = placements.iter().filter(|(n, _)| *n == node).map(|(_, g)| g).sum();
            let free = (0..GPUS_PER_NODE)
                .filter(|d| !cluster.device_allocated_by_name(GPU, &node, &format!("gpu-{d}")))
                .count()
                - taken_here;
            placements.push((node, gpus.min(free)));
        }
        let placements: Vec<(&str, usize)> = placements.iter().map(|(n, g)| (n.as_str(), *g)).collect();
        let (pods, claims) = fixtures::run_gang(&mut cluster, "ns", &name, &placements);
        let workload = ObjectKey::new("ns", &name);
        let candidate = if spec.assumed {
            // The same pods and claims, entered as a plan not yet confirmed.
            let assumed_pods: Vec<AssumedPod> = pods
                .iter()
                .map(|pod| AssumedPod {
                    pod: pod.clone(),
                    node: cluster.pod_node(pod).expect("entered").to_string(),
                    requests: fixtures::gpu_pod(0, 8, 64).requests,
                    traits: Default::default(),
                })
                .collect();
            let assumed_claims: Vec<AssumedClaim> = claims
                .iter()
                .map(|claim| AssumedClaim {
                    claim: claim.clone(),
                    devices: cluster.claim_devices(claim).expect("entered").to_vec(),
                })
                .collect();
            for pod in &pods {
                cluster.remove_pod(pod);
            }
            for claim in &claims {
                cluster.set_claim_allocation(claim, None);
            }
            let id = PlanId::Gang(workload.clone());
            cluster.assume(&id, &assumed_pods, &assumed_claims);
            PreemptionCandidate {
                workload,
                priority: spec.priority,
                admitted_at_seconds: spec.admitted_at_seconds,
                pods: vec![],
                claims: vec![],
                assumed_plans: vec![id],
            }
        } else {
            PreemptionCandidate {
                workload,
                priority: spec.priority,
                admitted_at_seconds: spec.admitted_at_seconds,
                pods,
                claims,
                assumed_plans: vec![],
            }
        };
        candidates.push(candidate);
    }
    (cluster, candidates)
}

fn preemptor_gang(scenario: &Scenario) -> GangRequest {
    let required = scenario.required.then_some(RACK);
    fixtures::gpu_gang("p", scenario.preemptor_pods, scenario.preemptor_gpus, required, None)
}

/// The racks a candidate holds pods or devices in (the test's devices are node-local,
/// in a pool named after their node).
fn racks_of(cluster: &ClusterState, candidate: &PreemptionCandidate) -> Vec<String> {
    let mut pods = candidate.pods.clone();
    let mut claims = candidate.claims.clone();
    for plan in &candidate.assumed_plans {
        if let Some((plan_pods, plan_claims)) = cluster.assumed_plan_members(plan) {
            pods.extend_from_slice(plan_pods);
            claims.extend_from_slice(plan_claims);
        }
    }
    let nodes = pods
        .iter()
        .filter_map(|pod| cluster.pod_node(pod).map(str::to_string))
        .chain(
            claims
                .iter()
                .flat_map(|claim| cluster.claim_devices(claim).unwrap_or_default())
                .map(|device| device.pool.clone()),
        );
    nodes
        .filter_map(|node| cluster.node(&node).and_then(|n| n.labels.get(RACK).cloned()))
        .collect()
}

/// The state with `victims` evicted.
fn without(cluster: &ClusterState, candidates: &[PreemptionCandidate], victims: &[&ObjectKey]) -> ClusterState {
    let mut state = cluster.clone();
    for candidate in candidates.iter().filter(|c| victims.contains(&&c.workload)) {
        state.evict(&candidate.pods, &candidate.claims, &candidate.assumed_plans);
    }
    state
}

fn config(cases: u32) -> ProptestConfig {
    let defaults = ProptestConfig::default();
    ProptestConfig {
        cases: if std::env::var_os("PROPTEST_CASES").is_some() {
            defaults.cases
        } else {
            cases
        },
        failure_persistence: None,
        ..defaults
    }
}

proptest! {
    #![proptest_config(config(384))]

    /// For a gang that does not fit as things are: an eviction evicts only gangs of
    /// strictly lower priority that hold something in its one domain, is proven by its
    /// plan on the state without the victims, and spares every victim it can (none can
    /// be dropped alone); when the gang would not fit, it does not fit with every gang
    /// of lower priority gone.
    #[test]
    fn evictions_are_proven_minimal_and_strictly_lower(scenario in scenario()) {
        let (cluster, candidates) = build(&scenario);
        let gang = preemptor_gang(&scenario);
        let plan_options = PlanOptions::default();
        if placement::plan(&cluster, &gang, &plan_options).plan().is_some() {
            // Preemption is asked for gangs that do not fit.
            return Ok(());
        }
        let preemptor = Preemptor {
            priority: scenario.preemptor_priority,
            policy: PreemptionPolicy::PreemptLowerPriority,
        };
        let decision = preempt(&cluster, &gang, &preemptor, &candidates, &PreemptionOptions::default());
        let lower: Vec<&ObjectKey> = candidates
            .iter()
            .filter(|c| c.priority < preemptor.priority)
            .map(|c| &c.workload)
            .collect();
        match &decision {
            Preemption::Evict(eviction) => {
                prop_assert!(!eviction.victims.is_empty());
                for victim in &eviction.victims {
                    prop_assert!(lower.contains(&victim), "{victim} is not of lower priority");
                    if let Some(domain) = &eviction.domain {
                        let candidate = candidates.iter().find(|c| c.workload == *victim).expect("a candidate");
                        let racks = racks_of(&cluster, candidate);
                        prop_assert!(racks.contains(domain), "{victim} holds nothing in {domain}: {racks:?}");
                    }
                }
                let in_domain = PlanOptions {
                    required_value: eviction.domain.clone(),
                    ..plan_options.clone()
                };
                let victims: Vec<&ObjectKey> = eviction.victims.iter().collect();
                let after = placement::plan(&without(&cluster, &candidates, &victims), &gang, &in_domain);
                prop_assert_eq!(after.plan(), Some(&eviction.plan), "the plan is not proven");
                for spared in &victims {
                    let fewer: Vec<&ObjectKey> = victims.iter().copied().filter(|v| v != spared).collect();
                    let outcome = placement::plan(&without(&cluster, &candidates, &fewer), &gang, &in_domain);
                    prop_assert!(
                        !matches!(outcome, Outcome::Placed(_)),
                        "{spared} need not be evicted: {:?}",
                        eviction.victims
                    );
                }
            }
            Preemption::WouldNotFit(reasons) => {
                let outcome = placement::plan(&without(&cluster, &candidates, &lower), &gang, &plan_options);
                prop_assert!(
                    !matches!(outcome, Outcome::Placed(_)),
                    "fits with every gang of lower priority gone, yet: {reasons:?}"
                );
            }
            Preemption::NotAllowed(_) => prop_assert!(lower.is_empty()),
            Preemption::Fits { .. } | Preemption::BudgetSpent(_) => {
                prop_assert!(false, "unexpected for a gang that does not fit: {decision}");
            }
        }
    }
}
