//! The plot of the paths part: `target/bench/ratios.svg`, each route's
//! throughput as a ratio to direct, per workload.

use std::path::Path;

use plotters::{
    prelude::*,
    style::text_anchor::{HPos, Pos, VPos},
};

use super::{
    paths::Route,
    results::{Results, Workload},
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
    let full = SVGBackend::new(path, (1150, 560)).into_drawing_area();
    full.fill(&WHITE)?;
    let titled = full.titled(
        "lb bench: throughput × direct, per path and workload (higher is better)",
        ("sans-serif", 22),
    )?;
    let (area, legend) = titled.split_horizontally(930);
    let mut chart = ChartBuilder::on(&area)
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..workloads.len() as f64, 0f64..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .light_line_style(WHITE)
        .bold_line_style(RGBColor(225, 225, 225))
        .y_desc("× direct")
        .y_label_formatter(&|v| format!("{v:.1}"))
        .label_style(("sans-serif", 15))
        .draw()?;
    let width = 0.8 / Route::ALL.len() as f64;
    for (i, route) in Route::ALL.iter().enumerate() {
        let color = COLORS[i];
        let bars: Vec<(f64, f64)> = workloads
            .iter()
            .enumerate()
            .filter_map(|(g, w)| Some((g as f64 + 0.1 + i as f64 * width, r.ratio(*w, *route)?)))
            .collect();
        chart
            .draw_series(bars.iter().map(|(x, y)| {
                Rectangle::new([(*x, 0.0), (*x + width * 0.92, *y)], color.filled())
            }))?;
        chart.draw_series(bars.iter().map(|(x, y)| {
            Text::new(
                format!("{y:.2}"),
                (*x + width * 0.46, *y + top * 0.01),
                ("sans-serif", 12)
                    .into_font()
                    .color(&BLACK)
                    .pos(Pos::new(HPos::Center, VPos::Bottom)),
            )
        }))?;
        let row = 40 + 28 * i as i32;
        legend.draw(&Rectangle::new([(8, row), (24, row + 16)], color.filled()))?;
        legend.draw(&Text::new(
            route.label(),
            (32, row + 8),
            ("sans-serif", 15).into_font().color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
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
