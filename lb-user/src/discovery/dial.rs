//! Reaching the apiserver (k3s 11349): the connector below the kube
//! client of discovery and of the elections.
//!
//! The client is kube's usual stack (the kubeconfig's or the service
//! account's TLS settings, server name and credentials, verified) on a
//! connector of our own, `Dialer`. When the Service discovered is the
//! apiservers' own (`default/kubernetes`), or the kubeconfig's server is
//! this service's VIP or one of its usable servers, each new connection is
//! dialled to the first server of the daemon's current usable list that
//! accepts, then to the kubeconfig's address, and last to the config's own
//! servers (the seeds: the usable list may be a persisted one whose
//! apiservers were all replaced while the node was down, and the
//! kubeconfig may point at the VIP). TLS still runs over
//! that connection with the kubeconfig's server name, so the certificate
//! is verified as before. Connections are not pooled, so when the watched
//! apiserver dies the next list or watch dials afresh and lands on a live
//! one: the watch follows the list it maintains. For any other Service the
//! kubeconfig's address is dialled as usual.
//!
//! The addresses of the plan are dialled one after another, each started
//! when the one before it has failed or has gone [`NEXT_DIAL_AFTER`]
//! without an answer, and the first to connect wins (RFC 8305's
//! staggered attempts). An apiserver that died silently (powered off,
//! partitioned: its SYNs go unanswered) then costs a request that much,
//! not the connect timeout: a lease's renewal has half a lease (500 ms by
//! default) before its holder falls silent.

use std::{
    fmt,
    future::Future,
    net::{IpAddr, SocketAddr},
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use futures::{StreamExt as _, stream::FuturesUnordered};
use hyper::Uri;
use hyper_util::{client::legacy::connect::HttpConnector, rt::TokioIo};
use tokio::{net::TcpStream, sync::watch};

use super::chain;

/// How long one dial of one address may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a dial may go unanswered before the next address is dialled
/// beside it: RFC 8305's least "Connection Attempt Delay" (it recommends
/// 250 ms for the Internet; apiservers are a LAN away).
pub(crate) const NEXT_DIAL_AFTER: Duration = Duration::from_millis(100);

/// When the apiserver is reached through the service's usable servers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DialRule {
    pub vip: SocketAddr,
    /// The Service discovered is `default/kubernetes`.
    pub apiserver_service: bool,
}

/// One place to dial.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dial {
    /// A usable server of the service.
    Server(SocketAddr),
    /// The kubeconfig's server, as written (a name is resolved).
    Configured,
}

impl DialRule {
    /// Where to dial for a request to `configured` (the kubeconfig's server
    /// address, when it is an IP address), in order. When the servers are
    /// apiservers (the Service is the apiservers' own, or the kubeconfig
    /// points at the VIP or at one of them): the usable servers, the
    /// kubeconfig's address, then the config's servers (`seeds`) not tried
    /// yet. Otherwise the kubeconfig's address alone.
    pub(crate) fn plan(
        &self,
        configured: Option<SocketAddr>,
        usable: &[SocketAddr],
        seeds: &[SocketAddr],
    ) -> Vec<Dial> {
        let through_usable = self.apiserver_service
            || configured
                .is_some_and(|c| c == self.vip || usable.contains(&c) || seeds.contains(&c));
        let mut plan: Vec<Dial> = Vec::new();
        if through_usable {
            plan.extend(usable.iter().map(|a| Dial::Server(*a)));
        }
        if !configured.is_some_and(|c| plan.contains(&Dial::Server(c))) {
            plan.push(Dial::Configured);
        }
        if through_usable {
            for seed in seeds {
                if !plan.contains(&Dial::Server(*seed)) && configured != Some(*seed) {
                    plan.push(Dial::Server(*seed));
                }
            }
        }
        plan
    }
}

/// The IP address and port of a URI, when its host is an IP address.
fn socket_addr_of(uri: &Uri) -> Option<SocketAddr> {
    let host = uri.host()?;
    let ip: IpAddr = host.trim_start_matches('[').trim_end_matches(']').parse().ok()?;
    let port = uri.port_u16().unwrap_or(if uri.scheme_str() == Some("https") { 443 } else { 80 });
    Some(SocketAddr::new(ip, port))
}

/// A connector (below TLS) that dials as [`DialRule::plan`] says: the
/// first address that accepts wins. TLS above it still verifies the
/// kubeconfig's server name.
#[derive(Clone)]
pub(crate) struct Dialer {
    rule: DialRule,
    seeds: Vec<SocketAddr>,
    usable: watch::Receiver<Vec<SocketAddr>>,
    tcp: HttpConnector,
}

