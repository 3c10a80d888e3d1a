//! `cargo xtask vmtest`: the privileged integration tests on other kernels.
//!
//! `lb` and the test binaries are built on the host, then each kernel is
//! booted once in a throwaway QEMU guest (virtme-ng) that sees the host's
//! files read-only and runs every test binary in turn. By default the
//! kernels are Debian's generic kernels of bullseye (5.10), bookworm (6.1)
//! and trixie (6.12), downloaded as packages and unpacked (never installed).
//! `--kernel` replaces that list: a `.deb`, a vmlinuz, or a Debian release
//! name (`--kernel bookworm`). A vmlinuz on its own needs 9p and virtio
//! built in (Debian's have them as modules: give the `.deb`, or the
//! `boot/vmlinuz-*` of an unpacked package).
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

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::{target_dir, workspace};

/// Debian releases whose generic kernel is tested by default.
const RELEASES: [&str; 3] = ["bullseye", "bookworm", "trixie"];
/// The virtme-ng release this was verified with, installed into a Python
/// virtual environment of its own under `target/vmtest/`.
const VIRTME_NG_VERSION: &str = "1.42";
/// Debian packages virtme-ng needs. Without udev the guest's output and
/// exit code are lost; python3-venv makes its virtual environment.
const HOST_PACKAGES: [&str; 5] = ["qemu-system-x86", "busybox-static", "kmod", "udev", "python3-venv"];
/// Used when the machine's own sources name no Debian mirror.
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
const DEBIAN_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";
/// One test binary inside the guest. Software emulation (no KVM here) is
/// slow; a hanging binary is killed and the others still run.
const BINARY_TIMEOUT_SECS: u64 = 600;
/// Booting and shutting down, on top of the binaries' own timeouts. The
/// whole boot is bounded by this plus their sum, so a hung guest cannot
/// stall CI.
const BOOT_ALLOWANCE_SECS: u64 = 240;
/// How long a run waits for another one in the same target directory.
const LOCK_WAIT: Duration = Duration::from_secs(45 * 60);
/// Console lines shown when a boot did not produce results.
const TAIL_LINES: usize = 40;
/// Modules the tests need that Debian builds as modules: `SOCK_DESTROY`
/// goes through netlink sock_diag to inet_diag and its TCP/UDP handlers.
/// The kernel would autoload them, but loading them up front makes a
/// missing one visible in the log instead of as an obscure test failure.
const GUEST_MODULES: [&str; 3] = ["inet_diag", "tcp_diag", "udp_diag"];
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

/// A test executable to run in the guest.
struct TestBinary {
    /// The cargo target name (`datapath`), also used for file names.
    name: String,
    path: PathBuf,
}

/// What the guest runs: `lb`, `lb-test-client` and the test executables,
/// all in one directory, the test executables under their target names.
struct Binaries {
    dir: PathBuf,
    tests: Vec<String>,
}

/// Where a kernel comes from.
enum KernelSource {
    /// The generic kernel of a Debian release.
    Debian(String),
    /// A `--kernel` file: a package or an image.
    File(PathBuf),
}

impl KernelSource {
    /// A `--kernel` argument: an existing file, else a Debian release name.
    fn parse(arg: &Path) -> anyhow::Result<Self> {
        if arg.exists() {
            return Ok(Self::File(arg.to_path_buf()));
        }
        let text = arg.to_string_lossy();
        if !text.is_empty() && text.chars().all(|c| c.is_ascii_lowercase() || c == '-') {
            return Ok(Self::Debian(text.into_owned()));
        }
        bail!("--kernel {}: no such file, and not a Debian release name (like bookworm)", arg.display());
    }

    fn name(&self) -> String {
        match self {
            Self::Debian(release) => release.clone(),
            Self::File(path) => kernel_name(path),
        }
    }
}

/// A kernel ready to boot.
struct Kernel {
    /// Short name: the Debian release, or derived from the `--kernel` path.
    name: String,
    vmlinuz: PathBuf,
    version: String,
    /// Whether an unpacked package with modules comes with it (virtme-ng
    /// finds `lib/modules/<version>` next to `boot/` by itself).
    has_modules: bool,
    fetch_time: Duration,
}

