//! Waiting on conditions instead of sleeping, and checking that one keeps holding.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

/// Polls `check` every 200 ms until it returns `Some`, or fails after `timeout` with the
/// last observation (`check`'s `Err`, or `what`).
pub async fn until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last_error = None;
    loop {
        match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(e) => last_error = Some(e),
        }
        if Instant::now() >= deadline {
            match last_error {
                Some(e) => {
                    bail!("timed out after {timeout:?} waiting for {what}; last error: {e:#}")
                }
                None => bail!("timed out after {timeout:?} waiting for {what}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until `api` lists no object (of its namespace, or at all), as [`until`] does.
pub async fn until_none_left<K>(what: &str, timeout: Duration, api: &kube::Api<K>) -> Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    until(what, timeout, || async {
        let left = api.list(&kube::api::ListParams::default()).await?.items;
        Ok(left.is_empty().then_some(()))
    })
    .await
}

/// Polls `check` every 200 ms for `period` and fails as soon as it does not hold: for
/// asserting that something does not happen.
pub async fn holds<F, Fut>(what: &str, period: Duration, mut check: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool>>,
{
    let deadline = Instant::now() + period;
    while Instant::now() < deadline {
        if !check().await? {
            bail!(
                "{what} stopped holding after {:?}",
                period - (deadline - Instant::now())
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}
