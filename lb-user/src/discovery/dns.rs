//! DNS discovery: the A (IPv4 VIP) or AAAA (IPv6 VIP) records of a name.
//!
//! The name is resolved (hickory-resolver; the system's resolv.conf, or
//! one name server given in [`super::Options`] or `LB_DNS_SERVER`), each
//! address becomes a ready server on the configured port, and the name is
//! resolved again when the records' TTL (the smallest) runs out, clamped to
//! `refresh_min..=refresh_max`. The resolver's cache is emptied before
//! each resolution, so a refresh always asks the server. NXDOMAIN,
//! SERVFAIL, a refusal or a timeout is sent as an `Err` (the daemon keeps
//! its last list), and the name is tried again after `refresh_min`. A name
//! that exists with no address of the family (NODATA) is an empty list.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use hickory_resolver::{
    TokioResolver,
    config::{ConnectionConfig, NameServerConfig, ResolverConfig, ResolverOpts},
    net::{DnsError, NetError, runtime::TokioRuntimeProvider},
    proto::{
        op::ResponseCode,
        rr::{RData, Record, RecordType},
    },
};
use tokio::sync::mpsc;

use super::{
    Endpoint,
    forward::{Signal, rank},
};
use crate::balancer::Readiness;

/// How long one query waits for an answer, by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// Queries per resolution (the first, and one retry).
const ATTEMPTS: usize = 2;

/// What to resolve.
#[derive(Clone, Debug)]
pub(crate) struct Target {
    /// The lb service (for logs).
    pub service: String,
    pub host: String,
    pub port: u16,
    pub vip: SocketAddr,
    pub refresh_min: Duration,
    pub refresh_max: Duration,
}

/// Which resolver to use.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ResolverChoice {
    /// One name server; `None`: the system's configuration.
    pub server: Option<SocketAddr>,
    pub timeout: Option<Duration>,
}

/// Resolves `target` until `signals` closes.
pub(crate) async fn run(target: Target, choice: ResolverChoice, signals: mpsc::Sender<Signal>) {
    let record_type = if target.vip.is_ipv4() { RecordType::A } else { RecordType::AAAA };
    loop {
        let (signal, wait) = match resolver(choice) {
            Err(error) => (Signal::Failed(format!("dns: {error}")), target.refresh_min),
            Ok(resolver) => {
                let (signal, wait) = resolve(&resolver, &target, record_type).await;
                (signal, wait)
            }
        };
        if let Signal::Failed(error) = &signal {
            tracing::warn!(service = %target.service, "{error}");
        }
        if signals.send(signal).await.is_err() {
            return;
        }
        tokio::time::sleep(wait).await;
    }
}

/// One resolution: the signal to send and how long until the next one.
async fn resolve(
    resolver: &TokioResolver,
    target: &Target,
    record_type: RecordType,
) -> (Signal, Duration) {
    resolver.clear_cache();
    match resolver.lookup(target.host.as_str(), record_type).await {
        Ok(lookup) => {
            let (ips, ttl) = addresses(lookup.answers(), record_type);
            let (endpoints, truncated) = rank(ips.into_iter().map(|ip| Endpoint {
                addr: SocketAddr::new(ip, target.port),
                readiness: Readiness::Ready,
            }));
            if truncated > 0 {
                tracing::warn!(
                    service = %target.service,
                    "dns discovery: {} has {} addresses; keeping {}, {truncated} left out",
                    target.host,
                    endpoints.len() + truncated,
                    endpoints.len(),
                );
            }
            let wait = refresh_after(ttl, target.refresh_min, target.refresh_max);
            tracing::debug!(service = %target.service, "dns discovery: {} {record_type}: {endpoints:?}, again in {wait:?}", target.host);
            (Signal::List { endpoints, truncated, confirm: true }, wait)
        }
        Err(NetError::Dns(DnsError::NoRecordsFound(no)))
            if no.response_code == ResponseCode::NoError =>
        {
            // The name exists, with no address of this family.
            let wait = refresh_after(
                no.negative_ttl.map(|t| Duration::from_secs(u64::from(t))),
                target.refresh_min,
                target.refresh_max,
            );
            (Signal::List { endpoints: Vec::new(), truncated: 0, confirm: true }, wait)
        }
        Err(error) => (
            Signal::Failed(format!(
                "dns: resolving {} {record_type}: {}",
                target.host,
                describe(&error)
            )),
            target.refresh_min,
        ),
    }
}

/// The error in the words an operator looks for.
fn describe(error: &NetError) -> String {
    match error {
        NetError::Dns(DnsError::NoRecordsFound(no))
            if no.response_code == ResponseCode::NXDomain =>
        {
            "NXDOMAIN (no such name)".to_owned()
        }
        NetError::Dns(DnsError::NoRecordsFound(no)) => code_words(no.response_code),
        NetError::Dns(DnsError::ResponseCode(code)) => code_words(*code),
        NetError::Timeout => "timed out".to_owned(),
        other => super::chain(other),
    }
}

