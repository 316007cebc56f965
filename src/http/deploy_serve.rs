//! Answering a request whose host is routed to a deployment: a static file, or
//! the proxy. A plain HTTP request to an upstream route takes
//! [`routed_fast_path`]: the steps of the chain that act on a deployment, in
//! the chain's order, in one middleware.

use crate::deploy::index::{Bound, Serve};
use crate::deploy::model::SiteFile;
use crate::deploy::proxy::{Forwarded, ProxyTimeouts, proxy_http, proxy_ws};
use crate::error::{ApiError, Code};
use crate::http::access_log;
use crate::http::chain::admission::{self, InFlight, record_request};
use crate::http::chain::canonical::canonicalize;
use crate::http::chain::context::{
    ClientIp, INTERNAL_PREFIX, PathReading, REQUEST_ID, RequestHost, RequestId, RoutedHost, Sni,
    X_FORWARDED_PROTO, policy_of, refuse, request_host,
};
use crate::http::chain::limits::{Limiters, charge_anonymous, charge_client, client_ip_of};
use crate::http::chain::logger::{request_id, request_span};
use crate::http::chain::routing::check_server_name;
use crate::http::policy::Policy;
use crate::http::request::{has_upgrade, is_websocket_upgrade};
use crate::http::state::Node;
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::http::Method;
use actix_web::http::header::{self, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{Error, HttpMessage, HttpRequest, HttpResponse, web};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

/// Step 12 for routed hosts: the deployment answers (a static file or the proxy)
/// instead of the router.
pub async fn deployment_dispatch<B: MessageBody + 'static>(
    req: ServiceRequest,
    next: Next<B>,
) -> Result<ServiceResponse<EitherBody<B>>, Error> {
    if policy_of(&req) != Some(Policy::Deployment) {
        return next
            .call(req)
            .await
            .map(ServiceResponse::map_into_left_body);
    }
    let node = Node::of(req.request()).clone();
    let (http, payload) = req.into_parts();
    // Boxed: the proxy's future is kilobytes, and inline it would make
    // every request's chain future that large (moved whole into actix's boxes).
    let resp = Box::pin(serve_routed(&node, http.clone(), payload)).await;
    Ok(ServiceResponse::new(http, resp).map_into_right_body())
}

/// Serves a routed request; every failure is the JSON envelope.
pub async fn serve_routed(node: &Node, req: HttpRequest, payload: Payload) -> HttpResponse {
    let Some(routed) = req.extensions().get::<RoutedHost>().cloned() else {
        return ApiError::new(Code::NoRoute, "no deployment serves this host")
            .error_response_owned();
    };
    let bound = node.deployments.route(
        &routed.host,
        req.method().as_str(),
        PathReading::of(&req.extensions(), req.path()),
    );
    let Some(bound) = bound else {
        return ApiError::new(
            Code::NoRoute,
            format!(
                "no route of {} takes {} {}",
                routed.host,
                req.method(),
                req.path()
            ),
        )
        .error_response_owned();
    };
    // Each borrow of the request's extensions ends before the next begins.
    let client_ip = req.extensions().get::<ClientIp>().map(|c| c.0);
    let request_id = req.extensions().get::<RequestId>().map(|r| r.0.clone());
    serve_observed(
        node,
        &req,
        payload,
        &routed.host,
        &bound,
        client_ip,
        request_id,
    )
    .await
}

/// The scheme the client used: the listener's (TLS or not), unless a trusted
/// proxy said otherwise in `X-Forwarded-Proto` (the canonical step removed
/// that header from any other peer, and `Forwarded` from every peer). Never
/// the request's own scheme: an absolute-form target `https://...` or an h2
/// `:scheme: https` on the plain listener is the client's word, not TLS.
fn client_scheme(req: &HttpRequest) -> &'static str {
    scheme_of(req, req.app_config().secure())
}

