//! An admission loop for unit tests, on an API server that never answers.

use std::sync::Arc;

use kube::runtime::reflector;

use super::{Admission, Caches, Settings};
use crate::cache::cluster::Index;

/// An admission loop whose API server does not answer: every write fails.
pub(crate) fn unreachable(index: Arc<Index>) -> Admission {
    let config = kube::Config::new("http://127.0.0.1:9".parse().expect("url"));
    let client = kube::Client::try_from(config).expect("client");
    let notify = Arc::new(tokio::sync::Notify::new());
    let (stores, _watches) =
        crate::cache::gang_objects::gang_watches(&client, notify.clone(), index.touched.clone(), false);
    Admission::new(
        client,
        index,
        Caches {
            workloads: reflector::store().0,
            stores,
            owners: Arc::default(),
            priorities: reflector::store().0,
        },
        Settings::default(),
        notify,
    )
}
