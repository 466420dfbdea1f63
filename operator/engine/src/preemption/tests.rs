use super::*;
use crate::fixtures::*;

const RACK: &str = "example.com/rack";

/// A gang of priority `priority`, admitted at `admitted_at_seconds`, running one pod per
/// `(node, gpus)`.
fn running(
    cluster: &mut ClusterState,
    name: &str,
    priority: i32,
    admitted_at_seconds: i64,
    placements: &[(&str, usize)],
) -> PreemptionCandidate {
    let (pods, claims) = run_gang(cluster, "ns", name, placements);
    PreemptionCandidate {
        workload: ObjectKey::new("ns", name),
        priority,
        admitted_at_seconds,
        pods,
        claims,
        assumed_plans: vec![],
    }
}

fn preemptor(priority: i32) -> Preemptor {
    Preemptor {
        priority,
        policy: PreemptionPolicy::PreemptLowerPriority,
    }
}

fn decide(cluster: &ClusterState, gang: &GangRequest, priority: i32, candidates: &[PreemptionCandidate]) -> Preemption {
    preempt(
        cluster,
        gang,
        &preemptor(priority),
        candidates,
        &PreemptionOptions::default(),
    )
}

fn eviction(decision: &Preemption) -> &Eviction {
    match decision {
        Preemption::Evict(eviction) => eviction,
        other => panic!("expected an eviction, got: {other}"),
    }
}

fn victims(decision: &Preemption) -> Vec<&str> {
    eviction(decision).victims.iter().map(ObjectKey::as_str).collect()
}

fn reasons(decision: &Preemption) -> String {
    match decision {
        Preemption::WouldNotFit(reasons) => reasons.join("; "),
        other => panic!("expected no fit, got: {other}"),
    }
}

/// The plan is proven on the state without the victims, in the decision's domain.
fn assert_proven(
    cluster: &ClusterState,
    gang: &GangRequest,
    decision: &Preemption,
    candidates: &[PreemptionCandidate],
) {
    let eviction = eviction(decision);
    let mut state = cluster.clone();
    for victim in candidates.iter().filter(|c| eviction.victims.contains(&c.workload)) {
        state.evict(&victim.pods, &victim.claims, &victim.assumed_plans);
    }
    let options = PlanOptions {
        required_value: eviction.domain.clone(),
        ..PlanOptions::default()
    };
    assert_eq!(placement::plan(&state, gang, &options).plan(), Some(&eviction.plan));
    assert_eq!(eviction.plan.topology_value, eviction.domain);
}

#[test]
fn a_gang_with_policy_never_evicts_nothing() {
    let mut cluster = gpu_cluster(1, 8, 1, 1);
    let low = running(&mut cluster, "low", 0, 0, &[("node-00000", 8)]);
    let gang = gpu_gang("p", 1, 8, None, None);
    let decision = preempt(
        &cluster,
        &gang,
        &Preemptor {
            priority: 100,
            policy: PreemptionPolicy::Never,
        },
        &[low],
        &PreemptionOptions::default(),
    );
    assert_eq!(
        decision,
        Preemption::NotAllowed("gang ns/p has preemption policy Never: it evicts no other gang".into())
    );
}

#[test]
fn only_gangs_of_strictly_lower_priority_are_victims() {
    let mut cluster = gpu_cluster(2, 8, 2, 1);
    let equal = running(&mut cluster, "equal", 10, 0, &[("node-00000", 8)]);
    let gang = gpu_gang("p", 1, 8, None, None);
    assert_eq!(
        decide(&cluster, &gang, 10, std::slice::from_ref(&equal)),
        Preemption::NotAllowed("no running gang has a priority below 10 (the lowest of 1 is 10)".into())
    );
    // A lower gang shares node-00001 with one of equal priority: evicting it is no use.
    let lower = running(&mut cluster, "lower", 5, 0, &[("node-00001", 4)]);
    let other = running(&mut cluster, "other", 10, 0, &[("node-00001", 4)]);
    let why = reasons(&decide(&cluster, &gang, 10, &[equal.clone(), lower.clone(), other]));
    assert!(
        why.contains("gang ns/p (priority 10) would not fit in the cluster even with every gang of lower priority there evicted (1 such gang(s))"),
        "{why}"
    );
    // One step up, the gang of priority 10 alone makes room.
    let decision = decide(&cluster, &gang, 11, &[equal, lower]);
    assert_eq!(victims(&decision), ["ns/equal"]);
}

