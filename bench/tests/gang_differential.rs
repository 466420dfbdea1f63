//! Gang-level fidelity against upstream: random small gangs on random small fleets,
//! each tried by upstream PodGroup gang scheduling and then by muster on the same
//! cluster state (same nodes, same devices taken by other pods first). Whenever upstream
//! places a gang, muster must place it too, and in one rack when the gang asks. Gangs
//! muster places and upstream does not (upstream does not backtrack across members'
//! device choices) are counted and printed, not failed.
//!
//! `MUSTER_GANG_DIFF_SEED` and `MUSTER_GANG_DIFF_FLEETS` (four gangs per fleet) change
//! the seed and the size of the run.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use muster_bench::contender::{self, Contender, GANG_LABEL};
use muster_bench::spec::GangSpec;
use muster_e2e::rng::Rng;
use muster_local_cluster::fleet::FleetSpec;
use muster_local_cluster::namespaces::namespace;
use muster_local_cluster::operator::{Operator, muster_binary};
use muster_local_cluster::{ControlPlane, install_crds, wait};
use serde_json::json;

const DEFAULT_SEED: u64 = 0x6761_6e67_0000_0001;
const DEFAULT_FLEETS: usize = 6;
const GANGS_PER_FLEET: usize = 4;
/// How long either scheduler may take to place a gang or say it cannot.
const VERDICT_TIMEOUT: Duration = Duration::from_secs(45);

/// A fleet, the devices other pods take first, and the gangs tried on it.
#[derive(Debug)]
struct Case {
    fleet: FleetSpec,
    /// GPUs each blocker pod takes.
    blockers: Vec<usize>,
    gangs: Vec<GangSpec>,
}

fn case(rng: &mut Rng, index: usize) -> Case {
    let nodes = rng.range(2, 5);
    let fleet = FleetSpec {
        nodes,
        nodes_per_rack: rng.range(1, 3),
        gpus_per_node: *rng.pick(&[2, 4, 8]),
        parallelism: 8,
        ..FleetSpec::default()
    };
    let blockers = (0..rng.range(0, 3))
        .map(|_| rng.range(1, fleet.gpus_per_node))
        .collect();
    let gangs = (0..GANGS_PER_FLEET)
        .map(|g| GangSpec {
            name: format!("f{index:02}-g{g}"),
            pods: rng.range(2, 4),
            gpus: (*rng.pick(&[1, 2, 4, 8])).min(fleet.gpus_per_node),
            same_rack: rng.next_u64().is_multiple_of(2),
            run_for_seconds: None,
            held: false,
        })
        .collect();
    Case { fleet, blockers, gangs }
}

/// What a scheduler did with a gang.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Verdict {
    Placed,
    NotPlaced,
    /// Neither placed nor refused in time.
    Undecided,
}

fn env_number(name: &str) -> Result<Option<u64>> {
    let Ok(text) = std::env::var(name) else { return Ok(None) };
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    };
    Ok(Some(parsed.with_context(|| format!("{name}={text} is not a number"))?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn whenever_upstream_places_a_gang_muster_does_too() -> Result<()> {
    let seed = env_number("MUSTER_GANG_DIFF_SEED")?.unwrap_or(DEFAULT_SEED);
    let fleets = env_number("MUSTER_GANG_DIFF_FLEETS")?.map_or(DEFAULT_FLEETS, |n| n as usize);
    let control_plane = ControlPlane::start(muster_bench::control_plane_options(false)).await?;
    let client = control_plane.client().await?;
    install_crds(&client).await?;
    let logs = control_plane.run_dir().join("logs").join("gang-differential");
    let operator = Operator::start_binary(
        &muster_binary()?,
        control_plane.kubeconfig(),
        &logs,
        &["--fencing=none"],
        &[],
    )?;
    let ns = namespace(&client, "gang-differential").await?;
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), &ns);
    for gpus in [1, 2, 3, 4, 5, 6, 7, 8] {
        templates
            .create(
                &PostParams::default(),
                &serde_json::from_value(contender::claim_template(gpus))?,
            )
            .await?;
    }

    let mut counts: BTreeMap<(Verdict, Verdict), usize> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut muster_only = Vec::new();
    for index in 0..fleets {
        let mut rng = Rng(seed ^ (index as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let case = case(&mut rng, index);
        let racks = muster_bench::fleet::reset(&client, &case.fleet).await?;
        take_devices(&client, &ns, &case.blockers).await?;
        for gang in &case.gangs {
            let upstream = run(&client, &ns, Contender::Upstream, gang, &racks).await?;
            let muster = run(&client, &ns, Contender::Muster, gang, &racks).await?;
            *counts.entry((upstream, muster)).or_default() += 1;
            let what = format!(
                "seed {seed:#x} fleet {index}: {} nodes × {} GPUs in racks of {}, blockers {:?}; gang {} of {} pods × {} GPUs{}",
                case.fleet.nodes,
                case.fleet.gpus_per_node,
                case.fleet.nodes_per_rack,
                case.blockers,
                gang.name,
                gang.pods,
                gang.gpus,
                if gang.same_rack { " in one rack" } else { "" }
            );
            match (upstream, muster) {
                (Verdict::Placed, Verdict::Placed) | (Verdict::NotPlaced, Verdict::NotPlaced) => {}
                (Verdict::Placed, _) => failures.push(format!("upstream placed, muster {muster:?}: {what}")),
                (_, Verdict::Placed) => muster_only.push(format!("muster placed, upstream {upstream:?}: {what}")),
                _ => failures.push(format!("upstream {upstream:?}, muster {muster:?}: {what}")),
            }
        }
        delete_pods(&client, &ns).await?;
    }
    operator.stop();
    let cases: usize = counts.values().sum();
    eprintln!(
        "gang differential: seed {seed:#x}, {cases} gangs on {fleets} fleets; (upstream, muster) verdicts: {counts:?}"
    );
    for line in &muster_only {
        eprintln!("  {line}");
    }
    control_plane.stop();
    if !failures.is_empty() {
        bail!("{} of {cases} gangs disagree:\n{}", failures.len(), failures.join("\n"));
    }
    ensure!(
        counts.get(&(Verdict::Placed, Verdict::Placed)).copied().unwrap_or(0) > 0,
        "no gang was placed by both: the cases test nothing"
    );
    Ok(())
}

/// Plain pods that take `gpus` GPUs each, bound by kube-scheduler before the gangs come.
async fn take_devices(client: &kube::Client, ns: &str, blockers: &[usize]) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    for (i, gpus) in blockers.iter().enumerate() {
        let pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": format!("blocker-{i}")},
            "spec": {
                "terminationGracePeriodSeconds": 0,
                "containers": [{"name": "main", "image": "other", "resources": {"claims": [{"name": "gpus"}]}}],
                "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": contender::template_name(*gpus)}],
            },
        });
        pods.create(&PostParams::default(), &serde_json::from_value(pod)?)
            .await?;
    }
    wait::until("the blockers to be bound", Duration::from_secs(60), || async {
        let bound = pods
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
            .count();
        Ok((bound == blockers.len()).then_some(()))
    })
    .await
}

