//! Pub/sub routes (docs/design.md §5): publish over HTTP, the two sockets, presence
//! and the topic list. The sockets' protocol is in docs/pubsub.md.

use super::ctx::NsCtx;
use super::form::{Body, Json};
use super::page::{Page, PageQuery, page_sorted};
use crate::actors::{
    Presence, Publish, PublishBatch, ReadHistory, SetHistory, Subscribe, Topics, UnsubscribeAll,
};
use crate::error::Code;
use crate::error::{ApiError, ApiResult};
use crate::http::chain::limits::Limiters;
use crate::http::policy::{Policy, RouteTable};
use crate::http::state::Node;
use crate::http::ws_session::settle;
use crate::http::ws_session::{Mode, WsSession};
use crate::identity::Identity;
use crate::pubsub::{
    FrameKind, MAX_BATCH, OutBody, PayloadTooLarge, Relay, SubscriberRef, TopicError, check_member,
    check_payload, check_topic, decode_base64,
};
use crate::quota::LiveHold;
use actix_web::body::BodyStream;
use actix_web::http::Method;
use actix_web::{HttpMessage, HttpRequest, HttpResponse, web};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::Arc;

/// Adds the pub/sub routes and their policies to the node's route table.
pub fn register(t: &mut RouteTable) {
    t.add(
        Method::POST,
        "/v1/pubsub/publish",
        Policy::ns("pubsub", "publish"),
        web::post().to(publish),
    )
    .add(
        Method::POST,
        "/v1/pubsub/publish-batch",
        Policy::ns("pubsub", "publish"),
        web::post().to(publish_batch),
    )
    .add(
        Method::GET,
        "/v1/pubsub/ws",
        Policy::ns("pubsub", "subscribe"),
        web::get().to(simple_socket),
    )
    .add(
        Method::GET,
        "/v1/ws",
        Policy::ns("pubsub", "subscribe"),
        web::get().to(full_socket),
    )
    .add(
        Method::GET,
        "/v1/pubsub/presence",
        Policy::ns("pubsub", "read"),
        web::get().to(presence),
    )
    .add(
        Method::GET,
        "/v1/pubsub/topics",
        Policy::ns("pubsub", "read"),
        web::get().to(topics),
    )
    .add(
        Method::GET,
        "/v1/pubsub/history",
        Policy::ns("pubsub", "read"),
        web::get().to(history),
    )
    .add(
        Method::GET,
        "/v1/namespaces/{namespace}/pubsub",
        Policy::ns("", ""),
        web::get().to(show_settings),
    )
    .add(
        Method::PUT,
        "/v1/namespaces/{namespace}/pubsub",
        Policy::ns("", ""),
        web::put().to(set_settings),
    )
    .add(
        Method::GET,
        LOCAL_VIEW_PATH,
        Policy::Internal,
        web::get().to(local_view),
    );
}

/// The internal route a node answering topics or presence asks every other
/// live node: that node's own sockets only (no fan-out from there).
const LOCAL_VIEW_PATH: &str = "/v1/internal/pubsub/local";

/// A topic a client names, refused: 400 `BAD_TOPIC` when invalid, 403
/// `RESERVED_TOPIC` when reserved. The one mapping of both the routes and
/// the socket's frames (`http/ws_session.rs`).
impl From<TopicError> for ApiError {
    fn from(e: TopicError) -> Self {
        let code = match e {
            TopicError::Reserved => Code::ReservedTopic,
            TopicError::Invalid => Code::BadTopic,
        };
        ApiError::new(code, e.to_string())
    }
}

/// A publish's payload over `pubsub.max_frame_bytes`: 413 `PAYLOAD_TOO_LARGE`
/// (the routes and the socket's `publish` frame alike).
impl From<PayloadTooLarge> for ApiError {
    fn from(e: PayloadTooLarge) -> Self {
        ApiError::too_large(e.to_string())
    }
}

