//! Store-backed identity: API key records, refresh token families and wallet
//! nonces (docs/design.md §3, §8). The pure formats and checks live in [`crate::auth`].

#![forbid(unsafe_code)]

use crate::auth::{self, AuthError, Grant, KeyKind, RefreshDecision, RefreshRecord, Role};
use crate::storage::{BatchOp, OrderedKv, Store, StoreError};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// What identity operations can fail with.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// A credential's format, signature or state was refused (mapped as [`AuthError`] is).
    #[error(transparent)]
    Auth(#[from] AuthError),
    /// The store failed; usually retryable.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A request field is out of bounds (400 `BAD_REQUEST`), the message says which.
    #[error("{0}")]
    BadInput(String),
    /// No such key in the namespace (404).
    #[error("not found")]
    NotFound,
    /// The wallet already has [`auth::MAX_OPEN_NONCES`] open challenges (429).
    #[error("too many open challenges for this wallet")]
    TooManyChallenges,
    /// The key's record is marked revoked (401 `API_KEY_REVOKED`).
    #[error("the API key was revoked")]
    KeyRevoked,
    /// The key is past its `expires_at` (401 `API_KEY_EXPIRED`).
    #[error("the API key expired")]
    KeyExpired,
}

/// The result of identity operations.
pub type IdResult<T> = Result<T, IdentityError>;

/// A stored API key (`keys/<hex hmac>`); the key itself is never stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiKeyRecord {
    /// Public id derived from the key's HMAC: listed, and used to revoke it.
    pub id: String,
    /// The namespace the key acts in (and whose key list shows it).
    pub namespace: String,
    /// A label its creator chose (at most 128 bytes); not unique.
    pub name: String,
    /// `sk` (control plane) or `rk` (data plane).
    pub kind: String,
    /// The role it was created with, for display; its grants are already in `grants`.
    pub role: Option<String>,
    /// Every grant the key holds (the role's, then the extra ones), as text.
    pub grants: Vec<String>,
    /// Unix seconds of creation.
    pub created_at: u64,
    /// Unix seconds after which the key is refused (at most
    /// [`auth::API_KEY_MAX_TTL_DAYS`] after creation).
    pub expires_at: u64,
    /// Set by a revoke; the record is kept so the key answers `API_KEY_REVOKED`.
    #[serde(default)]
    pub revoked: bool,
}

impl ApiKeyRecord {
    /// The grants that parse (a stored grant that no longer parses is skipped).
    pub fn parsed_grants(&self) -> Vec<Grant> {
        self.grants.iter().filter_map(|g| g.parse().ok()).collect()
    }
}

/// `keys/<hex hmac>`: the record of the key with this HMAC.
fn key_record_key(hash_hex: &str) -> Vec<u8> {
    format!("keys/{hash_hex}").into_bytes()
}

/// Index of a namespace's keys: `nskeys/<ns>/<id>` → hash hex.
fn ns_key_index(ns: &str, id: &str) -> Vec<u8> {
    format!("nskeys/{ns}/{id}").into_bytes()
}

/// What a new key is for.
pub struct NewKey<'a> {
    /// The namespace it will act in.
    pub namespace: &'a str,
    /// Its label, at most 128 bytes.
    pub name: &'a str,
    /// `sk` (control plane) or `rk` (data plane), written into the key.
    pub kind: KeyKind,
    /// A role whose grants it gets, before `grants`.
    pub role: Option<Role>,
    /// Extra grants on top of the role's.
    pub grants: Vec<Grant>,
    /// Lifetime, 1 to [`auth::API_KEY_MAX_TTL_DAYS`] days.
    pub expires_in_days: u64,
}

/// The writes that store a new key, and the key (shown once) with its record.
pub fn prepare_key(
    secret: &[u8],
    new: NewKey<'_>,
    now: u64,
) -> IdResult<(String, ApiKeyRecord, Vec<BatchOp>)> {
    if new.expires_in_days == 0 || new.expires_in_days > auth::API_KEY_MAX_TTL_DAYS {
        return Err(IdentityError::BadInput(format!(
            "expires_in_days must be 1..={}",
            auth::API_KEY_MAX_TTL_DAYS
        )));
    }
    if new.name.len() > 128 {
        return Err(IdentityError::BadInput(
            "name is at most 128 characters".into(),
        ));
    }
    let key = auth::generate_api_key(new.kind)?;
    let hash = auth::hash_api_key(secret, &key);
    let id = auth::key_id(&hash);
    let mut grants: Vec<String> = new
        .role
        .map(|r| r.grant_strs().iter().map(|s| s.to_string()).collect())
        .unwrap_or_default();
    grants.extend(new.grants.iter().map(|g| g.to_string()));
    let record = ApiKeyRecord {
        id: id.clone(),
        namespace: new.namespace.to_string(),
        name: new.name.to_string(),
        kind: new.kind.tag().to_string(),
        role: new.role.map(|r| r.as_str().to_string()),
        grants,
        created_at: now,
        expires_at: now + new.expires_in_days * 86_400,
        revoked: false,
    };
    let hash_hex = hex::encode(hash);
    let ops = vec![
        BatchOp::Put(
            key_record_key(&hash_hex),
            serde_json::to_vec(&record).expect("json"),
        ),
        BatchOp::Put(ns_key_index(new.namespace, &id), hash_hex.into_bytes()),
    ];
    Ok((key, record, ops))
}

