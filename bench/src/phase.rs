//! One phase: one contender runs one scenario in a fresh namespace on the scenario's
//! fleet, watched from the client side, and everything it made is deleted afterwards.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use muster_local_cluster::namespaces::namespace;
use muster_local_cluster::operator::Operator;
use serde_json::json;

use crate::contender::{self, Contender};
use crate::cost;
use crate::spec::{GangSpec, Scenario, ScenarioId};
use crate::timeline::{Recorder, Timeline};

/// A gang that held some of its devices but not all for this long counts as a partial
/// allocation: its members sat on devices while another member waited.
const PARTIAL_AFTER: Duration = Duration::from_secs(10);
/// Gangs submitted at once.
const SUBMIT_PARALLELISM: usize = 16;
/// Gangs submitted, or let go, at once in a burst.
const BURST_PARALLELISM: usize = 64;

/// Where the cluster and the operator come from for a phase.
pub struct Stage<'a> {
    pub client: &'a kube::Client,
    pub kubeconfig: &'a Path,
    pub log_dir: &'a Path,
    pub muster_binary: &'a Path,
    /// Control-plane components by name and pid, for their CPU seconds.
    pub components: &'a [(String, u32)],
    /// Rack of every node.
    pub racks: &'a HashMap<String, String>,
    /// kube-apiserver's audit log of writes.
    pub audit_log: &'a Path,
}

/// What became of one gang; times are seconds after the gang was created.
#[derive(Clone, Debug, Default)]
pub struct GangOutcome {
    pub name: String,
    pub pods: usize,
    pub created_at: f64,
    pub all_claims: Option<f64>,
    /// Every pod released to kube-scheduler (no scheduling gate left).
    pub all_released: Option<f64>,
    pub all_bound: Option<f64>,
    pub all_running: Option<f64>,
    pub finished: Option<f64>,
    /// All pods bound in one rack (only asked of gangs that need it).
    pub in_one_rack: Option<bool>,
    pub partial: bool,
}

/// The failure of S4: how long back to all running, and whether the same devices.
#[derive(Clone, Debug)]
pub struct Recovery {
    pub seconds: Option<f64>,
    pub same_devices: bool,
}

/// Everything measured in one phase.
#[derive(Clone, Debug)]
pub struct PhaseResult {
    pub scenario: ScenarioId,
    pub contender: Contender,
    pub repeat: usize,
    pub gangs: Vec<GangOutcome>,
    /// First create to the last gang done (running, or finished if gangs finish).
    pub makespan: f64,
    pub pods_bound: usize,
    /// Pods bound per second, from the first create to the last pod bound.
    pub pods_per_second: f64,
    /// GPU-seconds of running pods over the fleet's GPU-seconds during the makespan.
    pub gpu_utilisation: f64,
    pub stalled: bool,
    pub cpu_seconds: BTreeMap<String, f64>,
    pub muster_peak_rss_mib: Option<f64>,
    /// Writes served by kube-apiserver during the phase, by resource.
    pub apiserver_writes: BTreeMap<String, f64>,
    /// Writes muster made, from its own request counter.
    pub muster_writes: Option<f64>,
    /// The operator's writes by `verb resource`.
    pub muster_writes_by_request: BTreeMap<String, f64>,
    pub recovery: Option<Recovery>,
    /// Every write in the phase's namespace, by client, stage and resource, from the
    /// audit log (setup of templates aside).
    pub writes: crate::audit::WriteCounts,
    /// Pods that ran without being in `reservedFor` of each of their claims.
    pub unreserved_running: Vec<String>,
    /// Pods released to kube-scheduler, and pods bound, per second between the moments
    /// 10% and 90% of them were (scheduler_perf's throughput over a window).
    pub release_rate: Option<f64>,
    pub bind_rate: Option<f64>,
    /// muster's plans in the phase, and their mean duration in seconds, from its
    /// `muster_plan_duration_seconds`.
    pub muster_plans: Option<(f64, f64)>,
}

