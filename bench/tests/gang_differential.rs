//! Gang-level fidelity against upstream: random small gangs on random small fleets,
//! each tried by upstream PodGroup gang scheduling and then by muster on the same
//! cluster state (same nodes, same devices taken by other pods first). Whenever upstream
//! places a gang, muster must place it too, and in one rack when the gang asks. Gangs
//! muster places and upstream does not (upstream does not backtrack across members'
//! device choices) are counted and printed, not failed.
//!
//! Some gangs keep one pod per node by anti-affinity; some give each pod a claim that
//! binds at the first consumer to one of the fleet's local volumes (a few per node, made
//! afresh before each try). A gang muster admits whose pods kube-scheduler then refuses
//! never counts as placed: its plan missed a constraint.
//!
//! `MUSTER_GANG_DIFF_SEED` and `MUSTER_GANG_DIFF_FLEETS` (four gangs per fleet) change
//! the seed and the size of the run.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use muster_bench::contender::{self, Contender, GANG_LABEL};
use muster_bench::spec::GangSpec;
use muster_e2e::rng::Rng;
use muster_e2e::storage::{local_volume, static_class};
use muster_local_cluster::fleet::FleetSpec;
use muster_local_cluster::namespaces::namespace;
use muster_local_cluster::operator::{Operator, muster_binary};
use muster_local_cluster::{ControlPlane, install_crds, wait};
use serde_json::json;

const DEFAULT_SEED: u64 = 0x6761_6e67_0000_0001;
/// The class of the fleet's local volumes, which bind at the first consumer.
const LOCAL_CLASS: &str = "gang-differential-local";
const VOLUME_LABEL: &str = "bench.muster.dev/gang-differential";
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
    gangs: Vec<Gang>,
    /// Local volumes per node, by node index.
    volumes: Vec<usize>,
}

/// A gang and the pod constraints it adds.
#[derive(Debug)]
struct Gang {
    spec: GangSpec,
    /// One pod per node, by anti-affinity on the hostname.
    one_per_node: bool,
    /// A claim per pod that binds at the first consumer to a local volume.
    volume: bool,
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
    let specs: Vec<GangSpec> = (0..GANGS_PER_FLEET)
        .map(|g| GangSpec {
            name: format!("f{index:02}-g{g}"),
            pods: rng.range(2, 4),
            gpus: (*rng.pick(&[1, 2, 4, 8])).min(fleet.gpus_per_node),
            same_rack: rng.next_u64().is_multiple_of(2),
            run_for_seconds: None,
            held: false,
        })
        .collect();
    // Pod constraints draw from their own generator: the fleets and gangs above stay
    // as they were for the same seed.
    let mut extra = Rng(rng.next_u64() ^ 0x636f_6e73_7472_6169);
    let volumes = (0..fleet.nodes).map(|_| extra.range(0, 2)).collect();
    let gangs = specs
        .into_iter()
        .map(|spec| Gang {
            spec,
            one_per_node: extra.chance(35),
            volume: extra.chance(35),
        })
        .collect();
    Case {
        fleet,
        blockers,
        gangs,
        volumes,
    }
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
    let classes: Api<StorageClass> = Api::all(client.clone());
    classes
        .create(
            &PostParams::default(),
            &static_class(LOCAL_CLASS, "WaitForFirstConsumer")?,
        )
        .await?;
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
    let mut constrained: BTreeMap<&str, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut muster_only = Vec::new();
    for index in 0..fleets {
        let mut rng = Rng(seed ^ (index as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let case = case(&mut rng, index);
        let racks = muster_bench::fleet::reset(&client, &case.fleet).await?;
        take_devices(&client, &ns, &case.blockers).await?;
        let nodes: Vec<String> = case.fleet.topology().into_iter().map(|t| t.name).collect();
        for gang in &case.gangs {
            let mut tries = 0;
            let mut fresh_volumes = || {
                tries += 1;
                let volumes = &case.volumes;
                let nodes = &nodes;
                let client = &client;
                async move { reset_volumes(client, nodes, volumes, tries).await }
            };
            if gang.volume {
                fresh_volumes().await?;
            }
            let upstream = run(&client, &ns, Contender::Upstream, gang, &racks).await?;
            if gang.volume {
                fresh_volumes().await?;
            }
            let muster = run(&client, &ns, Contender::Muster, gang, &racks).await?;
            *counts.entry((upstream, muster)).or_default() += 1;
            if gang.one_per_node {
                *constrained.entry("one pod per node").or_default() += 1;
            }
            if gang.volume {
                *constrained.entry("a local volume per pod").or_default() += 1;
            }
            let spec = &gang.spec;
            let what = format!(
                "seed {seed:#x} fleet {index}: {} nodes × {} GPUs in racks of {}, blockers {:?}, local volumes per node {:?}; gang {} of {} pods × {} GPUs{}{}{}",
                case.fleet.nodes,
                case.fleet.gpus_per_node,
                case.fleet.nodes_per_rack,
                case.blockers,
                case.volumes,
                spec.name,
                spec.pods,
                spec.gpus,
                if spec.same_rack { " in one rack" } else { "" },
                if gang.one_per_node { ", one per node" } else { "" },
                if gang.volume { ", a local volume each" } else { "" },
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
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    volumes
        .delete_collection(&DeleteParams::default(), &ListParams::default().labels(VOLUME_LABEL))
        .await?;
    classes.delete(LOCAL_CLASS, &DeleteParams::default()).await?;
    let cases: usize = counts.values().sum();
    eprintln!(
        "gang differential: seed {seed:#x}, {cases} gangs on {fleets} fleets (with pod constraints: {constrained:?}); (upstream, muster) verdicts: {counts:?}"
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

/// `spec`, a pod spec of `gang`, with the gang's pod constraints.
fn constrain(spec: &mut serde_json::Value, gang: &Gang) {
    if gang.one_per_node {
        spec["affinity"] = json!({"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": {GANG_LABEL: gang.spec.name}},
        }]}});
    }
    if gang.volume {
        spec["volumes"] = json!([{"name": "data", "ephemeral": {"volumeClaimTemplate": {"spec": {
            "storageClassName": LOCAL_CLASS,
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "10Gi"}},
        }}}}]);
    }
}

/// Creates what `contender` submits for `gang`, with its pod constraints.
async fn submit(client: &kube::Client, ns: &str, contender: Contender, gang: &Gang) -> Result<()> {
    let post = PostParams::default();
    match contender {
        Contender::Muster => {
            let mut workload = contender::workload(&gang.spec);
            constrain(&mut workload["spec"]["podGroups"][0]["template"]["spec"], gang);
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &contender::workload_resource());
            api.create(&post, &serde_json::from_value(workload)?).await?;
        }
        Contender::Upstream | Contender::Plain => {
            if contender == Contender::Upstream {
                let api: Api<DynamicObject> =
                    Api::namespaced_with(client.clone(), ns, &contender::pod_group_resource());
                api.create(&post, &serde_json::from_value(contender::pod_group(&gang.spec))?)
                    .await?;
            }
            let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
            for index in 0..gang.spec.pods {
                let mut pod = serde_json::to_value(contender::pod(contender, &gang.spec, index)?)?;
                constrain(&mut pod["spec"], gang);
                pods.create(&post, &serde_json::from_value(pod)?).await?;
            }
        }
    }
    Ok(())
}

