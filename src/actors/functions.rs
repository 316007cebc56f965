//! The functions messages of a namespace's supervisor (docs/design.md §4). The
//! supervisor owns its namespace's function state
//! ([`FnOwner`](super::invoker::FnOwner)); handlers check the namespace still
//! exists and return the [`Invoker`]'s store work as a future, so slow store
//! work never holds the mailbox and guests never run on the actor's thread
//! (they run on the engine's worker pool). The changes (deploy, delete,
//! secrets) queue and run one at a time; each is applied to the owned state,
//! which is published to the calls as a new snapshot, before its reply.

use std::future::Future;
use std::sync::Arc;

use super::cron::{CronDue, CronSet};
use super::invoker::{CallerInfo, Change, DeployRequest, Deployed, Invoker, Trigger};
use super::namespace::{FnChangeJob, NamespaceSupervisor};
use super::topics::Publish;
use crate::functions::{FnError, FnResult, FunctionRecord, InvocationRecord, VersionMeta};
use crate::wasm::{CompiledModule, HostError};
use actix::prelude::*;
use bytes::Bytes;

impl NamespaceSupervisor {
    /// The invoker, if the namespace exists and the node runs functions.
    fn invoker(&self) -> FnResult<Invoker> {
        if self.record.is_none() {
            return Err(FnError::NamespaceGone);
        }
        self.functions
            .as_ref()
            .map(|f| f.invoker().clone())
            .ok_or_else(|| FnError::Internal("functions are not enabled on this node".into()))
    }

    /// Gives the guests their publish path: this supervisor's bounded
    /// mailbox, behind a weak address (a strong one held by the invoker
    /// would keep a stopped supervisor's mailbox connected, and actix's
    /// `Supervisor` would restart it).
    pub(crate) fn attach_functions(&mut self, ctx: &mut Context<Self>) {
        let Some(f) = self.functions.as_mut() else {
            return;
        };
        let addr = ctx.address().downgrade();
        let stats = self.stats.clone();
        f.attach(Arc::new(move |topic, data, depth| {
            let Some(addr) = addr.upgrade() else {
                return Err(HostError::Internal(
                    "the namespace supervisor is not attached".into(),
                ));
            };
            // Bounded like any other sender: a full mailbox is LIMIT, never a wait.
            if !stats.admit() {
                return Err(HostError::LimitReached);
            }
            match addr.try_send(Publish { topic, data, depth }) {
                Ok(()) => Ok(()),
                Err(_) => {
                    stats.cancel();
                    Err(HostError::LimitReached)
                }
            }
        }));
    }

    /// Queues a change of the namespace's functions (deploy, delete, a
    /// secret): the changes run one at a time, in mailbox order, each
    /// applied to the state this supervisor owns (and published to the
    /// calls) before its reply. The store work runs beside the mailbox: KV,
    /// pub/sub and calls are not held up by a deploy.
    fn change_functions<T, F>(
        &mut self,
        ctx: &mut Context<Self>,
        work: impl FnOnce(Invoker) -> F + 'static,
    ) -> ResponseFuture<FnResult<T>>
    where
        T: 'static,
        F: Future<Output = FnResult<(T, Change)>> + 'static,
    {
        let timer = self.stats.begin();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: FnChangeJob = Box::new(move |act: &mut Self| {
            let inv = act.invoker();
            Box::pin(
                async move { work(inv?).await }
                    .into_actor(act)
                    .map(move |res, act, _| {
                        let reply = res.map(|(t, change)| {
                            if let Some(f) = act.functions.as_mut() {
                                f.apply(change);
                            }
                            t
                        });
                        let _ = tx.send(reply);
                    }),
            )
        });
        self.fn_queue.push_back(job);
        self.next_fn_change(ctx);
        Box::pin(async move {
            let _timer = timer;
            rx.await.unwrap_or_else(|_| {
                Err(FnError::Internal(
                    "the namespace supervisor stopped during the change".into(),
                ))
            })
        })
    }

    /// Starts the next queued change of the functions, unless one runs.
    pub(crate) fn next_fn_change(&mut self, ctx: &mut Context<Self>) {
        if self.fn_changing {
            return;
        }
        let Some(job) = self.fn_queue.pop_front() else {
            return;
        };
        self.fn_changing = true;
        let fut = job(self);
        ctx.spawn(fut.map(|(), act, ctx| {
            act.fn_changing = false;
            act.next_fn_change(ctx);
        }));
    }

