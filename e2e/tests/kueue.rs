//! muster behind a real Kueue (built from its Go module, run as a process): Kueue decides
//! quota, order and preemption; muster reserves the devices of what Kueue admits.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::resource::v1::DeviceTaintRule;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use muster_api::v1alpha1::WorkloadPhase;
use muster_e2e::frameworks::{operator_args, wait_webhook_ready, webhook_port};
use muster_e2e::scenario::{Test, allocations, assert_runs_as_planned, cluster, gang, with_test};
use muster_local_cluster::fleet::GPU_DRIVER;
use muster_local_cluster::kueue::{GPU_RESOURCE, Kueue};
use muster_local_cluster::wait;
use serde_json::{Value, json};
use tokio::sync::OnceCell;

/// The shared cluster, with JobSet (and muster's webhook and admission policies) and
/// Kueue running beside it (started once per test binary, before any operator, which
/// looks for Kueue when it starts). Kueue runs its own Job and JobSet integrations and
/// their webhooks, as a cluster that installs Kueue has them.
async fn with_kueue() -> Result<()> {
    static KUEUE: OnceCell<Kueue> = OnceCell::const_new();
    let cluster = cluster().await?;
    KUEUE
        .get_or_try_init(|| async {
            webhook_port().await?;
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
    let preemption = preemption.then(|| json!({"withinClusterQueue": "LowerPriority"}));
    cluster_queue(test, "team", gpus, None, preemption).await
}

/// ClusterQueue `cq-<namespace>-<local>` with `gpus` of GPU quota, in `cohort` if given,
/// and LocalQueue `local` pointing at it in the test's namespace.
async fn cluster_queue(
    test: &Test,
    local: &str,
    gpus: u32,
    cohort: Option<&str>,
    preemption: Option<Value>,
) -> Result<()> {
    cluster_queue_of(test, local, "default", gpus, cohort, preemption).await
}

/// Like [`cluster_queue`], with the quota in `flavor`.
async fn cluster_queue_of(
    test: &Test,
    local: &str,
    flavor: &str,
    gpus: u32,
    cohort: Option<&str>,
    preemption: Option<Value>,
) -> Result<()> {
    let name = format!("cq-{}-{local}", test.ns);
    let mut spec = json!({"namespaceSelector": {}, "resourceGroups": quota(flavor, gpus)});
    if let Some(cohort) = cohort {
        spec["cohortName"] = json!(cohort);
    }
    if let Some(preemption) = preemption {
        spec["preemption"] = preemption;
    }
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
        "metadata": {"name": name}, "spec": spec,
    }))?;
    kueue_api(&test.client, "ClusterQueue", "clusterqueues", None)
        .create(&PostParams::default(), &object)
        .await?;
    let local_queue: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
        "metadata": {"name": local}, "spec": {"clusterQueue": name},
    }))?;
    kueue_api(&test.client, "LocalQueue", "localqueues", Some(&test.ns))
        .create(&PostParams::default(), &local_queue)
        .await?;
    Ok(())
}

/// The resource groups of a ClusterQueue with `gpus` of GPU quota in `flavor`, CPU and
/// memory plenty.
fn quota(flavor: &str, gpus: u32) -> Value {
    json!([{
        "coveredResources": ["cpu", "memory", GPU_RESOURCE],
        "flavors": [{"name": flavor, "resources": [
            {"name": "cpu", "nominalQuota": "1000"},
            {"name": "memory", "nominalQuota": "10Ti"},
            {"name": GPU_RESOURCE, "nominalQuota": gpus},
        ]}],
    }])
}

/// Sets the GPU quota of this test's ClusterQueue behind LocalQueue `team`.
async fn set_gpu_quota(test: &Test, gpus: u32) -> Result<()> {
    let patch = json!({"spec": {"resourceGroups": quota("default", gpus)}});
    kueue_api(&test.client, "ClusterQueue", "clusterqueues", None)
        .patch(
            &format!("cq-{}-team", test.ns),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    Ok(())
}

/// An AdmissionCheck muster answers, named for this test; returns its name.
async fn muster_check(test: &Test) -> Result<String> {
    let check = format!("dra-{}", test.ns);
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "AdmissionCheck",
        "metadata": {"name": check}, "spec": {"controllerName": "muster.dev/dra-reservation"},
    }))?;
    kueue_api(&test.client, "AdmissionCheck", "admissionchecks", None)
        .create(&PostParams::default(), &object)
        .await?;
    Ok(check)
}

