//! The Workload API and controller on a real control plane: schema validation by the
//! API server, the gated pods, claims and Service the operator creates, deletion, and
//! restarts of the operator.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use muster_api::labels;
use muster_api::v1alpha1::{Workload, WorkloadPhase};
use muster_e2e::testing::{SharedCluster, delete_namespace, exclusive, namespace, shared_cluster};
use muster_local_cluster::fleet::{FleetSpec, GPU_DRIVER};
use muster_local_cluster::operator::Operator;
use muster_local_cluster::wait;
use serde_json::{Value, json};

async fn cluster() -> Result<&'static SharedCluster> {
    shared_cluster(FleetSpec::with_nodes(2)).await
}

fn start_operator(cluster: &SharedCluster, test: &str) -> Result<Operator> {
    let logs = cluster.control_plane.run_dir().join("logs").join(test);
    Operator::start(cluster.control_plane.kubeconfig(), &logs, &[], &[])
}

fn training_workload(name: &str) -> Value {
    json!({
        "apiVersion": "muster.dev/v1alpha1",
        "kind": "Workload",
        "metadata": {"name": name},
        "spec": {
            "podGroups": [
                {
                    "name": "launcher",
                    "replicas": 1,
                    "template": {"spec": {"containers": [{"name": "main", "image": "busybox"}]}},
                },
                {
                    "name": "workers",
                    "replicas": 2,
                    "template": {
                        "metadata": {"labels": {"app": "trainer"}},
                        "spec": {
                            "containers": [{
                                "name": "main",
                                "image": "busybox",
                                "resources": {"claims": [{"name": "gpus"}, {"name": "fabric"}]},
                            }],
                            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "two-gpus"}],
                        },
                    },
                },
            ],
            "resourceClaims": [{"name": "fabric", "resourceClaimTemplateName": "one-gpu", "podGroups": ["workers"]}],
        },
    })
}

async fn create_templates(client: &kube::Client, ns: &str) -> Result<()> {
    let api: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), ns);
    for (name, count) in [("two-gpus", 2), ("one-gpu", 1)] {
        let template = json!({
            "metadata": {"name": name},
            "spec": {"metadata": {"labels": {"from-template": name}}, "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": GPU_DRIVER, "count": count}}]}}},
        });
        api.create(&PostParams::default(), &serde_json::from_value(template)?)
            .await?;
    }
    Ok(())
}

async fn create_workload(client: &kube::Client, ns: &str, value: Value) -> Result<Workload> {
    let api: Api<Workload> = Api::namespaced(client.clone(), ns);
    Ok(api
        .create(&PostParams::default(), &serde_json::from_value(value)?)
        .await?)
}

/// Waits until the Workload reports that all its objects exist.
async fn wait_for_created(client: &kube::Client, ns: &str, name: &str) -> Result<Workload> {
    let api: Api<Workload> = Api::namespaced(client.clone(), ns);
    wait::until(
        &format!("Workload {name} to have all its objects"),
        Duration::from_secs(60),
        || {
            let api = api.clone();
            async move {
                let w = api.get(name).await?;
                let status = w.status.clone().unwrap_or_default();
                let created = status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Created" && c.status == "True");
                let counted = status.pod_groups.iter().all(|g| g.created == g.replicas);
                Ok((created && counted && status.observed_generation == w.metadata.generation).then_some(w))
            }
        },
    )
    .await
}

/// The training workload with a topology no node has: it stays queued, pods gated.
fn unplaceable(name: &str) -> Value {
    let mut w = training_workload(name);
    w["spec"]["topology"] = json!({"required": "example.com/no-such-label"});
    w
}

fn selector(name: &str) -> ListParams {
    ListParams::default().labels(&format!("{}={name}", labels::WORKLOAD))
}

async fn gang_pods(client: &kube::Client, ns: &str, name: &str) -> Result<Vec<Pod>> {
    Ok(Api::<Pod>::namespaced(client.clone(), ns)
        .list(&selector(name))
        .await?
        .items)
}

