//! A real local Kubernetes control plane for muster's demo, end-to-end tests and
//! benchmark: etcd, kube-apiserver, kube-scheduler and kube-controller-manager built from
//! the official Go modules (cached outside the repository), kwok nodes, a fake GPU fleet
//! published the way a DRA driver would, Kueue, and muster as a child process.

pub mod apply;
pub mod controlplane;
pub mod fleet;
pub mod frameworks;
pub mod kueue;
pub mod namespaces;
pub mod operator;
pub mod paths;
pub mod pki;
pub mod process;
pub mod wait;

use anyhow::Result;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};

pub use controlplane::{ControlPlane, Options};

/// Installs (or updates) muster's CRDs with server-side apply and waits until they are
/// established.
pub async fn install_crds(client: &kube::Client) -> Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in muster_api::crd::crds() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        api.patch(&name, &PatchParams::apply("muster-e2e").force(), &Patch::Apply(&crd))
            .await?;
        wait_established(&api, &name).await?;
    }
    Ok(())
}

/// Waits until CRD `name` is established.
pub async fn wait_established(api: &Api<CustomResourceDefinition>, name: &str) -> Result<()> {
    wait::until(
        &format!("CRD {name} to be established"),
        std::time::Duration::from_secs(60),
        || {
            let (api, name) = (api.clone(), name.to_string());
            async move {
                let crd = api.get(&name).await?;
                let established = crd
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True");
                Ok(established.then_some(()))
            }
        },
    )
    .await
}
