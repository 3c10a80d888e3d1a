//! Reading a test binary's libtest output (run with `--nocapture
//! --test-threads=1`, and `--report-time` if it may) into one result per
//! test, with the first panic of a failed test, the reason a skipped test
//! gave and how long each took.

use std::{collections::BTreeMap, fmt::Write as _};

#[derive(Debug, PartialEq)]
pub enum TestResult {
    Ok,
    /// With the first panic's location and message, if it printed one.
    Failed(Option<String>),
    Ignored,
    /// Passed, but printed `SKIPPED: <reason>`: the harness's way of saying
    /// the kernel lacks what the test needs.
    Skipped(String),
    /// Started but never reported (the binary was killed or crashed).
    Unfinished,
}

#[derive(Debug, Default)]
pub struct Report {
    /// Every test that started, by name.
    pub tests: BTreeMap<String, TestResult>,
    /// Whether libtest printed its `test result:` line.
    pub summary: bool,
    /// Seconds each test that ended took, as `--report-time` said
    /// (`ok <12.345s>`).
    pub seconds: BTreeMap<String, f64>,
}

/// The test whose output [`parse`] is reading.
struct Running {
    name: String,
    /// From a `SKIPPED: <reason>` line.
    skip: Option<String>,
    /// `panicked at <location>: <message>`, from the first panic.
    panic: Option<String>,
    /// The panic's location was read; its message is the next line.
    panic_message_next: bool,
}

/// Reads libtest's `--nocapture --test-threads=1` output: `test NAME ... `
/// starts a test, its own output may follow (also on the same line), and
/// a line ending in `ok`/`FAILED`/`ignored` ends it.
pub fn parse(log: &str) -> Report {
    let mut report = Report::default();
    let mut current: Option<Running> = None;
    for line in log.lines() {
        if line.starts_with("test result: ") {
            report.summary = true;
            continue;
        }
        let rest = match line.strip_prefix("test ").and_then(|rest| rest.split_once(" ... ")) {
            Some((name, rest)) if !name.contains(' ') => {
                if let Some(running) = current.take() {
                    report.tests.insert(running.name, TestResult::Unfinished);
                }
                current = Some(Running {
                    name: name.to_owned(),
                    skip: None,
                    panic: None,
                    panic_message_next: false,
                });
                rest
            }
            _ => line,
        };
        let Some(running) = current.as_mut() else { continue };
        if std::mem::take(&mut running.panic_message_next)
            && let Some(panic) = running.panic.as_mut()
        {
            let _ = write!(panic, " {}", rest.trim());
            continue;
        }
        if let Some(reason) = rest.trim().strip_prefix("SKIPPED:") {
            running.skip.get_or_insert_with(|| reason.trim().to_owned());
        }
        // thread 'NAME' (ID) panicked at tests/tests/datapath.rs:76:9:
        if running.panic.is_none()
            && rest.starts_with("thread '")
            && let Some((_, location)) = rest.split_once(" panicked at ")
        {
            running.panic = Some(format!("panicked at {location}"));
            running.panic_message_next = true;
            continue;
        }
        let (verdict, seconds) = split_time(rest.trim());
        if let Some(seconds) = seconds
            && matches!(verdict, "ok" | "FAILED")
        {
            report.seconds.insert(running.name.clone(), seconds);
        }
        let result = match verdict {
            "ok" => Some(true),
            "FAILED" => Some(false),
            r if r == "ignored" || r.starts_with("ignored, ") => {
                if let Some(running) = current.take() {
                    report.tests.insert(running.name, TestResult::Ignored);
                }
                continue;
            }
            _ => None,
        };
        if let Some(passed) = result
            && let Some(running) = current.take()
        {
            let result = match (passed, running.skip) {
                (true, Some(reason)) => TestResult::Skipped(reason),
                (true, None) => TestResult::Ok,
                (false, _) => TestResult::Failed(running.panic),
            };
            report.tests.insert(running.name, result);
        }
    }
    if let Some(running) = current {
        report.tests.insert(running.name, TestResult::Unfinished);
    }
    report
}

