//! Steps 5 to 11 of the request chain (docs/design.md §2): client rate limit, CORS,
//! domain routing, authentication, authorization, scope gate, namespace rate limit.

use super::error::ApiError;
use super::middleware::policy_of;
use super::policy::Policy;
use crate::config::Config;
use crate::error::Code;
use crate::http::state::Node;
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::Method;
use actix_web::http::header::{self, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{Error, HttpMessage, HttpResponse, web};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

pub use crate::identity::Identity;

/// The namespace a request acts on, set by domain routing or authorization.
#[derive(Debug, Clone)]
pub struct Target(pub String);

/// The client's address after the trusted-proxy rule.
#[derive(Debug, Clone, Copy)]
pub struct ClientIp(pub IpAddr);

/// The node's rate limiters; idle buckets are evicted periodically.
pub struct Limiters {
    general: DefaultKeyedRateLimiter<IpAddr>,
    credential: DefaultKeyedRateLimiter<IpAddr>,
    pub wallet: DefaultKeyedRateLimiter<String>,
    namespace: DefaultKeyedRateLimiter<String>,
    /// Namespaces with their own bucket (`rate_per_minute`/`rate_burst` in the
    /// namespace record); `None` means the record has no override. Filled lazily.
    overrides: parking_lot::RwLock<
        std::collections::HashMap<String, Option<Arc<governor::DefaultDirectRateLimiter>>>,
    >,
    trusted: Vec<IpAddr>,
    clock: DefaultClock,
}

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
        self.namespace.retain_recent();
        self.namespace.shrink_to_fit();
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

    /// Checks the general bucket of a client (a deployment's fast path).
    pub(crate) fn check_general(&self, ip: IpAddr) -> Result<(), u64> {
        self.verdict(&self.general, &bucket_key(ip))
    }

    /// Checks a namespace's bucket: its own when its record sets one, else the default.
    pub(crate) async fn check_namespace(&self, node: &Node, ns: &str) -> Result<(), u64> {
        let known = self.overrides.read().get(ns).cloned();
        let own = match known {
            Some(o) => o,
            None => {
                let rec = node
                    .store
                    .get_json::<crate::actors::NamespaceRecord>(&crate::actors::ns_key(ns))
                    .await;
                let own = match rec {
                    Ok(Some(r)) if r.rate_per_minute.is_some() || r.rate_burst.is_some() => {
                        let rl = &node.config.rate_limit;
                        let q = quota(
                            r.rate_per_minute.unwrap_or(rl.namespace_per_minute),
                            r.rate_burst.unwrap_or(rl.namespace_burst),
                        );
                        Some(Arc::new(RateLimiter::direct(q)))
                    }
                    _ => None,
                };
                self.overrides.write().insert(ns.to_string(), own.clone());
                own
            }
        };
        match own {
            Some(lim) => lim.check().map_err(|nu| {
                nu.wait_time_from(self.clock.now())
                    .as_secs_f64()
                    .ceil()
                    .max(1.0) as u64
            }),
            None => self.verdict(&self.namespace, &ns.to_string()),
        }
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

fn limiters(req: &ServiceRequest) -> Arc<Limiters> {
    req.app_data::<web::Data<Arc<Limiters>>>()
        .expect("limiters")
        .get_ref()
        .clone()
}

fn node(req: &ServiceRequest) -> Node {
    req.app_data::<web::Data<Node>>()
        .expect("node data")
        .get_ref()
        .clone()
}

fn refuse<B>(req: ServiceRequest, err: ApiError) -> ServiceResponse<EitherBody<B>> {
    req.into_response(err.error_response_owned())
        .map_into_right_body()
}

type Res<B> = Result<ServiceResponse<EitherBody<B>>, Error>;

/// Step 5: the client rate limit, before authentication so the auth path is capped
/// too. Cluster peers (a valid hop) are exempt.
pub async fn client_rate_limit<B: MessageBody + 'static>(
    req: ServiceRequest,
    next: Next<B>,
) -> Res<B> {
    let l = limiters(&req);
    let xff = req
        .headers()
        .get("x-forwarded-for")
        .and_then(|v| v.to_str().ok());
    let ip = l.client_ip(req.peer_addr(), xff);
    if let Some(ip) = ip {
        req.extensions_mut().insert(ClientIp(ip));
    }
    let from_peer = req
        .extensions()
        .get::<Identity>()
        .is_some_and(|i| i.kind == "hop")
        || req
            .extensions()
            .get::<crate::http::forward::AnonymousHop>()
            .is_some();
    if !from_peer && let Some(ip) = ip {
        let key = bucket_key(ip);
        let (lim, code, bucket) = match policy_of(&req) {
            Some(Policy::Credential | Policy::NsCredential { .. }) => {
                (&l.credential, Code::RateLimited, "credential")
            }
            _ => (&l.general, Code::RateLimited, "general"),
        };
        if let Err(after) = l.verdict(lim, &key) {
            node(&req)
                .metrics
                .rate_limited
                .with_label_values(&[bucket])
                .inc();
            return Ok(refuse(req, ApiError::rate_limited(code, after)));
        }
    }
    next.call(req)
        .await
        .map(ServiceResponse::map_into_left_body)
}

/// Step 6: CORS. Allowed origins come from `[cors] allowed_origins`; a preflight
/// is answered 204 here.
pub async fn cors<B: MessageBody + 'static>(req: ServiceRequest, next: Next<B>) -> Res<B> {
    let origin = req.headers().get(header::ORIGIN).cloned();
    // A deployment answers its own CORS.
    let origin = origin.filter(|_| policy_of(&req) != Some(Policy::Deployment));
    let Some(origin) = origin else {
        return next
            .call(req)
            .await
            .map(ServiceResponse::map_into_left_body);
    };
    let allowed = {
        let n = node(&req);
        let o = origin.to_str().unwrap_or("");
        n.config
            .cors
            .allowed_origins
            .iter()
            .any(|a| a == "*" || a == o)
    };
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        if !allowed {
            return Ok(refuse(
                req,
                ApiError::new(Code::CorsOriginDenied, "this origin is not allowed"),
            ));
        }
        let resp = HttpResponse::NoContent()
            .insert_header((header::ACCESS_CONTROL_ALLOW_ORIGIN, origin))
            .insert_header((
                header::ACCESS_CONTROL_ALLOW_METHODS,
                "GET, POST, PUT, DELETE, PATCH, OPTIONS",
            ))
            .insert_header((
                header::ACCESS_CONTROL_ALLOW_HEADERS,
                "authorization, content-type, x-api-key, x-request-id, x-namespace",
            ))
            .insert_header((header::ACCESS_CONTROL_MAX_AGE, "600"))
            .insert_header((header::VARY, "Origin"))
            .finish();
        return Ok(req.into_response(resp).map_into_right_body());
    }
    let mut res = next.call(req).await?;
    if allowed {
        let h = res.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
        h.insert(
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static("x-request-id, retry-after"),
        );
    }
    Ok(res.map_into_left_body())
}

