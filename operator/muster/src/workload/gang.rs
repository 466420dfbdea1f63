//! The objects a Workload stands for: its gated pods, the ResourceClaims muster creates
//! for them, and the headless Service that gives the pods stable hostnames.
//!
//! Pure: the functions here build objects from the Workload (and, for claims, the
//! ResourceClaimTemplate's spec); the controller decides which of them to create.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, PodResourceClaim, PodSchedulingGate, PodSpec, Service, ServiceSpec};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Resource;
use muster_api::labels;
use muster_api::v1alpha1::{PodGroup, Workload};

use crate::workload::extended::{self, ExtendedError, ExtendedRequest, ExtendedResources};
use crate::workload::membership;

/// A Workload that cannot be turned into pods. Reported as a status condition; the
/// Workload's spec must change (it is immutable, so: recreated) before it can work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("the Workload has no name, namespace or uid yet")]
    Incomplete,
    #[error("pod group {group}: template.spec is missing")]
    MissingPodSpec { group: String },
    #[error(
        "pod group {group}: pod claim {claim} must set exactly one of resourceClaimName and resourceClaimTemplateName"
    )]
    AmbiguousPodClaim { group: String, claim: String },
    #[error(
        "pod group {group}: pod claim {claim} has the same name as the shared claim {claim} of spec.resourceClaims"
    )]
    ClaimNameClash { group: String, claim: String },
    #[error(
        "claim {first} and claim {second} would both be made as ResourceClaim {object}: rename a pod group or a claim"
    )]
    ObjectNameClash {
        object: String,
        first: String,
        second: String,
    },
    #[error("pod {pod}: {source}")]
    Extended {
        pod: String,
        #[source]
        source: ExtendedError,
    },
}

impl SpecError {
    /// Whether the cluster, not the Workload, must change (DeviceClasses mapping one
    /// extended resource).
    pub fn is_cluster_problem(&self) -> bool {
        matches!(
            self,
            SpecError::Extended {
                source: ExtendedError::Ambiguous { .. },
                ..
            }
        )
    }
}

/// Where a claim of the gang comes from.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum ClaimSource {
    /// muster creates the claim from this ResourceClaimTemplate.
    Template(String),
    /// The claim exists already; muster only refers to it.
    Existing,
    /// muster creates the claim for the pod's extended resources backed by DRA.
    Extended(Vec<ExtendedRequest>),
}

/// A ResourceClaim the gang uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangClaim {
    /// Name of the ResourceClaim object.
    pub object_name: String,
    /// Name the pods use for it (`spec.resourceClaims[].name`).
    pub pod_claim_name: String,
    pub source: ClaimSource,
    /// The pod the claim belongs to; `None` for gang-shared claims.
    pub pod: Option<String>,
    /// The pod group of that pod.
    pub pod_group: Option<String>,
}

impl GangClaim {
    /// How the spec names it: `x of pod a-0` or `shared x`.
    fn describe(&self) -> String {
        match &self.pod {
            Some(pod) => format!("{} of pod {pod}", self.pod_claim_name),
            None => format!("shared {}", self.pod_claim_name),
        }
    }
}

/// Everything muster creates for one Workload.
#[derive(Debug, Clone)]
pub struct Gang {
    /// The headless Service, unless `spec.network.enableDNSHostnames` is false.
    pub service: Option<Service>,
    pub claims: Vec<GangClaim>,
    pub pods: Vec<Pod>,
}

pub use crate::workload::names::{pod_claim_object_name, pod_name, shared_claim_object_name};

/// Owner reference making the Workload the controller of an object, so that deleting
/// the Workload garbage-collects it.
pub fn owner_reference(workload: &Workload) -> Result<OwnerReference, SpecError> {
    workload.controller_owner_ref(&()).ok_or(SpecError::Incomplete)
}

