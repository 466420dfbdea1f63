//! The worst-case cost estimate the API server computes for a selector and refuses
//! above [`crate::COST_LIMIT`]: cel-go's static cost model, with the Kubernetes library
//! estimator and the DRA size estimator (the largest device the API allows). Macros
//! are costed as cel-go expands them (accumulator, loop condition and step).

use crate::ast::Const;
use crate::parser::CompKind;
use crate::typed::{TComp, TKind, TNode};
use crate::types::{self, Type};

const SELECT_AND_IDENT: u64 = 1;
const LIST_CREATE: u64 = 10;
const MAP_CREATE: u64 = 30;
const STRING_TRAVERSAL: f64 = 0.1;
const REGEX_LENGTH: f64 = 0.25;

/// A [min, max] range, of costs or of sizes; arithmetic saturates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Est {
    min: u64,
    max: u64,
}

const UNKNOWN: Est = Est { min: 0, max: u64::MAX };

fn fixed(v: u64) -> Est {
    Est { min: v, max: v }
}

fn factor(x: u64, f: f64) -> u64 {
    let xf = x as f64;
    if xf > 0.0 && f > 0.0 && xf > u64::MAX as f64 / f {
        return u64::MAX;
    }
    let total = (xf * f).ceil();
    if total >= 18_446_744_073_709_551_616.0 {
        return u64::MAX;
    }
    total as u64
}

impl Est {
    fn add(self, o: Est) -> Est {
        Est {
            min: self.min.saturating_add(o.min),
            max: self.max.saturating_add(o.max),
        }
    }

    fn mul(self, o: Est) -> Est {
        Est {
            min: self.min.saturating_mul(o.min),
            max: self.max.saturating_mul(o.max),
        }
    }

    fn union(self, o: Est) -> Est {
        Est {
            min: self.min.min(o.min),
            max: self.max.max(o.max),
        }
    }

    fn times(self, f: f64) -> Est {
        Est {
            min: factor(self.min, f),
            max: factor(self.max, f),
        }
    }
}

/// Sizes of the entries of a list or map value.
#[derive(Clone, Copy, Debug)]
struct Entry {
    list: bool,
    key: Est,
    val: Est,
}

fn union_entry(a: Option<Entry>, b: Option<Entry>) -> Option<Entry> {
    match (a, b) {
        (Some(x), Some(y)) => Some(Entry {
            list: x.list,
            key: x.key.union(y.key),
            val: x.val.union(y.val),
        }),
        (x, None) => x,
        (None, y) => y,
    }
}

/// What the estimator knows of an expression besides its cost.
#[derive(Clone, Debug, Default)]
struct Info {
    /// A size computed from the expression (call results, comprehensions).
    size: Option<Est>,
    entry: Option<Entry>,
    /// Field path from a root variable, for the DRA size estimator.
    path: Option<Vec<String>>,
    /// A literal's own size.
    literal: Option<Est>,
    /// An int literal (for `lists.range`, `slice`, `flatten`, `split` limits).
    int: Option<i64>,
    ty: Type,
}

struct Local {
    slot: usize,
    path: Option<Vec<String>>,
    size: Option<Est>,
    entry: Option<Entry>,
}

struct Coster {
    locals: Vec<Local>,
}

/// The worst-case cost of a checked expression.
pub(crate) fn estimate(root: &TNode) -> u64 {
    let mut coster = Coster { locals: Vec::new() };
    coster.cost(root).0.max
}

/// The size the API server assumes for values reached from `device` (the limits of
/// the `resource.k8s.io` API).
fn device_size(path: &[String]) -> Option<Est> {
    #[derive(Clone, Copy, PartialEq)]
    enum D {
        Device,
        Driver,
        Multi,
        OuterAttr,
        InnerAttr,
        Attr,
        OuterCap,
        InnerCap,
        Quantity,
        Domain,
        Id,
    }
    let (first, rest) = path.split_first()?;
    if first != "device" {
        return None;
    }
    let mut node = D::Device;
    for name in rest {
        let elem = match node {
            D::OuterAttr => Some(D::InnerAttr),
            D::InnerAttr => Some(D::Attr),
            D::OuterCap => Some(D::InnerCap),
            D::InnerCap => Some(D::Quantity),
            _ => None,
        };
        let key = match node {
            D::OuterAttr | D::OuterCap => Some(D::Domain),
            D::InnerAttr | D::InnerCap => Some(D::Id),
            _ => None,
        };
        node = match name.as_str() {
            "@items" | "@values" => elem?,
            "@keys" => key?,
            field => match (node, field) {
                (D::Device, "driver") => D::Driver,
                (D::Device, "allowMultipleAllocations") => D::Multi,
                (D::Device, "attributes") => D::OuterAttr,
                (D::Device, "capacity") => D::OuterCap,
                _ if elem == Some(D::Attr) => D::Attr,
                _ => return None,
            },
        };
    }
    let max = match node {
        D::Device | D::Quantity => 0,
        D::Driver | D::Domain => 63,
        D::Multi => 1,
        D::OuterAttr | D::InnerAttr | D::OuterCap | D::InnerCap => 32,
        D::Attr => 64,
        D::Id => 32,
    };
    Some(Est { min: 0, max })
}

