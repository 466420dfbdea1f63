//! The dashboard drawn as one SVG in Grafana's dark theme: panels placed on the
//! 24-column grid as Grafana places them (30 px rows, 8 px gaps), time series as lines
//! with a legend below, stat panels as one big number colored by its thresholds, rows
//! as headers.

use std::fmt::Write as _;

use crate::dashboard::model::{Dashboard, Kind, Panel};
use crate::dashboard::units;
use crate::plot::escape;

/// One line of a panel: its legend name and its values by time (milliseconds).
pub struct Line {
    pub name: String,
    pub points: Vec<(i64, f64)>,
}

/// What to draw: the dashboard, each panel's lines (in the order of its panels), the
/// time range and step of the queries.
pub struct Picture<'a> {
    pub dashboard: &'a Dashboard,
    pub lines: &'a [Vec<Line>],
    pub start: i64,
    pub end: i64,
    pub step: i64,
    /// A line under the header saying where the data comes from.
    pub note: &'a str,
}

const WIDTH: f64 = 1600.0;
const PAGE_PADDING: f64 = 16.0;
const HEADER: f64 = 112.0;
const ROW_HEIGHT: f64 = 30.0;
const GAP: f64 = 8.0;
const PANEL_HEADER: f64 = 32.0;

const BACKGROUND: &str = "#111217";
const PANEL: &str = "#181b1f";
const BORDER: &str = "rgba(204,204,220,0.12)";
const TEXT: &str = "#ccccdc";
const TEXT_DIM: &str = "rgba(204,204,220,0.65)";
const GRID: &str = "rgba(204,204,220,0.1)";
const FONT: &str = "Inter, Helvetica, Arial, sans-serif";

/// Grafana's classic palette, the colors series take in order.
const PALETTE: [&str; 16] = [
    "#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1", "#BA43A9", "#705DA0", "#508642", "#CCA300",
    "#447EBC", "#C15C17", "#890F02", "#0A437C", "#6D1F62", "#584477",
];

/// Grafana's named colors in the dark theme.
fn named_color(name: &str) -> &str {
    match name {
        "green" => "#73BF69",
        "red" => "#F2495C",
        "yellow" => "#FADE2A",
        "orange" => "#FF9830",
        "blue" => "#5794F2",
        "purple" => "#B877D9",
        "text" => TEXT,
        other => other,
    }
}

/// Roughly how wide `text` is at `size` px in a sans-serif font.
fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.58
}

struct Rect {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
}

fn place(panel: &Panel) -> Rect {
    let column = (WIDTH - 2.0 * PAGE_PADDING - 23.0 * GAP) / 24.0;
    let g = panel.grid;
    Rect {
        x: PAGE_PADDING + f64::from(g.x) * (column + GAP),
        y: HEADER + f64::from(g.y) * (ROW_HEIGHT + GAP),
        w: f64::from(g.w) * column + f64::from(g.w.saturating_sub(1)) * GAP,
        h: f64::from(g.h) * ROW_HEIGHT + f64::from(g.h.saturating_sub(1)) * GAP,
    }
}

/// The picture's size in pixels.
pub fn size(dashboard: &Dashboard) -> (f64, f64) {
    let rows = dashboard.panels.iter().map(|p| p.grid.y + p.grid.h).max().unwrap_or(0);
    (WIDTH, HEADER + f64::from(rows) * (ROW_HEIGHT + GAP) + PAGE_PADDING)
}

pub fn render(picture: &Picture) -> String {
    let (width, height) = size(picture.dashboard);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="{FONT}" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="{BACKGROUND}"/>"#);
    header(&mut svg, picture);
    for (index, panel) in picture.dashboard.panels.iter().enumerate() {
        let lines = picture.lines.get(index).map_or(&[][..], Vec::as_slice);
        let rect = place(panel);
        match panel.kind {
            Kind::Row => row(&mut svg, panel, &rect),
            Kind::Stat => stat(&mut svg, panel, &rect, lines),
            Kind::TimeSeries => time_series(&mut svg, panel, &rect, lines, picture),
        }
    }
    svg.push_str("</svg>\n");
    svg
}

