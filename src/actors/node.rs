//! `NodeSupervisor`: starts namespace supervisors lazily (one per namespace, spread
//! over the node's actor threads) and forgets them when a namespace is deleted.
//! Handlers find a running supervisor in the shared [`Namespaces`] directory
//! without a hop; only a first use goes through this actor.
//!
//! **Passivation.** A namespace supervisor that sat idle for
//! `[server] passivate_after_seconds` is stopped by this actor's one
//! node-wide sweep (no timer per namespace): idle means no use of its handle
//! (every lookup, message and call marks its [`ActorStats`]), no handle held
//! outside the directory (a request in flight, a socket: each holds one, see
//! [`NsHandle`]'s lease), nothing in its mailbox and no invocation prepared,
//! queued or running. The check and the removal from [`Namespaces`] happen
//! under the directory's write lock, and handles are only ever cloned out
//! of it under its read lock, so no one can get hold of a supervisor that is
//! going away; the next use starts a new one through `Locate`, which is
//! single-flight (this actor checks the directory again after reading the
//! store, on its own thread). The published record goes back to a read copy
//! ([`super::records::Records`]).
//!
//! **Cron.** The cron schedules of every namespace that has one live in this
//! actor's one timer ([`super::cron::CronTable`]), which wakes each namespace's
//! supervisor when a slot is due (starting it if it sleeps).
//!
//! In a cluster, a namespace's full supervisor (triggers loaded, cron
//! ticking) starts only on its members. On a non-member a supervisor starts
//! only for what cannot be forwarded (sockets, operator views), and then
//! without triggers or cron; a socket's invokes and triggers and a token's
//! claims provider run on a member (`http/member_call.rs`); forwarding
//! itself starts none (its breakers live in [`crate::placement::Cluster`]).

use super::namespace::{NamespaceSupervisor, NsError};
use super::stats::{ActorDirectory, ActorStats, AskError, ask};
use crate::metrics::Metrics;
use crate::storage::{OrderedKv, Store};
use actix::dev::ToEnvelope;
use actix::prelude::*;
use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a handler waits for a namespace supervisor's answer.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(10);

/// The idle sweep runs this many times per `passivate_after` (so a
/// supervisor stops at most an eighth late), within [`SWEEP_MIN`, `SWEEP_MAX`].
const SWEEPS_PER_IDLE_TIME: u32 = 8;
/// Shortest time between two idle sweeps.
const SWEEP_MIN: Duration = Duration::from_millis(100);
/// Longest time between two idle sweeps.
const SWEEP_MAX: Duration = Duration::from_secs(15);

/// A running namespace supervisor: its address and its stats.
#[derive(Clone)]
pub struct NsHandle {
    /// The namespace's name.
    pub name: Arc<str>,
    /// The supervisor's address; it runs under an actix `Supervisor`, so the
    /// address stays valid across a restart.
    pub addr: Addr<NamespaceSupervisor>,
    /// Its mailbox admission and counters: every `ask` goes through them.
    pub stats: Arc<ActorStats>,
    /// Whether this node is a member of the namespace (always on a single
    /// node): only then does its supervisor run triggers and cron. Kept by
    /// the supervisor as the record's members change ([`NsHandle::is_member`]).
    member: Arc<std::sync::atomic::AtomicBool>,
    /// The namespace's invoker, shared with its supervisor (which owns its
    /// state and changes it: deploys, secrets, triggers). Calls are resolved
    /// through it on the caller's thread, as KV reads go to the store: no
    /// mailbox round trip per call. None when functions are off.
    pub invoker: Option<super::invoker::Invoker>,
    /// The routes of the namespace's topics on this node, kept by its
    /// supervisor's topic table: messages from the mesh are delivered with
    /// them, not through the supervisor's mailbox (docs/pubsub.md).
    pub routes: crate::pubsub::MeshRoutes,
    /// Counts the handle's clones: the directory holds one, each request
    /// or socket that uses the supervisor another. A supervisor whose
    /// handle is held anywhere else is in use and does not passivate.
    lease: Arc<()>,
}

