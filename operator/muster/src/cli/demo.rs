//! `muster demo`: a local control plane with a fake GPU fleet, the operator, and an
//! example training gang, shown as it progresses.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, WatchEvent, WatchParams};
use muster_api::labels;
use muster_api::v1alpha1::Workload;
use muster_local_cluster::fleet::FleetSpec;
use muster_local_cluster::operator::Operator;
use muster_local_cluster::{ControlPlane, Options, apply, install_crds};

const EXAMPLE: &str = include_str!("../../../../examples/training-gang.yaml");
const EXAMPLE_NAME: &str = "llama-pretrain";
const NAMESPACE: &str = "demo";

/// Options of `muster demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Fake GPU nodes to create (8 GPUs each, 4 nodes per rack).
    #[arg(long, default_value_t = 16)]
    nodes: usize,
    /// Stop the cluster once the gang has progressed, instead of leaving it up.
    #[arg(long)]
    teardown: bool,
    /// How long to follow the gang before giving up.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

pub async fn run(args: DemoArgs) -> Result<()> {
    let started = Instant::now();
    println!("muster demo: starting a local control plane (etcd, kube-apiserver, kube-scheduler,");
    println!("kube-controller-manager, kwok). The first run builds it from the Kubernetes Go modules,");
    println!("which takes about 15-25 minutes on 2 cores; later runs reuse the cache.");
    let control_plane = ControlPlane::start(Options {
        keep_run_dir: !args.teardown,
        ..Options::default()
    })
    .await?;
    let client = control_plane.client().await?;
    println!(
        "[{:>6.1}s] control plane ready at {}",
        started.elapsed().as_secs_f64(),
        control_plane.server()
    );

    install_crds(&client).await?;
    let fleet = FleetSpec {
        nodes: args.nodes,
        nodes_per_rack: 4,
        ..FleetSpec::default()
    };
    let nodes = fleet.create(&client).await?;
    let racks = nodes
        .iter()
        .map(|n| n.rack.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    println!(
        "[{:>6.1}s] {} fake nodes in {racks} racks, {} GPUs each, published as DRA ResourceSlices",
        started.elapsed().as_secs_f64(),
        nodes.len(),
        fleet.gpus_per_node
    );

    let binary = std::env::current_exe().context("locating the muster binary")?;
    let log_dir = control_plane.run_dir().join("logs");
    let operator = Operator::start_binary(&binary, control_plane.kubeconfig(), &log_dir, &[], &[])?;
    println!(
        "[{:>6.1}s] operator running (log: {})",
        started.elapsed().as_secs_f64(),
        operator.log_path().display()
    );

    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns = serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}});
    namespaces
        .patch(NAMESPACE, &PatchParams::apply("muster-demo"), &Patch::Apply(&ns))
        .await?;
    // Watch from before the apply, so that every status write shows even when the gang
    // is admitted and running before the first event arrives.
    let workloads: Api<Workload> = Api::namespaced(client.clone(), NAMESPACE);
    let watched_from = workloads
        .list_metadata(&ListParams::default().fields(&example_field()))
        .await?
        .metadata
        .resource_version
        .context("the Workload list carries no resourceVersion")?;
    let applied = apply::apply_yaml(&client, NAMESPACE, EXAMPLE, "muster-demo").await?;
    println!(
        "[{:>6.1}s] applied examples/training-gang.yaml: {}",
        started.elapsed().as_secs_f64(),
        applied.join(", ")
    );

    follow(&client, started, args.timeout, watched_from).await?;

    if args.teardown {
        operator.stop();
        control_plane.stop();
        println!("cluster stopped");
        return Ok(());
    }
    let kubectl = muster_local_cluster::paths::control_plane_binaries()?.join("kubectl");
    println!();
    println!("The cluster stays up until you press Ctrl-C. Try:");
    println!("  export KUBECONFIG={}", control_plane.kubeconfig().display());
    println!("  {} get workloads,pods -n {NAMESPACE}", kubectl.display());
    println!(
        "  {} describe workload {EXAMPLE_NAME} -n {NAMESPACE}",
        kubectl.display()
    );
    tokio::signal::ctrl_c().await?;
    operator.stop();
    control_plane.stop();
    Ok(())
}

