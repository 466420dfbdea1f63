//! A fake GPU fleet: kwok nodes with topology labels, and for each node a ResourceSlice
//! of a test DRA driver, published the way a real driver would.

use anyhow::{Context, Result};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

/// Name of the test DRA driver, of its DeviceClass and of the domain of its attributes.
pub const GPU_DRIVER: &str = "gpu.example.com";
/// Node label keys of the fleet's topology, coarse to fine.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
pub const BLOCK_LABEL: &str = "example.com/block";
pub const RACK_LABEL: &str = "example.com/rack";

/// Shape of a fleet. Node `i` sits in rack `i / nodes_per_rack`, racks fill blocks and
/// blocks fill zones in order.
#[derive(Clone, Debug)]
pub struct FleetSpec {
    pub nodes: usize,
    pub nodes_per_rack: usize,
    pub racks_per_block: usize,
    pub blocks_per_zone: usize,
    pub gpus_per_node: usize,
    /// Node allocatable CPU, in cores.
    pub cpu: u32,
    /// Node allocatable memory, in GiB.
    pub memory_gib: u32,
    pub gpu_model: String,
    /// GPU memory capacity, in GiB.
    pub gpu_memory_gib: u32,
    /// GPUs per NVLink domain on a node (the `nvlinkDomain` attribute).
    pub gpus_per_nvlink_domain: usize,
    /// Concurrent create requests.
    pub parallelism: usize,
    /// Node taints as (key, value, effect), for example the fence muster's pods tolerate.
    pub taints: Vec<(String, String, String)>,
}

impl Default for FleetSpec {
    fn default() -> Self {
        FleetSpec {
            nodes: 4,
            nodes_per_rack: 2,
            racks_per_block: 2,
            blocks_per_zone: 2,
            gpus_per_node: 8,
            cpu: 64,
            memory_gib: 512,
            gpu_model: "H100".into(),
            gpu_memory_gib: 80,
            gpus_per_nvlink_domain: 8,
            parallelism: 32,
            taints: Vec::new(),
        }
    }
}

/// Where a node sits in the fleet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeTopology {
    pub name: String,
    pub zone: String,
    pub block: String,
    pub rack: String,
}

impl FleetSpec {
    pub fn with_nodes(nodes: usize) -> Self {
        FleetSpec {
            nodes,
            ..FleetSpec::default()
        }
    }

    /// Taints every node with muster's fence, so only muster's pods may use the devices.
    pub fn fenced(mut self) -> Self {
        self.taints
            .push(("muster.dev/fenced".into(), "true".into(), "NoSchedule".into()));
        self
    }

    /// Names and topology of every node, in order.
    pub fn topology(&self) -> Vec<NodeTopology> {
        (0..self.nodes)
            .map(|i| {
                let rack = i / self.nodes_per_rack.max(1);
                let block = rack / self.racks_per_block.max(1);
                let zone = block / self.blocks_per_zone.max(1);
                NodeTopology {
                    name: format!("node-{i:05}"),
                    zone: format!("zone-{zone}"),
                    block: format!("block-{block:03}"),
                    rack: format!("rack-{rack:04}"),
                }
            })
            .collect()
    }

    /// The Node object kwok will manage.
    pub fn node(&self, topology: &NodeTopology) -> Result<Node> {
        let value = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": topology.name,
                "annotations": {
                    "node.alpha.kubernetes.io/ttl": "0",
                    "kwok.x-k8s.io/node": "fake",
                },
                "labels": {
                    "kubernetes.io/hostname": topology.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    ZONE_LABEL: topology.zone,
                    BLOCK_LABEL: topology.block,
                    RACK_LABEL: topology.rack,
                },
            },
            "spec": {
                "taints": self.taints.iter().map(|(key, value, effect)| json!({"key": key, "value": value, "effect": effect})).collect::<Vec<_>>(),
            },
            "status": {
                "allocatable": self.node_resources(),
                "capacity": self.node_resources(),
                "nodeInfo": {
                    "architecture": "amd64",
                    "kubeletVersion": "fake",
                    "kubeProxyVersion": "fake",
                    "operatingSystem": "linux",
                },
                "phase": "Running",
            },
        });
        Ok(serde_json::from_value(value)?)
    }

    fn node_resources(&self) -> Value {
        json!({"cpu": self.cpu.to_string(), "memory": format!("{}Gi", self.memory_gib), "pods": "110"})
    }

    /// The node's ResourceSlice: one pool per node, `gpus_per_node` devices.
    pub fn resource_slice(&self, topology: &NodeTopology) -> Result<ResourceSlice> {
        let devices: Vec<Value> = (0..self.gpus_per_node)
            .map(|index| {
                json!({
                    "name": format!("gpu-{index}"),
                    "attributes": {
                        "model": {"string": self.gpu_model},
                        "index": {"int": index},
                        "uuid": {"string": format!("GPU-{}-{index}", topology.name)},
                        "nvlinkDomain": {"int": index / self.gpus_per_nvlink_domain.max(1)},
                        "driverVersion": {"version": "550.54.15"},
                    },
                    "capacity": {
                        "memory": {"value": format!("{}Gi", self.gpu_memory_gib)},
                    },
                })
            })
            .collect();
        let value = json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": format!("{}-{}", topology.name, GPU_DRIVER)},
            "spec": {
                "driver": GPU_DRIVER,
                "nodeName": topology.name,
                "pool": {"name": topology.name, "generation": 1, "resourceSliceCount": 1},
                "devices": devices,
            },
        });
        Ok(serde_json::from_value(value)?)
    }

    /// The DeviceClass selecting every device of the test driver.
    pub fn device_class() -> Result<DeviceClass> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": GPU_DRIVER},
            "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{GPU_DRIVER}'")}}]},
        }))?)
    }

    /// Creates the DeviceClass, every node and every slice.
    pub async fn create(&self, client: &kube::Client) -> Result<Vec<NodeTopology>> {
        let classes: Api<DeviceClass> = Api::all(client.clone());
        create_or_keep(&classes, &Self::device_class()?).await?;
        let nodes: Api<Node> = Api::all(client.clone());
        let slices: Api<ResourceSlice> = Api::all(client.clone());
        let topology = self.topology();
        stream::iter(topology.iter())
            .map(|t| {
                let (nodes, slices) = (nodes.clone(), slices.clone());
                async move {
                    create_or_keep(&nodes, &self.node(t)?).await?;
                    create_or_keep(&slices, &self.resource_slice(t)?).await
                }
            })
            .buffer_unordered(self.parallelism.max(1))
            .try_collect::<Vec<()>>()
            .await?;
        Ok(topology)
    }
}

/// Creates `object` unless one of that name exists.
pub async fn create_or_keep<K>(api: &Api<K>, object: &K) -> Result<()>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(e) => Err(e).with_context(|| format!("creating {}", object.meta().name.as_deref().unwrap_or("?"))),
    }
}
