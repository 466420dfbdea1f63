//! The Prometheus text exposition format (and OpenMetrics, which muster serves): the
//! samples of one scrape, each a label set with its metric name under `__name__`.

use crate::dashboard::promql::{Labels, NAME, parse_float};

/// A line that is not a sample, a comment or blank.
#[derive(Debug, thiserror::Error)]
#[error("line {line}: {reason}: {text:?}")]
pub struct ParseError {
    pub line: usize,
    pub reason: &'static str,
    pub text: String,
}

/// Every sample of a metrics page, in order. Exemplars and timestamps after the value
/// are ignored: Prometheus stamps samples with the scrape's time.
pub fn parse(page: &str) -> Result<Vec<(Labels, f64)>, ParseError> {
    let mut samples = Vec::new();
    for (index, line) in page.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let error = |reason| ParseError {
            line: index + 1,
            reason,
            text: line.to_string(),
        };
        let name_end = line.find(['{', ' ']).ok_or_else(|| error("no value"))?;
        let mut labels = Labels::new();
        labels.insert(NAME.to_string(), line[..name_end].to_string());
        let mut rest = &line[name_end..];
        if rest.starts_with('{') {
            rest = label_set(&rest[1..], &mut labels).map_err(error)?;
        }
        let value = rest.split_whitespace().next().ok_or_else(|| error("no value"))?;
        samples.push((labels, parse_float(value).ok_or_else(|| error("bad value"))?));
    }
    Ok(samples)
}

/// Reads `name="value",...}` into `labels`; returns what follows the closing brace.
fn label_set<'a>(mut rest: &'a str, labels: &mut Labels) -> Result<&'a str, &'static str> {
    loop {
        rest = rest.trim_start_matches([' ', ',']);
        if let Some(after) = rest.strip_prefix('}') {
            return Ok(after);
        }
        let (name, after) = rest.split_once('=').ok_or("a label without '='")?;
        let after = after.strip_prefix('"').ok_or("a label value without quotes")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err("an unterminated label value"),
                Some((at, '"')) => break at,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return Err("an unterminated label value"),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.insert(name.trim().to_string(), value);
        rest = &after[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_names_labels_escapes_and_special_values() {
        let page = "# HELP x_total help\n# TYPE x counter\nx_total 3\n\
                    h_bucket{le=\"+Inf\",path=\"a\\\"b\\\\c\\nd\"} 7 1700000000\n\
                    g{a=\"1\", b=\"two\",} NaN\n# EOF\n";
        let samples = parse(page).unwrap();
        assert_eq!(samples.len(), 3);
        assert_eq!(samples[0].0[NAME], "x_total");
        assert_eq!(samples[0].1, 3.0);
        assert_eq!(samples[1].0["le"], "+Inf");
        assert_eq!(samples[1].0["path"], "a\"b\\c\nd");
        assert_eq!(samples[1].1, 7.0);
        assert_eq!(samples[2].0["b"], "two");
        assert!(samples[2].1.is_nan());
    }

    #[test]
    fn a_broken_line_is_an_error_with_its_number() {
        let error = parse("ok 1\nbroken{a=\"x} 1\n").unwrap_err();
        assert_eq!(error.line, 2);
        assert!(parse("novalue\n").is_err());
        assert!(parse("v abc\n").is_err());
    }
}
