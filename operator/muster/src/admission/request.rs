//! A Workload as the engine's gang request: its pods as [`crate::workload::gang`] builds them,
//! their node requirements, their claims (from existing claims where they exist, else
//! from the ResourceClaimTemplates they will be created from) and the topology.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use muster_api::Workload;
use muster_api::labels;
use muster_engine::claim::{Allocation, ClaimSpec};
use muster_engine::key::{ClaimKey, ObjectKey, PodKey};
use muster_engine::request::{
    GangRequest, GroupRequest, GroupTopology, PodClaim, PodInstance, SharedClaim, SliceRequest, TopologyRequest,
};

use crate::convert::{self, ConvertError};
use crate::workload::admitted::{AdmissionError, PodDefaults};
use crate::workload::extended::{self, ExtendedResources};
use crate::workload::gang::{self, ClaimSource};
use crate::workload::membership;

/// Why a Workload cannot be turned into a gang request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    Spec(#[from] gang::SpecError),
    #[error(transparent)]
    Convert(#[from] ConvertError),
    #[error("ResourceClaimTemplate {0} does not exist")]
    MissingTemplate(String),
    #[error("ResourceClaim {0} does not exist")]
    MissingClaim(String),
    #[error("ResourceClaim {0} is being deleted: kube-scheduler refuses pods that use it")]
    ClaimBeingDeleted(String),
    #[error(
        "pod group {group} has {have} of its {need} pods; they come from another controller and join with the \
         muster.dev/workload and muster.dev/pod-group labels"
    )]
    TooFewPods { group: String, have: usize, need: i32 },
    #[error("pod {pod} has no ResourceClaim for its claim {claim} yet (kube-controller-manager creates it)")]
    ClaimNotGenerated { pod: String, claim: String },
    #[error(
        "pod group {group}: pod {pod} asks for other resources, node constraints or claims than pod {first}; \
         the pods of a group must be alike"
    )]
    UnlikePods { group: String, first: String, pod: String },
    #[error("ResourceClaim {0} was deallocated when a commit was undone; waiting to see it free")]
    DeallocationNotSeen(String),
    #[error("pod {pod}: the API server would refuse it: {source}")]
    Admission {
        pod: String,
        #[source]
        source: AdmissionError,
    },
}

impl RequestError {
    /// Whether the Workload itself is wrong, for good: its spec cannot change, so no
    /// change of the cluster mends it. A missing template may still be created, pods of a
    /// group that differ (a rollout under way) may become alike again.
    pub fn is_permanent(&self) -> bool {
        // A conversion error can come from objects other than the spec (a claim named by
        // `resourceClaimName`, a member pod, a template that may be made again), and some
        // spec errors from the cluster (two DeviceClasses mapping one extended resource
        // during a driver rollout): only the spec's own errors are for good.
        matches!(self, RequestError::Spec(e) if !e.is_cluster_problem())
    }

    /// Whether the gang waits for an object that another controller or a user must make
    /// and may never make (its pods, a claim), rather than for muster's own caches.
    pub fn may_never_come(&self) -> bool {
        matches!(
            self,
            RequestError::MissingClaim(_)
                | RequestError::ClaimBeingDeleted(_)
                | RequestError::ClaimNotGenerated { .. }
                | RequestError::TooFewPods { .. }
        )
    }

    /// Whether the gang only waits for an object to appear, rather than being wrong.
    pub fn is_waiting(&self) -> bool {
        matches!(
            self,
            RequestError::MissingClaim(_)
                | RequestError::ClaimBeingDeleted(_)
                | RequestError::ClaimNotGenerated { .. }
                | RequestError::TooFewPods { .. }
                | RequestError::DeallocationNotSeen(_)
        )
    }
}

/// Claims and templates the gang may refer to, by `namespace/name`.
#[derive(Debug, Default)]
pub struct ClaimSources<'a> {
    pub templates: BTreeMap<ObjectKey, &'a ResourceClaimTemplate>,
    pub claims: BTreeMap<ClaimKey, &'a ResourceClaim>,
    /// Claims only, as the operator sees them: a claim not among them does not exist
    /// yet (it is waited for), rather than being taken from its template.
    claims_only: bool,
}

