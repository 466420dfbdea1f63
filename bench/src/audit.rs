//! Who wrote what to the API server during a phase, from kube-apiserver's audit log:
//! every write request in the phase's namespace with its client, resource, object and
//! time. It separates what each contender writes itself from what other clients
//! (kube-scheduler, kube-controller-manager, kwok, the benchmark) write because of it,
//! splits a gang's writes into admission (until its first pod ends or it is deleted) and
//! lifecycle (finish, deallocate, delete), and counts ResourceClaim status writes per
//! claim by writer.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::Path;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use serde::Deserialize;

/// Who made a request, by its User-Agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Client {
    Muster,
    Scheduler,
    ControllerManager,
    Kwok,
    /// The benchmark itself (creating and deleting gangs) and anything else.
    Other,
}

impl Client {
    pub const ALL: [Client; 5] = [
        Client::Muster,
        Client::Scheduler,
        Client::ControllerManager,
        Client::Kwok,
        Client::Other,
    ];

    pub fn of(user_agent: &str) -> Client {
        let agent = user_agent.to_ascii_lowercase();
        if agent.starts_with("muster/") {
            Client::Muster
        } else if agent.starts_with("kube-scheduler/") {
            Client::Scheduler
        } else if agent.starts_with("kube-controller-manager/") {
            Client::ControllerManager
        } else if agent.starts_with("kwok") {
            Client::Kwok
        } else {
            Client::Other
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Client::Muster => "muster",
            Client::Scheduler => "kube-scheduler",
            Client::ControllerManager => "kube-controller-manager",
            Client::Kwok => "kwok (kubelet)",
            Client::Other => "benchmark and others",
        }
    }
}

/// One write the API server served (or refused).
#[derive(Clone, Debug, PartialEq)]
pub struct Write {
    pub at: SystemTime,
    pub client: Client,
    pub verb: String,
    /// `resource[/subresource]`.
    pub resource: String,
    pub name: String,
    pub code: u16,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Event {
    stage: String,
    verb: String,
    #[serde(default)]
    user_agent: String,
    object_ref: Option<ObjectRef>,
    response_status: Option<Status>,
    request_received_timestamp: String,
}

#[derive(Deserialize)]
struct ObjectRef {
    #[serde(default)]
    resource: String,
    #[serde(default)]
    subresource: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    name: String,
}

#[derive(Deserialize)]
struct Status {
    #[serde(default)]
    code: u16,
}

/// The end of the audit log now, to read a phase's writes from later.
pub fn offset(log: &Path) -> u64 {
    std::fs::metadata(log).map(|m| m.len()).unwrap_or(0)
}

/// Writes in namespace `ns` logged after byte `from`.
pub fn read(log: &Path, from: u64, ns: &str) -> Result<Vec<Write>> {
    let mut file = std::fs::File::open(log).with_context(|| format!("opening {}", log.display()))?;
    file.seek(SeekFrom::Start(from))?;
    let mut writes = Vec::new();
    for line in BufReader::new(file).lines() {
        let line = line?;
        let Ok(event) = serde_json::from_str::<Event>(&line) else {
            continue;
        };
        if event.stage != "ResponseComplete" {
            continue;
        }
        let Some(object) = event.object_ref.filter(|o| o.namespace == ns) else {
            continue;
        };
        let Ok(at) = event.request_received_timestamp.parse::<k8s_openapi::jiff::Timestamp>() else {
            continue;
        };
        let resource = if object.subresource.is_empty() {
            object.resource
        } else {
            format!("{}/{}", object.resource, object.subresource)
        };
        writes.push(Write {
            at: SystemTime::from(at),
            client: Client::of(&event.user_agent),
            verb: event.verb,
            resource,
            name: object.name,
            code: event.response_status.map_or(0, |s| s.code),
        });
    }
    Ok(writes)
}

/// The gang an object belongs to: the longest gang name that is the object's name or
/// its prefix up to a `-` or `.` (pods, claims and events are named after their gang).
pub fn gang_of<'g>(name: &str, gangs_longest_first: &'g [String]) -> Option<&'g str> {
    gangs_longest_first
        .iter()
        .find(|g| {
            name.strip_prefix(g.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('-') || rest.starts_with('.'))
        })
        .map(String::as_str)
}

