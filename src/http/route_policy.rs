//! A deployment route's policy applied to a request (the types and
//! their checks: `deploy/route_policy.rs`). [`admit`] runs before the route
//! is served: the route's CORS preflight, its rate limit, and the
//! credential, checked by the chain's own `authenticate` against the
//! deployment's namespace and `require_grants`. On success the identity is
//! put on the request for the proxy ([`UpstreamView`]), which sends it as
//! `X-Meshgate-*` headers; [`Gate::finish`] puts the CORS headers on the answer.
//!
//! Whatever the route, the proxy drops a client's own `X-Meshgate-*` headers
//! (`deploy::route_policy::stripped`, called from
//! `deploy::proxy::upstream_header_lines`).

use crate::deploy::index::Bound;
use crate::deploy::route_policy::{
    self as rp, AuthMode, CorsPolicy, RateKey, RoutePolicy, UpstreamView,
};
use crate::error::{ApiError, Code};
use crate::http::state::Node;
use crate::identity::Identity;
use actix_web::http::header::{self, HeaderMap, HeaderValue};
use actix_web::http::{Method, StatusCode};
use actix_web::{HttpMessage, HttpRequest, HttpResponse};
use governor::clock::{Clock, DefaultClock};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock};

/// What [`admit`] decided: an early answer (a refusal, a preflight), and the
/// CORS override whose headers go on whatever answers.
#[derive(Default)]
pub(crate) struct Gate {
    /// Answer this instead of serving the route.
    pub early: Option<HttpResponse>,
    /// The route's CORS override and the request's allowed origin.
    cors: Option<(CorsPolicy, HeaderValue)>,
    /// The override exists but the origin is not allowed: the upstream's
    /// own CORS headers are still removed.
    cors_override: bool,
}

impl Gate {
    /// The answer with the route's CORS headers (the upstream's replaced).
    pub(crate) fn finish(self, mut resp: HttpResponse) -> HttpResponse {
        if !self.cors_override {
            return resp;
        }
        let h = resp.headers_mut();
        let upstream_cors: Vec<_> = h
            .keys()
            .filter(|k| k.as_str().starts_with("access-control-"))
            .cloned()
            .collect();
        for k in upstream_cors {
            h.remove(k);
        }
        if let Some((c, origin)) = self.cors {
            h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
            h.append(header::VARY, HeaderValue::from_static("Origin"));
            h.insert(
                header::ACCESS_CONTROL_EXPOSE_HEADERS,
                HeaderValue::from_static("x-request-id, retry-after, www-authenticate"),
            );
            if c.credentials {
                h.insert(
                    header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
                    HeaderValue::from_static("true"),
                );
            }
        }
        resp
    }
}

/// Runs the route's policy before it is served (see the module's doc). A
/// route without a policy costs one branch.
pub(crate) async fn admit(
    node: &Node,
    req: &HttpRequest,
    bound: &Bound,
    client_ip: Option<IpAddr>,
) -> Gate {
    let Some(policy) = bound.route.policy.as_ref() else {
        return Gate::default();
    };
    let mut gate = Gate::default();
    if let Some(c) = &policy.cors {
        gate.cors_override = true;
        let origin = req.headers().get(header::ORIGIN).cloned();
        let allowed = origin.filter(|o| o.to_str().is_ok_and(|s| c.allows(s)));
        let preflight = req.method() == Method::OPTIONS
            && req.headers().contains_key(header::ORIGIN)
            && req
                .headers()
                .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
        if preflight {
            gate.early = Some(match &allowed {
                Some(o) => preflight_answer(c, o.clone()),
                None => ApiError::new(Code::CorsOriginDenied, "this origin is not allowed")
                    .error_response_owned(),
            });
            // The preflight's answer is whole: `finish` leaves it as it is.
            gate.cors_override = false;
            return gate;
        }
        gate.cors = allowed.map(|o| (c.clone(), o));
    }
    if let Err(resp) = check(node, req, bound, policy, client_ip).await {
        gate.early = Some(resp);
    }
    gate
}

fn preflight_answer(c: &CorsPolicy, origin: HeaderValue) -> HttpResponse {
    let mut b = HttpResponse::NoContent();
    b.insert_header((header::ACCESS_CONTROL_ALLOW_ORIGIN, origin))
        .insert_header((header::ACCESS_CONTROL_ALLOW_METHODS, c.methods_value()))
        .insert_header((header::ACCESS_CONTROL_ALLOW_HEADERS, c.headers_value()))
        .insert_header((
            header::ACCESS_CONTROL_MAX_AGE,
            c.max_age.unwrap_or(rp::DEFAULT_CORS_MAX_AGE).to_string(),
        ))
        .insert_header((header::VARY, "Origin"));
    if c.credentials {
        b.insert_header((header::ACCESS_CONTROL_ALLOW_CREDENTIALS, "true"));
    }
    b.finish()
}