impl Coster {
    fn local(&self, slot: usize) -> Option<&Local> {
        self.locals.iter().rev().find(|l| l.slot == slot)
    }

    /// cel-go's `computeSize`: computed, literal, path-based, scalar, local variable.
    fn size(&self, info: &Info, local: Option<usize>) -> Option<Est> {
        if let Some(s) = info.size {
            return Some(s);
        }
        if let Some(s) = info.literal {
            return Some(s);
        }
        if let Some(path) = &info.path
            && let Some(s) = device_size(path)
        {
            return Some(s);
        }
        if info.ty.is_scalar() {
            return Some(fixed(1));
        }
        local.and_then(|slot| self.local(slot)).and_then(|l| l.size)
    }

    fn size_or_unknown(&self, info: &Info, local: Option<usize>) -> Est {
        self.size(info, local).unwrap_or(UNKNOWN)
    }

    fn push(&mut self, slot: usize, path: Option<Vec<String>>, size: Option<Est>, entry: Option<Entry>) {
        self.locals.push(Local {
            slot,
            path,
            size,
            entry,
        });
    }

    fn cost(&mut self, node: &TNode) -> (Est, Info) {
        let mut info = Info {
            ty: node.ty.clone(),
            ..Info::default()
        };
        let cost = match &node.kind {
            TKind::Const(c) => {
                info.literal = Some(fixed(match c {
                    Const::String(s) => s.chars().count() as u64,
                    Const::Bytes(b) => b.len() as u64,
                    _ => 1,
                }));
                if let Const::Int(i) = c {
                    info.int = Some(*i);
                }
                fixed(0)
            }
            TKind::Local { slot } => {
                if let Some(l) = self.local(*slot) {
                    info.path = l.path.clone();
                    info.entry = l.entry;
                }
                let size = self.size(&info, Some(*slot));
                info.size = size;
                fixed(SELECT_AND_IDENT)
            }
            TKind::Device => {
                info.path = Some(vec!["device".into()]);
                fixed(SELECT_AND_IDENT)
            }
            TKind::TypeIdent(_) => fixed(SELECT_AND_IDENT),
            TKind::Has { operand, .. } => self.cost(operand).0,
            TKind::Select {
                operand,
                field,
                optional,
            } => {
                let (c, o) = self.cost(operand);
                if *optional {
                    // `_?._`: an ordinary call.
                    c.add(fixed(1))
                } else {
                    info.path = o.path.map(|mut p| {
                        p.push(field.clone());
                        p
                    });
                    let access = matches!(o.ty, Type::Map(..) | Type::Struct(_) | Type::Param(_));
                    if access { c.add(fixed(SELECT_AND_IDENT)) } else { c }
                }
            }
            TKind::Index {
                operand,
                index,
                optional,
            } => {
                let (c1, o) = self.cost(operand);
                let (c2, _) = self.cost(index);
                if !*optional {
                    let list = matches!(o.ty, Type::List(_));
                    info.size = o.entry.map(|e| e.val);
                    info.path = o.path.clone().map(|mut p| {
                        p.push(if list { "@items" } else { "@values" }.into());
                        p
                    });
                    if info.size.is_none() {
                        info.size = info.path.as_deref().and_then(device_size);
                    }
                }
                c1.add(c2).add(fixed(1))
            }
            TKind::Call {
                function,
                member,
                overloads,
                args,
            } => self.call(function, *member, overloads, args, &mut info),
            TKind::List(items) => {
                let mut sum = fixed(0);
                let mut item_size = if items.is_empty() {
                    fixed(0)
                } else {
                    Est { min: u64::MAX, max: 0 }
                };
                for (item, _) in items {
                    let (c, i) = self.cost(item);
                    sum = sum.add(c);
                    item_size = item_size.union(self.size_or_unknown(&i, local_slot(item)));
                }
                info.literal = Some(fixed(items.len() as u64));
                info.entry = Some(Entry {
                    list: true,
                    key: fixed(1),
                    val: item_size,
                });
                sum.add(fixed(LIST_CREATE))
            }
            TKind::Map(entries) => {
                let mut sum = fixed(0);
                let empty = if entries.is_empty() {
                    fixed(0)
                } else {
                    Est { min: u64::MAX, max: 0 }
                };
                let (mut ks, mut vs) = (empty, empty);
                for (k, v, _) in entries {
                    let (ck, ik) = self.cost(k);
                    let (cv, iv) = self.cost(v);
                    sum = sum.add(ck).add(cv);
                    ks = ks.union(self.size_or_unknown(&ik, local_slot(k)));
                    vs = vs.union(self.size_or_unknown(&iv, local_slot(v)));
                }
                info.literal = Some(fixed(entries.len() as u64));
                info.entry = Some(Entry {
                    list: false,
                    key: ks,
                    val: vs,
                });
                sum.add(fixed(MAP_CREATE))
            }
            TKind::Bind { slot, init, body } => {
                let (ci, ii) = self.cost(init);
                let size = self.size(&ii, local_slot(init));
                self.push(*slot, ii.path.clone(), size, ii.entry);
                let (cb, ib) = self.cost(body);
                self.locals.pop();
                info.size = self.size(&ib, local_slot(body));
                info.entry = ib.entry;
                fixed(LIST_CREATE).add(ci).add(cb)
            }
            TKind::Comprehension(c) => self.comprehension(c, &mut info),
        };
        (cost, info)
    }

