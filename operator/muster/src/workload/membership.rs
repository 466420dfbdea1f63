//! Which pods make up a gang's groups, in which order, and which of them are its core
//! (the first `minCount` of each group). muster's own pods carry their index as a label;
//! pods another controller made for a template-less group (a Job's, for example) carry
//! a Job completion index or none, and are ordered by name after the indexed ones.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use muster_api::labels;
use muster_api::v1alpha1::{PodGroup, Workload};

use crate::frameworks::JOBSET_UID;
use crate::frameworks::jobs::JobOwner;
use crate::kube_ops::label;

/// Index of an Indexed Job's pod (label since Kubernetes 1.28, annotation before).
pub const JOB_COMPLETION_INDEX: &str = "batch.kubernetes.io/job-completion-index";

/// The gang's current attempt: how many times it was restarted as a unit. Its pods
/// carry it as a label, and their rendezvous environment says it.
pub fn attempt(workload: &Workload) -> i32 {
    workload.status.as_ref().map_or(0, |s| s.restarts)
}

/// Whether `pod` succeeded.
pub fn succeeded(pod: &Pod) -> bool {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded")
}

/// Whether `pod` belongs to attempt `attempt`. A pod without the label (one another
/// controller made) belongs to every attempt.
pub fn of_attempt(pod: &Pod, attempt: i32) -> bool {
    label(pod, labels::ATTEMPT).is_none_or(|a| a.parse() == Ok(attempt))
}

/// The pod's index within its group, where it carries one.
pub fn pod_index(pod: &Pod) -> Option<i32> {
    let annotation = || {
        pod.metadata
            .annotations
            .as_ref()?
            .get(JOB_COMPLETION_INDEX)
            .map(String::as_str)
    };
    label(pod, labels::POD_INDEX)
        .or_else(|| label(pod, JOB_COMPLETION_INDEX))
        .or_else(annotation)
        .and_then(|i| i.parse().ok())
}

/// The group a pod belongs to, from its label.
pub fn group_of<'w>(workload: &'w Workload, pod: &Pod) -> Option<&'w PodGroup> {
    let name = label(pod, labels::POD_GROUP)?;
    workload.spec.pod_groups.iter().find(|g| g.name == name)
}

/// Whether losing this pod breaks the gang: it is among the first `minCount` of its
/// group. A pod without an index cannot be told apart from the core, so it counts as core.
pub fn is_core(workload: &Workload, pod: &Pod) -> bool {
    let Some(group) = group_of(workload, pod) else {
        return true;
    };
    let index = if group.template.is_some() {
        pod_index(pod)
    } else {
        member_index(pod, group)
    };
    index.is_none_or(|i| i < group.min_count())
}

/// JobSet's label on its Jobs and their pods: the Job's index within its replicated job.
pub const JOBSET_JOB_INDEX: &str = "jobset.sigs.k8s.io/job-index";

/// A member's index within template-less group `group`: its completion index, offset by
/// its Job's index where the group is made of several Jobs (`members.podsPerJob`).
pub fn member_index(pod: &Pod, group: &PodGroup) -> Option<i32> {
    let index = pod_index(pod)?;
    match group.members.as_ref().and_then(|m| m.pods_per_job) {
        Some(per_job) => {
            let job: i32 = label(pod, JOBSET_JOB_INDEX)?.parse().ok()?;
            job.checked_mul(per_job)?.checked_add(index)
        }
        None => Some(index),
    }
}

/// The label the Job controller puts on its pods: the uid of the Job that made them.
pub const JOB_CONTROLLER_UID: &str = "batch.kubernetes.io/controller-uid";

/// Why a pod labelled for a template-less group is not one of its members.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub why: String,
    /// False while the refusal may only mean that the cache of Jobs has not seen the
    /// pod's Job yet: then it is not told (it may be a member in a moment).
    pub settled: bool,
}

