//! Where each member of a gang ran last: its node and devices, by group and member
//! index. A replacement the pods' controller makes for a member (a JobSet restarting its
//! Jobs, a Job replacing a failed pod), and a member of a gang muster restarts, is
//! planned back there first (`PlanOptions::previous`), so a restart comes back onto the
//! same devices when they are still free. Kept in memory: after an operator restart,
//! restarts are planned afresh.
//!
//! While a member's place is vacant (its pod failed or went, its replacement not placed
//! yet), its devices are held for the gang as a nomination holds devices: against gangs
//! that could not preempt it, for at most [`VACANCY_HOLD`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use muster_admission::State;
use muster_api::v1alpha1::{RestartedBy, Workload};
use muster_engine::cluster::{AssumedClaim, PlanId};
use muster_engine::key::ObjectKey;
use muster_engine::placement::{Plan, PreviousPlace, PreviousPlaces};
use muster_engine::request::GangRequest;

use super::{Admission, conflicts, key};
use crate::workload::{membership, observe};

/// How long the devices of a vacant place are held for the controller's replacement (a
/// JobSet recreating its Jobs takes seconds; a job that never replaces its pod must
/// not keep devices from others).
pub(crate) const VACANCY_HOLD: Duration = Duration::from_secs(300);

/// A member: its group and its index within the group.
type Member = (String, i32);

/// The last places of the members of each gang whose pods their controller restarts.
#[derive(Default)]
pub(crate) struct Places {
    gangs: Mutex<HashMap<ObjectKey, BTreeMap<Member, PreviousPlace>>>,
    /// Since when each place has been seen vacant.
    vacant_since: Mutex<HashMap<(ObjectKey, Member), Instant>>,
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
        let mut vacant = self.vacant_since.lock().unwrap_or_else(|e| e.into_inner());
        vacant.retain(|(gang, _), _| gangs.contains(gang));
    }

    /// The places of `gang` no member in `in_place` fills, vacant for less than
    /// [`VACANCY_HOLD`]; forgets when the others became vacant.
    fn vacant(&self, gang: &ObjectKey, in_place: &BTreeSet<Member>) -> Vec<(Member, PreviousPlace)> {
        let places = self.gangs.lock().unwrap_or_else(|e| e.into_inner());
        let mut since = self.vacant_since.lock().unwrap_or_else(|e| e.into_inner());
        since.retain(|(g, member), _| g != gang || !in_place.contains(member));
        let Some(places) = places.get(gang) else {
            return Vec::new();
        };
        places
            .iter()
            .filter(|(member, _)| !in_place.contains(*member))
            .filter(|(member, _)| {
                let at = *since
                    .entry((gang.clone(), (*member).clone()))
                    .or_insert_with(Instant::now);
                at.elapsed() < VACANCY_HOLD
            })
            .map(|(member, place)| (member.clone(), place.clone()))
            .collect()
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
            let pods = self.gang_pods(workload);
            // Members whose pod is placed and alive; a pod that failed or is going
            // leaves its place vacant from now, before the journal says so.
            let alive = |pod: &Pod| {
                pod.metadata.deletion_timestamp.is_none()
                    && pod.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Failed")
            };
            let in_place: BTreeSet<Member> = journal
                .pods
                .iter()
                .filter(|p| p.released_at.is_some())
                .filter_map(|p| pods.iter().find(|pod| pod.name_any() == p.name))
                .filter(|pod| alive(pod))
                .filter_map(|pod| member(workload, pod))
                .collect();
            let gang = key(workload);
            let vacant = self.places.vacant(&gang, &in_place);
            let namespace = workload.namespace().unwrap_or_default();
            // Held from the moment the place is vacant, before the old claim is given
            // back: a gang planned in between must not take what it frees.
            let claims: Vec<AssumedClaim> = vacant
                .iter()
                .map(|((group, index), place)| AssumedClaim {
                    claim: conflicts::nomination_hold(&namespace, &format!("vacant-{group}-{index}"), &gang),
                    devices: place
                        .devices
                        .iter()
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
