//! Dashboard sessions. A browser's `EventSource` cannot send an `Authorization`
//! header, so an operator away from loopback signs in once with the operator key
//! (`POST /__admin/login`) and gets an HttpOnly, SameSite=Strict cookie scoped to
//! `/__admin`, holding a stateless token: its expiry and an HMAC over the expiry
//! and the operator key's hash, keyed by the node's server secret. The key itself
//! never reaches the cookie or script; changing the operator key invalidates every
//! session. The chain's authentication step reads the cookie on `/__admin` routes
//! only, so it can never stand in for the key on the API.

use crate::http::Identity;
use crate::http::state::Node;
use actix_web::http::header;

/// The cookie's name.
pub const COOKIE: &str = "mg_admin";
/// How long a session lasts.
pub const SESSION_TTL_SECONDS: u64 = 12 * 3600;
const CONTEXT: &[u8] = b"meshgate-admin-session\0";

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

fn signed_message(node: &Node, exp: u64) -> Vec<u8> {
    let mut msg = CONTEXT.to_vec();
    msg.extend_from_slice(exp.to_string().as_bytes());
    msg.push(0);
    msg.extend_from_slice(&node.secrets.operator_key_hash);
    msg
}

/// A new session token, valid for [`SESSION_TTL_SECONDS`] from `now`.
pub fn issue(node: &Node, now: u64) -> String {
    let exp = now + SESSION_TTL_SECONDS;
    let mac = crate::util::hmac(&node.secrets.server_secret, &signed_message(node, exp));
    format!("{exp}.{}", hex::encode(mac))
}

/// Whether `token` is a session this node issued and that has not expired.
pub fn verify(node: &Node, token: &str, now: u64) -> bool {
    let Some((exp, mac)) = token.split_once('.') else {
        return false;
    };
    let (Ok(exp), Ok(mac)) = (exp.parse::<u64>(), hex::decode(mac)) else {
        return false;
    };
    if exp <= now || exp > now + SESSION_TTL_SECONDS {
        return false;
    }
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &node.secrets.server_secret);
    ring::hmac::verify(&key, &signed_message(node, exp), &mac).is_ok()
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

/// The operator identity a valid session cookie stands for, on dashboard paths only.
/// An absent, expired or forged cookie gives None (the request stays anonymous).
pub fn cookie_identity(node: &Node, path: &str, headers: &header::HeaderMap) -> Option<Identity> {
    if !is_dashboard_path(path) {
        return None;
    }
    let token = cookie_value(headers)?;
    verify(node, &token, unix_now()).then(|| {
        Identity::from(crate::identity::IdentityData {
            subject: "operator".into(),
            namespace: None,
            grants: Vec::new(),
            operator: true,
            kind: "admin_session",
            custom: serde_json::Value::Null,
            jti: None,
            exp: token.split_once('.').and_then(|(e, _)| e.parse().ok()),
            iat: None,
        })
    })
}

/// Unix seconds now (for handlers).
pub fn now() -> u64 {
    unix_now()
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