/// [`client_scheme`] of a request that came on a listener that is TLS
/// (`secure`) or not.
pub(crate) fn scheme_of(req: &HttpRequest, secure: bool) -> &'static str {
    if let Some(v) = req.headers().get(&X_FORWARDED_PROTO) {
        let v = v.as_bytes().trim_ascii();
        if v.eq_ignore_ascii_case(b"https") {
            return "https";
        }
        if v.eq_ignore_ascii_case(b"http") {
            return "http";
        }
    }
    if secure { "https" } else { "http" }
}

/// [`serve_bound`], counted: the route's series in `/metrics` and the
/// deployment's activity ring (`crate::deploy::activity`).
async fn serve_observed(
    node: &Node,
    req: &HttpRequest,
    payload: Payload,
    host: &str,
    bound: &Bound,
    client_ip: Option<IpAddr>,
    request_id: Option<String>,
) -> HttpResponse {
    use crate::deploy::activity::recording;
    let start = crate::util::mono_now();
    let server = crate::telemetry::ServerSpan::of(&req.extensions());
    if let Some(s) = &server {
        s.route(&bound.route.path_prefix);
        s.attribute("meshgate.namespace", bound.namespace.to_string());
        s.attribute("meshgate.deployment", bound.deployment.to_string());
    }
    let (resp, attempts) = recording(
        server.clone(),
        serve_bound(
            node,
            req,
            payload,
            host,
            bound,
            client_ip,
            request_id.clone(),
        ),
    )
    .await;
    let status = resp.status().as_u16();
    if let Some(s) = &server {
        s.upstream_status(status);
    }
    note_served(
        node,
        req,
        bound,
        &bound.observed.series,
        &bound.route.path_prefix,
        status,
        start.elapsed(),
        &attempts,
        request_id,
    );
    resp
}

/// Counts a request a deployment route served: its series in `/metrics`
/// (`series`, labelled `route`) and the deployment's activity ring. The
/// gRPC listener (`super::grpc`) counts its calls here too, one route per
/// `/package.Service/Method`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn note_served(
    node: &Node,
    req: &HttpRequest,
    bound: &Bound,
    series: &crate::metrics::RouteSeries,
    route: &str,
    status: u16,
    elapsed: Duration,
    attempts: &[crate::observe::Attempt],
    request_id: Option<String>,
) {
    use crate::observe::{ActivityEntry, Subject};
    node.metrics.observe_route_series(
        series,
        &bound.namespace,
        &bound.deployment,
        route,
        status,
        elapsed.as_secs_f64(),
        attempts,
    );
    let (subject, trace_id) = {
        let ext = req.extensions();
        (
            ext.get::<Subject>().map(|s| s.0.clone()),
            ext.get::<crate::observe::trace::TraceContext>()
                .map(|t| crate::observe::TraceId(t.trace_id)),
        )
    };
    bound.observed.push_activity(
        &node.metrics.route_activity,
        &bound.namespace,
        &bound.deployment,
        ActivityEntry {
            time_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or_default(),
            method: req.method().to_string(),
            path: req.path().to_string(),
            route: route.to_string(),
            status,
            duration_ms: elapsed.as_micros() as f64 / 1000.0,
            instance: attempts.last().map(|a| a.0.clone()),
            request_id,
            subject,
            trace_id,
        },
    );
}

