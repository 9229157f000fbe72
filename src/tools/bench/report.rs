//! What one scenario measured, its table rows and its JSON line, and the progress display.
//! Invariant: a result says how many of its jobs were done next to how many it asked for, so a
//! rate is never shown without the work behind it.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use super::stats::Summary;

/// One measured run: `n` asked for, `done` finished as asked, in `secs`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Run {
    pub label: String,
    pub n: u64,
    pub done: u64,
    pub secs: f64,
    pub rate: f64,
    pub unit: &'static str,
    /// Busy CPU of the whole machine per item done, in milliseconds (all cores together).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_ms: Option<f64>,
}

impl Run {
    pub fn new(label: impl Into<String>, n: u64, done: u64, secs: f64, unit: &'static str) -> Run {
        Run {
            label: label.into(),
            n,
            done,
            secs,
            rate: if secs > 0.0 { done as f64 / secs } else { 0.0 },
            unit,
            cpu_ms: None,
        }
    }

    /// This run with the machine's busy CPU-seconds over it, spread over the items done.
    pub fn with_cpu(mut self, busy_secs: Option<f64>) -> Run {
        self.cpu_ms = busy_secs
            .filter(|_| self.done > 0)
            .map(|b| b * 1000.0 / self.done as f64);
        self
    }
}

/// The result of one scenario: its main run, any runs beside it, ratios and latencies.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub scenario: &'static str,
    pub n: u64,
    pub done: u64,
    pub secs: f64,
    pub rate: f64,
    pub unit: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_ms: Option<f64>,
    /// `rate / against`, when the scenario has a reference measured in the same run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_to: Option<String>,
    /// The highest `ratio` the machine's cores allow, from CPU measured in the same run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_ceiling: Option<f64>,
    /// The least CPU per item the scenario's work could take: the sum of its parts, each
    /// measured alone in the same run (the relay: its statements and the raw publishes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub floor_cpu_ms: Option<f64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub runs: Vec<Run>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to_claim_ms: Option<Summary>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to_done_ms: Option<Summary>,
    /// Settings that shaped the number (in flight, pool size, batch, …).
    pub settings: serde_json::Value,
    /// Why the scenario did not run, when it could not here (the peer without Python).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// The most items per second the machine's cores allow for work that needs each of `parts`
/// (busy CPU milliseconds per item, measured in this run) done once per item: every core busy
/// all the time, and no part any cheaper than when it ran on its own.
pub fn cpu_ceiling(parts: &[Option<f64>]) -> Option<f64> {
    let cores = std::thread::available_parallelism().ok()?.get() as f64;
    let per_item_ms: f64 = parts.iter().copied().sum::<Option<f64>>()?;
    (per_item_ms > 0.0).then(|| cores * 1000.0 / per_item_ms)
}

impl Report {
    /// A report whose totals are the sum of `runs` (their `n`, `done` and `secs`).
    pub fn of_runs(
        scenario: &'static str,
        unit: &'static str,
        runs: Vec<Run>,
        settings: serde_json::Value,
    ) -> Report {
        let n = runs.iter().map(|r| r.n).sum();
        let done = runs.iter().map(|r| r.done).sum();
        let secs = runs.iter().map(|r| r.secs).sum();
        let main = Run::new(scenario, n, done, secs, unit);
        Report {
            scenario,
            n,
            done,
            secs,
            rate: main.rate,
            unit,
            runs,
            settings,
            ..Report::default()
        }
    }

    pub fn single(scenario: &'static str, run: Run, settings: serde_json::Value) -> Report {
        Report {
            scenario,
            n: run.n,
            done: run.done,
            secs: run.secs,
            rate: run.rate,
            unit: run.unit,
            cpu_ms: run.cpu_ms,
            settings,
            ..Report::default()
        }
    }

    /// A scenario that could not run on this machine, and why; it did none of its `n`.
    pub fn skipped(scenario: &'static str, n: u64, why: String) -> Report {
        Report {
            scenario,
            n,
            unit: "",
            skipped: Some(why),
            settings: serde_json::Value::Null,
            ..Report::default()
        }
    }

