//! The guest: the script it runs, and booting a kernel with virtme-ng to
//! run it.

use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use super::{
    kernels::Kernel,
    tools::Vng,
    watch::{self, BINARY_TIMEOUT_SECS, Ended},
};

/// Console lines shown when a boot did not produce results.
const TAIL_LINES: usize = 40;
/// Modules the tests need that Debian builds as modules: `SOCK_DESTROY`
/// goes through netlink sock_diag to inet_diag and its TCP/UDP handlers;
/// the external path's tests build topologies of veth pairs.
/// The kernel would autoload them, but loading them up front makes a
/// missing one visible in the log instead of as an obscure test failure.
const GUEST_MODULES: [&str; 4] = ["inet_diag", "tcp_diag", "udp_diag", "veth"];
/// Modules udev would load for the emulated machine (q35 with its
/// watchdogs, SATA and CD-ROM, CPU frequency and crypto drivers) that
/// nothing here uses. Under software emulation they cost boot time:
/// measured 42 s -> 22 s (5.10), 18 s -> 12 s (6.1, 6.12).
const BLACKLIST: &str = "modprobe.blacklist=floppy,parport,parport_pc,ppdev,pcspkr,serio_raw,psmouse,evdev,joydev,\
                         mousedev,button,intel_rapl_msr,intel_rapl_common,intel_pmc_core,intel_pmc_bxt,kvm,kvm_intel,\
                         kvm_amd,drm,drm_kms_helper,bochs,bochs_drm,ttm,cirrus,qxl,virtio_gpu,snd_pcsp,sg,sr_mod,cdrom,\
                         ahci,libahci,ata_generic,ata_piix,e1000,virtio_net,virtio_balloon,i2c_i801,i2c_smbus,i2c_piix4,\
                         lpc_ich,iTCO_wdt,iTCO_vendor_support,i6300esb,watchdog,powernow_k8,acpi_cpufreq,pcc_cpufreq,\
                         crct10dif_pclmul,crc32_pclmul,crc32c_intel,ghash_clmulni_intel,aesni_intel,sha1_ssse3,\
                         sha256_ssse3,sha512_ssse3,polyval_clmulni,polyval_generic";

/// What the guest runs: `lb`, `lb-test-client` and the test executables,
/// all in one directory, the test executables under their target names.
pub struct Binaries {
    pub dir: PathBuf,
    pub tests: Vec<String>,
    /// libtest's filter for each binary (`--filter`): checked to be
    /// letters, digits, `_` and `:`.
    pub filter: Option<String>,
    /// Tests not run, by binary (libtest's `--skip`; constants).
    pub skip: Vec<(String, String)>,
}