/// The request's host: `:authority`/`Host`, lower-cased, port stripped.
pub fn request_host(req: &ServiceRequest) -> Option<String> {
    let raw = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_string())
        .or_else(|| {
            req.headers()
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_string)
        })?;
    let raw = raw.rsplit('@').next().unwrap_or(&raw).to_ascii_lowercase();
    let host = if raw.starts_with('[') {
        raw.split(']')
            .next()
            .map(|h| format!("{h}]"))
            .unwrap_or(raw.clone())
    } else {
        raw.split(':').next().unwrap_or("").to_string()
    };
    Some(host)
}

/// The request's host as `request_host` found it (set by the route-policy step).
#[derive(Debug, Clone)]
pub struct RequestHost(pub String);

/// The TLS server name a connection presented (set when the node terminates TLS).
#[derive(Debug, Clone)]
pub struct Sni(pub Option<String>);

/// Step 7: maps the host to a deployment, a namespace (`ns-<name>.<base_domain>`)
/// or the gateway. On a TLS connection a host that disagrees with the SNI is 421.
pub async fn domain_routing<B: MessageBody + 'static>(
    req: ServiceRequest,
    next: Next<B>,
) -> Res<B> {
    let host = req
        .extensions()
        .get::<RequestHost>()
        .map(|h| h.0.clone())
        .or_else(|| request_host(&req));
    if let Some(host) = host {
        if let Some(Sni(Some(sni))) = req.conn_data::<Sni>()
            && !sni.eq_ignore_ascii_case(&host)
        {
            let e = ApiError::new(
                Code::MisdirectedRequest,
                format!("host {host} does not match the TLS server name {sni}"),
            );
            return Ok(refuse(req, e));
        }
        let n = node(&req);
        let routed = req
            .extensions()
            .get::<crate::http::deploy_serve::RoutedHost>()
            .map(|r| r.namespace.clone());
        if let Some(ns) = routed {
            req.extensions_mut().insert(Target(ns));
            return next
                .call(req)
                .await
                .map(ServiceResponse::map_into_left_body);
        }
        let suffix = format!(".{}", n.config.server.base_domain);
        if let Some(label) = host
            .strip_suffix(&suffix)
            .and_then(|h| h.strip_prefix("ns-"))
            && crate::http::routes::valid_namespace_name(label)
        {
            req.extensions_mut().insert(Target(label.to_string()));
        }
    }
    next.call(req)
        .await
        .map(ServiceResponse::map_into_left_body)
}

