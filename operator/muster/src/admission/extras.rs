//! Pods beyond a group's `minCount`: they start when they fit, in the gang's placement
//! domain, after the gang itself runs. Placing them is a commit of its own — recorded
//! (not yet released), reserved and checked, recorded released, then released; losing
//! one is the state machine's business (it is dropped and placed again).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use kube::api::Api;
use muster_admission::{Journal, Pin, PodRef, Record, commit};
use muster_api::v1alpha1::Workload;
use muster_engine::cluster::PlanId;
use muster_engine::placement::{self, Outcome, Plan};
use muster_engine::request::GangRequest;
use tracing::info;

use crate::admission::places;
use crate::admission::reserve::core_placement;
use crate::admission::waiting::Held;
use crate::admission::{Admission, CommitError, key};
use crate::workload::membership;
use crate::workload::observe;

/// Extras of a released gang that fit now, with their plan.
pub(crate) struct PlannedExtras {
    /// The gang's request cut down to the waiting pods.
    extras: GangRequest,
    plan: Plan,
    /// The gang's pods of the current attempt.
    pods: Vec<std::sync::Arc<Pod>>,
}

impl PlannedExtras {
    /// The nodes the extras are planned on.
    pub(crate) fn nodes(&self) -> impl Iterator<Item = &str> {
        self.plan.pods.iter().map(|p| p.node.as_str())
    }
}

/// Whether a released gang's waiting extras fit now.
pub(crate) enum ExtrasPlan {
    Fit(Box<PlannedExtras>),
    Wait,
    NoneWaiting,
}

