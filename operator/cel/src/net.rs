//! `net.IP` and `net.CIDR` of the Kubernetes IP and CIDR libraries: Go's `netip.Addr`
//! and `netip.Prefix`, parsed and printed as Go does, with the libraries' refusals
//! (zones, IPv4-mapped IPv6 addresses).

use std::fmt;

use thiserror::Error;

#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{0}")]
pub(crate) struct NetError(String);

/// An IPv4 or IPv6 address (no zone: the libraries refuse zones).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ip {
    V4([u8; 4]),
    V6([u8; 16]),
}

/// A prefix as written: the address keeps its host bits until `masked()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cidr {
    pub ip: Ip,
    pub bits: u8,
}

/// Go's `%q` quoting, which these messages use.
fn q(s: &str) -> String {
    crate::quote::go_quote(s.as_bytes())
}

fn addr_error(input: &str, msg: &str) -> String {
    format!("ParseAddr({}): {msg}", q(input))
}

/// Go's message for an error found at `at`, the rest of the input.
fn addr_error_at(input: &str, msg: &str, at: &str) -> String {
    if at.is_empty() {
        return addr_error(input, msg);
    }
    format!("ParseAddr({}): {msg} (at {})", q(input), q(at))
}

/// `netip.ParseAddr`: (address, has a zone).
pub(crate) fn parse_addr(s: &str) -> Result<(Ip, bool), String> {
    for c in s.bytes() {
        match c {
            b'.' => return parse_v4(s, s).map(|a| (Ip::V4(a), false)),
            b':' => return parse_v6(s),
            b'%' => return Err(addr_error(s, "missing IPv6 address")),
            _ => {}
        }
    }
    Err(addr_error(s, "unable to parse IP"))
}

fn parse_v4(input: &str, s: &str) -> Result<[u8; 4], String> {
    let b = s.as_bytes();
    let mut fields = [0u8; 4];
    let (mut val, mut pos, mut digits) = (0u32, 0usize, 0);
    for (i, &c) in b.iter().enumerate() {
        if c.is_ascii_digit() {
            if digits == 1 && val == 0 {
                return Err(addr_error(input, "IPv4 field has octet with leading zero"));
            }
            val = val * 10 + u32::from(c - b'0');
            digits += 1;
            if val > 255 {
                return Err(addr_error(input, "IPv4 field has value >255"));
            }
        } else if c == b'.' {
            if i == 0 || i == b.len() - 1 || b[i - 1] == b'.' {
                return Err(addr_error_at(input, "IPv4 field must have at least one digit", &s[i..]));
            }
            if pos == 3 {
                return Err(addr_error(input, "IPv4 address too long"));
            }
            fields[pos] = val as u8;
            pos += 1;
            val = 0;
            digits = 0;
        } else {
            return Err(addr_error_at(input, "unexpected character", &s[i..]));
        }
    }
    if pos < 3 {
        return Err(addr_error(input, "IPv4 address too short"));
    }
    fields[3] = val as u8;
    Ok(fields)
}