fn header(svg: &mut String, picture: &Picture) {
    let _ = writeln!(
        svg,
        r#"<text x="{PAGE_PADDING}" y="30" font-size="18" fill="{TEXT_DIM}">Dashboards <tspan fill="{TEXT}">› {}</tspan></text>"#,
        escape(&picture.dashboard.title)
    );
    let range = format!("{} to {} UTC", clock(picture.start, true), clock(picture.end, true));
    let range_width = text_width(&range, 13.0) + 24.0;
    let _ = writeln!(
        svg,
        r#"<rect x="{}" y="12" width="{range_width}" height="28" rx="2" fill="{PANEL}" stroke="{BORDER}"/><text x="{}" y="31" font-size="13" fill="{TEXT}" text-anchor="middle">{range}</text>"#,
        WIDTH - PAGE_PADDING - range_width,
        WIDTH - PAGE_PADDING - range_width / 2.0,
    );
    let mut x = PAGE_PADDING;
    let variables = std::iter::once(("Data source".to_string(), "Prometheus".to_string())).chain(
        picture
            .dashboard
            .variables
            .iter()
            .map(|(name, _)| (capitalized(name), "All".to_string())),
    );
    for (label, value) in variables {
        let label_width = text_width(&label, 13.0) + 20.0;
        let value_width = text_width(&value, 13.0) + 40.0;
        let _ = writeln!(
            svg,
            r#"<rect x="{x}" y="54" width="{label_width}" height="28" rx="2" fill="{PANEL}" stroke="{BORDER}"/><text x="{}" y="73" font-size="13" fill="{TEXT}">{}</text><rect x="{}" y="54" width="{value_width}" height="28" rx="2" fill="{BACKGROUND}" stroke="{BORDER}"/><text x="{}" y="73" font-size="13" fill="{TEXT}">{}</text><path d="M{} 66 l4 4 l4 -4" fill="none" stroke="{TEXT_DIM}" stroke-width="1.5"/>"#,
            x + 10.0,
            escape(&label),
            x + label_width,
            x + label_width + 10.0,
            escape(&value),
            x + label_width + value_width - 20.0,
        );
        x += label_width + value_width + 12.0;
    }
    let _ = writeln!(
        svg,
        r#"<text x="{PAGE_PADDING}" y="102" font-size="12" fill="{TEXT_DIM}">{}</text>"#,
        escape(picture.note)
    );
}

