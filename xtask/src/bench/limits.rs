//! The run's limits: Ctrl-C and the time limit, checked by every loop of
//! the bench ([`check_stop`]), and commands and polls bounded in time.

use std::{
    io::Read as _,
    process::{Command, Output, Stdio},
    sync::{
        OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

pub static STOP: AtomicBool = AtomicBool::new(false);
/// When the run started (after the build), and its time limit.
pub static STARTED: OnceLock<(Instant, Duration)> = OnceLock::new();

/// Fails once Ctrl-C was pressed or the run's time limit passed; every
/// loop of the bench calls it, so the guards clean up promptly.
pub fn check_stop() -> anyhow::Result<()> {
    if STOP.load(Ordering::Relaxed) {
        bail!("interrupted");
    }
    if let Some((started, limit)) = STARTED.get()
        && started.elapsed() > *limit
    {
        bail!("the bench ran past its time limit of {} s", limit.as_secs());
    }
    Ok(())
}

/// Runs `cmd` to its end, at most `limit` (then it is killed), and returns
/// its output. Stops early, killing it, on Ctrl-C.
pub fn output_within(cmd: &mut Command, limit: Duration) -> anyhow::Result<Output> {
    let what = crate::cmd::describe(cmd);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_reader = thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stdout.read_to_end(&mut buf);
        buf
    });
    let err_reader = thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stderr.read_to_end(&mut buf);
        buf
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline || STOP.load(Ordering::Relaxed) {
            let _ = child.kill();
            let _ = child.wait();
            check_stop()?;
            bail!("{what} did not finish within {} s (killed)", limit.as_secs());
        }
        thread::sleep(Duration::from_millis(5));
    };
    Ok(Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    })
}

/// Polls `check` every `every` until it holds (`Ok(true)`) or `limit`
/// passes (`Ok(false)`); stops on Ctrl-C.
pub fn poll(
    limit: Duration,
    every: Duration,
    mut check: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<bool> {
    let deadline = Instant::now() + limit;
    loop {
        if check()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        check_stop()?;
        thread::sleep(every);
    }
}