/// Replaces the fleet's local volumes with fresh ones (`try_number` in their names): a
/// bound volume stays its claim's after the claim is gone.
async fn reset_volumes(client: &kube::Client, nodes: &[String], per_node: &[usize], try_number: usize) -> Result<()> {
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    volumes
        .delete_collection(&DeleteParams::default(), &ListParams::default().labels(VOLUME_LABEL))
        .await?;
    for (node, count) in nodes.iter().zip(per_node) {
        for i in 0..*count {
            let name = format!("local-{node}-{i}-t{try_number}-{}", std::process::id());
            let labels = json!({VOLUME_LABEL: "true"});
            let volume = local_volume(&name, LOCAL_CLASS, "100Gi", "kubernetes.io/hostname", node, labels)?;
            volumes.create(&PostParams::default(), &volume).await?;
        }
    }
    Ok(())
}

/// Submits `gang` for `contender`, waits for its verdict, checks the rack if placed, and
/// deletes it again, waiting until its claims are gone.
async fn run(
    client: &kube::Client,
    ns: &str,
    contender: Contender,
    gang: &Gang,
    racks: &std::collections::HashMap<String, String>,
) -> Result<Verdict> {
    submit(client, ns, contender, gang).await?;
    let spec = &gang.spec;
    let verdict = verdict(client, ns, contender, spec).await?;
    if verdict == Verdict::Placed && gang.one_per_node {
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        let members = pods
            .list(&ListParams::default().labels(&format!("{GANG_LABEL}={}", spec.name)))
            .await?
            .items;
        let nodes: BTreeSet<&String> = members
            .iter()
            .filter_map(|p| p.spec.as_ref()?.node_name.as_ref())
            .collect();
        ensure!(
            nodes.len() == members.len(),
            "{contender:?} placed {} with two pods on a node: {nodes:?}",
            spec.name
        );
    }
    let gang = spec;
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
    let volume_claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
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
            let volume_claims_left = volume_claims
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .any(|c| c.metadata.name.as_deref().is_some_and(|n| n.starts_with(&prefix)));
            Ok((!left && !pods_left && !volume_claims_left).then_some(()))
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
