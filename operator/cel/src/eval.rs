//! Tree-walking evaluator with cel-go's error semantics and a runtime cost budget.
//!
//! Recursion depth is bounded by the tree height, which the parser limits. Arms with
//! many locals live in their own functions to keep the recursive frame small.

use std::rc::Rc;

use crate::DeviceView;
use crate::ast::{Comp, Const, DeviceField, Node};
use crate::functions::{self, Budget};
use crate::names::{self, Func};
use crate::parser::{BinOp, CompKind};
use crate::value::{Error, MapEntries, Result, Shared, Table, Value, check_key, compare, key_eq};

pub(crate) struct Evaluator<'a> {
    pub budget: Budget,
    /// Comprehension and binding variables; a binding may hold an error, which only
    /// surfaces when the variable is used.
    locals: Vec<Result<Value<'a>>>,
    device: &'a DeviceView<'a>,
}

fn constant(c: &Const) -> Value<'_> {
    match c {
        Const::Null => Value::Null,
        Const::Bool(b) => Value::Bool(*b),
        Const::Int(i) => Value::Int(*i),
        Const::Uint(u) => Value::Uint(*u),
        Const::Double(d) => Value::Double(*d),
        Const::String(s) => Value::str(s),
        Const::Bytes(b) => Value::Bytes(Shared::Borrowed(b)),
        Const::Type(t) => Value::Type(*t),
    }
}

fn select_error(v: &Value<'_>, field: &str) -> Error {
    match v {
        Value::Device(_) => Error::new(format!("no such field '{field}'")),
        other => Error::new(format!("type '{}' does not support field selection", other.type_name())),
    }
}

