//! JobSet and Trainer beside the shared cluster, and muster's webhook on loopback: the
//! chart's MutatingWebhookConfiguration pointed at one port that every operator of the
//! test binary serves in turn, with a namespaceSelector that leaves out namespaces
//! labelled [`SKIP_WEBHOOK`]; and the chart's admission policies.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams};
use muster_api::v1alpha1::WorkloadPhase;
use muster_local_cluster::fleet::RACK_LABEL;
use muster_local_cluster::frameworks::{Frameworks, apply_cluster_object, loopback_webhook};
use muster_local_cluster::wait;
use serde_json::{Value, json};
use tokio::sync::OnceCell;

use crate::scenario::{Test, allocations, cluster, with_test};

/// A namespace with this label is left out by muster's webhook (its namespaceSelector).
pub const SKIP_WEBHOOK: &str = "muster-e2e/skip-webhook";

/// The webhook's namespaceSelector in the tests.
pub fn namespace_selector() -> Value {
    json!({"matchExpressions": [{"key": SKIP_WEBHOOK, "operator": "DoesNotExist"}]})
}

/// Starts JobSet and Trainer, registers muster's webhook and applies the chart's
/// admission policies (once per test binary); returns the webhook's port.
pub async fn webhook_port() -> Result<u16> {
    static SETUP: OnceCell<(Frameworks, u16)> = OnceCell::const_new();
    let (_, port) = SETUP
        .get_or_try_init(|| async {
            let cluster = cluster().await?;
            let frameworks = Frameworks::start(&cluster.control_plane).await?;
            let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let client = cluster.control_plane.client().await?;
            // Without the gate policy: these tests run the operator as the cluster's admin,
            // not as the chart's ServiceAccount, which alone may open muster's gate.
            let rendered = crate::chart::render(&[("policies.gangGate", "false")])?;
            let mut configuration = crate::chart::of_kind(&rendered, "MutatingWebhookConfiguration")
                .first()
                .map(|c| (*c).clone())
                .context("the chart's webhook configuration")?;
            // As the chart renders webhook.namespaceSelector.
            for webhook in configuration["webhooks"].as_array_mut().into_iter().flatten() {
                webhook["namespaceSelector"] = namespace_selector();
            }
            apply_cluster_object(
                &client,
                &loopback_webhook(configuration, port),
                "mutatingwebhookconfigurations",
            )
            .await?;
            for (kind, plural) in [
                ("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
                ("ValidatingAdmissionPolicyBinding", "validatingadmissionpolicybindings"),
            ] {
                for object in crate::chart::of_kind(&rendered, kind) {
                    apply_cluster_object(&client, object, plural).await?;
                }
            }
            anyhow::Ok((frameworks, port))
        })
        .await?;
    Ok(*port)
}

/// The operator's arguments: adopt jobs, serve the webhook on `port` with a certificate
/// it makes (checked every second), in the namespaces the webhook's selector takes.
pub fn operator_args(port: u16) -> Vec<String> {
    vec![
        "--adopt-jobs".into(),
        format!("--webhook-bind-address=127.0.0.1:{port}"),
        "--webhook-dns-name=127.0.0.1".into(),
        "--webhook-namespace=default".into(),
        "--webhook-configuration=muster-webhook".into(),
        "--webhook-cert-check=1".into(),
        format!("--webhook-namespace-selector={}", namespace_selector()),
    ]
}

/// The operator's arguments as the chart runs it in `release_ns` (its webhook Secret
/// there; no namespaceSelector), serving the webhook on `port`.
pub fn chart_operator_args(port: u16, release_ns: &str) -> Vec<String> {
    vec![
        "--adopt-jobs".into(),
        format!("--webhook-bind-address=127.0.0.1:{port}"),
        "--webhook-dns-name=127.0.0.1".into(),
        format!("--webhook-namespace={release_ns}"),
        "--webhook-secret=muster-webhook-tls".into(),
        "--webhook-configuration=muster-webhook".into(),
        "--webhook-cert-check=1".into(),
    ]
}

/// An indexed Job of one pod labelled for muster, to probe the webhook with.
fn probe() -> Result<Job> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "probe", "labels": {"muster.dev/gang": "true"}},
        "spec": {"completionMode": "Indexed", "completions": 1, "parallelism": 1, "template": {"spec": {
            "restartPolicy": "Never", "containers": [{"name": "main", "image": "probe"}],
        }}},
    }))?)
}

/// Waits until the operator's webhook answers (its certificate made and trusted): a
/// labelled Job is admitted by the API server in a dry run.
pub async fn wait_webhook_ready(test: &Test) -> Result<()> {
    let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
    let probe = probe()?;
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

// ---- Jobs, JobSets and TrainJobs in the tests ----

pub async fn with_frameworks<F>(name: &str, body: F) -> Result<()>
where
    F: for<'a> FnOnce(&'a mut Test) -> futures::future::BoxFuture<'a, Result<()>> + Send + 'static,
{
    with_frameworks_and(name, &[], &[], body).await
}

