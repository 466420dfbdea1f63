//! An admitted gang's life on a real control plane: success, restarts that reuse the
//! reservation, re-planning after a lost node, failure after maxRestarts, suspend and
//! resume, deletion while the operator is down, and the environment pods get.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::DeviceTaintRule;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use muster_api::v1alpha1::{AdmissionState, WorkloadPhase};
use muster_api::{conditions, labels};
use muster_e2e::scenario::{
    Test, allocations, assert_runs_as_planned, gang, job_joining, with_test, worker_node, workload_of_joining_pods,
};
use muster_local_cluster::fleet::GPU_DRIVER;
use muster_local_cluster::wait;
use serde_json::{Value, json};

fn with_policy(mut workload: Value, policy: Value) -> Value {
    if let (Some(spec), Some(extra)) = (workload["spec"].as_object_mut(), policy.as_object()) {
        spec.extend(extra.clone());
    }
    workload
}

/// The devices each claim of the namespace holds, sorted.
async fn devices_by_claim(test: &Test) -> Result<BTreeMap<String, Vec<(String, String)>>> {
    let mut held = allocations(&test.claims()).await?;
    held.values_mut().for_each(|d| d.sort());
    Ok(held)
}

async fn wait_restarts(test: &Test, name: &str, restarts: i32) -> Result<()> {
    let api = test.workloads();
    wait::until(
        &format!("{name} to have restarted {restarts} times"),
        Duration::from_secs(60),
        || {
            let api = api.clone();
            async move {
                let w = api.get(name).await?;
                Ok(w.status.is_some_and(|s| s.restarts == restarts).then_some(()))
            }
        },
    )
    .await
}

#[tokio::test]
async fn pods_get_ranks_and_the_coordinator_address() -> Result<()> {
    with_test("env", &[], &[], |test| {
        Box::pin(async move {
            test.create(gang("torch", 2, None)).await?;
            assert_runs_as_planned(test, "torch").await?;
            let pod = test.pods().get("torch-workers-1").await?;
            let env: BTreeMap<String, String> = pod.spec.context("spec")?.containers[0]
                .env
                .clone()
                .unwrap_or_default()
                .into_iter()
                .map(|e| (e.name, e.value.unwrap_or_default()))
                .collect();
            ensure!(env["MUSTER_RANK"] == "2" && env["MUSTER_WORLD_SIZE"] == "3", "{env:?}");
            ensure!(
                env["MASTER_ADDR"] == "torch-launcher-0.torch" && env["MASTER_PORT"] == "29500",
                "{env:?}"
            );
            ensure!(
                env["MUSTER_POD_GROUP"] == "workers" && env["MUSTER_POD_INDEX"] == "1",
                "{env:?}"
            );
            ensure!(pod.metadata.labels.context("labels")?[labels::ATTEMPT] == "0");
            Ok(())
        })
    })
    .await
}

