//! A reload's parse: only the `[[service]]` tables whose text changed.
//!
//! With 10,000 services the file is 1.2 MB. Parsing it whole takes about
//! 100 ms in the daemon, most of it `toml`'s ~50 MB of temporaries being
//! faulted in and given back (the daemon returns freed memory to stay
//! small). A reload usually changes one service. [`Source::reload`]
//! compares the new text with the text the running config was read from,
//! parses only the tables from the first to the last changed byte, and
//! takes every other service from the running config: its text is the
//! same, so it reads the same.
//!
//! This is a shortcut, never a second parser. Whenever it cannot be sure
//! that the whole file reads to the config it would build, the file is
//! parsed whole, which also names any problem. It gives up when:
//! - the change reaches outside the service tables (`[daemon]`, text
//!   before the first service);
//! - the changed text is not whole tables: it must start with a plain
//!   `[[service]]` header and end with a line;
//! - the changed text holds anything but `[[service]]` tables, or any of
//!   its services has a problem;
//! - the services together break a rule about more than one (names and
//!   VIPs unique, no server another's VIP, at most `MAX_SERVICES`).
//!
//! Why a text on its own reads as it does in place: the unchanged text
//! before it ended, when it was last parsed, where a header began, so at
//! the top level of the grammar; the changed text starts with a header
//! (its keys belong to its own tables) and parses on its own, so it ends at
//! the top level too, at a line's end; the unchanged text after it starts
//! with a header, as it did. A property test below holds the shortcut to
//! the whole parse on random edits.

use std::{collections::HashSet, fmt, path::Path};

use lb_common::MAX_SERVICES;
use serde::Deserialize;
use toml::Spanned;

use super::{
    Config, ConfigError, Daemon, Service, check_servers,
    external_service::mixed_elections,
    parse::{Lines, read_services},
    raw::RawService,
    read_text,
};

/// The text a config was read from, and where each of its services'
/// `[[service]]` headers starts in it: what [`Source::reload`] compares a
/// changed file with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    text: String,
    starts: Vec<usize>,
}

/// How much of the file a reload parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Read {
    /// The whole file.
    Whole,
    /// Only this many service tables (0: the text had not changed).
    Tables(usize),
}

/// As the `tables_parsed` of a reload's log line: `all`, or a number.
impl fmt::Display for Read {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Whole => f.write_str("all"),
            Self::Tables(n) => write!(f, "{n}"),
        }
    }
}

/// A changed stretch of a file, read on its own: service tables only.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Tables {
    #[serde(default)]
    service: Vec<Spanned<RawService>>,
}

impl Source {
    /// Reads and validates `path` whole ([`Config::parse`]).
    pub fn load(path: &Path) -> Result<(Config, Self), ConfigError> {
        let text = read_text(path)?;
        Self::parse(text, path)
    }

    /// Parses and validates `text` whole; `path` only names the file in
    /// errors.
    pub fn parse(text: String, path: &Path) -> Result<(Config, Self), ConfigError> {
        let (config, starts) = Config::parse_tables(&text, path)?;
        Ok((config, Self { text, starts }))
    }

    /// Reads `path` again, for a reload: the config it holds now, what to
    /// compare the next reload with, and how much was parsed. `settings`
    /// and `running` are what this source was read into: its `[daemon]`
    /// settings and its services, in file order.
    pub fn reload(
        &self,
        path: &Path,
        settings: &Daemon,
        running: &[&Service],
    ) -> Result<(Config, Self, Read), ConfigError> {
        let text = read_text(path)?;
        self.reread(text, path, settings, running)
    }

    /// [`Source::reload`] of the file's new `text`.
    pub fn reread(
        &self,
        text: String,
        path: &Path,
        settings: &Daemon,
        running: &[&Service],
    ) -> Result<(Config, Self, Read), ConfigError> {
        // The shortcut reads only service tables: the settings are as they
        // were.
        if let Some((services, starts, tables)) = self.reparse(&text, settings, running) {
            let config = Config { daemon: settings.clone(), services };
            return Ok((config, Self { text, starts }, Read::Tables(tables)));
        }
        let (config, source) = Self::parse(text, path)?;
        Ok((config, source, Read::Whole))
    }

    /// Makes the next [`Source::reload`] parse the whole file: for after a
    /// reload that failed, which may have applied part of its change (the
    /// running services are then no longer what this text reads to).
    pub fn forget(&mut self) {
        self.text.clear();
        self.starts.clear();
    }

