//! muster's end-to-end harness: a real local control plane built from the official Go
//! modules, a fake GPU fleet published the way a DRA driver would, and helpers to run
//! the operator against it.

pub mod apply;
pub mod chart;
pub mod controlplane;
pub mod fleet;
pub mod invariants;
pub mod kueue;
pub mod operator;
pub mod paths;
pub mod pki;
pub mod process;
pub mod rbac;
pub mod rng;
pub mod scenario;
pub mod testing;
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