/// Makes this test's ClusterQueue behind `team` wait for `check` before admitting.
async fn require_check(test: &Test, check: &str) -> Result<()> {
    let patch = json!({"spec": {"admissionChecksStrategy": {"admissionChecks": [{"name": check}]}}});
    kueue_api(&test.client, "ClusterQueue", "clusterqueues", None)
        .patch(
            &format!("cq-{}-team", test.ns),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    Ok(())
}

/// A gang asking for 5 GPUs in all: Kueue keeps it waiting on a quota of 4, and muster
/// runs it with all 5 devices once the quota is 5.
async fn waits_on_four_runs_on_five(test: &Test, name: &str) -> Result<()> {
    test.wait_admitted_reason(name, "WaitingForKueue", Duration::from_secs(60))
        .await?;
    wait::holds(
        "Kueue not admitting 5 GPUs on a quota of 4",
        Duration::from_secs(3),
        || async {
            let object = kueue_workload(test, name).await?;
            Ok(condition_status(&object, "QuotaReserved").as_deref() != Some("True"))
        },
    )
    .await?;
    set_gpu_quota(test, 5).await?;
    wait_kueue_condition(test, name, "Admitted", "True").await?;
    let workload = test
        .wait_phase(name, WorkloadPhase::Running, Duration::from_secs(90))
        .await?;
    let placement = workload.status.and_then(|s| s.placement).context("placement")?;
    ensure!(placement.devices == 5, "{placement:?}");
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

/// Devices allocated to the claims of muster's Workloads `names`.
async fn devices_held(test: &Test, names: &[&str]) -> Result<i64> {
    let claims = test.claims().list(&kube::api::ListParams::default()).await?.items;
    Ok(claims
        .iter()
        .filter(|c| {
            c.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("muster.dev/workload"))
                .is_some_and(|w| names.contains(&w.as_str()))
        })
        .filter_map(|c| {
            c.status
                .as_ref()?
                .allocation
                .as_ref()?
                .devices
                .as_ref()?
                .results
                .as_ref()
        })
        .map(|r| r.len() as i64)
        .sum())
}

/// The GPUs Kueue counts as used by admitted workloads of ClusterQueue `cq-<ns>-<local>`.
async fn kueue_gpu_usage(test: &Test, local: &str) -> Result<i64> {
    let queue = kueue_api(&test.client, "ClusterQueue", "clusterqueues", None)
        .get(&format!("cq-{}-{local}", test.ns))
        .await?;
    Ok(queue.data["status"]["flavorsUsage"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|f| f["resources"].as_array().into_iter().flatten())
        .filter(|r| r["name"] == GPU_RESOURCE)
        .map(|r| match &r["total"] {
            Value::String(q) => q.parse::<i64>().unwrap_or(0),
            other => other.as_i64().unwrap_or(0),
        })
        .sum())
}

/// Waits until Kueue's GPU usage in LocalQueue `local`'s ClusterQueue equals the devices
/// muster's Workloads `names` hold, and both are `expected`.
async fn usage_matches_devices(test: &Test, local: &str, names: &[&str], expected: i64) -> Result<()> {
    let last = std::sync::Mutex::new((0, 0));
    let matched = wait::until(
        &format!("Kueue's GPU usage in {local} to match the {expected} devices muster holds"),
        Duration::from_secs(60),
        || async {
            let usage = kueue_gpu_usage(test, local).await?;
            let held = devices_held(test, names).await?;
            *last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = (usage, held);
            Ok((usage == held && held == expected).then_some(()))
        },
    )
    .await;
    let (usage, held) = *last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    matched.with_context(|| format!("Kueue counts {usage} GPUs, muster holds {held}"))
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
            set_gpu_quota(test, 16).await?;
            wait_kueue_condition(test, "trainer", "Admitted", "True").await?;
            let workload = assert_runs_as_planned(test, "trainer").await?;
            let placement = workload.status.and_then(|s| s.placement).context("placement")?;
            ensure!(placement.devices == 16, "{placement:?}");
            usage_matches_devices(test, "team", &["trainer"], 16).await?;
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
            usage_matches_devices(test, "team", &["trainer"], 0).await?;

            // Kueue's retention (here, a user) deletes the finished Kueue Workload: a
            // finished gang never queues again, whatever wakes its Workload.
            let kueue_workloads = kueue_api(&test.client, "Workload", "workloads", Some(&test.ns));
            kueue_workloads.delete("muster-trainer", &Default::default()).await?;
            wait::until("the Kueue Workload to go", Duration::from_secs(30), || async {
                Ok(kueue_workloads.get_opt("muster-trainer").await?.is_none().then_some(()))
            })
            .await?;
            let poke = json!({"metadata": {"annotations": {"muster-e2e/poke": "1"}}});
            test.workloads()
                .patch("trainer", &PatchParams::default(), &Patch::Merge(&poke))
                .await?;
            wait::holds(
                "no Kueue Workload for the finished gang",
                Duration::from_secs(5),
                || async { Ok(kueue_workloads.get_opt("muster-trainer").await?.is_none()) },
            )
            .await?;
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
            usage_matches_devices(test, "team", &["first", "second"], 32).await?;
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
            usage_matches_devices(test, "team", &["first", "second"], 32).await?;
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
            usage_matches_devices(test, "team", &["high", "low"], 32).await?;
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

/// Reads the Kueue Workload of `name` until `check` holds.
async fn wait_kueue(test: &Test, name: &str, what: &str, check: impl Fn(&DynamicObject) -> bool) -> Result<()> {
    let api = kueue_api(&test.client, "Workload", "workloads", Some(&test.ns));
    wait::until(what, Duration::from_secs(90), || async {
        let object = api.get_opt(&format!("muster-{name}")).await?;
        Ok(object.filter(|o| check(o)).map(|_| ()))
    })
    .await
}

#[tokio::test]
async fn a_gang_borrowing_from_its_cohort_gives_way_when_the_lender_reclaims() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-cohort", &[], &[], |test| {
        Box::pin(async move {
            let cohort = format!("pool-{}", test.ns);
            cluster_queue(test, "team", 32, Some(&cohort), None).await?;
            let reclaim = json!({"reclaimWithinCohort": "Any"});
            cluster_queue(test, "other", 32, Some(&cohort), Some(reclaim)).await?;
            // Two 32-GPU gangs in team's queue: the second runs on quota borrowed from other.
            test.create(queued_gang("own", 4, None)).await?;
            assert_runs_as_planned(test, "own").await?;
            test.create(queued_gang("borrower", 4, None)).await?;
            assert_runs_as_planned(test, "borrower").await?;
            // other wants its quota back: one of team's gangs is evicted as a unit.
            let mut lender = queued_gang("lender", 4, None);
            lender["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = json!("other");
            test.create(lender).await?;
            wait_kueue_condition(test, "lender", "Admitted", "True").await?;
            assert_runs_as_planned(test, "lender").await?;
            let mut evicted = Vec::new();
            for gang in ["own", "borrower"] {
                let object = kueue_workload(test, gang).await?;
                if condition_status(&object, "Admitted").as_deref() != Some("True") {
                    ensure!(
                        !holds_devices(test, gang).await?,
                        "{gang} was evicted and holds nothing"
                    );
                    evicted.push(gang);
                }
            }
            ensure!(evicted.len() == 1, "exactly one of team's gangs gave way: {evicted:?}");
            usage_matches_devices(test, "team", &["own", "borrower"], 32).await?;
            usage_matches_devices(test, "other", &["lender"], 32).await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn suspend_and_resume_go_through_kueue_and_a_quick_toggle_fails_nothing() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-suspend", &[], &[], |test| {
        Box::pin(async move {
            queues(test, 32, false).await?;
            // Its pods take 6 s to stop: the quota must stay charged meanwhile.
            let mut toggled = queued_gang("toggled", 4, None);
            for group in toggled["spec"]["podGroups"].as_array_mut().context("podGroups")? {
                group["template"]["metadata"] = json!({"annotations": {"muster-e2e-terminate-after": "6s"}});
            }
            test.create(toggled).await?;
            assert_runs_as_planned(test, "toggled").await?;
            usage_matches_devices(test, "team", &["toggled"], 32).await?;
            let params = PatchParams::default();
            let suspend = |on: bool| json!({"spec": {"suspend": on}});

            test.workloads()
                .patch("toggled", &params, &Patch::Merge(&suspend(true)))
                .await?;
            let pods = test.pods();
            wait::until("the gang's pods to be stopping", Duration::from_secs(30), || async {
                let stopping = pods
                    .list(&kube::api::ListParams::default().labels("muster.dev/workload=toggled"))
                    .await?
                    .items
                    .iter()
                    .any(|p| p.metadata.deletion_timestamp.is_some());
                Ok(stopping.then_some(()))
            })
            .await?;
            // Suspend keeps the quota while the gang still holds its devices.
            ensure!(holds_devices(test, "toggled").await?, "still giving its devices back");
            let object = kueue_workload(test, "toggled").await?;
            ensure!(
                object.data["spec"]["active"] != false
                    && condition_status(&object, "QuotaReserved").as_deref() == Some("True"),
                "Kueue's Workload stays charged while the gang holds devices: {}",
                object.data
            );
            ensure!(
                kueue_gpu_usage(test, "team").await? == 32,
                "Kueue still counts the devices the gang holds"
            );
            test.wait_phase("toggled", WorkloadPhase::Suspended, Duration::from_secs(90))
                .await?;
            wait_kueue(test, "toggled", "Kueue to give the quota back", |o| {
                o.data["spec"]["active"] == false && condition_status(o, "QuotaReserved").as_deref() != Some("True")
            })
            .await?;
            ensure!(!holds_devices(test, "toggled").await?, "a suspended gang holds nothing");
            usage_matches_devices(test, "team", &["toggled"], 0).await?;

            test.workloads()
                .patch("toggled", &params, &Patch::Merge(&suspend(false)))
                .await?;
            wait_kueue_condition(test, "toggled", "Admitted", "True").await?;
            assert_runs_as_planned(test, "toggled").await?;

            // Off and on again at once: it ends up running, and nothing failed.
            test.workloads()
                .patch("toggled", &params, &Patch::Merge(&suspend(true)))
                .await?;
            test.workloads()
                .patch("toggled", &params, &Patch::Merge(&suspend(false)))
                .await?;
            wait_kueue(test, "toggled", "Kueue to see the Workload active", |o| {
                o.data["spec"]["active"] == true
            })
            .await?;
            let workload = assert_runs_as_planned(test, "toggled").await?;
            let status = workload.status.context("status")?;
            ensure!(
                !status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Failed" && c.status == "True"),
                "{:?}",
                status.conditions
            );
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_workload_deleted_while_queued_or_running_takes_its_kueue_workload_with_it() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-delete", &[], &[], |test| {
        Box::pin(async move {
            queues(test, 32, false).await?;
            test.create(queued_gang("running", 4, None)).await?;
            assert_runs_as_planned(test, "running").await?;
            test.create(queued_gang("waiting", 4, None)).await?;
            test.wait_admitted_reason("waiting", "WaitingForKueue", Duration::from_secs(60))
                .await?;
            usage_matches_devices(test, "team", &["running", "waiting"], 32).await?;
            let kueue_workloads = kueue_api(&test.client, "Workload", "workloads", Some(&test.ns));
            let workloads = test.workloads();
            for name in ["waiting", "running"] {
                workloads.delete(name, &Default::default()).await?;
                wait::until(
                    &format!("{name} and its Kueue Workload to be gone"),
                    Duration::from_secs(90),
                    || {
                        let (workloads, kueue_workloads) = (workloads.clone(), kueue_workloads.clone());
                        async move {
                            let gone = workloads.get_opt(name).await?.is_none()
                                && kueue_workloads.get_opt(&format!("muster-{name}")).await?.is_none();
                            Ok(gone.then_some(()))
                        }
                    },
                )
                .await?;
                ensure!(!holds_devices(test, name).await?, "{name} holds nothing");
            }
            usage_matches_devices(test, "team", &[], 0).await?;
            Ok(())
        })
    })
    .await
}

/// muster's AdmissionCheck on a ClusterQueue: Kueue reserves quota, muster reserves the
/// devices. No rack has room (gangs outside Kueue hold a node of each), so muster
/// answers Retry and holds nothing; once a rack frees, it answers Ready and the gang runs.
#[tokio::test]
async fn the_admission_check_retries_until_the_devices_can_be_reserved() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-check", &[], &[], |test| {
        Box::pin(async move {
            let check = muster_check(test).await?;
            cluster_queue(test, "team", 64, None, None).await?;
            require_check(test, &check).await?;
            wait::until(
                "muster to mark its AdmissionCheck active",
                Duration::from_secs(60),
                || async {
                    let object = kueue_api(&test.client, "AdmissionCheck", "admissionchecks", None)
                        .get(&check)
                        .await?;
                    Ok((condition_status(&object, "Active").as_deref() == Some("True")).then_some(()))
                },
            )
            .await?;

            // Outside Kueue, one node of each rack is taken.
            test.create(gang("outsider-a", 1, Some("rack-0000"))).await?;
            test.create(gang("outsider-b", 1, Some("rack-0001"))).await?;
            assert_runs_as_planned(test, "outsider-a").await?;
            assert_runs_as_planned(test, "outsider-b").await?;

            // Kueue has quota for it; no rack has room: muster answers Retry (Kueue evicts
            // it after the requeue delay, and asks again).
            test.create(queued_gang("waiting", 4, None)).await?;
            wait_kueue(test, "waiting", "muster to answer Retry", |o| {
                o.data["status"]["admissionChecks"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| {
                        c["state"] == "Retry" && c["message"].as_str().is_some_and(|m| m.contains("has room for 3"))
                    })
            })
            .await?;
            ensure!(
                !holds_devices(test, "waiting").await?,
                "a gang muster answered Retry for holds nothing"
            );
            let pods = test.gang_pods("waiting").await?;
            ensure!(
                pods.iter()
                    .all(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none()),
                "no pod of it was released"
            );

            // A rack frees: the next time Kueue asks, muster reserves and says Ready.
            test.workloads().delete("outsider-a", &Default::default()).await?;
            wait_kueue_condition(test, "waiting", "Admitted", "True").await?;
            let admitted = kueue_workload(test, "waiting").await?;
            let state = admitted.data["status"]["admissionChecks"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["name"] == check.as_str())
                .map(|c| (c["state"].clone(), c["message"].clone()));
            ensure!(
                state
                    .as_ref()
                    .is_some_and(|(s, m)| s == "Ready" && m.as_str().is_some_and(|m| m.contains("32 devices"))),
                "{state:?}"
            );
            let workload = assert_runs_as_planned(test, "waiting").await?;
            let placement = workload.status.and_then(|s| s.placement).context("placement")?;
            ensure!(
                placement.topology_value.as_deref() == Some("rack-0000"),
                "{placement:?}"
            );
            usage_matches_devices(test, "team", &["waiting"], 32).await?;
            Ok(())
        })
    })
    .await
}

/// Kueue's Topology-Aware Scheduling picks a rack from CPU and memory alone; all GPUs
/// of rack-0000 are held outside Kueue. muster plans only inside the rack Kueue chose:
/// there it places the gang, or it answers Retry and holds nothing. It never releases a
/// pod whose devices are not reserved, and it runs once there is room.
#[tokio::test]
async fn under_topology_aware_scheduling_muster_places_inside_kueues_rack_or_retries() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-tas", &[], &[], |test| {
        Box::pin(async move {
            let suffix = test.ns.clone();
            let create = |kind: &'static str, plural: &'static str, object: Value| {
                let api = kueue_api(&test.client, kind, plural, None);
                async move {
                    let object: DynamicObject = serde_json::from_value(object)?;
                    api.create(&PostParams::default(), &object).await?;
                    anyhow::Ok(())
                }
            };
            create(
                "Topology",
                "topologies",
                json!({
                    "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Topology",
                    "metadata": {"name": format!("racks-{suffix}")},
                    "spec": {"levels": [{"nodeLabel": "example.com/rack"}]},
                }),
            )
            .await?;
            create(
                "ResourceFlavor",
                "resourceflavors",
                json!({
                    "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                    "metadata": {"name": format!("tas-{suffix}")},
                    "spec": {"nodeLabels": {"type": "kwok"}, "topologyName": format!("racks-{suffix}")},
                }),
            )
            .await?;
            let check = muster_check(test).await?;
            cluster_queue_of(test, "team", &format!("tas-{suffix}"), 64, None, None).await?;
            require_check(test, &check).await?;

            // Every GPU of rack-0000 is taken outside Kueue; its CPUs are mostly free.
            test.create(gang("outsider", 4, Some("rack-0000"))).await?;
            assert_runs_as_planned(test, "outsider").await?;

            test.create(queued_gang("tas", 4, None)).await?;
            wait_kueue(test, "tas", "the gang to ask Kueue for one rack", |o| {
                o.data["spec"]["podSets"][1]["topologyRequest"]["required"] == "example.com/rack"
            })
            .await?;
            // Either Kueue chose rack-0001 and muster placed the gang there, or Kueue chose
            // rack-0000 and muster answered Retry, holding nothing.
            enum Seen {
                Running,
                Retried,
            }
            let seen = wait::until(
                "the gang to run or muster to answer Retry",
                Duration::from_secs(90),
                || async {
                    let workload = test.workloads().get("tas").await?;
                    if workload.status.as_ref().and_then(|s| s.phase) == Some(WorkloadPhase::Running) {
                        return Ok(Some(Seen::Running));
                    }
                    let object = kueue_workload(test, "tas").await?;
                    let retried = object.data["status"]["admissionChecks"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|c| c["state"] == "Retry");
                    Ok(retried.then_some(Seen::Retried))
                },
            )
            .await?;
            if let Seen::Retried = seen {
                ensure!(
                    !holds_devices(test, "tas").await?,
                    "a gang answered Retry holds nothing"
                );
                test.workloads().delete("outsider", &Default::default()).await?;
            }
            let workload = assert_runs_as_planned(test, "tas").await?;
            usage_matches_devices(test, "team", &["tas"], 32).await?;
            let placement = workload.status.and_then(|s| s.placement).context("placement")?;
            let admitted = kueue_workload(test, "tas").await?;
            let assigned = admitted.data["status"]["admission"]["podSetAssignments"][1]["topologyAssignment"].clone();
            ensure!(
                assigned
                    .to_string()
                    .contains(placement.topology_value.as_deref().unwrap_or("none")),
                "muster placed the gang in {:?}, inside Kueue's assignment {assigned}",
                placement.topology_value
            );
            Ok(())
        })
    })
    .await
}

