//! The receiving side of a cluster hop (docs/design.md §6): an `X-Internal-Auth-*`
//! identity is believed only with a valid hop MAC (V4) over this request's
//! method, path, query string and body digest, judged by the newest MAC alone,
//! within ±60 s. A node without a cluster secret believes no hop. Once the MAC
//! holds, the body is read (bounded like the forwarder's) and its SHA-256
//! compared with the digest the MAC covered: a mismatch refuses the request
//! (401 `HOP_BODY_MISMATCH`), so a body changed on the way is never acted on.
//! The same bytes are then handed on to the handler. The gate deletes the
//! headers either way, so the MAC is consumed here and never forwarded.
//!
//! An anonymous hop (empty namespace, subject
//! [`ANONYMOUS_HOP`], nothing
//! else: a public invoke forwarded for a caller without a credential)
//! yields no identity: the request is as anonymous here as it was where it
//! arrived, only marked [`AnonymousHop`] so it is not forwarded again.

use crate::auth::{
    self, HOP_ACCEPTED_VERSION, HOP_BODY_SHA256_HEADER, HOP_MAC_HEADER, HOP_VERSION_HEADER,
    HopRequest,
};
use crate::error::ApiError;
use crate::error::Code;
use crate::http::chain::context::{ANONYMOUS_HOP, AnonymousHop};
use crate::http::request::{has_upgrade, read_limited};
use crate::http::state::Node;
use crate::identity::Identity;
use actix_web::HttpMessage;
use actix_web::dev::{Payload, ServiceRequest};

/// The identity a valid hop carries (`Ok(None)`: no hop, or one not
/// believed: its headers are simply dropped). `Err` is the request's answer:
/// a hop whose MAC holds but whose body is not the one it was made for, or
/// is larger than a hop may carry.
pub async fn verify_hop(
    node: &Node,
    req: &mut ServiceRequest,
) -> Result<Option<Identity>, ApiError> {
    let Some(key) = node.hop_key.as_ref() else {
        return Ok(None);
    };
    let headers = req.headers();
    let macs: Vec<&str> = headers
        .get_all(HOP_MAC_HEADER)
        .filter_map(|v| v.to_str().ok())
        .collect();
    if macs.is_empty() {
        return Ok(None);
    }
    let get = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let Some(hop) = auth::hop_from_headers(get) else {
        return Ok(None);
    };
    let claimed = get(HOP_BODY_SHA256_HEADER).unwrap_or_default();
    let signed = HopRequest {
        method: req.method().as_str(),
        path: req.path(),
        query: req.query_string(),
        body_sha256: &claimed,
    };
    let now = crate::util::now();
    if let Err(e) = key.verify(&macs, &signed, &hop, now) {
        let version = get(HOP_VERSION_HEADER).unwrap_or_default();
        if version != HOP_ACCEPTED_VERSION.label() {
            tracing::warn!(error = %e, version = %version, accepted = %HOP_ACCEPTED_VERSION, "Hop refused: this node believes only the accepted MAC version (every node of a cluster must run the same release); its identity headers are dropped.");
        } else {
            tracing::warn!(error = %e, "Hop refused; its identity headers are dropped.");
        }
        return Ok(None);
    }
    check_body(node, req, &claimed).await?;
    if hop.namespace.is_empty() {
        let anonymous = hop.subject == ANONYMOUS_HOP
            && hop.grants.is_empty()
            && hop.custom.is_empty()
            && hop.exp.is_none()
            && hop.iat.is_none()
            && hop.jti.is_none()
            && hop.device.is_none()
            && hop.session.is_none();
        if anonymous {
            req.extensions_mut().insert(AnonymousHop);
        } else {
            tracing::warn!(subject = %hop.subject, "Hop without a namespace that is not the anonymous one; its identity headers are dropped.");
        }
        return Ok(None);
    }
    let id = Identity::from(crate::identity::IdentityData {
        subject: hop.subject.clone(),
        namespace: Some(hop.namespace.clone()),
        grants: hop.grants.iter().filter_map(|g| g.parse().ok()).collect(),
        // The forwarding node checked the operator key (the flag is MAC'd).
        operator: hop.operator,
        kind: "hop",
        custom: serde_json::from_str(&hop.custom).unwrap_or(serde_json::Value::Null),
        jti: hop.jti.clone(),
        exp: hop.exp,
        iat: hop.iat,
        device: hop.device.clone(),
        session: hop.session.clone(),
    });
    // A session ended since the forwarding node looked is refused here too.
    crate::http::chain::access::session_live(node, &id, now)?;
    Ok(Some(id))
}

/// Reads the body (at most [`hop_body_limit`](crate::placement::peer::hop_body_limit)
/// bytes), compares its SHA-256 with `claimed`, and puts the same bytes back
/// for the handler. An upgrade's payload is the socket's frames, not a body:
/// it is left alone and the hop must have been made for an empty body.
async fn check_body(node: &Node, req: &mut ServiceRequest, claimed: &str) -> Result<(), ApiError> {
    let path = req.path().to_string();
    let mismatch = || {
        tracing::warn!(path = %path, "Hop refused: its body is not the one its MAC was made for.");
        ApiError::new(
            Code::HopBodyMismatch,
            "the body of this hop is not the one its MAC was made for",
        )
    };
    if has_upgrade(req.headers()) {
        return if claimed == auth::hop_body_sha256(b"") {
            Ok(())
        } else {
            Err(mismatch())
        };
    }
    let limit = crate::placement::peer::hop_body_limit(&node.config);
    let payload = req.take_payload();
    let body = read_limited(req.headers(), payload, limit).await?;
    if auth::hop_body_sha256(&body) != claimed {
        return Err(mismatch());
    }
    req.set_payload(Payload::from(body));
    Ok(())
}
