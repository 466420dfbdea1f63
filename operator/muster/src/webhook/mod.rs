//! muster's mutating admission webhook, served over TLS by every replica (leader or
//! not), so that labelled job objects get gated pod templates even while leadership
//! changes hands. What it changes is [`crate::frameworks::mutate`]'s; this module serves
//! it and keeps its certificate:
//!
//! - [`certs`]: without cert-manager, muster makes a CA and a serving certificate, keeps
//!   them in a Secret, renews them, and keeps the webhook configuration's `caBundle`
//!   current;
//! - with cert-manager (the chart's option), the certificate is read from files that the
//!   mounted Secret updates, and cert-manager's CA injector keeps the `caBundle`;
//! - [`review`]: one AdmissionReview in, one answer out.
//!
//! The configuration itself (rules, `objectSelector` on `muster.dev/gang`, failure
//! policy `Fail`) is the chart's: objects without the label never reach muster, and a
//! labelled job cannot be created ungated while muster is down.

pub mod certs;
pub mod review;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use base64::Engine as _;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use crate::kube_ops;
use crate::ops::serve::budget::{Budget, End, Limits};
use certs::Bundle;

/// Largest AdmissionReview accepted (the API server sends at most about 3 MiB objects).
const MAX_BODY: usize = 8 << 20;
/// What the webhook's callers may hold. Every connection is accepted; past the budget
/// an idle one of the peer holding most is closed, so connections held open by anyone
/// that reaches the port never keep the API server's calls waiting.
const LIMITS: Limits = Limits {
    connections: 256,
    // The API server opens one per call in flight; no other peer needs many.
    per_peer: 128,
    idle: Duration::from_secs(30),
    // Longest life of a connection, idle or not: the API server opens the next one.
    lifetime: Duration::from_secs(120),
};
/// Time a client has to finish the TLS handshake and send its request headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Time a client has to send a request's body.
const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a certificate kept in files (by cert-manager) is looked at for a change.
const FILES_CHECK: Duration = Duration::from_secs(2);

/// Where the serving certificate comes from.
#[derive(Clone, Debug)]
pub enum Certificates {
    /// muster keeps it in Secret `secret` of `namespace`, for `names` (DNS names or IP
    /// addresses), and writes its CA into the `caBundle` of MutatingWebhookConfiguration
    /// `configuration`.
    Managed {
        namespace: String,
        secret: String,
        names: Vec<String>,
        configuration: String,
        lifetimes: certs::Lifetimes,
    },
    /// `tls.crt` and `tls.key` in this directory (a mounted Secret that cert-manager keeps).
    Files(PathBuf),
}

/// Settings of the webhook server.
#[derive(Clone, Debug)]
pub struct Settings {
    pub address: std::net::SocketAddr,
    pub certificates: Certificates,
    /// How often the certificate is checked (renewed, reloaded, `caBundle` compared).
    pub check_every: Duration,
    /// Told once a certificate is served, so that `/readyz` waits for it.
    pub health: Option<Arc<crate::ops::serve::Health>>,
}

/// The certificate the server presents, swapped when it is renewed.
#[derive(Debug, Default)]
struct Resolver(RwLock<Option<Arc<CertifiedKey>>>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.read().ok()?.clone()
    }
}

impl Resolver {
    /// Serves `cert_pem` and `key_pem` from now on; `Ok(false)` when they are served
    /// already.
    fn load(&self, cert_pem: &str, key_pem: &str) -> Result<bool, String> {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("reading the certificate: {e}"))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| format!("reading the key: {e}"))?;
        if self
            .0
            .read()
            .ok()
            .and_then(|c| c.clone())
            .is_some_and(|current| current.cert == chain)
        {
            return Ok(false);
        }
        let signing = rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| e.to_string())?;
        let certified = Arc::new(CertifiedKey::new(chain, signing));
        if let Ok(mut current) = self.0.write() {
            *current = Some(certified);
        }
        Ok(true)
    }

    fn ready(&self) -> bool {
        self.0.read().is_ok_and(|c| c.is_some())
    }
}

/// How long the webhook tries to bind its address: a replica that replaces another on
/// the same address (host network, a restart in place) may find it still held for a
/// moment.
const BIND_FOR: std::time::Duration = std::time::Duration::from_secs(30);