/// `ok <12.345s>` into `ok` and 12.345; anything else as it is.
fn split_time(line: &str) -> (&str, Option<f64>) {
    let Some((verdict, time)) = line.split_once(" <") else { return (line, None) };
    match time.strip_suffix("s>").and_then(|t| t.parse::<f64>().ok()) {
        Some(seconds) if seconds.is_finite() && seconds >= 0.0 => (verdict, Some(seconds)),
        _ => (line, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_result() {
        let log = "\nrunning 5 tests\n\
                   test a ... ok\n\
                   test b ... storm total=3\nok\n\
                   test c ... \nthread 'c' panicked at x.rs:1:1:\nboom\nFAILED\n\
                   test d ... SKIPPED: this test needs sock_destroy, which this kernel lacks\nok\n\
                   test e ... ignored\n\
                   \nfailures:\n    c\n\ntest result: FAILED. 3 passed; 1 failed; 1 ignored; 0 measured; 0 filtered out; finished in 1.00s\n";
        let report = parse(log);
        assert!(report.summary);
        assert_eq!(report.tests.len(), 5);
        assert_eq!(report.tests["a"], TestResult::Ok);
        assert_eq!(report.tests["b"], TestResult::Ok);
        assert_eq!(
            report.tests["c"],
            TestResult::Failed(Some("panicked at x.rs:1:1: boom".into()))
        );
        assert_eq!(
            report.tests["d"],
            TestResult::Skipped("this test needs sock_destroy, which this kernel lacks".into())
        );
        assert_eq!(report.tests["e"], TestResult::Ignored);
    }

    /// Output as a test binary of `lb-tests` prints it: module paths in the
    /// names, the harness's own lines, a thread id in the panic line, the
    /// failure summary repeating the panic (which must not be taken for a
    /// test's output), and an ignore reason.
    #[test]
    fn an_integration_test_binary() {
        let log = r#"
running 4 tests
test failover::connects_move_at_once ... daemon ready in 0.4s
ok
test failover::fail_back ... daemon ready in 0.5s
thread 'failover::fail_back' (2211) panicked at tests/tests/datapath.rs:76:9:
assertion `left == right` failed: connect landed on backend-2
  left: "backend-2"
 right: "backend-1"
note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace
FAILED
test needs::sock_destroy ... SKIPPED: closing connections needs CONFIG_INET_DIAG_DESTROY
SKIPPED: a second line is not a second reason
ok
test slow::soak ... ignored, takes ten minutes

failures:

---- failover::fail_back stdout ----

thread 'failover::fail_back' (2211) panicked at tests/tests/datapath.rs:76:9:
assertion `left == right` failed: connect landed on backend-2

failures:
    failover::fail_back

test result: FAILED. 2 passed; 1 failed; 1 ignored; 0 measured; 0 filtered out; finished in 12.31s

"#;
        let report = parse(log);
        assert!(report.summary);
        assert_eq!(report.tests.len(), 4);
        assert_eq!(report.tests["failover::connects_move_at_once"], TestResult::Ok);
        assert_eq!(
            report.tests["failover::fail_back"],
            TestResult::Failed(Some(
                "panicked at tests/tests/datapath.rs:76:9: assertion `left == right` failed: connect landed on backend-2".into()
            ))
        );
        assert_eq!(
            report.tests["needs::sock_destroy"],
            TestResult::Skipped("closing connections needs CONFIG_INET_DIAG_DESTROY".into())
        );
        assert_eq!(report.tests["slow::soak"], TestResult::Ignored);
    }

    /// `--report-time`'s times, after the verdict on the same line.
    #[test]
    fn the_time_each_test_took() {
        let report = parse(
            "test a ... ok <1.250s>\ntest b ... out\nFAILED <0.010s>\ntest c ... ok <later>\n",
        );
        assert_eq!(report.tests["a"], TestResult::Ok);
        assert_eq!(report.tests["b"], TestResult::Failed(None));
        assert_eq!(report.seconds["a"], 1.25);
        assert_eq!(report.seconds["b"], 0.01);
        assert_eq!(report.tests["c"], TestResult::Unfinished, "not a verdict");
        assert!(!report.seconds.contains_key("c"));
    }

    #[test]
    fn a_binary_killed_mid_test() {
        let report = parse("running 3 tests\ntest a ... ok\ntest b ... some output");
        assert!(!report.summary);
        assert_eq!(report.tests["a"], TestResult::Ok);
        assert_eq!(report.tests["b"], TestResult::Unfinished);
        assert!(!report.tests.contains_key("c"), "a test that never started is not reported");
    }

    /// A test that started while another one never reported (a test that
    /// aborted the process would end the log; this is the defensive case).
    #[test]
    fn a_test_that_never_reported_before_the_next() {
        let report = parse("test a ... \ntest b ... ok\n");
        assert_eq!(report.tests["a"], TestResult::Unfinished);
        assert_eq!(report.tests["b"], TestResult::Ok);
    }

    #[test]
    fn a_failure_without_a_panic_line() {
        let report = parse("test a ... FAILED\n\ntest result: FAILED. 0 passed; 1 failed\n");
        assert_eq!(report.tests["a"], TestResult::Failed(None));
    }

    #[test]
    fn no_tests_at_all() {
        let report = parse(
            "\nrunning 0 tests\n\ntest result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out\n",
        );
        assert!(report.summary);
        assert!(report.tests.is_empty());
    }
}
