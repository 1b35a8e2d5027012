//! A rate over the last hour, drawn on the server as SVG (no script on the page).

use maud::{Markup, html};

/// Width and height of the drawing, in SVG units (it scales to its box).
const W: f64 = 320.0;
const H: f64 = 110.0;
/// Room for the labels.
const LEFT: f64 = 52.0;
const BOTTOM: f64 = 18.0;

/// A line of `points` — (seconds before now, value), oldest first — over the last `span`
/// seconds, with the largest value and the time axis labelled. An empty series draws the
/// frame and says so.
pub(crate) fn rate_chart(title: &str, unit: &str, points: &[(f64, f64)], span: f64) -> Markup {
    let top = points.iter().map(|p| p.1).fold(0.0_f64, f64::max);
    let scale = if top > 0.0 { top } else { 1.0 };
    let x = |ago: f64| LEFT + (W - LEFT) * (1.0 - (ago / span).clamp(0.0, 1.0));
    let y = |v: f64| (H - BOTTOM) * (1.0 - (v / scale).clamp(0.0, 1.0));
    let line: Vec<String> = points
        .iter()
        .map(|(ago, v)| format!("{:.1},{:.1}", x(*ago), y(*v)))
        .collect();
    let minutes = (span / 60.0).round();
    html! {
        figure.chart {
            svg viewBox=(format!("0 0 {W} {H}")) role="img"
                aria-label=(format!("{title}: at most {} {unit} over the last {minutes} minutes", fmt(top))) {
                line x1=(LEFT) y1=(H - BOTTOM) x2=(W) y2=(H - BOTTOM) class="axis" {}
                line x1=(LEFT) y1="0" x2=(LEFT) y2=(H - BOTTOM) class="axis" {}
                text x=(LEFT - 4.0) y="12" text-anchor="end" { (fmt(top)) }
                text x=(LEFT - 4.0) y=(H - BOTTOM) text-anchor="end" { "0" }
                text x=(LEFT) y=(H - 2.0) { "−" (minutes) " min" }
                text x=(W) y=(H - 2.0) text-anchor="end" { "now" }
                @if line.len() > 1 {
                    polyline points=(line.join(" ")) class="series" {}
                } @else {
                    text x=((W + LEFT) / 2.0) y=((H - BOTTOM) / 2.0) text-anchor="middle" class="empty" {
                        "sampling…"
                    }
                }
            }
            figcaption { (title) " (" (unit) ")" }
        }
    }
}

/// A value as people read it: whole numbers with thin separators, one decimal below 10.
pub(crate) fn fmt(v: f64) -> String {
    if v.abs() < 10.0 && v.fract() != 0.0 {
        return format!("{v:.1}");
    }
    let whole = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, c) in whole.chars().enumerate() {
        if i > 0 && (whole.len() - i) % 3 == 0 {
            out.push('\u{202f}');
        }
        out.push(c);
    }
    if v < 0.0 { format!("-{out}") } else { out }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_as_people_write_them() {
        assert_eq!(fmt(0.0), "0");
        assert_eq!(fmt(2.5), "2.5");
        assert_eq!(fmt(1234567.0), "1\u{202f}234\u{202f}567");
        assert_eq!(fmt(-12000.0), "-12\u{202f}000");
    }

    #[test]
    fn a_series_is_a_line_and_an_empty_one_says_it_samples() {
        let svg =
            rate_chart("writes", "rows/s", &[(3600.0, 0.0), (0.0, 50.0)], 3600.0).into_string();
        assert!(
            svg.contains("<polyline points=\"52.0,92.0 320.0,0.0\""),
            "{svg}"
        );
        assert!(svg.contains("at most 50 rows/s"), "{svg}");
        let empty = rate_chart("writes", "rows/s", &[], 3600.0).into_string();
        assert!(
            empty.contains("sampling…") && !empty.contains("polyline"),
            "{empty}"
        );
    }
}
