//! Command-line interface: `muster run`, `muster plan`, `muster crd`, `muster demo`, and
//! the kubectl plugin's `why` and `status`.

#[cfg(feature = "demo")]
pub mod demo;
pub mod kubectl;
pub mod plan;
pub mod run;
pub mod table;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};

use crate::admission::preemption_scope::PreemptionScope;
use clap::{Parser, Subcommand, ValueEnum};

use crate::ops::serve::{self, Endpoints, Health};
use crate::workload::controller;

/// muster runs a group of pods as one unit: it reserves every DRA device of a gang
/// before any of its pods starts.
#[derive(Parser, Debug)]
#[command(name = "muster", version, about, args_override_self = true)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the operator against a cluster (kubeconfig or in-cluster service account).
    Run(Box<RunArgs>),
    /// Start a local control plane with fake GPU nodes, run the operator and an example
    /// training gang, and show it progress.
    #[cfg(feature = "demo")]
    Demo(crate::cli::demo::DemoArgs),
    /// Plan Workloads against a cluster snapshot without a cluster: where would they go,
    /// or why would they not fit.
    Plan(PlanArgs),
    /// Why a gang is not running: plans it against the live cluster, read now, and says
    /// why it does not fit (per group and level, with numbers) and what preemption would
    /// do. As a kubectl plugin: `kubectl muster why WORKLOAD`.
    Why(crate::cli::kubectl::WhyArgs),
    /// Gangs with their phase, admission state, devices held and waiting time. As a
    /// kubectl plugin: `kubectl muster status`.
    #[command(visible_alias = "top")]
    Status(crate::cli::kubectl::StatusArgs),
    /// Before muster is removed (the chart's pre-delete hook runs it): stop the
    /// operator, hand the devices of running pods over to kube-controller-manager, give
    /// back every other device muster reserved, and take muster's finalizers off, so
    /// that nothing waits for muster once it is gone. Pods behind the gate stay there,
    /// and are named.
    Uninstall(UninstallArgs),
    /// Print the CustomResourceDefinitions muster serves, or write them to a directory.
    Crd {
        /// Write one file per CRD into this directory instead of printing.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

#[derive(clap::Args, Debug)]
struct UninstallArgs {
    /// Kubeconfig file; default: $KUBECONFIG, ~/.kube/config, then in-cluster.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// The operator's Deployment (`namespace/name`), scaled to none first; leave out if
    /// it is stopped already.
    #[arg(long)]
    deployment: Option<String>,
    /// How long the operator's pods may take to go, in seconds.
    #[arg(long, default_value_t = 120)]
    wait: u64,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Kubeconfig file; default: $KUBECONFIG, ~/.kube/config, then in-cluster.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Kubeconfig context to use.
    #[arg(long)]
    context: Option<String>,
    /// Parallel create requests per Workload.
    #[arg(long, default_value_t = 32)]
    create_parallelism: usize,
    /// Workloads reconciled at the same time. More makes a burst of gangs' pods sooner,
    /// but reconciles a gang again before the caches show what it made (refused creates),
    /// and competes with the admission loop's writes: 32 was slower end to end here.
    #[arg(long, default_value_t = 8)]
    concurrency: u16,
    /// Client-side limit of API requests per second.
    #[arg(long, default_value_t = 500.0, env = "MUSTER_KUBE_API_QPS")]
    kube_api_qps: f64,
    /// Client-side burst of API requests.
    #[arg(long, default_value_t = 1000, env = "MUSTER_KUBE_API_BURST")]
    kube_api_burst: u32,
    /// How long released pods may take to be scheduled before the gang is torn down and
    /// placed again, in seconds.
    #[arg(long, default_value_t = 120)]
    schedule_timeout: u64,
    /// After waiting this long (seconds), a gang blocks gangs of equal or lower priority
    /// queued behind it until it is admitted.
    #[arg(long, default_value_t = 600)]
    starvation_after: u64,
    /// How pods outside muster are kept off the devices muster plans with: `taint` (taint
    /// GPU nodes with muster.dev/fenced=true:NoSchedule; muster's pods tolerate it),
    /// `device-taint` (taint GPU devices with muster.dev/fenced, effect NoSchedule, by a
    /// DeviceTaintRule; muster's claims tolerate it) or `none` (only the conflict check
    /// after reserving).
    #[arg(long, value_enum, default_value_t = crate::admission::fencing::Fencing::Taint)]
    fencing: crate::admission::fencing::Fencing,
    /// Which gangs a gang of higher priority may evict: `cluster` (any namespace),
    /// `namespace` (only its own) or `off` (no preemption, for example where Kueue owns
    /// queueing and preemption).
    #[arg(long, value_enum, default_value_t = PreemptionScope::Cluster)]
    preemption_scope: PreemptionScope,
    /// Parallel API writes while reserving claims and releasing pods.
    #[arg(long, default_value_t = 64)]
    write_parallelism: usize,
    /// Commits in flight at once while the loop goes on planning; 1 commits one after
    /// another.
    #[arg(long, default_value_t = 16)]
    commit_parallelism: usize,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "MUSTER_LOG_FORMAT")]
    log_format: LogFormat,
    /// Log level: error, warn, info, debug or trace. `MUSTER_LOG` (a tracing filter such
    /// as `info,muster=debug`) takes precedence.
    #[arg(long, value_enum, default_value_t = LogLevel::Info)]
    log_level: LogLevel,
    /// Address for `/metrics`; "0" turns it off.
    #[arg(long, default_value = "127.0.0.1:8080")]
    metrics_bind_address: String,
    /// Serve `/metrics` only to callers whose bearer token a TokenReview accepts and
    /// whose user a SubjectAccessReview allows `get` on the non-resource URL `/metrics`
    /// (as kube-rbac-proxy does). The probes stay open.
    #[arg(long)]
    metrics_auth: bool,
    /// Address for `/healthz` and `/readyz`; "0" turns it off. May equal the metrics
    /// address.
    #[arg(long, default_value = "127.0.0.1:8081")]
    health_probe_bind_address: String,
    /// Run only while holding a coordination.k8s.io Lease, so that several replicas can
    /// run and only one admits and writes.
    #[arg(long)]
    leader_elect: bool,
    /// Namespace of the Lease; default: $POD_NAMESPACE, else "default".
    #[arg(long)]
    leader_election_namespace: Option<String>,
    /// Name of the Lease.
    #[arg(long, default_value = "muster")]
    leader_election_id: String,
    /// Seconds a Lease holds without renewal; a follower takes over after that long.
    #[arg(long, default_value_t = 15)]
    leader_election_lease_duration: u64,
    /// Run JobSets (and so TrainJobs) and Jobs labelled muster.dev/gang as gangs: keep
    /// each one's Workload. Their pods are gated by the webhook (`--webhook-bind-address`,
    /// on some replica).
    #[arg(long)]
    adopt_jobs: bool,
    /// Address of the admission webhook (HTTPS, path /mutate); "0" turns it off.
    #[arg(long, default_value = "0")]
    webhook_bind_address: String,
    /// Read the webhook's serving certificate from tls.crt and tls.key in this directory
    /// (for example a Secret cert-manager keeps); otherwise muster makes and renews one.
    #[arg(long)]
    webhook_cert_dir: Option<PathBuf>,
    /// Secret in which muster keeps the webhook's CA and serving certificate.
    #[arg(long, default_value = "muster-webhook-tls")]
    webhook_secret: String,
    /// Namespace of that Secret; default: $POD_NAMESPACE, else "default".
    #[arg(long)]
    webhook_namespace: Option<String>,
    /// Names the serving certificate is for (the webhook Service's DNS names, or an IP
    /// address); repeat the flag for several.
    #[arg(long)]
    webhook_dns_name: Vec<String>,
    /// The webhook configuration's namespaceSelector, as JSON (a LabelSelector): labelled
    /// jobs in namespaces it leaves out never pass the webhook and are not adopted.
    #[arg(long)]
    webhook_namespace_selector: Option<String>,
    /// MutatingWebhookConfiguration whose caBundle muster keeps current.
    #[arg(long, default_value = "muster-webhook")]
    webhook_configuration: String,
    /// Lifetime of the serving certificate muster makes, in seconds, at least 10
    /// (renewed at two thirds of it; its CA lives ten times as long).
    #[arg(long, default_value_t = 365 * 24 * 3600)]
    webhook_cert_lifetime: u64,
    /// Lifetime of the webhook's CA, in seconds; default ten times the serving
    /// certificate's.
    #[arg(long, hide = true)]
    webhook_ca_lifetime: Option<u64>,
    /// How often the webhook's certificate is checked, in seconds.
    #[arg(long, default_value_t = 60, hide = true)]
    webhook_cert_check: u64,
}

