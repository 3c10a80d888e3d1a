//! The state file: server lists set at runtime (`lb servers`), kept across
//! restarts so a node restarted during an outage still knows its servers.
//!
//! Each entry remembers the list the config had when it was saved; if the
//! operator has since changed the config's list, the config wins and the
//! entry is dropped (a stale file must never pin a node to dead servers).

use std::{
    collections::BTreeMap,
    fs::{File, OpenOptions},
    io::Write as _,
    net::SocketAddr,
    os::unix::fs::OpenOptionsExt as _,
    path::Path,
};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use tracing::error;

const FILE: &str = "servers.json";

/// The whole state file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedState {
    /// By service name: the lists set at runtime or discovered.
    pub services: BTreeMap<String, SavedList>,
    /// What the LoadBalancer Services last asked the nodes to serve: served
    /// again from the start of the next daemon, before its Services watch
    /// has listed, as the file's services are (fail-static).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub load_balancers: Vec<crate::loadbalancer::Served>,
}

/// One service's saved list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedList {
    /// The servers, in order of preference.
    pub servers: Vec<SocketAddr>,
    /// The default, if any.
    pub default: Option<SocketAddr>,
    /// The config's list when this was saved.
    pub configured: Vec<SocketAddr>,
    /// The config's default when this was saved.
    pub configured_default: Option<SocketAddr>,
    /// Servers a discovery source declared serving but not ready
    /// (terminating): drained again after a restart.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drained: Vec<SocketAddr>,
    /// For a discovered list: when it was discovered (seconds since the
    /// Unix epoch), shown as the last successful sync after a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discovered_at: Option<u64>,
}

impl SavedState {
    /// Reads `dir/servers.json`; a missing file is an empty state. A file
    /// that cannot be read or parsed is reported as an error (the config's
    /// lists are used instead) and left in place for the operator to see;
    /// it is replaced at the next `lb servers`. Each list is checked again
    /// by the daemon against its service before it is used.
    pub fn load(dir: &Path) -> Self {
        let path = dir.join(FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Self::default(),
            Err(e) => {
                error!(path = %path.display(), "cannot read the state file; using the config's server lists: {e}");
                return Self::default();
            }
        };
        serde_json::from_str(&text).unwrap_or_else(|e| {
            error!(path = %path.display(), "the state file is corrupt; using the config's server lists: {e}");
            Self::default()
        })
    }

    /// Writes `dir/servers.json` so that a crash or power loss leaves
    /// either the old file or the new one (`write_atomically`).
    pub fn save(&self, dir: &Path) -> anyhow::Result<()> {
        write_atomically(dir, FILE, &serde_json::to_vec_pretty(self)?)
    }

    /// The runtime list for a service whose config says `configured` /
    /// `configured_default`, if one was saved against that same config.
    pub fn list_for(
        &self,
        service: &str,
        configured: &[SocketAddr],
        configured_default: Option<SocketAddr>,
    ) -> Option<&SavedList> {
        let saved = self.services.get(service)?;
        (saved.configured == configured && saved.configured_default == configured_default)
            .then_some(saved)
    }
}

/// Writes `bytes` to `dir/name` so that a crash leaves the old file or the
/// new one, never a part: a temporary file in the same directory (created
/// exclusively, never through a symlink, readable by root only), written
/// and fsynced, renamed over the old one, then the directory fsynced so
/// that the rename itself is durable.
pub(crate) fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating state directory {}", dir.display()))?;
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    // A leftover from a crashed write of this same process id.
    let _ = std::fs::remove_file(&tmp);
    let write = || -> std::io::Result<()> {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", tmp.display()));
    }
    std::fs::rename(&tmp, &path).with_context(|| format!("replacing {}", path.display()))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing state directory {}", dir.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(n: u8) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, n], 80))
    }

    #[test]
    fn saved_list_applies_only_to_the_config_it_was_saved_against() {
        let dir = std::env::temp_dir().join(format!("lb-state-test-{}", std::process::id()));
        let mut state = SavedState::default();
        let list = SavedList {
            servers: vec![a(3), a(4)],
            default: Some(a(1)),
            configured: vec![a(1), a(2)],
            configured_default: Some(a(1)),
            drained: vec![a(4)],
            discovered_at: Some(1_700_000_000),
        };
        state.services.insert("api".into(), list.clone());
        state.save(&dir).unwrap();
        let loaded = SavedState::load(&dir);
        assert_eq!(loaded, state);
        assert_eq!(loaded.list_for("api", &[a(1), a(2)], Some(a(1))), Some(&list));
        assert_eq!(loaded.list_for("api", &[a(1)], Some(a(1))), None, "the config changed since");
        assert_eq!(loaded.list_for("other", &[a(1)], None), None);
        std::fs::write(dir.join(FILE), "{not json").unwrap();
        assert_eq!(SavedState::load(&dir), SavedState::default());
        assert_eq!(
            std::fs::read_to_string(dir.join(FILE)).unwrap(),
            "{not json",
            "a corrupt file is left for the operator"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_from_before_drained_lists_still_loads() {
        let text = r#"{"services":{"api":{"servers":["127.0.0.3:80"],"default":null,"configured":[],"configured_default":null}}}"#;
        let state: SavedState = serde_json::from_str(text).unwrap();
        assert_eq!(state.services["api"].drained, Vec::<SocketAddr>::new());
    }

    #[test]
    fn save_replaces_the_file_and_leaves_no_temporary_behind() {
        let dir = std::env::temp_dir().join(format!("lb-state-save-{}", std::process::id()));
        let mut state = SavedState::default();
        state.services.insert(
            "api".into(),
            SavedList {
                servers: vec![a(3)],
                default: None,
                configured: vec![a(1)],
                configured_default: None,
                drained: vec![],
                discovered_at: None,
            },
        );
        state.save(&dir).unwrap();
        state.services.clear();
        state.save(&dir).unwrap();
        assert_eq!(SavedState::load(&dir), state);
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, [FILE]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn save_never_writes_through_a_symlink() {
        let dir = std::env::temp_dir().join(format!("lb-state-symlink-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let tmp = dir.join(format!(".{FILE}.{}.tmp", std::process::id()));
        // A symlink planted at the temporary name is removed, not followed.
        std::os::unix::fs::symlink(&victim, &tmp).unwrap();
        SavedState::default().save(&dir).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
