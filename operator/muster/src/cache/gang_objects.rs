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
use kube::api::{Api, DynamicObject};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use muster_api::labels;

use crate::cache::touched::Touched;
use crate::kube_ops;

/// `(namespace, Workload)`.
type GangKey = (String, String);

/// Names of the objects each gang's label named when last seen, kept up from the watch
/// events: a name goes with its object's Delete event, or at the end of a relist that no
/// longer shows it. Lookups check the label against the store, since an object may have
/// been relabelled since.
#[derive(Default)]
struct ByGang(Mutex<HashMap<GangKey, BTreeSet<String>>>);

fn gang_key<K: Resource>(object: &K) -> Option<(GangKey, String)> {
    let meta = object.meta();
    let workload = meta.labels.as_ref()?.get(labels::WORKLOAD)?;
    Some(((meta.namespace.clone()?, workload.clone()), meta.name.clone()?))
}

impl ByGang {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<GangKey, BTreeSet<String>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Follows one watch event; `store` has applied it already.
    fn follow<K>(&self, event: &watcher::Event<K>, store: &Store<K>)
    where
        K: Resource<DynamicType = ()> + Clone + 'static,
    {
        match event {
            watcher::Event::Apply(object) | watcher::Event::InitApply(object) => {
                if let Some((key, name)) = gang_key(object) {
                    self.entries().entry(key).or_default().insert(name);
                }
            }
            watcher::Event::Delete(object) => {
                if let Some((key, name)) = gang_key(object) {
                    let mut entries = self.entries();
                    if let Some(names) = entries.get_mut(&key) {
                        names.remove(&name);
                        if names.is_empty() {
                            entries.remove(&key);
                        }
                    }
                }
            }
            // The relist is in the store now: what it no longer shows is gone.
            watcher::Event::InitDone => self.entries().retain(|(namespace, _), names| {
                names.retain(|name| store.get(&ObjectRef::new(name).within(namespace)).is_some());
                !names.is_empty()
            }),
            watcher::Event::Init => {}
        }
    }

    fn lookup<K>(&self, store: &Store<K>, namespace: &str, workload: &str) -> Vec<Arc<K>>
    where
        K: Resource<DynamicType = ()> + Clone + 'static,
    {
        let key = (namespace.to_string(), workload.to_string());
        let entries = self.entries();
        let Some(names) = entries.get(&key) else {
            return Vec::new();
        };
        names
            .iter()
            .filter_map(|name| store.get(&ObjectRef::new(name).within(namespace)))
            .filter(|object| object.labels().get(labels::WORKLOAD).map(String::as_str) == Some(workload))
            .collect()
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
    /// Kueue's Workloads that stand for gangs, when the cluster serves Kueue.
    pub kueue: Option<Store<DynamicObject>>,
    /// Kueue's AdmissionChecks and ResourceFlavors, when the cluster serves Kueue.
    pub kueue_checks: Option<Store<DynamicObject>>,
    pub kueue_flavors: Option<Store<DynamicObject>>,
}

impl GangStores {
    /// The Kueue Workload standing for `workload`, when Kueue is served.
    /// Only one made for this very Workload counts (its job-uid label): one left by a
    /// deleted Workload of the same name is not its.
    pub fn kueue_workload(&self, workload: &muster_api::v1alpha1::Workload) -> Option<Arc<DynamicObject>> {
        let store = self.kueue.as_ref()?;
        let namespace = workload.namespace()?;
        store
            .get(
                &ObjectRef::new_with(&crate::kueue::object_name(workload), crate::kueue::api_resource())
                    .within(&namespace),
            )
            .filter(|o| crate::kueue::made_for(o, workload))
    }

    /// Whether every store has listed, without waiting.
    pub fn is_ready(&self) -> bool {
        futures::FutureExt::now_or_never(self.wait_until_ready()).is_some()
    }

