//! The actor topology of docs/design.md §1: the node supervisor, one supervisor per
//! namespace, and the instrumentation every actor reports through.

#![forbid(unsafe_code)]

mod cron;
mod functions;
mod invoker;
mod namespace;
mod node;
mod records;
mod stats;
mod topics;
mod watch;

pub use cron::{CronDue, CronEntry, CronFire, CronSet, CronTable, stored_crons};
pub use functions::{
    DeleteFunction, DeleteSecret, DeployFunction, FireTriggers, FunctionLogs, FunctionVersions,
    ListFunctions, ListSecrets, PrepareInvoke, PutSecret, ShowFunction,
};
pub use invoker::{
    CallerInfo, DeployRequest, Deployed, FunctionsService, Invoker, MAX_LOGS, MAX_TRIGGER_DEPTH,
    Prepared, Reply, Trigger,
};
pub use namespace::{
    Export, ExportEntry, GetInfo, Import, InjectHold, InjectPanic, KvDelete, KvGet, KvList, KvPut,
    MAX_KV_KEY, MAX_KV_LIST, NamespaceExport, NamespaceInfo, NamespaceRecord, NamespaceRows,
    NamespaceSupervisor, NsError, NsResult, ReloadRecord, SetClaimsProvider, SetMembers, SetQuotas,
    SetWalletSignIn, kv_write, ns_key,
};
pub use node::{
    ASK_TIMEOUT, CreateNamespace, DeleteNamespace, Forget, Locate, LocateError, Namespaces,
    NodeSupervisor, NsHandle, Passivate, Sweep, WakeMember, locate, namespace_prefixes,
};
pub use records::{RECORD_TTL, Records};
pub use stats::{ActorDirectory, ActorStats, AskError, HandleTimer, ask, histogram_quantile, tell};
pub use topics::{
    HistoryOf, HistoryPage, HistoryState, MeshMessage, Presence, Publish, PublishBatch,
    ReadHistory, Release, ReplaceHistory, Replicated, SetHistory, Subscribe, Subscribed, Topics,
    Unsubscribe, UnsubscribeAll,
};
pub use watch::follow as follow_records;