/// What one kernel's run came to.
#[derive(Default)]
struct Outcome {
    name: String,
    version: String,
    passed: usize,
    failed: Vec<String>,
    /// Tests that ran but said they were skipped, with their reason.
    skipped: Vec<String>,
    /// Everything else that went wrong: no boot, a timeout, a binary that
    /// crashed or never ran.
    problems: Vec<String>,
    fetch: Duration,
    boot: Option<Duration>,
    tests: Option<Duration>,
    total: Duration,
    results: Option<PathBuf>,
}

impl Outcome {
    fn ok(&self) -> bool {
        self.failed.is_empty() && self.problems.is_empty() && self.passed > 0
    }

    /// The kernel's line and what went wrong; `full` includes the console
    /// tails, which the closing summary leaves to the lines printed before.
    fn summary(&self, full: bool) -> String {
        let secs = |d: Option<Duration>| d.map_or_else(|| "?".to_owned(), |d| format!("{:.0} s", d.as_secs_f64()));
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

pub fn run(kernels: Vec<PathBuf>) -> anyhow::Result<()> {
    let started = Instant::now();
    // Either the default Debian releases or exactly the kernels asked for;
    // a bad argument fails before anything is built.
    let sources: Vec<KernelSource> = if kernels.is_empty() {
        RELEASES.iter().map(|release| KernelSource::Debian((*release).to_owned())).collect()
    } else {
        kernels.iter().map(|k| KernelSource::parse(k)).collect::<anyhow::Result<_>>()?
    };
    let base = std::path::absolute(target_dir().join("vmtest")).context("resolving the target directory")?;

    // Held until the run ends: runs share `bin/` and `results/`.
    let _lock = lock(&base)?;
    let vng = ensure_tools(&base)?;
    let binaries = build(&base)?;

    let mut outcomes = Vec::new();
    let mut names = BTreeSet::new();
    for source in &sources {
        // Each kernel gets its own results directory, also when two
        // arguments have the same version (among n names, one of the
        // first n + 1 candidates is free).
        let name = (1..=sources.len() + 1)
            .map(|n| if n == 1 { source.name() } else { format!("{}-{n}", source.name()) })
            .find(|candidate| names.insert(candidate.clone()))
            .unwrap_or_else(|| source.name());
        println!("==> kernel {name}");
        // A kernel that cannot be fetched is one failed kernel, not the end
        // of the run.
        let kernel = match source {
            KernelSource::Debian(release) => debian_kernel(&base, release),
            KernelSource::File(path) => file_kernel(&base, path),
        }
        .map(|kernel| Kernel { name: name.clone(), ..kernel });
        let outcome = match kernel {
            Ok(kernel) => boot_and_test(&base, &vng, &kernel, &binaries),
            Err(e) => Outcome { name, problems: vec![format!("no kernel: {e:#}")], ..Outcome::default() },
        };
        println!("{}", outcome.summary(true));
        outcomes.push(outcome);
    }

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

/// An exclusive lock on `<base>/lock`, waiting at most [`LOCK_WAIT`] for
/// another run to finish. Released when the file is closed, also when the
/// process dies.
fn lock(base: &Path) -> anyhow::Result<fs::File> {
    fs::create_dir_all(base).with_context(|| format!("creating {}", base.display()))?;
    let path = base.join("lock");
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    let deadline = Instant::now() + LOCK_WAIT;
    let mut said = false;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(file),
            Err(fs::TryLockError::WouldBlock) => {}
            Err(fs::TryLockError::Error(e)) => return Err(e).with_context(|| format!("locking {}", path.display())),
        }
        if Instant::now() >= deadline {
            bail!("another vmtest run still holds {} after {} min", path.display(), LOCK_WAIT.as_secs() / 60);
        }
        if !said {
            println!("waiting for another vmtest run to finish (it holds {})", path.display());
            said = true;
        }
        std::thread::sleep(Duration::from_secs(5));
    }
}

// ---------------------------------------------------------------------------
// Host tools

/// virtme-ng, ready to run.
struct Vng {
    program: PathBuf,
    /// `PATH` for it: `vng` starts `virtme-run` by name.
    path: std::ffi::OsString,
}

/// Installs what virtme-ng needs when it is missing, and virtme-ng itself
/// into its own virtual environment. Only ever adds packages; the
/// machine's apt sources and Python packages are not changed.
fn ensure_tools(base: &Path) -> anyhow::Result<Vng> {
    let missing: Vec<&str> = HOST_PACKAGES.iter().copied().filter(|p| !dpkg_installed(p)).collect();
    if !missing.is_empty() {
        println!("==> installing {}", missing.join(" "));
        // The package lists may be absent or stale on a fresh machine.
        run_cmd(Command::new("apt-get").args(["update", "-qq"]).env("DEBIAN_FRONTEND", "noninteractive"))?;
        run_cmd(
            Command::new("apt-get")
                .args(["install", "-y", "-qq", "--no-install-recommends"])
                .args(&missing)
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )?;
    }
    let venv = base.join(format!("virtme-ng-{VIRTME_NG_VERSION}"));
    let bin = venv.join("bin");
    // Written last: an interrupted install is never mistaken for a
    // complete one. (Not made aside and renamed: a virtual environment's
    // scripts name their interpreter by its path.)
    let installed = venv.join("installed");
    if !installed.is_file() {
        println!("==> installing virtme-ng {VIRTME_NG_VERSION} into {}", venv.display());
        if venv.exists() {
            fs::remove_dir_all(&venv).with_context(|| format!("removing {}", venv.display()))?;
        }
        let python = if which("python3").is_some() { "python3" } else { "python" };
        run_cmd(Command::new(python).args(["-m", "venv"]).arg(&venv))?;
        let spec = format!("virtme-ng=={VIRTME_NG_VERSION}");
        run_cmd(Command::new(bin.join("pip")).args(["install", "--quiet", "--disable-pip-version-check", &spec]))?;
        fs::write(&installed, &spec).with_context(|| format!("writing {}", installed.display()))?;
    }
    let path = std::env::join_paths(std::iter::once(bin.clone()).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())))
        .context("building PATH for virtme-ng")?;
    Ok(Vng { program: bin.join("vng"), path })
}

