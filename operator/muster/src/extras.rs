//! Pods beyond a group's `minCount`: they start when they fit, in the gang's placement
//! domain, after the gang itself runs, and their loss does not restart the gang. A lost
//! extra whose claims are still allocated goes back onto its node; otherwise its claims
//! are deallocated and it is placed again like any other waiting extra.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use muster_api::labels;
use muster_api::v1alpha1::{PlannedPod, Workload};
use muster_engine::placement::{self, Outcome};
use tracing::info;

use crate::admission::{Admission, CommitError, StatusUpdate, deallocate, key, placement_of};
use crate::gang;
use crate::membership::label;
use crate::release;
use crate::status::is_gated;

fn short(key: &str) -> String {
    key.split_once('/').map_or(key, |(_, n)| n).to_string()
}

impl Admission {
    /// Keeps the extras of a running gang going: releases or drops planned extras that
    /// lost their pod, and places waiting extras that now fit.
    pub(crate) async fn tend_extras(&self, workload: &Workload) -> Result<(), CommitError> {
        let Some(mut placement) = placement_of(workload).cloned() else {
            return Ok(());
        };
        let Ok(request) = self.request(workload) else {
            return Ok(());
        };
        let namespace = workload.namespace().unwrap_or_default();
        let attempt = workload.status.as_ref().map_or(0, |s| s.restarts).to_string();
        let pods: BTreeMap<String, Arc<Pod>> = self
            .stores
            .pods_of(&namespace, &workload.name_any())
            .into_iter()
            .filter(|p| label(p, labels::ATTEMPT).is_none_or(|a| a == attempt))
            .map(|p| (p.name_any(), p))
            .collect();
        let claims_of_pod: BTreeMap<String, Vec<String>> = request
            .groups
            .iter()
            .flat_map(|g| &g.pods)
            .map(|p| (short(&p.name), p.claims.iter().map(|c| short(c)).collect()))
            .collect();
        let claims = self.claims_by_name(workload);
        let allocated = |name: &String| {
            claims
                .get(name)
                .is_some_and(|c| c.status.as_ref().is_some_and(|s| s.allocation.is_some()))
        };
        let claim_api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
        let pod_api: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);

        // Planned extras whose pod failed, was lost or was recreated.
        let mut dropped: BTreeSet<String> = BTreeSet::new();
        let made_here: BTreeSet<String> = gang::build(workload)
            .map(|g| g.pods.iter().filter_map(|p| p.metadata.name.clone()).collect())
            .unwrap_or_default();
        for planned in placement.pods.clone() {
            if !planned.extra {
                continue;
            }
            let Some(pod) = pods.get(&planned.name) else {
                // Another controller's pod is gone for good (it makes a new one, under a
                // new name); muster's own comes back under the same name.
                if !made_here.contains(&planned.name) {
                    dropped.insert(planned.name.clone());
                }
                continue;
            };
            let own_claims = claims_of_pod.get(&planned.name).cloned().unwrap_or_default();
            let node_gone = self.index.cluster().node(&planned.node).is_none();
            let failed = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed");
            if failed || (node_gone && !is_gated(pod)) {
                let params = if node_gone {
                    DeleteParams {
                        grace_period_seconds: Some(0),
                        ..DeleteParams::default()
                    }
                } else {
                    DeleteParams::default()
                };
                match pod_api.delete(&planned.name, &params).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
                continue;
            }
            if !is_gated(pod) {
                continue;
            }
            if !node_gone && own_claims.iter().all(allocated) {
                // Back onto its node and devices.
                release::release(&pod_api, &planned.name, &planned.node, Some(pod), self.settings.fencing).await?;
                continue;
            }
            for claim in &own_claims {
                deallocate(&claim_api, claim).await?;
            }
            dropped.insert(planned.name.clone());
        }
        if !dropped.is_empty() {
            placement.pods.retain(|p| !dropped.contains(&p.name));
            let dropped_claims: BTreeSet<String> = dropped
                .iter()
                .flat_map(|p| claims_of_pod.get(p).cloned().unwrap_or_default())
                .collect();
            placement.claims.retain(|c| !dropped_claims.contains(c));
            self.write_status(workload, StatusUpdate::placement(placement.clone()))
                .await?;
        }

        // Waiting extras: gated, never placed in this attempt.
        let planned: BTreeSet<&str> = placement.pods.iter().map(|p| p.name.as_str()).collect();
        let waiting: BTreeSet<String> = pods
            .values()
            .filter(|p| is_gated(p) && !planned.contains(p.name_any().as_str()))
            .map(|p| p.name_any())
            .collect();
        if waiting.is_empty() {
            return Ok(());
        }
        let mut extras = request.clone();
        for group in &mut extras.groups {
            group.pods.retain(|p| waiting.contains(&short(&p.name)));
            group.min_count = 0;
            // The gang's placement domain.
            if let (Some(key), Some(value)) = (&extras.topology.required, &placement.topology_value) {
                group.shape.node_selector.insert(key.clone(), value.clone());
            }
        }
        extras.groups.retain(|g| !g.pods.is_empty());
        extras.topology = Default::default();
        let outcome = {
            let cluster = self.index.cluster();
            placement::plan(&cluster, &extras, &self.settings.plan)
        };
        let Outcome::Placed(plan) = outcome else { return Ok(()) };
        if plan.pods.is_empty() {
            return Ok(());
        }
        info!(workload = %key(workload), pods = plan.pods.len(), "placing extra pods");
        // Record first, so a crash leaves them listed (and handled above).
        let mut grown = placement.clone();
        for p in &plan.pods {
            grown.pods.push(PlannedPod {
                name: short(&p.pod),
                node: p.node.clone(),
                extra: true,
            });
        }
        grown.claims.extend(plan.claims.iter().map(|c| short(&c.claim)));
        grown.devices += plan.device_count() as i32;
        let nodes: BTreeSet<String> = grown.pods.iter().map(|p| p.node.clone()).collect();
        grown.nodes = nodes.into_iter().collect();
        self.write_status(workload, StatusUpdate::placement(grown.clone()))
            .await?;
        if let Err(e) = self.reserve(workload, &plan).await {
            for claim in &plan.claims {
                deallocate(&claim_api, &short(&claim.claim)).await?;
            }
            self.write_status(workload, StatusUpdate::placement(placement)).await?;
            return Err(e);
        }
        for p in &plan.pods {
            release::release(
                &pod_api,
                &short(&p.pod),
                &p.node,
                pods.get(&short(&p.pod)).map(AsRef::as_ref),
                self.settings.fencing,
            )
            .await?;
        }
        crate::metrics::get().extras_placed.inc_by(plan.pods.len() as u64);
        Ok(())
    }
}
