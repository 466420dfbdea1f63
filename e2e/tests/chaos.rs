//! Chaos on 32 nodes for at least three minutes, with the invariant checker on: gangs
//! of two priorities — bound to a rack, elastic (pods beyond minCount), sharing a
//! user's claim (with each other and with pods outside muster), with a member that
//! fails, or that finish — are created, deleted, suspended and resumed, their pods
//! deleted, while the operator is killed (SIGKILL) and started again every half minute.
//! Once the chaos stops and the cluster settles: every gang that holds devices holds
//! all of its claims and runs, every queued or suspended gang holds nothing, no claim
//! of a deleted Workload is allocated, and no device is in two claims.
//!
//! Seeded: `MUSTER_CHAOS_SEED` replays a run's choices (not its timing); a failure
//! names the seed. `MUSTER_CHAOS_SECONDS` sets the chaos' length (at least 180).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use muster_api::labels;
use muster_api::v1alpha1::{AdmissionState, Workload};
use muster_e2e::rng::Rng;
use muster_e2e::scenario::{
    HIGH, LOW, Test, gang, outside_user, priority_classes, ranked, sharing_claim, terminating_for, user_claim,
};
use muster_e2e::testing::{exclusive, shared_cluster};
use muster_local_cluster::fleet::FleetSpec;
use serde_json::{Value, json};

/// Workloads alive at once, at most.
const MAX_LIVE: usize = 14;
/// User claims the gangs of the shared kind share.
const SHARED_CLAIMS: usize = 3;
/// How long the cluster may take to settle once the chaos stops.
const SETTLE: Duration = Duration::from_secs(180);
/// How often the operator is killed.
const KILL_EVERY: Duration = Duration::from_secs(30);

#[tokio::test]
async fn gangs_keep_their_invariants_through_deletions_suspends_and_operator_kills() -> Result<()> {
    let seed: u64 = match std::env::var("MUSTER_CHAOS_SEED") {
        Ok(seed) => seed.parse().context("MUSTER_CHAOS_SEED")?,
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos() as u64,
    };
    let seconds: u64 = std::env::var("MUSTER_CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(180)
        .max(180);
    eprintln!("chaos seed {seed}, {seconds} s");
    let started = Instant::now();
    let outcome = run(seed, Duration::from_secs(seconds)).await;
    eprintln!("chaos took {:.0} s in all", started.elapsed().as_secs_f64());
    outcome.with_context(|| format!("chaos with seed {seed} (MUSTER_CHAOS_SEED={seed} replays its choices)"))
}

async fn run(seed: u64, length: Duration) -> Result<()> {
    let _serial = exclusive().await;
    let fleet = FleetSpec {
        nodes: 32,
        nodes_per_rack: 4,
        racks_per_block: 2,
        ..FleetSpec::default()
    }
    .fenced();
    let cluster = shared_cluster(fleet).await?;
    let args = ["--schedule-timeout", "20"];
    let mut test = Test::start_on(cluster, "chaos", &args, &[]).await?;
    let mut log = Vec::new();
    let body = chaos(&mut test, seed, length, &args, &mut log).await;
    let cleanup = test.finish().await;
    let tail: Vec<&String> = log
        .iter()
        .rev()
        .take(60)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    body.and(cleanup).map_err(|e| {
        let tail: Vec<&str> = tail.iter().map(|s| s.as_str()).collect();
        e.context(format!("the last actions:\n{}", tail.join("\n")))
    })
}

/// The kinds of gangs the chaos makes.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// One to three workers held to one rack by a node selector.
    RackBound,
    /// Four workers of which two must start together; the others start when they fit.
    Elastic,
    /// Its launcher shares one of the user's claims (a device on one node).
    SharedClaim,
    /// A member fails as soon as it runs: the gang restarts once, then fails.
    FailingMember,
    /// Its launcher succeeds after a while, and the gang finishes.
    Finishing,
}

const KINDS: [Kind; 5] = [
    Kind::RackBound,
    Kind::Elastic,
    Kind::SharedClaim,
    Kind::FailingMember,
    Kind::Finishing,
];

fn rack(rng: &mut Rng) -> String {
    format!("rack-{:04}", rng.below(8))
}

