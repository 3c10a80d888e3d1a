//! Who answers for a VIP on the LAN: a prober in the client's namespace
//! asks (an ARP request every few milliseconds) and a capture on the
//! client's bridge port records every ARP reply and gratuitous ARP for the
//! VIPs, with the MAC address it came from and when.

use std::{
    net::Ipv4Addr,
    os::fd::AsRawFd as _,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use crate::{
    Namespace,
    lan::{VIP_IP, mac_of},
    raw::{packet_socket, parse_mac},
};

const ETH_P_ARP: u16 = 0x0806;
const ETH_P_ALL: u16 = 0x0003;

/// One answer seen: when (since the capture began), from which MAC, for
/// which VIP.
#[derive(Clone, Debug)]
pub struct Seen {
    pub at: Duration,
    pub mac: String,
    pub vip: Ipv4Addr,
}

/// The prober and the capture, until dropped.
pub struct Watch {
    pub started: Instant,
    /// Frames of any kind the capture read, and ARP frames among them: a
    /// failure's message tells a capture that fell behind from a node
    /// that never answered.
    frames: Arc<[AtomicU64; 2]>,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Watch {
    /// Captures on `port` (in the calling thread's namespace) and asks
    /// from `c0` in `client` every `every`, for the LAN's VIP.
    pub fn start(client: &Namespace, port: &str, every: Duration) -> Self {
        Self::start_for(client, port, every, vec![VIP_IP.parse().unwrap()])
    }

    /// As [`Self::start`], for each of `vips` (one request for each every
    /// `every`).
    pub fn start_for(client: &Namespace, port: &str, every: Duration, vips: Vec<Ipv4Addr>) -> Self {
        let started = Instant::now();
        let (seen, stop) = (Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicBool::new(false)));
        // Every protocol: a socket for one protocol sees only the frames
        // that arrive, not those the port sends on to the client.
        let capture = packet_socket(port, ETH_P_ALL, Some(Duration::from_millis(20)));
        let frames: Arc<[AtomicU64; 2]> = Arc::default();
        let (s, st, counted) = (seen.clone(), stop.clone(), frames.clone());
        let wanted = vips.clone();
        let capturing = thread::spawn(move || {
            let mut frame = [0u8; 2048];
            while !st.load(Ordering::Relaxed) {
                // SAFETY: reading into a buffer we own, of its length.
                let n = unsafe {
                    libc::recv(capture.as_raw_fd(), frame.as_mut_ptr().cast(), frame.len(), 0)
                };
                let Ok(n) = usize::try_from(n) else { continue };
                let f = &frame[..n];
                counted[0].fetch_add(1, Ordering::Relaxed);
                // An ARP reply, or a gratuitous ARP, from a VIP.
                if n < 42 || f[12..14] != ETH_P_ARP.to_be_bytes() {
                    continue;
                }
                counted[1].fetch_add(1, Ordering::Relaxed);
                let sender = Ipv4Addr::new(f[28], f[29], f[30], f[31]);
                if wanted.contains(&sender) && (f[21] == 2 || f[38..42] == sender.octets()) {
                    let mac = f[22..28].iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>();
                    let seen = Seen { at: started.elapsed(), mac: mac.join(":"), vip: sender };
                    s.lock().unwrap().push(seen);
                }
            }
        });
        let st = stop.clone();
        let asking = client.spawn(move || {
            let socket = packet_socket("c0", ETH_P_ARP, None);
            let mac = parse_mac(&mac_of("c0"));
            let requests: Vec<Vec<u8>> = vips
                .iter()
                .map(|vip| {
                    let mut request = Vec::with_capacity(42);
                    request.extend_from_slice(&[0xff; 6]);
                    request.extend_from_slice(&mac);
                    request.extend_from_slice(&ETH_P_ARP.to_be_bytes());
                    request.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
                    request.extend_from_slice(&mac);
                    request.extend_from_slice(&[198, 18, 0, 10]);
                    request.extend_from_slice(&[0; 6]);
                    request.extend_from_slice(&vip.octets());
                    request
                })
                .collect();
            while !st.load(Ordering::Relaxed) {
                for request in &requests {
                    // SAFETY: sending a buffer we own, of its length.
                    unsafe {
                        libc::send(socket.as_raw_fd(), request.as_ptr().cast(), request.len(), 0)
                    };
                }
                thread::sleep(every);
            }
        });
        Self { started, frames, seen, stop, threads: vec![capturing, asking] }
    }

    /// The answers seen so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// What the capture read so far, for a failure's message.
    pub fn captured(&self) -> String {
        let [all, arp] = &*self.frames;
        let (all, arp) = (all.load(Ordering::Relaxed), arp.load(Ordering::Relaxed));
        format!("{all} frames captured in {:?}, {arp} of them ARP", self.started.elapsed())
    }

    /// The MACs that answered, in turn: each run of answers from one MAC
    /// as (MAC, first, last).
    pub fn turns(&self) -> Vec<(String, Duration, Duration)> {
        self.turns_of(VIP_IP.parse().unwrap())
    }

    /// As [`Self::turns`], for `vip`.
    pub fn turns_of(&self, vip: Ipv4Addr) -> Vec<(String, Duration, Duration)> {
        let mut turns: Vec<(String, Duration, Duration)> = Vec::new();
        for s in self.seen().into_iter().filter(|s| s.vip == vip) {
            match turns.last_mut() {
                Some((mac, _, last)) if *mac == s.mac => *last = s.at,
                _ => turns.push((s.mac, s.at, s.at)),
            }
        }
        turns
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