impl NsHandle {
    /// Whether this node is a member of the namespace now.
    pub fn is_member(&self) -> bool {
        self.member.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the supervisor may passivate now: its handle is held by the
    /// directory alone, its mailbox is empty and no invocation is
    /// prepared, queued or running. Checked under the directory's write lock.
    fn idle(&self) -> bool {
        Arc::strong_count(&self.lease) == 1
            && self.stats.depth() == 0
            && self.invoker.as_ref().is_none_or(|i| i.busy() == 0)
    }

    /// Sends a message through the bounded mailbox and awaits the reply.
    pub async fn ask<M>(&self, msg: M) -> Result<M::Result, AskError>
    where
        NamespaceSupervisor: Handler<M>,
        <NamespaceSupervisor as Actor>::Context: ToEnvelope<NamespaceSupervisor, M>,
        M: Message + Send + 'static,
        M::Result: Send,
    {
        ask(&self.addr, &self.stats, msg, ASK_TIMEOUT).await
    }

    /// Resolves a call in this namespace, ready to run on the worker pool
    /// (the caller runs it). The supervisor is not asked: its invoker is
    /// shared through this handle, and a resolution is checked against the
    /// stored function record on every call, so a deploy or secret change made
    /// through the supervisor is seen by the next call.
    pub async fn prepare(
        &self,
        msg: super::functions::PrepareInvoke,
    ) -> crate::functions::FnResult<super::invoker::Prepared> {
        let _t = self.stats.timer();
        let inv = self.invoker.as_ref().ok_or_else(|| {
            crate::functions::FnError::Internal("functions are not enabled on this node".into())
        })?;
        inv.prepare(msg.name, msg.version, msg.input, msg.caller, msg.trigger, 0)
            .await
    }

    /// Whether the function `name` is public, read from its record without
    /// resolving or compiling it (see [`Invoker::is_public`](super::invoker::Invoker::is_public)).
    pub async fn is_public(&self, name: &str) -> crate::functions::FnResult<bool> {
        let inv = self.invoker.as_ref().ok_or_else(|| {
            crate::functions::FnError::Internal("functions are not enabled on this node".into())
        })?;
        inv.is_public(name).await
    }

    /// Sends `msg` through the bounded admission *now* (so a socket's
    /// messages keep the order its frames arrived in) and returns the future
    /// of the reply.
    pub fn ask_now<M>(
        &self,
        msg: M,
    ) -> futures_util::future::LocalBoxFuture<'static, Result<M::Result, AskError>>
    where
        NamespaceSupervisor: Handler<M>,
        <NamespaceSupervisor as Actor>::Context: ToEnvelope<NamespaceSupervisor, M>,
        M: Message + Send + 'static,
        M::Result: Send,
    {
        if !self.stats.admit() {
            return Box::pin(std::future::ready(Err(AskError::Overloaded)));
        }
        let req = self.addr.send(msg).timeout(ASK_TIMEOUT);
        let stats = self.stats.clone();
        Box::pin(async move {
            match req.await {
                Ok(r) => Ok(r),
                Err(MailboxError::Timeout) => Err(AskError::Timeout),
                Err(MailboxError::Closed) => {
                    stats.cancel();
                    Err(AskError::Gone)
                }
            }
        })
    }
}

/// The directory of running namespace supervisors, shared with handlers.
#[derive(Clone, Default)]
pub struct Namespaces(Arc<RwLock<HashMap<String, NsHandle>>>);

impl Namespaces {
    /// The running supervisor of `name`, if any (no store read, no start).
    /// A use: it keeps the supervisor from passivating.
    pub fn get(&self, name: &str) -> Option<NsHandle> {
        let map = self.0.read();
        let h = map.get(name)?;
        h.stats.touch();
        Some(h.clone())
    }
    /// Every running namespace's handle.
    pub fn handles(&self) -> Vec<NsHandle> {
        self.0.read().values().cloned().collect()
    }
    /// Names of the namespaces running here.
    pub fn names(&self) -> Vec<String> {
        self.0.read().keys().cloned().collect()
    }
    /// Supervisors running here.
    pub fn len(&self) -> usize {
        self.0.read().len()
    }
    /// Whether none runs.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The node's top actor.
pub struct NodeSupervisor {
    /// Where namespace records are read (a namespace starts only if it exists).
    store: Store,
    /// For the actors' labelled series.
    metrics: Metrics,
    /// Every actor registers its stats here (the dashboard's actor rows).
    directory: ActorDirectory,
    /// The running supervisors, shared with handlers.
    namespaces: Namespaces,
    /// The actor threads; a namespace runs on the one its name hashes to.
    arbiters: Vec<ArbiterHandle>,
    /// Mailbox bound of this actor and of every namespace supervisor.
    mailbox_capacity: usize,
    /// This actor's own stats (kind `node`).
    stats: Arc<ActorStats>,
    /// Handed to each namespace supervisor for delivery.
    pubsub: crate::pubsub::PubSubService,
    /// Handed to each namespace supervisor for its invoker; None when the
    /// node runs no functions.
    functions: Option<super::invoker::FunctionsService>,
    /// This node's id in a cluster ([`crate::placement::node_id`]); None on a
    /// single node, where every namespace is served in full.
    node_id: Option<String>,
    /// The published records: `Locate` reads them, each namespace
    /// supervisor publishes its own.
    records: super::records::Records,
    /// The node's default quotas, handed to every namespace supervisor.
    quotas: Arc<crate::config::QuotaConfig>,
    /// How long a namespace supervisor may sit idle before it passivates.
    passivate_after: Duration,
    /// Ages the idle stamps; a `ManualClock` in unit tests.
    clock: Arc<dyn crate::util::Clock>,
    /// When the sweep last saw each running supervisor used.
    idle_since: std::collections::HashMap<String, Instant>,
    /// Every cron schedule of the namespaces that have one: the node's one timer.
    cron: super::cron::CronTable,
    /// The timer armed for the table's next slot: (unix second, handle).
    cron_timer: Option<(i64, SpawnHandle)>,
}

impl NodeSupervisor {
    /// A supervisor with `actor_threads` arbiters (at least one), no
    /// functions and a default pub/sub service until the `with_*` calls.
    pub fn new(
        store: Store,
        metrics: Metrics,
        directory: ActorDirectory,
        namespaces: Namespaces,
        actor_threads: usize,
        mailbox_capacity: usize,
    ) -> Self {
        let arbiters = (0..actor_threads.max(1))
            .map(|_| Arbiter::new().handle())
            .collect();
        let stats = directory.register(&metrics, "node", "", mailbox_capacity);
        Self {
            records: super::records::Records::new(store.clone()),
            quotas: Default::default(),
            store,
            metrics,
            directory,
            namespaces,
            arbiters,
            mailbox_capacity,
            stats,
            pubsub: Default::default(),
            functions: None,
            node_id: None,
            passivate_after: Duration::from_secs(300),
            clock: Arc::new(crate::util::SystemClock),
            idle_since: Default::default(),
            cron: Default::default(),
            cron_timer: None,
        }
    }

