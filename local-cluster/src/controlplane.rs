//! A real Kubernetes control plane on loopback: etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler and kwok, started from the binaries that
//! `local-cluster/controlplane/build.sh` builds into the cache.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::paths;
use crate::pki::Pki;
use crate::process::ProcessGroup;

/// How to start a control plane.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// `--feature-gates` for kube-apiserver, kube-controller-manager and kube-scheduler,
    /// for example `GenericWorkload=true`.
    pub feature_gates: Vec<String>,
    /// `--runtime-config` for kube-apiserver, for example `scheduling.k8s.io/v1beta1=true`.
    pub runtime_config: Vec<String>,
    /// Keep the run directory (certificates, logs, etcd data) after stopping.
    pub keep_run_dir: bool,
    /// Write an audit log of every write request (`audit.log` in the run directory, JSON
    /// lines, metadata only), leaving out node heartbeats: who wrote what, when.
    pub audit: bool,
}

/// The audit policy of [`Options::audit`]: writes, at the metadata level, except the
/// nodes' leases and status, which kwok renews all the time.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: None
  namespaces: [kube-node-lease]
- level: None
  resources:
  - group: \"\"
    resources: [nodes, nodes/status]
- level: Metadata
  verbs: [create, update, patch, delete, deletecollection]
- level: None
";

/// A running control plane. Dropping it stops every process.
#[derive(Debug)]
pub struct ControlPlane {
    run_dir: PathBuf,
    kubeconfig: PathBuf,
    server: String,
    keep_run_dir: bool,
    processes: ProcessGroup,
}

struct Ports {
    etcd_client: u16,
    etcd_peer: u16,
    apiserver: u16,
    controller_manager: u16,
    scheduler: u16,
    kwok: u16,
}

impl Ports {
    /// Free loopback ports, all reserved at the same time so they differ from each other;
    /// released just before the components bind them.
    fn pick() -> Result<Self> {
        let listeners = (0..6)
            .map(|_| TcpListener::bind("127.0.0.1:0"))
            .collect::<std::io::Result<Vec<_>>>()?;
        let ports = listeners
            .iter()
            .map(|l| l.local_addr().map(|a| a.port()))
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Ports {
            etcd_client: ports[0],
            etcd_peer: ports[1],
            apiserver: ports[2],
            controller_manager: ports[3],
            scheduler: ports[4],
            kwok: ports[5],
        })
    }
}

