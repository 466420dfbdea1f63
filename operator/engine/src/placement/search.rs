//! Bounded backtracking across the gang's pods, for when first fit fails.
//!
//! First fit commits each pod to a node and to devices for good, so a group whose
//! selectors accept more than another's may take what the other needed, and a gang
//! that fits is reported as not fitting. Here the pods the gang requires are placed
//! tightest group first (fewest candidate nodes, least room), depth first: a pod that
//! fits nowhere sends the search back to the pods before it, which try their next node.
//! Whenever a pod joins a node, the devices of every pod on that node are allocated
//! anew in one allocator call, so earlier device choices on the node are revisited too.
//! Every pod tried on a node spends one attempt of [`PlanOptions::backtrack_budget`].
//!
//! [`PlanOptions::backtrack_budget`]: super::PlanOptions::backtrack_budget

use std::collections::BTreeMap;

use super::{ClaimAllocation, Domain, Occupancy, Placement, Plan, Planner, fixed_allocations_allow};
use crate::allocator::{self, AllocationError, ClaimRef, NoFit, NodeFit, WorkingSet};
use crate::claim::Allocation;
use crate::key::PodKey;
use crate::resources::Resources;

/// One pod of the gang.
#[derive(Clone, Copy, Debug)]
struct Member {
    group: usize,
    index: usize,
}

/// The pods on one node, with the allocations of their open claims in the same order.
#[derive(Clone, Default)]
struct NodeLoad {
    members: Vec<Member>,
    allocations: Vec<Allocation>,
    used: Resources,
}

/// Where the search stands: the load of every node it uses, every device it holds, and
/// its pods as the pod constraints count them.
struct Layout {
    loads: BTreeMap<usize, NodeLoad>,
    held: WorkingSet,
    occupancy: Occupancy,
}

enum Attempt {
    /// The pod is on the node now; the node's load before, to go back to.
    Placed(NodeLoad),
    /// Not with the pods already there.
    NoRoom,
    /// The call's allocator step budget ran out.
    StepsSpent,
}

enum SearchEnd {
    Found,
    NotFound,
    AttemptsSpent,
    StepsSpent(PodKey),
}

impl<'a> Planner<'a> {
    /// Whether the search applies: a budget is set, and no shared claim is still to be
    /// allocated (first fit alone decides where those go).
    pub(super) fn can_backtrack(&self) -> bool {
        let gang = self.gang;
        self.options.backtrack_budget > 0
            && !gang.groups.iter().any(|g| {
                g.shape
                    .shared
                    .iter()
                    .any(|s| gang.shared_claims[*s].allocation.is_none())
            })
    }

    /// Places the gang by search after first fit failed with `first_fit_failure`.
    pub(super) fn place_by_search(
        &self,
        domain: &Domain<'a>,
        orders: &[Vec<usize>],
        budget: &mut u64,
        first_fit_failure: String,
    ) -> Result<Placement, AllocationError> {
        let gang = self.gang;
        let groups = self.tightest_groups_first(orders);
        let members: Vec<Member> = groups
            .iter()
            .flat_map(|&group| (0..gang.groups[group].min_count).map(move |index| Member { group, index }))
            .collect();
        let mut layout = Layout {
            loads: BTreeMap::new(),
            held: WorkingSet::default(),
            occupancy: self.constraints.occupancy(),
        };
        let mut chosen = vec![0; members.len()];
        let attempts = self.options.backtrack_budget;
        match self.search(&mut layout, &members, orders, &mut chosen, 0, budget)? {
            SearchEnd::Found => {}
            SearchEnd::NotFound => {
                return Ok(Placement::NoFit(format!(
                    "{first_fit_failure}, and no other choice of nodes and devices for the pods before it fits either"
                )));
            }
            SearchEnd::AttemptsSpent => {
                // Earlier domains may have spent part of the call's attempts.
                return Ok(Placement::SearchExhausted(format!(
                    "search budget exhausted: the call's {attempts} placement attempts revisiting earlier pods' nodes and devices ran out before a plan was found or ruled out (first fit: {first_fit_failure})"
                )));
            }
            SearchEnd::StepsSpent(pod) => return Ok(Placement::BudgetSpent { pod }),
        }
        // Pods beyond minCount: first fit around the required ones, as they are optional.
        for &g in &groups {
            let group = &gang.groups[g];
            for index in group.min_count..group.pods.len() {
                let member = Member { group: g, index };
                let mut fitted = false;
                if group.topology.slice.is_some() {
                    // Whole slices only: a sliced group's extras wait.
                    break;
                }
                for &n in &orders[g] {
                    if !self.topology_allows(&layout, member, n) {
                        continue;
                    }
                    match self.place_member(&mut layout, n, member, budget)? {
                        Attempt::Placed(_) => {
                            fitted = true;
                            break;
                        }
                        Attempt::NoRoom => {}
                        Attempt::StepsSpent => {
                            return Ok(Placement::BudgetSpent {
                                pod: group.pods[index].key.clone(),
                            });
                        }
                    }
                }
                if !fitted {
                    break;
                }
            }
        }
        Ok(Placement::Placed(self.plan_of(domain, &layout)))
    }

