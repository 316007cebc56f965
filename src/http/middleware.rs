//! The request chain of docs/design.md §2, one function per step, outermost
//! first. The whole chain runs in one layer, [`front`], which calls the
//! steps in order; [`super::serve`] puts it under the probes and `Compress`;
//! a test drives the order from outside.

use crate::error::{ApiError, Code};
use crate::http::chain::admission::{self, InFlight, record_request};
use crate::http::chain::context::{
    INTERNAL_PREFIX, REQUEST_ID, RequestHost, RequestId, RoutedHost, X_API_KEY, X_FORWARDED_FOR,
    policy_of, refuse,
};
use crate::http::chain::limits::Limiters;
use crate::http::chain::logger::{request_id, request_span};
use crate::http::policy::{Policy, PolicyMap};
use crate::http::state::{Node, Phase};
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{Error, HttpMessage, HttpResponse, web};

/// Bodies smaller than this are sent uncompressed.
const SMALL_BODY: u64 = 1024;

/// Probes and `/metrics`: answered before anything else, outside the chain and
/// not counted in request metrics.
pub async fn probes(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, Error> {
    let path = req.path();
    if !matches!(path, "/livez" | "/readyz" | "/startupz" | "/metrics")
        || req.method() != actix_web::http::Method::GET
    {
        let mut res = next.call(req).await?;
        // The marker set by `admission` kept Compress off a small body; the
        // client never sees it.
        if res
            .headers()
            .get(header::CONTENT_ENCODING)
            .is_some_and(|v| v == "identity")
        {
            res.headers_mut().remove(header::CONTENT_ENCODING);
        }
        return Ok(res.map_into_left_body());
    }
    let node = Node::of(req.request()).clone();
    let resp = match path {
        "/livez" => HttpResponse::Ok().json(serde_json::json!({"status": "alive"})),
        "/startupz" => HttpResponse::Ok().json(serde_json::json!({"status": "started"})),
        "/readyz" => match node.phase() {
            Phase::Ready => HttpResponse::Ok().json(serde_json::json!({"status": "ready"})),
            Phase::Starting => {
                ApiError::new(Code::Starting, "the node is starting").error_response_owned()
            }
            Phase::Draining => {
                ApiError::new(Code::Draining, "the node is draining").error_response_owned()
            }
        },
        _ => metrics_answer(&req, &node),
    };
    Ok(req.into_response(resp).map_into_right_body())
}

/// `/metrics` on the main listener (`[metrics]`): whole with the operator key
/// (`Authorization: Bearer` or `X-API-Key`); without a credential 401, or,
/// when `public`, the exposition without namespace names. A wrong credential
/// is 401 and charged to the client's credential bucket, so `/metrics` is no
/// way around the sign-in rate limit.
fn metrics_answer(req: &ServiceRequest, node: &Node) -> HttpResponse {
    let text = |body: String| {
        HttpResponse::Ok()
            .content_type("text/plain; version=0.0.4")
            .body(body)
    };
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .or_else(|| req.headers().get(&X_API_KEY))
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            let v = v.trim();
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
                .unwrap_or(v)
                .trim()
        })
        .filter(|v| !v.is_empty());
    match presented {
        Some(k) if node.secrets.is_operator_key(k) => text(
            node.metrics
                .render(node.config.metrics.namespace_series_limit),
        ),
        None if node.config.metrics.public => text(node.metrics.render_public()),
        None => ApiError::new(
            Code::MissingCredential,
            "/metrics needs the operator key ([metrics] in the README)",
        )
        .error_response_owned(),
        Some(_) => {
            if let Some(l) = req.app_data::<web::Data<std::sync::Arc<Limiters>>>() {
                let xff = req
                    .headers()
                    .get(&X_FORWARDED_FOR)
                    .and_then(|v| v.to_str().ok());
                if let Some(ip) = l.client_ip(req.peer_addr(), xff)
                    && let Err(after) = l.check_credential(ip)
                {
                    node.metrics
                        .rate_limited
                        .with_label_values(&["credential"])
                        .inc();
                    return ApiError::rate_limited(Code::RateLimited, after).error_response_owned();
                }
            }
            ApiError::new(Code::InvalidOperatorKey, "/metrics needs the operator key")
                .error_response_owned()
        }
    }
}