impl ControlPlane {
    /// Builds the binaries if the cache lacks them, then starts every component and
    /// waits until the cluster serves requests, schedules pods and runs controllers.
    pub async fn start(options: Options) -> Result<Self> {
        let bin = tokio::task::spawn_blocking(paths::control_plane_binaries).await??;
        let run_dir = paths::new_run_dir()?;
        let pki = Pki::generate(&run_dir.join("pki"))?;
        let logs = run_dir.join("logs");
        fs::create_dir_all(&logs)?;
        let ports = Ports::pick()?;
        let server = format!("https://127.0.0.1:{}", ports.apiserver);
        let kubeconfig = run_dir.join("kubeconfig");
        write_kubeconfig(&kubeconfig, &server, &pki, &pki.admin_cert, &pki.admin_key)?;
        let controller_manager_kubeconfig = run_dir.join("kube-controller-manager.kubeconfig");
        write_kubeconfig(
            &controller_manager_kubeconfig,
            &server,
            &pki,
            &pki.controller_manager_cert,
            &pki.controller_manager_key,
        )?;

        let mut processes = ProcessGroup::new()?;
        let s = |p: &Path| p.display().to_string();
        let gates = options.feature_gates.join(",");

        let etcd_data = run_dir.join("etcd");
        processes.spawn(
            "etcd",
            &bin.join("etcd"),
            &[
                "--name=muster-e2e".into(),
                format!("--data-dir={}", s(&etcd_data)),
                format!("--listen-client-urls=http://127.0.0.1:{}", ports.etcd_client),
                format!("--advertise-client-urls=http://127.0.0.1:{}", ports.etcd_client),
                format!("--listen-peer-urls=http://127.0.0.1:{}", ports.etcd_peer),
                format!("--initial-advertise-peer-urls=http://127.0.0.1:{}", ports.etcd_peer),
                format!("--initial-cluster=muster-e2e=http://127.0.0.1:{}", ports.etcd_peer),
                "--unsafe-no-fsync=true".into(),
                "--quota-backend-bytes=8589934592".into(),
                "--auto-compaction-retention=1".into(),
                "--log-level=warn".into(),
            ],
            &logs.join("etcd.log"),
        )?;

        let mut apiserver_args = vec![
            format!("--etcd-servers=http://127.0.0.1:{}", ports.etcd_client),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--secure-port={}", ports.apiserver),
            format!("--cert-dir={}", s(&run_dir.join("apiserver"))),
            format!("--tls-cert-file={}", s(&pki.serving_cert)),
            format!("--tls-private-key-file={}", s(&pki.serving_key)),
            format!("--client-ca-file={}", s(&pki.ca_cert)),
            "--authorization-mode=Node,RBAC".into(),
            "--service-cluster-ip-range=10.0.0.0/24".into(),
            "--allow-privileged=true".into(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", s(&pki.service_account_public_key)),
            format!("--service-account-signing-key-file={}", s(&pki.service_account_key)),
            "--endpoint-reconciler-type=none".into(),
            "--profiling=false".into(),
            // As hardened clusters run: setting blockOwnerDeletion on an owner reference
            // needs update on the owner's finalizers subresource.
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement".into(),
            // Tests and benchmarks create thousands of objects quickly.
            "--max-requests-inflight=2000".into(),
            "--max-mutating-requests-inflight=1000".into(),
        ];
        if !gates.is_empty() {
            apiserver_args.push(format!("--feature-gates={gates}"));
        }
        if !options.runtime_config.is_empty() {
            apiserver_args.push(format!("--runtime-config={}", options.runtime_config.join(",")));
        }
        if options.audit {
            let policy = run_dir.join("audit-policy.yaml");
            fs::write(&policy, AUDIT_POLICY)?;
            apiserver_args.extend([
                format!("--audit-policy-file={}", s(&policy)),
                format!("--audit-log-path={}", s(&run_dir.join("audit.log"))),
                "--audit-log-format=json".into(),
                // Batched, so that writing the log does not lengthen requests.
                "--audit-log-mode=batch".into(),
                "--audit-log-maxbackup=0".into(),
                // One file for the whole run (in MB): the default rotates it at 100 MB,
                // and a reader of `audit.log` would miss what went before.
                "--audit-log-maxsize=1000000".into(),
            ]);
        }
        wait_for_tcp(&mut processes, "etcd", ports.etcd_client, Duration::from_secs(60)).await?;
        processes.spawn(
            "kube-apiserver",
            &bin.join("kube-apiserver"),
            &apiserver_args,
            &logs.join("kube-apiserver.log"),
        )?;

        let client = client_for(&kubeconfig).await?;
        wait_until(
            &mut processes,
            "kube-apiserver /readyz",
            Duration::from_secs(120),
            || {
                let client = client.clone();
                async move {
                    let req = http::Request::get("/readyz").body(Vec::new())?;
                    Ok(client
                        .request_text(req)
                        .await
                        .map(|body| body.trim() == "ok")
                        .unwrap_or(false))
                }
            },
        )
        .await?;

        let common = |port: u16, dir: &str| -> Vec<String> {
            let mut args = vec![
                format!("--kubeconfig={}", s(&kubeconfig)),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={port}"),
                format!("--cert-dir={}", s(&run_dir.join(dir))),
                "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics".into(),
                "--leader-elect=false".into(),
            ];
            if !gates.is_empty() {
                args.push(format!("--feature-gates={gates}"));
            }
            args
        };
        let mut kcm_args = common(ports.controller_manager, "kube-controller-manager");
        kcm_args.retain(|a| !a.starts_with("--kubeconfig="));
        kcm_args.extend([
            format!("--kubeconfig={}", s(&controller_manager_kubeconfig)),
            "--use-service-account-credentials=true".into(),
            format!("--root-ca-file={}", s(&pki.ca_cert)),
            format!("--service-account-private-key-file={}", s(&pki.service_account_key)),
            "--node-monitor-grace-period=40s".into(),
            "--kube-api-qps=500".into(),
            "--kube-api-burst=1000".into(),
        ]);
        processes.spawn(
            "kube-controller-manager",
            &bin.join("kube-controller-manager"),
            &kcm_args,
            &logs.join("kube-controller-manager.log"),
        )?;
        let mut scheduler_args = common(ports.scheduler, "kube-scheduler");
        scheduler_args.extend(["--kube-api-qps=500".into(), "--kube-api-burst=1000".into()]);
        processes.spawn(
            "kube-scheduler",
            &bin.join("kube-scheduler"),
            &scheduler_args,
            &logs.join("kube-scheduler.log"),
        )?;

        let stages = bin.join("stages");
        // Not kwok's pod-complete stage, which ends a Job's pods at once: here every pod
        // runs until a test ends it (the exit stage below).
        let stage_files = [
            "node/fast/node-initialize.yaml",
            "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
            "pod/fast/pod-ready.yaml",
        ];
        let mut kwok_args = vec![
            format!("--kubeconfig={}", s(&kubeconfig)),
            "--manage-all-nodes=false".into(),
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake".into(),
            "--cidr=10.244.0.0/16".into(),
            "--node-ip=10.0.0.1".into(),
            "--node-lease-duration-seconds=40".into(),
            format!("--server-address=127.0.0.1:{}", ports.kwok),
        ];
        for file in stage_files {
            kwok_args.push(format!("--config={}", s(&stages.join(file))));
        }
        // Lets tests end pods with an exit code (annotation muster-e2e-exit) or after a
        // while (muster-e2e-run-for), and keep deleted pods terminating for a while
        // (muster-e2e-terminate-after).
        for file in ["pod-exit.yaml", "pod-run-for.yaml", "pod-delete.yaml"] {
            let own_stages = paths::crate_dir().join("controlplane").join("stages").join(file);
            kwok_args.push(format!("--config={}", s(&own_stages)));
        }
        processes.spawn("kwok", &bin.join("kwok"), &kwok_args, &logs.join("kwok.log"))?;

        for (name, port) in [
            ("kube-controller-manager", ports.controller_manager),
            ("kube-scheduler", ports.scheduler),
        ] {
            let health = insecure_client(port)?;
            wait_until(
                &mut processes,
                &format!("{name} /healthz"),
                Duration::from_secs(120),
                || {
                    let health = health.clone();
                    async move {
                        let req = http::Request::get("/healthz").body(Vec::new())?;
                        Ok(health
                            .request_text(req)
                            .await
                            .map(|body| body.trim() == "ok")
                            .unwrap_or(false))
                    }
                },
            )
            .await?;
        }
        // The service-account controller creating the default account shows that
        // kube-controller-manager's controllers are running, not just its server.
        let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
        wait_until(
            &mut processes,
            "the default ServiceAccount",
            Duration::from_secs(120),
            || {
                let accounts = accounts.clone();
                async move { Ok(accounts.get_opt("default").await?.is_some()) }
            },
        )
        .await?;

        Ok(ControlPlane {
            run_dir,
            kubeconfig,
            server,
            keep_run_dir: options.keep_run_dir,
            processes,
        })
    }

    /// Name and process id of every component, for measuring what each costs.
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.processes.pids()
    }

