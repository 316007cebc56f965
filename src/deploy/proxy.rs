//! The reverse proxy of upstream deployments: round-robin among healthy
//! instances, passive health, a retry on another instance only when the
//! connection failed before any body was sent, streamed bodies both ways, and
//! WebSocket upgrades relayed frame by frame. Every connection goes through
//! the egress policy: the client resolves through [`CheckedResolver`], and
//! literal addresses are checked before each attempt.

use super::egress::{CheckedResolver, EgressPolicy, Refusal, forbidden_at_connect, refusal_of};
use crate::error::ApiError;
use crate::error::Code;
use actix_web::body::{BodySize, BoxBody, MessageBody, SizedStream};
use actix_web::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use actix_web::http::{Method, StatusCode};
use actix_web::{HttpRequest, HttpResponse, dev::Payload};
use bytes::Bytes;
use futures_util::{SinkExt, Stream, StreamExt};
use std::cell::RefCell;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
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
}

/// The instances of one deployment version.
pub struct UpstreamPool {
    /// The version's instances, in deploy order; picked round-robin among the healthy.
    pub instances: Vec<Instance>,
    /// Where the instances may be connected.
    pub egress: Arc<EgressPolicy>,
    /// Every instance is plain HTTP: requests go through [`super::h1`]
    /// (otherwise through awc, which speaks TLS).
    plain: bool,
    /// Round-robin cursor: where the next request starts looking for a healthy instance.
    next: AtomicUsize,
    /// Failures in a row that mark an instance down (at least 1).
    fail_after: u32,
    /// How long a down instance is skipped before it is tried again.
    down_for: Duration,
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
    fn uri(&self, path_and_query: &str) -> Result<actix_web::http::Uri, String> {
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
            })
            .collect();
        UpstreamPool {
            egress,
            plain: !instances.is_empty() && instances.iter().all(|i| i.plain_host.is_some()),
            instances,
            next: AtomicUsize::new(0),
            fail_after: fail_after.max(1),
            down_for,
        }
    }

    /// Healthy instances, in the order to try them (round-robin start).
    pub fn order(&self) -> Vec<usize> {
        let n = self.instances.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let now = now_ms();
        (0..n)
            .map(|i| (start + i) % n)
            .filter(|&i| self.instances[i].down_until_ms.load(Ordering::Relaxed) <= now)
            .collect()
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
    fn refused(&self, i: usize) -> Option<Refusal> {
        let a = self.instances[i].literal?;
        self.egress.check_addr(a.ip(), a.port()).err()
    }

    /// Whether each instance is healthy now (for the API).
    pub fn health(&self) -> Vec<(String, bool, u32)> {
        let now = now_ms();
        self.instances
            .iter()
            .map(|i| {
                (
                    i.base.clone(),
                    i.down_until_ms.load(Ordering::Relaxed) <= now,
                    i.failures.load(Ordering::Relaxed),
                )
            })
            .collect()
    }
}

/// Timeouts of the proxy.
#[derive(Clone, Copy)]
pub struct ProxyTimeouts {
    /// Limit on connecting to an instance (deployment config `connect_timeout_seconds`).
    pub connect: Duration,
    /// Limit on the whole upstream exchange (config `upstream_timeout_seconds`).
    pub response: Duration,
}

thread_local! {
    static UPSTREAM_CLIENT: RefCell<Option<(Duration, Arc<EgressPolicy>, awc::Client)>> =
        const { RefCell::new(None) };
}

/// The worker thread's client for deployment upstreams (awc is
/// single-threaded; pooled keep-alive connections). Every name resolves
/// through the egress policy, so only checked addresses are connected.
/// Redirects are never followed.
pub(crate) fn upstream_client(t: ProxyTimeouts, egress: &Arc<EgressPolicy>) -> awc::Client {
    UPSTREAM_CLIENT.with(|c| {
        let mut c = c.borrow_mut();
        if let Some((ct, policy, client)) = c.as_ref()
            && *ct == t.connect
            && Arc::ptr_eq(policy, egress)
        {
            return client.clone();
        }
        let resolver = actix_tls::connect::Resolver::custom(CheckedResolver(egress.clone()));
        let tcp = actix_tls::connect::Connector::new(resolver).service();
        let connector = awc::Connector::new()
            .connector(tcp)
            .timeout(t.connect)
            .max_http_version(actix_web::http::Version::HTTP_11)
            .limit(1024)
            .conn_keep_alive(Duration::from_secs(30));
        let client = awc::Client::builder()
            .connector(connector)
            .disable_redirects()
            .no_default_headers()
            .timeout(t.response)
            .finish();
        *c = Some((t.connect, egress.clone(), client.clone()));
        client
    })
}