/// Boots `kernel` once with the guest script, which runs every test binary
/// and leaves their output in `results` (emptied first). `Ok` once the
/// script ran to its end, whatever the tests said; an error (a timeout, a
/// guest that stopped early) ends with the console's last lines.
pub fn boot(vng: &Vng, kernel: &Kernel, binaries: &Binaries, results: &Path) -> anyhow::Result<()> {
    // Only this kernel's own results directory is ever removed.
    if results.exists() {
        fs::remove_dir_all(results).with_context(|| format!("removing {}", results.display()))?;
    }
    fs::create_dir_all(results).with_context(|| format!("creating {}", results.display()))?;
    let script = results.join("guest.sh");
    fs::write(&script, script_text(kernel, binaries, results))
        .with_context(|| format!("writing {}", script.display()))?;

    let console = results.join("console.log");
    let log =
        fs::File::create(&console).with_context(|| format!("creating {}", console.display()))?;
    // The outer bound; `watch::follow` stops a guest that falls silent
    // long before it.
    let timeout =
        watch::Allowance::GUEST.boot.as_secs() + BINARY_TIMEOUT_SECS * binaries.tests.len() as u64;
    let mut cmd = Command::new("timeout");
    cmd.args(["--kill-after=10", &timeout.to_string()])
        // KVM here is a nested paravirtual mode that does not boot stock
        // kernels; 9p because virtiofsd is not there.
        .arg(&vng.program)
        .args(["--force-9p", "--disable-kvm", "-m", "2G", "-p", "2", "--verbose"])
        .arg("-r")
        .arg(&kernel.vmlinuz)
        .arg(format!("--rwdir={}", results.display()))
        .args(["-a", BLACKLIST])
        .args(["--", "/bin/sh"])
        .arg(&script)
        .current_dir(results)
        .env("PATH", &vng.path)
        // vng has no timeout of its own and must never wait on a terminal.
        .stdin(Stdio::null())
        .stdout(log.try_clone().context("duplicating the console log handle")?)
        .stderr(log);
    println!(
        "booting {} ({}{}), at most {timeout} s; console: {}",
        kernel.vmlinuz.display(),
        kernel.version,
        if kernel.has_modules { ", with its modules" } else { ", no modules" },
        console.display()
    );
    let mut child = cmd.spawn().context("running vng")?;
    let status = match watch::follow(&mut child, results, &kernel.name, watch::Allowance::GUEST)
        .context("following the guest")?
    {
        Ended::Exited(status) => status,
        Ended::Wedged { quiet, running } => bail!(
            "the guest made no progress for {:.0} s{} and was stopped; last console lines:\n{}",
            quiet.as_secs_f64(),
            running
                .map(|name| format!(
                    " ({name} had run past its own {BINARY_TIMEOUT_SECS} s timeout)"
                ))
                .unwrap_or_default(),
            tail(&console)
        ),
    };
    if results.join("done").exists() {
        // The guest's own exit status only says whether a binary failed;
        // that is reported per binary.
        return Ok(());
    }
    match status.code() {
        Some(124 | 137) => {
            bail!("timed out after {timeout} s; last console lines:\n{}", tail(&console))
        }
        _ => bail!(
            "the guest stopped before the tests finished (vng: {status}); last console lines:\n{}",
            tail(&console)
        ),
    }
}

