//! The recording: a local control plane with a fake GPU fleet and muster, a mix of
//! gangs run on it for a few minutes while `/metrics` is scraped every few seconds.
//!
//! The mix has what an operator's dashboard should show: gangs that run and finish,
//! a gang that waits because it cannot fit, two teams of different PriorityClasses so
//! that production gangs preempt batch ones, a gang whose member keeps failing so that
//! it restarts, and gangs deleted while they run or wait. It is drawn from a seed, so
//! a run can be repeated.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use muster_local_cluster::fleet::{FleetSpec, RACK_LABEL};
use muster_local_cluster::operator::{Operator, http_get};
use muster_local_cluster::{ControlPlane, Options as ClusterOptions, install_crds, wait};
use serde_json::{Value, json};

use crate::contender::{RUN_FOR_ANNOTATION, claim_template, template_name, workload_resource};
use crate::dashboard::recording::{Recording, Scrape};

/// Label on every pod of a gang of the mix, naming its Workload.
const GANG_LABEL: &str = "dashboard.muster.dev/gang";
/// Annotation of the kwok stage that ends a running pod with an exit code.
const EXIT_ANNOTATION: &str = "muster-e2e-exit";
/// GPUs per claim the gangs use.
const CLAIM_SIZES: [u32; 3] = [2, 4, 8];

/// The PriorityClasses of the mix: research's batch work and production training.
const BATCH: &str = "batch";
const PRODUCTION: &str = "production";

const RESEARCH: &str = "research";
const TRAINING: &str = "training";
const SANDBOX: &str = "sandbox";
const NAMESPACES: [&str; 3] = [RESEARCH, TRAINING, SANDBOX];

pub struct Options {
    /// How long the mix runs.
    pub duration: Duration,
    pub scrape_interval: Duration,
    pub muster_binary: PathBuf,
    pub seed: u64,
    /// Keep the control plane's run directory (every component's log).
    pub keep_logs: bool,
}

/// A gang of the mix: `workers` pods of `gpus` GPUs each.
#[derive(Clone, Debug, PartialEq)]
pub struct Gang {
    pub namespace: &'static str,
    pub name: String,
    pub workers: u32,
    pub gpus: u32,
    pub class: &'static str,
    /// Each pod succeeds this long after it starts; `None`: it runs until deleted.
    pub run_for: Option<u32>,
    /// All workers in one rack.
    pub same_rack: bool,
    pub max_restarts: i32,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    Submit(Gang),
    Delete {
        namespace: &'static str,
        name: String,
    },
    /// One running pod of the gang fails, as if its trainer crashed.
    FailMember {
        namespace: &'static str,
        name: String,
    },
}

