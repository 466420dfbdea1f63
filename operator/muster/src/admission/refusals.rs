//! kube-scheduler's refusals a gang remembers (`status.schedulerRefusals`), as the nodes
//! its next plans keep each refused pod's group off, and when the last of them lapses.

use std::time::Duration;

use muster_admission::refusal::Refusal;
use muster_api::v1alpha1::Workload;
use muster_engine::placement::Avoid;
use muster_engine::request::GangRequest;

use crate::workload::observe;

/// The reason plans give for a node they keep a pod off.
const WHY: &str = "refused by kube-scheduler in the last 5 minutes";

/// The gang's refusals that still hold at `now`.
fn active(workload: &Workload, now: muster_admission::Millis) -> Vec<Refusal> {
    observe::refusals(workload)
        .into_iter()
        .filter(|r| r.active(now))
        .collect()
}

/// The nodes `request`'s pods keep off: every pod of a refused pod's group keeps off the
/// node it was refused on (the pods of a group are alike: what refused one refuses the
/// others); a refused pod of no group keeps off it alone.
pub(super) fn avoid(workload: &Workload, request: &GangRequest, now: muster_admission::Millis) -> Avoid {
    let mut avoid = Avoid::default();
    for refusal in active(workload, now) {
        let pods = request
            .groups
            .iter()
            .filter(|g| refusal.group.as_deref() == Some(g.name.as_str()))
            .flat_map(|g| &g.pods)
            .chain(
                request
                    .groups
                    .iter()
                    .flat_map(|g| &g.pods)
                    .filter(|p| refusal.group.is_none() && p.key.name() == refusal.pod),
            );
        for pod in pods {
            avoid
                .pod_nodes
                .entry(pod.key.clone())
                .or_default()
                .insert(refusal.node.clone(), WHY.to_string());
        }
    }
    avoid
}

/// How long until the first of the gang's refusals lapses, if any still holds: a gang
/// that fits only on nodes it keeps off is tried again then, whether or not the cluster
/// changes meanwhile.
pub(super) fn lapses_in(workload: &Workload, now: muster_admission::Millis) -> Option<Duration> {
    active(workload, now)
        .iter()
        .map(|r| r.at + muster_admission::refusal::MEMORY - now)
        .min()
        .map(|millis| Duration::from_millis(millis.max(0) as u64))
}
