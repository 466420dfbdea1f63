//! `kubernetes.URL` of the Kubernetes URL library: Go's `net/url` as the library uses
//! it (`ParseRequestURI` to accept, `Parse` to build the value), with Go's escaping,
//! `Hostname`, `Port`, `EscapedPath`, `Query` and `String` (which equality compares).
//!
//! Go strings are bytes: unescaping may produce invalid UTF-8 (`%ff`), kept as bytes
//! here and shown with U+FFFD replacements when a string reaches an expression.

use std::collections::BTreeMap;

use thiserror::Error;

#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{0}")]
pub(crate) struct UrlError(pub String);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Path,
    Host,
    Zone,
    UserPassword,
    QueryComponent,
    Fragment,
}

/// Go's `shouldEscape` (the source of its generated encoding table).
fn should_escape(c: u8, mode: Mode) -> bool {
    if c.is_ascii_alphanumeric() {
        return false;
    }
    if matches!(mode, Mode::Host | Mode::Zone)
        && matches!(
            c,
            b'!' | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
                | b':'
                | b'['
                | b']'
                | b'<'
                | b'>'
                | b'"'
        )
    {
        return false;
    }
    match c {
        b'-' | b'_' | b'.' | b'~' => return false,
        b'$' | b'&' | b'+' | b',' | b'/' | b':' | b';' | b'=' | b'?' | b'@' => match mode {
            Mode::Path => return c == b'?',
            Mode::UserPassword => return matches!(c, b'@' | b'/' | b'?' | b':'),
            Mode::QueryComponent => return true,
            Mode::Fragment => return false,
            Mode::Host | Mode::Zone => {}
        },
        _ => {}
    }
    if mode == Mode::Fragment && matches!(c, b'!' | b'(' | b')' | b'*') {
        return false;
    }
    true
}

fn unhex(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        _ => c - b'A' + 10,
    }
}

fn escape_error(s: &[u8]) -> String {
    format!("invalid URL escape {}", crate::quote::go_quote(s))
}

/// Go's `unescape`.
fn unescape(s: &[u8], mode: Mode) -> Result<Vec<u8>, String> {
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'%' => {
                if i + 2 >= s.len() || !s[i + 1].is_ascii_hexdigit() || !s[i + 2].is_ascii_hexdigit() {
                    let end = (i + 3).min(s.len());
                    return Err(escape_error(&s[i..end]));
                }
                if mode == Mode::Host && unhex(s[i + 1]) < 8 && &s[i..i + 3] != b"%25" {
                    return Err(escape_error(&s[i..i + 3]));
                }
                if mode == Mode::Zone {
                    let v = (unhex(s[i + 1]) << 4) | unhex(s[i + 2]);
                    if &s[i..i + 3] != b"%25" && v != b' ' && should_escape(v, Mode::Host) {
                        return Err(escape_error(&s[i..i + 3]));
                    }
                }
                i += 3;
            }
            c => {
                if matches!(mode, Mode::Host | Mode::Zone) && c < 0x80 && should_escape(c, mode) {
                    return Err(format!(
                        "invalid character {} in host name",
                        crate::quote::go_quote(&s[i..i + 1])
                    ));
                }
                i += 1;
            }
        }
    }
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'%' => {
                out.push((unhex(s[i + 1]) << 4) | unhex(s[i + 2]));
                i += 3;
            }
            b'+' if mode == Mode::QueryComponent => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    Ok(out)
}

/// Go's `escape`: the result is ASCII.
fn escape(s: &[u8], mode: Mode) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(s.len());
    for &c in s {
        if c == b' ' && mode == Mode::QueryComponent {
            out.push('+');
        } else if should_escape(c, mode) {
            out.push('%');
            out.push(HEX[usize::from(c >> 4)] as char);
            out.push(HEX[usize::from(c & 15)] as char);
        } else {
            out.push(c as char);
        }
    }
    out
}

/// `validEncoded`: no byte that would need escaping, beyond the sub-delimiters.
fn valid_encoded(s: &str, mode: Mode) -> bool {
    s.bytes().all(|c| {
        matches!(
            c,
            b'!' | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
                | b':'
                | b'@'
                | b'['
                | b']'
                | b'%'
        ) || !should_escape(c, mode)
    })
}

