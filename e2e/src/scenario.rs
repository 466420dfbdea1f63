//! Gang scenarios on the shared local cluster: a namespace and an operator per test, an
//! invariant checker beside it, and cleanup that always runs.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use muster_api::labels;
use muster_api::v1alpha1::{AdmissionState, PlacementStatus, Workload, WorkloadPhase};
use serde_json::{Value, json};

use crate::invariants::Checker;
use crate::testing::{SharedCluster, exclusive, shared_cluster};
use muster_local_cluster::fleet::{FleetSpec, GPU_DRIVER, RACK_LABEL};
use muster_local_cluster::namespaces::{delete_namespace, namespace};
use muster_local_cluster::operator::Operator;
use muster_local_cluster::wait;

/// A Workload of one template-less group `group` of `replicas` pods in one rack: its
/// pods come from another controller (see [`job_joining`]).
pub fn workload_of_joining_pods(name: &str, group: &str, replicas: i32) -> Value {
    json!({
        "apiVersion": "muster.dev/v1alpha1",
        "kind": "Workload",
        "metadata": {"name": name},
        "spec": {"topology": {"required": RACK_LABEL}, "podGroups": [{"name": group, "replicas": replicas}]},
    })
}

/// An Indexed Job whose pods join group `group` of Workload `workload`: gated, labelled,
/// each with an eight-GPU claim from the test's template.
pub fn job_joining(workload: &str, group: &str, pods: i32) -> Value {
    json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": workload},
        "spec": {
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            "backoffLimit": 6,
            "template": {
                "metadata": {"labels": {labels::WORKLOAD: workload, labels::POD_GROUP: group}},
                "spec": {
                    "restartPolicy": "Never",
                    "schedulingGates": [{"name": labels::GANG_GATE}],
                    "containers": [{
                        "name": "main",
                        "image": "trainer",
                        "resources": {"requests": {"cpu": "16", "memory": "64Gi"}, "claims": [{"name": "gpus"}]},
                    }],
                    "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}],
                },
            },
        },
    })
}

/// Two racks of four fenced nodes, eight GPUs and 64 CPUs each.
pub async fn cluster() -> Result<&'static SharedCluster> {
    shared_cluster(
        FleetSpec {
            nodes: 8,
            nodes_per_rack: 4,
            ..FleetSpec::default()
        }
        .fenced(),
    )
    .await
}

/// How long an invariant may stay broken: one commit, or one transition's writes.
pub const COMMIT_WINDOW: Duration = Duration::from_secs(20);

pub struct Test {
    pub client: kube::Client,
    pub ns: String,
    pub operator: Option<Operator>,
    checker: Option<Checker>,
    pub cluster: &'static SharedCluster,
    name: String,
}

impl Test {
    pub async fn start(name: &str, operator_args: &[&str], env: &[(&str, &str)]) -> Result<Self> {
        Self::start_on(cluster().await?, name, operator_args, env).await
    }