/// The whole chain in one layer, in order (one boxed future and one service
/// hop per request instead of eight). Steps 0 to 4 here: admission (refuses new work while the
/// node starts or drains, counts requests in flight for the drain, records
/// request metrics), the internal-header gate ([`internal_auth_gate`]), the
/// route's policy ([`route_policy`]), the request log ([`super::access_log`])
/// with the request id, then the envelope and the security headers
/// ([`answer`]), which runs steps 5 to 12 ([`super::chain::steps`]) inside.
/// Answers refused by admission or the gate are not logged.
pub async fn front(
    mut req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, Error> {
    let node = Node::of(req.request()).clone();
    if let Some(refused) = admission::refusal(&node) {
        return Ok(req.into_response(refused).map_into_right_body());
    }
    let start = crate::util::mono_now();
    // Decremented on drop, so a panicking handler cannot hold the drain forever.
    let in_flight = InFlight::enter(&node);
    let mut res = match internal_auth_gate(&node, &mut req).await {
        Err(refused) => Ok(refuse(req, refused)),
        Ok(()) => {
            route_policy(&node, &mut req);
            logged(req, next, start).await
        }
    };
    drop(in_flight);
    // Compressing a body under 1 KiB costs more (a fresh encoder per response)
    // than it saves; mark it so Compress leaves it alone.
    if let Ok(r) = &mut res
        && matches!(r.response().body().size(), actix_web::body::BodySize::Sized(n) if n < SMALL_BODY)
        && !r.headers().contains_key(header::CONTENT_ENCODING)
    {
        r.headers_mut().insert(
            header::CONTENT_ENCODING,
            HeaderValue::from_static("identity"),
        );
    }
    let status = match &res {
        Ok(r) => r.status(),
        Err(e) => e.as_response_error().status_code(),
    };
    record_request(&node, status, start);
    res
}

/// Step 1: deletes every `X-Internal-Auth-*` header unless a valid hop MAC came
/// with it (checked by the cluster module when this node is in a cluster). A
/// hop whose MAC holds but whose body was changed is refused here.
async fn internal_auth_gate(node: &Node, req: &mut ServiceRequest) -> Result<(), ApiError> {
    let has_internal = req
        .headers()
        .keys()
        .any(|k| k.as_str().starts_with(INTERNAL_PREFIX));
    if !has_internal {
        return Ok(());
    }
    if let Some(identity) = crate::http::hop::verify_hop(node, req).await? {
        req.extensions_mut().insert(identity);
    }
    let names: Vec<HeaderName> = req
        .headers()
        .keys()
        .filter(|k| k.as_str().starts_with(INTERNAL_PREFIX))
        .cloned()
        .collect();
    let headers = req.headers_mut();
    for n in names {
        headers.remove(n);
    }
    Ok(())
}

/// Step 2: puts the matched route's policy on the request. Every path of a host
/// routed to a deployment has the deployment policy. The host and its
/// deployment, found here once, travel in the request's extensions
/// (`RequestHost`, `RoutedHost`) for domain routing and the dispatcher.
fn route_policy(node: &Node, req: &mut ServiceRequest) {
    // The routed fast path found the host already unless it stopped earlier
    // (probes, hops, upgrades).
    let host = RequestHost::of(req);
    let routed = host
        .as_deref()
        .and_then(|h| node.deployments.host_namespace(h));
    if let (Some(namespace), Some(host)) = (routed, host) {
        let mut ext = req.extensions_mut();
        ext.insert(Policy::Deployment);
        ext.insert(RoutedHost { namespace, host });
    } else if let Some(map) = req.app_data::<web::Data<PolicyMap>>()
        && let Some(pattern) = map.pattern_of(req.path(), || req.match_pattern())
        && let Some(policy) = map.get(req.method(), pattern)
    {
        let p = policy.clone();
        req.extensions_mut().insert(p);
    }
}

/// Steps 3 and 4 (inside [`front`]): the request id (the client's when it
/// sent a sane one, else a fresh one; echoed in the response), the request's
/// log line ([`super::access_log`]), then the envelope and the security
/// headers ([`answer`]). Events logged while the request runs sit in a
/// `request` span with its method, path and id when `RUST_LOG` enables DEBUG
/// (docs/decisions.md "The request log").
async fn logged<B: MessageBody + 'static>(
    req: ServiceRequest,
    next: Next<B>,
    start: std::time::Instant,
) -> Result<ServiceResponse<EitherBody<EitherBody<B>>>, Error> {
    let id = request_id(&req);
    req.extensions_mut().insert(RequestId(id.clone()));
    let entry = crate::http::access_log::Entry::begin(req.method(), req.path(), start);
    let span = request_span(req.method(), req.path(), &id);
    let res = tracing::Instrument::instrument(answer(req, next), span).await;
    match res {
        Ok(mut r) => {
            entry.finish(r.status().as_u16(), &id);
            if let Ok(v) = HeaderValue::from_str(&id) {
                r.headers_mut().insert(REQUEST_ID, v);
            }
            Ok(r)
        }
        Err(e) => Err(e),
    }
}

/// Steps 3½ and 4: every error answer that is not already the JSON envelope
/// becomes it ([`envelope`]), then the security headers go on
/// ([`security_headers`]). A deployment's answers are the upstream's own:
/// neither touches them.
async fn answer<B: MessageBody + 'static>(
    req: ServiceRequest,
    next: Next<B>,
) -> Result<ServiceResponse<EitherBody<EitherBody<B>>>, Error> {
    let deployed = policy_of(&req) == Some(Policy::Deployment);
    let v1 = req.path().starts_with("/v1/");
    // Steps 5 to 12, in the same layer.
    let res = crate::http::chain::steps(req, next).await?;
    if deployed {
        return Ok(res.map_into_left_body());
    }
    let mut res = envelope(res);
    security_headers(res.headers_mut(), v1);
    Ok(res)
}

