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
    },
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
                        format!("{field} {v:?} must be an absolute path without . or .. segments"),
                    ));
                }
            }
            for m in &mut r.methods {
                *m = m.to_ascii_uppercase();
                if !METHODS.contains(&m.as_str()) {
                    return Err(ApiError::new(
                        Code::InvalidRoute,
                        format!("{m:?} is not an HTTP method"),
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
