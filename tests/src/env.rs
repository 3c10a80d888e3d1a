//! The environment of a test run: whether it may run at all (root), the
//! binaries under test, and the address plan.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
};

/// Whether privileged tests can run here. Without root they are skipped with
/// a printed reason, except under `CI=true`, where that is a failure.
pub fn privileged() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("privileged integration tests need root, and CI=true forbids skipping them");
    }
    eprintln!(
        "SKIPPED: this test needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN); run `cargo xtask test` as root"
    );
    false
}

/// Whether the running kernel is Linux `major.minor` or later.
pub fn kernel_at_least(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut numbers = release.split(|c: char| !c.is_ascii_digit()).map(|n| n.parse::<u32>().ok());
    match (numbers.next().flatten(), numbers.next().flatten()) {
        (Some(a), Some(b)) => (a, b) >= (major, minor),
        _ => panic!("unreadable kernel release {release:?}"),
    }
}

/// Whether the tests run under software emulation (`cargo xtask vmtest`
/// sets `LB_TEST_EMULATED=1`), where a loop of a million system calls
/// takes minutes: a test that churns that much churns a tenth there, and
/// the full count runs on the host kernel.
pub fn emulated() -> bool {
    std::env::var("LB_TEST_EMULATED").is_ok_and(|v| v == "1")
}

/// The `lb` binary under test: `$LB_BIN`, or the workspace's debug build.
pub fn lb_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("LB_BIN") {
        return PathBuf::from(path);
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let path = workspace.join("target/debug/lb");
    assert!(
        path.exists(),
        "{} not found: build it (`cargo build -p lb-user`) or set LB_BIN",
        path.display()
    );
    path
}

/// The test client binary: `bin` (`env!("CARGO_BIN_EXE_lb-test-client")` in
/// a test), or `$LB_TEST_CLIENT` (a VM's copy of it).
pub fn client_bin(bin: &str) -> PathBuf {
    std::env::var_os("LB_TEST_CLIENT").map_or_else(|| PathBuf::from(bin), PathBuf::from)
}

/// An address in this test's own loopback range `127.77.<test>.0/24`.
pub fn addr(test: u8, host: u8, port: u16) -> SocketAddr {
    SocketAddr::from(([127, 77, test, host], port))
}
