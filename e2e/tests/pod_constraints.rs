//! Gangs whose pods carry what kube-scheduler checks besides devices: volumes, inter-pod
//! anti-affinity, topology spread and host ports. muster plans with them, so the pods it
//! releases are bound where it planned them; an invariant checker runs beside each test.
//!
//! The volumes are static PersistentVolumes with node affinity and classes without a
//! provisioner (kwok mounts nothing: binding is all there is to it); each worker gets its
//! own claim through a generic ephemeral volume, which kube-controller-manager creates
//! when muster creates the pod.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::{LimitRange, Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::resource::v1::{ResourceClaimTemplate, ResourceSlice};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use muster_api::v1alpha1::WorkloadPhase;
use muster_e2e::scenario::{Test, with_test};
use muster_e2e::storage::{local_volume, static_class};
use muster_local_cluster::fleet::{FleetSpec, NodeTopology, RACK_LABEL, ZONE_LABEL, create_or_keep};
use muster_local_cluster::wait;
use serde_json::{Value, json};

const HOSTNAME: &str = "kubernetes.io/hostname";

/// A gang of one group of `workers` pods with one GPU each and `spec` merged into their
/// template's spec (and `labels` into its labels).
fn workers(name: &str, workers: i32, labels: Value, spec: Value) -> Value {
    let mut template_spec = json!({
        "containers": [{
            "name": "main",
            "image": "trainer",
            "resources": {"requests": {"cpu": "1"}, "claims": [{"name": "gpu"}]},
        }],
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
    });
    for (key, value) in spec.as_object().cloned().unwrap_or_default() {
        if key == "ports" {
            template_spec["containers"][0]["ports"] = value;
        } else {
            template_spec[key] = value;
        }
    }
    json!({
        "apiVersion": "muster.dev/v1alpha1",
        "kind": "Workload",
        "metadata": {"name": name},
        "spec": {"podGroups": [{
            "name": "workers",
            "replicas": workers,
            "template": {"metadata": {"labels": labels}, "spec": template_spec},
        }]},
    })
}

async fn one_gpu_template(test: &Test) -> Result<()> {
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(test.client.clone(), &test.ns);
    templates
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "one-gpu"},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}}},
            }))?,
        )
        .await?;
    Ok(())
}

/// Pod name → node of the gang's bound pods.
async fn nodes_of(test: &Test, name: &str) -> Result<BTreeMap<String, String>> {
    test.gang_pods(name)
        .await?
        .into_iter()
        .map(|p: Pod| {
            let node = p
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .context("a bound pod")?;
            Ok((p.metadata.name.unwrap_or_default(), node))
        })
        .collect()
}

async fn label_of(test: &Test, node: &str, key: &str) -> Result<String> {
    let nodes: Api<Node> = Api::all(test.client.clone());
    let node = nodes.get(node).await?;
    Ok(node
        .metadata
        .labels
        .unwrap_or_default()
        .get(key)
        .cloned()
        .unwrap_or_default())
}

/// A StorageClass without a provisioner, named after the test's namespace.
async fn storage_class(test: &Test, suffix: &str, mode: &str) -> Result<String> {
    let name = format!("{}-{suffix}", test.ns);
    let classes: Api<StorageClass> = Api::all(test.client.clone());
    classes
        .create(&PostParams::default(), &static_class(&name, mode)?)
        .await?;
    Ok(name)
}

/// A 100Gi volume of `class` that nodes with `key=value` reach, labelled with the test.
async fn volume(test: &Test, name: &str, class: &str, key: &str, value: &str, zone: Option<&str>) -> Result<()> {
    let volumes: Api<PersistentVolume> = Api::all(test.client.clone());
    let mut labels = json!({"e2e.muster.dev/test": test.ns});
    if let Some(zone) = zone {
        labels[ZONE_LABEL] = json!(zone);
    }
    volumes
        .create(
            &PostParams::default(),
            &local_volume(name, class, "100Gi", key, value, labels)?,
        )
        .await?;
    Ok(())
}

/// Deletes the test's volumes and its StorageClasses.
async fn remove_storage(test: &Test, classes: &[&str]) -> Result<()> {
    let volumes: Api<PersistentVolume> = Api::all(test.client.clone());
    volumes
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(&format!("e2e.muster.dev/test={}", test.ns)),
        )
        .await?;
    let storage: Api<StorageClass> = Api::all(test.client.clone());
    for class in classes {
        storage.delete(class, &DeleteParams::default()).await?;
    }
    Ok(())
}

