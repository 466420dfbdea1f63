//! GPUs requested the device-plugin way (`resources.limits: {example.com/gpu: 8}`) where a
//! DeviceClass maps that name to the fleet's DRA GPUs: muster turns each pod's request
//! into a ResourceClaim of its own, reserves every one of them on its pod's planned node
//! before any pod is released, and explains a gang that does not fit; a name two
//! DeviceClasses map is refused. An invariant checker runs beside the test.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::api::{Api, DeleteParams, PostParams};
use muster_api::v1alpha1::WorkloadPhase;
use muster_api::{conditions, labels};
use muster_e2e::scenario::with_test;
use muster_local_cluster::wait;
use serde_json::{Value, json};

const EXAMPLE: &str = include_str!("../../examples/dra-extended-resources.yaml");
const RESOURCE: &str = "example.com/gpu";
const CLASS: &str = "gpu-extended.example.com";

/// The example's DeviceClass and Workload.
fn example() -> Result<(DeviceClass, Value)> {
    let mut class = None;
    let mut workload = None;
    for document in EXAMPLE.split("\n---\n") {
        let value: Value = serde_saphyr::from_str(document)?;
        match value["kind"].as_str() {
            Some("DeviceClass") => class = Some(serde_json::from_value(value)?),
            Some("Workload") => workload = Some(value),
            other => anyhow::bail!("unexpected kind {other:?} in the example"),
        }
    }
    Ok((class.context("a DeviceClass")?, workload.context("a Workload")?))
}

/// Workers asking for `count` mapped GPUs each, in one rack.
fn gpu_workload(name: &str, replicas: i32, count: u32) -> Value {
    json!({
        "apiVersion": "muster.dev/v1alpha1",
        "kind": "Workload",
        "metadata": {"name": name},
        "spec": {
            "topology": {"required": muster_local_cluster::fleet::RACK_LABEL},
            "podGroups": [{
                "name": "workers",
                "replicas": replicas,
                "template": {"spec": {"containers": [{
                    "name": "trainer",
                    "image": "trainer",
                    "resources": {"requests": {"cpu": "16"}, "limits": {RESOURCE: count.to_string()}},
                }]}},
            }],
        },
    })
}

