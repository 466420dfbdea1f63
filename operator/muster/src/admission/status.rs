//! The admission loop's part of a Workload's status: the conditions it owns, the restart
//! count and the journal (`status.placement`), written against the version observed;
//! and its events.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::EventType;
use muster_admission::{ConditionType, EventKind, Reason, Record, State};
use muster_api::v1alpha1::{NominationStatus, PlacementStatus, SchedulerRefusal, Workload};
use muster_api::{conditions, labels};
use muster_engine::cluster::PlanId;
use muster_engine::key::ObjectKey;
use serde_json::json;

use crate::kube_ops;
use crate::ops::metrics::{self, ReasonLabel};
use crate::workload::observe::{self};

use super::{Admission, CommitError, key, now, placement_of, version};

/// Conditions the admission loop owns.
pub(super) const ADMISSION_CONDITIONS: [&str; 4] = [
    conditions::ADMITTED,
    conditions::RESTARTING,
    conditions::SUCCEEDED,
    conditions::FAILED,
];

/// One condition the admission loop sets.
pub(crate) struct ConditionUpdate {
    pub(crate) type_: &'static str,
    pub(crate) status: bool,
    pub(crate) reason: String,
    pub(crate) message: String,
}

/// A change to the admission loop's part of the status: the conditions it sets (the
/// others it owns are kept), the placement (`None` removes it), and the restart count
/// (`None` keeps it).
pub(crate) struct StatusUpdate {
    pub(crate) conditions: Vec<ConditionUpdate>,
    pub(crate) placement: Option<PlacementStatus>,
    pub(crate) restarts: Option<muster_admission::Restarts>,
    pub(crate) nomination: NominationUpdate,
    /// `status.schedulerRefusals` (`None` keeps them).
    pub(crate) refusals: Option<Vec<SchedulerRefusal>>,
}

/// What a status write does with `status.nomination` (a server-side apply that left it
/// out would remove it).
pub(crate) enum NominationUpdate {
    Keep,
    Set(NominationStatus),
    Clear,
}

pub(super) fn condition_type(type_: ConditionType) -> &'static str {
    match type_ {
        ConditionType::Admitted => conditions::ADMITTED,
        ConditionType::Restarting => conditions::RESTARTING,
        ConditionType::Succeeded => conditions::SUCCEEDED,
        ConditionType::Failed => conditions::FAILED,
    }
}

pub(super) fn event_reason(kind: EventKind) -> &'static str {
    match kind {
        EventKind::Admitted => conditions::EVENT_ADMITTED,
        EventKind::RolledBack => conditions::EVENT_ROLLED_BACK,
        EventKind::ScheduleTimeout => conditions::EVENT_SCHEDULE_TIMEOUT,
        EventKind::SchedulerRefused => conditions::EVENT_SCHEDULER_REFUSED,
        EventKind::Restarting => conditions::EVENT_RESTARTING,
        EventKind::Succeeded => conditions::EVENT_SUCCEEDED,
        EventKind::Failed => conditions::EVENT_FAILED,
        EventKind::Expired => conditions::EVENT_EXPIRED,
    }
}

