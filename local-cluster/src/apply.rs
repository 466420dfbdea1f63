//! `kubectl apply --server-side` for YAML documents, used by the demo and the tests.

use anyhow::{Context, Result, bail};
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::{self, Scope};

/// Applies every document of `yaml` (server-side apply, field manager `manager`),
/// putting namespaced objects without a namespace into `namespace`. Returns the
/// applied objects as `kind/name`.
pub async fn apply_yaml(client: &kube::Client, namespace: &str, yaml: &str, manager: &str) -> Result<Vec<String>> {
    let documents: Vec<serde_json::Value> = serde_saphyr::from_multiple(yaml).context("parsing YAML")?;
    let mut applied = Vec::new();
    for document in documents.into_iter().filter(|d| !d.is_null()) {
        let mut object: DynamicObject = serde_json::from_value(document).context("not a Kubernetes object")?;
        let types = object.types.clone().context("object without apiVersion/kind")?;
        let gvk = GroupVersionKind::try_from(&types)?;
        let (resource, capabilities) = discovery::pinned_kind(client, &gvk)
            .await
            .with_context(|| format!("the cluster does not serve {}/{}", types.api_version, types.kind))?;
        let name = object.metadata.name.clone().context("object without metadata.name")?;
        let api: Api<DynamicObject> = match capabilities.scope {
            Scope::Namespaced => {
                let ns = object
                    .metadata
                    .namespace
                    .get_or_insert_with(|| namespace.to_string())
                    .clone();
                Api::namespaced_with(client.clone(), &ns, &resource)
            }
            Scope::Cluster => Api::all_with(client.clone(), &resource),
        };
        if name.is_empty() {
            bail!("{} without a name", types.kind);
        }
        api.patch(&name, &PatchParams::apply(manager).force(), &Patch::Apply(&object))
            .await
            .with_context(|| format!("applying {} {name}", types.kind))?;
        applied.push(format!("{}/{name}", types.kind));
    }
    Ok(applied)
}
