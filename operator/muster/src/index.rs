//! Keeps the engine's [`ClusterState`] in step with the cluster: watches on Nodes, Pods,
//! ResourceSlices, DeviceClasses, DeviceTaintRules and ResourceClaims feed it one change
//! at a time. No
//! object store is kept for these kinds: the engine's compact model is the cache.

use std::collections::HashSet;
use std::fmt::Debug;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, DeviceTaintRule, ResourceClaim, ResourceSlice};
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use muster_engine::cluster::ClusterState;
use serde::de::DeserializeOwned;
use tokio::sync::Notify;
use tracing::warn;

use crate::convert;

/// Kinds the index watches; it is ready when every one has listed (a kind the cluster
/// does not serve counts as listed).
const KINDS: usize = 6;

/// The engine's cluster state, shared with the admission loop.
pub struct Index {
    cluster: Mutex<ClusterState>,
    /// Signalled on every change, so waiting gangs are planned again.
    pub changed: Notify,
    listed: AtomicUsize,
    /// Counts changes, so the admission loop knows whether a retry can see anything new.
    changes: std::sync::atomic::AtomicU64,
    /// Signalled when every kind has listed once.
    pub ready: Notify,
}

impl Default for Index {
    fn default() -> Self {
        Index {
            cluster: Mutex::new(ClusterState::new()),
            changed: Notify::new(),
            listed: AtomicUsize::new(0),
            changes: std::sync::atomic::AtomicU64::new(0),
            ready: Notify::new(),
        }
    }
}

impl Index {
    /// The cluster state, locked. Hold it briefly: watches wait for it.
    pub fn cluster(&self) -> MutexGuard<'_, ClusterState> {
        self.cluster.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// How many changes the index has seen.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::SeqCst)
    }

    /// Whether every watched kind has listed at least once.
    pub fn is_ready(&self) -> bool {
        self.listed.load(Ordering::SeqCst) >= KINDS
    }

    /// Waits until [`Index::is_ready`].
    pub async fn wait_ready(&self) {
        while !self.is_ready() {
            let notified = self.ready.notified();
            if self.is_ready() {
                break;
            }
            notified.await;
        }
    }

    fn mark_listed(&self) {
        if self.listed.fetch_add(1, Ordering::SeqCst) + 1 == KINDS {
            self.ready.notify_waiters();
        }
    }
}

/// How one kind enters the cluster state.
trait Indexed: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static {
    fn key(&self) -> String {
        convert::key(self.meta().namespace.as_deref(), self.meta().name.as_deref())
    }
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError>;
    fn remove(key: &str, cluster: &mut ClusterState);
}

impl Indexed for Node {
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        cluster.upsert_node(convert::node(self)?);
        Ok(())
    }
    fn remove(key: &str, cluster: &mut ClusterState) {
        cluster.remove_node(key.trim_start_matches('/'));
    }
}

impl Indexed for Pod {
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        let key = Indexed::key(self);
        match (convert::pod_node(self), self.spec.as_ref()) {
            (Some(node), Some(spec)) => {
                cluster.observe_pod_bound(&key, &node, convert::pod_requests(&format!("Pod {key}"), spec)?)
            }
            _ => cluster.observe_pod_unbound(&key),
        }
        Ok(())
    }
    fn remove(key: &str, cluster: &mut ClusterState) {
        cluster.remove_pod(key);
    }
}

impl Indexed for ResourceSlice {
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        cluster.upsert_slice(convert::slice(self)?);
        Ok(())
    }
    fn remove(key: &str, cluster: &mut ClusterState) {
        cluster.remove_slice(key.trim_start_matches('/'));
    }
}

impl Indexed for DeviceClass {
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        cluster.upsert_class(convert::device_class(self));
        Ok(())
    }
    fn remove(key: &str, cluster: &mut ClusterState) {
        cluster.remove_class(key.trim_start_matches('/'));
    }
}

impl Indexed for DeviceTaintRule {
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        cluster.upsert_taint_rule(
            self.metadata.name.as_deref().unwrap_or_default(),
            convert::taint_rule(self),
        );
        Ok(())
    }
    fn remove(key: &str, cluster: &mut ClusterState) {
        cluster.remove_taint_rule(key.trim_start_matches('/'));
    }
}