    /// Compares this report's rate with `base`, a rate measured in the same run and named `to`;
    /// nothing is compared against a base that measured nothing.
    pub fn against(&mut self, base: f64, to: &str) {
        if base > 0.0 {
            self.ratio = Some(self.rate / base);
            self.ratio_to = Some(to.into());
        }
    }

    /// Table rows: the scenario, then one indented row per extra run.
    pub fn rows(&self) -> Vec<[String; 7]> {
        let ratio = match (&self.ratio, &self.ratio_to, &self.ratio_ceiling) {
            (Some(r), Some(to), Some(c)) => format!("{r:.2} × {to} (cores allow ≤ {c:.2})"),
            (Some(r), Some(to), None) => format!("{r:.2} × {to}"),
            (None, Some(to), Some(c)) => format!("any engine ≤ {c:.2} × {to}"),
            _ => String::new(),
        };
        let cpu = |ms: Option<f64>| ms.map(|ms| format!("{ms:.3} ms")).unwrap_or_default();
        let mut rows = vec![[
            self.scenario.to_owned(),
            format!("{}/{}", self.done, self.n),
            format!("{:.2}", self.secs),
            format!("{:.0} {}", self.rate, self.unit),
            cpu(self.cpu_ms),
            ratio,
            self.latency_note(),
        ]];
        for r in &self.runs {
            rows.push([
                format!("  {}", r.label),
                format!("{}/{}", r.done, r.n),
                format!("{:.2}", r.secs),
                format!("{:.0} {}", r.rate, r.unit),
                cpu(r.cpu_ms),
                String::new(),
                String::new(),
            ]);
        }
        rows
    }

    fn latency_note(&self) -> String {
        if let Some(why) = &self.skipped {
            return why.clone();
        }
        let mut parts = Vec::new();
        if let Some(c) = self.to_claim_ms {
            parts.push(format!(
                "to claim p50 {:.1} / p99 {:.1} / max {:.1} ms",
                c.p50, c.p99, c.max
            ));
        }
        if let Some(d) = self.to_done_ms {
            parts.push(format!(
                "to done p50 {:.1} / p99 {:.1} / max {:.1} ms",
                d.p50, d.p99, d.max
            ));
        }
        parts.join("; ")
    }
}

pub const HEADER: [&str; 7] = [
    "scenario",
    "done/asked",
    "secs",
    "rate",
    "CPU per item",
    "ratio",
    "latency",
];

/// Renders rows under [`HEADER`] as a Markdown table, columns padded to line up.
pub fn table(rows: &[[String; 7]]) -> String {
    let mut width = HEADER.map(|h| h.chars().count());
    for r in rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: [&str; 7]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(width)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        format!("| {} |\n", padded.join(" | "))
    };
    let mut out = line(HEADER);
    out.push_str(&line(width.map(|_| "")).replace(' ', "-"));
    for r in rows {
        out.push_str(&line([&r[0], &r[1], &r[2], &r[3], &r[4], &r[5], &r[6]]));
    }
    out
}

/// Progress of one phase: a bar when stdout is a terminal, otherwise a line on stderr when the
/// phase starts and one when it ends.
pub struct Progress {
    bar: Option<ProgressBar>,
    label: String,
    started: Instant,
}

