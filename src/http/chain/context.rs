//! What the chain's steps put on a request and read from it, below every
//! step: the request's extensions (the target namespace, the client's
//! address, the request id, the host, a routed host, an anonymous hop), the
//! header names read on every request, the matched route's policy, and how a
//! step ends a request early. The route handlers read these types too; this
//! file imports no step.

use crate::error::ApiError;
use crate::http::policy::Policy;
use actix_web::body::EitherBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderName};
use actix_web::{Error, HttpMessage, HttpResponse};
use std::net::IpAddr;

/// The namespace a request acts on, set by domain routing or authorization.
#[derive(Debug, Clone)]
pub struct Target(pub String);

/// The client's address after the trusted-proxy rule.
#[derive(Debug, Clone, Copy)]
pub struct ClientIp(pub IpAddr);

/// The request id (`X-Request-ID`), generated when the client sent none.
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

/// The request id's header, echoed on every answer.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
// Header names read on every request, built once: a lookup by `&str` parses
// the name, and a name outside the standard set is copied into a fresh
// allocation, on each call.
pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
pub const X_NAMESPACE: HeaderName = HeaderName::from_static("x-namespace");
pub const INTERNAL_PREFIX: &str = "x-internal-auth-";

/// The policy the route-policy step put on the request (unknown routes have none).
pub fn policy_of(req: &ServiceRequest) -> Option<Policy> {
    req.extensions().get::<Policy>().cloned()
}

/// The request's host: `:authority`/`Host`, lower-cased, port stripped.
/// One allocation: the routed fast path and the route-policy step both ask
/// (the first hands its answer to the second, [`RequestHost`]).
pub fn request_host(req: &ServiceRequest) -> Option<String> {
    let raw = match req.uri().authority() {
        Some(a) => a.as_str(),
        None => req.headers().get(header::HOST)?.to_str().ok()?,
    };
    Some(host_of(raw))
}

/// The host part of an authority: no user info, no port, lower-cased.
pub fn host_of(raw: &str) -> String {
    let raw = raw.rsplit('@').next().unwrap_or(raw);
    if raw.starts_with('[') {
        return match raw.find(']') {
            Some(end) => raw[..=end].to_ascii_lowercase(),
            None => format!("{}]", raw.to_ascii_lowercase()),
        };
    }
    raw.split(':').next().unwrap_or("").to_ascii_lowercase()
}

/// The request's host as `request_host` found it (set by the routed fast path
/// or the route-policy step, whichever asked first).
#[derive(Debug, Clone)]
pub struct RequestHost(pub String);

impl RequestHost {
    /// The request's host: the one an earlier step stored, else found now and
    /// stored for the steps after (`None` without a host).
    pub fn of(req: &ServiceRequest) -> Option<String> {
        if let Some(h) = req.extensions().get::<RequestHost>() {
            return Some(h.0.clone());
        }
        let h = request_host(req)?;
        req.extensions_mut().insert(RequestHost(h.clone()));
        Some(h)
    }
}

/// Put on a request whose path the canonical step refused as ambiguous but
/// whose deployment passes such paths unchanged (`pass_ambiguous_paths`):
/// the path as a decoding upstream reads it, on which the deployment's
/// routes are matched (`crate::deploy::canonical::upstream_reading`). The
/// request's own path stays as the client sent it, and goes upstream so.
#[derive(Debug, Clone)]
pub struct PathReading(pub String);

impl PathReading {
    /// The path a request's routes are matched on: the reading when the
    /// path was passed unchanged, else the (canonical) path itself.
    pub fn of<'r>(ext: &'r actix_web::dev::Extensions, path: &'r str) -> &'r str {
        ext.get::<PathReading>().map_or(path, |r| r.0.as_str())
    }
}

/// The TLS server name a connection presented (set when the node terminates TLS).
#[derive(Debug, Clone)]
pub struct Sni(pub Option<String>);

/// Put on a request by domain routing when its host belongs to a deployment.
#[derive(Debug, Clone)]
pub struct RoutedHost {
    /// The namespace owning the host's deployment: the request's target namespace.
    pub namespace: String,
    /// The request's host, as the deployment index knows it; looked up again to serve.
    pub host: String,
}

/// Put on a request that came by a valid anonymous hop (a caller without a
/// credential, forwarded by a peer): it has no identity, is not forwarded
/// again and, like any hop, is not counted against the client rate limit
/// (the node it reached first did that).
#[derive(Debug, Clone, Copy)]
pub struct AnonymousHop;

/// The subject of an anonymous hop (its namespace is empty, no real
/// namespace is): a caller without a credential on a route that takes one.
pub const ANONYMOUS_HOP: &str = "anonymous";

/// Namespace names: 1–63 of `a-z`, `0-9`, `-`, starting with a letter or digit.
pub fn valid_namespace_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
}

/// How a step ends a request before the handler.
pub enum Early {
    /// Refused: the error's envelope answers.
    Refuse(ApiError),
    /// Answered by the step itself (a CORS preflight, the dashboard's sign-in redirect).
    Answer(HttpResponse),
}

impl From<ApiError> for Early {
    fn from(e: ApiError) -> Self {
        Early::Refuse(e)
    }
}

pub fn early<B>(req: ServiceRequest, e: Early) -> ServiceResponse<EitherBody<B>> {
    match e {
        Early::Refuse(err) => refuse(req, err),
        Early::Answer(resp) => req.into_response(resp).map_into_right_body(),
    }
}

pub fn refuse<B>(req: ServiceRequest, err: ApiError) -> ServiceResponse<EitherBody<B>> {
    req.into_response(err.error_response_owned())
        .map_into_right_body()
}

/// What a step of the chain returns: the answer, the handler's or its own.
pub type Res<B> = Result<ServiceResponse<EitherBody<B>>, Error>;

#[cfg(test)]
mod tests {
    use super::{RequestHost, host_of};
    use actix_web::{HttpMessage, test::TestRequest};

    #[test]
    fn request_host_is_found_once_and_kept_for_later_steps() {
        let req = TestRequest::default()
            .insert_header(("host", "Ns-Acme.Example.com:8080"))
            .to_srv_request();
        assert_eq!(
            RequestHost::of(&req).as_deref(),
            Some("ns-acme.example.com")
        );
        assert_eq!(
            req.extensions().get::<RequestHost>().map(|h| h.0.clone()),
            Some("ns-acme.example.com".to_string()),
            "the first ask stores the host for the steps after"
        );
        // The stored value wins over the header from now on.
        req.extensions_mut()
            .insert(RequestHost("kept.example".into()));
        assert_eq!(RequestHost::of(&req).as_deref(), Some("kept.example"));
        let bare = TestRequest::default().to_srv_request();
        assert_eq!(RequestHost::of(&bare), None);
        assert!(bare.extensions().get::<RequestHost>().is_none());
    }

    #[test]
    fn host_of_strips_port_and_user_info_and_lowers_case() {
        assert_eq!(host_of("Example.COM"), "example.com");
        assert_eq!(host_of("api.example.com:8443"), "api.example.com");
        assert_eq!(
            host_of("user:pw@Ns-Acme.Example.com:80"),
            "ns-acme.example.com"
        );
        assert_eq!(host_of("[::1]:8080"), "[::1]");
        assert_eq!(host_of("[FE80::1]"), "[fe80::1]");
        assert_eq!(host_of("[::1"), "[::1]");
        assert_eq!(host_of(":80"), "");
    }
}
