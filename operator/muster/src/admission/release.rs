//! Releasing a gang's pod: in one update, pin it to its planned node (a required node
//! affinity at least as strict as its claims' node selectors, so kube-scheduler never
//! undoes the allocation), tolerate the fence taint when fencing by taint, and remove
//! muster's scheduling gate. While a pod is gated, Kubernetes allows exactly these changes.

use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod, PodSchedulingGate, Toleration,
};
use kube::api::{Api, Patch, PatchParams};
use muster_api::labels;
use serde_json::json;

use crate::admission::fencing::Fencing;

/// `pod` as it was before muster released it: without the pin to its node and the
/// fence's toleration the release added. A gated pod is returned as it is. Members of a
/// group another controller made are compared, and planned, in this form, so that a
/// replacement still at the gate is alike the released pods of its group.
pub fn as_before_release(pod: &Pod) -> Pod {
    let mut pod = pod.clone();
    let Some(spec) = pod.spec.as_mut() else {
        return pod;
    };
    let gated = spec
        .scheduling_gates
        .iter()
        .flatten()
        .any(|g| g.name == labels::GANG_GATE);
    if gated {
        return pod;
    }
    let is_pin = |r: &NodeSelectorRequirement| {
        r.key == "metadata.name" && r.operator == "In" && r.values.as_ref().is_some_and(|v| v.len() == 1)
    };
    if let Some(affinity) = spec.affinity.as_mut() {
        if let Some(node_affinity) = affinity.node_affinity.as_mut() {
            if let Some(required) = node_affinity
                .required_during_scheduling_ignored_during_execution
                .as_mut()
            {
                // The release appended its pin last to every term: a pin of the
                // pod's own before it stays.
                for term in &mut required.node_selector_terms {
                    if let Some(fields) = term.match_fields.as_mut() {
                        if fields.last().is_some_and(is_pin) {
                            fields.pop();
                        }
                        if fields.is_empty() {
                            term.match_fields = None;
                        }
                    }
                }
                required
                    .node_selector_terms
                    .retain(|t| t.match_expressions.is_some() || t.match_fields.is_some());
                if required.node_selector_terms.is_empty() {
                    node_affinity.required_during_scheduling_ignored_during_execution = None;
                }
            }
            if node_affinity
                .required_during_scheduling_ignored_during_execution
                .is_none()
                && node_affinity
                    .preferred_during_scheduling_ignored_during_execution
                    .is_none()
            {
                affinity.node_affinity = None;
            }
        }
        if affinity.node_affinity.is_none() && affinity.pod_affinity.is_none() && affinity.pod_anti_affinity.is_none() {
            spec.affinity = None;
        }
    }
    if let Some(tolerations) = spec.tolerations.as_mut() {
        tolerations.retain(|t| t.key.as_deref() != Some(labels::FENCE_TAINT));
        if tolerations.is_empty() {
            spec.tolerations = None;
        }
    }
    pod
}

/// The pod's spec changes that release it to `node`, or `None` if it is released
/// already.
pub fn release_patch(pod: &Pod, node: &str, fencing: Fencing) -> Option<serde_json::Value> {
    let spec = pod.spec.as_ref()?;
    let gates: Vec<PodSchedulingGate> = spec.scheduling_gates.clone().unwrap_or_default();
    if !gates.iter().any(|g| g.name == labels::GANG_GATE) {
        return None;
    }
    let remaining: Vec<PodSchedulingGate> = gates.into_iter().filter(|g| g.name != labels::GANG_GATE).collect();
    let pin = NodeSelectorRequirement {
        key: "metadata.name".into(),
        operator: "In".into(),
        values: Some(vec![node.to_string()]),
    };
    let mut affinity: Affinity = spec.affinity.clone().unwrap_or_default();
    let node_affinity = affinity.node_affinity.get_or_insert_with(NodeAffinity::default);
    let required = node_affinity
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_with(|| NodeSelector {
            node_selector_terms: vec![],
        });
    if required.node_selector_terms.is_empty() {
        required.node_selector_terms.push(NodeSelectorTerm {
            match_expressions: None,
            match_fields: Some(vec![pin]),
        });
    } else {
        // Only requirements may be added to existing terms of a gated pod.
        for term in &mut required.node_selector_terms {
            term.match_fields.get_or_insert_with(Vec::new).push(pin.clone());
        }
    }
    let mut tolerations: Vec<Toleration> = spec.tolerations.clone().unwrap_or_default();
    if fencing.tolerates_node_fence()
        && !tolerations
            .iter()
            .any(|t| t.key.as_deref() == Some(labels::FENCE_TAINT))
    {
        tolerations.push(Toleration {
            key: Some(labels::FENCE_TAINT.into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Toleration::default()
        });
    }
    Some(json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": pod.metadata.resource_version},
        {"op": "replace", "path": "/spec/schedulingGates", "value": remaining},
        {"op": "add", "path": "/spec/affinity", "value": affinity},
        {"op": "add", "path": "/spec/tolerations", "value": tolerations},
        // Never another pod made under the same name.
        {"op": "test", "path": "/metadata/uid", "value": pod.metadata.uid},
    ]))
}