    /// [`Test::start`] on another shared cluster than the default one.
    pub async fn start_on(
        cluster: &'static SharedCluster,
        name: &str,
        operator_args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Self> {
        let client = cluster.control_plane.client().await?;
        let ns = namespace(&client, name).await?;
        let checker = Checker::start(client.clone(), COMMIT_WINDOW);
        let mut test = Test {
            client,
            ns,
            operator: None,
            checker: Some(checker),
            cluster,
            name: name.to_string(),
        };
        test.start_operator(operator_args, env)?;
        test.create_claim_template("eight-gpus", "gpus", 8).await?;
        Ok(test)
    }

    /// A ResourceClaimTemplate `name` of the test's namespace: one request `request` of
    /// `gpus` GPUs of the test driver.
    pub async fn create_claim_template(&self, name: &str, request: &str, gpus: u32) -> Result<()> {
        let templates: Api<ResourceClaimTemplate> = Api::namespaced(self.client.clone(), &self.ns);
        let template = json!({
            "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": request, "exactly": {"deviceClassName": GPU_DRIVER, "count": gpus}}]}}},
        });
        templates
            .create(&PostParams::default(), &serde_json::from_value(template)?)
            .await?;
        Ok(())
    }

    pub fn start_operator(&mut self, args: &[&str], env: &[(&str, &str)]) -> Result<()> {
        let operator = self.spawn_operator(self.cluster.control_plane.kubeconfig(), args, env)?;
        self.operator = Some(operator);
        Ok(())
    }

    /// Starts another operator with `kubeconfig`, logging beside the test's others; the
    /// caller owns it.
    pub fn spawn_operator(
        &self,
        kubeconfig: &std::path::Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Operator> {
        static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let logs = self
            .cluster
            .control_plane
            .run_dir()
            .join("logs")
            .join(format!("{}-{run}", self.name));
        Operator::start(kubeconfig, &logs, args, env)
    }

    pub fn workloads(&self) -> Api<Workload> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub fn claims(&self) -> Api<ResourceClaim> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub async fn create(&self, workload: Value) -> Result<()> {
        self.workloads()
            .create(&PostParams::default(), &serde_json::from_value(workload)?)
            .await?;
        Ok(())
    }

    pub async fn wait_phase(&self, name: &str, phase: WorkloadPhase, timeout: Duration) -> Result<Workload> {
        let api = self.workloads();
        let reached = wait::until(&format!("{name} to be {phase:?}"), timeout, || {
            let api = api.clone();
            async move {
                let w = api.get(name).await?;
                Ok(w.status.as_ref().is_some_and(|s| s.phase == Some(phase)).then_some(w))
            }
        })
        .await;
        // Say where it stands instead.
        match reached {
            Ok(w) => Ok(w),
            Err(e) => {
                let status = api.get(name).await.ok().and_then(|w| w.status);
                let seen = status.map(|s| {
                    let conditions: Vec<String> = s
                        .conditions
                        .iter()
                        .map(|c| format!("{}={} {}: {}", c.type_, c.status, c.reason, c.message))
                        .collect();
                    format!("phase {:?}; {}", s.phase, conditions.join("; "))
                });
                let pods = self.gang_pods(name).await.unwrap_or_default();
                let pods: Vec<String> = pods.iter().map(describe_pod).collect();
                Err(e.context(format!(
                    "{name} is at {}; pods: {}",
                    seen.unwrap_or_else(|| "no status".into()),
                    pods.join("; ")
                )))
            }
        }
    }

    /// Waits for the Admitted condition to have `reason`, and returns its message.
    /// Makes a pod's containers exit with `code` (the test kwok stage reads the
    /// annotation).
    pub async fn exit_pod(&self, pod: &str, code: u8) -> Result<()> {
        let patch = json!({"metadata": {"annotations": {"muster-e2e-exit": code.to_string()}}});
        self.pods()
            .patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// Another scheduler's claim `intruder`, written allocated to the first device of the
    /// gang's claim `claim`, as a double allocation the API server does not prevent.
    /// Returns that device as (pool, device).
    pub async fn intrude_on(&self, claim: &str) -> Result<(String, String)> {
        let held = allocations(&self.claims()).await?;
        let (pool, device) = held
            .get(claim)
            .and_then(|d| d.first().cloned())
            .with_context(|| format!("the first device of {claim}"))?;
        let intruder: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": "intruder"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": GPU_DRIVER, "count": 1}}]}},
        }))?;
        self.claims().create(&PostParams::default(), &intruder).await?;
        let allocation = json!({"status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": GPU_DRIVER, "pool": pool, "device": device},
        ]}}}});
        self.claims()
            .patch_status("intruder", &PatchParams::default(), &Patch::Merge(&allocation))
            .await?;
        Ok((pool, device))
    }

    /// Waits until the `Admitted` condition of `name` has not changed for `seconds`.
    pub async fn wait_admitted_unchanged_for(&self, name: &str, seconds: f64) -> Result<()> {
        let api = self.workloads();
        wait::until(
            &format!("{name} to have waited {seconds} s"),
            Duration::from_secs(30),
            || {
                let api = api.clone();
                async move {
                    let w = api.get(name).await?;
                    let since = w
                        .status
                        .unwrap_or_default()
                        .conditions
                        .into_iter()
                        .find(|c| c.type_ == "Admitted")
                        .map(|c| c.last_transition_time.0);
                    let waited = since.map(|t| k8s_openapi::jiff::Timestamp::now().duration_since(t).as_secs_f64());
                    Ok(waited.filter(|w| *w > seconds).map(|_| ()))
                }
            },
        )
        .await
    }

    /// Waits until `name` is `Finished` and no claim of the namespace is allocated.
    pub async fn wait_finished_holding_nothing(&self, name: &str) -> Result<()> {
        let (claims, workloads) = (self.claims(), self.workloads());
        wait::until(
            &format!("{name} to be finished and hold nothing"),
            Duration::from_secs(60),
            || {
                let (claims, workloads) = (claims.clone(), workloads.clone());
                async move {
                    let held = allocations(&claims).await?;
                    let state = workloads
                        .get(name)
                        .await?
                        .status
                        .and_then(|s| s.placement)
                        .and_then(|p| p.state);
                    Ok((held.is_empty() && state == Some(AdmissionState::Finished)).then_some(()))
                }
            },
        )
        .await
    }

    pub async fn wait_admitted_reason(&self, name: &str, reason: &str, timeout: Duration) -> Result<String> {
        let api = self.workloads();
        wait::until(&format!("{name}'s Admitted reason to be {reason}"), timeout, || {
            let api = api.clone();
            async move {
                let w = api.get(name).await?;
                let condition = w
                    .status
                    .unwrap_or_default()
                    .conditions
                    .into_iter()
                    .find(|c| c.type_ == "Admitted");
                Ok(condition.filter(|c| c.reason == reason).map(|c| c.message))
            }
        })
        .await
    }

    /// Waits for an event about Workload `name` with `reason` whose note contains
    /// `note_part`, and returns the note.
    pub async fn wait_event(&self, name: &str, reason: &str, note_part: &str) -> Result<String> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), &self.ns);
        wait::until(
            &format!("an event {reason} about {name} saying {note_part:?}"),
            Duration::from_secs(30),
            || {
                let events = events.clone();
                async move {
                    Ok(events
                        .list(&ListParams::default())
                        .await?
                        .items
                        .into_iter()
                        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
                        .filter(|e| e.reason.as_deref() == Some(reason))
                        .filter_map(|e| e.note)
                        .find(|note| note.contains(note_part)))
                }
            },
        )
        .await
    }

    /// Waits until kube-scheduler finds pod `name` unschedulable, and returns why.
    pub async fn wait_unschedulable(&self, name: &str) -> Result<String> {
        let pods = self.pods();
        wait::until(
            &format!("{name} to be found unschedulable"),
            Duration::from_secs(60),
            || {
                let pods = pods.clone();
                async move {
                    let pod = pods.get(name).await?;
                    let conditions = pod.status.and_then(|s| s.conditions).unwrap_or_default();
                    let scheduled = conditions.into_iter().find(|c| c.type_ == "PodScheduled");
                    Ok(scheduled
                        .filter(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
                        .map(|c| c.message.unwrap_or_default()))
                }
            },
        )
        .await
    }

    pub async fn gang_claims(&self, name: &str) -> Result<Vec<ResourceClaim>> {
        let selector = ListParams::default().labels(&format!("{}={name}", labels::WORKLOAD));
        Ok(self.claims().list(&selector).await?.items)
    }

    /// Waits until no claim is left in the test's namespace (the operator must run).
    pub async fn wait_claims_gone(&self) -> Result<()> {
        wait::until_none_left("the test's claims to be gone", Duration::from_secs(90), &self.claims()).await
    }

    pub async fn gang_pods(&self, name: &str) -> Result<Vec<Pod>> {
        let selector = ListParams::default().labels(&format!("{}={name}", labels::WORKLOAD));
        Ok(self.pods().list(&selector).await?.items)
    }

    /// Deletes every Workload (and Job: their pods may hold claims muster allocated) and
    /// every claim, and waits until the claims are deallocated and gone (the operator must run for that),
    /// then stops the operator and the checker and fails on any invariant violation.
    /// Every step runs even when one fails, so a failed test leaves nothing behind that
    /// would hold devices in the next one.
    pub async fn finish(mut self) -> Result<()> {
        let mut problems: Vec<anyhow::Error> = Vec::new();
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &self.ns);
        let background = DeleteParams::background();
        if let Err(e) = jobs.delete_collection(&background, &ListParams::default()).await {
            problems.push(anyhow::Error::new(e).context("deleting the test's Jobs"));
        }
        // One at a time: the chart's policy refuses to delete the running gang of a job on
        // its own, and the garbage collector deletes that one with its job (above).
        match self.workloads().list(&ListParams::default()).await {
            Ok(list) => {
                for workload in list.items {
                    let name = workload.metadata.name.unwrap_or_default();
                    match self.workloads().delete(&name, &DeleteParams::default()).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(e)) if e.code == 404 || e.message.contains("is the running gang of") => {}
                        Err(e) => problems.push(anyhow::Error::new(e).context(format!("deleting Workload {name}"))),
                    }
                }
            }
            Err(e) => problems.push(anyhow::Error::new(e).context("listing the test's Workloads")),
        }
        // Claims the test made itself (a user's, shared by gangs) go too; muster clears
        // what it allocated on them once no pod uses them.
        if let Err(e) = self
            .claims()
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await
        {
            problems.push(anyhow::Error::new(e).context("deleting the test's claims"));
        }
        if let Err(e) = self.wait_claims_gone().await {
            problems.push(e);
        }
        if let Some(operator) = self.operator.take() {
            operator.stop();
        }
        let violations = self.checker.take().map(Checker::finish).unwrap_or_default();
        if let Err(e) = delete_namespace(&self.client, &self.ns).await {
            problems.push(e.context("deleting the test's namespace"));
        }
        if !violations.is_empty() {
            problems.push(anyhow::anyhow!("invariant violations: {violations:#?}"));
        }
        let problems: Vec<String> = problems.iter().map(|p| format!("{p:#}")).collect();
        ensure!(
            problems.is_empty(),
            "cleaning up after {}: {}",
            self.name,
            problems.join("; ")
        );
        Ok(())
    }
}

