//! `google.protobuf.Timestamp` and `google.protobuf.Duration` as cel-go has them: Go's
//! `time.Time` limited to years 1..9999 (UTC) and Go's `time.Duration` (int64
//! nanoseconds). Parsing and formatting follow Go's `time` package: `time.Parse` with
//! the RFC 3339 layout, `time.ParseDuration`, `Format(RFC3339Nano)`.

use std::cmp::Ordering;
use std::fmt::Write as _;

use thiserror::Error;

/// Seconds of 0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z (cel-go's range).
const MIN_UNIX: i64 = -62_135_596_800;
const MAX_UNIX: i64 = 253_402_300_799;
const NANOS: i64 = 1_000_000_000;

#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub(crate) enum TimeError {
    #[error("timestamp overflow")]
    TimestampOverflow,
    #[error("integer overflow")]
    IntOverflow,
    #[error("type conversion error from 'string' to '{0}'")]
    Conversion(&'static str),
    #[error("{0}")]
    Zone(String),
}

/// An instant, with the UTC offset it was written with (only `string()` shows it).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timestamp {
    secs: i64,
    nanos: u32,
    offset: i32,
}

impl PartialEq for Timestamp {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Timestamp {}

impl PartialOrd for Timestamp {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Timestamp {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.secs, self.nanos).cmp(&(other.secs, other.nanos))
    }
}

/// The civil fields of an instant in some time zone.
pub(crate) struct Civil {
    pub year: i64,
    /// 1..=12.
    pub month: i64,
    /// 1..=31.
    pub day: i64,
    /// 0-based.
    pub year_day: i64,
    /// 0 is Sunday.
    pub week_day: i64,
    pub hour: i64,
    pub minute: i64,
    pub second: i64,
    pub nanos: i64,
}

