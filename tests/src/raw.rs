//! Raw frames on an interface: an `AF_PACKET` socket in the calling
//! thread's namespace, to watch what arrives (`arp.rs`) or to send what
//! no socket API would (a client's malformed or forged packets).

use std::{
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::Duration,
};

/// Sends each of `frames` out of `dev` (in the calling thread's
/// namespace) as it is, link layer included.
pub fn send(dev: &str, frames: &[Vec<u8>]) {
    // Protocol 0: the socket receives nothing.
    let socket = packet_socket(dev, 0, None);
    for frame in frames {
        // SAFETY: the buffer and its length.
        let sent = unsafe { libc::send(socket.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        assert_eq!(
            sent,
            frame.len() as isize,
            "sending a frame on {dev}: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// A flood generator's socket on one interface (in the namespace of the
/// thread that made it), kept open: opening and closing a packet socket
/// waits for the kernel's RCU grace period, milliseconds each.
pub struct Sender(OwnedFd);

impl Sender {
    pub fn new(dev: &str) -> Self {
        // Protocol 0: the socket receives nothing.
        Self(packet_socket(dev, 0, None))
    }

    /// Sends `frames` as they are, up to 64 per `sendmmsg` call; returns
    /// how many the kernel took (with its queue full it takes fewer: the
    /// rest are not sent, not retried).
    pub fn send(&self, frames: &[Vec<u8>]) -> usize {
        let mut sent = 0;
        for batch in frames.chunks(64) {
            let mut iovecs: Vec<libc::iovec> = batch
                .iter()
                .map(|f| libc::iovec { iov_base: f.as_ptr() as *mut _, iov_len: f.len() })
                .collect();
            let mut messages: Vec<libc::mmsghdr> = iovecs
                .iter_mut()
                .map(|iov| {
                    // SAFETY: a zeroed msghdr is valid; it points at one
                    // iovec that lives until the call returns.
                    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
                    header.msg_iov = iov;
                    header.msg_iovlen = 1;
                    libc::mmsghdr { msg_hdr: header, msg_len: 0 }
                })
                .collect();
            // SAFETY: `messages` and the buffers they point at live across
            // the call; the length is theirs. The kernel only reads them.
            let n = unsafe {
                libc::sendmmsg(self.0.as_raw_fd(), messages.as_mut_ptr(), messages.len() as u32, 0)
            };
            sent += usize::try_from(n).unwrap_or(0);
        }
        sent
    }
}

/// An `AF_PACKET` socket for `protocol` on `dev` (in the calling
/// thread's namespace), with a receive timeout.
pub(crate) fn packet_socket(dev: &str, protocol: u16, timeout: Option<Duration>) -> OwnedFd {
    let protocol = protocol.to_be();
    // SAFETY: plain socket call; the descriptor is owned at once.
    let fd = unsafe {
        libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, i32::from(protocol))
    };
    assert!(fd >= 0, "socket(AF_PACKET): {}", std::io::Error::last_os_error());
    // SAFETY: a descriptor we just made.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let name = std::ffi::CString::new(dev).unwrap();
    // SAFETY: a NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    assert_ne!(ifindex, 0, "no interface {dev}");
    // SAFETY: a zeroed sockaddr_ll is valid; we fill what bind reads.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = protocol;
    addr.sll_ifindex = ifindex as i32;
    // SAFETY: the address and its size.
    let bound = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const addr).cast(),
            size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    assert_eq!(bound, 0, "bind to {dev}: {}", std::io::Error::last_os_error());
    if let Some(timeout) = timeout {
        let tv = libc::timeval { tv_sec: 0, tv_usec: timeout.as_micros() as libc::suseconds_t };
        // SAFETY: the option's value and its size.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const tv).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
    }
    fd
}

/// `aa:bb:cc:dd:ee:ff` as bytes.
pub fn parse_mac(text: &str) -> [u8; 6] {
    let mut mac = [0u8; 6];
    for (byte, part) in mac.iter_mut().zip(text.split(':')) {
        *byte = u8::from_str_radix(part, 16).unwrap();
    }
    mac
}
