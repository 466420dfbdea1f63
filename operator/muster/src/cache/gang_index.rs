//! The gang objects of the caches — pods and claims carrying the `muster.dev/workload`
//! label — grouped by namespace and Workload, taken once per admission pass, so that
//! looking at every gang costs one walk over the caches rather than one per gang.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Resource;
use muster_api::labels;

use crate::cache::gang_objects::GangStores;

type GangKey = (String, String);

#[derive(Default)]
pub struct GangIndex {
    pods: HashMap<GangKey, Vec<Arc<Pod>>>,
    claims: HashMap<GangKey, Vec<Arc<ResourceClaim>>>,
    /// Every gang's claims of a namespace: a claim two Workloads share carries only the
    /// label of the first that joined it.
    namespace_claims: HashMap<String, Vec<Arc<ResourceClaim>>>,
    /// The same claims by `(namespace, name)`: a gang's journal may name a claim that
    /// carries another Workload's label.
    by_name: HashMap<(String, String), Arc<ResourceClaim>>,
    /// The Workload of each gang pod, by the pod's uid: whose a `reservedFor` entry is.
    pod_workloads: HashMap<String, String>,
}

fn group<K: Resource>(objects: Vec<Arc<K>>) -> HashMap<GangKey, Vec<Arc<K>>> {
    let mut grouped: HashMap<GangKey, Vec<Arc<K>>> = HashMap::new();
    for object in objects {
        let meta = object.meta();
        let Some(workload) = meta.labels.as_ref().and_then(|l| l.get(labels::WORKLOAD)) else {
            continue;
        };
        let key = (meta.namespace.clone().unwrap_or_default(), workload.clone());
        grouped.entry(key).or_default().push(object);
    }
    grouped
}

impl GangIndex {
    pub fn of(stores: &GangStores) -> Self {
        let claims = stores.claims.state();
        let mut namespace_claims: HashMap<String, Vec<Arc<ResourceClaim>>> = HashMap::new();
        let mut by_name = HashMap::new();
        for claim in &claims {
            let namespace = claim.meta().namespace.clone().unwrap_or_default();
            let name = claim.meta().name.clone().unwrap_or_default();
            by_name.insert((namespace.clone(), name), claim.clone());
            namespace_claims.entry(namespace).or_default().push(claim.clone());
        }
        let pods = stores.pods.state();
        let pod_workloads = pods
            .iter()
            .filter_map(|p| {
                let workload = p.meta().labels.as_ref()?.get(labels::WORKLOAD)?;
                Some((p.meta().uid.clone()?, workload.clone()))
            })
            .collect();
        GangIndex {
            pods: group(pods),
            pod_workloads,
            claims: group(claims),
            namespace_claims,
            by_name,
        }
    }

    /// The claim `namespace/name`, whichever Workload's label it carries.
    pub fn claim(&self, namespace: &str, name: &str) -> Option<&Arc<ResourceClaim>> {
        self.by_name.get(&(namespace.to_string(), name.to_string()))
    }

    /// The Workload whose label the gang pod with this uid carries (a pod's namespace is
    /// its claims').
    pub fn pod_workload(&self, uid: &str) -> Option<&str> {
        self.pod_workloads.get(uid).map(String::as_str)
    }

    pub fn namespace_claims(&self, namespace: &str) -> &[Arc<ResourceClaim>] {
        self.namespace_claims.get(namespace).map_or(&[], Vec::as_slice)
    }

    pub fn pods(&self, namespace: &str, workload: &str) -> &[Arc<Pod>] {
        self.pods
            .get(&(namespace.to_string(), workload.to_string()))
            .map_or(&[], Vec::as_slice)
    }

    pub fn claims(&self, namespace: &str, workload: &str) -> &[Arc<ResourceClaim>] {
        self.claims
            .get(&(namespace.to_string(), workload.to_string()))
            .map_or(&[], Vec::as_slice)
    }
}