/// One message of `POST /v1/pubsub/publish` (and of a batch).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PublishBody {
    /// Checked by [`topic_ok`] and against the caller's `publish` grants.
    topic: String,
    /// The payload, standard base64; at most `pubsub.max_frame_bytes` decoded.
    #[serde(default)]
    data_base64: String,
}

impl Body for PublishBody {}

/// Validates one message: topic, grant, base64, size (the same checks, in
/// the same order, as the socket's `publish` frame).
fn message(ctx: &NsCtx, node: &Node, m: PublishBody) -> ApiResult<(String, Bytes)> {
    check_topic(&m.topic)?;
    ctx.require("pubsub", "publish", &m.topic)?;
    let data = decode_base64(&m.data_base64)
        .map_err(|_| ApiError::new(Code::BadBase64, "data_base64 is not base64"))?;
    check_payload(&data, node.config.pubsub.max_frame_bytes)?;
    Ok((m.topic, data))
}

async fn publish(
    ctx: NsCtx,
    node: web::Data<Node>,
    body: Json<PublishBody>,
) -> ApiResult<HttpResponse> {
    let (topic, data) = message(&ctx, &node, body.into_inner())?;
    let msg = Publish {
        topic,
        data,
        depth: 0,
    };
    let pos = ask_within(&ctx, &node, msg).await??;
    let mut answer = crate::http::ws_session::position_fields(pos.as_ref());
    answer.insert("ok".into(), serde_json::Value::Bool(true));
    Ok(HttpResponse::Ok().json(answer))
}