fn workload(rng: &mut Rng, kind: Kind, name: &str) -> Value {
    let mut w = match kind {
        Kind::RackBound => gang(name, rng.range(1, 3) as i32, Some(&rack(rng))),
        Kind::Elastic => {
            let mut w = gang(name, 4, None);
            w["spec"]["podGroups"][1]["minCount"] = json!(2);
            w
        }
        Kind::SharedClaim => {
            let claim = format!("shared-{}", rng.below(SHARED_CLAIMS));
            sharing_claim(gang(name, rng.range(1, 2) as i32, None), "launcher", &claim)
        }
        Kind::FailingMember => {
            let mut w = gang(name, rng.range(1, 2) as i32, None);
            w["spec"]["failurePolicy"] = json!({"maxRestarts": 1});
            w["spec"]["podGroups"][0]["template"]["metadata"] = json!({"annotations": {"muster-e2e-exit": "1"}});
            w
        }
        Kind::Finishing => {
            let mut w = gang(name, rng.range(1, 2) as i32, None);
            let seconds = rng.range(20, 90);
            w["spec"]["podGroups"][0]["template"]["metadata"] =
                json!({"annotations": {"muster-e2e-run-for": format!("{seconds}s")}});
            w["spec"]["successPolicy"] = json!({"podGroups": ["launcher"]});
            w
        }
    };
    if rng.chance(30) {
        w = terminating_for(w, 5);
    }
    let class = if rng.chance(30) { HIGH } else { LOW };
    ranked(w, class)
}

async fn chaos(test: &mut Test, seed: u64, length: Duration, args: &[&str], log: &mut Vec<String>) -> Result<()> {
    let mut rng = Rng::for_case(seed, 0);
    priority_classes(&test.client).await?;
    for k in 0..SHARED_CLAIMS {
        test.claims()
            .create(&PostParams::default(), &user_claim(&format!("shared-{k}"), 1)?)
            .await?;
    }
    let started = Instant::now();
    let mut last_kill = Instant::now();
    let mut made = 0;
    let mut outsiders = 0;
    let mut note = |what: String| log.push(format!("{:>6.1}s {what}", started.elapsed().as_secs_f64()));
    while started.elapsed() < length {
        tokio::time::sleep(Duration::from_millis(rng.range(500, 2500) as u64)).await;
        if last_kill.elapsed() >= KILL_EVERY {
            if let Some(operator) = test.operator.take() {
                operator.kill();
            }
            test.start_operator(args, &[])?;
            last_kill = Instant::now();
            note("killed the operator (SIGKILL) and started it again".into());
            continue;
        }
        let live = live_workloads(test).await?;
        match rng.weighted(&[35, 12, 16, 8, 5]) {
            0 if live.len() < MAX_LIVE => {
                let kind = *rng.pick(&KINDS);
                let name = format!("g{made}");
                made += 1;
                test.create(workload(&mut rng, kind, &name)).await?;
                note(format!("created {name} ({kind:?})"));
            }
            1 if !live.is_empty() => {
                let name = rng.pick(&live).clone();
                test.workloads().delete(&name, &DeleteParams::default()).await?;
                note(format!("deleted {name}"));
            }
            2 if !live.is_empty() => {
                let name = rng.pick(&live).clone();
                let suspended = test.workloads().get(&name).await?.spec.suspend == Some(true);
                let patch = json!({"spec": {"suspend": !suspended}});
                test.workloads()
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
                note(format!("set suspend={} on {name}", !suspended));
            }
            3 => {
                let pods = test
                    .pods()
                    .list(&ListParams::default().labels(labels::WORKLOAD))
                    .await?
                    .items;
                let running: Vec<String> = pods
                    .iter()
                    .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
                    .filter_map(|p| p.metadata.name.clone())
                    .collect();
                if !running.is_empty() {
                    let name = rng.pick(&running).clone();
                    test.pods().delete(&name, &DeleteParams::default()).await?;
                    note(format!("deleted pod {name}"));
                }
            }
            4 => {
                let name = format!("outsider-{outsiders}");
                outsiders += 1;
                let claim = format!("shared-{}", rng.below(SHARED_CLAIMS));
                test.pods()
                    .create(&PostParams::default(), &outside_user(&name, &claim)?)
                    .await?;
                note(format!("outsider {name} uses {claim}"));
            }
            _ => {}
        }
    }
    note("the chaos stops".into());
    // Pods outside muster go: the claims they shared are collected.
    for k in 0..outsiders {
        let _ = test
            .pods()
            .delete(&format!("outsider-{k}"), &DeleteParams::default())
            .await;
    }
    if test.operator.is_none() {
        test.start_operator(args, &[])?;
    }
    let settled = settle(test).await;
    note(format!("settled: {settled:?}"));
    let rested = settled?;
    let problems = end_state(test).await?;
    ensure!(problems.is_empty(), "after the chaos settled: {problems:#?}");
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for line in log.iter() {
        let action = line.split_whitespace().nth(1).unwrap_or_default().to_string();
        *counts.entry(action).or_default() += 1;
    }
    eprintln!(
        "chaos: {made} gangs made; actions {counts:?}; at rest: {}",
        rested.into_iter().collect::<Vec<_>>().join(", ")
    );
    Ok(())
}

