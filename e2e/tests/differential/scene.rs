//! The non-DRA half of a differential case: what kube-scheduler's InterPodAffinity,
//! PodTopologySpread, NodePorts, VolumeBinding, VolumeZone, VolumeRestrictions and
//! NodeVolumeLimits filters read. A scene is the pods already on nodes (residents, bound
//! by name, with labels, anti-affinity, host ports and volumes), the case's
//! PersistentVolumes and PersistentVolumeClaims, and what the pod under test asks:
//! labels, (anti-)affinity, spread constraints, node selection, host ports and volumes.
//!
//! Scenes draw from their own generator, so the DRA half of every case stays as it was
//! for the same seed.

use std::collections::BTreeSet;

use muster_e2e::rng::Rng;
use serde_json::{Map, Value, json};

/// The label of every object of a case.
use super::CASE_LABEL;

/// StorageClasses every case may use, created once: no provisioner, binding at the
/// first consumer or at once.
pub const LATE_CLASS: &str = "differential-late";
pub const NOW_CLASS: &str = "differential-now";
/// The CSI driver of the CSINodes' attach limits and of some volumes.
pub const CSI_DRIVER: &str = "csi.example.com";
/// The label muster's test namespaces get, and its value in the main and the other one.
pub const TEAM_LABEL: &str = "e2e.muster.dev/team";
/// The label of a volume made for one claim that binds at once, naming the claim.
const FOR_LABEL: &str = "e2e.muster.dev/for";

pub const HOSTNAME: &str = "kubernetes.io/hostname";
pub const ZONE: &str = "topology.kubernetes.io/zone";
const TOPOLOGY_KEYS: &[&str] = &[
    HOSTNAME,
    ZONE,
    "example.com/rack",
    "example.com/block",
    "example.com/missing",
];
const APPS: &[&str] = &["web", "db", "cache"];
const TIERS: &[&str] = &["a", "b"];

/// Ports residents and the pod under test draw from: a clash needs the same protocol and
/// port on the same or the wildcard address.
const PORTS: &[(i32, &str, &str)] = &[
    (8080, "TCP", ""),
    (8080, "UDP", ""),
    (9000, "TCP", "127.0.0.1"),
    (9000, "TCP", "10.0.0.1"),
    (9100, "TCP", ""),
];

/// The CSINodes' attach limits of the driver, per node: none (the driver listed without
/// a count) on the last node.
pub fn attach_limit(node: usize) -> Option<i32> {
    [Some(1), Some(2), Some(3), None][node % 4]
}

/// One scene.
#[derive(Default)]
pub struct Scene {
    /// Features the pod under test uses, for the run's counts.
    pub features: BTreeSet<&'static str>,
    /// PersistentVolumes, created first.
    pub volumes: Vec<Value>,
    /// PersistentVolumeClaims; `bound` names those to wait for until the volume
    /// controller has bound them.
    pub claims: Vec<Value>,
    pub bound: Vec<String>,
    /// Pods bound to nodes by name before the pod under test, in the main namespace or
    /// the other one (`true`).
    pub residents: Vec<(Value, bool)>,
    /// What the pod under test gets: metadata labels, and fields of its spec.
    pub labels: Map<String, Value>,
    pub spec: Map<String, Value>,
    /// Ports of its container.
    pub ports: Vec<Value>,
    /// Whether the pod under test keeps a DRA claim.
    pub with_claim: bool,
}

fn labels(prefix: &str) -> Value {
    json!({ CASE_LABEL: prefix })
}

/// Labels of a resident or of the pod under test.
fn pod_labels(rng: &mut Rng) -> Map<String, Value> {
    let mut labels = Map::new();
    if rng.chance(80) {
        labels.insert("app".into(), json!(rng.pick(APPS)));
    }
    if rng.chance(50) {
        labels.insert("tier".into(), json!(rng.pick(TIERS)));
    }
    labels
}