    /// Sets how long an idle namespace supervisor runs before it passivates
    /// (`[server] passivate_after_seconds`).
    pub fn with_passivate_after(mut self, after: Duration) -> Self {
        self.passivate_after = after;
        self
    }

    /// Sets the clock the idle sweep reads (tests move a `ManualClock`).
    pub fn with_clock(mut self, clock: Arc<dyn crate::util::Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Sets this node's cluster id, so only the namespaces it is a member of
    /// get a full supervisor.
    pub fn with_node_id(mut self, node_id: Option<String>) -> Self {
        self.node_id = node_id;
        self
    }

    /// Gives every namespace supervisor the node's default quotas (`[quotas]`).
    pub fn with_quotas(mut self, quotas: crate::config::QuotaConfig) -> Self {
        self.quotas = Arc::new(quotas);
        self
    }

    /// Shares the node's directory of published records (else a private one).
    pub fn with_records(mut self, records: super::records::Records) -> Self {
        self.records = records;
        self
    }

    /// Gives every namespace supervisor an invoker from the node's functions service.
    pub fn with_functions(mut self, functions: super::invoker::FunctionsService) -> Self {
        self.functions = Some(functions);
        self
    }

    /// Gives every namespace supervisor the node's pub/sub delivery service.
    pub fn with_pubsub(mut self, pubsub: crate::pubsub::PubSubService) -> Self {
        self.pubsub = pubsub;
        self
    }

    /// The arbiter of a namespace: stable per name, so load spreads by hash.
    fn arbiter_for(&self, name: &str) -> &ArbiterHandle {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        name.hash(&mut h);
        &self.arbiters[(h.finish() as usize) % self.arbiters.len()]
    }

    /// Starts a namespace's supervisor and lists it in [`Namespaces`].
    fn start_namespace(&mut self, name: &str, member: bool, me: Addr<Self>) -> NsHandle {
        let stats =
            self.directory
                .register(&self.metrics, "namespace", name, self.mailbox_capacity);
        let invoker = self.functions.as_ref().map(|f| f.invoker(name));
        let quotas = self.quotas.clone();
        let routes = crate::pubsub::MeshRoutes::default();
        let shared = routes.clone();
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(member));
        let (shared_flag, node_id) = (flag.clone(), self.node_id.as_deref().map(Arc::<str>::from));
        let (n, store, s, cap, pubsub, functions, records) = (
            name.to_string(),
            self.store.clone(),
            stats.clone(),
            self.mailbox_capacity,
            self.pubsub.clone(),
            invoker.clone(),
            self.records.clone(),
        );
        let addr = Supervisor::start_in_arbiter(self.arbiter_for(name), move |_| {
            NamespaceSupervisor::new(n, store, s, cap)
                .with_records(records)
                .with_quotas(quotas.clone())
                .with_pubsub(pubsub)
                .with_mesh_routes(shared.clone())
                .with_functions(functions)
                .with_member(shared_flag.clone(), node_id.clone())
                .with_cron(me.recipient())
        });
        let handle = NsHandle {
            name: name.into(),
            addr,
            stats,
            member: flag,
            invoker,
            routes,
            lease: Arc::new(()),
        };
        self.idle_since.insert(name.to_string(), self.clock.now());
        self.metrics
            .namespace_lifecycle
            .with_label_values(&["activated"])
            .inc();
        self.namespaces
            .0
            .write()
            .insert(name.to_string(), handle.clone());
        tracing::debug!(namespace = %name, member, "Namespace supervisor started.");
        handle
    }
}

impl Actor for NodeSupervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let every = (self.passivate_after / SWEEPS_PER_IDLE_TIME).clamp(SWEEP_MIN, SWEEP_MAX);
        ctx.run_interval(every, |act, _| {
            act.sweep();
        });
    }
}