    fn comprehension(&mut self, c: &TComp, info: &mut Info) -> Est {
        let (cr, ri) = self.cost(&c.range);
        let range_size = self.size_or_unknown(&ri, local_slot(&c.range));
        let list = ri.entry.map_or(matches!(ri.ty, Type::List(_)), |e| e.list);
        let path = |sub: &str| {
            let mut p = ri.path.clone().unwrap_or_default();
            p.push(sub.to_string());
            Some(p)
        };
        match c.kind {
            CompKind::OptMap | CompKind::OptFlatMap => {
                // hasValue() on the target, then a binding of target.value().
                let has_value = cr.add(fixed(1));
                let value = cr.add(fixed(1));
                self.push(c.slot1, None, None, None);
                let (cb, _) = self.cost(&c.body);
                self.locals.pop();
                let bind = fixed(LIST_CREATE).add(value).add(cb);
                let some = if c.kind == CompKind::OptMap {
                    bind.add(fixed(1))
                } else {
                    bind
                };
                return has_value.add(some.union(fixed(1)));
            }
            CompKind::SortBy => return self.sort_by(c, cr, &ri, info),
            _ => {}
        }
        // Loop variables.
        let entry = ri.entry;
        if let Some(slot2) = c.slot2 {
            let key_path = path(if list { "@indices" } else { "@keys" });
            self.push(c.slot1, key_path, entry.map(|e| e.key), None);
            self.push(
                slot2,
                path(if list { "@items" } else { "@values" }),
                entry.map(|e| e.val),
                None,
            );
        } else if list {
            self.push(c.slot1, path("@items"), entry.map(|e| e.val), None);
        } else {
            self.push(c.slot1, path("@keys"), entry.map(|e| e.key), None);
        }
        let filter = c.filter.as_ref().map(|f| self.cost(f).0);
        let (body, bi) = self.cost(&c.body);
        let body_size = self.size_or_unknown(&bi, local_slot(&c.body));
        let var_size = self.local(c.slot1).and_then(|l| l.size);
        self.locals
            .truncate(self.locals.len() - 1 - usize::from(c.slot2.is_some()));
        let guarded = |step: Est, filter: Option<Est>| match filter {
            Some(f) => f.add(step.union(fixed(1))),
            None => step,
        };
        let (init, cond, step, result) = match c.kind {
            CompKind::All => (
                fixed(0),
                fixed(2),
                Est {
                    min: 1,
                    max: body.max.saturating_add(1),
                },
                fixed(1),
            ),
            CompKind::Exists => (
                fixed(0),
                fixed(3),
                Est {
                    min: 1,
                    max: body.max.saturating_add(1),
                },
                fixed(1),
            ),
            CompKind::ExistsOne => (fixed(0), fixed(0), body.add(Est { min: 1, max: 2 }), fixed(2)),
            CompKind::Map | CompKind::TransformList => (
                fixed(LIST_CREATE),
                fixed(0),
                guarded(body.add(fixed(12)), filter),
                fixed(1),
            ),
            CompKind::Filter => (
                fixed(LIST_CREATE),
                fixed(0),
                body.add(Est { min: 1, max: 13 }),
                fixed(1),
            ),
            CompKind::TransformMap => (
                fixed(MAP_CREATE),
                fixed(0),
                guarded(body.add(fixed(3)), filter),
                fixed(1),
            ),
            CompKind::TransformMapEntry => (
                fixed(MAP_CREATE),
                fixed(0),
                guarded(body.add(fixed(2)), filter),
                fixed(1),
            ),
            CompKind::OptMap | CompKind::OptFlatMap | CompKind::SortBy => (fixed(0), fixed(0), fixed(0), fixed(0)),
        };
        match c.kind {
            CompKind::All | CompKind::Exists | CompKind::ExistsOne => info.size = Some(fixed(1)),
            CompKind::Map | CompKind::TransformList => {
                info.size = Some(range_size);
                info.entry = Some(Entry {
                    list: true,
                    key: fixed(1),
                    val: fixed(0).union(body_size),
                });
            }
            CompKind::Filter => {
                info.size = Some(range_size);
                info.entry = Some(Entry {
                    list: true,
                    key: fixed(1),
                    val: fixed(0).union(var_size.unwrap_or(UNKNOWN)),
                });
            }
            _ => info.size = Some(range_size),
        }
        cr.add(init).add(result).add(range_size.mul(step.add(cond)))
    }

