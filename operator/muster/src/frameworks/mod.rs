//! Training jobs that become gangs with one label: a JobSet (and so a Kubeflow TrainJob,
//! whose runtime patch's template labels, or its runtime's, reach the JobSet Trainer
//! makes for it) or a `batch/v1` Job
//! labelled `muster.dev/gang: "true"`. Nothing in their pod templates has to change:
//!
//! - [`mutate`]: what muster's admission webhook changes in a labelled job object when it
//!   is created — the gang gate and the gang's labels in every pod template — so that
//!   the framework's controller creates gated pods that join the gang;
//! - [`derive`]: the Workload a job object stands for, one template-less pod group per
//!   replicated job (JobSet) or per Job, with the gang settings its annotations give;
//! - [`controller`]: keeps each labelled job's Workload (owned by the job), its suspend,
//!   its end, and tells the job object when its gang is admitted or cannot be placed.
//!
//! Restarts stay the framework's (JobSet's `failurePolicy`, a Job's `backoffLimit`):
//! the derived Workload has no `failurePolicy` of its own.

pub mod controller;
pub mod derive;
pub mod jobs;
pub mod mutate;
pub mod names;

use kube::api::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

/// A kind of job object muster adopts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Framework {
    /// `jobset.x-k8s.io/v1alpha2` JobSet.
    JobSet,
    /// `batch/v1` Job.
    Job,
}

/// JobSet's labels on its Jobs and pods.
pub use crate::owners::{JOBSET_NAME, JOBSET_UID};
pub const REPLICATED_JOB: &str = "jobset.sigs.k8s.io/replicatedjob-name";

/// The group of a Job's own Workload, as Kueue names a Job's only pod set.
pub const JOB_GROUP: &str = "main";

/// One pod template of a job object: a future pod group.
#[derive(Clone, Debug, PartialEq)]
pub struct PodSet {
    /// The pod group's name ([`names::group_name`] of the replicated job's).
    pub group: String,
    /// The replicated job's name as the JobSet has it (JobSet labels its pods with it);
    /// [`JOB_GROUP`] for a Job.
    pub replicated_job: String,
    /// JSON pointer of the pod template in the job object.
    pub template: String,
    /// The field path of the Job spec, for messages (`spec.replicatedJobs[1]` or `spec`).
    pub at: String,
    /// Jobs made from it (a replicated job's `replicas`; 1 for a Job).
    pub jobs: i64,
    /// Each Job's `parallelism` (default 1).
    pub parallelism: i64,
    /// Each Job's `completions`, if set.
    pub completions: Option<i64>,
    /// Each Job's `completionMode`, if set.
    pub completion_mode: Option<String>,
    /// Replicated jobs this one waits for (JobSet's `dependsOn`).
    pub depends_on: Vec<Dependency>,
}

/// One entry of a replicated job's `dependsOn`: JobSet creates the replicated job's Jobs
/// only once the named one reaches `status` (`Ready` or `Complete`).
#[derive(Clone, Debug, PartialEq)]
pub struct Dependency {
    pub name: String,
    pub status: String,
}

/// JobSet's `dependsOn` status by which a replicated job waits for another to finish.
pub const COMPLETE: &str = "Complete";

impl PodSet {
    /// Pods of one Job that run at once: `parallelism`, or fewer `completions` (none
    /// for a Job of `parallelism: 0` or `completions: 0`).
    pub fn pods_per_job(&self) -> i64 {
        self.completions
            .map_or(self.parallelism, |c| c.min(self.parallelism))
            .max(0)
    }

    /// Pods of the whole set: Jobs × pods per Job (none for a replicated job of
    /// `replicas: 0`). A set of no pods is no group of the gang.
    pub fn pods(&self) -> i64 {
        self.jobs.max(0).saturating_mul(self.pods_per_job())
    }
}

impl Framework {
    pub fn of(api_version: &str, kind: &str) -> Option<Framework> {
        match (api_version, kind) {
            ("jobset.x-k8s.io/v1alpha2", "JobSet") => Some(Framework::JobSet),
            ("batch/v1", "Job") => Some(Framework::Job),
            _ => None,
        }
    }

