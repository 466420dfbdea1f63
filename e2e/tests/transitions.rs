//! The operator killed right after a write of each transition of a running gang —
//! suspend, success, restart, teardown — converges once it is back: the transition
//! finishes, and nothing leaks. So does an interrupted commit that the next operator
//! undoes. (The commit's own steps are covered in the admission tests.)

use std::time::Duration;

use anyhow::{Context, Result};
use kube::api::{DeleteParams, Patch, PatchParams};
use muster_api::v1alpha1::WorkloadPhase;
use muster_e2e::scenario::{Test, allocations, assert_runs_as_planned, gang, with_test};
use muster_local_cluster::wait;
use serde_json::json;

#[derive(Clone, Copy, Debug)]
enum Drive {
    Suspend,
    Succeed,
    Restart,
    /// Another claim is given one of the running gang's devices: the gang gives way.
    Conflict,
}

async fn drive(test: &Test, how: Drive) -> Result<()> {
    match how {
        Drive::Suspend => {
            test.workloads()
                .patch(
                    "victim",
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"spec": {"suspend": true}})),
                )
                .await?;
        }
        Drive::Succeed => test.exit_pod("victim-launcher-0", 0).await?,
        Drive::Restart => test.exit_pod("victim-workers-1", 1).await?,
        Drive::Conflict => {
            test.intrude_on("victim-workers-0-gpus").await?;
        }
    }
    Ok(())
}

/// Where the gang must end up once the transition is finished.
async fn converged(test: &Test, how: Drive) -> Result<()> {
    let claims = test.claims();
    match how {
        Drive::Suspend => {
            test.wait_phase("victim", WorkloadPhase::Suspended, Duration::from_secs(90))
                .await?;
            wait::until("the suspended gang to hold nothing", Duration::from_secs(60), || {
                let claims = claims.clone();
                async move { Ok(allocations(&claims).await?.is_empty().then_some(())) }
            })
            .await?;
            test.workloads()
                .patch(
                    "victim",
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"spec": {"suspend": false}})),
                )
                .await?;
            assert_runs_as_planned(test, "victim").await?;
        }
        Drive::Succeed => {
            test.wait_phase("victim", WorkloadPhase::Succeeded, Duration::from_secs(90))
                .await?;
            test.wait_finished_holding_nothing("victim").await?;
        }
        Drive::Restart => {
            let workloads = test.workloads();
            wait::until("the gang to have restarted once", Duration::from_secs(90), || {
                let workloads = workloads.clone();
                async move {
                    let w = workloads.get("victim").await?;
                    Ok(w.status.is_some_and(|s| s.restarts == 1).then_some(()))
                }
            })
            .await?;
            test.wait_phase("victim", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            assert_runs_as_planned(test, "victim").await?;
        }
        Drive::Conflict => {
            let claims = test.claims();
            wait::until(
                "the gang to run again off the intruder's device",
                Duration::from_secs(90),
                || {
                    let claims = claims.clone();
                    async move {
                        let held = allocations(&claims).await?;
                        let Some(taken) = held.get("intruder").and_then(|d| d.first()).cloned() else {
                            return Ok(None);
                        };
                        // The gang's claims allocated again (none, right after the
                        // crash, would pass vacuously), none on the taken device.
                        let gang: Vec<_> = held.iter().filter(|(name, _)| name.as_str() != "intruder").collect();
                        let clear = !gang.is_empty() && gang.iter().all(|(_, devices)| !devices.contains(&taken));
                        Ok(clear.then_some(()))
                    }
                },
            )
            .await?;
            assert_runs_as_planned(test, "victim").await?;
            test.claims().delete("intruder", &DeleteParams::default()).await?;
        }
    }
    Ok(())
}

#[tokio::test]
async fn the_operator_killed_after_any_write_of_a_transition_converges() -> Result<()> {
    let cases = [
        (Drive::Suspend, "after-released-record"),
        (Drive::Suspend, "after-suspending-delete"),
        (Drive::Suspend, "after-suspending-deallocate"),
        (Drive::Suspend, "after-suspending-record"),
        (Drive::Succeed, "after-finishing-delete"),
        (Drive::Succeed, "after-finishing-deallocate"),
        (Drive::Succeed, "after-finishing-record"),
        // A restart gives back what its failed pod left and places the gang again.
        (Drive::Restart, "after-restarting-delete"),
        (Drive::Restart, "after-restarting-deallocate"),
        (Drive::Restart, "after-restarting-record"),
        (Drive::Conflict, "after-tearing-down-delete"),
        (Drive::Conflict, "after-tearing-down-deallocate"),
        (Drive::Conflict, "after-tearing-down-record"),
    ];
    for (how, fault) in cases {
        let name = format!("crash-{fault}");
        with_test(&name, &[], &[], |test| {
            Box::pin(async move {
                let mut workload = gang("victim", 2, None);
                workload["spec"]["successPolicy"] = json!({"podGroups": ["launcher"]});
                workload["spec"]["failurePolicy"] = json!({"maxRestarts": 1});
                test.create(workload).await?;
                assert_runs_as_planned(test, "victim").await?;

                // The same operator, now set to abort after the transition's write.
                if let Some(operator) = test.operator.take() {
                    operator.stop();
                }
                test.start_operator(&[], &[("MUSTER_FAULT_POINT", fault)])?;
                drive(test, how).await?;
                let operator = test.operator.as_mut().context("operator")?;
                operator.wait_aborted_at(fault, Duration::from_secs(90)).await?;
                test.operator = None;
                test.start_operator(&[], &[])?;
                converged(test, how).await
            })
        })
        .await
        .with_context(|| format!("after a crash {fault} ({how:?})"))?;
    }
    Ok(())
}

/// A commit interrupted after it allocated every claim is undone by the next operator,
/// which is itself killed after each of the undo's writes; the one after it finishes
/// the undo, and the gang is placed again.
#[tokio::test]
async fn an_interrupted_commit_is_undone_across_crashes() -> Result<()> {
    with_test(
        "crash-undo",
        &[],
        &[("MUSTER_FAULT_POINT", "after-all-claims")],
        |test| {
            Box::pin(async move {
                test.create(gang("victim", 2, None)).await?;
                for fault in [
                    "after-all-claims",
                    "after-reserving-deallocate",
                    "after-reserving-record",
                ] {
                    let operator = test.operator.as_mut().context("operator")?;
                    operator.wait_aborted_at(fault, Duration::from_secs(90)).await?;
                    test.operator = None;
                    let next = match fault {
                        "after-all-claims" => vec![("MUSTER_FAULT_POINT", "after-reserving-deallocate")],
                        "after-reserving-deallocate" => vec![("MUSTER_FAULT_POINT", "after-reserving-record")],
                        _ => vec![],
                    };
                    test.start_operator(&[], &next)?;
                }
                assert_runs_as_planned(test, "victim").await?;
                Ok(())
            })
        },
    )
    .await
}
