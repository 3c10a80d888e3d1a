//! The bench's plots: `target/bench/ratios.svg`, each route's throughput
//! as a ratio to direct, per workload (the paths part); and
//! `target/bench/xdp_ratios.svg`, `lb_xdp`'s program time per packet as a
//! ratio to its yardsticks, with each goal (the external part).

use std::path::Path;

use plotters::{
    coord::{Shift, types::RangedCoordf64},
    prelude::*,
    style::text_anchor::{HPos, Pos, VPos},
};

use super::{
    paths::Route,
    results::{External, Results, Workload},
};

const COLORS: [RGBColor; 5] = [
    RGBColor(120, 120, 120),
    RGBColor(160, 190, 220),
    RGBColor(31, 119, 180),
    RGBColor(230, 120, 40),
    RGBColor(44, 160, 44),
];

/// Grouped bars: per workload, one bar per route, the height its ratio to
/// direct, labelled with it; a line at 1.0 (direct).
pub fn ratios(r: &Results, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let workloads: Vec<Workload> = r.paths.iter().map(|(w, _)| *w).collect();
    let top = workloads
        .iter()
        .flat_map(|w| Route::ALL.map(|route| r.ratio(*w, route).unwrap_or(0.0)))
        .fold(1.0f64, f64::max)
        * 1.15;
    let (full, legend, mut chart) = canvas(
        path,
        "lb bench: throughput × direct, per path and workload (higher is better)",
        workloads.len(),
        top,
        "× direct",
    )?;
    let width = 0.8 / Route::ALL.len() as f64;
    for (i, route) in Route::ALL.iter().enumerate() {
        let color = COLORS[i];
        let bars: Vec<(f64, f64)> = workloads
            .iter()
            .enumerate()
            .filter_map(|(g, w)| Some((g as f64 + 0.1 + i as f64 * width, r.ratio(*w, *route)?)))
            .collect();
        draw_bars(&mut chart, &bars, width, top, color)?;
        legend_entry(&legend, i, color, route.label())?;
    }
    chart.draw_series(std::iter::once(PathElement::new(
        vec![(0.0, 1.0), (workloads.len() as f64, 1.0)],
        BLACK.stroke_width(1),
    )))?;
    // Workload names under their groups, in the backend's own coordinates.
    for (g, w) in workloads.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        let label = format!("{} ({})", w.label(), w.unit());
        full.draw(&Text::new(
            label,
            (x, y + 12),
            ("sans-serif", 15).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Top)),
        ))?;
    }
    full.present()?;
    Ok(())
}

/// Per case, a bar per family: `lb_xdp`'s time as a ratio to its
/// yardstick (the reference forwarder, or the pass-through program),
/// labelled with it; the case's goal as a line over its bars.
pub fn program_ratios(e: &External, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let Some(first) = e.program.first() else { return Ok(()) };
    let cases = first.cases(e.pass_ns).len();
    let top = e
        .program
        .iter()
        .flat_map(|p| p.cases(e.pass_ns).map(|c| c.ratio().max(c.at_most)))
        .fold(1.0f64, f64::max)
        * 1.15;
    let (full, legend, mut chart) = canvas(
        path,
        "lb_xdp: program time per packet × its yardstick (lower is better; line: goal)",
        cases,
        top,
        "× yardstick",
    )?;
    let width = 0.8 / e.program.len() as f64;
    for (i, p) in e.program.iter().enumerate() {
        let color = COLORS[2 + i % 3];
        let bars: Vec<(f64, f64)> = p
            .cases(e.pass_ns)
            .iter()
            .enumerate()
            .map(|(g, c)| (g as f64 + 0.1 + i as f64 * width, c.ratio()))
            .collect();
        draw_bars(&mut chart, &bars, width, top, color)?;
        legend_entry(&legend, i, color, p.family)?;
    }
    for (g, c) in first.cases(e.pass_ns).iter().enumerate() {
        let (x0, x1) = (g as f64 + 0.05, g as f64 + 0.95);
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(x0, c.at_most), (x1, c.at_most)],
            BLACK.stroke_width(2),
        )))?;
        let (x, y) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        full.draw(&Text::new(
            c.what,
            (x, y + 12),
            ("sans-serif", 13).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Top)),
        ))?;
    }
    full.present()?;
    Ok(())
}

/// A part of the picture.
type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// The chart the plots draw on.
type Chart<'a> = ChartContext<'a, SVGBackend<'a>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// The whole picture (titled, white), its legend's column, and a chart
/// of `groups` groups of bars up to `top`, with a light horizontal grid
/// and the y axis named `y_desc`.
fn canvas<'a>(
    path: &'a Path,
    title: &str,
    groups: usize,
    top: f64,
    y_desc: &str,
) -> Result<(Area<'a>, Area<'a>, Chart<'a>), Box<dyn std::error::Error>> {
    let full = SVGBackend::new(path, (1150, 560)).into_drawing_area();
    full.fill(&WHITE)?;
    let titled = full.titled(title, ("sans-serif", 22))?;
    let (area, legend) = titled.split_horizontally(930);
    let mut chart = ChartBuilder::on(&area)
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..groups as f64, 0f64..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .light_line_style(WHITE)
        .bold_line_style(RGBColor(225, 225, 225))
        .y_desc(y_desc)
        .y_label_formatter(&|v| format!("{v:.1}"))
        .label_style(("sans-serif", 15))
        .draw()?;
    Ok((full, legend, chart))
}

/// Bars at (left edge, height), `width` wide, each labelled with its
/// height.
fn draw_bars(
    chart: &mut Chart<'_>,
    bars: &[(f64, f64)],
    width: f64,
    top: f64,
    color: RGBColor,
) -> Result<(), Box<dyn std::error::Error>> {
    chart.draw_series(
        bars.iter()
            .map(|(x, y)| Rectangle::new([(*x, 0.0), (*x + width * 0.92, *y)], color.filled())),
    )?;
    chart.draw_series(bars.iter().map(|(x, y)| {
        Text::new(
            format!("{y:.2}"),
            (*x + width * 0.46, *y + top * 0.01),
            ("sans-serif", 12).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Bottom)),
        )
    }))?;
    Ok(())
}

/// The legend's `i`th line: a swatch of `color` and `label`.
fn legend_entry(
    legend: &Area<'_>,
    i: usize,
    color: RGBColor,
    label: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let row = 40 + 28 * i as i32;
    legend.draw(&Rectangle::new([(8, row), (24, row + 16)], color.filled()))?;
    legend.draw(&Text::new(
        label,
        (32, row + 8),
        ("sans-serif", 15).into_font().color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center)),
    ))?;
    Ok(())
}
