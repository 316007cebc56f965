//! Dashboard sessions. A browser's `EventSource` cannot send an `Authorization`
//! header, so an operator away from loopback signs in once with the operator key
//! (`POST /__admin/login`) and gets an HttpOnly, SameSite=Strict cookie scoped to
//! `/__admin` holding a random token (32 bytes, hex). The session itself is a
//! record in the node's store, `_admin/session/<hex SHA-256 of the token>`, with
//! a time to live of [`SESSION_TTL_SECONDS`]: sled on a single node, etcd in a
//! cluster, so every node honours a session, and a sign-out, made on any of them.
//! Neither the token nor the operator key is in the store.
//!
//! A session ends when
//! - the operator signs out (`POST /__admin/logout` deletes the record),
//! - the operator key changes: the record holds a digest of the operator key's
//!   HMAC ([`binding`]); a record of another key is refused and deleted, and a
//!   node that starts with a new key deletes every such record
//!   ([`end_sessions_of_other_keys`]),
//! - or its time to live runs out.
//!
//! Verifying reads the store; a node keeps what it read for at most
//! [`SESSION_CACHE_TTL`](super::board::SESSION_CACHE_TTL) (bounded by [`SESSION_CACHE_MAX`](super::board::SESSION_CACHE_MAX)), so a page's burst
//! of requests costs one read. A sign-out evicts the session on the node that
//! served it at once; another node stops honouring it within
//! [`SESSION_CACHE_TTL`](super::board::SESSION_CACHE_TTL).
//!
//! The chain's authentication step reads the cookie on `/__admin` routes only,
//! so it can never stand in for the key on the API. The dashboard's
//! state-changing routes (every method but GET, HEAD and OPTIONS) also refuse a
//! request from another origin ([`check_origin`]).

use crate::error::{ApiError, ApiResult, Code};
use crate::http::state::Node;
use crate::identity::Identity;
use crate::storage::OrderedKv;
use actix_web::http::header;
use std::time::Duration;

/// The cookie's name.
pub const COOKIE: &str = "mg_admin";
/// How long a session lasts.
pub const SESSION_TTL_SECONDS: u64 = 12 * 3600;
/// Where session records live in the store (apart from every tenant's data).
pub const SESSION_PREFIX: &str = "_admin/session/";
const BINDING_CONTEXT: &[u8] = b"meshgate-admin-session\0";
/// Most records [`end_sessions_of_other_keys`] looks at.
const SWEEP_LIMIT: usize = 10_000;

/// What the store keeps of a session.
#[derive(serde::Serialize, serde::Deserialize)]
struct Record {
    /// Unix seconds when the session ends.
    exp: u64,
    /// [`binding`] of the operator key it was opened with (hex).
    key: String,
}

/// A digest of the operator key's HMAC: what a session record is bound to.
fn binding(node: &Node) -> String {
    let mut msg = BINDING_CONTEXT.to_vec();
    msg.extend_from_slice(&node.secrets.operator_key_hash);
    hex::encode(ring::digest::digest(&ring::digest::SHA256, &msg))
}

/// The session id of a token: the hex SHA-256 of it (the store never sees the
/// token). None for what cannot be a token (64 lower-case hex digits).
fn session_id(token: &str) -> Option<String> {
    let shaped = token.len() == 64
        && token
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    shaped.then(|| {
        hex::encode(ring::digest::digest(
            &ring::digest::SHA256,
            token.as_bytes(),
        ))
    })
}

fn store_key(id: &str) -> Vec<u8> {
    format!("{SESSION_PREFIX}{id}").into_bytes()
}

/// Opens a session: a new random token, its record stored (durably) with a
/// time to live. Returns the token for the cookie.
pub async fn open(node: &Node) -> ApiResult<String> {
    let token = hex::encode(crate::util::random_bytes::<32>());
    let id = session_id(&token).ok_or_else(|| ApiError::internal("session token shape"))?;
    let exp = crate::util::now() + SESSION_TTL_SECONDS;
    let record = serde_json::to_vec(&Record {
        exp,
        key: binding(node),
    })
    .map_err(|e| ApiError::internal(e.to_string()))?;
    let ttl = Duration::from_secs(SESSION_TTL_SECONDS);
    Box::pin(node.store.put_ttl(&store_key(&id), &record, ttl)).await?;
    node.dashboard.sessions.insert(id, exp);
    Ok(token)
}

