//! kube-scheduler's filters that look at other pods and at volumes, for a gang: required
//! inter-pod affinity and anti-affinity (InterPodAffinity), topology spread
//! (PodTopologySpread, `DoNotSchedule`), host ports (NodePorts) and volumes (see
//! `volumes.rs`), against the pods running in the cluster and among the gang's own pods.
//!
//! Three uses, from cheap to exact:
//! - [`Constraints::node_room`]: what running pods and volumes allow a group on one node,
//!   and a bound on its pods there (one per node where a group's anti-affinity selects
//!   its own pods on the hostname, say); it tightens the planner's room bounds.
//! - [`Constraints::domain_room`]: the same bound over a set of nodes (one pod per rack
//!   for anti-affinity on the rack; the distinct volumes the nodes reach).
//! - [`Constraints::admit`]: whether one pod may join a node given the gang's pods placed
//!   so far ([`Occupancy`]), as kube-scheduler will judge it when it binds the pods.
//!
//! Preferred terms and `ScheduleAnyway` spread are hints: [`Constraints::hint`] scores
//! nodes by the running pods, and the planner tries higher scores first.
//!
//! Spread among the gang's own pods is checked as pods are placed, so the plan's order
//! is one in which kube-scheduler accepts every pod. With the default
//! `nodeAffinityPolicy: Honor`, kube-scheduler sees a released pod's spread only on the
//! node muster pinned it to: then only `minDomains` above 1 can refuse it (the pods on
//! that node alone must stay within `maxSkew`), which is checked too.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use super::Avoid;
use super::assigned::Assigned;
use super::volumes::{GangVolumes, VolumesHeld};
use crate::cluster::{ClusterState, Node};
use crate::key::PodKey;
use crate::pod::{AffinityTerm, PodRules, SpreadConstraint, WhenUnsatisfiable, ports_conflict};
use crate::request::{GangRequest, PodShape};
use crate::selector;

/// What the constraints allow a group on one node: how many of its pods at most
/// (`usize::MAX`: no bound from them), and which constraint set that bound.
pub(super) struct NodeRoom {
    pub(super) cap: usize,
    pub(super) why: Option<Arc<str>>,
}

/// A constraint that bounds a group's pods over several nodes.
pub(super) enum DomainBound<'c> {
    /// One pod per value of this key.
    AntiAffinity(&'c str),
    /// The free volumes of this class the nodes reach.
    Volumes(&'c str),
    /// The pods the topology domains assigned to the group take.
    Assigned,
}

impl DomainBound<'_> {
    /// The constraint, as it bounds the group to `count` pods.
    pub(super) fn describe(&self, count: usize) -> String {
        match self {
            DomainBound::AntiAffinity(key) => format!("anti-affinity on {key}"),
            DomainBound::Volumes(class) => format!("the {count} free PersistentVolumes of class {class:?} there"),
            DomainBound::Assigned => format!("the topology domains assigned to it ({count} pods there)"),
        }
    }
}

/// Why one pod may not join a node now.
#[derive(Debug)]
pub(super) struct Refusal {
    pub(super) reason: String,
    /// The node stays refused for the group's other pods while the gang only grows.
    pub(super) lasting: bool,
}

fn refuse(reason: String, lasting: bool) -> Refusal {
    Refusal { reason, lasting }
}

/// A required anti-affinity term of a group.
struct AntiTerm {
    key: usize,
    /// Values of the key where running pods it selects are.
    running: FxHashSet<String>,
    /// Groups of the gang whose pods it selects.
    groups: Vec<usize>,
}

/// A group's required affinity terms.
struct Affinity {
    /// Per term: its key and, per value, the running pods that match every term there.
    terms: Vec<(usize, FxHashMap<String, u32>)>,
    any_running: bool,
    /// Groups of the gang whose pods match every term.
    groups: Vec<usize>,
    /// The group's own pods match every term: the first may go anywhere.
    self_match: bool,
}

/// A `DoNotSchedule` spread constraint of a group.
struct Spread<'a> {
    constraint: &'a SpreadConstraint,
    /// Whether the group's pods count themselves.
    self_match: bool,
    /// Groups of the gang whose pods it counts.
    groups: Vec<usize>,
    /// Matching running pods per domain, every eligible domain present.
    domains: FxHashMap<String, u32>,
    /// How many domains have each count.
    histogram: BTreeMap<u32, u32>,
    /// Per node, its matching running pods: kube-scheduler checks a pinned pod's spread
    /// on its node alone, which matters with `minDomains` above 1.
    per_node: Option<FxHashMap<String, u32>>,
}

