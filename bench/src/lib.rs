//! The benchmark: muster, upstream PodGroup gang scheduling and plain kube-scheduler,
//! one after another on the same local control plane and fleet, with a Markdown report.

pub mod audit;
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
    /// Before a scenario's measured phases, run each contender once, unmeasured, on a
    /// few of its gangs: a contender's first phase pays for cold caches and connections.
    pub warm_up: bool,
}

/// The contenders of repeat `repeat`: the order rotates by one each repeat (ABC, BCA,
/// CAB, ABC...), so each contender runs first, second and last equally often.
pub fn order(contenders: &[Contender], repeat: usize) -> Vec<Contender> {
    let mut order = contenders.to_vec();
    if !order.is_empty() {
        let n = order.len();
        order.rotate_left(repeat % n);
    }
    order
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
        audit: true,
    }
}

/// Runs every scenario of `config`: per scenario a fresh fleet, an unmeasured warm-up
/// phase per contender, then each repeat runs the contenders in a rotated order.
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
    let audit_log = control_plane.audit_log();
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
            audit_log: &audit_log,
        };
        if config.warm_up {
            let few = spec::warm_up(&scenario);
            for contender in &config.contenders {
                let began = std::time::Instant::now();
                phase::run(&stage, &few, *contender, 0).await?;
                progress(&format!(
                    "  {} warm-up ({:.0} s, not measured)",
                    contender.label(),
                    began.elapsed().as_secs_f64()
                ));
            }
        }
        for repeat in 0..config.repeats {
            for contender in order(&config.contenders, repeat) {
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
                    progress(&format!(
                        "    last create → all Running: {:?} s; muster's plans (count, mean s): {:?}",
                        result.last_create_to_all_running(),
                        result.muster_plans
                    ));
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
        held: false,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_contender_runs_first_second_and_last_equally_often() {
        let all = Contender::ALL;
        let orders: Vec<Vec<Contender>> = (0..6).map(|r| order(&all, r)).collect();
        assert_eq!(orders[0], all);
        assert_eq!(orders[1], [all[1], all[2], all[0]]);
        assert_eq!(orders[2], [all[2], all[0], all[1]]);
        assert_eq!(orders[3], orders[0]);
        for position in 0..3 {
            for contender in all {
                let times = orders.iter().filter(|o| o[position] == contender).count();
                assert_eq!(times, 2, "{contender:?} at {position}");
            }
        }
    }
}
