//! The admission loop's status write as one JSON patch. It touches only the fields the
//! loop owns, and it is conditioned on `status.admissionRevision`, the count of the
//! loop's own writes, rather than on the object's resourceVersion: the Workload
//! controller's writes to its fields never make it fail, while a write decided on an
//! older journal (a deposed leader's, or one on a stale copy) does.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use muster_api::v1alpha1::{NominationStatus, PlacementStatus, SchedulerRefusal, Workload, WorkloadStatus};
use serde_json::{Value, json};

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

/// The patch that applies `update` to `base`, the Workload as this loop last saw it
/// (its own last write where the cache lags behind it). `now` stamps conditions whose
/// status changes.
pub(super) fn status_patch(base: &Workload, update: &StatusUpdate, now: &Time) -> Value {
    let mut ops = Vec::new();
    if let Some(uid) = &base.metadata.uid {
        ops.push(json!({"op": "test", "path": "/metadata/uid", "value": uid}));
    }
    let Some(current) = base.status.as_ref() else {
        // No status yet: the whole of the loop's part, on condition that none appeared.
        let mut status = WorkloadStatus {
            admission_revision: Some(1),
            ..WorkloadStatus::default()
        };
        for condition in &update.conditions {
            set(&mut status.conditions, condition, base.metadata.generation, now);
        }
        apply_fields(&mut status, update);
        ops.push(json!({"op": "test", "path": "/status", "value": null}));
        ops.push(json!({"op": "add", "path": "/status", "value": status}));
        return Value::Array(ops);
    };
    ops.push(json!({"op": "test", "path": "/status/admissionRevision", "value": current.admission_revision}));
    if current.admission_revision.is_none() {
        // Never counted yet (a new gang, or one a version before the count last wrote):
        // the journal must still be as seen. A new gang's is absent; an older one's is
        // held to the version seen, for this one write.
        match (&current.placement, &base.metadata.resource_version) {
            (None, _) => ops.push(json!({"op": "test", "path": "/status/placement", "value": null})),
            (Some(_), Some(version)) => {
                ops.push(json!({"op": "test", "path": "/metadata/resourceVersion", "value": version}));
            }
            (Some(_), None) => {}
        }
    }
    ops.push(json!({
        "op": "add",
        "path": "/status/admissionRevision",
        "value": current.admission_revision.unwrap_or(0) + 1,
    }));
    conditions(&mut ops, current, update, base.metadata.generation, now);
    if let Some(restarts) = update.restarts {
        ops.push(json!({"op": "add", "path": "/status/restarts", "value": restarts.total}));
        ops.push(json!({"op": "add", "path": "/status/restartsCountTowardsMax", "value": restarts.counted}));
    }
    match &update.placement {
        Some(placement) => ops.push(json!({"op": "add", "path": "/status/placement", "value": placement})),
        None if current.placement.is_some() => ops.push(json!({"op": "remove", "path": "/status/placement"})),
        None => {}
    }
    match &update.nomination {
        NominationUpdate::Keep => {}
        NominationUpdate::Set(nomination) => {
            ops.push(json!({"op": "add", "path": "/status/nomination", "value": nomination}));
        }
        NominationUpdate::Clear if current.nomination.is_some() => {
            ops.push(json!({"op": "remove", "path": "/status/nomination"}));
        }
        NominationUpdate::Clear => {}
    }
    match &update.refusals {
        Some(refusals) if !refusals.is_empty() => {
            ops.push(json!({"op": "add", "path": "/status/schedulerRefusals", "value": refusals}));
        }
        Some(_) if !current.scheduler_refusals.is_empty() => {
            ops.push(json!({"op": "remove", "path": "/status/schedulerRefusals"}));
        }
        Some(_) | None => {}
    }
    Value::Array(ops)
}

