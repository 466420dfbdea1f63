//! How often the Workload controller writes a Workload's status. A gang's pods are
//! created, released and become ready in bursts, each pod a watch event, and admission
//! moves the gang through its steps within a second: writing each would cost the API
//! server several writes per pod. Milestones are written at once (the first status, a
//! condition turning, Running, a terminal phase, a new generation); counts, messages and
//! the steps between Queued and Admitted wait out an interval, riding along with the
//! next write.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use muster_api::v1alpha1::{WorkloadPhase, WorkloadStatus};

/// The shortest time between two status writes of one Workload that can wait.
pub const INTERVAL: Duration = Duration::from_secs(1);

/// The status last written for each Workload, by uid.
#[derive(Debug, Default)]
pub struct StatusPacer {
    written: Mutex<Written>,
}

#[derive(Debug, Default)]
struct Written {
    at: HashMap<String, LastWrite>,
    pruned: Option<Instant>,
}

#[derive(Debug)]
struct LastWrite {
    at: Instant,
    /// The resourceVersion the write returned.
    version: Option<u64>,
    /// The status it wrote.
    status: WorkloadStatus,
    /// A later write was put off and is still to come.
    put_off: bool,
}

impl StatusPacer {
    /// How long a write of `uid` that can wait must still wait, if at all.
    pub fn wait(&self, uid: &str, now: Instant) -> Option<Duration> {
        let written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        let since = now.saturating_duration_since(written.at.get(uid)?.at);
        (since < INTERVAL).then(|| INTERVAL - since)
    }

    /// What this process last wrote for `uid`, if the cached copy (at `cached_version`)
    /// predates that write: the baseline to decide against until the cache catches up.
    pub fn newer_than_cache(&self, uid: &str, cached_version: Option<&str>) -> Option<WorkloadStatus> {
        let written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        let last = written.at.get(uid)?;
        let cached = cached_version.and_then(|v| v.parse::<u64>().ok())?;
        (cached < last.version?).then(|| last.status.clone())
    }

    /// Notes that a write of `uid` was put off.
    pub fn put_off(&self, uid: &str) {
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(last) = written.at.get_mut(uid) {
            last.put_off = true;
        }
    }

    /// When a write of `uid` that was put off is due (at once if it is late), so that a
    /// failing reconcile retries no later than that.
    pub fn put_off_due(&self, uid: &str, now: Instant) -> Option<Duration> {
        let written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        let last = written.at.get(uid).filter(|last| last.put_off)?;
        Some(INTERVAL.saturating_sub(now.saturating_duration_since(last.at)))
    }

    /// Notes a status write of `uid`; `version` is the resourceVersion it returned.
    pub fn wrote(&self, uid: &str, now: Instant, version: Option<&str>, status: &WorkloadStatus) {
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        let last = LastWrite {
            at: now,
            version: version.and_then(|v| v.parse().ok()),
            status: status.clone(),
            put_off: false,
        };
        written.at.insert(uid.to_string(), last);
        // A minute after its write an entry decides nothing (the cache has caught up and
        // the interval is long over): drop such entries now and then, so that deleted
        // Workloads do not pile up.
        if written
            .pruned
            .is_none_or(|at| now.saturating_duration_since(at) >= INTERVAL * 60)
        {
            written
                .at
                .retain(|_, last| now.saturating_duration_since(last.at) < INTERVAL * 60);
            written.pruned = Some(now);
        }
    }
}