/// Turns an error answer that is not already the JSON envelope (extractor
/// errors, 404s of unknown routes, 413s) into it.
fn envelope<B: MessageBody>(res: ServiceResponse<B>) -> ServiceResponse<EitherBody<B>> {
    let status = res.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return res.map_into_left_body();
    }
    let is_envelope = match res.response().error() {
        Some(e) => e.as_error::<ApiError>().is_some(),
        None => res
            .headers()
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/json")),
    };
    if is_envelope {
        return res.map_into_left_body();
    }
    let message = res
        .response()
        .error()
        .map(|e| e.to_string())
        .unwrap_or_default();
    let (code, message) = match status {
        StatusCode::NOT_FOUND => (Code::NotFound, "no such route".to_string()),
        StatusCode::PAYLOAD_TOO_LARGE => (
            Code::PayloadTooLarge,
            or(message, "the request body is too large"),
        ),
        StatusCode::METHOD_NOT_ALLOWED => (
            Code::MethodNotAllowed,
            "this route does not take that method".into(),
        ),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => (
            Code::UnsupportedMediaType,
            or(message, "unsupported content type"),
        ),
        s if s.is_client_error() => (Code::BadRequest, or(message, "bad request")),
        _ => (Code::Internal, or(message, "internal error")),
    };
    // actix's own answer keeps its status (a 408 stays a 408).
    let api = ApiError::with_status(status, code, message);
    let (req, old) = res.into_parts();
    let mut new = api.error_response_owned();
    for (k, v) in old.headers() {
        if k != header::CONTENT_TYPE && k != header::CONTENT_LENGTH {
            new.headers_mut().insert(k.clone(), v.clone());
        }
    }
    ServiceResponse::new(req, new).map_into_right_body()
}

fn or(s: String, default: &str) -> String {
    if s.is_empty() { default.to_string() } else { s }
}

/// Step 4: security headers; `/v1/*` answers are `Cache-Control: no-store`
/// unless the handler set one.
fn security_headers(h: &mut actix_web::http::header::HeaderMap, v1: bool) {
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    if v1 && !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
}

/// Most request-body bytes read and thrown away after an HTTP/2 refusal
/// ([`drain_h2_refusals`]); a larger declared body is not waited for.
pub const MAX_DRAIN_BYTES: u64 = 8 << 20;
/// Longest wait for an HTTP/2 request's unread body before the refusal goes
/// out anyway.
pub const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The request body, shared between the handler (which may read it) and
/// [`drain_h2_refusals`] (which reads what the handler left).
struct SharedPayload(std::rc::Rc<std::cell::RefCell<Option<actix_web::dev::Payload>>>);

impl futures_util::Stream for SharedPayload {
    type Item = Result<actix_web::web::Bytes, actix_web::error::PayloadError>;
    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        match self.0.borrow_mut().as_mut() {
            Some(p) => std::pin::Pin::new(p).poll_next(cx),
            None => std::task::Poll::Ready(None),
        }
    }
}

/// HTTP/2: a refusal (4xx, 5xx) of a request whose body was not read reaches
/// the client only after that body is read (up to [`MAX_DRAIN_BYTES`],
/// within [`DRAIN_TIMEOUT`]). Answering early is legal HTTP/2 (the stream
/// then ends with `RST_STREAM(NO_ERROR)`, as h2 sends it), but clients such
/// as curl 7.88 with nghttp2 report the reset that arrives while they still
/// upload as "Stream error in the HTTP/2 framing layer" and drop the answer
/// (issue #43; docs/decisions.md). HTTP/1.1 and requests without a body
/// are untouched.
pub async fn drain_h2_refusals(
    mut req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, Error> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let may_have_body = match declared {
        Some(n) => n > 0 && n <= MAX_DRAIN_BYTES,
        None => !matches!(
            *req.method(),
            actix_web::http::Method::GET | actix_web::http::Method::HEAD
        ),
    };
    if req.version() != actix_web::http::Version::HTTP_2 || !may_have_body {
        return next.call(req).await;
    }
    let shared = std::rc::Rc::new(std::cell::RefCell::new(Some(req.take_payload())));
    req.set_payload(actix_web::dev::Payload::Stream {
        payload: Box::pin(SharedPayload(shared.clone())),
    });
    let res = next.call(req).await;
    let refused = match &res {
        Ok(r) => r.status().is_client_error() || r.status().is_server_error(),
        Err(_) => true,
    };
    // Taken out of the cell first: no borrow is held across the reads.
    let left = shared.borrow_mut().take();
    if refused && let Some(mut payload) = left {
        use futures_util::StreamExt;
        let _ = tokio::time::timeout(DRAIN_TIMEOUT, async move {
            let mut read = 0u64;
            while let Some(Ok(chunk)) = payload.next().await {
                read += chunk.len() as u64;
                if read > MAX_DRAIN_BYTES {
                    break;
                }
            }
        })
        .await;
    }
    res
}
