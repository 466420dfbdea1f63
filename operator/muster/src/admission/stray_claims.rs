//! Claims muster allocated that lost their `muster.dev/workload` label. The gang caches
//! select on that label, so such a claim drops out of its gang's view (the gang cannot
//! be planned or taken apart with it) and out of the collector's (its devices would be
//! held for good). A claim a journal names gets the label of the gang holding it back;
//! one no journal names goes to the collector, which gives its devices back.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::EventType;
use muster_api::{conditions, labels};
use muster_engine::key::ObjectKey;
use serde_json::json;
use tracing::{info, warn};

use super::{Admission, key, ownership};
use crate::kube_ops;

/// How long a stray claim is left alone after it was looked at: a claim the collector
/// keeps (say, one not allocated) is not read again on every pass.
const LOOK_AGAIN_AFTER: Duration = Duration::from_secs(10);

/// How many stray claims a pass reads at most.
const STRAYS_PER_PASS: usize = 16;

/// How long a gang's steps wait for a claim of its journal that its caches do not show
/// while the index knows it as muster's (its label was taken off, or the gang's watch is
/// ahead of the index's): without the claim, the step would take it for lost.
const HIDDEN_FOR_AT_MOST: Duration = Duration::from_secs(60);

/// When each stray claim was last read, and since when each gang misses one of its
/// claims from its view.
#[derive(Default)]
pub(super) struct StrayClaims {
    looked_at: Mutex<HashMap<ObjectKey, Instant>>,
    hidden_since: Mutex<HashMap<ObjectKey, Instant>>,
    /// Claims labelled again, with how often and when first within [`TOLD_ONCE_PER`].
    relabelled: Mutex<HashMap<ObjectKey, (u32, Instant)>>,
}

/// A claim whose label keeps being taken off is labelled again each time, but its gang
/// is told so (an event) once in this long.
const TOLD_ONCE_PER: Duration = Duration::from_secs(3600);

impl StrayClaims {
    /// Whether `claim` is due to be read, recording that it is.
    fn due(&self, claim: &ObjectKey, strays: &BTreeSet<ObjectKey>) -> bool {
        let mut looked_at = self.looked_at.lock().unwrap_or_else(PoisonError::into_inner);
        looked_at.retain(|k, _| strays.contains(k));
        let now = Instant::now();
        match looked_at.get(claim) {
            Some(at) if now.duration_since(*at) < LOOK_AGAIN_AFTER => false,
            _ => {
                looked_at.insert(claim.clone(), now);
                true
            }
        }
    }
}

impl StrayClaims {
    /// Counts a relabelling of `claim`; returns how many there were within
    /// [`TOLD_ONCE_PER`], this one included.
    fn relabelled(&self, claim: &ObjectKey) -> u32 {
        let mut relabelled = self.relabelled.lock().unwrap_or_else(PoisonError::into_inner);
        relabelled.retain(|_, (_, first)| first.elapsed() < TOLD_ONCE_PER);
        let entry = relabelled.entry(claim.clone()).or_insert((0, Instant::now()));
        entry.0 += 1;
        entry.0
    }

    /// Whether `gang`'s step waits because `hidden` (claims of its journal its view
    /// misses while the index knows them as muster's) is not empty; never for longer
    /// than [`HIDDEN_FOR_AT_MOST`] on end.
    pub(super) fn wait_for_hidden(&self, gang: &ObjectKey, hidden: bool) -> bool {
        let mut since = self.hidden_since.lock().unwrap_or_else(PoisonError::into_inner);
        if !hidden {
            since.remove(gang);
            return false;
        }
        // A gang gone while it waited is not stepped again to clear its entry.
        since.retain(|_, at| at.elapsed() < 10 * HIDDEN_FOR_AT_MOST);
        let first = *since.entry(gang.clone()).or_insert_with(Instant::now);
        first.elapsed() < HIDDEN_FOR_AT_MOST
    }
}

