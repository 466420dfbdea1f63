//! `muster.dev/v1alpha1`: the Workload custom resource.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// Upper bound on a pod group's replicas. Pod indexes stay within four digits, which
/// the name-length rules below rely on.
pub const MAX_REPLICAS: i32 = 10_000;
/// Upper bound on pod groups per Workload.
pub const MAX_POD_GROUPS: usize = 16;
/// Upper bound on gang-shared claims per Workload.
pub const MAX_SHARED_CLAIMS: usize = 32;
/// Upper bound on the pods of a Workload, all groups together, so that its recorded
/// placement (`status.placement`, a pod name and node per pod) stays far below the
/// object size etcd accepts.
pub const MAX_PODS: i32 = 4096;
/// Longest `<workload>` + `<group>` so that `<workload>-<group>-<index>` (index up to
/// 9999) is a valid DNS label (63 characters): pod names double as hostnames.
pub const MAX_WORKLOAD_AND_GROUP_NAME: usize = 63 - 2 - 4;

/// A gang of pods that is placed, reserved and started as one unit.
///
/// muster creates the pods of every pod group with a scheduling gate, plans the whole gang
/// (nodes and DRA devices), reserves every ResourceClaim of the gang at once and only then
/// releases the pods to kube-scheduler, pinned to the planned nodes.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[kube(
    group = "muster.dev",
    version = "v1alpha1",
    kind = "Workload",
    plural = "workloads",
    shortname = "mw",
    category = "muster",
    namespaced,
    status = "WorkloadStatus",
    derive = "PartialEq",
    doc = "Workload is a gang of pods that muster places, reserves and starts as one unit.",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase","description":"Lifecycle phase of the gang"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyPods","description":"Pods that are ready"}"#,
    printcolumn = r#"{"name":"Pods","type":"integer","jsonPath":".status.pods","description":"Pods the gang asks for"}"#,
    printcolumn = r#"{"name":"Restarts","type":"integer","jsonPath":".status.restarts","description":"Gang restarts so far"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    validation = Rule::new("self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message("metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter): it names the gang's headless Service"),
    validation = Rule::new("self.spec.podGroups.all(g, size(self.metadata.name) + size(g.name) <= 57)").message("metadata.name and each pod group name may have at most 57 characters together, so that pod names <workload>-<group>-<index> stay valid DNS labels (63 characters)"),
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.successPolicy) || !has(self.successPolicy.podGroups) || self.successPolicy.podGroups.all(n, self.podGroups.exists(g, g.name == n))").message("successPolicy.podGroups may only name pod groups of this Workload"),
    validation = Rule::new("!has(self.resourceClaims) || self.resourceClaims.all(c, !has(c.podGroups) || c.podGroups.all(n, self.podGroups.exists(g, g.name == n)))").message("resourceClaims[].podGroups may only name pod groups of this Workload"),
    validation = Rule::new("!has(self.failurePolicy) || !has(self.failurePolicy.rules) || self.failurePolicy.rules.all(r, !has(r.podGroups) || r.podGroups.all(n, self.podGroups.exists(g, g.name == n)))").message("failurePolicy.rules[].podGroups may only name pod groups of this Workload"),
    validation = Rule::new("self.podGroups.map(g, g.replicas).sum() <= 4096").message("a Workload may have at most 4096 pods in all groups together, so that its placement can be recorded in its status"),
    validation = Rule::new("!has(self.resourceClaims) || self.resourceClaims.all(c, !has(c.resourceClaimTemplateName) || self.podGroups.all(g, !c.name.matches('^' + g.name + '-[0-9]+-')))").message("a shared claim made from a template may not be named <group>-<index>-<name>: its object <workload>-<claim> would be the name of a pod's claim <workload>-<group>-<index>-<name>"),
    validation = Rule::new("has(self.priorityClassName) == has(oldSelf.priorityClassName) && (!has(self.priorityClassName) || self.priorityClassName == oldSelf.priorityClassName)").message("priorityClassName is immutable: a gang's priority decides whom it may preempt, so it is fixed when the Workload is created; delete and recreate the Workload to change it"),
)]
pub struct WorkloadSpec {
    /// When true, the gang holds nothing: no pods run and every device reservation is
    /// released. Setting it back to false queues the gang again. Queue controllers such as
    /// Kueue use this field to admit a Workload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspend: Option<bool>,

