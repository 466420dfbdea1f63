//! `muster run`: the index, the Workload controller and the admission loop, wired
//! together.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::Client;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use tokio::sync::Notify;

use crate::admission::{self, Admission};
use crate::controller::{self, WorkloadController};
use crate::index::{self, Index};

/// Everything `muster run` runs.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    pub controller: controller::Settings,
    pub admission: admission::Settings,
}

/// Runs the operator until the process is asked to stop.
pub async fn run(client: Client, settings: Settings) {
    let index = Arc::new(Index::default());
    let wake = Arc::new(Notify::new());
    let (stores, watches) = controller::gang_watches(&client, wake.clone());
    let controller = WorkloadController::new(
        client.clone(),
        settings.controller,
        stores.clone(),
        watches,
        wake.clone(),
    );

    let (priorities, writer) = reflector::store::<PriorityClass>();
    let priority_watch = watcher(Api::<PriorityClass>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .for_each(|_| async {});

    let admission = Admission::new(
        client.clone(),
        index.clone(),
        controller.store(),
        stores,
        priorities,
        settings.admission,
        wake,
    );

    tokio::select! {
        _ = controller.run() => {}
        _ = index::run(client, index) => {}
        _ = admission.run() => {}
        _ = priority_watch => {}
    }
}
