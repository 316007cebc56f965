//! `/v1/auth/*`: token exchange, refresh rotation, logout, whoami, wallet sign-in
//! and API keys (docs/design.md §3), plus the authentication step's credential check.

use super::{NsCtx, now};
use crate::auth::{self, Claims, Grant, KeyKind, Role, WalletAllow, WalletSignIn};
use crate::error::Code;
use crate::http::chain::Identity;
use crate::http::error::{ApiError, ApiResult};
use crate::http::policy::{Policy, RouteTable};
use crate::http::state::Node;
use crate::identity::{self, NewKey};
use crate::util::{Clock, SystemClock};
use actix_web::http::Method;
use actix_web::{HttpResponse, web};
use serde::Deserialize;
use serde_json::json;

/// Adds these routes and their policies to the node's route table.
pub fn register(t: &mut RouteTable) {
    t.add(
        Method::POST,
        "/v1/auth/token",
        Policy::Credential,
        web::post().to(token),
    )
    .add(
        Method::POST,
        "/v1/auth/refresh",
        Policy::Credential,
        web::post().to(refresh),
    )
    .add(
        Method::POST,
        "/v1/auth/logout",
        Policy::Credential,
        web::post().to(logout),
    )
    .add(
        Method::POST,
        "/v1/auth/challenge",
        Policy::Credential,
        web::post().to(challenge),
    )
    .add(
        Method::POST,
        "/v1/auth/verify",
        Policy::Credential,
        web::post().to(verify),
    )
    .add(
        Method::GET,
        "/v1/auth/whoami",
        Policy::ns("", ""),
        web::get().to(whoami),
    )
    .add(
        Method::POST,
        "/v1/auth/api-keys",
        Policy::NsCredential {
            domain: "keys",
            action: "write",
        },
        web::post().to(create_key),
    )
    .add(
        Method::GET,
        "/v1/auth/api-keys",
        Policy::ns("keys", "read"),
        web::get().to(list_keys),
    )
    .add(
        Method::DELETE,
        "/v1/auth/api-keys/{id}",
        Policy::ns("keys", "write"),
        web::delete().to(revoke_key),
    )
    .add(
        Method::GET,
        "/v1/namespaces/{namespace}/wallet-sign-in",
        Policy::ns("namespace", "admin"),
        web::get().to(show_wallet_sign_in),
    )
    .add(
        Method::PUT,
        "/v1/namespaces/{namespace}/wallet-sign-in",
        Policy::ns("namespace", "admin"),
        web::put().to(set_wallet_sign_in),
    );
}

