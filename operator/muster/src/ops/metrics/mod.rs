//! The operator's Prometheus metrics, all prefixed `muster_`. One registry per process,
//! like the gangs it describes; served by [`crate::ops::serve`]. Labels stay bounded:
//! namespaces, reasons, states, classes and drivers, never a pod's or a Workload's name.

pub mod live;

use std::sync::LazyLock;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    pub phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

/// The PriorityClass a gang names (empty: none).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PriorityLabel {
    pub priority_class: String,
}

/// Why gangs were evicted: `Priority` (muster's own preemption for a gang of higher
/// priority) or the reason Kueue gave.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabel {
    pub cause: String,
}

/// What kind of failure a reconcile of a Workload ended with.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    pub verb: &'static str,
    /// `resource[/subresource][.group]`, as in RBAC rules.
    pub resource: String,
}

/// A request the API server refused or that did not reach it: `code` is the HTTP
/// status, or `transport`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiErrorLabels {
    pub verb: &'static str,
    pub resource: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabel {
    version: &'static str,
}

pub struct Metrics {
    registry: Registry,
    /// Engine time to plan one gang, by outcome (`placed`, `unschedulable`).
    pub plan_duration: Family<OutcomeLabel, Histogram>,
    /// Commit time of an admitted gang: from recording the plan to every pod released.
    pub commit_duration: Family<OutcomeLabel, Histogram>,
    /// From a Workload's creation to its gang's admission (first attempt), by the
    /// PriorityClass it names.
    pub submit_to_admitted: Family<PriorityLabel, Histogram>,
    /// From a Workload's creation to minCount pods of every group running (first
    /// attempt), by the PriorityClass it names.
    pub submit_to_running: Family<PriorityLabel, Histogram>,
    /// Workloads by phase.
    pub workloads: Family<PhaseLabel, Gauge>,
    /// Gangs waiting for admission.
    pub queue_length: Gauge,
    /// Time of one pass of the admission loop: the placed gangs' steps, planning and
    /// committing the queue.
    pub pass_duration: Histogram,
    /// Gangs whose claims were reserved, and the devices reserved for them.
    pub reservations: Counter,
    pub reserved_devices: Counter,
    /// Commits undone before release, by reason (`RolledBack`, `Conflict`, ...).
    pub rollbacks: Family<ReasonLabel, Counter>,
    /// Devices found taken by someone else after reserving.
    pub conflicts: Counter,
    /// Gangs evicted whole, by cause.
    pub preemptions: Family<CauseLabel, Counter>,
    /// Gang restarts, by reason.
    pub restarts: Family<ReasonLabel, Counter>,
    /// Released gangs torn down because their pods were not scheduled in time.
    pub schedule_timeouts: Counter,
    /// Released gangs (or extras) taken apart because kube-scheduler refused a pod on its
    /// planned node.
    pub scheduler_refusals: Counter,
    /// Pods beyond minCount placed after their gang started.
    pub extras_placed: Counter,
    /// 1 while this process holds the leader Lease (or runs without leader election).
    pub leader: Gauge,
    /// Requests to the API server, by RBAC verb and resource.
    pub api_requests: Family<ApiLabels, Counter>,
    /// AdmissionReviews the webhook answered.
    pub webhook_reviews: Counter,
    /// Requests the API server refused (by status code) or that failed on the way.
    pub api_errors: Family<ApiErrorLabels, Counter>,
    /// Reconciles of a Workload that failed, by kind of failure.
    pub reconcile_errors: Family<KindLabel, Counter>,
    /// Gauges read from the caches at each scrape.
    pub live: live::LiveGauges,
}

