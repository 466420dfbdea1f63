//! A real Kueue beside the local control plane: built from its Go module by
//! `local-cluster/controlplane/build-kueue.sh` (cached), its CRDs applied server-side, and the
//! manager run as a process with muster registered as an external framework, with its own
//! `batch/job` and `jobset.x-k8s.io/jobset` integrations and their webhooks registered as
//! Kueue installs them (`kueue-mutating-webhook-configuration`, whose name sorts before
//! muster's, so the API server calls Kueue's first), on a loopback certificate.

use std::fs;
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use rcgen::{CertificateParams, KeyPair, SanType};

use crate::ControlPlane;
use crate::fleet::GPU_DRIVER;
use crate::paths;
use crate::process::ProcessGroup;

/// The quota resource Kueue charges for the test driver's devices.
pub const GPU_RESOURCE: &str = "example.com/gpu";

/// Kueue v0.19.2 reads its metrics certificate from this fixed path when it does not
/// manage certificates itself, and exits if it is missing, even with metrics off.
const METRICS_CERTS: &str = "/etc/kueue/metrics/certs";

/// Directory holding the `kueue` binary and its CRDs (`crds/`). Builds them on first use
/// (about 11 minutes on 2 cores); later calls reuse the cache. `MUSTER_KUEUE_DIR` points
/// at a prepared directory instead.
pub fn kueue_binaries() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("MUSTER_KUEUE_DIR") {
        return Ok(PathBuf::from(dir));
    }
    paths::built_by("build-kueue.sh", "Kueue")
}

/// A running Kueue manager. It stops with its process group (when dropped, or when the
/// test binary exits).
#[derive(Debug)]
pub struct Kueue {
    processes: ProcessGroup,
    log: PathBuf,
}