/// Whether a write counts as part of admitting its gang or of its life after.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// Getting the gang running, and holding it while it runs: until its first pod
    /// ends or it is deleted (the pod's own end, written by kwok, lands here too, being
    /// what the benchmark sees it by).
    Admission,
    /// After: finishing, deallocating, deleting, restarting after a failure.
    Lifecycle,
}

/// A phase's writes, counted. Only writes to the gangs' own objects count (pods and
/// their bindings and status, claims, Workloads, PodGroups, Services, events named after
/// them): the API server's idle background (node leases and status) is not in the phase's
/// namespace, and what is in it but belongs to no gang (claim templates, the benchmark's
/// sync markers) is counted apart in `unattributed`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WriteCounts {
    /// By client, stage and resource.
    pub by: BTreeMap<(Client, Stage, String), u64>,
    /// ResourceClaim status writes of each claim over its whole life, by client and
    /// stage; every claim written at all is here, with no status write if it had none
    /// (kube-controller-manager makes a new claim from the template for a pod that has
    /// ended, which it does not check, and deletes it at once: it is never allocated).
    pub claim_status: BTreeMap<String, BTreeMap<(Client, Stage), u64>>,
    /// Writes refused with 409 Conflict, by client.
    pub conflicts: BTreeMap<Client, u64>,
    /// Writes in the namespace to objects of no gang.
    pub unattributed: u64,
}

impl WriteCounts {
    /// Counts `writes`; `lifecycle_from` is when each gang's lifecycle began: its first
    /// pod ended or it was deleted (absent: never).
    pub fn of(writes: &[Write], gangs: &[String], lifecycle_from: &BTreeMap<String, SystemTime>) -> Self {
        let mut gangs: Vec<String> = gangs.to_vec();
        gangs.sort_by_key(|g| std::cmp::Reverse(g.len()));
        let mut counts = WriteCounts::default();
        for write in writes {
            // A create by generateName (kube-controller-manager's claims from templates)
            // is logged without a name; only gang objects are made that way here, and
            // before their gang's life ends, as a rule. Other writes without a name are
            // the namespace controller's deletecollection of every kind at the end.
            let gang = gang_of(&write.name, &gangs);
            let generated = write.name.is_empty() && write.verb == "create";
            if gang.is_none() && !generated {
                counts.unattributed += 1;
                continue;
            }
            let stage = match gang.and_then(|g| lifecycle_from.get(g)) {
                Some(from) if write.at >= *from => Stage::Lifecycle,
                _ => Stage::Admission,
            };
            *counts
                .by
                .entry((write.client, stage, write.resource.clone()))
                .or_default() += 1;
            if write.resource.starts_with("resourceclaims") && !write.name.is_empty() {
                let claim = counts.claim_status.entry(write.name.clone()).or_default();
                if write.resource == "resourceclaims/status" {
                    *claim.entry((write.client, stage)).or_default() += 1;
                }
            }
            if write.code == 409 {
                *counts.conflicts.entry(write.client).or_default() += 1;
            }
        }
        counts
    }

    /// Writes matching the filters (`None`: any).
    pub fn total(&self, client: Option<Client>, stage: Option<Stage>) -> u64 {
        self.by
            .iter()
            .filter(|((c, s, _), _)| client.is_none_or(|w| w == *c) && stage.is_none_or(|w| w == *s))
            .map(|(_, n)| n)
            .sum()
    }

