//! The Kubernetes client muster uses: from a kubeconfig or the in-cluster service
//! account, with a client-side rate limit (kube-rs has none of its own).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use kube::client::ClientBuilder;
use kube::config::{KubeConfigOptions, Kubeconfig};
use tower::limit::RateLimitLayer;

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
    let builder = ClientBuilder::try_from(config)?.with_layer(&RateLimitLayer::new(u64::from(burst), window));
    Ok(builder.build())
}