/// An ephemeral volume `data` of `class`: one claim per pod.
fn data_volume(class: &str) -> Value {
    json!([{"name": "data", "ephemeral": {"volumeClaimTemplate": {"spec": {
        "storageClassName": class,
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "10Gi"}},
    }}}}])
}

/// Two GPU nodes of their own in zone `zone` (rack and block of their own too), fenced
/// like the fleet's.
async fn zone_nodes(test: &Test, zone: &str) -> Result<Vec<String>> {
    let fleet = FleetSpec::default().fenced();
    let nodes: Api<Node> = Api::all(test.client.clone());
    let slices: Api<ResourceSlice> = Api::all(test.client.clone());
    let mut names = Vec::new();
    for i in 0..2 {
        let topology = NodeTopology {
            name: format!("{zone}-{i}"),
            zone: zone.into(),
            block: format!("block-{zone}"),
            rack: format!("rack-{zone}"),
        };
        create_or_keep(&nodes, &fleet.node(&topology)?).await?;
        create_or_keep(&slices, &fleet.resource_slice(&topology)?).await?;
        names.push(topology.name);
    }
    Ok(names)
}

#[tokio::test]
async fn claims_bound_to_zonal_volumes_take_the_gang_to_their_zone() -> Result<()> {
    with_test("zonal-volumes", &[], &[], |test| {
        Box::pin(async move {
            one_gpu_template(test).await?;
            let zone_nodes = zone_nodes(test, "zone-pv").await?;
            // Claims bind at once, to the volumes of zone-pv.
            let class = storage_class(test, "zonal", "Immediate").await?;
            for i in 0..2 {
                volume(
                    test,
                    &format!("{}-zonal-{i}", test.ns),
                    &class,
                    ZONE_LABEL,
                    "zone-pv",
                    Some("zone-pv"),
                )
                .await?;
            }
            test.create(workers("zonal", 2, json!({}), json!({"volumes": data_volume(&class)})))
                .await?;
            test.wait_phase("zonal", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            let placed = nodes_of(test, "zonal").await?;
            for node in placed.values() {
                ensure!(zone_nodes.contains(node), "a worker left zone-pv: {placed:?}");
            }
            let result = async {
                let claims: Api<PersistentVolumeClaim> = Api::namespaced(test.client.clone(), &test.ns);
                for pod in placed.keys() {
                    let claim = claims.get(&format!("{pod}-data")).await?;
                    let volume = claim.spec.and_then(|s| s.volume_name).unwrap_or_default();
                    ensure!(volume.contains("-zonal-"), "{pod}'s claim is bound to {volume:?}");
                }
                Ok(())
            }
            .await;
            test.workloads().delete("zonal", &DeleteParams::default()).await?;
            test.wait_claims_gone().await?;
            remove_storage(test, &[&class]).await?;
            result
        })
    })
    .await
}

#[tokio::test]
async fn claims_that_bind_at_the_first_pod_get_the_planned_nodes_volumes() -> Result<()> {
    with_test("local-volumes", &[], &[], |test| {
        Box::pin(async move {
            one_gpu_template(test).await?;
            // Local disks on two nodes of the fleet only.
            let class = storage_class(test, "local", "WaitForFirstConsumer").await?;
            let disks = ["node-00005", "node-00006"];
            for node in disks {
                volume(test, &format!("{}-local-{node}", test.ns), &class, HOSTNAME, node, None).await?;
            }
            // Eight GPUs each: one worker per node.
            let mut gang = workers("local", 2, json!({}), json!({"volumes": data_volume(&class)}));
            gang["spec"]["podGroups"][0]["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] =
                json!("eight-gpus");
            test.create(gang).await?;
            test.wait_phase("local", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            let placed = nodes_of(test, "local").await?;
            let used: BTreeSet<&str> = placed.values().map(String::as_str).collect();
            ensure!(
                used == BTreeSet::from(disks),
                "workers not on the nodes with disks: {placed:?}"
            );
            // kube-scheduler bound each claim to the disk of the pod's node.
            let claims: Api<PersistentVolumeClaim> = Api::namespaced(test.client.clone(), &test.ns);
            let result = wait::until(
                "the claims to be bound on the planned nodes",
                Duration::from_secs(60),
                || {
                    let (claims, placed) = (claims.clone(), placed.clone());
                    async move {
                        for (pod, node) in &placed {
                            let claim = claims.get(&format!("{pod}-data")).await?;
                            let volume = claim.spec.and_then(|s| s.volume_name).unwrap_or_default();
                            if !volume.ends_with(node.as_str()) {
                                return Ok(None);
                            }
                        }
                        Ok(Some(()))
                    }
                },
            )
            .await;
            test.workloads().delete("local", &DeleteParams::default()).await?;
            test.wait_claims_gone().await?;
            remove_storage(test, &[&class]).await?;
            result
        })
    })
    .await
}

/// Anti-affinity on the hostname against the gang's own label.
fn one_per_node(app: &str) -> Value {
    json!({"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": HOSTNAME, "labelSelector": {"matchLabels": {"app": app}}},
    ]}})
}

