//! The report: one row per scenario and mode, aggregated over seeds, as a table, as JSON,
//! and as one SVG per scenario of each region's enforced share against its demand.
//!
//! Aggregation: safety figures (max Σ R/ρ, OA, fallback time, reconvergence, τ5 max) take
//! the worst seed; utilisation, false rejections, τ5 and bytes take the mean.

use std::fmt::Write as _;

use serde::Serialize;

use super::Outcome;
use super::metrics::Sample;
use super::regime::ModeKind;
use super::scenario::Scenario;

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub scenario: String,
    pub title: String,
    pub mode: String,
    /// Seeds that completed (a violation stops a run; it is counted in `violations`).
    pub seeds: u64,
    pub violations: u64,
    pub max_rate_ratio: f64,
    pub oa60_max: f64,
    /// OA over windows of 1–10 s, worst seed.
    pub oa_short_max: f64,
    pub utilization: f64,
    pub utilization_min: f64,
    pub false_rejections: f64,
    /// Mean over seeds; `None` when some seed never settled after a step (or no steps).
    pub tau5_s: Option<f64>,
    pub tau5_max_s: Option<f64>,
    pub fallback_s: Option<f64>,
    pub partition_utilization: Option<f64>,
    pub best_safe_utilization: Option<f64>,
    pub reconverge_s: Option<f64>,
    pub bytes_per_key_round: Option<f64>,
    pub writes_per_key_round: Option<f64>,
}

pub fn aggregate(scenarios: &[Scenario], modes: &[ModeKind], outcomes: &[Outcome]) -> Vec<Row> {
    let mut rows = Vec::new();
    for (s, sc) in scenarios.iter().enumerate() {
        for &mode in modes {
            let mine: Vec<&Outcome> = outcomes
                .iter()
                .filter(|o| o.scenario == s && o.mode == mode)
                .collect();
            let ok: Vec<_> = mine.iter().filter_map(|o| o.result.as_ref().ok()).collect();
            let violations = (mine.len() - ok.len()) as u64;
            if ok.is_empty() && violations == 0 {
                continue;
            }
            let max =
                |f: &dyn Fn(&super::RunMetrics) -> f64| ok.iter().map(|m| f(m)).fold(0.0, f64::max);
            let mean = |f: &dyn Fn(&super::RunMetrics) -> f64| {
                ok.iter().map(|m| f(m)).sum::<f64>() / ok.len().max(1) as f64
            };
            let opt_all = |f: &dyn Fn(&super::RunMetrics) -> Option<f64>| -> Option<Vec<f64>> {
                ok.iter().map(|m| f(m)).collect()
            };
            let opt_mean = |v: Option<Vec<f64>>| {
                v.filter(|v| !v.is_empty())
                    .map(|v| v.iter().sum::<f64>() / v.len() as f64)
            };
            let opt_max = |v: Option<Vec<f64>>| {
                v.filter(|v| !v.is_empty())
                    .map(|v| v.iter().cloned().fold(0.0, f64::max))
            };
            let partition = sc.partition.is_some();
            rows.push(Row {
                scenario: sc.id.clone(),
                title: sc.title.clone(),
                mode: mode.name().to_owned(),
                seeds: ok.len() as u64,
                violations,
                // Runs that broke the bound count with the ratio they broke it at.
                max_rate_ratio: mine
                    .iter()
                    .filter_map(|o| o.result.as_ref().err().and_then(|v| v.ratio))
                    .fold(max(&|m| m.max_rate_ratio), f64::max),
                oa60_max: max(&|m| m.oa60),
                oa_short_max: max(&|m| m.oa_short),
                utilization: mean(&|m| m.utilization),
                utilization_min: ok
                    .iter()
                    .map(|m| m.utilization)
                    .fold(f64::INFINITY, f64::min),
                false_rejections: mean(&|m| m.false_rejections),
                tau5_s: opt_mean(opt_all(&|m| m.tau5_s)),
                tau5_max_s: opt_max(opt_all(&|m| m.tau5_s)),
                fallback_s: if partition && mode == ModeKind::Lease {
                    // A seed that never fell back makes the worst case "never".
                    opt_max(opt_all(&|m| m.fallback_s))
                } else {
                    None
                },
                partition_utilization: opt_mean(opt_all(&|m| m.partition_utilization)),
                best_safe_utilization: opt_mean(opt_all(&|m| m.best_safe_utilization)),
                reconverge_s: if partition && mode == ModeKind::Lease {
                    opt_max(opt_all(&|m| m.reconverge_s))
                } else {
                    None
                },
                bytes_per_key_round: opt_mean(opt_all(&|m| m.bytes_per_key_round)),
                writes_per_key_round: opt_mean(opt_all(&|m| m.writes_per_key_round)),
            });
        }
    }
    rows
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.digits$}"))
}

