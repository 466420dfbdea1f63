//! `cargo run --release -p muster-bench`: runs the benchmark on a local control plane and
//! writes the report (`docs/benchmarks.md` and its plot).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Parser;
use muster_bench::contender::Contender;
use muster_bench::report;
use muster_bench::spec::{ScenarioId, Size};

#[derive(Parser)]
#[command(about = "muster against upstream gang scheduling and plain kube-scheduler")]
struct Args {
    /// Scenarios to run, comma-separated (S1..S7).
    #[arg(long, default_value = "S1,S2,S3,S4,S5,S6,S7", value_delimiter = ',')]
    scenarios: Vec<String>,
    /// Contenders to run, comma-separated (muster, upstream, plain); the report compares
    /// only those that ran.
    #[arg(long, default_value = "muster,upstream,plain", value_delimiter = ',')]
    contenders: Vec<String>,
    /// Repeats per scenario; each repeat rotates the contenders' order by one (ABC, BCA,
    /// CAB), so six repeats put every contender in every position twice.
    #[arg(long, default_value_t = 6)]
    repeats: usize,
    /// Skip the unmeasured warm-up phase of each contender.
    #[arg(long)]
    no_warm_up: bool,
    /// A few nodes and gangs per scenario, to check the harness.
    #[arg(long)]
    smoke: bool,
    /// The muster binary; by default the workspace's release build, built first.
    #[arg(long, env = "MUSTER_BIN")]
    muster_bin: Option<PathBuf>,
    /// Keep the logs of the control plane and of every operator after the run.
    #[arg(long)]
    keep_logs: bool,
    /// Where the report goes; the plot is written beside it.
    #[arg(long, default_value = "docs/benchmarks.md")]
    out: PathBuf,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let scenarios = args
        .scenarios
        .iter()
        .map(|s| ScenarioId::parse(s).with_context(|| format!("unknown scenario {s}: expected S1..S7")))
        .collect::<Result<Vec<_>>>()?;
    let contenders = args
        .contenders
        .iter()
        .map(|c| {
            Contender::parse(c).with_context(|| format!("unknown contender {c}: expected muster, upstream or plain"))
        })
        .collect::<Result<Vec<_>>>()?;
    let muster_binary = match args.muster_bin {
        Some(path) => path,
        None => muster_bench::build_release_muster()?,
    };
    let config = muster_bench::Config {
        size: if args.smoke { Size::Smoke } else { Size::Full },
        scenarios,
        contenders,
        repeats: args.repeats.max(1),
        muster_binary,
        keep_logs: args.keep_logs,
        warm_up: !args.no_warm_up,
    };
    let run = muster_bench::run(&config, |line| eprintln!("{line}")).await?;
    let plot_name = args
        .out
        .file_stem()
        .map(|s| format!("{}-cdf.svg", s.to_string_lossy()))
        .unwrap_or_else(|| "benchmarks-cdf.svg".into());
    let dir = args
        .out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(&plot_name), report::plot(&run))?;
    std::fs::write(&args.out, report::markdown(&run, &plot_name))?;
    eprintln!("report written to {}", args.out.display());
    Ok(())
}