fn valid_optional_port(port: &[u8]) -> bool {
    match port.split_first() {
        None => true,
        Some((b':', digits)) => digits.iter().all(u8::is_ascii_digit),
        Some(_) => false,
    }
}

fn valid_userinfo(s: &str) -> bool {
    s.chars().all(|c| {
        c.is_ascii_alphanumeric()
            || matches!(
                c,
                '-' | '.'
                    | '_'
                    | ':'
                    | '~'
                    | '!'
                    | '$'
                    | '&'
                    | '\''
                    | '('
                    | ')'
                    | '*'
                    | '+'
                    | ','
                    | ';'
                    | '='
                    | '%'
                    | '@'
            )
    })
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Userinfo {
    username: Vec<u8>,
    password: Option<Vec<u8>>,
}

/// Go's `url.URL`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Url {
    scheme: String,
    opaque: String,
    user: Option<Userinfo>,
    host: Vec<u8>,
    path: Vec<u8>,
    raw_path: String,
    force_query: bool,
    raw_query: String,
    fragment: Vec<u8>,
    raw_fragment: String,
    omit_host: bool,
}

/// Go's `getScheme`: (scheme, rest).
fn split_scheme(raw: &str) -> Result<(&str, &str), String> {
    for (i, c) in raw.bytes().enumerate() {
        match c {
            b'a'..=b'z' | b'A'..=b'Z' => {}
            b'0'..=b'9' | b'+' | b'-' | b'.' if i == 0 => return Ok(("", raw)),
            b'0'..=b'9' | b'+' | b'-' | b'.' => {}
            b':' if i == 0 => return Err("missing protocol scheme".into()),
            b':' => return Ok((&raw[..i], &raw[i + 1..])),
            _ => return Ok(("", raw)),
        }
    }
    Ok(("", raw))
}

/// Go's `parseHost` (Go 1.26 defaults: strict colons for http and https).
fn parse_host(scheme: &str, host: &str) -> Result<Vec<u8>, String> {
    let b = host.as_bytes();
    match host.rfind('[') {
        Some(i) if i > 0 => return Err("invalid IP-literal".into()),
        Some(_) => {
            let Some(close) = host.rfind(']') else {
                return Err("missing ']' in host".into());
            };
            let colon_port = &b[close + 1..];
            if !valid_optional_port(colon_port) {
                return Err(format!(
                    "invalid port {} after host",
                    crate::quote::go_quote(colon_port)
                ));
            }
            let colon_port = unescape(colon_port, Mode::Host)?;
            let hostname = &b[1..close];
            let unescaped = match host[1..close].find("%25") {
                Some(z) => {
                    let mut h = unescape(&hostname[..z], Mode::Host)?;
                    h.extend(unescape(&hostname[z..], Mode::Zone)?);
                    h
                }
                None => unescape(hostname, Mode::Host)?,
            };
            let text = String::from_utf8_lossy(&unescaped);
            match crate::net::parse_addr(&text) {
                Err(e) => return Err(format!("invalid host: {e}")),
                Ok((crate::net::Ip::V4(_), _)) => return Err("invalid IP-literal".into()),
                Ok(_) => {}
            }
            let mut out = Vec::with_capacity(unescaped.len() + 2 + colon_port.len());
            out.push(b'[');
            out.extend(unescaped);
            out.push(b']');
            out.extend(colon_port);
            return Ok(out);
        }
        None => {}
    }
    if let Some(mut i) = host.find(':') {
        let last = host.rfind(':').unwrap_or(i);
        if last != i && !(scheme == "http" || scheme == "https") {
            i = last;
        }
        let colon_port = &b[i..];
        if !valid_optional_port(colon_port) {
            return Err(format!(
                "invalid port {} after host",
                crate::quote::go_quote(colon_port)
            ));
        }
    }
    unescape(b, Mode::Host)
}

