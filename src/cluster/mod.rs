//! The cluster (docs/design.md §6). So far: the pub/sub mesh between nodes, a
//! gated libp2p GossipSub network whose members are the peers registered in
//! the shared store, carrying every locally published message to the other
//! nodes in per-publisher order (`mesh.rs`, `reorder.rs`), and the node's
//! mesh identity (`key.rs`).

#![forbid(unsafe_code)]

mod key;
mod mesh;
mod reorder;

pub use key::{KEY_FILE, load_or_create_keypair};
pub use mesh::{
    Connectedness, DeliverFn, DropHook, FORWARD_QUEUE, HEARTBEAT, MAX_TRANSMIT, MESH_TOPIC, Mesh,
    MeshConfig, MeshStatus, REGISTRY_INTERVAL, REGISTRY_PREFIX, REGISTRY_TTL, REORDER_BYTES,
    RESEND_AFTER, RESEND_BYTES, RESEND_MESSAGES, STREAM_IDLE, registered_addrs,
};
pub use reorder::{Dropped, Pushed, Reorder};

pub use libp2p::identity::Keypair;
pub use libp2p::{Multiaddr, PeerId};

/// What starting or running the mesh can fail with.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    /// The key file cannot be read, written or decoded.
    #[error("mesh key {path}: {reason}")]
    Key { path: String, reason: String },
    /// The libp2p host could not be built (transport or GossipSub set-up).
    #[error("mesh set-up failed: {0}")]
    Setup(String),
    /// The listen address was refused or never came up.
    #[error("mesh cannot listen on {addr}: {reason}")]
    Listen { addr: String, reason: String },
}

pub type MeshResult<T> = Result<T, MeshError>;
