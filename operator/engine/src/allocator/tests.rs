use super::*;
use crate::claim::{ClaimConfig, DeviceConstraint, DeviceTaint, DeviceToleration, OpaqueConfig, TolerationOperator};
use crate::cluster::{CounterConsumption, CounterSet, DeviceNodes, DeviceTaintRule};
use crate::device::{RequestPolicy, ValidRange};
use crate::fixtures::*;
use crate::selector::{Operator, Requirement};

const BUDGET: u64 = 1_000_000;

impl NodeFit {
    fn expect_placed(self) -> Vec<Allocation> {
        match self {
            NodeFit::Placed(allocations) => allocations,
            NodeFit::NoFit(why) => panic!("expected a fit, got {why:?}"),
        }
    }

    fn is_placed(&self) -> bool {
        matches!(self, NodeFit::Placed(_))
    }
}

fn setup(devices: Vec<Device>) -> (ClusterState, Node) {
    let mut cluster = ClusterState::new();
    cluster.upsert_class(gpu_class());
    let n = node("n1", 64, 256, &[("rack", "r1")]);
    cluster.upsert_node(n.clone());
    cluster.upsert_slice(node_slice("n1", devices));
    (cluster, n)
}

fn run(cluster: &ClusterState, node: &Node, claims: &[ClaimSpec]) -> Result<NodeFit, AllocationError> {
    run_with(cluster, &WorkingSet::default(), node, claims)
}

fn run_with(
    cluster: &ClusterState,
    usage: &WorkingSet,
    node: &Node,
    claims: &[ClaimSpec],
) -> Result<NodeFit, AllocationError> {
    let keys: Vec<String> = (0..claims.len()).map(|i| format!("ns/claim-{i}")).collect();
    let refs: Vec<ClaimRef<'_>> = claims
        .iter()
        .zip(&keys)
        .map(|(spec, key)| ClaimRef { key, spec })
        .collect();
    let mut budget = BUDGET;
    allocate(cluster, usage, node, &refs, &mut budget)
}

fn devices_of(allocation: &Allocation) -> Vec<String> {
    allocation.devices.iter().map(|d| d.device.clone()).collect()
}

fn gpus(n: usize) -> Vec<Device> {
    (0..n).map(|i| gpu(i, "H100")).collect()
}

#[test]
fn allocates_devices_in_slice_order_with_node_selector() {
    let (cluster, n) = setup(gpus(4));
    let result = run(&cluster, &n, &[gpu_claim(2)]).unwrap().expect_placed();
    assert_eq!(devices_of(&result[0]), ["gpu-0", "gpu-1"]);
    let d = &result[0].devices[0];
    assert_eq!(
        (d.request.as_str(), d.driver.as_str(), d.pool.as_str()),
        ("gpus", GPU, "n1")
    );
    assert_eq!(result[0].node_selector, Some(NodeSelector::for_node("n1")));
}

#[test]
fn all_claims_of_a_pod_are_allocated_together_or_not_at_all() {
    let (cluster, n) = setup(gpus(4));
    let ok = run(&cluster, &n, &[gpu_claim(2), gpu_claim(2)])
        .unwrap()
        .expect_placed();
    assert_eq!(devices_of(&ok[1]), ["gpu-2", "gpu-3"]);
    assert_eq!(
        run(&cluster, &n, &[gpu_claim(2), gpu_claim(3)]).unwrap(),
        NodeFit::NoFit(NoFit::NoSolution)
    );
}

#[test]
fn allocated_devices_are_excluded() {
    let (mut cluster, n) = setup(gpus(4));
    let taken = run(&cluster, &n, &[gpu_claim(3)]).unwrap().expect_placed();
    cluster.set_claim_allocation(&"ns/other".into(), Some(taken[0].devices.clone()));
    assert_eq!(
        devices_of(&run(&cluster, &n, &[gpu_claim(1)]).unwrap().expect_placed()[0]),
        ["gpu-3"]
    );
    assert_eq!(
        run(&cluster, &n, &[gpu_claim(2)]).unwrap(),
        NodeFit::NoFit(NoFit::NoSolution)
    );

    // The working set of a plan in progress counts too.
    let mut usage = WorkingSet::default();
    let last = run(&cluster, &n, &[gpu_claim(1)]).unwrap().expect_placed();
    usage.hold(&last[0].devices);
    assert_eq!(
        run_with(&cluster, &usage, &n, &[gpu_claim(1)]).unwrap(),
        NodeFit::NoFit(NoFit::NoSolution)
    );
    usage.release(&last[0].devices);
    assert!(run_with(&cluster, &usage, &n, &[gpu_claim(1)]).unwrap().is_placed());
}