/// Issue 23: the headless Service is made only where rendezvous by name needs it; a gang
/// that does without runs the same, with one object fewer to write.
#[tokio::test]
async fn a_gang_without_dns_hostnames_runs_without_a_service() -> Result<()> {
    with_test("no-service", &[], &[], |test| {
        Box::pin(async move {
            let network = json!({"network": {"enableDNSHostnames": false}});
            test.create(with_policy(gang("plain", 1, None), network)).await?;
            test.create(gang("named", 1, None)).await?;
            assert_runs_as_planned(test, "plain").await?;
            assert_runs_as_planned(test, "named").await?;
            let services: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(test.client.clone(), &test.ns);
            ensure!(services.get_opt("plain").await?.is_none(), "no Service for plain");
            ensure!(services.get_opt("named").await?.is_some(), "a Service by default");
            let pod = test.pods().get("plain-workers-0").await?;
            let spec = pod.spec.context("spec")?;
            ensure!(spec.subdomain.is_none(), "{:?}", spec.subdomain);
            let env: Vec<String> = spec.containers[0]
                .env
                .iter()
                .flatten()
                .map(|e| e.name.clone())
                .collect();
            ensure!(!env.iter().any(|e| e == "MASTER_ADDR"), "{env:?}");
            // The spec cannot be changed afterwards.
            let change = test
                .workloads()
                .patch(
                    "plain",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"network": {"enableDNSHostnames": true}}})),
                )
                .await;
            ensure!(change.is_err(), "network is immutable");
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_gang_succeeds_when_its_success_groups_do_and_expires_after_its_ttl() -> Result<()> {
    with_test("success", &[], &[], |test| {
        Box::pin(async move {
            let policy = json!({"successPolicy": {"podGroups": ["launcher"]}, "ttlSecondsAfterFinished": 3});
            test.create(with_policy(gang("job", 2, None), policy)).await?;
            assert_runs_as_planned(test, "job").await?;
            test.exit_pod("job-launcher-0", 0).await?;
            let workload = test
                .wait_phase("job", WorkloadPhase::Succeeded, Duration::from_secs(60))
                .await?;
            let status = workload.status.context("status")?;
            let succeeded = status
                .conditions
                .iter()
                .find(|c| c.type_ == "Succeeded")
                .context("Succeeded")?;
            ensure!(
                succeeded.message.contains("every pod of launcher succeeded"),
                "{}",
                succeeded.message
            );
            // The workers are stopped and every device is given back.
            let pods = test.pods();
            wait::until("the workers to be stopped", Duration::from_secs(60), || {
                let pods = pods.clone();
                async move {
                    let left = pods
                        .list(&ListParams::default().labels("muster.dev/pod-group=workers"))
                        .await?
                        .items;
                    Ok(left.is_empty().then_some(()))
                }
            })
            .await?;
            let claims = test.claims();
            wait::until("the devices to be released", Duration::from_secs(60), || {
                let claims = claims.clone();
                async move { Ok(allocations(&claims).await?.is_empty().then_some(())) }
            })
            .await?;
            // Deleted three seconds after it finished.
            let workloads = test.workloads();
            wait::until("the finished Workload to expire", Duration::from_secs(60), || {
                let workloads = workloads.clone();
                async move { Ok(workloads.get_opt("job").await?.is_none().then_some(())) }
            })
            .await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_failed_pod_restarts_the_gang_on_its_reservation() -> Result<()> {
    with_test("restart", &[], &[], |test| {
        Box::pin(async move {
            test.create(with_policy(
                gang("flaky", 2, None),
                json!({"failurePolicy": {"maxRestarts": 2}}),
            ))
            .await?;
            let before = assert_runs_as_planned(test, "flaky").await?;
            let nodes_before = before.status.and_then(|s| s.placement).context("placement")?.pods;
            let devices_before = devices_by_claim(test).await?;
            test.exit_pod("flaky-workers-1", 1).await?;
            wait_restarts(test, "flaky", 1).await?;
            let after = test
                .wait_phase("flaky", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            let after = assert_runs_as_planned(test, "flaky").await.map(|_| after)?;
            let status = after.status.context("status")?;
            ensure!(
                status.placement.as_ref().context("placement")?.pods == nodes_before,
                "same nodes"
            );
            ensure!(
                devices_by_claim(test).await? == devices_before,
                "same devices: the reservation was reused"
            );
            let restarting = status
                .conditions
                .iter()
                .find(|c| c.type_ == "Restarting")
                .context("Restarting")?;
            ensure!(
                restarting.status == "False" && restarting.reason == "Restarted",
                "{restarting:?}"
            );
            for pod in test.gang_pods("flaky").await? {
                ensure!(
                    pod.metadata.labels.context("labels")?[labels::ATTEMPT] == "1",
                    "new attempt only"
                );
            }
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_lost_node_restarts_the_gang_elsewhere() -> Result<()> {
    with_test("node-lost", &[], &[], |test| {
        Box::pin(async move {
            test.create(with_policy(
                gang("sturdy", 2, None),
                json!({"failurePolicy": {"maxRestarts": 1}}),
            ))
            .await?;
            let before = assert_runs_as_planned(test, "sturdy").await?;
            let placement = before.status.and_then(|s| s.placement).context("placement")?;
            let victim = worker_node(&placement)?;
            let nodes: Api<Node> = Api::all(test.client.clone());
            let node = nodes.get(&victim).await?;
            nodes.delete(&victim, &DeleteParams::default()).await?;
            let result = async {
                wait_restarts(test, "sturdy", 1).await?;
                test.wait_event("sturdy", conditions::EVENT_RESTARTING, &format!("node {victim} of pod"))
                    .await?;
                let after = assert_runs_as_planned(test, "sturdy").await?;
                let placement = after.status.and_then(|s| s.placement).context("placement")?;
                ensure!(
                    !placement.nodes.contains(&victim),
                    "placed again away from {victim}: {:?}",
                    placement.nodes
                );
                Ok(())
            }
            .await;
            // Put the node back for the other tests.
            let mut node = node;
            node.metadata.resource_version = None;
            node.metadata.uid = None;
            node.metadata.creation_timestamp = None;
            nodes.create(&Default::default(), &node).await?;
            result
        })
    })
    .await
}

/// Issue 21, item 4: a restart goes back onto its reservation only where the pods can
/// run. A node tainted `NoExecute` (as the node lifecycle controller taints a NotReady
/// one) is not gone, yet kube-scheduler would refuse the pinned pod: the gang is placed
/// again at once instead of waiting for that refusal.
#[tokio::test]
async fn a_restart_does_not_go_back_onto_a_node_tainted_no_execute() -> Result<()> {
    with_test("tainted-restart", &[], &[], |test| {
        Box::pin(async move {
            test.create(with_policy(
                gang("wary", 2, None),
                json!({"failurePolicy": {"maxRestarts": 1}}),
            ))
            .await?;
            let before = assert_runs_as_planned(test, "wary").await?;
            let placement = before.status.and_then(|s| s.placement).context("placement")?;
            let tainted = worker_node(&placement)?;
            let nodes: Api<Node> = Api::all(test.client.clone());
            let taints = nodes
                .get(&tainted)
                .await?
                .spec
                .and_then(|s| s.taints)
                .unwrap_or_default();
            let mut with_maintenance = serde_json::to_value(&taints)?;
            with_maintenance
                .as_array_mut()
                .context("taints")?
                .push(json!({"key": "example.com/maintenance", "value": "true", "effect": "NoExecute"}));
            nodes
                .patch(
                    &tainted,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"taints": with_maintenance}})),
                )
                .await?;
            let result = async {
                // The taint evicts the pod on it; should it not yet, its failure restarts
                // the gang the same way.
                let on_tainted = test
                    .gang_pods("wary")
                    .await?
                    .into_iter()
                    .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(tainted.as_str()));
                if let Some(pod) = on_tainted {
                    let _ = test.exit_pod(&pod.name_any(), 1).await;
                }
                wait_restarts(test, "wary", 1).await?;
                let after = assert_runs_as_planned(test, "wary").await?;
                let status = after.status.context("status")?;
                let placement = status.placement.context("placement")?;
                ensure!(
                    !placement.nodes.contains(&tainted),
                    "placed again away from {tainted}: {:?}",
                    placement.nodes
                );
                ensure!(
                    status.scheduler_refusals.is_empty(),
                    "no refusal was waited for: {:?}",
                    status.scheduler_refusals
                );
                let restarted = test
                    .wait_event("wary", conditions::EVENT_RESTARTING, "after placing the gang again")
                    .await;
                ensure!(restarted.is_ok(), "the restart placed the gang again: {restarted:?}");
                Ok(())
            }
            .await;
            // The node as it was, for the other tests.
            nodes
                .patch(
                    &tainted,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"taints": taints}})),
                )
                .await?;
            result
        })
    })
    .await
}

/// Issue 21, item 4: a device of the reservation got a `NoExecute` DeviceTaintRule (the
/// device taint controller evicts the pod using it; should it not yet, the pod's failure
/// restarts the gang the same way). The restart does not go back onto the device: the
/// gang is placed again at once, with no refusal waited for.
#[tokio::test]
async fn a_restart_does_not_go_back_onto_a_device_tainted_no_execute_by_a_rule() -> Result<()> {
    with_test("device-tainted-restart", &[], &[], |test| {
        Box::pin(async move {
            test.create(with_policy(
                gang("careful", 2, None),
                json!({"failurePolicy": {"maxRestarts": 1}}),
            ))
            .await?;
            let before = assert_runs_as_planned(test, "careful").await?;
            let placement = before.status.and_then(|s| s.placement).context("placement")?;
            let node = worker_node(&placement)?;
            let rules: Api<DeviceTaintRule> = Api::all(test.client.clone());
            let name = format!("broken-{}", test.ns);
            let rule: DeviceTaintRule = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {
                    "deviceSelector": {"driver": GPU_DRIVER, "pool": node, "device": "gpu-3"},
                    "taint": {"key": "example.com/broken", "value": "true", "effect": "NoExecute"},
                },
            }))?;
            rules.create(&PostParams::default(), &rule).await?;
            let result = async {
                let on_node = test
                    .gang_pods("careful")
                    .await?
                    .into_iter()
                    .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node.as_str()));
                if let Some(pod) = on_node {
                    let _ = test.exit_pod(&pod.name_any(), 1).await;
                }
                wait_restarts(test, "careful", 1).await?;
                let after = assert_runs_as_planned(test, "careful").await?;
                let status = after.status.context("status")?;
                let broken = (node.clone(), "gpu-3".to_string());
                let held = allocations(&test.claims()).await?;
                ensure!(
                    !held.values().flatten().any(|d| *d == broken),
                    "the tainted device {broken:?} was allocated again: {held:?}"
                );
                ensure!(
                    status.scheduler_refusals.is_empty(),
                    "no refusal was waited for: {:?}",
                    status.scheduler_refusals
                );
                let restarted = test
                    .wait_event("careful", conditions::EVENT_RESTARTING, "after placing the gang again")
                    .await;
                ensure!(restarted.is_ok(), "the restart placed the gang again: {restarted:?}");
                Ok(())
            }
            .await;
            rules.delete(&name, &DeleteParams::default()).await?;
            result
        })
    })
    .await
}