/// The script the guest runs: prepare what the tests expect of a machine,
/// then each binary with its output and status in the results directory.
fn script_text(kernel: &Kernel, binaries: &Binaries, results: &Path) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "#!/bin/sh\n# Written by `cargo xtask vmtest`; runs inside the guest.");
    // The guest does not inherit the host's environment.
    let _ = writeln!(s, "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
    let _ = writeln!(s, "export CI=true RUST_BACKTRACE=1");
    let _ = writeln!(s, "R={}", sh_quote(results));
    let _ = writeln!(s, "HOST_BIN={}", sh_quote(&binaries.dir));
    let _ = writeln!(s, "now() {{ read -r up _ < /proc/uptime; echo \"$up\"; }}");
    let _ = writeln!(s, "echo \"boot $(now)\" > \"$R/timing\"\nuname -r > \"$R/uname\"");
    s.push_str(
        r#"# The guest sees the host's files over 9p, and under software emulation
# every page of a binary read that way costs a round trip: the binaries
# run from memory instead. The tests keep their daemons' sockets, configs
# and logs under $TMPDIR, in memory too and apart from the host's /tmp
# (virtme-ng's /tmp is an overlay on it). Not mounted on /tmp itself: that
# would hide this very directory when the workspace is there.
mkdir -p /run/vmtest
mount -t tmpfs -o mode=1777 tmpfs /run/vmtest
mkdir -m 1777 /run/vmtest/tmp
export TMPDIR=/run/vmtest/tmp
B=/run/vmtest/bin
cp -r "$HOST_BIN" "$B"
export LB_BIN="$B/lb" LB_TEST_CLIENT="$B/lb-test-client"
# Software emulation runs a loop some 15 times slower: the tests that churn
# a million sockets churn fewer here (`lb_tests::emulated`).
export LB_TEST_EMULATED=1
# An https health check without ca_file loads the CA store. Read file by
# file from /etc/ssl/certs over 9p, that alone takes longer than the tests
# wait for the daemon to start; the bundle holds the same certificates.
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt; fi
grep -q ' /sys/fs/cgroup cgroup2 ' /proc/mounts || mount -t cgroup2 cgroup2 /sys/fs/cgroup
mkdir -p /sys/fs/bpf
grep -q ' /sys/fs/bpf bpf ' /proc/mounts || mount -t bpf bpf /sys/fs/bpf
if command -v ip >/dev/null; then ip link set lo up; else busybox ip link set lo up; fi
"#,
    );
    if kernel.has_modules {
        // virtme-ng links the package's modules to /lib/modules/$(uname -r).
        for module in GUEST_MODULES {
            let _ = writeln!(
                s,
                "modprobe {module} >> \"$R/modules.log\" 2>&1 || echo \"modprobe {module} failed\" >> \"$R/modules.log\""
            );
        }
    }
    // What udev loaded, to keep BLACKLIST honest.
    let _ = writeln!(s, "cut -d' ' -f1 /proc/modules > \"$R/modules.loaded\"");
    let filter = binaries.filter.as_deref().map(|f| format!(" {f}")).unwrap_or_default();
    for name in &binaries.tests {
        let mut filter = filter.clone();
        for (_, test) in binaries.skip.iter().filter(|(binary, _)| binary == name) {
            let _ = write!(filter, " --skip {test}");
        }
        // Test names are checked to be [A-Za-z0-9_-] in parse_artifacts.
        // --nocapture: a test that skips itself says so on stderr, which
        // libtest would otherwise swallow for a passing test.
        // --report-time (unstable; RUSTC_BOOTSTRAP lets a stable-built
        // binary take it): each test's time, for the summary's slowest.
        let _ = writeln!(
            s,
            "echo \"start {name} $(now)\" >> \"$R/timing\"\n\
             RUSTC_BOOTSTRAP=1 timeout --kill-after=10 {BINARY_TIMEOUT_SECS} \"$B/{name}\" --test-threads=1 --nocapture -Z unstable-options --report-time{filter} > \"$R/{name}.log\" 2>&1\n\
             echo $? > \"$R/{name}.status\"\n\
             echo \"end {name} $(now)\" >> \"$R/timing\""
        );
    }
    s.push_str("dmesg > \"$R/dmesg.log\" 2>&1\necho done > \"$R/done\"\nsync\n");
    s
}

/// Single-quoted for sh.
fn sh_quote(path: &Path) -> String {
    format!("'{}'", path.to_string_lossy().replace('\'', r"'\''"))
}

/// The last [`TAIL_LINES`] lines of `file`, or nothing if it cannot be read.
fn tail(file: &Path) -> String {
    let text = fs::read(file).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_binary_runs_with_the_filter_and_its_own_skips() {
        let kernel = Kernel {
            name: "bullseye".into(),
            vmlinuz: "/k/vmlinuz".into(),
            version: "5.10.0".into(),
            has_modules: false,
            fetch_time: std::time::Duration::ZERO,
        };
        let binaries = Binaries {
            dir: "/b".into(),
            tests: vec!["datapath".into(), "external".into()],
            filter: Some("a::b".into()),
            skip: vec![("external".into(), "nat_ports::".into()), ("external".into(), "x".into())],
        };
        let script = script_text(&kernel, &binaries, Path::new("/r"));
        let run = |name: &str| {
            script.lines().find(|l| l.contains(&format!("\"$B/{name}\""))).unwrap().to_owned()
        };
        assert!(run("datapath").contains("--report-time a::b > "), "{}", run("datapath"));
        assert!(
            run("external").contains("--report-time a::b --skip nat_ports:: --skip x > "),
            "{}",
            run("external")
        );
    }
}
