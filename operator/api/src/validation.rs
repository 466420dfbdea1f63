//! The Workload's validation rules, checked in Rust for objects that do not pass through
//! an API server (files given to `muster plan`). The API server enforces the same rules
//! through the CRD schema; the messages are the same.

use crate::v1alpha1::{
    ExitCodeOperator, FailurePolicy, GroupTopology, MAX_POD_GROUPS, MAX_PODS, MAX_REPLICAS, MAX_SHARED_CLAIMS,
    MAX_WORKLOAD_AND_GROUP_NAME, NODE_NAME_MESSAGE, Topology, Workload,
};

fn is_dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// Every rule the Workload breaks, or `Ok`.
pub fn validate(workload: &Workload) -> Result<(), Vec<String>> {
    let mut problems = Vec::new();
    let name = workload.metadata.name.as_deref().unwrap_or_default();
    let spec = &workload.spec;
    if !is_dns_label(name) || !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        problems.push("metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter): it names the gang's headless Service".to_string());
    }
    if spec.pod_groups.is_empty() {
        problems.push("spec.podGroups: at least one pod group is required".into());
    }
    if spec.pod_groups.len() > MAX_POD_GROUPS {
        problems.push(format!(
            "spec.podGroups: at most {MAX_POD_GROUPS} pod groups are allowed"
        ));
    }
    for (i, group) in spec.pod_groups.iter().enumerate() {
        let at = format!("spec.podGroups[{i}]");
        if !is_dns_label(&group.name) || group.name.len() > 56 {
            problems.push(format!(
                "{at}.name: {:?} must be a DNS label of at most 56 characters",
                group.name
            ));
        }
        if spec.pod_groups.iter().filter(|g| g.name == group.name).count() > 1
            && spec.pod_groups.iter().position(|g| g.name == group.name) == Some(i)
        {
            problems.push("pod group names must be unique within a Workload".into());
        }
        if !(1..=MAX_REPLICAS).contains(&group.replicas) {
            problems.push(format!("{at}.replicas: must be between 1 and {MAX_REPLICAS}"));
        }
        if let Some(min) = group.min_count {
            if min < 1 {
                problems.push(format!("{at}.minCount: must be at least 1"));
            }
            if min > group.replicas {
                problems.push(format!("{at}: minCount must not exceed replicas"));
            }
        }
        if let Some(topology) = &group.topology {
            problems.extend(group_topology_problems(&at, group.replicas, group.min_count, topology));
        }
        if group
            .template
            .as_ref()
            .and_then(|t| t.spec.as_ref())
            .and_then(|s| s.node_name.as_deref())
            .is_some_and(|n| !n.is_empty())
        {
            problems.push(format!("{at}: {NODE_NAME_MESSAGE}"));
        }
        if group.members.is_some() && group.template.is_some() {
            problems.push(format!(
                "{at}: members is for groups without a template: muster makes a template's pods itself"
            ));
        }
        if name.len() + group.name.len() > MAX_WORKLOAD_AND_GROUP_NAME {
            problems.push(format!("metadata.name and each pod group name may have at most {MAX_WORKLOAD_AND_GROUP_NAME} characters together, so that pod names <workload>-<group>-<index> stay valid DNS labels (63 characters)"));
        }
    }
    if spec.pod_groups.iter().map(|g| i64::from(g.replicas)).sum::<i64>() > i64::from(MAX_PODS) {
        problems.push(format!(
            "a Workload may have at most {MAX_PODS} pods in all groups together, so that its placement can be recorded in its status"
        ));
    }
    if let Some(topology) = &spec.topology {
        problems.extend(topology_problems(topology));
    }
    if spec.resource_claims.len() > MAX_SHARED_CLAIMS {
        problems.push(format!(
            "spec.resourceClaims: at most {MAX_SHARED_CLAIMS} shared claims are allowed"
        ));
    }
    for (i, claim) in spec.resource_claims.iter().enumerate() {
        if claim.resource_claim_template_name.is_some() == claim.resource_claim_name.is_some() {
            problems.push(format!(
                "spec.resourceClaims[{i}]: exactly one of resourceClaimTemplateName and resourceClaimName must be set"
            ));
        }
        if spec.resource_claims.iter().filter(|c| c.name == claim.name).count() > 1
            && spec.resource_claims.iter().position(|c| c.name == claim.name) == Some(i)
        {
            problems.push("shared resource claim names must be unique within a Workload".into());
        }
        let collides = |group: &str| {
            claim
                .name
                .strip_prefix(group)
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(|rest| {
                    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
                    digits > 0 && rest[digits..].starts_with('-')
                })
        };
        if claim.resource_claim_template_name.is_some() && spec.pod_groups.iter().any(|g| collides(&g.name)) {
            problems.push("a shared claim made from a template may not be named <group>-<index>-<name>: its object <workload>-<claim> would be the name of a pod's claim <workload>-<group>-<index>-<name>".into());
        }
        if claim
            .pod_groups
            .iter()
            .flatten()
            .any(|g| !spec.pod_groups.iter().any(|p| &p.name == g))
        {
            problems.push("resourceClaims[].podGroups may only name pod groups of this Workload".into());
        }
    }
    let names_unknown_group = |groups: &Option<Vec<String>>| {
        groups
            .iter()
            .flatten()
            .any(|g| !spec.pod_groups.iter().any(|p| &p.name == g))
    };
    if spec
        .success_policy
        .as_ref()
        .is_some_and(|p| names_unknown_group(&p.pod_groups))
    {
        problems.push("successPolicy.podGroups may only name pod groups of this Workload".into());
    }
    if let Some(policy) = &spec.failure_policy {
        problems.extend(failure_policy_problems(policy));
        if policy.restarted_by == Some(crate::v1alpha1::RestartedBy::PodController)
            && spec.pod_groups.iter().any(|g| g.template.is_some())
        {
            problems.push(
                "spec.failurePolicy.restartedBy: PodController needs every pod group to be template-less (muster makes the pods of a group with a template)".into(),
            );
        }
        if policy.rules.iter().any(|r| names_unknown_group(&r.pod_groups)) {
            problems.push("failurePolicy.rules[].podGroups may only name pod groups of this Workload".into());
        }
    }
    if problems.is_empty() { Ok(()) } else { Err(problems) }
}

