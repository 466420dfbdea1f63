//! Extended resources backed by DRA: a container asking `limits: {example.com/gpu: 8}`
//! where a DeviceClass declares `spec.extendedResourceName: example.com/gpu` (or asking
//! for the implicit name `deviceclass.resource.kubernetes.io/<class>`).
//!
//! kube-scheduler serves such a request itself, pod by pod, with a claim it makes while
//! binding — too late for a gang. muster creates the gang's pods, so it turns the request
//! into an ordinary per-pod ResourceClaim before the pod exists: one claim
//! `<pod>-extended-resources` with one `exactly` request per container and resource (named
//! like kube-scheduler's, `container-<i>-request-<j>`), referenced by the container's
//! `resources.claims`, and the resource removed from the container's requests and limits.
//! Planning, reservation and teardown then treat it like any claim.
//!
//! Rules:
//! - a name no DeviceClass maps stays a node resource (device plugin);
//! - a mapped name is served through DRA for every pod of the gang, also on nodes that
//!   advertise it through a device plugin (kube-scheduler would use the device plugin
//!   there): a gang is planned with one kind of device;
//! - the choice is made when a pod (or its claim) is created and recorded in the
//!   [`labels::EXTENDED_RESOURCES`] annotation: a mapping that appears or changes later
//!   does not rewrite a pod or claim that exists;
//! - a name two DeviceClasses map is refused (kube-scheduler takes the oldest class).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, PodResourceClaim, PodSpec, ResourceClaim as ContainerClaim};
use k8s_openapi::api::resource::v1::{
    DeviceClaim, DeviceRequest, ExactDeviceRequest, ResourceClaim, ResourceClaimSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use muster_api::labels;
use muster_engine::cluster::ClusterState;
use serde::{Deserialize, Serialize};

use crate::workload::names::pod_claim_object_name;

/// Name the pods use for the claim (`spec.resourceClaims[].name`).
pub const CLAIM: &str = "extended-resources";
/// Prefix of the name every DeviceClass maps implicitly.
pub const IMPLICIT_PREFIX: &str = "deviceclass.resource.kubernetes.io/";

/// Why a pod's extended resources cannot be turned into a claim.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExtendedError {
    #[error(
        "extended resource {resource} is mapped by more than one DeviceClass ({}): delete or change all but one",
        classes.join(", ")
    )]
    Ambiguous { resource: String, classes: Vec<String> },
    #[error("container {container} asks for {quantity} of extended resource {resource}: it must be a whole number")]
    NotWhole {
        container: String,
        resource: String,
        quantity: String,
    },
    #[error(
        "init container {container} asks for extended resource {resource}, which a DeviceClass maps: \
         only containers and sidecars may ask for it"
    )]
    InitContainer { container: String, resource: String },
    #[error("pod claim name {CLAIM} is used by muster for extended resources backed by DRA: rename the claim")]
    ReservedName,
}

/// One container's request for one extended resource, served by a device request.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtendedRequest {
    pub container: String,
    pub resource: String,
    pub count: i64,
    pub device_class: String,
    /// Name of the device request in the claim.
    pub request: String,
}

/// Which extended resources DeviceClasses map, and the choices already made for pods
/// that exist.
#[derive(Debug, Clone, Default)]
pub struct ExtendedResources {
    /// Resource name → the classes mapping it (more than one: ambiguous).
    classes: BTreeMap<String, Vec<String>>,
    /// Pod name → what was converted when the pod or its claim was created.
    recorded: BTreeMap<String, Vec<ExtendedRequest>>,
    /// Pod group → the same, for one of its pods: the pods of a group stay alike.
    groups: BTreeMap<String, Vec<ExtendedRequest>>,
}