fn capitalized(name: &str) -> String {
    let mut chars = name.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

fn row(svg: &mut String, panel: &Panel, rect: &Rect) {
    let middle = rect.y + rect.h / 2.0;
    let _ = writeln!(
        svg,
        r#"<path d="M{} {} l5 5 l5 -5" fill="none" stroke="{TEXT}" stroke-width="1.5"/><text x="{}" y="{}" font-size="16" font-weight="500" fill="{TEXT}">{}</text>"#,
        rect.x + 2.0,
        middle - 3.0,
        rect.x + 20.0,
        middle + 6.0,
        escape(&panel.title)
    );
}

fn panel_frame(svg: &mut String, panel: &Panel, rect: &Rect) {
    let _ = writeln!(
        svg,
        r#"<rect x="{}" y="{}" width="{}" height="{}" rx="2" fill="{PANEL}" stroke="{BORDER}"/><text x="{}" y="{}" font-size="14" font-weight="500" fill="{TEXT}">{}</text>"#,
        rect.x,
        rect.y,
        rect.w,
        rect.h,
        rect.x + 8.0,
        rect.y + 21.0,
        escape(&panel.title)
    );
}

fn no_data(svg: &mut String, x: f64, y: f64) {
    let _ = writeln!(
        svg,
        r#"<text x="{x}" y="{y}" font-size="14" fill="{TEXT_DIM}" text-anchor="middle">No data</text>"#
    );
}

/// The last value of each series that has one, side by side, colored by the panel's
/// thresholds (Grafana's `lastNotNull` with the value colored).
fn stat(svg: &mut String, panel: &Panel, rect: &Rect, lines: &[Line]) {
    panel_frame(svg, panel, rect);
    let values: Vec<f64> = lines
        .iter()
        .filter_map(|l| l.points.iter().rev().map(|p| p.1).find(|v| v.is_finite()))
        .collect();
    let body_top = rect.y + PANEL_HEADER;
    let body_h = rect.h - PANEL_HEADER;
    if values.is_empty() {
        no_data(svg, rect.x + rect.w / 2.0, body_top + body_h / 2.0);
        return;
    }
    let cell = rect.w / values.len() as f64;
    for (i, value) in values.iter().enumerate() {
        let text = units::format(*value, panel.unit.as_deref(), panel.decimals);
        let size = (body_h * 0.6)
            .min((cell - 16.0) / (text.chars().count() as f64 * 0.6))
            .max(10.0);
        let color = named_color(panel.threshold_color(*value));
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" font-size="{size:.0}" font-weight="500" fill="{color}" text-anchor="middle">{}</text>"#,
            rect.x + cell * (i as f64 + 0.5),
            body_top + body_h / 2.0 + size * 0.35,
            escape(&text)
        );
    }
}

/// The step between value ticks for about `count` ticks over `lo..hi`: 1, 2, 2.5 or
/// 5 times a power of ten, or for seconds from half a minute on, whole minutes and
/// hours as Grafana's time axes step.
fn value_step(lo: f64, hi: f64, count: f64, unit: Option<&str>) -> f64 {
    let raw = (hi - lo) / count.max(1.0);
    if unit == Some("s") && raw >= 30.0 {
        const CLOCK: [f64; 10] = [30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 7200.0, 21600.0];
        if let Some(step) = CLOCK.into_iter().find(|s| *s >= raw) {
            return step;
        }
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude)
}

/// `HH:MM:SS` (or `HH:MM`) of a time in milliseconds, in UTC.
fn clock(ms: i64, seconds: bool) -> String {
    let of_day = ms.div_euclid(1000).rem_euclid(86_400);
    let (h, m, s) = (of_day / 3600, of_day / 60 % 60, of_day % 60);
    if seconds {
        format!("{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h:02}:{m:02}")
    }
}

struct Legend {
    /// Each entry's position relative to the legend's top left.
    entries: Vec<(f64, f64)>,
    height: f64,
}

/// Lays legend entries out left to right, wrapping at `width`.
fn legend_layout(names: &[&str], width: f64) -> Legend {
    let mut entries = Vec::new();
    let (mut x, mut y) = (0.0, 0.0);
    for name in names {
        let w = 22.0 + text_width(name, 12.0) + 16.0;
        if x > 0.0 && x + w > width {
            x = 0.0;
            y += 20.0;
        }
        entries.push((x, y));
        x += w;
    }
    Legend {
        entries,
        height: if names.is_empty() { 0.0 } else { y + 20.0 },
    }
}

