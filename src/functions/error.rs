//! Errors of the functions capability.

use crate::error::Code;
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
        /// Its code (a 400 or 413 of the table in `crate::error`).
        code: Code,
        /// What is wrong.
        message: String,
    },
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
    /// A refusal with its own code and status (a quota reached).
    #[error("{0}")]
    Refused(crate::error::ApiError),
}

impl FnError {
    pub(crate) fn bad(code: Code, message: impl Into<String>) -> Self {
        FnError::BadInput {
            code,
            message: message.into(),
        }
    }
}

/// The stable API code of a sandbox error (also the `status` of its invocation record).
pub fn wasm_error_code(e: &WasmError) -> Code {
    match e {
        WasmError::InvalidModule(_) => Code::InvalidModule,
        WasmError::UnknownImport(_) => Code::UnknownImport,
        WasmError::ModuleTooLarge { .. } => Code::ModuleTooLarge,
        WasmError::ModuleTooComplex(_) => Code::ModuleTooComplex,
        WasmError::CompileBusy => Code::CompileBusy,
        WasmError::CompileTimeout(_) => Code::CompileTimeout,
        WasmError::InputTooLarge => Code::InputTooLarge,
        WasmError::OutputTooLarge => Code::OutputTooLarge,
        WasmError::Timeout => Code::FunctionTimeout,
        WasmError::Trapped(_) => Code::FunctionTrapped,
        WasmError::MemoryLimit => Code::FunctionMemoryLimit,
        WasmError::Busy => Code::FunctionBusy,
        WasmError::Overloaded => Code::Overloaded,
        WasmError::DepthExceeded => Code::DepthExceeded,
        WasmError::Internal(_) => Code::Internal,
    }
}
