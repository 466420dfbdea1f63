//! What the queue remembers of a gang it could not admit: when to try it again, and the
//! nodes it keeps from gangs of its priority or lower meanwhile — once it has waited
//! past the starvation limit, or right after a commit of its that did not go through.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use muster_engine::key::ObjectKey;

/// How many failed commits in a row a gang keeps its planned nodes through. A commit
/// fails for a conflict that is usually gone at the next try; past this many, something
/// lasting is wrong, and gangs of lower priority may have the nodes.
pub(super) const HOLDS_AFTER_FAILED_COMMITS: u32 = 3;

/// The longest wait between two tries of a gang whose attempts fail or that would not
/// fit even on an emptied cluster.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// How an attempt to admit a gang ended, for when and how it waits.
pub(super) enum Ended {
    /// It would fit the cluster with nothing else on it, on these nodes: it waits for
    /// capacity.
    WaitsForCapacity(Arc<BTreeSet<String>>),
    /// It would not fit even on an emptied cluster, or its request is wrong for now.
    NeverFits,
    /// Its commit (or the attempt) failed and was undone; `planned`: the nodes its plan
    /// took, if it had one.
    Failed { planned: Option<Arc<BTreeSet<String>>> },
}

/// What the loop remembers about a gang that does not fit.
#[derive(Clone)]
pub(super) struct Waiting {
    pub(super) since: Instant,
    pub(super) next_try: Instant,
    /// Attempts in a row that backed off (failed, or would never fit): a gang that waits
    /// for capacity starts over, so one conflict after a long wait costs a short backoff.
    pub(super) failures: u32,
    pub(super) changes_seen: u64,
    /// The nodes it could use on the cluster with nothing else on it, if it would fit
    /// there: only such a gang may hold the queue back once it has waited long (the
    /// starvation rule), and only on these nodes.
    pub(super) reach: Option<Arc<BTreeSet<String>>>,
    /// The nodes its last plan took, if its commit did not go through (one of the first
    /// [`HOLDS_AFTER_FAILED_COMMITS`] in a row): kept from gangs of its priority or lower,
    /// and from waiting extras, until it tries again.
    pub(super) holds: Option<Arc<BTreeSet<String>>>,
    /// When the first refusal that keeps it off a node lapses, if one does.
    pub(super) lapse: Option<Instant>,
}

impl Waiting {
    pub(super) fn new(now: Instant) -> Self {
        Waiting {
            since: now,
            next_try: now,
            failures: 0,
            changes_seen: 0,
            reach: None,
            holds: None,
            lapse: None,
        }
    }

    /// Whether the gang is tried again now, the cluster having seen `changes` changes:
    /// after its backoff, if the cluster changed (or at least every five minutes), or
    /// once a refusal that kept it off a node lapsed.
    pub(super) fn due(&self, changes: u64) -> bool {
        let now = Instant::now();
        (now >= self.next_try && (self.changes_seen != changes || self.next_try.elapsed() > Duration::from_secs(300)))
            || self.lapse.is_some_and(|lapse| now >= lapse)
    }

    /// Remembers how an attempt ended, the cluster having seen `changes` changes, and
    /// returns how long the gang waits before its next try.
    ///
    /// A gang that would fit an emptied cluster waits for capacity: it is tried again as
    /// soon as the cluster changes, at most once a second. Anything else backs off
    /// (1 s, 2 s, 4 s ... at most a minute), and a failed attempt is tried again after it
    /// whether or not the cluster changes meanwhile: nothing else may come to wake it.
    pub(super) fn settle(&mut self, ended: Ended, changes: u64, now: Instant) -> Duration {
        self.lapse = None;
        let backoff = match ended {
            Ended::WaitsForCapacity(reach) => {
                self.failures = 0;
                self.reach = Some(reach);
                self.holds = None;
                self.changes_seen = changes;
                Duration::from_secs(1)
            }
            Ended::NeverFits => {
                self.failures += 1;
                self.reach = None;
                self.holds = None;
                self.changes_seen = changes;
                crate::ops::backoff::exponential(self.failures, MAX_BACKOFF)
            }
            Ended::Failed { planned } => {
                self.failures += 1;
                // It holds the queue back only through what its plan took, and only briefly.
                self.reach = None;
                self.holds = planned.filter(|_| self.failures <= HOLDS_AFTER_FAILED_COMMITS);
                self.changes_seen = u64::MAX;
                crate::ops::backoff::exponential(self.failures, MAX_BACKOFF)
            }
        };
        self.next_try = now + backoff;
        backoff
    }
}

/// Why a gang keeps nodes from gangs of its priority or lower.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HoldReason {
    /// It has waited longest (the starvation rule).
    WaitedLongest,
    /// Its commit did not go through, and it tries again shortly.
    Retrying,
}

/// Nodes held for gangs that have waited longest, or that try again after a failed
/// commit: gangs of equal or lower priority, and waiting extras, are planned without them.
#[derive(Clone, Default)]
pub(super) struct Held {
    holders: Vec<Holder>,
}

