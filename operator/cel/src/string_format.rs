//! cel-go's `<string>.format(<list>)` as strings library version 2 has it (the
//! version Kubernetes' base environment uses since 1.29): its first formatter, with
//! `%f` and `%e` rendered by golang.org/x/text's en_US number printer (grouping,
//! `∞`, superscript exponents), and its compile-time check of calls whose format
//! string and argument list are both literals.
//!
//! One walk over the format string serves both: at run time each clause formats an
//! argument value, at compile time it checks the static type of the argument
//! expression at the same position.

use crate::quote::go_quote;
use crate::typed::{TKind, TNode};
use crate::types::Type;
use crate::value::{Error, Result, TypeName, Value, format_double};

/// x/text's en exponent: `×10` then the superscript exponent.
const TIMES_TEN: &str = "\u{d7}10";
const SUPERSCRIPT_DIGITS: [char; 10] = [
    '\u{2070}', '\u{b9}', '\u{b2}', '\u{b3}', '\u{2074}', '\u{2075}', '\u{2076}', '\u{2077}', '\u{2078}', '\u{2079}',
];
const SUPERSCRIPT_MINUS: char = '\u{207b}';
/// What Go's fmt (and x/text's copy of its parser) prints for a width or precision
/// too large to parse.
const NO_VERB: &str = "%!(NOVERB)";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verb {
    String,
    Decimal,
    Fixed,
    Scientific,
    Binary,
    Hex { upper: bool },
    Octal,
}

/// A failed clause: its message, and at compile time the position of the argument
/// expression to blame (otherwise the call is).
struct Failure {
    message: String,
    at: Option<usize>,
}

impl Failure {
    fn new(message: impl Into<String>) -> Self {
        Failure {
            message: message.into(),
            at: None,
        }
    }
}

/// One side of the walk: run time (values) or compile time (typed expressions).
trait Clauses {
    /// The argument a clause is about to use; run time checks the index here, before
    /// anything else about the clause.
    fn arg(&mut self, index: usize) -> std::result::Result<(), Failure>;
    fn len(&self) -> usize;
    fn clause(&mut self, index: usize, verb: Verb, precision: Option<i64>) -> std::result::Result<String, Failure>;
}

/// Walks `format`, expanding `%%` and handing every clause to `clauses`.
fn walk(format: &str, clauses: &mut impl Clauses) -> std::result::Result<String, Failure> {
    let bytes = format.as_bytes();
    let mut out = String::with_capacity(format.len());
    let mut i = 0;
    let mut index = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            let end = bytes[i..]
                .iter()
                .position(|&b| b == b'%')
                .map_or(bytes.len(), |p| i + p);
            out.push_str(&format[i..end]);
            i = end;
            continue;
        }
        if bytes.get(i + 1) == Some(&b'%') {
            out.push('%');
            i += 2;
            continue;
        }
        clauses.arg(index)?;
        if i + 1 >= bytes.len() {
            return Err(Failure::new("unexpected end of string"));
        }
        if index >= clauses.len() {
            return Err(Failure::new(format!("index {index} out of range")));
        }
        let rest = &bytes[i + 1..];
        let (read, precision) = parse_precision(rest).map_err(|e| {
            Failure::new(format!(
                "could not parse formatting clause: error while parsing precision: {e}"
            ))
        })?;
        // Go reads the verb as a byte, so a multi-byte character shows as its first byte.
        let verb = match rest[read] {
            b's' => Verb::String,
            b'd' => Verb::Decimal,
            b'f' => Verb::Fixed,
            b'e' => Verb::Scientific,
            b'b' => Verb::Binary,
            b'x' => Verb::Hex { upper: false },
            b'X' => Verb::Hex { upper: true },
            b'o' => Verb::Octal,
            other => {
                return Err(Failure::new(format!(
                    "could not parse formatting clause: unrecognized formatting clause \"{}\"",
                    char::from(other)
                )));
            }
        };
        let text = clauses.clause(index, verb, precision).map_err(|f| Failure {
            message: format!("error during formatting: {}", f.message),
            at: f.at,
        })?;
        out.push_str(&text);
        i += 1 + read + 1;
        index += 1;
    }
    Ok(out)
}

