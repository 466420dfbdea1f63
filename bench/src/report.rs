//! The Markdown report: per scenario a table per contender, a headline of ratios to
//! upstream measured in the same run, every goal with whether it was met, and the CDF.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use crate::audit::{ClaimWriter, Client, Stage};
use crate::contender::Contender;
use crate::phase::PhaseResult;
use crate::plot::{Series, cdf_svg};
use crate::spec::{Scenario, ScenarioId};
use crate::stats::{mean, percentile};

/// Everything a run produced.
pub struct Run {
    pub machine: String,
    pub date: String,
    pub repeats: usize,
    pub scenarios: Vec<Scenario>,
    pub results: Vec<PhaseResult>,
}

/// Aggregates over the repeats of one contender in one scenario.
struct Summary<'a> {
    phases: Vec<&'a PhaseResult>,
}

impl<'a> Summary<'a> {
    fn of(run: &'a Run, scenario: ScenarioId, contender: Contender) -> Self {
        Summary {
            phases: run
                .results
                .iter()
                .filter(|r| r.scenario == scenario && r.contender == contender)
                .collect(),
        }
    }

    fn is_empty(&self) -> bool {
        self.phases.is_empty()
    }

    /// Every gang's value, pooled over the repeats.
    fn pooled(&self, value: impl Fn(&crate::phase::GangOutcome) -> Option<f64>) -> Vec<f64> {
        self.phases
            .iter()
            .flat_map(|p| p.gangs.iter().filter_map(&value))
            .collect()
    }

    fn per_phase(&self, value: impl Fn(&PhaseResult) -> f64) -> Option<f64> {
        mean(&self.phases.iter().map(|p| value(p)).collect::<Vec<_>>())
    }

    /// The mean over the repeats, and the lowest and highest repeat.
    fn spread(&self, value: impl Fn(&PhaseResult) -> Option<f64>) -> Option<(f64, f64, f64)> {
        let values: Vec<f64> = self.phases.iter().filter_map(|p| value(p)).collect();
        let low = values.iter().copied().reduce(f64::min)?;
        let high = values.iter().copied().reduce(f64::max)?;
        Some((mean(&values)?, low, high))
    }

    /// Each repeat's p-th percentile of create → Running.
    fn running_percentile_spread(&self, p: f64) -> Option<(f64, f64, f64)> {
        self.spread(|phase| percentile(&phase.gangs.iter().filter_map(|g| g.all_running).collect::<Vec<_>>(), p))
    }

    fn bound(&self) -> Vec<f64> {
        self.pooled(|g| g.all_bound)
    }

    fn running(&self) -> Vec<f64> {
        self.pooled(|g| g.all_running)
    }

    /// The highest value of any repeat.
    fn most(&self, value: impl Fn(&PhaseResult) -> Option<f64>) -> Option<f64> {
        self.phases.iter().filter_map(|p| value(p)).reduce(f64::max)
    }

    fn gangs_per_phase(&self) -> usize {
        self.phases.first().map(|p| p.gangs.len()).unwrap_or(0)
    }
}

fn seconds(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "–".into())
}

fn number(v: Option<f64>, digits: usize) -> String {
    v.map(|v| format!("{v:.digits$}")).unwrap_or_else(|| "–".into())
}

/// `ours / theirs`, as "0.52×".
fn ratio(ours: Option<f64>, theirs: Option<f64>) -> String {
    match (ours, theirs) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "–".into(),
    }
}

/// "12.3 (11.0–14.1)": mean over the repeats, lowest and highest repeat.
fn spread(v: Option<(f64, f64, f64)>, digits: usize) -> String {
    match v {
        Some((mean, low, high)) => format!("{mean:.digits$} ({low:.digits$}–{high:.digits$})"),
        None => "–".into(),
    }
}

fn met(ok: Option<bool>) -> &'static str {
    match ok {
        Some(true) => "met",
        Some(false) => "**missed**",
        None => "",
    }
}

