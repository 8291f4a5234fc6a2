//! Line charts as inline SVG: one or more series against step, each point a
//! vertex of the series' polyline (and, on short series, a dot whose
//! tooltip gives its value), with a dashed line at a marked step (the best
//! checkpoint). No script: the browser draws it as it arrives.

use std::fmt::Write as _;

use super::html::escape;

const WIDTH: f64 = 460.0;
const HEIGHT: f64 = 190.0;
const LEFT: f64 = 52.0;
const RIGHT: f64 = 12.0;
const TOP: f64 = 10.0;
const BOTTOM: f64 = 24.0;
/// Series longer than this get no dots (the page would grow by a few
/// hundred bytes per point); the polyline keeps every point.
const DOTS_UP_TO: usize = 200;
const COLOURS: [&str; 6] = ["#1a73e8", "#d93025", "#188038", "#e37400", "#9334e6", "#5f6368"];

/// (step, value).
type Point = (f64, f64);

/// One line of a chart.
pub struct Series {
    /// Shown in the legend and the tooltips.
    pub name: String,
    /// (step, value) pairs, in step order; non-finite values are left out.
    pub points: Vec<(f64, f64)>,
}

/// One chart of the run page.
pub struct Chart<'a> {
    /// What the chart shows (the `data-metric` the tests and users look for).
    pub metric: &'a str,
    pub title: &'a str,
    pub series: Vec<Series>,
    /// A step to mark with a dashed line and its label (the best checkpoint).
    pub mark: Option<(f64, &'a str)>,
}

impl Chart<'_> {
    /// The chart as a `<figure>` with an inline SVG; a note instead when
    /// there is nothing to draw yet.
    pub fn render(&self) -> String {
        // Each series with its finite points, and its index for its colour.
        let series: Vec<(usize, &Series, Vec<Point>)> = self
            .series
            .iter()
            .enumerate()
            .map(|(i, s)| (i, s, s.points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()).collect()))
            .filter(|(_, _, points): &(usize, &Series, Vec<Point>)| !points.is_empty())
            .collect();
        let total: usize = series.iter().map(|(_, _, p)| p.len()).sum();
        let mut out = format!(
            "<figure data-metric=\"{}\" data-points=\"{total}\"><figcaption>{}</figcaption>",
            escape(self.metric),
            escape(self.title)
        );
        if total == 0 {
            out.push_str("<p>nothing recorded yet</p></figure>");
            return out;
        }
        let all = series.iter().flat_map(|(_, _, p)| p.iter());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(x, y) in all {
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
        if let Some((x, _)) = self.mark {
            (x0, x1) = (x0.min(x), x1.max(x));
        }
        if x1 - x0 < 1e-12 {
            // One step so far: centred, the axis not running below step 0.
            (x0, x1) = ((x0 - 1.0).max(0.0), x1 + 1.0);
        }
        if y1 - y0 < 1e-12 {
            let pad = if y0 == 0.0 { 1.0 } else { y0.abs() * 0.1 };
            (y0, y1) = (y0 - pad, y1 + pad);
        }
        let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * (WIDTH - LEFT - RIGHT);
        let sy = |y: f64| TOP + (y1 - y) / (y1 - y0) * (HEIGHT - TOP - BOTTOM);
        let _ = write!(
            out,
            "<svg viewBox=\"0 0 {WIDTH} {HEIGHT}\" width=\"{WIDTH}\" height=\"{HEIGHT}\" role=img>\
             <g stroke=\"#c5cad3\" font-size=\"10\" fill=\"#5a6375\">"
        );
        for i in 0..=2 {
            let y = y0 + (y1 - y0) * f64::from(i) / 2.0;
            let _ = write!(
                out,
                "<line x1=\"{LEFT}\" x2=\"{}\" y1=\"{py:.1}\" y2=\"{py:.1}\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=end stroke=none>{}</text>",
                WIDTH - RIGHT,
                LEFT - 4.0,
                sy(y) + 3.0,
                tick(y, y1 - y0),
                py = sy(y)
            );
        }
        let _ = write!(
            out,
            "<text x=\"{LEFT}\" y=\"{}\" stroke=none>step {}</text><text x=\"{}\" y=\"{}\" text-anchor=end stroke=none>{}</text></g>",
            HEIGHT - 6.0,
            tick(x0, x1 - x0),
            WIDTH - RIGHT,
            HEIGHT - 6.0,
            tick(x1, x1 - x0)
        );
        if let Some((x, label)) = self.mark {
            let px = sx(x);
            let _ = write!(
                out,
                "<g class=mark><line x1=\"{px:.1}\" x2=\"{px:.1}\" y1=\"{TOP}\" y2=\"{}\" stroke=\"#e37400\" stroke-dasharray=\"4 3\"/>\
                 <text x=\"{:.1}\" y=\"{}\" font-size=\"10\" fill=\"#e37400\">{}</text></g>",
                HEIGHT - BOTTOM,
                px + 3.0,
                TOP + 9.0,
                escape(label),
            );
        }
        for (i, s, points) in &series {
            let colour = COLOURS[i % COLOURS.len()];
            let path: Vec<String> = points.iter().map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y))).collect();
            let _ = write!(
                out,
                "<polyline class=series data-series=\"{}\" fill=none stroke=\"{colour}\" stroke-width=\"1.5\" points=\"{}\"/>",
                escape(&s.name),
                path.join(" ")
            );
            if points.len() <= DOTS_UP_TO {
                for &(x, y) in points {
                    let _ = write!(
                        out,
                        "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"2.5\" fill=\"{colour}\"><title>{} at step {}: {y:.4}</title></circle>",
                        sx(x),
                        sy(y),
                        escape(&s.name),
                        tick(x, 1.0)
                    );
                }
            }
        }
        out.push_str("</svg><div class=legend>");
        for (i, s, _) in &series {
            let _ =
                write!(out, "<span style=\"color:{}\">&#9644; {}</span>", COLOURS[i % COLOURS.len()], escape(&s.name));
        }
        out.push_str("</div></figure>");
        out
    }
}