/// Headers that belong to one hop and are never forwarded.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "http2-settings",
];

pub(crate) fn is_hop_by_hop(name: &HeaderName, listed: &[String]) -> bool {
    HOP_BY_HOP.contains(&name.as_str()) || listed.iter().any(|l| l == name.as_str())
}

/// Header names the `Connection` header lists (also hop-by-hop).
pub(crate) fn connection_listed(h: &HeaderMap) -> Vec<String> {
    h.get_all(header::CONNECTION)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect()
}

/// What the proxy adds about the client.
pub struct Forwarded {
    /// The client's address (from a trusted hop or the peer), appended to X-Forwarded-For.
    pub client_ip: Option<std::net::IpAddr>,
    /// The scheme the client used (`http`/`https`), sent as X-Forwarded-Proto.
    pub proto: &'static str,
    /// The Host the client asked for, sent as X-Forwarded-Host (Host itself is not passed).
    pub host: String,
    /// The request's id, sent as X-Request-ID so upstream logs can be correlated.
    pub request_id: Option<String>,
}

/// The request headers every client sends upstream, given to `emit` in
/// order as name and value: the client's, minus hop-by-hop ones, `Host` and
/// those the proxy sets; then `X-Forwarded-For` (the client's last one with
/// the client's address appended), `X-Forwarded-Proto`, `X-Forwarded-Host`
/// (the routed host) and `X-Request-ID` (the chain's; the client's passes
/// only when the chain has none). Each client sets `Host` itself.
pub(crate) fn upstream_header_lines(
    req: &HttpRequest,
    fwd: &Forwarded,
    mut emit: impl FnMut(&str, &[u8]),
) {
    let own_id = fwd
        .request_id
        .as_deref()
        .filter(|id| value_ok(id.as_bytes()));
    let listed = connection_listed(req.headers());
    // A route's policy (http/route_policy.rs): forged X-Meshgate-* headers
    // always go, the credential unless forwarded, the checked identity is added.
    let policy_view = actix_web::HttpMessage::extensions(req)
        .get::<Arc<super::route_policy::UpstreamView>>()
        .cloned();
    let mut prev_xff: Option<&[u8]> = None;
    for (k, v) in req.headers() {
        if super::route_policy::stripped(k.as_str(), policy_view.as_deref()) {
            continue;
        }
        match k.as_str() {
            "host" | "x-forwarded-proto" | "x-forwarded-host" => continue,
            "x-forwarded-for" => {
                prev_xff = Some(v.as_bytes());
                continue;
            }
            "x-request-id" if own_id.is_some() => continue,
            _ => {}
        }
        if is_hop_by_hop(k, &listed) {
            continue;
        }
        emit(k.as_str(), v.as_bytes());
    }
    if prev_xff.is_some() || fwd.client_ip.is_some() {
        let mut xff = Vec::with_capacity(64);
        if let Some(prev) = prev_xff {
            xff.extend_from_slice(prev);
            if fwd.client_ip.is_some() {
                xff.extend_from_slice(b", ");
            }
        }
        if let Some(ip) = fwd.client_ip {
            write_ip(&mut xff, ip);
        }
        emit("x-forwarded-for", &xff);
    }
    emit("x-forwarded-proto", fwd.proto.as_bytes());
    if value_ok(fwd.host.as_bytes()) {
        emit("x-forwarded-host", fwd.host.as_bytes());
    }
    if let Some(id) = own_id {
        emit("x-request-id", id.as_bytes());
    }
    if let Some(view) = &policy_view {
        view.emit(&mut emit);
    }
}