/// A gang's shared claim is charged once, through a podSet of its own: 2 workers with 2
/// GPUs each and one GPU they share (node-local, so all on one node) need 5 GPUs of quota.
#[tokio::test]
async fn a_shared_claim_is_charged_once_in_kueues_quota() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-shared", &[], &[], |test| {
        Box::pin(async move {
            for (name, count) in [("one-gpu", 1), ("two-gpus", 2)] {
                test.create_claim_template(name, "gpu", count).await?;
            }
            queues(test, 4, false).await?;
            let mut workload = queued_gang("shared", 2, None);
            workload["spec"]["resourceClaims"] =
                json!([{"name": "fabric", "resourceClaimTemplateName": "one-gpu", "podGroups": ["workers"]}]);
            let workers = &mut workload["spec"]["podGroups"][1]["template"]["spec"];
            workers["containers"][0]["resources"]["claims"] = json!([{"name": "gpus"}, {"name": "fabric"}]);
            workers["resourceClaims"][0]["resourceClaimTemplateName"] = json!("two-gpus");
            test.create(workload).await?;
            wait_kueue(test, "shared", "the shared claim's podSet", |o| {
                o.data["spec"]["podSets"]
                    .as_array()
                    .is_some_and(|sets| sets.iter().any(|s| s["name"] == "shared-claims" && s["count"] == 1))
            })
            .await?;
            // 5 GPUs asked, 4 in the quota: Kueue does not admit it, then it does.
            waits_on_four_runs_on_five(test, "shared").await?;
            usage_matches_devices(test, "team", &["shared"], 5).await?;
            let held = allocations(&test.claims()).await?;
            ensure!(
                held.get("shared-fabric").map(Vec::len) == Some(1),
                "the shared claim holds one device: {held:?}"
            );
            Ok(())
        })
    })
    .await
}