/// An axis label with as many decimals as the axis' `span` needs to tell
/// its ticks apart (entropy moving in the fourth decimal), trailing zeros cut.
fn tick(value: f64, span: f64) -> String {
    let magnitude = value.abs().max(span.abs());
    if magnitude != 0.0 && !(1e-4..1e6).contains(&magnitude) {
        return format!("{value:.2e}");
    }
    let decimals = if span > 0.0 { (2.0 - span.log10().floor()).clamp(0.0, 8.0) as usize } else { 3 };
    let text = format!("{value:.decimals$}");
    if text.contains('.') { text.trim_end_matches('0').trim_end_matches('.').to_owned() } else { text }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_point_is_a_vertex_and_the_mark_is_drawn() {
        let chart = Chart {
            metric: "loss",
            title: "Loss",
            series: vec![
                Series { name: "loss".into(), points: vec![(1.0, 0.5), (2.0, 0.25), (3.0, f64::NAN), (4.0, 0.1)] },
                Series { name: "empty".into(), points: Vec::new() },
            ],
            mark: Some((2.0, "best")),
        };
        let svg = chart.render();
        assert!(svg.contains("data-points=\"3\""), "{svg}");
        let polyline = svg.split(" points=\"").nth(1).and_then(|s| s.split('"').next()).expect("a polyline");
        assert_eq!(polyline.split(' ').count(), 3, "{svg}");
        assert_eq!(svg.matches("<circle").count(), 3);
        assert!(svg.contains("class=mark") && svg.contains(">best<"));
        assert!(!svg.contains("empty"), "a series with no points has no legend entry: {svg}");
        let nothing = Chart { metric: "kl", title: "KL", series: Vec::new(), mark: None }.render();
        assert!(nothing.contains("nothing recorded yet") && !nothing.contains("<svg"));
    }

    #[test]
    fn labels_have_the_digits_their_axis_needs() {
        assert_eq!(tick(0.5, 1.0), "0.5");
        assert_eq!(tick(12.0, 8.0), "12");
        assert_eq!(tick(1067.368, 1000.0), "1067");
        assert_eq!(tick(10.7893, 0.0012), "10.7893", "ticks 0.0006 apart stay apart");
        assert_eq!(tick(0.000_012, 0.000_01), "1.20e-5");
        assert_eq!(tick(0.0, 1.0), "0");
    }
}
