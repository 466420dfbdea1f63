//! Kubernetes operations several parts of muster share: reading labels, telling a gone
//! object from a failure, and adding or removing a finalizer without clobbering others'.

use std::fmt::Debug;

use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

/// The value of label `key` on `object`.
pub fn label<'a, K: Resource>(object: &'a K, key: &str) -> Option<&'a str> {
    object.meta().labels.as_ref()?.get(key).map(String::as_str)
}

/// The object does not exist (any more).
pub fn is_not_found(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(s) if s.code == 404)
}

/// A precondition failed: the object changed since it was read (resourceVersion), or
/// was made again under the same name (uid).
pub fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(s) if s.code == 409)
}

/// The result, with a missing object as `None`.
pub fn found<T>(result: Result<T, kube::Error>) -> Result<Option<T>, kube::Error> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Success, where a missing object counts as done (a delete, or a write to an object
/// whose removal makes the write moot).
pub fn done_if_gone<T>(result: Result<T, kube::Error>) -> Result<(), kube::Error> {
    found(result).map(drop)
}

/// Success, where a missing object or a failed precondition counts as done: the object
/// is gone, or changed meanwhile and is looked at again from a fresh read.
pub fn done_if_gone_or_changed<T>(result: Result<T, kube::Error>) -> Result<(), kube::Error> {
    match result {
        Err(e) if is_conflict(&e) => Ok(()),
        other => done_if_gone(other),
    }
}

/// Adds `finalizer` to `object` unless it has it, conditional on the version read.
/// Returns the object as it is now.
pub async fn add_finalizer<K>(api: &Api<K>, object: K, finalizer: &str) -> Result<K, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Serialize + Debug,
{
    if object.finalizers().iter().any(|f| f == finalizer) {
        return Ok(object);
    }
    let mut finalizers = object.finalizers().to_vec();
    finalizers.push(finalizer.to_string());
    let patch = json!({"metadata": {"finalizers": finalizers, "resourceVersion": object.resource_version()}});
    api.patch(&object.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
        .await
}

/// Removes `finalizer` from `object`, guarded by tests of the object's uid and of the
/// finalizer's position in the list: finalizers others add or remove meanwhile are kept,
/// and an object made again under the same name is left alone (the failed test is a 422).
/// A missing object counts as done.
pub async fn remove_finalizer<K>(api: &Api<K>, object: &K, finalizer: &str) -> Result<(), kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let Some(patch) = finalizer_removal(object, finalizer) else {
        return Ok(());
    };
    let patch: json_patch::Patch = serde_json::from_value(patch).map_err(kube::Error::SerdeError)?;
    done_if_gone(
        api.patch(&object.name_any(), &PatchParams::default(), &Patch::Json::<()>(patch))
            .await,
    )
}

/// The JSON patch that removes `finalizer` from `object` as read; `None` if it has none.
fn finalizer_removal<K: Resource>(object: &K, finalizer: &str) -> Option<serde_json::Value> {
    let position = object.finalizers().iter().position(|f| f == finalizer)?;
    let path = format!("/metadata/finalizers/{position}");
    let mut operations = Vec::new();
    if let Some(uid) = object.uid() {
        operations.push(json!({"op": "test", "path": "/metadata/uid", "value": uid}));
    }
    operations.push(json!({"op": "test", "path": path, "value": finalizer}));
    operations.push(json!({"op": "remove", "path": path}));
    Some(serde_json::Value::Array(operations))
}

/// A JSON patch's test failed: the object is not as the patch was decided on.
pub fn is_test_failed(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(s) if s.code == 422)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(kube::core::Status::failure("x", "Reason").with_code(code).boxed())
    }

    #[test]
    fn missing_objects_and_failed_preconditions_are_told_apart_from_failures() {
        assert_eq!(found(Err::<(), _>(api_error(404))).unwrap(), None);
        assert_eq!(found(Ok(7)).unwrap(), Some(7));
        assert!(found(Err::<(), _>(api_error(409))).is_err());
        assert!(done_if_gone(Err::<(), _>(api_error(404))).is_ok());
        assert!(done_if_gone(Err::<(), _>(api_error(409))).is_err());
        assert!(done_if_gone_or_changed(Err::<(), _>(api_error(409))).is_ok());
        assert!(done_if_gone_or_changed(Err::<(), _>(api_error(500))).is_err());
    }

    #[test]
    fn a_finalizer_is_removed_only_from_the_object_read_and_at_its_place() {
        let pod: Pod = serde_json::from_value(json!({"metadata": {
            "name": "p", "uid": "u1", "finalizers": ["other", "ours"],
        }}))
        .unwrap();
        assert_eq!(
            finalizer_removal(&pod, "ours"),
            Some(json!([
                {"op": "test", "path": "/metadata/uid", "value": "u1"},
                {"op": "test", "path": "/metadata/finalizers/1", "value": "ours"},
                {"op": "remove", "path": "/metadata/finalizers/1"},
            ]))
        );
        assert_eq!(finalizer_removal(&pod, "absent"), None);
    }

    #[test]
    fn labels_are_read_from_metadata() {
        let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "p", "labels": {"a": "1"}}})).unwrap();
        assert_eq!(label(&pod, "a"), Some("1"));
        assert_eq!(label(&pod, "b"), None);
        assert_eq!(label(&Pod::default(), "a"), None);
    }
}
