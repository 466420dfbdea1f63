//! One `admission.k8s.io/v1` AdmissionReview: the request decoded, the framework's
//! [`mutate::admit`] asked, and the answer as a JSON patch.

use base64::Engine as _;
use serde_json::{Value, json};

use crate::frameworks::Framework;
use crate::frameworks::mutate::{self, Operation, Verdict};

/// The response to an AdmissionReview request body; `Err` for a body that is not one.
pub fn respond(body: &[u8]) -> Result<Value, String> {
    let review: Value = serde_json::from_slice(body).map_err(|e| format!("not an AdmissionReview: {e}"))?;
    let request = &review["request"];
    let uid = request["uid"]
        .as_str()
        .ok_or("an AdmissionReview without request.uid")?;
    let kind = &request["kind"];
    let api_version = match kind["group"].as_str().unwrap_or_default() {
        "" => kind["version"].as_str().unwrap_or_default().to_string(),
        group => format!("{group}/{}", kind["version"].as_str().unwrap_or_default()),
    };
    let framework = Framework::of(&api_version, kind["kind"].as_str().unwrap_or_default());
    let operation = match request["operation"].as_str() {
        Some("CREATE") => Some(Operation::Create),
        Some("UPDATE") => Some(Operation::Update),
        _ => None,
    };
    let (Some(framework), Some(operation)) = (framework, operation) else {
        // Not ours (a misconfigured webhook): let it through unchanged.
        return Ok(allowed(uid, None));
    };
    let object = &request["object"];
    let old = Some(&request["oldObject"]).filter(|o| o.is_object());
    let response = match mutate::admit(framework, operation, object, old, &mutate::name_suffix(uid)) {
        Verdict::Admit(changed) => {
            let patch = json_patch::diff(object, &changed);
            if patch.0.is_empty() {
                allowed(uid, None)
            } else {
                allowed(uid, Some(serde_json::to_vec(&patch).map_err(|e| e.to_string())?))
            }
        }
        Verdict::Refuse(message) => json!({
            "uid": uid,
            "allowed": false,
            "status": {"code": 422, "reason": "Invalid", "message": message},
        }),
    };
    Ok(json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": response,
    }))
}

fn allowed(uid: &str, patch: Option<Vec<u8>>) -> Value {
    let mut response = json!({"uid": uid, "allowed": true});
    if let Some(patch) = patch {
        response["patchType"] = json!("JSONPatch");
        response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(patch));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_labelled_job_gets_a_patch_and_an_unlabelled_one_none() {
        let review = |labels: Value| {
            json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
                "uid": "u1", "operation": "CREATE",
                "kind": {"group": "batch", "version": "v1", "kind": "Job"},
                "object": {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "labels": labels},
                           "spec": {"template": {"spec": {"containers": []}}}},
            }})
        };
        let answer = respond(&serde_json::to_vec(&review(json!({"muster.dev/gang": "true"}))).unwrap()).unwrap();
        assert_eq!(answer["response"]["uid"], "u1");
        assert_eq!(answer["response"]["allowed"], true);
        let patch = base64::engine::general_purpose::STANDARD
            .decode(answer["response"]["patch"].as_str().unwrap())
            .unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&patch).unwrap();
        let mut object = review(json!({"muster.dev/gang": "true"}))["request"]["object"].clone();
        json_patch::patch(&mut object, &patch).unwrap();
        assert_eq!(
            object["spec"]["template"]["spec"]["schedulingGates"][0]["name"],
            "muster.dev/gang"
        );
        assert_eq!(
            object["spec"]["template"]["metadata"]["labels"]["muster.dev/workload"],
            "job-j"
        );

        let plain = respond(&serde_json::to_vec(&review(json!({}))).unwrap()).unwrap();
        assert!(plain["response"].get("patch").is_none());
        assert!(respond(b"{}").is_err());
    }
}