/// A preferred term or `ScheduleAnyway` constraint as a score of the node's domain.
struct Hint {
    key: String,
    /// Per value: running pods that match.
    running: FxHashMap<String, u32>,
    /// Score for a domain with matching pods (preferred terms), or per matching pod.
    weight: i64,
    per_pod: bool,
}

struct GroupRules<'a> {
    shape: &'a PodShape,
    anti: Vec<AntiTerm>,
    /// Values of keys where running pods' anti-affinity terms select this group's pods.
    blocked: Vec<(String, FxHashSet<String>)>,
    /// Groups of the gang with an anti-affinity term selecting this group's pods, and its key.
    anti_from: Vec<(usize, usize)>,
    affinity: Option<Affinity>,
    spread: Vec<Spread<'a>>,
    /// Groups whose host ports clash with this group's (itself included if it has any).
    port_clash: Vec<usize>,
    /// Keys on which at most one pod of the group fits per value, with the constraint
    /// for explanations.
    one_per: Vec<(usize, Arc<str>)>,
    /// "host port …" when the group's pods have host ports (one per node).
    port_bound: Option<Arc<str>>,
    hints: Vec<Hint>,
    /// Pods of the group with nodes of their own to avoid.
    avoiding: bool,
    /// Other groups whose affinity selects this group's pods and lets their first pod go
    /// anywhere (no running pod matches it): this group's pods join the domain of the
    /// pods it selects, so that the gang binds in any order (see [`Constraints::admit`]).
    joins: Vec<usize>,
}

/// The gang's constraints for one planning call.
pub(super) struct Constraints<'a> {
    cluster: &'a ClusterState,
    gang: &'a GangRequest,
    /// The gang's own pods, which never count as running pods against it.
    own: FxHashSet<&'a PodKey>,
    groups: Vec<GroupRules<'a>>,
    volumes: GangVolumes<'a>,
    avoid: &'a Avoid,
    /// Topology domains assigned to groups from outside.
    assigned: Assigned<'a>,
    /// Topology keys the gang's (anti-)affinity terms use, by id.
    keys: Vec<String>,
    /// Whether any group has any constraint: otherwise every check passes at once.
    active: bool,
}

/// The gang's pods placed so far, as the constraints count them.
#[derive(Clone, Default)]
pub(super) struct Occupancy {
    /// Per key id: per value, per group, pods placed.
    by_value: Vec<FxHashMap<String, Vec<u32>>>,
    /// Per node: per group, pods placed.
    by_node: FxHashMap<String, Vec<u32>>,
    /// Per group: pods placed.
    placed: Vec<u32>,
    /// Per group, per spread constraint: the gang's pods per domain, how the histogram
    /// of domain counts moved, and the gang's pods per node.
    spread: Vec<Vec<SpreadDelta>>,
    volumes: VolumesHeld,
    /// Volumes chosen for each placed pod's late claims.
    chosen: FxHashMap<(usize, usize), Vec<String>>,
    /// Per group, per assigned domain: pods placed.
    assigned: Vec<Vec<u32>>,
}

#[derive(Clone, Default)]
struct SpreadDelta {
    domains: FxHashMap<String, u32>,
    histogram: BTreeMap<u32, i64>,
    per_node: FxHashMap<String, u32>,
}