    /// Groups with the fewest candidate nodes first, then the least room over them, then
    /// the biggest pods; request order breaks ties.
    fn tightest_groups_first(&self, orders: &[Vec<usize>]) -> Vec<usize> {
        let mut groups: Vec<usize> = (0..self.gang.groups.len()).collect();
        groups.sort_by_key(|&g| {
            let room: usize = orders[g].iter().map(|n| self.room(*n, g)).sum();
            (
                self.constraints.follows_others(g),
                orders[g].len(),
                room,
                std::cmp::Reverse(self.weights[g]),
                g,
            )
        });
        groups
    }

    fn search(
        &self,
        layout: &mut Layout,
        members: &[Member],
        orders: &[Vec<usize>],
        chosen: &mut [usize],
        depth: usize,
        budget: &mut u64,
    ) -> Result<SearchEnd, AllocationError> {
        let Some(&member) = members.get(depth) else {
            return Ok(SearchEnd::Found);
        };
        // Pods of a group without allocations of their own are alike: placing them in node
        // order skips the permutations of one placement.
        // Not so for slices: which slice a pod is in depends on its index.
        let alike = depth > 0
            && members[depth - 1].group == member.group
            && self.gang.groups[member.group].topology.slice.is_none()
            && self.constraints.pods_alike(member.group)
            && self.gang.groups[member.group]
                .pods
                .iter()
                .all(|p| p.claims.iter().all(|c| c.allocation.is_none()));
        let first = if alike { chosen[depth - 1] } else { 0 };
        for (k, &n) in orders[member.group].iter().enumerate().skip(first) {
            let left = self.backtrack_left.get();
            if left == 0 {
                return Ok(SearchEnd::AttemptsSpent);
            }
            self.backtrack_left.set(left - 1);
            if !self.topology_allows(layout, member, n) {
                continue;
            }
            match self.place_member(layout, n, member, budget)? {
                Attempt::NoRoom => {}
                Attempt::StepsSpent => {
                    let pod = &self.gang.groups[member.group].pods[member.index];
                    return Ok(SearchEnd::StepsSpent(pod.key.clone()));
                }
                Attempt::Placed(before) => {
                    chosen[depth] = k;
                    match self.search(layout, members, orders, chosen, depth + 1, budget)? {
                        SearchEnd::NotFound => self.restore(layout, n, member, before),
                        end => return Ok(end),
                    }
                }
            }
        }
        Ok(SearchEnd::NotFound)
    }

    /// Whether `member` may join candidate `n` as its group's topology goes: in the value
    /// of the group's required label its placed pods have, and in the value of the slice
    /// label the placed pods of its slice have.
    fn topology_allows(&self, layout: &Layout, member: Member, n: usize) -> bool {
        let topology = &self.gang.groups[member.group].topology;
        if topology.is_empty() {
            return true;
        }
        let labels = &self.candidates[n].node.labels;
        let slice_of = |index: usize| topology.slice.as_ref().map(|s| index / s.size.max(1));
        layout.loads.iter().all(|(other, load)| {
            let other_labels = &self.candidates[*other].node.labels;
            load.members.iter().filter(|m| m.group == member.group).all(|m| {
                let same = |key: &String| labels.get(key) == other_labels.get(key);
                topology.required.as_ref().is_none_or(same)
                    && (slice_of(m.index) != slice_of(member.index)
                        || topology.slice.as_ref().is_none_or(|s| same(&s.key)))
            })
        })
    }