impl ExtendedResources {
    /// The mappings of `classes`: (class name, `spec.extendedResourceName`).
    pub fn new<'a>(classes: impl IntoIterator<Item = (&'a str, Option<&'a str>)>) -> Self {
        let mut map: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (class, explicit) in classes {
            map.entry(format!("{IMPLICIT_PREFIX}{class}"))
                .or_default()
                .push(class.to_string());
            if let Some(explicit) = explicit {
                map.entry(explicit.to_string()).or_default().push(class.to_string());
            }
        }
        for classes in map.values_mut() {
            classes.sort();
            classes.dedup();
        }
        ExtendedResources {
            classes: map,
            ..ExtendedResources::default()
        }
    }

    /// The mappings of the DeviceClasses in `cluster`.
    pub fn of_cluster(cluster: &ClusterState) -> Self {
        Self::new(
            cluster
                .classes()
                .map(|c| (c.name.as_str(), c.extended_resource_name.as_deref())),
        )
    }

    /// Keeps the choice made for gang objects that exist: a pod's (none if it has no
    /// annotation), else its extended-resources claim's. A pod yet to be made follows
    /// them too when one of its group exists.
    pub fn record_existing<'a>(
        &mut self,
        pods: impl IntoIterator<Item = &'a Pod>,
        claims: impl IntoIterator<Item = &'a ResourceClaim>,
    ) {
        let group = |meta: &ObjectMeta| meta.labels.as_ref()?.get(labels::POD_GROUP).cloned();
        for claim in claims {
            let (Some(name), Some(recorded)) = (claim.metadata.name.as_deref(), recorded(&claim.metadata)) else {
                continue;
            };
            if let Some(pod) = name.strip_suffix(&format!("-{CLAIM}")) {
                if let Some(group) = group(&claim.metadata) {
                    self.groups.insert(group, recorded.clone());
                }
                self.recorded.insert(pod.to_string(), recorded);
            }
        }
        for pod in pods {
            let recorded = recorded(&pod.metadata).unwrap_or_default();
            if let Some(group) = group(&pod.metadata) {
                self.groups.insert(group, recorded.clone());
            }
            if let Some(name) = &pod.metadata.name {
                self.recorded.insert(name.clone(), recorded);
            }
        }
    }

    /// What pod `pod` of group `group` (with spec `spec`, before conversion) gets
    /// through DRA.
    pub fn requests(&self, pod: &str, group: &str, spec: &PodSpec) -> Result<Vec<ExtendedRequest>, ExtendedError> {
        if let Some(recorded) = self.recorded.get(pod).or_else(|| self.groups.get(group)) {
            return Ok(recorded.clone());
        }
        let inits = spec.init_containers.iter().flatten().map(|c| (c, true));
        let mut out = Vec::new();
        for (index, (container, init)) in inits.chain(spec.containers.iter().map(|c| (c, false))).enumerate() {
            let resources = container.resources.clone().unwrap_or_default();
            let requests = resources.requests.unwrap_or_default();
            let limits = resources.limits.unwrap_or_default();
            // Requests default to limits for extended resources; sorted as upstream does.
            let mut names: Vec<&String> = requests.keys().chain(limits.keys()).collect();
            names.sort();
            names.dedup();
            for (position, resource) in names.iter().enumerate() {
                let Some(classes) = self.classes.get(*resource) else {
                    continue;
                };
                if let [_, _, ..] = classes.as_slice() {
                    return Err(ExtendedError::Ambiguous {
                        resource: resource.to_string(),
                        classes: classes.clone(),
                    });
                }
                let quantity = requests
                    .get(*resource)
                    .or(limits.get(*resource))
                    .cloned()
                    .unwrap_or_default();
                let count = muster_engine::quantity::Quantity::parse(&quantity.0)
                    .ok()
                    .and_then(|q| q.as_integer())
                    .filter(|c| *c >= 0)
                    .ok_or_else(|| ExtendedError::NotWhole {
                        container: container.name.clone(),
                        resource: resource.to_string(),
                        quantity: quantity.0.clone(),
                    })?;
                if count == 0 {
                    continue;
                }
                if init && !is_sidecar(container) {
                    return Err(ExtendedError::InitContainer {
                        container: container.name.clone(),
                        resource: resource.to_string(),
                    });
                }
                out.push(ExtendedRequest {
                    container: container.name.clone(),
                    resource: resource.to_string(),
                    count,
                    device_class: classes[0].clone(),
                    request: format!("container-{index}-request-{position}"),
                });
            }
        }
        Ok(out)
    }
}

fn is_sidecar(container: &Container) -> bool {
    container.restart_policy.as_deref() == Some("Always")
}

/// The requests recorded in an object's [`labels::EXTENDED_RESOURCES`] annotation.
pub fn recorded(meta: &ObjectMeta) -> Option<Vec<ExtendedRequest>> {
    let value = meta.annotations.as_ref()?.get(labels::EXTENDED_RESOURCES)?;
    serde_json::from_str(value).ok()
}

/// The annotation value recording `requests`.
pub fn annotation(requests: &[ExtendedRequest]) -> String {
    serde_json::to_string(requests).unwrap_or_default()
}