impl Admission {
    /// The plan of the waiting extras of a released gang, if some fit now.
    pub(super) async fn plan_extras(
        &self,
        workload: &Workload,
        journal: &Journal,
        held: &Held,
    ) -> Result<ExtrasPlan, CommitError> {
        let attempt = membership::attempt(workload);
        let pods: Vec<std::sync::Arc<Pod>> = self
            .gang_pods(workload)
            .into_iter()
            .filter(|p| membership::of_attempt(p, attempt))
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        let by_controller = places::restarted_by_pod_controller(workload);
        // Places being vacated for the controller's replacements: their devices are not
        // free yet, and the replacements go back onto them.
        if by_controller && journal.core().any(|p| p.released_at.is_none()) {
            return Ok(ExtrasPlan::NoneWaiting);
        }
        // A core pod that failed or went since the state machine's look: its place is
        // vacated first (its replacement must not be taken for an extra).
        let dead = |name: &str| {
            pods.iter().find(|p| p.name_any() == name).is_none_or(|p| {
                p.metadata.deletion_timestamp.is_some()
                    || p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed")
            })
        };
        if by_controller && journal.core().any(|p| dead(&p.name)) {
            return Ok(ExtrasPlan::NoneWaiting);
        }
        // No pod of the gang left (a JobSet restarting all its Jobs): the replacements
        // are placed as the whole gang, its topology and all.
        let whole = by_controller && journal.pods.is_empty();
        let planned: BTreeSet<&str> = journal.pods.iter().map(|p| p.name.as_str()).collect();
        // Core pods in place, by group: a group short of its minCount gets its
        // replacements all at once or not at all.
        let mut in_place: BTreeMap<String, i32> = BTreeMap::new();
        for planned in journal.core() {
            if let Some(group) = pods
                .iter()
                .find(|p| p.name_any() == planned.name)
                .and_then(|p| membership::group_of(workload, p))
            {
                *in_place.entry(group.name.clone()).or_default() += 1;
            }
        }
        let waiting: BTreeSet<String> = pods
            .iter()
            .filter(|p| crate::workload::status::is_gated(p) && !planned.contains(p.name_any().as_str()))
            .map(|p| p.name_any())
            .collect();
        if waiting.is_empty() {
            return Ok(ExtrasPlan::NoneWaiting);
        }
        // A gang that is not what the cluster can place now waits like any other.
        let request = match self.request(workload) {
            Ok(request) => request,
            Err(e) => {
                tracing::debug!(workload = %key(workload), error = %e, "extras wait");
                return Ok(ExtrasPlan::Wait);
            }
        };
        let mut extras = request.clone();
        // One view for the groups' values, the excluded nodes and the plan: as the gang's
        // own plan sees the cluster, through nominations of lower priority only.
        let snapshot = self.planning_view(&key(workload), self.priority(workload));
        for group in &mut extras.groups {
            // The value of the group's own level its planned pods have: from any of them
            // whose node is still there and labelled. Without one, the extras wait rather
            // than escape the level.
            let group_value = group.topology.required.as_ref().map(|key| {
                let value = journal
                    .pods
                    .iter()
                    .filter(|planned| group.pods.iter().any(|p| p.key.name() == planned.name))
                    .find_map(|planned| snapshot.node(&planned.node)?.labels.get(key).cloned());
                (key.clone(), value)
            });
            // Kueue's pod counts per assigned domain, less the group's pods placed there
            // (one placed outside every domain, before Kueue's current decision, still
            // counts against the group's total: it is taken from the roomiest domain).
            for planned in journal.pods.iter().filter(|planned| {
                !waiting.contains(&planned.name) && group.pods.iter().any(|p| p.key.name() == planned.name)
            }) {
                let domain = match group.assigned.iter().position(|d| d.nodes.contains(&planned.node)) {
                    Some(d) => Some(d),
                    None => (0..group.assigned.len()).max_by_key(|d| group.assigned[*d].pods),
                };
                if let Some(d) = domain {
                    group.assigned[d].pods = group.assigned[d].pods.saturating_sub(1);
                }
            }
            group.pods.retain(|p| waiting.contains(p.key.name()));
            // Core pods the group is short of (only where the pods' controller replaces
            // them: otherwise a lost core pod restarts the gang).
            let missing = if by_controller {
                let min_count = i32::try_from(group.min_count).unwrap_or(i32::MAX);
                usize::try_from(min_count - in_place.get(&group.name).copied().unwrap_or(0)).unwrap_or(0)
            } else {
                0
            };
            if missing > 0 {
                let core_waiting = group
                    .pods
                    .iter()
                    .filter(|p| {
                        pods.iter()
                            .find(|pod| pod.name_any() == p.key.name())
                            .is_some_and(|pod| membership::is_core(workload, pod))
                    })
                    .count();
                if core_waiting < missing {
                    tracing::debug!(workload = %key(workload), group = %group.name, missing, core_waiting, "replacements wait for the rest");
                    return Ok(ExtrasPlan::Wait);
                }
            }
            // A group none of whose pods is in place picks its own level's value anew.
            let refill = missing > 0 && !in_place.contains_key(&group.name);
            if let Some((_, None)) = group_value
                && !refill
            {
                group.pods.clear();
            }
            let group_value = group_value.and_then(|(key, value)| Some((key, value?)));
            group.min_count = missing;
            // The gang's placement domain.
            if let (Some(key), Some(value)) = (&extras.topology.required, &journal.topology_value) {
                group.shape.node_selector.insert(key.clone(), value.clone());
            }
            if let Some((key, value)) = group_value {
                group.shape.node_selector.insert(key, value);
            }
            // Sliced groups have no extras (the API requires minCount = replicas); a
            // group refilled whole keeps its own level and slices.
            if !refill {
                group.topology = Default::default();
            }
        }
        extras.groups.retain(|g| !g.pods.is_empty());
        if !whole {
            extras.topology = Default::default();
        }
        // Claims the extras would hold as they are, checked as a gang's are.
        if let Some(why) = self.found_claims_wait(workload, &extras, &snapshot) {
            tracing::debug!(workload = %key(workload), why, "extras wait");
            return Ok(ExtrasPlan::Wait);
        }
        // On a snapshot and a blocking thread, like a gang's plan.
        let outcome = {
            let cluster = snapshot.clone();
            // Off nodes held for gangs of its priority or higher that waited longest or
            // retry a commit (Kueue's decision is in each group's assigned domains).
            let excluded = held.against(self.priority(workload), &key(workload));
            // Off nodes kube-scheduler refused the group's pods on lately.
            let avoid = super::refusals::avoid(workload, &extras, crate::workload::observe::now_millis());
            // Replacements go back where their predecessors ran, if they all still can.
            let previous = if by_controller {
                self.places.previous(workload, &pods, &extras)
            } else {
                Default::default()
            };
            let options = muster_engine::placement::PlanOptions {
                excluded_nodes: std::sync::Arc::new(excluded),
                avoid: std::sync::Arc::new(avoid),
                previous: std::sync::Arc::new(previous),
                ..self.settings.plan.clone()
            };
            let request = extras.clone();
            tokio::task::spawn_blocking(move || placement::plan(&cluster, &request, &options))
                .await
                .map_err(|e| CommitError::Planning(e.to_string()))?
        };
        let Outcome::Placed(plan) = outcome else {
            return Ok(ExtrasPlan::Wait);
        };
        if plan.pods.is_empty() {
            return Ok(ExtrasPlan::Wait);
        }
        Ok(ExtrasPlan::Fit(Box::new(PlannedExtras { extras, plan, pods })))
    }

