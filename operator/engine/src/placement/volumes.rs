//! The gang's PersistentVolumeClaims as kube-scheduler's volume filters see them, per pod:
//! bound claims pin the pod to their volume's node affinity and zone (VolumeBinding,
//! VolumeZone); unbound claims of a `WaitForFirstConsumer` class need a free static
//! volume reachable from the node, or a class that provisions for it, and no volume goes
//! to two claims of the gang; unbound claims of other classes make the pod wait, as
//! kube-scheduler does; a `ReadWriteOncePod` claim in use refuses the pod; and CSI
//! volumes count against the node's attach limits (NodeVolumeLimits).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::cluster::{ClusterState, Node};
use crate::key::ObjectKey;
use crate::request::GangRequest;
use crate::selector::{NodeSelector, Operator};
use crate::storage::{Offer, Pv, Pvc, StorageClass, matching_volume};

/// Why the gang cannot be placed on any node because of a pod's claims.
pub(super) type VolumeError = String;

/// One pod's claims, resolved.
#[derive(Default)]
pub(super) struct PodVolumes<'a> {
    /// Claims bound to their volumes.
    bound: Vec<(&'a Pvc, &'a Pv)>,
    /// Unbound claims of late-binding classes, smallest request first (the order in
    /// which kube-scheduler matches them).
    late: Vec<&'a Pvc>,
    /// `ReadWriteOncePod` claims.
    exclusive: Vec<ObjectKey>,
    /// CSI volumes: driver and unique name.
    csi: Vec<(String, String)>,
}

impl PodVolumes<'_> {
    pub(super) fn is_empty(&self) -> bool {
        self.bound.is_empty() && self.late.is_empty() && self.exclusive.is_empty() && self.csi.is_empty()
    }
}

/// Volumes that could be bound to the claims of one group's volume slot, by node
/// affinity: the same for every pod whose claim in that slot asks for the same.
struct Pools<'a> {
    /// Distinct node affinities, each with its volumes, smallest first.
    pools: Vec<(Option<&'a NodeSelector>, Vec<&'a Pv>)>,
    /// Pools a node may reach, by one `key In (values)` requirement every term of their
    /// affinity has: only those with the node's value need checking.
    by_label: FxHashMap<(&'a str, &'a str), Vec<usize>>,
    /// The keys `by_label` uses.
    index_keys: Vec<&'a str>,
    /// When every pool's affinity is only `key In (values)` of one key: the pools each
    /// value of it reaches, as bits, and the key.
    by_value: Option<(&'a str, FxHashMap<&'a str, u64>)>,
    /// Pools without such a requirement: always checked.
    unindexed: Vec<usize>,
    /// Per node id, the pools it reaches as bits, once known (up to 64 pools).
    reach: RefCell<Vec<Option<u64>>>,
    /// The claim's class, if it can create volumes (then a node it provisions for needs
    /// no static volume).
    provisioning: Option<&'a StorageClass>,
    /// "free PersistentVolumes of class …", for explanations.
    why: Arc<str>,
}