#[derive(Clone)]
struct Holder {
    priority: i32,
    gang: ObjectKey,
    nodes: Arc<BTreeSet<String>>,
    why: HoldReason,
}

impl Held {
    pub(super) fn hold(&mut self, priority: i32, gang: &ObjectKey, nodes: &Arc<BTreeSet<String>>, why: HoldReason) {
        self.holders.push(Holder {
            priority,
            gang: gang.clone(),
            nodes: nodes.clone(),
            why,
        });
    }

    /// The nodes held against a gang of `priority`.
    pub(super) fn against(&self, priority: i32) -> BTreeSet<String> {
        self.holders
            .iter()
            .filter(|h| h.priority >= priority)
            .flat_map(|h| h.nodes.iter().cloned())
            .collect()
    }

    /// "a has waited longest ...", "b keeps the nodes its commit planned ..." for the
    /// holders a gang of `priority` is planned without.
    pub(super) fn message(&self, priority: i32) -> String {
        let by = |why: HoldReason| -> Vec<&str> {
            self.holders
                .iter()
                .filter(|h| h.priority >= priority && h.why == why)
                .map(|h| h.gang.as_str())
                .collect()
        };
        let mut parts = Vec::new();
        match by(HoldReason::WaitedLongest).as_slice() {
            [] => {}
            [one] => parts.push(format!(
                "{one} has waited longest and keeps the nodes it could use (starvation rule)"
            )),
            many => parts.push(format!(
                "{} have waited longest and keep the nodes they could use (starvation rule)",
                many.join(", ")
            )),
        }
        match by(HoldReason::Retrying).as_slice() {
            [] => {}
            [one] => parts.push(format!(
                "{one} keeps the nodes it planned until it tries again (its commit did not go through)"
            )),
            many => parts.push(format!(
                "{} keep the nodes they planned until they try again (their commits did not go through)",
                many.join(", ")
            )),
        }
        parts.join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(names: &[&str]) -> Arc<BTreeSet<String>> {
        Arc::new(names.iter().map(|n| n.to_string()).collect())
    }

    /// A gang that waited for capacity through many attempts, and whose commit then
    /// failed once, tries again within a second, not after the minute its attempts so far
    /// would add up to; meanwhile it keeps the nodes it planned.
    #[test]
    fn a_failed_commit_after_a_long_wait_backs_off_briefly_and_keeps_its_nodes() {
        let now = Instant::now();
        let mut waiting = Waiting::new(now);
        for changes in 1..=20 {
            waiting.settle(Ended::WaitsForCapacity(nodes(&["n1", "n2"])), changes, now);
        }
        let backoff = waiting.settle(
            Ended::Failed {
                planned: Some(nodes(&["n1"])),
            },
            21,
            now,
        );
        assert!(backoff <= Duration::from_secs(1), "backoff {backoff:?}");
        assert_eq!(waiting.holds, Some(nodes(&["n1"])));
        // Tried again after its backoff even if nothing changes meanwhile.
        assert_ne!(waiting.changes_seen, 21);
    }

    #[test]
    fn a_gang_whose_commits_keep_failing_lets_go_of_its_nodes_and_backs_off_further() {
        let now = Instant::now();
        let mut waiting = Waiting::new(now);
        let mut last = Duration::ZERO;
        for failed in 1..=HOLDS_AFTER_FAILED_COMMITS + 1 {
            last = waiting.settle(
                Ended::Failed {
                    planned: Some(nodes(&["n1"])),
                },
                1,
                now,
            );
            assert_eq!(
                waiting.holds.is_some(),
                failed <= HOLDS_AFTER_FAILED_COMMITS,
                "holds after {failed} failures"
            );
        }
        assert!(last >= Duration::from_secs(4), "backoff after four failures {last:?}");
        // Waiting for capacity again: it no longer keeps anything, and starts over.
        waiting.settle(Ended::WaitsForCapacity(nodes(&["n1"])), 2, now);
        assert_eq!(waiting.holds, None);
        assert_eq!(waiting.failures, 0);
    }

    #[test]
    fn held_nodes_keep_off_gangs_of_equal_or_lower_priority_and_say_why() {
        let mut held = Held::default();
        let a = ObjectKey::new("ns", "a");
        let b = ObjectKey::new("ns", "b");
        held.hold(10, &a, &nodes(&["n1"]), HoldReason::WaitedLongest);
        held.hold(5, &b, &nodes(&["n2"]), HoldReason::Retrying);
        assert_eq!(held.against(5), ["n1", "n2"].iter().map(|s| s.to_string()).collect());
        assert_eq!(held.against(6), ["n1"].iter().map(|s| s.to_string()).collect());
        assert_eq!(held.against(11), BTreeSet::new());
        let message = held.message(5);
        assert!(message.contains("ns/a has waited longest"), "{message}");
        assert!(message.contains("ns/b keeps the nodes it planned"), "{message}");
        assert!(!held.message(6).contains("ns/b"));
    }
}
