//! A client-side token bucket, as client-go's default rate limiter is: `qps` tokens a
//! second refill a bucket of `burst`, and a request waits for its token. (A fixed window
//! would let a whole window's requests through at once and then stall every caller until
//! the window ends.) kube-rs has no limiter of its own.

use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota};
use tower::{Layer, Service};

/// Requests per second and burst for every request muster makes. client-go's default of
/// 5 QPS / 10 burst (50 in many controllers) cannot release hundreds of pods per second.
#[derive(Clone, Copy, Debug, PartialEq)]
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

impl RateLimit {
    /// The bucket: one token every 1/qps seconds, at most `burst` saved up.
    fn quota(self) -> Quota {
        let period = Duration::from_secs_f64(1.0 / self.qps.clamp(0.001, 1e9));
        let burst = NonZeroU32::new(self.burst).unwrap_or(NonZeroU32::MIN);
        Quota::with_period(period.max(Duration::from_nanos(1)))
            .expect("the period is positive")
            .allow_burst(burst)
    }
}

/// Makes every request of the wrapped service take a token of one shared bucket.
#[derive(Clone)]
pub struct RateLimitLayer {
    bucket: Arc<DefaultDirectRateLimiter>,
}

impl RateLimitLayer {
    pub fn new(limit: RateLimit) -> Self {
        RateLimitLayer {
            bucket: Arc::new(governor::RateLimiter::direct(limit.quota())),
        }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimited<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimited {
            inner,
            bucket: self.bucket.clone(),
            token: false,
            wait: None,
        }
    }
}

pub struct RateLimited<S> {
    inner: S,
    bucket: Arc<DefaultDirectRateLimiter>,
    /// A token taken for the next call.
    token: bool,
    /// The wait for the next token, when the bucket was empty.
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S: Clone> Clone for RateLimited<S> {
    /// A clone shares the bucket, not the token taken for this one's next call.
    fn clone(&self) -> Self {
        RateLimited {
            inner: self.inner.clone(),
            bucket: self.bucket.clone(),
            token: false,
            wait: None,
        }
    }
}

impl<S, Request> Service<Request> for RateLimited<S>
where
    S: Service<Request>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        while !self.token {
            if let Some(wait) = self.wait.as_mut() {
                if wait.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.wait = None;
            }
            match self.bucket.check() {
                Ok(()) => self.token = true,
                Err(not_until) => {
                    let wait = not_until.wait_time_from(DefaultClock::default().now());
                    self.wait = Some(Box::pin(tokio::time::sleep(wait)));
                }
            }
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        debug_assert!(self.token, "poll_ready takes a token before call");
        self.token = false;
        self.inner.call(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;
    use tower::ServiceExt;

    fn counter()
    -> impl Service<(), Response = (), Error = Infallible, Future = std::future::Ready<Result<(), Infallible>>> + Clone
    {
        tower::service_fn(|()| std::future::ready(Ok::<_, Infallible>(())))
    }

    // The bucket runs on the real clock, so these only check lower bounds: a machine
    // under load can be slower, never faster.
    #[tokio::test]
    async fn after_the_burst_requests_come_at_the_refill_rate() {
        let layer = RateLimitLayer::new(RateLimit { qps: 20.0, burst: 5 });
        let mut service = layer.layer(counter());
        let start = std::time::Instant::now();
        for _ in 0..9 {
            service.ready().await.unwrap().call(()).await.unwrap();
        }
        // Five from the bucket, then four refills at 20 a second.
        assert!(start.elapsed() >= Duration::from_millis(150), "{:?}", start.elapsed());
    }

    #[tokio::test]
    async fn clones_share_one_bucket() {
        let layer = RateLimitLayer::new(RateLimit { qps: 5.0, burst: 2 });
        let mut a = layer.layer(counter());
        let mut b = a.clone();
        let start = std::time::Instant::now();
        a.ready().await.unwrap().call(()).await.unwrap();
        b.ready().await.unwrap().call(()).await.unwrap();
        a.ready().await.unwrap().call(()).await.unwrap();
        assert!(
            start.elapsed() >= Duration::from_millis(150),
            "the third token waits for the refill"
        );
    }

    #[test]
    fn zero_or_odd_settings_still_make_a_bucket() {
        let _ = RateLimit { qps: 0.0, burst: 0 }.quota();
        let _ = RateLimit {
            qps: f64::MAX,
            burst: 1,
        }
        .quota();
    }
}