impl PhaseResult {
    pub fn admitted(&self) -> usize {
        self.gangs.iter().filter(|g| g.all_bound.is_some()).count()
    }

    pub fn placed_correctly(&self) -> usize {
        self.gangs
            .iter()
            .filter(|g| g.all_bound.is_some() && g.in_one_rack != Some(false))
            .count()
    }

    pub fn partial(&self) -> usize {
        self.gangs.iter().filter(|g| g.partial).count()
    }

    /// Gangs left unfinished when the phase stalled.
    pub fn deadlocked(&self) -> usize {
        if !self.stalled {
            return 0;
        }
        self.gangs.iter().filter(|g| g.partial && g.finished.is_none()).count()
    }

    pub fn total_writes(&self) -> f64 {
        self.apiserver_writes.values().sum()
    }

    /// Writes to the phase's gang objects (pods, claims, Workloads, PodGroups, Services,
    /// events...) by every client, per pod bound: the API server's idle background
    /// (node leases and status) is not in it.
    pub fn gang_writes_per_pod(&self) -> f64 {
        self.writes.total(None, None) as f64 / self.pods_bound.max(1) as f64
    }

    /// From the last gang's create (or release, for a held baseline gang) to the moment
    /// every pod of every gang was Running, if they all were.
    pub fn last_create_to_all_running(&self) -> Option<f64> {
        let last_create = self.gangs.iter().map(|g| g.created_at).reduce(f64::max)?;
        let all_running = self
            .gangs
            .iter()
            .map(|g| g.all_running.map(|r| g.created_at + r))
            .collect::<Option<Vec<f64>>>()?
            .into_iter()
            .reduce(f64::max)?;
        Some((all_running - last_create).max(0.0))
    }

    /// muster's CPU seconds per 100 pods bound.
    pub fn muster_cpu_per_100_pods(&self) -> Option<f64> {
        let cpu = self.cpu_seconds.get("muster")?;
        Some(cpu * 100.0 / self.pods_bound.max(1) as f64)
    }

    /// Writes by `client` in `stage` per pod bound.
    pub fn writes_per_pod(&self, client: Option<crate::audit::Client>, stage: Option<crate::audit::Stage>) -> f64 {
        self.writes.total(client, stage) as f64 / self.pods_bound.max(1) as f64
    }
}