fn dpkg_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("install ok installed"))
}

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(program)).find(|candidate| candidate.is_file())
}

// ---------------------------------------------------------------------------
// Binaries

/// Builds `lb` and the `lb-tests` binaries and fixes them under
/// `<base>/bin`.
///
/// `lb` is the release build: the guest runs under software emulation,
/// where the debug build is too slow for the tests' own deadlines (a
/// daemon must answer within 60 s). The test binaries stay debug builds;
/// they do little work of their own.
fn build(base: &Path) -> anyhow::Result<Binaries> {
    println!("==> building lb (release) and the integration tests");
    crate::cargo(&["build", "--release", "--package", "lb-user"])?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(&cargo)
        .args(["test", "--package", "lb-tests", "--no-run", "--message-format=json"])
        .current_dir(workspace())
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo test --package lb-tests --no-run")?;
    if !out.status.success() {
        bail!("cargo test --package lb-tests --no-run failed ({})", out.status);
    }
    let (tests, client) = parse_artifacts(&String::from_utf8_lossy(&out.stdout))?;
    if tests.is_empty() {
        bail!("cargo reported no integration test executables for lb-tests");
    }
    let client = client.context("cargo reported no lb-test-client binary")?;

    let bin = base.join("bin");
    if bin.exists() {
        fs::remove_dir_all(&bin).with_context(|| format!("removing {}", bin.display()))?;
    }
    fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    pin(&target_dir().join("release/lb"), &bin.join("lb"))?;
    // The tests find the client through `$LB_TEST_CLIENT`.
    pin(&client, &bin.join("lb-test-client"))?;
    for test in &tests {
        pin(&test.path, &bin.join(&test.name))?;
    }
    Ok(Binaries { dir: bin, tests: tests.into_iter().map(|test| test.name).collect() })
}