impl Refusal {
    fn settled(why: impl Into<String>) -> Self {
        Refusal {
            why: why.into(),
            settled: true,
        }
    }
}

/// How a pod stands with a template-less group.
#[derive(Debug, PartialEq, Eq)]
enum Standing {
    /// A member; `verified` when its controller is known to be the group's (preferred
    /// over an older pod of the same index that is not).
    Member {
        verified: bool,
    },
    Refused(Refusal),
}

/// What the cache of Jobs says of a Job (namespace, name, uid); `None`: no cache.
type JobLookup<'a> = &'a dyn Fn(&str, &str, &str) -> Option<JobOwner>;

fn cached_job(namespace: &str, name: &str, uid: &str) -> Option<JobOwner> {
    crate::frameworks::jobs::owner_of_job(namespace, name, uid)
}

/// Why a pod labelled for template-less group `group` may not join it, if it may not:
/// a member is controlled by some object (a bare pod never joins), by the one the group
/// names if it names one, and carries the group's labels. A member of a JobSet's group
/// (its members name the JobSet's uid) is controlled by a Job of that JobSet.
pub fn refusal(pod: &Pod, group: &PodGroup) -> Option<Refusal> {
    match standing(pod, group, &cached_job) {
        Standing::Member { .. } => None,
        Standing::Refused(refusal) => Some(refusal),
    }
}

fn standing(pod: &Pod, group: &PodGroup, jobs: JobLookup<'_>) -> Standing {
    let controller = pod
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true));
    let Some(controller) = controller else {
        return Standing::Refused(Refusal::settled("it has no controller (a bare pod never joins a gang)"));
    };
    let Some(members) = group.members.as_ref() else {
        return Standing::Member { verified: false };
    };
    if let Some(uid) = &members.controller_uid
        && &controller.uid != uid
    {
        return Standing::Refused(Refusal::settled(format!(
            "its controller {} {} is not the group's",
            controller.kind, controller.name
        )));
    }
    if let Some((key, value)) = members
        .match_labels
        .iter()
        .find(|(k, v)| label(pod, k) != Some(v.as_str()))
    {
        return Standing::Refused(Refusal::settled(format!("it lacks the label {key}={value}")));
    }
    if members.pods_per_job.is_some() && member_index(pod, group).is_none() {
        return Standing::Refused(Refusal::settled(format!(
            "it lacks the labels {JOBSET_JOB_INDEX} and {JOB_COMPLETION_INDEX}"
        )));
    }
    let Some(jobset) = members.match_labels.get(JOBSET_UID) else {
        return Standing::Member {
            verified: members.controller_uid.is_some(),
        };
    };
    if controller.kind != "Job" || controller.api_version != "batch/v1" {
        return Standing::Refused(Refusal::settled(format!(
            "its controller {} {} is not a Job of the JobSet",
            controller.kind, controller.name
        )));
    }
    if label(pod, JOB_CONTROLLER_UID).is_some_and(|uid| uid != controller.uid) {
        return Standing::Refused(Refusal::settled(format!(
            "its label {JOB_CONTROLLER_UID} does not name its controller Job {}",
            controller.name
        )));
    }
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    match jobs(namespace, &controller.name, &controller.uid) {
        None => Standing::Member { verified: false },
        Some(JobOwner::ControlledBy(owner)) if &owner == jobset => Standing::Member { verified: true },
        Some(JobOwner::ControlledBy(_) | JobOwner::Uncontrolled) => Standing::Refused(Refusal::settled(format!(
            "its controller Job {} is not one of the JobSet's",
            controller.name
        ))),
        Some(JobOwner::Unknown) => Standing::Refused(Refusal {
            why: format!(
                "its controller Job {} (uid {}) does not exist",
                controller.name, controller.uid
            ),
            settled: false,
        }),
    }
}

/// The pods labelled for template-less group `group` that may not join it, each with
/// why: not the group's (see [`refusal`]), or a second pod of an index a member has.
pub fn refused<'p>(pods: &'p [Arc<Pod>], group: &PodGroup) -> Vec<(&'p Pod, Refusal)> {
    let (_, refused) = sort_members(pods, group, &cached_job);
    refused
}

