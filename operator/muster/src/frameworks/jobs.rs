//! The Jobs JobSets made, cached, so that membership can tell a pod of a JobSet's Job
//! from a pod that only carries the JobSet's labels: a member of a JobSet's group must be
//! controlled by a Job the cache shows, itself controlled by that JobSet.
//!
//! The cache is the process's one view of those Jobs: the JobSet adoption controller
//! fills it ([`follow`]); membership reads it wherever it is asked ([`owner_of_job`]).
//! While it is not filled (no JobSet adoption in this process), nothing can be verified
//! and membership goes by labels alone.

use std::sync::OnceLock;

use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

use crate::frameworks::JOBSET_NAME;

static JOBS: OnceLock<Store<Job>> = OnceLock::new();

/// What the cache says of a pod's controlling Job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobOwner {
    /// The Job exists with that uid, controlled by the object of this uid.
    ControlledBy(String),
    /// The Job exists with that uid and no controller.
    Uncontrolled,
    /// No Job of that name and uid is cached (yet).
    Unknown,
}

/// What the cache says of Job `name` with `uid` in `namespace`; `None` while there is no
/// cache to ask.
pub fn owner_of_job(namespace: &str, name: &str, uid: &str) -> Option<JobOwner> {
    let store = JOBS.get()?;
    let Some(job) = store.get(&ObjectRef::new(name).within(namespace)) else {
        return Some(JobOwner::Unknown);
    };
    if job.uid().as_deref() != Some(uid) {
        return Some(JobOwner::Unknown);
    }
    Some(
        match job.owner_references().iter().find(|o| o.controller == Some(true)) {
            Some(owner) => JobOwner::ControlledBy(owner.uid.clone()),
            None => JobOwner::Uncontrolled,
        },
    )
}

/// Watches the Jobs JobSets make (JobSet labels each with its name) into the process's
/// cache. Resolves once the first list is in (the cache is used from then on) with the
/// watch that keeps it current, for the caller to drive; `None` when the cache is kept
/// already.
pub async fn follow(client: Client) -> Option<impl std::future::Future<Output = ()>> {
    static STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if STARTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
        return None;
    }
    let (store, writer) = reflector::store::<Job>();
    let config = watcher::Config::default().labels(JOBSET_NAME);
    let events = watcher(Api::<Job>::all(client), config)
        .default_backoff()
        .modify(|job| {
            // Only the owners are read: the rest would only cost memory.
            job.managed_fields_mut().clear();
            job.spec = None;
            job.status = None;
        })
        .reflect(writer)
        .boxed();
    let mut keep = Box::pin(async move {
        let mut events = events;
        while events.next().await.is_some() {}
    });
    // Until the first list is in, membership goes by labels rather than by a cache that
    // shows only some Jobs.
    tokio::select! {
        _ = store.wait_until_ready() => {}
        () = &mut keep => {}
    }
    let _ = JOBS.set(store);
    Some(keep)
}
