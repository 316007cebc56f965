//! The reverse proxy of upstream deployments, its request driver: the
//! healthy instances in round-robin order ([`super::pool`]), one client per
//! request kind (a plain-HTTP request without a body through
//! [`super::wire`], with one through [`super::h1`], a pool with an
//! `https://` instance through [`super::awc_client`], a WebSocket upgrade
//! through [`super::relay`]), and ONE retry loop for all of them
//! ([`over_instances`]): another instance is tried only when the connection
//! failed before anything was sent. Every connection goes through the
//! egress policy: names resolve through it, and literal addresses are
//! checked before each attempt. The header rules are in [`super::headers`].

use super::egress::forbidden_at_connect;
use super::h1::{ConnectFailure, Exchange};
use super::headers::BodyKind;
use crate::error::ApiError;
use crate::error::Code;
use actix_web::{HttpRequest, HttpResponse, dev::Payload};
use std::cell::RefCell;
use std::rc::Rc;

// The names the rest of the node knows the proxy by.
pub(crate) use super::awc_client::stream_response;
pub use super::headers::Forwarded;
pub(crate) use super::headers::{connection_listed, is_hop_by_hop};
pub use super::pool::{Instance, ProxyTimeouts, UpstreamPool};

/// Proxies one HTTP request to the pool (WebSocket upgrades go to [`proxy_ws`]).
pub async fn proxy_http(
    req: &HttpRequest,
    payload: Payload,
    pool: &UpstreamPool,
    path_and_query: &str,
    fwd: &Forwarded,
    t: ProxyTimeouts,
) -> Result<HttpResponse, ApiError> {
    let order = pool.pick(Some(req), fwd.client_ip);
    if order.is_empty() {
        return Err(ApiError::new(
            Code::NoHealthyUpstream,
            "every instance of this upstream is unhealthy",
        )
        .retry_after(1));
    }
    if pool.plain() {
        return proxy_h1(req, payload, pool, order, path_and_query, fwd, t).await;
    }
    // Boxed: awc's exchange is large, and kept out of the plain path's future.
    Box::pin(proxy_awc(req, payload, pool, order, path_and_query, fwd, t)).await
}