/// A hard link (cargo replaces rather than rewrites its outputs, so the
/// link keeps this build), or a copy on another file system.
fn pin(from: &Path, to: &Path) -> anyhow::Result<()> {
    if fs::hard_link(from, to).is_err() {
        fs::copy(from, to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    }
    Ok(())
}

/// Picks the test executables and the `lb-test-client` binary out of
/// cargo's JSON messages.
fn parse_artifacts(messages: &str) -> anyhow::Result<(Vec<TestBinary>, Option<PathBuf>)> {
    let mut tests = Vec::new();
    let mut client = None;
    for line in messages.lines().filter(|l| l.starts_with('{')) {
        let message: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("parsing cargo message {line:?}"))?;
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(executable) = message["executable"].as_str() else { continue };
        let kinds = message["target"]["kind"].as_array().map(Vec::as_slice).unwrap_or_default();
        let name = message["target"]["name"].as_str().unwrap_or_default();
        let is_test_build = message["profile"]["test"].as_bool().unwrap_or(false);
        if kinds.iter().any(|k| k == "test") {
            // The name goes into file names and the guest script.
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
                bail!("unexpected test target name {name:?} in cargo's output");
            }
            tests.push(TestBinary { name: name.to_owned(), path: PathBuf::from(executable) });
        } else if kinds.iter().any(|k| k == "bin") && name == "lb-test-client" && !is_test_build {
            client = Some(PathBuf::from(executable));
        }
    }
    tests.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((tests, client))
}

// ---------------------------------------------------------------------------
// Kernels

/// Debian's generic kernel of `release`, downloaded and unpacked once.
fn debian_kernel(base: &Path, release: &str) -> anyhow::Result<Kernel> {
    let started = Instant::now();
    let root = base.join("kernels").join(release);
    if !root.exists() {
        fetch_debian_kernel(base, release, &root).with_context(|| format!("fetching the kernel of Debian {release}"))?;
    }
    let mut kernel = unpacked_kernel(release, &root)?;
    kernel.fetch_time = started.elapsed();
    Ok(kernel)
}

/// Resolves `linux-image-amd64` of `release` to the versioned package with
/// a private apt configuration, downloads it and unpacks it into `root`.
fn fetch_debian_kernel(base: &Path, release: &str, root: &Path) -> anyhow::Result<()> {
    let apt_dir = base.join("apt").join(release);
    let lists = apt_dir.join("lists");
    let cache = apt_dir.join("cache");
    let debs = apt_dir.join("debs");
    for dir in [lists.join("partial"), cache.join("archives/partial"), debs.clone()] {
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let sources = apt_dir.join("sources.list");
    let signed_by = if Path::new(DEBIAN_KEYRING).exists() { format!("[signed-by={DEBIAN_KEYRING}] ") } else { String::new() };
    fs::write(&sources, format!("# Written by `cargo xtask vmtest`.\ndeb {signed_by}{} {release} main\n", debian_mirror()))
        .with_context(|| format!("writing {}", sources.display()))?;
    let apt = |program: &str| {
        let mut cmd = Command::new(program);
        cmd.arg("-o")
            .arg(format!("Dir::Etc::sourcelist={}", sources.display()))
            .args(["-o", "Dir::Etc::sourceparts=/dev/null"])
            .arg("-o")
            .arg(format!("Dir::State::Lists={}", lists.display()))
            .arg("-o")
            .arg(format!("Dir::Cache={}", cache.display()))
            // Downloads land in a directory the unprivileged `_apt` user
            // cannot write to; without this apt warns on every download.
            .args(["-o", "APT::Sandbox::User=root"]);
        cmd
    };

    println!("fetching the package lists of {release}");
    run_cmd(apt("apt-get").args(["update", "-qq"]))?;
    let text = output_of(apt("apt-cache").args(["depends", "linux-image-amd64"]))?;
    let package = kernel_package(&text)
        .with_context(|| format!("linux-image-amd64 of {release} depends on no linux-image-<version>:\n{text}"))?;

    println!("downloading {package}");
    run_cmd(apt("apt-get").args(["download", "-qq", &package]).current_dir(&debs))?;
    let prefix = format!("{package}_");
    let deb = fs::read_dir(&debs)
        .with_context(|| format!("listing {}", debs.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&prefix)))
        .with_context(|| format!("apt-get download {package} left no .deb in {}", debs.display()))?;
    unpack_deb(&deb, root)?;
    // The unpacked tree is what is kept; the package is not needed again.
    let _ = fs::remove_file(&deb);
    Ok(())
}

/// The first `Depends: linux-image-<digit>...` of `apt-cache depends`.
fn kernel_package(depends: &str) -> Option<String> {
    depends.lines().find_map(|line| {
        let name = line.trim().trim_start_matches('|').strip_prefix("Depends:")?.trim();
        let version = name.strip_prefix("linux-image-")?;
        version.starts_with(|c: char| c.is_ascii_digit()).then(|| name.to_owned())
    })
}

