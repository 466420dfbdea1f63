//! Semantic versions (semver 2.0.0): strict parsing, the Kubernetes normalising parser,
//! and precedence.

use std::cmp::Ordering;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Prerelease {
    Numeric(u64),
    Alpha(String),
}

#[derive(Clone, Debug)]
pub(crate) struct Semver {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
    pre: Vec<Prerelease>,
    /// Kept for completeness; build metadata never affects precedence.
    #[allow(dead_code)]
    build: Vec<String>,
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-'
}

fn number(part: &str, what: &str) -> Result<u64, String> {
    if !part.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("Invalid character(s) found in {what} number {part:?}"));
    }
    if part.len() > 1 && part.starts_with('0') {
        let mut name = what.to_string();
        if let Some(first) = name.get_mut(0..1) {
            first.make_ascii_uppercase();
        }
        return Err(format!("{name} number must not contain leading zeroes {part:?}"));
    }
    part.parse::<u64>()
        .map_err(|_| format!("invalid {what} number {part:?}"))
}

impl Semver {
    /// Strict semver 2.0.0.
    pub(crate) fn parse(text: &str) -> Result<Semver, String> {
        if text.is_empty() {
            return Err("Version string empty".into());
        }
        let mut parts = text.splitn(3, '.');
        let (Some(major), Some(minor), Some(rest)) = (parts.next(), parts.next(), parts.next()) else {
            return Err("No Major.Minor.Patch elements found".into());
        };
        let major = number(major, "major")?;
        let minor = number(minor, "minor")?;
        let mut patch = rest;
        let mut build = Vec::new();
        if let Some((p, b)) = patch.split_once('+') {
            for id in b.split('.') {
                if id.is_empty() {
                    return Err("Build meta data is empty".into());
                }
                if !id.chars().all(is_ident_char) {
                    return Err(format!("Invalid character(s) found in build meta data {id:?}"));
                }
                build.push(id.to_string());
            }
            patch = p;
        }
        let mut pre = Vec::new();
        if let Some((p, r)) = patch.split_once('-') {
            for id in r.split('.') {
                if id.is_empty() {
                    return Err("Prerelease is empty".into());
                }
                if id.bytes().all(|b| b.is_ascii_digit()) {
                    if id.len() > 1 && id.starts_with('0') {
                        return Err(format!(
                            "Numeric PreRelease version must not contain leading zeroes {id:?}"
                        ));
                    }
                    let n = id
                        .parse::<u64>()
                        .map_err(|_| format!("invalid prerelease number {id:?}"))?;
                    pre.push(Prerelease::Numeric(n));
                } else if id.chars().all(is_ident_char) {
                    pre.push(Prerelease::Alpha(id.to_string()));
                } else {
                    return Err(format!("Invalid character(s) found in prerelease {id:?}"));
                }
            }
            patch = p;
        }
        let patch = number(patch, "patch")?;
        Ok(Semver {
            major,
            minor,
            patch,
            pre,
            build,
        })
    }

    /// Kubernetes' tolerant form: strips one leading `v`, removes leading zeros of the
    /// three components and fills in a missing minor or patch.
    pub(crate) fn parse_normalized(text: &str) -> Result<Semver, String> {
        let text = text.strip_prefix('v').unwrap_or(text);
        let mut parts: Vec<String> = text
            .splitn(3, '.')
            .map(|p| {
                if p.len() > 1 {
                    let trimmed = p.trim_start_matches('0');
                    if trimmed.as_bytes().first().is_none_or(|b| !b.is_ascii_digit()) {
                        return format!("0{trimmed}");
                    }
                    return trimmed.to_string();
                }
                p.to_string()
            })
            .collect();
        if parts.len() < 3 {
            if parts.last().is_some_and(|p| p.contains(['+', '-'])) {
                return Err("short version cannot contain PreRelease/Build meta data".into());
            }
            while parts.len() < 3 {
                parts.push("0".into());
            }
        }
        Semver::parse(&parts.join("."))
    }
}

impl PartialEq for Semver {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Semver {}

impl PartialOrd for Semver {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Semver {
    /// Semver precedence: a version without prerelease ranks above one with it;
    /// numeric identifiers rank below alphanumeric ones.
    fn cmp(&self, other: &Self) -> Ordering {
        let core = (self.major, self.minor, self.patch).cmp(&(other.major, other.minor, other.patch));
        if core != Ordering::Equal {
            return core;
        }
        match (self.pre.is_empty(), other.pre.is_empty()) {
            (true, true) => return Ordering::Equal,
            (true, false) => return Ordering::Greater,
            (false, true) => return Ordering::Less,
            _ => {}
        }
        for (a, b) in self.pre.iter().zip(other.pre.iter()) {
            let ord = match (a, b) {
                (Prerelease::Numeric(x), Prerelease::Numeric(y)) => x.cmp(y),
                (Prerelease::Numeric(_), Prerelease::Alpha(_)) => Ordering::Less,
                (Prerelease::Alpha(_), Prerelease::Numeric(_)) => Ordering::Greater,
                (Prerelease::Alpha(x), Prerelease::Alpha(y)) => x.cmp(y),
            };
            if ord != Ordering::Equal {
                return ord;
            }
        }
        self.pre.len().cmp(&other.pre.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Semver {
        Semver::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn strict_parsing() {
        for ok in [
            "1.0.0",
            "0.1.0-alpha.1",
            "1.2.3+build.5",
            "1.2.3-rc.1+b",
            "10.20.30",
            "1.0.0-0A.is.legal",
        ] {
            assert!(Semver::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1",
            "1.2",
            "v1.2.3",
            "01.2.3",
            "1.02.3",
            "1.2.03",
            "1.2.3-",
            "1.2.3-01",
            "1.2.3+",
            "1.2.3-a..b",
            "1.2.3-a_b",
            "1.2.3 ",
            "a.b.c",
            "1.2.3.4",
        ] {
            assert!(Semver::parse(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn normalized_parsing() {
        assert_eq!(Semver::parse_normalized("v1.0").unwrap(), v("1.0.0"));
        assert_eq!(Semver::parse_normalized("01.01.01").unwrap(), v("1.1.1"));
        assert_eq!(Semver::parse_normalized("1").unwrap(), v("1.0.0"));
        assert_eq!(Semver::parse_normalized("00.0.0").unwrap(), v("0.0.0"));
        assert!(Semver::parse_normalized("1.0-alpha").is_err());
        assert!(Semver::parse_normalized("vv1.0.0").is_err());
    }

    #[test]
    fn precedence() {
        let ordered = [
            "1.0.0-alpha",
            "1.0.0-alpha.1",
            "1.0.0-alpha.beta",
            "1.0.0-beta",
            "1.0.0-beta.2",
            "1.0.0-beta.11",
            "1.0.0-rc.1",
            "1.0.0",
            "1.0.1",
            "1.1.0",
            "2.0.0",
        ];
        for pair in ordered.windows(2) {
            assert!(v(pair[0]) < v(pair[1]), "{} < {}", pair[0], pair[1]);
        }
        assert_eq!(v("1.0.0+a"), v("1.0.0+b"));
    }
}
