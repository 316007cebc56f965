//! The internal routes a non-member calls on a member for the serverless
//! work it cannot forward as a request (docs/cluster.md, "Placement"; the
//! caller is `http/member_call.rs`): a socket's invoke frame, a token's
//! claims provider, the pub/sub triggers of a socket's publishes. Only a
//! valid hop reaches them (policy `internal`, 403 `INTERNAL_ONLY`
//! otherwise); the namespace is the hop's. A node that is not (or no longer)
//! a member of it answers 503 `NO_MEMBER_AVAILABLE` and runs nothing: the
//! work runs on members only.

use super::form::{Body, Json};
use crate::actors::{FireTriggers, Trigger};
use crate::error::{ApiError, ApiResult, Code};
use crate::http::member_call::{FIRE_PATH, INVOKE_PATH, members_elsewhere};
use crate::http::policy::{Policy, RouteTable};
use crate::http::request::read_limited;
use crate::http::state::Node;
use crate::http::ws_invoke::{run_here, split_version};
use crate::identity::Identity;
use crate::pubsub::{check_topic, decode_base64};
use crate::wasm::MAX_INPUT_BYTES;
use actix_web::http::Method;
use actix_web::{HttpMessage, HttpRequest, HttpResponse, web};
use serde::Deserialize;

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
    );
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

impl Body for FireRequest {}

/// `POST /v1/internal/pubsub/fire {"messages":[{topic, data_base64}]}`:
/// fires the pub/sub triggers of the hop's namespace matching each
/// publication (published on a socket of the calling node), once, here.
async fn fire(
    req: HttpRequest,
    node: web::Data<Node>,
    body: Json<FireRequest>,
) -> ApiResult<HttpResponse> {
    let messages = body.into_inner().messages;
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
