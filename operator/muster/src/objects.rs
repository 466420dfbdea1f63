//! Kubernetes objects read from YAML files — a `v1 List` as `kubectl get -o yaml`
//! prints it, or several YAML documents — sorted by kind, and the engine's cluster state
//! built from them.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{
    DeviceClass, DeviceTaintRule, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use muster_api::Workload;
use muster_engine::cluster::ClusterState;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;

use crate::convert::{self, ConvertError};

/// A file that cannot be read as Kubernetes objects.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{file}: {message}")]
    Syntax { file: String, message: String },
    #[error("{file}: document {document} ({object}): {message}")]
    Object {
        file: String,
        document: usize,
        object: String,
        message: String,
    },
}

/// The objects muster understands, by kind.
#[derive(Debug, Default, Clone)]
pub struct Objects {
    pub nodes: Vec<Node>,
    pub pods: Vec<Pod>,
    pub slices: Vec<ResourceSlice>,
    pub classes: Vec<DeviceClass>,
    pub taint_rules: Vec<DeviceTaintRule>,
    pub claims: Vec<ResourceClaim>,
    pub templates: Vec<ResourceClaimTemplate>,
    pub workloads: Vec<Workload>,
    /// Objects of other kinds, counted by kind.
    pub ignored: BTreeMap<String, usize>,
}

/// The largest file read: well above a 5,000-node cluster with its pods as kubectl
/// prints it (tens of megabytes), and a bound on what a hostile file can cost.
pub const MAX_FILE_BYTES: u64 = 1 << 30;

/// YAML limits for real clusters: millions of nodes and events, but few anchors and
/// aliases (kubectl prints none), so an alias bomb stops early.
fn yaml_options() -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_reader_input_bytes = Some(MAX_FILE_BYTES as usize);
    budget.max_events = 200_000_000;
    budget.max_nodes = 100_000_000;
    budget.max_total_scalar_bytes = MAX_FILE_BYTES as usize;
    budget.max_documents = 1_000_000;
    budget.max_aliases = 1_000;
    budget.max_anchors = 1_000;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options
}

impl Objects {
    /// Reads every object of a YAML or JSON text (`kubectl get -o yaml` or `-o json`, or
    /// several YAML documents). `file` names the source in errors.
    pub fn parse(file: &str, text: &str) -> Result<Self, LoadError> {
        let syntax = |message: String| LoadError::Syntax {
            file: file.to_string(),
            message,
        };
        let mut objects = Objects::default();
        // JSON is read as JSON, object by object straight from the text into its type:
        // no tree of the whole file is built, so memory stays near the file's size.
        if text.trim_start().starts_with('[') {
            let documents: Vec<&RawValue> = serde_json::from_str(text).map_err(|e| syntax(format!("JSON: {e}")))?;
            for (index, document) in documents.into_iter().enumerate() {
                objects.add_json(file, index + 1, document)?;
            }
        } else if text.trim_start().starts_with('{') {
            let document: &RawValue = serde_json::from_str(text).map_err(|e| syntax(format!("JSON: {e}")))?;
            objects.add_json(file, 1, document)?;
        } else {
            let documents: Vec<serde_json::Value> =
                serde_saphyr::from_multiple_with_options(text, yaml_options()).map_err(|e| syntax(e.to_string()))?;
            for (index, document) in documents.into_iter().enumerate() {
                objects.add(file, index + 1, document)?;
            }
        }
        Ok(objects)
    }

    /// Adds one JSON object (a List's items one by one), deserialized from its text.
    fn add_json(&mut self, file: &str, document: usize, raw: &RawValue) -> Result<(), LoadError> {
        let text = raw.get();
        if text == "null" {
            return Ok(());
        }
        let head: Head = serde_json::from_str(text).map_err(|e| LoadError::Object {
            file: file.to_string(),
            document,
            object: "<unreadable>".into(),
            message: e.to_string(),
        })?;
        let kind = head.kind.unwrap_or_default();
        let object = format!(
            "{kind} {}",
            head.metadata.and_then(|m| m.name).unwrap_or("<unnamed>".into())
        );
        let bad = |message: String| LoadError::Object {
            file: file.to_string(),
            document,
            object: object.clone(),
            message,
        };
        if is_list(&kind) {
            let list: RawList = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
            for item in list.items.unwrap_or_default() {
                self.add_json(file, document, item)?;
            }
            return Ok(());
        }
        match kind.as_ref() {
            "" => return Err(bad("no kind: not a Kubernetes object".into())),
            "Node" => self.nodes.push(typed_json(text).map_err(bad)?),
            "Pod" => self.pods.push(typed_json(text).map_err(bad)?),
            "ResourceSlice" => self.slices.push(typed_json(text).map_err(bad)?),
            "DeviceClass" => self.classes.push(typed_json(text).map_err(bad)?),
            "DeviceTaintRule" => self.taint_rules.push(typed_json(text).map_err(bad)?),
            "ResourceClaim" => self.claims.push(typed_json(text).map_err(bad)?),
            "ResourceClaimTemplate" => self.templates.push(typed_json(text).map_err(bad)?),
            "Workload" => self.push_workload(typed_json(text).map_err(bad)?).map_err(bad)?,
            other => *self.ignored.entry(other.to_string()).or_default() += 1,
        }
        Ok(())
    }