/// Releases pod `name` — the one with `uid`, never another made under the same name —
/// to `node`, starting from `cached` when given; a stale copy is read again. Returns the
/// pod as released (`None`: it was released already). `leading` runs between each read
/// and the write conditioned on it, and must not return if this process lost its Lease.
pub async fn release(
    api: &Api<Pod>,
    name: &str,
    uid: &str,
    node: &str,
    cached: Option<&Pod>,
    fencing: Fencing,
    leading: &(dyn Fn() + Sync),
) -> Result<Option<Pod>, kube::Error> {
    let mut current = match cached {
        Some(pod) => pod.clone(),
        None => api.get(name).await?,
    };
    for _ in 0..5 {
        if current.metadata.uid.as_deref() != Some(uid) {
            return Err(kube::Error::Api(Box::new(
                kube::core::Status::failure(
                    &format!("pod {name} was made again; not releasing the new one"),
                    "Conflict",
                )
                .with_code(409),
            )));
        }
        let Some(patch) = release_patch(&current, node, fencing) else {
            return Ok(None);
        };
        let patch: json_patch::Patch = serde_json::from_value(patch).map_err(kube::Error::SerdeError)?;
        leading();
        match api
            .patch(name, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
        {
            Ok(pod) => return Ok(Some(pod)),
            // The test of resourceVersion failed (422) or a conflict (409): read again.
            Err(kube::Error::Api(status)) if status.code == 422 || status.code == 409 => {
                current = api.get(name).await?
            }
            Err(e) => return Err(e),
        }
    }
    Err(kube::Error::Api(Box::new(
        kube::core::Status::failure(&format!("pod {name} kept changing while being released"), "Conflict")
            .with_code(409),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p", "uid": "u-1", "resourceVersion": "7"}, "spec": spec}))
            .unwrap()
    }

    /// `pod` with the release patch's replacements applied (gates, affinity, tolerations).
    fn released(p: &Pod, node: &str) -> Pod {
        let patch = release_patch(p, node, Fencing::Taint).unwrap();
        let mut value = serde_json::to_value(p).unwrap();
        for op in patch.as_array().unwrap().iter().filter(|o| o["op"] != "test") {
            let field = op["path"].as_str().unwrap().trim_start_matches("/spec/");
            value["spec"][field] = op["value"].clone();
        }
        value["spec"]["schedulingGates"] = json!(null);
        serde_json::from_value(value).unwrap()
    }

    /// Issue 20: a replacement at the gate is alike the released pods of its group once
    /// the release's pin and toleration are taken off them; a gated pod is left as it is.
    #[test]
    fn a_released_pod_seen_as_before_its_release_is_alike_its_gated_replacement() {
        for spec in [
            json!({"containers": [], "schedulingGates": [{"name": labels::GANG_GATE}]}),
            json!({
                "containers": [],
                "schedulingGates": [{"name": labels::GANG_GATE}],
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
                ]}}},
            }),
            // A pin of the pod's own stays.
            json!({
                "containers": [],
                "schedulingGates": [{"name": labels::GANG_GATE}],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]},
                ]}}},
            }),
        ] {
            let gated = pod(spec);
            let out = released(&gated, "node-1");
            assert_ne!(
                out.spec.as_ref().unwrap().affinity,
                gated.spec.as_ref().unwrap().affinity
            );
            let mut expected = gated.spec.clone().unwrap();
            expected.scheduling_gates = None;
            assert_eq!(as_before_release(&out).spec.unwrap(), expected);
            assert_eq!(as_before_release(&gated), gated);
        }
    }

    #[test]
    fn pins_ungates_and_tolerates_in_one_patch() {
        let p = pod(json!({"containers": [], "schedulingGates": [{"name": labels::GANG_GATE}, {"name": "other"}]}));
        let patch = release_patch(&p, "node-1", Fencing::Taint).unwrap();
        assert_eq!(
            patch[0],
            json!({"op": "test", "path": "/metadata/resourceVersion", "value": "7"})
        );
        assert_eq!(patch[1]["value"], json!([{"name": "other"}]));
        let terms =
            &patch[2]["value"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"];
        assert_eq!(
            terms,
            &json!([{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}])
        );
        assert_eq!(patch[3]["value"][0]["key"], labels::FENCE_TAINT);
        assert_eq!(patch[4], json!({"op": "test", "path": "/metadata/uid", "value": "u-1"}));
    }

    #[test]
    fn adds_the_pin_to_every_existing_term() {
        let p = pod(json!({
            "containers": [],
            "schedulingGates": [{"name": labels::GANG_GATE}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
                {"matchExpressions": [{"key": "b", "operator": "Exists"}]},
            ]}}},
        }));
        let patch = release_patch(&p, "n", Fencing::Taint).unwrap();
        let terms =
            patch[2]["value"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
                .as_array()
                .unwrap();
        assert_eq!(terms.len(), 2);
        for term in terms {
            assert_eq!(term["matchFields"][0]["values"], json!(["n"]));
            assert!(term["matchExpressions"].is_array(), "existing requirements stay");
        }
    }

    #[test]
    fn without_a_fence_no_toleration_is_added() {
        let p = pod(json!({
            "containers": [],
            "schedulingGates": [{"name": labels::GANG_GATE}],
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
        }));
        let patch = release_patch(&p, "n", Fencing::None).unwrap();
        assert_eq!(patch[3]["value"], json!([{"key": "gpu", "operator": "Exists"}]));
        let fenced = release_patch(&p, "n", Fencing::Taint).unwrap();
        assert_eq!(fenced[3]["value"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn released_pods_are_left_alone() {
        let p = pod(json!({"containers": [], "schedulingGates": []}));
        assert!(release_patch(&p, "n", Fencing::Taint).is_none());
    }
}
