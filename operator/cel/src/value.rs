//! Runtime values. Values borrow from the program and the device where they can, so
//! that evaluating a simple selector allocates nothing.

use std::cmp::Ordering;
use std::fmt;
use std::ops::Deref;
use std::rc::Rc;

use crate::device::{AttributeValue, qualify};
use crate::quantity::Quantity;

use crate::DeviceView;
use crate::format::NamedFormat;
use crate::net::{Cidr, Ip};
use crate::semver::Semver;
use crate::time::Timestamp;
use crate::url::Url;

/// Borrowed from the program or the device, or owned by this evaluation.
pub(crate) enum Shared<'a, T: ?Sized> {
    Borrowed(&'a T),
    Owned(Rc<T>),
}

impl<T: ?Sized> Clone for Shared<'_, T> {
    fn clone(&self) -> Self {
        match self {
            Shared::Borrowed(r) => Shared::Borrowed(r),
            Shared::Owned(rc) => Shared::Owned(Rc::clone(rc)),
        }
    }
}

impl<T: ?Sized> Deref for Shared<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            Shared::Borrowed(r) => r,
            Shared::Owned(rc) => rc,
        }
    }
}

/// The two per-device tables exposed as `map(domain, map(id, value))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Table {
    Attributes,
    Capacity,
}

/// Type values, as `type(x)` returns them and as the type identifiers denote them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TypeName {
    Null,
    Bool,
    Int,
    Uint,
    Double,
    String,
    Bytes,
    List,
    Map,
    Type,
    Optional,
    Quantity,
    Semver,
    Device,
    Timestamp,
    Duration,
    Url,
    Format,
    Ip,
    Cidr,
}

impl TypeName {
    pub(crate) fn name(self) -> &'static str {
        match self {
            TypeName::Null => "null_type",
            TypeName::Bool => "bool",
            TypeName::Int => "int",
            TypeName::Uint => "uint",
            TypeName::Double => "double",
            TypeName::String => "string",
            TypeName::Bytes => "bytes",
            TypeName::List => "list",
            TypeName::Map => "map",
            TypeName::Type => "type",
            TypeName::Optional => "optional_type",
            TypeName::Quantity => "kubernetes.Quantity",
            TypeName::Semver => "kubernetes.Semver",
            TypeName::Device => "kubernetes.DRADevice",
            TypeName::Timestamp => "google.protobuf.Timestamp",
            TypeName::Duration => "google.protobuf.Duration",
            TypeName::Url => "kubernetes.URL",
            TypeName::Format => "kubernetes.NamedFormat",
            TypeName::Ip => "net.IP",
            TypeName::Cidr => "net.CIDR",
        }
    }
}

impl fmt::Display for TypeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A runtime error. Fatal errors (cost limit) are never absorbed by `&&`, `||` or
/// comprehensions.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Error {
    pub message: String,
    pub fatal: bool,
}

impl Error {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        Error {
            message: message.into(),
            fatal: false,
        }
    }

    pub(crate) fn no_overload() -> Self {
        Error::new("no such overload")
    }

    pub(crate) fn no_overload_for(function: &str, args: &[&Value<'_>]) -> Self {
        let types: Vec<&str> = args.iter().map(|v| v.type_name().name()).collect();
        Error::new(format!("no such overload: {function}({})", types.join(", ")))
    }

    pub(crate) fn no_such_key(key: &Value<'_>) -> Self {
        Error::new(format!("no such key: {}", key.display_key()))
    }
}

pub(crate) type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) type MapEntries<'a> = Vec<(Value<'a>, Value<'a>)>;

