//! kube-scheduler's refusals of released pods: telling one from a pod that merely waits,
//! and remembering the node each was refused on, so that the next plans keep the pod's
//! group off it for a while.
//!
//! A refusal is a `PodScheduled=False` condition with reason `Unschedulable` on a
//! released, unbound pod for which kube-scheduler has not nominated a node. A pod still
//! marked `SchedulingGated` (the API server sets that at creation and it stays until
//! kube-scheduler first tries the pod), one without the condition, one with a nominated
//! node (kube-scheduler preempts for it and binds it once the victims are gone) and one
//! with `SchedulerError` (a failed API call or plugin error, which kube-scheduler retries
//! from its backoff queue) merely wait, up to the schedule timeout. A refusal is acted on
//! only once it has stood, and the pod been released, for
//! [`crate::Settings::refusal_grace`] (15 s by default, more than kube-scheduler's longest
//! backoff of 10 s): kube-scheduler retries a pod it refused when the cluster changes, so
//! a refusal that came from a cache behind muster's (a pod it still thinks holds the port,
//! a peer of an affinity term not bound yet) is gone within that time.

pub use crate::observe::{Refusal, Unscheduled};
use crate::{Millis, PodView};

/// How long a refusal keeps the pod's group off the node. kube-scheduler itself moves an
/// unschedulable pod back to be tried after at most five minutes.
pub const MEMORY: Millis = 300_000;

/// The most refusals a gang remembers (the oldest go first).
pub const KEPT: usize = 16;

impl Refusal {
    /// Whether it still keeps its group off the node at `now`.
    pub fn active(&self, now: Millis) -> bool {
        now < self.at + MEMORY
    }
}

/// kube-scheduler's message, if it refused the released pod (see the module's rules).
pub fn refused(pod: &PodView) -> Option<&str> {
    if pod.gated || pod.deleting || pod.node.is_some() || pod.phase.terminal() {
        return None;
    }
    let unscheduled = pod.unscheduled.as_ref()?;
    let refusal = unscheduled.reason == "Unschedulable";
    (refusal && !unscheduled.nominated).then_some(unscheduled.message.as_str())
}

/// `known` with `new` added: expired ones dropped, one per (group or pod, node) — the
/// newest — and at most [`KEPT`], newest last.
pub fn remember(known: &[Refusal], new: Vec<Refusal>, now: Millis) -> Vec<Refusal> {
    let mut kept: Vec<Refusal> = Vec::new();
    for refusal in known.iter().cloned().chain(new).filter(|r| r.active(now)) {
        let same = |r: &Refusal| {
            r.node == refusal.node && r.group == refusal.group && (r.group.is_some() || r.pod == refusal.pod)
        };
        kept.retain(|r| !same(r));
        kept.push(refusal);
    }
    let excess = kept.len().saturating_sub(KEPT);
    kept.drain(..excess);
    kept
}

/// A short account of refusals for a condition or an event: the first in full, how many
/// more.
pub fn describe(refusals: &[Refusal]) -> String {
    let Some(first) = refusals.first() else {
        return String::new();
    };
    let more = match refusals.len() {
        1 => String::new(),
        n => format!(" (and {} more pods)", n - 1),
    };
    let who = match &first.group {
        Some(group) => format!("group {group}"),
        None => format!("pod {}", first.pod),
    };
    format!(
        "kube-scheduler refused pod {} on its planned node {}{more}: {}; {who} keeps off {} for {}s",
        first.pod,
        first.node,
        first.message.trim().trim_end_matches('.'),
        first.node,
        MEMORY / 1000
    )
}