/// The credential a request presents: `Authorization: Bearer`, `X-API-Key`, or
/// `?token=` on a WebSocket upgrade.
fn presented_credential(req: &ServiceRequest) -> Option<String> {
    raw_credential(req).filter(|c| !c.is_empty())
}

fn raw_credential(req: &ServiceRequest) -> Option<String> {
    if let Some(v) = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let v = v.trim();
        if v.eq_ignore_ascii_case("bearer") {
            return None;
        }
        if let Some(t) = v
            .strip_prefix("Bearer ")
            .or_else(|| v.strip_prefix("bearer "))
        {
            return Some(t.trim().to_string());
        }
        return Some(v.to_string());
    }
    if let Some(v) = req.headers().get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(v.trim().to_string());
    }
    let upgrade = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    if upgrade {
        return web::Query::<std::collections::HashMap<String, String>>::from_query(
            req.query_string(),
        )
        .ok()
        .and_then(|q| q.get("token").cloned());
    }
    None
}

/// Step 8: authentication. A presented credential must be valid (else 401); no
/// credential leaves the request anonymous for authorization to judge.
pub async fn authentication<B: MessageBody + 'static>(
    req: ServiceRequest,
    next: Next<B>,
) -> Res<B> {
    // On `/__admin` routes only, a dashboard session cookie stands for the operator
    // key (EventSource cannot send headers); a presented header still wins.
    if req.extensions().get::<Identity>().is_none()
        && !req.headers().contains_key(header::AUTHORIZATION)
        && !req.headers().contains_key("x-api-key")
        && let Some(id) =
            crate::http::dashboard::cookie_identity(&node(&req), req.path(), req.headers())
    {
        req.extensions_mut().insert(id);
    }
    // A deployment's Authorization header belongs to its upstream.
    if req.extensions().get::<Identity>().is_none()
        && policy_of(&req) != Some(Policy::Deployment)
        && let Some(cred) = presented_credential(&req)
    {
        let n = node(&req);
        match crate::http::routes::authenticate(&n, &cred).await {
            Ok(id) => {
                req.extensions_mut().insert(id);
            }
            Err(e) => return Ok(refuse(req, e)),
        }
    }
    next.call(req)
        .await
        .map(ServiceResponse::map_into_left_body)
}

/// The namespace an operator names explicitly (`X-Namespace` or `?namespace=`).
fn named_namespace(req: &ServiceRequest) -> Option<String> {
    req.headers()
        .get("x-namespace")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| {
            web::Query::<std::collections::HashMap<String, String>>::from_query(req.query_string())
                .ok()
                .and_then(|q| q.get("namespace").cloned())
        })
}

/// A browser opening a dashboard page (not its JSON API or assets) without a
/// credential: it is sent to the sign-in form instead of a JSON 401.
fn wants_sign_in_page(req: &ServiceRequest) -> bool {
    req.method() == actix_web::http::Method::GET
        && matches!(req.path(), "/__admin" | "/__admin/")
        && req
            .headers()
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|a| a.contains("text/html"))
}

