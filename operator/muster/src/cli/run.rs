//! `muster run`: the index, the Workload controller and the admission loop, wired
//! together, behind leader election when several replicas run.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::Client;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use tokio::sync::Notify;
use tracing::{error, info};

use crate::admission::{self, Admission};
use crate::cache::cluster::{self, Index};
use crate::ops::leader::{self, Elector};
use crate::ops::serve::Health;
use crate::workload::controller::{self, WorkloadController};

/// Everything `muster run` runs.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    pub controller: controller::Settings,
    pub admission: admission::Settings,
    /// `None`: run as the only replica, without a Lease.
    pub leader_election: Option<leader::Settings>,
    /// Keep the Workloads of labelled JobSets and Jobs.
    pub adopt_jobs: bool,
    /// The webhook's `namespaceSelector`: labelled jobs elsewhere are not muster's.
    pub adopt_namespace_selector: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>,
}

/// Why [`run`] returned.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// Asked to stop.
    Stopped,
    /// Leadership was lost: the process must exit before anyone else writes.
    LostLease,
}

/// Runs the operator until the process is asked to stop or loses its Lease. Followers
/// keep the cluster model and the priority classes warm, so a takeover starts planning
/// at once.
pub async fn run(client: Client, settings: Settings, health: Arc<Health>) -> Ended {
    let index = Arc::new(Index::default());
    let (priorities, writer) = reflector::store::<PriorityClass>();
    let priority_watch = watcher(Api::<PriorityClass>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .for_each(|_| async {});
    let warm = async {
        tokio::join!(cluster::run(client.clone(), index.clone()), priority_watch);
    };
    let readiness = async {
        index.wait_ready().await;
        health.set_ready();
        info!("caches filled");
        std::future::pending::<()>().await;
    };

    let lead = async {
        let mut elector = settings
            .leader_election
            .clone()
            .map(|s| Elector::new(client.clone(), s));
        if let Some(elector) = elector.as_mut() {
            elector.acquire().await;
        }
        let guard = elector.as_ref().map(Elector::guard);
        let adopt_guard = guard.clone();
        crate::ops::metrics::get().leader.set(1);
        let wake = Arc::new(Notify::new());
        let kueue = crate::cache::gang_objects::kueue_served(&client).await;
        if kueue {
            info!(
                "the cluster serves Kueue: Workloads labelled {} queue in Kueue",
                crate::kueue::QUEUE_LABEL
            );
        }
        let (stores, mut watches) =
            crate::cache::gang_objects::gang_watches(&client, wake.clone(), index.touched.clone(), kueue);
        let kueue_watch = watches.kueue.take();
        // What muster suspended to requeue gangs is cached here; changes wake the loop.
        // The Jobs, JobSets and TrainJobs muster suspended to requeue gangs of their pods.
        let marked_owners = Arc::new(crate::owners::watch::Marked::default());
        let follow_owners = marked_owners
            .clone()
            .follow(client.clone(), index.touched.clone(), wake.clone());
        let controller = WorkloadController::new(
            client.clone(),
            controller::Settings {
                lease: guard.clone(),
                ..settings.controller.clone()
            },
            stores.clone(),
            index.clone(),
            watches,
            wake.clone(),
        );
        crate::ops::metrics::get()
            .live
            .set_source(Some(Arc::new(crate::report::readings::CacheSource {
                workloads: controller.store(),
                claims: stores.claims.clone(),
                cluster: index.clone(),
            })));
        let admission = Admission::new(
            client.clone(),
            index.clone(),
            crate::admission::Caches {
                workloads: controller.store(),
                stores,
                owners: marked_owners.clone(),
                priorities: priorities.clone(),
            },
            crate::admission::Settings {
                lease: guard,
                ..settings.admission.clone()
            },
            wake,
        );
        // Renewal runs on a thread and runtime of its own, so that nothing the operator
        // does (a long plan, busy worker threads, a slow write) can delay it.
        let (lost, lost_lease) = tokio::sync::oneshot::channel::<()>();
        let (stop, stop_keeping) = tokio::sync::oneshot::channel::<()>();
        let keeper = elector.take().map(|mut elector| {
            std::thread::spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        error!(error = %e, "cannot start the Lease keeper");
                        let _ = lost.send(());
                        return;
                    }
                };
                runtime.block_on(async {
                    tokio::select! {
                        _ = elector.keep() => {
                            let _ = lost.send(());
                        }
                        // A clean stop: the Lease is given up by the caller.
                        _ = stop_keeping => {}
                    }
                });
            })
        });
        let keep = async {
            match keeper {
                Some(_) => {
                    let _ = lost_lease.await;
                }
                None => std::future::pending().await,
            }
        };
        // Labelled JobSets (once the cluster serves them) and Jobs become gangs.
        let adopt = async {
            if !settings.adopt_jobs {
                return std::future::pending().await;
            }
            let adoption = crate::frameworks::controller::Settings {
                kueue,
                namespace_selector: settings.adopt_namespace_selector.clone(),
                priorities: priorities.clone(),
                lease: adopt_guard.clone(),
                owners: marked_owners.clone(),
            };
            crate::frameworks::controller::run_all(client.clone(), index.clone(), adoption).await;
        };
        // Kueue's Workloads are cached here; changes wake the admission loop.
        let follow_kueue = async {
            match kueue_watch {
                Some(events) => events.for_each(|_| async {}).await,
                None => std::future::pending().await,
            }
        };
        let ended = tokio::select! {
            // The controller stops on SIGTERM or Ctrl-C.
            _ = controller.run() => Ended::Stopped,
            _ = admission.run() => Ended::Stopped,
            _ = follow_kueue => Ended::Stopped,
            _ = follow_owners => Ended::Stopped,
            _ = adopt => Ended::Stopped,
            _ = keep => Ended::LostLease,
        };
        crate::ops::metrics::get().leader.set(0);
        crate::ops::metrics::get().live.set_source(None);
        let _ = stop.send(());
        if let Some(keeper) = keeper {
            // The keeper stops renewing before the Lease is given up, so it cannot take
            // it again behind the release.
            let _ = tokio::task::spawn_blocking(move || keeper.join()).await;
        }
        if ended == Ended::Stopped
            && let Some(settings) = settings.leader_election.clone()
        {
            Elector::new(client.clone(), settings).release().await;
        }
        ended
    };

    tokio::select! {
        ended = lead => {
            if ended == Ended::LostLease {
                error!("lost the leader Lease: stopping");
            }
            ended
        }
        _ = warm => Ended::Stopped,
        _ = readiness => Ended::Stopped,
    }
}
