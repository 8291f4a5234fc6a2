//! `sleuth run report`'s chart: a PNG of a run's learning curve against the
//! policy version (= the learner's step): training reward and validation
//! score above, failure rates (training and validation) below, the best
//! validated version marked. Text is drawn with a TrueType font from the
//! system (`SLEUTH_FONT`, else DejaVu Sans or Arial where they usually are).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;
use sleuth_metrics::reward::failure_rate;
use sleuth_proto::rollout::v1 as pb;

/// Where the chart's font is looked for when `SLEUTH_FONT` is unset.
const FONTS: [&str; 5] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
];

/// Registers the chart's font once per process.
fn register_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let path = match std::env::var_os("SLEUTH_FONT") {
                Some(path) => PathBuf::from(path),
                None => FONTS.iter().map(PathBuf::from).find(|p| p.is_file()).ok_or_else(|| {
                    "no TrueType font for the chart's text: set SLEUTH_FONT to a .ttf file \
                     (Debian: apt-get install fonts-dejavu-core)"
                        .to_owned()
                })?,
            };
            let bytes = std::fs::read(&path).map_err(|e| format!("SLEUTH_FONT {}: {e}", path.display()))?;
            plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
                .map_err(|_| format!("SLEUTH_FONT {}: not a TrueType font", path.display()))
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// A series: its name, colour and points (version, value).
type Series = (&'static str, RGBColor, Vec<(f64, f64)>);

/// Writes the chart of `run` to `path` (PNG, 1000x700).
pub fn write_png(run: &pb::Run, path: &Path) -> Result<()> {
    register_font()?;
    let training = |value: fn(&pb::VersionStats) -> f64| -> Vec<(f64, f64)> {
        run.training.iter().map(|t| (t.version as f64, value(t))).collect()
    };
    let validation = |value: &dyn Fn(&pb::Validation) -> f64| -> Vec<(f64, f64)> {
        run.validations.iter().map(|v| (v.version as f64, value(v))).collect()
    };
    let scores: Vec<Series> = vec![
        ("training reward", BLUE, training(|t| t.reward_mean)),
        ("validation score", RED, validation(&|v| sleuth_metrics::validation::score(v).unwrap_or_default())),
    ];
    let failures: Vec<Series> = vec![
        ("training failure rate", BLUE, training(|t| t.failure_rate)),
        ("validation failure rate", RED, validation(&|v| failure_rate(&v.metrics))),
    ];
    let last = scores.iter().chain(&failures).flat_map(|(_, _, points)| points.iter().map(|p| p.0)).fold(1.0, f64::max);

    let root = BitMapBackend::new(path, (1000, 700)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = match run.spec.as_ref().map(|s| s.name.as_str()).filter(|n| !n.is_empty()) {
        Some(name) => format!("{} ({name})", run.run_id),
        None => run.run_id.clone(),
    };
    let root = root.titled(&title, ("sans-serif", 24))?;
    let (top, bottom) = root.split_vertically(400);
    let low = scores.iter().flat_map(|(_, _, p)| p.iter().map(|p| p.1)).fold(0.0, f64::min).max(-1.0);
    // Legends where the curves usually are not: scores rise, failures fall.
    panel(&top, "reward / nDCG@10 / score", &scores, (last, low..1.0), SeriesLabelPosition::LowerRight, run)?;
    panel(&bottom, "failure rate", &failures, (last, 0.0..1.0), SeriesLabelPosition::UpperRight, run)?;
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// One panel: `series` against the version, the best validated version as a dashed line.
fn panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    y_label: &str,
    series: &[Series],
    (last, y): (f64, std::ops::Range<f64>),
    legend: SeriesLabelPosition,
    run: &pb::Run,
) -> Result<()> {
    let mut chart = ChartBuilder::on(area)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..last, y.clone())?;
    chart.configure_mesh().x_desc("policy version (learner step)").y_desc(y_label).draw()?;
    for (name, colour, points) in series {
        let colour = *colour;
        chart
            .draw_series(LineSeries::new(points.iter().copied(), colour.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, colour.filled())))?;
    }
    if !run.validations.is_empty() {
        let best = run.best_version as f64;
        let dash = (y.end - y.start) / 40.0;
        let dashes = (0..20).map(|i| y.start + 2.0 * dash * f64::from(i));
        chart
            .draw_series(dashes.map(|from| PathElement::new(vec![(best, from), (best, from + dash)], BLACK)))?
            .label(format!("best by validation (version {})", run.best_version))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    }
    chart.configure_series_labels().position(legend).background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_is_a_png_of_the_run() -> Result<()> {
        let run = pb::Run {
            run_id: "chart-test".into(),
            training: (0..6)
                .map(|v| pb::VersionStats {
                    version: v,
                    episodes: 8,
                    reward_mean: -0.5 + 0.2 * v as f64,
                    failure_rate: 0.5 - 0.05 * v as f64,
                    ..Default::default()
                })
                .collect(),
            validations: [(0, 0.1), (2, 0.4), (4, 0.35)]
                .into_iter()
                .map(|(version, ndcg)| pb::Validation {
                    version,
                    metrics: [("ndcg@10".into(), ndcg), ("failure_rate:turn_limit".into(), 0.2)].into(),
                    ..Default::default()
                })
                .collect(),
            best_version: 2,
            ..Default::default()
        };
        let dir = tempfile::tempdir()?;
        // SLEUTH_CHART_OUT=/tmp/chart.png keeps the chart to look at.
        let path = std::env::var_os("SLEUTH_CHART_OUT").map_or_else(|| dir.path().join("chart.png"), PathBuf::from);
        write_png(&run, &path)?;
        let bytes = std::fs::read(&path)?;
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "a PNG");
        let dimension = |at: usize| u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        assert_eq!((dimension(16), dimension(20)), (1000, 700));
        assert!(bytes.len() > 10_000, "curves, axes and text drawn: {} bytes", bytes.len());
        Ok(())
    }
}