fn is_leap(year: i64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

fn days_in(month: i64, year: i64) -> i64 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

impl Timestamp {
    /// `timestamp(int)`: seconds since the epoch, in UTC.
    pub(crate) fn from_unix(secs: i64) -> Result<Timestamp, TimeError> {
        if !(MIN_UNIX..=MAX_UNIX).contains(&secs) {
            return Err(TimeError::TimestampOverflow);
        }
        Ok(Timestamp {
            secs,
            nanos: 0,
            offset: 0,
        })
    }

    pub(crate) fn unix(&self) -> i64 {
        self.secs
    }

    /// The zero `time.Time` (what `optional.ofNonZeroValue` treats as empty).
    pub(crate) fn is_zero(&self) -> bool {
        self.secs == MIN_UNIX && self.nanos == 0
    }

    /// `timestamp(string)`: Go's `time.Parse(time.RFC3339, s)`, then cel-go's range.
    pub(crate) fn parse(s: &str) -> Result<Timestamp, TimeError> {
        let bad = || TimeError::Conversion("google.protobuf.Timestamp");
        let (secs, nanos, offset) = parse_rfc3339(s).ok_or_else(bad)?;
        if !(MIN_UNIX..=MAX_UNIX).contains(&secs) {
            return Err(TimeError::TimestampOverflow);
        }
        Ok(Timestamp { secs, nanos, offset })
    }

    /// The civil fields at `offset` seconds east of UTC.
    pub(crate) fn civil(&self, offset: i64) -> Civil {
        let local = i128::from(self.secs) + i128::from(offset);
        let days = local.div_euclid(86_400) as i64;
        let rem = local.rem_euclid(86_400) as i64;
        let (year, month, day) = civil_from_days(days);
        Civil {
            year,
            month,
            day,
            year_day: days - days_from_civil(year, 1, 1),
            week_day: (days + 4).rem_euclid(7),
            hour: rem / 3600,
            minute: rem % 3600 / 60,
            second: rem % 60,
            nanos: i64::from(self.nanos),
        }
    }

    /// `string(timestamp)`: `Format(time.RFC3339Nano)` at the written offset.
    pub(crate) fn format(&self) -> String {
        let c = self.civil(i64::from(self.offset));
        let mut out = String::with_capacity(35);
        let _ = write!(
            out,
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}",
            c.year, c.month, c.day, c.hour, c.minute, c.second
        );
        if self.nanos != 0 {
            let frac = format!("{:09}", self.nanos);
            out.push('.');
            out.push_str(frac.trim_end_matches('0'));
        }
        if self.offset == 0 {
            out.push('Z');
        } else {
            let minutes = self.offset.abs() / 60;
            let sign = if self.offset < 0 { '-' } else { '+' };
            let _ = write!(out, "{sign}{:02}:{:02}", minutes / 60, minutes % 60);
        }
        out
    }

    /// Timestamp plus duration, as cel-go's `addTimeDurationChecked`.
    pub(crate) fn add(&self, d: i64) -> Result<Timestamp, TimeError> {
        let sec = self.secs.checked_add(d / NANOS).ok_or(TimeError::IntOverflow)?;
        let nsec = i64::from(self.nanos) + d % NANOS;
        let (sec, nsec) = if nsec < 0 {
            (sec.checked_sub(1).ok_or(TimeError::IntOverflow)?, nsec + NANOS)
        } else if nsec >= NANOS {
            (sec.checked_add(1).ok_or(TimeError::IntOverflow)?, nsec - NANOS)
        } else {
            (sec, nsec)
        };
        if !(MIN_UNIX..=MAX_UNIX).contains(&sec) {
            return Err(TimeError::TimestampOverflow);
        }
        Ok(Timestamp {
            secs: sec,
            nanos: nsec as u32,
            offset: self.offset,
        })
    }

    pub(crate) fn sub_duration(&self, d: i64) -> Result<Timestamp, TimeError> {
        self.add(d.checked_neg().ok_or(TimeError::IntOverflow)?)
    }

    /// The duration between two timestamps (`subtractTimeChecked`).
    pub(crate) fn since(&self, other: &Timestamp) -> Result<i64, TimeError> {
        let sec = self.secs.checked_sub(other.secs).ok_or(TimeError::IntOverflow)?;
        let nsec = i64::from(self.nanos) - i64::from(other.nanos);
        sec.checked_mul(NANOS)
            .and_then(|t| t.checked_add(nsec))
            .ok_or(TimeError::IntOverflow)
    }
}

/// Go's `time.Parse` with layout `2006-01-02T15:04:05Z07:00` (its general parser,
/// which accepts everything the RFC 3339 fast path does, and a one-digit hour, a comma
/// before the fraction, offsets up to 24:60). Returns (unix seconds, nanoseconds,
/// offset seconds).
fn parse_rfc3339(s: &str) -> Option<(i64, u32, i32)> {
    let b = s.as_bytes();
    let digit = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
    let num =
        |from: usize, len: usize| -> i64 { b[from..from + len].iter().fold(0, |n, c| n * 10 + i64::from(c - b'0')) };
    let mut i = 0;
    // 2006: four characters, the first a digit, all digits for atoi.
    if b.len() < 4 || !(0..4).all(digit) {
        return None;
    }
    let year = num(0, 4);
    i += 4;
    let fixed2 = |i: &mut usize| -> Option<i64> {
        if digit(*i) && digit(*i + 1) {
            *i += 2;
            Some(num(*i - 2, 2))
        } else {
            None
        }
    };
    let literal = |i: &mut usize, c: u8| -> Option<()> { (b.get(*i) == Some(&c)).then(|| *i += 1) };
    literal(&mut i, b'-')?;
    let month = fixed2(&mut i)?;
    if !(1..=12).contains(&month) {
        return None;
    }
    literal(&mut i, b'-')?;
    let day = fixed2(&mut i)?;
    literal(&mut i, b'T')?;
    // 15: one or two digits.
    if !digit(i) {
        return None;
    }
    let hour = if digit(i + 1) {
        i += 2;
        num(i - 2, 2)
    } else {
        i += 1;
        num(i - 1, 1)
    };
    if hour >= 24 {
        return None;
    }
    literal(&mut i, b':')?;
    let minute = fixed2(&mut i)?;
    if minute >= 60 {
        return None;
    }
    literal(&mut i, b':')?;
    let second = fixed2(&mut i)?;
    if second >= 60 {
        return None;
    }
    let mut nanos = 0i64;
    if matches!(b.get(i), Some(b'.' | b',')) && digit(i + 1) {
        let mut n = i + 1;
        while digit(n) {
            n += 1;
        }
        // At most nine digits count; the rest are dropped.
        let used = (n - i - 1).min(9);
        nanos = num(i + 1, used) * 10i64.pow(9 - used as u32);
        i = n;
    }
    let offset: i64 = if b.get(i) == Some(&b'Z') {
        i += 1;
        0
    } else {
        if b.len() < i + 6 || b[i + 3] != b':' {
            return None;
        }
        let sign = b[i];
        let mut j = i + 1;
        let hh = fixed2(&mut j)?;
        j += 1;
        let mm = fixed2(&mut j)?;
        if hh > 24 || mm > 60 {
            return None;
        }
        let off = (hh * 60 + mm) * 60;
        i += 6;
        match sign {
            b'+' => off,
            b'-' => -off,
            _ => return None,
        }
    };
    if i != b.len() || day < 1 || day > days_in(month, year) {
        return None;
    }
    let local = days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second;
    Some((local - offset, nanos as u32, offset as i32))
}