/// Buckets from 1 ms to about 9 minutes, doubling.
fn latency() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::default();
        let metrics = Metrics {
            plan_duration: Family::new_with_constructor(latency as fn() -> Histogram),
            commit_duration: Family::new_with_constructor(latency as fn() -> Histogram),
            submit_to_admitted: Family::new_with_constructor(latency as fn() -> Histogram),
            submit_to_running: Family::new_with_constructor(latency as fn() -> Histogram),
            workloads: Family::default(),
            queue_length: Gauge::default(),
            pass_duration: latency(),
            reservations: Counter::default(),
            reserved_devices: Counter::default(),
            rollbacks: Family::default(),
            conflicts: Counter::default(),
            preemptions: Family::default(),
            restarts: Family::default(),
            schedule_timeouts: Counter::default(),
            scheduler_refusals: Counter::default(),
            extras_placed: Counter::default(),
            leader: Gauge::default(),
            api_requests: Family::default(),
            webhook_reviews: Counter::default(),
            api_errors: Family::default(),
            reconcile_errors: Family::default(),
            live: live::LiveGauges::default(),
            registry: Registry::default(),
        };
        let build = Family::<VersionLabel, Gauge>::default();
        build
            .get_or_create(&VersionLabel {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register("muster_build_info", "The running muster version", build);
        registry.register(
            "muster_plan_duration_seconds",
            "Time the engine took to plan one gang, by outcome",
            metrics.plan_duration.clone(),
        );
        registry.register(
            "muster_commit_duration_seconds",
            "Time from recording a plan to releasing every pod of the gang, by outcome",
            metrics.commit_duration.clone(),
        );
        registry.register(
            "muster_submit_to_admitted_seconds",
            "Time from a Workload's creation to its gang's admission, by PriorityClass",
            metrics.submit_to_admitted.clone(),
        );
        registry.register(
            "muster_submit_to_running_seconds",
            "Time from a Workload's creation to minCount pods of every group running, by PriorityClass",
            metrics.submit_to_running.clone(),
        );
        registry.register("muster_workloads", "Workloads by phase", metrics.workloads.clone());
        registry.register(
            "muster_queue_length",
            "Gangs waiting for admission",
            metrics.queue_length.clone(),
        );
        registry.register(
            "muster_admission_pass_duration_seconds",
            "Time of one pass of the admission loop: the placed gangs' steps, then planning and committing the queue",
            metrics.pass_duration.clone(),
        );
        registry.register(
            "muster_reservations",
            "Gangs whose every claim was reserved",
            metrics.reservations.clone(),
        );
        registry.register(
            "muster_reserved_devices",
            "Devices reserved for admitted gangs",
            metrics.reserved_devices.clone(),
        );
        registry.register(
            "muster_rollbacks",
            "Commits undone before release, by reason",
            metrics.rollbacks.clone(),
        );
        registry.register(
            "muster_conflicts",
            "Commits undone because another claim held a planned device",
            metrics.conflicts.clone(),
        );
        registry.register(
            "muster_preemptions",
            "Gangs evicted whole, by cause: Priority (for a gang of higher priority) or Kueue's eviction reason",
            metrics.preemptions.clone(),
        );
        registry.register("muster_restarts", "Gang restarts, by reason", metrics.restarts.clone());
        registry.register(
            "muster_schedule_timeouts",
            "Released gangs torn down because kube-scheduler did not bind every pod in time",
            metrics.schedule_timeouts.clone(),
        );
        registry.register(
            "muster_scheduler_refusals",
            "Released gangs taken apart because kube-scheduler refused a pod on its planned node",
            metrics.scheduler_refusals.clone(),
        );
        registry.register(
            "muster_extras_placed",
            "Pods beyond minCount placed after their gang started",
            metrics.extras_placed.clone(),
        );
        registry.register(
            "muster_leader",
            "1 while this process is the leader",
            metrics.leader.clone(),
        );
        registry.register(
            "muster_api_requests",
            "Requests to the API server, by RBAC verb and resource",
            metrics.api_requests.clone(),
        );
        registry.register(
            "muster_webhook_reviews",
            "AdmissionReviews the webhook answered",
            metrics.webhook_reviews.clone(),
        );
        registry.register(
            "muster_api_errors",
            "Requests to the API server that it refused (by HTTP status code) or that failed on the way (code transport)",
            metrics.api_errors.clone(),
        );
        registry.register(
            "muster_reconcile_errors",
            "Reconciles of a Workload that failed, by kind of failure",
            metrics.reconcile_errors.clone(),
        );
        registry.register_collector(Box::new(metrics.live.clone()));
        metrics.start_at_zero();
        Metrics { registry, ..metrics }
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

/// The process's metrics.
pub fn get() -> &'static Metrics {
    &METRICS
}

pub fn seconds(duration: Duration) -> f64 {
    duration.as_secs_f64()
}

impl Metrics {
    /// Counters of the causes that are known up front start at zero, so that a rate
    /// over them is 0 rather than absent before the first event, and dashboards and
    /// alerts see the series from the first scrape on.
    fn start_at_zero(&self) {
        use muster_api::conditions;
        let _ = self.preemptions.get_or_create(&CauseLabel {
            cause: "Priority".into(),
        });
        for reason in [
            conditions::REASON_POD_FAILED,
            conditions::REASON_POD_LOST,
            conditions::REASON_NODE_LOST,
        ] {
            let _ = self.restarts.get_or_create(&ReasonLabel { reason: reason.into() });
        }
        for reason in [
            conditions::REASON_ROLLED_BACK,
            conditions::REASON_CONFLICT,
            conditions::REASON_SCHEDULE_TIMEOUT,
            conditions::REASON_RELEASE_TIMEOUT,
        ] {
            let _ = self.rollbacks.get_or_create(&ReasonLabel { reason: reason.into() });
        }
        // The client's failures, the common kind; others appear when they happen.
        let _ = self.reconcile_errors.get_or_create(&KindLabel { kind: "kube" });
    }

    /// Observes a gang's wait from creation to admission.
    pub fn observe_submit_to_admitted(&self, priority_class: Option<&str>, waited: Duration) {
        self.submit_to_admitted
            .get_or_create(&PriorityLabel {
                priority_class: priority_class.unwrap_or_default().to_string(),
            })
            .observe(waited.as_secs_f64());
    }

    /// Observes a gang's time from creation to running.
    pub fn observe_submit_to_running(&self, priority_class: Option<&str>, took: Duration) {
        self.submit_to_running
            .get_or_create(&PriorityLabel {
                priority_class: priority_class.unwrap_or_default().to_string(),
            })
            .observe(took.as_secs_f64());
    }

    /// Counts one gang evicted whole.
    pub fn count_preemption(&self, cause: &str) {
        self.preemptions
            .get_or_create(&CauseLabel {
                cause: cause.to_string(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_prefixed_and_described() {
        let m = get();
        m.plan_duration
            .get_or_create(&OutcomeLabel { outcome: "placed" })
            .observe(0.003);
        m.rollbacks
            .get_or_create(&ReasonLabel {
                reason: "Conflict".into(),
            })
            .inc();
        m.workloads
            .get_or_create(&PhaseLabel {
                phase: "Running".into(),
            })
            .set(2);
        let text = m.encode();
        for line in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
            assert!(line.starts_with("muster_"), "{line}");
        }
        assert!(text.contains("# HELP muster_plan_duration_seconds"), "{text}");
        assert!(
            text.contains("muster_plan_duration_seconds_count{outcome=\"placed\"} 1"),
            "{text}"
        );
        assert!(text.contains("muster_rollbacks_total{reason=\"Conflict\"} 1"), "{text}");
        assert!(text.contains("muster_workloads{phase=\"Running\"} 2"), "{text}");
        assert!(text.contains("muster_build_info{version="), "{text}");
    }
}
