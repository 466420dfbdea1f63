//! Keeps the engine's [`ClusterState`] in step with the cluster: watches on Nodes, Pods,
//! ResourceSlices, DeviceClasses, DeviceTaintRules, ResourceClaims, and for the pods'
//! volumes and inter-pod affinity PersistentVolumeClaims, PersistentVolumes,
//! StorageClasses, CSINodes and Namespaces feed it one change at a time. No object store
//! is kept for these kinds: the engine's compact model is the cache.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, DeviceTaintRule, ResourceClaim, ResourceSlice};
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use muster_api::labels;
use muster_engine::cluster::ClusterState;
use muster_engine::key::{ClaimKey, ObjectKey, PodKey};
use serde::de::DeserializeOwned;
use tokio::sync::Notify;
use tracing::warn;

use crate::cache::touched::Touched;
use crate::convert;

/// Kinds the index watches; it is ready when every one has listed (a kind the cluster
/// does not serve counts as listed).
const KINDS: usize = 11;

/// The engine's cluster state, shared with the admission loop. Planners take a
/// snapshot and work on it off the lock; a watch that changes the state meanwhile
/// copies it first (copy on write), so neither waits for the other.
pub struct Index {
    cluster: Mutex<Arc<ClusterState>>,
    /// Signalled on every change, so waiting gangs are planned again.
    pub changed: Notify,
    listed: AtomicUsize,
    /// Counts changes, so the admission loop knows whether a retry can see anything new.
    changes: std::sync::atomic::AtomicU64,
    /// Signalled when every kind has listed once.
    pub ready: Notify,
    /// The highest ResourceClaim resourceVersion applied. Watch events come in the
    /// order of writes, so once it reaches a version every claim write up to it is in
    /// the state: the commit's conflict check reads the index instead of listing.
    claims_version: tokio::sync::watch::Sender<u64>,
    /// Every ResourceClaim could be read into the state: one that could not is missing
    /// from it, and the conflict check must list instead.
    claims_usable: std::sync::atomic::AtomicBool,
    /// What changed, for the admission loop to step only the gangs it concerns.
    pub touched: Arc<Touched>,
    /// Nodes whose last update the engine could not read: left out of the state (no plan
    /// goes there), yet not gone.
    unreadable_nodes: Mutex<BTreeSet<String>>,
    /// Claims carrying muster's allocation finalizer, and whether they carry the
    /// `muster.dev/workload` label: the gang caches select on the label, so one a user
    /// took it off (a stray) drops out of them, and the admission loop labels it again or
    /// collects it.
    muster_claims: Mutex<BTreeMap<ObjectKey, bool>>,
}

impl Default for Index {
    fn default() -> Self {
        Index {
            cluster: Mutex::new(Arc::new(ClusterState::new())),
            changed: Notify::new(),
            listed: AtomicUsize::new(0),
            changes: std::sync::atomic::AtomicU64::new(0),
            ready: Notify::new(),
            claims_version: tokio::sync::watch::Sender::new(0),
            claims_usable: std::sync::atomic::AtomicBool::new(true),
            touched: Arc::default(),
            unreadable_nodes: Mutex::default(),
            muster_claims: Mutex::default(),
        }
    }
}

impl Index {
    /// The cluster state as it is now, locked for a short read. Hold it briefly:
    /// watches wait for it. To plan, take a [`Index::snapshot`].
    pub fn cluster(&self) -> MutexGuard<'_, Arc<ClusterState>> {
        self.cluster.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The cluster state as it is now, to read for as long as needed without holding
    /// anyone up.
    pub fn snapshot(&self) -> Arc<ClusterState> {
        self.cluster().clone()
    }

    /// Changes the cluster state; copies it first if a snapshot is still in use.
    pub fn update<R>(&self, change: impl FnOnce(&mut ClusterState) -> R) -> R {
        change(Arc::make_mut(&mut self.cluster()))
    }

    /// Whether node `name` exists but its last update could not be read into the state
    /// (see [`Index::unreadable_nodes`]).
    pub fn node_unreadable(&self, name: &str) -> bool {
        self.unreadable_nodes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains(name)
    }

