//! What muster tells Kueue about the gangs that queue there, as Kueue's own job
//! controllers do: `PodsReady` while a gang runs, `Finished` when it ends (then the
//! quota's finalizer goes), and, after an eviction, the admission cleared once the gang
//! holds nothing, so that the quota passes to whoever Kueue chose.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kube::ResourceExt;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use muster_api::v1alpha1::AdmissionState as State;
use muster_api::v1alpha1::{PlacementStatus, Workload};
use muster_api::{conditions, labels};
use tracing::{debug, info, warn};

use crate::admission::{Admission, CommitError, key, placement_of};
use crate::kube_ops;
use crate::kueue::{self, Verdict};
use crate::workload::observe;

/// What muster knows of a gang's Kueue Workload.
pub(crate) enum KueueObject {
    /// The gang does not queue in Kueue (no queue label, or the cluster has no Kueue).
    NotQueued,
    /// It queues there, but the cache does not show its Kueue Workload yet.
    NotSeen,
    Seen(Arc<DynamicObject>),
}

impl KueueObject {
    pub(crate) fn is_not_queued(&self) -> bool {
        matches!(self, KueueObject::NotQueued)
    }

    fn seen(self) -> Option<Arc<DynamicObject>> {
        match self {
            KueueObject::Seen(object) => Some(object),
            KueueObject::NotQueued | KueueObject::NotSeen => None,
        }
    }
}

impl Admission {
    /// The Kueue Workload of a gang.
    pub(crate) fn kueue_object(&self, workload: &Workload) -> KueueObject {
        if self.stores.kueue.is_none() || kueue::queue_of(workload).is_none() {
            return KueueObject::NotQueued;
        }
        match self.stores.kueue_workload(workload) {
            Some(object) => KueueObject::Seen(object),
            None => KueueObject::NotSeen,
        }
    }

    /// The AdmissionChecks muster answers (`spec.controllerName` is muster's).
    pub(crate) fn our_checks(&self) -> BTreeSet<String> {
        self.stores
            .kueue_checks
            .iter()
            .flat_map(|s| s.state())
            .filter(|c| c.data["spec"]["controllerName"] == kueue::CHECK_CONTROLLER)
            .map(|c| c.name_any())
            .collect()
    }

    /// Whether Kueue holds this gang back: it queues there, and Kueue has neither
    /// admitted it nor reserved quota and asked muster to reserve its devices (or it
    /// was evicted). A gang whose Kueue Workload is not cached yet waits too.
    pub(crate) fn held_by_kueue(&self, workload: &Workload) -> bool {
        match self.kueue_object(workload) {
            KueueObject::NotQueued => false,
            KueueObject::NotSeen => true,
            KueueObject::Seen(object) => Verdict::of(&object).must_stop(&self.our_checks()),
        }
    }

    /// Whether Kueue takes a placed gang back: evicted, or its admission gone. Only what
    /// Kueue wrote counts: a Kueue Workload the cache does not show stops nothing.
    pub(crate) fn evicted_by_kueue(&self, workload: &Workload) -> bool {
        matches!(self.kueue_object(workload), KueueObject::Seen(object) if Verdict::of(&object).must_stop(&self.our_checks()))
    }

    /// Whether the pods of a reserved gang must wait for Kueue: its devices are
    /// reserved, but Kueue has not admitted it yet (muster's check still to be seen).
    pub(crate) fn release_held_by_kueue(&self, workload: &Workload) -> bool {
        match self.kueue_object(workload) {
            KueueObject::NotQueued => false,
            KueueObject::NotSeen => true,
            KueueObject::Seen(object) => {
                let verdict = Verdict::of(&object);
                !verdict.admitted || verdict.must_stop(&self.our_checks())
            }
        }
    }

    /// Every node's name and labels.
    fn node_labels(cluster: &muster_engine::cluster::ClusterState) -> Vec<(&str, &BTreeMap<String, String>)> {
        cluster.nodes().map(|n| (n.name.as_str(), &n.labels)).collect()
    }