/// Builds the gang's objects. Claims from templates are described, not built: building
/// them needs the template ([`claim_from_template`]). Extended resources `extended` maps
/// to DeviceClasses become a claim of each pod ([`claim_for_extended`]).
pub fn build(workload: &Workload, extended: &ExtendedResources) -> Result<Gang, SpecError> {
    let name = workload.metadata.name.as_deref().ok_or(SpecError::Incomplete)?;
    let namespace = workload.metadata.namespace.as_deref().ok_or(SpecError::Incomplete)?;
    let owner = owner_reference(workload)?;

    let mut claims = Vec::new();
    // Shared claims, and for each the pod groups that get it.
    let mut shared: Vec<(PodResourceClaim, Option<&Vec<String>>)> = Vec::new();
    for claim in &workload.spec.resource_claims {
        let (object_name, source) = match (&claim.resource_claim_template_name, &claim.resource_claim_name) {
            (Some(template), _) => (
                shared_claim_object_name(name, &claim.name),
                ClaimSource::Template(template.clone()),
            ),
            (None, Some(existing)) => (existing.clone(), ClaimSource::Existing),
            // Refused by the CRD schema; treat like a template-less existing name.
            (None, None) => (claim.name.clone(), ClaimSource::Existing),
        };
        shared.push((
            PodResourceClaim {
                name: claim.name.clone(),
                resource_claim_name: Some(object_name.clone()),
                resource_claim_template_name: None,
            },
            claim.pod_groups.as_ref(),
        ));
        claims.push(GangClaim {
            object_name,
            pod_claim_name: claim.name.clone(),
            source,
            pod: None,
            pod_group: None,
        });
    }

    let mut pods = Vec::new();
    for group in &workload.spec.pod_groups {
        let Some(template) = &group.template else {
            continue;
        };
        let spec = template.spec.as_ref().ok_or_else(|| SpecError::MissingPodSpec {
            group: group.name.clone(),
        })?;
        let group_shared: Vec<&PodResourceClaim> = shared
            .iter()
            .filter(|(_, groups)| groups.is_none_or(|g| g.contains(&group.name)))
            .map(|(claim, _)| claim)
            .collect();
        for claim in spec.resource_claims.iter().flatten() {
            if claim.resource_claim_name.is_some() == claim.resource_claim_template_name.is_some() {
                return Err(SpecError::AmbiguousPodClaim {
                    group: group.name.clone(),
                    claim: claim.name.clone(),
                });
            }
            if group_shared.iter().any(|s| s.name == claim.name) {
                return Err(SpecError::ClaimNameClash {
                    group: group.name.clone(),
                    claim: claim.name.clone(),
                });
            }
        }
        for index in 0..group.replicas {
            let mut pod = build_pod(workload, name, namespace, &owner, group, spec, &group_shared, index);
            let extended_claim = convert_extended(&mut pod, &group.name, extended)?;
            for claim in spec.resource_claims.iter().flatten() {
                if let Some(template) = &claim.resource_claim_template_name {
                    let pod_name = pod.metadata.name.clone().unwrap_or_default();
                    claims.push(GangClaim {
                        object_name: pod_claim_object_name(&pod_name, &claim.name),
                        pod_claim_name: claim.name.clone(),
                        source: ClaimSource::Template(template.clone()),
                        pod: Some(pod_name),
                        pod_group: Some(group.name.clone()),
                    });
                }
            }
            if let Some(requests) = extended_claim {
                let pod_name = pod.metadata.name.clone().unwrap_or_default();
                claims.push(GangClaim {
                    object_name: pod_claim_object_name(&pod_name, extended::CLAIM),
                    pod_claim_name: extended::CLAIM.to_string(),
                    source: ClaimSource::Extended(requests),
                    pod: Some(pod_name),
                    pod_group: Some(group.name.clone()),
                });
            }
            pods.push(pod);
        }
    }

    // Names are joined with '-', and group and claim names may hold '-' and digits:
    // group `a` with claim `0-x` and group `a-0` with claim `x` both make `<w>-a-0-0-x`.
    let mut made: BTreeMap<&str, &GangClaim> = BTreeMap::new();
    for claim in &claims {
        if let Some(other) = made.insert(&claim.object_name, claim)
            && (!matches!(claim.source, ClaimSource::Existing) || !matches!(other.source, ClaimSource::Existing))
        {
            return Err(SpecError::ObjectNameClash {
                object: claim.object_name.clone(),
                first: other.describe(),
                second: claim.describe(),
            });
        }
    }

    Ok(Gang {
        service: workload
            .spec
            .dns_hostnames()
            .then(|| build_service(name, namespace, owner)),
        claims,
        pods,
    })
}

