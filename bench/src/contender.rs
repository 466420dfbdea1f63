//! The contenders and the objects each submits for a gang. Pods are the same in all
//! three but for how they join the gang.

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DynamicObject, PostParams};
use kube::discovery::ApiResource;
use muster_local_cluster::fleet::{GPU_DRIVER, RACK_LABEL};
use serde_json::{Value, json};

use crate::spec::GangSpec;

/// Label on every pod of a gang, naming the gang.
pub const GANG_LABEL: &str = "bench.muster.dev/gang";
/// Annotation of the kwok stage that ends a running pod successfully after a duration.
pub const RUN_FOR_ANNOTATION: &str = "muster-e2e-run-for";
/// The benchmark's scheduling gate on the baselines' pods of a held gang.
pub const HOLD_GATE: &str = "bench.muster.dev/hold";

/// Who places the gangs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Contender {
    /// A muster Workload per gang.
    Muster,
    /// A `scheduling.k8s.io/v1beta1` PodGroup with a gang policy per gang, and its pods.
    Upstream,
    /// The pods alone: kube-scheduler without gangs, the floor.
    Plain,
}

impl Contender {
    pub const ALL: [Contender; 3] = [Contender::Muster, Contender::Upstream, Contender::Plain];

    pub fn label(self) -> &'static str {
        match self {
            Contender::Muster => "muster",
            Contender::Upstream => "upstream PodGroup",
            Contender::Plain => "kube-scheduler, no gang",
        }
    }

    /// The contender named `text` (`muster`, `upstream`, `plain`), any case.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|c| format!("{c:?}").eq_ignore_ascii_case(text))
    }

    /// Whether the benchmark creates the pods (muster creates its own).
    pub fn creates_pods(self) -> bool {
        self != Contender::Muster
    }
}

/// Name of the ResourceClaimTemplate for `gpus` GPUs.
pub fn template_name(gpus: usize) -> String {
    format!("gpus-{gpus}")
}

/// A ResourceClaimTemplate of `gpus` GPUs of the fleet's driver.
pub fn claim_template(gpus: usize) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": template_name(gpus)},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "gpus", "exactly": {"deviceClassName": GPU_DRIVER, "count": gpus}}
        ]}}},
    })
}

fn pod_metadata(gang: &GangSpec) -> Value {
    let mut annotations = serde_json::Map::new();
    if let Some(seconds) = gang.run_for_seconds {
        annotations.insert(RUN_FOR_ANNOTATION.into(), json!(format!("{seconds}s")));
    }
    json!({"labels": {GANG_LABEL: gang.name}, "annotations": annotations})
}

/// The pod spec every contender runs: one container, a claim of the gang's GPUs.
fn pod_spec(gang: &GangSpec) -> Value {
    json!({
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "containers": [{
            "name": "main",
            "image": "trainer",
            "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "claims": [{"name": "gpus"}]},
        }],
        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template_name(gang.gpus)}],
    })
}

/// The muster Workload of `gang`.
pub fn workload(gang: &GangSpec) -> Value {
    // A failed member restarts the gang, as the others' pods are replaced by their
    // controller; without it a Workload fails on the first pod failure.
    let mut spec = json!({
        "failurePolicy": {"maxRestarts": 3},
        "podGroups": [{
            "name": "w",
            "replicas": gang.pods,
            "template": {"metadata": pod_metadata(gang), "spec": pod_spec(gang)},
        }],
    });
    if gang.same_rack {
        spec["topology"] = json!({"required": RACK_LABEL});
    }
    json!({
        "apiVersion": "muster.dev/v1alpha1",
        "kind": "Workload",
        "metadata": {"name": gang.name},
        "spec": spec,
    })
}