/// Step 9: authorization. The credential's namespace must be the target
/// namespace (operators may act on any); operator and admin routes need the
/// operator key (admin also takes its dashboard session cookie).
pub async fn authorization<B: MessageBody + 'static>(req: ServiceRequest, next: Next<B>) -> Res<B> {
    let policy = policy_of(&req);
    // Borrowed, not cloned (an identity carries its grants and claims); the
    // borrow ends with `check`, before the request is changed.
    let check = {
        let ext = req.extensions();
        let id = ext.get::<Identity>();
        match &policy {
            None | Some(Policy::Public) | Some(Policy::Credential) | Some(Policy::Deployment) => {
                Ok(None)
            }
            Some(Policy::Operator) => match id {
                Some(i) if i.operator => Ok(None),
                Some(_) => Err(ApiError::new(
                    Code::OperatorOnly,
                    "this route needs the operator key",
                )),
                None => Err(ApiError::new(
                    Code::MissingCredential,
                    "this route needs the operator key",
                )),
            },
            // No source address is trusted: behind a TLS proxy on loopback every
            // public request arrives from 127.0.0.1.
            Some(Policy::Admin) => match id {
                Some(i) if i.operator => Ok(None),
                None if wants_sign_in_page(&req) => {
                    drop(ext);
                    return Ok(req.into_response(
                        HttpResponse::SeeOther()
                            .insert_header((header::LOCATION, "/__admin/login"))
                            .insert_header((header::CACHE_CONTROL, "no-store"))
                            .finish()
                            .map_into_right_body(),
                    ));
                }
                Some(_) => Err(ApiError::new(
                    Code::OperatorOnly,
                    "the dashboard needs the operator key",
                )),
                None => Err(ApiError::new(
                    Code::MissingCredential,
                    "the dashboard needs the operator key",
                )),
            },
            Some(Policy::Internal) => match id {
                Some(i) if i.kind == "hop" => Ok(None),
                _ => Err(ApiError::new(
                    Code::InternalOnly,
                    "this route is for cluster peers",
                )),
            },
            Some(
                Policy::Ns { .. } | Policy::NsOrAnonymous { .. } | Policy::NsCredential { .. },
            ) => {
                let routed = ext.get::<Target>().map(|t| t.0.clone());
                match id {
                    None if matches!(policy, Some(Policy::NsOrAnonymous { .. })) => Ok(routed),
                    None => Err(ApiError::new(
                        Code::MissingCredential,
                        "this route needs a credential",
                    )),
                    Some(i) if i.operator => match routed.or_else(|| named_namespace(&req)) {
                        Some(ns) => Ok(Some(ns)),
                        None => Err(ApiError::new(
                            Code::NamespaceRequired,
                            "the operator must name the namespace (X-Namespace header or ?namespace=)",
                        )),
                    },
                    Some(i) => {
                        let own = i.namespace.clone().unwrap_or_default();
                        let target = routed
                            .or_else(|| named_namespace(&req))
                            .unwrap_or_else(|| own.clone());
                        if target == own {
                            Ok(Some(target))
                        } else {
                            Err(ApiError::new(
                                Code::NamespaceMismatch,
                                "the credential belongs to another namespace",
                            ))
                        }
                    }
                }
            }
        }
    };
    match check {
        Ok(Some(ns)) => {
            req.extensions_mut().insert(Target(ns));
        }
        Ok(None) => {}
        Err(e) => return Ok(refuse(req, e)),
    }
    next.call(req)
        .await
        .map(ServiceResponse::map_into_left_body)
}

/// Step 10: the route's required grant must be among the credential's grants
/// (the resource part is checked by the handler, which knows the topic or key).
pub async fn scope_gate<B: MessageBody + 'static>(req: ServiceRequest, next: Next<B>) -> Res<B> {
    if let Some((domain, action)) = policy_of(&req).and_then(|p| p.grant()) {
        let lacks = req.extensions().get::<Identity>().is_some_and(|i| {
            !i.operator
                && !domain.is_empty()
                && !crate::auth::allows_action(&i.grants, domain, action)
        });
        if lacks {
            let e = ApiError::new(
                Code::MissingGrant,
                format!("the credential lacks a {domain}:{action} grant"),
            );
            return Ok(refuse(req, e));
        }
    }
    next.call(req)
        .await
        .map(ServiceResponse::map_into_left_body)
}

/// Step 11: the per-namespace bucket.
pub async fn namespace_rate_limit<B: MessageBody + 'static>(
    req: ServiceRequest,
    next: Next<B>,
) -> Res<B> {
    let target = req.extensions().get::<Target>().map(|t| t.0.clone());
    if let Some(ns) = target {
        let l = limiters(&req);
        if let Err(after) = l.check_namespace(&node(&req), &ns).await {
            node(&req)
                .metrics
                .rate_limited
                .with_label_values(&["namespace"])
                .inc();
            return Ok(refuse(
                req,
                ApiError::rate_limited(Code::NamespaceRateLimited, after),
            ));
        }
    }
    next.call(req)
        .await
        .map(ServiceResponse::map_into_left_body)
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