impl NodeSupervisor {
    /// The running supervisor of `name`, or one started now if the
    /// namespace exists (NotFound otherwise). Single-flight: the directory is
    /// checked again on this actor's thread once the store answered.
    fn activate(&mut self, name: String) -> ResponseActFuture<Self, Result<NsHandle, NsError>> {
        if let Some(h) = self.namespaces.get(&name) {
            return Box::pin(actix::fut::ready(Ok(h)));
        }
        // Whether to start a supervisor is decided on the store itself, not
        // on a read copy in `Records`: a copy taken while the namespace was
        // being deleted could otherwise start one for a namespace that is gone.
        // A name read missing a moment ago is answered without a read
        // (`Records::load`, `MISSING_TTL`).
        let records = self.records.clone();
        let load = name.clone();
        Box::pin(
            async move { records.load(&load).await }
                .into_actor(self)
                .map(move |res, act, ctx| match res? {
                    None => Err(NsError::NotFound),
                    // Another Locate may have started it while we read the store.
                    Some(rec) => Ok(act.namespaces.get(&name).unwrap_or_else(|| {
                        let member = act
                            .node_id
                            .as_deref()
                            .is_none_or(|id| crate::placement::is_member(&rec.members, id));
                        act.start_namespace(&name, member, ctx.address())
                    })),
                }),
        )
    }