fn parse_v6(input: &str) -> Result<(Ip, bool), String> {
    let (mut s, zone) = match input.find('%') {
        Some(i) if i + 1 == input.len() => return Err(addr_error(input, "zone must be a non-empty string")),
        Some(i) => (&input[..i], true),
        None => (input, false),
    };
    let mut ip = [0u8; 16];
    let mut ellipsis: Option<usize> = None;
    if s.starts_with("::") {
        ellipsis = Some(0);
        s = &s[2..];
        if s.is_empty() {
            return Ok((Ip::V6(ip), zone));
        }
    }
    let mut i = 0;
    while i < 16 {
        let b = s.as_bytes();
        let mut off = 0;
        let mut acc: u32 = 0;
        while off < b.len() {
            let Some(d) = (b[off] as char).to_digit(16) else {
                break;
            };
            acc = (acc << 4) + d;
            if off > 3 {
                return Err(addr_error_at(input, "each group must have 4 or less digits", s));
            }
            if acc > 0xffff {
                return Err(addr_error_at(input, "IPv6 field has value >=2^16", s));
            }
            off += 1;
        }
        if off == 0 {
            return Err(addr_error_at(
                input,
                "each colon-separated field must have at least one digit",
                s,
            ));
        }
        if b.get(off) == Some(&b'.') {
            if ellipsis.is_none() && i != 12 {
                return Err(addr_error_at(
                    input,
                    "embedded IPv4 address must replace the final 2 fields of the address",
                    s,
                ));
            }
            if i + 4 > 16 {
                return Err(addr_error_at(
                    input,
                    "too many hex fields to fit an embedded IPv4 at the end of the address",
                    s,
                ));
            }
            ip[i..i + 4].copy_from_slice(&parse_v4(input, s)?);
            s = "";
            i += 4;
            break;
        }
        ip[i] = (acc >> 8) as u8;
        ip[i + 1] = acc as u8;
        i += 2;
        s = &s[off..];
        if s.is_empty() {
            break;
        }
        if !s.starts_with(':') {
            return Err(addr_error_at(input, "unexpected character, want colon", s));
        } else if s.len() == 1 {
            return Err(addr_error_at(input, "colon must be followed by more characters", s));
        }
        s = &s[1..];
        if s.starts_with(':') {
            if ellipsis.is_some() {
                return Err(addr_error_at(input, "multiple :: in address", s));
            }
            ellipsis = Some(i);
            s = &s[1..];
            if s.is_empty() {
                break;
            }
        }
    }
    if !s.is_empty() {
        return Err(addr_error_at(input, "trailing garbage after address", s));
    }
    if i < 16 {
        let Some(e) = ellipsis else {
            return Err(addr_error(input, "address string too short"));
        };
        let n = 16 - i;
        ip.copy_within(e..i, e + n);
        ip[e..e + n].fill(0);
    } else if ellipsis.is_some() {
        return Err(addr_error(input, "the :: must expand to at least one field of zeros"));
    }
    Ok((Ip::V6(ip), zone))
}

impl Ip {
    /// The IP library's `parseIPAddr`.
    pub(crate) fn parse(s: &str) -> Result<Ip, NetError> {
        let (ip, zone) = parse_addr(s).map_err(|e| {
            NetError(format!(
                "IP Address {} parse error during conversion from string: {e}",
                q(s)
            ))
        })?;
        if zone {
            return Err(NetError(format!("IP address {} with zone value is not allowed", q(s))));
        }
        if ip.is_4in6() {
            return Err(NetError(format!("IPv4-mapped IPv6 address {} is not allowed", q(s))));
        }
        Ok(ip)
    }

    fn is_4in6(&self) -> bool {
        matches!(self, Ip::V6(b) if b[..10] == [0; 10] && b[10] == 0xff && b[11] == 0xff)
    }

    pub(crate) fn family(&self) -> i64 {
        match self {
            Ip::V4(_) => 4,
            Ip::V6(_) => 6,
        }
    }

    fn bit_len(&self) -> u8 {
        match self {
            Ip::V4(_) => 32,
            Ip::V6(_) => 128,
        }
    }

    fn as_u128(&self) -> u128 {
        match self {
            Ip::V4(b) => u128::from(u32::from_be_bytes(*b)),
            Ip::V6(b) => u128::from_be_bytes(*b),
        }
    }

    fn with_bits(&self, v: u128) -> Ip {
        match self {
            Ip::V4(_) => Ip::V4((v as u32).to_be_bytes()),
            Ip::V6(_) => Ip::V6(v.to_be_bytes()),
        }
    }

    pub(crate) fn is_unspecified(&self) -> bool {
        self.as_u128() == 0
    }

    pub(crate) fn is_loopback(&self) -> bool {
        match self {
            Ip::V4(b) => b[0] == 127,
            Ip::V6(_) => self.as_u128() == 1,
        }
    }

    fn is_multicast(&self) -> bool {
        match self {
            Ip::V4(b) => b[0] & 0xf0 == 0xe0,
            Ip::V6(b) => b[0] == 0xff,
        }
    }

