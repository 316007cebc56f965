//! Errors of the functions capability.

use crate::storage::StoreError;
use crate::wasm::WasmError;

/// Result alias of the functions module.
pub type FnResult<T> = Result<T, FnError>;

/// Why a functions operation failed.
#[derive(Debug, thiserror::Error)]
pub enum FnError {
    /// No such function (or version, or secret).
    #[error("{0}")]
    NotFound(String),
    /// The request is malformed or out of range; `code` is the stable API code.
    #[error("{message}")]
    BadInput {
        /// Stable upper-case code.
        code: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The caller may not do this (a non-public function called anonymously).
    #[error("{0}")]
    Denied(String),
    /// The namespace is gone.
    #[error("namespace not found")]
    NamespaceGone,
    /// Compiling or running the guest failed.
    #[error(transparent)]
    Wasm(#[from] WasmError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A fault of the node.
    #[error("internal error: {0}")]
    Internal(String),
}

impl FnError {
    pub(crate) fn bad(code: &'static str, message: impl Into<String>) -> Self {
        FnError::BadInput {
            code,
            message: message.into(),
        }
    }
}

/// The stable API code of a sandbox error (also the `status` of its invocation record).
pub fn wasm_error_code(e: &WasmError) -> &'static str {
    match e {
        WasmError::InvalidModule(_) => "INVALID_MODULE",
        WasmError::UnknownImport(_) => "UNKNOWN_IMPORT",
        WasmError::ModuleTooLarge { .. } => "MODULE_TOO_LARGE",
        WasmError::InputTooLarge => "INPUT_TOO_LARGE",
        WasmError::OutputTooLarge => "OUTPUT_TOO_LARGE",
        WasmError::Timeout => "FUNCTION_TIMEOUT",
        WasmError::Trapped(_) => "FUNCTION_TRAPPED",
        WasmError::MemoryLimit => "FUNCTION_MEMORY_LIMIT",
        WasmError::Busy => "FUNCTION_BUSY",
        WasmError::Overloaded => "OVERLOADED",
        WasmError::DepthExceeded => "DEPTH_EXCEEDED",
        WasmError::Internal(_) => "INTERNAL",
    }
}

impl FnError {
    /// The stable API code (the `status` of an invocation record).
    pub fn code(&self) -> &'static str {
        match self {
            FnError::NotFound(_) => "FUNCTION_NOT_FOUND",
            FnError::BadInput { code, .. } => code,
            FnError::Denied(_) => "FUNCTION_NOT_PUBLIC",
            FnError::NamespaceGone => "NAMESPACE_NOT_FOUND",
            FnError::Wasm(w) => wasm_error_code(w),
            FnError::Store(_) => "STORE_UNAVAILABLE",
            FnError::Internal(_) => "INTERNAL",
        }
    }
}
