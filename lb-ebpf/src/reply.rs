//! A server's packet to a NAT port, or to the client's own port for a VIP
//! that keeps the client's address (`reply`), is translated back to the
//! VIP and the client, and leaves the way the client's packets came, if
//! it arrived on the interface the flow's packets to the server leave by
//! (anything else claiming to be the server is dropped). An established
//! flow's reset, FIN or SYN from the server changes its state only if
//! its sequence number is within the server's window
//! (`lb_common::nat::server_window`). The server's
//! packets keep the flow's NAT port (`lb_common::nat`), except while the
//! flow is half-open: a server re-sending its SYN-ACK to a forged address
//! does not hold the port.
//!
//! A reset that answers a flow's SYN marks the server failed, as on the
//! socket path (`forward.rs` says when it counts).

#![allow(
    clippy::needless_borrows_for_generic_args,
    reason = "map keys go by reference: a key passed by value is one more copy of it on a stack that \
              holds 512 bytes for the whole call chain"
)]

use aya_ebpf::{bindings::xdp_action, helpers::bpf_ktime_get_ns, programs::XdpContext};
use lb_common::{
    EXTERNAL_FLOW_COOKIE, EventKind, NAT_REPLY_ESTABLISHED, NAT_REPLY_SYN, NatKey, NatReply,
    Reason, nat,
};

use crate::{
    consts::{IPPROTO_TCP, TCP_FIN, TCP_SYN},
    flows::nat_ports,
    maps::{NAT_REPLIES, count_xdp, in_vip_ports, opening_replies},
    packet,
    report::{emit, mark_failed_reporting},
    scratch::Packet,
};

/// A server's packet: translated back and sent to its client if it
/// answers a forwarded flow; `None` if it does not (uncounted: the full
/// path counts it, and `established.rs`'s short way leaves it to the
/// full path).
#[inline(never)]
pub(crate) fn reply(ctx: &XdpContext, p: &Packet) -> Option<u32> {
    // A reply goes to a NAT port, or comes from the port of a server of a
    // VIP that keeps the client's address (`VIP_PORTS` has those): a
    // packet to any other port (most of what crosses the node's
    // interfaces, its own traffic) is not one, without a hash lookup.
    let (first, count) = nat_ports();
    if u32::from(u16::from_be(p.dst.port)).wrapping_sub(first) >= count
        && !in_vip_ports(u16::from_be(p.src.port))
    {
        return None;
    }
    let key = NatKey { server: p.src, node: p.dst, protocol: p.protocol, _pad: [0; 3] };
    let tcp = u32::from(p.protocol) == IPPROTO_TCP;
    // UDP flows are never established.
    let (entry, established) = match if tcp { NAT_REPLIES.get_ptr_mut(&key) } else { None } {
        Some(entry) => (Some(entry), true),
        None => (opening_replies(p.protocol).get_ptr_mut(&key), false),
    };
    let entry = entry?;
    if !packet::for_this_node(ctx) {
        return Some(xdp_action::XDP_PASS);
    }
    // SAFETY: a map value, valid for the whole program run; copied, and
    // written back only in its flags and sequence words.
    let nat = unsafe { *entry };
    // SAFETY: the context's fields are valid for the whole program run.
    if unsafe { (*ctx.ctx).ingress_ifindex } != nat.server_ifindex {
        count_xdp(Reason::XdpReplyElsewhere);
        return Some(xdp_action::XDP_DROP);
    }
    let mut flags = nat.flags;
    if flags & NAT_REPLY_ESTABLISHED == 0 {
        if !p.is_rst() {
            flags |= NAT_REPLY_ESTABLISHED;
            if tcp && p.tcp_flags & TCP_SYN != 0 {
                // The server's own sequence number: the client that
                // acknowledges it completes the handshake (`promote`).
                // SAFETY: as above.
                unsafe { (*entry).syn_seq = p.tcp_seq };
            }
        } else if refuses(&nat, p) {
            count_xdp(Reason::XdpServerReset);
            if mark_failed_reporting(&p.src) {
                emit(EXTERNAL_FLOW_COOKIE, &nat.vip, &p.src, EventKind::ConnectFailed);
            }
        }
    }
    if tcp {
        let (syn, fin) = (p.tcp_flags & TCP_SYN != 0, p.tcp_flags & TCP_FIN != 0);
        // An established flow's SYN, FIN or reset from the server counts
        // only within the server's window: one forged blind on the
        // servers' side goes on to the client, whose stack judges it, but
        // ends nothing here and frees no port.
        let mut counts = true;
        if established {
            let (in_window, noted) = nat::server_window(nat.syn_seq, p.tcp_seq);
            if noted != nat.syn_seq {
                // SAFETY: as above; once per half a window of data.
                unsafe { (*entry).syn_seq = noted };
            }
            counts = in_window || !(syn || fin || p.is_rst());
        }
        if counts {
            flags = nat::after_tcp(flags, true, syn, fin, p.is_rst());
        } else {
            count_xdp(Reason::XdpServerOutOfWindow);
        }
    }
    // SAFETY: plain helper call without arguments.
    let tick = nat::tick(unsafe { bpf_ktime_get_ns() });
    let flags = nat::stamp_reply(nat.flags, flags, tcp, tick);
    if flags != nat.flags {
        // SAFETY: as above; a stamp changes about once a millisecond.
        unsafe { (*entry).flags = flags };
    }
    if packet::ttl(ctx, p) <= 1 {
        count_xdp(Reason::XdpTtlExceeded);
        return Some(xdp_action::XDP_PASS);
    }
    if !packet::rewrite(ctx, p, &nat.vip, &nat.client) || !packet::set_link(ctx, p, nat.macs) {
        return Some(xdp_action::XDP_DROP);
    }
    count_xdp(Reason::XdpReplied);
    Some(packet::redirect(nat.client_ifindex))
}

/// Whether the reset `p` (from where the flow's packets to the server
/// leave: `reply` checked) is the server refusing the flow's SYN: the
/// flow began with a SYN and the reset acknowledges it.
#[inline(always)]
fn refuses(nat: &NatReply, p: &Packet) -> bool {
    nat.flags & NAT_REPLY_SYN != 0 && p.tcp_ack == nat.syn_seq.wrapping_add(1)
}
