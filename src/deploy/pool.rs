//! Balancing and health of a deployment's upstream instances: the
//! balancers (smooth weighted round robin, least request by power of two
//! choices, rendezvous hashing) among the healthy ones, passive health (an
//! instance skipped for a while after `fail_after` connection failures in a
//! row), the active checks' state (run by [`super::health`]), and each instance's address
//! facts parsed once (its literal address for the egress check, its name to
//! resolve, the `Host` a plain-HTTP client sends, the origin URIs are built
//! from). No I/O here: the clients ([`super::h1`], [`super::wire`],
//! [`super::awc_client`]) connect, the driver ([`super::proxy`]) decides.

use super::egress::{EgressPolicy, Refusal};
use super::model::{Balance, HealthSpec};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// One upstream instance and its passive health.
pub struct Instance {
    /// The instance's base URL (`http://host:port`), as deployed; logs and status name it.
    pub base: String,
    /// The address the base names literally (never resolved, so checked by
    /// the proxy itself before each attempt).
    pub(crate) literal: Option<std::net::SocketAddr>,
    /// The host and port the base names (a name resolves through the egress policy).
    pub(crate) host_port: Option<(String, u16)>,
    /// The `Host` sent to a plain-HTTP instance (its authority), made once;
    /// None for an `https://` instance (reached through awc).
    pub(crate) plain_host: Option<hyper::header::HeaderValue>,
    /// The base's scheme and authority, parsed once: each request's URI is
    /// built from them and its path, not parsed again from a string.
    origin: Option<(
        actix_web::http::uri::Scheme,
        actix_web::http::uri::Authority,
    )>,
    /// Connection failures or timeouts in a row; reset by a success.
    failures: AtomicU32,
    /// Unix ms until which the instance is skipped (0: healthy); set at `fail_after`.
    down_until_ms: AtomicU64,
    /// Its weight (1..=1000).
    pub weight: u32,
    /// Requests sent and not yet answered (their heads), for `least_request`.
    in_flight: AtomicU32,
    /// Out of rotation by the active check (`unhealthy_threshold` failures
    /// in a row, until `healthy_threshold` passes in a row).
    check_down: AtomicBool,
    /// Active check passes in a row.
    check_passes: AtomicU32,
    /// Active check failures in a row.
    check_failures: AtomicU32,
    /// Unix ms of the last active check (0: none yet).
    last_check_ms: AtomicU64,
    /// The last active check's status (0: no answer).
    last_status: AtomicU32,
    /// This instance's hash seed (of its base URL), for rendezvous hashing.
    seed: u64,
}

/// How [`UpstreamPool::pick`] chooses.
enum Balancer {
    /// Every weight equal: the cursor alone (no lock).
    Cursor,
    /// Smooth weighted round robin: each instance's current weight.
    Smooth(parking_lot::Mutex<Vec<i64>>),
    /// Power of two random choices on in-flight requests over weight.
    LeastRequest,
    /// Rendezvous hashing of the header's value (none: the client address).
    Hash(Option<actix_web::http::header::HeaderName>),
}

/// One instance's state, as `GET /v1/deployments/{name}` and `/metrics` show it.
pub struct InstanceState {
    pub url: String,
    /// In rotation: neither passive nor active health has it out.
    pub healthy: bool,
    /// Passive failures in a row.
    pub failures: u32,
    /// The active check: None when the deployment has none.
    pub check: Option<CheckState>,
    pub in_flight: u32,
    pub weight: u32,
}

/// The active check's view of one instance.
pub struct CheckState {
    pub healthy: bool,
    pub passes: u32,
    pub failures: u32,
    /// Unix ms of the last check (0: none yet).
    pub last_ms: u64,
    /// Its status (0: no answer).
    pub last_status: u32,
}

/// Counts a request in flight on an instance until dropped.
pub(crate) struct InFlight<'a>(&'a AtomicU32);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// splitmix64's finalizer: a well-mixed 64-bit hash of `x`.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
    x ^ (x >> 31)
}

/// FNV-1a of `b`, then mixed: stable across nodes and builds.
fn hash_bytes(b: &[u8]) -> u64 {
    let mut h = 0xcbf29ce484222325u64;
    for &c in b {
        h ^= u64::from(c);
        h = h.wrapping_mul(0x100000001b3);
    }
    mix(h)
}

