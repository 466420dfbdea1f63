//! What the queue remembers of a gang it could not admit: when to try it again, and the
//! nodes it keeps from gangs of its priority or lower meanwhile — once it has waited
//! past the starvation limit, or right after a commit of its that did not go through.

use std::collections::{BTreeSet, HashMap};
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

/// How long a failed commit's nodes are kept at most, should the gang not try again
/// (it is suspended, or its undo takes long).
const RETRY_HOLD_LIMIT: Duration = Duration::from_secs(30);

/// How an attempt to admit a gang ended, for when and how it waits.
pub(super) enum Ended {
    /// It would fit the cluster with nothing else on it, on these nodes: it waits for
    /// capacity.
    WaitsForCapacity(Arc<BTreeSet<String>>),
    /// It would not fit even on an emptied cluster, or its request is wrong for now.
    NeverFits,
    /// Its commit failed and was undone, the `in_a_row`-th time in a row (see
    /// [`RetryHolds`]).
    Failed { in_a_row: u32 },
    /// The attempt failed before a plan (a status write refused, say).
    Errored,
}

/// What the loop remembers about a gang that does not fit.
#[derive(Clone)]
pub(super) struct Waiting {
    pub(super) since: Instant,
    pub(super) next_try: Instant,
    /// Attempts in a row that would never fit: a gang that waits for capacity starts
    /// over. (Failed commits keep their own count, in [`RetryHolds`], so one conflict
    /// after a long wait costs a short backoff.)
    pub(super) failures: u32,
    pub(super) changes_seen: u64,
    /// The nodes it could use on the cluster with nothing else on it, if it would fit
    /// there: only such a gang may hold the queue back once it has waited long (the
    /// starvation rule), and only on these nodes.
    pub(super) reach: Option<Arc<BTreeSet<String>>>,
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
            lapse: None,
        }
    }

    /// A gang back in the queue after a failed commit was undone: tried again at `at`,
    /// whether or not the cluster changes by then.
    pub(super) fn retrying(now: Instant, at: Instant) -> Self {
        Waiting {
            next_try: at,
            changes_seen: u64::MAX,
            ..Waiting::new(now)
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
                self.changes_seen = changes;
                Duration::from_secs(1)
            }
            Ended::NeverFits => {
                self.failures += 1;
                self.reach = None;
                self.changes_seen = changes;
                crate::ops::backoff::exponential(self.failures, MAX_BACKOFF)
            }
            Ended::Errored => {
                self.failures += 1;
                self.reach = None;
                self.changes_seen = u64::MAX;
                crate::ops::backoff::exponential(self.failures, MAX_BACKOFF)
            }
            Ended::Failed { in_a_row } => {
                // It holds the queue back only through what its plan took (see
                // `RetryHolds`), and only briefly.
                self.reach = None;
                self.changes_seen = u64::MAX;
                crate::ops::backoff::exponential(in_a_row, MAX_BACKOFF)
            }
        };
        self.next_try = now + backoff;
        backoff
    }
}

/// Gangs whose last commit did not go through: how many failed in a row, and the nodes
/// the last one planned, kept from gangs and extras of its priority or lower until it
/// tries again (for the first [`HOLDS_AFTER_FAILED_COMMITS`] in a row, and at most
/// [`RETRY_HOLD_LIMIT`]). Apart from [`Waiting`]: a commit that failed after its plan was
/// recorded is undone by the state machine, and the gang is out of the queue, its
/// `Waiting` forgotten, until then.
#[derive(Default)]
pub(super) struct RetryHolds {
    gangs: HashMap<ObjectKey, RetryHold>,
}

struct RetryHold {
    priority: i32,
    in_a_row: u32,
    nodes: Option<Arc<BTreeSet<String>>>,
    until: Instant,
    /// When it is to try again: its backoff, which outlives its `Waiting`.
    retry_at: Instant,
}

impl RetryHolds {
    /// A commit of `gang` failed, its plan on `planned` (if it had one). Returns how many
    /// failed in a row.
    pub(super) fn failed(
        &mut self,
        gang: &ObjectKey,
        priority: i32,
        planned: Option<Arc<BTreeSet<String>>>,
        now: Instant,
    ) -> u32 {
        let hold = self.gangs.entry(gang.clone()).or_insert(RetryHold {
            priority,
            in_a_row: 0,
            nodes: None,
            until: now,
            retry_at: now,
        });
        hold.in_a_row += 1;
        hold.priority = priority;
        hold.nodes = planned.filter(|_| hold.in_a_row <= HOLDS_AFTER_FAILED_COMMITS);
        hold.until = now + RETRY_HOLD_LIMIT;
        hold.in_a_row
    }