/// Creates and stores a key; returns it (shown once) and its record.
pub async fn create_key(
    store: &Store,
    secret: &[u8],
    new: NewKey<'_>,
    now: u64,
) -> IdResult<(String, ApiKeyRecord)> {
    let (key, record, ops) = prepare_key(secret, new, now)?;
    store.apply_batch(ops).await?;
    Ok((key, record))
}

/// Checks an API key: format and checksum first (no lookup for a mistyped key),
/// then the stored record: present, not revoked, not expired.
pub async fn lookup_key(
    store: &Store,
    secret: &[u8],
    key: &str,
    now: u64,
) -> IdResult<ApiKeyRecord> {
    auth::parse_api_key(key)?;
    lookup_key_hash(store, &auth::hash_api_key(secret, key), now).await
}

/// The stored record of an already parsed key, by its HMAC: present, not
/// revoked, not expired.
/// A record whose MAC fails (edited in the store) authenticates nothing: 401
/// `INVALID_API_KEY`, as for no record (the store logged it).
pub async fn lookup_key_hash(store: &Store, hash: &[u8; 32], now: u64) -> IdResult<ApiKeyRecord> {
    let record: ApiKeyRecord = store
        .get_json(&key_record_key(&hex::encode(hash)))
        .await
        .map_err(refused_as(AuthError::InvalidApiKey))?
        .ok_or(IdentityError::Auth(AuthError::InvalidApiKey))?;
    if record.revoked {
        return Err(IdentityError::KeyRevoked);
    }
    if record.expires_at <= now {
        return Err(IdentityError::KeyExpired);
    }
    Ok(record)
}

/// A store error as the client sees it: a record refused for its MAC is
/// `as_auth` (the credential it would back holds nothing), the rest as they are.
fn refused_as(as_auth: AuthError) -> impl FnOnce(StoreError) -> IdentityError {
    move |e| match e {
        StoreError::Tampered(_) => IdentityError::Auth(as_auth),
        e => IdentityError::Store(e),
    }
}

