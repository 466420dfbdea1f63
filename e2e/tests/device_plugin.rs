//! GPUs requested the device-plugin way (`resources.limits: {nvidia.com/gpu: 8}`) on
//! nodes that advertise them as an extended resource, with no ResourceSlices, beside the
//! fleet's DRA nodes: muster counts them as node resources, places such gangs (and gangs
//! that mix both kinds) whole, and explains the one that does not fit in the resource it
//! asked for. An invariant checker runs beside the test.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams};
use muster_api::v1alpha1::WorkloadPhase;
use muster_e2e::scenario::{Test, with_test};
use muster_local_cluster::fleet::{FleetSpec, NodeTopology, create_or_keep};
use serde_json::{Value, json};

const GPU_RESOURCE: &str = "nvidia.com/gpu";
const EXAMPLE: &str = include_str!("../../examples/device-plugin-gpus.yaml");

/// Three kwok nodes whose GPUs a device plugin advertises: two in one rack, one alone.
fn device_plugin_nodes() -> Result<Vec<Node>> {
    let fleet = FleetSpec::default().fenced();
    [("dp-0", "rack-dp-0"), ("dp-1", "rack-dp-0"), ("dp-2", "rack-dp-1")]
        .into_iter()
        .map(|(name, rack)| {
            let topology = NodeTopology {
                name: name.into(),
                zone: "zone-dp".into(),
                block: "block-dp".into(),
                rack: rack.into(),
            };
            let mut node = serde_json::to_value(fleet.node(&topology)?)?;
            for field in ["allocatable", "capacity"] {
                node["status"][field][GPU_RESOURCE] = json!("8");
            }
            Ok(serde_json::from_value(node)?)
        })
        .collect()
}

/// Workers asking the device-plugin way for eight GPUs each.
fn plugin_group(name: &str, replicas: i32) -> Value {
    json!({
        "name": name,
        "replicas": replicas,
        "template": {"spec": {"containers": [{
            "name": "main",
            "image": "trainer",
            "resources": {
                "requests": {"cpu": "16", "memory": "64Gi"},
                "limits": {GPU_RESOURCE: "8"},
            },
        }]}},
    })
}

/// The nodes the gang's pods are bound to, by pod group.
async fn nodes_by_group(test: &Test, name: &str) -> Result<BTreeMap<String, Vec<String>>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for pod in test.gang_pods(name).await? {
        let group = pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(muster_api::labels::POD_GROUP))
            .cloned()
            .context("pod group label")?;
        let node = pod.spec.and_then(|s| s.node_name).context("a bound pod")?;
        out.entry(group).or_default().push(node);
    }
    Ok(out)
}

#[tokio::test]
async fn device_plugin_gpus_are_placed_whole_beside_dra_gpus() -> Result<()> {
    with_test("device-plugin", &[], &[], |test| {
        Box::pin(async move {
            let nodes: Api<Node> = Api::all(test.client.clone());
            for node in device_plugin_nodes()? {
                create_or_keep(&nodes, &node).await?;
            }

            // The example as a user writes it: two workers of eight device-plugin GPUs
            // in one rack, so on the two nodes of rack-dp-0.
            let example: Value = serde_saphyr::from_str(EXAMPLE)?;
            test.create(example).await?;
            test.wait_phase("plugin-gpus", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            let placed = nodes_by_group(test, "plugin-gpus").await?;
            let mut workers = placed.get("workers").cloned().unwrap_or_default();
            workers.sort();
            ensure!(workers == ["dp-0", "dp-1"], "workers on {workers:?}");
            ensure!(test.gang_claims("plugin-gpus").await?.is_empty(), "no ResourceClaims");

            // A gang mixing both kinds: DRA workers on the fleet, device-plugin workers
            // on the node left.
            let mut mixed = muster_e2e::scenario::gang("mixed", 2, None);
            mixed["spec"].as_object_mut().context("spec")?.remove("topology");
            mixed["spec"]["podGroups"]
                .as_array_mut()
                .context("groups")?
                .push(plugin_group("plugin-workers", 1));
            test.create(mixed).await?;
            test.wait_phase("mixed", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            let placed = nodes_by_group(test, "mixed").await?;
            ensure!(
                placed.get("plugin-workers").map(Vec::as_slice) == Some(&["dp-2".to_string()][..]),
                "device-plugin workers on {placed:?}"
            );
            ensure!(
                placed["workers"].iter().all(|n| n.starts_with("node-")),
                "DRA workers on the DRA fleet: {placed:?}"
            );

            // No device-plugin GPUs are left: the next such gang holds nothing and says
            // which resource it lacks.
            test.create(json!({
                "apiVersion": "muster.dev/v1alpha1",
                "kind": "Workload",
                "metadata": {"name": "waits"},
                "spec": {"podGroups": [plugin_group("workers", 1)]},
            }))
            .await?;
            let message = test
                .wait_admitted_reason("waits", "Unschedulable", Duration::from_secs(60))
                .await?;
            ensure!(message.contains("8 nvidia.com/gpu"), "{message}");

            // Once the first gang is gone its GPUs are free again.
            test.workloads().delete("plugin-gpus", &DeleteParams::default()).await?;
            test.wait_phase("waits", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            let placed = nodes_by_group(test, "waits").await?;
            ensure!(
                placed["workers"].iter().all(|n| n == "dp-0" || n == "dp-1"),
                "{placed:?}"
            );
            Ok(())
        })
    })
    .await
}
