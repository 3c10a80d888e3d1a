//! What is wrong with a config file, and how it is worded: each
//! [`Problem`] at its line and key, all of a file's in one [`ConfigError`]
//! (`FILE:LINE: KEY: WHAT`).

use std::{
    fmt,
    path::{Path, PathBuf},
};

/// One thing wrong with a config file: where (line, when known) and under
/// which key, and what. Collected while parsing and rendered once, by
/// [`ConfigError`], as `FILE:LINE: KEY: WHAT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// 1-based line of the value, when the parser knows it.
    pub line: Option<usize>,
    /// The key, e.g. `service[0] ("api"): servers[1]`; empty for the file
    /// as a whole.
    pub key: String,
    /// What is wrong, and what would be right.
    pub what: String,
}

impl Problem {
    pub(super) fn new(
        line: Option<usize>,
        key: impl fmt::Display,
        what: impl fmt::Display,
    ) -> Self {
        Self { line, key: key.to_string(), what: what.to_string() }
    }
}

/// A [`Problem`]'s key (`service[3] ("api"): health.interval`,
/// `daemon.metrics`), kept as its parts and written out only for a problem:
/// almost every value has none, and a config may hold 16,384 services.
#[derive(Clone, Copy)]
pub(super) struct Key<'a> {
    /// The service's index and name, if the key is in one.
    service: Option<(usize, &'a str)>,
    /// The table, with its dot (`health.`), or "".
    table: &'a str,
    name: &'a str,
    /// The element, in a list (`servers[2]`).
    index: Option<usize>,
}

impl<'a> Key<'a> {
    /// A key outside services (`daemon.metrics`).
    pub(super) const fn top(name: &'a str) -> Self {
        Self { service: None, table: "", name, index: None }
    }

    /// The `i`th service, named `name`.
    pub(super) const fn service(i: usize, name: &'a str) -> Self {
        Self { service: Some((i, name)), table: "", name: "", index: None }
    }

    /// Key `name`, in this key's service and table.
    pub(super) const fn at(self, name: &'a str) -> Self {
        Self { name, index: None, ..self }
    }

    /// The keys of `table` (with its dot), in this key's service.
    pub(super) const fn table(self, table: &'a str) -> Self {
        Self { table, name: "", index: None, ..self }
    }

    /// Element `index` of this key's list.
    pub(super) const fn nth(self, index: usize) -> Self {
        Self { index: Some(index), ..self }
    }
}

impl fmt::Display for Key<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((i, name)) = self.service {
            write!(f, "service[{i}] ({name:?})")?;
            if self.table.is_empty() && self.name.is_empty() {
                return Ok(());
            }
            f.write_str(": ")?;
        }
        write!(f, "{}{}", self.table, self.name)?;
        if let Some(index) = self.index {
            write!(f, "[{index}]")?;
        }
        Ok(())
    }
}

/// A configuration error: one or more problems in one file.
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    /// The config file.
    pub file: PathBuf,
    /// Everything wrong with it, in the file's order.
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let file = self.file.display();
        for (i, Problem { line, key, what }) in self.problems.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            match line {
                Some(line) => write!(f, "{file}:{line}: ")?,
                None => write!(f, "{file}: ")?,
            }
            if !key.is_empty() {
                write!(f, "{key}: ")?;
            }
            f.write_str(what)?;
        }
        Ok(())
    }
}

impl ConfigError {
    pub(super) fn unreadable(path: &Path, error: &std::io::Error) -> Self {
        Self {
            file: path.to_owned(),
            problems: vec![Problem::new(None, "", format!("cannot read the config file: {error}"))],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_read_as_written() {
        let service = Key::service(3, "api");
        assert_eq!(service.to_string(), "service[3] (\"api\")");
        assert_eq!(service.at("servers").nth(2).to_string(), "service[3] (\"api\"): servers[2]");
        assert_eq!(
            service.table("health.").at("interval").to_string(),
            "service[3] (\"api\"): health.interval"
        );
        assert_eq!(Key::top("daemon.metrics").to_string(), "daemon.metrics");
    }
}
