//! The type checker, as the API server runs it when it validates a selector: names,
//! functions and overloads resolve against the declared environment, aggregate
//! literals must be homogeneous, regular expression literals must compile, the result
//! must be a `bool` (or the declared attribute type), and the estimated cost must stay
//! within the limit ([`crate::cost`]).
//!
//! Checking produces a typed tree ([`TNode`]) that the cost estimator reads, then lowers
//! it to the evaluator's tree ([`Node`]).

use std::sync::Arc;

use crate::ast::{Comp, Const, DeviceField, Node};
use crate::decls::{self, Overload};
use crate::functions;
use crate::names::{self, Func, Resolution};
use crate::parser::{BinOp, CompKind, Expr, ExprKind, ParseError};
use crate::typed::{TComp, TKind, TNode};
use crate::types::{self, Mapping, Type};
use crate::value::TypeName;

pub(crate) struct Checked {
    pub root: Node,
    pub slots: usize,
}

fn err<T>(pos: usize, message: impl Into<String>) -> Result<T, ParseError> {
    Err(ParseError {
        pos,
        message: message.into(),
    })
}

/// Type identifiers of the environment.
fn type_ident(name: &str) -> Option<(TypeName, Type)> {
    Some(match name {
        "bool" => (TypeName::Bool, Type::Bool),
        "bytes" => (TypeName::Bytes, Type::Bytes),
        "double" => (TypeName::Double, Type::Double),
        "int" => (TypeName::Int, Type::Int),
        "uint" => (TypeName::Uint, Type::Uint),
        "string" => (TypeName::String, Type::String),
        "null_type" => (TypeName::Null, Type::Null),
        "type" => (TypeName::Type, Type::Kind(None)),
        "list" => (TypeName::List, types::parse("list(A)")),
        "map" => (TypeName::Map, types::parse("map(A, B)")),
        "optional_type" => (TypeName::Optional, types::parse("optional(A)")),
        "google.protobuf.Timestamp" => (TypeName::Timestamp, Type::Timestamp),
        "google.protobuf.Duration" => (TypeName::Duration, Type::Duration),
        "kubernetes.Quantity" => (TypeName::Quantity, Type::Struct(types::QUANTITY)),
        "kubernetes.Semver" => (TypeName::Semver, Type::Struct(types::SEMVER)),
        "net.IP" => (TypeName::Ip, Type::Opaque(types::IP, Vec::new())),
        "net.CIDR" => (TypeName::Cidr, Type::Opaque(types::CIDR, Vec::new())),
        _ => return None,
    })
}

/// The fields of the `device` variable (with DRAConsumableCapacity, on by default).
fn device_field(name: &str) -> Option<Type> {
    Some(match name {
        "driver" => Type::String,
        "allowMultipleAllocations" => Type::Bool,
        "attributes" => Type::map(Type::String, Type::map(Type::String, Type::Any)),
        "capacity" => Type::map(Type::String, Type::map(Type::String, Type::Struct(types::QUANTITY))),
        _ => return None,
    })
}

/// `a.b.c` as a qualified name, when it is a chain of selections on an identifier.
fn qualified_name(expr: &Expr) -> Option<String> {
    match &expr.kind {
        ExprKind::Ident(name) => Some(name.clone()),
        ExprKind::Select {
            operand,
            field,
            optional: false,
        } => Some(format!("{}.{field}", qualified_name(operand)?)),
        _ => None,
    }
}

struct Checker {
    /// Variables in scope, innermost last: (name, slot, type).
    scopes: Vec<(String, usize, Type)>,
    slots: usize,
    mapping: Mapping,
    fresh: usize,
}

/// Whether the worst-case cost is estimated and held to the limit: the API server does
/// when it validates a new selector; kube-scheduler does not when it compiles a stored
/// one (the runtime limit still bounds every evaluation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CostCheck {
    Estimate,
    Skip,
}

pub(crate) fn check(expr: Expr, cost_check: CostCheck) -> Result<Checked, ParseError> {
    let mut checker = Checker {
        scopes: Vec::new(),
        slots: 0,
        mapping: Mapping::default(),
        fresh: 0,
    };
    let mut root = checker.node(expr)?;
    checker.finish(&mut root);
    validate_literals(&root)?;
    validate_format_calls(&root)?;
    if !matches!(root.ty, Type::Bool | Type::Any) {
        return err(
            root.pos,
            format!("must evaluate to bool or the unknown type, not {}", root.ty),
        );
    }
    let cost = match cost_check {
        CostCheck::Estimate => crate::cost::estimate(&root),
        CostCheck::Skip => 0,
    };
    if cost > crate::COST_LIMIT {
        return err(
            0,
            format!(
                "too complex, exceeds cost limit (estimated cost {cost}, limit {})",
                crate::COST_LIMIT
            ),
        );
    }
    let slots = checker.slots;
    Ok(Checked {
        root: lower(root)?,
        slots,
    })
}