/// The loop's conditions, each changed in place where it is (its index tested to still
/// hold it: the Workload controller's conditions share the list) or appended.
fn conditions(
    ops: &mut Vec<Value>,
    current: &WorkloadStatus,
    update: &StatusUpdate,
    generation: Option<i64>,
    now: &Time,
) {
    if current.conditions.is_empty() {
        let mut list = Vec::new();
        for condition in &update.conditions {
            set(&mut list, condition, generation, now);
        }
        if !list.is_empty() {
            ops.push(json!({"op": "add", "path": "/status/conditions", "value": list}));
        }
        return;
    }
    let mut appended: Vec<Condition> = Vec::new();
    for condition in &update.conditions {
        match current.conditions.iter().position(|c| c.type_ == condition.type_) {
            Some(index) => {
                let mut one = vec![current.conditions[index].clone()];
                set(&mut one, condition, generation, now);
                let path = format!("/status/conditions/{index}");
                ops.push(json!({"op": "test", "path": format!("{path}/type"), "value": condition.type_}));
                ops.push(json!({"op": "replace", "path": path, "value": one[0]}));
            }
            None => set(&mut appended, condition, generation, now),
        }
    }
    for condition in appended {
        ops.push(json!({"op": "add", "path": "/status/conditions/-", "value": condition}));
    }
}

fn set(list: &mut Vec<Condition>, condition: &ConditionUpdate, generation: Option<i64>, now: &Time) {
    crate::workload::status::set_condition(
        list,
        condition.type_,
        condition.status,
        &condition.reason,
        &condition.message,
        generation,
        now,
    );
}

/// The fields other than conditions, on a status made afresh.
fn apply_fields(status: &mut WorkloadStatus, update: &StatusUpdate) {
    if let Some(restarts) = update.restarts {
        status.restarts = restarts.total;
        status.restarts_count_towards_max = Some(restarts.counted);
    }
    status.placement = update.placement.clone();
    if let NominationUpdate::Set(nomination) = &update.nomination {
        status.nomination = Some(nomination.clone());
    }
    if let Some(refusals) = &update.refusals {
        status.scheduler_refusals = refusals.clone();
    }
}

#[cfg(test)]
mod tests {
    use super::ConditionUpdate;
    use super::*;
    use k8s_openapi::jiff::Timestamp;
    use muster_api::conditions;
    use muster_api::v1alpha1::{NominationStatus, PlacementStatus};

    fn workload(status: Value) -> Workload {
        serde_json::from_value(json!({
            "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
            "metadata": {"name": "w", "namespace": "ns", "uid": "u-1", "resourceVersion": "41", "generation": 2},
            "spec": {"podGroups": [{"name": "workers", "replicas": 1}]},
            "status": status,
        }))
        .expect("workload")
    }

    fn admitted(status: bool) -> StatusUpdate {
        StatusUpdate {
            conditions: vec![ConditionUpdate {
                type_: conditions::ADMITTED,
                status,
                reason: "Reserving".into(),
                message: "reserving".into(),
            }],
            placement: Some(PlacementStatus::default()),
            restarts: None,
            nomination: NominationUpdate::Clear,
            refusals: None,
        }
    }

    fn now() -> Time {
        Time(Timestamp::from_second(1_800_000_000).expect("time"))
    }

    /// Applies `patch` as kube-apiserver does. Its JSON patch library passes a `test`
    /// of `null` on a missing member, which this crate's does not: such tests are
    /// checked here and left out.
    fn apply(base: &Workload, patch: &Value) -> Result<Value, String> {
        let mut doc = serde_json::to_value(base).expect("json");
        let mut ops = Vec::new();
        for op in patch.as_array().expect("a list") {
            let path = op["path"].as_str().expect("path");
            if op["op"] == "test" && op["value"].is_null() {
                if doc.pointer(path).is_some_and(|v| !v.is_null()) {
                    return Err(format!("{path} is not null"));
                }
                continue;
            }
            ops.push(op.clone());
        }
        let patch: json_patch::Patch = serde_json::from_value(Value::Array(ops)).expect("patch");
        json_patch::patch(&mut doc, &patch).map_err(|e| e.to_string())?;
        Ok(doc)
    }