    /// PriorityClass of the gang's pods. Higher priority gangs are admitted first; the
    /// class is also set on every pod. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub priority_class_name: Option<String>,

    /// Where the whole gang must land, expressed as node label keys. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("topology is immutable; delete and recreate the Workload to change it"))]
    pub topology: Option<Topology>,

    /// The groups of pods that make up the gang. Immutable once created.
    #[schemars(length(min = 1, max = 16))]
    #[x_kube(
        validation = Rule::new("self.all(g, self.exists_one(h, h.name == g.name))").message("pod group names must be unique within a Workload"),
        validation = Rule::new("self == oldSelf").message("podGroups are immutable; delete and recreate the Workload to change them"),
    )]
    pub pod_groups: Vec<PodGroup>,

    /// ResourceClaims shared by the whole gang: muster creates one claim per Workload for
    /// each entry (named `<workload>-<name>`) and adds it to the pods of the listed pod
    /// groups. Containers use it by listing `name` in `resources.claims`. Immutable.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    #[x_kube(
        validation = Rule::new("self.all(c, self.exists_one(d, d.name == c.name))").message("shared resource claim names must be unique within a Workload"),
        validation = Rule::new("self == oldSelf").message("resourceClaims are immutable; delete and recreate the Workload to change them"),
    )]
    pub resource_claims: Vec<SharedResourceClaim>,

    /// What happens when a pod of the gang fails or its node is lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_policy: Option<FailurePolicy>,

    /// When the Workload counts as succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub success_policy: Option<SuccessPolicy>,

    /// Seconds after the Workload finished (Succeeded or Failed) when muster deletes it.
    /// Unset: the Workload is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_finished: Option<i32>,

    /// How the gang's pods find each other. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("network is immutable; delete and recreate the Workload to change it"))]
    pub network: Option<Network>,
}

/// How the pods muster makes find each other.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Network {
    /// Whether muster makes the headless Service named after the Workload, which gives
    /// every pod it makes the hostname `<workload>-<group>-<index>.<workload>` and lets
    /// `MUSTER_COORDINATOR_ADDRESS` / `MASTER_ADDR` name pod 0 of the first group. Default
    /// true. Set false for a gang that needs no rendezvous by name (independent workers,
    /// or its own discovery): no Service is made and the coordinator variables are not
    /// set. Gangs of other controllers' pods never get one (their controller names them).
    #[serde(default, rename = "enableDNSHostnames", skip_serializing_if = "Option::is_none")]
    pub enable_dns_hostnames: Option<bool>,
}

impl WorkloadSpec {
    /// Whether the gang's pods get hostnames under a headless Service (see [`Network`]).
    pub fn dns_hostnames(&self) -> bool {
        self.network.as_ref().and_then(|n| n.enable_dns_hostnames) != Some(false)
    }
}

/// Topology constraints for the whole gang, as node label keys.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.preferredLevels) || size(self.preferredLevels) == 0 || has(self.preferred)").message("topology.preferredLevels are finer levels within topology.preferred: set preferred too"),
    validation = Rule::new("!has(self.preferredLevels) || self.preferredLevels.all(l, (!has(self.required) || l != self.required) && (!has(self.preferred) || l != self.preferred))").message("topology.preferredLevels may not repeat topology.required or topology.preferred"),
)]
pub struct Topology {
    /// Node label key, for example `example.com/rack`: every pod of the gang lands on nodes
    /// that share one value of this label. Nodes without the label are not used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 317))]
    pub required: Option<String>,

    /// Node label key of a finer level, for example `example.com/nvlink-domain`: muster
    /// prefers placements within one value of this label and falls back to several.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 317))]
    pub preferred: Option<String>,