impl Checker {
    fn fresh_var(&mut self) -> Type {
        self.fresh += 1;
        Type::Param(format!("_var{}", self.fresh))
    }

    fn lookup(&self, name: &str) -> Option<(usize, Type)> {
        self.scopes
            .iter()
            .rev()
            .find(|(n, ..)| n == name)
            .map(|(_, slot, t)| (*slot, t.clone()))
    }

    fn bind(&mut self, name: String, ty: Type) -> usize {
        let slot = self.slots;
        self.slots += 1;
        self.scopes.push((name, slot, ty));
        slot
    }

    fn sub(&self, t: &Type) -> Type {
        self.mapping.substitute(t, false)
    }

    /// Replaces every type by its final form (unbound parameters become `dyn`).
    fn finish(&self, node: &mut TNode) {
        node.ty = self.mapping.substitute(&node.ty, true);
        match &mut node.kind {
            TKind::Select { operand, .. } | TKind::Has { operand, .. } => self.finish(operand),
            TKind::Index { operand, index, .. } => {
                self.finish(operand);
                self.finish(index);
            }
            TKind::Call { args, .. } => args.iter_mut().for_each(|a| self.finish(a)),
            TKind::List(items) => items.iter_mut().for_each(|(i, _)| self.finish(i)),
            TKind::Map(entries) => entries.iter_mut().for_each(|(k, v, _)| {
                self.finish(k);
                self.finish(v);
            }),
            TKind::Comprehension(c) => {
                self.finish(&mut c.range);
                if let Some(f) = &mut c.filter {
                    self.finish(f);
                }
                self.finish(&mut c.body);
                c.aux = self.mapping.substitute(&c.aux, true);
            }
            TKind::Bind { init, body, .. } => {
                self.finish(init);
                self.finish(body);
            }
            TKind::Const(_) | TKind::Local { .. } | TKind::Device | TKind::TypeIdent(_) => {}
        }
    }

    fn boxed(&mut self, expr: Expr) -> Result<Box<TNode>, ParseError> {
        Ok(Box::new(self.node(expr)?))
    }

    fn node(&mut self, expr: Expr) -> Result<TNode, ParseError> {
        let pos = expr.pos;
        let leaf = |c: Const, ty: Type| TNode {
            pos,
            ty,
            kind: TKind::Const(c),
        };
        Ok(match expr.kind {
            ExprKind::Null => leaf(Const::Null, Type::Null),
            ExprKind::Bool(b) => leaf(Const::Bool(b), Type::Bool),
            ExprKind::Int(i) => leaf(Const::Int(i), Type::Int),
            ExprKind::Uint(u) => leaf(Const::Uint(u), Type::Uint),
            ExprKind::Double(d) => leaf(Const::Double(d), Type::Double),
            ExprKind::String(s) => leaf(Const::String(s), Type::String),
            ExprKind::Bytes(b) => leaf(Const::Bytes(b), Type::Bytes),
            ExprKind::Ident(name) => self.ident(pos, &name)?,
            ExprKind::Select {
                operand,
                field,
                optional,
            } => {
                // A qualified type name such as `google.protobuf.Duration`.
                if !optional
                    && let Some(name) = qualified_name(&operand).map(|q| format!("{q}.{field}"))
                    && let Some((tn, t)) = type_ident(&name)
                    && self.lookup(name.split('.').next().unwrap_or("")).is_none()
                {
                    return Ok(TNode {
                        pos,
                        ty: Type::type_of(t),
                        kind: TKind::TypeIdent(tn),
                    });
                }
                let operand = self.boxed(*operand)?;
                let ty = self.select_type(pos, &operand.ty, &field, optional)?;
                TNode {
                    pos,
                    ty,
                    kind: TKind::Select {
                        operand,
                        field,
                        optional,
                    },
                }
            }
            ExprKind::Has { operand, field } => {
                let operand = self.boxed(*operand)?;
                self.select_type(pos, &operand.ty, &field, false)?;
                TNode {
                    pos,
                    ty: Type::Bool,
                    kind: TKind::Has { operand, field },
                }
            }
            ExprKind::Index {
                operand,
                index,
                optional,
            } => {
                let operand = self.boxed(*operand)?;
                let index = self.boxed(*index)?;
                let function = if optional { "_[?_]" } else { "_[_]" };
                let (ty, _) = self.resolve(pos, function, false, &[&operand.ty, &index.ty])?;
                TNode {
                    pos,
                    ty,
                    kind: TKind::Index {
                        operand,
                        index,
                        optional,
                    },
                }
            }
            ExprKind::Call { target, name, args } => self.call(pos, target, name, args)?,
            ExprKind::Not(e) => self.operator(pos, "!_", vec![*e])?,
            ExprKind::Neg(e) => self.operator(pos, "-_", vec![*e])?,
            ExprKind::Binary(op, l, r) => self.operator(pos, op.symbol(), vec![*l, *r])?,
            ExprKind::And(l, r) => self.logical(pos, "_&&_", *l, *r)?,
            ExprKind::Or(l, r) => self.logical(pos, "_||_", *l, *r)?,
            ExprKind::Cond(c, t, f) => self.operator(pos, "_?_:_", vec![*c, *t, *f])?,
            ExprKind::List(items) => {
                let mut out = Vec::with_capacity(items.len());
                let mut elem: Option<Type> = None;
                for (item, optional) in items {
                    let item = self.node(item)?;
                    let mut t = self.sub(&item.ty);
                    if optional {
                        match t.optional_inner() {
                            Some(inner) => t = inner.clone(),
                            None if t.is_dyn() => {}
                            None => {
                                return err(item.pos, format!("expected type 'optional_type({t})' but found '{t}'"));
                            }
                        }
                    }
                    elem = Some(self.join(elem, t));
                    out.push((item, optional));
                }
                let elem = match elem {
                    Some(e) => e,
                    None => self.fresh_var(),
                };
                TNode {
                    pos,
                    ty: Type::list(elem),
                    kind: TKind::List(out),
                }
            }
            ExprKind::Map(entries) => {
                let mut out = Vec::with_capacity(entries.len());
                let (mut kt, mut vt): (Option<Type>, Option<Type>) = (None, None);
                for (key, value, optional) in entries {
                    let key = self.node(key)?;
                    let key_type = self.sub(&key.ty);
                    kt = Some(self.join(kt, key_type));
                    let value = self.node(value)?;
                    let mut t = self.sub(&value.ty);
                    if optional {
                        match t.optional_inner() {
                            Some(inner) => t = inner.clone(),
                            None if t.is_dyn() => {}
                            None => {
                                return err(value.pos, format!("expected type 'optional_type({t})' but found '{t}'"));
                            }
                        }
                    }
                    vt = Some(self.join(vt, t));
                    out.push((key, value, optional));
                }
                let (k, v) = match (kt, vt) {
                    (Some(k), Some(v)) => (k, v),
                    _ => (self.fresh_var(), self.fresh_var()),
                };
                TNode {
                    pos,
                    ty: Type::map(k, v),
                    kind: TKind::Map(out),
                }
            }
            ExprKind::Comprehension(c) => self.comprehension(pos, *c)?,
            ExprKind::Bind { var, init, body } => {
                let init = self.boxed(*init)?;
                let depth = self.scopes.len();
                let slot = self.bind(var, init.ty.clone());
                let body = self.boxed(*body)?;
                self.scopes.truncate(depth);
                TNode {
                    pos,
                    ty: body.ty.clone(),
                    kind: TKind::Bind { slot, init, body },
                }
            }
        })
    }