#[test]
fn selectors_from_class_and_request() {
    let mut devices = gpus(2);
    devices.push(gpu(2, "A100"));
    let (cluster, n) = setup(devices);
    let mut claim = gpu_claim(1);
    if let DeviceRequest::Exactly(spec) = &mut claim.requests[0] {
        spec.selectors
            .push(format!("device.attributes['{GPU}'].model == 'A100'"));
    }
    assert_eq!(
        devices_of(&run(&cluster, &n, &[claim.clone()]).unwrap().expect_placed()[0]),
        ["gpu-2"]
    );
    if let DeviceRequest::Exactly(spec) = &mut claim.requests[0] {
        spec.count = 2;
    }
    assert_eq!(run(&cluster, &n, &[claim]).unwrap(), NodeFit::NoFit(NoFit::NoSolution));
}

#[test]
fn missing_class_and_cel_errors_are_errors_not_misfits() {
    let (mut cluster, n) = setup(gpus(2));
    let mut claim = gpu_claim(1);
    if let DeviceRequest::Exactly(spec) = &mut claim.requests[0] {
        spec.device_class_name = "nope.example.com".into();
    }
    let e = run(&cluster, &n, &[claim]).unwrap_err();
    assert!(
        e.message.contains("could not retrieve device class nope.example.com"),
        "{e}"
    );

    let mut claim = gpu_claim(1);
    if let DeviceRequest::Exactly(spec) = &mut claim.requests[0] {
        spec.selectors.push(format!("device.attributes['{GPU}'].missing == 1"));
    }
    let e = run(&cluster, &n, &[claim]).unwrap_err();
    assert!(
        e.message
            .contains("claim ns/claim-0: selector #0 on device gpu.example.com/n1/gpu-0: CEL runtime error"),
        "{e}"
    );
    assert!(e.message.contains("no such key"), "{e}");

    cluster.upsert_class(DeviceClass {
        selectors: vec!["@@".into()],
        ..gpu_class()
    });
    let e = run(&cluster, &n, &[gpu_claim(1)]).unwrap_err();
    assert!(
        e.message
            .starts_with("class gpu.example.com: selector #0: CEL compile error"),
        "{e}"
    );
}

#[test]
fn more_than_32_devices_is_an_error() {
    let (cluster, n) = setup(gpus(40));
    let e = run(&cluster, &n, &[gpu_claim(33)]).unwrap_err();
    assert!(e.message.contains("exceeds the claim limit of 32"), "{e}");
}

#[test]
fn match_attribute_backtracks_to_a_consistent_set() {
    // nvlinkDomain: gpu-0..3 → 0, gpu-4..7 → 1. gpu-1 and gpu-2 are taken, so two
    // devices with one domain means backtracking past gpu-0.
    let (mut cluster, n) = setup(gpus(8));
    let taken = |d: &str| DeviceResult {
        request: "x".into(),
        driver: GPU.into(),
        pool: "n1".into(),
        device: d.into(),
        admin_access: None,
        tolerations: vec![],
        binding_conditions: vec![],
        binding_failure_conditions: vec![],
        share_id: None,
        consumed_capacity: BTreeMap::new(),
    };
    cluster.set_claim_allocation(
        &"ns/x".into(),
        Some(vec![taken("gpu-1"), taken("gpu-2"), taken("gpu-3")]),
    );
    let mut claim = gpu_claim(2);
    claim.constraints.push(match_attribute(&format!("{GPU}/nvlinkDomain")));
    assert_eq!(
        devices_of(&run(&cluster, &n, &[claim.clone()]).unwrap().expect_placed()[0]),
        ["gpu-4", "gpu-5"]
    );
    claim.requests[0] = DeviceRequest::Exactly(request("gpus", 5));
    assert_eq!(run(&cluster, &n, &[claim]).unwrap(), NodeFit::NoFit(NoFit::NoSolution));
}

