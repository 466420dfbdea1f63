//! Shared pieces of the e2e tests: one control plane per test binary, a namespace per
//! test, and the operator as a child process.

use std::sync::OnceLock;

use anyhow::Result;
use tokio::sync::{Mutex, MutexGuard, OnceCell};

use muster_local_cluster::fleet::{FleetSpec, NodeTopology};
use muster_local_cluster::{ControlPlane, Options};

/// A control plane with a fleet, shared by the tests of one test binary. The processes
/// end with the test binary (see [`crate::process`]).
pub struct SharedCluster {
    pub control_plane: ControlPlane,
    pub nodes: Vec<NodeTopology>,
    pub fleet: FleetSpec,
}

/// Starts the shared cluster on first use, with the CRDs installed and `fleet` created.
pub async fn shared_cluster(fleet: FleetSpec) -> Result<&'static SharedCluster> {
    static CLUSTER: OnceCell<SharedCluster> = OnceCell::const_new();
    CLUSTER
        .get_or_try_init(|| async {
            let control_plane = ControlPlane::start(Options::default()).await?;
            let client = control_plane.client().await?;
            muster_local_cluster::install_crds(&client).await?;
            let nodes = fleet.create(&client).await?;
            Ok(SharedCluster {
                control_plane,
                nodes,
                fleet,
            })
        })
        .await
}

/// Tests that run the operator take this lock: two operators would act on each other's
/// Workloads.
pub async fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: OnceLock<Mutex<()>> = OnceLock::new();
    LOCK.get_or_init(|| Mutex::new(())).lock().await
}

pub use muster_local_cluster::namespaces::{delete_namespace, namespace};
