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
    /// Every state the watch delivered, in order, to explain a missing reservation.
    pub history: Vec<ClaimState>,
}

/// One state of a claim as the watch delivered it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimState {
    pub at: Instant,
    pub resource_version: String,
    /// The uids in `status.reservedFor`.
    pub reserved_for: Vec<String>,
    pub allocated: bool,
    /// The watch's delete event.
    pub deleted: bool,
}

/// Name prefix of the claims [`Recorder::sync`] creates to learn that the claim watch
/// has delivered everything written before.
pub const SYNC_MARKER: &str = "bench-sync-";

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
    /// The sync markers the claim watch has delivered.
    sync_markers: BTreeSet<String>,
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
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("");
        // The claims a pod runs with are those named before it ends: once it has ended,
        // kube-controller-manager may make it a new claim from the template (it does not
        // check that the pod has ended) and delete that at once, a claim the pod never
        // used and nobody reserves.
        let ended = matches!(phase, "Succeeded" | "Failed");
        for claim in pod
            .spec
            .iter()
            .flat_map(|s| s.resource_claims.iter().flatten())
            .filter(|_| !ended)
        {
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
        if name.starts_with(SYNC_MARKER) {
            self.sync_markers.insert(name);
            return;
        }
        let Some(gang) = self.gang_of_claim(&name).map(str::to_string) else {
            return;
        };
        let allocation = claim.status.as_ref().and_then(|s| s.allocation.as_ref());
        let record = self.claims.entry(uid).or_insert_with(|| ClaimRecord {
            gang,
            name: name.clone(),
            ..ClaimRecord::default()
        });
        let reserved_for: Vec<String> = claim
            .status
            .iter()
            .flat_map(|s| s.reserved_for.iter().flatten())
            .map(|r| r.uid.clone())
            .collect();
        record.reserved_for.extend(reserved_for.iter().cloned());
        record.history.push(ClaimState {
            at: now,
            resource_version: claim.metadata.resource_version.clone().unwrap_or_default(),
            reserved_for,
            allocated: allocation.is_some(),
            deleted: false,
        });
        match allocation {
            // Allocated, or allocated again after it was given back (a gang placed again
            // after a restart): it holds these devices from now on.
            Some(allocation) if record.allocated.is_none() || record.released.is_some() => {
                record.allocated.get_or_insert(now);
                record.released = None;
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
        let Some(record) = claim.metadata.uid.as_ref().and_then(|uid| self.claims.get_mut(uid)) else {
            return;
        };
        record.history.push(ClaimState {
            at: now,
            resource_version: claim.metadata.resource_version.clone().unwrap_or_default(),
            reserved_for: Vec::new(),
            allocated: false,
            deleted: true,
        });
        if record.allocated.is_some() && record.released.is_none() {
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
    /// claim without it may be deallocated or given to another pod. Call it after
    /// [`Recorder::sync`], or a reservation still on its way counts as missing.
    ///
    /// `None` when the claim watch started over during the phase: its history has a
    /// gap, and a reservation inside the gap cannot be told from none.
    pub fn unreserved_running(&self) -> Option<Vec<String>> {
        if self.claim_relists > 0 {
            return None;
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
        Some(missing)
    }

    /// Times the claim watch started over after its first list.
    pub fn claim_relists(&self) -> usize {
        self.claim_relists
    }

    /// What the recorder saw of pod `pod_name` and of its claim `claim_name`, for a pod
    /// [`Self::unreserved_running`] names: the pod's uid and moments, and every state of
    /// the claim (resourceVersion, `reservedFor`, allocated), in milliseconds after `base`.
    pub fn explain(&self, pod_name: &str, claim_name: &str, base: Instant) -> String {
        let ms = |at: Option<Instant>| {
            at.map(|at| format!("{}", at.saturating_duration_since(base).as_millis()))
                .unwrap_or_else(|| "-".into())
        };
        let mut out = String::new();
        for (uid, pod) in self.pods.iter().filter(|(_, p)| p.name == pod_name) {
            out.push_str(&format!(
                "pod {pod_name} uid {uid}: released {} bound {} on {:?} running {} finished {} (ms)\n",
                ms(pod.released),
                ms(pod.bound),
                pod.node,
                ms(pod.running),
                ms(pod.finished)
            ));
        }
        let claims: Vec<(&String, &ClaimRecord)> = self.claims.iter().filter(|(_, c)| c.name == claim_name).collect();
        if claims.is_empty() {
            out.push_str(&format!("claim {claim_name}: never seen by the watch\n"));
        }
        for (uid, claim) in claims {
            out.push_str(&format!("claim {claim_name} uid {uid}:\n"));
            for state in &claim.history {
                out.push_str(&format!(
                    "  {} ms rv {}{} allocated {} reservedFor {:?}\n",
                    ms(Some(state.at)),
                    state.resource_version,
                    if state.deleted { " deleted" } else { "" },
                    state.allocated,
                    state.reserved_for
                ));
            }
        }
        out
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
            sync_markers: BTreeSet::new(),
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

    /// Returns once the claim watch has delivered every claim event written before the
    /// call: it creates a marker claim in `ns` and waits for the watch to deliver it.
    /// Events of one watch arrive in the order they were written, so anything the
    /// timeline lacks afterwards was never written, not merely late. The marker is
    /// named after no gang and requests nothing that any pod uses.
    pub async fn sync(&self, client: &kube::Client, ns: &str) -> anyhow::Result<()> {
        static MARKERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let name = format!(
            "{SYNC_MARKER}{}",
            MARKERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
        let marker = serde_json::json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "marker", "exactly": {
                "deviceClassName": muster_local_cluster::fleet::GPU_DRIVER, "count": 1
            }}]}},
        });
        claims
            .create(&Default::default(), &serde_json::from_value(marker)?)
            .await?;
        muster_local_cluster::wait::until(
            "the claim watch to deliver the sync marker",
            std::time::Duration::from_secs(120),
            || async { Ok(self.timeline.lock().unwrap().sync_markers.contains(&name).then_some(())) },
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeline() -> Timeline {
        Timeline {
            pods: HashMap::new(),
            claims: HashMap::new(),
            gangs: vec!["g1".into()],
            last_progress: Instant::now(),
            claim_relists: 0,
            sync_markers: BTreeSet::new(),
        }
    }

    fn pod(phase: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "g1-0", "uid": "pod-uid", "labels": {GANG_LABEL: "g1"}},
            "spec": {
                "nodeName": "node-1",
                "containers": [{"name": "main"}],
                "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "gpus-2"}],
            },
            "status": {
                "phase": phase,
                "resourceClaimStatuses": [{"name": "gpus", "resourceClaimName": "g1-0-gpus-abcde"}],
            },
        }))
        .unwrap()
    }

    fn claim(name: &str, version: &str, reserved_for: &[&str]) -> ResourceClaim {
        let reserved: Vec<_> = reserved_for
            .iter()
            .map(|uid| serde_json::json!({"resource": "pods", "name": "g1-0", "uid": uid}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "uid": format!("{name}-uid"), "resourceVersion": version},
            "spec": {"devices": {}},
            "status": {
                "allocation": {"devices": {"results": [
                    {"request": "gpus", "driver": "gpu.example.com", "pool": "node-1", "device": "gpu-0"}
                ]}},
                "reservedFor": reserved,
            },
        }))
        .unwrap()
    }

    #[test]
    fn a_reservation_still_on_its_way_counts_once_it_arrives() {
        let mut timeline = timeline();
        let now = Instant::now();
        timeline.observe_claim(&claim("g1-0-gpus-abcde", "10", &[]), now);
        timeline.observe_pod(&pod("Running"), now);
        assert_eq!(
            timeline.unreserved_running(),
            Some(vec!["g1-0/g1-0-gpus-abcde".to_string()]),
            "the pod watch ran ahead of the claim watch"
        );
        timeline.observe_claim(&claim("g1-0-gpus-abcde", "11", &["pod-uid"]), now);
        // Unreserved again when the pod ends: the reservation seen once still counts.
        timeline.observe_claim(&claim("g1-0-gpus-abcde", "12", &[]), now);
        assert_eq!(timeline.unreserved_running(), Some(Vec::new()));
        let history: Vec<(&str, usize)> = timeline.claims["g1-0-gpus-abcde-uid"]
            .history
            .iter()
            .map(|s| (s.resource_version.as_str(), s.reserved_for.len()))
            .collect();
        assert_eq!(history, [("10", 0), ("11", 1), ("12", 0)]);
        let explained = timeline.explain("g1-0", "g1-0-gpus-abcde", now);
        assert!(
            explained.contains("uid pod-uid") && explained.contains("rv 11"),
            "{explained}"
        );
    }

    #[test]
    fn a_claim_made_for_a_pod_after_it_ended_is_not_one_it_ran_with() {
        let mut timeline = timeline();
        let now = Instant::now();
        timeline.observe_pod(&pod("Running"), now);
        timeline.observe_claim(&claim("g1-0-gpus-abcde", "11", &["pod-uid"]), now);
        // The pod ends; its claim goes, and kube-controller-manager makes it another
        // from the template, names it in the pod's status and deletes it.
        let mut ended = pod("Succeeded");
        ended.status.as_mut().unwrap().resource_claim_statuses.as_mut().unwrap()[0].resource_claim_name =
            Some("g1-0-gpus-fghij".into());
        timeline.observe_pod(&ended, now);
        timeline.observe_claim(&claim("g1-0-gpus-fghij", "20", &[]), now);
        assert_eq!(timeline.unreserved_running(), Some(Vec::new()));
        assert_eq!(
            timeline.pods["pod-uid"].claims,
            BTreeSet::from(["g1-0-gpus-abcde".to_string()])
        );
    }

    #[test]
    fn sync_markers_are_noted_and_belong_to_no_gang() {
        let mut timeline = timeline();
        let marker = format!("{SYNC_MARKER}0");
        timeline.observe_claim(&claim(&marker, "5", &[]), Instant::now());
        assert!(timeline.sync_markers.contains(&marker));
        assert!(timeline.claims.is_empty());
    }

    #[test]
    fn a_claim_watch_that_started_over_checks_nothing() {
        let mut timeline = timeline();
        timeline.observe_pod(&pod("Running"), Instant::now());
        assert_eq!(timeline.unreserved_running().map(|m| m.len()), Some(1));
        timeline.claim_relists = 1;
        assert_eq!(timeline.unreserved_running(), None);
    }
}
