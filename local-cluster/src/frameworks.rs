//! The training frameworks beside the local control plane: JobSet and Kubeflow Trainer,
//! built from their Go modules by `local-cluster/controlplane/build-frameworks.sh`
//! (cached), their CRDs applied server-side, and their controller managers run as
//! processes. JobSet's defaulting and validating webhooks are registered (JobSet relies
//! on its defaulting); Trainer's webhooks are not (they only validate, and default the
//! timestamps of runtime patches): its webhook server runs on a certificate nobody checks.
//! Also muster's own webhook configuration for an operator the tests start.

use std::fs;
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
use serde_json::{Value, json};

use crate::ControlPlane;
use crate::paths;
use crate::process::ProcessGroup;

/// Directory holding `jobset`, `trainer-controller-manager` and their CRDs (`crds/`).
/// Builds them on first use; later calls reuse the cache. `MUSTER_FRAMEWORKS_DIR`
/// points at a prepared directory instead.
pub fn framework_binaries() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("MUSTER_FRAMEWORKS_DIR") {
        return Ok(PathBuf::from(dir));
    }
    paths::built_by("build-frameworks.sh", "JobSet and Trainer")
}

/// Running JobSet and Trainer controller managers; they stop with their process group.
#[derive(Debug)]
pub struct Frameworks {
    processes: ProcessGroup,
    logs: Vec<PathBuf>,
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A CA and a loopback serving certificate it signed, written as `tls.crt` and `tls.key`
/// into `dir`; returns the CA's PEM.
pub fn loopback_certificate(dir: &Path) -> Result<String> {
    fs::create_dir_all(dir)?;
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.subject_alt_names = vec![
        SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        SanType::DnsName("localhost".try_into()?),
    ];
    let cert = params.signed_by(&key, &issuer)?;
    fs::write(dir.join("tls.crt"), cert.pem())?;
    fs::write(dir.join("tls.key"), key.serialize_pem())?;
    Ok(ca_cert.pem())
}

fn kubectl_apply(control_plane: &ControlPlane, path: &Path) -> Result<()> {
    let bin = paths::control_plane_binaries()?;
    let applied = Command::new(bin.join("kubectl"))
        .arg(format!("--kubeconfig={}", control_plane.kubeconfig().display()))
        .args(["apply", "--server-side", "--force-conflicts", "-f"])
        .arg(path)
        .output()
        .context("running kubectl apply")?;
    if !applied.status.success() {
        bail!(
            "applying {} failed: {}",
            path.display(),
            String::from_utf8_lossy(&applied.stderr)
        );
    }
    Ok(())
}

/// Applies `object` (a cluster-scoped admission configuration) with server-side apply.
pub async fn apply_cluster_object(client: &kube::Client, object: &Value, plural: &str) -> Result<()> {
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let resource = kube::api::ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(group, version, object["kind"].as_str().unwrap_or_default()),
        plural,
    );
    let api: kube::Api<kube::api::DynamicObject> = kube::Api::all_with(client.clone(), &resource);
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    api.patch(
        name,
        &kube::api::PatchParams::apply("muster-e2e").force(),
        &kube::api::Patch::Apply(object),
    )
    .await?;
    Ok(())
}

