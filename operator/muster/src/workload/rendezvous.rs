//! What a pod of a gang needs to find its peers: stable hostnames under the headless
//! Service (`<workload>-<group>-<index>.<workload>`) and environment variables with its
//! rank, the world size and the coordinator's address.
//!
//! - `MUSTER_WORKLOAD`, `MUSTER_NAMESPACE`, `MUSTER_POD_GROUP`: names.
//! - `MUSTER_POD_INDEX` (within the group), `MUSTER_GROUP_INDEX` (the group's position in
//!   `spec.podGroups`), `MUSTER_GROUP_SIZE` (the group's replicas).
//! - `MUSTER_RANK`: position among all pods (groups in order, pods by index), from 0;
//!   `MUSTER_WORLD_SIZE`: all pods of all groups.
//! - `MUSTER_COORDINATOR_ADDRESS` / `MASTER_ADDR`: hostname of pod 0 of the first group;
//!   `MUSTER_COORDINATOR_PORT` / `MASTER_PORT`: 29500, or the Workload's
//!   `muster.dev/coordinator-port` annotation.
//! - `MUSTER_ATTEMPT`: how many times the gang was restarted before this attempt.
//!
//! A variable the template sets itself is left alone.

use k8s_openapi::api::core::v1::{EnvVar, PodSpec};
use muster_api::v1alpha1::Workload;

use crate::workload::membership;
use crate::workload::names::pod_name;

/// Annotation on a Workload overriding the coordinator port.
pub const COORDINATOR_PORT_ANNOTATION: &str = "muster.dev/coordinator-port";
/// The default coordinator port (PyTorch's).
pub const DEFAULT_COORDINATOR_PORT: u16 = 29500;

/// The variables for pod `index` of group number `group_index`.
pub fn environment(workload: &Workload, group_index: usize, index: i32) -> Vec<EnvVar> {
    let name = workload.metadata.name.clone().unwrap_or_default();
    let groups = &workload.spec.pod_groups;
    let Some(group) = groups.get(group_index) else {
        return Vec::new();
    };
    let rank: i64 = groups[..group_index].iter().map(|g| i64::from(g.replicas)).sum::<i64>() + i64::from(index);
    let world: i64 = groups.iter().map(|g| i64::from(g.replicas)).sum();
    let coordinator = groups
        .first()
        .map(|g| format!("{}.{name}", pod_name(&name, &g.name, 0)))
        .unwrap_or_default();
    let port = workload
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(COORDINATOR_PORT_ANNOTATION))
        .and_then(|p| p.parse::<u16>().ok())
        .unwrap_or(DEFAULT_COORDINATOR_PORT)
        .to_string();
    let attempt = membership::attempt(workload).to_string();
    let var = |key: &str, value: String| EnvVar {
        name: key.to_string(),
        value: Some(value),
        value_from: None,
    };
    let mut vars = vec![
        var("MUSTER_WORKLOAD", name.clone()),
        var(
            "MUSTER_NAMESPACE",
            workload.metadata.namespace.clone().unwrap_or_default(),
        ),
        var("MUSTER_POD_GROUP", group.name.clone()),
        var("MUSTER_POD_INDEX", index.to_string()),
        var("MUSTER_GROUP_INDEX", group_index.to_string()),
        var("MUSTER_GROUP_SIZE", group.replicas.to_string()),
        var("MUSTER_RANK", rank.to_string()),
        var("MUSTER_WORLD_SIZE", world.to_string()),
        var("MUSTER_COORDINATOR_PORT", port.clone()),
        var("MASTER_PORT", port),
        var("MUSTER_ATTEMPT", attempt),
    ];
    // Without the headless Service no hostname resolves: no address to give.
    if workload.spec.dns_hostnames() {
        vars.push(var("MUSTER_COORDINATOR_ADDRESS", coordinator.clone()));
        vars.push(var("MASTER_ADDR", coordinator));
    }
    vars
}

/// Adds `env` to every container and init container, keeping variables they set.
pub fn inject(spec: &mut PodSpec, env: &[EnvVar]) {
    let containers = spec
        .containers
        .iter_mut()
        .chain(spec.init_containers.iter_mut().flatten());
    for container in containers {
        let existing = container.env.get_or_insert_with(Vec::new);
        for var in env {
            if !existing.iter().any(|e| e.name == var.name) {
                existing.push(var.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload() -> Workload {
        let mut w: Workload = serde_saphyr::from_str(
            "apiVersion: muster.dev/v1alpha1\nkind: Workload\nmetadata: {name: llama, namespace: team, annotations: {muster.dev/coordinator-port: '1234'}}\nspec:\n  podGroups:\n  - {name: launcher, replicas: 1}\n  - {name: workers, replicas: 4}\n",
        )
        .unwrap();
        w.status = Some(muster_api::WorkloadStatus {
            restarts: 2,
            ..Default::default()
        });
        w
    }

    fn get<'a>(env: &'a [EnvVar], key: &str) -> &'a str {
        env.iter()
            .find(|e| e.name == key)
            .and_then(|e| e.value.as_deref())
            .unwrap_or_else(|| panic!("{key}"))
    }

    #[test]
    fn ranks_follow_group_order_and_the_coordinator_is_the_first_pod() {
        let env = environment(&workload(), 1, 2);
        assert_eq!(get(&env, "MUSTER_RANK"), "3");
        assert_eq!(get(&env, "MUSTER_WORLD_SIZE"), "5");
        assert_eq!(get(&env, "MUSTER_POD_INDEX"), "2");
        assert_eq!(get(&env, "MUSTER_GROUP_INDEX"), "1");
        assert_eq!(get(&env, "MUSTER_GROUP_SIZE"), "4");
        assert_eq!(get(&env, "MASTER_ADDR"), "llama-launcher-0.llama");
        assert_eq!(get(&env, "MASTER_PORT"), "1234");
        assert_eq!(get(&env, "MUSTER_ATTEMPT"), "2");
        assert_eq!(get(&env, "MUSTER_NAMESPACE"), "team");
    }

    #[test]
    fn variables_the_template_sets_win() {
        let mut spec: PodSpec = serde_json::from_value(serde_json::json!({
            "containers": [{"name": "a", "env": [{"name": "MASTER_PORT", "value": "9"}]}],
            "initContainers": [{"name": "init"}],
        }))
        .unwrap();
        inject(&mut spec, &environment(&workload(), 0, 0));
        assert_eq!(get(spec.containers[0].env.as_ref().unwrap(), "MASTER_PORT"), "9");
        assert_eq!(
            get(
                spec.init_containers.as_ref().unwrap()[0].env.as_ref().unwrap(),
                "MUSTER_RANK"
            ),
            "0"
        );
    }
}
