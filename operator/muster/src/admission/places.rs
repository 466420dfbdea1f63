//! Where each member of a gang whose pods another controller restarts ran last: its node
//! and devices, by group and member index. A replacement the controller makes for a
//! member (a JobSet restarting its Jobs, a Job replacing a failed pod) is planned back
//! there first (`PlanOptions::previous`), so a restart comes back onto the same devices
//! when they are still free. Kept in memory: after an operator restart, replacements
//! are planned afresh.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use muster_api::v1alpha1::{RestartedBy, Workload};
use muster_engine::key::ObjectKey;
use muster_engine::placement::{Plan, PreviousPlace, PreviousPlaces};
use muster_engine::request::GangRequest;

use crate::workload::membership;

/// A member: its group and its index within the group.
type Member = (String, i32);

/// The last places of the members of each gang whose pods their controller restarts.
#[derive(Default)]
pub(crate) struct Places {
    gangs: Mutex<HashMap<ObjectKey, BTreeMap<Member, PreviousPlace>>>,
}

/// Whether the pods' own controller restarts the gang (`restartedBy: PodController`).
pub(crate) fn restarted_by_pod_controller(workload: &Workload) -> bool {
    workload.spec.failure_policy.as_ref().and_then(|p| p.restarted_by) == Some(RestartedBy::PodController)
}

fn member(workload: &Workload, pod: &Pod) -> Option<Member> {
    let group = membership::group_of(workload, pod)?;
    Some((group.name.clone(), membership::member_index(pod, group)?))
}

impl Places {
    /// Remembers where `plan` put the members of `workload` (`request`'s pods, named as
    /// `pods` are).
    pub(crate) fn remember(
        &self,
        workload: &Workload,
        pods: &[std::sync::Arc<Pod>],
        request: &GangRequest,
        plan: &Plan,
    ) {
        if !restarted_by_pod_controller(workload) {
            return;
        }
        let mut placed = BTreeMap::new();
        for placement in &plan.pods {
            let Some(pod) = pods.iter().find(|p| p.name_any() == placement.pod.name()) else {
                continue;
            };
            let Some(member) = member(workload, pod) else {
                continue;
            };
            let own = request
                .groups
                .iter()
                .flat_map(|g| &g.pods)
                .find(|p| p.key == placement.pod)
                .map(|p| p.claims.iter().map(|c| &c.key).collect::<Vec<_>>())
                .unwrap_or_default();
            let devices = plan
                .claims
                .iter()
                .filter(|c| own.contains(&&c.claim))
                .flat_map(|c| c.allocation.devices.iter().map(|d| d.device_id()))
                .collect();
            let place = PreviousPlace {
                node: placement.node.clone(),
                devices,
            };
            placed.insert(member, place);
        }
        let mut gangs = self.gangs.lock().unwrap_or_else(|e| e.into_inner());
        gangs.entry(crate::admission::key(workload)).or_default().extend(placed);
    }

    /// The last places of the members `pods` stand for, by their keys in `request`.
    pub(crate) fn previous(
        &self,
        workload: &Workload,
        pods: &[std::sync::Arc<Pod>],
        request: &GangRequest,
    ) -> PreviousPlaces {
        let gangs = self.gangs.lock().unwrap_or_else(|e| e.into_inner());
        let Some(places) = gangs.get(&crate::admission::key(workload)) else {
            return PreviousPlaces::new();
        };
        request
            .groups
            .iter()
            .flat_map(|g| &g.pods)
            .filter_map(|instance| {
                let pod = pods.iter().find(|p| p.name_any() == instance.key.name())?;
                let place = places.get(&member(workload, pod)?)?;
                Some((instance.key.clone(), place.clone()))
            })
            .collect()
    }

    /// Forgets the gangs that are no longer there.
    pub(crate) fn keep_only(&self, gangs: &std::collections::HashSet<ObjectKey>) {
        let mut places = self.gangs.lock().unwrap_or_else(|e| e.into_inner());
        places.retain(|gang, _| gangs.contains(gang));
    }
}
