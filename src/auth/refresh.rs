//! The pure parts of refresh tokens: minting, hashing, and the rotation
//! decision.
//!
//! A refresh token lives 30 days and is rotated on every use. The token it
//! replaced is accepted once more within 60 s of the rotation (a client
//! that lost the answer over a flaky link retries); any other reuse of a
//! rotated token means it leaked, and the whole family is revoked.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};

use super::error::{AuthError, Result};

/// Lifetime of a refresh token, in seconds (30 days).
pub const REFRESH_TOKEN_TTL: u64 = 30 * 24 * 60 * 60;
/// How long after its rotation a token may be used once more, in seconds.
pub const REFRESH_REUSE_GRACE: u64 = 60;

const PREFIX: &str = "mgr_";

/// What the node stores per refresh token, keyed by its hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefreshRecord {
    /// All tokens descending from one sign-in share a family id.
    pub family: String,
    /// The namespace the tokens are for.
    pub namespace: String,
    /// The subject the access tokens are issued to.
    pub subject: String,
    /// Grant strings of the access tokens.
    pub grants: Vec<String>,
    /// Unix seconds.
    pub issued_at: u64,
    /// Unix seconds.
    pub expires_at: u64,
    /// When this token was exchanged for its successor.
    pub rotated_at: Option<u64>,
    /// Hex hash of the successor token.
    pub successor_hash: Option<String>,
    /// Whether the one retry within the grace window was spent.
    pub grace_used: bool,
    /// Revoked by logout or by reuse detection.
    pub revoked: bool,
    /// The session the family is (`sid` of its access tokens); absent on
    /// families opened before sessions existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The device the sign-in named (`did`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

impl RefreshRecord {
    /// The record of the first token of a new family, issued `now`, valid
    /// `ttl` seconds (`[auth] refresh_token_days`).
    pub fn new_family(
        namespace: &str,
        subject: &str,
        grants: Vec<String>,
        now: u64,
        ttl: u64,
    ) -> Result<Self> {
        let mut b = [0u8; 16];
        SystemRandom::new()
            .fill(&mut b)
            .map_err(|_| AuthError::Random)?;
        Ok(Self::issued(
            hex::encode(b),
            namespace,
            subject,
            grants,
            now,
            ttl,
        ))
    }

    /// The record of the token that replaces `self` (same family and
    /// identity, a fresh `ttl` seconds).
    pub fn successor(&self, now: u64, ttl: u64) -> Self {
        let mut next = Self::issued(
            self.family.clone(),
            &self.namespace,
            &self.subject,
            self.grants.clone(),
            now,
            ttl,
        );
        next.session = self.session.clone();
        next.device = self.device.clone();
        next
    }

    /// Marks `self` as exchanged for the token hashed `successor_hash` (hex).
    pub fn mark_rotated(&mut self, successor_hash: &str, now: u64) {
        self.rotated_at = Some(now);
        self.successor_hash = Some(successor_hash.to_owned());
    }

    fn issued(
        family: String,
        namespace: &str,
        subject: &str,
        grants: Vec<String>,
        now: u64,
        ttl: u64,
    ) -> Self {
        RefreshRecord {
            family,
            namespace: namespace.to_owned(),
            subject: subject.to_owned(),
            grants,
            issued_at: now,
            expires_at: now.saturating_add(ttl),
            rotated_at: None,
            successor_hash: None,
            grace_used: false,
            revoked: false,
            session: None,
            device: None,
        }
    }
}

/// What to do with a presented refresh token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefreshDecision {
    /// Valid and current: issue a successor, `mark_rotated`, answer it.
    Rotate,
    /// Rotated less than 60 s ago and not retried yet: set `grace_used`,
    /// revoke the unseen successor and issue a new one (the client never
    /// got the first answer).
    GraceReuse,
    /// A rotated token used again: revoke the whole family.
    ReuseDetected,
    /// Past its 30 days.
    Expired,
    /// Revoked (logout, or its family was).
    Revoked,
}

impl RefreshDecision {
    /// The error to answer with, for the refusing decisions.
    pub fn error(self) -> Option<AuthError> {
        match self {
            RefreshDecision::Rotate | RefreshDecision::GraceReuse => None,
            RefreshDecision::ReuseDetected => Some(AuthError::RefreshTokenReused),
            RefreshDecision::Expired => Some(AuthError::RefreshTokenExpired),
            RefreshDecision::Revoked => Some(AuthError::RefreshTokenRevoked),
        }
    }
}

/// `mgr_` + 32 random bytes in base64url.
pub fn new_refresh_token() -> Result<String> {
    let mut b = [0u8; 32];
    SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| AuthError::Random)?;
    Ok(format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(b)))
}

/// Whether `token` has the shape of a refresh token (checked before any
/// lookup).
pub fn is_refresh_token_shaped(token: &str) -> bool {
    token
        .strip_prefix(PREFIX)
        .is_some_and(|b| b.len() == 43 && URL_SAFE_NO_PAD.decode(b).is_ok_and(|d| d.len() == 32))
}

/// HMAC-SHA256(secret, token): the only form a refresh token is stored in.
pub fn hash_token(secret: &[u8], token: &str) -> [u8; 32] {
    let tag = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, secret), token.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(tag.as_ref());
    out
}