    /// Still finer levels to prefer within `preferred`, coarse to fine, for example
    /// `[example.com/nvlink-domain, kubernetes.io/hostname]`. The gang goes into one value
    /// of the finest level that can hold it; otherwise it spans as few values of each
    /// level as it must. `kubernetes.io/hostname` last packs it onto as few nodes as
    /// possible.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 4), inner(length(min = 1, max = 317)))]
    #[x_kube(
        validation = Rule::new("self.all(l, self.exists_one(m, m == l))").message("topology.preferredLevels must not repeat a level"),
    )]
    pub preferred_levels: Vec<String>,
}

/// Where the pods of one group go relative to each other, as node label keys, within
/// the gang's `topology.required` domain.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.required) || !has(self.slice) || self.slice.required != self.required").message("topology.slice.required must be a finer level than the group's topology.required"),
)]
pub struct GroupTopology {
    /// Node label key, for example `example.com/rack`: every pod of the group lands on
    /// nodes that share one value of it. Other groups are not bound by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 317))]
    pub required: Option<String>,

    /// Slices of the group: each run of `size` consecutive pods (by index) lands on nodes
    /// that share one value of the slice's label, for example one tensor-parallel group
    /// of 8 per NVLink domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slice: Option<TopologySlice>,
}

/// A slice of a pod group: `size` consecutive pods within one value of `required`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct TopologySlice {
    /// Node label key that every pod of a slice shares one value of.
    #[schemars(length(min = 1, max = 317))]
    pub required: String,
    /// Pods per slice; must divide the group's replicas.
    #[schemars(range(min = 1, max = 10_000))]
    pub size: i32,
}

/// Why a template may not name its node.
pub const NODE_NAME_MESSAGE: &str = "template.spec.nodeName may not be set: the API server refuses it on a pod at a scheduling gate, and muster's pods wait at one until the gang is placed (use a nodeSelector or node affinity)";

/// A group of identical pods within the gang.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.minCount) || self.minCount <= self.replicas").message("minCount must not exceed replicas"),
    validation = Rule::new("!has(self.topology) || !has(self.topology.slice) || self.replicas % self.topology.slice.size == 0").message("topology.slice.size must divide replicas"),
    validation = Rule::new("!has(self.topology) || !has(self.topology.slice) || !has(self.minCount) || self.minCount == self.replicas").message("a group with slices starts whole: minCount, if set, must equal replicas"),
    validation = Rule::new("!has(self.members) || !has(self.template)").message("members is for groups without a template: muster makes a template's pods itself"),
    validation = Rule::new("!has(self.template) || !has(self.template.spec) || !has(self.template.spec.nodeName) || self.template.spec.nodeName == ''").message(NODE_NAME_MESSAGE),
)]
pub struct PodGroup {
    /// Name of the group, a DNS label. Pods are named `<workload>-<name>-<index>`.
    #[schemars(length(min = 1, max = 56), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: String,

    /// Number of pods in the group (1 to 10000).
    #[schemars(range(min = 1, max = 10_000))]
    pub replicas: i32,

    /// How many pods of this group must be placed together for the gang to start; the
    /// remaining pods start when they fit. Defaults to replicas (all-or-nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10_000))]
    pub min_count: Option<i32>,

    /// Template of the group's pods. Without a template, muster creates no pods for the
    /// group: pods created by another controller (for example a Job) join it by carrying
    /// the `muster.dev/gang` scheduling gate and the `muster.dev/workload` and
    /// `muster.dev/pod-group` labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<PodTemplateSpec>,

    /// Where the group's pods go relative to each other, within the gang's topology.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<GroupTopology>,

    /// For a group without a template: which pods may join it, beyond the two labels.
    /// Without it, a member only has to be controlled by some object (a bare pod never
    /// joins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub members: Option<Members>,
}

