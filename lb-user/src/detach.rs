//! What makes `lb detach` final under a supervisor that restarts lb
//! (systemd's `Restart=always`, a restart loop): a running daemon asked to
//! detach ([`crate::control::Request::Detach`]) exits with
//! [`EXIT_DETACHED`], which the shipped unit lists in
//! `RestartPreventExitStatus=`, so it stays stopped until the operator
//! starts it again. The removal itself holds the pins' lock
//! (`datapath::detach`): a daemon starting meanwhile cannot attach half-way
//! through it, or leave links without their layout mark.

/// The exit status of a daemon that stopped for `lb detach`: not a
/// failure, and not to be restarted.
pub const EXIT_DETACHED: u8 = 3;
