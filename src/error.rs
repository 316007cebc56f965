//! The error every layer returns toward a client, in the style of pingora's
//! error type: a [`Code`] from one table that gives each code its HTTP
//! status, its [`Fault`] kind and whether retrying may help; a message; and
//! the cause, kept for the logs. Domain code builds it; `http/error.rs` alone
//! turns it into the JSON envelope `{"ok":false,"error":{"code","message",
//! "retryable"}}` (docs/design.md §9), with `Retry-After` and the
//! gateway-fault header, and maps the lower layers' own error types onto it.
//! Imports nothing of the crate.

#![forbid(unsafe_code)]

use serde_json::json;
use std::fmt;
use std::sync::Arc;

pub use actix_web::http::StatusCode;

/// Who is at fault for an error, for logs and for the gateway-fault header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The request itself: retrying it unchanged does not help (429 aside).
    Client,
    /// The function's own code (a trap, its memory, its output, its time).
    Guest,
    /// A deployment's upstream, or a function acting as one.
    Upstream,
    /// This node or the cluster (a store, a timeout, overload).
    Node,
}

/// Declares [`Code`] and its one table: for each code its wire name, HTTP
/// status, fault kind and whether retrying the same request may help.
macro_rules! codes {
    ($($(#[$doc:meta])* $name:ident = $wire:literal, $status:literal, $fault:ident, $retry:literal;)*) => {
        /// Every stable error code a client can receive.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Code {
            $($(#[$doc])* $name,)*
        }

        impl Code {
            /// Every code, in table order.
            pub const ALL: &'static [Code] = &[$(Code::$name,)*];

            /// The code as sent in the envelope (`"NAMESPACE_NOT_FOUND"`).
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Code::$name => $wire,)*
                }
            }

            /// The HTTP status this code is answered with.
            pub fn status(self) -> StatusCode {
                let s = match self {
                    $(Code::$name => $status,)*
                };
                StatusCode::from_u16(s).expect("a valid status in the table")
            }

            /// Who is at fault.
            pub fn fault(self) -> Fault {
                match self {
                    $(Code::$name => Fault::$fault,)*
                }
            }

            /// Whether the same request may succeed later.
            pub fn retryable(self) -> bool {
                match self {
                    $(Code::$name => $retry,)*
                }
            }
        }
    };
}