/// Asks the namespace's supervisor to publish, waiting at most
/// `[pubsub] publish_timeout_ms` (then 504 `TIMEOUT`).
async fn ask_within<M>(
    ctx: &NsCtx,
    node: &Node,
    msg: M,
) -> Result<M::Result, crate::actors::AskError>
where
    crate::actors::NamespaceSupervisor: actix::Handler<M>,
    M: actix::Message + Send + 'static,
    M::Result: Send,
{
    let within = std::time::Duration::from_millis(node.config.pubsub.publish_timeout_ms);
    crate::actors::ask(&ctx.handle.addr, &ctx.handle.stats, msg, within).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchBody {
    /// 1 to [`MAX_BATCH`] messages; one invalid message refuses the whole batch.
    messages: Vec<PublishBody>,
}

impl Body for BatchBody {}

async fn publish_batch(
    ctx: NsCtx,
    node: web::Data<Node>,
    body: Json<BatchBody>,
) -> ApiResult<HttpResponse> {
    let body = body.into_inner();
    if body.messages.is_empty() || body.messages.len() > MAX_BATCH {
        return Err(ApiError::new(
            Code::BadBatch,
            format!("a batch holds 1 to {MAX_BATCH} messages"),
        ));
    }
    // Everything is checked before anything is published: all or none.
    let messages = body
        .messages
        .into_iter()
        .map(|m| message(&ctx, &node, m))
        .collect::<ApiResult<Vec<_>>>()?;
    let n = ask_within(&ctx, &node, PublishBatch { messages }).await??;
    Ok(HttpResponse::Ok().json(json!({"ok": true, "published": n})))
}

/// The query of `GET /v1/pubsub/ws`.
#[derive(Deserialize)]
struct SocketQuery {
    /// The one topic the socket subscribes to (needs a `subscribe` grant on it).
    topic: String,
    /// Join the topic's presence as `member_id`.
    #[serde(default)]
    presence: bool,
    /// Required with `presence=true`; see [`check_member`] for its bounds.
    member_id: Option<String>,
    /// Shown with the member: parsed as JSON, else kept as a string.
    member_meta: Option<String>,
    /// `json` (default) or `binary` (raw payloads as binary frames).
    format: Option<String>,
    /// Recover from this offset (with `recover_epoch`): a whole number.
    recover_offset: Option<String>,
    /// The epoch `recover_offset` belongs to.
    recover_epoch: Option<String>,
}

/// `recover_offset` and `recover_epoch` of a query: both or neither, the
/// offset a whole number (else 400 `BAD_OFFSET`).
fn recover_query(offset: Option<&str>, epoch: Option<String>) -> ApiResult<Option<(u64, String)>> {
    match (offset, epoch) {
        (None, None) => Ok(None),
        (Some(o), Some(e)) => o
            .parse::<u64>()
            .map(|o| Some((o, e)))
            .map_err(|_| ApiError::new(Code::BadOffset, "recover_offset is a whole number >= 0")),
        _ => Err(ApiError::new(
            Code::BadOffset,
            "recover_offset and recover_epoch come together",
        )),
    }
}

/// Upgrades the request; errors before the upgrade are ordinary HTTP answers.
fn handshake(
    req: &HttpRequest,
    body: web::Payload,
) -> ApiResult<(HttpResponse, actix_ws::MessageStream)> {
    let (resp, _unused_session, stream) = actix_ws::handle(req, body)
        .map_err(|e| ApiError::new(Code::NotAWebsocket, format!("WebSocket handshake: {e}")))?;
    Ok((resp, stream))
}

/// The 101 answer whose body is the socket's outbound queue.
fn upgraded(resp: HttpResponse, conn: std::rc::Rc<crate::pubsub::Conn>) -> HttpResponse {
    resp.set_body(BodyStream::new(OutBody(conn)))
        .map_into_boxed_body()
}

/// `GET /v1/pubsub/ws?topic=T`: the subscription is live before the 101 is sent.
async fn simple_socket(
    req: HttpRequest,
    body: web::Payload,
    ctx: NsCtx,
    node: web::Data<Node>,
    limiters: web::Data<Arc<Limiters>>,
    q: web::Query<SocketQuery>,
) -> ApiResult<HttpResponse> {
    let q = q.into_inner();
    check_topic(&q.topic)?;
    ctx.require("pubsub", "subscribe", &q.topic)?;
    let kind = match q.format.as_deref() {
        None | Some("json") => FrameKind::Simple,
        Some("binary") => FrameKind::Binary,
        Some(_) => {
            return Err(ApiError::new(Code::BadFormat, "format is json or binary"));
        }
    };
    let presence = if q.presence {
        let member = q
            .member_id
            .ok_or_else(|| ApiError::new(Code::BadMember, "presence=true needs member_id"))?;
        check_member(&member, q.member_meta.as_deref())
            // Its only refusal is BAD_MEMBER.
            .map_err(|e| ApiError::new(Code::BadMember, e.message))?;
        Some((member, q.member_meta))
    } else {
        None
    };
    let recover = recover_query(q.recover_offset.as_deref(), q.recover_epoch.clone())?;
    let recovering = recover.is_some();
    let can_publish = ctx
        .identity
        .as_ref()
        .is_some_and(|i| i.allows("pubsub", "publish", &q.topic));
    // The socket and its one subscription, within the namespace's quotas
    // (429 QUOTA_EXCEEDED before the upgrade).
    let mut quota = LiveHold::socket(&node.live, &ctx.name, node.limits(&ctx.name).await?)?;
    quota.subscribe()?;
    let (resp, stream) = handshake(&req, body)?;
    let relay = Relay::local(&node.pubsub);
    let conn = relay.open();
    let sub = SubscriberRef {
        relay: relay.id,
        conn: conn.id,
        kind,
    };
    let subscribed = ctx
        .handle
        .ask(Subscribe {
            topic: q.topic.clone(),
            sub,
            presence,
            recover,
        })
        .await;
    let subscribed = match settle(subscribed) {
        Ok(s) => s,
        Err(e) => {
            relay.forget(conn.id);
            // A timed-out subscribe may still be applied later: undo it.
            ctx.handle.stats.admit_always();
            ctx.handle.addr.do_send(UnsubscribeAll { conn: conn.id });
            return Err(e);
        }
    };
    if recovering {
        // The missed publications first in the socket's queue, then the
        // live ones the supervisor held meanwhile (a no-op when none).
        for frame in subscribed.missed.iter().flatten() {
            conn.push(frame.clone());
        }
        ctx.handle.stats.admit_always();
        ctx.handle.addr.do_send(crate::actors::Release {
            topic: q.topic.clone(),
            conn: conn.id,
        });
    }
    let mode = Mode::Simple {
        topic: q.topic,
        kind,
        can_publish,
    };
    WsSession::new(
        node.get_ref().clone(),
        ctx.handle.clone(),
        ctx.identity.clone(),
        relay,
        conn.clone(),
        mode,
        quota,
        socket_limits(&limiters, &node, &ctx.name).await,
    )
    .start_with(stream);
    let mut resp = upgraded(resp, conn);
    // The position and the recovery's outcome ride on the 101's headers.
    let h = resp.headers_mut();
    let mut set = |name: &'static str, v: String| {
        if let Ok(v) = actix_web::http::header::HeaderValue::from_str(&v) {
            h.insert(actix_web::http::header::HeaderName::from_static(name), v);
        }
    };
    if let Some(p) = &subscribed.position {
        set("x-meshgate-epoch", p.epoch.clone());
        set("x-meshgate-offset", p.offset.to_string());
    }
    if let Some(r) = subscribed.recovered {
        set("x-meshgate-recovered", r.to_string());
    }
    Ok(resp)
}

