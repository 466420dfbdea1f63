//! Resolves names and functions of a parsed expression. What cel-go's checker would
//! refuse for lack of a declaration (unknown variables, functions, arities, fields of
//! `device`, invalid regular expression literals, mixed-type literals) fails here;
//! type mismatches that need full type inference are left to evaluation.

use std::sync::Arc;

use crate::ast::{Comp, Const, DeviceField, Node};
use crate::functions::{Func, Resolution, resolve};
use crate::parser::{BinOp, Expr, ExprKind, ParseError};
use crate::value::TypeName;

pub(crate) struct Checked {
    pub root: Node,
    pub slots: usize,
}

pub(crate) fn check(expr: Expr) -> Result<Checked, ParseError> {
    let mut checker = Checker {
        scopes: Vec::new(),
        slots: 0,
    };
    let root = checker.node(expr)?;
    Ok(Checked {
        root,
        slots: checker.slots,
    })
}

struct Checker {
    /// Variables in scope, innermost last.
    scopes: Vec<(String, usize)>,
    slots: usize,
}

fn err<T>(pos: usize, message: impl Into<String>) -> Result<T, ParseError> {
    Err(ParseError {
        pos,
        message: message.into(),
    })
}

/// The static type of an expression where it is evident without full inference, as
/// cel-go would print it; `None` when unknown. Used for the homogeneous-literal rule of
/// the Kubernetes environment, which only fires when both types are known.
fn static_type(node: &Node) -> Option<String> {
    let t = |name: &str| Some(name.to_string());
    match node {
        Node::Const(c) => match c {
            Const::Null => t("null_type"),
            Const::Bool(_) => t("bool"),
            Const::Int(_) => t("int"),
            Const::Uint(_) => t("uint"),
            Const::Double(_) => t("double"),
            Const::String(_) => t("string"),
            Const::Bytes(_) => t("bytes"),
            Const::Type(_) => None,
        },
        Node::DeviceField(DeviceField::Driver) => t("string"),
        Node::DeviceField(DeviceField::AllowMultipleAllocations) => t("bool"),
        Node::Not(_) | Node::And(..) | Node::Or(..) | Node::Has { .. } => t("bool"),
        Node::Binary(BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge | BinOp::In, ..) => {
            t("bool")
        }
        Node::Call { func, .. } => match func {
            Func::Dyn => t("dyn"),
            Func::Int | Func::Size | Func::Sign | Func::CompareTo | Func::Major | Func::Minor | Func::Patch => t("int"),
            Func::Uint => t("uint"),
            Func::Double | Func::AsApproximateFloat => t("double"),
            Func::String => t("string"),
            Func::Bytes => t("bytes"),
            Func::Bool
            | Func::Contains
            | Func::StartsWith
            | Func::EndsWith
            | Func::Matches
            | Func::IsQuantity
            | Func::IsSemver
            | Func::IsInteger
            | Func::IsGreaterThan
            | Func::IsLessThan => t("bool"),
            Func::Quantity => t("kubernetes.Quantity"),
            Func::Semver => t("kubernetes.Semver"),
            _ => None,
        },
        Node::List(items) => {
            let mut elem: Option<String> = None;
            for (item, optional) in items {
                if *optional {
                    return None;
                }
                let it = static_type(item)?;
                match &elem {
                    None => elem = Some(it),
                    Some(e) if *e == it => {}
                    Some(_) => return None,
                }
            }
            elem.map(|e| format!("list({e})"))
        }
        Node::Map(entries) => {
            let mut kv: Option<(String, String)> = None;
            for (k, v, optional) in entries {
                if *optional {
                    return None;
                }
                let pair = (static_type(k)?, static_type(v)?);
                match &kv {
                    None => kv = Some(pair),
                    Some(p) if *p == pair => {}
                    Some(_) => return None,
                }
            }
            kv.map(|(k, v)| format!("map({k}, {v})"))
        }
        _ => None,
    }
}

