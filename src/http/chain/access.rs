//! Steps 8 to 10: authentication (with [`authenticate`], the check of a
//! presented credential, and the caches of `credentials.rs`), authorization
//! and the scope gate.

use super::context::{Early, Target, X_API_KEY, X_NAMESPACE, policy_of};
use crate::auth;
use crate::error::{ApiError, ApiResult, Code};
use crate::http::dashboard::session as dashboard;
use crate::http::policy::{Policy, PolicyMap};
use crate::http::request::is_websocket_upgrade;
use crate::http::state::Node;
use crate::identity::{self, Identity};
use crate::util::now;
use actix_web::dev::ServiceRequest;
use actix_web::http::header;
use actix_web::{HttpMessage, HttpResponse, web};

/// The credential a request presents: `Authorization: Bearer`, `X-API-Key`, or
/// `?token=` on a WebSocket upgrade.
fn presented_credential(req: &ServiceRequest) -> Option<String> {
    raw_credential(req).filter(|c| !c.is_empty())
}

fn raw_credential(req: &ServiceRequest) -> Option<String> {
    if let Some(v) = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let v = v.trim();
        if v.eq_ignore_ascii_case("bearer") {
            return None;
        }
        if let Some(t) = v
            .strip_prefix("Bearer ")
            .or_else(|| v.strip_prefix("bearer "))
        {
            return Some(t.trim().to_string());
        }
        return Some(v.to_string());
    }
    if let Some(v) = req.headers().get(&X_API_KEY).and_then(|v| v.to_str().ok()) {
        return Some(v.trim().to_string());
    }
    if is_websocket_upgrade(req.headers()) {
        return web::Query::<std::collections::HashMap<String, String>>::from_query(
            req.query_string(),
        )
        .ok()
        .and_then(|q| q.get("token").cloned());
    }
    None
}

/// Step 8: authentication. A presented credential must be valid (else 401); no
/// credential leaves the request anonymous for authorization to judge.
pub(crate) async fn authentication(req: &ServiceRequest) -> Result<(), ApiError> {
    // The dashboard changes state only from its own pages (a cookie rides
    // along on a cross-site form post).
    if dashboard::is_dashboard_path(req.path())
        && dashboard::is_state_changing(req.method())
        && policy_of(req) != Some(Policy::Deployment)
    {
        dashboard::check_origin(Node::of(req.request()), req.headers())?;
    }
    // On `/__admin` routes only, a dashboard session cookie stands for the operator
    // key (EventSource cannot send headers); a presented header still wins. The
    // session is read from the store (boxed: rare, and large on etcd).
    let anonymous = req.extensions().get::<Identity>().is_none();
    if anonymous
        && dashboard::is_dashboard_path(req.path())
        && !req.headers().contains_key(header::AUTHORIZATION)
        && !req.headers().contains_key(&X_API_KEY)
    {
        let session = Box::pin(dashboard::cookie_identity(
            Node::of(req.request()),
            req.path(),
            req.headers(),
        ))
        .await;
        if let Some(id) = session {
            req.extensions_mut().insert(id);
        }
    }
    // A deployment's Authorization header belongs to its upstream.
    if req.extensions().get::<Identity>().is_none()
        && policy_of(req) != Some(Policy::Deployment)
        && let Some(cred) = presented_credential(req)
    {
        let id = authenticate(Node::of(req.request()), &cred).await?;
        req.extensions_mut().insert(id);
    }
    Ok(())
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
            device: None,
            session: None,
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
        session_live(node, &id, t)?;
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
        device: c.did.clone(),
        session: c.sid.clone(),
    });
    session_live(node, &id, t)?;
    node.token_cache.insert(fingerprint, id.clone(), c.exp, t);
    Ok(id)
}

/// A token whose session was ended is refused (401 `SESSION_REVOKED`): a
/// lookup in the node's set of ended sessions, skipped while it is empty
/// (`identity::RevokedSessions`; docs/security.md, "Sessions").
pub(crate) fn session_live(node: &Node, id: &Identity, now: u64) -> ApiResult<()> {
    if let Some(sid) = &id.session
        && node.revoked_sessions.contains(sid, now)
    {
        return Err(auth::AuthError::SessionRevoked.into());
    }
    Ok(())
}

/// The namespace an operator names explicitly (`X-Namespace` or `?namespace=`).
fn named_namespace(req: &ServiceRequest) -> Option<String> {
    req.headers()
        .get(&X_NAMESPACE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| {
            web::Query::<std::collections::HashMap<String, String>>::from_query(req.query_string())
                .ok()
                .and_then(|q| q.get("namespace").cloned())
        })
}

/// The namespace a route's path names: the segment where its pattern has
/// `{namespace}` (`/v1/namespaces/{namespace}/wallet-sign-in`).
/// Only routes under `/v1/namespaces/` do, so the hot routes pay one prefix
/// compare; the pattern is the policy step's, remembered per path and thread.
fn path_namespace(req: &ServiceRequest) -> Option<String> {
    if !req.path().starts_with("/v1/namespaces/") {
        return None;
    }
    let map = req.app_data::<web::Data<PolicyMap>>()?;
    let pattern = map.pattern_of(req.path(), || req.match_pattern())?;
    let at = pattern.split('/').position(|s| s == "{namespace}")?;
    req.path().split('/').nth(at).map(str::to_string)
}