/// Workloads not being deleted.
async fn live_workloads(test: &Test) -> Result<Vec<String>> {
    Ok(test
        .workloads()
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|w| w.metadata.deletion_timestamp.is_none())
        .filter_map(|w| w.metadata.name)
        .collect())
}

/// Where each gang stands, if it is at rest: queued, suspended, running or finished
/// (a gang on its way somewhere is not).
fn at_rest(workload: &Workload, pods: &[Pod]) -> Option<String> {
    let name = workload.metadata.name.clone().unwrap_or_default();
    if workload.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let placement = workload.status.as_ref().and_then(|s| s.placement.as_ref());
    match placement.and_then(|p| p.state) {
        None => Some(format!("{name} queued")),
        Some(AdmissionState::Finished) => Some(format!("{name} finished")),
        Some(AdmissionState::Released) => {
            let running = placement
                .into_iter()
                .flat_map(|p| &p.pods)
                .filter(|p| !p.extra)
                .all(|planned| {
                    pods.iter().any(|p| {
                        p.metadata.name.as_deref() == Some(planned.name.as_str())
                            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    })
                });
            running.then(|| format!("{name} running"))
        }
        Some(_) => None,
    }
}

/// Waits until every gang has been at rest, unchanged, for ten seconds; returns where
/// each stands.
async fn settle(test: &Test) -> Result<BTreeSet<String>> {
    let deadline = Instant::now() + SETTLE;
    let mut stable_since: Option<(Instant, BTreeSet<String>)> = None;
    loop {
        let workloads = test.workloads().list(&ListParams::default()).await?.items;
        let pods = test
            .pods()
            .list(&ListParams::default().labels(labels::WORKLOAD))
            .await?
            .items;
        let states: Vec<Option<String>> = workloads.iter().map(|w| at_rest(w, &pods)).collect();
        if states.iter().all(Option::is_some) {
            let now: BTreeSet<String> = states.into_iter().flatten().collect();
            match &stable_since {
                Some((since, seen)) if *seen == now => {
                    if since.elapsed() >= Duration::from_secs(10) {
                        return Ok(now);
                    }
                }
                _ => stable_since = Some((Instant::now(), now)),
            }
        } else {
            stable_since = None;
        }
        if Instant::now() > deadline {
            let moving: Vec<String> = workloads
                .iter()
                .filter(|w| at_rest(w, &pods).is_none())
                .map(|w| {
                    let status = w.status.clone().unwrap_or_default();
                    format!(
                        "{} deleting={} state={:?} phase={:?} conditions={:?}",
                        w.metadata.name.clone().unwrap_or_default(),
                        w.metadata.deletion_timestamp.is_some(),
                        status.placement.and_then(|p| p.state),
                        status.phase,
                        status
                            .conditions
                            .iter()
                            .map(|c| format!("{}={} {}: {}", c.type_, c.status, c.reason, c.message))
                            .collect::<Vec<_>>()
                    )
                })
                .collect();
            anyhow::bail!("the cluster did not settle within {SETTLE:?}: {moving:#?}");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// What must hold once the chaos settled.
async fn end_state(test: &Test) -> Result<Vec<String>> {
    let workloads = test.workloads().list(&ListParams::default()).await?.items;
    let claims = test.claims().list(&ListParams::default()).await?.items;
    let pods = test.pods().list(&ListParams::default()).await?.items;
    let mut problems = Vec::new();
    let allocated = |name: &str| {
        claims
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name))
            .is_some_and(|c| c.status.as_ref().is_some_and(|s| s.allocation.is_some()))
    };
    let live_pods: BTreeSet<String> = pods
        .iter()
        .filter(|p| {
            !matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            )
        })
        .filter_map(|p| p.metadata.uid.clone())
        .collect();
    // Claims some placement names: their gangs hold them.
    let named: BTreeSet<&str> = workloads
        .iter()
        .filter_map(|w| w.status.as_ref()?.placement.as_ref())
        .filter(|p| p.state != Some(AdmissionState::Finished))
        .flat_map(|p| p.claims.iter().map(String::as_str))
        .collect();
    let uids: BTreeMap<String, String> = workloads
        .iter()
        .filter_map(|w| Some((w.metadata.uid.clone()?, w.metadata.name.clone()?)))
        .collect();
    for w in &workloads {
        let name = w.metadata.name.clone().unwrap_or_default();
        let placement = w.status.as_ref().and_then(|s| s.placement.as_ref());
        let suspended = w.spec.suspend == Some(true);
        match placement.and_then(|p| p.state) {
            Some(AdmissionState::Released) => {
                // It holds every claim of its placement, and runs.
                for claim in placement.into_iter().flat_map(|p| &p.claims) {
                    if !allocated(claim) {
                        problems.push(format!("running gang {name} does not hold its claim {claim}"));
                    }
                }
                if suspended {
                    problems.push(format!("suspended gang {name} is still released"));
                }
            }
            None => {
                // A queued or suspended gang holds nothing of its own.
                let uid = w.metadata.uid.clone().unwrap_or_default();
                for claim in &claims {
                    let own = claim.metadata.owner_references.iter().flatten().any(|o| o.uid == uid);
                    let claim_name = claim.metadata.name.clone().unwrap_or_default();
                    if own && allocated(&claim_name) {
                        let how = if suspended { "suspended" } else { "queued" };
                        problems.push(format!("{how} gang {name} holds {claim_name}"));
                    }
                }
            }
            _ => {}
        }
    }
    for claim in &claims {
        let name = claim.metadata.name.clone().unwrap_or_default();
        let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
            continue;
        };
        // No claim of a deleted Workload is allocated (a user's claim a pod or another
        // gang still uses aside).
        let owner_gone = claim
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.kind == "Workload" && !uids.contains_key(&o.uid));
        let label_gone = claim
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(labels::WORKLOAD))
            .is_some_and(|w| !workloads.iter().any(|x| x.metadata.name.as_deref() == Some(w.as_str())));
        let used = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.as_ref())
            .is_some_and(|r| r.iter().any(|c| live_pods.contains(&c.uid)));
        if (owner_gone || label_gone) && !named.contains(name.as_str()) && !used {
            let devices = allocation
                .devices
                .as_ref()
                .and_then(|d| d.results.as_ref())
                .map_or(0, Vec::len);
            problems.push(format!(
                "claim {name} of a deleted Workload is still allocated ({devices} devices)"
            ));
        }
    }
    // No device is in two claims.
    let mut holders: BTreeMap<(String, String, String), String> = BTreeMap::new();
    for claim in &claims {
        let name = claim.metadata.name.clone().unwrap_or_default();
        let results = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.clone())
            .unwrap_or_default();
        for r in results
            .iter()
            .filter(|r| r.admin_access != Some(true) && r.share_id.is_none())
        {
            let device = (r.driver.clone(), r.pool.clone(), r.device.clone());
            if let Some(other) = holders.insert(device.clone(), name.clone()) {
                problems.push(format!("device {device:?} is in {other} and {name}"));
            }
        }
    }
    Ok(problems)
}