/// The rotation rule, at `now`.
pub fn decide(record: &RefreshRecord, now: u64) -> RefreshDecision {
    if record.revoked {
        return RefreshDecision::Revoked;
    }
    if let Some(rotated_at) = record.rotated_at {
        let in_grace = now <= rotated_at.saturating_add(REFRESH_REUSE_GRACE);
        return if in_grace && !record.grace_used {
            RefreshDecision::GraceReuse
        } else {
            RefreshDecision::ReuseDetected
        };
    }
    if now >= record.expires_at {
        return RefreshDecision::Expired;
    }
    RefreshDecision::Rotate
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_700_000_000;

    fn record() -> RefreshRecord {
        RefreshRecord::new_family(
            "acme",
            "wallet:ab",
            vec!["kv:read:*".into()],
            NOW,
            REFRESH_TOKEN_TTL,
        )
        .unwrap()
    }

    /// Tokens have the documented shape and are stored hashed.
    #[test]
    fn token_shape_and_hash() {
        let t = new_refresh_token().unwrap();
        assert!(t.starts_with("mgr_"));
        assert!(is_refresh_token_shaped(&t));
        assert!(!is_refresh_token_shaped("mgr_short"));
        assert!(!is_refresh_token_shaped(&t.replacen("mgr_", "mgx_", 1)));
        assert_ne!(t, new_refresh_token().unwrap());
        assert_eq!(hash_token(b"s", &t), hash_token(b"s", &t));
        assert_ne!(hash_token(b"s", &t), hash_token(b"t", &t));
    }

    /// A fresh token rotates until its 30 days are over.
    #[test]
    fn fresh_and_expiry() {
        let r = record();
        assert_eq!(r.expires_at - r.issued_at, REFRESH_TOKEN_TTL);
        assert_eq!(decide(&r, NOW), RefreshDecision::Rotate);
        assert_eq!(decide(&r, r.expires_at - 1), RefreshDecision::Rotate);
        assert_eq!(decide(&r, r.expires_at), RefreshDecision::Expired);
        assert_eq!(
            RefreshDecision::Expired.error().unwrap().code(),
            "REFRESH_TOKEN_EXPIRED"
        );
    }

    /// A family lives the lifetime it was issued with (`[auth]
    /// refresh_token_days`), and each successor that lifetime again.
    #[test]
    fn lifetime_is_the_configured_one() {
        let day = 86_400;
        let r = RefreshRecord::new_family("acme", "key:k", vec![], NOW, day).unwrap();
        assert_eq!(r.expires_at, NOW + day);
        assert_eq!(decide(&r, NOW + day - 1), RefreshDecision::Rotate);
        assert_eq!(decide(&r, NOW + day), RefreshDecision::Expired);
        let next = r.successor(NOW + 10, 7 * day);
        assert_eq!(next.expires_at, NOW + 10 + 7 * day);
    }

    /// A successor keeps its family's session and device.
    #[test]
    fn successor_keeps_session() {
        let mut r = record();
        r.session = Some("s1".into());
        r.device = Some("phone".into());
        let next = r.successor(NOW + 10, REFRESH_TOKEN_TTL);
        assert_eq!(next.session.as_deref(), Some("s1"));
        assert_eq!(next.device.as_deref(), Some("phone"));
    }

    /// The rotated token is accepted once within 60 s, then never.
    #[test]
    fn grace_window_once() {
        let mut r = record();
        let next = r.successor(NOW + 100, REFRESH_TOKEN_TTL);
        assert_eq!(next.family, r.family);
        assert_eq!(decide(&next, NOW + 100), RefreshDecision::Rotate);
        r.mark_rotated("abcd", NOW + 100);
        assert_eq!(decide(&r, NOW + 100), RefreshDecision::GraceReuse);
        assert_eq!(decide(&r, NOW + 160), RefreshDecision::GraceReuse);
        r.grace_used = true;
        assert_eq!(decide(&r, NOW + 110), RefreshDecision::ReuseDetected);
        assert_eq!(
            RefreshDecision::ReuseDetected.error().unwrap().code(),
            "REFRESH_TOKEN_REUSED"
        );
    }

    /// Reuse after the window revokes the family.
    #[test]
    fn reuse_after_window() {
        let mut r = record();
        r.mark_rotated("abcd", NOW + 100);
        assert_eq!(decide(&r, NOW + 161), RefreshDecision::ReuseDetected);
        // Even past expiry, a rotated token's reuse is reuse.
        assert_eq!(decide(&r, r.expires_at + 1), RefreshDecision::ReuseDetected);
    }

    /// Revoked beats everything.
    #[test]
    fn revoked() {
        let mut r = record();
        r.revoked = true;
        assert_eq!(decide(&r, NOW), RefreshDecision::Revoked);
        r.mark_rotated("abcd", NOW);
        assert_eq!(decide(&r, NOW), RefreshDecision::Revoked);
        assert!(RefreshDecision::Rotate.error().is_none());
        assert!(RefreshDecision::GraceReuse.error().is_none());
    }

    /// The record serializes for the store.
    #[test]
    fn serde_round_trip() {
        let mut r = record();
        r.mark_rotated("abcd", NOW);
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<RefreshRecord>(&json).unwrap(), r);
    }
}