/// Whether `b` may stand in a header value (no control character but tab).
pub(crate) fn value_ok(b: &[u8]) -> bool {
    b.iter().all(|&c| (c >= b' ' && c != 0x7f) || c == b'\t')
}

/// Writes `ip` as text (an IPv4 address without the formatting machinery).
pub(crate) fn write_ip(out: &mut Vec<u8>, ip: std::net::IpAddr) {
    match ip {
        std::net::IpAddr::V4(v4) => {
            for (i, o) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                if o >= 100 {
                    out.push(b'0' + o / 100);
                }
                if o >= 10 {
                    out.push(b'0' + o / 10 % 10);
                }
                out.push(b'0' + o % 10);
            }
        }
        std::net::IpAddr::V6(_) => {
            use std::io::Write;
            let _ = write!(out, "{ip}");
        }
    }
}

/// [`upstream_header_lines`] as actix's header map (awc's requests).
fn upstream_headers(req: &HttpRequest, fwd: &Forwarded) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(req.headers().len() + 4);
    upstream_header_lines(req, fwd, |k, v| {
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_bytes(v),
        ) {
            out.append(k, v);
        }
    });
    out
}

/// The request body, handed to at most one upstream attempt. An attempt whose
/// connection failed never polled it, so the next instance can still take it;
/// once polled it is gone and no retry happens.
struct OnceBody {
    /// The client's body, shared by the attempts: the first poll takes it out.
    slot: Rc<RefCell<Option<Payload>>>,
    /// The body once this attempt took it; afterwards no other attempt can retry.
    taken: Option<Payload>,
}

/// The client's body, waiting in its slot for the one attempt that polls it.
pub(crate) type BodySlot = Rc<RefCell<Option<Payload>>>;

/// Sends `creq` with the client's body from `slot`, framed as `kind`.
pub(crate) fn send_once(
    creq: awc::ClientRequest,
    kind: BodyKind,
    slot: &BodySlot,
) -> awc::SendClientRequest {
    let body = OnceBody {
        slot: slot.clone(),
        taken: None,
    };
    match kind {
        BodyKind::None => creq.send(),
        BodyKind::Sized(n) => creq.send_body(SizedStream::new(n, body)),
        BodyKind::Chunked => creq.send_stream(body),
    }
}

/// Whether a failed attempt left the body for another one (it never polled it).
pub(crate) fn body_untouched(kind: BodyKind, slot: &BodySlot) -> bool {
    slot.borrow().is_some() || matches!(kind, BodyKind::None)
}

impl Stream for OnceBody {
    type Item = Result<Bytes, actix_web::error::PayloadError>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.taken.is_none() {
            let p = self.slot.borrow_mut().take();
            match p {
                Some(p) => self.taken = Some(p),
                None => return Poll::Ready(None),
            }
        }
        Pin::new(self.taken.as_mut().expect("taken")).poll_next(cx)
    }
}

/// How the client's body is framed.
#[derive(Clone, Copy)]
pub(crate) enum BodyKind {
    None,
    Sized(u64),
    Chunked,
}

pub(crate) fn body_kind(req: &HttpRequest) -> BodyKind {
    if let Some(len) = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        return if len == 0 {
            BodyKind::None
        } else {
            BodyKind::Sized(len)
        };
    }
    if req.headers().contains_key(header::TRANSFER_ENCODING)
        || req.version() == actix_web::http::Version::HTTP_2
            && !matches!(*req.method(), Method::GET | Method::HEAD)
    {
        return BodyKind::Chunked;
    }
    BodyKind::None
}

/// Proxies one HTTP request to the pool (WebSocket upgrades go to [`proxy_ws`]).
pub async fn proxy_http(
    req: &HttpRequest,
    payload: Payload,
    pool: &UpstreamPool,
    path_and_query: &str,
    fwd: &Forwarded,
    t: ProxyTimeouts,
) -> Result<HttpResponse, ApiError> {
    let order = pool.order();
    if order.is_empty() {
        return Err(ApiError::new(
            Code::NoHealthyUpstream,
            "every instance of this upstream is unhealthy",
        )
        .retry_after(1));
    }
    if pool.plain {
        return proxy_h1(req, payload, pool, order, path_and_query, fwd, t).await;
    }
    // Boxed: awc's exchange is large, and kept out of the plain path's future.
    Box::pin(proxy_awc(req, payload, pool, order, path_and_query, fwd, t)).await
}

