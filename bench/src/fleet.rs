//! Resetting the cluster to a scenario's fleet: every node and slice of the last one
//! goes, the new one is created.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Result;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, DeleteParams, ListParams};
use muster_local_cluster::fleet::FleetSpec;

/// Replaces every node and ResourceSlice with `fleet`'s; returns the rack of each node.
pub async fn reset(client: &kube::Client, fleet: &FleetSpec) -> Result<HashMap<String, String>> {
    let nodes: Api<Node> = Api::all(client.clone());
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    nodes
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await?;
    slices
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await?;
    muster_local_cluster::wait::until("the last fleet to go", Duration::from_secs(300), || async {
        let left = nodes.list_metadata(&ListParams::default().limit(1)).await?.items.len()
            + slices.list_metadata(&ListParams::default().limit(1)).await?.items.len();
        Ok((left == 0).then_some(()))
    })
    .await?;
    let topology = fleet.create(client).await?;
    // Every node must be Ready before anything is scheduled onto it.
    let expected = topology.len();
    muster_local_cluster::wait::until("the fleet's nodes to be ready", Duration::from_secs(600), || async {
        let ready = nodes
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|n| {
                n.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .count();
        Ok((ready >= expected).then_some(()))
    })
    .await?;
    Ok(topology.into_iter().map(|t| (t.name, t.rack)).collect())
}