/// The query of `GET /v1/pubsub/history`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HistoryQuery {
    /// The topic read (needs `pubsub:read:<topic>`).
    topic: String,
    /// Publications after this offset (before it with `reverse=true`).
    since_offset: Option<String>,
    /// The epoch `since_offset` belongs to; another one is refused.
    epoch: Option<String>,
    /// At most this many (1 to `max_recovered_publications`, the default).
    limit: Option<String>,
    /// `true`: newest first.
    reverse: Option<String>,
}

/// `GET /v1/pubsub/history?topic=T&since_offset=&epoch=&limit=&reverse=`:
/// the kept publications of a topic, by offset.
async fn history(
    ctx: NsCtx,
    node: web::Data<Node>,
    q: web::Query<HistoryQuery>,
) -> ApiResult<HttpResponse> {
    let q = q.into_inner();
    check_topic(&q.topic)?;
    ctx.require("pubsub", "read", &q.topic)?;
    let cap = node.config.pubsub.max_recovered_publications;
    let number = |v: Option<&str>, what: &str| -> ApiResult<Option<u64>> {
        v.map(|s| {
            s.parse::<u64>().map_err(|_| {
                ApiError::new(Code::BadOffset, format!("{what} is a whole number >= 0"))
            })
        })
        .transpose()
    };
    let since = number(q.since_offset.as_deref(), "since_offset")?;
    let limit = q
        .limit
        .as_deref()
        .map_or(Some(cap), |l| l.parse::<u64>().ok())
        .unwrap_or(0);
    if limit == 0 || limit > cap {
        return Err(ApiError::new(
            Code::InvalidLimit,
            format!("limit is 1 to {cap} (pubsub.max_recovered_publications)"),
        ));
    }
    let reverse = match q.reverse.as_deref() {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => return Err(ApiError::new(Code::BadQuery, "reverse is true or false")),
    };
    let page = ctx
        .handle
        .ask(ReadHistory {
            topic: q.topic.clone(),
            since,
            epoch: q.epoch,
            limit: limit as usize,
            max_bytes: node.config.pubsub.max_history_page_bytes,
            reverse,
        })
        .await??;
    let publications: Vec<_> = page
        .entries
        .iter()
        .map(|e| {
            json!({
                "offset": e.offset,
                "timestamp": e.timestamp,
                "data_base64": base64::Engine::encode(&base64::engine::general_purpose::STANDARD, &e.data),
            })
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "topic": q.topic,
        "epoch": page.position.as_ref().map(|p| p.epoch.clone()),
        "offset": page.position.as_ref().map_or(0, |p| p.offset),
        "publications": publications,
        "more": page.more,
    })))
}

/// The body of `PUT /v1/namespaces/{ns}/pubsub`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PubSubSettings {
    /// The history rules; the first whose glob matches a topic applies.
    history: Vec<crate::pubsub::HistoryRule>,
}