    /// The services of `text` (this source's text, changed), where their
    /// headers start, and how many tables were parsed; `None` when the
    /// changed text cannot be read on its own (see the module's comment).
    fn reparse(
        &self,
        text: &str,
        settings: &Daemon,
        running: &[&Service],
    ) -> Option<(Vec<Service>, Vec<usize>, usize)> {
        if running.len() != self.starts.len() {
            return None;
        }
        let (old, new) = (self.text.as_bytes(), text.as_bytes());
        if old == new {
            let services = running.iter().map(|&s| s.clone()).collect();
            return Some((services, self.starts.clone(), 0));
        }
        let same_start = old.iter().zip(new).take_while(|(a, b)| a == b).count();
        let same_end = old.iter().rev().zip(new.iter().rev()).take_while(|(a, b)| a == b).count();
        let same_end = same_end.min(old.len().min(new.len()) - same_start);
        // The tables the change touches: from the last one to start before
        // the first changed byte (a change right at a header may be the end
        // of the table before) up to the first one to start in the
        // unchanged end.
        let first = self.starts.partition_point(|&s| s < same_start).checked_sub(1)?;
        let after = self.starts.partition_point(|&s| s < old.len() - same_end);
        let from = self.starts[first];
        // Where the unchanged end starts in each text: an offset at or past
        // `old.len() - same_end` moves by the difference in length.
        let moved = |at: usize| at + new.len() - old.len();
        let to = moved(self.starts.get(after).copied().unwrap_or(old.len()));
        let changed = text.get(from..to)?;
        let whole_tables = changed.starts_with("[[service]]") && changed.ends_with('\n');
        if !(changed.is_empty() || whole_tables) {
            return None;
        }
        let tables: Tables = toml::from_str(changed).ok()?;
        let mut problems = Vec::new();
        let by_default = settings.membership.by_default;
        let (read, read_starts) =
            read_services(tables.service, &Lines::of(changed), by_default, &mut problems);
        if !problems.is_empty() {
            return None;
        }
        let count = read.len();
        let services: Vec<Service> = running[..first]
            .iter()
            .map(|&s| s.clone())
            .chain(read)
            .chain(running[after..].iter().map(|&s| s.clone()))
            .collect();
        if clash(&services) {
            return None;
        }
        let starts = self.starts[..first]
            .iter()
            .copied()
            .chain(read_starts.iter().map(|s| from + s))
            .chain(self.starts[after..].iter().map(|&s| moved(s)))
            .collect();
        Some((services, starts, count))
    }
}

/// Whether `services` break a rule about more than one of them: names and
/// VIPs are unique, no server is a VIP, at most [`MAX_SERVICES`]. (The
/// rules about one service held when its table was read.)
fn clash(services: &[Service]) -> bool {
    if services.len() > MAX_SERVICES as usize {
        return true;
    }
    let mut names = HashSet::with_capacity(services.len());
    let mut vips = HashSet::with_capacity(services.len());
    if !services.iter().all(|s| names.insert(s.name.as_str()) && vips.insert(s.vip)) {
        return true;
    }
    let owner = |addr| vips.contains(&addr).then(String::new);
    services.iter().any(|s| !check_servers(s.vip, &s.servers, s.default, owner).is_empty())
        || !mixed_elections(services).is_empty()
}

#[cfg(test)]
mod tests {
    use proptest::{prelude::*, sample::Index};

    use super::*;

    const DAEMON: &str = "[daemon]\ncgroup = \"/sys/fs/cgroup/unified/lb-test\"\n\n";

    fn service(i: usize, server: &str) -> String {
        format!(
            "[[service]]\nname = \"svc-{i}\"\nvip = \"127.0.{}.{}:80\"\nservers = [\"{server}\"]\n[service.health]\ncheck = \"none\"\n\n",
            i / 250,
            i % 250 + 1
        )
    }

    fn file(n: usize, moved: Option<(usize, &str)>) -> String {
        let services = (0..n).map(|i| match moved {
            Some((at, server)) if at == i => service(i, server),
            _ => service(i, &format!("127.1.0.{}:80", i % 250 + 1)),
        });
        std::iter::once(DAEMON.to_owned()).chain(services).collect()
    }

    fn source(text: &str) -> (Config, Source) {
        Source::parse(text.to_owned(), Path::new("test.toml")).expect("the old text parses")
    }

    /// The shortcut's reading of `new` (after `old`), checked against the
    /// whole parse of `new` whenever it gives one.
    fn reread(old: &str, new: &str) -> Option<usize> {
        let (config, source) = source(old);
        let running: Vec<&Service> = config.services.iter().collect();
        let (services, starts, tables) = source.reparse(new, &config.daemon, &running)?;
        let (whole, whole_source) = Source::parse(new.to_owned(), Path::new("test.toml"))
            .unwrap_or_else(|e| panic!("the shortcut read a file the whole parse rejects: {e}"));
        assert_eq!(services, whole.services);
        assert_eq!(starts, whole_source.starts);
        // The shortcut keeps the running settings: it must not answer when
        // they changed.
        assert_eq!(config.daemon, whole.daemon);
        Some(tables)
    }

    #[test]
    fn one_changed_service_is_the_one_table_parsed() {
        let old = file(100, None);
        assert_eq!(reread(&old, &old), Some(0));
        assert_eq!(reread(&old, &file(100, Some((50, "127.9.9.9:80")))), Some(1));
        assert_eq!(reread(&old, &file(100, Some((0, "127.9.9.9:80")))), Some(1));
        assert_eq!(reread(&old, &file(100, Some((99, "127.9.9.9:80")))), Some(1));
        // Added at the end, removed from the middle, a comment between two.
        assert!(reread(&old, &file(101, None)).is_some());
        assert!(reread(&old, &old.replacen(&service(7, "127.1.0.8:80"), "", 1)).is_some());
        let commented = old.replacen(
            "[[service]]\nname = \"svc-3\"",
            "# three\n[[service]]\nname = \"svc-3\"",
            1,
        );
        assert!(reread(&old, &commented).is_some());
    }