    pub fn resource(self) -> ApiResource {
        match self {
            Framework::JobSet => ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk("jobset.x-k8s.io", "v1alpha2", "JobSet"),
                "jobsets",
            ),
            Framework::Job => ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("batch", "v1", "Job"), "jobs"),
        }
    }

    /// How the kind starts the names of its Workloads (`jobset-<name>`, `job-<name>`).
    pub fn prefix(self) -> &'static str {
        match self {
            Framework::JobSet => "jobset",
            Framework::Job => "job",
        }
    }

    pub fn kind(self) -> &'static str {
        match self {
            Framework::JobSet => "JobSet",
            Framework::Job => "Job",
        }
    }

    /// The pod templates of the object's gang, in order: every one but the steps that
    /// run to completion before it ([`Framework::steps_before`]).
    pub fn pod_sets(self, object: &Value) -> Vec<PodSet> {
        let before = self.steps_before(object);
        self.all_pod_sets(object)
            .into_iter()
            .filter(|s| !before.contains(&s.replicated_job))
            .collect()
    }

    /// The replicated jobs that run to completion before the gang: those another
    /// replicated job depends on with status `Complete` (Trainer's dataset and model
    /// initializers). JobSet makes the gang's Jobs only once they are done, so they run
    /// on their own, outside the gang, and the gang's devices are reserved once they
    /// are done and its pods exist.
    pub fn steps_before(self, object: &Value) -> std::collections::BTreeSet<String> {
        self.all_pod_sets(object)
            .iter()
            .flat_map(|s| &s.depends_on)
            .filter(|d| d.status == COMPLETE)
            .map(|d| d.name.clone())
            .collect()
    }

    /// Every pod template of the object, in order.
    fn all_pod_sets(self, object: &Value) -> Vec<PodSet> {
        let job = |spec: &Value, replicated_job: &str, template: String, at: String, jobs: i64| PodSet {
            group: names::group_name(replicated_job),
            replicated_job: replicated_job.to_string(),
            template,
            at,
            jobs,
            parallelism: spec["parallelism"].as_i64().unwrap_or(1),
            completions: spec["completions"].as_i64(),
            completion_mode: spec["completionMode"].as_str().map(str::to_string),
            depends_on: Vec::new(),
        };
        match self {
            Framework::Job => vec![job(
                &object["spec"],
                JOB_GROUP,
                "/spec/template".into(),
                "spec".into(),
                1,
            )],
            Framework::JobSet => object["spec"]["replicatedJobs"]
                .as_array()
                .into_iter()
                .flatten()
                .enumerate()
                .map(|(i, r)| PodSet {
                    depends_on: r["dependsOn"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|d| Dependency {
                            name: d["name"].as_str().unwrap_or_default().to_string(),
                            status: d["status"].as_str().unwrap_or_default().to_string(),
                        })
                        .collect(),
                    ..job(
                        &r["template"]["spec"],
                        r["name"].as_str().unwrap_or_default(),
                        format!("/spec/replicatedJobs/{i}/template/spec/template"),
                        format!("spec.replicatedJobs[{i}]"),
                        r["replicas"].as_i64().unwrap_or(1),
                    )
                })
                .collect(),
        }
    }

    /// Whether the object makes no pods at all (each of its Jobs has `parallelism: 0` or
    /// `completions: 0`, or none is made): it needs no gang.
    pub fn makes_no_pods(self, object: &Value) -> bool {
        let sets = self.pod_sets(object);
        !sets.is_empty() && sets.iter().all(|s| s.pods() == 0)
    }

    /// The object's Workload name (what the webhook labels its pods with).
    pub fn workload_name(self, object: &Value) -> String {
        let longest = self.pod_sets(object).iter().map(|s| s.group.len()).max().unwrap_or(0);
        names::workload_name(self, object["metadata"]["name"].as_str().unwrap_or_default(), longest)
    }

    pub fn suspended(self, object: &Value) -> bool {
        object["spec"]["suspend"].as_bool() == Some(true)
    }

    /// A merge patch that suspends or resumes the object.
    pub fn suspend_patch(self, suspend: bool) -> Value {
        json!({"spec": {"suspend": suspend}})
    }

    /// How the job ended, from its own status: `Some((true, why))` succeeded,
    /// `Some((false, why))` failed, `None` still going.
    pub fn finished(self, object: &Value) -> Option<(bool, String)> {
        let (done, failed) = match self {
            Framework::JobSet => ("Completed", "Failed"),
            Framework::Job => ("Complete", "Failed"),
        };
        object["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["status"] == "True")
            .find_map(|c| {
                let message = c["message"].as_str().or(c["reason"].as_str()).unwrap_or_default();
                if c["type"] == done {
                    Some((true, format!("the {} completed: {message}", self.kind())))
                } else if c["type"] == failed {
                    Some((false, format!("the {} failed: {message}", self.kind())))
                } else {
                    None
                }
            })
    }
}