impl Admission {
    /// Writes a status record of the state machine (against the journal observed), and
    /// keeps the metrics and the cluster model in step with it.
    pub(crate) async fn record(&self, workload: &Workload, record: Record) -> Result<Arc<Workload>, CommitError> {
        // What the record stops holding and releasing is fenced first.
        let claims: Api<ResourceClaim> =
            Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
        self.fence_dropped_claims(workload, record.journal.as_ref(), &claims)
            .await?;
        self.fence_unreleased_pods(workload, record.journal.as_ref()).await?;
        let update = StatusUpdate {
            conditions: record
                .conditions
                .iter()
                .map(|c| ConditionUpdate {
                    type_: condition_type(c.type_),
                    status: c.status,
                    reason: c.reason.as_str().to_string(),
                    message: c.message.clone(),
                })
                .collect(),
            placement: record.journal.as_ref().map(observe::placement),
            restarts: record.restarts,
            // A commit's first record ends the nomination: the plan holds the devices now.
            nomination: if record.journal.as_ref().is_some_and(|j| j.state == State::Reserving) {
                NominationUpdate::Clear
            } else {
                NominationUpdate::Keep
            },
            refusals: record.refusals.as_deref().map(observe::scheduler_refusals),
        };
        let written = self.write_status(workload, update).await?;
        let gang = key(workload);
        if record
            .journal
            .as_ref()
            .is_some_and(|j| j.state == State::TearingDown && j.cause.as_ref().is_some_and(|c| c.0 == Reason::Conflict))
        {
            metrics::get().conflicts.inc();
        }
        for c in &record.conditions {
            match (c.type_, c.status) {
                (ConditionType::Restarting, true) => {
                    metrics::get()
                        .restarts
                        .get_or_create(&ReasonLabel {
                            reason: c.reason.as_str().to_string(),
                        })
                        .inc();
                }
                (ConditionType::Admitted, true) => {
                    self.index.update(|c| c.confirm(&PlanId::Gang(gang.clone())));
                    if workload.status.as_ref().is_none_or(|s| s.restarts == 0)
                        && let Some(created) = &workload.metadata.creation_timestamp
                    {
                        let waited = Timestamp::now().duration_since(created.0).unsigned_abs();
                        metrics::get().observe_submit_to_admitted(workload.spec.priority_class_name.as_deref(), waited);
                    }
                }
                (ConditionType::Admitted, false) if record.journal.is_none() => {
                    self.index.update(|c| c.forget(&PlanId::Gang(gang.clone())));
                    metrics::get()
                        .rollbacks
                        .get_or_create(&ReasonLabel {
                            reason: c.reason.as_str().to_string(),
                        })
                        .inc();
                }
                _ => {}
            }
        }
        Ok(written)
    }

    /// Writes the `Admitted` condition, and `placement` (removed when `None`).
    pub(crate) async fn set_admitted(
        &self,
        workload: &Workload,
        admitted: bool,
        reason: &str,
        message: &str,
        placement: Option<&PlacementStatus>,
    ) -> Result<(), CommitError> {
        let update = StatusUpdate {
            conditions: vec![ConditionUpdate {
                type_: conditions::ADMITTED,
                status: admitted,
                reason: reason.to_string(),
                message: message.to_string(),
            }],
            placement: placement.cloned(),
            restarts: None,
            nomination: NominationUpdate::Keep,
            refusals: None,
        };
        self.write_status(workload, update).await.map(|_| ())
    }

