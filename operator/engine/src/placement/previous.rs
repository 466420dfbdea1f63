//! Going back to where pods were: replacements of pods another controller made again
//! (a JobSet that restarts its Jobs, a Job that replaces a failed pod) are tried on
//! the node and the very devices their predecessors had, before any fresh plan. The
//! trial is first fit with one node per pod and the allocator confined to the
//! predecessor's devices, so every filter, selector and constraint of a fresh plan
//! applies; if one pod cannot go back, the gang is planned afresh.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::{Domain, Plan, Planner, PodFit};
use crate::allocator::AllocationError;
use crate::claim::DeviceId;
use crate::key::PodKey;

/// Where a pod's predecessor ran: its node and the devices its claims held.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PreviousPlace {
    pub node: String,
    pub devices: BTreeSet<DeviceId>,
}

/// Pods of the request with the place of their predecessor.
pub type PreviousPlaces = BTreeMap<PodKey, PreviousPlace>;

impl<'a> Planner<'a> {
    /// The plan that puts every pod of the request back where its predecessor was, if
    /// every pod has one and each fits there now (its node, its devices, the gang's and
    /// its group's topology); `None` otherwise.
    pub(super) fn place_as_before(&self) -> Result<Option<Plan>, AllocationError> {
        let gang = self.gang;
        let previous = &self.options.previous;
        let pods = gang.groups.iter().flat_map(|g| &g.pods);
        if previous.is_empty() || pods.clone().any(|p| !previous.contains_key(&p.key)) {
            return Ok(None);
        }
        let mut state = self.first_fit_start();
        let mut budget = self.options.step_budget;
        // In the order first fit places pods: a pod whose affinity needs another group's
        // pods finds them entered.
        for (g, index) in self.pod_order() {
            let pod = &gang.groups[g].pods[index];
            let place = &previous[&pod.key];
            let Some(candidate) = self.candidates.iter().position(|c| c.node.name == place.node) else {
                return Ok(None);
            };
            state.full[g].clear();
            state.usage.confine(Some(Arc::new(place.devices.clone())));
            let fit = self.fit_pod(&mut state, g, index, &[candidate], &|_| true, &mut budget)?;
            state.usage.confine(None);
            if !matches!(fit, PodFit::Placed) {
                return Ok(None);
            }
        }
        if !self.topology_holds(&state.placed) {
            return Ok(None);
        }
        let value = gang.topology.required.as_ref().and_then(|key| {
            let node = state.placed.iter().flatten().flatten().next()?;
            self.cluster.node(node)?.labels.get(key).cloned()
        });
        let domain = Domain {
            value,
            nodes: vec![],
            capacity: vec![],
            leftover: 0,
            _marker: Default::default(),
        };
        state.new_claims.sort_by_key(|(order, _)| *order);
        Ok(Some(self.assemble(
            &domain,
            &state.placed,
            state.new_claims.into_iter().map(|(_, c)| c).collect(),
            &state.occupancy,
        )))
    }

    /// Whether pods on these nodes keep the gang's required level, each group's own
    /// level and each slice within one value (labels can change while pods are away).
    fn topology_holds(&self, placed: &[Vec<Option<String>>]) -> bool {
        let label = |node: &str, key: &str| self.cluster.node(node).and_then(|n| n.labels.get(key).cloned());
        let one_value = |nodes: &mut dyn Iterator<Item = &String>, key: &str| {
            let values: BTreeSet<Option<String>> = nodes.map(|n| label(n, key)).collect();
            values.len() <= 1 && !values.contains(&None)
        };
        if let Some(key) = &self.gang.topology.required
            && !one_value(&mut placed.iter().flatten().flatten(), key)
        {
            return false;
        }
        self.gang.groups.iter().zip(placed).all(|(group, nodes)| {
            let required = group
                .topology
                .required
                .as_ref()
                .is_none_or(|key| one_value(&mut nodes.iter().flatten(), key));
            let slices = group.topology.slice.as_ref().is_none_or(|slice| {
                nodes
                    .chunks(slice.size.max(1))
                    .all(|chunk| one_value(&mut chunk.iter().flatten(), &slice.key))
            });
            required && slices
        })
    }
}
