//! `cargo xtask vmtest`: the privileged integration tests on other kernels.
//!
//! `lb` and the test binaries are built on the host, then each kernel is
//! booted once in a throwaway QEMU guest (virtme-ng) that sees the host's
//! files read-only and runs every test binary in turn. By default the
//! kernels are Debian's generic kernels of bullseye (5.10), bookworm (6.1)
//! and trixie (6.12), downloaded as packages and unpacked (never installed).
//! `--release RELEASE` and `--kernel FILE` (both repeatable) replace that
//! list: a release is one of those three names, a file is a `.deb` or a
//! vmlinuz. A vmlinuz on its own needs 9p and virtio built in (Debian's
//! have them as modules: give the `.deb`, or the `boot/vmlinuz-*` of an
//! unpacked package).
//!
//! The pieces: `tools` (what the host needs, and the run lock), `kernels`
//! (getting each kernel ready), `guest` (the script the guest runs, and
//! booting it), `libtest` (reading each binary's output into per-test
//! results); this module builds the binaries, runs each kernel and sums up.
//!
//! Layout under `target/vmtest/`:
//! - `apt/<release>/`: a private apt configuration per release, so the
//!   machine's own apt configuration and lists are never touched;
//! - `virtme-ng-<version>/`: a Python virtual environment with virtme-ng,
//!   so the machine's own Python packages are never touched either;
//! - `kernels/<name>/`: unpacked kernel packages, reused when present
//!   (delete a directory to fetch that kernel again);
//! - `bin/`: the binaries under test (`lb`, `lb-test-client` and the test
//!   executables), linked or copied there at the start of a run, so a
//!   rebuild on the host cannot change them mid-run; the guest copies them
//!   into its memory before running them;
//! - `results/<name>/`: the guest script, each binary's output and exit
//!   status, the guest's dmesg and the console log of the last run.

mod guest;
mod kernels;
mod libtest;
mod outcome;
mod tools;
mod watch;

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, PoisonError},
    time::Instant,
};

use anyhow::{Context as _, bail};

pub use self::kernels::{KernelSpec, Release};
use self::{
    guest::Binaries,
    kernels::Kernel,
    outcome::{Outcome, collect},
    tools::Vng,
};
use crate::{
    cargo::{cargo, cargo_command},
    cmd::{output_of, target_dir},
    stages::Stages,
};

/// `cargo xtask vmtest`'s command line. With neither option, every
/// [`Release`] is tested.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Test the generic kernel of this Debian release; may be repeated.
    #[arg(long = "release", value_name = "RELEASE")]
    releases: Vec<Release>,
    /// Test this kernel package (.deb) or image (vmlinuz); may be repeated.
    /// Always a file, even when its name is a release's.
    #[arg(long = "kernel", value_name = "FILE")]
    kernels: Vec<PathBuf>,
    /// Run only this test binary (`xdp_fixtures`, `datapath`, ...) in the
    /// guests; may be repeated. Default: every binary but the host-only.
    #[arg(long = "test", value_name = "BINARY")]
    tests: Vec<String>,
    /// Run only the tests whose names contain this (libtest's filter), in
    /// each binary run: `bgp::`, `short_way`.
    #[arg(long, value_name = "NAME", value_parser = test_filter)]
    pub filter: Option<String>,
}

/// A `--filter`: letters, digits, `_` and `:` (it goes into the guest's
/// shell script as it is).
fn test_filter(text: &str) -> Result<String, String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    if !text.is_empty() && text.chars().all(allowed) {
        Ok(text.to_owned())
    } else {
        Err(format!("{text:?}: a test name's part, of letters, digits, `_` and `:`"))
    }
}

impl Args {
    /// The test binaries asked for: all (but the host-only) when none was.
    pub fn guests(&self) -> Guests {
        if self.tests.is_empty() { Guests::All } else { Guests::Only(self.tests.clone()) }
    }

