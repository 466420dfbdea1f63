//! Namespaces seen refusing new objects because they are being deleted. Deleting a
//! namespace deletes its gangs' pods while the gangs are still there, and every pod's
//! deletion would have the Workload controller ask to make them again, to be refused
//! again: once one create is refused so, no gang of that namespace made before the
//! refusal asks again for a while. A namespace never stops terminating, and refuses new
//! Workloads too: a Workload made after the refusal is in a namespace of the same name
//! made again, and is not held back.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

/// How long a namespace seen terminating is not asked again.
pub const QUIET_FOR: Duration = Duration::from_secs(30);
/// Namespaces remembered at most at a time.
const MAX_REMEMBERED: usize = 10_000;

/// A creation time may be this much later than the clock read at a refusal and still
/// come before it: the API server keeps whole seconds.
const CREATION_PRECISION: Duration = Duration::from_secs(1);

#[derive(Default)]
pub struct TerminatingNamespaces {
    /// When each namespace refused, by this process's monotonic and wall clocks.
    seen: Mutex<HashMap<String, (Instant, SystemTime)>>,
}

impl TerminatingNamespaces {
    /// `namespace` refused a create because it is being deleted, at `now` (`wall` on the
    /// wall clock).
    pub fn refused(&self, namespace: &str, now: Instant, wall: SystemTime) {
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.len() >= MAX_REMEMBERED {
            seen.retain(|_, (at, _)| now.saturating_duration_since(*at) < QUIET_FOR);
        }
        seen.insert(namespace.to_string(), (now, wall));
    }

    /// `namespace` refused a create because it is being deleted, just now.
    pub fn refused_now(&self, namespace: &str) {
        self.refused(namespace, Instant::now(), SystemTime::now());
    }

    /// How much longer a gang of `namespace` made at `created` is not to ask for new
    /// objects: while the namespace was seen terminating lately, and the gang was made
    /// before that (unknown: held back).
    pub fn quiet_for(&self, namespace: &str, now: Instant, created: Option<SystemTime>) -> Option<Duration> {
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (at, wall) = *seen.get(namespace)?;
        if created.is_some_and(|created| created >= wall + CREATION_PRECISION) {
            return None;
        }
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
        let (start, wall) = (Instant::now(), SystemTime::now());
        let before = Some(wall - Duration::from_secs(60));
        assert_eq!(namespaces.quiet_for("team", start, before), None);
        namespaces.refused("team", start, wall);
        assert_eq!(namespaces.quiet_for("team", start, before), Some(QUIET_FOR));
        assert_eq!(namespaces.quiet_for("team", start, None), Some(QUIET_FOR));
        assert_eq!(
            namespaces.quiet_for("team", start + Duration::from_secs(10), before),
            Some(QUIET_FOR - Duration::from_secs(10))
        );
        assert_eq!(
            namespaces.quiet_for("other", start, before),
            None,
            "only that namespace"
        );
        assert_eq!(namespaces.quiet_for("team", start + QUIET_FOR, before), None);
        assert_eq!(
            namespaces.quiet_for("team", start, before),
            None,
            "forgotten once lapsed"
        );
    }

    #[test]
    fn a_gang_made_after_the_refusal_is_in_a_namespace_made_again_and_asks() {
        let namespaces = TerminatingNamespaces::default();
        let (start, wall) = (Instant::now(), SystemTime::now());
        namespaces.refused("demo", start, wall);
        let later = Some(wall + Duration::from_secs(5));
        assert_eq!(
            namespaces.quiet_for("demo", start + Duration::from_secs(5), later),
            None
        );
        // Within the second of the refusal, it may be either: held back, as the older.
        assert!(namespaces.quiet_for("demo", start, Some(wall)).is_some());
    }
}