    fn ident(&mut self, pos: usize, name: &str) -> Result<TNode, ParseError> {
        if let Some((slot, ty)) = self.lookup(name) {
            return Ok(TNode {
                pos,
                ty,
                kind: TKind::Local { slot },
            });
        }
        if name == "device" {
            return Ok(TNode {
                pos,
                ty: Type::Struct(types::DEVICE),
                kind: TKind::Device,
            });
        }
        if let Some((tn, t)) = type_ident(name) {
            return Ok(TNode {
                pos,
                ty: Type::type_of(t),
                kind: TKind::TypeIdent(tn),
            });
        }
        err(pos, format!("undeclared reference to '{name}' (in container '')"))
    }

    /// The type of `operand.field` (cel-go's `checkSelectField`).
    fn select_type(&mut self, pos: usize, operand: &Type, field: &str, optional: bool) -> Result<Type, ParseError> {
        let operand = self.sub(operand);
        let (target, was_optional) = match operand.optional_inner() {
            Some(inner) => (inner.clone(), true),
            None => (operand.clone(), false),
        };
        let result = match &target {
            Type::Map(_, v) => (**v).clone(),
            Type::Struct(types::DEVICE) => match device_field(field) {
                Some(t) => t,
                None => return err(pos, format!("undefined field '{field}'")),
            },
            Type::Struct(_) => return err(pos, format!("undefined field '{field}'")),
            Type::Param(_) => {
                self.mapping.assignable(&Type::Dyn, &target);
                Type::Dyn
            }
            t if t.is_dyn_or_error() => Type::Dyn,
            t => return err(pos, format!("type '{t}' does not support field selection")),
        };
        Ok(if was_optional || optional {
            Type::optional(result)
        } else {
            result
        })
    }

    /// Joins the element types of a literal (cel-go's `joinTypes`).
    fn join(&mut self, previous: Option<Type>, current: Type) -> Type {
        let Some(previous) = previous else {
            return current;
        };
        if self.mapping.assignable(&previous, &current) {
            return types::most_general(&previous, &current);
        }
        // Mixed literals type-check as dyn; the literal validator refuses them unless
        // they are arguments of `format`.
        Type::Dyn
    }

