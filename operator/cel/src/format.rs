//! `kubernetes.NamedFormat` of the Kubernetes format library: the named formats and
//! their validators, with the messages of apimachinery (`util/validation` for the DNS
//! names, `api/validate/content` for qualified names and label values), Go's
//! `ParseRequestURI` for `uri` and kube-openapi's strfmt for `uuid`, `byte`, `date` and
//! `datetime`.

/// A named format; equal formats have the same name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NamedFormat {
    Dns1123Label,
    Dns1123Subdomain,
    Dns1035Label,
    QualifiedName,
    Dns1123LabelPrefix,
    Dns1123SubdomainPrefix,
    Dns1035LabelPrefix,
    LabelValue,
    Uri,
    Uuid,
    Byte,
    Date,
    Datetime,
}

impl NamedFormat {
    /// The names `format.named` knows (and the `format.<name>()` functions).
    pub(crate) fn named(name: &str) -> Option<NamedFormat> {
        Some(match name {
            "dns1123Label" => NamedFormat::Dns1123Label,
            "dns1123Subdomain" => NamedFormat::Dns1123Subdomain,
            "dns1035Label" => NamedFormat::Dns1035Label,
            "qualifiedName" => NamedFormat::QualifiedName,
            "dns1123LabelPrefix" => NamedFormat::Dns1123LabelPrefix,
            "dns1123SubdomainPrefix" => NamedFormat::Dns1123SubdomainPrefix,
            "dns1035LabelPrefix" => NamedFormat::Dns1035LabelPrefix,
            "labelValue" => NamedFormat::LabelValue,
            "uri" => NamedFormat::Uri,
            "uuid" => NamedFormat::Uuid,
            "byte" => NamedFormat::Byte,
            "date" => NamedFormat::Date,
            "datetime" => NamedFormat::Datetime,
            _ => return None,
        })
    }

    /// The validation errors of `s`; empty when it is valid.
    pub(crate) fn validate(self, s: &str) -> Vec<String> {
        let b = s.as_bytes();
        match self {
            NamedFormat::Dns1123Label => dns1123_label(b),
            NamedFormat::Dns1123Subdomain => dns1123_subdomain(b, CHARACTERS),
            NamedFormat::Dns1035Label => dns1035_label(b),
            NamedFormat::QualifiedName => label_key(b),
            NamedFormat::Dns1123LabelPrefix => dns1123_label(&mask_trailing_dash(b)),
            NamedFormat::Dns1123SubdomainPrefix => dns1123_subdomain(&mask_trailing_dash(b), CHARACTERS),
            NamedFormat::Dns1035LabelPrefix => dns1035_label(&mask_trailing_dash(b)),
            NamedFormat::LabelValue => label_value(b),
            NamedFormat::Uri => match crate::url::parse_request_uri(s) {
                Ok(_) => Vec::new(),
                Err(e) => vec![e],
            },
            NamedFormat::Uuid => failing(is_uuid(b), "does not match the UUID format"),
            NamedFormat::Byte => failing(is_base64(b), "invalid base64"),
            NamedFormat::Date => failing(is_date(b), "invalid date"),
            NamedFormat::Datetime => failing(is_datetime(s), "invalid datetime"),
        }
    }
}

fn failing(valid: bool, message: &str) -> Vec<String> {
    if valid { Vec::new() } else { vec![message.to_string()] }
}

/// apimachinery's `maskTrailingDash`, as written: it drops the last two bytes.
fn mask_trailing_dash(b: &[u8]) -> Vec<u8> {
    if b.len() > 1 && b.ends_with(b"-") {
        let mut out = b[..b.len() - 2].to_vec();
        out.push(b'a');
        return out;
    }
    b.to_vec()
}

/// `util/validation` says "characters", `api/validate/content` says "bytes".
const CHARACTERS: &str = "characters";
const BYTES: &str = "bytes";

fn max_len_error(length: usize, unit: &str) -> String {
    format!("must be no more than {length} {unit}")
}

fn regex_error(msg: &str, re: &str, examples: &[&str]) -> String {
    let shown: Vec<String> = examples.iter().map(|e| format!("'{e}', ")).collect();
    format!("{msg} (e.g. {}regex used for validation is '{re}')", shown.join(" or "))
}

