//! A deployment route's policy (docs/deployments.md "Route
//! policy"): who may call the route (`auth`, `require_grants`), whether the
//! credential goes on to the upstream, the route's own CORS answers and its
//! own rate limit. Pure: the types, their JSON form and their checks. The
//! request side is `http/route_policy.rs`.
//!
//! A deployment's `policy` is its routes' default: at deploy time it is
//! copied into every route without a `policy` of its own ([`apply_default`]),
//! so a stored version holds each route's effective policy.

#![forbid(unsafe_code)]

use super::model::RouteSpec;
use crate::auth::Grant;
use crate::error::{ApiError, Code};
use serde::{Deserialize, Serialize};

/// Most grants one route may require.
pub const MAX_REQUIRED_GRANTS: usize = 16;
/// Most origins, methods or headers of one route's CORS override.
pub const MAX_CORS_ENTRIES: usize = 32;
/// Longest `max_age` a preflight answer may carry, in seconds (one day).
pub const MAX_CORS_MAX_AGE: u32 = 86_400;
/// Highest `requests_per_second` and `burst` of a route's rate limit.
pub const MAX_RATE: u32 = 1_000_000;
/// The preflight's `Access-Control-Max-Age` when the override sets none.
pub const DEFAULT_CORS_MAX_AGE: u32 = 600;
/// Request headers a preflight allows when the override lists none.
pub const DEFAULT_CORS_HEADERS: &[&str] = &["authorization", "content-type", "x-api-key"];
/// Methods a preflight allows when the override lists none.
pub const DEFAULT_CORS_METHODS: &[&str] = &["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"];

/// Which credential a route takes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthMode {
    /// No credential is read; `Authorization` belongs to the upstream (today's behaviour).
    #[default]
    None,
    /// An API key of the deployment's namespace (`X-API-Key` or `Authorization: Bearer`).
    ApiKey,
    /// A JWT issued for the deployment's namespace (`Authorization: Bearer`).
    Jwt,
    /// Either of the two.
    Any,
}

impl AuthMode {
    /// The name used in the JSON form and in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            AuthMode::None => "none",
            AuthMode::ApiKey => "api_key",
            AuthMode::Jwt => "jwt",
            AuthMode::Any => "any",
        }
    }

    /// Whether an identity of this kind (`api_key`, `jwt`, ...) is accepted.
    pub fn accepts(self, kind: &str) -> bool {
        match self {
            AuthMode::None => false,
            AuthMode::ApiKey => kind == "api_key",
            AuthMode::Jwt => kind == "jwt",
            AuthMode::Any => kind == "api_key" || kind == "jwt",
        }
    }
}

/// What a route's rate limit is keyed by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RateKey {
    /// The client's address (an IPv6 /64), as the node's own client bucket.
    #[default]
    Client,
    /// The authenticated subject (needs `auth` other than `none`).
    Subject,
}

/// A route's own token bucket, on top of the node's client and namespace buckets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitPolicy {
    /// Sustained rate, 1 to [`MAX_RATE`].
    pub requests_per_second: u32,
    /// Requests allowed at once, 1 to [`MAX_RATE`]; `requests_per_second` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// One bucket per client address, or per subject.
    #[serde(default)]
    pub key: RateKey,
}

impl RateLimitPolicy {
    /// The burst in effect.
    pub fn burst(&self) -> u32 {
        self.burst.unwrap_or(self.requests_per_second)
    }
}

/// A route's CORS override: meshgate answers the route's preflights and puts
/// these headers on its answers (the upstream's own `Access-Control-*` headers
/// are replaced).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CorsPolicy {
    /// Allowed origins, `scheme://host[:port]` (lower-cased), or `*` (not with `credentials`).
    pub origins: Vec<String>,
    /// Methods a preflight allows; [`DEFAULT_CORS_METHODS`] when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    /// Request headers a preflight allows (lower-cased); [`DEFAULT_CORS_HEADERS`] when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<String>,
    /// Sends `Access-Control-Allow-Credentials: true`.
    #[serde(default)]
    pub credentials: bool,
    /// Seconds a browser may cache a preflight; [`DEFAULT_CORS_MAX_AGE`] when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age: Option<u32>,
}

