//! Gang-aware priority preemption: which running gangs to evict, each one whole, so
//! that a gang that does not fit would fit in one topology domain (one value of its
//! required label, or the whole cluster without one). Pure like the rest of the engine:
//! the caller says how old each running gang is, and a decision to evict carries the
//! plan that proves the gang fits once its victims are gone.
//!
//! Per domain, the candidates are the gangs of strictly lower priority that hold pods,
//! or devices available to nodes, there: evicting anything else frees nothing the gang
//! could use there. They are evicted on a copy of the state, lowest priority first and
//! youngest first within a priority, until the smallest such prefix that lets the gang
//! fit is found (a check with all of them gone first, then a binary search). Then the
//! victims are reprieved, most valuable first (highest priority, then oldest), each
//! reprieve kept while the gang still fits, until no single victim can be spared.
//!
//! Domains are then compared by [`EvictionCost`]: the highest priority evicted, then
//! the number of gangs evicted, then the sum of their priorities, then the work lost.
//! Every step is a call to [`placement::plan`]; [`PreemptionOptions::max_plan_calls`]
//! bounds them.

use std::cmp::Reverse;
use std::collections::BTreeSet;
use std::fmt;

use rustc_hash::FxHashMap;

use crate::cluster::{ClusterState, DeviceReach, Evicted, PlanId};
use crate::key::{ClaimKey, ObjectKey, PodKey};
use crate::placement::{self, Outcome, Plan, PlanOptions};
use crate::request::GangRequest;
use crate::selector::NodeSelector;

/// Whether a gang may evict gangs of lower priority (`preemptionPolicy` of its
/// PriorityClass).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PreemptionPolicy {
    #[default]
    PreemptLowerPriority,
    Never,
}

/// The gang that does not fit, as preemption sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preemptor {
    pub priority: i32,
    pub policy: PreemptionPolicy,
}

/// A running or admitted gang that could be evicted, with everything it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreemptionCandidate {
    /// Its Workload.
    pub workload: ObjectKey,
    pub priority: i32,
    /// When it was admitted, in seconds on any clock the caller keeps consistently:
    /// larger is younger, and a younger gang loses less work when evicted.
    pub admitted_at_seconds: i64,
    /// Its pods that use node resources.
    pub pods: Vec<PodKey>,
    /// Its allocated claims.
    pub claims: Vec<ClaimKey>,
    /// Plans assumed for it and not confirmed yet: the pods and claims they entered go
    /// with it.
    pub assumed_plans: Vec<PlanId>,
}

/// Limits of one preemption decision.
#[derive(Clone, Debug)]
pub struct PreemptionOptions {
    /// For every trial placement of the preemptor (its `required_value` is set per
    /// domain).
    pub plan: PlanOptions,
    /// Trial placements in one decision: each domain costs one with every candidate
    /// gone, about log2(candidates) to find the smallest prefix, and one per victim to
    /// reprieve.
    pub max_plan_calls: u32,
}

impl Default for PreemptionOptions {
    fn default() -> Self {
        PreemptionOptions {
            plan: PlanOptions::default(),
            max_plan_calls: 256,
        }
    }
}

/// What an eviction costs, compared field by field in this order:
///
/// 1. the highest priority evicted: a gang is only ever evicted where nothing of lower
///    priority would do, whatever the numbers;
/// 2. the number of gangs evicted: each eviction restarts a whole gang, and priorities
///    may be negative, so a sum of priorities alone would favour evicting more gangs;
/// 3. the sum of their priorities: among as many victims, the less important ones;
/// 4. the work lost, as the largest sum of admission times: with as many victims, the
///    least total time run on any clock (the youngest gangs).
///
/// A lower cost is better; domains that cost the same go by label value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvictionCost {
    pub highest_priority: i32,
    pub victims: usize,
    pub priority_sum: i64,
    pub admitted_at_sum: i128,
}

impl EvictionCost {
    fn of<'a>(victims: impl Iterator<Item = &'a PreemptionCandidate>) -> Self {
        let mut cost = EvictionCost {
            highest_priority: i32::MIN,
            victims: 0,
            priority_sum: 0,
            admitted_at_sum: 0,
        };
        for victim in victims {
            cost.highest_priority = cost.highest_priority.max(victim.priority);
            cost.victims += 1;
            cost.priority_sum += i64::from(victim.priority);
            cost.admitted_at_sum += i128::from(victim.admitted_at_seconds);
        }
        cost
    }

    fn rank(&self) -> (i32, usize, i64, Reverse<i128>) {
        (
            self.highest_priority,
            self.victims,
            self.priority_sum,
            Reverse(self.admitted_at_sum),
        )
    }
}