/// Answers a request with the route it matched.
async fn serve_bound(
    node: &Node,
    req: &HttpRequest,
    payload: Payload,
    host: &str,
    bound: &Bound,
    client_ip: Option<IpAddr>,
    request_id: Option<String>,
) -> HttpResponse {
    // The route's policy (CORS preflight, rate limit, credential): a refusal
    // or a preflight answers here, with the route's CORS headers.
    let mut gate = super::route_policy::admit(node, req, bound, client_ip).await;
    if let Some(answer) = gate.early.take() {
        return gate.finish(answer);
    }
    let path = bound.route.rewrite(req.path());
    let result = match &bound.serve {
        // Boxed, as is the WebSocket relay: the proxy's path is kept small.
        Serve::Static(files) => Box::pin(serve_static(node, req, files, &path)).await,
        Serve::Upstream(pool) => {
            let mut pq = path;
            // A WebSocket's `?token=` the route's policy took is not sent on
            // (unless `forward_credentials`).
            let strip_token = bound.route.policy.is_some()
                && req
                    .extensions()
                    .get::<Arc<crate::deploy::route_policy::UpstreamView>>()
                    .is_some_and(|v| v.strip_query_token);
            let query = if strip_token {
                crate::deploy::route_policy::without_query_param(req.query_string(), "token")
            } else {
                std::borrow::Cow::Borrowed(req.query_string())
            };
            if !query.is_empty() {
                pq.push('?');
                pq.push_str(&query);
            }
            let peer = req.peer_addr().map(|a| a.ip());
            let fwd = Forwarded {
                client_ip: client_ip.or(peer),
                peer,
                proto: client_scheme(req),
                host: host.to_string(),
                request_id,
                trace: req
                    .extensions()
                    .get::<crate::observe::trace::TraceContext>()
                    .cloned(),
            };
            let cfg = &node.deployments.config;
            let t = ProxyTimeouts {
                connect: Duration::from_secs(cfg.connect_timeout_seconds),
                response: Duration::from_secs(cfg.upstream_timeout_seconds),
            };
            if is_websocket_upgrade(req.headers()) {
                // A tunnel opened with a token ends when the token or its
                // session does (close 4001), as a `/v1/ws` socket does.
                let view = req
                    .extensions()
                    .get::<std::sync::Arc<crate::deploy::route_policy::UpstreamView>>()
                    .and_then(|v| v.credential.clone());
                let ends = view.map(|id| {
                    let node = node.clone();
                    Box::new(move || id.ended(&node.revoked_sessions, crate::util::now()))
                        as crate::deploy::relay::Ends
                });
                Box::pin(proxy_ws(req, payload, pool, &pq, &fwd, t, ends)).await
            } else {
                let r = proxy_http(req, payload, pool, &pq, &fwd, t).await;
                // The deployment's `compress`, then a few header lookups.
                match r {
                    Ok(r) if pool.compress => Ok(crate::deploy::compress::apply(req, r)),
                    r => r,
                }
            }
        }
    };
    gate.finish(result.unwrap_or_else(|e| e.error_response_owned()))
}

/// What the fast path serves: a plain HTTP request (no upgrade, no cluster
/// hop headers, not a probe) to a host routed to a deployment whose matched
/// route is an upstream.
struct FastRoute {
    /// The node (cloned for this request only): metrics, config, deployments.
    node: Node,
    /// The rate limiters, applied as the chain would: client bucket, then namespace.
    limiters: Arc<Limiters>,
    /// The request's host: compared with the TLS server name, sent as X-Forwarded-Host.
    host: String,
    /// The matched deployment route and its upstream pool.
    bound: Arc<Bound>,
}

fn fast_route(req: &ServiceRequest) -> Option<FastRoute> {
    // Probes are answered before anything else, whatever the host.
    if req.method() == Method::GET
        && matches!(
            req.path(),
            "/livez" | "/readyz" | "/startupz" | "/metrics" | "/__metrics"
        )
    {
        return None;
    }
    // Hops (the internal-auth gate checks their MAC) and upgrades take the chain.
    if has_upgrade(req.headers())
        || req
            .headers()
            .keys()
            .any(|k| k.as_str().starts_with(INTERNAL_PREFIX))
    {
        return None;
    }
    let node = Node::of(req.request());
    let host = request_host(req)?;
    let bound = node.deployments.route(
        &host,
        req.method().as_str(),
        PathReading::of(&req.extensions(), req.path()),
    );
    let Some(bound) = bound else {
        // Not routed: the chain's route-policy step takes the host from here.
        req.extensions_mut().insert(RequestHost(host));
        return None;
    };
    if !matches!(bound.serve, Serve::Upstream(_)) {
        return None;
    }
    // Cloned only for a routed request (every other request takes the chain).
    let node = node.clone();
    let limiters = req
        .app_data::<web::Data<Arc<Limiters>>>()?
        .get_ref()
        .clone();
    Some(FastRoute {
        node,
        limiters,
        host,
        bound,
    })
}

