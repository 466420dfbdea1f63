//! Functions and operators: the CEL standard library, the cel-go extensions the
//! Kubernetes base environment enables (strings, lists, sets, optionals) and the
//! Kubernetes libraries (lists, regex, quantity, semver, IP, CIDR, URL, format).

use std::cmp::Ordering;
use std::rc::Rc;

use regex::Regex;

use crate::quantity::{Format, Quantity};

use crate::format::NamedFormat;
use crate::names::{Func, name};
use crate::net::{Cidr, Ip};
use crate::parser::BinOp;
use crate::semver::Semver;
use crate::time::{self, Timestamp};
use crate::url::{self, Url};
use crate::value::{Error, Result, Shared, Value, compare, format_double};

/// A runtime cost budget; exceeding it is fatal to the evaluation.
pub(crate) struct Budget {
    pub used: u64,
    pub limit: u64,
}

impl Budget {
    #[inline]
    pub(crate) fn charge(&mut self, units: u64) -> Result<()> {
        self.used = self.used.saturating_add(units);
        if self.used > self.limit {
            return Err(Error {
                message: "operation cancelled: actual cost limit exceeded".into(),
                fatal: true,
            });
        }
        Ok(())
    }

    /// Cost of handling `bytes` characters of string data (cel-go charges 0.1 a byte).
    /// A call that traverses text of `size`: characters for strings, as cel-go's
    /// `Size` counts them, bytes for bytes.
    pub(crate) fn charge_text(&mut self, size: usize) -> Result<()> {
        self.charge(1 + size as u64 / 10)
    }
}

/// The size cel-go gives a string: its characters.
fn char_count(s: &str) -> usize {
    s.chars().count()
}

/// Equality that charges one unit per compared element, so comparing huge or deeply
/// shared structures stays within the budget.
pub(crate) fn equals(a: &Value<'_>, b: &Value<'_>, budget: &mut Budget) -> Result<bool> {
    go_equal(a, b, budget)?.ok_or_else(Error::no_overload)
}

/// Whether `a.Equal(b)` is true, as list searches (`in`, `indexOf`, `distinct`, the
/// set functions) ask it: a failed comparison is just not a match.
fn same(a: &Value<'_>, b: &Value<'_>, budget: &mut Budget) -> Result<bool> {
    Ok(go_equal(a, b, budget)? == Some(true))
}

/// `!=`: cel-go negates "equal is true", so where `==` fails `!=` is true.
pub(crate) fn not_equals(a: &Value<'_>, b: &Value<'_>, budget: &mut Budget) -> Result<bool> {
    Ok(go_equal(a, b, budget)? != Some(true))
}

/// cel-go's `Equal`: `None` where it gives an error value, which a URL or a format
/// compared with a value of another type (not null) does. Lists and maps only stop at
/// an unequal element, so such an element counts as equal inside them.
fn go_equal(a: &Value<'_>, b: &Value<'_>, budget: &mut Budget) -> Result<Option<bool>> {
    budget.charge(1)?;
    match (a, b) {
        (Value::Url(_) | Value::Format(_), other)
            if !matches!(other, Value::Null) && other.type_name() != a.type_name() =>
        {
            Ok(None)
        }
        (Value::List(x), Value::List(y)) => {
            if x.len() != y.len() {
                return Ok(Some(false));
            }
            for (p, q) in x.iter().zip(y.iter()) {
                if go_equal(p, q, budget)? == Some(false) {
                    return Ok(Some(false));
                }
            }
            Ok(Some(true))
        }
        (Value::Optional(Some(x)), Value::Optional(Some(y))) => go_equal(x, y, budget),
        (x, y) if x.is_map() && y.is_map() => {
            if x.map_len() != y.map_len() {
                return Ok(Some(false));
            }
            for key in x.map_keys() {
                budget.charge(1 + x.lookup_cost() + y.lookup_cost())?;
                match (x.map_get(&key), y.map_get(&key)) {
                    (Ok(Some(p)), Ok(Some(q))) => {
                        if go_equal(&p, &q, budget)? == Some(false) {
                            return Ok(Some(false));
                        }
                    }
                    _ => return Ok(Some(false)),
                }
            }
            Ok(Some(true))
        }
        (x, y) => Ok(Some(crate::value::equals(x, y))),
    }
}

/// `elem in container`.
pub(crate) fn contains<'a>(elem: &Value<'a>, container: &Value<'a>, budget: &mut Budget) -> Result<bool> {
    match container {
        // cel-go asks the element whether it equals each item: only `true` counts.
        Value::List(items) => {
            for item in items.iter() {
                if same(elem, item, budget)? {
                    return Ok(true);
                }
            }
            Ok(false)
        }
        c if c.is_map() => {
            budget.charge(c.lookup_cost())?;
            c.map_contains(elem)
        }
        _ => Err(Error::no_overload()),
    }
}