/// The chart's permissions with `rbac.kueue=true` and its webhook (the default) are
/// enough for a gang's life in Kueue, with muster's admission check, and for a labelled
/// Job queued through its gang; every Kueue and webhook permission it grants is used
/// (but those for paths these lives do not take).
#[tokio::test]
async fn the_chart_rbac_for_kueue_is_enough_and_grants_nothing_unused() -> Result<()> {
    with_kueue().await?;
    let port = webhook_port().await?;
    with_test("kueue-rbac", &[], &[], |test| {
        Box::pin(async move {
            let release_ns = muster_local_cluster::namespaces::namespace(&test.client, "muster-system").await?;
            let (objects, kubeconfig) = muster_e2e::rbac::chart_account(
                test,
                &release_ns,
                &[("crds.install", "false"), ("rbac.kueue", "true")],
            )
            .await?;
            if let Some(admin) = test.operator.take() {
                admin.stop();
            }
            let args = muster_e2e::frameworks::chart_operator_args(port, &release_ns);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            test.operator = Some(test.spawn_operator(&kubeconfig, &args, &[])?);
            wait_webhook_ready(test).await?;

            let check = muster_check(test).await?;
            cluster_queue(test, "team", 64, None, None).await?;
            require_check(test, &check).await?;
            test.create(queued_gang("lifelong", 2, Some("kueue-low"))).await?;
            wait_kueue_condition(test, "lifelong", "Admitted", "True").await?;
            assert_runs_as_planned(test, "lifelong").await?;
            test.exit_pod("lifelong-launcher-0", 0).await?;
            // A labelled Job queued through its gang: Kueue charges it by the Job's
            // template, and its pod ends by itself.
            let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(test.client.clone(), &test.ns);
            let mut job = muster_e2e::scenario::job_joining("queued", "main", 1);
            job["metadata"] = json!({"name": "queued", "labels": {"muster.dev/gang": "true"},
                                     "annotations": {"muster.dev/queue-name": "team"}});
            let template = &mut job["spec"]["template"];
            template["metadata"] = json!({"annotations": {"muster-e2e-run-for": "3s"}});
            template["spec"].as_object_mut().map(|s| s.remove("schedulingGates"));
            jobs.create(&PostParams::default(), &serde_json::from_value(job)?)
                .await?;
            for name in ["lifelong", "job-queued"] {
                wait::until("Kueue's finalizer to go", Duration::from_secs(90), || async {
                    let object = kueue_workload(test, name).await?;
                    Ok((!object
                        .finalizers()
                        .iter()
                        .any(|f| f == "kueue.x-k8s.io/resource-in-use"))
                    .then_some(()))
                })
                .await?;
            }

            let operator = test.operator.as_ref().context("operator")?;
            let log = operator.log();
            ensure!(!log.contains("forbidden"), "no request was forbidden:\n{log}");
            ensure!(log.contains("the cluster serves Kueue"), "the operator used Kueue");
            let used = muster_e2e::rbac::used(operator).await?;
            let rules = muster_e2e::rbac::operator_rules(&objects);
            // Not in these lives: deleting the Kueue Workload of a gang that stops
            // queueing, reading a Topology (the flavor here has none) or a flavor not
            // cached yet, reading a JobSet
            // to charge its gang (the JobSet test here does), following a user's suspend
            // of a job's gang to the job, making a job's Workload again after an edit,
            // and renewing the webhook's certificate.
            let elsewhere = [
                ("delete", "workloads.kueue.x-k8s.io"),
                ("get", "topologies.kueue.x-k8s.io"),
                ("get", "resourceflavors.kueue.x-k8s.io"),
                ("get", "jobsets.jobset.x-k8s.io"),
                ("patch", "jobsets.jobset.x-k8s.io"),
                ("patch", "jobs.batch"),
                ("delete", "workloads.muster.dev"),
                ("update", "secrets"),
            ];
            let checked = [
                "priorityclasses.scheduling.k8s.io",
                "jobs.batch",
                "jobsets.jobset.x-k8s.io",
                "workloads.muster.dev",
                "secrets",
                "mutatingwebhookconfigurations.admissionregistration.k8s.io",
            ];
            let unused: Vec<String> = muster_e2e::rbac::granted(&rules)
                .into_iter()
                .filter(|(_, resource)| resource.ends_with(".kueue.x-k8s.io") || checked.contains(&resource.as_str()))
                .filter(|p| !used.contains(p))
                .filter(|(verb, resource)| !elsewhere.iter().any(|(v, r)| v == verb && r == resource))
                .map(|(verb, resource)| format!("{verb} {resource}"))
                .collect();
            muster_local_cluster::namespaces::delete_namespace(&test.client, &release_ns).await?;
            ensure!(
                unused.is_empty(),
                "the chart grants Kueue permissions the operator never used: {unused:?}; it used {used:?}"
            );
            Ok(())
        })
    })
    .await
}

/// A gang deleted while Kueue's eviction takes it apart (its pods take 10 s to stop):
/// it and its Kueue Workload go, it holds nothing, and the preemptor runs.
#[tokio::test]
async fn a_workload_deleted_while_being_evicted_goes_and_the_preemptor_runs() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-delete-evicted", &[], &[], |test| {
        Box::pin(async move {
            queues(test, 32, true).await?;
            let mut low = queued_gang("low", 4, Some("kueue-low"));
            for group in low["spec"]["podGroups"].as_array_mut().context("podGroups")? {
                group["template"]["metadata"] = json!({"annotations": {"muster-e2e-terminate-after": "10s"}});
            }
            test.create(low).await?;
            assert_runs_as_planned(test, "low").await?;
            test.create(queued_gang("high", 4, Some("kueue-high"))).await?;
            wait_kueue_condition(test, "low", "Evicted", "True").await?;
            // Its pods are still stopping.
            test.workloads().delete("low", &Default::default()).await?;
            let workloads = test.workloads();
            let kueue_workloads = kueue_api(&test.client, "Workload", "workloads", Some(&test.ns));
            wait::until("low and its Kueue Workload to be gone", Duration::from_secs(90), || {
                let (workloads, kueue_workloads) = (workloads.clone(), kueue_workloads.clone());
                async move {
                    let gone = workloads.get_opt("low").await?.is_none()
                        && kueue_workloads.get_opt("muster-low").await?.is_none();
                    Ok(gone.then_some(()))
                }
            })
            .await?;
            ensure!(!holds_devices(test, "low").await?, "the deleted gang holds nothing");
            wait_kueue_condition(test, "high", "Admitted", "True").await?;
            assert_runs_as_planned(test, "high").await?;
            usage_matches_devices(test, "team", &["high", "low"], 32).await?;
            Ok(())
        })
    })
    .await
}

/// An existing claim the gang names (`resourceClaimName`), which Kueue refuses in a
/// podSet, is charged once through a template owned by the Workload that mirrors it:
/// 2 workers with 2 GPUs each and the named GPU they share need 5 GPUs of quota.
#[tokio::test]
async fn an_existing_claim_the_gang_names_is_charged_once_in_kueues_quota() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-named", &[], &[], |test| {
        Box::pin(async move {
            test.create_claim_template("two-gpus", "gpu", 2).await?;
            let claim = json!({
                "metadata": {"name": "existing-gpu"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com", "count": 1}}]}},
            });
            test.claims()
                .create(&PostParams::default(), &serde_json::from_value(claim)?)
                .await?;
            queues(test, 4, false).await?;
            let mut workload = queued_gang("named", 2, None);
            workload["spec"]["resourceClaims"] =
                json!([{"name": "fabric", "resourceClaimName": "existing-gpu", "podGroups": ["workers"]}]);
            let workers = &mut workload["spec"]["podGroups"][1]["template"]["spec"];
            workers["containers"][0]["resources"]["claims"] = json!([{"name": "gpus"}, {"name": "fabric"}]);
            workers["resourceClaims"][0]["resourceClaimTemplateName"] = json!("two-gpus");
            test.create(workload).await?;
            wait_kueue(test, "named", "the named claim charged through a template", |o| {
                o.data["spec"]["podSets"].as_array().is_some_and(|sets| {
                    sets.iter().any(|s| {
                        s["name"] == "shared-claims"
                            && s["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
                                == "muster-named-quota-0"
                    })
                })
            })
            .await?;
            // 5 GPUs asked, 4 in the quota: Kueue does not admit it, then it does.
            waits_on_four_runs_on_five(test, "named").await?;
            usage_matches_devices(test, "team", &["named"], 5).await?;
            // The user's claim goes with the test; muster lets go of it once the gang ends.
            test.claims().delete("existing-gpu", &Default::default()).await?;
            Ok(())
        })
    })
    .await
}