    /// `cel.bind(@in, target, @in.@sortByAssociatedKeys(@in.map(x, key)))`.
    fn sort_by(&mut self, c: &TComp, cr: Est, ri: &Info, info: &mut Info) -> Est {
        let input_size = self.size(ri, local_slot(&c.range));
        let input_entry = ri.entry;
        self.push(usize::MAX, ri.path.clone(), input_size, input_entry);
        let r = input_size.unwrap_or(UNKNOWN);
        let path = ri.path.clone().map(|mut p| {
            p.push("@items".into());
            p
        });
        self.push(c.slot1, path, input_entry.map(|e| e.val), None);
        let (body, _) = self.cost(&c.body);
        self.locals.truncate(self.locals.len() - 2);
        let map = fixed(1)
            .add(fixed(LIST_CREATE))
            .add(fixed(1))
            .add(r.mul(body.add(fixed(12))));
        let per = match c.aux {
            Type::String | Type::Bytes | Type::Dyn | Type::Any => 2.0 + STRING_TRAVERSAL,
            _ => 2.0,
        };
        let sort = r.mul(r).times(per).add(fixed(1)).add(fixed(LIST_CREATE));
        info.size = Some(r);
        fixed(LIST_CREATE).add(cr).add(fixed(1)).add(sort).add(map)
    }

