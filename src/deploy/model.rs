//! Deployment records, their validation and their store keys (docs/design.md §7, §8).

use crate::error::ApiError;
use crate::error::Code;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most hosts one deployment may attach.
pub const MAX_HOSTS: usize = 16;
/// Most upstream instances of one deployment.
pub const MAX_INSTANCES: usize = 32;
/// Most routes of one deployment.
pub const MAX_ROUTES: usize = 64;

/// A deployment's head record (`dep/<ns>/<name>`): which version serves.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeploymentRecord {
    /// The deployment's name, unique in its namespace (see [`valid_name`]).
    pub name: String,
    /// The owning namespace (also in the key).
    pub namespace: String,
    /// The version now serving.
    pub active: u64,
    /// The highest version ever created.
    pub latest: u64,
    /// Unix seconds of the first version; kept across later ones.
    pub created_at: u64,
    /// Unix seconds of the last deploy or rollback.
    pub updated_at: u64,
}

/// One immutable version of a deployment (`depv/<ns>/<name>/<version>`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeploymentVersion {
    /// Counts up from 1 per deployment (one past the record's `latest`).
    pub version: u64,
    /// Normalized host names (see [`normalize_host`]) this version answers, at
    /// most [`MAX_HOSTS`]; each is claimed for the namespace under [`host_key`].
    pub hosts: Vec<String>,
    /// Checked routes (see [`validate_routes`]); never empty.
    pub routes: Vec<RouteSpec>,
    /// The site or upstreams that serve the routes.
    pub target: TargetSpec,
    /// Unix seconds when this version was created.
    pub created_at: u64,
    /// `tls: "auto"`: the hosts' certificate is issued by ACME
    /// (`deploy::acme`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tls_auto: bool,
}

/// What serves a deployment.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TargetSpec {
    /// Files of a tarball, each stored content-addressed under `blob/<sha256>`.
    Static {
        /// Each file by its path inside the site (`a/b.html`, no leading `/`).
        files: BTreeMap<String, SiteFile>,
        /// Unpacked size of the tarball's regular files, in bytes.
        total_bytes: u64,
    },
    /// HTTP instances, base URLs without a path (`http://127.0.0.1:9000`).
    Upstream {
        /// Normalized by [`normalize_instance`]; at most [`MAX_INSTANCES`].
        instances: Vec<String>,
        /// Each instance's weight (1..=[`MAX_WEIGHT`]), in the order of
        /// `instances`; empty when every weight is 1 (records written before
        /// weights existed read so).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        weights: Vec<u32>,
        /// How requests are spread over the instances.
        #[serde(default, skip_serializing_if = "Balance::is_default")]
        balance: Balance,
        /// The active health check, if any (passive health always applies).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        health: Option<HealthSpec>,
        /// Gzip answers the upstream did not encode, for clients that accept
        /// it (`super::compress`); true unless turned off (records written
        /// before the field read so).
        #[serde(default = "yes", skip_serializing_if = "is_true")]
        compress: bool,
        /// Pass a path the node refuses as ambiguous (`%2F`, `%5C`, `%2E`
        /// segments, `;` parameters, backslashes) to the upstream unchanged,
        /// its routes matched on how a decoding upstream reads it
        /// (`super::canonical::upstream_reading`); false: 400 `AMBIGUOUS_PATH`.
        #[serde(default, skip_serializing_if = "is_false")]
        pass_ambiguous_paths: bool,
        /// Pass client header names with `_` (those that read as a reserved
        /// name with `_` as `-` are dropped still); false: every such header is dropped.
        #[serde(default, skip_serializing_if = "is_false")]
        allow_underscore_headers: bool,
        /// gRPC to the instances (docs/deployments.md "gRPC"): the cap on a
        /// call's deadline. None: a call's own `grpc-timeout` alone.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        grpc: Option<GrpcSpec>,
    },
}

/// Highest `grpc.max_timeout_ms`: one day.
pub const MAX_GRPC_TIMEOUT_MS: u64 = 86_400_000;

/// A deployment's gRPC settings (`upstream.grpc`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct GrpcSpec {
    /// The longest a gRPC call may take, in ms (1..=[`MAX_GRPC_TIMEOUT_MS`]):
    /// a call's `grpc-timeout` above it, or a call without one, gets this
    /// deadline.
    pub max_timeout_ms: u64,
}

