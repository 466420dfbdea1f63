//! Resource pools as the allocator sees them from one node (upstream `GatherPools`):
//! slices grouped by (driver, pool), only the newest generation, completeness by
//! `resourceSliceCount`, pools sorted by driver and name with pools whose devices have
//! binding conditions last, slices sorted by name.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::cluster::{ClusterState, CounterSet, DeviceNodes, Node, Slice, SliceNodes};

/// A pool usable from one node.
#[derive(Debug, Clone)]
pub struct Pool {
    pub driver: String,
    pub name: String,
    /// Fewer slices than announced: skipped for ExactCount, an error for All.
    pub incomplete: bool,
    /// Duplicate device names or broken counter references.
    pub invalid: Option<String>,
    /// Slices with devices available on the node, sorted by name.
    pub slices: Vec<Arc<Slice>>,
    /// The pool's other device slices (for counter accounting).
    pub other_slices: Vec<Arc<Slice>>,
    pub counter_sets: BTreeMap<String, CounterSet>,
}

/// Whether a node matches a name / all-nodes / selector specification.
pub fn node_matches(
    node: &Node,
    name: Option<&str>,
    all: bool,
    selector: Option<&crate::selector::NodeSelector>,
) -> bool {
    match (name, all, selector) {
        (Some(name), _, _) if !name.is_empty() => node.name == name,
        (_, true, _) => true,
        (_, _, Some(selector)) => selector.matches(&node.name, &node.labels),
        _ => false,
    }
}

fn device_matches_node(node: &Node, nodes: Option<&DeviceNodes>) -> bool {
    match nodes {
        Some(DeviceNodes::Node(name)) => node.name == *name,
        Some(DeviceNodes::All) => true,
        Some(DeviceNodes::Selector(selector)) => selector.matches(&node.name, &node.labels),
        None => false,
    }
}

/// Whether any device of the slice is available on `node`.
pub fn slice_targets_node(slice: &Slice, node: &Node) -> bool {
    match &slice.nodes {
        SliceNodes::Node(name) => *name == node.name,
        SliceNodes::All => true,
        SliceNodes::Selector(selector) => selector.matches(&node.name, &node.labels),
        SliceNodes::PerDevice => slice
            .devices
            .iter()
            .any(|d| device_matches_node(node, d.nodes.as_ref())),
    }
}

/// Whether one device of a per-device slice is available on `node`.
pub fn device_targets_node(slice: &Slice, device: usize, node: &Node) -> bool {
    match slice.nodes {
        SliceNodes::PerDevice => device_matches_node(node, slice.devices.get(device).and_then(|d| d.nodes.as_ref())),
        _ => true,
    }
}

/// The pools a node can use.
pub fn gather(cluster: &ClusterState, node: &Node) -> Vec<Pool> {
    let mut by_pool: BTreeMap<(String, String), Vec<Arc<Slice>>> = BTreeMap::new();
    for slice in cluster.slices_for_node(&node.name) {
        if !slice_targets_node(slice, node) {
            continue;
        }
        let slices = by_pool.entry((slice.driver.clone(), slice.pool.clone())).or_default();
        match slices.first().map(|s| s.generation) {
            Some(generation) if slice.generation < generation => {}
            Some(generation) if slice.generation > generation => *slices = vec![slice.clone()],
            _ => slices.push(slice.clone()),
        }
    }

    let mut ready = Vec::new();
    let mut with_binding_conditions = Vec::new();
    for ((driver, pool_name), slices) in by_pool {
        let generation = slices[0].generation;
        let announced = slices[0].resource_slice_count;
        let mut all_slices = None;
        if slices.len() as i64 != announced {
            // Some slices of the pool may not target this node: count the whole pool.
            let mut at_generation = Vec::new();
            let mut obsolete = false;
            for slice in cluster.pool_slices(&driver, &pool_name) {
                if slice.generation > generation {
                    obsolete = true;
                    break;
                }
                if slice.generation == generation {
                    at_generation.push(slice.clone());
                }
            }
            if obsolete {
                continue;
            }
            if at_generation.len() as i64 != announced {
                ready.push(Pool {
                    driver,
                    name: pool_name,
                    incomplete: true,
                    invalid: None,
                    slices: vec![],
                    other_slices: vec![],
                    counter_sets: BTreeMap::new(),
                });
                continue;
            }
            all_slices = Some(at_generation);
        }
        let pool = build(driver, pool_name, slices, all_slices);
        let binding = pool
            .slices
            .iter()
            .any(|s| s.devices.iter().any(|d| !d.binding_conditions.is_empty()));
        if binding {
            with_binding_conditions.push(pool);
        } else {
            ready.push(pool);
        }
    }
    ready.extend(with_binding_conditions);
    ready
}