/// The Debian archive this machine already uses (the network may reach
/// nothing else), from its apt sources.
fn debian_mirror() -> String {
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(dir) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = dir.filter_map(Result::ok).map(|e| e.path()).collect();
        more.sort();
        files.extend(more.into_iter().filter(|p| p.extension().is_some_and(|e| e == "list" || e == "sources")));
    }
    for text in files.iter().filter_map(|file| fs::read_to_string(file).ok()) {
        for line in text.lines().filter(|line| !line.trim_start().starts_with('#')) {
            // One-line (`deb [opts] URI suite ...`) and deb822 (`URIs: URI`)
            // formats both have the URI as a word of its own.
            if let Some(uri) = line.split_whitespace().find(|word| {
                (word.starts_with("http://") || word.starts_with("https://")) && word.trim_end_matches('/').ends_with("/debian")
            }) {
                return uri.trim_end_matches('/').to_owned();
            }
        }
    }
    DEFAULT_MIRROR.to_owned()
}

/// A `--kernel` file: a kernel package, or a kernel image.
fn file_kernel(base: &Path, path: &Path) -> anyhow::Result<Kernel> {
    let started = Instant::now();
    let name = kernel_name(path);
    let path = fs::canonicalize(path).with_context(|| format!("--kernel {}", path.display()))?;
    let mut kernel = if path.extension().is_some_and(|e| e == "deb") {
        // Apart from the releases' directories, whatever the file is called.
        let root = base.join("kernels").join(format!("file-{name}"));
        // Unpack again when the package is newer than what was unpacked.
        let modified = |p: &Path| fs::metadata(p).and_then(|m| m.modified()).ok();
        if modified(&root).is_none_or(|unpacked| modified(&path).is_none_or(|deb| deb > unpacked)) {
            if root.exists() {
                fs::remove_dir_all(&root).with_context(|| format!("removing {}", root.display()))?;
            }
            unpack_deb(&path, &root)?;
        }
        unpacked_kernel(&name, &root)?
    } else {
        let version = bzimage_version(&path)?;
        // An image inside an unpacked tree (`<root>/boot/vmlinuz-<version>`)
        // brings its modules along.
        let has_modules = path
            .parent()
            .filter(|boot| boot.ends_with("boot"))
            .and_then(Path::parent)
            .is_some_and(|root| modules_dir(root, &version).is_some());
        Kernel { name, vmlinuz: path, version, has_modules, fetch_time: Duration::ZERO }
    };
    kernel.fetch_time = started.elapsed();
    Ok(kernel)
}

/// A short name for a `--kernel` file, also used as a directory name.
fn kernel_name(path: &Path) -> String {
    // Not file_stem: "vmlinuz-6.12.4" has no extension to drop.
    let file = path.file_name().map_or_else(|| "kernel".to_owned(), |s| s.to_string_lossy().into_owned());
    let stem = file.strip_suffix(".deb").unwrap_or(&file);
    // linux-image-6.1.0-37-amd64_6.1.140-1_amd64 -> 6.1.0-37-amd64
    let stem = stem.split('_').next().unwrap_or(stem);
    let stem = stem.strip_prefix("linux-image-").or_else(|| stem.strip_prefix("vmlinuz-")).unwrap_or(stem);
    stem.chars().map(|c| if c.is_ascii_alphanumeric() || "-.+".contains(c) { c } else { '_' }).collect()
}