#[test]
fn distinct_attribute_and_missing_attributes() {
    let (cluster, n) = setup(gpus(8));
    let mut claim = gpu_claim(2);
    claim.constraints.push(DeviceConstraint {
        requests: vec![],
        kind: ConstraintKind::DistinctAttribute(format!("{GPU}/nvlinkDomain")),
    });
    assert_eq!(
        devices_of(&run(&cluster, &n, &[claim.clone()]).unwrap().expect_placed()[0]),
        ["gpu-0", "gpu-4"]
    );
    claim.requests[0] = DeviceRequest::Exactly(request("gpus", 3));
    assert_eq!(run(&cluster, &n, &[claim]).unwrap(), NodeFit::NoFit(NoFit::NoSolution));

    let mut claim = gpu_claim(1);
    claim.constraints.push(match_attribute("other.example.com/missing"));
    assert_eq!(
        run(&cluster, &n, &[claim]).unwrap(),
        NodeFit::NoFit(NoFit::NoSolution),
        "a device lacking the attribute is refused"
    );
}

#[test]
fn first_available_takes_the_first_subrequest_that_fits_and_names_it() {
    let (cluster, n) = setup(gpus(4));
    let claim = ClaimSpec {
        requests: vec![DeviceRequest::FirstAvailable {
            name: "gpus".into(),
            subrequests: vec![request("eight", 8), request("four", 4), request("one", 1)],
        }],
        ..ClaimSpec::default()
    };
    let result = run(&cluster, &n, &[claim]).unwrap().expect_placed();
    assert_eq!(result[0].devices.len(), 4);
    assert_eq!(result[0].devices[0].request, "gpus/four");
}

#[test]
fn all_mode_takes_every_matching_device_or_nothing() {
    let (mut cluster, n) = setup(gpus(3));
    let mut spec = request("all", 0);
    spec.allocation_mode = AllocationMode::All;
    let claim = ClaimSpec {
        requests: vec![DeviceRequest::Exactly(spec)],
        ..ClaimSpec::default()
    };
    assert_eq!(
        run(&cluster, &n, std::slice::from_ref(&claim)).unwrap().expect_placed()[0]
            .devices
            .len(),
        3
    );
    let one = run(&cluster, &n, &[gpu_claim(1)]).unwrap().expect_placed();
    cluster.set_claim_allocation(&"ns/x".into(), Some(one[0].devices.clone()));
    assert_eq!(
        run(&cluster, &n, std::slice::from_ref(&claim)).unwrap(),
        NodeFit::NoFit(NoFit::NoSolution)
    );

    // All on an incomplete pool is an error.
    let mut incomplete = node_slice("n1", gpus(1));
    incomplete.name = "n1-b".into();
    incomplete.pool = "second".into();
    incomplete.resource_slice_count = 2;
    cluster.set_claim_allocation(&"ns/x".into(), None);
    cluster.upsert_slice(incomplete);
    let e = run(&cluster, &n, &[claim]).unwrap_err();
    assert!(e.message.contains("is currently being updated"), "{e}");
}

