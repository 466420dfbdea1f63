//! What muster's admission webhook does to a labelled job object: every pod template
//! gets the gang gate and the labels that make its pods members of the job's Workload.
//! It refuses what can never be a gang: a shape the Workload API cannot hold, Kueue's
//! queue label (Kueue's own job integration would take the job and suspend it; the
//! gang queues in Kueue through its Workload, named by the annotation
//! `muster.dev/queue-name`, whatever order the webhooks run in), and later changes of
//! the label or of the gang's shape. Pure: the webhook turns the result into a JSON patch.

use muster_api::labels;
use serde_json::{Value, json};

use crate::frameworks::derive::limits;
use crate::frameworks::{Framework, is_gang_root, labelled};
use crate::kueue::QUEUE_LABEL;

/// The webhook's answer for one object.
#[derive(Debug, PartialEq)]
pub enum Verdict {
    /// Admit it as changed (equal to the input: unchanged).
    Admit(Value),
    /// Refuse it, saying why.
    Refuse(String),
}

/// The operation being admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Create,
    Update,
}

fn has_queue_label(object: &Value) -> bool {
    object["metadata"]["labels"][QUEUE_LABEL].is_string()
}

/// Each pod set's replicated job and pod count: the gang's shape.
fn shape(framework: Framework, object: &Value) -> Vec<(String, i64)> {
    framework
        .pod_sets(object)
        .into_iter()
        .map(|s| {
            let pods = s.pods();
            (s.replicated_job, pods)
        })
        .collect()
}

/// The name the API server would generate from `generate_name` with `suffix`: the base
/// cut so that the whole stays within 63 characters, as the API server cuts it.
fn generated_name(generate_name: &str, suffix: &str) -> String {
    const MAX_BASE: usize = 63 - 5;
    let base: String = generate_name.chars().take(MAX_BASE).collect();
    format!("{base}{suffix}")
}

/// Five characters for a generated name, from the request's uid (itself random), in the
/// alphabet the API server uses.
pub fn name_suffix(seed: &str) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut hash = seed.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    (0..5)
        .map(|_| {
            let c = ALPHABET[(hash % ALPHABET.len() as u64) as usize];
            hash /= ALPHABET.len() as u64;
            char::from(c)
        })
        .collect()
}

