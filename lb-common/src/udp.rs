//! The value of `UDP_PEERS`: one UDP socket's reverse mapping, the VIPs
//! it sent to and the servers that got them, and the pure functions the
//! sendmsg and recvmsg programs use on it (tested here, on the host).

use crate::{Endpoint, UDP_PEERS_PER_SOCKET};

/// A VIP a UDP socket sent to (or connected to), and the server that got
/// it: what comes back from `server` on that socket is shown as from `vip`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UdpPeer {
    /// The VIP the application sent to; all zero in an unused slot.
    pub vip: Endpoint,
    /// The server the datagrams went to.
    pub server: Endpoint,
}

/// The value of the `UDP_PEERS` map, keyed by socket cookie: the reverse
/// mapping of one UDP socket, as (cookie, server) → VIP would be, in one
/// entry so that the socket's release removes all of it at once.
///
/// One slot per VIP: a send to a VIP reuses the server in its slot while
/// it is usable and preferred (so a socket's datagrams to a VIP all reach
/// one server, as on a connected socket), and chooses again otherwise.
/// Written only under the socket's lock (the sendmsg, recvmsg and connect
/// hooks take it) or at its release.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UdpPeers {
    /// The pairs, in the order they were first written.
    pub peers: [UdpPeer; UDP_PEERS_PER_SOCKET],
    /// The slot a new VIP takes (modulo [`UDP_PEERS_PER_SOCKET`]): the
    /// slots fill in turn, then the oldest is replaced.
    pub next: u32,
}

impl UdpPeers {
    /// The slot holding `vip`'s pair, if any.
    #[inline(always)]
    pub fn slot_of_vip(&self, vip: &Endpoint) -> Option<usize> {
        (0..UDP_PEERS_PER_SOCKET).find(|&i| self.peers[i].vip == *vip)
    }

    /// The VIP whose server is `server`, if any (the first such slot).
    #[inline(always)]
    pub fn vip_of_server(&self, server: &Endpoint) -> Option<Endpoint> {
        (0..UDP_PEERS_PER_SOCKET)
            .find(|&i| self.peers[i].server == *server && self.peers[i].vip.port != 0)
            .map(|i| self.peers[i].vip)
    }

    /// Records that datagrams to `vip` now go to `server`: in `vip`'s slot
    /// if it has one, else in the next slot in turn.
    #[inline(always)]
    pub fn set(&mut self, vip: &Endpoint, server: &Endpoint) {
        let slot = match self.slot_of_vip(vip) {
            Some(slot) => slot,
            None => {
                let slot = self.next as usize % UDP_PEERS_PER_SOCKET;
                self.next = self.next.wrapping_add(1);
                slot
            }
        };
        self.peers[slot] = UdpPeer { vip: *vip, server: *server };
    }
}

// The kernel and the daemon must agree on this byte for byte.
const _: () = assert!(size_of::<UdpPeers>() == 40 * UDP_PEERS_PER_SOCKET + 4);

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(last: u32, port: u16) -> Endpoint {
        Endpoint::from_v4_raw(last, port)
    }

    #[test]
    fn a_socket_keeps_one_server_per_vip_and_replaces_the_oldest_vip() {
        let mut peers = UdpPeers::default();
        assert_eq!(peers.vip_of_server(&Endpoint::default()), None, "empty slots match nothing");
        peers.set(&ep(1, 53), &ep(10, 53));
        peers.set(&ep(1, 53), &ep(11, 53));
        assert_eq!(peers.slot_of_vip(&ep(1, 53)), Some(0), "a VIP keeps its slot");
        assert_eq!(peers.vip_of_server(&ep(11, 53)), Some(ep(1, 53)));
        assert_eq!(peers.vip_of_server(&ep(10, 53)), None, "the VIP's old server is gone");
        for vip in 2..=UDP_PEERS_PER_SOCKET as u32 + 1 {
            peers.set(&ep(vip, 53), &ep(vip + 20, 53));
        }
        assert_eq!(peers.slot_of_vip(&ep(1, 53)), None, "the oldest VIP was replaced");
        for vip in 2..=UDP_PEERS_PER_SOCKET as u32 + 1 {
            assert_eq!(peers.vip_of_server(&ep(vip + 20, 53)), Some(ep(vip, 53)));
        }
    }
}
