//! The Workload a labelled job object stands for: one template-less pod group per pod
//! template, `replicas` = Jobs × `parallelism`, members picked by the job's own labels
//! and owners, and the gang settings of its annotations.
//!
//! A job muster cannot gang still gets its Workload, so that the reason is visible where
//! users look (`kubectl get mw`, the job's events): suspended, with the problems in the
//! [`labels::INVALID`] annotation, naming each field. Pure: the caller says which node
//! label keys the cluster has.

use std::collections::BTreeMap;

use muster_api::labels;
use muster_api::v1alpha1::{
    FailurePolicy, GroupTopology, MAX_PODS, MAX_REPLICAS, MAX_WORKLOAD_AND_GROUP_NAME, Members, PodGroup, Topology,
    TopologySlice, Workload, WorkloadSpec,
};
use serde_json::{Value, json};

use crate::frameworks::{Framework, JOBSET_UID, PodSet, REPLICATED_JOB};
use crate::kueue::QUEUE_LABEL;

/// The restarts a derived Workload allows: as many as the CRD does, since the job's own
/// policy (JobSet's `failurePolicy`, a Job's `backoffLimit`) decides when it fails.
pub const MAX_RESTARTS: i32 = 1000;

/// The Workload's name: `<prefix>-<job name>`, cut and made unique with a hash of the
/// whole name where `<workload>-<group>` would pass 57 characters.
pub fn workload_name(framework: Framework, name: &str, longest_group: usize) -> String {
    let full = format!("{}-{name}", framework.prefix());
    let room = MAX_WORKLOAD_AND_GROUP_NAME
        .saturating_sub(longest_group)
        .max(framework.prefix().len() + 7);
    if full.len() <= room {
        return full;
    }
    // FNV-1a: stable across releases, unlike the standard library's hasher.
    let hash = full.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let suffix = format!("{:05x}", hash & 0xf_ffff);
    let cut = full[..room - suffix.len() - 1].trim_end_matches('-');
    format!("{cut}-{suffix}")
}

fn annotation<'v>(object: &'v Value, key: &str) -> Option<&'v str> {
    object["metadata"]["annotations"][key].as_str()
}

/// A pod set's own annotation: on its pod template (as Kueue reads them), else on the
/// Job template of a replicated job.
fn pod_set_annotation<'v>(object: &'v Value, set: &PodSet, key: &str) -> Option<&'v str> {
    let template = object.pointer(&set.template)?;
    template["metadata"]["annotations"][key].as_str().or_else(|| {
        let job_template = set.template.strip_suffix("/spec/template")?;
        object.pointer(job_template)?["metadata"]["annotations"][key].as_str()
    })
}

/// Parses a positive count from annotation `key` at `at`.
fn count(value: &str, at: &str, key: &str, problems: &mut Vec<String>) -> Option<i32> {
    match value.trim().parse::<i32>() {
        Ok(n) if (1..=MAX_REPLICAS).contains(&n) => Some(n),
        _ => {
            problems.push(format!(
                "{at} annotation {key}: {value:?} is not a whole number from 1 to {MAX_REPLICAS}"
            ));
            None
        }
    }
}

/// A topology level from annotation `key` at `at`: a node label key that some node has.
fn level(value: &str, at: &str, key: &str, known: &dyn Fn(&str) -> bool, problems: &mut Vec<String>) -> Option<String> {
    let value = value.trim();
    if value.is_empty() || value.len() > 317 || value.contains(char::is_whitespace) || value.contains(',') {
        problems.push(format!("{at} annotation {key}: {value:?} is not a node label key"));
        return None;
    }
    if !known(value) {
        problems.push(format!(
            "{at} annotation {key}: no node has the label {value:?}, so no topology domain of it exists"
        ));
        return None;
    }
    Some(value.to_string())
}