/// Runs `scenario` with `contender`.
pub async fn run(stage: &Stage<'_>, scenario: &Scenario, contender: Contender, repeat: usize) -> Result<PhaseResult> {
    let client = stage.client;
    let ns = namespace(client, &format!("bench-{:?}-{contender:?}", scenario.id).to_lowercase()).await?;
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), &ns);
    for gpus in scenario.gangs.iter().map(|g| g.gpus).collect::<BTreeSet<_>>() {
        templates
            .create(
                &PostParams::default(),
                &serde_json::from_value(contender::claim_template(gpus))?,
            )
            .await?;
    }
    let operator = if contender == Contender::Muster {
        let logs = stage.log_dir.join(&ns);
        Some(Operator::start_binary(
            stage.muster_binary,
            stage.kubeconfig,
            &logs,
            &["--fencing=none", "--log-level=info"],
            &[],
        )?)
    } else {
        None
    };

    if let Some(operator) = &operator {
        wait_leading(operator).await?;
    }
    let recorder = Recorder::start(client, &ns, scenario.gangs.iter().map(|g| g.name.clone()));
    let audit_from = crate::audit::offset(stage.audit_log);
    let cpu_before = cost::cpu_by_process(stage.components);
    let writes_before = cost::apiserver_writes(client).await?;
    let outcome = drive(stage, scenario, contender, &ns, &recorder).await;
    let writes_after = cost::apiserver_writes(client).await?;
    let cpu_after = cost::cpu_by_process(stage.components);

    let mut cpu_seconds = cost::delta(&cpu_before, &cpu_after);
    let mut muster_peak_rss_mib = None;
    let mut muster_writes = None;
    let mut muster_plans = None;
    if let Some(operator) = &operator {
        if let Some(pid) = operator.pid() {
            cpu_seconds.insert("muster".into(), cost::cpu_seconds(pid).unwrap_or(0.0));
            muster_peak_rss_mib = cost::peak_rss_mib(pid);
        }
        muster_writes = operator_writes(operator).await.ok();
        muster_plans = operator_plans(operator).await.ok();
    }
    drop(recorder);
    let cleanup_wall = std::time::SystemTime::now();
    let cleanup = delete_namespace_and_wait(client, &ns).await;
    if let Some(operator) = operator {
        operator.stop();
    }
    let driven = outcome?;
    cleanup?;
    // The API server writes its audit events out in batches.
    tokio::time::sleep(crate::audit::FLUSH).await;
    let audited = crate::audit::read(stage.audit_log, audit_from, &ns)?;
    let mut result = summarize(scenario, contender, repeat, &driven, stage.racks);
    let gangs: Vec<String> = scenario.gangs.iter().map(|g| g.name.clone()).collect();
    // A gang's lifecycle begins when its first pod ends, or at the latest when the
    // namespace's deletion takes what is left.
    let lifecycle_from: BTreeMap<String, std::time::SystemTime> = scenario
        .gangs
        .iter()
        .map(|gang| {
            let first_end = driven
                .timeline
                .pods_of(&gang.name)
                .filter_map(|p| p.finished)
                .min()
                .map(|end| driven.start_wall + end.saturating_duration_since(driven.start));
            let from = first_end.map_or(cleanup_wall, |end| end.min(cleanup_wall));
            (gang.name.clone(), from)
        })
        .collect();
    result.writes = crate::audit::WriteCounts::of(&audited, &gangs, &lifecycle_from);
    result.unreserved_running = match driven.timeline.unreserved_running() {
        Some(missing) => missing,
        None => {
            eprintln!(
                "  the claim watch started over {} time(s): reservations not checked in this phase",
                driven.timeline.claim_relists()
            );
            Vec::new()
        }
    };
    for missing in &result.unreserved_running {
        eprintln!("{}", explain_unreserved(missing, &driven, &audited));
    }
    result.cpu_seconds = cpu_seconds;
    result.muster_peak_rss_mib = muster_peak_rss_mib;
    result.apiserver_writes = cost::delta(&writes_before, &writes_after);
    result.muster_writes = muster_writes.as_ref().map(|w| w.values().sum());
    result.muster_writes_by_request = muster_writes.unwrap_or_default();
    result.muster_plans = muster_plans;
    Ok(result)
}

/// What [`drive`] leaves behind for the summary.
struct Driven {
    timeline: Timeline,
    start: Instant,
    /// The wall clock at `start`, to place audit events on the timeline.
    start_wall: std::time::SystemTime,
    created: HashMap<String, Instant>,
    partial: BTreeSet<String>,
    stalled: bool,
    recovery: Option<Recovery>,
}

