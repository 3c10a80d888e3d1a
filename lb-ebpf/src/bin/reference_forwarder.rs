//! Not part of lb: the bench's yardstick for `lb_xdp` (`cargo xtask bench`,
//! `tests/benches/xdp_program_time.rs`). Program time in nanoseconds does
//! not travel between machines; a ratio to this, timed in the same run,
//! does.
//!
//! `reference_nat` is the least any NAT forwarder must do for a packet
//! of a flow it knows: parse Ethernet, IPv4 or IPv6 (no options or
//! extension headers) and TCP; look the flow up once in a hash table that
//! evicts (`REFERENCE_FLOWS`, an LRU as a flow table must be, keyed as
//! lb's own flows are); check and lower the TTL or hop limit, as a router
//! must; rewrite both addresses and ports with incremental checksum
//! updates; write the next hop's link layer; redirect to the interface
//! the entry names. It chooses nothing, counts nothing, checks no state:
//! the same entry serves a client's packet and a server's reply, whose
//! work is the same. `reference_pass` passes every packet: the floor of
//! any XDP program.
//!
//! Built beside lb's object by lb-user's build script; never loaded by lb.
#![no_std]
#![cfg_attr(target_arch = "bpf", no_main)]

use aya_ebpf::{
    bindings::xdp_action,
    helpers::bpf_redirect,
    macros::{map, xdp},
    maps::LruHashMap,
    programs::XdpContext,
};
use lb_common::{Endpoint, FlowKey, checksum, reference::ReferenceRewrite};

const ETH_HLEN: usize = 14;
const IPPROTO_TCP: u8 = 6;

/// The flows the bench writes: a packet with this key (its source, its
/// destination, TCP) leaves rewritten as the value says.
#[map]
static REFERENCE_FLOWS: LruHashMap<FlowKey, ReferenceRewrite> =
    LruHashMap::with_max_entries(1024, 0);

#[xdp]
pub fn reference_nat(ctx: XdpContext) -> u32 {
    forward(&ctx).unwrap_or(xdp_action::XDP_PASS)
}

#[xdp]
pub fn reference_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// A pointer to a `T` at `offset` bytes into the packet, if it holds one.
#[inline(always)]
fn at<T>(ctx: &XdpContext, offset: usize) -> Option<*mut T> {
    let start = ctx.data() + offset;
    if start + size_of::<T>() > ctx.data_end() {
        return None;
    }
    Some(start as *mut T)
}

#[inline(always)]
fn forward(ctx: &XdpContext) -> Option<u32> {
    let ethertype = u16::from_be(read::<u16>(ctx, 12)?);
    let (key, l4, ipv6) = match ethertype {
        0x0800 => {
            let ip = read::<[u32; 5]>(ctx, ETH_HLEN)?;
            let head = ip[0].to_ne_bytes();
            let word2 = ip[2].to_ne_bytes();
            // Version 4 without options; TCP.
            if head[0] != 0x45 || word2[1] != IPPROTO_TCP {
                return None;
            }
            let ports = read::<[u16; 2]>(ctx, ETH_HLEN + 20)?;
            let key = FlowKey {
                client: Endpoint::from_v4_raw(ip[3], ports[0]),
                vip: Endpoint::from_v4_raw(ip[4], ports[1]),
                protocol: IPPROTO_TCP,
                _pad: [0; 3],
            };
            (key, ETH_HLEN + 20, false)
        }
        0x86dd => {
            let ip = read::<[u32; 10]>(ctx, ETH_HLEN)?;
            if ip[1].to_ne_bytes()[2] != IPPROTO_TCP {
                return None;
            }
            let ports = read::<[u16; 2]>(ctx, ETH_HLEN + 40)?;
            let endpoint = |addr: [u32; 4], port| Endpoint { addr, port, _pad: [0; 2] };
            let key = FlowKey {
                client: endpoint([ip[2], ip[3], ip[4], ip[5]], ports[0]),
                vip: endpoint([ip[6], ip[7], ip[8], ip[9]], ports[1]),
                protocol: IPPROTO_TCP,
                _pad: [0; 3],
            };
            (key, ETH_HLEN + 40, true)
        }
        _ => return None,
    };
    // SAFETY: a map value, only read during this run.
    let to = unsafe { REFERENCE_FLOWS.get(key) }?;
    let (old_src, old_dst) = (&key.client, &key.vip);
    let tcp_check_at = l4 + 16;
    let mut check = read::<u16>(ctx, tcp_check_at)?;
    if ipv6 {
        let hop_limit = read::<u8>(ctx, ETH_HLEN + 7)?;
        if hop_limit <= 1 {
            return None;
        }
        for i in 0..4 {
            check = checksum::replace32(check, old_src.addr[i], to.src.addr[i]);
            check = checksum::replace32(check, old_dst.addr[i], to.dst.addr[i]);
        }
        write(ctx, ETH_HLEN + 7, hop_limit - 1)?;
        write(ctx, ETH_HLEN + 8, to.src.addr)?;
        write(ctx, ETH_HLEN + 24, to.dst.addr)?;
    } else {
        // The TTL shares a checksummed word with the protocol.
        let ttl_word = read::<[u8; 2]>(ctx, ETH_HLEN + 8)?;
        if ttl_word[0] <= 1 {
            return None;
        }
        let lowered = [ttl_word[0] - 1, ttl_word[1]];
        let mut ip_check = read::<u16>(ctx, ETH_HLEN + 10)?;
        ip_check = checksum::replace16(
            ip_check,
            u16::from_ne_bytes(ttl_word),
            u16::from_ne_bytes(lowered),
        );
        ip_check = checksum::replace32(ip_check, old_src.addr[3], to.src.addr[3]);
        ip_check = checksum::replace32(ip_check, old_dst.addr[3], to.dst.addr[3]);
        check = checksum::replace32(check, old_src.addr[3], to.src.addr[3]);
        check = checksum::replace32(check, old_dst.addr[3], to.dst.addr[3]);
        write(ctx, ETH_HLEN + 8, lowered)?;
        write(ctx, ETH_HLEN + 10, ip_check)?;
        write(ctx, ETH_HLEN + 12, [to.src.addr[3], to.dst.addr[3]])?;
    }
    check = checksum::replace16(check, old_src.port, to.src.port);
    check = checksum::replace16(check, old_dst.port, to.dst.port);
    write(ctx, tcp_check_at, check)?;
    write(ctx, l4, [to.src.port, to.dst.port])?;
    write(ctx, 0, to.macs)?;
    // SAFETY: plain helper call.
    Some(unsafe { bpf_redirect(to.ifindex, 0) } as u32)
}

/// Reads a `T` at `offset`; `None` past the end.
#[inline(always)]
fn read<T: Copy>(ctx: &XdpContext, offset: usize) -> Option<T> {
    // SAFETY: `at` checked the bounds; packet data may be unaligned.
    at::<T>(ctx, offset).map(|p| unsafe { p.read_unaligned() })
}

/// Writes `value` at `offset`; `None` past the end.
#[inline(always)]
fn write<T>(ctx: &XdpContext, offset: usize, value: T) -> Option<()> {
    let p = at::<T>(ctx, offset)?;
    // SAFETY: as in `read`.
    unsafe { p.write_unaligned(value) };
    Some(())
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable call to this; it must stay dead code.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