    /// Each ResourceFlavor's `spec.nodeLabels`, by flavor.
    fn flavor_labels(&self) -> BTreeMap<String, BTreeMap<String, String>> {
        kueue::flavor_node_labels(
            self.stores
                .kueue_flavors
                .iter()
                .flat_map(|s| s.state())
                .map(|f| (*f).clone()),
        )
    }

    /// Puts each group inside what Kueue assigned to its own podSet
    /// ([`kueue::apply_assignment`]).
    pub(crate) fn apply_kueue_assignment(
        &self,
        workload: &Workload,
        request: &mut muster_engine::request::GangRequest,
    ) {
        let Some(object) = self.kueue_object(workload).seen() else {
            return;
        };
        let cluster = self.index.snapshot();
        kueue::apply_assignment(
            request,
            workload,
            &object,
            &self.flavor_labels(),
            &Self::node_labels(&cluster),
        );
    }

    /// The first planned pod of the gang on a node outside Kueue's current decision for
    /// it (its group's flavors, the assigned topology domains), in words.
    ///
    /// `Err(())`: not known now — the gang's request cannot be built this pass (a claim
    /// the cache has not caught up with, a member being replaced), so the domains its
    /// plan was held to are not known either; judging it by others would answer Retry
    /// for a placement made inside them.
    fn placed_outside_kueue(&self, workload: &Workload, placement: &PlacementStatus) -> Result<Option<String>, ()> {
        let Some(object) = self.kueue_object(workload).seen() else {
            return Ok(None);
        };
        let assignments = kueue::assignments(&object);
        if assignments.is_empty() {
            return Ok(None);
        }
        let cluster = self.index.snapshot();
        // Held as plans hold it: the domains each group's request carries.
        let assigned: BTreeMap<String, Vec<muster_engine::request::AssignedDomain>> = match self.request(workload) {
            Ok(request) => request
                .groups
                .into_iter()
                .map(|g| (g.name, g.assigned))
                .filter(|(_, d)| !d.is_empty())
                .collect(),
            Err(_) => return Err(()),
        };
        let selectors = kueue::flavor_selectors(&assignments, &self.flavor_labels());
        let groups: BTreeMap<String, String> = self
            .gang_pods(workload)
            .iter()
            .filter_map(|p| Some((p.name_any(), p.labels().get(labels::POD_GROUP)?.clone())))
            .collect();
        let pods = placement.pods.iter().map(|p| {
            (
                p.name.as_str(),
                p.node.as_str(),
                groups.get(&p.name).map(String::as_str),
            )
        });
        Ok(kueue::placed_outside(
            pods,
            |node| cluster.node(node).map(|n| &n.labels),
            &assigned,
            &selectors,
        ))
    }

    /// Whether Kueue put the gang's podSets in different domains of the level it
    /// requires one of ([`kueue::split_by_kueue`]).
    pub(crate) fn kueue_split(&self, workload: &Workload) -> bool {
        let Some(object) = self.kueue_object(workload).seen() else {
            return false;
        };
        let cluster = self.index.snapshot();
        kueue::split_by_kueue(workload, &object, &Self::node_labels(&cluster))
    }

    /// How long Kueue has held quota for the gang waiting for muster's answer: since its
    /// check last changed state, while Kueue awaits the reservation. `None`: Kueue does
    /// not wait on muster now.
    pub(crate) fn kueue_waiting_for(&self, workload: &Workload) -> Option<std::time::Duration> {
        let KueueObject::Seen(object) = self.kueue_object(workload) else {
            return None;
        };
        let ours = self.our_checks();
        let verdict = Verdict::of(&object);
        if !verdict.awaits_reservation(&ours) {
            return None;
        }
        let (check, _) = verdict.our_check(&ours)?;
        // Kueue sets the check Pending before it reserves (and again after an eviction,
        // before the requeue): the wait on muster starts at the later of the two.
        let check_since: k8s_openapi::jiff::Timestamp = kueue::check_changed_at(&object, check)?.parse().ok()?;
        let reserved_since: k8s_openapi::jiff::Timestamp = kueue::quota_reserved_at(&object)?.parse().ok()?;
        let since = check_since.max(reserved_since);
        let waited = k8s_openapi::jiff::Timestamp::now().duration_since(since);
        std::time::Duration::try_from(waited).ok()
    }