impl CorsPolicy {
    /// Whether `origin` (the request's `Origin` header) is allowed.
    pub fn allows(&self, origin: &str) -> bool {
        self.origins.iter().any(|o| o == "*" || o == origin)
    }

    /// `Access-Control-Allow-Methods` of a preflight answer.
    pub fn methods_value(&self) -> String {
        if self.methods.is_empty() {
            DEFAULT_CORS_METHODS.join(", ")
        } else {
            self.methods.join(", ")
        }
    }

    /// `Access-Control-Allow-Headers` of a preflight answer.
    pub fn headers_value(&self) -> String {
        if self.headers.is_empty() {
            DEFAULT_CORS_HEADERS.join(", ")
        } else {
            self.headers.join(", ")
        }
    }
}

/// A route's policy; every field optional. `{}` is `auth: none`, today's behaviour.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutePolicy {
    /// Which credential the route takes.
    #[serde(default)]
    pub auth: AuthMode,
    /// Grants (the API's grant language) the credential must all hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub require_grants: Vec<Grant>,
    /// Keep `Authorization` and `X-API-Key` on the way to the upstream (when `auth` is not `none`).
    #[serde(default)]
    pub forward_credentials: bool,
    /// The route's CORS override.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cors: Option<CorsPolicy>,
    /// The route's own rate limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimitPolicy>,
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::new(Code::InvalidPolicy, message)
}

/// `scheme://host[:port]`, lower-cased: http(s), a DNS name or an address, no
/// path, query, user or trailing slash. None when `raw` is not an origin.
pub fn normalize_origin(raw: &str) -> Option<String> {
    let o = raw.trim().to_ascii_lowercase();
    let (scheme, rest) = o.split_once("://")?;
    if !matches!(scheme, "http" | "https") || rest.is_empty() {
        return None;
    }
    let (host, port) = if rest.starts_with('[') {
        let end = rest.find(']')?;
        let inner = &rest[1..end];
        if inner.is_empty()
            || !inner
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        {
            return None;
        }
        let after = &rest[end + 1..];
        let port = if after.is_empty() {
            None
        } else {
            Some(after.strip_prefix(':')?)
        };
        (inner, port)
    } else {
        match rest.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (rest, None),
        }
    };
    let host_ok = rest.starts_with('[')
        || (!host.is_empty()
            && host.len() <= 253
            && host.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && !l.starts_with('-')
                    && !l.ends_with('-')
                    && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            }));
    let port_ok = port.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 5
            && p.bytes().all(|b| b.is_ascii_digit())
            && p.parse::<u32>().is_ok_and(|n| (1..=65535).contains(&n))
    });
    (host_ok && port_ok).then_some(o)
}

