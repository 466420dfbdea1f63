//! Jobs survive muster: a teardown of a gang whose pods a Job, a JobSet or a TrainJob
//! makes (preemption, a schedule timeout, a refusal, a suspend) suspends the job, whose
//! controller takes the pods away without counting a failure; once every device is given
//! back muster resumes it, its pods wait behind the gate, and the gang runs again when
//! room returns. Against the real Job controller (kube-controller-manager), JobSet and
//! Trainer.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, ListParams};
use muster_e2e::frameworks::*;
use muster_e2e::scenario::{HIGH, LOW, Test, assert_runs_as_planned, gang, priority_classes, ranked};
use muster_local_cluster::fleet::RACK_LABEL;
use muster_local_cluster::wait;
use serde_json::{Value, json};

const RACK: &str = "rack-0000";

/// The pod template settings that put a job's pods at LOW priority in [`RACK`].
fn low_in_rack() -> Value {
    json!({"priorityClassName": LOW, "nodeSelector": {RACK_LABEL: RACK}})
}

/// Waits until `name`'s Workload has `pods` pods that have not ended, every one behind
/// the gate and none being deleted: the job's controller made them again, and they hold
/// nothing.
async fn waits_behind_the_gate(test: &Test, name: &str, pods: usize) -> Result<Vec<Pod>> {
    let api = test.pods();
    wait::until(
        &format!("{pods} new pods of {name} behind the gate"),
        Duration::from_secs(90),
        || {
            let api = api.clone();
            let selector = format!("muster.dev/workload={name}");
            async move {
                let list: Vec<Pod> = api
                    .list(&ListParams::default().labels(&selector))
                    .await?
                    .items
                    .into_iter()
                    .filter(|p| p.metadata.deletion_timestamp.is_none())
                    // A pod that ended stays with its Job, holding nothing.
                    .filter(|p| {
                        !matches!(
                            p.status.as_ref().and_then(|s| s.phase.as_deref()),
                            Some("Succeeded" | "Failed")
                        )
                    })
                    .collect();
                let gated = list.iter().all(|p| {
                    p.spec
                        .as_ref()
                        .and_then(|s| s.scheduling_gates.as_ref())
                        .is_some_and(|g| g.iter().any(|g| g.name == muster_api::labels::GANG_GATE))
                });
                Ok((list.len() == pods && gated).then_some(list))
            }
        },
    )
    .await
}

/// A kind of job the tests requeue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Job,
    JobSet,
    TrainJob,
}

impl Kind {
    /// Creates job `name` of this kind, its pods at LOW priority in [`RACK`]; returns its
    /// Workload's name and how many pods its gang has.
    async fn create(self, test: &Test, name: &str) -> Result<(String, usize)> {
        match self {
            Kind::Job => {
                let job = indexed_job(
                    name,
                    4,
                    json!({"spec": {"backoffLimit": 2, "template": {"spec": low_in_rack()}}}),
                );
                create_job(test, job).await?;
                Ok((format!("job-{name}"), 4))
            }
            Kind::JobSet => {
                // No failurePolicy: a restart of its own would fail it (maxRestarts 0).
                let mut jobset = labelled_jobset(name, 4, json!({}));
                for replicated in jobset["spec"]["replicatedJobs"].as_array_mut().into_iter().flatten() {
                    merge(&mut replicated["template"]["spec"]["template"]["spec"], low_in_rack());
                }
                create(&jobsets(test), jobset).await?;
                Ok((format!("jobset-{name}"), 5))
            }
            Kind::TrainJob => {
                let runtime = torch_runtime_with(test, low_in_rack()).await?;
                create(&trainjobs(test), labelled_trainjob(name, &runtime, 4)).await?;
                Ok((format!("jobset-{name}"), 4))
            }
        }
    }

    fn api(self, test: &Test) -> Api<DynamicObject> {
        match self {
            Kind::Job => Api::namespaced_with(test.client.clone(), &test.ns, &resource("batch", "v1", "Job", "jobs")),
            Kind::JobSet => jobsets(test),
            Kind::TrainJob => trainjobs(test),
        }
    }