impl Admission {
    /// Labels each stray claim a journal names with its holder's name again, and returns
    /// those no journal names, as read now, for the collector.
    pub(super) async fn relabel_stray_claims(&self) -> Vec<Arc<ResourceClaim>> {
        let strays: BTreeSet<ObjectKey> = self.index.stray_claims().into_iter().collect();
        let mut unheld = Vec::new();
        let mut read = 0;
        for stray in &strays {
            // A label taken off many claims at once is mended over a few passes, not in
            // one that holds every gang's step up.
            if read == STRAYS_PER_PASS || !self.stray_claims.due(stray, &strays) {
                continue;
            }
            read += 1;
            match self.relabel(stray).await {
                Ok(Some(claim)) => unheld.push(Arc::new(claim)),
                Ok(None) => {}
                Err(e) => {
                    warn!(claim = %stray, error = %e, "labelling a claim muster allocated again failed; retrying")
                }
            }
        }
        unheld
    }

    /// Reads `stray` and labels it for the gang whose journal names it (one whose
    /// Workload is not being deleted first), against the version read. Returns the claim
    /// when no journal names it.
    async fn relabel(&self, stray: &ObjectKey) -> Result<Option<ResourceClaim>, kube::Error> {
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), stray.namespace());
        let Some(claim) = api.get_opt(stray.name()).await? else {
            return Ok(None);
        };
        if !ownership::muster_allocated(&claim) || claim.labels().contains_key(labels::WORKLOAD) {
            return Ok(None);
        }
        let holder = {
            let holders = self.holders();
            let mut of_claim: Vec<_> = holders.of_claim(stray).cloned().collect();
            of_claim.sort_by_key(|h| h.deleting);
            of_claim.into_iter().next()
        };
        let Some(holder) = holder else {
            return Ok(Some(claim));
        };
        let patch = json!({
            "metadata": {
                "resourceVersion": claim.resource_version(),
                "labels": {labels::WORKLOAD: holder.gang.name()},
            },
        });
        self.ensure_leading();
        match api
            .patch(stray.name(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            // Changed or gone since the read: looked at again on a later pass.
            Err(e) if kube_ops::is_conflict(&e) || kube_ops::is_not_found(&e) => return Ok(None),
            Err(e) => return Err(e),
        }
        let times = self.stray_claims.relabelled(stray);
        info!(claim = %stray, workload = %holder.gang, times, "a claim muster allocated had lost its workload label; labelled again");
        // Told once an hour, however often the label is taken off.
        if times == 1
            && let Some(workload) = self.current_workloads().into_iter().find(|w| key(w) == holder.gang)
        {
            let note = format!(
                "ResourceClaim {} had lost its {} label; muster put it back, since the gang finds its claims by it (and does each time, telling once an hour)",
                stray.name(),
                labels::WORKLOAD
            );
            self.event(
                &workload,
                EventType::Warning,
                conditions::EVENT_CLAIM_RELABELLED,
                "Relabel",
                note,
            );
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_relabelled_again_and_again_is_told_once_and_counted() {
        let strays = StrayClaims::default();
        let claim = ObjectKey::new("ns", "c");
        assert_eq!(strays.relabelled(&claim), 1, "told");
        assert_eq!(strays.relabelled(&claim), 2, "not told again");
        assert_eq!(
            strays.relabelled(&ObjectKey::new("ns", "d")),
            1,
            "another claim is told"
        );
    }

    #[test]
    fn a_gang_waits_for_a_hidden_claim_only_while_it_is_hidden() {
        let strays = StrayClaims::default();
        let gang = ObjectKey::new("ns", "g");
        assert!(strays.wait_for_hidden(&gang, true));
        assert!(!strays.wait_for_hidden(&gang, false), "seen again");
        assert!(strays.hidden_since.lock().unwrap().is_empty(), "forgotten");
    }
}
