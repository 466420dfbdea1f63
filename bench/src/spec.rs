//! The scenarios: the fleet each runs on and the gangs it submits, in the full size the
//! report is made from and a smoke size that only shows the harness works.

use muster_local_cluster::fleet::FleetSpec;

/// One of the benchmark's scenarios.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ScenarioId {
    /// No contention: every gang fits at once.
    S1,
    /// Every gang must share one rack.
    S2,
    /// Demand twice the capacity; pods finish after a while and free their devices.
    S3,
    /// One member of a running gang fails.
    S4,
    /// Many nodes, many gangs created, run, finished and deleted.
    S5,
    /// A burst that fits: every gang at once on at least 1,000 nodes; the rate pods are
    /// released and bound.
    S6,
    /// A burst of rack-bound gangs at once on 1,000 nodes (issue 38): how soon after the
    /// last create every pod runs, and what the burst costs muster.
    S7,
}

impl ScenarioId {
    pub const ALL: [ScenarioId; 7] = [
        ScenarioId::S1,
        ScenarioId::S2,
        ScenarioId::S3,
        ScenarioId::S4,
        ScenarioId::S5,
        ScenarioId::S6,
        ScenarioId::S7,
    ];

    pub fn title(self) -> &'static str {
        match self {
            ScenarioId::S1 => "S1 no contention",
            ScenarioId::S2 => "S2 topology",
            ScenarioId::S3 => "S3 oversubscription",
            ScenarioId::S4 => "S4 member failure",
            ScenarioId::S5 => "S5 scale",
            ScenarioId::S6 => "S6 burst",
            ScenarioId::S7 => "S7 rack-bound burst",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|s| format!("{s:?}").eq_ignore_ascii_case(text))
    }
}

/// A gang: `pods` identical pods with `gpus` GPUs each.
#[derive(Clone, Debug)]
pub struct GangSpec {
    /// Unique in its phase, and no name is a prefix of another (fixed-width numbers), so
    /// that the gang of a claim follows from the claim's name.
    pub name: String,
    pub pods: usize,
    pub gpus: usize,
    /// All pods must land in one rack.
    pub same_rack: bool,
    /// Pods succeed this long after they start running; `None` runs until deleted.
    pub run_for_seconds: Option<u64>,
    /// Submitted held and let go all at once with every other held gang (the burst):
    /// the baselines' pods wait behind a scheduling gate of the benchmark's until every
    /// pod exists. muster's Workloads are simply created at that moment.
    pub held: bool,
}

/// A scenario at a given size.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub id: ScenarioId,
    pub fleet: FleetSpec,
    pub gangs: Vec<GangSpec>,
    /// Finished gangs are deleted by the benchmark as soon as they finish (churn).
    pub delete_finished: bool,
    /// How long the phase may run before what is left counts as stuck.
    pub timeout_seconds: u64,
    /// No pod bound, started or finished for this long ends the phase as stalled.
    pub stall_seconds: u64,
}

impl Scenario {
    pub fn gpus(&self) -> usize {
        self.fleet.nodes * self.fleet.gpus_per_node
    }

    pub fn pods(&self) -> usize {
        self.gangs.iter().map(|g| g.pods).sum()
    }
}

/// The sizes to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    /// The report's size.
    Full,
    /// A few nodes and gangs per scenario: checks the harness, measures nothing.
    Smoke,
}

fn fleet(nodes: usize, nodes_per_rack: usize) -> FleetSpec {
    FleetSpec {
        nodes,
        nodes_per_rack,
        racks_per_block: 4,
        blocks_per_zone: 4,
        gpus_per_node: 8,
        parallelism: 64,
        ..FleetSpec::default()
    }
}

fn gangs(
    prefix: &str,
    shapes: impl IntoIterator<Item = (usize, usize)>,
    same_rack: bool,
    run_for: Option<u64>,
) -> Vec<GangSpec> {
    shapes
        .into_iter()
        .enumerate()
        .map(|(i, (pods, gpus))| GangSpec {
            name: format!("{prefix}-{i:04}"),
            pods,
            gpus,
            same_rack,
            run_for_seconds: run_for,
            held: false,
        })
        .collect()
}

/// Gang sizes of S3, in submission order: 1, 4, 8, 16 pods, repeated.
const S3_SIZES: [usize; 4] = [1, 4, 8, 16];

