//! The one error type of the auth module: every rejection has its own
//! variant and a stable upper-case code that the HTTP layer puts in the
//! error body.

use crate::error::Code;
use std::fmt;

/// Result alias for the auth module.
pub type Result<T, E = AuthError> = std::result::Result<T, E>;

/// Which of the three dot-separated parts of a JWT was at fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenPart {
    /// The JOSE header.
    Header,
    /// The claims.
    Payload,
    /// The signature.
    Signature,
}

impl fmt::Display for TokenPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TokenPart::Header => "header",
            TokenPart::Payload => "payload",
            TokenPart::Signature => "signature",
        })
    }
}

/// Every way a credential, token, grant, MAC or challenge can be refused.
#[derive(thiserror::Error, Debug)]
pub enum AuthError {
    // --- API keys -------------------------------------------------------
    /// The string does not have the `mg_<sk|rk>_<body>_<crc>` shape.
    #[error("malformed API key: {0}")]
    MalformedKey(&'static str),
    /// The shape is right but the CRC32 does not match (a typo).
    #[error("API key checksum mismatch")]
    BadChecksum,
    /// Well-formed key that the node does not know, revoked or expired.
    /// Produced by the node's lookup, never by this module.
    #[error("invalid API key")]
    InvalidApiKey,

    // --- JWT ------------------------------------------------------------
    /// Not three dot-separated parts, or too long.
    #[error("malformed token: {0}")]
    MalformedToken(&'static str),
    /// A part is not unpadded base64url.
    #[error("token {0} is not base64url")]
    TokenEncoding(TokenPart),
    /// The header or payload is not the expected JSON.
    #[error("token {part} is not valid JSON: {reason}")]
    TokenJson {
        /// The part at fault.
        part: TokenPart,
        /// What serde said.
        reason: String,
    },
    /// `alg` is anything but `EdDSA` (`none`, `HS256`, ...).
    #[error("unsupported token algorithm {0:?}")]
    UnsupportedAlg(String),
    /// The header has no `kid`.
    #[error("token has no kid")]
    MissingKid,
    /// The `kid` names no key this node verifies with.
    #[error("unknown kid {0:?}")]
    UnknownKid(String),
    /// The signature does not verify (tampered header or payload).
    #[error("bad token signature")]
    BadSignature,
    /// `exp` is more than the leeway in the past.
    #[error("token expired")]
    TokenExpired,
    /// `nbf` is more than the leeway in the future.
    #[error("token not yet valid")]
    TokenNotYetValid,
    /// `iat` is more than the leeway in the future.
    #[error("token issued in the future")]
    TokenIssuedInFuture,
    /// `iss` is not this gateway.
    #[error("wrong token issuer")]
    WrongIssuer,
    /// `aud` is not this gateway.
    #[error("wrong token audience")]
    WrongAudience,
    /// The signing key file could not be read or written.
    #[error("JWT key file {path}: {source}")]
    KeyFile {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The signing key file is not an Ed25519 PKCS#8 v2 document, or a
    /// public key is not 32 bytes.
    #[error("bad JWT key: {0}")]
    BadKey(String),
    /// The system random generator failed.
    #[error("random generator failure")]
    Random,

    // --- Grants and roles ----------------------------------------------
    /// A grant string that does not parse.
    #[error("invalid grant {grant:?}: {reason}")]
    InvalidGrant {
        /// The input (truncated to 64 characters).
        grant: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A role name that is not one of owner, admin, developer, runtime, reader.
    #[error("unknown role {0:?}")]
    UnknownRole(String),

    // --- Hop MAC --------------------------------------------------------
    /// No `X-Internal-Auth-MAC` value at all.
    #[error("missing hop MAC")]
    MissingMac,
    /// A MAC value that is not `<unix>.<64 hex>`, or identity fields that
    /// cannot be MACed (a newline in a field).
    #[error("malformed hop MAC: {0}")]
    MalformedMac(&'static str),
    /// The newest MAC's timestamp is outside the ±60 s window.
    #[error("hop MAC outside the time window")]
    MacExpired,
    /// The newest MAC does not match the request.
    #[error("bad hop MAC")]
    BadMac,

    // --- Wallet sign-in -------------------------------------------------
    /// The challenge message is not one this gateway produced.
    #[error("malformed challenge: {0}")]
    MalformedChallenge(&'static str),
    /// The challenge is past its expiry (checked by the caller with `now`).
    #[error("challenge expired")]
    ChallengeExpired,
    /// The wallet already has the maximum number of open challenges.
    #[error("too many open challenges")]
    TooManyChallenges,
    /// The nonce is unknown or already spent.
    #[error("unknown or spent nonce")]
    NonceSpent,
    /// The wallet is not 64 hex characters (a 32-byte Ed25519 key).
    #[error("invalid wallet: {0}")]
    InvalidWallet(&'static str),
    /// The signature is neither 64 bytes of hex nor of base64.
    #[error("malformed wallet signature")]
    MalformedSignature,
    /// The signature does not verify over the message with the wallet key.
    #[error("bad wallet signature")]
    BadWalletSignature,
    /// A mixed-case EVM address whose case is not its EIP-55 checksum.
    #[error(
        "the address's mixed case is not its EIP-55 checksum (send it checksummed, or all lower case)"
    )]
    AddressChecksum,
    /// An EVM signature whose `v` is not 27, 28, 0 or 1.
    #[error("the signature's v is not 27, 28, 0 or 1")]
    BadRecoveryId,
    /// An EVM signature whose `s` is in the upper half of the curve order.
    #[error("the signature's s is not in the lower half of the curve order (EIP-2)")]
    SignatureHighS,
    /// A Sign-In with Ethereum message for another domain than the node's.
    #[error("the message is for another domain than this node's")]
    SiweDomainMismatch,
    /// A Sign-In with Ethereum message for another chain than the challenge's.
    #[error("the message names another chain id than the challenge")]
    SiweChainMismatch,
    /// A Sign-In with Ethereum message whose nonce names no challenge the
    /// node issued (or one long expired).
    #[error("no such challenge: ask for one at /v1/auth/challenge")]
    UnknownChallenge,
    /// A Sign-In with Ethereum message that is not the one the node issued.
    #[error("the message is not the one the challenge issued")]
    SiweMessageAltered,
    /// The namespace has not enabled wallet sign-in (or disabled it).
    #[error("this namespace does not take wallet sign-ins")]
    WalletSignInDisabled,
    /// The namespace's wallet sign-in does not allow this wallet.
    #[error("this wallet may not sign in to this namespace")]
    WalletNotAllowed,
    /// A wallet sign-in setting that cannot be kept (role name, limits, allow).
    #[error("invalid wallet sign-in setting: {0}")]
    InvalidWalletSignIn(String),

    // --- Refresh tokens -------------------------------------------------
    /// Unknown refresh token (not `mgr_...`, or no record).
    #[error("invalid refresh token")]
    InvalidRefreshToken,
    /// The refresh token is past its 30 days.
    #[error("refresh token expired")]
    RefreshTokenExpired,
    /// The refresh token (or its family) was revoked.
    #[error("refresh token revoked")]
    RefreshTokenRevoked,
    /// A rotated refresh token was used again: the family is revoked.
    #[error("refresh token reused; the session was revoked")]
    RefreshTokenReused,

    // --- Sessions ---------------------------------------------------------
    /// A `device_id` that is not 1 to 64 of `A-Z a-z 0-9 . _ : -`.
    #[error("invalid device_id: {0}")]
    InvalidDeviceId(&'static str),
    /// The token's session was ended (`DELETE /v1/auth/sessions`).
    #[error("the session of this token was ended; sign in again")]
    SessionRevoked,
}

impl AuthError {
    /// The error's code (its row of the table in `crate::error` gives the
    /// status); the node's own faults are `INTERNAL`.
    pub fn code(&self) -> Code {
        use AuthError::*;
        match self {
            MalformedKey(_) => Code::MalformedApiKey,
            BadChecksum => Code::BadChecksum,
            InvalidApiKey => Code::InvalidApiKey,
            MalformedToken(_) => Code::MalformedToken,
            TokenEncoding(_) => Code::TokenBadEncoding,
            TokenJson { .. } => Code::TokenBadJson,
            UnsupportedAlg(_) => Code::UnsupportedAlg,
            MissingKid => Code::MissingKid,
            UnknownKid(_) => Code::UnknownKid,
            BadSignature => Code::BadSignature,
            TokenExpired => Code::TokenExpired,
            TokenNotYetValid => Code::TokenNotYetValid,
            TokenIssuedInFuture => Code::TokenIssuedInFuture,
            WrongIssuer => Code::WrongIssuer,
            WrongAudience => Code::WrongAudience,
            KeyFile { .. } => Code::Internal,
            BadKey(_) => Code::Internal,
            Random => Code::Internal,
            InvalidGrant { .. } => Code::InvalidGrant,
            UnknownRole(_) => Code::UnknownRole,
            MissingMac => Code::MissingHopMac,
            MalformedMac(_) => Code::MalformedHopMac,
            MacExpired => Code::HopMacExpired,
            BadMac => Code::BadHopMac,
            MalformedChallenge(_) => Code::MalformedChallenge,
            ChallengeExpired => Code::ChallengeExpired,
            TooManyChallenges => Code::TooManyChallenges,
            NonceSpent => Code::NonceSpent,
            InvalidWallet(_) => Code::InvalidWallet,
            MalformedSignature => Code::MalformedSignature,
            BadWalletSignature => Code::BadWalletSignature,
            AddressChecksum => Code::AddressChecksumMismatch,
            BadRecoveryId => Code::BadRecoveryId,
            SignatureHighS => Code::SignatureHighS,
            SiweDomainMismatch => Code::SiweDomainMismatch,
            SiweChainMismatch => Code::SiweChainMismatch,
            SiweMessageAltered => Code::SiweMessageAltered,
            UnknownChallenge => Code::UnknownChallenge,
            WalletSignInDisabled => Code::WalletSignInDisabled,
            WalletNotAllowed => Code::WalletNotAllowed,
            InvalidWalletSignIn(_) => Code::InvalidWalletSignIn,
            InvalidRefreshToken => Code::InvalidRefreshToken,
            RefreshTokenExpired => Code::RefreshTokenExpired,
            RefreshTokenRevoked => Code::RefreshTokenRevoked,
            RefreshTokenReused => Code::RefreshTokenReused,
            InvalidDeviceId(_) => Code::InvalidDeviceId,
            SessionRevoked => Code::SessionRevoked,
        }
    }

    /// Whether the fault lies with the node (key file, random generator)
    /// rather than with the client's input. Node faults map to 5xx; all
    /// others are 400/401/403/429 as the HTTP layer decides.
    pub fn is_node_fault(&self) -> bool {
        matches!(
            self,
            AuthError::KeyFile { .. } | AuthError::BadKey(_) | AuthError::Random
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Codes are upper-case snake and distinct per variant.
    #[test]
    fn codes_are_stable_shape() {
        let samples = [
            AuthError::BadChecksum,
            AuthError::MalformedKey("x"),
            AuthError::TokenExpired,
            AuthError::UnknownKid("k".into()),
            AuthError::BadMac,
        ];
        let mut seen = std::collections::HashSet::new();
        for e in samples {
            let c = e.code().as_str();
            assert!(c.chars().all(|c| c.is_ascii_uppercase() || c == '_'));
            assert!(seen.insert(c));
        }
    }
}
