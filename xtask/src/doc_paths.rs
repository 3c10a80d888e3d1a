//! The docs name only paths that exist: every repository path that
//! README.md, ARCHITECTURE.md, SECURITY.md or a page under docs/ names
//! must be there, so that a file moved or renamed in the code cannot leave
//! a page pointing at nothing.
//!
//! A path is named in one of three places:
//! - inside backticks (`` `lb-user/src/health.rs` ``), from the top of the
//!   repository;
//! - as a Markdown link's target (`[testing](docs/testing.md)`), from the
//!   page that holds the link;
//! - in a file tree: a fenced block whose first line is a directory of the
//!   repository (`lb-user/src/`), each line after it an entry of that
//!   directory (a name ending in `.rs` or `/`), two spaces of indent per
//!   folder level. Any other fenced block (commands, config, JSON) is not
//!   read.
//!
//! Inside backticks, a word counts as a path when it starts with an entry
//! at the top of the repository (`lb-user`, `deploy`, `.ci`, `docs`, ...)
//! and holds a '/' or ends in a known extension. Not checked: URLs,
//! absolute paths (`/sys/fs/bpf`), build outputs under `target/`, paths
//! with a placeholder in them (`<`, `*`, `{`), and link targets that leave
//! the repository.
//!
//! The other way round, [`check`] also asks that ARCHITECTURE.md name
//! every Rust source file of the repository ([`SOURCE_ROOTS`]), so that a
//! file added to the code is placed in the picture.
//!
//! Plain string scanning, line by line: a path is expected on one line.

use std::{collections::BTreeSet, fs, path::Path};

use anyhow::{Context as _, bail};

/// The pages checked besides those under `docs/`.
const PAGES: [&str; 3] = ["README.md", "ARCHITECTURE.md", "SECURITY.md"];

/// Endings that make a word without a '/' a file name.
const EXTENSIONS: [&str; 11] =
    [".rs", ".md", ".toml", ".yaml", ".yml", ".sh", ".c", ".json", ".lock", ".dict", ".svg"];

/// Where the repository's Rust sources are: every `.rs` file under these
/// (build outputs and fuzzing corpora aside) must be named in
/// ARCHITECTURE.md.
const SOURCE_ROOTS: [&str; 7] =
    ["lb-common", "lb-ebpf", "lb-user", "tests", "xtask", "fuzz", "deploy"];

/// Characters that make a word a pattern or a placeholder, not a path.
const PLACEHOLDERS: [char; 7] = ['<', '>', '*', '{', '}', '$', '…'];

/// Checks every page: an error listing each path named that does not
/// exist, as `PAGE:LINE: PATH`.
pub fn check(workspace: &Path) -> anyhow::Result<()> {
    let mut pages = Vec::from(PAGES.map(str::to_owned));
    let docs = workspace.join("docs");
    if docs.is_dir() {
        for entry in fs::read_dir(&docs).with_context(|| format!("listing {}", docs.display()))? {
            let name = entry.context("listing docs/")?.file_name().to_string_lossy().into_owned();
            if name.ends_with(".md") {
                pages.push(format!("docs/{name}"));
            }
        }
    }
    pages.sort();

    let top = top_entries(workspace)?;
    let exists = |path: &str| workspace.join(path).exists();
    let mut missing = Vec::new();
    for page in &pages {
        let text =
            fs::read_to_string(workspace.join(page)).with_context(|| format!("reading {page}"))?;
        missing.extend(missing_paths(page, &text, &top, &exists));
    }
    if !missing.is_empty() {
        bail!("the docs name paths that do not exist:\n{}", missing.join("\n"));
    }

    let architecture =
        fs::read_to_string(workspace.join("ARCHITECTURE.md")).context("reading ARCHITECTURE.md")?;
    let named: BTreeSet<String> = named_paths("ARCHITECTURE.md", &architecture, &top)
        .into_iter()
        .map(|(_, path)| path)
        .collect();
    let mut sources = Vec::new();
    for root in SOURCE_ROOTS {
        rust_sources(workspace, Path::new(root), &mut sources)?;
    }
    sources.sort();
    let unnamed: Vec<String> = sources.into_iter().filter(|path| !named.contains(path)).collect();
    if !unnamed.is_empty() {
        bail!(
            "ARCHITECTURE.md does not name these source files (place each in its picture):\n{}",
            unnamed.join("\n")
        );
    }
    Ok(())
}