    fn push_workload(&mut self, workload: Workload) -> Result<(), String> {
        muster_api::validation::validate(&workload).map_err(|problems| problems.join("; "))?;
        self.workloads.push(workload);
        Ok(())
    }

    /// Adds the objects of another file.
    pub fn extend(&mut self, other: Objects) {
        self.nodes.extend(other.nodes);
        self.pods.extend(other.pods);
        self.slices.extend(other.slices);
        self.classes.extend(other.classes);
        self.taint_rules.extend(other.taint_rules);
        self.claims.extend(other.claims);
        self.templates.extend(other.templates);
        self.workloads.extend(other.workloads);
        for (kind, n) in other.ignored {
            *self.ignored.entry(kind).or_default() += n;
        }
    }

    /// Adds one YAML document, a List's items one by one.
    fn add(&mut self, file: &str, document: usize, mut value: serde_json::Value) -> Result<(), LoadError> {
        if value.is_null() {
            return Ok(());
        }
        let kind = value
            .get("kind")
            .and_then(|k| k.as_str())
            .unwrap_or_default()
            .to_string();
        let name = value
            .pointer("/metadata/name")
            .and_then(|n| n.as_str())
            .unwrap_or("<unnamed>")
            .to_string();
        let object = format!("{kind} {name}");
        let bad = |message: String| LoadError::Object {
            file: file.to_string(),
            document,
            object: object.clone(),
            message,
        };
        if kind.is_empty() {
            return Err(bad("no kind: not a Kubernetes object".into()));
        }
        if is_list(&kind) {
            // Moved out, not copied: each item's tree goes once it is typed.
            let items = match value.get_mut("items").map(serde_json::Value::take) {
                Some(serde_json::Value::Array(items)) => items,
                _ => Vec::new(),
            };
            drop(value);
            for item in items {
                self.add(file, document, item)?;
            }
            return Ok(());
        }
        match kind.as_str() {
            "Node" => self.nodes.push(typed(value).map_err(bad)?),
            "Pod" => self.pods.push(typed(value).map_err(bad)?),
            "ResourceSlice" => self.slices.push(typed(value).map_err(bad)?),
            "DeviceClass" => self.classes.push(typed(value).map_err(bad)?),
            "DeviceTaintRule" => self.taint_rules.push(typed(value).map_err(bad)?),
            "ResourceClaim" => self.claims.push(typed(value).map_err(bad)?),
            "ResourceClaimTemplate" => self.templates.push(typed(value).map_err(bad)?),
            "Workload" => self.push_workload(typed(value).map_err(bad)?).map_err(bad)?,
            other => *self.ignored.entry(other.to_string()).or_default() += 1,
        }
        Ok(())
    }

    /// The engine's picture of a cluster holding these objects.
    pub fn cluster_state(&self) -> Result<ClusterState, ConvertError> {
        let mut cluster = ClusterState::new();
        for node in &self.nodes {
            cluster.upsert_node(convert::node(node)?);
        }
        for class in &self.classes {
            cluster.upsert_class(convert::device_class(class));
        }
        for slice in &self.slices {
            cluster.upsert_slice(convert::slice(slice)?);
        }
        for rule in &self.taint_rules {
            cluster.upsert_taint_rule(
                rule.metadata.name.as_deref().unwrap_or_default(),
                convert::taint_rule(rule),
            );
        }
        for pod in &self.pods {
            let (Some(node), Some(spec)) = (convert::pod_node(pod), pod.spec.as_ref()) else {
                continue;
            };
            let key = convert::key(pod.metadata.namespace.as_deref(), pod.metadata.name.as_deref());
            cluster.upsert_pod(&key, &node, convert::pod_requests(&format!("Pod {key}"), spec)?);
        }
        for claim in &self.claims {
            let key = convert::key(claim.metadata.namespace.as_deref(), claim.metadata.name.as_deref());
            if let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) {
                let devices = convert::allocation_devices(&format!("ResourceClaim {key}"), allocation)?;
                cluster.set_claim_allocation(&key, Some(devices));
            }
        }
        Ok(cluster)
    }
}