/// Ends the session of `token` (its record deleted, evicted from this node's
/// cache). A token that is no session is no error.
pub async fn close(node: &Node, token: &str) -> ApiResult<()> {
    let Some(id) = session_id(token) else {
        return Ok(());
    };
    Box::pin(node.store.delete(&store_key(&id))).await?;
    // Evicted after the delete, so only a read already under way when the
    // record went can cache it again (for at most SESSION_CACHE_TTL).
    node.dashboard.sessions.evict(&id);
    Ok(())
}

/// The expiry of the live session `token` opens, if it does: its record is in
/// the store, bound to the current operator key, and not expired. A record of
/// another operator key is deleted. A store failure opens nothing.
async fn verify(node: &Node, token: &str) -> Option<u64> {
    let id = session_id(token)?;
    if let Some(exp) = node.dashboard.sessions.get(&id) {
        return (exp > crate::util::now()).then_some(exp);
    }
    let key = store_key(&id);
    let raw = match Box::pin(node.store.get(&key)).await {
        Ok(r) => r?,
        Err(e) => {
            tracing::warn!(error = %e, "Dashboard session not readable.");
            return None;
        }
    };
    let record: Record = serde_json::from_slice(&raw).ok()?;
    if record.key != binding(node) {
        // Opened with an operator key that is no longer the key.
        let _ = Box::pin(node.store.delete(&key)).await;
        return None;
    }
    if record.exp <= crate::util::now() {
        return None;
    }
    node.dashboard.sessions.insert(id, record.exp);
    Some(record.exp)
}

/// Whether `token` is still a live session (an open event stream asks
/// before each frame).
pub async fn is_open(node: &Node, token: &str) -> bool {
    verify(node, token).await.is_some()
}

/// Deletes every session record opened with another operator key than this
/// node's (the key changed since they were opened). Run once at start-up.
pub async fn end_sessions_of_other_keys(node: &Node) {
    let current = binding(node);
    let records = match node
        .store
        .scan_prefix(SESSION_PREFIX.as_bytes(), SWEEP_LIMIT)
        .await
    {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "Dashboard sessions not swept.");
            return;
        }
    };
    let mut ended = 0usize;
    for (key, value) in records {
        let stale = serde_json::from_slice::<Record>(&value).map_or(true, |r| r.key != current);
        if stale && node.store.delete(&key).await.unwrap_or(false) {
            ended += 1;
        }
    }
    if ended > 0 {
        tracing::info!(
            sessions = ended,
            "Dashboard sessions of another operator key ended."
        );
    }
}

/// The `Set-Cookie` value that opens a session.
pub fn set_cookie(token: &str, secure: bool) -> String {
    let secure = if secure { "; Secure" } else { "" };
    format!(
        "{COOKIE}={token}; Path=/__admin; HttpOnly; SameSite=Strict; Max-Age={SESSION_TTL_SECONDS}{secure}"
    )
}

/// The `Set-Cookie` value that ends a session.
pub fn clear_cookie() -> String {
    format!("{COOKIE}=; Path=/__admin; HttpOnly; SameSite=Strict; Max-Age=0")
}

/// The session cookie's value among a request's `Cookie` headers.
pub fn cookie_value(headers: &header::HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_string())
}

/// Whether a path belongs to the dashboard (the only place the cookie counts).
pub fn is_dashboard_path(path: &str) -> bool {
    path == "/__admin" || path.starts_with("/__admin/")
}

