//! `/metrics` behind Kubernetes' own authentication and authorization, as kube-rbac-proxy
//! does it: the caller's bearer token goes to a TokenReview, and the user it names must
//! be allowed `get` on the non-resource URL `/metrics` by a SubjectAccessReview. Answers
//! are remembered for a short while, so a scrape every few seconds costs the API server
//! two requests a minute per scraper.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::api::{Api, PostParams};
use tracing::warn;

/// How long an answer is remembered: a granted one for a minute, a refused one briefly
/// (a binding just made should work soon).
const ALLOWED_FOR: Duration = Duration::from_secs(60);
const REFUSED_FOR: Duration = Duration::from_secs(5);
/// At most this many callers are remembered; past it the memory starts afresh.
const REMEMBERED: usize = 256;

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
    /// Answers by the token's keyed hash (the token itself is not kept).
    remembered: Mutex<HashMap<u64, (Verdict, Instant)>>,
    hasher: RandomState,
}

impl MetricsAuth {
    pub fn new(client: kube::Client) -> Self {
        MetricsAuth {
            client,
            remembered: Mutex::new(HashMap::new()),
            hasher: RandomState::new(),
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
        if let Some((verdict, until)) = self.remembered.lock().expect("auth memory").get(&key).copied()
            && Instant::now() < until
        {
            return verdict;
        }
        let verdict = self.ask(token, path).await;
        let keep = match verdict {
            Verdict::Allowed => ALLOWED_FOR,
            Verdict::Unauthenticated | Verdict::Forbidden => REFUSED_FOR,
            Verdict::Unavailable => return verdict,
        };
        let mut remembered = self.remembered.lock().expect("auth memory");
        if remembered.len() >= REMEMBERED {
            remembered.clear();
        }
        remembered.insert(key, (verdict, Instant::now() + keep));
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