async fn gang_claims(client: &kube::Client, ns: &str, name: &str) -> Result<Vec<ResourceClaim>> {
    Ok(Api::<ResourceClaim>::namespaced(client.clone(), ns)
        .list(&selector(name))
        .await?
        .items)
}

fn names<K: kube::Resource>(objects: &[K]) -> Vec<String> {
    let mut names: Vec<String> = objects.iter().filter_map(|o| o.meta().name.clone()).collect();
    names.sort();
    names
}

fn uids<K: kube::Resource>(objects: &[K]) -> BTreeMap<String, String> {
    objects
        .iter()
        .map(|o| {
            (
                o.meta().name.clone().unwrap_or_default(),
                o.meta().uid.clone().unwrap_or_default(),
            )
        })
        .collect()
}

#[tokio::test]
async fn workload_yields_gated_pods_claims_and_service() -> Result<()> {
    let cluster = cluster().await?;
    let _serial = exclusive().await;
    let client = cluster.control_plane.client().await?;
    let ns = namespace(&client, "gang").await?;
    let operator = start_operator(cluster, "gang")?;
    create_templates(&client, &ns).await?;
    let created = create_workload(&client, &ns, unplaceable("llama")).await?;

    wait_for_created(&client, &ns, "llama").await?;
    let api: Api<Workload> = Api::namespaced(client.clone(), &ns);
    let workload = wait::until(
        "the gang to be queued as unschedulable",
        Duration::from_secs(60),
        || {
            let api = api.clone();
            async move {
                let w = api.get("llama").await?;
                let queued = w
                    .status
                    .as_ref()
                    .is_some_and(|s| s.phase == Some(WorkloadPhase::Queued))
                    && w.status.as_ref().is_some_and(|s| {
                        s.conditions
                            .iter()
                            .any(|c| c.type_ == "Admitted" && c.reason == "Unschedulable")
                    });
                Ok(queued.then_some(w))
            }
        },
    )
    .await?;
    let status = workload.status.clone().context("status")?;
    assert_eq!((status.pods, status.ready_pods, status.restarts), (3, 0, 0));
    let admitted = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Admitted")
        .context("Admitted")?;
    assert_eq!(admitted.status, "False");
    assert!(
        admitted.message.contains("no example.com/no-such-label label"),
        "{}",
        admitted.message
    );
    assert!(status.placement.is_none(), "nothing reserved");

    let pods = gang_pods(&client, &ns, "llama").await?;
    assert_eq!(names(&pods), ["llama-launcher-0", "llama-workers-0", "llama-workers-1"]);
    for pod in &pods {
        let spec = pod.spec.as_ref().context("pod spec")?;
        let gates: Vec<&str> = spec
            .scheduling_gates
            .iter()
            .flatten()
            .map(|g| g.name.as_str())
            .collect();
        assert_eq!(gates, [labels::GANG_GATE], "{:?} is gated", pod.metadata.name);
        assert!(spec.node_name.is_none(), "a gated pod is not bound");
        let owner = &pod.metadata.owner_references.as_ref().context("owner")?[0];
        assert_eq!(Some(&owner.uid), created.metadata.uid.as_ref());
        assert_eq!(spec.subdomain.as_deref(), Some("llama"));
        assert_eq!(spec.hostname.as_deref(), pod.metadata.name.as_deref());
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        assert_eq!(phase, Some("Pending"));
    }
    let worker = pods
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some("llama-workers-1"))
        .context("worker 1")?;
    let worker_labels = worker.metadata.labels.clone().unwrap_or_default();
    assert_eq!(worker_labels[labels::POD_GROUP], "workers");
    assert_eq!(worker_labels[labels::POD_INDEX], "1");
    assert_eq!(worker_labels["app"], "trainer");
    let refs: Vec<(String, Option<String>)> = worker
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|c| (c.name, c.resource_claim_name))
        .collect();
    assert_eq!(
        refs,
        [
            ("gpus".to_string(), Some("llama-workers-1-gpus".to_string())),
            ("fabric".into(), Some("llama-fabric".into()))
        ]
    );

    let claims = gang_claims(&client, &ns, "llama").await?;
    assert_eq!(
        names(&claims),
        ["llama-fabric", "llama-workers-0-gpus", "llama-workers-1-gpus"]
    );
    for claim in &claims {
        assert!(
            claim.status.as_ref().and_then(|s| s.allocation.as_ref()).is_none(),
            "nothing is allocated"
        );
        assert_eq!(
            claim.metadata.finalizers.clone().unwrap_or_default(),
            ["muster.dev/allocation"]
        );
        let owner = &claim.metadata.owner_references.as_ref().context("owner")?[0];
        assert_eq!((owner.kind.as_str(), owner.name.as_str()), ("Workload", "llama"));
    }
    let fabric = claims
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some("llama-fabric"))
        .context("fabric")?;
    let request = &fabric
        .spec
        .as_ref()
        .and_then(|s| s.devices.clone())
        .and_then(|d| d.requests)
        .context("requests")?[0];
    assert_eq!(request.exactly.as_ref().and_then(|e| e.count), Some(1));
    assert_eq!(
        fabric.metadata.labels.as_ref().context("labels")?["from-template"],
        "one-gpu"
    );

    let service = Api::<Service>::namespaced(client.clone(), &ns).get("llama").await?;
    let spec = service.spec.context("service spec")?;
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
    assert_eq!(spec.selector.context("selector")?[labels::WORKLOAD], "llama");

    let events = Api::<Event>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await?
        .items;
    let created_event = events
        .iter()
        .find(|e| {
            e.reason.as_deref() == Some("Created")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("llama")
        })
        .context("a Created event for the Workload")?;
    assert!(
        created_event.note.as_deref().unwrap_or_default().contains("3 pods"),
        "{:?}",
        created_event.note
    );

    operator.stop();
    delete_namespace(&client, &ns).await
}