/// A pod in a line: node, phase, gates and why it is not scheduled, for failure messages.
fn describe_pod(pod: &Pod) -> String {
    let spec = pod.spec.clone().unwrap_or_default();
    let status = pod.status.clone().unwrap_or_default();
    let gates: Vec<String> = spec
        .scheduling_gates
        .unwrap_or_default()
        .into_iter()
        .map(|g| g.name)
        .collect();
    let scheduled = status
        .conditions
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "PodScheduled")
        .map(|c| format!("{} {}", c.reason.unwrap_or_default(), c.message.unwrap_or_default()));
    format!(
        "{} node={:?} phase={:?} gates={gates:?} scheduled={scheduled:?}",
        pod.metadata.name.as_deref().unwrap_or_default(),
        spec.node_name,
        status.phase
    )
}

/// Runs `body` on a fresh test namespace and operator, and always cleans up after it,
/// so a failing test does not leave devices allocated for the next one.
pub async fn with_test<F>(name: &str, args: &[&str], env: &[(&str, &str)], body: F) -> Result<()>
where
    F: for<'a> FnOnce(&'a mut Test) -> futures::future::BoxFuture<'a, Result<()>>,
{
    let _serial = exclusive().await;
    let mut test = Test::start(name, args, env).await?;
    let outcome = body(&mut test).await;
    // What the operator did last says most about a failure seen only elsewhere (CI).
    let outcome = outcome.map_err(|e| match test.operator.as_ref() {
        Some(operator) => e.context(format!(
            "failed; the operator's last log lines:\n{}",
            log_tail(&operator.log(), OPERATOR_LOG_TAIL)
        )),
        None => e,
    });
    let cleanup = test.finish().await;
    outcome.and(cleanup)
}

