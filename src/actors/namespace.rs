//! `NamespaceSupervisor`: one actor per namespace, started lazily by the
//! [`NodeSupervisor`](super::NodeSupervisor). Handlers never hold namespace state:
//! they send one of the typed messages below and await the reply.
//!
//! A handler that panics is caught; the actor stops, actix's `Supervisor`
//! restarts it, `restarting` reloads its state from the store and the restart is
//! counted.

use super::stats::ActorStats;
use crate::storage::{BatchOp, OrderedKv, Store, StoreError};
use actix::prelude::*;
use serde::{Deserialize, Serialize};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

/// Longest namespace KV key, in bytes.
pub const MAX_KV_KEY: usize = 1024;
/// Most keys a KV listing returns at once.
pub const MAX_KV_LIST: usize = 1000;

/// The durable record of a namespace (`ns/<name>`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NamespaceRecord {
    pub name: String,
    pub created_at: u64,
    /// Member nodes (cluster placement); empty on a single node.
    #[serde(default)]
    pub members: Vec<String>,
    /// Per-namespace rate limit override: requests per minute.
    #[serde(default)]
    pub rate_per_minute: Option<u32>,
    /// Per-namespace rate limit override: burst.
    #[serde(default)]
    pub rate_burst: Option<u32>,
    /// Function that adds custom claims to this namespace's tokens.
    #[serde(default)]
    pub claims_provider: Option<String>,
}

/// Store key of a namespace record.
pub fn ns_key(name: &str) -> Vec<u8> {
    format!("ns/{name}").into_bytes()
}

fn kv_prefix(ns: &str) -> Vec<u8> {
    format!("kv/{ns}/").into_bytes()
}

/// What a namespace supervisor's handlers can fail with.
#[derive(Debug, thiserror::Error)]
pub enum NsError {
    #[error("namespace not found")]
    NotFound,
    #[error("{0}")]
    BadInput(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("internal error: the namespace actor failed and was restarted")]
    Panicked,
}

pub type NsResult<T> = Result<T, NsError>;

/// The actor.
pub struct NamespaceSupervisor {
    pub name: String,
    pub store: Store,
    pub stats: Arc<ActorStats>,
    pub record: Option<NamespaceRecord>,
    mailbox_capacity: usize,
    /// Live topics, local subscribers and presence (`actors/topics.rs`). Kept
    /// across a restart: it describes live sockets, which did not restart.
    pub topics: crate::pubsub::TopicTable,
    /// The namespace's function invoker (`actors/functions.rs`); None on a
    /// node built without the functions service.
    pub functions: Option<crate::functions::Invoker>,
    /// Whether this node is a member of the namespace. A non-member's
    /// supervisor (sockets, operator views, claims) loads no triggers and
    /// runs no cron: those run on members only.
    pub member: bool,
}

impl NamespaceSupervisor {
    pub fn new(
        name: String,
        store: Store,
        stats: Arc<ActorStats>,
        mailbox_capacity: usize,
    ) -> Self {
        Self {
            name,
            store,
            stats,
            record: None,
            mailbox_capacity,
            topics: Default::default(),
            functions: None,
            member: true,
        }
    }

    /// Marks this node a member of the namespace or not (see `member`).
    pub fn with_member(mut self, member: bool) -> Self {
        self.member = member;
        self
    }

    /// Gives the namespace its invoker from the node's functions service.
    pub fn with_functions(mut self, service: Option<crate::functions::FunctionsService>) -> Self {
        self.functions = service.map(|s| s.invoker(&self.name));
        self
    }

    /// Connects the topic table to the node's pub/sub delivery service.
    pub fn with_pubsub(mut self, service: crate::pubsub::PubSubService) -> Self {
        self.topics = crate::pubsub::TopicTable::new(service);
        self
    }

    /// Loads the namespace's state from the store (at start and after a restart).
    fn reload(&mut self, ctx: &mut Context<Self>) {
        let store = self.store.clone();
        let key = ns_key(&self.name);
        ctx.wait(
            async move { store.get_json::<NamespaceRecord>(&key).await }.into_actor(self).map(|res, act, _| {
                match res {
                    Ok(rec) => act.record = rec,
                    Err(e) => tracing::error!(namespace = %act.name, error = %e, "Namespace state could not be loaded."),
                }
            }),
        );
    }