#[tokio::test]
async fn a_gang_fails_after_max_restarts_and_gives_everything_back() -> Result<()> {
    with_test("max-restarts", &[], &[], |test| {
        Box::pin(async move {
            test.create(with_policy(
                gang("doomed", 2, None),
                json!({"failurePolicy": {"maxRestarts": 1}}),
            ))
            .await?;
            assert_runs_as_planned(test, "doomed").await?;
            // The first failure is within the budget: the gang runs again.
            test.exit_pod("doomed-workers-1", 1).await?;
            wait_restarts(test, "doomed", 1).await?;
            test.wait_phase("doomed", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            assert_runs_as_planned(test, "doomed").await?;
            // The second is not.
            test.exit_pod("doomed-workers-0", 1).await?;
            let workload = test
                .wait_phase("doomed", WorkloadPhase::Failed, Duration::from_secs(60))
                .await?;
            let status = workload.status.context("status")?;
            let failed = status
                .conditions
                .iter()
                .find(|c| c.type_ == "Failed")
                .context("Failed")?;
            ensure!(failed.reason == "MaxRestartsExceeded", "{failed:?}");
            ensure!(failed.message.contains("doomed-workers-0 failed"), "{}", failed.message);
            ensure!(failed.message.contains("maxRestarts is 1"), "{}", failed.message);
            ensure!(status.restarts == 1, "restarted once, then failed: {}", status.restarts);
            let claims = test.claims();
            wait::until("the devices to be released", Duration::from_secs(60), || {
                let claims = claims.clone();
                async move { Ok(allocations(&claims).await?.is_empty().then_some(())) }
            })
            .await?;
            // Finished is recorded once muster sees every claim free.
            let workloads = test.workloads();
            wait::until("the gang to hold nothing", Duration::from_secs(30), || {
                let workloads = workloads.clone();
                async move {
                    let placement = workloads.get("doomed").await?.status.and_then(|s| s.placement);
                    Ok((placement.and_then(|p| p.state) == Some(AdmissionState::Finished)).then_some(()))
                }
            })
            .await?;
            // The failed pod stays for its logs; nothing runs again.
            let pods: Vec<Pod> = test.gang_pods("doomed").await?;
            ensure!(
                pods.iter()
                    .all(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed")
                        || p.metadata.deletion_timestamp.is_some()),
                "no pod runs"
            );
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn suspend_gives_everything_back_and_resume_runs_the_gang_again() -> Result<()> {
    with_test("suspend", &[], &[], |test| {
        Box::pin(async move {
            test.create(gang("pausable", 2, None)).await?;
            assert_runs_as_planned(test, "pausable").await?;
            let params = PatchParams::default();
            test.workloads()
                .patch("pausable", &params, &Patch::Merge(&json!({"spec": {"suspend": true}})))
                .await?;
            test.wait_phase("pausable", WorkloadPhase::Suspended, Duration::from_secs(60))
                .await?;
            // No pod, no allocation, and no placement left.
            let (pods, claims, workloads) = (test.pods(), test.claims(), test.workloads());
            wait::until("the gang to hold nothing", Duration::from_secs(60), || {
                let (pods, claims, workloads) = (pods.clone(), claims.clone(), workloads.clone());
                async move {
                    let running = pods.list(&ListParams::default()).await?.items;
                    let held = allocations(&claims).await?;
                    let placed = workloads.get("pausable").await?.status.and_then(|s| s.placement);
                    Ok((running.is_empty() && held.is_empty() && placed.is_none()).then_some(()))
                }
            })
            .await?;

            test.workloads()
                .patch("pausable", &params, &Patch::Merge(&json!({"spec": {"suspend": false}})))
                .await?;
            assert_runs_as_planned(test, "pausable").await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_workload_deleted_while_the_operator_is_down_is_cleaned_up_when_it_returns() -> Result<()> {
    with_test("delete-offline", &[], &[], |test| {
        Box::pin(async move {
            test.create(gang("orphan", 2, None)).await?;
            assert_runs_as_planned(test, "orphan").await?;
            if let Some(operator) = test.operator.take() {
                operator.stop();
            }
            test.workloads().delete("orphan", &DeleteParams::default()).await?;
            // The finalizer holds the Workload, and its devices stay reserved, meanwhile.
            let workload = test.workloads().get("orphan").await?;
            ensure!(workload.metadata.deletion_timestamp.is_some());
            ensure!(
                !allocations(&test.claims()).await?.is_empty(),
                "still held while the operator is down"
            );

            test.start_operator(&[], &[])?;
            let (workloads, claims, pods) = (test.workloads(), test.claims(), test.pods());
            wait::until(
                "the Workload, its pods and claims to be gone",
                Duration::from_secs(90),
                || {
                    let (workloads, claims, pods) = (workloads.clone(), claims.clone(), pods.clone());
                    async move {
                        let gone = workloads.get_opt("orphan").await?.is_none()
                            && claims.list(&ListParams::default()).await?.items.is_empty()
                            && pods.list(&ListParams::default()).await?.items.is_empty();
                        Ok(gone.then_some(()))
                    }
                },
            )
            .await?;
            Ok(())
        })
    })
    .await
}

/// The pods of a gang that are bound to a node and running, by name.
async fn running_pods(test: &Test, name: &str) -> Result<BTreeMap<String, Pod>> {
    Ok(test
        .gang_pods(name)
        .await?
        .into_iter()
        .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .map(|p| (p.metadata.name.clone().unwrap_or_default(), p))
        .collect())
}

#[tokio::test]
async fn extras_beyond_min_count_start_when_they_fit_and_their_loss_does_not_restart_the_gang() -> Result<()> {
    with_test("elastic", &[], &[], |test| {
        Box::pin(async move {
            // Two of each rack's four nodes are taken.
            for (blocker, rack) in [("blocker-a", "rack-0000"), ("blocker-b", "rack-0001")] {
                test.create(gang(blocker, 2, Some(rack))).await?;
                assert_runs_as_planned(test, blocker).await?;
            }

            // Four workers, two of them required, in one rack of the gang's choosing: the
            // two extras have no room yet.
            let mut elastic = gang("elastic", 4, None);
            elastic["spec"]["podGroups"][1]["minCount"] = json!(2);
            test.create(elastic).await?;
            let workload = test
                .wait_phase("elastic", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            let placement = workload.status.and_then(|s| s.placement).context("placement")?;
            ensure!(
                placement.pods.len() == 3,
                "launcher and two workers planned: {:?}",
                placement.pods
            );
            let rack = placement.topology_value.clone().context("the gang's rack")?;
            let (own_blocker, other_blocker) = if rack == "rack-0000" {
                ("blocker-a", "blocker-b")
            } else {
                ("blocker-b", "blocker-a")
            };
            let extras_wait = || async {
                let mut gated = true;
                for extra in ["elastic-workers-2", "elastic-workers-3"] {
                    let pod = test.pods().get(extra).await?;
                    gated &= pod
                        .spec
                        .as_ref()
                        .and_then(|s| s.scheduling_gates.as_ref())
                        .is_some_and(|g| !g.is_empty());
                }
                let held = devices_by_claim(test).await?;
                let unheld =
                    !held.contains_key("elastic-workers-2-gpus") && !held.contains_key("elastic-workers-3-gpus");
                Ok::<_, anyhow::Error>(gated && unheld)
            };
            ensure!(
                extras_wait().await?,
                "the extras wait behind their gates, holding nothing"
            );

            // The other rack frees: room for the extras, but outside the gang's rack, so
            // they keep waiting.
            test.workloads().delete(other_blocker, &DeleteParams::default()).await?;
            let claims = test.claims();
            wait::until(
                &format!("{other_blocker}'s devices to be free"),
                Duration::from_secs(60),
                || {
                    let claims = claims.clone();
                    async move {
                        let held = allocations(&claims).await?;
                        Ok((!held.keys().any(|c| c.starts_with(other_blocker))).then_some(()))
                    }
                },
            )
            .await?;
            wait::holds(
                "the extras waiting while only another rack has room",
                Duration::from_secs(5),
                extras_wait,
            )
            .await?;

            // The gang's rack frees: the extras start there, and the gang runs as planned.
            test.workloads().delete(own_blocker, &DeleteParams::default()).await?;
            let shared: &Test = test;
            wait::until("the extras to run", Duration::from_secs(90), || async move {
                Ok((running_pods(shared, "elastic").await?.len() == 5).then_some(()))
            })
            .await?;
            let running = assert_runs_as_planned(test, "elastic").await?;
            let placement = running.status.context("status")?.placement.context("placement")?;
            ensure!(placement.pods.len() == 5, "all planned: {:?}", placement.pods);
            let racks: BTreeMap<String, String> = test
                .cluster
                .nodes
                .iter()
                .map(|n| (n.name.clone(), n.rack.clone()))
                .collect();
            for pod in &placement.pods {
                ensure!(
                    racks[&pod.node] == rack,
                    "{} in {}, the gang's rack is {rack}",
                    pod.name,
                    racks[&pod.node]
                );
            }

            // An extra fails: it is replaced and placed again, and the gang keeps running.
            let failing = test.pods().get("elastic-workers-3").await?.metadata.uid;
            test.exit_pod("elastic-workers-3", 1).await?;
            let shared: &Test = test;
            let failing = &failing;
            wait::until(
                "the failed extra to run again",
                Duration::from_secs(90),
                || async move {
                    let running = running_pods(shared, "elastic").await?;
                    let replaced = running
                        .get("elastic-workers-3")
                        .is_some_and(|p| &p.metadata.uid != failing);
                    Ok((replaced && running.len() == 5).then_some(()))
                },
            )
            .await?;
            let workload = test.workloads().get("elastic").await?;
            let status = workload.status.context("status")?;
            ensure!(
                status.restarts == 0,
                "the gang did not restart: {} restarts",
                status.restarts
            );
            let core = test.pods().get("elastic-workers-0").await?;
            ensure!(
                core.metadata.labels.context("labels")?[labels::ATTEMPT] == "0",
                "the core pods were not replaced"
            );
            assert_runs_as_planned(test, "elastic").await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn a_jobs_pods_join_a_template_less_workload_and_run_as_one_gang() -> Result<()> {
    with_test("job", &[], &[], |test| {
        Box::pin(async move {
            test.create(workload_of_joining_pods("trainers", "workers", 2)).await?;
            let job: Job = serde_json::from_value(job_joining("trainers", "workers", 2))?;
            let jobs: Api<Job> = Api::namespaced(test.client.clone(), &test.ns);
            jobs.create(&PostParams::default(), &job).await?;

            let workload = test
                .wait_phase("trainers", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            let placement = workload.status.and_then(|s| s.placement).context("placement")?;
            ensure!(placement.pods.len() == 2, "both Job pods planned: {:?}", placement.pods);
            let rack = placement.topology_value.clone().context("topology value")?;
            let racks: BTreeMap<String, String> = test
                .cluster
                .nodes
                .iter()
                .map(|n| (n.name.clone(), n.rack.clone()))
                .collect();
            let held = allocations(&test.claims()).await?;
            for planned in &placement.pods {
                let pod = test.pods().get(&planned.name).await?;
                let node = pod.spec.as_ref().and_then(|s| s.node_name.clone()).context("bound")?;
                ensure!(
                    node == planned.node,
                    "{} on {node}, planned {}",
                    planned.name,
                    planned.node
                );
                ensure!(
                    racks[&node] == rack,
                    "{} in {}, the gang's rack is {rack}",
                    planned.name,
                    racks[&node]
                );
                // The claim kube-controller-manager generated holds eight devices of that
                // node, allocated by muster and reserved for the pod.
                let claim_name = pod
                    .status
                    .as_ref()
                    .and_then(|s| s.resource_claim_statuses.as_ref())
                    .and_then(|s| s.first())
                    .and_then(|s| s.resource_claim_name.clone())
                    .context("generated claim")?;
                let devices = held.get(&claim_name).context("claim allocated")?;
                ensure!(
                    devices.len() == 8 && devices.iter().all(|(pool, _)| *pool == node),
                    "{claim_name}: {devices:?}"
                );
                let claim = test.claims().get(&claim_name).await?;
                ensure!(
                    claim.finalizers().iter().any(|f| f == labels::CLAIM_FINALIZER),
                    "allocated by muster: {:?}",
                    claim.metadata.finalizers
                );
                let reserved = claim.status.and_then(|s| s.reserved_for).unwrap_or_default();
                ensure!(
                    reserved.len() == 1 && Some(&reserved[0].uid) == pod.metadata.uid.as_ref(),
                    "{claim_name} reserved for {reserved:?}"
                );
            }

            // The Job's pods complete: the gang succeeds, the Job completes and the
            // devices are given back.
            for planned in &placement.pods {
                test.exit_pod(&planned.name, 0).await?;
            }
            test.wait_phase("trainers", WorkloadPhase::Succeeded, Duration::from_secs(90))
                .await?;
            wait::until("the Job to complete", Duration::from_secs(90), || {
                let jobs = jobs.clone();
                async move {
                    let job = jobs.get("trainers").await?;
                    Ok((job.status.and_then(|s| s.succeeded) == Some(2)).then_some(()))
                }
            })
            .await?;
            let claims = test.claims();
            wait::until("the devices to be released", Duration::from_secs(60), || {
                let claims = claims.clone();
                async move { Ok(allocations(&claims).await?.is_empty().then_some(())) }
            })
            .await?;
            Ok(())
        })
    })
    .await
}

/// Counts, per claim of the namespace, the writes that changed its status, as a watch
/// started at `start` sees them (a watch delivers every change).
struct ClaimStatusWrites {
    counts: std::sync::Arc<std::sync::Mutex<BTreeMap<String, usize>>>,
    watch: tokio::task::JoinHandle<()>,
}

impl ClaimStatusWrites {
    fn start(test: &Test) -> Self {
        use futures::StreamExt;
        use kube::runtime::watcher;
        let counts = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::new()));
        let seen = counts.clone();
        let events = watcher(test.claims(), watcher::Config::default());
        let watch = tokio::spawn(async move {
            let mut last: BTreeMap<String, Value> = BTreeMap::new();
            let mut events = std::pin::pin!(events);
            while let Some(event) = events.next().await {
                let (Ok(watcher::Event::Apply(claim)) | Ok(watcher::Event::InitApply(claim))) = event else {
                    continue;
                };
                let status = serde_json::to_value(&claim.status).unwrap_or_default();
                let name = claim.name_any();
                if last.get(&name).is_some_and(|s| *s != status) {
                    *seen.lock().unwrap().entry(name.clone()).or_insert(0) += 1;
                }
                last.insert(name, status);
            }
        });
        ClaimStatusWrites { counts, watch }
    }

    fn of(&self, claim: &str) -> usize {
        self.counts.lock().unwrap().get(claim).copied().unwrap_or(0)
    }
}

impl Drop for ClaimStatusWrites {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

/// Issue 23: muster writes a claim's allocation and its pod's reservation in one write,
/// so kube-scheduler writes nothing to it; and a claim whose pod succeeded is not
/// rewritten by kube-controller-manager in a loop (it drops the ended pod and reserves it
/// again, kubernetes#141274) until the whole gang ends: every gang, whether it may
/// restart or not, lets kube-controller-manager deallocate the claim in the write that
/// drops the pod (delete-protection, from the pods' release). Before, a gang that may
/// restart kept its claims unprotected, and each was written dozens of times.
#[tokio::test]
async fn a_claim_is_written_once_to_reserve_and_given_back_when_its_pod_succeeds() -> Result<()> {
    with_test("claim-writes", &[], &[], |test| {
        Box::pin(async move {
            test.create(gang("once", 1, None)).await?;
            test.create(with_policy(
                gang("again", 1, None),
                json!({"failurePolicy": {"maxRestarts": 1}}),
            ))
            .await?;
            for gang in ["once", "again"] {
                assert_runs_as_planned(test, gang).await?;
                let pod = test.pods().get(&format!("{gang}-workers-0")).await?;
                let claim = test.claims().get(&format!("{gang}-workers-0-gpus")).await?;
                let reserved: Vec<String> = claim
                    .status
                    .as_ref()
                    .and_then(|s| s.reserved_for.clone())
                    .unwrap_or_default()
                    .into_iter()
                    .map(|r| r.uid)
                    .collect();
                ensure!(reserved == [pod.uid().context("uid")?], "{reserved:?}");
                let status_writers: Vec<String> = claim
                    .metadata
                    .managed_fields
                    .iter()
                    .flatten()
                    .filter(|f| f.subresource.as_deref() == Some("status"))
                    .filter_map(|f| f.manager.clone())
                    .collect();
                ensure!(
                    status_writers == [labels::ADMISSION_FIELD_MANAGER],
                    "only muster wrote the status of {}: {status_writers:?}",
                    claim.name_any()
                );
                let finalizers = claim.finalizers();
                ensure!(
                    finalizers.iter().any(|f| f == labels::DELETE_PROTECTION_FINALIZER),
                    "{gang}: {finalizers:?}"
                );
            }
            let writes = ClaimStatusWrites::start(test);
            // Let the watch list what is there before the pods end.
            tokio::time::sleep(Duration::from_secs(1)).await;
            test.exit_pod("once-workers-0", 0).await?;
            test.exit_pod("again-workers-0", 0).await?;
            for gang in ["once", "again"] {
                let claim = format!("{gang}-workers-0-gpus");
                wait::until(
                    &format!("{claim} to be given back"),
                    Duration::from_secs(30),
                    || async { Ok((!allocations(&test.claims()).await?.contains_key(&claim)).then_some(())) },
                )
                .await?;
            }
            // Given back once: nothing rewrites them afterwards.
            tokio::time::sleep(Duration::from_secs(3)).await;
            let (once, again) = (writes.of("once-workers-0-gpus"), writes.of("again-workers-0-gpus"));
            eprintln!("status writes from the pod's end: {once}, restartable {again}");
            for (gang, writes) in [("once", once), ("again", again)] {
                ensure!(
                    writes <= 2,
                    "kube-controller-manager drops {gang}'s ended pod and deallocates in one write: {writes} writes"
                );
            }
            for gang in ["once", "again"] {
                let state = test.state(gang).await?;
                ensure!(
                    state == Some(AdmissionState::Released),
                    "{gang} runs on, its launcher running: {state:?}"
                );
            }
            Ok(())
        })
    })
    .await
}

/// Issue 35, item 2: kube-controller-manager's write loop on a claim whose ended pod it
/// drops and reserves again (kubernetes#141274), on a claim with mixed consumers: a claim
/// the gang's pods share where one pod succeeded while the other runs on. Its status is
/// written at most 3 times over that time and the gang's end.
///
/// It fails today (about 2,700 writes in 8 s): kube-controller-manager reserves the claim
/// again for any pod bound to a node that references it, ended or not, and takes the ended
/// pod out again, for as long as the claim stays allocated for the other pod. Only the
/// ended pod's deletion stops it, and muster cannot delete a pod it would then make again
/// until it records which members completed.
#[tokio::test]
#[ignore = "open defect, kubernetes#141274: kube-controller-manager re-reserves ended pods on a claim still in use"]
async fn a_shared_claim_some_of_whose_pods_ended_is_not_rewritten_in_a_loop() -> Result<()> {
    with_test("mixed-consumers", &[], &[], |test| {
        Box::pin(async move {
            test.create_claim_template("one-gpu", "gpu", 1).await?;
            // Two pods sharing one node-local device, and a launcher that keeps the gang
            // running once both are done.
            let mut workload = gang("mixed", 0, None);
            workload["spec"]["resourceClaims"] =
                json!([{"name": "fabric", "resourceClaimTemplateName": "one-gpu", "podGroups": ["sharers"]}]);
            workload["spec"]["podGroups"]
                .as_array_mut()
                .context("groups")?
                .push(json!({
                    "name": "sharers",
                    "replicas": 2,
                    "template": {"spec": {"containers": [{
                        "name": "main", "image": "trainer",
                        "resources": {"requests": {"cpu": "16"}, "claims": [{"name": "fabric"}]},
                    }]}},
                }));
            workload["spec"]["podGroups"]
                .as_array_mut()
                .context("groups")?
                .retain(|g| g["name"] != "workers");
            test.create(workload).await?;
            test.wait_phase("mixed", WorkloadPhase::Running, Duration::from_secs(90))
                .await?;
            for pod in ["mixed-sharers-0", "mixed-sharers-1"] {
                test.wait_pod_running(pod).await?;
            }
            let writes = ClaimStatusWrites::start(test);
            tokio::time::sleep(Duration::from_secs(1)).await;
            test.exit_pod("mixed-sharers-0", 0).await?;
            tokio::time::sleep(Duration::from_secs(8)).await;
            let while_one_runs = writes.of("mixed-fabric");
            test.exit_pod("mixed-sharers-1", 0).await?;
            wait::until("the shared claim to be given back", Duration::from_secs(30), || async {
                Ok((!allocations(&test.claims()).await?.contains_key("mixed-fabric")).then_some(()))
            })
            .await?;
            tokio::time::sleep(Duration::from_secs(3)).await;
            let total = writes.of("mixed-fabric");
            eprintln!("status writes of the shared claim: {while_one_runs} while one pod ran, {total} in all");
            ensure!(total <= 3, "the shared claim's status was written {total} times");
            Ok(())
        })
    })
    .await
}