    /// Puts `member` on candidate `n`, allocating the devices of every pod there anew.
    fn place_member(
        &self,
        layout: &mut Layout,
        n: usize,
        member: Member,
        budget: &mut u64,
    ) -> Result<Attempt, AllocationError> {
        let node = &self.candidates[n].node;
        let group = &self.gang.groups[member.group];
        let pod = &group.pods[member.index];
        let mut free = self.cluster.free_resources(node);
        if let Some(load) = layout.loads.get(&n) {
            free.sub(&load.used);
        }
        if !group.shape.requests.fits_in(&free) || !fixed_allocations_allow(pod, node) {
            return Ok(Attempt::NoRoom);
        }
        let before = layout.loads.get(&n).cloned().unwrap_or_default();
        // The node's room for the group bounds its pods there: past it the allocator
        // would only prove, at a cost that grows fast with the pods, that they do not fit.
        let of_group = before.members.iter().filter(|m| m.group == member.group).count();
        if of_group >= self.room(n, member.group) {
            return Ok(Attempt::NoRoom);
        }
        let Ok(chosen_volumes) = self.constraints.admit(
            &layout.occupancy,
            member.group,
            member.index,
            self.candidates[n].id,
            node,
        ) else {
            return Ok(Attempt::NoRoom);
        };
        let mut members = before.members.clone();
        members.push(member);
        let refs: Vec<ClaimRef<'_>> = members.iter().flat_map(|m| self.open_claims_of(*m)).collect();
        let allocations = if refs.is_empty() {
            Vec::new()
        } else {
            for allocation in &before.allocations {
                layout.held.release(&allocation.devices);
            }
            let result = allocator::allocate(self.cluster, &layout.held, node, &refs, budget);
            if !matches!(result, Ok(NodeFit::Placed(_))) {
                for allocation in &before.allocations {
                    layout.held.hold(&allocation.devices);
                }
            }
            match result? {
                NodeFit::Placed(allocations) => allocations,
                NodeFit::NoFit(NoFit::NoSolution) => return Ok(Attempt::NoRoom),
                NodeFit::NoFit(NoFit::BudgetExhausted) => return Ok(Attempt::StepsSpent),
            }
        };
        for allocation in &allocations {
            layout.held.hold(&allocation.devices);
        }
        self.constraints
            .enter(&mut layout.occupancy, member.group, member.index, node, chosen_volumes);
        let mut used = before.used.clone();
        used.add(&group.shape.requests);
        layout.loads.insert(
            n,
            NodeLoad {
                members,
                allocations,
                used,
            },
        );
        Ok(Attempt::Placed(before))
    }

    /// The pod's claims that still need devices, in claim order.
    fn open_claims_of(&self, member: Member) -> impl Iterator<Item = ClaimRef<'a>> + use<'a> {
        let group = &self.gang.groups[member.group];
        let pod = &group.pods[member.index];
        pod.claims
            .iter()
            .zip(&group.shape.claims)
            .filter(|(claim, _)| claim.allocation.is_none())
            .map(|(claim, spec)| ClaimRef {
                key: claim.key.as_str(),
                spec,
            })
    }

    /// The plan of a finished layout: claims in group, pod and claim order.
    fn plan_of(&self, domain: &Domain<'a>, layout: &Layout) -> Plan {
        let gang = self.gang;
        let mut placed: Vec<Vec<Option<String>>> = gang.groups.iter().map(|g| vec![None; g.pods.len()]).collect();
        let mut claims: BTreeMap<(usize, usize, usize), ClaimAllocation> = BTreeMap::new();
        for (n, load) in &layout.loads {
            let node = &self.candidates[*n].node.name;
            let mut allocations = load.allocations.iter();
            for member in &load.members {
                placed[member.group][member.index] = Some(node.clone());
                let group = &gang.groups[member.group];
                let pod = &group.pods[member.index];
                for (c, claim) in pod.claims.iter().enumerate().filter(|(_, c)| c.allocation.is_none()) {
                    let allocation = allocations.next().expect("one allocation per open claim").clone();
                    claims.insert(
                        (member.group, member.index, c),
                        ClaimAllocation {
                            claim: claim.key.clone(),
                            allocation,
                        },
                    );
                }
            }
        }
        self.assemble(domain, &placed, claims.into_values().collect(), &layout.occupancy)
    }
}

impl Planner<'_> {
    /// Takes `member`, the pod last placed on candidate `n`, off it again: the node's load
    /// goes back to `before`, with its devices.
    fn restore(&self, layout: &mut Layout, n: usize, member: Member, before: NodeLoad) {
        if let Some(current) = layout.loads.remove(&n) {
            for allocation in &current.allocations {
                layout.held.release(&allocation.devices);
            }
        }
        for allocation in &before.allocations {
            layout.held.hold(&allocation.devices);
        }
        if !before.members.is_empty() {
            layout.loads.insert(n, before);
        }
        self.constraints.leave(
            &mut layout.occupancy,
            member.group,
            member.index,
            &self.candidates[n].node,
        );
    }
}