/// The Workload for `object`, a job of `framework`. `known_level`: whether some node
/// carries a label key.
pub fn derive(framework: Framework, object: &Value, known_level: &dyn Fn(&str) -> bool) -> Workload {
    let mut problems = Vec::new();
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    let uid = object["metadata"]["uid"].as_str().unwrap_or_default();
    let sets = framework.pod_sets(object);
    if sets.is_empty() {
        problems.push("spec.replicatedJobs: a JobSet needs at least one replicated job".into());
    }
    if sets.len() > muster_api::v1alpha1::MAX_POD_GROUPS {
        problems.push(format!(
            "spec.replicatedJobs: muster gangs at most {} replicated jobs",
            muster_api::v1alpha1::MAX_POD_GROUPS
        ));
    }
    if framework == Framework::JobSet
        && object["spec"]["startupPolicy"]["startupPolicyOrder"].as_str() == Some("InOrder")
    {
        problems.push("spec.startupPolicy.startupPolicyOrder: InOrder creates the replicated jobs one after another once the earlier ones run, so the gang never has all its pods to start together; use AnyOrder".into());
    }

    let mut groups = Vec::new();
    let mut total: i64 = 0;
    for set in sets.iter().take(muster_api::v1alpha1::MAX_POD_GROUPS) {
        let at = &set.at;
        if set.parallelism < 1 {
            problems.push(format!("{at}.parallelism: {} pods never make a gang", set.parallelism));
        }
        if let Some(completions) = set.completions
            && completions > set.parallelism
        {
            problems.push(format!(
                "{at}.completions ({completions}) is larger than {at}.parallelism ({}): the Job runs its pods in waves, which cannot start together as one gang; set completions equal to parallelism",
                set.parallelism
            ));
        }
        let per_job = set
            .completions
            .map_or(set.parallelism, |c| c.min(set.parallelism))
            .max(1);
        let pods = set.jobs.max(1).saturating_mul(per_job);
        total = total.saturating_add(pods);
        let replicas = i32::try_from(pods.min(i64::from(MAX_REPLICAS))).unwrap_or(MAX_REPLICAS);
        if pods > i64::from(MAX_REPLICAS) {
            problems.push(format!(
                "{at}: {pods} pods in one group; muster gangs at most {MAX_REPLICAS}"
            ));
        }
        let template_at = format!("{at} pod template");
        let min_count = pod_set_annotation(object, set, labels::PODSET_MIN_COUNT)
            .and_then(|v| count(v, &template_at, labels::PODSET_MIN_COUNT, &mut problems))
            .filter(|&min| {
                let fits = min <= replicas;
                if !fits {
                    problems.push(format!(
                        "{template_at} annotation {}: minCount {min} is larger than the group's {replicas} pods",
                        labels::PODSET_MIN_COUNT
                    ));
                }
                fits
            });
        let required = pod_set_annotation(object, set, labels::PODSET_REQUIRED_TOPOLOGY).and_then(|v| {
            level(
                v,
                &template_at,
                labels::PODSET_REQUIRED_TOPOLOGY,
                known_level,
                &mut problems,
            )
        });
        let slice_level = pod_set_annotation(object, set, labels::PODSET_SLICE_REQUIRED_TOPOLOGY).and_then(|v| {
            level(
                v,
                &template_at,
                labels::PODSET_SLICE_REQUIRED_TOPOLOGY,
                known_level,
                &mut problems,
            )
        });
        let slice_size = pod_set_annotation(object, set, labels::PODSET_SLICE_SIZE)
            .and_then(|v| count(v, &template_at, labels::PODSET_SLICE_SIZE, &mut problems));
        let slice = match (slice_level, slice_size) {
            (Some(required), Some(size)) if replicas % size == 0 && min_count.is_none_or(|m| m == replicas) => {
                Some(TopologySlice { required, size })
            }
            (Some(_), Some(size)) => {
                problems.push(format!(
                    "{template_at} annotation {}: {size} must divide the group's {replicas} pods, and a group of slices has no minCount of its own",
                    labels::PODSET_SLICE_SIZE
                ));
                None
            }
            (Some(_), None) | (None, Some(_)) => {
                problems.push(format!(
                    "{template_at}: annotations {} and {} go together",
                    labels::PODSET_SLICE_REQUIRED_TOPOLOGY,
                    labels::PODSET_SLICE_SIZE
                ));
                None
            }
            (None, None) => None,
        };
        let slice = slice.filter(|s| Some(&s.required) != required.as_ref());
        let topology = (required.is_some() || slice.is_some()).then_some(GroupTopology { required, slice });
        let members = match framework {
            Framework::Job => Members {
                controller_uid: Some(uid.to_string()),
                ..Members::default()
            },
            Framework::JobSet => Members {
                match_labels: BTreeMap::from([
                    (JOBSET_UID.to_string(), uid.to_string()),
                    (REPLICATED_JOB.to_string(), set.group.clone()),
                ]),
                pods_per_job: Some(i32::try_from(per_job.min(i64::from(MAX_REPLICAS))).unwrap_or(1)),
                ..Members::default()
            },
        };
        groups.push(PodGroup {
            name: set.group.clone(),
            replicas: replicas.max(1),
            min_count,
            template: None,
            topology,
            members: Some(members),
        });
    }
    if groups.is_empty() {
        // Held and invalid: a Workload needs a group to exist at all.
        groups.push(PodGroup {
            name: "none".into(),
            replicas: 1,
            min_count: None,
            template: None,
            topology: None,
            members: Some(Members {
                controller_uid: Some(uid.to_string()),
                ..Members::default()
            }),
        });
    }
    if total > i64::from(MAX_PODS) {
        problems.push(format!("the job has {total} pods; a gang has at most {MAX_PODS}"));
    }

    let topology = gang_topology(object, known_level, &mut problems);
    let priority_class_name = annotation(object, labels::PRIORITY_CLASS)
        .map(str::to_string)
        .or_else(|| {
            sets.iter()
                .filter_map(|s| object.pointer(&s.template)?["spec"]["priorityClassName"].as_str())
                .find(|c| !c.is_empty())
                .map(str::to_string)
        });
    let longest_group = groups.iter().map(|g| g.name.len()).max().unwrap_or(0);
    let workload_name = workload_name(framework, name, longest_group);

    let mut workload_labels = BTreeMap::new();
    let queue = annotation(object, labels::QUEUE_NAME)
        .or_else(|| object["metadata"]["labels"][QUEUE_LABEL].as_str())
        .filter(|q| !q.is_empty());
    if let Some(queue) = queue {
        workload_labels.insert(QUEUE_LABEL.to_string(), queue.to_string());
    }
    let mut annotations = BTreeMap::new();
    if !problems.is_empty() {
        annotations.insert(labels::INVALID.to_string(), problems.join("; "));
    }
    let owner = json!({
        "apiVersion": object["apiVersion"],
        "kind": object["kind"],
        "name": name,
        "uid": uid,
        "controller": true,
    });
    let mut workload = Workload::new(
        &workload_name,
        WorkloadSpec {
            suspend: Some(framework.suspended(object) || !problems.is_empty()),
            priority_class_name,
            topology,
            pod_groups: groups,
            // The framework decides restarts; muster never fails the gang on its own.
            failure_policy: Some(FailurePolicy {
                max_restarts: MAX_RESTARTS,
                rules: Vec::new(),
                restart_backoff: None,
            }),
            ..WorkloadSpec::default()
        },
    );
    workload.metadata.namespace = object["metadata"]["namespace"].as_str().map(str::to_string);
    workload.metadata.labels = Some(workload_labels);
    workload.metadata.annotations = (!annotations.is_empty()).then_some(annotations);
    workload.metadata.owner_references = serde_json::from_value(json!([owner])).ok();
    workload
}

