//! Following a guest while it runs: a line per test binary as it ends, so
//! a CI log shows how far a kernel got, and a guest that stops making
//! progress (wedged: its own per-binary timeout would have moved it on)
//! is stopped instead of holding the run until the boot's outer bound.

use std::{
    fs,
    io::Write as _,
    path::Path,
    process::{Child, ExitStatus},
    thread,
    time::{Duration, Instant},
};

/// One test binary inside the guest. Software emulation (no KVM here) is
/// slow, and slower on some hosts than others by half: on one host
/// `external` took 510 s on 5.10 (each case starts a daemon and a
/// topology, some 30 s under emulation) and `election` over 900 s on
/// 6.1 (ten cases of three daemons, some 95 s each). A hanging binary is
/// killed and the others still run; one that passes is never near this.
pub const BINARY_TIMEOUT_SECS: u64 = 1_800;
/// How long the guest may go without a word before it counts as wedged.
#[derive(Clone, Copy)]
pub struct Allowance {
    /// To boot and start its first binary, or to shut down after its last.
    pub boot: Duration,
    /// While a binary runs: its own timeout, its kill, and some slack for
    /// the script's next line.
    pub binary: Duration,
}

impl Allowance {
    pub const GUEST: Self = Self {
        boot: Duration::from_secs(240),
        binary: Duration::from_secs(BINARY_TIMEOUT_SECS + 60),
    };
}
/// How often the timing file is read.
const POLL: Duration = Duration::from_secs(1);
/// How long the guest is given to go once told to stop.
const STOP_WAIT: Duration = Duration::from_secs(20);

/// How a watched guest ended.
pub enum Ended {
    /// vng exited by itself.
    Exited(ExitStatus),
    /// Nothing new appeared in the timing file for `quiet`; the guest was
    /// stopped. `running` is the binary it had started last, if any.
    Wedged { quiet: Duration, running: Option<String> },
}

/// Waits for `child` (the `timeout`-wrapped vng) to end, printing a line
/// per binary the guest finishes (`<results>/timing`, see the guest
/// script) and stopping the guest if it falls silent.
pub fn follow(
    child: &mut Child,
    results: &Path,
    kernel: &str,
    allowance: Allowance,
) -> std::io::Result<Ended> {
    let timing = results.join("timing");
    let mut seen = 0;
    let mut last_word = Instant::now();
    let mut running: Option<(String, f64)> = None;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Ended::Exited(status));
        }
        let text = fs::read_to_string(&timing).unwrap_or_default();
        // Only whole lines: the guest may be writing the last one.
        let lines: Vec<&str> = text.lines().take(text.matches('\n').count()).collect();
        for line in lines.iter().skip(seen) {
            last_word = Instant::now();
            match Event::parse(line) {
                Some(Event::Start { name, at }) => running = Some((name.to_owned(), at)),
                Some(Event::End { name, at }) => {
                    let took =
                        running.take().filter(|(n, _)| n == name).map(|(_, start)| at - start);
                    let status = fs::read_to_string(results.join(format!("{name}.status")))
                        .map(|s| s.trim().to_owned())
                        .unwrap_or_else(|_| "?".to_owned());
                    println!("{}", progress_line(kernel, name, took, &status));
                    let _ = std::io::stdout().flush();
                }
                Some(Event::Boot { .. }) | None => {}
            }
        }
        seen = seen.max(lines.len());
        let quiet_for = if running.is_some() { allowance.binary } else { allowance.boot };
        if last_word.elapsed() > quiet_for {
            stop(child);
            return Ok(Ended::Wedged {
                quiet: last_word.elapsed(),
                running: running.map(|(name, _)| name),
            });
        }
        thread::sleep(POLL);
    }
}

