//! Gauges read fresh at every scrape from the operator's caches, rather than kept up to
//! date by the code that changes them: a scrape always sees one consistent reading, and
//! a label set that no longer applies (a namespace with no waiting gang) disappears.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;

/// What the live gauges show at one instant.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Readings {
    /// Gangs waiting for admission, by (namespace, reason).
    pub pending: BTreeMap<(String, String), i64>,
    /// Longest wait of a gang waiting for admission, by namespace, in seconds.
    pub pending_longest_wait: BTreeMap<String, f64>,
    /// Gangs by the admission state recorded in their placement.
    pub states: BTreeMap<String, i64>,
    /// Longest time a gang has been in each admission state, in seconds.
    pub state_longest: BTreeMap<String, f64>,
    /// Devices allocated to claims muster reserved, by DeviceClass.
    pub reserved_by_class: BTreeMap<String, i64>,
    /// Devices published by ResourceSlices, by driver.
    pub devices_by_driver: BTreeMap<String, DeviceCounts>,
}

/// One driver's published devices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounts {
    /// Allocated to some claim (muster's or anyone's).
    pub in_use: i64,
    pub free: i64,
}

/// Where the readings come from: the leader's caches.
pub trait Source: Send + Sync {
    fn read(&self) -> Readings;
}

/// The collector registered once; the source is plugged in when the operator leads.
#[derive(Clone, Default)]
pub struct LiveGauges {
    source: Arc<RwLock<Option<Arc<dyn Source>>>>,
}

impl std::fmt::Debug for LiveGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveGauges").finish_non_exhaustive()
    }
}

impl LiveGauges {
    /// Reads from `source` from now on; `None` stops reading (the gauges go empty, as a
    /// follower has nothing to report).
    pub fn set_source(&self, source: Option<Arc<dyn Source>>) {
        *self.source.write().expect("live gauges source") = source;
    }
}

/// Names and help of the live gauges, for the registry and the metrics test.
pub const PENDING: &str = "muster_pending_gangs";
pub const PENDING_LONGEST_WAIT: &str = "muster_pending_gangs_longest_wait_seconds";
pub const STATES: &str = "muster_gang_states";
pub const STATE_LONGEST: &str = "muster_gang_state_longest_seconds";
pub const RESERVED: &str = "muster_reserved_devices_by_class";
pub const DEVICES: &str = "muster_devices";

fn gauge_family<L, V>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, V)>,
) -> Result<(), std::fmt::Error>
where
    L: prometheus_client::encoding::EncodeLabelSet,
    V: prometheus_client::encoding::EncodeGaugeValue,
{
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in samples {
        let family = metric.encode_family(&labels)?;
        ConstGauge::new(value).encode(family)?;
    }
    Ok(())
}

impl Collector for LiveGauges {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let source = self.source.read().expect("live gauges source").clone();
        let readings = source.map(|s| s.read()).unwrap_or_default();
        gauge_family(
            &mut encoder,
            PENDING,
            "Gangs waiting for admission, by namespace and the reason of their Admitted condition",
            readings
                .pending
                .iter()
                .map(|((namespace, reason), n)| ([("namespace", namespace.as_str()), ("reason", reason.as_str())], *n)),
        )?;
        gauge_family(
            &mut encoder,
            PENDING_LONGEST_WAIT,
            "Longest time a gang of the namespace has waited for admission",
            readings
                .pending_longest_wait
                .iter()
                .map(|(namespace, s)| ([("namespace", namespace.as_str())], *s)),
        )?;
        gauge_family(
            &mut encoder,
            STATES,
            "Gangs by the admission state recorded in their placement",
            readings
                .states
                .iter()
                .map(|(state, n)| ([("state", state.as_str())], *n)),
        )?;
        gauge_family(
            &mut encoder,
            STATE_LONGEST,
            "Longest time a gang has been in its current admission state, by state",
            readings
                .state_longest
                .iter()
                .map(|(state, s)| ([("state", state.as_str())], *s)),
        )?;
        gauge_family(
            &mut encoder,
            RESERVED,
            "Devices allocated to the claims muster reserved for gangs, by DeviceClass",
            readings
                .reserved_by_class
                .iter()
                .map(|(class, n)| ([("device_class", class.as_str())], *n)),
        )?;
        gauge_family(
            &mut encoder,
            DEVICES,
            "Devices published by ResourceSlices, by driver and whether a claim holds them",
            readings.devices_by_driver.iter().flat_map(|(driver, counts)| {
                [
                    ([("driver", driver.as_str()), ("state", "in_use")], counts.in_use),
                    ([("driver", driver.as_str()), ("state", "free")], counts.free),
                ]
            }),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    struct Fixed(Readings);

    impl Source for Fixed {
        fn read(&self) -> Readings {
            self.0.clone()
        }
    }

    fn encode(gauges: &LiveGauges) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(gauges.clone()));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    #[test]
    fn without_a_source_every_gauge_is_described_and_empty() {
        let text = encode(&LiveGauges::default());
        for name in [PENDING, PENDING_LONGEST_WAIT, STATES, STATE_LONGEST, RESERVED, DEVICES] {
            assert!(text.contains(&format!("# TYPE {name} gauge")), "{text}");
        }
        assert!(!text.lines().any(|l| l.starts_with("muster_")), "{text}");
    }

    #[test]
    fn readings_become_labelled_samples_and_vanish_with_the_source() {
        let gauges = LiveGauges::default();
        let mut readings = Readings::default();
        readings.pending.insert(("team-a".into(), "Unschedulable".into()), 3);
        readings.pending_longest_wait.insert("team-a".into(), 42.5);
        readings.states.insert("Released".into(), 2);
        readings.state_longest.insert("Released".into(), 7.0);
        readings.reserved_by_class.insert("gpu.example.com".into(), 16);
        readings
            .devices_by_driver
            .insert("gpu.example.com".into(), DeviceCounts { in_use: 16, free: 112 });
        gauges.set_source(Some(Arc::new(Fixed(readings))));
        let text = encode(&gauges);
        for sample in [
            "muster_pending_gangs{namespace=\"team-a\",reason=\"Unschedulable\"} 3",
            "muster_pending_gangs_longest_wait_seconds{namespace=\"team-a\"} 42.5",
            "muster_gang_states{state=\"Released\"} 2",
            "muster_gang_state_longest_seconds{state=\"Released\"} 7.0",
            "muster_reserved_devices_by_class{device_class=\"gpu.example.com\"} 16",
            "muster_devices{driver=\"gpu.example.com\",state=\"in_use\"} 16",
            "muster_devices{driver=\"gpu.example.com\",state=\"free\"} 112",
        ] {
            assert!(text.contains(sample), "{sample} missing from\n{text}");
        }
        gauges.set_source(None);
        assert!(!encode(&gauges).contains("team-a"));
    }
}