fn homogeneous<'n>(pos: usize, nodes: impl Iterator<Item = &'n Node>) -> Result<(), ParseError> {
    let mut first: Option<String> = None;
    for node in nodes {
        let Some(t) = static_type(node) else { continue };
        match &first {
            None => first = Some(t),
            Some(f) if *f != t => return err(pos, format!("expected type '{f}' but found '{t}'")),
            Some(_) => {}
        }
    }
    Ok(())
}

impl Checker {
    fn lookup(&self, name: &str) -> Option<usize> {
        self.scopes.iter().rev().find(|(n, _)| n == name).map(|(_, slot)| *slot)
    }

    fn bind(&mut self, name: String) -> usize {
        let slot = self.slots;
        self.slots += 1;
        self.scopes.push((name, slot));
        slot
    }

    fn boxed(&mut self, expr: Expr) -> Result<Box<Node>, ParseError> {
        Ok(Box::new(self.node(expr)?))
    }

    fn node(&mut self, expr: Expr) -> Result<Node, ParseError> {
        let pos = expr.pos;
        Ok(match expr.kind {
            ExprKind::Null => Node::Const(Const::Null),
            ExprKind::Bool(b) => Node::Const(Const::Bool(b)),
            ExprKind::Int(i) => Node::Const(Const::Int(i)),
            ExprKind::Uint(u) => Node::Const(Const::Uint(u)),
            ExprKind::Double(d) => Node::Const(Const::Double(d)),
            ExprKind::String(s) => Node::Const(Const::String(s)),
            ExprKind::Bytes(b) => Node::Const(Const::Bytes(b)),
            ExprKind::Ident(name) => {
                if let Some(slot) = self.lookup(&name) {
                    Node::Local(slot)
                } else if name == "device" {
                    Node::Device
                } else if let Some(t) = TypeName::from_ident(&name) {
                    Node::Const(Const::Type(t))
                } else {
                    return err(pos, format!("undeclared reference to '{name}' (in container '')"));
                }
            }
            ExprKind::Select {
                operand,
                field,
                optional,
            } => {
                let operand = self.node(*operand)?;
                if matches!(operand, Node::Device) && !optional {
                    match DeviceField::from_name(&field) {
                        Some(f) => Node::DeviceField(f),
                        None => return err(pos, format!("undefined field '{field}'")),
                    }
                } else {
                    Node::Select {
                        operand: Box::new(operand),
                        field,
                        optional,
                    }
                }
            }
            ExprKind::Has { operand, field } => {
                let operand = self.node(*operand)?;
                if matches!(operand, Node::Device) && DeviceField::from_name(&field).is_none() {
                    return err(pos, format!("undefined field '{field}'"));
                }
                Node::Has {
                    operand: Box::new(operand),
                    field,
                }
            }
            ExprKind::Index {
                operand,
                index,
                optional,
            } => Node::Index {
                operand: self.boxed(*operand)?,
                index: self.boxed(*index)?,
                optional,
            },
            ExprKind::Call { target, name, args } => self.call(pos, target, name, args)?,
            ExprKind::Not(e) => Node::Not(self.boxed(*e)?),
            ExprKind::Neg(e) => Node::Neg(self.boxed(*e)?),
            ExprKind::Binary(op, l, r) => Node::Binary(op, self.boxed(*l)?, self.boxed(*r)?),
            ExprKind::And(l, r) => Node::And(self.boxed(*l)?, self.boxed(*r)?),
            ExprKind::Or(l, r) => Node::Or(self.boxed(*l)?, self.boxed(*r)?),
            ExprKind::Cond(c, t, f) => Node::Cond(self.boxed(*c)?, self.boxed(*t)?, self.boxed(*f)?),
            ExprKind::List(items) => {
                let mut out = Vec::with_capacity(items.len());
                for (item, optional) in items {
                    out.push((self.node(item)?, optional));
                }
                homogeneous(pos, out.iter().filter(|(_, opt)| !opt).map(|(n, _)| n))?;
                Node::List(out)
            }
            ExprKind::Map(entries) => {
                let mut out = Vec::with_capacity(entries.len());
                for (key, value, optional) in entries {
                    let key = self.node(key)?;
                    if let Some(t) = static_type(&key)
                        && !matches!(t.as_str(), "int" | "uint" | "bool" | "string" | "dyn")
                    {
                        return err(pos, format!("unsupported map key type: {t}"));
                    }
                    out.push((key, self.node(value)?, optional));
                }
                homogeneous(pos, out.iter().map(|(k, _, _)| k))?;
                homogeneous(pos, out.iter().filter(|(_, _, opt)| !opt).map(|(_, v, _)| v))?;
                Node::Map(out)
            }
            ExprKind::Comprehension(c) => {
                let c = *c;
                let range = self.node(c.range)?;
                let depth = self.scopes.len();
                let slot1 = self.bind(c.var1);
                let slot2 = c.var2.map(|v| self.bind(v));
                let filter = match c.filter {
                    Some(f) => Some(self.node(f)?),
                    None => None,
                };
                let body = self.node(c.body)?;
                self.scopes.truncate(depth);
                Node::Comprehension(Box::new(Comp {
                    kind: c.kind,
                    range,
                    slot1,
                    slot2,
                    filter,
                    body,
                }))
            }
            ExprKind::Bind { var, init, body } => {
                let init = self.boxed(*init)?;
                let depth = self.scopes.len();
                let slot = self.bind(var);
                let body = self.boxed(*body)?;
                self.scopes.truncate(depth);
                Node::Bind { slot, init, body }
            }
        })
    }