    /// Called from `started`: attaches the invoker to this actor (its guests
    /// publish through it) and loads the triggers before any message is
    /// handled (a publish or a cron slot that woke the supervisor finds
    /// them); from then on the invoker keeps the node's cron timer current.
    pub(crate) fn functions_started(&mut self, ctx: &mut Context<Self>) {
        let Some(inv) = self.functions.as_ref().map(|f| f.invoker().clone()) else {
            return;
        };
        self.attach_functions(ctx);
        let name = self.name.clone();
        ctx.wait(async move { inv.load_triggers().await }.into_actor(self).map(
            move |res, act, _| {
                let Some(f) = act.functions.as_mut() else {
                    return;
                };
                match res {
                    Ok(change) => f.apply(change),
                    Err(e) => {
                        tracing::warn!(namespace = %name, error = %e, "Function triggers could not be loaded.")
                    }
                }
                if let Some(sink) = act.cron.clone() {
                    f.schedule_crons_with(sink);
                }
            },
        ));
    }

    /// The pub/sub trigger path, called once for every accepted client
    /// publish (not for presence events), after local delivery, with the
    /// publisher's trigger depth (0 for clients; a function publishing from a
    /// trigger passes its depth + 1, and triggers stop at depth 5): fires the
    /// functions whose patterns match.
    pub(crate) fn fire_pubsub_triggers(&self, topic: &str, data: &Bytes, depth: u8) {
        if !self.member {
            return;
        }
        if let Some(f) = &self.functions {
            f.invoker().on_published(topic, data, depth);
        }
    }
}

/// Sent by the internal route a non-member calls (`POST
/// /v1/internal/pubsub/fire`, docs/cluster.md "Placement"): publications a
/// socket on that node published, whose pub/sub triggers this member fires,
/// as it fires those of its own clients' publishes (depth 0). Replies with
/// whether this supervisor fires triggers (false: not a member here).
#[derive(Message)]
#[rtype(result = "bool")]
pub struct FireTriggers {
    /// (topic, data) of each publication, in publish order.
    pub messages: Vec<(String, Bytes)>,
}

impl Handler<FireTriggers> for NamespaceSupervisor {
    type Result = bool;
    fn handle(&mut self, msg: FireTriggers, _: &mut Context<Self>) -> bool {
        let _t = self.stats.begin();
        if !self.member {
            return false;
        }
        for (topic, data) in &msg.messages {
            self.fire_pubsub_triggers(topic, data, 0);
        }
        true
    }
}

impl Handler<CronDue> for NamespaceSupervisor {
    type Result = ();
    fn handle(&mut self, msg: CronDue, _: &mut Context<Self>) {
        // Sent past admission but counted (`admit_always`) by the node's timer.
        let _t = self.stats.begin();
        // Cron runs on members only; a non-member's supervisor has no
        // triggers, and the node's timer forgets the namespace (it was a
        // member when the schedules were read).
        if !self.member {
            if let Some(cron) = &self.cron {
                cron.do_send(CronSet {
                    namespace: self.name.clone(),
                    entries: Vec::new(),
                });
            }
            return;
        }
        if let Some(owner) = &self.functions {
            for f in msg.fires {
                owner.invoker().fire_cron(&f.function, &f.expr, f.slot);
            }
        }
    }
}

/// Sent by `POST /v1/functions` with a module already validated and compiled;
/// replies with the new version once it is durable and current.
#[derive(Message)]
#[rtype(result = "FnResult<Deployed>")]
pub struct DeployFunction {
    /// The checked name, limits and metadata, and the module's bytes.
    pub req: DeployRequest,
    /// The compiled module, kept in the invoker's cache as the new version.
    pub module: Arc<CompiledModule>,
}

impl Handler<DeployFunction> for NamespaceSupervisor {
    type Result = ResponseFuture<FnResult<Deployed>>;
    fn handle(&mut self, msg: DeployFunction, ctx: &mut Context<Self>) -> Self::Result {
        self.change_functions(ctx, move |inv| async move {
            inv.deploy(msg.req, msg.module).await
        })
    }
}

/// Sent by `GET /v1/functions`; replies with one page of the function
/// records, by name, and the name the next page resumes after (None on the
/// last page).
#[derive(Message)]
#[rtype(result = "FnResult<(Vec<FunctionRecord>, Option<Vec<u8>>)>")]
pub struct ListFunctions {
    /// The page starts strictly after this name (None: from the first).
    pub after: Option<Vec<u8>>,
    /// Most records on the page.
    pub limit: usize,
}