    /// The kernels asked for, the releases first; every release when none
    /// was. A `--kernel` that names no file is an error here, before
    /// anything is built.
    pub fn kernel_specs(&self) -> anyhow::Result<Vec<KernelSpec>> {
        let Self { releases, kernels, tests: _, filter: _ } = self;
        if releases.is_empty() && kernels.is_empty() {
            return Ok(Release::ALL.map(KernelSpec::Release).to_vec());
        }
        let releases = releases.iter().copied().map(KernelSpec::Release);
        let files = kernels.iter().cloned().map(KernelSpec::file);
        releases.map(Ok).chain(files).collect()
    }
}

/// A test executable to run in the guest.
struct TestBinary {
    /// The cargo target name (`datapath`), also used for file names.
    name: String,
    path: PathBuf,
}

/// Tests each of `kernels`, [`guests_at_once`] of them at a time, prints
/// one line per kernel as it ends and a closing summary, and fails if any
/// kernel did. With `stages` (`cargo xtask test`), the build, the kernels'
/// fetch and the guests are stages of its table.
pub fn run(
    kernels: &[KernelSpec],
    guests: Guests,
    filter: Option<&str>,
    mut stages: Option<&mut Stages>,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let base = std::path::absolute(target_dir().join("vmtest"))
        .context("resolving the target directory")?;

    // Held until the run ends: runs share `bin/` and `results/`.
    let _lock = tools::lock(&base)?;
    if let Some(stages) = stages.as_deref_mut() {
        stages.begin("VMs: virtme-ng, lb (release) and the tests built, kernels fetched");
    }
    let vng = tools::ensure(&base)?;
    let binaries = build(&base, &guests, filter)?;

    // Each kernel gets its own results directory, also when two arguments
    // have the same version (among n names, one of the first n + 1
    // candidates is free).
    let mut names = BTreeSet::new();
    let prepared: Vec<(String, anyhow::Result<Kernel>)> = kernels
        .iter()
        .map(|spec| {
            let name = (1..=kernels.len() + 1)
                .map(|n| if n == 1 { spec.name() } else { format!("{}-{n}", spec.name()) })
                .find(|candidate| names.insert(candidate.clone()))
                .unwrap_or_else(|| spec.name());
            println!("==> kernel {name}");
            let kernel = spec.prepare(&base).map(|kernel| Kernel { name: name.clone(), ..kernel });
            (name, kernel)
        })
        .collect();

    let at_once = guests_at_once(prepared.len());
    let title = format!(
        "VMs: {} ({at_once} at a time)",
        prepared.iter().map(|(name, _)| name.as_str()).collect::<Vec<_>>().join(", ")
    );
    match stages {
        Some(stages) => stages.begin(&title),
        None => println!("==> {title}"),
    }
    let outcomes = boot_each(&base, &vng, &binaries, prepared, at_once);

    println!("==> vmtest summary ({:.0} s in all)", started.elapsed().as_secs_f64());
    for outcome in &outcomes {
        println!("{}", outcome.summary(false));
    }
    // One plain closing line over every kernel, for whoever reads the end.
    let passed: usize = outcomes.iter().map(|o| o.passed).sum();
    let failed_tests: usize = outcomes.iter().map(|o| o.failed.len() + o.problems.len()).sum();
    let skipped: usize = outcomes.iter().map(|o| o.skipped.len()).sum();
    println!("vmtest: {passed} passed, {failed_tests} failed, {skipped} skipped");
    let failed: Vec<&str> = outcomes.iter().filter(|o| !o.ok()).map(|o| o.name.as_str()).collect();
    if !failed.is_empty() {
        bail!("vmtest failed on: {}", failed.join(", "));
    }
    Ok(())
}