impl Kueue {
    /// Installs Kueue's CRDs into `control_plane` and starts the manager, then waits
    /// until it is ready.
    pub async fn start(control_plane: &ControlPlane) -> Result<Self> {
        let dir = tokio::task::spawn_blocking(kueue_binaries).await??;
        let bin = tokio::task::spawn_blocking(paths::control_plane_binaries).await??;
        let run = control_plane.run_dir().join("kueue");
        fs::create_dir_all(&run)?;

        // Kueue's Workload CRD alone is over a megabyte: only server-side apply takes it.
        let applied = Command::new(bin.join("kubectl"))
            .arg(format!("--kubeconfig={}", control_plane.kubeconfig().display()))
            .args(["apply", "--server-side", "--force-conflicts", "-f"])
            .arg(dir.join("crds"))
            .output()
            .context("running kubectl apply for Kueue's CRDs")?;
        if !applied.status.success() {
            bail!(
                "applying Kueue's CRDs failed: {}",
                String::from_utf8_lossy(&applied.stderr)
            );
        }
        let client = control_plane.client().await?;
        let crds: kube::Api<
            k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
        > = kube::Api::all(client.clone());
        for entry in fs::read_dir(dir.join("crds"))? {
            let path = entry?.path();
            // kueue.x-k8s.io_workloads.yaml names workloads.kueue.x-k8s.io.
            let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            if let Some((group, plural)) = stem.split_once('_') {
                crate::wait_established(&crds, &format!("{plural}.{group}")).await?;
            }
        }

        // Kueue's webhooks for the job kinds it integrates, on a certificate the API
        // server trusts.
        let webhook_certs = run.join("webhook-certs");
        let ca = crate::frameworks::loopback_certificate(&webhook_certs)?;
        ensure_metrics_certificate()?;

        let [webhook_port, health_port] = free_ports()?;
        let config = run.join("config.yaml");
        fs::write(
            &config,
            format!(
                r#"apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: kueue-system
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
webhook:
  host: 127.0.0.1
  port: {webhook_port}
  certDir: {certs}
metrics:
  bindAddress: "0"
health:
  healthProbeBindAddress: 127.0.0.1:{health_port}
featureGates:
  VisibilityOnDemand: false
integrations:
  frameworks: ["batch/job", "jobset.x-k8s.io/jobset"]
  externalFrameworks: ["Workload.v1alpha1.muster.dev"]
resources:
  deviceClassMappings:
  - name: {GPU_RESOURCE}
    deviceClassNames: ["{GPU_DRIVER}"]
"#,
                certs = webhook_certs.display(),
            ),
        )?;
        let log = control_plane.run_dir().join("logs").join("kueue.log");
        let mut processes = ProcessGroup::new()?;
        processes.spawn(
            "kueue",
            &dir.join("kueue"),
            &[
                format!("--config={}", config.display()),
                format!("--kubeconfig={}", control_plane.kubeconfig().display()),
            ],
            &log,
        )?;
        let mut kueue = Kueue { processes, log };
        let health = format!("127.0.0.1:{health_port}");
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            kueue.processes.check_running()?;
            if let Ok((200, _)) = crate::operator::http_get(&health, "/readyz").await {
                // Its webhooks serve now: the API server may call them.
                register_webhooks(&client, &ca, webhook_port).await?;
                return Ok(kueue);
            }
            if std::time::Instant::now() > deadline {
                bail!(
                    "Kueue was not ready within 2 minutes; its log:\n{}",
                    crate::process::tail(&kueue.log, 40)
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Fails with Kueue's log tail if it has exited.
    pub fn check_running(&mut self) -> Result<()> {
        self.processes.check_running()
    }

    /// Kueue's log.
    pub fn log(&self) -> &Path {
        &self.log
    }
}

/// Kueue's webhooks for Jobs and JobSets, as its release installs them (mutating on
/// create: Kueue suspends a job that names a LocalQueue; validating on create and
/// update), served on `port` with the CA `ca`.
async fn register_webhooks(client: &kube::Client, ca: &str, port: u16) -> Result<()> {
    use base64::Engine as _;
    let ca_bundle = base64::engine::general_purpose::STANDARD.encode(ca);
    let webhook = |name: &str, path: &str, group: &str, version: &str, resource: &str, operations: &[&str]| {
        serde_json::json!({
            "name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
            "clientConfig": {"url": format!("https://127.0.0.1:{port}{path}"), "caBundle": ca_bundle},
            "rules": [{"apiGroups": [group], "apiVersions": [version], "operations": operations, "resources": [resource]}],
            // As Kueue's release has it: not the system's namespaces.
            "namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "kueue-system"]}]},
        })
    };
    let mutating = serde_json::json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "kueue-mutating-webhook-configuration"},
        "webhooks": [
            webhook("mjob.kb.io", "/mutate-batch-v1-job", "batch", "v1", "jobs", &["CREATE"]),
            webhook("mjobset.kb.io", "/mutate-jobset-x-k8s-io-v1alpha2-jobset", "jobset.x-k8s.io", "v1alpha2", "jobsets", &["CREATE"]),
        ],
    });
    let validating = serde_json::json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "kueue-validating-webhook-configuration"},
        "webhooks": [
            webhook("vjob.kb.io", "/validate-batch-v1-job", "batch", "v1", "jobs", &["CREATE", "UPDATE"]),
            webhook("vjobset.kb.io", "/validate-jobset-x-k8s-io-v1alpha2-jobset", "jobset.x-k8s.io", "v1alpha2", "jobsets", &["CREATE", "UPDATE"]),
        ],
    });
    crate::frameworks::apply_cluster_object(client, &mutating, "mutatingwebhookconfigurations").await?;
    crate::frameworks::apply_cluster_object(client, &validating, "validatingwebhookconfigurations").await?;
    Ok(())
}

fn free_ports<const N: usize>() -> Result<[u16; N]> {
    let listeners = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut ports = [0; N];
    for (port, listener) in ports.iter_mut().zip(&listeners) {
        *port = listener.local_addr()?.port();
    }
    Ok(ports)
}

/// A self-signed loopback serving certificate as `tls.crt` and `tls.key` in `dir`.
fn write_self_signed(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.subject_alt_names = vec![
        SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        SanType::DnsName("localhost".try_into()?),
    ];
    let cert = params.self_signed(&key)?;
    fs::write(dir.join("tls.crt"), cert.pem())?;
    fs::write(dir.join("tls.key"), key.serialize_pem())?;
    Ok(())
}

/// Writes a self-signed certificate where Kueue insists on reading its metrics
/// certificate, unless one is there already.
fn ensure_metrics_certificate() -> Result<()> {
    let dir = Path::new(METRICS_CERTS);
    if dir.join("tls.crt").exists() && dir.join("tls.key").exists() {
        return Ok(());
    }
    write_self_signed(dir).with_context(|| {
        format!("Kueue reads its metrics certificate from {METRICS_CERTS}; the tests could not write one there")
    })
}