const DNS1123_LABEL_FMT: &str = "[a-z0-9]([-a-z0-9]*[a-z0-9])?";
const DNS1123_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character";
const DNS1123_SUBDOMAIN_FMT: &str = "[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*";
const DNS1123_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character";
const DNS1035_LABEL_FMT: &str = "[a-z]([-a-z0-9]*[a-z0-9])?";
const DNS1035_LABEL_MSG: &str = "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric character";
const LABEL_KEY_FMT: &str = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]";
const LABEL_KEY_MSG: &str =
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character";
const LABEL_VALUE_FMT: &str = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?";
const LABEL_VALUE_MSG: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character";

/// `first (middle* last)?` over bytes, as the validators' anchored regexes match.
fn shaped(b: &[u8], first: fn(u8) -> bool, middle: fn(u8) -> bool, last: fn(u8) -> bool) -> bool {
    match b {
        [] => false,
        [only] => first(*only),
        [f, mid @ .., l] => first(*f) && mid.iter().all(|&c| middle(c)) && last(*l),
    }
}

fn lower_alnum(c: u8) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit()
}

fn lower_alnum_dash(c: u8) -> bool {
    lower_alnum(c) || c == b'-'
}

fn is_label(b: &[u8]) -> bool {
    shaped(b, lower_alnum, lower_alnum_dash, lower_alnum)
}

fn is_subdomain(b: &[u8]) -> bool {
    b.split(|&c| c == b'.').all(is_label)
}

fn dns1123_label(b: &[u8]) -> Vec<String> {
    let mut errs = Vec::new();
    if b.len() > 63 {
        errs.push(max_len_error(63, CHARACTERS));
    }
    if !is_label(b) {
        if is_subdomain(b) {
            errs.push("must not contain dots".to_string());
        } else {
            errs.push(regex_error(
                DNS1123_LABEL_MSG,
                DNS1123_LABEL_FMT,
                &["my-name", "123-abc"],
            ));
        }
    }
    errs
}

fn dns1123_subdomain(b: &[u8], unit: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if b.len() > 253 {
        errs.push(max_len_error(253, unit));
    }
    if !is_subdomain(b) {
        errs.push(regex_error(
            DNS1123_SUBDOMAIN_MSG,
            DNS1123_SUBDOMAIN_FMT,
            &["example.com"],
        ));
    }
    errs
}

fn dns1035_label(b: &[u8]) -> Vec<String> {
    let mut errs = Vec::new();
    if b.len() > 63 {
        errs.push(max_len_error(63, CHARACTERS));
    }
    if !shaped(b, |c| c.is_ascii_lowercase(), lower_alnum_dash, lower_alnum) {
        errs.push(regex_error(
            DNS1035_LABEL_MSG,
            DNS1035_LABEL_FMT,
            &["my-name", "abc-123"],
        ));
    }
    errs
}

fn is_label_name(b: &[u8]) -> bool {
    let ext = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.');
    shaped(b, |c| c.is_ascii_alphanumeric(), ext, |c| c.is_ascii_alphanumeric())
}

/// `content.IsLabelKey`, which is the qualified name validator.
fn label_key(b: &[u8]) -> Vec<String> {
    let examples = ["MyName", "my.name", "123-abc"];
    let mut errs = Vec::new();
    let parts: Vec<&[u8]> = b.split(|&c| c == b'/').collect();
    let name = match parts.as_slice() {
        [name] => *name,
        [prefix, name] => {
            if prefix.is_empty() {
                errs.push("prefix part must be non-empty".to_string());
            } else {
                errs.extend(
                    dns1123_subdomain(prefix, BYTES)
                        .into_iter()
                        .map(|m| format!("prefix part {m}")),
                );
            }
            *name
        }
        _ => {
            return vec![format!(
                "a valid label key {} with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')",
                regex_error(LABEL_KEY_MSG, LABEL_KEY_FMT, &examples)
            )];
        }
    };
    if name.is_empty() {
        errs.push("name part must be non-empty".to_string());
    } else if name.len() > 63 {
        errs.push(format!("name part {}", max_len_error(63, BYTES)));
    }
    if !is_label_name(name) {
        errs.push(format!(
            "name part {}",
            regex_error(LABEL_KEY_MSG, LABEL_KEY_FMT, &examples)
        ));
    }
    errs
}