impl Dialer {
    pub(crate) fn new(
        rule: DialRule,
        seeds: Vec<SocketAddr>,
        usable: watch::Receiver<Vec<SocketAddr>>,
    ) -> Self {
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(CONNECT_TIMEOUT));
        // A dead apiserver that sends nothing (powered off, partitioned)
        // must not hold the watch forever.
        tcp.set_keepalive(Some(Duration::from_secs(10)));
        tcp.set_keepalive_interval(Some(Duration::from_secs(5)));
        tcp.set_keepalive_retries(Some(3));
        tcp.set_tcp_user_timeout(Some(Duration::from_secs(30)));
        Self { rule, seeds, usable, tcp }
    }
}

/// Every dial failed.
#[derive(Debug)]
pub(crate) struct DialError(String);

impl fmt::Display for DialError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DialError {}

impl tower::Service<Uri> for Dialer {
    type Response = TokioIo<TcpStream>;
    type Error = DialError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, DialError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), DialError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let plan = self.rule.plan(socket_addr_of(&uri), &self.usable.borrow(), &self.seeds);
        let dials: Vec<_> = plan
            .into_iter()
            .map(|dial| {
                let (to, name) = match dial {
                    Dial::Server(addr) => (
                        format!("http://{addr}/").parse::<Uri>().expect("an address is a URI"),
                        addr.to_string(),
                    ),
                    Dial::Configured => (
                        uri.clone(),
                        format!("{} (kubeconfig)", uri.authority().map_or("?", |a| a.as_str())),
                    ),
                };
                let tcp = self.tcp.clone();
                async move {
                    match tower::ServiceExt::oneshot(tcp, to).await {
                        Ok(stream) => {
                            tracing::debug!(
                                "kubernetes discovery: connected to the apiserver at {name}"
                            );
                            Ok(stream)
                        }
                        Err(e) => Err(format!("{name}: {}", chain(&e))),
                    }
                }
            })
            .collect();
        Box::pin(first_to_connect(dials, NEXT_DIAL_AFTER))
    }
}

/// Runs `dials` in order, each started when the one before it has failed
/// or `after` has passed since the last start, whichever comes first: the
/// first to connect wins, and the others are dropped (their sockets
/// closed). An error lists every failure, in the order they came.
async fn first_to_connect<S, F>(dials: Vec<F>, after: Duration) -> Result<S, DialError>
where
    F: Future<Output = Result<S, String>>,
{
    let mut waiting = dials.into_iter();
    let mut running = FuturesUnordered::new();
    running.extend(waiting.next());
    let mut failures = Vec::new();
    while !running.is_empty() {
        let more = waiting.len() > 0;
        tokio::select! {
            Some(dialled) = running.next() => match dialled {
                Ok(stream) => return Ok(stream),
                Err(failure) => {
                    failures.push(failure);
                    running.extend(waiting.next());
                }
            },
            () = tokio::time::sleep(after), if more => running.extend(waiting.next()),
        }
    }
    Err(DialError(format!("no apiserver accepted a connection ({})", failures.join("; "))))
}

#[cfg(test)]
mod tests {
    use tokio::time::{Instant, sleep};

    use super::*;

    fn vip4() -> SocketAddr {
        "127.0.0.1:443".parse().unwrap()
    }

    #[test]
    fn the_dial_plan_goes_through_usable_servers_only_for_apiservers() {
        let vip = vip4();
        let a: SocketAddr = "127.10.0.1:6443".parse().unwrap();
        let b: SocketAddr = "127.10.0.2:6443".parse().unwrap();
        let elsewhere: SocketAddr = "127.19.9.9:443".parse().unwrap();
        let apiservers = DialRule { vip, apiserver_service: true };
        let app = DialRule { vip, apiserver_service: false };
        let none: &[SocketAddr] = &[];
        // default/kubernetes: the usable servers first, then the kubeconfig.
        assert_eq!(
            apiservers.plan(Some(elsewhere), &[a, b], none),
            [Dial::Server(a), Dial::Server(b), Dial::Configured]
        );
        assert_eq!(apiservers.plan(None, &[a], none), [Dial::Server(a), Dial::Configured]);
        // The kubeconfig points at one of them: not dialled twice.
        assert_eq!(app.plan(Some(b), &[a, b], none), [Dial::Server(a), Dial::Server(b)]);
        // The kubeconfig points at the VIP: its servers, then the VIP (which
        // the kernel rewrites when the daemon is in the attached cgroup).
        assert_eq!(app.plan(Some(vip), &[b], none), [Dial::Server(b), Dial::Configured]);
        // An application's Service: its servers are not apiservers.
        assert_eq!(app.plan(Some(elsewhere), &[a, b], none), [Dial::Configured]);
        assert_eq!(app.plan(None, &[a, b], none), [Dial::Configured]);
        // Nothing usable yet: the kubeconfig.
        assert_eq!(apiservers.plan(Some(vip), &[], none), [Dial::Configured]);
    }

