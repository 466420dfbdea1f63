//! What kube-scheduler reads of a pod besides its resources, node requirements and DRA
//! claims: labels, inter-pod (anti-)affinity terms, topology spread constraints, host
//! ports and PersistentVolumeClaims. [`PodRules`] is what a gang's pods ask for;
//! [`PodTraits`] is what a running pod holds against others.

use std::collections::BTreeMap;

use crate::key::ObjectKey;
use crate::labels::LabelSelector;

/// A required or preferred inter-pod (anti-)affinity term (`PodAffinityTerm`), with
/// `matchLabelKeys` and `mismatchLabelKeys` already merged into the selector, as the API
/// server does on pod creation.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AffinityTerm {
    /// Which pods: an unset selector selects none.
    pub selector: LabelSelector,
    /// Namespaces named by the term. With neither these nor a namespace selector, the
    /// term applies to the namespace of the pod that has it.
    pub namespaces: Vec<String>,
    /// Namespaces by their labels (`{}`: every namespace).
    pub namespace_selector: Option<LabelSelector>,
    pub topology_key: String,
}

impl AffinityTerm {
    /// Whether the term of a pod in namespace `own` selects a pod with `labels` in
    /// `namespace`, whose namespace has `namespace_labels` (kube-scheduler's
    /// `AffinityTerm.Matches`).
    pub fn selects(
        &self,
        own: &str,
        namespace: &str,
        labels: &BTreeMap<String, String>,
        namespace_labels: &BTreeMap<String, String>,
    ) -> bool {
        let in_namespace = if self.namespaces.is_empty() && self.namespace_selector.is_none() {
            namespace == own
        } else {
            self.namespaces.iter().any(|n| n == namespace)
                || self
                    .namespace_selector
                    .as_ref()
                    .is_some_and(|s| s.matches(namespace_labels))
        };
        in_namespace && self.selector.matches(labels)
    }
}

/// A preferred term with its weight (1–100).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WeightedTerm {
    pub weight: i32,
    pub term: AffinityTerm,
}

/// What kube-scheduler does with a spread constraint it cannot meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WhenUnsatisfiable {
    /// A filter: nodes that would skew the spread more than `maxSkew` are refused.
    DoNotSchedule,
    /// A preference only.
    ScheduleAnyway,
}

/// A `topologySpreadConstraint`, `matchLabelKeys` merged into the selector.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SpreadConstraint {
    pub max_skew: i32,
    pub topology_key: String,
    pub when_unsatisfiable: WhenUnsatisfiable,
    /// Counts the pods of the pod's own namespace it selects. Unset selects none; `{}`
    /// counts none either (kube-scheduler counts no pods for an empty selector) but
    /// matches the pod itself.
    pub selector: LabelSelector,
    /// Below this many domains, the minimum count is taken as 0 (default 1).
    pub min_domains: i32,
    /// `nodeAffinityPolicy: Honor` (the default): only nodes the pod's node selector and
    /// required node affinity accept count as domains.
    pub honor_node_affinity: bool,
    /// `nodeTaintsPolicy: Honor` (default `Ignore`): only nodes whose taints the pod
    /// tolerates count as domains.
    pub honor_node_taints: bool,
}

/// A host port: `hostIP` (empty is `0.0.0.0`), protocol (`TCP` if empty) and port.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostPort {
    pub ip: String,
    pub protocol: String,
    pub port: i32,
}

/// The wildcard host IP.
pub const ALL_HOST_IPS: &str = "0.0.0.0";

impl HostPort {
    /// A port as the scheduler records it: an empty IP is every IP, an empty protocol TCP.
    pub fn new(ip: &str, protocol: &str, port: i32) -> Self {
        HostPort {
            ip: if ip.is_empty() { ALL_HOST_IPS } else { ip }.to_string(),
            protocol: if protocol.is_empty() { "TCP" } else { protocol }.to_string(),
            port,
        }
    }

    /// Whether both cannot be bound on one node (`HostPortInfo.CheckConflict`): the same
    /// protocol and port, on the same IP or with either on every IP.
    pub fn conflicts(&self, other: &HostPort) -> bool {
        self.port > 0
            && self.port == other.port
            && self.protocol == other.protocol
            && (self.ip == other.ip || self.ip == ALL_HOST_IPS || other.ip == ALL_HOST_IPS)
    }
}

impl std::fmt::Display for HostPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.ip == ALL_HOST_IPS {
            write!(f, "{}/{}", self.port, self.protocol)
        } else {
            write!(f, "{}:{}/{}", self.ip, self.port, self.protocol)
        }
    }
}