fn list_index(items: &[Value<'_>], index: &Value<'_>) -> Result<Option<usize>> {
    let i: i128 = match index {
        Value::Int(i) => i128::from(*i),
        Value::Uint(u) => i128::from(*u),
        Value::Double(d) if d.fract() == 0.0 && d.abs() < 9.2e18 => *d as i128,
        Value::Double(_) => {
            return Err(Error::new(format!(
                "unsupported index value {} in list",
                index.display_key()
            )));
        }
        other => {
            return Err(Error::new(format!(
                "unsupported index type '{}' in list",
                other.type_name()
            )));
        }
    };
    if i < 0 || i >= items.len() as i128 {
        return Ok(None);
    }
    Ok(Some(i as usize))
}

fn out_of_range(items: &[Value<'_>], index: &Value<'_>) -> Error {
    Error::new(format!(
        "index '{}' out of range in list size '{}'",
        index.display_key(),
        items.len()
    ))
}

/// `&&`/`||` combine: `decisive` (false for `&&`, true for `||`) wins over errors.
fn logical<'a>(left: Result<Value<'a>>, right: Result<Value<'a>>, decisive: bool) -> Result<Value<'a>> {
    match (left, right) {
        (_, Err(e)) if e.fatal => Err(e),
        (_, Ok(Value::Bool(b))) if b == decisive => Ok(Value::Bool(decisive)),
        (Ok(Value::Bool(_)), Ok(Value::Bool(_))) => Ok(Value::Bool(!decisive)),
        (Err(e), _) | (Ok(Value::Bool(_)), Err(e)) => Err(e),
        (Ok(_), _) => Err(Error::no_overload()),
    }
}

/// What a comprehension iterates: list elements (with indexes) or map keys (with values).
enum Range<'a> {
    List(Rc<[Value<'a>]>),
    Map(Rc<MapEntries<'a>>),
    /// A lazy device map: its keys, with values looked up on demand.
    Lazy(Value<'a>, Vec<Value<'a>>),
}

impl<'a> Range<'a> {
    fn new(v: Value<'a>) -> Result<Range<'a>> {
        match v {
            Value::List(items) => Ok(Range::List(items)),
            Value::Map(entries) => Ok(Range::Map(entries)),
            v @ (Value::Domains(..) | Value::Domain(..)) => {
                let keys = v.map_keys();
                Ok(Range::Lazy(v, keys))
            }
            other => Err(Error::new(format!(
                "expression of type '{}' cannot be the range of a comprehension",
                other.type_name()
            ))),
        }
    }

    fn len(&self) -> usize {
        match self {
            Range::List(items) => items.len(),
            Range::Map(entries) => entries.len(),
            Range::Lazy(_, keys) => keys.len(),
        }
    }

    fn is_list(&self) -> bool {
        matches!(self, Range::List(_))
    }

    /// The first variable's value (element or key) and, when asked, the second's
    /// (index-value pairs bind index first for lists).
    fn item(&self, i: usize, two: bool) -> Result<(Value<'a>, Option<Value<'a>>)> {
        Ok(match self {
            Range::List(items) if two => (Value::Int(i as i64), Some(items[i].clone())),
            Range::List(items) => (items[i].clone(), None),
            Range::Map(entries) => (entries[i].0.clone(), two.then(|| entries[i].1.clone())),
            Range::Lazy(map, keys) => {
                let key = keys[i].clone();
                let value = if two {
                    Some(map.map_get(&key)?.unwrap_or(Value::Null))
                } else {
                    None
                };
                (key, value)
            }
        })
    }
}

impl<'a> Evaluator<'a> {
    pub(crate) fn new(device: &'a DeviceView<'a>, slots: usize, limit: u64) -> Self {
        let mut locals = Vec::new();
        if slots > 0 {
            locals.resize_with(slots, || Ok(Value::Null));
        }
        Evaluator {
            budget: Budget { used: 0, limit },
            locals,
            device,
        }
    }

    /// A thin dispatcher: every arm calls a helper, so the recursive frame stays small.
    pub(crate) fn eval(&mut self, node: &'a Node) -> Result<Value<'a>> {
        self.budget.charge(1)?;
        match node {
            Node::Const(c) => Ok(constant(c)),
            Node::Local(slot) => self.local(*slot),
            Node::Device => Ok(Value::Device(self.device)),
            Node::DeviceField(field) => Ok(self.device_field(*field)),
            Node::Select {
                operand,
                field,
                optional,
            } => self.select(operand, field, *optional),
            Node::Has { operand, field } => self.has(operand, field),
            Node::Index {
                operand,
                index,
                optional,
            } => self.index(operand, index, *optional),
            Node::Call { func, args, regex } => self.call(*func, args, regex.as_deref()),
            Node::Not(e) => self.not(e),
            Node::Neg(e) => self.neg(e),
            Node::Binary(op, l, r) => self.binary(*op, l, r),
            Node::And(l, r) => self.logical(l, r, false),
            Node::Or(l, r) => self.logical(l, r, true),
            Node::Cond(c, t, f) => self.conditional(c, t, f),
            Node::List(items) => self.list(items),
            Node::Map(entries) => self.map(entries),
            Node::Comprehension(c) => self.comprehension(c),
            Node::Bind { slot, init, body } => self.bind(*slot, init, body),
        }
    }

    fn local(&self, slot: usize) -> Result<Value<'a>> {
        self.locals.get(slot).cloned().unwrap_or(Ok(Value::Null))
    }

    #[inline(never)]
    fn not(&mut self, e: &'a Node) -> Result<Value<'a>> {
        match self.eval(e)? {
            Value::Bool(b) => Ok(Value::Bool(!b)),
            other => Err(Error::no_overload_for("!_", &[&other])),
        }
    }

    #[inline(never)]
    fn neg(&mut self, e: &'a Node) -> Result<Value<'a>> {
        match self.eval(e)? {
            Value::Int(i) => i
                .checked_neg()
                .map(Value::Int)
                .ok_or_else(|| Error::new("integer overflow")),
            Value::Double(d) => Ok(Value::Double(-d)),
            other => Err(Error::no_overload_for("-_", &[&other])),
        }
    }

    /// `&&` (decisive false) and `||` (decisive true), commutative over errors.
    #[inline(never)]
    fn logical(&mut self, l: &'a Node, r: &'a Node, decisive: bool) -> Result<Value<'a>> {
        let left = self.eval(l);
        match &left {
            Ok(Value::Bool(b)) if *b == decisive => return left,
            Err(e) if e.fatal => return left,
            _ => {}
        }
        let right = self.eval(r);
        logical(left, right, decisive)
    }

    #[inline(never)]
    fn conditional(&mut self, c: &'a Node, t: &'a Node, f: &'a Node) -> Result<Value<'a>> {
        match self.eval(c)? {
            Value::Bool(true) => self.eval(t),
            Value::Bool(false) => self.eval(f),
            other => Err(Error::no_overload_for("_?_:_", &[&other])),
        }
    }

    #[inline(never)]
    fn bind(&mut self, slot: usize, init: &'a Node, body: &'a Node) -> Result<Value<'a>> {
        let value = self.eval(init);
        if let Err(e) = &value
            && e.fatal
        {
            return value;
        }
        if let Some(s) = self.locals.get_mut(slot) {
            *s = value;
        }
        self.eval(body)
    }

    fn device_field(&self, field: DeviceField) -> Value<'a> {
        match field {
            DeviceField::Driver => Value::str(self.device.driver),
            DeviceField::Attributes => Value::Domains(self.device, Table::Attributes),
            DeviceField::Capacity => Value::Domains(self.device, Table::Capacity),
            DeviceField::AllowMultipleAllocations => Value::Bool(self.device.allow_multiple_allocations),
        }
    }

    /// `v.field`, `v.?field`; selecting on an optional value is itself optional.
    #[inline(never)]
    fn select(&mut self, operand: &'a Node, field: &'a str, optional: bool) -> Result<Value<'a>> {
        let v = self.eval(operand)?;
        let (target, optional) = match v {
            Value::Optional(None) => return Ok(Value::Optional(None)),
            Value::Optional(Some(inner)) => ((*inner).clone(), true),
            other => (other, optional),
        };
        let found = match &target {
            Value::Device(_) => DeviceField::from_name(field).map(|f| self.device_field(f)),
            m if m.is_map() => {
                self.budget.charge(m.lookup_cost())?;
                m.map_get(&Value::str(field))?
            }
            other => return Err(select_error(other, field)),
        };
        match (found, optional) {
            (Some(v), false) => Ok(v),
            (Some(v), true) => Ok(Value::some(v)),
            (None, true) => Ok(Value::Optional(None)),
            (None, false) => match target {
                Value::Device(_) => Err(select_error(&target, field)),
                _ => Err(Error::no_such_key(&Value::str(field))),
            },
        }
    }

    #[inline(never)]
    fn has(&mut self, operand: &'a Node, field: &'a str) -> Result<Value<'a>> {
        let v = self.eval(operand)?;
        match &v {
            Value::Device(_) => Ok(Value::Bool(DeviceField::from_name(field).is_some())),
            // Any domain is present: upstream's lookup never fails on this map.
            Value::Domains(..) => Ok(Value::Bool(true)),
            m if m.is_map() => {
                self.budget.charge(m.lookup_cost())?;
                Ok(Value::Bool(m.map_contains(&Value::str(field))?))
            }
            // cel-go indexes a list with the field name, which fails; on any other
            // value a presence test is simply false.
            Value::List(_) => Err(Error::new("unsupported index type 'string' in list")),
            _ => Ok(Value::Bool(false)),
        }
    }

    #[inline(never)]
    fn index(&mut self, operand: &'a Node, index: &'a Node, optional: bool) -> Result<Value<'a>> {
        let v = self.eval(operand)?;
        let key = self.eval(index)?;
        let k = &key;
        // cel-go has no qualifier (index) for these values.
        match k {
            Value::Timestamp(_) => return Err(Error::new("invalid qualifier type: types.Timestamp")),
            Value::Duration(_) => return Err(Error::new("invalid qualifier type: types.Duration")),
            Value::Url(_) => return Err(Error::new("invalid qualifier type: cel.URL")),
            Value::Format(_) => return Err(Error::new("invalid qualifier type: cel.Format")),
            _ => {}
        }
        let (target, optional) = match v {
            Value::Optional(None) => return Ok(Value::Optional(None)),
            Value::Optional(Some(inner)) => ((*inner).clone(), true),
            other => (other, optional),
        };
        match &target {
            Value::List(items) => match (list_index(items, k)?, optional) {
                (Some(i), false) => Ok(items[i].clone()),
                (Some(i), true) => Ok(Value::some(items[i].clone())),
                (None, true) => Ok(Value::Optional(None)),
                (None, false) => Err(out_of_range(items, k)),
            },
            m if m.is_map() => match (
                self.budget.charge(m.lookup_cost()).and_then(|_| m.map_get(k))?,
                optional,
            ) {
                (Some(v), false) => Ok(v),
                (Some(v), true) => Ok(Value::some(v)),
                (None, true) => Ok(Value::Optional(None)),
                (None, false) => Err(Error::no_such_key(k)),
            },
            other => Err(Error::no_overload_for("_[_]", &[other, k])),
        }
    }

    #[inline(never)]
    fn binary(&mut self, op: BinOp, l: &'a Node, r: &'a Node) -> Result<Value<'a>> {
        let a = self.eval(l)?;
        let b = self.eval(r)?;
        Ok(match op {
            BinOp::Eq => Value::Bool(functions::equals(&a, &b, &mut self.budget)?),
            BinOp::Ne => Value::Bool(functions::not_equals(&a, &b, &mut self.budget)?),
            BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge => {
                let ord = compare(&a, &b).map_err(|e| {
                    if e.message == "no such overload" {
                        Error::no_overload_for(op.symbol(), &[&a, &b])
                    } else {
                        e
                    }
                })?;
                Value::Bool(match op {
                    BinOp::Lt => ord.is_lt(),
                    BinOp::Le => ord.is_le(),
                    BinOp::Gt => ord.is_gt(),
                    _ => ord.is_ge(),
                })
            }
            BinOp::In => Value::Bool(
                functions::contains(&a, &b, &mut self.budget)
                    .map_err(|_| Error::no_overload_for(op.symbol(), &[&a, &b]))?,
            ),
            _ => functions::arithmetic(op, a, b, &mut self.budget)?,
        })
    }

    #[inline(never)]
    fn call(&mut self, func: Func, args: &'a [Node], regex: Option<&regex::Regex>) -> Result<Value<'a>> {
        // `or` and `orValue` only evaluate their argument when the receiver is empty.
        if matches!(func, Func::Or | Func::OrValue)
            && let [receiver, alternative] = args
        {
            return match self.eval(receiver)? {
                Value::Optional(Some(v)) if func == Func::OrValue => Ok((*v).clone()),
                v @ Value::Optional(Some(_)) => Ok(v),
                Value::Optional(None) => {
                    let alt = self.eval(alternative)?;
                    if func == Func::Or && !matches!(alt, Value::Optional(_)) {
                        return Err(Error::no_overload_for("or", &[&Value::Optional(None), &alt]));
                    }
                    Ok(alt)
                }
                other => Err(Error::no_overload_for(names::name(func), &[&other])),
            };
        }
        // Small argument lists stay on the stack.
        match args {
            [] => functions::call(func, &[], regex, &mut self.budget),
            [a] => {
                let a = self.eval(a)?;
                functions::call(func, &[a], regex, &mut self.budget)
            }
            [a, b] => {
                let a = self.eval(a)?;
                let b = self.eval(b)?;
                functions::call(func, &[a, b], regex, &mut self.budget)
            }
            _ => {
                let mut values = Vec::with_capacity(args.len());
                for a in args {
                    values.push(self.eval(a)?);
                }
                functions::call(func, &values, regex, &mut self.budget)
            }
        }
    }

    #[inline(never)]
    fn list(&mut self, items: &'a [(Node, bool)]) -> Result<Value<'a>> {
        let mut out = Vec::with_capacity(items.len());
        for (item, optional) in items {
            let v = self.eval(item)?;
            if *optional {
                match v {
                    Value::Optional(Some(inner)) => out.push((*inner).clone()),
                    Value::Optional(None) => {}
                    other => {
                        return Err(Error::new(format!(
                            "cannot initialize optional list element from non-optional value {}",
                            other.display_key()
                        )));
                    }
                }
            } else {
                out.push(v);
            }
        }
        Ok(Value::list(out))
    }

    #[inline(never)]
    fn map(&mut self, entries: &'a [(Node, Node, bool)]) -> Result<Value<'a>> {
        let mut out: MapEntries<'a> = Vec::with_capacity(entries.len());
        for (k, v, optional) in entries {
            let key = self.eval(k)?;
            check_key(&key)?;
            let mut value = self.eval(v)?;
            if *optional {
                match value {
                    Value::Optional(Some(inner)) => value = (*inner).clone(),
                    Value::Optional(None) => {
                        out.retain(|(existing, _)| !key_eq(existing, &key));
                        continue;
                    }
                    other => {
                        return Err(Error::new(format!(
                            "cannot initialize optional entry '{}' from non-optional value {}",
                            key.display_key(),
                            other.display_key()
                        )));
                    }
                }
            }
            self.budget.charge(out.len() as u64 / 8)?;
            match out.iter_mut().find(|(existing, _)| key_eq(existing, &key)) {
                Some(slot) => slot.1 = value,
                None => out.push((key, value)),
            }
        }
        Ok(Value::Map(Rc::new(out)))
    }

    fn set(&mut self, slot: usize, value: Value<'a>) {
        if let Some(s) = self.locals.get_mut(slot) {
            *s = Ok(value);
        }
    }

    /// The loop body's result, propagating fatal errors.
    fn body(&mut self, node: &'a Node) -> Result<Result<Value<'a>>> {
        match self.eval(node) {
            Err(e) if e.fatal => Err(e),
            other => Ok(other),
        }
    }

    #[inline(never)]
    fn comprehension(&mut self, c: &'a Comp) -> Result<Value<'a>> {
        let range_value = self.eval(&c.range)?;
        if matches!(c.kind, CompKind::OptMap | CompKind::OptFlatMap) {
            return self.opt_map(c, range_value);
        }
        let range = Range::new(range_value)?;
        let two = c.slot2.is_some();
        let n = range.len();
        match c.kind {
            CompKind::All | CompKind::Exists => {
                // cel-go folds with `&&` / `||`: the decisive value wins over errors, and
                // the first error is reported otherwise.
                let decisive = c.kind == CompKind::Exists;
                let mut first_error = None;
                for i in 0..n {
                    self.budget.charge(1)?;
                    // A value that cannot be represented (an invalid version) is an
                    // error of this element only.
                    if let Err(e) = self.bind_item(c, &range, i, two) {
                        first_error.get_or_insert(e);
                        continue;
                    }
                    match self.body(&c.body)? {
                        Ok(Value::Bool(b)) if b == decisive => return Ok(Value::Bool(decisive)),
                        Ok(Value::Bool(_)) => {}
                        Ok(other) => {
                            first_error.get_or_insert(Error::no_overload_for(
                                if decisive { "_||_" } else { "_&&_" },
                                &[&other],
                            ));
                        }
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
                match first_error {
                    Some(e) => Err(e),
                    None => Ok(Value::Bool(!decisive)),
                }
            }
            CompKind::ExistsOne => {
                let mut count = 0u64;
                for i in 0..n {
                    self.budget.charge(1)?;
                    self.bind_item(c, &range, i, two)?;
                    match self.eval(&c.body)? {
                        Value::Bool(true) => count += 1,
                        Value::Bool(false) => {}
                        other => return Err(Error::no_overload_for("_?_:_", &[&other])),
                    }
                }
                Ok(Value::Bool(count == 1))
            }
            CompKind::Map | CompKind::Filter | CompKind::TransformList => {
                let mut out = Vec::new();
                for i in 0..n {
                    self.budget.charge(1)?;
                    let item = self.bind_item(c, &range, i, two)?;
                    if let Some(filter) = &c.filter {
                        match self.eval(filter)? {
                            Value::Bool(true) => {}
                            Value::Bool(false) => continue,
                            other => return Err(Error::no_overload_for("_?_:_", &[&other])),
                        }
                    }
                    if c.kind == CompKind::Filter {
                        match self.eval(&c.body)? {
                            Value::Bool(true) => out.push(item),
                            Value::Bool(false) => {}
                            other => return Err(Error::no_overload_for("_?_:_", &[&other])),
                        }
                    } else {
                        out.push(self.eval(&c.body)?);
                    }
                }
                Ok(Value::list(out))
            }
            CompKind::TransformMap | CompKind::TransformMapEntry => {
                let mut out: MapEntries<'a> = Vec::new();
                for i in 0..n {
                    self.budget.charge(1)?;
                    let key = self.bind_item(c, &range, i, two)?;
                    if let Some(filter) = &c.filter {
                        match self.eval(filter)? {
                            Value::Bool(true) => {}
                            Value::Bool(false) => continue,
                            other => return Err(Error::no_overload_for("_?_:_", &[&other])),
                        }
                    }
                    let value = self.eval(&c.body)?;
                    if c.kind == CompKind::TransformMap {
                        let key = if range.is_list() { Value::Int(i as i64) } else { key };
                        out.push((key, value));
                        continue;
                    }
                    if !value.is_map() {
                        return Err(Error::no_overload_for("transformMapEntry", &[&value]));
                    }
                    for (k, v) in value.map_entries()? {
                        self.budget.charge(1 + out.len() as u64 / 16)?;
                        if out.iter().any(|(existing, _)| key_eq(existing, &k)) {
                            return Err(Error::new(format!(
                                "insert failed: key {} already exists",
                                k.display_key()
                            )));
                        }
                        out.push((k, v));
                    }
                }
                Ok(Value::Map(Rc::new(out)))
            }
            CompKind::SortBy => {
                let Range::List(items) = &range else {
                    return Err(Error::no_overload_for("sortBy", &[]));
                };
                let mut keys = Vec::with_capacity(n);
                for i in 0..n {
                    self.budget.charge(1)?;
                    self.bind_item(c, &range, i, false)?;
                    keys.push(self.eval(&c.body)?);
                }
                functions::sort_by_keys(items, &keys, &mut self.budget)
            }
            CompKind::OptMap | CompKind::OptFlatMap => Err(Error::no_overload()),
        }
    }

    /// Binds the loop variables for item `i`; returns the first variable's value.
    fn bind_item(&mut self, c: &Comp, range: &Range<'a>, i: usize, two: bool) -> Result<Value<'a>> {
        let (first, second) = range.item(i, two)?;
        self.set(c.slot1, first.clone());
        if let (Some(slot), Some(value)) = (c.slot2, second) {
            self.set(slot, value);
        }
        Ok(first)
    }

    fn opt_map(&mut self, c: &'a Comp, target: Value<'a>) -> Result<Value<'a>> {
        match target {
            Value::Optional(None) => Ok(Value::Optional(None)),
            Value::Optional(Some(inner)) => {
                self.set(c.slot1, (*inner).clone());
                let result = self.eval(&c.body)?;
                if c.kind == CompKind::OptMap {
                    return Ok(Value::some(result));
                }
                match result {
                    v @ Value::Optional(_) => Ok(v),
                    other => Err(Error::no_overload_for("optFlatMap", &[&other])),
                }
            }
            other => Err(Error::no_overload_for(
                if c.kind == CompKind::OptMap {
                    "optMap"
                } else {
                    "optFlatMap"
                },
                &[&other],
            )),
        }
    }
}