    /// Kueue's requeue delay for a gang that would not fit even on the emptied cluster as
    /// it is now: `base` backed off by the retries Kueue counted on muster's check.
    pub(crate) fn never_fit_retry_after(&self, workload: &Workload, base: i64) -> i64 {
        let KueueObject::Seen(object) = self.kueue_object(workload) else {
            return base;
        };
        let verdict = Verdict::of(&object);
        match verdict.our_check(&self.our_checks()) {
            Some((check, _)) => kueue::never_fit_backoff(&object, check, base),
            None => base,
        }
    }

    /// Answers muster's admission check on the gang's Kueue Workload, if it has one.
    pub(crate) async fn answer_check(
        &self,
        workload: &Workload,
        state: &str,
        message: &str,
        requeue_after_seconds: Option<i64>,
    ) -> Result<(), CommitError> {
        let KueueObject::Seen(object) = self.kueue_object(workload) else {
            return Ok(());
        };
        let ours = self.our_checks();
        let verdict = Verdict::of(&object);
        let Some((check, _)) = verdict.our_check(&ours) else {
            return Ok(());
        };
        let Some(patch) = kueue::check_patch(
            &object,
            check,
            state,
            message,
            requeue_after_seconds,
            &observe::now_rfc3339(),
        ) else {
            return Ok(());
        };
        let api = self.kueue_api(&object);
        self.ensure_leading();
        api.patch_status(&object.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        if state == "Retry" {
            self.answered_retry
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(key(workload));
        }
        info!(workload = %key(workload), check, state, %message, "answered Kueue's admission check");
        Ok(())
    }

    /// Keeps every AdmissionCheck muster answers Active, as Kueue requires.
    async fn keep_checks_active(&self) {
        let Some(store) = &self.stores.kueue_checks else { return };
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &kueue::admission_check_resource());
        for check in store
            .state()
            .into_iter()
            .filter(|c| c.data["spec"]["controllerName"] == kueue::CHECK_CONTROLLER)
        {
            let Some(patch) = kueue::active_patch(&check, &observe::now_rfc3339()) else {
                continue;
            };
            self.ensure_leading();
            if let Err(e) = api
                .patch_status(&check.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                warn!(check = %check.name_any(), error = %e, "marking the AdmissionCheck active failed; retrying");
            }
        }
    }

    /// Brings every Kueue Workload of muster's in line with its gang, as the gang stands
    /// now (after this pass's steps, with this loop's own writes).
    pub(crate) async fn sync_kueue(&self) {
        let Some(store) = self.stores.kueue.clone() else { return };
        let workloads = self.current_workloads();
        self.keep_checks_active().await;
        for workload in workloads.iter().filter(|w| w.metadata.deletion_timestamp.is_none()) {
            let KueueObject::Seen(object) = self.kueue_object(workload) else {
                continue;
            };
            if let Err(e) = self.sync_one(workload, &object).await {
                warn!(workload = %key(workload), error = %e, "updating the Kueue Workload failed; retrying");
            }
        }
        // A gang deleted, or no longer queueing in Kueue, lets go of the quota once it
        // holds nothing; a Kueue Workload of a gang that stopped queueing goes.
        let api_for = |namespace: &str| -> Api<DynamicObject> {
            Api::namespaced_with(self.client.clone(), namespace, &kueue::api_resource())
        };
        for object in store.state() {
            let namespace = object.namespace().unwrap_or_default();
            let owner = workloads
                .iter()
                .find(|w| w.namespace().as_deref() == Some(namespace.as_str()) && kueue::made_for(&object, w));
            let live = owner.is_some_and(|w| w.metadata.deletion_timestamp.is_none() && kueue::queue_of(w).is_some());
            let holds = owner.is_some_and(|w| placement_of(w).and_then(|p| p.state).is_some());
            if live || holds {
                continue;
            }
            if let Err(e) = self.release_quota_finalizer(&object).await {
                warn!(object = %object.name_any(), error = %e, "removing Kueue's finalizer failed; retrying");
                continue;
            }
            if owner.is_some_and(|w| w.metadata.deletion_timestamp.is_none())
                && object.metadata.deletion_timestamp.is_none()
            {
                self.ensure_leading();
                match api_for(&namespace)
                    .delete(&object.name_any(), &Default::default())
                    .await
                {
                    Ok(_) => {
                        info!(object = %object.name_any(), "the gang no longer queues in Kueue; deleted its Kueue Workload")
                    }
                    Err(e) if kube_ops::is_not_found(&e) => {}
                    Err(e) => {
                        warn!(object = %object.name_any(), error = %e, "deleting the Kueue Workload failed; retrying")
                    }
                }
            }
        }
    }