fn failure_policy_problems(policy: &FailurePolicy) -> Vec<String> {
    let mut problems = Vec::new();
    if !(0..=1000).contains(&policy.max_restarts) {
        problems.push("spec.failurePolicy.maxRestarts: must be between 0 and 1000".into());
    }
    if policy.restarted_by == Some(crate::v1alpha1::RestartedBy::PodController)
        && (policy.max_restarts != 0 || !policy.rules.is_empty() || policy.restart_backoff.is_some())
    {
        problems.push("failurePolicy.restartedBy PodController leaves restarts to the pods' controller: maxRestarts, rules and restartBackoff do not apply".into());
    }
    if policy.rules.len() > 16 {
        problems.push("spec.failurePolicy.rules: at most 16 rules are allowed".into());
    }
    for (i, rule) in policy.rules.iter().enumerate() {
        let at = format!("spec.failurePolicy.rules[{i}]");
        if rule.on_exit_codes.is_none() && rule.on_pod_conditions.is_none() && rule.on_reasons.is_none() {
            problems.push("a failure rule needs onExitCodes, onPodConditions or onReasons".into());
        }
        if let Some(name) = &rule.name {
            if !is_dns_label(name) {
                problems.push("failurePolicy.rules[].name must be a DNS label".into());
            }
            if policy.rules.iter().filter(|r| r.name.as_ref() == Some(name)).count() > 1 {
                problems.push("failurePolicy.rules[].name must be unique".into());
            }
        }
        if let Some(codes) = &rule.on_exit_codes {
            if codes.values.is_empty() || codes.values.len() > 255 {
                problems.push(format!("{at}.onExitCodes.values: between 1 and 255 codes"));
            }
            if codes.values.iter().any(|v| !(0..=255).contains(v)) {
                problems.push("exit codes are between 0 and 255".into());
            }
            if codes
                .values
                .iter()
                .enumerate()
                .any(|(j, v)| codes.values[..j].contains(v))
            {
                problems.push("onExitCodes.values must not repeat a code".into());
            }
            if codes.operator == ExitCodeOperator::In && codes.values.contains(&0) {
                problems.push("onExitCodes with operator In may not list 0: a container that exits 0 succeeded".into());
            }
        }
        let lengths = [
            ("onPodConditions", rule.on_pod_conditions.as_ref().map(Vec::len), 8),
            ("onReasons", rule.on_reasons.as_ref().map(Vec::len), 8),
            ("podGroups", rule.pod_groups.as_ref().map(Vec::len), 16),
        ];
        for (field, len, max) in lengths {
            if len.is_some_and(|n| n == 0 || n > max) {
                problems.push(format!("{at}.{field}: between 1 and {max} items"));
            }
        }
    }
    if let Some(backoff) = &policy.restart_backoff {
        if !(1..=3600).contains(&backoff.initial_seconds) || !(1..=86400).contains(&backoff.max_seconds) {
            problems.push(
                "spec.failurePolicy.restartBackoff: initialSeconds between 1 and 3600, maxSeconds between 1 and 86400"
                    .into(),
            );
        }
        if backoff.initial_seconds > backoff.max_seconds {
            problems.push("restartBackoff.initialSeconds must not exceed maxSeconds".into());
        }
    }
    problems
}

