//! The receiving side of a cluster hop: an `X-Internal-Auth-*` identity is
//! believed only with a valid hop MAC. A node outside a cluster has no hop key,
//! so every such header is dropped by the gate.

use super::chain::Identity;
use crate::node::Node;
use actix_web::dev::ServiceRequest;

/// The identity a valid hop carries, or None (the headers are then deleted).
pub fn verify_hop(_node: &Node, _req: &ServiceRequest) -> Option<Identity> {
    // Single node: no cluster secret, so no hop can be valid.
    None
}