    async fn sync_one(&self, workload: &Workload, object: &DynamicObject) -> Result<(), CommitError> {
        let verdict = Verdict::of(object);
        let api = self.kueue_api(object);
        let now = observe::now_rfc3339();
        let journal = placement_of(workload).and_then(|p| p.state);
        let params = PatchParams::default();

        // Ended: once its devices are free, Kueue is told (and gives the quota back),
        // then the finalizer goes.
        if observe::finished(workload) {
            if !journal.is_none_or(|s| s == State::Finished) {
                return Ok(());
            }
            if !verdict.finished {
                let succeeded = observe::condition(workload, conditions::SUCCEEDED).is_some_and(|c| c.status == "True");
                let message = if succeeded {
                    "the gang succeeded"
                } else {
                    "the gang failed"
                };
                if let Some(patch) = kueue::finished_patch(object, succeeded, message, &now) {
                    self.ensure_leading();
                    api.patch_status(&object.name_any(), &params, &Patch::Merge(&patch))
                        .await?;
                    info!(workload = %key(workload), succeeded, "told Kueue the gang finished");
                }
            } else {
                self.release_quota_finalizer(object).await?;
            }
            return Ok(());
        }

        // Evicted: once the gang holds nothing, the admission goes back to Kueue.
        if let Some(reason) = &verdict.evicted {
            if verdict.holds_quota && journal.is_none() {
                self.ensure_leading();
                let patch = kueue::requeue_patch(object, reason, &now);
                api.patch_status(&object.name_any(), &params, &Patch::Merge(&patch))
                    .await?;
                info!(workload = %key(workload), %reason, "gave the gang's admission back to Kueue");
                crate::ops::metrics::get().count_preemption(reason);
                self.event(
                    workload,
                    kube::runtime::events::EventType::Normal,
                    conditions::REASON_WAITING_FOR_KUEUE,
                    "Evict",
                    format!("Kueue evicted the gang ({reason}); it holds nothing and queues again"),
                );
            }
            return self.say_waiting(workload, &verdict).await;
        }
        if !verdict.admitted && !verdict.awaits_reservation(&self.our_checks()) {
            return self.say_waiting(workload, &verdict).await;
        }
        // Kueue holds the quota while the gang's request waits for an object to appear
        // (a Job short of pods, a claim never made): once that outlasts the grace, the
        // quota goes back for a while, backing off, rather than be held for ever.
        if journal.is_none()
            && !verdict.admitted
            && self
                .kueue_waiting_for(workload)
                .is_some_and(|waited| waited >= super::queue::KUEUE_WAIT_GRACE)
            && let Err(e) = self.request(workload)
            && e.may_never_come()
        {
            let base = super::queue::KUEUE_RETRY_NEVER_FIT_SECONDS;
            let retry_after = self.never_fit_retry_after(workload, base);
            return self
                .answer_check(workload, "Retry", &e.to_string(), Some(retry_after))
                .await;
        }

        // Every claim reserved: muster's check is ready, and Kueue admits the gang; but
        // only for a placement inside Kueue's current decision. A gang placed before this
        // Kueue Workload asked (its label added, or the old one recreated) may lie outside
        // the flavors or domains Kueue charges now: Retry makes Kueue evict it, and muster
        // places it again inside them. Judged only while the check is not Ready yet: once
        // Ready, a node label that flaps or a flavor edited later never evicts a running
        // gang (Kueue itself never judges a placement again after admission).
        let deciding = verdict
            .our_check(&self.our_checks())
            .is_some_and(|(_, state)| state != "Ready");
        if deciding
            && matches!(journal, Some(State::Reserved | State::Released))
            && let Some(placement) = placement_of(workload)
        {
            match self.placed_outside_kueue(workload, placement) {
                Ok(Some(outside)) => {
                    return self
                        .answer_check(workload, "Retry", &outside, Some(super::queue::KUEUE_RETRY_SECONDS))
                        .await;
                }
                Ok(None) => {}
                // Judged on a later pass, once known.
                Err(()) => return Ok(()),
            }
        }
        // A claim another allocator made that kube-controller-manager deallocated behind
        // the caches holds the answer back: the gang's next step sees it.
        if deciding
            && matches!(journal, Some(State::Reserved | State::Released))
            && !self.found_claims_still_allocated(workload).await?
        {
            return Ok(());
        }
        if matches!(journal, Some(State::Reserved | State::Released))
            && let Some(placement) = placement_of(workload)
        {
            let message = format!(
                "every claim is reserved: {} devices on {} nodes",
                placement.devices,
                placement.nodes.len()
            );
            self.answer_check(workload, "Ready", &message, None).await?;
        }
        if !verdict.admitted {
            return Ok(());
        }

        // Admitted: Kueue's waitForPodsReady wants to hear when the gang runs, and when it
        // stops running (a restart, a gang placed again from the queue), whatever the
        // admission state: a True left standing would keep Kueue from ever evicting a
        // restarted gang that no longer fits.
        let min_counts: BTreeMap<String, i32> = workload
            .spec
            .pod_groups
            .iter()
            .map(|g| (g.name.clone(), g.min_count()))
            .collect();
        let ready = journal == Some(State::Released) && kueue::gang_ready(&self.gang_pods(workload), &min_counts);
        if let Some(patch) = kueue::pods_ready_patch(object, ready, &now) {
            self.ensure_leading();
            api.patch_status(&object.name_any(), &params, &Patch::Merge(&patch))
                .await?;
        }
        Ok(())
    }

