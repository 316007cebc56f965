//! The gRPC listener (`[grpc] listen`; docs/deployments.md "gRPC",
//! docs/decisions.md "gRPC on a listener of its own"): HTTP/2 served by
//! hyper, because actix-http's HTTP/2 dispatcher cannot send the trailers
//! every gRPC answer ends with. Each call to a deployment host goes through
//! the chain's steps that act on a proxied host, the same functions the
//! routed fast path (`deploy_serve.rs`) calls, in its order: admission,
//! the canonical request, the request id, span and log, the client rate
//! limit, the TLS server-name check, the namespace rate limit, the route's
//! policy, then the upstream (`crate::deploy::grpc`). The node's own
//! refusals are gRPC statuses in a Trailers-Only answer, never JSON.
//!
//! The steps read an actix request: the call's head is made into one (its
//! body stays hyper's and streams to the upstream untouched).

use super::chain::admission::{self, InFlight, record_request};
use super::chain::canonical::canonicalize;
use super::chain::context::{ClientIp, PathReading, RequestId, Sni, request_host};
use super::chain::limits::{Limiters, charge_anonymous, charge_client, client_ip_of};
use super::chain::logger::{request_id, request_span};
use super::chain::routing::check_server_name;
use super::state::Node;
use crate::deploy::activity::{attempt_begins, attempted, recording};
use crate::deploy::grpc::{
    GRPC_STATUS, GRPC_TIMEOUT, GrpcBody, GrpcCode, LocalExec, code_of, deadline_of, encode_timeout,
    is_grpc, sender, status_headers,
};
use crate::deploy::h1::ConnectFailure;
use crate::deploy::index::{Bound, Serve};
use crate::deploy::pool::{ProxyTimeouts, UpstreamPool};
use crate::deploy::proxy::Forwarded;
use crate::error::{ApiError, Code};
use actix_web::HttpMessage;
use actix_web::HttpRequest;
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode};
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// How long a TLS client may take to finish its handshake (`HttpServer`'s default).
const TLS_HANDSHAKE: Duration = Duration::from_secs(3);

/// What every call of one worker's listener needs.
pub(crate) struct Ctx {
    /// The node: deployments, metrics, config.
    pub node: Node,
    /// The node's rate limiters (the main listener's own).
    pub limiters: Arc<Limiters>,
}

/// A call's answer and the status it is counted with in the request
/// metrics, the route series and the log: the upstream's HTTP status, or
/// the HTTP status of the node's own refusal (a Trailers-Only answer is
/// HTTP 200 on the wire).
type Answer = (Response<GrpcBody>, u16);

/// Serves one accepted connection: TLS first when `tls` is set (its server
/// name kept for the 421 check), then HTTP/2 with prior knowledge.
pub(crate) async fn serve_connection(
    ctx: Rc<Ctx>,
    tcp: actix_web::rt::net::TcpStream,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let _ = tcp.set_nodelay(true);
    let Ok(peer) = tcp.peer_addr() else { return };
    match tls {
        None => serve_h2(ctx, tcp, peer, None).await,
        Some(acceptor) => {
            let Ok(Ok(stream)) = tokio::time::timeout(TLS_HANDSHAKE, acceptor.accept(tcp)).await
            else {
                return;
            };
            let sni = stream
                .get_ref()
                .1
                .server_name()
                .map(str::to_ascii_lowercase);
            serve_h2(ctx, stream, peer, Some(Sni(sni))).await
        }
    }
}

async fn serve_h2<IO>(ctx: Rc<Ctx>, io: IO, peer: SocketAddr, sni: Option<Sni>)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + 'static,
{
    let sni = Rc::new(sni);
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let ctx = ctx.clone();
        let sni = sni.clone();
        async move { Ok::<_, Infallible>(Box::pin(call(&ctx, req, peer, sni.as_ref().as_ref())).await) }
    });
    let _ = hyper::server::conn::http2::Builder::new(LocalExec)
        .serve_connection(hyper_util::rt::TokioIo::new(io), svc)
        .await;
}

/// A refusal waits, before it goes out, for the rest of a request body the
/// client is still sending (up to `MAX_DRAIN_BYTES`), for as long as
/// frames keep coming at most this far apart: an upload in flight is read
/// to its end, an idle stream (a bidi call waiting for its answer) is not
/// waited for. As the main listener's `drain_h2_refusals` does, for clients
/// that drop an answer whose `RST_STREAM(NO_ERROR)` arrives mid-upload
/// (docs/decisions.md).
const DRAIN_IDLE: Duration = Duration::from_millis(50);

