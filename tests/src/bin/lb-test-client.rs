//! A client the integration tests run *inside* the test cgroup, so that its
//! connects go through the datapath. It reads commands on stdin and answers
//! one line each on stdout:
//!
//! - `connect ADDR` → `ok ID PEER GREETING` or `err MESSAGE`: TCP connect,
//!   then `getpeername` (what the application sees) and the server's answer
//!   to `who` (which server really accepted);
//! - `udp ADDR` → `ok ID PEER GREETING`: connected UDP, one datagram each way;
//! - `alive ID` → `alive` or `dead MESSAGE`: is TCP connection ID still open;
//! - `close ID` → `closed`.
//!
//! Every read has a timeout, so a test can never hang on it.

use std::{
    collections::HashMap,
    io::{BufRead as _, BufReader, ErrorKind, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

const TIMEOUT: Duration = Duration::from_secs(5);

fn main() {
    let mut conns: HashMap<u32, TcpStream> = HashMap::new();
    let mut next_id = 0u32;
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let mut words = line.split_whitespace();
        let answer = match (words.next(), words.next()) {
            (Some("connect"), Some(addr)) => match connect(addr) {
                Ok((stream, peer, greeting)) => {
                    next_id += 1;
                    conns.insert(next_id, stream);
                    format!("ok {next_id} {peer} {greeting}")
                }
                Err(e) => format!("err {e}"),
            },
            (Some("udp"), Some(addr)) => match udp(addr) {
                Ok((peer, greeting)) => format!("ok 0 {peer} {greeting}"),
                Err(e) => format!("err {e}"),
            },
            (Some("alive"), Some(id)) => match id.parse().ok().and_then(|id: u32| conns.get(&id)) {
                Some(stream) => alive(stream),
                None => "err no such connection".to_owned(),
            },
            (Some("close"), Some(id)) => {
                id.parse().ok().and_then(|id: u32| conns.remove(&id));
                "closed".to_owned()
            }
            (Some("exit"), _) => break,
            _ => format!("err bad command {line:?}"),
        };
        let mut out = stdout.lock();
        let _ = writeln!(out, "{answer}");
        let _ = out.flush();
    }
}

fn connect(addr: &str) -> Result<(TcpStream, SocketAddr, String), String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("bad address: {e}"))?;
    let stream = TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| e.to_string().replace(' ', "_"))?;
    let peer = stream.peer_addr().map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    (&stream).write_all(b"who\n").map_err(|e| format!("send:{}", e.kind()))?;
    let mut greeting = String::new();
    let mut reader = BufReader::new(&stream);
    reader.read_line(&mut greeting).map_err(|e| format!("no_greeting:{}", e.kind()))?;
    Ok((stream, peer, greeting.trim().to_owned()))
}

fn udp(addr: &str) -> Result<(SocketAddr, String), String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("bad address: {e}"))?;
    let bind: SocketAddr = if addr.is_ipv4() { "0.0.0.0:0".parse().unwrap() } else { "[::]:0".parse().unwrap() };
    let socket = UdpSocket::bind(bind).map_err(|e| e.to_string())?;
    socket.connect(addr).map_err(|e| e.to_string().replace(' ', "_"))?;
    let peer = socket.peer_addr().map_err(|e| e.to_string())?;
    socket.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    socket.send(b"hello").map_err(|e| e.to_string())?;
    let mut buf = [0u8; 64];
    let n = socket.recv(&mut buf).map_err(|e| format!("no_reply:{}", e.kind()))?;
    Ok((peer, String::from_utf8_lossy(&buf[..n]).trim().to_owned()))
}

/// Open means: no EOF and no error pending (a destroyed socket reports
/// ECONNABORTED, a reset one ECONNRESET).
fn alive(stream: &TcpStream) -> String {
    let _ = stream.set_nonblocking(true);
    let mut buf = [0u8; 1];
    let result = (&*stream).peek(&mut buf);
    let _ = stream.set_nonblocking(false);
    match result {
        Err(e) if e.kind() == ErrorKind::WouldBlock => "alive".to_owned(),
        Ok(0) => "dead eof".to_owned(),
        Ok(_) => "alive".to_owned(),
        Err(e) => format!("dead {}", e.kind()),
    }
}