impl GrpcSpec {
    /// Checks the range; 400 `INVALID_UPSTREAM` otherwise.
    pub fn validate(&self) -> Result<(), ApiError> {
        if (1..=MAX_GRPC_TIMEOUT_MS).contains(&self.max_timeout_ms) {
            return Ok(());
        }
        Err(ApiError::new(
            Code::InvalidUpstream,
            format!(
                "upstream.grpc.max_timeout_ms {} is not within 1..={MAX_GRPC_TIMEOUT_MS}",
                self.max_timeout_ms
            ),
        ))
    }
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Highest weight of an instance.
pub const MAX_WEIGHT: u32 = 1000;

/// How a deployment's requests are spread over its healthy instances
/// (docs/deployments.md "Load balancing").
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Balance {
    /// Smooth weighted round robin (nginx's): each instance in proportion
    /// to its weight, interleaved.
    #[default]
    RoundRobin,
    /// Power of two random choices on in-flight requests over weight.
    LeastRequest,
    /// Rendezvous hashing of a header's value (or the client's address):
    /// one key stays on one instance while it is healthy.
    Hash(HashOn),
}

/// What [`Balance::Hash`] hashes.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HashOn {
    /// The request header whose value is hashed; none (or a request
    /// without it): the client's address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
}

impl Balance {
    fn is_default(&self) -> bool {
        *self == Balance::RoundRobin
    }
}

/// An active health check: every `interval_ms` (jittered) each instance
/// gets `GET path`; `unhealthy_threshold` failures in a row take it out of
/// rotation, `healthy_threshold` passes in a row bring it back.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HealthSpec {
    /// Absolute path (and query) requested.
    pub path: String,
    /// Between two checks of an instance, in ms (at least 100).
    #[serde(default = "default_interval_ms")]
    pub interval_ms: u64,
    /// Limit on one check (connect and answer head), in ms.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Passes in a row that bring an instance back.
    #[serde(default = "default_healthy_threshold")]
    pub healthy_threshold: u32,
    /// Failures in a row that take an instance out.
    #[serde(default = "default_unhealthy_threshold")]
    pub unhealthy_threshold: u32,
    /// Statuses that pass; empty: any 2xx.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expected_statuses: Vec<u16>,
}

fn default_interval_ms() -> u64 {
    5_000
}
fn default_timeout_ms() -> u64 {
    1_000
}
fn default_healthy_threshold() -> u32 {
    2
}
fn default_unhealthy_threshold() -> u32 {
    3
}

impl HealthSpec {
    /// Whether an answer's status passes the check.
    pub fn passes(&self, status: u16) -> bool {
        if self.expected_statuses.is_empty() {
            (200..300).contains(&status)
        } else {
            self.expected_statuses.contains(&status)
        }
    }
}

/// Checks weights (one per instance, each 1..=[`MAX_WEIGHT`], all 1 stored
/// as none), the hash header's name and the health check; 400
/// `INVALID_UPSTREAM` otherwise.
pub fn validate_balancing(
    instances: usize,
    weights: &mut Vec<u32>,
    balance: &Balance,
    health: Option<&HealthSpec>,
) -> Result<(), ApiError> {
    let bad = |m: String| ApiError::new(Code::InvalidUpstream, m);
    if !weights.is_empty() && weights.len() != instances {
        return Err(bad(format!(
            "{} weights for {instances} instances",
            weights.len()
        )));
    }
    if let Some(w) = weights.iter().find(|w| !(1..=MAX_WEIGHT).contains(*w)) {
        return Err(bad(format!("weight {w} is not within 1..={MAX_WEIGHT}")));
    }
    if weights.iter().all(|&w| w == 1) {
        weights.clear();
    }
    if let Balance::Hash(HashOn { header: Some(h) }) = balance
        && actix_web::http::header::HeaderName::from_bytes(h.as_bytes()).is_err()
    {
        return Err(bad(format!("hash header {h:?} is not a header name")));
    }
    if let Some(h) = health {
        if !h.path.starts_with('/')
            || h.path.len() > 1024
            || !h.path.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(bad(format!(
                "health path {:?} must be an absolute path (\"/healthz\")",
                h.path
            )));
        }
        if !(100..=3_600_000).contains(&h.interval_ms) {
            return Err(bad(format!(
                "health interval_ms {} is not within 100..=3600000",
                h.interval_ms
            )));
        }
        if !(1..=60_000).contains(&h.timeout_ms) {
            return Err(bad(format!(
                "health timeout_ms {} is not within 1..=60000",
                h.timeout_ms
            )));
        }
        for (name, t) in [
            ("healthy_threshold", h.healthy_threshold),
            ("unhealthy_threshold", h.unhealthy_threshold),
        ] {
            if !(1..=100).contains(&t) {
                return Err(bad(format!("health {name} {t} is not within 1..=100")));
            }
        }
        if h.expected_statuses.len() > 16
            || h.expected_statuses.iter().any(|s| !(100..=599).contains(s))
        {
            return Err(bad(
                "health expected_statuses: at most 16 statuses, each 100..=599".into(),
            ));
        }
    }
    Ok(())
}

