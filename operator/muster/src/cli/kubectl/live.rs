//! The live cluster read into the same objects `muster plan` reads from a file, so that
//! `why` plans with the very code the offline planner and the operator use.

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{LimitRange, Node, Pod};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, ListParams};

use crate::snapshot::Objects;

/// Lists every object of `kind` the planner reads. Pages through large clusters.
async fn list<K>(api: Api<K>, what: &str) -> Result<Vec<K>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut items = Vec::new();
    let mut params = ListParams::default().limit(500);
    loop {
        let page = api.list(&params).await.with_context(|| format!("listing {what}"))?;
        items.extend(page.items);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(items),
        }
    }
}

/// The cluster as the planner sees it: nodes, pods, ResourceSlices, DeviceClasses,
/// DeviceTaintRules, ResourceClaims and PriorityClasses, read now.
pub(super) async fn cluster(client: &kube::Client) -> Result<Objects> {
    let (nodes, pods, slices, classes, claims, priorities, taint_rules) = tokio::try_join!(
        list(Api::<Node>::all(client.clone()), "nodes"),
        list(Api::<Pod>::all(client.clone()), "pods"),
        list(Api::<ResourceSlice>::all(client.clone()), "resourceslices"),
        list(Api::<DeviceClass>::all(client.clone()), "deviceclasses"),
        list(Api::<ResourceClaim>::all(client.clone()), "resourceclaims"),
        list(Api::<PriorityClass>::all(client.clone()), "priorityclasses"),
        taint_rules(client),
    )?;
    let mut objects = Objects::default();
    for node in &nodes {
        objects.add_node(node)?;
    }
    for slice in &slices {
        objects.add_slice(slice)?;
    }
    for pod in pods {
        objects.add_pod(pod)?;
    }
    objects.classes = classes;
    objects.claims = claims;
    objects.priority_classes = priorities;
    objects.taint_rules = taint_rules;
    Ok(objects)
}

/// DeviceTaintRules, where the cluster serves them (on by default from 1.37).
async fn taint_rules(client: &kube::Client) -> Result<Vec<k8s_openapi::api::resource::v1::DeviceTaintRule>> {
    match list(Api::all(client.clone()), "devicetaintrules").await {
        Ok(rules) => Ok(rules),
        Err(e)
            if e.chain()
                .any(|c| matches!(c.downcast_ref::<kube::Error>(), Some(kube::Error::Api(s)) if s.code == 404)) =>
        {
            Ok(Vec::new())
        }
        Err(e) => Err(e),
    }
}

/// The ResourceClaimTemplates of a namespace: the gang's claims are made from them.
/// The namespace's LimitRanges and the cluster's RuntimeClasses: the defaults and
/// overhead the API server gives the gang's pods not made yet. Either is left out where
/// the caller may not read it (the plan then warns of LimitRanges it could not see).
pub(super) async fn pod_defaults(client: &kube::Client, namespace: &str) -> (Vec<LimitRange>, Vec<RuntimeClass>) {
    let (ranges, classes) = tokio::join!(
        list(Api::<LimitRange>::namespaced(client.clone(), namespace), "limitranges"),
        list(Api::<RuntimeClass>::all(client.clone()), "runtimeclasses"),
    );
    (ranges.unwrap_or_default(), classes.unwrap_or_default())
}

pub(super) async fn templates(client: &kube::Client, namespace: &str) -> Result<Vec<ResourceClaimTemplate>> {
    list(Api::namespaced(client.clone(), namespace), "resourceclaimtemplates").await
}
