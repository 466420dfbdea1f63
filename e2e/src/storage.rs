//! Storage the tests make: StorageClasses without a provisioner (static volumes only,
//! binding at once or at the first consumer) and local volumes bound to nodes by label.

use anyhow::Result;
use k8s_openapi::api::core::v1::PersistentVolume;
use k8s_openapi::api::storage::v1::StorageClass;
use serde_json::{Value, json};

/// A StorageClass whose volumes are made by hand, binding `WaitForFirstConsumer` or
/// `Immediate`.
pub fn static_class(name: &str, binding_mode: &str) -> Result<StorageClass> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "provisioner": "kubernetes.io/no-provisioner",
        "volumeBindingMode": binding_mode,
    }))?)
}

/// A ReadWriteOnce local volume of `class` and `size` that nodes with `key=value` reach,
/// with `labels`, kept when its claim goes.
pub fn local_volume(
    name: &str,
    class: &str,
    size: &str,
    key: &str,
    value: &str,
    labels: Value,
) -> Result<PersistentVolume> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "storageClassName": class,
            "capacity": {"storage": size},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "local": {"path": format!("/mnt/{name}")},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": key, "operator": "In", "values": [value]}]},
            ]}},
        },
    }))?)
}
