//! What the external path's short way for established flows
//! (`lb-ebpf/src/established.rs`) reads from the daemon: which ports are
//! external VIPs' (`VIP_PORTS`, a bit per port), and the epoch (`EPOCH`)
//! that ends every verdict the kernel keeps, bumped after each change to
//! what those verdicts stand for (`SERVICES`, `EXTERNAL`, `LINK_MACS`).

use anyhow::Context as _;
use aya::maps::{Array, Map};
use lb_common::{VIP_PORT_WORDS, maps, vip_port_bit};

/// Handles to `EPOCH` and `VIP_PORTS`, and what `VIP_PORTS` holds.
pub(super) struct FastPathMaps {
    epoch: Array<aya::maps::MapData, u32>,
    vip_ports: Array<aya::maps::MapData, u64>,
    /// `EPOCH` as last written (read back once, at start): this daemon,
    /// which holds the pins' lock, is its only writer.
    now: u32,
    /// `VIP_PORTS` as last written (read back once, at start).
    ports: Vec<u64>,
}

impl FastPathMaps {
    pub(super) fn from_maps(
        mut map: impl FnMut(&str) -> anyhow::Result<Map>,
    ) -> anyhow::Result<Self> {
        let epoch = Array::try_from(map(maps::EPOCH)?)
            .with_context(|| format!("map {} has an unexpected type or size", maps::EPOCH))?;
        let vip_ports: Array<_, u64> = Array::try_from(map(maps::VIP_PORTS)?)
            .with_context(|| format!("map {} has an unexpected type or size", maps::VIP_PORTS))?;
        let ports = (0..VIP_PORT_WORDS)
            .map(|i| vip_ports.get(&i, 0))
            .collect::<Result<_, _>>()
            .with_context(|| format!("reading map {}", maps::VIP_PORTS))?;
        let now = epoch.get(&0, 0).with_context(|| format!("reading map {}", maps::EPOCH))?;
        Ok(Self { epoch, vip_ports, now, ports })
    }

    /// Ends the verdicts the kernel keeps for established flows: called
    /// after every change to `SERVICES`, `EXTERNAL` or `LINK_MACS`.
    pub(super) fn new_epoch(&mut self) -> anyhow::Result<()> {
        let next = self.now.wrapping_add(1);
        self.epoch.set(0, next, 0).with_context(|| format!("writing map {}", maps::EPOCH))?;
        self.now = next;
        Ok(())
    }

    /// Makes `VIP_PORTS` hold exactly `ports`. Returns how
    /// many of its words changed.
    pub(super) fn set_ports(&mut self, ports: impl Iterator<Item = u16>) -> anyhow::Result<usize> {
        let wanted = port_words(ports);
        let mut changed = 0;
        for (index, (had, want)) in self.ports.iter_mut().zip(wanted).enumerate() {
            if *had != want {
                self.vip_ports
                    .set(index as u32, want, 0)
                    .with_context(|| format!("writing map {}", maps::VIP_PORTS))?;
                *had = want;
                changed += 1;
            }
        }
        Ok(changed)
    }
}

/// `VIP_PORTS`' words for `ports`: a bit per port.
fn port_words(ports: impl Iterator<Item = u16>) -> Vec<u64> {
    let mut words = vec![0; VIP_PORT_WORDS as usize];
    for port in ports {
        let (word, bit) = vip_port_bit(port);
        words[word as usize] |= bit;
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_port_has_its_own_bit() {
        let words = port_words([0, 63, 64, 80, 443, 65_535].into_iter());
        assert_eq!(words.len(), 1024);
        assert_eq!(words[0], 1 | 1 << 63);
        assert_eq!(words[1], 1 | 1 << (80 - 64));
        assert_eq!(words[443 / 64], 1 << (443 % 64));
        assert_eq!(words[1023], 1 << 63);
        let set: u32 = words.iter().map(|w| w.count_ones()).sum();
        assert_eq!(set, 6);
        assert_eq!(port_words([8080, 8080].into_iter())[8080 / 64].count_ones(), 1);
    }
}
