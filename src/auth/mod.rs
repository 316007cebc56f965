//! Identity primitives: API keys, grants and roles, EdDSA JWTs, refresh
//! token rotation, wallet sign-in (Ed25519 keys and Sign-In with Ethereum) and the cluster hop MAC.
//!
//! Everything here is pure and synchronous: no store, no HTTP, and time is
//! always a parameter (`now`, unix seconds). The node wires these into the
//! authentication, authorization and scope steps of the chain. See
//! `docs/auth.md` for the formats and rules.
#![forbid(unsafe_code)]

mod apikey;
mod error;
mod grants;
mod hopmac;
mod jwt;
mod refresh;
mod session;
mod siwe;
mod wallet;
mod wallet_policy;

pub use self::{
    apikey::{
        API_KEY_DEFAULT_TTL_DAYS, API_KEY_MAX_TTL_DAYS, KeyKind, ParsedKey,
        generate as generate_api_key, hash as hash_api_key, hash_with as hash_api_key_with,
        is_api_key_shaped, key_id, parse as parse_api_key,
    },
    error::{AuthError, Result, TokenPart},
    grants::{
        ACTIONS, DOMAINS, Grant, Role, allows, allows_action, glob_match, grants_cover,
        parse_grants,
    },
    hopmac::{
        HOP_ACCEPTED_VERSION, HOP_BODY_SHA256_HEADER, HOP_CUSTOM_HEADER, HOP_DEVICE_HEADER,
        HOP_EXP_HEADER, HOP_GRANTS_HEADER, HOP_HEADER_PREFIX, HOP_HEADERS, HOP_IAT_HEADER,
        HOP_JTI_HEADER, HOP_MAC_HEADER, HOP_MAC_WINDOW, HOP_NAMESPACE_HEADER, HOP_SESSION_HEADER,
        HOP_SUBJECT_HEADER, HOP_VERSION_HEADER, HopIdentity, HopKey, HopRequest, HopVersion,
        body_sha256 as hop_body_sha256, canonical_json, from_headers as hop_from_headers,
        to_headers as hop_to_headers,
    },
    jwt::{ACCESS_TOKEN_TTL, Claims, JWT_LEEWAY, JwtKeys, MAX_TOKEN_LEN, kid_for},
    refresh::{
        REFRESH_REUSE_GRACE, REFRESH_TOKEN_TTL, RefreshDecision, RefreshRecord,
        decide as decide_refresh, hash_token as hash_refresh_token, is_refresh_token_shaped,
        new_refresh_token,
    },
    session::{MAX_DEVICE_ID, check_device_id, is_session_id_shaped, new_session_id},
    siwe::{
        SIWE_PREAMBLE, SiweMessage, checksum_address, eip191_digest, new_siwe_nonce,
        normalize_evm_address, parse_siwe, recover_address,
    },
    wallet::{
        Challenge, MAX_OPEN_NONCES, NONCE_TTL, challenge_message, new_nonce, normalize_wallet,
        parse_challenge, verify_signature as verify_wallet_signature,
    },
    wallet_policy::{
        DEFAULT_WALLET_ROLE, MAX_WALLET_ALLOW, MAX_WALLET_GRANTS, SUBJECT_PLACEHOLDER, WalletAllow,
        WalletSignIn, normalize_any_wallet,
    },
};