#[tokio::test]
async fn missing_template_is_reported_and_then_picked_up() -> Result<()> {
    let cluster = cluster().await?;
    let _serial = exclusive().await;
    let client = cluster.control_plane.client().await?;
    let ns = namespace(&client, "late-template").await?;
    let operator = start_operator(cluster, "late-template")?;
    create_workload(&client, &ns, training_workload("late")).await?;

    let api: Api<Workload> = Api::namespaced(client.clone(), &ns);
    let message = wait::until("the missing template to be reported", Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let w = api.get("late").await?;
            let condition = w
                .status
                .unwrap_or_default()
                .conditions
                .into_iter()
                .find(|c| c.type_ == "Created");
            Ok(condition
                .filter(|c| c.reason == "ResourceClaimTemplateNotFound")
                .map(|c| c.message))
        }
    })
    .await?;
    assert!(message.contains("two-gpus") || message.contains("one-gpu"), "{message}");

    create_templates(&client, &ns).await?;
    wait_for_created(&client, &ns, "late").await?;
    assert_eq!(gang_claims(&client, &ns, "late").await?.len(), 3);

    operator.stop();
    delete_namespace(&client, &ns).await
}

#[tokio::test]
async fn deleting_a_workload_removes_what_it_created() -> Result<()> {
    let cluster = cluster().await?;
    let _serial = exclusive().await;
    let client = cluster.control_plane.client().await?;
    let ns = namespace(&client, "delete").await?;
    let operator = start_operator(cluster, "delete")?;
    create_templates(&client, &ns).await?;
    create_workload(&client, &ns, training_workload("doomed")).await?;
    wait_for_created(&client, &ns, "doomed").await?;
    // It fits: claims get allocated and pods run; deletion must undo all of it.
    let api: Api<Workload> = Api::namespaced(client.clone(), &ns);
    wait::until("the gang to run", Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let w = api.get("doomed").await?;
            Ok(w.status
                .is_some_and(|s| s.phase == Some(WorkloadPhase::Running))
                .then_some(()))
        }
    })
    .await?;

    Api::<Workload>::namespaced(client.clone(), &ns)
        .delete("doomed", &DeleteParams::foreground())
        .await?;
    wait::until(
        "the gang's pods, claims and Service to be gone",
        Duration::from_secs(90),
        || {
            let (client, ns) = (client.clone(), ns.clone());
            async move {
                let pods = gang_pods(&client, &ns, "doomed").await?.len();
                let claims = gang_claims(&client, &ns, "doomed").await?.len();
                let service = Api::<Service>::namespaced(client.clone(), &ns)
                    .get_opt("doomed")
                    .await?;
                Ok((pods == 0 && claims == 0 && service.is_none()).then_some(()))
            }
        },
    )
    .await?;
    let templates = Api::<ResourceClaimTemplate>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await?;
    assert_eq!(templates.items.len(), 2, "the user's templates stay");

    operator.stop();
    delete_namespace(&client, &ns).await
}