/// Serves the pod's extended resources that DeviceClasses map through its own claim, and
/// records on the pod what came from where; the claim's requests, if any.
fn convert_extended(
    pod: &mut Pod,
    group: &str,
    extended: &ExtendedResources,
) -> Result<Option<Vec<ExtendedRequest>>, SpecError> {
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    let spec = pod.spec.get_or_insert_with(Default::default);
    let failed = |source| SpecError::Extended {
        pod: pod_name.clone(),
        source,
    };
    let requests = extended.requests(&pod_name, group, spec).map_err(failed)?;
    if requests.is_empty() {
        return Ok(None);
    }
    extended::convert(&pod_name, spec, &requests).map_err(failed)?;
    pod.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(labels::EXTENDED_RESOURCES.into(), extended::annotation(&requests));
    Ok(Some(requests))
}

#[allow(clippy::too_many_arguments)]
fn build_pod(
    workload: &Workload,
    name: &str,
    namespace: &str,
    owner: &OwnerReference,
    group: &PodGroup,
    template_spec: &PodSpec,
    shared: &[&PodResourceClaim],
    index: i32,
) -> Pod {
    let template_meta = group
        .template
        .as_ref()
        .and_then(|t| t.metadata.clone())
        .unwrap_or_default();
    let pod_name = pod_name(name, &group.name, index);
    let mut pod_labels = template_meta.labels.unwrap_or_default();
    pod_labels.extend(gang_labels(name));
    pod_labels.insert(labels::POD_GROUP.into(), group.name.clone());
    pod_labels.insert(labels::POD_INDEX.into(), index.to_string());
    pod_labels.insert(labels::ATTEMPT.into(), membership::attempt(workload).to_string());

    let mut spec = template_spec.clone();
    let group_index = workload
        .spec
        .pod_groups
        .iter()
        .position(|g| g.name == group.name)
        .unwrap_or(0);
    crate::workload::rendezvous::inject(
        &mut spec,
        &crate::workload::rendezvous::environment(workload, group_index, index),
    );
    let gates = spec.scheduling_gates.get_or_insert_with(Vec::new);
    if !gates.iter().any(|g| g.name == labels::GANG_GATE) {
        gates.push(PodSchedulingGate {
            name: labels::GANG_GATE.into(),
        });
    }
    spec.hostname = Some(pod_name.clone());
    if workload.spec.dns_hostnames() {
        spec.subdomain = Some(name.to_string());
    }
    if let Some(class) = &workload.spec.priority_class_name {
        spec.priority_class_name = Some(class.clone());
    }
    let mut pod_claims: Vec<PodResourceClaim> = spec
        .resource_claims
        .take()
        .unwrap_or_default()
        .into_iter()
        .map(|claim| match &claim.resource_claim_template_name {
            Some(_) => PodResourceClaim {
                resource_claim_name: Some(pod_claim_object_name(&pod_name, &claim.name)),
                resource_claim_template_name: None,
                name: claim.name,
            },
            None => claim,
        })
        .collect();
    pod_claims.extend(shared.iter().map(|c| (*c).clone()));
    spec.resource_claims = (!pod_claims.is_empty()).then_some(pod_claims);

    Pod {
        metadata: ObjectMeta {
            name: Some(pod_name),
            namespace: Some(namespace.to_string()),
            labels: Some(pod_labels),
            annotations: template_meta.annotations,
            owner_references: Some(vec![owner.clone()]),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    }
}

/// Labels every object of a gang carries.
pub fn gang_labels(workload: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(labels::WORKLOAD.to_string(), workload.to_string())])
}