/// The rows as a fixed-width table.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<4} {:<13} {:>5} {:>8} {:>6} {:>7} {:>6} {:>7} {:>11} {:>8} {:>11} {:>7} {:>7} {:>7}",
        "scen",
        "mode",
        "seeds",
        "maxΣR/ρ",
        "OA60",
        "OA1-10",
        "η",
        "falsrej",
        "τ5 mean/max",
        "fallback",
        "part η/best",
        "reconv",
        "B/key",
        "W/key"
    );
    for r in rows {
        let tau = match (r.tau5_s, r.tau5_max_s) {
            (Some(a), Some(b)) => format!("{a:.1}/{b:.1}"),
            _ => "-".to_owned(),
        };
        let part = match (r.partition_utilization, r.best_safe_utilization) {
            (Some(a), Some(b)) => format!("{a:.3}/{b:.3}"),
            _ => "-".to_owned(),
        };
        let seeds = if r.violations > 0 {
            format!("{}!{}", r.seeds, r.violations)
        } else {
            r.seeds.to_string()
        };
        let _ = writeln!(
            out,
            "{:<4} {:<13} {:>5} {:>8.4} {:>6.3} {:>7.3} {:>6.3} {:>6.2}% {:>11} {:>8} {:>11} {:>7} {:>7} {:>7}",
            r.scenario,
            r.mode,
            seeds,
            r.max_rate_ratio,
            r.oa60_max,
            r.oa_short_max,
            r.utilization,
            r.false_rejections * 100.0,
            tau,
            opt(r.fallback_s, 2),
            part,
            opt(r.reconverge_s, 2),
            opt(r.bytes_per_key_round, 0),
            opt(r.writes_per_key_round, 2),
        );
    }
    out
}

pub fn json(rows: &[Row]) -> String {
    serde_json::to_string_pretty(rows).expect("plain data")
}

const COLORS: [&str; 4] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];

/// Each region's enforced rate (solid) and offered demand (dashed) over time, with the
/// scenario's partition shaded. Written by hand: a few polylines and labels; plotting
/// crates lay out text with a font backend (system fonts or an embedded font file) that
/// this does not need. The pieces are helpers below, each writing its part of the image
/// in the order the elements stand in the file (later elements paint over earlier ones).
pub fn svg(sc: &Scenario, samples: &[Sample]) -> String {
    let f = Frame::new(sc, samples);
    let mut s = String::new();
    svg_header(&mut s, sc, &f);
    svg_axes(&mut s, &f);
    let regions = samples.first().map_or(0, |s| s.demand.len());
    for r in 0..regions {
        svg_region(&mut s, sc, samples, &f, r);
    }
    s.push_str("</svg>\n");
    s
}

/// The plot's geometry: the canvas, its margins, and the scales from scenario seconds and
/// units/s to pixels. One value shared by the helpers of [`svg`], so that every part is
/// drawn on the same axes.
#[derive(Clone, Copy)]
struct Frame {
    w: f64,
    h: f64,
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
    t_max: f64,
    y_step: f64,
    y_max: f64,
}

impl Frame {
    /// The canvas and margins are fixed; the time axis spans the scenario, the value axis
    /// the largest rate or demand sampled (at least ρ/10) plus 5%, rounded up to a grid
    /// step.
    fn new(sc: &Scenario, samples: &[Sample]) -> Frame {
        let (w, h) = (900.0, 420.0);
        let (left, right, top, bottom) = (60.0, 160.0, 40.0, 40.0);
        let t_max = sc.duration_s.max(1.0);
        let top_value = samples
            .iter()
            .flat_map(|s| s.rates.iter().chain(&s.demand))
            .fold(sc.rho * 0.1, |a, &b| a.max(b))
            * 1.05;
        let y_step = nice_step(top_value / 5.0);
        let y_max = (top_value / y_step).ceil() * y_step;
        Frame {
            w,
            h,
            left,
            right,
            top,
            bottom,
            t_max,
            y_step,
            y_max,
        }
    }