/// Whether going from `current` to `desired` can wait: no condition turns, the
/// generation is the same, and the phase stays among the steps before a gang runs.
pub fn can_wait(current: &WorkloadStatus, desired: &WorkloadStatus) -> bool {
    let step = |phase: Option<WorkloadPhase>| {
        matches!(
            phase,
            Some(WorkloadPhase::Queued | WorkloadPhase::Pending | WorkloadPhase::Admitted)
        )
    };
    fn turns(status: &WorkloadStatus) -> Vec<(&str, &str)> {
        let mut turns: Vec<(&str, &str)> = status
            .conditions
            .iter()
            .map(|c| (c.type_.as_str(), c.status.as_str()))
            .collect();
        turns.sort_unstable();
        turns
    }
    current.observed_generation == desired.observed_generation
        && (current.phase == desired.phase || (step(current.phase) && step(desired.phase)))
        && turns(current) == turns(desired)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    use k8s_openapi::jiff::Timestamp;
    use muster_api::v1alpha1::PodGroupStatus;

    use super::*;

    fn status(phase: WorkloadPhase, ready: i32) -> WorkloadStatus {
        let all = ready == 4;
        WorkloadStatus {
            observed_generation: Some(1),
            phase: Some(phase),
            pods: 4,
            ready_pods: ready,
            pod_groups: vec![PodGroupStatus {
                name: "workers".into(),
                replicas: 4,
                created: 4,
                ready,
                ..Default::default()
            }],
            conditions: vec![Condition {
                type_: "PodsReady".into(),
                status: if all { "True" } else { "False" }.into(),
                reason: if all { "PodsReady" } else { "PodsNotReady" }.into(),
                message: format!("{ready} of 4 pods are ready"),
                last_transition_time: Time(Timestamp::UNIX_EPOCH),
                observed_generation: Some(1),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn a_second_write_that_can_wait_waits_out_the_interval() {
        let pacer = StatusPacer::default();
        let start = Instant::now();
        assert_eq!(pacer.wait("a", start), None, "never written");
        pacer.wrote("a", start, Some("10"), &status(WorkloadPhase::Queued, 0));
        let later = start + Duration::from_millis(300);
        assert_eq!(pacer.wait("a", later), Some(Duration::from_millis(700)));
        assert_eq!(pacer.wait("b", later), None, "per Workload");
        assert_eq!(pacer.wait("a", start + INTERVAL), None);
    }

    #[test]
    fn a_stale_cache_is_judged_by_what_was_written_last() {
        let pacer = StatusPacer::default();
        let queued = status(WorkloadPhase::Queued, 0);
        pacer.wrote("a", Instant::now(), Some("10"), &queued);
        assert_eq!(
            pacer.newer_than_cache("a", Some("9")),
            Some(queued),
            "the cache predates the write"
        );
        assert_eq!(pacer.newer_than_cache("a", Some("10")), None, "the cache has it");
        assert_eq!(pacer.newer_than_cache("a", Some("11")), None, "someone wrote since");
        assert_eq!(pacer.newer_than_cache("b", Some("9")), None);
    }

    #[test]
    fn a_put_off_write_is_due_when_its_interval_ends() {
        let pacer = StatusPacer::default();
        let start = Instant::now();
        pacer.wrote("a", start, Some("10"), &status(WorkloadPhase::Queued, 0));
        assert_eq!(pacer.put_off_due("a", start), None, "nothing put off");
        pacer.put_off("a");
        let later = start + Duration::from_millis(400);
        assert_eq!(pacer.put_off_due("a", later), Some(Duration::from_millis(600)));
        assert_eq!(pacer.put_off_due("a", start + INTERVAL * 2), Some(Duration::ZERO));
        pacer.wrote("a", later, Some("11"), &status(WorkloadPhase::Pending, 0));
        assert_eq!(pacer.put_off_due("a", later), None, "written");
    }

    #[test]
    fn old_entries_are_dropped() {
        let pacer = StatusPacer::default();
        let start = Instant::now();
        let queued = status(WorkloadPhase::Queued, 0);
        pacer.wrote("gone", start, None, &queued);
        pacer.wrote("a", start + INTERVAL * 61, None, &queued);
        let written = pacer.written.lock().unwrap();
        assert!(!written.at.contains_key("gone"));
        assert!(written.at.contains_key("a"));
    }

    #[test]
    fn counts_and_the_steps_before_running_can_wait_and_milestones_cannot() {
        let admitted = status(WorkloadPhase::Admitted, 1);
        assert!(
            can_wait(&admitted, &status(WorkloadPhase::Admitted, 3)),
            "counts and messages"
        );
        assert!(can_wait(
            &status(WorkloadPhase::Queued, 0),
            &status(WorkloadPhase::Pending, 0)
        ));
        assert!(can_wait(&status(WorkloadPhase::Pending, 0), &admitted));
        assert!(!can_wait(&admitted, &status(WorkloadPhase::Running, 4)), "Running");
        assert!(
            !can_wait(&status(WorkloadPhase::Running, 4), &status(WorkloadPhase::Admitted, 3)),
            "a running gang losing a pod"
        );
        assert!(!can_wait(&admitted, &status(WorkloadPhase::Suspended, 1)));
        let mut regenerated = admitted.clone();
        regenerated.observed_generation = Some(2);
        assert!(!can_wait(&admitted, &regenerated), "a new generation is acknowledged");
    }
}