impl<'a> Pools<'a> {
    fn new(cluster: &'a ClusterState, claim: &Pvc, taken: &dyn Fn(&str) -> bool) -> Self {
        let mut pools: Vec<(Option<&NodeSelector>, Vec<&Pv>)> = Vec::new();
        let mut by_affinity: FxHashMap<Option<&NodeSelector>, usize> = FxHashMap::default();
        // Volumes come in name order, so the pools do too.
        for volume in cluster.storage().volumes_of_class(&claim.class) {
            // Node affinity aside, which is what the pools sort out. Volumes other plans
            // took are theirs.
            if matches!(volume.offers_where(claim, true), Offer::Yes) && !taken(&volume.name) {
                let affinity = volume.node_affinity.as_ref();
                let pool = *by_affinity.entry(affinity).or_insert_with(|| {
                    pools.push((affinity, Vec::new()));
                    pools.len() - 1
                });
                pools[pool].1.push(volume);
            }
        }
        for (_, volumes) in &mut pools {
            volumes.sort_by(|a, b| a.capacity.cmp(&b.capacity).then_with(|| a.name.cmp(&b.name)));
        }
        let mut by_label: FxHashMap<(&str, &str), Vec<usize>> = FxHashMap::default();
        let mut unindexed = Vec::new();
        for (i, (selector, _)) in pools.iter().enumerate() {
            match selector.and_then(|s| index_requirement(s)) {
                Some((key, values)) => {
                    for value in values {
                        by_label.entry((key, value)).or_default().push(i);
                    }
                }
                None => unindexed.push(i),
            }
        }
        let nodes = if pools.len() <= 64 { cluster.node_id_bound() } else { 0 };
        let mut index_keys: Vec<&str> = by_label.keys().map(|(key, _)| *key).collect();
        index_keys.sort_unstable();
        index_keys.dedup();
        let only_index = |selector: &NodeSelector| {
            selector.terms.iter().all(|t| {
                t.match_fields.is_empty() && matches!(t.match_expressions.as_slice(), [r] if r.operator == Operator::In)
            })
        };
        let by_value = match index_keys.as_slice() {
            [key]
                if pools.len() <= 64
                    && unindexed.is_empty()
                    && pools.iter().all(|(s, _)| s.is_some_and(only_index)) =>
            {
                let mut masks: FxHashMap<&str, u64> = FxHashMap::default();
                for ((_, value), reached) in &by_label {
                    *masks.entry(*value).or_default() |= reached.iter().fold(0u64, |m, i| m | (1 << i));
                }
                Some((*key, masks))
            }
            _ => None,
        };
        Pools {
            pools,
            by_label,
            index_keys,
            by_value,
            unindexed,
            reach: RefCell::new(vec![None; nodes]),
            provisioning: cluster
                .storage()
                .class(&claim.class)
                .filter(|c| !c.provisioner.is_empty() && c.provisioner != crate::storage::NO_PROVISIONER),
            why: Arc::from(format!("free PersistentVolumes of class {:?}", claim.class)),
        }
    }

    /// Whether the claim's class creates volumes for a node with `labels`.
    fn provisions(&self, labels: &BTreeMap<String, String>) -> bool {
        self.provisioning.is_some_and(|c| c.provisions_for(labels))
    }

    /// The pools node `id` with `labels` reaches, as bits (`None` past 64 pools).
    fn mask(&self, id: usize, labels: &BTreeMap<String, String>) -> Option<u64> {
        let mut reach = self.reach.borrow_mut();
        let slot = reach.get_mut(id)?;
        if let Some(mask) = slot {
            return Some(*mask);
        }
        if let Some((key, masks)) = &self.by_value {
            let mask = labels
                .get(*key)
                .and_then(|v| masks.get(v.as_str()))
                .copied()
                .unwrap_or(0);
            *slot = Some(mask);
            return Some(mask);
        }
        let mut mask = 0u64;
        let mut consider = |i: usize| {
            if mask & (1 << i) == 0 && self.pools[i].0.is_none_or(|s| s.matches("", labels)) {
                mask |= 1 << i;
            }
        };
        self.unindexed.iter().for_each(|i| consider(*i));
        for key in &self.index_keys {
            if let Some(pools) = labels.get(*key).and_then(|v| self.by_label.get(&(*key, v.as_str()))) {
                pools.iter().for_each(|i| consider(*i));
            }
        }
        *slot = Some(mask);
        Some(mask)
    }

    fn pools_of(&self, id: usize, labels: &BTreeMap<String, String>) -> Vec<usize> {
        match self.mask(id, labels) {
            Some(mask) => (0..self.pools.len()).filter(|i| mask & (1 << i) != 0).collect(),
            None => self.reachable(labels),
        }
    }

    /// Indices of the pools whose volumes a node with `labels` reaches.
    fn reachable(&self, labels: &BTreeMap<String, String>) -> Vec<usize> {
        let mut found: Vec<usize> = self.unindexed.clone();
        for key in &self.index_keys {
            if let Some(pools) = labels.get(*key).and_then(|v| self.by_label.get(&(*key, v.as_str()))) {
                found.extend(pools);
            }
        }
        found.sort_unstable();
        found.dedup();
        found.retain(|i| self.pools[*i].0.is_none_or(|s| s.matches("", labels)));
        found
    }

