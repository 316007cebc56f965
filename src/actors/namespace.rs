//! `NamespaceSupervisor`: one actor per namespace, started lazily by the
//! [`NodeSupervisor`](super::NodeSupervisor). Handlers never hold namespace state:
//! they send one of the typed messages below and await the reply.
//!
//! A handler that panics is caught; the actor stops, actix's `Supervisor`
//! restarts it, `restarting` reloads its state from the store and the restart is
//! counted.

use super::stats::ActorStats;
use crate::storage::{BatchOp, Store, StoreError};
use actix::prelude::*;
use serde::{Deserialize, Serialize};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

/// Longest namespace KV key, in bytes.
pub const MAX_KV_KEY: usize = 1024;
/// Most keys a KV listing returns at once.
pub const MAX_KV_LIST: usize = 1000;

pub use crate::namespace::{NamespaceRecord, ns_key};

fn kv_prefix(ns: &str) -> Vec<u8> {
    format!("kv/{ns}/").into_bytes()
}

/// The journal of an import of the namespace too large for one store
/// transaction (`Store::apply_journaled`): KV requests wait while it exists.
pub fn import_journal_key(ns: &str) -> Vec<u8> {
    format!("_import/{ns}").into_bytes()
}

/// How long a KV request waits on an import in progress before finishing it
/// itself (its writer may have died).
const IMPORT_TAKEOVER: std::time::Duration = std::time::Duration::from_secs(3);
/// How long a KV request waits on an import in progress in all before 503.
const IMPORT_WAIT: std::time::Duration = std::time::Duration::from_secs(8);