/// Which pods make up a template-less group.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Members {
    /// uid of the object that must be each member's controller (the owner reference with
    /// `controller: true`), for example the Job whose pods make the group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub controller_uid: Option<String>,
    /// Labels each member must carry, for example a JobSet's uid and replicated job.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub match_labels: std::collections::BTreeMap<String, String>,
    /// Pods per Job, for a group made of the Jobs of one JobSet replicated job: a
    /// member's index is its Job's index (label `jobset.sigs.k8s.io/job-index`) times
    /// this, plus its completion index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10_000))]
    pub pods_per_job: Option<i32>,
}

impl PodGroup {
    /// The gang threshold of this group: `minCount`, defaulting to `replicas`.
    pub fn min_count(&self) -> i32 {
        self.min_count.unwrap_or(self.replicas)
    }
}

/// A ResourceClaim shared by the pods of the gang.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.resourceClaimTemplateName) != has(self.resourceClaimName)").message("exactly one of resourceClaimTemplateName and resourceClaimName must be set"),
)]
pub struct SharedResourceClaim {
    /// Name by which containers refer to the claim in `resources.claims`; a DNS label
    /// unique among the pod's claims.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: String,

    /// ResourceClaimTemplate in the Workload's namespace from which muster creates the
    /// shared claim `<workload>-<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub resource_claim_template_name: Option<String>,

    /// An existing ResourceClaim in the Workload's namespace to share instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub resource_claim_name: Option<String>,

    /// Pod groups whose pods get the claim. Unset: every pod group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    pub pod_groups: Option<Vec<String>>,
}

/// Gang restart behaviour.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.restartedBy) || self.restartedBy != 'PodController' || (self.maxRestarts == 0 && !has(self.rules) && !has(self.restartBackoff))").message("failurePolicy.restartedBy PodController leaves restarts to the pods' controller: maxRestarts, rules and restartBackoff do not apply"),
)]
pub struct FailurePolicy {
    /// How many restarts that count (see `rules`) the gang may make as a unit after a pod
    /// fails or its node is lost, before the Workload fails. Default 0.
    #[serde(default)]
    #[schemars(range(min = 0, max = 1000))]
    pub max_restarts: i32,
    /// What a failure does, by what failed: the first rule, in order, that matches any
    /// failed or lost pod of the gang's core (its pods within minCount) decides; when none
    /// matches, the gang restarts and the restart counts against `maxRestarts` (as
    /// without rules).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    #[x_kube(validation = Rule::new("self.all(r, !has(r.name) || self.exists_one(q, has(q.name) && q.name == r.name))").message("failurePolicy.rules[].name must be unique"))]
    pub rules: Vec<FailureRule>,
    /// A wait between a failure and the gang's next attempt, doubling with each restart
    /// up to a cap. Unset: the next attempt starts as soon as the failed one is gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_backoff: Option<RestartBackoff>,
    /// Who restarts the gang after a core pod fails or is lost. `Muster` (unset): muster
    /// restarts the gang as a unit, under `maxRestarts` and `rules`. `PodController`: the
    /// controller that made the pods (a Job, a JobSet) replaces them by its own policy;
    /// muster deletes nothing, gives back what the failed or lost pod held, and puts its
    /// replacements back onto the same nodes and devices where these are still free (all
    /// of a group's missing core pods at once). The gang then ends when its pods succeed
    /// or when its job says it ended. Only for Workloads whose groups are all
    /// template-less.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restarted_by: Option<RestartedBy>,
}

/// Who restarts a gang's pods after a failure (`failurePolicy.restartedBy`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum RestartedBy {
    /// muster restarts the gang as a unit.
    Muster,
    /// The pods' own controller replaces them; muster places the replacements.
    PodController,
}

