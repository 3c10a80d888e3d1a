//! Active health checks: TCP connect, HTTP or HTTPS GET. Each server is
//! checked by its own task with its own timeout, so a slow server never
//! delays the checks of others. Checks go straight to the servers (never a
//! VIP), so the datapath never rewrites them.

use std::{net::SocketAddr, time::Duration};

use anyhow::Context as _;

use crate::{
    balancer::Health,
    config::{CheckKind, HealthConfig},
};

/// Checks one server the way its service is configured.
pub struct Checker {
    kind: CheckKind,
    timeout: Duration,
    status: (u16, u16),
    url: String,
    client: Option<reqwest::Client>,
}

impl Checker {
    /// Builds the checker of `server`; errors name the file that is wrong.
    pub fn new(config: &HealthConfig, server: SocketAddr) -> anyhow::Result<Self> {
        let scheme = if config.check == CheckKind::Https { "https" } else { "http" };
        let host = config.server_name.clone().unwrap_or_else(|| match server {
            SocketAddr::V4(a) => a.ip().to_string(),
            SocketAddr::V6(a) => format!("[{}]", a.ip()),
        });
        let url = format!("{scheme}://{host}:{}{}", server.port(), config.path);
        let client = match config.check {
            CheckKind::Http | CheckKind::Https => Some(http_client(config, server)?),
            CheckKind::Tcp | CheckKind::None => None,
        };
        Ok(Self { kind: config.check, timeout: config.timeout, status: config.status, url, client })
    }

    /// One check of `server`; always returns within the timeout.
    pub async fn check(&self, server: SocketAddr) -> Health {
        let attempt = async {
            match (self.kind, &self.client) {
                (CheckKind::None, _) => Health::Unknown,
                (CheckKind::Tcp, _) => match tokio::net::TcpStream::connect(server).await {
                    Ok(_) => Health::Pass,
                    Err(e) => Health::Fail(format!("tcp connect: {e}")),
                },
                (_, Some(client)) => match client.get(&self.url).send().await {
                    Ok(response) => {
                        let code = response.status().as_u16();
                        if (self.status.0..=self.status.1).contains(&code) {
                            Health::Pass
                        } else {
                            Health::Fail(format!("GET {}: HTTP {code}", self.url))
                        }
                    }
                    Err(e) => Health::Fail(format!("GET {}: {}", self.url, error_chain(&e))),
                },
                (_, None) => Health::Unknown,
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

fn http_client(config: &HealthConfig, server: SocketAddr) -> anyhow::Result<reqwest::Client> {
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
    builder = builder.tls_built_in_native_certs(config.check == CheckKind::Https && config.ca_file.is_none());
    if config.check == CheckKind::Https {
        builder = builder.use_rustls_tls();
        if let Some(path) = &config.ca_file {
            let pem = std::fs::read(path).with_context(|| format!("health.ca_file: reading {}", path.display()))?;
            for cert in reqwest::Certificate::from_pem_bundle(&pem).with_context(|| format!("health.ca_file: {} is not a PEM bundle", path.display()))? {
                builder = builder.add_root_certificate(cert);
            }
        }
        if let (Some(cert), Some(key)) = (&config.cert_file, &config.key_file) {
            let mut pem = std::fs::read(cert).with_context(|| format!("health.cert_file: reading {}", cert.display()))?;
            pem.extend(std::fs::read(key).with_context(|| format!("health.key_file: reading {}", key.display()))?);
            let identity = reqwest::Identity::from_pem(&pem)
                .with_context(|| format!("health.cert_file/key_file: {} and {} are not a PEM certificate and key", cert.display(), key.display()))?;
            builder = builder.identity(identity);
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
                let _ = write!(stream, "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            }
        });
        addr
    }

    fn config(check: CheckKind) -> HealthConfig {
        HealthConfig { check, path: "/readyz".into(), ..HealthConfig::default() }
    }

    #[tokio::test]
    async fn http_status_decides() {
        let ok = http_server(200);
        assert_eq!(Checker::new(&config(CheckKind::Http), ok).unwrap().check(ok).await, Health::Pass);
        let broken = http_server(500);
        let result = Checker::new(&config(CheckKind::Http), broken).unwrap().check(broken).await;
        assert!(matches!(&result, Health::Fail(e) if e.contains("HTTP 500") && e.contains("/readyz")), "{result:?}");
    }

    #[tokio::test]
    async fn tcp_refused_fails_and_none_is_unknown() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        assert_eq!(Checker::new(&config(CheckKind::Tcp), addr).unwrap().check(addr).await, Health::Pass);
        drop(listener);
        let result = Checker::new(&config(CheckKind::Tcp), addr).unwrap().check(addr).await;
        assert!(matches!(&result, Health::Fail(e) if e.contains("refused")), "{result:?}");
        assert_eq!(Checker::new(&config(CheckKind::None), addr).unwrap().check(addr).await, Health::Unknown);
    }

    #[tokio::test]
    async fn a_silent_server_times_out() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let cfg = HealthConfig { timeout: Duration::from_millis(200), ..config(CheckKind::Http) };
        let result = Checker::new(&cfg, addr).unwrap().check(addr).await;
        assert!(matches!(&result, Health::Fail(_)), "{result:?}");
        drop(listener);
    }

    #[test]
    fn missing_ca_file_is_named() {
        let cfg = HealthConfig { ca_file: Some("/nonexistent/ca.pem".into()), ..config(CheckKind::Https) };
        let err = Checker::new(&cfg, "127.0.0.1:1".parse().unwrap()).err().unwrap();
        assert!(format!("{err:#}").contains("health.ca_file: reading /nonexistent/ca.pem"), "{err:#}");
    }
}