fn parse_authority(scheme: &str, authority: &str) -> Result<(Option<Userinfo>, Vec<u8>), String> {
    let at = authority.rfind('@');
    let host = parse_host(scheme, at.map_or(authority, |i| &authority[i + 1..]))?;
    let Some(at) = at else {
        return Ok((None, host));
    };
    let userinfo = &authority[..at];
    if !valid_userinfo(userinfo) {
        return Err("net/url: invalid userinfo".into());
    }
    let user = match userinfo.split_once(':') {
        None => Userinfo {
            username: unescape(userinfo.as_bytes(), Mode::UserPassword)?,
            password: None,
        },
        Some((name, password)) => Userinfo {
            username: unescape(name.as_bytes(), Mode::UserPassword)?,
            password: Some(unescape(password.as_bytes(), Mode::UserPassword)?),
        },
    };
    Ok((Some(user), host))
}

/// Go's unexported `parse`.
fn parse(raw: &str, via_request: bool) -> Result<Url, String> {
    if raw.bytes().any(|b| b < b' ' || b == 0x7f) {
        return Err("net/url: invalid control character in URL".into());
    }
    if raw.is_empty() && via_request {
        return Err("empty url".into());
    }
    let mut url = Url::default();
    if raw == "*" {
        url.path = b"*".to_vec();
        return Ok(url);
    }
    let (scheme, mut rest) = split_scheme(raw)?;
    url.scheme = scheme.to_ascii_lowercase();
    if rest.ends_with('?') && rest.matches('?').count() == 1 {
        url.force_query = true;
        rest = &rest[..rest.len() - 1];
    } else if let Some((r, q)) = rest.split_once('?') {
        url.raw_query = q.to_string();
        rest = r;
    }
    if !rest.starts_with('/') {
        if !url.scheme.is_empty() {
            url.opaque = rest.to_string();
            return Ok(url);
        }
        if via_request {
            return Err("invalid URI for request".into());
        }
        let segment = rest.split('/').next().unwrap_or("");
        if segment.contains(':') {
            return Err("first path segment in URL cannot contain colon".into());
        }
    }
    if (!url.scheme.is_empty() || !via_request && !rest.starts_with("///")) && rest.starts_with("//") {
        let authority = &rest[2..];
        let (authority, path) = match authority.find('/') {
            Some(i) => (&authority[..i], &authority[i..]),
            None => (authority, ""),
        };
        (url.user, url.host) = parse_authority(&url.scheme, authority)?;
        rest = path;
    } else if !url.scheme.is_empty() && rest.starts_with('/') {
        url.omit_host = true;
    }
    url.set_path(rest)?;
    Ok(url)
}

impl Url {
    /// The library's `url()`: accepted by `ParseRequestURI`, built by `Parse`.
    pub(crate) fn from_string(s: &str) -> Result<Url, UrlError> {
        let wrap = |e: String| UrlError(format!("URL parse error during conversion from string: {e}"));
        parse_request_uri(s).map_err(wrap)?;
        parse_url(s).map_err(wrap)
    }

    fn set_path(&mut self, p: &str) -> Result<(), String> {
        self.path = unescape(p.as_bytes(), Mode::Path)?;
        self.raw_path = if escape(&self.path, Mode::Path) == p {
            String::new()
        } else {
            p.to_string()
        };
        Ok(())
    }

    fn set_fragment(&mut self, f: &str) -> Result<(), String> {
        self.fragment = unescape(f.as_bytes(), Mode::Fragment)?;
        self.raw_fragment = if escape(&self.fragment, Mode::Fragment) == f {
            String::new()
        } else {
            f.to_string()
        };
        Ok(())
    }

    pub(crate) fn scheme(&self) -> &str {
        &self.scheme
    }

    pub(crate) fn host(&self) -> &[u8] {
        &self.host
    }

    /// Go's `splitHostPort`: (hostname, port).
    fn split_host_port(&self) -> (&[u8], &[u8]) {
        let mut host: &[u8] = &self.host;
        let mut port: &[u8] = b"";
        if let Some(colon) = host.iter().rposition(|&c| c == b':')
            && valid_optional_port(&host[colon..])
        {
            port = &host[colon + 1..];
            host = &host[..colon];
        }
        if host.len() >= 2 && host[0] == b'[' && host[host.len() - 1] == b']' {
            host = &host[1..host.len() - 1];
        }
        (host, port)
    }

