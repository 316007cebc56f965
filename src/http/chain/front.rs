//! Steps 0 to 4 of the request chain (docs/design.md §2) and the layer the
//! whole chain runs in, [`front`]: admission, the internal-header gate, the
//! route's policy, the request log with the request id, then the envelope
//! and the security headers around steps 5 to 12 ([`steps`](super::steps::steps)).
//! [`serve`](crate::http::serve) puts it under the probes and `Compress`; a
//! test drives the order from outside.

use super::admission::{self, InFlight, record_request};
use super::context::{
    INTERNAL_PREFIX, REQUEST_ID, RequestHost, RequestId, RoutedHost, policy_of, refuse,
};
use super::logger::{request_id, request_span};
use super::steps::steps;
use crate::error::{ApiError, Code};
use crate::http::policy::{Policy, PolicyMap};
use crate::http::state::Node;
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{Error, HttpMessage, web};

/// Bodies smaller than this are sent uncompressed.
const SMALL_BODY: u64 = 1024;

/// The whole chain in one layer, in order (one boxed future and one service
/// hop per request instead of eight). Steps 0 to 4 here: admission (refuses new work while the
/// node starts or drains, counts requests in flight for the drain, records
/// request metrics), the internal-header gate ([`internal_auth_gate`]), the
/// route's policy ([`route_policy`]), the request log ([`access_log`](crate::http::access_log))
/// with the request id, then the envelope and the security headers
/// ([`answer`]), which runs steps 5 to 12 ([`steps`](super::steps::steps)) inside.
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
/// log line ([`access_log`](crate::http::access_log)), then the envelope and the security
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
    let mut trace = crate::observe::trace::TraceContext::from_headers(req.headers());
    // The request's SERVER span, when spans are exported (else nothing is built).
    let server =
        crate::telemetry::ServerSpan::begin(&mut trace, req.method().as_str(), req.path(), &id);
    let entry = crate::http::access_log::Entry::begin(req.method(), start).trace(&trace);
    if let Some(s) = &server {
        req.extensions_mut().insert(s.clone());
    }
    req.extensions_mut().insert(trace);
    let span = request_span(req.method(), req.path(), &id);
    let res = tracing::Instrument::instrument(answer(req, next), span).await;
    if let Some(s) = server {
        match &res {
            Ok(r) => s.finish(r.status().as_u16(), r.request().match_pattern().as_deref()),
            Err(e) => s.finish(e.as_response_error().status_code().as_u16(), None),
        }
    }
    match res {
        Ok(mut r) => {
            entry.finish(r.status().as_u16(), &id, r.request().path());
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
    let res = steps(req, next).await?;
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