/// Test binaries that run on the host kernel only: load tests (200
/// threads, 10,000 connections) that say nothing more about a kernel than
/// the others do and would take many minutes under software emulation,
/// the discovery and membership tests that never touch the kernel, and
/// the elections: two or three daemons at once, each attaching `lb_xdp`,
/// timed against sub-second leases, which software emulation on two CPUs
/// cannot keep (on 5.10, 60–130 s a test and half of them failing on
/// time: a restarted daemon not answering within 60 s, a takeover not
/// seen). Their kernel half, ARP answered by `lb_xdp` until the fence, is
/// `xdp_fixtures`' on every kernel.
const HOST_ONLY: [&str; 6] =
    ["chaos", "stress", "discovery", "election", "load_balancers", "membership"];

/// Test binaries CI runs on the host kernel only ([`Guests::Trimmed`]):
/// discovery through a VIP, the balancer's failure scenarios (k3s's
/// issues, replayed), LoadBalancer Services end to end and announcing by
/// BGP, whose kernel halves (the connect rewrite, sock_ops' reports,
/// closing a server's connections, the external path) `datapath`,
/// `hardening`, `xdp_fixtures`, `external` and `external_discovery` test
/// on every kernel (BGP's other half is BIRD's). They take some 450 s of
/// the 5.10 guest's time under software emulation (164 s, 40 s, about
/// 70 s and 150 s), which CI's budget does not have; `cargo xtask vmtest`
/// runs them on every kernel.
const TRIMMED_IN_CI: [&str; 4] = ["balancer", "bgp", "discovery_e2e", "load_balancers_e2e"];

/// Tests CI runs on the host kernel only, though their binary runs in the
/// 5.10 guest (libtest's `--skip`: a test's name, or the start of a
/// module's): each costs 30–40 s there, most of it `lb_xdp`'s
/// verification, which every other test of the binary repeats, for
/// nothing 5.10 could do differently: the NAT ports kept from the
/// node's own connections (`ip_local_reserved_ports`), a wider range and
/// a second source address (the same program, other map contents), a
/// reload's attach and detach and an interface created anew (the
/// daemon's netlink, which every test's attach already takes); and the
/// hostile clients and servers end to end (`external::hostile`, some
/// 140 s), whose every verdict is the program's own on packets, which
/// `xdp_fixtures` checks on 5.10 with the same frames (`hostile.rs`,
/// `tables.rs`: a SYN sent again, a flood of new flows, a server's reset
/// out of its window). Some 300 s of the guest; `cargo xtask vmtest`
/// runs them.
const SKIPPED_IN_CI: [(&str, &str); 4] = [
    ("external", "nat_ports::"),
    ("external", "hostile::"),
    ("external", "a_reload_attaches_and_detaches_the_external_path"),
    ("external", "an_interface_created_anew_gets_the_program_again"),
];

/// The test binaries CI runs on its newest kernel (6.12), which sits
/// between the oldest (5.10, where CI runs all but [`TRIMMED_IN_CI`]) and
/// the host's own: the ones that load every program and drive the
/// kernel's hooks most directly (the connect rewrite, UDP's, `lb_xdp` on
/// every kind of packet). The external path end to end, the daemon's
/// hardening and the operator's commands say less of a kernel in between
/// than of the two around it, and took most of its 7.7 min.
pub const CI_NEWEST: [&str; 3] = ["datapath", "udp", "xdp_fixtures"];

/// Which test binaries the guests run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Guests {
    /// All but [`HOST_ONLY`].
    All,
    /// All but [`HOST_ONLY`] and [`TRIMMED_IN_CI`].
    Trimmed,
    /// These binaries, and no others (`--test`).
    Only(Vec<String>),
}

/// The client binaries the tests start inside the guest, and the variable
/// through which each test finds its copy.
const CLIENTS: [(&str, &str); 1] = [("lb-test-client", "LB_TEST_CLIENT")];

