//! Line charts as SVG files, so that a person can look at the bench's curves rather than read
//! them: one chart per plot, a line and markers per series, the data's own x values as ticks.

use std::fmt::Write as _;

pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

pub struct Chart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub log_x: bool,
    pub log_y: bool,
    pub series: Vec<Series>,
}

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 440.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const COLOURS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];

impl Chart<'_> {
    pub fn render(&self) -> String {
        let points: Vec<(f64, f64)> = self.series.iter().flat_map(|s| s.points.iter().copied()).filter(|&(x, y)| self.usable(x, y)).collect();
        let mut svg = String::new();
        let _ = writeln!(svg, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#);
        let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(svg, r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#, WIDTH / 2.0, escape(self.title));
        if points.is_empty() {
            let _ = writeln!(svg, r#"<text x="{}" y="{}" text-anchor="middle">no data</text></svg>"#, WIDTH / 2.0, HEIGHT / 2.0);
            return svg;
        }
        let xs = Axis::new(points.iter().map(|p| p.0), self.log_x, false);
        let ys = Axis::new(points.iter().map(|p| p.1), self.log_y, true);
        let (x0, x1, y0, y1) = (LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP);
        let px = |x: f64| x0 + (x1 - x0) * xs.frac(x);
        let py = |y: f64| y0 + (y1 - y0) * ys.frac(y);

        // Frame, grid and ticks: x at the data's distinct values (few per plot), y at round values.
        let _ = writeln!(svg, r##"<rect x="{x0}" y="{y1}" width="{}" height="{}" fill="none" stroke="#444"/>"##, x1 - x0, y0 - y1);
        let mut x_ticks: Vec<f64> = points.iter().map(|p| p.0).collect();
        x_ticks.sort_by(f64::total_cmp);
        x_ticks.dedup();
        for &x in &x_ticks {
            let _ = writeln!(svg, r##"<line x1="{0:.1}" y1="{y0}" x2="{0:.1}" y2="{y1}" stroke="#ddd"/><text x="{0:.1}" y="{1}" text-anchor="middle">{2}</text>"##, px(x), y0 + 16.0, number(x));
        }
        for y in ys.ticks() {
            let _ = writeln!(svg, r##"<line x1="{x0}" y1="{0:.1}" x2="{x1}" y2="{0:.1}" stroke="#eee"/><text x="{1}" y="{2:.1}" text-anchor="end">{3}</text>"##, py(y), x0 - 6.0, py(y) + 4.0, number(y));
        }
        let _ = writeln!(svg, r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#, (x0 + x1) / 2.0, HEIGHT - 18.0, escape(self.x_label));
        let _ = writeln!(svg, r#"<text x="18" y="{0}" text-anchor="middle" transform="rotate(-90 18 {0})">{1}</text>"#, (y0 + y1) / 2.0, escape(self.y_label));

        for (i, s) in self.series.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            let pts: Vec<(f64, f64)> = s.points.iter().copied().filter(|&(x, y)| self.usable(x, y)).map(|(x, y)| (px(x), py(y))).collect();
            let path: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let _ = writeln!(svg, r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#, path.join(" "));
            for (x, y) in &pts {
                let _ = writeln!(svg, r#"<circle cx="{x:.1}" cy="{y:.1}" r="3.5" fill="{colour}"/>"#);
            }
            let ly = TOP + 10.0 + 20.0 * i as f64;
            let _ = writeln!(svg, r#"<line x1="{0}" y1="{ly}" x2="{1}" y2="{ly}" stroke="{colour}" stroke-width="3"/><text x="{2}" y="{3}">{4}</text>"#, x1 + 12.0, x1 + 32.0, x1 + 38.0, ly + 4.0, escape(&s.name));
        }
        svg.push_str("</svg>\n");
        svg
    }

    /// Points a log axis cannot show (zero or below) and non-finite values are left out.
    fn usable(&self, x: f64, y: f64) -> bool {
        x.is_finite() && y.is_finite() && (!self.log_x || x > 0.0) && (!self.log_y || y > 0.0)
    }
}

/// One axis: its range and scale.
struct Axis {
    lo: f64,
    hi: f64,
    log: bool,
}

impl Axis {
    /// A linear value axis starts at zero (`from_zero`) so that heights compare.
    fn new(values: impl Iterator<Item = f64>, log: bool, from_zero: bool) -> Axis {
        let (mut lo, mut hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
        if log {
            lo = 10f64.powf(lo.log10().floor());
            hi = 10f64.powf(hi.log10().ceil());
            if hi <= lo {
                hi = lo * 10.0;
            }
        } else {
            if from_zero {
                lo = lo.min(0.0);
            }
            let step = nice_step((hi - lo).max(f64::MIN_POSITIVE));
            hi = (hi / step).ceil() * step;
            if hi <= lo {
                hi = lo + 1.0;
            }
        }
        Axis { lo, hi, log }
    }

    fn frac(&self, v: f64) -> f64 {
        if self.log {
            (v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        }
    }

    fn ticks(&self) -> Vec<f64> {
        if self.log {
            let mut t = Vec::new();
            let mut v = self.lo;
            while v <= self.hi * 1.0001 {
                t.push(v);
                v *= 10.0;
            }
            t
        } else {
            let step = nice_step(self.hi - self.lo);
            (0..=((self.hi - self.lo) / step).round() as usize).map(|i| self.lo + step * i as f64).collect()
        }
    }
}

/// A round step (1, 2 or 5 times a power of ten) giving about five intervals over `span`.
fn nice_step(span: f64) -> f64 {
    let raw = span / 5.0;
    let power = 10f64.powf(raw.log10().floor());
    let m = raw / power;
    power * if m <= 1.0 { 1.0 } else if m <= 2.0 { 2.0 } else if m <= 5.0 { 5.0 } else { 10.0 }
}

fn number(v: f64) -> String {
    if v != 0.0 && (v.abs() < 0.01 || v.abs() >= 1e6) {
        format!("{v:.0e}")
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else if v.abs() < 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.1}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_places_its_points_inside_the_frame_and_names_its_series() {
        let chart = Chart {
            title: "prefill <tok/s>",
            x_label: "prompt tokens",
            y_label: "tok/s",
            log_x: true,
            log_y: false,
            series: vec![
                Series { name: "prefill engine".into(), points: vec![(8.0, 10.0), (2048.0, 50.0)] },
                Series { name: "decode engine".into(), points: vec![(8.0, 12.0), (2048.0, f64::NAN)] },
            ],
        };
        let svg = chart.render();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("prefill &lt;tok/s&gt;") && svg.contains("decode engine"));
        // Three usable points, three markers; the NaN is left out.
        assert_eq!(svg.matches("<circle").count(), 3);
        for c in svg.split("<circle").skip(1) {
            let cx: f64 = c.split("cx=\"").nth(1).unwrap().split('"').next().unwrap().parse().unwrap();
            let cy: f64 = c.split("cy=\"").nth(1).unwrap().split('"').next().unwrap().parse().unwrap();
            assert!((LEFT..=WIDTH - RIGHT).contains(&cx) && (TOP..=HEIGHT - BOTTOM).contains(&cy), "({cx}, {cy})");
        }
        // The x ticks are the data's own values.
        assert!(svg.contains(">8</text>") && svg.contains(">2048</text>"));
    }

    #[test]
    fn log_axes_tick_at_powers_of_ten_and_linear_ones_at_round_steps() {
        let a = Axis::new([0.6, 10_040.0].into_iter(), true, true);
        assert_eq!(a.ticks(), vec![0.1, 1.0, 10.0, 100.0, 1000.0, 10_000.0, 100_000.0]);
        let l = Axis::new([3.0, 47.0].into_iter(), false, true);
        assert_eq!(l.ticks(), vec![0.0, 10.0, 20.0, 30.0, 40.0, 50.0]);
    }
}