#[derive(clap::Args, Debug)]
struct PlanArgs {
    /// The cluster: what `kubectl get nodes,pods,resourceslices,deviceclasses,resourceclaims -A -o yaml`
    /// prints (a v1 List, or several YAML documents).
    #[arg(long, value_name = "SNAPSHOT.yaml")]
    cluster: PathBuf,
    /// Files with Workloads and their ResourceClaimTemplates (and DeviceClasses, taken as
    /// applied with them), planned in order.
    #[arg(value_name = "WORKLOAD.yaml", required = true)]
    workloads: Vec<PathBuf>,
    /// Namespace of objects that do not name one.
    #[arg(short, long, default_value = "default")]
    namespace: String,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = PlanOutput::Human)]
    output: PlanOutput,
    /// Plan as the operator does with this `--fencing` (which fence its pods or claims
    /// tolerate).
    #[arg(long, value_enum, default_value_t = crate::admission::fencing::Fencing::Taint)]
    fencing: crate::admission::fencing::Fencing,
    /// Show what preemption would do as the operator's `--preemption-scope` allows it.
    #[arg(long, value_enum, default_value_t = PreemptionScope::Cluster)]
    preemption_scope: PreemptionScope,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum PlanOutput {
    Human,
    Json,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum LogFormat {
    Text,
    Json,
}

/// Entry point of the `muster` binary.
pub fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Crd { dir } => print_crds(dir),
        Command::Plan(args) => plan(args),
        Command::Why(args) => crate::cli::kubectl::why(args),
        Command::Status(args) => crate::cli::kubectl::status(args),
        Command::Uninstall(args) => {
            init_logging(LogFormat::Text, LogLevel::Info);
            tokio::runtime::Runtime::new()?.block_on(uninstall(args))
        }
        #[cfg(feature = "demo")]
        Command::Demo(args) => tokio::runtime::Runtime::new()?.block_on(crate::cli::demo::run(args)),
        Command::Run(args) => {
            init_logging(args.log_format, args.log_level);
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(run(*args))
        }
    }
}