/// Go's `time.ParseDuration`.
pub(crate) fn parse_duration(s: &str) -> Result<i64, TimeError> {
    let bad = TimeError::Conversion("google.protobuf.Duration");
    const LIMIT: u64 = 1 << 63;
    let mut rest = s.as_bytes();
    let mut neg = false;
    if let Some(&c) = rest.first()
        && (c == b'-' || c == b'+')
    {
        neg = c == b'-';
        rest = &rest[1..];
    }
    if rest == b"0" {
        return Ok(0);
    }
    if rest.is_empty() {
        return Err(bad);
    }
    let mut total: u64 = 0;
    while !rest.is_empty() {
        if !(rest[0] == b'.' || rest[0].is_ascii_digit()) {
            return Err(bad);
        }
        let mut v: u64 = 0;
        let mut n = 0;
        while n < rest.len() && rest[n].is_ascii_digit() {
            if v > LIMIT / 10 {
                return Err(bad);
            }
            v = v * 10 + u64::from(rest[n] - b'0');
            if v > LIMIT {
                return Err(bad);
            }
            n += 1;
        }
        let pre = n > 0;
        rest = &rest[n..];
        let (mut f, mut scale, mut post) = (0u64, 1f64, false);
        if rest.first() == Some(&b'.') {
            rest = &rest[1..];
            let mut n = 0;
            let mut overflow = false;
            while n < rest.len() && rest[n].is_ascii_digit() {
                if !overflow {
                    if f > (LIMIT - 1) / 10 {
                        overflow = true;
                    } else {
                        let y = f * 10 + u64::from(rest[n] - b'0');
                        if y > LIMIT {
                            overflow = true;
                        } else {
                            f = y;
                            scale *= 10.0;
                        }
                    }
                }
                n += 1;
            }
            post = n > 0;
            rest = &rest[n..];
        }
        if !pre && !post {
            return Err(bad);
        }
        let unit_len = rest.iter().take_while(|c| !(**c == b'.' || c.is_ascii_digit())).count();
        if unit_len == 0 {
            return Err(bad);
        }
        let unit: u64 = match &rest[..unit_len] {
            b"ns" => 1,
            // "us", and with U+00B5 (micro sign) or U+03BC (Greek mu).
            b"us" | b"\xc2\xb5s" | b"\xce\xbcs" => 1_000,
            b"ms" => 1_000_000,
            b"s" => 1_000_000_000,
            b"m" => 60_000_000_000,
            b"h" => 3_600_000_000_000,
            _ => return Err(bad),
        };
        rest = &rest[unit_len..];
        if v > LIMIT / unit {
            return Err(bad);
        }
        v *= unit;
        if f > 0 {
            // Go converts the float product with uint64(), which saturates here.
            v = v.wrapping_add((f as f64 * (unit as f64 / scale)) as u64);
            if v > LIMIT {
                return Err(bad);
            }
        }
        total += v;
        if total > LIMIT {
            return Err(bad);
        }
    }
    if neg {
        return Ok((total as i64).wrapping_neg());
    }
    i64::try_from(total).map_err(|_| bad)
}