    /// Path of an admin kubeconfig for this cluster.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The API server URL.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// Directory with certificates, logs and etcd data of this run.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// The audit log, when started with [`Options::audit`].
    pub fn audit_log(&self) -> PathBuf {
        self.run_dir.join("audit.log")
    }

    /// A new admin client. Each async runtime needs its own client.
    pub async fn client(&self) -> Result<kube::Client> {
        client_for(&self.kubeconfig).await
    }

    /// Fails with a component's log if any component has exited.
    pub fn check_running(&mut self) -> Result<()> {
        self.processes.check_running()
    }

    /// Stops every component and removes the run directory unless asked to keep it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.processes.stop(Duration::from_secs(10));
        if !self.keep_run_dir {
            let _ = fs::remove_dir_all(&self.run_dir);
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A client for the cluster behind a kubeconfig file.
pub async fn client_for(kubeconfig: &Path) -> Result<kube::Client> {
    let kc = Kubeconfig::read_from(kubeconfig)?;
    let mut config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    config.read_timeout = Some(Duration::from_secs(60));
    Ok(kube::Client::try_from(config)?)
}

/// A client for a component's own HTTPS server (self-signed, no authentication).
fn insecure_client(port: u16) -> Result<kube::Client> {
    let mut config = kube::Config::new(format!("https://127.0.0.1:{port}").parse()?);
    config.accept_invalid_certs = true;
    config.connect_timeout = Some(Duration::from_secs(2));
    config.read_timeout = Some(Duration::from_secs(5));
    Ok(kube::Client::try_from(config)?)
}

async fn wait_for_tcp(processes: &mut ProcessGroup, what: &str, port: u16, timeout: Duration) -> Result<()> {
    wait_until(processes, what, timeout, || async move {
        Ok(tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok())
    })
    .await
}

/// Polls `ready` until it holds, failing early when a component exits.
async fn wait_until<F, Fut>(processes: &mut ProcessGroup, what: &str, timeout: Duration, mut ready: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        processes.check_running()?;
        if ready().await.unwrap_or(false) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn write_kubeconfig(path: &Path, server: &str, pki: &Pki, cert: &Path, key: &Path) -> Result<()> {
    let b64 = |p: &Path| -> Result<String> {
        Ok(base64::engine::general_purpose::STANDARD.encode(fs::read(p).with_context(|| p.display().to_string())?))
    };
    let text = format!(
        "apiVersion: v1
kind: Config
clusters:
- name: muster-e2e
  cluster:
    server: {server}
    certificate-authority-data: {ca}
users:
- name: admin
  user:
    client-certificate-data: {cert}
    client-key-data: {key}
contexts:
- name: muster-e2e
  context:
    cluster: muster-e2e
    user: admin
current-context: muster-e2e
",
        ca = b64(&pki.ca_cert)?,
        cert = b64(cert)?,
        key = b64(key)?,
    );
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