/// One page of a namespace's keys (never the secrets), by id: those whose id sorts strictly
/// after `after` (None: from the first), at most `limit`, and the id the
/// next page resumes after (None on the last page). Reads the index from
/// `after` on, `limit + 1` entries at most (`Store::scan_page`). A record
/// refused for its MAC, or one of another namespace the index was edited to
/// name, is left out.
pub async fn list_keys_page(
    store: &Store,
    ns: &str,
    after: Option<&[u8]>,
    limit: usize,
) -> IdResult<(Vec<ApiKeyRecord>, Option<Vec<u8>>)> {
    let prefix = format!("nskeys/{ns}/").into_bytes();
    let after = after.map(|a| [prefix.as_slice(), a].concat());
    let (rows, last) = store.scan_page(&prefix, after.as_deref(), limit).await?;
    let mut out = Vec::new();
    for (_, hash) in rows {
        let hash = String::from_utf8_lossy(&hash).into_owned();
        match store.get_json::<ApiKeyRecord>(&key_record_key(&hash)).await {
            Ok(Some(r)) if r.namespace == ns => out.push(r),
            Ok(_) | Err(StoreError::Tampered(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok((out, last.map(|k| k[prefix.len()..].to_vec())))
}

/// Revokes a key of a namespace by id; effective on the next request.
pub async fn revoke_key(store: &Store, ns: &str, id: &str) -> IdResult<()> {
    let hash = store
        .get(&ns_key_index(ns, id))
        .await?
        .ok_or(IdentityError::NotFound)?;
    let hash = String::from_utf8_lossy(&hash).into_owned();
    let k = key_record_key(&hash);
    // A record refused for its MAC is never rewritten (that would MAC the
    // edit), nor one of another namespace an edited index names.
    let mut record: ApiKeyRecord = match store.get_json::<ApiKeyRecord>(&k).await {
        Ok(Some(r)) if r.namespace == ns => r,
        Ok(_) | Err(StoreError::Tampered(_)) => return Err(IdentityError::NotFound),
        Err(e) => return Err(e.into()),
    };
    record.revoked = true;
    store.put_json(&k, &record).await?;
    Ok(())
}

/// Every store key a namespace's identity data occupies (for namespace deletion).
pub async fn namespace_identity_keys(store: &Store, ns: &str) -> IdResult<Vec<Vec<u8>>> {
    let mut keys = Vec::new();
    for (idx, hash) in store.scan_all(format!("nskeys/{ns}/").as_bytes()).await? {
        keys.push(key_record_key(&String::from_utf8_lossy(&hash)));
        keys.push(idx);
    }
    for (k, _) in store.scan_all(format!("sess/{ns}/").as_bytes()).await? {
        keys.push(k);
    }
    Ok(keys)
}

fn refresh_key(hash_hex: &str) -> Vec<u8> {
    format!("rt/{hash_hex}").into_bytes()
}

fn family_key(family: &str, hash_hex: &str) -> Vec<u8> {
    format!("rtfam/{family}/{hash_hex}").into_bytes()
}

/// Issues the first refresh token of a new family.
pub async fn issue_refresh(
    store: &Store,
    secret: &[u8],
    ns: &str,
    subject: &str,
    grants: Vec<String>,
    now: u64,
    ttl: u64,
) -> IdResult<String> {
    let record = RefreshRecord::new_family(ns, subject, grants, now, ttl)?;
    store_refresh(store, secret, &record).await
}

async fn store_refresh(store: &Store, secret: &[u8], record: &RefreshRecord) -> IdResult<String> {
    let token = auth::new_refresh_token()?;
    let hash = hex::encode(auth::hash_refresh_token(secret, &token));
    let ttl = Duration::from_secs(record.expires_at.saturating_sub(record.issued_at).max(1));
    store
        .put_ttl(
            &refresh_key(&hash),
            &serde_json::to_vec(record).expect("json"),
            ttl,
        )
        .await?;
    store
        .put_ttl(&family_key(&record.family, &hash), b"", ttl)
        .await?;
    Ok(token)
}

/// Revokes every token of a family.
async fn revoke_family(store: &Store, family: &str) -> IdResult<()> {
    for (k, _) in store
        .scan_all(format!("rtfam/{family}/").as_bytes())
        .await?
    {
        let hash = String::from_utf8_lossy(&k[format!("rtfam/{family}/").len()..]).into_owned();
        let rk = refresh_key(&hash);
        if let Some(mut r) = store.get_json::<RefreshRecord>(&rk).await? {
            r.revoked = true;
            store.put_json(&rk, &r).await?;
        }
    }
    Ok(())
}

/// Rotates a refresh token: returns the record it speaks for and its successor.
/// A reuse after the grace window revokes the whole family. The rotation is a
/// compare-and-swap on the record, so two racing uses cannot both rotate.
pub async fn rotate_refresh(
    store: &Store,
    secret: &[u8],
    token: &str,
    now: u64,
    ttl: u64,
) -> IdResult<(RefreshRecord, String)> {
    if !auth::is_refresh_token_shaped(token) {
        return Err(AuthError::InvalidRefreshToken.into());
    }
    let hash = hex::encode(auth::hash_refresh_token(secret, token));
    let key = refresh_key(&hash);
    loop {
        let raw = store
            .get(&key)
            .await
            .map_err(refused_as(AuthError::InvalidRefreshToken))?
            .ok_or(IdentityError::Auth(AuthError::InvalidRefreshToken))?;
        let record: RefreshRecord = serde_json::from_slice(&raw)
            .map_err(|_| StoreError::Corrupt("refresh record".into()))?;
        let decision = auth::decide_refresh(&record, now);
        match decision {
            RefreshDecision::Rotate | RefreshDecision::GraceReuse => {
                let successor = record.successor(now, ttl);
                let mut updated = record.clone();
                if decision == RefreshDecision::GraceReuse {
                    updated.grace_used = true;
                    // The successor the client never saw is withdrawn.
                    if let Some(prev) = &record.successor_hash {
                        let pk = refresh_key(prev);
                        if let Some(mut p) = store.get_json::<RefreshRecord>(&pk).await? {
                            p.revoked = true;
                            store.put_json(&pk, &p).await?;
                        }
                    }
                }
                let new_token = auth::new_refresh_token()?;
                let new_hash = hex::encode(auth::hash_refresh_token(secret, &new_token));
                updated.mark_rotated(&new_hash, now);
                let ttl = Duration::from_secs(record.expires_at.saturating_sub(now).max(1));
                let swapped = store
                    .compare_and_swap(
                        &key,
                        Some(&raw),
                        Some(&serde_json::to_vec(&updated).expect("json")),
                        Some(ttl),
                    )
                    .await?;
                if !swapped {
                    continue;
                }
                let sttl = Duration::from_secs(successor.expires_at.saturating_sub(now).max(1));
                store
                    .put_ttl(
                        &refresh_key(&new_hash),
                        &serde_json::to_vec(&successor).expect("json"),
                        sttl,
                    )
                    .await?;
                store
                    .put_ttl(&family_key(&successor.family, &new_hash), b"", sttl)
                    .await?;
                return Ok((successor, new_token));
            }
            RefreshDecision::ReuseDetected => {
                revoke_family(store, &record.family).await?;
                return Err(AuthError::RefreshTokenReused.into());
            }
            RefreshDecision::Expired | RefreshDecision::Revoked => {
                return Err(decision
                    .error()
                    .unwrap_or(AuthError::InvalidRefreshToken)
                    .into());
            }
        }
    }
}

/// Logout: revokes the family of a refresh token.
pub async fn logout(store: &Store, secret: &[u8], token: &str) -> IdResult<()> {
    if !auth::is_refresh_token_shaped(token) {
        return Err(AuthError::InvalidRefreshToken.into());
    }
    let hash = hex::encode(auth::hash_refresh_token(secret, token));
    let record: RefreshRecord = store
        .get_json(&refresh_key(&hash))
        .await
        .map_err(refused_as(AuthError::InvalidRefreshToken))?
        .ok_or(IdentityError::Auth(AuthError::InvalidRefreshToken))?;
    revoke_family(store, &record.family).await
}

fn nonce_key(wallet: &str, nonce: &str) -> Vec<u8> {
    format!("nonce/{wallet}/{nonce}").into_bytes()
}

/// `nopen/<wallet>/<client>/<nonce>`: the open Ed25519 challenges of a
/// wallet asked for from one client network, counted against
/// [`auth::MAX_OPEN_NONCES`]; gone when the challenge expires or is spent.
fn nonce_open_key(wallet: &str, client: &str, nonce: &str) -> Vec<u8> {
    format!("nopen/{wallet}/{client}/{nonce}").into_bytes()
}

/// Opens a wallet challenge: at most [`auth::MAX_OPEN_NONCES`] open per
/// wallet and client network (`client`: its IPv4 address or IPv6 /64), so a client
/// that opens many for someone else's wallet fills only its own cap.
/// The challenge is valid `ttl` seconds (`auth.challenge_seconds`).
pub async fn open_challenge(
    store: &Store,
    wallet: &str,
    client: &str,
    ns: &str,
    now: u64,
    ttl: u64,
) -> IdResult<String> {
    let wallet = auth::normalize_wallet(wallet)?;
    let open = store
        .scan_prefix(
            format!("nopen/{wallet}/{client}/").as_bytes(),
            auth::MAX_OPEN_NONCES + 1,
        )
        .await?;
    if open.len() >= auth::MAX_OPEN_NONCES {
        return Err(IdentityError::TooManyChallenges);
    }
    let nonce = auth::new_nonce()?;
    let message = auth::challenge_message(&wallet, ns, &nonce, now, now + ttl);
    // The nonce's value: the namespace, a newline, the client network (for
    // the verify to close its open entry).
    store
        .put_ttl(
            &nonce_key(&wallet, &nonce),
            format!("{ns}\n{client}").as_bytes(),
            Duration::from_secs(ttl),
        )
        .await?;
    store
        .put_ttl(
            &nonce_open_key(&wallet, client, &nonce),
            b"",
            Duration::from_secs(ttl),
        )
        .await?;
    Ok(message)
}

/// Verifies a signed challenge and spends its nonce by compare-and-swap, so a
/// signature logs in once. Returns the challenge.
pub async fn verify_challenge(
    store: &Store,
    message: &str,
    signature: &str,
    now: u64,
) -> IdResult<auth::Challenge> {
    let ch = auth::parse_challenge(message)?;
    if ch.is_expired(now) {
        return Err(AuthError::ChallengeExpired.into());
    }
    auth::verify_wallet_signature(&ch.wallet, message.as_bytes(), signature)?;
    let key = nonce_key(&ch.wallet, &ch.nonce);
    let raw = store
        .get(&key)
        .await
        .map_err(refused_as(AuthError::NonceSpent))?
        .ok_or(IdentityError::Auth(AuthError::NonceSpent))?;
    let value = String::from_utf8_lossy(&raw).into_owned();
    let (ns, client) = value.split_once('\n').unwrap_or((value.as_str(), ""));
    if ns != ch.namespace {
        return Err(AuthError::NonceSpent.into());
    }
    if !store.compare_and_swap(&key, Some(&raw), None, None).await? {
        return Err(AuthError::NonceSpent.into());
    }
    if !client.is_empty() {
        store
            .delete(&nonce_open_key(&ch.wallet, client, &ch.nonce))
            .await?;
    }
    Ok(ch)
}

/// How long a Sign-In with Ethereum challenge is kept past its expiry, in
/// seconds: a late verify is told `CHALLENGE_EXPIRED` rather than that no
/// such challenge was issued.
const SIWE_KEEP_EXPIRED: u64 = 60;

/// `siwe/c/<nonce>`: a Sign-In with Ethereum challenge the node issued.
fn siwe_key(nonce: &str) -> Vec<u8> {
    format!("siwe/c/{nonce}").into_bytes()
}

/// `siwe/a/<address>/<client>/<nonce>`: the open challenges of an address
/// (lower case, `0x`) asked for from one client network,
/// counted against [`auth::MAX_OPEN_NONCES`]; gone when the challenge
/// expires or is spent.
fn siwe_open_key(address: &str, client: &str, nonce: &str) -> Vec<u8> {
    format!("siwe/a/{address}/{client}/{nonce}").into_bytes()
}

/// What the node keeps of a Sign-In with Ethereum challenge it issued.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SiweChallenge {
    /// The message exactly as issued; verify compares the bytes.
    pub message: String,
    /// The namespace it signs in to.
    pub namespace: String,
    /// The address, lower case with `0x`.
    pub address: String,
    /// The chain the wallet signs for.
    pub chain_id: u64,
    /// Unix seconds of the message's `Expiration Time`.
    pub expires_at: u64,
    /// Set when a verify signed in with it: a second use is `NONCE_SPENT`.
    #[serde(default)]
    pub spent: bool,
    /// The client network it was asked for from (whose cap it counts in).
    #[serde(default)]
    pub client: String,
}

/// Who issues a Sign-In with Ethereum challenge: the node's domain
/// (`server.base_domain`) and URI (its public URL).
pub struct SiweIssuer<'a> {
    /// The message's domain.
    pub domain: &'a str,
    /// The message's `URI`.
    pub uri: &'a str,
    /// How long the challenge is valid, in seconds.
    pub ttl: u64,
}

/// Opens a Sign-In with Ethereum challenge for `address` (any accepted
/// form; EIP-55 checked) on chain `chain_id` to sign in to `ns`: at most
/// [`auth::MAX_OPEN_NONCES`] open per address and client network (`client`).
pub async fn open_siwe_challenge(
    store: &Store,
    issuer: &SiweIssuer<'_>,
    address: &str,
    chain_id: u64,
    ns: &str,
    client: &str,
    now: u64,
) -> IdResult<SiweChallenge> {
    let address = auth::normalize_evm_address(address)?;
    let open = store
        .scan_prefix(
            format!("siwe/a/{address}/{client}/").as_bytes(),
            auth::MAX_OPEN_NONCES + 1,
        )
        .await?;
    if open.len() >= auth::MAX_OPEN_NONCES {
        return Err(IdentityError::TooManyChallenges);
    }
    let nonce = auth::new_siwe_nonce()?;
    let expires_at = now + issuer.ttl;
    let message = auth::SiweMessage::for_namespace(
        issuer.domain,
        issuer.uri,
        &auth::checksum_address(&address),
        chain_id,
        ns,
        &nonce,
        now,
        expires_at,
    )
    .render();
    let record = SiweChallenge {
        message,
        namespace: ns.to_string(),
        address: address.clone(),
        chain_id,
        expires_at,
        spent: false,
        client: client.to_string(),
    };
    store
        .put_ttl(
            &siwe_key(&nonce),
            &serde_json::to_vec(&record).expect("json"),
            Duration::from_secs(issuer.ttl + SIWE_KEEP_EXPIRED),
        )
        .await?;
    store
        .put_ttl(
            &siwe_open_key(&address, client, &nonce),
            b"",
            Duration::from_secs(issuer.ttl),
        )
        .await?;
    Ok(record)
}

/// Verifies a signed Sign-In with Ethereum message: for this node's
/// `domain`, naming a challenge the node issued (`UNKNOWN_CHALLENGE`) and
/// did not spend (`NONCE_SPENT`), on that challenge's chain, unexpired,
/// byte for byte the message issued (`SIWE_MESSAGE_ALTERED`), and signed
/// (EIP-191) by its address. Spends the nonce by compare-and-swap, so a
/// signature logs in once. Returns the challenge.
pub async fn verify_siwe(
    store: &Store,
    domain: &str,
    message: &str,
    signature: &str,
    now: u64,
) -> IdResult<SiweChallenge> {
    let parsed = auth::parse_siwe(message)?;
    auth::normalize_evm_address(&parsed.address)?;
    if parsed.domain != domain {
        return Err(AuthError::SiweDomainMismatch.into());
    }
    let key = siwe_key(&parsed.nonce);
    let raw = store
        .get(&key)
        .await
        .map_err(refused_as(AuthError::UnknownChallenge))?
        .ok_or(IdentityError::Auth(AuthError::UnknownChallenge))?;
    let issued: SiweChallenge = serde_json::from_slice(&raw)
        .map_err(|_| StoreError::Corrupt("sign-in challenge".into()))?;
    if issued.spent {
        return Err(AuthError::NonceSpent.into());
    }
    if parsed.chain_id != issued.chain_id {
        return Err(AuthError::SiweChainMismatch.into());
    }
    if now >= issued.expires_at {
        return Err(AuthError::ChallengeExpired.into());
    }
    if message != issued.message {
        return Err(AuthError::SiweMessageAltered.into());
    }
    let signer = auth::recover_address(message.as_bytes(), signature)?;
    if signer != issued.address {
        return Err(AuthError::BadWalletSignature.into());
    }
    let spent = SiweChallenge {
        spent: true,
        ..issued.clone()
    };
    let keep = Duration::from_secs((issued.expires_at + SIWE_KEEP_EXPIRED).saturating_sub(now));
    let swapped = store
        .compare_and_swap(
            &key,
            Some(&raw),
            Some(&serde_json::to_vec(&spent).expect("json")),
            Some(keep),
        )
        .await?;
    if !swapped {
        return Err(AuthError::NonceSpent.into());
    }
    store
        .delete(&siwe_open_key(
            &issued.address,
            &issued.client,
            &parsed.nonce,
        ))
        .await?;
    Ok(issued)
}

/// Who is calling, as resolved by authentication (or carried by a cluster
/// hop): shared, so the credential caches and the request's extensions hold
/// the same one (a clone per request was an allocation per field, about 1.5%
/// of a KV read through the chain, BENCHMARKS.md). Its fields are read
/// through [`Deref`](std::ops::Deref) to [`IdentityData`].
#[derive(Clone)]
pub struct Identity(std::sync::Arc<IdentityData>);

impl std::ops::Deref for Identity {
    type Target = IdentityData;
    fn deref(&self) -> &IdentityData {
        &self.0
    }
}

impl From<IdentityData> for Identity {
    fn from(d: IdentityData) -> Identity {
        Identity(std::sync::Arc::new(d))
    }
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// What an [`Identity`] says about its caller.
#[derive(Debug, Clone)]
pub struct IdentityData {
    /// `operator`, `key:<id>` for an API key, or a JWT's `sub` (`key:<id>` or
    /// `wallet:<address>`, whatever it was issued for); a hop carries the original's.
    pub subject: String,
    /// The credential's namespace; None for the operator.
    pub namespace: Option<String>,
    /// Grants (`domain:action:resource-glob`).
    pub grants: Vec<crate::auth::Grant>,
    /// The operator may act on any namespace.
    pub operator: bool,
    /// `operator`, `admin_session` (dashboard login), `api_key`, `jwt` or `hop`.
    pub kind: &'static str,
    /// Custom claims (JWT) as JSON.
    pub custom: serde_json::Value,
    /// JWT id when the credential is a JWT (a hop carries it on).
    pub jti: Option<String>,
    /// JWT expiry, Unix seconds.
    pub exp: Option<u64>,
    /// JWT issue time, Unix seconds.
    pub iat: Option<u64>,
    /// The device a JWT's sign-in named (`did`; a hop carries it on).
    pub device: Option<String>,
    /// A JWT's session (`sid`; a hop carries it on).
    pub session: Option<String>,
}

impl Identity {
    /// The identity of API key `key_id` of namespace `namespace`.
    pub fn api_key(key_id: &str, namespace: &str, grants: Vec<crate::auth::Grant>) -> Identity {
        Identity::from(IdentityData {
            subject: format!("key:{key_id}"),
            namespace: Some(namespace.to_string()),
            grants,
            operator: false,
            kind: "api_key",
            custom: serde_json::Value::Null,
            jti: None,
            exp: None,
            iat: None,
            device: None,
            session: None,
        })
    }

    /// Whether this identity may do `domain:action` on `resource`.
    pub fn allows(&self, domain: &str, action: &str, resource: &str) -> bool {
        self.operator || crate::auth::allows(&self.grants, domain, action, resource)
    }
}

/// One sign-in's session, as `GET /v1/auth/sessions` lists it
/// (`sess/<ns>/<subject>/<sid>`; kept as long as its refresh family).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SessionRecord {
    /// The session id (`sid` claim).
    pub sid: String,
    /// The device the sign-in named (`did` claim), if any.
    pub device_id: Option<String>,
    /// Unix seconds of the sign-in.
    pub created_at: u64,
    /// Unix seconds of the last refresh; None until the first.
    pub last_refresh_at: Option<u64>,
    /// Unix seconds after which its refresh token expires (unless refreshed).
    pub expires_at: u64,
    /// The refresh family it lives in (never shown to clients).
    #[serde(default)]
    family: String,
}

/// `sess/<ns>/<subject>/`: the sessions of a subject in a namespace
/// (neither a namespace name nor a subject holds a `/`).
fn session_prefix(ns: &str, subject: &str) -> Vec<u8> {
    format!("sess/{ns}/{subject}/").into_bytes()
}

fn session_key(ns: &str, subject: &str, sid: &str) -> Vec<u8> {
    format!("sess/{ns}/{subject}/{sid}").into_bytes()
}

/// `srev/`: the ended sessions whose access tokens may still be unexpired.
pub const REVOKED_PREFIX: &str = "srev/";

fn revoked_key(sid: &str) -> Vec<u8> {
    format!("{REVOKED_PREFIX}{sid}").into_bytes()
}

/// What a sign-in names: its namespace, subject, grants and device.
pub struct SignIn<'a> {
    /// The namespace the tokens are for.
    pub namespace: &'a str,
    /// The subject they are issued to.
    pub subject: &'a str,
    /// Grant strings of the access tokens.
    pub grants: Vec<String>,
    /// The client's `device_id` (already checked).
    pub device: Option<&'a str>,
}

/// Opens a session: a fresh `sid`, its record, and the first refresh token
/// of its family (valid `ttl` seconds). Returns the refresh token and sid.
pub async fn open_session(
    store: &Store,
    secret: &[u8],
    sign_in: SignIn<'_>,
    now: u64,
    ttl: u64,
) -> IdResult<(String, String)> {
    let sid = auth::new_session_id()?;
    let mut record =
        RefreshRecord::new_family(sign_in.namespace, sign_in.subject, sign_in.grants, now, ttl)?;
    record.session = Some(sid.clone());
    record.device = sign_in.device.map(str::to_string);
    let session = SessionRecord {
        sid: sid.clone(),
        device_id: record.device.clone(),
        created_at: now,
        last_refresh_at: None,
        expires_at: record.expires_at,
        family: record.family.clone(),
    };
    store
        .put_ttl(
            &session_key(sign_in.namespace, sign_in.subject, &sid),
            &serde_json::to_vec(&session).expect("json"),
            Duration::from_secs(ttl.max(1)),
        )
        .await?;
    let token = store_refresh(store, secret, &record).await?;
    Ok((token, sid))
}

/// Notes a refresh of the session `record` speaks for (its successor's
/// expiry, `last_refresh_at`). A session that was ended meanwhile (its record
/// gone: a refresh racing the end) revokes the family and is refused, so an
/// ended session never gets a token after the end answered.
pub async fn touch_session(store: &Store, record: &RefreshRecord, now: u64) -> IdResult<()> {
    let Some(sid) = &record.session else {
        return Ok(());
    };
    let key = session_key(&record.namespace, &record.subject, sid);
    loop {
        let Some(raw) = store.get(&key).await? else {
            revoke_family(store, &record.family).await?;
            return Err(AuthError::SessionRevoked.into());
        };
        let mut s: SessionRecord = serde_json::from_slice(&raw)
            .map_err(|_| StoreError::Corrupt("session record".into()))?;
        s.last_refresh_at = Some(now);
        s.expires_at = record.expires_at;
        let ttl = Duration::from_secs(record.expires_at.saturating_sub(now).max(1));
        let new = serde_json::to_vec(&s).expect("json");
        if store
            .compare_and_swap(&key, Some(&raw), Some(&new), Some(ttl))
            .await?
        {
            return Ok(());
        }
    }
}

/// One page of the sessions of `subject` in `ns`, by sid: as
/// [`list_keys_page`] pages.
pub async fn list_sessions_page(
    store: &Store,
    ns: &str,
    subject: &str,
    after: Option<&[u8]>,
    limit: usize,
) -> IdResult<(Vec<SessionRecord>, Option<Vec<u8>>)> {
    let prefix = session_prefix(ns, subject);
    let after = after.map(|a| [prefix.as_slice(), a].concat());
    let (rows, last) = store.scan_page(&prefix, after.as_deref(), limit).await?;
    let out = rows
        .iter()
        .filter_map(|(_, v)| serde_json::from_slice::<SessionRecord>(v).ok())
        .collect();
    Ok((out, last.map(|k| k[prefix.len()..].to_vec())))
}

/// Ends session `sid` of `subject` in `ns`: its refresh family is revoked
/// (refused at once on every node: the store is read on each refresh), the
/// sid goes on the revocation list for `revoke_for` seconds (the access
/// token lifetime plus its leeway) and the record is deleted. False when
/// the subject has no such session.
pub async fn end_session(
    store: &Store,
    ns: &str,
    subject: &str,
    sid: &str,
    now: u64,
    revoke_for: u64,
) -> IdResult<bool> {
    if !auth::is_session_id_shaped(sid) {
        return Ok(false);
    }
    let key = session_key(ns, subject, sid);
    let Some(s) = store.get_json::<SessionRecord>(&key).await? else {
        return Ok(false);
    };
    store
        .put_ttl(
            &revoked_key(sid),
            (now + revoke_for).to_string().as_bytes(),
            Duration::from_secs(revoke_for.max(1)),
        )
        .await?;
    store.delete(&key).await?;
    revoke_family(store, &s.family).await?;
    Ok(true)
}

/// Most sessions one subject holds in one namespace; a sign-in past it ends
/// the subject's oldest session first (docs/auth.md, "Sessions and devices").
pub const MAX_SESSIONS_PER_SUBJECT: usize = 100;

/// Makes room for one more session of `subject` in `ns`: while it holds
/// [`MAX_SESSIONS_PER_SUBJECT`] or more, its oldest is ended (as
/// [`end_session`]). Reads at most that many records.
pub async fn make_room_for_session(
    store: &Store,
    ns: &str,
    subject: &str,
    now: u64,
    revoke_for: u64,
) -> IdResult<()> {
    let (rows, _) = store
        .scan_page(&session_prefix(ns, subject), None, MAX_SESSIONS_PER_SUBJECT)
        .await?;
    if rows.len() < MAX_SESSIONS_PER_SUBJECT {
        return Ok(());
    }
    let mut held: Vec<SessionRecord> = rows
        .iter()
        .filter_map(|(_, v)| serde_json::from_slice::<SessionRecord>(v).ok())
        .collect();
    held.sort_by_key(|s| s.created_at);
    let excess = held.len() + 1 - MAX_SESSIONS_PER_SUBJECT;
    for s in held.iter().take(excess) {
        end_session(store, ns, subject, &s.sid, now, revoke_for).await?;
    }
    Ok(())
}

/// Ends every session of `subject` in `ns` signed in with `device`; the
/// sids ended.
pub async fn end_device_sessions(
    store: &Store,
    ns: &str,
    subject: &str,
    device: &str,
    now: u64,
    revoke_for: u64,
) -> IdResult<Vec<String>> {
    let mut ended = Vec::new();
    for (_, v) in store.scan_all(&session_prefix(ns, subject)).await? {
        let Ok(s) = serde_json::from_slice::<SessionRecord>(&v) else {
            continue;
        };
        if s.device_id.as_deref() == Some(device)
            && end_session(store, ns, subject, &s.sid, now, revoke_for).await?
        {
            ended.push(s.sid);
        }
    }
    Ok(ended)
}

/// The ended sessions whose access tokens may still be live, sid → the unix
/// second the entry lapses, as the store has them now.
pub async fn revoked_sessions(store: &Store) -> IdResult<Vec<(String, u64)>> {
    let rows = store.scan_all(REVOKED_PREFIX.as_bytes()).await?;
    Ok(rows
        .into_iter()
        .filter_map(|(k, v)| {
            let sid = std::str::from_utf8(&k[REVOKED_PREFIX.len()..]).ok()?;
            let until = std::str::from_utf8(&v).ok()?.parse().ok()?;
            Some((sid.to_string(), until))
        })
        .collect())
}

/// How often a node re-reads the store's revocation list whatever its watch
/// on the list reports: an access token of a session ended through another
/// node is refused here at most this long (plus one store read) after the
/// end was answered, and on etcd usually within the watch's milliseconds.
/// The node that ended it refuses at once.
pub const REVOCATION_POLL: Duration = Duration::from_secs(2);

/// The node's copy of the ended sessions (sid → the unix second its entry
/// lapses). Checked on every request with a session token: a relaxed atomic
/// load while nothing is revoked, a read-locked map lookup otherwise.
#[derive(Default)]
pub struct RevokedSessions {
    /// Entries in `map`; 0 lets the hot path skip the lock.
    len: std::sync::atomic::AtomicUsize,
    map: parking_lot::RwLock<std::collections::HashMap<String, u64>>,
}

impl IdentityData {
    /// Why a credential that was good when a socket opened is no longer
    /// (its token expired, its session was ended), or None while it holds.
    /// API keys and the operator key have neither: they end with the socket.
    pub fn ended(&self, revoked: &RevokedSessions, now: u64) -> Option<&'static str> {
        if self
            .exp
            .is_some_and(|exp| now > exp.saturating_add(crate::auth::JWT_LEEWAY))
        {
            return Some("the token expired");
        }
        match &self.session {
            Some(sid) if revoked.contains(sid, now) => Some("the session was ended"),
            _ => None,
        }
    }

    /// Whether [`IdentityData::ended`] can ever say so (a token: it expires).
    pub fn may_end(&self) -> bool {
        self.exp.is_some() || self.session.is_some()
    }
}