    /// Waits until every store has listed.
    pub async fn wait_until_ready(&self) {
        let kueue = async {
            for store in [&self.kueue, &self.kueue_checks, &self.kueue_flavors]
                .into_iter()
                .flatten()
            {
                let _ = store.wait_until_ready().await;
            }
        };
        let _ = tokio::join!(
            self.pods.wait_until_ready(),
            self.claims.wait_until_ready(),
            self.services.wait_until_ready(),
            kueue
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

/// The watches that feed [`GangStores`]; the controller drives them, except Kueue's,
/// which `kueue` drives on its own.
pub struct GangWatches {
    pub pods: Events<Pod>,
    pub claims: Events<ResourceClaim>,
    pub services: Events<Service>,
    pub kueue: Option<Events<DynamicObject>>,
}

/// Whether the cluster serves Kueue's Workloads (`kueue.x-k8s.io/v1beta2`). A failed
/// discovery counts as no: muster then works as without Kueue, and says so.
pub async fn kueue_served(client: &Client) -> bool {
    let served = match client.list_api_group_resources("kueue.x-k8s.io/v1beta2").await {
        Ok(list) => list.resources.iter().any(|r| r.name == "workloads"),
        Err(e) if kube_ops::is_not_found(&e) => false,
        Err(e) => {
            tracing::warn!(error = %e, "cannot tell whether the cluster serves Kueue; running without it");
            false
        }
    };
    if !served {
        return false;
    }
    // Installed but not readable (the chart's rbac.kueue is off): a watch that can never
    // list would hold admission back for good.
    for resource in [
        crate::kueue::api_resource(),
        crate::kueue::admission_check_resource(),
        crate::kueue::flavor_resource(),
    ] {
        let api = Api::<DynamicObject>::all_with(client.clone(), &resource);
        if let Err(e) = api.list(&kube::api::ListParams::default().limit(1)).await {
            tracing::warn!(error = %e, kind = %resource.kind, "the cluster serves Kueue, but muster may not read it; running without it");
            return false;
        }
    }
    true
}

/// A cache of one kind of gang object, with its index by Workload and the watch that
/// feeds both (and tells `changed`).
fn indexed_watch<K>(
    client: &Client,
    config: &watcher::Config,
    changed: &Arc<tokio::sync::Notify>,
    touched: &Arc<Touched>,
) -> (Store<K>, Arc<ByGang>, Events<K>)
where
    K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    let by_gang = Arc::new(ByGang::default());
    let (store, writer) = reflector::store();
    let events = watcher(Api::<K>::all(client.clone()), config.clone())
        .default_backoff()
        .modify(|object| object.managed_fields_mut().clear())
        .reflect(writer)
        .inspect({
            let by_gang = by_gang.clone();
            let store = store.clone();
            move |event| {
                if let Ok(event) = event {
                    by_gang.follow(event, &store);
                }
            }
        })
        .inspect(touch_gangs(touched, K::kind(&()) == "ResourceClaim"))
        .touched_objects()
        .inspect({
            let changed = changed.clone();
            move |_| changed.notify_one()
        })
        .boxed();
    (store, by_gang, events)
}

/// Records the gang of each object a watch event shows (by its workload label) as
/// touched, and with `claims` the object itself as a changed claim (a claim carries the
/// label of one Workload only, and others may hold it); a relist touches everything
/// (what it no longer shows is not told one by one).
fn touch_gangs<K: Resource>(
    touched: &Arc<Touched>,
    claims: bool,
) -> impl Fn(&Result<watcher::Event<K>, watcher::Error>) + use<K> {
    let touched = touched.clone();
    move |event| match event {
        Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object) | watcher::Event::Delete(object)) => {
            if let Some(((namespace, workload), name)) = gang_key(object) {
                touched.gang(&namespace, &workload);
                if claims {
                    touched.claim(&namespace, &name);
                }
            }
        }
        Ok(watcher::Event::InitDone) => touched.everything(),
        Ok(watcher::Event::Init) | Err(_) => {}
    }
}

/// Sets up the gang object caches and their watches.
/// `changed` is told about every event, so the admission loop sees gang objects change
/// (for example claims of a deleted Workload, which no reconcile reports).
/// `kueue`: also cache Kueue's Workloads that stand for gangs.
/// `touched` records the gangs whose objects changed.
pub fn gang_watches(
    client: &Client,
    changed: Arc<tokio::sync::Notify>,
    touched: Arc<Touched>,
    kueue: bool,
) -> (GangStores, GangWatches) {
    let gang_objects = watcher::Config::default().labels(labels::WORKLOAD);
    let (pods, pods_by_gang, pod_events) = indexed_watch::<Pod>(client, &gang_objects, &changed, &touched);
    let (claims, claims_by_gang, claim_events) =
        indexed_watch::<ResourceClaim>(client, &gang_objects, &changed, &touched);
    let follow = |resource: kube::api::ApiResource, config: watcher::Config| {
        let writer = reflector::store::Writer::new(resource.clone());
        let store = writer.as_reader();
        let events = watcher(Api::<DynamicObject>::all_with(client.clone(), &resource), config)
            .default_backoff()
            .modify(|o| o.managed_fields_mut().clear())
            .reflect(writer)
            .inspect(touch_gangs(&touched, false))
            .touched_objects()
            .inspect({
                let changed = changed.clone();
                move |_| changed.notify_one()
            })
            .boxed();
        (store, events)
    };
    // Kueue's checks and flavors change what it says of every gang.
    let touching_all = |(store, events): (Store<DynamicObject>, Events<DynamicObject>)| {
        let touched = touched.clone();
        (store, events.inspect(move |_| touched.everything()).boxed())
    };
    let (kueue_store, kueue_checks, kueue_flavors, kueue_events) = if kueue {
        let (workloads, workload_events) = follow(crate::kueue::api_resource(), gang_objects.clone());
        let (checks, check_events) = touching_all(follow(
            crate::kueue::admission_check_resource(),
            watcher::Config::default(),
        ));
        let (flavors, flavor_events) =
            touching_all(follow(crate::kueue::flavor_resource(), watcher::Config::default()));
        let events = futures::stream::select_all([workload_events, check_events, flavor_events]).boxed();
        (Some(workloads), Some(checks), Some(flavors), Some(events))
    } else {
        (None, None, None, None)
    };
    let (services, services_writer) = reflector::store();
    let service_events = watcher(Api::<Service>::all(client.clone()), gang_objects)
        .default_backoff()
        .reflect(services_writer)
        .inspect(touch_gangs(&touched, false))
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
            kueue: kueue_store,
            kueue_checks,
            kueue_flavors,
        },
        GangWatches {
            pods: pod_events,
            claims: claim_events,
            services: service_events,
            kueue: kueue_events,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::reflector::store::Writer;

    fn pod(name: &str, workload: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns", "labels": {labels::WORKLOAD: workload}},
        }))
        .unwrap()
    }

    /// Feeds an event to the store, then to the index, as the watch stream does.
    fn feed(writer: &mut Writer<Pod>, by_gang: &ByGang, store: &Store<Pod>, event: watcher::Event<Pod>) {
        writer.apply_watcher_event(&event);
        by_gang.follow(&event, store);
    }

    fn names(pods: Vec<Arc<Pod>>) -> Vec<String> {
        pods.iter().map(|p| p.name_any()).collect()
    }

    #[test]
    fn a_lookup_during_a_relist_loses_nothing() {
        let mut writer: Writer<Pod> = Writer::default();
        let store = writer.as_reader();
        let by_gang = ByGang::default();
        feed(&mut writer, &by_gang, &store, watcher::Event::Init);
        feed(
            &mut writer,
            &by_gang,
            &store,
            watcher::Event::InitApply(pod("a-0", "a")),
        );
        // The store shows the relist only once it is complete.
        assert!(by_gang.lookup(&store, "ns", "a").is_empty());
        feed(
            &mut writer,
            &by_gang,
            &store,
            watcher::Event::InitApply(pod("a-1", "a")),
        );
        feed(&mut writer, &by_gang, &store, watcher::Event::InitDone);
        assert_eq!(names(by_gang.lookup(&store, "ns", "a")), ["a-0", "a-1"]);

        // Deleted, relabelled, and gone during a gap in the watch.
        feed(&mut writer, &by_gang, &store, watcher::Event::Delete(pod("a-0", "a")));
        assert_eq!(names(by_gang.lookup(&store, "ns", "a")), ["a-1"]);
        feed(&mut writer, &by_gang, &store, watcher::Event::Apply(pod("a-1", "b")));
        assert!(by_gang.lookup(&store, "ns", "a").is_empty());
        assert_eq!(names(by_gang.lookup(&store, "ns", "b")), ["a-1"]);
        feed(&mut writer, &by_gang, &store, watcher::Event::Init);
        feed(&mut writer, &by_gang, &store, watcher::Event::InitDone);
        assert!(by_gang.lookup(&store, "ns", "b").is_empty());
        assert!(by_gang.entries().is_empty(), "nothing kept for objects that are gone");
    }
}