/// One rule of the failure policy. Every criterion it sets must match the failed pod.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.onExitCodes) || has(self.onPodConditions) || has(self.onReasons)").message("a failure rule needs onExitCodes, onPodConditions or onReasons"),
)]
pub struct FailureRule {
    /// Names the rule in conditions and events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("failurePolicy.rules[].name must be a DNS label"))]
    pub name: Option<String>,
    /// What the gang does when the rule matches.
    pub action: FailureAction,
    /// Matches a failed pod by the exit codes of its containers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_exit_codes: Option<OnExitCodes>,
    /// Matches a pod that has any one of these conditions, as a Job's podFailurePolicy
    /// does (for example `DisruptionTarget`, which the API server and the kubelet set on
    /// pods they evict or preempt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 8))]
    pub on_pod_conditions: Option<Vec<OnPodCondition>>,
    /// Matches a failure of one of these kinds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 8))]
    pub on_reasons: Option<Vec<FailureReason>>,
    /// Matches only failures of pods of these groups. Unset: any group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 16))]
    pub pod_groups: Option<Vec<String>>,
}

/// What the gang does when a failure rule matches.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum FailureAction {
    /// The Workload fails at once, whatever restarts are left.
    FailGang,
    /// The gang restarts, and the restart counts against `maxRestarts`.
    RestartGang,
    /// The gang restarts without counting it against `maxRestarts` (a disruption that is
    /// not the application's fault).
    RestartGangAndIgnoreMaxRestarts,
}

/// Exit codes of a failed pod's containers.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.operator == 'NotIn' || !self.values.exists(v, v == 0)").message("onExitCodes with operator In may not list 0: a container that exits 0 succeeded"),
)]
pub struct OnExitCodes {
    /// Only this container's exit code counts. Unset: any container of the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub container_name: Option<String>,
    /// `In`: some terminated container exited with one of `values`; `NotIn`: some
    /// terminated container exited with a code not in `values`.
    pub operator: ExitCodeOperator,
    /// The exit codes, between 0 and 255.
    #[schemars(length(min = 1, max = 255))]
    #[x_kube(
        validation = Rule::new("self.all(v, v >= 0 && v <= 255)").message("exit codes are between 0 and 255"),
        validation = Rule::new("self.all(v, self.exists_one(w, w == v))").message("onExitCodes.values must not repeat a code"),
    )]
    pub values: Vec<i32>,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum ExitCodeOperator {
    In,
    NotIn,
}

/// A condition the failed pod must have.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct OnPodCondition {
    /// The condition type, for example `DisruptionTarget`.
    #[serde(rename = "type")]
    #[schemars(length(min = 1, max = 316))]
    pub type_: String,
    /// Its status. Default `True`.
    #[serde(default = "condition_true")]
    pub status: ConditionStatus,
}

fn condition_true() -> ConditionStatus {
    ConditionStatus::True
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

/// What kind of failure ended a pod.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum FailureReason {
    /// A container failed (the pod's phase is Failed for none of the reasons below).
    PodFailed,
    /// The kubelet evicted the pod (node pressure) or the Eviction API did.
    Evicted,
    /// kube-scheduler preempted the pod for one of higher priority.
    Preempted,
    /// The pod's `activeDeadlineSeconds` passed.
    DeadlineExceeded,
    /// The pod's node is gone or not ready.
    NodeLost,
    /// The pod disappeared, or was deleted, while it ran.
    PodLost,
}

/// Exponential backoff between restarts.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.initialSeconds <= self.maxSeconds").message("restartBackoff.initialSeconds must not exceed maxSeconds"),
)]
pub struct RestartBackoff {
    /// The wait before the first restart; each further restart waits twice as long.
    #[schemars(range(min = 1, max = 3600))]
    pub initial_seconds: i32,
    /// The longest wait.
    #[schemars(range(min = 1, max = 86400))]
    pub max_seconds: i32,
}

/// Completion behaviour.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SuccessPolicy {
    /// The Workload succeeds when every pod of these groups has succeeded; the remaining
    /// pods are then stopped. Unset or empty: all pod groups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    pub pod_groups: Option<Vec<String>>,
}