    pub(crate) fn hostname(&self) -> &[u8] {
        self.split_host_port().0
    }

    pub(crate) fn port(&self) -> &[u8] {
        self.split_host_port().1
    }

    pub(crate) fn escaped_path(&self) -> String {
        if !self.raw_path.is_empty()
            && valid_encoded(&self.raw_path, Mode::Path)
            && unescape(self.raw_path.as_bytes(), Mode::Path).is_ok_and(|p| p == self.path)
        {
            return self.raw_path.clone();
        }
        if self.path == b"*" {
            return "*".into();
        }
        escape(&self.path, Mode::Path)
    }

    fn escaped_fragment(&self) -> String {
        if !self.raw_fragment.is_empty()
            && valid_encoded(&self.raw_fragment, Mode::Fragment)
            && unescape(self.raw_fragment.as_bytes(), Mode::Fragment).is_ok_and(|f| f == self.fragment)
        {
            return self.raw_fragment.clone();
        }
        escape(&self.fragment, Mode::Fragment)
    }

    /// Go's `Query`: malformed pairs are dropped, and everything past the parameter
    /// limit (10000, Go's default).
    pub(crate) fn query(&self) -> BTreeMap<Vec<u8>, Vec<Vec<u8>>> {
        let mut out: BTreeMap<Vec<u8>, Vec<Vec<u8>>> = BTreeMap::new();
        if self.raw_query.matches('&').count() + 1 > 10_000 {
            return out;
        }
        for pair in self.raw_query.split('&') {
            if pair.contains(';') || pair.is_empty() {
                continue;
            }
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let Ok(key) = unescape(key.as_bytes(), Mode::QueryComponent) else {
                continue;
            };
            let Ok(value) = unescape(value.as_bytes(), Mode::QueryComponent) else {
                continue;
            };
            out.entry(key).or_default().push(value);
        }
        out
    }

    /// Go's `String`, which the library's equality compares.
    pub(crate) fn to_go_string(&self) -> String {
        let mut buf = String::new();
        if !self.scheme.is_empty() {
            buf.push_str(&self.scheme);
            buf.push(':');
        }
        if !self.opaque.is_empty() {
            buf.push_str(&self.opaque);
        } else {
            let authority = !self.scheme.is_empty() || !self.host.is_empty() || self.user.is_some();
            // `OmitHost` drops an empty authority ("scheme:/path").
            let omitted = self.omit_host && self.host.is_empty() && self.user.is_none();
            if authority && !omitted {
                if !self.host.is_empty() || !self.path.is_empty() || self.user.is_some() {
                    buf.push_str("//");
                }
                if let Some(user) = &self.user {
                    buf.push_str(&escape(&user.username, Mode::UserPassword));
                    if let Some(p) = &user.password {
                        buf.push(':');
                        buf.push_str(&escape(p, Mode::UserPassword));
                    }
                    buf.push('@');
                }
                if !self.host.is_empty() {
                    buf.push_str(&escape(&self.host, Mode::Host));
                }
            }
            let path = self.escaped_path();
            if !path.is_empty() && !path.starts_with('/') && !self.host.is_empty() {
                buf.push('/');
            }
            if buf.is_empty() && path.split('/').next().unwrap_or("").contains(':') {
                buf.push_str("./");
            }
            buf.push_str(&path);
        }
        if self.force_query || !self.raw_query.is_empty() {
            buf.push('?');
            buf.push_str(&self.raw_query);
        }
        if !self.fragment.is_empty() {
            buf.push('#');
            buf.push_str(&self.escaped_fragment());
        }
        buf
    }
}

fn url_error(input: &[u8], e: String) -> String {
    format!("parse {}: {e}", crate::quote::go_quote(input))
}

/// Go's `url.ParseRequestURI`, with its error text.
pub(crate) fn parse_request_uri(s: &str) -> Result<Url, String> {
    parse(s, true).map_err(|e| url_error(s.as_bytes(), e))
}

