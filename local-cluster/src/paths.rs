//! Where the control-plane binaries and the per-run directories live: a cache outside
//! the repository (`$MUSTER_CACHE`, default `~/.cache/muster`).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result, bail};

/// Root of muster's cache.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("MUSTER_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").context("neither MUSTER_CACHE nor HOME is set")?;
    Ok(Path::new(&home).join(".cache").join("muster"))
}

/// This crate's directory (`local-cluster/` in the repository).
pub fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Directory holding etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
/// kubectl, kwok and kwok's stages. Builds them on first use (many minutes); later calls
/// reuse the cache. `MUSTER_CONTROLPLANE_BIN` points at a prepared directory instead.
pub fn control_plane_binaries() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("MUSTER_CONTROLPLANE_BIN") {
        return Ok(PathBuf::from(dir));
    }
    built_by("build.sh", "the control plane")
}

/// Runs build script `script` of `controlplane/`, which builds `what` into the cache
/// (or finds it there) and prints the directory last.
pub fn built_by(script: &str, what: &str) -> Result<PathBuf> {
    let script = crate_dir().join("controlplane").join(script);
    let output = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        bail!("building {what} failed ({}); see the output above", output.status);
    }
    let stdout = String::from_utf8(output.stdout)?;
    let dir = stdout
        .lines()
        .last()
        .with_context(|| format!("the build script of {what} printed no directory"))?;
    Ok(PathBuf::from(dir.trim()))
}

/// A fresh directory for one control plane run. Directories of runs whose process is
/// gone are removed first.
pub fn new_run_dir() -> Result<PathBuf> {
    static SEQUENCE: AtomicU32 = AtomicU32::new(0);
    let runs = cache_dir()?.join("runs");
    fs::create_dir_all(&runs)?;
    remove_stale_runs(&runs);
    let dir = runs.join(format!(
        "{}-{}",
        std::process::id(),
        SEQUENCE.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn remove_stale_runs(runs: &Path) {
    let Ok(entries) = fs::read_dir(runs) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}