/// [`proxy_http`] through awc (a pool with an `https://` instance). The
/// client's body goes to the one attempt that polls it: after that no other
/// instance is tried.
async fn proxy_awc(
    req: &HttpRequest,
    payload: Payload,
    pool: &UpstreamPool,
    order: Vec<usize>,
    path_and_query: &str,
    fwd: &Forwarded,
    t: ProxyTimeouts,
) -> Result<HttpResponse, ApiError> {
    use super::awc_client::{attempt, body_untouched, upstream_client};
    let kind = super::headers::body_kind(req);
    let slot = Rc::new(RefCell::new(Some(payload)));
    let client = upstream_client(t, &pool.egress);
    over_instances(
        pool,
        order,
        async |inst| attempt(&client, req, inst, path_and_query, fwd, kind, &slot).await,
        || body_untouched(kind, &slot),
    )
    .await
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
    let body = match super::headers::body_kind(req) {
        BodyKind::None => {
            let a = over_instances(
                pool,
                order,
                async |inst| super::wire::attempt(req, pool, inst, path_and_query, fwd, t).await,
                || true,
            )
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
    *hreq.headers_mut() = super::headers::h1_headers(req, fwd);
    let mut pending = Some(hreq);
    // Boxed: hyper's exchange is large, and kept out of the bodiless path's future.
    let res = Box::pin(over_instances(
        pool,
        order,
        async |inst| {
            // Each attempt names its own CLIENT span as the parent.
            if crate::telemetry::enabled()
                && let (Some(r), Some(tc)) = (pending.as_mut(), &fwd.trace)
                && let Ok(v) =
                    hyper::header::HeaderValue::from_str(&super::activity::traceparent(tc))
            {
                r.headers_mut().insert("traceparent", v);
            }
            super::h1::exchange(pool, inst, &mut pending, t).await
        },
        || true,
    ))
    .await?;
    Ok(super::h1::into_response(req, res))
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
    ends: Option<super::relay::Ends>,
) -> Result<HttpResponse, ApiError> {
    use actix_web::FromRequest;
    let payload = actix_web::web::Payload::from_request(req, &mut payload)
        .await
        .map_err(|e| ApiError::new(Code::BadUpgrade, e.to_string()))?;
    let order = pool.pick(Some(req), fwd.client_ip);
    if order.is_empty() {
        return Err(ApiError::new(
            Code::NoHealthyUpstream,
            "every instance of this upstream is unhealthy",
        )
        .retry_after(1));
    }
    let client = super::awc_client::upstream_client(t, &pool.egress);
    let (protocol, upstream) = over_instances(
        pool,
        order,
        async |inst| {
            // Built per attempt: each names its own CLIENT span as the parent.
            let headers = super::headers::upstream_headers(req, fwd);
            super::relay::handshake(&client, inst, &headers, path_and_query).await
        },
        || true,
    )
    .await?;
    super::relay::accept(req, payload, protocol, upstream, ends)
}

/// The one retry loop: tries the instances in `order` (those the egress
/// policy refuses skipped) until one answers. An instance that could not be
/// connected counts against its health and the next is tried, while
/// `may_retry` says the request can still be sent whole (awc: the body was
/// not taken); a timeout or a failure after the request went out ends the
/// request (never sent twice).
pub(crate) async fn over_instances<T>(
    pool: &UpstreamPool,
    order: Vec<usize>,
    mut attempt: impl AsyncFnMut(&Instance) -> Exchange<T>,
    may_retry: impl Fn() -> bool,
) -> Result<T, ApiError> {
    let mut last_err = None;
    let mut forbidden = None;
    for i in order {
        if let Some(r) = pool.refused(i) {
            forbidden = Some(r);
            continue;
        }
        let inst = &pool.instances[i];
        // In flight until its answer's head (for `least_request`).
        let _in_flight = pool.start(i);
        super::activity::attempt_begins(&inst.base);
        let exchange = attempt(inst).await;
        super::activity::attempted(&inst.base, outcome(&exchange));
        match exchange {
            Exchange::Answered(res) => {
                pool.succeeded(i);
                return Ok(res);
            }
            Exchange::NotConnected(ConnectFailure::Refused(r)) => {
                // A policy refusal, not a health failure; nothing was sent.
                tracing::warn!(instance = %inst.base, refusal = %r, "Upstream refused by the egress policy.");
                forbidden = Some(r);
            }
            Exchange::NotConnected(ConnectFailure::Failed(e)) => {
                pool.failed(i);
                tracing::warn!(instance = %inst.base, error = %e, "Upstream connection failed.");
                last_err = Some(e);
                if !may_retry() {
                    break;
                }
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
            Exchange::Ended(e) => return Err(e),
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

/// The `outcome` label of one exchange with an instance.
fn outcome<T>(e: &super::h1::Exchange<T>) -> &'static str {
    use super::h1::{ConnectFailure, Exchange};
    match e {
        Exchange::Answered(_) => "answered",
        Exchange::NotConnected(ConnectFailure::Refused(_)) => "refused",
        Exchange::NotConnected(ConnectFailure::Failed(_)) => "connect_failed",
        Exchange::TimedOut => "timeout",
        Exchange::Failed(_) | Exchange::Ended(_) => "failed",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deploy::pool::tests::{echo_upstream, loopback_policy, pool};
    use std::time::Duration;

    fn three() -> UpstreamPool {
        pool(
            &[
                "http://127.0.0.1:1",
                "http://127.0.0.1:2",
                "http://127.0.0.1:3",
            ],
            1,
            Duration::from_secs(3600),
        )
    }

    fn failed_conn<T>() -> Exchange<T> {
        Exchange::NotConnected(ConnectFailure::Failed("refused".into()))
    }

    /// Instances that could not be connected count against their health and
    /// the next is tried; the one that answers is healthy.
    #[actix_rt::test]
    async fn the_loop_moves_on_only_when_nothing_was_sent() {
        let p = three();
        let mut tried = Vec::new();
        let r = over_instances(
            &p,
            vec![0, 1, 2],
            async |inst| {
                tried.push(inst.base.clone());
                if tried.len() < 3 {
                    failed_conn()
                } else {
                    Exchange::Answered(7)
                }
            },
            || true,
        )
        .await;
        assert_eq!(r.unwrap(), 7);
        assert_eq!(tried.len(), 3);
        let h = p.health();
        assert!(!h[0].1 && !h[1].1 && h[2].1, "{h:?}");
        // All down: unavailable, with the last error.
        let p = three();
        let e = over_instances(&p, vec![0, 1, 2], async |_| failed_conn::<()>(), || true)
            .await
            .unwrap_err();
        assert!(matches!(e.code, Code::UpstreamUnavailable), "{e:?}");
        assert!(e.message.ends_with("refused"));
    }

    /// A timeout, a failure after sending and an error of the client end
    /// the request at once; only the timeout counts against health.
    #[actix_rt::test]
    async fn the_loop_never_sends_twice() {
        for (ex, code, health) in [
            (Exchange::TimedOut, Code::UpstreamTimeout, 1),
            (Exchange::Failed("reset".into()), Code::UpstreamFailed, 0),
            (
                Exchange::Ended(ApiError::new(Code::BadUpgrade, "no")),
                Code::BadUpgrade,
                0,
            ),
        ] {
            let p = three();
            let mut ex = Some(ex);
            let mut calls = 0;
            let e = over_instances(
                &p,
                vec![0, 1, 2],
                async |_| {
                    calls += 1;
                    ex.take().unwrap_or(Exchange::Answered(()))
                },
                || true,
            )
            .await
            .unwrap_err();
            assert_eq!(e.code.as_str(), code.as_str());
            assert_eq!(calls, 1);
            assert_eq!(p.health()[0].2, health);
        }
        // A body already taken (awc) stops the loop after a failed connection.
        let p = three();
        let mut calls = 0;
        let e = over_instances(
            &p,
            vec![0, 1, 2],
            async |_| {
                calls += 1;
                failed_conn::<()>()
            },
            || false,
        )
        .await
        .unwrap_err();
        assert!(matches!(e.code, Code::UpstreamUnavailable));
        assert_eq!(calls, 1);
    }

    /// Literal addresses the policy refuses are never attempted; a refusal
    /// (literal or resolved) is the answer when no instance answered, and
    /// never counts against health.
    #[actix_rt::test]
    async fn refusals_are_skipped_and_reported() {
        let strict = std::sync::Arc::new(super::super::egress::EgressPolicy::from_config(
            &crate::config::DeployConfig::default(),
        ));
        let bases = vec![
            "http://10.0.0.1:80".to_string(),
            "http://app.test:80".to_string(),
        ];
        let p = UpstreamPool::new(&bases, strict, 1, Duration::from_secs(60));
        let mut tried = Vec::new();
        let e = over_instances(
            &p,
            vec![0, 1],
            async |inst| {
                tried.push(inst.base.clone());
                failed_conn::<()>()
            },
            || true,
        )
        .await
        .unwrap_err();
        assert_eq!(tried, vec!["http://app.test:80"]);
        assert!(matches!(e.code, Code::UpstreamForbidden), "{e:?}");
        let p = UpstreamPool::new(&bases, loopback_policy(), 1, Duration::from_secs(60));
        let refusal = p.egress.check_addr("127.0.0.1".parse().unwrap(), 1);
        assert!(refusal.is_ok());
        let strict = super::super::egress::EgressPolicy::from_config(
            &crate::config::DeployConfig::default(),
        );
        let r = strict
            .check_addr("127.0.0.1".parse().unwrap(), 1)
            .unwrap_err();
        let e = over_instances(
            &p,
            vec![1],
            async |_| Exchange::<()>::NotConnected(ConnectFailure::Refused(r.clone())),
            || true,
        )
        .await
        .unwrap_err();
        assert!(matches!(e.code, Code::UpstreamForbidden));
        assert!(p.health().iter().all(|h| h.1 && h.2 == 0));
    }

    /// Through each plain client (wire without a body, hyper with one) a
    /// request passes a closed port and reaches the live instance.
    #[actix_rt::test]
    async fn requests_reach_a_live_instance_past_a_closed_one() {
        use actix_web::test::TestRequest;
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let (port, _accepted, task) = echo_upstream().await;
        let p = pool(
            &[
                &format!("http://127.0.0.1:{closed}"),
                &format!("http://127.0.0.1:{port}"),
            ],
            1,
            Duration::from_secs(3600),
        );
        let fwd = Forwarded {
            client_ip: Some("10.9.8.7".parse().unwrap()),
            peer: None,
            proto: "http",
            host: "app.test".into(),
            request_id: None,
            trace: None,
        };
        let t = ProxyTimeouts {
            connect: Duration::from_secs(10),
            response: Duration::from_secs(30),
        };
        for (req, want) in [
            (TestRequest::get().uri("/a?b"), "GET /a?b HTTP/1.1 "),
            (
                TestRequest::post()
                    .uri("/p")
                    .insert_header(("content-length", "4"))
                    .set_payload("body"),
                "POST /p HTTP/1.1 body",
            ),
        ] {
            let (req, payload) = req.to_http_parts();
            let res = proxy_http(
                &req,
                payload,
                &p,
                req.uri().path_and_query().unwrap().as_str(),
                &fwd,
                t,
            )
            .await
            .unwrap();
            assert_eq!(res.status(), actix_web::http::StatusCode::OK);
            assert_eq!(res.headers().get("x-saw-proto").unwrap(), "true");
            assert!(res.headers().get("x-hop").is_none());
            let body = actix_web::body::to_bytes(res.into_body())
                .await
                .ok()
                .unwrap();
            assert_eq!(&body[..], want.as_bytes());
        }
        // The closed port was tried (once per request, order permitting) and marked down.
        assert!(!p.health()[0].1);
        assert!(p.health()[1].1);
        task.abort();
    }
}
