//! What happens to an admitted gang: it succeeds when every pod of its success groups
//! has succeeded, restarts as a unit when a pod fails or is lost (onto the same
//! reservation when its nodes and devices are healthy, otherwise planned again), fails
//! for good after `failurePolicy.maxRestarts` restarts, gives everything back when
//! suspended, and is deleted `ttlSecondsAfterFinished` after it finished.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams};
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use muster_api::v1alpha1::{AdmissionState, PlacementStatus, Workload};
use muster_api::{conditions, labels};
use tracing::info;

use crate::admission::{Admission, CommitError, StatusUpdate, condition, deallocate, key, placement_of};
use crate::membership;
use crate::status::is_gated;

fn label<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

fn phase(pod: &Pod) -> Option<&str> {
    pod.status.as_ref()?.phase.as_deref()
}

fn terminal(pod: &Pod) -> bool {
    matches!(phase(pod), Some("Succeeded") | Some("Failed"))
}

/// The attempt a Workload is on (its restart count).
fn attempt(workload: &Workload) -> i32 {
    workload.status.as_ref().map_or(0, |s| s.restarts)
}

fn is_finished(workload: &Workload) -> bool {
    [conditions::SUCCEEDED, conditions::FAILED]
        .iter()
        .any(|t| condition(workload, t).is_some_and(|c| c.status == "True"))
}

/// Whether a Workload finished (succeeded or failed for good).
pub fn finished(workload: &Workload) -> bool {
    is_finished(workload)
}

impl Admission {
    /// The gang's pods of its current attempt, by name.
    fn current_pods(&self, workload: &Workload) -> BTreeMap<String, Arc<Pod>> {
        let namespace = workload.namespace().unwrap_or_default();
        let attempt = attempt(workload).to_string();
        self.stores
            .pods_of(&namespace, &workload.name_any())
            .into_iter()
            .filter(|p| label(p, labels::ATTEMPT).is_none_or(|a| a == attempt))
            .map(|p| (p.name_any(), p))
            .collect()
    }

