//! PersistentVolumeClaims, PersistentVolumes, StorageClasses and CSINodes in the engine's
//! terms.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimSpec};
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use muster_engine::key::ObjectKey;
use muster_engine::storage::{AccessModes, BindingMode, ClaimRef, CsiNode, Pv, Pvc, StorageClass as Class};

use super::scheduling::label_selector;
use super::{ConvertError, node_selector, quantity};

const BETA_CLASS: &str = "volume.beta.kubernetes.io/storage-class";
const BIND_COMPLETED: &str = "pv.kubernetes.io/bind-completed";
const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
const DEFAULT_CLASS: &str = "storageclass.kubernetes.io/is-default-class";

/// A claim's spec as the engine sees it, for claim `key` (with no status yet).
pub fn claim_spec(
    object: &str,
    key: ObjectKey,
    spec: &PersistentVolumeClaimSpec,
    class: Option<String>,
) -> Result<Pvc, ConvertError> {
    Ok(Pvc {
        key,
        uid: String::new(),
        class: class.or_else(|| spec.storage_class_name.clone()).unwrap_or_default(),
        volume_name: spec.volume_name.clone().filter(|n| !n.is_empty()),
        bind_completed: false,
        access_modes: AccessModes::parse(spec.access_modes.iter().flatten().map(String::as_str)),
        request: spec
            .resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .and_then(|r| r.get("storage"))
            .map(|q| quantity(object, "spec.resources.requests.storage", q))
            .transpose()?,
        selector: spec
            .selector
            .as_ref()
            .map(|s| label_selector(object, Some(s)))
            .transpose()?,
        block: spec.volume_mode.as_deref() == Some("Block"),
        selected_node: None,
        volume_attributes_class: spec.volume_attributes_class_name.clone().filter(|n| !n.is_empty()),
        deleting: false,
        lost: false,
    })
}

pub fn claim(claim: &PersistentVolumeClaim) -> Result<Pvc, ConvertError> {
    let key = super::object_key(claim);
    let object = format!("PersistentVolumeClaim {key}");
    let annotations = claim.metadata.annotations.clone().unwrap_or_default();
    let spec = claim.spec.clone().unwrap_or_default();
    let mut pvc = claim_spec(&object, key, &spec, annotations.get(BETA_CLASS).cloned())?;
    pvc.uid = claim.metadata.uid.clone().unwrap_or_default();
    pvc.bind_completed = annotations.contains_key(BIND_COMPLETED);
    pvc.selected_node = annotations.get(SELECTED_NODE).cloned();
    pvc.deleting = claim.metadata.deletion_timestamp.is_some();
    pvc.lost = claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Lost");
    Ok(pvc)
}

pub fn volume(volume: &PersistentVolume) -> Result<Pv, ConvertError> {
    let name = volume.metadata.name.clone().unwrap_or_default();
    let object = format!("PersistentVolume {name}");
    let spec = volume.spec.clone().unwrap_or_default();
    let annotations = volume.metadata.annotations.clone().unwrap_or_default();
    Ok(Pv {
        labels: volume.metadata.labels.clone().unwrap_or_default(),
        class: annotations
            .get(BETA_CLASS)
            .cloned()
            .or(spec.storage_class_name)
            .unwrap_or_default(),
        capacity: spec
            .capacity
            .as_ref()
            .and_then(|c| c.get("storage"))
            .map(|q| quantity(&object, "spec.capacity.storage", q))
            .transpose()?,
        access_modes: AccessModes::parse(spec.access_modes.iter().flatten().map(String::as_str)),
        block: spec.volume_mode.as_deref() == Some("Block"),
        claim_ref: spec.claim_ref.map(|r| ClaimRef {
            namespace: r.namespace.unwrap_or_default(),
            name: r.name.unwrap_or_default(),
            uid: r.uid.unwrap_or_default(),
        }),
        // A volume written in a file, not created yet, will be available once it is.
        available: matches!(
            volume.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Available") | None
        ),
        node_affinity: spec
            .node_affinity
            .and_then(|a| a.required)
            .map(|s| node_selector(&object, &s))
            .transpose()?,
        csi: spec.csi.map(|c| (c.driver, c.volume_handle)),
        volume_attributes_class: spec.volume_attributes_class_name.filter(|n| !n.is_empty()),
        deleting: volume.metadata.deletion_timestamp.is_some(),
        name,
    })
}

pub fn storage_class(class: &StorageClass) -> Class {
    Class {
        name: class.metadata.name.clone().unwrap_or_default(),
        provisioner: class.provisioner.clone(),
        binding_mode: match class.volume_binding_mode.as_deref() {
            Some("WaitForFirstConsumer") => Some(BindingMode::WaitForFirstConsumer),
            Some("Immediate") => Some(BindingMode::Immediate),
            _ => None,
        },
        allowed_topologies: class
            .allowed_topologies
            .iter()
            .flatten()
            .map(|term| {
                term.match_label_expressions
                    .iter()
                    .flatten()
                    .map(|r| (r.key.clone(), r.values.clone()))
                    .collect()
            })
            .collect(),
    }
}

/// Whether a StorageClass is marked the default one.
pub fn is_default_class(class: &StorageClass) -> bool {
    class
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(DEFAULT_CLASS))
        .is_some_and(|v| v == "true")
}

pub fn csi_node(node: &CSINode) -> CsiNode {
    CsiNode {
        limits: node
            .spec
            .drivers
            .iter()
            .map(|d| {
                (
                    d.name.clone(),
                    d.allocatable.as_ref().and_then(|a| a.count).map(i64::from),
                )
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_and_volumes_read_as_the_scheduler_reads_them() {
        let pvc: PersistentVolumeClaim = serde_saphyr::from_str(
            r#"
metadata:
  name: data
  namespace: team
  uid: u1
  annotations: {pv.kubernetes.io/bind-completed: "yes", volume.beta.kubernetes.io/storage-class: old}
spec: {storageClassName: new, volumeName: pv-1, accessModes: [ReadWriteOncePod], resources: {requests: {storage: 10Gi}}}
status: {phase: Bound}
"#,
        )
        .unwrap();
        let pvc = claim(&pvc).unwrap();
        assert_eq!(pvc.class, "old", "the beta annotation wins");
        assert!(pvc.is_bound() && pvc.read_write_once_pod());
        let pv: PersistentVolume = serde_saphyr::from_str(
            r#"
metadata: {name: pv-1, labels: {topology.kubernetes.io/zone: z1}}
spec:
  storageClassName: old
  capacity: {storage: 20Gi}
  accessModes: [ReadWriteOncePod]
  claimRef: {namespace: team, name: data, uid: u1}
  csi: {driver: csi.example.com, volumeHandle: h1}
  nodeAffinity: {required: {nodeSelectorTerms: [{matchExpressions: [{key: topology.kubernetes.io/zone, operator: In, values: [z1]}]}]}}
status: {phase: Bound}
"#,
        )
        .unwrap();
        let pv = volume(&pv).unwrap();
        assert!(pv.bound_to(&pvc) && !pv.available);
        assert_eq!(pv.csi, Some(("csi.example.com".into(), "h1".into())));
        let class: StorageClass = serde_saphyr::from_str(
            r#"
metadata: {name: local, annotations: {storageclass.kubernetes.io/is-default-class: "true"}}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
"#,
        )
        .unwrap();
        assert!(is_default_class(&class));
        assert_eq!(
            storage_class(&class).binding_mode,
            Some(BindingMode::WaitForFirstConsumer)
        );
    }
}
