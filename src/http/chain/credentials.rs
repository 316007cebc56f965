//! The credential caches of authentication (step 8, `access.rs`): JWTs
//! already verified and API key records recently read. The node holds them
//! (`state.rs`); nothing here knows the node or the request.

use crate::auth;
use crate::identity::Identity;
use crate::util::{Clock, SystemClock};

/// Tokens whose signature and claims were already verified, by SHA-256 of the
/// token, until they expire: an EdDSA verification costs ~200 µs here, a
/// look-up ~1 µs. Bounded; expired entries are dropped first, then all.
#[derive(Default)]
pub struct TokenCache {
    /// SHA-256 of the token to its identity and `exp` (Unix seconds; believed
    /// until `exp` plus the JWT leeway), at most [`TOKEN_CACHE_CAPACITY`].
    map: parking_lot::Mutex<std::collections::HashMap<[u8; 32], (Identity, u64)>>,
}

/// Most verified tokens remembered at once.
pub const TOKEN_CACHE_CAPACITY: usize = 10_000;

impl TokenCache {
    /// The identity of a token verified before and not yet expired.
    pub(crate) fn get(&self, fingerprint: &[u8; 32], now: u64) -> Option<Identity> {
        let mut map = self.map.lock();
        match map.get(fingerprint) {
            Some((id, exp)) if now <= exp + auth::JWT_LEEWAY => Some(id.clone()),
            Some(_) => {
                map.remove(fingerprint);
                None
            }
            None => None,
        }
    }

    /// Remembers a verified token until `exp`; when full, drops the expired, else all.
    pub(crate) fn insert(&self, fingerprint: [u8; 32], id: Identity, exp: u64, now: u64) {
        let mut map = self.map.lock();
        if map.len() >= TOKEN_CACHE_CAPACITY {
            map.retain(|_, (_, e)| now <= *e + auth::JWT_LEEWAY);
            if map.len() >= TOKEN_CACHE_CAPACITY {
                map.clear();
            }
        }
        map.insert(fingerprint, (id, exp));
    }
}

/// API keys whose stored record was read (present, not revoked, not
/// expired), by the key's HMAC, for at most `KEY_CACHE_TTL`: the
/// authentication of a key then costs its checksum, one HMAC and a look-up
/// instead of a store read and a JSON decode. A revocation or a namespace
/// deletion through this node empties the cache at once; on the other nodes
/// of a cluster a revoked key keeps working for at most `KEY_CACHE_TTL`.
pub struct KeyCache {
    /// The key's HMAC to its identity, the record's `expires_at` (Unix
    /// seconds) and when the record was read; at most [`TOKEN_CACHE_CAPACITY`] entries.
    map: parking_lot::Mutex<
        std::collections::HashMap<[u8; 32], (Identity, u64, std::time::Instant)>,
    >,
    /// Where the read times and their age come from ([`SystemClock`] but in tests).
    clock: std::sync::Arc<dyn Clock>,
}

impl Default for KeyCache {
    fn default() -> Self {
        Self::with_clock(std::sync::Arc::new(SystemClock))
    }
}

/// How long a key record read from the store is believed.
pub const KEY_CACHE_TTL: std::time::Duration = std::time::Duration::from_secs(1);

impl KeyCache {
    /// An empty cache reading time from `clock`.
    pub fn with_clock(clock: std::sync::Arc<dyn Clock>) -> KeyCache {
        KeyCache {
            map: Default::default(),
            clock,
        }
    }

    /// Whether a record read at `read` is still believed.
    fn fresh(&self, read: std::time::Instant) -> bool {
        self.clock.now().saturating_duration_since(read) < KEY_CACHE_TTL
    }