/// The report's Markdown; the plot is written beside it as `plot_file`.
pub fn markdown(run: &Run, plot_file: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# muster against upstream gang scheduling\n");
    let _ = writeln!(
        out,
        "Measured on **{}**, {}, on one local Kubernetes v1.37.1 control plane (etcd, kube-apiserver, \
         kube-scheduler, kube-controller-manager) with kwok nodes and a fake DRA GPU driver, \
         upstream gang scheduling enabled (`GenericWorkload`, `TopologyAwareWorkloadScheduling`, \
         `scheduling.k8s.io/v1beta1`). Rerun with `cargo run --release -p muster-bench`.\n",
        run.machine, run.date
    );
    let _ = writeln!(
        out,
        "Each scenario runs every contender in turn on the same freshly reset fleet, never two at \
         once: first an unmeasured warm-up phase of each, then {} repeats whose order rotates by one \
         each time (muster-upstream-plain, upstream-plain-muster, plain-muster-upstream), so each \
         contender runs first, second and last equally often; values are means over the repeats with \
         the lowest and highest repeat in brackets. Ratios are muster over upstream PodGroup gang \
         scheduling measured in the same run; **absolute times are this machine's**. Times come from \
         client-side watches on a monotonic clock, from a gang's create request to the moment the \
         last of its pods is bound (create → bound) or Running (create → Running). Writes come from \
         kube-apiserver's audit log: every write request in the phase's namespace, with the client \
         that made it.\n",
        run.repeats
    );
    let _ = writeln!(
        out,
        "Contenders: **muster** (a Workload per gang); **upstream** (a `PodGroup` with a gang policy and pods naming it in `spec.schedulingGroup`); **plain** kube-scheduler without gangs (the pods alone), the floor, where partial allocations are expected.\n"
    );
    headline(&mut out, run);
    let _ = writeln!(out, "![create → Running per gang, S1 and S5]({plot_file})\n");
    for scenario in &run.scenarios {
        details(&mut out, run, scenario);
    }
    let _ = writeln!(out, "## Definitions\n");
    let _ = writeln!(
        out,
        "- **admitted**: every pod of the gang bound to a node. **placed correctly**: admitted, and in one rack where the gang asks for it."
    );
    let _ = writeln!(
        out,
        "- **partial allocation**: a gang that held devices for some of its pods but not all for 10 s or more: members sitting on GPUs while another member waits."
    );
    let _ = writeln!(
        out,
        "- **deadlocked**: gangs holding a partial allocation when nothing has been bound, started or finished for the scenario's stall time."
    );
    let _ = writeln!(
        out,
        "- **pods/s**: pods bound from the first create to the last pod bound. **writes/pod**: create, update, patch and delete requests on the gangs' own objects (pods and their bindings and status, claims and their status, Workloads, PodGroups, Services, events, each named after its gang, and the claims kube-controller-manager makes from templates, which the audit log shows without a name) in the audit log, from every client, per pod bound. Only gang objects count: the API server's idle background (node leases and status) is outside the phase's namespace, and what in it belongs to no gang (claim templates, the benchmark's sync markers, the namespace controller's deletecollection of every kind at the end) is left out. **admission / lifecycle**: a write to a gang's object before its first pod ends or it is deleted (getting it running and holding it while it runs, muster recording Running included; so is kwok's write that ends that first pod), or after (finishing, deallocating, deleting, restarting after a failure, the namespace's deletion at the end)."
    );
    let _ = writeln!(
        out,
        "- **GPU utilisation**: GPU-seconds of running pods over the fleet's GPU-seconds, from the first create to the last gang done."
    );
    let _ = writeln!(
        out,
        "- **CPU s**: CPU seconds used during the phase, from /proc: muster's operator, kube-scheduler, kube-apiserver."
    );
    out
}

