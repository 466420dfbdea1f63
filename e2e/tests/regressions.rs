//! One test per defect the admission state machine closed, on the real control plane.
//! Each failed before the state machine drove admission.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod, ResourceQuota};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use muster_api::labels;
use muster_api::v1alpha1::{AdmissionState, WorkloadPhase};
use muster_e2e::scenario::{
    HIGH, LOW, MID, NEVER, Test, allocations, assert_runs_as_planned, claim_sharers, gang, job_joining, outside_user,
    priority_classes, ranked, sharing_claim, terminating_for, user_claim, with_test, workload_of_joining_pods,
};
use muster_local_cluster::fleet::GPU_DRIVER;
use muster_local_cluster::wait;
use serde_json::json;

async fn restarts(test: &Test, name: &str) -> Result<i32> {
    Ok(test.workloads().get(name).await?.status.map_or(0, |s| s.restarts))
}

/// Restarts the test's operator so that it pauses at `point` until the file `until`
/// exists.
fn restart_paused(test: &mut Test, point: &str, until: &str) -> Result<()> {
    if let Some(operator) = test.operator.take() {
        operator.stop();
    }
    test.start_operator(&[], &[("MUSTER_PAUSE_POINT", point), ("MUSTER_PAUSE_UNTIL", until)])
}