    /// Mean and largest number of ResourceClaim status writes per claim, counting the
    /// writes `which` picks by client and stage, over every claim whose status was
    /// written at all (the claims that were allocated; see [`Self::claims_never_written`]).
    pub fn claim_status_per_claim(&self, which: impl Fn(Client, Stage) -> bool) -> Option<(f64, u64)> {
        let values: Vec<u64> = self
            .claim_status
            .values()
            .filter(|by| !by.is_empty())
            .map(|by| by.iter().filter(|((c, s), _)| which(*c, *s)).map(|(_, n)| n).sum())
            .collect();
        let max = values.iter().copied().max()?;
        Some((values.iter().sum::<u64>() as f64 / values.len() as f64, max))
    }

    /// Claims whose status was written, which [`Self::claim_status_per_claim`] averages over.
    pub fn claims_written(&self) -> usize {
        self.claim_status.values().filter(|by| !by.is_empty()).count()
    }

    /// Claims created and deleted with no status write in between.
    pub fn claims_never_written(&self) -> usize {
        self.claim_status.len() - self.claims_written()
    }

    /// [`Self::claim_status_per_claim`] over every client and stage.
    pub fn claim_status_per_claim_all(&self) -> Option<(f64, u64)> {
        self.claim_status_per_claim(|_, _| true)
    }
}

/// Who writes a claim's status, as the report splits them: muster, the two controllers
/// that reserve and release claims, and everyone else (kwok, the benchmark).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimWriter {
    Muster,
    ControllerManager,
    Scheduler,
    Others,
}

impl ClaimWriter {
    pub const ALL: [ClaimWriter; 4] = [
        ClaimWriter::Muster,
        ClaimWriter::ControllerManager,
        ClaimWriter::Scheduler,
        ClaimWriter::Others,
    ];

    pub fn of(client: Client) -> Self {
        match client {
            Client::Muster => ClaimWriter::Muster,
            Client::ControllerManager => ClaimWriter::ControllerManager,
            Client::Scheduler => ClaimWriter::Scheduler,
            Client::Kwok | Client::Other => ClaimWriter::Others,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            ClaimWriter::Muster => "muster",
            ClaimWriter::ControllerManager => "kube-controller-manager",
            ClaimWriter::Scheduler => "kube-scheduler",
            ClaimWriter::Others => "others",
        }
    }
}

/// How long to wait for the API server to write out its batched audit events.
pub const FLUSH: Duration = Duration::from_secs(3);

#[cfg(test)]
mod tests {
    use super::*;

    /// An audit line; `object` is `[resource, subresource, namespace, name]`.
    fn line(agent: &str, verb: &str, object: [&str; 4], at: &str, code: u16) -> String {
        let [resource, sub, ns, name] = object;
        serde_json::json!({
            "kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata",
            "stage": "ResponseComplete", "verb": verb, "userAgent": agent,
            "user": {"username": "admin"},
            "objectRef": {"resource": resource, "subresource": sub, "namespace": ns, "name": name},
            "responseStatus": {"code": code},
            "requestReceivedTimestamp": at, "stageTimestamp": at,
        })
        .to_string()
    }

