//! Whether a gang's reservation can still take its pods: what a restart onto the same
//! nodes and devices checks before it reuses them (the state machine's `NodeHealth` and
//! `devices_published`). kube-scheduler would refuse a pod pinned to a node whose taints
//! it does not tolerate (the node lifecycle controller taints a NotReady or unreachable
//! node `NoExecute`), and the device taint controller evicts a pod from a device with a
//! `NoExecute` taint its allocation does not tolerate: going back onto either only waits
//! for a refusal or an eviction.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::DeviceRequestAllocationResult;
use muster_admission::{Journal, NodeHealth, State};
use muster_api::v1alpha1::Workload;
use muster_engine::claim::TaintEffect;
use muster_engine::cluster::{ClusterState, Node};
use muster_engine::placement::{self, PodPlacement};
use muster_engine::selector::{Toleration, tolerates_all};

use super::request::RequestError;
use super::{Admission, key};
use crate::convert;

/// How long after its backoff a restart waits for its pods to be checkable before it
/// gives its reservation up.
const UNCHECKED_FOR_MS: i64 = 30_000;

impl Admission {
    /// What keeps a gang restarting onto its reservation from putting its pods back on
    /// their nodes, by kube-scheduler's filters (`placement::verify`: resources, pod
    /// affinity and spread, host ports, volumes, taints). Asked only of a gang restarting
    /// onto its reservation whose backoff is over; `None` while its attempt's pods still
    /// show (in the gang's pods or the cluster's), since the cluster must not hold them.
    /// A request that cannot be built or checked is a problem too (the check fails
    /// closed): at once when the Workload is wrong for good or a claim is being deleted,
    /// else once it has stayed so for [`UNCHECKED_FOR_MS`]; then the gang is placed
    /// again rather than sent back onto nodes kube-scheduler may refuse.
    pub(super) fn reuse_problems(
        &self,
        workload: &Workload,
        journal: Option<&Journal>,
        pods: &[Arc<Pod>],
    ) -> Option<Vec<String>> {
        let Some(journal) = journal.filter(|j| j.state == State::Restarting && j.reuse_reservation) else {
            return Some(Vec::new());
        };
        let retired = |p: &Arc<Pod>| {
            journal
                .retired
                .iter()
                .any(|uid| Some(uid.as_str()) == p.metadata.uid.as_deref())
        };
        if pods.iter().any(retired) {
            return None;
        }
        // The state machine decides only once the backoff is over.
        let spec = crate::workload::observe::spec(workload);
        let attempt = crate::workload::membership::attempt(workload);
        let now = crate::workload::observe::now_millis();
        let mut due = journal.since;
        if let Some(backoff) = spec.restart_backoff {
            due += backoff.before_restart(attempt - 1) + 1000;
            if now < due {
                return Some(Vec::new());
            }
        }
        // What cannot be checked yet may be a moment's gap in the caches or the cluster (a
        // DeviceClass being made again, a claim's label put back): not known, for a
        // while; then the check fails closed.
        let unchecked =
            |why: String| (now >= due + UNCHECKED_FOR_MS).then(|| vec![format!("its pods cannot be checked: {why}")]);
        let request = match self.request(workload) {
            Ok(request) => request,
            // The cache has not caught up with a write of this loop's: it will.
            Err(RequestError::DeallocationNotSeen(_)) => return None,
            // The Workload is wrong for good, or kube-scheduler refuses a claim being
            // deleted: no wait mends it.
            Err(e) if e.is_permanent() || matches!(e, RequestError::ClaimBeingDeleted(_)) => {
                return Some(vec![format!("its pods cannot be checked: {e}")]);
            }
            Err(e) => return unchecked(e.to_string()),
        };
        let cluster = self.planning_view(&key(workload), self.priority(workload));
        // The cluster's pods come from another watch than the gang's: an old pod it
        // still shows would count against its own successor.
        let planned = request.groups.iter().flat_map(|g| &g.pods);
        if planned.clone().any(|p| cluster.pod_node(&p.key).is_some()) {
            return None;
        }
        let placement: Vec<PodPlacement> = request
            .groups
            .iter()
            .flat_map(|g| {
                g.pods.iter().filter_map(|p| {
                    let planned = journal.planned(p.key.name())?;
                    Some(PodPlacement {
                        group: g.name.clone(),
                        pod: p.key.clone(),
                        node: planned.node.clone(),
                    })
                })
            })
            .collect();
        match placement::verify(&cluster, &request, &placement, &self.settings.plan) {
            Ok(problems) => Some(problems),
            Err(e) => unchecked(e.message),
        }
    }
}

