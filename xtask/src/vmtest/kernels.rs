//! The kernels to boot: which ones were asked for, and getting each one
//! ready (a Debian release's generic kernel fetched with a private apt
//! configuration, or a `--kernel` file), unpacked but never installed.

use std::{
    fmt, fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::cmd::{output_of, run_cmd};

/// Used when the machine's own sources name no Debian mirror.
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
const DEBIAN_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// A Debian release whose generic kernel can be tested (`--release`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Release {
    /// Debian 11, Linux 5.10: the oldest kernel lb supports.
    Bullseye,
    /// Debian 12, Linux 6.1.
    Bookworm,
    /// Debian 13, Linux 6.12.
    Trixie,
}

impl Release {
    /// Every release, oldest first: what `cargo xtask vmtest` tests by default.
    pub const ALL: [Self; 3] = [Self::Bullseye, Self::Bookworm, Self::Trixie];

    /// The suite's name in Debian's archive, also the name of its
    /// directories under `target/vmtest/`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bullseye => "bullseye",
            Self::Bookworm => "bookworm",
            Self::Trixie => "trixie",
        }
    }

    /// The Linux version its generic kernel has.
    pub fn linux(self) -> &'static str {
        match self {
            Self::Bullseye => "5.10",
            Self::Bookworm => "6.1",
            Self::Trixie => "6.12",
        }
    }
}

impl fmt::Display for Release {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A kernel asked for: a release name and a file path are kept apart, so a
/// file that happens to be called `trixie` is never mistaken for the
/// release, nor the release for a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelSpec {
    /// The generic kernel of a Debian release (`--release`).
    Release(Release),
    /// A kernel package (`.deb`) or image (`vmlinuz`) (`--kernel`).
    File(PathBuf),
}

impl KernelSpec {
    /// A `--kernel` argument: it must name an existing file. A missing one
    /// that is spelled like a release says where the release goes instead.
    pub fn file(path: PathBuf) -> anyhow::Result<Self> {
        if path.is_file() {
            return Ok(Self::File(path));
        }
        let hint = Release::ALL
            .iter()
            .find(|release| path.as_os_str() == release.name())
            .map(|release| format!(" (for Debian's {release} kernel, use --release {release})"))
            .unwrap_or_default();
        bail!("--kernel {}: no such file{hint}", path.display());
    }

    /// A short name for messages and directory names.
    pub fn name(&self) -> String {
        match self {
            Self::Release(release) => release.name().to_owned(),
            Self::File(path) => kernel_name(path),
        }
    }

    /// Gets the kernel ready to boot: fetched, unpacked, its version read.
    pub fn prepare(&self, base: &Path) -> anyhow::Result<Kernel> {
        match self {
            Self::Release(release) => debian_kernel(base, *release),
            Self::File(path) => file_kernel(base, path),
        }
    }
}

/// A kernel ready to boot.
pub struct Kernel {
    /// Short name: the Debian release, or derived from the `--kernel` path.
    pub name: String,
    pub vmlinuz: PathBuf,
    pub version: String,
    /// Whether an unpacked package with modules comes with it (virtme-ng
    /// finds `lib/modules/<version>` next to `boot/` by itself).
    pub has_modules: bool,
    pub fetch_time: Duration,
}

/// Debian's generic kernel of `release`, downloaded and unpacked once.
fn debian_kernel(base: &Path, release: Release) -> anyhow::Result<Kernel> {
    let started = Instant::now();
    let root = base.join("kernels").join(release.name());
    if !root.exists() {
        fetch_debian_kernel(base, release, &root).with_context(|| {
            format!("fetching the kernel of Debian {release} (Linux {})", release.linux())
        })?;
    }
    let mut kernel = unpacked_kernel(release.name(), &root)?;
    kernel.fetch_time = started.elapsed();
    Ok(kernel)
}