/// Whether any port of `a` conflicts with any of `b`.
pub fn ports_conflict(a: &[HostPort], b: &[HostPort]) -> bool {
    a.iter().any(|p| b.iter().any(|q| p.conflicts(q)))
}

/// What the pods of a group ask of kube-scheduler beyond resources, node selection,
/// tolerations and claims. Their PersistentVolumeClaims are per pod
/// ([`crate::request::PodInstance::volumes`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PodRules {
    /// The pods' labels (those every pod of the group has).
    pub labels: BTreeMap<String, String>,
    /// Required inter-pod affinity: every term must find a matching pod in the node's
    /// domain of its topology key.
    pub affinity: Vec<AffinityTerm>,
    /// Required inter-pod anti-affinity: no term may find a matching pod there.
    pub anti_affinity: Vec<AffinityTerm>,
    /// Preferred terms: hints for the order in which nodes are tried.
    pub preferred_affinity: Vec<WeightedTerm>,
    pub preferred_anti_affinity: Vec<WeightedTerm>,
    pub spread: Vec<SpreadConstraint>,
    /// Host ports of the containers and restartable init containers (with
    /// `hostNetwork`, every container port is a host port).
    pub host_ports: Vec<HostPort>,
}

impl PodRules {
    /// Whether the pods ask for none of these.
    pub fn is_empty(&self) -> bool {
        self.affinity.is_empty()
            && self.anti_affinity.is_empty()
            && self.preferred_affinity.is_empty()
            && self.preferred_anti_affinity.is_empty()
            && self.spread.is_empty()
            && self.host_ports.is_empty()
    }
}

/// What a pod on a node holds against others: its labels (for others' terms), its
/// required anti-affinity terms, host ports and PersistentVolumeClaims.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodTraits {
    pub labels: BTreeMap<String, String>,
    pub anti_affinity: Vec<AffinityTerm>,
    pub host_ports: Vec<HostPort>,
    /// Its PersistentVolumeClaims, `namespace/name`.
    pub volumes: Vec<ObjectKey>,
    /// PersistentVolumes a plan chose for its claims that are not bound yet: no other
    /// plan may choose them.
    pub volumes_taken: Vec<String>,
    /// Being deleted: topology spread does not count it.
    pub terminating: bool,
}

impl PodTraits {
    /// A planned pod of a group, as it will run.
    pub fn planned(rules: &PodRules, volumes: &[ObjectKey], volumes_taken: Vec<String>) -> Self {
        PodTraits {
            labels: rules.labels.clone(),
            anti_affinity: rules.anti_affinity.clone(),
            host_ports: rules.host_ports.clone(),
            volumes: volumes.to_vec(),
            volumes_taken,
            terminating: false,
        }
    }

    pub fn is_empty(&self) -> bool {
        self == &PodTraits::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_conflict_on_the_same_ip_or_the_wildcard() {
        let any = HostPort::new("", "", 8080);
        let local = HostPort::new("127.0.0.1", "TCP", 8080);
        let other = HostPort::new("10.0.0.1", "TCP", 8080);
        let udp = HostPort::new("", "UDP", 8080);
        assert!(any.conflicts(&local) && local.conflicts(&any));
        assert!(!local.conflicts(&other));
        assert!(!any.conflicts(&udp));
        assert!(!HostPort::new("", "", 0).conflicts(&HostPort::new("", "", 0)));
        assert_eq!(any.to_string(), "8080/TCP");
    }

    #[test]
    fn a_term_without_namespaces_applies_to_its_own() {
        let labels: BTreeMap<String, String> = [("app".to_string(), "w".to_string())].into();
        let none = BTreeMap::new();
        let mut term = AffinityTerm {
            selector: LabelSelector::of_labels(&[("app", "w")]),
            namespaces: vec![],
            namespace_selector: None,
            topology_key: "kubernetes.io/hostname".into(),
        };
        assert!(term.selects("a", "a", &labels, &none));
        assert!(!term.selects("a", "b", &labels, &none));
        term.namespace_selector = Some(LabelSelector::everything());
        assert!(term.selects("a", "b", &labels, &none));
        term.namespace_selector = Some(LabelSelector::of_labels(&[("team", "x")]));
        assert!(
            !term.selects("a", "a", &labels, &none),
            "the selector replaces the default"
        );
        term.namespaces = vec!["a".into()];
        assert!(term.selects("a", "a", &labels, &none));
    }
}