/// Turns the extended resources of `requests` in pod `pod`'s spec into references to
/// its claim: removed from requests and limits, named in `resources.claims`.
pub fn convert(pod: &str, spec: &mut PodSpec, requests: &[ExtendedRequest]) -> Result<(), ExtendedError> {
    if requests.is_empty() {
        return Ok(());
    }
    if spec.resource_claims.iter().flatten().any(|c| c.name == CLAIM) {
        return Err(ExtendedError::ReservedName);
    }
    let containers = spec
        .init_containers
        .iter_mut()
        .flatten()
        .chain(spec.containers.iter_mut());
    for container in containers {
        for request in requests.iter().filter(|r| r.container == container.name) {
            let resources = container.resources.get_or_insert_with(Default::default);
            for list in [&mut resources.requests, &mut resources.limits] {
                if let Some(map) = list {
                    map.remove(&request.resource);
                    if map.is_empty() {
                        *list = None;
                    }
                }
            }
            resources.claims.get_or_insert_with(Vec::new).push(ContainerClaim {
                name: CLAIM.to_string(),
                request: Some(request.request.clone()),
            });
        }
    }
    spec.resource_claims
        .get_or_insert_with(Vec::new)
        .push(PodResourceClaim {
            name: CLAIM.to_string(),
            resource_claim_name: Some(pod_claim_object_name(pod, CLAIM)),
            resource_claim_template_name: None,
        });
    Ok(())
}