    /// Resolves a call against the declared overloads (cel-go's `resolveOverload`).
    fn resolve(
        &mut self,
        pos: usize,
        function: &str,
        member: bool,
        args: &[&Type],
    ) -> Result<(Type, Vec<&'static str>), ParseError> {
        let Some(overloads) = decls::lookup(function) else {
            return err(pos, format!("undeclared reference to '{function}' (in container '')"));
        };
        self.resolve_in(pos, function, member, args, overloads)
    }

    fn resolve_in(
        &mut self,
        pos: usize,
        function: &str,
        member: bool,
        args: &[&Type],
        overloads: &'static [Overload],
    ) -> Result<(Type, Vec<&'static str>), ParseError> {
        let arg_types: Vec<Type> = args.iter().map(|t| (*t).clone()).collect();
        let mut result: Option<Type> = None;
        let mut ids = Vec::new();
        for overload in overloads {
            if overload.member != member {
                continue;
            }
            // Fresh type variables per overload.
            let mut params = Vec::new();
            collect_params(&overload.result, &mut params);
            for p in &overload.params {
                collect_params(p, &mut params);
            }
            let mut renames = Vec::new();
            for p in params {
                let v = self.fresh_var();
                renames.push((p, v));
            }
            let rename = |t: &Type| rename_params(t, &renames);
            let candidate: Vec<Type> = overload.params.iter().map(rename).collect();
            if self.mapping.assignable_list(&arg_types, &candidate) {
                ids.push(overload.id);
                let t = self.sub(&rename(&overload.result));
                result = Some(match result {
                    None => t,
                    Some(r) if r.is_dyn() || r == t => r,
                    Some(_) => Type::Dyn,
                });
            }
        }
        match result {
            Some(t) => Ok((t, ids)),
            None => {
                let shown: Vec<String> = arg_types
                    .iter()
                    .map(|t| self.mapping.substitute(t, true).to_string())
                    .collect();
                let applied = if member && !shown.is_empty() {
                    format!("{}.({})", shown[0], shown[1..].join(", "))
                } else {
                    format!("({})", shown.join(", "))
                };
                err(
                    pos,
                    format!("found no matching overload for '{function}' applied to '{applied}'"),
                )
            }
        }
    }

    fn operator(&mut self, pos: usize, function: &str, args: Vec<Expr>) -> Result<TNode, ParseError> {
        let mut nodes = Vec::with_capacity(args.len());
        for a in args {
            nodes.push(self.node(a)?);
        }
        let types: Vec<Type> = nodes.iter().map(|n| n.ty.clone()).collect();
        let refs: Vec<&Type> = types.iter().collect();
        let (ty, overloads) = self.resolve(pos, function, false, &refs)?;
        Ok(TNode {
            pos,
            ty,
            kind: TKind::Call {
                function: function.to_string(),
                member: false,
                overloads,
                args: nodes,
            },
        })
    }

    fn logical(&mut self, pos: usize, function: &str, l: Expr, r: Expr) -> Result<TNode, ParseError> {
        let l = self.node(l)?;
        let r = self.node(r)?;
        for side in [&l, &r] {
            if !self.mapping.assignable(&side.ty, &Type::Bool) {
                return err(
                    side.pos,
                    format!(
                        "expected type 'bool' but found '{}'",
                        self.mapping.substitute(&side.ty, true)
                    ),
                );
            }
        }
        Ok(TNode {
            pos,
            ty: Type::Bool,
            kind: TKind::Call {
                function: function.to_string(),
                member: false,
                overloads: vec![if function == "_&&_" {
                    "logical_and"
                } else {
                    "logical_or"
                }],
                args: vec![l, r],
            },
        })
    }

    fn call(
        &mut self,
        pos: usize,
        target: Option<Box<Expr>>,
        name: String,
        args: Vec<Expr>,
    ) -> Result<TNode, ParseError> {
        // `optional.of(x)`, `lists.range(n)`, `format.dns1123Label()` ...: a namespaced
        // global function.
        if let Some(t) = &target
            && let Some(prefix) = qualified_name(t)
        {
            let qualified = format!("{prefix}.{name}");
            if decls::lookup(&qualified).is_some() {
                return self.finish_call(pos, qualified, None, args);
            }
        }
        let receiver = match target {
            Some(t) => Some(self.node(*t)?),
            None => None,
        };
        self.finish_call(pos, name, receiver, args)
    }

    fn finish_call(
        &mut self,
        pos: usize,
        function: String,
        receiver: Option<TNode>,
        args: Vec<Expr>,
    ) -> Result<TNode, ParseError> {
        let member = receiver.is_some();
        let mut nodes = Vec::with_capacity(args.len() + 1);
        if let Some(r) = receiver {
            nodes.push(r);
        }
        for a in args {
            nodes.push(self.node(a)?);
        }
        let types: Vec<Type> = nodes.iter().map(|n| n.ty.clone()).collect();
        let refs: Vec<&Type> = types.iter().collect();
        let (ty, overloads) = self.resolve(pos, &function, member, &refs)?;
        Ok(TNode {
            pos,
            ty,
            kind: TKind::Call {
                function,
                member,
                overloads,
                args: nodes,
            },
        })
    }

