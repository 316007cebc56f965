//! The one place errors become HTTP answers (docs/design.md §9): every error body is
//! `{"ok":false,"error":{"code","message","retryable"}}` with a stable code.

use crate::actors::{AskError, LocateError, NsError};
use crate::error::Code;
use crate::storage::StoreError;
use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderValue};
use actix_web::{HttpResponse, ResponseError};

/// Marks a 502/503/504 the node itself produced (docs/design.md §6 breakers).
pub const GATEWAY_FAULT: &str = "x-meshgate-fault";

pub use crate::error::{ApiError, ApiResult};

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }
    fn error_response(&self) -> HttpResponse {
        let mut r = HttpResponse::build(self.status);
        if let Some(s) = self.retry_after {
            r.insert_header((header::RETRY_AFTER, HeaderValue::from(s)));
        }
        r.insert_header((header::CACHE_CONTROL, HeaderValue::from_static("no-store")));
        // A failure of this node itself (not a function's own answer): a node
        // forwarding here counts it against this member's breaker.
        if self.is_gateway_fault() {
            r.insert_header((GATEWAY_FAULT, HeaderValue::from_static("gateway")));
        }
        r.json(self.body())
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(_) => {
                ApiError::new(Code::StoreUnavailable, e.to_string()).retry_after(1)
            }
            _ => ApiError::internal(e.to_string()),
        }
    }
}

impl From<NsError> for ApiError {
    fn from(e: NsError) -> Self {
        match e {
            NsError::NotFound => ApiError::new(Code::NamespaceNotFound, "namespace not found"),
            NsError::BadInput(m) => ApiError::new(Code::BadRequest, m),
            NsError::Store(s) => s.into(),
            NsError::Panicked => ApiError::internal(e.to_string()),
            NsError::Refused(a) => a,
        }
    }
}

impl From<AskError> for ApiError {
    fn from(e: AskError) -> Self {
        match e {
            AskError::Overloaded => {
                ApiError::overloaded("the namespace is overloaded; retry later")
            }
            AskError::Gone => ApiError::new(Code::Restarting, e.to_string()).retry_after(1),
            AskError::Timeout => ApiError::new(Code::Timeout, e.to_string()),
        }
    }
}

impl From<LocateError> for ApiError {
    fn from(e: LocateError) -> Self {
        match e {
            LocateError::Ns(e) => e.into(),
            LocateError::Ask(e) => e.into(),
        }
    }
}

/// Turns actix's own extractor errors (bad JSON, oversized bodies...) into the envelope.
pub fn json_config(limit: usize) -> actix_web::web::JsonConfig {
    actix_web::web::JsonConfig::default()
        .limit(limit)
        .error_handler(|err, _| {
            use actix_web::error::JsonPayloadError as J;
            let api = match &err {
                J::OverflowKnownLength { .. } | J::Overflow { .. } => {
                    ApiError::too_large(err.to_string())
                }
                J::ContentType => ApiError::new(
                    Code::UnsupportedMediaType,
                    "expected Content-Type: application/json",
                ),
                J::Deserialize(e) => ApiError::new(Code::MalformedJson, e.to_string()),
                _ => ApiError::new(Code::MalformedBody, err.to_string()),
            };
            api.into()
        })
}

/// The same for raw bodies (`web::Bytes`).
pub fn payload_config(limit: usize) -> actix_web::web::PayloadConfig {
    actix_web::web::PayloadConfig::new(limit)
}

/// The same for query strings.
pub fn query_config() -> actix_web::web::QueryConfig {
    actix_web::web::QueryConfig::default()
        .error_handler(|err, _| ApiError::new(Code::BadQuery, err.to_string()).into())
}

/// The same for path parameters.
pub fn path_config() -> actix_web::web::PathConfig {
    actix_web::web::PathConfig::default()
        .error_handler(|err, _| ApiError::new(Code::BadPath, err.to_string()).into())
}

impl From<crate::auth::AuthError> for ApiError {
    fn from(e: crate::auth::AuthError) -> Self {
        // The node's own faults (key file, randomness) are INTERNAL.
        ApiError::new(e.code(), e.to_string())
    }
}

impl From<crate::identity::IdentityError> for ApiError {
    fn from(e: crate::identity::IdentityError) -> Self {
        use crate::identity::IdentityError as I;
        match e {
            I::Auth(a) => a.into(),
            I::Store(s) => s.into(),
            I::BadInput(m) => ApiError::new(Code::BadRequest, m),
            I::NotFound => ApiError::new(Code::NotFound, "no such key"),
            I::TooManyChallenges => ApiError::rate_limited(Code::TooManyChallenges, 60),
            I::KeyRevoked => ApiError::new(Code::ApiKeyRevoked, e.to_string()),
            I::KeyExpired => ApiError::new(Code::ApiKeyExpired, e.to_string()),
        }
    }
}

impl From<crate::wasm::WasmError> for ApiError {
    fn from(e: crate::wasm::WasmError) -> Self {
        use crate::wasm::WasmError as W;
        let api = ApiError::new(crate::functions::wasm_error_code(&e), e.to_string());
        match e {
            W::Busy | W::Overloaded | W::CompileBusy | W::CompileTimeout(_) => api.retry_after(1),
            _ => api,
        }
    }
}

impl From<crate::functions::FnError> for ApiError {
    fn from(e: crate::functions::FnError) -> Self {
        use crate::functions::FnError as F;
        match e {
            F::NotFound(m) => ApiError::new(Code::FunctionNotFound, m),
            F::BadInput { code, message } => ApiError::new(code, message),
            F::NamespaceGone => ApiError::new(Code::NamespaceNotFound, "namespace not found"),
            F::Wasm(w) => w.into(),
            F::Store(s) => s.into(),
            F::Internal(m) => ApiError::internal(m),
            F::Refused(a) => a,
        }
    }
}
