//! The paths a client command needs from the config file, read leniently.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{
    ConfigError,
    model::{DEFAULT_BPFFS, DEFAULT_CONTROL_SOCKET, DEFAULT_STATE_DIR},
    read_text,
};

/// The paths a client subcommand needs (control socket, pins), read
/// leniently: `lb reload` and `lb detach` must work even when the file on
/// disk has just been broken (that is when an operator needs them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientPaths {
    /// `daemon.control_socket`, or its default.
    pub control_socket: PathBuf,
    /// `daemon.bpffs`, or its default.
    pub bpffs: PathBuf,
    /// `daemon.state_dir`, or its default (where BIRD's socket is).
    pub state_dir: PathBuf,
}

impl ClientPaths {
    /// Reads them from the config file at `path`: only an unreadable file
    /// is an error; anything unparsable gives the defaults.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Ok(Self::of_text(&read_text(path)?))
    }

    /// The `[daemon]` table usually comes first: then only the text before
    /// the first line that opens an array of tables (`[[service]]`) is
    /// parsed, so that a client command against 10,000 services does not
    /// wait for the whole file. A head that does not parse (the cut fell
    /// inside a multi-line value) or has no `[daemon]` falls back to the
    /// whole file.
    fn of_text(text: &str) -> Self {
        let services_start = text
            .match_indices('\n')
            .map(|(i, _)| i + 1)
            .find(|&start| text[start..].trim_start_matches([' ', '\t']).starts_with("[["));
        if let Some(head) = services_start.map(|end| &text[..end])
            && let Some(paths) = Self::of_document(head)
        {
            return paths;
        }
        Self::of_document(text).unwrap_or_else(|| Self::of_values(None, None, None))
    }

    /// The paths of a TOML document with a `[daemon]` table; only the two
    /// keys are read into values (the rest is parsed, not built).
    fn of_document(text: &str) -> Option<Self> {
        #[derive(Deserialize)]
        struct File {
            daemon: Option<Paths>,
        }
        // Values, not paths: a key of the wrong type gives its default
        // without losing the other.
        #[derive(Deserialize)]
        struct Paths {
            control_socket: Option<toml::Value>,
            bpffs: Option<toml::Value>,
            state_dir: Option<toml::Value>,
        }
        let paths = toml::from_str::<File>(text).ok()?.daemon?;
        Some(Self::of_values(paths.control_socket, paths.bpffs, paths.state_dir))
    }

    /// The strings given, each defaulted when missing or not a string.
    fn of_values(
        control_socket: Option<toml::Value>,
        bpffs: Option<toml::Value>,
        state_dir: Option<toml::Value>,
    ) -> Self {
        let get = |value: Option<toml::Value>, default: &str| {
            PathBuf::from(value.as_ref().and_then(toml::Value::as_str).unwrap_or(default))
        };
        Self {
            control_socket: get(control_socket, DEFAULT_CONTROL_SOCKET),
            bpffs: get(bpffs, DEFAULT_BPFFS),
            state_dir: get(state_dir, DEFAULT_STATE_DIR),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_paths_survive_a_broken_config() {
        let dir = std::env::temp_dir().join(format!("lb-client-paths-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.toml");
        std::fs::write(
            &path,
            "[daemon]\ncontrol_socket = \"/tmp/x.sock\"\n[[service]]\npolcy = 1\n",
        )
        .unwrap();
        let paths = ClientPaths::load(&path).unwrap();
        assert_eq!(
            paths,
            ClientPaths {
                control_socket: "/tmp/x.sock".into(),
                bpffs: DEFAULT_BPFFS.into(),
                state_dir: DEFAULT_STATE_DIR.into()
            }
        );
        std::fs::remove_dir_all(&dir).unwrap();

        let defaults = ClientPaths {
            control_socket: DEFAULT_CONTROL_SOCKET.into(),
            bpffs: DEFAULT_BPFFS.into(),
            state_dir: DEFAULT_STATE_DIR.into(),
        };
        assert_eq!(ClientPaths::of_text("not toml at all ["), defaults);
        assert_eq!(ClientPaths::of_text(""), defaults);
        assert_eq!(
            ClientPaths::of_text("[daemon]\nbpffs = 3\ncontrol_socket = \"/run/x.sock\"\n"),
            ClientPaths {
                control_socket: "/run/x.sock".into(),
                bpffs: DEFAULT_BPFFS.into(),
                state_dir: DEFAULT_STATE_DIR.into()
            },
            "a key of the wrong type gives its default, not the other's"
        );
        assert_eq!(
            ClientPaths::of_text(
                "[[service]]\nname = \"a\"\n[daemon]\nbpffs = \"/sys/fs/bpf/x\"\nmetrics = 1\n"
            ),
            ClientPaths {
                control_socket: DEFAULT_CONTROL_SOCKET.into(),
                bpffs: "/sys/fs/bpf/x".into(),
                state_dir: DEFAULT_STATE_DIR.into()
            },
            "[daemon] after the services, other keys of any type"
        );
        let tricky =
            "[daemon]\nbpffs = \"\"\"\n[[service]]\n\"\"\"\ncontrol_socket = \"/run/y.sock\"\n";
        assert_eq!(
            ClientPaths::of_text(tricky).control_socket,
            PathBuf::from("/run/y.sock"),
            "a header-like line inside a string: the whole file decides"
        );
    }
}