/// A label selector over `app` and `tier`: unset, empty, by labels or by expressions.
fn selector(rng: &mut Rng) -> Option<Value> {
    match rng.weighted(&[6, 6, 50, 38]) {
        0 => None,
        1 => Some(json!({})),
        2 => Some(json!({"matchLabels": {"app": rng.pick(APPS)}})),
        _ => {
            let key = *rng.pick(&["app", "tier"]);
            let values = if key == "app" { APPS } else { TIERS };
            let expression = match rng.below(4) {
                0 => json!({"key": key, "operator": "In", "values": [rng.pick(values), rng.pick(values)]}),
                1 => json!({"key": key, "operator": "NotIn", "values": [rng.pick(values)]}),
                2 => json!({"key": key, "operator": "Exists"}),
                _ => json!({"key": key, "operator": "DoesNotExist"}),
            };
            Some(json!({"matchExpressions": [expression]}))
        }
    }
}

/// A `PodAffinityTerm`, whose namespaces may name the other namespace or select by label.
fn term(rng: &mut Rng, main: &str, other: &str) -> Value {
    let mut term = json!({"topologyKey": rng.pick(TOPOLOGY_KEYS)});
    if let Some(selector) = selector(rng) {
        // A key of matchLabelKeys must not be in the selector.
        if rng.chance(15) && !selector.to_string().contains("tier") {
            let key = if rng.chance(70) {
                "matchLabelKeys"
            } else {
                "mismatchLabelKeys"
            };
            term[key] = json!(["tier"]);
        }
        term["labelSelector"] = selector;
    }
    match rng.weighted(&[60, 10, 8, 8, 7, 7]) {
        1 => term["namespaces"] = json!([other]),
        2 => term["namespaces"] = json!([main, other]),
        3 => term["namespaceSelector"] = json!({}),
        4 => term["namespaceSelector"] = json!({"matchLabels": {TEAM_LABEL: "other"}}),
        5 => term["namespaceSelector"] = json!({"matchLabels": {TEAM_LABEL: "main"}}),
        _ => {}
    }
    term
}

fn port(rng: &mut Rng) -> Value {
    let (port, protocol, ip) = *rng.pick(PORTS);
    let mut value = json!({"containerPort": port, "hostPort": port, "protocol": protocol});
    if !ip.is_empty() {
        value["hostIP"] = json!(ip);
    }
    value
}

/// A PersistentVolume of `size` Gi, reachable from one node, one zone, or everywhere.
#[allow(clippy::too_many_arguments)]
fn volume(
    rng: &mut Rng,
    prefix: &str,
    name: &str,
    class: &str,
    size: u32,
    nodes: &[String],
    modes: &[&str],
    claim: Option<(&str, &str)>,
    csi: bool,
) -> Value {
    let mut spec = json!({
        "capacity": {"storage": format!("{size}Gi")},
        "accessModes": modes,
        "persistentVolumeReclaimPolicy": "Retain",
    });
    if !class.is_empty() {
        spec["storageClassName"] = json!(class);
    }
    if csi {
        spec["csi"] = json!({"driver": CSI_DRIVER, "volumeHandle": format!("{prefix}-{name}")});
    } else {
        spec["hostPath"] = json!({"path": format!("/tmp/{prefix}-{name}")});
    }
    let mut metadata = json!({"name": format!("{prefix}-{name}"), "labels": labels(prefix)});
    let reach = rng.weighted(&[40, 40, 20]);
    let zone = format!("zone-{}", rng.below(2));
    match reach {
        0 => {
            spec["nodeAffinity"] = json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": HOSTNAME, "operator": "In", "values": [rng.pick(nodes)]},
            ]}]}});
        }
        1 => {
            spec["nodeAffinity"] = json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": ZONE, "operator": "In", "values": [zone]},
            ]}]}});
        }
        _ => {}
    }
    // Zone labels VolumeZone reads, sometimes at odds with the affinity.
    if rng.chance(30) {
        let zones = if rng.chance(20) {
            "zone-0__zone-1".to_string()
        } else {
            format!("zone-{}", rng.below(2))
        };
        metadata["labels"][ZONE] = json!(zones);
    }
    if rng.chance(15) {
        metadata["labels"]["disk"] = json!(rng.pick(&["ssd", "hdd"]));
    }
    if let Some((namespace, claim)) = claim {
        spec["claimRef"] = json!({"namespace": namespace, "name": claim});
    }
    json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": metadata, "spec": spec})
}

