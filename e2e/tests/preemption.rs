//! Gang-aware priority preemption without Kueue: a queued gang of higher priority that
//! does not fit evicts whole gangs of lower priority, but only when it is proven to fit
//! then, and keeps the freed devices for itself across an operator crash. Every gang is
//! held to one rack by a node selector so that they contend.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::api::{Api, PostParams};
use muster_api::v1alpha1::{Workload, WorkloadPhase};
use muster_e2e::scenario::{HIGH, LOW, MID, NEVER, Test, allocations, assert_runs_as_planned, gang, with_test};
use muster_local_cluster::fleet::GPU_DRIVER;
use muster_local_cluster::namespaces::{delete_namespace, namespace};
use muster_local_cluster::wait;
use serde_json::{Value, json};

const RACK: &str = "rack-0000";

async fn priority_classes(test: &Test) -> Result<()> {
    muster_e2e::scenario::priority_classes(&test.client).await
}

/// A gang of `workers` eight-GPU workers in [`RACK`], of priority class `class`.
fn ranked(name: &str, workers: i32, class: &str) -> Value {
    muster_e2e::scenario::ranked(gang(name, workers, Some(RACK)), class)
}

/// The devices the gang's claims hold now.
async fn devices_of(test: &Test, name: &str) -> Result<BTreeSet<(String, String)>> {
    let prefix = format!("{name}-");
    Ok(allocations(&test.claims())
        .await?
        .into_iter()
        .filter(|(claim, _)| claim.starts_with(&prefix))
        .flat_map(|(_, devices)| devices)
        .collect())
}

async fn nomination_of(test: &Test, name: &str) -> Result<Option<Vec<String>>> {
    let workload = test.workloads().get(name).await?;
    Ok(workload.status.and_then(|s| s.nomination).map(|n| n.victims))
}

/// `name` stays queued and `running` keeps running for a while.
async fn keeps_waiting(test: &Test, name: &str, running: &[&str]) -> Result<()> {
    let api = test.workloads();
    wait::holds(
        &format!("{name} to keep waiting and {running:?} to keep running"),
        Duration::from_secs(6),
        || {
            let api = api.clone();
            async move {
                let waiting = api.get(name).await?;
                let queued = waiting.status.as_ref().is_some_and(|s| s.placement.is_none());
                let mut all_running = true;
                for other in running {
                    let w = api.get(other).await?;
                    all_running &= w.status.as_ref().and_then(|s| s.phase) == Some(WorkloadPhase::Running);
                }
                Ok(queued && all_running)
            }
        },
    )
    .await
}