/// `.<digits>` after the `%`: how many bytes it takes and its value.
fn parse_precision(rest: &[u8]) -> std::result::Result<(usize, Option<i64>), String> {
    if rest.first() != Some(&b'.') {
        return Ok((0, None));
    }
    let mut j = 1;
    loop {
        match rest.get(j) {
            None => return Err("could not find end of precision specifier".into()),
            Some(b) if b.is_ascii_digit() => j += 1,
            Some(_) => break,
        }
    }
    // Go's strconv.Atoi, with its messages.
    let digits = std::str::from_utf8(&rest[1..j]).unwrap_or("");
    if digits.is_empty() {
        return Err("error while converting precision to integer: strconv.Atoi: parsing \"\": invalid syntax".into());
    }
    match digits.parse::<i64>() {
        Ok(p) => Ok((j, Some(p))),
        Err(_) => Err(format!(
            "error while converting precision to integer: strconv.Atoi: parsing \"{digits}\": value out of range"
        )),
    }
}

// ---- run time ----

/// Evaluates `format.format(args)`.
pub(crate) fn format(format: &str, args: &[Value<'_>]) -> Result<String> {
    walk(format, &mut Values { args }).map_err(|f| Error::new(f.message))
}

struct Values<'v, 'a> {
    args: &'v [Value<'a>],
}

impl Clauses for Values<'_, '_> {
    fn arg(&mut self, index: usize) -> std::result::Result<(), Failure> {
        if index >= self.args.len() {
            return Err(Failure::new(format!("index {index} out of range")));
        }
        Ok(())
    }

    fn len(&self) -> usize {
        self.args.len()
    }

    fn clause(&mut self, index: usize, verb: Verb, precision: Option<i64>) -> std::result::Result<String, Failure> {
        let v = &self.args[index];
        let wrong = |message: &str| Err(Failure::new(format!("{message}, was given {}", v.type_name())));
        match verb {
            Verb::String => string_clause(v).map_err(|e| Failure::new(e.message)),
            Verb::Decimal => match decimal(v) {
                Some(s) => Ok(s),
                None => wrong(DECIMAL),
            },
            Verb::Fixed | Verb::Scientific => {
                let x = match v {
                    Value::Double(d) => *d,
                    Value::String(s) if &**s == "NaN" => f64::NAN,
                    Value::String(s) if &**s == "Infinity" => f64::INFINITY,
                    Value::String(s) if &**s == "-Infinity" => f64::NEG_INFINITY,
                    _ => return wrong(if verb == Verb::Fixed { FIXED } else { SCIENTIFIC }),
                };
                let precision = precision.unwrap_or(6);
                Ok(if verb == Verb::Fixed {
                    fixed(x, precision)
                } else {
                    scientific(x, precision)
                })
            }
            Verb::Binary => match v {
                Value::Int(i) => Ok(signed(*i < 0, format!("{:b}", i.unsigned_abs()))),
                Value::Uint(u) => Ok(format!("{u:b}")),
                Value::Bool(b) => Ok(if *b { "1" } else { "0" }.into()),
                _ => wrong(BINARY),
            },
            Verb::Hex { upper } => {
                let s = match v {
                    Value::String(s) => hex_bytes(s.as_bytes()),
                    Value::Bytes(b) => hex_bytes(b),
                    Value::Int(i) => signed(*i < 0, format!("{:x}", i.unsigned_abs())),
                    Value::Uint(u) => format!("{u:x}"),
                    _ => return wrong(HEX),
                };
                Ok(if upper { s.to_ascii_uppercase() } else { s })
            }
            Verb::Octal => match v {
                Value::Int(i) => Ok(signed(*i < 0, format!("{:o}", i.unsigned_abs()))),
                Value::Uint(u) => Ok(format!("{u:o}")),
                _ => wrong(OCTAL),
            },
        }
    }
}

const BINARY: &str = "only integers and bools can be formatted as binary";
const DECIMAL: &str = "decimal clause can only be used on integers";
const FIXED: &str = "fixed-point clause can only be used on doubles";
const HEX: &str = "only integers, byte buffers, and strings can be formatted as hex";
const OCTAL: &str = "octal clause can only be used on integers";
const SCIENTIFIC: &str = "scientific clause can only be used on doubles";
const STRING: &str = "string clause can only be used on strings, bools, bytes, ints, doubles, maps, lists, types, durations, and timestamps";

fn signed(negative: bool, digits: String) -> String {
    if negative { format!("-{digits}") } else { digits }
}