    fn expect_bool(&mut self, node: &TNode) -> Result<(), ParseError> {
        if self.mapping.assignable(&node.ty, &Type::Bool) {
            return Ok(());
        }
        err(
            node.pos,
            format!(
                "expected type 'bool' but found '{}'",
                self.mapping.substitute(&node.ty, true)
            ),
        )
    }

    fn comprehension(&mut self, pos: usize, c: crate::parser::Comprehension) -> Result<TNode, ParseError> {
        if c.kind == CompKind::SortBy
            && !matches!(
                c.range.kind,
                ExprKind::List(_)
                    | ExprKind::Select { .. }
                    | ExprKind::Ident(_)
                    | ExprKind::Comprehension(_)
                    | ExprKind::Call { .. }
                    | ExprKind::Bind { .. }
            )
        {
            return err(
                pos,
                "sortBy can only be applied to a list, identifier, comprehension, call or select expression",
            );
        }
        let range = self.node(c.range)?;
        let range_type = self.sub(&range.ty);
        let depth = self.scopes.len();
        if matches!(c.kind, CompKind::OptMap | CompKind::OptFlatMap) {
            // `target.hasValue() ? optional.of(cel.bind(x, target.value(), body)) : ...`
            let (value, _) = self.resolve(pos, "value", true, &[&range_type])?;
            let slot1 = self.bind(c.var1, value);
            let body = self.node(c.body)?;
            self.scopes.truncate(depth);
            let ty = if c.kind == CompKind::OptMap {
                Type::optional(body.ty.clone())
            } else {
                let none = types::parse("optional(V)");
                let none = rename_params(&none, &[("V".to_string(), self.fresh_var())]);
                let (t, _) = self.resolve_cond(pos, &body.ty, &none)?;
                t
            };
            return Ok(TNode {
                pos,
                ty,
                kind: TKind::Comprehension(Box::new(TComp {
                    kind: c.kind,
                    range,
                    slot1,
                    slot2: None,
                    filter: None,
                    body,
                    aux: Type::Dyn,
                })),
            });
        }
        let two = c.var2.is_some();
        let (t1, t2) = match &range_type {
            Type::List(elem) if two => (Type::Int, Some((**elem).clone())),
            Type::List(elem) => ((**elem).clone(), None),
            Type::Map(k, v) => ((**k).clone(), two.then(|| (**v).clone())),
            t if t.is_dyn_or_error() || matches!(t, Type::Param(_)) => {
                self.mapping.assignable(&Type::Dyn, t);
                (Type::Dyn, two.then_some(Type::Dyn))
            }
            t => {
                return err(
                    range.pos,
                    format!(
                        "expression of type '{t}' cannot be the range of a comprehension (must be list, map, or dynamic)"
                    ),
                );
            }
        };
        if c.kind == CompKind::SortBy && !matches!(range_type, Type::List(_)) && !range_type.is_dyn() {
            // `@sortByAssociatedKeys` takes a list receiver.
            return err(
                pos,
                format!("found no matching overload for '@sortByAssociatedKeys' applied to '{range_type}'"),
            );
        }
        let slot1 = self.bind(c.var1, t1.clone());
        let slot2 = match (c.var2, t2) {
            (Some(name), Some(t)) => Some(self.bind(name, t)),
            _ => None,
        };
        let filter = match c.filter {
            Some(f) => {
                let f = self.node(f)?;
                self.expect_bool(&f)?;
                Some(f)
            }
            None => None,
        };
        let body = self.node(c.body)?;
        self.scopes.truncate(depth);
        let mut aux = Type::Dyn;
        let ty = match c.kind {
            CompKind::All | CompKind::Exists | CompKind::ExistsOne => {
                self.expect_bool(&body)?;
                Type::Bool
            }
            CompKind::Filter => {
                self.expect_bool(&body)?;
                Type::list(t1)
            }
            CompKind::Map | CompKind::TransformList => Type::list(body.ty.clone()),
            CompKind::TransformMap => {
                let key = if matches!(range_type, Type::List(_)) {
                    Type::Int
                } else {
                    t1
                };
                Type::map(key, body.ty.clone())
            }
            CompKind::TransformMapEntry => {
                let accu = types::parse("map(K, V)");
                let k = self.fresh_var();
                let v = self.fresh_var();
                let accu = rename_params(&accu, &[("K".to_string(), k), ("V".to_string(), v)]);
                let body_type = body.ty.clone();
                let (t, _) = self.resolve(pos, "cel.@mapInsert", false, &[&accu, &body_type])?;
                t
            }
            CompKind::SortBy => {
                let keys = Type::list(body.ty.clone());
                let (t, _) = self.resolve(pos, "@sortByAssociatedKeys", true, &[&range_type, &keys])?;
                aux = body.ty.clone();
                t
            }
            CompKind::OptMap | CompKind::OptFlatMap => Type::Dyn,
        };
        Ok(TNode {
            pos,
            ty,
            kind: TKind::Comprehension(Box::new(TComp {
                kind: c.kind,
                range,
                slot1,
                slot2,
                filter,
                body,
                aux,
            })),
        })
    }

