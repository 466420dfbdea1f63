//! The failure policy's rules: given how the pod that ended an attempt failed, whether
//! the gang fails at once, restarts counting against `maxRestarts`, or restarts without
//! counting; and how long the next attempt waits.

use crate::Millis;

/// What a matching rule makes the gang do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureAction {
    FailGang,
    RestartGang,
    /// Restart without counting against `maxRestarts`.
    RestartUncounted,
}

/// How a pod's failure came about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// A container failed.
    PodFailed,
    /// The kubelet or the Eviction API evicted it.
    Evicted,
    /// kube-scheduler preempted it.
    Preempted,
    /// Its `activeDeadlineSeconds` passed.
    DeadlineExceeded,
    /// Its node is gone or not ready.
    NodeLost,
    /// It disappeared or was deleted while it ran.
    PodLost,
}

/// `onExitCodes`: `In` (`within`) or `NotIn` the values, of one container or any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExitCodes {
    pub container: Option<String>,
    pub within: bool,
    pub values: Vec<i32>,
}

/// One rule; every criterion it sets must match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailureRule {
    pub name: Option<String>,
    pub action: FailureAction,
    pub exit_codes: Option<ExitCodes>,
    /// `(type, status)` conditions the pod must all have.
    pub conditions: Vec<(String, String)>,
    /// Kinds of failure, any of which matches; empty: any kind.
    pub kinds: Vec<FailureKind>,
    /// Groups whose pods it applies to; empty: every group.
    pub groups: Vec<String>,
}

/// What is known of the pod whose failure ended the attempt.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Failure {
    pub group: Option<String>,
    pub kind: Option<FailureKind>,
    /// Exit codes of its terminated containers, by container name.
    pub exit_codes: Vec<(String, i32)>,
    /// Its conditions, `(type, status)`.
    pub conditions: Vec<(String, String)>,
}

impl FailureRule {
    pub fn matches(&self, failure: &Failure) -> bool {
        let group = self.groups.is_empty()
            || failure
                .group
                .as_ref()
                .is_some_and(|g| self.groups.iter().any(|r| r == g));
        let kind = self.kinds.is_empty() || failure.kind.is_some_and(|k| self.kinds.contains(&k));
        let conditions = self.conditions.iter().all(|wanted| failure.conditions.contains(wanted));
        let exit_codes = self.exit_codes.as_ref().is_none_or(|codes| {
            failure
                .exit_codes
                .iter()
                .filter(|(container, _)| codes.container.as_ref().is_none_or(|c| c == container))
                // A container that succeeded is not what failed, whatever the operator.
                .filter(|(_, code)| *code != 0)
                .any(|(_, code)| codes.values.contains(code) == codes.within)
        });
        group && kind && conditions && exit_codes
    }
}

/// The first rule that matches decides; none: a restart that counts. Returns the action
/// and the name of the rule that chose it.
pub fn action_for<'r>(rules: &'r [FailureRule], failure: &Failure) -> (FailureAction, Option<&'r str>) {
    rules
        .iter()
        .find(|r| r.matches(failure))
        .map_or((FailureAction::RestartGang, None), |r| (r.action, r.name.as_deref()))
}

/// `restartBackoff`: the wait before the next attempt, doubling from `initial` with each
/// restart made so far, at most `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Millis,
    pub max: Millis,
}