    pub(crate) fn is_link_local_multicast(&self) -> bool {
        match self {
            Ip::V4(b) => b[..3] == [224, 0, 0],
            Ip::V6(b) => b[0] == 0xff && b[1] & 0x0f == 0x02,
        }
    }

    pub(crate) fn is_link_local_unicast(&self) -> bool {
        match self {
            Ip::V4(b) => b[..2] == [169, 254],
            Ip::V6(b) => b[0] == 0xfe && b[1] & 0xc0 == 0x80,
        }
    }

    /// Go's rule: private and unique-local addresses count as global unicast.
    pub(crate) fn is_global_unicast(&self) -> bool {
        if let Ip::V4(b) = self
            && (*b == [0; 4] || *b == [255; 4])
        {
            return false;
        }
        !self.is_unspecified() && !self.is_loopback() && !self.is_multicast() && !self.is_link_local_unicast()
    }
}

/// Go's `netip.Addr.String`: dotted quads, or RFC 5952 for IPv6.
impl fmt::Display for Ip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = match self {
            Ip::V4(b) => return write!(f, "{}.{}.{}.{}", b[0], b[1], b[2], b[3]),
            Ip::V6(b) => b,
        };
        let groups: Vec<u16> = b.chunks(2).map(|c| u16::from_be_bytes([c[0], c[1]])).collect();
        // The longest run of at least two zero groups, the first of equal runs.
        let (mut best, mut best_len) = (8, 1);
        let mut i = 0;
        while i < 8 {
            let start = i;
            while i < 8 && groups[i] == 0 {
                i += 1;
            }
            if i - start > best_len {
                best = start;
                best_len = i - start;
            }
            i += 1;
        }
        let mut i = 0;
        while i < 8 {
            if i == best {
                f.write_str("::")?;
                i += best_len;
                continue;
            }
            if i > 0 && (best == 8 || i != best + best_len) {
                f.write_str(":")?;
            }
            write!(f, "{:x}", groups[i])?;
            i += 1;
        }
        Ok(())
    }
}

/// `cidr()` and `parseCIDR` each prefix the error with this.
const PREFIX_ERROR: &str = "network address parse error during conversion from string: ";

