//! muster-cel against the real control plane, expression by expression: a corpus of
//! hand-written selectors (`operator/cel/corpus.txt`) and seeded generated ones, each
//! compiled and evaluated by muster-cel and published as a ResourceClaim selector for
//! the real API server and kube-scheduler. Both must agree on every expression:
//!
//! - the API server refuses the claim (it compiles selectors when it validates them:
//!   syntax, types, cost estimate) ⇔ muster-cel does not compile the expression;
//! - kube-scheduler binds the pod ⇔ muster-cel selects the device;
//! - kube-scheduler leaves the pod unschedulable ⇔ muster-cel does not select it;
//! - kube-scheduler reports a CEL runtime error ⇔ muster-cel's evaluation fails.
//!
//! Expressions run in batches. Each expression gets its own device (an `idx` attribute
//! tells them apart; every device has the same other attributes) and its own claim,
//! whose first selector picks the device by `idx` so that the expression under test is
//! evaluated against that device only. A fence (a device, class, claim and pod written
//! after the batch's objects) makes sure kube-scheduler has seen the whole batch before
//! the batch's pods are created.
//!
//! `MUSTER_CEL_SEED` and `MUSTER_CEL_GENERATED` override the seed and the number of
//! generated expressions.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use muster_cel::name_map::NameMap;
use muster_cel::quantity::Quantity;
use muster_cel::{AttributeValue, Attributes, DeviceView};
use muster_e2e::rng::Rng;
use muster_e2e::testing::{delete_namespace, namespace, shared_cluster};
use muster_local_cluster::fleet::FleetSpec;
use serde_json::{Value, json};

const DRIVER: &str = "corpus.example.com";
const FENCE_DRIVER: &str = "corpus-fence.example.com";
const CLASS: &str = "cel-corpus";
const LABEL: &str = "e2e.muster.dev/cel-corpus";
const NODES: usize = 4;
/// Expressions per batch (pods spread over the nodes, 110 pods each at most).
const BATCH: usize = 160;
const DEFAULT_SEED: u64 = 0x6365_6c5f_636f_7270;
const DEFAULT_GENERATED: usize = 400;
const VERDICT_TIMEOUT: Duration = Duration::from_secs(90);
const CORPUS: &str = include_str!("../../operator/cel/corpus.txt");

/// An outcome, as both sides report it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Outcome {
    Selected,
    NotSelected,
    /// The expression does not compile (the API server refuses the claim).
    Refused(String),
    /// Evaluation failed (kube-scheduler reports a CEL runtime error).
    RuntimeError(String),
}

impl Outcome {
    fn kind(&self) -> &'static str {
        match self {
            Outcome::Selected => "selected",
            Outcome::NotSelected => "not selected",
            Outcome::Refused(_) => "refused",
            Outcome::RuntimeError(_) => "runtime error",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Refused(m) | Outcome::RuntimeError(m) => {
                let first = m.lines().next().unwrap_or("");
                write!(f, "{}: {}", self.kind(), first.chars().take(300).collect::<String>())
            }
            _ => f.write_str(self.kind()),
        }
    }
}

// ---- the device every expression sees ----

fn attributes(idx: i64) -> Attributes {
    Attributes::from([
        ("model".into(), AttributeValue::String("H100".into())),
        ("cores".into(), AttributeValue::Int(128)),
        ("ecc".into(), AttributeValue::Bool(true)),
        ("driverVersion".into(), AttributeValue::Version("1.2.3".into())),
        ("idx".into(), AttributeValue::Int(idx)),
        ("topo.example.com/rack".into(), AttributeValue::String("r1".into())),
        ("topo.example.com/ports".into(), AttributeValue::Int(8)),
    ])
}

fn capacity() -> NameMap<Quantity> {
    NameMap::from([
        ("memory".into(), Quantity::parse("80Gi").expect("quantity")),
        ("topo.example.com/slots".into(), Quantity::parse("4").expect("quantity")),
    ])
}