    fn resolve_cond(&mut self, pos: usize, a: &Type, b: &Type) -> Result<(Type, Vec<&'static str>), ParseError> {
        self.resolve(pos, "_?_:_", false, &[&Type::Bool, a, b])
    }
}

fn collect_params(t: &Type, out: &mut Vec<String>) {
    match t {
        Type::Param(name) if !out.contains(name) => out.push(name.clone()),
        Type::List(e) | Type::Kind(Some(e)) => collect_params(e, out),
        Type::Map(k, v) => {
            collect_params(k, out);
            collect_params(v, out);
        }
        Type::Opaque(_, params) => params.iter().for_each(|p| collect_params(p, out)),
        _ => {}
    }
}

fn rename_params(t: &Type, renames: &[(String, Type)]) -> Type {
    match t {
        Type::Param(name) => renames
            .iter()
            .find(|(n, _)| n == name)
            .map_or_else(|| t.clone(), |(_, v)| v.clone()),
        Type::List(e) => Type::list(rename_params(e, renames)),
        Type::Map(k, v) => Type::map(rename_params(k, renames), rename_params(v, renames)),
        Type::Opaque(name, params) => Type::Opaque(name, params.iter().map(|p| rename_params(p, renames)).collect()),
        Type::Kind(Some(p)) => Type::type_of(rename_params(p, renames)),
        other => other.clone(),
    }
}

/// cel-go's literal validator reads the parameter of an optional element's type; on a
/// `dyn` element it fails, and the API server with it.
const DYN_OPTIONAL: &str = "an optional element of type dyn: the API server fails on it";

/// cel-go's homogeneous aggregate literal validator: the elements of a list literal
/// (keys and values of a map literal) must all have the same type, except inside the
/// arguments of `format`.
fn validate_literals(node: &TNode) -> Result<(), ParseError> {
    let mut stack = vec![(node, false)];
    while let Some((n, exempt)) = stack.pop() {
        match &n.kind {
            TKind::List(items) => {
                if !exempt {
                    let mut first: Option<Type> = None;
                    for (item, optional) in items {
                        let t = if *optional {
                            match item.ty.optional_inner() {
                                Some(inner) => inner.clone(),
                                None => return err(item.pos, DYN_OPTIONAL),
                            }
                        } else {
                            item.ty.clone()
                        };
                        match &first {
                            None => first = Some(t),
                            Some(f) if !f.equivalent(&t) => {
                                return err(item.pos, format!("expected type '{f}' but found '{t}'"));
                            }
                            Some(_) => {}
                        }
                    }
                }
                stack.extend(items.iter().map(|(i, _)| (i, exempt)));
            }
            TKind::Map(entries) => {
                if !exempt {
                    let mut first: Option<(Type, Type)> = None;
                    for (k, v, optional) in entries {
                        let vt = if *optional {
                            match v.ty.optional_inner() {
                                Some(inner) => inner.clone(),
                                None => return err(v.pos, DYN_OPTIONAL),
                            }
                        } else {
                            v.ty.clone()
                        };
                        match &first {
                            None => first = Some((k.ty.clone(), vt)),
                            Some((fk, fv)) => {
                                if !fk.equivalent(&k.ty) {
                                    return err(k.pos, format!("expected type '{fk}' but found '{}'", k.ty));
                                }
                                if !fv.equivalent(&vt) {
                                    return err(v.pos, format!("expected type '{fv}' but found '{vt}'"));
                                }
                            }
                        }
                    }
                }
                for (k, v, _) in entries {
                    stack.push((k, exempt));
                    stack.push((v, exempt));
                }
            }
            TKind::Select { operand, .. } | TKind::Has { operand, .. } => stack.push((operand, exempt)),
            TKind::Index { operand, index, .. } => {
                stack.push((operand, exempt));
                stack.push((index, exempt));
            }
            TKind::Call { function, args, .. } => {
                let exempt = exempt || function == "format";
                stack.extend(args.iter().map(|a| (a, exempt)));
            }
            TKind::Comprehension(c) => {
                stack.push((&c.range, exempt));
                if let Some(f) = &c.filter {
                    stack.push((f, exempt));
                }
                stack.push((&c.body, exempt));
            }
            TKind::Bind { init, body, .. } => {
                stack.push((init, exempt));
                stack.push((body, exempt));
            }
            TKind::Const(_) | TKind::Local { .. } | TKind::Device | TKind::TypeIdent(_) => {}
        }
    }
    Ok(())
}