#[test]
fn lower_priorities_win_over_fewer_victims() {
    // Two racks of two 8-GPU nodes; the gang needs both nodes of one rack.
    let mut cluster = gpu_cluster(4, 8, 2, 2);
    let one = running(&mut cluster, "one", 5, 0, &[("node-00000", 8), ("node-00001", 8)]);
    let first = running(&mut cluster, "first", 1, 10, &[("node-00002", 8)]);
    let second = running(&mut cluster, "second", 1, 20, &[("node-00003", 8)]);
    let gang = gpu_gang("p", 2, 8, Some(RACK), None);
    let candidates = [one, first, second];
    let decision = decide(&cluster, &gang, 10, &candidates);
    assert_eq!(victims(&decision), ["ns/second", "ns/first"], "youngest first");
    assert_eq!(eviction(&decision).domain.as_deref(), Some("rack-0001"));
    assert_eq!(
        eviction(&decision).cost,
        EvictionCost {
            highest_priority: 1,
            victims: 2,
            priority_sum: 2,
            admitted_at_sum: 30,
        }
    );
    assert_proven(&cluster, &gang, &decision, &candidates);
}

#[test]
fn fewest_victims_win_at_equal_priority() {
    let mut cluster = gpu_cluster(4, 8, 2, 2);
    let first = running(&mut cluster, "first", 1, 10, &[("node-00000", 8)]);
    let second = running(&mut cluster, "second", 1, 20, &[("node-00001", 8)]);
    let both = running(&mut cluster, "both", 1, 0, &[("node-00002", 8), ("node-00003", 8)]);
    let gang = gpu_gang("p", 2, 8, Some(RACK), None);
    let candidates = [first, second, both];
    let decision = decide(&cluster, &gang, 10, &candidates);
    assert_eq!(victims(&decision), ["ns/both"]);
    assert_eq!(eviction(&decision).domain.as_deref(), Some("rack-0001"));
    assert!(eviction(&decision).every_domain_weighed);
    assert_proven(&cluster, &gang, &decision, &candidates);
}

#[test]
fn the_youngest_goes_when_all_else_is_equal() {
    // Between domains.
    let mut cluster = gpu_cluster(4, 8, 2, 2);
    let old = running(&mut cluster, "old", 1, 100, &[("node-00000", 8), ("node-00001", 8)]);
    let young = running(&mut cluster, "young", 1, 200, &[("node-00002", 8), ("node-00003", 8)]);
    let gang = gpu_gang("p", 2, 8, Some(RACK), None);
    let decision = decide(&cluster, &gang, 10, &[old, young]);
    assert_eq!(victims(&decision), ["ns/young"]);
    assert_eq!(eviction(&decision).domain.as_deref(), Some("rack-0001"));

    // Within one domain.
    let mut cluster = gpu_cluster(2, 8, 2, 1);
    let old = running(&mut cluster, "old", 1, 100, &[("node-00000", 8)]);
    let young = running(&mut cluster, "young", 1, 200, &[("node-00001", 8)]);
    let gang = gpu_gang("p", 1, 8, None, None);
    let candidates = [old, young];
    let decision = decide(&cluster, &gang, 10, &candidates);
    assert_eq!(victims(&decision), ["ns/young"]);
    assert_eq!(eviction(&decision).domain, None);
    assert_proven(&cluster, &gang, &decision, &candidates);
}

#[test]
fn nothing_is_evicted_for_a_gang_that_would_not_fit_anyway() {
    // Three 8-GPU pods in one rack of two nodes: no eviction makes room.
    let mut cluster = gpu_cluster(4, 8, 2, 2);
    let candidates = [
        running(&mut cluster, "a", 1, 0, &[("node-00000", 8), ("node-00001", 8)]),
        running(&mut cluster, "b", 1, 0, &[("node-00002", 8), ("node-00003", 8)]),
    ];
    let gang = gpu_gang("p", 3, 8, Some(RACK), None);
    let why = reasons(&decide(&cluster, &gang, 10, &candidates));
    assert!(
        why.starts_with("gang ns/p (priority 10) would not fit in any example.com/rack even with every gang of lower priority there evicted (2 such gang(s))"),
        "{why}"
    );
    assert!(
        why.contains(
            "example.com/rack=rack-0000, with 1 gang(s) of lower priority evicted: group p-workers needs 3 pods"
        ),
        "{why}"
    );
    assert!(why.contains("has room for 2"), "{why}");
}

