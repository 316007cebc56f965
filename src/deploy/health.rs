//! Active health checks of upstream instances: one checker per upstream
//! pool with a `health` spec (so per deployment and node), a tokio task
//! that every `interval_ms` (jittered by up to a tenth, the first after a
//! random part of the interval) sends each instance `GET path` and records
//! the result in the pool ([`UpstreamPool::checked`]): out of rotation
//! after `unhealthy_threshold` failures in a row, back after
//! `healthy_threshold` passes. It connects like the proxy does, through
//! the egress policy ([`super::h1::connect_tcp`]: names resolve through it,
//! refused literal addresses fail the check). An `https://` instance gets
//! the same `GET` over TLS, with the proxy's client config
//! ([`super::awc_client::upstream_tls`]: a certificate the proxy would
//! refuse fails the check). The task holds the
//! pool weakly and is aborted when the pool is retired (deployment deleted
//! or replaced, see [`super::Deployments::reload`]) or dropped.

use super::model::HealthSpec;
use super::pool::{ProxyTimeouts, UpstreamPool};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Starts `pool`'s checker when it has a health spec and a tokio runtime
/// runs here (replacing one already running).
pub fn start(pool: &Arc<UpstreamPool>) {
    let Some(spec) = pool.health.clone() else {
        return;
    };
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let task = rt.spawn(run(Arc::downgrade(pool), spec));
    if let Some(old) = pool.checker.lock().replace(task.abort_handle()) {
        old.abort();
    }
}

/// The checker's loop: ends when the pool is gone.
async fn run(pool: Weak<UpstreamPool>, spec: HealthSpec) {
    let interval = spec.interval_ms;
    let mut wait = match pool.upgrade() {
        Some(p) => p.random() % interval.max(1),
        None => return,
    };
    loop {
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let Some(p) = pool.upgrade() else { return };
        let results =
            futures_util::future::join_all((0..p.instances.len()).map(|i| check(&p, i, &spec)))
                .await;
        for (i, (ok, status)) in results.into_iter().enumerate() {
            p.checked(i, ok, status);
        }
        // ±10 %: checkers started together drift apart.
        let spread = (interval / 5).max(1);
        wait = interval - interval / 10 + p.random() % spread;
    }
}

/// One check of instance `i`: whether it passed, and the status answered (0: none).
async fn check(p: &UpstreamPool, i: usize, spec: &HealthSpec) -> (bool, u16) {
    check_with(p, i, spec, super::awc_client::upstream_tls()).await
}

/// [`check`] with the TLS config of `https://` instances.
async fn check_with(
    p: &UpstreamPool,
    i: usize,
    spec: &HealthSpec,
    tls: std::sync::Arc<rustls::ClientConfig>,
) -> (bool, u16) {
    if p.refused(i).is_some() {
        return (false, 0);
    }
    let inst = &p.instances[i];
    let limit = Duration::from_millis(spec.timeout_ms);
    let t = ProxyTimeouts {
        connect: limit,
        response: limit,
    };
    let exchange = async {
        let Ok(s) = super::h1::connect_tcp(p, inst, t).await else {
            return (false, 0);
        };
        if let Some(host) = inst.plain_host.as_ref().and_then(|h| h.to_str().ok()) {
            return ask(s, host, spec).await;
        }
        // https: the handshake first, the server name the base's host.
        let Some(authority) = inst.base.strip_prefix("https://") else {
            return (false, 0);
        };
        let Some((host, _)) = &inst.host_port else {
            return (false, 0);
        };
        let name = host.trim_start_matches('[').trim_end_matches(']');
        let Ok(name) = rustls_pki_types::ServerName::try_from(name.to_string()) else {
            return (false, 0);
        };
        match tokio_rustls::TlsConnector::from(tls).connect(name, s).await {
            Ok(s) => ask(s, authority, spec).await,
            Err(e) => {
                tracing::debug!(instance = %inst.base, error = %e, "Health check: TLS failed.");
                (false, 0)
            }
        }
    };
    tokio::time::timeout(limit, exchange)
        .await
        .unwrap_or((false, 0))
}

/// `GET path` on a connected stream: whether the status passes, and the status.
async fn ask(
    mut s: impl AsyncRead + AsyncWrite + Unpin,
    host: &str,
    spec: &HealthSpec,
) -> (bool, u16) {
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: meshgate-health-check\r\nConnection: close\r\n\r\n",
        spec.path
    );
    if s.write_all(req.as_bytes()).await.is_err() {
        return (false, 0);
    }
    let mut buf = Vec::with_capacity(256);
    let mut b = [0u8; 256];
    while !buf.windows(2).any(|w| w == b"\r\n") && buf.len() < 1024 {
        match s.read(&mut b).await {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&b[..n]),
        }
    }
    let status = status_of(&buf);
    (status.is_some_and(|c| spec.passes(c)), status.unwrap_or(0))
}

