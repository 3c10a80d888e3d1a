//! A fake DNS server for discovery tests: UDP and TCP on one loopback
//! port, answering A and AAAA queries from a table the test changes, built
//! with hickory-proto. [`FakeDns::set_mode`] makes it answer SERVFAIL or
//! NXDOMAIN, or drop queries (a timeout).
//!
//! It runs on the tokio runtime of the test that starts it; dropping it
//! stops it.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
};

use hickory_proto::{
    op::{Message, MessageType, OpCode, ResponseCode},
    rr::{
        Name, RData, Record, RecordType,
        rdata::{A, AAAA},
    },
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream, UdpSocket},
    task::JoinHandle,
};

/// How the server answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// From the table: the records, or NXDOMAIN for a name not in it.
    Answer,
    /// SERVFAIL to every query.
    ServFail,
    /// NXDOMAIN to every query.
    NxDomain,
    /// No answer at all.
    Drop,
}

struct State {
    mode: Mode,
    /// Lower-case name with the final dot → (addresses, TTL).
    records: HashMap<String, (Vec<IpAddr>, u32)>,
    queries: usize,
}

/// The fake DNS server.
pub struct FakeDns {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    tasks: Vec<JoinHandle<()>>,
}

fn key(name: &str) -> String {
    let mut name = name.to_ascii_lowercase();
    if !name.ends_with('.') {
        name.push('.');
    }
    name
}

impl FakeDns {
    /// Starts on `127.0.0.1`, UDP and TCP on the same port.
    pub async fn start() -> Self {
        let state =
            Arc::new(Mutex::new(State { mode: Mode::Answer, records: HashMap::new(), queries: 0 }));
        // A port free for both protocols.
        let (udp, tcp) = loop {
            let udp = UdpSocket::bind("127.0.0.1:0").await.expect("fake dns: bind udp");
            if let Ok(tcp) = TcpListener::bind(udp.local_addr().unwrap()).await {
                break (udp, tcp);
            }
        };
        let addr = udp.local_addr().unwrap();
        let udp_task = tokio::spawn(serve_udp(udp, state.clone()));
        let tcp_task = tokio::spawn(serve_tcp(tcp, state.clone()));
        Self { addr, state, tasks: vec![udp_task, tcp_task] }
    }

    /// Where it listens, UDP and TCP.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets the addresses of `name` (A and AAAA alike, by family) and
    /// their TTL.
    pub fn set(&self, name: &str, addrs: &[IpAddr], ttl: u32) {
        self.state.lock().unwrap().records.insert(key(name), (addrs.to_vec(), ttl));
    }

    /// Removes `name`: NXDOMAIN.
    pub fn remove(&self, name: &str) {
        self.state.lock().unwrap().records.remove(&key(name));
    }

    /// How it answers from now on.
    pub fn set_mode(&self, mode: Mode) {
        self.state.lock().unwrap().mode = mode;
    }

    /// Queries received so far.
    pub fn queries(&self) -> usize {
        self.state.lock().unwrap().queries
    }
}

impl Drop for FakeDns {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The answer to one query, or `None` to stay silent.
fn answer(state: &Mutex<State>, query: &[u8]) -> Option<Vec<u8>> {
    let request = Message::from_vec(query).ok()?;
    let mut state = state.lock().unwrap();
    state.queries += 1;
    let mut response = Message::response(request.metadata.id, OpCode::Query);
    response.metadata.message_type = MessageType::Response;
    response.metadata.recursion_desired = request.metadata.recursion_desired;
    response.metadata.recursion_available = true;
    response.metadata.authoritative = true;
    response.add_queries(request.queries.iter().cloned());
    match state.mode {
        Mode::Drop => return None,
        Mode::ServFail => response.metadata.response_code = ResponseCode::ServFail,
        Mode::NxDomain => response.metadata.response_code = ResponseCode::NXDomain,
        Mode::Answer => {
            for q in &request.queries {
                let name: &Name = q.name();
                match state.records.get(&key(&name.to_ascii())) {
                    None => response.metadata.response_code = ResponseCode::NXDomain,
                    Some((addrs, ttl)) => {
                        for ip in addrs {
                            let data = match (ip, q.query_type()) {
                                (IpAddr::V4(v4), RecordType::A) => RData::A(A(*v4)),
                                (IpAddr::V6(v6), RecordType::AAAA) => RData::AAAA(AAAA(*v6)),
                                _ => continue,
                            };
                            response.add_answer(Record::from_rdata(name.clone(), *ttl, data));
                        }
                    }
                }
            }
        }
    }
    response.to_vec().ok()
}

async fn serve_udp(socket: UdpSocket, state: Arc<Mutex<State>>) {
    let mut buf = vec![0u8; 4096];
    loop {
        let Ok((n, from)) = socket.recv_from(&mut buf).await else {
            continue;
        };
        if let Some(reply) = answer(&state, &buf[..n]) {
            let _ = socket.send_to(&reply, from).await;
        }
    }
}

async fn serve_tcp(listener: TcpListener, state: Arc<Mutex<State>>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(serve_tcp_connection(stream, state.clone()));
    }
}

async fn serve_tcp_connection(mut stream: TcpStream, state: Arc<Mutex<State>>) {
    loop {
        let Ok(len) = stream.read_u16().await else {
            return;
        };
        let mut query = vec![0u8; usize::from(len)];
        if stream.read_exact(&mut query).await.is_err() {
            return;
        }
        let Some(reply) = answer(&state, &query) else {
            continue;
        };
        let Ok(len) = u16::try_from(reply.len()) else {
            return;
        };
        if stream.write_u16(len).await.is_err() || stream.write_all(&reply).await.is_err() {
            return;
        }
    }
}