/// Submits every gang, then watches until they are all done, the phase stalls or it
/// times out; deletes finished gangs if the scenario churns, and fails a member in S4.
async fn drive(
    stage: &Stage<'_>,
    scenario: &Scenario,
    contender: Contender,
    ns: &str,
    recorder: &Recorder,
) -> Result<Driven> {
    let client = stage.client;
    let burst = scenario.gangs.iter().any(|g| g.held);
    if burst && contender.creates_pods() {
        // Every pod first, held behind the benchmark's gate.
        stream::iter(scenario.gangs.iter())
            .map(|gang| contender::submit(client, ns, contender, gang))
            .buffer_unordered(BURST_PARALLELISM)
            .try_collect::<Vec<()>>()
            .await?;
        let pods = scenario.pods();
        muster_local_cluster::wait::until("every held pod to exist", Duration::from_secs(600), || async {
            Ok((recorder.timeline.lock().unwrap().pods.len() >= pods).then_some(()))
        })
        .await?;
    }
    let start = Instant::now();
    let start_wall = std::time::SystemTime::now();
    let created: HashMap<String, Instant> = stream::iter(scenario.gangs.iter())
        .map(|gang| async move {
            let at = Instant::now();
            if burst && contender.creates_pods() {
                contender::release(client, ns, gang).await?;
            } else {
                contender::submit(client, ns, contender, gang).await?;
            }
            Ok::<_, anyhow::Error>((gang.name.clone(), at))
        })
        .buffer_unordered(if burst { BURST_PARALLELISM } else { SUBMIT_PARALLELISM })
        .try_collect()
        .await?;
    let deadline = start + Duration::from_secs(scenario.timeout_seconds);
    let mut partial_since: HashMap<String, Instant> = HashMap::new();
    let mut partial = BTreeSet::new();
    let mut deleted = BTreeSet::new();
    let mut deletions = Vec::new();
    let mut stalled = false;
    let mut recovery = None;
    let wants_finish = scenario.gangs.iter().any(|g| g.run_for_seconds.is_some());
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = Instant::now();
        let (done, to_delete, last_progress) = {
            let timeline = recorder.timeline.lock().unwrap();
            let mut done = 0;
            let mut to_delete = Vec::new();
            for gang in &scenario.gangs {
                let held = timeline
                    .claims_of(&gang.name)
                    .filter(|c| c.allocated.is_some() && c.released.is_none())
                    .count();
                let finished = finished_pods(&timeline, gang) >= gang.pods;
                if held > 0 && held < gang.pods && !finished {
                    let since = *partial_since.entry(gang.name.clone()).or_insert(now);
                    if now - since >= PARTIAL_AFTER {
                        partial.insert(gang.name.clone());
                    }
                } else {
                    partial_since.remove(&gang.name);
                }
                let gang_done = if wants_finish {
                    finished
                } else {
                    running_pods(&timeline, gang) >= gang.pods
                };
                if gang_done {
                    done += 1;
                    if scenario.delete_finished && !deleted.contains(&gang.name) {
                        to_delete.push(gang.clone());
                    }
                }
            }
            (done, to_delete, timeline.last_progress)
        };
        for gang in to_delete {
            deleted.insert(gang.name.clone());
            let client = client.clone();
            let ns = ns.to_string();
            deletions.push(tokio::spawn(async move {
                contender::delete(&client, &ns, contender, &gang).await
            }));
        }
        if done == scenario.gangs.len() {
            if scenario.id == ScenarioId::S4 && recovery.is_none() {
                recovery = Some(fail_a_member(client, ns, contender, &scenario.gangs[0], recorder).await?);
            }
            break;
        }
        if now >= deadline {
            stalled = true;
            break;
        }
        if now.duration_since(last_progress) >= Duration::from_secs(scenario.stall_seconds) {
            stalled = true;
            break;
        }
    }
    for deletion in deletions {
        deletion.await??;
    }
    // A pod's Running can arrive on the pod watch before its claim's reservation on the
    // claim watch: the reservations are judged only once the claim watch has caught up.
    let early = recorder.timeline.lock().unwrap().unreserved_running();
    recorder.sync(client, ns).await?;
    let timeline = recorder.timeline.lock().unwrap().clone();
    if let (Some(early), Some(now)) = (early, timeline.unreserved_running()) {
        let late: Vec<&String> = early.iter().filter(|m| !now.contains(m)).collect();
        if !late.is_empty() {
            eprintln!("  reservations seen only once the claim watch caught up: {late:?}");
        }
    }
    Ok(Driven {
        timeline,
        start,
        start_wall,
        created,
        partial,
        stalled,
        recovery,
    })
}