/// [`proxy_http`] through awc (a pool with an `https://` instance).
async fn proxy_awc(
    req: &HttpRequest,
    payload: Payload,
    pool: &UpstreamPool,
    order: Vec<usize>,
    path_and_query: &str,
    fwd: &Forwarded,
    t: ProxyTimeouts,
) -> Result<HttpResponse, ApiError> {
    let kind = body_kind(req);
    let slot = Rc::new(RefCell::new(Some(payload)));
    let client = upstream_client(t, &pool.egress);
    let mut last_err = None;
    let mut forbidden = None;
    for i in order {
        if let Some(r) = pool.refused(i) {
            forbidden = Some(r);
            continue;
        }
        let uri = match pool.instances[i].uri(path_and_query) {
            Ok(u) => u,
            Err(e) => {
                return Err(ApiError::new(
                    Code::UpstreamFailed,
                    format!("the upstream URI is not valid: {e}"),
                ));
            }
        };
        let mut creq = client.request(req.method().clone(), uri).no_decompress();
        // The header map is set whole (the builder moves on each header added),
        // built for this attempt (retries are rare).
        *creq.headers_mut() = upstream_headers(req, fwd);
        let sent = send_once(creq, kind, &slot).await;
        match sent {
            Ok(res) => {
                pool.succeeded(i);
                return Ok(stream_response(req, res));
            }
            Err(awc::error::SendRequestError::Connect(e)) => {
                if let Some(r) = refusal_of(&e) {
                    // A policy refusal, not a health failure; nothing was sent.
                    tracing::warn!(instance = %pool.instances[i].base, refusal = %r, "Upstream refused by the egress policy.");
                    forbidden = Some(r.clone());
                    continue;
                }
                pool.failed(i);
                tracing::warn!(instance = %pool.instances[i].base, error = %e, "Upstream connection failed.");
                last_err = Some(format!("{e}"));
                if !body_untouched(kind, &slot) {
                    break;
                }
            }
            Err(awc::error::SendRequestError::Timeout) => {
                pool.failed(i);
                return Err(ApiError::new(
                    Code::UpstreamTimeout,
                    "the upstream did not answer in time",
                ));
            }
            Err(e) => {
                // Reached and failed: never retried.
                tracing::warn!(instance = %pool.instances[i].base, error = %e, "Upstream request failed.");
                return Err(ApiError::new(
                    Code::UpstreamFailed,
                    format!("the upstream failed: {e}"),
                ));
            }
        }
    }
    if let Some(r) = forbidden {
        return Err(forbidden_at_connect(&r));
    }
    Err(ApiError::new(
        Code::UpstreamUnavailable,
        format!(
            "no upstream instance could be reached: {}",
            last_err.unwrap_or_default()
        ),
    ))
}

/// [`proxy_http`] to plain-HTTP instances: a request without a body through
/// [`super::wire`], one with a body through [`super::h1`] (hyper). The
/// request is built once and, when an instance could not be connected
/// (nothing sent), handed to the next.
async fn proxy_h1(
    req: &HttpRequest,
    payload: Payload,
    pool: &UpstreamPool,
    order: Vec<usize>,
    path_and_query: &str,
    fwd: &Forwarded,
    t: ProxyTimeouts,
) -> Result<HttpResponse, ApiError> {
    use super::h1::UpBody;
    let body = match body_kind(req) {
        BodyKind::None => {
            let a = over_instances(pool, order, async |inst| {
                super::wire::attempt(req, pool, inst, path_and_query, fwd, t).await
            })
            .await?;
            return Ok(super::wire::into_response(req, a));
        }
        BodyKind::Sized(n) => UpBody::stream(payload, Some(n)),
        BodyKind::Chunked => UpBody::stream(payload, None),
    };
    let uri: hyper::Uri = path_and_query.parse().map_err(|e| {
        ApiError::new(
            Code::UpstreamFailed,
            format!("the upstream URI is not valid: {e}"),
        )
    })?;
    let method = hyper::Method::from_bytes(req.method().as_str().as_bytes())
        .map_err(|e| ApiError::new(Code::BadRequest, format!("bad method: {e}")))?;
    let mut hreq = hyper::Request::new(body);
    *hreq.method_mut() = method;
    *hreq.uri_mut() = uri;
    *hreq.headers_mut() = h1_headers(req, fwd);
    let mut pending = Some(hreq);
    // Boxed: hyper's exchange is large, and kept out of the bodiless path's future.
    let res = Box::pin(over_instances(pool, order, async |inst| {
        super::h1::exchange(pool, inst, &mut pending, t).await
    }))
    .await?;
    Ok(h1_response(req, res))
}