    /// The smallest volume reachable from node `id` with `labels` not `taken`.
    fn smallest_free(&self, id: usize, labels: &BTreeMap<String, String>, taken: &FxHashSet<&str>) -> Option<&'a Pv> {
        self.pools_of(id, labels)
            .into_iter()
            .filter_map(|i| self.pools[i].1.iter().find(|v| !taken.contains(v.name.as_str())))
            .min_by(|a, b| a.capacity.cmp(&b.capacity).then_with(|| a.name.cmp(&b.name)))
            .copied()
    }

    /// How many volumes node `id` with `labels` reaches.
    fn count(&self, id: usize, labels: &BTreeMap<String, String>) -> usize {
        match self.mask(id, labels) {
            Some(mask) => (0..self.pools.len())
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| self.pools[i].1.len())
                .sum(),
            None => self.reachable(labels).into_iter().map(|i| self.pools[i].1.len()).sum(),
        }
    }

    /// How many distinct volumes these nodes reach.
    fn count_over<'n>(&self, nodes: impl Iterator<Item = (usize, &'n Node)>) -> usize {
        let mut mask = 0u64;
        let mut pools: FxHashSet<usize> = FxHashSet::default();
        for (id, node) in nodes {
            match self.mask(id, &node.labels) {
                Some(m) => mask |= m,
                None => pools.extend(self.reachable(&node.labels)),
            }
        }
        pools.extend((0..self.pools.len().min(64)).filter(|i| mask & (1 << i) != 0));
        pools.into_iter().map(|i| self.pools[i].1.len()).sum()
    }
}

/// A `key In (values)` requirement every term of `selector` has, to index it by.
fn index_requirement(selector: &NodeSelector) -> Option<(&str, Vec<&str>)> {
    let first = selector.terms.first()?;
    let requirement = first.match_expressions.iter().find(|r| r.operator == Operator::In)?;
    let mut values: Vec<&str> = Vec::new();
    for term in &selector.terms {
        let same_key = term
            .match_expressions
            .iter()
            .find(|r| r.operator == Operator::In && r.key == requirement.key)?;
        values.extend(same_key.values.iter().map(String::as_str));
    }
    Some((requirement.key.as_str(), values))
}

/// Two claims that ask the same of a volume: the same pools serve both.
fn same_ask(a: &Pvc, b: &Pvc) -> bool {
    a.class == b.class
        && a.request == b.request
        && a.access_modes == b.access_modes
        && a.selector == b.selector
        && a.block == b.block
        && a.volume_attributes_class == b.volume_attributes_class
        && a.selected_node.is_none()
        && b.selected_node.is_none()
}

/// The gang's claims, resolved once per planning call.
pub(super) struct GangVolumes<'a> {
    cluster: &'a ClusterState,
    /// Volumes the gang's own pods took in an earlier plan still assumed: theirs again.
    own_taken: FxHashSet<String>,
    /// Per group, per pod.
    pods: Vec<Vec<PodVolumes<'a>>>,
    /// Per group, per late claim slot (as the first pod orders them): the pools, when every
    /// pod's claim in that slot asks the same and no volume is meant for one of them.
    slots: Vec<Vec<Option<Pools<'a>>>>,
    /// Per group: whether no pod has claims, and whether every pod has the same bound
    /// volumes.
    empty: Vec<bool>,
    alike_bound: Vec<bool>,
    /// Per group: whether its pods are interchangeable for their volumes.
    alike: Vec<bool>,
    /// Per node with attach limits: the CSI volumes its pods use, by driver.
    attached: FxHashMap<&'a str, FxHashMap<String, FxHashSet<String>>>,
    /// Whether any pod has claims.
    pub(super) any: bool,
}

/// A pod's volume check on one node failed, for good while the gang fills up (volumes
/// and attach slots are only ever taken): why.
pub(super) struct VolumeRefusal {
    pub(super) reason: String,
}

