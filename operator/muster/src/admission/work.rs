//! Which placed gangs a pass steps: a keyed work queue fed by the watches. A gang takes
//! a step when something happened to it — its own objects changed
//! ([`crate::cache::touched`]), a claim it holds or a claim on one of its devices
//! changed, a node it is planned on changed — when it asked to be looked at again by a
//! time, or when its last step wrote something or failed (the next step follows from
//! it). Every gang takes one as well every [`RESYNC`], in case a change reached no gang
//! it concerned. So what a pass does follows the events, not the number of Workloads.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use muster_api::v1alpha1::Workload;
use muster_engine::cluster::ClusterState;
use muster_engine::key::{ClaimKey, ObjectKey};

use super::ownership::Holders;
use super::{conflicts, key, placement_of};
use crate::cache::touched::Changes;

/// How often every gang takes a step, whatever the watches showed.
pub(super) const RESYNC: Duration = Duration::from_secs(30);

/// The gangs to step in one pass.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Selection {
    All,
    Some(HashSet<ObjectKey>),
}

impl Selection {
    pub(super) fn contains(&self, gang: &ObjectKey) -> bool {
        match self {
            Selection::All => true,
            Selection::Some(gangs) => gangs.contains(gang),
        }
    }
}

/// What the queue remembers between passes.
#[derive(Default)]
pub(super) struct Work {
    /// When each gang asked to be looked at again.
    rechecks: HashMap<ObjectKey, Instant>,
    /// Gangs whose last step wrote something or failed: they step again next pass.
    again: HashSet<ObjectKey>,
    /// When every gang last took a step.
    swept: Option<Instant>,
    /// Released gangs whose waiting extras did not fit, with the count of cluster
    /// changes they were tried at: tried again once it moved.
    extras_waiting: HashMap<ObjectKey, u64>,
}

impl Work {
    /// The gangs to step now, from what changed since the last pass.
    pub(super) fn select(
        &mut self,
        changes: Changes,
        workloads: &[Arc<Workload>],
        holders: &Holders,
        cluster: &ClusterState,
        now: Instant,
    ) -> Selection {
        if changes.everything || self.swept.is_none_or(|at| now.duration_since(at) >= RESYNC) {
            self.swept = Some(now);
            self.again.clear();
            self.rechecks.clear();
            return Selection::All;
        }
        let mut gangs: HashSet<ObjectKey> = std::mem::take(&mut self.again);
        gangs.extend(changes.gangs);
        self.rechecks.retain(|gang, at| {
            let due = *at <= now;
            if due {
                gangs.insert(gang.clone());
            }
            !due
        });
        for claim in &changes.claims {
            gangs.extend(holders.of_claim(claim).map(|h| h.gang.clone()));
            // A claim that now holds a device against the rules with others (see
            // `conflicts`): the holders of those look as well (a conflict is the state
            // machine's to act on).
            let claim_key = ClaimKey::from(claim.clone());
            for result in cluster.claim_devices(&claim_key).unwrap_or_default() {
                let id = result.device_id();
                if !conflicts::doubly_held(cluster, &id, result.share_id.is_some()) {
                    continue;
                }
                for other in cluster.holder_names(&id) {
                    gangs.extend(holders.of_claim(&ObjectKey::from(other)).map(|h| h.gang.clone()));
                }
            }
        }
        if !changes.nodes.is_empty() {
            for workload in workloads {
                let placed_there =
                    placement_of(workload).is_some_and(|p| p.nodes.iter().any(|n| changes.nodes.contains(n)));
                if placed_there {
                    gangs.insert(key(workload));
                }
            }
        }
        Selection::Some(gangs)
    }

    /// A stepped gang's outcome: `busy` if the step wrote something or failed (it steps
    /// again next pass), and when it asked to be looked at again, if it did.
    pub(super) fn stepped(&mut self, gang: &ObjectKey, busy: bool, recheck: Option<Instant>) {
        if busy {
            self.again.insert(gang.clone());
        }
        match recheck {
            Some(at) => {
                self.rechecks.insert(gang.clone(), at);
            }
            None => {
                self.rechecks.remove(gang);
            }
        }
    }

    /// A released gang's waiting extras did not fit, the cluster having seen `changes`
    /// changes.
    pub(super) fn extras_wait(&mut self, gang: &ObjectKey, changes: u64) {
        self.extras_waiting.insert(gang.clone(), changes);
    }

    /// The gang's extras were placed, none wait, or it is no longer released.
    pub(super) fn extras_placed_or_gone(&mut self, gang: &ObjectKey) {
        self.extras_waiting.remove(gang);
    }

    /// Whether the gang has extras that did not fit.
    pub(super) fn extras_waiting(&self, gang: &ObjectKey) -> bool {
        self.extras_waiting.contains_key(gang)
    }

    /// Whether the gang's waiting extras are to be tried again: the cluster changed since
    /// they did not fit.
    pub(super) fn extras_due(&self, gang: &ObjectKey, changes: u64) -> bool {
        self.extras_waiting.get(gang).is_some_and(|seen| *seen != changes)
    }