/// Resolves `linux-image-amd64` of `release` to the versioned package with
/// a private apt configuration, downloads it and unpacks it into `root`.
fn fetch_debian_kernel(base: &Path, release: Release, root: &Path) -> anyhow::Result<()> {
    let apt_dir = base.join("apt").join(release.name());
    let lists = apt_dir.join("lists");
    let cache = apt_dir.join("cache");
    let debs = apt_dir.join("debs");
    for dir in [lists.join("partial"), cache.join("archives/partial"), debs.clone()] {
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let sources = apt_dir.join("sources.list");
    let signed_by = if Path::new(DEBIAN_KEYRING).exists() {
        format!("[signed-by={DEBIAN_KEYRING}] ")
    } else {
        String::new()
    };
    fs::write(
        &sources,
        format!(
            "# Written by `cargo xtask vmtest`.\ndeb {signed_by}{} {release} main\n",
            debian_mirror()
        ),
    )
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
    let package = kernel_package(&text).with_context(|| {
        format!("linux-image-amd64 of {release} depends on no linux-image-<version>:\n{text}")
    })?;

    println!("downloading {package}");
    run_cmd(apt("apt-get").args(["download", "-qq", &package]).current_dir(&debs))?;
    let prefix = format!("{package}_");
    let deb = fs::read_dir(&debs)
        .with_context(|| format!("listing {}", debs.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&prefix)))
        .with_context(|| {
            format!("apt-get download {package} left no .deb in {}", debs.display())
        })?;
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
        files.extend(
            more.into_iter()
                .filter(|p| p.extension().is_some_and(|e| e == "list" || e == "sources")),
        );
    }
    for text in files.iter().filter_map(|file| fs::read_to_string(file).ok()) {
        for line in text.lines().filter(|line| !line.trim_start().starts_with('#')) {
            // One-line (`deb [opts] URI suite ...`) and deb822 (`URIs: URI`)
            // formats both have the URI as a word of its own.
            if let Some(uri) = line.split_whitespace().find(|word| {
                (word.starts_with("http://") || word.starts_with("https://"))
                    && word.trim_end_matches('/').ends_with("/debian")
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
                fs::remove_dir_all(&root)
                    .with_context(|| format!("removing {}", root.display()))?;
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
    let file =
        path.file_name().map_or_else(|| "kernel".to_owned(), |s| s.to_string_lossy().into_owned());
    let stem = file.strip_suffix(".deb").unwrap_or(&file);
    // linux-image-6.1.0-37-amd64_6.1.140-1_amd64 -> 6.1.0-37-amd64
    let stem = stem.split('_').next().unwrap_or(stem);
    let stem =
        stem.strip_prefix("linux-image-").or_else(|| stem.strip_prefix("vmlinuz-")).unwrap_or(stem);
    stem.chars()
        .map(|c| if c.is_ascii_alphanumeric() || "-.+".contains(c) { c } else { '_' })
        .collect()
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
    let kernel = unpacked_kernel("", &partial)
        .with_context(|| format!("{} holds no kernel", deb.display()))?;
    if let Some(modules) = modules_dir(&partial, &kernel.version) {
        // Both depmod -b and virtme-ng look for <root>/lib/modules; newer
        // packages ship usr/lib/modules only.
        let lib_modules = partial.join("lib/modules");
        if !lib_modules.exists() {
            fs::create_dir_all(partial.join("lib"))
                .with_context(|| format!("creating {}/lib", partial.display()))?;
            std::os::unix::fs::symlink("../usr/lib/modules", &lib_modules)
                .with_context(|| format!("linking {}", lib_modules.display()))?;
        }
        run_cmd(Command::new("depmod").arg("-b").arg(&partial).arg(&kernel.version))
            .with_context(|| format!("depmod for {}", modules.display()))?;
    }
    fs::rename(&partial, root)
        .with_context(|| format!("renaming {} to {}", partial.display(), root.display()))?;
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
    let version = vmlinuz
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .trim_start_matches("vmlinuz-")
        .to_owned();
    let has_modules = modules_dir(root, &version).is_some();
    Ok(Kernel { name: name.to_owned(), vmlinuz, version, has_modules, fetch_time: Duration::ZERO })
}

fn modules_dir(root: &Path, version: &str) -> Option<PathBuf> {
    ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|dir| root.join(dir).join(version))
        .find(|dir| dir.is_dir())
}

/// The release string of an x86 bzImage, from its setup header
/// (`kernel_version` at 0x20e points to a string at 0x200 + value).
fn bzimage_version(path: &Path) -> anyhow::Result<String> {
    let image = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    if image.get(0x202..0x206) != Some(b"HdrS") {
        bail!(
            "{} is neither a .deb nor an x86 kernel image (no HdrS setup header)",
            path.display()
        );
    }
    let pointer = image
        .get(0x20e..0x210)
        .with_context(|| format!("{}: truncated setup header", path.display()))?;
    let offset = usize::from(u16::from_le_bytes([pointer[0], pointer[1]])) + 0x200;
    let text = image
        .get(offset..)
        .with_context(|| format!("{}: kernel_version points past the end", path.display()))?;
    let end = text.iter().take(256).position(|&b| b == 0 || b == b' ').unwrap_or(0);
    if end == 0 {
        bail!("{}: no kernel version in the setup header", path.display());
    }
    Ok(String::from_utf8_lossy(&text[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_package_from_apt_cache() {
        let text = "linux-image-amd64\n  Depends: linux-image-6.1.0-37-amd64\n  Depends: foo\n";
        assert_eq!(kernel_package(text).as_deref(), Some("linux-image-6.1.0-37-amd64"));
        assert_eq!(
            kernel_package("linux-image-amd64\n  Depends: linux-image-amd64-signed\n"),
            None
        );
    }

    #[test]
    fn kernel_names() {
        assert_eq!(
            kernel_name(Path::new("/x/linux-image-6.1.0-37-amd64_6.1.140-1_amd64.deb")),
            "6.1.0-37-amd64"
        );
        assert_eq!(kernel_name(Path::new("/boot/vmlinuz-6.12.4")), "6.12.4");
        assert_eq!(KernelSpec::Release(Release::Bookworm).name(), "bookworm");
    }

    #[test]
    fn a_kernel_file_must_exist() {
        let missing = KernelSpec::file(PathBuf::from("/no/such/vmlinuz")).unwrap_err().to_string();
        assert_eq!(missing, "--kernel /no/such/vmlinuz: no such file");
        // A release name given as a file is a missing file, with a pointer
        // to the flag that means the release.
        let release = KernelSpec::file(PathBuf::from("trixie")).unwrap_err().to_string();
        assert!(release.contains("use --release trixie"), "{release}");
        // A directory is no kernel file either.
        assert!(KernelSpec::file(std::env::temp_dir()).is_err());
    }

    #[test]
    fn release_names_and_versions() {
        let names: Vec<String> =
            Release::ALL.iter().map(|r| format!("{r} {}", r.linux())).collect();
        assert_eq!(names, ["bullseye 5.10", "bookworm 6.1", "trixie 6.12"]);
        // clap's spelling of each release is its archive name.
        for release in Release::ALL {
            let value = clap::ValueEnum::to_possible_value(&release).unwrap();
            assert_eq!(value.get_name(), release.name());
        }
    }

    #[test]
    fn not_a_kernel_image() {
        let file = std::env::temp_dir().join(format!("vmtest-not-a-kernel-{}", std::process::id()));
        fs::write(&file, b"short").unwrap();
        assert!(bzimage_version(&file).is_err());
        let _ = fs::remove_file(&file);
    }
}
