//! Whether a client's SYN is one its server must answer: SYN alone among
//! the flags (ECN's ECE and CWR aside), a header length that fits, no
//! data, and a TCP checksum that verifies. Only such a SYN, sent again
//! unanswered, counts against its server (`forward::keeps`): a server
//! drops anything else without a word, so any other would let a client
//! fail a server at will. Asked on that rare path only, never per packet.

use aya_ebpf::programs::XdpContext;
use lb_common::checksum;

use super::read;
use crate::{
    consts::{IPPROTO_TCP, IPV4_HLEN, IPV6_HLEN, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    scratch::Packet,
};

/// TCP's PSH and URG flags.
const TCP_PSH: u8 = 0x08;
const TCP_URG: u8 = 0x20;

/// The longest TCP header, in 32-bit words.
const TCP_MAX_WORDS: usize = 15;

/// Whether `p`, a TCP packet from a client, is a SYN its server must
/// answer (see the module).
#[inline(always)]
pub(crate) fn answerable(ctx: &XdpContext, p: &Packet) -> bool {
    let flags = TCP_SYN | TCP_ACK | TCP_FIN | TCP_RST | TCP_PSH | TCP_URG;
    if p.tcp_flags & flags != TCP_SYN {
        return false;
    }
    let l4 = p.l4();
    let Some(offset) = read::<u8>(ctx, l4 + 12) else { return false };
    let words = usize::from(offset >> 4);
    let ip_hlen = if p.ipv6 { IPV6_HLEN } else { IPV4_HLEN };
    let tcp_len = 4 * words;
    if words < 5 || p.ip_len as usize != ip_hlen + tcp_len {
        return false;
    }
    // The pseudo-header: the addresses as they lie, then the protocol and
    // the TCP length as the bytes they are in network order.
    let len = (tcp_len as u16).to_be_bytes();
    let mut sum: u64 = if p.ipv6 {
        let words = p.src.addr.iter().chain(&p.dst.addr).map(|w| u64::from(*w)).sum::<u64>();
        words
            + u64::from(u32::from_ne_bytes([0, 0, len[0], len[1]]))
            + u64::from(u32::from_ne_bytes([0, 0, 0, IPPROTO_TCP as u8]))
    } else {
        u64::from(p.src.addr[3])
            + u64::from(p.dst.addr[3])
            + u64::from(u32::from_ne_bytes([0, IPPROTO_TCP as u8, len[0], len[1]]))
    };
    for i in 0..TCP_MAX_WORDS {
        if i >= words {
            break;
        }
        let Some(word) = read::<u32>(ctx, l4 + 4 * i) else { return false };
        sum += u64::from(word);
    }
    // With its checksum, a segment sums to all ones.
    checksum::fold(sum) == 0xffff
}