/// A JobSet muster runs as a gang queues in Kueue through its gang, named by the
/// annotation `muster.dev/queue-name`. With Kueue's own JobSet webhook installed (whose
/// configuration the API server calls first), a JobSet that also carries Kueue's queue
/// label is refused with why: Kueue would suspend it and wait for a label muster moves.
/// Kueue charges the gang by the JobSet's pod template at once, before any pod exists;
/// it waits for Kueue's quota (its pods gated, nothing reserved), then runs with every
/// claim reserved, Kueue counting the devices muster holds; Kueue's own JobSet
/// integration never takes it, and the JobSet is told which admits it.
#[tokio::test]
async fn a_jobset_routed_through_muster_waits_for_kueues_quota_then_runs_reserved() -> Result<()> {
    with_kueue().await?;
    let port = webhook_port().await?;
    let args = operator_args(port);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    with_test("kueue-jobset", &args, &[], |test| {
        Box::pin(async move {
            wait_webhook_ready(test).await?;
            let check = muster_check(test).await?;
            cluster_queue(test, "team", 8, None, None).await?;
            require_check(test, &check).await?;
            let jobsets: Api<DynamicObject> = Api::namespaced_with(
                test.client.clone(),
                &test.ns,
                &ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("jobset.x-k8s.io", "v1alpha2", "JobSet"), "jobsets"),
            );
            let worker = json!({"spec": {"parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": "trainer",
                    "resources": {"requests": {"cpu": "16", "memory": "64Gi"}, "claims": [{"name": "gpus"}]}}],
                "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}],
            }}}});
            let jobset = |labels: Value, annotations: Value, suspend: bool| -> Result<DynamicObject> {
                Ok(serde_json::from_value(json!({
                    "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                    "metadata": {"name": "queued", "labels": labels, "annotations": annotations},
                    "spec": {"suspend": suspend, "replicatedJobs": [{"name": "workers", "replicas": 2, "template": worker}]},
                }))?)
            };
            let rack = json!({"muster.dev/required-topology": muster_local_cluster::fleet::RACK_LABEL});
            let both = jobset(
                json!({"muster.dev/gang": "true", "kueue.x-k8s.io/queue-name": "team"}),
                rack.clone(),
                false,
            )?;
            let message = match jobsets.create(&PostParams::default(), &both).await {
                Ok(_) => anyhow::bail!("a gang's JobSet carrying Kueue's queue label was admitted"),
                Err(e) => format!("{e:#}"),
            };
            ensure!(
                message.contains("kueue.x-k8s.io/queue-name") && message.contains("muster.dev/queue-name"),
                "{message}"
            );

            let mut annotations = rack;
            annotations["muster.dev/queue-name"] = json!("team");
            jobsets
                .create(&PostParams::default(), &jobset(json!({"muster.dev/gang": "true"}), annotations, true)?)
                .await?;
            // Suspended, it has no pod: Kueue charges its template's 8 GPUs for each worker.
            wait_kueue(test, "jobset-queued", "Kueue to charge the JobSet's template", |o| {
                let set = &o.data["spec"]["podSets"][0];
                set["count"] == 2 && set["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == "eight-gpus"
            })
            .await?;
            let resume = json!({"spec": {"suspend": false}});
            jobsets
                .patch("queued", &PatchParams::default(), &Patch::Merge(&resume))
                .await?;
            // 16 GPUs asked, 8 of quota: Kueue holds it, muster reserves nothing.
            test.wait_admitted_reason("jobset-queued", "WaitingForKueue", Duration::from_secs(90))
                .await?;
            ensure!(allocations(&test.claims()).await?.is_empty(), "nothing reserved before Kueue admits it");
            let stored = jobsets.get("queued").await?;
            ensure!(
                stored.labels().get("kueue.x-k8s.io/queue-name").is_none(),
                "the JobSet carries no queue label of Kueue's"
            );
            ensure!(stored.data["spec"]["suspend"].as_bool() != Some(true), "Kueue did not suspend the JobSet");
            test.wait_event("queued", "GangQueuedInKueue", "muster admits it").await?;
            // Quota for both: Kueue admits, muster reserves and releases.
            set_gpu_quota(test, 16).await?;
            wait_kueue_condition(test, "jobset-queued", "Admitted", "True").await?;
            test.wait_phase("jobset-queued", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            ensure!(allocations(&test.claims()).await?.len() == 2, "both workers' claims are reserved");
            usage_matches_devices(test, "team", &["jobset-queued"], 16).await?;
            jobsets.delete("queued", &Default::default()).await?;
            Ok(())
        })
    })
    .await
}

/// A hand-written Workload whose group's pods another controller makes is charged by its
/// largest member; when the pods change (small ones replaced by pods with eight GPUs
/// each) while Kueue has not reserved quota, its Kueue Workload is made again for them,
/// and the gang runs only once Kueue has quota for them.
#[tokio::test]
async fn a_template_less_gang_is_charged_by_its_largest_member_and_again_when_its_pods_change() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-members", &[], &[], |test| {
        Box::pin(async move {
            queues(test, 0, false).await?;
            // No quota at all: the small pods, which ask for no GPU, are not admitted
            // either.
            let mut patch = json!({"spec": {"resourceGroups": quota("default", 0)}});
            patch["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuota"] = json!("0");
            kueue_api(&test.client, "ClusterQueue", "clusterqueues", None)
                .patch(&format!("cq-{}-team", test.ns), &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            let mut workload = muster_e2e::scenario::workload_of_joining_pods("joined", "main", 2);
            workload["metadata"]["labels"] = json!({"kueue.x-k8s.io/queue-name": "team"});
            test.create(workload).await?;
            let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(test.client.clone(), &test.ns);
            let mut small = muster_e2e::scenario::job_joining("joined", "main", 2);
            small["metadata"]["name"] = json!("small");
            let spec = &mut small["spec"]["template"]["spec"];
            spec.as_object_mut().map(|s| s.remove("resourceClaims"));
            spec["containers"][0]["resources"] = json!({"requests": {"cpu": "1"}});
            jobs.create(&PostParams::default(), &serde_json::from_value(small)?).await?;
            wait_kueue(test, "joined", "Kueue to charge the small pods", |o| {
                o.data["spec"]["podSets"][0]["template"]["spec"]["resourceClaims"]
                    .as_array()
                    .is_none_or(Vec::is_empty)
            })
            .await?;
            let first = kueue_workload(test, "joined").await?.metadata.uid;

            jobs.delete("small", &kube::api::DeleteParams::background()).await?;
            let mut large = muster_e2e::scenario::job_joining("joined", "main", 2);
            large["metadata"]["name"] = json!("large");
            jobs.create(&PostParams::default(), &serde_json::from_value(large)?).await?;
            wait_kueue(test, "joined", "Kueue's Workload made again for the large pods", |o| {
                o.metadata.uid != first
                    && o.data["spec"]["podSets"][0]["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
                        == "eight-gpus"
            })
            .await?;
            test.wait_event("joined", "KueueWorkloadRebuilt", "made again").await?;
            set_gpu_quota(test, 16).await?;
            wait_kueue_condition(test, "joined", "Admitted", "True").await?;
            test.wait_phase("joined", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            usage_matches_devices(test, "team", &["joined"], 16).await?;
            Ok(())
        })
    })
    .await
}