/// Decides on `object` (and, for an update, `old`) of `framework`. A labelled job made
/// with `generateName` and no name is given its name here (`generateName` and
/// `name_suffix`, as the API server would), since its gang's Workload and its pods'
/// labels are named after it.
pub fn admit(
    framework: Framework,
    operation: Operation,
    object: &Value,
    old: Option<&Value>,
    name_suffix: &str,
) -> Verdict {
    let now = labelled(object);
    let kind = framework.kind();
    if operation == Operation::Update {
        if object["metadata"]["deletionTimestamp"].is_string() {
            return Verdict::Admit(object.clone());
        }
        let before = old.and_then(labelled);
        if before != now {
            return Verdict::Refuse(match before {
                Some(_) => format!(
                    "the label {} cannot be removed or changed once the {kind} exists: delete it and create it again",
                    labels::ADOPT
                ),
                None => format!(
                    "the label {} can only be set when the {kind} is created: its pods must be gated from the start",
                    labels::ADOPT
                ),
            });
        }
    }
    match now {
        None => return Verdict::Admit(object.clone()),
        Some(labels::ADOPT_VALUE) => {}
        Some(other) => {
            return Verdict::Refuse(format!(
                "metadata.labels[{}]: {other:?} is not a value muster knows; set \"{}\" to run the {kind} as a gang",
                labels::ADOPT,
                labels::ADOPT_VALUE
            ));
        }
    }
    if !is_gang_root(framework, object) {
        // A JobSet's Job: its pod template came from the JobSet's, changed already.
        return Verdict::Admit(object.clone());
    }
    if has_queue_label(object) && (operation == Operation::Create || !old.is_some_and(has_queue_label)) {
        return Verdict::Refuse(format!(
            "metadata.labels[{QUEUE_LABEL}]: Kueue's own {kind} integration would take (and suspend) a {kind} with this label, beside the gang muster makes of it; to queue the gang in Kueue, name the LocalQueue in the annotation {} instead (muster's Workload then queues there)",
            labels::QUEUE_NAME
        ));
    }
    let mut named = object.clone();
    if object["metadata"]["name"].as_str().unwrap_or_default().is_empty() {
        match object["metadata"]["generateName"].as_str().filter(|g| !g.is_empty()) {
            Some(generate) if operation == Operation::Create => {
                named["metadata"]["name"] = json!(generated_name(generate, name_suffix));
            }
            _ => {
                return Verdict::Refuse(format!(
                    "metadata.name: a {kind} labelled {} needs a name (or generateName), which its gang's Workload is named after",
                    labels::ADOPT
                ));
            }
        }
    }
    let object = &named;
    match (operation, old) {
        (Operation::Create, _) => {
            let problems = limits(framework, object);
            if !problems.is_empty() {
                return Verdict::Refuse(problems.join("; "));
            }
        }
        (Operation::Update, Some(old)) => {
            let (before, after) = (shape(framework, old), shape(framework, object));
            if before != after {
                return Verdict::Refuse(format!(
                    "the {kind} runs as one gang of a fixed shape: its pods per replicated job cannot change from {before:?} to {after:?} (elastic replicas are not supported); delete the {kind} and create it again"
                ));
            }
        }
        (Operation::Update, None) => {}
    }
    let mut changed = object.clone();
    let workload = framework.workload_name(object);
    for set in framework.pod_sets(object) {
        // An update keeps muster's change where it was made (a later webhook may have
        // dropped it); a template made without it (the job predates the webhook) is not
        // changed now: its pods may run already, and the adoption controller holds it.
        if operation == Operation::Update
            && !old.and_then(|o| o.pointer(&set.template)).is_some_and(|t| {
                t["spec"]["schedulingGates"]
                    .as_array()
                    .is_some_and(|g| g.iter().any(|g| g["name"] == labels::GANG_GATE))
            })
        {
            continue;
        }
        let Some(template) = changed.pointer_mut(&set.template) else {
            continue;
        };
        if !template.is_object() {
            continue;
        }
        let metadata = entry(template, "metadata");
        let pod_labels = entry(metadata, "labels");
        pod_labels[labels::WORKLOAD] = json!(workload);
        pod_labels[labels::POD_GROUP] = json!(set.group);
        let spec = entry(template, "spec");
        let gates = spec
            .as_object_mut()
            .map(|s| s.entry("schedulingGates").or_insert_with(|| json!([])));
        if let Some(gates) = gates.and_then(Value::as_array_mut)
            && !gates.iter().any(|g| g["name"] == labels::GANG_GATE)
        {
            gates.push(json!({"name": labels::GANG_GATE}));
        }
    }
    Verdict::Admit(changed)
}