fn time_series(svg: &mut String, panel: &Panel, rect: &Rect, lines: &[Line], picture: &Picture) {
    panel_frame(svg, panel, rect);
    let names: Vec<&str> = lines.iter().map(|l| l.name.as_str()).collect();
    let legend = legend_layout(&names, rect.w - 16.0);
    let values = || {
        lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.1))
            .filter(|v| v.is_finite())
    };
    let plot_top = rect.y + PANEL_HEADER + 6.0;
    let plot_bottom = rect.y + rect.h - legend.height - 8.0 - 22.0;
    if values().next().is_none() {
        no_data(svg, rect.x + rect.w / 2.0, (plot_top + plot_bottom) / 2.0);
        return;
    }
    let lo = values().fold(0.0_f64, f64::min);
    let mut hi = values().fold(f64::NEG_INFINITY, f64::max);
    if hi <= lo {
        hi = lo + 1.0;
    }
    let unit = panel.unit.as_deref();
    let step = value_step(lo, hi, ((plot_bottom - plot_top) / 36.0).floor(), unit);
    // The axis spans whole steps, each labelled.
    let (lo, hi) = ((lo / step).floor() * step, (hi / step).ceil() * step);
    let ticks: Vec<f64> = (0..=((hi - lo) / step).round() as i64)
        .map(|i| lo + i as f64 * step)
        .collect();
    let labels: Vec<String> = ticks.iter().map(|t| units::axis_label(*t, unit)).collect();
    let label_width = labels.iter().map(|l| text_width(l, 12.0)).fold(0.0, f64::max);
    let plot_left = rect.x + 10.0 + label_width + 8.0;
    let plot_right = rect.x + rect.w - 14.0;
    let span = (picture.end - picture.start).max(1) as f64;
    let x = |t: i64| plot_left + (t - picture.start) as f64 / span * (plot_right - plot_left);
    let y = |v: f64| plot_bottom - (v - lo) / (hi - lo) * (plot_bottom - plot_top);

    for (tick, label) in ticks.iter().zip(&labels) {
        let ty = y(*tick);
        let _ = writeln!(
            svg,
            r#"<line x1="{plot_left:.1}" x2="{plot_right:.1}" y1="{ty:.1}" y2="{ty:.1}" stroke="{GRID}"/><text x="{:.1}" y="{:.1}" fill="{TEXT_DIM}" text-anchor="end">{}</text>"#,
            plot_left - 8.0,
            ty + 4.0,
            escape(label)
        );
    }
    let seconds = [5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200]
        .into_iter()
        .find(|s| span / (f64::from(*s) * 1000.0) <= (plot_right - plot_left) / 80.0)
        .unwrap_or(7200);
    let interval = i64::from(seconds) * 1000;
    let mut t = (picture.start + interval - 1).div_euclid(interval) * interval;
    while t <= picture.end {
        let tx = x(t);
        let _ = writeln!(
            svg,
            r#"<line x1="{tx:.1}" x2="{tx:.1}" y1="{plot_top:.1}" y2="{plot_bottom:.1}" stroke="{GRID}"/><text x="{tx:.1}" y="{:.1}" fill="{TEXT_DIM}" text-anchor="middle">{}</text>"#,
            plot_bottom + 16.0,
            clock(t, seconds < 60)
        );
        t += interval;
    }

    for (i, line) in lines.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        for segment in segments(&line.points, picture.step) {
            if let [(t, v)] = segment.as_slice() {
                let _ = writeln!(
                    svg,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="2" fill="{color}"/>"#,
                    x(*t),
                    y(*v)
                );
                continue;
            }
            let points: Vec<String> = segment
                .iter()
                .map(|(t, v)| format!("{:.1},{:.1}", x(*t), y(*v)))
                .collect();
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" stroke-linejoin="round" points="{}"/>"#,
                points.join(" ")
            );
        }
        let (lx, ly) = legend.entries[i];
        let (lx, ly) = (rect.x + 8.0 + lx, rect.y + rect.h - legend.height - 4.0 + ly);
        let _ = writeln!(
            svg,
            r#"<rect x="{lx:.1}" y="{:.1}" width="14" height="4" rx="1" fill="{color}"/><text x="{:.1}" y="{:.1}" fill="{TEXT}">{}</text>"#,
            ly + 8.0,
            lx + 20.0,
            ly + 14.0,
            escape(&line.name)
        );
    }
}