/// What the annotation on a pod or claim says was converted: (resource, count, class).
fn recorded(object: &kube::api::ObjectMeta) -> Result<Vec<(String, i64, String)>> {
    let text = object
        .annotations
        .as_ref()
        .and_then(|a| a.get(labels::EXTENDED_RESOURCES))
        .context("the extended-resources annotation")?;
    let list: Vec<Value> = serde_json::from_str(text)?;
    Ok(list
        .iter()
        .map(|r| {
            (
                r["resource"].as_str().unwrap_or_default().to_string(),
                r["count"].as_i64().unwrap_or_default(),
                r["deviceClass"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect())
}

/// Every pod asks for no extended resource, names its claim, and says where it came from.
fn check_pod(pod: &Pod) -> Result<()> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let spec = pod.spec.as_ref().context("pod spec")?;
    for container in &spec.containers {
        let resources = container.resources.clone().unwrap_or_default();
        for list in [resources.requests, resources.limits].into_iter().flatten() {
            ensure!(
                !list.contains_key(RESOURCE),
                "{name} still asks for {RESOURCE}: {list:?}"
            );
        }
        ensure!(
            resources
                .claims
                .iter()
                .flatten()
                .any(|c| c.name == "extended-resources"),
            "{name}'s container names its claim"
        );
    }
    let claim = format!("{name}-extended-resources");
    ensure!(
        spec.resource_claims
            .iter()
            .flatten()
            .any(|c| c.resource_claim_name.as_deref() == Some(&claim)),
        "{name} refers to {claim}"
    );
    ensure!(
        recorded(&pod.metadata)? == [(RESOURCE.to_string(), 8, CLASS.to_string())],
        "{name}'s annotation"
    );
    Ok(())
}

/// Claim `claim` holds eight devices on `node`.
fn check_claim(claim: &ResourceClaim, node: &str) -> Result<()> {
    let name = claim.metadata.name.clone().unwrap_or_default();
    ensure!(
        recorded(&claim.metadata)? == [(RESOURCE.to_string(), 8, CLASS.to_string())],
        "{name}'s annotation"
    );
    let results = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.clone())
        .with_context(|| format!("{name} allocated"))?;
    ensure!(results.len() == 8, "{name}: {} devices", results.len());
    ensure!(
        results.iter().all(|r| r.pool == node),
        "{name}: devices on {node}: {results:?}"
    );
    Ok(())
}

#[tokio::test]
async fn extended_resources_a_device_class_maps_are_reserved_as_claims_before_release() -> Result<()> {
    let go_on = std::env::temp_dir().join(format!("muster-extended-{}", std::process::id()));
    let go_on_text = go_on.display().to_string();
    let paused = [
        ("MUSTER_PAUSE_POINT", "after-reserved"),
        ("MUSTER_PAUSE_UNTIL", go_on_text.as_str()),
    ];
    with_test("extended", &[], &paused, |test| {
        let go_on = go_on.clone();
        Box::pin(async move {
            let classes: Api<DeviceClass> = Api::all(test.client.clone());
            let (class, example) = example()?;
            classes.create(&PostParams::default(), &class).await?;
            test.create(example).await?;

            // Every claim is reserved on its pod's planned node while the pods still wait.
            test.wait_paused("after-reserved").await?;
            let placement = test
                .workloads()
                .get("extended-gpus")
                .await?
                .status
                .and_then(|s| s.placement)
                .context("placement")?;
            let planned: BTreeMap<String, String> = placement
                .pods
                .iter()
                .map(|p| (p.name.clone(), p.node.clone()))
                .collect();
            ensure!(planned.len() == 2, "two workers planned: {planned:?}");
            let pods = test.gang_pods("extended-gpus").await?;
            for pod in &pods {
                check_pod(pod)?;
                let gated = pod.spec.as_ref().and_then(|s| s.scheduling_gates.as_ref());
                ensure!(
                    gated.is_some_and(|g| g.iter().any(|g| g.name == labels::GANG_GATE)),
                    "pods still gated"
                );
            }
            let claims = test.gang_claims("extended-gpus").await?;
            ensure!(claims.len() == 2, "one claim per pod: {}", claims.len());
            for claim in &claims {
                let name = claim.metadata.name.clone().unwrap_or_default();
                let pod = name.trim_end_matches("-extended-resources");
                check_claim(claim, &planned[pod])?;
            }
            std::fs::write(&go_on, b"")?;

            // The gang runs where it was planned, each claim reserved for its pod.
            test.wait_phase("extended-gpus", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            for pod in test.gang_pods("extended-gpus").await? {
                let name = pod.metadata.name.clone().unwrap_or_default();
                let node = pod.spec.as_ref().and_then(|s| s.node_name.clone()).context("bound")?;
                ensure!(planned[&name] == node, "{name} on {node}, planned {}", planned[&name]);
                let claim = test.claims().get(&format!("{name}-extended-resources")).await?;
                check_claim(&claim, &node)?;
                let reserved = claim.status.and_then(|s| s.reserved_for).unwrap_or_default();
                ensure!(
                    reserved.len() == 1 && Some(&reserved[0].uid) == pod.metadata.uid.as_ref(),
                    "{name}'s claim reserved for {reserved:?}"
                );
            }
            let workload = test.workloads().get("extended-gpus").await?;
            let container =
                serde_json::to_value(&workload.spec)?["podGroups"][0]["template"]["spec"]["containers"][0].clone();
            ensure!(
                container["resources"]["limits"][RESOURCE] == json!("8")
                    && container["resources"]["claims"].is_null()
                    && workload.spec.pod_groups[0]
                        .template
                        .as_ref()
                        .and_then(|t| t.spec.as_ref())
                        .is_some_and(|s| s.resource_claims.is_none()),
                "the Workload stays as written: {container}"
            );

            // More than a rack holds (four such nodes): nothing is held, and the reason
            // names the class.
            test.create(gpu_workload("too-big", 5, 8)).await?;
            let message = test
                .wait_admitted_reason("too-big", "Unschedulable", Duration::from_secs(60))
                .await?;
            ensure!(message.contains(&format!("8 {CLASS} devices each")), "{message}");
            let held = test.gang_claims("too-big").await?;
            ensure!(held.len() == 5, "its claims exist: {}", held.len());
            ensure!(
                held.iter()
                    .all(|c| c.status.as_ref().and_then(|s| s.allocation.as_ref()).is_none()),
                "the gang that does not fit holds nothing"
            );
            test.workloads().delete("too-big", &DeleteParams::default()).await?;

            // A second DeviceClass mapping the name: refused, nothing made.
            let mut second = class.clone();
            second.metadata.name = Some("gpu-extended-2.example.com".into());
            classes.create(&PostParams::default(), &second).await?;
            test.create(gpu_workload("ambiguous", 1, 8)).await?;
            let message = wait::until("the ambiguous gang to be refused", Duration::from_secs(60), || {
                let api = test.workloads();
                async move {
                    let w = api.get("ambiguous").await?;
                    Ok(w.status
                        .unwrap_or_default()
                        .conditions
                        .into_iter()
                        .find(|c| c.type_ == conditions::CREATED)
                        .filter(|c| c.reason == conditions::REASON_EXTENDED_RESOURCE_AMBIGUOUS)
                        .map(|c| c.message))
                }
            })
            .await?;
            ensure!(message.contains("gpu-extended-2.example.com"), "{message}");
            ensure!(test.gang_pods("ambiguous").await?.is_empty(), "no pods made");
            ensure!(test.gang_claims("ambiguous").await?.is_empty(), "no claims made");
            test.workloads().delete("ambiguous", &DeleteParams::default()).await?;

            for name in ["gpu-extended-2.example.com", CLASS] {
                classes.delete(name, &DeleteParams::default()).await?;
            }
            let _ = std::fs::remove_file(&go_on);
            Ok(())
        })
    })
    .await
}