impl<'a> GangVolumes<'a> {
    pub(super) fn new(cluster: &'a ClusterState, gang: &'a GangRequest) -> Result<Self, VolumeError> {
        let storage = cluster.storage();
        let mut pods = Vec::with_capacity(gang.groups.len());
        let mut any = false;
        for group in &gang.groups {
            let mut resolved = Vec::with_capacity(group.pods.len());
            for pod in &group.pods {
                let mut volumes = PodVolumes::default();
                for key in &pod.volumes {
                    let claim = storage
                        .claim(key)
                        .ok_or_else(|| format!("pod {}: PersistentVolumeClaim {key} not found", pod.key))?;
                    if claim.deleting {
                        return Err(format!("pod {}: PersistentVolumeClaim {key} is being deleted", pod.key));
                    }
                    if claim.lost {
                        return Err(format!(
                            "pod {}: PersistentVolumeClaim {key} is bound to a PersistentVolume that does not exist",
                            pod.key
                        ));
                    }
                    if claim.read_write_once_pod() {
                        if cluster.claim_in_use(key) {
                            return Err(format!(
                                "pod {}: PersistentVolumeClaim {key} with access mode ReadWriteOncePod is in use by another pod",
                                pod.key
                            ));
                        }
                        volumes.exclusive.push(key.clone());
                    }
                    if let Some(csi) = storage.csi_volume(claim) {
                        volumes.csi.push(csi);
                    }
                    if claim.is_bound() {
                        let name = claim.volume_name.as_deref().unwrap_or_default();
                        let volume = storage.volume(name).ok_or_else(|| {
                            format!(
                                "pod {}: PersistentVolumeClaim {key} is bound to PersistentVolume {name}, which does not exist",
                                pod.key
                            )
                        })?;
                        volumes.bound.push((claim, volume));
                        continue;
                    }
                    if let Some(volume) = &claim.volume_name {
                        return Err(format!(
                            "pod {} waits for its PersistentVolumeClaim {key} to be bound: it names PersistentVolume \
                             {volume}, but kube-controller-manager has not completed the binding yet (no \
                             pv.kubernetes.io/bind-completed annotation)",
                            pod.key
                        ));
                    }
                    let late = storage.binds_late(claim).map_err(|e| format!("pod {}: {e}", pod.key))?;
                    if !late {
                        return Err(format!(
                            "pod {} waits for its PersistentVolumeClaim {key} to be bound (its StorageClass {:?} binds at once, not for the first pod)",
                            pod.key, claim.class
                        ));
                    }
                    volumes.late.push(claim);
                }
                // kube-scheduler matches the smallest requests first.
                volumes
                    .late
                    .sort_by(|a, b| a.request.cmp(&b.request).then_with(|| a.key.cmp(&b.key)));
                any |= !volumes.is_empty();
                resolved.push(volumes);
            }
            pods.push(resolved);
        }
        let own_taken: FxHashSet<String> = gang
            .groups
            .iter()
            .flat_map(|g| &g.pods)
            .filter_map(|p| cluster.pod(&p.key))
            .flat_map(|entry| entry.traits.volumes_taken.iter().cloned())
            .collect();
        let taken = |name: &str| cluster.volume_taken(name) && !own_taken.contains(name);
        let slots = pods
            .iter()
            .map(|group: &Vec<PodVolumes<'_>>| {
                let Some(first) = group.first() else { return Vec::new() };
                (0..first.late.len())
                    .map(|slot| {
                        let representative = first.late[slot];
                        let alike = group
                            .iter()
                            .all(|p| p.late.len() == first.late.len() && same_ask(p.late[slot], representative));
                        let meant = storage
                            .volumes_of_class(&representative.class)
                            .any(|v| group.iter().any(|p| v.bound_to(p.late[slot])));
                        (alike && !meant).then(|| Pools::new(cluster, representative, &taken))
                    })
                    .collect()
            })
            .collect();
        let mut attached: FxHashMap<&str, FxHashMap<String, FxHashSet<String>>> = FxHashMap::default();
        // Only where a limit can bite: a driver of the gang's volumes with a limit.
        let limited = storage.limited_csi_drivers();
        let counted = pods
            .iter()
            .flatten()
            .any(|p| p.csi.iter().any(|(driver, _)| limited.contains(driver.as_str())));
        if counted {
            for node in cluster.nodes() {
                if storage
                    .csi_node(&node.name)
                    .is_none_or(|n| n.limits.values().all(Option::is_none))
                {
                    continue;
                }
                let mut by_driver: FxHashMap<String, FxHashSet<String>> = FxHashMap::default();
                for (_, entry) in cluster.pods_on(&node.name) {
                    for key in &entry.traits.volumes {
                        if let Some((driver, unique)) = storage.claim(key).and_then(|c| storage.csi_volume(c)) {
                            by_driver.entry(driver).or_default().insert(unique);
                        }
                    }
                }
                attached.insert(node.name.as_str(), by_driver);
            }
        }
        let empty = pods.iter().map(|g| g.iter().all(PodVolumes::is_empty)).collect();
        let alike_bound = pods
            .iter()
            .map(|group: &Vec<PodVolumes<'_>>| {
                group.first().is_none_or(|first| {
                    group.iter().all(|p| {
                        p.bound.len() == first.bound.len()
                            && p.bound.iter().zip(&first.bound).all(|(a, b)| a.1.name == b.1.name)
                    })
                })
            })
            .collect();
        let alike = pods
            .iter()
            .zip(&alike_bound)
            .zip(&slots)
            .map(
                |((group, bound), slots): ((&Vec<PodVolumes<'_>>, &bool), &Vec<Option<Pools<'_>>>)| {
                    let late = group.first().map_or(0, |p| p.late.len());
                    *bound && group.iter().all(|p| p.late.len() == late) && slots.iter().all(Option::is_some)
                },
            )
            .collect();
        Ok(GangVolumes {
            cluster,
            own_taken,
            empty,
            alike_bound,
            alike,
            pods,
            slots,
            attached,
            any,
        })
    }

    pub(super) fn pod(&self, group: usize, index: usize) -> &PodVolumes<'a> {
        &self.pods[group][index]
    }

    /// Whether the group's pods are interchangeable for their volumes: the same bound
    /// volumes, and late claims that draw on the same pools.
    pub(super) fn pods_alike(&self, group: usize) -> bool {
        self.alike[group]
    }

    /// Whether every pod of the group has the same bound volumes (one claim they share,
    /// or none): then what they allow holds for the whole group.
    fn bound_alike(&self, group: usize) -> bool {
        self.alike_bound[group]
    }

    /// Why a pod's bound volumes do not allow `node`.
    fn bound_conflict(pod: &PodVolumes<'_>, node: &Node) -> Option<String> {
        for (claim, volume) in &pod.bound {
            if !volume.reachable_from(&node.labels) {
                return Some(format!(
                    "node affinity of PersistentVolume {} (claim {})",
                    volume.name, claim.key
                ));
            }
            if !volume.in_zone_of(&node.labels) {
                return Some(format!(
                    "zone of PersistentVolume {} (claim {})",
                    volume.name, claim.key
                ));
            }
        }
        None
    }

    /// What the group's volumes allow on `node` for any of its pods: `Err` why none can
    /// go there, or how many could at most (`usize::MAX`: no bound from volumes) and what
    /// bounds them.
    pub(super) fn node_room(&self, group: usize, id: usize, node: &Node) -> Result<(usize, Option<Arc<str>>), String> {
        let Some(first) = self.pods[group].first() else {
            return Ok((usize::MAX, None));
        };
        if self.empty[group] {
            return Ok((usize::MAX, None));
        }
        if self.bound_alike(group)
            && let Some(why) = Self::bound_conflict(first, node)
        {
            return Err(why);
        }
        let mut room = (usize::MAX, None);
        for (slot, pools) in self.slots[group].iter().enumerate() {
            let Some(pools) = pools else { continue };
            if pools.provisions(&node.labels) {
                continue;
            }
            let count = pools.count(id, &node.labels);
            if count == 0 {
                return Err(format!(
                    "no free PersistentVolume of class {:?}",
                    first.late[slot].class
                ));
            }
            if count < room.0 {
                room = (count, Some(pools.why.clone()));
            }
        }
        if let Some((limit_room, driver)) = self.attach_room(group, node)?
            && limit_room < room.0
        {
            room = (limit_room, Some(Arc::from(format!("the attach limit of {driver}"))));
        }
        Ok(room)
    }

    /// How many more pods of the group the node's attach limits allow, by its first pod's
    /// new CSI volumes (`None`: no limit applies).
    fn attach_room(&self, group: usize, node: &Node) -> Result<Option<(usize, String)>, String> {
        let Some(first) = self.pods[group].first() else {
            return Ok(None);
        };
        let Some(attached) = self.attached.get(node.name.as_str()) else {
            return Ok(None);
        };
        let limits = match self.cluster.storage().csi_node(&node.name) {
            Some(csi) => &csi.limits,
            None => return Ok(None),
        };
        let mut room: Option<(usize, String)> = None;
        let mut per_driver: BTreeMap<&str, usize> = BTreeMap::new();
        for (driver, unique) in &first.csi {
            if !attached.get(driver).is_some_and(|a| a.contains(unique)) {
                *per_driver.entry(driver).or_default() += 1;
            }
        }
        for (driver, new) in per_driver {
            let Some(Some(limit)) = limits.get(driver) else {
                continue;
            };
            let used = attached.get(driver).map_or(0, FxHashSet::len) as i64;
            let free = (*limit - used).max(0) as usize;
            if free < new {
                return Err(format!("attach limit of {driver} ({limit} volumes) reached"));
            }
            if room.as_ref().is_none_or(|(r, _)| free / new < *r) {
                room = Some((free / new, driver.to_string()));
            }
        }
        Ok(room)
    }

    /// How many distinct volumes the nodes reach for each late slot of the group, as a
    /// bound of its pods there: the smallest, with its claim's class (`None`: no bound).
    pub(super) fn domain_room<'n>(
        &self,
        group: usize,
        nodes: impl Iterator<Item = (usize, &'n Node)> + Clone,
    ) -> Option<(usize, &'a str)> {
        let first = self.pods[group].first()?;
        let mut best: Option<(usize, &'a str)> = None;
        for (slot, pools) in self.slots[group].iter().enumerate() {
            let Some(pools) = pools else { continue };
            let claim = first.late[slot];
            if nodes.clone().any(|(_, n)| pools.provisions(&n.labels)) {
                continue;
            }
            let count = pools.count_over(nodes.clone());
            if best.as_ref().is_none_or(|(b, _)| count < *b) {
                best = Some((count, claim.class.as_str()));
            }
        }
        best
    }

    /// Whether another plan's pods took the volume.
    fn taken_by_others(&self, volume: &str) -> bool {
        self.cluster.volume_taken(volume) && !self.own_taken.contains(volume)
    }

    fn provisions(&self, claim: &Pvc, node: &Node) -> bool {
        self.cluster
            .storage()
            .class(&claim.class)
            .is_some_and(|class| class.provisions_for(&node.labels))
    }

    /// Whether pod `index` of `group` may go to `node` with the volumes the gang's placed
    /// pods hold in `held`: the volumes its late claims would get there, or why not.
    pub(super) fn place(
        &self,
        group: usize,
        index: usize,
        id: usize,
        node: &Node,
        held: &VolumesHeld,
    ) -> Result<Vec<String>, VolumeRefusal> {
        let pod = &self.pods[group][index];
        if let Some(reason) = Self::bound_conflict(pod, node) {
            return Err(VolumeRefusal { reason });
        }
        for key in &pod.exclusive {
            if held.exclusive.contains(key) {
                return Err(VolumeRefusal {
                    reason: format!("PersistentVolumeClaim {key} (ReadWriteOncePod) used by another pod of the gang"),
                });
            }
        }
        self.attach_check(pod, node, held)?;
        let mut chosen: Vec<String> = Vec::new();
        for (slot, claim) in pod.late.iter().enumerate() {
            if let Some(selected) = &claim.selected_node {
                if *selected != node.name {
                    return Err(VolumeRefusal {
                        reason: format!("claim {} is being provisioned for node {selected}", claim.key),
                    });
                }
                if self.provisions(claim, node) {
                    continue;
                }
                return Err(VolumeRefusal {
                    reason: format!("claim {} cannot be provisioned", claim.key),
                });
            }
            let taken: FxHashSet<&str> = held
                .volumes
                .iter()
                .map(String::as_str)
                .chain(chosen.iter().map(String::as_str))
                .collect();
            let found = match self.slots[group].get(slot).and_then(Option::as_ref) {
                Some(pools) if pod.late.len() == self.pods[group][0].late.len() => {
                    pools.smallest_free(id, &node.labels, &taken)
                }
                _ => matching_volume(
                    claim,
                    self.cluster.storage().volumes_of_class(&claim.class),
                    &node.labels,
                    &|name: &str| taken.contains(name) || self.taken_by_others(name),
                ),
            };
            match found {
                Some(volume) => chosen.push(volume.name.clone()),
                None if self.provisions(claim, node) => {}
                None => {
                    return Err(VolumeRefusal {
                        reason: format!("no free PersistentVolume of class {:?}", claim.class),
                    });
                }
            }
        }
        Ok(chosen)
    }

    fn attach_check(&self, pod: &PodVolumes<'_>, node: &Node, held: &VolumesHeld) -> Result<(), VolumeRefusal> {
        if pod.csi.is_empty() {
            return Ok(());
        }
        let Some(attached) = self.attached.get(node.name.as_str()) else {
            return Ok(());
        };
        let Some(csi) = self.cluster.storage().csi_node(&node.name) else {
            return Ok(());
        };
        let gang = held.attached.get(&node.name);
        let mut new: BTreeMap<&str, usize> = BTreeMap::new();
        for (driver, unique) in &pod.csi {
            let present = attached.get(driver).is_some_and(|a| a.contains(unique))
                || gang.is_some_and(|g| g.contains_key(&(driver.clone(), unique.clone())));
            if !present {
                *new.entry(driver).or_default() += 1;
            }
        }
        for (driver, count) in new {
            let Some(Some(limit)) = csi.limits.get(driver) else {
                continue;
            };
            let used = attached.get(driver).map_or(0, FxHashSet::len)
                + gang.map_or(0, |g| {
                    g.keys()
                        .filter(|(d, unique)| d == driver && !attached.get(driver).is_some_and(|a| a.contains(unique)))
                        .count()
                });
            if (used + count) as i64 > *limit {
                return Err(VolumeRefusal {
                    reason: format!("attach limit of {driver} ({limit} volumes)"),
                });
            }
        }
        Ok(())
    }
}

