//! Active health checks: TCP connect, HTTP or HTTPS GET, a DNS query over
//! UDP (`dns`). Each server is checked by its own task with its own
//! timeout, so a slow server never delays the checks of others. Checks go
//! straight to the servers (never a VIP), so the datapath never rewrites
//! them.

use std::{net::SocketAddr, path::Path, time::Duration};

use anyhow::Context as _;

use crate::{
    balancer::Health,
    config::{CheckKind, HealthConfig},
};

mod dns;

/// What one check of a server does.
enum Probe {
    /// Connect, then close.
    Tcp,
    /// GET `url`; a status within `status` (inclusive) passes.
    Http { client: reqwest::Client, url: String, status: (u16, u16) },
    /// Ask a DNS question; a well-formed answer passes.
    Dns(dns::Question),
}

/// Checks one server the way its service is configured.
pub struct Checker {
    probe: Probe,
    timeout: Duration,
}

/// The files of an https check, read and parsed once per service: a CA
/// bundle that does not parse or a key that is missing fails a start or a
/// reload here, before any server is checked.
#[derive(Clone, Default)]
pub struct Tls {
    /// Trusted roots instead of the system's, when `ca_file` is set.
    roots: Option<Vec<reqwest::Certificate>>,
    /// The client certificate and key (`cert_file`, `key_file`).
    identity: Option<reqwest::Identity>,
}

impl Tls {
    /// Reads the TLS files `config` names (none for a check that is not
    /// https). Errors name the key and the file.
    pub fn load(config: &HealthConfig) -> anyhow::Result<Self> {
        if config.check != CheckKind::Https {
            return Ok(Self::default());
        }
        let read = |key: &str, path: &Path| {
            std::fs::read(path).with_context(|| format!("health.{key}: reading {}", path.display()))
        };
        let roots = match &config.ca_file {
            Some(path) => {
                Some(reqwest::Certificate::from_pem_bundle(&read("ca_file", path)?).with_context(
                    || format!("health.ca_file: {} is not a PEM bundle", path.display()),
                )?)
            }
            None => None,
        };
        let identity = match (&config.cert_file, &config.key_file) {
            (Some(cert), Some(key)) => {
                let mut pem = read("cert_file", cert)?;
                pem.extend(read("key_file", key)?);
                Some(reqwest::Identity::from_pem(&pem).with_context(|| {
                    format!(
                        "health.cert_file/key_file: {} and {} are not a PEM certificate and key",
                        cert.display(),
                        key.display()
                    )
                })?)
            }
            _ => None,
        };
        Ok(Self { roots, identity })
    }
}

impl Checker {
    /// The checker of `server`, or `None` for `check = "none"` (the kernel's
    /// connection reports are then the only signal).
    pub fn new(
        config: &HealthConfig,
        tls: &Tls,
        server: SocketAddr,
    ) -> anyhow::Result<Option<Self>> {
        let probe = match config.check {
            CheckKind::None => return Ok(None),
            CheckKind::Tcp => Probe::Tcp,
            CheckKind::Dns => Probe::Dns(dns::Question::new(&config.query, &config.query_type)?),
            CheckKind::Http | CheckKind::Https => {
                let scheme = if config.check == CheckKind::Https { "https" } else { "http" };
                let host = config.server_name.clone().unwrap_or_else(|| match server {
                    SocketAddr::V4(a) => a.ip().to_string(),
                    SocketAddr::V6(a) => format!("[{}]", a.ip()),
                });
                let url = format!("{scheme}://{host}:{}{}", server.port(), config.path);
                Probe::Http {
                    client: http_client(config, tls, server)?,
                    url,
                    status: config.status,
                }
            }
        };
        Ok(Some(Self { probe, timeout: config.timeout }))
    }