/// Tries the instances in `order` (those the egress policy refuses skipped)
/// until one answers: an instance that could not be connected counts
/// against its health and the next is tried; a timeout or a failure after
/// the request went out ends the request (never sent twice).
async fn over_instances<T>(
    pool: &UpstreamPool,
    order: Vec<usize>,
    mut attempt: impl AsyncFnMut(&Instance) -> super::h1::Exchange<T>,
) -> Result<T, ApiError> {
    use super::h1::{ConnectFailure, Exchange};
    let mut last_err = None;
    let mut forbidden = None;
    for i in order {
        if let Some(r) = pool.refused(i) {
            forbidden = Some(r);
            continue;
        }
        let inst = &pool.instances[i];
        match attempt(inst).await {
            Exchange::Answered(res) => {
                pool.succeeded(i);
                return Ok(res);
            }
            Exchange::NotConnected(ConnectFailure::Refused(r)) => {
                tracing::warn!(instance = %inst.base, refusal = %r, "Upstream refused by the egress policy.");
                forbidden = Some(r);
            }
            Exchange::NotConnected(ConnectFailure::Failed(e)) => {
                pool.failed(i);
                tracing::warn!(instance = %inst.base, error = %e, "Upstream connection failed.");
                last_err = Some(e);
            }
            Exchange::TimedOut => {
                pool.failed(i);
                return Err(ApiError::new(
                    Code::UpstreamTimeout,
                    "the upstream did not answer in time",
                ));
            }
            Exchange::Failed(e) => {
                // Reached and failed: never retried.
                tracing::warn!(instance = %inst.base, error = %e, "Upstream request failed.");
                return Err(ApiError::new(
                    Code::UpstreamFailed,
                    format!("the upstream failed: {e}"),
                ));
            }
        }
    }
    if let Some(r) = forbidden {
        return Err(forbidden_at_connect(&r));
    }
    Err(ApiError::new(
        Code::UpstreamUnavailable,
        format!(
            "no upstream instance could be reached: {}",
            last_err.unwrap_or_default()
        ),
    ))
}

/// [`upstream_header_lines`] as hyper's header map (`Host` is set per instance).
fn h1_headers(req: &HttpRequest, fwd: &Forwarded) -> hyper::HeaderMap {
    use hyper::header::{HeaderName as HName, HeaderValue as HValue};
    let mut out = hyper::HeaderMap::with_capacity(req.headers().len() + 5);
    upstream_header_lines(req, fwd, |k, v| {
        if let (Ok(k), Ok(v)) = (HName::from_bytes(k.as_bytes()), HValue::from_bytes(v)) {
            out.append(k, v);
        }
    });
    out
}