/// One file of a static site.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SiteFile {
    /// SHA-256 (hex) of the contents: the bytes are stored under `blob/<sha256>`.
    pub sha256: String,
    /// Size of the contents, in bytes.
    pub size: u64,
    /// The `Content-Type` served, guessed from the path's extension.
    pub content_type: String,
}

/// One route: which requests of the deployment's hosts it takes, and how the
/// upstream path is formed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    /// Requests whose path starts with this, on a segment boundary; `/` by default.
    #[serde(default = "root")]
    pub path_prefix: String,
    /// Upper-case method names; empty takes every method.
    #[serde(default)]
    pub methods: Vec<String>,
    /// Removed from the front of the path before it goes upstream or to the site
    /// (see [`RouteSpec::rewrite`]).
    #[serde(default)]
    pub strip_prefix: Option<String>,
    /// Put in front of the path, after `strip_prefix` is removed.
    #[serde(default)]
    pub add_prefix: Option<String>,
    /// Among routes on the same prefix of a host, the highest wins (then the
    /// deployment name); a deeper prefix wins regardless.
    #[serde(default)]
    pub priority: i32,
    /// Who may call the route, its CORS and its rate limit
    /// (`super::route_policy`); None: no credential read, as before policies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<super::route_policy::RoutePolicy>,
}

fn root() -> String {
    "/".into()
}

impl RouteSpec {
    /// The route of a deployment without routes: everything under the host.
    pub fn everything() -> RouteSpec {
        RouteSpec {
            path_prefix: root(),
            methods: Vec::new(),
            strip_prefix: None,
            add_prefix: None,
            priority: 0,
            policy: None,
        }
    }

    /// The path sent upstream (or looked up in a site): `strip_prefix` removed
    /// when the path starts with it, then `add_prefix` put in front.
    pub fn rewrite(&self, path: &str) -> String {
        let mut p = path;
        if let Some(s) = self.strip_prefix.as_deref()
            && let Some(rest) = strip_path_prefix(p, s)
        {
            p = rest;
        }
        let mut out = String::with_capacity(p.len() + 8);
        if let Some(a) = self.add_prefix.as_deref() {
            out.push_str(a.trim_end_matches('/'));
        }
        if !p.is_empty() && !p.starts_with('/') {
            out.push('/');
        }
        out.push_str(p);
        if out.is_empty() {
            out.push('/');
        }
        out
    }
}

/// `path` without `prefix` when the prefix ends at a segment boundary
/// (`/api` strips `/api/x` and `/api`, not `/apix`).
pub fn strip_path_prefix<'a>(path: &'a str, prefix: &str) -> Option<&'a str> {
    let prefix = prefix.trim_end_matches('/');
    if prefix.is_empty() {
        return Some(path);
    }
    let rest = path.strip_prefix(prefix)?;
    (rest.is_empty() || rest.starts_with('/')).then_some(rest)
}

/// Deployment names: 1–63 of `a-z`, `0-9`, `-`, `_`, starting with a letter or digit.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && name.as_bytes()[0].is_ascii_alphanumeric()
}