/// What happens when, in seconds from the start, for a mix of `seconds` (at least two
/// minutes). The fleet has 128 GPUs in four racks of 32.
pub fn schedule(seconds: u32, seed: u64) -> Vec<(u32, Action)> {
    let seconds = seconds.max(120);
    let mut rng = fastrand::Rng::with_seed(seed);
    let gang = |namespace, name: &str, workers, gpus, class, run_for| Gang {
        namespace,
        name: name.to_string(),
        workers,
        gpus,
        class,
        run_for,
        same_rack: workers * gpus >= 16,
        max_restarts: 3,
    };
    let mut actions = vec![
        // Research fills most of the fleet with batch work at once.
        (
            0,
            Action::Submit(gang(RESEARCH, "pretrain-a", 4, 8, BATCH, Some(seconds * 3 / 5))),
        ),
        (
            0,
            Action::Submit(gang(RESEARCH, "pretrain-b", 4, 8, BATCH, Some(seconds / 2))),
        ),
        (
            2,
            Action::Submit(gang(RESEARCH, "finetune-a", 2, 8, BATCH, Some(seconds / 3))),
        ),
        // 48 GPUs in one rack of 32: never fits, waits until it is deleted.
        (10, Action::Submit(gang(RESEARCH, "sweep-xl", 6, 8, BATCH, None))),
        (
            seconds * 3 / 4,
            Action::Delete {
                namespace: RESEARCH,
                name: "sweep-xl".into(),
            },
        ),
        // Production arrives on a full fleet and preempts batch gangs.
        (
            seconds / 5,
            Action::Submit(gang(TRAINING, "llm-sft", 4, 8, PRODUCTION, Some(seconds / 3))),
        ),
        (
            seconds / 2,
            Action::Submit(gang(TRAINING, "llm-rlhf", 3, 8, PRODUCTION, Some(seconds / 4))),
        ),
    ];
    // A gang whose member crashes now and then: each failure restarts the gang.
    let mut flaky = gang(SANDBOX, "flaky", 2, 4, BATCH, None);
    flaky.max_restarts = 100;
    actions.push((1, Action::Submit(flaky)));
    let mut at = 45;
    while at < seconds - 15 {
        actions.push((
            at,
            Action::FailMember {
                namespace: SANDBOX,
                name: "flaky".into(),
            },
        ));
        at += rng.u32(50..=80);
    }
    // A steady arrival of smaller gangs from both teams; some are cancelled.
    let mut at = 20;
    let mut index = 0;
    while at < seconds.saturating_sub(40) {
        index += 1;
        let production = rng.u32(0..=9) < 4;
        let (namespace, class, prefix) = if production {
            (TRAINING, PRODUCTION, "train")
        } else {
            (RESEARCH, BATCH, "sweep")
        };
        let name = format!("{prefix}-{index}");
        let gpus = CLAIM_SIZES[rng.u32(0..=2) as usize];
        let arrival = gang(namespace, &name, rng.u32(1..=4), gpus, class, Some(rng.u32(60..=180)));
        actions.push((at, Action::Submit(arrival)));
        let cancelled_at = at + rng.u32(20..=60);
        if !production && index % 4 == 0 && cancelled_at < seconds {
            actions.push((cancelled_at, Action::Delete { namespace, name }));
        }
        at += rng.u32(12..=28);
    }
    actions.sort_by_key(|(at, _)| *at);
    actions
}

/// The Workload of `gang`.
pub fn workload(gang: &Gang) -> Value {
    let mut annotations = serde_json::Map::new();
    if let Some(seconds) = gang.run_for {
        annotations.insert(RUN_FOR_ANNOTATION.into(), json!(format!("{seconds}s")));
    }
    let mut spec = json!({
        "priorityClassName": gang.class,
        "failurePolicy": {"maxRestarts": gang.max_restarts},
        "ttlSecondsAfterFinished": 60,
        "podGroups": [{
            "name": "workers",
            "replicas": gang.workers,
            "template": {
                "metadata": {"labels": {GANG_LABEL: gang.name}, "annotations": annotations},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 0,
                    "containers": [{
                        "name": "trainer",
                        "image": "trainer",
                        "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "claims": [{"name": "gpus"}]},
                    }],
                    "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template_name(gang.gpus as usize)}],
                },
            },
        }],
    });
    if gang.same_rack {
        spec["topology"] = json!({"required": RACK_LABEL});
    }
    json!({
        "apiVersion": "muster.dev/v1alpha1",
        "kind": "Workload",
        "metadata": {"name": gang.name, "namespace": gang.namespace},
        "spec": spec,
    })
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Starts the cluster and muster, runs the mix, and returns the scrapes.
pub async fn record(options: &Options, progress: impl Fn(&str)) -> Result<Recording> {
    let control_plane = ControlPlane::start(ClusterOptions {
        keep_run_dir: options.keep_logs,
        ..ClusterOptions::default()
    })
    .await?;
    progress(&format!(
        "control plane up; logs in {}",
        control_plane.run_dir().display()
    ));
    let client = control_plane.client().await?;
    install_crds(&client).await?;
    let fleet = FleetSpec {
        nodes: 16,
        nodes_per_rack: 4,
        ..FleetSpec::default()
    };
    crate::fleet::reset(&client, &fleet).await?;
    prepare(&client).await?;
    let mut operator = Operator::start_binary(
        &options.muster_binary,
        control_plane.kubeconfig(),
        &control_plane.run_dir().join("logs"),
        &[],
        &[],
    )?;
    let address = operator.http;
    wait::until("muster to serve /metrics", Duration::from_secs(60), || async move {
        Ok(matches!(http_get(&address.to_string(), "/metrics").await, Ok((200, _))).then_some(()))
    })
    .await?;
    progress(&format!(
        "muster running; {} of gangs, scraping every {:?}",
        humanize(options.duration),
        options.scrape_interval
    ));

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (scrapes, driven) = tokio::join!(scrape_until(address, options.scrape_interval, stopped), async {
        let driven = drive(&client, &mut operator, options, &progress).await;
        let _ = stop.send(());
        driven
    });
    operator.stop();
    control_plane.stop();
    driven?;
    Ok(Recording {
        scrape_interval_ms: options.scrape_interval.as_millis() as i64,
        scrapes,
    })
}

