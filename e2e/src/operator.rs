//! The muster operator as a child process of a test, so tests can stop, kill and
//! restart it like a real deployment.

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
                .unwrap_or_else(|| crate::paths::e2e_dir().join("..").join("target"));
            target.join("debug").join("muster")
        }
    };
    if !path.exists() {
        bail!(
            "{} does not exist: build it first (cargo build -p muster) or set MUSTER_BIN",
            path.display()
        );
    }
    Ok(path)
}

/// A running `muster run`.
pub struct Operator {
    processes: ProcessGroup,
    log: PathBuf,
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
        let mut args = vec!["run".to_string(), format!("--kubeconfig={}", kubeconfig.display())];
        args.extend(extra_args.iter().map(|a| a.to_string()));
        let mut processes = ProcessGroup::new()?;
        processes
            .spawn_with_env("muster", binary, &args, &log, env)
            .context("starting the operator")?;
        Ok(Operator { processes, log })
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

    /// Kills the operator at once, as a crash would.
    pub fn kill(mut self) {
        self.processes.stop(Duration::ZERO);
    }
}
