//! The Kubernetes client muster uses: from a kubeconfig or the in-cluster service
//! account, over HTTP/2 when the API server offers it (as client-go does), every request
//! taking a token of one client-side bucket and counted as RBAC names it.
//!
//! kube-rs's own stack speaks HTTP/1.1 only, so each request in flight holds a TLS
//! connection of its own, and a burst of writes opens (and the API server handshakes)
//! one connection per parallel write. One HTTP/2 connection carries them all as
//! streams. The stack is otherwise kube-rs's: base URI, retries of retryable server
//! answers, authentication, extra headers.

mod accounting;
mod rate_limit;

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::retry::RetryPolicy;
use kube::client::{ClientBuilder, ConfigExt};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tower::retry::RetryLayer;
use tower::util::MapRequestLayer;
use tower::{BoxError, ServiceBuilder};

pub use accounting::classify;
pub use rate_limit::RateLimit;

/// How often an idle HTTP/2 connection is pinged, and how long a ping may go
/// unanswered, so a connection to a vanished API server is noticed (client-go pings
/// after 30 s without reads and gives up after 15 s more).
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(15);

/// How muster names itself to the API server (audit logs, request logs): kube-rs sends
/// no User-Agent of its own.
pub const USER_AGENT: &str = concat!("muster/", env!("CARGO_PKG_VERSION"));

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
    build(config, limit)
}

fn build(config: kube::Config, limit: RateLimit) -> Result<kube::Client> {
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_nodelay(true);
    tcp.set_connect_timeout(config.connect_timeout);
    let mut tls = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config.rustls_client_config()?)
        .https_or_http();
    if let Some(name) = &config.tls_server_name {
        let name = name
            .clone()
            .try_into()
            .with_context(|| format!("tls-server-name {name:?} is not a valid server name"))?;
        tls = tls.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name));
    }
    // Offers h2 and http/1.1 by ALPN: the API server picks HTTP/2 unless it was
    // started without it.
    let connector = tls.enable_all_versions().wrap_connector(tcp);
    let transport = hyper_util::client::legacy::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .http2_keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .http2_keep_alive_while_idle(true)
        .build(connector);

    let default_namespace = config.default_namespace.clone();
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .layer(MapRequestLayer::new(name_muster))
        .layer(accounting::AccountingLayer)
        .option_layer(
            config
                .default_retry
                .then(|| RetryLayer::new(RetryPolicy::server_retry())),
        )
        .layer(rate_limit::RateLimitLayer::new(limit))
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(transport);
    Ok(ClientBuilder::new(service, default_namespace).build())
}

fn name_muster<B>(mut request: http::Request<B>) -> http::Request<B> {
    request
        .headers_mut()
        .entry(http::header::USER_AGENT)
        .or_insert(http::HeaderValue::from_static(USER_AGENT));
    request
}