#[tokio::test]
async fn a_gang_of_higher_priority_runs_on_the_devices_of_the_gang_it_preempts() -> Result<()> {
    with_test("preempt-runs", &[], &[], |test| {
        Box::pin(async move {
            priority_classes(test).await?;
            test.create(ranked("low", 4, LOW)).await?;
            assert_runs_as_planned(test, "low").await?;
            let freed = devices_of(test, "low").await?;
            ensure!(freed.len() == 32, "low holds {} devices", freed.len());

            test.create(ranked("high", 4, HIGH)).await?;
            let message = test
                .wait_admitted_reason("low", "Preempted", Duration::from_secs(60))
                .await?;
            ensure!(
                message.contains("high"),
                "the victim's condition names the preemptor: {message}"
            );
            test.wait_event("low", "Preempted", "high").await?;
            assert_runs_as_planned(test, "high").await?;
            let taken = devices_of(test, "high").await?;
            ensure!(taken == freed, "high runs on exactly low's devices");
            ensure!(
                nomination_of(test, "high").await?.is_none(),
                "the commit ends the nomination"
            );

            // The victim waits in the queue again, holding nothing.
            test.wait_phase("low", WorkloadPhase::Queued, Duration::from_secs(30))
                .await?;
            ensure!(devices_of(test, "low").await?.is_empty(), "the victim holds nothing");
            // Queued again, it says why (issue 22, defect 5): the rollback is counted
            // as a preemption, not as a schedule timeout.
            let (_, metrics) = test.operator.as_ref().context("operator")?.get("/metrics").await?;
            ensure!(
                metrics.contains(r#"muster_rollbacks_total{reason="Preempted"} 1"#)
                    && metrics.contains(r#"muster_rollbacks_total{reason="ScheduleTimeout"} 0"#),
                "the victim was queued again as preempted: {}",
                metrics
                    .lines()
                    .filter(|l| l.contains("rollbacks"))
                    .collect::<Vec<_>>()
                    .join("; ")
            );
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_gang_whose_class_never_preempts_waits() -> Result<()> {
    with_test("preempt-never", &[], &[], |test| {
        Box::pin(async move {
            priority_classes(test).await?;
            test.create(ranked("low", 4, LOW)).await?;
            assert_runs_as_planned(test, "low").await?;
            test.create(ranked("patient", 4, NEVER)).await?;
            test.wait_admitted_reason("patient", "Unschedulable", Duration::from_secs(30))
                .await?;
            keeps_waiting(test, "patient", &["low"]).await?;
            ensure!(nomination_of(test, "patient").await?.is_none(), "no nomination");
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_gang_that_would_not_fit_after_evicting_evicts_nothing() -> Result<()> {
    with_test("preempt-would-not-fit", &[], &[], |test| {
        Box::pin(async move {
            priority_classes(test).await?;
            // Half the rack is of lower priority, half of the preemptor's own.
            test.create(ranked("low", 2, LOW)).await?;
            assert_runs_as_planned(test, "low").await?;
            test.create(ranked("peer", 2, HIGH)).await?;
            assert_runs_as_planned(test, "peer").await?;
            // Three nodes' worth: evicting low frees only two.
            test.create(ranked("high", 3, HIGH)).await?;
            test.wait_admitted_reason("high", "Unschedulable", Duration::from_secs(30))
                .await?;
            keeps_waiting(test, "high", &["low", "peer"]).await?;
            ensure!(nomination_of(test, "high").await?.is_none(), "no nomination");
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_nomination_survives_a_crash_between_eviction_and_commit() -> Result<()> {
    let fault = "after-tearing-down-deallocate";
    with_test("preempt-crash", &[], &[], |test| {
        Box::pin(async move {
            priority_classes(test).await?;
            // A victim that may restart keeps the deallocation of its claims to muster
            // (the fault point is muster's deallocation; see docs/architecture.md).
            let mut low = ranked("low", 4, LOW);
            low["spec"]["failurePolicy"] = json!({"maxRestarts": 1});
            test.create(low).await?;
            assert_runs_as_planned(test, "low").await?;
            let freed = devices_of(test, "low").await?;
            // A small gang of low's priority that any freed node would take.
            test.create(ranked("third", 1, LOW)).await?;
            test.wait_admitted_reason("third", "Unschedulable", Duration::from_secs(30))
                .await?;

            // The same operator, now set to abort once the victim gave a claim back.
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }
            test.start_operator(&[], &[("MUSTER_FAULT_POINT", fault)])?;
            test.create(ranked("high", 4, HIGH)).await?;
            let operator = test.operator.as_mut().context("operator")?;
            operator.wait_aborted_at(fault, Duration::from_secs(90)).await?;
            test.operator = None;
            let victims = nomination_of(test, "high")
                .await?
                .context("high's nomination survives the crash")?;
            ensure!(victims == vec![format!("{}/low", test.ns)], "victims {victims:?}");

            test.start_operator(&[], &[])?;
            assert_runs_as_planned(test, "high").await?;
            ensure!(devices_of(test, "high").await? == freed, "high runs on low's devices");
            ensure!(
                devices_of(test, "third").await?.is_empty(),
                "third took no freed device"
            );
            ensure!(
                test.workloads()
                    .get("third")
                    .await?
                    .status
                    .is_some_and(|s| s.placement.is_none()),
                "third is still queued"
            );
            // Never admitted in between: had the hold failed, third would have taken a
            // freed device and been preempted by high in turn, and ended the same way.
            let events: kube::Api<k8s_openapi::api::core::v1::Event> =
                kube::Api::namespaced(test.client.clone(), &test.ns);
            let preempted_events = |name: &str| {
                let params =
                    kube::api::ListParams::default().fields(&format!("involvedObject.name={name},reason=Preempted"));
                let events = events.clone();
                async move { events.list(&params).await }
            };
            // The query finds the victim's event, so an empty answer for third means something.
            ensure!(
                !preempted_events("low").await?.items.is_empty(),
                "low's Preempted event"
            );
            let preempted = preempted_events("third").await?;
            ensure!(
                preempted.items.is_empty(),
                "third was admitted and preempted: {:?}",
                preempted.items.iter().map(|e| &e.message).collect::<Vec<_>>()
            );
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn the_nomination_is_recorded_before_any_victim_and_a_suspended_preemptor_evicts_nothing() -> Result<()> {
    let go_on = std::env::temp_dir().join(format!("muster-preempt-{}", std::process::id()));
    let go_on_text = go_on.display().to_string();
    let _ = std::fs::remove_file(&go_on);
    let resume = go_on.clone();
    let outcome = with_test("preempt-suspended", &[], &[], |test| {
        Box::pin(async move {
            priority_classes(test).await?;
            test.create(ranked("low", 4, LOW)).await?;
            assert_runs_as_planned(test, "low").await?;

            // The same operator, now held once a nomination is recorded.
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }
            test.start_operator(
                &[],
                &[
                    ("MUSTER_PAUSE_POINT", "after-nominated"),
                    ("MUSTER_PAUSE_UNTIL", go_on_text.as_str()),
                ],
            )?;
            test.create(ranked("high", 4, HIGH)).await?;
            let victims = wait::until("high's nomination", Duration::from_secs(60), || async {
                nomination_of(test, "high").await
            })
            .await?;
            ensure!(victims == vec![format!("{}/low", test.ns)], "victims {victims:?}");
            let low = test.workloads().get("low").await?;
            ensure!(
                low.status.and_then(|s| s.placement).and_then(|p| p.state)
                    == Some(muster_api::v1alpha1::AdmissionState::Released),
                "no victim is touched before the nomination is recorded"
            );

            test.workloads()
                .patch(
                    "high",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&json!({"spec": {"suspend": true}})),
                )
                .await?;
            std::fs::write(&resume, b"")?;
            wait::until("high's nomination to be dropped", Duration::from_secs(30), || async {
                Ok(nomination_of(test, "high").await?.is_none().then_some(()))
            })
            .await?;
            let api = test.workloads();
            wait::holds("low to keep running", Duration::from_secs(4), || {
                let api = api.clone();
                async move {
                    let w = api.get("low").await?;
                    Ok(w.status.and_then(|s| s.phase) == Some(WorkloadPhase::Running))
                }
            })
            .await?;
            Ok(())
        })
    })
    .await;
    let _ = std::fs::remove_file(&go_on);
    outcome
}

/// A preemptor whose commit fails at its first record (the write that ends its
/// nomination) keeps its nomination, commits at the next try, and no gang gives way to
/// a conflict with it meanwhile. (The exact interleaving of issue 22, defect 3 — a gang
/// planned in the same pass right after the failure — is pinned by the unit test
/// `a_failed_plan_record_holds_the_nomination_again`.)
#[tokio::test]
async fn a_preemptor_whose_commit_fails_once_keeps_its_nomination_and_runs() -> Result<()> {
    with_test("nomination-failed-commit", &[], &[], |test| {
        Box::pin(async move {
            priority_classes(test).await?;
            test.create(ranked("victim", 4, LOW)).await?;
            assert_runs_as_planned(test, "victim").await?;
            // Of lower priority still: it waits behind the victim, and preempts nothing.
            test.create(gang("bystander", 4, Some(RACK))).await?;
            test.wait_admitted_reason("bystander", "Unschedulable", Duration::from_secs(60))
                .await?;
            // The same operator, committing one gang at a time, whose next commit fails
            // at its first record.
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }
            test.start_operator(&["--commit-parallelism", "1"], &[("MUSTER_FAIL_WRITE", "plan-record")])?;
            test.create(ranked("preemptor", 4, HIGH)).await?;
            test.wait_phase("preemptor", WorkloadPhase::Running, Duration::from_secs(120))
                .await?;
            let operator = test.operator.as_ref().context("operator")?;
            ensure!(
                operator.log().contains("failing the write plan-record once"),
                "the commit failed once"
            );
            assert_runs_as_planned(test, "preemptor").await?;
            let events: kube::Api<k8s_openapi::api::events::v1::Event> =
                kube::Api::namespaced(test.client.clone(), &test.ns);
            let conflicts: Vec<String> = events
                .list(&kube::api::ListParams::default())
                .await?
                .items
                .into_iter()
                .filter_map(|e| e.note)
                .filter(|note| note.contains("allocated to another claim as well"))
                .collect();
            ensure!(conflicts.is_empty(), "no gang gave way to a conflict: {conflicts:?}");
            Ok(())
        })
    })
    .await
}

/// With `--preemption-scope=namespace`, a tenant's priority reaches only its own
/// namespace: a gang of the lowest priority in another namespace runs on, and the gang
/// of middle priority beside the preemptor is evicted instead (the whole cluster in
/// reach, the lowest would have been).
#[tokio::test]
async fn a_namespace_scoped_preemptor_evicts_only_in_its_own_namespace() -> Result<()> {
    with_test("preempt-scope", &["--preemption-scope=namespace"], &[], |test| {
        Box::pin(async move {
            priority_classes(test).await?;
            let other = namespace(&test.client, "preempt-scope-b").await?;
            let templates: Api<ResourceClaimTemplate> = Api::namespaced(test.client.clone(), &other);
            templates
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "metadata": {"name": "eight-gpus"},
                        "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": GPU_DRIVER, "count": 8}}]}}},
                    }))?,
                )
                .await?;
            let elsewhere: Api<Workload> = Api::namespaced(test.client.clone(), &other);
            let phase_elsewhere = || async {
                Ok::<_, anyhow::Error>(elsewhere.get("lowest").await?.status.and_then(|s| s.phase))
            };
            elsewhere
                .create(&PostParams::default(), &serde_json::from_value(ranked("lowest", 2, LOW))?)
                .await?;
            test.create(ranked("beside", 2, MID)).await?;
            test.wait_phase("beside", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            wait::until("the other tenant's gang to run", Duration::from_secs(60), || async {
                Ok((phase_elsewhere().await? == Some(WorkloadPhase::Running)).then_some(()))
            })
            .await?;

            test.create(ranked("urgent", 2, HIGH)).await?;
            test.wait_admitted_reason("beside", "Preempted", Duration::from_secs(60))
                .await?;
            assert_runs_as_planned(test, "urgent").await?;
            ensure!(
                phase_elsewhere().await? == Some(WorkloadPhase::Running),
                "the other tenant's gang runs on"
            );
            delete_namespace(&test.client, &other).await?;
            Ok(())
        })
    })
    .await
}

/// A tenant names a class for its gang that its pods were not admitted with: pods of its
/// own Job at default priority joined to a Workload of the highest class. The gang is
/// held, naming the field, and preempts no one; given the class by its pods, it runs.
#[tokio::test]
async fn a_gang_is_worth_no_more_than_its_pods() -> Result<()> {
    use k8s_openapi::api::batch::v1::Job;
    use muster_api::conditions;
    use muster_e2e::scenario::{job_joining, workload_of_joining_pods};
    with_test("priority-bound", &[], &[], |test| {
        Box::pin(async move {
            priority_classes(test).await?;
            test.create(ranked("incumbent", 4, LOW)).await?;
            assert_runs_as_planned(test, "incumbent").await?;

            // Two pods of eight GPUs each, in the rack the incumbent fills; default priority.
            test.create(muster_e2e::scenario::ranked(
                workload_of_joining_pods("jumper", "workers", 2),
                HIGH,
            ))
            .await?;
            let mut job = job_joining("jumper", "workers", 2);
            job["spec"]["template"]["spec"]["nodeSelector"] = json!({muster_local_cluster::fleet::RACK_LABEL: RACK});
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            jobs.create(&PostParams::default(), &serde_json::from_value(job.clone())?)
                .await?;
            let message = test
                .wait_admitted_reason(
                    "jumper",
                    conditions::REASON_PRIORITY_ABOVE_PODS,
                    Duration::from_secs(60),
                )
                .await?;
            ensure!(
                message.contains("spec.priorityClassName") && message.contains(HIGH),
                "the hold names the field and the class: {message}"
            );
            keeps_waiting(test, "jumper", &["incumbent"]).await?;
            ensure!(
                nomination_of(test, "jumper").await?.is_none(),
                "the held gang nominates no victims"
            );

            // Its pods admitted with the class: now it preempts as its class allows.
            jobs.delete("jumper", &kube::api::DeleteParams::foreground()).await?;
            wait::until("the Job's pods to go", Duration::from_secs(60), || async {
                let pods = test
                    .pods()
                    .list(&kube::api::ListParams::default().labels("muster.dev/workload=jumper"))
                    .await?;
                Ok(pods.items.is_empty().then_some(()))
            })
            .await?;
            job["spec"]["template"]["spec"]["priorityClassName"] = json!(HIGH);
            jobs.create(&PostParams::default(), &serde_json::from_value(job)?)
                .await?;
            test.wait_admitted_reason("incumbent", "Preempted", Duration::from_secs(60))
                .await?;
            test.wait_phase("jumper", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            Ok(())
        })
    })
    .await
}