    /// One idle sweep: stops every namespace supervisor idle for
    /// `passivate_after` (see the module doc); returns how many stopped.
    fn sweep(&mut self) -> usize {
        let now = self.clock.now();
        let mut candidates = Vec::new();
        for (name, h) in self.namespaces.0.read().iter() {
            if h.stats.take_active() {
                self.idle_since.insert(name.clone(), now);
                continue;
            }
            let since = *self.idle_since.entry(name.clone()).or_insert(now);
            if now.saturating_duration_since(since) >= self.passivate_after {
                candidates.push(name.clone());
            }
        }
        let mut stopped = 0;
        for name in candidates {
            let handle = {
                let mut map = self.namespaces.0.write();
                match map.get(&name) {
                    Some(h) if h.stats.take_active() => {
                        self.idle_since.insert(name.clone(), now);
                        None
                    }
                    Some(h) if h.idle() => map.remove(&name),
                    _ => None,
                }
            };
            let Some(h) = handle else { continue };
            self.idle_since.remove(&name);
            // Readers fall back to a read copy (then the store) at once: a
            // successor started from here on publishes under its own id.
            self.records.hand_back(&name, h.stats.id);
            // No address of it may outlive the message for long: while one
            // does, actix restarts what stops (see `NamespaceSupervisor::ended`).
            let addr = h.addr.clone();
            drop(h);
            addr.do_send(Passivate);
            drop(addr);
            self.metrics
                .namespace_lifecycle
                .with_label_values(&["passivated"])
                .inc();
            tracing::debug!(namespace = %name, "Namespace supervisor passivated.");
            stopped += 1;
        }
        stopped
    }

    /// Arms the cron timer for the table's next slot (if it is not armed
    /// for that one already).
    fn arm_cron(&mut self, ctx: &mut Context<Self>) {
        let next = self.cron.next_due();
        if self.cron_timer.as_ref().map(|(t, _)| *t) == next {
            return;
        }
        if let Some((_, h)) = self.cron_timer.take() {
            ctx.cancel_future(h);
        }
        let Some(next) = next else { return };
        let now_ms = chrono::Utc::now().timestamp_millis();
        let wait = Duration::from_millis((next.saturating_mul(1000) - now_ms).max(0) as u64);
        let h = ctx.run_later(wait, |act, ctx| {
            act.cron_timer = None;
            act.cron_wake(ctx);
        });
        self.cron_timer = Some((next, h));
    }

    /// The cron timer fired: wakes each namespace with a due slot.
    fn cron_wake(&mut self, ctx: &mut Context<Self>) {
        for (ns, fires) in self.cron.pop_due(chrono::Utc::now()) {
            let deliver = |h: &NsHandle, fires| {
                h.stats.admit_always();
                h.addr.do_send(super::cron::CronDue { fires });
            };
            if let Some(h) = self.namespaces.get(&ns) {
                deliver(&h, fires);
                continue;
            }
            let wake = self.activate(ns.clone()).map(move |res, _, _| match res {
                Ok(h) => deliver(&h, fires),
                Err(e) => {
                    tracing::warn!(namespace = %ns, error = %e, "A due cron slot could not wake its namespace.")
                }
            });
            ctx.spawn(wake);
        }
        self.arm_cron(ctx);
    }
}

impl Handler<super::cron::CronSet> for NodeSupervisor {
    type Result = ();
    fn handle(&mut self, msg: super::cron::CronSet, ctx: &mut Context<Self>) {
        // Sent with `do_send` by invokers and at start, past admission.
        let _t = self.stats.timer();
        self.cron
            .set(&msg.namespace, msg.entries, chrono::Utc::now());
        self.arm_cron(ctx);
    }
}

