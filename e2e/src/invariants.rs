//! The gang invariants, checked against the live cluster while a test runs. Each must
//! not stay broken for longer than one commit window (a commit that finds a conflict
//! undoes its writes within it):
//! - no device is in two allocations (admin access and shared devices aside);
//! - no gang that is queued or reserving holds allocated claims past the window, and a
//!   deleted gang's claims are given back;
//! - a claim muster allocated for a gang is one the gang's placement names, and a
//!   released gang holds every claim its placement names;
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

    let mut holders: BTreeMap<(String, String, String), String> = BTreeMap::new();
    // Per gang, its allocated claims: whether muster allocated each (its finalizer) and
    // whether a pod reserves it.
    let mut gang_holds: BTreeMap<String, Vec<(String, bool, bool)>> = BTreeMap::new();
    for claim in &claims {
        let name = format!(
            "{}/{}",
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default()
        );
        let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
            continue;
        };
        if let Some(workload) = claim.metadata.labels.as_ref().and_then(|l| l.get(labels::WORKLOAD)) {
            let gang = format!("{}/{workload}", claim.metadata.namespace.clone().unwrap_or_default());
            let muster_allocated = claim
                .metadata
                .finalizers
                .iter()
                .flatten()
                .any(|f| f == labels::CLAIM_FINALIZER);
            let reserved = claim
                .status
                .as_ref()
                .and_then(|s| s.reserved_for.as_ref())
                .is_some_and(|r| !r.is_empty());
            gang_holds
                .entry(gang)
                .or_default()
                .push((name.clone(), muster_allocated, reserved));
        }
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
    }
    let deleting: BTreeSet<String> = workloads
        .iter()
        .filter(|w| w.metadata.deletion_timestamp.is_some())
        .map(|w| {
            format!(
                "{}/{}",
                w.metadata.namespace.clone().unwrap_or_default(),
                w.metadata.name.clone().unwrap_or_default()
            )
        })
        .collect();
    let placements: BTreeMap<String, _> = workloads
        .iter()
        .map(|w| {
            let key = format!(
                "{}/{}",
                w.metadata.namespace.clone().unwrap_or_default(),
                w.metadata.name.clone().unwrap_or_default()
            );
            (key, w.status.as_ref().and_then(|s| s.placement.clone()))
        })
        .collect();
    for (gang, held) in gang_holds {
        let Some(placement) = placements.get(&gang) else {
            // What muster allocated and no pod uses any more must be given back; a claim
            // another pod (or a Job's pod the gang leaves behind) still uses stays.
            let stale: Vec<&str> = held
                .iter()
                .filter(|(_, muster_allocated, reserved)| *muster_allocated && !reserved)
                .map(|(name, _, _)| name.as_str())
                .collect();
            if !stale.is_empty() {
                problems.insert(format!(
                    "deleted gang {gang} still holds {} allocated claims ({})",
                    stale.len(),
                    stale.join(", ")
                ));
            }
            continue;
        };
        let state = placement.as_ref().and_then(|p| p.state);
        if matches!(state, None | Some(AdmissionState::Reserving)) {
            problems.insert(format!(
                "gang {gang} holds {} allocated claims without being admitted",
                held.len()
            ));
        }
        // What muster allocated for the gang is what its placement names.
        let named: BTreeSet<&str> = placement
            .iter()
            .flat_map(|p| p.claims.iter().map(String::as_str))
            .collect();
        for (claim, muster_allocated, _) in &held {
            let short = claim.split_once('/').map_or(claim.as_str(), |(_, n)| n);
            if *muster_allocated && state.is_some() && !named.contains(short) {
                problems.insert(format!(
                    "gang {gang} holds {claim}, which muster allocated but its placement does not name"
                ));
            }
        }
    }
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
