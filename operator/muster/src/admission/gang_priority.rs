//! A gang's priority, bounded by its pods'. The API server's Priority admission (and a
//! ResourceQuota scoped to PriorityClasses) governs who may run pods of which priority;
//! a Workload is created by whoever may create Workloads, and muster creates or joins
//! its pods. So a gang is worth no more than the lowest priority the API server gave one
//! of its pods (`spec.priority`): a Workload naming a higher class than its pods would
//! let a tenant jump the queue and preempt others with pods of default priority.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use muster_api::labels;
use muster_api::v1alpha1::Workload;

/// The PriorityClass named `name`, or, with no name, the one marked global default, as
/// the API server's Priority admission resolves a pod's.
pub fn class<'c>(classes: &'c [Arc<PriorityClass>], name: Option<&str>) -> Option<&'c Arc<PriorityClass>> {
    match name {
        Some(name) => classes.iter().find(|p| p.metadata.name.as_deref() == Some(name)),
        None => classes.iter().find(|p| p.global_default == Some(true)),
    }
}

/// A class's value; no class, 0.
pub fn value(class: Option<&Arc<PriorityClass>>) -> i32 {
    class.map_or(0, |p| p.value.unwrap_or(0))
}

/// The pods whose priority bounds the gang's: live pods of its groups (a pod with the
/// Workload's label alone is not, nor a failed or leaving pod of an earlier attempt).
pub fn members<'a>(workload: &'a Workload, pods: impl IntoIterator<Item = &'a Pod>) -> impl Iterator<Item = &'a Pod> {
    pods.into_iter().filter(move |p| {
        let group = p.metadata.labels.as_ref().and_then(|l| l.get(labels::POD_GROUP));
        let failed = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed");
        group.is_some_and(|g| workload.spec.pod_groups.iter().any(|d| &d.name == g))
            && p.metadata.deletion_timestamp.is_none()
            && !failed
    })
}

/// The class a Workload names is worth more than one of its pods.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "spec.priorityClassName {class} (priority {value}) is above the priority of member pod {pod} ({pod_priority}, as \
     the API server admitted it): a gang's priority cannot exceed its pods'; give the pods that class (their \
     template's priorityClassName) or name a class of at most {pod_priority}"
)]
pub struct AboveMembers {
    pub class: String,
    pub value: i32,
    pub pod: String,
    pub pod_priority: i32,
}

/// The lowest `spec.priority` among `pods`, with the pod that has it. A pod the API
/// server admitted always has one; one without (a cache of another source) counts as 0.
pub fn lowest<'a>(pods: impl IntoIterator<Item = &'a Pod>) -> Option<(i32, &'a str)> {
    pods.into_iter()
        .map(|p| {
            let priority = p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
            (priority, p.metadata.name.as_deref().unwrap_or_default())
        })
        // The same pod every time, whatever the cache's order: the message stays put.
        .min()
}

/// The gang's priority: its class's `value` (the default class's where it names none),
/// never above the lowest of its pods'. A Workload that names a class above its pods is
/// refused ([`AboveMembers`]); one that names none takes its pods' priority (the
/// default class may have changed since they were admitted).
pub fn of_gang(class: Option<(&str, i32)>, default: i32, members: Option<(i32, &str)>) -> Result<i32, AboveMembers> {
    match (class, members) {
        (Some((class, value)), Some((pod_priority, pod))) if value > pod_priority => Err(AboveMembers {
            class: class.to_string(),
            value,
            pod: pod.to_string(),
            pod_priority,
        }),
        (Some((_, value)), _) => Ok(value),
        (None, Some((pod_priority, _))) => Ok(pod_priority),
        (None, None) => Ok(default),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, priority: Option<i32>) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"containers": [], "priority": priority}}))
            .unwrap()
    }

    #[test]
    fn a_class_is_resolved_by_name_or_else_as_the_global_default() {
        let class = |name: &str, value: i32, default: bool| -> Arc<PriorityClass> {
            Arc::new(
                serde_json::from_value(json!({"metadata": {"name": name}, "value": value, "globalDefault": default}))
                    .unwrap(),
            )
        };
        let classes = [class("high", 1000, false), class("normal", 10, true)];
        assert_eq!(value(class_of(&classes, Some("high"))), 1000);
        assert_eq!(value(class_of(&classes, None)), 10, "the global default");
        assert_eq!(
            class_of(&classes, Some("gone")),
            None,
            "a missing class is not the default"
        );
        assert_eq!(value(class_of(&classes[..1], None)), 0, "no default: 0");
    }

    fn class_of<'c>(classes: &'c [Arc<PriorityClass>], name: Option<&str>) -> Option<&'c Arc<PriorityClass>> {
        super::class(classes, name)
    }

    #[test]
    fn a_class_above_a_member_pod_is_refused_naming_the_field() {
        let pods = [pod("w-0", Some(1000)), pod("w-1", Some(0))];
        let e = of_gang(Some(("system-cluster-critical", 2_000_000_000)), 0, lowest(&pods)).unwrap_err();
        assert_eq!(e.pod, "w-1");
        assert_eq!(e.pod_priority, 0);
        let message = e.to_string();
        assert!(
            message.starts_with("spec.priorityClassName system-cluster-critical"),
            "{message}"
        );
    }

    #[test]
    fn a_class_at_or_below_its_pods_is_the_gang_s_priority() {
        let pods = [pod("w-0", Some(1000)), pod("w-1", Some(1000))];
        assert_eq!(of_gang(Some(("high", 1000)), 0, lowest(&pods)), Ok(1000));
        assert_eq!(of_gang(Some(("low", 10)), 0, lowest(&pods)), Ok(10));
    }

    #[test]
    fn without_pods_yet_the_class_stands() {
        // muster creates a template group's pods with the Workload's class: the API
        // server then decides whether they may have it.
        assert_eq!(of_gang(Some(("high", 1000)), 5, None), Ok(1000));
        assert_eq!(of_gang(None, 5, None), Ok(5));
    }

    #[test]
    fn without_a_class_the_gang_takes_its_pods_priority_not_todays_default() {
        let pods = [pod("w-0", Some(0)), pod("w-1", None)];
        assert_eq!(of_gang(None, 1000, lowest(&pods)), Ok(0));
        let pods = [pod("w-0", Some(7))];
        assert_eq!(of_gang(None, 1000, lowest(&pods)), Ok(7));
    }

    #[test]
    fn only_live_pods_of_the_gang_s_groups_bound_it() {
        let workload: Workload = serde_json::from_value(json!({
            "apiVersion": "muster.dev/v1alpha1", "kind": "Workload", "metadata": {"name": "w"},
            "spec": {"podGroups": [{"name": "workers", "replicas": 1}]},
        }))
        .unwrap();
        let labelled = |name: &str, group: &str, priority: i32| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": name, "labels": {labels::WORKLOAD: "w", labels::POD_GROUP: group}},
                "spec": {"containers": [], "priority": priority},
            }))
            .unwrap()
        };
        let member = labelled("w-0", "workers", 1000);
        let stranger = labelled("planted", "elsewhere", 0);
        let mut failed = labelled("w-0-old", "workers", 0);
        failed.status = Some(serde_json::from_value(json!({"phase": "Failed"})).unwrap());
        let mut leaving = labelled("w-0-leaving", "workers", 0);
        leaving.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
        let pods = [member, stranger, failed, leaving];
        assert_eq!(lowest(members(&workload, &pods)), Some((1000, "w-0")));
    }
}
