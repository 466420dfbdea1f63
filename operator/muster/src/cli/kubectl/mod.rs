//! `kubectl muster`: the `muster` binary installed (or linked) as `kubectl-muster` on the
//! PATH, which kubectl runs as a plugin. `why` plans a gang against the live cluster
//! and says why it does not fit; `status` (or `top`) lists gangs. Flags follow kubectl:
//! `-n`, `-A`, `-o`, `--kubeconfig`, `--context`.

mod live;
mod status;
mod why;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::ValueEnum;

/// Where to read from, as kubectl's global flags say.
#[derive(clap::Args, Debug, Clone)]
pub struct Target {
    /// Kubeconfig file; default: $KUBECONFIG, ~/.kube/config, then in-cluster.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Kubeconfig context to use.
    #[arg(long)]
    context: Option<String>,
    /// Namespace; default: the context's namespace.
    #[arg(short, long)]
    namespace: Option<String>,
}

impl Target {
    async fn client(&self) -> Result<kube::Client> {
        crate::ops::client::client(
            self.kubeconfig.as_deref(),
            self.context.clone(),
            crate::ops::client::RateLimit::default(),
        )
        .await
        .context("connecting to the cluster")
    }

    fn namespace(&self, client: &kube::Client) -> String {
        self.namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_string())
    }
}

/// `-o`: the output formats kubectl users expect.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Output {
    /// Columns for a terminal.
    #[default]
    Table,
    /// More columns.
    Wide,
    Json,
    Yaml,
}

#[derive(clap::Args, Debug)]
pub struct WhyArgs {
    #[command(flatten)]
    target: Target,
    /// The Workload (`kubectl get mw`).
    workload: String,
    /// Plan with this fence, as the operator's `--fencing` does.
    #[arg(long, value_enum, default_value_t = crate::admission::fencing::Fencing::Taint)]
    fencing: crate::admission::fencing::Fencing,
    /// `json` or `yaml` print the plan as `muster plan -o json` does, with the gang's summary.
    #[arg(short, long, value_enum, default_value_t = Output::Table)]
    output: Output,
}

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    target: Target,
    /// Gangs of every namespace.
    #[arg(short = 'A', long)]
    all_namespaces: bool,
    #[arg(short, long, value_enum, default_value_t = Output::Table)]
    output: Output,
}

pub fn why(args: WhyArgs) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    let text = runtime.block_on(why::run(&args))?;
    print!("{text}");
    Ok(())
}

pub fn status(args: StatusArgs) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    let text = runtime.block_on(status::run(&args))?;
    print!("{text}");
    Ok(())
}

/// Serializes for `-o json` / `-o yaml`.
fn serialized<T: serde::Serialize>(value: &T, output: Output) -> Result<String> {
    Ok(match output {
        Output::Yaml => serde_saphyr::to_string(value)?,
        _ => serde_json::to_string_pretty(value)? + "\n",
    })
}
