//! The Workload a labelled job object stands for: one template-less pod group per pod
//! template, `replicas` = Jobs × `parallelism`, members picked by the job's own labels
//! and owners, the gang settings of its annotations, and the priority of its pod
//! templates.
//!
//! A job muster cannot gang still gets its Workload, so that the reason is visible where
//! users look (`kubectl get mw`, the job's events): suspended, with the problems in the
//! [`labels::INVALID`] annotation, naming each field. The Workload is always one the
//! CRD accepts (names made to fit, counts clamped), so that it can say so. Pure: the
//! caller says what the cluster has ([`Cluster`]).

use std::collections::BTreeMap;

use muster_api::labels;
use muster_api::v1alpha1::{
    FailurePolicy, GroupTopology, MAX_POD_GROUPS, MAX_PODS, MAX_REPLICAS, Members, PodGroup, RestartedBy, Topology,
    TopologySlice, Workload, WorkloadSpec,
};
use serde_json::{Value, json};

use crate::frameworks::{Framework, JOBSET_UID, PodSet, REPLICATED_JOB};
use crate::kueue::QUEUE_LABEL;

/// JobSet's annotation (on the JobSet or a replicated job's Job template) that places
/// each Job alone in one domain of a level, by pod affinity muster's plan does not make.
pub const EXCLUSIVE_TOPOLOGY: &str = "alpha.jobset.sigs.k8s.io/exclusive-topology";

/// What deriving a Workload needs to know of the cluster.
pub struct Cluster<'a> {
    /// Whether some node carries a label key.
    pub known_level: &'a dyn Fn(&str) -> bool,
    /// The value of a PriorityClass; `None` when it does not exist.
    pub priority: &'a dyn Fn(&str) -> Option<i32>,
    /// The PriorityClass marked `globalDefault`, with its value: the priority of pods
    /// that name none.
    pub default_priority: Option<i32>,
    /// Whether muster integrates with Kueue (the cluster serves it and muster may read it).
    pub kueue: bool,
}

fn annotation<'v>(object: &'v Value, key: &str) -> Option<&'v str> {
    object["metadata"]["annotations"][key].as_str()
}

/// The Job template of a pod set (a replicated job's `template`; a Job itself).
fn job_template<'v>(object: &'v Value, set: &PodSet) -> Option<&'v Value> {
    match set.template.strip_suffix("/spec/template") {
        Some("") => Some(object),
        Some(job) => object.pointer(job),
        None => None,
    }
}

/// A pod set's own annotation: on its pod template (as Kueue reads them), else on the
/// Job template of a replicated job.
fn pod_set_annotation<'v>(object: &'v Value, set: &PodSet, key: &str) -> Option<&'v str> {
    let template = object.pointer(&set.template)?;
    template["metadata"]["annotations"][key]
        .as_str()
        .or_else(|| job_template(object, set)?["metadata"]["annotations"][key].as_str())
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