fn headline(out: &mut String, run: &Run) {
    let _ = writeln!(out, "## Headline\n");
    let _ = writeln!(
        out,
        "| scenario | measure | muster | upstream | muster / upstream | goal | |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|");
    for scenario in &run.scenarios {
        let ours = Summary::of(run, scenario.id, Contender::Muster);
        let theirs = Summary::of(run, scenario.id, Contender::Upstream);
        // Without upstream in the run, muster's own measures and goals still show.
        if ours.is_empty() {
            continue;
        }
        let title = scenario.id.title();
        let mut row = |measure: &str, a: Option<f64>, b: Option<f64>, digits: usize, goal: &str, ok: Option<bool>| {
            let _ = writeln!(
                out,
                "| {title} | {measure} | {} | {} | {} | {goal} | {} |",
                number(a, digits),
                number(b, digits),
                ratio(a, b),
                met(ok)
            );
        };
        match scenario.id {
            ScenarioId::S1 => {
                let (a, b) = (percentile(&ours.running(), 99.0), percentile(&theirs.running(), 99.0));
                row(
                    "create → Running p99 (s)",
                    a,
                    b,
                    2,
                    "≤ upstream",
                    a.zip(b).map(|(a, b)| a <= b),
                );
                let (a, b) = (
                    ours.per_phase(|p| p.pods_per_second),
                    theirs.per_phase(|p| p.pods_per_second),
                );
                row("pods/s", a, b, 1, "", None);
                let a = ours.per_phase(|p| p.writes_per_pod(Some(Client::Muster), Some(Stage::Admission)));
                row(
                    "muster's own admission writes per pod (4-pod gangs)",
                    a,
                    None,
                    2,
                    "≤ 4",
                    a.map(|a| a <= 4.0),
                );
            }
            ScenarioId::S2 | ScenarioId::S3 => {
                let placed = |s: &Summary| s.per_phase(|p| p.placed_correctly() as f64);
                let (a, b) = (placed(&ours), placed(&theirs));
                row(
                    "gangs placed correctly per run",
                    a,
                    b,
                    1,
                    "≥ upstream",
                    a.zip(b).map(|(a, b)| a >= b),
                );
                let a = ours.per_phase(|p| p.partial() as f64);
                row(
                    "partial allocations per run",
                    a,
                    theirs.per_phase(|p| p.partial() as f64),
                    1,
                    "0",
                    a.map(|a| a == 0.0),
                );
                let a = ours.per_phase(|p| p.deadlocked() as f64);
                row(
                    "deadlocked gangs per run",
                    a,
                    theirs.per_phase(|p| p.deadlocked() as f64),
                    1,
                    "0",
                    a.map(|a| a == 0.0),
                );
                if scenario.id == ScenarioId::S3 {
                    let (a, b) = (
                        ours.per_phase(PhaseResult::gang_writes_per_pod),
                        theirs.per_phase(PhaseResult::gang_writes_per_pod),
                    );
                    row(
                        "API-server writes per pod, all clients (gang objects)",
                        a,
                        b,
                        1,
                        "≤ upstream",
                        a.zip(b).map(|(a, b)| a <= b),
                    );
                    let per_claim =
                        |s: &Summary| s.per_phase(|p| p.writes.claim_status_per_claim_all().map_or(0.0, |c| c.0));
                    let a = per_claim(&ours);
                    row(
                        "claim status writes per claim over its life",
                        a,
                        per_claim(&theirs),
                        2,
                        "≤ 3",
                        a.map(|a| a <= 3.0),
                    );
                    row(
                        "makespan (s)",
                        ours.per_phase(|p| p.makespan),
                        theirs.per_phase(|p| p.makespan),
                        1,
                        "",
                        None,
                    );
                    row(
                        "GPU utilisation",
                        ours.per_phase(|p| p.gpu_utilisation),
                        theirs.per_phase(|p| p.gpu_utilisation),
                        2,
                        "",
                        None,
                    );
                }
            }
            ScenarioId::S4 => {
                let recovery = |s: &Summary| {
                    mean(
                        &s.phases
                            .iter()
                            .filter_map(|p| p.recovery.as_ref()?.seconds)
                            .collect::<Vec<_>>(),
                    )
                };
                row(
                    "failure → all Running (s)",
                    recovery(&ours),
                    recovery(&theirs),
                    2,
                    "",
                    None,
                );
                let same = |s: &Summary| {
                    s.per_phase(|p| f64::from(u8::from(p.recovery.as_ref().is_some_and(|r| r.same_devices))))
                };
                row(
                    "same devices back (share of runs)",
                    same(&ours),
                    same(&theirs),
                    2,
                    "",
                    None,
                );
            }
            ScenarioId::S5 => {
                let (a, b) = (percentile(&ours.bound(), 99.0), percentile(&theirs.bound(), 99.0));
                row("create → bound p99 (s)", a, b, 2, "", None);
                let (a, b) = (
                    ours.per_phase(|p| p.pods_per_second),
                    theirs.per_phase(|p| p.pods_per_second),
                );
                row("pods/s bound", a, b, 1, "muster ≥ 300", a.map(|a| a >= 300.0));
                let rss = ours.per_phase(|p| p.muster_peak_rss_mib.unwrap_or(0.0));
                row("muster peak RSS (MiB)", rss, None, 0, "≤ 300", rss.map(|r| r <= 300.0));
                let all = |s: &Summary| s.per_phase(PhaseResult::gang_writes_per_pod);
                row(
                    "API-server writes per pod, all clients (gang objects)",
                    all(&ours),
                    all(&theirs),
                    1,
                    "",
                    None,
                );
            }
            ScenarioId::S6 => {
                let plain = Summary::of(run, scenario.id, Contender::Plain);
                let rate = |s: &Summary| s.per_phase(|p| p.bind_rate.unwrap_or(0.0));
                let (a, b) = (rate(&ours), rate(&theirs));
                row(
                    "pods bound per second (10–90% window)",
                    a,
                    b,
                    1,
                    "≥ 2× upstream",
                    a.zip(b).map(|(a, b)| a >= 2.0 * b),
                );
                let floor = rate(&plain);
                row(
                    "pods bound per second, muster / plain kube-scheduler",
                    a,
                    floor,
                    1,
                    "≥ 1.0× plain",
                    a.zip(floor).map(|(a, f)| a >= f),
                );
                row(
                    "pods released per second (10–90% window)",
                    ours.per_phase(|p| p.release_rate.unwrap_or(0.0)),
                    theirs.per_phase(|p| p.release_rate.unwrap_or(0.0)),
                    1,
                    "",
                    None,
                );
                let rss = ours.per_phase(|p| p.muster_peak_rss_mib.unwrap_or(0.0));
                row("muster peak RSS (MiB)", rss, None, 0, "≤ 300", rss.map(|r| r <= 300.0));
            }
            ScenarioId::S7 => {
                let last = |s: &Summary| s.spread(PhaseResult::last_create_to_all_running).map(|(m, _, _)| m);
                let (a, b) = (last(&ours), last(&theirs));
                row("last create → all Running (s)", a, b, 1, "≤ 5", a.map(|a| a <= 5.0));
                let cpu = ours.spread(PhaseResult::muster_cpu_per_100_pods).map(|(m, _, _)| m);
                row("muster CPU s per 100 pods", cpu, None, 2, "≤ 1", cpu.map(|c| c <= 1.0));
                let plan = ours
                    .spread(|p| p.muster_plans.map(|(_, mean)| mean * 1000.0))
                    .map(|(m, _, _)| m);
                row("muster plan time per gang, mean (ms)", plan, None, 2, "", None);
            }
        }
    }
    let _ = writeln!(out);
}

