//! The one place errors become HTTP answers (docs/design.md §9): every error body is
//! `{"ok":false,"error":{"code","message","retryable"}}` with a stable code.

use crate::actors::{AskError, LocateError, NsError};
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
        if matches!(self.status.as_u16(), 502..=504) && !self.code.starts_with("FUNCTION_") {
            r.insert_header((GATEWAY_FAULT, HeaderValue::from_static("gateway")));
        }
        r.json(self.body())
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "STORE_UNAVAILABLE",
                e.to_string(),
            )
            .retry_after(1),
            _ => ApiError::internal(e.to_string()),
        }
    }
}

impl From<NsError> for ApiError {
    fn from(e: NsError) -> Self {
        match e {
            NsError::NotFound => ApiError::not_found("NAMESPACE_NOT_FOUND", "namespace not found"),
            NsError::BadInput(m) => ApiError::bad_request("BAD_REQUEST", m),
            NsError::Store(s) => s.into(),
            NsError::Panicked => ApiError::internal(e.to_string()),
        }
    }
}

impl From<AskError> for ApiError {
    fn from(e: AskError) -> Self {
        match e {
            AskError::Overloaded => {
                ApiError::overloaded("the namespace is overloaded; retry later")
            }
            AskError::Gone => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "RESTARTING", e.to_string())
                    .retry_after(1)
            }
            AskError::Timeout => {
                ApiError::new(StatusCode::GATEWAY_TIMEOUT, "TIMEOUT", e.to_string())
            }
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
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UNSUPPORTED_MEDIA_TYPE",
                    "expected Content-Type: application/json",
                ),
                J::Deserialize(e) => ApiError::bad_request("MALFORMED_JSON", e.to_string()),
                _ => ApiError::bad_request("MALFORMED_BODY", err.to_string()),
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
        .error_handler(|err, _| ApiError::bad_request("BAD_QUERY", err.to_string()).into())
}

/// The same for path parameters.
pub fn path_config() -> actix_web::web::PathConfig {
    actix_web::web::PathConfig::default()
        .error_handler(|err, _| ApiError::bad_request("BAD_PATH", err.to_string()).into())
}

impl From<crate::auth::AuthError> for ApiError {
    fn from(e: crate::auth::AuthError) -> Self {
        if e.is_node_fault() {
            return ApiError::internal(e.to_string());
        }
        let status = if e.is_bad_input() {
            StatusCode::BAD_REQUEST
        } else {
            StatusCode::UNAUTHORIZED
        };
        ApiError::new(status, e.code(), e.to_string())
    }
}

impl From<crate::identity::IdentityError> for ApiError {
    fn from(e: crate::identity::IdentityError) -> Self {
        use crate::identity::IdentityError as I;
        match e {
            I::Auth(a) => a.into(),
            I::Store(s) => s.into(),
            I::BadInput(m) => ApiError::bad_request("BAD_REQUEST", m),
            I::NotFound => ApiError::not_found("NOT_FOUND", "no such key"),
            I::TooManyChallenges => ApiError::rate_limited("TOO_MANY_CHALLENGES", 60),
            I::KeyRevoked => ApiError::unauthorized("API_KEY_REVOKED", e.to_string()),
            I::KeyExpired => ApiError::unauthorized("API_KEY_EXPIRED", e.to_string()),
        }
    }
}

impl From<crate::wasm::WasmError> for ApiError {
    fn from(e: crate::wasm::WasmError) -> Self {
        use crate::wasm::WasmError as W;
        let code = crate::functions::wasm_error_code(&e);
        let status = match &e {
            W::InvalidModule(_) | W::UnknownImport(_) => StatusCode::BAD_REQUEST,
            W::ModuleTooLarge { .. } | W::InputTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            W::Timeout => StatusCode::GATEWAY_TIMEOUT,
            W::Busy => StatusCode::TOO_MANY_REQUESTS,
            W::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            W::OutputTooLarge
            | W::Trapped(_)
            | W::MemoryLimit
            | W::DepthExceeded
            | W::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let api = ApiError::new(status, code, e.to_string());
        match e {
            W::Busy | W::Overloaded => api.retry_after(1),
            _ => api,
        }
    }
}

impl From<crate::functions::FnError> for ApiError {
    fn from(e: crate::functions::FnError) -> Self {
        use crate::functions::FnError as F;
        match e {
            F::NotFound(m) => ApiError::not_found("FUNCTION_NOT_FOUND", m),
            F::BadInput { code, message } => ApiError::bad_request(code, message),
            F::Denied(m) => ApiError::forbidden("FUNCTION_NOT_PUBLIC", m),
            F::NamespaceGone => ApiError::not_found("NAMESPACE_NOT_FOUND", "namespace not found"),
            F::Wasm(w) => w.into(),
            F::Store(s) => s.into(),
            F::Internal(m) => ApiError::internal(m),
        }
    }
}
