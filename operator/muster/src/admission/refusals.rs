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

#[cfg(test)]
mod tests {
    use muster_engine::key::PodKey;
    use muster_engine::request::{GroupRequest, PodInstance};

    use super::*;

    fn group(name: &str, pods: &[&str]) -> GroupRequest {
        GroupRequest {
            name: name.into(),
            min_count: pods.len(),
            shape: Default::default(),
            pods: pods
                .iter()
                .map(|p| PodInstance {
                    key: PodKey::new("ns", p),
                    claims: vec![],
                    volumes: vec![],
                })
                .collect(),
            topology: Default::default(),
            assigned: Vec::new(),
        }
    }

    fn workload(refusals: serde_json::Value) -> Workload {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
            "metadata": {"name": "g", "namespace": "ns"},
            "spec": {"podGroups": [{"name": "w", "replicas": 2}]},
            "status": {"schedulerRefusals": refusals},
        }))
        .expect("workload")
    }

    #[test]
    fn a_refusal_keeps_the_whole_group_off_the_node_until_it_lapses() {
        let w = workload(serde_json::json!([
            {"podGroup": "w", "pod": "g-w-0", "node": "n1", "message": "no", "at": "2026-01-01T00:00:00Z"},
            {"pod": "lone", "node": "n2", "message": "no", "at": "2026-01-01T00:01:00Z"},
        ]));
        let request = GangRequest {
            name: "ns/g".into(),
            groups: vec![group("w", &["g-w-0", "g-w-1"]), group("x", &["lone", "g-x-1"])],
            ..Default::default()
        };
        let at = observe::millis(&serde_json::from_value(serde_json::json!("2026-01-01T00:00:00Z")).expect("time"));
        let avoid = avoid(&w, &request, at + 1_000);
        let nodes = |pod: &str| {
            avoid
                .pod_nodes
                .get(&PodKey::new("ns", pod))
                .map(|n| n.keys().cloned().collect::<Vec<_>>())
                .unwrap_or_default()
        };
        assert_eq!(nodes("g-w-0"), ["n1"]);
        assert_eq!(nodes("g-w-1"), ["n1"], "the group's other pods keep off it too");
        assert_eq!(nodes("lone"), ["n2"], "a pod of no group keeps off it alone");
        assert!(nodes("g-x-1").is_empty());
        assert_eq!(lapses_in(&w, at + 1_000), Some(Duration::from_secs(299)));
        // Five minutes on, the first has lapsed; the second lapses a minute later.
        let later = at + muster_admission::refusal::MEMORY;
        assert_eq!(
            nodes_after(&w, &request, later),
            vec![("lone".to_string(), "n2".to_string())]
        );
        assert_eq!(lapses_in(&w, later), Some(Duration::from_secs(60)));
        assert_eq!(lapses_in(&w, later + 60_000), None);
        assert!(avoid_is_empty(&w, &request, later + 60_000));
    }

    fn nodes_after(w: &Workload, request: &GangRequest, now: muster_admission::Millis) -> Vec<(String, String)> {
        avoid(w, request, now)
            .pod_nodes
            .into_iter()
            .flat_map(|(pod, nodes)| nodes.into_keys().map(move |n| (pod.name().to_string(), n)))
            .collect()
    }

    fn avoid_is_empty(w: &Workload, request: &GangRequest, now: muster_admission::Millis) -> bool {
        avoid(w, request, now).is_empty()
    }
}