/// Runs a KV store operation that refuses (`Ok(None)`) while an import of
/// `ns` is in progress: retries until it is done, finishes it after
/// [`IMPORT_TAKEOVER`], gives up after [`IMPORT_WAIT`].
async fn unless_importing<T, Fut>(
    store: &Store,
    ns: &str,
    journal: &[u8],
    mut op: impl FnMut() -> Fut,
) -> NsResult<T>
where
    Fut: std::future::Future<Output = crate::storage::StoreResult<Option<T>>>,
{
    let start = crate::util::mono_now();
    let mut pause = std::time::Duration::from_millis(5);
    let mut took_over = false;
    loop {
        if let Some(v) = op().await? {
            return Ok(v);
        }
        let waited = start.elapsed();
        if waited >= IMPORT_TAKEOVER && !took_over {
            took_over = true;
            tracing::warn!(namespace = %ns, "An import has been in progress for a while; finishing it here.");
            store.roll_forward(journal).await?;
            continue;
        }
        if waited >= IMPORT_WAIT {
            return Err(NsError::Store(StoreError::Unavailable(format!(
                "an import of namespace {ns} is in progress; try again"
            ))));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(std::time::Duration::from_millis(50));
    }
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
    /// A refusal with its own code and status (a quota reached).
    #[error("{0}")]
    Refused(crate::error::ApiError),
}

pub type NsResult<T> = Result<T, NsError>;

/// The actor.
pub struct NamespaceSupervisor {
    /// The namespace this actor serves; every key it reads or writes is under it.
    pub name: String,
    /// The node's store (local or cluster), where the namespace's data lives.
    pub store: Store,
    /// Mailbox admission, handled and restart counters, shared with the senders:
    /// the admission counter is what bounds the mailbox.
    pub stats: Arc<ActorStats>,
    /// The namespace's record as last loaded; None before the load or once deleted.
    pub record: Option<NamespaceRecord>,
    /// The admission bound; the actix mailbox is set to twice it, as a backstop.
    mailbox_capacity: usize,
    /// Live topics, local subscribers and presence (`actors/topics.rs`). Kept
    /// across a restart: it describes live sockets, which did not restart.
    pub topics: crate::pubsub::TopicTable,
    /// The namespace's function state, owned here (`actors/functions.rs`):
    /// changed by this actor's messages only, published to the calls as an
    /// immutable snapshot. None on a node built without the functions service.
    pub functions: Option<super::invoker::FnOwner>,
    /// Changes of the functions waiting for the one running to end
    /// (`actors/functions.rs`): deploys, deletes and secrets run one at a time.
    pub fn_queue: std::collections::VecDeque<FnChangeJob>,
    /// A change of the functions is running.
    pub fn_changing: bool,
    /// Whether this node is a member of the namespace. A non-member's
    /// supervisor (sockets, operator views) loads no triggers and runs no
    /// cron: those run on members only. Followed when the record's members
    /// change ([`NamespaceSupervisor::follow_membership`]).
    pub member: bool,
    /// `member`, shared with the namespace's [`super::NsHandle`] (its
    /// sockets read it to know where their serverless work runs).
    member_flag: Arc<std::sync::atomic::AtomicBool>,
    /// This node's cluster id (None on a single node: always a member).
    node_id: Option<Arc<str>>,
    /// Where the record is published for the other rooms to read
    /// (`actors/records.rs`); this supervisor is its one writer here.
    pub records: Option<super::records::Records>,
    /// The node's default quotas (`[quotas]`); the record's overrides win.
    pub quotas: Arc<crate::config::QuotaConfig>,
    /// The history of the topics the record's `history` rules name
    /// (`actors/topics.rs`); None until a message first needs it
    /// (`load_history_then`: not on wake). Kept across a restart, like the
    /// topic table.
    pub history: Option<crate::pubsub::NsHistory>,
    /// A history batch is being written; appends meanwhile wait for the next
    /// one, with the acks that wait on them.
    pub history_writing: bool,
    /// The acks waiting for the history writes queued since the last batch.
    pub history_waiters: Vec<tokio::sync::oneshot::Sender<bool>>,
    /// Publications of history topics waiting for the next sequencing
    /// transaction, with the senders of their positions (`actors/topics.rs`).
    pub history_staged: Vec<(
        crate::pubsub::history::Staged,
        tokio::sync::oneshot::Sender<Option<crate::pubsub::Position>>,
    )>,
    /// The history sweep's timer is set (`actors/topics.rs`, `arm_history_sweep`).
    pub history_sweep_armed: bool,
    /// Topics of `history_staged` this node's history copy holds no stream
    /// of yet: counted against the `history_topics` quota until sequenced.
    pub history_new: std::collections::HashSet<String>,
    /// The distinct topics of the history write in flight: each has a
    /// publication on its way, so its stream is not idle until it ends.
    pub history_in_flight: Vec<String>,
    /// Recovered publications' frames shared by the sockets holding them
    /// (`actors/topics.rs`).
    pub recovered_frames: super::topics::RecoveredFrames,
    /// Recovering subscriptions whose missed publications are on their way
    /// to the socket; live publications wait here until it says
    /// [`Release`](super::Release) (`actors/topics.rs`).
    pub held: Vec<super::topics::Held>,
    /// The node's cron timer, which a member's invoker keeps current with
    /// its cron schedules; None off a node supervisor (unit tests).
    pub cron: Option<Recipient<super::cron::CronSet>>,
    /// Set when it stops for good (deleted or passivated): actix's
    /// `Supervisor` restarts a stopped actor while any address of it is
    /// alive, and such a restart must stop again at once, not serve.
    pub ended: bool,
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
            fn_queue: Default::default(),
            fn_changing: false,
            member: true,
            member_flag: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            node_id: None,
            records: None,
            quotas: Default::default(),
            history: None,
            history_writing: false,
            history_waiters: Vec::new(),
            history_staged: Vec::new(),
            history_new: std::collections::HashSet::new(),
            history_in_flight: Vec::new(),
            recovered_frames: Default::default(),
            history_sweep_armed: false,
            held: Vec::new(),
            cron: None,
            ended: false,
        }
    }

    /// Stops for good (no restart, see `ended`), letting go of the
    /// addresses of itself that it handed out.
    pub(crate) fn end(&mut self, ctx: &mut Context<Self>) {
        self.ended = true;
        if let Some(f) = &mut self.functions {
            f.detach();
        }
        ctx.terminate();
    }

    /// Keeps the node's cron timer current with this namespace's schedules
    /// (members only: see `functions_started`).
    pub fn with_cron(mut self, cron: Recipient<super::cron::CronSet>) -> Self {
        self.cron = Some(cron);
        self
    }

    /// Publishes the record to the node's directory of records.
    pub fn with_records(mut self, records: super::records::Records) -> Self {
        self.records = Some(records);
        self
    }

    /// Gives the supervisor the node's default quotas.
    pub fn with_quotas(mut self, quotas: Arc<crate::config::QuotaConfig>) -> Self {
        self.quotas = quotas;
        self
    }

    /// The namespace's quota limits: its record's overrides over the node's defaults.
    pub fn limits(&self) -> crate::quota::Limits {
        let none = crate::quota::Overrides::new();
        let overrides = self.record.as_ref().map_or(&none, |r| &r.quotas);
        crate::quota::Limits::of(&self.quotas, overrides)
    }

    /// Changes one field of the namespace's record: reads the record from
    /// the store (its other fields are the store's: another node may have
    /// written them), applies `change`, writes it back and publishes it;
    /// replies with the record. Every `Set*` message of the record uses it.
    pub(crate) fn change_record(
        &mut self,
        change: impl FnOnce(&mut NamespaceRecord) + 'static,
    ) -> ResponseActFuture<Self, NsResult<NamespaceRecord>> {
        let timer = self.stats.begin();
        let store = self.store.clone();
        let key = ns_key(&self.name);
        Box::pin(
            async move {
                let _timer = timer;
                let Some(mut rec) = store.get_json::<NamespaceRecord>(&key).await? else {
                    return Err(NsError::NotFound);
                };
                change(&mut rec);
                store.put_json(&key, &rec).await?;
                Ok(rec)
            }
            .into_actor(self)
            .map(|res, act, _| {
                if let Ok(rec) = &res {
                    act.set_record(Some(rec.clone()));
                }
                res
            }),
        )
    }

    /// Sets the record and publishes it (None: the namespace is gone).
    pub(crate) fn set_record(&mut self, record: Option<NamespaceRecord>) {
        if let Some(r) = &self.records {
            r.publish(&self.name, self.stats.id, record.as_ref());
        }
        self.record = record;
        let limits = self.limits();
        if let Some(f) = &mut self.functions {
            f.set_limits(limits);
        }
    }

    /// Marks this node (cluster id `node_id`) a member of the namespace or
    /// not (see `member`), the flag shared with the namespace's handle.
    pub fn with_member(
        mut self,
        flag: Arc<std::sync::atomic::AtomicBool>,
        node_id: Option<Arc<str>>,
    ) -> Self {
        self.member = flag.load(std::sync::atomic::Ordering::Relaxed);
        self.member_flag = flag;
        self.node_id = node_id;
        self
    }

    /// After the record was read again: if the members changed this node's
    /// part, the supervisor turns full (triggers loaded, cron scheduled) or
    /// light (no trigger fires, cron stops at its next slot) in place, its
    /// sockets and topics kept.
    pub(crate) fn follow_membership(&mut self, ctx: &mut Context<Self>) {
        let (Some(id), Some(rec)) = (&self.node_id, &self.record) else {
            return;
        };
        let member = crate::placement::is_member(&rec.members, id);
        if member == self.member {
            return;
        }
        self.member = member;
        self.member_flag
            .store(member, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(namespace = %self.name, member, "This node's membership of the namespace changed.");
        if member {
            self.functions_started(ctx);
        }
    }

    /// Gives the namespace its invoker from the node's functions service.
    pub fn with_functions(mut self, invoker: Option<super::invoker::Invoker>) -> Self {
        self.functions = invoker.map(super::invoker::FnOwner::new);
        self
    }

    /// Connects the topic table to the node's pub/sub delivery service.
    pub fn with_pubsub(mut self, service: crate::pubsub::PubSubService) -> Self {
        self.topics = crate::pubsub::TopicTable::new(service);
        self
    }

    /// Shares the topic table's routes with the node's mesh ingress, which
    /// delivers messages from other nodes without this supervisor (call
    /// after [`with_pubsub`](Self::with_pubsub)).
    pub fn with_mesh_routes(mut self, routes: crate::pubsub::MeshRoutes) -> Self {
        self.topics.share_routes(routes);
        self
    }

    /// Loads the namespace's state from the store (at start and after a restart).
    fn reload(&mut self, ctx: &mut Context<Self>) {
        let store = self.store.clone();
        let key = ns_key(&self.name);
        ctx.wait(
            async move { store.get_json::<NamespaceRecord>(&key).await }.into_actor(self).map(|res, act, ctx| {
                match res {
                    Ok(rec) => {
                        act.set_record(rec);
                        act.follow_membership(ctx);
                    }
                    Err(e) => tracing::error!(namespace = %act.name, error = %e, "Namespace state could not be loaded."),
                }
            }),
        );
        // The history is not loaded here: the first message that needs it
        // loads it (`actors/topics.rs`, `load_history_then`).
    }

    /// Runs a handler body, turning a panic into a restart instead of a dead actor.
    pub(crate) fn guarded<R>(
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

/// A queued change of the namespace's functions: given the supervisor when
/// its turn comes, it returns the work to run beside the mailbox.
pub type FnChangeJob =
    Box<dyn FnOnce(&mut NamespaceSupervisor) -> ResponseActFuture<NamespaceSupervisor, ()>>;

impl Actor for NamespaceSupervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if self.ended {
            // Restarted by actix while an address was still held: stop again.
            ctx.stop();
            return;
        }
        // The admission counter in ActorStats is the bound; this is only a backstop.
        ctx.set_mailbox_capacity(self.mailbox_capacity.saturating_mul(2).max(16));
        self.reload(ctx);
        // A restart dropped the context's timers: the sweep is armed again
        // if the history kept across it holds anything.
        self.history_sweep_armed = false;
        self.arm_history_sweep(ctx);
        // After a restart, what was staged meanwhile is written now.
        self.flush_history(ctx);
        // A change of the functions cut off by a restart answered its
        // sender with an error; the next ones go on.
        self.fn_changing = false;
        self.next_fn_change(ctx);
        if self.member {
            self.functions_started(ctx);
        } else {
            // Guests it runs directly may still publish; no triggers, no cron.
            self.attach_functions(ctx);
        }
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        // Readers go back to the store until a supervisor runs again (a
        // restart under `Supervisor` publishes again at once).
        if let Some(r) = &self.records {
            r.retire(&self.name, self.stats.id);
        }
    }
}