#[test]
fn device_taint_rules_taint_the_devices_they_select() {
    let (mut cluster, n) = setup(gpus(3));
    let rule = |device: Option<&str>, pool: Option<&str>| DeviceTaintRule {
        driver: Some(GPU.into()),
        pool: pool.map(Into::into),
        device: device.map(Into::into),
        taint: DeviceTaint {
            key: "maintenance".into(),
            value: None,
            effect: TaintEffect::NoSchedule,
        },
    };
    cluster.upsert_taint_rule("gpu-0-broken", rule(Some("gpu-0"), None));
    cluster.upsert_taint_rule("other-pool", rule(None, Some("n2")));
    assert_eq!(
        devices_of(&run(&cluster, &n, &[gpu_claim(2)]).unwrap().expect_placed()[0]),
        ["gpu-1", "gpu-2"],
        "the rule's device is skipped; a rule for another pool changes nothing"
    );
    assert_eq!(
        run(&cluster, &n, &[gpu_claim(3)]).unwrap(),
        NodeFit::NoFit(NoFit::NoSolution)
    );

    let mut tolerant = gpu_claim(3);
    if let DeviceRequest::Exactly(spec) = &mut tolerant.requests[0] {
        spec.tolerations.push(DeviceToleration {
            key: Some("maintenance".into()),
            operator: TolerationOperator::Exists,
            value: None,
            effect: None,
            toleration_seconds: None,
        });
    }
    assert!(
        run(&cluster, &n, &[tolerant]).unwrap().is_placed(),
        "a toleration lets it through"
    );

    cluster.upsert_taint_rule("whole-driver", rule(None, None));
    assert_eq!(
        run(&cluster, &n, &[gpu_claim(1)]).unwrap(),
        NodeFit::NoFit(NoFit::NoSolution)
    );
    cluster.remove_taint_rule("whole-driver");
    cluster.remove_taint_rule("gpu-0-broken");
    assert!(
        run(&cluster, &n, &[gpu_claim(3)]).unwrap().is_placed(),
        "removed rules taint nothing"
    );
}

#[test]
fn taints_need_tolerations_and_admin_access_ignores_use() {
    let mut devices = gpus(2);
    devices[0].taints.push(DeviceTaint {
        key: "fenced".into(),
        value: Some("muster".into()),
        effect: TaintEffect::NoSchedule,
    });
    devices[1].taints.push(DeviceTaint {
        key: "info".into(),
        value: None,
        effect: TaintEffect::Other,
    });
    let (mut cluster, n) = setup(devices);
    assert_eq!(
        devices_of(&run(&cluster, &n, &[gpu_claim(1)]).unwrap().expect_placed()[0]),
        ["gpu-1"]
    );
    assert_eq!(
        run(&cluster, &n, &[gpu_claim(2)]).unwrap(),
        NodeFit::NoFit(NoFit::NoSolution)
    );
    let mut claim = gpu_claim(2);
    let toleration = DeviceToleration {
        key: Some("fenced".into()),
        operator: TolerationOperator::Equal,
        value: Some("muster".into()),
        effect: None,
        toleration_seconds: None,
    };
    if let DeviceRequest::Exactly(spec) = &mut claim.requests[0] {
        spec.tolerations.push(toleration.clone());
    }
    let result = run(&cluster, &n, &[claim]).unwrap().expect_placed();
    assert_eq!(
        result[0].devices[0].tolerations,
        vec![toleration],
        "tolerations are copied into results"
    );

    let both = run(&cluster, &n, &[gpu_claim(1)]).unwrap().expect_placed();
    cluster.set_claim_allocation(&"ns/x".into(), Some(both[0].devices.clone()));
    let mut admin = gpu_claim(1);
    if let DeviceRequest::Exactly(spec) = &mut admin.requests[0] {
        spec.admin_access = true;
    }
    let result = run(&cluster, &n, &[admin]).unwrap().expect_placed();
    assert_eq!(
        devices_of(&result[0]),
        ["gpu-1"],
        "admin access may use an allocated device (gpu-0 is tainted)"
    );
    assert_eq!(result[0].devices[0].admin_access, Some(true));
}