    #[test]
    fn writes_are_read_attributed_and_split_by_gang_and_time() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("muster-bench-audit-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let log = dir.join("audit.log");
        let early = "2026-01-01T00:00:01.000000Z";
        let late = "2026-01-01T00:01:00.000000Z";
        let before = line(
            "kube-scheduler/v1.37.1",
            "create",
            ["pods", "binding", "other", "x-1"],
            early,
            201,
        );
        std::fs::write(&log, format!("{before}\n"))?;
        let from = offset(&log);
        let lines = [
            line(
                "muster/0.1.0",
                "patch",
                ["resourceclaims", "status", "ns", "g1-workers-0-gpus"],
                early,
                200,
            ),
            line(
                "muster/0.1.0",
                "patch",
                ["resourceclaims", "status", "ns", "g1-workers-0-gpus"],
                late,
                200,
            ),
            line(
                "kube-controller-manager/v1.37.1 (linux/amd64)",
                "patch",
                ["resourceclaims", "status", "ns", "g1-workers-0-gpus"],
                late,
                409,
            ),
            line(
                "kube-scheduler/v1.37.1",
                "create",
                ["pods", "binding", "ns", "g1-workers-0"],
                early,
                201,
            ),
            line("kwok/v0.8.0", "patch", ["pods", "status", "ns", "g10-0"], late, 200),
            line("", "create", ["workloads", "", "ns", "g1"], early, 201),
            // A claim of g10 that nobody wrote the status of, and an object of no gang.
            line(
                "kube-controller-manager/v1.37.1 (linux/amd64)",
                "create",
                ["resourceclaims", "", "ns", "g10-0-gpus-abcde"],
                early,
                201,
            ),
            line("", "create", ["resourceclaimtemplates", "", "ns", "gpus-2"], early, 201),
            // A claim made from a template by generateName: logged without a name.
            line(
                "kube-controller-manager/v1.37.1 (linux/amd64)",
                "create",
                ["resourceclaims", "", "ns", ""],
                late,
                201,
            ),
            // The namespace's deletion: no gang's object.
            line(
                "kube-controller-manager/v1.37.1 (linux/amd64)",
                "deletecollection",
                ["pods", "", "ns", ""],
                late,
                200,
            ),
            line(
                "muster/0.1.0",
                "patch",
                ["pods", "", "other-ns", "g1-workers-0"],
                early,
                200,
            ),
        ];
        std::fs::write(&log, format!("{before}\n{}\n", lines.join("\n")))?;
        let writes = read(&log, from, "ns")?;
        assert_eq!(writes.len(), 10, "the earlier line and other namespaces are left out");
        let gangs = vec!["g1".to_string(), "g10".to_string()];
        assert_eq!(gang_of("g10-0", &gangs), Some("g10"), "not g1: the longest name wins");
        assert_eq!(gang_of("g1", &gangs), Some("g1"));
        assert_eq!(gang_of("g1x", &gangs), None);
        let running = BTreeMap::from([(
            "g1".to_string(),
            SystemTime::from("2026-01-01T00:00:30Z".parse::<k8s_openapi::jiff::Timestamp>()?),
        )]);
        let counts = WriteCounts::of(&writes, &gangs, &running);
        assert_eq!(counts.total(Some(Client::Muster), Some(Stage::Admission)), 1);
        assert_eq!(counts.total(Some(Client::Muster), Some(Stage::Lifecycle)), 1);
        assert_eq!(counts.total(Some(Client::ControllerManager), None), 3);
        assert_eq!(
            counts.total(Some(Client::ControllerManager), Some(Stage::Admission)),
            2,
            "a create without a name is admission"
        );
        assert_eq!(counts.total(Some(Client::Scheduler), None), 1);
        // g10 never ran: all of its writes are admission.
        assert_eq!(counts.total(Some(Client::Kwok), Some(Stage::Admission)), 1);
        assert_eq!(counts.total(Some(Client::Other), None), 1);
        assert_eq!(
            counts.total(None, None),
            8,
            "the template and the namespace's deletecollection belong to no gang"
        );
        assert_eq!(counts.unattributed, 2);
        assert_eq!(
            counts.claim_status["g1-workers-0-gpus"],
            BTreeMap::from([
                ((Client::Muster, Stage::Admission), 1),
                ((Client::Muster, Stage::Lifecycle), 1),
                ((Client::ControllerManager, Stage::Lifecycle), 1),
            ])
        );
        assert!(counts.claim_status["g10-0-gpus-abcde"].is_empty());
        // The claim never written is no claim the gang used: one claim, three writes.
        assert_eq!((counts.claims_written(), counts.claims_never_written()), (1, 1));
        assert_eq!(counts.claim_status_per_claim_all(), Some((3.0, 3)));
        assert_eq!(
            counts.claim_status_per_claim(|c, s| c == Client::Muster && s == Stage::Lifecycle),
            Some((1.0, 1))
        );
        assert_eq!(
            counts.claim_status_per_claim(|c, _| ClaimWriter::of(c) == ClaimWriter::Scheduler),
            Some((0.0, 0))
        );
        assert_eq!(counts.conflicts.get(&Client::ControllerManager), Some(&1));
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