    #[test]
    fn a_write_is_conditioned_on_the_loops_own_count_never_on_the_resource_version() {
        let base = workload(json!({
            "conditions": [
                {"type": "Created", "status": "True", "reason": "AllCreated", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ],
            "admissionRevision": 4,
        }));
        let patch = status_patch(&base, &admitted(false), &now());
        assert!(!patch.to_string().contains("resourceVersion"), "{patch}");
        // The Workload controller wrote meanwhile: its conditions and counts changed,
        // and with them the resourceVersion. The write still applies.
        let mut theirs = base.clone();
        theirs.metadata.resource_version = Some("57".into());
        let status = theirs.status.as_mut().expect("status");
        status.ready_pods = 3;
        status.conditions.push(Condition {
            type_: "PodsReady".into(),
            status: "True".into(),
            reason: "AllReady".into(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: now(),
        });
        let written = apply(&theirs, &patch).expect("applies over the controller's write");
        assert_eq!(written["status"]["admissionRevision"], 5);
        assert_eq!(written["status"]["readyPods"], 3, "the controller's fields are kept");
        let types: Vec<&str> = written["status"]["conditions"]
            .as_array()
            .expect("conditions")
            .iter()
            .map(|c| c["type"].as_str().expect("type"))
            .collect();
        assert_eq!(types, ["Created", "PodsReady", "Admitted"]);
        // Another write of the loop's landed first (a deposed leader's, or this one's
        // own on a stale copy): the write fails.
        let mut ours = theirs.clone();
        ours.status.as_mut().expect("status").admission_revision = Some(5);
        assert!(apply(&ours, &patch).is_err(), "a newer journal is never overwritten");
    }

    #[test]
    fn an_owned_condition_is_changed_where_it_is_and_only_if_it_is_still_there() {
        let base = workload(json!({
            "conditions": [
                {"type": "Created", "status": "True", "reason": "AllCreated", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "Admitted", "status": "False", "reason": "Queued", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ],
            "placement": {},
            "nomination": {"victims": ["ns/low"]},
        }));
        let patch = status_patch(&base, &admitted(false), &now());
        let written = apply(&base, &patch).expect("applies");
        let admitted = &written["status"]["conditions"][1];
        assert_eq!(admitted["reason"], "Reserving");
        assert_eq!(
            admitted["lastTransitionTime"], "2026-01-01T00:00:00Z",
            "the status did not change"
        );
        assert_eq!(
            written["status"]["admissionRevision"], 1,
            "a Workload written before the count"
        );
        // Written before the count, it is held to the version seen for that one write.
        let mut moved = base.clone();
        moved.metadata.resource_version = Some("42".into());
        assert!(
            apply(&moved, &patch).is_err(),
            "an uncounted journal is never overwritten"
        );
        assert!(written["status"].get("nomination").is_none(), "cleared");
        // Had the list been reordered meanwhile, the write would not land on another
        // writer's condition.
        let mut moved = base.clone();
        moved.status.as_mut().expect("status").conditions.swap(0, 1);
        assert!(apply(&moved, &patch).is_err());
    }

    #[test]
    fn fields_are_removed_only_where_the_loop_left_them() {
        let placed = workload(json!({"placement": {}, "schedulerRefusals": [
            {"pod": "p", "node": "n", "at": "2026-01-01T00:00:00Z"},
        ], "admissionRevision": 2}));
        let update = StatusUpdate {
            conditions: Vec::new(),
            placement: None,
            restarts: Some(muster_admission::Restarts { total: 2, counted: 1 }),
            nomination: NominationUpdate::Set(NominationStatus::default()),
            refusals: Some(Vec::new()),
        };
        let written = apply(&placed, &status_patch(&placed, &update, &now())).expect("applies");
        let status = &written["status"];
        assert!(status.get("placement").is_none() && status.get("schedulerRefusals").is_none());
        assert_eq!(
            (status["restarts"].clone(), status["restartsCountTowardsMax"].clone()),
            (json!(2), json!(1))
        );
        assert!(status.get("nomination").is_some());
        // Nothing to remove: no remove operation, which would fail on a missing field.
        let queued = workload(json!({"admissionRevision": 2}));
        let patch = status_patch(&queued, &update, &now());
        assert!(apply(&queued, &patch).is_ok(), "{patch}");
    }

    #[test]
    fn a_workload_without_status_gets_the_loops_part_only_if_none_appeared() {
        let mut base = workload(Value::Null);
        base.status = None;
        let patch = status_patch(&base, &admitted(true), &now());
        let written = apply(&base, &patch).expect("applies");
        assert_eq!(written["status"]["admissionRevision"], 1);
        assert_eq!(written["status"]["conditions"][0]["type"], "Admitted");
        let mut raced = base.clone();
        raced.status = Some(WorkloadStatus::default());
        assert!(
            apply(&raced, &patch).is_err(),
            "the controller's first status is not overwritten"
        );
    }
}