impl Body for PubSubSettings {}

/// Who may change a namespace's pub/sub settings: the operator, or its
/// credential with `pubsub:admin` or `namespace:admin`; and the path's
/// namespace must be the one the request acts on.
fn settings_admin(ctx: &NsCtx, path: &str) -> ApiResult<()> {
    if ctx.name != path {
        return Err(ApiError::new(
            Code::NamespaceMismatch,
            "the credential belongs to another namespace",
        ));
    }
    let Some(i) = &ctx.identity else {
        return Err(ApiError::new(
            Code::MissingCredential,
            "this route needs a credential",
        ));
    };
    if i.operator
        || crate::auth::allows_action(&i.grants, "pubsub", "admin")
        || crate::auth::allows_action(&i.grants, "namespace", "admin")
    {
        return Ok(());
    }
    Err(ApiError::new(
        Code::MissingGrant,
        "the credential lacks a pubsub:admin or namespace:admin grant",
    ))
}

/// `GET /v1/namespaces/{ns}/pubsub`: the namespace's history rules.
async fn show_settings(ctx: NsCtx, ns: web::Path<String>) -> ApiResult<HttpResponse> {
    settings_admin(&ctx, &ns)?;
    let info = ctx.handle.ask(crate::actors::GetInfo).await??;
    Ok(HttpResponse::Ok()
        .json(json!({"namespace": info.record.name, "history": info.record.history})))
}

/// `PUT /v1/namespaces/{ns}/pubsub`: replaces the history rules (checked
/// against `[pubsub]`'s caps first; nothing is stored when one is refused).
async fn set_settings(
    ctx: NsCtx,
    node: web::Data<Node>,
    ns: web::Path<String>,
    body: Json<PubSubSettings>,
) -> ApiResult<HttpResponse> {
    settings_admin(&ctx, &ns)?;
    let rules = body.into_inner().history;
    let caps = crate::pubsub::HistoryCaps::from(&node.config.pubsub);
    crate::pubsub::history::check_rules(&rules, &caps)
        .map_err(|e| ApiError::new(Code::InvalidHistory, e))?;
    let record = ctx.handle.ask(SetHistory { rules }).await??;
    tracing::info!(namespace = %record.name, rules = record.history.len(), "Pub/sub history rules set.");
    Ok(HttpResponse::Ok()
        .json(json!({"ok": true, "namespace": record.name, "history": record.history})))
}

/// What a socket's publish and invoke frames are rate-limited by: the
/// chain's limiters and the namespace's record (its own rate limit).
async fn socket_limits(
    limiters: &Arc<Limiters>,
    node: &Node,
    ns: &str,
) -> crate::http::ws_session::SocketLimits {
    crate::http::ws_session::SocketLimits {
        limiters: limiters.clone(),
        record: node.records.get(ns).await.ok().flatten(),
        key: ns.to_string(),
        since: crate::util::mono_now(),
    }
}

/// `GET /v1/ws`: the full socket; subscriptions come as frames.
async fn full_socket(
    req: HttpRequest,
    body: web::Payload,
    ctx: NsCtx,
    node: web::Data<Node>,
    limiters: web::Data<Arc<Limiters>>,
) -> ApiResult<HttpResponse> {
    let quota = LiveHold::socket(&node.live, &ctx.name, node.limits(&ctx.name).await?)?;
    let (resp, stream) = handshake(&req, body)?;
    let relay = Relay::local(&node.pubsub);
    let conn = relay.open();
    WsSession::new(
        node.get_ref().clone(),
        ctx.handle.clone(),
        ctx.identity.clone(),
        relay,
        conn.clone(),
        Mode::Full {
            topics: Default::default(),
        },
        quota,
        socket_limits(&limiters, &node, &ctx.name).await,
    )
    .start_with(stream);
    Ok(upgraded(resp, conn))
}

/// The query of `GET /v1/pubsub/presence`.
#[derive(Deserialize)]
struct TopicQuery {
    /// Whose presence members to list.
    topic: String,
}