#[test]
fn victims_come_from_one_domain_only() {
    // One free node in each rack: enough for the gang over the cluster, not in a rack.
    let mut cluster = gpu_cluster(4, 8, 2, 2);
    let candidates = [
        running(&mut cluster, "a", 1, 100, &[("node-00001", 8)]),
        running(&mut cluster, "b", 1, 200, &[("node-00003", 8)]),
    ];
    let gang = gpu_gang("p", 2, 8, Some(RACK), None);
    let decision = decide(&cluster, &gang, 10, &candidates);
    assert_eq!(victims(&decision), ["ns/b"]);
    let eviction = eviction(&decision);
    assert_eq!(eviction.domain.as_deref(), Some("rack-0001"));
    assert_eq!(eviction.plan.nodes(), ["node-00002", "node-00003"]);
    assert_proven(&cluster, &gang, &decision, &candidates);
}

#[test]
fn victims_that_are_not_needed_are_reprieved() {
    // node-00000: a small gang of priority 1 beside one of the preemptor's priority;
    // node-00001: a gang of priority 2. Evicting in order takes both low gangs before
    // the gang fits, but only the second is needed.
    let mut cluster = gpu_cluster(2, 8, 2, 1);
    let candidates = [
        running(&mut cluster, "small", 1, 0, &[("node-00000", 2)]),
        running(&mut cluster, "equal", 9, 0, &[("node-00000", 6)]),
        running(&mut cluster, "whole", 2, 0, &[("node-00001", 8)]),
    ];
    let gang = gpu_gang("p", 1, 8, None, None);
    let decision = decide(&cluster, &gang, 9, &candidates);
    assert_eq!(victims(&decision), ["ns/whole"]);
    assert_eq!(eviction(&decision).cost.highest_priority, 2);
    assert_proven(&cluster, &gang, &decision, &candidates);
}

#[test]
fn a_gang_whose_devices_sit_in_another_domain_is_not_evicted_there() {
    let mut cluster = gpu_cluster(4, 8, 2, 2);
    // rack-0001 is held by a gang of the preemptor's priority, and by the lowest gang,
    // whose claim holds devices there but whose pods are not bound yet.
    let equal = running(&mut cluster, "equal", 10, 0, &[("node-00002", 8), ("node-00003", 4)]);
    let (_, claims) = run_gang(&mut cluster, "ns", "unbound", &[("node-00003", 4)]);
    let unbound = PreemptionCandidate {
        workload: ObjectKey::new("ns", "unbound"),
        priority: 0,
        admitted_at_seconds: 500,
        pods: vec![],
        claims,
        assumed_plans: vec![],
    };
    let in_rack = running(&mut cluster, "in-rack", 1, 0, &[("node-00000", 8)]);
    // The running gang's pod is gone; only its claim is left.
    cluster.remove_pod(&"ns/unbound-0".into());
    let candidates = [equal, unbound, in_rack];
    let gang = gpu_gang("p", 2, 8, Some(RACK), None);

    let domains = Domains::new(&cluster, &gang, &candidates, &[1, 2]);
    assert_eq!(domains.values, [Some("rack-0000".into()), Some("rack-0001".into())]);
    assert_eq!(domains.members, [vec![2], vec![1]]);

    let decision = decide(&cluster, &gang, 10, &candidates);
    assert_eq!(victims(&decision), ["ns/in-rack"]);
    assert_proven(&cluster, &gang, &decision, &candidates);
}

#[test]
fn an_assumed_plan_is_evicted_with_its_gang() {
    let mut cluster = gpu_cluster(1, 8, 1, 1);
    let low = gpu_gang("low", 1, 8, None, None);
    let plan = placement::plan(&cluster, &low, &PlanOptions::default());
    let (pods, claims) = plan.plan().expect("the low gang fits").assumption(&low);
    let id = PlanId::Gang("ns/low".into());
    cluster.assume(&id, &pods, &claims);
    let candidates = [PreemptionCandidate {
        workload: "ns/low".into(),
        priority: 0,
        admitted_at_seconds: 0,
        pods: vec![],
        claims: vec![],
        assumed_plans: vec![id],
    }];
    let gang = gpu_gang("p", 1, 8, None, None);
    let decision = decide(&cluster, &gang, 1, &candidates);
    assert_eq!(victims(&decision), ["ns/low"]);
    assert_proven(&cluster, &gang, &decision, &candidates);
}