/// The queue label of an admitted gang cannot change or go (the chart's admission
/// policy, run by the API server); a suspended gang that holds nothing may move, and its
/// Kueue Workload follows it to the new LocalQueue.
#[tokio::test]
async fn the_queue_of_an_admitted_gang_is_fixed_and_a_suspended_one_moves() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-move", &[], &[], |test| {
        Box::pin(async move {
            cluster_queue(test, "team", 32, None, None).await?;
            cluster_queue(test, "other", 32, None, None).await?;
            test.create(queued_gang("mover", 2, None)).await?;
            assert_runs_as_planned(test, "mover").await?;
            usage_matches_devices(test, "team", &["mover"], 16).await?;
            let params = PatchParams::default();
            for (what, label) in [("changed", json!("other")), ("removed", Value::Null)] {
                let patch = json!({"metadata": {"labels": {"kueue.x-k8s.io/queue-name": label}}});
                let message = match test.workloads().patch("mover", &params, &Patch::Merge(&patch)).await {
                    Ok(_) => anyhow::bail!("the queue label of an admitted gang was {what}"),
                    Err(e) => format!("{e:#}"),
                };
                ensure!(
                    message.contains("cannot change") && message.contains("while the gang is admitted"),
                    "{message}"
                );
            }
            let suspend = |on: bool| json!({"spec": {"suspend": on}});
            test.workloads()
                .patch("mover", &params, &Patch::Merge(&suspend(true)))
                .await?;
            test.wait_phase("mover", WorkloadPhase::Suspended, Duration::from_secs(90))
                .await?;
            wait_kueue(test, "mover", "Kueue to give the quota back", |o| {
                condition_status(o, "QuotaReserved").as_deref() != Some("True")
            })
            .await?;
            let patch = json!({"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "other"}}});
            test.workloads().patch("mover", &params, &Patch::Merge(&patch)).await?;
            wait_kueue(test, "mover", "Kueue's Workload to move to LocalQueue other", |o| {
                o.data["spec"]["queueName"] == "other"
            })
            .await?;
            test.workloads()
                .patch("mover", &params, &Patch::Merge(&suspend(false)))
                .await?;
            wait_kueue_condition(test, "mover", "Admitted", "True").await?;
            assert_runs_as_planned(test, "mover").await?;
            usage_matches_devices(test, "other", &["mover"], 16).await?;
            usage_matches_devices(test, "team", &[], 0).await?;
            Ok(())
        })
    })
    .await
}

/// What keeps a gang from queueing in Kueue is a condition, not a line in the log: an
/// existing claim it names that is not there yet (then it queues once it is); and a gang
/// of nine groups is charged as nine podSets.
#[tokio::test]
async fn a_gang_kueue_cannot_charge_yet_says_why_and_nine_groups_queue() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-conditions", &[], &[], |test| {
        Box::pin(async move {
            queues(test, 0, false).await?;
            let mut named = queued_gang("named", 1, None);
            named["spec"]["resourceClaims"] =
                json!([{"name": "fabric", "resourceClaimName": "later", "podGroups": ["workers"]}]);
            test.create(named).await?;
            let api = test.workloads();
            let message = wait::until("the gang to say what it waits for", Duration::from_secs(60), || async {
                Ok(api.get_opt("named").await?.and_then(|w| w.status).and_then(|s| {
                    s.conditions
                        .into_iter()
                        .find(|c| c.type_ == "Created" && c.reason == "ResourceClaimNotFound")
                        .map(|c| c.message)
                }))
            })
            .await?;
            ensure!(message.contains("Kueue cannot charge the gang for it"), "{message}");
            let claim = json!({
                "metadata": {"name": "later"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com", "count": 1}}]}},
            });
            test.claims()
                .create(&PostParams::default(), &serde_json::from_value(claim)?)
                .await?;
            wait_kueue(test, "named", "the gang to queue once its claim exists", |_| true).await?;

            let groups: Vec<Value> = (0..9)
                .map(|i| {
                    json!({"name": format!("g{i}"), "replicas": 1, "template": {"spec": {
                        "tolerations": [{"key": "muster.dev/fenced", "operator": "Exists"}],
                        "containers": [{"name": "main", "image": "w", "resources": {"requests": {"cpu": "1"}}}],
                    }}})
                })
                .collect();
            test.create(json!({
                "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
                "metadata": {"name": "nine", "labels": {"kueue.x-k8s.io/queue-name": "team"}},
                "spec": {"podGroups": groups},
            }))
            .await?;
            wait_kueue(test, "nine", "nine podSets", |o| {
                o.data["spec"]["podSets"].as_array().map(Vec::len) == Some(9)
            })
            .await?;
            test.claims().delete("later", &Default::default()).await?;
            Ok(())
        })
    })
    .await
}

/// Kueue's waitForPodsReady hears when a running gang stops being ready: a restart says
/// `PodsReady=False` (WaitForRecovery) at once, also while the restart waits its backoff
/// on the reservation, and `True` again once the next attempt runs (issue 25, item 10).
#[tokio::test]
async fn a_restarting_gang_tells_kueue_its_pods_are_not_ready_until_they_run_again() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-pods-ready", &[], &[], |test| {
        Box::pin(async move {
            queues(test, 16, false).await?;
            let mut workload = queued_gang("trainer", 2, None);
            workload["spec"]["failurePolicy"] =
                json!({"maxRestarts": 2, "restartBackoff": {"initialSeconds": 30, "maxSeconds": 30}});
            test.create(workload).await?;
            assert_runs_as_planned(test, "trainer").await?;
            wait_kueue_condition(test, "trainer", "PodsReady", "True").await?;

            let failed_at = std::time::Instant::now();
            test.exit_pod("trainer-workers-0", 1).await?;
            let object = wait_kueue_condition(test, "trainer", "PodsReady", "False").await?;
            // The backoff keeps the gang Restarting for 30 s: hearing it sooner is hearing
            // it from the restart, not from the next attempt's commit.
            ensure!(
                failed_at.elapsed() < Duration::from_secs(25),
                "PodsReady=False only after {:?}",
                failed_at.elapsed()
            );
            let reason = object.data["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == "PodsReady")
                .and_then(|c| c["reason"].as_str().map(String::from));
            ensure!(reason.as_deref() == Some("WaitForRecovery"), "{reason:?}");
            wait_kueue_condition(test, "trainer", "PodsReady", "True").await?;
            assert_runs_as_planned(test, "trainer").await?;
            usage_matches_devices(test, "team", &["trainer"], 16).await?;
            Ok(())
        })
    })
    .await
}

/// Two flavors, `muster-e2e-rack-a` (nodes of rack-0000) and `muster-e2e-rack-b`
/// (rack-0001), in that order, with `gpus` GPUs each in this test's ClusterQueue behind
/// LocalQueue `team`.
async fn rack_flavors(test: &Test, gpus: u32) -> Result<()> {
    let rack = muster_local_cluster::fleet::RACK_LABEL;
    let flavors = kueue_api(&test.client, "ResourceFlavor", "resourceflavors", None);
    for (flavor, value) in [("muster-e2e-rack-a", "rack-0000"), ("muster-e2e-rack-b", "rack-0001")] {
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
            "metadata": {"name": flavor}, "spec": {"nodeLabels": {rack: value}},
        }))?;
        match flavors.create(&PostParams::default(), &object).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    let flavor = |name: &str| {
        json!({"name": name, "resources": [
            {"name": "cpu", "nominalQuota": "1000"},
            {"name": "memory", "nominalQuota": "10Ti"},
            {"name": GPU_RESOURCE, "nominalQuota": gpus},
        ]})
    };
    let queue: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
        "metadata": {"name": format!("cq-{}-team", test.ns)},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{
            "coveredResources": ["cpu", "memory", GPU_RESOURCE],
            "flavors": [flavor("muster-e2e-rack-a"), flavor("muster-e2e-rack-b")],
        }]},
    }))?;
    kueue_api(&test.client, "ClusterQueue", "clusterqueues", None)
        .create(&PostParams::default(), &queue)
        .await?;
    let local: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
        "metadata": {"name": "team"}, "spec": {"clusterQueue": format!("cq-{}-team", test.ns)},
    }))?;
    kueue_api(&test.client, "LocalQueue", "localqueues", Some(&test.ns))
        .create(&PostParams::default(), &local)
        .await?;
    Ok(())
}

