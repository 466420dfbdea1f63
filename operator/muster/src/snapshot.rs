//! Kubernetes objects read from YAML files — a `v1 List` as `kubectl get -o yaml`
//! prints it, or several YAML documents — sorted by kind, and the engine's cluster state
//! built from them.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};

use k8s_openapi::api::core::v1::{LimitRange, Namespace, Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::resource::v1::{
    DeviceClass, DeviceTaintRule, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use muster_api::Workload;
use muster_engine::cluster::{self as model, ClusterState, PodEntry};
use muster_engine::key::PodKey;
use muster_engine::storage::{CsiNode, Pv, Pvc, StorageClass as Class};
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

/// The objects muster understands, by kind. Nodes, slices and the pods bound to nodes
/// are kept as the engine models them, converted as they are read, so that a large
/// cluster snapshot is never held twice.
#[derive(Debug, Default, Clone)]
pub struct Objects {
    pub nodes: Vec<model::Node>,
    pub slices: Vec<model::Slice>,
    /// Pods bound or nominated to a node, with what they use there.
    pub pods_on_nodes: Vec<PodOnNode>,
    /// Pods labelled as a Workload's, as read: a template-less group counts them.
    pub pods: Vec<Pod>,
    pub classes: Vec<DeviceClass>,
    pub taint_rules: Vec<DeviceTaintRule>,
    pub claims: Vec<ResourceClaim>,
    pub templates: Vec<ResourceClaimTemplate>,
    pub workloads: Vec<Workload>,
    /// PriorityClasses: what a Workload's `priorityClassName` is worth.
    pub priority_classes: Vec<PriorityClass>,
    /// LimitRanges and RuntimeClasses: the defaults and overhead the API server gives a
    /// pod it stores, for pods planned before they exist.
    pub limit_ranges: Vec<LimitRange>,
    pub runtime_classes: Vec<RuntimeClass>,
    /// PersistentVolumeClaims, PersistentVolumes, StorageClasses (with whether each is
    /// the default) and CSINodes, as the engine models them.
    pub volume_claims: Vec<Pvc>,
    pub volumes: Vec<Pv>,
    pub storage_classes: Vec<(Class, bool)>,
    pub csi_nodes: Vec<(String, CsiNode)>,
    /// Namespaces with their labels.
    pub namespaces: Vec<(String, BTreeMap<String, String>)>,
    /// Kueue's Workloads standing for muster's and its ResourceFlavors, read live (by
    /// `kubectl muster why`): a gang Kueue admitted is planned inside its decision.
    pub kueue_workloads: Vec<kube::api::DynamicObject>,
    pub kueue_flavors: Vec<kube::api::DynamicObject>,
    /// Objects of other kinds, counted by kind.
    pub ignored: BTreeMap<String, usize>,
}

/// A pod that uses resources on a node.
#[derive(Debug, Clone)]
pub struct PodOnNode {
    pub key: PodKey,
    pub entry: PodEntry,
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
        if starts_as_json(text.as_bytes()) {
            return Self::read_json(file, serde_json::Deserializer::from_str(text));
        }
        let documents: Vec<serde_json::Value> =
            serde_saphyr::from_multiple_with_options(text, yaml_options()).map_err(|e| syntax(file, e.to_string()))?;
        let mut objects = Objects::default();
        for (index, document) in documents.into_iter().enumerate() {
            objects.add(file, index + 1, document)?;
        }
        Ok(objects)
    }

    /// Reads every object of a YAML or JSON stream. JSON is read object by object as
    /// the stream goes, so the whole file is never held in memory.
    pub fn read(file: &str, reader: impl Read) -> Result<Self, LoadError> {
        let mut reader = BufReader::with_capacity(1 << 16, reader);
        let json = loop {
            let buffer = reader.fill_buf().map_err(|e| syntax(file, e.to_string()))?;
            match buffer.iter().position(|b| !b.is_ascii_whitespace()) {
                Some(at) => break starts_as_json(&buffer[at..]),
                None if buffer.is_empty() => break false,
                None => {
                    let consumed = buffer.len();
                    reader.consume(consumed);
                }
            }
        };
        if json {
            return Self::read_json(file, serde_json::Deserializer::from_reader(reader));
        }
        let mut text = String::new();
        reader
            .read_to_string(&mut text)
            .map_err(|e| syntax(file, e.to_string()))?;
        Self::parse(file, &text)
    }

    /// A JSON document: a List, an array of objects, or one object.
    fn read_json<'de, R: serde_json::de::Read<'de>>(
        file: &str,
        mut deserializer: serde_json::Deserializer<R>,
    ) -> Result<Self, LoadError> {
        let mut reader = JsonDocument {
            file,
            objects: Objects::default(),
            failure: None,
        };
        let read =
            serde::de::DeserializeSeed::deserialize(&mut reader, &mut deserializer).and_then(|()| deserializer.end());
        if let Some(failure) = reader.failure {
            return Err(failure);
        }
        read.map_err(|e| syntax(file, format!("JSON: {e}")))?;
        Ok(reader.objects)
    }

    /// Adds one JSON object (a List's items one by one), deserialized from its text;
    /// `default_kind` is its kind if it does not say.
    fn add_json(
        &mut self,
        file: &str,
        document: usize,
        raw: &RawValue,
        default_kind: Option<&str>,
    ) -> Result<(), LoadError> {
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
        let kind = head.kind.or(default_kind.map(Into::into)).unwrap_or_default();
        let name = head.metadata.and_then(|m| m.name).unwrap_or("<unnamed>".into());
        let bad = object_error(file, document, &kind, &name);
        if is_list(&kind) {
            let list: RawList = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
            for item in list.items.unwrap_or_default() {
                self.add_json(file, document, item, item_kind(&kind))?;
            }
            return Ok(());
        }
        self.push(&kind, JsonText(text)).map_err(bad)
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
        let bad = object_error(file, document, &kind, &name);
        if is_list(&kind) {
            // Moved out, not copied: each item's tree goes once it is typed.
            let items = match value.get_mut("items").map(serde_json::Value::take) {
                Some(serde_json::Value::Array(items)) => items,
                _ => Vec::new(),
            };
            drop(value);
            for mut item in items {
                if let (Some(object), Some(kind)) = (item.as_object_mut(), item_kind(&kind)) {
                    object.entry("kind").or_insert_with(|| kind.into());
                }
                self.add(file, document, item)?;
            }
            return Ok(());
        }
        self.push(&kind, value).map_err(bad)
    }

    /// Adds one object of `kind`, typed from `source`.
    fn push(&mut self, kind: &str, source: impl Source) -> Result<(), String> {
        match kind {
            "" => return Err("no kind: not a Kubernetes object".into()),
            "Node" => self.add_node(&source.typed()?).map_err(|e| e.message)?,
            "ResourceSlice" => self.add_slice(&source.typed()?).map_err(|e| e.message)?,
            "Pod" => self.add_pod(source.typed()?).map_err(|e| e.message)?,
            "DeviceClass" => self.classes.push(source.typed()?),
            "DeviceTaintRule" => self.taint_rules.push(source.typed()?),
            "ResourceClaim" => self.claims.push(source.typed()?),
            "ResourceClaimTemplate" => self.templates.push(source.typed()?),
            "PriorityClass" => self.priority_classes.push(source.typed()?),
            "LimitRange" => self.limit_ranges.push(source.typed()?),
            "RuntimeClass" => self.runtime_classes.push(source.typed()?),
            "PersistentVolumeClaim" => {
                let claim: PersistentVolumeClaim = source.typed()?;
                self.volume_claims
                    .push(convert::storage::claim(&claim).map_err(|e| e.message)?);
            }
            "PersistentVolume" => {
                let volume: PersistentVolume = source.typed()?;
                self.volumes
                    .push(convert::storage::volume(&volume).map_err(|e| e.message)?);
            }
            "StorageClass" => {
                let class: StorageClass = source.typed()?;
                self.storage_classes.push((
                    convert::storage::storage_class(&class),
                    convert::storage::is_default_class(&class),
                ));
            }
            "CSINode" => {
                let node: CSINode = source.typed()?;
                let name = node.metadata.name.clone().unwrap_or_default();
                self.csi_nodes.push((name, convert::storage::csi_node(&node)));
            }
            "Namespace" => {
                let namespace: Namespace = source.typed()?;
                self.namespaces.push((
                    namespace.metadata.name.unwrap_or_default(),
                    namespace.metadata.labels.unwrap_or_default(),
                ));
            }
            "Workload" => {
                let workload: Workload = source.typed()?;
                muster_api::validation::validate(&workload).map_err(|problems| problems.join("; "))?;
                self.workloads.push(workload);
            }
            other => *self.ignored.entry(other.to_string()).or_default() += 1,
        }
        Ok(())
    }

    pub fn add_node(&mut self, node: &Node) -> Result<(), ConvertError> {
        self.nodes.push(convert::node(node)?);
        Ok(())
    }

    pub fn add_slice(&mut self, slice: &ResourceSlice) -> Result<(), ConvertError> {
        self.slices.push(convert::slice(slice)?);
        Ok(())
    }

    /// Counts what a pod uses on its node, and keeps a pod labelled as a Workload's.
    pub fn add_pod(&mut self, pod: Pod) -> Result<(), ConvertError> {
        if let Some(entry) = convert::pod_entry(&pod)? {
            let key = convert::pod_key(&pod);
            self.pods_on_nodes.push(PodOnNode { key, entry });
        }
        let labels = pod.metadata.labels.as_ref();
        if labels.is_some_and(|l| l.contains_key(muster_api::labels::WORKLOAD)) {
            self.pods.push(pod);
        }
        Ok(())
    }

    /// Adds the objects of another file.
    pub fn extend(&mut self, other: Objects) {
        self.nodes.extend(other.nodes);
        self.slices.extend(other.slices);
        self.pods_on_nodes.extend(other.pods_on_nodes);
        self.pods.extend(other.pods);
        self.classes.extend(other.classes);
        self.taint_rules.extend(other.taint_rules);
        self.claims.extend(other.claims);
        self.templates.extend(other.templates);
        self.workloads.extend(other.workloads);
        self.priority_classes.extend(other.priority_classes);
        self.limit_ranges.extend(other.limit_ranges);
        self.runtime_classes.extend(other.runtime_classes);
        self.volume_claims.extend(other.volume_claims);
        self.volumes.extend(other.volumes);
        self.storage_classes.extend(other.storage_classes);
        self.csi_nodes.extend(other.csi_nodes);
        self.namespaces.extend(other.namespaces);
        self.kueue_workloads.extend(other.kueue_workloads);
        self.kueue_flavors.extend(other.kueue_flavors);
        for (kind, n) in other.ignored {
            *self.ignored.entry(kind).or_default() += n;
        }
    }

    /// The StorageClass a claim without a class gets: the last one read marked default
    /// (the API server takes the newest; a file has no creation times).
    pub fn default_storage_class(&self) -> Option<&str> {
        self.storage_classes
            .iter()
            .rev()
            .find(|(_, default)| *default)
            .map(|(class, _)| class.name.as_str())
    }

    /// The engine's picture of a cluster holding these objects. Its nodes, slices and
    /// pods on nodes move into it.
    pub fn take_cluster_state(&mut self) -> Result<ClusterState, ConvertError> {
        let mut cluster = ClusterState::new();
        for node in std::mem::take(&mut self.nodes) {
            cluster.upsert_node(node);
        }
        for class in &self.classes {
            cluster.upsert_class(convert::device_class(class));
        }
        for slice in std::mem::take(&mut self.slices) {
            cluster.upsert_slice(slice);
        }
        for rule in &self.taint_rules {
            cluster.upsert_taint_rule(
                rule.metadata.name.as_deref().unwrap_or_default(),
                convert::taint_rule(rule),
            );
        }
        for pod in std::mem::take(&mut self.pods_on_nodes) {
            cluster.place_pod(&pod.key, pod.entry);
        }
        for claim in &self.volume_claims {
            cluster.storage_mut().upsert_claim(claim.clone());
        }
        for volume in &self.volumes {
            cluster.storage_mut().upsert_volume(volume.clone());
        }
        for (class, _) in &self.storage_classes {
            cluster.storage_mut().upsert_class(class.clone());
        }
        for (node, csi) in &self.csi_nodes {
            cluster.storage_mut().upsert_csi_node(node, csi.clone());
        }
        for (name, labels) in &self.namespaces {
            cluster.upsert_namespace(name, labels.clone());
        }
        for claim in &self.claims {
            let key = convert::claim_key(claim);
            if let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) {
                let devices = convert::allocation_devices(&format!("ResourceClaim {key}"), allocation)?;
                cluster.set_claim_allocation(&key, Some(devices));
            }
        }
        Ok(cluster)
    }
}

