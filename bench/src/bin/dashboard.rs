//! `cargo run --release -p muster-bench --bin dashboard`: records muster's `/metrics`
//! while a mix of gangs runs on a local control plane, evaluates the Grafana
//! dashboard's queries over the recording and draws it to `docs/dashboard.svg` (and a
//! PNG beside it when headless Chromium is installed). `--replay` draws again from the
//! last recording without running anything.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use muster_bench::dashboard::{self, mix, model::Dashboard, recording::Recording, svg};

#[derive(Parser)]
#[command(about = "A picture of muster's Grafana dashboard with data recorded from a running muster")]
struct Args {
    /// Minutes the mix of gangs runs.
    #[arg(long, default_value_t = 8)]
    minutes: u64,
    /// Seconds between scrapes of /metrics.
    #[arg(long, default_value_t = 5)]
    scrape_seconds: u64,
    /// Seed of the mix of gangs.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where the recording is written, or read with --replay.
    #[arg(long, default_value = "target/dashboard/recording.json")]
    recording: PathBuf,
    /// Draw from the recording instead of running the mix.
    #[arg(long)]
    replay: bool,
    /// The dashboard's JSON.
    #[arg(long, default_value = "charts/muster/dashboards/muster.json")]
    dashboard: PathBuf,
    /// The SVG to write; the PNG goes beside it.
    #[arg(long, default_value = "docs/dashboard.svg")]
    out: PathBuf,
    /// Headless Chromium, for the PNG; none is written if it cannot be run.
    #[arg(long, default_value = "chromium")]
    chromium: String,
    /// The muster binary; by default the workspace's release build, built first.
    #[arg(long, env = "MUSTER_BIN")]
    muster_bin: Option<PathBuf>,
    /// Also write every query's result, and the samples it was evaluated over, as JSON.
    #[arg(long)]
    values: Option<PathBuf>,
    /// Keep the control plane's logs (and muster's) after the run.
    #[arg(long)]
    keep_logs: bool,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let dashboard = Dashboard::parse(
        &std::fs::read_to_string(&args.dashboard).with_context(|| format!("reading {}", args.dashboard.display()))?,
    )?;
    let recording = if args.replay {
        Recording::load(&args.recording)?
    } else {
        let muster_binary = match args.muster_bin {
            Some(path) => path,
            None => muster_bench::build_release_muster()?,
        };
        let options = mix::Options {
            duration: Duration::from_secs(args.minutes.max(2) * 60),
            scrape_interval: Duration::from_secs(args.scrape_seconds.max(1)),
            muster_binary,
            seed: args.seed,
            keep_logs: args.keep_logs,
        };
        let recording = mix::record(&options, |line| eprintln!("{line}")).await?;
        recording.save(&args.recording)?;
        eprintln!(
            "{} scrapes recorded to {}",
            recording.scrapes.len(),
            args.recording.display()
        );
        recording
    };
    let minutes = recording.scrapes.len() as i64 * recording.scrape_interval_ms / 60_000;
    let note = format!(
        "Drawn from {} with muster's /metrics scraped every {} s for {minutes} min while a mix of gangs ran on a local control plane \
         (cargo run --release -p muster-bench --bin dashboard). Times in UTC.",
        args.dashboard.display(),
        recording.scrape_interval_ms / 1000,
    );
    let evaluation = dashboard::evaluate(&dashboard, &recording)?;
    if let Some(path) = &args.values {
        std::fs::write(path, serde_json::to_vec(&evaluation.to_json())?)?;
        eprintln!("values written to {}", path.display());
    }
    let picture = dashboard::draw(&dashboard, &evaluation, &note);
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, &picture)?;
    eprintln!("dashboard drawn to {}", args.out.display());
    let png = args.out.with_extension("png");
    match screenshot(&args.chromium, &args.out, &png, svg::size(&dashboard)) {
        Ok(()) => eprintln!("screenshot written to {}", png.display()),
        Err(e) => eprintln!("no PNG: {e:#}"),
    }
    Ok(())
}

/// Opens the SVG in headless Chromium and saves what it shows as a PNG.
fn screenshot(chromium: &str, svg: &Path, png: &Path, (width, height): (f64, f64)) -> Result<()> {
    let svg = std::fs::canonicalize(svg)?;
    let png = std::env::current_dir()?.join(png);
    let output = std::process::Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            &format!("--window-size={},{}", width.ceil(), height.ceil()),
            &format!("--screenshot={}", png.display()),
            &format!("file://{}", svg.display()),
        ])
        .output()
        .with_context(|| format!("running {chromium}"))?;
    if !output.status.success() || !png.exists() {
        bail!(
            "{chromium} failed: {}",
            String::from_utf8_lossy(&output.stderr)
                .lines()
                .last()
                .unwrap_or_default()
        );
    }
    Ok(())
}