fn code_words(code: ResponseCode) -> String {
    match code {
        ResponseCode::ServFail => "SERVFAIL (server failure)".to_owned(),
        ResponseCode::NXDomain => "NXDOMAIN (no such name)".to_owned(),
        ResponseCode::Refused => "REFUSED (the server refused the query)".to_owned(),
        other => format!("response code {} ({other})", u16::from(other)),
    }
}

/// The addresses of the family's records, and the smallest TTL among them.
pub(crate) fn addresses(
    records: &[Record],
    record_type: RecordType,
) -> (Vec<IpAddr>, Option<Duration>) {
    let mut ips = Vec::new();
    let mut ttl: Option<u32> = None;
    for record in records {
        let ip = match (&record.data, record_type) {
            (RData::A(a), RecordType::A) => IpAddr::V4(a.0),
            (RData::AAAA(aaaa), RecordType::AAAA) => IpAddr::V6(aaaa.0),
            _ => continue,
        };
        if ip.is_unspecified() {
            continue;
        }
        ips.push(ip);
        ttl = Some(ttl.map_or(record.ttl, |t| t.min(record.ttl)));
    }
    (ips, ttl.map(|t| Duration::from_secs(u64::from(t))))
}

/// When to resolve again: at the TTL, within the bounds (no TTL: the
/// lower bound).
pub(crate) fn refresh_after(ttl: Option<Duration>, min: Duration, max: Duration) -> Duration {
    ttl.unwrap_or(min).clamp(min, max.max(min))
}

fn resolver(choice: ResolverChoice) -> Result<TokioResolver, String> {
    let mut builder = match choice.server {
        Some(server) => {
            let mut udp = ConnectionConfig::udp();
            udp.port = server.port();
            let mut tcp = ConnectionConfig::tcp();
            tcp.port = server.port();
            let config = ResolverConfig::from_parts(
                None,
                Vec::new(),
                vec![NameServerConfig::new(server.ip(), true, vec![udp, tcp])],
            );
            TokioResolver::builder_with_config(config, TokioRuntimeProvider::default())
        }
        None => TokioResolver::builder_tokio()
            .map_err(|e| format!("reading the system's DNS configuration: {}", super::chain(&e)))?,
    };
    let options: &mut ResolverOpts = builder.options_mut();
    options.timeout = choice.timeout.unwrap_or(DEFAULT_TIMEOUT);
    options.attempts = ATTEMPTS;
    builder.build().map_err(|e| format!("building the resolver: {}", super::chain(&e)))
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use hickory_resolver::proto::rr::{
        Name,
        rdata::{A, AAAA, CNAME},
    };

    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn the_ttl_is_clamped_to_the_bounds() {
        assert_eq!(refresh_after(Some(S(30)), S(5), S(300)), S(30));
        assert_eq!(refresh_after(Some(S(1)), S(5), S(300)), S(5));
        assert_eq!(refresh_after(Some(S(0)), S(5), S(300)), S(5));
        assert_eq!(refresh_after(Some(S(86_400)), S(5), S(300)), S(300));
        assert_eq!(refresh_after(None, S(5), S(300)), S(5));
        // Bounds the wrong way round (the config rejects them) never panic.
        assert_eq!(refresh_after(Some(S(30)), S(60), S(10)), S(60));
    }

    #[test]
    fn addresses_of_the_family_with_the_smallest_ttl() {
        let name = Name::from_ascii("api.example.").unwrap();
        let records = vec![
            Record::from_rdata(
                name.clone(),
                600,
                RData::CNAME(CNAME(Name::from_ascii("real.example.").unwrap())),
            ),
            Record::from_rdata(name.clone(), 60, RData::A(A(Ipv4Addr::new(127, 10, 0, 2)))),
            Record::from_rdata(name.clone(), 30, RData::A(A(Ipv4Addr::new(127, 10, 0, 1)))),
            Record::from_rdata(name.clone(), 5, RData::AAAA(AAAA(Ipv6Addr::LOCALHOST))),
            Record::from_rdata(name.clone(), 5, RData::A(A(Ipv4Addr::UNSPECIFIED))),
        ];
        let (ips, ttl) = addresses(&records, RecordType::A);
        assert_eq!(ips, [IpAddr::from([127, 10, 0, 2]), IpAddr::from([127, 10, 0, 1])]);
        assert_eq!(ttl, Some(S(30)));
        let (ips, ttl) = addresses(&records, RecordType::AAAA);
        assert_eq!(ips, [IpAddr::V6(Ipv6Addr::LOCALHOST)]);
        assert_eq!(ttl, Some(S(5)));
        assert_eq!(addresses(&[], RecordType::A), (vec![], None));
    }

    #[test]
    fn errors_name_the_dns_failure() {
        assert_eq!(describe(&NetError::Timeout), "timed out");
        assert_eq!(
            describe(&NetError::Dns(DnsError::ResponseCode(ResponseCode::ServFail))),
            "SERVFAIL (server failure)"
        );
        assert_eq!(
            describe(&NetError::Dns(DnsError::ResponseCode(ResponseCode::Refused))),
            "REFUSED (the server refused the query)"
        );
    }
}