#[tokio::test]
async fn one_worker_per_node_by_anti_affinity() -> Result<()> {
    with_test("anti-affinity", &[], &[], |test| {
        Box::pin(async move {
            one_gpu_template(test).await?;
            // One GPU each would pack onto one node; anti-affinity spreads them.
            let gang = workers(
                "spread-out",
                4,
                json!({"app": "spread-out"}),
                json!({"affinity": one_per_node("spread-out")}),
            );
            test.create(gang).await?;
            test.wait_phase("spread-out", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            let placed = nodes_of(test, "spread-out").await?;
            let distinct: BTreeSet<&String> = placed.values().collect();
            ensure!(distinct.len() == 4, "workers share nodes: {placed:?}");

            // More workers than nodes: the gang waits, and says why with numbers.
            let gang = workers(
                "too-many",
                40,
                json!({"app": "too-many"}),
                json!({"affinity": one_per_node("too-many")}),
            );
            test.create(gang).await?;
            let message = test
                .wait_admitted_reason("too-many", "Unschedulable", Duration::from_secs(60))
                .await?;
            ensure!(
                message.contains("but anti-affinity on kubernetes.io/hostname leaves")
                    && message.contains("for 40 pods of group workers"),
                "{message}"
            );
            Ok(())
        })
    })
    .await
}

/// Issue 21, item 4: a restart onto the reservation checks the pod constraints too. A
/// pod another workload started on a worker's node during the restart's backoff, which
/// the workers' anti-affinity excludes, sends the gang to be placed again at once, not
/// back onto a node where kube-scheduler would refuse its pod.
#[tokio::test]
async fn a_restart_does_not_go_back_onto_a_node_its_anti_affinity_now_excludes() -> Result<()> {
    with_test("anti-affinity-restart", &[], &[], |test| {
        Box::pin(async move {
            one_gpu_template(test).await?;
            let mut gang = workers(
                "apart",
                2,
                json!({"app": "apart"}),
                json!({"affinity": one_per_node("apart")}),
            );
            gang["spec"]["failurePolicy"] =
                json!({"maxRestarts": 1, "restartBackoff": {"initialSeconds": 10, "maxSeconds": 10}});
            test.create(gang).await?;
            test.wait_phase("apart", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            let placed = nodes_of(test, "apart").await?;
            let (victim, node) = placed.iter().next().context("a worker")?;
            let (victim, node) = (victim.clone(), node.clone());
            test.exit_pod(&victim, 1).await?;
            // The attempt's pods go; during the backoff a pod the workers' anti-affinity
            // selects starts on the node (bound by name, as a DaemonSet's would be).
            let pods = test.pods();
            wait::until("the attempt's pods to leave the node", Duration::from_secs(60), || {
                let (pods, node) = (pods.clone(), node.clone());
                async move {
                    let left = pods
                        .list(&ListParams::default().labels("muster.dev/workload=apart"))
                        .await?
                        .items
                        .into_iter()
                        .any(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node.as_str()));
                    Ok((!left).then_some(()))
                }
            })
            .await?;
            let intruder: Pod = serde_json::from_value(json!({
                "metadata": {"name": "intruder", "labels": {"app": "apart"}},
                "spec": {
                    "nodeName": node,
                    "containers": [{"name": "main", "image": "agent", "resources": {"requests": {"cpu": "100m"}}}],
                },
            }))?;
            pods.create(&PostParams::default(), &intruder).await?;
            let workloads = test.workloads();
            let status = wait::until("the gang to run again", Duration::from_secs(120), || {
                let workloads = workloads.clone();
                async move {
                    let status = workloads.get("apart").await?.status.unwrap_or_default();
                    let running = status.restarts == 1 && status.phase == Some(WorkloadPhase::Running);
                    Ok(running.then_some(status))
                }
            })
            .await?;
            let nodes = status.placement.as_ref().map(|p| p.nodes.clone()).unwrap_or_default();
            ensure!(!nodes.contains(&node), "placed again away from {node}: {nodes:?}");
            ensure!(
                status.scheduler_refusals.is_empty(),
                "no refusal was waited for: {:?}",
                status.scheduler_refusals
            );
            pods.delete("intruder", &DeleteParams::default()).await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_spread_constraint_balances_the_gang_over_racks() -> Result<()> {
    with_test("spread", &[], &[], |test| {
        Box::pin(async move {
            one_gpu_template(test).await?;
            // The fleet's zone only: its two racks are the constraint's domains.
            let gang = workers(
                "balanced",
                4,
                json!({"app": "balanced"}),
                json!({
                    "nodeSelector": {ZONE_LABEL: "zone-0"},
                    "topologySpreadConstraints": [{
                        "maxSkew": 1,
                        "topologyKey": RACK_LABEL,
                        "whenUnsatisfiable": "DoNotSchedule",
                        "labelSelector": {"matchLabels": {"app": "balanced"}},
                    }],
                }),
            );
            test.create(gang).await?;
            test.wait_phase("balanced", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            let placed = nodes_of(test, "balanced").await?;
            let mut per_rack: BTreeMap<String, usize> = BTreeMap::new();
            for node in placed.values() {
                *per_rack.entry(label_of(test, node, RACK_LABEL).await?).or_default() += 1;
            }
            ensure!(
                per_rack.values().copied().collect::<Vec<_>>() == [2, 2],
                "not balanced over the two racks: {per_rack:?}"
            );
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_host_port_in_use_keeps_the_gang_off_that_node() -> Result<()> {
    with_test("host-ports", &[], &[], |test| {
        Box::pin(async move {
            one_gpu_template(test).await?;
            // Another workload's pod holds port 29500 on node-00000.
            let pods = test.pods();
            pods.create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "port-holder"},
                    "spec": {
                        "nodeName": "node-00000",
                        "terminationGracePeriodSeconds": 0,
                        "containers": [{"name": "main", "image": "server", "ports": [{"containerPort": 29500, "hostPort": 29500}]}],
                    },
                }))?,
            )
            .await?;
            let rack_0 = json!({RACK_LABEL: "rack-0000"});
            let ports = json!([{"containerPort": 29500, "hostPort": 29500}]);
            // Four nodes in rack-0000, one port each: three workers fit, beside the holder.
            test.create(workers(
                "rendezvous",
                3,
                json!({}),
                json!({"nodeSelector": rack_0, "ports": ports}),
            ))
            .await?;
            test.wait_phase("rendezvous", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            let placed = nodes_of(test, "rendezvous").await?;
            let distinct: BTreeSet<&String> = placed.values().collect();
            ensure!(distinct.len() == 3, "workers share a port: {placed:?}");
            ensure!(
                !distinct.contains(&"node-00000".to_string()),
                "a worker is on the port holder's node: {placed:?}"
            );
            // A fourth does not fit: the reason names the port.
            test.create(workers(
                "one-more",
                1,
                json!({}),
                json!({"nodeSelector": rack_0, "ports": ports}),
            ))
            .await?;
            let message = test
                .wait_admitted_reason("one-more", "Unschedulable", Duration::from_secs(60))
                .await?;
            ensure!(message.contains("host port 29500/TCP in use"), "{message}");
            pods.delete("port-holder", &DeleteParams::default()).await?;
            Ok(())
        })
    })
    .await
}

/// The planned node of each pod, from the Workload's `status.placement`.
async fn planned_nodes(test: &Test, name: &str) -> Result<BTreeMap<String, String>> {
    let workload = test.workloads().get(name).await?;
    let placement = workload.status.and_then(|s| s.placement).context("a placement")?;
    Ok(placement.pods.into_iter().map(|p| (p.name, p.node)).collect())
}

/// Issue 21, item 3: a constraint muster does not see (a node affinity added to a gated
/// pod after muster made it, as a webhook would) makes kube-scheduler refuse a released
/// pod on its planned node. The gang is taken apart within seconds, not after the
/// schedule timeout, kube-scheduler's message is kept, and the next plan keeps the
/// group off that node: the pods muster makes again (without the added term) run
/// elsewhere, although the refused node still has room and would be planned first.
#[tokio::test]
async fn a_refusal_by_kube_scheduler_takes_the_gang_apart_at_once_and_is_not_planned_again() -> Result<()> {
    refused_gang("refusal", None).await
}

/// The same, with the operator killed right after it recorded the refusal (the intent
/// to take the gang apart and the node to keep off, in one write): the next operator
/// finishes the teardown and keeps the group off the node.
#[tokio::test]
async fn a_refusal_recorded_before_a_crash_is_acted_on_by_the_next_operator() -> Result<()> {
    refused_gang("refusal-crash", Some("after-released-record")).await
}

async fn refused_gang(name: &str, crash: Option<&'static str>) -> Result<()> {
    let go_on = std::env::temp_dir().join(format!("muster-{name}-{}", std::process::id()));
    let go_on_text = go_on.display().to_string();
    let mut env = vec![
        ("MUSTER_PAUSE_POINT", "after-reserved"),
        ("MUSTER_PAUSE_UNTIL", go_on_text.as_str()),
    ];
    env.extend(crash.map(|fault| ("MUSTER_FAULT_POINT", fault)));
    with_test(name, &[], &env, |test| {
        let go_on = go_on.clone();
        Box::pin(async move {
            let _ = std::fs::remove_file(&go_on);
            one_gpu_template(test).await?;
            let rack_0 = json!({RACK_LABEL: "rack-0000"});
            test.create(workers("refused", 2, json!({}), json!({"nodeSelector": rack_0})))
                .await?;
            test.wait_paused("after-reserved").await?;
            let planned = planned_nodes(test, "refused").await?;
            let refused_pod = "refused-workers-0";
            let refused_node = planned.get(refused_pod).context("worker 0 planned")?.clone();
            // Behind muster's back: worker 0 may not go to its planned node.
            test.pods()
                .patch(
                    refused_pod,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"spec": {"affinity": {"nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
                            "matchExpressions": [{"key": HOSTNAME, "operator": "NotIn", "values": [refused_node]}],
                        }]},
                    }}}})),
                )
                .await?;
            let released = std::time::Instant::now();
            std::fs::write(&go_on, b"")?;

            if let Some(fault) = crash {
                let operator = test.operator.as_mut().context("operator")?;
                operator.wait_aborted_at(fault, Duration::from_secs(60)).await?;
                let noticed = released.elapsed();
                // The grace is 15 s; the schedule timeout, 120 s.
                ensure!(
                    noticed < Duration::from_secs(45),
                    "the refusal was recorded after {noticed:?}"
                );
                test.operator = None;
                test.start_operator(&[], &[])?;
            } else {
                let note = test.wait_event("refused", "SchedulerRefused", "node affinity").await?;
                let noticed = released.elapsed();
                ensure!(
                    noticed < Duration::from_secs(45),
                    "the refusal was acted on after {noticed:?}: {note}"
                );
                ensure!(
                    note.contains(refused_pod) && note.contains(&refused_node),
                    "the note names the pod and the node: {note}"
                );
            }

            // The gang runs again, off the refused node.
            test.wait_phase("refused", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            let placed = nodes_of(test, "refused").await?;
            ensure!(
                placed.values().all(|node| *node != refused_node),
                "a worker was planned onto {refused_node} again: {placed:?}"
            );
            let workload = test.workloads().get("refused").await?;
            let status = workload.status.unwrap_or_default();
            let remembered = status
                .scheduler_refusals
                .iter()
                .find(|r| r.node == refused_node)
                .context("the refusal is remembered in the status")?;
            ensure!(
                remembered.pod == refused_pod
                    && remembered.pod_group.as_deref() == Some("workers")
                    && remembered.message.contains("node affinity"),
                "{remembered:?}"
            );
            ensure!(status.restarts == 0, "a refusal is no restart: {}", status.restarts);
            let _ = std::fs::remove_file(&go_on);
            Ok(())
        })
    })
    .await
}

/// Issue 36, item 1: the pods are planned as the API server stored them. Each case gives
/// every worker 40 more CPUs than its template asks for, so that only one fits a node of
/// 64; the template alone (one GPU, one CPU) would pack four onto one node, and
/// kube-scheduler would refuse three of them.
async fn planned_as_stored(test: &Test, name: &str, spec: Value) -> Result<()> {
    one_gpu_template(test).await?;
    let rack_0 = json!({RACK_LABEL: "rack-0000"});
    let mut spec = spec;
    spec["nodeSelector"] = rack_0;
    test.create(workers(name, 4, json!({}), spec)).await?;
    let workload = test
        .wait_phase(name, WorkloadPhase::Running, Duration::from_secs(120))
        .await?;
    let placed = nodes_of(test, name).await?;
    let distinct: BTreeSet<&String> = placed.values().collect();
    ensure!(distinct.len() == 4, "workers share a node: {placed:?}");
    let status = workload.status.unwrap_or_default();
    ensure!(
        status.restarts == 0 && status.scheduler_refusals.is_empty(),
        "kube-scheduler refused a pod before the gang ran: restarts {}, refusals {:?}",
        status.restarts,
        status.scheduler_refusals
    );
    Ok(())
}

/// A GPU container that asks for no CPU, in a namespace whose LimitRange gives each
/// container 40 CPUs.
#[tokio::test]
async fn a_limit_ranges_default_requests_are_planned() -> Result<()> {
    with_test("limit-range", &[], &[], |test| {
        Box::pin(async move {
            let ranges: Api<LimitRange> = Api::namespaced(test.client.clone(), &test.ns);
            ranges
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "metadata": {"name": "defaults"},
                        "spec": {"limits": [{"type": "Container", "defaultRequest": {"cpu": "40"}, "default": {"cpu": "40"}}]},
                    }))?,
                )
                .await?;
            planned_as_stored(
                test,
                "defaulted",
                json!({"containers": [{
                    "name": "main",
                    "image": "trainer",
                    "resources": {"claims": [{"name": "gpu"}]},
                }]}),
            )
            .await
        })
    })
    .await
}