/// The tolerations of each pod group's template, with `extra` (the node fence's, which
/// released pods get) added; groups without a template have none here.
pub fn group_tolerations(workload: &Workload, extra: &[Toleration]) -> BTreeMap<String, Vec<Toleration>> {
    workload
        .spec
        .pod_groups
        .iter()
        .filter_map(|g| {
            let template = g.template.as_ref()?;
            let own = template
                .spec
                .as_ref()
                .and_then(|s| s.tolerations.as_deref())
                .map(convert::tolerations)
                .unwrap_or_default();
            Some((g.name.clone(), own.into_iter().chain(extra.iter().cloned()).collect()))
        })
        .collect()
}

/// The groups whose planned pods the journal puts on each node, from the pods' names
/// (`<workload>-<group>-<index>`; the longest group name that fits wins).
pub fn groups_by_node(workload: &Workload, journal: &Journal) -> BTreeMap<String, BTreeSet<String>> {
    let name = workload.metadata.name.clone().unwrap_or_default();
    let mut by_node: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for planned in &journal.pods {
        let group = workload
            .spec
            .pod_groups
            .iter()
            .filter(|g| {
                let prefix = format!("{name}-{}-", g.name);
                planned
                    .name
                    .strip_prefix(prefix.as_str())
                    .is_some_and(|index| !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()))
            })
            .max_by_key(|g| g.name.len());
        if let Some(group) = group {
            by_node
                .entry(planned.node.clone())
                .or_default()
                .insert(group.name.clone());
        }
    }
    by_node
}

/// The health of a node the gang planned or runs on, `None` if it is gone. One whose last
/// update could not be read (`unreadable`) is left out of the cluster state, yet it is
/// not gone: its pods keep running and nothing new goes there, as on a cordoned node.
pub fn planned_node_health(
    node: Option<&Node>,
    unreadable: bool,
    groups: Option<&BTreeSet<String>>,
    tolerations: &BTreeMap<String, Vec<Toleration>>,
) -> Option<NodeHealth> {
    match node {
        Some(node) => Some(node_health(node, groups, tolerations)),
        None if unreadable => Some(NodeHealth::Unschedulable),
        None => None,
    }
}

/// A node the gang's pods may go back onto: not cordoned, and every taint that keeps
/// pods off (`NoSchedule`, `NoExecute`) tolerated by each group planned there.
pub fn node_health(
    node: &Node,
    groups: Option<&BTreeSet<String>>,
    tolerations: &BTreeMap<String, Vec<Toleration>>,
) -> NodeHealth {
    if node.unschedulable {
        return NodeHealth::Unschedulable;
    }
    let tolerated = groups.into_iter().flatten().all(|group| {
        let none = Vec::new();
        tolerates_all(tolerations.get(group).unwrap_or(&none), &node.taints)
    });
    if tolerated {
        NodeHealth::Ready
    } else {
        NodeHealth::Unschedulable
    }
}

