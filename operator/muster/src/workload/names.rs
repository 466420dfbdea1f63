//! The names muster gives the objects it makes for a gang.

/// Name of pod `index` of `group`: `<workload>-<group>-<index>`; also its hostname.
pub fn pod_name(workload: &str, group: &str, index: i32) -> String {
    format!("{workload}-{group}-{index}")
}

/// Name of a per-pod claim: `<pod>-<claim>`.
pub fn pod_claim_object_name(pod: &str, claim: &str) -> String {
    format!("{pod}-{claim}")
}

/// Name of a gang-shared claim created from a template: `<workload>-<claim>`.
pub fn shared_claim_object_name(workload: &str, claim: &str) -> String {
    format!("{workload}-{claim}")
}
