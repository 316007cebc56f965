//! Serverless work a non-member cannot forward as a request, sent to a
//! member of the namespace (docs/cluster.md, "Placement"): the `invoke`
//! frame of a socket held here, the claims provider of a token issued here,
//! and the pub/sub triggers of what a socket here published. Each goes to an
//! internal route of one member (`routes/internal.rs`) under a hop MAC,
//! chosen by rendezvous like a forwarded request and through the same
//! per-(namespace, member) breakers: a member that could not be connected
//! to is passed over for the next; a member reached that failed is not
//! retried (it may have run the work), so the work runs at most once.

use crate::auth::HopIdentity;
use crate::error::{ApiError, Code};
use crate::http::state::Node;
use crate::placement::peer::{InternalCall, PeerAnswer, PeerError, internal_call};
use crate::placement::{Admit, Queued, rendezvous};
use actix_web::http::{Method, StatusCode};
use bytes::Bytes;
use std::time::Duration;

/// The members of `ns` when this node is not one of them (cluster mode, a
/// namespace with members that exclude this node); None to run the work
/// here. A store failure is the answer (503): running a namespace's work on
/// a non-member could double it.
pub(crate) async fn members_elsewhere(
    node: &Node,
    ns: &str,
) -> Result<Option<Vec<String>>, ApiError> {
    let Some(cluster) = node.cluster.get() else {
        return Ok(None);
    };
    let Some(record) = node.records.get(ns).await? else {
        return Ok(None);
    };
    if crate::placement::is_member(&record.members, &cluster.node_id) {
        return Ok(None);
    }
    Ok(Some(record.members.clone()))
}

/// How long a member may take to answer an internal call: the hop's
/// response timeout (`[deploy] upstream_timeout_seconds`) plus the connect.
fn call_bound(node: &Node) -> Duration {
    let t = crate::placement::peer::PeerTimeouts::from_config(&node.config);
    t.connect + t.response
}

/// Sends `path?query` with `body` (of `content_type`) to one member of `ns` (rendezvous order
/// of `members` by `spread`), signed as `hop`. A member's answer, whatever
/// its status, is returned; `Err` only when no member took the call (503
/// `NO_MEMBER_AVAILABLE`) or the one reached gave no answer (502/504
/// `MEMBER_FAILED`).
pub(crate) async fn call_member(
    node: &Node,
    ns: &str,
    members: &[String],
    spread: &str,
    path: &str,
    query: &str,
    hop: &HopIdentity,
    body: Bytes,
    content_type: &'static str,
) -> Result<PeerAnswer, ApiError> {
    let cluster = node
        .cluster
        .get()
        .ok_or_else(|| ApiError::new(Code::NoMemberAvailable, "not in a cluster"))?;
    let breakers = cluster.breakers(
        ns,
        node.config.cluster.breaker_failures,
        Duration::from_secs(node.config.cluster.breaker_probe_seconds),
    );
    let set_state = |member: &str| {
        node.metrics
            .breaker_state
            .with_label_values(&[ns, member])
            .set(if breakers.is_open(member) { 2 } else { 0 });
    };
    for member in rendezvous(members, spread) {
        if breakers.admit(member) == Admit::No {
            node.metrics
                .forwards
                .with_label_values(&["skipped_open"])
                .inc();
            continue;
        }
        let Some(base) = cluster.address_of(member).await else {
            breakers.failure(member);
            set_state(member);
            continue;
        };
        let call = InternalCall {
            method: Method::POST,
            path,
            query,
            body: body.clone(),
            content_type: Some(content_type),
            within: call_bound(node),
        };
        match internal_call(node.hop_key.as_ref(), &node.config, &base, hop, call).await {
            Ok(answer) => {
                if answer.gateway_fault {
                    node.metrics
                        .forwards
                        .with_label_values(&["member_failed"])
                        .inc();
                    breakers.failure(member);
                } else {
                    node.metrics.forwards.with_label_values(&["ok"]).inc();
                    breakers.success(member);
                }
                set_state(member);
                return Ok(answer);
            }
            Err(PeerError::Unconnected(e)) => {
                node.metrics
                    .forwards
                    .with_label_values(&["member_unreachable"])
                    .inc();
                breakers.failure(member);
                set_state(member);
                tracing::warn!(namespace = ns, member = %member, error = %e, "Member not reached; trying the next.");
            }
            Err(PeerError::Failed(e)) => {
                node.metrics
                    .forwards
                    .with_label_values(&["member_unreachable"])
                    .inc();
                breakers.failure(member);
                set_state(member);
                tracing::warn!(namespace = ns, member = %member, error = %e, "Member call failed.");
                return Err(ApiError::with_status(
                    StatusCode::BAD_GATEWAY,
                    Code::MemberFailed,
                    format!("member {member} failed: {e}"),
                ));
            }
        }
    }
    Err(ApiError::new(
        Code::NoMemberAvailable,
        format!("no member of namespace {ns} could take the call"),
    )
    .retry_after(1))
}