/// Builds `lb` and the `lb-tests` binaries that `guests` asks for and
/// fixes them under `<base>/bin`, each to run with `filter` (`--filter`).
///
/// `lb` is the release build: the guest runs under software emulation,
/// where the debug build is too slow for the tests' own deadlines (a
/// daemon must answer within 60 s). The test binaries stay debug builds;
/// they do little work of their own.
fn build(base: &Path, guests: &Guests, filter: Option<&str>) -> anyhow::Result<Binaries> {
    println!("==> building lb (release) and the integration tests");
    cargo(&["build", "--release", "--package", "lb-user"])?;
    let out = output_of(&mut cargo_command(&[
        "test",
        "--package",
        "lb-tests",
        "--no-run",
        "--message-format=json",
    ])?)?;
    let (mut tests, clients) = parse_artifacts(&out)?;
    tests.retain(|test| {
        let name = test.name.as_str();
        let why = if let Guests::Only(wanted) = guests {
            if wanted.iter().any(|w| w == name) {
                return true;
            }
            "was not asked for (--test)"
        } else if HOST_ONLY.contains(&name) {
            "runs on the host kernel only (cargo xtask test runs it there)"
        } else if *guests == Guests::Trimmed && TRIMMED_IN_CI.contains(&name) {
            "runs on the host kernel only in CI (`cargo xtask vmtest` runs it in the guests)"
        } else {
            return true;
        };
        println!("vmtest: {name} {why}");
        false
    });
    if tests.is_empty() {
        bail!("cargo reported no integration test executables for lb-tests");
    }
    let mut skip = Vec::new();
    if *guests == Guests::Trimmed {
        for (binary, test) in SKIPPED_IN_CI {
            if tests.iter().any(|t| t.name == binary) {
                println!("vmtest: {binary}: {test} runs on the host kernel only in CI");
                skip.push((binary.to_owned(), test.to_owned()));
            }
        }
    }

    let bin = base.join("bin");
    if bin.exists() {
        fs::remove_dir_all(&bin).with_context(|| format!("removing {}", bin.display()))?;
    }
    fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    pin(&target_dir().join("release/lb"), &bin.join("lb"))?;
    // The tests find the client through `$LB_TEST_CLIENT` (see the guest
    // script).
    for (name, _) in CLIENTS {
        let client =
            clients.get(name).with_context(|| format!("cargo reported no {name} binary"))?;
        pin_stripped(client, &bin.join(name))?;
    }
    for test in &tests {
        pin_stripped(&test.path, &bin.join(&test.name))?;
    }
    let tests = tests.into_iter().map(|test| test.name).collect();
    Ok(Binaries { dir: bin, tests, filter: filter.map(str::to_owned), skip })
}

/// A hard link (cargo replaces rather than rewrites its outputs, so the
/// link keeps this build), or a copy on another file system.
fn pin(from: &Path, to: &Path) -> anyhow::Result<()> {
    if fs::hard_link(from, to).is_err() {
        fs::copy(from, to)
            .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    }
    Ok(())
}

/// A copy of the debug build `from` without its debug information: the
/// guest copies every binary into memory (a tmpfs of half its 2 GB), and
/// with it the test binaries came to 1 GB, past that, and died of SIGBUS.
/// Without it they are a tenth of that; backtraces keep function names
/// (the symbol table stays), not file and line. Without `objcopy`
/// (binutils) the binary goes whole, as before.
fn pin_stripped(from: &Path, to: &Path) -> anyhow::Result<()> {
    let stripped = Command::new("objcopy").arg("--strip-debug").arg(from).arg(to).status();
    match stripped {
        Ok(status) if status.success() => Ok(()),
        other => {
            println!(
                "vmtest: objcopy --strip-debug {} failed ({other:?}); the guest gets it whole",
                from.display()
            );
            let _ = fs::remove_file(to);
            pin(from, to)
        }
    }
}