/// Reads and drops what is left of a refused call's body (see [`DRAIN_IDLE`]).
async fn drain(mut body: Incoming) {
    use hyper::body::Body as _;
    let mut read = 0u64;
    while !body.is_end_stream() && read <= super::middleware::MAX_DRAIN_BYTES {
        let frame = std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx));
        match tokio::time::timeout(DRAIN_IDLE, frame).await {
            Ok(Some(Ok(f))) => {
                read += f.data_ref().map_or(0, |d| d.len() as u64);
            }
            _ => return,
        }
    }
}

/// A Trailers-Only answer: HTTP 200, the status in the head, no body.
fn trailers_only(code: GrpcCode, message: &str) -> Response<GrpcBody> {
    let mut r = Response::new(GrpcBody::Empty);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    h.extend(status_headers(code, message));
    r
}

/// One of the node's errors as a gRPC answer.
fn refusal(e: &ApiError) -> Answer {
    let status = e.status.as_u16();
    (trailers_only(code_of(e.code, status), &e.message), status)
}

/// A refusal a step answered as an HTTP response (the route policy's): its
/// envelope's message, with the status its HTTP status maps to.
async fn refusal_of_response(resp: actix_web::HttpResponse) -> Answer {
    let status = resp.status().as_u16();
    let body = actix_web::body::to_bytes(resp.into_body())
        .await
        .unwrap_or_default();
    let message = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| format!("refused with HTTP status {status}"));
    (
        trailers_only(code_of(Code::BadRequest, status), &message),
        status,
    )
}

/// The call's head as an actix request, for the chain's steps: method,
/// target (with its `:authority`), headers and peer; the node and its
/// limiters as app data. The body is not in it.
fn actix_request(
    ctx: &Ctx,
    parts: &hyper::http::request::Parts,
    peer: SocketAddr,
) -> actix_web::dev::ServiceRequest {
    let method =
        actix_web::http::Method::from_bytes(parts.method.as_str().as_bytes()).unwrap_or_default();
    let mut sreq = actix_web::test::TestRequest::default()
        .method(method)
        .uri(&parts.uri.to_string())
        .version(actix_web::http::Version::HTTP_2)
        .peer_addr(peer)
        .app_data(actix_web::web::Data::new(ctx.node.clone()))
        .app_data(actix_web::web::Data::new(ctx.limiters.clone()))
        .to_srv_request();
    let h = sreq.headers_mut();
    for (k, v) in &parts.headers {
        // The chain's internal-auth gate, for a listener no hop reaches: a
        // client's `X-Internal-Auth-*` header is dropped, never forwarded.
        if k.as_str()
            .starts_with(crate::http::chain::context::INTERNAL_PREFIX)
        {
            continue;
        }
        if let (Ok(k), Ok(v)) = (
            actix_web::http::header::HeaderName::from_bytes(k.as_str().as_bytes()),
            actix_web::http::header::HeaderValue::from_bytes(v.as_bytes()),
        ) {
            h.append(k, v);
        }
    }
    sreq
}

/// One call, through the steps of a proxied host (see the module's doc).
async fn call(
    ctx: &Ctx,
    req: Request<Incoming>,
    peer: SocketAddr,
    sni: Option<&Sni>,
) -> Response<GrpcBody> {
    let node = &ctx.node;
    let grpc = req
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| is_grpc(v.as_bytes()));
    if !grpc {
        // gRPC over HTTP/2: a content type that is not gRPC's is 415.
        let mut r = trailers_only(
            GrpcCode::Internal,
            "this listener serves gRPC (content-type application/grpc) only",
        );
        *r.status_mut() = StatusCode::UNSUPPORTED_MEDIA_TYPE;
        drain(req.into_body()).await;
        return r;
    }
    // Admission.
    if let Some(refused) = admission::refusal(node) {
        return refusal_of_response(refused).await.0;
    }
    let start = crate::util::mono_now();
    let in_flight = InFlight::enter(node);
    let (parts, body) = req.into_parts();
    let mut sreq = actix_request(ctx, &parts, peer);
    // The canonical request, before any step and any route match.
    if let Err(e) = canonicalize(&mut sreq) {
        let (resp, status) = refusal(&e);
        drain(body).await;
        record_request(node, status_code(status), start);
        return resp;
    }
    // The logger.
    let id = request_id(&sreq);
    let mut trace = crate::observe::trace::TraceContext::from_headers(sreq.headers());
    let server = crate::telemetry::ServerSpan::begin(&mut trace, "POST", sreq.path(), &id);
    let entry = crate::http::access_log::Entry::begin(sreq.method(), start).trace(&trace);
    if let Some(s) = &server {
        sreq.extensions_mut().insert(s.clone());
    }
    sreq.extensions_mut().insert(trace);
    sreq.extensions_mut().insert(RequestId(id.clone()));
    let span = request_span(sreq.method(), sreq.path(), &id);
    let host = request_host(&sreq);
    let (http, _) = sreq.into_parts();
    let mut body = Some(body);
    let (mut resp, status) =
        tracing::Instrument::instrument(steps(ctx, &http, &mut body, host, sni, id.clone()), span)
            .await;
    drop(in_flight);
    if let Some(unread) = body {
        drain(unread).await;
    }
    if let Some(s) = server {
        s.finish(status, None);
    }
    entry.finish(status, &id, http.path());
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    record_request(node, status_code(status), start);
    resp
}

