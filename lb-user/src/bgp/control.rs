//! BIRD's control socket, its machine interface: a command is a line;
//! each line of the reply starts with a four-digit code, followed by `-`
//! while more lines of the reply follow (a line starting with a space
//! continues the one before), or by a space on the last. Codes 0xxx say
//! an action was done, 1xxx and 2xxx carry a table, 8xxx and 9xxx are
//! errors (`doc/prog-client` in BIRD's sources). Every exchange is
//! bounded by [`TIMEOUT`], and a BIRD that no longer accepts connections
//! (frozen, its queue full) is told at once rather than waited for.

use std::{
    io::{BufReader, Write as _},
    os::{fd::OwnedFd, unix::net::UnixStream},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

/// How long one command may take, connect to last line.
pub const TIMEOUT: Duration = Duration::from_secs(2);
/// The most reply lines read for one command (a bound, not a limit a
/// real reply of lb's few protocols comes near).
const MAX_LINES: usize = 10_000;

/// One line of a reply: its code (the last code seen, for a continuation)
/// and its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Line {
    /// Its four-digit code.
    pub code: u16,
    /// What follows the code.
    pub text: String,
}

/// Sends `command` to the BIRD listening on `socket`; its reply, or the
/// error it answered with.
pub fn command(socket: &Path, command: &str) -> anyhow::Result<Vec<Line>> {
    let deadline = Instant::now() + TIMEOUT;
    let stream = connect(socket)
        .with_context(|| format!("connecting to BIRD's control socket {}", socket.display()))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    // The greeting: `0001 BIRD 2.0.12 ready.`
    // Each read may wait only for what is left of the exchange's time.
    let mut in_time = || {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("BIRD did not answer within {TIMEOUT:?}");
        }
        Ok(stream.set_read_timeout(Some(left))?)
    };
    read_reply(&mut reader, &mut in_time).context("reading BIRD's greeting")?;
    (&stream).write_all(format!("{command}\n").as_bytes())?;
    let reply = read_reply(&mut reader, &mut in_time)
        .with_context(|| format!("BIRD's reply to {command:?}"))?;
    if let Some(error) = reply.iter().find(|l| l.code >= 8000) {
        bail!("BIRD refused {command:?}: {} {}", error.code, error.text);
    }
    Ok(reply)
}

/// Connects without waiting: a BIRD that does not accept (its queue of
/// connections full) is an error at once, where a blocking connect would
/// wait for it without end.
fn connect(socket: &Path) -> std::io::Result<UnixStream> {
    use socket2::{Domain, SockAddr, Socket, Type};
    let raw = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    raw.set_nonblocking(true)?;
    match raw.connect(&SockAddr::unix(socket)?) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
            return Err(std::io::Error::new(
                e.kind(),
                "BIRD accepts no connection (frozen or overloaded: its queue is full)",
            ));
        }
        Err(e) => return Err(e),
    }
    raw.set_nonblocking(false)?;
    Ok(UnixStream::from(OwnedFd::from(raw)))
}

/// Reads one reply from `reader`, up to its last line; `in_time` before
/// each line says whether there is time left (and bounds the read).
fn read_reply(
    reader: &mut impl std::io::BufRead,
    in_time: &mut impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Vec<Line>> {
    let mut lines = Vec::new();
    let mut code = 0;
    for _ in 0..MAX_LINES {
        in_time()?;
        let mut raw = String::new();
        if reader.read_line(&mut raw)? == 0 {
            bail!("BIRD closed the socket mid-reply");
        }
        let raw = raw.trim_end_matches('\n');
        let (last, text) = match parse_line(raw) {
            Some((c, last, text)) => {
                code = c;
                (last, text)
            }
            // A continuation: " text".
            None => (false, raw.strip_prefix(' ').unwrap_or(raw)),
        };
        lines.push(Line { code, text: text.to_owned() });
        if last {
            return Ok(lines);
        }
    }
    bail!("BIRD's reply ran past {MAX_LINES} lines")
}

/// `dddd-text` or `dddd text`: the code, whether it is the last line, the
/// text.
fn parse_line(raw: &str) -> Option<(u16, bool, &str)> {
    let code = raw.get(..4)?;
    if !code.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let last = match raw.as_bytes().get(4) {
        Some(b'-') => false,
        Some(b' ') | None => true,
        Some(_) => return None,
    };
    Some((code.parse().ok()?, last, raw.get(5..).unwrap_or("")))
}

/// A BGP session as `show protocols` lists it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Session {
    /// lb's name for it (`lb_peer0`...).
    pub name: String,
    /// `up`, `start`, `down`...
    pub state: String,
    /// `Established`, `Active`, `Idle`..., and any error BIRD gives.
    pub info: String,
}

