//! PersistentVolumeClaims, PersistentVolumes, StorageClasses and CSINodes as kube-scheduler's
//! volume filters read them (VolumeBinding, VolumeZone, VolumeRestrictions,
//! NodeVolumeLimits), and the matching of an unbound claim to a static volume.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::key::ObjectKey;
use crate::labels::LabelSelector;
use crate::quantity::Quantity;
use crate::selector::NodeSelector;

/// The provisioner of classes whose volumes are only created by hand.
pub const NO_PROVISIONER: &str = "kubernetes.io/no-provisioner";

/// Node labels VolumeZone compares with a volume's labels of the same key.
pub const ZONE_LABELS: [&str; 4] = [
    "failure-domain.beta.kubernetes.io/zone",
    "failure-domain.beta.kubernetes.io/region",
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
];

/// Access modes, as bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AccessModes(u8);

impl AccessModes {
    pub const READ_WRITE_ONCE: AccessModes = AccessModes(1);
    pub const READ_ONLY_MANY: AccessModes = AccessModes(2);
    pub const READ_WRITE_MANY: AccessModes = AccessModes(4);
    pub const READ_WRITE_ONCE_POD: AccessModes = AccessModes(8);

    /// From the API's names; unknown ones are kept as a bit no volume offers.
    pub fn parse<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        AccessModes(names.into_iter().fold(0, |bits, name| {
            bits | match name {
                "ReadWriteOnce" => 1,
                "ReadOnlyMany" => 2,
                "ReadWriteMany" => 4,
                "ReadWriteOncePod" => 8,
                _ => 16,
            }
        }))
    }

    pub fn contains(self, other: AccessModes) -> bool {
        self.0 & other.0 == other.0
    }
}

/// A PersistentVolumeClaim.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Pvc {
    pub key: ObjectKey,
    pub uid: String,
    /// The beta annotation's class, else `spec.storageClassName`; empty: none.
    pub class: String,
    /// `spec.volumeName`.
    pub volume_name: Option<String>,
    /// `pv.kubernetes.io/bind-completed`: with a volume name, the claim is bound.
    pub bind_completed: bool,
    pub access_modes: AccessModes,
    /// `resources.requests.storage`.
    pub request: Option<Quantity>,
    pub selector: Option<LabelSelector>,
    pub block: bool,
    /// `volume.kubernetes.io/selected-node`: a node already chosen for provisioning.
    pub selected_node: Option<String>,
    pub volume_attributes_class: Option<String>,
    pub deleting: bool,
    /// `status.phase: Lost`.
    pub lost: bool,
}

impl Pvc {
    /// Bound to its volume for good.
    pub fn is_bound(&self) -> bool {
        self.volume_name.is_some() && self.bind_completed
    }

    pub fn read_write_once_pod(&self) -> bool {
        self.access_modes.contains(AccessModes::READ_WRITE_ONCE_POD)
    }
}

/// A PersistentVolume's `claimRef`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// A PersistentVolume.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Pv {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// The beta annotation's class, else `spec.storageClassName`.
    pub class: String,
    pub capacity: Option<Quantity>,
    pub access_modes: AccessModes,
    pub block: bool,
    pub claim_ref: Option<ClaimRef>,
    /// `status.phase: Available`.
    pub available: bool,
    /// `spec.nodeAffinity.required`.
    pub node_affinity: Option<NodeSelector>,
    /// The CSI driver and volume handle.
    pub csi: Option<(String, String)>,
    pub volume_attributes_class: Option<String>,
    pub deleting: bool,
}

impl Pv {
    /// Whether the volume is meant for `claim` (`IsVolumeBoundToClaim`).
    pub fn bound_to(&self, claim: &Pvc) -> bool {
        self.claim_ref.as_ref().is_some_and(|r| {
            r.name == claim.key.name()
                && r.namespace == claim.key.namespace()
                && (r.uid.is_empty() || r.uid == claim.uid)
        })
    }

    /// Whether the volume's node affinity accepts a node with `labels`. Like
    /// kube-scheduler, only labels count: a `metadata.name` field never matches.
    pub fn reachable_from(&self, labels: &BTreeMap<String, String>) -> bool {
        self.node_affinity.as_ref().is_none_or(|s| s.matches("", labels))
    }