/// Whether `name` is a header name token (RFC 9110 `tchar`s).
fn header_token(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Checks and normalizes a policy (origins and headers lower-cased, methods
/// upper-cased); 400 `INVALID_POLICY` says what is wrong. `at` names where
/// the policy stands in the body, for the message.
pub fn validate_policy(mut p: RoutePolicy, at: &str) -> Result<RoutePolicy, ApiError> {
    if p.require_grants.len() > MAX_REQUIRED_GRANTS {
        return Err(invalid(format!(
            "{at}.require_grants: at most {MAX_REQUIRED_GRANTS} grants"
        )));
    }
    if p.auth == AuthMode::None && !p.require_grants.is_empty() {
        return Err(invalid(format!(
            "{at}.require_grants needs a credential: set auth to api_key, jwt or any"
        )));
    }
    if let Some(c) = p.cors.as_mut() {
        if c.origins.is_empty() {
            return Err(invalid(format!(
                "{at}.cors.origins: give at least one origin"
            )));
        }
        for (what, n) in [
            ("origins", c.origins.len()),
            ("methods", c.methods.len()),
            ("headers", c.headers.len()),
        ] {
            if n > MAX_CORS_ENTRIES {
                return Err(invalid(format!(
                    "{at}.cors.{what}: at most {MAX_CORS_ENTRIES}"
                )));
            }
        }
        for o in &mut c.origins {
            if o == "*" {
                if c.credentials {
                    return Err(invalid(format!(
                        "{at}.cors: origin \"*\" cannot go with credentials; list the origins"
                    )));
                }
                continue;
            }
            *o = normalize_origin(o).ok_or_else(|| {
                invalid(format!(
                    "{at}.cors.origins: {o:?} is not an origin (scheme://host[:port], http or https, no path)"
                ))
            })?;
        }
        for m in &mut c.methods {
            *m = m.to_ascii_uppercase();
            if !super::model::METHODS.contains(&m.as_str()) {
                return Err(invalid(format!(
                    "{at}.cors.methods: {m:?} is not an HTTP method"
                )));
            }
        }
        for h in &mut c.headers {
            *h = h.to_ascii_lowercase();
            if !header_token(h) {
                return Err(invalid(format!(
                    "{at}.cors.headers: {h:?} is not a header name"
                )));
            }
        }
        if c.max_age.is_some_and(|a| a > MAX_CORS_MAX_AGE) {
            return Err(invalid(format!(
                "{at}.cors.max_age: at most {MAX_CORS_MAX_AGE} seconds"
            )));
        }
    }
    if let Some(r) = &p.rate_limit {
        let ok = |n: u32| (1..=MAX_RATE).contains(&n);
        if !ok(r.requests_per_second) || !ok(r.burst()) {
            return Err(invalid(format!(
                "{at}.rate_limit: requests_per_second and burst are 1 to {MAX_RATE}"
            )));
        }
        if r.key == RateKey::Subject && p.auth == AuthMode::None {
            return Err(invalid(format!(
                "{at}.rate_limit.key \"subject\" needs a credential: set auth to api_key, jwt or any"
            )));
        }
    }
    Ok(p)
}

/// Checks every route's policy (see [`validate_policy`]).
pub fn validate_route_policies(routes: &mut [RouteSpec]) -> Result<(), ApiError> {
    for (i, r) in routes.iter_mut().enumerate() {
        if let Some(p) = r.policy.take() {
            r.policy = Some(validate_policy(p, &format!("routes[{i}].policy"))?);
        }
    }
    Ok(())
}

/// Checks the deployment-wide default and copies it into every route without
/// a policy of its own (a route's own policy wins, whole).
pub fn apply_default(
    routes: &mut [RouteSpec],
    default: Option<RoutePolicy>,
) -> Result<(), ApiError> {
    let Some(d) = default else { return Ok(()) };
    let d = validate_policy(d, "policy")?;
    for r in routes.iter_mut().filter(|r| r.policy.is_none()) {
        r.policy = Some(d.clone());
    }
    Ok(())
}

/// Request headers that carry an identity meshgate vouches for: whatever a
/// client sends under this prefix is dropped before the upstream, on every route.
pub const IDENTITY_HEADER_PREFIX: &str = "x-meshgate-";
/// The credential's namespace.
pub const H_NAMESPACE: &str = "x-meshgate-namespace";
/// The credential's subject (`key:<id>`, or the JWT's `sub`).
pub const H_SUBJECT: &str = "x-meshgate-subject";
/// The credential's grants, comma-separated.
pub const H_GRANTS: &str = "x-meshgate-grants";
/// An API key's name (its label).
pub const H_KEY_NAME: &str = "x-meshgate-key-name";

/// Whether a client's request header is removed before the upstream:
/// every header that reads as `x-meshgate-*` (with `_` as `-`, as CGI-style
/// servers read names) always; the credential headers when the route
/// authenticated (`strip_credentials`). The edge's canonical step
/// (`super::canonical::judge_header`) dropped these already; this is the
/// proxy's own guard.
pub fn strip_upstream_header(name: &str, strip_credentials: bool) -> bool {
    // Names arrive lower-case (actix and hyper header names).
    super::canonical::reads_as_identity(name)
        || (strip_credentials && (name == "authorization" || name == "x-api-key"))
}

/// What the proxy sends upstream for a route whose policy authenticated:
/// the checked identity's `X-Meshgate-*` headers, and whether the credential
/// headers are dropped. `http/route_policy.rs` puts it on the request (an
/// `Arc` in its extensions); the proxy reads it there.
#[derive(Debug, Clone, Default)]
pub struct UpstreamView {
    /// `X-Meshgate-*` headers (lower-case names), in order.
    pub headers: Vec<(&'static str, String)>,
    /// Drop `Authorization` and `X-API-Key` (no `forward_credentials`).
    pub strip_credentials: bool,
    /// The credential came as `?token=` (a WebSocket upgrade) and is not
    /// forwarded: the `token` parameter is removed from the query sent upstream.
    pub strip_query_token: bool,
    /// The route's checked credential when it can end while a WebSocket it
    /// opened is relayed (a token: it expires, its session can be ended).
    pub credential: Option<crate::identity::Identity>,
}

impl UpstreamView {
    /// Gives the identity headers to the proxy's `emit`.
    pub fn emit(&self, emit: &mut impl FnMut(&str, &[u8])) {
        for (k, v) in &self.headers {
            emit(k, v.as_bytes());
        }
    }
}

/// `query` (without its `?`) minus every `name` parameter (its key compared
/// after `%XX` and `+` decoding, as a query is read); borrowed when none is there.
pub fn without_query_param<'q>(query: &'q str, name: &str) -> std::borrow::Cow<'q, str> {
    let is_name = |pair: &str| {
        let b = pair.split('=').next().unwrap_or_default().as_bytes();
        let mut key = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            let escaped = (b[i] == b'%')
                .then(|| b.get(i + 1..i + 3))
                .flatten()
                .and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok());
            match (escaped, b[i]) {
                (Some(v), _) => {
                    key.push(v);
                    i += 3;
                }
                (None, c) => {
                    key.push(if c == b'+' { b' ' } else { c });
                    i += 1;
                }
            }
        }
        key == name.as_bytes()
    };
    if !query.split('&').any(is_name) {
        return std::borrow::Cow::Borrowed(query);
    }
    let kept: Vec<&str> = query
        .split('&')
        .filter(|p| !p.is_empty() && !is_name(p))
        .collect();
    std::borrow::Cow::Owned(kept.join("&"))
}

