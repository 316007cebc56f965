//! The internal routes a non-member calls on a member for the serverless
//! work it cannot forward as a request (docs/cluster.md, "Placement"; the
//! caller is `http/member_call.rs`): a socket's invoke frame, a token's
//! claims provider, the pub/sub triggers of a socket's publishes. Only a
//! valid hop reaches them (policy `internal`, 403 `INTERNAL_ONLY`
//! otherwise); the namespace is the hop's. A node that is not (or no longer)
//! a member of it answers 503 `NO_MEMBER_AVAILABLE` and runs nothing: the
//! work runs on members only.

use crate::actors::{FireTriggers, Trigger};
use crate::error::{ApiError, ApiResult, Code};
use crate::http::member_call::{FIRE_PATH, INVOKE_PATH, members_elsewhere};
use crate::http::policy::{Policy, RouteTable};
use crate::http::request::read_limited;
use crate::http::state::Node;
use crate::http::ws_invoke::{run_here, split_version};
use crate::identity::Identity;
use crate::pubsub::{check_topic, decode_base64};
use crate::storage::OrderedKv;
use crate::wasm::MAX_INPUT_BYTES;
use actix_web::http::Method;
use actix_web::{HttpMessage, HttpRequest, HttpResponse, web};
use serde::Deserialize;
use serde_json::json;

/// Publications in one fire call, at most.
const MAX_FIRE_BATCH: usize = 1_000;

/// Adds the internal routes and their policy.
pub fn register(t: &mut RouteTable) {
    t.add(
        Method::POST,
        INVOKE_PATH,
        Policy::Internal,
        web::post().to(invoke),
    )
    .add(
        Method::POST,
        FIRE_PATH,
        Policy::Internal,
        web::post().to(fire),
    )
    .add(
        Method::POST,
        EVACUATE_PATH,
        Policy::Internal,
        web::post().to(evacuate),
    )
    .add(
        Method::POST,
        "/v1/cluster/nodes/{id}/drain",
        Policy::Operator,
        web::post().to(drain),
    );
}

/// Where a drained node is told to close its sockets.
const EVACUATE_PATH: &str = "/v1/internal/cluster/evacuate";

/// Compare-and-swap attempts per record when another writer changes it
/// meanwhile.
const DRAIN_ATTEMPTS: usize = 5;

/// `POST /v1/cluster/nodes/{id}/drain` (the operator): moves every
/// namespace off live node `id` (each of its member slots goes to the first
/// other live node, in the namespace's rendezvous order, that is not
/// already a member; a namespace with no spare node keeps its other members
/// only), then closes every socket of that node with 4012 (reconnect and
/// recover). 404 `NODE_NOT_FOUND` for a node that is not live, 409
/// `LAST_NODE` when no other node is live; nothing changes then.
async fn drain(node: web::Data<Node>, id: web::Path<String>) -> ApiResult<HttpResponse> {
    let id = id.into_inner();
    let not_found = || {
        ApiError::new(
            Code::NodeNotFound,
            format!("no live node {id:?} in the cluster"),
        )
    };
    let Some(cluster) = node.cluster.get() else {
        return Err(not_found());
    };
    let live = cluster.live_now().await;
    let Some(target) = live.iter().find(|n| n.id == id).cloned() else {
        return Err(not_found());
    };
    let others: Vec<String> = live
        .iter()
        .map(|n| n.id.clone())
        .filter(|n| *n != id)
        .collect();
    if others.is_empty() {
        return Err(ApiError::new(
            Code::LastNode,
            format!("{id:?} is the only live node: nothing could take its namespaces"),
        ));
    }
    let mut moved = Vec::new();
    for (k, _) in node.store.scan_all(b"ns/").await? {
        let Some(ns) = std::str::from_utf8(&k)
            .ok()
            .and_then(|k| k.strip_prefix("ns/"))
            .filter(|n| !n.is_empty() && !n.contains('/'))
        else {
            continue;
        };
        for _ in 0..DRAIN_ATTEMPTS {
            let Some(bytes) = node.store.get(&k).await? else {
                break;
            };
            let Ok(rec) = serde_json::from_slice::<crate::namespace::NamespaceRecord>(&bytes)
            else {
                break;
            };
            if !rec.members.contains(&id) {
                break;
            }
            let gone = [id.clone()];
            let members = crate::placement::replaced_members(ns, &rec.members, &gone, &others)
                .unwrap_or_else(|| rec.members.iter().filter(|m| **m != id).cloned().collect());
            if members.is_empty() {
                break;
            }
            let new = crate::namespace::NamespaceRecord { members, ..rec };
            let new_bytes = serde_json::to_vec(&new)
                .map_err(|e| ApiError::new(Code::Internal, e.to_string()))?;
            if node
                .store
                .compare_and_swap(&k, Some(&bytes), Some(&new_bytes), None)
                .await?
            {
                moved.push(json!({"namespace": ns, "members": new.members}));
                break;
            }
        }
    }
    tracing::warn!(node = %id, namespaces = moved.len(), "Node drained: its namespaces moved.");
    // Its sockets: closed here, or by the node itself through a hop.
    let closed = if id == cluster.node_id {
        node.pubsub.close_every(crate::pubsub::close::NODE_DRAINED);
        true
    } else {
        // A hop names a namespace; "_cluster" is none a tenant can have.
        let hop = crate::http::member_call::node_hop(&node, "_cluster");
        let call = crate::placement::peer::InternalCall {
            method: Method::POST,
            path: EVACUATE_PATH,
            query: "",
            body: bytes::Bytes::new(),
            content_type: None,
            within: std::time::Duration::from_secs(5),
        };
        let answer = crate::placement::peer::internal_call(
            node.hop_key.as_ref(),
            &node.config,
            &target.advertise,
            &hop,
            call,
        )
        .await;
        match answer {
            Ok(a) if a.status.is_success() => true,
            Ok(a) => {
                tracing::warn!(node = %id, status = %a.status, "Drained node did not close its sockets.");
                false
            }
            Err(e) => {
                tracing::warn!(node = %id, error = %e, "Drained node not reached to close its sockets.");
                false
            }
        }
    };
    Ok(HttpResponse::Ok().json(json!({
        "ok": true, "node": id, "moved": moved, "sockets_closed": closed,
    })))
}