fn label_value(b: &[u8]) -> Vec<String> {
    let mut errs = Vec::new();
    if b.len() > 63 {
        errs.push(max_len_error(63, BYTES));
    }
    if !b.is_empty() && !is_label_name(b) {
        errs.push(regex_error(
            LABEL_VALUE_MSG,
            LABEL_VALUE_FMT,
            &["MyValue", "my_value", "12345"],
        ));
    }
    errs
}

/// strfmt's `UUIDPattern`: 8-4-4-4-12 hex digits, each dash optional, any case.
fn is_uuid(b: &[u8]) -> bool {
    let mut i = 0;
    for (n, group) in [8, 4, 4, 4, 12].into_iter().enumerate() {
        if n > 0 && b.get(i) == Some(&b'-') {
            i += 1;
        }
        if b.len() < i + group || !b[i..i + group].iter().all(u8::is_ascii_hexdigit) {
            return false;
        }
        i += group;
    }
    i == b.len()
}

/// govalidator's base64 pattern: whole groups of four, the last one maybe padded.
fn is_base64(b: &[u8]) -> bool {
    let alphabet = |c: &u8| c.is_ascii_alphanumeric() || *c == b'+' || *c == b'/';
    if b.is_empty() || !b.len().is_multiple_of(4) {
        return false;
    }
    let (body, last) = b.split_at(b.len() - 4);
    body.iter().all(alphabet)
        && match last {
            [x, y, b'=', b'='] => alphabet(x) && alphabet(y),
            [x, y, z, b'='] => alphabet(x) && alphabet(y) && alphabet(z),
            _ => last.iter().all(alphabet),
        }
}

/// `time.Parse("2006-01-02", s)` succeeds: four-digit year, two-digit month and day,
/// a real calendar date.
fn is_date(b: &[u8]) -> bool {
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return false;
    }
    let digits = |r: std::ops::Range<usize>| -> Option<i64> {
        b[r].iter().try_fold(0i64, |acc, &c| {
            c.is_ascii_digit().then(|| acc * 10 + i64::from(c - b'0'))
        })
    };
    let (Some(year), Some(month), Some(day)) = (digits(0..4), digits(5..7), digits(8..10)) else {
        return false;
    };
    if !(1..=12).contains(&month) {
        return false;
    }
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days = match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    };
    (1..=days).contains(&day)
}

