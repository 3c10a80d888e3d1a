//! The state file: server lists set at runtime (`lb servers`), kept across
//! restarts so a node restarted during an outage still knows its servers.
//!
//! Each entry remembers the list the config had when it was saved; if the
//! operator has since changed the config's list, the config wins and the
//! entry is dropped (a stale file must never pin a node to dead servers).

use std::{collections::BTreeMap, net::SocketAddr, path::Path};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use tracing::warn;

const FILE: &str = "servers.json";

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedState {
    pub services: BTreeMap<String, SavedList>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedList {
    pub servers: Vec<SocketAddr>,
    pub default: Option<SocketAddr>,
    /// The config's list and default when this was saved.
    pub configured: Vec<SocketAddr>,
    pub configured_default: Option<SocketAddr>,
}

impl SavedState {
    /// Reads `dir/servers.json`; a missing file is an empty state, an
    /// unreadable one is logged and ignored (the config still works).
    pub fn load(dir: &Path) -> Self {
        let path = dir.join(FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text).unwrap_or_else(|e| {
                warn!(path = %path.display(), "ignoring an unreadable state file: {e}");
                Self::default()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Self::default(),
            Err(e) => {
                warn!(path = %path.display(), "ignoring an unreadable state file: {e}");
                Self::default()
            }
        }
    }

    /// Writes `dir/servers.json` atomically (temporary file, then rename).
    pub fn save(&self, dir: &Path) -> anyhow::Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating state directory {}", dir.display()))?;
        let path = dir.join(FILE);
        let tmp = dir.join(format!("{FILE}.tmp"));
        std::fs::write(&tmp, serde_json::to_vec_pretty(self)?).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("replacing {}", path.display()))?;
        Ok(())
    }

    /// The runtime list for a service whose config says `configured` /
    /// `configured_default`, if one was saved against that same config.
    pub fn list_for(&self, service: &str, configured: &[SocketAddr], configured_default: Option<SocketAddr>) -> Option<(Vec<SocketAddr>, Option<SocketAddr>)> {
        let saved = self.services.get(service)?;
        (saved.configured == configured && saved.configured_default == configured_default).then(|| (saved.servers.clone(), saved.default))
    }
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
        state.services.insert("api".into(), SavedList { servers: vec![a(3)], default: Some(a(1)), configured: vec![a(1), a(2)], configured_default: Some(a(1)) });
        state.save(&dir).unwrap();
        let loaded = SavedState::load(&dir);
        assert_eq!(loaded, state);
        assert_eq!(loaded.list_for("api", &[a(1), a(2)], Some(a(1))), Some((vec![a(3)], Some(a(1)))));
        assert_eq!(loaded.list_for("api", &[a(1)], Some(a(1))), None, "the config changed since");
        assert_eq!(loaded.list_for("other", &[a(1)], None), None);
        std::fs::write(dir.join(FILE), "{not json").unwrap();
        assert_eq!(SavedState::load(&dir), SavedState::default());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
