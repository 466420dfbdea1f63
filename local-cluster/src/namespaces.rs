//! Namespaces for a test or a benchmark phase: created ready for pods, deleted without
//! waiting.

use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, DeleteParams, PostParams};

use crate::wait;

/// A fresh namespace named after `prefix`, ready for pods (its default ServiceAccount exists).
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

/// Deletes a namespace (without waiting for it to go).
pub async fn delete_namespace(client: &kube::Client, name: &str) -> Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces.delete(name, &DeleteParams::default()).await?;
    Ok(())
}