    /// The job failed nothing: no Failed (or FailureTarget) condition, a Job's
    /// `status.failed` 0, a JobSet's `status.restarts` 0 (a TrainJob's JobSet's too).
    async fn failed_nothing(self, test: &Test, name: &str) -> Result<()> {
        let object = self.api(test).get(name).await?;
        let failed_condition = object.data["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| (c["type"] == "Failed" || c["type"] == "FailureTarget") && c["status"] == "True");
        ensure!(!failed_condition, "{self:?} {name} failed: {}", object.data["status"]);
        match self {
            Kind::Job => {
                let failed = object.data["status"]["failed"].as_i64().unwrap_or(0);
                ensure!(failed == 0, "the Job counted {failed} failed pods");
            }
            Kind::JobSet | Kind::TrainJob => {
                let jobset = jobsets(test).get(name).await?;
                let restarts = jobset.data["status"]["restarts"].as_i64().unwrap_or(0);
                ensure!(restarts == 0, "the JobSet restarted {restarts} times");
                let failed = jobset.data["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Failed" && c["status"] == "True");
                ensure!(!failed, "the JobSet failed: {}", jobset.data["status"]);
            }
        }
        Ok(())
    }

    /// Waits until the job is not suspended (muster resumed it).
    async fn resumed(self, test: &Test, name: &str) -> Result<()> {
        let api = self.api(test);
        wait::until(
            &format!("{self:?} {name} to be resumed"),
            Duration::from_secs(60),
            || {
                let api = api.clone();
                async move {
                    let object = api.get(name).await?;
                    let marked = object.labels().contains_key(muster_api::labels::REQUEUED);
                    Ok((object.data["spec"]["suspend"] != true && !marked).then_some(()))
                }
            },
        )
        .await
    }
}

/// Issue 33: a running job whose gang a gang of higher priority preempts is suspended,
/// not killed: its pods go without a failure counted, every device is given back, the
/// job is resumed and its pods wait behind the gate, and once room returns it runs again
/// as one gang. (Before, a Job ended Failed with `failed=4`.)
async fn a_preempted_job_is_requeued_and_runs_again(kind: Kind) -> Result<()> {
    let name = format!("preempted-{}", format!("{kind:?}").to_lowercase());
    with_frameworks(&name.clone(), move |test| {
        Box::pin(async move {
            priority_classes(&test.client).await?;
            let (workload, pods) = kind.create(test, "victim").await?;
            runs_as_one_gang(test, &workload, pods).await?;
            let old: Vec<String> = test
                .gang_pods(&workload)
                .await?
                .iter()
                .filter_map(|p| p.metadata.uid.clone())
                .collect();

            test.create(ranked(gang("high", 4, Some(RACK)), HIGH)).await?;
            test.wait_admitted_reason(&workload, "Preempted", Duration::from_secs(60))
                .await?;
            // The job itself is suspended (a TrainJob, not the JobSet Trainer made for it).
            let suspended = format!("suspended {kind:?} victim");
            test.wait_event(&workload, "JobSuspended", &suspended).await?;
            assert_runs_as_planned(test, "high").await?;

            // The job was suspended and resumed again: its pods are new, behind the gate,
            // and nothing failed.
            let waiting = waits_behind_the_gate(test, &workload, pods).await?;
            ensure!(
                waiting
                    .iter()
                    .all(|p| p.metadata.uid.as_ref().is_some_and(|u| !old.contains(u))),
                "the job made its pods again"
            );
            kind.resumed(test, "victim").await?;
            test.wait_event(&workload, "JobResumed", &format!("resumed {kind:?} victim"))
                .await?;
            kind.failed_nothing(test, "victim").await?;

            // Room returns: the job runs again as one gang, still with nothing failed.
            test.workloads()
                .delete("high", &Default::default())
                .await
                .context("deleting the preemptor")?;
            runs_as_one_gang(test, &workload, pods).await?;
            kind.failed_nothing(test, "victim").await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_preempted_job_is_requeued_by_its_suspend_and_runs_again_with_nothing_failed() -> Result<()> {
    a_preempted_job_is_requeued_and_runs_again(Kind::Job).await
}

#[tokio::test]
async fn a_preempted_jobset_is_requeued_by_its_suspend_and_runs_again_without_a_restart() -> Result<()> {
    a_preempted_job_is_requeued_and_runs_again(Kind::JobSet).await
}

/// The TrainJob is what muster suspends: Trainer applies its JobSet again and would
/// undo a suspend of the JobSet's own.
#[tokio::test]
async fn a_preempted_trainjob_is_requeued_through_its_own_suspend_and_runs_again() -> Result<()> {
    a_preempted_job_is_requeued_and_runs_again(Kind::TrainJob).await
}

/// A released Job's pods that kube-scheduler cannot bind in time (another pod took a
/// planned node's CPUs between plan and bind): with `timeout`, the gang is taken apart
/// for the schedule timeout; without, for kube-scheduler's refusal. Either way the Job
/// is suspended and resumed, runs again elsewhere, and fails nothing.
async fn an_unbindable_job_is_requeued(name: &str, timeout: bool, reason: &'static str) -> Result<()> {
    let go_on = std::env::temp_dir().join(format!("muster-requeue-{name}-{}", std::process::id()));
    let go_on_text = go_on.display().to_string();
    let _ = std::fs::remove_file(&go_on);
    let paused = [
        ("MUSTER_PAUSE_POINT", "after-reserved"),
        ("MUSTER_PAUSE_UNTIL", go_on_text.as_str()),
    ];
    let args: &[&str] = if timeout { &["--schedule-timeout", "8"] } else { &[] };
    let outcome = with_frameworks_and(name, args, &paused, {
        let go_on = go_on.clone();
        move |test| {
            Box::pin(async move {
                create_job(test, indexed_job("late", 4, json!({"spec": {"backoffLimit": 2}}))).await?;
                test.wait_paused("after-reserved").await?;
                let workload = test.workloads().get("job-late").await?;
                let placement = workload.status.and_then(|s| s.placement).context("placement")?;
                let node = placement.pods.first().context("a planned pod")?.node.clone();
                test.block_cpus("hog", &node).await?;
                std::fs::write(&go_on, b"")?;

                test.wait_admitted_reason("job-late", reason, Duration::from_secs(90))
                    .await?;
                test.wait_event("job-late", "JobSuspended", "suspended Job late")
                    .await?;
                runs_as_one_gang(test, "job-late", 4).await?;
                Kind::Job.failed_nothing(test, "late").await?;
                test.pods().delete("hog", &Default::default()).await?;
                Ok(())
            })
        }
    })
    .await;
    let _ = std::fs::remove_file(&go_on);
    outcome
}

#[tokio::test]
async fn a_job_not_scheduled_in_time_is_requeued_by_its_suspend_with_nothing_failed() -> Result<()> {
    an_unbindable_job_is_requeued("job-timeout", true, "ScheduleTimeout").await
}

#[tokio::test]
async fn a_job_kube_scheduler_refuses_is_requeued_by_its_suspend_with_nothing_failed() -> Result<()> {
    an_unbindable_job_is_requeued("job-refused", false, "SchedulerRefused").await
}

/// Waits until the gang of Workload `name` holds no device.
async fn holds_nothing(test: &Test, name: &str) -> Result<()> {
    let claims = test.claims();
    let prefix = name.to_string();
    wait::until(&format!("{name} to hold nothing"), Duration::from_secs(60), || {
        let (claims, prefix) = (claims.clone(), prefix.clone());
        async move {
            let held = muster_e2e::scenario::allocations(&claims).await?;
            Ok(held.keys().all(|c| !c.starts_with(&prefix)).then_some(()))
        }
    })
    .await
}

async fn set_suspend(api: &Api<DynamicObject>, name: &str, suspend: bool) -> Result<()> {
    api.patch(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&json!({"spec": {"suspend": suspend}})),
    )
    .await?;
    Ok(())
}

/// A user who suspends a Job's gang (its Workload), or the Job itself, stops the Job
/// without a failure counted; resuming either runs the gang again.
#[tokio::test]
async fn a_user_suspend_of_the_gang_or_of_the_job_fails_nothing_and_a_resume_runs_it_again() -> Result<()> {
    with_frameworks("job-suspend", |test| {
        Box::pin(async move {
            create_job(test, indexed_job("paused", 4, json!({"spec": {"backoffLimit": 1}}))).await?;
            runs_as_one_gang(test, "job-paused", 4).await?;
            let workloads: Api<DynamicObject> = Api::namespaced_with(
                test.client.clone(),
                &test.ns,
                &resource("muster.dev", "v1alpha1", "Workload", "workloads"),
            );
            let jobs = Kind::Job.api(test);

            // The gang's Workload, suspended and resumed.
            set_suspend(&workloads, "job-paused", true).await?;
            test.wait_phase(
                "job-paused",
                muster_api::v1alpha1::WorkloadPhase::Suspended,
                Duration::from_secs(60),
            )
            .await?;
            holds_nothing(test, "job-paused").await?;
            let job = jobs.get("paused").await?;
            ensure!(
                job.data["spec"]["suspend"] == true,
                "the Job follows its gang's suspend"
            );
            Kind::Job.failed_nothing(test, "paused").await?;
            set_suspend(&workloads, "job-paused", false).await?;
            runs_as_one_gang(test, "job-paused", 4).await?;
            Kind::Job.failed_nothing(test, "paused").await?;

            // The Job itself, suspended and resumed.
            set_suspend(&jobs, "paused", true).await?;
            test.wait_phase(
                "job-paused",
                muster_api::v1alpha1::WorkloadPhase::Suspended,
                Duration::from_secs(60),
            )
            .await?;
            holds_nothing(test, "job-paused").await?;
            Kind::Job.failed_nothing(test, "paused").await?;
            set_suspend(&jobs, "paused", false).await?;
            runs_as_one_gang(test, "job-paused", 4).await?;
            Kind::Job.failed_nothing(test, "paused").await?;
            Ok(())
        })
    })
    .await
}

/// A Job whose pods were joined to a Workload by hand (no label on the Job) is requeued
/// the same way: its gang's teardown suspends the Job, not its pods.
#[tokio::test]
async fn a_job_joined_to_a_workload_by_hand_is_requeued_by_its_suspend() -> Result<()> {
    with_frameworks("job-joined", |test| {
        Box::pin(async move {
            priority_classes(&test.client).await?;
            let mut workload = ranked(muster_e2e::scenario::workload_of_joining_pods("joined", "main", 4), LOW);
            workload["spec"]["failurePolicy"] = json!({"restartedBy": "PodController"});
            test.create(workload).await?;
            let mut job = muster_e2e::scenario::job_joining("joined", "main", 4);
            merge(&mut job["spec"]["template"]["spec"], low_in_rack());
            create_job(test, job).await?;
            runs_as_one_gang(test, "joined", 4).await?;

            test.create(ranked(gang("high", 4, Some(RACK)), HIGH)).await?;
            test.wait_admitted_reason("joined", "Preempted", Duration::from_secs(60))
                .await?;
            test.wait_event("joined", "JobSuspended", "suspended Job joined")
                .await?;
            assert_runs_as_planned(test, "high").await?;
            waits_behind_the_gate(test, "joined", 4).await?;
            Kind::Job.resumed(test, "joined").await?;
            Kind::Job.failed_nothing(test, "joined").await?;
            test.workloads().delete("high", &Default::default()).await?;
            runs_as_one_gang(test, "joined", 4).await?;
            Kind::Job.failed_nothing(test, "joined").await?;
            Ok(())
        })
    })
    .await
}

fn start_operator(test: &mut Test, port: u16, fault: Option<&str>) -> Result<()> {
    start_operator_with(test, port, fault, &[])
}

fn start_operator_with(test: &mut Test, port: u16, fault: Option<&str>, extra: &[&str]) -> Result<()> {
    let mut args = operator_args(port);
    args.extend(extra.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let env: Vec<(&str, &str)> = fault.map(|f| ("MUSTER_FAULT_POINT", f)).into_iter().collect();
    test.start_operator(&args, &env)
}

/// The operator killed right after it suspended a preempted Job, and right after it
/// resumed it: the next operator finishes the requeue, and the Job runs again once room
/// returns, having failed nothing.
#[tokio::test]
async fn a_requeue_converges_when_the_operator_is_killed_after_any_of_its_writes() -> Result<()> {
    let port = webhook_port().await?;
    for fault in ["after-tearing-down-suspend", "after-tearing-down-resume"] {
        let name = format!("requeue-{fault}");
        with_frameworks_and(&name, &[], &[("MUSTER_FAULT_POINT", fault)], move |test| {
            Box::pin(async move {
                priority_classes(&test.client).await?;
                let (workload, pods) = Kind::Job.create(test, "victim").await?;
                runs_as_one_gang(test, &workload, pods).await?;
                test.create(ranked(gang("high", 4, Some(RACK)), HIGH)).await?;
                let operator = test.operator.as_mut().context("operator")?;
                operator.wait_aborted_at(fault, Duration::from_secs(90)).await?;
                test.operator = None;
                start_operator(test, port, None)?;
                wait_webhook_ready(test).await?;
                assert_runs_as_planned(test, "high").await?;
                waits_behind_the_gate(test, &workload, pods).await?;
                Kind::Job.resumed(test, "victim").await?;
                Kind::Job.failed_nothing(test, "victim").await?;
                test.workloads().delete("high", &Default::default()).await?;
                runs_as_one_gang(test, &workload, pods).await?;
                Kind::Job.failed_nothing(test, "victim").await
            })
        })
        .await
        .with_context(|| format!("killed {fault}"))?;
    }
    Ok(())
}

/// Issue 33: a Job's gang that lost a member whose replacement cannot be placed (its
/// node's CPUs taken meanwhile, the rest of the rack full) holds the other members'
/// devices, and the vacated place's, only for the schedule timeout from the recorded
/// vacancy, across an operator restart in the middle: then it is requeued whole through
/// the Job's suspend, and a gang of the same priority that only the held devices kept
/// out runs; the two run in turn.
#[tokio::test]
async fn a_gang_short_of_a_replacement_holds_its_devices_only_for_the_schedule_timeout() -> Result<()> {
    let timeout = 20;
    let port = webhook_port().await?;
    let args = ["--schedule-timeout", "20"];
    with_frameworks_and("vacancy-bound", &args, &[], move |test| {
        Box::pin(async move {
            let in_rack = json!({"nodeSelector": {RACK_LABEL: RACK}});
            let first = indexed_job("first", 4, json!({"spec": {"template": {"spec": in_rack.clone()}}}));
            create_job(test, first).await?;
            runs_as_one_gang(test, "job-first", 4).await?;

            // A pod of the first fails; its node's CPUs are taken before the Job replaces
            // it, so the replacement (16 CPUs) cannot go back there.
            let pods = test.gang_pods("job-first").await?;
            let failing = pods.first().context("a pod")?;
            let failing_name = failing.metadata.name.clone().unwrap_or_default();
            let node = failing
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .context("bound")?;
            test.exit_pod(&failing_name, 1).await?;
            test.block_cpus("hog", &node).await?;
            let workloads = test.workloads();
            let since = wait::until("the vacancy to be recorded", Duration::from_secs(60), || {
                let workloads = workloads.clone();
                async move {
                    let w = workloads.get("job-first").await?;
                    let vacancy = w
                        .status
                        .and_then(|s| s.placement)
                        .and_then(|p| p.vacancies.into_iter().next());
                    Ok(vacancy.map(|v| v.since.0))
                }
            })
            .await?;
            // A gang of the same priority that fits only on the vacated place's devices
            // (one pod of 1 CPU and eight GPUs): the hold keeps it out.
            let mut second = indexed_job("second", 1, json!({"spec": {"template": {"spec": in_rack}}}));
            second["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] = json!({"cpu": "1"});
            create_job(test, second).await?;
            let api = test.workloads();
            wait::holds(
                "the second to wait while the first holds the place",
                Duration::from_secs(8),
                || {
                    let api = api.clone();
                    async move {
                        let placed = api
                            .get_opt("job-second")
                            .await?
                            .and_then(|w| w.status)
                            .and_then(|s| s.placement)
                            .is_some();
                        Ok(!placed)
                    }
                },
            )
            .await?;

            // The operator restarts in the middle: the bound is the recorded one.
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }
            start_operator_with(test, port, None, &args)?;
            wait_webhook_ready(test).await?;

            test.wait_admitted_reason("job-first", "ReplacementTimeout", Duration::from_secs(90))
                .await?;
            let waited = k8s_openapi::jiff::Timestamp::now().duration_since(since);
            ensure!(
                waited.as_secs() <= timeout + 10,
                "the first held a partial reservation {}s after its vacancy (bound {timeout}s)",
                waited.as_secs()
            );
            // The second runs on what the first gave back; the first waits behind the gate.
            runs_as_one_gang(test, "job-second", 1).await?;
            waits_behind_the_gate(test, "job-first", 4).await?;
            let first = Kind::Job.api(test).get("first").await?;
            ensure!(
                first.data["status"]["failed"].as_i64().unwrap_or(0) <= 1,
                "only the pod that failed counts: {}",
                first.data["status"]
            );

            // In turn: once the second is gone and the node free, the first runs again.
            Kind::Job
                .api(test)
                .delete("second", &kube::api::DeleteParams::background())
                .await?;
            test.pods().delete("hog", &Default::default()).await?;
            runs_as_one_gang(test, "job-first", 4).await?;
            Ok(())
        })
    })
    .await
}

/// Issue 33: pods of a controller muster cannot suspend (a ReplicaSet's here) are
/// deleted by a teardown, with the `DisruptionTarget` condition first, as
/// kube-scheduler's preemption gives it: `PreemptionByMuster` when a gang of higher
/// priority takes their devices.
#[tokio::test]
async fn pods_of_a_controller_muster_cannot_suspend_are_marked_disrupted_before_they_go() -> Result<()> {
    with_frameworks("disrupted", |test| {
        Box::pin(async move {
            priority_classes(&test.client).await?;
            let mut workload = ranked(muster_e2e::scenario::workload_of_joining_pods("sts", "workers", 2), LOW);
            workload["spec"]["failurePolicy"] = json!({"restartedBy": "PodController"});
            test.create(workload).await?;
            let mut template = muster_e2e::scenario::job_joining("sts", "workers", 2)["spec"]["template"].clone();
            template["metadata"]["annotations"] = json!({"muster-e2e-terminate-after": "30s"});
            template["spec"]["restartPolicy"] = json!("Always");
            merge(&mut template["spec"], low_in_rack());
            let replicaset = json!({
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "metadata": {"name": "sts"},
                "spec": {
                    "replicas": 2,
                    "selector": {"matchLabels": {"muster.dev/workload": "sts"}},
                    "template": template,
                },
            });
            let replicasets: Api<DynamicObject> = Api::namespaced_with(
                test.client.clone(),
                &test.ns,
                &resource("apps", "v1", "ReplicaSet", "replicasets"),
            );
            create(&replicasets, replicaset).await?;
            test.wait_phase(
                "sts",
                muster_api::v1alpha1::WorkloadPhase::Running,
                Duration::from_secs(90),
            )
            .await?;

            test.create(ranked(gang("high", 4, Some(RACK)), HIGH)).await?;
            let pods = test.pods();
            let reasons = wait::until(
                "the ReplicaSet's pods to be marked and deleted",
                Duration::from_secs(60),
                || {
                    let pods = pods.clone();
                    async move {
                        let going: Vec<Pod> = pods
                            .list(&ListParams::default().labels("muster.dev/workload=sts"))
                            .await?
                            .items
                            .into_iter()
                            .filter(|p| p.metadata.deletion_timestamp.is_some())
                            .collect();
                        let reasons: Vec<String> = going
                            .iter()
                            .filter_map(|p| {
                                p.status
                                    .as_ref()?
                                    .conditions
                                    .as_ref()?
                                    .iter()
                                    .find(|c| c.type_ == "DisruptionTarget" && c.status == "True")
                                    .and_then(|c| c.reason.clone())
                            })
                            .collect();
                        Ok((going.len() == 2 && reasons.len() == 2).then_some(reasons))
                    }
                },
            )
            .await?;
            ensure!(
                reasons.iter().all(|r| r == "PreemptionByMuster"),
                "the condition's reason: {reasons:?}"
            );
            assert_runs_as_planned(test, "high").await?;
            replicasets
                .delete("sts", &kube::api::DeleteParams::background())
                .await?;
            Ok(())
        })
    })
    .await
}

/// Review of issue 33: a Job some of whose pods completed is requeued by a preemption
/// and runs again: its controller makes pods only for the indexes left, and the gang is
/// placed with the completed ones counted toward its minimum.
#[tokio::test]
async fn a_preempted_job_some_of_whose_pods_completed_runs_the_rest_again() -> Result<()> {
    with_frameworks("preempted-partly-done", |test| {
        Box::pin(async move {
            priority_classes(&test.client).await?;
            let (workload, pods) = Kind::Job.create(test, "victim").await?;
            runs_as_one_gang(test, &workload, pods).await?;
            let done = test
                .gang_pods(&workload)
                .await?
                .into_iter()
                .next()
                .and_then(|p| p.metadata.name)
                .context("a pod")?;
            test.exit_pod(&done, 0).await?;
            let api = test.pods();
            wait::until("a pod to complete", Duration::from_secs(30), || {
                let (api, done) = (api.clone(), done.clone());
                async move {
                    let pod = api.get(&done).await?;
                    Ok((pod.status.and_then(|s| s.phase).as_deref() == Some("Succeeded")).then_some(()))
                }
            })
            .await?;

            test.create(ranked(gang("high", 4, Some(RACK)), HIGH)).await?;
            test.wait_admitted_reason(&workload, "Preempted", Duration::from_secs(60))
                .await?;
            assert_runs_as_planned(test, "high").await?;
            waits_behind_the_gate(test, &workload, pods - 1).await?;
            Kind::Job.failed_nothing(test, "victim").await?;

            test.workloads().delete("high", &Default::default()).await?;
            runs_as_one_gang(test, &workload, pods - 1).await?;
            Kind::Job.failed_nothing(test, "victim").await?;
            Ok(())
        })
    })
    .await
}