fn claim(prefix: &str, name: &str, class: &str, size: u32, modes: &[&str], volume: Option<&str>) -> Value {
    let mut spec = json!({
        "accessModes": modes,
        "resources": {"requests": {"storage": format!("{size}Gi")}},
        "storageClassName": class,
    });
    if let Some(volume) = volume {
        spec["volumeName"] = json!(volume);
    }
    json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": format!("{prefix}-{name}"), "labels": labels(prefix)},
        "spec": spec,
    })
}

/// A resident: a pod bound to `node` by name.
fn resident(prefix: &str, index: usize, node: &str, labels_of: Map<String, Value>, spec: Map<String, Value>) -> Value {
    let mut metadata_labels = labels_of;
    metadata_labels.insert(CASE_LABEL.into(), json!(prefix));
    let mut pod_spec = json!({
        "nodeName": node,
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "main", "image": "busybox"}],
    });
    for (k, v) in spec {
        if k == "ports" {
            pod_spec["containers"][0]["ports"] = v;
        } else {
            pod_spec[k] = v;
        }
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": format!("{prefix}-r{index}"), "labels": metadata_labels},
        "spec": pod_spec,
    })
}

/// A scene for case `number`; `nodes` are the fleet's, `main` and `other` the two
/// namespaces.
pub fn generate(seed: u64, number: usize, nodes: &[String], main: &str, other: &str) -> Scene {
    let mut rng = Rng::for_case(seed ^ 0x7363_656e_6573_0001, number);
    let prefix = format!("c{number:04}");
    let mut scene = Scene {
        with_claim: true,
        ..Scene::default()
    };
    // About one case in six is DRA only, as the cases were before scenes.
    if rng.chance(16) {
        return scene;
    }
    scene.with_claim = rng.chance(55);
    scene.labels = pod_labels(&mut rng);
    let affinity = rng.chance(45);
    let spread = rng.chance(40);
    let ports = rng.chance(30);
    let volumes = rng.chance(45);
    let selection = rng.chance(25);

    // Residents.
    let mut resident_claims: Vec<String> = Vec::new();
    for index in 0..rng.weighted(&[15, 25, 25, 20, 15]) {
        let node = rng.pick(nodes).clone();
        let in_other = rng.chance(25);
        let mut spec = Map::new();
        if rng.chance(25) {
            // Only by labels: a resident must never repel the fence pod.
            spec.insert(
                "affinity".into(),
                json!({"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
                    "topologyKey": rng.pick(TOPOLOGY_KEYS),
                    "labelSelector": {"matchLabels": {"app": rng.pick(APPS)}},
                }]}}),
            );
        }
        if ports && rng.chance(50) {
            spec.insert("ports".into(), json!([port(&mut rng)]));
        }
        if volumes && !in_other && rng.chance(40) {
            // A claim of its own on a CSI volume.
            let name = format!("r{index}-data");
            resident_claims.push(name.clone());
            spec.insert(
                "volumes".into(),
                json!([{"name": "data", "persistentVolumeClaim": {"claimName": format!("{prefix}-{name}")}}]),
            );
        }
        scene
            .residents
            .push((resident(&prefix, index, &node, pod_labels(&mut rng), spec), in_other));
    }
    for name in &resident_claims {
        let pv = format!("{name}-pv");
        scene.volumes.push(volume(
            &mut rng,
            &prefix,
            &pv,
            "",
            1,
            nodes,
            &["ReadWriteOnce"],
            Some((main, &format!("{prefix}-{name}"))),
            true,
        ));
        scene.claims.push(claim(
            &prefix,
            name,
            "",
            1,
            &["ReadWriteOnce"],
            Some(&format!("{prefix}-{pv}")),
        ));
        scene.bound.push(format!("{prefix}-{name}"));
    }

    if affinity {
        let mut pod_affinity = Map::new();
        let mut anti = Map::new();
        let required = |rng: &mut Rng| -> Vec<Value> {
            (0..rng.weighted(&[30, 55, 15]))
                .map(|_| term(rng, main, other))
                .collect()
        };
        let preferred = |rng: &mut Rng| -> Vec<Value> {
            (0..rng.weighted(&[60, 30, 10]))
                .map(|_| json!({"weight": rng.range(1, 100), "podAffinityTerm": term(rng, main, other)}))
                .collect()
        };
        let terms = required(&mut rng);
        if !terms.is_empty() {
            scene.features.insert("pod affinity");
            pod_affinity.insert("requiredDuringSchedulingIgnoredDuringExecution".into(), json!(terms));
        }
        let terms = required(&mut rng);
        if !terms.is_empty() {
            scene.features.insert("pod anti-affinity");
            anti.insert("requiredDuringSchedulingIgnoredDuringExecution".into(), json!(terms));
        }
        let terms = preferred(&mut rng);
        if !terms.is_empty() {
            pod_affinity.insert("preferredDuringSchedulingIgnoredDuringExecution".into(), json!(terms));
        }
        let terms = preferred(&mut rng);
        if !terms.is_empty() {
            anti.insert("preferredDuringSchedulingIgnoredDuringExecution".into(), json!(terms));
        }
        let mut value = json!({});
        if !pod_affinity.is_empty() {
            value["podAffinity"] = Value::Object(pod_affinity);
        }
        if !anti.is_empty() {
            value["podAntiAffinity"] = Value::Object(anti);
        }
        scene.spec.insert("affinity".into(), value);
    }
    if scene.residents.iter().any(|(r, _)| r["spec"].get("affinity").is_some()) {
        scene.features.insert("anti-affinity of residents");
    }

    if selection {
        // Node selection decides which nodes spread counts (nodeAffinityPolicy).
        if rng.chance(50) {
            scene
                .spec
                .insert("nodeSelector".into(), json!({ZONE: format!("zone-{}", rng.below(2))}));
        } else {
            let mut affinity = scene.spec.remove("affinity").unwrap_or_else(|| json!({}));
            affinity["nodeAffinity"] = json!({"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "example.com/rack", "operator": "NotIn", "values": [format!("rack-{:04}", rng.below(4))]}]},
            ]}});
            scene.spec.insert("affinity".into(), affinity);
        }
    }

    if spread {
        let constraints: Vec<Value> = (0..rng.range(1, 2))
            .map(|_| {
                let hard = rng.chance(75);
                let mut constraint = json!({
                    "maxSkew": rng.weighted(&[0, 60, 25, 15]),
                    "topologyKey": rng.pick(TOPOLOGY_KEYS),
                    "whenUnsatisfiable": if hard { "DoNotSchedule" } else { "ScheduleAnyway" },
                });
                if let Some(selector) = selector(&mut rng) {
                    if rng.chance(15) && !selector.to_string().contains("tier") {
                        constraint["matchLabelKeys"] = json!(["tier"]);
                    }
                    constraint["labelSelector"] = selector;
                }
                if hard && rng.chance(30) {
                    constraint["minDomains"] = json!(rng.range(2, 5));
                }
                if rng.chance(25) {
                    constraint["nodeAffinityPolicy"] = json!(rng.pick(&["Honor", "Ignore"]));
                }
                if rng.chance(15) {
                    constraint["nodeTaintsPolicy"] = json!(rng.pick(&["Honor", "Ignore"]));
                }
                constraint
            })
            .collect();
        // A key and action go together once.
        let mut seen = BTreeSet::new();
        let constraints: Vec<Value> = constraints
            .into_iter()
            .filter(|c| seen.insert((c["topologyKey"].to_string(), c["whenUnsatisfiable"].to_string())))
            .collect();
        if constraints.iter().any(|c| c["whenUnsatisfiable"] == "DoNotSchedule") {
            scene.features.insert("topology spread");
        }
        if constraints.iter().any(|c| c.get("minDomains").is_some()) {
            scene.features.insert("minDomains");
        }
        scene
            .spec
            .insert("topologySpreadConstraints".into(), json!(constraints));
    }

    if ports {
        scene.features.insert("host ports");
        if rng.chance(25) {
            // Every container port a host port.
            scene.spec.insert("hostNetwork".into(), json!(true));
            scene.features.insert("hostNetwork");
            scene.ports = vec![json!({"containerPort": rng.pick(&[8080, 9000, 9100])})];
        } else {
            scene.ports = (0..rng.range(1, 2)).map(|_| port(&mut rng)).collect();
            // A host port once: the API server refuses duplicates.
            scene.ports.dedup();
        }
    }

    if volumes {
        let mut pod_volumes: Vec<Value> = Vec::new();
        for slot in 0..rng.weighted(&[0, 75, 25]) {
            let name = format!("v{slot}");
            let modes: &[&str] = match rng.weighted(&[62, 20, 10, 8]) {
                0 => &["ReadWriteOnce"],
                1 => &["ReadWriteOncePod"],
                2 => &["ReadWriteMany"],
                _ => &["ReadWriteOnce", "ReadOnlyMany"],
            };
            let size = *rng.pick(&[5, 10, 20]);
            match rng.weighted(&[40, 35, 10, 15]) {
                0 => {
                    // Bound to a volume with node affinity or zone labels.
                    scene.features.insert("bound volume");
                    let pv = format!("{name}-pv");
                    let csi = rng.chance(40);
                    scene.volumes.push(volume(
                        &mut rng,
                        &prefix,
                        &pv,
                        LATE_CLASS,
                        size,
                        nodes,
                        modes,
                        Some((main, &format!("{prefix}-{name}"))),
                        csi,
                    ));
                    scene.claims.push(claim(
                        &prefix,
                        &name,
                        LATE_CLASS,
                        size,
                        modes,
                        Some(&format!("{prefix}-{pv}")),
                    ));
                    scene.bound.push(format!("{prefix}-{name}"));
                    if csi {
                        scene.features.insert("attach limits");
                    }
                    if modes == ["ReadWriteOncePod"]
                        && scene.residents.iter().any(|(_, other)| !other)
                        && rng.chance(70)
                    {
                        // A resident uses the same exclusive claim.
                        scene.features.insert("ReadWriteOncePod in use");
                        let (resident, _) = scene
                            .residents
                            .iter_mut()
                            .find(|(_, other)| !other)
                            .expect("a resident");
                        resident["spec"]["volumes"] = json!([{"name": "data", "persistentVolumeClaim": {"claimName": format!("{prefix}-{name}")}}]);
                    }
                }
                1 => {
                    // Binds at the first consumer to one of the static volumes.
                    scene.features.insert("late binding");
                    for v in 0..rng.weighted(&[15, 35, 30, 20]) {
                        let pv_modes: &[&str] = if rng.chance(80) { modes } else { &["ReadWriteOnce"] };
                        let csi = rng.chance(30);
                        let pv_size = *rng.pick(&[5, 10, 20, 40]);
                        let mut pv = volume(
                            &mut rng,
                            &prefix,
                            &format!("{name}-pv{v}"),
                            LATE_CLASS,
                            pv_size,
                            nodes,
                            pv_modes,
                            None,
                            csi,
                        );
                        if rng.chance(20) {
                            pv["metadata"]["labels"]["disk"] = json!("ssd");
                        }
                        scene.volumes.push(pv);
                    }
                    let mut late = claim(&prefix, &name, LATE_CLASS, size, modes, None);
                    if rng.chance(20) {
                        late["spec"]["selector"] = json!({"matchLabels": {"disk": "ssd"}});
                    }
                    scene.claims.push(late);
                }
                2 => {
                    // Binds at once, but has no volume: the pod waits.
                    scene.features.insert("unbound immediate claim");
                    let mut waiting = claim(&prefix, &name, NOW_CLASS, size, modes, None);
                    // No volume carries its label, so it takes none meant for another.
                    waiting["spec"]["selector"] = json!({"matchLabels": {FOR_LABEL: format!("{prefix}-{name}")}});
                    scene.claims.push(waiting);
                }
                _ => {
                    // Binds at once to a volume made for it.
                    scene.features.insert("bound volume");
                    let pv = format!("{name}-pv");
                    let mut made = volume(&mut rng, &prefix, &pv, NOW_CLASS, size, nodes, modes, None, false);
                    made["metadata"]["labels"][FOR_LABEL] = json!(format!("{prefix}-{name}"));
                    scene.volumes.push(made);
                    let mut bound = claim(&prefix, &name, NOW_CLASS, size, modes, None);
                    bound["spec"]["selector"] = json!({"matchLabels": {FOR_LABEL: format!("{prefix}-{name}")}});
                    // Only its own volume: wait for the volume controller to bind it.
                    scene.claims.push(bound);
                    scene.bound.push(format!("{prefix}-{name}"));
                }
            }
            pod_volumes.push(json!({"name": name, "persistentVolumeClaim": {"claimName": format!("{prefix}-{name}")}}));
        }
        if !pod_volumes.is_empty() {
            scene.spec.insert("volumes".into(), json!(pod_volumes));
        }
    }
    scene
}