/// Picks the test executables and the client binaries ([`CLIENTS`]) out
/// of cargo's JSON messages.
fn parse_artifacts(
    messages: &str,
) -> anyhow::Result<(Vec<TestBinary>, std::collections::BTreeMap<&'static str, PathBuf>)> {
    let mut tests = Vec::new();
    let mut clients = std::collections::BTreeMap::new();
    for line in messages.lines().filter(|l| l.starts_with('{')) {
        let message: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("parsing cargo message {line:?}"))?;
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(executable) = message["executable"].as_str() else { continue };
        let kinds = message["target"]["kind"].as_array().map(Vec::as_slice).unwrap_or_default();
        let name = message["target"]["name"].as_str().unwrap_or_default();
        let is_test_build = message["profile"]["test"].as_bool().unwrap_or(false);
        if kinds.iter().any(|k| k == "test") {
            // The name goes into file names and the guest script.
            if name.is_empty()
                || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                bail!("unexpected test target name {name:?} in cargo's output");
            }
            tests.push(TestBinary { name: name.to_owned(), path: PathBuf::from(executable) });
        } else if kinds.iter().any(|k| k == "bin")
            && !is_test_build
            && let Some((client, _)) = CLIENTS.iter().find(|(client, _)| *client == name)
        {
            clients.insert(*client, PathBuf::from(executable));
        }
    }
    tests.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((tests, clients))
}

/// How many guests boot at once: one per two of the machine's CPUs, up to
/// one per kernel. Under software emulation a guest keeps about 1.2 CPUs
/// busy (110-135 % measured on the 2-CPU machine while its tests run), so
/// two guests on two CPUs each ran 1.7-1.8 times slower: together barely
/// sooner than one after the other, and every test's deadline nearer.
/// Each guest is its own kernel: nothing a test does in one (addresses,
/// sysctls, namespaces) is seen by another.
fn guests_at_once(kernels: usize) -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    (cpus / 2).clamp(1, kernels.max(1))
}

/// Boots each prepared kernel, `at_once` at a time, and returns their
/// outcomes in the kernels' order. A kernel that could not be fetched is
/// one failed kernel, not the end of the run.
fn boot_each(
    base: &Path,
    vng: &Vng,
    binaries: &Binaries,
    prepared: Vec<(String, anyhow::Result<Kernel>)>,
    at_once: usize,
) -> Vec<Outcome> {
    let count = prepared.len();
    let queue = Mutex::new(prepared.into_iter().enumerate());
    let done = Mutex::new(Vec::with_capacity(count));
    std::thread::scope(|scope| {
        for _ in 0..at_once {
            scope.spawn(|| {
                loop {
                    // The lock is held only to take the next kernel.
                    let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
                    let Some((index, (name, kernel))) = next else { break };
                    let outcome = match kernel {
                        Ok(kernel) => boot_and_test(base, vng, &kernel, binaries),
                        Err(e) => Outcome {
                            name,
                            problems: vec![format!("no kernel: {e:#}")],
                            ..Outcome::default()
                        },
                    };
                    println!("{}", outcome.summary(true));
                    done.lock().unwrap_or_else(PoisonError::into_inner).push((index, outcome));
                }
            });
        }
    });
    let mut done = done.into_inner().unwrap_or_else(PoisonError::into_inner);
    done.sort_by_key(|(index, _)| *index);
    done.into_iter().map(|(_, outcome)| outcome).collect()
}