/// cel-go's `string.format` validator (strings library version 1 and later), on every
/// call with a literal format string and a list literal argument. Upstream reports all
/// of them sorted by position; the first is the one that shows.
fn validate_format_calls(node: &TNode) -> Result<(), ParseError> {
    let mut first: Option<(usize, String)> = None;
    let mut stack = vec![node];
    while let Some(n) = stack.pop() {
        match &n.kind {
            TKind::List(items) => stack.extend(items.iter().map(|(i, _)| i)),
            TKind::Map(entries) => {
                for (k, v, _) in entries {
                    stack.push(k);
                    stack.push(v);
                }
            }
            TKind::Select { operand, .. } | TKind::Has { operand, .. } => stack.push(operand),
            TKind::Index { operand, index, .. } => {
                stack.push(operand);
                stack.push(index);
            }
            TKind::Call {
                function,
                member,
                overloads,
                args,
            } => {
                if *member
                    && function == "format"
                    && (overloads.is_empty() || overloads.contains(&"string_format"))
                    && let [target, list] = args.as_slice()
                    && let TKind::Const(Const::String(format)) = &target.kind
                    && let TKind::List(items) = &list.kind
                    && let Err((pos, message)) = crate::string_format::validate(n.pos, format, items)
                    && first.as_ref().is_none_or(|(p, _)| pos < *p)
                {
                    first = Some((pos, message));
                }
                stack.extend(args.iter());
            }
            TKind::Comprehension(c) => {
                stack.push(&c.range);
                if let Some(f) = &c.filter {
                    stack.push(f);
                }
                stack.push(&c.body);
            }
            TKind::Bind { init, body, .. } => {
                stack.push(init);
                stack.push(body);
            }
            TKind::Const(_) | TKind::Local { .. } | TKind::Device | TKind::TypeIdent(_) => {}
        }
    }
    match first {
        Some((pos, message)) => err(pos, message),
        None => Ok(()),
    }
}

fn lower_box(node: TNode) -> Result<Box<Node>, ParseError> {
    Ok(Box::new(lower(node)?))
}

/// The evaluator's tree.
fn lower(node: TNode) -> Result<Node, ParseError> {
    let pos = node.pos;
    Ok(match node.kind {
        TKind::Const(c) => Node::Const(c),
        TKind::Local { slot } => Node::Local(slot),
        TKind::Device => Node::Device,
        TKind::TypeIdent(t) => Node::Const(Const::Type(t)),
        TKind::Select {
            operand,
            field,
            optional,
        } => {
            if matches!(operand.kind, TKind::Device)
                && !optional
                && let Some(f) = DeviceField::from_name(&field)
            {
                return Ok(Node::DeviceField(f));
            }
            Node::Select {
                operand: lower_box(*operand)?,
                field,
                optional,
            }
        }
        TKind::Has { operand, field } => Node::Has {
            operand: lower_box(*operand)?,
            field,
        },
        TKind::Index {
            operand,
            index,
            optional,
        } => {
            let index = lower_box(*index)?;
            // cel-go turns a constant index into a qualifier when it plans the program,
            // and has none for timestamps and durations.
            if is_constant(&index)
                && let Some(t @ (TypeName::Timestamp | TypeName::Duration)) = constant_type(&index)
            {
                let go_type = if t == TypeName::Timestamp {
                    "types.Timestamp"
                } else {
                    "types.Duration"
                };
                return err(
                    pos,
                    format!("program instantiation failed: invalid qualifier type: {go_type}"),
                );
            }
            Node::Index {
                operand: lower_box(*operand)?,
                index,
                optional,
            }
        }
        TKind::Call {
            function, member, args, ..
        } => {
            let op = match function.as_str() {
                "_+_" => Some(BinOp::Add),
                "_-_" => Some(BinOp::Sub),
                "_*_" => Some(BinOp::Mul),
                "_/_" => Some(BinOp::Div),
                "_%_" => Some(BinOp::Rem),
                "_==_" => Some(BinOp::Eq),
                "_!=_" => Some(BinOp::Ne),
                "_<_" => Some(BinOp::Lt),
                "_<=_" => Some(BinOp::Le),
                "_>_" => Some(BinOp::Gt),
                "_>=_" => Some(BinOp::Ge),
                "@in" => Some(BinOp::In),
                _ => None,
            };
            let operator = op.is_some() || matches!(function.as_str(), "!_" | "-_" | "_&&_" | "_||_" | "_?_:_");
            if !operator {
                return lower_call(pos, &function, member, args);
            }
            let mut nodes = Vec::with_capacity(args.len());
            for a in args {
                nodes.push(Box::new(lower(a)?));
            }
            let mut nodes = nodes.into_iter();
            let mut next = || nodes.next().ok_or_else(|| invalid(pos));
            match (op, function.as_str()) {
                (Some(op), _) => Node::Binary(op, next()?, next()?),
                (None, "!_") => Node::Not(next()?),
                (None, "-_") => Node::Neg(next()?),
                (None, "_&&_") => Node::And(next()?, next()?),
                (None, "_||_") => Node::Or(next()?, next()?),
                _ => Node::Cond(next()?, next()?, next()?),
            }
        }
        TKind::List(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (item, optional) in items {
                out.push((lower(item)?, optional));
            }
            Node::List(out)
        }
        TKind::Map(entries) => {
            let mut out = Vec::with_capacity(entries.len());
            for (k, v, optional) in entries {
                out.push((lower(k)?, lower(v)?, optional));
            }
            Node::Map(out)
        }
        TKind::Comprehension(c) => {
            let c = *c;
            Node::Comprehension(Box::new(Comp {
                kind: c.kind,
                range: lower(c.range)?,
                slot1: c.slot1,
                slot2: c.slot2,
                filter: c.filter.map(lower).transpose()?,
                body: lower(c.body)?,
            }))
        }
        TKind::Bind { slot, init, body } => Node::Bind {
            slot,
            init: lower_box(*init)?,
            body: lower_box(*body)?,
        },
    })
}