/// Two groups charged to two flavors whose node labels set the same key to different
/// racks each run in the rack of their own flavor: not both in the last one, over its
/// quota (issue 25, item 3).
#[tokio::test]
async fn groups_charged_to_different_flavors_run_on_their_own_flavors_nodes() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-flavors", &[], &[], |test| {
        Box::pin(async move {
            let rack = muster_local_cluster::fleet::RACK_LABEL;
            // One node's worth of GPUs in each flavor: the first group takes rack-a's,
            // the second has to go to rack-b.
            rack_flavors(test, 8).await?;

            let mut workload = gang("split", 1, None);
            workload["metadata"]["labels"] = json!({"kueue.x-k8s.io/queue-name": "team"});
            workload["spec"].as_object_mut().context("spec")?.remove("topology");
            let worker = workload["spec"]["podGroups"][1].clone();
            let mut first = worker.clone();
            first["name"] = json!("first");
            let mut second = worker;
            second["name"] = json!("second");
            workload["spec"]["podGroups"] = json!([first, second]);
            test.create(workload).await?;
            wait_kueue_condition(test, "split", "Admitted", "True").await?;
            // Two racks, so not `assert_runs_as_planned`, which expects one.
            let ran = test
                .wait_phase("split", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            let placement = ran.status.and_then(|s| s.placement).context("placement")?;
            let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(test.client.clone());
            for (group, expected) in [("first", "rack-0000"), ("second", "rack-0001")] {
                let planned = placement
                    .pods
                    .iter()
                    .find(|p| p.name.starts_with(&format!("split-{group}-")))
                    .with_context(|| format!("a pod of {group}"))?;
                let node = nodes.get(&planned.node).await?;
                let in_rack = node.labels().get(rack).cloned();
                ensure!(
                    in_rack.as_deref() == Some(expected),
                    "{group} runs on {} in {in_rack:?}, not in its flavor's {expected}",
                    planned.node
                );
            }
            usage_matches_devices(test, "team", &["split"], 16).await?;
            Ok(())
        })
    })
    .await
}

/// What Kueue assigned to podSet `pod_set` under TAS: each domain's values of the
/// assignment's levels, with the pods counted there.
fn topology_assignment(object: &DynamicObject, pod_set: &str) -> Result<Vec<(Vec<String>, u64)>> {
    let assignment = object.data["status"]["admission"]["podSetAssignments"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|a| a["name"] == pod_set)
        .with_context(|| format!("no assignment for podSet {pod_set}"))?;
    let mut domains = Vec::new();
    for slice in assignment["topologyAssignment"]["slices"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let count = slice["domainCount"].as_u64().unwrap_or(0) as usize;
        for d in 0..count {
            let values = slice["valuesPerLevel"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|level| match level["universal"].as_str() {
                    Some(value) => value.to_string(),
                    None => {
                        let individual = &level["individual"];
                        format!(
                            "{}{}{}",
                            individual["prefix"].as_str().unwrap_or_default(),
                            individual["roots"][d].as_str().unwrap_or_default(),
                            individual["suffix"].as_str().unwrap_or_default()
                        )
                    }
                })
                .collect();
            let pods = &slice["podCounts"];
            let pods = pods["universal"]
                .as_u64()
                .or_else(|| pods["individual"][d].as_u64())
                .unwrap_or(0);
            domains.push((values, pods));
        }
    }
    ensure!(
        !domains.is_empty(),
        "podSet {pod_set} has no topology assignment: {assignment}"
    );
    Ok(domains)
}

/// Issue 25, item 4: Kueue groups no more than a leader and its workers, so each podSet
/// of a three-group gang gets a topology assignment of its own, with pods counted per
/// node. Each group must run inside its own podSet's assignment: a group that needs only
/// what Kueue counts (CPU) on exactly the nodes and counts Kueue chose, a group with
/// devices (which Kueue's TAS does not count) in the rack Kueue chose. Before, muster
/// planned the gang anywhere in the union of the assignments and packed it its own way.
#[tokio::test]
async fn a_three_group_gang_runs_where_kueue_counted_each_groups_pods() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-tas3", &[], &[], |test| {
        Box::pin(async move {
            let rack = muster_local_cluster::fleet::RACK_LABEL;
            let hostname = "kubernetes.io/hostname";
            let suffix = test.ns.clone();
            for (kind, plural, object) in [
                (
                    "Topology",
                    "topologies",
                    json!({
                        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Topology",
                        "metadata": {"name": format!("nodes-{suffix}")},
                        "spec": {"levels": [{"nodeLabel": rack}, {"nodeLabel": hostname}]},
                    }),
                ),
                (
                    "ResourceFlavor",
                    "resourceflavors",
                    json!({
                        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                        "metadata": {"name": format!("tas3-{suffix}")},
                        "spec": {"nodeLabels": {"type": "kwok"}, "topologyName": format!("nodes-{suffix}")},
                    }),
                ),
            ] {
                let object: DynamicObject = serde_json::from_value(object)?;
                kueue_api(&test.client, kind, plural, None)
                    .create(&PostParams::default(), &object)
                    .await?;
            }
            let check = muster_check(test).await?;
            cluster_queue_of(test, "team", &format!("tas3-{suffix}"), 64, None, None).await?;
            require_check(test, &check).await?;
            // A pod outside Kueue and muster takes most of node-00001's CPUs, so that
            // the nodes of rack-0000 differ for Kueue's best fit and muster's first fit.
            test.pods()
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "metadata": {"name": "cpu-hog"},
                        "spec": {
                            "nodeName": "node-00001",
                            "terminationGracePeriodSeconds": 0,
                            "containers": [{"name": "main", "image": "hog", "resources": {"requests": {"cpu": "40"}}}],
                        },
                    }))?,
                )
                .await?;

            let cpu_only = |name: &str, replicas: i32, cpu: &str| {
                json!({"name": name, "replicas": replicas, "template": {"spec": {
                    "containers": [{"name": "main", "image": name, "resources": {"requests": {"cpu": cpu, "memory": "8Gi"}}}],
                }}})
            };
            let workers = json!({"name": "workers", "replicas": 2, "template": {"spec": {
                "containers": [{
                    "name": "main", "image": "trainer",
                    "resources": {"requests": {"cpu": "8", "memory": "16Gi"}, "claims": [{"name": "gpus"}]},
                }],
                "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}],
            }}});
            test.create(json!({
                "apiVersion": "muster.dev/v1alpha1", "kind": "Workload",
                "metadata": {"name": "tas3", "labels": {"kueue.x-k8s.io/queue-name": "team"}},
                "spec": {
                    "topology": {"required": rack},
                    "successPolicy": {"podGroups": ["driver"]},
                    "podGroups": [cpu_only("driver", 1, "2"), cpu_only("ps", 2, "16"), workers],
                },
            }))
            .await?;
            wait_kueue(test, "tas3", "each podSet to ask Kueue for one rack", |o| {
                (0..3).all(|i| o.data["spec"]["podSets"][i]["topologyRequest"]["required"] == rack)
            })
            .await?;
            let workload = assert_runs_as_planned(test, "tas3").await?;
            usage_matches_devices(test, "team", &["tas3"], 16).await?;
            let admitted = kueue_workload(test, "tas3").await?;
            let placement = workload.status.and_then(|s| s.placement).context("placement")?;
            let nodes: BTreeMap<String, String> = test
                .cluster
                .nodes
                .iter()
                .map(|n| (n.name.clone(), n.rack.clone()))
                .collect();
            for group in ["driver", "ps", "workers"] {
                let assigned = topology_assignment(&admitted, group)?;
                let mut on_node: BTreeMap<&str, u64> = BTreeMap::new();
                for pod in placement.pods.iter().filter(|p| p.name.starts_with(&format!("tas3-{group}-"))) {
                    *on_node.entry(pod.node.as_str()).or_default() += 1;
                }
                if group == "workers" {
                    // Devices: held to the racks of the nodes Kueue chose for the podSet.
                    let racks: BTreeSet<&str> = assigned
                        .iter()
                        .filter_map(|(v, _)| nodes.get(v.last()?).map(String::as_str))
                        .collect();
                    for node in on_node.keys() {
                        let in_rack = nodes.get(*node).map(String::as_str).unwrap_or_default();
                        ensure!(
                            racks.contains(in_rack),
                            "a worker runs on {node} in {in_rack}, outside Kueue's racks {racks:?}"
                        );
                    }
                    continue;
                }
                // CPU only: the very nodes, as many pods as Kueue counted on each.
                // (Kueue writes the finest level, the hostname, last.)
                let counted: BTreeMap<&str, u64> = assigned
                    .iter()
                    .filter_map(|(v, n)| Some((v.last()?.as_str(), *n)))
                    .collect();
                ensure!(
                    on_node == counted,
                    "group {group} runs {on_node:?}, Kueue counted {counted:?}"
                );
            }
            Ok(())
        })
    })
    .await
}

