//! What muster's admission webhook does to a labelled job object: every pod template
//! gets the gang gate and the labels that make its pods members of the job's Workload,
//! and Kueue's queue label moves to an annotation (the Workload queues in Kueue, not the
//! job, so Kueue's own job integrations leave it alone). Pure: the webhook turns the
//! result into a JSON patch.

use muster_api::labels;
use serde_json::{Value, json};

use crate::frameworks::derive::workload_name;
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

/// Decides on `object` (and, for an update, `old`) of `framework`.
pub fn admit(framework: Framework, operation: Operation, object: &Value, old: Option<&Value>) -> Verdict {
    let now = labelled(object);
    if operation == Operation::Update {
        if object["metadata"]["deletionTimestamp"].is_string() {
            return Verdict::Admit(object.clone());
        }
        let before = old.and_then(labelled);
        if before != now {
            return Verdict::Refuse(match before {
                Some(_) => format!(
                    "the label {} cannot be removed or changed once the {} exists: delete it and create it again",
                    labels::ADOPT,
                    framework.kind()
                ),
                None => format!(
                    "the label {} can only be set when the {} is created: its pods must be gated from the start",
                    labels::ADOPT,
                    framework.kind()
                ),
            });
        }
    }
    match now {
        None => return Verdict::Admit(object.clone()),
        Some(labels::ADOPT_VALUE) => {}
        Some(other) => {
            return Verdict::Refuse(format!(
                "metadata.labels[{}]: {other:?} is not a value muster knows; set \"{}\" to run the {} as a gang",
                labels::ADOPT,
                labels::ADOPT_VALUE,
                framework.kind()
            ));
        }
    }
    if !is_gang_root(framework, object) {
        // A JobSet's Job: its pod template came from the JobSet's, changed already.
        return Verdict::Admit(object.clone());
    }
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    if name.is_empty() {
        return Verdict::Refuse(format!(
            "metadata.name: a {} labelled {} needs a name of its own (generateName is not supported), which its gang's Workload is named after",
            framework.kind(),
            labels::ADOPT
        ));
    }
    let mut changed = object.clone();
    let sets = framework.pod_sets(object);
    let longest = sets.iter().map(|s| s.group.len()).max().unwrap_or(0);
    let workload = workload_name(framework, name, longest);
    for set in &sets {
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
    // Kueue's queue label goes to the Workload.
    if let Some(queue) = changed["metadata"]["labels"]
        .as_object_mut()
        .and_then(|l| l.remove(QUEUE_LABEL))
    {
        let metadata = entry(&mut changed, "metadata");
        entry(metadata, "annotations")[labels::QUEUE_NAME] = queue;
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

    #[test]
    fn every_pod_template_gets_the_gate_and_the_gangs_labels() {
        let object = jobset(json!({"muster.dev/gang": "true", "kueue.x-k8s.io/queue-name": "team"}));
        let Verdict::Admit(changed) = admit(Framework::JobSet, Operation::Create, &object, None) else {
            panic!("admitted")
        };
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
        assert!(
            changed["metadata"]["labels"].get(QUEUE_LABEL).is_none(),
            "Kueue's label moved"
        );
        assert_eq!(changed["metadata"]["annotations"][labels::QUEUE_NAME], "team");
        // Again: nothing more changes.
        assert_eq!(
            admit(Framework::JobSet, Operation::Update, &changed, Some(&changed)),
            Verdict::Admit(changed.clone())
        );
    }

    #[test]
    fn unlabelled_objects_pass_and_the_label_cannot_come_or_go_later() {
        let plain = jobset(json!({}));
        assert_eq!(
            admit(Framework::JobSet, Operation::Create, &plain, None),
            Verdict::Admit(plain.clone())
        );
        let labelled = jobset(json!({"muster.dev/gang": "true"}));
        assert!(matches!(
            admit(Framework::JobSet, Operation::Update, &labelled, Some(&plain)),
            Verdict::Refuse(m) if m.contains("only be set when the JobSet is created")
        ));
        assert!(matches!(
            admit(Framework::JobSet, Operation::Update, &plain, Some(&labelled)),
            Verdict::Refuse(m) if m.contains("cannot be removed")
        ));
        assert!(matches!(
            admit(Framework::JobSet, Operation::Create, &jobset(json!({"muster.dev/gang": "yes"})), None),
            Verdict::Refuse(m) if m.contains("\"yes\" is not a value muster knows")
        ));
        let mut unnamed = labelled.clone();
        unnamed["metadata"]["name"] = json!(null);
        assert!(matches!(
            admit(Framework::JobSet, Operation::Create, &unnamed, None),
            Verdict::Refuse(m) if m.contains("generateName")
        ));
    }
}
