//! Active health checks of upstream instances (docs/deployments.md, "Health
//! checks"), one scheduler per node ([`HealthChecks`]), on a budget:
//!
//! - **One check per distinct instance.** A check is keyed by (namespace,
//!   instance base URL, path, timeout): two deployments (or versions) of a
//!   namespace naming the same instance with the same check share one, and
//!   each gets its result (judged by its own `expected_statuses` and
//!   thresholds, [`UpstreamPool::checked`]).
//! - **A minimum interval.** A check runs at most every
//!   `[deploy] health_min_interval_ms`, whatever a (stored or imported)
//!   deployment asks; a new one asking for less is refused at create.
//! - **A budget per namespace.** A namespace's checks on this node together
//!   start at most `health_checks_per_second`: each check's interval is
//!   lengthened to (the namespace's active checks / budget) so they spread
//!   evenly, and a per-namespace credit admits due checks only within the
//!   budget (so a burst of due checks waits instead of running at once).
//! - **A share of the slots per namespace.** At most
//!   `health_in_flight_per_namespace` of a namespace's checks are in flight
//!   at once (of [`MAX_RUNNING`] node-wide): checks that hang until a long
//!   `timeout_ms` make their own namespace's wait, never another's
//!   (docs/security.md, "Health checks on a budget").
//! - **Only where it matters.** A node checks a pool only while it proxies
//!   for it: from the pool's creation (a deploy, a restart) and each request
//!   it picks an instance for, until `health_idle_seconds` without one (0:
//!   always). A cluster node that does not serve a deployment's hosts stops
//!   checking its instances after that long.
//!
//! A check connects like the proxy does, through the egress policy
//! ([`super::h1::connect_tcp`]: names resolve through it, refused literal
//! addresses fail the check). An `https://` instance gets the same `GET`
//! over TLS, with the proxy's client config
//! ([`super::awc_client::upstream_tls`]: a certificate the proxy would
//! refuse fails the check). Pools are held weakly; a retired pool
//! (deployment deleted or replaced, see [`super::Deployments::reload`]) is
//! checked no more.

use super::model::HealthSpec;
use super::pool::{ProxyTimeouts, UpstreamPool};
use crate::config::DeployConfig;
use crate::error::{ApiError, Code};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// How often the scheduler looks for due checks.
const TICK: Duration = Duration::from_millis(100);
/// Checks in flight at once on a node, over every namespace.
const MAX_RUNNING: usize = crate::config::HEALTH_MAX_IN_FLIGHT;

/// 400 `INVALID_UPSTREAM` for a health check asking for a shorter interval
/// than `[deploy] health_min_interval_ms` (at create).
pub fn check_min_interval(cfg: &DeployConfig, spec: Option<&HealthSpec>) -> Result<(), ApiError> {
    match spec {
        Some(h) if h.interval_ms < cfg.health_min_interval_ms => Err(ApiError::new(
            Code::InvalidUpstream,
            format!(
                "health interval_ms {} is shorter than this node's minimum, {} ms ([deploy] health_min_interval_ms)",
                h.interval_ms, cfg.health_min_interval_ms
            ),
        )),
        _ => Ok(()),
    }
}

/// What makes two checks one: the same instance checked the same way, for one namespace.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct CheckKey {
    namespace: Arc<str>,
    base: String,
    path: String,
    timeout_ms: u64,
}

/// One pool's instance that a check serves.
struct Sub {
    pool: Weak<UpstreamPool>,
    index: usize,
}

/// One distinct check and the pools' instances it serves.
struct Check {
    subs: Vec<Sub>,
    /// When it is next due.
    next_due: Instant,
    /// A check of it is in flight (never two at once).
    running: bool,
    /// A pool it serves is in use (set at each tick).
    in_use: bool,
}

/// The scheduler's state.
#[derive(Default)]
struct State {
    checks: HashMap<CheckKey, Check>,
    /// Checks each namespace may start now (refilled at its budget a second).
    credit: HashMap<Arc<str>, f64>,
    /// Checks in flight, node-wide.
    running: usize,
    /// Checks in flight, by namespace (none: 0).
    running_ns: HashMap<Arc<str>, usize>,
}

