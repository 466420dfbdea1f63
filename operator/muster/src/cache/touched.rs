//! What the watches saw change since the admission loop last looked: the gangs whose own
//! objects changed (their Workload, its pods, claims, Service or Kueue Workload, by the
//! `muster.dev/workload` label), and the claims, nodes and devices of the cluster that
//! did. The loop steps only the gangs something happened to (see `admission::work`);
//! the watches only record keys here, they never decide.

use std::collections::HashSet;
use std::sync::{Mutex, PoisonError};

use muster_engine::key::ObjectKey;

/// Keys the watches recorded, taken whole by the admission loop.
#[derive(Default)]
pub struct Touched(Mutex<Changes>);

/// What changed since the last [`Touched::take`].
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Gangs (`namespace/workload`) whose own objects changed.
    pub gangs: HashSet<ObjectKey>,
    /// Claims (`namespace/name`) whose allocation or consumers may have changed: their
    /// holders, and the holders of claims on the same devices, look again.
    pub claims: HashSet<ObjectKey>,
    /// Nodes whose health may have changed: the gangs placed on them look again.
    pub nodes: HashSet<String>,
    /// Something every placed gang depends on changed (device publication or taints, a
    /// watch that listed again and may have missed deletions): all look again.
    pub everything: bool,
}

impl Touched {
    fn changes(&self) -> std::sync::MutexGuard<'_, Changes> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn gang(&self, namespace: &str, workload: &str) {
        self.changes().gangs.insert(ObjectKey::new(namespace, workload));
    }

    pub fn claim(&self, namespace: &str, name: &str) {
        self.changes().claims.insert(ObjectKey::new(namespace, name));
    }

    pub fn node(&self, name: &str) {
        self.changes().nodes.insert(name.to_string());
    }

    pub fn everything(&self) {
        self.changes().everything = true;
    }

    /// Everything recorded so far; the record starts empty again.
    pub fn take(&self) -> Changes {
        std::mem::take(&mut *self.changes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_take_hands_over_what_was_recorded_once() {
        let touched = Touched::default();
        touched.gang("ns", "a");
        touched.claim("ns", "c");
        touched.node("n1");
        let changes = touched.take();
        assert_eq!(changes.gangs, HashSet::from([ObjectKey::new("ns", "a")]));
        assert_eq!(changes.claims, HashSet::from([ObjectKey::new("ns", "c")]));
        assert_eq!(changes.nodes, HashSet::from(["n1".to_string()]));
        assert!(!changes.everything);
        assert_eq!(touched.take(), Changes::default());
        touched.everything();
        assert!(touched.take().everything);
    }
}
