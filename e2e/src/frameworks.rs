//! JobSet and Trainer beside the shared cluster, and muster's webhook on loopback: the
//! chart's MutatingWebhookConfiguration pointed at one port that every operator of the
//! test binary serves in turn.

use anyhow::{Context, Result};
use muster_local_cluster::frameworks::{Frameworks, apply_cluster_object, loopback_webhook};
use tokio::sync::OnceCell;

use crate::scenario::cluster;

/// Starts JobSet and Trainer and registers muster's webhook (once per test binary);
/// returns the webhook's port.
pub async fn webhook_port() -> Result<u16> {
    static SETUP: OnceCell<(Frameworks, u16)> = OnceCell::const_new();
    let (_, port) = SETUP
        .get_or_try_init(|| async {
            let cluster = cluster().await?;
            let frameworks = Frameworks::start(&cluster.control_plane).await?;
            let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let client = cluster.control_plane.client().await?;
            let rendered = crate::chart::render(&[])?;
            let configuration = crate::chart::of_kind(&rendered, "MutatingWebhookConfiguration")
                .first()
                .map(|c| (*c).clone())
                .context("the chart's webhook configuration")?;
            apply_cluster_object(
                &client,
                &loopback_webhook(configuration, port),
                "mutatingwebhookconfigurations",
            )
            .await?;
            anyhow::Ok((frameworks, port))
        })
        .await?;
    Ok(*port)
}

/// The operator's arguments: adopt jobs, serve the webhook on `port` with a certificate
/// it makes (checked every second).
pub fn operator_args(port: u16) -> Vec<String> {
    vec![
        "--adopt-jobs".into(),
        format!("--webhook-bind-address=127.0.0.1:{port}"),
        "--webhook-dns-name=127.0.0.1".into(),
        "--webhook-namespace=default".into(),
        "--webhook-configuration=muster-webhook".into(),
        "--webhook-cert-check=1".into(),
    ]
}