/// The gang's topology from the job object's annotations.
fn gang_topology(object: &Value, known: &dyn Fn(&str) -> bool, problems: &mut Vec<String>) -> Option<Topology> {
    let at = "metadata";
    let required = annotation(object, labels::REQUIRED_TOPOLOGY)
        .and_then(|v| level(v, at, labels::REQUIRED_TOPOLOGY, known, problems));
    let preferred = annotation(object, labels::PREFERRED_TOPOLOGY)
        .and_then(|v| level(v, at, labels::PREFERRED_TOPOLOGY, known, problems));
    let mut preferred_levels = Vec::new();
    if let Some(list) = annotation(object, labels::PREFERRED_LEVELS) {
        for part in list.split(',') {
            if let Some(l) = level(part, at, labels::PREFERRED_LEVELS, known, problems) {
                preferred_levels.push(l);
            }
        }
        if preferred.is_none() && !preferred_levels.is_empty() {
            problems.push(format!(
                "{at} annotation {}: finer levels within {}: set that annotation too",
                labels::PREFERRED_LEVELS,
                labels::PREFERRED_TOPOLOGY
            ));
            preferred_levels.clear();
        }
        let repeats = preferred_levels.iter().enumerate().any(|(i, l)| {
            preferred_levels[..i].contains(l) || Some(l) == required.as_ref() || Some(l) == preferred.as_ref()
        });
        if repeats || preferred_levels.len() > 4 {
            problems.push(format!(
                "{at} annotation {}: at most 4 levels, none repeated, none the required or preferred one",
                labels::PREFERRED_LEVELS
            ));
            preferred_levels.clear();
        }
    }
    (required.is_some() || preferred.is_some()).then_some(Topology {
        required,
        preferred,
        preferred_levels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(key: &str) -> bool {
        matches!(key, "example.com/rack" | "example.com/block" | "kubernetes.io/hostname")
    }

    fn jobset(annotations: Value, workers: Value) -> Value {
        json!({
            "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": "train", "namespace": "team", "uid": "js-uid", "annotations": annotations,
                         "labels": {"muster.dev/gang": "true", "kueue.x-k8s.io/queue-name": "q"}},
            "spec": {"replicatedJobs": [
                {"name": "launcher", "template": {"spec": {"template": {"spec": {"priorityClassName": "high"}}}}},
                {"name": "workers", "replicas": 2, "template": {"spec": workers}},
            ]},
        })
    }

    #[test]
    fn a_jobset_becomes_one_group_per_replicated_job() {
        let object = jobset(
            json!({"muster.dev/required-topology": "example.com/rack"}),
            json!({"parallelism": 2, "completions": 2, "template": {"metadata": {"annotations": {
                "muster.dev/podset-min-count": "3", "muster.dev/podset-required-topology": "example.com/block"}}}}),
        );
        let w = derive(Framework::JobSet, &object, &known);
        assert_eq!(w.metadata.name.as_deref(), Some("jobset-train"));
        assert_eq!(w.metadata.annotations, None, "valid");
        assert_eq!(w.spec.suspend, Some(false));
        assert_eq!(w.spec.priority_class_name.as_deref(), Some("high"));
        assert_eq!(
            w.spec.topology.as_ref().unwrap().required.as_deref(),
            Some("example.com/rack")
        );
        let groups: Vec<(&str, i32, Option<i32>)> = w
            .spec
            .pod_groups
            .iter()
            .map(|g| (g.name.as_str(), g.replicas, g.min_count))
            .collect();
        assert_eq!(groups, [("launcher", 1, None), ("workers", 4, Some(3))]);
        let members = w.spec.pod_groups[1].members.as_ref().unwrap();
        assert_eq!(members.pods_per_job, Some(2));
        assert_eq!(members.match_labels[JOBSET_UID], "js-uid");
        assert_eq!(w.metadata.labels.as_ref().unwrap()[QUEUE_LABEL], "q");
        let owner = &w.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("JobSet", "js-uid", Some(true))
        );
        assert_eq!(
            muster_api::validation::validate(&w),
            Ok(()),
            "the CRD's rules accept it"
        );
    }

    #[test]
    fn bad_input_names_the_field_and_holds_the_gang() {
        let cases = [
            (
                json!({"muster.dev/required-topology": "example.com/rakc"}),
                json!({"parallelism": 1, "template": {}}),
                "metadata annotation muster.dev/required-topology: no node has the label \"example.com/rakc\"",
            ),
            (
                json!({}),
                json!({"parallelism": 2, "template": {"metadata": {"annotations": {"muster.dev/podset-min-count": "5"}}}}),
                "spec.replicatedJobs[1] pod template annotation muster.dev/podset-min-count: minCount 5 is larger than the group's 4 pods",
            ),
            (
                json!({}),
                json!({"parallelism": 2, "template": {"metadata": {"annotations": {"muster.dev/podset-slice-size": "two"}}}}),
                "annotation muster.dev/podset-slice-size: \"two\" is not a whole number",
            ),
            (
                json!({}),
                json!({"parallelism": 2, "completions": 8, "template": {}}),
                "spec.replicatedJobs[1].completions (8) is larger than spec.replicatedJobs[1].parallelism (2)",
            ),
        ];
        for (annotations, workers, expected) in cases {
            let w = derive(Framework::JobSet, &jobset(annotations, workers), &known);
            let invalid = w.metadata.annotations.as_ref().map(|a| a[labels::INVALID].clone());
            assert!(
                invalid.as_deref().is_some_and(|i| i.contains(expected)),
                "{invalid:?} should say {expected:?}"
            );
            assert_eq!(w.spec.suspend, Some(true), "nothing is reserved");
            assert_eq!(muster_api::validation::validate(&w), Ok(()), "still a valid Workload");
        }
    }

    #[test]
    fn a_job_is_one_group_of_its_parallel_pods() {
        let job = json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "sweep", "namespace": "team", "uid": "job-uid"},
            "spec": {"parallelism": 4, "completions": 4, "suspend": true, "template": {}},
        });
        let w = derive(Framework::Job, &job, &known);
        assert_eq!(w.metadata.name.as_deref(), Some("job-sweep"));
        assert_eq!(w.spec.suspend, Some(true), "follows the Job's suspend");
        assert_eq!(w.spec.pod_groups[0].name, "main");
        assert_eq!(w.spec.pod_groups[0].replicas, 4);
        assert_eq!(
            w.spec.pod_groups[0].members.as_ref().unwrap().controller_uid.as_deref(),
            Some("job-uid")
        );
    }

    #[test]
    fn long_names_are_cut_with_a_hash() {
        let long = "a".repeat(63);
        let name = workload_name(Framework::JobSet, &long, 8);
        assert!(name.len() + 8 <= MAX_WORKLOAD_AND_GROUP_NAME, "{name}");
        assert_ne!(name, workload_name(Framework::JobSet, &format!("{long}b"), 8));
        assert_eq!(workload_name(Framework::Job, "x", 4), "job-x");
    }
}