/// How long the answering node waits for each other node's local view; one
/// that does not answer in time is left out and named in `nodes_missing`.
const FAN_OUT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// A topic as one node counts it (the shape of `TopicInfo`).
#[derive(Serialize, Deserialize, Clone)]
struct TopicCount {
    /// The topic's name.
    topic: String,
    /// Subscriptions to it on that node.
    subscribers: usize,
    /// Presence members on that node.
    members: usize,
}

/// A presence member as one node holds it (the shape of `Member`).
#[derive(Serialize, Deserialize, Clone)]
struct PresenceMember {
    /// Merged across nodes by this id.
    member_id: String,
    /// As the member joined; the earliest join's meta wins in a merge.
    meta: Option<serde_json::Value>,
    /// Unix milliseconds of the first join (the earliest across nodes).
    joined_at: u64,
    /// Sockets present under this id (summed across nodes).
    connections: usize,
}

/// What one node holds for a namespace on its own sockets: the topics, or
/// the presence members of one topic.
#[derive(Serialize, Deserialize, Default)]
struct LocalView {
    /// Filled when no topic was asked for.
    #[serde(default)]
    topics: Vec<TopicCount>,
    /// Filled when a topic was asked for: its presence members.
    #[serde(default)]
    members: Vec<PresenceMember>,
}

/// The query of [`LOCAL_VIEW_PATH`].
#[derive(Deserialize)]
struct LocalQuery {
    /// Presence of this topic; None for the topic list.
    topic: Option<String>,
}

/// This node's own view of `handle`'s namespace.
async fn local_of(handle: &crate::actors::NsHandle, topic: Option<&str>) -> ApiResult<LocalView> {
    let mut view = LocalView::default();
    match topic {
        Some(t) => {
            let members = handle
                .ask(Presence {
                    topic: t.to_string(),
                })
                .await??;
            view.members = members
                .into_iter()
                .map(|m| PresenceMember {
                    member_id: m.member_id,
                    meta: m.meta,
                    joined_at: m.joined_at,
                    connections: m.connections,
                })
                .collect();
        }
        None => {
            view.topics = handle
                .ask(Topics)
                .await??
                .into_iter()
                .map(|t| TopicCount {
                    topic: t.topic,
                    subscribers: t.subscribers,
                    members: t.members,
                })
                .collect();
        }
    }
    Ok(view)
}

/// `GET /v1/internal/pubsub/local[?topic=T]` (cluster peers only): this
/// node's own topics, or presence members of `T`, for the namespace the hop
/// names. A namespace with no supervisor running here has no sockets here:
/// an empty view, and none is started for the question.
async fn local_view(
    req: HttpRequest,
    node: web::Data<Node>,
    q: web::Query<LocalQuery>,
) -> ApiResult<HttpResponse> {
    let ns = req
        .extensions()
        .get::<Identity>()
        .and_then(|i| i.namespace.clone())
        .ok_or_else(|| ApiError::new(Code::NamespaceRequired, "the hop names no namespace"))?;
    let topic = q.into_inner().topic;
    if let Some(t) = &topic {
        check_topic(t)?;
    }
    let view = match node.namespaces.get(&ns) {
        Some(handle) => local_of(&handle, topic.as_deref()).await?,
        None => LocalView::default(),
    };
    Ok(HttpResponse::Ok().json(view))
}