/// The rate limit, the credential, its namespace and grants; Err is the answer.
async fn check(
    node: &Node,
    req: &HttpRequest,
    bound: &Bound,
    policy: &RoutePolicy,
    client_ip: Option<IpAddr>,
) -> Result<(), HttpResponse> {
    let client = client_ip.or_else(|| req.peer_addr().map(|a| a.ip()));
    if let Some(rl) = &policy.rate_limit
        && (rl.key == RateKey::Client || policy.auth == AuthMode::None)
    {
        let key = client
            .map(super::chain::limits::bucket_key)
            .map(|ip| format!("ip:{ip}"));
        limit(node, bound, key.as_deref().unwrap_or("ip:unknown"))
            .map_err(|e| e.error_response_owned())?;
    }
    if policy.auth == AuthMode::None {
        // The client's X-Meshgate-* headers are dropped by the proxy anyway.
        return Ok(());
    }
    let (id, from_query) = authenticated(node, req, bound, policy).await?;
    // The deployment's activity ring names who made the request.
    req.extensions_mut()
        .insert(crate::observe::Subject(id.subject.clone()));
    if let Some(rl) = &policy.rate_limit
        && rl.key == RateKey::Subject
    {
        limit(node, bound, &format!("sub:{}", id.subject)).map_err(|e| e.error_response_owned())?;
    }
    let mut headers = vec![
        (rp::H_NAMESPACE, bound.namespace.clone()),
        (rp::H_SUBJECT, id.subject.clone()),
        (
            rp::H_GRANTS,
            id.grants
                .iter()
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                .join(","),
        ),
    ];
    if id.kind == "api_key"
        && let Some(name) = key_name(node, req).await
    {
        headers.push((rp::H_KEY_NAME, name));
    }
    // A subject or key name that cannot stand in a header is not sent at all.
    if headers
        .iter()
        .any(|(_, v)| HeaderValue::from_str(v).is_err())
    {
        return Err(ApiError::new(
            Code::MalformedToken,
            "the credential's subject cannot be sent upstream",
        )
        .error_response_owned());
    }
    req.extensions_mut().insert(Arc::new(UpstreamView {
        headers,
        strip_credentials: !policy.forward_credentials,
        strip_query_token: from_query && !policy.forward_credentials,
        credential: id.may_end().then(|| id.clone()),
    }));
    Ok(())
}

/// The presented credential of a request, and whether it came as
/// `?token=`: a header (see [`credential`]), else on a WebSocket upgrade
/// the `token` query parameter (browsers cannot set headers on a
/// WebSocket), as the node's own socket endpoints read it.
fn request_credential(req: &HttpRequest) -> Option<(String, bool)> {
    if let Some(c) = credential(req.headers()) {
        return Some((c, false));
    }
    if !crate::http::request::is_websocket_upgrade(req.headers()) {
        return None;
    }
    actix_web::web::Query::<HashMap<String, String>>::from_query(req.query_string())
        .ok()
        .and_then(|q| q.get("token").map(|t| t.trim().to_string()))
        .filter(|t| !t.is_empty())
        .map(|t| (t, true))
}

/// The presented credential: `Authorization` (Bearer, or the bare value) or `X-API-Key`.
fn credential(h: &HeaderMap) -> Option<String> {
    if let Some(v) = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        let t = v
            .strip_prefix("Bearer ")
            .or_else(|| v.strip_prefix("bearer "))
            .unwrap_or(v)
            .trim();
        return (!t.is_empty() && !t.eq_ignore_ascii_case("bearer")).then(|| t.to_string());
    }
    h.get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// A 401 with `WWW-Authenticate` (`invalid_token` when one was presented).
fn unauthorized(e: ApiError, host: &str, presented: bool) -> HttpResponse {
    if e.status != StatusCode::UNAUTHORIZED {
        return e.error_response_owned();
    }
    let mut resp = e.error_response_owned();
    let realm: String = host
        .split(':')
        .next()
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-'))
        .collect();
    let v = if presented {
        format!("Bearer realm=\"{realm}\", error=\"invalid_token\"")
    } else {
        format!("Bearer realm=\"{realm}\"")
    };
    if let Ok(v) = HeaderValue::from_str(&v) {
        resp.headers_mut().insert(header::WWW_AUTHENTICATE, v);
    }
    resp
}

