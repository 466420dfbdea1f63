//! What muster suspended to requeue gangs, watched: each [`OwnerKind`] the cluster
//! serves, selected by muster's mark, so the cache holds only what muster suspended.
//! Jobs are watched at once, JobSets and TrainJobs once the cluster serves them (asked
//! every minute, as the adoption controller asks).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use kube::api::{Api, DynamicObject};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use muster_api::labels;
use muster_api::v1alpha1::Workload;
use serde_json::json;
use tokio::sync::Notify;
use tracing::{info, warn};

use super::{Owner, OwnerKind, mark_of, marked_workload};
use crate::cache::touched::Touched;
use crate::kube_ops;

/// How long a suspend this process made counts as seen, while the watch may not show it.
const OWN_SUSPEND_SEEN_FOR: Duration = Duration::from_secs(15);
/// How long an owner this process resumed counts as muster's still: a TrainJob's JobSet
/// stays suspended until Trainer applies it again.
const RESUMED_SEEN_FOR: Duration = Duration::from_secs(60);
/// How often the cluster is asked again whether it serves JobSets and TrainJobs.
const SERVED_RECHECK: Duration = Duration::from_secs(60);

/// An object muster marked as suspended for a gang, as the cache shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MarkedOwner {
    pub owner: Owner,
    /// Its `spec.suspend` is true.
    pub suspended: bool,
    pub namespace: String,
    /// The name of the Workload its mark names.
    pub workload: String,
    pub resource_version: Option<String>,
}

/// The cache of marked objects, and this process's own suspends the watches may not
/// show yet.
#[derive(Default)]
pub struct Marked {
    stores: RwLock<Vec<(OwnerKind, Store<DynamicObject>)>>,
    /// Workload uid → when this process suspended its owners, and their uids.
    own: Mutex<HashMap<String, (Instant, Vec<String>)>>,
    /// Owner uid → when this process resumed it, and the version of it that showed the
    /// mark it took off (the cache may show that version a while longer).
    resumed: Mutex<HashMap<String, (Instant, Option<String>)>>,
}

impl Marked {
    /// Every object marked as suspended for `workload`: by its name (a Workload made
    /// again under the name, as the adoption controller makes a job's, is the same gang's
    /// and resumes what was suspended for the one before).
    pub fn of(&self, workload: &Workload) -> Vec<MarkedOwner> {
        let wanted = workload.name_any();
        let namespace = workload.namespace().unwrap_or_default();
        let stores = self.stores.read().unwrap_or_else(PoisonError::into_inner);
        stores
            .iter()
            .flat_map(|(kind, store)| store.state().into_iter().map(move |object| (*kind, object)))
            .filter(|(_, object)| {
                object.namespace().as_deref() == Some(namespace.as_str())
                    && mark_of(object.as_ref()).and_then(marked_workload) == Some(wanted.as_str())
            })
            .filter(|(_, object)| !self.resumed_at(&object.uid().unwrap_or_default(), object.resource_version()))
            .map(|(kind, object)| MarkedOwner {
                owner: Owner {
                    kind,
                    name: object.name_any(),
                    uid: object.uid().unwrap_or_default(),
                },
                suspended: object.data["spec"]["suspend"] == true,
                namespace: namespace.clone(),
                workload: wanted.clone(),
                resource_version: object.resource_version(),
            })
            .collect()
    }

    /// The state machine's view of the owners of `workload`'s pods (`pod_owners`: the
    /// objects that make them): suspended when every one is covered by a suspended mark
    /// (a JobSet by its TrainJob's), or this process just suspended them.
    pub fn owners(&self, workload: &Workload, pod_owners: &[Owner]) -> muster_admission::Owners {
        let marked = self.of(workload);
        let own = self.own_suspend(workload);
        let covered = |o: &Owner| {
            marked.iter().any(|m| {
                m.suspended
                    && (m.owner.uid == o.uid || (o.kind == OwnerKind::JobSet && m.owner.kind == OwnerKind::TrainJob))
            })
        };
        let all_marked_suspended =
            !marked.is_empty() && marked.iter().all(|m| m.suspended) && pod_owners.iter().all(covered);
        muster_admission::Owners {
            suspended: own || all_marked_suspended,
            marked: own || !marked.is_empty(),
        }
    }

    fn own_suspend(&self, workload: &Workload) -> bool {
        self.own_suspended(workload).is_some()
    }

    /// The uids of the owners of `workload` this process suspended a moment ago (the
    /// watches may not show them marked yet).
    pub fn own_suspended(&self, workload: &Workload) -> Option<Vec<String>> {
        let uid = workload.uid().unwrap_or_default();
        let mut own = self.own.lock().unwrap_or_else(PoisonError::into_inner);
        own.retain(|_, (at, _)| at.elapsed() < OWN_SUSPEND_SEEN_FOR);
        own.get(&uid).map(|(_, owners)| owners.clone())
    }

