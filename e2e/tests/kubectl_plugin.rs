//! `kubectl muster`: the muster binary linked as `kubectl-muster` on the PATH, run by the
//! real kubectl as a plugin against the live cluster.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use muster_e2e::scenario::{Test, assert_runs_as_planned, gang, with_test};
use muster_local_cluster::operator::muster_binary;
use muster_local_cluster::paths::control_plane_binaries;
use serde_json::{Value, json};

/// A directory holding `kubectl-muster`, a link to the muster binary.
fn plugin_dir(test: &Test) -> Result<PathBuf> {
    let dir = test.cluster.control_plane.run_dir().join(format!("{}-plugin", test.ns));
    std::fs::create_dir_all(&dir)?;
    let link = dir.join("kubectl-muster");
    if !link.exists() {
        std::os::unix::fs::symlink(muster_binary()?, &link)?;
    }
    Ok(dir)
}

/// Runs `kubectl muster ARGS` and returns what it printed; fails when it fails.
fn kubectl_muster(test: &Test, plugins: &Path, args: &[&str]) -> Result<String> {
    let kubectl = control_plane_binaries()?.join("kubectl");
    let path = std::env::join_paths(
        std::iter::once(plugins.to_path_buf())
            .chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )?;
    let output = Command::new(&kubectl)
        .arg("muster")
        .args(args)
        .env("PATH", path)
        .env("KUBECONFIG", test.cluster.control_plane.kubeconfig())
        .output()
        .context("running kubectl")?;
    let stdout = String::from_utf8(output.stdout)?;
    ensure!(
        output.status.success(),
        "kubectl muster {} failed ({}): {}{}",
        args.join(" "),
        output.status,
        stdout,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(stdout)
}

#[tokio::test]
async fn why_and_status_answer_through_kubectl() -> Result<()> {
    with_test("plugin", &[], &[], |test| {
        Box::pin(async move {
            let plugins = plugin_dir(test)?;
            let ns = test.ns.clone();
            let ns = ns.as_str();

            test.create(gang("runs", 2, None)).await?;
            assert_runs_as_planned(test, "runs").await?;
            // 64 workers of 8 GPUs in one rack cannot fit anywhere.
            test.create(gang("never", 64, None)).await?;
            test.wait_admitted_reason("never", "Unschedulable", Duration::from_secs(60))
                .await?;

            let why = kubectl_muster(test, &plugins, &["why", "never", "-n", ns])?;
            ensure!(why.contains(&format!("{ns}/never is Queued")), "{why}");
            ensure!(why.contains("muster says: Unschedulable"), "{why}");
            ensure!(why.contains("never: does not fit"), "{why}");
            // The planner's reason, with numbers, per group and level.
            ensure!(
                why.contains("group workers needs 64 pods") && why.contains("example.com/rack"),
                "{why}"
            );

            let why = kubectl_muster(test, &plugins, &["why", "runs", "-n", ns])?;
            ensure!(why.contains(&format!("{ns}/runs is Running (Released")), "{why}");
            ensure!(why.contains("16 devices on"), "{why}");

            // A gang that fits but is held (suspended, then resumed with the operator
            // stopped): why plans it and shows where it would go.
            test.operator.take().context("operator")?.stop();
            test.create(gang("would-fit", 1, None)).await?;
            let why = kubectl_muster(test, &plugins, &["why", "would-fit", "-n", ns])?;
            ensure!(why.contains("would-fit: fits (example.com/rack="), "{why}");
            ensure!(why.contains("would-fit-workers-0"), "the plan lists the pods: {why}");
            ensure!(why.contains("It fits now"), "{why}");
            let answer: Value = serde_json::from_str(&kubectl_muster(
                test,
                &plugins,
                &["why", "would-fit", "-n", ns, "-o", "json"],
            )?)?;
            ensure!(answer["plan"]["feasible"] == json!(true), "{answer}");
            ensure!(answer["gang"]["name"] == "would-fit", "{answer}");

            let status = kubectl_muster(test, &plugins, &["status", "-n", ns])?;
            let lines: Vec<Vec<&str>> = status.lines().map(|l| l.split_whitespace().collect()).collect();
            ensure!(lines[0][..3] == ["NAME", "PHASE", "STATE"], "{status}");
            let row = |name: &str| lines.iter().find(|l| l[0] == name).cloned().unwrap_or_default();
            ensure!(row("runs")[1..4] == ["Running", "Released", "16"], "{status}");
            ensure!(
                row("never")[1] == "Queued" && row("never").last() == Some(&"Unschedulable"),
                "{status}"
            );

            let wide = kubectl_muster(test, &plugins, &["status", "-A", "-o", "wide"])?;
            let header = wide.lines().next().unwrap_or_default();
            ensure!(header.starts_with("NAMESPACE") && header.contains("MESSAGE"), "{wide}");
            ensure!(wide.lines().any(|l| l.starts_with(ns) && l.contains("runs")), "{wide}");

            let json: Value =
                serde_json::from_str(&kubectl_muster(test, &plugins, &["status", "-n", ns, "-o", "json"])?)?;
            let gangs = json["gangs"].as_array().context("gangs")?;
            ensure!(gangs.len() == 3, "{json}");
            let never = gangs.iter().find(|g| g["name"] == "never").context("never")?;
            ensure!(
                never["reason"] == "Unschedulable" && never["waiting"].as_u64().is_some(),
                "{never}"
            );
            let yaml = kubectl_muster(test, &plugins, &["top", "-n", ns, "-o", "yaml"])?;
            ensure!(yaml.contains("name: runs") && yaml.contains("phase: Running"), "{yaml}");

            // A Workload that is not there is a clear error.
            let missing = kubectl_muster(test, &plugins, &["why", "nothing", "-n", ns]);
            ensure!(
                missing.as_ref().is_err_and(|e| e.to_string().contains("not found")),
                "{missing:?}"
            );
            // The operator cleans up after the test.
            test.start_operator(&[], &[])?;
            Ok(())
        })
    })
    .await
}
