//! The operator's HTTP server against callers that misbehave or are not allowed: idle
//! connections cannot starve it, and with `--metrics-auth` only a token the API server
//! accepts, of a user allowed to get `/metrics`, reads the metrics.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, PostParams};
use muster_e2e::chart;
use muster_e2e::scenario::{Test, with_test};
use muster_local_cluster::wait;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// `GET path` with an optional bearer token; the status code.
async fn get(address: std::net::SocketAddr, path: &str, token: Option<&str>) -> Result<u16> {
    let mut stream = TcpStream::connect(address).await?;
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: muster\r\n{authorization}Connection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response)).await??;
    let head = String::from_utf8_lossy(&response);
    head.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status line in {head:?}"))
}

/// Waits until the operator answers on `address`.
async fn serving(address: std::net::SocketAddr) -> Result<()> {
    wait::until("the operator to serve", Duration::from_secs(30), || async move {
        Ok(get(address, "/healthz", None)
            .await
            .ok()
            .filter(|code| *code == 200)
            .map(|_| ()))
    })
    .await
}

async fn token_of(test: &Test, account: &str) -> Result<String> {
    let accounts: Api<ServiceAccount> = Api::namespaced(test.client.clone(), &test.ns);
    accounts
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": account}}))?,
        )
        .await?;
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..TokenRequestSpec::default()
        }),
        ..TokenRequest::default()
    };
    let answer = accounts
        .create_token_request(account, &PostParams::default(), &request)
        .await?;
    answer.status.and_then(|s| s.token).context("a token")
}

#[tokio::test]
async fn with_metrics_auth_only_an_allowed_token_reads_the_metrics() -> Result<()> {
    with_test("metrics-auth", &["--metrics-auth"], &[], |test| {
        Box::pin(async move {
            let address = test.operator.as_ref().context("operator")?.http;
            serving(address).await?;
            ensure!(get(address, "/metrics", None).await? == 401, "no token: 401");
            ensure!(get(address, "/healthz", None).await? == 200, "the probes stay open");
            ensure!(
                get(address, "/metrics", Some("not-a-token")).await? == 401,
                "an unknown token: 401"
            );

            let token = token_of(test, "scraper").await?;
            ensure!(
                get(address, "/metrics", Some(&token)).await? == 403,
                "a user without the role: 403"
            );

            // The chart's reader role, bound to the scraper.
            let objects = chart::render(&[("metrics.auth.enabled", "true")])?;
            let reader = chart::of_kind(&objects, "ClusterRole")
                .into_iter()
                .find(|r| {
                    r["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| n.ends_with("-metrics-reader"))
                })
                .context("the chart's metrics-reader role")?;
            let mut reader = reader.clone();
            let role_name = format!("{}-metrics-reader", test.ns);
            reader["metadata"]["name"] = json!(role_name);
            let binding = json!({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": role_name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
                "subjects": [{"kind": "ServiceAccount", "name": "scraper", "namespace": test.ns}],
            });
            muster_e2e::rbac::apply(&test.client, &[&reader, &binding]).await?;
            // A refusal is remembered for a few seconds.
            wait::until("the scraper to read the metrics", Duration::from_secs(30), || {
                let token = token.clone();
                async move { Ok((get(address, "/metrics", Some(&token)).await? == 200).then_some(())) }
            })
            .await?;
            Ok(())
        })
    })
    .await
}

#[tokio::test]
async fn idle_connections_cannot_starve_the_metrics_server() -> Result<()> {
    with_test("metrics-idle", &[], &[], |test| {
        Box::pin(async move {
            let operator = test.operator.as_ref().context("operator")?;
            let address = operator.http;
            let pid = operator.pid().context("the operator's pid")?;
            serving(address).await?;
            let open_files = || std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count());
            let before = open_files()?;
            // Connections that never send a request.
            let mut idle = Vec::new();
            for _ in 0..200 {
                idle.push(TcpStream::connect(address).await?);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            let during = open_files()?;
            ensure!(
                during <= before + 40,
                "200 idle connections took {} file descriptors of the operator",
                during - before
            );
            // Those over the limit were closed at once; the rest time out, and a scrape
            // gets through within seconds.
            let mut closed = 0;
            for stream in &mut idle {
                let mut byte = [0u8; 1];
                if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(10), stream.read(&mut byte)).await {
                    closed += 1;
                }
            }
            ensure!(closed >= 160, "only {closed} of 200 idle connections were refused");
            wait::until("a scrape to get through", Duration::from_secs(20), || async move {
                Ok(get(address, "/metrics", None)
                    .await
                    .ok()
                    .filter(|code| *code == 200)
                    .map(|_| ()))
            })
            .await?;
            drop(idle);
            Ok(())
        })
    })
    .await
}
