//! `/v1/namespaces`: created, listed, shown and deleted by the operator.

use super::ctx::NsCtx;
use super::form::{Body, Json};
use super::page::{Page, PageQuery};
use crate::actors::{
    CreateNamespace, DeleteNamespace, GetInfo, InjectHold, InjectPanic, NamespaceRecord, ns_key,
};
use crate::auth::{KeyKind, Role};
use crate::error::Code;
use crate::error::{ApiError, ApiResult};
use crate::http::chain::context::valid_namespace_name;
use crate::http::policy::{Policy, RouteTable};
use crate::http::state::Node;
use crate::identity::{self, NewKey};
use crate::storage::OrderedKv;
use crate::util::now;
use actix_web::http::Method;
use actix_web::{HttpResponse, web};
use serde::Deserialize;
use serde_json::json;

/// Adds these routes and their policies to the node's route table.
pub fn register(t: &mut RouteTable) {
    t.add(
        Method::POST,
        "/v1/namespaces",
        Policy::Operator,
        web::post().to(create),
    )
    .add(
        Method::GET,
        "/v1/namespaces",
        Policy::Operator,
        web::get().to(list),
    )
    .add(
        Method::GET,
        "/v1/namespaces/{name}",
        Policy::Operator,
        web::get().to(show),
    )
    .add(
        Method::DELETE,
        "/v1/namespaces/{name}",
        Policy::Operator,
        web::delete().to(delete),
    )
    .add(
        Method::PUT,
        "/v1/namespaces/{name}/claims-provider",
        Policy::Operator,
        web::put().to(set_claims_provider),
    )
    .add(
        Method::PUT,
        "/v1/namespaces/{name}/members",
        Policy::Operator,
        web::put().to(set_members),
    )
    .add(
        Method::PUT,
        "/v1/namespaces/{namespace}/quotas",
        Policy::Operator,
        web::put().to(set_quotas),
    )
    .add(
        Method::GET,
        "/v1/namespaces/{namespace}/quotas",
        Policy::ns("namespace", "read"),
        web::get().to(show_quotas),
    );
    if t.fault_injection() {
        t.add(
            Method::POST,
            "/v1/namespaces/{name}/debug/panic",
            Policy::Operator,
            web::post().to(panic),
        )
        .add(
            Method::POST,
            "/v1/namespaces/{name}/debug/hold",
            Policy::Operator,
            web::post().to(hold),
        )
        .add(
            Method::POST,
            "/v1/namespaces/{name}/debug/hold-compile",
            Policy::Operator,
            web::post().to(hold_compile),
        );
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRequest {
    /// 1 to 63 of `a-z`, `0-9`, `-`, not starting with `-`.
    name: String,
    /// Node ids serving it (at most 16); empty: placed by rendezvous hashing
    /// in a cluster, served anywhere on a single node.
    #[serde(default)]
    members: Vec<String>,
    /// Its own request rate, per minute; None: `rate_limit.namespace_per_minute`.
    #[serde(default)]
    rate_per_minute: Option<u32>,
    /// Its own burst; None: `rate_limit.namespace_burst`.
    #[serde(default)]
    rate_burst: Option<u32>,
}

impl Body for CreateRequest {}

/// Creates a namespace and its first owner API key (shown once).
async fn create(
    node: web::Data<Node>,
    limiters: web::Data<std::sync::Arc<crate::http::chain::limits::Limiters>>,
    body: Json<CreateRequest>,
) -> ApiResult<HttpResponse> {
    let body = body.into_inner();
    if !valid_namespace_name(&body.name) {
        return Err(ApiError::new(
            Code::InvalidNamespaceName,
            "a namespace name is 1-63 of a-z, 0-9 and '-', not starting with '-'",
        ));
    }
    if body.rate_per_minute == Some(0) || body.rate_burst == Some(0) {
        return Err(ApiError::new(Code::BadRequest, "rate limits must be > 0"));
    }
    // Members: the named nodes, else (in a cluster) three live nodes by
    // rendezvous hashing; empty on a single node (served wherever it lands).
    let mut members = Vec::new();
    for m in body.members {
        if !node_id_shaped(&m) {
            return Err(ApiError::new(
                Code::InvalidMember,
                format!("{m:?} is not a node id"),
            ));
        }
        if !members.contains(&m) {
            members.push(m);
        }
    }
    if members.len() > 16 {
        return Err(ApiError::new(Code::InvalidMember, "at most 16 members"));
    }
    if members.is_empty()
        && let Some(c) = node.cluster.get()
    {
        members = c.place(&body.name).await;
    }
    let t = now();
    let record = NamespaceRecord {
        members,
        rate_per_minute: body.rate_per_minute,
        rate_burst: body.rate_burst,
        ..NamespaceRecord::new(&body.name, t)
    };
    let (key, key_record, mut ops) = identity::prepare_key(
        &node.secrets.server_secret,
        NewKey {
            namespace: &body.name,
            name: "owner",
            kind: KeyKind::Secret,
            role: Some(Role::Owner),
            grants: Vec::new(),
            expires_in_days: node.config.auth.api_key_default_days as u64,
        },
        t,
    )?;
    // The node supervisor claims the name first (compare-and-swap), then
    // writes the key and the usage records.
    ops.extend(crate::quota::fresh_records(&body.name));
    let created = crate::actors::ask(
        &node.supervisor,
        &node.supervisor_stats,
        CreateNamespace {
            record: record.clone(),
            ops,
        },
        crate::actors::ASK_TIMEOUT,
    )
    .await??;
    if !created {
        return Err(ApiError::new(
            Code::NamespaceExists,
            format!("namespace {:?} already exists", body.name),
        ));
    }
    limiters.forget_namespace(&body.name);
    tracing::info!(namespace = %body.name, "Namespace created.");
    // The owner key is answered as `POST /v1/auth/api-keys` answers a new
    // key (`api_key` and `key`), beside the namespace.
    Ok(HttpResponse::Created().json(json!({
        "namespace": record, "api_key": key, "key": key_record,
    })))
}

/// `GET /v1/namespaces[?limit=&cursor=]`: one page of the namespaces, by name.
async fn list(node: web::Data<Node>, q: web::Query<PageQuery>) -> ApiResult<HttpResponse> {
    let page = Page::parse(&q, "namespaces", "")?;
    const PREFIX: &[u8] = b"ns/";
    let (rows, last) = node
        .store
        .scan_page(PREFIX, page.after_key(PREFIX).as_deref(), page.limit)
        .await?;
    let list: Vec<NamespaceRecord> = rows
        .iter()
        .filter_map(|(_, v)| serde_json::from_slice(v).ok())
        .collect();
    let next = page.next_cursor(last.as_deref().map(|k| &k[PREFIX.len()..]));
    Ok(HttpResponse::Ok().json(json!({"namespaces": list, "next_cursor": next})))
}

async fn show(node: web::Data<Node>, name: web::Path<String>) -> ApiResult<HttpResponse> {
    let h = node.locate(&name).await?;
    let info = h.ask(GetInfo).await??;
    let quotas = quota_report(&node, &name).await?;
    let mut out = serde_json::to_value(info).map_err(|e| ApiError::internal(e.to_string()))?;
    out["quotas"] = quotas;
    Ok(HttpResponse::Ok().json(out))
}

/// Each quota of `ns` with its limit and use (usage records made first
/// where a namespace from before quotas has none).
async fn quota_report(node: &Node, ns: &str) -> ApiResult<serde_json::Value> {
    use crate::quota::Group;
    for g in [Group::Kv, Group::Functions] {
        crate::quota::ensure_usage(&node.store, ns, g).await?;
    }
    node.deployments.usage(ns).await?;
    let limits = node.limits(ns).await?;
    let history = node
        .locate(ns)
        .await?
        .ask(crate::actors::HistoryOf { streams: false })
        .await??;
    Ok(crate::quota::report(
        &node.store,
        ns,
        &limits,
        &node.live,
        (history.bytes, history.topics),
    )
    .await?)
}

/// The quotas of a namespace, to the operator or the namespace's own
/// credential (`namespace:read`).
async fn show_quotas(
    node: web::Data<Node>,
    ctx: NsCtx,
    name: web::Path<String>,
) -> ApiResult<HttpResponse> {
    if *name != ctx.name {
        return Err(ApiError::new(
            Code::NamespaceMismatch,
            "the credential belongs to another namespace",
        ));
    }
    node.locate(&name).await?;
    let quotas = quota_report(&node, &name).await?;
    Ok(HttpResponse::Ok().json(json!({"namespace": ctx.name, "quotas": quotas})))
}

/// A quota override body: names each quota it may hold.
impl Body for crate::quota::Overrides {
    fn takes() -> String {
        format!(
            "a JSON object of quota names to whole numbers, the names among {}",
            crate::quota::names()
        )
    }
}

/// Sets a namespace's quota overrides (the operator): `{"kv_bytes": n, ...}`
/// replaces them all; a quota left out takes `[quotas]`'s default again.
async fn set_quotas(
    node: web::Data<Node>,
    name: web::Path<String>,
    body: Json<crate::quota::Overrides>,
) -> ApiResult<HttpResponse> {
    let overrides = body.into_inner();
    crate::quota::check_overrides(&overrides)?;
    let h = node.locate(&name).await?;
    let record = h
        .ask(crate::actors::SetQuotas { quotas: overrides })
        .await??;
    let quotas = quota_report(&node, &name).await?;
    Ok(HttpResponse::Ok().json(json!({"ok": true, "namespace": record, "quotas": quotas})))
}

/// Deletes a namespace whole, in one atomic batch, and stops its supervisor
/// (both by the node supervisor, `DeleteNamespace`).
async fn delete(
    node: web::Data<Node>,
    limiters: web::Data<std::sync::Arc<crate::http::chain::limits::Limiters>>,
    name: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let name = name.into_inner();
    if node.store.get(&ns_key(&name)).await?.is_none() {
        return Err(ApiError::new(
            Code::NamespaceNotFound,
            "namespace not found",
        ));
    }
    // Deployments first: their host claims are released with them.
    node.deployments.delete_namespace(&name).await?;
    // The rest, and the supervisor's stop, by the node supervisor.
    crate::actors::ask(
        &node.supervisor,
        &node.supervisor_stats,
        DeleteNamespace { name: name.clone() },
        crate::actors::ASK_TIMEOUT,
    )
    .await??;
    node.key_cache.clear();
    // Its modules and site files go once no other record names them.
    node.blob_sweeps.request();
    limiters.forget_namespace(&name);
    tracing::info!(namespace = %name, "Namespace deleted.");
    Ok(HttpResponse::Ok().json(json!({"ok": true, "deleted": name})))
}

/// Fault injection (`[debug] fault_injection`): makes the namespace's supervisor
/// panic so supervision can be observed. Registered only when it is on.
async fn panic(node: web::Data<Node>, name: web::Path<String>) -> ApiResult<HttpResponse> {
    let h = node.locate(&name).await?;
    let r = h.ask(InjectPanic).await?;
    Ok(HttpResponse::Ok().json(json!({"ok": true, "panicked": r.is_err()})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HoldQuery {
    /// How long the supervisor holds, in milliseconds (at most 60,000).
    ms: u64,
}

/// Fault injection (`[debug] fault_injection`): the namespace's supervisor
/// holds its mailbox for `?ms=` milliseconds ([`InjectHold`]), so a test
/// sees the overload answer. Answers 202 once the hold is in the mailbox.
async fn hold(
    node: web::Data<Node>,
    name: web::Path<String>,
    q: web::Query<HoldQuery>,
) -> ApiResult<HttpResponse> {
    let ms = q.ms.min(60_000);
    let h = node.locate(&name).await?;
    crate::actors::tell(&h.addr, &h.stats, InjectHold { ms })?;
    Ok(HttpResponse::Accepted().json(json!({"ok": true, "held_ms": ms})))
}

/// Fault injection (`[debug] fault_injection`): a compile slot of the
/// node's gate is taken for the namespace and kept `?ms=` milliseconds, as
/// a long compile of its would (`wasm::gate`). Answers 202 once the slot is
/// taken, the gate's refusal when it is not.
async fn hold_compile(
    node: web::Data<Node>,
    name: web::Path<String>,
    q: web::Query<HoldQuery>,
) -> ApiResult<HttpResponse> {
    let ms = q.ms.min(60_000);
    let engine = node.functions.engine().clone();
    let ns = name.into_inner();
    tokio::task::spawn_blocking(move || {
        engine.hold_compile_slot(&ns, std::time::Duration::from_millis(ms))
    })
    .await
    .map_err(|e| ApiError::internal(format!("the hold task failed: {e}")))??;
    Ok(HttpResponse::Accepted().json(json!({"ok": true, "held_ms": ms})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClaimsProviderRequest {
    /// A function of the namespace, or null to remove the provider.
    function: Option<String>,
}

impl Body for ClaimsProviderRequest {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MembersRequest {
    /// The node ids to serve the namespace: at least one, at most 16, no
    /// duplicates, each a live node of the cluster.
    members: Vec<String>,
}

impl Body for MembersRequest {}

/// Whether `m` has the shape of a node id.
fn node_id_shaped(m: &str) -> bool {
    !m.is_empty()
        && m.len() <= 128
        && m.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// `PUT /v1/namespaces/{name}/members {"members": [...]}` (the operator):
/// places the namespace on these live nodes. Everything is checked before
/// anything changes (400 `INVALID_MEMBER`: empty, more than 16, a
/// duplicate, not a node id, a node not live in the registry now; on a
/// single node there are no members to set). The record is written by the
/// namespace's supervisor and every node follows it through the record
/// watch: the new members serve at once.
async fn set_members(
    node: web::Data<Node>,
    name: web::Path<String>,
    body: Json<MembersRequest>,
) -> ApiResult<HttpResponse> {
    let members = body.into_inner().members;
    let Some(cluster) = node.cluster.get() else {
        return Err(ApiError::new(
            Code::InvalidMember,
            "a single node has no members to set",
        ));
    };
    if members.is_empty() {
        return Err(ApiError::new(Code::InvalidMember, "members is empty"));
    }
    if members.len() > 16 {
        return Err(ApiError::new(Code::InvalidMember, "at most 16 members"));
    }
    let live: Vec<String> = cluster.live_now().await.into_iter().map(|n| n.id).collect();
    for (i, m) in members.iter().enumerate() {
        if !node_id_shaped(m) {
            return Err(ApiError::new(
                Code::InvalidMember,
                format!("{m:?} is not a node id"),
            ));
        }
        if members[..i].contains(m) {
            return Err(ApiError::new(
                Code::InvalidMember,
                format!("{m:?} is named twice"),
            ));
        }
        if !live.contains(m) {
            return Err(ApiError::new(
                Code::InvalidMember,
                format!("node {m:?} is not a live node of the cluster"),
            ));
        }
    }
    let h = node.locate(&name).await?;
    let record = h.ask(crate::actors::SetMembers { members }).await??;
    tracing::info!(namespace = %name, members = ?record.members, "Namespace members set.");
    Ok(HttpResponse::Ok().json(json!({"ok": true, "namespace": record})))
}

/// Names the function that adds custom claims to the namespace's tokens.
async fn set_claims_provider(
    node: web::Data<Node>,
    name: web::Path<String>,
    body: Json<ClaimsProviderRequest>,
) -> ApiResult<HttpResponse> {
    // The record is its supervisor's: it writes the change and publishes it.
    let h = node.locate(&name).await?;
    if let Some(f) = &body.function
        && node
            .store
            .get(&crate::functions::fn_key(&name, f))
            .await?
            .is_none()
    {
        return Err(ApiError::new(
            Code::FunctionNotFound,
            format!("no function {f:?} in {name}"),
        ));
    }
    let record = h
        .ask(crate::actors::SetClaimsProvider {
            function: body.function.clone(),
        })
        .await??;
    Ok(HttpResponse::Ok().json(json!({"ok": true, "namespace": record})))
}
