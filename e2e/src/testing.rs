//! Shared pieces of the e2e tests: one control plane per test binary, a namespace per
//! test, and the operator as a child process.

use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, DeleteParams, PostParams};
use tokio::sync::{Mutex, MutexGuard, OnceCell};

use crate::fleet::{FleetSpec, NodeTopology};
use crate::{ControlPlane, Options, wait};

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
            crate::install_crds(&client).await?;
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

/// A namespace for one test, ready for pods (its default ServiceAccount exists).
pub async fn namespace(client: &kube::Client, prefix: &str) -> Result<String> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let mut ns = Namespace::default();
    ns.metadata.generate_name = Some(format!("{prefix}-"));
    let created = namespaces
        .create(&PostParams::default(), &ns)
        .await
        .context("creating a test namespace")?;
    let name = created.metadata.name.context("namespace without a name")?;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &name);
    wait::until(
        "the namespace's default ServiceAccount",
        Duration::from_secs(60),
        || {
            let accounts = accounts.clone();
            async move { Ok(accounts.get_opt("default").await?.map(|_| ())) }
        },
    )
    .await?;
    Ok(name)
}

/// Deletes a test namespace (without waiting for it to go).
pub async fn delete_namespace(client: &kube::Client, name: &str) -> Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces.delete(name, &DeleteParams::default()).await?;
    Ok(())
}