/// The credential's identity, checked against the route: 401 without one or
/// with one that does not hold or is of a kind the route does not take, 403
/// for another namespace's (or the operator's) or without the grants. With
/// it, whether the credential came as `?token=`.
async fn authenticated(
    node: &Node,
    req: &HttpRequest,
    bound: &Bound,
    policy: &RoutePolicy,
) -> Result<(Identity, bool), HttpResponse> {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("meshgate");
    let Some((cred, from_query)) = request_credential(req) else {
        let what = match policy.auth {
            AuthMode::ApiKey => "an API key (X-API-Key or Authorization: Bearer)",
            AuthMode::Jwt => "a token (Authorization: Bearer)",
            _ => "an API key or a token",
        };
        return Err(unauthorized(
            ApiError::new(Code::MissingCredential, format!("this route needs {what}")),
            host,
            false,
        ));
    };
    let id = super::chain::access::authenticate(node, &cred)
        .await
        .map_err(|e| unauthorized(e, host, true))?;
    if id.operator || id.namespace.as_deref() != Some(bound.namespace.as_str()) {
        return Err(ApiError::new(
            Code::NamespaceMismatch,
            format!(
                "this route takes credentials of namespace {} only",
                bound.namespace
            ),
        )
        .error_response_owned());
    }
    if !policy.auth.accepts(id.kind) {
        return Err(unauthorized(
            ApiError::new(
                Code::MissingCredential,
                format!(
                    "this route takes auth {:?}; a credential of kind {} was presented",
                    policy.auth.as_str(),
                    id.kind
                ),
            ),
            host,
            true,
        ));
    }
    if let Some(missing) = policy
        .require_grants
        .iter()
        .find(|g| !crate::auth::grants_cover(&id.grants, std::slice::from_ref(*g)))
    {
        return Err(ApiError::new(
            Code::MissingGrant,
            format!("this route needs the grant {missing}"),
        )
        .error_response_owned());
    }
    Ok((id, from_query))
}

/// An API key's name (its label), read from its record and remembered a
/// minute (its validity is `authenticate`'s, checked on every request).
async fn key_name(node: &Node, req: &HttpRequest) -> Option<String> {
    /// Key HMAC to its name and when it was read (Unix seconds).
    type Names = HashMap<[u8; 32], (String, u64)>;
    static NAMES: LazyLock<Mutex<Names>> = LazyLock::new(Default::default);
    const KEEP_SECONDS: u64 = 60;
    let (cred, _) = request_credential(req)?;
    let hash = node.secrets.api_key_hash(&cred);
    let t = crate::util::now();
    let fresh = |at: u64| t.saturating_sub(at) < KEEP_SECONDS;
    if let Some((n, at)) = NAMES.lock().get(&hash)
        && fresh(*at)
    {
        return Some(n.clone());
    }
    let r = crate::identity::lookup_key_hash(&node.store, &hash, t)
        .await
        .ok()?;
    let mut names = NAMES.lock();
    if names.len() >= 4096 {
        names.retain(|_, (_, at)| fresh(*at));
        if names.len() >= 4096 {
            names.clear();
        }
    }
    names.insert(hash, (r.name.clone(), t));
    Some(r.name)
}

/// Idle keys of a route's bucket are dropped every this many checks.
const EVICT_EVERY: u64 = 4096;

/// Charges the route's bucket (built with the index, on the route's
/// [`Bound`]: no lock of the node's is taken) for `key`; Err is the 429
/// with `Retry-After`.
fn limit(node: &Node, bound: &Bound, key: &str) -> Result<(), ApiError> {
    let Some(bucket) = bound.bucket.as_deref() else {
        // Every route with a `rate_limit` gets its bucket with the index.
        debug_assert!(false, "a rate-limited route without its bucket");
        return Ok(());
    };
    if bucket.checks.fetch_add(1, Ordering::Relaxed) % EVICT_EVERY == EVICT_EVERY - 1 {
        bucket.limiter.retain_recent();
    }
    bucket.limiter.check_key(&key.to_string()).map_err(|nu| {
        let after = nu
            .wait_time_from(DefaultClock::default().now())
            .as_secs_f64()
            .ceil()
            .max(1.0) as u64;
        node.metrics
            .rate_limited
            .with_label_values(&["route"])
            .inc();
        ApiError::rate_limited(Code::RouteRateLimited, after)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bearer, a bare Authorization value and X-API-Key are read; empty ones are not.
    #[test]
    fn credentials_are_read() {
        let mut h = HeaderMap::new();
        assert_eq!(credential(&h), None);
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer abc"),
        );
        assert_eq!(credential(&h).as_deref(), Some("abc"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer"));
        assert_eq!(credential(&h), None);
        let mut h = HeaderMap::new();
        h.insert(
            header::HeaderName::from_static("x-api-key"),
            HeaderValue::from_static(" mg_x "),
        );
        assert_eq!(credential(&h).as_deref(), Some("mg_x"));
    }
}