    /// Runs a handler body, turning a panic into a restart instead of a dead actor.
    pub(super) fn guarded<R>(
        &mut self,
        ctx: &mut Context<Self>,
        f: impl FnOnce(&mut Self) -> NsResult<R>,
    ) -> NsResult<R> {
        match std::panic::catch_unwind(AssertUnwindSafe(|| f(self))) {
            Ok(r) => r,
            Err(_) => {
                tracing::error!(namespace = %self.name, "Namespace supervisor panicked; restarting.");
                ctx.stop();
                Err(NsError::Panicked)
            }
        }
    }
}

impl Actor for NamespaceSupervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // The admission counter in ActorStats is the bound; this is only a backstop.
        ctx.set_mailbox_capacity(self.mailbox_capacity.saturating_mul(2).max(16));
        self.reload(ctx);
        if self.member {
            self.functions_started(ctx);
        } else if let Some(inv) = &self.functions {
            // Guests it runs directly may still publish; no triggers, no cron.
            inv.attach(ctx.address(), self.stats.clone());
        }
    }
}

impl Supervised for NamespaceSupervisor {
    fn restarting(&mut self, ctx: &mut Context<Self>) {
        self.stats.restarted();
        tracing::warn!(namespace = %self.name, restarts = self.stats.restarts(), "Namespace supervisor restarted.");
        self.record = None;
        self.reload(ctx);
    }
}

/// Sent by handlers that need the namespace record; replies with it (NotFound once deleted).
#[derive(Message)]
#[rtype(result = "NsResult<NamespaceInfo>")]
pub struct GetInfo;

/// A namespace as shown by its supervisor.
#[derive(Debug, Clone, Serialize)]
pub struct NamespaceInfo {
    pub record: NamespaceRecord,
    pub restarts: u64,
    pub handled: u64,
}

impl Handler<GetInfo> for NamespaceSupervisor {
    type Result = NsResult<NamespaceInfo>;
    fn handle(&mut self, _: GetInfo, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        self.guarded(ctx, |act| {
            let record = act.record.clone().ok_or(NsError::NotFound)?;
            Ok(NamespaceInfo {
                record,
                restarts: act.stats.restarts(),
                handled: act.stats.handled(),
            })
        })
    }
}

/// Sent by the operator's fault-injection route (`[debug] fault_injection`): the
/// handler panics, so the reply is always `Err(Panicked)` and the actor restarts.
#[derive(Message)]
#[rtype(result = "NsResult<()>")]
pub struct InjectPanic;

impl Handler<InjectPanic> for NamespaceSupervisor {
    type Result = NsResult<()>;
    fn handle(&mut self, _: InjectPanic, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        self.guarded(ctx, |_| panic!("fault injected"))
    }
}

/// The store key of a namespace KV key, after checking its length.
fn kv_key(ns: &str, key: &str) -> NsResult<Vec<u8>> {
    check_key(key)?;
    let mut k = kv_prefix(ns);
    k.extend_from_slice(key.as_bytes());
    Ok(k)
}

fn check_key(key: &str) -> NsResult<()> {
    if key.is_empty() || key.len() > MAX_KV_KEY {
        return Err(NsError::BadInput(format!(
            "a KV key is 1 to {MAX_KV_KEY} bytes"
        )));
    }
    Ok(())
}

/// Sent by `GET /v1/kv/{key}`; replies with the value or None.
#[derive(Message)]
#[rtype(result = "NsResult<Option<Vec<u8>>>")]
pub struct KvGet {
    pub key: String,
}

impl Handler<KvGet> for NamespaceSupervisor {
    type Result = ResponseFuture<NsResult<Option<Vec<u8>>>>;
    fn handle(&mut self, msg: KvGet, _: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let store = self.store.clone();
        let ns = self.name.clone();
        Box::pin(async move {
            let k = kv_key(&ns, &msg.key)?;
            Ok(store.get(&k).await?)
        })
    }
}

/// Sent by `PUT /v1/kv/{key}`; replies once the value is durable.
#[derive(Message)]
#[rtype(result = "NsResult<()>")]
pub struct KvPut {
    pub key: String,
    pub value: Vec<u8>,
}

impl Handler<KvPut> for NamespaceSupervisor {
    type Result = ResponseFuture<NsResult<()>>;
    fn handle(&mut self, msg: KvPut, _: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let store = self.store.clone();
        let ns = self.name.clone();
        Box::pin(async move {
            let k = kv_key(&ns, &msg.key)?;
            Ok(store.put(&k, &msg.value).await?)
        })
    }
}

/// Sent by `DELETE /v1/kv/{key}`; replies whether the key existed.
#[derive(Message)]
#[rtype(result = "NsResult<bool>")]
pub struct KvDelete {
    pub key: String,
}