/// A RuntimeClass whose overhead is 40 CPUs.
#[tokio::test]
async fn a_runtime_classs_overhead_is_planned() -> Result<()> {
    with_test("runtime-class", &[], &[], |test| {
        Box::pin(async move {
            let class = format!("{}-sandbox", test.ns);
            let classes: Api<RuntimeClass> = Api::all(test.client.clone());
            classes
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "metadata": {"name": class},
                        "handler": "sandbox",
                        "overhead": {"podFixed": {"cpu": "40"}},
                    }))?,
                )
                .await?;
            let outcome = planned_as_stored(test, "sandboxed", json!({"runtimeClassName": class})).await;
            classes.delete(&class, &DeleteParams::default()).await?;
            outcome
        })
    })
    .await
}

/// A sidecar of 40 CPUs that admission injects into every pod of the namespace (a
/// MutatingAdmissionPolicy here; a mutating webhook does the same to the stored pod).
#[tokio::test]
async fn a_sidecar_injected_at_admission_is_planned() -> Result<()> {
    with_test("injected-sidecar", &[], &[], |test| {
        Box::pin(async move {
            let name = format!("{}-sidecar", test.ns);
            let policies = admission_api(test, "MutatingAdmissionPolicy", "mutatingadmissionpolicies");
            let bindings = admission_api(
                test,
                "MutatingAdmissionPolicyBinding",
                "mutatingadmissionpolicybindings",
            );
            let policy = json!({
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingAdmissionPolicy",
                "metadata": {"name": name},
                "spec": {
                    "matchConstraints": {"resourceRules": [{
                        "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"],
                    }]},
                    "failurePolicy": "Fail",
                    "reinvocationPolicy": "Never",
                    "mutations": [{
                        "patchType": "ApplyConfiguration",
                        "applyConfiguration": {"expression": "Object{spec: Object.spec{initContainers: [\
                            Object.spec.initContainers{name: \"mesh\", image: \"mesh\", restartPolicy: \"Always\", \
                            resources: Object.spec.initContainers.resources{requests: {\"cpu\": \"40\"}}}]}}"},
                    }],
                },
            });
            let binding = json!({
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingAdmissionPolicyBinding",
                "metadata": {"name": name},
                "spec": {
                    "policyName": name,
                    "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": test.ns}}},
                },
            });
            policies
                .create(&PostParams::default(), &serde_json::from_value(policy)?)
                .await?;
            bindings
                .create(&PostParams::default(), &serde_json::from_value(binding)?)
                .await?;
            // The policy applies once the API server has loaded it: wait until a pod
            // made now gets its sidecar.
            wait::until("the sidecar policy to apply", Duration::from_secs(30), || async {
                let probe: Pod = serde_json::from_value(json!({
                    "metadata": {"generateName": "probe-"},
                    "spec": {"containers": [{"name": "main", "image": "probe"}]},
                }))?;
                let made = test
                    .pods()
                    .create(
                        &PostParams {
                            dry_run: true,
                            ..PostParams::default()
                        },
                        &probe,
                    )
                    .await?;
                let injected = made.spec.and_then(|s| s.init_containers).is_some_and(|c| !c.is_empty());
                Ok(injected.then_some(()))
            })
            .await?;
            let outcome = planned_as_stored(test, "injected", json!({})).await;
            bindings.delete(&name, &DeleteParams::default()).await?;
            policies.delete(&name, &DeleteParams::default()).await?;
            outcome
        })
    })
    .await
}

