//! Atomic gang admission on a real control plane: a gang gets every device or holds
//! none, is released only when fully reserved, survives the operator being killed at any
//! step of a commit, and is torn down and placed again when its pods cannot all start.
//! An invariant checker runs beside every test.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::DeviceTaintRule;
use kube::api::{Api, DeleteParams, PostParams};
use muster_api::v1alpha1::{AdmissionState, WorkloadPhase};
use muster_api::{conditions, labels};
use muster_e2e::scenario::{
    Test, allocations, assert_runs_as_planned, gang, job_joining, log_tail, with_test, worker_node,
    workload_of_joining_pods,
};
use muster_local_cluster::fleet::GPU_DRIVER;
use muster_local_cluster::wait;
use serde_json::json;

#[tokio::test]
async fn a_gang_that_fits_runs_on_its_planned_nodes_with_its_planned_devices() -> Result<()> {
    with_test("fits", &[], &[], |test| {
        Box::pin(async move {
            test.create(gang("llama", 3, None)).await?;
            let workload = assert_runs_as_planned(test, "llama").await?;
            let placement = workload.status.and_then(|s| s.placement).context("placement")?;
            assert_eq!(placement.devices, 24);
            let admitted = test
                .wait_admitted_reason("llama", "Admitted", Duration::from_secs(5))
                .await?;
            ensure!(admitted.contains("reserved 24 devices on 3 nodes"), "{admitted}");
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_gang_too_big_for_any_rack_holds_nothing_and_says_why() -> Result<()> {
    with_test("too-big", &[], &[], |test| {
        Box::pin(async move {
            test.create(gang("huge", 5, None)).await?;
            let message = test.wait_admitted_reason("huge", "Unschedulable", Duration::from_secs(60)).await?;
            ensure!(
                message.contains("group workers needs 5 pods (8 gpu.example.com devices each, 16 CPU, 65536Mi memory) in one example.com/rack, but the best"),
                "{message}"
            );
            ensure!(message.contains("has room for 4"), "{message}");
            let workload = test.workloads().get("huge").await?;
            assert_eq!(workload.status.as_ref().and_then(|s| s.phase), Some(WorkloadPhase::Queued));
            ensure!(allocations(&test.claims()).await?.is_empty(), "no claim allocated");
            for pod in test.gang_pods("huge").await? {
                let spec = pod.spec.context("spec")?;
                ensure!(spec.node_name.is_none(), "no pod bound");
                ensure!(spec.scheduling_gates.unwrap_or_default().iter().any(|g| g.name == labels::GANG_GATE), "still gated");
            }
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn two_gangs_competing_for_one_rack_are_admitted_one_after_the_other() -> Result<()> {
    with_test("compete", &[], &[], |test| {
        Box::pin(async move {
            // Each needs three of the four nodes of rack-0000.
            test.create(gang("first", 3, Some("rack-0000"))).await?;
            assert_runs_as_planned(test, "first").await?;
            test.create(gang("second", 3, Some("rack-0000"))).await?;
            let message = test
                .wait_admitted_reason("second", "Unschedulable", Duration::from_secs(60))
                .await?;
            ensure!(message.contains("has room for 1"), "{message}");
            let held = allocations(&test.claims()).await?;
            ensure!(
                held.keys().all(|c| c.starts_with("first-")),
                "the second gang holds nothing: {held:?}"
            );

            test.workloads().delete("first", &DeleteParams::default()).await?;
            assert_runs_as_planned(test, "second").await?;
            let held = allocations(&test.claims()).await?;
            ensure!(held.keys().all(|c| c.starts_with("second-")), "{held:?}");
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn the_operator_killed_at_any_commit_step_converges() -> Result<()> {
    for fault in [
        "after-plan-recorded",
        "after-first-claim",
        "after-all-claims",
        "after-reserved",
        "after-first-release",
    ] {
        let name = format!("fault-{fault}");
        with_test(&name, &[], &[("MUSTER_FAULT_POINT", fault)], |test| {
            Box::pin(async move {
                test.create(gang("victim", 3, None)).await?;
                let operator = test.operator.as_mut().context("operator")?;
                operator.wait_aborted_at(fault, Duration::from_secs(60)).await?;
                test.operator = None;
                test.start_operator(&[], &[])?;
                assert_runs_as_planned(test, "victim").await?;
                let held = allocations(&test.claims()).await?;
                let placement = test
                    .workloads()
                    .get("victim")
                    .await?
                    .status
                    .and_then(|s| s.placement)
                    .context("placement")?;
                let planned: BTreeSet<&String> = placement.claims.iter().collect();
                ensure!(
                    held.keys().collect::<BTreeSet<_>>() == planned,
                    "held {held:?}, planned {planned:?}"
                );
                Ok(())
            })
        })
        .await
        .with_context(|| format!("after a crash {fault}"))?;
    }
    Ok(())
}

#[tokio::test]
async fn a_plain_pod_never_gets_a_device_muster_reserved() -> Result<()> {
    with_test("plain", &[], &[], |test| {
        Box::pin(async move {
            // Someone else's pod with its own claim, submitted while the gang is admitted.
            test.create(gang("gang", 4, Some("rack-0001"))).await?;
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": "intruder"},
                "spec": {
                    "containers": [{"name": "main", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "eight-gpus"}],
                },
            }))?;
            test.pods().create(&PostParams::default(), &pod).await?;
            assert_runs_as_planned(test, "gang").await?;
            // The fence keeps the pod off every GPU node: it is unschedulable, and its
            // claim never gets a device.
            let reason = test.wait_unschedulable("intruder").await?;
            ensure!(reason.contains("untolerated taint"), "the fence is why: {reason}");
            let held = allocations(&test.claims()).await?;
            let gang_devices: BTreeSet<_> = held
                .iter()
                .filter(|(c, _)| c.starts_with("gang-"))
                .flat_map(|(_, d)| d.clone())
                .collect();
            let others: BTreeSet<_> = held
                .iter()
                .filter(|(c, _)| !c.starts_with("gang-"))
                .flat_map(|(_, d)| d.clone())
                .collect();
            ensure!(gang_devices.len() == 32, "the gang holds 32 devices");
            ensure!(
                gang_devices.is_disjoint(&others),
                "no device of the gang given to the plain pod"
            );
            test.pods().delete("intruder", &DeleteParams::default()).await?;
            Ok(())
        })
    })
    .await
}

/// Without a fence (`--fencing none`), kube-scheduler may give a planned device to another
/// pod while a gang is being committed: the re-read of all claims after reserving finds
/// it, the commit is undone, and the gang is placed again away from that device.
#[tokio::test]
async fn a_device_taken_during_a_commit_is_caught_and_the_gang_placed_again() -> Result<()> {
    with_test("conflict", &[], &[], |test| {
        Box::pin(async move {
            // Hold the commit once the plan is recorded, until the test says go.
            let resume = test.cluster.control_plane.run_dir().join(format!("{}-resume", test.ns));
            let resume_path = resume.display().to_string();
            test.operator.take().context("operator")?.stop();
            test.start_operator(
                &["--fencing", "none"],
                &[
                    ("MUSTER_PAUSE_POINT", "after-plan-recorded"),
                    ("MUSTER_PAUSE_UNTIL", &resume_path),
                ],
            )?;
            // Unfenced GPU nodes: every pod here tolerates the test fleet's fence taint.
            let tolerate = json!([{"key": labels::FENCE_TAINT, "operator": "Exists"}]);
            let mut racer = gang("racer", 2, None);
            for group in racer["spec"]["podGroups"].as_array_mut().context("groups")? {
                group["template"]["spec"]["tolerations"] = tolerate.clone();
            }
            test.create(racer).await?;
            let workloads = test.workloads();
            let placement = wait::until("racer's plan to be recorded", Duration::from_secs(60), || {
                let workloads = workloads.clone();
                async move {
                    let placement = workloads.get("racer").await?.status.and_then(|s| s.placement);
                    Ok(placement.filter(|p| p.state == Some(AdmissionState::Reserving)))
                }
            })
            .await?;
            let victim = worker_node(&placement)?;

            // Meanwhile kube-scheduler places someone else's pod on a planned node and
            // gives it all eight GPUs there.
            let intruder: Pod = serde_json::from_value(json!({
                "metadata": {"name": "intruder"},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": victim},
                    "tolerations": tolerate,
                    "containers": [{"name": "main", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "eight-gpus"}],
                },
            }))?;
            test.pods().create(&PostParams::default(), &intruder).await?;
            let claims = test.claims();
            let taken = wait::until("the intruder's claim to be allocated", Duration::from_secs(60), || {
                let claims = claims.clone();
                async move {
                    let held = allocations(&claims).await?;
                    Ok(held.into_iter().find(|(c, _)| c.starts_with("intruder")))
                }
            })
            .await?;
            ensure!(
                taken.1.iter().all(|(pool, _)| *pool == victim),
                "the intruder's devices are on {victim}: {taken:?}"
            );
            std::fs::write(&resume, b"")?;

            // muster reserves, finds the device taken, undoes everything and plans again.
            let note = test
                .wait_event("racer", conditions::EVENT_ROLLED_BACK, "is allocated to")
                .await?;
            ensure!(note.contains(&taken.0), "the conflict names the other claim: {note}");
            let workload = assert_runs_as_planned(test, "racer").await?;
            let placement = workload.status.and_then(|s| s.placement).context("placement")?;
            ensure!(
                placement
                    .pods
                    .iter()
                    .all(|p| !(p.name.contains("workers") && p.node == victim)),
                "no worker placed again on {victim}: {:?}",
                placement.pods
            );
            let held = allocations(&test.claims()).await?;
            ensure!(
                held.get(&taken.0) == Some(&taken.1),
                "the intruder keeps its devices: {held:?}"
            );
            let (_, metrics) = test.operator.as_ref().context("operator")?.get("/metrics").await?;
            ensure!(
                metrics.lines().any(|l| l == "muster_conflicts_total 1"),
                "one conflict counted:\n{}",
                metrics
                    .lines()
                    .filter(|l| l.contains("conflict"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            test.pods().delete("intruder", &DeleteParams::default()).await?;
            Ok(())
        })
    })
    .await
}

/// A cluster-wide DeviceTaintRule for the test fleet's driver, removed when dropped (the
/// control plane is shared by this file's tests).
struct TaintRule {
    api: Api<DeviceTaintRule>,
    name: String,
}

impl TaintRule {
    async fn create(test: &Test, name: &str, device: Option<&str>, key: &str) -> Result<Self> {
        let api: Api<DeviceTaintRule> = Api::all(test.client.clone());
        let mut selector = json!({"driver": GPU_DRIVER});
        if let Some(device) = device {
            selector["device"] = json!(device);
        }
        let rule: DeviceTaintRule = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"deviceSelector": selector, "taint": {"key": key, "value": "true", "effect": "NoSchedule"}},
        }))?;
        api.create(&PostParams::default(), &rule).await?;
        Ok(TaintRule {
            api,
            name: name.to_string(),
        })
    }

    async fn delete(self) -> Result<()> {
        self.api.delete(&self.name, &DeleteParams::default()).await?;
        Ok(())
    }
}

/// muster honours DeviceTaintRules as kube-scheduler does: with gpu-0 of every node
/// tainted for maintenance, no node has eight usable GPUs, until the rule goes.
#[tokio::test]
async fn devices_tainted_by_a_rule_are_not_planned_until_it_goes() -> Result<()> {
    with_test("maintenance", &[], &[], |test| {
        Box::pin(async move {
            let rule = TaintRule::create(test, "maintenance-gpu-0", Some("gpu-0"), "example.com/maintenance").await?;
            let outcome = async {
                test.create(gang("patient", 1, None)).await?;
                let message = test
                    .wait_admitted_reason("patient", "Unschedulable", Duration::from_secs(60))
                    .await?;
                ensure!(held_devices(test).await?.is_empty(), "nothing reserved: {message}");
                Ok::<_, anyhow::Error>(())
            }
            .await;
            rule.delete().await?;
            outcome?;
            assert_runs_as_planned(test, "patient").await?;
            Ok(())
        })
    })
    .await
}

/// `--fencing device-taint`: the GPUs carry the fence as a device taint that only muster's
/// claims tolerate. Another pod's claim gets no GPU, but the pod itself may still use a
/// GPU node's CPU (here the fleet's node taint is tolerated by every pod, as if the nodes
/// were open).
#[tokio::test]
async fn a_device_fence_keeps_other_claims_off_the_gpus_but_not_other_pods_off_the_nodes() -> Result<()> {
    with_test("device-fence", &["--fencing", "device-taint"], &[], |test| {
        Box::pin(async move {
            let rule = TaintRule::create(test, "muster-fence", None, labels::FENCE_TAINT).await?;
            let outcome = async {
                let open_nodes = json!([{"key": labels::FENCE_TAINT, "operator": "Exists"}]);
                let mut fenced = gang("fenced", 2, None);
                for group in fenced["spec"]["podGroups"].as_array_mut().context("groups")? {
                    group["template"]["spec"]["tolerations"] = open_nodes.clone();
                }
                test.create(fenced).await?;
                assert_runs_as_planned(test, "fenced").await?;
                for claim in test.gang_claims("fenced").await? {
                    let results = claim
                        .status
                        .and_then(|s| s.allocation)
                        .and_then(|a| a.devices)
                        .and_then(|d| d.results)
                        .unwrap_or_default();
                    ensure!(
                        results.iter().all(|r| r
                            .tolerations
                            .iter()
                            .flatten()
                            .any(|t| t.key.as_deref() == Some(labels::FENCE_TAINT))),
                        "each result records the fence's toleration: {results:?}"
                    );
                }
                let outsider = |name: &str, claims: bool| -> Result<Pod> {
                    let mut spec = json!({
                        "tolerations": open_nodes,
                        "containers": [{"name": "main", "image": "x", "resources": {"requests": {"cpu": "1"}}}],
                    });
                    if claims {
                        spec["containers"][0]["resources"]["claims"] = json!([{"name": "gpu"}]);
                        spec["resourceClaims"] = json!([{"name": "gpu", "resourceClaimTemplateName": "eight-gpus"}]);
                    }
                    Ok(serde_json::from_value(
                        json!({"metadata": {"name": name}, "spec": spec}),
                    )?)
                };
                test.pods()
                    .create(&PostParams::default(), &outsider("with-gpus", true)?)
                    .await?;
                test.pods()
                    .create(&PostParams::default(), &outsider("cpu-only", false)?)
                    .await?;
                let pods = test.pods();
                wait::until("the CPU-only pod to run on a GPU node", Duration::from_secs(60), || {
                    let pods = pods.clone();
                    async move {
                        let pod = pods.get("cpu-only").await?;
                        let bound = pod.spec.and_then(|s| s.node_name).is_some();
                        Ok((bound && pod.status.and_then(|s| s.phase).as_deref() == Some("Running")).then_some(()))
                    }
                })
                .await?;
                let reason = test.wait_unschedulable("with-gpus").await?;
                let held = allocations(&test.claims()).await?;
                ensure!(
                    !held.keys().any(|c| c.starts_with("with-gpus")),
                    "the outsider's claim got no device ({reason}): {held:?}"
                );
                for name in ["with-gpus", "cpu-only"] {
                    test.pods().delete(name, &DeleteParams::default()).await?;
                }
                Ok::<_, anyhow::Error>(())
            }
            .await;
            rule.delete().await?;
            outcome
        })
    })
    .await
}

async fn held_devices(test: &Test) -> Result<Vec<(String, String)>> {
    Ok(allocations(&test.claims()).await?.into_values().flatten().collect())
}

#[tokio::test]
async fn a_released_gang_that_cannot_be_scheduled_is_torn_down_and_placed_again() -> Result<()> {
    let timeout = ["--schedule-timeout", "8"];
    let go_on = std::env::temp_dir().join(format!("muster-teardown-{}", std::process::id()));
    let go_on_text = go_on.display().to_string();
    let _ = std::fs::remove_file(&go_on);
    let paused = [
        ("MUSTER_PAUSE_POINT", "after-reserved"),
        ("MUSTER_PAUSE_UNTIL", go_on_text.as_str()),
    ];
    with_test("teardown", &timeout, &paused, |test| {
        let go_on = go_on.clone();
        Box::pin(async move {
            test.create(gang("unlucky", 3, None)).await?;
            test.wait_paused("after-reserved").await?;
            // Between plan and bind, another pod takes the CPU of one planned worker node.
            let workload = test.workloads().get("unlucky").await?;
            let placement = workload.status.and_then(|s| s.placement).context("placement")?;
            let victim = worker_node(&placement)?;
            let hog: Pod = serde_json::from_value(json!({
                "metadata": {"name": "hog"},
                "spec": {
                    "nodeName": victim,
                    "tolerations": [{"key": "muster.dev/fenced", "operator": "Exists"}],
                    "containers": [{"name": "main", "image": "x", "resources": {"requests": {"cpu": "60"}}}],
                },
            }))?;
            test.pods().create(&PostParams::default(), &hog).await?;
            std::fs::write(&go_on, b"")?;

            let message = test
                .wait_admitted_reason("unlucky", "ScheduleTimeout", Duration::from_secs(60))
                .await?;
            ensure!(message.contains("not scheduled within 8s"), "{message}");
            test.wait_event("unlucky", conditions::EVENT_SCHEDULE_TIMEOUT, "not scheduled within 8s")
                .await?;
            let workload = assert_runs_as_planned(test, "unlucky").await?;
            let placement = workload.status.and_then(|s| s.placement).context("placement")?;
            let on_victim: Vec<_> = placement
                .pods
                .iter()
                .filter(|p| p.name.contains("workers") && p.node == victim)
                .collect();
            ensure!(
                on_victim.is_empty(),
                "no worker placed again on {victim}: {:?}",
                placement.pods
            );
            test.pods().delete("hog", &DeleteParams::default()).await?;
            let _ = std::fs::remove_file(&go_on);
            Ok(())
        })
    })
    .await
}

/// The starvation rule holds the nodes a long-waiting gang could use, and only those:
/// a gang that needs other nodes goes ahead.
#[tokio::test]
async fn a_gang_waiting_too_long_keeps_its_nodes_from_smaller_ones_but_not_the_rest() -> Result<()> {
    with_test("starvation", &["--starvation-after", "3"], &[], |test| {
        Box::pin(async move {
            test.create(gang("small", 1, Some("rack-0000"))).await?;
            assert_runs_as_planned(test, "small").await?;
            // Needs all of rack-0000, where one node is taken: it waits.
            test.create(gang("big", 4, Some("rack-0000"))).await?;
            test.wait_admitted_reason("big", "Unschedulable", Duration::from_secs(60))
                .await?;
            // Past the starvation limit.
            test.wait_admitted_unchanged_for("big", 4.0).await?;
            // A gang that can only use rack-0001 takes nothing big could use: it runs.
            test.create(gang("elsewhere", 1, Some("rack-0001"))).await?;
            assert_runs_as_planned(test, "elsewhere").await?;
            // A small gang that would fit in rack-0000 must wait behind it.
            test.create(gang("late", 1, Some("rack-0000"))).await?;
            let message = test
                .wait_admitted_reason("late", "WaitingBehind", Duration::from_secs(60))
                .await?;
            ensure!(message.contains("big has waited longest"), "{message}");
            ensure!(
                test.gang_claims("late").await?.iter().all(|c| c
                    .status
                    .as_ref()
                    .and_then(|s| s.allocation.as_ref())
                    .is_none())
            );

            test.workloads().delete("small", &DeleteParams::default()).await?;
            assert_runs_as_planned(test, "big").await?;
            test.workloads().delete("big", &DeleteParams::default()).await?;
            assert_runs_as_planned(test, "late").await?;
            Ok(())
        })
    })
    .await
}

/// Gangs that fit side by side are committed at the same time: each is planned with the
/// ones before it assumed, so their commits' round trips overlap without ever taking a
/// device twice. Both commits must reach the pause before either may go on; one after
/// the other, the second would never start while the first waits.
#[tokio::test]
async fn gangs_planned_in_one_pass_are_committed_together_on_separate_devices() -> Result<()> {
    let go_on = std::env::temp_dir().join(format!("muster-concurrent-commits-{}", std::process::id()));
    let go_on_text = go_on.display().to_string();
    with_test("together", &[], &[], |test| {
        let go_on = go_on.clone();
        let go_on_text = go_on_text.clone();
        Box::pin(async move {
            // Another scheduler holds one GPU on three nodes of each rack: neither gang
            // (two whole nodes in one rack) fits while the operator joins and plans them.
            let mut taken = Vec::new();
            for rack in test.cluster.nodes.chunk_by(|a, b| a.rack == b.rack) {
                for node in rack.iter().take(3) {
                    let name = format!("taken-{}", node.name);
                    take_device(test, &name, &node.name, "gpu-0").await?;
                    taken.push(name);
                }
            }
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            for name in ["left", "right"] {
                test.create(workload_of_joining_pods(name, "workers", 2)).await?;
                let job: Job = serde_json::from_value(job_joining(name, "workers", 2))?;
                jobs.create(&PostParams::default(), &job).await?;
            }
            for name in ["left", "right"] {
                test.wait_admitted_reason(name, conditions::REASON_UNSCHEDULABLE, Duration::from_secs(60))
                    .await?;
            }
            // With the operator down the devices come free; the next one finds both gangs
            // complete and waiting in its first pass.
            let first_log = test.operator.as_ref().map(|o| o.log_path().to_path_buf());
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }
            for name in &taken {
                test.claims().delete(name, &DeleteParams::default()).await?;
            }
            wait::until("the taken devices to come free", Duration::from_secs(60), || async {
                let held = allocations(&test.claims()).await?;
                Ok(taken.iter().all(|t| !held.contains_key(t)).then_some(()))
            })
            .await?;
            test.start_operator(
                &[],
                &[
                    ("MUSTER_PAUSE_POINT", "after-plan-recorded"),
                    ("MUSTER_PAUSE_UNTIL", go_on_text.as_str()),
                    // Why a gang is left out of a pass, should one be.
                    ("MUSTER_LOG", "info,muster::admission=debug"),
                ],
            )?;
            let operator = test.operator.as_ref().context("operator")?;
            let paused = wait::until("both commits to pause", Duration::from_secs(60), || {
                let paused = operator
                    .log()
                    .matches("pause point after-plan-recorded reached")
                    .count();
                async move { Ok((paused == 2).then_some(())) }
            })
            .await;
            if let Err(e) = paused {
                // Where each gang stood as the first operator left it, and what it did.
                let mut seen = Vec::new();
                for name in ["left", "right"] {
                    let workload = test.workloads().get(name).await?;
                    seen.push(format!("{name}: {}", serde_json::to_string(&workload.status)?));
                }
                let first = first_log
                    .and_then(|path| std::fs::read_to_string(path).ok())
                    .unwrap_or_default();
                return Err(e.context(format!(
                    "{}\nthe first operator's last lines:\n{}",
                    seen.join("\n"),
                    log_tail(&first, 40)
                )));
            }
            // Neither gang left the queue as the operator started: its controller
            // reconciles nothing before its caches of pods and claims are filled.
            let log = operator.log();
            ensure!(
                !log.contains("its objects are not created"),
                "a gang was taken for one whose objects are not created at the restart:\n{}",
                log.lines()
                    .filter(|l| l.contains("gang not queued"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            std::fs::write(&go_on, b"")?;
            for name in ["left", "right"] {
                test.wait_phase(name, WorkloadPhase::Running, Duration::from_secs(90))
                    .await?;
            }
            let held = allocations(&test.claims()).await?;
            let devices: Vec<&(String, String)> = held.values().flatten().collect();
            let distinct: BTreeSet<&(String, String)> = devices.iter().copied().collect();
            ensure!(devices.len() == 32, "both gangs hold 32 devices: {held:?}");
            ensure!(distinct.len() == devices.len(), "a device is held twice: {held:?}");
            Ok(())
        })
    })
    .await?;
    let _ = std::fs::remove_file(&go_on);
    Ok(())
}

/// A claim `name` holding `device` of `node`, allocated the way another scheduler would.
async fn take_device(test: &Test, name: &str, node: &str, device: &str) -> Result<()> {
    let claim = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": GPU_DRIVER, "count": 1}}]}},
    }))?;
    test.claims().create(&PostParams::default(), &claim).await?;
    let allocation = json!({"status": {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": GPU_DRIVER, "pool": node, "device": device},
    ]}}}});
    test.claims()
        .patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&allocation),
        )
        .await?;
    Ok(())
}