/// A host name as routed: lower-case DNS labels, no port, no trailing dot.
/// An address in any spelling, `localhost` and a single label are 400
/// `HOST_RESERVED` (see [`super::hosts`]); an address is refused before the
/// syntax is checked, so `[::1]` is reserved rather than malformed.
pub fn normalize_host(raw: &str) -> Result<String, ApiError> {
    if let Some(why) = super::hosts::address_like(raw) {
        return Err(super::hosts::refusal(raw.trim(), &why));
    }
    let h = raw.trim().trim_end_matches('.').to_ascii_lowercase();
    let ok = !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        });
    if let (true, Some(why)) = (ok, super::hosts::reserved_everywhere(&h)) {
        return Err(super::hosts::refusal(&h, &why));
    }
    if ok {
        Ok(h)
    } else {
        Err(ApiError::new(
            Code::InvalidHost,
            format!("{raw:?} is not a host name (DNS labels, no port, no scheme)"),
        ))
    }
}

/// An upstream instance URL reduced to `scheme://authority`; only http and https.
pub fn normalize_instance(raw: &str) -> Result<String, ApiError> {
    let bad = |why: &str| {
        ApiError::new(
            Code::InvalidUpstream,
            format!("upstream {raw:?} {why}; use http://host:port or https://host:port"),
        )
    };
    let uri: actix_web::http::Uri = raw.trim().parse().map_err(|_| bad("is not a URL"))?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        Some(_) => return Err(bad("is not http(s)")),
        None => return Err(bad("has no scheme")),
    }
    let Some(auth) = uri.authority() else {
        return Err(bad("has no host"));
    };
    if auth.as_str().contains('@') || auth.host().is_empty() {
        return Err(bad("has credentials or no host"));
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(bad("has a path or query (routes form the path)"));
    }
    Ok(format!(
        "{}://{}",
        uri.scheme_str().expect("checked"),
        auth.as_str()
    ))
}

pub(crate) const METHODS: &[&str] = &[
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE",
];

/// Checks and normalizes routes (none: one route for everything).
pub fn validate_routes(routes: Vec<RouteSpec>) -> Result<Vec<RouteSpec>, ApiError> {
    if routes.len() > MAX_ROUTES {
        return Err(ApiError::new(
            Code::TooManyRoutes,
            format!("at most {MAX_ROUTES} routes"),
        ));
    }
    if routes.is_empty() {
        return Ok(vec![RouteSpec::everything()]);
    }
    let mut routes = routes;
    super::route_policy::validate_route_policies(&mut routes)?;
    let path_ok = |p: &str| {
        p.starts_with('/')
            && p.len() <= 1024
            && !p.split('/').any(|s| s == ".." || s == ".")
            && p.bytes()
                .all(|b| b.is_ascii_graphic() && b != b'?' && b != b'#')
    };
    routes
        .into_iter()
        .map(|mut r| {
            for (field, v) in [
                ("path_prefix", Some(&r.path_prefix)),
                ("strip_prefix", r.strip_prefix.as_ref()),
                ("add_prefix", r.add_prefix.as_ref()),
            ] {
                if let Some(v) = v
                    && !path_ok(v)
                {
                    return Err(ApiError::new(
                        Code::InvalidRoute,
                        format!(
                            "{field} {} must be an absolute path without . or .. segments",
                            crate::util::quoted(v)
                        ),
                    ));
                }
                // Requests are matched in their canonical spelling
                // (`super::canonical`): a prefix in another spelling would
                // never match, or match what the upstream reads otherwise.
                if field != "add_prefix"
                    && let Some(v) = v
                    && !matches!(
                        super::canonical::canonical_path(v),
                        Ok(std::borrow::Cow::Borrowed(_))
                    )
                {
                    return Err(ApiError::new(
                        Code::InvalidRoute,
                        format!(
                            "{field} {} must be a canonical path (no //, no escape of a letter, digit or -._~, no %2F, %5C, \\ or ;, escapes upper-case)",
                            crate::util::quoted(v)
                        ),
                    ));
                }
            }
            for m in &mut r.methods {
                *m = m.to_ascii_uppercase();
                if !METHODS.contains(&m.as_str()) {
                    return Err(ApiError::new(
                        Code::InvalidRoute,
                        format!("{} is not an HTTP method", crate::util::quoted(m)),
                    ));
                }
            }
            Ok(r)
        })
        .collect()
}