fn syntax(file: &str, message: String) -> LoadError {
    LoadError::Syntax {
        file: file.to_string(),
        message,
    }
}

/// What is wrong with object `kind name`, the `document`th of `file`.
fn object_error<'a>(file: &'a str, document: usize, kind: &'a str, name: &'a str) -> impl Fn(String) -> LoadError + 'a {
    move |message| LoadError::Object {
        file: file.to_string(),
        document,
        object: format!("{kind} {name}"),
        message,
    }
}

fn starts_as_json(text: &[u8]) -> bool {
    let first = text.iter().find(|b| !b.is_ascii_whitespace());
    matches!(first, Some(b'{') | Some(b'['))
}

/// Where an object's fields come from: its JSON text, or a YAML document's tree.
trait Source {
    /// The object as a `T`, or an error that names the field at fault.
    fn typed<T: DeserializeOwned>(self) -> Result<T, String>;
}

struct JsonText<'a>(&'a str);

impl Source for JsonText<'_> {
    fn typed<T: DeserializeOwned>(self) -> Result<T, String> {
        let mut deserializer = serde_json::Deserializer::from_str(self.0);
        serde_path_to_error::deserialize(&mut deserializer).map_err(path_error)
    }
}

impl Source for serde_json::Value {
    fn typed<T: DeserializeOwned>(self) -> Result<T, String> {
        serde_path_to_error::deserialize(self).map_err(path_error)
    }
}