/// Go's `url.Parse`.
fn parse_url(s: &str) -> Result<Url, String> {
    let (u, frag) = s.split_once('#').unwrap_or((s, ""));
    let mut url = parse(u, false).map_err(|e| url_error(u.as_bytes(), e))?;
    if !frag.is_empty() {
        url.set_fragment(frag).map_err(|e| url_error(s.as_bytes(), e))?;
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> Url {
        Url::from_string(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn text(b: &[u8]) -> String {
        String::from_utf8_lossy(b).into_owned()
    }

    #[test]
    fn components_like_go() {
        let u = url("https://user:pass@Example.com:80/path%20x?k1=a&k2=b&k2=c#frag");
        assert_eq!(u.scheme(), "https");
        assert_eq!(text(u.host()), "Example.com:80");
        assert_eq!(text(u.hostname()), "Example.com");
        assert_eq!(text(u.port()), "80");
        assert_eq!(u.escaped_path(), "/path%20x");
        let q = u.query();
        assert_eq!(q[b"k2".as_slice()], vec![b"b".to_vec(), b"c".to_vec()]);
        assert_eq!(
            u.to_go_string(),
            "https://user:pass@Example.com:80/path%20x?k1=a&k2=b&k2=c#frag"
        );
        let u = url("https://[::1]:80/");
        assert_eq!(text(u.hostname()), "::1");
        assert_eq!(text(u.host()), "[::1]:80");
        assert_eq!(
            url("https://example.com/path with spaces/").escaped_path(),
            "/path%20with%20spaces/"
        );
        assert_eq!(url("https://example.com").escaped_path(), "");
        assert_eq!(url("/a%2fb").escaped_path(), "/a%2fb");
        assert_eq!(url("/a%2Fb").to_go_string(), "/a%2Fb");
        assert_eq!(url("*").escaped_path(), "*");
        assert_eq!(url("HTTP:opaque").to_go_string(), "http:opaque");
        assert_eq!(url("//example.com/a").host(), b"example.com");
        assert_eq!(url("http:/a").to_go_string(), "http:/a");
        assert_eq!(url("http://a/b?").to_go_string(), "http://a/b?");
        assert_eq!(url("/?a+b=c%20d&;x=1&e").query().len(), 2);
        assert_eq!(url("/?a+b=c%20d").query()[b"a b".as_slice()], vec![b"c d".to_vec()]);
        assert_eq!(url("mongodb://a:1,b:2/").host(), b"a:1,b:2");
    }

    #[test]
    fn refusals_like_go() {
        for (input, message) in [
            ("", "parse \"\": empty url"),
            ("not a url", "parse \"not a url\": invalid URI for request"),
            ("../relative", "parse \"../relative\": invalid URI for request"),
            (
                "https://a:b:c/",
                "parse \"https://a:b:c/\": invalid port \":b:c\" after host",
            ),
            (":foo", "parse \":foo\": missing protocol scheme"),
            (
                "http://a b/",
                "parse \"http://a b/\": invalid character \" \" in host name",
            ),
            ("/%zz", "parse \"/%zz\": invalid URL escape \"%zz\""),
            ("/%", "parse \"/%\": invalid URL escape \"%\""),
            ("http://[::1/", "parse \"http://[::1/\": missing ']' in host"),
            ("http://[10.0.0.1]/", "parse \"http://[10.0.0.1]/\": invalid IP-literal"),
            ("http://a[::1]/", "parse \"http://a[::1]/\": invalid IP-literal"),
            (
                "http://a\tb/",
                "parse \"http://a\\tb/\": net/url: invalid control character in URL",
            ),
            ("http://a%41/", "parse \"http://a%41/\": invalid URL escape \"%41\""),
            ("http://x y@a/", "parse \"http://x y@a/\": net/url: invalid userinfo"),
            ("/a?x#%zz", "parse \"/a?x#%zz\": invalid URL escape \"%zz\""),
        ] {
            let got = Url::from_string(input).map(|u| u.to_go_string());
            assert_eq!(
                got,
                Err(UrlError(format!(
                    "URL parse error during conversion from string: {message}"
                ))),
                "{input}"
            );
        }
        assert!(parse_request_uri("/a?x#%zz").is_ok());
        assert!(Url::from_string("mongodb://a:1:2/").is_ok());
        assert!(Url::from_string("http://[fe80::1%25en0]:8080/").is_ok());
    }
}