fn is_level(key: &str) -> bool {
    (1..=317).contains(&key.len())
}

fn topology_problems(topology: &Topology) -> Vec<String> {
    let mut problems = Vec::new();
    let levels = &topology.preferred_levels;
    if levels.is_empty() {
        return problems;
    }
    if topology.preferred.is_none() {
        problems.push("topology.preferredLevels are finer levels within topology.preferred: set preferred too".into());
    }
    if levels.len() > 4 {
        problems.push("spec.topology.preferredLevels: at most 4 levels are allowed".into());
    }
    if !levels.iter().all(|l| is_level(l)) {
        problems.push("each of topology.preferredLevels must be a label key of 1 to 317 characters".into());
    }
    if levels.iter().enumerate().any(|(i, l)| levels[..i].contains(l)) {
        problems.push("topology.preferredLevels must not repeat a level".into());
    }
    if levels
        .iter()
        .any(|l| Some(l) == topology.required.as_ref() || Some(l) == topology.preferred.as_ref())
    {
        problems.push("topology.preferredLevels may not repeat topology.required or topology.preferred".into());
    }
    problems
}

fn group_topology_problems(at: &str, replicas: i32, min_count: Option<i32>, topology: &GroupTopology) -> Vec<String> {
    let mut problems = Vec::new();
    if topology.required.as_deref().is_some_and(|k| !is_level(k)) {
        problems.push(format!(
            "{at}.topology.required: must be a label key of 1 to 317 characters"
        ));
    }
    let Some(slice) = &topology.slice else {
        return problems;
    };
    if !is_level(&slice.required) {
        problems.push(format!(
            "{at}.topology.slice.required: must be a label key of 1 to 317 characters"
        ));
    }
    if !(1..=MAX_REPLICAS).contains(&slice.size) {
        problems.push(format!(
            "{at}.topology.slice.size: must be between 1 and {MAX_REPLICAS}"
        ));
    } else if replicas % slice.size != 0 {
        problems.push(format!("{at}: topology.slice.size must divide replicas"));
    }
    if min_count.is_some_and(|m| m != replicas) {
        problems.push(format!(
            "{at}: a group with slices starts whole: minCount, if set, must equal replicas"
        ));
    }
    if topology.required.as_ref() == Some(&slice.required) {
        problems.push(format!(
            "{at}: topology.slice.required must be a finer level than the group's topology.required"
        ));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(yaml: &str) -> Workload {
        serde_saphyr::from_str(yaml).expect("test workload parses")
    }

    #[test]
    fn failure_rules_are_checked_as_the_api_server_does() {
        let good = workload(
            "kind: Workload\nmetadata: {name: w}\nspec:\n  podGroups:\n  - {name: a, replicas: 2}\n  failurePolicy:\n    maxRestarts: 3\n    restartBackoff: {initialSeconds: 10, maxSeconds: 300}\n    rules:\n    - {name: bug, action: FailGang, onExitCodes: {operator: In, values: [42]}}\n    - {action: RestartGangAndIgnoreMaxRestarts, onPodConditions: [{type: DisruptionTarget}], podGroups: [a]}\n    - {action: RestartGang, onReasons: [NodeLost, Evicted]}\n",
        );
        assert_eq!(validate(&good), Ok(()));
        let bad = workload(
            "kind: Workload\nmetadata: {name: w}\nspec:\n  podGroups:\n  - {name: a, replicas: 2}\n  failurePolicy:\n    restartBackoff: {initialSeconds: 60, maxSeconds: 10}\n    rules:\n    - {name: x, action: FailGang}\n    - {name: x, action: FailGang, onExitCodes: {operator: In, values: [0, 7, 7, 300]}}\n    - {action: RestartGang, onReasons: [Evicted], podGroups: [nope]}\n",
        );
        let problems = validate(&bad).unwrap_err();
        for expected in [
            "a failure rule needs onExitCodes, onPodConditions or onReasons",
            "failurePolicy.rules[].name must be unique",
            "may not list 0",
            "must not repeat a code",
            "exit codes are between 0 and 255",
            "failurePolicy.rules[].podGroups may only name pod groups",
            "initialSeconds must not exceed maxSeconds",
        ] {
            assert!(
                problems.iter().any(|p| p.contains(expected)),
                "{expected:?} not in {problems:?}"
            );
        }
    }

    #[test]
    fn a_template_that_names_its_node_is_refused_with_the_field() {
        let pinned = workload(
            "kind: Workload\nmetadata: {name: w}\nspec:\n  podGroups:\n  - {name: a, replicas: 1, template: {spec: {nodeName: n1, containers: [{name: c}]}}}\n",
        );
        let problems = validate(&pinned).unwrap_err();
        assert_eq!(problems, [format!("spec.podGroups[0]: {NODE_NAME_MESSAGE}")]);
        let empty = workload(
            "kind: Workload\nmetadata: {name: w}\nspec:\n  podGroups:\n  - {name: a, replicas: 1, template: {spec: {nodeName: '', containers: [{name: c}]}}}\n",
        );
        assert_eq!(validate(&empty), Ok(()));
    }

    #[test]
    fn accepts_a_good_workload_and_lists_every_problem_of_a_bad_one() {
        let good = workload(
            "kind: Workload\nmetadata: {name: w}\nspec:\n  podGroups:\n  - {name: a, replicas: 2, minCount: 1}\n",
        );
        assert_eq!(validate(&good), Ok(()));
        // A shared claim whose name only starts like a group's is fine.
        let fine = workload(
            "kind: Workload\nmetadata: {name: w}\nspec:\n  podGroups:\n  - {name: a, replicas: 2}\n  resourceClaims:\n  - {name: a-fabric, resourceClaimTemplateName: t}\n",
        );
        assert_eq!(validate(&fine), Ok(()));
        let levelled = workload(
            "kind: Workload\nmetadata: {name: w}\nspec:\n  topology: {required: block, preferred: rack, preferredLevels: [kubernetes.io/hostname]}\n  podGroups:\n  - {name: a, replicas: 1}\n  - {name: b, replicas: 16, topology: {required: rack, slice: {required: nvlink, size: 8}}}\n",
        );
        assert_eq!(validate(&levelled), Ok(()));
        let bad = workload(
            "kind: Workload\nmetadata: {name: 9w}\nspec:\n  podGroups:\n  - {name: a, replicas: 2, minCount: 3}\n  - {name: a, replicas: 0}\n  - {name: b, replicas: 5000}\n  - {name: s, replicas: 6, minCount: 3, topology: {required: rack, slice: {required: rack, size: 4}}}\n  resourceClaims:\n  - {name: c, podGroups: [nope]}\n  - {name: a-0-gpus, resourceClaimTemplateName: t}\n  topology: {required: rack, preferredLevels: [rack, h, h]}\n  successPolicy: {podGroups: [zzz]}\n",
        );
        let problems = validate(&bad).unwrap_err();
        for expected in [
            "DNS-1035 label",
            "spec.podGroups[0]: minCount must not exceed replicas",
            "pod group names must be unique",
            "spec.podGroups[1].replicas: must be between 1 and 10000",
            "exactly one of resourceClaimTemplateName and resourceClaimName",
            "resourceClaims[].podGroups may only name pod groups",
            "successPolicy.podGroups may only name pod groups",
            "at most 4096 pods in all groups together",
            "may not be named <group>-<index>-<name>",
            "spec.podGroups[3]: topology.slice.size must divide replicas",
            "spec.podGroups[3]: a group with slices starts whole",
            "spec.podGroups[3]: topology.slice.required must be a finer level",
            "set preferred too",
            "must not repeat a level",
            "may not repeat topology.required or topology.preferred",
        ] {
            assert!(
                problems.iter().any(|p| p.contains(expected)),
                "missing {expected:?} in {problems:?}"
            );
        }
    }
}