fn path_error<E: std::fmt::Display>(e: serde_path_to_error::Error<E>) -> String {
    let path = e.path().to_string();
    if path == "." {
        e.inner().to_string()
    } else {
        format!("{path}: {}", e.inner())
    }
}

/// Reads a top-level JSON value into `objects`, one object at a time: each object of
/// an array, or of a List's `items`, is held as its own text only while it is typed.
/// An object that fails stops the read; the failure is kept to be reported as is.
struct JsonDocument<'f> {
    file: &'f str,
    objects: Objects,
    failure: Option<LoadError>,
}

impl JsonDocument<'_> {
    fn add<E: serde::de::Error>(
        &mut self,
        document: usize,
        raw: &RawValue,
        default_kind: Option<&str>,
    ) -> Result<(), E> {
        self.objects
            .add_json(self.file, document, raw, default_kind)
            .map_err(|failure| {
                self.failure = Some(failure);
                E::custom("stopped at an object that cannot be read")
            })
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for &mut JsonDocument<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for &mut JsonDocument<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a Kubernetes object, a List of them, or an array of them")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut document = 0;
        while let Some(raw) = seq.next_element::<Box<RawValue>>()? {
            document += 1;
            self.add(document, &raw, None)?;
        }
        Ok(())
    }

    /// A List's items are read as they come (kubectl prints them before `kind`, the API
    /// server after it); any other object is kept whole and added at its end.
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut fields: Vec<(String, Box<RawValue>)> = Vec::new();
        let mut had_items = false;
        let kind_of = |fields: &[(String, Box<RawValue>)]| {
            fields
                .iter()
                .find(|(key, _)| key == "kind")
                .and_then(|(_, raw)| serde_json::from_str::<String>(raw.get()).ok())
        };
        while let Some(key) = map.next_key::<String>()? {
            if key == "items" {
                had_items = true;
                let kind = kind_of(&fields);
                let default_kind = kind.as_deref().and_then(item_kind).map(str::to_string);
                map.next_value_seed(ListItems {
                    document: &mut *self,
                    default_kind,
                })?;
            } else {
                fields.push((key, map.next_value()?));
            }
        }
        let kind = kind_of(&fields).unwrap_or_default();
        if had_items {
            if is_list(&kind) {
                return Ok(());
            }
            self.failure = Some(LoadError::Object {
                file: self.file.to_string(),
                document: 1,
                object: if kind.is_empty() { "<no kind>".into() } else { kind },
                message: "has items but is not a List".into(),
            });
            return Err(serde::de::Error::custom("not a List"));
        }
        let mut text = String::from("{");
        for (i, (key, raw)) in fields.iter().enumerate() {
            if i > 0 {
                text.push(',');
            }
            text.push_str(&serde_json::to_string(key).map_err(serde::de::Error::custom)?);
            text.push(':');
            text.push_str(raw.get());
        }
        text.push('}');
        let raw = RawValue::from_string(text).map_err(serde::de::Error::custom)?;
        self.add(1, &raw, None)
    }
}

