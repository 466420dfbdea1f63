//! What a gang asks for, in the engine's terms: pod groups of identical pods, their
//! node requirements and claims, claims shared by several pods, and topology.

use std::collections::BTreeMap;

use crate::claim::{Allocation, ClaimSpec};
use crate::key::{ClaimKey, ObjectKey, PodKey};
use crate::pod::PodRules;
use crate::resources::Resources;
use crate::selector::{NodeSelector, Toleration};

/// A gang to place.
#[derive(Clone, Debug, Default)]
pub struct GangRequest {
    /// Names the gang in plans and messages, for example `namespace/workload`.
    pub name: String,
    pub groups: Vec<GroupRequest>,
    /// Claims used by more than one pod (gang-shared claims, or an existing claim the
    /// pods refer to by name). Allocated once.
    pub shared_claims: Vec<SharedClaim>,
    pub topology: TopologyRequest,
}

impl GangRequest {
    /// Whether pod `pod` of group `group` comes after the group's `min_count` pods.
    pub fn is_extra(&self, group: &str, pod: &PodKey) -> bool {
        self.groups
            .iter()
            .find(|g| g.name == group)
            .and_then(|g| g.pods.iter().position(|p| p.key == *pod).map(|i| i >= g.min_count))
            .unwrap_or(false)
    }
}

/// Topology constraints as node label keys.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopologyRequest {
    /// Every pod on nodes sharing one value of this label.
    pub required: Option<String>,
    /// Prefer one value of this (finer) label.
    pub preferred: Option<String>,
    /// Still finer levels to prefer within `preferred`, coarse to fine: the gang goes into
    /// one value of the finest level that can hold it, and otherwise fills the values of
    /// each level roomiest first, so that it spans as few as possible. The node name's
    /// label as the last level packs the gang onto as few nodes as possible.
    pub preferred_levels: Vec<String>,
}

impl TopologyRequest {
    /// The preferred levels, coarse to fine: `preferred`, then `preferred_levels`.
    pub fn preferences(&self) -> Vec<&str> {
        self.preferred
            .iter()
            .chain(&self.preferred_levels)
            .map(String::as_str)
            .collect()
    }
}

/// Topology of one group, within the gang's required domain.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupTopology {
    /// Every pod of the group on nodes sharing one value of this label.
    pub required: Option<String>,
    /// Each run of consecutive pods (by index) of this many pods on nodes sharing one
    /// value of the slice's label: for example one tensor-parallel group per NVLink domain.
    pub slice: Option<SliceRequest>,
}

impl GroupTopology {
    pub fn is_empty(&self) -> bool {
        self.required.is_none() && self.slice.is_none()
    }
}

/// Slices of a group: `size` consecutive pods within one value of `key`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceRequest {
    pub key: String,
    pub size: usize,
}

/// A claim several pods use.
#[derive(Clone, Debug)]
pub struct SharedClaim {
    pub key: ClaimKey,
    pub spec: ClaimSpec,
    /// Already allocated: the allocation stands and constrains the nodes.
    pub allocation: Option<Allocation>,
}

/// A group of identical pods.
#[derive(Clone, Debug, Default)]
pub struct GroupRequest {
    pub name: String,
    /// Pods that must be placed for the gang to start.
    pub min_count: usize,
    pub shape: PodShape,
    /// The group's pods, in index order; the first `min_count` are the gang's core.
    pub pods: Vec<PodInstance>,
    /// Where the group's pods go relative to each other.
    pub topology: GroupTopology,
    /// Topology domains a quota manager assigned to the group (Kueue's Topology-Aware
    /// Scheduling): its pods go only to their nodes, at most so many per domain. Empty:
    /// none assigned.
    pub assigned: Vec<AssignedDomain>,
}

/// One assigned topology domain: its nodes and how many of the group's pods it takes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AssignedDomain {
    /// Names the domain in messages, for example `example.com/rack=rack-0001`.
    pub name: String,
    pub nodes: std::collections::BTreeSet<String>,
    pub pods: usize,
}

/// What every pod of a group needs from a node.
#[derive(Clone, Debug, Default)]
pub struct PodShape {
    pub requests: Resources,
    /// `spec.nodeSelector`.
    pub node_selector: BTreeMap<String, String>,
    /// Required node affinity.
    pub affinity: Option<NodeSelector>,
    pub tolerations: Vec<Toleration>,
    /// Claims each pod has for itself, in the pod's order: one spec for the whole group,
    /// each pod's own [`PodInstance::claims`] in the same order.
    pub claims: Vec<ClaimSpec>,
    /// Indices into [`GangRequest::shared_claims`] of the shared claims the pods use.
    pub shared: Vec<usize>,
    /// Labels, inter-pod (anti-)affinity, topology spread and host ports.
    pub rules: PodRules,
}

/// One pod of a group.
#[derive(Clone, Debug)]
pub struct PodInstance {
    pub key: PodKey,
    /// The pod's own claims, aligned by index with its group's [`PodShape::claims`]: the
    /// shape holds what each claim asks for (the same for every pod of the group), this
    /// holds which claim object it is for this pod.
    pub claims: Vec<PodClaim>,
    /// The PersistentVolumeClaims of the pod's volumes (`namespace/name`), in the pod's
    /// order: a claim by name, or the one made for a generic ephemeral volume.
    pub volumes: Vec<ObjectKey>,
}

impl PodInstance {
    /// A pod with its own claims and no volumes.
    pub fn new(key: PodKey, claims: Vec<PodClaim>) -> Self {
        PodInstance {
            key,
            claims,
            volumes: Vec::new(),
        }
    }

    /// Whether the pod has claims of its own and every one is allocated already: it needs
    /// no devices, only room on the nodes those allocations allow.
    pub fn claims_all_allocated(&self) -> bool {
        !self.claims.is_empty() && self.claims.iter().all(|c| c.allocation.is_some())
    }
}

/// One of a pod's own claims.
#[derive(Clone, Debug)]
pub struct PodClaim {
    pub key: ClaimKey,
    /// The allocation the claim already has: kept, and constraining the pod's node.
    pub allocation: Option<Allocation>,
}

impl PodClaim {
    /// A claim not allocated yet.
    pub fn unallocated(key: ClaimKey) -> Self {
        PodClaim { key, allocation: None }
    }
}

impl GroupRequest {
    /// A group of `replicas` pods named `<prefix>-<index>` whose claims are named
    /// `<pod>-<claim index>`.
    pub fn uniform(name: &str, namespace: &str, replicas: usize, min_count: usize, shape: PodShape) -> Self {
        let pods = (0..replicas)
            .map(|i| {
                let pod = format!("{name}-{i}");
                PodInstance::new(
                    PodKey::new(namespace, &pod),
                    (0..shape.claims.len())
                        .map(|c| PodClaim::unallocated(ClaimKey::new(namespace, &format!("{pod}-claim-{c}"))))
                        .collect(),
                )
            })
            .collect();
        GroupRequest {
            name: name.to_string(),
            min_count,
            shape,
            pods,
            topology: GroupTopology::default(),
            assigned: Vec::new(),
        }
    }
}
