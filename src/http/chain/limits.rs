//! Steps 5 and 11: the client rate limit (per address, or per /64) and the
//! namespace rate limit, and the buckets behind them.
//!
//! Step 11 has two buckets per namespace (docs/security.md, "Anonymous
//! traffic and the owner's API"): anonymous traffic (a request to one of its
//! deployment hosts, whatever the route's `auth`, or one without a
//! credential) draws on its anonymous bucket, a credentialed request to its
//! API on its namespace bucket, so a flood of its public site cannot starve
//! its owner's API. A deployment route's credential is checked after step
//! 11, so a host's traffic cannot be told owner from stranger there: all of
//! it is anonymous.

use super::context::{AnonymousHop, ClientIp, RoutedHost, Target, X_FORWARDED_FOR, policy_of};
use crate::config::Config;
use crate::error::{ApiError, Code};
use crate::http::policy::Policy;
use crate::http::state::Node;
use crate::identity::Identity;
use actix_web::dev::ServiceRequest;
use actix_web::http::header::HeaderMap;
use actix_web::{HttpMessage, web};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

/// The node's rate limiters; idle buckets are evicted periodically.
pub struct Limiters {
    /// Per-client bucket (IPv4 address or IPv6 /64) for ordinary routes and deployments.
    general: DefaultKeyedRateLimiter<IpAddr>,
    /// Per-client bucket for credential-issuing routes, tighter so guessing is slow.
    credential: DefaultKeyedRateLimiter<IpAddr>,
    /// Per-wallet bucket of the auth challenge, so one wallet cannot be flooded from many IPs.
    pub wallet: DefaultKeyedRateLimiter<String>,
    /// The default per-namespace bucket, for namespaces whose record sets no override.
    namespace: DefaultKeyedRateLimiter<String>,
    /// The per-namespace bucket of anonymous traffic (its hosts, requests
    /// without a credential): `anonymous_per_minute`/`anonymous_burst`.
    anonymous: DefaultKeyedRateLimiter<String>,
    /// Namespaces with their own bucket (`rate_per_minute`/`rate_burst` in the
    /// namespace record), with the limits it was made for. Filled lazily.
    overrides: parking_lot::RwLock<std::collections::HashMap<String, OwnBucket>>,
    /// `trusted_proxies`: peers whose last X-Forwarded-For entry is taken as the client.
    trusted: Vec<IpAddr>,
    /// The limiters' clock, used to turn a refusal into Retry-After seconds.
    clock: DefaultClock,
}

/// A namespace's own bucket and the (`rate_per_minute`, `rate_burst`) it was made for.
type OwnBucket = (
    (Option<u32>, Option<u32>),
    Arc<governor::DefaultDirectRateLimiter>,
);

fn quota(per_minute: u32, burst: u32) -> Quota {
    let per = Duration::from_nanos(60_000_000_000 / per_minute.max(1) as u64);
    Quota::with_period(per)
        .expect("non-zero")
        .allow_burst(NonZeroU32::new(burst.max(1)).expect("non-zero"))
}

/// How often idle buckets are dropped.
pub const BUCKET_EVICTION_INTERVAL: Duration = Duration::from_secs(60);

impl Limiters {
    pub fn new(cfg: &Config) -> Arc<Limiters> {
        let rl = &cfg.rate_limit;
        let l = Arc::new(Limiters {
            general: RateLimiter::keyed(quota(rl.general_per_minute, rl.general_burst)),
            credential: RateLimiter::keyed(quota(rl.credential_per_minute, rl.credential_burst)),
            wallet: RateLimiter::keyed(quota(rl.wallet_per_minute, rl.wallet_burst)),
            namespace: RateLimiter::keyed(quota(rl.namespace_per_minute, rl.namespace_burst)),
            anonymous: RateLimiter::keyed(quota(rl.anonymous_per_minute, rl.anonymous_burst)),
            overrides: Default::default(),
            trusted: rl
                .trusted_proxies
                .iter()
                .filter_map(|p| p.parse().ok())
                .collect(),
            clock: DefaultClock::default(),
        });
        let weak = Arc::downgrade(&l);
        std::thread::Builder::new()
            .name("bucket-evictor".into())
            .spawn(move || {
                loop {
                    // Audited: the evictor is its own thread.
                    #[allow(clippy::disallowed_methods)]
                    std::thread::sleep(BUCKET_EVICTION_INTERVAL);
                    let Some(l) = weak.upgrade() else { return };
                    l.evict_idle();
                }
            })
            .expect("thread");
        l
    }

    /// Drops buckets that are full again (idle), keeping memory bounded under churn.
    pub fn evict_idle(&self) {
        for lim in [&self.general, &self.credential] {
            lim.retain_recent();
            lim.shrink_to_fit();
        }
        self.wallet.retain_recent();
        self.wallet.shrink_to_fit();
        for lim in [&self.namespace, &self.anonymous] {
            lim.retain_recent();
            lim.shrink_to_fit();
        }
    }