fn device_json(idx: usize) -> Value {
    let mut attrs = serde_json::Map::new();
    for (name, value) in attributes(idx as i64).iter() {
        let v = match value {
            AttributeValue::Int(i) => json!({"int": i}),
            AttributeValue::Bool(b) => json!({"bool": b}),
            AttributeValue::String(s) => json!({"string": s}),
            AttributeValue::Version(v) => json!({"version": v}),
        };
        attrs.insert(name.clone(), v);
    }
    let caps: serde_json::Map<String, Value> = capacity()
        .iter()
        .map(|(name, q)| (name.clone(), json!({"value": q.to_string()})))
        .collect();
    json!({"name": format!("d{idx}"), "attributes": attrs, "capacity": caps})
}

/// muster-cel's outcome for an expression, on device `idx`.
fn muster(expression: &str, idx: usize) -> Outcome {
    let attributes = attributes(idx as i64);
    let capacity = capacity();
    let view = DeviceView {
        driver: DRIVER,
        attributes: &attributes,
        capacity: &capacity,
        allow_multiple_allocations: false,
    };
    match muster_cel::compile(expression) {
        Err(e) => Outcome::Refused(e.message),
        Ok(program) => match program.evaluate(&view) {
            Ok(true) => Outcome::Selected,
            Ok(false) => Outcome::NotSelected,
            Err(e) => Outcome::RuntimeError(e.message),
        },
    }
}

// ---- the corpus ----

/// The hand-written expressions, each with whether it is a known gap (`! `).
fn hand_written() -> Vec<(String, bool)> {
    CORPUS
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .map(|l| match l.strip_prefix("! ") {
            Some(gap) => (gap.to_string(), true),
            None => (l.to_string(), false),
        })
        .collect()
}

const A: &str = "device.attributes[\"corpus.example.com\"]";
const T: &str = "device.attributes[\"topo.example.com\"]";
const C: &str = "device.capacity[\"corpus.example.com\"]";