fn details(out: &mut String, run: &Run, scenario: &Scenario) {
    let _ = writeln!(out, "## {}\n", scenario.id.title());
    let sizes: std::collections::BTreeMap<usize, usize> = scenario.gangs.iter().fold(Default::default(), |mut m, g| {
        *m.entry(g.pods).or_default() += 1;
        m
    });
    let shape: Vec<String> = sizes.iter().map(|(pods, n)| format!("{n} × {pods}-pod")).collect();
    let gpus = scenario.gangs.first().map(|g| g.gpus).unwrap_or(0);
    let _ = writeln!(
        out,
        "{} nodes × {} GPUs in racks of {}; gangs {} with {gpus} GPUs per pod{}{}{}.\n",
        scenario.fleet.nodes,
        scenario.fleet.gpus_per_node,
        scenario.fleet.nodes_per_rack,
        shape.join(", "),
        if scenario.gangs.iter().any(|g| g.same_rack) {
            ", each in one rack"
        } else {
            ""
        },
        scenario
            .gangs
            .first()
            .and_then(|g| g.run_for_seconds)
            .map(|s| format!(", pods finish after {s} s"))
            .unwrap_or_default(),
        if scenario.delete_finished {
            ", finished gangs deleted (churn)"
        } else {
            ""
        },
    );
    let _ = writeln!(
        out,
        "| contender | admitted / placed correctly (of {}) | create → bound p50 / p90 / p99 (s) | create → Running p99 per repeat (s) | pods/s | partial | deadlocked | makespan (s) | GPU util. | CPU s muster / scheduler / apiserver | writes/pod, all clients (muster's) | muster RSS MiB |",
        Summary::of(run, scenario.id, Contender::Muster)
            .gangs_per_phase()
            .max(scenario.gangs.len())
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    for contender in Contender::ALL {
        let s = Summary::of(run, scenario.id, contender);
        if s.is_empty() {
            continue;
        }
        let bound = s.bound();
        let triple = |v: &[f64]| {
            format!(
                "{} / {} / {}",
                seconds(percentile(v, 50.0)),
                seconds(percentile(v, 90.0)),
                seconds(percentile(v, 99.0))
            )
        };
        let cpu = |name: &str| s.per_phase(|p| p.cpu_seconds.get(name).copied().unwrap_or(0.0));
        let muster_writes = if contender == Contender::Muster {
            format!(
                " ({})",
                number(s.per_phase(|p| p.writes_per_pod(Some(Client::Muster), None)), 2)
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "| {} | {} / {} | {} | {} | {} | {} | {} | {} | {} | {} / {} / {} | {}{} | {} |",
            contender.label(),
            number(s.per_phase(|p| p.admitted() as f64), 1),
            number(s.per_phase(|p| p.placed_correctly() as f64), 1),
            triple(&bound),
            spread(s.running_percentile_spread(99.0), 2),
            spread(s.spread(|p| Some(p.pods_per_second)), 1),
            number(s.per_phase(|p| p.partial() as f64), 1),
            number(s.per_phase(|p| p.deadlocked() as f64), 1),
            spread(s.spread(|p| Some(p.makespan)), 1),
            spread(s.spread(|p| Some(p.gpu_utilisation)), 2),
            number(cpu("muster").filter(|_| contender == Contender::Muster), 1),
            number(cpu("kube-scheduler"), 1),
            number(cpu("kube-apiserver"), 1),
            spread(s.spread(|p| Some(p.gang_writes_per_pod())), 1),
            muster_writes,
            number(
                s.per_phase(|p| p.muster_peak_rss_mib.unwrap_or(0.0))
                    .filter(|_| contender == Contender::Muster),
                0
            ),
        );
    }
    let _ = writeln!(out);
    writes_table(out, run, scenario);
    muster_writes_table(out, run, scenario);
    claim_writes_table(out, run, scenario);
    match scenario.id {
        ScenarioId::S6 => {
            let _ = writeln!(
                out,
                "The burst: the baselines' pods are all created first behind a gate of the benchmark's, then let go at once; muster's Workloads are all created at that moment (muster creates the pods, reserves every claim and releases them). Rates are per second between the moments 10% and 90% of the pods were released or bound.\n"
            );
            let _ = writeln!(out, "| contender | released per second | bound per second |");
            let _ = writeln!(out, "|---|---|---|");
            for contender in Contender::ALL {
                let s = Summary::of(run, scenario.id, contender);
                if s.is_empty() {
                    continue;
                }
                let _ = writeln!(
                    out,
                    "| {} | {} | {} |",
                    contender.label(),
                    spread(s.spread(|p| p.release_rate), 1),
                    spread(s.spread(|p| p.bind_rate), 1)
                );
            }
            let _ = writeln!(out);
        }
        ScenarioId::S3 => {
            let _ = writeln!(
                out,
                "Starvation of the largest gangs (16 pods): queue wait create → bound, and how many never ran.\n"
            );
            let _ = writeln!(
                out,
                "| contender | 16-pod wait p50 / max (s) | all gangs wait p50 (s) | 16-pod gangs not admitted per run |"
            );
            let _ = writeln!(out, "|---|---|---|---|");
            for contender in Contender::ALL {
                let s = Summary::of(run, scenario.id, contender);
                if s.is_empty() {
                    continue;
                }
                let big = s.pooled(|g| if g.pods == 16 { g.all_bound } else { None });
                let max = big
                    .iter()
                    .copied()
                    .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
                let _ = writeln!(
                    out,
                    "| {} | {} / {} | {} | {} |",
                    contender.label(),
                    seconds(percentile(&big, 50.0)),
                    seconds(max),
                    seconds(percentile(&s.bound(), 50.0)),
                    number(
                        s.per_phase(
                            |p| p.gangs.iter().filter(|g| g.pods == 16 && g.all_bound.is_none()).count() as f64
                        ),
                        1
                    ),
                );
            }
            let _ = writeln!(out);
        }
        ScenarioId::S4 => {
            let _ = writeln!(
                out,
                "One member of the running gang fails (its container exits 1). muster restarts the gang on its reservation; for upstream and plain the benchmark replaces the failed pod as a Job-like controller would.\n"
            );
            let _ = writeln!(
                out,
                "| contender | failure → all Running per run (s) | same devices back |"
            );
            let _ = writeln!(out, "|---|---|---|");
            for contender in Contender::ALL {
                let s = Summary::of(run, scenario.id, contender);
                if s.is_empty() {
                    continue;
                }
                let times: Vec<String> = s
                    .phases
                    .iter()
                    .map(|p| seconds(p.recovery.as_ref().and_then(|r| r.seconds)))
                    .collect();
                let same = s
                    .phases
                    .iter()
                    .filter(|p| p.recovery.as_ref().is_some_and(|r| r.same_devices))
                    .count();
                let _ = writeln!(
                    out,
                    "| {} | {} | {same} of {} |",
                    contender.label(),
                    times.join(", "),
                    s.phases.len()
                );
            }
            let _ = writeln!(out);
        }
        ScenarioId::S7 => {
            let _ = writeln!(
                out,
                "The burst as in S6, every gang bound to one rack: from the last gang's create (a baseline's, its release) to every pod Running; muster's CPU seconds over the phase per 100 pods bound; its plans and their mean time, from `muster_plan_duration_seconds`.\n"
            );
            let _ = writeln!(
                out,
                "| contender | last create → all Running (s) | muster CPU s per 100 pods | muster plans per run, mean plan (ms) |"
            );
            let _ = writeln!(out, "|---|---|---|---|");
            for contender in Contender::ALL {
                let s = Summary::of(run, scenario.id, contender);
                if s.is_empty() {
                    continue;
                }
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} / {} |",
                    contender.label(),
                    spread(s.spread(PhaseResult::last_create_to_all_running), 1),
                    spread(s.spread(PhaseResult::muster_cpu_per_100_pods), 2),
                    number(s.spread(|p| p.muster_plans.map(|(n, _)| n)).map(|(m, _, _)| m), 0),
                    spread(s.spread(|p| p.muster_plans.map(|(_, mean)| mean * 1000.0)), 2),
                );
            }
            let _ = writeln!(out);
        }
        _ => {}
    }
}

