//! The functions messages of a namespace's supervisor (docs/design.md §4). The
//! supervisor owns its namespace's [`Invoker`]; handlers check the namespace
//! still exists and return the invoker's work as a future, so slow store
//! work never holds the mailbox and guests never run on the actor's thread
//! (they run on the engine's worker pool).

use std::sync::Arc;

use super::invoker::{CallerInfo, DeployRequest, Deployed, Invoker, Trigger};
use super::namespace::NamespaceSupervisor;
use crate::functions::{FnError, FnResult, FunctionRecord, InvocationRecord, VersionMeta};
use crate::wasm::CompiledModule;
use actix::prelude::*;
use bytes::Bytes;

impl NamespaceSupervisor {
    /// The invoker, if the namespace exists and the node runs functions.
    fn invoker(&self) -> FnResult<Invoker> {
        if self.record.is_none() {
            return Err(FnError::NamespaceGone);
        }
        self.functions
            .clone()
            .ok_or_else(|| FnError::Internal("functions are not enabled on this node".into()))
    }

    /// Called from `started`: attaches the invoker to this actor (its guests
    /// publish through it) and loads the triggers before any message is
    /// handled (a publish or a cron slot that woke the supervisor finds
    /// them); from then on the invoker keeps the node's cron timer current.
    pub(super) fn functions_started(&mut self, ctx: &mut Context<Self>) {
        let Some(inv) = self.functions.clone() else {
            return;
        };
        inv.attach(ctx.address(), self.stats.clone());
        let name = self.name.clone();
        let cron = self.cron.clone();
        ctx.wait(
            async move {
                if let Err(e) = inv.load_triggers().await {
                    tracing::warn!(namespace = %name, error = %e, "Function triggers could not be loaded.");
                }
                if let Some(sink) = cron {
                    inv.schedule_crons_with(sink);
                }
            }
            .into_actor(self),
        );
    }

    /// The pub/sub trigger path, called once for every accepted client
    /// publish (not for presence events), after local delivery, with the
    /// publisher's trigger depth (0 for clients; a function publishing from a
    /// trigger passes its depth + 1, and triggers stop at depth 5): fires the
    /// functions whose patterns match.
    pub(super) fn fire_pubsub_triggers(&self, topic: &str, data: &Bytes, depth: u8) {
        if let Some(inv) = &self.functions {
            inv.on_published(topic, data, depth);
        }
    }
}

impl Handler<super::CronDue> for NamespaceSupervisor {
    type Result = ();
    fn handle(&mut self, msg: super::CronDue, _: &mut Context<Self>) {
        // Sent past admission but counted (`admit_always`) by the node's timer.
        let _t = self.stats.begin();
        // Cron runs on members only; a non-member's supervisor has no
        // triggers, and the node's timer forgets the namespace (it was a
        // member when the schedules were read).
        if !self.member {
            if let Some(cron) = &self.cron {
                cron.do_send(super::CronSet {
                    namespace: self.name.clone(),
                    entries: Vec::new(),
                });
            }
            return;
        }
        if let Some(inv) = &self.functions {
            for f in msg.fires {
                inv.fire_cron(&f.function, &f.expr, f.slot);
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
    fn handle(&mut self, msg: DeployFunction, _: &mut Context<Self>) -> Self::Result {
        let timer = self.stats.begin();
        let inv = self.invoker();
        Box::pin(async move {
            let _timer = timer;
            inv?.deploy(msg.req, msg.module).await
        })
    }
}

/// Sent by `GET /v1/functions`; replies with every function record.
#[derive(Message)]
#[rtype(result = "FnResult<Vec<FunctionRecord>>")]
pub struct ListFunctions;

impl Handler<ListFunctions> for NamespaceSupervisor {
    type Result = ResponseFuture<FnResult<Vec<FunctionRecord>>>;
    fn handle(&mut self, _: ListFunctions, _: &mut Context<Self>) -> Self::Result {
        let timer = self.stats.begin();
        let inv = self.invoker();
        Box::pin(async move {
            let _timer = timer;
            inv?.list().await
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
    fn handle(&mut self, msg: DeleteFunction, _: &mut Context<Self>) -> Self::Result {
        let timer = self.stats.begin();
        let inv = self.invoker();
        Box::pin(async move {
            let _timer = timer;
            inv?.delete(&msg.name).await
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
    fn handle(&mut self, msg: PutSecret, _: &mut Context<Self>) -> Self::Result {
        let timer = self.stats.begin();
        let inv = self.invoker();
        Box::pin(async move {
            let _timer = timer;
            inv?.put_secret(&msg.key, &msg.value).await
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
    fn handle(&mut self, msg: DeleteSecret, _: &mut Context<Self>) -> Self::Result {
        let timer = self.stats.begin();
        let inv = self.invoker();
        Box::pin(async move {
            let _timer = timer;
            inv?.delete_secret(&msg.key).await
        })
    }
}
