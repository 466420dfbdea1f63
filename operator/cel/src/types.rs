//! Static types and their unification, as cel-go's checker computes them: type
//! parameters are bound through a substitution map, `dyn` (and `google.protobuf.Any`,
//! the declared type of device attributes) is assignable to and from everything.

use std::collections::HashMap;
use std::fmt;

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) enum Type {
    Error,
    #[default]
    Dyn,
    /// `google.protobuf.Any`: what Kubernetes declares device attribute values as.
    Any,
    Null,
    Bool,
    Int,
    Uint,
    Double,
    String,
    Bytes,
    Timestamp,
    Duration,
    List(Box<Type>),
    Map(Box<Type>, Box<Type>),
    /// `optional_type(T)`, `net.IP`, `net.CIDR`.
    Opaque(&'static str, Vec<Type>),
    /// Object types: `kubernetes.Quantity`, `kubernetes.Semver`, `kubernetes.URL`,
    /// `kubernetes.NamedFormat`, `kubernetes.DRADevice`.
    Struct(&'static str),
    /// `type(T)`, the type of type values; a bare `type` has no parameter.
    Kind(Option<Box<Type>>),
    Param(String),
}

pub(crate) const OPTIONAL: &str = "optional_type";
pub(crate) const QUANTITY: &str = "kubernetes.Quantity";
pub(crate) const SEMVER: &str = "kubernetes.Semver";
pub(crate) const URL: &str = "kubernetes.URL";
pub(crate) const FORMAT: &str = "kubernetes.NamedFormat";
pub(crate) const DEVICE: &str = "kubernetes.DRADevice";
pub(crate) const IP: &str = "net.IP";
pub(crate) const CIDR: &str = "net.CIDR";

impl Type {
    pub(crate) fn list(elem: Type) -> Type {
        Type::List(Box::new(elem))
    }

    pub(crate) fn map(key: Type, value: Type) -> Type {
        Type::Map(Box::new(key), Box::new(value))
    }

    pub(crate) fn optional(inner: Type) -> Type {
        Type::Opaque(OPTIONAL, vec![inner])
    }

    pub(crate) fn type_of(t: Type) -> Type {
        Type::Kind(Some(Box::new(t)))
    }

    /// `dyn` and `any` accept every value (cel-go's `isDyn`).
    pub(crate) fn is_dyn(&self) -> bool {
        matches!(self, Type::Dyn | Type::Any)
    }

    pub(crate) fn is_dyn_or_error(&self) -> bool {
        matches!(self, Type::Dyn | Type::Any | Type::Error)
    }

    pub(crate) fn optional_inner(&self) -> Option<&Type> {
        match self {
            Type::Opaque(OPTIONAL, params) => params.first(),
            _ => None,
        }
    }

    fn params(&self) -> Vec<&Type> {
        match self {
            Type::List(e) => vec![e],
            Type::Map(k, v) => vec![k, v],
            Type::Opaque(_, p) => p.iter().collect(),
            Type::Kind(Some(t)) => vec![t],
            _ => Vec::new(),
        }
    }

    /// Same kind, for the checks that compare kinds only.
    fn same_kind(&self, other: &Type) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }

    /// Types sized at one unit by the cost estimator (cel-go's `isScalar`).
    pub(crate) fn is_scalar(&self) -> bool {
        match self {
            Type::Bool | Type::Double | Type::Duration | Type::Int | Type::Timestamp | Type::Uint => true,
            Type::Opaque(OPTIONAL, p) => p.first().is_some_and(Type::is_scalar),
            _ => false,
        }
    }

    /// Equal up to the names of type parameters (cel-go's `IsEquivalentType`).
    pub(crate) fn equivalent(&self, other: &Type) -> bool {
        match (self, other) {
            (Type::Param(_), Type::Param(_)) => true,
            (Type::List(a), Type::List(b)) => a.equivalent(b),
            (Type::Map(a, b), Type::Map(c, d)) => a.equivalent(c) && b.equivalent(d),
            (Type::Opaque(a, p), Type::Opaque(b, q)) => {
                a == b && p.len() == q.len() && p.iter().zip(q).all(|(x, y)| x.equivalent(y))
            }
            (Type::Kind(Some(a)), Type::Kind(Some(b))) => a.equivalent(b),
            (a, b) => a == b,
        }
    }
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Type::Error => f.write_str("*error*"),
            Type::Dyn => f.write_str("dyn"),
            Type::Any => f.write_str("any"),
            Type::Null => f.write_str("null_type"),
            Type::Bool => f.write_str("bool"),
            Type::Int => f.write_str("int"),
            Type::Uint => f.write_str("uint"),
            Type::Double => f.write_str("double"),
            Type::String => f.write_str("string"),
            Type::Bytes => f.write_str("bytes"),
            Type::Timestamp => f.write_str("google.protobuf.Timestamp"),
            Type::Duration => f.write_str("google.protobuf.Duration"),
            Type::List(e) => write!(f, "list({e})"),
            Type::Map(k, v) => write!(f, "map({k}, {v})"),
            Type::Opaque(name, params) if params.is_empty() => f.write_str(name),
            Type::Opaque(name, params) => {
                write!(f, "{name}(")?;
                for (i, p) in params.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{p}")?;
                }
                f.write_str(")")
            }
            Type::Struct(name) => f.write_str(name),
            Type::Kind(None) => f.write_str("type"),
            Type::Kind(Some(t)) => write!(f, "type({t})"),
            Type::Param(name) => f.write_str(name),
        }
    }
}