/// The fast path of a routed host's upstream request, the outermost
/// middleware. It runs the chain's steps that act on a deployment, in the
/// chain's order: admission (starting/draining refusals, in-flight count,
/// request metrics), the logger (request id, span, echoed `X-Request-ID`),
/// the client rate limit, the TLS server-name check of domain routing and
/// the namespace rate limit, then the proxy (a route's own policy, its
/// credential, CORS and rate limit, runs in `serve_bound`, on both paths).
/// The others do nothing for a deployment (security headers, the envelope,
/// CORS, authentication, authorization, the scope gate, cluster forwarding)
/// and are not run; nor is
/// `Compress` (an upstream's answer is gzipped by the proxy itself,
/// `crate::deploy::compress`, as it streams). Every other
/// request, static sites included, goes on through the whole chain.
pub async fn routed_fast_path<B: MessageBody + 'static>(
    mut req: ServiceRequest,
    next: Next<B>,
) -> Result<ServiceResponse<EitherBody<B>>, Error> {
    // The canonical request, before any step and any route match
    // (docs/design.md §2): this is the outermost layer but the HTTP/2 drain.
    if let Err(e) = canonicalize(&mut req) {
        return Ok(refuse(req, e));
    }
    let Some(route) = fast_route(&req) else {
        return next
            .call(req)
            .await
            .map(ServiceResponse::map_into_left_body);
    };
    let node = &route.node;
    // Admission.
    if let Some(refused) = admission::refusal(node) {
        return Ok(req.into_response(refused).map_into_right_body());
    }
    let start = crate::util::mono_now();
    let in_flight = InFlight::enter(node);
    // The logger.
    let id = request_id(&req);
    let mut trace = crate::observe::trace::TraceContext::from_headers(req.headers());
    let server =
        crate::telemetry::ServerSpan::begin(&mut trace, req.method().as_str(), req.path(), &id);
    let entry = access_log::Entry::begin(req.method(), start).trace(&trace);
    if let Some(s) = &server {
        req.extensions_mut().insert(s.clone());
    }
    req.extensions_mut().insert(trace);
    let span = request_span(req.method(), req.path(), &id);
    let (http, payload) = req.into_parts();
    // Boxed: the steps' future holds the upstream exchange (kilobytes), and
    // this future is moved whole into actix's box and between its layers;
    // in a box of its own it is allocated once and never copied.
    let mut resp = tracing::Instrument::instrument(
        Box::pin(routed_steps(&route, &http, payload, id.clone())),
        span.clone(),
    )
    .await;
    drop(in_flight);
    if let Some(s) = server {
        s.finish(resp.status().as_u16(), None);
    }
    entry.finish(resp.status().as_u16(), &id, http.path());
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&id) {
        h.insert(REQUEST_ID, v);
    }
    // The marker that keeps `Compress` off (the chain's outermost step drops it too).
    if h.get(header::CONTENT_ENCODING)
        .is_some_and(|v| v == "identity")
    {
        h.remove(header::CONTENT_ENCODING);
    }
    record_request(node, resp.status(), start);
    Ok(ServiceResponse::new(http, resp).map_into_right_body())
}

/// The steps between the logger and the handler, for a routed upstream request.
async fn routed_steps(
    route: &FastRoute,
    req: &HttpRequest,
    payload: Payload,
    request_id: String,
) -> HttpResponse {
    let node = &route.node;
    let l = &route.limiters;
    // The chain's steps that act on a deployment, in its order. The client
    // rate limit (the general bucket: a deployment's policy).
    let client_ip = client_ip_of(l, req.headers(), req.peer_addr());
    if let Some(ip) = client_ip
        && let Err(e) = charge_client(l, node, ip, false)
    {
        return e.error_response_owned();
    }
    // Domain routing: on a TLS connection the host must be the server name.
    if let Err(e) = check_server_name(req.conn_data::<Sni>(), &route.host) {
        return e.error_response_owned();
    }
    // The namespace rate limit: a host's traffic is anonymous (its own bucket).
    if let Err(e) = charge_anonymous(l, node, &route.bound.namespace) {
        return e.error_response_owned();
    }
    serve_observed(
        node,
        req,
        payload,
        &route.host,
        &route.bound,
        client_ip,
        Some(request_id),
    )
    .await
}