/// Lifecycle phase of a Workload.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, schemars::JsonSchema)]
pub enum WorkloadPhase {
    /// Pods and claims are being created, or the gang waits for admission.
    #[default]
    Pending,
    /// The gang is queued for admission but does not fit yet.
    Queued,
    /// Every claim of the gang is reserved and its pods are released to the scheduler.
    Admitted,
    /// At least minCount pods of every group are running.
    Running,
    /// The gang finished successfully.
    Succeeded,
    /// The gang failed and will not be restarted.
    Failed,
    /// `spec.suspend` is true: the gang holds nothing.
    Suspended,
}

/// Observed state of a Workload.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Lifecycle phase of the gang.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<WorkloadPhase>,

    /// Latest observations: Created, Admitted, PodsReady, Restarting, Succeeded, Failed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,

    /// Pods the gang asks for (sum of replicas).
    #[serde(default)]
    pub pods: i32,

    /// Pods of the gang that are ready.
    #[serde(default)]
    pub ready_pods: i32,

    /// Per pod group counts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pod_groups: Vec<PodGroupStatus>,

    /// Where the gang was placed, once admitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<PlacementStatus>,

    /// How many times the gang was restarted as a unit.
    #[serde(default)]
    pub restarts: i32,

    /// Of `restarts`, those that count against `failurePolicy.maxRestarts` (a rule with
    /// `RestartGangAndIgnoreMaxRestarts` restarts without counting). Unset: all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restarts_count_towards_max: Option<i32>,

    /// While the gang evicts gangs of lower priority to fit: the victims, and the nodes
    /// and devices held for it until it commits. Recorded before any victim is touched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nomination: Option<NominationStatus>,

    /// Released pods kube-scheduler refused on their planned node, newest last. For five
    /// minutes after each, the gang's plans keep the pod's group off that node; older
    /// ones are ignored and dropped at the next refusal (at most 16 are kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scheduler_refusals: Vec<SchedulerRefusal>,

    /// How many times the admission loop has written its part of this status. Each of its
    /// writes is conditioned on this count (not on the object's resourceVersion), so a
    /// write decided on an older journal fails while the Workload controller's writes to
    /// its own fields never make it fail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission_revision: Option<i64>,
}

/// A released pod kube-scheduler reported unschedulable on the node muster planned.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SchedulerRefusal {
    /// The pod's group; unset for a pod that carries none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_group: Option<String>,
    /// Name of the refused pod.
    pub pod: String,
    /// The node it was planned on.
    pub node: String,
    /// kube-scheduler's message (the pod's `PodScheduled` condition).
    #[serde(default)]
    pub message: String,
    /// When muster acted on the refusal.
    pub at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
}

/// A preemption under way: what the gang evicts, and where it goes once they are gone.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NominationStatus {
    /// When the nomination was made; it lapses if the gang still does not fit long after.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// The evicted Workloads, as `namespace/name`.
    #[serde(default)]
    pub victims: Vec<String>,
    /// The node nominated for each pod of the gang.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<NominatedPod>,
    /// The devices nominated for each ResourceClaim of the gang.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub claims: Vec<NominatedClaim>,
}

/// A pod of a nominated placement.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NominatedPod {
    /// Name of the pod.
    pub name: String,
    /// Node nominated for it.
    pub node: String,
}

/// A claim of a nominated placement and its devices.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NominatedClaim {
    /// Name of the ResourceClaim.
    pub name: String,
    /// Devices nominated for it.
    #[serde(default)]
    pub devices: Vec<NominatedDevice>,
}

/// One device of a nominated claim.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NominatedDevice {
    /// The claim's request the device serves.
    pub request: String,
    /// DRA driver of the device.
    pub driver: String,
    /// Pool of the device.
    pub pool: String,
    /// Name of the device in its pool.
    pub device: String,
    /// Set when the device allows several allocations and the nomination takes one share
    /// of it, as the allocation's `shareID` will: the rest of the device stays free.
    #[serde(default, rename = "shareID", skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// The capacity the share consumes, as quantities, as the allocation's
    /// `consumedCapacity` will.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub consumed_capacity: BTreeMap<String, String>,
}