/// The authentication step's check of a presented credential: the operator key,
/// an API key (checksum first, then the record), or a JWT.
pub async fn authenticate(node: &Node, cred: &str) -> ApiResult<Identity> {
    if node.secrets.is_operator_key(cred) {
        return Ok(Identity::from(crate::identity::IdentityData {
            subject: "operator".into(),
            namespace: None,
            grants: Vec::new(),
            operator: true,
            kind: "operator",
            custom: serde_json::Value::Null,
            jti: None,
            exp: None,
            iat: None,
        }));
    }
    if cred.starts_with("mg_") {
        // Checksum first: a mistyped key never reaches the cache or the store.
        auth::parse_api_key(cred).map_err(identity::IdentityError::from)?;
        let hash = node.secrets.api_key_hash(cred);
        let t = now();
        if let Some(id) = node.key_cache.get(&hash, t) {
            return Ok(id);
        }
        let r = identity::lookup_key_hash(&node.store, &hash, t).await?;
        let id = Identity::api_key(&r.id, &r.namespace, r.parsed_grants());
        node.key_cache.insert(hash, id.clone(), r.expires_at);
        return Ok(id);
    }
    if cred.starts_with("mgop_") {
        return Err(ApiError::new(
            Code::InvalidOperatorKey,
            "the operator key is wrong",
        ));
    }
    let t = now();
    let digest = ring::digest::digest(&ring::digest::SHA256, cred.as_bytes());
    let fingerprint: [u8; 32] = digest.as_ref().try_into().expect("32 bytes");
    if let Some(id) = node.token_cache.get(&fingerprint, t) {
        return Ok(id);
    }
    let iss = &node.config.server.public_url;
    let c = node.jwt.verify(cred, t, iss, iss)?;
    let id = Identity::from(crate::identity::IdentityData {
        subject: c.sub.clone(),
        namespace: Some(c.namespace.clone()),
        grants: c.grants.iter().filter_map(|g| g.parse().ok()).collect(),
        operator: false,
        kind: "jwt",
        custom: c.custom.clone(),
        jti: Some(c.jti.clone()),
        exp: Some(c.exp),
        iat: Some(c.iat),
    });
    node.token_cache.insert(fingerprint, id.clone(), c.exp, t);
    Ok(id)
}

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
    fn get(&self, fingerprint: &[u8; 32], now: u64) -> Option<Identity> {
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
    fn insert(&self, fingerprint: [u8; 32], id: Identity, exp: u64, now: u64) {
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
    fn get(&self, hash: &[u8; 32], now: u64) -> Option<Identity> {
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
    fn insert(&self, hash: [u8; 32], id: Identity, expires_at: u64) {
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

/// Largest custom-claims object a claims provider may return, in bytes.
pub const MAX_CUSTOM_CLAIMS: usize = 4096;

/// The custom claims of a token: the output of the namespace's claims provider
/// (a function of that namespace, run in its own invoker with
/// `{"subject","namespace","grants"}` on stdin), or null when it has none. A
/// provider that fails or answers anything but a JSON object fails the token
/// issue (502 `CLAIMS_PROVIDER_FAILED`): claims may carry authorization, so
/// they are never silently dropped.
async fn custom_claims(
    node: &Node,
    ns: &str,
    subject: &str,
    grants: &[String],
) -> ApiResult<serde_json::Value> {
    use crate::actors::{CallerInfo, Trigger};
    let record = node.records.get(ns).await?;
    let Some(provider) = record.and_then(|r| r.claims_provider.clone()) else {
        return Ok(serde_json::Value::Null);
    };
    let failed = |m: String| ApiError::new(Code::ClaimsProviderFailed, m);
    let h = node.locate(ns).await?;
    let input = json!({"subject": subject, "namespace": ns, "grants": grants})
        .to_string()
        .into_bytes();
    let caller = CallerInfo {
        subject: Some(subject.to_string()),
        request_id: crate::http::middleware::fresh_request_id(),
    };
    let prepared = h
        .prepare(crate::actors::PrepareInvoke {
            name: provider.clone(),
            version: None,
            input,
            caller,
            trigger: Trigger::Claims,
        })
        .await
        .map_err(|e| failed(format!("claims provider {provider:?}: {e}")))?;
    let reply = prepared
        .run()
        .await
        .map_err(|e| failed(format!("claims provider {provider:?}: {e}")))?;
    if reply.output.len() > MAX_CUSTOM_CLAIMS {
        return Err(failed(format!(
            "the claims provider answered more than {MAX_CUSTOM_CLAIMS} bytes"
        )));
    }
    match serde_json::from_slice::<serde_json::Value>(&reply.output) {
        Ok(v) if v.is_object() => Ok(v),
        _ => Err(failed(
            "the claims provider did not answer a JSON object".into(),
        )),
    }
}

/// Signs an access token and opens a refresh family; the token-pair answer.
/// A wallet sign-in names the namespace's role it was issued as (`role`
/// claim and answer field).
async fn token_pair(
    node: &Node,
    ns: &str,
    subject: &str,
    grants: Vec<String>,
    role: Option<String>,
) -> ApiResult<HttpResponse> {
    let t = now();
    let iss = &node.config.server.public_url;
    let mut claims = Claims::new(iss, iss, subject, ns, grants.clone(), t)?;
    claims.custom = custom_claims(node, ns, subject, &grants).await?;
    claims.role = role.clone();
    let ttl = node.config.auth.access_token_seconds;
    claims.exp = t + ttl;
    let access = node.jwt.sign(&claims);
    let refresh = identity::issue_refresh(
        &node.store,
        &node.secrets.server_secret,
        ns,
        subject,
        grants,
        t,
        node.config.auth.refresh_token_seconds(),
    )
    .await?;
    let mut answer = json!({
        "access_token": access, "token_type": "Bearer", "expires_in": ttl, "refresh_token": refresh,
    });
    if let Some(role) = role {
        answer["role"] = json!(role);
    }
    Ok(HttpResponse::Ok().json(answer))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenRequest {
    /// The API key to exchange for a token pair (surrounding whitespace ignored).
    api_key: String,
}

async fn token(node: web::Data<Node>, body: web::Json<TokenRequest>) -> ApiResult<HttpResponse> {
    let r = identity::lookup_key(
        &node.store,
        &node.secrets.server_secret,
        body.api_key.trim(),
        now(),
    )
    .await?;
    token_pair(
        &node,
        &r.namespace,
        &format!("key:{}", r.id),
        r.grants,
        None,
    )
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RefreshRequest {
    /// The refresh token to rotate; a reuse past the grace window revokes its family.
    refresh_token: String,
}

async fn refresh(
    node: web::Data<Node>,
    body: web::Json<RefreshRequest>,
) -> ApiResult<HttpResponse> {
    let t = now();
    let (record, new_refresh) = identity::rotate_refresh(
        &node.store,
        &node.secrets.server_secret,
        &body.refresh_token,
        t,
        node.config.auth.refresh_token_seconds(),
    )
    .await?;
    // A wallet's session lasts only as long as the namespace still lets it
    // sign in, with the grants its role holds now.
    let (grants, role) = match record.subject.strip_prefix("wallet:") {
        Some(wallet) => {
            let setting = wallet_setting(&node, &record.namespace).await?;
            setting.admits(wallet)?;
            (setting.grants_for(wallet), Some(setting.role))
        }
        None => (record.grants.clone(), None),
    };
    let iss = &node.config.server.public_url;
    let mut claims = Claims::new(
        iss,
        iss,
        &record.subject,
        &record.namespace,
        grants.clone(),
        t,
    )?;
    claims.exp = t + node.config.auth.access_token_seconds;
    claims.custom = custom_claims(&node, &record.namespace, &record.subject, &grants).await?;
    claims.role = role.clone();
    let mut answer = json!({
        "access_token": node.jwt.sign(&claims), "token_type": "Bearer",
        "expires_in": node.config.auth.access_token_seconds, "refresh_token": new_refresh,
    });
    if let Some(role) = role {
        answer["role"] = json!(role);
    }
    Ok(HttpResponse::Ok().json(answer))
}

async fn logout(node: web::Data<Node>, body: web::Json<RefreshRequest>) -> ApiResult<HttpResponse> {
    identity::logout(
        &node.store,
        &node.secrets.server_secret,
        &body.refresh_token,
    )
    .await?;
    Ok(HttpResponse::Ok().json(json!({"ok": true})))
}

async fn whoami(ctx: NsCtx) -> ApiResult<HttpResponse> {
    let id = ctx
        .identity
        .ok_or_else(|| ApiError::new(Code::MissingCredential, "no credential"))?;
    Ok(HttpResponse::Ok().json(json!({
        "subject": id.subject, "namespace": ctx.name, "kind": id.kind, "operator": id.operator,
        "grants": id.grants.iter().map(|g| g.to_string()).collect::<Vec<_>>(),
        "custom": id.custom, "exp": id.exp,
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChallengeRequest {
    /// The wallet address; normalized, and the key of its own rate limit.
    wallet: String,
    /// The namespace the sign-in is for; must exist.
    namespace: String,
}

async fn challenge(
    node: web::Data<Node>,
    limiters: web::Data<std::sync::Arc<crate::http::chain::Limiters>>,
    body: web::Json<ChallengeRequest>,
) -> ApiResult<HttpResponse> {
    let wallet = auth::normalize_wallet(&body.wallet)?;
    if let Err(after) = limiters.check_wallet(&wallet) {
        node.metrics
            .rate_limited
            .with_label_values(&["wallet"])
            .inc();
        return Err(ApiError::rate_limited(Code::WalletRateLimited, after));
    }
    wallet_setting(&node, &body.namespace)
        .await?
        .admits(&wallet)?;
    let message = identity::open_challenge(&node.store, &wallet, &body.namespace, now()).await?;
    Ok(HttpResponse::Ok().json(json!({"message": message, "expires_in": auth::NONCE_TTL})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VerifyRequest {
    /// The challenge message exactly as `/v1/auth/challenge` returned it.
    message: String,
    /// The wallet's signature of `message`.
    signature: String,
}

/// A wallet sign-in gets exactly the grants of the namespace's wallet role,
/// `{sub}` replaced by its address, if the namespace still lets it sign in
/// (the setting may have changed since the challenge).
async fn verify(node: web::Data<Node>, body: web::Json<VerifyRequest>) -> ApiResult<HttpResponse> {
    let ch = identity::verify_challenge(&node.store, &body.message, &body.signature, now()).await?;
    let setting = wallet_setting(&node, &ch.namespace).await?;
    setting.admits(&ch.wallet)?;
    token_pair(
        &node,
        &ch.namespace,
        &format!("wallet:{}", ch.wallet),
        setting.grants_for(&ch.wallet),
        Some(setting.role),
    )
    .await
}

/// The wallet sign-in setting of `ns` as the store has it now (not a cached
/// copy: a disable must hold at once on every node); a namespace that never
/// set one has it off.
async fn wallet_setting(node: &Node, ns: &str) -> ApiResult<WalletSignIn> {
    let Some(record) = node
        .store
        .get_json::<crate::actors::NamespaceRecord>(&crate::actors::ns_key(ns))
        .await?
    else {
        return Err(ApiError::new(
            Code::NamespaceNotFound,
            "namespace not found",
        ));
    };
    Ok(record.wallet_sign_in.unwrap_or_else(WalletSignIn::off))
}

/// The route's `{namespace}` must be the one the request acts on (the
/// authorization step took it from the path; checked again here).
fn same_namespace(ctx: &NsCtx, path: &str) -> ApiResult<()> {
    if ctx.name != path {
        return Err(ApiError::new(
            Code::NamespaceMismatch,
            "the credential belongs to another namespace",
        ));
    }
    Ok(())
}

/// `GET /v1/namespaces/{ns}/wallet-sign-in`: the namespace's setting (off
/// with the default role when its owner never set one).
async fn show_wallet_sign_in(
    node: web::Data<Node>,
    ctx: NsCtx,
    ns: web::Path<String>,
) -> ApiResult<HttpResponse> {
    same_namespace(&ctx, &ns)?;
    let setting = wallet_setting(&node, &ctx.name).await?;
    Ok(HttpResponse::Ok().json(json!({"namespace": ctx.name, "wallet_sign_in": setting})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WalletSignInRequest {
    /// Whether wallets may sign in.
    enabled: bool,
    /// The namespace's own role name; default `wallet`.
    #[serde(default)]
    role: Option<String>,
    /// The role's grants (`{sub}` in a resource is the wallet's address); default none.
    #[serde(default)]
    grants: Vec<String>,
    /// `"any"` or a list of wallet addresses; required when enabled.
    #[serde(default)]
    allow: Option<WalletAllow>,
}

/// `PUT /v1/namespaces/{ns}/wallet-sign-in`: replaces the namespace's
/// setting. A credential may only give wallets grants it holds itself.
async fn set_wallet_sign_in(
    ctx: NsCtx,
    ns: web::Path<String>,
    body: web::Json<WalletSignInRequest>,
) -> ApiResult<HttpResponse> {
    same_namespace(&ctx, &ns)?;
    let caller = ctx
        .identity
        .clone()
        .ok_or_else(|| ApiError::new(Code::MissingCredential, "no credential"))?;
    let body = body.into_inner();
    let setting = WalletSignIn::new(body.enabled, body.role, body.grants, body.allow)?;
    if !caller.operator && !auth::grants_cover(&caller.grants, &setting.grant_bound()?) {
        return Err(ApiError::new(
            Code::GrantEscalation,
            "wallets cannot be given grants the caller lacks",
        ));
    }
    // The record is its supervisor's: it writes the change and publishes it.
    let record = ctx
        .handle
        .ask(crate::actors::SetWalletSignIn {
            setting: setting.clone(),
        })
        .await??;
    tracing::info!(namespace = %record.name, enabled = setting.enabled, role = %setting.role, "Wallet sign-in set.");
    Ok(HttpResponse::Ok()
        .json(json!({"ok": true, "namespace": record.name, "wallet_sign_in": setting})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateKeyRequest {
    /// A label for the key list; may be empty.
    #[serde(default)]
    name: String,
    /// A role name (`owner`, `admin`, `developer`, `runtime`, `reader`).
    #[serde(default)]
    role: Option<String>,
    /// Extra grants; with the role's, all must be covered by the caller's own.
    #[serde(default)]
    grants: Vec<String>,
    /// Lifetime in days; default `auth.api_key_default_days`.
    #[serde(default)]
    expires_in_days: Option<u64>,
    /// `sk` (default) or `rk`.
    #[serde(default)]
    kind: Option<String>,
}

async fn create_key(
    node: web::Data<Node>,
    ctx: NsCtx,
    body: web::Json<CreateKeyRequest>,
) -> ApiResult<HttpResponse> {
    let caller = ctx
        .identity
        .clone()
        .ok_or_else(|| ApiError::new(Code::MissingCredential, "no credential"))?;
    let role = body.role.as_deref().map(str::parse::<Role>).transpose()?;
    let grants: Vec<Grant> = auth::parse_grants(&body.grants)?;
    if role.is_none() && grants.is_empty() {
        return Err(ApiError::new(
            Code::BadRequest,
            "give a role or at least one grant",
        ));
    }
    let mut requested = role.map(|r| r.grants()).unwrap_or_default();
    requested.extend(grants.iter().cloned());
    if !caller.operator && !auth::grants_cover(&caller.grants, &requested) {
        return Err(ApiError::new(
            Code::GrantEscalation,
            "a key cannot be given grants its creator lacks",
        ));
    }
    let kind = match body.kind.as_deref() {
        None | Some("sk") => KeyKind::Secret,
        Some("rk") => KeyKind::Runtime,
        Some(other) => {
            return Err(ApiError::new(
                Code::BadRequest,
                format!("kind {other:?} is not sk or rk"),
            ));
        }
    };
    let (key, record) = identity::create_key(
        &node.store,
        &node.secrets.server_secret,
        NewKey {
            namespace: &ctx.name,
            name: &body.name,
            kind,
            role,
            grants,
            expires_in_days: body
                .expires_in_days
                .unwrap_or(node.config.auth.api_key_default_days as u64),
        },
        now(),
    )
    .await?;
    Ok(HttpResponse::Created().json(json!({"key": key, "api_key": key, "record": record})))
}

async fn list_keys(node: web::Data<Node>, ctx: NsCtx) -> ApiResult<HttpResponse> {
    let keys = identity::list_keys(&node.store, &ctx.name).await?;
    Ok(HttpResponse::Ok().json(json!({"keys": keys})))
}

async fn revoke_key(
    node: web::Data<Node>,
    ctx: NsCtx,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    identity::revoke_key(&node.store, &ctx.name, &id).await?;
    node.key_cache.clear();
    Ok(HttpResponse::Ok().json(json!({"ok": true, "revoked": id.into_inner()})))
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