impl Handler<ListFunctions> for NamespaceSupervisor {
    type Result = ResponseFuture<FnResult<(Vec<FunctionRecord>, Option<Vec<u8>>)>>;
    fn handle(&mut self, msg: ListFunctions, _: &mut Context<Self>) -> Self::Result {
        let timer = self.stats.begin();
        let inv = self.invoker();
        Box::pin(async move {
            let _timer = timer;
            inv?.list(msg.after.as_deref(), msg.limit).await
        })
    }
}

/// Sent by `GET /v1/functions/{name}`; replies with the record, the current
/// version's settings and the engine's cache counters.
#[derive(Message)]
#[rtype(result = "FnResult<serde_json::Value>")]
pub struct ShowFunction {
    /// The function's name.
    pub name: String,
}

impl Handler<ShowFunction> for NamespaceSupervisor {
    type Result = ResponseFuture<FnResult<serde_json::Value>>;
    fn handle(&mut self, msg: ShowFunction, _: &mut Context<Self>) -> Self::Result {
        let timer = self.stats.begin();
        let inv = self.invoker();
        Box::pin(async move {
            let _timer = timer;
            inv?.show(&msg.name).await
        })
    }
}

/// Sent by `GET /v1/functions/{name}/versions`; replies with the kept versions.
#[derive(Message)]
#[rtype(result = "FnResult<Vec<VersionMeta>>")]
pub struct FunctionVersions {
    /// The function's name.
    pub name: String,
}

impl Handler<FunctionVersions> for NamespaceSupervisor {
    type Result = ResponseFuture<FnResult<Vec<VersionMeta>>>;
    fn handle(&mut self, msg: FunctionVersions, _: &mut Context<Self>) -> Self::Result {
        let timer = self.stats.begin();
        let inv = self.invoker();
        Box::pin(async move {
            let _timer = timer;
            inv?.versions(&msg.name).await
        })
    }
}

/// Sent by `DELETE /v1/functions/{name}`; replies once it is gone.
#[derive(Message)]
#[rtype(result = "FnResult<()>")]
pub struct DeleteFunction {
    /// The function's name; its versions, triggers and logs go with it.
    pub name: String,
}

impl Handler<DeleteFunction> for NamespaceSupervisor {
    type Result = ResponseFuture<FnResult<()>>;
    fn handle(&mut self, msg: DeleteFunction, ctx: &mut Context<Self>) -> Self::Result {
        self.change_functions(ctx, move |inv| async move {
            inv.delete(&msg.name).await.map(|c| ((), c))
        })
    }
}

/// A call to resolve in one namespace: what the invoke routes, `/v1/ws` and
/// the claims provider hand to [`NsHandle::prepare`](crate::actors::NsHandle::prepare).
pub struct PrepareInvoke {
    /// The function to call, in the handle's namespace.
    pub name: String,
    /// A kept version to run; None runs the current one.
    pub version: Option<u64>,
    /// The guest's stdin, already within the engine's input limit: the
    /// sender's edge checked it (see `docs/architecture.md`, "Checked once").
    pub input: Vec<u8>,
    /// Who calls and the request id, for the `caller` import and the record.
    pub caller: CallerInfo,
    /// What started the call, written into the invocation record.
    pub trigger: Trigger,
}

/// Sent by `GET /v1/functions/{name}/logs`; replies with the newest records.
#[derive(Message)]
#[rtype(result = "FnResult<Vec<InvocationRecord>>")]
pub struct FunctionLogs {
    /// The function's name.
    pub name: String,
    /// Most records returned, newest first; clamped to 1..=[`MAX_LOGS`](crate::actors::MAX_LOGS).
    pub limit: usize,
}

impl Handler<FunctionLogs> for NamespaceSupervisor {
    type Result = ResponseFuture<FnResult<Vec<InvocationRecord>>>;
    fn handle(&mut self, msg: FunctionLogs, _: &mut Context<Self>) -> Self::Result {
        let timer = self.stats.begin();
        let inv = self.invoker();
        Box::pin(async move {
            let _timer = timer;
            inv?.logs(&msg.name, msg.limit).await
        })
    }
}

/// Sent by `PUT /v1/functions/secrets`; replies once the sealed value is durable.
#[derive(Message)]
#[rtype(result = "FnResult<()>")]
pub struct PutSecret {
    /// The secret's name: an environment variable name the guests see it under.
    pub key: String,
    /// The secret, sealed before it is stored; at most 16 KiB.
    pub value: String,
}