/// What the gang's placed pods hold of volumes: static volumes chosen for their late
/// claims, `ReadWriteOncePod` claims, and CSI volumes per node.
#[derive(Clone, Default, Debug)]
pub(super) struct VolumesHeld {
    volumes: FxHashSet<String>,
    exclusive: FxHashSet<ObjectKey>,
    /// Per node: CSI volumes (driver, unique name) and how many placed pods use each.
    attached: FxHashMap<String, FxHashMap<(String, String), u32>>,
}

impl VolumesHeld {
    pub(super) fn hold(&mut self, pod: &PodVolumes<'_>, node: &str, chosen: &[String]) {
        self.volumes.extend(chosen.iter().cloned());
        self.exclusive.extend(pod.exclusive.iter().cloned());
        if !pod.csi.is_empty() {
            let on_node = self.attached.entry(node.to_string()).or_default();
            for volume in &pod.csi {
                *on_node.entry(volume.clone()).or_default() += 1;
            }
        }
    }

    pub(super) fn release(&mut self, pod: &PodVolumes<'_>, node: &str, chosen: &[String]) {
        for name in chosen {
            self.volumes.remove(name);
        }
        for key in &pod.exclusive {
            self.exclusive.remove(key);
        }
        if let Some(on_node) = self.attached.get_mut(node) {
            for volume in &pod.csi {
                if let Some(users) = on_node.get_mut(volume) {
                    *users -= 1;
                    if *users == 0 {
                        on_node.remove(volume);
                    }
                }
            }
        }
    }
}