/// A random boolean expression over the device and literals.
fn generated(rng: &mut Rng, depth: usize) -> String {
    if depth > 0 && rng.chance(45) {
        let l = generated(rng, depth - 1);
        let r = generated(rng, depth - 1);
        return match rng.below(5) {
            0 => format!("({l}) && ({r})"),
            1 => format!("({l}) || ({r})"),
            2 => format!("!({l})"),
            3 => format!("({l}) ? ({r}) : false"),
            _ => format!("[{l}, {r}].exists(b, b)"),
        };
    }
    let int = |rng: &mut Rng| -> String {
        match rng.below(8) {
            0 => format!("{A}.cores"),
            1 => format!("{T}.ports"),
            2 => format!("{A}.?cores.orValue(0)"),
            3 => format!("{A}.nope"),
            4 => format!("size({A}.model)"),
            5 => format!(
                "{C}.memory.compareTo(quantity(\"{}\"))",
                rng.pick(&["40Gi", "80Gi", "81920Mi", "1Ti"])
            ),
            6 => format!("{A}.driverVersion.minor()"),
            _ => rng
                .pick(&["0", "1", "-1", "128", "9223372036854775807", "7 / 0"])
                .to_string(),
        }
    };
    let string = |rng: &mut Rng| -> String {
        match rng.below(7) {
            0 => format!("{A}.model"),
            1 => format!("{T}.rack"),
            2 => "device.driver".to_string(),
            3 => format!("{A}.?model.orValue(\"x\")"),
            4 => format!("{A}.model.lowerAscii()"),
            5 => format!("\"{}\".substring({})", rng.pick(&["H100", "r1", ""]), rng.below(6)),
            _ => format!("\"{}\"", rng.pick(&["H100", "h100", "r1", "", "corpus.example.com"])),
        }
    };
    match rng.below(18) {
        0 | 1 => {
            let op = rng.pick(&["==", "!=", "<", "<=", ">", ">="]);
            format!("{} {op} {}", int(rng), int(rng))
        }
        2 | 3 => {
            let op = rng.pick(&["==", "!=", "<", ">="]);
            format!("{} {op} {}", string(rng), string(rng))
        }
        4 => format!(
            "{}.{}(\"{}\")",
            string(rng),
            rng.pick(&["startsWith", "endsWith", "contains", "matches"]),
            rng.pick(&["H", "1", "", "^r[0-9]$", "[", "."])
        ),
        5 => format!(
            "has({}.{})",
            rng.pick(&[A, T]),
            rng.pick(&["model", "rack", "nope", "cores"])
        ),
        6 => format!(
            "{C}.{}.isGreaterThan(quantity(\"{}\"))",
            rng.pick(&["memory", "nope"]),
            rng.pick(&["1Gi", "80Gi", "100Gi", "1.5"])
        ),
        7 => format!(
            "{A}.driverVersion.{}(semver(\"{}\"))",
            rng.pick(&["isGreaterThan", "isLessThan"]),
            rng.pick(&["1.2.3", "1.10.0", "0.9.9", "1.2.3-rc.1", "v1"])
        ),
        8 => format!(
            "{}.{}({}, {} {} {})",
            rng.pick(&[A, T, "device.attributes"]),
            rng.pick(&["exists", "all", "exists_one"]),
            "k",
            "k",
            rng.pick(&["==", "!="]),
            rng.pick(&["\"model\"", "\"rack\"", "\"topo.example.com\""])
        ),
        9 => format!(
            "{} in {}",
            rng.pick(&["\"model\"", "\"rack\"", "\"corpus.example.com\""]),
            rng.pick(&[A, T, "device.attributes"])
        ),
        10 => format!(
            "[{}].{}(x, x {} {})",
            rng.pick(&["1, 2, 3", "0, 1", "", "3, 2"]),
            rng.pick(&["all", "exists", "exists_one"]),
            rng.pick(&["> 1", "== 0", "/ 0 =="]),
            rng.below(3)
        ),
        11 => format!(
            "cel.bind(v, {}, v {} {})",
            int(rng),
            rng.pick(&["==", ">", "<"]),
            int(rng)
        ),
        12 => format!(
            "\"{}\".split(\"{}\").size() == {}",
            rng.pick(&["a,b,c", "", "a"]),
            rng.pick(&[",", ""]),
            rng.below(4)
        ),
        13 => format!(
            "optional.{}.orValue({}) {} 0",
            rng.pick(&["of(1)", "none()", "ofNonZeroValue(0)"]),
            int(rng),
            rng.pick(&["==", ">"])
        ),
        14 => format!(
            "{}.{}() {} {}",
            rng.pick(&["[3, 1, 2]", "[1]", "[]"]),
            rng.pick(&["min", "max", "sum"]),
            rng.pick(&["==", ">="]),
            rng.below(4)
        ),
        15 => format!(
            "timestamp(\"{}\") {} duration(\"{}\") {} timestamp({})",
            rng.pick(&[
                "2024-02-29T23:59:59.5Z",
                "1970-01-01T00:00:00+01:00",
                "9999-12-31T23:59:59Z",
                "2024-1-1T00:00:00Z"
            ]),
            rng.pick(&["+", "-"]),
            rng.pick(&["1h30m", "-1.5s", "0", "2562047h", "1d"]),
            rng.pick(&["<", ">=", "=="]),
            rng.pick(&["0", "1709251199", "-1", "253402300799"])
        ),
        16 => format!(
            "cidr(\"{}\").{}(\"{}\")",
            rng.pick(&["10.0.0.0/8", "10.1.2.3/16", "::/0", "2001:db8::/32", "10.0.0.0/33"]),
            rng.pick(&["containsIP", "containsCIDR"]),
            rng.pick(&[
                "10.1.2.3",
                "10.0.0.0/8",
                "2001:db8::1",
                "2001:db8::/48",
                "::ffff:1.2.3.4",
                "x"
            ])
        ),
        _ => rng
            .pick(&[
                "device.allowMultipleAllocations",
                "true",
                "false",
                "device.driver == 'corpus.example.com'",
            ])
            .to_string(),
    }
}