/// The BGP sessions in a `show protocols` reply (code 1002 rows).
pub fn sessions(reply: &[Line]) -> Vec<Session> {
    reply
        .iter()
        .filter(|l| l.code == 1002)
        .filter_map(|l| {
            let mut words = l.text.split_whitespace();
            let name = words.next()?;
            let proto = words.next()?;
            if proto != "BGP" {
                return None;
            }
            let _table = words.next()?;
            let state = words.next()?;
            let _since = words.next()?;
            let info: Vec<&str> = words.collect();
            Some(Session { name: name.to_owned(), state: state.to_owned(), info: info.join(" ") })
        })
        .collect()
}

/// The BFD sessions in a `show bfd sessions` reply (code 1020 rows: the
/// peer's address, its interface, the state): each peer's address and
/// state (`Up`, `Down`, `Init`, `AdminDown`).
pub fn bfd_sessions(reply: &[Line]) -> Vec<(std::net::IpAddr, String)> {
    const STATES: [&str; 4] = ["Up", "Down", "Init", "AdminDown"];
    reply
        .iter()
        .filter(|l| l.code == 1020)
        .filter_map(|l| {
            let mut words = l.text.split_whitespace();
            let address = words.next()?.parse().ok()?;
            let state = words.find(|w| STATES.contains(w))?;
            Some((address, state.to_owned()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_is_read_to_its_last_line_and_its_sessions_found() {
        let text = "2002-Name       Proto      Table      State  Since         Info\n\
                    1002-device1    Device     ---        up     13:45:15.758  \n \
                    lb_peer0   BGP        ---        up     13:45:20.207  Established   \n \
                    lb_peer1   BGP        ---        start  13:45:24.333  Idle          Error: BFD session down\n\
                    0000 \n";
        let reply = read_reply(&mut text.as_bytes(), &mut || Ok(())).unwrap();
        assert_eq!(reply.len(), 5);
        assert_eq!(reply[2].code, 1002, "a continuation keeps the code before it");
        let sessions = sessions(&reply);
        assert_eq!(sessions.len(), 2);
        assert_eq!((sessions[0].name.as_str(), sessions[0].state.as_str()), ("lb_peer0", "up"));
        assert_eq!(sessions[0].info, "Established");
        assert_eq!(sessions[1].info, "Idle Error: BFD session down");
    }

    #[test]
    fn bfd_sessions_are_found_by_address() {
        let text = "1020-lb_bfd:\n \
                    IP address                Interface  State      Since         Interval  Timeout\n \
                    198.18.0.254              ext0       Up         13:45:20.207    0.100    0.300\n \
                    2001:2::fe                ext0       Down       13:45:24.333    1.000    0.000\n\
                    0000 \n";
        let reply = read_reply(&mut text.as_bytes(), &mut || Ok(())).unwrap();
        let sessions = bfd_sessions(&reply);
        assert_eq!(
            sessions,
            [
                ("198.18.0.254".parse().unwrap(), "Up".to_owned()),
                ("2001:2::fe".parse().unwrap(), "Down".to_owned())
            ]
        );
    }

    #[test]
    fn a_bird_that_accepts_nothing_is_told_at_once_not_waited_for() {
        // A listener that never accepts: its queue fills, as a frozen
        // BIRD's does, and a connect must then fail, not block.
        let dir = std::env::temp_dir().join(format!("lb-unit-bird-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bird.ctl");
        let _ = std::fs::remove_file(&path);
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mut held = Vec::new();
        let refused = (0..10_000).find_map(|_| match connect(&path) {
            Ok(stream) => {
                held.push(stream);
                None
            }
            Err(e) => Some(e),
        });
        let refused = refused.expect("the queue never filled");
        assert_eq!(refused.kind(), std::io::ErrorKind::WouldBlock, "{refused}");
        // And a command says so, within its time.
        let started = Instant::now();
        let error = command(&path, "show status").unwrap_err();
        assert!(format!("{error:#}").contains("accepts no connection"), "{error:#}");
        assert!(started.elapsed() < TIMEOUT, "waited {:?}", started.elapsed());
        drop(held);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_silent_bird_is_given_up_at_the_deadline() {
        // Accepted, never greeted: the greeting's read ends at the deadline.
        let dir = std::env::temp_dir().join(format!("lb-unit-bird-silent-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bird.ctl");
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let started = Instant::now();
        let error = command(&path, "show status").unwrap_err();
        assert!(started.elapsed() >= TIMEOUT, "gave up after {:?}", started.elapsed());
        assert!(format!("{error:#}").contains("greeting"), "{error:#}");
        drop(listener);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_cut_or_endless_reply_is_an_error_not_a_hang() {
        assert!(read_reply(&mut "1002-a\n".as_bytes(), &mut || Ok(())).is_err(), "cut");
        let endless = "1002-x\n".repeat(MAX_LINES + 1);
        assert!(read_reply(&mut endless.as_bytes(), &mut || Ok(())).is_err(), "endless");
        assert_eq!(parse_line("0003 Reconfigured"), Some((3, true, "Reconfigured")));
        assert_eq!(parse_line("9001 syntax error"), Some((9001, true, "syntax error")));
        assert_eq!(parse_line("abcd"), None);
    }
}