#[test]
fn shared_counters_limit_partitions() {
    // One physical GPU with 40Gi, offered as two 20Gi halves or one 40Gi whole.
    let consumes = |gib: i64| {
        vec![CounterConsumption {
            counter_set: "gpu-0".into(),
            counters: BTreeMap::from([(
                "memory".into(),
                Quantity::from_units(gib << 30, crate::quantity::Format::BinarySI),
            )]),
        }]
    };
    let devices = vec![
        Device {
            name: "whole".into(),
            consumes_counters: consumes(40),
            ..Device::default()
        },
        Device {
            name: "half-a".into(),
            consumes_counters: consumes(20),
            ..Device::default()
        },
        Device {
            name: "half-b".into(),
            consumes_counters: consumes(20),
            ..Device::default()
        },
    ];
    let (mut cluster, n) = setup(devices);
    let mut counters = node_slice("n1", vec![]);
    counters.name = "n1-counters".into();
    counters.resource_slice_count = 2;
    counters.shared_counters = vec![CounterSet {
        name: "gpu-0".into(),
        counters: BTreeMap::from([(
            "memory".into(),
            Quantity::from_units(40 << 30, crate::quantity::Format::BinarySI),
        )]),
    }];
    let mut devices_slice = cluster.slice("n1-gpu.example.com").unwrap().as_ref().clone();
    devices_slice.resource_slice_count = 2;
    cluster.upsert_slice(devices_slice);
    cluster.upsert_slice(counters);
    assert_eq!(
        devices_of(&run(&cluster, &n, &[gpu_claim(1)]).unwrap().expect_placed()[0]),
        ["whole"]
    );
    assert_eq!(
        devices_of(&run(&cluster, &n, &[gpu_claim(2)]).unwrap().expect_placed()[0]),
        ["half-a", "half-b"]
    );
    let whole = run(&cluster, &n, &[gpu_claim(1)]).unwrap().expect_placed();
    cluster.set_claim_allocation(&"ns/x".into(), Some(whole[0].devices.clone()));
    assert_eq!(
        run(&cluster, &n, &[gpu_claim(1)]).unwrap(),
        NodeFit::NoFit(NoFit::NoSolution),
        "the counters are used up"
    );
}

#[test]
fn consumable_capacity_shares_a_device() {
    let mut nic = Device {
        name: "nic".into(),
        allow_multiple_allocations: true,
        ..Device::default()
    };
    nic.capacity.insert(
        "bandwidth".into(),
        Capacity {
            value: Quantity::parse("100G").unwrap(),
            request_policy: Some(Box::new(RequestPolicy {
                default: Some(Quantity::parse("10G").unwrap()),
                valid_values: vec![],
                valid_range: Some(ValidRange {
                    min: Quantity::parse("10G").unwrap(),
                    max: None,
                    step: Some(Quantity::parse("10G").unwrap()),
                }),
            })),
        },
    );
    let (mut cluster, n) = setup(vec![nic]);
    let mut claim = gpu_claim(1);
    if let DeviceRequest::Exactly(spec) = &mut claim.requests[0] {
        spec.capacity
            .insert("bandwidth".into(), Quantity::parse("35G").unwrap());
    }
    let first = run(&cluster, &n, &[claim.clone()]).unwrap().expect_placed();
    assert_eq!(
        run(&cluster, &n, &[claim.clone()]).unwrap().expect_placed(),
        first,
        "deterministic, share ID included"
    );
    let result = &first[0].devices[0];
    assert_eq!(
        result.consumed_capacity["bandwidth"],
        Quantity::parse("40G").unwrap(),
        "rounded up to the step"
    );
    assert!(result.share_id.is_some());
    cluster.set_claim_allocation(&"ns/a".into(), Some(first[0].devices.clone()));
    let second = run(&cluster, &n, &[claim.clone()]).unwrap().expect_placed();
    cluster.set_claim_allocation(&"ns/b".into(), Some(second[0].devices.clone()));
    assert_eq!(
        run(&cluster, &n, &[claim.clone()]).unwrap(),
        NodeFit::NoFit(NoFit::NoSolution),
        "80G used, 40G more does not fit"
    );
    let small = gpu_claim(1);
    let third = run(&cluster, &n, &[small]).unwrap().expect_placed();
    assert_eq!(
        third[0].devices[0].consumed_capacity["bandwidth"],
        Quantity::parse("10G").unwrap(),
        "the default"
    );
}