fn admission_api(test: &Test, kind: &str, plural: &str) -> Api<DynamicObject> {
    let resource = ApiResource {
        group: "admissionregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: "admissionregistration.k8s.io/v1".into(),
        kind: kind.into(),
        plural: plural.into(),
    };
    Api::all_with(test.client.clone(), &resource)
}

/// Issue 36, item 3: workers that must share a rack with `job=<name>` pods, labelled so
/// themselves, beside a launcher labelled the same. kube-scheduler lets the first worker
/// go anywhere only while no such pod is bound: a launcher bound first in another rack
/// would keep the workers off their rack for good. The launcher fits tightest in
/// rack-0000 (busy pods fill it) while the workers may only go to rack-0001: the plan
/// puts the launcher with them, and every pod is taken at first try whichever binds
/// first.
#[tokio::test]
async fn a_self_affine_group_and_the_pods_it_selects_share_a_domain_in_any_bind_order() -> Result<()> {
    with_test("bind-order", &[], &[], |test| {
        Box::pin(async move {
            one_gpu_template(test).await?;
            let pods = test.pods();
            let racks = test.cluster.nodes.iter().map(|n| (n.name.clone(), n.rack.clone()));
            let rack_0: Vec<String> = racks.filter(|(_, r)| r == "rack-0000").map(|(n, _)| n).collect();
            for node in &rack_0 {
                pods.create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "metadata": {"name": format!("busy-{node}")},
                        "spec": {
                            "nodeName": node,
                            "terminationGracePeriodSeconds": 0,
                            "containers": [{"name": "main", "image": "busy", "resources": {"requests": {"cpu": "60"}}}],
                        },
                    }))?,
                )
                .await?;
            }
            let job = json!({"job": "together"});
            let mut gang = workers(
                "together",
                2,
                job.clone(),
                json!({
                    "nodeSelector": {RACK_LABEL: "rack-0001"},
                    "affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
                        "topologyKey": RACK_LABEL,
                        "labelSelector": {"matchLabels": job},
                    }]}},
                }),
            );
            gang["spec"]["podGroups"]
                .as_array_mut()
                .context("groups")?
                .push(json!({
                    "name": "launcher",
                    "replicas": 1,
                    "template": {
                        "metadata": {"labels": job},
                        "spec": {"containers": [{"name": "main", "image": "launcher", "resources": {"requests": {"cpu": "2"}}}]},
                    },
                }));
            test.create(gang).await?;
            let workload = test
                .wait_phase("together", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            for (pod, node) in nodes_of(test, "together").await? {
                let rack = label_of(test, &node, RACK_LABEL).await?;
                ensure!(rack == "rack-0001", "{pod} is on {node} in {rack}");
            }
            let status = workload.status.unwrap_or_default();
            ensure!(
                status.restarts == 0 && status.scheduler_refusals.is_empty(),
                "kube-scheduler refused a pod: restarts {}, refusals {:?}",
                status.restarts,
                status.scheduler_refusals
            );
            for node in &rack_0 {
                pods.delete(&format!("busy-{node}"), &DeleteParams::default()).await?;
            }
            Ok(())
        })
    })
    .await
}