fn status_code(status: u16) -> actix_web::http::StatusCode {
    actix_web::http::StatusCode::from_u16(status)
        .unwrap_or(actix_web::http::StatusCode::INTERNAL_SERVER_ERROR)
}

/// The steps between the logger and the upstream, as `routed_steps` runs
/// them for a proxied HTTP request.
async fn steps(
    ctx: &Ctx,
    req: &HttpRequest,
    body: &mut Option<Incoming>,
    host: Option<String>,
    sni: Option<&Sni>,
    request_id: String,
) -> Answer {
    let node = &ctx.node;
    let l = &ctx.limiters;
    let client_ip = client_ip_of(l, req.headers(), req.peer_addr());
    if let Some(ip) = client_ip {
        if let Err(e) = charge_client(l, node, ip, false) {
            return refusal(&e);
        }
        req.extensions_mut().insert(ClientIp(ip));
    }
    let Some(host) = host else {
        return refusal(&ApiError::new(Code::NoRoute, "the call names no host"));
    };
    if let Err(e) = check_server_name(sni, &host) {
        return refusal(&e);
    }
    let bound = node.deployments.route(
        &host,
        req.method().as_str(),
        PathReading::of(&req.extensions(), req.path()),
    );
    let Some(bound) = bound else {
        return refusal(&ApiError::new(
            Code::NoRoute,
            format!("no route of {host} takes {}", req.path()),
        ));
    };
    let Serve::Upstream(pool) = &bound.serve else {
        return refusal(&ApiError::new(
            Code::NoRoute,
            format!("{host} is a static site, not a gRPC upstream"),
        ));
    };
    if let Err(e) = charge_anonymous(l, node, &bound.namespace) {
        return refusal(&e);
    }
    // Counted under the matched route's declared `path_prefix`, as every
    // routed request: a route per method gives figures per method, and a
    // client's method name never becomes a label.
    let start = crate::util::mono_now();
    let server = crate::telemetry::ServerSpan::of(&req.extensions());
    if let Some(s) = &server {
        s.route(req.path());
        s.attribute("meshgate.namespace", bound.namespace.to_string());
        s.attribute("meshgate.deployment", bound.deployment.to_string());
    }
    let ((resp, status), attempts) = recording(
        server.clone(),
        Box::pin(upstream_call(
            node,
            req,
            body,
            &host,
            &bound,
            pool,
            client_ip,
            &request_id,
            sni.is_some(),
        )),
    )
    .await;
    if let Some(s) = &server {
        s.upstream_status(status);
    }
    super::deploy_serve::note_served(
        node,
        req,
        &bound,
        &bound.observed.series,
        &bound.route.path_prefix,
        status,
        start.elapsed(),
        &attempts,
        Some(request_id),
    );
    (resp, status)
}