/// Tells `timeout` to end vng (it passes the signal on, and kills what is
/// left 10 s later), then waits a bounded while for it.
fn stop(child: &mut Child) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let until = Instant::now() + STOP_WAIT;
    while Instant::now() < until {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        thread::sleep(POLL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A line of the guest's timing file (written by the guest script), with
/// the guest's uptime in seconds.
#[derive(Debug, PartialEq)]
pub enum Event<'a> {
    Boot { at: f64 },
    Start { name: &'a str, at: f64 },
    End { name: &'a str, at: f64 },
}

impl<'a> Event<'a> {
    /// `boot <uptime>`, `start <name> <uptime>` or `end <name> <uptime>`.
    pub fn parse(line: &'a str) -> Option<Self> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let uptime = |word: &str| word.parse().ok().filter(|s: &f64| s.is_finite() && *s >= 0.0);
        match words.as_slice() {
            ["boot", at] => Some(Self::Boot { at: uptime(at)? }),
            ["start", name, at] => Some(Self::Start { name, at: uptime(at)? }),
            ["end", name, at] => Some(Self::End { name, at: uptime(at)? }),
            _ => None,
        }
    }
}

/// What is printed when a binary ends in the guest.
fn progress_line(kernel: &str, name: &str, took: Option<f64>, status: &str) -> String {
    let took = took.map(|s| format!(" in {s:.0} s")).unwrap_or_default();
    let how = match status {
        "0" => "passed".to_owned(),
        "124" | "137" => format!("killed after {BINARY_TIMEOUT_SECS} s"),
        code => format!("failed (exit {code})"),
    };
    format!("  {kernel}: {name} {how}{took}")
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    /// A stand-in guest: `script` run by sh in a fresh results directory
    /// of its own (`test`: the test's name).
    fn guest(test: &str, script: &str) -> (Child, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("xtask-watch-{}-{test}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let child = Command::new("sh").arg("-c").arg(script).current_dir(&dir).spawn().unwrap();
        (child, dir)
    }

    const QUICK: Allowance =
        Allowance { boot: Duration::from_secs(3), binary: Duration::from_secs(2) };

    #[test]
    fn a_guest_that_finishes_is_followed_to_its_end() {
        let (mut child, dir) = guest(
            "finishes",
            "echo 'boot 0.5' > timing; echo 'start udp 1' >> timing; echo 0 > udp.status; \
             echo 'end udp 2' >> timing; exit 3",
        );
        let ended = follow(&mut child, &dir, "test", QUICK).unwrap();
        assert!(matches!(ended, Ended::Exited(status) if status.code() == Some(3)));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_guest_silent_past_its_binary_allowance_is_stopped() {
        let started = Instant::now();
        let (mut child, dir) = guest(
            "silent",
            "echo 'boot 0.5' > timing; echo 'start election 1' >> timing; exec sleep 60",
        );
        let ended = follow(&mut child, &dir, "test", QUICK).unwrap();
        let Ended::Wedged { quiet, running } = ended else { panic!("not stopped") };
        assert_eq!(running.as_deref(), Some("election"));
        assert!(quiet > QUICK.binary);
        assert!(started.elapsed() < Duration::from_secs(30), "stopped, not waited out");
        assert!(child.try_wait().unwrap().is_some(), "the guest is gone");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn timing_lines() {
        assert_eq!(
            Event::parse("start udp 525.85"),
            Some(Event::Start { name: "udp", at: 525.85 })
        );
        assert_eq!(Event::parse("end udp 568.89"), Some(Event::End { name: "udp", at: 568.89 }));
        assert_eq!(Event::parse("boot 3.2"), Some(Event::Boot { at: 3.2 }));
        assert_eq!(Event::parse("boot -1"), None);
        assert_eq!(Event::parse("end udp"), None);
        assert_eq!(Event::parse("end udp 5x"), None);
        assert_eq!(
            progress_line("bullseye", "udp", Some(43.04), "0"),
            "  bullseye: udp passed in 43 s"
        );
        assert_eq!(
            progress_line("trixie", "election", None, "124"),
            format!("  trixie: election killed after {BINARY_TIMEOUT_SECS} s")
        );
        assert_eq!(
            progress_line("trixie", "udp", Some(1.0), "101"),
            "  trixie: udp failed (exit 101) in 1 s"
        );
    }
}