    /// A released gang: success, failure and restarts, or waiting for the scheduler.
    pub(crate) async fn supervise(&self, workload: &Workload, next: &mut Duration) -> Result<(), CommitError> {
        let Some(placement) = placement_of(workload).cloned() else {
            return Ok(());
        };
        let pods = self.current_pods(workload);

        // Success: every pod of the success groups succeeded.
        let success_groups: Vec<&str> = match workload
            .spec
            .success_policy
            .as_ref()
            .and_then(|p| p.pod_groups.as_ref())
        {
            Some(groups) if !groups.is_empty() => groups.iter().map(String::as_str).collect(),
            _ => workload.spec.pod_groups.iter().map(|g| g.name.as_str()).collect(),
        };
        let all_succeeded = workload
            .spec
            .pod_groups
            .iter()
            .filter(|g| success_groups.contains(&g.name.as_str()))
            .all(|g| {
                // At least minCount succeeded and none still runs; an extra that never
                // got room does not hold the gang back.
                let group: Vec<&Arc<Pod>> = pods
                    .values()
                    .filter(|p| label(p, labels::POD_GROUP) == Some(g.name.as_str()))
                    .collect();
                let done = group.iter().filter(|p| phase(p) == Some("Succeeded")).count();
                let settled = group.iter().all(|p| is_gated(p) || phase(p) == Some("Succeeded"));
                done as i32 >= g.min_count() && settled
            });
        if all_succeeded {
            let message = format!("every pod of {} succeeded", success_groups.join(", "));
            return self
                .finish(workload, &placement, true, conditions::REASON_SUCCEEDED, message)
                .await;
        }

        // Failures of the gang's core (pods planned within their group's minCount).
        let mut failure: Option<(&'static str, String)> = None;
        for planned in &placement.pods {
            let pod = pods.get(&planned.name);
            let problem = match pod {
                None => Some((conditions::REASON_POD_LOST, format!("pod {} disappeared", planned.name))),
                Some(p) if is_gated(p) => Some((
                    conditions::REASON_POD_LOST,
                    format!("pod {} was replaced", planned.name),
                )),
                Some(p) if phase(p) == Some("Failed") => {
                    let why = p
                        .status
                        .as_ref()
                        .and_then(|s| s.reason.clone().or(s.message.clone()))
                        .unwrap_or_default();
                    Some((
                        conditions::REASON_POD_FAILED,
                        format!("pod {} failed {why}", planned.name).trim().to_string(),
                    ))
                }
                Some(p) => p
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_ref())
                    .filter(|node| self.index.cluster().node(node).is_none())
                    .map(|node| {
                        (
                            conditions::REASON_NODE_LOST,
                            format!("node {node} of pod {} is gone", planned.name),
                        )
                    }),
            };
            let Some(problem) = problem else { continue };
            let core = !planned.extra;
            if core {
                failure = Some(problem);
                break;
            }
        }
        if let Some((reason, message)) = failure {
            let restarts = attempt(workload);
            let max = workload.spec.failure_policy.as_ref().map_or(0, |p| p.max_restarts);
            if restarts >= max {
                let message = format!(
                    "{message}; the gang was restarted {restarts} times and failurePolicy.maxRestarts is {max}"
                );
                return self
                    .finish(workload, &placement, false, conditions::REASON_MAX_RESTARTS, message)
                    .await;
            }
            return self.restart(workload, &placement, reason, message).await;
        }

        self.tend_extras(workload).await?;

        // Waiting for the scheduler to bind every released pod (a gated extra waits for
        // its own turn above).
        let bound: BTreeSet<&str> = pods
            .values()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some() || is_gated(p))
            .map(|p| p.metadata.name.as_deref().unwrap_or_default())
            .collect();
        if placement.pods.iter().all(|p| bound.contains(p.name.as_str())) {
            return Ok(());
        }
        self.check_schedule_timeout(workload, &placement, &bound, next).await
    }

    /// Restarts the gang: its pods are deleted (the controller recreates them for the next
    /// attempt) and, once they are gone, the gang goes back onto its reservation or into
    /// the queue.
    async fn restart(
        &self,
        workload: &Workload,
        placement: &PlacementStatus,
        reason: &'static str,
        message: String,
    ) -> Result<(), CommitError> {
        // Claims kube-controller-manager made for another controller's pods go with them.
        let reuse = !membership::has_external_groups(workload) && self.reservation_healthy(workload, placement);
        let restarts = attempt(workload) + 1;
        let mut restarting = placement.clone();
        restarting.state = Some(AdmissionState::Restarting);
        restarting.reuse_reservation = reuse;
        restarting.released_at = None;
        let plan = if reuse {
            "onto the same nodes and devices"
        } else {
            "after placing the gang again"
        };
        let note = format!("{message}; restarting the gang (restart {restarts}) {plan}");
        crate::metrics::get()
            .restarts
            .get_or_create(&crate::metrics::ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
        info!(workload = %key(workload), "{note}");
        self.write_status(
            workload,
            StatusUpdate {
                conditions: vec![(conditions::RESTARTING, true, reason.to_string(), note.clone())],
                placement: Some(Some(restarting)),
                restarts: Some(restarts),
            },
        )
        .await?;
        self.event(
            workload,
            EventType::Warning,
            conditions::EVENT_RESTARTING,
            "Restart",
            note,
        )
        .await;
        self.delete_pods(workload, |_| true).await
    }

    /// The planned nodes exist and are schedulable, and every claim still holds an
    /// allocation whose devices are still published.
    fn reservation_healthy(&self, workload: &Workload, placement: &PlacementStatus) -> bool {
        let cluster = self.index.cluster();
        let nodes_ok = placement
            .nodes
            .iter()
            .all(|n| cluster.node(n).is_some_and(|node| !node.unschedulable));
        if !nodes_ok {
            return false;
        }
        let claims = self.claims_by_name(workload);
        placement.claims.iter().all(|name| {
            let Some(allocation) = claims.get(name).and_then(|c| c.status.as_ref()?.allocation.clone()) else {
                return false;
            };
            allocation
                .devices
                .iter()
                .flat_map(|d| d.results.iter().flatten())
                .all(|r| cluster.device_published(&r.driver, &r.pool, &r.device))
        })
    }

    /// A restarting gang: once the old attempt's pods are gone, back onto the reservation
    /// (released when the new pods exist) or into the queue.
    pub(crate) async fn restart_step(&self, workload: &Workload) -> Result<(), CommitError> {
        let Some(placement) = placement_of(workload).cloned() else {
            return Ok(());
        };
        let namespace = workload.namespace().unwrap_or_default();
        let current = attempt(workload).to_string();
        let old: Vec<Arc<Pod>> = self
            .stores
            .pods_of(&namespace, &workload.name_any())
            .into_iter()
            .filter(|p| label(p, labels::ATTEMPT) != Some(current.as_str()))
            .collect();
        if !old.is_empty() {
            return self
                .delete_pods(workload, |p| label(p, labels::ATTEMPT) != Some(current.as_str()))
                .await;
        }
        if placement.reuse_reservation && self.reservation_healthy(workload, &placement) {
            let mut reserved = placement.clone();
            reserved.state = Some(AdmissionState::Reserved);
            reserved.reuse_reservation = false;
            let message = format!("attempt {current} goes onto the same nodes and devices");
            self.write_status(
                workload,
                StatusUpdate {
                    conditions: vec![(
                        conditions::RESTARTING,
                        false,
                        conditions::REASON_RESTARTED.into(),
                        message,
                    )],
                    placement: Some(Some(reserved)),
                    restarts: None,
                },
            )
            .await?;
            return Ok(());
        }
        let message = format!("attempt {current} is queued to be placed again");
        self.write_status(
            workload,
            StatusUpdate {
                conditions: vec![(
                    conditions::RESTARTING,
                    false,
                    conditions::REASON_RESTARTED.into(),
                    message.clone(),
                )],
                placement: None,
                restarts: None,
            },
        )
        .await?;
        self.undo(workload, conditions::REASON_RESTARTED, message).await
    }

    /// Records success or failure; the gang's pods are stopped and its devices given
    /// back by [`Admission::finish_step`].
    async fn finish(
        &self,
        workload: &Workload,
        placement: &PlacementStatus,
        succeeded: bool,
        reason: &'static str,
        message: String,
    ) -> Result<(), CommitError> {
        let mut finishing = placement.clone();
        finishing.state = Some(AdmissionState::Finishing);
        let type_ = if succeeded {
            conditions::SUCCEEDED
        } else {
            conditions::FAILED
        };
        info!(workload = %key(workload), outcome = type_, "{message}");
        self.write_status(
            workload,
            StatusUpdate {
                conditions: vec![(type_, true, reason.to_string(), message.clone())],
                placement: Some(Some(finishing)),
                restarts: None,
            },
        )
        .await?;
        let (event_type, event) = if succeeded {
            (EventType::Normal, conditions::EVENT_SUCCEEDED)
        } else {
            (EventType::Warning, conditions::EVENT_FAILED)
        };
        self.event(workload, event_type, event, "Finish", message).await;
        Ok(())
    }

    /// A finished gang: stop what still runs, deallocate every claim once no running pod
    /// uses it, then hold nothing.
    pub(crate) async fn finish_step(&self, workload: &Workload) -> Result<(), CommitError> {
        let Some(placement) = placement_of(workload).cloned() else {
            return Ok(());
        };
        self.delete_pods(workload, |p| !terminal(p)).await?;
        if self.release_claims(workload, &placement).await? {
            let mut finished = placement;
            finished.state = Some(AdmissionState::Finished);
            self.write_status(workload, StatusUpdate::placement(finished)).await?;
        }
        Ok(())
    }

    /// A suspended gang: its pods go (the controller deletes them too) and its claims are
    /// deallocated; it is queued again when resumed.
    pub(crate) async fn suspend_step(&self, workload: &Workload) -> Result<(), CommitError> {
        let Some(placement) = placement_of(workload).cloned() else {
            return Ok(());
        };
        self.delete_pods(workload, |_| true).await?;
        let namespace = workload.namespace().unwrap_or_default();
        if !self.stores.pods_of(&namespace, &workload.name_any()).is_empty() {
            return Ok(());
        }
        if self.release_claims(workload, &placement).await? {
            self.undo(
                workload,
                conditions::REASON_SUSPENDED,
                "spec.suspend is true: the gang holds nothing".into(),
            )
            .await?;
        }
        Ok(())
    }

    /// A finished gang with `ttlSecondsAfterFinished`: deleted when the time is up.
    pub(crate) async fn expire(&self, workload: &Workload, next: &mut Duration) -> Result<(), CommitError> {
        let Some(ttl) = workload.spec.ttl_seconds_after_finished else {
            return Ok(());
        };
        let finished_at = [conditions::SUCCEEDED, conditions::FAILED]
            .iter()
            .filter_map(|t| condition(workload, t).filter(|c| c.status == "True"))
            .map(|c| c.last_transition_time.0)
            .next();
        let Some(finished_at) = finished_at else { return Ok(()) };
        let age = Timestamp::now().duration_since(finished_at).unsigned_abs();
        let ttl = Duration::from_secs(u64::try_from(ttl).unwrap_or(0));
        if age < ttl {
            *next = (*next).min(ttl - age + Duration::from_millis(100));
            return Ok(());
        }
        let api: Api<Workload> = Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
        let message = format!("deleted {}s after it finished (ttlSecondsAfterFinished)", ttl.as_secs());
        self.event(
            workload,
            EventType::Normal,
            conditions::EVENT_EXPIRED,
            "Delete",
            message,
        )
        .await;
        match api.delete(&workload.name_any(), &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Deallocates the gang's claims whose consumers have all finished or are gone;
    /// whether every claim is deallocated now.
    async fn release_claims(&self, workload: &Workload, placement: &PlacementStatus) -> Result<bool, CommitError> {
        let namespace = workload.namespace().unwrap_or_default();
        let pods: BTreeMap<String, Arc<Pod>> = self
            .stores
            .pods_of(&namespace, &workload.name_any())
            .into_iter()
            .filter_map(|p| Some((p.uid()?, p)))
            .collect();
        let claims = self.claims_by_name(workload);
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
        let mut all_done = true;
        for name in &placement.claims {
            let Some(claim) = claims.get(name) else { continue };
            let Some(status) = &claim.status else { continue };
            if status.allocation.is_none() {
                continue;
            }
            let in_use = status
                .reserved_for
                .iter()
                .flatten()
                .any(|c| pods.get(&c.uid).is_some_and(|p| !terminal(p)));
            if in_use {
                all_done = false;
                continue;
            }
            deallocate(&api, name).await?;
        }
        Ok(all_done)
    }

    /// Deletes the gang's pods that `which` selects and are not being deleted yet.
    async fn delete_pods(&self, workload: &Workload, which: impl Fn(&Pod) -> bool) -> Result<(), CommitError> {
        let namespace = workload.namespace().unwrap_or_default();
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        for pod in self.stores.pods_of(&namespace, &workload.name_any()) {
            if !which(&pod) {
                continue;
            }
            // A pod whose node is gone runs nowhere and no kubelet will confirm its end:
            // remove it at once.
            let node_gone = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_some_and(|n| self.index.cluster().node(n).is_none());
            let params = match (node_gone, pod.meta().deletion_timestamp.is_some()) {
                (true, _) => DeleteParams {
                    grace_period_seconds: Some(0),
                    ..DeleteParams::default()
                },
                (false, true) => continue,
                (false, false) => DeleteParams::default(),
            };
            match api.delete(&pod.name_any(), &params).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}