pub(crate) fn arithmetic<'a>(op: BinOp, a: Value<'a>, b: Value<'a>, budget: &mut Budget) -> Result<Value<'a>> {
    use Value as V;
    let overflow = || Error::new("integer overflow");
    let uoverflow = || Error::new("unsigned integer overflow");
    Ok(match (op, a, b) {
        (BinOp::Add, V::Int(x), V::Int(y)) => V::Int(x.checked_add(y).ok_or_else(overflow)?),
        (BinOp::Sub, V::Int(x), V::Int(y)) => V::Int(x.checked_sub(y).ok_or_else(overflow)?),
        (BinOp::Mul, V::Int(x), V::Int(y)) => V::Int(x.checked_mul(y).ok_or_else(overflow)?),
        (BinOp::Div, V::Int(x), V::Int(y)) => {
            if y == 0 {
                return Err(Error::new("division by zero"));
            }
            V::Int(x.checked_div(y).ok_or_else(overflow)?)
        }
        (BinOp::Rem, V::Int(x), V::Int(y)) => {
            if y == 0 {
                return Err(Error::new("modulus by zero"));
            }
            V::Int(x.checked_rem(y).ok_or_else(overflow)?)
        }
        (BinOp::Add, V::Uint(x), V::Uint(y)) => V::Uint(x.checked_add(y).ok_or_else(uoverflow)?),
        (BinOp::Sub, V::Uint(x), V::Uint(y)) => V::Uint(x.checked_sub(y).ok_or_else(uoverflow)?),
        (BinOp::Mul, V::Uint(x), V::Uint(y)) => V::Uint(x.checked_mul(y).ok_or_else(uoverflow)?),
        (BinOp::Div, V::Uint(x), V::Uint(y)) => {
            if y == 0 {
                return Err(Error::new("division by zero"));
            }
            V::Uint(x / y)
        }
        (BinOp::Rem, V::Uint(x), V::Uint(y)) => {
            if y == 0 {
                return Err(Error::new("modulus by zero"));
            }
            V::Uint(x % y)
        }
        (BinOp::Add, V::Duration(x), V::Duration(y)) => V::Duration(x.checked_add(y).ok_or_else(overflow)?),
        (BinOp::Sub, V::Duration(x), V::Duration(y)) => V::Duration(x.checked_sub(y).ok_or_else(overflow)?),
        (BinOp::Add, V::Timestamp(t), V::Duration(d)) | (BinOp::Add, V::Duration(d), V::Timestamp(t)) => {
            V::Timestamp(t.add(d).map_err(time_error)?)
        }
        (BinOp::Sub, V::Timestamp(t), V::Duration(d)) => V::Timestamp(t.sub_duration(d).map_err(time_error)?),
        (BinOp::Sub, V::Timestamp(x), V::Timestamp(y)) => V::Duration(x.since(&y).map_err(time_error)?),
        (BinOp::Add, V::Double(x), V::Double(y)) => V::Double(x + y),
        (BinOp::Sub, V::Double(x), V::Double(y)) => V::Double(x - y),
        (BinOp::Mul, V::Double(x), V::Double(y)) => V::Double(x * y),
        (BinOp::Div, V::Double(x), V::Double(y)) => V::Double(x / y),
        (BinOp::Add, V::String(x), V::String(y)) => {
            budget.charge_text(char_count(&x) + char_count(&y))?;
            let mut s = String::with_capacity(x.len() + y.len());
            s.push_str(&x);
            s.push_str(&y);
            V::owned_str(s)
        }
        (BinOp::Add, V::Bytes(x), V::Bytes(y)) => {
            budget.charge_text(x.len() + y.len())?;
            let mut v = Vec::with_capacity(x.len() + y.len());
            v.extend_from_slice(&x);
            v.extend_from_slice(&y);
            V::Bytes(Shared::Owned(v.into()))
        }
        (BinOp::Add, V::List(x), V::List(y)) => {
            if x.is_empty() {
                return Ok(V::List(y));
            }
            if y.is_empty() {
                return Ok(V::List(x));
            }
            budget.charge((x.len() + y.len()) as u64)?;
            V::List(x.iter().chain(y.iter()).cloned().collect())
        }
        (op, a, b) => return Err(Error::no_overload_for(op.symbol(), &[&a, &b])),
    })
}

/// Go's RE2 makes `\d`, `\w`, `\s` and `\b` ASCII-only; the regex crate makes them
/// Unicode-aware. Rewrites them to their ASCII meaning.
fn translate_pattern(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len() + 16);
    let mut chars = pattern.chars().peekable();
    let mut in_class = false;
    let mut class_start = false;
    while let Some(c) = chars.next() {
        if c == '\\' {
            let Some(e) = chars.next() else {
                out.push('\\');
                break;
            };
            let replacement = match (in_class, e) {
                (false, 'd') => Some("[0-9]"),
                (false, 'D') => Some("[^0-9]"),
                (false, 'w') => Some("[0-9A-Za-z_]"),
                (false, 'W') => Some("[^0-9A-Za-z_]"),
                (false, 's') => Some("[\\t\\n\\f\\r ]"),
                (false, 'S') => Some("[^\\t\\n\\f\\r ]"),
                (false, 'b') => Some("(?-u:\\b)"),
                (false, 'B') => Some("(?-u:\\B)"),
                (true, 'd') => Some("0-9"),
                (true, 'D') => Some("[^0-9]"),
                (true, 'w') => Some("0-9A-Za-z_"),
                (true, 'W') => Some("[^0-9A-Za-z_]"),
                (true, 's') => Some("\\t\\n\\f\\r "),
                (true, 'S') => Some("[^\\t\\n\\f\\r ]"),
                _ => None,
            };
            match replacement {
                Some(r) => out.push_str(r),
                None => {
                    out.push('\\');
                    out.push(e);
                }
            }
            class_start = false;
            continue;
        }
        if in_class {
            if c == ']' && !class_start {
                in_class = false;
            } else if c == '[' && chars.peek() == Some(&':') {
                // A POSIX class such as [:alpha:]: copy it whole.
                out.push(c);
                for p in chars.by_ref() {
                    out.push(p);
                    if p == ']' {
                        break;
                    }
                }
                class_start = false;
                continue;
            } else if c == '[' {
                // A literal '[' inside a class in RE2 is a nested class in the regex crate.
                out.push_str("\\[");
                class_start = false;
                continue;
            }
            out.push(c);
            class_start = c == '^' && class_start && out.ends_with("[^");
            continue;
        }
        if c == '[' {
            in_class = true;
            class_start = true;
            out.push(c);
            if chars.peek() == Some(&'^') {
                out.push('^');
                chars.next();
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// Compiles an RE2 pattern.
pub(crate) fn compile_regex(pattern: &str) -> Result<Regex> {
    regex::RegexBuilder::new(&translate_pattern(pattern))
        .size_limit(1 << 22)
        .build()
        .map_err(|e| {
            let text = e.to_string();
            let detail = text
                .lines()
                .find_map(|l| l.trim().strip_prefix("error: "))
                .unwrap_or(text.trim())
                .to_string();
            Error::new(format!("error parsing regexp: {detail}: `{pattern}`"))
        })
}

fn regex_arg<'r>(
    precompiled: Option<&'r Regex>,
    pattern: &Value<'_>,
    owned: &'r mut Option<Regex>,
) -> Result<&'r Regex> {
    if let Some(re) = precompiled {
        return Ok(re);
    }
    let Value::String(p) = pattern else {
        return Err(Error::no_overload());
    };
    Ok(owned.insert(compile_regex(p)?))
}

fn int_arg(v: &Value<'_>) -> Result<i64> {
    match v {
        Value::Int(i) => Ok(*i),
        _ => Err(Error::no_overload()),
    }
}

fn str_arg<'v>(v: &'v Value<'_>) -> Result<&'v str> {
    match v {
        Value::String(s) => Ok(s),
        _ => Err(Error::no_overload()),
    }
}

fn list_arg<'v, 'a>(v: &'v Value<'a>) -> Result<&'v Rc<[Value<'a>]>> {
    match v {
        Value::List(l) => Ok(l),
        _ => Err(Error::no_overload()),
    }
}

