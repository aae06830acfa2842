//! `--plot FILE.png`: latency histogram (top) and CDF (bottom), drawn with
//! plotters' bitmap backend. Text uses a font compiled into the binary
//! (Hack, from `epaint_default_fonts`) through plotters' `ab_glyph`
//! support, so no fontconfig or system font is needed.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;

use super::stats::percentile;
use super::{BenchError, Result, RunInfo};

const FONT: &str = "sans-serif";
const BINS: usize = 60;

fn register_font() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut ok = true;
    ONCE.call_once(|| {
        ok = plotters::style::register_font(
            FONT,
            FontStyle::Normal,
            epaint_default_fonts::HACK_REGULAR,
        )
        .is_ok();
    });
    if ok {
        Ok(())
    } else {
        Err(BenchError::Plot("the embedded font does not load".into()))
    }
}

fn err<E: std::fmt::Debug>(e: E) -> BenchError {
    BenchError::Plot(format!("{e:?}"))
}

/// Histogram bins of `sorted` over `lo..hi` (samples above `hi` go to the
/// last bin): `(start, end, count)`.
pub(crate) fn histogram(sorted: &[f64], lo: f64, hi: f64, bins: usize) -> Vec<(f64, f64, u32)> {
    let width = ((hi - lo) / bins as f64).max(f64::MIN_POSITIVE);
    let mut counts = vec![0u32; bins];
    for &x in sorted {
        let b = (((x - lo) / width).floor().max(0.0) as usize).min(bins - 1);
        counts[b] += 1;
    }
    counts
        .into_iter()
        .enumerate()
        .map(|(i, c)| (lo + i as f64 * width, lo + (i + 1) as f64 * width, c))
        .collect()
}

/// Draw `series` (message size, latency samples in µs). The histogram shows
/// the first series up to its 95th percentile (the tail piles into the
/// last bin); the CDF shows every series over its full range, on a
/// logarithmic latency axis so that the tail stays visible.
pub fn latency_png(path: &Path, info: &RunInfo, series: &[(u32, &[f64])]) -> Result<()> {
    register_font()?;
    let Some(&(first_size, first)) = series.first() else {
        return Err(BenchError::Plot("no samples".into()));
    };
    if first.is_empty() {
        return Err(BenchError::Plot("no samples".into()));
    }
    let sorted_all: Vec<Vec<f64>> = series
        .iter()
        .map(|(_, s)| {
            let mut v = s.to_vec();
            v.sort_by(f64::total_cmp);
            v
        })
        .collect();
    let sorted = &sorted_all[0];
    let lo = sorted[0];
    let p95 = percentile(sorted, 0.95);
    let hi = if p95 > lo { p95 } else { lo + 1.0 };
    let bins = histogram(sorted, lo, hi, BINS);
    let max_count = bins.iter().map(|b| b.2).max().unwrap_or(1).max(1);
    let median = super::stats::median(sorted);
    let p90 = percentile(sorted, 0.90);
    let p99 = percentile(sorted, 0.99);
    let p999 = percentile(sorted, 0.999);

    let root = BitMapBackend::new(path, (1100, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (top, bottom) = root.split_vertically(450);
    let what = if info.latency_factor == 2 {
        "one-way"
    } else {
        "round trip"
    };
    let caption = format!(
        "stag lat {} on {} ({}, {}): {} B, {} latency; p99 {:.1} us, p99.9 {:.1} us",
        info.op, info.device, info.support, info.completions, first_size, what, p99, p999
    );

    let mut hist = ChartBuilder::on(&top)
        .caption(caption, (FONT, 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(lo..hi, 0u32..(max_count + max_count / 10 + 1))
        .map_err(err)?;
    hist.configure_mesh()
        .x_desc("latency [usec], min to p95 (slower samples in the last bin)")
        .y_desc("count")
        .label_style((FONT, 14))
        .draw()
        .map_err(err)?;
    hist.draw_series(
        bins.iter()
            .map(|&(a, b, c)| Rectangle::new([(a, 0), (b, c)], BLUE.mix(0.55).filled())),
    )
    .map_err(err)?;
    for (x, name, color) in [(median, "median", RED), (p90, "p90", MAGENTA)] {
        if x <= hi {
            hist.draw_series(LineSeries::new(
                [(x, 0), (x, max_count)],
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label(format!("{name} {x:.2} us"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        }
    }
    hist.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;

    let cdf_lo = sorted_all
        .iter()
        .map(|s| s[0])
        .fold(f64::INFINITY, f64::min);
    let cdf_hi = sorted_all
        .iter()
        .map(|s| s[s.len() - 1])
        .fold(f64::NEG_INFINITY, f64::max);
    let cdf_hi = if cdf_hi > cdf_lo {
        cdf_hi
    } else {
        cdf_lo + 1.0
    };
    let mut cdf = ChartBuilder::on(&bottom)
        .caption("CDF", (FONT, 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((cdf_lo..cdf_hi).log_scale(), 0f64..1f64)
        .map_err(err)?;
    cdf.configure_mesh()
        .x_desc("latency [usec], log scale")
        .x_labels(6)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_desc("fraction of samples ≤ x")
        .label_style((FONT, 14))
        .draw()
        .map_err(err)?;
    let legend = series.len() <= 8;
    for (k, ((size, _), s)) in series.iter().zip(&sorted_all).enumerate() {
        let color = Palette99::pick(k).to_rgba();
        let n = s.len() as f64;
        let drawn = cdf
            .draw_series(LineSeries::new(
                s.iter().enumerate().map(|(i, &x)| (x, (i + 1) as f64 / n)),
                color.stroke_width(2),
            ))
            .map_err(err)?;
        if legend {
            drawn.label(format!("{size} B")).legend(move |(x, y)| {
                PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
            });
        }
    }
    if legend {
        cdf.configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font((FONT, 14))
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_bins_cover_everything() {
        let v = [1.0, 1.5, 2.0, 2.5, 3.0, 100.0];
        let h = histogram(&v, 1.0, 3.0, 4);
        assert_eq!(h.len(), 4);
        assert_eq!(h.iter().map(|b| b.2).sum::<u32>(), 6);
        assert_eq!(h[0], (1.0, 1.5, 1));
        // 3.0 and the 100 µs outlier pile into the last bin.
        assert_eq!(h[3].2, 3);
    }
}