    /// How many changes the index has seen.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::SeqCst)
    }

    /// Counts a change the admission loop made itself that frees room (a hold or an
    /// assumption forgotten): no watch event tells it, and gangs waiting for capacity
    /// are tried again only once the count moves.
    pub fn note_room_freed(&self) {
        self.changes.fetch_add(1, Ordering::SeqCst);
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

    /// Waits until every ResourceClaim write up to `version` is in the state; false if
    /// that takes longer than `limit`, or if some claim could not be read into it.
    pub async fn wait_for_claims(&self, version: u64, limit: std::time::Duration) -> bool {
        if !self.claims_usable.load(Ordering::SeqCst) {
            return false;
        }
        let mut seen = self.claims_version.subscribe();
        let reached = tokio::time::timeout(limit, seen.wait_for(|v| *v >= version))
            .await
            .is_ok_and(|r| r.is_ok());
        reached && self.claims_usable.load(Ordering::SeqCst)
    }

    /// Whether every ResourceClaim could be read into the state (one that could not is
    /// missing from it, and only a list shows it).
    pub fn claims_usable(&self) -> bool {
        self.claims_usable.load(Ordering::SeqCst)
    }

    /// Claims muster allocated that lost their `muster.dev/workload` label.
    pub fn stray_claims(&self) -> Vec<ObjectKey> {
        let claims = self
            .muster_claims
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        claims
            .iter()
            .filter(|(_, labelled)| !**labelled)
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// Whether the claim carries muster's allocation finalizer, as the index saw it last
    /// (labelled or not).
    pub fn muster_claim(&self, key: &ObjectKey) -> bool {
        self.muster_claims
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains_key(key)
    }

    /// `labelled`: `None` once the claim is gone or carries no finalizer of muster's.
    fn note_muster_claim(&self, key: ObjectKey, labelled: Option<bool>) {
        let mut claims = self
            .muster_claims
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match labelled {
            Some(labelled) => {
                claims.insert(key, labelled);
            }
            None => {
                claims.remove(&key);
            }
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
    /// How the engine names objects of this kind: a name for cluster-scoped kinds, a
    /// typed key for namespaced ones.
    type Key: Clone + Eq + Hash + Send;
    fn key(&self) -> Self::Key;
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError>;
    fn remove(key: &Self::Key, cluster: &mut ClusterState);
    /// Records what a change of the object with `key` may concern (see [`Touched`]).
    fn touch(_key: &Self::Key, _touched: &Touched) {}
    /// Whether applying the object would change the state at all (a node's heartbeat
    /// changes nothing the engine keeps): only then is it touched.
    fn changes(&self, _cluster: &ClusterState) -> bool {
        true
    }
    /// Whether the index tracks how far the watch of this kind has come.
    const VERSIONED: bool = false;
    /// Tells the index which objects of this kind exist but could not be read.
    fn publish_unreadable(_unreadable: &HashSet<Self::Key>, _index: &Index) {}
    /// Tells the index what it keeps of the object beside the state.
    fn observe(&self, _index: &Index) {}
    /// Tells the index the object with `key` is gone.
    fn forget(_key: &Self::Key, _index: &Index) {}
}

impl Indexed for Node {
    type Key = String;
    fn key(&self) -> String {
        self.name_any()
    }
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        cluster.upsert_node(convert::node(self)?);
        Ok(())
    }
    fn remove(key: &String, cluster: &mut ClusterState) {
        cluster.remove_node(key);
    }
    fn touch(key: &String, touched: &Touched) {
        touched.node(key);
    }
    fn changes(&self, cluster: &ClusterState) -> bool {
        convert::node(self).map_or(true, |node| cluster.node(&node.name) != Some(&node))
    }
    fn publish_unreadable(unreadable: &HashSet<String>, index: &Index) {
        let mut nodes = index
            .unreadable_nodes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if nodes.len() != unreadable.len() || !unreadable.iter().all(|n| nodes.contains(n)) {
            *nodes = unreadable.iter().cloned().collect();
        }
    }
}

impl Indexed for Pod {
    type Key = PodKey;
    fn key(&self) -> PodKey {
        convert::pod_key(self)
    }
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        let key = Indexed::key(self);
        match convert::pod_entry(self)? {
            Some(entry) => cluster.observe_pod_bound(&key, entry),
            None => cluster.observe_pod_unbound(&key),
        }
        Ok(())
    }
    fn remove(key: &PodKey, cluster: &mut ClusterState) {
        cluster.remove_pod(key);
    }
}

impl Indexed for ResourceSlice {
    type Key = String;
    fn key(&self) -> String {
        self.name_any()
    }
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        cluster.upsert_slice(convert::slice(self)?);
        Ok(())
    }
    fn remove(key: &String, cluster: &mut ClusterState) {
        cluster.remove_slice(key);
    }
    fn touch(_key: &String, touched: &Touched) {
        touched.everything();
    }
}

impl Indexed for DeviceClass {
    type Key = String;
    fn key(&self) -> String {
        self.name_any()
    }
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        cluster.upsert_class(convert::device_class(self));
        Ok(())
    }
    fn remove(key: &String, cluster: &mut ClusterState) {
        cluster.remove_class(key);
    }
}

impl Indexed for DeviceTaintRule {
    type Key = String;
    fn key(&self) -> String {
        self.name_any()
    }
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        cluster.upsert_taint_rule(
            self.metadata.name.as_deref().unwrap_or_default(),
            convert::taint_rule(self),
        );
        Ok(())
    }
    fn remove(key: &String, cluster: &mut ClusterState) {
        cluster.remove_taint_rule(key);
    }
    fn touch(_key: &String, touched: &Touched) {
        touched.everything();
    }
}