/// The other live nodes' views of `ns` (cluster mode only, else `None`),
/// asked at once, each within [`FAN_OUT_TIMEOUT`]; the ids of those that
/// did not answer come second.
async fn others_views(
    node: &Node,
    ns: &str,
    topic: Option<&str>,
) -> Option<(Vec<LocalView>, Vec<String>)> {
    let cluster = node.cluster.get()?;
    let hop = crate::auth::HopIdentity {
        namespace: ns.to_string(),
        subject: format!("node:{}", cluster.node_id),
        custom: String::new(),
        grants: Vec::new(),
        exp: None,
        iat: None,
        jti: None,
        device: None,
        session: None,
        operator: false,
    };
    let query = match topic {
        Some(t) => format!("topic={}", percent_encode(t)),
        None => String::new(),
    };
    let peers: Vec<_> = cluster
        .live_now()
        .await
        .into_iter()
        .filter(|p| p.id != cluster.node_id)
        .collect();
    let asks = peers.iter().map(|p| {
        crate::placement::peer::internal_get(
            node.hop_key.as_ref(),
            &node.config,
            &p.advertise,
            LOCAL_VIEW_PATH,
            &query,
            &hop,
            FAN_OUT_TIMEOUT,
        )
    });
    let answers = futures_util::future::join_all(asks).await;
    let mut views = Vec::new();
    let mut missing = Vec::new();
    for (p, a) in peers.iter().zip(answers) {
        match a.and_then(|b| serde_json::from_slice::<LocalView>(&b).map_err(|e| e.to_string())) {
            Ok(v) => views.push(v),
            Err(e) => {
                tracing::warn!(namespace = ns, peer = %p.id, error = %e, "A node's pub/sub view is left out of a cluster-wide answer.");
                missing.push(p.id.clone());
            }
        }
    }
    missing.sort();
    Some((views, missing))
}

/// `s` for a query string: unreserved ASCII kept, every other byte as `%XX`.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Presence members of one topic across views: one entry per member id,
/// its connections summed, the earliest join (and its meta) kept.
fn merge_members(views: impl IntoIterator<Item = LocalView>) -> Vec<PresenceMember> {
    let mut by_id: std::collections::BTreeMap<String, PresenceMember> = Default::default();
    for m in views.into_iter().flat_map(|v| v.members) {
        match by_id.get_mut(&m.member_id) {
            Some(e) => {
                e.connections += m.connections;
                if m.joined_at < e.joined_at {
                    e.joined_at = m.joined_at;
                    e.meta = m.meta;
                }
            }
            None => {
                by_id.insert(m.member_id.clone(), m);
            }
        }
    }
    by_id.into_values().collect()
}

/// Topics across views: one entry per topic, subscriber and member counts
/// summed (a member id present on two nodes counts twice), by name.
fn merge_topics(views: impl IntoIterator<Item = LocalView>) -> Vec<TopicCount> {
    let mut by_name: std::collections::BTreeMap<String, TopicCount> = Default::default();
    for t in views.into_iter().flat_map(|v| v.topics) {
        match by_name.get_mut(&t.topic) {
            Some(e) => {
                e.subscribers += t.subscribers;
                e.members += t.members;
            }
            None => {
                by_name.insert(t.topic.clone(), t);
            }
        }
    }
    by_name.into_values().collect()
}

/// `GET /v1/pubsub/presence?topic=T`. In a cluster the members present on
/// every live node (sockets stay on the node they reached), with
/// `partial`/`nodes_missing` naming the nodes that did not answer.
async fn presence(
    ctx: NsCtx,
    node: web::Data<Node>,
    q: web::Query<TopicQuery>,
) -> ApiResult<HttpResponse> {
    let topic = q.into_inner().topic;
    check_topic(&topic)?;
    ctx.require("pubsub", "read", &topic)?;
    let here = local_of(&ctx.handle, Some(&topic)).await?;
    let Some((mut views, missing)) = others_views(&node, &ctx.name, Some(&topic)).await else {
        return Ok(HttpResponse::Ok().json(json!({"topic": topic, "members": here.members})));
    };
    views.push(here);
    Ok(HttpResponse::Ok().json(json!({
        "topic": topic,
        "members": merge_members(views),
        "partial": !missing.is_empty(),
        "nodes_missing": missing,
    })))
}

/// A topic's key in its listing: its name.
fn topic_key(t: &TopicCount) -> &[u8] {
    t.topic.as_bytes()
}

