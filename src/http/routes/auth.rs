//! `/v1/auth/*`: token exchange, refresh rotation, logout, whoami, wallet sign-in
//! and API keys (docs/design.md §3). The check of a presented credential is
//! the chain's (`chain/access.rs`).

use super::ctx::NsCtx;
use super::form::{Body, Json};
use super::page::{Page, PageQuery};
use crate::auth::{self, Claims, Grant, KeyKind, Role, WalletAllow, WalletSignIn};
use crate::error::Code;
use crate::error::{ApiError, ApiResult};
use crate::http::policy::{Policy, RouteTable};
use crate::http::state::Node;
use crate::identity::{self, NewKey};
use crate::util::now;
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
        "/v1/auth/sessions",
        Policy::ns("", ""),
        web::get().to(list_sessions),
    )
    .add(
        Method::DELETE,
        "/v1/auth/sessions",
        Policy::ns("", ""),
        web::delete().to(end_device_sessions),
    )
    .add(
        Method::DELETE,
        "/v1/auth/sessions/{sid}",
        Policy::ns("", ""),
        web::delete().to(end_session),
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
    let input = json!({"subject": subject, "namespace": ns, "grants": grants})
        .to_string()
        .into_bytes();
    // On a non-member the provider runs on a member of the namespace
    // (docs/cluster.md, "Placement"); nothing of it starts here.
    if let Some(members) = crate::http::member_call::members_elsewhere(node, ns).await? {
        let hop = crate::auth::HopIdentity {
            namespace: ns.to_string(),
            subject: subject.to_string(),
            custom: String::new(),
            grants: grants.to_vec(),
            exp: None,
            iat: None,
            jti: None,
            device: None,
            session: None,
            operator: false,
        };
        let output = Box::pin(crate::http::ws_invoke::run_on_member(
            node,
            ns,
            &members,
            &hop,
            &provider,
            Trigger::Claims,
            input.into(),
        ))
        .await
        .map_err(|e| failed(format!("claims provider {provider:?}: {}", e.message)))?;
        return claims_of(&output);
    }
    let h = node.locate(ns).await?;
    let caller = CallerInfo {
        subject: Some(subject.to_string()),
        request_id: crate::http::chain::logger::fresh_request_id(),
        trace: None,
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
    claims_of(&reply.output)
}

/// A claims provider's output as custom claims: a JSON object of at most
/// [`MAX_CUSTOM_CLAIMS`] bytes, else 502 `CLAIMS_PROVIDER_FAILED`.
fn claims_of(output: &[u8]) -> ApiResult<serde_json::Value> {
    let failed = |m: String| ApiError::new(Code::ClaimsProviderFailed, m);
    if output.len() > MAX_CUSTOM_CLAIMS {
        return Err(failed(format!(
            "the claims provider answered more than {MAX_CUSTOM_CLAIMS} bytes"
        )));
    }
    match serde_json::from_slice::<serde_json::Value>(output) {
        Ok(v) if v.is_object() => Ok(v),
        _ => Err(failed(
            "the claims provider did not answer a JSON object".into(),
        )),
    }
}

/// Signs an access token and opens a session (a refresh family with a fresh
/// `sid`, bound to the client's `device_id` when it named one); the
/// token-pair answer. A wallet sign-in names the namespace's role it was
/// issued as (`role` claim and answer field).
async fn token_pair(
    node: &Node,
    ns: &str,
    subject: &str,
    grants: Vec<String>,
    role: Option<String>,
    device: Option<&str>,
) -> ApiResult<HttpResponse> {
    let t = now();
    let iss = &node.config.server.public_url;
    let mut claims = Claims::new(iss, iss, subject, ns, grants.clone(), t)?;
    claims.custom = custom_claims(node, ns, subject, &grants).await?;
    claims.role = role.clone();
    let ttl = node.config.auth.access_token_seconds;
    claims.exp = t + ttl;
    identity::make_room_for_session(&node.store, ns, subject, t, revoke_for(node)).await?;
    let (refresh, sid) = identity::open_session(
        &node.store,
        &node.secrets.server_secret,
        identity::SignIn {
            namespace: ns,
            subject,
            grants,
            device,
        },
        t,
        node.config.auth.refresh_token_seconds(),
    )
    .await?;
    claims.did = device.map(str::to_string);
    claims.sid = Some(sid.clone());
    let access = node.jwt.sign(&claims);
    let mut answer = json!({
        "access_token": access, "token_type": "Bearer", "expires_in": ttl, "refresh_token": refresh,
        "session_id": sid, "device_id": device,
    });
    if let Some(role) = role {
        answer["role"] = json!(role);
    }
    Ok(HttpResponse::Ok().json(answer))
}

/// A request's `device_id`, checked (400 `INVALID_DEVICE_ID`).
fn device_of(device_id: &Option<String>) -> ApiResult<Option<&str>> {
    match device_id.as_deref() {
        None => Ok(None),
        Some(d) => {
            auth::check_device_id(d)?;
            Ok(Some(d))
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenRequest {
    /// The API key to exchange for a token pair (surrounding whitespace ignored).
    api_key: String,
    /// The client's device: 1 to 64 of `A-Z a-z 0-9 . _ : -` (the `did` claim).
    #[serde(default)]
    device_id: Option<String>,
}

impl Body for TokenRequest {}

async fn token(node: web::Data<Node>, body: Json<TokenRequest>) -> ApiResult<HttpResponse> {
    let device = device_of(&body.device_id)?;
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
        device,
    )
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RefreshRequest {
    /// The refresh token to rotate; a reuse past the grace window revokes its family.
    refresh_token: String,
}

impl Body for RefreshRequest {}

async fn refresh(node: web::Data<Node>, body: Json<RefreshRequest>) -> ApiResult<HttpResponse> {
    let t = now();
    let (record, new_refresh) = identity::rotate_refresh(
        &node.store,
        &node.secrets.server_secret,
        &body.refresh_token,
        t,
        node.config.auth.refresh_token_seconds(),
    )
    .await?;
    // An ended session's family was revoked; one ended while this refresh
    // was rotating is caught here (and its family revoked).
    identity::touch_session(&node.store, &record, t).await?;
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
    claims.did = record.device.clone();
    claims.sid = record.session.clone();
    let mut answer = json!({
        "access_token": node.jwt.sign(&claims), "token_type": "Bearer",
        "expires_in": node.config.auth.access_token_seconds, "refresh_token": new_refresh,
        "session_id": record.session, "device_id": record.device,
    });
    if let Some(role) = role {
        answer["role"] = json!(role);
    }
    Ok(HttpResponse::Ok().json(answer))
}

async fn logout(node: web::Data<Node>, body: Json<RefreshRequest>) -> ApiResult<HttpResponse> {
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
        "session_id": id.session, "device_id": id.device,
    })))
}