impl Indexed for ResourceClaim {
    const VERSIONED: bool = true;
    type Key = ClaimKey;
    fn key(&self) -> ClaimKey {
        convert::claim_key(self)
    }
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
    fn remove(key: &ClaimKey, cluster: &mut ClusterState) {
        cluster.set_claim_allocation(key, None);
    }
    fn touch(key: &ClaimKey, touched: &Touched) {
        touched.claim(key.namespace(), key.name());
    }
    fn observe(&self, index: &Index) {
        let finalized = self.finalizers().iter().any(|f| f == labels::CLAIM_FINALIZER);
        let labelled = self.labels().contains_key(labels::WORKLOAD);
        index.note_muster_claim(convert::object_key(self), finalized.then_some(labelled));
    }
    fn forget(key: &ClaimKey, index: &Index) {
        index.note_muster_claim(ObjectKey::new(key.namespace(), key.name()), None);
    }
}

impl Indexed for PersistentVolumeClaim {
    type Key = ObjectKey;
    fn key(&self) -> ObjectKey {
        convert::object_key(self)
    }
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        cluster.storage_mut().upsert_claim(convert::storage::claim(self)?);
        Ok(())
    }
    fn remove(key: &ObjectKey, cluster: &mut ClusterState) {
        cluster.storage_mut().remove_claim(key);
    }
}

impl Indexed for PersistentVolume {
    type Key = String;
    fn key(&self) -> String {
        self.name_any()
    }
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        cluster.storage_mut().upsert_volume(convert::storage::volume(self)?);
        Ok(())
    }
    fn remove(key: &String, cluster: &mut ClusterState) {
        cluster.storage_mut().remove_volume(key);
    }
}

impl Indexed for StorageClass {
    type Key = String;
    fn key(&self) -> String {
        self.name_any()
    }
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        cluster
            .storage_mut()
            .upsert_class(convert::storage::storage_class(self));
        Ok(())
    }
    fn remove(key: &String, cluster: &mut ClusterState) {
        cluster.storage_mut().remove_class(key);
    }
}

impl Indexed for CSINode {
    type Key = String;
    fn key(&self) -> String {
        self.name_any()
    }
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        cluster
            .storage_mut()
            .upsert_csi_node(&self.name_any(), convert::storage::csi_node(self));
        Ok(())
    }
    fn remove(key: &String, cluster: &mut ClusterState) {
        cluster.storage_mut().remove_csi_node(key);
    }
}

impl Indexed for Namespace {
    type Key = String;
    fn key(&self) -> String {
        self.name_any()
    }
    fn apply(&self, cluster: &mut ClusterState) -> Result<(), convert::ConvertError> {
        cluster.upsert_namespace(&self.name_any(), self.metadata.labels.clone().unwrap_or_default());
        Ok(())
    }
    fn remove(key: &String, cluster: &mut ClusterState) {
        cluster.remove_namespace(key);
    }
}

/// Watches every kind until the process stops.
pub async fn run(client: Client, index: Arc<Index>) {
    tokio::join!(
        watch::<Node>(Api::all(client.clone()), index.clone()),
        watch::<Pod>(Api::all(client.clone()), index.clone()),
        watch::<ResourceSlice>(Api::all(client.clone()), index.clone()),
        watch::<DeviceClass>(Api::all(client.clone()), index.clone()),
        watch::<ResourceClaim>(Api::all(client.clone()), index.clone()),
        watch_taint_rules(client.clone(), index.clone()),
        watch::<PersistentVolumeClaim>(Api::all(client.clone()), index.clone()),
        watch::<PersistentVolume>(Api::all(client.clone()), index.clone()),
        watch::<StorageClass>(Api::all(client.clone()), index.clone()),
        watch::<CSINode>(Api::all(client.clone()), index.clone()),
        watch::<Namespace>(Api::all(client.clone()), index.clone()),
    );
}

