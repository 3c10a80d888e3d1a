//! This node's identity in the Leases it holds: its name, then a token of
//! its own (`node-a_3f9c0e4b1d2a7788`, as client-go's leader election
//! joins a host name and a UUID), so that two nodes given one name (a
//! copied config, a hard-coded `node_name`) never pass for each other's
//! holder. The token is kept in the state directory with the boot it was
//! made in: a daemon restarted within one boot (an upgrade, a rollout) is
//! the same holder and keeps its leases; after a reboot, whose kernel
//! kept no flow, the node is a new one.

use std::{fs, io::Read as _, path::Path};

/// The file in the state directory: `<boot id> <token>`.
const FILE: &str = "lease-identity";
/// The kernel's random identifier of this boot.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";
/// Hex digits in a token: 64 random bits.
const TOKEN_DIGITS: usize = 16;

/// This node's holder identity: `node_name`, `_`, and the token of this
/// boot kept in `state_dir` (made and saved when there is none). A token
/// that cannot be saved is used all the same, said in the log: the next
/// start is then a new holder, as after a reboot.
pub(crate) fn load(node_name: &str, state_dir: &Path) -> String {
    let boot = fs::read_to_string(BOOT_ID).map(|b| b.trim().to_owned()).unwrap_or_default();
    let path = state_dir.join(FILE);
    let saved = fs::read_to_string(&path).ok();
    let token = match kept_token(saved.as_deref(), &boot) {
        Some(token) => token,
        None => {
            let token = fresh_token();
            let line = format!("{boot} {token}\n");
            if let Err(e) = crate::state::write_atomically(state_dir, FILE, line.as_bytes()) {
                tracing::warn!(
                    "cannot keep this node's lease identity ({e:#}): a restart will not renew the leases it holds"
                );
            }
            token
        }
    };
    format!("{node_name}_{token}")
}

/// The token saved as `saved` if it was made in this `boot`.
fn kept_token(saved: Option<&str>, boot: &str) -> Option<String> {
    let (saved_boot, token) = saved?.trim().split_once(' ')?;
    let well_formed = token.len() == TOKEN_DIGITS && token.bytes().all(|b| b.is_ascii_hexdigit());
    (!boot.is_empty() && saved_boot == boot && well_formed).then(|| token.to_owned())
}

/// 64 bits from the kernel's random source, in hex.
fn fresh_token() -> String {
    let mut bytes = [0u8; TOKEN_DIGITS / 2];
    let read = fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if let Err(e) = read {
        // No /dev/urandom: the clock and the process still tell two
        // daemons apart.
        tracing::warn!(
            "reading /dev/urandom: {e}; the lease identity's token comes from the clock"
        );
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mixed = (nanos as u64) ^ (u64::from(std::process::id()) << 32);
        bytes = mixed.to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_kept_only_within_the_boot_it_was_made_in() {
        let boot = "6e1f0b4c-0000-4000-8000-000000000001";
        let saved = format!("{boot} 0123456789abcdef\n");
        assert_eq!(kept_token(Some(&saved), boot).as_deref(), Some("0123456789abcdef"));
        assert_eq!(kept_token(Some(&saved), "another-boot"), None, "rebooted: a new holder");
        assert_eq!(kept_token(Some(&saved), ""), None, "no boot id: nothing to match");
        assert_eq!(kept_token(None, boot), None);
        for bad in ["", "x", boot, &format!("{boot} 0123"), &format!("{boot} 0123456789abcdeg")] {
            assert_eq!(kept_token(Some(bad), boot), None, "{bad:?}");
        }
    }

    #[test]
    fn an_identity_is_the_name_and_a_token_kept_in_the_state_directory() {
        let dir = std::env::temp_dir().join(format!("lb-identity-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let first = load("node-a", &dir);
        let (name, token) = first.split_once('_').unwrap();
        assert_eq!(name, "node-a");
        assert_eq!(token.len(), TOKEN_DIGITS);
        assert_eq!(load("node-a", &dir), first, "the same boot: the same holder");
        let other = std::env::temp_dir().join(format!("lb-identity-{}-b", std::process::id()));
        let _ = fs::remove_dir_all(&other);
        assert_ne!(load("node-a", &other), first, "another node of the same name");
        let _ = fs::remove_dir_all(&dir);
        let _ = fs::remove_dir_all(&other);
    }
}