/// [`with_frameworks`] with more operator arguments and environment.
pub async fn with_frameworks_and<F>(name: &str, extra: &[&str], env: &[(&str, &str)], body: F) -> Result<()>
where
    F: for<'a> FnOnce(&'a mut Test) -> futures::future::BoxFuture<'a, Result<()>> + Send + 'static,
{
    let port = webhook_port().await?;
    let mut args = operator_args(port);
    args.extend(extra.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    with_test(name, &args, env, |test| {
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

pub fn resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

pub fn jobsets(test: &Test) -> Api<DynamicObject> {
    Api::namespaced_with(
        test.client.clone(),
        &test.ns,
        &resource("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets"),
    )
}

pub fn cluster_training_runtimes(test: &Test) -> Api<DynamicObject> {
    Api::all_with(
        test.client.clone(),
        &resource(
            "trainer.kubeflow.org",
            "v1alpha1",
            "ClusterTrainingRuntime",
            "clustertrainingruntimes",
        ),
    )
}

pub fn trainjobs(test: &Test) -> Api<DynamicObject> {
    Api::namespaced_with(
        test.client.clone(),
        &test.ns,
        &resource("trainer.kubeflow.org", "v1alpha1", "TrainJob", "trainjobs"),
    )
}

pub async fn create(api: &Api<DynamicObject>, object: Value) -> Result<()> {
    api.create(&PostParams::default(), &serde_json::from_value(object)?)
        .await?;
    Ok(())
}

pub async fn delete_jobs(test: &Test) -> Result<()> {
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

/// A worker's pod spec: 16 CPUs and the eight GPUs of a claim from the test's template.
pub fn worker_pod(restart: &str) -> Value {
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
pub fn labelled_jobset(name: &str, workers: i64, extra: Value) -> Value {
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
pub fn indexed_job(name: &str, pods: i64, extra: Value) -> Value {
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
pub fn merge(value: &mut Value, patch: Value) {
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
pub async fn runs_as_one_gang(test: &Test, name: &str, pods: usize) -> Result<BTreeMap<String, Vec<(String, String)>>> {
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
pub async fn all_given_back(test: &Test, name: &str) -> Result<()> {
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
pub async fn wait_job_event(test: &Test, name: &str, reason: &str, note_part: &str) -> Result<String> {
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

pub async fn create_job(test: &Test, job: Value) -> Result<()> {
    let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
    jobs.create(&PostParams::default(), &serde_json::from_value(job)?)
        .await?;
    Ok(())
}

/// A ClusterTrainingRuntime `torch-gpus-<ns>`: torch, one pod per node with eight GPUs.
pub async fn torch_runtime(test: &Test) -> Result<String> {
    torch_runtime_with(test, json!({})).await
}

/// [`torch_runtime`] with `pod_spec` merged into its node's pod spec.
pub async fn torch_runtime_with(test: &Test, pod_spec: Value) -> Result<String> {
    let name = format!("torch-gpus-{}", test.ns);
    let mut runtime = json!({
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
    merge(
        &mut runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"],
        pod_spec,
    );
    create(&cluster_training_runtimes(test), runtime).await?;
    Ok(name)
}

/// A ClusterTrainingRuntime `tune-gpus-<ns>` shaped like Trainer's torchtune runtimes:
/// a dataset and a model initializer (one pod each, a CPU, no devices), then the node
/// step (eight GPUs a node), which JobSet makes once both initializers are complete.
pub async fn initializing_runtime(test: &Test) -> Result<String> {
    let name = format!("tune-gpus-{}", test.ns);
    let initializer = |step: &str| {
        json!({
            "name": step,
            "template": {
                "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": step}},
                "spec": {"template": {"spec": {"containers": [{
                    "name": step,
                    "image": "initializer",
                    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                }]}}},
            },
        })
    };
    let runtime = json!({
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": name, "labels": {"trainer.kubeflow.org/framework": "torchtune"}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": {"replicatedJobs": [
                initializer("dataset-initializer"),
                initializer("model-initializer"),
                {
                    "name": "node",
                    "dependsOn": [
                        {"name": "dataset-initializer", "status": "Complete"},
                        {"name": "model-initializer", "status": "Complete"},
                    ],
                    "template": {
                        "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                        "spec": {"template": {"spec": {
                            "containers": [{
                                "name": "node",
                                "image": "torchtune",
                                "resources": {"requests": {"cpu": "16", "memory": "64Gi"}, "claims": [{"name": "gpus"}]},
                            }],
                            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}],
                        }}},
                    },
                },
            ]}},
        },
    });
    create(&cluster_training_runtimes(test), runtime).await?;
    Ok(name)
}

/// A TrainJob of `nodes` nodes on `runtime`, labelled for muster and annotated for one
/// rack through a runtime patch (Trainer v2.3 puts its labels on the JobSet it makes).
pub fn labelled_trainjob(name: &str, runtime: &str, nodes: i64) -> Value {
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
