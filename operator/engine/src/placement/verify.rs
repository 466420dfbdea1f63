//! Whether a placement made earlier still holds: the nodes of a gang's pods, with the
//! allocations its claims kept, checked against the cluster as it is now, as
//! kube-scheduler would check the pods if they were released there again. A gang that
//! restarts onto its reservation asks this first, and plans afresh when it fails.

use std::collections::BTreeMap;

use super::{Planner, PodPlacement, fixed_allocations_allow};
use crate::allocator::AllocationError;
use crate::claim::{Allocation, TaintEffect};
use crate::cluster::ClusterState;
use crate::request::GangRequest;
use crate::resources::Resources;

use super::PlanOptions;

/// What no longer holds about `placement` of `gang` on `cluster`, one line per problem
/// (none: it holds). The cluster must not hold the gang's own pods (evict them first);
/// the gang's claims carry the allocations to keep. An error is a request that cannot be
/// checked at all (a volume claim being deleted, say), not a problem of the placement.
pub fn verify(
    cluster: &ClusterState,
    gang: &GangRequest,
    placement: &[PodPlacement],
    options: &PlanOptions,
) -> Result<Vec<String>, AllocationError> {
    Ok(Planner::new(cluster, gang, options)?.verify(placement))
}

impl Planner<'_> {
    fn verify(&self, placement: &[PodPlacement]) -> Vec<String> {
        let gang = self.gang;
        let on: BTreeMap<_, _> = placement.iter().map(|p| (&p.pod, p.node.as_str())).collect();
        let mut problems = Vec::new();
        let mut used: BTreeMap<&str, Resources> = BTreeMap::new();
        let mut occupancy = self.constraints.occupancy();
        // In the order the pods were planned in: a pod whose affinity needs another
        // group's pods finds them entered.
        for (g, index) in self.pod_order() {
            let group = &gang.groups[g];
            let pod = &group.pods[index];
            let Some(&name) = on.get(&pod.key) else {
                if index < group.min_count {
                    problems.push(format!("pod {} has no node", pod.key));
                }
                continue;
            };
            let mut problem = |why: String| problems.push(format!("pod {} on node {name}: {why}", pod.key));
            let Some(node) = self.cluster.node(name) else {
                problem("the node is gone".into());
                continue;
            };
            if let Err(why) = self.node_filter(&group.shape, node) {
                problem(why);
                continue;
            }
            if let Some(why) = self.options.avoid.nodes.get(name) {
                problem(why.clone());
                continue;
            }
            let mut free = self.cluster.free_resources(node);
            let taken = used.entry(name).or_default();
            free.sub(taken);
            if let Some(short) = free.shortfall(&group.shape.requests) {
                problem(format!("insufficient {short}"));
                continue;
            }
            taken.add(&group.shape.requests);
            if !fixed_allocations_allow(pod, node) {
                problem("its claims are allocated for other nodes".into());
                continue;
            }
            let shared = group
                .shape
                .shared
                .iter()
                .filter_map(|s| Some((&gang.shared_claims[*s].key, gang.shared_claims[*s].allocation.as_ref()?)));
            let own = pod.claims.iter().filter_map(|c| Some((&c.key, c.allocation.as_ref()?)));
            if let Some(why) = own
                .chain(shared)
                .find_map(|(claim, a)| self.evicting_taint(claim.as_str(), a))
            {
                problem(why);
                continue;
            }
            let Some(candidate) = self.candidates.iter().find(|c| c.node.name == name) else {
                // Not a candidate: running pods or volumes refuse it, or no room.
                // (An id past every node's only skips the per-node caches.)
                problem(match self.constraints.node_room(g, usize::MAX, node) {
                    Err(why) => why,
                    Ok(_) => "no room for the pod".into(),
                });
                continue;
            };
            match self.constraints.admit(&occupancy, g, index, candidate.id, node) {
                Ok(chosen) => self.constraints.enter(&mut occupancy, g, index, node, chosen),
                Err(refusal) => problem(refusal.reason),
            }
        }
        problems
    }

    /// A taint with effect NoExecute on a device of `allocation` that its results do not
    /// tolerate: the device taint controller would evict the pod.
    fn evicting_taint(&self, claim: &str, allocation: &Allocation) -> Option<String> {
        allocation.devices.iter().find_map(|d| {
            self.cluster
                .device_taints(&d.driver, &d.pool, &d.device)
                .into_iter()
                .find(|t| t.effect == TaintEffect::NoExecute && !d.tolerations.iter().any(|tol| tol.tolerates(t)))
                .map(|t| {
                    format!(
                        "device {}/{}/{} of claim {claim} has the taint {}={}:NoExecute",
                        d.driver,
                        d.pool,
                        d.device,
                        t.key,
                        t.value.as_deref().unwrap_or_default()
                    )
                })
        })
    }
}