    fn call(
        &mut self,
        function: &str,
        member: bool,
        overloads: &[&'static str],
        args: &[TNode],
        info: &mut Info,
    ) -> Est {
        if function == "dyn" {
            let (c, a) = self.cost(&args[0]);
            info.size = self.size(&a, local_slot(&args[0]));
            info.entry = a.entry;
            info.path = a.path;
            return c.add(fixed(1));
        }
        let mut costs = Vec::with_capacity(args.len());
        let mut infos = Vec::with_capacity(args.len());
        for a in args {
            let (c, mut i) = self.cost(a);
            if i.size.is_none() {
                i.size = self.size(&i, local_slot(a));
            }
            costs.push(c);
            infos.push(i);
        }
        let (target_cost, target, arg_costs, arg_infos) = if member {
            (costs[0], Some(&infos[0]), &costs[1..], &infos[1..])
        } else {
            (fixed(0), None, &costs[..], &infos[..])
        };
        let arg_sum = arg_costs.iter().fold(fixed(0), |s, c| s.add(*c));
        let mut total: Option<Est> = None;
        let mut result_size: Option<Est> = None;
        for &id in overloads {
            let (c, size) = self.function_cost(function, id, target, arg_infos, arg_costs, arg_sum, info);
            total = Some(total.map_or(c, |t| t.union(c)));
            if let Some(s) = size {
                result_size = Some(result_size.map_or(s, |r| r.union(s)));
            }
        }
        if result_size.is_some() {
            info.size = result_size;
        }
        target_cost.add(total.unwrap_or(fixed(0)))
    }

    #[allow(clippy::too_many_arguments)]
    fn function_cost(
        &mut self,
        function: &str,
        id: &str,
        target: Option<&Info>,
        args: &[Info],
        arg_costs: &[Est],
        arg_sum: Est,
        info: &mut Info,
    ) -> (Est, Option<Est>) {
        let size = |i: &Info| i.size.unwrap_or(UNKNOWN);
        let call = |c: Est, s: Option<Est>| (c.add(arg_sum), s);
        // cel-go list and set extensions' estimators.
        match id {
            "list_slice" => {
                if let Some(t) = target
                    && args.len() == 2
                {
                    let sz = size(t);
                    let start = as_uint(&args[0], 0);
                    let end = as_uint(&args[1], sz.max);
                    return call(
                        alloc_list(1.0, fixed(end.wrapping_sub(start))),
                        Some(fixed(end.wrapping_sub(start))),
                    );
                }
            }
            "lists_range" => {
                let n = args.first().map_or(u64::MAX, |a| as_uint(a, u64::MAX));
                return call(alloc_list(1.0, fixed(n)), Some(fixed(n)));
            }
            "list_reverse" => {
                if let Some(t) = target {
                    return call(alloc_list(1.0, size(t)), Some(size(t)));
                }
            }
            "list_flatten" | "list_flatten_int" => {
                if let Some(t) = target {
                    let depth = if id == "list_flatten" {
                        1
                    } else {
                        args.first().map_or(u64::MAX, |a| as_uint(a, u64::MAX))
                    };
                    return call(alloc_list(depth as f64, size(t)), Some(size(t)));
                }
            }
            "list_distinct" => {
                if let Some(t) = target {
                    let s = size(t).mul(size(t));
                    return call(alloc_list(2.0, s), Some(s));
                }
            }
            "list_sort" => {
                if let Some(t) = target {
                    let s = size(t).mul(size(t));
                    let per = match &t.ty {
                        Type::List(e) if matches!(**e, Type::String | Type::Bytes | Type::Dyn | Type::Any) => {
                            2.0 + STRING_TRAVERSAL
                        }
                        _ => 2.0,
                    };
                    return call(alloc_list(per, s), Some(s));
                }
            }
            "list_sets_contains_list" | "list_sets_intersects_list" | "list_sets_equivalent_list" => {
                let f = if id == "list_sets_equivalent_list" { 2.0 } else { 1.0 };
                let c = size(&args[0]).mul(size(&args[1])).times(f).add(fixed(1));
                return call(c, None);
            }
            _ => {}
        }
        if let Some((c, s)) = kubernetes_cost(function, id, target, args) {
            return call(c, s);
        }
        match id {
            "string_format" => {
                if let Some(t) = target {
                    return call(size(t).times(STRING_TRAVERSAL), None);
                }
            }
            "string_to_bytes" => {
                let s = size(&args[0]);
                return call(
                    s.times(STRING_TRAVERSAL),
                    Some(Est {
                        min: s.min,
                        max: s.max.saturating_mul(4),
                    }),
                );
            }
            "bytes_to_string" => {
                let s = size(&args[0]);
                return call(
                    s.times(STRING_TRAVERSAL),
                    Some(Est {
                        min: s.min / 4,
                        max: s.max,
                    }),
                );
            }
            "strings_quote" => {
                let s = size(&args[0]);
                return call(
                    s.times(STRING_TRAVERSAL),
                    Some(Est {
                        min: s.min.saturating_add(2),
                        max: s.max.saturating_mul(2).saturating_add(2),
                    }),
                );
            }
            "starts_with_string" | "ends_with_string" => return call(size(&args[0]).times(STRING_TRAVERSAL), None),
            "in_list" => return call(size(&args[1]), None),
            "matches" | "matches_string" => {
                let (s, re) = if let Some(t) = target {
                    (t, &args[0])
                } else {
                    (&args[0], &args[1])
                };
                let str_cost = size(s).add(fixed(1)).times(STRING_TRAVERSAL);
                let re_cost = size(re).times(REGEX_LENGTH);
                return call(str_cost.mul(re_cost), None);
            }
            "contains_string" => {
                if let Some(t) = target {
                    let c = size(t)
                        .times(STRING_TRAVERSAL)
                        .mul(size(&args[0]).times(STRING_TRAVERSAL));
                    return call(c, None);
                }
            }
            "logical_and" | "logical_or" => {
                let (l, r) = (arg_costs[0], arg_costs[1]);
                return (
                    Est {
                        min: l.min,
                        max: l.max.saturating_add(r.max),
                    },
                    None,
                );
            }
            "conditional" => {
                let s = size(&args[1]).union(size(&args[2]));
                info.entry = union_entry(args[1].entry, args[2].entry);
                return (arg_costs[0].add(arg_costs[1].union(arg_costs[2])), Some(s));
            }
            "add_string" | "add_bytes" | "add_list" => {
                let s = size(&args[0]).add(size(&args[1]));
                if let Some(e) = union_entry(args[0].entry, args[1].entry) {
                    info.entry = Some(e);
                }
                return if id == "add_list" {
                    call(fixed(1), Some(s))
                } else {
                    call(s.times(STRING_TRAVERSAL), Some(s))
                };
            }
            "less_string"
            | "greater_string"
            | "less_equals_string"
            | "greater_equals_string"
            | "less_bytes"
            | "greater_bytes"
            | "less_equals_bytes"
            | "greater_equals_bytes"
            | "equals"
            | "not_equals" => {
                let smallest = size(&args[0]).max.min(size(&args[1]).max);
                let c = Est {
                    min: u64::from(smallest > 0),
                    max: smallest,
                };
                return call(c.times(STRING_TRAVERSAL), None);
            }
            "index_list" | "index_map" => {
                // Result size and path are set by the caller (see `Index`).
                return call(fixed(1), None);
            }
            _ => {}
        }
        call(fixed(1), None)
    }
}

fn local_slot(node: &TNode) -> Option<usize> {
    match node.kind {
        TKind::Local { slot } => Some(slot),
        _ => None,
    }
}

/// cel-go's `nodeAsUintValue`: an int literal, negative ones as zero.
fn as_uint(info: &Info, default: u64) -> u64 {
    info.int.map_or(default, |v| v.max(0) as u64)
}

fn alloc_list(per: f64, size: Est) -> Est {
    size.times(per).add(fixed(1)).add(fixed(LIST_CREATE))
}

/// The size of a list's elements as the Kubernetes estimator sees it: only from the
/// size estimator's paths (not from literals).
fn items_size(list: &Info) -> Est {
    list.path
        .as_ref()
        .and_then(|p| {
            let mut p = p.clone();
            p.push("@items".into());
            device_size(&p)
        })
        .unwrap_or(UNKNOWN)
}

/// The Kubernetes library's estimator (`library.CostEstimator.EstimateCallCost`),
/// keyed on function names.
fn kubernetes_cost(function: &str, id: &str, target: Option<&Info>, args: &[Info]) -> Option<(Est, Option<Est>)> {
    let size = |i: &Info| i.size.unwrap_or(UNKNOWN);
    let one = Some((fixed(1), None));
    match function {
        "isSorted" | "sum" | "max" | "min" | "indexOf" | "lastIndexOf" => {
            let t = target?;
            if let Type::List(elem) = &t.ty {
                let mut el = fixed(1);
                if matches!(**elem, Type::String | Type::Bytes) {
                    el = el.add(items_size(t).times(STRING_TRAVERSAL));
                }
                return Some((size(t).mul(el), None));
            }
            Some((size(t).times(STRING_TRAVERSAL), None))
        }
        "url" => {
            let s = size(args.first()?);
            Some((s.times(STRING_TRAVERSAL), Some(s)))
        }
        "lowerAscii" | "upperAscii" | "substring" | "trim" => {
            let s = size(target?);
            Some((s.times(STRING_TRAVERSAL), Some(s)))
        }
        "replace" => {
            let t = target?;
            if args.len() < 2 {
                return None;
            }
            let sz = size(t);
            let old = size(&args[0]);
            let new = size(&args[1]);
            let mut count = Est { min: 0, max: 0 };
            let mut retained = Est { min: 0, max: 0 };
            if old.min == 0 {
                count.max = if sz.max < u64::MAX { sz.max + 1 } else { sz.max };
                retained.max = sz.max;
            } else if new.max <= old.min {
                retained.max = sz.max;
            } else {
                count.max = (sz.max as f64 / old.min as f64).ceil() as u64;
            }
            if old.max == 0 {
                count.min = if sz.min < u64::MAX { sz.min + 1 } else { sz.min };
                retained.min = sz.min;
            } else if old.max <= new.min {
                retained.min = sz.min;
            } else {
                count.min = (sz.min as f64 / old.max as f64).ceil() as u64;
            }
            let result = count.mul(new).add(retained);
            Some((sz.times(2.0 * STRING_TRAVERSAL), Some(result)))
        }
        "split" => {
            let t = target?;
            let sz = size(t);
            let max = args.get(1).and_then(|a| a.int).map_or(sz.max, |v| v as u64);
            Some((sz.times(2.0 * STRING_TRAVERSAL), Some(Est { min: 0, max })))
        }
        "join" => {
            let t = target?;
            let list = size(t);
            let elem = items_size(t);
            let mut sz = list.mul(elem);
            if let Some(sep) = args.first() {
                let seps = Est {
                    min: list.min.saturating_sub(1),
                    max: list.max.saturating_sub(1),
                };
                sz = sz.add(size(sep).mul(seps));
            }
            Some((sz.times(STRING_TRAVERSAL), Some(sz)))
        }
        "find" | "findAll" => {
            let t = target?;
            let sz = size(t);
            let str_cost = sz.add(fixed(1)).times(STRING_TRAVERSAL);
            let re_cost = size(args.first()?).times(REGEX_LENGTH);
            Some((str_cost.mul(re_cost), Some(Est { min: 0, max: sz.max })))
        }
        "cidr" | "isIP" | "isCIDR" | "quantity" | "isQuantity" | "semver" | "isSemver" => {
            Some((size(args.first()?).times(STRING_TRAVERSAL), None))
        }
        "ip" => {
            if id == "cidr_ip" {
                return one;
            }
            Some((size(args.first()?).times(STRING_TRAVERSAL), None))
        }
        "ip.isCanonical" => Some((size(args.first()?).times(2.0 * STRING_TRAVERSAL), None)),
        "masked"
        | "prefixLength"
        | "family"
        | "isUnspecified"
        | "isLoopback"
        | "isLinkLocalMulticast"
        | "isLinkLocalUnicast"
        | "isGlobalUnicast"
        | "format.named"
        | "sign"
        | "asInteger"
        | "isInteger"
        | "asApproximateFloat"
        | "isGreaterThan"
        | "isLessThan"
        | "compareTo"
        | "add"
        | "sub"
        | "major"
        | "minor"
        | "patch"
        | "getScheme"
        | "getHostname"
        | "getHost"
        | "getPort"
        | "getEscapedPath"
        | "getQuery" => one,
        "containsIP" | "containsCIDR" => {
            let first = args.first()?;
            let sz = Est { min: 4, max: 16 };
            let mut c = sz.add(sz).times(STRING_TRAVERSAL);
            if function == "containsCIDR" {
                c = c.add(sz.times(STRING_TRAVERSAL)).add(fixed(1));
            }
            if id.ends_with("_string") {
                c = c.add(size(first).times(STRING_TRAVERSAL));
            }
            Some((c, None))
        }
        "validate" => {
            let s = size(args.first()?);
            Some((s.times(STRING_TRAVERSAL).times(128.0 * REGEX_LENGTH), None))
        }
        "_==_" => {
            let (l, r) = (args.first()?, args.get(1)?);
            if l.ty != r.ty {
                return None;
            }
            match &l.ty {
                Type::Opaque(types::IP | types::CIDR, _) => one,
                Type::Struct(types::QUANTITY | types::SEMVER) => one,
                Type::Struct(types::FORMAT) => Some((Est { min: 1, max: 64 }.times(STRING_TRAVERSAL), None)),
                Type::Struct(types::URL) => {
                    let s = r.size.unwrap_or(fixed(1));
                    Some((Est { min: 1, max: s.max }.times(STRING_TRAVERSAL), None))
                }
                _ => None,
            }
        }
        _ => None,
    }
}
