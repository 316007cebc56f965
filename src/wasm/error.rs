//! Errors of the WASM module and the guest ABI error codes.

#![forbid(unsafe_code)]

/// Result alias of the WASM module.
pub type Result<T, E = WasmError> = std::result::Result<T, E>;

/// Why compiling or running a guest failed.
///
/// Grouped by who is at fault: the deployer (`InvalidModule`, `UnknownImport`,
/// `ModuleTooLarge`, `ModuleTooComplex`), the caller (`InputTooLarge`), the guest (`OutputTooLarge`,
/// `Timeout`, `Trapped`, `MemoryLimit`, `DepthExceeded`), load (`Busy`,
/// `Overloaded`, `CompileBusy`, `CompileTimeout`) and the node itself (`Internal`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WasmError {
    /// The bytes are not a valid module (or not a WASI command module).
    #[error("invalid module: {0}")]
    InvalidModule(String),
    /// The module imports something the host does not provide, as `module::name`.
    #[error("unknown import: {0}")]
    UnknownImport(String),
    /// The module is bigger than `WasmConfig::max_module_bytes` (or, as
    /// WAT text, than `max_wat_bytes`).
    #[error("module too large: {size} bytes, the limit is {max} ([functions] {key})")]
    ModuleTooLarge {
        /// Size of the module, in bytes.
        size: usize,
        /// The limit, in bytes.
        max: usize,
        /// The limit's config key.
        key: &'static str,
    },
    /// The module declares more than a `[functions]` limit allows (functions,
    /// locals, globals, data...): refused before it is compiled. The message
    /// names the count, its value and the limit.
    #[error("module too complex: {0}")]
    ModuleTooComplex(String),
    /// The namespace already has a compile waiting or running (retryable).
    #[error("a compile of this namespace is already running; try again when it is done")]
    CompileBusy,
    /// The compile did not end before `compile_timeout_ms` (waiting for a
    /// slot included); its result, if it ends later, is dropped (retryable).
    #[error("compile timed out: {0}")]
    CompileTimeout(String),
    /// The input is bigger than 1 MiB.
    #[error("input too large (limit 1 MiB)")]
    InputTooLarge,
    /// The guest wrote more than 1 MiB to stdout.
    #[error("output too large (limit 1 MiB)")]
    OutputTooLarge,
    /// The guest ran past its deadline.
    #[error("function timed out")]
    Timeout,
    /// The guest trapped or exited with a non-zero code.
    #[error("function trapped: {0}")]
    Trapped(String),
    /// The guest failed after its memory limit refused to grow it.
    #[error("function exceeded its memory limit")]
    MemoryLimit,
    /// The namespace's queue is full, or the invocation waited for a worker
    /// longer than the queue wait (both retryable).
    #[error("namespace busy: no worker free in time for this namespace")]
    Busy,
    /// The node's invocation queue is full.
    #[error("node overloaded: invocation queue full")]
    Overloaded,
    /// Nested invocations went deeper than the limit.
    #[error("nested invocation depth exceeded")]
    DepthExceeded,
    /// A fault of the node, not of the guest.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Why a [`HostApi`](super::HostApi) call failed; each maps to one guest error code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// No such key or function.
    #[error("not found")]
    NotFound,
    /// The namespace may not do this.
    #[error("denied")]
    Denied,
    /// A quota or rate limit was reached.
    #[error("limit reached")]
    LimitReached,
    /// An argument was rejected (bad topic, key too long...).
    #[error("bad argument")]
    BadArgument,
    /// The node failed.
    #[error("internal error: {0}")]
    Internal(String),
}

/// The guest ABI error codes: distinct negatives, documented in `docs/guest-abi.md`.
pub mod codes {
    /// The key or function does not exist.
    pub const NOT_FOUND: i32 = -1;
    /// Reserved: the output buffer is too small (kv_get, invoke and caller return the length instead).
    pub const BUFFER_TOO_SMALL: i32 = -2;
    /// The namespace may not do this.
    pub const DENIED: i32 = -3;
    /// A limit was reached (1,000 publishes, depth 5, a quota).
    pub const LIMIT: i32 = -4;
    /// A pointer out of bounds, a non-UTF-8 name, a bad level...
    pub const BAD_ARGUMENT: i32 = -5;
    /// The host or the called function failed.
    pub const INTERNAL: i32 = -6;
}

impl HostError {
    /// The guest ABI code of this error.
    pub fn code(&self) -> i32 {
        match self {
            HostError::NotFound => codes::NOT_FOUND,
            HostError::Denied => codes::DENIED,
            HostError::LimitReached => codes::LIMIT,
            HostError::BadArgument => codes::BAD_ARGUMENT,
            HostError::Internal(_) => codes::INTERNAL,
        }
    }
}