/// Sent by tests (and free to send anywhere): runs the idle sweep now;
/// replies with how many namespace supervisors it passivated.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct Sweep;

impl Handler<Sweep> for NodeSupervisor {
    type Result = usize;
    fn handle(&mut self, _: Sweep, _: &mut Context<Self>) -> usize {
        let _t = self.stats.timer();
        self.sweep()
    }
}

/// Sent by the node supervisor's idle sweep to a namespace supervisor it
/// took out of the directory (nobody else holds its handle): it stops for
/// good, without a restart. No reply.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Passivate;

impl Handler<Passivate> for NamespaceSupervisor {
    type Result = ();
    fn handle(&mut self, _: Passivate, ctx: &mut Context<Self>) {
        let _t = self.stats.timer();
        // Its record is a read copy already; a late ReloadRecord's publish
        // under this owner is retired when it stops.
        self.end(ctx);
    }
}

/// Sent by handlers the first time they need a namespace on this node; replies
/// with its running supervisor (started now if the namespace exists) or NotFound.
#[derive(Message)]
#[rtype(result = "Result<NsHandle, NsError>")]
pub struct Locate {
    /// The namespace to find or start.
    pub name: String,
}

impl Handler<Locate> for NodeSupervisor {
    type Result = ResponseActFuture<Self, Result<NsHandle, NsError>>;
    fn handle(&mut self, msg: Locate, _: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        self.activate(msg.name)
    }
}

/// Sent by the record watch (with `do_send`) when a namespace's record
/// changed and no supervisor of it runs here: if this node is a member,
/// the namespace's stored cron schedules go into the node's timer (which
/// starts its full supervisor when a slot is due), so a node made a member
/// takes up the namespace's cron at once; its triggers and calls start the
/// supervisor when they come. On a non-member, or a single node, nothing.
#[derive(Message)]
#[rtype(result = "()")]
pub struct WakeMember {
    /// The namespace whose record changed.
    pub name: String,
}

impl Handler<WakeMember> for NodeSupervisor {
    type Result = ();
    fn handle(&mut self, msg: WakeMember, ctx: &mut Context<Self>) {
        let _t = self.stats.timer();
        let Some(id) = self.node_id.clone() else {
            return;
        };
        if self.namespaces.get(&msg.name).is_some() {
            return;
        }
        let (records, store, me) = (self.records.clone(), self.store.clone(), ctx.address());
        actix::spawn(async move {
            let member = match records.load(&msg.name).await {
                Ok(Some(rec)) => crate::placement::is_member(&rec.members, &id),
                _ => false,
            };
            if !member {
                return;
            }
            match super::cron::stored_crons_of(&store, &msg.name).await {
                Ok(entries) if !entries.is_empty() => me.do_send(super::cron::CronSet {
                    namespace: msg.name,
                    entries,
                }),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(namespace = %msg.name, error = %e, "Cron schedules of a namespace this node joined could not be read.");
                }
            }
        });
    }
}

/// Sent when a namespace is deleted (with `do_send`, past admission: it must
/// not be refused): its supervisor stops and is forgotten. No reply.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Forget {
    /// The deleted namespace.
    pub name: String,
}

impl Handler<Forget> for NodeSupervisor {
    type Result = ();
    fn handle(&mut self, msg: Forget, _: &mut Context<Self>) {
        // Sent with `do_send`, past admission: it holds no slot to give back.
        let _t = self.stats.timer();
        self.idle_since.remove(&msg.name);
        self.cron.remove(&msg.name);
        if let Some(h) = self.namespaces.0.write().remove(&msg.name) {
            h.addr.do_send(Stop);
        }
    }
}

/// Sent by `POST /v1/namespaces`: creates a namespace. Its record is
/// claimed first (compare-and-swap on `ns/<name>`), then `ops` (its first
/// API key, its usage records) are written; if they fail the claim is taken
/// back. Replies false, nothing written, when the name is taken. The node
/// supervisor is the one writer of namespace creation and deletion on this
/// node, as it is of which supervisors run (docs/architecture.md).
#[derive(Message)]
#[rtype(result = "Result<bool, NsError>")]
pub struct CreateNamespace {
    /// The new namespace's record, written as `ns/<name>`.
    pub record: crate::namespace::NamespaceRecord,
    /// Written once the name is claimed, in one batch.
    pub ops: Vec<crate::storage::BatchOp>,
}