/// How many lines of the operator's log a failed test shows.
const OPERATOR_LOG_TAIL: usize = 60;

/// The last `lines` lines of `log`, without terminal colours.
pub fn log_tail(log: &str, lines: usize) -> String {
    let all: Vec<&str> = log.lines().collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|line| strip_colours(line))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `line` without ANSI colour sequences (ESC [ ... m).
fn strip_colours(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A launcher (2 CPU, no devices) and `workers` pods with eight GPUs and 16 CPUs each, in
/// one rack; `rack` pins the gang to one rack by node selector.
pub fn gang(name: &str, workers: i32, rack: Option<&str>) -> Value {
    let node_selector = rack.map(|r| json!({RACK_LABEL: r})).unwrap_or(json!({}));
    json!({
        "apiVersion": "muster.dev/v1alpha1",
        "kind": "Workload",
        "metadata": {"name": name},
        "spec": {
            "topology": {"required": RACK_LABEL},
            "podGroups": [
                {
                    "name": "launcher",
                    "replicas": 1,
                    "template": {"spec": {
                        "nodeSelector": node_selector,
                        "containers": [{"name": "main", "image": "launcher", "resources": {"requests": {"cpu": "2"}}}],
                    }},
                },
                {
                    "name": "workers",
                    "replicas": workers,
                    "template": {"spec": {
                        "nodeSelector": node_selector,
                        "containers": [{
                            "name": "main",
                            "image": "trainer",
                            "resources": {"requests": {"cpu": "16", "memory": "64Gi"}, "claims": [{"name": "gpus"}]},
                        }],
                        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}],
                    }},
                },
            ],
        },
    })
}