    /// The zones (or regions) the volume's topology labels name, by label key
    /// (VolumeZone): values split at `__`; a malformed label is ignored.
    pub fn zone_topology(&self) -> Vec<(&str, BTreeSet<&str>)> {
        ZONE_LABELS
            .iter()
            .filter_map(|key| {
                let value = self.labels.get(*key)?;
                let zones: BTreeSet<&str> = value.split("__").map(str::trim).collect();
                (!zones.contains("")).then_some((*key, zones))
            })
            .collect()
    }

    /// Whether a node with `labels` is in the volume's zones (VolumeZone): nodes without
    /// any zone or region label pass.
    pub fn in_zone_of(&self, labels: &BTreeMap<String, String>) -> bool {
        if !ZONE_LABELS.iter().any(|k| labels.contains_key(*k)) {
            return true;
        }
        self.zone_topology().iter().all(|(key, zones)| {
            let value = labels.get(*key).or_else(|| labels.get(ga_label(key)));
            value.is_some_and(|v| zones.contains(v.as_str()))
        })
    }

    /// Whether the volume could be bound to `claim` on a node with `labels`, in the order
    /// `FindMatchingVolume` checks it.
    pub fn offers(&self, claim: &Pvc, labels: &BTreeMap<String, String>) -> Offer {
        self.offers_where(claim, self.reachable_from(labels))
    }

    /// [`Pv::offers`] on a node the volume is `reachable` from or not.
    pub fn offers_where(&self, claim: &Pvc, reachable: bool) -> Offer {
        if self.claim_ref.is_some() && !self.bound_to(claim) {
            return Offer::No;
        }
        let big_enough = match (&self.capacity, &claim.request) {
            (_, None) => true,
            (Some(capacity), Some(request)) => capacity >= request,
            (None, Some(request)) => request.sign() <= 0,
        };
        if !big_enough
            || self.block != claim.block
            || self.volume_attributes_class != claim.volume_attributes_class
            || self.deleting
        {
            return Offer::No;
        }
        if self.bound_to(claim) {
            return if reachable { Offer::Meant } else { Offer::MeantElsewhere };
        }
        if self.available
            && claim.selector.as_ref().is_none_or(|s| s.matches(&self.labels))
            && self.class == claim.class
            && reachable
            && self.access_modes.contains(claim.access_modes)
        {
            Offer::Yes
        } else {
            Offer::No
        }
    }
}

/// What a volume offers a claim on one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    No,
    Yes,
    /// The volume is meant for the claim (its `claimRef` names it) and reachable.
    Meant,
    /// Meant for the claim, but not reachable from the node: the claim has no volume there.
    MeantElsewhere,
}

fn ga_label(key: &str) -> &str {
    match key {
        "failure-domain.beta.kubernetes.io/zone" => "topology.kubernetes.io/zone",
        "failure-domain.beta.kubernetes.io/region" => "topology.kubernetes.io/region",
        other => other,
    }
}

/// When a StorageClass's claims are bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BindingMode {
    Immediate,
    WaitForFirstConsumer,
}

/// A StorageClass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageClass {
    pub name: String,
    pub provisioner: String,
    /// `None`: unset, which kube-scheduler refuses.
    pub binding_mode: Option<BindingMode>,
    /// `allowedTopologies`: terms of (label key, values); none allows every node.
    pub allowed_topologies: Vec<Vec<(String, Vec<String>)>>,
}

impl StorageClass {
    /// Whether new volumes of the class can be created for a node with `labels`.
    pub fn provisions_for(&self, labels: &BTreeMap<String, String>) -> bool {
        !self.provisioner.is_empty()
            && self.provisioner != NO_PROVISIONER
            && (self.allowed_topologies.is_empty()
                || self.allowed_topologies.iter().any(|term| {
                    term.iter()
                        .all(|(key, values)| labels.get(key).is_some_and(|v| values.contains(v)))
                }))
    }
}

/// A CSINode: per CSI driver on the node, how many of its volumes may be attached.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CsiNode {
    pub limits: BTreeMap<String, Option<i64>>,
}

/// The storage objects of the cluster.
#[derive(Clone, Debug, Default)]
pub struct Storage {
    claims: FxHashMap<ObjectKey, Arc<Pvc>>,
    volumes: BTreeMap<String, Arc<Pv>>,
    volumes_by_class: FxHashMap<String, BTreeSet<String>>,
    classes: BTreeMap<String, StorageClass>,
    csi_nodes: FxHashMap<String, CsiNode>,
}

impl Storage {
    pub fn upsert_claim(&mut self, claim: Pvc) {
        self.claims.insert(claim.key.clone(), Arc::new(claim));
    }