/// Who wrote, per pod bound, in admission (until the gang runs) and after (its life:
/// finishing, deallocating, deleting); claim status writes per claim; conflicts; and the
/// reservation invariant.
fn writes_table(out: &mut String, run: &Run, scenario: &Scenario) {
    let _ = writeln!(
        out,
        "Writes per pod bound, from the audit log, admission / lifecycle, by client; claim status writes per claim (mean / most); requests refused with 409 Conflict per run (in brackets, muster's); pods that ran without being in `reservedFor` of each of their claims.\n"
    );
    let clients = [
        Client::Muster,
        Client::Scheduler,
        Client::ControllerManager,
        Client::Kwok,
        Client::Other,
    ];
    let header: Vec<&str> = clients.iter().map(|c| c.label()).collect();
    let _ = writeln!(
        out,
        "| contender | {} | all | claim status writes per claim | 409s | running unreserved |",
        header.join(" | ")
    );
    let _ = writeln!(out, "|---|{}---|---|---|---|", "---|".repeat(clients.len()));
    for contender in Contender::ALL {
        let s = Summary::of(run, scenario.id, contender);
        if s.is_empty() {
            continue;
        }
        let cells: Vec<String> = clients
            .iter()
            .map(|client| {
                format!(
                    "{} / {}",
                    number(
                        s.per_phase(|p| p.writes_per_pod(Some(*client), Some(Stage::Admission))),
                        2
                    ),
                    number(
                        s.per_phase(|p| p.writes_per_pod(Some(*client), Some(Stage::Lifecycle))),
                        2
                    )
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} / {} | {} ({}) | {} |",
            contender.label(),
            cells.join(" | "),
            spread(s.spread(|p| Some(p.gang_writes_per_pod())), 1),
            number(
                s.per_phase(|p| p.writes.claim_status_per_claim_all().map_or(0.0, |c| c.0)),
                2
            ),
            number(s.most(|p| p.writes.claim_status_per_claim_all().map(|c| c.1 as f64)), 0),
            number(s.per_phase(|p| p.writes.conflicts.values().sum::<u64>() as f64), 0),
            number(
                s.per_phase(|p| p.writes.conflicts.get(&Client::Muster).copied().unwrap_or(0) as f64),
                0
            ),
            number(s.per_phase(|p| p.unreserved_running.len() as f64), 0),
        );
    }
    let _ = writeln!(out);
}

/// muster's own writes per pod bound, by resource, admission / lifecycle: where the
/// operator's API load goes.
fn muster_writes_table(out: &mut String, run: &Run, scenario: &Scenario) {
    let s = Summary::of(run, scenario.id, Contender::Muster);
    if s.is_empty() {
        return;
    }
    let resources: BTreeSet<String> = s
        .phases
        .iter()
        .flat_map(|p| p.writes.by.keys())
        .filter(|(client, _, _)| *client == Client::Muster)
        .map(|(_, _, resource)| resource.clone())
        .collect();
    if resources.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "muster's own writes per pod bound, by resource, admission / lifecycle.\n\n| {} |\n|{}",
        resources.iter().map(String::as_str).collect::<Vec<_>>().join(" | "),
        "---|".repeat(resources.len())
    );
    let cells: Vec<String> = resources
        .iter()
        .map(|resource| {
            let per_pod = |stage: Stage| {
                s.per_phase(|p| {
                    p.writes
                        .by
                        .get(&(Client::Muster, stage, resource.clone()))
                        .copied()
                        .unwrap_or(0) as f64
                        / p.pods_bound.max(1) as f64
                })
            };
            format!(
                "{} / {}",
                number(per_pod(Stage::Admission), 2),
                number(per_pod(Stage::Lifecycle), 2)
            )
        })
        .collect();
    let _ = writeln!(out, "| {} |\n", cells.join(" | "));
}