    /// This process suspended `owners` of `workload` (some, or nothing is recorded).
    pub fn suspended_now(&self, workload: &Workload, owners: &[super::Owner]) {
        if owners.is_empty() {
            return;
        }
        let uid = workload.uid().unwrap_or_default();
        let uids = owners.iter().map(|o| o.uid.clone()).collect();
        self.own
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(uid, (Instant::now(), uids));
    }

    /// This process resumed `owners` of `workload`.
    pub fn resumed_now(&self, workload: &Workload, owners: &[MarkedOwner]) {
        let uid = workload.uid().unwrap_or_default();
        self.own.lock().unwrap_or_else(PoisonError::into_inner).remove(&uid);
        let mut resumed = self.resumed.lock().unwrap_or_else(PoisonError::into_inner);
        resumed.retain(|_, (at, _)| at.elapsed() < RESUMED_SEEN_FOR);
        for owner in owners {
            resumed.insert(
                owner.owner.uid.clone(),
                (Instant::now(), owner.resource_version.clone()),
            );
        }
    }

    /// Whether this process resumed the owner of `uid` a moment ago.
    pub fn just_resumed(&self, uid: &str) -> bool {
        self.resumed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(uid)
            .is_some_and(|(at, _)| at.elapsed() < RESUMED_SEEN_FOR)
    }

    /// Whether this process took the mark off the owner of `uid` at `version`, or at a
    /// newer one, a moment ago: a cached copy of that version or an older one is stale (a
    /// mark put on again is newer).
    fn resumed_at(&self, uid: &str, version: Option<String>) -> bool {
        let number = |v: &Option<String>| v.as_deref().and_then(|v| v.parse::<u64>().ok());
        self.resumed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(uid)
            .is_some_and(|(at, seen)| {
                at.elapsed() < RESUMED_SEEN_FOR
                    && match (number(seen), number(&version)) {
                        (Some(seen), Some(cached)) => cached <= seen,
                        _ => *seen == version,
                    }
            })
    }

    /// Runs the watches until the process stops. Each event touches the gang its mark
    /// names and wakes the admission loop (`changed`).
    pub async fn follow(self: Arc<Self>, client: Client, touched: Arc<Touched>, changed: Arc<Notify>) {
        let mut watching: Vec<OwnerKind> = Vec::new();
        let mut running = FuturesUnordered::new();
        let mut recheck = tokio::time::interval(SERVED_RECHECK);
        loop {
            tokio::select! {
                _ = recheck.tick(), if watching.len() < OwnerKind::ALL.len() => {
                    for kind in OwnerKind::ALL {
                        if watching.contains(&kind) || !served(&client, kind).await {
                            continue;
                        }
                        watching.push(kind);
                        if kind != OwnerKind::Job {
                            info!(kind = %kind.resource().kind, "the cluster serves it: a gang of its pods is requeued by suspending it");
                        }
                        running.push(self.clone().watch(client.clone(), kind, touched.clone(), changed.clone()));
                    }
                }
                Some(()) = running.next() => return,
            }
        }
    }

    async fn watch(self: Arc<Self>, client: Client, kind: OwnerKind, touched: Arc<Touched>, changed: Arc<Notify>) {
        let resource = kind.resource();
        let writer = reflector::store::Writer::new(resource.clone());
        self.stores
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .push((kind, writer.as_reader()));
        let config = watcher::Config::default().labels(labels::REQUEUED);
        let events = watcher(Api::<DynamicObject>::all_with(client, &resource), config)
            .default_backoff()
            .modify(|object| {
                // Only the mark and the suspend are read: the rest would only cost memory.
                object.managed_fields_mut().clear();
                let suspend = object.data["spec"]["suspend"].clone();
                object.data = json!({"spec": {"suspend": suspend}});
            })
            .reflect(writer)
            .touched_objects();
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(object) => {
                    if let (Some(namespace), Some(workload)) =
                        (object.namespace(), mark_of(&object).and_then(marked_workload))
                    {
                        touched.gang(&namespace, workload);
                    }
                    changed.notify_one();
                }
                Err(e) => warn!(error = %e, kind = %resource.kind, "watching what muster suspended failed; retrying"),
            }
        }
    }
}

/// Whether the cluster serves `kind`.
async fn served(client: &Client, kind: OwnerKind) -> bool {
    let resource = kind.resource();
    match client.list_api_group_resources(&resource.api_version).await {
        Ok(list) => list.resources.iter().any(|r| r.name == resource.plural),
        Err(e) => {
            if !kube_ops::is_not_found(&e) {
                warn!(error = %e, kind = %resource.kind, "cannot tell whether the cluster serves it; asking again later");
            }
            false
        }
    }
}
