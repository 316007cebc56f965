//! Forwarding a namespace's request to a member node (docs/design.md §6), the step
//! just before the handler. Served here when this node is a member (or the
//! namespace has no members, or the request already came by hop); otherwise
//! sent to the member the credential hashes to, then the others, skipping
//! members whose breaker is open. The body is read whole first (bounded by
//! [`hop_body_limit`], 413 above) because the hop MAC (V4) covers its
//! SHA-256 along with the method, path, query and identity. A member that
//! could not be connected to (refused, unreachable, or a TLS certificate not
//! signed by `peer_ca_file`) is passed over; a member reached that failed is
//! not retried. Failures of the member itself (failed or timed-out
//! connection, a 502/503/504 its gateway produced) count against its breaker.
//!
//! The namespace is the one the request acts on, except on the by-namespace
//! invoke route (`POST /v1/invoke/{namespace}/{name}`), where it is the
//! namespace the path names: that route is forwarded to the members of the
//! named namespace whoever calls, a caller without a credential included.
//! Such an anonymous call travels under an anonymous hop ([`ANONYMOUS_HOP`]),
//! which the member turns into no identity at all: it grants nothing, and the
//! member still checks that the function is public. A caller with a
//! credential travels as itself (its own namespace and grants), so a
//! credential of another namespace reaches only public functions there too.
//! Forwarding keeps nothing for the namespace on this node but its breakers
//! ([`crate::placement::Cluster::breakers`]): no namespace supervisor is started.

use crate::auth::{HopIdentity, HopRequest, canonical_json, hop_body_sha256};
use crate::deploy::proxy::{connection_listed, is_hop_by_hop, stream_response};
use crate::error::ApiError;
use crate::error::Code;
use crate::http::chain::context::{ANONYMOUS_HOP, AnonymousHop, RequestId, Target, policy_of};
use crate::http::deploy_serve::deployment_dispatch;
use crate::http::error::GATEWAY_FAULT;
use crate::http::policy::Policy;
use crate::http::request::{has_upgrade, read_limited};
use crate::http::state::Node;
use crate::identity::Identity;
use crate::placement::peer::{PeerTimeouts, hop_body_limit, peer_client};
use crate::placement::{Admit, rendezvous};
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderName, HeaderValue};
use actix_web::http::{Method, StatusCode};
use actix_web::middleware::Next;
use actix_web::{Error, HttpMessage, HttpRequest, HttpResponse};
use std::time::Duration;

/// Names the member that served a forwarded request.
pub const MEMBER_HEADER: &str = "x-meshgate-member";

/// The hop identity of an anonymous caller: no namespace, no grants.
fn anonymous_hop() -> HopIdentity {
    HopIdentity {
        namespace: String::new(),
        subject: ANONYMOUS_HOP.into(),
        custom: String::new(),
        grants: Vec::new(),
        exp: None,
        iat: None,
        jti: None,
        device: None,
        session: None,
        operator: false,
    }
}

/// The hop identity of `id` acting on `target`: the credential's own
/// namespace and grants (an operator acts on `target` with every grant).
pub(crate) fn hop_identity(id: &Identity, target: &str) -> HopIdentity {
    HopIdentity {
        namespace: if id.operator {
            target.to_string()
        } else {
            id.namespace.clone().unwrap_or_default()
        },
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
        device: id.device.clone(),
        session: id.session.clone(),
        // The member treats the forwarded operator as the operator
        // (`?secrets=reseal`, operator-only routes): the flag is in the MAC.
        operator: id.operator,
    }
}

/// The namespace a by-namespace route names in its path (the segment where
/// its pattern has `{namespace}`), when it could be a namespace name (one
/// that is not is answered here: 404 from the handler).
fn path_namespace(req: &ServiceRequest) -> Option<String> {
    let pattern = req.match_pattern()?;
    let at = pattern.split('/').position(|s| s == "{namespace}")?;
    let ns = req.path().split('/').nth(at)?;
    let plausible = !ns.is_empty()
        && ns.len() <= 64
        && ns
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    plausible.then(|| ns.to_string())
}