/// Defect 1: an extra released long after the gang was admitted measured its schedule
/// timeout from the gang's release, and tore the running gang down.
#[tokio::test]
async fn defect_1_an_extra_released_after_the_schedule_timeout_does_not_tear_the_gang_down() -> Result<()> {
    with_test("late-extra", &["--schedule-timeout", "5"], &[], |test| {
        Box::pin(async move {
            // Two of rack-0000's four nodes are taken.
            test.create(gang("blocker", 2, Some("rack-0000"))).await?;
            assert_runs_as_planned(test, "blocker").await?;
            let mut elastic = gang("elastic", 4, Some("rack-0000"));
            elastic["spec"]["podGroups"][1]["minCount"] = json!(2);
            test.create(elastic).await?;
            test.wait_phase("elastic", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            // Longer than the schedule timeout passes before the extras have room.
            let workloads = test.workloads();
            wait::holds("the gang running without its extras", Duration::from_secs(7), || {
                let workloads = workloads.clone();
                async move {
                    let w = workloads.get("elastic").await?;
                    let placement = w.status.and_then(|s| s.placement);
                    Ok(placement.is_some_and(|p| p.state == Some(AdmissionState::Released) && p.pods.len() == 3))
                }
            })
            .await?;
            test.workloads().delete("blocker", &DeleteParams::default()).await?;
            let pods = test.pods();
            wait::until("the extras to run", Duration::from_secs(90), || {
                let pods = pods.clone();
                async move {
                    let running = pods
                        .list(&ListParams::default().labels(&format!("{}=elastic", labels::WORKLOAD)))
                        .await?
                        .items
                        .into_iter()
                        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                        .count();
                    Ok((running == 5).then_some(()))
                }
            })
            .await?;
            // The gang was never torn down: no restart, same attempt, still released.
            let workload = test.workloads().get("elastic").await?;
            let status = workload.status.context("status")?;
            let admitted = status
                .conditions
                .iter()
                .find(|c| c.type_ == "Admitted")
                .context("Admitted")?;
            ensure!(admitted.status == "True", "{admitted:?}");
            ensure!(status.restarts == 0, "restarts: {}", status.restarts);
            let core = test.pods().get("elastic-workers-0").await?;
            ensure!(core.metadata.deletion_timestamp.is_none(), "the core pods stay");
            assert_runs_as_planned(test, "elastic").await?;
            Ok(())
        })
    })
    .await
}

/// Defect 2: a claim the gang shares with a pod outside it was deallocated when the gang
/// ended, while that pod still ran on its device.
#[tokio::test]
async fn defect_2_a_shared_claim_another_pod_uses_stays_allocated_after_the_gang_ends() -> Result<()> {
    with_test("shared-claim", &[], &[], |test| {
        Box::pin(async move {
            let claims = test.claims();
            let claim: ResourceClaim = serde_json::from_value(json!({
                "metadata": {"name": "shared-gpu"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": GPU_DRIVER, "count": 1}}]}},
            }))?;
            claims.create(&PostParams::default(), &claim).await?;
            // The worker's only device is the shared claim's.
            let mut workload = gang("sharer", 1, None);
            let worker = &mut workload["spec"]["podGroups"][1]["template"]["spec"];
            worker["resourceClaims"] = json!([]);
            worker["containers"][0]["resources"]["claims"] = json!([{"name": "fabric"}]);
            workload["spec"]["resourceClaims"] =
                json!([{"name": "fabric", "resourceClaimName": "shared-gpu", "podGroups": ["workers"]}]);
            workload["spec"]["successPolicy"] = json!({"podGroups": ["launcher"]});
            test.create(workload).await?;
            test.wait_phase("sharer", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            let held = allocations(&test.claims()).await?;
            ensure!(held.contains_key("shared-gpu"), "muster allocated the shared claim: {held:?}");

            // A plain pod joins the claim; kube-scheduler puts it where the device is.
            let outsider: Pod = serde_json::from_value(json!({
                "metadata": {"name": "outsider"},
                "spec": {
                    "containers": [{"name": "main", "image": "tool", "resources": {"claims": [{"name": "gpu"}]}}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": "shared-gpu"}],
                    "tolerations": [{"key": labels::FENCE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
                },
            }))?;
            test.pods().create(&PostParams::default(), &outsider).await?;
            let pods = test.pods();
            let outsider_uid = wait::until("the outsider to run", Duration::from_secs(60), || {
                let pods = pods.clone();
                async move {
                    let pod = pods.get("outsider").await?;
                    let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                    Ok(running.then(|| pod.metadata.uid.clone().unwrap_or_default()))
                }
            })
            .await?;

            // The gang succeeds and gives back what only it used.
            test.exit_pod("sharer-launcher-0", 0).await?;
            test.wait_phase("sharer", WorkloadPhase::Succeeded, Duration::from_secs(60))
                .await?;
            let claims_api = test.claims();
            wait::until("the gang's own claims to be free", Duration::from_secs(60), || {
                let claims = claims_api.clone();
                async move {
                    let held = allocations(&claims).await?;
                    Ok(held.keys().all(|c| c == "shared-gpu").then_some(()))
                }
            })
            .await?;
            // The shared claim stays allocated and reserved for the outsider.
            let claims_api = test.claims();
            let outsider_uid = &outsider_uid;
            wait::holds("the outsider keeping its device", Duration::from_secs(5), || {
                let claims = claims_api.clone();
                async move {
                    let claim = claims.get("shared-gpu").await?;
                    let status = claim.status.unwrap_or_default();
                    let reserved = status.reserved_for.unwrap_or_default();
                    Ok(status.allocation.is_some() && reserved.iter().any(|r| &r.uid == outsider_uid))
                }
            })
            .await?;
            // Once the outsider is gone, the gang gives the claim back and finishes.
            test.pods().delete("outsider", &DeleteParams::default()).await?;
            test.wait_finished_holding_nothing("sharer").await?;
            test.claims().delete("shared-gpu", &DeleteParams::default()).await?;
            Ok(())
        })
    })
    .await
}

/// Defect 4: the conflict check read the claims once; an allocation another scheduler
/// wrote after that read went unseen, and a device stayed with two claims. Now a
/// released gang whose device another claim holds too gives way and is placed again.
#[tokio::test]
async fn defect_4_an_allocation_written_after_the_conflict_check_is_caught() -> Result<()> {
    let go_on = std::env::temp_dir().join(format!("muster-defect-4-{}", std::process::id()));
    let go_on_text = go_on.display().to_string();
    let paused = [
        ("MUSTER_PAUSE_POINT", "after-reserved"),
        ("MUSTER_PAUSE_UNTIL", go_on_text.as_str()),
    ];
    with_test("late-intruder", &[], &paused, |test| {
        let go_on = go_on.clone();
        Box::pin(async move {
            test.create(gang("victim", 1, None)).await?;
            test.wait_paused("after-reserved").await?;
            // Another scheduler writes an allocation of one of the gang's devices now.
            let (pool, device) = test.intrude_on("victim-workers-0-gpus").await?;
            std::fs::write(&go_on, b"")?;

            // The gang is released, sees the double allocation, gives way and runs again
            // on other devices; the intruder keeps its device.
            test.wait_event("victim", "RolledBack", "allocated to another claim as well")
                .await?;
            test.wait_phase("victim", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            let held = allocations(&test.claims()).await?;
            ensure!(
                held.get("intruder") == Some(&vec![(pool.clone(), device.clone())]),
                "the intruder keeps its device: {held:?}"
            );
            ensure!(
                held.iter()
                    .filter(|(name, _)| name.as_str() != "intruder")
                    .all(|(_, devices)| !devices.contains(&(pool.clone(), device.clone()))),
                "no claim of the gang holds the intruder's device: {held:?}"
            );
            test.claims().delete("intruder", &DeleteParams::default()).await?;
            let _ = std::fs::remove_file(&go_on);
            Ok(())
        })
    })
    .await
}

/// Defect 5: a teardown deleted the pods with grace 0 and gave their devices to the
/// next gang while their containers could still run. Pods here take 12 s to stop: the
/// next gang gets the devices only once they are gone.
#[tokio::test]
async fn defect_5_devices_are_not_given_again_while_the_old_pods_terminate() -> Result<()> {
    with_test("slow-stop", &[], &[], |test| {
        Box::pin(async move {
            // All of rack-0000's GPUs, held by pods that take 12 s to stop.
            let mut first = gang("first", 4, Some("rack-0000"));
            for group in first["spec"]["podGroups"].as_array_mut().context("podGroups")? {
                group["template"]["metadata"] = json!({"annotations": {"muster-e2e-terminate-after": "12s"}});
            }
            test.create(first).await?;
            assert_runs_as_planned(test, "first").await?;
            test.create(gang("second", 1, Some("rack-0000"))).await?;
            test.wait_admitted_reason("second", "Unschedulable", Duration::from_secs(60))
                .await?;

            test.workloads()
                .patch(
                    "first",
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"spec": {"suspend": true}})),
                )
                .await?;
            let mut seen_terminating = false;
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            loop {
                ensure!(std::time::Instant::now() < deadline, "second never ran");
                let first_pods = test.gang_pods("first").await?;
                seen_terminating |= first_pods.iter().any(|p| p.metadata.deletion_timestamp.is_some());
                let second_allocated = test
                    .gang_claims("second")
                    .await?
                    .iter()
                    .any(|c| c.status.as_ref().and_then(|s| s.allocation.as_ref()).is_some());
                ensure!(
                    first_pods.is_empty() || !second_allocated,
                    "second holds devices while {} pods of first still exist",
                    first_pods.len()
                );
                if first_pods.is_empty() && second_allocated {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            ensure!(
                seen_terminating,
                "first's pods were deleted gracefully and seen terminating"
            );
            assert_runs_as_planned(test, "second").await?;
            Ok(())
        })
    })
    .await
}

/// Defect 6: resuming a suspended gang while its pods still terminated marked it
/// Failed (the pods looked lost).
#[tokio::test]
async fn defect_6_a_quick_resume_while_pods_terminate_runs_the_gang_again() -> Result<()> {
    with_test("quick-resume", &[], &[], |test| {
        Box::pin(async move {
            test.create(gang("toggled", 2, None)).await?;
            assert_runs_as_planned(test, "toggled").await?;
            let params = PatchParams::default();
            test.workloads()
                .patch("toggled", &params, &Patch::Merge(&json!({"spec": {"suspend": true}})))
                .await?;
            test.workloads()
                .patch("toggled", &params, &Patch::Merge(&json!({"spec": {"suspend": false}})))
                .await?;
            let workload = test
                .wait_phase("toggled", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            let status = workload.status.context("status")?;
            ensure!(
                !status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Failed" && c.status == "True"),
                "the gang did not fail: {:?}",
                status.conditions
            );
            ensure!(status.restarts == 0, "no restart: {}", status.restarts);
            assert_runs_as_planned(test, "toggled").await?;
            Ok(())
        })
    })
    .await
}

/// Defect 7: a gang of another controller's pods could not restart: its pods have no
/// attempt label, so every pod the Job made again was deleted as old.
#[tokio::test]
async fn defect_7_a_gang_of_job_pods_restarts_after_losing_a_pod() -> Result<()> {
    with_test("job-restart", &[], &[], |test| {
        Box::pin(async move {
            let mut workload = workload_of_joining_pods("trainers", "workers", 2);
            workload["spec"]["failurePolicy"] = json!({"maxRestarts": 2});
            test.create(workload).await?;
            let job: Job = serde_json::from_value(job_joining("trainers", "workers", 2))?;
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            jobs.create(&PostParams::default(), &job).await?;
            let workload = test
                .wait_phase("trainers", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            let first = workload.status.and_then(|s| s.placement).context("placement")?;
            let lost = first.pods.first().context("a planned pod")?.name.clone();
            test.pods().delete(&lost, &DeleteParams::default()).await?;

            // One restart: the Job's new pods join, are placed and run.
            let api = test.workloads();
            wait::until("the gang to restart once and run", Duration::from_secs(120), || {
                let api = api.clone();
                async move {
                    let w = api.get("trainers").await?;
                    let status = w.status.unwrap_or_default();
                    let running = status.phase == Some(WorkloadPhase::Running);
                    Ok((status.restarts == 1 && running).then_some(()))
                }
            })
            .await?;
            let workload = test.workloads().get("trainers").await?;
            let placement = workload.status.and_then(|s| s.placement).context("placement")?;
            ensure!(
                placement.pods.iter().all(|p| p.name != lost),
                "the lost pod's replacement runs: {:?}",
                placement.pods
            );
            ensure!(restarts(test, "trainers").await? == 1);
            for planned in &placement.pods {
                let pod = test.pods().get(&planned.name).await?;
                let node = pod.spec.and_then(|s| s.node_name).context("bound")?;
                ensure!(
                    node == planned.node,
                    "{} on {node}, planned {}",
                    planned.name,
                    planned.node
                );
            }
            jobs.delete("trainers", &DeleteParams::background()).await?;
            Ok(())
        })
    })
    .await
}

/// Defect 9: a reservation waited forever for planned pods that never came, holding
/// every device of the gang. Here a quota stops the restarted gang's pods from being
/// made. A restart no longer goes onto its reservation as it is (its claims are
/// protected and the failed pod's goes with it): the claims left are given back and the
/// gang waits in the queue holding nothing until its pods exist, then runs again. (A
/// reservation recorded without its pods, one waiting for Kueue or for pods being made
/// again, is given back after the timeout: `transitions.rs`.)
#[tokio::test]
async fn defect_9_a_reservation_whose_pods_never_appear_is_given_back() -> Result<()> {
    with_test("no-pods", &["--schedule-timeout", "5"], &[], |test| {
        Box::pin(async move {
            let mut workload = gang("stuck", 1, None);
            workload["spec"]["failurePolicy"] = json!({"maxRestarts": 1});
            test.create(workload).await?;
            assert_runs_as_planned(test, "stuck").await?;
            let quotas: Api<ResourceQuota> = Api::namespaced(test.client.clone(), &test.ns);
            let quota: ResourceQuota = serde_json::from_value(json!({
                "metadata": {"name": "no-pods"},
                "spec": {"hard": {"pods": "0"}},
            }))?;
            quotas.create(&PostParams::default(), &quota).await?;
            // A pod fails: the gang restarts, but no pod can be made.
            test.exit_pod("stuck-workers-0", 1).await?;
            let claims = test.claims();
            let workloads = test.workloads();
            let holds_nothing = || {
                let (claims, workloads) = (claims.clone(), workloads.clone());
                async move {
                    let placement = workloads.get("stuck").await?.status.and_then(|s| s.placement);
                    anyhow::Ok(allocations(&claims).await?.is_empty() && placement.and_then(|p| p.state).is_none())
                }
            };
            wait::until("the reservation to be given back", Duration::from_secs(60), || {
                let check = holds_nothing();
                async move { Ok(check.await?.then_some(())) }
            })
            .await?;
            wait::holds(
                "the gang to hold nothing while its pods cannot be made",
                Duration::from_secs(6),
                holds_nothing,
            )
            .await?;
            // Pods can be made again: the gang is placed and runs.
            quotas.delete("no-pods", &DeleteParams::default()).await?;
            test.wait_phase("stuck", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            assert_runs_as_planned(test, "stuck").await?;
            ensure!(restarts(test, "stuck").await? == 1, "restarted once");
            Ok(())
        })
    })
    .await
}

/// Defect 10: a gang that can never fit blocked every gang behind it once it had waited
/// past the starvation limit.
#[tokio::test]
async fn defect_10_a_gang_that_can_never_fit_does_not_hold_the_queue() -> Result<()> {
    with_test("never-fits", &["--starvation-after", "1"], &[], |test| {
        Box::pin(async move {
            // Nine workers with eight GPUs each in one rack of four nodes: never.
            test.create(gang("huge", 9, None)).await?;
            let message = test
                .wait_admitted_reason("huge", "Unschedulable", Duration::from_secs(60))
                .await?;
            ensure!(message.contains("would not fit even on an empty cluster"), "{message}");
            // Past the starvation limit.
            test.wait_admitted_unchanged_for("huge", 2.0).await?;
            test.create(gang("small", 1, None)).await?;
            assert_runs_as_planned(test, "small").await?;
            Ok(())
        })
    })
    .await
}

/// Defect 11: two groups whose per-pod claims would get one object name passed the
/// schema; the claim was made once and fought over, retried forever. It is refused
/// with a condition that names both claims, and nothing is made.
#[tokio::test]
async fn defect_11_claims_of_two_groups_with_one_object_name_are_refused() -> Result<()> {
    with_test("name-clash", &[], &[], |test| {
        Box::pin(async move {
            let mut clash = gang("clash", 1, None);
            let workers = clash["spec"]["podGroups"][1].clone();
            let mut twin = workers.clone();
            twin["name"] = json!("workers-0");
            twin["template"]["spec"]["resourceClaims"][0]["name"] = json!("gpus");
            clash["spec"]["podGroups"][1]["template"]["spec"]["resourceClaims"][0]["name"] = json!("0-gpus");
            clash["spec"]["podGroups"][1]["template"]["spec"]["containers"][0]["resources"]["claims"][0]["name"] =
                json!("0-gpus");
            clash["spec"]["podGroups"]
                .as_array_mut()
                .context("podGroups")?
                .push(twin);
            test.create(clash).await?;
            let api = test.workloads();
            let message = wait::until(
                "the Created condition to refuse the spec",
                Duration::from_secs(60),
                || {
                    let api = api.clone();
                    async move {
                        let w = api.get("clash").await?;
                        let condition = w
                            .status
                            .unwrap_or_default()
                            .conditions
                            .into_iter()
                            .find(|c| c.type_ == "Created" && c.status == "False" && c.reason == "InvalidSpec");
                        Ok(condition.map(|c| c.message))
                    }
                },
            )
            .await?;
            ensure!(
                message.contains("would both be made as ResourceClaim clash-workers-0-0-gpus"),
                "{message}"
            );
            // Nothing was made, and it stays that way.
            wait::holds("no pod and no claim of the gang", Duration::from_secs(3), || async {
                Ok(test.gang_pods("clash").await?.is_empty() && test.gang_claims("clash").await?.is_empty())
            })
            .await?;
            Ok(())
        })
    })
    .await
}

// ---- Issue 22: shared claims, nominations and preemption ----

/// The claim `name`'s allocation, as JSON (`None`: not allocated).
async fn allocation_of(test: &Test, name: &str) -> Result<Option<serde_json::Value>> {
    let claim = test.claims().get(name).await?;
    Ok(claim
        .status
        .and_then(|s| s.allocation)
        .map(|a| serde_json::to_value(a).unwrap_or_default()))
}

/// Once the pod `blocker` goes, gang `name` runs, on the allocation `held` of claim
/// `scratch`.
async fn runs_on_once_unblocked(test: &Test, name: &str, held: serde_json::Value) -> Result<()> {
    test.pods().delete("blocker", &DeleteParams::default()).await?;
    test.wait_phase(name, WorkloadPhase::Running, Duration::from_secs(60))
        .await?;
    ensure!(
        allocation_of(test, "scratch").await? == Some(held),
        "{name} runs on the allocation it held"
    );
    Ok(())
}

/// `name` stays released, never restarted, for `seconds`.
async fn stays_released(test: &Test, name: &str, seconds: u64) -> Result<()> {
    let api = test.workloads();
    wait::holds(
        &format!("{name} to stay released"),
        Duration::from_secs(seconds),
        || {
            let api = api.clone();
            async move {
                let status = api.get(name).await?.status.unwrap_or_default();
                let state = status.placement.and_then(|p| p.state);
                Ok(state == Some(AdmissionState::Released) && status.restarts == 0)
            }
        },
    )
    .await
}

/// Issue 22, defect 1a: a gang admitted onto a claim that another Workload joined first
/// (so the claim carries the other's label) did not see the claim, took itself apart as
/// if the claim had lost its allocation, and then could not let go of it: wedged in
/// TearingDown, the device allocated with no consumer.
#[tokio::test]
async fn issue22_1a_a_gang_runs_on_a_claim_another_workload_joined_first() -> Result<()> {
    with_test("shared-first", &[], &[], |test| {
        Box::pin(async move {
            test.claims()
                .create(&PostParams::default(), &user_claim("scratch", 1)?)
                .await?;
            // Five pods of 16 CPUs that must share the claim's node: never fits.
            test.create(claim_sharers("big-a", 5, "scratch", None)).await?;
            test.wait_claim_joined("scratch", "big-a").await?;
            test.wait_admitted_reason("big-a", "Unschedulable", Duration::from_secs(60))
                .await?;
            test.create(claim_sharers("small-b", 1, "scratch", None)).await?;
            test.wait_phase("small-b", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            stays_released(test, "small-b", 5).await?;
            let placement = test
                .workloads()
                .get("small-b")
                .await?
                .status
                .and_then(|s| s.placement)
                .context("placement")?;
            ensure!(
                placement.claims.contains(&"scratch".to_string()),
                "the gang's journal names the claim it holds: {:?}",
                placement.claims
            );
            // Once small-b is gone, nothing holds the claim: it is given back.
            test.workloads().delete("small-b", &DeleteParams::default()).await?;
            wait::until("scratch to be given back", Duration::from_secs(60), || async {
                Ok(allocation_of(test, "scratch").await?.is_none().then_some(()))
            })
            .await?;
            Ok(())
        })
    })
    .await
}

/// Issue 22, defect 1b: a claim still labelled for a deleted Workload was taken for an
/// orphan and freed under the gang that holds it, which was placed again and wedged
/// again, for ever.
#[tokio::test]
async fn issue22_1b_a_claim_labelled_for_a_deleted_workload_is_not_freed_under_its_holder() -> Result<()> {
    with_test("shared-orphan", &[], &[], |test| {
        Box::pin(async move {
            test.claims()
                .create(&PostParams::default(), &user_claim("scratch", 1)?)
                .await?;
            test.create(claim_sharers("first", 5, "scratch", None)).await?;
            test.wait_claim_joined("scratch", "first").await?;
            test.workloads().delete("first", &DeleteParams::default()).await?;
            let api = test.workloads();
            wait::until("first to be gone", Duration::from_secs(60), || {
                let api = api.clone();
                async move { Ok(api.get_opt("first").await?.is_none().then_some(())) }
            })
            .await?;
            // The claim keeps the deleted Workload's label.
            test.wait_claim_joined("scratch", "first").await?;
            test.create(claim_sharers("second", 1, "scratch", None)).await?;
            test.wait_phase("second", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            let held = allocation_of(test, "scratch").await?.context("scratch allocated")?;
            stays_released(test, "second", 8).await?;
            ensure!(
                allocation_of(test, "scratch").await? == Some(held),
                "the claim kept its allocation"
            );
            Ok(())
        })
    })
    .await
}

/// Issue 22, defect 1c: a gang that finished gave back a claim it shared with a gang
/// released but not yet bound (`reservedFor` named only the finished gang's pods);
/// kube-scheduler then allocated the claim again itself, outside muster's plan.
#[tokio::test]
async fn issue22_1c_a_finishing_gang_keeps_a_claim_another_released_gang_holds() -> Result<()> {
    let go_on = std::env::temp_dir().join(format!("muster-issue22-1c-{}", std::process::id()));
    let (go_on_text, resume) = (go_on.display().to_string(), go_on.clone());
    let _ = std::fs::remove_file(&go_on);
    let outcome = with_test("shared-finish", &[], &[], |test| {
        Box::pin(async move {
            test.claims()
                .create(&PostParams::default(), &user_claim("scratch", 1)?)
                .await?;
            test.create(claim_sharers("owner", 1, "scratch", None)).await?;
            test.wait_phase("owner", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            let (_, node) = test.wait_pod_running("owner-workers-0").await?;

            // The same operator, now held after the next commit's claims are checked.
            restart_paused(test, "after-reserved", &go_on_text)?;
            test.create(claim_sharers("joiner", 1, "scratch", None)).await?;
            test.wait_paused("after-reserved").await?;
            // The node's CPUs are taken meanwhile: joiner's pod is released but cannot be
            // bound until the blocker goes.
            test.block_cpus("blocker", &node).await?;
            let held = allocation_of(test, "scratch").await?.context("scratch allocated")?;
            std::fs::write(&resume, b"")?;
            test.wait_unschedulable("joiner-workers-0").await?;

            // The owner finishes while joiner waits for its node.
            test.exit_pod("owner-workers-0", 0).await?;
            test.wait_phase("owner", WorkloadPhase::Succeeded, Duration::from_secs(60))
                .await?;
            let api = test.workloads();
            wait::until("owner to finish", Duration::from_secs(60), || {
                let api = api.clone();
                async move {
                    let state = api
                        .get("owner")
                        .await?
                        .status
                        .and_then(|s| s.placement)
                        .and_then(|p| p.state);
                    Ok((state == Some(AdmissionState::Finished)).then_some(()))
                }
            })
            .await?;
            ensure!(
                allocation_of(test, "scratch").await?.as_ref() == Some(&held),
                "the finished gang left joiner's claim allocated as muster planned it"
            );
            runs_on_once_unblocked(test, "joiner", held).await
        })
    })
    .await;
    let _ = std::fs::remove_file(&go_on);
    outcome
}

/// Issue 22, defect 1d: a nomination that included a claim made every gang sharing that
/// claim look as if its claim were allocated meanwhile, which stopped the whole pass:
/// nothing behind it was placed while the nomination lasted.
#[tokio::test]
async fn issue22_1d_a_nominated_shared_claim_does_not_hold_the_queue() -> Result<()> {
    with_test("nominated-claim", &[], &[], |test| {
        Box::pin(async move {
            priority_classes(&test.client).await?;
            test.claims()
                .create(&PostParams::default(), &user_claim("scratch", 1)?)
                .await?;
            // A victim whose pods take a minute to stop fills rack-0000.
            test.create(terminating_for(ranked(gang("victim", 4, Some("rack-0000")), LOW), 60))
                .await?;
            assert_runs_as_planned(test, "victim").await?;
            // Its launcher shares the claim (a device on one node: only pods on that node
            // can share it).
            let preemptor = sharing_claim(
                ranked(gang("preemptor", 3, Some("rack-0000")), HIGH),
                "launcher",
                "scratch",
            );
            test.create(preemptor).await?;
            test.wait_nomination("preemptor").await?;
            // A gang sharing the nominated claim waits, ahead of a gang that fits.
            let waiting = sharing_claim(ranked(gang("sharer", 1, Some("rack-0000")), LOW), "launcher", "scratch");
            test.create(waiting).await?;
            test.wait_phase("sharer", WorkloadPhase::Queued, Duration::from_secs(60))
                .await?;
            test.create(gang("behind", 1, Some("rack-0001"))).await?;
            test.wait_phase("behind", WorkloadPhase::Running, Duration::from_secs(25))
                .await?;
            ensure!(
                test.workloads()
                    .get("preemptor")
                    .await?
                    .status
                    .and_then(|s| s.nomination)
                    .is_some(),
                "the nomination still held while the gang behind was placed"
            );
            Ok(())
        })
    })
    .await
}

/// Issue 22, defect 2: a gang of higher priority planned around the nomination of a
/// lower one: the lower preemptor was admitted onto the freed devices, and then
/// preempted by the higher gang right after. (The higher gang needs three of the four
/// nodes the nomination holds: it fits as soon as three are free, before the lower one
/// could, so what decides is only whether the nomination is in its way.)
#[tokio::test]
async fn issue22_2_a_lower_nomination_does_not_hold_devices_against_a_higher_gang() -> Result<()> {
    with_test("nomination-order", &[], &[], |test| {
        Box::pin(async move {
            priority_classes(&test.client).await?;
            test.create(terminating_for(ranked(gang("victim", 4, Some("rack-0000")), LOW), 20))
                .await?;
            assert_runs_as_planned(test, "victim").await?;
            test.create(ranked(gang("middle", 4, Some("rack-0000")), MID)).await?;
            test.wait_nomination("middle").await?;
            test.create(ranked(gang("high", 3, Some("rack-0000")), HIGH)).await?;
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            loop {
                ensure!(
                    test.state("middle").await?.is_none(),
                    "middle was admitted onto the devices a gang of higher priority waited for"
                );
                let high = test.workloads().get("high").await?;
                if high.status.and_then(|s| s.phase) == Some(WorkloadPhase::Running) {
                    break;
                }
                ensure!(std::time::Instant::now() < deadline, "high never ran");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            assert_runs_as_planned(test, "high").await?;
            let api = test.workloads();
            wait::until("middle's nomination to be dropped", Duration::from_secs(30), || {
                let api = api.clone();
                async move {
                    let w = api.get("middle").await?;
                    Ok(w.status.is_some_and(|s| s.nomination.is_none()).then_some(()))
                }
            })
            .await?;
            Ok(())
        })
    })
    .await
}

/// Issue 22, defect 4: preemption counted a claim the victim shares with a pod outside
/// it as freed. The victim was evicted for a preemptor that could not fit, and could
/// not leave TearingDown while that pod ran.
#[tokio::test]
async fn issue22_4_preemption_counts_only_what_the_victim_gives_back() -> Result<()> {
    with_test("preempt-shared", &[], &[], |test| {
        Box::pin(async move {
            priority_classes(&test.client).await?;
            test.claims()
                .create(&PostParams::default(), &user_claim("scratch", 1)?)
                .await?;
            // Its launcher shares the claim with a pod outside the gang.
            let victim = sharing_claim(ranked(gang("victim", 3, Some("rack-0000")), LOW), "launcher", "scratch");
            test.create(victim).await?;
            test.wait_phase("victim", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            test.pods()
                .create(&PostParams::default(), &outside_user("outsider", "scratch")?)
                .await?;
            test.wait_pod_running("outsider").await?;

            // The whole rack: with the outsider's device kept, it never fits.
            test.create(ranked(gang("whole", 4, Some("rack-0000")), HIGH)).await?;
            test.wait_admitted_reason("whole", "Unschedulable", Duration::from_secs(60))
                .await?;
            stays_released(test, "victim", 6).await?;
            ensure!(
                test.workloads()
                    .get("whole")
                    .await?
                    .status
                    .is_some_and(|s| s.nomination.is_none()),
                "no nomination for a preemptor that cannot fit"
            );
            test.workloads().delete("whole", &DeleteParams::default()).await?;

            // Three nodes' worth fits once the victim is gone: it is evicted, lets go of
            // the claim the outsider uses, and waits in the queue.
            test.create(ranked(gang("three", 3, Some("rack-0000")), HIGH)).await?;
            test.wait_admitted_reason("victim", "Preempted", Duration::from_secs(60))
                .await?;
            test.wait_phase("victim", WorkloadPhase::Queued, Duration::from_secs(60))
                .await?;
            assert_runs_as_planned(test, "three").await?;
            let claim = test.claims().get("scratch").await?;
            let status = claim.status.unwrap_or_default();
            ensure!(
                status.allocation.is_some() && status.reserved_for.unwrap_or_default().len() == 1,
                "the outsider keeps the claim"
            );
            test.pods().delete("outsider", &DeleteParams::default()).await?;
            Ok(())
        })
    })
    .await
}

// ---- Review of issue 22 ----

/// kube-controller-manager held still (SIGSTOP) until dropped: the entries of pods that
/// are gone stay in `reservedFor` meanwhile, as they do while it lags.
struct ControllerManagerHeld(u32);

impl ControllerManagerHeld {
    fn hold(test: &Test) -> Result<Self> {
        let pid = test
            .cluster
            .control_plane
            .pids()
            .into_iter()
            .find(|(name, _)| name == "kube-controller-manager")
            .map(|(_, pid)| pid)
            .context("kube-controller-manager's pid")?;
        let signalled = std::process::Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()?;
        ensure!(signalled.success(), "stopping kube-controller-manager");
        Ok(ControllerManagerHeld(pid))
    }
}

impl Drop for ControllerManagerHeld {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

/// Review of issue 22, defect 1: a gang took a pod of its own that was gone, while its
/// uid was still in `reservedFor`, for a consumer outside it. Suspended, it let go of its
/// own claim, left it allocated for no one, and said it held nothing (Kueue would have
/// given its quota back while the devices stayed taken). It must hold the claim until the
/// entry goes, then give it back.
#[tokio::test]
async fn issue22_review_a_gone_pod_of_the_gang_still_in_reserved_for_is_its_own() -> Result<()> {
    with_test("gone-own-pod", &[], &[], |test| {
        Box::pin(async move {
            test.create(gang("keeper", 1, Some("rack-0000"))).await?;
            assert_runs_as_planned(test, "keeper").await?;
            let claim = "keeper-workers-0-gpus";
            let (uid, _) = test.wait_pod_running("keeper-workers-0").await?;
            let held = ControllerManagerHeld::hold(test)?;
            test.workloads()
                .patch(
                    "keeper",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"suspend": true}})),
                )
                .await?;
            // The pod goes (kwok ends it at once); its uid stays in reservedFor.
            let pods = test.pods();
            wait::until("the worker to be gone", Duration::from_secs(60), || {
                let pods = pods.clone();
                let uid = uid.clone();
                async move {
                    let pod = pods.get_opt("keeper-workers-0").await?;
                    Ok(pod
                        .is_none_or(|p| p.metadata.uid.as_deref() != Some(uid.as_str()))
                        .then_some(()))
                }
            })
            .await?;
            // As long as the entry stays, the gang keeps naming its claim.
            let api = test.workloads();
            let claims = test.claims();
            wait::holds(
                "the suspended gang to keep naming its claim while its gone pod reserves it",
                Duration::from_secs(8),
                || {
                    let (api, claims, uid) = (api.clone(), claims.clone(), uid.clone());
                    async move {
                        let named = api
                            .get("keeper")
                            .await?
                            .status
                            .and_then(|s| s.placement)
                            .is_some_and(|p| p.claims.iter().any(|c| c == claim));
                        let status = claims.get(claim).await?.status.unwrap_or_default();
                        let allocated = status.allocation.is_some();
                        let reserved = status.reserved_for.unwrap_or_default().iter().any(|r| r.uid == uid);
                        Ok(named || !allocated || !reserved)
                    }
                },
            )
            .await?;
            drop(held);
            // Once kube-controller-manager takes the entry out, the claim is given back.
            wait::until("the claim to be given back", Duration::from_secs(60), || async {
                Ok(allocation_of(test, claim).await?.is_none().then_some(()))
            })
            .await?;
            test.wait_phase("keeper", WorkloadPhase::Suspended, Duration::from_secs(60))
                .await?;
            // The phase is written when the suspension is seen; the admission loop records
            // that it holds nothing once its give-back is done, a moment after the claim.
            wait::until(
                "the suspended gang to hold nothing",
                Duration::from_secs(30),
                || async { Ok(test.state("keeper").await?.is_none().then_some(())) },
            )
            .await?;
            Ok(())
        })
    })
    .await
}

/// Review of issue 22, defect 2: a gang planned a claim it found allocated onto a device
/// that a nomination of higher priority counted on being freed: a fresh allocation could
/// not have taken it, the hold did. The victim then left the claim to that gang, the
/// device never came free, and the preemptor lost its nomination (and went on to evict
/// the gang that took it). The gang must wait until the preemptor is placed.
#[tokio::test]
async fn issue22_review_a_found_claim_counts_against_a_nomination() -> Result<()> {
    with_test("found-nominated", &[], &[], |test| {
        Box::pin(async move {
            priority_classes(&test.client).await?;
            test.claims()
                .create(&PostParams::default(), &user_claim("scratch", 1)?)
                .await?;
            // Three workers and a launcher on the claim's device fill most of rack-0000;
            // its pods take half a minute to stop.
            let victim = sharing_claim(ranked(gang("victim", 3, Some("rack-0000")), LOW), "launcher", "scratch");
            test.create(terminating_for(victim, 30)).await?;
            test.wait_phase("victim", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            // The whole rack, the claim's device included: the victim must go.
            test.create(ranked(gang("preemptor", 4, Some("rack-0000")), HIGH))
                .await?;
            test.wait_nomination("preemptor").await?;
            let nominated: BTreeSet<(String, String)> = test
                .workloads()
                .get("preemptor")
                .await?
                .status
                .and_then(|s| s.nomination)
                .context("nomination")?
                .claims
                .into_iter()
                .flat_map(|c| c.devices)
                .map(|d| (d.pool, d.device))
                .collect();
            // A gang of lower priority that would hold the claim as it is.
            test.create(ranked(claim_sharers("sharer", 1, "scratch", None), MID))
                .await?;
            let deadline = std::time::Instant::now() + Duration::from_secs(150);
            loop {
                let preemptor = test.workloads().get("preemptor").await?;
                if preemptor.status.as_ref().and_then(|s| s.phase) == Some(WorkloadPhase::Running) {
                    break;
                }
                // Once the victim let go of the claim it may be allocated afresh, on a
                // device the nomination does not count on; never held on one it does.
                if test.state("sharer").await?.is_some() {
                    let held = allocations(&test.claims()).await?.remove("scratch").unwrap_or_default();
                    ensure!(
                        held.iter().all(|d| !nominated.contains(d)),
                        "sharer held the claim whose device the preemptor's nomination counts on: {held:?}"
                    );
                }
                ensure!(std::time::Instant::now() < deadline, "the preemptor never ran");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            assert_runs_as_planned(test, "preemptor").await?;
            // Then the claim, given back by the victim, is allocated again for the sharer.
            test.wait_phase("sharer", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            Ok(())
        })
    })
    .await
}

/// Review of issue 22, defect 3: a released gang's extra pods planned around the
/// nomination of a gang of lower priority, which a gang's own plan does not (it plans as
/// if nominations of lower priority were not there). The extras waited while the lower
/// preemptor took the devices they could have had.
#[tokio::test]
async fn issue22_review_extras_plan_through_a_lower_nomination() -> Result<()> {
    with_test("extras-nominated", &[], &[], |test| {
        Box::pin(async move {
            priority_classes(&test.client).await?;
            // Three of rack-0000's four nodes, slow to stop.
            test.create(terminating_for(ranked(gang("victim", 3, Some("rack-0000")), LOW), 15))
                .await?;
            assert_runs_as_planned(test, "victim").await?;
            // The fourth node runs the elastic gang's core; its two extras wait.
            let mut elastic = ranked(gang("elastic", 3, Some("rack-0000")), HIGH);
            elastic["spec"]["podGroups"][1]["minCount"] = json!(1);
            test.create(elastic).await?;
            test.wait_phase("elastic", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            // A gang of lower priority than the elastic one evicts the victim and holds
            // two of its nodes.
            test.create(ranked(gang("preemptor", 2, Some("rack-0000")), MID))
                .await?;
            test.wait_nomination("preemptor").await?;
            // Once the victim is gone, the extras take what they need.
            let pods = test.pods();
            wait::until("every elastic worker to run", Duration::from_secs(120), || {
                let pods = pods.clone();
                async move {
                    let mut running = 0;
                    for i in 0..3 {
                        let pod = pods.get_opt(&format!("elastic-workers-{i}")).await?;
                        let phase = pod.as_ref().and_then(|p| p.status.as_ref()?.phase.clone());
                        let bound = pod.as_ref().and_then(|p| p.spec.as_ref()?.node_name.clone());
                        running += usize::from(phase.as_deref() == Some("Running") && bound.is_some());
                    }
                    Ok((running == 3).then_some(()))
                }
            })
            .await?;
            Ok(())
        })
    })
    .await
}

/// A gang of one pod on node `node` asking for `cpu` CPUs and nothing else.
fn cpu_only(name: &str, node: &str, cpu: &str) -> serde_json::Value {
    json!({
        "apiVersion": "muster.dev/v1alpha1",
        "kind": "Workload",
        "metadata": {"name": name},
        "spec": {"podGroups": [{
            "name": "workers",
            "replicas": 1,
            "template": {"spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "containers": [{"name": "main", "image": "trainer", "resources": {"requests": {"cpu": cpu}}}],
            }},
        }]},
    })
}

/// Second review of issue 22, finding 1: a gang preempted for the CPU or memory its pods
/// take, not for devices, was never evicted: only a victim holding a nominated device
/// was. The preemptor's nomination stood, nothing was evicted, and it waited in
/// five-minute cycles for ever.
#[tokio::test]
async fn issue22_review_a_gang_preempted_for_its_nodes_resources_is_evicted() -> Result<()> {
    with_test("preempt-cpu", &[], &[], |test| {
        Box::pin(async move {
            priority_classes(&test.client).await?;
            // 40 of node-00000's 64 CPUs.
            test.create(ranked(cpu_only("low", "node-00000", "40"), LOW)).await?;
            test.wait_phase("low", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            test.create(ranked(cpu_only("high", "node-00000", "40"), HIGH)).await?;
            test.wait_admitted_reason("low", "Preempted", Duration::from_secs(60))
                .await?;
            test.wait_phase("high", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            test.wait_phase("low", WorkloadPhase::Queued, Duration::from_secs(30))
                .await?;
            Ok(())
        })
    })
    .await
}

/// A node label no node carries until a test puts it on.
const OPEN_LABEL: &str = "muster-e2e/open";

/// Second review of issue 22, finding 4: gangs committed side by side that hold one
/// claim they found allocated each fenced it against the version they read; the first
/// fence moved the version, and every other commit failed with a conflict and backed
/// off, one gang per pass getting through.
#[tokio::test]
async fn issue22_review_gangs_committed_together_all_hold_a_claim_they_found() -> Result<()> {
    with_test("shared-together", &[], &[], |test| {
        Box::pin(async move {
            test.claims()
                .create(&PostParams::default(), &user_claim("scratch", 1)?)
                .await?;
            test.create(claim_sharers("holder", 1, "scratch", None)).await?;
            test.wait_phase("holder", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            let (_, node) = test.wait_pod_running("holder-workers-0").await?;
            // Three more of 16 CPUs fill the claim's node. They wait for a label of the
            // node's, so that one pass plans them all, each committed while the pass
            // plans the next.
            for i in 0..3 {
                let mut joiner = claim_sharers(&format!("joiner-{i}"), 1, "scratch", None);
                joiner["spec"]["podGroups"][0]["template"]["spec"]["nodeSelector"] = json!({OPEN_LABEL: "yes"});
                test.create(joiner).await?;
            }
            for i in 0..3 {
                test.wait_admitted_reason(&format!("joiner-{i}"), "Unschedulable", Duration::from_secs(60))
                    .await?;
            }
            let nodes: Api<Node> = Api::all(test.client.clone());
            let label = |value: Option<&str>| json!({"metadata": {"labels": {OPEN_LABEL: value}}});
            nodes
                .patch(&node, &PatchParams::default(), &Patch::Merge(&label(Some("yes"))))
                .await?;
            for i in 0..3 {
                test.wait_phase(&format!("joiner-{i}"), WorkloadPhase::Running, Duration::from_secs(60))
                    .await?;
            }
            let (_, metrics) = test.operator.as_ref().context("operator")?.get("/metrics").await?;
            ensure!(
                metrics.lines().any(|l| l == "muster_conflicts_total 0"),
                "no commit failed for a conflict: {}",
                metrics
                    .lines()
                    .filter(|l| l.starts_with("muster_conflicts") || l.contains("rollbacks_total"))
                    .collect::<Vec<_>>()
                    .join("; ")
            );
            nodes
                .patch(&node, &PatchParams::default(), &Patch::Merge(&label(None)))
                .await?;
            Ok(())
        })
    })
    .await
}

/// Second review of issue 22, finding 2: a released gang's waiting extras were placed in
/// its step, before the queue, so room that came free went to the extras of a gang of
/// lower priority before a waiting gang of higher priority was planned (and the other
/// way round, a lower preemptor could take room from a higher gang's extras: the cause
/// of `issue22_review_extras_plan_through_a_lower_nomination`'s flakes). Extras are now
/// placed in the queue at their gang's priority.
#[tokio::test]
async fn issue22_review_room_goes_to_a_higher_gang_before_lower_extras() -> Result<()> {
    with_test("extras-order", &[], &[], |test| {
        Box::pin(async move {
            rack_full_with_extras_and_a_higher_gang_waiting(test).await?;
            // One node comes free: it is the higher gang's.
            test.workloads().delete("blocker", &DeleteParams::default()).await?;
            test.wait_phase("high", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            extras_still_wait(test).await
        })
    })
    .await
}

/// The flake of `issue22_review_room_goes_to_a_higher_gang_before_lower_extras` on a slow
/// machine: the higher gang's commit onto the freed node did not go through (a conflict
/// with the cache), and it then backed off for as long as all its attempts so far added
/// up to (up to a minute: waiting for capacity counted as failing), while the lower
/// gang's extras, tried at every change, took the node. A failed commit now backs off
/// briefly and keeps the nodes it planned from gangs and extras of lower priority until
/// it tries again, also while the state machine undoes a commit whose plan was recorded
/// (the gang is out of the queue meanwhile). Here the commit fails once on purpose,
/// before its plan is recorded, then after.
#[tokio::test]
async fn a_failed_commit_keeps_its_room_from_lower_extras() -> Result<()> {
    for failure in ["plan-record", "claim-reservation"] {
        with_test(&format!("failed-{failure}"), &[], &[], |test| {
            Box::pin(async move {
                rack_full_with_extras_and_a_higher_gang_waiting(test).await?;
                // The same cluster under an operator whose next commit fails once,
                // committing one gang at a time.
                if let Some(operator) = test.operator.take() {
                    operator.stop();
                }
                test.start_operator(&["--commit-parallelism", "1"], &[("MUSTER_FAIL_WRITE", failure)])?;
                test.workloads().delete("blocker", &DeleteParams::default()).await?;
                test.wait_phase("high", WorkloadPhase::Running, Duration::from_secs(60))
                    .await?;
                let operator = test.operator.as_ref().context("operator")?;
                ensure!(
                    operator.log().contains(&format!("failing the write {failure} once")),
                    "the higher gang's commit failed once"
                );
                extras_still_wait(test).await
            })
        })
        .await
        .with_context(|| format!("a commit failing at {failure}"))?;
    }
    Ok(())
}

/// rack-0000's four nodes: two for the gang `filler`, one for `blocker`, one for the core
/// of `elastic`, whose two extras wait; `high`, of higher priority and not preempting,
/// waits for a node. All but `high` are of priority [`LOW`].
async fn rack_full_with_extras_and_a_higher_gang_waiting(test: &Test) -> Result<()> {
    priority_classes(&test.client).await?;
    test.create(ranked(gang("filler", 2, Some("rack-0000")), LOW)).await?;
    assert_runs_as_planned(test, "filler").await?;
    test.create(ranked(gang("blocker", 1, Some("rack-0000")), LOW)).await?;
    assert_runs_as_planned(test, "blocker").await?;
    let mut elastic = ranked(gang("elastic", 3, Some("rack-0000")), LOW);
    elastic["spec"]["podGroups"][1]["minCount"] = json!(1);
    test.create(elastic).await?;
    test.wait_phase("elastic", WorkloadPhase::Running, Duration::from_secs(60))
        .await?;
    test.create(ranked(gang("high", 1, Some("rack-0000")), NEVER)).await?;
    test.wait_admitted_reason("high", "Unschedulable", Duration::from_secs(60))
        .await?;
    Ok(())
}

/// Of `elastic` (see [`rack_full_with_extras_and_a_higher_gang_waiting`]), only its core
/// worker is placed.
async fn extras_still_wait(test: &Test) -> Result<()> {
    let placement = test
        .workloads()
        .get("elastic")
        .await?
        .status
        .and_then(|s| s.placement)
        .context("placement")?;
    ensure!(
        placement.pods.iter().filter(|p| p.name.contains("workers")).count() == 1,
        "the extras still wait: {:?}",
        placement.pods
    );
    Ok(())
}

/// The uids `reservedFor` of claim `name` lists, and whether it is allocated.
async fn listing_of(test: &Test, name: &str) -> Result<(bool, Vec<String>)> {
    let status = test.claims().get(name).await?.status.unwrap_or_default();
    let listed = status
        .reserved_for
        .unwrap_or_default()
        .into_iter()
        .map(|r| r.uid)
        .collect();
    Ok((status.allocation.is_some(), listed))
}

/// Waits until claim `name` no longer lists `uid` (kube-controller-manager took a pod that
/// is gone out of it).
async fn wait_unlisted(test: &Test, name: &str, uid: &str) -> Result<()> {
    wait::until(
        &format!("{name} to no longer list {uid}"),
        Duration::from_secs(60),
        || async {
            let (_, listed) = listing_of(test, name).await?;
            Ok((!listed.iter().any(|u| u == uid)).then_some(()))
        },
    )
    .await
}

/// The claim `scratch`, allocated by kube-scheduler for the pod `outsider` outside any
/// gang (and so protected: kube-controller-manager deallocates it with its last pod).
/// Returns the outsider's uid and node, and the allocation.
async fn found_by_kube_scheduler(test: &Test) -> Result<(String, String, serde_json::Value)> {
    test.claims()
        .create(&PostParams::default(), &user_claim("scratch", 1)?)
        .await?;
    test.pods()
        .create(&PostParams::default(), &outside_user("outsider", "scratch")?)
        .await?;
    let (uid, node) = test.wait_pod_running("outsider").await?;
    let claim = test.claims().get("scratch").await?;
    ensure!(
        claim
            .finalizers()
            .iter()
            .any(|f| f == labels::DELETE_PROTECTION_FINALIZER),
        "kube-scheduler protects a claim it allocates: {:?}",
        claim.metadata.finalizers
    );
    let held = allocation_of(test, "scratch").await?.context("scratch allocated")?;
    Ok((uid, node, held))
}

/// Issue 22, the model's seeds 304452 and 492994: a gang held a claim kube-scheduler had
/// allocated for a pod outside any gang, but was no entry in its `reservedFor` until
/// kube-scheduler bound the gang's pod. When the pod outside ended first,
/// kube-controller-manager deallocated the claim under the released gang, and
/// kube-scheduler would then allocate it itself, outside muster's plan. Now the gang's
/// hold lists its pods there. The gang's pod is kept from binding here (its node's CPUs
/// are taken) while the pod outside goes.
#[tokio::test]
async fn issue22_model_a_claim_found_allocated_stays_with_the_gang_when_its_last_outside_pod_ends() -> Result<()> {
    let go_on = std::env::temp_dir().join(format!("muster-issue22-found-{}", std::process::id()));
    let go_on_text = go_on.display().to_string();
    let _ = std::fs::remove_file(&go_on);
    let paused = [
        ("MUSTER_PAUSE_POINT", "after-reserved"),
        ("MUSTER_PAUSE_UNTIL", go_on_text.as_str()),
    ];
    let resume = go_on.clone();
    let outcome = with_test("found-outlives", &[], &paused, |test| {
        Box::pin(async move {
            let (outsider, node, held) = found_by_kube_scheduler(test).await?;
            test.create(claim_sharers("sharer", 1, "scratch", None)).await?;
            test.wait_paused("after-reserved").await?;
            let pod = test.pods().get("sharer-workers-0").await?;
            let gang_pod = pod.metadata.uid.clone().unwrap_or_default();
            let (_, listed) = listing_of(test, "scratch").await?;
            ensure!(
                listed.contains(&gang_pod) && listed.contains(&outsider),
                "the gang's hold lists its pod beside the outsider: {listed:?}"
            );
            // The node's CPUs are taken: the gang's pod is released but not bound.
            test.block_cpus("blocker", &node).await?;
            std::fs::write(&resume, b"")?;
            test.wait_unschedulable("sharer-workers-0").await?;

            // The last pod outside the gang ends.
            test.pods()
                .delete(
                    "outsider",
                    &DeleteParams {
                        grace_period_seconds: Some(0),
                        ..DeleteParams::default()
                    },
                )
                .await?;
            wait_unlisted(test, "scratch", &outsider).await?;
            wait::holds(
                "scratch to stay allocated for the gang",
                Duration::from_secs(3),
                || async { Ok(allocation_of(test, "scratch").await?.as_ref() == Some(&held)) },
            )
            .await?;
            runs_on_once_unblocked(test, "sharer", held).await
        })
    })
    .await;
    let _ = std::fs::remove_file(&go_on);
    outcome
}

/// Issue 22, the undo of that listing: a gang that lets go of a claim another allocator
/// made takes its pods still behind the gate out of `reservedFor` (nothing else would
/// while they exist), and deallocates it if that leaves a protected claim with no entry,
/// as kube-controller-manager would have done when the last pod outside ended. Here the
/// operator dies after the hold and before the release; the pod outside ends; the next
/// operator undoes the commit, and the gang's next commit allocates the claim afresh.
#[tokio::test]
async fn issue22_model_a_gang_letting_go_of_a_found_claim_takes_its_gated_pods_out() -> Result<()> {
    with_test(
        "found-undone",
        &[],
        &[("MUSTER_FAULT_POINT", "after-reserved")],
        |test| {
            Box::pin(async move {
                let (outsider, _, _) = found_by_kube_scheduler(test).await?;
                test.create(claim_sharers("sharer", 1, "scratch", None)).await?;
                let operator = test.operator.as_mut().context("operator")?;
                operator
                    .wait_aborted_at("after-reserved", Duration::from_secs(90))
                    .await?;
                test.operator = None;
                test.pods()
                    .delete(
                        "outsider",
                        &DeleteParams {
                            grace_period_seconds: Some(0),
                            ..DeleteParams::default()
                        },
                    )
                    .await?;
                wait_unlisted(test, "scratch", &outsider).await?;
                let gang_pod = test
                    .pods()
                    .get("sharer-workers-0")
                    .await?
                    .metadata
                    .uid
                    .unwrap_or_default();
                ensure!(
                    listing_of(test, "scratch").await? == (true, vec![gang_pod.clone()]),
                    "only the gang's gated pod keeps scratch allocated"
                );

                test.start_operator(&[], &[])?;
                test.wait_phase("sharer", WorkloadPhase::Running, Duration::from_secs(90))
                    .await?;
                let claim = test.claims().get("scratch").await?;
                ensure!(
                    claim.finalizers().iter().any(|f| f == labels::CLAIM_FINALIZER),
                    "the gang let go of kube-scheduler's allocation, and muster allocated scratch afresh: {:?}",
                    claim.metadata.finalizers
                );
                let (uid, _) = test.wait_pod_running("sharer-workers-0").await?;
                ensure!(
                    listing_of(test, "scratch").await? == (true, vec![uid]),
                    "scratch is allocated for the running pod alone"
                );
                Ok(())
            })
        },
    )
    .await
}

/// Issue 35: a user who takes the `muster.dev/workload` label off a claim muster
/// allocated hid it from its gang and from the collector (the gang's commits stopped on a
/// missing claim, and the devices stayed allocated for good once the gang went). muster
/// puts the label back while a journal names the claim, and gives the devices back once
/// the gang is gone, label or not.
#[tokio::test]
async fn a_claim_that_lost_its_workload_label_is_labelled_again_and_never_leaks_its_devices() -> Result<()> {
    with_test("stray-claim", &[], &[], |test| {
        Box::pin(async move {
            test.create(gang("kept", 2, None)).await?;
            assert_runs_as_planned(test, "kept").await?;
            let placement = test
                .workloads()
                .get("kept")
                .await?
                .status
                .and_then(|s| s.placement)
                .context("placement")?;
            let claim = placement.claims.first().cloned().context("a claim")?;
            let claims = test.claims();
            let unlabel = json!({"metadata": {"labels": {labels::WORKLOAD: null}}});
            claims
                .patch(&claim, &PatchParams::default(), &Patch::Merge(&unlabel))
                .await?;
            wait::until("the label to be put back", Duration::from_secs(30), || {
                let claims = claims.clone();
                let claim = claim.clone();
                async move {
                    let current = claims.get(&claim).await?;
                    Ok((current.labels().get(labels::WORKLOAD).map(String::as_str) == Some("kept")).then_some(()))
                }
            })
            .await?;
            test.wait_event("kept", "ClaimRelabelled", &claim).await?;
            ensure!(restarts(test, "kept").await? == 0, "the gang ran on, untouched");
            test.wait_phase("kept", WorkloadPhase::Running, Duration::from_secs(10))
                .await?;

            // Taken off again and the gang deleted while the operator is down, so that
            // the next one's caches never show the claim: the devices still come back.
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }
            claims
                .patch(&claim, &PatchParams::default(), &Patch::Merge(&unlabel))
                .await?;
            test.workloads().delete("kept", &DeleteParams::default()).await?;
            test.start_operator(&[], &[])?;
            wait::until("every device to be given back", Duration::from_secs(90), || {
                let claims = claims.clone();
                async move { Ok(allocations(&claims).await?.is_empty().then_some(())) }
            })
            .await?;
            wait::until("muster's finalizer to leave the claim", Duration::from_secs(60), || {
                let claims = claims.clone();
                let claim = claim.clone();
                async move {
                    let gone_or_free = claims
                        .get_opt(&claim)
                        .await?
                        .is_none_or(|c| !c.finalizers().iter().any(|f| f == labels::CLAIM_FINALIZER));
                    Ok(gone_or_free.then_some(()))
                }
            })
            .await?;
            Ok(())
        })
    })
    .await
}

/// Issue 35, item 1: kube-scheduler's Unreserve (after a failed bind) takes a released
/// pod out of a gang-wide claim muster allocated, and nothing listed it again: once the
/// other pods listed there ended, kube-controller-manager would deallocate the claim
/// under the pod still pending, and kube-scheduler allocate it itself, outside the plan.
/// muster lists a released, unbound pod again on its own claims too.
#[tokio::test]
async fn a_released_pod_unreserved_from_a_claim_muster_allocated_is_listed_again() -> Result<()> {
    let go_on = std::env::temp_dir().join(format!("muster-issue35-1-{}", std::process::id()));
    let (go_on_text, resume) = (go_on.display().to_string(), go_on.clone());
    let _ = std::fs::remove_file(&go_on);
    let outcome = with_test("unreserved", &[], &[], |test| {
        Box::pin(async move {
            test.create_claim_template("one-gpu", "gpu", 1).await?;
            restart_paused(test, "after-reserved", &go_on_text)?;
            // Two pods of 16 CPUs sharing one node-local device: both on one node.
            test.create(json!({
                "apiVersion": "muster.dev/v1alpha1",
                "kind": "Workload",
                "metadata": {"name": "wide"},
                "spec": {
                    "resourceClaims": [{"name": "fabric", "resourceClaimTemplateName": "one-gpu", "podGroups": ["workers"]}],
                    "podGroups": [{
                        "name": "workers",
                        "replicas": 2,
                        "template": {"spec": {"containers": [{
                            "name": "main", "image": "trainer",
                            "resources": {"requests": {"cpu": "16"}, "claims": [{"name": "fabric"}]},
                        }]}},
                    }],
                },
            }))
            .await?;
            test.wait_paused("after-reserved").await?;
            let placement = test
                .workloads()
                .get("wide")
                .await?
                .status
                .and_then(|s| s.placement)
                .context("placement")?;
            let node = placement.pods.first().context("a planned pod")?.node.clone();
            // The node's CPUs are taken meanwhile: the pods are released but not bound.
            test.block_cpus("blocker", &node).await?;
            std::fs::write(&resume, b"")?;
            test.wait_unschedulable("wide-workers-1").await?;

            let claims = test.claims();
            let uid_of = |pod: Pod| pod.metadata.uid.unwrap_or_default();
            let first = uid_of(test.pods().get("wide-workers-0").await?);
            let second = uid_of(test.pods().get("wide-workers-1").await?);
            let claim = claims.get("wide-fabric").await?;
            let (_, listed) = listing_of(test, "wide-fabric").await?;
            ensure!(
                listed.contains(&first) && listed.contains(&second),
                "both released pods listed: {listed:?}"
            );
            // What Unreserve does: the pod's entry goes.
            let kept: Vec<_> = claim
                .status
                .iter()
                .flat_map(|s| s.reserved_for.iter().flatten())
                .filter(|c| c.uid != second)
                .cloned()
                .collect();
            claims
                .patch_status(
                    "wide-fabric",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"status": {"reservedFor": kept}})),
                )
                .await?;
            wait::until("the pod to be listed again", Duration::from_secs(20), || async {
                Ok(listing_of(test, "wide-fabric").await?.1.contains(&second).then_some(()))
            })
            .await?;
            test.pods().delete("blocker", &DeleteParams::default()).await?;
            test.wait_phase("wide", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            ensure!(restarts(test, "wide").await? == 0, "never taken apart");
            Ok(())
        })
    })
    .await;
    let _ = std::fs::remove_file(&go_on);
    outcome
}