    pub fn remove_claim(&mut self, key: &ObjectKey) {
        self.claims.remove(key);
    }

    pub fn claim(&self, key: &ObjectKey) -> Option<&Pvc> {
        self.claims.get(key).map(Arc::as_ref)
    }

    pub fn claims(&self) -> impl Iterator<Item = &Pvc> {
        self.claims.values().map(Arc::as_ref)
    }

    pub fn upsert_volume(&mut self, volume: Pv) {
        self.remove_volume(&volume.name);
        self.volumes_by_class
            .entry(volume.class.clone())
            .or_default()
            .insert(volume.name.clone());
        self.volumes.insert(volume.name.clone(), Arc::new(volume));
    }

    pub fn remove_volume(&mut self, name: &str) {
        if let Some(old) = self.volumes.remove(name)
            && let Some(names) = self.volumes_by_class.get_mut(&old.class)
        {
            names.remove(name);
        }
    }

    pub fn volume(&self, name: &str) -> Option<&Pv> {
        self.volumes.get(name).map(Arc::as_ref)
    }

    pub fn volumes(&self) -> impl Iterator<Item = &Pv> {
        self.volumes.values().map(Arc::as_ref)
    }

    /// Volumes of a class, in name order.
    pub fn volumes_of_class<'a>(&'a self, class: &str) -> impl Iterator<Item = &'a Pv> + 'a {
        self.volumes_by_class
            .get(class)
            .into_iter()
            .flatten()
            .filter_map(|name| self.volumes.get(name).map(Arc::as_ref))
    }

    pub fn upsert_class(&mut self, class: StorageClass) {
        self.classes.insert(class.name.clone(), class);
    }

    pub fn remove_class(&mut self, name: &str) {
        self.classes.remove(name);
    }

    pub fn class(&self, name: &str) -> Option<&StorageClass> {
        self.classes.get(name)
    }

    pub fn classes(&self) -> impl Iterator<Item = &StorageClass> {
        self.classes.values()
    }

    pub fn upsert_csi_node(&mut self, node: &str, csi: CsiNode) {
        self.csi_nodes.insert(node.to_string(), csi);
    }

    pub fn remove_csi_node(&mut self, node: &str) {
        self.csi_nodes.remove(node);
    }

    pub fn csi_node(&self, node: &str) -> Option<&CsiNode> {
        self.csi_nodes.get(node)
    }

    /// CSI drivers some node limits the volumes of.
    pub fn limited_csi_drivers(&self) -> BTreeSet<&str> {
        self.csi_nodes
            .values()
            .flat_map(|n| n.limits.iter())
            .filter(|(_, limit)| limit.is_some())
            .map(|(driver, _)| driver.as_str())
            .collect()
    }

    /// Whether a claim waits for a node (its class binds at the first consumer) rather
    /// than for the volume controller (`IsDelayBindingMode`). A class that does not
    /// exist binds at once; `Err` for a class without a binding mode.
    pub fn binds_late(&self, claim: &Pvc) -> Result<bool, String> {
        if claim.class.is_empty() {
            return Ok(false);
        }
        match self.classes.get(&claim.class) {
            None => Ok(false),
            Some(class) => match class.binding_mode {
                None => Err(format!("VolumeBindingMode not set for StorageClass {:?}", class.name)),
                Some(mode) => Ok(mode == BindingMode::WaitForFirstConsumer),
            },
        }
    }

    /// The CSI volume a claim stands for: the driver and a name unique to the volume
    /// (`None`: no CSI volume, which attach limits ignore). An unbound claim of a
    /// class with a CSI provisioner will be a new volume of that driver.
    pub fn csi_volume(&self, claim: &Pvc) -> Option<(String, String)> {
        if let Some(volume) = claim.volume_name.as_deref().and_then(|name| self.volume(name)) {
            return volume
                .csi
                .as_ref()
                .map(|(driver, handle)| (driver.clone(), format!("{driver}^{handle}")));
        }
        let class = self.classes.get(&claim.class)?;
        (!class.provisioner.is_empty()).then(|| {
            (
                class.provisioner.clone(),
                format!("{}^new-{}", class.provisioner, claim.key),
            )
        })
    }
}