/// The device of an allocation result is still published by its driver, and carries no
/// `NoExecute` taint the result does not tolerate.
pub fn device_usable(cluster: &ClusterState, result: &DeviceRequestAllocationResult) -> bool {
    if !cluster.device_published(&result.driver, &result.pool, &result.device) {
        return false;
    }
    let tolerations: Vec<_> = result
        .tolerations
        .iter()
        .flatten()
        .map(convert::device_toleration)
        .collect();
    cluster
        .device_taints(&result.driver, &result.pool, &result.device)
        .iter()
        .filter(|t| t.effect == TaintEffect::NoExecute)
        .all(|taint| tolerations.iter().any(|t| t.tolerates(taint)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_admission::{PlannedPod, State};
    use muster_engine::selector::{NodeTaintEffect, Taint};
    use serde_json::json;

    fn workload() -> Workload {
        serde_json::from_value(json!({
            "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
            "metadata": {"name": "w", "namespace": "ns"},
            "spec": {"podGroups": [
                {"name": "a", "replicas": 1, "template": {"spec": {"containers": [],
                    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]}}},
                {"name": "a-1", "replicas": 1, "template": {"spec": {"containers": []}}},
            ]},
        }))
        .expect("workload")
    }

    fn journal(pods: &[(&str, &str)]) -> Journal {
        Journal {
            state: State::Restarting,
            since: 0,
            pods: pods
                .iter()
                .map(|(name, node)| PlannedPod {
                    name: name.to_string(),
                    node: node.to_string(),
                    group: None,
                    extra: false,
                    released_at: None,
                    claims: vec![],
                    devices: vec![],
                })
                .collect(),
            claims: vec![],
            released_at: None,
            reuse_reservation: true,
            retired: vec![],
            cause: None,
            topology_value: None,
            nodes: vec![],
            vacancies: vec![],
            devices: 0,
        }
    }

    fn node(taints: &[(&str, NodeTaintEffect)]) -> Node {
        Node {
            name: "n".into(),
            labels: BTreeMap::new(),
            taints: taints
                .iter()
                .map(|(key, effect)| Taint {
                    key: key.to_string(),
                    value: String::new(),
                    effect: *effect,
                })
                .collect(),
            unschedulable: false,
            allocatable: Default::default(),
        }
    }

    /// A node update the engine cannot read leaves the node out of the state; its pods
    /// must not be taken for lost (and deleted at once) for that.
    #[test]
    fn a_node_the_index_could_not_read_is_not_gone() {
        let tolerations = BTreeMap::new();
        assert_eq!(
            planned_node_health(None, true, None, &tolerations),
            Some(NodeHealth::Unschedulable)
        );
        assert_eq!(planned_node_health(None, false, None, &tolerations), None);
        assert_eq!(
            planned_node_health(Some(&node(&[])), false, None, &tolerations),
            Some(NodeHealth::Ready)
        );
    }

    #[test]
    fn a_node_is_healthy_for_a_restart_only_if_every_group_planned_there_tolerates_its_taints() {
        let w = workload();
        let by_node = groups_by_node(&w, &journal(&[("w-a-0", "n1"), ("w-a-1-0", "n2")]));
        assert_eq!(by_node["n1"], BTreeSet::from(["a".to_string()]));
        assert_eq!(
            by_node["n2"],
            BTreeSet::from(["a-1".to_string()]),
            "the longest group that fits"
        );
        let tolerations = group_tolerations(&w, &[]);
        let gpu = node(&[("gpu", NodeTaintEffect::NoSchedule)]);
        assert_eq!(node_health(&gpu, by_node.get("n1"), &tolerations), NodeHealth::Ready);
        assert_eq!(
            node_health(&gpu, by_node.get("n2"), &tolerations),
            NodeHealth::Unschedulable
        );
        let not_ready = node(&[("node.kubernetes.io/not-ready", NodeTaintEffect::NoExecute)]);
        assert_eq!(
            node_health(&not_ready, by_node.get("n1"), &tolerations),
            NodeHealth::Unschedulable
        );
        let preferred = node(&[("x", NodeTaintEffect::PreferNoSchedule)]);
        assert_eq!(
            node_health(&preferred, by_node.get("n2"), &tolerations),
            NodeHealth::Ready
        );
        let mut cordoned = node(&[]);
        cordoned.unschedulable = true;
        assert_eq!(
            node_health(&cordoned, by_node.get("n1"), &tolerations),
            NodeHealth::Unschedulable
        );
    }

    /// Issue 35: a restart onto the reservation whose pods cannot be checked (here the
    /// claims their template names are gone) must not go back onto it unchecked: once
    /// that lasts, the check says why, and the gang is placed again.
    #[tokio::test]
    async fn a_restart_whose_pods_cannot_be_checked_does_not_reuse_the_reservation() {
        let index = std::sync::Arc::new(crate::cache::cluster::Index::default());
        index.update(|c| *c = muster_engine::fixtures::gpu_cluster(1, 8, 1, 1));
        let admission = crate::admission::test_support::unreachable(index);
        let workload: Workload = serde_json::from_value(json!({
            "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
            "metadata": {"name": "w", "namespace": "ns", "uid": "u"},
            "spec": {"podGroups": [{"name": "a", "replicas": 1, "template": {"spec": {
                "containers": [{"name": "c", "resources": {"claims": [{"name": "gpus"}]}}],
                "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "gone"}],
            }}}]},
        }))
        .expect("workload");
        let mut journal = journal(&[("w-a-0", "n")]);
        journal.since = crate::workload::observe::now_millis();
        assert_eq!(
            admission.reuse_problems(&workload, Some(&journal), &[]),
            None,
            "a claim missing a moment (its label put back, say) is waited for"
        );
        journal.since -= UNCHECKED_FOR_MS;
        let problems = admission
            .reuse_problems(&workload, Some(&journal), &[])
            .expect("decided");
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("cannot be checked"), "{problems:?}");
        assert!(problems[0].contains("w-a-0-gpus"), "{problems:?}");
    }
}