#[test]
fn config_from_class_then_claim() {
    let (mut cluster, n) = setup(gpus(2));
    let opaque = |text: &str| OpaqueConfig {
        driver: GPU.into(),
        parameters: text.into(),
    };
    cluster.upsert_class(DeviceClass {
        config: vec![opaque("{\"class\":1}")],
        ..gpu_class()
    });
    let mut claim = ClaimSpec {
        requests: vec![
            DeviceRequest::Exactly(request("a", 1)),
            DeviceRequest::Exactly(request("b", 1)),
        ],
        ..ClaimSpec::default()
    };
    claim.config.push(ClaimConfig {
        requests: vec!["b".into()],
        opaque: opaque("{\"b\":1}"),
    });
    claim.config.push(ClaimConfig {
        requests: vec![],
        opaque: opaque("{\"all\":1}"),
    });
    let result = run(&cluster, &n, &[claim]).unwrap().expect_placed();
    let config: Vec<(ConfigSource, Vec<String>, String)> = result[0]
        .config
        .iter()
        .map(|c| (c.source, c.requests.clone(), c.opaque.parameters.clone()))
        .collect();
    assert_eq!(
        config,
        [
            (ConfigSource::FromClass, vec![], "{\"class\":1}".to_string()),
            (ConfigSource::FromClaim, vec!["b".to_string()], "{\"b\":1}".to_string()),
            (ConfigSource::FromClaim, vec![], "{\"all\":1}".to_string()),
        ]
    );
}

#[test]
fn shared_slices_give_selector_or_no_node_selector() {
    let mut cluster = ClusterState::new();
    cluster.upsert_class(gpu_class());
    let n = node("n1", 8, 8, &[("rack", "r1")]);
    let mut network = node_slice("fabric", vec![gpu(0, "IMEX")]);
    network.nodes = SliceNodes::Selector(NodeSelector {
        terms: vec![Term {
            match_expressions: vec![Requirement::new("rack", Operator::In, &["r1"])],
            match_fields: vec![],
        }],
    });
    cluster.upsert_slice(network);
    let result = run(&cluster, &n, &[gpu_claim(1)]).unwrap().expect_placed();
    let selector = result[0].node_selector.clone().unwrap();
    assert_eq!(
        selector.terms[0].match_expressions,
        vec![Requirement::new("rack", Operator::In, &["r1"])]
    );

    let mut everywhere = node_slice("global", vec![gpu(0, "X")]);
    everywhere.nodes = SliceNodes::All;
    let mut cluster = ClusterState::new();
    cluster.upsert_class(gpu_class());
    cluster.upsert_slice(everywhere);
    assert_eq!(
        run(&cluster, &n, &[gpu_claim(1)]).unwrap().expect_placed()[0].node_selector,
        None
    );

    let mut per_device = node_slice("per-device", vec![gpu(0, "X"), gpu(1, "X")]);
    per_device.nodes = SliceNodes::PerDevice;
    per_device.devices[0].nodes = Some(DeviceNodes::Node("elsewhere".into()));
    per_device.devices[1].nodes = Some(DeviceNodes::All);
    let mut cluster = ClusterState::new();
    cluster.upsert_class(gpu_class());
    cluster.upsert_slice(per_device);
    let result = run(&cluster, &n, &[gpu_claim(1)]).unwrap().expect_placed();
    assert_eq!(devices_of(&result[0]), ["gpu-1"]);
}

#[test]
fn a_hopeless_search_stops_at_its_budget() {
    // Five of 24 devices for one request, and one A100 (there is none) for another:
    // the search tries every combination of five before giving up.
    let (cluster, n) = setup(gpus(24));
    let mut a100 = request("a100", 1);
    a100.selectors
        .push(format!("device.attributes['{GPU}'].model == 'A100'"));
    let claim = ClaimSpec {
        requests: vec![DeviceRequest::Exactly(request("h100", 5)), DeviceRequest::Exactly(a100)],
        ..ClaimSpec::default()
    };
    let keys = ["ns/c".to_string()];
    let refs = [ClaimRef {
        key: &keys[0],
        spec: &claim,
    }];
    let mut budget = 1_000;
    assert_eq!(
        allocate(&cluster, &WorkingSet::default(), &n, &refs, &mut budget).unwrap(),
        NodeFit::NoFit(NoFit::BudgetExhausted)
    );
    assert_eq!(budget, 0);
    let mut budget = BUDGET;
    assert_eq!(
        allocate(&cluster, &WorkingSet::default(), &n, &refs, &mut budget).unwrap(),
        NodeFit::NoFit(NoFit::NoSolution)
    );
    assert!(
        BUDGET - budget > 42_504,
        "every combination was tried: {} steps",
        BUDGET - budget
    );
}
