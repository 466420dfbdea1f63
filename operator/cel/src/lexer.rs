//! Tokens of the CEL grammar.

use std::sync::Arc;

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Tok {
    Int(i64),
    /// A decimal integer literal above `i64::MAX`: only valid right after a unary minus.
    IntOverflow(u64),
    Uint(u64),
    Double(f64),
    String(Arc<str>),
    Bytes(Arc<[u8]>),
    Ident(String),
    True,
    False,
    Null,
    In,
    LParen,
    RParen,
    LBracket,
    RBracket,
    LBrace,
    RBrace,
    Dot,
    Comma,
    Colon,
    Question,
    Plus,
    Minus,
    Star,
    Slash,
    Percent,
    Bang,
    EqEq,
    NotEq,
    Lt,
    Le,
    Gt,
    Ge,
    AndAnd,
    OrOr,
    Eof,
}

impl Tok {
    pub(crate) fn describe(&self) -> String {
        match self {
            Tok::Int(v) => v.to_string(),
            Tok::IntOverflow(v) => v.to_string(),
            Tok::Uint(v) => format!("{v}u"),
            Tok::Double(v) => v.to_string(),
            Tok::String(_) => "string literal".to_string(),
            Tok::Bytes(_) => "bytes literal".to_string(),
            Tok::Ident(name) => name.clone(),
            Tok::True => "true".into(),
            Tok::False => "false".into(),
            Tok::Null => "null".into(),
            Tok::In => "in".into(),
            Tok::LParen => "(".into(),
            Tok::RParen => ")".into(),
            Tok::LBracket => "[".into(),
            Tok::RBracket => "]".into(),
            Tok::LBrace => "{".into(),
            Tok::RBrace => "}".into(),
            Tok::Dot => ".".into(),
            Tok::Comma => ",".into(),
            Tok::Colon => ":".into(),
            Tok::Question => "?".into(),
            Tok::Plus => "+".into(),
            Tok::Minus => "-".into(),
            Tok::Star => "*".into(),
            Tok::Slash => "/".into(),
            Tok::Percent => "%".into(),
            Tok::Bang => "!".into(),
            Tok::EqEq => "==".into(),
            Tok::NotEq => "!=".into(),
            Tok::Lt => "<".into(),
            Tok::Le => "<=".into(),
            Tok::Gt => ">".into(),
            Tok::Ge => ">=".into(),
            Tok::AndAnd => "&&".into(),
            Tok::OrOr => "||".into(),
            Tok::Eof => "<EOF>".into(),
        }
    }
}

/// A token and the byte offset where it starts.
#[derive(Clone, Debug)]
pub(crate) struct Token {
    pub tok: Tok,
    pub pos: usize,
}

/// A lexical error at a byte offset.
#[derive(Debug)]
pub(crate) struct LexError {
    pub pos: usize,
    pub message: String,
}

/// Words the grammar reserves; using one as an identifier is a syntax error.
const RESERVED: &[&str] = &[
    "as",
    "break",
    "const",
    "continue",
    "else",
    "for",
    "function",
    "if",
    "import",
    "let",
    "loop",
    "package",
    "namespace",
    "return",
    "var",
    "void",
    "while",
];

pub(crate) fn tokenize(src: &str) -> Result<Vec<Token>, LexError> {
    let mut lexer = Lexer {
        src,
        bytes: src.as_bytes(),
        pos: 0,
    };
    let mut out = Vec::new();
    loop {
        lexer.skip_trivia();
        let start = lexer.pos;
        if start >= lexer.bytes.len() {
            out.push(Token {
                tok: Tok::Eof,
                pos: start,
            });
            return Ok(out);
        }
        let tok = lexer.next_token()?;
        out.push(Token { tok, pos: start });
    }
}

struct Lexer<'s> {
    src: &'s str,
    bytes: &'s [u8],
    pos: usize,
}