/// `dpkg -x` into a fresh directory, then moved into place, so an
/// interrupted unpack is never mistaken for a complete one. Also runs
/// depmod (a package leaves that to its postinst), so that modprobe and
/// the kernel's module autoloading work in the guest.
fn unpack_deb(deb: &Path, root: &Path) -> anyhow::Result<()> {
    println!("unpacking {}", deb.display());
    let partial = root.with_extension("partial");
    if partial.exists() {
        fs::remove_dir_all(&partial).with_context(|| format!("removing {}", partial.display()))?;
    }
    fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
    run_cmd(Command::new("dpkg").arg("-x").arg(deb).arg(&partial))?;
    let kernel = unpacked_kernel("", &partial).with_context(|| format!("{} holds no kernel", deb.display()))?;
    if let Some(modules) = modules_dir(&partial, &kernel.version) {
        // Both depmod -b and virtme-ng look for <root>/lib/modules; newer
        // packages ship usr/lib/modules only.
        let lib_modules = partial.join("lib/modules");
        if !lib_modules.exists() {
            fs::create_dir_all(partial.join("lib")).with_context(|| format!("creating {}/lib", partial.display()))?;
            std::os::unix::fs::symlink("../usr/lib/modules", &lib_modules)
                .with_context(|| format!("linking {}", lib_modules.display()))?;
        }
        run_cmd(Command::new("depmod").arg("-b").arg(&partial).arg(&kernel.version))
            .with_context(|| format!("depmod for {}", modules.display()))?;
    }
    fs::rename(&partial, root).with_context(|| format!("renaming {} to {}", partial.display(), root.display()))?;
    Ok(())
}