/// The route's policy, the deadline, then the call on one of the instances.
#[allow(clippy::too_many_arguments)]
async fn upstream_call(
    node: &Node,
    req: &HttpRequest,
    body: &mut Option<Incoming>,
    host: &str,
    bound: &Bound,
    pool: &UpstreamPool,
    client_ip: Option<IpAddr>,
    request_id: &str,
    tls: bool,
) -> Answer {
    let deadline = match deadline_of(
        req.headers()
            .get(GRPC_TIMEOUT.as_str())
            .map(|v| v.as_bytes()),
        pool.grpc_max_timeout,
    ) {
        Ok(d) => d.map(|d| tokio::time::Instant::now() + d),
        Err(e) => return refusal(&e),
    };
    // The route's policy (its rate limit and credential): a refusal ends the call.
    let mut gate = super::route_policy::admit(node, req, bound, client_ip).await;
    if let Some(early) = gate.early.take() {
        return refusal_of_response(early).await;
    }
    let mut pq = bound.route.rewrite(req.path());
    if !req.query_string().is_empty() {
        pq.push('?');
        pq.push_str(req.query_string());
    }
    let peer = req.peer_addr().map(|a| a.ip());
    let fwd = Forwarded {
        client_ip: client_ip.or(peer),
        peer,
        proto: super::deploy_serve::scheme_of(req, tls),
        host: host.to_string(),
        request_id: Some(request_id.to_string()),
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
    let order = pool.pick(Some(req), client_ip);
    if order.is_empty() {
        return refusal(&ApiError::new(
            Code::NoHealthyUpstream,
            "no healthy instance of this deployment",
        ));
    }
    // A connection that cannot be had is retried on the next instance
    // (nothing was sent); once the call is sent it is not retried.
    let mut chosen = None;
    let mut last = String::new();
    for i in order {
        let base = &pool.instances[i].base;
        attempt_begins(base);
        match sender((&bound.namespace, &bound.deployment), pool, i, t).await {
            Ok(tx) => {
                chosen = Some((i, tx));
                break;
            }
            Err(ConnectFailure::Refused(r)) => {
                attempted(base, "refused");
                return refusal(&crate::deploy::egress::forbidden_at_connect(&r));
            }
            Err(ConnectFailure::Failed(why)) => {
                attempted(base, "connect_failed");
                pool.failed(i);
                last = why;
            }
        }
    }
    let Some((i, mut tx)) = chosen else {
        return refusal(&ApiError::new(
            Code::UpstreamUnavailable,
            format!("no instance could be reached: {last}"),
        ));
    };
    let inst = &pool.instances[i];
    // The identity the route's policy checked, the forwarding headers and
    // the trace context, as every proxied request (`deploy::headers`).
    let mut headers = crate::deploy::headers::h1_headers(req, &fwd);
    headers.insert(header::TE, HeaderValue::from_static("trailers"));
    match deadline {
        Some(d) => {
            headers.insert(
                GRPC_TIMEOUT,
                encode_timeout(d.saturating_duration_since(tokio::time::Instant::now())),
            );
        }
        None => {
            headers.remove(GRPC_TIMEOUT);
        }
    }
    let Some(body) = body.take() else {
        return refusal(&ApiError::new(Code::Internal, "the call's body was taken"));
    };
    let mut up = Request::new(body);
    *up.method_mut() = hyper::Method::POST;
    *up.version_mut() = hyper::Version::HTTP_2;
    *up.headers_mut() = headers;
    match format!("{}{}", inst.base, pq).parse() {
        Ok(u) => *up.uri_mut() = u,
        Err(e) => {
            return refusal(&ApiError::new(
                Code::UpstreamFailed,
                format!("no URI of {} for this call: {e}", inst.base),
            ));
        }
    }
    let in_flight = pool.start(i);
    let sent = tx.send_request(up);
    let answered = match deadline {
        Some(d) => match tokio::time::timeout_at(d, sent).await {
            Ok(r) => r,
            Err(_) => {
                attempted(&inst.base, "timed_out");
                return refusal(&ApiError::new(
                    Code::UpstreamTimeout,
                    "the call's deadline passed before the upstream answered (meshgate)",
                ));
            }
        },
        None => sent.await,
    };
    drop(in_flight);
    let resp = match answered {
        Ok(r) => r,
        Err(e) => {
            attempted(&inst.base, "failed");
            pool.failed(i);
            return refusal(&ApiError::new(
                Code::UpstreamFailed,
                format!("the upstream failed the call: {e}"),
            ));
        }
    };
    attempted(&inst.base, "answered");
    pool.succeeded(i);
    let status = resp.status().as_u16();
    let (mut parts, incoming) = resp.into_parts();
    let needs_status = !parts.headers.contains_key(GRPC_STATUS);
    parts.headers.remove(header::CONNECTION);
    // A Trailers-Only answer (its status in the head, the stream ended
    // with it) is passed as one: no empty DATA frame after it.
    let body = if hyper::body::Body::is_end_stream(&incoming) {
        GrpcBody::Empty
    } else {
        GrpcBody::proxied(incoming, deadline, needs_status && status == 200)
    };
    (Response::from_parts(parts, body), status)
}
