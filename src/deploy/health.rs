//! Active health checks of upstream instances: one checker per upstream
//! pool with a `health` spec (so per deployment and node), a tokio task
//! that every `interval_ms` (jittered by up to a tenth, the first after a
//! random part of the interval) sends each instance `GET path` and records
//! the result in the pool ([`UpstreamPool::checked`]): out of rotation
//! after `unhealthy_threshold` failures in a row, back after
//! `healthy_threshold` passes. It connects like the proxy does, through
//! the egress policy ([`super::h1::connect_tcp`]: names resolve through it,
//! refused literal addresses fail the check). An `https://` instance is
//! checked by its TCP connect only (no TLS handshake). The task holds the
//! pool weakly and is aborted when the pool is retired (deployment deleted
//! or replaced, see [`super::Deployments::reload`]) or dropped.

use super::model::HealthSpec;
use super::pool::{ProxyTimeouts, UpstreamPool};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
        let Ok(mut s) = super::h1::connect_tcp(p, inst, t).await else {
            return (false, 0);
        };
        let Some(host) = inst.plain_host.as_ref().and_then(|h| h.to_str().ok()) else {
            // https: the TCP connect is the check.
            return (true, 0);
        };
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
    };
    tokio::time::timeout(limit, exchange)
        .await
        .unwrap_or((false, 0))
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
