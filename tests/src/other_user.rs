//! What another local user can reach: an attempt (connecting to a unix
//! socket, opening a file to write, opening a directory) made in a forked
//! child as uid and gid 65534 (`nobody`), or as root for the control.
//! After the fork the child makes only system calls: the test process
//! has other threads, and the child has none of them.

use std::{ffi::CString, os::unix::ffi::OsStrExt as _, path::Path};

/// Who makes an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum As {
    Root,
    Nobody,
}

/// What an attempt is.
pub enum Attempt<'a> {
    /// `connect` to the unix socket at the path.
    Connect(&'a Path),
    /// `open` the file for writing (not creating it).
    Write(&'a Path),
    /// `open` the directory.
    List(&'a Path),
}

/// Makes `attempt` as `who`: `Ok(())` if it succeeded, or the error it
/// met (`EACCES`: denied).
pub fn try_as(who: As, attempt: Attempt) -> std::io::Result<()> {
    let path = match attempt {
        Attempt::Connect(p) | Attempt::Write(p) | Attempt::List(p) => p,
    };
    let c_path = CString::new(path.as_os_str().as_bytes()).expect("a path without NUL");
    // SAFETY: zeroed is a valid sockaddr_un; the path is copied in below.
    let mut address: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    address.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    assert!(bytes.len() < address.sun_path.len(), "{} is too long for a socket", path.display());
    for (to, from) in address.sun_path.iter_mut().zip(bytes) {
        *to = *from as libc::c_char;
    }
    // SAFETY: the child makes only async-signal-safe system calls on
    // memory prepared before the fork, and leaves by _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: as above.
        unsafe {
            let dropped = who == As::Root
                || (libc::setgroups(0, std::ptr::null()) == 0
                    && libc::setgid(65_534) == 0
                    && libc::setuid(65_534) == 0);
            if !dropped {
                libc::_exit(255);
            }
            let fd = match attempt {
                Attempt::Connect(_) => {
                    let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                    let size = size_of::<libc::sockaddr_un>() as libc::socklen_t;
                    if fd < 0 || libc::connect(fd, (&raw const address).cast(), size) != 0 {
                        -1
                    } else {
                        fd
                    }
                }
                Attempt::Write(_) => libc::open(c_path.as_ptr(), libc::O_WRONLY),
                Attempt::List(_) => libc::open(c_path.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY),
            };
            libc::_exit(if fd >= 0 { 0 } else { (*libc::__errno_location()).clamp(1, 254) });
        }
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid, "waitpid: {}", std::io::Error::last_os_error());
    assert!(libc::WIFEXITED(status), "the child did not exit: {status}");
    match libc::WEXITSTATUS(status) {
        0 => Ok(()),
        255 => panic!("the child could not become uid 65534"),
        errno => Err(std::io::Error::from_raw_os_error(errno)),
    }
}