/// Binds the webhook's address, retrying for [`BIND_FOR`].
async fn bind(address: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let started = std::time::Instant::now();
    loop {
        match TcpListener::bind(address).await {
            Ok(listener) => return Ok(listener),
            Err(e) if started.elapsed() < BIND_FOR => {
                tracing::warn!(%address, error = %e, "the webhook's address is not free yet; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Binds the webhook's address and serves it until the process stops, keeping its
/// certificate. Returns only if the address cannot be bound.
pub async fn run(client: kube::Client, settings: Settings) -> std::io::Result<()> {
    let listener = bind(settings.address).await?;
    info!(address = %settings.address, "serving the admission webhook");
    let resolver = Arc::new(Resolver::default());
    let keeper = keep_certificate(client, settings.clone(), resolver.clone());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_no_client_auth()
        .with_cert_resolver(resolver.clone());
    let mut config = config;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let serve = serve(listener, acceptor, resolver);
    tokio::select! {
        () = keeper => {}
        () = serve => {}
    }
    Ok(())
}

async fn serve(listener: TcpListener, acceptor: tokio_rustls::TlsAcceptor, resolver: Arc<Resolver>) {
    let budget = Budget::new(LIMITS);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(error = %e, "accepting a webhook connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if !resolver.ready() {
            // No certificate yet: the API server retries (its failure policy holds the job).
            continue;
        }
        let Some(ticket) = budget.admit(peer.ip()) else {
            debug!(%peer, "every webhook connection is busy: closed");
            continue;
        };
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let marker = ticket.marker();
            let connection = async move {
                let tls = match tokio::time::timeout(HEADER_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        debug!(%peer, error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => return,
                };
                let service = service_fn(move |request| {
                    let marker = marker.clone();
                    async move { Ok::<_, std::convert::Infallible>(handle(request, &marker).await) }
                });
                let served = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
                if let Err(e) = served {
                    debug!(%peer, error = %e, "webhook connection ended with an error");
                }
            };
            match ticket.drive(connection).await {
                End::Closed => {}
                end => debug!(%peer, ?end, "webhook connection closed"),
            }
        });
    }
}

/// Answers one request. The connection counts as busy (never shed) only once its body
/// is in: a caller trickling bodies holds no place that others need.
async fn handle(request: Request<Incoming>, marker: &crate::ops::serve::budget::Marker) -> Response<Full<Bytes>> {
    if request.method() != Method::POST || request.uri().path() != "/mutate" {
        return reply(StatusCode::NOT_FOUND, Bytes::from_static(b"not found\n"));
    }
    let body = match tokio::time::timeout(BODY_TIMEOUT, Limited::new(request.into_body(), MAX_BODY).collect()).await {
        Ok(Ok(body)) => body.to_bytes(),
        Ok(Err(e)) => return reply(StatusCode::PAYLOAD_TOO_LARGE, Bytes::from(format!("{e}\n"))),
        Err(_) => {
            return reply(
                StatusCode::REQUEST_TIMEOUT,
                Bytes::from_static(b"the body took too long\n"),
            );
        }
    };
    let _busy = marker.busy();
    match review::respond(&body) {
        Ok(answer) => {
            crate::ops::metrics::get().webhook_reviews.inc();
            let mut response = reply(StatusCode::OK, Bytes::from(answer.to_string()));
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/json"),
            );
            response
        }
        Err(e) => reply(StatusCode::BAD_REQUEST, Bytes::from(format!("{e}\n"))),
    }
}

fn reply(status: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    response
}

/// Keeps the serving certificate loaded, renewed and trusted, checking every
/// `check_every`; a failed check is retried sooner.
async fn keep_certificate(client: kube::Client, settings: Settings, resolver: Arc<Resolver>) {
    loop {
        let (result, every) = match &settings.certificates {
            Certificates::Managed { .. } => (
                keep_managed(&client, &settings.certificates, &resolver).await,
                settings.check_every,
            ),
            // A renewal shows in the mounted files within the kubelet's sync period; it
            // is served as soon as it does.
            Certificates::Files(dir) => (load_files(dir, &resolver), settings.check_every.min(FILES_CHECK)),
        };
        let wait = match result {
            Ok(()) => {
                if let Some(health) = &settings.health {
                    health.set_webhook_ready();
                }
                every
            }
            Err(e) => {
                warn!(error = %e, "the webhook certificate is not ready; trying again");
                every.min(Duration::from_secs(2))
            }
        };
        tokio::time::sleep(wait).await;
    }
}

fn load_files(dir: &std::path::Path, resolver: &Resolver) -> Result<(), String> {
    let read =
        |name: &str| std::fs::read_to_string(dir.join(name)).map_err(|e| format!("{}: {e}", dir.join(name).display()));
    if resolver.load(&read(certs::TLS_CERT)?, &read(certs::TLS_KEY)?)? {
        info!(dir = %dir.display(), "serving the webhook certificate from its files");
    }
    Ok(())
}

fn bundle_of(secret: &Secret) -> Option<Bundle> {
    let data = secret.data.as_ref()?;
    let text = |key: &str| data.get(key).and_then(|b| String::from_utf8(b.0.clone()).ok());
    Some(Bundle {
        ca_bundle: text(certs::CA_CERT)?,
        ca_key: text(certs::CA_KEY)?,
        cert: text(certs::TLS_CERT)?,
        key: text(certs::TLS_KEY)?,
    })
}

fn secret_data(bundle: &Bundle) -> BTreeMap<String, ByteString> {
    [
        (certs::CA_CERT, &bundle.ca_bundle),
        (certs::CA_KEY, &bundle.ca_key),
        (certs::TLS_CERT, &bundle.cert),
        (certs::TLS_KEY, &bundle.key),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
    .collect()
}

/// One check of a managed certificate: renew the Secret if due (replicas race on its
/// resourceVersion; the loser reads the winner's), load it, and put its CAs into the
/// webhook configuration. A new CA goes into the configuration one check before any
/// certificate is served from it.
async fn keep_managed(client: &kube::Client, certificates: &Certificates, resolver: &Resolver) -> Result<(), String> {
    let Certificates::Managed {
        namespace,
        secret: name,
        names,
        configuration,
        lifetimes,
    } = certificates
    else {
        return Ok(());
    };
    let configurations: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let Some(config) = configurations.get_opt(configuration).await.map_err(|e| e.to_string())? else {
        return Err(format!("MutatingWebhookConfiguration {configuration} does not exist"));
    };
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let stored = secrets.get_opt(name).await.map_err(|e| e.to_string())?;
    let bundle = stored.as_ref().and_then(bundle_of);
    let trusted = bundle.as_ref().is_some_and(|b| {
        let current = certs::pems(&b.ca_bundle).into_iter().next().unwrap_or_default();
        !current.is_empty() && trusts(&config, &current)
    });
    let now = time::OffsetDateTime::now_utc();
    let renewed = certs::renew(bundle.as_ref(), names, now, *lifetimes, trusted).map_err(|e| e.to_string())?;
    let bundle = match renewed {
        None => bundle.ok_or("no certificate")?,
        Some(fresh) => {
            let mut object = stored.clone().unwrap_or_default();
            object.metadata.name = Some(name.clone());
            object.metadata.namespace = Some(namespace.clone());
            // Labelled as the chart's objects are, and owned by the webhook
            // configuration, so that it goes when muster is uninstalled.
            let labels = object.metadata.labels.get_or_insert_default();
            for (key, value) in config.metadata.labels.iter().flatten() {
                if key.starts_with("app.kubernetes.io/") || key.starts_with("helm.sh/") {
                    labels.insert(key.clone(), value.clone());
                }
            }
            labels.insert("app.kubernetes.io/managed-by".into(), "muster".into());
            labels.insert("app.kubernetes.io/component".into(), "webhook".into());
            if let Some(uid) = config.metadata.uid.clone() {
                object.metadata.owner_references =
                    Some(vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                        api_version: "admissionregistration.k8s.io/v1".into(),
                        kind: "MutatingWebhookConfiguration".into(),
                        name: configuration.clone(),
                        uid,
                        ..Default::default()
                    }]);
            }
            object.type_ = Some("kubernetes.io/tls".into());
            object.data = Some(secret_data(&fresh));
            let written = match &stored {
                // Conditional on the version read: a replica that renewed first wins.
                Some(_) => secrets.replace(name, &PostParams::default(), &object).await,
                None => secrets.create(&PostParams::default(), &object).await,
            };
            match written {
                Ok(_) => {
                    info!(secret = %name, "renewed the webhook's certificate");
                    fresh
                }
                Err(e) if kube_ops::is_conflict(&e) => {
                    return Err("another replica renewed the certificate first; reading it".into());
                }
                Err(e) => return Err(e.to_string()),
            }
        }
    };
    if resolver.load(&bundle.cert, &bundle.key)? {
        info!(secret = %name, "serving the webhook certificate");
    }
    ensure_ca_bundle(client, config, &bundle.ca_bundle).await
}

/// Whether every webhook of `config` trusts the CA `pem`.
fn trusts(config: &MutatingWebhookConfiguration, pem: &str) -> bool {
    let webhooks = config.webhooks.as_deref().unwrap_or_default();
    !webhooks.is_empty()
        && webhooks.iter().all(|w| {
            w.client_config
                .ca_bundle
                .as_ref()
                .is_some_and(|b| String::from_utf8_lossy(&b.0).contains(pem.trim()))
        })
}

/// Writes `ca_bundle` into every webhook of the configuration where it differs
/// (conditional on the version read).
async fn ensure_ca_bundle(
    client: &kube::Client,
    mut current: MutatingWebhookConfiguration,
    ca_bundle: &str,
) -> Result<(), String> {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let configuration = current.metadata.name.clone().unwrap_or_default();
    let wanted = ByteString(ca_bundle.as_bytes().to_vec());
    let mut changed = false;
    for webhook in current.webhooks.iter_mut().flatten() {
        if webhook.client_config.ca_bundle.as_ref() != Some(&wanted) {
            webhook.client_config.ca_bundle = Some(wanted.clone());
            changed = true;
        }
    }
    if changed {
        api.replace(&configuration, &PostParams::default(), &current)
            .await
            .map_err(|e| e.to_string())?;
        info!(
            %configuration,
            ca = %base64::engine::general_purpose::STANDARD.encode(&ca_bundle.as_bytes()[..ca_bundle.len().min(24)]),
            "wrote the webhook's CA into its configuration"
        );
    }
    Ok(())
}