fn example_field() -> String {
    format!("metadata.name={EXAMPLE_NAME}")
}

/// Prints the gang's state each time it changes (every status write since
/// `resource_version`, as watched), until it runs.
async fn follow(
    client: &kube::Client,
    started: Instant,
    timeout: Duration,
    mut resource_version: String,
) -> Result<()> {
    let workloads: Api<Workload> = Api::namespaced(client.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let selector = ListParams::default().labels(&format!("{}={EXAMPLE_NAME}", labels::WORKLOAD));
    let params = WatchParams::default().fields(&example_field()).timeout(60);
    let deadline = tokio::time::Instant::now() + timeout;
    let late = || anyhow::anyhow!("the gang did not run within {timeout:?}");
    let watch_from = |version: String| {
        let (workloads, params) = (workloads.clone(), params.clone());
        async move {
            let events = tokio::time::timeout_at(deadline, workloads.watch(&params, &version))
                .await
                .map_err(|_| late())??;
            anyhow::Ok(events.boxed())
        }
    };
    let mut events = watch_from(resource_version.clone()).await?;
    let mut last = String::new();
    loop {
        let next = tokio::time::timeout_at(deadline, events.next())
            .await
            .map_err(|_| late())?;
        let workload = match next {
            // The server closes a watch after its timeout: go on from the last event.
            None => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                events = watch_from(resource_version.clone()).await?;
                continue;
            }
            Some(Err(e)) => {
                eprintln!("watching the Workload: {e}; watching again");
                tokio::time::sleep(Duration::from_secs(1)).await;
                events = watch_from(resource_version.clone()).await?;
                continue;
            }
            Some(Ok(WatchEvent::Added(w) | WatchEvent::Modified(w))) => w,
            Some(Ok(WatchEvent::Bookmark(b))) => {
                resource_version = b.metadata.resource_version;
                continue;
            }
            Some(Ok(WatchEvent::Deleted(_))) => anyhow::bail!("the Workload was deleted"),
            // Too old to resume from: start again from the Workload as it is now.
            Some(Ok(WatchEvent::Error(e))) if e.code == 410 => {
                let now = workloads.get(EXAMPLE_NAME).await?;
                events = watch_from(now.metadata.resource_version.clone().unwrap_or_default()).await?;
                now
            }
            Some(Ok(WatchEvent::Error(e))) => anyhow::bail!("watching the Workload: {e}"),
        };
        if let Some(version) = &workload.metadata.resource_version {
            resource_version.clone_from(version);
        }
        let status = workload.status.clone().unwrap_or_default();
        let admitted = status
            .conditions
            .iter()
            .find(|c| c.type_ == muster_api::conditions::ADMITTED);
        let line = format!(
            "{:<9} {:<12} {}/{} pods ready",
            status.phase.map(|p| format!("{p:?}")).unwrap_or_else(|| "-".into()),
            admitted.map(|c| c.reason.as_str()).unwrap_or("-"),
            status.ready_pods,
            status.pods,
        );
        if line != last {
            println!("[{:>6.1}s] {EXAMPLE_NAME}: {line}", started.elapsed().as_secs_f64());
            if let Some(c) = admitted {
                println!("          {}", c.message);
            }
            last = line;
        }
        if status.phase == Some(muster_api::v1alpha1::WorkloadPhase::Running) {
            if let Some(placement) = &status.placement {
                println!(
                    "The gang runs: {} devices reserved on {} nodes{}, every claim allocated before any pod started.",
                    placement.devices,
                    placement.nodes.len(),
                    placement
                        .topology_value
                        .as_ref()
                        .map(|v| format!(" in rack {v}"))
                        .unwrap_or_default()
                );
                let bound: BTreeMap<String, String> = pods
                    .list(&selector)
                    .await?
                    .items
                    .into_iter()
                    .filter_map(|p| Some((p.metadata.name?, p.spec?.node_name?)))
                    .collect();
                for planned in &placement.pods {
                    let node = bound.get(&planned.name).map(String::as_str).unwrap_or("(not bound)");
                    println!("  {:<32} planned on {:<12} runs on {node}", planned.name, planned.node);
                }
            }
            return Ok(());
        }
    }
}
