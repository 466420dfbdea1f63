//! Go's string quoting, which error messages and `string.format` reproduce.

/// Go's `strconv.Quote`: printable characters as they are, the rest escaped.
pub(crate) fn go_quote(s: &[u8]) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for chunk in s.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\x07' => out.push_str("\\a"),
                '\x08' => out.push_str("\\b"),
                '\x0c' => out.push_str("\\f"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\x0b' => out.push_str("\\v"),
                c if go_printable(c) => out.push(c),
                c if (c as u32) < 0x80 => out.push_str(&format!("\\x{:02x}", c as u32)),
                c if (c as u32) < 0x10000 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push_str(&format!("\\U{:08x}", c as u32)),
            }
        }
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out.push('"');
    out
}

/// Go's `strconv.IsPrint`: letters, marks, numbers, punctuation, symbols and the ASCII
/// space, as of Unicode 15.0, the tables Go's `unicode` package has.
fn go_printable(c: char) -> bool {
    static PRINTABLE: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    if c.is_ascii() {
        return (' '..='~').contains(&c);
    }
    let re = PRINTABLE.get_or_init(|| {
        regex::Regex::new(r"^[[\p{L}\p{M}\p{N}\p{P}\p{S}]&&\p{Age=V15_0}]$").expect("a valid character class")
    });
    re.is_match(c.encode_utf8(&mut [0; 4]))
}

#[cfg(test)]
mod tests {
    use super::go_quote;

    #[test]
    fn quotes_as_go_with_its_unicode_tables() {
        assert_eq!(go_quote("é😀\n".as_bytes()), "\"é😀\\n\"");
        // U+0897 came with Unicode 16.0, after Go's tables: Go escapes it.
        assert_eq!(go_quote("\u{0897}".as_bytes()), "\"\\u0897\"");
        assert_eq!(go_quote(b"\xff"), "\"\\xff\"");
    }
}
