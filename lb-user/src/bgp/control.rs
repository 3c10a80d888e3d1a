//! BIRD's control socket, its machine interface: a command is a line;
//! each line of the reply starts with a four-digit code, followed by `-`
//! while more lines of the reply follow (a line starting with a space
//! continues the one before), or by a space on the last. Codes 0xxx say
//! an action was done, 1xxx and 2xxx carry a table, 8xxx and 9xxx are
//! errors (`doc/prog-client` in BIRD's sources). Every exchange is
//! bounded by [`TIMEOUT`].

use std::{
    io::{BufReader, Write as _},
    os::unix::net::UnixStream,
    path::Path,
    time::Duration,
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
    let stream = UnixStream::connect(socket)
        .with_context(|| format!("connecting to BIRD's control socket {}", socket.display()))?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    // The greeting: `0001 BIRD 2.0.12 ready.`
    read_reply(&mut reader).context("reading BIRD's greeting")?;
    (&stream).write_all(format!("{command}\n").as_bytes())?;
    let reply = read_reply(&mut reader).with_context(|| format!("BIRD's reply to {command:?}"))?;
    if let Some(error) = reply.iter().find(|l| l.code >= 8000) {
        bail!("BIRD refused {command:?}: {} {}", error.code, error.text);
    }
    Ok(reply)
}

/// Reads one reply, up to its last line.
fn read_reply(reader: &mut impl std::io::BufRead) -> anyhow::Result<Vec<Line>> {
    let mut lines = Vec::new();
    let mut code = 0;
    for _ in 0..MAX_LINES {
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
        let reply = read_reply(&mut text.as_bytes()).unwrap();
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
        let reply = read_reply(&mut text.as_bytes()).unwrap();
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
    fn a_cut_or_endless_reply_is_an_error_not_a_hang() {
        assert!(read_reply(&mut "1002-a\n".as_bytes()).is_err(), "cut");
        let endless = "1002-x\n".repeat(MAX_LINES + 1);
        assert!(read_reply(&mut endless.as_bytes()).is_err(), "endless");
        assert_eq!(parse_line("0003 Reconfigured"), Some((3, true, "Reconfigured")));
        assert_eq!(parse_line("9001 syntax error"), Some((9001, true, "syntax error")));
        assert_eq!(parse_line("abcd"), None);
    }
}
