//! Unconnected UDP through a VIP, the way musl's resolver sends: DNS
//! queries with `sendto()` on one socket, answers with `recvfrom()`.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv6Addr, SocketAddr, UdpSocket},
    time::Duration,
};

use hickory_proto::{
    op::{Message, Query},
    rr::{Name, RData, RecordType},
};

/// The name the tests' DNS servers answer, each with an address of its own.
const NAME: &str = "web.lb.test.";

/// An unconnected socket of the family that can send to `to` (IPv6 for an
/// IPv4-mapped address).
fn unconnected(to: &SocketAddr) -> std::io::Result<UdpSocket> {
    let any: SocketAddr = match to {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().expect("an address"),
        SocketAddr::V6(_) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
    };
    UdpSocket::bind(any)
}

/// The id of `churn-sendto`'s queries, which no `sendto` run uses: their
/// answers outlive the sockets that asked, and a later socket of another
/// test that gets the same port must not take one for its own (one did,
/// and a query seemed answered by another test's server).
const CHURN_ID: u16 = u16::MAX;

fn query(id: u16) -> Vec<u8> {
    let mut message = Message::query();
    message.metadata.id = id;
    message.metadata.recursion_desired = true;
    message.add_query(Query::query(Name::from_ascii(NAME).expect("a name"), RecordType::A));
    message.to_vec().expect("a query encodes")
}

/// `sendto ADDR N` → `sendto sent=N answered=A from_addr=F sources=SRC:N,...
/// names=IP:N,...`: one unconnected socket sends N queries to ADDR, one
/// at a time, and reads each answer (2 s at most; the first query left
/// unanswered ends the run, so it is bounded); `from_addr` counts the
/// answers whose source, as `recvfrom()` reports it, is ADDR, `sources`
/// counts every source, and `names` the addresses the answers carried
/// (which server answered). The socket is returned, for the caller to
/// keep open until the next `sendto`.
pub fn sendto(addr: &str, n: Option<&str>) -> Result<(String, UdpSocket), String> {
    let to: SocketAddr = addr.parse().map_err(|e| format!("bad address {addr}: {e}"))?;
    let n: u16 = n
        .and_then(|n| n.parse().ok())
        .filter(|n| *n < CHURN_ID)
        .ok_or("usage: sendto ADDR N (N < 65535)")?;
    let socket = unconnected(&to).map_err(|e| format!("socket: {e}"))?;
    socket.set_read_timeout(Some(Duration::from_secs(2))).map_err(|e| e.to_string())?;
    let (mut sent, mut answered, mut from_addr) = (0, 0, 0);
    let mut sources: BTreeMap<String, usize> = BTreeMap::new();
    let mut names: BTreeMap<String, usize> = BTreeMap::new();
    let mut buf = [0u8; 1500];
    for id in 0..n {
        if let Err(e) = socket.send_to(&query(id), to) {
            return Err(format!("sendto {to} (query {id}): {e}"));
        }
        sent += 1;
        // Answers to this query only: a late answer to an earlier one is
        // read and dropped.
        let mut answered_this = false;
        while let Ok((len, from)) = socket.recv_from(&mut buf) {
            let Ok(answer) = Message::from_vec(&buf[..len]) else { continue };
            if answer.metadata.id != id {
                continue;
            }
            answered += 1;
            answered_this = true;
            from_addr += usize::from(from == to);
            *sources.entry(from.to_string()).or_default() += 1;
            for record in &answer.answers {
                if let RData::A(a) = &record.data {
                    *names.entry(a.0.to_string()).or_default() += 1;
                }
            }
            break;
        }
        if !answered_this {
            break;
        }
    }
    let list = |m: &BTreeMap<String, usize>| {
        m.iter().map(|(k, v)| format!("{k}:{v}")).collect::<Vec<_>>().join(",")
    };
    let answer = format!(
        "sendto sent={sent} answered={answered} from_addr={from_addr} sources={} names={}",
        list(&sources),
        list(&names)
    );
    Ok((answer, socket))
}

/// `churn-sendto ADDR N` → `churned ok=K failed=F`: N unconnected
/// sockets one after the other, each sends one query to ADDR and is
/// closed without waiting for the answer.
pub fn churn_sendto(addr: &str, n: Option<&str>) -> Result<String, String> {
    let to: SocketAddr = addr.parse().map_err(|e| format!("bad address {addr}: {e}"))?;
    let n: usize = n.and_then(|n| n.parse().ok()).ok_or("usage: churn-sendto ADDR N")?;
    let datagram = query(CHURN_ID);
    let (mut ok, mut failed) = (0, 0);
    for _ in 0..n {
        match unconnected(&to).and_then(|socket| socket.send_to(&datagram, to)) {
            Ok(_) => ok += 1,
            Err(_) => failed += 1,
        }
    }
    Ok(format!("churned ok={ok} failed={failed}"))
}