impl Handler<CreateNamespace> for NodeSupervisor {
    type Result = ResponseFuture<Result<bool, NsError>>;
    fn handle(&mut self, msg: CreateNamespace, _: &mut Context<Self>) -> Self::Result {
        let timer = self.stats.begin();
        let (store, records) = (self.store.clone(), self.records.clone());
        Box::pin(async move {
            let _timer = timer;
            let name = msg.record.name.clone();
            let key = crate::namespace::ns_key(&name);
            let bytes = serde_json::to_vec(&msg.record)
                .map_err(|e| NsError::BadInput(format!("namespace record: {e}")))?;
            if !store
                .compare_and_swap(&key, None, Some(&bytes), None)
                .await?
            {
                return Ok(false);
            }
            if let Err(e) = store.apply_batch(msg.ops).await {
                let _ = store.delete(&key).await;
                return Err(e.into());
            }
            // A request that found the name missing a moment ago must not hide it.
            records.created(&name);
            Ok(true)
        })
    }
}

/// Store prefixes holding a namespace's data; all removed together on delete.
pub fn namespace_prefixes(ns: &str) -> Vec<String> {
    [
        "kv", "fn", "fnver", "log", "secret", "dep", "nskeys", "usage", "hist",
    ]
    .iter()
    .map(|p| format!("{p}/{ns}/"))
    .collect()
}

/// Sent by `DELETE /v1/namespaces/{name}` once the namespace's deployments
/// are gone: deletes its record, its API keys and every prefix of its data
/// ([`namespace_prefixes`]) in one atomic batch, then stops its supervisor.
/// `NotFound` when there is no such namespace.
#[derive(Message)]
#[rtype(result = "Result<(), NsError>")]
pub struct DeleteNamespace {
    /// The namespace to delete.
    pub name: String,
}

impl Handler<DeleteNamespace> for NodeSupervisor {
    type Result = ResponseFuture<Result<(), NsError>>;
    fn handle(&mut self, msg: DeleteNamespace, ctx: &mut Context<Self>) -> Self::Result {
        let timer = self.stats.begin();
        let store = self.store.clone();
        let me = ctx.address();
        Box::pin(async move {
            let _timer = timer;
            let name = msg.name;
            let key = crate::namespace::ns_key(&name);
            if store.get(&key).await?.is_none() {
                return Err(NsError::NotFound);
            }
            let mut ops = vec![crate::storage::BatchOp::Delete(key)];
            let keys = crate::identity::namespace_identity_keys(&store, &name)
                .await
                .map_err(|e| match e {
                    crate::identity::IdentityError::Store(s) => NsError::Store(s),
                    other => NsError::BadInput(other.to_string()),
                })?;
            ops.extend(keys.into_iter().map(crate::storage::BatchOp::Delete));
            for p in namespace_prefixes(&name) {
                for (k, _) in store.scan_all(p.as_bytes()).await? {
                    ops.push(crate::storage::BatchOp::Delete(k));
                }
            }
            store.apply_batch(ops).await?;
            // Past admission: the stop must not be refused.
            me.do_send(Forget { name });
            Ok(())
        })
    }
}

/// Sent by the node supervisor to stop a namespace supervisor for good.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Stop;

impl Handler<Stop> for NamespaceSupervisor {
    type Result = ();
    fn handle(&mut self, _: Stop, ctx: &mut Context<Self>) {
        // The namespace is gone: its sockets are closed (4004), not left mute.
        self.topics.close_all_sockets();
        self.end(ctx);
    }
}

