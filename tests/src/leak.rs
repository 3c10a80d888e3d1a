//! How a guard reports what it found left behind after its cleanup.

use std::thread;

/// Reports what a guard found left behind *after* it did all the cleanup it
/// could: a panic that fails the test, naming the leak; or, if the thread is
/// already panicking (the test failed, the guard runs while unwinding), a
/// printed line, since a panic during a panic aborts the whole test binary
/// and hides the test's own failure.
#[track_caller]
pub(crate) fn leaked(guard: &str, problems: &[String]) {
    if problems.is_empty() {
        return;
    }
    let what = problems.join("; ");
    if thread::panicking() {
        eprintln!("LEAK ({guard}, while the test was already failing): {what}");
    } else {
        panic!("LEAK ({guard}): {what}");
    }
}