impl Indexed for ResourceClaim {
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        let key = Indexed::key(self);
        let devices = self
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .map(|a| convert::allocation_devices(&format!("ResourceClaim {key}"), a))
            .transpose()?;
        cluster.observe_claim_allocation(&key, devices);
        Ok(())
    }
    fn remove(key: &str, cluster: &mut ClusterState) {
        cluster.set_claim_allocation(key, None);
    }
}

/// Watches every kind until the process stops.
pub async fn run(client: Client, index: Arc<Index>) {
    tokio::join!(
        watch::<Node>(Api::all(client.clone()), index.clone(), false),
        watch::<Pod>(Api::all(client.clone()), index.clone(), false),
        watch::<ResourceSlice>(Api::all(client.clone()), index.clone(), false),
        watch::<DeviceClass>(Api::all(client.clone()), index.clone(), false),
        watch::<ResourceClaim>(Api::all(client.clone()), index.clone(), false),
        watch_taint_rules(client.clone(), index.clone()),
    );
}

/// Watches DeviceTaintRules where the cluster serves them in resource.k8s.io/v1 (1.37
/// on; before, only behind a feature gate in a beta or alpha version, which muster does
/// not read). A failed discovery is asked again with backoff, not taken for a "no"; the
/// index does not wait for it to be ready.
async fn watch_taint_rules(client: Client, index: Arc<Index>) {
    let group_version = DeviceTaintRule::api_version(&());
    let mut counted = false;
    let mut delay = std::time::Duration::from_secs(1);
    loop {
        match client.list_api_group_resources(&group_version).await {
            Ok(list) if list.resources.iter().any(|r| r.name == DeviceTaintRule::plural(&())) => {
                return watch::<DeviceTaintRule>(Api::all(client.clone()), index, counted).await;
            }
            Ok(_) => {
                if !counted {
                    index.mark_listed();
                }
                return;
            }
            Err(e) => {
                warn!(error = %e, retry_in = ?delay, "cannot tell whether the cluster serves DeviceTaintRules; asking again");
                if !counted {
                    counted = true;
                    index.mark_listed();
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(std::time::Duration::from_secs(60));
            }
        }
    }
}

/// Feeds one kind into the cluster state; `counted`: its first list already counts
/// towards the index being ready.
async fn watch<K: Indexed>(api: Api<K>, index: Arc<Index>, counted: bool) {
    let kind = K::kind(&());
    let mut known: HashSet<String> = HashSet::new();
    let mut relisting: Option<HashSet<String>> = None;
    let mut listed_once = counted;
    let mut events = watcher(api, watcher::Config::default()).default_backoff().boxed();
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                warn!(%kind, error = %e, "watch failed; retrying");
                continue;
            }
        };
        {
            let mut cluster = index.cluster();
            match event {
                watcher::Event::Init => relisting = Some(HashSet::new()),
                watcher::Event::InitApply(object) => {
                    apply(&object, &mut cluster);
                    relisting.get_or_insert_with(HashSet::new).insert(Indexed::key(&object));
                }
                watcher::Event::InitDone => {
                    let seen = relisting.take().unwrap_or_default();
                    for gone in known.difference(&seen) {
                        K::remove(gone, &mut cluster);
                    }
                    known = seen;
                }
                watcher::Event::Apply(object) => {
                    apply(&object, &mut cluster);
                    known.insert(Indexed::key(&object));
                }
                watcher::Event::Delete(object) => {
                    let key = Indexed::key(&object);
                    K::remove(&key, &mut cluster);
                    known.remove(&key);
                }
            }
        }
        if relisting.is_none() && !listed_once {
            listed_once = true;
            index.mark_listed();
        }
        index.changes.fetch_add(1, Ordering::SeqCst);
        index.changed.notify_one();
    }
}

fn apply<K: Indexed>(object: &K, cluster: &mut ClusterState) {
    if let Err(e) = object.apply(cluster) {
        // The object is unusable: forget it rather than keep a stale version.
        warn!(object = %e.object, error = %e.message, "ignoring an object the engine cannot use");
        K::remove(&Indexed::key(object), cluster);
    }
}