/// Submits `gang` for `contender`, waits for its verdict, checks the rack if placed, and
/// deletes it again, waiting until its claims are gone.
async fn run(
    client: &kube::Client,
    ns: &str,
    contender: Contender,
    gang: &GangSpec,
    racks: &std::collections::HashMap<String, String>,
) -> Result<Verdict> {
    contender::submit(client, ns, contender, gang).await?;
    let verdict = verdict(client, ns, contender, gang).await?;
    if verdict == Verdict::Placed && gang.same_rack {
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        let placed: BTreeSet<&String> = pods
            .list(&ListParams::default().labels(&format!("{GANG_LABEL}={}", gang.name)))
            .await?
            .items
            .iter()
            .filter_map(|p| p.spec.as_ref()?.node_name.as_ref())
            .filter_map(|n| racks.get(n))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        ensure!(
            placed.len() == 1,
            "{contender:?} placed {} across racks {placed:?}",
            gang.name
        );
    }
    contender::delete(client, ns, contender, gang).await?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
    let prefix = format!("{}-", gang.name);
    wait::until(
        &format!("{}'s claims to go", gang.name),
        Duration::from_secs(120),
        || async {
            let left = claims
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .any(|c| c.metadata.name.as_deref().is_some_and(|n| n.starts_with(&prefix)));
            let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
            let pods_left = !pods
                .list(&ListParams::default().labels(&format!("{GANG_LABEL}={}", gang.name)))
                .await?
                .items
                .is_empty();
            Ok((!left && !pods_left).then_some(()))
        },
    )
    .await?;
    if contender == Contender::Muster {
        let workloads: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &contender::workload_resource());
        wait::until(
            &format!("Workload {} to go", gang.name),
            Duration::from_secs(60),
            || async { Ok(workloads.get_opt(&gang.name).await?.is_none().then_some(())) },
        )
        .await?;
    }
    Ok(verdict)
}

/// Placed: every pod bound. Not placed: upstream marked a pod unschedulable, or muster
/// said the gang does not fit.
async fn verdict(client: &kube::Client, ns: &str, contender: Contender, gang: &GangSpec) -> Result<Verdict> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let workloads: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &contender::workload_resource());
    let decided = wait::until(&format!("a verdict on {}", gang.name), VERDICT_TIMEOUT, || async {
        let members = pods
            .list(&ListParams::default().labels(&format!("{GANG_LABEL}={}", gang.name)))
            .await?
            .items;
        let bound = members
            .iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
            .count();
        if bound == gang.pods {
            return Ok(Some(Verdict::Placed));
        }
        let refused = match contender {
            Contender::Muster => workloads.get_opt(&gang.name).await?.is_some_and(|w| {
                w.data["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Admitted" && c["status"] == "False" && c["reason"] == "Unschedulable")
            }),
            _ => members.iter().any(|p| {
                p.status.as_ref().and_then(|s| s.conditions.as_ref()).is_some_and(|c| {
                    c.iter().any(|c| {
                        c.type_ == "PodScheduled" && c.status == "False" && c.reason.as_deref() == Some("Unschedulable")
                    })
                })
            }),
        };
        Ok(refused.then_some(Verdict::NotPlaced))
    })
    .await;
    Ok(decided.unwrap_or(Verdict::Undecided))
}

/// Deletes every pod of the namespace (the blockers) and waits for their claims to go.
async fn delete_pods(client: &kube::Client, ns: &str) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    pods.delete_collection(&DeleteParams::default(), &ListParams::default())
        .await?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
    wait::until_none_left("the blockers' claims to go", Duration::from_secs(120), &claims).await
}