impl<'a> ClaimSources<'a> {
    pub fn new(templates: &'a [ResourceClaimTemplate], claims: &'a [ResourceClaim]) -> Self {
        ClaimSources {
            templates: templates.iter().map(|t| (convert::object_key(t), t)).collect(),
            claims: claims.iter().map(|c| (convert::claim_key(c), c)).collect(),
            claims_only: false,
        }
    }

    /// Claims only (no templates), from wherever they are kept.
    pub fn from_claims(claims: impl IntoIterator<Item = &'a ResourceClaim>) -> Self {
        ClaimSources {
            templates: BTreeMap::new(),
            claims: claims.into_iter().map(|c| (convert::claim_key(c), c)).collect(),
            claims_only: true,
        }
    }

    /// The spec (and allocation, if any) of claim object `name`: the claim's own when it
    /// exists, else its template's.
    fn resolve(
        &self,
        namespace: &str,
        name: &str,
        template: Option<&str>,
    ) -> Result<(ClaimSpec, Option<Allocation>), RequestError> {
        let key = ClaimKey::new(namespace, name);
        if let Some(claim) = self.claims.get(&key) {
            // One of muster's being deleted is given back by muster first, as any other.
            if claim.metadata.deletion_timestamp.is_some() && !super::ownership::muster_allocated(claim) {
                return Err(RequestError::ClaimBeingDeleted(key.to_string()));
            }
            let object = format!("ResourceClaim {key}");
            let spec = convert::claim_spec(&object, &claim.spec.clone().unwrap_or_default())?;
            let allocation = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .map(|a| convert::allocation(&object, a))
                .transpose()?;
            return Ok((spec, allocation));
        }
        let Some(template) = template.filter(|_| !self.claims_only) else {
            return Err(RequestError::MissingClaim(key.to_string()));
        };
        let template_key = ObjectKey::new(namespace, template);
        let found = self
            .templates
            .get(&template_key)
            .ok_or_else(|| RequestError::MissingTemplate(template_key.to_string()))?;
        let spec = found.spec.clone().and_then(|s| s.spec).unwrap_or_default();
        Ok((
            convert::claim_spec(&format!("ResourceClaimTemplate {template_key}"), &spec)?,
            None,
        ))
    }
}

impl ClaimSources<'_> {
    /// Like [`ClaimSources::resolve`], for the claim muster makes for a pod's extended
    /// resources: the claim's own spec once it exists, else the one it will be made with.
    fn resolve_extended(
        &self,
        namespace: &str,
        name: &str,
        requests: &[extended::ExtendedRequest],
    ) -> Result<(ClaimSpec, Option<Allocation>), RequestError> {
        if self.claims_only || self.claims.contains_key(&ClaimKey::new(namespace, name)) {
            return self.resolve(namespace, name, None);
        }
        let object = format!("ResourceClaim {namespace}/{name} (extended resources)");
        Ok((convert::claim_spec(&object, &extended::claim_spec(requests))?, None))
    }
}