/// A List's `items`, each added as it is read.
struct ListItems<'r, 'f> {
    document: &'r mut JsonDocument<'f>,
    /// The items' kind when they do not say.
    default_kind: Option<String>,
}

impl<'de> serde::de::DeserializeSeed<'de> for ListItems<'_, '_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for ListItems<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a List's items")
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(raw) = seq.next_element::<Box<RawValue>>()? {
            self.document.add(1, &raw, self.default_kind.as_deref())?;
        }
        Ok(())
    }
}

/// Lists: kubectl's `List`, and the API server's `<Kind>List`.
fn is_list(kind: &str) -> bool {
    kind.ends_with("List")
}

/// The kind of a list's items when they do not say (the API server's `<Kind>List`
/// leaves it out of each item).
fn item_kind(list_kind: &str) -> Option<&str> {
    list_kind.strip_suffix("List").filter(|kind| !kind.is_empty())
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
        let cluster = objects.clone().take_cluster_state().unwrap();
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
        assert_eq!(objects.nodes[0].name, "n1");
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

    #[test]
    fn reads_a_stream_as_kubectl_prints_it_object_by_object() {
        // kubectl prints a List's items before its kind.
        let list = r#"
            {"apiVersion": "v1", "items": [
                {"kind": "Node", "metadata": {"name": "n1", "labels": {"rack": "r1"}}, "status": {"allocatable": {"cpu": "8"}}},
                {"kind": "ResourceSlice", "metadata": {"name": "n1-gpus"}, "spec": {"driver": "gpu.example.com",
                    "nodeName": "n1", "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
                    "devices": [{"name": "gpu-0", "attributes": {"model": {"string": "H100"}, "index": {"int": 0}}}]}},
                {"kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}, "spec": {"nodeName": "n1",
                    "containers": [{"name": "c", "resources": {"requests": {"cpu": "2"}}}]}}
            ], "kind": "List", "metadata": {"resourceVersion": ""}}"#;
        let mut objects = Objects::read("snap.json", list.as_bytes()).unwrap();
        assert_eq!((objects.nodes.len(), objects.slices.len()), (1, 1));
        let device = &objects.slices[0].devices[0];
        assert_eq!(
            device.attributes.keys().map(String::as_str).collect::<Vec<_>>(),
            ["index", "model"]
        );
        assert!(objects.pods.is_empty(), "only a Workload's pods are kept whole");
        let cluster = objects.take_cluster_state().unwrap();
        assert_eq!(cluster.node_usage("n1").unwrap().cpu_millis, 2000);
        assert!(
            objects.nodes.is_empty() && objects.slices.is_empty(),
            "moved, not copied"
        );

        let one = Objects::read(
            "c.json",
            &br#"  {"kind": "DeviceClass", "metadata": {"name": "gpu"}}"#[..],
        )
        .unwrap();
        assert_eq!(one.classes.len(), 1);
        let yaml = Objects::read("c.yaml", &b"kind: DeviceClass\nmetadata: {name: gpu}\n"[..]).unwrap();
        assert_eq!(yaml.classes.len(), 1);

        let e = Objects::read("x.json", &br#"{"kind": "ConfigMap", "items": []}"#[..]).unwrap_err();
        assert!(e.to_string().contains("has items but is not a List"), "{e}");
        // The API server's own list names the kind once, before the items.
        let raw =
            r#"{"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": [{"metadata": {"name": "n9"}}]}"#;
        assert_eq!(Objects::read("raw.json", raw.as_bytes()).unwrap().nodes[0].name, "n9");
        let events = r#"{"items": [{"kind": "Event", "metadata": {"name": "e"}}], "kind": "EventList"}"#;
        assert_eq!(Objects::read("e.json", events.as_bytes()).unwrap().ignored["Event"], 1);
        let yaml = "kind: NodeList\nitems:\n- metadata: {name: n8}\n";
        assert_eq!(Objects::read("raw.yaml", yaml.as_bytes()).unwrap().nodes[0].name, "n8");
        let bad = r#"{"items": [{"kind": "Node", "metadata": {"name": "n1"}, "spec": {"unschedulable": "maybe"}}], "kind": "List"}"#;
        let e = Objects::read("snap.json", bad.as_bytes()).unwrap_err().to_string();
        assert!(
            e.starts_with("snap.json: document 1 (Node n1): spec.unschedulable: invalid type"),
            "{e}"
        );
        let e = Objects::read("t.json", &b"[{\"kind\": \"Node\"} x"[..]).unwrap_err();
        assert!(e.to_string().starts_with("t.json: JSON:"), "{e}");
    }
}