/// The pods another controller made for template-less group `group`, in gang order
/// (by index; of one index a verified pod before others, then the oldest, then by
/// name), at most `replicas` of them; pods being deleted or failed (their controller
/// replaces them) are not members, nor are pods [`refused`].
pub fn external_members<'p>(pods: &'p [Arc<Pod>], group: &PodGroup) -> Vec<&'p Pod> {
    let (mut members, _) = sort_members(pods, group, &cached_job);
    members.truncate(usize::try_from(group.replicas).unwrap_or(0));
    members
}

/// How long a refusal that may be the cache's lag waits before it is told.
const UNSETTLED_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// The pods labelled for the Workload's template-less groups that are not members and
/// should be told so, each with why: settled refusals, and unsettled ones of pods older
/// than a minute (a Job the cache still does not show by then is not coming).
pub fn reported_refusals<'p>(workload: &Workload, pods: &'p [Arc<Pod>]) -> Vec<(&'p Pod, String)> {
    let now = k8s_openapi::jiff::Timestamp::now();
    let old_enough = |pod: &Pod| {
        pod.metadata
            .creation_timestamp
            .as_ref()
            .is_some_and(|t| now.duration_since(t.0).unsigned_abs() > UNSETTLED_FOR)
    };
    workload
        .spec
        .pod_groups
        .iter()
        .filter(|g| g.template.is_none())
        .flat_map(|g| refused(pods, g))
        .filter(|(pod, refusal)| refusal.settled || old_enough(pod))
        .map(|(pod, refusal)| (pod, refusal.why))
        .collect()
}

#[allow(clippy::type_complexity)]
fn sort_members<'p>(
    pods: &'p [Arc<Pod>],
    group: &PodGroup,
    jobs: JobLookup<'_>,
) -> (Vec<&'p Pod>, Vec<(&'p Pod, Refusal)>) {
    let mut refused = Vec::new();
    let mut members: Vec<(&Pod, bool)> = Vec::new();
    for pod in pods
        .iter()
        .map(AsRef::as_ref)
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Failed"))
        .filter(|p| label(*p, labels::POD_GROUP) == Some(group.name.as_str()))
    {
        match standing(pod, group, jobs) {
            Standing::Refused(why) => refused.push((pod, why)),
            Standing::Member { verified } => members.push((pod, verified)),
        }
    }
    // Of one index, a pod whose controller is verified, then the oldest: a later pod (a
    // stray one, or a second controller's) cannot displace a member, nor can an older
    // pod that merely carries the labels displace a verified one.
    members.sort_by_key(|(p, verified)| {
        let index = member_index(p, group);
        (
            index.is_none(),
            index,
            !verified,
            p.metadata.creation_timestamp.as_ref().map(|t| t.0),
            p.metadata.name.clone(),
        )
    });
    let mut kept: Vec<&Pod> = Vec::with_capacity(members.len());
    for (pod, _) in members {
        let index = member_index(pod, group);
        match kept.last() {
            Some(last) if index.is_some() && member_index(last, group) == index => {
                refused.push((
                    pod,
                    Refusal::settled(format!("pod {} has its index already", last.name_any())),
                ));
            }
            _ => kept.push(pod),
        }
    }
    (kept, refused)
}

