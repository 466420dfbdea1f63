//! The muster operator as a child process of a test, so tests can stop, kill and
//! restart it like a real deployment.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::process::ProcessGroup;

/// Path of the `muster` binary: `$MUSTER_BIN`, else the workspace's debug build.
pub fn muster_binary() -> Result<PathBuf> {
    let path = match std::env::var_os("MUSTER_BIN") {
        Some(path) => PathBuf::from(path),
        None => {
            let target = std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| crate::paths::crate_dir().join("..").join("target"));
            target.join("debug").join("muster")
        }
    };
    if !path.exists() {
        bail!(
            "{} does not exist: build it first (cargo build -p muster --features faults) or set MUSTER_BIN",
            path.display()
        );
    }
    Ok(path)
}

/// A running `muster run`.
pub struct Operator {
    processes: ProcessGroup,
    log: PathBuf,
    /// Where it serves `/metrics`, `/healthz` and `/readyz`.
    pub http: SocketAddr,
}

/// A loopback port nobody listens on right now.
fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

impl Operator {
    /// Starts `muster run` against the cluster of `kubeconfig`, logging into `log_dir`.
    pub fn start(kubeconfig: &Path, log_dir: &Path, extra_args: &[&str], env: &[(&str, &str)]) -> Result<Self> {
        Self::start_binary(&muster_binary()?, kubeconfig, log_dir, extra_args, env)
    }

    /// Like [`Operator::start`], with the given `muster` binary.
    pub fn start_binary(
        binary: &Path,
        kubeconfig: &Path,
        log_dir: &Path,
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Self> {
        std::fs::create_dir_all(log_dir)?;
        let log = log_dir.join("muster.log");
        // Metrics and probes on one free port, so operators can run side by side.
        let http = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let mut args = vec![
            "run".to_string(),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--metrics-bind-address={http}"),
            format!("--health-probe-bind-address={http}"),
        ];
        args.extend(extra_args.iter().map(|a| a.to_string()));
        let mut processes = ProcessGroup::new()?;
        processes
            .spawn_with_env("muster", binary, &args, &log, env)
            .context("starting the operator")?;
        Ok(Operator { processes, log, http })
    }

    /// The operator's process id.
    pub fn pid(&self) -> Option<u32> {
        self.processes.pids().first().map(|(_, pid)| *pid)
    }

    /// Fails with the operator's log if it has exited.
    pub fn check_running(&mut self) -> Result<()> {
        self.processes.check_running()
    }

    /// Path of the operator's log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The operator's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops the operator (SIGTERM, then SIGKILL).
    pub fn stop(mut self) {
        self.processes.stop(Duration::from_secs(10));
    }

    /// GETs `path` from the operator's HTTP endpoint: status code and body.
    pub async fn get(&self, path: &str) -> Result<(u16, String)> {
        http_get(&self.http.to_string(), path).await
    }

    /// Waits until the process aborted at fault point `fault` (`MUSTER_FAULT_POINT`), and
    /// fails with the end of its log if it stopped anywhere else.
    pub async fn wait_aborted_at(&mut self, fault: &str, timeout: std::time::Duration) -> Result<()> {
        crate::wait::until(&format!("the operator to abort {fault}"), timeout, || {
            let exited = self.check_running().is_err();
            async move { Ok(exited.then_some(())) }
        })
        .await?;
        let log = self.log();
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        anyhow::ensure!(
            log.contains(&format!("fault point {fault} reached")),
            "the operator stopped at {fault}, not elsewhere; the end of its log:\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
        Ok(())
    }

    /// Stops the operator's process (SIGSTOP), as a stalled machine or a long pause
    /// would; [`Operator::resume`] lets it go on.
    pub fn freeze(&self) -> Result<()> {
        self.processes.signal_component("muster", "STOP")
    }

    pub fn resume(&self) -> Result<()> {
        self.processes.signal_component("muster", "CONT")
    }

    /// Kills the operator at once, as a crash would.
    pub fn kill(mut self) {
        self.processes.stop(Duration::ZERO);
    }
}

/// A plain HTTP/1.1 GET on loopback: the status and the body.
pub async fn http_get(address: &str, path: &str) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("an HTTP status line")?;
    let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    Ok((status, body))
}
