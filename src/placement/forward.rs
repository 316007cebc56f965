//! Forwarding a namespace's request to a member node (DESIGN.md §6), the step
//! just before the handler. Served here when this node is a member (or the
//! namespace has no members, or the request already came by hop); otherwise
//! sent to the member the credential hashes to, then the others, skipping
//! members whose breaker is open. A member that refused the connection is
//! passed over while no body was sent; a member reached that failed is not
//! retried. Failures of the member itself (refused or timed-out connection,
//! a 502/503/504 its gateway produced) count against its breaker.

use super::{Admit, rendezvous};
use crate::auth::{HopIdentity, HopVersion, canonical_json};
use crate::deploy::proxy::{
    ProxyTimeouts, body_kind, body_untouched, client, connection_listed, is_hop_by_hop, send_once,
    stream_response,
};
use crate::http::{ApiError, Identity, Policy, Target};
use crate::node::Node;
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{Error, HttpMessage, HttpRequest, HttpResponse, web};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

/// Names the member that served a forwarded request.
pub const MEMBER_HEADER: &str = "x-meshgate-member";

fn node(req: &ServiceRequest) -> Node {
    req.app_data::<web::Data<Node>>()
        .expect("node data")
        .get_ref()
        .clone()
}

/// The hop identity for `target` (an operator acts with every grant there).
fn hop_identity(id: &Identity, target: &str) -> HopIdentity {
    HopIdentity {
        namespace: target.to_string(),
        subject: id.subject.clone(),
        custom: if id.custom.is_null() {
            String::new()
        } else {
            canonical_json(&id.custom)
        },
        grants: if id.operator {
            vec!["*:*:*".into()]
        } else {
            id.grants.iter().map(|g| g.to_string()).collect()
        },
        exp: id.exp,
        iat: id.iat,
        jti: id.jti.clone(),
        device: None,
        session: None,
    }
}

/// The members a request for `ns` should go to, or None to serve it here.
/// A store failure is the request's answer (503): serving a namespace here
/// without knowing its members could split it.
async fn members_elsewhere(
    node: &Node,
    req: &ServiceRequest,
) -> Result<Option<(String, Vec<String>)>, ApiError> {
    let Some(cluster) = node.cluster.get() else {
        return Ok(None);
    };
    let ns_policy = matches!(
        crate::http::policy_of(req),
        Some(Policy::Ns { .. } | Policy::NsOrAnonymous { .. } | Policy::NsCredential { .. })
    );
    if !ns_policy {
        return Ok(None);
    }
    let Some(target) = req.extensions().get::<Target>().map(|t| t.0.clone()) else {
        return Ok(None);
    };
    let Some(kind) = req.extensions().get::<Identity>().map(|i| i.kind) else {
        return Ok(None);
    };
    // A hop is served where it lands: never forwarded twice.
    if kind == "hop" {
        return Ok(None);
    }
    // Sockets stay on the node they reached; the mesh carries their messages.
    if req.headers().contains_key(header::UPGRADE) {
        return Ok(None);
    }
    // A namespace that does not exist is answered here (404 from its handler).
    let Some(members) = cluster.members(&target).await? else {
        return Ok(None);
    };
    if members.is_empty() || members.iter().any(|m| *m == cluster.node_id) {
        return Ok(None);
    }
    Ok(Some((target, members)))
}

/// Mirrors a breaker in `meshgate_breaker_state` (0 closed, 2 open).
fn set_state(n: &Node, ns: &str, member: &str, b: &super::Breakers) {
    n.metrics
        .breaker_state
        .with_label_values(&[ns, member])
        .set(if b.is_open(member) { 2 } else { 0 });
}

/// The forwarding step.
pub async fn cluster_forward<B: MessageBody + 'static>(
    req: ServiceRequest,
    next: Next<B>,
) -> Result<ServiceResponse<EitherBody<B>>, Error> {
    let n = node(&req);
    let (target, members) = match members_elsewhere(&n, &req).await {
        Ok(Some(found)) => found,
        Ok(None) => {
            return next
                .call(req)
                .await
                .map(ServiceResponse::map_into_left_body);
        }
        Err(e) => {
            let (http, _) = req.into_parts();
            return Ok(ServiceResponse::new(http, e.error_response_owned()).map_into_right_body());
        }
    };
    let id = req
        .extensions()
        .get::<Identity>()
        .cloned()
        .expect("checked");
    let (http, payload) = req.into_parts();
    let resp = match forward(&n, &http, payload, &target, &members, &id).await {
        Ok(r) => r,
        Err(e) => e.error_response_owned(),
    };
    Ok(ServiceResponse::new(http, resp).map_into_right_body())
}

