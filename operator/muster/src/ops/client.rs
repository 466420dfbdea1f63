//! The Kubernetes client muster uses: from a kubeconfig or the in-cluster service
//! account, with a client-side rate limit (kube-rs has none of its own).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use kube::client::ClientBuilder;
use kube::config::{KubeConfigOptions, Kubeconfig};
use tower::limit::RateLimitLayer;
use tower::util::MapRequestLayer;

/// Requests per second and burst for every request muster makes. client-go's default of
/// 5 QPS / 10 burst (50 in many controllers) cannot release hundreds of pods per second.
#[derive(Clone, Copy, Debug)]
pub struct RateLimit {
    pub qps: f64,
    pub burst: u32,
}

impl Default for RateLimit {
    fn default() -> Self {
        RateLimit {
            qps: 500.0,
            burst: 1000,
        }
    }
}

/// A client from an explicit kubeconfig, or the usual inference (in-cluster included).
pub async fn client(kubeconfig: Option<&Path>, context: Option<String>, limit: RateLimit) -> Result<kube::Client> {
    let options = KubeConfigOptions {
        context,
        ..KubeConfigOptions::default()
    };
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &options).await?
        }
        None => kube::Config::infer()
            .await
            .context("no kubeconfig and not running in a cluster")?,
    };
    // A window of `burst` requests every burst/qps seconds: `qps` on average, bursts
    // of up to `burst`.
    let burst = limit.burst.max(1);
    let window = Duration::from_secs_f64(f64::from(burst) / limit.qps.max(0.001));
    let builder = ClientBuilder::try_from(config)?
        .with_layer(&RateLimitLayer::new(u64::from(burst), window))
        .with_layer(&MapRequestLayer::new(count_request));
    Ok(builder.build())
}

fn count_request<B>(request: http::Request<B>) -> http::Request<B> {
    let (verb, resource) = classify(request.method(), request.uri().path(), request.uri().query());
    crate::ops::metrics::get()
        .api_requests
        .get_or_create(&crate::ops::metrics::ApiLabels { verb, resource })
        .inc();
    request
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