/// Deleting a namespace deletes its gangs' pods while the gangs are still there: muster
/// does not ask the namespace again and again for objects it refuses to make.
#[tokio::test]
async fn a_namespace_being_deleted_is_not_asked_again_for_its_gangs_objects() -> Result<()> {
    let cluster = cluster().await?;
    let _serial = exclusive().await;
    let client = cluster.control_plane.client().await?;
    let ns = namespace(&client, "ns-gone").await?;
    let operator = start_operator(cluster, "ns-gone")?;
    create_templates(&client, &ns).await?;
    let gangs = ["a", "b", "c", "d"];
    for name in gangs {
        create_workload(&client, &ns, unplaceable(name)).await?;
        wait_for_created(&client, &ns, name).await?;
    }
    // Creates the API server refused with 403 (a terminating namespace's answer).
    let refused = |samples: &BTreeMap<String, f64>| -> f64 {
        samples
            .iter()
            .filter(|(k, _)| {
                k.starts_with("muster_api_errors_total{") && k.contains("verb=\"create\"") && k.contains("code=\"403\"")
            })
            .map(|(_, v)| v)
            .sum()
    };
    let before = refused(&muster_e2e::rbac::metrics(&operator).await?);
    delete_namespace(&client, &ns).await?;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    wait::until("the namespace to be gone", Duration::from_secs(120), || {
        let (namespaces, ns) = (namespaces.clone(), ns.clone());
        async move { Ok(namespaces.get_opt(&ns).await?.is_none().then_some(())) }
    })
    .await?;
    let asked = refused(&muster_e2e::rbac::metrics(&operator).await?) - before;
    operator.stop();
    // At most one try for each of the gangs' objects of one kind or step: its pods, or its
    // Service and claims (made together).
    let objects = gangs.len() * (3 + 1);
    ensure!(
        asked <= objects as f64,
        "{asked} creates refused in the terminating namespace, for {objects} objects"
    );
    Ok(())
}

