//! `/v1/health`, `/v1/status`, `/v1/version`, the JWKS, and the debug sleep route.

use crate::error::Code;
use crate::error::{ApiError, ApiResult};
use crate::http::policy::{Policy, RouteTable};
use crate::http::state::Node;
use crate::identity::Identity;
use actix_web::http::Method;
use actix_web::{HttpMessage, HttpRequest, HttpResponse, web};
use serde::Deserialize;
use serde_json::json;

/// Adds these routes and their policies to the node's route table.
pub fn register(t: &mut RouteTable) {
    // The status names namespaces: the operator's, unless `[metrics]
    // public` (then without the names).
    let status_policy = if t.metrics_public() {
        Policy::Public
    } else {
        Policy::Operator
    };
    t.add(
        Method::GET,
        "/v1/health",
        Policy::Public,
        web::get().to(health),
    )
    .add(
        Method::GET,
        "/v1/status",
        status_policy,
        web::get().to(status),
    )
    .add(
        Method::GET,
        "/v1/version",
        Policy::Public,
        web::get().to(version),
    )
    .add(
        Method::GET,
        "/v1/auth/jwks",
        Policy::Public,
        web::get().to(jwks),
    )
    .add(
        Method::GET,
        "/.well-known/jwks.json",
        Policy::Public,
        web::get().to(jwks),
    )
    .add(
        Method::GET,
        "/v1/openapi.json",
        Policy::Public,
        web::get().to(openapi),
    );
    if t.debug_sleep() {
        t.add(
            Method::GET,
            "/v1/debug/sleep",
            Policy::Public,
            web::get().to(sleep),
        );
    }
}

/// The OpenAPI document of the node's routes (`crate::http::openapi`),
/// made once from its route table when the node starts serving.
async fn openapi(doc: web::Data<crate::http::openapi::Document>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(doc.0.clone())
}

async fn health(node: web::Data<Node>) -> HttpResponse {
    HttpResponse::Ok().json(json!({"ok": true, "status": "healthy", "phase": format!("{:?}", node.phase()).to_lowercase()}))
}

async fn version() -> HttpResponse {
    HttpResponse::Ok().json(json!({"name": "meshgate", "version": env!("CARGO_PKG_VERSION")}))
}

/// Node status: uptime, namespaces running here, actors and their restarts.
/// It names namespaces, so it needs the operator key (`[metrics]`): without
/// it 401 (403 for another credential), or, when `[metrics] public`, the
/// same status with no namespace named.
async fn status(req: HttpRequest, node: web::Data<Node>) -> ApiResult<HttpResponse> {
    let caller = req.extensions().get::<Identity>().map(|i| i.operator);
    let whole = caller == Some(true);
    match caller {
        Some(true) => {}
        _ if node.config.metrics.public => {}
        Some(false) => {
            return Err(ApiError::new(
                Code::OperatorOnly,
                "/v1/status needs the operator key",
            ));
        }
        None => {
            return Err(ApiError::new(
                Code::MissingCredential,
                "/v1/status needs the operator key ([metrics] in the README)",
            ));
        }
    }
    let named = |ns: &str| whole.then(|| ns.to_string());
    let actors: Vec<_> = node
        .directory
        .snapshot()
        .iter()
        .map(|a| {
            let mut row = json!({"id": a.id, "kind": a.kind, "mailbox_depth": a.depth(),
                   "handled": a.handled(), "restarts": a.restarts()});
            if let Some(ns) = named(&a.namespace) {
                row["namespace"] = json!(ns);
            }
            row
        })
        .collect();
    let mut breakers = Vec::new();
    let held = node
        .cluster
        .get()
        .map(|c| c.all_breakers())
        .unwrap_or_default();
    for (ns, bs) in held {
        for b in bs.snapshot() {
            let mut row = json!({"member": b.member, "state": b.state,
                "consecutive_failures": b.consecutive_failures, "open_for_seconds": b.open_for_seconds,
                "next_probe_seconds": b.next_probe_seconds});
            if let Some(ns) = named(&ns) {
                row["namespace"] = json!(ns);
            }
            breakers.push(row);
        }
    }
    // The public view (`[metrics] public`) names no address and no peer
    // id: only the operator sees where the members listen.
    let cluster = node.cluster.get().map(|c| {
        let mut v = json!({"node_id": c.node_id,
               "live_nodes": c.live().into_iter().map(|n| n.id).collect::<Vec<_>>()});
        if whole {
            v["advertise"] = json!(c.advertise);
        }
        v
    });
    let phase = node.phase();
    let node_id = node
        .cluster
        .get()
        .map(|c| c.node_id.clone())
        .unwrap_or_else(crate::util::hostname);
    let mut body = json!({
        "ok": true,
        "node_id": node_id,
        "version": env!("CARGO_PKG_VERSION"),
        "phase": format!("{phase:?}").to_lowercase(),
        "ready": phase == crate::http::Phase::Ready,
        "store": store_status(&node).await,
        "cluster": cluster,
        "mesh": mesh_status(&node, whole).await,
        "uptime_seconds": node.metrics.started.elapsed().as_secs(),
        "namespaces_running": node.namespaces.len(),
        "actors": actors,
        "breakers": breakers,
    });
    // Placement names namespaces: the operator's view only.
    if whole {
        let (shown, truncated) = namespace_members(&node).await;
        body["namespace_members"] = json!(shown);
        body["namespace_members_truncated"] = json!(truncated);
    }
    Ok(HttpResponse::Ok().json(body))
}