fn build(driver: String, name: String, mut slices: Vec<Arc<Slice>>, all_slices: Option<Vec<Arc<Slice>>>) -> Pool {
    slices.sort_by(|a, b| a.name.cmp(&b.name));
    let targeting: BTreeSet<String> = slices.iter().map(|s| s.name.clone()).collect();
    let mut device_slices = Vec::new();
    let mut counter_slices = Vec::new();
    for slice in slices {
        if slice.shared_counters.is_empty() {
            device_slices.push(slice);
        } else {
            counter_slices.push(slice);
        }
    }
    let mut other_slices = Vec::new();
    for slice in all_slices.into_iter().flatten() {
        if targeting.contains(&slice.name) {
            continue;
        }
        if slice.shared_counters.is_empty() {
            other_slices.push(slice);
        } else {
            counter_slices.push(slice);
        }
    }

    let mut pool = Pool {
        driver,
        name,
        incomplete: false,
        invalid: None,
        slices: device_slices,
        other_slices,
        counter_sets: BTreeMap::new(),
    };
    let mut names = BTreeSet::new();
    for slice in &pool.slices {
        for device in &slice.devices {
            if !names.insert(device.name.clone()) {
                pool.invalid = Some(format!("duplicate device name {}", device.name));
                return pool;
            }
        }
    }
    for slice in &counter_slices {
        for set in &slice.shared_counters {
            if pool.counter_sets.insert(set.name.clone(), set.clone()).is_some() {
                pool.invalid = Some(format!("duplicate counter set name {}", set.name));
                return pool;
            }
        }
    }
    for slice in pool.slices.iter().chain(pool.other_slices.iter()) {
        for device in &slice.devices {
            for consumption in &device.consumes_counters {
                let Some(set) = pool.counter_sets.get(&consumption.counter_set) else {
                    pool.invalid = Some(format!("counter set {} not found", consumption.counter_set));
                    return pool;
                };
                if let Some(missing) = consumption.counters.keys().find(|c| !set.counters.contains_key(*c)) {
                    pool.invalid = Some(format!("counter {missing} not found in counter set {}", set.name));
                    return pool;
                }
            }
        }
    }
    pool
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Device;
    use crate::selector::{Operator, Requirement, Term};

    fn slice(name: &str, pool: &str, generation: i64, count: i64, nodes: SliceNodes, devices: &[&str]) -> Slice {
        Slice {
            name: name.into(),
            driver: "gpu.example.com".into(),
            pool: pool.into(),
            generation,
            resource_slice_count: count,
            nodes,
            devices: devices
                .iter()
                .map(|d| Device {
                    name: d.to_string(),
                    ..Default::default()
                })
                .collect(),
            shared_counters: vec![],
        }
    }

    fn node(name: &str, rack: &str) -> Node {
        Node {
            name: name.into(),
            labels: [("rack".to_string(), rack.to_string())].into(),
            ..Default::default()
        }
    }

    #[test]
    fn newest_generation_wins_and_incomplete_pools_are_marked() {
        let mut c = ClusterState::new();
        let n = node("n1", "r1");
        c.upsert_slice(slice("a-old", "n1", 1, 1, SliceNodes::Node("n1".into()), &["old"]));
        c.upsert_slice(slice("a-new", "n1", 2, 1, SliceNodes::Node("n1".into()), &["new"]));
        c.upsert_slice(slice("b-1", "shared", 1, 2, SliceNodes::All, &["s1"]));
        let pools = gather(&c, &n);
        assert_eq!(pools.len(), 2);
        assert_eq!(pools[0].name, "n1");
        assert_eq!(pools[0].slices[0].devices[0].name, "new");
        assert!(pools[1].incomplete, "one of two slices published");
        c.upsert_slice(slice("b-2", "shared", 1, 2, SliceNodes::All, &["s2"]));
        let pools = gather(&c, &n);
        assert!(!pools[1].incomplete);
        assert_eq!(pools[1].slices.len(), 2);
    }

    #[test]
    fn selector_slices_and_obsolete_pools() {
        let mut c = ClusterState::new();
        let selector = crate::selector::NodeSelector {
            terms: vec![Term {
                match_expressions: vec![Requirement::new("rack", Operator::In, &["r1"])],
                match_fields: vec![],
            }],
        };
        c.upsert_slice(slice("x-1", "fabric", 3, 2, SliceNodes::Selector(selector), &["f1"]));
        c.upsert_slice(slice(
            "x-2",
            "fabric",
            3,
            2,
            SliceNodes::Node("elsewhere".into()),
            &["f2"],
        ));
        let pools = gather(&c, &node("n1", "r1"));
        assert_eq!(pools.len(), 1);
        assert!(!pools[0].incomplete, "complete when counting the whole pool");
        assert_eq!(pools[0].slices.len(), 1);
        assert_eq!(pools[0].other_slices.len(), 1);
        assert!(gather(&c, &node("n2", "r2")).is_empty(), "selector does not match");
        c.upsert_slice(slice(
            "x-3",
            "fabric",
            4,
            1,
            SliceNodes::Node("elsewhere".into()),
            &["f3"],
        ));
        assert!(
            gather(&c, &node("n1", "r1")).is_empty(),
            "a newer generation elsewhere makes it obsolete"
        );
    }

    #[test]
    fn duplicate_devices_make_a_pool_invalid() {
        let mut c = ClusterState::new();
        c.upsert_slice(slice("a", "p", 1, 2, SliceNodes::All, &["d"]));
        c.upsert_slice(slice("b", "p", 1, 2, SliceNodes::All, &["d"]));
        let pools = gather(&c, &node("n", "r"));
        assert_eq!(pools[0].invalid.as_deref(), Some("duplicate device name d"));
    }
}