/// Everything seen of an unreserved running pod (`pod/claim`) and its claim: the
/// recorder's states of the claim, and every write the audit log has of either, in
/// milliseconds after the phase's start. A reservation the API server served but the
/// watch never delivered is the recorder's fault; one never written is the scheduler's.
fn explain_unreserved(missing: &str, driven: &Driven, audited: &[crate::audit::Write]) -> String {
    let (pod, claim) = missing.split_once('/').unwrap_or((missing, ""));
    let mut out = format!(
        "  {missing} ran unreserved; the recorder saw:\n{}  the audit log has:\n",
        driven.timeline.explain(pod, claim, driven.start)
    );
    for write in audited.iter().filter(|w| w.name == pod || w.name == claim) {
        let ms = write
            .at
            .duration_since(driven.start_wall)
            .map_or_else(|e| -(e.duration().as_millis() as i128), |d| d.as_millis() as i128);
        out.push_str(&format!(
            "  {ms} ms {} {} {} {} -> {}\n",
            write.client.label(),
            write.verb,
            write.resource,
            write.name,
            write.code
        ));
    }
    out
}

fn running_pods(timeline: &Timeline, gang: &GangSpec) -> usize {
    timeline
        .pods_of(&gang.name)
        .filter(|p| p.running.is_some() && p.finished.is_none())
        .count()
}

fn finished_pods(timeline: &Timeline, gang: &GangSpec) -> usize {
    timeline
        .pods_of(&gang.name)
        .filter(|p| p.finished.is_some() && !p.failed)
        .count()
}

/// S4: one member of the running gang fails. muster restarts the gang itself; for the
/// others the benchmark acts as their controller and replaces the failed pod. Measures
/// the time until every member runs again and whether the gang got its devices back.
async fn fail_a_member(
    client: &kube::Client,
    ns: &str,
    contender: Contender,
    gang: &GangSpec,
    recorder: &Recorder,
) -> Result<Recovery> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let before = recorder.timeline.lock().unwrap().devices_held(&gang.name);
    let members = pods
        .list(&ListParams::default().labels(&format!("{}={}", contender::GANG_LABEL, gang.name)))
        .await?;
    let (victim, victim_uid) = members
        .items
        .iter()
        .filter_map(|p| Some((p.metadata.name.clone()?, p.metadata.uid.clone()?)))
        .max()
        .context("a member to fail")?;
    let failed_at = Instant::now();
    let exit = json!({"metadata": {"annotations": {"muster-e2e-exit": "1"}}});
    pods.patch(&victim, &PatchParams::default(), &Patch::Merge(&exit))
        .await?;
    // Recovery counts only once the failure has been seen.
    muster_local_cluster::wait::until("the member to fail", Duration::from_secs(60), || async {
        let timeline = recorder.timeline.lock().unwrap();
        Ok(timeline.pods.get(&victim_uid).and_then(|p| p.finished).map(|_| ()))
    })
    .await?;
    if contender.creates_pods() {
        replace_failed_pod(&pods, contender, gang, &victim).await?;
    }
    let deadline = failed_at + Duration::from_secs(180);
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (running, devices) = {
            let timeline = recorder.timeline.lock().unwrap();
            // Only pods bound after the failure, or bound before it and still running.
            (running_pods(&timeline, gang), timeline.devices_held(&gang.name))
        };
        if running >= gang.pods && devices.len() >= before.len() {
            return Ok(Recovery {
                seconds: Some(failed_at.elapsed().as_secs_f64()),
                same_devices: devices == before,
            });
        }
        if Instant::now() >= deadline {
            return Ok(Recovery {
                seconds: None,
                same_devices: false,
            });
        }
    }
}

