//! `cargo xtask vmtest`: the privileged integration tests on other kernels.
//!
//! The test binaries are built on the host, then each kernel is booted once
//! in a throwaway QEMU guest (virtme-ng) that sees the host's files read-only
//! and runs every test binary in turn. By default the kernels are Debian's
//! generic kernels of bullseye (5.10), bookworm (6.1) and trixie (6.12),
//! downloaded as packages and unpacked (never installed) under
//! `target/vmtest/kernels/`; `--kernel PATH` (a `.deb` or a vmlinuz) replaces
//! that list.
//!
//! Layout under `target/vmtest/`:
//! - `apt/<release>/`: a private apt configuration per release, so the
//!   machine's own apt configuration and lists are never touched;
//! - `kernels/<name>/`: unpacked kernel packages, reused when present
//!   (delete a directory to fetch that kernel again);
//! - `results/<name>/`: the guest script, each binary's output and exit
//!   status, and the whole console log of the last run on that kernel.

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::{lb_bin, target_dir, workspace};

/// Debian releases whose generic kernel is tested by default.
const RELEASES: [&str; 3] = ["bullseye", "bookworm", "trixie"];
/// The virtme-ng release this was verified with.
const VIRTME_NG: &str = "virtme-ng==1.42";
/// Debian packages virtme-ng needs. Without udev the guest's output and
/// exit code are lost.
const HOST_PACKAGES: [&str; 4] = ["qemu-system-x86", "busybox-static", "kmod", "udev"];
/// Used when the machine's own sources name no Debian mirror.
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
const DEBIAN_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";
/// One boot, all test binaries included. Software emulation (no KVM here)
/// is slow, but a hang must not stall CI.
const BOOT_TIMEOUT_SECS: u64 = 900;
/// One test binary inside the guest; a hanging binary still leaves time
/// for the others and for the guest to report.
const BINARY_TIMEOUT_SECS: u64 = 400;
/// Console lines shown when a boot did not produce results.
const TAIL_LINES: usize = 40;
/// Modules the tests need that Debian builds as modules: `SOCK_DESTROY`
/// goes through netlink sock_diag to inet_diag and its TCP/UDP handlers.
/// The kernel would autoload them, but loading them up front makes a
/// missing one visible in the log instead of as an obscure test failure.
const GUEST_MODULES: [&str; 3] = ["inet_diag", "tcp_diag", "udp_diag"];
/// Modules udev would load for the emulated hardware although nothing
/// here uses them; each costs seconds under software emulation.
const BLACKLIST: &str = "modprobe.blacklist=floppy,parport,parport_pc,ppdev,pcspkr,serio_raw,psmouse,evdev,\
                         joydev,mousedev,button,intel_rapl_msr,intel_rapl_common,intel_pmc_core,kvm,kvm_intel,kvm_amd,\
                         drm,drm_kms_helper,bochs,bochs_drm,ttm,cirrus,qxl,virtio_gpu,snd_pcsp,i2c_piix4,sg,sr_mod,cdrom,ata_generic,ata_piix,libata,\
                         e1000,virtio_net,net_failover,failover,virtio_balloon,virtio_rng,rng_core,qemu_fw_cfg,crc32_pclmul,\
                         ghash_clmulni_intel,aesni_intel,crct10dif_pclmul,polyval_clmulni";

/// A compiled integration test binary of `lb-tests`.
struct TestBinary {
    name: String,
    path: PathBuf,
}

/// Where a kernel comes from.
enum KernelSource {
    /// The generic kernel of a Debian release.
    Debian(&'static str),
    /// A `--kernel` argument.
    Given(PathBuf),
}

impl KernelSource {
    fn name(&self) -> String {
        match self {
            Self::Debian(release) => (*release).to_owned(),
            Self::Given(path) => kernel_name(path),
        }
    }
}

/// A kernel ready to boot.
struct Kernel {
    /// Short name: the Debian release, or derived from the `--kernel` path.
    name: String,
    vmlinuz: PathBuf,
    /// The unpacked package's root (it holds `lib/modules/<version>`), if any.
    root: Option<PathBuf>,
    version: String,
    fetch_time: Duration,
}

/// What one kernel's run came to.
#[derive(Default)]
struct Outcome {
    name: String,
    version: String,
    passed: u32,
    failed: u32,
    ignored: u32,
    failed_tests: Vec<String>,
    /// Everything else that went wrong: no boot, a timeout, a binary that
    /// crashed or never ran.
    problems: Vec<String>,
    fetch: Duration,
    boot: Option<Duration>,
    tests: Option<Duration>,
    total: Duration,
    results: PathBuf,
}

impl Outcome {
    fn ok(&self) -> bool {
        self.failed == 0 && self.problems.is_empty() && self.passed > 0
    }