/// Whether `value` may be a label value (a LocalQueue's name goes into one).
fn is_label_value(value: &str) -> bool {
    value.len() <= 63
        && value.starts_with(|c: char| c.is_ascii_alphanumeric())
        && value.ends_with(|c: char| c.is_ascii_alphanumeric())
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// What the Workload API can never hold, whatever the cluster: too many replicated jobs,
/// pods in one group, or pods in all. muster's webhook refuses a job with any of these
/// when it is created.
pub fn limits(framework: Framework, object: &Value) -> Vec<String> {
    let sets = framework.pod_sets(object);
    let mut problems = Vec::new();
    if sets.len() > MAX_POD_GROUPS {
        problems.push(format!(
            "spec.replicatedJobs: {} replicated jobs; muster gangs at most {MAX_POD_GROUPS}",
            sets.len()
        ));
    }
    for set in &sets {
        if set.pods() > i64::from(MAX_REPLICAS) {
            problems.push(format!(
                "{}: {} pods in one group ({} Jobs of {} pods); muster gangs at most {MAX_REPLICAS}",
                set.at,
                set.pods(),
                set.jobs.max(1),
                set.pods_per_job()
            ));
        }
    }
    let total = sets.iter().fold(0i64, |sum, s| sum.saturating_add(s.pods()));
    if total > i64::from(MAX_PODS) {
        problems.push(format!(
            "the {} has {total} pods; a gang has at most {MAX_PODS}",
            framework.kind()
        ));
    }
    problems
}

/// Whether a pod template carries what muster's webhook puts there: the gang's gate and
/// its labels for `workload` and `group`.
pub fn gated_by_webhook(template: &Value, workload: &str, group: &str) -> bool {
    let labels = &template["metadata"]["labels"];
    labels[labels::WORKLOAD] == workload
        && labels[labels::POD_GROUP] == group
        && template["spec"]["schedulingGates"]
            .as_array()
            .is_some_and(|gates| gates.iter().any(|g| g["name"] == labels::GANG_GATE))
}

/// The priority of a pod set's pods: the PriorityClass their template names (`None` for
/// the cluster's default) and its value. `Err`: the class does not exist.
fn pod_set_priority(object: &Value, set: &PodSet, cluster: &Cluster<'_>) -> Result<(Option<String>, i32), String> {
    let class = object
        .pointer(&set.template)
        .and_then(|t| t["spec"]["priorityClassName"].as_str())
        .filter(|c| !c.is_empty());
    match class {
        None => Ok((None, cluster.default_priority.unwrap_or(0))),
        Some(class) => match (cluster.priority)(class) {
            Some(value) => Ok((Some(class.to_string()), value)),
            None => Err(format!(
                "{} pod template spec.priorityClassName: PriorityClass {class:?} does not exist",
                set.at
            )),
        },
    }
}

/// The Workload for `object`, a job of `framework`, on `cluster`.
pub fn derive(framework: Framework, object: &Value, cluster: &Cluster<'_>) -> Workload {
    let mut problems = limits(framework, object);
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    let uid = object["metadata"]["uid"].as_str().unwrap_or_default();
    let sets = framework.pod_sets(object);
    let before = framework.steps_before(object);
    let workload_name = framework.workload_name(object);
    let kind = framework.kind();
    if sets.is_empty() {
        problems.push("spec.replicatedJobs: a JobSet needs at least one replicated job".into());
    }
    if framework == Framework::JobSet
        && object["spec"]["startupPolicy"]["startupPolicyOrder"].as_str() == Some("InOrder")
    {
        problems.push("spec.startupPolicy.startupPolicyOrder: InOrder creates the replicated jobs one after another once the earlier ones run, so the gang never has all its pods to start together; use AnyOrder".into());
    }
    if framework == Framework::JobSet && annotation(object, EXCLUSIVE_TOPOLOGY).is_some() {
        problems.push(format!("metadata annotation {EXCLUSIVE_TOPOLOGY}: JobSet's exclusive placement keeps Jobs apart by pod affinity that muster's plan does not make; use muster.dev/podset-required-topology (and slices) instead"));
    }
    if annotation(object, labels::PRIORITY_CLASS).is_some() {
        problems.push(format!(
            "metadata annotation {}: muster takes a gang's priority from its pod templates' spec.priorityClassName, which the API server's admission governs; remove the annotation and set the pod templates' priorityClassName",
            labels::PRIORITY_CLASS
        ));
    }
    if object["metadata"]["labels"][QUEUE_LABEL].is_string() {
        problems.push(format!(
            "metadata.labels[{QUEUE_LABEL}]: Kueue's own {kind} integration takes a job with this label; put the LocalQueue in the annotation {} instead",
            labels::QUEUE_NAME
        ));
    }

    let mut groups = Vec::new();
    let mut lowest: Option<(Option<String>, i32)> = None;
    // A set of no pods (`replicas: 0`, `parallelism: 0`, `completions: 0`) is no group:
    // the gang does not wait for pods that never come.
    for set in sets.iter().filter(|s| s.pods() > 0).take(MAX_POD_GROUPS) {
        let at = &set.at;
        if let Some(completions) = set.completions
            && completions > set.parallelism
        {
            problems.push(format!(
                "{at}.completions ({completions}) is larger than {at}.parallelism ({}): the Job runs its pods in waves, which cannot start together as one gang; set completions equal to parallelism",
                set.parallelism
            ));
        }
        // A step that runs to completion first is outside the gang; one that waits for
        // another to be ready would wait for ever on pods that wait at the gate.
        for (i, dependency) in set.depends_on.iter().enumerate() {
            if dependency.status != crate::frameworks::COMPLETE && !before.contains(&dependency.name) {
                problems.push(format!(
                    "{at}.dependsOn[{i}]: JobSet creates this replicated job only once {:?} is {}, but that replicated job's pods wait at the gang's gate for this one's, so neither ever starts; muster gangs replicated jobs that start together, and runs those a step depends on with status Complete before the gang",
                    dependency.name, dependency.status
                ));
            }
        }
        if framework == Framework::JobSet && set.completion_mode.as_deref() == Some("NonIndexed") {
            problems.push(format!(
                "{at}.template.spec.completionMode: NonIndexed pods carry no completion index, by which muster tells the gang's pods apart; use Indexed"
            ));
        }
        if framework == Framework::JobSet
            && job_template(object, set).is_some_and(|j| j["metadata"]["annotations"][EXCLUSIVE_TOPOLOGY].is_string())
        {
            problems.push(format!("{at}.template annotation {EXCLUSIVE_TOPOLOGY}: JobSet's exclusive placement keeps Jobs apart by pod affinity that muster's plan does not make; use muster.dev/podset-required-topology (and slices) instead"));
        }
        if !object
            .pointer(&set.template)
            .is_some_and(|t| gated_by_webhook(t, &workload_name, &set.group))
        {
            problems.push(format!(
                "{at} pod template: it lacks the scheduling gate {} or the labels {}={workload_name} and {}={}, so the {kind} was created without muster's webhook (before the webhook was installed, or while its namespaceSelector left this namespace out) and its pods start without the gang; delete the {kind} and create it again",
                labels::GANG_GATE,
                labels::WORKLOAD,
                labels::POD_GROUP,
                set.group
            ));
        }
        match pod_set_priority(object, set, cluster) {
            Ok(priority) => {
                if lowest.as_ref().is_none_or(|(_, value)| priority.1 < *value) {
                    lowest = Some(priority);
                }
            }
            Err(problem) => problems.push(problem),
        }
        let per_job = set.pods_per_job();
        let replicas = i32::try_from(set.pods().clamp(1, i64::from(MAX_REPLICAS))).unwrap_or(MAX_REPLICAS);
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
                cluster.known_level,
                &mut problems,
            )
        });
        let slice_level = pod_set_annotation(object, set, labels::PODSET_SLICE_REQUIRED_TOPOLOGY).and_then(|v| {
            level(
                v,
                &template_at,
                labels::PODSET_SLICE_REQUIRED_TOPOLOGY,
                cluster.known_level,
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
                    (REPLICATED_JOB.to_string(), set.replicated_job.clone()),
                ]),
                pods_per_job: Some(i32::try_from(per_job.min(i64::from(MAX_REPLICAS))).unwrap_or(1)),
                ..Members::default()
            },
        };
        groups.push(PodGroup {
            name: set.group.clone(),
            replicas,
            min_count,
            template: None,
            topology,
            members: Some(members),
        });
    }
    if groups.is_empty() {
        // Held and invalid: a Workload needs a group to exist at all (a job of no pods
        // gets none: see `Framework::makes_no_pods`).
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
    if groups.iter().map(|g| i64::from(g.replicas)).sum::<i64>() > i64::from(MAX_PODS) {
        // Held for the count `limits` named; a Workload the CRD accepts says so.
        for group in &mut groups {
            group.replicas = 1;
            group.min_count = None;
            group.topology = None;
        }
    }

    let topology = gang_topology(object, cluster.known_level, &mut problems);
    let mut workload_labels = BTreeMap::new();
    if let Some(queue) = annotation(object, labels::QUEUE_NAME)
        .map(str::trim)
        .filter(|q| !q.is_empty())
    {
        if !is_label_value(queue) {
            problems.push(format!(
                "metadata annotation {}: {queue:?} is not the name of a LocalQueue",
                labels::QUEUE_NAME
            ));
        } else {
            if !cluster.kueue {
                problems.push(format!(
                    "metadata annotation {}: the gang asks for Kueue's LocalQueue {queue}, but this muster does not work with Kueue (the cluster does not serve kueue.x-k8s.io/v1beta2, or muster may not read it: the chart's rbac.kueue), and would run it uncharged",
                    labels::QUEUE_NAME
                ));
            }
            workload_labels.insert(QUEUE_LABEL.to_string(), queue.to_string());
        }
    }
    // Named by the framework, not the object: items of a LIST carry no apiVersion or
    // kind, and a Workload owned by "" is refused.
    let resource = framework.resource();
    let owner = json!({
        "apiVersion": resource.api_version,
        "kind": resource.kind,
        "name": name,
        "uid": uid,
        "controller": true,
    });
    let mut workload = Workload::new(
        &workload_name,
        WorkloadSpec {
            suspend: Some(false),
            priority_class_name: lowest.and_then(|(class, _)| class),
            topology,
            pod_groups: groups,
            // The framework decides restarts: muster places its replacements.
            failure_policy: Some(FailurePolicy {
                max_restarts: 0,
                rules: Vec::new(),
                restart_backoff: None,
                restarted_by: Some(RestartedBy::PodController),
            }),
            ..WorkloadSpec::default()
        },
    );
    workload.metadata.namespace = object["metadata"]["namespace"].as_str().map(str::to_string);
    workload.metadata.labels = Some(workload_labels);
    workload.metadata.owner_references = serde_json::from_value(json!([owner])).ok();
    if let Err(refused) = muster_api::validation::validate(&workload) {
        problems.extend(refused);
    }
    problems.dedup();
    if !problems.is_empty() {
        workload.metadata.annotations = Some(BTreeMap::from([(labels::INVALID.to_string(), summarise(&problems))]));
    }
    workload.spec.suspend = Some(framework.suspended(object) || !problems.is_empty());
    workload
}