fn invalid(pos: usize) -> ParseError {
    ParseError {
        pos,
        message: "invalid operator".into(),
    }
}

fn lower_call(pos: usize, function: &str, member: bool, args: Vec<TNode>) -> Result<Node, ParseError> {
    let argc = args.len() - usize::from(member);
    let func = match names::resolve(function, member, argc) {
        Resolution::Found(func) => func,
        _ => return err(pos, format!("function '{function}' is declared but not implemented")),
    };
    let mut nodes = Vec::with_capacity(args.len());
    let mut pattern = None;
    // cel-go's duration and timestamp literal validators check `f(<literal>)`.
    let literal_arg = match (func, args.first()) {
        (Func::Timestamp | Func::Duration, Some(a)) if matches!(a.kind, TKind::Const(_)) => Some(a.pos),
        _ => None,
    };
    for (i, a) in args.into_iter().enumerate() {
        if i == 1
            && matches!(func, Func::Matches | Func::Find | Func::FindAll)
            && let TKind::Const(Const::String(p)) = &a.kind
        {
            pattern = Some(p.clone());
        }
        nodes.push(lower(a)?);
    }
    let mut regex = None;
    if let Some(pattern) = pattern {
        // Literal patterns are compiled once; the API server compiles them too when it
        // builds the program (cel-go's literal validator and regex optimisation), and
        // refuses an invalid one.
        match functions::compile_regex(&pattern) {
            Ok(re) => regex = Some(Arc::new(re)),
            Err(e) => return err(pos, e.message),
        }
    }
    let node = Node::Call {
        func,
        args: nodes,
        regex,
    };
    // The API server builds the program with cel-go's constant folding of type
    // conversions: one that fails on a constant fails the program, and the object.
    if is_constant(&node)
        && let Some(message) = constant_error(&node)
    {
        if let Some(arg_pos) = literal_arg {
            return err(arg_pos, format!("invalid {function} argument"));
        }
        return err(pos, format!("program instantiation failed: {message}"));
    }
    Ok(node)
}

/// Conversions that cel-go evaluates when it plans a program, if their argument is
/// constant.
fn is_conversion(func: Func) -> bool {
    matches!(
        func,
        Func::Int
            | Func::Uint
            | Func::Double
            | Func::String
            | Func::Bool
            | Func::Bytes
            | Func::Dyn
            | Func::Type
            | Func::Timestamp
            | Func::Duration
    )
}

/// Constants after cel-go's folding: literals, literal lists and maps of constants, and
/// conversions of constants.
fn is_constant(node: &Node) -> bool {
    match node {
        Node::Const(_) => true,
        Node::List(items) => items.iter().all(|(i, optional)| !optional && is_constant(i)),
        Node::Map(entries) => entries
            .iter()
            .all(|(k, v, optional)| !optional && is_constant(k) && is_constant(v)),
        Node::Call { func, args, .. } => is_conversion(*func) && args.len() == 1 && is_constant(&args[0]),
        _ => false,
    }
}

/// The type of a constant expression's value, if it has one.
fn constant_type(node: &Node) -> Option<TypeName> {
    with_constant(node, |v| v.ok().map(|v| v.type_name()))
}

/// The error a constant expression evaluates to, if any.
fn constant_error(node: &Node) -> Option<String> {
    with_constant(node, |v| v.err().map(|e| e.message))
}

fn with_constant<R>(node: &Node, f: impl FnOnce(crate::value::Result<crate::value::Value<'_>>) -> R) -> R {
    let attributes = crate::Attributes::new();
    let capacity = crate::name_map::NameMap::<crate::quantity::Quantity>::new();
    let device = crate::DeviceView {
        driver: "",
        attributes: &attributes,
        capacity: &capacity,
        allow_multiple_allocations: false,
    };
    let mut evaluator = crate::eval::Evaluator::new(&device, 0, crate::COST_LIMIT);
    f(evaluator.eval(node))
}