    /// `gang`, whose commit failed, is to try again at `at`.
    pub(super) fn retry_at(&mut self, gang: &ObjectKey, at: Instant) {
        if let Some(hold) = self.gangs.get_mut(gang) {
            hold.retry_at = at;
        }
    }

    /// When `gang`, whose last commit failed, is to try again.
    pub(super) fn next_try(&self, gang: &ObjectKey) -> Option<Instant> {
        self.gangs.get(gang).map(|h| h.retry_at)
    }

    /// `gang` tried again and did not fail (committed, or waits): it keeps nothing.
    pub(super) fn tried(&mut self, gang: &ObjectKey) {
        self.gangs.remove(gang);
    }

    /// Adds the holds standing at `now` to `held`.
    pub(super) fn hold_into(&self, held: &mut Held, now: Instant) {
        for (gang, hold) in &self.gangs {
            if let Some(nodes) = &hold.nodes
                && now < hold.until
            {
                held.hold(hold.priority, gang, nodes, HoldReason::Retrying);
            }
        }
    }

    /// Forgets the gangs that are gone, or whose commit went through after all (the
    /// state machine finished it): only those `retrying` still keep anything.
    pub(super) fn keep_only(&mut self, retrying: &std::collections::HashSet<ObjectKey>) {
        self.gangs.retain(|gang, _| retrying.contains(gang));
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
/// Where preemption stays inside a namespace, so does the starvation rule: a gang that
/// waited longest keeps nodes only from gangs of its own namespace, so that no tenant's
/// priority reaches another's (a retry's hold, seconds long, protects a commit under
/// way and binds every gang).
#[derive(Clone, Default)]
pub(super) struct Held {
    holders: Vec<Holder>,
    per_namespace: bool,
}

#[derive(Clone)]
struct Holder {
    priority: i32,
    gang: ObjectKey,
    nodes: Arc<BTreeSet<String>>,
    why: HoldReason,
}

impl Held {
    /// Holds that bind gangs of every namespace, or (`per_namespace`) only the holder's.
    pub(super) fn new(per_namespace: bool) -> Self {
        Held {
            holders: Vec::new(),
            per_namespace,
        }
    }

    /// Whether `holder` keeps its nodes from gang `gang` of `priority`.
    fn binds(&self, holder: &Holder, priority: i32, gang: &ObjectKey) -> bool {
        holder.priority >= priority
            && holder.gang != *gang
            && (!self.per_namespace
                || holder.why == HoldReason::Retrying
                || holder.gang.namespace() == gang.namespace())
    }

    pub(super) fn hold(&mut self, priority: i32, gang: &ObjectKey, nodes: &Arc<BTreeSet<String>>, why: HoldReason) {
        self.holders.push(Holder {
            priority,
            gang: gang.clone(),
            nodes: nodes.clone(),
            why,
        });
    }

    /// Drops what `gang` keeps for a retry: it tried again.
    pub(super) fn release_retrying(&mut self, gang: &ObjectKey) {
        self.holders
            .retain(|h| !(h.gang == *gang && h.why == HoldReason::Retrying));
    }

    /// Whether every hold against gang `gang` of `priority` is a retry's (and one is).
    pub(super) fn only_retrying_against(&self, priority: i32, gang: &ObjectKey) -> bool {
        let mut against = self.holders.iter().filter(|h| self.binds(h, priority, gang)).peekable();
        against.peek().is_some() && against.all(|h| h.why == HoldReason::Retrying)
    }

    /// Whether a retry's hold stands against gang `gang` of `priority`.
    pub(super) fn retrying_against(&self, priority: i32, gang: &ObjectKey) -> bool {
        self.holders
            .iter()
            .any(|h| self.binds(h, priority, gang) && h.why == HoldReason::Retrying)
    }

    /// The nodes held against gang `gang` of `priority` (never its own).
    pub(super) fn against(&self, priority: i32, gang: &ObjectKey) -> BTreeSet<String> {
        self.holders
            .iter()
            .filter(|h| self.binds(h, priority, gang))
            .flat_map(|h| h.nodes.iter().cloned())
            .collect()
    }

    /// "a has waited longest ...", "b keeps the nodes it planned ..." for the holders
    /// gang `gang` of `priority` is planned without.
    pub(super) fn message(&self, priority: i32, gang: &ObjectKey) -> String {
        let by = |why: HoldReason| -> Vec<&str> {
            let names: BTreeSet<&str> = self
                .holders
                .iter()
                .filter(|h| self.binds(h, priority, gang) && h.why == why)
                .map(|h| h.gang.as_str())
                .collect();
            names.into_iter().collect()
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

    fn names(held: &BTreeSet<String>) -> Vec<&str> {
        held.iter().map(String::as_str).collect()
    }

    /// A gang that waited for capacity through many attempts, and whose commit then
    /// failed once, tries again within a second, not after the minute its attempts so far
    /// would add up to.
    #[test]
    fn a_failed_commit_after_a_long_wait_backs_off_briefly() {
        let now = Instant::now();
        let mut waiting = Waiting::new(now);
        for changes in 1..=20 {
            waiting.settle(Ended::WaitsForCapacity(nodes(&["n1", "n2"])), changes, now);
        }
        let backoff = waiting.settle(Ended::Failed { in_a_row: 1 }, 21, now);
        assert!(backoff <= Duration::from_secs(1), "backoff {backoff:?}");
        // Tried again after its backoff even if nothing changes meanwhile.
        assert_ne!(waiting.changes_seen, 21);
    }

    /// Waits on a claim, or for the cache to show a deallocation, count as never fitting:
    /// they do not lengthen the backoff of a failed commit after them.
    #[test]
    fn attempts_that_never_fit_do_not_lengthen_a_failed_commits_backoff() {
        let now = Instant::now();
        let mut waiting = Waiting::new(now);
        for changes in 1..=5 {
            waiting.settle(Ended::NeverFits, changes, now);
        }
        let mut holds = RetryHolds::default();
        let gang = ObjectKey::new("ns", "high");
        let in_a_row = holds.failed(&gang, 1, Some(nodes(&["n1"])), now);
        let backoff = waiting.settle(Ended::Failed { in_a_row }, 6, now);
        assert!(backoff <= Duration::from_secs(1), "backoff {backoff:?}");
    }

    #[test]
    fn a_gang_whose_commits_keep_failing_lets_go_of_its_nodes_and_backs_off_further() {
        let now = Instant::now();
        let gang = ObjectKey::new("ns", "high");
        let other = ObjectKey::new("ns", "low");
        let mut holds = RetryHolds::default();
        let mut waiting = Waiting::new(now);
        let mut backoff = Duration::ZERO;
        for failed in 1..=HOLDS_AFTER_FAILED_COMMITS + 1 {
            let in_a_row = holds.failed(&gang, 10, Some(nodes(&["n1"])), now);
            assert_eq!(in_a_row, failed);
            backoff = waiting.settle(Ended::Failed { in_a_row }, 1, now);
            let mut held = Held::default();
            holds.hold_into(&mut held, now);
            assert_eq!(
                !held.against(10, &other).is_empty(),
                failed <= HOLDS_AFTER_FAILED_COMMITS,
                "holds after {failed} failures"
            );
        }
        assert!(
            backoff >= Duration::from_secs(4),
            "backoff after four failures {backoff:?}"
        );
        // It tried again and waits for room: it keeps nothing, and starts over.
        holds.tried(&gang);
        let mut held = Held::default();
        holds.hold_into(&mut held, now);
        assert!(held.against(0, &other).is_empty());
        assert_eq!(holds.failed(&gang, 10, None, now), 1);
    }

    /// The hold outlives the gang's `Waiting` (a commit undone by the state machine takes
    /// the gang out of the queue), but not its limit, nor the gang.
    #[test]
    fn a_failed_commits_hold_lapses_and_goes_with_its_gang() {
        let now = Instant::now();
        let gang = ObjectKey::new("ns", "high");
        let other = ObjectKey::new("ns", "low");
        let mut holds = RetryHolds::default();
        holds.failed(&gang, 10, Some(nodes(&["n1"])), now);
        let mut held = Held::default();
        holds.hold_into(&mut held, now + RETRY_HOLD_LIMIT);
        assert!(held.against(0, &other).is_empty(), "lapsed");
        holds.keep_only(&[other.clone()].into());
        let mut held = Held::default();
        holds.hold_into(&mut held, now);
        assert!(held.against(0, &other).is_empty(), "gone with its gang");
    }

    #[test]
    fn held_nodes_keep_off_gangs_of_equal_or_lower_priority_but_never_their_holder() {
        let mut held = Held::default();
        let a = ObjectKey::new("ns", "a");
        let b = ObjectKey::new("ns", "b");
        let c = ObjectKey::new("ns", "c");
        held.hold(10, &a, &nodes(&["n1"]), HoldReason::WaitedLongest);
        held.hold(5, &b, &nodes(&["n2"]), HoldReason::Retrying);
        held.hold(5, &b, &nodes(&["n2"]), HoldReason::Retrying);
        assert_eq!(names(&held.against(5, &c)), ["n1", "n2"]);
        assert_eq!(names(&held.against(5, &b)), ["n1"]);
        assert_eq!(names(&held.against(6, &c)), ["n1"]);
        assert!(held.against(11, &c).is_empty());
        let message = held.message(5, &c);
        assert!(message.contains("ns/a has waited longest"), "{message}");
        assert!(message.contains("ns/b keeps the nodes it planned"), "{message}");
        assert_eq!(message.matches("ns/b").count(), 1, "{message}");
        assert!(!held.message(6, &c).contains("ns/b"));
    }

    /// A gang kept off nodes only by a retry's hold waits without a word (no status, no
    /// preemption); one starvation hold makes it a real wait. A hold goes once its holder
    /// tried again.
    #[test]
    fn a_gang_held_back_only_for_a_retry_knows_it() {
        let mut held = Held::default();
        let a = ObjectKey::new("ns", "a");
        let b = ObjectKey::new("ns", "b");
        let c = ObjectKey::new("ns", "c");
        assert!(!held.only_retrying_against(5, &c), "nothing holds");
        held.hold(5, &b, &nodes(&["n2"]), HoldReason::Retrying);
        assert!(held.only_retrying_against(5, &c));
        assert!(held.retrying_against(5, &c));
        assert!(!held.only_retrying_against(5, &b), "its own hold is not against it");
        held.hold(10, &a, &nodes(&["n1"]), HoldReason::WaitedLongest);
        assert!(!held.only_retrying_against(5, &c));
        held.release_retrying(&b);
        assert!(!held.retrying_against(5, &c));
        assert_eq!(names(&held.against(5, &c)), ["n1"]);
    }

    /// A failed commit's backoff outlives the gang's `Waiting` (dropped while the commit
    /// is undone): it comes back to the queue due at that time, not at once.
    #[test]
    fn a_gang_back_from_an_undone_commit_keeps_its_backoff() {
        let now = Instant::now();
        let gang = ObjectKey::new("ns", "high");
        let mut holds = RetryHolds::default();
        holds.failed(&gang, 10, Some(nodes(&["n1"])), now);
        let at = now + Duration::from_secs(4);
        holds.retry_at(&gang, at);
        assert_eq!(holds.next_try(&gang), Some(at));
        let waiting = Waiting::retrying(now, at);
        assert_eq!(waiting.next_try, at);
        assert_ne!(waiting.changes_seen, 0, "due after its backoff whatever changes");
    }

    #[test]
    fn within_a_namespace_scope_the_starvation_rule_binds_only_the_holder_s_namespace() {
        let (starved, retrying) = (ObjectKey::new("a", "big"), ObjectKey::new("a", "retry"));
        for per_namespace in [false, true] {
            let mut held = Held::new(per_namespace);
            held.hold(10, &starved, &nodes(&["n1"]), HoldReason::WaitedLongest);
            held.hold(10, &retrying, &nodes(&["n2"]), HoldReason::Retrying);
            let own = ObjectKey::new("a", "small");
            assert_eq!(names(&held.against(10, &own)), ["n1", "n2"], "its own namespace");
            let other = ObjectKey::new("b", "small");
            let expected: &[&str] = if per_namespace { &["n2"] } else { &["n1", "n2"] };
            assert_eq!(
                names(&held.against(10, &other)),
                expected,
                "per namespace: {per_namespace}"
            );
            assert!(held.message(10, &other).contains("a/big") != per_namespace);
        }
    }
}