/// `GET /v1/pubsub/topics`: the live topics the caller may read. In a
/// cluster those of every live node, counts summed, with
/// `partial`/`nodes_missing` as for presence.
/// Paged by topic name (`?limit=&cursor=`, `page.rs`): live topics are
/// held in memory, not in the store, so the page is cut from the sorted,
/// merged list.
async fn topics(
    ctx: NsCtx,
    node: web::Data<Node>,
    q: web::Query<PageQuery>,
) -> ApiResult<HttpResponse> {
    let page = Page::parse(&q, "topics", &ctx.name)?;
    let here = local_of(&ctx.handle, None).await?;
    let readable = |t: &TopicCount| ctx.may("pubsub", "read", &t.topic);
    let Some((mut views, missing)) = others_views(&node, &ctx.name, None).await else {
        let (list, next) = page_sorted(
            merge_topics([here]).into_iter().filter(readable),
            &page,
            topic_key,
        );
        return Ok(HttpResponse::Ok().json(json!({"topics": list, "next_cursor": next})));
    };
    views.push(here);
    let (list, next) = page_sorted(
        merge_topics(views).into_iter().filter(readable),
        &page,
        topic_key,
    );
    Ok(HttpResponse::Ok().json(json!({
        "topics": list,
        "next_cursor": next,
        "partial": !missing.is_empty(),
        "nodes_missing": missing,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str, joined_at: u64, connections: usize) -> PresenceMember {
        PresenceMember {
            member_id: id.into(),
            meta: Some(json!({"at": joined_at})),
            joined_at,
            connections,
        }
    }

    /// Members of several nodes: one per id, connections summed, the
    /// earliest join and its meta kept.
    #[test]
    fn members_merge_by_id() {
        let a = LocalView {
            members: vec![member("u1", 20, 1), member("u2", 5, 1)],
            ..Default::default()
        };
        let b = LocalView {
            members: vec![member("u1", 10, 2)],
            ..Default::default()
        };
        let m = merge_members([a, b]);
        assert_eq!(m.len(), 2);
        assert_eq!(
            (m[0].member_id.as_str(), m[0].joined_at, m[0].connections),
            ("u1", 10, 3)
        );
        assert_eq!(m[0].meta, Some(json!({"at": 10})));
        assert_eq!(m[1].member_id, "u2");
    }

    /// Topics of several nodes: a union by name with counts summed.
    #[test]
    fn topics_merge_by_name() {
        let t = |name: &str, s| TopicCount {
            topic: name.into(),
            subscribers: s,
            members: 0,
        };
        let a = LocalView {
            topics: vec![t("x", 1), t("y", 2)],
            ..Default::default()
        };
        let b = LocalView {
            topics: vec![t("x", 3)],
            ..Default::default()
        };
        let m = merge_topics([a, b]);
        let got: Vec<_> = m
            .iter()
            .map(|t| (t.topic.as_str(), t.subscribers))
            .collect();
        assert_eq!(got, vec![("x", 4), ("y", 2)]);
    }

    /// The one mapping of the domain's refusals: the codes and statuses both
    /// publish paths answer, the socket's frames through the same error.
    #[test]
    fn refusals_map_to_their_codes() {
        let code = |e: ApiError| (e.code, e.status.as_u16());
        let reserved = check_topic("_mg/x").unwrap_err();
        assert_eq!(code(reserved.clone().into()), (Code::ReservedTopic, 403));
        let invalid = check_topic("a b").unwrap_err();
        assert_eq!(code(invalid.into()), (Code::BadTopic, 400));
        let big = check_payload(&[0; 3], 2).unwrap_err();
        assert_eq!(code(big.into()), (Code::PayloadTooLarge, 413));
        let frame = crate::pubsub::FrameError::from(ApiError::from(reserved));
        assert_eq!(frame.code, "RESERVED_TOPIC");
    }

    /// A topic goes into the query string intact, whatever it holds.
    #[test]
    fn topics_percent_encoded() {
        assert_eq!(percent_encode("room/1+é&x=y"), "room%2F1%2B%C3%A9%26x%3Dy");
        assert_eq!(percent_encode("a-b_c.d~"), "a-b_c.d~");
    }
}
