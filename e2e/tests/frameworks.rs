//! Training jobs that enter unchanged: a JobSet, a Kubeflow TrainJob and an indexed Job
//! labelled muster.dev/gang run as gangs, against real JobSet and Trainer controller
//! managers (built from their Go modules) and muster's admission webhook on loopback.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use muster_api::v1alpha1::{Workload, WorkloadPhase};
use muster_e2e::frameworks::*;
use muster_e2e::scenario::{Test, allocations};
use muster_local_cluster::fleet::RACK_LABEL;
use muster_local_cluster::wait;
use serde_json::json;

fn start_operator(test: &mut Test, port: u16) -> Result<()> {
    let args = operator_args(port);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    test.start_operator(&args, &[])
}

#[tokio::test]
async fn a_labelled_jobset_runs_as_one_gang_in_one_rack() -> Result<()> {
    with_frameworks("jobset", |test| {
        Box::pin(async move {
            create(&jobsets(test), labelled_jobset("train", 4, json!({}))).await?;
            let devices = runs_as_one_gang(test, "jobset-train", 5).await?;
            ensure!(devices.len() == 4, "four workers with claims: {devices:?}");
            let workload = test.workloads().get("jobset-train").await?;
            let owner = &workload.metadata.owner_references.clone().unwrap_or_default()[0];
            ensure!(
                owner.kind == "JobSet" && owner.name == "train",
                "owned by the JobSet: {owner:?}"
            );
            wait_job_event(test, "train", "GangAdmitted", "reserved").await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_labelled_indexed_job_runs_as_one_gang() -> Result<()> {
    with_frameworks("job", |test| {
        Box::pin(async move {
            create_job(test, indexed_job("sweep", 4, json!({}))).await?;
            let devices = runs_as_one_gang(test, "job-sweep", 4).await?;
            ensure!(devices.len() == 4, "{devices:?}");
            wait_job_event(test, "sweep", "GangAdmitted", "reserved").await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_labelled_trainjob_runs_as_one_gang_and_gives_every_device_back_when_deleted() -> Result<()> {
    with_frameworks("trainjob", |test| {
        Box::pin(async move {
            let runtime = torch_runtime(test).await?;
            create(&trainjobs(test), labelled_trainjob("llama", &runtime, 4)).await?;
            let devices = runs_as_one_gang(test, "jobset-llama", 4).await?;
            ensure!(devices.len() == 4, "{devices:?}");

            // Deleting the TrainJob deletes its JobSet, the Workload, and gives back
            // every device.
            trainjobs(test).delete("llama", &DeleteParams::background()).await?;
            all_given_back(test, "jobset-llama").await?;
            cluster_training_runtimes(test)
                .delete(&runtime, &DeleteParams::default())
                .await?;
            Ok(())
        })
    })
    .await
}

/// Issue 33: a TrainJob on a runtime with initializers (torchtune's shape) runs them
/// first, outside the gang and ungated; the node step's gang is reserved whole only once
/// they are done and JobSet has made its pods, every device before any node pod starts.
#[tokio::test]
async fn a_trainjob_whose_runtime_initializes_first_gangs_its_nodes_once_the_initializers_are_done() -> Result<()> {
    with_frameworks("trainjob-steps", |test| {
        Box::pin(async move {
            // Initializers need no GPU: a CPU node, outside muster's fence, runs them.
            let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(test.client.clone());
            let cpu_node = format!("cpu-{}", test.ns);
            nodes
                .create(
                    &kube::api::PostParams::default(),
                    &serde_json::from_value(json!({
                        "metadata": {"name": cpu_node, "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                            "labels": {"kubernetes.io/hostname": cpu_node, "kubernetes.io/os": "linux", "type": "kwok"}},
                        "status": {"allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
                            "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"}, "phase": "Running"},
                    }))?,
                )
                .await?;
            let outcome = initializers_then_nodes(test).await;
            nodes.delete(&cpu_node, &kube::api::DeleteParams::default()).await?;
            outcome
        })
    })
    .await
}

/// The body of the test above, on a cluster with a CPU node.
async fn initializers_then_nodes(test: &mut muster_e2e::scenario::Test) -> Result<()> {
    {
        {
            let runtime = initializing_runtime(test).await?;
            create(&trainjobs(test), labelled_trainjob("tune", &runtime, 2)).await?;
            let workload = wait::until("the gang's Workload", Duration::from_secs(60), || {
                let api = test.workloads();
                async move { Ok(api.get_opt("jobset-tune").await?) }
            })
            .await?;
            let groups: Vec<String> = workload.spec.pod_groups.iter().map(|g| g.name.clone()).collect();
            ensure!(groups == ["node"], "the gang is the node step: {groups:?}");
            ensure!(
                !workload
                    .metadata
                    .annotations
                    .unwrap_or_default()
                    .contains_key(muster_api::labels::INVALID),
                "the gang is not held"
            );

            // The initializers run at once, ungated and outside the gang; no node pod yet.
            let pods = test.pods();
            let initializers: Vec<String> = wait::until("both initializers to run", Duration::from_secs(90), || {
                let pods = pods.clone();
                async move {
                    let list = pods
                        .list(&ListParams::default().labels("jobset.sigs.k8s.io/jobset-name=tune"))
                        .await?
                        .items;
                    let running: Vec<String> = list
                        .iter()
                        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                        .filter_map(|p| p.metadata.name.clone())
                        .collect();
                    Ok((running.len() == 2).then_some(running))
                }
            })
            .await?;
            ensure!(
                initializers.iter().all(|p| p.contains("initializer")),
                "only initializers run before they are done: {initializers:?}"
            );
            ensure!(
                test.gang_pods("jobset-tune").await?.is_empty(),
                "no node pod before the initializers are done"
            );

            for pod in &initializers {
                test.exit_pod(pod, 0).await?;
            }
            let devices = runs_as_one_gang(test, "jobset-tune", 2).await?;
            ensure!(devices.len() == 2, "{devices:?}");
            let trainjob = trainjobs(test).get("tune").await?;
            let failed = trainjob.data["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Failed" && c["status"] == "True");
            ensure!(!failed, "the TrainJob did not fail: {}", trainjob.data["status"]);
            Ok(())
        }
    }
}

#[tokio::test]
async fn deleting_a_jobset_gives_back_every_device() -> Result<()> {
    with_frameworks("jobset-delete", |test| {
        Box::pin(async move {
            create(&jobsets(test), labelled_jobset("gone", 2, json!({}))).await?;
            runs_as_one_gang(test, "jobset-gone", 3).await?;
            jobsets(test).delete("gone", &DeleteParams::background()).await?;
            all_given_back(test, "jobset-gone").await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_jobset_restart_runs_its_new_pods_as_the_gang_again() -> Result<()> {
    with_frameworks("jobset-restart", |test| {
        Box::pin(async move {
            let restartable = json!({"spec": {"failurePolicy": {"maxRestarts": 1}}});
            create(&jobsets(test), labelled_jobset("again", 2, restartable)).await?;
            let before = runs_as_one_gang(test, "jobset-again", 3).await?;
            let worker = test
                .pods()
                .list(&ListParams::default().labels("jobset.sigs.k8s.io/replicatedjob-name=workers"))
                .await?
                .items
                .into_iter()
                .next()
                .context("a worker")?;
            let old: BTreeSet<String> = test
                .gang_pods("jobset-again")
                .await?
                .iter()
                .filter_map(|p| p.metadata.uid.clone())
                .collect();
            test.exit_pod(worker.metadata.name.as_deref().unwrap_or_default(), 1)
                .await?;
            // JobSet recreates its Jobs; muster admits the new pods as the gang again.
            let pods = test.pods();
            wait::until("JobSet to make new pods", Duration::from_secs(120), || {
                let (pods, old) = (pods.clone(), old.clone());
                async move {
                    let fresh = pods
                        .list(&ListParams::default().labels("muster.dev/workload=jobset-again"))
                        .await?
                        .items
                        .into_iter()
                        .filter(|p| p.metadata.uid.as_ref().is_some_and(|u| !old.contains(u)))
                        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                        .count();
                    Ok((fresh == 3).then_some(()))
                }
            })
            .await?;
            let after = runs_as_one_gang(test, "jobset-again", 3).await?;
            let nodes = |devices: &BTreeMap<String, Vec<(String, String)>>| -> BTreeSet<Vec<(String, String)>> {
                devices.values().cloned().collect()
            };
            // The new pods went back onto the old pods' nodes and devices.
            ensure!(
                nodes(&before) == nodes(&after),
                "devices before the restart: {:?}; after: {:?}",
                nodes(&before),
                nodes(&after)
            );
            // JobSet restarted it: muster did not count a restart of its own.
            let workload = test.workloads().get("jobset-again").await?;
            let restarts = workload.status.as_ref().map_or(0, |s| s.restarts);
            ensure!(restarts == 0, "muster restarted the gang itself {restarts} times");
            Ok(())
        })
    })
    .await
}

/// Issue 20: while a Job waits out its backoff before it replaces a failed pod, the
/// devices the failed pod freed are held for the replacement: a gang of the same
/// priority waiting for exactly that room does not take them in between.
#[tokio::test]
async fn a_failed_pods_devices_are_held_for_its_replacement_against_a_waiting_gang() -> Result<()> {
    with_frameworks("job-hold", |test| {
        Box::pin(async move {
            // One rack full, the Job's three pods in the other: a gang of two workers in
            // one rack waits for one more node there.
            test.create(muster_e2e::scenario::gang("filler", 4, None)).await?;
            test.wait_phase("filler", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            create_job(test, indexed_job("held", 3, json!({}))).await?;
            runs_as_one_gang(test, "job-held", 3).await?;
            test.create(muster_e2e::scenario::gang("rival", 2, None)).await?;
            test.wait_phase("rival", WorkloadPhase::Queued, Duration::from_secs(60))
                .await?;
            let victim = test
                .gang_pods("job-held")
                .await?
                .into_iter()
                .find(|p| completion_index(p).as_deref() == Some("2"))
                .context("the pod of index 2")?;
            let victim_devices = pod_devices(test, &victim).await?;
            test.exit_pod(victim.metadata.name.as_deref().unwrap_or_default(), 1)
                .await?;
            // The Job replaces the pod after its backoff (10 s); meanwhile the rival
            // would fit on the freed node.
            let api = test.pods();
            let victim_uid = victim.metadata.uid.clone().unwrap_or_default();
            let replacement = wait::until("the Job's replacement to run", Duration::from_secs(120), || {
                let (api, victim_uid) = (api.clone(), victim_uid.clone());
                async move {
                    let list = api
                        .list(&ListParams::default().labels("muster.dev/workload=job-held"))
                        .await?
                        .items;
                    Ok(list.into_iter().find(|p| {
                        completion_index(p).as_deref() == Some("2")
                            && p.metadata.uid.as_deref() != Some(victim_uid.as_str())
                            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    }))
                }
            })
            .await?;
            let rival = test.workloads().get("rival").await?;
            let placed = rival.status.as_ref().and_then(|s| s.placement.as_ref()).is_some();
            ensure!(!placed, "the waiting gang took the failed pod's devices");
            let devices = pod_devices(test, &replacement).await?;
            ensure!(
                devices == victim_devices,
                "the replacement runs on {devices:?}, its predecessor ran on {victim_devices:?}"
            );
            Ok(())
        })
    })
    .await
}

/// The devices of `pod`'s claims, as (pool, device).
async fn pod_devices(test: &Test, pod: &Pod) -> Result<Vec<(String, String)>> {
    let mut devices = Vec::new();
    for status in pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.clone())
        .unwrap_or_default()
    {
        let name = status.resource_claim_name.context("generated claim")?;
        let claim = test.claims().get(&name).await?;
        let allocation = claim
            .status
            .and_then(|s| s.allocation)
            .with_context(|| format!("{name} allocated"))?;
        devices.extend(
            allocation
                .devices
                .and_then(|d| d.results)
                .unwrap_or_default()
                .into_iter()
                .map(|r| (r.pool, r.device)),
        );
    }
    Ok(devices)
}

fn completion_index(pod: &Pod) -> Option<String> {
    pod.metadata
        .labels
        .as_ref()?
        .get("batch.kubernetes.io/job-completion-index")
        .cloned()
}

/// Issue 20: restarts stay the framework's. A Job replaces its failed pod (backoffLimit):
/// muster neither restarts nor deletes the gang's other pods, and the replacement goes
/// back onto the failed pod's devices.
#[tokio::test]
async fn a_jobs_failed_pod_is_replaced_by_the_job_onto_its_devices_while_the_others_run_on() -> Result<()> {
    with_frameworks("job-replace", |test| {
        Box::pin(async move {
            create_job(test, indexed_job("replace", 3, json!({}))).await?;
            runs_as_one_gang(test, "job-replace", 3).await?;
            let pods = test.gang_pods("job-replace").await?;
            let victim = pods
                .iter()
                .find(|p| completion_index(p).as_deref() == Some("1"))
                .context("the pod of index 1")?
                .clone();
            let victim_devices = pod_devices(test, &victim).await?;
            ensure!(!victim_devices.is_empty(), "the pod has devices");
            let others: BTreeSet<String> = pods
                .iter()
                .filter(|p| p.metadata.uid != victim.metadata.uid)
                .filter_map(|p| p.metadata.uid.clone())
                .collect();
            test.exit_pod(victim.metadata.name.as_deref().unwrap_or_default(), 1)
                .await?;
            let api = test.pods();
            let victim_uid = victim.metadata.uid.clone().unwrap_or_default();
            let replacement = wait::until("the Job's replacement to run", Duration::from_secs(120), || {
                let (api, victim_uid) = (api.clone(), victim_uid.clone());
                async move {
                    let list = api
                        .list(&ListParams::default().labels("muster.dev/workload=job-replace"))
                        .await?
                        .items;
                    Ok(list.into_iter().find(|p| {
                        completion_index(p).as_deref() == Some("1")
                            && p.metadata.uid.as_deref() != Some(victim_uid.as_str())
                            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    }))
                }
            })
            .await?;
            // The other pods are the same pods, still running.
            let running: BTreeSet<String> = test
                .gang_pods("job-replace")
                .await?
                .into_iter()
                .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                .filter_map(|p| p.metadata.uid)
                .collect();
            ensure!(
                others.is_subset(&running),
                "muster took the gang apart: {others:?} not all in {running:?}"
            );
            let devices = pod_devices(test, &replacement).await?;
            ensure!(
                devices == victim_devices,
                "the replacement runs on {devices:?}, its predecessor ran on {victim_devices:?}"
            );
            let workload = test.workloads().get("job-replace").await?;
            let status = workload.status.unwrap_or_default();
            ensure!(status.restarts == 0, "muster restarted the gang itself");
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_labelled_jobset_created_while_muster_is_down_never_runs_ungated() -> Result<()> {
    let port = webhook_port().await?;
    with_frameworks("jobset-down", move |test| {
        Box::pin(async move {
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }
            // failurePolicy Fail: the API server refuses the JobSet while no webhook
            // answers; nothing of it exists, so no pod can run ungated.
            let api = jobsets(test);
            let refused = create(&api, labelled_jobset("early", 2, json!({}))).await;
            let message = match refused {
                Ok(()) => anyhow::bail!("the JobSet was admitted while muster was down"),
                Err(e) => format!("{e:#}"),
            };
            ensure!(
                message.contains("muster-webhook") || message.contains("gang.muster.dev"),
                "{message}"
            );
            let pods = test.pods().list(&ListParams::default()).await?.items;
            ensure!(pods.is_empty(), "no pod exists: {}", pods.len());
            // muster starts; applied again (as kubectl and GitOps tools retry), it runs.
            start_operator(test, port)?;
            wait_webhook_ready(test).await?;
            create(&jobsets(test), labelled_jobset("early", 2, json!({}))).await?;
            runs_as_one_gang(test, "jobset-early", 3).await?;
            Ok(())
        })
    })
    .await
}

/// A labelled Job admitted by a follower's webhook while no operator leads is found by
/// the next leader in its first list (whose items carry no apiVersion or kind), and
/// becomes a gang owned by the Job.
#[tokio::test]
async fn a_labelled_job_created_while_no_operator_leads_becomes_a_gang_on_takeover() -> Result<()> {
    let port = webhook_port().await?;
    with_frameworks("takeover", move |test| {
        Box::pin(async move {
            // Someone else holds the Lease: the operator follows, serving the webhook.
            let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(test.client.clone(), &test.ns);
            let held = k8s_openapi::api::coordination::v1::Lease {
                metadata: kube::api::ObjectMeta {
                    name: Some("muster".into()),
                    ..Default::default()
                },
                spec: Some(k8s_openapi::api::coordination::v1::LeaseSpec {
                    holder_identity: Some("another-muster".into()),
                    lease_duration_seconds: Some(3600),
                    renew_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                        k8s_openapi::jiff::Timestamp::now(),
                    )),
                    ..Default::default()
                }),
            };
            leases.create(&PostParams::default(), &held).await?;
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }
            let mut args = operator_args(port);
            args.extend([
                "--leader-elect".to_string(),
                format!("--leader-election-namespace={}", test.ns),
                "--leader-election-lease-duration=4".to_string(),
            ]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            test.start_operator(&args, &[])?;
            wait_webhook_ready(test).await?;
            create_job(test, indexed_job("taken", 2, json!({}))).await?;
            let workloads = test.workloads();
            wait::holds("no gang made by a follower", Duration::from_secs(2), || {
                let workloads = workloads.clone();
                async move { Ok(workloads.get_opt("job-taken").await?.is_none()) }
            })
            .await?;
            // The holder goes: the operator leads, and lists the Job it never saw.
            leases.delete("muster", &DeleteParams::default()).await?;
            let gang = wait::until("the Job's gang", Duration::from_secs(60), || {
                let workloads = workloads.clone();
                async move { workloads.get_opt("job-taken").await.map_err(Into::into) }
            })
            .await?;
            let owner = gang.metadata.owner_references.unwrap_or_default();
            ensure!(
                owner.len() == 1 && owner[0].api_version == "batch/v1" && owner[0].kind == "Job",
                "{owner:?}"
            );
            runs_as_one_gang(test, "job-taken", 2).await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn unlabelled_jobsets_and_jobs_are_never_touched() -> Result<()> {
    with_frameworks("unlabelled", |test| {
        Box::pin(async move {
            let before = reviews(test).await?;
            // They tolerate muster's fence, so they can run without it.
            let tolerate = json!([{"key": "muster.dev/fenced", "operator": "Exists"}]);
            let mut jobset = labelled_jobset("plain", 1, json!({}));
            jobset["metadata"]["labels"] = json!({});
            jobset["metadata"]["annotations"] = json!({});
            for r in jobset["spec"]["replicatedJobs"].as_array_mut().into_iter().flatten() {
                let spec = &mut r["template"]["spec"]["template"]["spec"];
                spec["tolerations"] = tolerate.clone();
                spec.as_object_mut().map(|s| s.remove("resourceClaims"));
                spec["containers"][0]["resources"] = json!({"requests": {"cpu": "1"}});
            }
            create(&jobsets(test), jobset).await?;
            let mut job = indexed_job("plain", 2, json!({}));
            job["metadata"]["labels"] = json!({});
            job["spec"]["template"]["spec"]["tolerations"] = tolerate;
            job["spec"]["template"]["spec"]
                .as_object_mut()
                .map(|s| s.remove("resourceClaims"));
            job["spec"]["template"]["spec"]["containers"][0]["resources"] = json!({"requests": {"cpu": "1"}});
            create_job(test, job).await?;
            let pods = test.pods();
            let running = wait::until("the unlabelled pods to run", Duration::from_secs(90), || {
                let pods = pods.clone();
                async move {
                    let items = pods.list(&ListParams::default()).await?.items;
                    let running = items
                        .iter()
                        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                        .count();
                    Ok((running == 4).then_some(items))
                }
            })
            .await?;
            for pod in &running {
                let gates = pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.scheduling_gates.clone())
                    .unwrap_or_default();
                ensure!(gates.is_empty(), "no gate: {gates:?}");
                let labels = pod.metadata.labels.clone().unwrap_or_default();
                ensure!(
                    !labels.keys().any(|k| k.starts_with("muster.dev/")),
                    "no muster label: {labels:?}"
                );
            }
            let workloads: Vec<Workload> = test.workloads().list(&ListParams::default()).await?.items;
            ensure!(workloads.is_empty(), "no Workload: {}", workloads.len());
            ensure!(reviews(test).await? == before, "the webhook saw none of them");
            Ok(())
        })
    })
    .await
}

/// AdmissionReviews the operator's webhook answered so far.
async fn reviews(test: &Test) -> Result<f64> {
    let metrics = muster_e2e::rbac::metrics(test.operator.as_ref().context("operator")?).await?;
    Ok(metrics.get("muster_webhook_reviews_total").copied().unwrap_or(0.0))
}

/// The derived Workload's `Created` message, once it is False/InvalidSpec.
async fn invalid_message(test: &Test, name: &str) -> Result<String> {
    let api = test.workloads();
    let found = wait::until(&format!("{name} to be InvalidSpec"), Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let Some(w) = api.get_opt(name).await? else {
                return Ok(None);
            };
            Ok(w.status
                .unwrap_or_default()
                .conditions
                .into_iter()
                .find(|c| c.type_ == "Created" && c.status == "False" && c.reason == "InvalidSpec")
                .map(|c| c.message))
        }
    })
    .await;
    match found {
        Ok(message) => Ok(message),
        Err(e) => {
            let seen = api.get_opt(name).await?;
            let log = test.operator.as_ref().map(|o| o.log()).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            Err(e.context(format!(
                "the Workload: {}; the operator's log ends:\n{}",
                serde_json::to_string(&seen)?,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            )))
        }
    }
}

/// Waits until the API server refuses `attempt` and returns its message.
async fn refused<T, F>(what: &str, attempt: F) -> Result<String>
where
    F: std::future::Future<Output = Result<T, kube::Error>>,
{
    match attempt.await {
        Ok(_) => anyhow::bail!("{what} was accepted"),
        Err(e) => Ok(format!("{e:#}")),
    }
}

#[tokio::test]
async fn bad_input_names_the_field_on_the_workload_and_the_job_and_reserves_nothing() -> Result<()> {
    with_frameworks("bad-input", |test| {
        Box::pin(async move {
            let cases = [
                (
                    "topology",
                    json!({"metadata": {"annotations": {"muster.dev/required-topology": "example.com/rakc"}}}),
                    "muster.dev/required-topology: no node has the label",
                ),
                (
                    "min-count",
                    json!({"spec": {"template": {"metadata": {"annotations": {"muster.dev/podset-min-count": "9"}}}}}),
                    "muster.dev/podset-min-count: minCount 9 is larger than the group's 2 pods",
                ),
                (
                    "malformed",
                    json!({"spec": {"template": {"metadata": {"annotations": {"muster.dev/podset-slice-size": "two"}}}}}),
                    "muster.dev/podset-slice-size: \"two\" is not a whole number",
                ),
                (
                    "waves",
                    json!({"spec": {"completions": 6}}),
                    "spec.completions (6) is larger than spec.parallelism (2)",
                ),
                (
                    "priority",
                    json!({"metadata": {"annotations": {"muster.dev/priority-class": "system-cluster-critical"}}}),
                    "muster.dev/priority-class: muster takes a gang's priority from its pod templates",
                ),
            ];
            for (name, extra, _) in &cases {
                create_job(test, indexed_job(name, 2, extra.clone())).await?;
            }
            // JobSet shapes that would wait for pods that never come together.
            let waiting = json!({"spec": {"replicatedJobs": [
                {"name": "launcher", "template": {"spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "launcher"}]}}}}},
                {"name": "workers", "dependsOn": [{"name": "launcher", "status": "Ready"}],
                 "template": {"spec": {"template": {"spec": worker_pod("Never")}}}},
            ]}});
            let mut depends = labelled_jobset("depends", 1, json!({}));
            depends["spec"]["replicatedJobs"] = waiting["spec"]["replicatedJobs"].clone();
            create(&jobsets(test), depends).await?;
            let mut unindexed = labelled_jobset("unindexed", 1, json!({}));
            unindexed["spec"]["replicatedJobs"][1]["template"]["spec"]["completionMode"] = json!("NonIndexed");
            create(&jobsets(test), unindexed).await?;
            let jobset_cases = [
                ("jobset-depends", "depends", "spec.replicatedJobs[1].dependsOn"),
                ("jobset-unindexed", "unindexed", "spec.replicatedJobs[1].template.spec.completionMode: NonIndexed"),
            ];
            for (name, _, expected) in &cases {
                let workload = format!("job-{name}");
                let message = invalid_message(test, &workload).await?;
                ensure!(message.contains(expected), "{workload}: {message:?} should say {expected:?}");
                wait_job_event(test, name, "InvalidGang", expected).await?;
            }
            for (workload, jobset, expected) in jobset_cases {
                let message = invalid_message(test, workload).await?;
                ensure!(message.contains(expected), "{workload}: {message:?} should say {expected:?}");
                wait_job_event(test, jobset, "InvalidGang", expected).await?;
            }

            // More pods than a gang holds: refused when created, with the count.
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            let huge: Job = serde_json::from_value(indexed_job("huge", 5000, json!({})))?;
            let message = refused("a Job of 5000 pods", jobs.create(&PostParams::default(), &huge)).await?;
            ensure!(message.contains("the Job has 5000 pods; a gang has at most 4096"), "{message}");
            // Elastic replicas: the gang's shape cannot change once the JobSet exists.
            create(&jobsets(test), labelled_jobset("elastic", 2, json!({"spec": {"suspend": true}}))).await?;
            let scale = json!([{"op": "replace", "path": "/spec/replicatedJobs/1/replicas", "value": 3}]);
            let message = refused(
                "scaling a labelled JobSet",
                jobsets(test).patch(
                    "elastic",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::<()>::Json(serde_json::from_value(scale)?),
                ),
            )
            .await?;
            ensure!(message.contains("fixed shape"), "{message}");
            // A quota on Workloads: the job is told why its gang does not exist.
            let quotas: Api<k8s_openapi::api::core::v1::ResourceQuota> = Api::namespaced(test.client.clone(), &test.ns);
            let quota = json!({"metadata": {"name": "no-workloads"}, "spec": {"hard": {"count/workloads.muster.dev": "0"}}});
            quotas
                .create(&PostParams::default(), &serde_json::from_value(quota)?)
                .await?;
            wait::until("the quota to count Workloads", Duration::from_secs(30), || {
                let quotas = quotas.clone();
                async move {
                    let quota = quotas.get("no-workloads").await?;
                    Ok(quota.status.and_then(|s| s.hard).is_some().then_some(()))
                }
            })
            .await?;
            create_job(test, indexed_job("quota", 1, json!({}))).await?;
            wait_job_event(test, "quota", "InvalidGang", "cannot create Workload job-quota").await?;
            quotas.delete("no-workloads", &DeleteParams::default()).await?;

            // Nothing reserved, nothing released.
            let (claims, pods) = (test.claims(), test.pods());
            wait::holds("nothing to be reserved", Duration::from_secs(5), || {
                let (claims, pods) = (claims.clone(), pods.clone());
                async move {
                let held = allocations(&claims).await?;
                let ungated = pods
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .filter(|p| p.spec.as_ref().and_then(|s| s.scheduling_gates.as_ref()).is_none_or(Vec::is_empty))
                    .count();
                Ok(held.is_empty() && ungated == 0)
                }
            })
            .await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn the_label_cannot_be_added_or_removed_later() -> Result<()> {
    with_frameworks("relabel", |test| {
        Box::pin(async move {
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            let mut plain = indexed_job("later", 1, json!({"spec": {"suspend": true}}));
            plain["metadata"]["labels"] = json!({});
            create_job(test, plain).await?;
            let add = json!({"metadata": {"labels": {"muster.dev/gang": "true"}}});
            let message = refused(
                "adding the label",
                jobs.patch(
                    "later",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&add),
                ),
            )
            .await?;
            ensure!(message.contains("can only be set when the Job is created"), "{message}");

            create_job(test, indexed_job("labelled", 1, json!({"spec": {"suspend": true}}))).await?;
            let remove = json!({"metadata": {"labels": {"muster.dev/gang": null}}});
            let message = refused(
                "removing the label",
                jobs.patch(
                    "labelled",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&remove),
                ),
            )
            .await?;
            ensure!(
                message.contains("cannot be removed or changed once the Job exists"),
                "{message}"
            );
            Ok(())
        })
    })
    .await
}

/// The Workload of `name`'s condition `type_` once it has `status`, for its message.
async fn wait_condition(test: &Test, name: &str, type_: &str, status: &str) -> Result<String> {
    let api = test.workloads();
    wait::until(
        &format!("{name} to have {type_}={status}"),
        Duration::from_secs(60),
        || {
            let api = api.clone();
            async move {
                Ok(api
                    .get_opt(name)
                    .await?
                    .and_then(|w| w.status)
                    .and_then(|s| {
                        s.conditions
                            .into_iter()
                            .find(|c| c.type_ == type_ && c.status == status)
                    })
                    .map(|c| c.message))
            }
        },
    )
    .await
}

/// A pod that carries a JobSet group's labels and is controlled by a Job of the JobSet's
/// name that the JobSet did not make is refused, stays at the gate, and is told so; the
/// JobSet's own pods run as the gang.
#[tokio::test]
async fn a_stray_labelled_pod_is_refused_and_reported_and_the_jobsets_pods_run() -> Result<()> {
    with_frameworks("stray", |test| {
        Box::pin(async move {
            create(&jobsets(test), labelled_jobset("guarded", 2, json!({"spec": {"suspend": true}}))).await?;
            let uid = jobsets(test).get("guarded").await?.metadata.uid.context("uid")?;
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            let decoy: Job = serde_json::from_value(json!({
                "metadata": {"name": "decoy", "labels": {"jobset.sigs.k8s.io/jobset-name": "guarded"}},
                "spec": {"suspend": true, "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "decoy"}]}}},
            }))?;
            let decoy = jobs.create(&PostParams::default(), &decoy).await?;
            // Made before the JobSet's own worker 0, with every label of it.
            let stray: Pod = serde_json::from_value(json!({
                "metadata": {
                    "name": "stray-worker-0",
                    "labels": {
                        "muster.dev/workload": "jobset-guarded", "muster.dev/pod-group": "workers",
                        "jobset.sigs.k8s.io/jobset-uid": uid, "jobset.sigs.k8s.io/replicatedjob-name": "workers",
                        "jobset.sigs.k8s.io/job-index": "0", "batch.kubernetes.io/job-completion-index": "0",
                    },
                    "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "decoy",
                                         "uid": decoy.metadata.uid, "controller": true}],
                },
                "spec": {
                    "schedulingGates": [{"name": "muster.dev/gang"}],
                    "tolerations": [{"key": "muster.dev/fenced", "operator": "Exists"}],
                    "containers": [{"name": "main", "image": "stray", "resources": {"requests": {"cpu": "1"}}}],
                },
            }))?;
            test.pods().create(&PostParams::default(), &stray).await?;
            let resume = json!({"spec": {"suspend": false}});
            jobsets(test)
                .patch("guarded", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&resume))
                .await?;
            runs_as_one_gang(test, "jobset-guarded", 3).await?;
            let message = wait_condition(test, "jobset-guarded", "PodsRefused", "True").await?;
            ensure!(
                message.contains("pod stray-worker-0") && message.contains("1 pods"),
                "{message}"
            );
            let stray = test.pods().get("stray-worker-0").await?;
            ensure!(
                stray.spec.and_then(|s| s.scheduling_gates).unwrap_or_default().iter().any(|g| g.name == "muster.dev/gang"),
                "the stray pod stays at the gate"
            );
            wait_job_event(test, "stray-worker-0", "NotAGangMember", "not a member of Workload jobset-guarded").await?;
            Ok(())
        })
    })
    .await
}

/// The PriorityClass `name` of `value`, made once for the test binary.
async fn priority_class(test: &Test, name: &str, value: i32) -> Result<()> {
    let classes: Api<k8s_openapi::api::scheduling::v1::PriorityClass> = Api::all(test.client.clone());
    if classes.get_opt(name).await?.is_none() {
        let class = serde_json::from_value(json!({"metadata": {"name": name}, "value": value}))?;
        match classes.create(&PostParams::default(), &class).await {
            Ok(_) => {}
            Err(e) if matches!(&e, kube::Error::Api(s) if s.code == 409) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// A gang's priority cannot be raised after it is made, and a job's gang takes the
/// priority of its pod templates (the lowest of them).
#[tokio::test]
async fn a_gangs_priority_is_fixed_and_a_jobs_comes_from_its_pod_templates() -> Result<()> {
    with_frameworks("priority", |test| {
        Box::pin(async move {
            priority_class(test, "muster-e2e-low", 10).await?;
            priority_class(test, "muster-e2e-high", 1000).await?;
            let mut workload = muster_e2e::scenario::gang("ranked", 1, None);
            workload["spec"]["priorityClassName"] = json!("muster-e2e-low");
            test.create(workload).await?;
            let raise = json!({"spec": {"priorityClassName": "system-cluster-critical"}});
            let message = refused(
                "raising a gang's priority",
                test.workloads().patch(
                    "ranked",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&raise),
                ),
            )
            .await?;
            ensure!(message.contains("priorityClassName is immutable"), "{message}");
            test.create(muster_e2e::scenario::gang("unranked", 1, None)).await?;
            let message = refused(
                "giving a gang a priority",
                test.workloads().patch(
                    "unranked",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&raise),
                ),
            )
            .await?;
            ensure!(message.contains("priorityClassName is immutable"), "{message}");

            let mut job = indexed_job("ranked", 2, json!({"spec": {"suspend": true}}));
            job["spec"]["template"]["spec"]["priorityClassName"] = json!("muster-e2e-low");
            create_job(test, job).await?;
            let workloads = test.workloads();
            let derived = wait::until("the Job's gang", Duration::from_secs(30), || {
                let workloads = workloads.clone();
                async move { workloads.get_opt("job-ranked").await.map_err(Into::into) }
            })
            .await?;
            ensure!(
                derived.spec.priority_class_name.as_deref() == Some("muster-e2e-low"),
                "the pod template's class: {:?}",
                derived.spec.priority_class_name
            );
            Ok(())
        })
    })
    .await
}

/// A job edited before its gang is admitted gets its gang made again as it now says
/// (a topology typo fixed gives the gang its topology); edited after, the gang runs on
/// as admitted, never suspended, and the job is told.
#[tokio::test]
async fn a_job_edited_before_admission_is_made_again_and_after_admission_is_told() -> Result<()> {
    with_frameworks("edited", |test| {
        Box::pin(async move {
            let typo = json!({"spec": {"suspend": true}, "metadata": {"annotations": {"muster.dev/required-topology": "example.com/rakc"}}});
            create_job(test, indexed_job("edited", 2, typo)).await?;
            invalid_message(test, "job-edited").await?;
            let first = test.workloads().get("job-edited").await?.metadata.uid;
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            let fix = json!({"metadata": {"annotations": {"muster.dev/required-topology": RACK_LABEL}}});
            jobs.patch("edited", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&fix))
                .await?;
            let workloads = test.workloads();
            let remade = wait::until("the gang to be made again with its topology", Duration::from_secs(60), || {
                let (workloads, first) = (workloads.clone(), first.clone());
                async move {
                    let Some(w) = workloads.get_opt("job-edited").await? else {
                        return Ok(None);
                    };
                    let fixed = w.metadata.uid != first
                        && w.spec.topology.as_ref().and_then(|t| t.required.as_deref()) == Some(RACK_LABEL)
                        && !w.metadata.annotations.as_ref().is_some_and(|a| a.contains_key("muster.dev/invalid"));
                    Ok(fixed.then_some(w))
                }
            })
            .await?;
            wait_job_event(test, "edited", "GangRecreated", "before its gang was admitted").await?;
            let resume = json!({"spec": {"suspend": false}});
            jobs.patch("edited", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&resume))
                .await?;
            runs_as_one_gang(test, "job-edited", 2).await?;

            // Admitted: a change (here, a typo again) is told, and nothing else happens.
            let again = json!({"metadata": {"annotations": {"muster.dev/preferred-topology": "example.com/rakc"}}});
            jobs.patch("edited", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&again))
                .await?;
            let note = wait_job_event(test, "edited", "GangChangeIgnored", "after its gang was admitted").await?;
            ensure!(note.contains("no node has the label"), "{note}");
            wait::holds("the admitted gang to run on as it was", Duration::from_secs(3), || {
                let (workloads, uid) = (workloads.clone(), remade.metadata.uid.clone());
                async move {
                    let w = workloads.get("job-edited").await?;
                    Ok(w.metadata.uid == uid
                        && w.spec.suspend != Some(true)
                        && w.status.and_then(|s| s.phase) == Some(WorkloadPhase::Running))
                }
            })
            .await?;
            Ok(())
        })
    })
    .await
}

/// Suspending a job's gang Workload suspends the job (its controller takes the pods
/// away); resuming it resumes the job, and the gang runs again.
#[tokio::test]
async fn suspending_a_jobs_gang_suspends_the_job_and_resuming_runs_it_again() -> Result<()> {
    with_frameworks("paused", |test| {
        Box::pin(async move {
            create_job(test, indexed_job("paused", 2, json!({}))).await?;
            runs_as_one_gang(test, "job-paused", 2).await?;
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            let suspend = |on: bool| json!({"spec": {"suspend": on}});
            test.workloads()
                .patch(
                    "job-paused",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&suspend(true)),
                )
                .await?;
            wait::until("the Job to be suspended", Duration::from_secs(30), || {
                let jobs = jobs.clone();
                async move {
                    let job = jobs.get("paused").await?;
                    Ok((job.spec.and_then(|s| s.suspend) == Some(true)).then_some(()))
                }
            })
            .await?;
            test.wait_phase("job-paused", WorkloadPhase::Suspended, Duration::from_secs(60))
                .await?;
            let claims = test.claims();
            wait::until("the gang to hold nothing", Duration::from_secs(60), || {
                let claims = claims.clone();
                async move { Ok(allocations(&claims).await?.is_empty().then_some(())) }
            })
            .await?;
            test.workloads()
                .patch(
                    "job-paused",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&suspend(false)),
                )
                .await?;
            runs_as_one_gang(test, "job-paused", 2).await?;
            let job = jobs.get("paused").await?;
            ensure!(job.spec.and_then(|s| s.suspend) != Some(true), "the Job runs again");
            Ok(())
        })
    })
    .await
}

/// A labelled Job in a namespace the webhook's namespaceSelector leaves out is not
/// muster's; once the namespace is in, the Job (made without the webhook) is held, and
/// says why.
#[tokio::test]
async fn a_job_outside_the_webhooks_namespaces_is_left_alone_and_one_it_never_saw_is_held() -> Result<()> {
    with_frameworks("outside", |test| {
        Box::pin(async move {
            let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(test.client.clone());
            let label =
                |value: Option<&str>| json!({"metadata": {"labels": {muster_e2e::frameworks::SKIP_WEBHOOK: value}}});
            namespaces
                .patch(
                    &test.ns,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&label(Some("true"))),
                )
                .await?;
            // The API server matches a webhook's namespaceSelector against its own cache of
            // namespaces, which may lag the patch: a dry run (which passes the mutating
            // webhooks) shows when the webhook leaves the namespace alone.
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            let probe: Job = serde_json::from_value(indexed_job("outside", 1, json!({"spec": {"suspend": true}})))?;
            wait::until(
                "the webhook to leave the namespace out",
                Duration::from_secs(30),
                || {
                    let (jobs, probe) = (jobs.clone(), probe.clone());
                    async move {
                        let dry = PostParams {
                            dry_run: true,
                            ..PostParams::default()
                        };
                        let made = jobs.create(&dry, &probe).await?;
                        let gated = made
                            .spec
                            .and_then(|s| s.template.spec)
                            .and_then(|s| s.scheduling_gates)
                            .is_some_and(|g| g.iter().any(|g| g.name == "muster.dev/gang"));
                        Ok((!gated).then_some(()))
                    }
                },
            )
            .await?;
            create_job(test, indexed_job("outside", 1, json!({"spec": {"suspend": true}}))).await?;
            let workloads = test.workloads();
            wait::holds(
                "no Workload for a Job outside the webhook's namespaces",
                Duration::from_secs(4),
                || {
                    let workloads = workloads.clone();
                    async move { Ok(workloads.get_opt("job-outside").await?.is_none()) }
                },
            )
            .await?;
            namespaces
                .patch(
                    &test.ns,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&label(None)),
                )
                .await?;
            // The namespace's labels are read again within seconds; any change of the Job
            // looks at it again.
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            let mut touch = 0;
            wait::until("the Job to get its Workload", Duration::from_secs(60), || {
                touch += 1;
                let (jobs, workloads) = (jobs.clone(), workloads.clone());
                let patch = json!({"metadata": {"annotations": {"muster-e2e/touch": touch.to_string()}}});
                async move {
                    jobs.patch(
                        "outside",
                        &kube::api::PatchParams::default(),
                        &kube::api::Patch::Merge(&patch),
                    )
                    .await?;
                    Ok(workloads.get_opt("job-outside").await?.map(|_| ()))
                }
            })
            .await?;
            let message = invalid_message(test, "job-outside").await?;
            ensure!(message.contains("created without muster's webhook"), "{message}");
            Ok(())
        })
    })
    .await
}

/// Without Kueue, a gang that asks for a LocalQueue is held, never run uncharged.
#[tokio::test]
async fn a_gang_that_asks_for_kueue_is_held_when_muster_has_no_kueue() -> Result<()> {
    with_frameworks("no-kueue", |test| {
        Box::pin(async move {
            let mut workload = muster_e2e::scenario::gang("queued", 1, None);
            workload["metadata"]["labels"] = json!({"kueue.x-k8s.io/queue-name": "team"});
            test.create(workload).await?;
            let annotated = json!({"metadata": {"annotations": {"muster.dev/queue-name": "team"}}});
            create_job(test, indexed_job("queued", 1, annotated)).await?;
            let api = test.workloads();
            let message = wait::until("the Workload to be held", Duration::from_secs(60), || {
                let api = api.clone();
                async move {
                    Ok(api.get_opt("queued").await?.and_then(|w| w.status).and_then(|s| {
                        s.conditions
                            .into_iter()
                            .find(|c| c.type_ == "Created" && c.reason == "KueueUnavailable")
                            .map(|c| c.message)
                    }))
                }
            })
            .await?;
            ensure!(message.contains("held rather than run uncharged"), "{message}");
            let message = invalid_message(test, "job-queued").await?;
            ensure!(message.contains("does not work with Kueue"), "{message}");
            let claims = test.claims();
            wait::holds("nothing to be reserved", Duration::from_secs(3), || {
                let claims = claims.clone();
                async move { Ok(allocations(&claims).await?.is_empty()) }
            })
            .await?;
            Ok(())
        })
    })
    .await
}

/// A Job whose name is no DNS label (a dot in it; the Job API allows one where pods
/// have no index) gets a gang named to fit, and runs.
#[tokio::test]
async fn a_job_named_with_a_dot_runs_as_a_gang() -> Result<()> {
    with_frameworks("dotted", |test| {
        Box::pin(async move {
            let mut job = indexed_job("train.v2", 1, json!({}));
            job["spec"].as_object_mut().map(|s| s.remove("completionMode"));
            create_job(test, job).await?;
            let workloads = test.workloads();
            let name = wait::until("the Job's gang", Duration::from_secs(30), || {
                let workloads = workloads.clone();
                async move {
                    Ok(workloads
                        .list(&ListParams::default())
                        .await?
                        .items
                        .into_iter()
                        .filter_map(|w| w.metadata.name)
                        .find(|n| n.starts_with("job-train-v2-")))
                }
            })
            .await?;
            runs_as_one_gang(test, &name, 1).await?;
            Ok(())
        })
    })
    .await
}

/// `/readyz` waits for the webhook's certificate; with a short lifetime, the CA and the
/// serving certificate rotate, the new CA reaches the caBundle before anything is served
/// from it, and the webhook never refuses a call meanwhile.
#[tokio::test]
async fn the_webhook_is_ready_only_with_a_certificate_and_rotates_without_refusing_a_call() -> Result<()> {
    let port = webhook_port().await?;
    with_frameworks("rotation", move |test| {
        Box::pin(async move {
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }
            // No configuration to put its CA in: no certificate to serve, so not ready.
            let own_ns = format!("--webhook-namespace={}", test.ns);
            let mut args = operator_args(port);
            args.retain(|a| !a.starts_with("--webhook-configuration") && !a.starts_with("--webhook-namespace="));
            args.push("--webhook-configuration=muster-e2e-missing".into());
            args.push(own_ns.clone());
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            test.start_operator(&refs, &[])?;
            let operator = test.operator.as_ref().context("operator")?;
            wait::until("/healthz to answer", Duration::from_secs(30), || async {
                Ok(matches!(operator.get("/healthz").await, Ok((200, _))).then_some(()))
            })
            .await?;
            wait::holds(
                "/readyz to wait for the certificate",
                Duration::from_secs(3),
                || async { Ok(!matches!(operator.get("/readyz").await, Ok((200, _)))) },
            )
            .await?;
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }

            // Serving certificates of 12 s, a CA of 24 s, in a Secret of the test's own.
            let mut args = operator_args(port);
            args.retain(|a| !a.starts_with("--webhook-namespace="));
            args.extend([
                own_ns,
                "--webhook-cert-lifetime=12".into(),
                "--webhook-ca-lifetime=24".into(),
            ]);
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            test.start_operator(&refs, &[])?;
            wait_webhook_ready(test).await?;
            let operator = test.operator.as_ref().context("operator")?;
            wait::until("/readyz", Duration::from_secs(30), || async {
                Ok(matches!(operator.get("/readyz").await, Ok((200, _))).then_some(()))
            })
            .await?;
            let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(test.client.clone(), &test.ns);
            let ca_of = |secret: &k8s_openapi::api::core::v1::Secret| -> String {
                let data = secret.data.clone().unwrap_or_default();
                let text = data
                    .get("ca.crt")
                    .map(|b| String::from_utf8_lossy(&b.0).to_string())
                    .unwrap_or_default();
                text.split("-----END CERTIFICATE-----")
                    .next()
                    .unwrap_or_default()
                    .to_string()
            };
            let first = secrets.get("muster-webhook-tls").await?;
            ensure!(
                first
                    .metadata
                    .owner_references
                    .as_ref()
                    .is_some_and(|o| o.iter().any(|o| o.kind == "MutatingWebhookConfiguration")),
                "the Secret is owned by the webhook configuration"
            );
            ensure!(
                first
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("app.kubernetes.io/managed-by"))
                    .map(String::as_str)
                    == Some("muster"),
                "{:?}",
                first.metadata.labels
            );
            let first_ca = ca_of(&first);
            let first_cert = first.data.clone().unwrap_or_default().get("tls.crt").cloned();
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            let probe: Job = serde_json::from_value(indexed_job("probe", 1, json!({})))?;
            let dry = PostParams {
                dry_run: true,
                ..PostParams::default()
            };
            // Calls go on while the CA and then the serving certificate rotate: none refused.
            let calls = std::sync::Mutex::new((0usize, Vec::<String>::new()));
            let call = || async {
                let answer = jobs.create(&dry, &probe).await;
                let mut calls = calls.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                calls.0 += 1;
                if let Err(e) = answer {
                    calls.1.push(format!("{e:#}"));
                }
            };
            wait::until(
                "the CA and the serving certificate to rotate",
                Duration::from_secs(60),
                || async {
                    call().await;
                    let secret = secrets.get("muster-webhook-tls").await?;
                    let data = secret.data.clone().unwrap_or_default();
                    if ca_of(&secret) == first_ca || data.get("tls.crt") == first_cert.as_ref() {
                        return Ok(None);
                    }
                    let serving = data
                        .get("tls.crt")
                        .map(|b| String::from_utf8_lossy(&b.0).to_string())
                        .unwrap_or_default();
                    let (_, pem) = x509_parser::pem::parse_x509_pem(serving.as_bytes())?;
                    let issuer = pem.parse_x509()?.issuer().to_string();
                    let ca = format!("{}-----END CERTIFICATE-----\n", ca_of(&secret));
                    let (_, ca) = x509_parser::pem::parse_x509_pem(ca.as_bytes())?;
                    let from_new_ca = ca.parse_x509()?.subject().to_string() == issuer;
                    Ok(from_new_ca.then_some(()))
                },
            )
            .await?;
            // More calls served from the new CA.
            wait::holds(
                "calls to be answered from the new CA",
                Duration::from_secs(2),
                || async {
                    call().await;
                    Ok(true)
                },
            )
            .await?;
            let (probes, failures) = calls.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
            ensure!(
                failures.is_empty(),
                "{} of {probes} calls were refused during the rotation: {failures:?}",
                failures.len()
            );
            Ok(())
        })
    })
    .await
}

/// A Workload its Job left behind without an owner (as `--cascade=orphan` leaves it) is
/// not taken by a new Job of the same name, which says what to do; once it is deleted,
/// the new Job gets its own.
#[tokio::test]
async fn an_orphaned_workload_is_not_taken_by_a_new_job_of_its_name_which_says_what_to_do() -> Result<()> {
    with_frameworks("orphaned", |test| {
        Box::pin(async move {
            let suspended = json!({"spec": {"suspend": true}});
            create_job(test, indexed_job("orphaned", 1, suspended.clone())).await?;
            let workloads = test.workloads();
            wait::until("the Job's gang", Duration::from_secs(30), || {
                let workloads = workloads.clone();
                async move { Ok(workloads.get_opt("job-orphaned").await?.map(|_| ())) }
            })
            .await?;
            // What `--cascade=orphan` leaves: the Workload without its owner, the Job gone
            // (made here without waiting for the garbage collector to find the CRD).
            let ownerless = json!({"metadata": {"ownerReferences": null}});
            workloads
                .patch(
                    "job-orphaned",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&ownerless),
                )
                .await?;
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            jobs.delete("orphaned", &DeleteParams::background()).await?;
            wait::until("the Job to go", Duration::from_secs(60), || {
                let jobs = jobs.clone();
                async move { Ok(jobs.get_opt("orphaned").await?.is_none().then_some(())) }
            })
            .await?;
            create_job(test, indexed_job("orphaned", 1, suspended)).await?;
            wait_job_event(test, "orphaned", "InvalidGang", "has no owner").await?;
            workloads.delete("job-orphaned", &DeleteParams::default()).await?;
            let uid = jobs.get("orphaned").await?.metadata.uid;
            wait::until("the new Job's own gang", Duration::from_secs(60), || {
                let (workloads, uid) = (workloads.clone(), uid.clone());
                async move {
                    let owned = workloads.get_opt("job-orphaned").await?.is_some_and(|w| {
                        w.metadata
                            .owner_references
                            .unwrap_or_default()
                            .iter()
                            .any(|o| Some(&o.uid) == uid.as_ref())
                    });
                    Ok(owned.then_some(()))
                }
            })
            .await?;
            Ok(())
        })
    })
    .await
}

/// A Job labelled for muster inside a JobSet that is not (its replicated job's template
/// carries the label) is not a gang of its own, and says so.
#[tokio::test]
async fn a_labelled_job_of_an_unlabelled_jobset_is_told_it_runs_outside_any_gang() -> Result<()> {
    with_frameworks("half-labelled", |test| {
        Box::pin(async move {
            let mut jobset = labelled_jobset("half", 1, json!({"spec": {"suspend": true}}));
            jobset["metadata"]["labels"] = json!({});
            jobset["spec"]["replicatedJobs"][1]["template"]["metadata"] =
                json!({"labels": {"muster.dev/gang": "true"}});
            create(&jobsets(test), jobset).await?;
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            let job = wait::until("JobSet to make its workers' Job", Duration::from_secs(60), || {
                let jobs = jobs.clone();
                async move {
                    Ok(jobs
                        .list(&ListParams::default().labels("muster.dev/gang=true"))
                        .await?
                        .items
                        .into_iter()
                        .find_map(|j| j.metadata.name))
                }
            })
            .await?;
            wait_job_event(test, &job, "InvalidGang", "which made it, is not").await?;
            ensure!(
                test.workloads().list(&ListParams::default()).await?.items.is_empty(),
                "no gang for it"
            );
            Ok(())
        })
    })
    .await
}

/// Issue 33: a labelled Job made with `generateName` (as Argo, Kubeflow Pipelines and
/// Airflow make them) is named by muster's webhook and runs as a gang.
#[tokio::test]
async fn a_labelled_job_made_with_generate_name_runs_as_a_gang() -> Result<()> {
    with_frameworks("generate-name", |test| {
        Box::pin(async move {
            let mut job = indexed_job("unused", 2, json!({}));
            job["metadata"] = json!({
                "generateName": "sweep-",
                "labels": {"muster.dev/gang": "true"},
                "annotations": {"muster.dev/required-topology": RACK_LABEL},
            });
            create_job(test, job).await?;
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            let name = jobs
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .find_map(|j| j.metadata.name.filter(|n| n.starts_with("sweep-")))
                .context("the Job, named")?;
            ensure!(name.len() == "sweep-".len() + 5, "a generated name: {name}");
            runs_as_one_gang(test, &format!("job-{name}"), 2).await?;
            Ok(())
        })
    })
    .await
}

/// Issue 33: a replicated job of `replicas: 0` is no group of its JobSet's gang (which
/// runs without waiting for it), and a Job of `parallelism: 0` needs no gang at all.
#[tokio::test]
async fn a_set_of_no_pods_is_no_group_and_a_job_of_none_needs_no_gang() -> Result<()> {
    with_frameworks("no-pods", |test| {
        Box::pin(async move {
            let mut jobset = labelled_jobset("partial", 2, json!({}));
            jobset["spec"]["replicatedJobs"][1]["replicas"] = json!(0);
            create(&jobsets(test), jobset).await?;
            runs_as_one_gang(test, "jobset-partial", 1).await?;
            let workload = test.workloads().get("jobset-partial").await?;
            let groups: Vec<String> = workload.spec.pod_groups.iter().map(|g| g.name.clone()).collect();
            ensure!(groups == ["launcher"], "only the launcher is a group: {groups:?}");

            create_job(test, indexed_job("idle", 4, json!({"spec": {"parallelism": 0}}))).await?;
            wait_job_event(test, "idle", "GangNotNeeded", "makes no pods").await?;
            ensure!(
                test.workloads().get_opt("job-idle").await?.is_none(),
                "no Workload for a Job of no pods"
            );
            Ok(())
        })
    })
    .await
}

/// Issue 33: the Workload of a labelled Job cannot be deleted on its own while its gang
/// runs (the chart's policy, run by the API server): the Job's pods would run on
/// without it, and the Workload muster made again could never admit them. Deleting the
/// Job takes the Workload with it and gives every device back.
#[tokio::test]
async fn a_running_jobs_workload_cannot_be_deleted_on_its_own() -> Result<()> {
    with_frameworks("keep-gang", |test| {
        Box::pin(async move {
            create_job(test, indexed_job("kept", 2, json!({}))).await?;
            runs_as_one_gang(test, "job-kept", 2).await?;
            let refused = match test.workloads().delete("job-kept", &DeleteParams::default()).await {
                Ok(_) => anyhow::bail!("the running gang's Workload was deleted on its own"),
                Err(e) => e.to_string(),
            };
            ensure!(
                refused.contains("is the running gang of Job kept") && refused.contains("delete the Job"),
                "{refused}"
            );
            runs_as_one_gang(test, "job-kept", 2).await?;
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            jobs.delete("kept", &DeleteParams::background()).await?;
            all_given_back(test, "job-kept").await?;
            Ok(())
        })
    })
    .await
}