/// Among `volumes`, the one an unbound claim would be bound to on a node with `labels`
/// (`FindMatchingVolume`): a volume meant for the claim if it is reachable, else the
/// smallest that offers itself, skipping those `taken` names.
pub fn matching_volume<'a>(
    claim: &Pvc,
    volumes: impl Iterator<Item = &'a Pv>,
    labels: &BTreeMap<String, String>,
    taken: &dyn Fn(&str) -> bool,
) -> Option<&'a Pv> {
    let mut smallest: Option<&Pv> = None;
    for volume in volumes {
        if taken(&volume.name) {
            continue;
        }
        match volume.offers(claim, labels) {
            Offer::No => {}
            Offer::Meant => return Some(volume),
            Offer::MeantElsewhere => return None,
            Offer::Yes => {
                if smallest.is_none_or(|s| s.capacity.as_ref() > volume.capacity.as_ref()) {
                    smallest = Some(volume);
                }
            }
        }
    }
    smallest
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::selector::{Operator, Requirement, Term};

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn pv(name: &str, size: &str, zone: &str) -> Pv {
        Pv {
            name: name.into(),
            class: "local".into(),
            capacity: Some(Quantity::parse(size).unwrap()),
            access_modes: AccessModes::READ_WRITE_ONCE,
            available: true,
            node_affinity: Some(NodeSelector {
                terms: vec![Term {
                    match_expressions: vec![Requirement::new("topology.kubernetes.io/zone", Operator::In, &[zone])],
                    match_fields: vec![],
                }],
            }),
            ..Pv::default()
        }
    }

    fn pvc(size: &str) -> Pvc {
        Pvc {
            key: ObjectKey::new("ns", "data"),
            uid: "u1".into(),
            class: "local".into(),
            access_modes: AccessModes::READ_WRITE_ONCE,
            request: Some(Quantity::parse(size).unwrap()),
            ..Pvc::default()
        }
    }

    #[test]
    fn the_smallest_reachable_volume_that_is_big_enough_is_matched() {
        let volumes = [
            pv("a", "100Gi", "z1"),
            pv("b", "50Gi", "z1"),
            pv("c", "20Gi", "z1"),
            pv("d", "60Gi", "z2"),
        ];
        let zone1 = labels(&[("topology.kubernetes.io/zone", "z1")]);
        let none = |_: &str| false;
        assert_eq!(
            matching_volume(&pvc("30Gi"), volumes.iter(), &zone1, &none)
                .unwrap()
                .name,
            "b"
        );
        let b_taken = |name: &str| name == "b";
        assert_eq!(
            matching_volume(&pvc("30Gi"), volumes.iter(), &zone1, &b_taken)
                .unwrap()
                .name,
            "a"
        );
        assert!(matching_volume(&pvc("200Gi"), volumes.iter(), &zone1, &none).is_none());
        let mut rwx = pvc("10Gi");
        rwx.access_modes = AccessModes::READ_WRITE_MANY;
        assert!(
            matching_volume(&rwx, volumes.iter(), &zone1, &none).is_none(),
            "modes must be offered"
        );
    }

    #[test]
    fn a_volume_meant_for_the_claim_is_it_or_nothing() {
        let mut meant = pv("m", "10Gi", "z2");
        meant.claim_ref = Some(ClaimRef {
            namespace: "ns".into(),
            name: "data".into(),
            uid: String::new(),
        });
        meant.available = false;
        let volumes = [pv("a", "100Gi", "z1"), meant];
        let none = |_: &str| false;
        let zone2 = labels(&[("topology.kubernetes.io/zone", "z2")]);
        assert_eq!(
            matching_volume(&pvc("5Gi"), volumes.iter(), &zone2, &none)
                .unwrap()
                .name,
            "m"
        );
        let zone1 = labels(&[("topology.kubernetes.io/zone", "z1")]);
        assert!(matching_volume(&pvc("5Gi"), volumes.iter(), &zone1, &none).is_none());
    }

    #[test]
    fn zone_labels_restrict_nodes_that_have_zone_labels() {
        let mut volume = pv("a", "1Gi", "z1");
        volume.labels = labels(&[("topology.kubernetes.io/zone", "z1__z2")]);
        assert!(volume.in_zone_of(&labels(&[("topology.kubernetes.io/zone", "z2")])));
        assert!(!volume.in_zone_of(&labels(&[("topology.kubernetes.io/zone", "z3")])));
        assert!(
            volume.in_zone_of(&labels(&[("rack", "r1")])),
            "a node without zone labels passes"
        );
        volume.labels = labels(&[("failure-domain.beta.kubernetes.io/zone", "z1")]);
        assert!(
            volume.in_zone_of(&labels(&[("topology.kubernetes.io/zone", "z1")])),
            "beta label read as GA"
        );
    }
}