/// The runs of finite values without a missing step between them: Grafana leaves a
/// gap where a series has no value.
fn segments(points: &[(i64, f64)], step: i64) -> Vec<Vec<(i64, f64)>> {
    let mut out: Vec<Vec<(i64, f64)>> = Vec::new();
    let mut last: Option<i64> = None;
    for &(t, v) in points {
        if !v.is_finite() {
            last = None;
            continue;
        }
        match (last, out.last_mut()) {
            (Some(previous), Some(run)) if t - previous <= step + step / 2 => run.push((t, v)),
            _ => out.push(vec![(t, v)]),
        }
        last = Some(t);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dashboard::model::Dashboard;

    /// The dashboard with `lines` over five seconds.
    fn five_seconds(dashboard: &Dashboard, lines: &[Vec<Line>], note: &str) -> String {
        render(&Picture {
            dashboard,
            lines,
            start: 0,
            end: 5_000,
            step: 5_000,
            note,
        })
    }

    #[test]
    fn gaps_split_lines_and_nan_is_a_gap() {
        let points = [(0, 1.0), (10, 2.0), (30, 3.0), (40, f64::NAN), (50, 4.0), (60, 5.0)];
        let runs = segments(&points, 10);
        assert_eq!(
            runs,
            vec![vec![(0, 1.0), (10, 2.0)], vec![(30, 3.0)], vec![(50, 4.0), (60, 5.0)]]
        );
    }

    #[test]
    fn ticks_are_round_and_clock_like_for_seconds() {
        assert_eq!(value_step(0.0, 7.0, 4.0, None), 2.0);
        assert_eq!(value_step(0.0, 0.9, 4.0, None), 0.25);
        assert_eq!(value_step(0.0, 0.9, 4.0, Some("s")), 0.25);
        // 450 s in four ticks: two minutes, not 125 s.
        assert_eq!(value_step(0.0, 450.0, 4.0, Some("s")), 120.0);
        assert_eq!(value_step(0.0, 450.0, 4.0, None), 200.0);
        assert_eq!(clock(3_723_000, true), "01:02:03");
        assert_eq!(clock(3_723_000, false), "01:02");
    }

    #[test]
    fn the_value_axis_ends_on_a_labelled_tick_above_the_data() {
        let json = include_str!("../../../charts/muster/dashboards/muster.json");
        let dashboard = Dashboard::parse(json).unwrap();
        let index = dashboard
            .panels
            .iter()
            .position(|p| p.kind == Kind::TimeSeries)
            .unwrap();
        let mut lines: Vec<Vec<Line>> = dashboard.panels.iter().map(|_| Vec::new()).collect();
        lines[index] = vec![Line {
            name: "x".into(),
            points: vec![(0, 0.0), (5_000, 7.7)],
        }];
        let svg = five_seconds(&dashboard, &lines, "");
        assert!(svg.contains(">8</text>"), "{svg}");
        assert!(!svg.contains(">10</text>"));
    }

    #[test]
    fn every_panel_is_drawn_in_place_with_its_title() {
        let json = include_str!("../../../charts/muster/dashboards/muster.json");
        let dashboard = Dashboard::parse(json).unwrap();
        let lines: Vec<Vec<Line>> = dashboard
            .panels
            .iter()
            .map(|_| {
                vec![Line {
                    name: "a <b>".into(),
                    points: vec![(0, 1.0), (5_000, 2.0)],
                }]
            })
            .collect();
        let svg = five_seconds(&dashboard, &lines, "note");
        for panel in &dashboard.panels {
            assert!(svg.contains(&escape(&panel.title)), "{}", panel.title);
        }
        assert!(svg.contains("a &lt;b&gt;"));
        let time_series = dashboard.panels.iter().filter(|p| p.kind == Kind::TimeSeries).count();
        assert_eq!(svg.matches("<polyline").count(), time_series);
        let (width, height) = size(&dashboard);
        assert_eq!(width, WIDTH);
        assert!(height > HEADER + 80.0 * ROW_HEIGHT);
        assert!(svg.trim_end().ends_with("</svg>"));
    }
}
