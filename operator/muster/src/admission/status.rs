//! The admission loop's part of a Workload's status: the conditions it owns, the restart
//! count and the journal (`status.placement`), written against the version observed;
//! and its events.

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::EventType;
use muster_admission::{ConditionType, EventKind, Reason, Record, State};
use muster_api::v1alpha1::{PlacementStatus, Workload};
use muster_api::{conditions, labels};
use muster_engine::cluster::PlanId;
use muster_engine::key::ObjectKey;

use crate::kube_ops;
use crate::ops::metrics::{self, ReasonLabel};
use crate::workload::observe::{self};

use super::status_patch::status_patch;
pub(crate) use super::status_patch::{ConditionUpdate, NominationUpdate, StatusUpdate};
use super::{Admission, CommitError, key, now, version};

pub(super) fn condition_type(type_: ConditionType) -> &'static str {
    match type_ {
        ConditionType::Admitted => conditions::ADMITTED,
        ConditionType::Restarting => conditions::RESTARTING,
        ConditionType::Succeeded => conditions::SUCCEEDED,
        ConditionType::Failed => conditions::FAILED,
    }
}

/// Why the admission loop writes no status: the installed Workload CRD is older than
/// this operator.
const OUTDATED_SCHEMA: &str = "the Workload CRD drops status.admissionRevision: install the CRD of this muster version \
(muster crd | kubectl apply --server-side -f -) and restart the operator; admission writes nothing until then";

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
        // What the record stops holding and releasing is fenced first: the pods before
        // the claims, so that a pod taken out of a claim as gated cannot be one a deposed
        // leader's release let go meanwhile.
        let claims: Api<ResourceClaim> =
            Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
        self.fence_unreleased_pods(workload, record.journal.as_ref()).await?;
        self.fence_dropped_claims(workload, record.journal.as_ref(), &claims)
            .await?;
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
            // The nomination ends once the commit's reservation is whole and checked (the
            // gang released, or recorded reserved for Kueue, or past that already: taken
            // apart or suspended since): a commit that fails before keeps it, so that the
            // devices its victims gave back stay held for it.
            nomination: if record.journal.as_ref().is_some_and(|j| j.state != State::Reserving) {
                NominationUpdate::Clear
            } else {
                NominationUpdate::Keep
            },
            refusals: record.refusals.as_deref().map(observe::scheduler_refusals),
        };
        let written = self.write_status(workload, update).await?;
        let gang = key(workload);
        // The claims it starts or stops naming: the other gangs holding them look again
        // (whether another gang holds a claim decides what they may do with it).
        let named = |journal: Option<&muster_admission::Journal>| -> BTreeSet<String> {
            journal.into_iter().flat_map(|j| j.claims.iter().cloned()).collect()
        };
        let before = named(observe::journal(workload).as_ref());
        let after = named(record.journal.as_ref());
        for claim in before.symmetric_difference(&after) {
            self.index.touched.claim(gang.namespace(), claim);
        }
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

    /// Whether the loop stopped writing status because the Workload CRD drops
    /// `status.admissionRevision` (see [`Self::write_status`]).
    pub(crate) fn schema_is_outdated(&self) -> bool {
        self.schema_outdated.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Writes the admission loop's part of the status: the conditions in `update` (the
    /// others are kept), the placement of `update` (`None` removes it), and the other
    /// fields `update` sets. One JSON patch (see [`status_patch`]), conditioned on the
    /// loop's own write count, not on the resourceVersion: the Workload controller's
    /// writes never make it fail, and no write of the loop is made over one it has not
    /// seen.
    ///
    /// A test that fails because the controller's conditions moved is tried again at
    /// once on the newest copy, if the loop's own part there is still the one this write
    /// was decided on.
    pub(crate) async fn write_status(
        &self,
        workload: &Workload,
        update: StatusUpdate,
    ) -> Result<Arc<Workload>, CommitError> {
        let api: Api<Workload> = Api::namespaced(self.client.clone(), &workload.namespace().unwrap_or_default());
        let revision = |w: &Workload| w.status.as_ref().and_then(|s| s.admission_revision);
        if self.schema_outdated.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(CommitError::Conflict(OUTDATED_SCHEMA.into()));
        }
        let mut base = Arc::new(workload.clone());
        for _ in 0..3 {
            let patch: json_patch::Patch =
                serde_json::from_value(status_patch(&base, &update, &now())).map_err(kube::Error::SerdeError)?;
            self.ensure_leading();
            match api
                .patch_status(
                    &workload.name_any(),
                    &PatchParams {
                        field_manager: Some(labels::ADMISSION_FIELD_MANAGER.into()),
                        ..PatchParams::default()
                    },
                    &Patch::Json::<()>(patch),
                )
                .await
            {
                Ok(written) => {
                    let expected = revision(&base).unwrap_or(0) + 1;
                    if revision(&written) != Some(expected) {
                        // The API server dropped the count: its Workload CRD is older
                        // than this operator, and no write of the loop is guarded. The
                        // loop writes no status again until the CRD is upgraded (and the
                        // process restarted): a write it cannot fence could be made over
                        // a newer one, and one taken for failed is made again and again.
                        self.schema_outdated.store(true, std::sync::atomic::Ordering::SeqCst);
                        tracing::error!(workload = %key(workload), "{OUTDATED_SCHEMA}");
                        return Err(CommitError::Conflict(OUTDATED_SCHEMA.into()));
                    }
                    let written = Arc::new(written);
                    self.holders().follow(&written);
                    self.written
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(key(&written), written.clone());
                    return Ok(written);
                }
                Err(e) if kube_ops::is_test_failed(&e) => {
                    // Read, not the cache: one behind the write that moved the conditions
                    // would fail this write, which may be a commit's last before it
                    // releases the gang.
                    self.ensure_leading();
                    let Some(fresh) = api.get_opt(&workload.name_any()).await?.map(Arc::new) else {
                        return Err(CommitError::Conflict(format!("{} is gone", key(workload))));
                    };
                    if revision(&fresh) != revision(workload)
                        || fresh.metadata.uid != workload.metadata.uid
                        || fresh.metadata.resource_version == base.metadata.resource_version
                    {
                        return Err(CommitError::Conflict(format!(
                            "the admission status of {} changed meanwhile; looking again",
                            key(workload)
                        )));
                    }
                    base = fresh;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(CommitError::Conflict(format!(
            "the conditions of {} kept moving; looking again",
            key(workload)
        )))
    }

    /// `workload`, or this loop's own newer write of it.
    pub(super) fn newest(&self, workload: &Arc<Workload>) -> Arc<Workload> {
        let written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        match written.get(&key(workload)) {
            Some(mine)
                if mine.metadata.uid == workload.metadata.uid
                    && version(mine.as_ref()) > version(workload.as_ref()) =>
            {
                mine.clone()
            }
            _ => workload.clone(),
        }
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

    /// Publishes an event off the caller's path: no step of a gang waits for its events.
    pub(crate) fn event(&self, workload: &Workload, type_: EventType, reason: &str, action: &str, note: String) {
        let recorder = self.recorder.clone();
        let workload = workload.clone();
        let reason = reason.to_string();
        let action = action.to_string();
        tokio::spawn(async move {
            crate::workload::controller::publish_event(&recorder, &workload, type_, &reason, &action, note).await;
        });
    }
}
