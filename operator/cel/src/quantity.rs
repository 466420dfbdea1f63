//! Kubernetes resource quantities (`resource.Quantity`): parsing, exact arithmetic and
//! comparison, and the canonical text form.
//!
//! A quantity is kept as an exact number of nano-units in an `i128`, which covers every
//! value Kubernetes objects hold in practice (up to about 10^29 units). Like the
//! apimachinery parser, digits beyond nano precision round up (away from zero).

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

const NANOS_PER_UNIT: i128 = 1_000_000_000;

/// How a quantity was written, which decides how it prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// Power-of-two suffixes: Ki, Mi, Gi, Ti, Pi, Ei.
    BinarySI,
    /// Power-of-ten suffixes: n, u, m, k, M, G, T, P, E, or none.
    DecimalSI,
    /// An exponent: 1e3, 5E-2.
    DecimalExponent,
}

/// An exact resource quantity.
#[derive(Clone, Copy, Debug)]
pub struct Quantity {
    nanos: i128,
    format: Format,
}

/// A string that is not a quantity, or a result out of range.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {0:?}")]
    Syntax(String),
    #[error("quantity {0:?} is too large")]
    TooLarge(String),
    #[error("quantity arithmetic overflowed")]
    Overflow,
}

impl Quantity {
    /// Zero, in decimal format.
    pub const ZERO: Quantity = Quantity {
        nanos: 0,
        format: Format::DecimalSI,
    };

    /// A whole number of units.
    pub fn from_units(units: i64, format: Format) -> Self {
        Quantity {
            nanos: i128::from(units) * NANOS_PER_UNIT,
            format,
        }
    }

    /// A number of milli-units (CPU is usually counted this way).
    pub fn from_millis(millis: i64) -> Self {
        Quantity {
            nanos: i128::from(millis) * 1_000_000,
            format: Format::DecimalSI,
        }
    }

    /// Parses the Kubernetes quantity syntax.
    pub fn parse(text: &str) -> Result<Self, QuantityError> {
        let syntax = || QuantityError::Syntax(text.to_string());
        let bytes = text.as_bytes();
        let mut pos = 0;
        let negative = match bytes.first() {
            Some(b'-') => {
                pos = 1;
                true
            }
            Some(b'+') => {
                pos = 1;
                false
            }
            _ => false,
        };
        let int_start = pos;
        while pos < bytes.len() && bytes[pos].is_ascii_digit() {
            pos += 1;
        }
        let int_digits = &text[int_start..pos];
        let mut frac_digits = "";
        if pos < bytes.len() && bytes[pos] == b'.' {
            pos += 1;
            let frac_start = pos;
            while pos < bytes.len() && bytes[pos].is_ascii_digit() {
                pos += 1;
            }
            frac_digits = &text[frac_start..pos];
        }
        if int_digits.is_empty() && frac_digits.is_empty() {
            return Err(syntax());
        }
        let suffix = &text[pos..];
        let (base, exponent, format) = parse_suffix(suffix).ok_or_else(syntax)?;

        // value = digits * 10^-len(frac) * base^exponent, kept exact in nano-units.
        let mut digits: i128 = 0;
        let mut significant = 0usize;
        for d in int_digits.bytes().chain(frac_digits.bytes()) {
            if digits == 0 && d == b'0' {
                continue;
            }
            significant += 1;
            if significant > 36 {
                return Err(QuantityError::TooLarge(text.to_string()));
            }
            digits = digits * 10 + i128::from(d - b'0');
        }
        let too_large = || QuantityError::TooLarge(text.to_string());
        let mut numerator = digits;
        let mut denominator: i128 = 1;
        let frac_len = u32::try_from(frac_digits.len()).map_err(|_| too_large())?;
        if frac_len > 36 {
            return Err(too_large());
        }
        denominator = denominator.checked_mul(10i128.pow(frac_len)).ok_or_else(too_large)?;
        match base {
            2 => numerator = numerator.checked_mul(1i128 << exponent).ok_or_else(too_large)?,
            _ if exponent >= 0 => {
                let scale = 10i128.checked_pow(exponent as u32).ok_or_else(too_large)?;
                numerator = numerator.checked_mul(scale).ok_or_else(too_large)?;
            }
            _ => {
                let scale = 10i128.checked_pow((-exponent) as u32).ok_or_else(too_large)?;
                denominator = denominator.checked_mul(scale).ok_or_else(too_large)?;
            }
        }
        numerator = numerator.checked_mul(NANOS_PER_UNIT).ok_or_else(too_large)?;
        // Round up to whole nano-units.
        let mut nanos = numerator / denominator;
        if numerator % denominator != 0 {
            nanos += 1;
        }
        if negative {
            nanos = -nanos;
        }
        Ok(Quantity { nanos, format })
    }

