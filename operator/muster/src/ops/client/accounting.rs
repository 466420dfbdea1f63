//! What muster asks of the API server, counted as RBAC names it: every request by verb
//! and resource (`muster_api_requests_total`), and every refusal or failure by code
//! (`muster_api_errors_total`).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tower::{Layer, Service};

use crate::ops::metrics::{self, ApiErrorLabels, ApiLabels};

/// Counts each request, and each response that is not a success.
#[derive(Clone, Copy, Debug, Default)]
pub struct AccountingLayer;

impl<S> Layer<S> for AccountingLayer {
    type Service = Accounting<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Accounting { inner }
    }
}

#[derive(Clone, Debug)]
pub struct Accounting<S> {
    inner: S,
}

impl<S, B, R> Service<http::Request<B>> for Accounting<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let (verb, resource) = classify(request.method(), request.uri().path(), request.uri().query());
        metrics::get()
            .api_requests
            .get_or_create(&ApiLabels {
                verb,
                resource: resource.clone(),
            })
            .inc();
        let response = self.inner.call(request);
        Box::pin(async move {
            let result = response.await;
            let code = match &result {
                Ok(response) if response.status().is_success() => None,
                Ok(response) => Some(response.status().as_u16().to_string()),
                Err(_) => Some("transport".to_string()),
            };
            if let Some(code) = code {
                metrics::get()
                    .api_errors
                    .get_or_create(&ApiErrorLabels { verb, resource, code })
                    .inc();
            }
            result
        })
    }
}

/// The RBAC verb and resource (with subresource) of an API request, as the API server's
/// authorizer sees it: `GET /api/v1/namespaces/a/pods?watch=true` is `watch pods`.
pub fn classify(method: &http::Method, path: &str, query: Option<&str>) -> (&'static str, String) {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    // /api/v1/... or /apis/<group>/<version>/...
    let (group, rest) = match parts.as_slice() {
        ["api", _version, rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return (verb_of(method, false, false), path.to_string()),
    };
    let rest = match rest {
        ["namespaces", _namespace, more @ ..] if !more.is_empty() => more,
        other => other,
    };
    let (resource, named) = match rest {
        [resource] => (resource.to_string(), false),
        [resource, _name] => (resource.to_string(), true),
        [resource, _name, sub, ..] => (format!("{resource}/{sub}"), true),
        _ => (String::new(), false),
    };
    let watch = query.is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
    let resource = if group.is_empty() {
        resource
    } else {
        format!("{resource}.{group}")
    };
    (verb_of(method, named, watch), resource)
}

fn verb_of(method: &http::Method, named: bool, watch: bool) -> &'static str {
    match *method {
        http::Method::GET if watch => "watch",
        http::Method::GET if named => "get",
        http::Method::GET => "list",
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE if named => "delete",
        http::Method::DELETE => "deletecollection",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_classified_as_rbac_sees_them() {
        let get = http::Method::GET;
        assert_eq!(
            classify(&get, "/api/v1/pods", Some("watch=true&resourceVersion=5")),
            ("watch", "pods".into())
        );
        assert_eq!(classify(&get, "/api/v1/nodes", None), ("list", "nodes".into()));
        assert_eq!(
            classify(
                &http::Method::PUT,
                "/apis/resource.k8s.io/v1/namespaces/a/resourceclaims/c/status",
                None
            ),
            ("update", "resourceclaims/status.resource.k8s.io".into())
        );
        assert_eq!(
            classify(
                &http::Method::PATCH,
                "/apis/muster.dev/v1alpha1/namespaces/a/workloads/w",
                None
            ),
            ("patch", "workloads.muster.dev".into())
        );
        assert_eq!(
            classify(&http::Method::POST, "/apis/events.k8s.io/v1/namespaces/a/events", None),
            ("create", "events.events.k8s.io".into())
        );
        assert_eq!(
            classify(&get, "/api/v1/namespaces/a/pods/p", None),
            ("get", "pods".into())
        );
        assert_eq!(
            classify(&get, "/api/v1/namespaces/a", None),
            ("get", "namespaces".into())
        );
        assert_eq!(
            classify(&http::Method::DELETE, "/api/v1/namespaces/a/services/s", None),
            ("delete", "services".into())
        );
    }
}