/// `dep/<ns>/<name>`: the [`DeploymentRecord`].
pub fn dep_key(ns: &str, name: &str) -> Vec<u8> {
    format!("dep/{ns}/{name}").into_bytes()
}

/// `dep/<ns>/`: every deployment record of the namespace.
pub fn dep_prefix(ns: &str) -> Vec<u8> {
    format!("dep/{ns}/").into_bytes()
}

/// `depv/<ns>/<name>/<version>` (zero-padded so versions sort): a [`DeploymentVersion`].
pub fn ver_key(ns: &str, name: &str, version: u64) -> Vec<u8> {
    format!("depv/{ns}/{name}/{version:020}").into_bytes()
}

/// `depv/<ns>/<name>/`: every version of one deployment.
pub fn ver_prefix(ns: &str, name: &str) -> Vec<u8> {
    format!("depv/{ns}/{name}/").into_bytes()
}

/// `depv/<ns>/`: every version of every deployment of the namespace.
pub fn ns_ver_prefix(ns: &str) -> Vec<u8> {
    format!("depv/{ns}/").into_bytes()
}

/// Which namespace owns a host (`host/<host>`).
pub fn host_key(host: &str) -> Vec<u8> {
    format!("host/{host}").into_bytes()
}

/// The owner of a host, as stored under [`host_key`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HostClaim {
    /// The only namespace whose deployments may route this host.
    pub namespace: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Strip then add, on segment boundaries, with the rest of the path kept.
    #[test]
    fn rewrite_strips_then_adds() {
        let r = RouteSpec {
            path_prefix: "/api".into(),
            methods: vec![],
            strip_prefix: Some("/api".into()),
            add_prefix: Some("/v2/".into()),
            priority: 0,
            policy: None,
        };
        assert_eq!(r.rewrite("/api/users"), "/v2/users");
        assert_eq!(r.rewrite("/api"), "/v2");
        assert_eq!(r.rewrite("/apix"), "/v2/apix");
        assert_eq!(RouteSpec::everything().rewrite("/a/b"), "/a/b");
        let strip_only = RouteSpec {
            add_prefix: None,
            ..r
        };
        assert_eq!(strip_only.rewrite("/api"), "/");
        assert_eq!(strip_only.rewrite("/api/x"), "/x");
    }

    /// Weights within 1..=1000 (all 1 stored as none), absolute health
    /// paths, intervals of at least 100 ms.
    #[test]
    fn balancing_is_checked() {
        let mut w = vec![3, 1];
        validate_balancing(2, &mut w, &Balance::RoundRobin, None).unwrap();
        assert_eq!(w, vec![3, 1]);
        let mut w = vec![1, 1];
        validate_balancing(2, &mut w, &Balance::LeastRequest, None).unwrap();
        assert!(w.is_empty());
        for bad in [vec![0, 1], vec![1001, 1], vec![1]] {
            let mut w = bad.clone();
            let e = validate_balancing(2, &mut w, &Balance::RoundRobin, None).unwrap_err();
            assert_eq!(e.code, "INVALID_UPSTREAM", "{bad:?}");
        }
        let h: HealthSpec = serde_json::from_str(r#"{"path": "/healthz"}"#).unwrap();
        assert_eq!((h.interval_ms, h.healthy_threshold), (5000, 2));
        assert!(h.passes(204) && !h.passes(301));
        validate_balancing(1, &mut vec![], &Balance::RoundRobin, Some(&h)).unwrap();
        for bad in [
            HealthSpec {
                path: "healthz".into(),
                ..h.clone()
            },
            HealthSpec {
                interval_ms: 50,
                ..h.clone()
            },
            HealthSpec {
                healthy_threshold: 0,
                ..h.clone()
            },
            HealthSpec {
                expected_statuses: vec![42],
                ..h.clone()
            },
        ] {
            assert!(validate_balancing(1, &mut vec![], &Balance::RoundRobin, Some(&bad)).is_err());
        }
        let hash: Balance = serde_json::from_str(r#"{"hash": {"header": "X-User"}}"#).unwrap();
        assert_eq!(
            hash,
            Balance::Hash(HashOn {
                header: Some("X-User".into())
            })
        );
        let rr: Balance = serde_json::from_str(r#""least_request""#).unwrap();
        assert_eq!(rr, Balance::LeastRequest);
        let bad = Balance::Hash(HashOn {
            header: Some("a b".into()),
        });
        assert!(validate_balancing(1, &mut vec![], &bad, None).is_err());
        // A record of before weights reads with the defaults.
        let t: TargetSpec =
            serde_json::from_str(r#"{"kind":"upstream","instances":["http://a:1"]}"#).unwrap();
        let TargetSpec::Upstream {
            weights,
            balance,
            health,
            ..
        } = t
        else {
            panic!()
        };
        assert!(weights.is_empty() && balance == Balance::RoundRobin && health.is_none());
        let TargetSpec::Upstream { compress, .. } =
            serde_json::from_str(r#"{"kind":"upstream","instances":["http://a:1"]}"#).unwrap()
        else {
            panic!()
        };
        assert!(compress, "a record of before compression compresses");
        let off = TargetSpec::Upstream {
            instances: vec!["http://a:1".into()],
            weights: vec![],
            balance: Balance::RoundRobin,
            health: None,
            compress: false,
            pass_ambiguous_paths: false,
            allow_underscore_headers: false,
            grpc: None,
        };
        let text = serde_json::to_string(&off).unwrap();
        assert!(text.contains(r#""compress":false"#), "{text}");
        let back: TargetSpec = serde_json::from_str(&text).unwrap();
        assert!(matches!(
            back,
            TargetSpec::Upstream {
                compress: false,
                ..
            }
        ));
    }

    /// Only http(s) instances with a host and no path are accepted.
    #[test]
    fn instances_must_be_http() {
        assert_eq!(
            normalize_instance("http://127.0.0.1:9000").unwrap(),
            "http://127.0.0.1:9000"
        );
        assert_eq!(
            normalize_instance("https://example.com/").unwrap(),
            "https://example.com"
        );
        for bad in [
            "ftp://x:21",
            "127.0.0.1:9000",
            "http://u:p@x:1",
            "http://x:1/path",
            "http://x:1/?q=1",
            "",
            "file:///etc/passwd",
        ] {
            let e = normalize_instance(bad).unwrap_err();
            assert_eq!(e.code, "INVALID_UPSTREAM", "{bad}");
        }
    }

    /// Hosts are lower-cased DNS names; ports, schemes and junk are refused.
    #[test]
    fn hosts_are_dns_names() {
        assert_eq!(
            normalize_host("App.Example.TEST.").unwrap(),
            "app.example.test"
        );
        for bad in ["", "a:80", "http://a", "a..b", "-a.b", "a b", "ä.test"] {
            assert!(normalize_host(bad).is_err(), "{bad}");
        }
        // Addresses in every spelling, localhost and single labels are
        // reserved, not malformed.
        for reserved in [
            "127.0.0.1",
            "127.0.0.1.",
            "2130706433",
            "0x7f.1",
            "127.1",
            "[::1]",
            "::1",
            "[::ffff:127.0.0.1]",
            "::FFFF:127.0.0.1",
            "LocalHost.",
            "app.localhost",
            "intranet",
        ] {
            let e = normalize_host(reserved).unwrap_err();
            assert_eq!(e.code, "HOST_RESERVED", "{reserved}: {e}");
        }
        assert_eq!(normalize_host("a b").unwrap_err().code, "INVALID_HOST");
    }

    /// Route paths must be absolute and free of dot segments; methods are checked.
    #[test]
    fn routes_are_checked() {
        let mut r = RouteSpec::everything();
        r.path_prefix = "/a/../b".into();
        assert!(validate_routes(vec![r]).is_err());
        let mut r = RouteSpec::everything();
        r.methods = vec!["FETCH".into()];
        assert!(validate_routes(vec![r]).is_err());
        let mut r = RouteSpec::everything();
        r.methods = vec!["get".into()];
        assert_eq!(validate_routes(vec![r]).unwrap()[0].methods, vec!["GET"]);
        assert_eq!(
            validate_routes(vec![]).unwrap(),
            vec![RouteSpec::everything()]
        );
    }
}
