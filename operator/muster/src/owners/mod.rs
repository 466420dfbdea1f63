//! The objects whose suspend stops a gang's pods: a Job, a JobSet, a TrainJob. muster
//! requeues a gang of such pods by suspending them, as Kueue evicts a job: their
//! controllers take the pods away without counting a failure against `backoffLimit`,
//! `podFailurePolicy` or JobSet's `maxRestarts`. Once the gang gave every device back,
//! muster resumes them, and the controllers make the pods again behind muster's gate.
//!
//! What muster suspended carries its mark ([`labels::REQUEUED`] and
//! [`labels::REQUEUED_FOR`], written in the same patch as the suspend), which
//! [`watch::Marked`] caches, so that a restarted operator, or a successor, resumes what
//! its predecessor suspended. The decisions are the state machine's
//! (`muster_admission::Owners`); [`writes`] performs them.

pub mod watch;
pub mod writes;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{ApiResource, GroupVersionKind};
use muster_api::labels;
use muster_api::v1alpha1::Workload;

/// JobSet's labels on its Jobs and their pods: the JobSet's uid and name.
pub const JOBSET_UID: &str = "jobset.sigs.k8s.io/jobset-uid";
pub const JOBSET_NAME: &str = "jobset.sigs.k8s.io/jobset-name";

/// A kind of object muster suspends to requeue a gang of its pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OwnerKind {
    Job,
    JobSet,
    /// Trainer makes a JobSet for each TrainJob and applies it again: only the
    /// TrainJob's own `spec.suspend` stops it.
    TrainJob,
}

impl OwnerKind {
    pub const ALL: [OwnerKind; 3] = [OwnerKind::Job, OwnerKind::JobSet, OwnerKind::TrainJob];

    pub fn resource(self) -> ApiResource {
        let (group, version, kind, plural) = match self {
            OwnerKind::Job => ("batch", "v1", "Job", "jobs"),
            OwnerKind::JobSet => ("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets"),
            OwnerKind::TrainJob => ("trainer.kubeflow.org", "v1alpha1", "TrainJob", "trainjobs"),
        };
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
    }

    /// The kind an owner reference names, whatever the version of its group.
    pub fn of_reference(api_version: &str, kind: &str) -> Option<OwnerKind> {
        let group = api_version.split_once('/').map_or("", |(g, _)| g);
        OwnerKind::ALL.into_iter().find(|k| {
            let resource = k.resource();
            resource.kind == kind && resource.group == group
        })
    }
}

/// One object muster may suspend.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Owner {
    pub kind: OwnerKind,
    pub name: String,
    pub uid: String,
}

/// The object that makes `pod` and that muster can suspend: the JobSet of a JobSet's Job
/// (JobSet labels the pods of its Jobs with its name and uid), or the pod's Job. `None`
/// for muster's own pods and for pods of any other controller.
pub fn of_pod(pod: &Pod) -> Option<Owner> {
    let reference = pod.owner_references().iter().find(|o| o.controller == Some(true))?;
    if OwnerKind::of_reference(&reference.api_version, &reference.kind) != Some(OwnerKind::Job) {
        return None;
    }
    let labels = pod.labels();
    if let (Some(name), Some(uid)) = (labels.get(JOBSET_NAME), labels.get(JOBSET_UID)) {
        return Some(Owner {
            kind: OwnerKind::JobSet,
            name: name.clone(),
            uid: uid.clone(),
        });
    }
    Some(Owner {
        kind: OwnerKind::Job,
        name: reference.name.clone(),
        uid: reference.uid.clone(),
    })
}

/// The value of [`labels::REQUEUED_FOR`] for a gang: `<uid>/<name>` of its Workload.
pub fn mark(workload: &Workload) -> String {
    format!("{}/{}", workload.uid().unwrap_or_default(), workload.name_any())
}

/// The Workload name a mark names.
pub fn marked_workload(mark: &str) -> Option<&str> {
    mark.split_once('/').map(|(_, name)| name).filter(|n| !n.is_empty())
}

/// The mark an object carries, if it is suspended for a gang.
pub fn mark_of<K: kube::Resource>(object: &K) -> Option<&str> {
    let meta = object.meta();
    meta.labels.as_ref()?.get(labels::REQUEUED)?;
    meta.annotations.as_ref()?.get(labels::REQUEUED_FOR).map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(owner: serde_json::Value, labels: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p", "labels": labels, "ownerReferences": [owner]}}))
            .unwrap()
    }

    #[test]
    fn a_pods_owner_is_its_jobset_or_its_job_and_nothing_else() {
        let job = json!({"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": "j1", "controller": true});
        assert_eq!(
            of_pod(&pod(job.clone(), json!({}))),
            Some(Owner {
                kind: OwnerKind::Job,
                name: "train".into(),
                uid: "j1".into()
            })
        );
        let of_jobset = pod(job, json!({JOBSET_NAME: "js", JOBSET_UID: "s1"}));
        assert_eq!(
            of_pod(&of_jobset).map(|o| (o.kind, o.uid)),
            Some((OwnerKind::JobSet, "s1".into()))
        );
        let sts = json!({"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "db", "uid": "x", "controller": true});
        assert_eq!(of_pod(&pod(sts, json!({}))), None);
        let workload = json!({"apiVersion": "muster.dev/v1alpha1", "kind": "Workload", "name": "g", "uid": "w", "controller": true});
        assert_eq!(of_pod(&pod(workload, json!({}))), None);
    }

    #[test]
    fn owner_kinds_are_known_by_group_whatever_the_version() {
        assert_eq!(
            OwnerKind::of_reference("trainer.kubeflow.org/v1alpha1", "TrainJob"),
            Some(OwnerKind::TrainJob)
        );
        assert_eq!(
            OwnerKind::of_reference("jobset.x-k8s.io/v1alpha2", "JobSet"),
            Some(OwnerKind::JobSet)
        );
        assert_eq!(OwnerKind::of_reference("batch/v1", "Job"), Some(OwnerKind::Job));
        assert_eq!(OwnerKind::of_reference("example.com/v1", "Job"), None);
        assert_eq!(marked_workload("uid-1/job-train"), Some("job-train"));
        assert_eq!(marked_workload("nonsense"), None);
    }
}