/// The subject whose sessions a caller sees and ends: its own, always. A
/// namespace owner ends another subject's access by revoking its API key or
/// taking its wallet off the sign-in allow list (refreshes recheck both).
fn session_subject(ctx: &NsCtx) -> ApiResult<String> {
    let id = ctx
        .identity
        .as_ref()
        .ok_or_else(|| ApiError::new(Code::MissingCredential, "no credential"))?;
    Ok(id.subject.clone())
}

/// How long an ended session's sid stays on the revocation list: as long as
/// an access token issued just before the end is accepted (its lifetime and
/// the clock leeway), and a minute more.
fn revoke_for(node: &Node) -> u64 {
    node.config.auth.access_token_seconds + auth::JWT_LEEWAY + 60
}

/// `GET /v1/auth/sessions[?limit=&cursor=]`: one page of the caller's own
/// sessions in the namespace, by sid.
async fn list_sessions(
    node: web::Data<Node>,
    ctx: NsCtx,
    q: web::Query<PageQuery>,
) -> ApiResult<HttpResponse> {
    let subject = session_subject(&ctx)?;
    let scope = format!("{}/{subject}", ctx.name);
    let page = Page::parse(&q, "sessions", &scope)?;
    let (sessions, last) = identity::list_sessions_page(
        &node.store,
        &ctx.name,
        &subject,
        page.after.as_deref(),
        page.limit,
    )
    .await?;
    let next = page.next_cursor(last.as_deref());
    let current = ctx.identity.as_ref().and_then(|i| i.session.clone());
    let sessions: Vec<_> = sessions
        .iter()
        .map(|s| {
            json!({
                "sid": s.sid, "device_id": s.device_id, "created_at": s.created_at,
                "last_refresh_at": s.last_refresh_at, "expires_at": s.expires_at,
                "current": current.as_deref() == Some(s.sid.as_str()),
            })
        })
        .collect();
    Ok(HttpResponse::Ok()
        .json(json!({"subject": subject, "sessions": sessions, "next_cursor": next})))
}