#[derive(Clone)]
pub(crate) enum Value<'a> {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Double(f64),
    String(Shared<'a, str>),
    Bytes(Shared<'a, [u8]>),
    List(Rc<[Value<'a>]>),
    /// A map literal or computed map, in insertion order; keys are unique.
    Map(Rc<MapEntries<'a>>),
    Optional(Option<Rc<Value<'a>>>),
    Type(TypeName),
    Quantity(Shared<'a, Quantity>),
    Semver(Rc<Semver>),
    Timestamp(Timestamp),
    /// Nanoseconds, as Go's `time.Duration`.
    Duration(i64),
    Ip(Ip),
    Cidr(Cidr),
    Url(Rc<Url>),
    Format(NamedFormat),
    /// The `device` variable.
    Device(&'a DeviceView<'a>),
    /// `device.attributes` or `device.capacity`: every domain maps to a (maybe empty) map.
    Domains(&'a DeviceView<'a>, Table),
    /// `device.attributes[domain]`: a lazy view onto the device's tables.
    Domain(&'a DeviceView<'a>, Table, Shared<'a, str>),
}

impl<'a> Value<'a> {
    pub(crate) fn str(s: &'a str) -> Self {
        Value::String(Shared::Borrowed(s))
    }

    pub(crate) fn owned_str(s: impl Into<Rc<str>>) -> Self {
        Value::String(Shared::Owned(s.into()))
    }

    pub(crate) fn list(items: Vec<Value<'a>>) -> Self {
        Value::List(items.into())
    }

    pub(crate) fn some(v: Value<'a>) -> Self {
        Value::Optional(Some(Rc::new(v)))
    }

    pub(crate) fn type_name(&self) -> TypeName {
        match self {
            Value::Null => TypeName::Null,
            Value::Bool(_) => TypeName::Bool,
            Value::Int(_) => TypeName::Int,
            Value::Uint(_) => TypeName::Uint,
            Value::Double(_) => TypeName::Double,
            Value::String(_) => TypeName::String,
            Value::Bytes(_) => TypeName::Bytes,
            Value::List(_) => TypeName::List,
            Value::Map(_) | Value::Domains(..) | Value::Domain(..) => TypeName::Map,
            Value::Optional(_) => TypeName::Optional,
            Value::Type(_) => TypeName::Type,
            Value::Quantity(_) => TypeName::Quantity,
            Value::Semver(_) => TypeName::Semver,
            Value::Timestamp(_) => TypeName::Timestamp,
            Value::Duration(_) => TypeName::Duration,
            Value::Ip(_) => TypeName::Ip,
            Value::Cidr(_) => TypeName::Cidr,
            Value::Url(_) => TypeName::Url,
            Value::Format(_) => TypeName::Format,
            Value::Device(_) => TypeName::Device,
        }
    }

    /// How a key appears in `no such key` messages.
    pub(crate) fn display_key(&self) -> String {
        match self {
            Value::String(s) => s.to_string(),
            Value::Int(i) => i.to_string(),
            Value::Uint(u) => u.to_string(),
            Value::Bool(b) => b.to_string(),
            Value::Double(d) => format_double(*d),
            other => other.type_name().name().to_string(),
        }
    }

    /// The zero value test behind `optional.ofNonZeroValue`.
    pub(crate) fn is_zero(&self) -> bool {
        match self {
            Value::Null => true,
            Value::Bool(b) => !b,
            Value::Int(i) => *i == 0,
            Value::Uint(u) => *u == 0,
            Value::Double(d) => *d == 0.0,
            Value::String(s) => s.is_empty(),
            Value::Bytes(b) => b.is_empty(),
            Value::List(l) => l.is_empty(),
            Value::Map(m) => m.is_empty(),
            Value::Domain(..) | Value::Domains(..) => self.map_len() == 0,
            Value::Timestamp(t) => t.is_zero(),
            Value::Duration(d) => *d == 0,
            _ => false,
        }
    }

    pub(crate) fn is_map(&self) -> bool {
        matches!(self, Value::Map(_) | Value::Domains(..) | Value::Domain(..))
    }

    /// Number of entries of a map value.
    pub(crate) fn map_len(&self) -> usize {
        match self {
            Value::Map(m) => m.len(),
            Value::Domains(dev, table) => domains(dev, *table).len(),
            Value::Domain(dev, table, domain) => domain_ids(dev, *table, domain).len(),
            _ => 0,
        }
    }

    /// Looks a key up in a map value: `Ok(None)` when absent, an error when the
    /// attribute exists but cannot be represented (an invalid version string).
    pub(crate) fn map_get(&self, key: &Value<'a>) -> Result<Option<Value<'a>>> {
        match self {
            Value::Map(entries) => Ok(entries.iter().find(|(k, _)| key_eq(k, key)).map(|(_, v)| v.clone())),
            // Upstream wraps this map so that any lookup succeeds with an empty map.
            Value::Domains(dev, table) => Ok(Some(match key {
                Value::String(domain) => Value::Domain(dev, *table, domain.clone()),
                _ => Value::Map(Rc::new(Vec::new())),
            })),
            Value::Domain(dev, table, domain) => match key {
                Value::String(id) => lookup(dev, *table, domain, id),
                _ => Ok(None),
            },
            _ => Ok(None),
        }
    }

    /// Whether a map value has `key`, without converting the entry's value.
    pub(crate) fn map_contains(&self, key: &Value<'a>) -> Result<bool> {
        match (self, key) {
            (Value::Map(entries), _) => Ok(entries.iter().any(|(k, _)| key_eq(k, key))),
            (Value::Domains(dev, table), Value::String(domain)) => {
                Ok(names(dev, *table).any(|n| qualify(n, dev.driver).0 == &**domain))
            }
            (Value::Domain(dev, table, domain), Value::String(id)) => Ok(match table {
                Table::Attributes => attribute(dev, domain, id).is_some(),
                Table::Capacity => capacity(dev, domain, id).is_some(),
            }),
            (Value::Domains(..) | Value::Domain(..), _) => Ok(false),
            _ => Err(Error::no_overload()),
        }
    }

    /// Cost of one key lookup: computed maps are scanned linearly.
    pub(crate) fn lookup_cost(&self) -> u64 {
        match self {
            Value::Map(entries) => entries.len() as u64 / 16,
            _ => 0,
        }
    }

    /// Keys of a map value, in a stable order.
    pub(crate) fn map_keys(&self) -> Vec<Value<'a>> {
        match self {
            Value::Map(entries) => entries.iter().map(|(k, _)| k.clone()).collect(),
            Value::Domains(dev, table) => domains(dev, *table).into_iter().map(Value::str).collect(),
            Value::Domain(dev, table, domain) => domain_ids(dev, *table, domain).into_iter().map(Value::str).collect(),
            _ => Vec::new(),
        }
    }

    /// Entries of a map value, in the order of [`Value::map_keys`].
    pub(crate) fn map_entries(&self) -> Result<MapEntries<'a>> {
        match self {
            Value::Map(entries) => Ok(entries.as_ref().clone()),
            _ => {
                let mut out = Vec::new();
                for key in self.map_keys() {
                    let value = self.map_get(&key)?.unwrap_or(Value::Null);
                    out.push((key, value));
                }
                Ok(out)
            }
        }
    }
}

/// Map keys: cel-go keeps its maps as Go maps, which take any hashable value (doubles
/// and null too, and URLs, which hash as their pointer); lists, maps and bytes are not
/// hashable.
pub(crate) fn check_key(key: &Value<'_>) -> Result<()> {
    match key {
        Value::Url(_)
        | Value::Int(_)
        | Value::Uint(_)
        | Value::Bool(_)
        | Value::String(_)
        | Value::Double(_)
        | Value::Null
        | Value::Timestamp(_)
        | Value::Duration(_) => Ok(()),
        other => Err(Error::new(format!("unsupported map key type: {}", other.type_name()))),
    }
}

/// Key equality: like `==`, so `1`, `1u` and `1.0` find the same entry; a URL key is
/// its Go pointer, so only the same URL value finds it.
pub(crate) fn key_eq(a: &Value<'_>, b: &Value<'_>) -> bool {
    match (a, b) {
        (Value::Url(x), Value::Url(y)) => Rc::ptr_eq(x, y),
        _ => equals(a, b),
    }
}

fn with_qualified<R>(domain: &str, id: &str, f: impl FnOnce(&str) -> R) -> R {
    // Qualified names are short (domain <= 63, id <= 32); join them without allocating.
    let len = domain.len() + 1 + id.len();
    let mut buf = [0u8; 128];
    if len <= buf.len() {
        buf[..domain.len()].copy_from_slice(domain.as_bytes());
        buf[domain.len()] = b'/';
        buf[domain.len() + 1..len].copy_from_slice(id.as_bytes());
        if let Ok(joined) = std::str::from_utf8(&buf[..len]) {
            return f(joined);
        }
    }
    f(&format!("{domain}/{id}"))
}

/// Finds `domain`/`id` in one of the device's tables, honouring bare names of the
/// driver's own domain.
fn find<'a, V: ?Sized + 'a>(
    get: impl Fn(&str) -> Option<&'a V>,
    driver: &str,
    domain: &str,
    id: &str,
) -> Option<&'a V> {
    if domain == driver
        && !id.contains('/')
        && let Some(v) = get(id)
    {
        return Some(v);
    }
    if domain.contains('/') || domain.is_empty() {
        return None;
    }
    with_qualified(domain, id, get)
}

fn attribute<'a>(dev: &DeviceView<'a>, domain: &str, id: &str) -> Option<&'a AttributeValue> {
    let attributes = dev.attributes;
    find(|name| attributes.get(name), dev.driver, domain, id)
}

fn capacity<'a>(dev: &DeviceView<'a>, domain: &str, id: &str) -> Option<&'a Quantity> {
    let capacity = dev.capacity;
    find(|name| capacity.quantity(name), dev.driver, domain, id)
}

fn lookup<'a>(dev: &'a DeviceView<'a>, table: Table, domain: &str, id: &str) -> Result<Option<Value<'a>>> {
    match table {
        Table::Attributes => match attribute(dev, domain, id) {
            None => Ok(None),
            Some(value) => attribute_value(value).map(Some),
        },
        Table::Capacity => Ok(capacity(dev, domain, id).map(|q| Value::Quantity(Shared::Borrowed(q)))),
    }
}

fn attribute_value(value: &AttributeValue) -> Result<Value<'_>> {
    Ok(match value {
        AttributeValue::Int(i) => Value::Int(*i),
        AttributeValue::Bool(b) => Value::Bool(*b),
        AttributeValue::String(s) => Value::str(s),
        AttributeValue::Version(v) => Value::Semver(Rc::new(
            Semver::parse(v).map_err(|e| Error::new(format!("parse semantic version: {e}")))?,
        )),
    })
}