    fn verdict<K: Clone + std::hash::Hash + Eq>(
        &self,
        lim: &DefaultKeyedRateLimiter<K>,
        key: &K,
    ) -> Result<(), u64> {
        lim.check_key(key).map_err(|nu| {
            nu.wait_time_from(self.clock.now())
                .as_secs_f64()
                .ceil()
                .max(1.0) as u64
        })
    }

    /// Forgets what is known of a namespace's bucket (after it is created or deleted).
    pub fn forget_namespace(&self, ns: &str) {
        self.overrides.write().remove(ns);
    }

    /// Charges a client's credential bucket (a wrong key at `/metrics`).
    pub(crate) fn check_credential(&self, ip: IpAddr) -> Result<(), u64> {
        self.verdict(&self.credential, &bucket_key(ip))
    }

    /// Checks a namespace's bucket: its own when `record` (the one its
    /// owner published, `actors/records.rs`) sets one, else the default; the
    /// bucket is made again only when the record's limits change.
    fn charge_namespace_with(
        &self,
        node: &Node,
        ns: &String,
        record: Option<&crate::namespace::NamespaceRecord>,
    ) -> Result<(), u64> {
        let limits = match record {
            Some(r) if r.rate_per_minute.is_some() || r.rate_burst.is_some() => {
                Some((r.rate_per_minute, r.rate_burst))
            }
            // No override, no such namespace, or the store failed: the default bucket.
            _ => None,
        };
        let Some(limits) = limits else {
            return self.verdict(&self.namespace, ns);
        };
        let known = self
            .overrides
            .read()
            .get(ns.as_str())
            .filter(|(set, _)| *set == limits)
            .map(|(_, lim)| lim.clone());
        let own = match known {
            Some(lim) => lim,
            None => {
                let rl = &node.config.rate_limit;
                let q = quota(
                    limits.0.unwrap_or(rl.namespace_per_minute),
                    limits.1.unwrap_or(rl.namespace_burst),
                );
                let lim = Arc::new(RateLimiter::direct(q));
                self.overrides
                    .write()
                    .insert(ns.clone(), (limits, lim.clone()));
                lim
            }
        };
        own.check().map_err(|nu| {
            nu.wait_time_from(self.clock.now())
                .as_secs_f64()
                .ceil()
                .max(1.0) as u64
        })
    }

    /// Checks the per-wallet challenge bucket; Err carries Retry-After seconds.
    pub fn check_wallet(&self, wallet: &str) -> Result<(), u64> {
        self.verdict(&self.wallet, &wallet.to_string())
    }

    /// The client address: the peer, or the last `X-Forwarded-For` entry when the
    /// peer is a trusted proxy.
    pub fn client_ip(&self, peer: Option<SocketAddr>, xff: Option<&str>) -> Option<IpAddr> {
        let peer = peer?.ip();
        if self.trusted.contains(&peer)
            && let Some(last) = xff.and_then(|v| v.rsplit(',').next()).map(str::trim)
            && let Ok(ip) = last.parse::<IpAddr>()
        {
            return Some(ip);
        }
        Some(peer)
    }
}

/// The bucket key of a client: its IPv4 address, or its IPv6 /64.
pub fn bucket_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

pub(crate) fn limiters(req: &ServiceRequest) -> &Limiters {
    req.app_data::<web::Data<Arc<Limiters>>>()
        .expect("limiters")
        .get_ref()
}

/// The client's address ([`Limiters::client_ip`] of the peer and its
/// `X-Forwarded-For`).
pub fn client_ip_of(l: &Limiters, headers: &HeaderMap, peer: Option<SocketAddr>) -> Option<IpAddr> {
    let xff = headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok());
    l.client_ip(peer, xff)
}

/// Step 5's charge to a client's bucket: the credential bucket for
/// `credential` routes, else the general one (a deployment's too).
pub fn charge_client(
    l: &Limiters,
    node: &Node,
    ip: IpAddr,
    credential: bool,
) -> Result<(), ApiError> {
    let key = bucket_key(ip);
    let (lim, bucket) = if credential {
        (&l.credential, "credential")
    } else {
        (&l.general, "general")
    };
    if let Err(after) = l.verdict(lim, &key) {
        node.metrics.rate_limited.with_label_values(&[bucket]).inc();
        return Err(ApiError::rate_limited(Code::RateLimited, after));
    }
    Ok(())
}

/// Step 11's charge to a namespace's bucket.
pub async fn charge_namespace(l: &Limiters, node: &Node, ns: &str) -> Result<(), ApiError> {
    let record = node.records.get(ns).await.ok().flatten();
    charge_namespace_now(l, node, &ns.to_string(), record.as_deref())
}