/// The gang request for `workload`, planned from its pods as the API server stored them:
/// `stored` holds the Workload's pods. The pods of a group without a template come from
/// another controller ([`membership::external_members`]); those of a group with one are
/// muster's, planned as stored (with the defaults, overhead and injected containers
/// admission gave them) or, where one is not stored yet, as built with `defaults`.
/// `extended` says which extended resources the pods get through their own claims.
pub fn gang_request(
    workload: &Workload,
    extended: &ExtendedResources,
    sources: &ClaimSources<'_>,
    stored: &[Arc<Pod>],
    defaults: &PodDefaults,
) -> Result<GangRequest, RequestError> {
    let external = stored;
    let gang = gang::build(workload, extended)?;
    let namespace = workload.metadata.namespace.clone().unwrap_or_default();
    let name = workload.metadata.name.clone().unwrap_or_default();

    // Which claim objects belong to one pod, and where the rest come from.
    let per_pod: BTreeMap<&str, &gang::GangClaim> = gang
        .claims
        .iter()
        .filter(|c| c.pod.is_some())
        .map(|c| (c.object_name.as_str(), c))
        .collect();
    let gang_templates: BTreeMap<&str, &str> = gang
        .claims
        .iter()
        .filter(|c| c.pod.is_none())
        .filter_map(|c| match &c.source {
            ClaimSource::Template(t) => Some((c.object_name.as_str(), t.as_str())),
            ClaimSource::Existing | ClaimSource::Extended(_) => None,
        })
        .collect();

    let mut shared: Vec<SharedClaim> = Vec::new();
    let mut shared_index: BTreeMap<String, usize> = BTreeMap::new();
    let mut groups: Vec<GroupRequest> = Vec::new();
    for group in &workload.spec.pod_groups {
        let made_elsewhere = group.template.is_none();
        // Another controller's pods as they were before muster released them: a
        // replacement at the gate is alike the released pods of its group.
        let unreleased: Vec<Pod>;
        let own: Vec<Pod>;
        // A member that succeeded counts toward minCount and is not placed again: its
        // controller does not run that index again (a Job's gang requeued after some of
        // its pods completed).
        let mut succeeded = 0;
        let pods: Vec<&Pod> = if made_elsewhere {
            let members = membership::external_members(external, group);
            succeeded = members.iter().filter(|p| membership::succeeded(p)).count();
            unreleased = members
                .into_iter()
                .filter(|p| !membership::succeeded(p))
                .map(crate::admission::release::as_before_release)
                .collect();
            unreleased.iter().collect()
        } else {
            own = gang
                .pods
                .iter()
                .filter(|p| p.metadata.labels.as_ref().and_then(|l| l.get(labels::POD_GROUP)) == Some(&group.name))
                .map(|built| as_stored(built, external, &namespace, defaults))
                .collect::<Result<_, _>>()?;
            own.iter().collect()
        };
        let need = usize::try_from(group.min_count())
            .unwrap_or(0)
            .saturating_sub(succeeded);
        if made_elsewhere && pods.len() < need {
            return Err(RequestError::TooFewPods {
                group: group.name.clone(),
                have: pods.len() + succeeded,
                need: group.min_count(),
            });
        }
        let Some(first) = pods.first() else { continue };
        if made_elsewhere {
            check_alike(&group.name, &pods)?;
        }
        let spec = first.spec.clone().unwrap_or_default();
        let object = format!("Workload {namespace}/{name} pod group {}", group.name);
        let mut shape = convert::pod_shape(&object, first)?;
        // Claim order as in the pod: own claims feed `claims`, the rest `shared`.
        let mut own_names: Vec<&str> = Vec::new();
        for claim in spec.resource_claims.iter().flatten() {
            if made_elsewhere && claim.resource_claim_template_name.is_some() {
                // kube-controller-manager made one claim per pod from the template; the
                // first pod's stands for the group (the pods are alike).
                let object_name = generated(first, &claim.name)?;
                let (claim_spec, _) = sources.resolve(&namespace, object_name, None)?;
                shape.claims.push(claim_spec);
                own_names.push(claim.name.as_str());
                continue;
            }
            let object_name = claim.resource_claim_name.as_deref().unwrap_or_default();
            if let Some(gang_claim) = per_pod.get(object_name) {
                let (claim_spec, _) = match &gang_claim.source {
                    ClaimSource::Template(template) => sources.resolve(&namespace, object_name, Some(template))?,
                    ClaimSource::Extended(requests) => sources.resolve_extended(&namespace, object_name, requests)?,
                    ClaimSource::Existing => continue,
                };
                shape.claims.push(claim_spec);
                own_names.push(claim.name.as_str());
            } else {
                let index = match shared_index.get(object_name) {
                    Some(index) => *index,
                    None => {
                        let template = gang_templates.get(object_name).copied();
                        let (spec, allocation) = sources.resolve(&namespace, object_name, template)?;
                        shared.push(SharedClaim {
                            key: ClaimKey::new(&namespace, object_name),
                            spec,
                            allocation,
                        });
                        shared_index.insert(object_name.to_string(), shared.len() - 1);
                        shared.len() - 1
                    }
                };
                shape.shared.push(index);
            }
        }
        let instances = pods
            .iter()
            .copied()
            .map(|pod| {
                let pod_name = pod.metadata.name.clone().unwrap_or_default();
                let mut claims = Vec::new();
                for own in &own_names {
                    let object_name = if made_elsewhere {
                        generated(pod, own)?.to_string()
                    } else {
                        gang::pod_claim_object_name(&pod_name, own)
                    };
                    let key = ClaimKey::new(&namespace, &object_name);
                    let existing = sources.claims.get(&key);
                    if existing.is_none() && sources.claims_only {
                        return Err(RequestError::MissingClaim(key.to_string()));
                    }
                    let allocation = existing
                        .and_then(|c| c.status.as_ref()?.allocation.as_ref())
                        .map(|a| convert::allocation(&format!("ResourceClaim {key}"), a))
                        .transpose()?;
                    claims.push(PodClaim { key, allocation });
                }
                Ok(PodInstance {
                    key: PodKey::new(&namespace, &pod_name),
                    claims,
                    volumes: pod
                        .spec
                        .as_ref()
                        .map(|spec| convert::scheduling::volume_claims(&namespace, &pod_name, spec))
                        .unwrap_or_default(),
                })
            })
            .collect::<Result<Vec<_>, RequestError>>()?;
        let topology = group.topology.clone().unwrap_or_default();
        groups.push(GroupRequest {
            name: group.name.clone(),
            min_count: need.min(instances.len()),
            shape,
            pods: instances,
            topology: GroupTopology {
                required: topology.required,
                slice: topology.slice.map(|slice| SliceRequest {
                    key: slice.required,
                    size: usize::try_from(slice.size).unwrap_or(1).max(1),
                }),
            },
            // Kueue's topology assignment, if any, is added where the gang is planned.
            assigned: Vec::new(),
        });
    }
    let topology = workload.spec.topology.clone().unwrap_or_default();
    Ok(GangRequest {
        name: format!("{namespace}/{name}"),
        groups,
        shared_claims: shared,
        topology: TopologyRequest {
            required: topology.required,
            preferred: topology.preferred,
            preferred_levels: topology.preferred_levels,
        },
    })
}