/// The claim's spec: one `exactly` request per container and resource.
pub fn claim_spec(requests: &[ExtendedRequest]) -> ResourceClaimSpec {
    ResourceClaimSpec {
        devices: Some(DeviceClaim {
            requests: Some(
                requests
                    .iter()
                    .map(|r| DeviceRequest {
                        name: r.request.clone(),
                        exactly: Some(ExactDeviceRequest {
                            device_class_name: r.device_class.clone(),
                            allocation_mode: Some("ExactCount".into()),
                            count: Some(r.count),
                            ..Default::default()
                        }),
                        first_available: None,
                    })
                    .collect(),
            ),
            ..Default::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> PodSpec {
        serde_saphyr::from_str(yaml).expect("valid pod spec")
    }

    fn gpus() -> ExtendedResources {
        ExtendedResources::new([("gpu.example.com", Some("example.com/gpu")), ("nic.example.com", None)])
    }

    const WORKER: &str = r#"
containers:
- name: main
  image: busybox
  resources:
    limits: {example.com/gpu: "8", cpu: "4", nvidia.com/gpu: "1"}
    requests: {cpu: "4"}
- name: side
  image: busybox
  resources: {limits: {deviceclass.resource.kubernetes.io/nic.example.com: "2"}}
"#;

    #[test]
    fn mapped_names_become_requests_named_like_upstream() {
        let requests = gpus().requests("w-0", "g", &spec(WORKER)).unwrap();
        assert_eq!(
            requests,
            [
                ExtendedRequest {
                    container: "main".into(),
                    resource: "example.com/gpu".into(),
                    count: 8,
                    device_class: "gpu.example.com".into(),
                    // cpu, example.com/gpu, nvidia.com/gpu: the second name.
                    request: "container-0-request-1".into(),
                },
                ExtendedRequest {
                    container: "side".into(),
                    resource: "deviceclass.resource.kubernetes.io/nic.example.com".into(),
                    count: 2,
                    device_class: "nic.example.com".into(),
                    request: "container-1-request-0".into(),
                },
            ]
        );
    }

    #[test]
    fn conversion_moves_the_request_to_the_claim_and_keeps_unmapped_names() {
        let mut pod = spec(WORKER);
        let requests = gpus().requests("w-0", "g", &pod).unwrap();
        convert("w-0", &mut pod, &requests).unwrap();
        let main = pod.containers[0].resources.clone().unwrap();
        let limits = main.limits.unwrap();
        assert!(!limits.contains_key("example.com/gpu"));
        assert!(
            limits.contains_key("nvidia.com/gpu"),
            "no DeviceClass maps it: a node resource"
        );
        assert_eq!(
            main.claims.unwrap(),
            [ContainerClaim {
                name: CLAIM.into(),
                request: Some("container-0-request-1".into())
            }]
        );
        assert!(
            pod.containers[1].resources.as_ref().unwrap().limits.is_none(),
            "an emptied list goes"
        );
        let claims = pod.resource_claims.unwrap();
        assert_eq!(claims[0].resource_claim_name.as_deref(), Some("w-0-extended-resources"));

        let spec = claim_spec(&requests);
        let devices = spec.devices.unwrap().requests.unwrap();
        let exactly = devices[0].exactly.clone().unwrap();
        assert_eq!(
            (
                devices[0].name.as_str(),
                exactly.device_class_name.as_str(),
                exactly.count
            ),
            ("container-0-request-1", "gpu.example.com", Some(8))
        );
    }

    #[test]
    fn unmapped_names_stay_node_resources() {
        let pod = spec(WORKER);
        let none = ExtendedResources::new([("other.example.com", None)]);
        assert_eq!(none.requests("w-0", "g", &pod).unwrap(), []);
    }

    #[test]
    fn a_name_two_classes_map_is_refused() {
        let both = ExtendedResources::new([
            ("gpu.example.com", Some("example.com/gpu")),
            ("a100.example.com", Some("example.com/gpu")),
        ]);
        assert_eq!(
            both.requests("w-0", "g", &spec(WORKER)).unwrap_err().to_string(),
            "extended resource example.com/gpu is mapped by more than one DeviceClass \
             (a100.example.com, gpu.example.com): delete or change all but one"
        );
    }

    #[test]
    fn existing_pods_and_claims_keep_the_choice_made_at_creation() {
        let pod = spec(WORKER);
        let first = gpus().requests("w-0", "g", &pod).unwrap();
        let mut created = Pod::default();
        created.metadata.name = Some("w-0".into());
        created.metadata.annotations = Some(BTreeMap::from([(
            labels::EXTENDED_RESOURCES.to_string(),
            annotation(&first),
        )]));
        let mut before = Pod::default();
        before.metadata.name = Some("w-1".into());
        let mut claim = ResourceClaim::default();
        claim.metadata.name = Some("w-2-extended-resources".into());
        claim.metadata.annotations = created.metadata.annotations.clone();

        // The mapping changed since: another class now.
        let mut now = ExtendedResources::new([("b200.example.com", Some("example.com/gpu"))]);
        now.record_existing([&created, &before], [&claim]);
        assert_eq!(now.requests("w-0", "g", &pod).unwrap(), first);
        assert_eq!(now.requests("w-1", "g", &pod).unwrap(), [], "made before any mapping");
        assert_eq!(now.requests("w-2", "g", &pod).unwrap(), first, "its claim exists");
        assert_eq!(
            now.requests("w-3", "g", &pod).unwrap()[0].device_class,
            "b200.example.com"
        );

        // A pod yet to be made follows the pods of its group that exist.
        created.metadata.labels = Some(BTreeMap::from([(labels::POD_GROUP.to_string(), "g".to_string())]));
        let mut now = ExtendedResources::new([("b200.example.com", Some("example.com/gpu"))]);
        now.record_existing([&created], []);
        assert_eq!(now.requests("w-3", "g", &pod).unwrap(), first);
        assert_eq!(
            now.requests("x-0", "other", &pod).unwrap()[0].device_class,
            "b200.example.com"
        );
    }

    #[test]
    fn odd_requests_are_refused_with_the_container_named() {
        let fraction = spec("containers: [{name: m, resources: {limits: {example.com/gpu: 500m}}}]");
        assert!(matches!(
            gpus().requests("p", "g", &fraction).unwrap_err(),
            ExtendedError::NotWhole { container, .. } if container == "m"
        ));
        let init =
            spec("initContainers: [{name: i, resources: {limits: {example.com/gpu: 1}}}]\ncontainers: [{name: m}]");
        assert!(matches!(
            gpus().requests("p", "g", &init).unwrap_err(),
            ExtendedError::InitContainer { .. }
        ));
        let sidecar = spec(
            "initContainers: [{name: i, restartPolicy: Always, resources: {limits: {example.com/gpu: 1}}}]\ncontainers: [{name: m}]",
        );
        assert_eq!(
            gpus().requests("p", "g", &sidecar).unwrap()[0].request,
            "container-0-request-0"
        );
        let mut clash = spec(WORKER);
        clash.resource_claims = Some(vec![PodResourceClaim {
            name: CLAIM.into(),
            resource_claim_name: Some("x".into()),
            resource_claim_template_name: None,
        }]);
        let requests = gpus().requests("p", "g", &clash).unwrap();
        assert_eq!(convert("p", &mut clash, &requests), Err(ExtendedError::ReservedName));
    }
}