/// Every `.rs` file under `dir` (from the top of `workspace`), into
/// `found`, build outputs aside.
fn rust_sources(workspace: &Path, dir: &Path, found: &mut Vec<String>) -> anyhow::Result<()> {
    let full = workspace.join(dir);
    if !full.is_dir() {
        return Ok(());
    }
    for entry in fs::read_dir(&full).with_context(|| format!("listing {}", full.display()))? {
        let entry = entry.with_context(|| format!("listing {}", full.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = dir.join(&name);
        if entry.file_type()?.is_dir() {
            if !matches!(name.as_str(), "target" | "corpus" | "artifacts") {
                rust_sources(workspace, &path, found)?;
            }
        } else if name.ends_with(".rs") {
            found.push(path.to_string_lossy().into_owned());
        }
    }
    Ok(())
}

/// The names at the top of the repository, but build outputs and git's.
fn top_entries(workspace: &Path) -> anyhow::Result<BTreeSet<String>> {
    let mut top = BTreeSet::new();
    for entry in
        fs::read_dir(workspace).with_context(|| format!("listing {}", workspace.display()))?
    {
        let name =
            entry.context("listing the workspace")?.file_name().to_string_lossy().into_owned();
        if name != "target" && name != ".git" {
            top.insert(name);
        }
    }
    Ok(top)
}

/// Each path `text` (the page `page`) names that `exists` says is not
/// there, as `PAGE:LINE: PATH`.
fn missing_paths(
    page: &str,
    text: &str,
    top: &BTreeSet<String>,
    exists: &dyn Fn(&str) -> bool,
) -> Vec<String> {
    named_paths(page, text, top)
        .into_iter()
        .filter(|(_, path)| !exists(path))
        .map(|(line, path)| format!("{page}:{line}: {path}"))
        .collect()
}

/// Where a line of a page is.
enum Block {
    /// Running text, where backticks and links are read.
    Text,
    /// The first line of a fenced block.
    FenceStart,
    /// A fenced file tree: its root and the folders open so far.
    Tree(Vec<String>),
    /// Any other fenced block: not read.
    Other,
}

/// Every repository path `text` names, with its line (from 1), each from
/// the top of the repository.
fn named_paths(page: &str, text: &str, top: &BTreeSet<String>) -> Vec<(usize, String)> {
    let mut named = Vec::new();
    let mut block = Block::Text;
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        if line.trim_start().starts_with("```") {
            block = match block {
                Block::Text => Block::FenceStart,
                _ => Block::Text,
            };
            continue;
        }
        match &mut block {
            Block::Text => {
                for word in code_words(line) {
                    if is_repository_path(word, top) {
                        named.push((number, word.trim_end_matches('/').to_owned()));
                    }
                }
                for target in link_targets(line) {
                    if let Some(path) = from_page(page, target) {
                        named.push((number, path));
                    }
                }
            }
            Block::FenceStart => {
                let first = line.trim();
                block = if first.ends_with('/') && is_repository_path(first, top) {
                    let root = first.trim_end_matches('/').to_owned();
                    named.push((number, root.clone()));
                    Block::Tree(vec![root])
                } else {
                    Block::Other
                };
            }
            Block::Tree(folders) => {
                if let Some((depth, entry)) = tree_entry(line, folders.len() - 1) {
                    // Close the folders deeper than this entry's.
                    folders.truncate(depth + 1);
                    let name = entry.trim_end_matches('/');
                    named.push((number, format!("{}/{name}", folders.join("/"))));
                    if entry.ends_with('/') {
                        folders.push(name.to_owned());
                    }
                }
            }
            Block::Other => {}
        }
    }
    named
}

/// The words inside the line's backtick spans.
fn code_words(line: &str) -> impl Iterator<Item = &str> {
    line.split('`')
        .skip(1)
        .step_by(2)
        .flat_map(str::split_whitespace)
        .map(|word| word.trim_matches(|c: char| matches!(c, ',' | ';' | ':' | '(' | ')' | '"')))
}

/// The targets of the line's Markdown links (`[text](target)`), without
/// an anchor.
fn link_targets(line: &str) -> Vec<&str> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(start) = rest.find("](") {
        rest = &rest[start + 2..];
        let Some(end) = rest.find(')') else { break };
        let target = rest[..end].split('#').next().unwrap_or_default();
        if !target.is_empty() {
            targets.push(target);
        }
        rest = &rest[end..];
    }
    targets
}

/// Whether a word in backticks names a path of the repository.
fn is_repository_path(word: &str, top: &BTreeSet<String>) -> bool {
    let first = word.split('/').next().unwrap_or_default();
    !word.contains("://")
        && !word.contains(PLACEHOLDERS)
        && first != "target"
        && top.contains(first)
        && (word.contains('/') || EXTENSIONS.iter().any(|ext| word.ends_with(ext)))
}

/// A link's target from the top of the repository, or `None` for a URL,
/// an absolute path or a target outside the repository.
fn from_page(page: &str, target: &str) -> Option<String> {
    if target.contains("://") || target.starts_with('/') || target.starts_with("mailto:") {
        return None;
    }
    let mut parts: Vec<&str> = page.split('/').collect();
    parts.pop(); // the page's own name
    for part in target.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            part => parts.push(part),
        }
    }
    let path = parts.join("/");
    (!path.starts_with("target/") && !path.contains(PLACEHOLDERS)).then_some(path)
}

