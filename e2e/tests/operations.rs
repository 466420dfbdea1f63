//! Running muster as a platform team would: metrics and probes, two replicas with leader
//! election and a leader killed mid-stream, and the Helm chart's RBAC as the only
//! permissions the operator has — enough for everything it does, and nothing it never
//! uses.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use muster_api::conditions;
use muster_api::v1alpha1::{AdmissionState, WorkloadPhase};
use muster_e2e::frameworks::{chart_operator_args, wait_webhook_ready, webhook_port};
use muster_e2e::rbac::{self, metrics};
use muster_e2e::scenario::{Test, assert_runs_as_planned, gang, with_test};
use muster_local_cluster::operator::Operator;
use muster_local_cluster::wait;
use serde_json::json;

async fn is_leader(operator: &Operator) -> bool {
    metrics(operator)
        .await
        .is_ok_and(|m| m.get("muster_leader") == Some(&1.0))
}

#[tokio::test]
async fn metrics_and_probes_describe_the_running_operator() -> Result<()> {
    with_test("metrics", &[], &[], |test| {
        Box::pin(async move {
            test.create(gang("observed", 1, None)).await?;
            assert_runs_as_planned(test, "observed").await?;
            let operator = test.operator.as_ref().context("operator")?;
            for probe in ["/healthz", "/readyz"] {
                let (status, _) = operator.get(probe).await?;
                ensure!(status == 200, "{probe} answered {status}");
            }
            let (status, _) = operator.get("/nothing-here").await?;
            ensure!(status == 404, "unknown paths are 404, got {status}");
            // The phase gauge follows the status a moment later.
            let seen = wait::until(
                "the phase gauge to count the gang Running",
                Duration::from_secs(10),
                || async {
                    let seen = metrics(operator).await?;
                    Ok((seen.get("muster_workloads{phase=\"Running\"}") == Some(&1.0)).then_some(seen))
                },
            )
            .await?;
            for (sample, at_least) in [
                ("muster_workloads{phase=\"Running\"}", 1.0),
                ("muster_reservations_total", 1.0),
                ("muster_reserved_devices_total", 8.0),
                ("muster_plan_duration_seconds_count{outcome=\"placed\"}", 1.0),
                ("muster_commit_duration_seconds_count{outcome=\"committed\"}", 1.0),
                // The gang names no PriorityClass.
                ("muster_submit_to_admitted_seconds_count{priority_class=\"\"}", 1.0),
                ("muster_submit_to_running_seconds_count{priority_class=\"\"}", 1.0),
                ("muster_leader", 1.0),
                ("muster_api_requests_total{verb=\"create\",resource=\"pods\"}", 2.0),
            ] {
                let value = seen.get(sample).copied().unwrap_or_default();
                ensure!(value >= at_least, "{sample} is {value}, expected at least {at_least}");
            }
            ensure!(
                seen.keys().all(|k| k.starts_with("muster_")),
                "every metric is prefixed muster_"
            );
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_follower_takes_over_when_the_leader_is_killed_and_nothing_is_admitted_twice() -> Result<()> {
    // The Lease lives in the test's namespace; four seconds keep the takeover short.
    let lease_args = |ns: &str| {
        vec![
            "--leader-elect".to_string(),
            format!("--leader-election-namespace={ns}"),
            "--leader-election-lease-duration=4".to_string(),
        ]
    };
    with_test("failover", &[], &[], move |test| {
        Box::pin(async move {
            let args = lease_args(&test.ns);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            // The first operator leads, and holds its first commit half done (claims
            // written, nothing released) until it is killed.
            let never = test.cluster.control_plane.run_dir().join(format!("{}-never", test.ns));
            let never = never.display().to_string();
            let paused = [
                ("MUSTER_PAUSE_POINT", "after-all-claims"),
                ("MUSTER_PAUSE_UNTIL", never.as_str()),
            ];
            test.operator.take().context("operator")?.stop();
            let first = test.spawn_operator(test.cluster.control_plane.kubeconfig(), &args, &paused)?;
            wait::until("the first operator to lead", Duration::from_secs(60), || {
                let first = &first;
                async move { Ok(is_leader(first).await.then_some(())) }
            })
            .await?;
            let second = test.spawn_operator(test.cluster.control_plane.kubeconfig(), &args, &[])?;
            wait::until("the second operator to be ready", Duration::from_secs(60), || {
                let second = &second;
                async move { Ok((second.get("/readyz").await.ok().map(|(code, _)| code) == Some(200)).then_some(())) }
            })
            .await?;
            ensure!(!is_leader(&second).await, "the second operator follows");
            let lease: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(test.client.clone(), &test.ns);
            let holder = lease.get("muster").await?.spec.and_then(|s| s.holder_identity);
            ensure!(holder.is_some(), "the Lease names its holder");

            // Gangs arrive; the leader dies in the middle of committing the first.
            test.create(gang("g0", 1, None)).await?;
            let workloads = test.workloads();
            wait::until("g0's claims to be written", Duration::from_secs(60), || {
                let (workloads, first) = (workloads.clone(), &first);
                async move {
                    let reserving = workloads
                        .get("g0")
                        .await?
                        .status
                        .and_then(|s| s.placement)
                        .is_some_and(|p| p.state == Some(AdmissionState::Reserving));
                    let paused = first.log().contains("pause point after-all-claims reached");
                    Ok((reserving && paused).then_some(()))
                }
            })
            .await?;
            for name in ["g1", "g2"] {
                test.create(gang(name, 1, None)).await?;
            }
            first.kill();
            let killed = std::time::Instant::now();
            wait::until("the follower to lead", Duration::from_secs(30), || {
                let second = &second;
                async move { Ok(is_leader(second).await.then_some(())) }
            })
            .await?;
            let takeover = killed.elapsed();
            println!(
                "the follower led {:.1} s after the leader was killed (lease 4 s)",
                takeover.as_secs_f64()
            );
            ensure!(
                takeover < Duration::from_secs(12),
                "takeover took {takeover:?}, three lease durations"
            );
            for name in ["g3", "g4"] {
                test.create(gang(name, 1, None)).await?;
            }
            test.operator = Some(second);
            for name in ["g0", "g1", "g2", "g3", "g4"] {
                assert_runs_as_planned(test, name).await?;
            }

            // Each gang was admitted at most once: one Admitted event, no restart.
            let events: Api<Event> = Api::namespaced(test.client.clone(), &test.ns);
            let events = events.list(&ListParams::default()).await?.items;
            for name in ["g0", "g1", "g2", "g3", "g4"] {
                let admitted = events
                    .iter()
                    .filter(|e| e.reason.as_deref() == Some(conditions::EVENT_ADMITTED))
                    .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
                    .count();
                ensure!(admitted <= 1, "{name} was admitted {admitted} times");
                let workload = test.workloads().get(name).await?;
                ensure!(
                    workload.status.is_some_and(|s| s.restarts == 0),
                    "{name} never restarted"
                );
            }
            Ok(())
        })
    })
    .await
}

/// Defect 3: a leader stalled (SIGSTOP) in the middle of a commit for longer than its
/// Lease, while a follower takes over, must not write once it runs again: it stops at
/// its next write, and nothing is allocated twice or leaked.
#[tokio::test]
async fn a_stalled_leader_writes_nothing_after_a_follower_took_over() -> Result<()> {
    with_test("stalled-leader", &[], &[], |test| {
        Box::pin(async move {
            let args = [
                "--leader-elect".to_string(),
                format!("--leader-election-namespace={}", test.ns),
                "--leader-election-lease-duration=4".to_string(),
            ];
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            // The leader holds its first commit right after recording the plan.
            let go_on = test.cluster.control_plane.run_dir().join(format!("{}-go-on", test.ns));
            let go_on_text = go_on.display().to_string();
            let paused = [
                ("MUSTER_PAUSE_POINT", "after-plan-recorded"),
                ("MUSTER_PAUSE_UNTIL", go_on_text.as_str()),
            ];
            test.operator.take().context("operator")?.stop();
            let mut first = test.spawn_operator(test.cluster.control_plane.kubeconfig(), &args, &paused)?;
            wait::until("the first operator to lead", Duration::from_secs(60), || {
                let first = &first;
                async move { Ok(is_leader(first).await.then_some(())) }
            })
            .await?;
            let second = test.spawn_operator(test.cluster.control_plane.kubeconfig(), &args, &[])?;
            test.create(gang("g0", 1, None)).await?;
            wait::until("the leader to pause in g0's commit", Duration::from_secs(60), || {
                let first = &first;
                async move {
                    Ok(first
                        .log()
                        .contains("pause point after-plan-recorded reached")
                        .then_some(()))
                }
            })
            .await?;

            // The leader stalls; the follower takes over and admits g0 and g1 itself.
            first.freeze()?;
            test.create(gang("g1", 1, None)).await?;
            wait::until("the follower to lead", Duration::from_secs(30), || {
                let second = &second;
                async move { Ok(is_leader(second).await.then_some(())) }
            })
            .await?;
            let held: &Test = test;
            for name in ["g0", "g1"] {
                held.wait_phase(name, WorkloadPhase::Running, Duration::from_secs(90))
                    .await?;
            }

            // The old leader runs again, and would go on with its commit.
            std::fs::write(&go_on, b"")?;
            first.resume()?;
            wait::until("the stalled leader to stop", Duration::from_secs(30), || {
                let exited = first.check_running().is_err();
                async move { Ok(exited.then_some(())) }
            })
            .await?;
            let log = first.log();
            ensure!(
                log.contains("may have passed to another replica") || log.contains("lost the leader Lease"),
                "the stalled leader stopped because it no longer led; the end of its log:\n{}",
                log.lines()
                    .rev()
                    .take(30)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            // It went no further with its commit: writing it would have met the
            // follower's allocations.
            ensure!(
                !log.contains("reserving failed"),
                "the stalled leader wrote after it had lost the Lease"
            );
            test.operator = Some(second);
            // The gangs run as planned on the devices they hold.
            for name in ["g0", "g1"] {
                assert_runs_as_planned(test, name).await?;
            }
            Ok(())
        })
    })
    .await
}

/// Permissions a gang's ordinary life does not request: checked by the API server while
/// handling another request, or used on paths of conflicts and cold caches.
const NOT_IN_AN_ORDINARY_LIFE: &[(&str, &str, &str)] = &[
    (
        "get",
        "pods",
        "releasing a pod the cache does not hold yet, or after a write conflict",
    ),
    ("get", "services", "telling whose a Service is after a create conflict"),
    (
        "update",
        "workloads/finalizers.muster.dev",
        "checked by the API server, not requested: setting blockOwnerDeletion on owned pods and claims under OwnerReferencesPermissionEnforcement (on in the test control plane)",
    ),
    (
        "update",
        "resourceclaims/binding.resource.k8s.io",
        "writing status.allocation and reservedFor on 1.36+ (a synthetic subresource)",
    ),
    (
        "patch",
        "resourceclaims/binding.resource.k8s.io",
        "writing status.allocation and reservedFor on 1.36+ (a synthetic subresource)",
    ),
    (
        "update",
        "secrets",
        "renewing the webhook's certificate (a year from now by default)",
    ),
    (
        "patch",
        "jobsets.jobset.x-k8s.io",
        "following a user's suspend of a JobSet's gang (this life suspends a Job's)",
    ),
    (
        "patch",
        "trainjobs.trainer.kubeflow.org",
        "requeueing a TrainJob's gang by its suspend (this life suspends a Job)",
    ),
    (
        "get",
        "trainjobs.trainer.kubeflow.org",
        "reading a TrainJob before its suspend, or its mark after a restart (this life suspends a Job)",
    ),
    (
        "get",
        "jobsets.jobset.x-k8s.io",
        "reading a JobSet before its suspend (this life suspends a Job)",
    ),
    (
        "get",
        "jobs.batch",
        "reading a Job just before muster suspends it to requeue its gang (this life's Job is suspended by its Workload's suspend, whose job follows it, often before muster's own step)",
    ),
    (
        "patch",
        "pods/status",
        "the DisruptionTarget condition on a pod of a controller muster cannot suspend, before its teardown deletes it",
    ),
];

#[tokio::test]
async fn the_chart_rbac_is_enough_for_a_gang_s_whole_life_and_grants_nothing_unused() -> Result<()> {
    let port = webhook_port().await?;
    with_test("rbac", &[], &[], move |test| {
        Box::pin(async move {
            // The chart's ServiceAccount and roles, released into a namespace of its own.
            let release_ns = muster_local_cluster::namespaces::namespace(&test.client, "muster-system").await?;
            // The chart's defaults: its webhook runs, and labelled jobs become gangs.
            let (objects, kubeconfig) = rbac::chart_account(test, &release_ns, &[("crds.install", "false")]).await?;

            // The operator with only those permissions, as the chart runs it.
            if let Some(admin) = test.operator.take() {
                admin.stop();
            }
            // A short Lease, so that it is renewed within the test.
            let lease_ns = format!("--leader-election-namespace={release_ns}");
            let mut args: Vec<String> = vec!["--leader-elect".into(), lease_ns, "--leader-election-lease-duration=2".into()];
            args.extend(chart_operator_args(port, &release_ns));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let operator = test.spawn_operator(&kubeconfig, &args, &[])?;
            test.operator = Some(operator);
            wait_webhook_ready(test).await?;

            // A labelled Job's life: its gang made, made again after an edit before it
            // is admitted, run, suspended through its Workload (which suspends the Job),
            // resumed, deleted.
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            let mut job = muster_e2e::scenario::job_joining("labelled", "main", 1);
            job["metadata"] = json!({"name": "labelled", "labels": {"muster.dev/gang": "true"}});
            job["spec"]["suspend"] = json!(true);
            job["spec"]["template"]["spec"].as_object_mut().map(|s| s.remove("schedulingGates"));
            jobs.create(&PostParams::default(), &serde_json::from_value(job)?).await?;
            let workloads = test.workloads();
            let first = wait::until("the Job's gang", Duration::from_secs(30), || {
                let workloads = workloads.clone();
                async move { Ok(workloads.get_opt("job-labelled").await?.and_then(|w| w.metadata.uid)) }
            })
            .await?;
            let edit = json!({"metadata": {"annotations": {"muster.dev/required-topology": muster_local_cluster::fleet::RACK_LABEL}}});
            jobs.patch("labelled", &PatchParams::default(), &Patch::Merge(&edit)).await?;
            wait::until("the Job's gang to be made again", Duration::from_secs(30), || {
                let (workloads, first) = (workloads.clone(), first.clone());
                async move {
                    let uid = workloads.get_opt("job-labelled").await?.and_then(|w| w.metadata.uid);
                    Ok(uid.filter(|u| *u != first).map(|_| ()))
                }
            })
            .await?;
            let suspend = |on: bool| json!({"spec": {"suspend": on}});
            jobs.patch("labelled", &PatchParams::default(), &Patch::Merge(&suspend(false)))
                .await?;
            test.wait_phase("job-labelled", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            workloads
                .patch("job-labelled", &PatchParams::default(), &Patch::Merge(&suspend(true)))
                .await?;
            wait::until("the Job to follow its gang's suspend", Duration::from_secs(30), || {
                let jobs = jobs.clone();
                async move {
                    let job = jobs.get("labelled").await?;
                    Ok((job.spec.and_then(|s| s.suspend) == Some(true)).then_some(()))
                }
            })
            .await?;
            workloads
                .patch("job-labelled", &PatchParams::default(), &Patch::Merge(&suspend(false)))
                .await?;
            test.wait_phase("job-labelled", WorkloadPhase::Running, Duration::from_secs(60))
                .await?;
            jobs.delete("labelled", &kube::api::DeleteParams::background()).await?;

            // A gang's whole life: admitted, a pod fails and the gang restarts on its
            // reservation, suspended, resumed, deleted.
            let mut workload = gang("lifelong", 2, None);
            workload["spec"]["failurePolicy"] = json!({"maxRestarts": 1});
            test.create(workload).await?;
            assert_runs_as_planned(test, "lifelong").await?;
            let exit = json!({"metadata": {"annotations": {"muster-e2e-exit": "1"}}});
            test.pods()
                .patch("lifelong-workers-0", &PatchParams::default(), &Patch::Merge(&exit))
                .await?;
            let workloads = test.workloads();
            wait::until("the gang to restart", Duration::from_secs(60), || {
                let workloads = workloads.clone();
                async move {
                    let w = workloads.get("lifelong").await?;
                    Ok(w.status.is_some_and(|s| s.restarts == 1).then_some(()))
                }
            })
            .await?;
            assert_runs_as_planned(test, "lifelong").await?;
            let suspend = |on: bool| json!({"spec": {"suspend": on}});
            workloads
                .patch("lifelong", &PatchParams::default(), &Patch::Merge(&suspend(true)))
                .await?;
            test.wait_phase("lifelong", WorkloadPhase::Suspended, Duration::from_secs(60))
                .await?;
            workloads
                .patch("lifelong", &PatchParams::default(), &Patch::Merge(&suspend(false)))
                .await?;
            assert_runs_as_planned(test, "lifelong").await?;
            workloads.delete("lifelong", &Default::default()).await?;
            test.wait_claims_gone().await?;
            let operator = test.operator.as_ref().context("operator")?;
            let log = operator.log();
            ensure!(!log.contains("forbidden"), "no request was forbidden:\n{log}");

            // Every granted permission was used, or is only ever checked.
            let used = rbac::used(operator).await?;
            let rules = rbac::operator_rules(&objects);
            let unused: Vec<String> = rbac::granted(&rules)
                .into_iter()
                .filter(|p| !used.contains(p))
                .filter(|(verb, resource)| {
                    !NOT_IN_AN_ORDINARY_LIFE
                        .iter()
                        .any(|(v, r, _)| v == verb && r == resource)
                })
                .map(|(verb, resource)| format!("{verb} {resource}"))
                .collect();
            muster_local_cluster::namespaces::delete_namespace(&test.client, &release_ns).await?;
            ensure!(
                unused.is_empty(),
                "the chart grants permissions the operator never used: {unused:?}; it used {used:?}"
            );
            Ok(())
        })
    })
    .await
}

/// Issue 33: `helm uninstall` loses nothing. The chart's pre-delete hook (its command and
/// its own ServiceAccount and roles, as rendered) runs `muster uninstall` with muster
/// stopped: the running gang keeps its devices, handed over to kube-controller-manager
/// (which gives them back when its pods end), a gang waiting behind the gate holds
/// nothing and stays behind it (named in the report), no Workload or claim keeps a
/// finalizer of muster's, and the namespace then goes without muster.
#[tokio::test]
async fn uninstalling_gives_every_device_back_in_time_and_leaves_nothing_waiting_for_muster() -> Result<()> {
    with_test("uninstall", &[], &[], |test| {
        Box::pin(async move {
            let release_ns = muster_local_cluster::namespaces::namespace(&test.client, "muster-system").await?;
            let (objects, _) = rbac::chart_account(test, &release_ns, &[("crds.install", "false")]).await?;
            let hook = muster_e2e::chart::of_kind(&objects, "Job")
                .into_iter()
                .find(|j| j["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete")
                .context("the chart's pre-delete hook")?
                .clone();
            let container = &hook["spec"]["template"]["spec"]["containers"][0];
            ensure!(container["command"] == json!(["/muster"]), "{container}");
            let args: Vec<String> = container["args"]
                .as_array()
                .context("args")?
                .iter()
                .filter_map(|a| a.as_str().map(str::to_string))
                .collect();
            ensure!(args.first().map(String::as_str) == Some("uninstall"), "{args:?}");
            let account = hook["spec"]["template"]["spec"]["serviceAccountName"]
                .as_str()
                .context("the hook's ServiceAccount")?;
            let kubeconfig = rbac::service_account_kubeconfig(test, &release_ns, account).await?;

            // A running gang, and one that waits behind the gate (it does not fit).
            test.create(gang("running", 2, None)).await?;
            assert_runs_as_planned(test, "running").await?;
            test.create(gang("waiting", 16, None)).await?;
            test.wait_admitted_reason("waiting", conditions::REASON_UNSCHEDULABLE, Duration::from_secs(60))
                .await?;

            // muster stops (the hook scales its Deployment to none; here it is a
            // process), then the hook runs as the chart renders it.
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }
            let binary = muster_local_cluster::operator::muster_binary()?;
            let output = tokio::process::Command::new(&binary)
                .args(&args)
                .arg(format!("--kubeconfig={}", kubeconfig.display()))
                .output()
                .await?;
            let report = String::from_utf8_lossy(&output.stdout).to_string();
            ensure!(
                output.status.success(),
                "muster uninstall failed: {report}{}",
                String::from_utf8_lossy(&output.stderr)
            );
            ensure!(
                report.contains("behind the scheduling gate") && report.contains("waiting-workers-0"),
                "the report names the pods left behind the gate: {report}"
            );

            // Nothing keeps a finalizer of muster's; the running gang keeps its devices,
            // each claim protected so that kube-controller-manager gives it back.
            for workload in test.workloads().list(&ListParams::default()).await?.items {
                ensure!(
                    !workload
                        .metadata
                        .finalizers
                        .unwrap_or_default()
                        .iter()
                        .any(|f| f.starts_with("muster.dev/")),
                    "Workload {:?} keeps muster's finalizer",
                    workload.metadata.name
                );
            }
            let claims = test.claims().list(&ListParams::default()).await?.items;
            for claim in &claims {
                let name = claim.metadata.name.clone().unwrap_or_default();
                let finalizers = claim.metadata.finalizers.clone().unwrap_or_default();
                ensure!(
                    !finalizers.iter().any(|f| f == muster_api::labels::CLAIM_FINALIZER),
                    "claim {name} keeps muster's finalizer"
                );
                let allocated = claim.status.as_ref().and_then(|s| s.allocation.as_ref()).is_some();
                if name.starts_with("running-") {
                    ensure!(
                        allocated
                            && finalizers
                                .iter()
                                .any(|f| f == muster_api::labels::DELETE_PROTECTION_FINALIZER),
                        "the running gang's claim {name} keeps its devices, handed over: {finalizers:?}"
                    );
                } else {
                    ensure!(!allocated, "claim {name} of the waiting gang holds nothing");
                }
            }
            let pods = test.gang_pods("waiting").await?;
            ensure!(
                !pods.is_empty()
                    && pods.iter().all(|p| p
                        .spec
                        .as_ref()
                        .and_then(|s| s.scheduling_gates.as_ref())
                        .is_some_and(|g| !g.is_empty())),
                "the waiting gang's pods stay behind the gate"
            );

            // Its pods end: kube-controller-manager gives the devices back, muster absent.
            test.exit_pod("running-launcher-0", 0).await?;
            for worker in 0..2 {
                test.exit_pod(&format!("running-workers-{worker}"), 0).await?;
            }
            let api = test.claims();
            wait::until(
                "the ended gang's devices to be given back",
                Duration::from_secs(60),
                || {
                    let api = api.clone();
                    async move { Ok(muster_e2e::scenario::allocations(&api).await?.is_empty().then_some(())) }
                },
            )
            .await?;
            // The namespace goes without muster (its clean-up deletes it; with a
            // finalizer of muster's left, it would hang in Terminating).
            muster_local_cluster::namespaces::delete_namespace(&test.client, &release_ns).await?;
            Ok(())
        })
    })
    .await
}

/// The refusal's message, if the API server refused the request.
fn refusal<T>(result: kube::Result<T>) -> Option<String> {
    match result {
        Err(kube::Error::Api(status)) if status.code == 403 || status.code == 422 => Some(status.message),
        _ => None,
    }
}

#[tokio::test]
async fn only_muster_opens_its_gate_or_gives_a_pod_the_toleration_of_its_fence() -> Result<()> {
    use k8s_openapi::api::admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding};
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::DeleteParams;
    with_test("gate-policy", &[], &[], |test| {
        Box::pin(async move {
            let release_ns = muster_local_cluster::namespaces::namespace(&test.client, "muster-system").await?;
            let (objects, kubeconfig) = rbac::chart_account(
                test,
                &release_ns,
                &[("crds.install", "false"), ("webhook.enabled", "false")],
            )
            .await?;
            // The chart's policy, bound to this test's namespace only: other tests run
            // their operators as the cluster's admin.
            let mut policy: Vec<serde_json::Value> = objects
                .iter()
                .filter(|o| {
                    o["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| n.ends_with("-gang-gate"))
                })
                .cloned()
                .collect();
            ensure!(policy.len() == 2, "the chart renders the gate policy and its binding");
            for object in &mut policy {
                if object["kind"] == "ValidatingAdmissionPolicyBinding" {
                    object["spec"]["matchResources"] =
                        json!({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": test.ns}}});
                }
            }
            rbac::apply(&test.client, &policy.iter().collect::<Vec<_>>()).await?;
            let policy_name = policy[0]["metadata"]["name"].as_str().context("name")?.to_string();
            let outcome = async {
                // muster as the chart runs it, with its ServiceAccount's rights only.
                if let Some(admin) = test.operator.take() {
                    admin.stop();
                }
                test.operator = Some(test.spawn_operator(&kubeconfig, &[], &[])?);

                // A tenant with the built-in edit role in the namespace.
                let bindings: Api<k8s_openapi::api::rbac::v1::RoleBinding> =
                    Api::namespaced(test.client.clone(), &test.ns);
                bindings
                    .create(
                        &PostParams::default(),
                        &serde_json::from_value(json!({
                            "metadata": {"name": "alice-edit"},
                            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
                            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}],
                        }))?,
                    )
                    .await?;
                let alice = rbac::impersonating(test.cluster.control_plane.kubeconfig(), "alice").await?;
                let alice: Api<Pod> = Api::namespaced(alice, &test.ns);
                let pod = |name: &str, spec: serde_json::Value| -> Result<Pod> {
                    let mut spec = spec;
                    spec["containers"] = json!([{"name": "main", "image": "trainer"}]);
                    Ok(serde_json::from_value(
                        json!({"metadata": {"name": name}, "spec": spec}),
                    )?)
                };
                let fence = json!({"key": "muster.dev/fenced", "operator": "Exists"});

                // A pod of her own that tolerates the fence is refused, once the API
                // server has taken the policy in.
                let tolerating = pod("tolerating", json!({"tolerations": [fence]}))?;
                let message = wait::until("the gate policy to be enforced", Duration::from_secs(30), || {
                    let (alice, tolerating) = (alice.clone(), tolerating.clone());
                    async move {
                        let result = alice.create(&PostParams::default(), &tolerating).await;
                        if result.is_ok() {
                            alice
                                .delete("tolerating", &DeleteParams::default().grace_period(0))
                                .await?;
                        }
                        Ok(refusal(result))
                    }
                })
                .await?;
                ensure!(
                    message.contains("muster.dev/fenced"),
                    "the refusal names the fence: {message}"
                );

                // Tolerating every taint passes the fence too: refused on a pod that asks
                // for devices, allowed on one that does not (a node agent, say).
                let mut greedy = pod(
                    "greedy",
                    json!({"tolerations": [{"operator": "Exists"}],
                    "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}]}),
                )?;
                if let Some(container) = greedy.spec.as_mut().and_then(|s| s.containers.first_mut()) {
                    container.resources = Some(serde_json::from_value(json!({"claims": [{"name": "gpus"}]}))?);
                }
                let refused = refusal(alice.create(&PostParams::default(), &greedy).await);
                ensure!(refused.is_some(), "a pod with GPUs tolerating every taint is refused");
                alice
                    .create(
                        &PostParams::default(),
                        &pod("agent", json!({"tolerations": [{"operator": "Exists"}]}))?,
                    )
                    .await
                    .context("a pod without devices may tolerate every taint")?;
                // Nor may a pod with devices skip the scheduler (and every NoSchedule taint).
                let node = test.cluster.nodes.first().context("a node")?.name.clone();
                let mut pinned = greedy.clone();
                pinned.metadata.name = Some("pinned".into());
                if let Some(spec) = pinned.spec.as_mut() {
                    spec.tolerations = None;
                    spec.node_name = Some(node);
                }
                let message = refusal(alice.create(&PostParams::default(), &pinned).await)
                    .context("a pod with GPUs created on a node by name")?;
                ensure!(
                    message.contains("spec.nodeName"),
                    "the refusal names the field: {message}"
                );

                // Behind muster's gate, the toleration may come with the pod; the gate
                // may not go.
                let gated = pod(
                    "gated",
                    json!({"schedulingGates": [{"name": "muster.dev/gang"}], "tolerations": [fence]}),
                )?;
                alice
                    .create(&PostParams::default(), &gated)
                    .await
                    .context("a gated pod may carry the toleration")?;
                let open = json!({"spec": {"schedulingGates": []}});
                let message = refusal(
                    alice
                        .patch("gated", &PatchParams::default(), &Patch::Merge(&open))
                        .await,
                )
                .context("the tenant took muster's gate off a pod")?;
                ensure!(
                    message.contains("muster.dev/gang"),
                    "the refusal names the gate: {message}"
                );

                // Nor may the toleration be added to a pod of hers later.
                alice.create(&PostParams::default(), &pod("plain", json!({}))?).await?;
                let tolerate = json!({"spec": {"tolerations": [fence]}});
                let message = refusal(
                    alice
                        .patch("plain", &PatchParams::default(), &Patch::Merge(&tolerate))
                        .await,
                )
                .context("the tenant gave a pod the toleration of the fence")?;
                ensure!(
                    message.contains("muster.dev/fenced"),
                    "the refusal names the fence: {message}"
                );

                // muster itself opens its gate and gives its pods the toleration.
                test.create(gang("guarded", 2, None)).await?;
                assert_runs_as_planned(test, "guarded").await?;
                anyhow::Ok(())
            }
            .await;
            let policies: Api<ValidatingAdmissionPolicy> = Api::all(test.client.clone());
            let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(test.client.clone());
            bindings.delete(&policy_name, &DeleteParams::default()).await?;
            policies.delete(&policy_name, &DeleteParams::default()).await?;
            outcome
        })
    })
    .await
}

/// A TLS client that takes any certificate: the attacker does not care whom it talks to.
fn any_certificate() -> tokio_rustls::TlsConnector {
    use tokio_rustls::rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use tokio_rustls::rustls::{DigitallySignedStruct, SignatureScheme};
    #[derive(Debug)]
    struct Any(std::sync::Arc<tokio_rustls::rustls::crypto::CryptoProvider>);
    impl ServerCertVerifier for Any {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, tokio_rustls::rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
            Ok(HandshakeSignatureValid::assertion())
        }
        fn verify_tls13_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
            Ok(HandshakeSignatureValid::assertion())
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }
    let provider = std::sync::Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .dangerous()
        .with_custom_certificate_verifier(std::sync::Arc::new(Any(provider)))
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
}

/// Keeps `count` connections from `source` to `target` open, opening each again when
/// the server closes it: each sends `request` (over TLS with `tls`), reads the answer
/// and stays open, idle, as a keep-alive client does. Returns the task and how many
/// requests were answered.
fn hold_connections(
    source: std::net::IpAddr,
    target: std::net::SocketAddr,
    count: usize,
    request: String,
    tls: Option<tokio_rustls::TlsConnector>,
) -> (
    tokio::task::JoinHandle<()>,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
    async fn hold<S: AsyncRead + AsyncWrite + Unpin>(
        mut stream: S,
        request: &str,
        answered: &std::sync::atomic::AtomicUsize,
    ) -> std::io::Result<()> {
        stream.write_all(request.as_bytes()).await?;
        let mut buffer = [0u8; 4096];
        if stream.read(&mut buffer).await? > 0 {
            answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // Until the server closes it.
        while stream.read(&mut buffer).await? > 0 {}
        Ok(())
    }
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = answered.clone();
    let task = tokio::spawn(async move {
        let mut holders = tokio::task::JoinSet::new();
        for _ in 0..count {
            let (request, counter, tls) = (request.clone(), counter.clone(), tls.clone());
            holders.spawn(async move {
                loop {
                    let held = async {
                        let socket = tokio::net::TcpSocket::new_v4()?;
                        socket.bind(std::net::SocketAddr::new(source, 0))?;
                        let stream = socket.connect(target).await?;
                        match &tls {
                            Some(tls) => {
                                let name = tokio_rustls::rustls::pki_types::ServerName::IpAddress(target.ip().into());
                                let stream = tls.connect(name, stream).await?;
                                hold(stream, &request, &counter).await
                            }
                            None => hold(stream, &request, &counter).await,
                        }
                    };
                    let _ = held.await;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            });
        }
        while holders.join_next().await.is_some() {}
    });
    (task, answered)
}

/// Floods `/metrics` at `target` from `source` with a fresh random token per request.
fn flood_metrics(source: std::net::IpAddr, target: std::net::SocketAddr) -> tokio::task::JoinHandle<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tokio::spawn(async move {
        let mut tasks = tokio::task::JoinSet::new();
        for worker in 0..4u64 {
            tasks.spawn(async move {
                let mut n = worker;
                loop {
                    n = n.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let request = format!(
                        "GET /metrics HTTP/1.1\r\nHost: muster\r\nAuthorization: Bearer forged-{n:016x}\r\nConnection: close\r\n\r\n"
                    );
                    let sent = async {
                        let socket = tokio::net::TcpSocket::new_v4()?;
                        socket.bind(std::net::SocketAddr::new(source, 0))?;
                        let mut stream = socket.connect(target).await?;
                        stream.write_all(request.as_bytes()).await?;
                        let mut response = Vec::new();
                        stream.read_to_end(&mut response).await?;
                        std::io::Result::Ok(())
                    };
                    if sent.await.is_err() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    })
}

/// An attacker on 127.0.0.2 holds more idle connections than any listener serves at
/// once, on the probes and metrics port (after a keep-alive request) and on the webhook
/// (TCP without a TLS handshake), and floods `/metrics` with forged tokens. The probes
/// still answer, the API server's webhook calls still get through within their timeout,
/// and a labelled Job is admitted as a gang.
#[tokio::test]
async fn idle_connections_and_forged_tokens_take_no_endpoint_down() -> Result<()> {
    let port = webhook_port().await?;
    let mut args = muster_e2e::frameworks::operator_args(port);
    args.push("--metrics-auth".into());
    with_test("endpoints", &[], &[], move |test| {
        Box::pin(async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            // The attack begins before the operator does, so that the API server has no
            // connection to the webhook that it could go on using.
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }
            let attacker: std::net::IpAddr = [127, 0, 0, 2].into();
            let webhook: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
            // A request the webhook answers (400: not an AdmissionReview), on a connection
            // kept alive.
            let review = "POST /mutate HTTP/1.1\r\nHost: muster\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
            let (webhook_attack, opened) =
                hold_connections(attacker, webhook, 300, review.to_string(), Some(any_certificate()));
            test.start_operator(&args, &[])?;
            let http = test.operator.as_ref().context("operator")?.http;
            let keep_alive = format!("GET /healthz HTTP/1.1\r\nHost: {http}\r\n\r\n");
            let (probes_attack, _) = hold_connections(attacker, http, 96, keep_alive, None);
            let flood = flood_metrics(attacker, http);
            let outcome = async {
                wait::until("the attacker to hold the webhook's connections", Duration::from_secs(60), || {
                    let opened = opened.clone();
                    async move { Ok((opened.load(std::sync::atomic::Ordering::Relaxed) >= 256).then_some(())) }
                })
                .await?;

                // The kubelet's probes, as it sends them: a fresh connection, 2 s to answer.
                for round in 0..10 {
                    for probe in ["/healthz", "/readyz"] {
                        let answer = tokio::time::timeout(
                            Duration::from_secs(2),
                            muster_local_cluster::operator::http_get(&http.to_string(), probe),
                        )
                        .await;
                        ensure!(
                            matches!(answer, Ok(Ok((200, _)))),
                            "{probe} in round {round} under attack: {answer:?}"
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }

                // The API server's calls to the webhook: a labelled Job is made (its
                // create waits for the webhook) and runs as a gang.
                let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
                let mut job = muster_e2e::scenario::job_joining("attacked", "main", 2);
                job["metadata"] = json!({"name": "attacked", "labels": {"muster.dev/gang": "true"}});
                job["spec"]["template"]["spec"].as_object_mut().map(|s| s.remove("schedulingGates"));
                // With failurePolicy Fail, a webhook that does not answer within its
                // timeout fails the create.
                jobs.create(&PostParams::default(), &serde_json::from_value(job)?)
                    .await
                    .context("creating a labelled Job while the webhook is attacked")?;
                test.wait_phase("job-attacked", WorkloadPhase::Running, Duration::from_secs(90))
                    .await?;
                anyhow::Ok(())
            }
            .await;
            probes_attack.abort();
            webhook_attack.abort();
            flood.abort();
            outcome
        })
    })
    .await
}

/// While no replica of muster answers, its webhook's failure policy refuses a labelled
/// job's changes that muster must check (its spec), and lets the rest through: the
/// garbage collector's and a finalizer's updates.
#[tokio::test]
async fn while_muster_is_down_only_the_updates_it_must_check_are_refused() -> Result<()> {
    let port = webhook_port().await?;
    let args = muster_e2e::frameworks::operator_args(port);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    with_test("webhook-down", &args, &[], |test| {
        Box::pin(async move {
            wait_webhook_ready(test).await?;
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            let mut job = muster_e2e::scenario::job_joining("kept", "main", 1);
            job["metadata"] = json!({"name": "kept", "labels": {"muster.dev/gang": "true"}});
            job["spec"]["suspend"] = json!(true);
            job["spec"]["template"]["spec"]
                .as_object_mut()
                .map(|s| s.remove("schedulingGates"));
            jobs.create(&PostParams::default(), &serde_json::from_value(job)?)
                .await?;
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }
            let finalizers = |list: serde_json::Value| json!({"metadata": {"finalizers": list}});
            jobs.patch(
                "kept",
                &PatchParams::default(),
                &Patch::Merge(&finalizers(json!(["example.com/keep"]))),
            )
            .await
            .context("a finalizer added while muster is down")?;
            let resume = json!({"spec": {"suspend": false}});
            let refused = jobs
                .patch("kept", &PatchParams::default(), &Patch::Merge(&resume))
                .await;
            ensure!(
                refused.is_err(),
                "a change of the spec waits for muster's webhook: {refused:?}"
            );
            jobs.patch("kept", &PatchParams::default(), &Patch::Merge(&finalizers(json!(null))))
                .await
                .context("a finalizer removed while muster is down")?;
            jobs.delete("kept", &kube::api::DeleteParams::background()).await?;
            Ok(())
        })
    })
    .await
}