    /// The exact value in nano-units.
    pub fn nanos(&self) -> i128 {
        self.nanos
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// The value in milli-units, rounded up (as `Quantity.MilliValue`).
    pub fn milli_value(&self) -> i128 {
        div_ceil(self.nanos, 1_000_000)
    }

    /// The value in units, rounded up (as `Quantity.Value`).
    pub fn value(&self) -> i128 {
        div_ceil(self.nanos, NANOS_PER_UNIT)
    }

    /// Whether the value is a whole number of units.
    pub fn is_integer(&self) -> bool {
        self.nanos % NANOS_PER_UNIT == 0
    }

    /// The value as an `i64`, when it is a whole number in range.
    pub fn as_integer(&self) -> Option<i64> {
        if !self.is_integer() {
            return None;
        }
        i64::try_from(self.nanos / NANOS_PER_UNIT).ok()
    }

    /// The value as a float (inexact).
    pub fn as_approximate_float(&self) -> f64 {
        self.nanos as f64 / NANOS_PER_UNIT as f64
    }

    /// -1, 0 or 1.
    pub fn sign(&self) -> i64 {
        self.nanos.signum() as i64
    }

    pub fn checked_add(&self, other: &Quantity) -> Result<Quantity, QuantityError> {
        let nanos = self.nanos.checked_add(other.nanos).ok_or(QuantityError::Overflow)?;
        Ok(Quantity {
            nanos,
            format: self.format,
        })
    }

    pub fn checked_sub(&self, other: &Quantity) -> Result<Quantity, QuantityError> {
        let nanos = self.nanos.checked_sub(other.nanos).ok_or(QuantityError::Overflow)?;
        Ok(Quantity {
            nanos,
            format: self.format,
        })
    }

    /// This quantity times a whole number.
    pub fn checked_mul(&self, factor: i64) -> Result<Quantity, QuantityError> {
        let nanos = self
            .nanos
            .checked_mul(i128::from(factor))
            .ok_or(QuantityError::Overflow)?;
        Ok(Quantity {
            nanos,
            format: self.format,
        })
    }
}

fn div_ceil(value: i128, divisor: i128) -> i128 {
    let quotient = value / divisor;
    if value % divisor > 0 { quotient + 1 } else { quotient }
}

/// (base, exponent, format) of a suffix.
fn parse_suffix(suffix: &str) -> Option<(i128, i32, Format)> {
    let decimal = |e| Some((10, e, Format::DecimalSI));
    let binary = |e| Some((2, e, Format::BinarySI));
    match suffix {
        "" => decimal(0),
        "n" => decimal(-9),
        "u" => decimal(-6),
        "m" => decimal(-3),
        "k" => decimal(3),
        "M" => decimal(6),
        "G" => decimal(9),
        "T" => decimal(12),
        "P" => decimal(15),
        "E" => decimal(18),
        "Ki" => binary(10),
        "Mi" => binary(20),
        "Gi" => binary(30),
        "Ti" => binary(40),
        "Pi" => binary(50),
        "Ei" => binary(60),
        _ => {
            let rest = suffix.strip_prefix('e').or_else(|| suffix.strip_prefix('E'))?;
            let digits = rest.strip_prefix(['+', '-']).unwrap_or(rest);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || digits.len() > 3 {
                return None;
            }
            let exponent: i32 = rest.parse().ok()?;
            Some((10, exponent, Format::DecimalExponent))
        }
    }
}

impl PartialEq for Quantity {
    fn eq(&self, other: &Self) -> bool {
        self.nanos == other.nanos
    }
}

impl Eq for Quantity {}

impl PartialOrd for Quantity {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Quantity {
    fn cmp(&self, other: &Self) -> Ordering {
        self.nanos.cmp(&other.nanos)
    }
}

impl std::hash::Hash for Quantity {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.nanos.hash(state);
    }
}

impl FromStr for Quantity {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Quantity::parse(s)
    }
}

