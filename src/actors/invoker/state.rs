//! What a namespace's supervisor publishes for its invoker: an immutable
//! [`Snapshot`] (quota limits, triggers, the publish path, the generation
//! of kept resolutions), swapped whole on every change and read lock-free
//! by every call (`arc_swap`), as `actors/records.rs` publishes records.
//! The supervisor owns the state it is made from ([`super::FnOwner`]);
//! this file names no other of the folder.

use std::sync::Arc;

use bytes::Bytes;

use crate::wasm::HostError;

/// How a guest's `publish` reaches its namespace's supervisor: the
/// supervisor's bounded mailbox, behind a weak address (an address held
/// here would keep a stopped supervisor's mailbox connected).
pub type Publisher = Arc<dyn Fn(String, Bytes, u8) -> Result<(), HostError> + Send + Sync>;

/// The triggers of one function's current version.
#[derive(Clone)]
pub struct TriggerEntry {
    /// Function the triggers fire; one entry per function, replaced on each deploy.
    pub name: String,
    /// Topic patterns matched against every accepted publish by `on_published`.
    pub topics: Vec<String>,
    /// Each cron expression with its parsed schedule: the text goes in the event.
    pub crons: Vec<(String, cron::Schedule)>,
}

/// One namespace's function state as its supervisor last published it.
#[derive(Clone, Default)]
pub struct Snapshot {
    /// The namespace's quota limits (None until the record loaded: the
    /// node's defaults); a guest's KV writes and the deploys count against them.
    pub limits: Option<crate::quota::Limits>,
    /// Pub/sub and cron triggers of each function's current version, read on
    /// every publish and cron slot.
    pub triggers: Arc<Vec<TriggerEntry>>,
    /// The publish path of the guests; None while no supervisor is attached.
    pub publisher: Option<Publisher>,
    /// Moves on every change the supervisor makes (deploy, delete, secrets,
    /// import): resolutions kept under an older one are not used.
    pub generation: u64,
}
