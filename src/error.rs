//! The error every layer returns toward a client: a stable code, its HTTP
//! status, a message and whether retrying may help. Domain code builds it;
//! `http/error.rs` alone turns it into the JSON envelope
//! `{"ok":false,"error":{"code","message","retryable"}}` (docs/design.md §9)
//! and maps the lower layers' own error types onto it.
//! Imports nothing of the crate.

use serde_json::json;
use std::fmt;

pub use actix_web::http::StatusCode;

/// Who is at fault for an error, for logs and for the gateway-fault header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The request itself (4xx): retrying it unchanged does not help.
    Client,
    /// The function's own code (a trap, its memory, its output).
    Guest,
    /// A deployment's upstream.
    Upstream,
    /// This node or the cluster (a store, a timeout, overload).
    Node,
}

/// An error answer: status, stable code, message, and whether retrying may help.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub retry_after: Option<u64>,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }
    pub fn unauthorized(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, code, message)
    }
    pub fn forbidden(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, code, message)
    }
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }
    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, code, message)
    }
    pub fn payload_too_large(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, code, message)
    }
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "PAYLOAD_TOO_LARGE", message)
    }
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "OVERLOADED", message).retry_after(1)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL", message)
    }
    pub fn rate_limited(code: &'static str, retry_after: u64) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            code,
            "rate limit exceeded; retry later",
        )
        .retry_after(retry_after)
    }
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds.max(1));
        self
    }
    /// Whether the same request may succeed later (server-side or rate-limit trouble).
    pub fn retryable(&self) -> bool {
        self.status == StatusCode::TOO_MANY_REQUESTS
            || self.status.is_server_error()
                && !matches!(
                    self.code,
                    "FUNCTION_TRAPPED"
                        | "FUNCTION_MEMORY_LIMIT"
                        | "OUTPUT_TOO_LARGE"
                        | "DEPTH_EXCEEDED"
                )
    }
    /// The JSON envelope.
    pub fn body(&self) -> serde_json::Value {
        json!({"ok": false, "error": {"code": self.code, "message": self.message, "retryable": self.retryable()}})
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

impl ApiError {
    /// The fault kind of this error (see [`Fault`]).
    pub fn fault(&self) -> Fault {
        if self.code.starts_with("FUNCTION_")
            || matches!(self.code, "OUTPUT_TOO_LARGE" | "DEPTH_EXCEEDED")
        {
            Fault::Guest
        } else if self.code.starts_with("UPSTREAM_") {
            Fault::Upstream
        } else if self.status.is_server_error() || self.status == StatusCode::TOO_MANY_REQUESTS {
            Fault::Node
        } else {
            Fault::Client
        }
    }
}