/// The controller owner of an object, as (apiVersion, kind, name).
pub fn controller_of(object: &Value) -> Option<(&str, &str, &str)> {
    object["metadata"]["ownerReferences"]
        .as_array()?
        .iter()
        .find(|o| o["controller"] == true)
        .map(|o| {
            (
                o["apiVersion"].as_str().unwrap_or_default(),
                o["kind"].as_str().unwrap_or_default(),
                o["name"].as_str().unwrap_or_default(),
            )
        })
}

/// Whether a labelled object is a gang of its own: a Job that a JobSet made is part of
/// the JobSet's gang (a TrainJob's labels reach both).
pub fn is_gang_root(framework: Framework, object: &Value) -> bool {
    match framework {
        Framework::JobSet => true,
        Framework::Job => !matches!(controller_of(object), Some((_, "JobSet", _))),
    }
}

/// Whether the object carries muster's label with its one value.
pub fn labelled(object: &Value) -> Option<&str> {
    object["metadata"]["labels"][muster_api::labels::ADOPT].as_str()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jobsets_pod_sets_are_its_replicated_jobs() {
        let jobset = json!({"spec": {"replicatedJobs": [
            {"name": "launcher", "template": {"spec": {"template": {}}}},
            {"name": "workers", "replicas": 2, "template": {"spec": {"parallelism": 4, "completions": 4, "template": {}}}},
        ]}});
        let sets = Framework::JobSet.pod_sets(&jobset);
        assert_eq!(sets.len(), 2);
        assert_eq!((sets[0].jobs, sets[0].parallelism), (1, 1));
        assert_eq!(
            (
                sets[1].group.as_str(),
                sets[1].jobs,
                sets[1].parallelism,
                sets[1].completions
            ),
            ("workers", 2, 4, Some(4))
        );
        assert_eq!(sets[1].template, "/spec/replicatedJobs/1/template/spec/template");
    }

    #[test]
    fn the_end_comes_from_the_jobs_own_conditions() {
        let done =
            json!({"status": {"conditions": [{"type": "Complete", "status": "True", "reason": "CompletionsReached"}]}});
        assert_eq!(Framework::Job.finished(&done).map(|f| f.0), Some(true));
        let failed = json!({"status": {"conditions": [{"type": "Failed", "status": "True", "message": "BackoffLimitExceeded"}]}});
        assert_eq!(
            Framework::JobSet.finished(&failed),
            Some((false, "the JobSet failed: BackoffLimitExceeded".into()))
        );
        assert_eq!(Framework::Job.finished(&json!({})), None);
    }

    #[test]
    fn a_jobsets_job_is_not_a_gang_of_its_own() {
        let child = json!({"metadata": {"ownerReferences": [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": "js", "controller": true}]}});
        assert!(!is_gang_root(Framework::Job, &child));
        let cron = json!({"metadata": {"ownerReferences": [{"apiVersion": "batch/v1", "kind": "CronJob", "name": "c", "controller": true}]}});
        assert!(is_gang_root(Framework::Job, &cron));
    }
}