/// Waits for `victim` to fail, deletes it and creates it again, as a Job-like controller
/// would for a gang of bare pods.
async fn replace_failed_pod(pods: &Api<Pod>, contender: Contender, gang: &GangSpec, victim: &str) -> Result<()> {
    muster_local_cluster::wait::until("the failed member", Duration::from_secs(60), || async {
        let pod = pods.get(victim).await?;
        Ok((pod.status.and_then(|s| s.phase).as_deref() == Some("Failed")).then_some(()))
    })
    .await?;
    pods.delete(victim, &Default::default()).await?;
    muster_local_cluster::wait::until("the failed member to go", Duration::from_secs(60), || async {
        Ok(pods.get_opt(victim).await?.is_none().then_some(()))
    })
    .await?;
    let index: usize = victim.rsplit('-').next().unwrap_or("0").parse()?;
    pods.create(&PostParams::default(), &contender::pod(contender, gang, index)?)
        .await?;
    Ok(())
}

/// Waits until the operator is ready and leads, as kube-scheduler already is when the
/// other contenders start.
async fn wait_leading(operator: &Operator) -> Result<()> {
    muster_local_cluster::wait::until("the operator to lead", Duration::from_secs(120), || async {
        let (code, body) = operator.get("/metrics").await?;
        let leading = code == 200 && body.lines().any(|l| l.trim() == "muster_leader 1");
        let ready = leading && matches!(operator.get("/readyz").await, Ok((200, _)));
        Ok(ready.then_some(()))
    })
    .await
}

/// Requests the operator made that change something, by verb and resource, from
/// `muster_api_requests_total`.
async fn operator_writes(operator: &Operator) -> Result<BTreeMap<String, f64>> {
    let (code, body) = operator.get("/metrics").await?;
    if code != 200 {
        bail!("the operator's metrics answered {code}");
    }
    let mut writes = BTreeMap::new();
    for (label, value) in cost::counters(&body, "muster_api_requests_total") {
        let verb = label("verb");
        if !matches!(verb, "create" | "update" | "patch" | "delete") {
            continue;
        }
        *writes.entry(format!("{verb} {}", label("resource"))).or_default() += value;
    }
    Ok(writes)
}

/// How many gangs the operator planned, and their mean plan time in seconds, from
/// `muster_plan_duration_seconds` (every outcome).
async fn operator_plans(operator: &Operator) -> Result<(f64, f64)> {
    let (code, body) = operator.get("/metrics").await?;
    if code != 200 {
        bail!("the operator's metrics answered {code}");
    }
    let total = |name: &str| cost::counters(&body, name).map(|(_, value)| value).sum::<f64>();
    let count = total("muster_plan_duration_seconds_count");
    let sum = total("muster_plan_duration_seconds_sum");
    Ok((count, if count > 0.0 { sum / count } else { 0.0 }))
}

/// Deletes the phase's namespace and waits until it is gone, so no claim of this phase
/// holds a device in the next.
async fn delete_namespace_and_wait(client: &kube::Client, ns: &str) -> Result<()> {
    muster_local_cluster::namespaces::delete_namespace(client, ns).await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    muster_local_cluster::wait::until(&format!("namespace {ns} to go"), Duration::from_secs(600), || async {
        Ok(namespaces.get_opt(ns).await?.is_none().then_some(()))
    })
    .await
}

fn seconds_since(base: Instant, at: Instant) -> f64 {
    at.saturating_duration_since(base).as_secs_f64()
}

/// The `n`-th earliest of `times` (1-based), once there are that many.
fn nth_earliest(mut times: Vec<Instant>, n: usize) -> Option<Instant> {
    if n == 0 || times.len() < n {
        return None;
    }
    times.sort();
    Some(times[n - 1])
}

