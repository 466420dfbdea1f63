//! Training jobs that enter unchanged: a JobSet, a Kubeflow TrainJob and an indexed Job
//! labelled muster.dev/gang run as gangs, against real JobSet and Trainer controller
//! managers (built from their Go modules) and muster's admission webhook on loopback.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams};
use muster_api::v1alpha1::{Workload, WorkloadPhase};
use muster_e2e::frameworks::{operator_args, webhook_port};
use muster_e2e::scenario::{Test, allocations, with_test};
use muster_local_cluster::fleet::RACK_LABEL;
use muster_local_cluster::wait;
use serde_json::{Value, json};

async fn with_frameworks<F>(name: &str, body: F) -> Result<()>
where
    F: for<'a> FnOnce(&'a mut Test) -> futures::future::BoxFuture<'a, Result<()>> + Send + 'static,
{
    let port = webhook_port().await?;
    let args = operator_args(port);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    with_test(name, &args, &[], |test| {
        Box::pin(async move {
            wait_webhook_ready(test).await?;
            let outcome = body(test).await;
            // JobSets and TrainJobs own their Workloads: they go first.
            let cleanup = delete_jobs(test).await;
            outcome.and(cleanup)
        })
    })
    .await
}

fn resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

fn jobsets(test: &Test) -> Api<DynamicObject> {
    Api::namespaced_with(
        test.client.clone(),
        &test.ns,
        &resource("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets"),
    )
}

fn trainjobs(test: &Test) -> Api<DynamicObject> {
    Api::namespaced_with(
        test.client.clone(),
        &test.ns,
        &resource("trainer.kubeflow.org", "v1alpha1", "TrainJob", "trainjobs"),
    )
}

async fn create(api: &Api<DynamicObject>, object: Value) -> Result<()> {
    api.create(&PostParams::default(), &serde_json::from_value(object)?)
        .await?;
    Ok(())
}

async fn delete_jobs(test: &Test) -> Result<()> {
    let background = DeleteParams::background();
    trainjobs(test)
        .delete_collection(&background, &ListParams::default())
        .await?;
    jobsets(test)
        .delete_collection(&background, &ListParams::default())
        .await?;
    let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
    jobs.delete_collection(&background, &ListParams::default()).await?;
    Ok(())
}

fn start_operator(test: &mut Test, port: u16) -> Result<()> {
    let args = operator_args(port);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    test.start_operator(&args, &[])
}

/// Waits until the operator's webhook answers (its certificate made and trusted): a
/// labelled Job is admitted by the API server in a dry run.
async fn wait_webhook_ready(test: &Test) -> Result<()> {
    let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
    let probe: Job = serde_json::from_value(indexed_job("probe", 1, json!({})))?;
    wait::until("muster's webhook to answer", Duration::from_secs(60), || {
        let (jobs, probe) = (jobs.clone(), probe.clone());
        async move {
            let dry = PostParams {
                dry_run: true,
                ..PostParams::default()
            };
            Ok(jobs.create(&dry, &probe).await.ok().map(|_| ()))
        }
    })
    .await
}

/// A worker's pod spec: 16 CPUs and the eight GPUs of a claim from the test's template.
fn worker_pod(restart: &str) -> Value {
    json!({
        "restartPolicy": restart,
        "containers": [{
            "name": "main",
            "image": "trainer",
            "resources": {"requests": {"cpu": "16", "memory": "64Gi"}, "claims": [{"name": "gpus"}]},
        }],
        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}],
    })
}

/// A JobSet of a launcher and `workers` worker Jobs of one pod each, labelled for muster
/// and annotated for one rack.
fn labelled_jobset(name: &str, workers: i64, extra: Value) -> Value {
    let mut jobset = json!({
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "labels": {"muster.dev/gang": "true"},
            "annotations": {"muster.dev/required-topology": RACK_LABEL},
        },
        "spec": {
            "replicatedJobs": [
                {"name": "launcher", "template": {"spec": {"parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "launcher", "resources": {"requests": {"cpu": "2"}}}],
                }}}}},
                {"name": "workers", "replicas": workers, "template": {"spec": {"parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": worker_pod("Never")}}}},
            ],
        },
    });
    merge(&mut jobset, extra);
    jobset
}

