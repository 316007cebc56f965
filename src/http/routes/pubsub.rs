//! Pub/sub routes (DESIGN.md §5): publish over HTTP, the two sockets, presence
//! and the topic list. The sockets' protocol is in docs/pubsub.md.

use super::NsCtx;
use crate::actors::{Presence, Publish, PublishBatch, Subscribe, Topics, UnsubscribeAll};
use crate::http::error::{ApiError, ApiResult};
use crate::http::policy::{Policy, RouteTable};
use crate::node::Node;
use crate::pubsub::{
    FrameKind, MAX_BATCH, Mode, OutBody, Relay, SubscriberRef, TopicError, WsSession, check_member,
    check_topic,
};
use actix_web::body::BodyStream;
use actix_web::http::Method;
use actix_web::{HttpRequest, HttpResponse, web};
use base64::Engine as _;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::json;

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
    );
}

/// A topic as a client names it: 400 when invalid, 403 when reserved.
fn topic_ok(topic: &str) -> ApiResult<()> {
    check_topic(topic).map_err(|e| match e {
        TopicError::Reserved => ApiError::forbidden("RESERVED_TOPIC", e.to_string()),
        TopicError::Invalid => ApiError::bad_request("BAD_TOPIC", e.to_string()),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PublishBody {
    topic: String,
    #[serde(default)]
    data_base64: String,
}

/// Validates one message: topic, grant, base64, size.
fn message(ctx: &NsCtx, node: &Node, m: PublishBody) -> ApiResult<(String, Bytes)> {
    topic_ok(&m.topic)?;
    ctx.require("pubsub", "publish", &m.topic)?;
    let data = base64::engine::general_purpose::STANDARD
        .decode(m.data_base64.as_bytes())
        .map_err(|_| ApiError::bad_request("BAD_BASE64", "data_base64 is not base64"))?;
    if data.len() > node.config.pubsub.max_frame_bytes {
        return Err(ApiError::too_large(
            "the message is larger than pubsub.max_frame_bytes",
        ));
    }
    Ok((m.topic, data.into()))
}

async fn publish(
    ctx: NsCtx,
    node: web::Data<Node>,
    body: web::Json<PublishBody>,
) -> ApiResult<HttpResponse> {
    let (topic, data) = message(&ctx, &node, body.into_inner())?;
    ctx.handle
        .ask(Publish {
            topic,
            data,
            depth: 0,
        })
        .await??;
    Ok(HttpResponse::Ok().json(json!({"ok": true})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchBody {
    messages: Vec<PublishBody>,
}

async fn publish_batch(
    ctx: NsCtx,
    node: web::Data<Node>,
    body: web::Json<BatchBody>,
) -> ApiResult<HttpResponse> {
    let body = body.into_inner();
    if body.messages.is_empty() || body.messages.len() > MAX_BATCH {
        return Err(ApiError::bad_request(
            "BAD_BATCH",
            format!("a batch holds 1 to {MAX_BATCH} messages"),
        ));
    }
    // Everything is checked before anything is published: all or none.
    let messages = body
        .messages
        .into_iter()
        .map(|m| message(&ctx, &node, m))
        .collect::<ApiResult<Vec<_>>>()?;
    let n = ctx.handle.ask(PublishBatch { messages }).await??;
    Ok(HttpResponse::Ok().json(json!({"ok": true, "published": n})))
}

#[derive(Deserialize)]
struct SocketQuery {
    topic: String,
    #[serde(default)]
    presence: bool,
    member_id: Option<String>,
    member_meta: Option<String>,
    format: Option<String>,
}

/// Upgrades the request; errors before the upgrade are ordinary HTTP answers.
fn handshake(
    req: &HttpRequest,
    body: web::Payload,
) -> ApiResult<(HttpResponse, actix_ws::MessageStream)> {
    let (resp, _unused_session, stream) = actix_ws::handle(req, body).map_err(|e| {
        ApiError::bad_request("NOT_A_WEBSOCKET", format!("WebSocket handshake: {e}"))
    })?;
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
    q: web::Query<SocketQuery>,
) -> ApiResult<HttpResponse> {
    let q = q.into_inner();
    topic_ok(&q.topic)?;
    ctx.require("pubsub", "subscribe", &q.topic)?;
    let kind = match q.format.as_deref() {
        None | Some("json") => FrameKind::Simple,
        Some("binary") => FrameKind::Binary,
        Some(_) => {
            return Err(ApiError::bad_request(
                "BAD_FORMAT",
                "format is json or binary",
            ));
        }
    };
    let presence = if q.presence {
        let member = q
            .member_id
            .ok_or_else(|| ApiError::bad_request("BAD_MEMBER", "presence=true needs member_id"))?;
        check_member(&member, q.member_meta.as_deref())
            .map_err(|e| ApiError::bad_request(e.code, e.message))?;
        Some((member, q.member_meta))
    } else {
        None
    };
    let can_publish = ctx
        .identity
        .as_ref()
        .is_some_and(|i| i.allows("pubsub", "publish", &q.topic));
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
        })
        .await;
    if let Err(e) = flatten(subscribed) {
        relay.forget(conn.id);
        // A timed-out subscribe may still be applied later: undo it.
        ctx.handle.stats.admit_always();
        ctx.handle.addr.do_send(UnsubscribeAll { conn: conn.id });
        return Err(e);
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
    )
    .start_with(stream);
    Ok(upgraded(resp, conn))
}

fn flatten(r: Result<crate::actors::NsResult<()>, crate::actors::AskError>) -> ApiResult<()> {
    r?.map_err(ApiError::from)
}

/// `GET /v1/ws`: the full socket; subscriptions come as frames.
async fn full_socket(
    req: HttpRequest,
    body: web::Payload,
    ctx: NsCtx,
    node: web::Data<Node>,
) -> ApiResult<HttpResponse> {
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
    )
    .start_with(stream);
    Ok(upgraded(resp, conn))
}

#[derive(Deserialize)]
struct TopicQuery {
    topic: String,
}

async fn presence(ctx: NsCtx, q: web::Query<TopicQuery>) -> ApiResult<HttpResponse> {
    let topic = q.into_inner().topic;
    topic_ok(&topic)?;
    ctx.require("pubsub", "read", &topic)?;
    let members = ctx
        .handle
        .ask(Presence {
            topic: topic.clone(),
        })
        .await??;
    Ok(HttpResponse::Ok().json(json!({"topic": topic, "members": members})))
}

async fn topics(ctx: NsCtx) -> ApiResult<HttpResponse> {
    let list = ctx.handle.ask(Topics).await??;
    // Only the topics the caller may read.
    let list: Vec<_> = list
        .into_iter()
        .filter(|t| {
            ctx.identity
                .as_ref()
                .is_some_and(|i| i.allows("pubsub", "read", &t.topic))
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({"topics": list})))
}
