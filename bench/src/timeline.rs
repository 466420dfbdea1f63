//! What happens to each gang, seen from client-side watches and stamped with a
//! monotonic clock: when its claims are allocated, its pods bound, running, finished.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use tokio::task::JoinHandle;

use crate::contender::GANG_LABEL;

/// A device: (pool, device).
pub type Device = (String, String);

#[derive(Clone, Debug, Default)]
pub struct PodRecord {
    pub gang: String,
    pub name: String,
    /// Names of its ResourceClaims (those made from templates once they are known).
    pub claims: BTreeSet<String>,
    pub node: Option<String>,
    /// When the pod was first seen without scheduling gates.
    pub released: Option<Instant>,
    pub bound: Option<Instant>,
    pub running: Option<Instant>,
    pub finished: Option<Instant>,
    pub failed: bool,
}

#[derive(Clone, Debug, Default)]
pub struct ClaimRecord {
    pub gang: String,
    pub name: String,
    /// Every pod uid seen in its `status.reservedFor`.
    pub reserved_for: BTreeSet<String>,
    pub allocated: Option<Instant>,
    pub released: Option<Instant>,
    pub devices: Vec<Device>,
}

/// Every pod and claim seen, by uid, and the last time anything moved.
#[derive(Clone, Debug)]
pub struct Timeline {
    pub pods: HashMap<String, PodRecord>,
    pub claims: HashMap<String, ClaimRecord>,
    /// Gang names, longest first, to find the gang of a claim by its name's prefix.
    gangs: Vec<String>,
    pub last_progress: Instant,
    /// Times the claim watch started over from a fresh list after the first: a claim
    /// that changed meanwhile may have been reserved and unreserved unseen.
    claim_relists: usize,
}

impl Timeline {
    fn gang_of_claim(&self, claim_name: &str) -> Option<&str> {
        self.gangs
            .iter()
            .find(|g| {
                claim_name
                    .strip_prefix(g.as_str())
                    .is_some_and(|rest| rest.starts_with('-'))
            })
            .map(String::as_str)
    }

    fn observe_pod(&mut self, pod: &Pod, now: Instant) {
        let (Some(uid), Some(gang)) = (
            pod.metadata.uid.clone(),
            pod.metadata.labels.as_ref().and_then(|l| l.get(GANG_LABEL)).cloned(),
        ) else {
            return;
        };
        let record = self.pods.entry(uid).or_insert_with(|| PodRecord {
            gang,
            name: pod.metadata.name.clone().unwrap_or_default(),
            ..PodRecord::default()
        });
        for claim in pod.spec.iter().flat_map(|s| s.resource_claims.iter().flatten()) {
            let generated = || {
                pod.status
                    .as_ref()?
                    .resource_claim_statuses
                    .as_ref()?
                    .iter()
                    .find(|s| s.name == claim.name)?
                    .resource_claim_name
                    .clone()
            };
            if let Some(name) = claim.resource_claim_name.clone().or_else(generated) {
                record.claims.insert(name);
            }
        }
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("");
        let mut moved = false;
        let gated = pod
            .spec
            .as_ref()
            .and_then(|s| s.scheduling_gates.as_ref())
            .is_some_and(|g| !g.is_empty());
        if record.released.is_none() && !gated {
            record.released = Some(now);
        }
        if record.bound.is_none() && node.is_some() {
            record.bound = Some(now);
            record.node = node;
            moved = true;
        }
        if record.running.is_none() && matches!(phase, "Running" | "Succeeded") {
            record.running = Some(now);
            moved = true;
        }
        if record.finished.is_none() && matches!(phase, "Succeeded" | "Failed") {
            record.finished = Some(now);
            record.failed = phase == "Failed";
            moved = true;
        }
        if moved {
            self.last_progress = now;
        }
    }

    /// A deleted pod that had not ended ends now, unsuccessfully.
    fn pod_gone(&mut self, pod: &Pod, now: Instant) {
        if let Some(record) = pod.metadata.uid.as_ref().and_then(|uid| self.pods.get_mut(uid))
            && record.finished.is_none()
        {
            record.finished = Some(now);
            record.failed = true;
        }
    }

    fn observe_claim(&mut self, claim: &ResourceClaim, now: Instant) {
        let Some(uid) = claim.metadata.uid.clone() else { return };
        let name = claim.metadata.name.clone().unwrap_or_default();
        let Some(gang) = self.gang_of_claim(&name).map(str::to_string) else {
            return;
        };
        let allocation = claim.status.as_ref().and_then(|s| s.allocation.as_ref());
        let record = self.claims.entry(uid).or_insert_with(|| ClaimRecord {
            gang,
            name: name.clone(),
            ..ClaimRecord::default()
        });
        for reference in claim.status.iter().flat_map(|s| s.reserved_for.iter().flatten()) {
            record.reserved_for.insert(reference.uid.clone());
        }
        match allocation {
            Some(allocation) if record.allocated.is_none() => {
                record.allocated = Some(now);
                record.devices = allocation
                    .devices
                    .iter()
                    .flat_map(|d| d.results.iter().flatten())
                    .map(|r| (r.pool.clone(), r.device.clone()))
                    .collect();
            }
            None if record.allocated.is_some() && record.released.is_none() => record.released = Some(now),
            _ => {}
        }
    }