/// The name of the claim kube-controller-manager generated for the pod's claim entry
/// `claim` (from a ResourceClaimTemplate), once it has.
pub fn generated_claim<'p>(pod: &'p Pod, claim: &str) -> Option<&'p str> {
    pod.status
        .as_ref()?
        .resource_claim_statuses
        .as_ref()?
        .iter()
        .find(|s| s.name == claim)?
        .resource_claim_name
        .as_deref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, index: Option<&str>) -> Arc<Pod> {
        owned_pod(name, index, "job-uid", 0)
    }

    /// A pod controlled by the object `controller`, created `age` seconds after the epoch.
    fn owned_pod(name: &str, index: Option<&str>, controller: &str, age: i64) -> Arc<Pod> {
        let mut labels = json!({"muster.dev/workload": "w", "muster.dev/pod-group": "workers"});
        if let Some(i) = index {
            labels[JOB_COMPLETION_INDEX] = json!(i);
        }
        let created = k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + age).unwrap();
        Arc::new(
            serde_json::from_value(json!({"metadata": {
                "name": name,
                "labels": labels,
                "creationTimestamp": created.to_string(),
                "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "job", "uid": controller, "controller": true}],
            }}))
            .unwrap(),
        )
    }

    fn workload() -> Workload {
        serde_json::from_value(json!({
            "apiVersion": "muster.dev/v1alpha1", "kind": "Workload", "metadata": {"name": "w"},
            "spec": {"podGroups": [{"name": "workers", "replicas": 3, "minCount": 2}]}
        }))
        .unwrap()
    }

    #[test]
    fn external_pods_are_ordered_by_index_then_name_and_capped_at_replicas() {
        let pods = [
            pod("job-z", None),
            pod("job-b", Some("1")),
            pod("job-a", None),
            pod("job-c", Some("0")),
        ];
        let w = workload();
        let members: Vec<_> = external_members(&pods, &w.spec.pod_groups[0])
            .iter()
            .map(|p| p.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(members, ["job-c", "job-b", "job-a"]);
    }

    #[test]
    fn a_stray_pod_never_displaces_a_member() {
        let mut w = workload();
        let real = owned_pod("job-0-abc", Some("0"), "job-uid", 10);
        let mut bare = (*pod("stray", Some("0"))).clone();
        bare.metadata.owner_references = None;
        let bare = Arc::new(bare);
        // Another controller's pod of the same index, created earlier.
        let other = owned_pod("other-0", Some("0"), "other-uid", 1);
        let later = owned_pod("job-0-late", Some("0"), "job-uid", 20);
        let pods = [bare.clone(), later.clone(), real.clone()];
        let names = |members: Vec<&Pod>| -> Vec<String> { members.iter().map(|p| p.name_any()).collect() };
        // Without a named controller: any controlled pod, the oldest of an index wins.
        assert_eq!(names(external_members(&pods, &w.spec.pod_groups[0])), ["job-0-abc"]);
        let refused: Vec<String> = refused(&pods, &w.spec.pod_groups[0])
            .iter()
            .map(|(p, why)| format!("{}: {}", p.name_any(), why.why))
            .collect();
        assert_eq!(
            refused,
            [
                "stray: it has no controller (a bare pod never joins a gang)",
                "job-0-late: pod job-0-abc has its index already"
            ]
        );
        // With the group's controller named, an older pod of another controller is refused.
        w.spec.pod_groups[0].members = Some(muster_api::v1alpha1::Members {
            controller_uid: Some("job-uid".into()),
            ..Default::default()
        });
        let pods = [other, real];
        assert_eq!(names(external_members(&pods, &w.spec.pod_groups[0])), ["job-0-abc"]);
    }

    #[test]
    fn a_jobset_member_is_a_pod_of_one_of_the_jobsets_jobs_and_preferred_over_an_older_impostor() {
        let mut w = workload();
        w.spec.pod_groups[0].members = Some(muster_api::v1alpha1::Members {
            match_labels: [(JOBSET_UID.to_string(), "js-uid".to_string())].into(),
            pods_per_job: Some(1),
            ..Default::default()
        });
        let group = &w.spec.pod_groups[0];
        let of_jobset = |name: &str, job_uid: &str, age: i64| {
            let mut pod = (*owned_pod(name, Some("0"), job_uid, age)).clone();
            let labels = pod.metadata.labels.get_or_insert_default();
            labels.insert(JOBSET_UID.into(), "js-uid".into());
            labels.insert(JOBSET_JOB_INDEX.into(), "0".into());
            labels.insert(JOB_CONTROLLER_UID.into(), job_uid.into());
            Arc::new(pod)
        };
        // The real Job is the JobSet's; the impostor names a Job nobody made, or another
        // object's Job.
        let jobs = |_: &str, _: &str, uid: &str| -> Option<JobOwner> {
            Some(match uid {
                "real-job" => JobOwner::ControlledBy("js-uid".into()),
                "foreign-job" => JobOwner::ControlledBy("other".into()),
                _ => JobOwner::Unknown,
            })
        };
        let real = of_jobset("js-workers-0-0-abc", "real-job", 10);
        let forged = of_jobset("forged", "fake-job", 1);
        let foreign = of_jobset("foreign", "foreign-job", 2);
        let pods = [forged.clone(), foreign.clone(), real.clone()];
        let (members, refused) = sort_members(&pods, group, &jobs);
        assert_eq!(
            members.iter().map(|p| p.name_any()).collect::<Vec<_>>(),
            ["js-workers-0-0-abc"]
        );
        let why: Vec<(String, bool)> = refused.iter().map(|(p, r)| (p.name_any(), r.settled)).collect();
        assert_eq!(why, [("forged".to_string(), false), ("foreign".to_string(), true)]);
        // An older pod the cache cannot tell apart (no cache) loses to a verified one.
        let unverifiable = |_: &str, _: &str, uid: &str| -> Option<JobOwner> {
            (uid == "real-job").then(|| JobOwner::ControlledBy("js-uid".into()))
        };
        let (members, _) = sort_members(&pods, group, &unverifiable);
        assert_eq!(members[0].name_any(), "js-workers-0-0-abc", "verified over older");
        // A pod whose controller is not a Job at all.
        let mut not_a_job = (*of_jobset("x", "real-job", 0)).clone();
        not_a_job.metadata.owner_references.as_mut().unwrap()[0].kind = "ReplicaSet".into();
        assert!(matches!(standing(&not_a_job, group, &jobs), Standing::Refused(r) if r.why.contains("not a Job")));
    }

    #[test]
    fn a_jobset_members_index_counts_its_jobs() {
        let mut w = workload();
        w.spec.pod_groups[0].members = Some(muster_api::v1alpha1::Members {
            pods_per_job: Some(2),
            ..Default::default()
        });
        let mut pod = (*owned_pod("js-workers-1-1", Some("1"), "job-1", 0)).clone();
        pod.metadata
            .labels
            .get_or_insert_default()
            .insert(JOBSET_JOB_INDEX.into(), "1".into());
        assert_eq!(member_index(&pod, &w.spec.pod_groups[0]), Some(3));
        let unindexed = owned_pod("js-x", Some("1"), "job-1", 0);
        assert!(refusal(&unindexed, &w.spec.pod_groups[0]).is_some());
    }

    #[test]
    fn the_core_is_the_first_min_count_and_unindexed_pods_count_as_core() {
        let w = workload();
        assert!(is_core(&w, &pod("a", Some("1"))));
        assert!(!is_core(&w, &pod("a", Some("2"))));
        assert!(is_core(&w, &pod("a", None)));
    }

    #[test]
    fn a_pod_belongs_to_the_attempt_on_its_label_or_to_every_attempt_without_one() {
        let mut w = workload();
        assert_eq!(attempt(&w), 0);
        w.status = Some(muster_api::WorkloadStatus {
            restarts: 2,
            ..Default::default()
        });
        assert_eq!(attempt(&w), 2);
        let mut labelled = (*pod("a", None)).clone();
        labelled
            .metadata
            .labels
            .get_or_insert_default()
            .insert(labels::ATTEMPT.into(), "2".into());
        assert!(of_attempt(&labelled, 2));
        assert!(!of_attempt(&labelled, 1));
        assert!(of_attempt(&pod("b", None), 1));
    }
}