/// The error envelope a member answered, as an error of this node with the
/// member's code and message (a body that is not one, or a code this node
/// does not know, is `MEMBER_FAILED` naming the status).
pub(crate) fn member_error(answer: &PeerAnswer) -> ApiError {
    let v: serde_json::Value = serde_json::from_slice(&answer.body).unwrap_or_default();
    let code = v["error"]["code"]
        .as_str()
        .and_then(|c| Code::ALL.iter().copied().find(|k| k.as_str() == c));
    let message = v["error"]["message"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| format!("the member answered {}", answer.status));
    match code {
        Some(code) => ApiError::new(code, message),
        None => ApiError::with_status(StatusCode::BAD_GATEWAY, Code::MemberFailed, message),
    }
}

/// A percent-encoded query value: unreserved ASCII kept, every other byte `%XX`.
pub(crate) fn query_value(s: &str) -> String {
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

/// Where a socket's invoke frame and a token's claims provider run on a member.
pub(crate) const INVOKE_PATH: &str = "/v1/internal/functions/invoke";
/// Where the pub/sub triggers of a non-member's socket publishes are fired.
pub(crate) const FIRE_PATH: &str = "/v1/internal/pubsub/fire";

/// Publications per call to a member.
const FIRE_BATCH_MAX: usize = 500;

/// Hands one publication of `ns` on `topic`, accepted on a socket of this
/// node while it is not a member of `ns`, to a member, whose supervisor
/// fires the matching pub/sub triggers once. The namespace's publications
/// queue in order ([`crate::placement::FireQueues`]) and go in batches, one
/// call in flight per namespace, from a task on this thread.
pub(crate) fn fire_elsewhere(node: &Node, ns: &str, topic: String, data: Bytes) {
    let Some(cluster) = node.cluster.get() else {
        return;
    };
    match cluster.fire_queues.push(ns, topic, data) {
        Queued::Behind => {}
        Queued::StartSender => {
            let (node, ns) = (node.clone(), ns.to_string());
            actix_web::rt::spawn(async move { send_all(&node, &ns).await });
        }
        Queued::Full => {
            node.metrics
                .forwards
                .with_label_values(&["trigger_dropped"])
                .inc();
            tracing::warn!(
                namespace = ns,
                "Publication fires no trigger: the queue to the members is full."
            );
        }
    }
}

/// Sends the namespace's queue to a member, batch after batch, until it is empty.
async fn send_all(node: &Node, ns: &str) {
    let Some(cluster) = node.cluster.get() else {
        return;
    };
    while let Some(batch) = cluster.fire_queues.next_batch(ns, FIRE_BATCH_MAX) {
        if let Err(e) = fire_on_member(node, ns, &batch).await {
            node.metrics
                .forwards
                .with_label_values(&["trigger_dropped"])
                .inc_by(batch.len() as u64);
            tracing::warn!(namespace = ns, publications = batch.len(), error = %e.message, "Publications fired no trigger: no member took them.");
        }
    }
}

/// One batch of publications to a member of `ns`, whose triggers it fires.
async fn fire_on_member(node: &Node, ns: &str, batch: &[(String, Bytes)]) -> Result<(), ApiError> {
    use base64::Engine;
    let Some(members) = members_elsewhere(node, ns).await? else {
        // This node became a member meanwhile, or the namespace is gone:
        // a member's own supervisor fires its publications itself.
        return Ok(());
    };
    let messages: Vec<serde_json::Value> = batch
        .iter()
        .map(|(topic, data)| {
            serde_json::json!({
                "topic": topic,
                "data_base64": base64::engine::general_purpose::STANDARD.encode(data),
            })
        })
        .collect();
    let body = serde_json::to_vec(&serde_json::json!({ "messages": messages }))
        .map_err(|e| ApiError::new(Code::Internal, e.to_string()))?;
    let hop = node_hop(node, ns);
    let answer = call_member(
        node,
        ns,
        &members,
        ns,
        FIRE_PATH,
        "",
        &hop,
        body.into(),
        "application/json",
    )
    .await?;
    if answer.status.is_success() {
        Ok(())
    } else {
        Err(member_error(&answer))
    }
}

/// The hop identity of this node acting for namespace `ns` (no grants):
/// what a member trusts for work this node hands it.
pub(crate) fn node_hop(node: &Node, ns: &str) -> HopIdentity {
    let id = node.cluster.get().map(|c| c.node_id.as_str()).unwrap_or("");
    HopIdentity {
        namespace: ns.to_string(),
        subject: format!("node:{id}"),
        custom: String::new(),
        grants: Vec::new(),
        exp: None,
        iat: None,
        jti: None,
        device: None,
        session: None,
        operator: false,
    }
}