    fn call(
        &mut self,
        pos: usize,
        target: Option<Box<Expr>>,
        name: String,
        args: Vec<Expr>,
    ) -> Result<Node, ParseError> {
        // `optional.of(x)`, `lists.range(n)` ...: a namespaced global function, unless the
        // namespace is a variable in scope.
        if let Some(t) = &target
            && let ExprKind::Ident(ns) = &t.kind
            && self.lookup(ns).is_none()
            && ns != "device"
        {
            let qualified = format!("{ns}.{name}");
            if !matches!(resolve(&qualified, false, args.len()), Resolution::Unknown) {
                return self.finish_call(pos, &qualified, false, None, args);
            }
        }
        let member = target.is_some();
        let receiver = match target {
            Some(t) => Some(self.node(*t)?),
            None => None,
        };
        self.finish_call(pos, &name, member, receiver, args)
    }

    fn finish_call(
        &mut self,
        pos: usize,
        name: &str,
        member: bool,
        receiver: Option<Node>,
        args: Vec<Expr>,
    ) -> Result<Node, ParseError> {
        let func = match resolve(name, member, args.len()) {
            Resolution::Found(func) => func,
            Resolution::Arity => {
                let shape = if member { "a receiver and " } else { "" };
                return err(
                    pos,
                    format!(
                        "found no matching overload for '{name}' applied to {shape}{} argument(s)",
                        args.len()
                    ),
                );
            }
            Resolution::Unknown => return err(pos, format!("undeclared reference to '{name}' (in container '')")),
        };
        let mut nodes = Vec::with_capacity(args.len() + 1);
        if let Some(r) = receiver {
            nodes.push(r);
        }
        for arg in args {
            nodes.push(self.node(arg)?);
        }
        let mut regex = None;
        if matches!(func, Func::Matches | Func::Find | Func::FindAll)
            && let Some(Node::Const(Const::String(pattern))) = nodes.get(1)
        {
            // Literal patterns are validated and compiled once, like cel-go's regex
            // literal validator and regex optimisation.
            match crate::functions::compile_regex(pattern) {
                Ok(re) => regex = Some(Arc::new(re)),
                Err(e) => return err(pos, e.message),
            }
        }
        Ok(Node::Call {
            func,
            args: nodes,
            regex,
        })
    }
}