/// ResourceClaim status writes per claim over the claim's whole life, by who wrote them
/// and, for muster and kube-controller-manager, whether during admission or after.
fn claim_writes_table(out: &mut String, run: &Run, scenario: &Scenario) {
    let _ = writeln!(
        out,
        "ResourceClaim status writes per claim over its whole life (creation to deletion), from the audit log, by writer: the mean per claim, and in brackets the most any one claim had; admission / lifecycle as above. Every claim whose status anyone wrote counts, also for the writers that never touched it; claims never written are counted apart: kube-controller-manager makes a pod whose claim it deleted at the pod's end a new one from the template (it does not check that the pod has ended), and deletes it unused.\n"
    );
    let columns: [(&str, ClaimWriter, Option<Stage>); 6] = [
        ("muster, admission", ClaimWriter::Muster, Some(Stage::Admission)),
        ("muster, lifecycle", ClaimWriter::Muster, Some(Stage::Lifecycle)),
        (
            "kube-controller-manager, admission",
            ClaimWriter::ControllerManager,
            Some(Stage::Admission),
        ),
        (
            "kube-controller-manager, lifecycle",
            ClaimWriter::ControllerManager,
            Some(Stage::Lifecycle),
        ),
        ("kube-scheduler", ClaimWriter::Scheduler, None),
        ("others", ClaimWriter::Others, None),
    ];
    let header: Vec<&str> = columns.iter().map(|c| c.0).collect();
    let _ = writeln!(
        out,
        "| contender | claims per run (never written) | {} | all writers: mean (lowest–highest repeat), most |",
        header.join(" | ")
    );
    let _ = writeln!(out, "|---|---|{}---|", "---|".repeat(columns.len()));
    for contender in Contender::ALL {
        let s = Summary::of(run, scenario.id, contender);
        if s.is_empty() {
            continue;
        }
        let per_claim = |which: &dyn Fn(Client, Stage) -> bool| {
            format!(
                "{} ({})",
                number(
                    s.per_phase(|p| p.writes.claim_status_per_claim(which).map_or(0.0, |c| c.0)),
                    2
                ),
                number(
                    s.most(|p| p.writes.claim_status_per_claim(which).map(|c| c.1 as f64)),
                    0
                )
            )
        };
        let cells: Vec<String> = columns
            .iter()
            .map(|(_, writer, stage)| {
                per_claim(&|c: Client, st: Stage| ClaimWriter::of(c) == *writer && stage.is_none_or(|w| w == st))
            })
            .collect();
        let _ = writeln!(
            out,
            "| {} | {} ({}) | {} | {}, {} |",
            contender.label(),
            number(s.per_phase(|p| p.writes.claims_written() as f64), 0),
            number(s.per_phase(|p| p.writes.claims_never_written() as f64), 0),
            cells.join(" | "),
            spread(s.spread(|p| p.writes.claim_status_per_claim_all().map(|c| c.0)), 2),
            number(s.most(|p| p.writes.claim_status_per_claim_all().map(|c| c.1 as f64)), 0),
        );
    }
    let _ = writeln!(out);
}

/// The CDF of create → Running per contender, for the scenarios with the most gangs.
pub fn plot(run: &Run) -> String {
    let colors = ["#1b6ac9", "#d9480f", "#666666", "#2b8a3e", "#862e9c", "#e67700"];
    let mut series = Vec::new();
    for scenario in run
        .scenarios
        .iter()
        .filter(|s| matches!(s.id, ScenarioId::S1 | ScenarioId::S5))
    {
        for contender in Contender::ALL {
            let s = Summary::of(run, scenario.id, contender);
            if s.is_empty() {
                continue;
            }
            series.push(Series {
                label: format!("{:?} {}", scenario.id, contender.label()),
                color: colors[series.len() % colors.len()],
                values: s.running(),
            });
        }
    }
    cdf_svg("create → all pods Running, per gang", "seconds (this machine)", &series)
}