/// Type parameter bindings.
#[derive(Clone, Debug, Default)]
pub(crate) struct Mapping {
    subs: HashMap<String, Type>,
}

impl Mapping {
    fn find(&self, t: &Type) -> Option<&Type> {
        match t {
            Type::Param(name) => self.subs.get(name),
            _ => None,
        }
    }

    fn add(&mut self, param: &Type, t: Type) {
        if let Type::Param(name) = param {
            self.subs.insert(name.clone(), t);
        }
    }

    /// Whether `t2` can take values of `t1`; binds type parameters on success.
    pub(crate) fn assignable(&mut self, t1: &Type, t2: &Type) -> bool {
        let mut copy = self.clone();
        if copy.internal_assignable(t1, t2) {
            *self = copy;
            true
        } else {
            false
        }
    }

    pub(crate) fn assignable_list(&mut self, l1: &[Type], l2: &[Type]) -> bool {
        let mut copy = self.clone();
        if l1.len() == l2.len() && l1.iter().zip(l2).all(|(a, b)| copy.internal_assignable(a, b)) {
            *self = copy;
            true
        } else {
            false
        }
    }

    fn internal_assignable(&mut self, t1: &Type, t2: &Type) -> bool {
        if matches!(t2, Type::Param(_)) {
            let (valid, has_sub) = self.valid_substitution(t1, t2);
            if valid {
                return true;
            }
            if has_sub {
                return false;
            }
        }
        if matches!(t1, Type::Param(_)) {
            return self.valid_substitution(t2, t1).0;
        }
        if t1.is_dyn_or_error() || t2.is_dyn_or_error() {
            return true;
        }
        if matches!(t1, Type::Null) {
            return nullable(t2);
        }
        if matches!(t2, Type::Null) {
            return nullable(t1);
        }
        match t1 {
            Type::Kind(_) => matches!(t2, Type::Kind(_)),
            Type::List(_) | Type::Map(..) | Type::Opaque(..) => {
                let same_name = match (t1, t2) {
                    (Type::Opaque(a, _), Type::Opaque(b, _)) => a == b,
                    _ => t1.same_kind(t2),
                };
                let (p1, p2) = (t1.params(), t2.params());
                same_name
                    && p1.len() == p2.len()
                    && p1.iter().zip(p2.iter()).all(|(a, b)| self.internal_assignable(a, b))
            }
            _ => t1 == t2,
        }
    }

    fn valid_substitution(&mut self, t1: &Type, t2: &Type) -> (bool, bool) {
        if t1 == t2 {
            return (true, true);
        }
        if let Some(sub) = self.find(t2).cloned() {
            if *t1 == sub {
                return (true, true);
            }
            if self.internal_assignable(t1, &sub) {
                let general = most_general(t1, &sub);
                if self.not_referenced_in(t2, &general) {
                    self.add(t2, general);
                }
                return (true, true);
            }
            return (false, true);
        }
        if self.not_referenced_in(t2, t1) {
            self.add(t2, t1.clone());
            return (true, false);
        }
        (false, false)
    }

    fn not_referenced_in(&self, t: &Type, within: &Type) -> bool {
        if t == within {
            return false;
        }
        match within {
            Type::Param(_) => match self.find(within) {
                None => true,
                Some(sub) => self.not_referenced_in(t, sub),
            },
            Type::List(_) | Type::Map(..) | Type::Opaque(..) | Type::Kind(_) => {
                within.params().iter().all(|p| self.not_referenced_in(t, p))
            }
            _ => true,
        }
    }