fn corpus(seed: u64, generated_count: usize) -> Vec<(String, bool)> {
    let mut all = hand_written();
    // Past the length limit.
    all.push((
        format!("\"{}\" == \"\"", "a".repeat(muster_cel::MAX_EXPRESSION_LENGTH)),
        false,
    ));
    for i in 0..generated_count {
        let mut rng = Rng::for_case(seed, i);
        all.push((generated(&mut rng, 2), false));
    }
    all
}

// ---- the control plane ----

struct Harness {
    ns: String,
    client: kube::Client,
    nodes: Vec<String>,
    pods: Api<Pod>,
    claims: Api<ResourceClaim>,
    slices: Api<ResourceSlice>,
    classes: Api<DeviceClass>,
}

fn pod_json(name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {LABEL: "true"}},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "busybox", "resources": {"claims": [{"name": "dev"}]}}],
            "resourceClaims": [{"name": "dev", "resourceClaimName": name}],
        },
    })
}

fn claim_json(name: &str, class: &str, selectors: &[String]) -> Value {
    let selectors: Vec<Value> = selectors.iter().map(|s| json!({"cel": {"expression": s}})).collect();
    json!({
        "metadata": {"name": name, "labels": {LABEL: "true"}},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {
            "deviceClassName": class,
            "selectors": selectors,
        }}]}},
    })
}

/// kube-scheduler's first verdict on a pod.
fn verdict(pod: &Pod) -> Option<Outcome> {
    if pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_ref())
        .is_some_and(|n| !n.is_empty())
    {
        return Some(Outcome::Selected);
    }
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    let c = conditions
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")?;
    let message = c.message.clone().unwrap_or_default();
    match c.reason.as_deref() {
        Some("Unschedulable") => Some(Outcome::NotSelected),
        Some("SchedulerError") if message.contains("CEL runtime error") => Some(Outcome::RuntimeError(message)),
        // Another scheduler error (a conflicting write, say) is no verdict on the
        // expression: the scheduler retries the pod.
        _ => None,
    }
}

