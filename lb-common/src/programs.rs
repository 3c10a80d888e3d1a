//! Names of the programs in the object file; also their link pin names.

/// cgroup connect4: rewrites IPv4 connects to a VIP.
pub const CONNECT4: &str = "lb_connect4";
/// cgroup connect6: rewrites IPv6 (and IPv4-mapped) connects to a VIP.
pub const CONNECT6: &str = "lb_connect6";
/// cgroup getpeername4: a socket connected through a VIP sees the VIP.
pub const GETPEERNAME4: &str = "lb_getpeername4";
/// cgroup getpeername6: as [`GETPEERNAME4`] for IPv6.
pub const GETPEERNAME6: &str = "lb_getpeername6";
/// sock_ops: counts connections, marks failed servers, reports events.
pub const SOCK_OPS: &str = "lb_sock_ops";
/// cgroup sock_release (Linux 5.9+): a released socket leaves the
/// socket tables, and a connect its application gave up on is no
/// server failure.
pub const SOCK_RELEASE: &str = "lb_sock_release";
/// cgroup sendmsg4: rewrites an unconnected UDP send to an IPv4 VIP
/// (or IPv4-mapped, from an IPv6 socket).
pub const SENDMSG4: &str = "lb_sendmsg4";
/// cgroup sendmsg6: as [`SENDMSG4`] for IPv6.
pub const SENDMSG6: &str = "lb_sendmsg6";
/// cgroup recvmsg4: what a server sent to a socket that sent to it
/// through a VIP comes from the VIP.
pub const RECVMSG4: &str = "lb_recvmsg4";
/// cgroup recvmsg6: as [`RECVMSG4`] for IPv6 (and IPv4-mapped).
pub const RECVMSG6: &str = "lb_recvmsg6";
/// Every program, in one list so attach, adopt and detach agree.
pub const ALL: [&str; 10] = [
    CONNECT4,
    CONNECT6,
    GETPEERNAME4,
    GETPEERNAME6,
    SOCK_OPS,
    SOCK_RELEASE,
    SENDMSG4,
    SENDMSG6,
    RECVMSG4,
    RECVMSG6,
];
/// Without these there is no load balancing: a kernel lacking them is
/// an error.
pub const REQUIRED: [&str; 8] =
    [CONNECT4, CONNECT6, SOCK_OPS, SOCK_RELEASE, SENDMSG4, SENDMSG6, RECVMSG4, RECVMSG6];
/// The cgroup programs pins of `UPGRADABLE_LAYOUT` lack (an upgrade
/// attaches them).
pub const NEW_IN_LAYOUT: [&str; 0] = [];
/// XDP, the external path: forwards packets from the network for an
/// external VIP to its servers and translates their replies back.
/// Not a cgroup program: attached to interfaces, its links pinned
/// under `links/xdp-<mode>/<interface>`.
pub const XDP: &str = "lb_xdp";
/// The getpeername hooks (Linux 5.8+): without them applications see
/// the server's address instead of the VIP; lb degrades and says so.
pub const OPTIONAL: [&str; 2] = [GETPEERNAME4, GETPEERNAME6];