impl<'a> Constraints<'a> {
    /// The gang's constraints against `cluster`; `Err` when no node can take some pod
    /// (a claim that does not exist or waits to be bound, say), with why.
    pub(super) fn new(cluster: &'a ClusterState, gang: &'a GangRequest, avoid: &'a Avoid) -> Result<Self, String> {
        let volumes = GangVolumes::new(cluster, gang)?;
        let own: FxHashSet<&PodKey> = gang.groups.iter().flat_map(|g| g.pods.iter().map(|p| &p.key)).collect();
        let namespace_of = |g: &'a crate::request::GroupRequest| -> &'a str {
            g.pods
                .first()
                .map(|p| p.key.namespace())
                .unwrap_or_else(|| gang.name.split('/').next().unwrap_or_default())
        };
        let namespaces: Vec<&str> = gang.groups.iter().map(namespace_of).collect();
        let mut keys: Vec<String> = Vec::new();
        let mut key_id = |key: &str| -> usize {
            match keys.iter().position(|k| k == key) {
                Some(i) => i,
                None => {
                    keys.push(key.to_string());
                    keys.len() - 1
                }
            }
        };
        // Whether group `g`'s term selects the pods of group `h`.
        let selects = |term: &AffinityTerm, g: usize, h: usize| {
            term.selects(
                namespaces[g],
                namespaces[h],
                &gang.groups[h].shape.rules.labels,
                cluster.namespace_labels(namespaces[h]),
            )
        };
        // Every running pod, with its node: only for gangs with terms to match them.
        let has_terms = gang.groups.iter().any(|g| {
            let rules = &g.shape.rules;
            !rules.affinity.is_empty()
                || !rules.anti_affinity.is_empty()
                || !rules.preferred_affinity.is_empty()
                || !rules.preferred_anti_affinity.is_empty()
        });
        let running: Vec<(&PodKey, &crate::cluster::PodEntry, &Node)> = if has_terms {
            cluster
                .pods()
                .filter(|(key, _)| !own.contains(key))
                .filter_map(|(key, entry)| Some((key, entry, cluster.node(&entry.node)?)))
                .collect()
        } else {
            Vec::new()
        };
        let mut groups = Vec::with_capacity(gang.groups.len());
        for (g, group) in gang.groups.iter().enumerate() {
            let rules: &PodRules = &group.shape.rules;
            let namespace = namespaces[g];
            let selects_running = |term: &AffinityTerm, key: &PodKey, labels| {
                term.selects(
                    namespace,
                    key.namespace(),
                    labels,
                    cluster.namespace_labels(key.namespace()),
                )
            };
            let anti = rules
                .anti_affinity
                .iter()
                .map(|term| AntiTerm {
                    key: key_id(&term.topology_key),
                    running: running
                        .iter()
                        .filter(|(key, entry, _)| selects_running(term, key, &entry.traits.labels))
                        .filter_map(|(_, _, node)| node.labels.get(&term.topology_key).cloned())
                        .collect(),
                    groups: (0..gang.groups.len()).filter(|h| selects(term, g, *h)).collect(),
                })
                .collect::<Vec<_>>();
            let mut blocked: BTreeMap<&str, FxHashSet<String>> = BTreeMap::new();
            for (key, entry) in cluster.pods_with_anti_affinity().filter(|(key, _)| !own.contains(key)) {
                let Some(node) = cluster.node(&entry.node) else {
                    continue;
                };
                for term in &entry.traits.anti_affinity {
                    if term.selects(
                        key.namespace(),
                        namespace,
                        &rules.labels,
                        cluster.namespace_labels(namespace),
                    ) && let Some(value) = node.labels.get(&term.topology_key)
                    {
                        blocked.entry(&term.topology_key).or_default().insert(value.clone());
                    }
                }
            }
            let mut anti_from = Vec::new();
            for (h, other) in gang.groups.iter().enumerate() {
                for term in &other.shape.rules.anti_affinity {
                    if selects(term, h, g) {
                        anti_from.push((h, key_id(&term.topology_key)));
                    }
                }
            }
            let affinity = (!rules.affinity.is_empty()).then(|| {
                let matches_all = |labels, key: &PodKey| rules.affinity.iter().all(|t| selects_running(t, key, labels));
                let mut terms: Vec<(usize, FxHashMap<String, u32>)> = rules
                    .affinity
                    .iter()
                    .map(|t| (key_id(&t.topology_key), FxHashMap::default()))
                    .collect();
                let mut any_running = false;
                for (key, entry, node) in &running {
                    if !matches_all(&entry.traits.labels, key) {
                        continue;
                    }
                    for (term, (_, counts)) in rules.affinity.iter().zip(&mut terms) {
                        if let Some(value) = node.labels.get(&term.topology_key) {
                            *counts.entry(value.clone()).or_default() += 1;
                            any_running = true;
                        }
                    }
                }
                let groups: Vec<usize> = (0..gang.groups.len())
                    .filter(|h| rules.affinity.iter().all(|t| selects(t, g, *h)))
                    .collect();
                Affinity {
                    terms,
                    any_running,
                    self_match: groups.contains(&g),
                    groups,
                }
            });
            if let Some(affinity) = &affinity
                && !affinity.any_running
                && affinity.groups.is_empty()
            {
                return Err(format!(
                    "group {}: its pod affinity finds no matching pod, running or in the gang",
                    group.name
                ));
            }
            let eligible_nodes = |constraint: &'a SpreadConstraint| {
                cluster
                    .nodes()
                    .filter(move |n| spread_eligible(&group.shape, constraint, n))
            };
            let spread = rules
                .spread
                .iter()
                .filter(|c| c.when_unsatisfiable == WhenUnsatisfiable::DoNotSchedule)
                .map(|constraint| {
                    let mut domains: FxHashMap<String, u32> = FxHashMap::default();
                    let pinned = constraint.honor_node_affinity && constraint.min_domains > 1;
                    let mut per_node: FxHashMap<String, u32> = FxHashMap::default();
                    for node in eligible_nodes(constraint) {
                        if !has_spread_keys(rules, node) {
                            continue;
                        }
                        let count = spread_count(cluster, &own, constraint, namespace, &node.name);
                        let value = node.labels[&constraint.topology_key].clone();
                        *domains.entry(value).or_default() += count;
                        if pinned {
                            per_node.insert(node.name.clone(), count);
                        }
                    }
                    let mut histogram: BTreeMap<u32, u32> = BTreeMap::new();
                    for count in domains.values() {
                        *histogram.entry(*count).or_default() += 1;
                    }
                    Spread {
                        constraint,
                        self_match: constraint.selector.matches(&rules.labels),
                        groups: (0..gang.groups.len())
                            .filter(|h| {
                                namespaces[*h] == namespace
                                    && !constraint.selector.is_empty()
                                    && constraint.selector.matches(&gang.groups[*h].shape.rules.labels)
                            })
                            .collect(),
                        domains,
                        histogram,
                        per_node: pinned.then_some(per_node),
                    }
                })
                .collect();
            let port_clash = (0..gang.groups.len())
                .filter(|h| ports_conflict(&rules.host_ports, &gang.groups[*h].shape.rules.host_ports))
                .collect();
            let one_per = rules
                .anti_affinity
                .iter()
                .zip(&anti)
                .filter(|(_, t)| t.groups.contains(&g))
                .map(|(term, t)| (t.key, Arc::from(format!("anti-affinity on {}", term.topology_key))))
                .collect();
            let mut hints = Vec::new();
            for (weighted, sign) in rules
                .preferred_affinity
                .iter()
                .map(|w| (w, 1))
                .chain(rules.preferred_anti_affinity.iter().map(|w| (w, -1)))
            {
                let mut counts: FxHashMap<String, u32> = FxHashMap::default();
                for (key, entry, node) in &running {
                    if selects_running(&weighted.term, key, &entry.traits.labels)
                        && let Some(value) = node.labels.get(&weighted.term.topology_key)
                    {
                        *counts.entry(value.clone()).or_default() += 1;
                    }
                }
                hints.push(Hint {
                    key: weighted.term.topology_key.clone(),
                    running: counts,
                    weight: sign * i64::from(weighted.weight),
                    per_pod: false,
                });
            }
            for constraint in rules
                .spread
                .iter()
                .filter(|c| c.when_unsatisfiable == WhenUnsatisfiable::ScheduleAnyway)
            {
                let mut counts: FxHashMap<String, u32> = FxHashMap::default();
                for node in eligible_nodes(constraint) {
                    if let Some(value) = node.labels.get(&constraint.topology_key) {
                        *counts.entry(value.clone()).or_default() +=
                            spread_count(cluster, &own, constraint, namespace, &node.name);
                    }
                }
                hints.push(Hint {
                    key: constraint.topology_key.clone(),
                    running: counts,
                    weight: -1,
                    per_pod: true,
                });
            }
            groups.push(GroupRules {
                shape: &group.shape,
                anti,
                blocked: blocked.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
                anti_from,
                affinity,
                spread,
                port_clash,
                one_per,
                port_bound: rules.host_ports.first().map(|p| Arc::from(format!("host port {p}"))),
                hints,
                avoiding: group.pods.iter().any(|p| avoid.pod_nodes.contains_key(&p.key)),
                joins: Vec::new(),
            });
        }
        for x in 0..groups.len() {
            let joins: Vec<usize> = (0..groups.len())
                .filter(|g| *g != x)
                .filter(|g| {
                    groups[*g]
                        .affinity
                        .as_ref()
                        .is_some_and(|a| a.self_match && !a.any_running && a.groups.contains(&x))
                })
                .collect();
            groups[x].joins = joins;
        }
        let assigned = Assigned::new(gang);
        let active = volumes.any
            || assigned.any()
            || !avoid.pod_nodes.is_empty()
            || groups.iter().any(|r| {
                !r.anti.is_empty()
                    || !r.blocked.is_empty()
                    || !r.anti_from.is_empty()
                    || r.affinity.is_some()
                    || !r.spread.is_empty()
                    || !r.port_clash.is_empty()
                    || !r.hints.is_empty()
                    || !r.joins.is_empty()
                    || !r.shape.rules.host_ports.is_empty()
            })
            || cluster.pods_with_anti_affinity().next().is_some();
        Ok(Constraints {
            cluster,
            gang,
            own,
            groups,
            volumes,
            avoid,
            assigned,
            keys,
            active,
        })
    }

    /// Whether any check can fail or any hint differs between nodes.
    pub(super) fn active(&self) -> bool {
        self.active
    }

    /// An empty [`Occupancy`] for this gang.
    pub(super) fn occupancy(&self) -> Occupancy {
        Occupancy {
            by_value: vec![FxHashMap::default(); self.keys.len()],
            by_node: FxHashMap::default(),
            placed: vec![0; self.groups.len()],
            spread: self
                .groups
                .iter()
                .map(|g| vec![SpreadDelta::default(); g.spread.len()])
                .collect(),
            volumes: VolumesHeld::default(),
            chosen: FxHashMap::default(),
            assigned: self.assigned.empty(),
        }
    }

    /// What running pods and volumes allow group `g` on `node`: `Err` why none of its pods
    /// may go there.
    pub(super) fn node_room(&self, g: usize, id: usize, node: &Node) -> Result<NodeRoom, String> {
        let mut room = NodeRoom {
            cap: usize::MAX,
            why: None,
        };
        if !self.active {
            return Ok(room);
        }
        if let Some(cap) = self.assigned.node_cap(g, node)? {
            room = NodeRoom {
                cap,
                why: Some(Arc::from("the topology domain assigned to it")),
            };
        }
        let rules = &self.groups[g];
        for (key, values) in &rules.blocked {
            if node.labels.get(key).is_some_and(|v| values.contains(v)) {
                return Err(format!("anti-affinity of running pods on {key}"));
            }
        }
        for term in &rules.anti {
            let key = &self.keys[term.key];
            if node.labels.get(key).is_some_and(|v| term.running.contains(v)) {
                return Err(format!("anti-affinity on {key} with running pods"));
            }
        }
        if let Some(affinity) = &rules.affinity {
            for (key, counts) in &affinity.terms {
                let key = &self.keys[*key];
                let Some(value) = node.labels.get(key) else {
                    return Err(format!("no {key} label (pod affinity)"));
                };
                if affinity.any_running && affinity.groups.is_empty() && !counts.contains_key(value) {
                    return Err(format!("pod affinity on {key}: no matching pod there"));
                }
            }
        }
        let ports = &rules.shape.rules.host_ports;
        if !ports.is_empty() {
            for (_, entry) in self.cluster_pods_on(node) {
                if let Some(port) = ports
                    .iter()
                    .find(|p| entry.traits.host_ports.iter().any(|q| p.conflicts(q)))
                {
                    return Err(format!("host port {port} in use"));
                }
            }
            if room.cap > 1 {
                room = NodeRoom {
                    cap: 1,
                    why: rules.port_bound.clone(),
                };
            }
        }
        if !has_spread_keys(&rules.shape.rules, node) {
            let key = rules
                .shape
                .rules
                .spread
                .iter()
                .find(|c| {
                    c.when_unsatisfiable == WhenUnsatisfiable::DoNotSchedule
                        && !node.labels.contains_key(&c.topology_key)
                })
                .map(|c| c.topology_key.as_str())
                .unwrap_or_default();
            return Err(format!("no {key} label (topology spread)"));
        }
        for (key, why) in &rules.one_per {
            if node.labels.contains_key(&self.keys[*key]) && room.cap > 1 {
                room = NodeRoom {
                    cap: 1,
                    why: Some(why.clone()),
                };
            }
        }
        let (cap, why) = self.volumes.node_room(g, id, node)?;
        if cap < room.cap {
            room = NodeRoom { cap, why };
        }
        Ok(room)
    }

    fn cluster_pods_on<'s>(
        &'s self,
        node: &'s Node,
    ) -> impl Iterator<Item = (&'a PodKey, &'a crate::cluster::PodEntry)> + 's {
        self.cluster
            .pods_on(&node.name)
            .filter(|(key, _)| !self.own.contains(key))
    }

    /// A bound of group `g`'s pods over `nodes` (those where it has room) from
    /// constraints that span nodes, with the constraint that sets it.
    pub(super) fn domain_room(&self, g: usize, nodes: &[(usize, &Node)]) -> Option<(usize, DomainBound<'_>)> {
        if !self.active {
            return None;
        }
        let rules = &self.groups[g];
        let mut best: Option<(usize, DomainBound<'_>)> = None;
        for (key, _) in &rules.one_per {
            let key = &self.keys[*key];
            if nodes.iter().any(|(_, n)| !n.labels.contains_key(key)) {
                continue;
            }
            let values: BTreeSet<&String> = nodes.iter().filter_map(|(_, n)| n.labels.get(key)).collect();
            if best.as_ref().is_none_or(|(b, _)| values.len() < *b) {
                best = Some((values.len(), DomainBound::AntiAffinity(key)));
            }
        }
        if let Some((count, class)) = self.volumes.domain_room(g, nodes.iter().copied())
            && best.as_ref().is_none_or(|(b, _)| count < *b)
        {
            best = Some((count, DomainBound::Volumes(class)));
        }
        if let Some(count) = self.assigned.domain_cap(g, nodes.iter().map(|(_, n)| *n))
            && best.as_ref().is_none_or(|(b, _)| count < *b)
        {
            best = Some((count, DomainBound::Assigned));
        }
        best
    }

    /// How much the hints prefer `node` for group `g` (higher first; 0 without hints).
    pub(super) fn hint(&self, g: usize, node: &Node) -> i64 {
        self.groups[g]
            .hints
            .iter()
            .filter_map(|h| {
                let count = h.running.get(node.labels.get(&h.key)?).copied().unwrap_or(0);
                Some(if h.per_pod {
                    h.weight * i64::from(count)
                } else if count > 0 {
                    h.weight
                } else {
                    0
                })
            })
            .sum()
    }

    /// Whether some group's hints tell nodes apart.
    pub(super) fn has_hints(&self) -> bool {
        self.groups.iter().any(|g| !g.hints.is_empty())
    }

    /// Whether the pods of group `g` are interchangeable for the constraints: no pod has
    /// nodes of its own to avoid or volumes that differ from the others'.
    pub(super) fn pods_alike(&self, g: usize) -> bool {
        !self.active || (!self.groups[g].avoiding && self.volumes.pods_alike(g))
    }

    /// Groups that must come after others in placement order: their affinity is met
    /// only by pods of other groups of the gang.
    pub(super) fn follows_others(&self, g: usize) -> bool {
        self.groups[g]
            .affinity
            .as_ref()
            .is_some_and(|a| !a.self_match && !a.any_running)
    }

    /// Whether pod `index` of group `g` may join `node` with the gang's pods placed as in
    /// `occupancy`: the volumes its late claims get there, or why not.
    pub(super) fn admit(
        &self,
        occupancy: &Occupancy,
        g: usize,
        index: usize,
        id: usize,
        node: &Node,
    ) -> Result<Vec<String>, Refusal> {
        if !self.active {
            return Ok(Vec::new());
        }
        let pod = &self.gang.groups[g].pods[index];
        // This pod's own: another pod of the group may still use the node.
        if let Some(why) = self
            .avoid
            .pod_nodes
            .get(&pod.key)
            .and_then(|nodes| nodes.get(&node.name))
        {
            return Err(refuse(why.clone(), false));
        }
        if let Some(reason) = self.assigned.refuse(&occupancy.assigned, g, node) {
            return Err(refuse(reason, true));
        }
        let rules = &self.groups[g];
        let count = |key: usize, h: usize| -> u32 {
            node.labels
                .get(&self.keys[key])
                .and_then(|v| occupancy.by_value[key].get(v))
                .map_or(0, |per_group| per_group[h])
        };
        for term in &rules.anti {
            if term.groups.iter().any(|h| count(term.key, *h) > 0) {
                return Err(refuse(
                    format!("anti-affinity on {} with the gang's pods", self.keys[term.key]),
                    true,
                ));
            }
        }
        for (h, key) in &rules.anti_from {
            if count(*key, *h) > 0 {
                return Err(refuse(
                    format!(
                        "anti-affinity of group {}'s pods on {}",
                        self.gang.groups[*h].name, self.keys[*key]
                    ),
                    true,
                ));
            }
        }
        if let Some(affinity) = &rules.affinity {
            let mut met = true;
            for (key, counts) in &affinity.terms {
                let Some(value) = node.labels.get(&self.keys[*key]) else {
                    return Err(refuse(format!("no {} label (pod affinity)", self.keys[*key]), true));
                };
                let gang: u32 = affinity.groups.iter().map(|h| count(*key, *h)).sum();
                if counts.get(value).copied().unwrap_or(0) + gang == 0 {
                    met = false;
                }
            }
            let gang_placed = affinity.groups.iter().any(|h| occupancy.placed[*h] > 0);
            if !met && (affinity.any_running || gang_placed || !affinity.self_match) {
                let key = &self.keys[affinity.terms[0].0];
                return Err(refuse(format!("pod affinity on {key}: no matching pod there"), false));
            }
        }
        // kube-scheduler lets the first pod of a self-matching affinity go anywhere only
        // while no pod it selects exists: were this pod bound first elsewhere, the
        // other group's pods would be refused for good. So the pods such an affinity
        // selects share its domain, whichever binds first.
        for g in &rules.joins {
            let Some(affinity) = &self.groups[*g].affinity else {
                continue;
            };
            if !affinity.groups.iter().any(|h| occupancy.placed[*h] > 0) {
                continue;
            }
            for (key, _) in &affinity.terms {
                let here: u32 = affinity.groups.iter().map(|h| count(*key, *h)).sum();
                if here == 0 {
                    return Err(refuse(
                        format!(
                            "pod affinity of group {}'s pods on {}: the pods it selects share one domain, so that \
                             kube-scheduler takes them in any order",
                            self.gang.groups[*g].name, self.keys[*key]
                        ),
                        false,
                    ));
                }
            }
        }
        if let Some(on_node) = occupancy.by_node.get(&node.name)
            && let Some(h) = rules.port_clash.iter().find(|h| on_node[**h] > 0)
        {
            return Err(refuse(
                format!("host port clash with group {}'s pods", self.gang.groups[*h].name),
                true,
            ));
        }
        for (s, spread) in rules.spread.iter().enumerate() {
            let constraint = spread.constraint;
            let Some(value) = node.labels.get(&constraint.topology_key) else {
                continue;
            };
            let delta = &occupancy.spread[g][s];
            let matching =
                spread.domains.get(value).copied().unwrap_or(0) + delta.domains.get(value).copied().unwrap_or(0);
            let min = if (spread.domains.len() as i64) < i64::from(constraint.min_domains) {
                0
            } else {
                min_count(&spread.histogram, &delta.histogram)
            };
            let own = u32::from(spread.self_match);
            if i64::from(matching + own) - i64::from(min) > i64::from(constraint.max_skew) {
                return Err(refuse(
                    format!(
                        "topology spread on {}: {matching} matching pods in {value}, {min} in the emptiest domain, maxSkew {}",
                        constraint.topology_key, constraint.max_skew
                    ),
                    false,
                ));
            }
            if let Some(per_node) = &spread.per_node {
                let here = per_node.get(&node.name).copied().unwrap_or(0)
                    + delta.per_node.get(&node.name).copied().unwrap_or(0);
                if i64::from(here + own) > i64::from(constraint.max_skew) {
                    return Err(refuse(
                        format!(
                            "topology spread on {} with minDomains {}: {here} matching pods on the node, maxSkew {}",
                            constraint.topology_key, constraint.min_domains, constraint.max_skew
                        ),
                        true,
                    ));
                }
            }
        }
        // Lasting for the whole group only when its pods ask the same of volumes.
        self.volumes
            .place(g, index, id, node, &occupancy.volumes)
            .map_err(|r| refuse(r.reason, self.volumes.pods_alike(g)))
    }

    /// The volumes chosen for the placed pods' late claims, in group and pod order.
    pub(super) fn volume_choices(&self, occupancy: &Occupancy) -> Vec<super::VolumeChoice> {
        let mut chosen: Vec<(&(usize, usize), &Vec<String>)> = occupancy.chosen.iter().collect();
        chosen.sort();
        chosen
            .into_iter()
            .flat_map(|((g, i), volumes)| {
                let pod = &self.gang.groups[*g].pods[*i].key;
                volumes.iter().map(move |volume| super::VolumeChoice {
                    pod: pod.clone(),
                    volume: volume.clone(),
                })
            })
            .collect()
    }

    /// Enters pod `index` of group `g` on `node`, with the volumes [`Constraints::admit`]
    /// chose.
    pub(super) fn enter(&self, occupancy: &mut Occupancy, g: usize, index: usize, node: &Node, chosen: Vec<String>) {
        if !self.active {
            return;
        }
        self.count(occupancy, g, node, true);
        occupancy.volumes.hold(self.volumes.pod(g, index), &node.name, &chosen);
        occupancy.chosen.insert((g, index), chosen);
    }

    /// Undoes [`Constraints::enter`].
    pub(super) fn leave(&self, occupancy: &mut Occupancy, g: usize, index: usize, node: &Node) {
        if !self.active {
            return;
        }
        self.count(occupancy, g, node, false);
        let chosen = occupancy.chosen.remove(&(g, index)).unwrap_or_default();
        occupancy
            .volumes
            .release(self.volumes.pod(g, index), &node.name, &chosen);
    }

    fn count(&self, occupancy: &mut Occupancy, g: usize, node: &Node, add: bool) {
        let groups = self.groups.len();
        let step = |n: &mut u32| {
            if add { *n += 1 } else { *n = n.saturating_sub(1) }
        };
        for (key, by_value) in self.keys.iter().zip(&mut occupancy.by_value) {
            if let Some(value) = node.labels.get(key) {
                step(&mut by_value.entry(value.clone()).or_insert_with(|| vec![0; groups])[g]);
            }
        }
        step(
            &mut occupancy
                .by_node
                .entry(node.name.clone())
                .or_insert_with(|| vec![0; groups])[g],
        );
        step(&mut occupancy.placed[g]);
        self.assigned.count(&mut occupancy.assigned, g, node, add);
        for (owner, rules) in self.groups.iter().enumerate() {
            for (s, spread) in rules.spread.iter().enumerate() {
                if !spread.groups.contains(&g) || !spread_eligible(rules.shape, spread.constraint, node) {
                    continue;
                }
                let Some(value) = node.labels.get(&spread.constraint.topology_key) else {
                    continue;
                };
                if !spread.domains.contains_key(value) {
                    continue;
                }
                let delta = &mut occupancy.spread[owner][s];
                let before = spread.domains[value] + delta.domains.get(value).copied().unwrap_or(0);
                let after = if add { before + 1 } else { before.saturating_sub(1) };
                *delta.histogram.entry(before).or_default() -= 1;
                *delta.histogram.entry(after).or_default() += 1;
                step(delta.domains.entry(value.clone()).or_default());
                if spread.per_node.is_some() {
                    step(delta.per_node.entry(node.name.clone()).or_default());
                }
            }
        }
    }
}