    /// The config's servers (the seeds) stay a last resort for reaching an
    /// apiserver. A persisted list whose apiservers were all replaced while
    /// the node was down, and a kubeconfig that points at the VIP: the seeds
    /// come last.
    #[test]
    fn the_config_servers_are_dialled_last() {
        let vip = vip4();
        let stale: SocketAddr = "127.10.0.1:6443".parse().unwrap();
        let seed: SocketAddr = "127.10.0.9:6443".parse().unwrap();
        let elsewhere: SocketAddr = "127.19.9.9:443".parse().unwrap();
        let apiservers = DialRule { vip, apiserver_service: true };
        let app = DialRule { vip, apiserver_service: false };
        assert_eq!(
            app.plan(Some(vip), &[stale], &[seed]),
            [Dial::Server(stale), Dial::Configured, Dial::Server(seed)]
        );
        assert_eq!(apiservers.plan(None, &[], &[seed]), [Dial::Configured, Dial::Server(seed)]);
        // A seed that is usable, or the kubeconfig's address: once.
        assert_eq!(
            apiservers.plan(Some(elsewhere), &[seed], &[seed]),
            [Dial::Server(seed), Dial::Configured]
        );
        assert_eq!(
            app.plan(Some(seed), &[stale], &[seed]),
            [Dial::Server(stale), Dial::Configured]
        );
        // An application's Service: its seeds are not apiservers either.
        assert_eq!(app.plan(Some(elsewhere), &[stale], &[seed]), [Dial::Configured]);
    }

    #[test]
    fn uri_addresses() {
        let uri = |s: &str| s.parse::<Uri>().unwrap();
        assert_eq!(
            socket_addr_of(&uri("https://127.10.0.1:6443/")),
            Some("127.10.0.1:6443".parse().unwrap())
        );
        assert_eq!(
            socket_addr_of(&uri("https://127.10.0.1/")),
            Some("127.10.0.1:443".parse().unwrap())
        );
        assert_eq!(socket_addr_of(&uri("http://[::1]:8080/")), Some("[::1]:8080".parse().unwrap()));
        assert_eq!(socket_addr_of(&uri("https://kubernetes.default.svc/")), None);
    }

    /// A dial that answers `outcome` after `ms` milliseconds.
    async fn dial(
        ms: u64,
        outcome: Result<&'static str, &'static str>,
    ) -> Result<&'static str, String> {
        sleep(Duration::from_millis(ms)).await;
        outcome.map_err(str::to_owned)
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_address_holds_a_dial_only_until_the_next_one_starts() {
        // The first address never answers its SYN: the connect timeout.
        let start = Instant::now();
        let dials = vec![
            Box::pin(dial(CONNECT_TIMEOUT.as_millis() as u64, Err("dead: timed out"))),
            Box::pin(dial(5, Ok("live"))),
        ];
        assert_eq!(first_to_connect(dials, NEXT_DIAL_AFTER).await.unwrap(), "live");
        assert_eq!(start.elapsed(), NEXT_DIAL_AFTER + Duration::from_millis(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_address_starts_the_next_at_once() {
        let start = Instant::now();
        let dials = vec![Box::pin(dial(1, Err("refused"))), Box::pin(dial(5, Ok("live")))];
        assert_eq!(first_to_connect(dials, NEXT_DIAL_AFTER).await.unwrap(), "live");
        assert_eq!(start.elapsed(), Duration::from_millis(6));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_address_still_wins_if_it_answers_first() {
        // The first answers at 150 ms; the second, started at 100 ms, would
        // answer at 300 ms: the first is taken then.
        let start = Instant::now();
        let dials = vec![Box::pin(dial(150, Ok("slow"))), Box::pin(dial(200, Ok("later")))];
        assert_eq!(first_to_connect(dials, NEXT_DIAL_AFTER).await.unwrap(), "slow");
        assert_eq!(start.elapsed(), Duration::from_millis(150));
    }

    #[tokio::test(start_paused = true)]
    async fn every_failure_is_named_when_none_connects() {
        let dials = vec![
            Box::pin(dial(300, Err("a: timed out"))),
            Box::pin(dial(10, Err("b: refused"))),
            Box::pin(dial(1, Err("c: unreachable"))),
        ];
        let Err(error) = first_to_connect(dials, NEXT_DIAL_AFTER).await else {
            panic!("a dial connected")
        };
        assert_eq!(
            error.to_string(),
            "no apiserver accepted a connection (b: refused; c: unreachable; a: timed out)"
        );
        let none: Vec<std::future::Ready<Result<(), String>>> = Vec::new();
        assert!(first_to_connect(none, NEXT_DIAL_AFTER).await.is_err());
    }
}
