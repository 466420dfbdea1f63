//! What the API server's admission adds to the pod under test: a LimitRange of the main
//! namespace (default requests, default limits, a max or a min standing in for them) and
//! a RuntimeClass (overhead, a node selector, tolerations), with residents that use CPU
//! so that the extra requests decide where the pod fits. The engine plans the pod as
//! generated with muster's admission defaults applied, which must be what the API server
//! stores.
//!
//! Drawn from a generator of its own, so that the devices and the scene of every case
//! stay as they were for the same seed.

use std::collections::BTreeSet;

use muster_e2e::rng::Rng;
use serde_json::{Value, json};

use super::{CASE_LABEL, labels};

/// Nodes have 64 CPUs: the requests here leave room on some, none or all of them.
const DEFAULT_CPU: &[&str] = &["8", "40", "70"];
const OVERHEAD_CPU: &[&str] = &["4", "40"];
const RESIDENT_CPU: &[&str] = &["20", "40", "60"];

/// The objects a case's admission reads, created just before the pod under test.
#[derive(Default, Clone)]
pub struct Admission {
    pub limit_range: Option<Value>,
    pub runtime_class: Option<Value>,
}

/// Gives case `number` its admission objects, and `pod` and `residents` what goes with
/// them; `features` counts what the case uses.
pub fn generate(
    seed: u64,
    number: usize,
    prefix: &str,
    pod: &mut Value,
    residents: &mut [(Value, bool)],
    features: &mut BTreeSet<&'static str>,
) -> Admission {
    let mut rng = Rng::for_case(seed ^ 0x6164_6d69_7373_0001, number);
    let mut admission = Admission::default();
    if !rng.chance(45) {
        return admission;
    }
    for (resident, _) in residents.iter_mut() {
        if rng.chance(40) {
            resident["spec"]["containers"][0]["resources"] = json!({"requests": {"cpu": rng.pick(RESIDENT_CPU)}});
            features.insert("residents using CPU");
        }
    }
    if rng.chance(30) {
        // A request of its own: a LimitRange leaves it as it is.
        pod["spec"]["containers"][0]["resources"]["requests"] = json!({"cpu": "2"});
    }
    if rng.chance(60) {
        let cpu = *rng.pick(DEFAULT_CPU);
        let item = match rng.weighted(&[40, 25, 15, 20]) {
            0 => json!({"type": "Container", "defaultRequest": {"cpu": cpu}}),
            // A default limit is the default request where none is given.
            1 => json!({"type": "Container", "default": {"cpu": cpu, "memory": "1Gi"}}),
            // A max is the default limit; it is above every request of the case.
            2 => json!({"type": "Container", "max": {"cpu": "70"}}),
            // A min is the default request where nothing else gives one.
            _ => json!({"type": "Container", "min": {"cpu": "1"}, "defaultRequest": {"memory": "2Gi"}}),
        };
        // (A Pod item's max would refuse a pod without limits: left out.)
        let limits = vec![item];
        admission.limit_range = Some(json!({
            "apiVersion": "v1",
            "kind": "LimitRange",
            "metadata": {"name": format!("{prefix}-limits"), "labels": labels(prefix)},
            "spec": {"limits": limits},
        }));
        features.insert("LimitRange defaults");
    }
    if rng.chance(50) {
        let name = format!("{prefix}-runtime");
        let mut class = json!({
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": {"name": name, "labels": {CASE_LABEL: prefix}},
            "handler": "sandbox",
        });
        if rng.chance(75) {
            class["overhead"] = json!({"podFixed": {"cpu": rng.pick(OVERHEAD_CPU), "memory": "128Mi"}});
            features.insert("RuntimeClass overhead");
        }
        // Nodes of one zone; never against a zone the pod selects itself, which the API
        // server refuses to store.
        let own_zone = pod["spec"]["nodeSelector"].get(super::scene::ZONE).is_some();
        if rng.chance(35) && !own_zone {
            class["scheduling"] = json!({
                "nodeSelector": {super::scene::ZONE: format!("zone-{}", rng.below(2))},
                "tolerations": [{"key": "sandbox", "operator": "Exists"}],
            });
            features.insert("RuntimeClass scheduling");
        }
        pod["spec"]["runtimeClassName"] = json!(name);
        admission.runtime_class = Some(class);
    }
    admission
}
