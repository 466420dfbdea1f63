//! JobSet and Trainer beside the shared cluster, and muster's webhook on loopback: the
//! chart's MutatingWebhookConfiguration pointed at one port that every operator of the
//! test binary serves in turn, with a namespaceSelector that leaves out namespaces
//! labelled [`SKIP_WEBHOOK`]; and the chart's admission policies.

use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, PostParams};
use muster_local_cluster::frameworks::{Frameworks, apply_cluster_object, loopback_webhook};
use muster_local_cluster::wait;
use serde_json::{Value, json};
use tokio::sync::OnceCell;

use crate::scenario::{Test, cluster};

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
            let rendered = crate::chart::render(&[])?;
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