/// Boots `kernel` once and runs every test binary in it.
fn boot_and_test(base: &Path, vng: &Vng, kernel: &Kernel, binaries: &Binaries) -> Outcome {
    let started = Instant::now();
    let results = base.join("results").join(&kernel.name);
    let mut outcome = Outcome {
        name: kernel.name.clone(),
        version: kernel.version.clone(),
        fetch: kernel.fetch_time,
        results: Some(results.clone()),
        ..Outcome::default()
    };
    match guest::boot(vng, kernel, binaries, &results) {
        Ok(()) => collect(&results, &binaries.tests, &mut outcome),
        Err(e) => {
            // Whatever did finish still counts.
            collect(&results, &binaries.tests, &mut outcome);
            outcome.problems.insert(0, format!("{e:#}"));
        }
    }
    outcome.total = started.elapsed() + kernel.fetch_time;
    outcome
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    /// The kernels `cargo xtask <args>` asks for, or clap's error.
    fn kernels(args: &[&str]) -> anyhow::Result<Vec<KernelSpec>> {
        let cli = crate::Cli::try_parse_from(["cargo xtask", "vmtest"].iter().chain(args))?;
        let crate::Task::Vmtest(args) = cli.command else { panic!("not the vmtest command") };
        args.kernel_specs()
    }

    #[test]
    fn a_filter_is_part_of_a_test_name_and_nothing_for_the_shell() {
        let filter = |value: &str| {
            let cli = crate::Cli::try_parse_from(["cargo xtask", "vmtest", "--filter", value])?;
            let crate::Task::Vmtest(args) = cli.command else { panic!("not the vmtest command") };
            Ok::<_, clap::Error>(args.filter)
        };
        assert_eq!(filter("bgp::every_node").unwrap().as_deref(), Some("bgp::every_node"));
        for bad in ["", "a b", "x;reboot", "$(id)", "a'b"] {
            assert!(filter(bad).is_err(), "{bad:?} taken");
        }
    }

    #[test]
    fn the_test_binaries_asked_for() {
        let cli = crate::Cli::try_parse_from([
            "cargo xtask",
            "vmtest",
            "--test",
            "xdp_fixtures",
            "--test",
            "datapath",
        ])
        .unwrap();
        let crate::Task::Vmtest(args) = cli.command else { panic!("not the vmtest command") };
        assert!(
            matches!(args.guests(), Guests::Only(names) if names == ["xdp_fixtures", "datapath"])
        );
    }

    #[test]
    fn command_line() {
        // None asked for: every release.
        let all: Vec<KernelSpec> = Release::ALL.map(KernelSpec::Release).to_vec();
        assert_eq!(kernels(&[]).unwrap(), all);
        assert_eq!(
            kernels(&["--release", "trixie", "--release", "bullseye"]).unwrap(),
            [KernelSpec::Release(Release::Trixie), KernelSpec::Release(Release::Bullseye)]
        );
        // A file, and releases before files whatever the order given.
        let file = std::env::current_exe().unwrap();
        let file_arg = file.to_str().unwrap();
        assert_eq!(
            kernels(&["--kernel", file_arg, "--release", "bookworm"]).unwrap(),
            [KernelSpec::Release(Release::Bookworm), KernelSpec::File(file.clone())]
        );
        // An unknown release is refused by the parser, naming the known ones.
        let unknown = kernels(&["--release", "sid"]).unwrap_err().to_string();
        assert!(unknown.contains("bullseye, bookworm, trixie"), "{unknown}");
        // A release name is never a file, nor a file name a release.
        let missing = kernels(&["--kernel", "trixie"]).unwrap_err().to_string();
        assert!(missing.contains("--kernel trixie: no such file"), "{missing}");
        assert!(kernels(&["--release", file_arg]).is_err());
        assert!(kernels(&["trixie"]).is_err(), "no positional kernels");
    }

    #[test]
    fn cargo_artifacts() {
        let messages = r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"datapath"},"profile":{"test":true},"executable":"/t/datapath-1"}
{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"lb-test-client"},"profile":{"test":false},"executable":"/t/lb-test-client"}
{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"lb-test-client"},"profile":{"test":true},"executable":"/t/lb_test_client-2"}
{"reason":"build-finished","success":true}"#;
        let (tests, client) = parse_artifacts(messages).unwrap();
        assert_eq!(tests.len(), 1);
        assert_eq!(tests[0].path, Path::new("/t/datapath-1"));
        assert_eq!(
            client.get("lb-test-client").map(PathBuf::as_path),
            Some(Path::new("/t/lb-test-client"))
        );
        assert!(parse_artifacts(r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"a b"},"executable":"/t/x"}"#).is_err());
    }
}