    #[test]
    fn the_whole_file_is_parsed_when_the_change_is_not_whole_service_tables() {
        let old = file(10, None);
        let cases = [
            // The daemon's settings.
            old.replace("lb-test", "lb-other"),
            // A table that is not a service, among the services.
            old.replacen(
                "[[service]]\nname = \"svc-4\"",
                "[daemon]\n[[service]]\nname = \"svc-4\"",
                1,
            ),
            // A header the shortcut does not recognise.
            old.replacen("[[service]]\nname = \"svc-4\"", "[[ service ]]\nname = \"svc-4\"", 1),
            // A string opened and not closed in the changed table.
            old.replacen(
                "check = \"none\"\n\n[[service]]\nname = \"svc-5\"",
                "check = \"\"\"none\"\n\n[[service]]\nname = \"svc-5\"",
                1,
            ),
        ];
        for new in &cases {
            assert_eq!(reread(&old, new), None, "{new}");
        }
    }

    #[test]
    fn a_change_that_clashes_with_an_unchanged_service_is_left_to_the_whole_parse() {
        let old = file(10, None);
        // svc-2 takes svc-8's name; svc-3's VIP; svc-5's VIP as a server.
        for new in [
            old.replacen("\"svc-2\"", "\"svc-8\"", 1),
            old.replacen("vip = \"127.0.0.3:80\"", "vip = \"127.0.0.4:80\"", 1),
            file(10, Some((2, "127.0.0.6:80"))),
        ] {
            assert_eq!(reread(&old, &new), None);
            Source::parse(new, Path::new("test.toml"))
                .expect_err("the whole parse names the clash");
        }
    }

    /// A service table from a small vocabulary, so that random files often
    /// clash: names and VIPs from 12, a server sometimes one of the VIPs.
    #[derive(Clone, Debug)]
    struct Table {
        name: u8,
        vip: u8,
        server: u8,
        health: u8,
    }

    impl Table {
        fn text(&self) -> String {
            let server = match self.server {
                s @ 0..3 => format!("127.0.0.{}:80", s + 1),
                12 => "no address".to_owned(),
                s => format!("127.0.1.{s}:80"),
            };
            let mut t = format!(
                "[[service]]\nname = \"svc-{}\"\nvip = \"127.0.0.{}:80\"\nservers = [\"{server}\"]\n",
                self.name,
                self.vip + 1
            );
            t += match self.health {
                0 => "",
                1 => "health = { check = \"none\" }\n",
                2 => "[service.health]\ncheck = \"none\"\n",
                _ => "# a comment\n[service.health]\ncheck = \"tcp\"\ninterval = \"3s\"\n",
            };
            t + "\n"
        }
    }

    fn table() -> impl Strategy<Value = Table> {
        (0..12u8, 0..12u8, 0..13u8, 0..4u8).prop_map(|(name, vip, server, health)| Table {
            name,
            vip,
            server,
            health,
        })
    }

    /// Bits of text that, spliced in anywhere, make a file the shortcut
    /// must not misread.
    const SPLICES: &[&str] = &[
        "[[service]]\n",
        "\n",
        "# x\n",
        "\"\"\"",
        "'''\n",
        "[daemon]\n",
        "[service.health]\n",
        "name = \"svc-1\"\n",
        "policy = \"spread\"\n",
        "]",
        "servers = [\"127.0.1.9:80\"]\n",
    ];

    fn render(tables: &[Table], daemon_last: bool) -> String {
        let services: String = tables.iter().map(Table::text).collect();
        if daemon_last { services + DAEMON } else { DAEMON.to_owned() + &services }
    }

    proptest! {
        /// Whatever the edit, the shortcut either declines or reads the
        /// file as the whole parse does (same services, same starts).
        #[test]
        fn the_shortcut_reads_what_the_whole_parse_reads(
            old in proptest::collection::vec(table(), 1..7),
            edits in proptest::collection::vec((0..4u8, any::<Index>(), table()), 0..3),
            splice in proptest::option::of((any::<Index>(), 0..SPLICES.len())),
            daemon_last in any::<bool>(),
        ) {
            let old_text = render(&old, daemon_last);
            if Config::parse(&old_text, Path::new("test.toml")).is_err() {
                return Ok(());
            }
            let mut new = old.clone();
            for (op, at, table) in edits {
                let i = at.index(new.len() + 1);
                match op {
                    0 if i < new.len() => new[i] = table,
                    1 => new.insert(i, table),
                    2 if i < new.len() => { new.remove(i); }
                    _ if i + 1 < new.len() => new.swap(i, i + 1),
                    _ => {}
                }
            }
            let mut new_text = render(&new, daemon_last);
            if let Some((at, splice)) = splice {
                new_text.insert_str(at.index(new_text.len() + 1), SPLICES[splice]);
            }
            reread(&old_text, &new_text);
        }
    }
}