/// Whether a request came by hop (identified or anonymous): a hop is served
/// where it lands, never forwarded twice.
fn came_by_hop(req: &ServiceRequest) -> bool {
    let ext = req.extensions();
    ext.get::<Identity>().is_some_and(|i| i.kind == "hop") || ext.get::<AnonymousHop>().is_some()
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
    let policy = policy_of(req);
    let by_path = matches!(policy, Some(Policy::NsOrAnonymous { .. }));
    let ns_policy = by_path
        || matches!(
            policy,
            Some(Policy::Ns { .. } | Policy::NsCredential { .. })
        );
    if !ns_policy || came_by_hop(req) {
        return Ok(None);
    }
    // The by-namespace route acts on the namespace its path names, whoever
    // calls; every other route on the one authorization settled.
    let target = if by_path {
        path_namespace(req)
    } else {
        req.extensions().get::<Target>().map(|t| t.0.clone())
    };
    let Some(target) = target else {
        return Ok(None);
    };
    // Without a credential only the by-namespace route gets this far
    // (authorization refused the others).
    if req.extensions().get::<Identity>().is_none() && !by_path {
        return Ok(None);
    }
    // Sockets stay on the node they reached; the mesh carries their messages.
    if has_upgrade(req.headers()) {
        return Ok(None);
    }
    // Deployment reads are answered here: their records are in the shared
    // store, and an upstream's health is kept by each node that proxies (the
    // view of this node is the one this client's routed traffic meets).
    if req.method() == Method::GET && policy.as_ref().is_some_and(Policy::reads_deployments) {
        return Ok(None);
    }
    // A namespace that does not exist is answered here (404 from its handler).
    // The members as the namespace's owner published them (or the store's,
    // kept briefly, where no owner runs here: see `actors/records.rs`).
    let Some(record) = node.records.get(&target).await? else {
        cluster.forget_breakers(&target);
        return Ok(None);
    };
    if crate::placement::is_member(&record.members, &cluster.node_id) {
        return Ok(None);
    }
    Ok(Some((target, record.members.clone())))
}

/// Mirrors a breaker in `meshgate_breaker_state` (0 closed, 2 open).
fn set_state(n: &Node, ns: &str, member: &str, b: &crate::placement::Breakers) {
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
    let n = Node::of(req.request()).clone();
    let (target, members) = match members_elsewhere(&n, &req).await {
        Ok(Some(found)) => found,
        Ok(None) => return deployment_dispatch(req, next).await,
        Err(e) => {
            let (http, _) = req.into_parts();
            return Ok(ServiceResponse::new(http, e.error_response_owned()).map_into_right_body());
        }
    };
    let id = req.extensions().get::<Identity>().cloned();
    let (http, payload) = req.into_parts();
    // Boxed, as is the change's follow-up: a hop's future is kilobytes, and
    // inline it would make every request's chain future that large.
    let resp = match Box::pin(forward(&n, &http, payload, &target, &members, &id)).await {
        Ok(r) => r,
        Err(e) => e.error_response_owned(),
    };
    if resp.status().is_success() {
        Box::pin(after_forwarded_change(&n, &http)).await;
    }
    Ok(ServiceResponse::new(http, resp).map_into_right_body())
}

/// A change a member made for a client of this node is seen by this node at
/// once, not at its next poll: the client's next request may come here.
/// Deployments rebuild the routing index from the store's new generation;
/// a revoked key leaves this node's key cache.
async fn after_forwarded_change(n: &Node, req: &HttpRequest) {
    if matches!(*req.method(), Method::GET | Method::HEAD) {
        return;
    }
    // The route's policy says what changed: its grant's domain.
    let domain = req
        .extensions()
        .get::<Policy>()
        .and_then(Policy::grant)
        .map(|(domain, _)| domain);
    match domain {
        Some("deployments") => {
            if let Err(e) = n.deployments.follow().await {
                tracing::warn!(error = %e, "Routing index not refreshed after a forwarded change.");
            }
        }
        Some("keys") => n.key_cache.clear(),
        _ => {}
    }
}