impl Lexer<'_> {
    fn peek(&self, ahead: usize) -> u8 {
        self.bytes.get(self.pos + ahead).copied().unwrap_or(0)
    }

    fn err<T>(&self, pos: usize, message: impl Into<String>) -> Result<T, LexError> {
        Err(LexError {
            pos,
            message: message.into(),
        })
    }

    fn skip_trivia(&mut self) {
        loop {
            match self.peek(0) {
                b' ' | b'\t' | b'\n' | b'\r' | b'\x0c' => self.pos += 1,
                b'/' if self.peek(1) == b'/' => {
                    while self.pos < self.bytes.len() && self.bytes[self.pos] != b'\n' {
                        self.pos += 1;
                    }
                }
                _ => return,
            }
        }
    }

    fn next_token(&mut self) -> Result<Tok, LexError> {
        let start = self.pos;
        let c = self.peek(0);
        let two = |lexer: &mut Self, tok| {
            lexer.pos += 2;
            Ok(tok)
        };
        let one = |lexer: &mut Self, tok| {
            lexer.pos += 1;
            Ok(tok)
        };
        match c {
            b'(' => one(self, Tok::LParen),
            b')' => one(self, Tok::RParen),
            b'[' => one(self, Tok::LBracket),
            b']' => one(self, Tok::RBracket),
            b'{' => one(self, Tok::LBrace),
            b'}' => one(self, Tok::RBrace),
            b',' => one(self, Tok::Comma),
            b':' => one(self, Tok::Colon),
            b'?' => one(self, Tok::Question),
            b'+' => one(self, Tok::Plus),
            b'-' => one(self, Tok::Minus),
            b'*' => one(self, Tok::Star),
            b'/' => one(self, Tok::Slash),
            b'%' => one(self, Tok::Percent),
            b'=' if self.peek(1) == b'=' => two(self, Tok::EqEq),
            b'!' if self.peek(1) == b'=' => two(self, Tok::NotEq),
            b'!' => one(self, Tok::Bang),
            b'<' if self.peek(1) == b'=' => two(self, Tok::Le),
            b'<' => one(self, Tok::Lt),
            b'>' if self.peek(1) == b'=' => two(self, Tok::Ge),
            b'>' => one(self, Tok::Gt),
            b'&' if self.peek(1) == b'&' => two(self, Tok::AndAnd),
            b'|' if self.peek(1) == b'|' => two(self, Tok::OrOr),
            b'.' if self.peek(1).is_ascii_digit() => self.number(),
            b'.' => one(self, Tok::Dot),
            b'0'..=b'9' => self.number(),
            b'"' | b'\'' => self.string(false, false),
            b'r' | b'R' if matches!(self.peek(1), b'"' | b'\'') => {
                self.pos += 1;
                self.string(true, false)
            }
            b'b' | b'B' if matches!(self.peek(1), b'"' | b'\'') => {
                self.pos += 1;
                self.string(false, true)
            }
            b'b' | b'B' if matches!(self.peek(1), b'r' | b'R') && matches!(self.peek(2), b'"' | b'\'') => {
                self.pos += 2;
                self.string(true, true)
            }
            b'r' | b'R' if matches!(self.peek(1), b'b' | b'B') && matches!(self.peek(2), b'"' | b'\'') => {
                self.pos += 2;
                self.string(true, true)
            }
            c if c == b'_' || c.is_ascii_alphabetic() => {
                while self.peek(0) == b'_' || self.peek(0).is_ascii_alphanumeric() {
                    self.pos += 1;
                }
                let word = &self.src[start..self.pos];
                Ok(match word {
                    "true" => Tok::True,
                    "false" => Tok::False,
                    "null" => Tok::Null,
                    "in" => Tok::In,
                    _ if RESERVED.contains(&word) => return self.err(start, format!("reserved identifier: {word}")),
                    _ => Tok::Ident(word.to_string()),
                })
            }
            _ => {
                let ch = self.src[start..].chars().next().unwrap_or('\u{fffd}');
                self.err(start, format!("token recognition error at: '{ch}'"))
            }
        }
    }

    fn number(&mut self) -> Result<Tok, LexError> {
        let start = self.pos;
        if self.peek(0) == b'0' && matches!(self.peek(1), b'x' | b'X') && self.peek(2).is_ascii_hexdigit() {
            self.pos += 2;
            let digits_start = self.pos;
            while self.peek(0).is_ascii_hexdigit() {
                self.pos += 1;
            }
            let digits = &self.src[digits_start..self.pos];
            if matches!(self.peek(0), b'u' | b'U') {
                self.pos += 1;
                return match u64::from_str_radix(digits, 16) {
                    Ok(v) => Ok(Tok::Uint(v)),
                    Err(_) => self.err(start, "invalid uint literal"),
                };
            }
            return match u64::from_str_radix(digits, 16) {
                Ok(v) if i64::try_from(v).is_ok() => Ok(Tok::Int(v as i64)),
                Ok(v) => Ok(Tok::IntOverflow(v)),
                Err(_) => self.err(start, "invalid int literal"),
            };
        }
        while self.peek(0).is_ascii_digit() {
            self.pos += 1;
        }
        let mut is_double = false;
        if self.peek(0) == b'.' && self.peek(1).is_ascii_digit() {
            is_double = true;
            self.pos += 1;
            while self.peek(0).is_ascii_digit() {
                self.pos += 1;
            }
        }
        if matches!(self.peek(0), b'e' | b'E') {
            let sign = usize::from(matches!(self.peek(1), b'+' | b'-'));
            if self.peek(1 + sign).is_ascii_digit() {
                is_double = true;
                self.pos += 1 + sign;
                while self.peek(0).is_ascii_digit() {
                    self.pos += 1;
                }
            }
        }
        let text = &self.src[start..self.pos];
        if is_double {
            return match text.parse::<f64>() {
                Ok(v) => Ok(Tok::Double(v)),
                Err(_) => self.err(start, "invalid double literal"),
            };
        }
        if matches!(self.peek(0), b'u' | b'U') {
            self.pos += 1;
            return match text.parse::<u64>() {
                Ok(v) => Ok(Tok::Uint(v)),
                Err(_) => self.err(start, "invalid uint literal"),
            };
        }
        match text.parse::<u64>() {
            Ok(v) if i64::try_from(v).is_ok() => Ok(Tok::Int(v as i64)),
            Ok(v) => Ok(Tok::IntOverflow(v)),
            Err(_) => self.err(start, "invalid int literal"),
        }
    }

    /// Reads a quoted literal; `self.pos` is at the opening quote.
    fn string(&mut self, raw: bool, bytes: bool) -> Result<Tok, LexError> {
        let start = self.pos;
        let quote = self.peek(0);
        let triple = self.peek(1) == quote && self.peek(2) == quote;
        let open = if triple { 3 } else { 1 };
        self.pos += open;
        let body_start = self.pos;
        // Find the closing quote; outside raw literals a backslash escapes the next byte.
        loop {
            if self.pos >= self.bytes.len() {
                return self.err(start, "unterminated string literal");
            }
            let c = self.bytes[self.pos];
            if c == b'\\' && !raw {
                self.pos += 2;
                continue;
            }
            if !triple && (c == b'\n' || c == b'\r') {
                return self.err(start, "newline in single-quoted string literal");
            }
            if c == quote && (!triple || (self.peek(1) == quote && self.peek(2) == quote)) {
                break;
            }
            self.pos += 1;
        }
        let body_end = self.pos.min(self.bytes.len());
        self.pos += open;
        let body = self.src.get(body_start..body_end).unwrap_or("");
        let body = body.replace("\r\n", "\n").replace('\r', "\n");
        let decoded = if raw {
            body.into_bytes()
        } else {
            unescape(&body, bytes).map_err(|message| LexError { pos: start, message })?
        };
        if bytes {
            Ok(Tok::Bytes(decoded.into()))
        } else {
            match String::from_utf8(decoded) {
                Ok(s) => Ok(Tok::String(s.into())),
                Err(_) => self.err(start, "invalid UTF-8 in string literal"),
            }
        }
    }
}

