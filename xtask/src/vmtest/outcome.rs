//! What one kernel's run came to: read from what the guest left in its
//! results directory (the timing file, each binary's libtest log and
//! exit status), and the kernel's line of the summary.

use std::{fmt::Write as _, fs, path::Path, path::PathBuf, time::Duration};

use super::{
    libtest::{self, TestResult},
    watch::{BINARY_TIMEOUT_SECS, Event},
};

/// What one kernel's run came to.
#[derive(Default)]
pub struct Outcome {
    pub name: String,
    pub version: String,
    pub passed: usize,
    pub failed: Vec<String>,
    /// Tests that ran but said they were skipped, with their reason.
    pub skipped: Vec<String>,
    /// How long each test that ended took (`binary::test`, seconds).
    pub seconds: Vec<(String, f64)>,
    /// Everything else that went wrong: no boot, a timeout, a binary that
    /// crashed or never ran.
    pub problems: Vec<String>,
    pub fetch: Duration,
    pub boot: Option<Duration>,
    pub tests: Option<Duration>,
    pub total: Duration,
    pub results: Option<PathBuf>,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.failed.is_empty() && self.problems.is_empty() && self.passed > 0
    }

    /// The kernel's line and what went wrong; `full` includes the console
    /// tails, which the closing summary leaves to the lines printed before.
    pub fn summary(&self, full: bool) -> String {
        let secs = |d: Option<Duration>| {
            d.map_or_else(|| "?".to_owned(), |d| format!("{:.0} s", d.as_secs_f64()))
        };
        let mut text = format!(
            "{} {:<9} {:<24} {} passed, {} failed, {} skipped; fetch {:.0} s, boot {}, tests {}, total {:.0} s",
            if self.ok() { "ok  " } else { "FAIL" },
            self.name,
            self.version,
            self.passed,
            self.failed.len(),
            self.skipped.len(),
            self.fetch.as_secs_f64(),
            secs(self.boot),
            secs(self.tests),
            self.total.as_secs_f64(),
        );
        for test in &self.failed {
            let _ = write!(text, "\n       failed: {test}");
        }
        for test in &self.skipped {
            let _ = write!(text, "\n       skipped: {test}");
        }
        if full && !self.seconds.is_empty() {
            let _ = write!(text, "\n       slowest: {}", slowest(&self.seconds, 5));
        }
        for problem in &self.problems {
            let problem = if full { problem } else { problem.lines().next().unwrap_or_default() };
            let _ = write!(text, "\n       {problem}");
        }
        if let Some(results) = self.results.as_ref().filter(|_| !self.ok()) {
            let _ = write!(text, "\n       logs: {}", results.display());
        }
        text
    }
}

/// Reads what the guest left in `results` into `outcome`.
pub fn collect(results: &Path, tests: &[String], outcome: &mut Outcome) {
    if let Ok(uname) = fs::read_to_string(results.join("uname")) {
        outcome.version = uname.trim().to_owned();
    }
    let timing = fs::read_to_string(results.join("timing")).unwrap_or_default();
    let (mut first_start, mut last_end) = (None, None);
    for line in timing.lines() {
        match Event::parse(line) {
            Some(Event::Boot { at }) => outcome.boot = Some(Duration::from_secs_f64(at)),
            Some(Event::Start { at, .. }) => first_start = first_start.or(Some(at)),
            Some(Event::End { at, .. }) => last_end = Some(at),
            None => {}
        }
    }
    if let (Some(start), Some(end)) = (first_start, last_end) {
        outcome.tests = Some(Duration::from_secs_f64((end - start).max(0.0)));
    }
    if let Ok(modules) = fs::read_to_string(results.join("modules.log")) {
        outcome
            .problems
            .extend(modules.lines().filter(|l| l.contains("failed")).map(str::to_owned));
    }

    if timing.is_empty() {
        // The script never started: the boot's own error says it all.
        return;
    }
    for test in tests {
        let log = fs::read(results.join(format!("{test}.log")))
            .map(|b| String::from_utf8_lossy(&b).into_owned());
        let status = fs::read_to_string(results.join(format!("{test}.status"))).ok();
        let report = libtest::parse(log.as_deref().unwrap_or_default());
        outcome
            .seconds
            .extend(report.seconds.iter().map(|(name, s)| (format!("{test}::{name}"), *s)));
        let mut failed = 0;
        for (name, result) in &report.tests {
            match result {
                TestResult::Ok => outcome.passed += 1,
                TestResult::Skipped(reason) => {
                    outcome.skipped.push(format!("{test}::{name} ({reason})"));
                }
                TestResult::Failed(why) => {
                    failed += 1;
                    // The first panic says what went wrong; the rest is in the log.
                    let why = why.as_deref().map(|why| format!(": {why}")).unwrap_or_default();
                    outcome.failed.push(format!("{test}::{name}{why}"));
                }
                TestResult::Ignored => outcome.skipped.push(format!("{test}::{name} (#[ignore])")),
                TestResult::Unfinished => {
                    outcome.failed.push(format!("{test}::{name} (did not finish)"));
                }
            }
        }
        match status.as_deref().map(str::trim) {
            None => outcome.problems.push(format!("{test}: never finished")),
            Some("0") if report.summary => {}
            Some("0") => {
                outcome.problems.push(format!("{test}: exited 0 without libtest's summary"));
            }
            Some("124" | "137") => {
                outcome.problems.push(format!("{test}: timed out after {BINARY_TIMEOUT_SECS} s"));
            }
            // A failing test already counts; a binary that failed without
            // one (a crash, a panic outside a test) must not pass silently.
            Some(code) if failed == 0 => {
                outcome.problems.push(format!("{test}: exited with {code} without a failing test"));
            }
            Some(_) => {}
        }
    }
}

/// The `n` tests that took longest, slowest first: `name 12 s, …`.
fn slowest(seconds: &[(String, f64)], n: usize) -> String {
    let mut by_time: Vec<&(String, f64)> = seconds.iter().collect();
    by_time.sort_by(|a, b| b.1.total_cmp(&a.1));
    by_time
        .iter()
        .take(n)
        .map(|(name, s)| format!("{name} {s:.0} s"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowest_tests_first() {
        let seconds =
            [("a::x".to_owned(), 2.0), ("b::y".to_owned(), 30.4), ("a::z".to_owned(), 7.0)];
        assert_eq!(slowest(&seconds, 2), "b::y 30 s, a::z 7 s");
        assert_eq!(slowest(&seconds, 5), "b::y 30 s, a::z 7 s, a::x 2 s");
    }
}