/// Go's `Duration.Seconds()`, whose float rounding `int()` then truncates.
fn seconds_f64(d: i64) -> f64 {
    (d / NANOS) as f64 + (d % NANOS) as f64 / 1e9
}

/// `string(duration)`: the seconds as the shortest decimal, then `s`.
pub(crate) fn format_duration(d: i64) -> String {
    format!("{}s", seconds_f64(d))
}

pub(crate) fn duration_hours(d: i64) -> i64 {
    ((d / 3_600_000_000_000) as f64 + (d % 3_600_000_000_000) as f64 / 3.6e12) as i64
}

pub(crate) fn duration_minutes(d: i64) -> i64 {
    ((d / 60_000_000_000) as f64 + (d % 60_000_000_000) as f64 / 6e10) as i64
}

pub(crate) fn duration_seconds(d: i64) -> i64 {
    seconds_f64(d) as i64
}

pub(crate) fn duration_milliseconds(d: i64) -> i64 {
    d / 1_000_000
}

/// Go's `strconv.Atoi`.
fn atoi(s: &str) -> Result<i64, TimeError> {
    let digits = s.strip_prefix(['+', '-']).unwrap_or(s);
    let invalid = || TimeError::Zone(format!("strconv.Atoi: parsing {s:?}: invalid syntax"));
    if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return Err(invalid());
    }
    s.parse::<i64>()
        .map_err(|_| TimeError::Zone(format!("strconv.Atoi: parsing {s:?}: value out of range")))
}

/// The offset (seconds east of UTC) of the time zone argument of the timestamp
/// accessors at `ts`: cel-go's `inTimeZone`. Without a colon the argument is a zone
/// name for Go's `time.LoadLocation` (the system's zoneinfo, as Go reads it);
/// otherwise `[+-]hours:minutes`, parsed as leniently as cel-go does.
pub(crate) fn zone_offset(ts: &Timestamp, zone: &str) -> Result<i64, TimeError> {
    let Some(colon) = zone.find(':') else {
        return named_zone_offset(ts, zone);
    };
    let hours = atoi(&zone[..colon])?;
    let minutes = atoi(&zone[colon + 1..])?;
    let offset = if zone.starts_with('-') {
        hours.wrapping_mul(60).wrapping_sub(minutes)
    } else {
        hours.wrapping_mul(60).wrapping_add(minutes)
    };
    // time.Duration(offset) * time.Minute, then Seconds(), then int().
    Ok(seconds_f64(offset.wrapping_mul(60 * NANOS)) as i64)
}

