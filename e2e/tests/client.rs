//! muster's Kubernetes client against the real API server: requests in flight share one
//! HTTP/2 connection instead of opening one TLS connection each, and the token bucket
//! holds a burst to its rate.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::future::join_all;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams};
use muster::ops::client::{RateLimit, client};
use muster_e2e::testing::shared_cluster;
use muster_local_cluster::fleet::FleetSpec;

/// Inodes of the sockets this process has open.
fn own_socket_inodes() -> Result<BTreeSet<u64>> {
    let mut inodes = BTreeSet::new();
    for entry in std::fs::read_dir("/proc/self/fd")? {
        let Ok(target) = std::fs::read_link(entry?.path()) else {
            continue;
        };
        let target = target.to_string_lossy();
        if let Some(inode) = target.strip_prefix("socket:[").and_then(|t| t.strip_suffix(']')) {
            inodes.insert(inode.parse()?);
        }
    }
    Ok(inodes)
}

/// Established TCP connections of this process to `port` on the loopback.
fn connections_to(port: u16) -> Result<usize> {
    let own = own_socket_inodes()?;
    let mut count = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(remote), Some(state), Some(inode)) = (fields.get(2), fields.get(3), fields.get(9)) else {
                continue;
            };
            let remote_port = remote.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            // 01: ESTABLISHED.
            if remote_port == Some(port) && *state == "01" && own.contains(&inode.parse()?) {
                count += 1;
            }
        }
    }
    Ok(count)
}

fn apiserver_port(server: &str) -> Result<u16> {
    server
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .with_context(|| format!("no port in {server}"))
}

#[tokio::test]
async fn parallel_requests_share_one_http2_connection() -> Result<()> {
    let cluster = shared_cluster(FleetSpec::with_nodes(2)).await?;
    let port = apiserver_port(cluster.control_plane.server())?;
    let client = client(Some(cluster.control_plane.kubeconfig()), None, RateLimit::default()).await?;
    let nodes: Api<Node> = Api::all(client.clone());
    // The first request opens the connection (and learns, by ALPN, that it is HTTP/2).
    nodes.list(&ListParams::default()).await?;
    let before = connections_to(port)?;
    assert!(before >= 1, "no connection to the API server is open after a request");
    // Each request in flight would hold a connection of its own over HTTP/1.1.
    let lists = join_all((0..64).map(|_| {
        let nodes = nodes.clone();
        async move { nodes.list(&ListParams::default()).await }
    }))
    .await;
    for list in lists {
        assert_eq!(list?.items.len(), 2);
    }
    let opened = connections_to(port)?.saturating_sub(before);
    assert!(
        opened == 0,
        "64 parallel requests opened {opened} connections to the API server: not one HTTP/2 connection"
    );
    Ok(())
}

#[tokio::test]
async fn the_token_bucket_holds_requests_past_the_burst_to_its_rate() -> Result<()> {
    let cluster = shared_cluster(FleetSpec::with_nodes(2)).await?;
    let client = client(
        Some(cluster.control_plane.kubeconfig()),
        None,
        RateLimit { qps: 20.0, burst: 10 },
    )
    .await?;
    let nodes: Api<Node> = Api::all(client);
    let start = Instant::now();
    for _ in 0..30 {
        nodes.list(&ListParams::default()).await?;
    }
    // Ten from the bucket, twenty more at 20 a second: at least about a second. (A lower
    // bound only: a loaded machine is slower, never faster.)
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(900), "30 requests took {took:?}");
    Ok(())
}