/// Decodes escape sequences; in bytes literals `\x` and octal escapes are raw bytes.
fn unescape(body: &str, bytes: bool) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(body.len());
    let mut chars = body.char_indices().peekable();
    let bad = || "unable to unescape string".to_string();
    let push_char = |out: &mut Vec<u8>, c: char| {
        let mut buf = [0u8; 4];
        out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
    };
    while let Some((_, c)) = chars.next() {
        if c != '\\' {
            push_char(&mut out, c);
            continue;
        }
        let Some((_, e)) = chars.next() else {
            return Err("unable to unescape string, found '\\' as last character".into());
        };
        let simple = match e {
            'a' => Some('\x07'),
            'b' => Some('\x08'),
            'f' => Some('\x0c'),
            'n' => Some('\n'),
            'r' => Some('\r'),
            't' => Some('\t'),
            'v' => Some('\x0b'),
            '\\' | '\'' | '"' | '`' | '?' => Some(e),
            _ => None,
        };
        if let Some(s) = simple {
            push_char(&mut out, s);
            continue;
        }
        let mut take = |n: usize, radix: u32| -> Result<u32, String> {
            let mut v: u32 = 0;
            for _ in 0..n {
                let (_, d) = chars.next().ok_or_else(bad)?;
                v = v * radix + d.to_digit(radix).ok_or_else(bad)?;
            }
            Ok(v)
        };
        match e {
            'x' | 'X' => {
                let v = take(2, 16)?;
                if bytes {
                    out.push(v as u8);
                } else {
                    push_char(&mut out, char::from_u32(v).ok_or_else(bad)?);
                }
            }
            'u' | 'U' => {
                if bytes {
                    return Err(bad());
                }
                let v = take(if e == 'u' { 4 } else { 8 }, 16)?;
                let c = char::from_u32(v).ok_or_else(|| "invalid unicode code point".to_string())?;
                push_char(&mut out, c);
            }
            '0'..='3' => {
                let high = e.to_digit(8).unwrap_or(0);
                let v =
                    high * 64 + take(2, 8).map_err(|_| "unable to unescape octal sequence in string".to_string())?;
                if bytes {
                    out.push(v as u8);
                } else {
                    push_char(&mut out, char::from_u32(v).ok_or_else(bad)?);
                }
            }
            _ => return Err(bad()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(src: &str) -> Vec<Tok> {
        tokenize(src).unwrap().into_iter().map(|t| t.tok).collect()
    }

    #[test]
    fn numbers() {
        assert_eq!(
            toks("1 0x1F 2u 0xFu 1.5 1e3 .5 007"),
            vec![
                Tok::Int(1),
                Tok::Int(31),
                Tok::Uint(2),
                Tok::Uint(15),
                Tok::Double(1.5),
                Tok::Double(1000.0),
                Tok::Double(0.5),
                Tok::Int(7),
                Tok::Eof
            ]
        );
        assert_eq!(
            toks("1.size"),
            vec![Tok::Int(1), Tok::Dot, Tok::Ident("size".into()), Tok::Eof]
        );
        assert_eq!(toks("9223372036854775808"), vec![Tok::IntOverflow(1 << 63), Tok::Eof]);
        assert!(tokenize("18446744073709551616").is_err());
    }

    #[test]
    fn strings() {
        let s = |src: &str| match &toks(src)[0] {
            Tok::String(s) => s.to_string(),
            other => panic!("{other:?}"),
        };
        assert_eq!(s(r#""a\tb\n""#), "a\tb\n");
        assert_eq!(s(r#"'\x41\u00e9\U0001F600\101'"#), "A\u{e9}\u{1F600}A");
        assert_eq!(s(r#"r"a\tb""#), "a\\tb");
        assert_eq!(s("'''a\n'b'''"), "a\n'b");
        assert_eq!(s(r#""\"\'\\""#), "\"'\\");
        assert_eq!(
            toks(r#"b"\xff\377é""#)[0],
            Tok::Bytes(vec![0xff, 0xff, 0xc3, 0xa9].into())
        );
        assert!(tokenize(r#""\q""#).is_err());
        assert!(tokenize("'abc").is_err());
        assert!(tokenize("'a\nb'").is_err());
        assert!(tokenize(r#"b"\u0041""#).is_err());
        assert!(tokenize(r#""\ud800""#).is_err());
    }

    #[test]
    fn operators_and_words() {
        assert_eq!(
            toks("a&&b||!c != d // comment\n in"),
            vec![
                Tok::Ident("a".into()),
                Tok::AndAnd,
                Tok::Ident("b".into()),
                Tok::OrOr,
                Tok::Bang,
                Tok::Ident("c".into()),
                Tok::NotEq,
                Tok::Ident("d".into()),
                Tok::In,
                Tok::Eof
            ]
        );
        assert!(tokenize("while").is_err());
        assert!(tokenize("a # b").is_err());
        assert!(tokenize("a & b").is_err());
    }
}