    /// Applies the admission loop's part of the status: every condition it owns and the
    /// restart count, each taken from `update` or kept as it is, and the placement of
    /// `update`. (A server-side apply that left an owned field out would remove it.)
    ///
    /// The write is conditional on the journal `workload` shows: it is made against
    /// that resourceVersion, and when another writer changed the object meanwhile, it is
    /// made again against a fresh read only if the journal there is still the same.
    pub(crate) async fn write_status(
        &self,
        workload: &Workload,
        update: StatusUpdate,
    ) -> Result<Arc<Workload>, CommitError> {
        let api: Api<Workload> = Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
        let expected = placement_of(workload).cloned();
        let mut base = workload.clone();
        for _ in 0..10 {
            self.ensure_leading();
            let current = base.status.clone().unwrap_or_default();
            let mut owned: Vec<Condition> = current
                .conditions
                .iter()
                .filter(|c| ADMISSION_CONDITIONS.contains(&c.type_.as_str()))
                .cloned()
                .collect();
            for condition in &update.conditions {
                crate::workload::status::set_condition(
                    &mut owned,
                    condition.type_,
                    condition.status,
                    &condition.reason,
                    &condition.message,
                    base.metadata.generation,
                    &now(),
                );
            }
            let placement = update.placement.clone();
            let restarts = update.restarts.map_or(current.restarts, |r| r.total);
            let mut status = json!({"conditions": owned, "restarts": restarts});
            // Kept as is unless this write counts a restart: the field is this writer's.
            if let Some(counted) = update
                .restarts
                .map(|r| r.counted)
                .or(current.restarts_count_towards_max)
            {
                status["restartsCountTowardsMax"] = json!(counted);
            }
            if let Some(placement) = placement {
                status["placement"] = serde_json::to_value(placement).unwrap_or_default();
            }
            let nomination = match &update.nomination {
                NominationUpdate::Keep => current.nomination.clone(),
                NominationUpdate::Set(nomination) => Some(nomination.clone()),
                NominationUpdate::Clear => None,
            };
            if let Some(nomination) = nomination {
                status["nomination"] = serde_json::to_value(nomination).unwrap_or_default();
            }
            // Kept as they are unless this write remembers a refusal: the field is this
            // writer's, and an apply that left it out would forget them.
            let refusals = update.refusals.as_ref().unwrap_or(&current.scheduler_refusals);
            if !refusals.is_empty() {
                status["schedulerRefusals"] = serde_json::to_value(refusals).unwrap_or_default();
            }
            let patch = json!({
                "apiVersion": "muster.dev/v1alpha1",
                "kind": "Workload",
                "metadata": {"resourceVersion": base.resource_version()},
                "status": status,
            });
            match api
                .patch_status(
                    &workload.name_any(),
                    &PatchParams::apply(labels::ADMISSION_FIELD_MANAGER).force(),
                    &Patch::Apply(&patch),
                )
                .await
            {
                Ok(written) => {
                    let written = Arc::new(written);
                    self.holders().follow(&written);
                    self.written
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(key(&written), written.clone());
                    return Ok(written);
                }
                // Another writer (the Workload controller, say) changed the object: try
                // again against the newest copy the cache has, if its journal is still
                // the one this write was decided on. (No read: muster may only patch.)
                Err(e) if kube_ops::is_conflict(&e) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let Some(fresh) = self.current_workload(&key(workload)) else {
                        return Err(CommitError::Conflict(format!("{} is gone", key(workload))));
                    };
                    if placement_of(&fresh) != expected.as_ref() {
                        return Err(CommitError::Conflict(format!(
                            "the placement of {} changed meanwhile; looking again",
                            key(workload)
                        )));
                    }
                    base = (*fresh).clone();
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(CommitError::Conflict(format!(
            "the status of {} kept changing; looking again",
            key(workload)
        )))
    }

    /// The Workload as this loop last saw it.
    pub(super) fn current_workload(&self, gang: &ObjectKey) -> Option<Arc<Workload>> {
        self.current_workloads().into_iter().find(|w| key(w) == *gang)
    }

    /// The Workloads as the loop last saw them: the cache, or what its own last write
    /// returned where the cache has not caught up yet (acting on a stale copy could
    /// commit a gang twice).
    pub(crate) fn current_workloads(&self) -> Vec<Arc<Workload>> {
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        let cached = self.workloads.state();
        let live: BTreeSet<ObjectKey> = cached.iter().map(|w| key(w)).collect();
        written.retain(|k, _| live.contains(k));
        cached
            .into_iter()
            .map(|w| {
                let k = key(&w);
                match written.get(&k) {
                    Some(mine) if version(mine.as_ref()) > version(w.as_ref()) => mine.clone(),
                    Some(_) => {
                        written.remove(&k);
                        w
                    }
                    None => w,
                }
            })
            .collect()
    }

    pub(crate) async fn event(&self, workload: &Workload, type_: EventType, reason: &str, action: &str, note: String) {
        crate::workload::controller::publish_event(&self.recorder, workload, type_, reason, action, note).await;
    }
}