impl Harness {
    async fn start() -> Result<Harness> {
        let fleet = FleetSpec {
            nodes: NODES,
            gpus_per_node: 0,
            ..FleetSpec::default()
        };
        let cluster = shared_cluster(fleet).await?;
        let client = cluster.control_plane.client().await?;
        let ns = namespace(&client, "cel-corpus").await?;
        let harness = Harness {
            nodes: cluster.nodes.iter().map(|n| n.name.clone()).collect(),
            pods: Api::namespaced(client.clone(), &ns),
            claims: Api::namespaced(client.clone(), &ns),
            slices: Api::all(client.clone()),
            classes: Api::all(client.clone()),
            client,
            ns,
        };
        for (name, driver) in [(CLASS.to_string(), DRIVER), (format!("{CLASS}-fence"), FENCE_DRIVER)] {
            let class: DeviceClass = serde_json::from_value(json!({
                "metadata": {"name": name, "labels": {LABEL: "true"}},
                "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{driver}'")}}]},
            }))?;
            harness
                .classes
                .patch(&name, &PatchParams::apply("cel-corpus").force(), &Patch::Apply(&class))
                .await?;
        }
        Ok(harness)
    }

    async fn clear(&self) -> Result<()> {
        let all = ListParams::default().labels(LABEL);
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        };
        self.claims.delete_collection(&now, &all).await?;
        self.pods.delete_collection(&now, &all).await?;
        self.slices.delete_collection(&now, &all).await?;
        let pods = self.pods.clone();
        muster_local_cluster::wait::until("the last batch's pods to be gone", Duration::from_secs(60), || {
            let pods = pods.clone();
            async move {
                let left = pods.list(&ListParams::default().labels(LABEL)).await?;
                Ok(left.items.is_empty().then_some(()))
            }
        })
        .await
    }

    /// Runs one batch: `(index, expression)` pairs; returns the control plane's outcomes.
    async fn batch(&self, number: usize, items: &[(usize, String)]) -> Result<BTreeMap<usize, Outcome>> {
        self.clear().await?;
        // One device per expression, spread over the nodes.
        for (n, node) in self.nodes.iter().enumerate() {
            let devices: Vec<Value> = items
                .iter()
                .filter(|(i, _)| i % self.nodes.len() == n)
                .map(|(i, _)| device_json(*i))
                .collect();
            if devices.is_empty() {
                continue;
            }
            let slice: ResourceSlice = serde_json::from_value(json!({
                "metadata": {"name": format!("cel-corpus-{number}-{n}"), "labels": {LABEL: "true"}},
                "spec": {
                    "driver": DRIVER,
                    "nodeName": node,
                    "pool": {"name": format!("cel-corpus-{number}-{n}"), "generation": 1, "resourceSliceCount": 1},
                    "devices": devices,
                },
            }))?;
            self.slices.create(&PostParams::default(), &slice).await?;
        }
        // Claims: the API server validates (compiles) every selector.
        let mut outcomes = BTreeMap::new();
        let created: Vec<(usize, Option<String>)> = stream::iter(items.iter().cloned())
            .map(|(i, expression)| async move {
                let name = format!("e{i}");
                let selectors = vec![format!("device.attributes['{DRIVER}'].idx == {i}"), expression];
                let claim: ResourceClaim = serde_json::from_value(claim_json(&name, CLASS, &selectors))?;
                let mut attempts = 0;
                loop {
                    attempts += 1;
                    match self.claims.create(&PostParams::default(), &claim).await {
                        Ok(_) => return Ok::<_, anyhow::Error>((i, None)),
                        Err(kube::Error::Api(status)) if status.code == 422 => {
                            return Ok((i, Some(status.message.clone())));
                        }
                        // A handler that fails while validating aborts the connection:
                        // the object is refused all the same. Told apart from a passing
                        // network problem by trying twice and finding no claim.
                        Err(e) if attempts == 2 && self.claims.get_opt(&name).await?.is_none() => {
                            return Ok((i, Some(format!("the API server failed validating it: {e}"))));
                        }
                        Err(_) if attempts < 2 => {}
                        Err(e) => return Err(anyhow::anyhow!("creating claim {name}: {e:?}")),
                    }
                }
            })
            .buffer_unordered(16)
            .try_collect()
            .await?;
        let mut accepted = Vec::new();
        for (i, refused) in created {
            match refused {
                Some(message) => {
                    outcomes.insert(i, Outcome::Refused(message));
                }
                None => accepted.push(i),
            }
        }
        self.fence(number).await?;
        // Pods, then their first verdicts.
        stream::iter(accepted.iter().copied())
            .map(|i| async move {
                let pod: Pod = serde_json::from_value(pod_json(&format!("e{i}")))?;
                self.pods.create(&PostParams::default(), &pod).await?;
                Ok::<_, anyhow::Error>(())
            })
            .buffer_unordered(16)
            .try_collect::<Vec<()>>()
            .await?;
        let deadline = Instant::now() + VERDICT_TIMEOUT;
        loop {
            let pods = self.pods.list(&ListParams::default().labels(LABEL)).await?;
            for pod in &pods.items {
                let name = pod.metadata.name.as_deref().unwrap_or_default();
                let Some(i) = name.strip_prefix('e').and_then(|n| n.parse::<usize>().ok()) else {
                    continue;
                };
                if !outcomes.contains_key(&i)
                    && let Some(v) = verdict(pod)
                {
                    outcomes.insert(i, v);
                }
            }
            if accepted.iter().all(|i| outcomes.contains_key(i)) {
                break;
            }
            if Instant::now() > deadline {
                let missing: Vec<&usize> = accepted.iter().filter(|i| !outcomes.contains_key(i)).collect();
                bail!("no verdict within {VERDICT_TIMEOUT:?} for expressions {missing:?}");
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        Ok(outcomes)
    }

    /// Makes sure kube-scheduler has seen the batch: a device, claim and pod written
    /// after it must be usable.
    async fn fence(&self, number: usize) -> Result<()> {
        let name = format!("fence-{number}");
        let slice: ResourceSlice = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {LABEL: "true"}},
            "spec": {
                "driver": FENCE_DRIVER,
                "nodeName": self.nodes[0],
                "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "f"}],
            },
        }))?;
        self.slices.create(&PostParams::default(), &slice).await?;
        let claim: ResourceClaim = serde_json::from_value(claim_json(&name, &format!("{CLASS}-fence"), &[]))?;
        self.claims.create(&PostParams::default(), &claim).await?;
        let pod: Pod = serde_json::from_value(pod_json(&name))?;
        self.pods.create(&PostParams::default(), &pod).await?;
        let seen = tokio::time::timeout(
            VERDICT_TIMEOUT,
            kube::runtime::wait::await_condition(self.pods.clone(), &name, |p: Option<&Pod>| {
                p.is_some_and(|p| matches!(verdict(p), Some(Outcome::Selected)))
            }),
        )
        .await
        .context("the fence pod was not bound")??;
        if seen.is_none() {
            bail!("the fence pod is gone");
        }
        Ok(())
    }

    async fn finish(&self) -> Result<()> {
        self.clear().await?;
        for name in [CLASS.to_string(), format!("{CLASS}-fence")] {
            self.classes.delete(&name, &DeleteParams::default()).await?;
        }
        delete_namespace(&self.client, &self.ns).await
    }
}