/// The node's own bounded admission for `Locate`.
pub async fn locate(
    node: &Addr<NodeSupervisor>,
    node_stats: &ActorStats,
    namespaces: &Namespaces,
    name: &str,
) -> Result<NsHandle, LocateError> {
    if let Some(h) = namespaces.get(name) {
        return Ok(h);
    }
    match ask(
        node,
        node_stats,
        Locate {
            name: name.to_string(),
        },
        ASK_TIMEOUT,
    )
    .await
    {
        Ok(Ok(h)) => Ok(h),
        Ok(Err(e)) => Err(LocateError::Ns(e)),
        Err(e) => Err(LocateError::Ask(e)),
    }
}

/// Why a namespace supervisor could not be found.
#[derive(Debug, thiserror::Error)]
pub enum LocateError {
    /// The node supervisor answered: no such namespace, or the store failed.
    #[error(transparent)]
    Ns(NsError),
    /// The node supervisor did not answer (mailbox full, stopped, timed out).
    #[error(transparent)]
    Ask(AskError),
}

impl NodeSupervisor {
    /// Its mailbox admission, kept by the node for [`locate`] before the actor starts.
    pub fn stats(&self) -> Arc<ActorStats> {
        self.stats.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::ManualClock;

    /// A node supervisor on a fresh sled store with namespace `a`, an idle
    /// time of 10 s and a clock the test moves.
    async fn setup() -> (
        Addr<NodeSupervisor>,
        Arc<ActorStats>,
        Namespaces,
        Arc<ManualClock>,
        tempfile::TempDir,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        let rec = crate::namespace::NamespaceRecord::new("a", 1);
        store
            .put_json(&crate::namespace::ns_key("a"), &rec)
            .await
            .unwrap();
        let clock = Arc::new(ManualClock::default());
        let namespaces = Namespaces::default();
        let sup = NodeSupervisor::new(
            store,
            Metrics::new(),
            ActorDirectory::default(),
            namespaces.clone(),
            1,
            64,
        )
        .with_passivate_after(Duration::from_secs(10))
        .with_clock(clock.clone());
        let stats = sup.stats();
        (sup.start(), stats, namespaces, clock, dir)
    }

    /// An idle supervisor passivates once its idle time passed on the
    /// sweep's clock, not before; a held handle (a request, a socket) keeps
    /// it, and so does a use; the next `locate` starts a new one.
    #[actix_rt::test]
    async fn idle_supervisors_passivate_and_held_ones_stay() {
        let (node, stats, namespaces, clock, _dir) = setup().await;
        let h = locate(&node, &stats, &namespaces, "a").await.unwrap();
        let first = h.stats.id;
        assert_eq!(node.send(Sweep).await.unwrap(), 0);
        clock.advance(Duration::from_secs(11));
        // Held: it stays however long it idles.
        assert_eq!(node.send(Sweep).await.unwrap(), 0);
        assert_eq!(node.send(Sweep).await.unwrap(), 0);
        drop(h);
        // Used (a lookup) since the last sweep: the idle time starts again.
        assert!(namespaces.get("a").is_some());
        assert_eq!(node.send(Sweep).await.unwrap(), 0);
        clock.advance(Duration::from_secs(9));
        assert_eq!(node.send(Sweep).await.unwrap(), 0);
        clock.advance(Duration::from_secs(2));
        assert_eq!(node.send(Sweep).await.unwrap(), 1);
        assert!(namespaces.get("a").is_none());
        let h = locate(&node, &stats, &namespaces, "a").await.unwrap();
        assert_ne!(h.stats.id, first, "a new supervisor");
    }

    /// Two `Locate`s sent at once for a sleeping namespace get one supervisor.
    #[actix_rt::test]
    async fn concurrent_locates_start_one_supervisor() {
        let (node, stats, namespaces, _clock, _dir) = setup().await;
        let (x, y) = futures_util::join!(
            locate(&node, &stats, &namespaces, "a"),
            locate(&node, &stats, &namespaces, "a")
        );
        assert_eq!(x.unwrap().stats.id, y.unwrap().stats.id);
        assert_eq!(namespaces.len(), 1);
    }
}