impl State {
    /// A check of `key` is done: its slots are free again.
    fn finished(&mut self, key: &CheckKey) {
        self.running = self.running.saturating_sub(1);
        if let Some(n) = self.running_ns.get_mut(&key.namespace) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.running_ns.remove(&key.namespace);
            }
        }
        if let Some(c) = self.checks.get_mut(key) {
            c.running = false;
        }
    }
}

/// The node's health checker: every pool with a `health` spec is watched
/// here, and one task (started with the first) runs the due checks.
pub struct HealthChecks {
    state: Arc<Mutex<State>>,
    /// `health_min_interval_ms`.
    min_interval_ms: u64,
    /// `health_checks_per_second`, per namespace.
    per_second: u32,
    /// `health_idle_seconds` in ms (0: always check).
    idle_ms: u64,
    /// `health_in_flight_per_namespace`.
    in_flight_per_namespace: usize,
    /// Whether the task runs.
    started: AtomicBool,
    /// Checks sent since start (each distinct check once).
    sent: Arc<AtomicU64>,
}

impl HealthChecks {
    /// A checker with `[deploy]`'s health settings; its task starts with
    /// the first pool watched.
    pub fn new(cfg: &DeployConfig) -> HealthChecks {
        HealthChecks {
            state: Default::default(),
            min_interval_ms: cfg.health_min_interval_ms.max(1),
            per_second: cfg.health_checks_per_second.max(1),
            idle_ms: cfg.health_idle_seconds.saturating_mul(1000),
            in_flight_per_namespace: cfg.health_in_flight_per_namespace.clamp(1, MAX_RUNNING),
            started: AtomicBool::new(false),
            sent: Default::default(),
        }
    }

    /// Checks sent by this node since it started.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Distinct checks known (watched pools' instances, shared ones once).
    pub fn distinct(&self) -> usize {
        self.state.lock().checks.len()
    }

    /// Watches `pool` of namespace `ns` (when it has a health spec): each
    /// instance joins its distinct check, a new check first due after a
    /// random part of its interval.
    pub fn watch(&self, ns: &str, pool: &Arc<UpstreamPool>) {
        let Some(spec) = pool.health.as_ref() else {
            return;
        };
        let ns: Arc<str> = ns.into();
        let now = crate::util::mono_now();
        {
            let mut st = self.state.lock();
            for (index, inst) in pool.instances.iter().enumerate() {
                let key = CheckKey {
                    namespace: ns.clone(),
                    base: inst.base.clone(),
                    path: spec.path.clone(),
                    timeout_ms: spec.timeout_ms,
                };
                let first = spec.interval_ms.max(self.min_interval_ms);
                let c = st.checks.entry(key).or_insert_with(|| Check {
                    subs: Vec::new(),
                    next_due: now + Duration::from_millis(pool.random() % first),
                    running: false,
                    in_use: true,
                });
                c.subs.push(Sub {
                    pool: Arc::downgrade(pool),
                    index,
                });
            }
        }
        self.start();
    }

