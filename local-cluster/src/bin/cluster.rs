//! Starts the local control plane with a fake GPU fleet and keeps it up until Ctrl-C,
//! for development: `cargo run -p muster-local-cluster --bin cluster -- [NODES] [NODES_PER_RACK]`.

use anyhow::Result;
use muster_local_cluster::fleet::FleetSpec;
use muster_local_cluster::{ControlPlane, Options, install_crds};

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let nodes = args.next().map(|a| a.parse()).transpose()?.unwrap_or(8);
    let nodes_per_rack = args.next().map(|a| a.parse()).transpose()?.unwrap_or(4);
    let control_plane = ControlPlane::start(Options::default()).await?;
    let client = control_plane.client().await?;
    install_crds(&client).await?;
    FleetSpec {
        nodes,
        nodes_per_rack,
        ..FleetSpec::default()
    }
    .create(&client)
    .await?;
    let bin = muster_local_cluster::paths::control_plane_binaries()?;
    println!("export KUBECONFIG={}", control_plane.kubeconfig().display());
    println!("alias kubectl={}", bin.join("kubectl").display());
    println!("{nodes} nodes up; Ctrl-C stops the cluster");
    tokio::signal::ctrl_c().await?;
    control_plane.stop();
    Ok(())
}
