//! A gang placed at several topology levels on the real control plane: the example's
//! gang keeps to one block, prefers one rack, puts its workers in one rack and in
//! pairs each inside one NVLink domain. A second such gang finds only half a rack of
//! whole pairs, waits with a reason that names the slice level, and runs once the first
//! is gone. An invariant checker runs beside the test.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, DeleteParams};
use muster_api::v1alpha1::WorkloadPhase;
use muster_e2e::scenario::{Test, with_test};
use muster_local_cluster::fleet::{FleetSpec, NodeTopology, RACK_LABEL, create_or_keep};
use serde_json::Value;

const NVLINK_LABEL: &str = "example.com/nvlink-domain";
const EXAMPLE: &str = include_str!("../../examples/multi-level-topology.yaml");

/// Seven GPU nodes in a block of their own, the only nodes with NVLink domains:
/// rack-lv-0 holds one whole pair (lv-0, lv-1) and a single (lv-2), rack-lv-1 two pairs.
const NODES: [(&str, &str, &str); 7] = [
    ("lv-0", "rack-lv-0", "nvl-a"),
    ("lv-1", "rack-lv-0", "nvl-a"),
    ("lv-2", "rack-lv-0", "nvl-b"),
    ("lv-3", "rack-lv-1", "nvl-c"),
    ("lv-4", "rack-lv-1", "nvl-c"),
    ("lv-5", "rack-lv-1", "nvl-d"),
    ("lv-6", "rack-lv-1", "nvl-d"),
];

async fn create_nodes(test: &Test) -> Result<()> {
    let fleet = FleetSpec::default().fenced();
    let nodes: Api<Node> = Api::all(test.client.clone());
    let slices: Api<ResourceSlice> = Api::all(test.client.clone());
    for (name, rack, nvlink) in NODES {
        let topology = NodeTopology {
            name: name.into(),
            zone: "zone-lv".into(),
            block: "block-lv".into(),
            rack: rack.into(),
        };
        let mut node = serde_json::to_value(fleet.node(&topology)?)?;
        node["metadata"]["labels"][NVLINK_LABEL] = Value::from(nvlink);
        create_or_keep(&nodes, &serde_json::from_value(node)?).await?;
        create_or_keep(&slices, &fleet.resource_slice(&topology)?).await?;
    }
    Ok(())
}

/// The example's Workload (its claim template is the test namespace's own), renamed.
fn example(name: &str) -> Result<Value> {
    let mut workload = EXAMPLE
        .split("\n---\n")
        .map(serde_saphyr::from_str::<Value>)
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .find(|d| d["kind"] == "Workload")
        .context("a Workload in the example")?;
    workload["metadata"]["name"] = Value::from(name);
    Ok(workload)
}

/// Pod name → (rack, NVLink domain) of the node it is bound to.
async fn levels_of(test: &Test, name: &str) -> Result<BTreeMap<String, (String, String)>> {
    let nodes: Api<Node> = Api::all(test.client.clone());
    let mut out = BTreeMap::new();
    for pod in test.gang_pods(name).await? {
        let pod: Pod = pod;
        let node_name = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .context("a bound pod")?;
        let node = nodes.get(&node_name).await?;
        let labels = node.metadata.labels.unwrap_or_default();
        let label = |key: &str| labels.get(key).cloned().unwrap_or_default();
        out.insert(
            pod.metadata.name.clone().unwrap_or_default(),
            (label(RACK_LABEL), label(NVLINK_LABEL)),
        );
    }
    Ok(out)
}

/// The workers share one rack, and each pair (by index) one NVLink domain.
fn check_levels(name: &str, levels: &BTreeMap<String, (String, String)>) -> Result<String> {
    let worker = |i: usize| levels.get(&format!("{name}-workers-{i}")).context("a worker");
    let rack = worker(0)?.0.clone();
    for i in 0..4 {
        ensure!(worker(i)?.0 == rack, "workers in several racks: {levels:?}");
    }
    for pair in [(0, 1), (2, 3)] {
        ensure!(
            worker(pair.0)?.1 == worker(pair.1)?.1 && !worker(pair.0)?.1.is_empty(),
            "pair {pair:?} split over NVLink domains: {levels:?}"
        );
    }
    Ok(rack)
}

#[tokio::test]
async fn gangs_keep_their_levels_and_slices() -> Result<()> {
    with_test("topology-levels", &[], &[], |test| {
        Box::pin(async move {
            create_nodes(test).await?;

            // The example as written: only rack-lv-1 holds two whole pairs.
            test.create(example("levels")?).await?;
            test.wait_phase("levels", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            let placed = levels_of(test, "levels").await?;
            ensure!(check_levels("levels", &placed)? == "rack-lv-1", "{placed:?}");
            // The whole gang, launcher too, in the preferred rack.
            ensure!(placed["levels-launcher-0"].0 == "rack-lv-1", "{placed:?}");

            // A second gang finds one whole pair in rack-lv-0: it waits and says which
            // level failed, holding nothing.
            test.create(example("levels-2")?).await?;
            let message = test
                .wait_admitted_reason("levels-2", "Unschedulable", Duration::from_secs(60))
                .await?;
            ensure!(
                message.contains(&format!(
                    "all in one {RACK_LABEL}, in slices of 2 each in one {NVLINK_LABEL}"
                )),
                "{message}"
            );
            ensure!(
                test.gang_claims("levels-2").await?.iter().all(|c| c
                    .status
                    .as_ref()
                    .and_then(|s| s.allocation.as_ref())
                    .is_none()),
                "the waiting gang holds devices"
            );

            // Once the first gang is gone, the second takes its pairs.
            test.workloads().delete("levels", &DeleteParams::default()).await?;
            test.wait_phase("levels-2", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            let placed = levels_of(test, "levels-2").await?;
            ensure!(check_levels("levels-2", &placed)? == "rack-lv-1", "{placed:?}");
            Ok(())
        })
    })
    .await
}