/// Watches DeviceTaintRules where the cluster serves them in resource.k8s.io/v1 (1.37
/// on; before, only behind a feature gate in a beta or alpha version, which muster does
/// not read). A failed discovery is asked again with backoff, not taken for a "no", and
/// the index is not ready until it has an answer: a plan that ignored a taint could put
/// a gang on devices being drained.
async fn watch_taint_rules(client: Client, index: Arc<Index>) {
    let group_version = DeviceTaintRule::api_version(&());
    let mut delay = std::time::Duration::from_secs(1);
    loop {
        match client.list_api_group_resources(&group_version).await {
            Ok(list) if list.resources.iter().any(|r| r.name == DeviceTaintRule::plural(&())) => {
                return watch::<DeviceTaintRule>(Api::all(client.clone()), index).await;
            }
            Ok(_) => {
                index.mark_listed();
                return;
            }
            Err(e) => {
                warn!(error = %e, retry_in = ?delay, "cannot tell whether the cluster serves DeviceTaintRules; admission waits and asks again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(std::time::Duration::from_secs(60));
            }
        }
    }
}

/// Feeds one kind into the cluster state.
async fn watch<K: Indexed>(api: Api<K>, index: Arc<Index>) {
    let kind = K::kind(&());
    let mut known: HashSet<K::Key> = HashSet::new();
    let mut relisting: Option<HashSet<K::Key>> = None;
    let mut listed_once = false;
    let mut newest_version = 0u64;
    let mut relist_version = 0u64;
    // Objects the engine cannot use, left out of the state.
    let mut unusable: HashSet<K::Key> = HashSet::new();
    let mut events = watcher(api, watcher::Config::default()).default_backoff().boxed();
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                warn!(%kind, error = %e, "watch failed; retrying");
                continue;
            }
        };
        // A relist's objects arrive in name order, not write order: what it shows
        // counts only once the whole list is in, and then as the list's newest (a
        // store restored from a backup starts lower).
        let version_of = |o: &K| o.meta().resource_version.as_deref().and_then(|v| v.parse::<u64>().ok());
        let mut published = None;
        if K::VERSIONED {
            match &event {
                watcher::Event::Init => relist_version = 0,
                watcher::Event::InitApply(o) => relist_version = relist_version.max(version_of(o).unwrap_or(0)),
                watcher::Event::InitDone => {
                    newest_version = relist_version;
                    published = Some(newest_version);
                }
                watcher::Event::Apply(o) | watcher::Event::Delete(o) => {
                    newest_version = newest_version.max(version_of(o).unwrap_or(0));
                    published = Some(newest_version);
                }
            }
        }
        index.update(|cluster| {
            match event {
                watcher::Event::Init => relisting = Some(HashSet::new()),
                watcher::Event::InitApply(object) => {
                    apply(&object, cluster, &mut unusable);
                    object.observe(&index);
                    relisting.get_or_insert_with(HashSet::new).insert(Indexed::key(&object));
                }
                watcher::Event::InitDone => {
                    let seen = relisting.take().unwrap_or_default();
                    for gone in known.difference(&seen) {
                        K::remove(gone, cluster);
                        K::forget(gone, &index);
                        unusable.remove(gone);
                    }
                    known = seen;
                    // What changed while the watch was down is not known one by one.
                    index.touched.everything();
                }
                watcher::Event::Apply(object) => {
                    let changes = object.changes(cluster);
                    apply(&object, cluster, &mut unusable);
                    object.observe(&index);
                    let key = Indexed::key(&object);
                    if changes {
                        K::touch(&key, &index.touched);
                    }
                    known.insert(key);
                }
                watcher::Event::Delete(object) => {
                    let key = Indexed::key(&object);
                    K::remove(&key, cluster);
                    K::forget(&key, &index);
                    K::touch(&key, &index.touched);
                    unusable.remove(&key);
                    known.remove(&key);
                }
            }
            // Under the state's lock: whoever holds it never sees a node left out of the
            // state that is not marked unreadable (it would be taken for gone).
            K::publish_unreadable(&unusable, &index);
        });
        if let Some(version) = published {
            // Until every claim can be read, the commit's conflict check lists instead.
            index.claims_usable.store(unusable.is_empty(), Ordering::SeqCst);
            index.claims_version.send_if_modified(|seen| {
                let changed = version != *seen;
                *seen = version;
                changed
            });
        }
        if relisting.is_none() && !listed_once {
            listed_once = true;
            index.mark_listed();
        }
        index.changes.fetch_add(1, Ordering::SeqCst);
        index.changed.notify_one();
    }
}

fn apply<K: Indexed>(object: &K, cluster: &mut ClusterState, unusable: &mut HashSet<K::Key>) {
    let key = Indexed::key(object);
    if let Err(e) = object.apply(cluster) {
        // The object is unusable: forget it rather than keep a stale version.
        warn!(object = %e.object, error = %e.message, "ignoring an object the engine cannot use");
        K::remove(&key, cluster);
        unusable.insert(key);
    } else {
        unusable.remove(&key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_that_cannot_be_read_are_published_until_they_can() {
        let index = Index::default();
        let unreadable: HashSet<String> = ["n1".to_string()].into();
        <Node as Indexed>::publish_unreadable(&unreadable, &index);
        assert!(index.node_unreadable("n1"));
        assert!(!index.node_unreadable("n2"));
        <Node as Indexed>::publish_unreadable(&HashSet::new(), &index);
        assert!(!index.node_unreadable("n1"));
    }
}