async fn forward(
    n: &Node,
    req: &HttpRequest,
    payload: actix_web::dev::Payload,
    target: &str,
    members: &[String],
    id: &Option<Identity>,
) -> Result<HttpResponse, ApiError> {
    let cluster = n.cluster.get().expect("cluster mode");
    let key = n.hop_key.as_ref().ok_or_else(|| {
        ApiError::new(
            Code::NoClusterSecret,
            "this node has no cluster secret, so it cannot forward",
        )
    })?;
    let breakers = cluster.breakers(
        target,
        n.config.cluster.breaker_failures,
        Duration::from_secs(n.config.cluster.breaker_probe_seconds),
    );
    let hop = match id {
        Some(id) => hop_identity(id, target),
        None => anonymous_hop(),
    };
    // Sockets are never forwarded (see `members_elsewhere`), so the body is
    // a finite one: read it whole, as its digest goes into the MAC.
    // The client's body, read whole up to the hop bound (413 above, before
    // reading when its Content-Length already says so).
    let body = read_limited(req.headers(), payload, hop_body_limit(&n.config)).await?;
    let digest = hop_body_sha256(&body);
    let had_body = !body.is_empty() || req.headers().contains_key(header::CONTENT_LENGTH);
    let path = req.path();
    let query = req.query_string();
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or(path);
    let listed = connection_listed(req.headers());
    let t = PeerTimeouts::from_config(&n.config);
    let peer_ca = &n.config.cluster.peer_ca_file;
    let client = peer_client(peer_ca, t).map_err(|e| {
        tracing::error!(error = %e, "No client for other members.");
        ApiError::new(Code::NoMemberAvailable, e).retry_after(1)
    })?;
    let request_id = req.extensions().get::<RequestId>().map(|r| r.0.clone());
    let trace = req
        .extensions()
        .get::<crate::observe::trace::TraceContext>()
        .cloned();
    // With spans exported: each attempt to a member is a CLIENT span, the
    // parent the member's request continues from.
    let server = crate::telemetry::ServerSpan::of(&req.extensions());
    if let Some(s) = &server {
        s.attribute("meshgate.namespace", target.to_string());
    }
    // Anonymous callers spread by request id, so they do not all land on
    // the same member.
    let spread = match (id, &request_id) {
        (Some(id), _) => id.subject.clone(),
        (None, Some(rid)) => rid.clone(),
        (None, None) => String::new(),
    };
    for member in rendezvous(members, &spread) {
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
        if base.starts_with("https://") && peer_ca.is_empty() {
            // Public roots are never trusted for a peer: without the peers'
            // CA this member cannot be checked, so it is not used.
            n.metrics
                .forwards
                .with_label_values(&["member_unreachable"])
                .inc();
            breakers.failure(member);
            set_state(n, target, member, &breakers);
            tracing::warn!(namespace = target, member = %member, advertise = %base, "Member not forwarded to: it advertises https:// and [cluster] peer_ca_file is not set.");
            continue;
        }
        let signed = HopRequest {
            method: req.method().as_str(),
            path,
            query,
            body_sha256: &digest,
        };
        let mut creq = client
            .request(req.method().clone(), format!("{base}{pq}"))
            .no_decompress();
        for (k, v) in req.headers() {
            if k == header::HOST
                || k == header::AUTHORIZATION
                || k == header::CONTENT_LENGTH
                || k.as_str() == "x-api-key"
                || k.as_str().starts_with("x-internal-auth-")
                || k.as_str() == crate::observe::trace::TRACEPARENT
                || k.as_str() == crate::observe::trace::TRACESTATE
                || is_hop_by_hop(k, &listed)
            {
                continue;
            }
            creq = creq.append_header((k.clone(), v.clone()));
        }
        // The trace context continues on the member (this node's span as
        // the parent); it is not identity, and the hop MAC does not cover it.
        let client_span = server.as_ref().map(|s| s.client_begins(&base));
        if let Some(t) = &trace {
            let tp = match client_span {
                Some(id) => t.traceparent_from(id),
                None => t.traceparent(),
            };
            creq = creq.insert_header((crate::observe::trace::TRACEPARENT, tp));
            if let Some(ts) = &t.tracestate {
                creq = creq.insert_header((crate::observe::trace::TRACESTATE, ts.as_str()));
            }
        }
        for (k, v) in key.sign_headers(&signed, &hop, crate::util::now()) {
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
        let sent = if had_body {
            creq.send_body(body.clone()).await
        } else {
            creq.send().await
        };
        if let Some(s) = &server {
            s.client_ends(if sent.is_ok() { "answered" } else { "failed" });
            if let Ok(res) = &sent {
                s.upstream_status(res.status().as_u16());
            }
        }
        match sent {
            Ok(res) => {
                let gateway_fault = matches!(res.status().as_u16(), 502..=504)
                    && res.headers().contains_key(GATEWAY_FAULT);
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
                // Not connected (refused, unreachable, TLS handshake or
                // certificate refused): the member never saw the request,
                // and the body is still here for the next one.
                let unconnected = matches!(e, awc::error::SendRequestError::Connect(_));
                let timed_out = matches!(e, awc::error::SendRequestError::Timeout);
                if unconnected || timed_out {
                    n.metrics
                        .forwards
                        .with_label_values(&["member_unreachable"])
                        .inc();
                    breakers.failure(member);
                    set_state(n, target, member, &breakers);
                }
                tracing::warn!(namespace = target, member = %member, advertise = %base, error = %e, "Forward to a member failed.");
                if !unconnected {
                    return Err(ApiError::with_status(
                        if timed_out {
                            StatusCode::GATEWAY_TIMEOUT
                        } else {
                            StatusCode::BAD_GATEWAY
                        },
                        Code::MemberFailed,
                        format!("member {member} failed: {e}"),
                    ));
                }
            }
        }
    }
    Err(ApiError::new(
        Code::NoMemberAvailable,
        format!("no member of namespace {target} could take the request"),
    )
    .retry_after(1))
}