    /// Forgets what it remembers of gangs that are gone.
    pub(super) fn keep_only(&mut self, live: &HashSet<ObjectKey>) {
        self.rechecks.retain(|gang, _| live.contains(gang));
        self.again.retain(|gang| live.contains(gang));
        self.extras_waiting.retain(|gang, _| live.contains(gang));
    }

    /// When the next gang asked to be looked at, if one did.
    pub(super) fn next_recheck(&self) -> Option<Instant> {
        self.rechecks.values().min().copied()
    }

    /// Whether some gang steps again next pass at once.
    pub(super) fn busy(&self) -> bool {
        !self.again.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_engine::claim::DeviceResult;
    use muster_engine::fixtures;
    use serde_json::json;

    fn workload(name: &str, nodes: &[&str], claims: &[&str]) -> Arc<Workload> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
                "metadata": {"name": name, "namespace": "ns"},
                "spec": {"podGroups": [{"name": "w", "replicas": 1}]},
                "status": {"placement": {"state": "Released", "nodes": nodes, "claims": claims}},
            }))
            .expect("workload"),
        )
    }

    fn gangs(selection: Selection) -> Vec<String> {
        let Selection::Some(gangs) = selection else {
            panic!("not all gangs: {selection:?}")
        };
        let mut names: Vec<String> = gangs.into_iter().map(|g| g.as_str().to_string()).collect();
        names.sort();
        names
    }

    fn holding(cluster: &mut ClusterState, claim: &str, device: &str) {
        let result: DeviceResult = fixtures::device_result("r", "node-0", device);
        cluster.set_claim_allocation(&ClaimKey::from(ObjectKey::new("ns", claim)), Some(vec![result]));
    }

    #[test]
    fn only_the_gangs_something_happened_to_take_a_step() {
        let workloads = vec![
            workload("a", &["n1"], &["a-gpu"]),
            workload("b", &["n2"], &["b-gpu", "shared"]),
            workload("c", &["n3"], &["c-gpu", "shared"]),
            workload("d", &["n4"], &["d-gpu"]),
        ];
        let holders = Holders::of(&workloads);
        let mut cluster = ClusterState::new();
        holding(&mut cluster, "d-gpu", "gpu-0");
        let mut work = Work::default();
        let now = Instant::now();
        assert_eq!(
            work.select(Changes::default(), &workloads, &holders, &cluster, now),
            Selection::All,
            "the first pass steps every gang"
        );
        let quiet = work.select(Changes::default(), &workloads, &holders, &cluster, now);
        assert!(gangs(quiet).is_empty(), "nothing happened");

        // Its own object, a claim it shares, a node it is on.
        let changes = Changes {
            gangs: HashSet::from([ObjectKey::new("ns", "a")]),
            claims: HashSet::from([ObjectKey::new("ns", "shared")]),
            ..Changes::default()
        };
        assert_eq!(
            gangs(work.select(changes, &workloads, &holders, &cluster, now)),
            ["ns/a", "ns/b", "ns/c"]
        );
        let changes = Changes {
            nodes: HashSet::from(["n4".to_string()]),
            ..Changes::default()
        };
        assert_eq!(
            gangs(work.select(changes, &workloads, &holders, &cluster, now)),
            ["ns/d"]
        );

        // Another claim takes d's device: d looks at the conflict.
        holding(&mut cluster, "intruder", "gpu-0");
        let changes = Changes {
            claims: HashSet::from([ObjectKey::new("ns", "intruder")]),
            ..Changes::default()
        };
        assert_eq!(
            gangs(work.select(changes, &workloads, &holders, &cluster, now)),
            ["ns/d"]
        );

        // A share of a's device taken beside a's exclusive hold: a looks too.
        holding(&mut cluster, "a-gpu", "gpu-1");
        let mut share: DeviceResult = fixtures::device_result("r", "node-0", "gpu-1");
        share.share_id = Some("s1".into());
        cluster.set_claim_allocation(&ClaimKey::from(ObjectKey::new("ns", "sharer")), Some(vec![share]));
        let changes = Changes {
            claims: HashSet::from([ObjectKey::new("ns", "sharer")]),
            ..Changes::default()
        };
        assert_eq!(
            gangs(work.select(changes, &workloads, &holders, &cluster, now)),
            ["ns/a"]
        );

        // A gang that wrote steps again; one that asked for a time, at that time.
        work.stepped(&ObjectKey::new("ns", "a"), true, None);
        work.stepped(&ObjectKey::new("ns", "b"), false, Some(now + Duration::from_secs(5)));
        assert_eq!(work.next_recheck(), Some(now + Duration::from_secs(5)));
        assert_eq!(
            gangs(work.select(Changes::default(), &workloads, &holders, &cluster, now)),
            ["ns/a"]
        );
        let later = now + Duration::from_secs(6);
        assert_eq!(
            gangs(work.select(Changes::default(), &workloads, &holders, &cluster, later)),
            ["ns/b"]
        );

        // Everything, once the resync is due or a watch listed again.
        let resync = now + RESYNC;
        assert_eq!(
            work.select(Changes::default(), &workloads, &holders, &cluster, resync),
            Selection::All
        );
        let changes = Changes {
            everything: true,
            ..Changes::default()
        };
        assert_eq!(
            work.select(changes, &workloads, &holders, &cluster, resync),
            Selection::All
        );
    }
}