/// Gangs to evict so that the preemptor fits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Eviction {
    /// Whole gangs, lowest priority first, youngest first within a priority.
    pub victims: Vec<ObjectKey>,
    /// The value of the required topology label every victim is evicted from (none: the
    /// gang has no required label).
    pub domain: Option<String>,
    /// Where the preemptor goes once the victims are gone: the devices to nominate to it.
    pub plan: Plan,
    pub cost: EvictionCost,
    /// Trial placements this decision made.
    pub plan_calls: u32,
    /// False when the budget of trial placements ran out before every domain was
    /// weighed: the eviction is proven and no victim can be spared, but another domain
    /// might have cost less.
    pub every_domain_weighed: bool,
}

/// The decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Preemption {
    Evict(Box<Eviction>),
    /// The gang fits without evicting anything (the state changed since the caller's
    /// own plan failed).
    Fits {
        domain: Option<String>,
        plan: Box<Plan>,
    },
    /// The gang may not evict anything: why.
    NotAllowed(String),
    /// The gang would not fit in any domain even with every gang it may evict there
    /// gone: why, with numbers.
    WouldNotFit(Vec<String>),
    /// The budget of trial placements ran out before any eviction was proven: why.
    BudgetSpent(String),
}

impl fmt::Display for Preemption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Preemption::Evict(eviction) => {
                let victims: Vec<&str> = eviction.victims.iter().map(ObjectKey::as_str).collect();
                write!(
                    f,
                    "evict {} gang(s) up to priority {}: {}",
                    victims.len(),
                    eviction.cost.highest_priority,
                    victims.join(", ")
                )
            }
            Preemption::Fits { .. } => write!(f, "fits without evicting any gang"),
            Preemption::NotAllowed(why) | Preemption::BudgetSpent(why) => write!(f, "{why}"),
            Preemption::WouldNotFit(reasons) => write!(f, "{}", reasons.join("; ")),
        }
    }
}

/// How many domains that do not fit are explained one by one.
const DOMAINS_EXPLAINED: usize = 3;

/// Decides which gangs to evict so that `gang` fits. Call it when [`placement::plan`]
/// found no place for the gang: a domain where no candidate holds anything is not
/// planned again.
pub fn preempt(
    cluster: &ClusterState,
    gang: &GangRequest,
    preemptor: &Preemptor,
    candidates: &[PreemptionCandidate],
    options: &PreemptionOptions,
) -> Preemption {
    if preemptor.policy == PreemptionPolicy::Never {
        return Preemption::NotAllowed(format!(
            "gang {} has preemption policy Never: it evicts no other gang",
            gang.name
        ));
    }
    let lower: Vec<usize> = (0..candidates.len())
        .filter(|&c| candidates[c].priority < preemptor.priority)
        .collect();
    if lower.is_empty() {
        return Preemption::NotAllowed(match candidates.iter().map(|c| c.priority).min() {
            Some(lowest) => format!(
                "no running gang has a priority below {} (the lowest of {} is {lowest})",
                preemptor.priority,
                candidates.len()
            ),
            None => "no running gang to evict".to_string(),
        });
    }
    let domains = Domains::new(cluster, gang, candidates, &lower);
    Search {
        gang,
        preemptor,
        candidates,
        options,
        state: cluster.clone(),
        calls: 0,
    }
    .run(&domains, lower.len())
}

/// The domains of the gang's required label, each with the candidates that hold
/// something there.
struct Domains {
    values: Vec<Option<String>>,
    /// Per domain: indices into the candidates.
    members: Vec<Vec<usize>>,
    label: Option<String>,
}