    /// Applies the bindings; unbound parameters become `dyn` when `to_dyn`.
    pub(crate) fn substitute(&self, t: &Type, to_dyn: bool) -> Type {
        if let Some(sub) = self.find(t) {
            return self.substitute(sub, to_dyn);
        }
        match t {
            Type::Param(_) if to_dyn => Type::Dyn,
            Type::List(e) => Type::list(self.substitute(e, to_dyn)),
            Type::Map(k, v) => Type::map(self.substitute(k, to_dyn), self.substitute(v, to_dyn)),
            Type::Opaque(name, params) => {
                Type::Opaque(name, params.iter().map(|p| self.substitute(p, to_dyn)).collect())
            }
            Type::Kind(Some(p)) => Type::type_of(self.substitute(p, to_dyn)),
            other => other.clone(),
        }
    }
}

fn nullable(t: &Type) -> bool {
    matches!(
        t,
        Type::Opaque(..) | Type::Struct(_) | Type::Any | Type::Duration | Type::Timestamp | Type::Null
    )
}

fn less_specific(t1: &Type, t2: &Type) -> bool {
    if t1.is_dyn() || matches!(t1, Type::Param(_)) {
        return true;
    }
    if t2.is_dyn() || matches!(t2, Type::Param(_)) {
        return false;
    }
    match (t1, t2) {
        (Type::Opaque(a, p), Type::Opaque(b, q)) => {
            a == b && p.len() == q.len() && p.iter().zip(q).all(|(x, y)| less_specific(x, y))
        }
        (Type::List(a), Type::List(b)) => less_specific(a, b),
        (Type::Map(a, b), Type::Map(c, d)) => less_specific(a, c) && less_specific(b, d),
        (Type::Kind(_), Type::Kind(_)) => true,
        (a, b) => a == b,
    }
}

pub(crate) fn most_general(t1: &Type, t2: &Type) -> Type {
    if less_specific(t1, t2) { t1.clone() } else { t2.clone() }
}

/// Parses the compact signatures of the declaration table: `int`, `list(A)`,
/// `map(K, V)`, `optional(T)`, single capital letters for type parameters.
pub(crate) fn parse(text: &str) -> Type {
    let text = text.trim();
    if let Some(open) = text.find('(') {
        let name = &text[..open];
        let inner = &text[open + 1..text.len() - 1];
        let mut parts = Vec::new();
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(parse(&inner[start..i]));
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(parse(&inner[start..]));
        let mut parts = parts.into_iter();
        let mut next = || parts.next().unwrap_or(Type::Dyn);
        return match name {
            "list" => Type::list(next()),
            "map" => {
                let k = next();
                Type::map(k, next())
            }
            "optional" => Type::optional(next()),
            "type" => Type::type_of(next()),
            _ => Type::Error,
        };
    }
    match text {
        "dyn" => Type::Dyn,
        "null" => Type::Null,
        "bool" => Type::Bool,
        "int" => Type::Int,
        "uint" => Type::Uint,
        "double" => Type::Double,
        "string" => Type::String,
        "bytes" => Type::Bytes,
        "timestamp" => Type::Timestamp,
        "duration" => Type::Duration,
        "quantity" => Type::Struct(QUANTITY),
        "semver" => Type::Struct(SEMVER),
        "url" => Type::Struct(URL),
        "format" => Type::Struct(FORMAT),
        "ip" => Type::Opaque(IP, Vec::new()),
        "cidr" => Type::Opaque(CIDR, Vec::new()),
        p if p.len() == 1 && p.as_bytes()[0].is_ascii_uppercase() => Type::Param(p.to_string()),
        _ => Type::Error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unification_binds_parameters() {
        let mut m = Mapping::default();
        let a = parse("A");
        assert!(m.assignable(&Type::Int, &a));
        assert!(!m.assignable(&Type::String, &a));
        assert_eq!(m.substitute(&parse("list(A)"), false), Type::list(Type::Int));
        // dyn is more general: the binding widens.
        assert!(m.assignable(&Type::Dyn, &a));
        assert_eq!(m.substitute(&parse("list(A)"), false), Type::list(Type::Dyn));
        let mut m = Mapping::default();
        assert!(m.assignable_list(
            &[Type::list(Type::Int), Type::list(Type::Any)],
            &[parse("list(A)"), parse("list(A)")]
        ));
        assert_eq!(parse("map(K, optional(V))").to_string(), "map(K, optional_type(V))");
    }
}
