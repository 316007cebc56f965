//! The receiving side of a cluster hop (DESIGN.md §6): an `X-Internal-Auth-*`
//! identity is believed only with a valid hop MAC over this request's method and
//! path, judged by the newest MAC alone, within ±60 s. A node without a cluster
//! secret believes no hop. The gate deletes the headers either way, so the MAC
//! is consumed here and never forwarded.

use super::chain::Identity;
use crate::auth::{self, HOP_MAC_HEADER};
use crate::node::Node;
use actix_web::dev::ServiceRequest;

/// The identity a valid hop carries, or None.
pub fn verify_hop(node: &Node, req: &ServiceRequest) -> Option<Identity> {
    let key = node.hop_key.as_ref()?;
    let headers = req.headers();
    let macs: Vec<&str> = headers
        .get_all(HOP_MAC_HEADER)
        .filter_map(|v| v.to_str().ok())
        .collect();
    if macs.is_empty() {
        return None;
    }
    let hop = auth::hop_from_headers(|name| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    })?;
    let now = crate::http::routes::now();
    match key.verify(&macs, req.method().as_str(), req.path(), &hop, now) {
        Ok(_) => Some(Identity {
            subject: hop.subject.clone(),
            namespace: Some(hop.namespace.clone()),
            grants: hop.grants.iter().filter_map(|g| g.parse().ok()).collect(),
            operator: false,
            kind: "hop",
            custom: serde_json::from_str(&hop.custom).unwrap_or(serde_json::Value::Null),
            jti: hop.jti.clone(),
            exp: hop.exp,
            iat: hop.iat,
        }),
        Err(e) => {
            tracing::warn!(error = %e, "Hop refused; its identity headers are dropped.");
            None
        }
    }
}