/// The status of an HTTP/1.x status line at the start of `head`.
fn status_of(head: &[u8]) -> Option<u16> {
    let line = head.split(|&b| b == b'\r').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split(' ');
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    parts
        .next()?
        .parse()
        .ok()
        .filter(|c| (100..=599).contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deploy::model::Balance;
    use crate::deploy::pool::tests::pool;

    /// A TLS listener on 127.0.0.1 with a self-signed certificate for
    /// 127.0.0.1, answering `status` to each request; its port and a client
    /// config trusting that certificate.
    async fn tls_answering(status: &'static str) -> (u16, Arc<rustls::ClientConfig>) {
        let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
        let der = cert.cert.der().clone();
        let key = rustls_pki_types::PrivateKeyDer::Pkcs8(
            rustls_pki_types::PrivatePkcs8KeyDer::from(cert.key_pair.serialize_der()),
        );
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![der.clone()], key)
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut s) = acceptor.accept(s).await else {
                        return;
                    };
                    let mut b = [0u8; 1024];
                    let n = s.read(&mut b).await.unwrap_or(0);
                    let head = String::from_utf8_lossy(&b[..n]).to_string();
                    // The request as the check sends it.
                    let ok = head.starts_with("GET /healthz HTTP/1.1\r\n")
                        && head.contains(&format!("Host: 127.0.0.1:{port}\r\n"));
                    let st = if ok { status } else { "400 Bad" };
                    let _ = s
                        .write_all(format!("HTTP/1.1 {st}\r\nContent-Length: 0\r\n\r\n").as_bytes())
                        .await;
                    let _ = s.shutdown().await;
                });
            }
        });
        (port, Arc::new(client))
    }

    /// An `https://` instance is checked by a GET over TLS: its status
    /// passes or fails the check; a certificate the proxy's config does not
    /// trust, or a listener that does not speak TLS, fails it (no status).
    #[tokio::test]
    async fn https_instances_are_checked_over_tls() {
        let spec: HealthSpec =
            serde_json::from_value(serde_json::json!({"path": "/healthz"})).unwrap();
        let (ok, trusting) = tls_answering("200 OK").await;
        let (bad, trusting_bad) = tls_answering("503 No").await;
        let plain = {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = l.local_addr().unwrap().port();
            tokio::spawn(async move {
                while let Ok((mut s, _)) = l.accept().await {
                    let mut b = [0u8; 1024];
                    let _ = s.read(&mut b).await;
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                        .await;
                }
            });
            port
        };
        let p = pool(
            &[
                &format!("https://127.0.0.1:{ok}"),
                &format!("https://127.0.0.1:{bad}"),
                &format!("https://127.0.0.1:{plain}"),
            ],
            1,
            Duration::ZERO,
        );
        assert_eq!(
            check_with(&p, 0, &spec, trusting.clone()).await,
            (true, 200)
        );
        assert_eq!(check_with(&p, 1, &spec, trusting_bad).await, (false, 503));
        // The proxy's own config (public roots): the self-signed one fails.
        assert_eq!(check(&p, 0, &spec).await, (false, 0));
        // Not TLS at all: fails (a TCP connect alone no longer passes).
        assert_eq!(check_with(&p, 2, &spec, trusting).await, (false, 0));
    }

    #[test]
    fn status_lines_are_read() {
        assert_eq!(status_of(b"HTTP/1.1 204 No Content\r\n"), Some(204));
        assert_eq!(status_of(b"HTTP/1.0 503 x\r\nA: b\r\n"), Some(503));
        assert_eq!(status_of(b"SSH-2.0\r\n"), None);
        assert_eq!(status_of(b"HTTP/1.1 abc\r\n"), None);
    }

    /// A checker against real listeners on 127.0.0.1: a 503 takes its
    /// instance out, a 200 keeps its own in; the checker stops with the pool.
    #[tokio::test]
    async fn checks_take_failing_instances_out() {
        async fn answering(status: &'static str) -> u16 {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = l.local_addr().unwrap().port();
            tokio::spawn(async move {
                while let Ok((mut s, _)) = l.accept().await {
                    let mut b = [0u8; 1024];
                    let _ = s.read(&mut b).await;
                    let _ = s
                        .write_all(
                            format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n").as_bytes(),
                        )
                        .await;
                }
            });
            port
        }
        let (ok, bad) = (answering("200 OK").await, answering("503 No").await);
        let spec: HealthSpec = serde_json::from_value(serde_json::json!({
            "path": "/healthz", "interval_ms": 100, "unhealthy_threshold": 1, "healthy_threshold": 1
        }))
        .unwrap();
        let p = Arc::new(
            pool(
                &[
                    &format!("http://127.0.0.1:{ok}"),
                    &format!("http://127.0.0.1:{bad}"),
                ],
                1,
                Duration::ZERO,
            )
            .with_balancing(&[], &Balance::RoundRobin, Some(spec)),
        );
        start(&p);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while p.states()[1].healthy {
            assert!(std::time::Instant::now() < deadline, "never checked");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let s = p.states();
        assert!(s[0].healthy);
        assert_eq!(s[1].check.as_ref().unwrap().last_status, 503);
        assert_eq!(p.order(), vec![0]);
        // Stopped (as when the deployment is deleted or replaced): no more checks.
        p.stop_checker();
        tokio::task::yield_now().await;
        let last: Vec<u64> = p
            .states()
            .iter()
            .map(|s| s.check.as_ref().unwrap().last_ms)
            .collect();
        tokio::time::sleep(Duration::from_millis(400)).await;
        let after: Vec<u64> = p
            .states()
            .iter()
            .map(|s| s.check.as_ref().unwrap().last_ms)
            .collect();
        assert_eq!(last, after);
    }
}