fn named_zone_offset(ts: &Timestamp, name: &str) -> Result<i64, TimeError> {
    if name.is_empty() || name == "UTC" {
        return Ok(0);
    }
    let zone = if name == "Local" {
        jiff::tz::TimeZone::system()
    } else {
        if name.contains("..") || name.starts_with(['/', '\\']) {
            return Err(TimeError::Zone("time: invalid location name".into()));
        }
        // Go opens the file by its exact name; the database lookup ignores case.
        match jiff::tz::TimeZone::get(name) {
            Ok(zone) if zone.iana_name() == Some(name) => zone,
            _ => return Err(TimeError::Zone(format!("unknown time zone {name}"))),
        }
    };
    let instant = jiff::Timestamp::new(ts.secs, ts.nanos as i32)
        .map_err(|_| TimeError::Zone(format!("unknown time zone {name}")))?;
    Ok(i64::from(zone.to_offset(instant).seconds()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_like_go() {
        let ts = Timestamp::parse("2024-03-01T10:20:30.5+02:00").unwrap();
        assert_eq!(ts.format(), "2024-03-01T10:20:30.5+02:00");
        assert_eq!(ts.civil(0).hour, 8);
        assert_eq!(
            Timestamp::parse("2024-01-01T1:02:03Z").unwrap().format(),
            "2024-01-01T01:02:03Z"
        );
        assert_eq!(
            Timestamp::parse("2024-01-01T00:00:00,25-00:00").unwrap().format(),
            "2024-01-01T00:00:00.25Z"
        );
        assert_eq!(
            Timestamp::parse("2024-01-01T00:00:00.1234567891Z").unwrap().format(),
            "2024-01-01T00:00:00.123456789Z"
        );
        for bad in [
            "2023-02-29T00:00:00Z",
            "2024-01-01 00:00:00Z",
            "2024-01-01T00:00:00",
            "2024-1-01T00:00:00Z",
            "2024-01-01T24:00:00Z",
            "2024-01-01T00:00:00+25:00",
            "2024-01-01T00:00:00z",
            "bad",
        ] {
            assert!(Timestamp::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            Timestamp::parse("0000-01-01T00:00:00Z"),
            Err(TimeError::TimestampOverflow)
        );
        assert_eq!(Timestamp::parse("1970-01-01T00:00:00Z").unwrap().unix(), 0);
        assert_eq!(Timestamp::from_unix(0).unwrap().civil(0).week_day, 4);
    }

    #[test]
    fn durations_like_go() {
        assert_eq!(parse_duration("1h2m3.5s"), Ok(3_723_500_000_000));
        assert_eq!(parse_duration("-1.5h"), Ok(-5_400_000_000_000));
        assert_eq!(parse_duration("0"), Ok(0));
        assert_eq!(parse_duration(".5us"), Ok(500));
        assert_eq!(parse_duration("1µs1μs"), Ok(2_000));
        assert_eq!(parse_duration("-9223372036854775808ns"), Ok(i64::MIN));
        for bad in ["", "1", "1d", ".s", "9223372036854775808ns", "3000000h", "+", "1h 2m"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(format_duration(5_400_000_000_000), "5400s");
        assert_eq!(format_duration(1_500_000_000), "1.5s");
        assert_eq!(format_duration(-1), "-0.000000001s");
        assert_eq!(format_duration(0), "0s");
        assert_eq!(duration_hours(-5_400_000_000_000), -1);
    }

    #[test]
    fn zones() {
        let ts = Timestamp::parse("2024-07-01T12:00:00Z").unwrap();
        assert_eq!(zone_offset(&ts, "+02:30"), Ok(9000));
        assert_eq!(zone_offset(&ts, "-02:30"), Ok(-9000));
        assert_eq!(zone_offset(&ts, "-00:30"), Ok(-1800));
        assert_eq!(zone_offset(&ts, "UTC"), Ok(0));
        assert!(zone_offset(&ts, "a:00").is_err());
        assert!(zone_offset(&ts, "Mars/Olympus").is_err());
        assert!(zone_offset(&ts, "../etc").is_err());
    }

    #[test]
    fn arithmetic_overflow() {
        let max = Timestamp::parse("9999-12-31T23:59:59Z").unwrap();
        assert_eq!(max.add(NANOS), Err(TimeError::TimestampOverflow));
        assert_eq!(max.sub_duration(i64::MIN), Err(TimeError::IntOverflow));
        let min = Timestamp::parse("0001-01-01T00:00:00Z").unwrap();
        assert!(min.is_zero());
        assert_eq!(max.since(&min), Err(TimeError::IntOverflow));
        let a = Timestamp::parse("2024-01-01T00:00:00.25Z").unwrap();
        assert_eq!(a.add(-500_000_000).unwrap().format(), "2023-12-31T23:59:59.75Z");
    }
}
