//! The gang invariants, checked against the live cluster while a test runs:
//! - no device is in two allocations (admin access and shared devices aside);
//! - no gang (an existing Workload) holds allocated claims while it is not admitted
//!   (placement not Released) for longer than one commit window.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, ListParams};
use muster_api::labels;
use muster_api::v1alpha1::{AdmissionState, Workload};
use tokio::task::JoinHandle;

/// A background checker; [`Checker::finish`] returns every violation seen.
pub struct Checker {
    violations: Arc<Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl Checker {
    /// Starts checking every 250 ms. `commit_window`: how long a gang may hold
    /// allocations without being admitted.
    pub fn start(client: kube::Client, commit_window: Duration) -> Self {
        let violations = Arc::new(Mutex::new(Vec::new()));
        let found = violations.clone();
        let task = tokio::spawn(async move {
            let mut holding_since: HashMap<String, Instant> = HashMap::new();
            loop {
                if let Ok(problems) = check(&client, &mut holding_since, commit_window).await {
                    let mut found = found.lock().expect("violations");
                    for problem in problems {
                        if !found.contains(&problem) {
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

async fn check(
    client: &kube::Client,
    holding_since: &mut HashMap<String, Instant>,
    commit_window: Duration,
) -> Result<Vec<String>, kube::Error> {
    let claims = Api::<ResourceClaim>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let workloads = Api::<Workload>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let mut problems = Vec::new();

    let mut holders: BTreeMap<(String, String, String), String> = BTreeMap::new();
    let mut gang_holds: BTreeMap<String, usize> = BTreeMap::new();
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
            *gang_holds.entry(gang).or_default() += 1;
        }
        for result in allocation.devices.iter().flat_map(|d| d.results.iter().flatten()) {
            if result.admin_access == Some(true) || result.share_id.is_some() {
                continue;
            }
            let device = (result.driver.clone(), result.pool.clone(), result.device.clone());
            if let Some(other) = holders.insert(device.clone(), name.clone()) {
                problems.push(format!(
                    "device {}/{}/{} is allocated to {other} and {name}",
                    device.0, device.1, device.2
                ));
            }
        }
    }
    let admitted: BTreeMap<String, bool> = workloads
        .iter()
        .map(|w| {
            let key = format!(
                "{}/{}",
                w.metadata.namespace.clone().unwrap_or_default(),
                w.metadata.name.clone().unwrap_or_default()
            );
            let released = w
                .status
                .as_ref()
                .and_then(|s| s.placement.as_ref())
                .and_then(|p| p.state)
                .is_some_and(|s| s == AdmissionState::Released);
            (key, released)
        })
        .collect();
    let now = Instant::now();
    holding_since.retain(|gang, _| gang_holds.contains_key(gang));
    for (gang, count) in gang_holds {
        // A deleted gang's claims wait for garbage collection; they are not a gang
        // waiting to be placed.
        let Some(is_admitted) = admitted.get(&gang).copied() else {
            holding_since.remove(&gang);
            continue;
        };
        if is_admitted {
            holding_since.remove(&gang);
            continue;
        }
        let since = *holding_since.entry(gang.clone()).or_insert(now);
        if now.duration_since(since) > commit_window {
            problems.push(format!(
                "gang {gang} holds {count} allocated claims without being admitted for more than {commit_window:?}"
            ));
        }
    }
    Ok(problems)
}