fn names<'a>(dev: &'a DeviceView<'a>, table: Table) -> Box<dyn Iterator<Item = &'a str> + 'a> {
    match table {
        Table::Attributes => Box::new(dev.attributes.keys().map(String::as_str)),
        Table::Capacity => dev.capacity.names(),
    }
}

/// The distinct domains of a table, sorted.
fn domains<'a>(dev: &'a DeviceView<'a>, table: Table) -> Vec<&'a str> {
    let mut out: Vec<&str> = names(dev, table).map(|n| qualify(n, dev.driver).0).collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// The distinct ids of one domain, sorted.
fn domain_ids<'a>(dev: &'a DeviceView<'a>, table: Table, domain: &str) -> Vec<&'a str> {
    let mut out: Vec<&str> = names(dev, table)
        .filter_map(|n| {
            let (d, id) = qualify(n, dev.driver);
            (d == domain).then_some(id)
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Heterogeneous equality: values of different kinds are unequal, numbers compare by
/// value across int, uint and double.
pub(crate) fn equals(a: &Value<'_>, b: &Value<'_>) -> bool {
    use Value as V;
    match (a, b) {
        (V::Null, V::Null) => true,
        (V::Bool(x), V::Bool(y)) => x == y,
        (V::Int(_) | V::Uint(_) | V::Double(_), V::Int(_) | V::Uint(_) | V::Double(_)) => numbers_equal(a, b),
        (V::String(x), V::String(y)) => **x == **y,
        (V::Bytes(x), V::Bytes(y)) => **x == **y,
        (V::List(x), V::List(y)) => x.len() == y.len() && x.iter().zip(y.iter()).all(|(p, q)| equals(p, q)),
        (V::Optional(x), V::Optional(y)) => match (x, y) {
            (None, None) => true,
            (Some(p), Some(q)) => equals(p, q),
            _ => false,
        },
        (V::Type(x), V::Type(y)) => x == y,
        (V::Quantity(x), V::Quantity(y)) => **x == **y,
        (V::Semver(x), V::Semver(y)) => x.cmp(y) == Ordering::Equal,
        (V::Timestamp(x), V::Timestamp(y)) => x == y,
        (V::Duration(x), V::Duration(y)) => x == y,
        (V::Ip(x), V::Ip(y)) => x == y,
        (V::Cidr(x), V::Cidr(y)) => x == y,
        // The URL library compares URLs as Go prints them.
        (V::Url(x), V::Url(y)) => x.to_go_string() == y.to_go_string(),
        (V::Format(x), V::Format(y)) => x == y,
        (V::Device(x), V::Device(y)) => std::ptr::eq(*x, *y),
        (x, y) if x.is_map() && y.is_map() => {
            if x.map_len() != y.map_len() {
                return false;
            }
            for key in x.map_keys() {
                match (x.map_get(&key), y.map_get(&key)) {
                    (Ok(Some(p)), Ok(Some(q))) if equals(&p, &q) => {}
                    _ => return false,
                }
            }
            true
        }
        _ => false,
    }
}

fn cmp_f64(a: f64, b: f64) -> Ordering {
    if a < b {
        Ordering::Less
    } else if a > b {
        Ordering::Greater
    } else {
        Ordering::Equal
    }
}

/// cel-go's cross-type comparisons: a double is compared with an integer converted to
/// a double, after range checks; a negative int is below every uint.
fn double_int(d: f64, i: i64) -> Ordering {
    if d < i64::MIN as f64 {
        Ordering::Less
    } else if d > i64::MAX as f64 {
        Ordering::Greater
    } else {
        cmp_f64(d, i as f64)
    }
}

fn double_uint(d: f64, u: u64) -> Ordering {
    if d < 0.0 {
        Ordering::Less
    } else if d > u64::MAX as f64 {
        Ordering::Greater
    } else {
        cmp_f64(d, u as f64)
    }
}

fn int_uint(i: i64, u: u64) -> Ordering {
    match i64::try_from(u) {
        Ok(u) if i >= 0 => i.cmp(&u),
        _ => Ordering::Less,
    }
}

/// Ordering of two numbers of any numeric kind, as cel-go orders them; `None` when
/// cel-go refuses (a NaN receiver, or two doubles one of which is NaN) or a value is
/// not a number.
pub(crate) fn compare_numbers(a: &Value<'_>, b: &Value<'_>) -> Option<Ordering> {
    use Value as V;
    match (a, b) {
        (V::Double(x), _) if x.is_nan() => None,
        (V::Double(_), V::Double(y)) if y.is_nan() => None,
        (V::Int(x), V::Int(y)) => Some(x.cmp(y)),
        (V::Uint(x), V::Uint(y)) => Some(x.cmp(y)),
        (V::Double(x), V::Double(y)) => Some(cmp_f64(*x, *y)),
        (V::Int(x), V::Uint(y)) => Some(int_uint(*x, *y)),
        (V::Uint(x), V::Int(y)) => Some(int_uint(*y, *x).reverse()),
        (V::Double(x), V::Int(y)) => Some(double_int(*x, *y)),
        (V::Int(x), V::Double(y)) => Some(double_int(*y, *x).reverse()),
        (V::Double(x), V::Uint(y)) => Some(double_uint(*x, *y)),
        (V::Uint(x), V::Double(y)) => Some(double_uint(*y, *x).reverse()),
        _ => None,
    }
}

/// Numeric equality as cel-go's `Equal` methods: a NaN double equals nothing, but an
/// integer compared with NaN finds them "equal" (its comparison does not check).
fn numbers_equal(a: &Value<'_>, b: &Value<'_>) -> bool {
    use Value as V;
    match (a, b) {
        (V::Double(x), _) if x.is_nan() => false,
        (V::Double(_), V::Double(y)) if y.is_nan() => false,
        (V::Int(_) | V::Uint(_), V::Double(y)) if y.is_nan() => true,
        _ => compare_numbers(a, b) == Some(Ordering::Equal),
    }
}

/// Ordering for `<`, `<=`, `>`, `>=`.
pub(crate) fn compare(a: &Value<'_>, b: &Value<'_>) -> Result<Ordering> {
    use Value as V;
    match (a, b) {
        (V::Int(_) | V::Uint(_) | V::Double(_), V::Int(_) | V::Uint(_) | V::Double(_)) => {
            compare_numbers(a, b).ok_or_else(|| Error::new("NaN values cannot be ordered"))
        }
        (V::String(x), V::String(y)) => Ok(x.as_bytes().cmp(y.as_bytes())),
        (V::Bool(x), V::Bool(y)) => Ok(x.cmp(y)),
        (V::Bytes(x), V::Bytes(y)) => Ok(x.as_ref().cmp(y.as_ref())),
        (V::Timestamp(x), V::Timestamp(y)) => Ok(x.cmp(y)),
        (V::Duration(x), V::Duration(y)) => Ok(x.cmp(y)),
        _ => Err(Error::no_overload()),
    }
}

/// Formats a double as Go's `%g` verb does (shortest digits, exponent from 1e+06).
pub(crate) fn format_double(d: f64) -> String {
    if d.is_nan() {
        return "NaN".into();
    }
    if d.is_infinite() {
        return if d > 0.0 { "+Inf".into() } else { "-Inf".into() };
    }
    if d == 0.0 {
        return if d.is_sign_negative() { "-0".into() } else { "0".into() };
    }
    // Shortest round-trip digits and decimal exponent, from Rust's `{:e}`.
    let sci = format!("{:e}", d.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if d < 0.0 { "-" } else { "" };
    if !(-4..6).contains(&exp) {
        let mut out = String::from(sign);
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let esign = if exp < 0 { '-' } else { '+' };
        out.push_str(&format!("e{esign}{:02}", exp.abs()));
        return out;
    }
    let mut out = String::from(sign);
    if exp < 0 {
        out.push_str("0.");
        for _ in 0..(-exp - 1) {
            out.push('0');
        }
        out.push_str(&digits);
    } else {
        let int_len = exp as usize + 1;
        if digits.len() <= int_len {
            out.push_str(&digits);
            for _ in digits.len()..int_len {
                out.push('0');
            }
        } else {
            out.push_str(&digits[..int_len]);
            out.push('.');
            out.push_str(&digits[int_len..]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_style_doubles() {
        for (d, s) in [
            (1.0, "1"),
            (1.5, "1.5"),
            (100000.0, "100000"),
            (123456.0, "123456"),
            (1e6, "1e+06"),
            (1e21, "1e+21"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5, "-2.5"),
            (123456789.0, "1.23456789e+08"),
            (f64::INFINITY, "+Inf"),
        ] {
            assert_eq!(format_double(d), s, "{d}");
        }
    }

    #[test]
    fn exact_numeric_comparison() {
        // As cel-go: the int is converted to a double, which rounds it to 2^63.
        let big = Value::Int(i64::MAX);
        assert_eq!(
            compare_numbers(&big, &Value::Double(9_223_372_036_854_775_808.0)),
            Some(Ordering::Equal)
        );
        assert_eq!(
            compare_numbers(&Value::Uint(u64::MAX), &Value::Int(-1)),
            Some(Ordering::Greater)
        );
        assert_eq!(
            compare_numbers(&Value::Double(1.5), &Value::Int(1)),
            Some(Ordering::Greater)
        );
        assert_eq!(
            compare_numbers(&Value::Double(-1.5), &Value::Int(-1)),
            Some(Ordering::Less)
        );
        assert_eq!(compare_numbers(&Value::Double(f64::NAN), &Value::Int(1)), None);
        assert!(equals(&Value::Int(1), &Value::Double(1.0)));
        assert!(!equals(&Value::Int(1), &Value::str("1")));
    }
}