/// The pod `built` as the API server stored it: the stored pod of that name and attempt
/// (as before its release), else `built` with the admission `defaults`. The stored one is
/// what kube-scheduler sees: LimitRange defaults, a RuntimeClass's overhead, containers a
/// mutating webhook injected.
fn as_stored(built: &Pod, stored: &[Arc<Pod>], namespace: &str, defaults: &PodDefaults) -> Result<Pod, RequestError> {
    let name = built.metadata.name.as_deref().unwrap_or_default();
    let attempt = built.metadata.labels.as_ref().and_then(|l| l.get(labels::ATTEMPT));
    let found = stored.iter().find(|p| {
        p.metadata.name.as_deref() == Some(name)
            && p.metadata.deletion_timestamp.is_none()
            && p.metadata.labels.as_ref().and_then(|l| l.get(labels::ATTEMPT)) == attempt
    });
    if let Some(pod) = found {
        return Ok(crate::admission::release::as_before_release(pod));
    }
    let mut pod = built.clone();
    defaults
        .apply(namespace, &mut pod)
        .map_err(|source| RequestError::Admission {
            pod: format!("{namespace}/{name}"),
            source,
        })?;
    Ok(pod)
}

/// The claim kube-controller-manager generated for a pod's claim entry.
fn generated<'p>(pod: &'p Pod, claim: &str) -> Result<&'p str, RequestError> {
    membership::generated_claim(pod, claim).ok_or_else(|| RequestError::ClaimNotGenerated {
        pod: format!(
            "{}/{}",
            pod.metadata.namespace.as_deref().unwrap_or_default(),
            pod.metadata.name.as_deref().unwrap_or_default()
        ),
        claim: claim.to_string(),
    })
}

