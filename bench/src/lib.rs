//! The benchmark: muster, upstream PodGroup gang scheduling and plain kube-scheduler,
//! one after another on the same local control plane and fleet, with a Markdown report.

pub mod contender;
pub mod cost;
pub mod dashboard;
pub mod fleet;
pub mod phase;
pub mod plot;
pub mod report;
pub mod spec;
pub mod stats;
pub mod timeline;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use muster_local_cluster::{ControlPlane, Options, install_crds};

use crate::contender::Contender;
use crate::phase::Stage;
use crate::report::Run;
use crate::spec::{ScenarioId, Size, scenario};

/// What to run.
#[derive(Clone, Debug)]
pub struct Config {
    pub size: Size,
    pub scenarios: Vec<ScenarioId>,
    pub contenders: Vec<Contender>,
    pub repeats: usize,
    pub muster_binary: PathBuf,
    /// Keep the control plane's run directory (logs of every component and operator).
    pub keep_logs: bool,
}

/// The control plane with upstream gang scheduling switched on: the Workload API, its
/// topology constraints, and the beta scheduling API that serves PodGroups.
pub fn control_plane_options(keep_logs: bool) -> Options {
    Options {
        feature_gates: vec![
            "GenericWorkload=true".into(),
            "TopologyAwareWorkloadScheduling=true".into(),
        ],
        runtime_config: vec!["scheduling.k8s.io/v1beta1=true".into()],
        keep_run_dir: keep_logs,
    }
}

/// Runs every scenario of `config`: per scenario a fresh fleet, then each repeat runs
/// the contenders in order, the next repeat in the reverse order.
pub async fn run(config: &Config, progress: impl Fn(&str)) -> Result<Run> {
    let control_plane = ControlPlane::start(control_plane_options(config.keep_logs)).await?;
    progress(&format!(
        "control plane up; logs in {}",
        control_plane.run_dir().display()
    ));
    let client = control_plane.client().await?;
    install_crds(&client).await?;
    warm_up(&client).await?;
    let components = control_plane.pids();
    let log_dir = control_plane.run_dir().join("logs");
    let mut scenarios = Vec::new();
    let mut results = Vec::new();
    for id in &config.scenarios {
        let scenario = scenario(*id, config.size);
        progress(&format!(
            "{}: {} nodes, {} gangs, {} pods",
            id.title(),
            scenario.fleet.nodes,
            scenario.gangs.len(),
            scenario.pods()
        ));
        let racks = fleet::reset(&client, &scenario.fleet).await?;
        let stage = Stage {
            client: &client,
            kubeconfig: control_plane.kubeconfig(),
            log_dir: &log_dir,
            muster_binary: &config.muster_binary,
            components: &components,
            racks: &racks,
        };
        for repeat in 0..config.repeats {
            let mut order = config.contenders.clone();
            if repeat % 2 == 1 {
                order.reverse();
            }
            for contender in order {
                let began = std::time::Instant::now();
                let result = phase::run(&stage, &scenario, contender, repeat).await?;
                progress(&format!(
                    "  {} #{}: {} of {} gangs admitted, makespan {:.1} s, {:.1} pods/s, {} partial{} ({:.0} s with setup and teardown)",
                    contender.label(),
                    repeat + 1,
                    result.admitted(),
                    result.gangs.len(),
                    result.makespan,
                    result.pods_per_second,
                    result.partial(),
                    if result.stalled { ", stalled" } else { "" },
                    began.elapsed().as_secs_f64(),
                ));
                if std::env::var_os("MUSTER_BENCH_TRACE").is_some() {
                    for gang in &result.gangs {
                        progress(&format!("    {gang:?}"));
                    }
                    progress(&format!("    writes: {:?}", result.apiserver_writes));
                    progress(&format!("    muster's writes: {:?}", result.muster_writes_by_request));
                    progress(&format!("    cpu: {:?}", result.cpu_seconds));
                }
                results.push(result);
            }
        }
        scenarios.push(scenario);
    }
    control_plane.stop();
    Ok(Run {
        machine: machine(),
        date: today(),
        repeats: config.repeats,
        scenarios,
        results,
    })
}

/// Creates one object of every kind a contender submits, and deletes them: the API
/// server's first write of a custom resource takes seconds, which no contender should pay.
async fn warm_up(client: &kube::Client) -> Result<()> {
    let ns = muster_local_cluster::namespaces::namespace(client, "bench-warm-up").await?;
    let gang = spec::GangSpec {
        name: "warm-up".into(),
        pods: 1,
        gpus: 1,
        same_rack: false,
        run_for_seconds: None,
    };
    let post = kube::api::PostParams::default();
    let mut workload = contender::workload(&gang);
    // No operator runs yet; suspended, it would not run anyway.
    workload["spec"]["suspend"] = serde_json::json!(true);
    let workloads: kube::Api<kube::api::DynamicObject> =
        kube::Api::namespaced_with(client.clone(), &ns, &contender::workload_resource());
    workloads.create(&post, &serde_json::from_value(workload)?).await?;
    let groups: kube::Api<kube::api::DynamicObject> =
        kube::Api::namespaced_with(client.clone(), &ns, &contender::pod_group_resource());
    groups
        .create(&post, &serde_json::from_value(contender::pod_group(&gang))?)
        .await?;
    muster_local_cluster::namespaces::delete_namespace(client, &ns).await
}

/// The CPU model, core count and memory of this machine.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string())
        .unwrap_or_else(|| "an unknown CPU".into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let memory_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map(|kib| kib / 1024.0 / 1024.0)
        .unwrap_or(0.0);
    format!("{model}, {cores} cores, {memory_gib:.0} GiB")
}

fn today() -> String {
    std::process::Command::new("date")
        .arg("+%Y-%m-%d")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|d| d.trim().to_string())
        .unwrap_or_default()
}

/// Builds the release `muster` binary of this workspace and returns its path.
pub fn build_release_muster() -> Result<PathBuf> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let status = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "-p", "muster"])
        .current_dir(&workspace)
        .status()
        .context("running cargo build --release -p muster")?;
    if !status.success() {
        bail!("cargo build --release -p muster failed");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace.join("target"));
    Ok(target.join("release").join("muster"))
}
