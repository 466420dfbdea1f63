//! `/metrics` behind Kubernetes' own authentication and authorization, as kube-rbac-proxy
//! does it: the caller's bearer token goes to a TokenReview, and the user it names must
//! be allowed `get` on the non-resource URL `/metrics` by a SubjectAccessReview. Answers
//! are remembered for a short while, so a scrape every few seconds costs the API server
//! two requests a minute per scraper. Callers with ever new tokens cannot push the
//! scrapers' answers out (refusals are remembered apart), and the reviews have a rate
//! of their own, on a client of their own: past it a caller gets 503 at once, and
//! admission's requests never wait behind them.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::api::{Api, PostParams};
use tracing::warn;

/// How long an answer is remembered: a granted one for a minute, a refused one briefly
/// (a binding just made should work soon).
const ALLOWED_FOR: Duration = Duration::from_secs(60);
const REFUSED_FOR: Duration = Duration::from_secs(10);
/// At most this many answers of each kind are remembered; past it the expired go, then
/// the oldest.
const REMEMBERED: usize = 256;
/// Reviews asked of the API server per second, and how many may be saved up.
const REVIEWS_PER_SECOND: u32 = 5;
const REVIEW_BURST: u32 = 20;
/// How long one caller waits for its reviews.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);

/// What the caller is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// 200: allowed.
    Allowed,
    /// 401: no token, or one the API server does not know.
    Unauthenticated,
    /// 403: a known user without `get` on `/metrics`.
    Forbidden,
    /// 503: the API server could not be asked.
    Unavailable,
}

pub struct MetricsAuth {
    client: kube::Client,
    /// Answers by the token's keyed hash (the token itself is not kept): allowed ones
    /// apart from refused ones.
    allowed: Mutex<Remembered>,
    refused: Mutex<Remembered>,
    hasher: RandomState,
    reviews: DefaultDirectRateLimiter,
}

/// Answers until they expire, at most [`REMEMBERED`].
#[derive(Default)]
struct Remembered(HashMap<u64, (Verdict, Instant)>);

impl Remembered {
    fn get(&self, key: u64, now: Instant) -> Option<Verdict> {
        self.0.get(&key).filter(|(_, until)| now < *until).map(|(v, _)| *v)
    }

    fn insert(&mut self, key: u64, verdict: Verdict, until: Instant, now: Instant) {
        if self.0.len() >= REMEMBERED && !self.0.contains_key(&key) {
            self.0.retain(|_, (_, until)| now < *until);
            if self.0.len() >= REMEMBERED
                && let Some(oldest) = self.0.iter().min_by_key(|(_, (_, until))| *until).map(|(k, _)| *k)
            {
                self.0.remove(&oldest);
            }
        }
        self.0.insert(key, (verdict, until));
    }
}

impl MetricsAuth {
    /// `client` is the reviews' own (its own rate limit and connections).
    pub fn new(client: kube::Client) -> Self {
        let quota = Quota::per_second(NonZeroU32::new(REVIEWS_PER_SECOND).expect("positive"))
            .allow_burst(NonZeroU32::new(REVIEW_BURST).expect("positive"));
        MetricsAuth {
            client,
            allowed: Mutex::new(Remembered::default()),
            refused: Mutex::new(Remembered::default()),
            hasher: RandomState::new(),
            reviews: RateLimiter::direct(quota),
        }
    }

    /// Whether the request with this `Authorization` header may read `path`.
    pub async fn check(&self, authorization: Option<&str>, path: &str) -> Verdict {
        let Some(token) = authorization
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
        else {
            return Verdict::Unauthenticated;
        };
        let key = self.hasher.hash_one((token, path));
        let now = Instant::now();
        for memory in [&self.allowed, &self.refused] {
            if let Some(verdict) = memory.lock().expect("auth memory").get(key, now) {
                return verdict;
            }
        }
        if self.reviews.check().is_err() {
            // Others spend the reviews: a scraper allowed before stays allowed meanwhile
            // (its answer is a little stale), anyone else waits.
            let stale = self.allowed.lock().expect("auth memory").0.get(&key).map(|(v, _)| *v);
            return stale.unwrap_or(Verdict::Unavailable);
        }
        let verdict = match tokio::time::timeout(REVIEW_TIMEOUT, self.ask(token, path)).await {
            Ok(verdict) => verdict,
            Err(_) => Verdict::Unavailable,
        };
        let (memory, keep) = match verdict {
            Verdict::Allowed => (&self.allowed, ALLOWED_FOR),
            Verdict::Unauthenticated | Verdict::Forbidden => (&self.refused, REFUSED_FOR),
            Verdict::Unavailable => return verdict,
        };
        let now = Instant::now();
        memory
            .lock()
            .expect("auth memory")
            .insert(key, verdict, now + keep, now);
        verdict
    }

    async fn ask(&self, token: &str, path: &str) -> Verdict {
        let reviews: Api<TokenReview> = Api::all(self.client.clone());
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_string(),
                audiences: None,
            },
            ..TokenReview::default()
        };
        let user = match reviews.create(&PostParams::default(), &review).await {
            Ok(review) => match review
                .status
                .filter(|s| s.authenticated == Some(true))
                .and_then(|s| s.user)
            {
                Some(user) => user,
                None => return Verdict::Unauthenticated,
            },
            Err(e) => {
                warn!(error = %e, "a TokenReview for /metrics failed");
                return Verdict::Unavailable;
            }
        };
        let access: Api<SubjectAccessReview> = Api::all(self.client.clone());
        let question = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                uid: user.uid,
                groups: user.groups,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(path.to_string()),
                    verb: Some("get".to_string()),
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        match access.create(&PostParams::default(), &question).await {
            Ok(answer) if answer.status.as_ref().is_some_and(|s| s.allowed) => Verdict::Allowed,
            Ok(_) => Verdict::Forbidden,
            Err(e) => {
                warn!(error = %e, "a SubjectAccessReview for /metrics failed");
                Verdict::Unavailable
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_memory_drops_the_expired_then_the_oldest() {
        let now = Instant::now();
        let mut memory = Remembered::default();
        for key in 0..REMEMBERED as u64 {
            memory.insert(key, Verdict::Forbidden, now + Duration::from_secs(10 + key), now);
        }
        memory.insert(1_000, Verdict::Forbidden, now + Duration::from_secs(5), now);
        assert_eq!(memory.0.len(), REMEMBERED);
        assert_eq!(memory.get(0, now), None, "the oldest went");
        assert_eq!(memory.get(1, now), Some(Verdict::Forbidden));
        let later = now + Duration::from_secs(12);
        memory.insert(2_000, Verdict::Forbidden, later + Duration::from_secs(10), later);
        assert_eq!(
            memory.0.len(),
            REMEMBERED - 2,
            "the expired went (1, 1000 and 2 no longer hold)"
        );
        assert_eq!(memory.get(2_000, later), Some(Verdict::Forbidden));
    }
}