impl Progress {
    pub fn new(label: impl Into<String>, len: u64, interactive: bool) -> Progress {
        let label = label.into();
        let bar = (interactive && std::io::stdout().is_terminal()).then(|| {
            let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stdout());
            bar.set_style(
                ProgressStyle::with_template(
                    "{msg:<22} [{bar:30}] {pos}/{len} {per_sec} ({elapsed})",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.set_message(label.clone());
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        if bar.is_none() {
            eprintln!("bench: {label}: {len} …");
        }
        Progress {
            bar,
            label,
            started: Instant::now(),
        }
    }

    pub fn set(&self, pos: u64) {
        if let Some(b) = &self.bar {
            b.set_position(pos);
        }
    }

    pub fn finish(&self, done: u64) {
        match &self.bar {
            Some(b) => b.finish_and_clear(),
            None => eprintln!(
                "bench: {}: {done} done in {:.2}s",
                self.label,
                self.started.elapsed().as_secs_f64()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_is_done_over_seconds_and_zero_without_time() {
        assert_eq!(Run::new("x", 10, 10, 2.0, "jobs/s").rate, 5.0);
        assert_eq!(Run::new("x", 10, 4, 2.0, "jobs/s").rate, 2.0);
        assert_eq!(Run::new("x", 10, 10, 0.0, "jobs/s").rate, 0.0);
    }

    #[test]
    fn table_lines_up_and_shows_done_of_asked() {
        let mut r = Report::single(
            "engine",
            Run::new("engine", 100, 100, 2.0, "jobs/s"),
            serde_json::json!({}),
        );
        r.ratio = Some(0.5);
        r.ratio_to = Some("limit".into());
        let t = table(&r.rows());
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[1].starts_with("|--") || lines[1].starts_with("| -"));
        assert!(lines[2].contains("100/100") && lines[2].contains("50 jobs/s"));
        assert!(lines[2].contains("0.50 × limit"));
        let widths: Vec<usize> = lines.iter().map(|l| l.chars().count()).collect();
        assert!(widths.iter().all(|w| *w == widths[0]), "{t}");
    }

    #[test]
    fn cpu_per_item_and_the_ceiling_show_when_measured() {
        let run = Run::new("relay", 200, 200, 2.0, "rows/s").with_cpu(Some(0.1));
        assert_eq!(run.cpu_ms, Some(0.5), "0.1 CPU-seconds over 200 rows");
        assert_eq!(
            Run::new("x", 10, 0, 1.0, "rows/s")
                .with_cpu(Some(0.1))
                .cpu_ms,
            None,
            "nothing done, nothing to spread the CPU over"
        );
        let mut r = Report::single("relay", run, serde_json::json!({}));
        r.ratio = Some(0.48);
        r.ratio_to = Some("raw".into());
        r.ratio_ceiling = Some(0.5);
        let t = table(&r.rows());
        assert!(t.contains("CPU per item") && t.contains("0.500 ms"), "{t}");
        assert!(t.contains("0.48 × raw (cores allow ≤ 0.50)"), "{t}");
    }

    #[test]
    fn the_cpu_ceiling_spreads_the_parts_over_every_core() {
        let cores = std::thread::available_parallelism().unwrap().get() as f64;
        // 0.5 ms + 1.5 ms of CPU per item: each core does 500 items a second.
        assert_eq!(cpu_ceiling(&[Some(0.5), Some(1.5)]), Some(cores * 500.0));
        assert_eq!(cpu_ceiling(&[Some(0.5), None]), None, "a part not measured");
        assert_eq!(cpu_ceiling(&[Some(0.0)]), None, "no CPU measured");
    }

    #[test]
    fn a_ratio_needs_a_base_that_measured_something() {
        let mut r = Report::single(
            "engine",
            Run::new("engine", 100, 100, 2.0, "jobs/s"),
            serde_json::json!({}),
        );
        r.against(0.0, "limit");
        assert_eq!((r.ratio, r.ratio_to.as_deref()), (None, None));
        r.against(200.0, "limit");
        assert_eq!(
            (r.ratio, r.ratio_to.as_deref()),
            (Some(0.25), Some("limit"))
        );
    }

    #[test]
    fn totals_of_runs_add_up() {
        let r = Report::of_runs(
            "kinds",
            "jobs/s",
            vec![
                Run::new("compile", 10, 10, 1.0, "jobs/s"),
                Run::new("research", 10, 9, 3.0, "jobs/s"),
            ],
            serde_json::json!({}),
        );
        assert_eq!((r.n, r.done, r.secs), (20, 19, 4.0));
        assert!((r.rate - 19.0 / 4.0).abs() < 1e-9);
        assert_eq!(r.rows().len(), 3);
    }
}