fn humanize(duration: Duration) -> String {
    let seconds = duration.as_secs();
    if seconds.is_multiple_of(60) {
        format!("{} min", seconds / 60)
    } else {
        format!("{seconds} s")
    }
}

/// PriorityClasses, namespaces and claim templates.
async fn prepare(client: &kube::Client) -> Result<()> {
    let classes: Api<PriorityClass> = Api::all(client.clone());
    for (name, value) in [(BATCH, 100), (PRODUCTION, 1000)] {
        let class: PriorityClass = serde_json::from_value(json!({
            "metadata": {"name": name},
            "value": value,
            "preemptionPolicy": "PreemptLowerPriority",
        }))?;
        classes.create(&PostParams::default(), &class).await?;
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for namespace in NAMESPACES {
        let object: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}}))?;
        namespaces.create(&PostParams::default(), &object).await?;
        let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
        wait::until("a namespace's default ServiceAccount", Duration::from_secs(60), || {
            let accounts = accounts.clone();
            async move { Ok(accounts.get_opt("default").await?.map(|_| ())) }
        })
        .await?;
        let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), namespace);
        for gpus in CLAIM_SIZES {
            templates
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(claim_template(gpus as usize))?,
                )
                .await?;
        }
    }
    Ok(())
}

/// Scrapes `/metrics` every `every` until `stop` fires.
async fn scrape_until(
    address: SocketAddr,
    every: Duration,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Vec<Scrape> {
    let mut scrapes = Vec::new();
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = &mut stop => return scrapes,
            _ = ticks.tick() => {
                let at_ms = now_ms();
                let page = match tokio::time::timeout(every, http_get(&address.to_string(), "/metrics")).await {
                    Ok(Ok((200, body))) => Some(body),
                    _ => None,
                };
                scrapes.push(Scrape { at_ms, page });
            }
        }
    }
}

/// Runs the schedule against the cluster for the whole duration.
async fn drive(
    client: &kube::Client,
    operator: &mut Operator,
    options: &Options,
    progress: &impl Fn(&str),
) -> Result<()> {
    let seconds = options.duration.as_secs() as u32;
    let mut actions = schedule(seconds, options.seed).into_iter().peekable();
    let started = Instant::now();
    let mut reported = 0;
    while started.elapsed() < options.duration {
        let now = started.elapsed().as_secs() as u32;
        while let Some((at, _)) = actions.peek()
            && *at <= now
        {
            let (at, action) = actions.next().context("a peeked action")?;
            let note = perform(client, &action).await?;
            progress(&format!("  {at:>4} s  {note}"));
        }
        operator
            .check_running()
            .context("muster stopped during the recording")?;
        if now >= reported + 60 {
            reported = now;
            progress(&format!("  {now:>4} s  workloads: {}", phases(client).await?));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

async fn perform(client: &kube::Client, action: &Action) -> Result<String> {
    match action {
        Action::Submit(gang) => {
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), gang.namespace, &workload_resource());
            api.create(&PostParams::default(), &serde_json::from_value(workload(gang))?)
                .await
                .with_context(|| format!("creating {}/{}", gang.namespace, gang.name))?;
            Ok(format!(
                "submitted {}/{}: {} x {} GPUs, {}",
                gang.namespace, gang.name, gang.workers, gang.gpus, gang.class
            ))
        }
        Action::Delete { namespace, name } => {
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &workload_resource());
            match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => Ok(format!("deleted {namespace}/{name}")),
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(format!("{namespace}/{name} was gone already")),
                Err(e) => Err(e.into()),
            }
        }
        Action::FailMember { namespace, name } => {
            let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
            let running = pods
                .list(&ListParams::default().labels(&format!("{GANG_LABEL}={name}")))
                .await?
                .items
                .into_iter()
                .find(|p| {
                    p.metadata.deletion_timestamp.is_none()
                        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                });
            let Some(pod) = running else {
                return Ok(format!("{namespace}/{name} has no running pod to fail"));
            };
            let pod_name = pod.metadata.name.context("a pod without a name")?;
            let patch = json!({"metadata": {"annotations": {EXIT_ANNOTATION: "1"}}});
            pods.patch(&pod_name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            Ok(format!("failed pod {namespace}/{pod_name}"))
        }
    }
}