impl Domains {
    fn new(cluster: &ClusterState, gang: &GangRequest, candidates: &[PreemptionCandidate], lower: &[usize]) -> Self {
        let label = gang.topology.required.clone();
        let index = cluster.nodes_by_label(label.as_deref());
        let domain_of: FxHashMap<&str, usize> = index
            .iter()
            .enumerate()
            .flat_map(|(d, (_, nodes))| nodes.iter().map(move |(_, node)| (node.name.as_str(), d)))
            .collect();
        let mut members = vec![Vec::new(); index.len()];
        let mut selected = Vec::new();
        for &c in lower {
            for d in touched_domains(cluster, &candidates[c], &domain_of, &index, &mut selected) {
                members[d].push(c);
            }
        }
        Domains {
            values: index
                .iter()
                .map(|(value, _)| label.as_ref().map(|_| value.clone()))
                .collect(),
            members,
            label,
        }
    }

    fn describe(&self, d: usize) -> String {
        match (&self.label, &self.values[d]) {
            (Some(label), Some(value)) => format!("{label}={value}"),
            _ => "the cluster".to_string(),
        }
    }
}

/// The domains whose nodes a candidate's pods run on, or can use a device it holds.
/// `selected` keeps the domains of each node selector met so far: devices shared by
/// several nodes come in slices of a few selectors.
fn touched_domains<'c>(
    cluster: &'c ClusterState,
    candidate: &PreemptionCandidate,
    domain_of: &FxHashMap<&str, usize>,
    index: &crate::cluster::NodeIndex,
    selected: &mut Vec<(&'c NodeSelector, Vec<usize>)>,
) -> BTreeSet<usize> {
    let mut pods: Vec<&PodKey> = candidate.pods.iter().collect();
    let mut claims: Vec<&ClaimKey> = candidate.claims.iter().collect();
    for plan in &candidate.assumed_plans {
        if let Some((plan_pods, plan_claims)) = cluster.assumed_plan_members(plan) {
            pods.extend(plan_pods);
            claims.extend(plan_claims);
        }
    }
    let mut touched = BTreeSet::new();
    for pod in pods {
        if let Some(d) = cluster.pod_node(pod).and_then(|node| domain_of.get(node)) {
            touched.insert(*d);
        }
    }
    for claim in claims {
        for device in cluster.claim_devices(claim).unwrap_or_default() {
            // Admin access holds nothing: evicting it frees nothing.
            if device.admin_access == Some(true) {
                continue;
            }
            match cluster.device_reach(&device.driver, &device.pool, &device.device) {
                Some(DeviceReach::Node(node)) => touched.extend(domain_of.get(node)),
                Some(DeviceReach::Selector(selector)) => {
                    if !selected.iter().any(|(known, _)| *known == selector) {
                        let domains = (0..index.len())
                            .filter(|d| index[*d].1.iter().any(|(_, n)| selector.matches(&n.name, &n.labels)))
                            .collect();
                        selected.push((selector, domains));
                    }
                    if let Some((_, domains)) = selected.iter().find(|(known, _)| *known == selector) {
                        touched.extend(domains);
                    }
                }
                Some(DeviceReach::All) => touched.extend(0..index.len()),
                None => {}
            }
        }
    }
    touched
}

/// One decision's search, on its own copy of the state.
struct Search<'a> {
    gang: &'a GangRequest,
    preemptor: &'a Preemptor,
    candidates: &'a [PreemptionCandidate],
    options: &'a PreemptionOptions,
    state: ClusterState,
    calls: u32,
}

/// The best eviction of one domain.
struct DomainEviction {
    /// Candidate indices, in eviction order.
    victims: Vec<usize>,
    plan: Plan,
    cost: EvictionCost,
}

enum DomainResult {
    Evict(Box<DomainEviction>),
    /// Not even with every candidate gone: the planner's reasons.
    WouldNotFit(Vec<String>),
    BudgetSpent,
}