/// The node planned for the gang's first worker.
pub fn worker_node(placement: &PlacementStatus) -> Result<String> {
    Ok(placement
        .pods
        .iter()
        .find(|p| p.name.contains("workers"))
        .context("a planned worker")?
        .node
        .clone())
}

/// Every device of every allocated claim in the namespace, by claim.
pub async fn allocations(claims: &Api<ResourceClaim>) -> Result<BTreeMap<String, Vec<(String, String)>>> {
    let mut out = BTreeMap::new();
    for claim in claims.list(&ListParams::default()).await?.items {
        if let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) {
            let devices = allocation
                .devices
                .iter()
                .flat_map(|d| d.results.iter().flatten())
                .map(|r| (r.pool.clone(), r.device.clone()))
                .collect();
            out.insert(claim.metadata.name.clone().unwrap_or_default(), devices);
        }
    }
    Ok(out)
}

/// The gang runs as planned: every pod on its planned node, every claim allocated on
/// that node and reserved for its pod, all in one rack. Checked on one read of
/// everything, until it holds or 90 s pass: `phase` is a summary written apart from the
/// placement, and may still say Running for a moment while the placement moved on (the
/// operator killed before it wrote the phase, and not yet back).
pub async fn assert_runs_as_planned(test: &Test, name: &str) -> Result<Workload> {
    test.wait_phase(name, WorkloadPhase::Running, Duration::from_secs(90))
        .await?;
    let what = format!("{name} to run as planned");
    wait::until(&what, Duration::from_secs(90), || async {
        let workload = test.workloads().get(name).await?;
        if workload.status.as_ref().and_then(|s| s.phase) != Some(WorkloadPhase::Running) {
            anyhow::bail!(
                "{name} is at phase {:?}",
                workload.status.as_ref().and_then(|s| s.phase)
            );
        }
        runs_as_planned_now(test, name, workload).await.map(Some)
    })
    .await
}

/// Whether `workload`, just read at phase Running, runs as planned now.
async fn runs_as_planned_now(test: &Test, name: &str, workload: Workload) -> Result<Workload> {
    let placement = workload
        .status
        .as_ref()
        .and_then(|s| s.placement.clone())
        .context("placement")?;
    ensure!(
        placement.state == Some(AdmissionState::Released),
        "state {:?}",
        placement.state
    );
    let planned: BTreeMap<String, String> = placement
        .pods
        .iter()
        .map(|p| (p.name.clone(), p.node.clone()))
        .collect();
    let pods = test.gang_pods(name).await?;
    ensure!(
        pods.len() == planned.len(),
        "{} pods, {} planned",
        pods.len(),
        planned.len()
    );
    let nodes = test
        .cluster
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.rack.clone()))
        .collect::<BTreeMap<_, _>>();
    let mut racks = BTreeSet::new();
    for pod in &pods {
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone()).context("bound")?;
        ensure!(
            planned.get(&pod_name) == Some(&node),
            "{pod_name} on {node}, planned {:?}",
            planned.get(&pod_name)
        );
        racks.insert(nodes[&node].clone());
    }
    ensure!(racks.len() == 1, "one rack, got {racks:?}");
    ensure!(
        placement.topology_value.as_ref() == racks.first(),
        "topology value {:?}",
        placement.topology_value
    );
    let claims = test.gang_claims(name).await?;
    ensure!(
        claims.len() == placement.claims.len(),
        "claims {} vs planned {}",
        claims.len(),
        placement.claims.len()
    );
    for claim in &claims {
        let claim_name = claim.metadata.name.clone().unwrap_or_default();
        let status = claim.status.as_ref().context("claim status")?;
        let allocation = status.allocation.as_ref().context("allocated")?;
        ensure!(allocation.allocation_timestamp.is_some(), "allocationTimestamp written");
        ensure!(
            claim
                .metadata
                .finalizers
                .iter()
                .flatten()
                .any(|f| f == labels::CLAIM_FINALIZER),
            "{claim_name} allocated by muster, which keeps its finalizer on it"
        );
        let pod_name = claim_name.trim_end_matches("-gpus");
        let node = &planned[pod_name];
        let results = allocation
            .devices
            .as_ref()
            .and_then(|d| d.results.clone())
            .unwrap_or_default();
        ensure!(results.len() == 8, "{claim_name}: {} devices", results.len());
        ensure!(
            results.iter().all(|r| &r.pool == node),
            "{claim_name}: devices on {node}"
        );
        let reserved = status.reserved_for.clone().unwrap_or_default();
        let pod = pods
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(pod_name))
            .context("pod")?;
        ensure!(
            reserved.len() == 1 && Some(&reserved[0].uid) == pod.metadata.uid.as_ref(),
            "{claim_name} reserved for {reserved:?}"
        );
    }
    Ok(workload)
}