/// `DELETE /v1/auth/sessions/{sid}`: ends one of the caller's sessions. A
/// sid the caller's subject does not have (unknown, or another subject's)
/// is 404 `SESSION_NOT_FOUND` alike.
async fn end_session(
    node: web::Data<Node>,
    ctx: NsCtx,
    sid: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let subject = session_subject(&ctx)?;
    let t = now();
    let ttl = revoke_for(&node);
    if !identity::end_session(&node.store, &ctx.name, &subject, &sid, t, ttl).await? {
        return Err(ApiError::new(Code::SessionNotFound, "no such session"));
    }
    node.revoked_sessions.insert(&sid, t + ttl);
    tracing::info!(namespace = %ctx.name, subject = %subject, sid = %sid, "Session ended.");
    Ok(HttpResponse::Ok().json(json!({"ok": true, "ended": [sid.into_inner()]})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceQuery {
    /// The device whose sessions end (required).
    #[serde(default)]
    device_id: Option<String>,
}

/// `DELETE /v1/auth/sessions?device_id=`: ends every session of the caller
/// signed in from that device; `ended` lists them (empty when none).
async fn end_device_sessions(
    node: web::Data<Node>,
    ctx: NsCtx,
    q: web::Query<DeviceQuery>,
) -> ApiResult<HttpResponse> {
    let subject = session_subject(&ctx)?;
    let device = device_of(&q.device_id)?.ok_or_else(|| {
        ApiError::new(
            Code::BadRequest,
            "device_id is required (DELETE /v1/auth/sessions/{sid} ends one session)",
        )
    })?;
    let t = now();
    let ttl = revoke_for(&node);
    let ended =
        identity::end_device_sessions(&node.store, &ctx.name, &subject, device, t, ttl).await?;
    for sid in &ended {
        node.revoked_sessions.insert(sid, t + ttl);
    }
    tracing::info!(namespace = %ctx.name, subject = %subject, device = %device, count = ended.len(), "Device sessions ended.");
    Ok(HttpResponse::Ok().json(json!({"ok": true, "ended": ended})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChallengeRequest {
    /// `ed25519` (the default) or `evm` (Sign-In with Ethereum).
    #[serde(default)]
    chain: Option<String>,
    /// An Ed25519 wallet: its public key; normalized, and the key of its own rate limit.
    #[serde(default)]
    wallet: Option<String>,
    /// An EVM account (`chain: "evm"`): `0x` and 40 hex, EIP-55 checked.
    #[serde(default)]
    address: Option<String>,
    /// The EIP-155 chain id the EVM wallet signs for.
    #[serde(default)]
    chain_id: Option<u64>,
    /// The namespace the sign-in is for; must exist.
    namespace: String,
}

impl Body for ChallengeRequest {}

/// Which kind of wallet a challenge is for, from its request.
enum ChallengeFor {
    Ed25519(String),
    Evm { address: String, chain_id: u64 },
}

impl ChallengeRequest {
    /// The wallet asked for, normalized; a field of the other kind, or a
    /// missing one, is 400.
    fn wallet(&self) -> ApiResult<ChallengeFor> {
        let bad = |m: &str| ApiError::new(Code::BadRequest, m);
        match self.chain.as_deref() {
            None | Some("ed25519") => {
                if self.address.is_some() || self.chain_id.is_some() {
                    return Err(bad(
                        "address and chain_id are for \"chain\": \"evm\"; an Ed25519 wallet is \"wallet\"",
                    ));
                }
                let w = self
                    .wallet
                    .as_deref()
                    .ok_or_else(|| bad("wallet is required"))?;
                Ok(ChallengeFor::Ed25519(auth::normalize_wallet(w)?))
            }
            Some("evm") => {
                if self.wallet.is_some() {
                    return Err(bad("an EVM account is \"address\", not \"wallet\""));
                }
                let a = self
                    .address
                    .as_deref()
                    .ok_or_else(|| bad("address is required"))?;
                let address = auth::normalize_evm_address(a)?;
                let chain_id = self
                    .chain_id
                    .filter(|c| *c > 0)
                    .ok_or_else(|| bad("chain_id (a positive integer) is required"))?;
                Ok(ChallengeFor::Evm { address, chain_id })
            }
            Some(_) => Err(bad("chain is \"ed25519\" or \"evm\"")),
        }
    }
}

/// The URI of the node's Sign-In with Ethereum messages: its public URL
/// when that is a URL, else `https://<base_domain>`.
fn siwe_uri(node: &Node) -> String {
    let public = &node.config.server.public_url;
    if public.contains("://") {
        public.clone()
    } else {
        format!("https://{}", node.config.server.base_domain)
    }
}

/// The client network a challenge cap is kept for: the client's IPv4
/// address or IPv6 /64 (as the rate limits key it), `unknown` without one.
/// Another client's open challenges never count against this one's cap.
fn client_network(ip: Option<std::net::IpAddr>) -> String {
    match ip {
        Some(ip) => crate::http::chain::limits::bucket_key(ip).to_string(),
        None => "unknown".into(),
    }
}

async fn challenge(
    node: web::Data<Node>,
    limiters: web::Data<std::sync::Arc<crate::http::chain::limits::Limiters>>,
    req: actix_web::HttpRequest,
    body: Json<ChallengeRequest>,
) -> ApiResult<HttpResponse> {
    let client = client_network(crate::http::chain::limits::client_ip_of(
        &limiters,
        req.headers(),
        req.peer_addr(),
    ));
    let wanted = body.wallet()?;
    let wallet = match &wanted {
        ChallengeFor::Ed25519(w) => w.clone(),
        ChallengeFor::Evm { address, .. } => address.clone(),
    };
    if let Err(after) = limiters.check_wallet(&wallet) {
        node.metrics
            .rate_limited
            .with_label_values(&["wallet"])
            .inc();
        return Err(ApiError::rate_limited(Code::WalletRateLimited, after));
    }
    // A namespace that does not exist answers as one that takes no wallet
    // sign-ins: the challenge does not tell whether a namespace exists.
    match wallet_setting(&node, &body.namespace).await {
        Ok(setting) => setting.admits(&wallet)?,
        Err(e) if e.code == Code::NamespaceNotFound => {
            return Err(auth::AuthError::WalletSignInDisabled.into());
        }
        Err(e) => return Err(e),
    }
    let ttl = node.config.auth.challenge_seconds;
    match wanted {
        ChallengeFor::Ed25519(w) => {
            let message =
                identity::open_challenge(&node.store, &w, &client, &body.namespace, now(), ttl)
                    .await?;
            Ok(HttpResponse::Ok().json(json!({"message": message, "expires_in": ttl})))
        }
        ChallengeFor::Evm { address, chain_id } => {
            let uri = siwe_uri(&node);
            let issuer = identity::SiweIssuer {
                domain: &node.config.server.base_domain,
                uri: &uri,
                ttl,
            };
            let ch = identity::open_siwe_challenge(
                &node.store,
                &issuer,
                &address,
                chain_id,
                &body.namespace,
                &client,
                now(),
            )
            .await?;
            Ok(HttpResponse::Ok().json(json!({
                "message": ch.message, "expires_in": ttl, "chain": "evm",
                "address": auth::checksum_address(&ch.address), "chain_id": ch.chain_id,
            })))
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VerifyRequest {
    /// The challenge message exactly as `/v1/auth/challenge` returned it.
    message: String,
    /// The wallet's signature of `message`: Ed25519 (64 bytes), or an EVM
    /// `personal_sign` signature (65 bytes hex, `r ‖ s ‖ v`).
    signature: String,
    /// The client's device: 1 to 64 of `A-Z a-z 0-9 . _ : -` (the `did` claim).
    #[serde(default)]
    device_id: Option<String>,
}

impl Body for VerifyRequest {}

/// A wallet sign-in gets exactly the grants of the namespace's wallet role,
/// `{sub}` replaced by its address, if the namespace still lets it sign in
/// (the setting may have changed since the challenge). A message in
/// EIP-4361's layout is a Sign-In with Ethereum; any other an Ed25519 one.
async fn verify(node: web::Data<Node>, body: Json<VerifyRequest>) -> ApiResult<HttpResponse> {
    // Checked before the nonce is spent: a bad device id costs no challenge.
    let device = device_of(&body.device_id)?;
    let is_siwe = body
        .message
        .split('\n')
        .next()
        .is_some_and(|l| l.ends_with(auth::SIWE_PREAMBLE));
    let (namespace, wallet) = if is_siwe {
        let ch = identity::verify_siwe(
            &node.store,
            &node.config.server.base_domain,
            &body.message,
            &body.signature,
            now(),
        )
        .await?;
        (ch.namespace, ch.address)
    } else {
        let ch =
            identity::verify_challenge(&node.store, &body.message, &body.signature, now()).await?;
        (ch.namespace, ch.wallet)
    };
    let setting = wallet_setting(&node, &namespace).await?;
    setting.admits(&wallet)?;
    token_pair(
        &node,
        &namespace,
        &format!("wallet:{wallet}"),
        setting.grants_for(&wallet),
        Some(setting.role),
        device,
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

impl Body for WalletSignInRequest {}

/// `PUT /v1/namespaces/{ns}/wallet-sign-in`: replaces the namespace's
/// setting. A credential may only give wallets grants it holds itself.
async fn set_wallet_sign_in(
    ctx: NsCtx,
    ns: web::Path<String>,
    body: Json<WalletSignInRequest>,
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

impl Body for CreateKeyRequest {}

async fn create_key(
    node: web::Data<Node>,
    ctx: NsCtx,
    body: Json<CreateKeyRequest>,
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
    // The kind: `rk` (the data plane) for the runtime role, `sk` for the
    // others and for grants alone, unless the body names one.
    let kind = match body.kind.as_deref() {
        None if role == Some(Role::Runtime) => KeyKind::Runtime,
        None | Some("sk") => KeyKind::Secret,
        Some("rk") => KeyKind::Runtime,
        Some(other) => {
            return Err(ApiError::new(
                Code::BadRequest,
                format!("kind {} is not sk or rk", crate::util::quoted(other)),
            ));
        }
    };
    // An `rk` key is embedded in apps: it carries the data plane only, so a
    // leaked one never deploys, manages keys or reads the namespace's records.
    if kind == KeyKind::Runtime
        && let Some(g) = requested.iter().find(|g| !data_plane(g))
    {
        return Err(ApiError::new(
            Code::BadRequest,
            format!(
                "an rk key carries data-plane grants only (pubsub:publish|subscribe|read, functions:invoke, kv:read|write), not {}:{}; use kind sk",
                g.domain(),
                g.action()
            ),
        ));
    }
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
    // The secret once (`api_key`) and the key as the key list shows it
    // (`key`); `POST /v1/namespaces` answers its owner key the same way.
    Ok(HttpResponse::Created().json(json!({"api_key": key, "key": record})))
}

/// Whether `g` is a data-plane grant, the only kind an `rk` key carries.
fn data_plane(g: &Grant) -> bool {
    matches!(
        (g.domain(), g.action()),
        ("pubsub", "publish" | "subscribe" | "read")
            | ("functions", "invoke")
            | ("kv", "read" | "write")
    )
}

/// `GET /v1/keys[?limit=&cursor=]`: one page of the namespace's API keys, by id.
async fn list_keys(
    node: web::Data<Node>,
    ctx: NsCtx,
    q: web::Query<PageQuery>,
) -> ApiResult<HttpResponse> {
    let page = Page::parse(&q, "keys", &ctx.name)?;
    let (keys, last) =
        identity::list_keys_page(&node.store, &ctx.name, page.after.as_deref(), page.limit).await?;
    let next = page.next_cursor(last.as_deref());
    Ok(HttpResponse::Ok().json(json!({"keys": keys, "next_cursor": next})))
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