/// The upstream's answer from [`super::h1`], its body streamed as it arrives.
fn h1_response(req: &HttpRequest, res: hyper::Response<super::h1::UpstreamBody>) -> HttpResponse {
    let (parts, body) = res.into_parts();
    let status = StatusCode::from_u16(parts.status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let listed: Vec<String> = parts
        .headers
        .get_all(hyper::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect();
    let mut out = HttpResponse::new(status);
    let mut len = None;
    {
        let h = out.headers_mut();
        for (k, v) in &parts.headers {
            if *k == hyper::header::CONTENT_LENGTH {
                len = v.to_str().ok().and_then(|s| s.parse::<u64>().ok());
                continue;
            }
            let Ok(name) = HeaderName::from_bytes(k.as_str().as_bytes()) else {
                continue;
            };
            if is_hop_by_hop(&name, &listed) {
                continue;
            }
            if let Ok(v) = HeaderValue::from_bytes(v.as_bytes()) {
                h.append(name, v);
            }
        }
    }
    match finish_head(req, out, len) {
        ControlFlow::Break(done) => done,
        ControlFlow::Continue(out) => out.set_body(BoxBody::new(body)),
    }
}

/// Ends an upstream answer's head (its headers copied): the marker that keeps
/// the node's `Compress` off, and for an answer that has no body (HEAD, 204,
/// 304, 1xx) the upstream's length kept. `Break` with the whole answer when
/// it has no body; `Continue` with the head to put the body in.
pub(crate) fn finish_head(
    req: &HttpRequest,
    mut out: HttpResponse,
    len: Option<u64>,
) -> ControlFlow<HttpResponse, HttpResponse> {
    let h = out.headers_mut();
    if !h.contains_key(header::CONTENT_ENCODING) {
        h.insert(
            header::CONTENT_ENCODING,
            HeaderValue::from_static("identity"),
        );
    }
    let status = out.status();
    let no_body = req.method() == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
        || status.is_informational();
    if !no_body {
        return ControlFlow::Continue(out);
    }
    if let Some(n) = len {
        out.head_mut().no_chunking(true);
        out.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        // A body of no told size: actix then sends the head's own
        // Content-Length (for an empty body it would send 0), and no body.
        return ControlFlow::Break(out.set_body(BoxBody::new(NoBody)));
    }
    ControlFlow::Break(out)
}

/// The body of an answer that has none, whose head tells the length it
/// would have (a HEAD request's answer).
struct NoBody;

impl MessageBody for NoBody {
    type Error = std::convert::Infallible;

    fn size(&self) -> BodySize {
        BodySize::Stream
    }

    fn poll_next(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        Poll::Ready(None)
    }
}

/// The upstream's answer, its body streamed as it arrives.
pub(crate) fn stream_response<S>(req: &HttpRequest, res: awc::ClientResponse<S>) -> HttpResponse
where
    S: Stream<Item = Result<Bytes, actix_web::error::PayloadError>> + Unpin + 'static,
{
    let status = res.status();
    let listed = connection_listed(res.headers());
    let mut out = HttpResponse::new(status);
    let mut len = None;
    {
        let h = out.headers_mut();
        for (k, v) in res.headers() {
            if k == header::CONTENT_LENGTH {
                len = v.to_str().ok().and_then(|s| s.parse::<u64>().ok());
                continue;
            }
            if is_hop_by_hop(k, &listed) {
                continue;
            }
            h.append(k.clone(), v.clone());
        }
    }
    let out = match finish_head(req, out, len) {
        ControlFlow::Break(done) => return done,
        ControlFlow::Continue(out) => out,
    };
    let body: BoxBody = match len {
        Some(n) => SizedStream::new(n, res).boxed(),
        None => actix_web::body::BodyStream::new(res).boxed(),
    };
    debug_assert!(!matches!(body.size(), BodySize::None));
    out.set_body(body)
}

/// Relays a WebSocket upgrade: the upstream's handshake first (its refusal is
/// passed on as an error), then frames both ways until either side closes.
pub async fn proxy_ws(
    req: &HttpRequest,
    mut payload: Payload,
    pool: &UpstreamPool,
    path_and_query: &str,
    fwd: &Forwarded,
    t: ProxyTimeouts,
) -> Result<HttpResponse, ApiError> {
    use actix_web::FromRequest;
    let payload = actix_web::web::Payload::from_request(req, &mut payload)
        .await
        .map_err(|e| ApiError::new(Code::BadUpgrade, e.to_string()))?;
    let order = pool.order();
    if order.is_empty() {
        return Err(ApiError::new(
            Code::NoHealthyUpstream,
            "every instance of this upstream is unhealthy",
        ));
    }
    let headers = upstream_headers(req, fwd);
    let client = upstream_client(t, &pool.egress);
    let mut last_err = String::new();
    let mut forbidden = None;
    for i in order {
        if let Some(r) = pool.refused(i) {
            forbidden = Some(r);
            continue;
        }
        let base = &pool.instances[i].base;
        let ws_base = base
            .replacen("http://", "ws://", 1)
            .replacen("https://", "wss://", 1);
        let url = format!("{ws_base}{path_and_query}");
        let mut wreq = client.ws(url.as_str()).max_frame_size(16 << 20);
        for (k, v) in &headers {
            let name = k.as_str();
            if name.starts_with("sec-websocket-") && name != "sec-websocket-protocol" {
                continue;
            }
            wreq = wreq.header(k.clone(), v.clone());
        }
        match wreq.connect().await {
            Ok((res, framed)) => {
                pool.succeeded(i);
                let protocol = res.headers().get(header::SEC_WEBSOCKET_PROTOCOL).cloned();
                let (mut resp, session, stream) = actix_ws::handle(req, payload)
                    .map_err(|e| ApiError::new(Code::BadUpgrade, e.to_string()))?;
                if let Some(p) = protocol {
                    resp.headers_mut().insert(header::SEC_WEBSOCKET_PROTOCOL, p);
                }
                actix_web::rt::spawn(relay(session, stream.max_frame_size(16 << 20), framed));
                return Ok(resp);
            }
            Err(awc::error::WsClientError::SendRequest(awc::error::SendRequestError::Connect(
                e,
            ))) => {
                if let Some(r) = refusal_of(&e) {
                    tracing::warn!(instance = %base, refusal = %r, "Upstream refused by the egress policy.");
                    forbidden = Some(r.clone());
                    continue;
                }
                pool.failed(i);
                last_err = e.to_string();
            }
            Err(e) => {
                return Err(ApiError::new(
                    Code::UpstreamFailed,
                    format!("the upstream refused the WebSocket upgrade: {e}"),
                ));
            }
        }
    }
    if let Some(r) = forbidden {
        return Err(forbidden_at_connect(&r));
    }
    Err(ApiError::new(
        Code::UpstreamUnavailable,
        format!("no upstream instance could be reached: {last_err}"),
    ))
}

async fn relay(
    mut session: actix_ws::Session,
    mut client_rx: actix_ws::MessageStream,
    framed: actix_codec::Framed<awc::BoxedSocket, awc::ws::Codec>,
) {
    use awc::ws::{Frame, Message};
    let (mut up_tx, mut up_rx) = framed.split();
    loop {
        tokio::select! {
            m = client_rx.next() => {
                let out = match m {
                    Some(Ok(actix_ws::Message::Text(t))) => Message::Text(t),
                    Some(Ok(actix_ws::Message::Binary(b))) => Message::Binary(b),
                    Some(Ok(actix_ws::Message::Continuation(c))) => Message::Continuation(c),
                    Some(Ok(actix_ws::Message::Ping(p))) => Message::Ping(p),
                    Some(Ok(actix_ws::Message::Pong(p))) => Message::Pong(p),
                    Some(Ok(actix_ws::Message::Close(r))) => {
                        let _ = up_tx.send(Message::Close(r)).await;
                        break;
                    }
                    Some(Ok(actix_ws::Message::Nop)) => continue,
                    Some(Err(_)) | None => {
                        let _ = up_tx.send(Message::Close(None)).await;
                        break;
                    }
                };
                if up_tx.send(out).await.is_err() {
                    let _ = session.close(None).await;
                    return;
                }
            }
            f = up_rx.next() => {
                let sent = match f {
                    Some(Ok(Frame::Text(t))) => match std::str::from_utf8(&t) {
                        Ok(s) => session.text(s.to_string()).await,
                        Err(_) => session.binary(t).await,
                    },
                    Some(Ok(Frame::Binary(b))) => session.binary(b).await,
                    Some(Ok(Frame::Continuation(c))) => session.continuation(c).await,
                    Some(Ok(Frame::Ping(p))) => session.ping(&p).await,
                    Some(Ok(Frame::Pong(p))) => session.pong(&p).await,
                    Some(Ok(Frame::Close(r))) => {
                        let _ = session.close(r).await;
                        return;
                    }
                    Some(Err(_)) | None => {
                        let _ = session.close(None).await;
                        return;
                    }
                };
                if sent.is_err() {
                    let _ = up_tx.send(Message::Close(None)).await;
                    return;
                }
            }
        }
    }
    let _ = session.close(None).await;
}