/// PriorityClasses the tests rank gangs with (cluster-scoped, kept once made): a low,
/// a middle and a high class that preempt, and a high one that never does.
pub const LOW: &str = "muster-e2e-low";
pub const MID: &str = "muster-e2e-mid";
pub const HIGH: &str = "muster-e2e-high";
pub const NEVER: &str = "muster-e2e-never";

/// Makes the PriorityClasses [`LOW`], [`MID`], [`HIGH`] and [`NEVER`] if missing.
pub async fn priority_classes(client: &kube::Client) -> Result<()> {
    let classes: Api<k8s_openapi::api::scheduling::v1::PriorityClass> = Api::all(client.clone());
    for (name, value, policy) in [
        (LOW, 100, "PreemptLowerPriority"),
        (MID, 500, "PreemptLowerPriority"),
        (HIGH, 1000, "PreemptLowerPriority"),
        (NEVER, 1000, "Never"),
    ] {
        let class = serde_json::from_value(json!({
            "metadata": {"name": name},
            "value": value,
            "preemptionPolicy": policy,
        }))?;
        match classes.create(&PostParams::default(), &class).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// `workload` with PriorityClass `class`.
pub fn ranked(mut workload: Value, class: &str) -> Value {
    workload["spec"]["priorityClassName"] = json!(class);
    workload
}

/// `workload` whose pods take `seconds` to stop once deleted.
pub fn terminating_for(mut workload: Value, seconds: u32) -> Value {
    for group in workload["spec"]["podGroups"].as_array_mut().into_iter().flatten() {
        group["template"]["metadata"]["annotations"]["muster-e2e-terminate-after"] = json!(format!("{seconds}s"));
    }
    workload
}

/// A ResourceClaim of `gpus` GPUs made by the user, not by muster.
pub fn user_claim(name: &str, gpus: u32) -> Result<ResourceClaim> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": GPU_DRIVER, "count": gpus}}]}},
    }))?)
}

/// `workload` whose group `group` also shares the existing claim `claim` (named
/// `shared` in its pods).
pub fn sharing_claim(mut workload: Value, group: &str, claim: &str) -> Value {
    for g in workload["spec"]["podGroups"].as_array_mut().into_iter().flatten() {
        if g["name"] == group {
            let container = &mut g["template"]["spec"]["containers"][0]["resources"]["claims"];
            if !container.is_array() {
                *container = json!([]);
            }
            if let Some(claims) = container.as_array_mut() {
                claims.push(json!({"name": "shared"}));
            }
        }
    }
    let claims = &mut workload["spec"]["resourceClaims"];
    if !claims.is_array() {
        *claims = json!([]);
    }
    if let Some(claims) = claims.as_array_mut() {
        claims.push(json!({"name": "shared", "resourceClaimName": claim, "podGroups": [group]}));
    }
    workload
}