/// The kernel image and version in an unpacked package.
fn unpacked_kernel(name: &str, root: &Path) -> anyhow::Result<Kernel> {
    let boot = root.join("boot");
    let vmlinuz = fs::read_dir(&boot)
        .with_context(|| format!("listing {}", boot.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-")))
        .with_context(|| format!("no vmlinuz-* in {}", boot.display()))?;
    let version = vmlinuz.file_name().unwrap_or_default().to_string_lossy().trim_start_matches("vmlinuz-").to_owned();
    let has_modules = modules_dir(root, &version).is_some();
    Ok(Kernel { name: name.to_owned(), vmlinuz, version, has_modules, fetch_time: Duration::ZERO })
}

fn modules_dir(root: &Path, version: &str) -> Option<PathBuf> {
    ["lib/modules", "usr/lib/modules"].iter().map(|dir| root.join(dir).join(version)).find(|dir| dir.is_dir())
}

/// The release string of an x86 bzImage, from its setup header
/// (`kernel_version` at 0x20e points to a string at 0x200 + value).
fn bzimage_version(path: &Path) -> anyhow::Result<String> {
    let image = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    if image.get(0x202..0x206) != Some(b"HdrS") {
        bail!("{} is neither a .deb nor an x86 kernel image (no HdrS setup header)", path.display());
    }
    let pointer = image.get(0x20e..0x210).with_context(|| format!("{}: truncated setup header", path.display()))?;
    let offset = usize::from(u16::from_le_bytes([pointer[0], pointer[1]])) + 0x200;
    let text = image.get(offset..).with_context(|| format!("{}: kernel_version points past the end", path.display()))?;
    let end = text.iter().take(256).position(|&b| b == 0 || b == b' ').unwrap_or(0);
    if end == 0 {
        bail!("{}: no kernel version in the setup header", path.display());
    }
    Ok(String::from_utf8_lossy(&text[..end]).into_owned())
}

// ---------------------------------------------------------------------------
// The guest

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
    match boot(vng, kernel, binaries, &results) {
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

fn boot(vng: &Vng, kernel: &Kernel, binaries: &Binaries, results: &Path) -> anyhow::Result<()> {
    // Only this kernel's own results directory is ever removed.
    if results.exists() {
        fs::remove_dir_all(results).with_context(|| format!("removing {}", results.display()))?;
    }
    fs::create_dir_all(results).with_context(|| format!("creating {}", results.display()))?;
    let script = results.join("guest.sh");
    fs::write(&script, guest_script(kernel, binaries, results)).with_context(|| format!("writing {}", script.display()))?;

    let console = results.join("console.log");
    let log = fs::File::create(&console).with_context(|| format!("creating {}", console.display()))?;
    let timeout = BOOT_ALLOWANCE_SECS + BINARY_TIMEOUT_SECS * binaries.tests.len() as u64;
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
    let status = cmd.status().context("running vng")?;
    if results.join("done").exists() {
        // The guest's own exit status only says whether a binary failed;
        // that is reported per binary.
        return Ok(());
    }
    match status.code() {
        Some(124 | 137) => bail!("timed out after {timeout} s; last console lines:\n{}", tail(&console)),
        _ => bail!("the guest stopped before the tests finished (vng: {status}); last console lines:\n{}", tail(&console)),
    }
}

/// The script the guest runs: prepare what the tests expect of a machine,
/// then each binary with its output and status in the results directory.
fn guest_script(kernel: &Kernel, binaries: &Binaries, results: &Path) -> String {
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
            let _ = writeln!(s, "modprobe {module} >> \"$R/modules.log\" 2>&1 || echo \"modprobe {module} failed\" >> \"$R/modules.log\"");
        }
    }
    // What udev loaded, to keep BLACKLIST honest.
    let _ = writeln!(s, "cut -d' ' -f1 /proc/modules > \"$R/modules.loaded\"");
    for test in &binaries.tests {
        // Test names are checked to be [A-Za-z0-9_-] in parse_artifacts.
        // --nocapture: a test that skips itself says so on stderr, which
        // libtest would otherwise swallow for a passing test.
        let _ = writeln!(
            s,
            "echo \"start {name} $(now)\" >> \"$R/timing\"\n\
             timeout --kill-after=10 {BINARY_TIMEOUT_SECS} \"$B/{name}\" --test-threads=1 --nocapture > \"$R/{name}.log\" 2>&1\n\
             echo $? > \"$R/{name}.status\"\n\
             echo \"end {name} $(now)\" >> \"$R/timing\"",
            name = test,
        );
    }
    s.push_str("dmesg > \"$R/dmesg.log\" 2>&1\necho done > \"$R/done\"\nsync\n");
    s
}

/// Single-quoted for sh.
fn sh_quote(path: &Path) -> String {
    format!("'{}'", path.to_string_lossy().replace('\'', r"'\''"))
}

/// Reads what the guest left in `results` into `outcome`.
fn collect(results: &Path, tests: &[String], outcome: &mut Outcome) {
    if let Ok(uname) = fs::read_to_string(results.join("uname")) {
        outcome.version = uname.trim().to_owned();
    }
    let timing = fs::read_to_string(results.join("timing")).unwrap_or_default();
    let (mut first_start, mut last_end) = (None, None);
    for line in timing.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let seconds = words.last().and_then(|w| w.parse::<f64>().ok()).filter(|s| s.is_finite() && *s >= 0.0);
        match words.first() {
            Some(&"boot") => outcome.boot = seconds.map(Duration::from_secs_f64),
            Some(&"start") => first_start = first_start.or(seconds),
            Some(&"end") => last_end = seconds.or(last_end),
            _ => {}
        }
    }
    if let (Some(start), Some(end)) = (first_start, last_end) {
        outcome.tests = Some(Duration::from_secs_f64((end - start).max(0.0)));
    }
    if let Ok(modules) = fs::read_to_string(results.join("modules.log")) {
        outcome.problems.extend(modules.lines().filter(|l| l.contains("failed")).map(str::to_owned));
    }

    if timing.is_empty() {
        // The script never started: the boot's own error says it all.
        return;
    }
    for test in tests {
        let log = fs::read(results.join(format!("{}.log", test))).map(|b| String::from_utf8_lossy(&b).into_owned());
        let status = fs::read_to_string(results.join(format!("{}.status", test))).ok();
        let report = parse_libtest(log.as_deref().unwrap_or_default());
        let mut failed = 0;
        for (name, result) in &report.tests {
            match result {
                TestResult::Ok => outcome.passed += 1,
                TestResult::Skipped(reason) => outcome.skipped.push(format!("{}::{name} ({reason})", test)),
                TestResult::Failed(why) => {
                    failed += 1;
                    // The first panic says what went wrong; the rest is in the log.
                    let why = why.as_deref().map(|why| format!(": {why}")).unwrap_or_default();
                    outcome.failed.push(format!("{}::{name}{why}", test));
                }
                TestResult::Ignored => outcome.skipped.push(format!("{}::{name} (#[ignore])", test)),
                TestResult::Unfinished => outcome.failed.push(format!("{}::{name} (did not finish)", test)),
            }
        }
        match status.as_deref().map(str::trim) {
            None => outcome.problems.push(format!("{}: never finished", test)),
            Some("0") if report.summary => {}
            Some("0") => outcome.problems.push(format!("{}: exited 0 without libtest's summary", test)),
            Some("124" | "137") => outcome.problems.push(format!("{}: timed out after {BINARY_TIMEOUT_SECS} s", test)),
            // A failing test already counts; a binary that failed without
            // one (a crash, a panic outside a test) must not pass silently.
            Some(code) if failed == 0 => {
                outcome.problems.push(format!("{}: exited with {code} without a failing test", test));
            }
            Some(_) => {}
        }
    }
}