    /// A queued gang that Kueue has not admitted says so.
    async fn say_waiting(&self, workload: &Workload, verdict: &Verdict) -> Result<(), CommitError> {
        if placement_of(workload).and_then(|p| p.state).is_some() {
            return Ok(());
        }
        let queue = kueue::queue_of(workload).unwrap_or_default();
        let message = match &verdict.evicted {
            Some(reason) => {
                format!("Kueue evicted the gang ({reason}); it waits in LocalQueue {queue} to be admitted again")
            }
            None => format!("waiting for Kueue to admit it from LocalQueue {queue}"),
        };
        let current =
            observe::condition(workload, conditions::ADMITTED).map(|c| (c.reason.as_str(), c.message.as_str()));
        if current != Some((conditions::REASON_WAITING_FOR_KUEUE, message.as_str())) {
            self.set_admitted(workload, false, conditions::REASON_WAITING_FOR_KUEUE, &message, None)
                .await?;
        }
        Ok(())
    }

    /// The API of `object`'s Kueue Workloads.
    fn kueue_api(&self, object: &DynamicObject) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.client.clone(),
            &object.namespace().unwrap_or_default(),
            &kueue::api_resource(),
        )
    }

    /// Removes Kueue's quota finalizer from `object`, guarded by a test of its place in
    /// the list.
    async fn release_quota_finalizer(&self, object: &DynamicObject) -> Result<(), CommitError> {
        if !object.finalizers().iter().any(|f| f == kueue::RESOURCE_IN_USE) {
            return Ok(());
        }
        let api = self.kueue_api(object);
        self.ensure_leading();
        match kube_ops::remove_finalizer(&api, object, kueue::RESOURCE_IN_USE).await {
            // Made again under the same name, or its finalizers changed meanwhile: the
            // next pass decides on a fresh copy.
            Err(e) if kube_ops::is_test_failed(&e) => {
                debug!(object = %object.name_any(), "Kueue Workload changed since it was read; looking again");
                Ok(())
            }
            other => Ok(kube_ops::done_if_gone_or_changed(other)?),
        }
    }
}