/// How many namespaces `/v1/status` lists with their members.
pub const STATUS_MEMBERS_SHOWN: usize = 100;

/// The members of the namespaces running here (a supervisor, full or
/// light), the first [`STATUS_MEMBERS_SHOWN`] by name, and whether more run.
/// Each from the record this node serves by (its owner's snapshot or a
/// recent read): `[]` is every node (a single node, or a namespace placed
/// nowhere in particular).
async fn namespace_members(node: &Node) -> (Vec<serde_json::Value>, bool) {
    let mut names = node.namespaces.names();
    names.sort();
    let truncated = names.len() > STATUS_MEMBERS_SHOWN;
    names.truncate(STATUS_MEMBERS_SHOWN);
    let here = node.cluster.get().map(|c| c.node_id.clone());
    let mut rows = Vec::with_capacity(names.len());
    for ns in names {
        // A record that cannot be read now (store down) is shown as unknown.
        let (members, known) = match node.records.get(&ns).await {
            Ok(Some(r)) => (r.members.clone(), true),
            Ok(None) => continue,
            Err(_) => (Vec::new(), false),
        };
        let member_here = here
            .as_deref()
            .is_none_or(|id| crate::placement::is_member(&members, id));
        let mut row = json!({"namespace": ns, "members": members, "member_here": member_here});
        if !known {
            row["members"] = serde_json::Value::Null;
            row["member_here"] = serde_json::Value::Null;
        }
        rows.push(row);
    }
    (rows, truncated)
}

/// The store's backend and whether it answers a read within a second; the
/// answer is kept a second, so status calls cost the shared store at most
/// one read a second.
async fn store_status(node: &Node) -> serde_json::Value {
    static LAST: parking_lot::Mutex<Option<(std::time::Instant, serde_json::Value)>> =
        parking_lot::Mutex::new(None);
    if let Some((at, v)) = LAST.lock().as_ref()
        && at.elapsed() < std::time::Duration::from_secs(1)
    {
        return v.clone();
    }
    let v = probe_store(node).await;
    *LAST.lock() = Some((crate::util::mono_now(), v.clone()));
    v
}

async fn probe_store(node: &Node) -> serde_json::Value {
    let backend = if node.store.as_sled().is_some() {
        "sled"
    } else {
        "etcd"
    };
    let started = crate::util::mono_now();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(1),
        node.store
            .get_unless(b"_status/probe", b"_status/no-journal"),
    )
    .await;
    let (healthy, error) = match read {
        Ok(Ok(_)) => (true, None),
        Ok(Err(e)) => (false, Some(e.to_string())),
        Err(_) => (false, Some("no answer within 1 s".to_string())),
    };
    json!({"backend": backend, "healthy": healthy, "error": error,
           "read_ms": started.elapsed().as_secs_f64() * 1000.0})
}

/// The pub/sub mesh as this node sees it: its peer id, the peers in the
/// registry and the ones connected (null off cluster mode).
async fn mesh_status(node: &Node, whole: bool) -> serde_json::Value {
    #[cfg(feature = "cluster")]
    if let Some(mesh) = node.mesh.get()
        && let Some(st) = mesh.status().await
    {
        let ids = |v: &[crate::cluster::PeerId]| {
            let mut v: Vec<String> = v.iter().map(|p| p.to_string()).collect();
            v.sort();
            v
        };
        if !whole {
            return json!({"registered": st.registered.len(), "connected": st.connected.len(),
                          "subscribed": st.subscribed.len()});
        }
        return json!({"peer_id": st.peer_id.to_string(), "registered": ids(&st.registered),
                      "connected": ids(&st.connected), "subscribed": ids(&st.subscribed)});
    }
    let _ = (node, whole);
    serde_json::Value::Null
}

async fn jwks(node: web::Data<Node>) -> HttpResponse {
    HttpResponse::Ok()
        .insert_header(("cache-control", "public, max-age=300"))
        .json(node.jwt.jwks())
}

#[derive(Deserialize)]
struct SleepQuery {
    /// Milliseconds to hold the request; more than `[debug] max_sleep_ms` is refused.
    ms: u64,
}

/// Holds the request `ms` milliseconds (at most `[debug] max_sleep_ms`;
/// registered only when that is above 0): lets tests watch a drain wait for
/// an in-flight request.
async fn sleep(node: web::Data<Node>, q: web::Query<SleepQuery>) -> ApiResult<HttpResponse> {
    let max = node.config.debug.max_sleep_ms;
    tokio::time::sleep(std::time::Duration::from_millis(q.ms.min(max))).await;
    Ok(HttpResponse::Ok().json(json!({"ok": true, "slept_ms": q.ms.min(max)})))
}
