//! The caches of gang objects: the pods, claims and Services that carry the
//! `muster.dev/workload` label, watched once and shared by the controller and the
//! admission loop, with an index by namespace and Workload so that looking at one gang
//! does not walk every gang's objects. The engine's model of the cluster is fed by its
//! own watches (`index`); the Workloads are cached by the controller that reconciles them.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use muster_api::labels;

/// `(namespace, Workload)`.
type GangKey = (String, String);

/// Names of the objects each gang's label named when last seen. A name may outlive its
/// object or its label: lookups check both against the store and drop what is stale.
#[derive(Default)]
struct ByGang(Mutex<HashMap<GangKey, BTreeSet<String>>>);

impl ByGang {
    fn note<K: Resource>(&self, object: &K) {
        let meta = object.meta();
        let (Some(namespace), Some(name)) = (&meta.namespace, &meta.name) else {
            return;
        };
        let Some(workload) = meta.labels.as_ref().and_then(|l| l.get(labels::WORKLOAD)) else {
            return;
        };
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry((namespace.clone(), workload.clone()))
            .or_default()
            .insert(name.clone());
    }

    fn lookup<K>(&self, store: &Store<K>, namespace: &str, workload: &str) -> Vec<Arc<K>>
    where
        K: Resource<DynamicType = ()> + Clone + 'static,
    {
        let key = (namespace.to_string(), workload.to_string());
        let mut by_gang = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(names) = by_gang.get_mut(&key) else {
            return Vec::new();
        };
        let mut found = Vec::with_capacity(names.len());
        names.retain(|name| {
            let object = store.get(&ObjectRef::new(name).within(namespace));
            match object {
                Some(object) if object.labels().get(labels::WORKLOAD).map(String::as_str) == Some(workload) => {
                    found.push(object);
                    true
                }
                _ => false,
            }
        });
        if names.is_empty() {
            by_gang.remove(&key);
        }
        found
    }
}

/// Caches of the objects muster creates for gangs (selected by the workload label).
#[derive(Clone)]
pub struct GangStores {
    pub pods: Store<Pod>,
    pub claims: Store<ResourceClaim>,
    pub services: Store<Service>,
    pods_by_gang: Arc<ByGang>,
    claims_by_gang: Arc<ByGang>,
}

impl GangStores {
    /// Waits until every store has listed.
    pub async fn wait_until_ready(&self) {
        let _ = tokio::join!(
            self.pods.wait_until_ready(),
            self.claims.wait_until_ready(),
            self.services.wait_until_ready()
        );
    }

    /// The gang's pods, by the workload label.
    pub fn pods_of(&self, namespace: &str, workload: &str) -> Vec<Arc<Pod>> {
        self.pods_by_gang.lookup(&self.pods, namespace, workload)
    }

    /// The gang's claims, by the workload label.
    pub fn claims_of(&self, namespace: &str, workload: &str) -> Vec<Arc<ResourceClaim>> {
        self.claims_by_gang.lookup(&self.claims, namespace, workload)
    }
}

type Events<K> = futures::stream::BoxStream<'static, Result<K, watcher::Error>>;

/// The watches that feed [`GangStores`]; the controller drives them.
pub struct GangWatches {
    pub pods: Events<Pod>,
    pub claims: Events<ResourceClaim>,
    pub services: Events<Service>,
}

/// Sets up the gang object caches and their watches.
/// `changed` is told about every event, so the admission loop sees gang objects change
/// (for example claims of a deleted Workload, which no reconcile reports).
pub fn gang_watches(client: &Client, changed: Arc<tokio::sync::Notify>) -> (GangStores, GangWatches) {
    let gang_objects = watcher::Config::default().labels(labels::WORKLOAD);
    let pods_by_gang = Arc::new(ByGang::default());
    let claims_by_gang = Arc::new(ByGang::default());
    let (pods, pods_writer) = reflector::store();
    let pod_events = watcher(Api::<Pod>::all(client.clone()), gang_objects.clone())
        .default_backoff()
        .modify(|pod| pod.managed_fields_mut().clear())
        .reflect(pods_writer)
        .touched_objects()
        .inspect({
            let changed = changed.clone();
            let by_gang = pods_by_gang.clone();
            move |pod| {
                if let Ok(pod) = pod {
                    by_gang.note(pod);
                }
                changed.notify_one()
            }
        })
        .boxed();
    let (claims, claims_writer) = reflector::store();
    let claim_events = watcher(Api::<ResourceClaim>::all(client.clone()), gang_objects.clone())
        .default_backoff()
        .modify(|claim| claim.managed_fields_mut().clear())
        .reflect(claims_writer)
        .touched_objects()
        .inspect({
            let changed = changed.clone();
            let by_gang = claims_by_gang.clone();
            move |claim| {
                if let Ok(claim) = claim {
                    by_gang.note(claim);
                }
                changed.notify_one()
            }
        })
        .boxed();
    let (services, services_writer) = reflector::store();
    let service_events = watcher(Api::<Service>::all(client.clone()), gang_objects)
        .default_backoff()
        .reflect(services_writer)
        .touched_objects()
        .inspect({
            let changed = changed.clone();
            move |_| changed.notify_one()
        })
        .boxed();
    (
        GangStores {
            pods,
            claims,
            services,
            pods_by_gang,
            claims_by_gang,
        },
        GangWatches {
            pods: pod_events,
            claims: claim_events,
            services: service_events,
        },
    )
}