/// Issue 25, item 6: a maintenance DeviceTaintRule over every GPU makes a gang Kueue
/// reserved quota for unable to fit even on the emptied cluster. That is the cluster's
/// state of the moment, not a wrong spec: muster answers Retry (never Rejected, which
/// would deactivate the Kueue Workload for good), holds nothing, and the gang runs once
/// the rule is gone.
#[tokio::test]
async fn a_maintenance_taint_over_every_gpu_is_waited_out_not_rejected() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-maintenance", &[], &[], |test| {
        Box::pin(async move {
            let check = muster_check(test).await?;
            cluster_queue(test, "team", 64, None, None).await?;
            require_check(test, &check).await?;
            let rules: Api<DeviceTaintRule> = Api::all(test.client.clone());
            let name = format!("maintenance-{}", test.ns);
            let rule: DeviceTaintRule = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {
                    "deviceSelector": {"driver": GPU_DRIVER},
                    "taint": {"key": "example.com/maintenance", "value": "true", "effect": "NoSchedule"},
                },
            }))?;
            rules.create(&PostParams::default(), &rule).await?;
            let during = async {
                test.create(queued_gang("patient", 2, None)).await?;
                wait_kueue(test, "patient", "muster to answer Retry", |o| {
                    o.data["status"]["admissionChecks"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|c| {
                            c["state"] == "Retry"
                                && c["message"]
                                    .as_str()
                                    .is_some_and(|m| m.contains("even on an empty cluster"))
                        })
                })
                .await?;
                let object = kueue_workload(test, "patient").await?;
                ensure!(
                    object.data["spec"]["active"] != json!(false),
                    "Kueue deactivated the gang: {}",
                    object.data["status"]
                );
                ensure!(
                    !holds_devices(test, "patient").await?,
                    "a gang answered Retry holds nothing"
                );
                anyhow::Ok(())
            }
            .await;
            rules.delete(&name, &Default::default()).await?;
            during?;
            // Kueue asks again after the requeue delay; now the gang fits.
            wait::until(
                "the gang to run once the maintenance is over",
                Duration::from_secs(180),
                || async {
                    let workload = test.workloads().get("patient").await?;
                    Ok((workload.status.as_ref().and_then(|s| s.phase) == Some(WorkloadPhase::Running)).then_some(()))
                },
            )
            .await?;
            assert_runs_as_planned(test, "patient").await?;
            let object = kueue_workload(test, "patient").await?;
            ensure!(
                !object.data["status"]["admissionChecks"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["state"] == "Rejected"),
                "never Rejected: {}",
                object.data["status"]
            );
            usage_matches_devices(test, "team", &["patient"], 16).await?;
            Ok(())
        })
    })
    .await
}

/// Review of issue 25: a template-less group is charged with its pods' node selector, so
/// that Kueue assigns a flavor whose nodes the pods can use. The pods select rack-0001;
/// the first flavor with quota is rack-0000's. Before, the charge dropped the selector,
/// Kueue assigned rack-0000's flavor, and the gang, whose pods cannot go there, was
/// answered Retry every minute, for ever.
#[tokio::test]
async fn a_template_less_group_is_charged_with_its_node_selector_and_kueue_picks_a_flavor_it_can_use() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-selector", &[], &[], |test| {
        Box::pin(async move {
            let rack = muster_local_cluster::fleet::RACK_LABEL;
            rack_flavors(test, 16).await?;
            let mut workload = muster_e2e::scenario::workload_of_joining_pods("picky", "main", 2);
            workload["metadata"]["labels"] = json!({"kueue.x-k8s.io/queue-name": "team"});
            test.create(workload).await?;
            let mut job = muster_e2e::scenario::job_joining("picky", "main", 2);
            job["spec"]["template"]["spec"]["nodeSelector"] = json!({rack: "rack-0001"});
            let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(test.client.clone(), &test.ns);
            jobs.create(&PostParams::default(), &serde_json::from_value(job)?)
                .await?;
            wait_kueue_condition(test, "picky", "Admitted", "True").await?;
            let admitted = kueue_workload(test, "picky").await?;
            let flavor = admitted.data["status"]["admission"]["podSetAssignments"][0]["flavors"][GPU_RESOURCE].clone();
            ensure!(flavor == "muster-e2e-rack-b", "Kueue assigned {flavor}");
            let ran = test
                .wait_phase("picky", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            let placement = ran.status.and_then(|s| s.placement).context("placement")?;
            ensure!(
                placement.topology_value.is_none() || placement.topology_value.as_deref() == Some("rack-0001"),
                "{placement:?}"
            );
            usage_matches_devices(test, "team", &["picky"], 16).await?;
            Ok(())
        })
    })
    .await
}

/// Review of issue 25 (item 11's remainder): a gang whose request waits for an object
/// that may never come — here a group of two whose Job makes one pod — while Kueue holds
/// its quota. After a grace of a minute muster answers Retry with why, so Kueue gives
/// the quota to others meanwhile; before, the check stayed Pending and the quota was held
/// for ever.
#[tokio::test]
async fn a_gang_short_of_pods_gives_kueue_its_quota_back_after_a_grace() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-short", &[], &[], |test| {
        Box::pin(async move {
            let check = muster_check(test).await?;
            queues(test, 16, false).await?;
            require_check(test, &check).await?;
            let mut workload = muster_e2e::scenario::workload_of_joining_pods("short", "main", 2);
            workload["metadata"]["labels"] = json!({"kueue.x-k8s.io/queue-name": "team"});
            test.create(workload).await?;
            let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(test.client.clone(), &test.ns);
            jobs.create(
                &PostParams::default(),
                &serde_json::from_value(muster_e2e::scenario::job_joining("short", "main", 1))?,
            )
            .await?;
            wait_kueue_condition(test, "short", "QuotaReserved", "True").await?;
            wait::until(
                "muster to answer Retry for the pod that never comes",
                Duration::from_secs(150),
                || async {
                    let object = kueue_workload(test, "short").await?;
                    let retried = object.data["status"]["admissionChecks"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|c| c["state"] == "Retry" && c["message"].as_str().is_some_and(|m| m.contains("main")));
                    Ok(retried.then_some(()))
                },
            )
            .await?;
            // Kueue evicts it and requeues it: the quota is free meanwhile.
            wait::until("Kueue to free the quota", Duration::from_secs(60), || async {
                Ok((kueue_gpu_usage(test, "team").await? == 0).then_some(()))
            })
            .await?;
            ensure!(!holds_devices(test, "short").await?, "the gang holds nothing");
            Ok(())
        })
    })
    .await
}

/// A gang queued in Kueue is worth no more than its pods there either: a Workload of the
/// highest class joined by pods at default priority gets its pods' priority in Kueue
/// (so Kueue preempts nothing for it at the class's), and muster holds it, naming the
/// field.
#[tokio::test]
async fn kueue_sees_a_gang_at_no_more_than_its_pods_priority() -> Result<()> {
    with_kueue().await?;
    with_test("kueue-priority", &[], &[], |test| {
        Box::pin(async move {
            muster_e2e::scenario::priority_classes(&test.client).await?;
            queues(test, 16, false).await?;
            let mut workload = muster_e2e::scenario::ranked(
                muster_e2e::scenario::workload_of_joining_pods("jumper", "main", 2),
                muster_e2e::scenario::HIGH,
            );
            workload["metadata"]["labels"] = json!({"kueue.x-k8s.io/queue-name": "team"});
            test.create(workload).await?;
            let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(test.client.clone(), &test.ns);
            let job = muster_e2e::scenario::job_joining("jumper", "main", 2);
            jobs.create(&PostParams::default(), &serde_json::from_value(job)?)
                .await?;
            wait_kueue(test, "jumper", "Kueue's Workload", |_| true).await?;
            let queued = kueue_workload(test, "jumper").await?;
            ensure!(
                queued.data["spec"]["priority"].as_i64().unwrap_or(0) == 0,
                "Kueue sees the pods' priority, not the class's: {}",
                queued.data["spec"]
            );
            test.wait_admitted_reason(
                "jumper",
                muster_api::conditions::REASON_PRIORITY_ABOVE_PODS,
                Duration::from_secs(90),
            )
            .await?;
            Ok(())
        })
    })
    .await
}
