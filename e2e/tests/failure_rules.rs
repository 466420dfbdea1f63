//! The failure policy's rules and backoff on a real control plane: an exit code that
//! fails the gang at once, an eviction (a disruption, not the application's fault) that
//! restarts it without counting, and the wait between restarts.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, EvictParams};
use muster_api::v1alpha1::WorkloadPhase;
use muster_e2e::scenario::{Test, assert_runs_as_planned, gang, with_test};
use muster_local_cluster::wait;
use serde_json::{Value, json};

fn with_policy(mut workload: Value, policy: Value) -> Value {
    workload["spec"]["failurePolicy"] = policy;
    workload
}

/// Waits until `name` has made `restarts` restarts, `counted` of them counted.
async fn wait_restarts(test: &Test, name: &str, restarts: i32, counted: i32) -> Result<()> {
    let api = test.workloads();
    wait::until(
        &format!("{name} to have restarted {restarts} times, {counted} counted"),
        Duration::from_secs(90),
        || {
            let api = api.clone();
            async move {
                let status = api.get(name).await?.status.unwrap_or_default();
                Ok((status.restarts == restarts
                    && status.restarts_count_towards_max.unwrap_or(status.restarts) == counted)
                    .then_some(()))
            }
        },
    )
    .await
}

#[tokio::test]
async fn an_exit_code_a_rule_names_fails_the_gang_at_once() -> Result<()> {
    with_test("rule-exit-code", &[], &[], |test| {
        Box::pin(async move {
            test.create(with_policy(
                gang("fatal", 2, None),
                json!({"maxRestarts": 3, "rules": [
                    {"name": "bad-config", "action": "FailGang", "onExitCodes": {"operator": "In", "values": [42]}},
                ]}),
            ))
            .await?;
            assert_runs_as_planned(test, "fatal").await?;
            test.exit_pod("fatal-workers-1", 42).await?;
            let failed = test
                .wait_phase("fatal", WorkloadPhase::Failed, Duration::from_secs(60))
                .await?;
            let status = failed.status.context("status")?;
            ensure!(status.restarts == 0, "three restarts were left, none was made");
            let condition = status
                .conditions
                .iter()
                .find(|c| c.type_ == "Failed")
                .context("a Failed condition")?;
            ensure!(
                condition.status == "True"
                    && condition.reason == "FailedByRule"
                    && condition.message.contains("bad-config"),
                "{condition:?}"
            );
            test.wait_finished_holding_nothing("fatal").await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn an_eviction_restarts_the_gang_without_counting() -> Result<()> {
    with_test("rule-disruption", &[], &[], |test| {
        Box::pin(async move {
            // No counted restart at all: any counted failure would fail the gang.
            test.create(with_policy(
                gang("evicted", 2, None),
                json!({"maxRestarts": 0, "rules": [
                    {"name": "disruption", "action": "RestartGangAndIgnoreMaxRestarts",
                     "onPodConditions": [{"type": "DisruptionTarget"}]},
                ]}),
            ))
            .await?;
            assert_runs_as_planned(test, "evicted").await?;
            // The Eviction API marks the pod DisruptionTarget before deleting it; the pod
            // then takes a few seconds to stop, as a real one takes its grace period.
            let pods: Api<Pod> = test.pods();
            let slow = json!({"metadata": {"annotations": {"muster-e2e-terminate-after": "5s"}}});
            pods.patch(
                "evicted-workers-0",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&slow),
            )
            .await?;
            pods.evict("evicted-workers-0", &EvictParams::default()).await?;
            wait_restarts(test, "evicted", 1, 0).await?;
            test.wait_phase("evicted", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            assert_runs_as_planned(test, "evicted").await?;
            // A failure of the application still counts, and none is allowed.
            test.exit_pod("evicted-workers-1", 1).await?;
            test.wait_phase("evicted", WorkloadPhase::Failed, Duration::from_secs(60))
                .await?;
            test.wait_finished_holding_nothing("evicted").await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn restarts_wait_a_backoff_that_doubles() -> Result<()> {
    with_test("backoff", &[], &[], |test| {
        Box::pin(async move {
            test.create(with_policy(
                gang("patient", 1, None),
                json!({"maxRestarts": 3, "restartBackoff": {"initialSeconds": 3, "maxSeconds": 20}}),
            ))
            .await?;
            assert_runs_as_planned(test, "patient").await?;
            // Each attempt's pods carry its number; the wait is measured from the
            // failure to the first pod of the next attempt being released.
            let mut waits = Vec::new();
            for attempt in 1..=2 {
                let failed_at = Instant::now();
                let pod = test
                    .gang_pods("patient")
                    .await?
                    .into_iter()
                    .filter_map(|p| p.metadata.name)
                    .find(|n| n.contains("workers"))
                    .context("a worker")?;
                test.exit_pod(&pod, 1).await?;
                let pods = test.pods();
                wait::until(
                    &format!("attempt {attempt} to be released"),
                    Duration::from_secs(90),
                    || {
                        let pods = pods.clone();
                        async move {
                            let released = pods
                                .list(&Default::default())
                                .await?
                                .items
                                .into_iter()
                                .filter(|p| {
                                    p.metadata
                                        .labels
                                        .as_ref()
                                        .and_then(|l| l.get(muster_api::labels::ATTEMPT))
                                        == Some(&attempt.to_string())
                                })
                                .any(|p| !muster::workload::status::is_gated(&p));
                            Ok(released.then_some(()))
                        }
                    },
                )
                .await?;
                waits.push(failed_at.elapsed());
                test.wait_phase("patient", WorkloadPhase::Running, Duration::from_secs(90))
                    .await?;
            }
            // 3 s before the first restart, 6 s before the second: lower bounds only (a
            // loaded machine is slower, never faster).
            ensure!(waits[0] >= Duration::from_secs(3), "first restart after {:?}", waits[0]);
            ensure!(
                waits[1] >= Duration::from_secs(6),
                "second restart after {:?}",
                waits[1]
            );
            let status = test.workloads().get("patient").await?.status.context("status")?;
            ensure!(status.restarts == 2, "{status:?}");
            let restarting = status
                .conditions
                .iter()
                .find(|c| c.type_ == "Restarting")
                .context("Restarting")?;
            ensure!(restarting.reason == "Restarted", "{restarting:?}");
            Ok(())
        })
    })
    .await
}