fn bool_arg(v: &Value<'_>) -> Result<bool> {
    match v {
        Value::Bool(b) => Ok(*b),
        _ => Err(Error::no_overload()),
    }
}

fn quantity_arg<'v>(v: &'v Value<'_>) -> Result<&'v Quantity> {
    match v {
        Value::Quantity(q) => Ok(q),
        _ => Err(Error::no_overload()),
    }
}

fn quantity_value<'a>(q: Quantity) -> Value<'a> {
    Value::Quantity(Shared::Owned(Rc::new(q)))
}

fn quantity_error(e: crate::quantity::QuantityError) -> Error {
    Error::new(e.to_string())
}

fn time_error(e: time::TimeError) -> Error {
    Error::new(e.to_string())
}

fn net_error(e: crate::net::NetError) -> Error {
    Error::new(e.to_string())
}

/// A Go string as an expression sees it (invalid UTF-8 shown as U+FFFD).
fn go_string<'a>(b: &[u8]) -> Value<'a> {
    Value::owned_str(String::from_utf8_lossy(b))
}

fn conversion_error(from: &Value<'_>, to: &str) -> Error {
    Error::new(format!("type conversion error from '{}' to '{to}'", from.type_name()))
}

fn ordering_int(o: Ordering) -> i64 {
    match o {
        Ordering::Less => -1,
        Ordering::Equal => 0,
        Ordering::Greater => 1,
    }
}

/// Two receivers of the same comparable kind (quantities or versions).
fn compare_objects(a: &Value<'_>, b: &Value<'_>) -> Result<Ordering> {
    match (a, b) {
        (Value::Quantity(x), Value::Quantity(y)) => Ok(x.cmp(y)),
        (Value::Semver(x), Value::Semver(y)) => Ok(x.cmp(y)),
        _ => Err(Error::no_overload()),
    }
}

/// Rune-indexed string helpers follow cel-go's strings extension.
fn runes(s: &str) -> Vec<char> {
    s.chars().collect()
}

fn out_of_range(i: i64) -> Error {
    Error::new(format!("index out of range: {i}"))
}

fn index_of(s: &str, sub: &str, offset: i64) -> Result<i64> {
    if offset < 0 {
        return Err(out_of_range(offset));
    }
    let hay = runes(s);
    let off = offset as u64;
    if sub.is_empty() {
        return Ok(off.min(hay.len() as u64) as i64);
    }
    if off >= hay.len() as u64 {
        return Ok(-1);
    }
    let needle = runes(sub);
    let off = off as usize;
    if needle.len() > hay.len() {
        return Ok(-1);
    }
    for i in off..=hay.len() - needle.len() {
        if hay[i..i + needle.len()] == needle[..] {
            return Ok(i as i64);
        }
    }
    Ok(-1)
}

fn last_index_of(s: &str, sub: &str, offset: Option<i64>) -> Result<i64> {
    let hay = runes(s);
    let offset = match offset {
        None => {
            if sub.is_empty() {
                return Ok(hay.len() as i64);
            }
            if s.len() < sub.len() {
                return Ok(-1);
            }
            hay.len() as i64 - 1
        }
        Some(o) if o < 0 => return Err(out_of_range(o)),
        Some(o) => o,
    };
    if sub.is_empty() {
        return Ok(offset.min(hay.len() as i64));
    }
    if offset as u64 >= hay.len() as u64 {
        return Ok(-1);
    }
    let needle = runes(sub);
    if needle.len() > hay.len() {
        return Ok(-1);
    }
    let start = (offset as usize).min(hay.len() - needle.len());
    for i in (0..=start).rev() {
        if hay[i..i + needle.len()] == needle[..] {
            return Ok(i as i64);
        }
    }
    Ok(-1)
}

