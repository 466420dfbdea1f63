//! Namespaces seen refusing new objects because they are being deleted. Deleting a
//! namespace deletes its gangs' pods while the gangs are still there, and every pod's
//! deletion would have the Workload controller ask to make them again, to be refused
//! again: once one create is refused so, no gang of that namespace asks again for a
//! while. A namespace never stops terminating; the mark lapses only for one of the same
//! name made again after the old one is gone.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a namespace seen terminating is not asked again.
pub const QUIET_FOR: Duration = Duration::from_secs(30);
/// Namespaces remembered at most at a time.
const MAX_REMEMBERED: usize = 10_000;

#[derive(Default)]
pub struct TerminatingNamespaces {
    seen: Mutex<HashMap<String, Instant>>,
}

impl TerminatingNamespaces {
    /// `namespace` refused a create because it is being deleted, at `now`.
    pub fn refused(&self, namespace: &str, now: Instant) {
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.len() >= MAX_REMEMBERED {
            seen.retain(|_, at| now.saturating_duration_since(*at) < QUIET_FOR);
        }
        seen.insert(namespace.to_string(), now);
    }

    /// How much longer `namespace` is not asked for new objects, if it was seen
    /// terminating lately.
    pub fn quiet_for(&self, namespace: &str, now: Instant) -> Option<Duration> {
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = *seen.get(namespace)?;
        let left = QUIET_FOR.checked_sub(now.saturating_duration_since(at));
        match left {
            Some(left) if !left.is_zero() => Some(left),
            _ => {
                seen.remove(namespace);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_seen_terminating_is_quiet_for_a_while_then_asked_again() {
        let namespaces = TerminatingNamespaces::default();
        let start = Instant::now();
        assert_eq!(namespaces.quiet_for("team", start), None);
        namespaces.refused("team", start);
        assert_eq!(namespaces.quiet_for("team", start), Some(QUIET_FOR));
        assert_eq!(
            namespaces.quiet_for("team", start + Duration::from_secs(10)),
            Some(QUIET_FOR - Duration::from_secs(10))
        );
        assert_eq!(namespaces.quiet_for("other", start), None, "only that namespace");
        assert_eq!(namespaces.quiet_for("team", start + QUIET_FOR), None);
        assert_eq!(namespaces.quiet_for("team", start), None, "forgotten once lapsed");
    }
}