/// The scenario `id` at `size`. Each size keeps the scenario's shape: contention,
/// topology and failure are the same questions at either size.
pub fn scenario(id: ScenarioId, size: Size) -> Scenario {
    let smoke = size == Size::Smoke;
    match id {
        ScenarioId::S1 => {
            let (nodes, count) = if smoke { (4, 3) } else { (64, 48) };
            Scenario {
                id,
                fleet: fleet(nodes, 8),
                gangs: gangs("s1", (0..count).map(|_| (4, 2)), false, None),
                delete_finished: false,
                timeout_seconds: 300,
                stall_seconds: 60,
            }
        }
        ScenarioId::S2 => {
            // Racks of four (smoke) or eight nodes; one gang per rack fills it exactly.
            let (nodes, per_rack) = if smoke { (8, 4) } else { (48, 8) };
            let count = nodes / per_rack;
            Scenario {
                id,
                fleet: fleet(nodes, per_rack),
                gangs: gangs("s2", (0..count).map(|_| (per_rack, 8)), true, None),
                delete_finished: false,
                timeout_seconds: 300,
                stall_seconds: 60,
            }
        }
        ScenarioId::S3 => {
            // Pods of two GPUs; demand is twice the fleet's GPUs.
            let (nodes, run_for) = if smoke { (4, 3) } else { (32, 20) };
            let capacity_pods = nodes * 8 / 2;
            let mut shapes = Vec::new();
            let mut demand = 0;
            let mut i = 0;
            while demand < 2 * capacity_pods {
                let pods = S3_SIZES[i % S3_SIZES.len()].min(capacity_pods);
                shapes.push((pods, 2));
                demand += pods;
                i += 1;
            }
            Scenario {
                id,
                fleet: fleet(nodes, 8),
                gangs: gangs("s3", shapes, false, Some(run_for)),
                delete_finished: false,
                timeout_seconds: if smoke { 240 } else { 900 },
                stall_seconds: 90,
            }
        }
        ScenarioId::S4 => {
            let nodes = if smoke { 4 } else { 16 };
            Scenario {
                id,
                fleet: fleet(nodes, 4),
                gangs: gangs("s4", [(4, 8)], true, None),
                delete_finished: false,
                timeout_seconds: 300,
                stall_seconds: 120,
            }
        }
        ScenarioId::S5 => {
            let (nodes, count, run_for) = if smoke { (8, 6, 3) } else { (1000, 500, 10) };
            Scenario {
                id,
                fleet: fleet(nodes, 4),
                gangs: gangs("s5", (0..count).map(|_| (4, 8)), true, Some(run_for)),
                delete_finished: true,
                timeout_seconds: if smoke { 300 } else { 1800 },
                stall_seconds: 120,
            }
        }
        ScenarioId::S6 => {
            // Gangs of four pods, a whole node each: the burst fills the fleet exactly.
            let nodes = if smoke { 16 } else { 1000 };
            let mut gangs = gangs("s6", (0..nodes / 4).map(|_| (4, 8)), false, None);
            for gang in &mut gangs {
                gang.held = true;
            }
            Scenario {
                id,
                fleet: fleet(nodes, 8),
                gangs,
                delete_finished: false,
                timeout_seconds: if smoke { 300 } else { 1200 },
                stall_seconds: 120,
            }
        }
        ScenarioId::S7 => {
            // Gangs of four pods, a whole node each, every gang in one rack of eight:
            // the burst takes four fifths of the fleet.
            let nodes = if smoke { 16 } else { 1000 };
            let mut gangs = gangs("s7", (0..nodes / 5).map(|_| (4, 8)), true, None);
            for gang in &mut gangs {
                gang.held = true;
            }
            Scenario {
                id,
                fleet: fleet(nodes, 8),
                gangs,
                delete_finished: false,
                timeout_seconds: if smoke { 300 } else { 1200 },
                stall_seconds: 120,
            }
        }
    }
}

/// A few of `scenario`'s gangs (up to four), for a contender's unmeasured warm-up on the
/// scenario's fleet.
pub fn warm_up(scenario: &Scenario) -> Scenario {
    Scenario {
        gangs: scenario.gangs.iter().take(4).cloned().collect(),
        timeout_seconds: scenario.timeout_seconds.min(300),
        ..scenario.clone()
    }
}