    /// One check of `server`; always returns within the timeout.
    pub async fn check(&self, server: SocketAddr) -> Health {
        let attempt = async {
            match &self.probe {
                Probe::Tcp => match tokio::net::TcpStream::connect(server).await {
                    Ok(_) => Health::Pass,
                    Err(e) => Health::Fail(format!("tcp connect: {e}")),
                },
                Probe::Http { client, url, status } => match client.get(url).send().await {
                    Ok(response) => {
                        let code = response.status().as_u16();
                        if (status.0..=status.1).contains(&code) {
                            Health::Pass
                        } else {
                            Health::Fail(format!("GET {url}: HTTP {code}"))
                        }
                    }
                    Err(e) => Health::Fail(format!("GET {url}: {}", error_chain(&e))),
                },
                Probe::Dns(question) => question.ask(server).await,
            }
        };
        match tokio::time::timeout(self.timeout, attempt).await {
            Ok(result) => result,
            Err(_) => Health::Fail(format!("no answer within {:?}", self.timeout)),
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn http_client(
    config: &HealthConfig,
    tls: &Tls,
    server: SocketAddr,
) -> anyhow::Result<reqwest::Client> {
    let mut builder = reqwest::Client::builder()
        .timeout(config.timeout)
        .connect_timeout(config.timeout)
        .redirect(reqwest::redirect::Policy::none())
        .pool_max_idle_per_host(0)
        .no_proxy()
        .user_agent(concat!("lb-health-check/", env!("CARGO_PKG_VERSION")));
    if let Some(name) = &config.server_name {
        // Connect to the server's address, verify the certificate for `name`.
        builder = builder.resolve(name, server);
    }
    // The system's roots only where they are used: an https check without
    // a CA bundle of its own. Loading them costs tens of milliseconds per
    // client (seconds under emulation), and `ca_file` replaces them, so
    // that a cluster's private CA is the only one trusted.
    let https = config.check == CheckKind::Https;
    builder = builder.tls_built_in_native_certs(https && tls.roots.is_none());
    if https {
        builder = builder.use_rustls_tls();
        for cert in tls.roots.iter().flatten() {
            builder = builder.add_root_certificate(cert.clone());
        }
        if let Some(identity) = &tls.identity {
            builder = builder.identity(identity.clone());
        }
        if config.insecure_skip_verify {
            builder = builder.danger_accept_invalid_certs(true);
        }
    }
    builder.build().context("building the HTTP client for health checks")
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};

    use super::*;

    fn http_server(status: u16) -> SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming().take(4) {
                let mut stream = stream.unwrap();
                let mut buf = [0u8; 1024];
                let _ = stream.read(&mut buf);
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
            }
        });
        addr
    }

    fn config(check: CheckKind) -> HealthConfig {
        HealthConfig { check, path: "/readyz".into(), ..HealthConfig::default() }
    }

    fn checker(config: &HealthConfig, server: SocketAddr) -> Checker {
        Checker::new(config, &Tls::load(config).unwrap(), server)
            .unwrap()
            .expect("a check is configured")
    }

    #[tokio::test]
    async fn http_status_decides() {
        let ok = http_server(200);
        assert_eq!(checker(&config(CheckKind::Http), ok).check(ok).await, Health::Pass);
        let broken = http_server(500);
        let result = checker(&config(CheckKind::Http), broken).check(broken).await;
        assert!(
            matches!(&result, Health::Fail(e) if e.contains("HTTP 500") && e.contains("/readyz")),
            "{result:?}"
        );
    }

    #[tokio::test]
    async fn tcp_refused_fails_and_none_has_no_checker() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        assert_eq!(checker(&config(CheckKind::Tcp), addr).check(addr).await, Health::Pass);
        drop(listener);
        let result = checker(&config(CheckKind::Tcp), addr).check(addr).await;
        assert!(matches!(&result, Health::Fail(e) if e.contains("refused")), "{result:?}");
        let none = config(CheckKind::None);
        assert!(
            Checker::new(&none, &Tls::load(&none).unwrap(), addr).unwrap().is_none(),
            "check = none has no checker"
        );
    }

    #[tokio::test]
    async fn a_silent_server_times_out() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let cfg = HealthConfig { timeout: Duration::from_millis(200), ..config(CheckKind::Http) };
        let result = checker(&cfg, addr).check(addr).await;
        assert!(matches!(&result, Health::Fail(_)), "{result:?}");
        drop(listener);
    }

    #[test]
    fn missing_ca_file_is_named() {
        let cfg = HealthConfig {
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..config(CheckKind::Https)
        };
        let err = Tls::load(&cfg).err().unwrap();
        assert!(
            format!("{err:#}").contains("health.ca_file: reading /nonexistent/ca.pem"),
            "{err:#}"
        );
    }
}
