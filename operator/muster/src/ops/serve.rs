//! The operator's HTTP endpoints: `/metrics` (Prometheus), `/healthz` (liveness: the
//! process serves requests) and `/readyz` (readiness: its caches are filled, so it can
//! lead at once).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

/// What the probes report.
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
}

impl Health {
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
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

/// Serves `endpoints` on `listener` until the process stops.
pub async fn serve(listener: TcpListener, endpoints: Endpoints, health: Arc<Health>) {
    if let Ok(address) = listener.local_addr() {
        info!(%address, ?endpoints, "serving");
    }
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(error = %e, "accepting a connection failed");
                continue;
            }
        };
        let health = health.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let health = health.clone();
                async move { Ok::<_, Infallible>(respond(&request, endpoints, &health)) }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}

fn respond(request: &Request<Incoming>, endpoints: Endpoints, health: &Health) -> Response<Full<Bytes>> {
    let metrics = matches!(endpoints, Endpoints::Metrics | Endpoints::All);
    let probes = matches!(endpoints, Endpoints::Probes | Endpoints::All);
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
    }
    match request.uri().path() {
        "/metrics" if metrics => {
            let mut response = text(StatusCode::OK, crate::ops::metrics::get().encode());
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
            );
            response
        }
        "/healthz" | "/livez" if probes => text(StatusCode::OK, "ok\n".into()),
        "/readyz" if probes && health.is_ready() => text(StatusCode::OK, "ok\n".into()),
        "/readyz" if probes => text(StatusCode::SERVICE_UNAVAILABLE, "caches are not filled yet\n".into()),
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