impl RevokedSessions {
    /// Whether `sid` was ended and its entry has not lapsed at `now`.
    pub fn contains(&self, sid: &str, now: u64) -> bool {
        if self.len.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            return false;
        }
        self.map.read().get(sid).is_some_and(|until| *until > now)
    }

    /// Adds an ended session (this node ended it: refused here at once).
    pub fn insert(&self, sid: &str, until: u64) {
        let mut m = self.map.write();
        m.insert(sid.to_string(), until);
        self.len
            .store(m.len(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Merges the store's list in and drops lapsed entries.
    pub fn merge(&self, from_store: Vec<(String, u64)>, now: u64) {
        let mut m = self.map.write();
        m.retain(|_, until| *until > now);
        for (sid, until) in from_store {
            if until > now {
                m.insert(sid, until);
            }
        }
        self.len
            .store(m.len(), std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The set answers while an entry lasts, skips the lock while empty,
    /// and a merge drops lapsed entries while keeping the local ones.
    #[test]
    fn revoked_sessions_set() {
        let r = RevokedSessions::default();
        assert!(!r.contains("s_a", 100));
        r.insert("s_a", 200);
        assert!(r.contains("s_a", 100));
        assert!(!r.contains("s_a", 200), "lapsed at its end");
        assert!(!r.contains("s_b", 100));
        r.merge(vec![("s_b".into(), 300), ("s_old".into(), 50)], 100);
        assert!(r.contains("s_a", 150) && r.contains("s_b", 150));
        assert!(
            !r.contains("s_old", 40),
            "a lapsed store entry is not taken"
        );
        r.merge(Vec::new(), 250);
        assert!(!r.contains("s_a", 150), "dropped once lapsed");
        assert!(r.contains("s_b", 260));
        r.merge(Vec::new(), 400);
        assert_eq!(r.len.load(std::sync::atomic::Ordering::Relaxed), 0);
    }
}