    /// The identity of a key read less than [`KEY_CACHE_TTL`] ago and not expired.
    pub(crate) fn get(&self, hash: &[u8; 32], now: u64) -> Option<Identity> {
        let mut map = self.map.lock();
        match map.get(hash) {
            Some((id, expires_at, read)) if self.fresh(*read) && now < *expires_at => {
                Some(id.clone())
            }
            Some(_) => {
                map.remove(hash);
                None
            }
            None => None,
        }
    }

    /// Remembers a key just read from the store; when full, drops the stale, else all.
    pub(crate) fn insert(&self, hash: [u8; 32], id: Identity, expires_at: u64) {
        let mut map = self.map.lock();
        if map.len() >= TOKEN_CACHE_CAPACITY {
            map.retain(|_, (_, _, read)| self.fresh(*read));
            if map.len() >= TOKEN_CACHE_CAPACITY {
                map.clear();
            }
        }
        map.insert(hash, (id, expires_at, self.clock.now()));
    }

    /// Forgets every key (a key was revoked or a namespace deleted).
    pub fn clear(&self) {
        self.map.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> Identity {
        Identity::api_key("k", "n", Vec::new())
    }

    /// A cached key is believed for `KEY_CACHE_TTL` at most, never past its
    /// own expiry, and not at all after `clear` (a revocation).
    #[test]
    fn key_cache_believes_a_record_briefly() {
        let clock = std::sync::Arc::new(crate::util::ManualClock::default());
        let c = KeyCache::with_clock(clock.clone());
        let (h1, h2, h3) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        c.insert(h1, id(), 1_000);
        c.insert(h2, id(), 1_000);
        assert_eq!(
            c.get(&h1, 999).map(|i| i.subject.clone()),
            Some("key:k".into())
        );
        assert!(c.get(&h2, 1_000).is_none(), "past the key's expiry");
        assert!(c.get(&h3, 0).is_none());
        c.clear();
        assert!(c.get(&h1, 999).is_none(), "cleared by a revocation");
        c.insert(h1, id(), 1_000);
        let tick = std::time::Duration::from_millis(1);
        clock.advance(KEY_CACHE_TTL - tick);
        assert!(c.get(&h1, 999).is_some(), "just younger than the TTL");
        clock.advance(tick);
        assert!(c.get(&h1, 999).is_none(), "as old as the cache's TTL");
    }

    /// When full, the insert drops the records older than `KEY_CACHE_TTL`
    /// and keeps the fresh ones.
    #[test]
    fn key_cache_when_full_drops_the_stale_first() {
        let clock = std::sync::Arc::new(crate::util::ManualClock::default());
        let c = KeyCache::with_clock(clock.clone());
        let hash = |i: usize| {
            let mut h = [0u8; 32];
            h[..8].copy_from_slice(&(i as u64).to_le_bytes());
            h
        };
        for i in 0..TOKEN_CACHE_CAPACITY - 1 {
            c.insert(hash(i), id(), 1_000);
        }
        clock.advance(KEY_CACHE_TTL);
        let fresh = hash(TOKEN_CACHE_CAPACITY - 1);
        c.insert(fresh, id(), 1_000);
        c.insert(hash(TOKEN_CACHE_CAPACITY), id(), 1_000);
        assert_eq!(c.map.lock().len(), 2, "the stale records were dropped");
        assert!(c.get(&fresh, 999).is_some(), "the fresh one was kept");
    }

    /// A verified token is believed until its `exp` plus the JWT leeway (the
    /// time is the caller's Unix seconds, passed in: no clock to wait on).
    #[test]
    fn token_cache_believes_a_token_until_it_expires() {
        let c = TokenCache::default();
        let f = [7u8; 32];
        c.insert(f, id(), 1_000, 900);
        assert!(c.get(&f, 1_000 + auth::JWT_LEEWAY).is_some());
        assert!(
            c.get(&f, 1_001 + auth::JWT_LEEWAY).is_none(),
            "past exp and the leeway"
        );
        assert!(c.get(&f, 900).is_none(), "an expired entry is dropped");
    }
}