/// The kinds of lists kubectl prints.
fn is_list(kind: &str) -> bool {
    matches!(
        kind,
        "List"
            | "NodeList"
            | "PodList"
            | "ResourceSliceList"
            | "DeviceClassList"
            | "DeviceTaintRuleList"
            | "ResourceClaimList"
            | "ResourceClaimTemplateList"
            | "WorkloadList"
    )
}

/// What an object says it is, read without the rest of it.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(default, borrow)]
    kind: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow)]
    metadata: Option<HeadMetadata<'a>>,
}

#[derive(Deserialize)]
struct HeadMetadata<'a> {
    #[serde(default, borrow)]
    name: Option<std::borrow::Cow<'a, str>>,
}

/// A List's items, each still as text.
#[derive(Deserialize)]
struct RawList<'a> {
    #[serde(default, borrow)]
    items: Option<Vec<&'a RawValue>>,
}

/// `text` as a `T`, or an error that names the field at fault.
fn typed_json<T: DeserializeOwned>(text: &str) -> Result<T, String> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            e.inner().to_string()
        } else {
            format!("{path}: {}", e.inner())
        }
    })
}

fn typed<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, String> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            e.inner().to_string()
        } else {
            format!("{path}: {}", e.inner())
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_lists_and_documents_and_names_bad_objects() {
        let text = r#"
apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: Node, metadata: {name: n1}, status: {allocatable: {cpu: "8"}}}
- {apiVersion: v1, kind: ConfigMap, metadata: {name: c}}
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: gpu.example.com}
spec: {selectors: [{cel: {expression: "true"}}]}
"#;
        let objects = Objects::parse("snap.yaml", text).unwrap();
        assert_eq!((objects.nodes.len(), objects.classes.len()), (1, 1));
        assert_eq!(objects.ignored["ConfigMap"], 1);
        let cluster = objects.cluster_state().unwrap();
        assert_eq!(cluster.node("n1").unwrap().allocatable.cpu_millis, 8000);

        let bad = "apiVersion: v1\nkind: Node\nmetadata: {name: n1}\nspec: {unschedulable: maybe}\n";
        let e = Objects::parse("snap.yaml", bad).unwrap_err().to_string();
        assert!(
            e.starts_with("snap.yaml: document 1 (Node n1): spec.unschedulable: invalid type"),
            "{e}"
        );

        let e = Objects::parse("w.yaml", "kind: Workload\nmetadata: {name: w}\nspec: {podGroups: []}\n").unwrap_err();
        assert!(
            e.to_string()
                .contains("(Workload w): spec.podGroups: at least one pod group is required"),
            "{e}"
        );
        assert!(Objects::parse("x.yaml", "a: [").is_err());
    }

    #[test]
    fn reads_json_lists_arrays_and_objects_and_names_bad_objects() {
        let list = r#"{"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n\u0031"}, "status": {"allocatable": {"cpu": "8"}}},
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}},
            {"apiVersion": "v1", "kind": "NodeList", "items": [{"kind": "Node", "metadata": {"name": "n2"}}]}
        ]}"#;
        let objects = Objects::parse("snap.json", list).unwrap();
        assert_eq!(objects.nodes.len(), 2);
        assert_eq!(objects.nodes[0].metadata.name.as_deref(), Some("n1"));
        assert_eq!(objects.ignored["ConfigMap"], 1);

        let array = r#"[{"kind": "DeviceClass", "metadata": {"name": "gpu"}}, null]"#;
        assert_eq!(Objects::parse("a.json", array).unwrap().classes.len(), 1);

        let bad = r#"{"kind": "List", "items": [{"kind": "Node", "metadata": {"name": "n1"}, "spec": {"unschedulable": "maybe"}}]}"#;
        let e = Objects::parse("snap.json", bad).unwrap_err().to_string();
        assert!(
            e.starts_with("snap.json: document 1 (Node n1): spec.unschedulable: invalid type"),
            "{e}"
        );
        let e = Objects::parse(
            "w.json",
            r#"{"kind": "Workload", "metadata": {"name": "w"}, "spec": {"podGroups": []}}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("(Workload w): spec.podGroups"), "{e}");
        let e = Objects::parse("k.json", r#"{"metadata": {"name": "x"}}"#).unwrap_err();
        assert!(e.to_string().contains("no kind"), "{e}");
        assert!(Objects::parse("x.json", "[{").is_err());
    }
}