/// A gang of `pods` pods of 16 CPUs with no devices of their own, sharing the existing
/// claim `claim`: all its pods go where the claim's device is. `rack` pins it.
pub fn claim_sharers(name: &str, pods: i32, claim: &str, rack: Option<&str>) -> Value {
    let node_selector = rack.map(|r| json!({RACK_LABEL: r})).unwrap_or(json!({}));
    let workload = json!({
        "apiVersion": "muster.dev/v1alpha1",
        "kind": "Workload",
        "metadata": {"name": name},
        "spec": {
            "topology": {"required": RACK_LABEL},
            "podGroups": [{
                "name": "workers",
                "replicas": pods,
                "template": {"spec": {
                    "nodeSelector": node_selector,
                    "containers": [{"name": "main", "image": "trainer", "resources": {"requests": {"cpu": "16"}}}],
                }},
            }],
        },
    });
    sharing_claim(workload, "workers", claim)
}

/// A pod outside any gang that uses the existing claim `claim` (kube-scheduler puts it
/// where the claim's device is; it tolerates the fence).
pub fn outside_user(name: &str, claim: &str) -> Result<Pod> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "containers": [{"name": "main", "image": "tool", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "tolerations": [{"key": labels::FENCE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
        },
    }))?)
}

impl Test {
    /// Waits until `name` has a nomination, and returns its victims.
    pub async fn wait_nomination(&self, name: &str) -> Result<Vec<String>> {
        let api = self.workloads();
        wait::until(&format!("{name}'s nomination"), Duration::from_secs(60), || {
            let api = api.clone();
            async move {
                let w = api.get(name).await?;
                Ok(w.status.and_then(|s| s.nomination).map(|n| n.victims))
            }
        })
        .await
    }

    /// Waits until claim `claim` carries the label of Workload `workload`.
    pub async fn wait_claim_joined(&self, claim: &str, workload: &str) -> Result<()> {
        let api = self.claims();
        wait::until(&format!("{claim} to join {workload}"), Duration::from_secs(60), || {
            let api = api.clone();
            async move {
                let c = api.get(claim).await?;
                let label = c.metadata.labels.unwrap_or_default().get(labels::WORKLOAD).cloned();
                Ok((label.as_deref() == Some(workload)).then_some(()))
            }
        })
        .await
    }

    /// Waits until pod `name` runs, and returns its uid and node.
    pub async fn wait_pod_running(&self, name: &str) -> Result<(String, String)> {
        let pods = self.pods();
        wait::until(&format!("{name} to run"), Duration::from_secs(60), || {
            let pods = pods.clone();
            async move {
                let pod = pods.get(name).await?;
                let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
                Ok(node
                    .filter(|_| running)
                    .map(|n| (pod.metadata.uid.clone().unwrap_or_default(), n)))
            }
        })
        .await
    }

    /// Waits until the operator reached its pause point `point` (`MUSTER_PAUSE_POINT`).
    pub async fn wait_paused(&self, point: &str) -> Result<()> {
        let operator = self.operator.as_ref().context("operator")?;
        let line = format!("pause point {point} reached");
        wait::until(
            &format!("the operator to pause {point}"),
            Duration::from_secs(60),
            || {
                let reached = operator.log().contains(&line);
                async move { Ok(reached.then_some(())) }
            },
        )
        .await
    }

    /// Takes node `node`'s CPUs with a pod `name` bound there directly, and waits until
    /// it runs: a pod released onto the node is then not bound until it goes.
    pub async fn block_cpus(&self, name: &str, node: &str) -> Result<()> {
        let blocker: Pod = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "nodeName": node,
                "containers": [{"name": "main", "image": "tool", "resources": {"requests": {"cpu": "50"}}}],
            },
        }))?;
        self.pods().create(&PostParams::default(), &blocker).await?;
        self.wait_pod_running(name).await?;
        Ok(())
    }

    /// The placement state of `name` (`None`: queued).
    pub async fn state(&self, name: &str) -> Result<Option<AdmissionState>> {
        Ok(self
            .workloads()
            .get(name)
            .await?
            .status
            .and_then(|s| s.placement)
            .and_then(|p| p.state))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_tests_log_tail_is_its_last_lines_without_colours() {
        let log = "one\n\u{1b}[2mtwo\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m x\nthree";
        assert_eq!(log_tail(log, 2), "two  INFO x\nthree");
        assert_eq!(log_tail(log, 10), "one\ntwo  INFO x\nthree");
    }
}