async fn forward(
    n: &Node,
    req: &HttpRequest,
    payload: actix_web::dev::Payload,
    target: &str,
    members: &[String],
    id: &Identity,
) -> Result<HttpResponse, ApiError> {
    let cluster = n.cluster.get().expect("cluster mode");
    let key = n.hop_key.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "NO_CLUSTER_SECRET",
            "this node has no cluster secret, so it cannot forward",
        )
    })?;
    let handle = n.locate(target).await?;
    let breakers = handle.breakers.clone();
    let hop = hop_identity(id, target);
    let path = req.path();
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or(path);
    let listed = connection_listed(req.headers());
    let kind = body_kind(req);
    let slot = Rc::new(RefCell::new(Some(payload)));
    let t = ProxyTimeouts {
        connect: Duration::from_secs(n.config.deploy.connect_timeout_seconds),
        response: Duration::from_secs(n.config.deploy.upstream_timeout_seconds),
    };
    let client = client(t);
    let request_id = req
        .extensions()
        .get::<crate::http::RequestId>()
        .map(|r| r.0.clone());
    for member in rendezvous(members, &id.subject) {
        match breakers.admit(member) {
            Admit::No => {
                n.metrics
                    .forwards
                    .with_label_values(&["skipped_open"])
                    .inc();
                tracing::info!(namespace = target, member = %member, "Member skipped: its breaker is open.");
                continue;
            }
            Admit::Probe => {
                tracing::info!(namespace = target, member = %member, "Probing a member with an open breaker.");
            }
            Admit::Yes => {}
        }
        let Some(base) = cluster.address_of(member).await else {
            breakers.failure(member);
            continue;
        };
        let now = crate::http::now();
        let mac = key.sign(HopVersion::V3, req.method().as_str(), path, &hop, now);
        let mut creq = client
            .request(req.method().clone(), format!("{base}{pq}"))
            .no_decompress();
        for (k, v) in req.headers() {
            if k == header::HOST
                || k == header::AUTHORIZATION
                || k.as_str() == "x-api-key"
                || k.as_str().starts_with("x-internal-auth-")
                || is_hop_by_hop(k, &listed)
            {
                continue;
            }
            creq = creq.append_header((k.clone(), v.clone()));
        }
        for (k, v) in crate::auth::hop_to_headers(&hop, HopVersion::V3, &mac) {
            if let (Ok(k), Ok(v)) = (
                HeaderName::from_bytes(k.as_bytes()),
                HeaderValue::from_str(&v),
            ) {
                creq = creq.insert_header((k, v));
            }
        }
        if let Some(rid) = &request_id {
            creq = creq.insert_header(("x-request-id", rid.as_str()));
        }
        let sent = send_once(creq, kind, &slot).await;
        match sent {
            Ok(res) => {
                let gateway_fault = matches!(res.status().as_u16(), 502..=504)
                    && res.headers().contains_key(crate::http::GATEWAY_FAULT);
                if gateway_fault {
                    n.metrics
                        .forwards
                        .with_label_values(&["member_failed"])
                        .inc();
                    breakers.failure(member);
                } else {
                    n.metrics.forwards.with_label_values(&["ok"]).inc();
                    breakers.success(member);
                }
                set_state(n, target, member, &breakers);
                let mut out = stream_response(req, res);
                if let Ok(v) = HeaderValue::from_str(member) {
                    out.headers_mut()
                        .insert(HeaderName::from_static(MEMBER_HEADER), v);
                }
                return Ok(out);
            }
            Err(e) => {
                let refused = matches!(e, awc::error::SendRequestError::Connect(_));
                let timed_out = matches!(e, awc::error::SendRequestError::Timeout);
                if refused || timed_out {
                    n.metrics
                        .forwards
                        .with_label_values(&["member_unreachable"])
                        .inc();
                    breakers.failure(member);
                    set_state(n, target, member, &breakers);
                }
                tracing::warn!(namespace = target, member = %member, error = %e, "Forward to a member failed.");
                if !refused || !body_untouched(kind, &slot) {
                    return Err(ApiError::new(
                        if timed_out {
                            StatusCode::GATEWAY_TIMEOUT
                        } else {
                            StatusCode::BAD_GATEWAY
                        },
                        "MEMBER_FAILED",
                        format!("member {member} failed: {e}"),
                    ));
                }
            }
        }
    }
    Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "NO_MEMBER_AVAILABLE",
        format!("no member of namespace {target} could take the request"),
    )
    .retry_after(1))
}