/// Weighted rendezvous score of `key` on an instance: `-w / ln(u)` with `u`
/// uniform in (0, 1) from the key's and the instance's hashes. The highest
/// score takes the key, so removing an instance moves only its keys.
fn rendezvous(key: u64, seed: u64, weight: u32) -> f64 {
    let u = ((mix(key ^ seed) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -f64::from(weight) / u.ln()
}

/// The instances of one deployment version.
pub struct UpstreamPool {
    /// The version's instances, in deploy order; picked by the balancer among the healthy.
    pub instances: Vec<Instance>,
    /// Where the instances may be connected.
    pub egress: Arc<EgressPolicy>,
    /// Every instance is plain HTTP: requests go through [`super::h1`]
    /// (otherwise through awc, which speaks TLS).
    plain: bool,
    /// Round-robin cursor (equal weights): where the next request starts looking for a healthy instance.
    next: AtomicUsize,
    /// Failures in a row that mark an instance down (at least 1).
    fail_after: u32,
    /// How long a down instance is skipped before it is tried again.
    down_for: Duration,
    /// How the first instance to try is chosen.
    balancer: Balancer,
    /// State of the random choices of `least_request`.
    rng: AtomicU64,
    /// The active check, run by [`super::health`] while this pool serves.
    pub health: Option<HealthSpec>,
    /// Unix ms of the last request this node picked an instance for (at
    /// first, of the pool's creation): the checker checks only pools in use
    /// (`health_idle_seconds`).
    last_used_ms: AtomicU64,
    /// The deployment's `compress`: answers gzipped for clients that accept
    /// it (`super::compress`).
    pub compress: bool,
    /// Set when the pool is retired (its deployment deleted or replaced):
    /// the checker stops checking for it.
    retired: AtomicBool,
    /// The deployment's `pass_ambiguous_paths`: a path the node refuses as
    /// ambiguous is passed unchanged (`super::canonical`).
    pub pass_ambiguous_paths: bool,
    /// The deployment's `allow_underscore_headers`: client header names with
    /// `_` are passed (`super::canonical::judge_header`).
    pub allow_underscore_headers: bool,
    /// The deployment's `grpc.max_timeout_ms`: the cap on a gRPC call's deadline.
    pub grpc_max_timeout: Option<Duration>,
}

/// Timeouts of the proxy.
#[derive(Clone, Copy)]
pub struct ProxyTimeouts {
    /// Limit on connecting to an instance (deployment config `connect_timeout_seconds`).
    pub connect: Duration,
    /// Limit on the whole upstream exchange (config `upstream_timeout_seconds`).
    pub response: Duration,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// The scheme and authority of an instance's base (`http://host:port`).
fn origin_of(
    base: &str,
) -> Option<(
    actix_web::http::uri::Scheme,
    actix_web::http::uri::Authority,
)> {
    let uri: actix_web::http::Uri = base.parse().ok()?;
    let p = uri.into_parts();
    Some((p.scheme?, p.authority?))
}

/// The `Host` of a plain `http://` base: its authority.
fn plain_host(base: &str) -> Option<hyper::header::HeaderValue> {
    let (scheme, authority) = origin_of(base)?;
    if scheme != actix_web::http::uri::Scheme::HTTP {
        return None;
    }
    hyper::header::HeaderValue::from_str(authority.as_str()).ok()
}

impl Instance {
    /// The URI of `path_and_query` on this instance.
    pub(crate) fn uri(&self, path_and_query: &str) -> Result<actix_web::http::Uri, String> {
        let built = self.origin.as_ref().and_then(|(scheme, authority)| {
            let mut parts = actix_web::http::uri::Parts::default();
            parts.scheme = Some(scheme.clone());
            parts.authority = Some(authority.clone());
            parts.path_and_query = Some(path_and_query.parse().ok()?);
            actix_web::http::Uri::from_parts(parts).ok()
        });
        match built {
            Some(u) => Ok(u),
            None => format!("{}{}", self.base, path_and_query)
                .parse()
                .map_err(|e| format!("{e}")),
        }
    }
}

impl UpstreamPool {
    pub fn new(
        bases: &[String],
        egress: Arc<EgressPolicy>,
        fail_after: u32,
        down_for: Duration,
    ) -> UpstreamPool {
        let instances: Vec<Instance> = bases
            .iter()
            .map(|b| Instance {
                base: b.clone(),
                literal: super::egress::literal_addr(b),
                host_port: super::egress::host_port(b),
                plain_host: plain_host(b),
                origin: origin_of(b),
                failures: AtomicU32::new(0),
                down_until_ms: AtomicU64::new(0),
                weight: 1,
                in_flight: AtomicU32::new(0),
                check_down: AtomicBool::new(false),
                check_passes: AtomicU32::new(0),
                check_failures: AtomicU32::new(0),
                last_check_ms: AtomicU64::new(0),
                last_status: AtomicU32::new(0),
                seed: hash_bytes(b.as_bytes()),
            })
            .collect();
        UpstreamPool {
            egress,
            plain: !instances.is_empty() && instances.iter().all(|i| i.plain_host.is_some()),
            instances,
            next: AtomicUsize::new(0),
            fail_after: fail_after.max(1),
            down_for,
            balancer: Balancer::Cursor,
            rng: AtomicU64::new(now_ms() ^ 0x2545f4914f6cdd1d),
            health: None,
            last_used_ms: AtomicU64::new(now_ms()),
            compress: true,
            retired: AtomicBool::new(false),
            pass_ambiguous_paths: false,
            allow_underscore_headers: false,
            grpc_max_timeout: None,
        }
    }

    /// The pool gzipping its answers for clients that accept it, or not
    /// (`super::compress`).
    pub fn with_compress(mut self, compress: bool) -> UpstreamPool {
        self.compress = compress;
        self
    }

    /// With the deployment's gRPC settings.
    pub fn with_grpc(mut self, grpc: Option<super::model::GrpcSpec>) -> UpstreamPool {
        self.grpc_max_timeout = grpc.map(|g| Duration::from_millis(g.max_timeout_ms));
        self
    }

    /// The deployment's request rules: ambiguous paths passed, underscore
    /// header names passed (`super::canonical`).
    pub fn with_request_rules(mut self, paths: bool, underscores: bool) -> UpstreamPool {
        self.pass_ambiguous_paths = paths;
        self.allow_underscore_headers = underscores;
        self
    }

    /// The pool with its weights (none: all 1), balancer and active check.
    pub fn with_balancing(
        mut self,
        weights: &[u32],
        balance: &Balance,
        health: Option<HealthSpec>,
    ) -> UpstreamPool {
        for (inst, &w) in self.instances.iter_mut().zip(weights) {
            inst.weight = w.max(1);
        }
        let equal = self
            .instances
            .windows(2)
            .all(|w| w[0].weight == w[1].weight);
        self.balancer =
            match balance {
                Balance::RoundRobin if equal => Balancer::Cursor,
                Balance::RoundRobin => {
                    Balancer::Smooth(parking_lot::Mutex::new(vec![0; self.instances.len()]))
                }
                Balance::LeastRequest => Balancer::LeastRequest,
                Balance::Hash(on) => Balancer::Hash(on.header.as_deref().and_then(|h| {
                    actix_web::http::header::HeaderName::from_bytes(h.as_bytes()).ok()
                })),
            };
        self.health = health;
        self
    }

    /// Retires the pool: the active checker checks it no more.
    pub(crate) fn stop_checker(&self) {
        self.retired.store(true, Ordering::Relaxed);
    }

    /// Whether the pool is retired ([`UpstreamPool::stop_checker`]).
    pub(crate) fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// Unix ms of the last request this node picked an instance for (or of
    /// the pool's creation).
    pub(crate) fn last_used_ms(&self) -> u64 {
        self.last_used_ms.load(Ordering::Relaxed)
    }

    /// Test only: the pool as last used at `ms`.
    #[cfg(test)]
    pub(crate) fn set_last_used_ms(&self, ms: u64) {
        self.last_used_ms.store(ms, Ordering::Relaxed);
    }

    /// Whether instance `i` is in rotation at `now` (unix ms).
    fn up(&self, i: usize, now: u64) -> bool {
        let inst = &self.instances[i];
        inst.down_until_ms.load(Ordering::Relaxed) <= now
            && !inst.check_down.load(Ordering::Relaxed)
    }

    /// Counts a request in flight on instance `i` until the guard drops.
    pub(crate) fn start(&self, i: usize) -> InFlight<'_> {
        let c = &self.instances[i].in_flight;
        c.fetch_add(1, Ordering::Relaxed);
        InFlight(c)
    }

    /// A random number (splitmix64 over an atomic counter).
    pub(crate) fn random(&self) -> u64 {
        mix(self.rng.fetch_add(0x9e3779b97f4a7c15, Ordering::Relaxed))
    }

    /// The instances to try for a request, the balancer's choice first and
    /// the other healthy ones after it (tried only when it cannot be
    /// connected); empty when none is healthy. `hash` balancing hashes the
    /// request's header, or without it the `client` address.
    pub fn pick(
        &self,
        req: Option<&actix_web::HttpRequest>,
        client: Option<std::net::IpAddr>,
    ) -> Vec<usize> {
        let n = self.instances.len();
        let now = now_ms();
        // Read first: one shared-line write a second at most, not one a request.
        if self.last_used_ms.load(Ordering::Relaxed) / 1000 != now / 1000 {
            self.last_used_ms.store(now, Ordering::Relaxed);
        }
        let mut order = Vec::with_capacity(n);
        match &self.balancer {
            Balancer::Cursor => {
                let start = self.next.fetch_add(1, Ordering::Relaxed);
                order.extend((0..n).map(|i| (start + i) % n).filter(|&i| self.up(i, now)));
            }
            Balancer::Smooth(current) => {
                let mut best = None;
                {
                    let mut cur = current.lock();
                    let mut total = 0i64;
                    for i in 0..n {
                        if !self.up(i, now) {
                            continue;
                        }
                        let w = i64::from(self.instances[i].weight);
                        cur[i] += w;
                        total += w;
                        if best.is_none_or(|b: usize| cur[i] > cur[b]) {
                            best = Some(i);
                        }
                    }
                    if let Some(b) = best {
                        cur[b] -= total;
                    }
                }
                if let Some(b) = best {
                    order.extend(
                        (0..n)
                            .map(|i| (b + i) % n)
                            .filter(|&i| i == b || self.up(i, now)),
                    );
                }
            }
            Balancer::LeastRequest => {
                order.extend((0..n).filter(|&i| self.up(i, now)));
                if order.len() > 1 {
                    let r = self.random();
                    let k = order.len() as u64;
                    let a = (r % k) as usize;
                    let b = (a + 1 + ((r >> 32) % (k - 1)) as usize) % order.len();
                    let (ia, ib) = (&self.instances[order[a]], &self.instances[order[b]]);
                    // Fewer in flight per weight wins: a/wa < b/wb.
                    let la = u64::from(ia.in_flight.load(Ordering::Relaxed)) * u64::from(ib.weight);
                    let lb = u64::from(ib.in_flight.load(Ordering::Relaxed)) * u64::from(ia.weight);
                    let chosen = if lb < la || (lb == la && ib.weight > ia.weight) {
                        b
                    } else {
                        a
                    };
                    order.swap(0, chosen);
                }
            }
            Balancer::Hash(header) => {
                let key = match header
                    .as_ref()
                    .and_then(|h| req.and_then(|r| r.headers().get(h)))
                {
                    Some(v) => hash_bytes(v.as_bytes()),
                    None => match client {
                        Some(std::net::IpAddr::V4(a)) => hash_bytes(&a.octets()),
                        Some(std::net::IpAddr::V6(a)) => hash_bytes(&a.octets()),
                        None => 0,
                    },
                };
                let mut best: Option<(usize, f64)> = None;
                for i in (0..n).filter(|&i| self.up(i, now)) {
                    let inst = &self.instances[i];
                    let s = rendezvous(key, inst.seed, inst.weight);
                    if best.is_none_or(|(_, b)| s > b) {
                        best = Some((i, s));
                    }
                }
                if let Some((b, _)) = best {
                    order.extend(
                        (0..n)
                            .map(|i| (b + i) % n)
                            .filter(|&i| i == b || self.up(i, now)),
                    );
                }
            }
        }
        order
    }

    /// An active check of instance `i` passed (`ok`) or failed, with the
    /// status it answered (0: none).
    pub(crate) fn checked(&self, i: usize, ok: bool, status: u16) {
        let Some(h) = &self.health else { return };
        let inst = &self.instances[i];
        inst.last_check_ms.store(now_ms(), Ordering::Relaxed);
        inst.last_status.store(u32::from(status), Ordering::Relaxed);
        if ok {
            inst.check_failures.store(0, Ordering::Relaxed);
            let p = inst.check_passes.fetch_add(1, Ordering::Relaxed) + 1;
            if p >= h.healthy_threshold && inst.check_down.swap(false, Ordering::Relaxed) {
                tracing::info!(instance = %inst.base, passes = p, "Upstream instance back in rotation (active check).");
            }
        } else {
            inst.check_passes.store(0, Ordering::Relaxed);
            let f = inst.check_failures.fetch_add(1, Ordering::Relaxed) + 1;
            if f >= h.unhealthy_threshold && !inst.check_down.swap(true, Ordering::Relaxed) {
                tracing::warn!(instance = %inst.base, failures = f, status, "Upstream instance out of rotation (active check).");
            }
        }
    }

    /// Each instance's state now (for the API and `/metrics`).
    pub fn states(&self) -> Vec<InstanceState> {
        let now = now_ms();
        self.instances
            .iter()
            .enumerate()
            .map(|(n, i)| InstanceState {
                url: i.base.clone(),
                healthy: self.up(n, now),
                failures: i.failures.load(Ordering::Relaxed),
                check: self.health.as_ref().map(|_| CheckState {
                    healthy: !i.check_down.load(Ordering::Relaxed),
                    passes: i.check_passes.load(Ordering::Relaxed),
                    failures: i.check_failures.load(Ordering::Relaxed),
                    last_ms: i.last_check_ms.load(Ordering::Relaxed),
                    last_status: i.last_status.load(Ordering::Relaxed),
                }),
                in_flight: i.in_flight.load(Ordering::Relaxed),
                weight: i.weight,
            })
            .collect()
    }

    /// Whether every instance is plain HTTP (requests then go through
    /// [`super::wire`] and [`super::h1`], otherwise through awc).
    pub(crate) fn plain(&self) -> bool {
        self.plain
    }

    /// Healthy instances, in the order to try them (the balancer's choice
    /// first), for a request without a hash key.
    pub fn order(&self) -> Vec<usize> {
        self.pick(None, None)
    }

    /// A connection failure or timeout: after `fail_after` in a row the instance
    /// is skipped for `down_for` (then tried again; one more failure skips it again).
    pub fn failed(&self, i: usize) {
        let inst = &self.instances[i];
        let f = inst.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if f >= self.fail_after {
            inst.down_until_ms.store(
                now_ms() + self.down_for.as_millis() as u64,
                Ordering::Relaxed,
            );
            tracing::warn!(instance = %inst.base, failures = f, "Upstream instance marked unhealthy.");
        }
    }

    pub fn succeeded(&self, i: usize) {
        let inst = &self.instances[i];
        if inst.failures.swap(0, Ordering::Relaxed) != 0 {
            inst.down_until_ms.store(0, Ordering::Relaxed);
        }
    }

    /// The policy's refusal of instance `i`'s literal address, if it has one
    /// and it is refused (names are checked by the client's resolver).
    pub(crate) fn refused(&self, i: usize) -> Option<Refusal> {
        let a = self.instances[i].literal?;
        self.egress.check_addr(a.ip(), a.port()).err()
    }

    /// Whether each instance is healthy now, and its passive failures.
    pub fn health(&self) -> Vec<(String, bool, u32)> {
        self.states()
            .into_iter()
            .map(|s| (s.url, s.healthy, s.failures))
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::DeployConfig;

    /// A policy that allows loopback (tests connect to 127.0.0.1 only).
    pub(crate) fn loopback_policy() -> Arc<EgressPolicy> {
        let cfg = DeployConfig {
            upstream_allow: vec!["127.0.0.0/8".into()],
            ..DeployConfig::default()
        };
        Arc::new(EgressPolicy::from_config(&cfg))
    }

    pub(crate) fn pool(bases: &[&str], fail_after: u32, down_for: Duration) -> UpstreamPool {
        let bases: Vec<String> = bases.iter().map(|s| s.to_string()).collect();
        UpstreamPool::new(&bases, loopback_policy(), fail_after, down_for)
    }

    /// Each request starts one instance further; all are offered.
    #[test]
    fn order_is_round_robin_over_all_healthy() {
        let p = pool(
            &[
                "http://127.0.0.1:1",
                "http://127.0.0.1:2",
                "http://127.0.0.1:3",
            ],
            1,
            Duration::from_secs(60),
        );
        assert_eq!(p.order(), vec![0, 1, 2]);
        assert_eq!(p.order(), vec![1, 2, 0]);
        assert_eq!(p.order(), vec![2, 0, 1]);
        assert_eq!(p.order(), vec![0, 1, 2]);
        assert!(pool(&[], 1, Duration::ZERO).order().is_empty());
    }

    /// `fail_after` failures in a row mark an instance down (skipped); a
    /// success before that resets the count, and a success revives it.
    #[test]
    fn failures_in_a_row_mark_an_instance_down() {
        let p = pool(
            &["http://127.0.0.1:1", "http://127.0.0.1:2"],
            2,
            Duration::from_secs(3600),
        );
        p.failed(0);
        p.succeeded(0);
        p.failed(0);
        assert_eq!(p.health()[0], ("http://127.0.0.1:1".into(), true, 1));
        p.failed(0);
        assert_eq!(p.health()[0], ("http://127.0.0.1:1".into(), false, 2));
        for _ in 0..3 {
            assert_eq!(p.order(), vec![1]);
        }
        p.succeeded(0);
        assert_eq!(p.health()[0], ("http://127.0.0.1:1".into(), true, 0));
        assert_eq!(p.order().len(), 2);
        // `fail_after` 0 counts as 1; `down_for` 0 skips no request.
        let p = pool(&["http://127.0.0.1:1"], 0, Duration::ZERO);
        p.failed(0);
        assert_eq!(p.health()[0].2, 1);
        assert_eq!(p.order(), vec![0]);
    }

    fn weighted(n: usize, weights: &[u32], balance: Balance) -> UpstreamPool {
        let bases: Vec<String> = (1..=n).map(|i| format!("http://127.0.0.1:{i}")).collect();
        let refs: Vec<&str> = bases.iter().map(String::as_str).collect();
        pool(&refs, 1, Duration::from_secs(3600)).with_balancing(weights, &balance, None)
    }

    fn ip(k: u32) -> Option<std::net::IpAddr> {
        Some(std::net::IpAddr::V4(std::net::Ipv4Addr::from(k)))
    }

    /// Smooth weighted round robin: exact shares per cycle, interleaved
    /// (3:1 is a a b a, not a a a b); a down instance's share goes to the rest.
    #[test]
    fn smooth_round_robin_follows_weights() {
        let p = weighted(2, &[3, 1], Balance::RoundRobin);
        let first: Vec<usize> = (0..4).map(|_| p.order()[0]).collect();
        assert_eq!(first, vec![0, 0, 1, 0]);
        let mut n = [0; 2];
        for _ in 0..1000 {
            n[p.order()[0]] += 1;
        }
        assert_eq!(n, [750, 250]);
        // The other healthy instance follows the choice (for a retry).
        assert_eq!(p.order().len(), 2);
        let p = weighted(3, &[5, 2, 3], Balance::RoundRobin);
        let mut n = [0; 3];
        for _ in 0..100 {
            n[p.order()[0]] += 1;
        }
        assert_eq!(n, [50, 20, 30]);
        p.failed(0);
        let mut n = [0; 3];
        for _ in 0..100 {
            n[p.order()[0]] += 1;
        }
        assert_eq!(n, [0, 40, 60]);
    }

    /// Power of two choices: never the most loaded of two; with three, the
    /// stalled one is never chosen; with equal load, all are used; weight
    /// divides the load.
    #[test]
    fn least_request_avoids_loaded_instances() {
        let p = weighted(2, &[], Balance::LeastRequest);
        let stalled: Vec<_> = (0..5).map(|_| p.start(0)).collect();
        for _ in 0..100 {
            assert_eq!(p.order(), vec![1, 0]);
        }
        drop(stalled);
        let mut n = [0; 2];
        for _ in 0..1000 {
            n[p.order()[0]] += 1;
        }
        assert!(n[0] > 300 && n[1] > 300, "{n:?}");
        let p = weighted(3, &[], Balance::LeastRequest);
        let _stalled = p.start(2);
        for _ in 0..200 {
            assert_ne!(p.order()[0], 2);
        }
        // 2 in flight on weight 4 beats 1 in flight on weight 1.
        let p = weighted(2, &[4, 1], Balance::LeastRequest);
        let _a = (p.start(0), p.start(0));
        let _b = p.start(1);
        for _ in 0..50 {
            assert_eq!(p.order()[0], 0);
        }
        assert_eq!(weighted(1, &[], Balance::LeastRequest).order(), vec![0]);
    }

    /// Rendezvous hashing: a key stays on one instance; shares follow the
    /// weights; removing an instance moves only the keys that were on it.
    #[test]
    fn hash_is_consistent() {
        let p = weighted(4, &[], Balance::Hash(Default::default()));
        let before: Vec<usize> = (0..4000).map(|k| p.pick(None, ip(k))[0]).collect();
        for k in 0..4000 {
            assert_eq!(p.pick(None, ip(k))[0], before[k as usize]);
        }
        let mut n = [0; 4];
        for &i in &before {
            n[i] += 1;
        }
        assert!(n.iter().all(|&c| (800..1200).contains(&c)), "{n:?}");
        p.failed(2);
        let mut moved_to = [0; 4];
        for k in 0..4000 {
            let now = p.pick(None, ip(k))[0];
            if before[k as usize] == 2 {
                assert_ne!(now, 2);
                moved_to[now] += 1;
            } else {
                assert_eq!(now, before[k as usize], "key {k} moved");
            }
        }
        // The lost share spreads over the rest.
        assert!(
            moved_to.iter().enumerate().all(|(i, &c)| i == 2 || c > 150),
            "{moved_to:?}"
        );
        // Back: every key returns where it was.
        p.succeeded(2);
        for k in 0..4000 {
            assert_eq!(p.pick(None, ip(k))[0], before[k as usize]);
        }
        let p = weighted(2, &[3, 1], Balance::Hash(Default::default()));
        let on0 = (0..4000).filter(|&k| p.pick(None, ip(k))[0] == 0).count();
        assert!((2800..3200).contains(&on0), "{on0}");
    }

    /// A hash header's value is the key; without the header, the client address.
    #[test]
    fn hash_reads_the_header() {
        let on = super::super::model::HashOn {
            header: Some("X-User".into()),
        };
        let p = weighted(8, &[], Balance::Hash(on));
        let req = |u: &str| {
            actix_web::test::TestRequest::default()
                .insert_header(("x-user", u.to_string()))
                .to_http_request()
        };
        let alice = p.pick(Some(&req("alice")), ip(1))[0];
        for k in 0..50 {
            assert_eq!(p.pick(Some(&req("alice")), ip(k))[0], alice);
        }
        let bare = actix_web::test::TestRequest::default().to_http_request();
        let by_ip = p.pick(Some(&bare), ip(7))[0];
        assert_eq!(p.pick(None, ip(7))[0], by_ip);
        let users: std::collections::BTreeSet<usize> = (0..100)
            .map(|u| p.pick(Some(&req(&format!("user{u}"))), ip(1))[0])
            .collect();
        assert!(users.len() >= 6, "{users:?}");
    }

    /// An active check failing `unhealthy_threshold` times takes an instance
    /// out; `healthy_threshold` passes bring it back.
    #[test]
    fn active_checks_move_instances_in_and_out() {
        let spec: HealthSpec = serde_json::from_value(serde_json::json!({
            "path": "/h", "healthy_threshold": 2, "unhealthy_threshold": 2
        }))
        .unwrap();
        let p = pool(
            &["http://127.0.0.1:1", "http://127.0.0.1:2"],
            1,
            Duration::ZERO,
        )
        .with_balancing(&[], &Balance::RoundRobin, Some(spec));
        p.checked(0, false, 503);
        assert_eq!(p.order().len(), 2);
        p.checked(0, false, 503);
        for _ in 0..4 {
            assert_eq!(p.order(), vec![1]);
        }
        let s = &p.states()[0];
        let c = s.check.as_ref().unwrap();
        assert!(!s.healthy && !c.healthy && c.failures == 2 && c.last_status == 503);
        p.checked(0, true, 200);
        assert_eq!(p.order(), vec![1]);
        p.checked(0, true, 200);
        assert_eq!(p.order().len(), 2);
        p.checked(1, false, 0);
        p.checked(1, false, 0);
        p.checked(0, false, 0);
        p.checked(0, false, 0);
        assert!(p.order().is_empty());
    }

    /// A pool is plain when every instance is `http://`; each plain instance
    /// has its `Host`, literal address and origin parsed once.
    #[test]
    fn instances_are_parsed_once() {
        let p = pool(
            &["http://127.0.0.1:8080", "http://app.internal:81"],
            1,
            Duration::ZERO,
        );
        assert!(p.plain());
        let a = &p.instances[0];
        assert_eq!(a.plain_host.as_ref().unwrap(), "127.0.0.1:8080");
        assert_eq!(a.literal, Some("127.0.0.1:8080".parse().unwrap()));
        let b = &p.instances[1];
        assert_eq!(b.literal, None);
        assert_eq!(b.host_port, Some(("app.internal".into(), 81)));
        assert_eq!(
            b.uri("/a/b?c=d").unwrap().to_string(),
            "http://app.internal:81/a/b?c=d"
        );
        let p = pool(
            &["http://127.0.0.1:1", "https://example.test"],
            1,
            Duration::ZERO,
        );
        assert!(!p.plain());
        assert!(p.instances[1].plain_host.is_none());
        assert_eq!(
            p.instances[1].uri("/x").unwrap().to_string(),
            "https://example.test/x"
        );
        assert!(!pool(&[], 1, Duration::ZERO).plain());
        assert!(p.instances[0].uri("/a b").is_err());
    }

    /// A literal address the policy refuses is refused before any connect;
    /// a name is left to the resolver.
    #[test]
    fn refused_literals_are_found_before_connecting() {
        let bases = vec![
            "http://10.1.2.3:80".to_string(),
            "http://127.0.0.1:80".to_string(),
            "http://app.internal:80".to_string(),
        ];
        let strict = Arc::new(EgressPolicy::from_config(&DeployConfig::default()));
        let p = UpstreamPool::new(&bases, strict, 1, Duration::ZERO);
        assert!(p.refused(0).is_some());
        assert!(p.refused(1).is_some());
        assert!(p.refused(2).is_none());
        let p = UpstreamPool::new(&bases, loopback_policy(), 1, Duration::ZERO);
        assert!(p.refused(1).is_none());
    }

    /// An upstream on 127.0.0.1 answering each request with its request
    /// line and body (keep-alive), and how many connections it accepted.
    pub(crate) async fn echo_upstream() -> (
        u16,
        Arc<std::sync::atomic::AtomicUsize>,
        tokio::task::JoinHandle<()>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = accepted.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                counted.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut b = [0u8; 4096];
                    loop {
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            match s.read(&mut b).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&b[..n]),
                            }
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).to_string();
                        let len: usize = head
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse().unwrap())
                            })
                            .unwrap_or(0);
                        while buf.len() < end + 4 + len {
                            match s.read(&mut b).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&b[..n]),
                            }
                        }
                        let mut body = head.lines().next().unwrap().as_bytes().to_vec();
                        body.push(b' ');
                        body.extend_from_slice(&buf[end + 4..end + 4 + len]);
                        let xff = head
                            .lines()
                            .any(|l| l.eq_ignore_ascii_case("x-forwarded-proto: http"));
                        let out = format!(
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nX-Saw-Proto: {xff}\r\nConnection: x-hop\r\nX-Hop: 1\r\n\r\n",
                            body.len()
                        );
                        if s.write_all(out.as_bytes()).await.is_err()
                            || s.write_all(&body).await.is_err()
                        {
                            return;
                        }
                        buf.drain(..end + 4 + len);
                    }
                });
            }
        });
        (port, accepted, task)
    }
}