#[tokio::test]
async fn operator_restart_creates_nothing_twice() -> Result<()> {
    let cluster = cluster().await?;
    let _serial = exclusive().await;
    let client = cluster.control_plane.client().await?;
    let ns = namespace(&client, "restart").await?;
    let operator = start_operator(cluster, "restart-1")?;
    create_templates(&client, &ns).await?;
    create_workload(&client, &ns, unplaceable("steady")).await?;
    wait_for_created(&client, &ns, "steady").await?;
    let pods_before = uids(&gang_pods(&client, &ns, "steady").await?);
    let claims_before = uids(&gang_claims(&client, &ns, "steady").await?);
    operator.kill();

    // While the operator is down, one pod disappears: the restarted operator must
    // recreate exactly that one and leave everything else as it was.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    pods.delete("steady-workers-0", &DeleteParams::default()).await?;
    wait::until("the pod to be deleted", Duration::from_secs(30), || {
        let pods = pods.clone();
        async move { Ok(pods.get_opt("steady-workers-0").await?.is_none().then_some(())) }
    })
    .await?;

    let operator = start_operator(cluster, "restart-2")?;
    let recreated = wait::until("the deleted pod to be recreated", Duration::from_secs(60), || {
        let pods = pods.clone();
        async move { Ok(pods.get_opt("steady-workers-0").await?) }
    })
    .await?;
    assert_ne!(recreated.metadata.uid.as_ref(), pods_before.get("steady-workers-0"));
    wait_for_created(&client, &ns, "steady").await?;

    let pods_after = uids(&gang_pods(&client, &ns, "steady").await?);
    let claims_after = uids(&gang_claims(&client, &ns, "steady").await?);
    assert_eq!(pods_after.len(), 3, "{pods_after:?}");
    for (name, uid) in &pods_before {
        if name != "steady-workers-0" {
            assert_eq!(pods_after.get(name), Some(uid), "{name} kept");
        }
    }
    assert_eq!(claims_after, claims_before, "claims untouched");
    let services = Api::<Service>::namespaced(client.clone(), &ns)
        .list(&selector("steady"))
        .await?;
    assert_eq!(services.items.len(), 1);

    operator.stop();
    delete_namespace(&client, &ns).await
}