/// Decodes `%XX` escapes; None for bad escapes, non-UTF-8, NUL or dot segments.
fn decode_path(raw: &str) -> Option<String> {
    let b = raw.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    let s = String::from_utf8(out).ok()?;
    if s.contains('\0') || s.split('/').any(|seg| seg == ".." || seg == ".") {
        return None;
    }
    Some(s)
}

/// The file a path names: itself, or `index.html` for a folder.
fn find<'a>(files: &'a BTreeMap<String, SiteFile>, path: &str) -> Option<&'a SiteFile> {
    let p = path.trim_start_matches('/');
    if p.is_empty() || p.ends_with('/') {
        return files.get(&format!("{p}index.html"));
    }
    files
        .get(p)
        .or_else(|| files.get(&format!("{p}/index.html")))
}

async fn serve_static(
    node: &Node,
    req: &HttpRequest,
    files: &BTreeMap<String, SiteFile>,
    path: &str,
) -> Result<HttpResponse, ApiError> {
    if !matches!(*req.method(), Method::GET | Method::HEAD) {
        let mut r = ApiError::new(Code::MethodNotAllowed, "a static site answers GET and HEAD")
            .error_response_owned();
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Ok(r);
    }
    let Some(file) = decode_path(path).and_then(|p| find(files, &p)) else {
        return Err(ApiError::new(
            Code::FileNotFound,
            format!("no file at {path}"),
        ));
    };
    let etag = format!("\"{}\"", file.sha256);
    let fresh = req
        .headers()
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .map(|t| t.trim().trim_start_matches("W/"))
                .any(|t| t == etag || t == "*")
        });
    if fresh {
        return Ok(HttpResponse::NotModified()
            .insert_header((header::ETAG, etag))
            .insert_header((header::CACHE_CONTROL, "no-cache"))
            .finish());
    }
    // Shared with every other answer sending this file now.
    let bytes = node
        .deployments
        .files
        .read(&node.store, &file.sha256)
        .await?
        .ok_or_else(|| {
            ApiError::new(
                Code::Internal,
                "a file of this site is missing from the store",
            )
        })?;
    Ok(HttpResponse::Ok()
        .insert_header((header::CONTENT_TYPE, file.content_type.as_str()))
        .insert_header((header::ETAG, etag))
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .body(crate::http::body::in_chunks(bytes, ())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Escapes decode; dot segments, NUL and bad escapes are refused.
    #[test]
    fn decodes_paths() {
        assert_eq!(decode_path("/a%20b.html").as_deref(), Some("/a b.html"));
        assert_eq!(decode_path("/%2e%2e/x"), None);
        assert_eq!(decode_path("/a/../x"), None);
        assert_eq!(decode_path("/a%00"), None);
        assert_eq!(decode_path("/a%zz"), None);
        assert_eq!(decode_path("/a%4"), None);
    }

    /// Folders serve their index.html, with or without the trailing slash.
    #[test]
    fn folders_serve_index() {
        let f = |sha: &str| SiteFile {
            sha256: sha.into(),
            size: 1,
            content_type: "text/html".into(),
        };
        let files: BTreeMap<String, SiteFile> = [
            ("index.html".to_string(), f("root")),
            ("docs/index.html".to_string(), f("docs")),
            ("a.css".to_string(), f("css")),
        ]
        .into_iter()
        .collect();
        assert_eq!(find(&files, "/").unwrap().sha256, "root");
        assert_eq!(find(&files, "/docs/").unwrap().sha256, "docs");
        assert_eq!(find(&files, "/docs").unwrap().sha256, "docs");
        assert_eq!(find(&files, "/a.css").unwrap().sha256, "css");
        assert!(find(&files, "/missing").is_none());
    }
}