#[test]
fn a_gang_that_fits_already_evicts_nothing() {
    let mut cluster = gpu_cluster(2, 8, 2, 1);
    let candidates = [running(&mut cluster, "low", 0, 0, &[("node-00000", 8)])];
    let gang = gpu_gang("p", 1, 8, None, None);
    match decide(&cluster, &gang, 1, &candidates) {
        Preemption::Fits { domain: None, plan } => assert_eq!(plan.nodes(), ["node-00001"]),
        other => panic!("expected a fit, got: {other:?}"),
    }
}

#[test]
fn the_budget_of_trial_placements_bounds_the_search() {
    let mut cluster = gpu_cluster(4, 8, 2, 2);
    let candidates = [
        running(&mut cluster, "both", 1, 0, &[("node-00000", 8), ("node-00001", 8)]),
        running(&mut cluster, "first", 1, 10, &[("node-00002", 8)]),
        running(&mut cluster, "second", 1, 20, &[("node-00003", 8)]),
    ];
    let gang = gpu_gang("p", 2, 8, Some(RACK), None);
    let options = |max_plan_calls| PreemptionOptions {
        max_plan_calls,
        ..PreemptionOptions::default()
    };
    let decide_with = |calls| preempt(&cluster, &gang, &preemptor(10), &candidates, &options(calls));
    assert_eq!(
        decide_with(0),
        Preemption::BudgetSpent(
            "preemption for gang ns/p spent its 0 trial placements after weighing 0 of 2 domains with gangs of lower priority, before any eviction was proven".into()
        )
    );
    // rack-0000 (one candidate) is weighed in 2 calls; rack-0001 is cut short.
    let cut = decide_with(3);
    assert_eq!(victims(&cut), ["ns/both"]);
    assert!(!eviction(&cut).every_domain_weighed);
    assert_eq!(eviction(&cut).plan_calls, 3);
    let full = decide_with(256);
    assert_eq!(victims(&full), ["ns/both"]);
    assert!(eviction(&full).every_domain_weighed);
}

#[test]
fn a_device_shared_by_nodes_ties_its_gang_to_every_domain_it_reaches() {
    use crate::cluster::{Slice, SliceNodes};
    use crate::selector::{NodeSelector, Operator, Requirement, Term};

    let mut cluster = gpu_cluster(4, 8, 2, 2);
    let rack_one = NodeSelector {
        terms: vec![Term {
            match_expressions: vec![Requirement::new(RACK, Operator::In, &["rack-0001"])],
            match_fields: vec![],
        }],
    };
    for (pool, nodes) in [
        ("fabric-rack", SliceNodes::Selector(rack_one)),
        ("fabric-all", SliceNodes::All),
    ] {
        cluster.upsert_slice(Slice {
            name: pool.into(),
            driver: GPU.into(),
            pool: pool.into(),
            generation: 1,
            resource_slice_count: 1,
            nodes,
            devices: vec![gpu(0, "H100")],
            shared_counters: vec![],
        });
    }
    let mut holding = |name: &str, pool: &str| {
        let claim = ClaimKey::new("ns", name);
        let device = device_result("gpus", pool, "gpu-0");
        cluster.set_claim_allocation(&claim, Some(vec![device]));
        PreemptionCandidate {
            workload: ObjectKey::new("ns", name),
            priority: 0,
            admitted_at_seconds: 0,
            pods: vec![],
            claims: vec![claim],
            assumed_plans: vec![],
        }
    };
    let candidates = [holding("rack-only", "fabric-rack"), holding("everywhere", "fabric-all")];
    let gang = gpu_gang("p", 1, 8, Some(RACK), None);
    let domains = Domains::new(&cluster, &gang, &candidates, &[0, 1]);
    assert_eq!(domains.members, [vec![1], vec![0, 1]]);
}