/// An indexed Job of `pods` workers.
fn indexed_job(name: &str, pods: i64, extra: Value) -> Value {
    let mut job = json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {"muster.dev/gang": "true"},
                     "annotations": {"muster.dev/required-topology": RACK_LABEL}},
        "spec": {
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            "backoffLimit": 6,
            "template": {"spec": worker_pod("Never")},
        },
    });
    merge(&mut job, extra);
    job
}

/// `patch` merged into `value` (objects by key, everything else replaced).
fn merge(value: &mut Value, patch: Value) {
    match (value, patch) {
        (Value::Object(into), Value::Object(from)) => {
            for (k, v) in from {
                merge(into.entry(k).or_insert(Value::Null), v);
            }
        }
        (slot, patch) => *slot = patch,
    }
}

/// The gang of Workload `name` runs: every pod of it bound in one rack, every claim
/// allocated (by muster, with its finalizer) before any pod started, and no pod ever
/// ungated before its claims were. Returns each pod's claim devices by pod.
async fn runs_as_one_gang(test: &Test, name: &str, pods: usize) -> Result<BTreeMap<String, Vec<(String, String)>>> {
    test.wait_phase(name, WorkloadPhase::Running, Duration::from_secs(120))
        .await?;
    let pods_api = test.pods();
    let running: Vec<Pod> = wait::until(
        &format!("{pods} pods of {name} to run"),
        Duration::from_secs(60),
        || {
            let pods_api = pods_api.clone();
            let name = name.to_string();
            async move {
                let list = pods_api
                    .list(&ListParams::default().labels(&format!("muster.dev/workload={name}")))
                    .await?
                    .items;
                let running: Vec<Pod> = list
                    .into_iter()
                    .filter(|p| p.metadata.deletion_timestamp.is_none())
                    .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                    .collect();
                Ok((running.len() == pods).then_some(running))
            }
        },
    )
    .await?;
    let racks: BTreeMap<String, String> = test
        .cluster
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.rack.clone()))
        .collect();
    let claims = test.claims().list(&ListParams::default()).await?.items;
    let mut by_pod = BTreeMap::new();
    let mut used_racks = BTreeSet::new();
    let mut last_allocation = None;
    let mut first_start = None;
    for pod in &running {
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone()).context("bound")?;
        used_racks.insert(racks[&node].clone());
        let start = pod
            .status
            .as_ref()
            .and_then(|s| s.start_time.clone())
            .context("started")?;
        first_start = first_start.min(Some(start.0)).or(Some(start.0));
        for status in pod
            .status
            .as_ref()
            .and_then(|s| s.resource_claim_statuses.clone())
            .unwrap_or_default()
        {
            let claim_name = status.resource_claim_name.context("generated claim")?;
            let claim = claims
                .iter()
                .find(|c| c.metadata.name.as_deref() == Some(claim_name.as_str()))
                .context("the claim")?;
            let allocation = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.clone())
                .with_context(|| format!("{claim_name} allocated"))?;
            ensure!(
                claim
                    .metadata
                    .finalizers
                    .iter()
                    .flatten()
                    .any(|f| f == muster_api::labels::CLAIM_FINALIZER),
                "{claim_name} was allocated by muster"
            );
            if let Some(at) = allocation.allocation_timestamp {
                last_allocation = last_allocation.max(Some(at.0));
            }
            let devices: Vec<(String, String)> = allocation
                .devices
                .and_then(|d| d.results)
                .unwrap_or_default()
                .into_iter()
                .map(|r| (r.pool, r.device))
                .collect();
            ensure!(
                devices.iter().all(|(pool, _)| pool == &node),
                "{claim_name}: devices on {node}"
            );
            by_pod.insert(format!("{pod_name}@{node}"), devices);
        }
    }
    ensure!(used_racks.len() == 1, "one rack, got {used_racks:?}");
    ensure!(
        last_allocation <= first_start,
        "every claim was allocated ({last_allocation:?}) before the first pod started ({first_start:?})"
    );
    Ok(by_pod)
}

/// Waits until Workload `name` is gone and no claim of the namespace holds a device.
async fn all_given_back(test: &Test, name: &str) -> Result<()> {
    let (claims, workloads) = (test.claims(), test.workloads());
    wait::until("every device to be given back", Duration::from_secs(120), || {
        let (claims, workloads, name) = (claims.clone(), workloads.clone(), name.to_string());
        async move {
            let held = allocations(&claims).await?;
            let workload = workloads.get_opt(&name).await?;
            Ok((held.is_empty() && workload.is_none()).then_some(()))
        }
    })
    .await
}