codes! {
    // 400: the request is malformed or names something it may not.
    BadRequest = "BAD_REQUEST", 400, Client, false;
    BadBase64 = "BAD_BASE64", 400, Client, false;
    BadBatch = "BAD_BATCH", 400, Client, false;
    BadBody = "BAD_BODY", 400, Client, false;
    BadFormat = "BAD_FORMAT", 400, Client, false;
    BadMember = "BAD_MEMBER", 400, Client, false;
    BadPath = "BAD_PATH", 400, Client, false;
    AmbiguousPath = "AMBIGUOUS_PATH", 400, Client, false;
    BadQuery = "BAD_QUERY", 400, Client, false;
    BadTopic = "BAD_TOPIC", 400, Client, false;
    BadOffset = "BAD_OFFSET", 400, Client, false;
    InvalidHistory = "INVALID_HISTORY", 400, Client, false;
    BadUpgrade = "BAD_UPGRADE", 400, Client, false;
    HostReserved = "HOST_RESERVED", 400, Client, false;
    InvalidCron = "INVALID_CRON", 400, Client, false;
    /// A `device_id` that is not 1 to 64 of `A-Z a-z 0-9 . _ : -`.
    InvalidDeviceId = "INVALID_DEVICE_ID", 400, Client, false;
    /// A listing's `cursor` that does not decode, or was made for another listing or namespace.
    InvalidCursor = "INVALID_CURSOR", 400, Client, false;
    InvalidExport = "INVALID_EXPORT", 400, Client, false;
    ImportSizeMismatch = "IMPORT_SIZE_MISMATCH", 400, Client, false;
    InvalidField = "INVALID_FIELD", 400, Client, false;
    InvalidGrant = "INVALID_GRANT", 400, Client, false;
    InvalidHost = "INVALID_HOST", 400, Client, false;
    /// A deployment certificate upload that is not a PEM chain and key.
    InvalidCertificate = "INVALID_CERTIFICATE", 400, Client, false;
    CertificateExpired = "CERTIFICATE_EXPIRED", 400, Client, false;
    CertificateNotYetValid = "CERTIFICATE_NOT_YET_VALID", 400, Client, false;
    CertificateHostMismatch = "CERTIFICATE_HOST_MISMATCH", 400, Client, false;
    CertificateKeyMismatch = "CERTIFICATE_KEY_MISMATCH", 400, Client, false;
    /// A deployment asks for `tls: "auto"` on a node without `[tls.acme]`.
    AcmeNotConfigured = "ACME_NOT_CONFIGURED", 400, Client, false;
    InvalidJson = "INVALID_JSON", 400, Client, false;
    InvalidLimit = "INVALID_LIMIT", 400, Client, false;
    InvalidMember = "INVALID_MEMBER", 400, Client, false;
    InvalidMetadata = "INVALID_METADATA", 400, Client, false;
    InvalidModule = "INVALID_MODULE", 400, Client, false;
    /// A module over a `[functions]` count limit, refused before compiling.
    ModuleTooComplex = "MODULE_TOO_COMPLEX", 400, Client, false;
    /// A gRPC request's `grpc-timeout` is not 1 to 8 digits and a unit
    /// (answered as gRPC status INTERNAL on the gRPC listener).
    InvalidGrpcTimeout = "INVALID_GRPC_TIMEOUT", 400, Client, false;
    InvalidName = "INVALID_NAME", 400, Client, false;
    InvalidNamespaceName = "INVALID_NAMESPACE_NAME", 400, Client, false;
    /// A deployment route's `policy` (or the deployment's default) is wrong.
    InvalidPolicy = "INVALID_POLICY", 400, Client, false;
    InvalidRoute = "INVALID_ROUTE", 400, Client, false;
    InvalidSecret = "INVALID_SECRET", 400, Client, false;
    InvalidTarball = "INVALID_TARBALL", 400, Client, false;
    InvalidUpstream = "INVALID_UPSTREAM", 400, Client, false;
    InvalidWallet = "INVALID_WALLET", 400, Client, false;
    /// A mixed-case EVM address that is not its EIP-55 checksum.
    AddressChecksumMismatch = "ADDRESS_CHECKSUM_MISMATCH", 400, Client, false;
    BadRecoveryId = "BAD_RECOVERY_ID", 400, Client, false;
    SignatureHighS = "SIGNATURE_HIGH_S", 400, Client, false;
    InvalidWalletSignIn = "INVALID_WALLET_SIGN_IN", 400, Client, false;
    KeyTooLong = "KEY_TOO_LONG", 400, Client, false;
    MalformedBody = "MALFORMED_BODY", 400, Client, false;
    MalformedChallenge = "MALFORMED_CHALLENGE", 400, Client, false;
    MalformedJson = "MALFORMED_JSON", 400, Client, false;
    MalformedMultipart = "MALFORMED_MULTIPART", 400, Client, false;
    MalformedSignature = "MALFORMED_SIGNATURE", 400, Client, false;
    MissingPart = "MISSING_PART", 400, Client, false;
    NamespaceRequired = "NAMESPACE_REQUIRED", 400, Client, false;
    NotAWebsocket = "NOT_A_WEBSOCKET", 400, Client, false;
    TooManyRoutes = "TOO_MANY_ROUTES", 400, Client, false;
    UnknownImport = "UNKNOWN_IMPORT", 400, Client, false;
    BadVersion = "BAD_VERSION", 400, Client, false;
    MissingTarget = "MISSING_TARGET", 400, Client, false;
    UnknownPart = "UNKNOWN_PART", 400, Client, false;
    UnknownRole = "UNKNOWN_ROLE", 400, Client, false;
    UnsafeTarball = "UNSAFE_TARBALL", 400, Client, false;
    UnsupportedExportFormat = "UNSUPPORTED_EXPORT_FORMAT", 400, Client, false;
    UnsupportedExportVersion = "UNSUPPORTED_EXPORT_VERSION", 400, Client, false;
    /// At create time; at connect time the proxy answers it with 502.
    UpstreamForbidden = "UPSTREAM_FORBIDDEN", 400, Client, false;
    UpstreamUnresolvable = "UPSTREAM_UNRESOLVABLE", 400, Client, false;
    // 401: no credential, or one that does not hold.
    MissingCredential = "MISSING_CREDENTIAL", 401, Client, false;
    ApiKeyExpired = "API_KEY_EXPIRED", 401, Client, false;
    ApiKeyRevoked = "API_KEY_REVOKED", 401, Client, false;
    BadChecksum = "BAD_CHECKSUM", 401, Client, false;
    BadHopMac = "BAD_HOP_MAC", 401, Client, false;
    BadSignature = "BAD_SIGNATURE", 401, Client, false;
    BadWalletSignature = "BAD_WALLET_SIGNATURE", 401, Client, false;
    ChallengeExpired = "CHALLENGE_EXPIRED", 401, Client, false;
    HopBodyMismatch = "HOP_BODY_MISMATCH", 401, Client, false;
    HopMacExpired = "HOP_MAC_EXPIRED", 401, Client, false;
    InvalidApiKey = "INVALID_API_KEY", 401, Client, false;
    InvalidOperatorKey = "INVALID_OPERATOR_KEY", 401, Client, false;
    InvalidRefreshToken = "INVALID_REFRESH_TOKEN", 401, Client, false;
    MalformedApiKey = "MALFORMED_API_KEY", 401, Client, false;
    MalformedHopMac = "MALFORMED_HOP_MAC", 401, Client, false;
    MalformedToken = "MALFORMED_TOKEN", 401, Client, false;
    MissingHopMac = "MISSING_HOP_MAC", 401, Client, false;
    MissingKid = "MISSING_KID", 401, Client, false;
    NonceSpent = "NONCE_SPENT", 401, Client, false;
    SiweChainMismatch = "SIWE_CHAIN_MISMATCH", 401, Client, false;
    SiweDomainMismatch = "SIWE_DOMAIN_MISMATCH", 401, Client, false;
    SiweMessageAltered = "SIWE_MESSAGE_ALTERED", 401, Client, false;
    UnknownChallenge = "UNKNOWN_CHALLENGE", 401, Client, false;
    RefreshTokenExpired = "REFRESH_TOKEN_EXPIRED", 401, Client, false;
    RefreshTokenReused = "REFRESH_TOKEN_REUSED", 401, Client, false;
    RefreshTokenRevoked = "REFRESH_TOKEN_REVOKED", 401, Client, false;
    /// The token's session was ended (`DELETE /v1/auth/sessions`).
    SessionRevoked = "SESSION_REVOKED", 401, Client, false;
    TokenBadEncoding = "TOKEN_BAD_ENCODING", 401, Client, false;
    TokenBadJson = "TOKEN_BAD_JSON", 401, Client, false;
    TokenExpired = "TOKEN_EXPIRED", 401, Client, false;
    TokenIssuedInFuture = "TOKEN_ISSUED_IN_FUTURE", 401, Client, false;
    TokenNotYetValid = "TOKEN_NOT_YET_VALID", 401, Client, false;
    UnknownKid = "UNKNOWN_KID", 401, Client, false;
    UnsupportedAlg = "UNSUPPORTED_ALG", 401, Client, false;
    WrongAudience = "WRONG_AUDIENCE", 401, Client, false;
    WrongIssuer = "WRONG_ISSUER", 401, Client, false;
    // 403: a credential that may not do this.
    CorsOriginDenied = "CORS_ORIGIN_DENIED", 403, Client, false;
    /// A state-changing dashboard request from another origin than the node's own.
    CrossOrigin = "CROSS_ORIGIN", 403, Client, false;
    FunctionNotPublic = "FUNCTION_NOT_PUBLIC", 403, Client, false;
    GrantEscalation = "GRANT_ESCALATION", 403, Client, false;
    InternalOnly = "INTERNAL_ONLY", 403, Client, false;
    MissingGrant = "MISSING_GRANT", 403, Client, false;
    NamespaceMismatch = "NAMESPACE_MISMATCH", 403, Client, false;
    OperatorOnly = "OPERATOR_ONLY", 403, Client, false;
    ReservedTopic = "RESERVED_TOPIC", 403, Client, false;
    /// The namespace never enabled wallet sign-in, or disabled it.
    WalletSignInDisabled = "WALLET_SIGN_IN_DISABLED", 403, Client, false;
    WalletNotAllowed = "WALLET_NOT_ALLOWED", 403, Client, false;
    /// An export's secrets are sealed to another namespace than the import's.
    SecretsBoundElsewhere = "SECRETS_BOUND_ELSEWHERE", 403, Client, false;
    // 404, 405, 409, 413, 415: the target.
    NotFound = "NOT_FOUND", 404, Client, false;
    NodeNotFound = "NODE_NOT_FOUND", 404, Client, false;
    DeploymentNotFound = "DEPLOYMENT_NOT_FOUND", 404, Client, false;
    CertificateNotFound = "CERTIFICATE_NOT_FOUND", 404, Client, false;
    FileNotFound = "FILE_NOT_FOUND", 404, Client, false;
    FunctionNotFound = "FUNCTION_NOT_FOUND", 404, Client, false;
    KeyNotFound = "KEY_NOT_FOUND", 404, Client, false;
    NamespaceNotFound = "NAMESPACE_NOT_FOUND", 404, Client, false;
    NoRoute = "NO_ROUTE", 404, Client, false;
    /// No session of the caller's subject has this id (another subject's answers the same).
    SessionNotFound = "SESSION_NOT_FOUND", 404, Client, false;
    VersionNotFound = "VERSION_NOT_FOUND", 404, Client, false;
    MethodNotAllowed = "METHOD_NOT_ALLOWED", 405, Client, false;
    /// The Host header names another site than the TLS server name.
    MisdirectedRequest = "MISDIRECTED_REQUEST", 421, Client, false;
    HostTaken = "HOST_TAKEN", 409, Client, false;
    NamespaceExists = "NAMESPACE_EXISTS", 409, Client, false;
    LastNode = "LAST_NODE", 409, Client, false;
    NoEarlierVersion = "NO_EARLIER_VERSION", 409, Client, false;
    SecretsSealedElsewhere = "SECRETS_SEALED_ELSEWHERE", 409, Client, false;
    PayloadTooLarge = "PAYLOAD_TOO_LARGE", 413, Client, false;
    ImportTooLarge = "IMPORT_TOO_LARGE", 413, Client, false;
    /// The namespace's export would be larger than an import takes.
    ExportTooLarge = "EXPORT_TOO_LARGE", 413, Client, false;
    InputTooLarge = "INPUT_TOO_LARGE", 413, Client, false;
    ModuleTooLarge = "MODULE_TOO_LARGE", 413, Client, false;
    SiteTooLarge = "SITE_TOO_LARGE", 413, Client, false;
    UnsupportedMediaType = "UNSUPPORTED_MEDIA_TYPE", 415, Client, false;
    // 429: too much, for now.
    RateLimited = "RATE_LIMITED", 429, Client, true;
    NamespaceRateLimited = "NAMESPACE_RATE_LIMITED", 429, Client, true;
    /// Anonymous traffic to a namespace (its hosts, requests without a credential) past its own bucket.
    AnonymousRateLimited = "ANONYMOUS_RATE_LIMITED", 429, Client, true;
    /// A deployment route's own `rate_limit` (per client or per subject).
    RouteRateLimited = "ROUTE_RATE_LIMITED", 429, Client, true;
    WalletRateLimited = "WALLET_RATE_LIMITED", 429, Client, true;
    TooManyChallenges = "TOO_MANY_CHALLENGES", 429, Client, true;
    FunctionBusy = "FUNCTION_BUSY", 429, Node, true;
    /// A namespace quota would be passed (413 instead for the byte quotas);
    /// the message names the quota and what frees it. Not retryable (the
    /// one 429 that is not): the same request passes only once the
    /// namespace deleted something or the operator raised the quota.
    QuotaExceeded = "QUOTA_EXCEEDED", 429, Client, false;
    /// The namespace's previous compile is still waiting or running.
    CompileBusy = "COMPILE_BUSY", 429, Client, true;
    /// The namespace's previous export is still being built or sent.
    ExportBusy = "EXPORT_BUSY", 429, Client, true;
    // 500: something broke.
    Internal = "INTERNAL", 500, Node, true;
    FunctionTrapped = "FUNCTION_TRAPPED", 500, Guest, false;
    FunctionMemoryLimit = "FUNCTION_MEMORY_LIMIT", 500, Guest, false;
    OutputTooLarge = "OUTPUT_TOO_LARGE", 500, Guest, false;
    DepthExceeded = "DEPTH_EXCEEDED", 500, Guest, false;
    // 502, 503, 504: an upstream, a member, or this node cannot answer now.
    UpstreamFailed = "UPSTREAM_FAILED", 502, Upstream, true;
    UpstreamUnavailable = "UPSTREAM_UNAVAILABLE", 502, Upstream, true;
    /// The namespace's claims-provider function did not answer usable claims.
    ClaimsProviderFailed = "CLAIMS_PROVIDER_FAILED", 502, Upstream, true;
    /// A member a request was forwarded to failed (504 when it timed out).
    MemberFailed = "MEMBER_FAILED", 502, Node, true;
    /// Every instance of an upstream is out of rotation (passive health or
    /// its active check); no panic threshold (docs/deployments.md "Health checks").
    NoHealthyUpstream = "NO_HEALTHY_UPSTREAM", 503, Upstream, true;
    Overloaded = "OVERLOADED", 503, Node, true;
    StoreUnavailable = "STORE_UNAVAILABLE", 503, Node, true;
    Restarting = "RESTARTING", 503, Node, true;
    Starting = "STARTING", 503, Node, true;
    Draining = "DRAINING", 503, Node, true;
    DeployBusy = "DEPLOY_BUSY", 503, Node, true;
    /// Every site-unpack slot of the node stayed taken for `unpack_wait_ms`.
    UnpackBusy = "UNPACK_BUSY", 503, Node, true;
    /// A compile did not end (or start) before `compile_timeout_ms`.
    CompileTimeout = "COMPILE_TIMEOUT", 503, Node, true;
    NoClusterSecret = "NO_CLUSTER_SECRET", 503, Node, true;
    NoMemberAvailable = "NO_MEMBER_AVAILABLE", 503, Node, true;
    Timeout = "TIMEOUT", 504, Node, true;
    UpstreamTimeout = "UPSTREAM_TIMEOUT", 504, Upstream, true;
    FunctionTimeout = "FUNCTION_TIMEOUT", 504, Guest, true;
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Lets a test compare a code with its wire name: `assert_eq!(e.code, "NOT_FOUND")`.
impl PartialEq<&str> for Code {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// An error answer: its code, the status it is sent with, a message for
/// the client, an optional `Retry-After`, and the cause for the logs.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// The stable code; its row of the table decides the rest.
    pub code: Code,
    /// The code's status, except where a path documents another
    /// ([`ApiError::with_status`]).
    pub status: StatusCode,
    /// For the client: what went wrong and, where it helps, what to do.
    pub message: String,
    /// Seconds for the `Retry-After` header (overload, rate limits).
    pub retry_after: Option<u64>,
    /// What caused it, for the logs (never sent to the client).
    pub source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

pub type ApiResult<T> = Result<T, ApiError>;

/// The longest message an error carries; past it the message is cut (a
/// parser's message can quote a client's input whole).
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// `m` cut to [`MAX_MESSAGE_BYTES`] on a character boundary.
fn bounded(mut m: String) -> String {
    if m.len() > MAX_MESSAGE_BYTES {
        let mut end = MAX_MESSAGE_BYTES;
        while !m.is_char_boundary(end) {
            end -= 1;
        }
        m.truncate(end);
        m.push('…');
    }
    m
}

impl ApiError {
    /// An error with `code`'s status.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            status: code.status(),
            message: bounded(message.into()),
            retry_after: None,
            source: None,
        }
    }
    /// An error sent with another status than its code's. Used where the
    /// same condition is answered differently on two paths: an upstream the
    /// egress policy forbids is 400 at create and 502 when the proxy would
    /// connect; a forwarded request's member that timed out is 504.
    pub fn with_status(status: StatusCode, code: Code, message: impl Into<String>) -> Self {
        Self {
            status,
            ..Self::new(code, message)
        }
    }
    /// `PAYLOAD_TOO_LARGE`.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(Code::PayloadTooLarge, message)
    }
    /// `OVERLOADED`, retry after a second.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(Code::Overloaded, message).retry_after(1)
    }
    /// `INTERNAL`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }
    /// A rate limit's refusal, retry after `retry_after` seconds.
    pub fn rate_limited(code: Code, retry_after: u64) -> Self {
        Self::new(code, "rate limit exceeded; retry later").retry_after(retry_after)
    }
    /// Sets `Retry-After` (at least 1 s).
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds.max(1));
        self
    }
    /// Keeps `cause` for the logs.
    pub fn caused_by(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(cause));
        self
    }
    /// Whether the same request may succeed later (the code's row).
    pub fn retryable(&self) -> bool {
        self.code.retryable()
    }
    /// Who is at fault (the code's row).
    pub fn fault(&self) -> Fault {
        self.code.fault()
    }
    /// Whether this is a 502/503/504 of the node itself rather than of a
    /// function's own run: a node that forwarded here counts it against
    /// this member's breaker.
    pub fn is_gateway_fault(&self) -> bool {
        matches!(self.status.as_u16(), 502..=504) && self.fault() != Fault::Guest
    }
    /// The JSON envelope.
    pub fn body(&self) -> serde_json::Value {
        json!({"ok": false, "error": {"code": self.code.as_str(), "message": self.message, "retryable": self.retryable()}})
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
        )?;
        if let Some(s) = &self.source {
            write!(f, " (cause: {s})")?;
        }
        Ok(())
    }
}