impl Cidr {
    /// The CIDR library's `parseCIDR` (`netip.ParsePrefix`, no IPv4-mapped addresses).
    pub(crate) fn parse(s: &str) -> Result<Cidr, NetError> {
        let wrap = |msg: String| {
            NetError(format!(
                "{PREFIX_ERROR}{PREFIX_ERROR}netip.ParsePrefix({}): {msg}",
                q(s)
            ))
        };
        let Some(slash) = s.rfind('/') else {
            return Err(wrap("no '/'".into()));
        };
        let (ip, zone) = parse_addr(&s[..slash]).map_err(wrap)?;
        if zone {
            return Err(wrap("IPv6 zones cannot be present in a prefix".into()));
        }
        let bits = &s[slash + 1..];
        let bad_bits = || wrap(format!("bad bits after slash: {}", q(bits)));
        if bits.len() > 1 && !matches!(bits.as_bytes()[0], b'1'..=b'9') {
            return Err(bad_bits());
        }
        // strconv.Atoi: an optional sign, then digits.
        let digits = bits.strip_prefix(['+', '-']).unwrap_or(bits);
        if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
            return Err(bad_bits());
        }
        let bits: i64 = bits.parse().map_err(|_| bad_bits())?;
        if bits < 0 || bits > i64::from(ip.bit_len()) {
            return Err(wrap("prefix length out of range".into()));
        }
        if ip.is_4in6() {
            return Err(NetError(format!(
                "{PREFIX_ERROR}IPv4-mapped IPv6 address {} is not allowed",
                q(s)
            )));
        }
        Ok(Cidr { ip, bits: bits as u8 })
    }

    fn mask(&self) -> u128 {
        let len = u32::from(self.ip.bit_len());
        let host = len - u32::from(self.bits);
        let all = if len == 128 { u128::MAX } else { (1u128 << len) - 1 };
        if host >= 128 { 0 } else { all & !((1u128 << host) - 1) }
    }

    pub(crate) fn masked(&self) -> Cidr {
        Cidr {
            ip: self.ip.with_bits(self.ip.as_u128() & self.mask()),
            bits: self.bits,
        }
    }

    /// `netip.Prefix.Contains`: same family, same masked bits.
    pub(crate) fn contains(&self, ip: &Ip) -> bool {
        self.ip.family() == ip.family() && (self.ip.as_u128() ^ ip.as_u128()) & self.mask() == 0
    }

    /// `containsCIDR`: the prefixes overlap and `other` is at least as long.
    pub(crate) fn contains_cidr(&self, other: &Cidr) -> bool {
        if self.ip.family() != other.ip.family() {
            return false;
        }
        let shorter = if self.bits <= other.bits { self } else { other };
        let overlaps = (self.ip.as_u128() ^ other.ip.as_u128()) & shorter.mask() == 0;
        overlaps && self.bits <= other.bits
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.ip, self.bits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_like_go() {
        for (input, shown) in [
            ("10.0.0.1", "10.0.0.1"),
            ("2001:DB8::1", "2001:db8::1"),
            ("::", "::"),
            ("::1", "::1"),
            ("1:0:0:2:0:0:0:3", "1:0:0:2::3"),
            ("1:0:0:2:0:0:3:4", "1::2:0:0:3:4"),
            ("1:2:3:4:5:6:7:0", "1:2:3:4:5:6:7:0"),
            ("::1.2.3.4", "::102:304"),
            ("0:0:0:0:0:0:0:0", "::"),
        ] {
            assert_eq!(
                Ip::parse(input).map(|ip| ip.to_string()),
                Ok(shown.to_string()),
                "{input}"
            );
        }
        for bad in [
            "010.0.0.1",
            "10.0.0",
            "10.0.0.256",
            "1.2.3.4.5",
            "::ffff:1.2.3.4",
            "fe80::1%eth0",
            "1::2::3",
            "12345::",
            "1:2:3:4:5:6:7:8:9",
            "1:2:3:4:5:6:7::8",
            "",
            "a",
            "1.2.3.4%x",
        ] {
            assert!(Ip::parse(bad).is_err(), "{bad}");
        }
        assert!(Ip::parse("10.1.2.3").unwrap().is_global_unicast());
        assert!(!Ip::parse("255.255.255.255").unwrap().is_global_unicast());
        assert!(Ip::parse("ff02::1").unwrap().is_link_local_multicast());
        assert!(Ip::parse("fe80::1").unwrap().is_link_local_unicast());
    }

    #[test]
    fn prefixes_like_go() {
        let c = Cidr::parse("10.1.2.3/8").unwrap();
        assert_eq!(c.to_string(), "10.1.2.3/8");
        assert_eq!(c.masked().to_string(), "10.0.0.0/8");
        assert!(c.contains(&Ip::parse("10.200.0.1").unwrap()));
        assert!(!c.contains(&Ip::parse("11.0.0.1").unwrap()));
        assert!(c.contains_cidr(&Cidr::parse("10.1.0.0/16").unwrap()));
        assert!(!Cidr::parse("10.1.0.0/16").unwrap().contains_cidr(&c));
        assert!(
            Cidr::parse("::/0")
                .unwrap()
                .contains(&Ip::parse("2001:db8::1").unwrap())
        );
        assert!(!Cidr::parse("0.0.0.0/0").unwrap().contains(&Ip::parse("::1").unwrap()));
        for bad in [
            "10.0.0.0/33",
            "10.0.0.0/08",
            "10.0.0.0",
            "10.0.0.0/",
            "10.0.0.0/-1",
            "::ffff:1.2.3.4/96",
            "fe80::1%1/64",
        ] {
            assert!(Cidr::parse(bad).is_err(), "{bad}");
        }
    }
}