/// Waits for an event with `reason` about object `name` saying `note_part`.
async fn wait_job_event(test: &Test, name: &str, reason: &str, note_part: &str) -> Result<String> {
    let events: Api<Event> = Api::namespaced(test.client.clone(), &test.ns);
    wait::until(
        &format!("an event {reason} about {name} saying {note_part:?}"),
        Duration::from_secs(60),
        || {
            let events = events.clone();
            async move {
                Ok(events
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
                    .filter(|e| e.reason.as_deref() == Some(reason))
                    .filter_map(|e| e.note)
                    .find(|note| note.contains(note_part)))
            }
        },
    )
    .await
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

async fn create_job(test: &Test, job: Value) -> Result<()> {
    let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
    jobs.create(&PostParams::default(), &serde_json::from_value(job)?)
        .await?;
    Ok(())
}

/// A ClusterTrainingRuntime `torch-gpus-<ns>`: torch, one pod per node with eight GPUs.
async fn torch_runtime(test: &Test) -> Result<String> {
    let name = format!("torch-gpus-{}", test.ns);
    let runtime = json!({
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": name, "labels": {"trainer.kubeflow.org/framework": "torch"}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": {"replicatedJobs": [{
                "name": "node",
                "template": {
                    "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                    "spec": {"template": {"spec": {
                        "containers": [{
                            "name": "node",
                            "image": "pytorch",
                            "resources": {"requests": {"cpu": "16", "memory": "64Gi"}, "claims": [{"name": "gpus"}]},
                        }],
                        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}],
                    }}},
                },
            }]}},
        },
    });
    let api: Api<DynamicObject> = Api::all_with(
        test.client.clone(),
        &resource(
            "trainer.kubeflow.org",
            "v1alpha1",
            "ClusterTrainingRuntime",
            "clustertrainingruntimes",
        ),
    );
    create(&api, runtime).await?;
    Ok(name)
}

/// A TrainJob of `nodes` nodes on `runtime`, labelled for muster and annotated for one
/// rack through a runtime patch (Trainer v2.3 puts its labels on the JobSet it makes).
fn labelled_trainjob(name: &str, runtime: &str, nodes: i64) -> Value {
    json!({
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": {
            "runtimeRef": {"name": runtime, "kind": "ClusterTrainingRuntime", "apiGroup": "trainer.kubeflow.org"},
            "trainer": {"numNodes": nodes},
            "runtimePatches": [{
                "manager": "muster.dev",
                "trainingRuntimeSpec": {"template": {"metadata": {
                    "labels": {"muster.dev/gang": "true"},
                    "annotations": {"muster.dev/required-topology": RACK_LABEL},
                }}},
            }],
        },
    })
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
            let api: Api<DynamicObject> = Api::all_with(
                test.client.clone(),
                &resource(
                    "trainer.kubeflow.org",
                    "v1alpha1",
                    "ClusterTrainingRuntime",
                    "clustertrainingruntimes",
                ),
            );
            api.delete(&runtime, &DeleteParams::default()).await?;
            Ok(())
        })
    })
    .await
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
            // Compared and reported: the new pods' devices against the old ones'.
            eprintln!(
                "devices before the restart: {:?}; after: {:?}; same: {}",
                nodes(&before),
                nodes(&after),
                nodes(&before) == nodes(&after)
            );
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
            ];
            for (name, extra, _) in &cases {
                create_job(test, indexed_job(name, 2, extra.clone())).await?;
            }
            for (name, _, expected) in &cases {
                let workload = format!("job-{name}");
                let message = invalid_message(test, &workload).await?;
                ensure!(message.contains(expected), "{workload}: {message:?} should say {expected:?}");
                wait_job_event(test, name, "InvalidGang", expected).await?;
            }
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
            let refused = jobs
                .patch(
                    "later",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&add),
                )
                .await;
            let message = format!("{:#}", refused.err().context("refused")?);
            ensure!(message.contains("can only be set when the Job is created"), "{message}");
            Ok(())
        })
    })
    .await
}