#[derive(Debug, PartialEq)]
enum TestResult {
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

#[derive(Default)]
struct LibtestReport {
    tests: BTreeMap<String, TestResult>,
    /// Whether libtest printed its `test result:` line.
    summary: bool,
}

/// The test whose output `parse_libtest` is reading.
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
fn parse_libtest(log: &str) -> LibtestReport {
    let mut report = LibtestReport::default();
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
                current = Some(Running { name: name.to_owned(), skip: None, panic: None, panic_message_next: false });
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
        let result = match rest.trim() {
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

// ---------------------------------------------------------------------------
// Helpers

fn tail(file: &Path) -> String {
    let text = fs::read(file).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n")
}

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program()).chain(cmd.get_args()).map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ")
}

fn run_cmd(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("running {}", describe(cmd)))?;
    if !status.success() {
        bail!("{} failed ({status})", describe(cmd));
    }
    Ok(())
}

fn output_of(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.stderr(Stdio::inherit()).output().with_context(|| format!("running {}", describe(cmd)))?;
    if !out.status.success() {
        bail!("{} failed ({})", describe(cmd), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtest_output() {
        let log = "\nrunning 5 tests\n\
                   test a ... ok\n\
                   test b ... storm total=3\nok\n\
                   test c ... \nthread 'c' panicked at x.rs:1:1:\nboom\nFAILED\n\
                   test d ... SKIPPED: this test needs sock_destroy, which this kernel lacks\nok\n\
                   test e ... ignored\n\
                   \nfailures:\n    c\n\ntest result: FAILED. 3 passed; 1 failed; 1 ignored; 0 measured; 0 filtered out; finished in 1.00s\n";
        let report = parse_libtest(log);
        assert!(report.summary);
        assert_eq!(report.tests["a"], TestResult::Ok);
        assert_eq!(report.tests["b"], TestResult::Ok);
        assert_eq!(report.tests["c"], TestResult::Failed(Some("panicked at x.rs:1:1: boom".into())));
        assert_eq!(report.tests["d"], TestResult::Skipped("this test needs sock_destroy, which this kernel lacks".into()));
        assert_eq!(report.tests["e"], TestResult::Ignored);
        // A binary killed mid-test.
        let report = parse_libtest("running 3 tests\ntest a ... ok\ntest b ... some output");
        assert!(!report.summary);
        assert_eq!(report.tests["a"], TestResult::Ok);
        assert_eq!(report.tests["b"], TestResult::Unfinished);
    }

    #[test]
    fn kernel_package_from_apt_cache() {
        let text = "linux-image-amd64\n  Depends: linux-image-6.1.0-37-amd64\n  Depends: foo\n";
        assert_eq!(kernel_package(text).as_deref(), Some("linux-image-6.1.0-37-amd64"));
        assert_eq!(kernel_package("linux-image-amd64\n  Depends: linux-image-amd64-signed\n"), None);
    }

    #[test]
    fn kernel_names() {
        assert_eq!(kernel_name(Path::new("/x/linux-image-6.1.0-37-amd64_6.1.140-1_amd64.deb")), "6.1.0-37-amd64");
        assert_eq!(kernel_name(Path::new("/boot/vmlinuz-6.12.4")), "6.12.4");
        assert!(matches!(KernelSource::parse(Path::new("bookworm")), Ok(KernelSource::Debian(r)) if r == "bookworm"));
        assert!(KernelSource::parse(Path::new("/no/such/vmlinuz")).is_err());
    }

    #[test]
    fn not_a_kernel_image() {
        let file = std::env::temp_dir().join(format!("vmtest-not-a-kernel-{}", std::process::id()));
        fs::write(&file, b"short").unwrap();
        assert!(bzimage_version(&file).is_err());
        let _ = fs::remove_file(&file);
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
        assert_eq!(client.as_deref(), Some(Path::new("/t/lb-test-client")));
        assert!(parse_artifacts(r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"a b"},"executable":"/t/x"}"#).is_err());
    }
}