/// A file tree's line: its depth (two spaces a level, at most `deepest`,
/// the depth of the last folder opened) and its entry (a name ending in
/// `.rs` or `/`), or `None` for a line that describes the entry above it.
fn tree_entry(line: &str, deepest: usize) -> Option<(usize, &str)> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    let entry = line.split_whitespace().next()?;
    let is_entry = entry.ends_with(".rs") || entry.ends_with('/');
    (indent.is_multiple_of(2) && indent / 2 <= deepest && is_entry && !entry.contains(PLACEHOLDERS))
        .then_some((indent / 2, entry))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn top() -> BTreeSet<String> {
        ["lb-user", "docs", "deploy", ".ci", "README.md", "target"]
            .into_iter()
            .map(str::to_owned)
            .collect()
    }

    /// What `missing_paths` reports on `text` (the page `page`) in a
    /// repository that holds exactly `files`.
    fn missing(page: &str, text: &str, files: &[&str]) -> Vec<String> {
        let exists = |path: &str| {
            files.iter().any(|file| *file == path || file.starts_with(&format!("{path}/")))
        };
        missing_paths(page, text, &top(), &exists)
    }

    #[test]
    fn a_named_path_that_exists_passes() {
        let text = "The checks are in `lb-user/src/health.rs`; see `deploy/`.\n";
        assert_eq!(
            missing("README.md", text, &["lb-user/src/health.rs", "deploy/lb.service"]),
            Vec::<String>::new()
        );
    }

    #[test]
    fn a_named_path_that_does_not_exist_is_reported_with_its_page_and_line() {
        let text = "# Title\n\nSee `lb-user/src/control.rs` and `.ci/run`.\n";
        assert_eq!(
            missing("SECURITY.md", text, &[".ci/run"]),
            ["SECURITY.md:3: lb-user/src/control.rs"]
        );
    }

    #[test]
    fn links_are_read_from_their_page() {
        let text = "[testing](testing.md), [the map](../ARCHITECTURE.md), [gone](old.md#top)\n";
        let files = ["docs/testing.md", "ARCHITECTURE.md"];
        assert_eq!(missing("docs/external.md", text, &files), ["docs/external.md:1: docs/old.md"]);
    }

    #[test]
    fn urls_absolute_paths_outputs_and_other_words_are_ignored() {
        let text = "\
`/sys/fs/bpf/lb` and `/run/lb/lb.sock`; [site](https://example.com/lb-user/x.rs);
`target/bench/report.md`; `links/xdp-<mode>/<interface>`; `lb-user/src/*.rs`;
`lb run --config FILE`; `lb-user`; `state_dir/servers.json`; [up](../../elsewhere.md)
";
        assert_eq!(missing("README.md", text, &[]), Vec::<String>::new());
    }

    #[test]
    fn fenced_blocks_are_read_only_when_they_are_file_trees() {
        let text = "\
```toml
servers = [\"lb-user/src/nothing.rs\"]
```
```
lb-user/src/
main.rs        the entry point
daemon/        the daemon
  mod.rs       its loop, described at length
               over two lines, ending in gone.rs
  gone.rs      no longer there
health.rs      checks
```
";
        let files = ["lb-user/src/main.rs", "lb-user/src/daemon/mod.rs", "lb-user/src/health.rs"];
        assert_eq!(
            missing("ARCHITECTURE.md", text, &files),
            ["ARCHITECTURE.md:10: lb-user/src/daemon/gone.rs"]
        );
    }

    /// The other way round: a source file must be named in ARCHITECTURE.md.
    #[test]
    fn a_source_file_that_architecture_does_not_name_is_reported() {
        let workspace = std::env::temp_dir().join(format!("lb-doc-paths-{}", std::process::id()));
        let src = workspace.join("lb-user/src");
        fs::create_dir_all(&src).unwrap();
        for file in ["lib.rs", "health.rs"] {
            fs::write(src.join(file), "").unwrap();
        }
        for page in PAGES {
            fs::write(workspace.join(page), "").unwrap();
        }
        fs::write(workspace.join("ARCHITECTURE.md"), "```\nlb-user/src/\nlib.rs\n```\n").unwrap();
        let error = check(&workspace).unwrap_err().to_string();
        fs::write(workspace.join("ARCHITECTURE.md"), "```\nlb-user/src/\nlib.rs\nhealth.rs\n```\n")
            .unwrap();
        let named = check(&workspace);
        fs::remove_dir_all(&workspace).unwrap();
        assert!(error.contains("lb-user/src/health.rs"), "{error}");
        assert!(!error.contains("lib.rs"), "{error}");
        named.unwrap();
    }
}