impl Search<'_> {
    fn run(mut self, domains: &Domains, lower: usize) -> Preemption {
        // Domains whose cheapest candidate is cheapest first, so that a good eviction
        // found early caps the priorities the others may evict.
        let mut order: Vec<usize> = (0..domains.values.len())
            .filter(|d| !domains.members[*d].is_empty())
            .collect();
        let lowest = |d: usize| domains.members[d].iter().map(|c| self.candidates[*c].priority).min();
        order.sort_by_cached_key(|&d| (lowest(d), domains.members[d].len(), domains.values[d].clone()));
        let empty_domains = domains.values.len() - order.len();

        let mut best: Option<(usize, DomainEviction)> = None;
        let mut failures: Vec<String> = Vec::new();
        let mut weighed = 0;
        let mut spent = false;
        for &d in &order {
            let cap = best.as_ref().map(|(_, e)| e.cost.highest_priority);
            let mut members: Vec<usize> = domains.members[d]
                .iter()
                .copied()
                .filter(|c| cap.is_none_or(|cap| self.candidates[*c].priority <= cap))
                .collect();
            if members.is_empty() {
                weighed += 1;
                continue;
            }
            members.sort_by(|a, b| {
                let (a, b) = (&self.candidates[*a], &self.candidates[*b]);
                (a.priority, Reverse(a.admitted_at_seconds), &a.workload).cmp(&(
                    b.priority,
                    Reverse(b.admitted_at_seconds),
                    &b.workload,
                ))
            });
            match self.weigh(&domains.values[d], &members) {
                DomainResult::Evict(eviction) if eviction.victims.is_empty() => {
                    return Preemption::Fits {
                        domain: domains.values[d].clone(),
                        plan: Box::new(eviction.plan),
                    };
                }
                DomainResult::Evict(eviction) => {
                    let better = best.as_ref().is_none_or(|(b, current)| {
                        (eviction.cost.rank(), &domains.values[d]) < (current.cost.rank(), &domains.values[*b])
                    });
                    if better {
                        best = Some((d, *eviction));
                    }
                }
                DomainResult::WouldNotFit(reasons) => {
                    failures.push(format!(
                        "{}, with {} gang(s) of lower priority evicted: {}",
                        domains.describe(d),
                        members.len(),
                        reasons.join("; ")
                    ));
                }
                DomainResult::BudgetSpent => {
                    spent = true;
                    break;
                }
            }
            weighed += 1;
        }

        if let Some((d, eviction)) = best {
            return Preemption::Evict(Box::new(Eviction {
                victims: eviction
                    .victims
                    .iter()
                    .map(|c| self.candidates[*c].workload.clone())
                    .collect(),
                domain: domains.values[d].clone(),
                plan: eviction.plan,
                cost: eviction.cost,
                plan_calls: self.calls,
                every_domain_weighed: !spent,
            }));
        }
        if spent {
            return Preemption::BudgetSpent(format!(
                "preemption for gang {} spent its {} trial placements after weighing {weighed} of {} domains with gangs of lower priority, before any eviction was proven",
                self.gang.name,
                self.options.max_plan_calls,
                order.len()
            ));
        }
        self.would_not_fit(domains, failures, empty_domains, lower)
    }

    fn would_not_fit(
        &self,
        domains: &Domains,
        failures: Vec<String>,
        empty_domains: usize,
        lower: usize,
    ) -> Preemption {
        let gang = &self.gang.name;
        let priority = self.preemptor.priority;
        let scope = match &domains.label {
            Some(label) => format!("in any {label}"),
            None => "in the cluster".to_string(),
        };
        if failures.is_empty() {
            return Preemption::WouldNotFit(vec![format!(
                "gang {gang} (priority {priority}) would not fit {scope} by preemption: none of the {lower} gang(s) of lower priority holds pods or devices there"
            )]);
        }
        let mut reasons = vec![format!(
            "gang {gang} (priority {priority}) would not fit {scope} even with every gang of lower priority there evicted ({lower} such gang(s))"
        )];
        let more = failures.len().saturating_sub(DOMAINS_EXPLAINED);
        reasons.extend(failures.into_iter().take(DOMAINS_EXPLAINED));
        if more > 0 {
            reasons.push(format!("and {more} more domain(s) where it would not fit either"));
        }
        if empty_domains > 0 {
            reasons.push(format!("{empty_domains} domain(s) hold no gang of lower priority"));
        }
        Preemption::WouldNotFit(reasons)
    }

    /// The cheapest eviction in one domain among `members` (in eviction order). Leaves
    /// the state as it found it.
    fn weigh(&mut self, domain: &Option<String>, members: &[usize]) -> DomainResult {
        let options = PlanOptions {
            required_value: domain.clone(),
            ..self.options.plan.clone()
        };
        let mut evicted: Vec<Option<Evicted>> = vec![None; members.len()];
        let result = self.weigh_on(&options, members, &mut evicted);
        for record in evicted.into_iter().rev().flatten() {
            self.state.restore(record);
        }
        result
    }

    fn weigh_on(&mut self, options: &PlanOptions, members: &[usize], evicted: &mut [Option<Evicted>]) -> DomainResult {
        // With every candidate gone: whether this domain can work at all.
        let mut prefix = 0;
        self.move_to_prefix(members, evicted, &mut prefix, members.len());
        let mut plan = match self.try_plan(options) {
            None => return DomainResult::BudgetSpent,
            Some(Outcome::Unschedulable(why)) => return DomainResult::WouldNotFit(why.reasons),
            Some(Outcome::Placed(plan)) => plan,
        };
        // The smallest prefix that fits; the empty one is taken not to (the caller's
        // plan failed), and the reprieve below finds out if it does.
        let (mut fails, mut fits) = (0, members.len());
        while fits - fails > 1 {
            let middle = fails + (fits - fails) / 2;
            self.move_to_prefix(members, evicted, &mut prefix, middle);
            match self.try_plan(options) {
                None => return DomainResult::BudgetSpent,
                Some(Outcome::Placed(found)) => {
                    fits = middle;
                    plan = found;
                }
                Some(Outcome::Unschedulable(_)) => fails = middle,
            }
        }
        self.move_to_prefix(members, evicted, &mut prefix, fits);

        // Reprieve, most valuable first. A victim kept before a later one was spared is
        // tried again, so that at the end no single victim can be spared, however the
        // planner's heuristics react to more room.
        let mut by_value: Vec<usize> = (0..fits).collect();
        by_value.sort_by(|a, b| {
            let (a, b) = (&self.candidates[members[*a]], &self.candidates[members[*b]]);
            (Reverse(a.priority), a.admitted_at_seconds, &a.workload).cmp(&(
                Reverse(b.priority),
                b.admitted_at_seconds,
                &b.workload,
            ))
        });
        let mut reprieves = 0;
        let mut kept_at: Vec<Option<usize>> = vec![None; members.len()];
        loop {
            let mut tried = false;
            for &v in &by_value {
                if evicted[v].is_none() || kept_at[v] == Some(reprieves) {
                    continue;
                }
                tried = true;
                if let Some(record) = evicted[v].take() {
                    self.state.restore(record);
                }
                match self.try_plan(options) {
                    None => {
                        // Leave the state as the records say.
                        evicted[v] = Some(self.evict(members[v]));
                        return DomainResult::BudgetSpent;
                    }
                    Some(Outcome::Placed(found)) => {
                        plan = found;
                        reprieves += 1;
                    }
                    Some(Outcome::Unschedulable(_)) => {
                        evicted[v] = Some(self.evict(members[v]));
                        kept_at[v] = Some(reprieves);
                    }
                }
            }
            if !tried {
                break;
            }
        }
        let victims: Vec<usize> = (0..fits)
            .filter(|v| evicted[*v].is_some())
            .map(|v| members[v])
            .collect();
        DomainResult::Evict(Box::new(DomainEviction {
            cost: EvictionCost::of(victims.iter().map(|c| &self.candidates[*c])),
            victims,
            plan,
        }))
    }

    /// Evicts candidates `members[..target]` and restores the others, from `prefix`.
    fn move_to_prefix(
        &mut self,
        members: &[usize],
        evicted: &mut [Option<Evicted>],
        prefix: &mut usize,
        target: usize,
    ) {
        while *prefix < target {
            evicted[*prefix] = Some(self.evict(members[*prefix]));
            *prefix += 1;
        }
        while *prefix > target {
            *prefix -= 1;
            if let Some(record) = evicted[*prefix].take() {
                self.state.restore(record);
            }
        }
    }

    fn evict(&mut self, candidate: usize) -> Evicted {
        let candidate = &self.candidates[candidate];
        self.state
            .evict(&candidate.pods, &candidate.claims, &candidate.assumed_plans)
    }

    /// One trial placement, or `None` when the budget is spent.
    fn try_plan(&mut self, options: &PlanOptions) -> Option<Outcome> {
        if self.calls >= self.options.max_plan_calls {
            return None;
        }
        self.calls += 1;
        Some(placement::plan(&self.state, self.gang, options))
    }
}

#[cfg(test)]
mod tests;
