//! Reading and writing a cgroup sock_addr program's context
//! (`bpf_sock_addr`): the destination of a connect or send, the peer of a
//! getpeername, the source of a recvmsg.

use aya_ebpf::programs::SockAddrContext;
use lb_common::Endpoint;

// `bpf_sock_addr` fields must be read and written as whole, volatile 4-byte
// accesses: the verifier rejects narrower or merged loads and stores of the
// context, which the compiler would otherwise be free to emit.
macro_rules! ctx_read {
    ($ctx:expr, $($field:tt)+) => {
        // SAFETY: the context pointer is valid for the whole program run.
        unsafe { core::ptr::read_volatile(&raw const (*$ctx.sock_addr).$($field)+) }
    };
}
macro_rules! ctx_write {
    ($ctx:expr, $value:expr, $($field:tt)+) => {
        // SAFETY: as in `ctx_read`; these fields are writable in connect and
        // getpeername programs.
        unsafe { core::ptr::write_volatile(&raw mut (*$ctx.sock_addr).$($field)+, $value) }
    };
}
pub(crate) use {ctx_read, ctx_write};

/// The IPv6 address and port of the context (IPv4-mapped for IPv4).
pub(crate) fn read_endpoint6(ctx: &SockAddrContext) -> Endpoint {
    let addr = [
        ctx_read!(ctx, user_ip6[0]),
        ctx_read!(ctx, user_ip6[1]),
        ctx_read!(ctx, user_ip6[2]),
        ctx_read!(ctx, user_ip6[3]),
    ];
    Endpoint { addr, port: read_port(ctx), _pad: [0; 2] }
}

pub(crate) fn write_endpoint6(ctx: &SockAddrContext, ep: &Endpoint) {
    ctx_write!(ctx, ep.addr[0], user_ip6[0]);
    ctx_write!(ctx, ep.addr[1], user_ip6[1]);
    ctx_write!(ctx, ep.addr[2], user_ip6[2]);
    ctx_write!(ctx, ep.addr[3], user_ip6[3]);
    write_port(ctx, ep.port);
}

/// `user_port` holds the port in network byte order in its low 16 bits.
pub(crate) fn read_port(ctx: &SockAddrContext) -> u16 {
    ctx_read!(ctx, user_port) as u16
}

pub(crate) fn write_port(ctx: &SockAddrContext, port_be: u16) {
    ctx_write!(ctx, u32::from(port_be), user_port);
}