fn hex_bytes(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn decimal(v: &Value<'_>) -> Option<String> {
    match v {
        Value::Int(i) => Some(i.to_string()),
        Value::Uint(u) => Some(u.to_string()),
        _ => None,
    }
}

fn bytes_to_string(b: &[u8]) -> Result<String> {
    std::str::from_utf8(b)
        .map(str::to_string)
        .map_err(|_| Error::new("could not convert argument to string: invalid UTF-8 in bytes"))
}

/// `%s`: the value's string conversion; lists and maps as CEL-like literals.
fn string_clause(v: &Value<'_>) -> Result<String> {
    Ok(match v {
        Value::List(items) => list(items)?,
        v if v.is_map() => map(v)?,
        Value::Int(i) => i.to_string(),
        Value::Uint(u) => u.to_string(),
        Value::Double(d) => format_double(*d),
        Value::Bool(b) => b.to_string(),
        Value::String(s) => s.to_string(),
        Value::Bytes(b) => bytes_to_string(b)?,
        Value::Timestamp(t) => t.format(),
        Value::Duration(d) => crate::time::format_duration(*d),
        Value::Type(t) => t.name().to_string(),
        Value::Null => "null".into(),
        other => return Err(Error::new(format!("{STRING}, was given {}", other.type_name()))),
    })
}

/// An element of a list or a map value inside `%s`, quoted as a CEL literal would be.
fn element(v: &Value<'_>) -> Result<String> {
    Ok(match v {
        Value::Int(_) | Value::Uint(_) => decimal(v).unwrap_or_default(),
        Value::String(s) => go_quote(s.as_bytes()),
        Value::Bytes(b) => format!("b{}", go_quote(bytes_to_string(b)?.as_bytes())),
        Value::Bool(_) | Value::Null | Value::Type(_) => string_clause(v)?,
        Value::Timestamp(t) => format!("timestamp({})", go_quote(t.format().as_bytes())),
        Value::Duration(d) => format!("duration({})", go_quote(crate::time::format_duration(*d).as_bytes())),
        Value::List(items) => list(items)?,
        v if v.is_map() => map(v)?,
        // Go's `%.6f`, quoted when not a number literal.
        Value::Double(d) if d.is_nan() => "\"NaN\"".into(),
        Value::Double(d) if d.is_infinite() => if *d > 0.0 { "\"+Inf\"" } else { "\"-Inf\"" }.into(),
        Value::Double(d) => format!("{d:.6}"),
        other => return Err(Error::new(format!("no formatting function for {}", other.type_name()))),
    })
}

fn list(items: &[Value<'_>]) -> Result<String> {
    let parts = items.iter().map(element).collect::<Result<Vec<_>>>()?;
    Ok(format!("[{}]", parts.join(", ")))
}

/// Entries sorted by their formatted keys.
fn map(v: &Value<'_>) -> Result<String> {
    let mut pairs = Vec::new();
    for (k, value) in v.map_entries()? {
        let key = match &k {
            Value::String(s) => go_quote(s.as_bytes()),
            Value::Bool(b) => b.to_string(),
            Value::Int(_) | Value::Uint(_) => decimal(&k).unwrap_or_default(),
            other => {
                return Err(Error::new(format!(
                    "no formatting function for map key of type {}",
                    other.type_name()
                )));
            }
        };
        pairs.push((key, element(&value)?));
    }
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    let parts: Vec<String> = pairs.into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
    Ok(format!("{{{}}}", parts.join(", ")))
}

// ---- x/text's en_US number printer ----

/// Whether x/text's copy of Go's format parser gives up on this width or precision
/// (it stops once the number read so far exceeds a million).
fn too_large(n: i64) -> bool {
    n / 10 > 1_000_000
}

/// Groups an integer's digits by three with commas.
fn group(int: &str) -> String {
    let mut out = String::with_capacity(int.len() + int.len() / 3);
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `%.<precision>f` through the en_US printer: exact rounding half to even, grouped
/// integer digits, trailing zeros down to the minimum fraction digits. x/text keeps
/// the minimum in a `uint8` and the maximum in an `int16`, and both wrap; a negative
/// maximum means the shortest exact digits.
fn fixed(x: f64, precision: i64) -> String {
    if too_large(precision) {
        return NO_VERB.into();
    }
    if x.is_nan() {
        return "NaN".into();
    }
    let sign = if x < 0.0 { "-" } else { "" };
    if x.is_infinite() {
        return format!("{sign}\u{221e}");
    }
    let min_frac = precision as u8 as usize;
    let max_frac = precision as i16;
    let abs = x.abs();
    let text = if max_frac >= 0 {
        format!("{abs:.*}", max_frac as usize)
    } else {
        format!("{abs}")
    };
    let (int, frac) = text.split_once('.').unwrap_or((&text, ""));
    let int = int.trim_start_matches('0');
    let mut frac = frac.trim_end_matches('0').to_string();
    while frac.len() < min_frac {
        frac.push('0');
    }
    let mut out = String::from(sign);
    out.push_str(&group(if int.is_empty() { "0" } else { int }));
    if !frac.is_empty() {
        out.push('.');
        out.push_str(&frac);
    }
    out
}

/// `%e`: cel-go passes its precision to the printer as a width (`%<precision>e`), so
/// there are always six fraction digits and the precision only pads with spaces.
fn scientific(x: f64, width: i64) -> String {
    if width != 0 && too_large(width) {
        return NO_VERB.into();
    }
    let sign = if x < 0.0 { "-" } else { "" };
    let body = if x.is_nan() {
        "NaN".to_string()
    } else if x.is_infinite() {
        format!("{sign}\u{221e}")
    } else {
        let text = format!("{:.6e}", x.abs());
        let (mantissa, exp) = text.split_once('e').unwrap_or((&text, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        // Zero has no significant digit: x/text shows it with exponent zero.
        let exp = if x == 0.0 { 0 } else { exp };
        let mut out = format!("{sign}{mantissa}{TIMES_TEN}");
        if exp < 0 {
            out.push(SUPERSCRIPT_MINUS);
        }
        let digits = format!("{:02}", exp.unsigned_abs());
        out.extend(digits.bytes().map(|b| SUPERSCRIPT_DIGITS[usize::from(b - b'0')]));
        out
    };
    // x/text keeps the width in a `uint16`.
    let width = usize::from(width as u16);
    let count = body.chars().count();
    if width > count {
        let mut padded = " ".repeat(width - count);
        padded.push_str(&body);
        return padded;
    }
    body
}

// ---- compile time ----

/// cel-go's format validator: a call whose format string is a literal and whose
/// argument is a list literal must parse, use every argument, and give each clause an
/// argument whose static type the clause accepts (`dyn` passes). Returns the position
/// to report at and the message.
pub(crate) fn validate(
    call_pos: usize,
    format: &str,
    args: &[(TNode, bool)],
) -> std::result::Result<(), (usize, String)> {
    let mut checker = Static { args, requested: 0 };
    match walk(format, &mut checker) {
        Err(f) => Err((f.at.unwrap_or(call_pos), f.message)),
        Ok(_) if args.len() > checker.requested => Err((
            call_pos,
            format!(
                "too many arguments supplied to string.format (expected {}, got {})",
                checker.requested,
                args.len()
            ),
        )),
        Ok(_) => Ok(()),
    }
}

struct Static<'n> {
    args: &'n [(TNode, bool)],
    requested: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Int,
    Uint,
    Double,
    Bool,
    String,
    Bytes,
    Timestamp,
    Duration,
    List,
    Map,
    Type,
    Null,
}

fn kind(t: &Type) -> Option<Kind> {
    Some(match t {
        Type::Int => Kind::Int,
        Type::Uint => Kind::Uint,
        Type::Double => Kind::Double,
        Type::Bool => Kind::Bool,
        Type::String => Kind::String,
        Type::Bytes => Kind::Bytes,
        Type::Timestamp => Kind::Timestamp,
        Type::Duration => Kind::Duration,
        Type::List(_) => Kind::List,
        Type::Map(..) => Kind::Map,
        Type::Kind(_) => Kind::Type,
        Type::Null => Kind::Null,
        _ => return None,
    })
}

/// cel-go's `TypeName` of a static type, for the messages.
fn type_name(t: &Type) -> String {
    match t {
        Type::Any => "google.protobuf.Any".into(),
        Type::List(_) => TypeName::List.name().into(),
        Type::Map(..) => TypeName::Map.name().into(),
        Type::Kind(_) => TypeName::Type.name().into(),
        Type::Opaque(name, _) | Type::Struct(name) => (*name).into(),
        other => other.to_string(),
    }
}

/// Only the kind counts (a list is a list whatever its elements); `dyn` is anything.
fn one_of(t: &Type, kinds: &[Kind]) -> bool {
    matches!(t, Type::Dyn) || kind(t).is_some_and(|k| kinds.contains(&k))
}

const STRING_KINDS: &[Kind] = &[
    Kind::List,
    Kind::Map,
    Kind::Int,
    Kind::Uint,
    Kind::Double,
    Kind::Bool,
    Kind::String,
    Kind::Timestamp,
    Kind::Bytes,
    Kind::Duration,
    Kind::Type,
    Kind::Null,
];

/// `%s` looks into list and map literals, element by element.
fn check_string(node: &TNode) -> std::result::Result<(), Failure> {
    if !one_of(&node.ty, STRING_KINDS) {
        return Err(Failure {
            message: format!("{STRING}, was given {}", type_name(&node.ty)),
            at: Some(node.pos),
        });
    }
    match &node.kind {
        TKind::List(items) => items.iter().try_for_each(|(item, _)| check_string(item)),
        TKind::Map(entries) => entries.iter().try_for_each(|(k, v, _)| {
            check_string(k)?;
            check_string(v)
        }),
        _ => Ok(()),
    }
}

impl Clauses for Static<'_> {
    fn arg(&mut self, _index: usize) -> std::result::Result<(), Failure> {
        self.requested += 1;
        Ok(())
    }

    fn len(&self) -> usize {
        self.args.len()
    }

    fn clause(&mut self, index: usize, verb: Verb, _precision: Option<i64>) -> std::result::Result<String, Failure> {
        let node = &self.args[index].0;
        let (kinds, message): (&[Kind], &str) = match verb {
            Verb::String => return check_string(node).map(|()| String::new()),
            Verb::Decimal => (&[Kind::Int, Kind::Uint], DECIMAL),
            // Strings pass for "NaN", "Infinity" and "-Infinity".
            Verb::Fixed => (&[Kind::Double, Kind::String], FIXED),
            Verb::Scientific => (&[Kind::Double, Kind::String], SCIENTIFIC),
            Verb::Binary => (&[Kind::Int, Kind::Uint, Kind::Bool], BINARY),
            Verb::Hex { .. } => (&[Kind::Int, Kind::Uint, Kind::String, Kind::Bytes], HEX),
            Verb::Octal => (&[Kind::Int, Kind::Uint], OCTAL),
        };
        if one_of(&node.ty, kinds) {
            Ok(String::new())
        } else {
            Err(Failure {
                message: format!("{message}, was given {}", type_name(&node.ty)),
                at: Some(node.pos),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn en_us_fixed_point() {
        assert_eq!(fixed(1.5, 2), "1.50");
        assert_eq!(fixed(1234567.891, 2), "1,234,567.89");
        assert_eq!(fixed(0.125, 2), "0.12");
        assert_eq!(fixed(-0.001, 2), "-0.00");
        assert_eq!(fixed(-0.0, 2), "0.00");
        assert_eq!(fixed(1e21, 0), "1,000,000,000,000,000,000,000");
        assert_eq!(fixed(f64::NEG_INFINITY, 2), "-\u{221e}");
        // The minimum wraps at 256: no trailing zeros.
        assert_eq!(fixed(1.5, 256), "1.5");
        assert_eq!(fixed(2.0, 300), format!("2.{}", "0".repeat(44)));
    }

    #[test]
    fn en_us_scientific() {
        assert_eq!(scientific(2.5, 6), "2.500000\u{d7}10\u{2070}\u{2070}");
        assert_eq!(scientific(1052.033, 6), "1.052033\u{d7}10\u{2070}\u{b3}");
        assert_eq!(
            scientific(-1e-300, 0),
            "-1.000000\u{d7}10\u{207b}\u{b3}\u{2070}\u{2070}"
        );
        assert_eq!(scientific(f64::NAN, 5), "  NaN");
    }

    #[test]
    fn clauses() {
        let args = [Value::Int(-255), Value::str("hi"), Value::str("hi"), Value::Bool(true)];
        assert_eq!(format("%x %X %s %b%%", &args).unwrap(), "-ff 6869 hi 1%");
        assert!(format("%d", &[]).is_err());
        assert!(format("%", &[Value::Int(1)]).is_err());
        assert!(format("%.f", &[Value::Double(1.0)]).is_err());
    }
}