impl Supervised for NamespaceSupervisor {
    fn restarting(&mut self, ctx: &mut Context<Self>) {
        if self.ended {
            return;
        }
        self.stats.restarted();
        tracing::warn!(namespace = %self.name, restarts = self.stats.restarts(), "Namespace supervisor restarted.");
        self.record = None;
        // A history write in flight went with the context (its publishers
        // were answered when their senders dropped): the next may start, and
        // only the publications still staged hold new topics.
        self.history_writing = false;
        self.history_in_flight.clear();
        let history = self.history.as_ref();
        self.history_new = self
            .history_staged
            .iter()
            .map(|(s, _)| s.topic.clone())
            .filter(|t| !history.is_some_and(|h| h.has_topic(t)))
            .collect();
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
    /// The namespace's stored record.
    pub record: NamespaceRecord,
    /// How often the supervisor restarted after a panic (an operator's health signal).
    pub restarts: u64,
    /// Messages the supervisor has handled since the node started.
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

/// Sent when the record changed in the store elsewhere (another node of the
/// cluster wrote it): the supervisor reads it again and republishes it.
#[derive(Message)]
#[rtype(result = "()")]
pub struct ReloadRecord;

impl Handler<ReloadRecord> for NamespaceSupervisor {
    type Result = ();
    fn handle(&mut self, _: ReloadRecord, ctx: &mut Context<Self>) {
        // Sent with `do_send` by the store watch, past admission.
        let _t = self.stats.timer();
        self.reload(ctx);
    }
}

/// Sent by `PUT /v1/namespaces/{ns}/claims-provider`: names the function that
/// adds custom claims to the namespace's tokens (None removes it). The
/// supervisor writes its record and publishes it; replies with the record.
#[derive(Message)]
#[rtype(result = "NsResult<NamespaceRecord>")]
pub struct SetClaimsProvider {
    /// A function of the namespace (checked to exist by the caller), or None.
    pub function: Option<String>,
}

impl Handler<SetClaimsProvider> for NamespaceSupervisor {
    type Result = ResponseActFuture<Self, NsResult<NamespaceRecord>>;
    fn handle(&mut self, msg: SetClaimsProvider, _: &mut Context<Self>) -> Self::Result {
        self.change_record(move |rec| rec.claims_provider = msg.function)
    }
}

/// Sent by `PUT /v1/namespaces/{ns}/members` (the operator) and by the
/// cluster's replacement of a dead member: the namespace's new members
/// (checked live by the caller), written to its record and published;
/// replies with the record. Every node follows through the record watch
/// (a new member starts serving, an old one stops firing triggers and cron).
#[derive(Message)]
#[rtype(result = "NsResult<NamespaceRecord>")]
pub struct SetMembers {
    /// The node ids, at least one, no duplicates.
    pub members: Vec<String>,
}

impl Handler<SetMembers> for NamespaceSupervisor {
    type Result = ResponseActFuture<Self, NsResult<NamespaceRecord>>;
    fn handle(&mut self, msg: SetMembers, _: &mut Context<Self>) -> Self::Result {
        self.change_record(move |rec| rec.members = msg.members)
    }
}

/// Sent by `PUT /v1/namespaces/{ns}/quotas` (the operator): replaces the
/// namespace's quota overrides (checked by the caller), written to its
/// record and published; replies with the record. Lowering a quota below
/// the usage refuses only what would grow it further.
#[derive(Message)]
#[rtype(result = "NsResult<NamespaceRecord>")]
pub struct SetQuotas {
    /// The overrides by resource name; the others fall back to `[quotas]`.
    pub quotas: crate::quota::Overrides,
}

impl Handler<SetQuotas> for NamespaceSupervisor {
    type Result = ResponseActFuture<Self, NsResult<NamespaceRecord>>;
    fn handle(&mut self, msg: SetQuotas, _: &mut Context<Self>) -> Self::Result {
        self.change_record(move |rec| rec.quotas = msg.quotas)
    }
}

/// Sent by `PUT /v1/namespaces/{ns}/wallet-sign-in`: the namespace's wallet
/// sign-in setting (checked by the caller), replacing the one before. The
/// supervisor writes its record and publishes it; replies with the record.
#[derive(Message)]
#[rtype(result = "NsResult<NamespaceRecord>")]
pub struct SetWalletSignIn {
    /// The new setting.
    pub setting: crate::auth::WalletSignIn,
}

impl Handler<SetWalletSignIn> for NamespaceSupervisor {
    type Result = ResponseActFuture<Self, NsResult<NamespaceRecord>>;
    fn handle(&mut self, msg: SetWalletSignIn, _: &mut Context<Self>) -> Self::Result {
        self.change_record(move |rec| rec.wallet_sign_in = Some(msg.setting))
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

/// Sent (without awaiting a reply) by the operator's fault-injection route
/// `debug/hold` (`[debug] fault_injection`): the supervisor handles nothing
/// else for `ms` milliseconds and keeps this message's mailbox slot until
/// then, so with `[server] mailbox_capacity = 1` every client request to
/// the namespace meanwhile finds the mailbox full (503 `OVERLOADED`). The
/// wait is a timer, not a blocked thread.
#[derive(Message)]
#[rtype(result = "()")]
pub struct InjectHold {
    /// How long the supervisor holds, in milliseconds.
    pub ms: u64,
}

impl Handler<InjectHold> for NamespaceSupervisor {
    type Result = ();
    fn handle(&mut self, msg: InjectHold, ctx: &mut Context<Self>) {
        let t = self.stats.timer();
        let hold = actix::clock::sleep(std::time::Duration::from_millis(msg.ms));
        ctx.wait(hold.into_actor(self).map(move |_, act, _| {
            // The slot `tell` took, given back only now.
            act.stats.cancel();
            drop(t);
        }));
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
    /// The key within the namespace's KV, 1 to `MAX_KV_KEY` bytes (checked by `run`).
    pub key: String,
}

impl KvGet {
    /// The read: needs nothing the supervisor owns but the namespace's name
    /// and the store, so `GET /v1/kv/{key}` runs it on its own thread (no
    /// round trip through the mailbox) and the handler below runs the same.
    /// The import check is the same either way.
    pub async fn run(self, store: &Store, ns: &str) -> NsResult<Option<Vec<u8>>> {
        let k = kv_key(ns, &self.key)?;
        let j = import_journal_key(ns);
        unless_importing(store, ns, &j, || store.get_unless(&k, &j)).await
    }
}

impl Handler<KvGet> for NamespaceSupervisor {
    type Result = ResponseFuture<NsResult<Option<Vec<u8>>>>;
    fn handle(&mut self, msg: KvGet, _: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let store = self.store.clone();
        let ns = self.name.clone();
        Box::pin(async move { msg.run(&store, &ns).await })
    }
}

/// Sent by `PUT /v1/kv/{key}`; replies once the value is durable.
#[derive(Message)]
#[rtype(result = "NsResult<()>")]
pub struct KvPut {
    /// The key within the namespace's KV, 1 to `MAX_KV_KEY` bytes.
    pub key: String,
    /// The value to store: the request body as given (bounded by the HTTP payload limit).
    pub value: Vec<u8>,
}

impl Handler<KvPut> for NamespaceSupervisor {
    type Result = ResponseFuture<NsResult<()>>;
    fn handle(&mut self, msg: KvPut, _: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let store = self.store.clone();
        let ns = self.name.clone();
        let limits = self.limits();
        Box::pin(async move {
            kv_write(&store, &ns, &limits, msg.key.as_bytes(), Some(&msg.value))
                .await
                .map(|_| ())
        })
    }
}

/// Writes (`Some`) or deletes (`None`) one KV key of `ns`, counted against
/// its `kv_bytes` and `kv_keys` quotas in the same guarded store change as
/// the write (so the usage record is exact on every node), and not while
/// an import is in progress. Replies whether the key existed; a write past
/// a quota is refused whole (`NsError::Refused`, nothing written). Every
/// KV write goes through here: the HTTP routes and the guests' `kv_put`.
pub async fn kv_write(
    store: &Store,
    ns: &str,
    limits: &crate::quota::Limits,
    key: &[u8],
    value: Option<&[u8]>,
) -> NsResult<bool> {
    use crate::quota::{Group, Resource, Usage, usage_key};
    if key.is_empty() || key.len() > MAX_KV_KEY {
        return Err(NsError::BadInput(format!(
            "a KV key is 1 to {MAX_KV_KEY} bytes"
        )));
    }
    let mut k = kv_prefix(ns);
    k.extend_from_slice(key);
    let u = usage_key(ns, Group::Kv);
    let j = import_journal_key(ns);
    let keys = [k.clone(), u.clone()];
    // `Err(None)`: the namespace has no usage record yet (made before
    // quotas): it is counted once and the change decided again.
    let decide = |vals: &[Option<Vec<u8>>]| {
        let old = vals[0].as_ref().map(|v| key.len() + v.len());
        let new = value.map(|v| key.len() + v.len());
        if old.is_none() && new.is_none() {
            return Ok((Vec::new(), false));
        }
        // An unreadable record counts from zero rather than block every write.
        let mut usage = match vals[1].as_deref() {
            None => return Err(None),
            raw => Usage::decode(raw).unwrap_or_default(),
        };
        let bytes = new.unwrap_or(0) as i64 - old.unwrap_or(0) as i64;
        let count = i64::from(new.is_some()) - i64::from(old.is_some());
        usage
            .apply(
                limits,
                &[(Resource::KvBytes, bytes), (Resource::KvKeys, count)],
            )
            .map_err(Some)?;
        let write = match value {
            Some(v) => BatchOp::Put(k.clone(), v.to_vec()),
            None => BatchOp::Delete(k.clone()),
        };
        Ok((
            vec![write, BatchOp::Put(u.clone(), usage.encode())],
            old.is_some(),
        ))
    };
    loop {
        let r =
            unless_importing(store, ns, &j, || store.transact(&keys, Some(&j), &decide)).await?;
        match r {
            Ok(existed) => return Ok(existed),
            Err(Some(refused)) => return Err(NsError::Refused(refused)),
            Err(None) => crate::quota::ensure_usage(store, ns, Group::Kv).await?,
        }
    }
}

/// Sent by `DELETE /v1/kv/{key}`; replies whether the key existed.
#[derive(Message)]
#[rtype(result = "NsResult<bool>")]
pub struct KvDelete {
    /// The key within the namespace's KV to delete.
    pub key: String,
}

impl Handler<KvDelete> for NamespaceSupervisor {
    type Result = ResponseFuture<NsResult<bool>>;
    fn handle(&mut self, msg: KvDelete, _: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let store = self.store.clone();
        let ns = self.name.clone();
        let limits = self.limits();
        Box::pin(async move { kv_write(&store, &ns, &limits, msg.key.as_bytes(), None).await })
    }
}

/// Sent by `GET /v1/kv?prefix=`; replies with one page of the matching keys
/// in order, and the key (relative to the namespace) the next page resumes
/// after (None on the last page).
#[derive(Message)]
#[rtype(result = "NsResult<(Vec<String>, Option<Vec<u8>>)>")]
pub struct KvList {
    /// Only keys starting with this are listed (empty: all).
    pub prefix: String,
    /// The page starts strictly after this key (None: from the first).
    pub after: Option<Vec<u8>>,
    /// Most keys to return; capped at `MAX_KV_LIST` by the handler.
    pub limit: usize,
}

impl Handler<KvList> for NamespaceSupervisor {
    type Result = ResponseFuture<NsResult<(Vec<String>, Option<Vec<u8>>)>>;
    fn handle(&mut self, msg: KvList, _: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let store = self.store.clone();
        let ns = self.name.clone();
        Box::pin(async move {
            let base = kv_prefix(&ns);
            let mut p = base.clone();
            p.extend_from_slice(msg.prefix.as_bytes());
            let after = msg.after.map(|a| [base.as_slice(), &a].concat());
            let j = import_journal_key(&ns);
            let limit = msg.limit.min(MAX_KV_LIST);
            // Keys only: a listing of large values must not read them
            // (it cost 41 ms of CPU a call over 250 values of 1 MB).
            let (keys, last) = unless_importing(&store, &ns, &j, || {
                store.scan_keys_page_unless(&p, after.as_deref(), limit, &j)
            })
            .await?;
            let keys = keys
                .into_iter()
                .map(|k| String::from_utf8_lossy(&k[base.len()..]).into_owned())
                .collect();
            Ok((keys, last.map(|k| k[base.len()..].to_vec())))
        })
    }
}

/// One exported KV entry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ExportEntry {
    /// The key within the namespace's KV (its store prefix stripped).
    pub key: String,
    /// The value, base64 (standard alphabet): values are arbitrary bytes.
    pub value_base64: String,
}

/// The first export format, the namespace KV only (`{"format":1,...}`):
/// still accepted by `PUT /v1/db/import`, which then replaces the KV only.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NamespaceExport {
    /// The export format: 1 for this KV-only layout.
    pub format: u32,
    /// The namespace exported from; informational (an import may target another).
    #[serde(default)]
    pub namespace: String,
    /// Every KV entry of the namespace, in key order.
    pub kv: Vec<ExportEntry>,
}

/// What `GET /v1/db/export` reads through the supervisor: the KV, the
/// function records, their versions, the sealed secrets, the deployment
/// records and their versions, each key relative to its prefix. One snapshot
/// at which no import was in progress.
#[derive(Debug, Default)]
pub struct NamespaceRows {
    /// KV entries: key within the namespace, raw value.
    pub kv: Vec<(String, Vec<u8>)>,
    /// Function records (JSON), by function name.
    pub functions: Vec<(String, Vec<u8>)>,
    /// Function version records (JSON), by `<function>/<version>`.
    pub versions: Vec<(String, Vec<u8>)>,
    /// Secrets as sealed in the store, by name; the route reseals them for the export.
    pub secrets: Vec<(String, Vec<u8>)>,
    /// Deployment records (JSON), by deployment name.
    pub deployments: Vec<(String, Vec<u8>)>,
    /// Deployment version records (JSON), relative to their prefix.
    pub deployment_versions: Vec<(String, Vec<u8>)>,
}

/// Sent by `GET /v1/db/export`; replies with the namespace's rows.
#[derive(Message)]
#[rtype(result = "NsResult<NamespaceRows>")]
pub struct Export;

impl Handler<Export> for NamespaceSupervisor {
    type Result = AtomicResponse<Self, NsResult<NamespaceRows>>;
    fn handle(&mut self, _: Export, _: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let store = self.store.clone();
        let ns = self.name.clone();
        AtomicResponse::new(Box::pin(
            async move {
                // One snapshot of them all, at which no import was in progress.
                let prefixes = [
                    kv_prefix(&ns),
                    crate::functions::fn_prefix(&ns),
                    crate::functions::fnver_prefix(&ns),
                    crate::functions::secret_prefix(&ns),
                    crate::deploy::model::dep_prefix(&ns),
                    crate::deploy::model::ns_ver_prefix(&ns),
                ];
                let j = import_journal_key(&ns);
                let rows = unless_importing(&store, &ns, &j, || {
                    store.scan_unless(&prefixes, usize::MAX, &j)
                })
                .await?;
                let mut parts = prefixes.iter().zip(rows).map(|(prefix, rows)| {
                    rows.into_iter()
                        .map(|(k, v)| (String::from_utf8_lossy(&k[prefix.len()..]).into_owned(), v))
                        .collect::<Vec<_>>()
                });
                Ok(NamespaceRows {
                    kv: parts.next().unwrap_or_default(),
                    functions: parts.next().unwrap_or_default(),
                    versions: parts.next().unwrap_or_default(),
                    secrets: parts.next().unwrap_or_default(),
                    deployments: parts.next().unwrap_or_default(),
                    deployment_versions: parts.next().unwrap_or_default(),
                })
            }
            .into_actor(self),
        ))
    }
}

/// Sent by `PUT /v1/db/import` with an import the route checked whole: the
/// namespace's KV becomes exactly `kv`, the keys under each of `replace`
/// (for a whole-namespace import: the functions, their versions, the
/// secrets) become exactly `records`, and `extra` (the deployments and host
/// claims, prepared under the deployment lock) lands with them. One change
/// for every KV reader and writer, on any node: `Store::apply_journaled`
/// under [`import_journal_key`], the KV as its steps, the rest as its last
/// part, which must fit one store transaction. The supervisor holds its
/// mailbox meanwhile. Replies `Ok(Err(reason))`, nothing written, when the
/// last part is too large.
#[derive(Message)]
#[rtype(result = "NsResult<Result<(), String>>")]
pub struct Import {
    /// The namespace's whole new KV, as full store keys and values: every other key goes.
    pub kv: Vec<(Vec<u8>, Vec<u8>)>,
    /// Store prefixes whose keys become exactly `records` (empty for a KV-only import).
    pub replace: Vec<Vec<u8>>,
    /// The new rows under `replace` (full store keys), written in the journal's last part.
    pub records: Vec<(Vec<u8>, Vec<u8>)>,
    /// Further writes (deployments, host claims) that land with `records`, atomically.
    pub extra: Vec<BatchOp>,
}

/// The writes that make the keys under `prefixes` exactly `puts`: deletes of
/// the others first, then the puts.
async fn replacing(
    store: &Store,
    prefixes: &[Vec<u8>],
    puts: Vec<(Vec<u8>, Vec<u8>)>,
) -> NsResult<Vec<BatchOp>> {
    let mut ops = Vec::new();
    {
        let written: std::collections::HashSet<&[u8]> =
            puts.iter().map(|(k, _)| k.as_slice()).collect();
        for prefix in prefixes {
            for (k, _) in store.scan_all(prefix).await? {
                if !written.contains(k.as_slice()) {
                    ops.push(BatchOp::Delete(k));
                }
            }
        }
    }
    ops.extend(puts.into_iter().map(|(k, v)| BatchOp::Put(k, v)));
    Ok(ops)
}

impl Handler<Import> for NamespaceSupervisor {
    type Result = AtomicResponse<Self, NsResult<Result<(), String>>>;
    fn handle(&mut self, msg: Import, _: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let store = self.store.clone();
        let functions = self.functions.as_ref().map(|f| f.invoker().clone());
        let ns = self.name.clone();
        AtomicResponse::new(Box::pin(
            async move {
                let journal = import_journal_key(&ns);
                // A journal a dead importer left is finished first.
                store.roll_forward(&journal).await?;
                let steps = replacing(&store, &[kv_prefix(&ns)], msg.kv).await?;
                let mut last = msg.extra;
                last.extend(replacing(&store, &msg.replace, msg.records).await?);
                let mut closing = last.clone();
                closing.push(BatchOp::Delete(journal.clone()));
                if let Err(why) = store.check_atomic(&closing) {
                    return Ok((Err(why), None));
                }
                store.apply_journaled(&journal, steps, last).await?;
                // The functions may all have changed: their triggers are read
                // again and every kept resolution forgotten.
                let change = match functions {
                    Some(inv) => Some(inv.load_triggers().await.unwrap_or_else(|e| {
                        tracing::warn!(namespace = %ns, error = %e, "Function triggers could not be reloaded after an import.");
                        super::invoker::Change::Secrets
                    })),
                    None => None,
                };
                Ok((Ok(()), change))
            }
            .into_actor(self)
            .map(|res: NsResult<_>, act, _| {
                res.map(|(r, change)| {
                    if let (Some(c), Some(f)) = (change, act.functions.as_mut()) {
                        f.apply(c);
                    }
                    r
                })
            }),
        ))
    }
}