impl Frameworks {
    /// Installs the CRDs of JobSet and Trainer into `control_plane`, registers JobSet's
    /// webhooks, starts both managers and waits until they are ready.
    pub async fn start(control_plane: &ControlPlane) -> Result<Self> {
        let dir = tokio::task::spawn_blocking(framework_binaries).await??;
        tokio::task::spawn_blocking(paths::control_plane_binaries).await??;
        let run = control_plane.run_dir().join("frameworks");
        fs::create_dir_all(&run)?;
        kubectl_apply(control_plane, &dir.join("crds"))?;
        let client = control_plane.client().await?;
        let crds: kube::Api<
            k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
        > = kube::Api::all(client.clone());
        for name in [
            "jobsets.jobset.x-k8s.io",
            "trainjobs.trainer.kubeflow.org",
            "trainingruntimes.trainer.kubeflow.org",
            "clustertrainingruntimes.trainer.kubeflow.org",
        ] {
            crate::wait_established(&crds, name).await?;
        }

        let logs_dir = control_plane.run_dir().join("logs");
        let mut processes = ProcessGroup::new()?;
        let mut logs = Vec::new();

        // JobSet, with its webhooks on a loopback certificate the API server trusts.
        let jobset_certs = run.join("jobset-certs");
        let ca = loopback_certificate(&jobset_certs)?;
        let [jobset_webhook, jobset_health] = [free_port()?, free_port()?];
        let jobset_config = run.join("jobset.yaml");
        fs::write(
            &jobset_config,
            format!(
                "apiVersion: config.jobset.x-k8s.io/v1alpha1
kind: Configuration
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
webhook:
  host: 127.0.0.1
  port: {jobset_webhook}
  certDir: {certs}
metrics:
  bindAddress: \"0\"
health:
  healthProbeBindAddress: 127.0.0.1:{jobset_health}
",
                certs = jobset_certs.display()
            ),
        )?;
        let log = logs_dir.join("jobset.log");
        processes.spawn(
            "jobset",
            &dir.join("jobset"),
            &[
                format!("--config={}", jobset_config.display()),
                format!("--kubeconfig={}", control_plane.kubeconfig().display()),
            ],
            &log,
        )?;
        logs.push(log);
        let ca_bundle = base64::engine::general_purpose::STANDARD.encode(ca);
        let url = |path: &str| format!("https://127.0.0.1:{jobset_webhook}{path}");
        let rules = |operations: Value| json!([{"apiGroups": ["jobset.x-k8s.io"], "apiVersions": ["v1alpha2"], "operations": operations, "resources": ["jobsets"]}]);
        let mutating = json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "jobset-mutating-webhook-configuration"},
            "webhooks": [{
                "name": "mjobset.kb.io", "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
                "clientConfig": {"url": url("/mutate-jobset-x-k8s-io-v1alpha2-jobset"), "caBundle": ca_bundle},
                "rules": rules(json!(["CREATE"])),
            }],
        });
        let validating = json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "jobset-validating-webhook-configuration"},
            "webhooks": [{
                "name": "vjobset.kb.io", "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
                "clientConfig": {"url": url("/validate-jobset-x-k8s-io-v1alpha2-jobset"), "caBundle": ca_bundle},
                "rules": rules(json!(["CREATE", "UPDATE"])),
            }],
        });
        apply_cluster_object(&client, &mutating, "mutatingwebhookconfigurations").await?;
        apply_cluster_object(&client, &validating, "validatingwebhookconfigurations").await?;

        // Trainer: its webhook server starts on a certificate in $TMPDIR/k8s-webhook-server
        // (controller-runtime's default), but no configuration sends it anything.
        let trainer_tmp = run.join("trainer-tmp");
        loopback_certificate(&trainer_tmp.join("k8s-webhook-server").join("serving-certs"))?;
        let [trainer_webhook, trainer_health] = [free_port()?, free_port()?];
        let trainer_config = run.join("trainer.yaml");
        fs::write(
            &trainer_config,
            format!(
                "apiVersion: config.trainer.kubeflow.org/v1alpha1
kind: Configuration
leaderElection:
  leaderElect: false
certManagement:
  enable: false
webhook:
  host: 127.0.0.1
  port: {trainer_webhook}
metrics:
  bindAddress: \"0\"
health:
  healthProbeBindAddress: 127.0.0.1:{trainer_health}
"
            ),
        )?;
        let log = logs_dir.join("trainer.log");
        let tmp = trainer_tmp.display().to_string();
        processes.spawn_with_env(
            "trainer",
            &dir.join("trainer-controller-manager"),
            &[
                format!("--config={}", trainer_config.display()),
                format!("--kubeconfig={}", control_plane.kubeconfig().display()),
            ],
            &log,
            &[("TMPDIR", tmp.as_str())],
        )?;
        logs.push(log);

        let mut frameworks = Frameworks { processes, logs };
        for (name, port) in [("JobSet", jobset_health), ("Trainer", trainer_health)] {
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            loop {
                frameworks.processes.check_running()?;
                if let Ok((200, _)) = crate::operator::http_get(&format!("127.0.0.1:{port}"), "/readyz").await {
                    break;
                }
                if std::time::Instant::now() > deadline {
                    bail!(
                        "{name} was not ready within 2 minutes; its log:\n{}",
                        frameworks.log_tails()
                    );
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        Ok(frameworks)
    }

    /// Fails with the managers' log tails if one has exited.
    pub fn check_running(&mut self) -> Result<()> {
        self.processes.check_running()
    }

    /// The end of each manager's log.
    pub fn log_tails(&self) -> String {
        self.logs
            .iter()
            .map(|l| format!("{}:\n{}", l.display(), crate::process::tail(l, 30)))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// muster's webhook for an operator the tests start on loopback: the chart's
/// MutatingWebhookConfiguration `configuration` with its Service replaced by
/// `https://127.0.0.1:<port>/mutate`. The operator fills in the caBundle.
pub fn loopback_webhook(mut configuration: Value, port: u16) -> Value {
    for webhook in configuration["webhooks"].as_array_mut().into_iter().flatten() {
        webhook["clientConfig"] = json!({"url": format!("https://127.0.0.1:{port}/mutate")});
    }
    configuration
}