impl Handler<KvDelete> for NamespaceSupervisor {
    type Result = ResponseFuture<NsResult<bool>>;
    fn handle(&mut self, msg: KvDelete, _: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let store = self.store.clone();
        let ns = self.name.clone();
        Box::pin(async move {
            let k = kv_key(&ns, &msg.key)?;
            Ok(store.delete(&k).await?)
        })
    }
}

/// Sent by `GET /v1/kv?prefix=`; replies with the matching keys in order.
#[derive(Message)]
#[rtype(result = "NsResult<Vec<String>>")]
pub struct KvList {
    pub prefix: String,
    pub limit: usize,
}

impl Handler<KvList> for NamespaceSupervisor {
    type Result = ResponseFuture<NsResult<Vec<String>>>;
    fn handle(&mut self, msg: KvList, _: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let store = self.store.clone();
        let ns = self.name.clone();
        Box::pin(async move {
            let base = kv_prefix(&ns);
            let mut p = base.clone();
            p.extend_from_slice(msg.prefix.as_bytes());
            let rows = store.scan_prefix(&p, msg.limit.min(MAX_KV_LIST)).await?;
            Ok(rows
                .into_iter()
                .map(|(k, _)| String::from_utf8_lossy(&k[base.len()..]).into_owned())
                .collect())
        })
    }
}

/// One exported KV entry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ExportEntry {
    pub key: String,
    pub value_base64: String,
}

/// The whole data of a namespace, as `GET /v1/db/export` answers and `PUT /v1/db/import` takes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NamespaceExport {
    pub format: u32,
    #[serde(default)]
    pub namespace: String,
    pub kv: Vec<ExportEntry>,
}

/// Sent by `GET /v1/db/export`; replies with every KV entry of the namespace.
#[derive(Message)]
#[rtype(result = "NsResult<NamespaceExport>")]
pub struct Export;

impl Handler<Export> for NamespaceSupervisor {
    type Result = ResponseFuture<NsResult<NamespaceExport>>;
    fn handle(&mut self, _: Export, _: &mut Context<Self>) -> Self::Result {
        use base64::Engine;
        let _t = self.stats.begin();
        let store = self.store.clone();
        let ns = self.name.clone();
        Box::pin(async move {
            let base = kv_prefix(&ns);
            let rows = store.scan_all(&base).await?;
            let kv = rows
                .into_iter()
                .map(|(k, v)| ExportEntry {
                    key: String::from_utf8_lossy(&k[base.len()..]).into_owned(),
                    value_base64: base64::engine::general_purpose::STANDARD.encode(v),
                })
                .collect();
            Ok(NamespaceExport {
                format: 1,
                namespace: ns,
                kv,
            })
        })
    }
}

/// Sent by `PUT /v1/db/import`; replaces the namespace's KV whole, atomically.
/// Replies with the number of entries written.
#[derive(Message)]
#[rtype(result = "NsResult<usize>")]
pub struct Import(pub NamespaceExport);

impl Handler<Import> for NamespaceSupervisor {
    type Result = ResponseFuture<NsResult<usize>>;
    fn handle(&mut self, msg: Import, _: &mut Context<Self>) -> Self::Result {
        use base64::Engine;
        let _t = self.stats.begin();
        let store = self.store.clone();
        let ns = self.name.clone();
        Box::pin(async move {
            if msg.0.format != 1 {
                return Err(NsError::BadInput(format!(
                    "unsupported export format {}",
                    msg.0.format
                )));
            }
            // Validate everything before touching the store: no partial state.
            let base = kv_prefix(&ns);
            let mut puts = Vec::with_capacity(msg.0.kv.len());
            let mut seen = std::collections::HashSet::new();
            for e in &msg.0.kv {
                check_key(&e.key)?;
                if !seen.insert(e.key.as_str()) {
                    return Err(NsError::BadInput(format!("duplicate key {:?}", e.key)));
                }
                let value = base64::engine::general_purpose::STANDARD
                    .decode(&e.value_base64)
                    .map_err(|_| {
                        NsError::BadInput(format!("value of {:?} is not base64", e.key))
                    })?;
                let mut k = base.clone();
                k.extend_from_slice(e.key.as_bytes());
                puts.push(BatchOp::Put(k, value));
            }
            let mut ops: Vec<BatchOp> = store
                .scan_all(&base)
                .await?
                .into_iter()
                .map(|(k, _)| BatchOp::Delete(k))
                .collect();
            let n = puts.len();
            ops.extend(puts);
            store.apply_batch(ops).await?;
            Ok(n)
        })
    }
}
