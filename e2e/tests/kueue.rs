//! muster behind a real Kueue (built from its Go module, run as a process): Kueue decides
//! quota, order and preemption; muster reserves the devices of what Kueue admits.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use muster_api::v1alpha1::WorkloadPhase;
use muster_e2e::kueue::{GPU_RESOURCE, Kueue};
use muster_e2e::scenario::{Test, allocations, assert_runs_as_planned, cluster, gang, with_test};
use muster_e2e::wait;
use serde_json::{Value, json};
use tokio::sync::OnceCell;

/// The shared cluster, with Kueue running beside it (started once per test binary, before
/// any operator, which looks for Kueue when it starts).
async fn with_kueue() -> Result<()> {
    static KUEUE: OnceCell<Kueue> = OnceCell::const_new();
    let cluster = cluster().await?;
    KUEUE
        .get_or_try_init(|| async {
            let kueue = Kueue::start(&cluster.control_plane).await?;
            let client = cluster.control_plane.client().await?;
            let flavors = kueue_api(&client, "ResourceFlavor", "resourceflavors", None);
            let flavor: DynamicObject = serde_json::from_value(json!({
                "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                "metadata": {"name": "default"},
            }))?;
            flavors.create(&PostParams::default(), &flavor).await?;
            let priorities: Api<PriorityClass> = Api::all(client);
            for (name, value) in [("kueue-low", 100), ("kueue-high", 1000)] {
                let class: PriorityClass = serde_json::from_value(json!({"metadata": {"name": name}, "value": value}))?;
                priorities.create(&PostParams::default(), &class).await?;
            }
            anyhow::Ok(kueue)
        })
        .await?;
    Ok(())
}

fn kueue_api(client: &kube::Client, kind: &str, plural: &str, namespace: Option<&str>) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", kind), plural);
    match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    }
}

/// A ClusterQueue for this test with `gpus` of GPU quota (CPU and memory plenty), and
/// LocalQueue `team` pointing at it in the test's namespace.
async fn queues(test: &Test, gpus: u32, preemption: bool) -> Result<()> {
    let cluster_queue = format!("cq-{}", test.ns);
    let mut spec = json!({
        "namespaceSelector": {},
        "resourceGroups": [{
            "coveredResources": ["cpu", "memory", GPU_RESOURCE],
            "flavors": [{"name": "default", "resources": [
                {"name": "cpu", "nominalQuota": "1000"},
                {"name": "memory", "nominalQuota": "10Ti"},
                {"name": GPU_RESOURCE, "nominalQuota": gpus},
            ]}],
        }],
    });
    if preemption {
        spec["preemption"] = json!({"withinClusterQueue": "LowerPriority"});
    }
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
        "metadata": {"name": cluster_queue}, "spec": spec,
    }))?;
    kueue_api(&test.client, "ClusterQueue", "clusterqueues", None)
        .create(&PostParams::default(), &object)
        .await?;
    let local: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
        "metadata": {"name": "team"}, "spec": {"clusterQueue": cluster_queue},
    }))?;
    kueue_api(&test.client, "LocalQueue", "localqueues", Some(&test.ns))
        .create(&PostParams::default(), &local)
        .await?;
    Ok(())
}

/// A gang of `workers` eight-GPU workers queueing in LocalQueue `team`; it succeeds when
/// its launcher does.
fn queued_gang(name: &str, workers: i32, priority: Option<&str>) -> Value {
    let mut workload = gang(name, workers, None);
    workload["metadata"]["labels"] = json!({"kueue.x-k8s.io/queue-name": "team"});
    workload["spec"]["successPolicy"] = json!({"podGroups": ["launcher"]});
    if let Some(class) = priority {
        workload["spec"]["priorityClassName"] = json!(class);
    }
    workload
}

/// The Kueue Workload standing for muster Workload `name`.
async fn kueue_workload(test: &Test, name: &str) -> Result<DynamicObject> {
    Ok(kueue_api(&test.client, "Workload", "workloads", Some(&test.ns))
        .get(&format!("muster-{name}"))
        .await?)
}