    /// Starts the task on this thread's runtime, once.
    fn start(&self) {
        if self.started.load(Ordering::Relaxed) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.started.swap(true, Ordering::Relaxed) {
            return;
        }
        let cfg = Budget {
            min_interval_ms: self.min_interval_ms,
            per_second: self.per_second,
            idle_ms: self.idle_ms,
            in_flight_per_namespace: self.in_flight_per_namespace,
        };
        rt.spawn(run(Arc::downgrade(&self.state), cfg, self.sent.clone()));
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// The limits the scheduler keeps.
#[derive(Clone, Copy)]
struct Budget {
    min_interval_ms: u64,
    per_second: u32,
    idle_ms: u64,
    /// Checks of one namespace in flight at once.
    in_flight_per_namespace: usize,
}

/// A check to run now: its key, the spec and the instances it serves.
type Due = (CheckKey, HealthSpec, Vec<(Arc<UpstreamPool>, usize)>);

/// The scheduler's loop: ends when the node's checker is gone.
async fn run(state: Weak<Mutex<State>>, budget: Budget, sent: Arc<AtomicU64>) {
    let mut last = crate::util::mono_now();
    loop {
        tokio::time::sleep(TICK).await;
        let Some(shared) = state.upgrade() else {
            return;
        };
        let now = crate::util::mono_now();
        let due = plan(&mut shared.lock(), now, now - last, budget, unix_ms());
        last = now;
        for (key, spec, subs) in due {
            sent.fetch_add(1, Ordering::Relaxed);
            let state = shared.clone();
            tokio::spawn(async move {
                let (pool, index) = &subs[0];
                let (_, status) = check(pool, *index, &spec).await;
                for (p, i) in &subs {
                    let passes = status != 0 && p.health.as_ref().is_some_and(|h| h.passes(status));
                    p.checked(*i, passes, status);
                }
                state.lock().finished(&key);
            });
        }
    }
}

/// One tick: drops what no live pool needs, refills each namespace's
/// credit, and takes the due checks of pools in use within the budget
/// (the longest overdue first), scheduling each one's next run.
fn plan(st: &mut State, now: Instant, elapsed: Duration, b: Budget, now_ms: u64) -> Vec<Due> {
    let in_use = |p: &UpstreamPool| {
        !p.is_retired() && (b.idle_ms == 0 || now_ms.saturating_sub(p.last_used_ms()) <= b.idle_ms)
    };
    // Retired and dropped pools leave; the namespaces' checks in use now.
    let mut active: HashMap<Arc<str>, u64> = HashMap::new();
    st.checks.retain(|k, c| {
        let mut used = false;
        c.subs.retain(|s| match s.pool.upgrade() {
            Some(p) if !p.is_retired() => {
                used |= in_use(&p);
                true
            }
            _ => false,
        });
        c.in_use = used;
        if used {
            *active.entry(k.namespace.clone()).or_default() += 1;
        }
        !c.subs.is_empty() || c.running
    });
    // Each namespace's credit, and so how many of its due checks start now.
    st.credit.retain(|ns, _| active.contains_key(ns));
    let refill = f64::from(b.per_second) * elapsed.as_secs_f64();
    let cap = (f64::from(b.per_second) * TICK.as_secs_f64()).max(1.0);
    let room = MAX_RUNNING.saturating_sub(st.running);
    let mut admit: HashMap<Arc<str>, usize> = HashMap::new();
    for ns in active.keys() {
        let credit = st.credit.entry(ns.clone()).or_insert(0.0);
        *credit = (*credit + refill).min(cap);
        let own_room = b
            .in_flight_per_namespace
            .saturating_sub(st.running_ns.get(ns).copied().unwrap_or(0));
        admit.insert(ns.clone(), (*credit as usize).min(room).min(own_room));
    }
    // The longest overdue of each namespace, no more than it admits (a
    // bounded heap: a namespace with thousands overdue costs no copies).
    let mut due: HashMap<Arc<str>, std::collections::BinaryHeap<(Instant, CheckKey)>> =
        HashMap::new();
    for (k, c) in &st.checks {
        if !c.in_use || c.running || c.next_due > now {
            continue;
        }
        let limit = admit.get(&k.namespace).copied().unwrap_or(0);
        if limit == 0 {
            continue;
        }
        let heap = due.entry(k.namespace.clone()).or_default();
        if heap.len() < limit {
            heap.push((c.next_due, k.clone()));
        } else if heap.peek().is_some_and(|(latest, _)| c.next_due < *latest) {
            heap.pop();
            heap.push((c.next_due, k.clone()));
        }
    }
    let mut out = Vec::new();
    for (ns, n) in &active {
        let Some(heap) = due.remove(ns) else {
            continue;
        };
        let Some(credit) = st.credit.get_mut(ns) else {
            continue;
        };
        let list = heap.into_sorted_vec();
        // The namespace's checks spread over its budget.
        let spread_ms = n.saturating_mul(1000) / u64::from(b.per_second);
        for (_, key) in list {
            let ns_running = st.running_ns.get(ns).copied().unwrap_or(0);
            if *credit < 1.0 || st.running >= MAX_RUNNING || ns_running >= b.in_flight_per_namespace
            {
                break;
            }
            let Some(c) = st.checks.get_mut(&key) else {
                continue;
            };
            let subs: Vec<(Arc<UpstreamPool>, usize)> = c
                .subs
                .iter()
                .filter_map(|s| s.pool.upgrade().map(|p| (p, s.index)))
                .collect();
            let Some(spec) = subs.first().and_then(|(p, _)| p.health.clone()) else {
                continue;
            };
            let asked = subs
                .iter()
                .filter_map(|(p, _)| p.health.as_ref().map(|h| h.interval_ms))
                .min()
                .unwrap_or(spec.interval_ms);
            let interval = asked.max(b.min_interval_ms).max(spread_ms).max(1);
            // ±10 %: checks due together drift apart.
            let jitter = subs[0].0.random() % (interval / 5).max(1);
            c.next_due = now + Duration::from_millis(interval - interval / 10 + jitter);
            c.running = true;
            st.running += 1;
            *st.running_ns.entry(ns.clone()).or_default() += 1;
            *credit -= 1.0;
            out.push((key, spec, subs));
        }
    }
    out
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

    /// `[deploy]` health settings for the tests: 100 ms minimum, `per_second`, always checking.
    fn budget(per_second: u32, idle_seconds: u64) -> DeployConfig {
        DeployConfig {
            health_min_interval_ms: 100,
            health_checks_per_second: per_second,
            health_idle_seconds: idle_seconds,
            ..DeployConfig::default()
        }
    }

    fn spec(path: &str, interval_ms: u64) -> HealthSpec {
        serde_json::from_value(serde_json::json!({
            "path": path, "interval_ms": interval_ms, "unhealthy_threshold": 1, "healthy_threshold": 1
        }))
        .unwrap()
    }

    fn checked_pool(bases: &[String], spec: HealthSpec) -> Arc<UpstreamPool> {
        let refs: Vec<&str> = bases.iter().map(String::as_str).collect();
        Arc::new(pool(&refs, 1, Duration::ZERO).with_balancing(
            &[],
            &Balance::RoundRobin,
            Some(spec),
        ))
    }

    /// Runs the scheduler's ticks over `secs` seconds of made-up time (each
    /// check done at once): the checks each namespace started.
    fn simulate(hc: &HealthChecks, b: Budget, secs: u64) -> HashMap<String, u64> {
        let mut started: HashMap<String, u64> = HashMap::new();
        let t0 = Instant::now();
        let ms0 = unix_ms();
        let mut st = hc.state.lock();
        for tick in 1..=(secs * 1000 / TICK.as_millis() as u64) {
            let now = t0 + TICK * tick as u32;
            for (key, _, _) in plan(&mut st, now, TICK, b, ms0) {
                *started.entry(key.namespace.to_string()).or_default() += 1;
                st.finished(&key);
            }
        }
        started
    }

    /// evil's `deployments` × 32 instances checked every `interval_ms`, and
    /// bank's one instance checked every second, watched by `hc`; the pools
    /// are returned so they stay in use.
    fn evil_and_bank(
        hc: &HealthChecks,
        deployments: usize,
        interval_ms: u64,
    ) -> (Vec<Arc<UpstreamPool>>, Arc<UpstreamPool>) {
        let mut pools = Vec::new();
        for d in 0..deployments {
            let bases: Vec<String> = (0..32)
                .map(|i| format!("http://127.0.0.1:{}", 20000 + i))
                .collect();
            let p = checked_pool(&bases, spec(&format!("/h/{d}"), interval_ms));
            hc.watch("evil", &p);
            pools.push(p);
        }
        let bank = checked_pool(&["http://127.0.0.1:30000".to_string()], spec("/h", 1000));
        hc.watch("bank", &bank);
        (pools, bank)
    }

    /// 100 deployments × 32 instances asking for 100 ms checks cost their
    /// namespace its budget (50 checks a second) and no more, while another
    /// namespace's one check still runs at its own interval.
    #[test]
    fn a_namespace_stays_within_its_check_budget() {
        let hc = HealthChecks::new(&budget(50, 0));
        let b = Budget {
            min_interval_ms: 100,
            per_second: 50,
            idle_ms: 0,
            in_flight_per_namespace: 16,
        };
        let (_pools, _bank) = evil_and_bank(&hc, 100, 100);
        assert_eq!(hc.distinct(), 3201);
        let started = simulate(&hc, b, 10);
        let evil = started["evil"];
        // At most the budget a second (plus one tick's credit), and it is used.
        assert!((400..=50 * 10 + 5).contains(&evil), "{evil}");
        // bank: once a second (and maybe once more for its first, random, start).
        assert!((8..=11).contains(&started["bank"]), "{started:?}");
    }

    /// The attack: 10 deployments × 32 instances of evil that accept and
    /// never answer (each check hangs until its 60 s timeout) must not take
    /// the node's check slots: evil holds at most its share in flight, and
    /// bank's one check still runs about once a second. (Before, evil's
    /// hanging checks filled all 256 slots within seconds and bank's
    /// stopped.)
    #[test]
    fn hanging_checks_of_one_namespace_leave_the_others_slots() {
        let hc = HealthChecks::new(&budget(50, 0));
        let b = Budget {
            min_interval_ms: 100,
            per_second: 50,
            idle_ms: 0,
            in_flight_per_namespace: 16,
        };
        let (_pools, _bank) = evil_and_bank(&hc, 10, 1000);
        let t0 = Instant::now();
        let ms0 = unix_ms();
        let mut st = hc.state.lock();
        let mut bank_started = 0;
        for tick in 1..=(30_000 / TICK.as_millis() as u32) {
            for (key, _, _) in plan(&mut st, t0 + TICK * tick, TICK, b, ms0) {
                if &*key.namespace == "bank" {
                    bank_started += 1;
                    st.finished(&key);
                }
                // evil's checks never finish (within these 30 s).
            }
            let evil = st.running_ns.get("evil").copied().unwrap_or(0);
            assert!(evil <= 16, "evil holds {evil} check slots");
        }
        // bank: about once a second over 30 s.
        assert!(bank_started >= 25, "bank's checks started: {bank_started}");
    }

    /// Two deployments of a namespace naming the same instance with the same
    /// check share one check; another namespace's, another path's are their own.
    #[test]
    fn shared_instances_are_checked_once() {
        let hc = HealthChecks::new(&budget(50, 0));
        let same = vec!["http://127.0.0.1:20000".to_string()];
        let (a, b) = (
            checked_pool(&same, spec("/h", 100)),
            checked_pool(&same, spec("/h", 100)),
        );
        hc.watch("bank", &a);
        hc.watch("bank", &b);
        assert_eq!(hc.distinct(), 1);
        let b_ = Budget {
            min_interval_ms: 100,
            per_second: 50,
            idle_ms: 0,
            in_flight_per_namespace: 16,
        };
        // At most one check a tick (100 ms) for the one shared check, never two.
        let started = simulate(&hc, b_, 5);
        assert!((20..=50).contains(&started["bank"]), "{started:?}");
        let c = checked_pool(&same, spec("/other", 100));
        hc.watch("bank", &c);
        let d = checked_pool(&same, spec("/h", 100));
        hc.watch("evil", &d);
        assert_eq!(hc.distinct(), 3);
        // A retired pool's check goes once nothing else needs it.
        c.stop_checker();
        simulate(&hc, b_, 1);
        assert_eq!(hc.distinct(), 2);
    }

    /// With `health_idle_seconds`, a pool no request used for that long is
    /// not checked; once a request picks an instance, it is again.
    #[test]
    fn only_pools_in_use_are_checked() {
        let hc = HealthChecks::new(&budget(50, 60));
        let b = Budget {
            min_interval_ms: 100,
            per_second: 50,
            idle_ms: 60_000,
            in_flight_per_namespace: 16,
        };
        let p = checked_pool(&["http://127.0.0.1:20000".to_string()], spec("/h", 100));
        hc.watch("bank", &p);
        p.set_last_used_ms(unix_ms() - 120_000);
        assert!(simulate(&hc, b, 2).is_empty());
        p.order();
        assert!(simulate(&hc, b, 2)["bank"] >= 5);
    }

    /// A checker against real listeners on 127.0.0.1: a 503 takes its
    /// instance out, a 200 keeps its own in; a retired pool is checked no more.
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
        let p = checked_pool(
            &[
                format!("http://127.0.0.1:{ok}"),
                format!("http://127.0.0.1:{bad}"),
            ],
            spec("/healthz", 100),
        );
        let hc = HealthChecks::new(&budget(50, 0));
        hc.watch("bank", &p);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while p.states()[1].healthy {
            assert!(std::time::Instant::now() < deadline, "never checked");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let s = p.states();
        assert!(s[0].healthy);
        assert_eq!(s[1].check.as_ref().unwrap().last_status, 503);
        assert_eq!(p.order(), vec![0]);
        // Retired (as when the deployment is deleted or replaced): no more checks.
        p.stop_checker();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let sent = hc.sent();
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(hc.sent(), sent);
    }
}