/// The upstream PodGroup of `gang`: all pods or none, in one rack if the gang asks.
pub fn pod_group(gang: &GangSpec) -> Value {
    let mut spec = json!({"schedulingPolicy": {"gang": {"minCount": gang.pods}}});
    if gang.same_rack {
        spec["schedulingConstraints"] = json!({"topology": [{"key": RACK_LABEL}]});
    }
    json!({
        "apiVersion": "scheduling.k8s.io/v1beta1",
        "kind": "PodGroup",
        "metadata": {"name": gang.name},
        "spec": spec,
    })
}

/// Pod `index` of `gang` as `contender` submits it (never [`Contender::Muster`]).
pub fn pod(contender: Contender, gang: &GangSpec, index: usize) -> Result<Pod> {
    let mut spec = pod_spec(gang);
    if contender == Contender::Upstream {
        spec["schedulingGroup"] = json!({"podGroupName": gang.name});
    }
    if gang.held {
        spec["schedulingGates"] = json!([{"name": HOLD_GATE}]);
    }
    let mut metadata = pod_metadata(gang);
    metadata["name"] = json!(format!("{}-{index}", gang.name));
    serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}))
        .context("building a pod")
}

pub fn pod_group_resource() -> ApiResource {
    ApiResource {
        group: "scheduling.k8s.io".into(),
        version: "v1beta1".into(),
        api_version: "scheduling.k8s.io/v1beta1".into(),
        kind: "PodGroup".into(),
        plural: "podgroups".into(),
    }
}

pub fn workload_resource() -> ApiResource {
    ApiResource {
        group: "muster.dev".into(),
        version: "v1alpha1".into(),
        api_version: "muster.dev/v1alpha1".into(),
        kind: "Workload".into(),
        plural: "workloads".into(),
    }
}

/// Creates everything `contender` submits for `gang`, the gang object first.
pub async fn submit(client: &kube::Client, ns: &str, contender: Contender, gang: &GangSpec) -> Result<()> {
    let post = PostParams::default();
    match contender {
        Contender::Muster => {
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &workload_resource());
            api.create(&post, &serde_json::from_value(workload(gang))?)
                .await
                .with_context(|| format!("creating Workload {}", gang.name))?;
        }
        Contender::Upstream | Contender::Plain => {
            if contender == Contender::Upstream {
                let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &pod_group_resource());
                api.create(&post, &serde_json::from_value(pod_group(gang))?)
                    .await
                    .with_context(|| format!("creating PodGroup {}", gang.name))?;
            }
            let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
            for index in 0..gang.pods {
                pods.create(&post, &pod(contender, gang, index)?)
                    .await
                    .with_context(|| format!("creating pod {}-{index}", gang.name))?;
            }
        }
    }
    Ok(())
}

/// Lets a held baseline gang go: removes the benchmark's gate from each of its pods.
pub async fn release(client: &kube::Client, ns: &str, gang: &GangSpec) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let open = json!({"spec": {"schedulingGates": []}});
    for index in 0..gang.pods {
        let name = format!("{}-{index}", gang.name);
        pods.patch(
            &name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&open),
        )
        .await
        .with_context(|| format!("releasing pod {name}"))?;
    }
    Ok(())
}

/// Deletes what `contender` submitted for `gang` (its claims go with their owners).
pub async fn delete(client: &kube::Client, ns: &str, contender: Contender, gang: &GangSpec) -> Result<()> {
    let params = kube::api::DeleteParams::default();
    let ignore_missing = |result: Result<_, kube::Error>| match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(e),
    };
    match contender {
        Contender::Muster => {
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &workload_resource());
            ignore_missing(api.delete(&gang.name, &params).await.map(|_| ()))?;
        }
        Contender::Upstream | Contender::Plain => {
            let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
            for index in 0..gang.pods {
                ignore_missing(
                    pods.delete(&format!("{}-{index}", gang.name), &params)
                        .await
                        .map(|_| ()),
                )?;
            }
            if contender == Contender::Upstream {
                let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &pod_group_resource());
                ignore_missing(api.delete(&gang.name, &params).await.map(|_| ()))?;
            }
        }
    }
    Ok(())
}