/// Longest problem told in full, and how many are told: a problem quotes the value it
/// refuses, and a value of any size (a 256 KiB annotation) must not make the Workload's
/// own annotation too large to write.
const PROBLEM_CHARS: usize = 512;
const PROBLEMS_TOLD: usize = 8;

/// `problems` as one annotation value of bounded size: each cut at [`PROBLEM_CHARS`],
/// at most [`PROBLEMS_TOLD`] of them and a count of the rest.
fn summarise(problems: &[String]) -> String {
    let mut told: Vec<String> = problems
        .iter()
        .take(PROBLEMS_TOLD)
        .map(|p| match p.char_indices().nth(PROBLEM_CHARS) {
            Some((cut, _)) => format!("{}… ({} characters in all)", &p[..cut], p.chars().count()),
            None => p.clone(),
        })
        .collect();
    if problems.len() > PROBLEMS_TOLD {
        told.push(format!("and {} more", problems.len() - PROBLEMS_TOLD));
    }
    told.join("; ")
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
    use crate::frameworks::mutate::{Operation, Verdict, admit};

    fn known(key: &str) -> bool {
        matches!(key, "example.com/rack" | "example.com/block" | "kubernetes.io/hostname")
    }

    fn priority(class: &str) -> Option<i32> {
        match class {
            "high" => Some(1000),
            "low" => Some(10),
            _ => None,
        }
    }

    fn cluster() -> Cluster<'static> {
        Cluster {
            known_level: &known,
            priority: &priority,
            default_priority: None,
            kueue: true,
        }
    }

    /// `object` as muster's webhook admits it.
    fn mutated(framework: Framework, object: Value) -> Value {
        match admit(framework, Operation::Create, &object, None, "x2v4b") {
            Verdict::Admit(changed) => changed,
            Verdict::Refuse(why) => panic!("refused: {why}"),
        }
    }

    fn jobset(annotations: Value, workers: Value) -> Value {
        mutated(
            Framework::JobSet,
            json!({
                "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                "metadata": {"name": "train", "namespace": "team", "uid": "js-uid", "annotations": annotations,
                             "labels": {"muster.dev/gang": "true"}},
                "spec": {"replicatedJobs": [
                    {"name": "launcher", "template": {"spec": {"template": {"spec": {"priorityClassName": "high"}}}}},
                    {"name": "workers", "replicas": 2, "template": {"spec": workers}},
                ]},
            }),
        )
    }

    fn invalid(w: &Workload) -> String {
        w.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(labels::INVALID).cloned())
            .unwrap_or_default()
    }

    /// Issue 33: a replicated job of `replicas: 0`, or a Job of `parallelism: 0` or
    /// `completions: 0`, contributes no pods: it is no group, and a job of no pods at all
    /// is no gang, rather than a gang waiting for pods that never come.
    #[test]
    fn a_set_of_no_pods_is_no_group_and_a_job_of_none_is_no_gang() {
        let object = jobset(json!({}), json!({"parallelism": 1, "completions": 1}));
        let mut object = object;
        object["spec"]["replicatedJobs"][1]["replicas"] = json!(0);
        let w = derive(Framework::JobSet, &object, &cluster());
        assert_eq!(invalid(&w), "");
        let groups: Vec<&str> = w.spec.pod_groups.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(groups, ["launcher"]);

        for (parallelism, completions) in [(0, 4), (4, 0)] {
            let job = mutated(
                Framework::Job,
                json!({
                    "apiVersion": "batch/v1", "kind": "Job",
                    "metadata": {"name": "idle", "namespace": "team", "uid": "j", "labels": {"muster.dev/gang": "true"}},
                    "spec": {"parallelism": parallelism, "completions": completions, "completionMode": "Indexed",
                             "template": {"spec": {"priorityClassName": "low"}}},
                }),
            );
            assert!(
                Framework::Job.makes_no_pods(&job),
                "parallelism {parallelism}, completions {completions}: no pods, no gang"
            );
        }
    }

    #[test]
    fn a_jobset_becomes_one_group_per_replicated_job() {
        let object = jobset(
            json!({"muster.dev/required-topology": "example.com/rack", "muster.dev/queue-name": "q"}),
            json!({"parallelism": 2, "completions": 2, "template": {"metadata": {"annotations": {
                "muster.dev/podset-min-count": "3", "muster.dev/podset-required-topology": "example.com/block"}},
                "spec": {"priorityClassName": "low"}}}),
        );
        let w = derive(Framework::JobSet, &object, &cluster());
        assert_eq!(w.metadata.name.as_deref(), Some("jobset-train"));
        assert_eq!(w.metadata.annotations, None, "valid: {}", invalid(&w));
        assert_eq!(w.spec.suspend, Some(false));
        assert_eq!(
            w.spec.priority_class_name.as_deref(),
            Some("low"),
            "the lowest of the templates'"
        );
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
    fn the_priority_is_the_pod_templates_never_an_annotation() {
        // A template without a class runs at the cluster's default priority.
        let object = jobset(json!({}), json!({"template": {}}));
        let mut with_default = cluster();
        with_default.default_priority = Some(5);
        let w = derive(Framework::JobSet, &object, &with_default);
        assert_eq!(w.spec.priority_class_name, None, "the default (5) is below high");
        let w = derive(Framework::JobSet, &object, &cluster());
        assert_eq!(w.spec.priority_class_name, None, "no class is priority 0");

        let claimed = jobset(
            json!({"muster.dev/priority-class": "system-cluster-critical"}),
            json!({"template": {"spec": {"priorityClassName": "high"}}}),
        );
        let w = derive(Framework::JobSet, &claimed, &cluster());
        assert!(
            invalid(&w).contains("muster.dev/priority-class: muster takes a gang's priority from its pod templates"),
            "{}",
            invalid(&w)
        );
        assert_eq!(w.spec.priority_class_name.as_deref(), Some("high"));
        assert_eq!(w.spec.suspend, Some(true));

        let missing = jobset(json!({}), json!({"template": {"spec": {"priorityClassName": "nope"}}}));
        let w = derive(Framework::JobSet, &missing, &cluster());
        assert!(
            invalid(&w).contains("PriorityClass \"nope\" does not exist"),
            "{}",
            invalid(&w)
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
            (
                json!({}),
                json!({"completionMode": "NonIndexed", "template": {}}),
                "spec.replicatedJobs[1].template.spec.completionMode: NonIndexed",
            ),
            (
                json!({"alpha.jobset.sigs.k8s.io/exclusive-topology": "example.com/rack"}),
                json!({"template": {}}),
                "metadata annotation alpha.jobset.sigs.k8s.io/exclusive-topology",
            ),
            (
                json!({"muster.dev/queue-name": "not a queue"}),
                json!({"template": {}}),
                "\"not a queue\" is not the name of a LocalQueue",
            ),
        ];
        for (annotations, workers, expected) in cases {
            let w = derive(Framework::JobSet, &jobset(annotations, workers), &cluster());
            assert!(
                invalid(&w).contains(expected),
                "{:?} should say {expected:?}",
                invalid(&w)
            );
            assert_eq!(w.spec.suspend, Some(true), "nothing is reserved");
            assert_eq!(muster_api::validation::validate(&w), Ok(()), "still a valid Workload");
        }
        let mut waiting = jobset(json!({}), json!({"template": {}}));
        waiting["spec"]["replicatedJobs"][1]["dependsOn"] = json!([{"name": "launcher", "status": "Ready"}]);
        let w = derive(Framework::JobSet, &waiting, &cluster());
        assert!(
            invalid(&w).contains("spec.replicatedJobs[1].dependsOn"),
            "{}",
            invalid(&w)
        );
    }

    /// Issue 33: a Trainer runtime's initializers (what the node step depends on with
    /// status `Complete`) are no group of the gang: the gang is the node step, whose
    /// Jobs JobSet makes once they are done. A step that waits for another to be ready
    /// is held, with the field named, since the other's pods wait at the gate for it.
    #[test]
    fn the_gang_is_the_step_after_those_that_run_to_completion_first() {
        let mut object = jobset(json!({}), json!({"template": {}}));
        object["spec"]["replicatedJobs"][1]["dependsOn"] = json!([{"name": "launcher", "status": "Complete"}]);
        let w = derive(Framework::JobSet, &object, &cluster());
        assert_eq!(invalid(&w), "");
        assert_eq!(w.spec.suspend, Some(false));
        let groups: Vec<&str> = w.spec.pod_groups.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(groups, ["workers"]);

        // A later step may wait for an initializer to be ready: it runs ungated.
        object["spec"]["replicatedJobs"].as_array_mut().unwrap().push(
            json!({"name": "watcher", "dependsOn": [{"name": "launcher", "status": "Ready"}],
                         "template": {"spec": {"template": {"spec": {}}}}}),
        );
        let object = mutated(Framework::JobSet, object);
        let w = derive(Framework::JobSet, &object, &cluster());
        assert_eq!(invalid(&w), "");

        // Launcher then nodes, the launcher made once the nodes are ready: held.
        let mut mpi = jobset(json!({}), json!({"template": {}}));
        mpi["spec"]["replicatedJobs"][0]["dependsOn"] = json!([{"name": "workers", "status": "Ready"}]);
        let w = derive(Framework::JobSet, &mpi, &cluster());
        assert!(
            invalid(&w).contains("spec.replicatedJobs[0].dependsOn[0]"),
            "{}",
            invalid(&w)
        );
        assert_eq!(w.spec.suspend, Some(true));
    }

    #[test]
    fn a_queue_without_kueue_is_held_rather_than_run_uncharged() {
        let object = jobset(json!({"muster.dev/queue-name": "team"}), json!({"template": {}}));
        let mut without = cluster();
        without.kueue = false;
        let w = derive(Framework::JobSet, &object, &without);
        assert!(invalid(&w).contains("does not work with Kueue"), "{}", invalid(&w));
        assert_eq!(w.spec.suspend, Some(true));
    }

    #[test]
    fn a_job_the_webhook_never_saw_is_held() {
        let job = json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "early", "namespace": "team", "uid": "job-uid", "labels": {"muster.dev/gang": "true"}},
            "spec": {"parallelism": 2, "completions": 2, "template": {"spec": {"containers": []}}},
        });
        let w = derive(Framework::Job, &job, &cluster());
        assert!(
            invalid(&w).contains("created without muster's webhook"),
            "{}",
            invalid(&w)
        );
        assert_eq!(w.spec.suspend, Some(true));
        let w = derive(Framework::Job, &mutated(Framework::Job, job), &cluster());
        assert_eq!(invalid(&w), "");
    }

    #[test]
    fn the_owner_is_named_by_the_framework_as_a_listed_job_has_no_kind() {
        // Items of a LIST of built-in kinds carry no apiVersion or kind.
        let job = mutated(
            Framework::Job,
            json!({
                "metadata": {"name": "listed", "namespace": "team", "uid": "job-uid", "labels": {"muster.dev/gang": "true"}},
                "spec": {"parallelism": 2, "completions": 2, "completionMode": "Indexed", "template": {}},
            }),
        );
        let w = derive(Framework::Job, &job, &cluster());
        let owner = &w.metadata.owner_references.as_ref().expect("an owner")[0];
        assert_eq!(
            (
                owner.api_version.as_str(),
                owner.kind.as_str(),
                owner.name.as_str(),
                owner.uid.as_str()
            ),
            ("batch/v1", "Job", "listed", "job-uid")
        );
        assert_eq!(owner.controller, Some(true));
    }

    #[test]
    fn a_job_is_one_group_of_its_parallel_pods() {
        let job = mutated(
            Framework::Job,
            json!({
                "apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": "sweep", "namespace": "team", "uid": "job-uid", "labels": {"muster.dev/gang": "true"}},
                "spec": {"parallelism": 4, "completions": 4, "suspend": true, "template": {}},
            }),
        );
        let w = derive(Framework::Job, &job, &cluster());
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
    fn names_and_counts_the_crd_refuses_are_made_to_fit() {
        // A dot in the name, and more pods than a gang holds.
        let job = json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "train.v2", "namespace": "team", "uid": "job-uid", "labels": {"muster.dev/gang": "true"}},
            "spec": {"parallelism": 5000, "completions": 5000, "completionMode": "Indexed", "template": {}},
        });
        assert!(!limits(Framework::Job, &job).is_empty());
        let w = derive(Framework::Job, &job, &cluster());
        assert!(
            w.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with("job-train-v2-"))
        );
        assert!(
            invalid(&w).contains("the Job has 5000 pods; a gang has at most 4096"),
            "{}",
            invalid(&w)
        );
        assert_eq!(muster_api::validation::validate(&w), Ok(()), "the CRD accepts it");
        // A long replicated job.
        let long = "w".repeat(63);
        let mut object = jobset(json!({}), json!({"template": {}}));
        object["spec"]["replicatedJobs"][1]["name"] = json!(long);
        let object = mutated(Framework::JobSet, object);
        let w = derive(Framework::JobSet, &object, &cluster());
        assert_eq!(muster_api::validation::validate(&w), Ok(()));
        assert_eq!(invalid(&w), "");
        assert_eq!(
            w.spec.pod_groups[1].members.as_ref().unwrap().match_labels[REPLICATED_JOB],
            long
        );
    }

    #[test]
    fn problems_are_told_within_a_bounded_size_whatever_the_values_quoted() {
        let huge = "x".repeat(256 << 10);
        let problems: Vec<String> = (0..20)
            .map(|i| format!("annotation a{i}: {huge:?} is not a node label key"))
            .collect();
        let told = summarise(&problems);
        assert!(told.len() < 8 * 1024, "{} bytes", told.len());
        assert!(told.starts_with("annotation a0: \"xxx"), "the field is named first");
        assert!(told.ends_with("and 12 more"), "{}", &told[told.len() - 40..]);
        assert_eq!(summarise(&["short".to_string()]), "short");
    }
}