    fn claim_gone(&mut self, claim: &ResourceClaim, now: Instant) {
        if let Some(record) = claim.metadata.uid.as_ref().and_then(|uid| self.claims.get_mut(uid))
            && record.allocated.is_some()
            && record.released.is_none()
        {
            record.released = Some(now);
        }
    }

    /// Pods of `gang`, in no order.
    pub fn pods_of<'a>(&'a self, gang: &'a str) -> impl Iterator<Item = &'a PodRecord> + 'a {
        self.pods.values().filter(move |p| p.gang == gang)
    }

    /// Claims of `gang`, in no order.
    pub fn claims_of<'a>(&'a self, gang: &'a str) -> impl Iterator<Item = &'a ClaimRecord> + 'a {
        self.claims.values().filter(move |c| c.gang == gang)
    }

    /// Devices held right now by `gang`'s claims.
    pub fn devices_held(&self, gang: &str) -> BTreeSet<Device> {
        self.claims_of(gang)
            .filter(|c| c.allocated.is_some() && c.released.is_none())
            .flat_map(|c| c.devices.iter().cloned())
            .collect()
    }

    /// Pods that ran although some claim of theirs never listed them in `reservedFor`
    /// (`pod/claim`): kube-scheduler and the kubelet rely on the reservation, and a
    /// claim without it may be deallocated or given to another pod.
    ///
    /// Empty when the claim watch started over during the phase: its history has a
    /// gap, and a reservation inside the gap cannot be told from none.
    pub fn unreserved_running(&self) -> Vec<String> {
        if self.claim_relists > 0 {
            eprintln!(
                "  the claim watch started over {} time(s): reservations not checked in this phase",
                self.claim_relists
            );
            return Vec::new();
        }
        let mut missing = Vec::new();
        for (uid, pod) in &self.pods {
            if pod.running.is_none() {
                continue;
            }
            for claim in &pod.claims {
                let reserved = self
                    .claims
                    .values()
                    .filter(|c| &c.name == claim)
                    .any(|c| c.reserved_for.contains(uid));
                if !reserved {
                    missing.push(format!("{}/{claim}", pod.name));
                }
            }
        }
        missing.sort();
        missing
    }

    /// Pods of each gang that are bound and not finished, by gang.
    pub fn active_pods(&self) -> BTreeMap<&str, usize> {
        let mut out = BTreeMap::new();
        for pod in self.pods.values() {
            if pod.bound.is_some() && pod.finished.is_none() {
                *out.entry(pod.gang.as_str()).or_default() += 1;
            }
        }
        out
    }
}

/// The watches feeding a [`Timeline`]; they stop when this is dropped.
pub struct Recorder {
    pub timeline: Arc<Mutex<Timeline>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Recorder {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Recorder {
    /// Starts watching the pods and claims of namespace `ns` for the gangs named.
    pub fn start(client: &kube::Client, ns: &str, gangs: impl IntoIterator<Item = String>) -> Self {
        let mut gangs: Vec<String> = gangs.into_iter().collect();
        gangs.sort_by_key(|g| std::cmp::Reverse(g.len()));
        let timeline = Arc::new(Mutex::new(Timeline {
            pods: HashMap::new(),
            claims: HashMap::new(),
            gangs,
            last_progress: Instant::now(),
            claim_relists: 0,
        }));
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
        let pod_timeline = timeline.clone();
        let pod_task = tokio::spawn(async move {
            let config = watcher::Config::default().labels(GANG_LABEL);
            let mut events = watcher::watcher(pods, config).boxed();
            loop {
                match events.try_next().await {
                    Ok(Some(Event::Apply(pod) | Event::InitApply(pod))) => {
                        pod_timeline.lock().unwrap().observe_pod(&pod, Instant::now());
                    }
                    Ok(Some(Event::Delete(pod))) => {
                        pod_timeline.lock().unwrap().pod_gone(&pod, Instant::now());
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    // The watcher relists on its own after an error.
                    Err(_) => tokio::time::sleep(std::time::Duration::from_millis(200)).await,
                }
            }
        });
        let claim_timeline = timeline.clone();
        let claim_task = tokio::spawn(async move {
            let mut events = watcher::watcher(claims, watcher::Config::default()).boxed();
            let mut listed = false;
            loop {
                match events.try_next().await {
                    Ok(Some(Event::Init)) => {
                        if listed {
                            claim_timeline.lock().unwrap().claim_relists += 1;
                        }
                        listed = true;
                    }
                    Ok(Some(Event::Apply(claim) | Event::InitApply(claim))) => {
                        claim_timeline.lock().unwrap().observe_claim(&claim, Instant::now());
                    }
                    Ok(Some(Event::Delete(claim))) => {
                        claim_timeline.lock().unwrap().claim_gone(&claim, Instant::now());
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(_) => tokio::time::sleep(std::time::Duration::from_millis(200)).await,
                }
            }
        });
        Recorder {
            timeline,
            tasks: vec![pod_task, claim_task],
        }
    }
}
