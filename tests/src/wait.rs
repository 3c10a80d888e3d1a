//! Time: polling until a condition holds, and the monotonic clock that
//! other processes of a test report in.

use std::{
    thread,
    time::{Duration, Instant},
};

/// Polls `check` every 20 ms until it holds or `timeout` passes.
pub fn wait_until(timeout: Duration, check: impl FnMut() -> bool) -> bool {
    wait_every(Duration::from_millis(20), timeout, check)
}

/// Polls `check` every `every` until it holds or `timeout` passes (a
/// check that costs the system under test something, less often).
pub fn wait_every(every: Duration, timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(every);
    }
}

/// CLOCK_MONOTONIC in nanoseconds: comparable across processes (the
/// storm client reports in it).
pub fn monotonic_ns() -> u64 {
    // SAFETY: clock_gettime fills the struct we pass.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid clock id and out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