/// What the engine plans with for one pod: it must be the same for every pod of a group.
fn planning_view(pod: &Pod) -> serde_json::Value {
    let spec = pod.spec.clone().unwrap_or_default();
    let ports: Vec<String> = convert::scheduling::host_ports(&spec)
        .iter()
        .map(ToString::to_string)
        .collect();
    let resources = |containers: &[k8s_openapi::api::core::v1::Container]| {
        containers
            .iter()
            .map(|c| serde_json::json!([c.resources, c.restart_policy]))
            .collect::<Vec<_>>()
    };
    let claims: Vec<_> = spec
        .resource_claims
        .iter()
        .flatten()
        .map(|c| serde_json::json!([c.name, c.resource_claim_name, c.resource_claim_template_name]))
        .collect();
    serde_json::json!({
        "containers": resources(&spec.containers),
        "init": resources(spec.init_containers.as_deref().unwrap_or_default()),
        "overhead": spec.overhead,
        "resources": spec.resources,
        "nodeSelector": spec.node_selector,
        "affinity": spec.affinity,
        "topologySpreadConstraints": spec.topology_spread_constraints,
        "hostNetwork": spec.host_network,
        "ports": ports,
        "tolerations": spec.tolerations,
        "claims": claims,
    })
}

/// Pods another controller made for one group must be alike: the engine plans a group
/// with one shape.
fn check_alike(group: &str, pods: &[&Pod]) -> Result<(), RequestError> {
    let first = planning_view(pods[0]);
    match pods.iter().skip(1).find(|p| planning_view(p) != first) {
        None => Ok(()),
        Some(pod) => Err(RequestError::UnlikePods {
            group: group.to_string(),
            first: pods[0].metadata.name.clone().unwrap_or_default(),
            pod: pod.metadata.name.clone().unwrap_or_default(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILES: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: eight-gpus, namespace: team}
spec: {spec: {devices: {requests: [{name: gpus, exactly: {deviceClassName: gpu.example.com, count: 8}}]}}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: scratch, namespace: team}
spec: {devices: {requests: [{name: disk, exactly: {deviceClassName: disk.example.com}}]}}
---
apiVersion: muster.dev/v1alpha1
kind: Workload
metadata: {name: llama, namespace: team, uid: u1}
spec:
  topology: {required: example.com/rack}
  podGroups:
  - name: launcher
    replicas: 1
    template: {spec: {containers: [{name: l, resources: {requests: {cpu: "2"}}}]}}
  - name: workers
    replicas: 3
    minCount: 2
    template:
      spec:
        tolerations: [{key: gpu, operator: Exists}]
        containers: [{name: w, resources: {requests: {cpu: "16", memory: 64Gi}}}]
        resourceClaims:
        - {name: gpus, resourceClaimTemplateName: eight-gpus}
        - {name: scratch, resourceClaimName: scratch}
  resourceClaims:
  - {name: fabric, resourceClaimTemplateName: eight-gpus, podGroups: [workers]}
"#;

    #[test]
    fn workload_becomes_groups_with_own_and_shared_claims() {
        let objects = crate::snapshot::Objects::parse("files.yaml", FILES).unwrap();
        let sources = ClaimSources::new(&objects.templates, &objects.claims);
        let request = gang_request(
            &objects.workloads[0],
            &ExtendedResources::default(),
            &sources,
            &[],
            &PodDefaults::default(),
        )
        .unwrap();
        assert_eq!(request.name, "team/llama");
        assert_eq!(request.topology.required.as_deref(), Some("example.com/rack"));
        let names: Vec<_> = request
            .groups
            .iter()
            .map(|g| (g.name.as_str(), g.pods.len(), g.min_count))
            .collect();
        assert_eq!(names, [("launcher", 1, 1), ("workers", 3, 2)]);
        let workers = &request.groups[1];
        assert_eq!(workers.shape.requests.cpu_millis, 16_000);
        // Its own, and the two the API server adds (DefaultTolerationSeconds).
        assert_eq!(workers.shape.tolerations.len(), 3);
        assert_eq!(workers.shape.claims.len(), 1, "one claim per pod");
        let keys: Vec<_> = workers.pods[2].claims.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(keys, ["team/llama-workers-2-gpus"]);
        let shared: Vec<_> = request.shared_claims.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(shared, ["team/scratch", "team/llama-fabric"]);
        assert_eq!(workers.shape.shared, [0, 1]);
        assert!(request.groups[0].shape.claims.is_empty() && request.groups[0].shape.shared.is_empty());
    }

    #[test]
    fn missing_templates_and_claims_are_named() {
        let objects = crate::snapshot::Objects::parse("files.yaml", FILES).unwrap();
        let sources = ClaimSources::new(&[], &objects.claims);
        let e = gang_request(
            &objects.workloads[0],
            &ExtendedResources::default(),
            &sources,
            &[],
            &PodDefaults::default(),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "ResourceClaimTemplate team/eight-gpus does not exist");
        let sources = ClaimSources::new(&objects.templates, &[]);
        let e = gang_request(
            &objects.workloads[0],
            &ExtendedResources::default(),
            &sources,
            &[],
            &PodDefaults::default(),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "ResourceClaim team/scratch does not exist");
    }

    #[test]
    fn a_claim_another_allocator_made_that_is_being_deleted_is_waited_out() {
        let objects = crate::snapshot::Objects::parse("files.yaml", FILES).unwrap();
        let mut claims = objects.claims.clone();
        for claim in claims
            .iter_mut()
            .filter(|c| c.metadata.name.as_deref() == Some("scratch"))
        {
            claim.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        }
        let sources = ClaimSources::new(&objects.templates, &claims);
        let e = gang_request(
            &objects.workloads[0],
            &ExtendedResources::default(),
            &sources,
            &[],
            &PodDefaults::default(),
        )
        .unwrap_err();
        assert_eq!(e, RequestError::ClaimBeingDeleted("team/scratch".into()));
        assert!(e.is_waiting() && !e.is_permanent(), "it goes, and may be made again");
    }

    #[test]
    fn a_groups_pods_are_planned_as_stored_else_as_admission_would_store_them() {
        let objects = crate::snapshot::Objects::parse("files.yaml", FILES).unwrap();
        let sources = ClaimSources::new(&objects.templates, &objects.claims);
        let workload = &objects.workloads[0];
        let built = gang::build(workload, &ExtendedResources::default()).unwrap();
        // The launcher as stored: a webhook added a sidecar of 1 CPU.
        let mut launcher = built
            .pods
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some("llama-launcher-0"))
            .unwrap()
            .clone();
        launcher.metadata.namespace = Some("team".into());
        let sidecar: k8s_openapi::api::core::v1::Container =
            serde_json::from_value(serde_json::json!({"name": "mesh", "restartPolicy": "Always",
                "resources": {"requests": {"cpu": "1"}}}))
            .unwrap();
        launcher.spec.as_mut().unwrap().init_containers = Some(vec![sidecar]);
        let mut deleting = launcher.clone();
        deleting.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
        let mut older = launcher.clone();
        older
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert(labels::ATTEMPT.into(), "7".into());
        let limit_range: k8s_openapi::api::core::v1::LimitRange = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "defaults", "namespace": "team"},
            "spec": {"limits": [{"type": "Container", "defaultRequest": {"cpu": "3", "memory": "1Gi"}}]},
        }))
        .unwrap();
        let defaults = PodDefaults::new([limit_range], [], false);
        let cpu_of = |request: &GangRequest, group: usize| request.groups[group].shape.requests.cpu_millis;

        let stored = [Arc::new(launcher)];
        let request = gang_request(workload, &ExtendedResources::default(), &sources, &stored, &defaults).unwrap();
        assert_eq!(cpu_of(&request, 0), 3_000, "the stored launcher with its sidecar");
        // The workers are not stored: built, their memory defaulted, their CPU their own.
        assert_eq!(cpu_of(&request, 1), 16_000);
        assert_eq!(request.groups[1].shape.requests.memory, 64 << 30);

        // A stored pod that is going, or of another attempt, is not the one to plan.
        for other in [deleting, older] {
            let request = gang_request(
                workload,
                &ExtendedResources::default(),
                &sources,
                &[Arc::new(other)],
                &defaults,
            )
            .unwrap();
            assert_eq!(cpu_of(&request, 0), 2_000, "the launcher as built");
        }
        let request = gang_request(workload, &ExtendedResources::default(), &sources, &[], &defaults).unwrap();
        assert_eq!(
            request.groups[0].shape.requests.memory,
            1 << 30,
            "the LimitRange's default"
        );
    }
}