/// Counts for one pod group.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodGroupStatus {
    /// Name of the pod group.
    pub name: String,
    /// Pods the group asks for.
    pub replicas: i32,
    /// Pods of the group that exist.
    #[serde(default)]
    pub created: i32,
    /// Pods still held by the muster scheduling gate.
    #[serde(default)]
    pub gated: i32,
    /// Pods that are ready.
    #[serde(default)]
    pub ready: i32,
    /// Pods that succeeded.
    #[serde(default)]
    pub succeeded: i32,
    /// Pods that failed.
    #[serde(default)]
    pub failed: i32,
}

/// How far muster got with committing a gang's placement. Recorded before any claim is
/// written, so that a restarted operator completes or undoes a half-done commit.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum AdmissionState {
    /// The plan is recorded; claims are being allocated.
    Reserving,
    /// Every claim of the gang is allocated; pods are being released.
    Reserved,
    /// Every pod is released to the scheduler, pinned to its planned node.
    Released,
    /// The released pods were not all scheduled in time: the pods are being deleted and
    /// the claims deallocated, after which the gang is queued again.
    TearingDown,
    /// A pod failed or was lost: the attempt's pods (`retiredPods`) are being deleted;
    /// then the gang is released again onto its reservation (`reuseReservation`) or its
    /// claims are deallocated and it is queued again.
    Restarting,
    /// `spec.suspend` was set: the released pods are being deleted and the claims
    /// deallocated; then the gang holds nothing.
    Suspending,
    /// The gang succeeded or failed: its remaining pods are stopped and its claims
    /// deallocated.
    Finishing,
    /// Nothing is held any more.
    Finished,
}

/// A pod and the node muster planned for it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlannedPod {
    /// Name of the pod.
    pub name: String,
    /// Node the pod is pinned to when it is released.
    pub node: String,
    /// The pod's group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Placed beyond its group's minCount: losing it does not restart the gang.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub extra: bool,
    /// When an extra pod, or a core pod placed after the gang (a replacement its
    /// controller made), was released; absent while its reservation is being made or
    /// given back, and for core pods released with the gang.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// A core pod that failed or went and whose place is being given back, for its
    /// controller's replacement (`failurePolicy.restartedBy: PodController`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub leaving: bool,
    /// An extra pod's own ResourceClaims, deallocated when it is dropped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub claims: Vec<String>,
    /// The devices of the pod's own claims (`driver/pool/device`), recorded where its
    /// controller replaces it, so that its replacement goes back onto them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<String>,
}

/// The placement muster chose for the gang, and how far its commit got.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlacementStatus {
    /// Commit progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<AdmissionState>,
    /// When the current state was entered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// Value of the required topology label shared by every node of the gang.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology_value: Option<String>,
    /// Nodes used by the gang, sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<String>,
    /// Number of devices reserved for the gang.
    #[serde(default)]
    pub devices: i32,
    /// Planned node of every pod.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<PlannedPod>,
    /// ResourceClaims muster allocates for the gang.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub claims: Vec<String>,
    /// When the pods were released to the scheduler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// While restarting: the nodes and devices are healthy, so the next attempt goes
    /// onto the same reservation without planning again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reuse_reservation: bool,
    /// While restarting: the uids of the attempt's pods that must be gone before the
    /// next attempt starts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retired_pods: Vec<String>,
    /// Places whose pod failed or went, kept for the replacements their controller makes
    /// (`failurePolicy.restartedBy: PodController`): where each goes back to, and since
    /// when. Past the schedule timeout the whole gang is requeued.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vacancies: Vec<Vacancy>,
}

/// A place vacated for the replacement of a gang's pod.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Vacancy {
    /// The pod that left it.
    pub pod: String,
    /// Its pod group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// The member's index in its group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<i32>,
    /// The node it was on.
    pub node: String,
    /// The devices its own claims held, as `driver/pool/device`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<String>,
    /// When it became vacant.
    pub since: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
}