/// The object at `key` of `value`, made an empty object if missing or null.
fn entry<'v>(value: &'v mut Value, key: &str) -> &'v mut Value {
    if !value[key].is_object() {
        value[key] = json!({});
    }
    &mut value[key]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jobset(labels: Value) -> Value {
        json!({
            "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": "train", "labels": labels},
            "spec": {"replicatedJobs": [
                {"name": "workers", "template": {"spec": {"template": {"spec": {"schedulingGates": [{"name": "other"}]}}}}},
                {"name": "launcher", "template": {"spec": {"template": {"metadata": {"labels": {"app": "x"}}, "spec": {}}}}},
            ]},
        })
    }

    fn admitted(verdict: Verdict) -> Value {
        match verdict {
            Verdict::Admit(changed) => changed,
            Verdict::Refuse(why) => panic!("refused: {why}"),
        }
    }

    #[test]
    fn every_pod_template_gets_the_gate_and_the_gangs_labels() {
        let object = jobset(json!({"muster.dev/gang": "true"}));
        let changed = admitted(admit(Framework::JobSet, Operation::Create, &object, None, "x2v4b"));
        let template = &changed["spec"]["replicatedJobs"][0]["template"]["spec"]["template"];
        assert_eq!(
            template["spec"]["schedulingGates"],
            json!([{"name": "other"}, {"name": "muster.dev/gang"}])
        );
        assert_eq!(template["metadata"]["labels"]["muster.dev/workload"], "jobset-train");
        assert_eq!(template["metadata"]["labels"]["muster.dev/pod-group"], "workers");
        let launcher = &changed["spec"]["replicatedJobs"][1]["template"]["spec"]["template"];
        assert_eq!(launcher["metadata"]["labels"]["app"], "x");
        assert_eq!(launcher["metadata"]["labels"]["muster.dev/pod-group"], "launcher");
        // Again: nothing more changes.
        assert_eq!(
            admit(Framework::JobSet, Operation::Update, &changed, Some(&changed), "x2v4b"),
            Verdict::Admit(changed.clone())
        );
        // A later webhook dropped the gate: it comes back.
        let mut dropped = changed.clone();
        dropped["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["schedulingGates"] =
            json!([{"name": "other"}]);
        assert_eq!(
            admit(Framework::JobSet, Operation::Update, &dropped, Some(&changed), "x2v4b"),
            Verdict::Admit(changed.clone())
        );
    }

    /// Issue 33: the steps a Trainer runtime runs to completion before training (its
    /// dataset and model initializers, which the node step depends on with status
    /// `Complete`) are not gated: they run first, outside the gang.
    #[test]
    fn steps_that_run_to_completion_first_are_not_gated() {
        let object = json!({
            "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": "tune", "labels": {"muster.dev/gang": "true"}},
            "spec": {"replicatedJobs": [
                {"name": "dataset-initializer", "template": {"spec": {"template": {"spec": {}}}}},
                {"name": "model-initializer", "template": {"spec": {"template": {"spec": {}}}}},
                {"name": "node", "dependsOn": [
                    {"name": "dataset-initializer", "status": "Complete"},
                    {"name": "model-initializer", "status": "Complete"},
                ], "template": {"spec": {"template": {"spec": {}}}}},
            ]},
        });
        let changed = admitted(admit(Framework::JobSet, Operation::Create, &object, None, "x2v4b"));
        for i in 0..2 {
            assert_eq!(
                changed["spec"]["replicatedJobs"][i], object["spec"]["replicatedJobs"][i],
                "initializer {i} is left as it is"
            );
        }
        let node = &changed["spec"]["replicatedJobs"][2]["template"]["spec"]["template"];
        assert_eq!(node["spec"]["schedulingGates"], json!([{"name": "muster.dev/gang"}]));
        assert_eq!(node["metadata"]["labels"]["muster.dev/pod-group"], "node");
    }

    #[test]
    fn kueues_queue_label_is_refused_whatever_ran_before() {
        // As it comes, and as Kueue's own webhook leaves it (suspended) when it runs first.
        let queued = jobset(json!({"muster.dev/gang": "true", "kueue.x-k8s.io/queue-name": "team"}));
        let mut suspended = queued.clone();
        suspended["spec"]["suspend"] = json!(true);
        for object in [&queued, &suspended] {
            assert!(matches!(
                admit(Framework::JobSet, Operation::Create, object, None, "x2v4b"),
                Verdict::Refuse(m) if m.contains("kueue.x-k8s.io/queue-name") && m.contains("muster.dev/queue-name")
            ));
        }
        // Nothing strips it: an unlabelled job keeps it untouched (not muster's).
        let plain = jobset(json!({"kueue.x-k8s.io/queue-name": "team"}));
        assert_eq!(
            admit(Framework::JobSet, Operation::Create, &plain, None, "x2v4b"),
            Verdict::Admit(plain.clone())
        );
        // Added later: refused too.
        let labelled = admitted(admit(
            Framework::JobSet,
            Operation::Create,
            &jobset(json!({"muster.dev/gang": "true"})),
            None,
            "x2v4b",
        ));
        let mut later = labelled.clone();
        later["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = json!("team");
        assert!(matches!(
            admit(Framework::JobSet, Operation::Update, &later, Some(&labelled), "x2v4b"),
            Verdict::Refuse(_)
        ));
    }

    #[test]
    fn unlabelled_objects_pass_and_the_label_cannot_come_or_go_later() {
        let plain = jobset(json!({}));
        assert_eq!(
            admit(Framework::JobSet, Operation::Create, &plain, None, "x2v4b"),
            Verdict::Admit(plain.clone())
        );
        let labelled = jobset(json!({"muster.dev/gang": "true"}));
        assert!(matches!(
            admit(Framework::JobSet, Operation::Update, &labelled, Some(&plain), "x2v4b"),
            Verdict::Refuse(m) if m.contains("only be set when the JobSet is created")
        ));
        assert!(matches!(
            admit(Framework::JobSet, Operation::Update, &plain, Some(&labelled), "x2v4b"),
            Verdict::Refuse(m) if m.contains("cannot be removed")
        ));
        assert!(matches!(
            admit(Framework::JobSet, Operation::Create, &jobset(json!({"muster.dev/gang": "yes"})), None, "x2v4b"),
            Verdict::Refuse(m) if m.contains("\"yes\" is not a value muster knows")
        ));
        let mut unnamed = labelled.clone();
        unnamed["metadata"]["name"] = json!(null);
        assert!(matches!(
            admit(Framework::JobSet, Operation::Create, &unnamed, None, "x2v4b"),
            Verdict::Refuse(m) if m.contains("generateName")
        ));
        // Made with generateName (as Argo or Kubeflow Pipelines make jobs): named here,
        // and its pods labelled for the Workload of that name.
        unnamed["metadata"]["generateName"] = json!("train-");
        let Verdict::Admit(named) = admit(Framework::JobSet, Operation::Create, &unnamed, None, "x2v4b") else {
            panic!("admitted");
        };
        assert_eq!(named["metadata"]["name"], "train-x2v4b");
        assert_eq!(
            named["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["labels"][labels::WORKLOAD],
            "jobset-train-x2v4b"
        );
        let long = "a".repeat(70);
        assert_eq!(generated_name(&long, "x2v4b").len(), 63);
        assert_eq!(name_suffix("uid-1"), name_suffix("uid-1"));
        assert_ne!(name_suffix("uid-1"), name_suffix("uid-2"));
    }

    #[test]
    fn a_shape_the_api_cannot_hold_is_refused_and_the_shape_cannot_change() {
        let mut huge = jobset(json!({"muster.dev/gang": "true"}));
        huge["spec"]["replicatedJobs"][0]["replicas"] = json!(5000);
        assert!(matches!(
            admit(Framework::JobSet, Operation::Create, &huge, None, "x2v4b"),
            Verdict::Refuse(m) if m.contains("5001 pods; a gang has at most 4096")
        ));
        let created = admitted(admit(
            Framework::JobSet,
            Operation::Create,
            &jobset(json!({"muster.dev/gang": "true"})),
            None,
            "x2v4b",
        ));
        let mut scaled = created.clone();
        scaled["spec"]["replicatedJobs"][0]["replicas"] = json!(3);
        assert!(matches!(
            admit(Framework::JobSet, Operation::Update, &scaled, Some(&created), "x2v4b"),
            Verdict::Refuse(m) if m.contains("fixed shape")
        ));
    }

    #[test]
    fn an_update_of_a_job_made_before_the_webhook_is_not_gated_now() {
        let old = jobset(json!({"muster.dev/gang": "true"}));
        let mut new = old.clone();
        new["metadata"]["annotations"] = json!({"note": "x"});
        assert_eq!(
            admit(Framework::JobSet, Operation::Update, &new, Some(&old), "x2v4b"),
            Verdict::Admit(new.clone())
        );
    }
}
