//! The layers around the request chain (docs/design.md §2), outside it: the
//! probes and `/metrics` (answered before anything else) and, outermost,
//! [`drain_h2_refusals`]. The chain itself runs in one layer,
//! [`chain::front::front`](crate::http::chain::front::front).

use crate::error::{ApiError, Code};
use crate::http::chain::context::{X_API_KEY, X_FORWARDED_FOR};
use crate::http::chain::limits::Limiters;
use crate::http::state::{Node, Phase};
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header;
use actix_web::middleware::Next;
use actix_web::{Error, HttpMessage, HttpResponse, web};

/// Probes and `/metrics`: answered before anything else, outside the chain and
/// not counted in request metrics. `/__metrics` is `/metrics` under a name
/// a routed host's upstream is unlikely to own (same answer, same auth).
pub async fn probes(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, Error> {
    let path = req.path();
    if !matches!(
        path,
        "/livez" | "/readyz" | "/startupz" | "/metrics" | "/__metrics"
    ) || req.method() != actix_web::http::Method::GET
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
/// (docs/decisions.md). HTTP/1.1 and requests without a body
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
