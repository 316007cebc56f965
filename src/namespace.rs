//! The namespace record (`ns/<name>` in the store): what a tenant is, its
//! members in a cluster and its own limits. Its owner is the namespace's
//! supervisor (`actors/namespace.rs`); every other room reads it or asks the
//! supervisor.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// The durable record of a namespace (`ns/<name>`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NamespaceRecord {
    /// The namespace's name (`valid_namespace_name`), also the key `ns/<name>`.
    pub name: String,
    /// Unix seconds of the namespace's creation.
    pub created_at: u64,
    /// Member nodes (cluster placement); empty on a single node.
    #[serde(default)]
    pub members: Vec<String>,
    /// Per-namespace rate limit override: requests per minute.
    #[serde(default)]
    pub rate_per_minute: Option<u32>,
    /// Per-namespace rate limit override: burst.
    #[serde(default)]
    pub rate_burst: Option<u32>,
    /// Function that adds custom claims to this namespace's tokens.
    #[serde(default)]
    pub claims_provider: Option<String>,
    /// The operator's quota overrides by resource name (`quota.rs`); the
    /// others are `[quotas]`'s.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub quotas: std::collections::BTreeMap<String, u64>,
    /// Whether and as what wallets sign in; None (never set): they do not.
    #[serde(default)]
    pub wallet_sign_in: Option<crate::auth::WalletSignIn>,
    /// Which topics keep a history and how much (`PUT /v1/namespaces/{ns}/pubsub`,
    /// docs/pubsub.md "History and recovery"); empty: none does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<crate::pubsub::HistoryRule>,
}

impl NamespaceRecord {
    /// A new namespace's record: no members, no overrides, no settings.
    pub fn new(name: &str, created_at: u64) -> NamespaceRecord {
        NamespaceRecord {
            name: name.to_string(),
            created_at,
            members: Vec::new(),
            rate_per_minute: None,
            rate_burst: None,
            claims_provider: None,
            quotas: Default::default(),
            wallet_sign_in: None,
            history: Vec::new(),
        }
    }
}

/// Store key of a namespace record.
pub fn ns_key(name: &str) -> Vec<u8> {
    format!("ns/{name}").into_bytes()
}