impl Handler<PutSecret> for NamespaceSupervisor {
    type Result = ResponseFuture<FnResult<()>>;
    fn handle(&mut self, msg: PutSecret, ctx: &mut Context<Self>) -> Self::Result {
        self.change_functions(ctx, move |inv| async move {
            inv.put_secret(&msg.key, &msg.value).await.map(|c| ((), c))
        })
    }
}

/// Sent by `GET /v1/functions/secrets`; replies with secret names (never values).
#[derive(Message)]
#[rtype(result = "FnResult<Vec<String>>")]
pub struct ListSecrets;

impl Handler<ListSecrets> for NamespaceSupervisor {
    type Result = ResponseFuture<FnResult<Vec<String>>>;
    fn handle(&mut self, _: ListSecrets, _: &mut Context<Self>) -> Self::Result {
        let timer = self.stats.begin();
        let inv = self.invoker();
        Box::pin(async move {
            let _timer = timer;
            inv?.list_secrets().await
        })
    }
}

/// Sent by `DELETE /v1/functions/secrets/{key}`; replies once it is gone (NotFound if absent).
#[derive(Message)]
#[rtype(result = "FnResult<()>")]
pub struct DeleteSecret {
    /// The secret's name.
    pub key: String,
}

impl Handler<DeleteSecret> for NamespaceSupervisor {
    type Result = ResponseFuture<FnResult<()>>;
    fn handle(&mut self, msg: DeleteSecret, ctx: &mut Context<Self>) -> Self::Result {
        self.change_functions(ctx, move |inv| async move {
            inv.delete_secret(&msg.key).await.map(|c| ((), c))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actors::invoker::FunctionsService;
    use crate::actors::stats::{ActorDirectory, ask};
    use crate::metrics::Metrics;
    use crate::storage::Store;
    use std::time::Duration;

    const NOOP: &[u8] = br#"(module (func (export "_start")))"#;

    fn request(name: &str) -> DeployRequest {
        DeployRequest {
            name: name.into(),
            wasm: NOOP.to_vec(),
            memory_limit_mb: 16,
            timeout_seconds: 5,
            is_public: false,
            env_vars: Default::default(),
            pubsub_topics: Vec::new(),
            cron: Vec::new(),
        }
    }

    /// Deploys sent at once are changes of the state the supervisor owns,
    /// run one at a time from its queue (no lock): each gets its own
    /// version, and the snapshot the calls read moves with each. A secret
    /// set through the supervisor is seen by the next call.
    #[actix_rt::test]
    async fn deploys_sent_at_once_get_a_version_each() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        let rec = crate::namespace::NamespaceRecord::new("ns", 1);
        store
            .put_json(&crate::namespace::ns_key("ns"), &rec)
            .await
            .unwrap();
        let metrics = Metrics::new();
        let stats = ActorDirectory::default().register(&metrics, "namespace", "ns", 64);
        let engine = crate::wasm::WasmEngine::new(
            crate::wasm::WasmConfig::default(),
            dir.path().join("cache"),
        )
        .unwrap();
        let svc = FunctionsService::start(engine, store.clone(), metrics, &[7u8; 32]);
        let inv = svc.invoker("ns");
        let addr = NamespaceSupervisor::new("ns".into(), store, stats.clone(), 64)
            .with_functions(Some(inv.clone()))
            .start();
        let module = svc.compile("ns", NOOP.to_vec()).await.unwrap();
        let before = inv.snapshot().generation;
        let deploys = (0..5).map(|_| {
            let msg = DeployFunction {
                req: request("f"),
                module: module.clone(),
            };
            ask(&addr, &stats, msg, Duration::from_secs(10))
        });
        let mut versions: Vec<u64> = futures_util::future::join_all(deploys)
            .await
            .into_iter()
            .map(|r| r.unwrap().unwrap().version)
            .collect();
        versions.sort_unstable();
        assert_eq!(versions, [1, 2, 3, 4, 5]);
        assert!(inv.snapshot().generation >= before + 5);
        assert!(inv.snapshot().publisher.is_some(), "attached");

        let caller = || CallerInfo {
            subject: None,
            request_id: "r".into(),
            trace: None,
        };
        let p = inv
            .prepare("f".into(), None, Vec::new(), caller(), Trigger::Http, 0)
            .await
            .unwrap();
        assert_eq!(p.version, 5);
        let put = PutSecret {
            key: "TOKEN".into(),
            value: "a".into(),
        };
        ask(&addr, &stats, put, Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap();
        let p = inv
            .prepare("f".into(), None, Vec::new(), caller(), Trigger::Http, 0)
            .await
            .unwrap();
        assert!(p.env().iter().any(|(k, v)| k == "TOKEN" && v == "a"));
    }
}