async fn uninstall(args: UninstallArgs) -> Result<()> {
    let deployment = match &args.deployment {
        Some(text) => Some(
            text.split_once('/')
                .map(|(ns, name)| (ns.to_string(), name.to_string()))
                .with_context(|| format!("--deployment {text}: expected namespace/name"))?,
        ),
        None => None,
    };
    let client = crate::ops::client::client(args.kubeconfig.as_deref(), None, Default::default()).await?;
    let settings = crate::uninstall::Settings {
        deployment,
        wait: std::time::Duration::from_secs(args.wait),
    };
    let report = crate::uninstall::run(client, &settings).await?;
    print!("{report}");
    Ok(())
}

fn init_logging(format: LogFormat, level: LogLevel) {
    let default = match level {
        LogLevel::Error => "error",
        LogLevel::Warn => "warn",
        LogLevel::Info => "info,kube_runtime=warn",
        LogLevel::Debug => "debug,kube_runtime=info,hyper=info,tower=info,rustls=info",
        LogLevel::Trace => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("MUSTER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn run(args: RunArgs) -> Result<()> {
    let limit = crate::ops::client::RateLimit {
        qps: args.kube_api_qps,
        burst: args.kube_api_burst,
    };
    let client = crate::ops::client::client(args.kubeconfig.as_deref(), args.context.clone(), limit).await?;
    let injected = crate::ops::faults::Injected::from_env()?;
    let settings = crate::cli::run::Settings {
        controller: controller::Settings {
            create_parallelism: args.create_parallelism,
            concurrency: args.concurrency,
            ..controller::Settings::default()
        },
        admission: crate::admission::Settings {
            schedule_timeout: std::time::Duration::from_secs(args.schedule_timeout),
            starvation_after: std::time::Duration::from_secs(args.starvation_after),
            write_parallelism: args.write_parallelism,
            commit_parallelism: args.commit_parallelism,
            fencing: args.fencing,
            preemption_scope: args.preemption_scope,
            fault: injected.fault,
            pause: injected.pause,
            fail: injected.fail,
            ..crate::admission::Settings::default()
        },
        adopt_jobs: args.adopt_jobs,
        adopt_namespace_selector: args
            .webhook_namespace_selector
            .as_deref()
            .filter(|s| !s.trim().is_empty())
            .map(serde_json::from_str)
            .transpose()
            .context("--webhook-namespace-selector: not a LabelSelector in JSON")?,
        leader_election: args.leader_elect.then(|| {
            let namespace = args
                .leader_election_namespace
                .clone()
                .or_else(|| std::env::var("POD_NAMESPACE").ok())
                .unwrap_or_else(|| "default".to_string());
            crate::ops::leader::Settings::new(
                namespace,
                args.leader_election_id.clone(),
                crate::ops::leader::identity(),
                std::time::Duration::from_secs(args.leader_election_lease_duration.max(1)),
            )
        }),
    };
    check_crd_installed(&client).await?;
    tracing::info!(version = env!("CARGO_PKG_VERSION"), "muster operator starting");

    let health = Arc::new(Health::default());
    let metrics = serve::bind(&args.metrics_bind_address)
        .await
        .with_context(|| format!("binding --metrics-bind-address {}", args.metrics_bind_address))?;
    let probes = if args.health_probe_bind_address == args.metrics_bind_address {
        None
    } else {
        serve::bind(&args.health_probe_bind_address)
            .await
            .with_context(|| format!("binding --health-probe-bind-address {}", args.health_probe_bind_address))?
    };
    let shared = args.health_probe_bind_address == args.metrics_bind_address;
    // The reviews behind /metrics get a client of their own: whoever calls /metrics
    // never spends the rate limit of admission's writes.
    let auth = match args.metrics_auth {
        true => {
            let reviews = crate::ops::client::RateLimit { qps: 20.0, burst: 40 };
            let client = crate::ops::client::client(args.kubeconfig.as_deref(), args.context.clone(), reviews).await?;
            Some(Arc::new(serve::auth::MetricsAuth::new(client)))
        }
        false => None,
    };
    if let Some(listener) = metrics {
        let endpoints = if shared { Endpoints::All } else { Endpoints::Metrics };
        tokio::spawn(serve::serve(listener, endpoints, health.clone(), auth));
    }
    if let Some(listener) = probes {
        tokio::spawn(serve::serve(listener, Endpoints::Probes, health.clone(), None));
    }
    // Every replica serves the webhook, so that a change of leader never blocks jobs.
    if let Some(mut settings) = webhook_settings(&args)? {
        health.expect_webhook();
        settings.health = Some(health.clone());
        let client = client.clone();
        tokio::spawn(async move {
            if let Err(e) = crate::webhook::run(client, settings).await {
                tracing::error!(error = %e, "the admission webhook cannot serve");
                std::process::exit(1);
            }
        });
    }

    match crate::cli::run::run(client, settings, health).await {
        crate::cli::run::Ended::Stopped => Ok(()),
        crate::cli::run::Ended::LostLease => anyhow::bail!("lost the leader Lease"),
    }
}

fn webhook_settings(args: &RunArgs) -> Result<Option<crate::webhook::Settings>> {
    if args.webhook_bind_address == "0" || args.webhook_bind_address.is_empty() {
        return Ok(None);
    }
    let address = args
        .webhook_bind_address
        .parse()
        .with_context(|| format!("--webhook-bind-address {}", args.webhook_bind_address))?;
    let certificates = match &args.webhook_cert_dir {
        Some(dir) => crate::webhook::Certificates::Files(dir.clone()),
        None => {
            if args.webhook_dns_name.is_empty() {
                anyhow::bail!(
                    "--webhook-dns-name: the names of the webhook's certificate are needed (or --webhook-cert-dir)"
                );
            }
            crate::webhook::Certificates::Managed {
                namespace: args
                    .webhook_namespace
                    .clone()
                    .or_else(|| std::env::var("POD_NAMESPACE").ok())
                    .unwrap_or_else(|| "default".to_string()),
                secret: args.webhook_secret.clone(),
                names: args.webhook_dns_name.clone(),
                configuration: args.webhook_configuration.clone(),
                lifetimes: {
                    let serving = args.webhook_cert_lifetime.max(10);
                    crate::webhook::certs::Lifetimes {
                        serving: std::time::Duration::from_secs(serving),
                        ca: std::time::Duration::from_secs(
                            args.webhook_ca_lifetime.unwrap_or(serving.saturating_mul(10)).max(10),
                        ),
                    }
                },
            }
        }
    };
    Ok(Some(crate::webhook::Settings {
        address,
        certificates,
        check_every: std::time::Duration::from_secs(args.webhook_cert_check.max(1)),
        health: None,
    }))
}

async fn check_crd_installed(client: &kube::Client) -> Result<()> {
    let api: kube::Api<muster_api::Workload> = kube::Api::all(client.clone());
    api.list(&kube::api::ListParams::default().limit(1)).await.context(
        "cannot list workloads.muster.dev: is the CRD installed? (muster crd | kubectl apply --server-side -f -)",
    )?;
    Ok(())
}

fn read_objects(path: &std::path::Path) -> Result<crate::snapshot::Objects> {
    let size = std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    if size > crate::snapshot::MAX_FILE_BYTES {
        anyhow::bail!(
            "{}: {size} bytes is over the limit of {} bytes for one file",
            path.display(),
            crate::snapshot::MAX_FILE_BYTES
        );
    }
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(crate::snapshot::Objects::read(&path.display().to_string(), file)?)
}

fn plan(args: PlanArgs) -> Result<()> {
    let snapshot = read_objects(&args.cluster)?;
    let mut workloads = crate::snapshot::Objects::default();
    for path in &args.workloads {
        workloads.extend(read_objects(path)?);
    }
    if workloads.workloads.is_empty() {
        anyhow::bail!(
            "no Workload in {}",
            args.workloads
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let (report, details) = crate::cli::plan::plan(
        snapshot,
        &workloads,
        &args.namespace,
        args.fencing,
        args.preemption_scope,
    )?;
    match args.output {
        PlanOutput::Human => print!("{}", crate::cli::plan::human(&report, &details)),
        PlanOutput::Json => println!("{}", serde_json::to_string_pretty(&report)?),
    }
    Ok(())
}

fn print_crds(dir: Option<PathBuf>) -> Result<()> {
    for crd in muster_api::crd::crds() {
        let yaml = muster_api::crd::to_yaml(&crd)?;
        match &dir {
            Some(dir) => {
                let path = dir.join(muster_api::crd::file_name(&crd));
                std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?;
            }
            None => print!("---\n{yaml}"),
        }
    }
    Ok(())
}
