//! Leader election through a coordination.k8s.io Lease, so that of several replicas only
//! one admits gangs and writes. A candidate takes the Lease once its holder has not
//! renewed it for the lease duration, measured on the candidate's own clock from when it
//! last saw the record change (clocks of different machines are never compared). The
//! leader renews every retry period and stops the process when it could not renew within
//! the renew deadline: two leaders must never write at once, and a restart is the
//! simplest way back to being a clean follower.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tracing::{info, warn};

use crate::kube_ops;

#[derive(Clone, Debug)]
pub struct Settings {
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// Who this process is: unique among the candidates.
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

impl Settings {
    /// Renewing at a third of the lease duration and giving up at two thirds leaves a
    /// deposed leader time to stop before anyone else may take over.
    pub fn new(namespace: String, name: String, identity: String, lease_duration: Duration) -> Self {
        Settings {
            namespace,
            name,
            identity,
            lease_duration,
            renew_deadline: lease_duration * 2 / 3,
            retry_period: (lease_duration / 5).max(Duration::from_millis(200)),
        }
    }
}

/// This process's identity: the pod name where there is one, made unique per process.
pub fn identity() -> String {
    let host = std::env::var("POD_NAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "muster".to_string());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{host}_{}_{nanos:08x}", std::process::id())
}

/// Whether this process may still act as the leader: until two thirds of a lease
/// duration after its last renewal, measured on the monotonic clock (which keeps
/// running while the process is stopped). Writers check it before every write, so a
/// leader that was stalled past that point writes nothing more.
#[derive(Clone, Debug)]
pub struct LeaseGuard {
    /// Milliseconds after `start` until which the Lease is held.
    held_until: Arc<AtomicU64>,
    start: Instant,
}

impl LeaseGuard {
    fn new() -> Self {
        LeaseGuard {
            held_until: Arc::new(AtomicU64::new(0)),
            start: Instant::now(),
        }
    }

    fn renewed(&self, renewed_at: Instant, deadline: Duration) {
        let until = (renewed_at + deadline).duration_since(self.start).as_millis() as u64;
        self.held_until.store(until, Ordering::SeqCst);
    }

    /// Whether the Lease is still held.
    pub fn held(&self) -> bool {
        (self.start.elapsed().as_millis() as u64) < self.held_until.load(Ordering::SeqCst)
    }

    /// Stops the process unless the Lease is still held: called before a write, so a
    /// leader that was stalled past its Lease writes nothing more.
    pub fn exit_unless_held(&self) {
        if !self.held() {
            tracing::error!("the leader Lease may have passed to another replica: stopping before the next write");
            std::process::exit(1);
        }
    }
}

/// A candidate for the Lease.
pub struct Elector {
    api: Api<Lease>,
    settings: Settings,
    guard: LeaseGuard,
    /// The holder and renew time last seen, and when they were first seen.
    observed: Option<(Option<String>, Option<MicroTime>, Instant)>,
}

impl Elector {
    pub fn new(client: kube::Client, settings: Settings) -> Self {
        Elector {
            api: Api::namespaced(client, &settings.namespace),
            settings,
            guard: LeaseGuard::new(),
            observed: None,
        }
    }

    /// What writers check before every write.
    pub fn guard(&self) -> LeaseGuard {
        self.guard.clone()
    }

    /// Waits until this process holds the Lease.
    pub async fn acquire(&mut self) {
        info!(lease = %self.settings.name, namespace = %self.settings.namespace, identity = %self.settings.identity, "waiting to lead");
        loop {
            let asked = Instant::now();
            match self.try_acquire_or_renew().await {
                Ok(true) => {
                    self.guard.renewed(asked, self.settings.renew_deadline);
                    info!(identity = %self.settings.identity, "leading");
                    return;
                }
                Ok(false) => {}
                Err(e) => warn!(error = %e, "reading or writing the leader Lease failed"),
            }
            tokio::time::sleep(self.settings.retry_period).await;
        }
    }

    /// Renews the Lease until it cannot within the renew deadline; then returns.
    pub async fn keep(&mut self) {
        let mut renewed = Instant::now();
        loop {
            tokio::time::sleep(self.settings.retry_period).await;
            // A renewal counts from when it was asked for: the answer may come late.
            let asked = Instant::now();
            let attempt = tokio::time::timeout(self.settings.retry_period, self.try_acquire_or_renew()).await;
            match attempt.unwrap_or_else(|_| Err(kube::Error::Service("renewing the Lease timed out".into()))) {
                Ok(true) => {
                    renewed = asked;
                    self.guard.renewed(asked, self.settings.renew_deadline);
                }
                Ok(false) => {
                    warn!("another process took the leader Lease");
                    return;
                }
                Err(e) => warn!(error = %e, "renewing the leader Lease failed"),
            }
            if renewed.elapsed() > self.settings.renew_deadline {
                warn!(deadline = ?self.settings.renew_deadline, "could not renew the leader Lease in time");
                return;
            }
        }
    }

    /// Gives the Lease up (on a clean shutdown), so a follower takes over at once.
    pub async fn release(&mut self) {
        let Ok(Some(mut lease)) = self.api.get_opt(&self.settings.name).await else {
            return;
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(&self.settings.identity) {
            return;
        }
        spec.holder_identity = None;
        spec.renew_time = None;
        spec.acquire_time = None;
        match self
            .api
            .replace(&self.settings.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => info!("gave up the leader Lease"),
            Err(e) => warn!(error = %e, "giving up the leader Lease failed; it expires on its own"),
        }
    }

    /// One round: `Ok(true)` when this process holds the Lease afterwards.
    async fn try_acquire_or_renew(&mut self) -> Result<bool, kube::Error> {
        let now = MicroTime(Timestamp::now());
        let seconds = i32::try_from(self.settings.lease_duration.as_secs().max(1)).unwrap_or(i32::MAX);
        let Some(mut lease) = self.api.get_opt(&self.settings.name).await? else {
            let lease = Lease {
                metadata: kube::api::ObjectMeta {
                    name: Some(self.settings.name.clone()),
                    namespace: Some(self.settings.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.settings.identity.clone()),
                    lease_duration_seconds: Some(seconds),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(e) if kube_ops::is_conflict(&e) => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let mine = holder.as_deref() == Some(&self.settings.identity);
        if !mine && holder.is_some() {
            let record = (holder.clone(), spec.renew_time.clone());
            let changed = self
                .observed
                .as_ref()
                .is_none_or(|(h, r, _)| (h.clone(), r.clone()) != record);
            if changed {
                self.observed = Some((record.0, record.1, Instant::now()));
            }
            let held_for = spec
                .lease_duration_seconds
                .map_or(self.settings.lease_duration, |s| Duration::from_secs(s.max(1) as u64));
            let seen = self.observed.as_ref().map_or_else(Instant::now, |(_, _, at)| *at);
            if seen.elapsed() < held_for {
                return Ok(false);
            }
            info!(previous = ?holder, "the leader Lease expired; taking it over");
        }
        if !mine {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(self.settings.identity.clone());
        spec.lease_duration_seconds = Some(seconds);
        spec.renew_time = Some(now);
        // The resourceVersion from the read makes this fail if anyone wrote in between.
        match self
            .api
            .replace(&self.settings.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if kube_ops::is_conflict(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }
}