impl Backoff {
    /// The wait before attempt `restarts + 1` (`restarts` restarts made before this one).
    pub fn before_restart(&self, restarts: i32) -> Millis {
        let doublings = u32::try_from(restarts.max(0)).unwrap_or(0).min(40);
        self.initial.saturating_mul(1i64 << doublings).min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(action: FailureAction) -> FailureRule {
        FailureRule {
            name: None,
            action,
            exit_codes: None,
            conditions: vec![],
            kinds: vec![],
            groups: vec![],
        }
    }

    fn failed(group: &str, codes: &[(&str, i32)]) -> Failure {
        Failure {
            group: Some(group.into()),
            kind: Some(FailureKind::PodFailed),
            exit_codes: codes.iter().map(|(c, e)| (c.to_string(), *e)).collect(),
            conditions: vec![],
        }
    }

    #[test]
    fn exit_codes_in_and_not_in_of_any_or_one_container() {
        let fatal = FailureRule {
            exit_codes: Some(ExitCodes {
                container: None,
                within: true,
                values: vec![42],
            }),
            ..rule(FailureAction::FailGang)
        };
        assert!(fatal.matches(&failed("workers", &[("main", 42)])));
        assert!(fatal.matches(&failed("workers", &[("sidecar", 0), ("main", 42)])));
        assert!(!fatal.matches(&failed("workers", &[("main", 1)])));

        let of_main = FailureRule {
            exit_codes: Some(ExitCodes {
                container: Some("main".into()),
                within: false,
                values: vec![1, 2],
            }),
            ..rule(FailureAction::FailGang)
        };
        assert!(of_main.matches(&failed("workers", &[("main", 137)])));
        assert!(!of_main.matches(&failed("workers", &[("main", 2)])));
        assert!(
            !of_main.matches(&failed("workers", &[("sidecar", 137)])),
            "another container"
        );
        // A container that exited 0 is not the failure, even for NotIn.
        assert!(!of_main.matches(&failed("workers", &[("main", 0)])));
    }

    #[test]
    fn every_criterion_must_match() {
        let disruption = FailureRule {
            conditions: vec![("DisruptionTarget".into(), "True".into())],
            kinds: vec![FailureKind::Evicted, FailureKind::Preempted],
            groups: vec!["workers".into()],
            ..rule(FailureAction::RestartUncounted)
        };
        let mut evicted = Failure {
            group: Some("workers".into()),
            kind: Some(FailureKind::Evicted),
            exit_codes: vec![],
            conditions: vec![("DisruptionTarget".into(), "True".into())],
        };
        assert!(disruption.matches(&evicted));
        evicted.group = Some("launcher".into());
        assert!(!disruption.matches(&evicted), "another group");
        evicted.group = Some("workers".into());
        evicted.conditions.clear();
        assert!(!disruption.matches(&evicted), "no DisruptionTarget");
        evicted.conditions = vec![("DisruptionTarget".into(), "True".into())];
        evicted.kind = Some(FailureKind::NodeLost);
        assert!(!disruption.matches(&evicted), "another kind");
    }

    #[test]
    fn the_first_matching_rule_decides_and_none_restarts_counting() {
        let rules = vec![
            FailureRule {
                name: Some("node-loss".into()),
                kinds: vec![FailureKind::NodeLost],
                ..rule(FailureAction::RestartUncounted)
            },
            FailureRule {
                name: Some("any-node-or-bug".into()),
                kinds: vec![FailureKind::NodeLost, FailureKind::PodFailed],
                ..rule(FailureAction::FailGang)
            },
        ];
        let lost = Failure {
            kind: Some(FailureKind::NodeLost),
            ..Failure::default()
        };
        assert_eq!(
            action_for(&rules, &lost),
            (FailureAction::RestartUncounted, Some("node-loss"))
        );
        assert_eq!(
            action_for(&rules, &failed("w", &[("main", 1)])),
            (FailureAction::FailGang, Some("any-node-or-bug"))
        );
        let evicted = Failure {
            kind: Some(FailureKind::Evicted),
            ..Failure::default()
        };
        assert_eq!(action_for(&rules, &evicted), (FailureAction::RestartGang, None));
        assert_eq!(action_for(&[], &lost), (FailureAction::RestartGang, None));
    }

    #[test]
    fn backoff_doubles_from_the_first_restart_up_to_the_cap() {
        let backoff = Backoff {
            initial: 10_000,
            max: 60_000,
        };
        let waits: Vec<Millis> = (0..6).map(|r| backoff.before_restart(r)).collect();
        assert_eq!(waits, [10_000, 20_000, 40_000, 60_000, 60_000, 60_000]);
        assert_eq!(backoff.before_restart(i32::MAX), 60_000);
        assert_eq!(backoff.before_restart(-1), 10_000);
    }
}