/// A browser opening a dashboard page (not its JSON API or assets) without a
/// credential: it is sent to the sign-in form instead of a JSON 401.
fn wants_sign_in_page(req: &ServiceRequest) -> bool {
    req.method() == actix_web::http::Method::GET
        && matches!(req.path(), "/__admin" | "/__admin/")
        && req
            .headers()
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|a| a.contains("text/html"))
}

/// Step 9: authorization. The credential's namespace must be the target
/// namespace (operators may act on any); operator and admin routes need the
/// operator key (admin also takes its dashboard session cookie).
pub(crate) fn authorization(req: &ServiceRequest) -> Result<(), Early> {
    let policy = policy_of(req);
    // Borrowed, not cloned (an identity carries its grants and claims); the
    // borrow ends with `check`, before the request is changed.
    let check = {
        let ext = req.extensions();
        let id = ext.get::<Identity>();
        match &policy {
            None | Some(Policy::Public) | Some(Policy::Credential) | Some(Policy::Deployment) => {
                Ok(None)
            }
            Some(Policy::Operator) => match id {
                Some(i) if i.operator => Ok(None),
                Some(_) => Err(ApiError::new(
                    Code::OperatorOnly,
                    "this route needs the operator key",
                )),
                None => Err(ApiError::new(
                    Code::MissingCredential,
                    "this route needs the operator key",
                )),
            },
            // No source address is trusted: behind a TLS proxy on loopback every
            // public request arrives from 127.0.0.1.
            Some(Policy::Admin) => match id {
                Some(i) if i.operator => Ok(None),
                None if wants_sign_in_page(req) => {
                    return Err(Early::Answer(
                        HttpResponse::SeeOther()
                            .insert_header((header::LOCATION, "/__admin/login"))
                            .insert_header((header::CACHE_CONTROL, "no-store"))
                            .finish(),
                    ));
                }
                Some(_) => Err(ApiError::new(
                    Code::OperatorOnly,
                    "the dashboard needs the operator key",
                )),
                None => Err(ApiError::new(
                    Code::MissingCredential,
                    "the dashboard needs the operator key",
                )),
            },
            Some(Policy::Internal) => match id {
                Some(i) if i.kind == "hop" => Ok(None),
                _ => Err(ApiError::new(
                    Code::InternalOnly,
                    "this route is for cluster peers",
                )),
            },
            Some(
                Policy::Ns { .. } | Policy::NsOrAnonymous { .. } | Policy::NsCredential { .. },
            ) => {
                // A route whose path names the namespace (`{namespace}`)
                // acts on that one, whatever the host or header say; the
                // by-namespace invoke route (`NsOrAnonymous`) is the
                // handler's to judge.
                let by_path = match policy {
                    Some(Policy::Ns { .. } | Policy::NsCredential { .. }) => path_namespace(req),
                    _ => None,
                };
                let routed = by_path.or_else(|| ext.get::<Target>().map(|t| t.0.clone()));
                match id {
                    None if matches!(policy, Some(Policy::NsOrAnonymous { .. })) => Ok(routed),
                    None => Err(ApiError::new(
                        Code::MissingCredential,
                        "this route needs a credential",
                    )),
                    Some(i) if i.operator => match routed.or_else(|| named_namespace(req)) {
                        Some(ns) => Ok(Some(ns)),
                        None => Err(ApiError::new(
                            Code::NamespaceRequired,
                            "the operator must name the namespace (X-Namespace header or ?namespace=)",
                        )),
                    },
                    Some(i) => {
                        let own = i.namespace.clone().unwrap_or_default();
                        let target = routed
                            .or_else(|| named_namespace(req))
                            .unwrap_or_else(|| own.clone());
                        if target == own {
                            Ok(Some(target))
                        } else {
                            Err(ApiError::new(
                                Code::NamespaceMismatch,
                                "the credential belongs to another namespace",
                            ))
                        }
                    }
                }
            }
        }
    };
    if let Some(ns) = check? {
        req.extensions_mut().insert(Target(ns));
    }
    Ok(())
}

/// Step 10: the route's required grant must be among the credential's grants
/// (the resource part is checked by the handler, which knows the topic or key).
pub(crate) fn scope_gate(req: &ServiceRequest) -> Result<(), ApiError> {
    if let Some((domain, action)) = policy_of(req).and_then(|p| p.grant()) {
        let lacks = req.extensions().get::<Identity>().is_some_and(|i| {
            !i.operator
                && !domain.is_empty()
                && !crate::auth::allows_action(&i.grants, domain, action)
        });
        if lacks {
            return Err(ApiError::new(
                Code::MissingGrant,
                format!("the credential lacks a {domain}:{action} grant"),
            ));
        }
    }
    Ok(())
}
