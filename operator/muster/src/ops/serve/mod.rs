//! The operator's HTTP endpoints: `/metrics` (Prometheus), `/healthz` (liveness: the
//! process serves requests) and `/readyz` (readiness: its caches are filled, so it can
//! lead at once, and the admission webhook, where it runs, has a certificate to serve).
//!
//! Anything that reaches the port may connect, so each listener has a budget of its own
//! ([`budget`]): connections at once (an idle one of the peer holding most makes room for
//! a newcomer), time to send the request head, time idle, and a connection's life. The
//! probes listen apart from `/metrics`, so a scraper's abuse never reaches the kubelet's
//! probes. `/metrics` can require a token allowed to read it ([`auth`]).

pub mod auth;
pub mod budget;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use auth::{MetricsAuth, Verdict};
use budget::{Budget, End, Limits};

/// What one listener lets its callers hold: Prometheus and the kubelet need a handful
/// of connections, each request answered at once.
const LIMITS: Limits = Limits {
    connections: 128,
    per_peer: 16,
    idle: Duration::from_secs(15),
    lifetime: Duration::from_secs(60),
};
/// Time a caller has to send its request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// What the probes report.
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
    /// The process serves the admission webhook: ready only once it has a certificate.
    webhook: AtomicBool,
    webhook_ready: AtomicBool,
}

impl Health {
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    /// Readiness waits for the webhook's certificate too.
    pub fn expect_webhook(&self) {
        self.webhook.store(true, Ordering::Relaxed);
    }

    pub fn set_webhook_ready(&self) {
        self.webhook_ready.store(true, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
            && (!self.webhook.load(Ordering::Relaxed) || self.webhook_ready.load(Ordering::Relaxed))
    }
}

/// What one listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoints {
    Metrics,
    Probes,
    /// Both on one address.
    All,
}

/// Binds `address`; `None` when it is "0" (disabled).
pub async fn bind(address: &str) -> std::io::Result<Option<TcpListener>> {
    if address == "0" || address.is_empty() {
        return Ok(None);
    }
    let address: SocketAddr = address
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{address}: {e}")))?;
    TcpListener::bind(address).await.map(Some)
}

/// Serves `endpoints` on `listener` until the process stops; `/metrics` only to callers
/// `auth` allows, when given.
pub async fn serve(listener: TcpListener, endpoints: Endpoints, health: Arc<Health>, auth: Option<Arc<MetricsAuth>>) {
    if let Ok(address) = listener.local_addr() {
        info!(%address, ?endpoints, authenticated = auth.is_some(), "serving");
    }
    let budget = Budget::new(LIMITS);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(error = %e, "accepting a connection failed");
                // Out of file descriptors, say: let some connections end first.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(ticket) = budget.admit(peer.ip()) else {
            debug!(%peer, "every connection is busy: closed");
            drop(stream);
            continue;
        };
        let (health, auth) = (health.clone(), auth.clone());
        tokio::spawn(async move {
            let marker = ticket.marker();
            let service = service_fn(move |request| {
                let (health, auth, busy) = (health.clone(), auth.clone(), marker.busy());
                async move {
                    let response = respond(&request, endpoints, &health, auth.as_deref()).await;
                    drop(busy);
                    Ok::<_, Infallible>(response)
                }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            match ticket.drive(connection).await {
                End::Closed => {}
                end => debug!(%peer, ?end, "connection closed"),
            }
        });
    }
}

async fn respond(
    request: &Request<Incoming>,
    endpoints: Endpoints,
    health: &Health,
    auth: Option<&MetricsAuth>,
) -> Response<Full<Bytes>> {
    let metrics = matches!(endpoints, Endpoints::Metrics | Endpoints::All);
    let probes = matches!(endpoints, Endpoints::Probes | Endpoints::All);
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
    }
    match request.uri().path() {
        "/metrics" if metrics => {
            if let Some(auth) = auth {
                let header = request
                    .headers()
                    .get(hyper::header::AUTHORIZATION)
                    .and_then(|h| h.to_str().ok());
                match auth.check(header, "/metrics").await {
                    Verdict::Allowed => {}
                    Verdict::Unauthenticated => {
                        let mut response = text(StatusCode::UNAUTHORIZED, "a bearer token is needed\n".into());
                        response.headers_mut().insert(
                            hyper::header::WWW_AUTHENTICATE,
                            hyper::header::HeaderValue::from_static("Bearer"),
                        );
                        return response;
                    }
                    Verdict::Forbidden => {
                        return text(StatusCode::FORBIDDEN, "not allowed to get /metrics\n".into());
                    }
                    Verdict::Unavailable => {
                        return text(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "cannot check the token with the API server\n".into(),
                        );
                    }
                }
            }
            let mut response = text(StatusCode::OK, crate::ops::metrics::get().encode());
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
            );
            response
        }
        "/healthz" | "/livez" if probes => text(StatusCode::OK, "ok\n".into()),
        "/readyz" if probes && health.is_ready() => text(StatusCode::OK, "ok\n".into()),
        "/readyz" if probes => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "caches are not filled yet, or the webhook has no certificate yet\n".into(),
        ),
        _ => text(StatusCode::NOT_FOUND, "not found\n".into()),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