/// [`charge_namespace`] without waiting, with the namespace's record as the
/// caller holds it (a socket's frames, answered in order, charge the bucket
/// as they are read): 429 `NAMESPACE_RATE_LIMITED` past it, counted.
pub fn charge_namespace_now(
    l: &Limiters,
    node: &Node,
    ns: &String,
    record: Option<&crate::namespace::NamespaceRecord>,
) -> Result<(), ApiError> {
    if let Err(after) = l.charge_namespace_with(node, ns, record) {
        node.metrics
            .rate_limited
            .with_label_values(&["namespace"])
            .inc();
        return Err(ApiError::rate_limited(Code::NamespaceRateLimited, after));
    }
    Ok(())
}

/// Step 11's charge of anonymous traffic to namespace `ns` (a request to
/// one of its hosts, or one without a credential): its anonymous bucket,
/// never its namespace bucket. 429 `ANONYMOUS_RATE_LIMITED` past it, counted.
pub fn charge_anonymous(l: &Limiters, node: &Node, ns: &str) -> Result<(), ApiError> {
    if let Err(after) = l.verdict(&l.anonymous, &ns.to_string()) {
        node.metrics
            .rate_limited
            .with_label_values(&["anonymous"])
            .inc();
        return Err(ApiError::rate_limited(Code::AnonymousRateLimited, after));
    }
    Ok(())
}

/// Step 5: the client rate limit, before authentication so the auth path is capped
/// too. Cluster peers (a valid hop) are exempt.
pub(crate) fn client_rate_limit(req: &ServiceRequest) -> Result<(), ApiError> {
    let l = limiters(req);
    let ip = client_ip_of(l, req.headers(), req.peer_addr());
    if let Some(ip) = ip {
        req.extensions_mut().insert(ClientIp(ip));
    }
    let from_peer = {
        let ext = req.extensions();
        ext.get::<Identity>().is_some_and(|i| i.kind == "hop")
            || ext.get::<AnonymousHop>().is_some()
    };
    if !from_peer && let Some(ip) = ip {
        let credential = matches!(
            policy_of(req),
            Some(Policy::Credential | Policy::NsCredential { .. })
        );
        charge_client(l, Node::of(req.request()), ip, credential)?;
    }
    Ok(())
}

/// Step 11: the per-namespace bucket; anonymous traffic (a deployment host,
/// or no credential) its anonymous bucket instead.
pub(crate) async fn namespace_rate_limit(req: &ServiceRequest) -> Result<(), ApiError> {
    let (target, anonymous) = {
        let ext = req.extensions();
        (
            ext.get::<Target>().map(|t| t.0.clone()),
            ext.get::<RoutedHost>().is_some() || ext.get::<Identity>().is_none(),
        )
    };
    if let Some(ns) = target {
        let (l, node) = (limiters(req), Node::of(req.request()));
        if anonymous {
            charge_anonymous(l, node, &ns)?;
        } else {
            charge_namespace(l, node, &ns).await?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two IPv6 addresses of one /64 share a bucket key; another /64 does not.
    #[test]
    fn ipv6_slash_64_buckets() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::2".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(bucket_key(a), bucket_key(b));
        assert_ne!(bucket_key(a), bucket_key(c));
        let v4: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(bucket_key(v4), v4);
    }

    /// X-Forwarded-For is believed only from a trusted proxy, and only its last entry.
    #[test]
    fn forwarded_for_only_from_trusted_proxies() {
        let mut cfg = Config::default();
        cfg.rate_limit.trusted_proxies = vec!["127.0.0.2".into()];
        let l = Limiters::new(&cfg);
        let untrusted: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let trusted: SocketAddr = "127.0.0.2:5000".parse().unwrap();
        assert_eq!(
            l.client_ip(Some(untrusted), Some("9.9.9.9")),
            Some("127.0.0.1".parse().unwrap())
        );
        assert_eq!(
            l.client_ip(Some(trusted), Some("1.1.1.1, 9.9.9.9")),
            Some("9.9.9.9".parse().unwrap())
        );
        assert_eq!(
            l.client_ip(Some(trusted), Some("garbage")),
            Some("127.0.0.2".parse().unwrap())
        );
    }

    /// The general bucket refuses past its burst and says when to retry.
    #[test]
    fn bucket_refuses_past_burst() {
        let mut cfg = Config::default();
        cfg.rate_limit.general_burst = 3;
        cfg.rate_limit.general_per_minute = 60;
        let l = Limiters::new(&cfg);
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        for _ in 0..3 {
            assert!(l.verdict(&l.general, &ip).is_ok());
        }
        let after = l.verdict(&l.general, &ip).unwrap_err();
        assert!((1..=2).contains(&after), "{after}");
        // Another client is unaffected.
        assert!(l.verdict(&l.general, &"10.0.0.2".parse().unwrap()).is_ok());
    }
}