/// Workloads by phase, for the progress lines.
async fn phases(client: &kube::Client) -> Result<String> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &workload_resource());
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for workload in api.list(&ListParams::default()).await? {
        let phase = workload.data["status"]["phase"].as_str().unwrap_or("New").to_string();
        *counts.entry(phase).or_default() += 1;
    }
    if counts.is_empty() {
        return Ok("none".into());
    }
    Ok(counts
        .iter()
        .map(|(phase, n)| format!("{n} {phase}"))
        .collect::<Vec<_>>()
        .join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_has_every_kind_of_event_within_its_time() {
        let actions = schedule(480, 7);
        assert!(actions.iter().all(|(at, _)| *at < 480));
        assert!(actions.windows(2).all(|w| w[0].0 <= w[1].0));
        let submitted: Vec<&Gang> = actions
            .iter()
            .filter_map(|(_, a)| match a {
                Action::Submit(g) => Some(g),
                _ => None,
            })
            .collect();
        let mut names: Vec<_> = submitted.iter().map(|g| (g.namespace, g.name.as_str())).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), submitted.len(), "gang names are unique");
        assert!(submitted.iter().any(|g| g.class == BATCH));
        assert!(submitted.iter().any(|g| g.class == PRODUCTION));
        // One gang cannot fit in a rack of 32 GPUs.
        assert!(submitted.iter().any(|g| g.same_rack && g.workers * g.gpus > 32));
        let count = |f: fn(&Action) -> bool| actions.iter().filter(|(_, a)| f(a)).count();
        assert!(count(|a| matches!(a, Action::Delete { .. })) >= 2);
        assert!(count(|a| matches!(a, Action::FailMember { .. })) >= 4);
        // Every deletion and failure names a gang submitted before it.
        for (at, action) in &actions {
            if let Action::Delete { namespace, name } | Action::FailMember { namespace, name } = action {
                assert!(
                    actions.iter().any(|(before, a)| before < at
                        && matches!(a, Action::Submit(g) if g.namespace == *namespace && g.name == *name)),
                    "{name} at {at}"
                );
            }
        }
        assert_eq!(schedule(480, 7), actions, "the same seed gives the same mix");
    }

    #[test]
    fn a_gang_s_workload_carries_its_class_size_and_topology() {
        let gang = Gang {
            namespace: TRAINING,
            name: "g".into(),
            workers: 3,
            gpus: 8,
            class: PRODUCTION,
            run_for: Some(90),
            same_rack: true,
            max_restarts: 3,
        };
        let w = workload(&gang);
        assert_eq!(w["spec"]["priorityClassName"], PRODUCTION);
        assert_eq!(w["spec"]["podGroups"][0]["replicas"], 3);
        assert_eq!(w["spec"]["topology"]["required"], RACK_LABEL);
        let template = &w["spec"]["podGroups"][0]["template"];
        assert_eq!(template["metadata"]["annotations"][RUN_FOR_ANNOTATION], "90s");
        assert_eq!(
            template["spec"]["resourceClaims"][0]["resourceClaimTemplateName"],
            "gpus-8"
        );
    }
}