fn summarize(
    scenario: &Scenario,
    contender: Contender,
    repeat: usize,
    driven: &Driven,
    racks: &HashMap<String, String>,
) -> PhaseResult {
    let (start, timeline) = (driven.start, &driven.timeline);
    let mut gangs = Vec::new();
    let mut last_done = start;
    let mut last_bound = start;
    for gang in &scenario.gangs {
        let created = driven.created.get(&gang.name).copied().unwrap_or(start);
        let pods: Vec<_> = timeline.pods_of(&gang.name).collect();
        let claims: Vec<_> = timeline.claims_of(&gang.name).collect();
        let all_claims = nth_earliest(claims.iter().filter_map(|c| c.allocated).collect(), gang.pods);
        let all_released = nth_earliest(pods.iter().filter_map(|p| p.released).collect(), gang.pods);
        let all_bound = nth_earliest(pods.iter().filter_map(|p| p.bound).collect(), gang.pods);
        let all_running = nth_earliest(pods.iter().filter_map(|p| p.running).collect(), gang.pods);
        let finished = nth_earliest(
            pods.iter().filter(|p| !p.failed).filter_map(|p| p.finished).collect(),
            gang.pods,
        )
        .filter(|_| gang.run_for_seconds.is_some());
        let done = if gang.run_for_seconds.is_some() {
            finished
        } else {
            all_running
        };
        if let Some(done) = done {
            last_done = last_done.max(done);
        }
        for bound in pods.iter().filter_map(|p| p.bound) {
            last_bound = last_bound.max(bound);
        }
        let in_one_rack = gang.same_rack.then(|| {
            pods.iter()
                .filter_map(|p| p.node.as_ref())
                .map(|n| racks.get(n))
                .collect::<BTreeSet<_>>()
                .len()
                <= 1
        });
        gangs.push(GangOutcome {
            name: gang.name.clone(),
            pods: gang.pods,
            created_at: seconds_since(start, created),
            all_claims: all_claims.map(|t| seconds_since(created, t)),
            all_released: all_released.map(|t| seconds_since(created, t)),
            all_bound: all_bound.map(|t| seconds_since(created, t)),
            all_running: all_running.map(|t| seconds_since(created, t)),
            finished: finished.map(|t| seconds_since(created, t)),
            in_one_rack,
            partial: driven.partial.contains(&gang.name),
        });
    }
    let makespan = seconds_since(start, last_done);
    let pods_bound = timeline.pods.values().filter(|p| p.bound.is_some()).count();
    let bound_span = seconds_since(start, last_bound);
    let gpus_by_gang: HashMap<&str, usize> = scenario.gangs.iter().map(|g| (g.name.as_str(), g.gpus)).collect();
    let gpu_seconds: f64 = timeline
        .pods
        .values()
        .filter_map(|p| {
            let running = p.running?;
            let end = p.finished.unwrap_or(last_done).min(last_done);
            Some(seconds_since(running, end) * *gpus_by_gang.get(p.gang.as_str())? as f64)
        })
        .sum();
    PhaseResult {
        scenario: scenario.id,
        contender,
        repeat,
        gangs,
        makespan,
        pods_bound,
        pods_per_second: if bound_span > 0.0 {
            pods_bound as f64 / bound_span
        } else {
            0.0
        },
        gpu_utilisation: if makespan > 0.0 {
            gpu_seconds / (scenario.gpus() as f64 * makespan)
        } else {
            0.0
        },
        stalled: driven.stalled,
        cpu_seconds: BTreeMap::new(),
        muster_peak_rss_mib: None,
        apiserver_writes: BTreeMap::new(),
        muster_writes: None,
        muster_writes_by_request: BTreeMap::new(),
        recovery: driven.recovery.clone(),
        writes: crate::audit::WriteCounts::default(),
        unreserved_running: Vec::new(),
        release_rate: window_rate(timeline.pods.values().filter_map(|p| p.released).collect()),
        bind_rate: window_rate(timeline.pods.values().filter_map(|p| p.bound).collect()),
        muster_plans: None,
    }
}

/// Events per second between the 10th and the 90th percentile of `times`.
fn window_rate(mut times: Vec<Instant>) -> Option<f64> {
    if times.len() < 10 {
        return None;
    }
    times.sort();
    let (low, high) = (times.len() / 10, times.len() * 9 / 10);
    let span = times[high].saturating_duration_since(times[low]).as_secs_f64();
    (span > 0.0).then(|| (high - low) as f64 / span)
}