    /// Commits planned extras: recorded (not yet released), reserved and checked,
    /// recorded released, then released.
    pub(super) async fn commit_extras(
        &self,
        workload: &Workload,
        journal: &Journal,
        planned: PlannedExtras,
    ) -> Result<(), CommitError> {
        let PlannedExtras { extras, plan, pods } = planned;
        info!(workload = %key(workload), pods = plan.pods.len(), "placing extra pods");
        let mut placement = core_placement(&extras, &plan, places::restarted_by_pod_controller(workload));
        // Replacements of core pods carry their own claims while their commit runs (it
        // is dropped like an extra's if it stops); their devices the gang counted already.
        for replacement in placement.pods.iter_mut().filter(|p| !p.extra) {
            let own: Vec<String> = extras
                .groups
                .iter()
                .flat_map(|g| &g.pods)
                .filter(|p| p.key.name() == replacement.name)
                .flat_map(|p| &p.claims)
                .filter(|c| !extras.shared_claims.iter().any(|s| s.key == c.key))
                .map(|c| c.key.name().to_string())
                .collect();
            let devices: usize = plan
                .claims
                .iter()
                .filter(|c| own.iter().any(|o| o == c.claim.name()))
                .map(|c| c.allocation.devices.len())
                .sum();
            placement.devices -= i32::try_from(devices).unwrap_or(0);
            replacement.claims = own;
        }
        let grown = commit::with_extras(journal, &placement);
        let recorded = self
            .record(
                workload,
                Record {
                    journal: Some(grown.clone()),
                    conditions: vec![],
                    restarts: None,
                    refusals: None,
                },
            )
            .await?;
        let assumption = PlanId::Extras(key(workload));
        let (assumed_pods, assumed_claims) = plan.assumption(&extras);
        self.index
            .update(|c| c.assume(&assumption, &assumed_pods, &assumed_claims));
        let reserved = match self.hold_found(workload, &extras, &plan).await {
            Ok(()) => self.reserve(workload, &plan).await,
            Err(e) => Err(e),
        };
        if reserved.is_ok() {
            // The allocations are the cluster's now (the watch may have shown them).
            self.index.update(|c| c.confirm(&assumption));
            self.places.remember(workload, &pods, &extras, &plan);
        } else {
            self.index.update(|c| c.forget(&assumption));
        }
        if let Err((error, written)) = reserved {
            // The state machine drops the extras that were never released.
            let api: Api<ResourceClaim> =
                Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
            self.undo_allocations(&api, written).await?;
            return Err(error);
        }
        let released = commit::extras_released(&grown, &placement, observe::now_millis());
        let recorded = self
            .record(
                &recorded,
                Record {
                    journal: Some(released),
                    conditions: vec![],
                    restarts: None,
                    refusals: None,
                },
            )
            .await?;
        // Released as a gang's pods are: their claims listed and protected first, then
        // every pod at once.
        let pins: Vec<Pin> = placement
            .pods
            .iter()
            .filter_map(|planned| {
                let pod = pods.iter().find(|p| p.name_any() == planned.name)?;
                Some(Pin {
                    pod: PodRef {
                        name: planned.name.clone(),
                        uid: pod.uid()?,
                    },
                    node: planned.node.clone(),
                })
            })
            .collect();
        self.release_pins(&recorded, &pins).await?;
        crate::ops::metrics::get().extras_placed.inc_by(plan.pods.len() as u64);
        Ok(())
    }
}