fn condition_status(object: &DynamicObject, type_: &str) -> Option<String> {
    object.data["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .and_then(|c| c["status"].as_str().map(String::from))
}

async fn wait_kueue_condition(test: &Test, name: &str, type_: &str, status: &str) -> Result<DynamicObject> {
    wait::until(
        &format!("Kueue Workload of {name} to have {type_}={status}"),
        Duration::from_secs(90),
        || async {
            let object = kueue_workload(test, name).await?;
            Ok((condition_status(&object, type_).as_deref() == Some(status)).then_some(object))
        },
    )
    .await
}

/// Whether muster's Workload `name` holds any allocated claim.
async fn holds_devices(test: &Test, name: &str) -> Result<bool> {
    let held = allocations(&test.claims()).await?;
    Ok(held.keys().any(|claim| claim.starts_with(&format!("{name}-"))))
}

#[tokio::test]
async fn a_gang_waits_for_kueue_then_runs_with_every_claim_reserved_and_gives_the_quota_back() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-admit", &[], &[], |test| {
        Box::pin(async move {
            // No quota yet: the gang queues in Kueue and holds nothing.
            queues(test, 0, false).await?;
            test.create(queued_gang("trainer", 2, None)).await?;
            let message = test
                .wait_admitted_reason("trainer", "WaitingForKueue", Duration::from_secs(60))
                .await?;
            ensure!(message.contains("LocalQueue team"), "{message}");
            let object = kueue_workload(test, "trainer").await?;
            ensure!(
                object
                    .finalizers()
                    .iter()
                    .any(|f| f == "kueue.x-k8s.io/resource-in-use"),
                "{:?}",
                object.finalizers()
            );
            ensure!(object.data["spec"]["podSets"].as_array().map(Vec::len) == Some(2));
            wait::holds(
                "the gang holding nothing while Kueue waits",
                Duration::from_secs(3),
                || async { Ok(!holds_devices(test, "trainer").await?) },
            )
            .await?;

            // Quota for 16 GPUs: Kueue admits, muster reserves every claim and runs it.
            let cq = format!("cq-{}", test.ns);
            let quota = json!({"spec": {"resourceGroups": [{
                "coveredResources": ["cpu", "memory", GPU_RESOURCE],
                "flavors": [{"name": "default", "resources": [
                    {"name": "cpu", "nominalQuota": "1000"},
                    {"name": "memory", "nominalQuota": "10Ti"},
                    {"name": GPU_RESOURCE, "nominalQuota": 16},
                ]}],
            }]}});
            kueue_api(&test.client, "ClusterQueue", "clusterqueues", None)
                .patch(&cq, &PatchParams::default(), &Patch::Merge(&quota))
                .await?;
            wait_kueue_condition(test, "trainer", "Admitted", "True").await?;
            let workload = assert_runs_as_planned(test, "trainer").await?;
            let placement = workload.status.and_then(|s| s.placement).context("placement")?;
            ensure!(placement.devices == 16, "{placement:?}");
            wait_kueue_condition(test, "trainer", "PodsReady", "True").await?;

            // It succeeds: Kueue hears so and the quota is free again.
            test.exit_pod("trainer-launcher-0", 0).await?;
            test.wait_phase("trainer", WorkloadPhase::Succeeded, Duration::from_secs(90))
                .await?;
            let finished = wait_kueue_condition(test, "trainer", "Finished", "True").await?;
            ensure!(
                finished.data["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Finished" && c["reason"] == "Succeeded"),
                "{:?}",
                finished.data["status"]
            );
            wait::until("Kueue's finalizer to go", Duration::from_secs(60), || async {
                let object = kueue_workload(test, "trainer").await?;
                Ok((!object
                    .finalizers()
                    .iter()
                    .any(|f| f == "kueue.x-k8s.io/resource-in-use"))
                .then_some(()))
            })
            .await?;
            test.wait_finished_holding_nothing("trainer").await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn quota_for_one_gang_runs_them_one_after_the_other() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-quota", &[], &[], |test| {
        Box::pin(async move {
            queues(test, 32, false).await?;
            test.create(queued_gang("first", 4, None)).await?;
            wait_kueue_condition(test, "first", "Admitted", "True").await?;
            assert_runs_as_planned(test, "first").await?;
            // The cluster has room for both; the quota has not.
            test.create(queued_gang("second", 4, None)).await?;
            test.wait_admitted_reason("second", "WaitingForKueue", Duration::from_secs(60))
                .await?;
            wait::holds("the second gang holding nothing", Duration::from_secs(3), || async {
                Ok(!holds_devices(test, "second").await?)
            })
            .await?;
            test.exit_pod("first-launcher-0", 0).await?;
            test.wait_phase("first", WorkloadPhase::Succeeded, Duration::from_secs(90))
                .await?;
            wait_kueue_condition(test, "second", "Admitted", "True").await?;
            assert_runs_as_planned(test, "second").await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_preempted_gang_is_taken_apart_as_a_unit_and_runs_again_later() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-preempt", &[], &[], |test| {
        Box::pin(async move {
            queues(test, 32, true).await?;
            test.create(queued_gang("low", 4, Some("kueue-low"))).await?;
            assert_runs_as_planned(test, "low").await?;
            test.create(queued_gang("high", 4, Some("kueue-high"))).await?;

            // Kueue evicts the low gang; muster takes it apart, then gives the quota back.
            wait_kueue_condition(test, "low", "Evicted", "True").await?;
            wait_kueue_condition(test, "high", "Admitted", "True").await?;
            assert_runs_as_planned(test, "high").await?;
            ensure!(!holds_devices(test, "low").await?, "the evicted gang holds nothing");
            wait::until(
                "the evicted gang's pods to wait at the gate again",
                Duration::from_secs(60),
                || async {
                    let pods = test.gang_pods("low").await?;
                    let gated = pods.len() == 5
                        && pods.iter().all(|p| {
                            p.spec
                                .as_ref()
                                .and_then(|s| s.scheduling_gates.as_ref())
                                .is_some_and(|g| !g.is_empty())
                        });
                    Ok(gated.then_some(()))
                },
            )
            .await?;
            let requeued = kueue_workload(test, "low").await?;
            ensure!(
                condition_status(&requeued, "Requeued").as_deref() == Some("True"),
                "{:?}",
                requeued.data["status"]
            );
            test.wait_admitted_reason("low", "WaitingForKueue", Duration::from_secs(30))
                .await?;

            // When the high gang is done, the low one runs again.
            test.exit_pod("high-launcher-0", 0).await?;
            test.wait_phase("high", WorkloadPhase::Succeeded, Duration::from_secs(90))
                .await?;
            assert_runs_as_planned(test, "low").await?;
            Ok(())
        })
    })
    .await
}