impl fmt::Display for Quantity {
    /// The canonical form: the largest suffix of the quantity's format that keeps the
    /// number whole (binary suffixes only for whole multiples of 1024).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.nanos < 0 { "-" } else { "" };
        let magnitude = self.nanos.unsigned_abs();
        if magnitude == 0 {
            return write!(f, "0");
        }
        if self.format == Format::BinarySI && magnitude.is_multiple_of(NANOS_PER_UNIT as u128) {
            let units = magnitude / NANOS_PER_UNIT as u128;
            for (suffix, shift) in [("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)] {
                if units.is_multiple_of(1u128 << shift) {
                    return write!(f, "{sign}{}{suffix}", units >> shift);
                }
            }
            if units < 1024 {
                return write!(f, "{sign}{units}");
            }
        }
        for (suffix, nanos_per) in [
            ("E", 10u128.pow(27)),
            ("P", 10u128.pow(24)),
            ("T", 10u128.pow(21)),
            ("G", 10u128.pow(18)),
            ("M", 10u128.pow(15)),
            ("k", 10u128.pow(12)),
            ("", 10u128.pow(9)),
            ("m", 10u128.pow(6)),
            ("u", 10u128.pow(3)),
            ("n", 1),
        ] {
            if magnitude.is_multiple_of(nanos_per) {
                return write!(f, "{sign}{}{suffix}", magnitude / nanos_per);
            }
        }
        unreachable!("every magnitude is a multiple of one nano-unit")
    }
}

impl AsRef<Quantity> for Quantity {
    fn as_ref(&self) -> &Quantity {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(text: &str) -> Quantity {
        Quantity::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn parses_every_suffix_exactly() {
        let cases = [
            ("1", 1_000_000_000),
            ("1.5", 1_500_000_000),
            ("500m", 500_000_000),
            ("1n", 1),
            ("3u", 3_000),
            ("2k", 2_000_000_000_000),
            ("1Ki", 1024 * 1_000_000_000),
            ("1.5Gi", 1_610_612_736 * 1_000_000_000),
            ("1e3", 1_000_000_000_000),
            ("5E-2", 50_000_000),
            ("-2", -2_000_000_000),
            ("+.5", 500_000_000),
            ("0.1n", 1),
            ("80Gi", 80 * (1 << 30) * 1_000_000_000),
        ];
        for (text, nanos) in cases {
            assert_eq!(q(text).nanos(), nanos, "{text}");
        }
    }

    #[test]
    fn rejects_what_kubernetes_rejects() {
        for text in ["", "Gi", "1 Gi", "1GB", "1.2.3", "abc", "1e", "1Kii", "--1", "1ki", "."] {
            assert!(Quantity::parse(text).is_err(), "{text:?} must be refused");
        }
    }

    #[test]
    fn compares_across_formats() {
        assert_eq!(q("1Gi"), q("1073741824"));
        assert_eq!(q("1k"), q("1000"));
        assert_eq!(q("1e3"), q("1k"));
        assert!(q("1Gi") > q("1G"));
        assert!(q("999m") < q("1"));
        assert_eq!(q("100m").milli_value(), 100);
        assert_eq!(q("1500m").value(), 2, "value rounds up");
        assert_eq!(q("-1500m").value(), -1);
    }

    #[test]
    fn arithmetic_and_integer_views() {
        assert_eq!(q("1Gi").checked_add(&q("512Mi")).unwrap(), q("1536Mi"));
        assert_eq!(q("1").checked_sub(&q("250m")).unwrap(), q("750m"));
        assert_eq!(q("2Gi").checked_mul(4).unwrap(), q("8Gi"));
        assert_eq!(q("5").as_integer(), Some(5));
        assert_eq!(q("5.5").as_integer(), None);
        assert!(q("1k").is_integer());
        assert_eq!(q("-3").sign(), -1);
        assert_eq!(q("0").sign(), 0);
        assert!((q("1.25").as_approximate_float() - 1.25).abs() < 1e-12);
    }

    #[test]
    fn prints_canonically() {
        for (text, canonical) in [
            ("1024Mi", "1Gi"),
            ("1536Mi", "1536Mi"),
            ("1000", "1k"),
            ("0.5", "500m"),
            ("1e3", "1k"),
            ("0", "0"),
            ("100", "100"),
            ("-2Gi", "-2Gi"),
            ("1.5Ki", "1536"),
        ] {
            assert_eq!(q(text).to_string(), canonical, "{text}");
        }
    }
}
