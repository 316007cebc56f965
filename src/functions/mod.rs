//! Functions (docs/design.md §4): deploy, versions, secrets, the per-namespace
//! invoker and its triggers, on top of the sandbox in `crate::wasm`.
//!
//! - `model`: stored records, store keys, validation of names and metadata,
//!   topic globs and cron expressions.
//! - `secrets`: AES-256-GCM sealing of function secrets.
//! - `invoker`: [`FunctionsService`] (one per node: engine, record queue) and
//!   [`Invoker`] (one per namespace, owned by its supervisor).
//! - `error`: [`FnError`].

#![forbid(unsafe_code)]

mod error;
pub mod model;
mod secrets;

#[cfg(test)]
mod tests;

pub use self::{
    error::{FnError, FnResult, wasm_error_code},
    model::{
        DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT_SECONDS, FunctionMetadata, FunctionRecord,
        InvocationRecord, MAX_VERSIONS, MEMORY_MB_RANGE, TIMEOUT_RANGE, VersionMeta, blob_key,
        fn_key, parse_cron, topic_matches, valid_function_name, valid_secret_name,
    },
};
pub use self::{
    model::{ExportedFunction, fn_prefix, fnver_prefix, kv_prefix, secret_key, secret_prefix},
    secrets::{EXPORT_SEAL_V1, EXPORT_SEAL_V2, ExportBox, SecretBox},
};