    /// Pixel column of scenario second `t`.
    fn x(&self, t: f64) -> f64 {
        self.left + (self.w - self.left - self.right) * t / self.t_max
    }

    /// Pixel row of value `v` (units/s).
    fn y(&self, v: f64) -> f64 {
        self.top + (self.h - self.top - self.bottom) * (1.0 - v / self.y_max)
    }
}

/// The opening tag, the background, the title and the shaded partition: what every
/// other part is drawn over. Split out of [`svg`].
fn svg_header(s: &mut String, sc: &Scenario, f: &Frame) {
    // Only the fields the format strings name; the rest are read through `f`.
    let Frame {
        w, h, left, top, ..
    } = *f;
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="22" font-size="14">{} {}: enforced rate (solid) vs offered demand (dashed), key k0, mode lease</text>"#,
        sc.id,
        escape(&sc.title)
    );
    if let Some(p) = &sc.partition {
        let _ = writeln!(
            s,
            r##"<rect x="{:.1}" y="{top}" width="{:.1}" height="{:.1}" fill="#eeeeee"/>"##,
            f.x(p.start_s),
            f.x(p.end_s) - f.x(p.start_s),
            h - top - f.bottom
        );
    }
}

/// Axes and grid: horizontal grid lines with their values, time labels, the axis titles
/// and the plot's border. Split out of [`svg`].
fn svg_axes(s: &mut String, f: &Frame) {
    // Only the fields the format strings name; the rest are read through `f`.
    let Frame { left, top, .. } = *f;
    let y_lines = (f.y_max / f.y_step).round() as usize;
    for i in 0..=y_lines {
        let v = f.y_step * i as f64;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#dddddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{v:.0}</text>"##,
            f.w - f.right,
            f.y(v),
            f.y(v),
            left - 6.0,
            f.y(v) + 4.0
        );
    }
    let step = nice_step(f.t_max / 8.0);
    let mut t = 0.0;
    while t <= f.t_max + 1e-9 {
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{t:.0}</text>"#,
            f.x(t),
            f.h - f.bottom + 16.0
        );
        t += step;
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time (s)</text><text x="14" y="{:.1}" transform="rotate(-90 14 {:.1})" text-anchor="middle">units/s</text>"#,
        (left + f.w - f.right) / 2.0,
        f.h - 6.0,
        f.h / 2.0,
        f.h / 2.0
    );
    let _ = writeln!(
        s,
        r##"<rect x="{left}" y="{top}" width="{:.1}" height="{:.1}" fill="none" stroke="#333333"/>"##,
        f.w - left - f.right,
        f.h - top - f.bottom
    );
}

/// Region `r`: its enforced rate (solid) and offered demand (dashed) as polylines, and
/// its legend entry. Split out of [`svg`].
fn svg_region(s: &mut String, sc: &Scenario, samples: &[Sample], f: &Frame, r: usize) {
    let Frame { w, right, top, .. } = *f;
    let color = COLORS[r % COLORS.len()];
    for (dash, pick) in [("", 0), (r#" stroke-dasharray="5,4""#, 1)] {
        let points: Vec<String> = samples
            .iter()
            .map(|smp| {
                let v = if pick == 0 {
                    smp.rates.get(r).copied().unwrap_or(0.0)
                } else {
                    smp.demand[r]
                };
                format!("{:.1},{:.1}", f.x(smp.t_s), f.y(v))
            })
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5"{dash} points="{}"/>"#,
            points.join(" ")
        );
    }
    let ly = top + 18.0 * r as f64 + 10.0;
    let _ = writeln!(
        s,
        r#"<line x1="{:.1}" x2="{:.1}" y1="{ly:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{}</text>"#,
        w - right + 10.0,
        w - right + 34.0,
        w - right + 40.0,
        ly + 4.0,
        escape(&sc.region_name(r))
    );
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    let base = 10f64.powf(raw.max(1e-9).log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * base)
        .find(|&c| c >= raw)
        .unwrap_or(10.0 * base)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
