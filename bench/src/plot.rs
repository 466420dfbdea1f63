//! A latency CDF per contender as a small self-contained SVG.

use std::fmt::Write as _;

/// One line of the plot.
pub struct Series {
    pub label: String,
    pub color: &'static str,
    pub values: Vec<f64>,
}

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 360.0;
const LEFT: f64 = 56.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 32.0;
const BOTTOM: f64 = 48.0;

/// The empirical CDF of each series' values, x in seconds.
pub fn cdf_svg(title: &str, x_label: &str, series: &[Series]) -> String {
    let x_max = series
        .iter()
        .flat_map(|s| s.values.iter().copied())
        .fold(0.0_f64, f64::max)
        .max(1e-3);
    let x_max = nice_ceiling(x_max);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let x = |v: f64| LEFT + v / x_max * plot_w;
    let y = |f: f64| TOP + (1.0 - f) * plot_h;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="14">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    for i in 0..=4 {
        let f = f64::from(i) / 4.0;
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{f:.2}</text>"##,
            WIDTH - RIGHT,
            LEFT - 6.0,
            y(f) + 4.0,
            y = y(f)
        );
        let v = x_max * f;
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" x2="{x:.1}" y1="{TOP}" y2="{}" stroke="#ddd"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
            HEIGHT - BOTTOM,
            HEIGHT - BOTTOM + 16.0,
            trim(v),
            x = x(v)
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 10.0,
        escape(x_label)
    );
    let _ = writeln!(
        svg,
        r#"<text x="14" y="{}" text-anchor="middle" transform="rotate(-90 14 {})">fraction of gangs</text>"#,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0
    );
    for (i, s) in series.iter().enumerate() {
        let mut values = s.values.clone();
        values.sort_by(f64::total_cmp);
        let n = values.len().max(1) as f64;
        let mut points = format!("{:.1},{:.1}", x(0.0), y(0.0));
        for (k, v) in values.iter().enumerate() {
            let _ = write!(
                points,
                " {:.1},{:.1} {:.1},{:.1}",
                x(*v),
                y(k as f64 / n),
                x(*v),
                y((k + 1) as f64 / n)
            );
        }
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{points}"/>"#,
            s.color
        );
        let ly = TOP + 14.0 + 16.0 * i as f64;
        let lx = WIDTH - RIGHT - 190.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="{}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
            lx + 18.0,
            s.color,
            lx + 24.0,
            ly + 4.0,
            escape(&s.label)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// The smallest of 1, 2, 5 × 10ⁿ at or above `v`.
fn nice_ceiling(v: f64) -> f64 {
    let magnitude = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * magnitude)
}

fn trim(v: f64) -> String {
    let text = format!("{v:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// `text` safe inside an SVG element.
pub fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_ends_on_a_round_number() {
        assert_eq!(nice_ceiling(0.7), 1.0);
        assert_eq!(nice_ceiling(13.0), 20.0);
        assert_eq!(nice_ceiling(41.0), 50.0);
        assert_eq!(nice_ceiling(100.0), 100.0);
    }

    #[test]
    fn every_series_is_drawn_and_labelled() {
        let svg = cdf_svg(
            "t <1>",
            "seconds",
            &[
                Series {
                    label: "a".into(),
                    color: "red",
                    values: vec![1.0, 2.0],
                },
                Series {
                    label: "b".into(),
                    color: "blue",
                    values: vec![],
                },
            ],
        );
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("t &lt;1&gt;"));
        assert!(svg.trim_end().ends_with("</svg>"));
    }
}