fn build_service(name: &str, namespace: &str, owner: OwnerReference) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            labels: Some(gang_labels(name)),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(gang_labels(name)),
            // Peers must resolve each other before they are ready: rendezvous happens
            // during start-up.
            publish_not_ready_addresses: Some(true),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// The ResourceClaim for `claim`, created from its template's spec.
pub fn claim_from_template(
    workload: &Workload,
    claim: &GangClaim,
    template: &ResourceClaimTemplateSpec,
) -> Result<ResourceClaim, SpecError> {
    made_claim(
        workload,
        claim,
        template.metadata.clone().unwrap_or_default(),
        template.spec.clone(),
    )
}

/// The ResourceClaim serving the extended resources `requests` of `claim`'s pod, marked
/// with where they came from.
pub fn claim_for_extended(
    workload: &Workload,
    claim: &GangClaim,
    requests: &[ExtendedRequest],
) -> Result<ResourceClaim, SpecError> {
    let meta = ObjectMeta {
        annotations: Some(BTreeMap::from([(
            labels::EXTENDED_RESOURCES.to_string(),
            extended::annotation(requests),
        )])),
        ..ObjectMeta::default()
    };
    made_claim(workload, claim, meta, Some(extended::claim_spec(requests)))
}

fn made_claim(
    workload: &Workload,
    claim: &GangClaim,
    template_meta: ObjectMeta,
    spec: Option<k8s_openapi::api::resource::v1::ResourceClaimSpec>,
) -> Result<ResourceClaim, SpecError> {
    let name = workload.metadata.name.as_deref().ok_or(SpecError::Incomplete)?;
    let mut claim_labels = template_meta.labels.unwrap_or_default();
    claim_labels.extend(gang_labels(name));
    claim_labels.insert(labels::CLAIM_NAME.into(), claim.pod_claim_name.clone());
    if let Some(group) = &claim.pod_group {
        claim_labels.insert(labels::POD_GROUP.into(), group.clone());
    }
    // Made with the finalizer its commit would give it, so the commit has no metadata to
    // write (see `admission::claim_writes::commit_finalizers`).
    let finalizers = vec![labels::CLAIM_FINALIZER.to_string()];
    Ok(ResourceClaim {
        metadata: ObjectMeta {
            name: Some(claim.object_name.clone()),
            namespace: workload.metadata.namespace.clone(),
            labels: Some(claim_labels),
            annotations: template_meta.annotations,
            owner_references: Some(vec![owner_reference(workload)?]),
            finalizers: Some(finalizers),
            ..ObjectMeta::default()
        },
        spec,
        status: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_api::v1alpha1::{SharedResourceClaim, WorkloadSpec};

    fn workload(yaml: &str) -> Workload {
        let mut w: Workload = serde_saphyr::from_str(yaml).expect("valid test workload");
        w.metadata.namespace = Some("team-a".into());
        w.metadata.uid = Some("uid-1".into());
        w
    }

    const TRAINING: &str = r#"
apiVersion: muster.dev/v1alpha1
kind: Workload
metadata: {name: llama}
spec:
  priorityClassName: training-high
  podGroups:
  - name: launcher
    replicas: 1
    template:
      metadata: {labels: {app: llama}}
      spec:
        containers: [{name: main, image: busybox}]
  - name: workers
    replicas: 2
    template:
      spec:
        containers:
        - name: main
          image: busybox
          resources: {claims: [{name: gpus}, {name: fabric}]}
        resourceClaims:
        - {name: gpus, resourceClaimTemplateName: eight-gpus}
        - {name: scratch, resourceClaimName: shared-scratch}
  resourceClaims:
  - {name: fabric, resourceClaimTemplateName: imex-channel, podGroups: [workers]}
"#;

    #[test]
    fn claims_of_two_groups_that_would_share_an_object_name_are_refused() {
        let w = workload(
            r#"
apiVersion: muster.dev/v1alpha1
kind: Workload
metadata: {name: w}
spec:
  podGroups:
  - name: a
    replicas: 1
    template:
      spec:
        containers: [{name: main, image: busybox}]
        resourceClaims: [{name: 0-x, resourceClaimTemplateName: gpu}]
  - name: a-0
    replicas: 1
    template:
      spec:
        containers: [{name: main, image: busybox}]
        resourceClaims: [{name: x, resourceClaimTemplateName: gpu}]
"#,
        );
        let error = build(&w, &ExtendedResources::default()).unwrap_err();
        assert_eq!(
            error.to_string(),
            "claim 0-x of pod w-a-0 and claim x of pod w-a-0-0 would both be made as ResourceClaim w-a-0-0-x: rename a pod group or a claim"
        );
    }

    #[test]
    fn pods_are_gated_named_labelled_and_owned() {
        let w = workload(TRAINING);
        let gang = build(&w, &ExtendedResources::default()).unwrap();
        let names: Vec<_> = gang.pods.iter().map(|p| p.metadata.name.clone().unwrap()).collect();
        assert_eq!(names, ["llama-launcher-0", "llama-workers-0", "llama-workers-1"]);
        let pod = &gang.pods[2];
        let labels = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[labels::WORKLOAD], "llama");
        assert_eq!(labels[labels::POD_GROUP], "workers");
        assert_eq!(labels[labels::POD_INDEX], "1");
        let owner = &pod.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.controller),
            ("Workload", "llama", Some(true))
        );
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.scheduling_gates.as_ref().unwrap()[0].name, labels::GANG_GATE);
        assert_eq!(spec.hostname.as_deref(), Some("llama-workers-1"));
        assert_eq!(spec.subdomain.as_deref(), Some("llama"));
        assert_eq!(spec.priority_class_name.as_deref(), Some("training-high"));
        assert_eq!(gang.pods[0].metadata.labels.as_ref().unwrap()["app"], "llama");
    }

    #[test]
    fn template_claims_become_named_claims_and_shared_claims_join_listed_groups() {
        let w = workload(TRAINING);
        let gang = build(&w, &ExtendedResources::default()).unwrap();
        let worker_claims = gang.pods[1].spec.as_ref().unwrap().resource_claims.clone().unwrap();
        let refs: Vec<_> = worker_claims
            .iter()
            .map(|c| {
                (
                    c.name.as_str(),
                    c.resource_claim_name.as_deref(),
                    c.resource_claim_template_name.is_some(),
                )
            })
            .collect();
        assert_eq!(
            refs,
            [
                ("gpus", Some("llama-workers-0-gpus"), false),
                ("scratch", Some("shared-scratch"), false),
                ("fabric", Some("llama-fabric"), false),
            ]
        );
        assert!(
            gang.pods[0].spec.as_ref().unwrap().resource_claims.is_none(),
            "launcher is not in podGroups of fabric"
        );
        let created: Vec<_> = gang
            .claims
            .iter()
            .map(|c| (c.object_name.as_str(), c.pod.as_deref(), c.source.clone()))
            .collect();
        assert_eq!(
            created,
            [
                ("llama-fabric", None, ClaimSource::Template("imex-channel".into())),
                (
                    "llama-workers-0-gpus",
                    Some("llama-workers-0"),
                    ClaimSource::Template("eight-gpus".into())
                ),
                (
                    "llama-workers-1-gpus",
                    Some("llama-workers-1"),
                    ClaimSource::Template("eight-gpus".into())
                ),
            ]
        );
    }

    #[test]
    fn claims_from_templates_carry_labels_owner_and_spec() {
        let w = workload(TRAINING);
        let gang = build(&w, &ExtendedResources::default()).unwrap();
        let template: ResourceClaimTemplateSpec = serde_saphyr::from_str(
            "metadata: {labels: {tier: gpu}}\nspec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.example.com, count: 8}}]}}",
        )
        .unwrap();
        let claim = claim_from_template(&w, &gang.claims[1], &template).unwrap();
        assert_eq!(claim.metadata.name.as_deref(), Some("llama-workers-0-gpus"));
        let l = claim.metadata.labels.unwrap();
        assert_eq!(
            (
                l["tier"].as_str(),
                l[labels::WORKLOAD].as_str(),
                l[labels::CLAIM_NAME].as_str()
            ),
            ("gpu", "llama", "gpus")
        );
        assert_eq!(l[labels::POD_GROUP], "workers");
        assert_eq!(
            claim.spec.unwrap().devices.unwrap().requests.unwrap()[0]
                .exactly
                .as_ref()
                .unwrap()
                .count,
            Some(8)
        );
        let shared = claim_from_template(&w, &gang.claims[0], &template).unwrap();
        assert!(!shared.metadata.labels.unwrap().contains_key(labels::POD_GROUP));
    }

    #[test]
    fn extended_resources_a_device_class_maps_become_a_claim_of_each_pod() {
        let w = workload(
            r#"
apiVersion: muster.dev/v1alpha1
kind: Workload
metadata: {name: w}
spec:
  podGroups:
  - name: workers
    replicas: 2
    template:
      spec:
        containers:
        - {name: main, image: busybox, resources: {limits: {example.com/gpu: "8", cpu: "1"}}}
        resourceClaims: [{name: scratch, resourceClaimTemplateName: scratch}]
"#,
        );
        let extended = ExtendedResources::new([("gpu.example.com", Some("example.com/gpu"))]);
        let gang = build(&w, &extended).unwrap();
        let pod = &gang.pods[1];
        let container = &pod.spec.as_ref().unwrap().containers[0];
        let resources = container.resources.as_ref().unwrap();
        assert_eq!(
            resources.limits.as_ref().unwrap().keys().collect::<Vec<_>>(),
            ["cpu"],
            "the extended resource goes from the pod"
        );
        assert_eq!(resources.claims.as_ref().unwrap()[0].name, extended::CLAIM);
        let recorded = extended::recorded(&pod.metadata).unwrap();
        assert_eq!(
            (recorded[0].resource.as_str(), recorded[0].count),
            ("example.com/gpu", 8)
        );
        let refs: Vec<_> = pod
            .spec
            .as_ref()
            .unwrap()
            .resource_claims
            .iter()
            .flatten()
            .map(|c| c.resource_claim_name.clone().unwrap())
            .collect();
        assert_eq!(refs, ["w-workers-1-scratch", "w-workers-1-extended-resources"]);

        let claim = gang
            .claims
            .iter()
            .find(|c| c.object_name == "w-workers-1-extended-resources")
            .unwrap();
        let ClaimSource::Extended(requests) = &claim.source else {
            panic!("an extended-resources claim: {claim:?}");
        };
        let object = claim_for_extended(&w, claim, requests).unwrap();
        let l = object.metadata.labels.as_ref().unwrap();
        assert_eq!(
            (
                l[labels::WORKLOAD].as_str(),
                l[labels::CLAIM_NAME].as_str(),
                l[labels::POD_GROUP].as_str()
            ),
            ("w", extended::CLAIM, "workers")
        );
        assert_eq!(extended::recorded(&object.metadata).unwrap(), recorded);
        assert_eq!(object.metadata.finalizers.unwrap(), [labels::CLAIM_FINALIZER]);
        assert_eq!(object.metadata.owner_references.unwrap()[0].kind, "Workload");
        let exactly = object.spec.unwrap().devices.unwrap().requests.unwrap()[0]
            .exactly
            .clone()
            .unwrap();
        assert_eq!(
            (exactly.device_class_name.as_str(), exactly.count),
            ("gpu.example.com", Some(8))
        );

        let unmapped = build(&w, &ExtendedResources::default()).unwrap();
        assert!(unmapped.pods[0].metadata.annotations.is_none());
        assert_eq!(unmapped.claims.len(), 2, "only the template claims");

        let both = ExtendedResources::new([
            ("gpu.example.com", Some("example.com/gpu")),
            ("other.example.com", Some("example.com/gpu")),
        ]);
        let error = build(&w, &both).unwrap_err();
        assert!(error.is_cluster_problem(), "{error}");
    }

    #[test]
    fn service_is_headless_and_selects_the_gang() {
        let gang = build(&workload(TRAINING), &ExtendedResources::default()).unwrap();
        let service = gang.service.expect("a Service by default");
        let spec = service.spec.unwrap();
        assert_eq!(service.metadata.name.as_deref(), Some("llama"));
        assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
        assert_eq!(spec.selector.unwrap()[labels::WORKLOAD], "llama");
        assert_eq!(spec.publish_not_ready_addresses, Some(true));
    }

    #[test]
    fn without_dns_hostnames_there_is_no_service_subdomain_or_coordinator_address() {
        let mut w = workload(TRAINING);
        w.spec.network = Some(muster_api::v1alpha1::Network {
            enable_dns_hostnames: Some(false),
        });
        let gang = build(&w, &ExtendedResources::default()).unwrap();
        assert!(gang.service.is_none());
        let spec = gang.pods[0].spec.as_ref().unwrap();
        assert_eq!(spec.subdomain, None);
        assert_eq!(spec.hostname.as_deref(), Some("llama-launcher-0"));
        let env: Vec<&str> = spec.containers[0]
            .env
            .iter()
            .flatten()
            .map(|e| e.name.as_str())
            .collect();
        assert!(env.contains(&"MUSTER_RANK") && env.contains(&"MASTER_PORT"), "{env:?}");
        assert!(
            !env.contains(&"MASTER_ADDR") && !env.contains(&"MUSTER_COORDINATOR_ADDRESS"),
            "{env:?}"
        );
    }

    #[test]
    fn groups_without_template_create_no_pods() {
        let mut w = workload(TRAINING);
        w.spec.pod_groups[1].template = None;
        let gang = build(&w, &ExtendedResources::default()).unwrap();
        assert_eq!(gang.pods.len(), 1);
        assert_eq!(gang.claims.len(), 1, "only the shared claim");
    }

    #[test]
    fn spec_errors_name_the_group_and_claim() {
        let mut w = workload(TRAINING);
        w.spec.resource_claims.push(SharedResourceClaim {
            name: "gpus".into(),
            resource_claim_template_name: Some("x".into()),
            resource_claim_name: None,
            pod_groups: None,
        });
        assert_eq!(
            build(&w, &ExtendedResources::default()).unwrap_err(),
            SpecError::ClaimNameClash {
                group: "workers".into(),
                claim: "gpus".into()
            }
        );

        let mut w = workload(TRAINING);
        let spec = w.spec.pod_groups[1].template.as_mut().unwrap().spec.as_mut().unwrap();
        spec.resource_claims.as_mut().unwrap()[0].resource_claim_name = Some("both".into());
        assert!(
            matches!(build(&w, &ExtendedResources::default()).unwrap_err(), SpecError::AmbiguousPodClaim { claim, .. } if claim == "gpus")
        );

        let mut w = workload(TRAINING);
        w.spec.pod_groups[0].template.as_mut().unwrap().spec = None;
        assert_eq!(
            build(&w, &ExtendedResources::default()).unwrap_err(),
            SpecError::MissingPodSpec {
                group: "launcher".into()
            }
        );

        let w = Workload::new(
            "x",
            WorkloadSpec {
                pod_groups: vec![],
                ..Default::default()
            },
        );
        assert_eq!(
            build(&w, &ExtendedResources::default()).unwrap_err(),
            SpecError::Incomplete
        );
    }
}