    fn summary(&self) -> String {
        let secs = |d: Option<Duration>| d.map_or_else(|| "?".to_owned(), |d| format!("{:.0} s", d.as_secs_f64()));
        let mut line = format!(
            "{} {:<9} {:<28} {} passed, {} failed, {} skipped; fetch {:.0} s, boot {}, tests {}, total {:.0} s",
            if self.ok() { "ok  " } else { "FAIL" },
            self.name,
            self.version,
            self.passed,
            self.failed,
            self.ignored,
            self.fetch.as_secs_f64(),
            secs(self.boot),
            secs(self.tests),
            self.total.as_secs_f64(),
        );
        for test in &self.failed_tests {
            let _ = write!(line, "\n       failed: {test}");
        }
        for problem in &self.problems {
            let _ = write!(line, "\n       {problem}");
        }
        if !self.ok() && !self.results.as_os_str().is_empty() {
            let _ = write!(line, "\n       logs: {}", self.results.display());
        }
        line
    }
}

pub fn run(kernels: Vec<PathBuf>) -> anyhow::Result<()> {
    let started = Instant::now();
    ensure_tools()?;
    let tests = build_tests()?;
    let base = target_dir().join("vmtest");
    let base = std::path::absolute(&base).with_context(|| format!("resolving {}", base.display()))?;

    // Either the default Debian releases or exactly the kernels asked for.
    let sources: Vec<KernelSource> = if kernels.is_empty() {
        RELEASES.iter().map(|&release| KernelSource::Debian(release)).collect()
    } else {
        kernels.into_iter().map(KernelSource::Given).collect()
    };

    let mut outcomes = Vec::new();
    for source in &sources {
        let name = source.name();
        println!("==> kernel {name}");
        // A kernel that cannot be fetched is one failed kernel, not the end
        // of the run.
        let kernel = match source {
            KernelSource::Debian(release) => debian_kernel(&base, release),
            KernelSource::Given(path) => given_kernel(&base, path),
        };
        let outcome = match kernel {
            Ok(kernel) => boot_and_test(&base, &kernel, &tests),
            Err(e) => Outcome { name, problems: vec![format!("no kernel: {e:#}")], ..Outcome::default() },
        };
        println!("{}", outcome.summary());
        outcomes.push(outcome);
    }

    println!("==> vmtest summary ({:.0} s in all)", started.elapsed().as_secs_f64());
    for outcome in &outcomes {
        println!("{}", outcome.summary());
    }
    let failed: Vec<&str> = outcomes.iter().filter(|o| !o.ok()).map(|o| o.name.as_str()).collect();
    if !failed.is_empty() {
        bail!("vmtest failed on: {}", failed.join(", "));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Host tools

/// Installs what virtme-ng needs when it is missing. Only ever adds
/// packages; the machine's apt sources are not changed.
fn ensure_tools() -> anyhow::Result<()> {
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
    if which("vng").is_none() {
        println!("==> installing {VIRTME_NG}");
        let python = if which("python3").is_some() { "python3" } else { "python" };
        run_cmd(Command::new(python).args(["-m", "pip", "install", "--quiet", VIRTME_NG]))?;
        // pyenv and friends put new scripts behind shims that need a rehash.
        if which("pyenv").is_some() {
            let _ = Command::new("pyenv").arg("rehash").status();
        }
        if which("vng").is_none() {
            bail!("installed {VIRTME_NG}, but `vng` is still not on PATH ({:?})", std::env::var_os("PATH").unwrap_or_default());
        }
    }
    Ok(())
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
// Test binaries

/// Builds `lb` and the `lb-tests` binaries on the host; returns the test
/// executables, as cargo reports them.
fn build_tests() -> anyhow::Result<Vec<TestBinary>> {
    println!("==> building lb and the integration tests");
    crate::cargo(&["build", "--package", "lb-user"])?;
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
    let stdout = String::from_utf8_lossy(&out.stdout);
    let (tests, client) = parse_artifacts(&stdout)?;
    if tests.is_empty() {
        bail!("cargo reported no integration test executables for lb-tests");
    }
    // The tests start the client through a path compiled into them; the
    // guest sees the same path, but make a missing one an error here.
    let client = client.context("cargo reported no lb-test-client binary")?;
    if !client.exists() {
        bail!("{} does not exist", client.display());
    }
    if !lb_bin().exists() {
        bail!("{} does not exist after building lb-user", lb_bin().display());
    }
    Ok(tests)
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
        fetch_debian_kernel(base, release, &root)?;
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
    let apt_options = |cmd: &mut Command| {
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
    };

    println!("fetching the package lists of {release}");
    let mut update = Command::new("apt-get");
    apt_options(&mut update);
    run_cmd(update.args(["update", "-qq"]))?;

    let mut depends = Command::new("apt-cache");
    apt_options(&mut depends);
    let text = output_of(depends.args(["depends", "linux-image-amd64"]))?;
    let package = kernel_package(&text)
        .with_context(|| format!("linux-image-amd64 of {release} depends on no linux-image-<version>:\n{text}"))?;

    println!("downloading {package}");
    let mut download = Command::new("apt-get");
    apt_options(&mut download);
    run_cmd(download.args(["download", "-qq", &package]).current_dir(&debs))?;
    let deb = fs::read_dir(&debs)
        .with_context(|| format!("listing {}", debs.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("{package}_"))))
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

/// The host of the Debian archive this machine already uses (the network
/// may reach nothing else), from its apt sources.
fn debian_mirror() -> String {
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(dir) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = dir.filter_map(Result::ok).map(|e| e.path()).collect();
        more.sort();
        files.extend(more.into_iter().filter(|p| p.extension().is_some_and(|e| e == "list" || e == "sources")));
    }
    files
        .iter()
        .filter_map(|file| fs::read_to_string(file).ok())
        .flat_map(|text| text.lines().map(str::to_owned).collect::<Vec<_>>())
        .filter(|line| !line.trim_start().starts_with('#'))
        .flat_map(|line| line.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        .find(|word| (word.starts_with("http://") || word.starts_with("https://")) && word.trim_end_matches('/').ends_with("/debian"))
        .map_or_else(|| DEFAULT_MIRROR.to_owned(), |uri| uri.trim_end_matches('/').to_owned())
}

/// A `--kernel` argument: a kernel package, or a kernel image.
fn given_kernel(base: &Path, path: &Path) -> anyhow::Result<Kernel> {
    let started = Instant::now();
    let name = kernel_name(path);
    let path = fs::canonicalize(path).with_context(|| format!("--kernel {}", path.display()))?;
    let mut kernel = if path.extension().is_some_and(|e| e == "deb") {
        let root = base.join("kernels").join(&name);
        // Unpack again when the package is newer than what was unpacked.
        let stale = match (fs::metadata(&path).and_then(|m| m.modified()), fs::metadata(&root).and_then(|m| m.modified())) {
            (Ok(deb), Ok(unpacked)) => deb > unpacked,
            _ => true,
        };
        if stale {
            if root.exists() {
                fs::remove_dir_all(&root).with_context(|| format!("removing {}", root.display()))?;
            }
            unpack_deb(&path, &root)?;
        }
        unpacked_kernel(&name, &root)?
    } else {
        let version = bzimage_version(&path).with_context(|| format!("reading the kernel version of {}", path.display()))?;
        // An image inside an unpacked tree (`<root>/boot/vmlinuz-<version>`)
        // brings its modules along.
        let root = path
            .parent()
            .filter(|boot| boot.ends_with("boot"))
            .and_then(Path::parent)
            .filter(|root| modules_dir(root, &version).is_some())
            .map(Path::to_path_buf);
        Kernel { name, vmlinuz: path, root, version, fetch_time: Duration::ZERO }
    };
    kernel.fetch_time = started.elapsed();
    Ok(kernel)
}

/// `bookworm`-style short name for a `--kernel` path, also a directory name.
fn kernel_name(path: &Path) -> String {
    // Not file_stem: "vmlinuz-6.12.4" has no extension to drop.
    let file = path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "kernel".into());
    let stem = file.strip_suffix(".deb").unwrap_or(&file);
    // linux-image-6.1.0-37-amd64_6.1.140-1_amd64 -> 6.1.0-37-amd64
    let stem = stem.split('_').next().unwrap_or(stem);
    let stem = stem.strip_prefix("linux-image-").or_else(|| stem.strip_prefix("vmlinuz-")).unwrap_or(stem);
    stem.chars().map(|c| if c.is_ascii_alphanumeric() || "-.+".contains(c) { c } else { '_' }).collect()
}

/// `dpkg -x` into a fresh directory, then moved into place, so an
/// interrupted unpack is never mistaken for a complete one. Also
/// generates `modules.dep` (a package leaves that to its postinst), so
/// modprobe works in the guest.
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
        // depmod -b looks in <base>/lib/modules; newer packages ship
        // usr/lib/modules only.
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
    Ok(Kernel { name: name.to_owned(), vmlinuz, root: Some(root.to_path_buf()), version, fetch_time: Duration::ZERO })
}

fn modules_dir(root: &Path, version: &str) -> Option<PathBuf> {
    ["lib/modules", "usr/lib/modules"].iter().map(|dir| root.join(dir).join(version)).find(|dir| dir.is_dir())
}

/// The release string of an x86 bzImage, from its setup header
/// (`kernel_version` at 0x20e points to a string at 0x200 + value).
fn bzimage_version(path: &Path) -> anyhow::Result<String> {
    let image = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    if image.get(0x202..0x206) != Some(b"HdrS") {
        bail!("{} is not an x86 bzImage (no HdrS setup header)", path.display());
    }
    let offset = u16::from_le_bytes([image[0x20e], image[0x20f]]) as usize + 0x200;
    let text = image.get(offset..).with_context(|| format!("{}: kernel_version points past the end", path.display()))?;
    let end = text.iter().position(|&b| b == 0 || b == b' ').unwrap_or(text.len().min(64));
    let version = String::from_utf8_lossy(&text[..end]).into_owned();
    if version.is_empty() {
        bail!("{}: empty kernel_version", path.display());
    }
    Ok(version)
}

// ---------------------------------------------------------------------------
// The guest

/// Boots `kernel` once and runs every test binary in it.
fn boot_and_test(base: &Path, kernel: &Kernel, tests: &[TestBinary]) -> Outcome {
    let started = Instant::now();
    let results = base.join("results").join(&kernel.name);
    let mut outcome = Outcome {
        name: kernel.name.clone(),
        version: kernel.version.clone(),
        fetch: kernel.fetch_time,
        results: results.clone(),
        ..Outcome::default()
    };
    if let Err(e) = boot(kernel, tests, &results) {
        outcome.problems.push(format!("{e:#}"));
    }
    collect(&results, tests, &mut outcome);
    outcome.total = started.elapsed() + kernel.fetch_time;
    outcome
}

fn boot(kernel: &Kernel, tests: &[TestBinary], results: &Path) -> anyhow::Result<()> {
    // Only this kernel's own results directory is ever removed.
    if results.exists() {
        fs::remove_dir_all(results).with_context(|| format!("removing {}", results.display()))?;
    }
    fs::create_dir_all(results).with_context(|| format!("creating {}", results.display()))?;
    let script = results.join("guest.sh");
    fs::write(&script, guest_script(kernel, tests, results)?).with_context(|| format!("writing {}", script.display()))?;

    let console = results.join("console.log");
    let log = fs::File::create(&console).with_context(|| format!("creating {}", console.display()))?;
    let mut cmd = Command::new("timeout");
    cmd.args(["--kill-after=10", &BOOT_TIMEOUT_SECS.to_string(), "vng", "--force-9p", "--disable-kvm", "-m", "2G", "-p", "2"])
        .arg("-r")
        .arg(&kernel.vmlinuz)
        .arg(format!("--rwdir={}", results.display()))
        .args(["-a", BLACKLIST])
        .args(["--", "/bin/sh"])
        .arg(&script)
        .current_dir(results)
        // vng has no timeout of its own and must never wait on a terminal.
        .stdin(Stdio::null())
        .stdout(log.try_clone().context("duplicating the console log handle")?)
        .stderr(log);
    println!("booting {} ({}), console: {}", kernel.name, kernel.vmlinuz.display(), console.display());
    let status = cmd.status().context("running vng")?;
    match status.code() {
        Some(0) => Ok(()),
        Some(124) | Some(137) => bail!("timed out after {BOOT_TIMEOUT_SECS} s; last console lines:\n{}", tail(&console)),
        // The guest's own exit status: the script fails when a binary did;
        // that is reported per binary, so only a missing `done` matters.
        _ if results.join("done").exists() => Ok(()),
        _ => bail!("vng exited with {status} before the tests finished; last console lines:\n{}", tail(&console)),
    }
}

/// The script the guest runs: prepare what the tests expect of a machine,
/// then each binary with its output and status in the results directory.
fn guest_script(kernel: &Kernel, tests: &[TestBinary], results: &Path) -> anyhow::Result<String> {
    let lb = std::path::absolute(lb_bin()).context("resolving the lb binary")?;
    let mut s = String::new();
    let _ = writeln!(s, "#!/bin/sh\n# Written by `cargo xtask vmtest`; runs inside the guest.");
    // The guest does not inherit the host's environment.
    let _ = writeln!(s, "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
    let _ = writeln!(s, "export CI=true RUST_BACKTRACE=1 LB_BIN={}", sh_quote(&lb));
    let _ = writeln!(s, "R={}", sh_quote(results));
    let _ = writeln!(s, "uptime() {{ read -r up _ < /proc/uptime; echo \"$up\"; }}");
    let _ = writeln!(s, "echo \"boot $(uptime)\" > \"$R/timing\"");
    let _ = writeln!(s, "uname -r > \"$R/uname\"");
    let _ = writeln!(
        s,
        r#"# The tests' daemon keeps its socket and state under $TMPDIR; the host's
# /tmp is read-only here unless virtme-ng put a tmpfs on it.
export TMPDIR=/tmp
if ! touch /tmp/.vmtest 2>/dev/null; then mount -t tmpfs tmpfs /tmp; fi
grep -q ' /sys/fs/cgroup cgroup2 ' /proc/mounts || mount -t cgroup2 cgroup2 /sys/fs/cgroup
mkdir -p /sys/fs/bpf
grep -q ' /sys/fs/bpf bpf ' /proc/mounts || mount -t bpf bpf /sys/fs/bpf
if command -v ip >/dev/null; then ip link set lo up; else busybox ip link set lo up; fi"#
    );
    if kernel.root.is_some() {
        // virtme-ng links the package's modules (with the modules.dep made
        // on the host) to /lib/modules/$(uname -r), where the kernel's own
        // autoloading finds them too.
        for module in GUEST_MODULES {
            let _ = writeln!(s, "modprobe {module} >> \"$R/modules.log\" 2>&1 || echo \"modprobe {module} failed\" >> \"$R/modules.log\"");
        }
    }
    let _ = writeln!(s, "rc=0");
    for test in tests {
        // Cargo target names are [A-Za-z0-9_-]; checked in parse_artifacts,
        // so the name can go into file names unquoted.
        let name = &test.name;
        let _ = writeln!(
            s,
            "echo \"start {name} $(uptime)\" >> \"$R/timing\"\n\
             timeout --kill-after=10 {BINARY_TIMEOUT_SECS} {bin} --test-threads=1 > \"$R/{name}.log\" 2>&1\n\
             status=$?\n\
             echo \"end {name} $(uptime)\" >> \"$R/timing\"\n\
             echo $status > \"$R/{name}.status\"\n\
             [ $status -eq 0 ] || rc=1",
            bin = sh_quote(&test.path)
        );
    }
    let _ = writeln!(s, "echo done > \"$R/done\"\nsync\nexit $rc");
    Ok(s)
}

/// Single-quoted for sh.
fn sh_quote(path: &Path) -> String {
    format!("'{}'", path.to_string_lossy().replace('\'', r"'\''"))
}

/// Reads what the guest left in `results` into `outcome`.
fn collect(results: &Path, tests: &[TestBinary], outcome: &mut Outcome) {
    if let Ok(uname) = fs::read_to_string(results.join("uname")) {
        outcome.version = uname.trim().to_owned();
    }
    let timing = fs::read_to_string(results.join("timing")).unwrap_or_default();
    let mut first_start = None;
    let mut last_end = None;
    for line in timing.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let seconds = |w: Option<&&str>| w.and_then(|w| w.parse::<f64>().ok());
        match words.first() {
            Some(&"boot") => outcome.boot = seconds(words.get(1)).map(Duration::from_secs_f64),
            Some(&"start") => first_start = first_start.or(seconds(words.get(2))),
            Some(&"end") => last_end = seconds(words.get(2)).or(last_end),
            _ => {}
        }
    }
    if let (Some(start), Some(end)) = (first_start, last_end) {
        outcome.tests = Some(Duration::from_secs_f64((end - start).max(0.0)));
    }
    if let Ok(modules) = fs::read_to_string(results.join("modules.log")) {
        for line in modules.lines().filter(|l| l.contains("failed")) {
            outcome.problems.push(line.to_owned());
        }
    }

    for test in tests {
        let log = fs::read_to_string(results.join(format!("{}.log", test.name))).unwrap_or_default();
        let status = fs::read_to_string(results.join(format!("{}.status", test.name))).ok();
        let counts = parse_libtest(&log);
        outcome.passed += counts.passed;
        outcome.failed += counts.failed;
        outcome.ignored += counts.ignored;
        outcome.failed_tests.extend(counts.failed_tests.iter().map(|t| format!("{}::{t}", test.name)));
        match status.as_deref().map(str::trim) {
            None => outcome.problems.push(format!("{}: never finished", test.name)),
            Some("0") => {}
            Some("124") | Some("137") => {
                outcome.problems.push(format!("{}: timed out after {BINARY_TIMEOUT_SECS} s", test.name));
            }
            // A failing test already counts; a binary that failed without
            // one (a crash, a panic outside a test) must not pass silently.
            Some(code) if counts.failed == 0 => {
                outcome.problems.push(format!("{}: exited with {code} without a failing test", test.name));
            }
            Some(_) => {}
        }
    }
}

#[derive(Default)]
struct Counts {
    passed: u32,
    failed: u32,
    ignored: u32,
    failed_tests: Vec<String>,
}

/// Counts from libtest's output: its `test result:` lines, or, when a
/// binary died before printing one, the individual `test X ... ok` lines.
fn parse_libtest(log: &str) -> Counts {
    let mut summary = Counts::default();
    let mut seen_summary = false;
    let mut individual = Counts::default();
    let mut failed = BTreeSet::new();
    for line in log.lines() {
        if let Some(rest) = line.strip_prefix("test result: ") {
            seen_summary = true;
            for part in rest.split(';') {
                let words: Vec<&str> = part.split_whitespace().collect();
                let (Some(number), Some(what)) = (words.iter().rev().nth(1), words.last()) else { continue };
                let Ok(n) = number.parse::<u32>() else { continue };
                match *what {
                    "passed" => summary.passed += n,
                    "failed" => summary.failed += n,
                    "ignored" => summary.ignored += n,
                    _ => {}
                }
            }
        } else if let Some(rest) = line.strip_prefix("test ") {
            let Some((name, result)) = rest.rsplit_once(" ... ") else { continue };
            match result.trim() {
                "ok" => individual.passed += 1,
                "FAILED" => {
                    individual.failed += 1;
                    failed.insert(name.to_owned());
                }
                r if r.starts_with("ignored") => individual.ignored += 1,
                _ => {}
            }
        }
    }
    let mut counts = if seen_summary { summary } else { individual };
    counts.failed_tests = failed.into_iter().collect();
    counts
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
    fn libtest_counts() {
        let log = "running 2 tests\ntest a ... ok\ntest b ... FAILED\n\nfailures:\n\ntest result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.00s\n";
        let counts = parse_libtest(log);
        assert_eq!((counts.passed, counts.failed, counts.ignored), (1, 1, 0));
        assert_eq!(counts.failed_tests, ["b"]);
        // A binary that died mid-way: only the individual lines.
        let counts = parse_libtest("running 3 tests\ntest a ... ok\ntest b ... ");
        assert_eq!((counts.passed, counts.failed), (1, 0));
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
    }
}
