//! The DNS check (`check = "dns"`): one query over UDP, from a socket of
//! its own connected to the server, for the configured name and type. Any
//! well-formed answer to it passes (the same id, a response, the same
//! question), NXDOMAIN included: the server answered. A refusal (REFUSED,
//! or nothing listening: the port is unreachable), another error code
//! (SERVFAIL, FORMERR, NOTIMP), an answer to something else, garbage or no
//! answer within the timeout fails.

use std::net::SocketAddr;

use hickory_proto::{
    op::{Message, MessageType, Query, ResponseCode},
    rr::{Name, RecordType},
};
use tokio::net::UdpSocket;

use crate::balancer::Health;

/// The question a DNS check asks.
#[derive(Clone, Debug)]
pub(super) struct Question {
    query: Query,
}

impl Question {
    /// `name` and `record_type` as the config checked them.
    pub(super) fn new(name: &str, record_type: &str) -> anyhow::Result<Self> {
        let name = Name::from_ascii(name)
            .map_err(|e| anyhow::anyhow!("health.query: {name:?} is not a DNS name: {e}"))?;
        let record_type: RecordType = record_type.parse().map_err(|e| {
            anyhow::anyhow!("health.query_type: {record_type:?} is not a record type: {e}")
        })?;
        Ok(Self { query: Query::query(name, record_type) })
    }

    /// One check of `server` (the caller bounds it in time).
    pub(super) async fn ask(&self, server: SocketAddr) -> Health {
        let what = format!("dns {} {}", self.query.name(), self.query.query_type());
        let fail = |why: String| Health::Fail(format!("{what}: {why}"));
        let any: SocketAddr =
            if server.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { ([0u16; 8], 0).into() };
        let socket = match UdpSocket::bind(any).await {
            Ok(socket) => socket,
            Err(e) => return fail(format!("binding a UDP socket: {e}")),
        };
        if let Err(e) = socket.connect(server).await {
            return fail(format!("connecting the UDP socket: {e}"));
        }
        let mut request = Message::query();
        request.metadata.recursion_desired = true;
        request.add_query(self.query.clone());
        let bytes = match request.to_vec() {
            Ok(bytes) => bytes,
            Err(e) => return fail(format!("encoding the query: {e}")),
        };
        if let Err(e) = socket.send(&bytes).await {
            return fail(format!("sending the query: {e}"));
        }
        let mut buf = vec![0u8; 4096];
        let n = match socket.recv(&mut buf).await {
            Ok(n) => n,
            // ECONNREFUSED: an ICMP port unreachable came back.
            Err(e) => return fail(e.to_string()),
        };
        let answer = match Message::from_vec(&buf[..n]) {
            Ok(answer) => answer,
            Err(e) => return fail(format!("an answer that is not DNS ({n} bytes): {e}")),
        };
        judge(&request, &answer).map_or(Health::Pass, fail)
    }
}

/// Whether `answer` answers `request` well: `None`, or why not.
fn judge(request: &Message, answer: &Message) -> Option<String> {
    if answer.metadata.message_type != MessageType::Response {
        return Some("the server sent a query, not an answer".to_owned());
    }
    if answer.metadata.id != request.metadata.id {
        return Some(format!(
            "an answer with id {}, not the query's {}",
            answer.metadata.id, request.metadata.id
        ));
    }
    if answer.queries != request.queries {
        return Some("an answer to another question".to_owned());
    }
    match answer.metadata.response_code {
        ResponseCode::NoError | ResponseCode::NXDomain => None,
        code => Some(format!("answered {code}")),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A server that answers each query with what `reply` makes of it
    /// (`None`: silence), and the address it listens on.
    async fn server(reply: fn(&Message) -> Option<Vec<u8>>) -> SocketAddr {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                let Ok(query) = Message::from_vec(&buf[..n]) else { continue };
                if let Some(bytes) = reply(&query) {
                    let _ = socket.send_to(&bytes, from).await;
                }
            }
        });
        addr
    }

    fn response(query: &Message, code: ResponseCode) -> Message {
        let mut answer = Message::response(query.metadata.id, query.metadata.op_code);
        answer.metadata.response_code = code;
        answer.add_queries(query.queries.iter().cloned());
        answer
    }

    async fn check(reply: fn(&Message) -> Option<Vec<u8>>) -> Health {
        let question = Question::new("kubernetes.default.svc.cluster.local.", "A").unwrap();
        let server = server(reply).await;
        tokio::time::timeout(Duration::from_millis(500), question.ask(server))
            .await
            .unwrap_or_else(|_| Health::Fail("timeout".to_owned()))
    }

    fn failed(health: &Health, why: &str) -> bool {
        matches!(health, Health::Fail(reason) if reason.contains(why))
    }

    #[tokio::test]
    async fn an_answer_or_nxdomain_passes() {
        assert_eq!(check(|q| response(q, ResponseCode::NoError).to_vec().ok()).await, Health::Pass);
        assert_eq!(
            check(|q| response(q, ResponseCode::NXDomain).to_vec().ok()).await,
            Health::Pass
        );
    }

    #[tokio::test]
    async fn refusals_errors_strangers_and_garbage_fail() {
        let health = check(|q| response(q, ResponseCode::Refused).to_vec().ok()).await;
        assert!(failed(&health, "answered Query Refused"), "{health:?}");
        let health = check(|q| response(q, ResponseCode::ServFail).to_vec().ok()).await;
        assert!(failed(&health, "answered Server Failure"), "{health:?}");
        let health = check(|q| {
            let mut other = response(q, ResponseCode::NoError);
            other.metadata.id = q.metadata.id.wrapping_add(1);
            other.to_vec().ok()
        })
        .await;
        assert!(failed(&health, "not the query's"), "{health:?}");
        let health = check(|q| {
            let mut other = Message::response(q.metadata.id, q.metadata.op_code);
            other.add_query(Query::query(Name::from_ascii("example.org.").unwrap(), RecordType::A));
            other.to_vec().ok()
        })
        .await;
        assert!(failed(&health, "another question"), "{health:?}");
        let health = check(|_| Some(b"not dns".to_vec())).await;
        assert!(failed(&health, "not DNS"), "{health:?}");
        assert!(failed(&check(|_| None).await, "timeout"));
    }

    #[tokio::test]
    async fn nothing_listening_fails_at_once() {
        // A port bound and closed again: nothing listens there now.
        let addr = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let question = Question::new("example.org.", "AAAA").unwrap();
        let health = tokio::time::timeout(Duration::from_secs(2), question.ask(addr))
            .await
            .expect("a refusal comes back at once");
        assert!(failed(&health, "refused"), "{health:?}");
    }
}