/// The operator identity a live session cookie stands for, on dashboard paths
/// only. An absent, ended, expired or made-up cookie gives None (the request
/// stays anonymous).
pub async fn cookie_identity(
    node: &Node,
    path: &str,
    headers: &header::HeaderMap,
) -> Option<Identity> {
    if !is_dashboard_path(path) {
        return None;
    }
    let token = cookie_value(headers)?;
    let exp = verify(node, &token).await?;
    Some(Identity::from(crate::identity::IdentityData {
        subject: "operator".into(),
        namespace: None,
        grants: Vec::new(),
        operator: true,
        kind: "admin_session",
        custom: serde_json::Value::Null,
        jti: None,
        exp: Some(exp),
        iat: None,
        device: None,
        session: None,
    }))
}

/// Whether `method` may change state (anything but GET, HEAD and OPTIONS).
pub fn is_state_changing(method: &actix_web::http::Method) -> bool {
    use actix_web::http::Method;
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// A state-changing dashboard request must come from the node's own origin: its
/// `Origin` names the request's own host and port (the port by the origin's
/// scheme when the `Host` has none), or `[server] public_url`. An opaque
/// origin (`Origin: null`, what a browser sends under `Referrer-Policy:
/// no-referrer` or from a sandboxed frame) passes only with `Sec-Fetch-Site:
/// same-origin`. Without an `Origin`, a `Sec-Fetch-Site` other than
/// `same-origin` or `none` is refused (a sibling host may be a tenant's
/// site); a request with neither (curl, a script with the operator key)
/// passes. CORS's `allowed_origins` do not count here: they are for API
/// clients, never for the dashboard's cookie.
pub fn check_origin(node: &Node, headers: &header::HeaderMap) -> Result<(), ApiError> {
    let refuse = |why: String| Err(ApiError::new(Code::CrossOrigin, why));
    let site = headers
        .get("sec-fetch-site")
        .map(|v| v.to_str().unwrap_or("?"));
    let origin = headers
        .get(header::ORIGIN)
        .map(|v| v.to_str().unwrap_or("").trim());
    match (origin, site) {
        (None, None | Some("same-origin" | "none")) => Ok(()),
        (None, Some(site)) => refuse(format!(
            "a {site} request may not change the dashboard's state"
        )),
        (Some("null"), Some("same-origin")) => Ok(()),
        (Some("null"), _) => {
            refuse("an opaque origin (null) may not change the dashboard's state".to_string())
        }
        (Some(origin), _) => {
            let host = headers
                .get(header::HOST)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            if same_origin(origin, host)
                || matches_public_url(origin, &node.config.server.public_url)
            {
                return Ok(());
            }
            refuse(format!(
                "origin {origin:?} is not this node's own; the dashboard changes state only from its own pages"
            ))
        }
    }
}

/// An origin's (scheme, lower-case host, port).
fn parse_origin(origin: &str) -> Option<(&str, String, u16)> {
    let (scheme, rest) = origin.split_once("://")?;
    let default = match scheme {
        "http" => 80,
        "https" => 443,
        _ => return None,
    };
    if rest.is_empty() || rest.contains(['/', '@', '?', '#']) {
        return None;
    }
    let (host, port) = split_host_port(rest, default)?;
    Some((scheme, host, port))
}

/// `host[:port]` (brackets kept on IPv6) as (lower-case host, port or `default`).
fn split_host_port(authority: &str, default: u16) -> Option<(String, u16)> {
    let (host, port) = if authority.starts_with('[') {
        let end = authority.find(']')?;
        let port = match &authority[end + 1..] {
            "" => None,
            p => Some(p.strip_prefix(':')?),
        };
        (&authority[..=end], port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => default,
    };
    (!host.is_empty()).then(|| (host.to_ascii_lowercase(), port))
}

/// Whether `origin` names the host and port of the request's `Host` header.
fn same_origin(origin: &str, host: &str) -> bool {
    let Some((scheme, o_host, o_port)) = parse_origin(origin) else {
        return false;
    };
    // A Host without a port is on the default port of the scheme the browser used.
    let default = if scheme == "https" { 443 } else { 80 };
    split_host_port(host.trim(), default).is_some_and(|(h, p)| h == o_host && p == o_port)
}

/// Whether `origin` is the origin of `[server] public_url` (empty: never).
fn matches_public_url(origin: &str, public_url: &str) -> bool {
    let Some((scheme, rest)) = public_url.trim().split_once("://") else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let own = format!("{scheme}://{authority}");
    matches!((parse_origin(origin), parse_origin(&own)), (Some(a), Some(b)) if a == b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::dashboard::board::{SESSION_CACHE_TTL, SessionCache};
    use std::sync::Arc;

    /// Cookies are found among several pairs and several headers.
    #[test]
    fn finds_the_cookie() {
        let mut h = header::HeaderMap::new();
        h.append(header::COOKIE, "a=1; b=2".parse().unwrap());
        h.append(header::COOKIE, "x=y; mg_admin=123.abc".parse().unwrap());
        assert_eq!(cookie_value(&h).as_deref(), Some("123.abc"));
        assert_eq!(cookie_value(&header::HeaderMap::new()), None);
    }

    /// Only `/__admin` and paths under it take the cookie.
    #[test]
    fn dashboard_paths_only() {
        assert!(is_dashboard_path("/__admin"));
        assert!(is_dashboard_path("/__admin/api/stream"));
        assert!(!is_dashboard_path("/__administrator"));
        assert!(!is_dashboard_path("/v1/namespaces"));
    }

    /// A session read from the store is kept [`SESSION_CACHE_TTL`], then read
    /// again; an evicted one at once.
    #[test]
    fn cache_keeps_a_session_for_its_ttl() {
        let clock = Arc::new(crate::util::ManualClock::default());
        let cache = SessionCache::with_clock(clock.clone());
        cache.insert("a".into(), 42);
        cache.insert("b".into(), 43);
        assert_eq!(cache.get("a"), Some(42));
        clock.advance(SESSION_CACHE_TTL - Duration::from_millis(1));
        assert_eq!(cache.get("a"), Some(42));
        cache.evict("b");
        assert_eq!(cache.get("b"), None, "evicted");
        clock.advance(Duration::from_millis(1));
        assert_eq!(cache.get("a"), None, "aged out");
    }

    /// Only 64 lower-case hex digits can be a token; the id is its SHA-256.
    #[test]
    fn token_shape() {
        let t = "ab".repeat(32);
        assert_eq!(session_id(&t).map(|i| i.len()), Some(64));
        assert_ne!(session_id(&t).as_deref(), Some(t.as_str()));
        for bad in ["", "operator", &"AB".repeat(32), &"ab".repeat(33), "1.2"] {
            assert_eq!(session_id(bad), None, "{bad}");
        }
    }

    /// An origin is the node's own when host and port agree with `Host`
    /// (default ports by the origin's scheme); anything else is another origin.
    #[test]
    fn same_origin_rules() {
        assert!(same_origin("http://127.0.0.1:8080", "127.0.0.1:8080"));
        assert!(same_origin("https://GW.example.com", "gw.example.com"));
        assert!(same_origin("https://gw.example.com", "gw.example.com:443"));
        assert!(same_origin("http://[::1]:8080", "[::1]:8080"));
        assert!(!same_origin("http://127.0.0.1:8081", "127.0.0.1:8080"));
        assert!(!same_origin("https://evil.example", "gw.example.com"));
        assert!(!same_origin(
            "https://ns-a.gw.example.com",
            "gw.example.com"
        ));
        assert!(!same_origin("null", "gw.example.com"));
        assert!(!same_origin("http://gw.example.com", "gw.example.com:443"));
        assert!(!same_origin("http://a@gw.example.com", "gw.example.com"));
        assert!(matches_public_url(
            "https://gw.example.com",
            "https://gw.example.com/"
        ));
        assert!(matches_public_url(
            "https://gw.example.com",
            "https://gw.example.com:443"
        ));
        assert!(!matches_public_url("https://gw.example.com", ""));
        assert!(!matches_public_url(
            "http://gw.example.com",
            "https://gw.example.com"
        ));
    }
}