/// strfmt's `IsDateTime`: lowercased and split at every `t`, the first piece a date,
/// the second matching `DateTimePattern` with hours, minutes and seconds compared as
/// text; later pieces are not looked at.
fn is_datetime(s: &str) -> bool {
    if s.len() < 4 {
        return false;
    }
    let lower = s.to_lowercase();
    let pieces: Vec<&str> = lower.split('t').collect();
    if pieces.len() < 2 || !is_date(pieces[0].as_bytes()) {
        return false;
    }
    let time = pieces[1];
    let b = time.as_bytes();
    let two_digits = |i: usize| b.len() >= i + 2 && b[i].is_ascii_digit() && b[i + 1].is_ascii_digit();
    if !(two_digits(0) && b.get(2) == Some(&b':') && two_digits(3) && b.get(5) == Some(&b':') && two_digits(6)) {
        return false;
    }
    let zone = |rest: &str| {
        let z = rest.as_bytes();
        rest == "z"
            || (z.len() == 6
                && matches!(z[0], b'+' | b'-')
                && z[1].is_ascii_digit()
                && z[2].is_ascii_digit()
                && z[3] == b':'
                && z[4].is_ascii_digit()
                && z[5].is_ascii_digit())
    };
    let rest = &time[8..];
    // `(.[0-9]+)?`: any character but a newline, then digits; a zone never starts
    // with a digit, so the digits run as far as they go.
    let fraction = rest.chars().next().filter(|&c| c != '\n').and_then(|c| {
        let after = &rest[c.len_utf8()..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        (digits > 0).then(|| &after[digits..])
    });
    let matched = zone(rest) || fraction.is_some_and(zone);
    matched && &time[0..2] <= "23" && &time[3..5] <= "59" && &time[6..8] <= "59"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(f: NamedFormat, s: &str) -> Vec<String> {
        f.validate(s)
    }

    #[test]
    fn dns_names_like_apimachinery() {
        assert!(errors(NamedFormat::Dns1123Label, "my-label").is_empty());
        assert_eq!(
            errors(NamedFormat::Dns1123Label, "My_Label"),
            [
                "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
            ]
        );
        assert_eq!(errors(NamedFormat::Dns1123Label, "a.b"), ["must not contain dots"]);
        assert_eq!(
            errors(NamedFormat::Dns1123Label, &"a".repeat(64)),
            ["must be no more than 63 characters"]
        );
        assert!(errors(NamedFormat::Dns1123Subdomain, "apiextensions.k8s.io").is_empty());
        assert_eq!(errors(NamedFormat::Dns1123Subdomain, "a..b").len(), 1);
        assert!(errors(NamedFormat::Dns1035Label, "1abc").len() == 1);
        // The prefix variants replace the last two bytes by "a".
        assert!(errors(NamedFormat::Dns1123LabelPrefix, "my-label-prefix-").is_empty());
        assert!(errors(NamedFormat::Dns1123LabelPrefix, "a.-").is_empty());
        assert!(errors(NamedFormat::Dns1123SubdomainPrefix, "mysubdomain.prefix.-").is_empty());
        assert_eq!(errors(NamedFormat::Dns1035LabelPrefix, "-").len(), 1);
    }

    #[test]
    fn qualified_names_and_label_values_like_apimachinery() {
        assert!(errors(NamedFormat::QualifiedName, "apiextensions.k8s.io/v1beta1").is_empty());
        assert_eq!(
            errors(NamedFormat::QualifiedName, "/a"),
            ["prefix part must be non-empty"]
        );
        assert_eq!(errors(NamedFormat::QualifiedName, "a/").len(), 2);
        assert_eq!(errors(NamedFormat::QualifiedName, "a/b/c").len(), 1);
        assert_eq!(
            errors(NamedFormat::QualifiedName, &format!("{}/a", "b".repeat(254))),
            ["prefix part must be no more than 253 bytes"]
        );
        assert!(errors(NamedFormat::LabelValue, "").is_empty());
        assert_eq!(errors(NamedFormat::LabelValue, "-a").len(), 1);
        assert_eq!(
            errors(NamedFormat::LabelValue, &"a".repeat(64)),
            ["must be no more than 63 bytes"]
        );
    }

    #[test]
    fn strfmt_formats() {
        assert!(is_uuid(b"123e4567-e89b-12d3-a456-426614174000"));
        assert!(is_uuid(b"123E4567E89B12D3A456426614174000"));
        assert!(!is_uuid(b"123e4567-e89b-12d3-a456-42661417400"));
        assert!(!is_uuid(b"123e4567--e89b-12d3-a456-426614174000"));
        assert!(is_base64(b"aGVsbG8="));
        assert!(is_base64(b"aGVs"));
        assert!(!is_base64(b""));
        assert!(!is_base64(b"aGVsbG8"));
        assert!(!is_base64(b"a=Vs"));
        assert!(is_date(b"2024-02-29"));
        assert!(!is_date(b"2023-02-29"));
        assert!(!is_date(b"2021-1-01"));
        assert!(is_datetime("2021-01-01T00:00:00Z"));
        assert!(is_datetime("2021-01-01t23:59:59.123+05:00"));
        assert!(is_datetime("2021-01-01T00:00:00-1+05:00"));
        assert!(is_datetime("2021-01-01T00:00:00ZTanything"));
        assert!(!is_datetime("2021-01-01T24:00:00Z"));
        assert!(!is_datetime("2021-01-01T00:00:00"));
        assert!(!is_datetime("2021-01-01 00:00:00Z"));
        assert_eq!(
            errors(NamedFormat::Uri, "not a url"),
            ["parse \"not a url\": invalid URI for request"]
        );
    }
}