/// The smallest domain count, from the running pods' histogram moved by the gang's.
fn min_count(base: &BTreeMap<u32, u32>, delta: &BTreeMap<u32, i64>) -> u32 {
    let counts: BTreeSet<u32> = base.keys().chain(delta.keys()).copied().collect();
    counts
        .into_iter()
        .find(|c| i64::from(base.get(c).copied().unwrap_or(0)) + delta.get(c).copied().unwrap_or(0) > 0)
        .unwrap_or(0)
}

/// Whether a node counts as a domain of a spread constraint for pods of `shape`: it
/// passes the pods' node selection (`nodeAffinityPolicy: Honor`) and taints
/// (`nodeTaintsPolicy: Honor`) as the constraint says, and has every key of their
/// `DoNotSchedule` constraints.
fn spread_eligible(shape: &PodShape, constraint: &SpreadConstraint, node: &Node) -> bool {
    if constraint.honor_node_affinity
        && (shape.node_selector.iter().any(|(k, v)| node.labels.get(k) != Some(v))
            || shape
                .affinity
                .as_ref()
                .is_some_and(|a| !a.matches(&node.name, &node.labels)))
    {
        return false;
    }
    if constraint.honor_node_taints && !selector::tolerates_all(&shape.tolerations, &node.taints) {
        return false;
    }
    has_spread_keys(&shape.rules, node)
}

fn has_spread_keys(rules: &PodRules, node: &Node) -> bool {
    rules
        .spread
        .iter()
        .filter(|c| c.when_unsatisfiable == WhenUnsatisfiable::DoNotSchedule)
        .all(|c| node.labels.contains_key(&c.topology_key))
}

/// Running pods on `node` a spread constraint of a pod in `namespace` counts: in that
/// namespace, not being deleted, selected (an empty selector counts none).
fn spread_count(
    cluster: &ClusterState,
    own: &FxHashSet<&PodKey>,
    constraint: &SpreadConstraint,
    namespace: &str,
    node: &str,
) -> u32 {
    if constraint.selector.is_empty() {
        return 0;
    }
    cluster
        .pods_on(node)
        .filter(|(key, entry)| {
            !own.contains(key)
                && key.namespace() == namespace
                && !entry.traits.terminating
                && constraint.selector.matches(&entry.traits.labels)
        })
        .count() as u32
}
