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
use crate::controller::{self, WorkloadController};
use crate::index::{self, Index};
use crate::leader::{self, Elector};
use crate::serve::Health;

/// Everything `muster run` runs.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    pub controller: controller::Settings,
    pub admission: admission::Settings,
    /// `None`: run as the only replica, without a Lease.
    pub leader_election: Option<leader::Settings>,
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
        tokio::join!(index::run(client.clone(), index.clone()), priority_watch);
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
        crate::metrics::get().leader.set(1);
        let wake = Arc::new(Notify::new());
        let (stores, watches) = controller::gang_watches(&client, wake.clone());
        let controller = WorkloadController::new(
            client.clone(),
            settings.controller.clone(),
            stores.clone(),
            watches,
            wake.clone(),
        );
        let admission = Admission::new(
            client.clone(),
            index.clone(),
            controller.store(),
            stores,
            priorities.clone(),
            crate::admission::Settings {
                lease: guard,
                ..settings.admission.clone()
            },
            wake,
        );
        // Renewal runs on its own task, so that nothing the admission loop does (a long
        // plan, a slow write) can delay it.
        let keeper = elector.take().map(|mut elector| {
            tokio::spawn(async move {
                elector.keep().await;
            })
        });
        let keep = async {
            match keeper {
                Some(keeper) => {
                    let _ = keeper.await;
                }
                None => std::future::pending().await,
            }
        };
        let ended = tokio::select! {
            // The controller stops on SIGTERM or Ctrl-C.
            _ = controller.run() => Ended::Stopped,
            _ = admission.run() => Ended::Stopped,
            _ = keep => Ended::LostLease,
        };
        crate::metrics::get().leader.set(0);
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
