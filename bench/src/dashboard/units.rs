//! Values written as Grafana writes them for a panel's unit: its automatic number of
//! decimals, seconds scaled to ms, s, min and hours, counts and rates scaled by 1000.

/// `value` in `unit` (a Grafana unit id; unset or unknown ones are plain numbers), with
/// `decimals` fixed or, if `None`, chosen from the value as Grafana does.
pub fn format(value: f64, unit: Option<&str>, decimals: Option<usize>) -> String {
    if value.is_nan() {
        return "NaN".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "+Inf".into() } else { "-Inf".into() };
    }
    match unit.unwrap_or("none") {
        "s" => seconds(value, decimals),
        "ms" => seconds(value / 1000.0, decimals),
        "reqps" => format!(
            "{} req/s",
            scaled(value, &["", "K", "M", "B", "T"], decimals).trim_end()
        ),
        "ops" => format!(
            "{} ops/s",
            scaled(value, &["", "K", "M", "B", "T"], decimals).trim_end()
        ),
        "percentunit" => format!("{}%", fixed(value * 100.0, decimals)),
        "percent" => format!("{}%", fixed(value, decimals)),
        "short" => scaled(value, &["", " K", " Mil", " Bil", " Tri"], decimals),
        _ => fixed(value, decimals),
    }
}

/// A tick label: the value in its unit without trailing zeros ("1.5 s", "0.25").
pub fn axis_label(value: f64, unit: Option<&str>) -> String {
    let text = format(value, unit, None);
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_end);
    if number.contains('.') {
        format!("{}{suffix}", number.trim_end_matches('0').trim_end_matches('.'))
    } else {
        text
    }
}

fn seconds(value: f64, decimals: Option<usize>) -> String {
    let size = value.abs();
    let (scaled, suffix) = match size {
        0.0 => return "0 s".into(),
        s if s < 1e-6 => (value * 1e9, "ns"),
        s if s < 1e-3 => (value * 1e6, "µs"),
        s if s < 1.0 => (value * 1e3, "ms"),
        s if s < 60.0 => (value, "s"),
        s if s < 3600.0 => (value / 60.0, "min"),
        s if s < 86400.0 => (value / 3600.0, "hour"),
        _ => (value / 86400.0, "day"),
    };
    format!("{} {suffix}", fixed(scaled, decimals))
}

/// Divided by 1000 per step of `suffixes`, as far as the value reaches.
fn scaled(value: f64, suffixes: &[&str], decimals: Option<usize>) -> String {
    let step = if value == 0.0 {
        0
    } else {
        (value.abs().log10() / 3.0)
            .floor()
            .clamp(0.0, (suffixes.len() - 1) as f64) as usize
    };
    format!(
        "{}{}",
        fixed(value / 1000f64.powi(step as i32), decimals),
        suffixes[step]
    )
}

/// The value rounded to `decimals`, or to as many as Grafana's `getDecimalsForValue`
/// gives: none for whole numbers, else three significant digits.
pub fn fixed(value: f64, decimals: Option<usize>) -> String {
    if value == 0.0 {
        return "0".into();
    }
    let decimals = decimals.unwrap_or_else(|| automatic_decimals(value));
    let factor = 10f64.powi(decimals as i32);
    let rounded = (value * factor).round() / factor;
    format!("{rounded:.decimals$}")
}

fn automatic_decimals(value: f64) -> usize {
    if value.fract() == 0.0 {
        return 0;
    }
    let magnitude = value.abs().log10().floor();
    let mut decimals = -magnitude + 1.0;
    let norm = value.abs() / 10f64.powf(-decimals);
    if norm > 2.25 {
        decimals += 1.0;
    }
    decimals.max(0.0) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_scale_like_grafana() {
        assert_eq!(format(0.0, Some("s"), None), "0 s");
        assert_eq!(format(0.0042, Some("s"), None), "4.20 ms");
        assert_eq!(format(0.25, Some("s"), None), "250 ms");
        assert_eq!(format(12.34, Some("s"), None), "12.3 s");
        assert_eq!(format(90.0, Some("s"), None), "1.50 min");
        assert_eq!(format(7200.0, Some("s"), None), "2 hour");
    }

    #[test]
    fn counts_and_rates() {
        assert_eq!(format(3.0, None, None), "3");
        assert_eq!(format(0.0333, Some("reqps"), None), "0.0333 req/s");
        assert_eq!(format(1500.0, Some("reqps"), None), "1.50K req/s");
        assert_eq!(format(2.0, Some("reqps"), None), "2 req/s");
        assert_eq!(format(12_000.0, Some("short"), None), "12 K");
        assert_eq!(format(1.5, None, Some(0)), "2");
        assert_eq!(format(f64::NAN, None, None), "NaN");
    }

    #[test]
    fn axis_labels_drop_trailing_zeros() {
        assert_eq!(axis_label(0.5, None), "0.5");
        assert_eq!(axis_label(1.5, Some("s")), "1.5 s");
        assert_eq!(axis_label(0.25, Some("s")), "250 ms");
        assert_eq!(axis_label(20.0, None), "20");
        assert_eq!(axis_label(0.05, Some("reqps")), "0.05 req/s");
    }
}