impl std::error::Error for ApiError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code has its own wire name (no two codes share one, so a
    /// client can tell them apart), upper snake case (digits allowed).
    #[test]
    fn wire_names_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for &c in Code::ALL {
            let w = c.as_str();
            assert!(seen.insert(w), "{w} twice");
            assert!(
                w.chars()
                    .all(|ch| ch.is_ascii_uppercase() || ch.is_ascii_digit() || ch == '_'),
                "{w}"
            );
        }
    }

    /// The table's columns agree: 4xx are the client's (retryable only when
    /// rate limited: a 429 but a quota's), 5xx never the client's; a guest's
    /// failure never marks the gateway.
    #[test]
    fn the_table_is_consistent() {
        for &c in Code::ALL {
            let s = c.status();
            assert!(s.is_client_error() || s.is_server_error(), "{c}");
            if s.is_server_error() {
                assert_ne!(c.fault(), Fault::Client, "{c}");
            }
            if s.is_client_error() && s != StatusCode::TOO_MANY_REQUESTS {
                assert!(!c.retryable(), "{c} is a 4xx and retryable");
            }
            if s == StatusCode::TOO_MANY_REQUESTS {
                // A quota frees only when the namespace holds less.
                assert_eq!(c.retryable(), c != Code::QuotaExceeded, "{c}");
            }
        }
        assert!(!ApiError::new(Code::FunctionTimeout, "x").is_gateway_fault());
        assert!(ApiError::new(Code::UpstreamTimeout, "x").is_gateway_fault());
        assert!(ApiError::new(Code::Overloaded, "x").is_gateway_fault());
        assert!(!ApiError::new(Code::Internal, "x").is_gateway_fault());
    }

    /// The envelope carries the wire name and the row's retryable.
    #[test]
    fn envelope() {
        let e = ApiError::new(Code::StoreUnavailable, "down").retry_after(1);
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            e.body(),
            json!({"ok": false, "error": {"code": "STORE_UNAVAILABLE", "message": "down", "retryable": true}})
        );
        let e = ApiError::with_status(StatusCode::BAD_GATEWAY, Code::UpstreamForbidden, "no");
        assert_eq!((e.status.as_u16(), e.code), (502, Code::UpstreamForbidden));
        assert!(!e.retryable());
    }
}
