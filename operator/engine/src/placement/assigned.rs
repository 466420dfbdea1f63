//! Topology domains assigned to a group from outside: the nodes of each domain, and how
//! many of the group's pods each domain takes at most. Kueue's Topology-Aware Scheduling
//! charges its quota per domain and pod count; a gang placed elsewhere, or packed
//! differently, leaves Kueue counting usage where there is none.

use rustc_hash::FxHashMap;

use crate::cluster::Node;
use crate::request::GangRequest;

/// Per group, the domains assigned to it (none: the group goes anywhere).
pub(super) struct Assigned<'a> {
    groups: Vec<Option<GroupDomains<'a>>>,
}

struct GroupDomains<'a> {
    /// The domain each node of the assignment lies in.
    domain_of: FxHashMap<&'a str, usize>,
    /// Per domain: pods it takes at most, and its name for messages.
    caps: Vec<(usize, &'a str)>,
}

impl<'a> Assigned<'a> {
    pub(super) fn new(gang: &'a GangRequest) -> Self {
        let groups = gang
            .groups
            .iter()
            .map(|group| {
                if group.assigned.is_empty() {
                    return None;
                }
                let mut domain_of = FxHashMap::default();
                for (d, domain) in group.assigned.iter().enumerate() {
                    for node in &domain.nodes {
                        // Domains of one level do not overlap; should two, the first counts.
                        domain_of.entry(node.as_str()).or_insert(d);
                    }
                }
                let caps = group.assigned.iter().map(|d| (d.pods, d.name.as_str())).collect();
                Some(GroupDomains { domain_of, caps })
            })
            .collect();
        Assigned { groups }
    }

    /// Whether any group has domains assigned.
    pub(super) fn any(&self) -> bool {
        self.groups.iter().any(Option::is_some)
    }

    /// How many pods of group `g` `node` takes at most by the assignment (`None`: no
    /// bound), or why none.
    pub(super) fn node_cap(&self, g: usize, node: &Node) -> Result<Option<usize>, String> {
        let Some(domains) = &self.groups[g] else {
            return Ok(None);
        };
        match domains.domain_of.get(node.name.as_str()) {
            Some(d) => Ok(Some(domains.caps[*d].0)),
            None => Err("outside the topology domains assigned to the group".into()),
        }
    }

    /// How many pods of group `g` the nodes take at most together: the caps of the
    /// domains they lie in (`None`: no bound).
    pub(super) fn domain_cap<'n>(&self, g: usize, nodes: impl Iterator<Item = &'n Node>) -> Option<usize> {
        let domains = self.groups[g].as_ref()?;
        let mut seen = vec![false; domains.caps.len()];
        let mut cap = 0;
        for node in nodes {
            if let Some(d) = domains.domain_of.get(node.name.as_str())
                && !std::mem::replace(&mut seen[*d], true)
            {
                cap += domains.caps[*d].0;
            }
        }
        Some(cap)
    }

    /// Why one more pod of group `g` may not join `node`, given the pods placed per
    /// domain (`placed`, as [`Assigned::count`] keeps it).
    pub(super) fn refuse(&self, placed: &[Vec<u32>], g: usize, node: &Node) -> Option<String> {
        let domains = self.groups[g].as_ref()?;
        let Some(d) = domains.domain_of.get(node.name.as_str()) else {
            return Some("outside the topology domains assigned to the group".into());
        };
        let (cap, name) = domains.caps[*d];
        (placed[g][*d] as usize >= cap).then(|| format!("the assigned domain {name} holds {cap} of the group's pods"))
    }

    /// Per group and domain, no pod placed yet.
    pub(super) fn empty(&self) -> Vec<Vec<u32>> {
        self.groups
            .iter()
            .map(|d| vec![0; d.as_ref().map_or(0, |d| d.caps.len())])
            .collect()
    }

    /// Counts a pod of group `g` placed on (`add`) or taken off `node`.
    pub(super) fn count(&self, placed: &mut [Vec<u32>], g: usize, node: &Node, add: bool) {
        let Some(d) = self.groups[g]
            .as_ref()
            .and_then(|d| d.domain_of.get(node.name.as_str()))
        else {
            return;
        };
        let n = &mut placed[g][*d];
        *n = if add { *n + 1 } else { n.saturating_sub(1) };
    }
}