fn env_number(name: &str) -> Result<Option<u64>> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(text) => Ok(Some(text.trim().parse().with_context(|| format!("{name}={text}"))?)),
    }
}

#[tokio::test]
async fn muster_cel_agrees_with_the_api_server_and_kube_scheduler() -> Result<()> {
    let seed = env_number("MUSTER_CEL_SEED")?.unwrap_or(DEFAULT_SEED);
    let count = env_number("MUSTER_CEL_GENERATED")?.map_or(DEFAULT_GENERATED, |n| n as usize);
    let expressions = corpus(seed, count);
    let started = Instant::now();
    let harness = Harness::start().await?;
    let indexed: Vec<(usize, String)> = expressions.iter().map(|(e, _)| e.clone()).enumerate().collect();
    let mut cluster = BTreeMap::new();
    for (number, chunk) in indexed.chunks(BATCH).enumerate() {
        cluster.extend(harness.batch(number, chunk).await?);
    }
    harness.finish().await?;

    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    let mut disagreements = Vec::new();
    let mut gaps = Vec::new();
    for (i, (expression, gap)) in expressions.iter().enumerate() {
        let theirs = cluster.get(&i).cloned().context("an expression without a verdict")?;
        let ours = muster(expression, i);
        *counts.entry(theirs.kind()).or_default() += 1;
        let shown: String = expression.chars().take(200).collect();
        let report = format!("#{i} {shown}\n    muster-cel:    {ours}\n    control plane: {theirs}");
        if *gap {
            gaps.push(report);
        } else if ours.kind() != theirs.kind() {
            disagreements.push(report);
        }
    }
    if !gaps.is_empty() {
        eprintln!("{} known gaps (not compared):\n{}", gaps.len(), gaps.join("\n"));
    }
    eprintln!(
        "{} expressions ({} hand-written, seed {seed:#x}) in {:.0?}: {counts:?}",
        expressions.len(),
        expressions.len() - count - 1,
        started.elapsed()
    );
    if !disagreements.is_empty() {
        bail!(
            "{} of {} expressions disagree:\n{}",
            disagreements.len(),
            expressions.len(),
            disagreements.join("\n")
        );
    }
    Ok(())
}