/// Creates `workload` and expects the API server to refuse it with a message
/// containing `expected`.
async fn expect_refused(api: &Api<Workload>, workload: Value, expected: &str) -> Result<()> {
    let object: Workload = serde_json::from_value(workload)?;
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => bail!(
            "{:?} was accepted; expected refusal with {expected:?}",
            object.metadata.name
        ),
        Err(kube::Error::Api(status)) => {
            ensure!(status.code == 422, "unexpected status {status:?}");
            ensure!(
                status.message.contains(expected),
                "message {:?} lacks {expected:?}",
                status.message
            );
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// `base` with the field at `pointer` set to `value` (created if absent).
fn with(mut base: Value, pointer: &str, value: Value) -> Value {
    let (parent, key) = pointer.rsplit_once('/').expect("a JSON pointer");
    match base.pointer_mut(parent).expect("pointer into the test workload") {
        Value::Object(map) => {
            map.insert(key.to_string(), value);
        }
        Value::Array(items) => items[key.parse::<usize>().expect("an index")] = value,
        _ => panic!("{parent} is neither object nor array"),
    }
    base
}

#[tokio::test]
async fn invalid_workloads_are_refused_with_clear_messages() -> Result<()> {
    let cluster = cluster().await?;
    let client = cluster.control_plane.client().await?;
    let ns = namespace(&client, "invalid").await?;
    let api: Api<Workload> = Api::namespaced(client.clone(), &ns);
    let base = training_workload("bad");

    expect_refused(&api, with(base.clone(), "/spec/podGroups", json!([])), "spec.podGroups").await?;
    expect_refused(
        &api,
        with(base.clone(), "/spec/podGroups/1/name", json!("launcher")),
        "pod group names must be unique",
    )
    .await?;
    expect_refused(
        &api,
        with(base.clone(), "/spec/podGroups/1/minCount", json!(3)),
        "minCount must not exceed replicas",
    )
    .await?;
    expect_refused(
        &api,
        with(base.clone(), "/spec/podGroups/1/replicas", json!(0)),
        "spec.podGroups[1].replicas",
    )
    .await?;
    // Issue 36, item 4: a gated pod may not name its node.
    expect_refused(
        &api,
        with(
            base.clone(),
            "/spec/podGroups/1/template/spec/nodeName",
            json!("node-00000"),
        ),
        "template.spec.nodeName may not be set",
    )
    .await?;
    expect_refused(
        &api,
        with(base.clone(), "/spec/podGroups/1/replicas", json!(10_001)),
        "less than or equal to 10000",
    )
    .await?;
    expect_refused(
        &api,
        with(base.clone(), "/spec/podGroups/1/name", json!("Workers")),
        "spec.podGroups[1].name",
    )
    .await?;
    expect_refused(
        &api,
        with(base.clone(), "/metadata/name", json!("a".repeat(50))),
        "at most 57 characters together",
    )
    .await?;
    expect_refused(
        &api,
        with(base.clone(), "/metadata/name", json!("9lives")),
        "DNS-1035 label",
    )
    .await?;
    expect_refused(
        &api,
        with(
            base.clone(),
            "/spec/resourceClaims/0/resourceClaimName",
            json!("existing"),
        ),
        "exactly one of resourceClaimTemplateName and resourceClaimName",
    )
    .await?;
    expect_refused(
        &api,
        with(base.clone(), "/spec/successPolicy", json!({"podGroups": ["nope"]})),
        "successPolicy.podGroups may only name pod groups",
    )
    .await?;
    // Defect 13: a gang too big to record its placement.
    expect_refused(
        &api,
        with(base.clone(), "/spec/podGroups/1/replicas", json!(5_000)),
        "at most 4096 pods in all groups together",
    )
    .await?;
    // Defect 11: a shared claim named like a pod's claim would take its object name.
    expect_refused(
        &api,
        with(base.clone(), "/spec/resourceClaims/0/name", json!("workers-0-gpus")),
        "may not be named <group>-<index>-<name>",
    )
    .await?;
    expect_refused(
        &api,
        with(base.clone(), "/spec/resourceClaims/0/podGroups", json!(["nope"])),
        "resourceClaims[].podGroups may only name pod groups",
    )
    .await?;
    // Failure rules are checked by the API server, with messages that name the problem.
    let rule = |rule: Value| json!({"maxRestarts": 2, "rules": [rule]});
    for (policy, message) in [
        (
            rule(json!({"action": "FailGang"})),
            "a failure rule needs onExitCodes, onPodConditions or onReasons",
        ),
        (
            rule(json!({"action": "FailGang", "onExitCodes": {"operator": "In", "values": [0, 3]}})),
            "may not list 0",
        ),
        (
            rule(json!({"action": "FailGang", "onExitCodes": {"operator": "In", "values": [3, 3]}})),
            "must not repeat a code",
        ),
        (
            rule(json!({"action": "FailGang", "onExitCodes": {"operator": "In", "values": [256]}})),
            "between 0 and 255",
        ),
        (
            rule(json!({"action": "RestartGang", "onReasons": ["Evicted"], "podGroups": ["nope"]})),
            "failurePolicy.rules[].podGroups may only name pod groups",
        ),
        (
            json!({"restartBackoff": {"initialSeconds": 60, "maxSeconds": 10}}),
            "initialSeconds must not exceed maxSeconds",
        ),
    ] {
        expect_refused(&api, with(base.clone(), "/spec/failurePolicy", policy), message).await?;
    }

    // Pod groups are immutable, suspend is not.
    let created = create_workload(&client, &ns, with(base.clone(), "/metadata/name", json!("good"))).await?;
    let params = PatchParams::default();
    let change = json!({"spec": {"podGroups": [{"name": "launcher", "replicas": 2}]}});
    match api.patch("good", &params, &Patch::Merge(&change)).await {
        Ok(_) => bail!("changing podGroups was accepted"),
        Err(kube::Error::Api(status)) => {
            ensure!(
                status.message.contains("podGroups are immutable"),
                "message {:?}",
                status.message
            )
        }
        Err(e) => return Err(e.into()),
    }
    let suspended = api
        .patch("good", &params, &Patch::Merge(&json!({"spec": {"suspend": true}})))
        .await?;
    assert_eq!(suspended.spec.suspend, Some(true));
    assert!(suspended.metadata.generation > created.metadata.generation);

    delete_namespace(&client, &ns).await
}