/// `POST /v1/internal/cluster/evacuate` (a hop from the node that drained
/// this one): closes every socket here with 4012.
async fn evacuate(node: web::Data<Node>) -> HttpResponse {
    node.pubsub.close_every(crate::pubsub::close::NODE_DRAINED);
    HttpResponse::Ok().json(json!({"ok": true}))
}

/// The hop's identity and namespace, and this node's supervisor of it, when
/// this node is a member (503 `NO_MEMBER_AVAILABLE` when not: the caller's
/// view of the members is behind).
async fn member_side(
    req: &HttpRequest,
    node: &Node,
) -> ApiResult<(Identity, crate::actors::NsHandle)> {
    let id = req
        .extensions()
        .get::<Identity>()
        .cloned()
        .ok_or_else(|| ApiError::new(Code::InternalOnly, "this route is for cluster peers"))?;
    let ns = id
        .namespace
        .clone()
        .ok_or_else(|| ApiError::new(Code::NamespaceRequired, "the hop names no namespace"))?;
    if members_elsewhere(node, &ns).await?.is_some() {
        return Err(ApiError::new(
            Code::NoMemberAvailable,
            format!("this node is not a member of namespace {ns}"),
        )
        .retry_after(1));
    }
    let h = node.locate(&ns).await?;
    Ok((id, h))
}

/// The query of [`INVOKE_PATH`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InvokeQuery {
    /// `name` or `name@version`.
    function: String,
    /// `ws` (a socket's invoke frame: the hop's grants must allow it) or
    /// `claims` (a token's claims provider).
    trigger: String,
}

/// `POST /v1/internal/functions/invoke?function=F&trigger=ws|claims`: runs
/// `F` of the hop's namespace here with the body as its input; 200 with
/// the output's bytes, or the error envelope the same call would get on
/// the calling node.
async fn invoke(
    req: HttpRequest,
    node: web::Data<Node>,
    q: web::Query<InvokeQuery>,
    payload: web::Payload,
) -> ApiResult<HttpResponse> {
    let q = q.into_inner();
    let trigger = match q.trigger.as_str() {
        "ws" => Trigger::Ws,
        "claims" => Trigger::Claims,
        other => {
            return Err(ApiError::new(
                Code::BadRequest,
                format!("unknown trigger {other:?}"),
            ));
        }
    };
    let (name, version) =
        split_version(&q.function).map_err(|e| ApiError::new(Code::BadVersion, e.message))?;
    let (id, h) = member_side(&req, &node).await?;
    if trigger == Trigger::Ws && !id.allows("functions", "invoke", &name) {
        return Err(ApiError::new(
            Code::MissingGrant,
            format!("the credential lacks functions:invoke:{name}"),
        ));
    }
    let body = read_limited(req.headers(), payload, MAX_INPUT_BYTES).await?;
    let output = Box::pin(run_here(
        &h,
        Some(id.subject.clone()),
        name,
        version,
        body.to_vec(),
        trigger,
    ))
    .await?;
    Ok(HttpResponse::Ok()
        .content_type("application/octet-stream")
        .body(output))
}

/// The body of [`FIRE_PATH`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FireRequest {
    messages: Vec<FireMessage>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FireMessage {
    topic: String,
    data_base64: String,
}

/// `POST /v1/internal/pubsub/fire {"messages":[{topic, data_base64}]}`:
/// fires the pub/sub triggers of the hop's namespace matching each
/// publication (published on a socket of the calling node), once, here.
async fn fire(
    req: HttpRequest,
    node: web::Data<Node>,
    payload: web::Payload,
) -> ApiResult<HttpResponse> {
    // Its own limit, above `[server] max_body_bytes`: a batch, or one
    // publication of the largest socket frame, in base64.
    let limit = crate::placement::fire_body_limit(node.config.pubsub.max_frame_bytes);
    let raw = read_limited(req.headers(), payload, limit).await?;
    let body: FireRequest = serde_json::from_slice(&raw)
        .map_err(|e| ApiError::new(Code::MalformedJson, e.to_string()))?;
    let messages = body.messages;
    if messages.len() > MAX_FIRE_BATCH {
        return Err(ApiError::new(
            Code::BadBatch,
            format!("at most {MAX_FIRE_BATCH} publications per call"),
        ));
    }
    let mut decoded = Vec::with_capacity(messages.len());
    for m in messages {
        check_topic(&m.topic).map_err(ApiError::from)?;
        let data = decode_base64(&m.data_base64)
            .map_err(|_| ApiError::new(Code::BadBase64, "data_base64 is not base64"))?;
        decoded.push((m.topic, data));
    }
    let (_, h) = member_side(&req, &node).await?;
    let fired = h.ask(FireTriggers { messages: decoded }).await?;
    if !fired {
        return Err(ApiError::new(
            Code::NoMemberAvailable,
            "this node's supervisor of the namespace is not a member's",
        )
        .retry_after(1));
    }
    Ok(HttpResponse::Ok().json(serde_json::json!({"ok": true})))
}
