//! The gang invariants, checked against the live cluster while a test runs. Each must
//! not stay broken for longer than one commit window (a commit that finds a conflict
//! undoes its writes within it):
//! - no device is in two allocations (admin access and shared devices aside);
//! - claims are held as muster's ownership rule says: every gang whose placement names a
//!   claim holds it; no gang that is queued or reserving holds allocated claims of its
//!   own past the window; a claim muster allocated is named by a placement or used by a
//!   pod (a deleted gang's claims are given back), and a gang holds no claim muster
//!   allocated that its placement does not name, unless another gang or a pod outside
//!   it holds that claim;
//! - a released gang holds every claim its placement names, and no pod of a gang is
//!   released while a claim it uses is not allocated;
//! - no released gang holds its devices while one of its planned minCount pods cannot be
//!   scheduled (the operator tears such a gang down after `--schedule-timeout`).
//!
//! A check that cannot read the cluster for longer than the window is a violation too.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, ListParams};
use muster_api::labels;
use muster_api::v1alpha1::{AdmissionState, Workload};
use tokio::task::JoinHandle;

/// How long a deleted gang may take to give its claims back.
const DELETION_WINDOW: Duration = Duration::from_secs(60);

/// A background checker; [`Checker::finish`] returns every violation seen.
pub struct Checker {
    violations: Arc<Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl Checker {
    /// Starts checking every 250 ms. `commit_window`: how long an invariant may stay
    /// broken.
    pub fn start(client: kube::Client, commit_window: Duration) -> Self {
        let violations = Arc::new(Mutex::new(Vec::new()));
        let found = violations.clone();
        let task = tokio::spawn(async move {
            let mut broken_since: HashMap<String, Instant> = HashMap::new();
            let mut failing_since: Option<Instant> = None;
            loop {
                let broken = match check(&client).await {
                    Ok(broken) => {
                        failing_since = None;
                        Ok(broken)
                    }
                    Err(e) => {
                        let since = *failing_since.get_or_insert_with(Instant::now);
                        Err((since, e))
                    }
                };
                let broken = match broken {
                    Ok(broken) => Some(broken),
                    Err((since, e)) => {
                        if since.elapsed() > commit_window {
                            let problem = format!("the invariants could not be checked for {commit_window:?}: {e}");
                            let mut found = found.lock().expect("violations");
                            if !found.contains(&problem) {
                                found.push(problem);
                            }
                        }
                        None
                    }
                };
                if let Some(broken) = broken {
                    let now = Instant::now();
                    broken_since.retain(|problem, _| broken.contains(problem));
                    let mut found = found.lock().expect("violations");
                    for problem in broken {
                        let since = *broken_since.entry(problem.clone()).or_insert(now);
                        // A deleted gang gives its claims back once its pods have ended,
                        // which takes their termination grace, not one commit.
                        let window = if problem.starts_with("deleted gang") {
                            commit_window.max(DELETION_WINDOW)
                        } else {
                            commit_window
                        };
                        let problem = format!("{problem} (for more than {window:?})");
                        if now.duration_since(since) > window && !found.contains(&problem) {
                            found.push(problem);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
        Checker { violations, task }
    }

    /// Stops checking and returns the violations.
    pub fn finish(self) -> Vec<String> {
        self.task.abort();
        self.violations.lock().expect("violations").clone()
    }
}

/// Every invariant broken right now, each described the same way while it stays broken.
async fn check(client: &kube::Client) -> Result<BTreeSet<String>, kube::Error> {
    let claims = Api::<ResourceClaim>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let workloads = Api::<Workload>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default().labels(labels::WORKLOAD))
        .await?
        .items;
    let mut problems = BTreeSet::new();

    let workload_key = |w: &Workload| {
        format!(
            "{}/{}",
            w.metadata.namespace.clone().unwrap_or_default(),
            w.metadata.name.clone().unwrap_or_default()
        )
    };
    let placements: BTreeMap<String, _> = workloads
        .iter()
        .map(|w| (workload_key(w), w.status.as_ref().and_then(|s| s.placement.clone())))
        .collect();
    // Who holds each claim: every gang whose placement names it (a finished gang holds
    // nothing).
    let mut named_by: BTreeMap<String, Vec<(String, Option<AdmissionState>)>> = BTreeMap::new();
    for (gang, placement) in &placements {
        let Some(placement) = placement.as_ref().filter(|p| p.state != Some(AdmissionState::Finished)) else {
            continue;
        };
        let namespace = gang.split_once('/').map_or("", |(ns, _)| ns);
        for claim in &placement.claims {
            named_by
                .entry(format!("{namespace}/{claim}"))
                .or_default()
                .push((gang.clone(), placement.state));
        }
    }
    let mut gang_pods: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for pod in &pods {
        if let Some(workload) = pod.metadata.labels.as_ref().and_then(|l| l.get(labels::WORKLOAD)) {
            let gang = format!("{}/{workload}", pod.metadata.namespace.clone().unwrap_or_default());
            gang_pods
                .entry(gang)
                .or_default()
                .insert(pod.metadata.uid.clone().unwrap_or_default());
        }
    }

    let mut holders: BTreeMap<(String, String, String), String> = BTreeMap::new();
    for claim in &claims {
        let name = format!(
            "{}/{}",
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default()
        );
        let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
            continue;
        };
        for result in allocation.devices.iter().flat_map(|d| d.results.iter().flatten()) {
            if result.admin_access == Some(true) || result.share_id.is_some() {
                continue;
            }
            let device = (result.driver.clone(), result.pool.clone(), result.device.clone());
            if let Some(other) = holders.insert(device.clone(), name.clone()) {
                problems.insert(format!(
                    "device {}/{}/{} is allocated to {other} and {name}",
                    device.0, device.1, device.2
                ));
            }
        }
        let muster_allocated = claim
            .metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == labels::CLAIM_FINALIZER);
        let reserved: Vec<&str> = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.as_ref())
            .into_iter()
            .flatten()
            .map(|r| r.uid.as_str())
            .collect();
        let holding = named_by.get(&name).map(Vec::as_slice).unwrap_or_default();
        for (gang, state) in holding {
            if *state == Some(AdmissionState::Reserving) {
                problems.insert(format!("gang {gang} holds {name} without being admitted"));
            }
        }
        let Some(workload) = claim.metadata.labels.as_ref().and_then(|l| l.get(labels::WORKLOAD)) else {
            continue;
        };
        let gang = format!("{}/{workload}", claim.metadata.namespace.clone().unwrap_or_default());
        if !holding.is_empty() {
            continue;
        }
        // No placement names it: a pod outside the gang whose label it carries may keep
        // it (the gang let go of it); otherwise it is a leak, or the gang's own holding.
        let own = gang_pods.get(&gang);
        let used_outside = reserved.iter().any(|uid| own.is_none_or(|own| !own.contains(*uid)));
        let Some(placement) = placements.get(&gang) else {
            // What muster allocated and no pod uses any more must be given back; a claim
            // another pod (or a Job's pod the gang leaves behind) still uses stays.
            if muster_allocated && reserved.is_empty() {
                problems.insert(format!("deleted gang {gang} still holds allocated claim {name}"));
            }
            continue;
        };
        if used_outside {
            continue;
        }
        let state = placement.as_ref().and_then(|p| p.state);
        if state.is_none() {
            problems.insert(format!("gang {gang} holds {name} without being admitted"));
        } else if muster_allocated {
            problems.insert(format!(
                "gang {gang} holds {name}, which muster allocated but no placement names"
            ));
        }
    }
    let deleting: BTreeSet<String> = workloads
        .iter()
        .filter(|w| w.metadata.deletion_timestamp.is_some())
        .map(workload_key)
        .collect();
    for (gang, placement) in &placements {
        let Some(placement) = placement.as_ref().filter(|p| p.state == Some(AdmissionState::Released)) else {
            continue;
        };
        let namespace = gang.split_once('/').map_or("", |(ns, _)| ns);
        if deleting.contains(gang) {
            continue;
        }
        for claim in &placement.claims {
            let key = format!("{namespace}/{claim}");
            let object = claims.iter().find(|c| {
                c.metadata.namespace.as_deref() == Some(namespace) && c.metadata.name.as_deref() == Some(claim.as_str())
            });
            // A claim that is gone or going (kube-controller-manager deletes a finished
            // Job pod's claim) is not the gang's to hold.
            let Some(object) = object.filter(|c| c.metadata.deletion_timestamp.is_none()) else {
                continue;
            };
            if object.status.as_ref().is_none_or(|s| s.allocation.is_none()) {
                problems.insert(format!(
                    "released gang {gang} does not hold {key}, which its placement names"
                ));
            }
        }
    }
    // No pod of a gang is released while a claim it uses is not allocated (a claim that
    // does not exist yet keeps the pod from being scheduled anyway).
    for pod in &pods {
        let spec = pod.spec.clone().unwrap_or_default();
        let gated = spec
            .scheduling_gates
            .iter()
            .flatten()
            .any(|g| g.name == labels::GANG_GATE);
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if gated || matches!(phase, Some("Succeeded" | "Failed")) {
            continue;
        }
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let generated: BTreeMap<String, String> = pod
            .status
            .as_ref()
            .and_then(|s| s.resource_claim_statuses.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|c| Some((c.name.clone(), c.resource_claim_name.clone()?)))
            .collect();
        for entry in spec.resource_claims.iter().flatten() {
            let Some(object) = entry
                .resource_claim_name
                .clone()
                .or_else(|| generated.get(&entry.name).cloned())
            else {
                continue;
            };
            let found = claims.iter().find(|c| {
                c.metadata.namespace.as_deref() == Some(namespace.as_str())
                    && c.metadata.name.as_deref() == Some(object.as_str())
            });
            if found.is_some_and(|c| c.status.as_ref().is_none_or(|s| s.allocation.is_none())) {
                problems.insert(format!(
                    "pod {namespace}/{} is released but its claim {object} is not allocated",
                    pod.metadata.name.clone().unwrap_or_default()
                ));
            }
        }
    }
    let unschedulable: BTreeSet<String> = pods
        .iter()
        .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_none()))
        .filter(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .into_iter()
                .flatten()
                .any(|c| {
                    c.type_ == "PodScheduled" && c.status == "False" && c.reason.as_deref() == Some("Unschedulable")
                })
        })
        .map(|p| {
            format!(
                "{}/{}",
                p.metadata.namespace.clone().unwrap_or_default(),
                p.metadata.name.clone().unwrap_or_default()
            )
        })
        .collect();
    for (gang, placement) in &placements {
        let Some(placement) = placement.as_ref().filter(|p| p.state == Some(AdmissionState::Released)) else {
            continue;
        };
        let namespace = gang.split_once('/').map_or("", |(ns, _)| ns);
        for planned in placement.pods.iter().filter(|p| !p.extra) {
            if unschedulable.contains(&format!("{namespace}/{}", planned.name)) {
                problems.insert(format!(
                    "gang {gang} is released and holds its devices, but its pod {} cannot be scheduled",
                    planned.name
                ));
            }
        }
    }
    Ok(problems)
}
