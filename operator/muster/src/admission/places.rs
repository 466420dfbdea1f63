//! Where each member of a gang ran last: its node and devices, by group and member
//! index. A replacement the pods' controller makes for a member (a JobSet restarting its
//! Jobs, a Job replacing a failed pod), and a member of a gang muster restarts, is
//! planned back there first (`PlanOptions::previous`), so a restart comes back onto the
//! same devices when they are still free. Kept in memory, and for a vacated place in the
//! journal (`status.placement.vacancies`), so that a restarted operator or a new leader
//! still puts a replacement back where its predecessor ran.
//!
//! While a member's place is vacant (its pod failed or went, its replacement not placed
//! yet), its devices are held for the gang as a nomination holds devices: against gangs
//! that could not preempt it, for as long as the journal names the vacancy (the state
//! machine requeues the whole gang once it is older than the schedule timeout).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use muster_admission::State;
use muster_api::v1alpha1::{RestartedBy, Workload};
use muster_engine::claim::DeviceId;
use muster_engine::cluster::{AssumedClaim, PlanId};
use muster_engine::key::ObjectKey;
use muster_engine::placement::{Plan, PreviousPlace, PreviousPlaces};
use muster_engine::request::GangRequest;

use super::{Admission, conflicts, key};
use crate::workload::{membership, observe};

/// A member: its group and its index within the group.
type Member = (String, i32);

/// The last places of the members of each gang whose pods their controller restarts.
#[derive(Default)]
pub(crate) struct Places {
    gangs: Mutex<HashMap<ObjectKey, BTreeMap<Member, PreviousPlace>>>,
}

/// A device a vacancy records (`driver/pool/device`; a pool may hold slashes).
fn device(text: &str) -> Option<DeviceId> {
    let (driver, rest) = text.split_once('/')?;
    let (pool, device) = rest.rsplit_once('/')?;
    Some(DeviceId {
        driver: driver.to_string(),
        pool: pool.to_string(),
        device: device.to_string(),
    })
}

/// The places the journal of `workload` records as vacant, by member.
fn recorded_vacancies(workload: &Workload) -> BTreeMap<Member, PreviousPlace> {
    observe::journal(workload)
        .into_iter()
        .flat_map(|j| j.vacancies)
        .filter_map(|v| {
            let member = (v.group?, v.index?);
            let place = PreviousPlace {
                node: v.node,
                devices: v.devices.iter().filter_map(|d| device(d)).collect(),
            };
            Some((member, place))
        })
        .collect()
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
        // What this process remembers, else what the journal recorded of a vacated
        // place (after a restart or a change of leader).
        let mut places = recorded_vacancies(workload);
        if let Some(remembered) = gangs.get(&crate::admission::key(workload)) {
            places.extend(remembered.iter().map(|(m, p)| (m.clone(), p.clone())));
        }
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

impl Admission {
    /// Every pass, under each running gang's nomination plan (a placed gang has no
    /// nomination): the devices of its vacant places. Returns the gangs holding some.
    pub(super) fn hold_vacant_places(&self, workloads: &[Arc<Workload>]) -> BTreeSet<ObjectKey> {
        let mut holding = BTreeSet::new();
        for workload in workloads {
            if !restarted_by_pod_controller(workload)
                || workload.metadata.deletion_timestamp.is_some()
                || workload.spec.suspend == Some(true)
            {
                continue;
            }
            let Some(journal) = observe::journal(workload).filter(|j| j.state == State::Released) else {
                continue;
            };
            let gang = key(workload);
            let namespace = workload.namespace().unwrap_or_default();
            // Held from the record of the vacancy on, before the old claim is given back:
            // a gang planned in between must not take what it frees.
            let claims: Vec<AssumedClaim> = journal
                .vacancies
                .iter()
                .map(|vacancy| AssumedClaim {
                    claim: conflicts::nomination_hold(&namespace, &format!("vacant-{}", vacancy.pod), &gang),
                    devices: vacancy
                        .devices
                        .iter()
                        .filter_map(|d| device(d))
                        .map(|d| conflicts::held_device("vacant", &d.driver, &d.pool, &d.device))
                        .collect(),
                })
                .filter(|c| !c.devices.is_empty())
                .collect();
            if claims.is_empty() {
                continue;
            }
            self.index
                .update(|c| c.assume(&PlanId::Nomination(gang.clone()), &[], &claims));
            holding.insert(gang);
        }
        holding
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_device_parses_back_whatever_slashes_its_pool_has() {
        let id = device("gpu.example.com/zone-a/rack-1/node-3/gpu-7").expect("a device");
        assert_eq!(
            (id.driver.as_str(), id.pool.as_str(), id.device.as_str()),
            ("gpu.example.com", "zone-a/rack-1/node-3", "gpu-7")
        );
        assert_eq!(id.to_string(), "gpu.example.com/zone-a/rack-1/node-3/gpu-7");
        assert_eq!(device("no-slashes"), None);
    }
}