/// Whether the proxy drops a client's request header `name` (lower-case):
/// `X-Meshgate-*` always, on every route; the credential when the route
/// authenticated and does not forward it.
pub fn stripped(name: &str, view: Option<&UpstreamView>) -> bool {
    strip_upstream_header(name, view.is_some_and(|v| v.strip_credentials))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `token` goes in any spelling of its key; other parameters stay in order.
    #[test]
    fn query_tokens_are_removed() {
        assert_eq!(without_query_param("a=1&b=2", "token"), "a=1&b=2");
        assert!(matches!(
            without_query_param("a=1", "token"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(without_query_param("token=x", "token"), "");
        assert_eq!(
            without_query_param("a=1&token=x&b=2&%74oken=y&tokens=z", "token"),
            "a=1&b=2&tokens=z"
        );
        assert_eq!(without_query_param("token&a=%zz", "token"), "a=%zz");
    }

    fn parse(v: serde_json::Value) -> Result<RoutePolicy, String> {
        let p: RoutePolicy = serde_json::from_value(v).map_err(|e| e.to_string())?;
        validate_policy(p, "policy").map_err(|e| e.code.to_string())
    }

    /// `{}` is today's behaviour; a full policy parses and is normalized.
    #[test]
    fn policies_parse_and_normalize() {
        assert_eq!(
            parse(serde_json::json!({})).unwrap(),
            RoutePolicy::default()
        );
        let p = parse(serde_json::json!({
            "auth": "jwt", "require_grants": ["kv:read:*"], "forward_credentials": true,
            "cors": {"origins": ["https://App.Example.com", "http://127.0.0.1:8080", "http://[::1]:3000"],
                     "methods": ["get"], "headers": ["X-Trace"], "credentials": true, "max_age": 60},
            "rate_limit": {"requests_per_second": 5, "key": "subject"}
        }))
        .unwrap();
        assert_eq!(p.auth, AuthMode::Jwt);
        let c = p.cors.unwrap();
        assert_eq!(c.origins[0], "https://app.example.com");
        assert_eq!(c.methods, vec!["GET"]);
        assert_eq!(c.headers, vec!["x-trace"]);
        assert_eq!(p.rate_limit.unwrap().burst(), 5);
    }

    /// Each bad input is refused: unknown auth or field (by serde), a bad
    /// grant, a non-origin, a zero rate, grants or a subject key without auth.
    #[test]
    fn bad_policies_are_refused() {
        for bad in [
            serde_json::json!({"auth": "basic"}),
            serde_json::json!({"auth": "jwt", "require_grants": ["nope"]}),
            serde_json::json!({"auth": "jwt", "colour": "red"}),
            serde_json::json!({"cors": {"origins": ["https://a.test"], "extra": 1}}),
            serde_json::json!({"rate_limit": {"requests_per_second": 1, "per": "minute"}}),
        ] {
            assert!(
                parse(bad.clone()).is_err_and(|e| !e.starts_with("INVALID")),
                "{bad}"
            );
        }
        for bad in [
            serde_json::json!({"require_grants": ["kv:read:*"]}),
            serde_json::json!({"cors": {"origins": []}}),
            serde_json::json!({"cors": {"origins": ["example.com"]}}),
            serde_json::json!({"cors": {"origins": ["https://a.test/"]}}),
            serde_json::json!({"cors": {"origins": ["https://a.test/path"]}}),
            serde_json::json!({"cors": {"origins": ["ftp://a.test"]}}),
            serde_json::json!({"cors": {"origins": ["https://a.test:0"]}}),
            serde_json::json!({"cors": {"origins": ["https://a.test:99999"]}}),
            serde_json::json!({"cors": {"origins": ["https://u@a.test"]}}),
            serde_json::json!({"cors": {"origins": ["*"], "credentials": true}}),
            serde_json::json!({"cors": {"origins": ["*"], "methods": ["FETCH"]}}),
            serde_json::json!({"cors": {"origins": ["*"], "headers": ["a b"]}}),
            serde_json::json!({"cors": {"origins": ["*"], "max_age": 100000}}),
            serde_json::json!({"rate_limit": {"requests_per_second": 0}}),
            serde_json::json!({"rate_limit": {"requests_per_second": 1, "burst": 0}}),
            serde_json::json!({"rate_limit": {"requests_per_second": 1, "key": "subject"}}),
        ] {
            assert_eq!(parse(bad.clone()).unwrap_err(), "INVALID_POLICY", "{bad}");
        }
    }

    /// The default goes to routes without a policy; a route's own wins.
    #[test]
    fn default_fills_routes_without_one() {
        let mut own = RouteSpec::everything();
        own.path_prefix = "/public".into();
        own.policy = Some(RoutePolicy::default());
        let mut routes = vec![RouteSpec::everything(), own];
        let d = RoutePolicy {
            auth: AuthMode::Jwt,
            ..Default::default()
        };
        apply_default(&mut routes, Some(d.clone())).unwrap();
        assert_eq!(routes[0].policy.as_ref(), Some(&d));
        assert_eq!(routes[1].policy.as_ref(), Some(&RoutePolicy::default()));
    }

    /// Forged identity headers always go; credentials only when told.
    #[test]
    fn identity_headers_always_stripped() {
        assert!(strip_upstream_header("x-meshgate-subject", false));
        assert!(strip_upstream_header("x-meshgate-anything", false));
        assert!(!strip_upstream_header("authorization", false));
        assert!(strip_upstream_header("authorization", true));
        assert!(strip_upstream_header("x-api-key", true));
        assert!(!strip_upstream_header("x-custom", true));
    }

    /// Modes accept their kinds only; the operator and hops never.
    #[test]
    fn modes_accept_kinds() {
        assert!(AuthMode::Any.accepts("jwt") && AuthMode::Any.accepts("api_key"));
        assert!(!AuthMode::Jwt.accepts("api_key") && !AuthMode::ApiKey.accepts("jwt"));
        assert!(!AuthMode::Any.accepts("operator") && !AuthMode::None.accepts("jwt"));
    }
}
