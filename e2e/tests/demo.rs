//! `muster demo --teardown` as a new user runs it: its own control plane, the operator and
//! the example training gang, followed until it runs, then everything stopped.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use muster_local_cluster::operator::muster_binary;

#[tokio::test]
async fn the_demo_runs_the_example_gang_and_tears_down() -> Result<()> {
    let mut demo = tokio::process::Command::new(muster_binary()?);
    demo.args(["demo", "--teardown"]).kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(300), demo.output())
        .await
        .context("muster demo did not finish within 300 s")??;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        output.status.success(),
        "muster demo failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    for expected in [
        "control plane ready",
        "16 fake nodes in 4 racks",
        "applied examples/training-gang.yaml",
        "The gang runs:",
        "every claim allocated before any pod started",
        "cluster stopped",
    ] {
        ensure!(
            stdout.contains(expected),
            "no {expected:?} in the demo's output:\n{stdout}"
        );
    }
    // Each status change shows: queued, admitted with its devices reserved, running,
    // with every pod on its planned node.
    let position = |text: &str| stdout.find(text).with_context(|| format!("no {text:?} in:\n{stdout}"));
    let queued = position("llama-pretrain: Queued")?;
    let admitted = position("reserved 32 devices on 4 nodes")?;
    let running = position("llama-pretrain: Running")?;
    ensure!(queued < admitted && admitted < running, "out of order:\n{stdout}");
    let placed: Vec<&str> = stdout.lines().filter(|l| l.contains(" planned on ")).collect();
    ensure!(placed.len() == 5, "five pods listed:\n{stdout}");
    for line in placed {
        let words: Vec<&str> = line.split_whitespace().collect();
        ensure!(words.len() == 7 && words[3] == words[6], "runs where planned: {line}");
    }
    Ok(())
}