/// Go's `strings.Replace`: at most `n` replacements (all when negative); an empty
/// `old` matches before every rune and at the end.
fn replace(s: &str, old: &str, new: &str, n: i64, budget: &mut Budget) -> Result<String> {
    let limit = if n < 0 { usize::MAX } else { n as usize };
    let matches = if old.is_empty() {
        s.chars().count() + 1
    } else {
        s.matches(old).count()
    }
    .min(limit);
    let out_len = s.len() + matches * new.len();
    budget.charge_text(s.len() + out_len)?;
    if matches == 0 {
        return Ok(s.to_string());
    }
    let mut out = String::with_capacity(out_len);
    if old.is_empty() {
        let mut done = 0;
        for c in s.chars() {
            if done < matches {
                out.push_str(new);
                done += 1;
            }
            out.push(c);
        }
        if done < matches {
            out.push_str(new);
        }
        return Ok(out);
    }
    let mut rest = s;
    for _ in 0..matches {
        match rest.find(old) {
            Some(i) => {
                out.push_str(&rest[..i]);
                out.push_str(new);
                rest = &rest[i + old.len()..];
            }
            None => break,
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// Go's `strings.SplitN`: `n == 0` gives no pieces, a negative `n` all of them; an
/// empty separator splits between runes.
fn split<'a>(s: &str, sep: &str, n: i64, budget: &mut Budget) -> Result<Value<'a>> {
    budget.charge_text(char_count(s))?;
    if n == 0 {
        return Ok(Value::list(Vec::new()));
    }
    let limit = if n < 0 { usize::MAX } else { n as usize };
    let mut out: Vec<Value<'a>> = Vec::new();
    if sep.is_empty() {
        let mut rest = s;
        while !rest.is_empty() {
            if out.len() + 1 == limit {
                out.push(Value::owned_str(rest));
                break;
            }
            let len = rest.chars().next().map_or(1, char::len_utf8);
            out.push(Value::owned_str(&rest[..len]));
            rest = &rest[len..];
        }
        budget.charge(out.len() as u64)?;
        return Ok(Value::list(out));
    }
    for piece in s.splitn(limit, sep) {
        out.push(Value::owned_str(piece));
    }
    budget.charge(out.len() as u64)?;
    Ok(Value::list(out))
}

fn substring(s: &str, start: i64, end: Option<i64>) -> Result<String> {
    let r = runes(s);
    let len = r.len() as i64;
    let end_v = end.unwrap_or(len);
    if let Some(e) = end
        && start > e
    {
        return Err(Error::new(format!("invalid substring range. start: {start}, end: {e}")));
    }
    if start < 0 || start > len {
        return Err(out_of_range(start));
    }
    if end_v < 0 || end_v > len {
        return Err(out_of_range(end_v));
    }
    Ok(r[start as usize..end_v as usize].iter().collect())
}

fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '\x07' => out.push_str("\\a"),
            '\x08' => out.push_str("\\b"),
            '\x0c' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\x0b' => out.push_str("\\v"),
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn flatten<'a>(list: &[Value<'a>], depth: i64, out: &mut Vec<Value<'a>>, budget: &mut Budget) -> Result<()> {
    for item in list {
        budget.charge(1)?;
        match item {
            Value::List(inner) if depth > 0 => flatten(inner, depth - 1, out, budget)?,
            other => out.push(other.clone()),
        }
    }
    Ok(())
}

/// Sorts `items` by `keys` (same length): all keys must share one comparable type.
pub(crate) fn sort_by_keys<'a>(items: &[Value<'a>], keys: &[Value<'a>], budget: &mut Budget) -> Result<Value<'a>> {
    let Some(first) = keys.first() else {
        return Ok(Value::list(items.to_vec()));
    };
    let kind = first.type_name();
    if !matches!(
        first,
        Value::Int(_)
            | Value::Uint(_)
            | Value::Double(_)
            | Value::Bool(_)
            | Value::String(_)
            | Value::Bytes(_)
            | Value::Timestamp(_)
            | Value::Duration(_)
    ) {
        return Err(Error::new("list elements must be comparable"));
    }
    if keys.iter().any(|k| k.type_name() != kind) {
        return Err(Error::new("list elements must have the same type"));
    }
    let n = keys.len() as u64;
    budget.charge(n * (64 - n.leading_zeros() as u64).max(1))?;
    let mut order: Vec<usize> = (0..items.len()).collect();
    let mut failure = None;
    order.sort_by(|&i, &j| match compare(&keys[i], &keys[j]) {
        Ok(o) => o,
        Err(e) => {
            failure.get_or_insert(e);
            Ordering::Equal
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(Value::list(order.into_iter().map(|i| items[i].clone()).collect()))
}

fn parse_go_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

fn double_to_int(d: f64) -> Result<i64> {
    // Bounds as cel-go: the open interval (-2^63, 2^63).
    if d.is_nan() || d <= -9_223_372_036_854_775_808.0 || d >= 9_223_372_036_854_775_808.0 {
        return Err(Error::new("integer overflow"));
    }
    Ok(d as i64)
}

fn double_to_uint(d: f64) -> Result<u64> {
    if d.is_nan() || !(0.0..18_446_744_073_709_551_616.0).contains(&d) {
        return Err(Error::new("unsigned integer overflow"));
    }
    Ok(d as u64)
}

/// Calls a function on evaluated arguments (the receiver first for methods).
pub(crate) fn call<'a>(
    func: Func,
    args: &[Value<'a>],
    precompiled: Option<&Regex>,
    budget: &mut Budget,
) -> Result<Value<'a>> {
    use Value as V;
    let arg = |i: usize| args.get(i).ok_or_else(Error::no_overload);
    let no_overload = || Error::no_overload_for(name(func), &args.iter().collect::<Vec<_>>());
    let a0 = arg(0);
    Ok(match func {
        Func::Int => match a0? {
            V::Int(i) => V::Int(*i),
            V::Uint(u) => V::Int(i64::try_from(*u).map_err(|_| Error::new("integer overflow"))?),
            V::Double(d) => V::Int(double_to_int(*d)?),
            V::Duration(d) => V::Int(*d),
            V::Timestamp(t) => V::Int(t.unix()),
            V::String(s) => V::Int(s.parse::<i64>().map_err(|_| conversion_error(&args[0], "int"))?),
            _ => return Err(no_overload()),
        },
        Func::Uint => match a0? {
            V::Uint(u) => V::Uint(*u),
            V::Int(i) => V::Uint(u64::try_from(*i).map_err(|_| Error::new("unsigned integer overflow"))?),
            V::Double(d) => V::Uint(double_to_uint(*d)?),
            V::String(s) if !s.starts_with('+') => {
                V::Uint(s.parse::<u64>().map_err(|_| conversion_error(&args[0], "uint"))?)
            }
            V::String(_) => return Err(conversion_error(&args[0], "uint")),
            _ => return Err(no_overload()),
        },
        Func::Double => match a0? {
            V::Double(d) => V::Double(*d),
            V::Int(i) => V::Double(*i as f64),
            V::Uint(u) => V::Double(*u as f64),
            V::String(s) => V::Double(s.parse::<f64>().map_err(|_| conversion_error(&args[0], "double"))?),
            _ => return Err(no_overload()),
        },
        Func::String => match a0? {
            V::String(s) => V::String(s.clone()),
            V::Int(i) => V::owned_str(i.to_string()),
            V::Uint(u) => V::owned_str(u.to_string()),
            V::Double(d) => V::owned_str(format_double(*d)),
            V::Bool(b) => V::str(if *b { "true" } else { "false" }),
            V::Bytes(b) => match std::str::from_utf8(b) {
                Ok(s) => V::owned_str(s),
                Err(_) => return Err(Error::new("invalid UTF-8 in bytes, cannot convert to string")),
            },
            V::Type(t) => V::str(t.name()),
            V::Duration(d) => V::owned_str(time::format_duration(*d)),
            V::Timestamp(t) => V::owned_str(t.format()),
            V::Ip(ip) => V::owned_str(ip.to_string()),
            V::Cidr(c) => V::owned_str(c.to_string()),
            _ => return Err(no_overload()),
        },
        Func::Bool => match a0? {
            V::Bool(b) => V::Bool(*b),
            V::String(s) => V::Bool(parse_go_bool(s).ok_or_else(|| conversion_error(&args[0], "bool"))?),
            _ => return Err(no_overload()),
        },
        Func::Bytes => match a0? {
            V::Bytes(b) => V::Bytes(b.clone()),
            V::String(s) => V::Bytes(Shared::Owned(Rc::from(s.as_bytes()))),
            _ => return Err(no_overload()),
        },
        Func::Dyn => a0?.clone(),
        Func::Type => match a0? {
            // kube-scheduler binds `device` to a Go map: its runtime type is `map`.
            V::Device(_) => V::Type(crate::value::TypeName::Map),
            v => V::Type(v.type_name()),
        },
        Func::Size => match a0? {
            V::String(s) => {
                budget.charge_text(char_count(s))?;
                V::Int(s.chars().count() as i64)
            }
            V::Bytes(b) => V::Int(b.len() as i64),
            V::List(l) => V::Int(l.len() as i64),
            m if m.is_map() => V::Int(m.map_len() as i64),
            _ => return Err(no_overload()),
        },
        Func::Contains | Func::StartsWith | Func::EndsWith => {
            let (V::String(s), V::String(t)) = (a0?, arg(1)?) else {
                return Err(no_overload());
            };
            budget.charge_text(char_count(s) + char_count(t))?;
            V::Bool(match func {
                Func::Contains => s.contains(&**t),
                Func::StartsWith => s.starts_with(&**t),
                _ => s.ends_with(&**t),
            })
        }
        Func::Matches => {
            let s = str_arg(a0?).map_err(|_| no_overload())?;
            let mut owned = None;
            let re = regex_arg(precompiled, arg(1)?, &mut owned)?;
            budget.charge_text(char_count(s))?;
            V::Bool(re.is_match(s))
        }
        Func::Find => {
            let s = str_arg(a0?).map_err(|_| no_overload())?;
            let mut owned = None;
            let re = regex_arg(precompiled, arg(1)?, &mut owned)?;
            budget.charge_text(char_count(s))?;
            V::owned_str(re.find(s).map_or("", |m| m.as_str()))
        }
        Func::FindAll => {
            let s = str_arg(a0?).map_err(|_| no_overload())?;
            let limit = match args.get(2) {
                Some(n) => int_arg(n)?,
                None => -1,
            };
            let mut owned = None;
            let re = regex_arg(precompiled, arg(1)?, &mut owned)?;
            budget.charge_text(char_count(s))?;
            let take = if limit < 0 { usize::MAX } else { limit as usize };
            let found: Vec<V<'a>> = re.find_iter(s).take(take).map(|m| V::owned_str(m.as_str())).collect();
            budget.charge(found.len() as u64)?;
            V::list(found)
        }
        Func::CharAt => {
            let s = str_arg(a0?)?;
            let i = int_arg(arg(1)?)?;
            budget.charge_text(char_count(s))?;
            let count = s.chars().count() as i64;
            if i < 0 || i > count {
                return Err(out_of_range(i));
            }
            match s.chars().nth(i as usize) {
                Some(c) => V::owned_str(c.to_string()),
                None => V::str(""),
            }
        }
        Func::IndexOf | Func::LastIndexOf => match a0? {
            V::String(s) => {
                let sub = str_arg(arg(1)?)?;
                budget.charge_text(char_count(s) + char_count(sub))?;
                let offset = match args.get(2) {
                    Some(o) => Some(int_arg(o)?),
                    None => None,
                };
                V::Int(if func == Func::IndexOf {
                    index_of(s, sub, offset.unwrap_or(0))?
                } else {
                    last_index_of(s, sub, offset)?
                })
            }
            V::List(items) if args.len() == 2 => {
                let needle = arg(1)?;
                let mut found = -1;
                let positions: Box<dyn Iterator<Item = usize>> = if func == Func::IndexOf {
                    Box::new(0..items.len())
                } else {
                    Box::new((0..items.len()).rev())
                };
                for i in positions {
                    if same(&items[i], needle, budget)? {
                        found = i as i64;
                        break;
                    }
                }
                V::Int(found)
            }
            _ => return Err(no_overload()),
        },
        Func::LowerAscii | Func::UpperAscii => {
            let s = str_arg(a0?)?;
            budget.charge_text(char_count(s))?;
            V::owned_str(if func == Func::LowerAscii {
                s.to_ascii_lowercase()
            } else {
                s.to_ascii_uppercase()
            })
        }
        Func::Replace => {
            let s = str_arg(a0?)?;
            let old = str_arg(arg(1)?)?;
            let new = str_arg(arg(2)?)?;
            let n = match args.get(3) {
                Some(n) => int_arg(n)?,
                None => -1,
            };
            V::owned_str(replace(s, old, new, n, budget)?)
        }
        Func::Split => {
            let s = str_arg(a0?)?;
            let sep = str_arg(arg(1)?)?;
            let n = match args.get(2) {
                Some(n) => int_arg(n)?,
                None => -1,
            };
            split(s, sep, n, budget)?
        }
        Func::Substring => {
            let s = str_arg(a0?)?;
            let start = int_arg(arg(1)?)?;
            let end = match args.get(2) {
                Some(e) => Some(int_arg(e)?),
                None => None,
            };
            budget.charge_text(char_count(s))?;
            V::owned_str(substring(s, start, end)?)
        }
        Func::Trim => {
            let s = str_arg(a0?)?;
            budget.charge_text(char_count(s))?;
            V::owned_str(s.trim())
        }
        Func::Join => {
            let items = list_arg(a0?)?;
            let sep = match args.get(1) {
                Some(s) => str_arg(s)?,
                None => "",
            };
            let mut out = String::new();
            for (i, item) in items.iter().enumerate() {
                let V::String(s) = item else {
                    return Err(Error::new(format!("join: invalid input: {}", item.display_key())));
                };
                if i > 0 {
                    out.push_str(sep);
                }
                budget.charge_text(char_count(s) + char_count(sep))?;
                out.push_str(s);
            }
            V::owned_str(out)
        }
        Func::Reverse => match a0? {
            V::String(s) => {
                budget.charge_text(char_count(s))?;
                V::owned_str(s.chars().rev().collect::<String>())
            }
            V::List(items) => {
                budget.charge(items.len() as u64)?;
                V::List(items.iter().rev().cloned().collect())
            }
            _ => return Err(no_overload()),
        },
        Func::Quote => {
            let s = str_arg(a0?)?;
            budget.charge_text(char_count(s))?;
            V::owned_str(quote(s))
        }
        Func::StringFormat => {
            let s = str_arg(a0?)?;
            let items = list_arg(arg(1)?)?;
            // cel-go charges the format string's length only, not the output's.
            budget.charge_text(char_count(s))?;
            V::owned_str(crate::string_format::format(s, items)?)
        }
        Func::IsSorted => {
            let items = list_arg(a0?)?;
            budget.charge(items.len() as u64)?;
            for pair in items.windows(2) {
                if compare(&pair[0], &pair[1])? == Ordering::Greater {
                    return Ok(V::Bool(false));
                }
            }
            if let Some(only) = items.first() {
                compare(only, only)?;
            }
            V::Bool(true)
        }
        Func::Sum => {
            let items = list_arg(a0?)?;
            budget.charge(items.len() as u64)?;
            let mut iter = items.iter();
            let Some(first) = iter.next() else {
                return Ok(V::Int(0));
            };
            if !matches!(first, V::Int(_) | V::Uint(_) | V::Double(_) | V::Duration(_)) {
                return Err(no_overload());
            }
            let mut acc = first.clone();
            for item in iter {
                acc = arithmetic(BinOp::Add, acc, item.clone(), budget)?;
            }
            acc
        }
        Func::Min | Func::Max => {
            let items = list_arg(a0?)?;
            budget.charge(items.len() as u64)?;
            let mut iter = items.iter();
            let Some(mut best) = iter.next() else {
                let which = if func == Func::Min { "min" } else { "max" };
                return Err(Error::new(format!("{which} called on empty list")));
            };
            compare(best, best)?;
            for item in iter {
                let ord = compare(best, item)?;
                let better = if func == Func::Min {
                    ord == Ordering::Greater
                } else {
                    ord == Ordering::Less
                };
                if better {
                    best = item;
                }
            }
            best.clone()
        }
        Func::Slice => {
            let items = list_arg(a0?)?;
            let start = int_arg(arg(1)?)?;
            let end = int_arg(arg(2)?)?;
            if start < 0 || end < 0 {
                return Err(Error::new(format!(
                    "cannot slice({start}, {end}), negative indexes not supported"
                )));
            }
            if start > end {
                return Err(Error::new(format!(
                    "cannot slice({start}, {end}), start index must be less than or equal to end index"
                )));
            }
            if end as u64 > items.len() as u64 {
                return Err(Error::new(format!(
                    "cannot slice({start}, {end}), list is length {}",
                    items.len()
                )));
            }
            budget.charge((end - start) as u64)?;
            V::List(items[start as usize..end as usize].iter().cloned().collect())
        }
        Func::Flatten => {
            let items = list_arg(a0?)?;
            let depth = match args.get(1) {
                Some(d) => int_arg(d)?,
                None => 1,
            };
            if depth < 0 {
                return Err(Error::new("level must be non-negative"));
            }
            let mut out = Vec::new();
            flatten(items, depth, &mut out, budget)?;
            V::list(out)
        }
        Func::Distinct => {
            let items = list_arg(a0?)?;
            let mut out: Vec<V<'a>> = Vec::new();
            for item in items.iter() {
                let mut seen = false;
                for kept in &out {
                    if same(item, kept, budget)? {
                        seen = true;
                        break;
                    }
                }
                if !seen {
                    out.push(item.clone());
                }
            }
            V::list(out)
        }
        Func::Sort => {
            let items = list_arg(a0?)?;
            sort_by_keys(items, items, budget)?
        }
        Func::Unwrap => {
            let mut out = Vec::new();
            for item in list_arg(a0?)?.iter() {
                match item {
                    V::Optional(Some(v)) => out.push((**v).clone()),
                    V::Optional(None) => {}
                    _ => return Err(no_overload()),
                }
            }
            V::list(out)
        }
        Func::First => V::Optional(list_arg(a0?)?.first().map(|v| Rc::new(v.clone()))),
        Func::Last => V::Optional(list_arg(a0?)?.last().map(|v| Rc::new(v.clone()))),
        Func::Range => {
            let n = int_arg(a0?)?;
            if n < 0 {
                return Err(Error::new(format!("lists.range: size must be non-negative, got {n}")));
            }
            budget.charge(n as u64)?;
            V::List((0..n).map(V::Int).collect())
        }
        Func::SetsContains | Func::SetsEquivalent | Func::SetsIntersects => {
            let a = list_arg(a0?)?;
            let b = list_arg(arg(1)?)?;
            let all_in = |sub: &[V<'a>], set: &[V<'a>], budget: &mut Budget| -> Result<bool> {
                for x in sub {
                    let mut found = false;
                    for y in set {
                        if same(x, y, budget)? {
                            found = true;
                            break;
                        }
                    }
                    if !found {
                        return Ok(false);
                    }
                }
                Ok(true)
            };
            V::Bool(match func {
                Func::SetsContains => all_in(b, a, budget)?,
                Func::SetsEquivalent => all_in(b, a, budget)? && all_in(a, b, budget)?,
                _ => {
                    let mut any = false;
                    'outer: for x in a.iter() {
                        for y in b.iter() {
                            if same(x, y, budget)? {
                                any = true;
                                break 'outer;
                            }
                        }
                    }
                    any
                }
            })
        }
        Func::OptionalOf => V::some(a0?.clone()),
        Func::OptionalNone => V::Optional(None),
        Func::OptionalOfNonZeroValue => {
            let v = a0?;
            if v.is_zero() {
                V::Optional(None)
            } else {
                V::some(v.clone())
            }
        }
        Func::HasValue => match a0? {
            V::Optional(o) => V::Bool(o.is_some()),
            _ => return Err(no_overload()),
        },
        Func::Value => match a0? {
            V::Optional(Some(v)) => (**v).clone(),
            V::Optional(None) => return Err(Error::new("optional.none() dereference")),
            _ => return Err(no_overload()),
        },
        // Short-circuiting forms are evaluated by the evaluator; these handle
        // already-evaluated arguments.
        Func::Or => match (a0?, arg(1)?) {
            (V::Optional(Some(_)), _) => args[0].clone(),
            (V::Optional(None), V::Optional(_)) => args[1].clone(),
            _ => return Err(no_overload()),
        },
        Func::OrValue => match a0? {
            V::Optional(Some(v)) => (**v).clone(),
            V::Optional(None) => arg(1)?.clone(),
            _ => return Err(no_overload()),
        },
        Func::Quantity => {
            let s = str_arg(a0?).map_err(|_| no_overload())?;
            quantity_value(Quantity::parse(s).map_err(quantity_error)?)
        }
        Func::IsQuantity => V::Bool(Quantity::parse(str_arg(a0?).map_err(|_| no_overload())?).is_ok()),
        Func::Sign => V::Int(quantity_arg(a0?).map_err(|_| no_overload())?.sign()),
        Func::IsInteger => V::Bool(quantity_arg(a0?).map_err(|_| no_overload())?.as_integer().is_some()),
        Func::AsInteger => V::Int(
            quantity_arg(a0?)
                .map_err(|_| no_overload())?
                .as_integer()
                .ok_or_else(|| Error::new("cannot convert value to integer"))?,
        ),
        Func::AsApproximateFloat => V::Double(quantity_arg(a0?).map_err(|_| no_overload())?.as_approximate_float()),
        Func::Add | Func::Sub => {
            let q = quantity_arg(a0?).map_err(|_| no_overload())?;
            let other = match arg(1)? {
                V::Quantity(o) => **o,
                V::Int(i) => Quantity::from_units(*i, Format::DecimalExponent),
                _ => return Err(no_overload()),
            };
            let result = if func == Func::Add {
                q.checked_add(&other)
            } else {
                q.checked_sub(&other)
            };
            quantity_value(result.map_err(quantity_error)?)
        }
        Func::Mul => {
            let q = quantity_arg(a0?).map_err(|_| no_overload())?;
            let factor = int_arg(arg(1)?).map_err(|_| no_overload())?;
            quantity_value(q.checked_mul(factor).map_err(quantity_error)?)
        }
        Func::CompareTo => V::Int(ordering_int(compare_objects(a0?, arg(1)?).map_err(|_| no_overload())?)),
        Func::IsGreaterThan => V::Bool(compare_objects(a0?, arg(1)?).map_err(|_| no_overload())? == Ordering::Greater),
        Func::IsLessThan => V::Bool(compare_objects(a0?, arg(1)?).map_err(|_| no_overload())? == Ordering::Less),
        Func::Semver | Func::IsSemver => {
            let s = str_arg(a0?).map_err(|_| no_overload())?;
            let normalize = match args.get(1) {
                Some(n) => bool_arg(n).map_err(|_| no_overload())?,
                None => false,
            };
            let parsed = if normalize {
                Semver::parse_normalized(s)
            } else {
                Semver::parse(s)
            };
            match (func, parsed) {
                (Func::IsSemver, parsed) => V::Bool(parsed.is_ok()),
                (_, Ok(v)) => V::Semver(Rc::new(v)),
                (_, Err(e)) => return Err(Error::new(e)),
            }
        }
        Func::Timestamp => match a0? {
            V::Timestamp(t) => V::Timestamp(*t),
            V::Int(i) => V::Timestamp(Timestamp::from_unix(*i).map_err(time_error)?),
            V::String(s) => V::Timestamp(Timestamp::parse(s).map_err(time_error)?),
            _ => return Err(no_overload()),
        },
        Func::Duration => match a0? {
            V::Duration(d) => V::Duration(*d),
            V::String(s) => V::Duration(time::parse_duration(s).map_err(time_error)?),
            _ => return Err(no_overload()),
        },
        Func::GetFullYear
        | Func::GetMonth
        | Func::GetDayOfYear
        | Func::GetDayOfMonth
        | Func::GetDate
        | Func::GetDayOfWeek
        | Func::GetHours
        | Func::GetMinutes
        | Func::GetSeconds
        | Func::GetMilliseconds => match (a0?, args.get(1)) {
            (V::Duration(d), None) => V::Int(match func {
                Func::GetHours => time::duration_hours(*d),
                Func::GetMinutes => time::duration_minutes(*d),
                Func::GetSeconds => time::duration_seconds(*d),
                Func::GetMilliseconds => time::duration_milliseconds(*d),
                _ => return Err(no_overload()),
            }),
            (V::Timestamp(t), zone) => {
                // Without a zone argument the environment's default is UTC.
                let offset = match zone {
                    None => 0,
                    Some(V::String(z)) => time::zone_offset(t, z).map_err(time_error)?,
                    Some(_) => return Err(no_overload()),
                };
                let c = t.civil(offset);
                V::Int(match func {
                    Func::GetFullYear => c.year,
                    Func::GetMonth => c.month - 1,
                    Func::GetDayOfYear => c.year_day,
                    Func::GetDayOfMonth => c.day - 1,
                    Func::GetDate => c.day,
                    Func::GetDayOfWeek => c.week_day,
                    Func::GetHours => c.hour,
                    Func::GetMinutes => c.minute,
                    Func::GetSeconds => c.second,
                    _ => c.nanos / 1_000_000,
                })
            }
            _ => return Err(no_overload()),
        },
        Func::Ip => match a0? {
            V::String(s) => V::Ip(Ip::parse(s).map_err(net_error)?),
            V::Cidr(c) => V::Ip(c.ip),
            _ => return Err(no_overload()),
        },
        Func::IsIp => V::Bool(Ip::parse(str_arg(a0?).map_err(|_| no_overload())?).is_ok()),
        Func::IpIsCanonical => {
            let s = str_arg(a0?).map_err(|_| no_overload())?;
            V::Bool(Ip::parse(s).map_err(net_error)?.to_string() == s)
        }
        Func::Family
        | Func::IsUnspecified
        | Func::IsLoopback
        | Func::IsLinkLocalMulticast
        | Func::IsLinkLocalUnicast
        | Func::IsGlobalUnicast => {
            let V::Ip(ip) = a0? else {
                return Err(no_overload());
            };
            match func {
                Func::Family => V::Int(ip.family()),
                Func::IsUnspecified => V::Bool(ip.is_unspecified()),
                Func::IsLoopback => V::Bool(ip.is_loopback()),
                Func::IsLinkLocalMulticast => V::Bool(ip.is_link_local_multicast()),
                Func::IsLinkLocalUnicast => V::Bool(ip.is_link_local_unicast()),
                _ => V::Bool(ip.is_global_unicast()),
            }
        }
        Func::Cidr => V::Cidr(Cidr::parse(str_arg(a0?).map_err(|_| no_overload())?).map_err(net_error)?),
        Func::IsCidr => V::Bool(Cidr::parse(str_arg(a0?).map_err(|_| no_overload())?).is_ok()),
        Func::ContainsIp => match (a0?, arg(1)?) {
            (V::Cidr(c), V::Ip(ip)) => V::Bool(c.contains(ip)),
            // A string that is no address is "no such overload" upstream.
            (V::Cidr(c), V::String(s)) => V::Bool(c.contains(&Ip::parse(s).map_err(|_| no_overload())?)),
            _ => return Err(no_overload()),
        },
        Func::ContainsCidr => match (a0?, arg(1)?) {
            (V::Cidr(c), V::Cidr(other)) => V::Bool(c.contains_cidr(other)),
            (V::Cidr(c), V::String(s)) => V::Bool(c.contains_cidr(&Cidr::parse(s).map_err(net_error)?)),
            _ => return Err(no_overload()),
        },
        Func::PrefixLength => match a0? {
            V::Cidr(c) => V::Int(i64::from(c.bits)),
            _ => return Err(no_overload()),
        },
        Func::Masked => match a0? {
            V::Cidr(c) => V::Cidr(c.masked()),
            _ => return Err(no_overload()),
        },
        Func::Url => {
            let s = str_arg(a0?).map_err(|_| no_overload())?;
            budget.charge_text(char_count(s))?;
            V::Url(Rc::new(Url::from_string(s).map_err(|e| Error::new(e.to_string()))?))
        }
        Func::IsUrl => {
            let s = str_arg(a0?).map_err(|_| no_overload())?;
            budget.charge_text(s.len())?;
            V::Bool(url::parse_request_uri(s).is_ok())
        }
        Func::GetScheme | Func::GetHost | Func::GetHostname | Func::GetPort | Func::GetEscapedPath | Func::GetQuery => {
            let V::Url(u) = a0? else {
                return Err(no_overload());
            };
            match func {
                Func::GetScheme => V::owned_str(u.scheme()),
                Func::GetHost => go_string(u.host()),
                Func::GetHostname => go_string(u.hostname()),
                Func::GetPort => go_string(u.port()),
                Func::GetEscapedPath => V::owned_str(u.escaped_path()),
                _ => {
                    let query = u.query();
                    budget.charge(query.values().map(|v| v.len() as u64 + 1).sum())?;
                    let entries = query
                        .into_iter()
                        .map(|(k, vs)| (go_string(&k), V::list(vs.iter().map(|v| go_string(v)).collect())))
                        .collect();
                    V::Map(Rc::new(entries))
                }
            }
        }
        Func::FormatNamed => {
            let s = str_arg(a0?).map_err(|_| no_overload())?;
            V::Optional(NamedFormat::named(s).map(|f| Rc::new(V::Format(f))))
        }
        Func::FormatConstant(f) => V::Format(f),
        Func::Validate => {
            let (V::Format(f), V::String(s)) = (a0?, arg(1)?) else {
                return Err(no_overload());
            };
            budget.charge_text(s.len())?;
            let errors = f.validate(s);
            if errors.is_empty() {
                V::Optional(None)
            } else {
                V::some(V::list(errors.into_iter().map(V::owned_str).collect()))
            }
        }
        Func::Major | Func::Minor | Func::Patch => match a0? {
            // Components wrap like Go's int64(uint64) conversion.
            V::Semver(v) => V::Int(match func {
                Func::Major => v.major,
                Func::Minor => v.minor,
                _ => v.patch,
            } as i64),
            _ => return Err(no_overload()),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ascii_classes_like_re2() {
        let re = compile_regex(r"^\d+$").unwrap();
        assert!(re.is_match("123"));
        assert!(!re.is_match("١٢٣"), "Arabic-Indic digits are not \\d in RE2");
        let re = compile_regex(r"^[\w.-]+$").unwrap();
        assert!(re.is_match("a_b.c-d"));
        assert!(!re.is_match("é"));
        assert!(compile_regex(r"^[[:alpha:]]+$").unwrap().is_match("abc"));
        assert!(compile_regex(r"[]a]").unwrap().is_match("]"));
        assert!(compile_regex(r"[^]a]").unwrap().is_match("b"));
        assert!(compile_regex(r"\bfoo\b").unwrap().is_match("a foo b"));
        assert!(compile_regex("(").is_err());
    }

    #[test]
    fn go_replace_and_split() {
        let mut budget = Budget {
            used: 0,
            limit: u64::MAX,
        };
        assert_eq!(replace("aaa", "a", "b", 2, &mut budget).unwrap(), "bba");
        assert_eq!(replace("abc", "", "-", -1, &mut budget).unwrap(), "-a-b-c-");
        assert_eq!(replace("abc", "", "-", 2, &mut budget).unwrap(), "-a-bc");
        assert_eq!(replace("abc", "x", "-", -1, &mut budget).unwrap(), "abc");
        let pieces = |v: Value<'_>| match v {
            Value::List(l) => l.iter().map(|x| x.display_key()).collect::<Vec<_>>(),
            _ => panic!(),
        };
        assert_eq!(pieces(split("a,b,c", ",", 2, &mut budget).unwrap()), ["a", "b,c"]);
        assert_eq!(pieces(split("abc", "", -1, &mut budget).unwrap()), ["a", "b", "c"]);
        assert_eq!(pieces(split("abc", "", 2, &mut budget).unwrap()), ["a", "bc"]);
        assert!(pieces(split("abc", ",", 0, &mut budget).unwrap()).is_empty());
        assert_eq!(pieces(split("", ",", -1, &mut budget).unwrap()), [""]);
    }
}
