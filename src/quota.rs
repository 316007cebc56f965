//! Per-namespace quotas: how much one namespace may hold (docs/quotas.md).
//!
//! The limits are `[quotas]` of the configuration, overridden per namespace
//! by the operator (kept in the namespace record, [`Overrides`]). What is
//! stored (KV, functions, deployments) is counted in **usage records** in
//! the store, one per group (`usage/<ns>/kv`, `usage/<ns>/fn`,
//! `usage/<ns>/dep`), changed in the same guarded store transaction as the
//! data they count ([`crate::storage::Store::transact`]), so the count is
//! exact after a restart and on every node of a cluster, and never
//! recounted per request. A namespace created before quotas has no usage
//! records: the first write counts its data once ([`count_existing`]).
//! Sockets and subscriptions are live, not stored: each node counts its
//! own ([`LiveCounts`]).

#![forbid(unsafe_code)]

use crate::config::QuotaConfig;
use crate::error::{ApiError, Code, StatusCode};
use crate::storage::{BatchOp, OrderedKv, Store, StoreResult};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Every resource a quota bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    /// KV bytes: each key's length plus its value's.
    KvBytes,
    /// KV keys.
    KvKeys,
    /// Functions.
    Functions,
    /// Module bytes over every kept version of every function.
    ModuleBytes,
    /// Deployments.
    Deployments,
    /// Hosts claimed by the namespace's deployments.
    Hosts,
    /// Unpacked static-site bytes over every kept deployment version.
    SiteBytes,
    /// Pub/sub sockets open at once (per node).
    Sockets,
    /// Topic subscriptions held at once (per node).
    Subscriptions,
    /// Pub/sub history payload bytes kept (per node: each node's store
    /// holds its own). Past it the oldest publications are trimmed, as
    /// `[pubsub] max_history_bytes_per_namespace` trims (the lower wins);
    /// an import carrying more is refused.
    HistoryBytes,
    /// Pub/sub history topics with a stream (an epoch and offsets) kept
    /// (per node, like `HistoryBytes`). A topic's stream outlives its
    /// publications (`[pubsub] history_meta_ttl_seconds`); at the limit a
    /// new topic takes the place of the longest-idle one that holds no
    /// publication and no subscriber here, or is refused.
    HistoryTopics,
}

impl Resource {
    /// Every resource, in the order they are shown.
    pub const ALL: [Resource; 11] = [
        Resource::KvBytes,
        Resource::KvKeys,
        Resource::Functions,
        Resource::ModuleBytes,
        Resource::Deployments,
        Resource::Hosts,
        Resource::SiteBytes,
        Resource::Sockets,
        Resource::Subscriptions,
        Resource::HistoryBytes,
        Resource::HistoryTopics,
    ];

    /// The name in `[quotas]`, the API and error messages.
    pub fn name(self) -> &'static str {
        match self {
            Resource::KvBytes => "kv_bytes",
            Resource::KvKeys => "kv_keys",
            Resource::Functions => "functions",
            Resource::ModuleBytes => "module_bytes",
            Resource::Deployments => "deployments",
            Resource::Hosts => "hosts",
            Resource::SiteBytes => "site_bytes",
            Resource::Sockets => "sockets",
            Resource::Subscriptions => "subscriptions",
            Resource::HistoryBytes => "history_bytes",
            Resource::HistoryTopics => "history_topics",
        }
    }

    /// The resource of a name, if it is one.
    pub fn parse(name: &str) -> Option<Resource> {
        Resource::ALL.into_iter().find(|r| r.name() == name)
    }

    /// Whether it counts bytes (refused with 413) rather than things (429).
    pub fn is_bytes(self) -> bool {
        matches!(
            self,
            Resource::KvBytes
                | Resource::ModuleBytes
                | Resource::SiteBytes
                | Resource::HistoryBytes
        )
    }

    /// Whether each node counts it for itself (live, not stored).
    pub fn is_live(self) -> bool {
        matches!(
            self,
            Resource::Sockets
                | Resource::Subscriptions
                | Resource::HistoryBytes
                | Resource::HistoryTopics
        )
    }

    /// What gives room back under this quota, for the refusal's message.
    pub fn frees(self) -> &'static str {
        match self {
            Resource::KvBytes => "delete KV keys or write smaller values",
            Resource::KvKeys => "delete KV keys",
            Resource::Functions => "delete a function",
            Resource::ModuleBytes => "delete a function",
            Resource::Deployments => "delete a deployment",
            Resource::Hosts => "delete a deployment or give one fewer hosts",
            Resource::SiteBytes => "delete a deployment",
            Resource::Sockets => "close one of the namespace's sockets on this node",
            Resource::Subscriptions => "unsubscribe from a topic or close a socket on this node",
            Resource::HistoryBytes => "import less history",
            Resource::HistoryTopics => {
                "let topics' publications expire and their subscribers leave"
            }
        }
    }

    /// The usage record group it is counted in (stored resources only).
    fn group(self) -> Option<Group> {
        match self {
            Resource::KvBytes | Resource::KvKeys => Some(Group::Kv),
            Resource::Functions | Resource::ModuleBytes => Some(Group::Functions),
            Resource::Deployments | Resource::Hosts | Resource::SiteBytes => {
                Some(Group::Deployments)
            }
            Resource::Sockets
            | Resource::Subscriptions
            | Resource::HistoryBytes
            | Resource::HistoryTopics => None,
        }
    }

    fn default_limit(self, cfg: &QuotaConfig) -> u64 {
        match self {
            Resource::KvBytes => cfg.kv_bytes,
            Resource::KvKeys => cfg.kv_keys,
            Resource::Functions => cfg.functions,
            Resource::ModuleBytes => cfg.module_bytes,
            Resource::Deployments => cfg.deployments,
            Resource::Hosts => cfg.hosts,
            Resource::SiteBytes => cfg.site_bytes,
            Resource::Sockets => cfg.sockets,
            Resource::Subscriptions => cfg.subscriptions,
            Resource::HistoryBytes => cfg.history_bytes,
            Resource::HistoryTopics => cfg.history_topics,
        }
    }
}

/// The groups of stored usage, one record each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// `usage/<ns>/kv`: KV bytes and keys.
    Kv,
    /// `usage/<ns>/fn`: functions and module bytes.
    Functions,
    /// `usage/<ns>/dep`: deployments, hosts and site bytes.
    Deployments,
}

impl Group {
    fn suffix(self) -> &'static str {
        match self {
            Group::Kv => "kv",
            Group::Functions => "fn",
            Group::Deployments => "dep",
        }
    }
}

/// The store key of a namespace's usage record of `group`.
pub fn usage_key(ns: &str, group: Group) -> Vec<u8> {
    format!("usage/{ns}/{}", group.suffix()).into_bytes()
}

/// The store prefix of every usage record of a namespace.
pub fn usage_prefix(ns: &str) -> String {
    format!("usage/{ns}/")
}

/// Every quota's name, comma separated, for messages.
pub fn names() -> String {
    Resource::ALL.map(Resource::name).join(", ")
}

/// The operator's per-namespace limits, by resource name; the rest are `[quotas]`'s.
pub type Overrides = BTreeMap<String, u64>;

/// Checks an operator's overrides: known names only, at most 2^53 (a JSON
/// number every client reads exactly).
pub fn check_overrides(o: &Overrides) -> Result<(), ApiError> {
    for (name, v) in o {
        if Resource::parse(name).is_none() {
            return Err(ApiError::new(
                Code::BadRequest,
                format!("{name:?} is not a quota ({})", names()),
            ));
        }
        if *v > (1u64 << 53) {
            return Err(ApiError::new(
                Code::BadRequest,
                format!("quota {name} is larger than 2^53"),
            ));
        }
    }
    Ok(())
}

/// One namespace's limits: its overrides over the node's defaults.
#[derive(Debug, Clone, Copy)]
pub struct Limits([u64; Resource::ALL.len()]);

impl Limits {
    /// The limits of a namespace with `overrides` on a node configured with `cfg`.
    pub fn of(cfg: &QuotaConfig, overrides: &Overrides) -> Limits {
        let mut l = [0; Resource::ALL.len()];
        for (i, r) in Resource::ALL.into_iter().enumerate() {
            l[i] = overrides
                .get(r.name())
                .copied()
                .unwrap_or_else(|| r.default_limit(cfg));
        }
        Limits(l)
    }

    /// The limit of one resource.
    pub fn get(&self, r: Resource) -> u64 {
        self.0[r as usize]
    }
}

/// A usage record: counts by resource name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Usage(pub BTreeMap<String, u64>);

impl Usage {
    /// The record as stored; a missing or unreadable one reads as `None`.
    pub fn decode(raw: Option<&[u8]>) -> Option<Usage> {
        raw.and_then(|r| serde_json::from_slice(r).ok())
    }

    /// The record's bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The count of `r`.
    pub fn get(&self, r: Resource) -> u64 {
        self.0.get(r.name()).copied().unwrap_or(0)
    }

    /// Sets the count of `r`.
    pub fn set(&mut self, r: Resource, v: u64) {
        self.0.insert(r.name().to_string(), v);
    }

    /// Applies `deltas` if no resource that grows passes its limit; a
    /// shrinking change always passes (a namespace over a lowered quota
    /// may still delete). Saturates at zero.
    pub fn apply(&mut self, limits: &Limits, deltas: &[(Resource, i64)]) -> Result<(), ApiError> {
        for &(r, d) in deltas {
            let used = self.get(r);
            if d > 0 && used.saturating_add(d as u64) > limits.get(r) {
                return Err(exceeded(r, used, d as u64, limits.get(r)));
            }
        }
        for &(r, d) in deltas {
            let used = self.get(r);
            let v = if d >= 0 {
                used.saturating_add(d as u64)
            } else {
                used.saturating_sub(d.unsigned_abs())
            };
            self.set(r, v);
        }
        Ok(())
    }
}

/// The refusal of a change that would take `r` past its limit: 413 for
/// bytes, 429 for counts, `QUOTA_EXCEEDED` either way, naming the quota and
/// what gives room back. Not retryable and without `Retry-After`: the same
/// change passes only once the namespace holds less or the operator raised
/// the quota (docs/quotas.md).
pub fn exceeded(r: Resource, used: u64, need: u64, limit: u64) -> ApiError {
    let msg = format!(
        "quota {} exceeded: {used} of {limit} used, this change needs {need} more; {} \
         to make room, or ask the operator to raise the quota",
        r.name(),
        r.frees()
    );
    if r.is_bytes() {
        ApiError::with_status(StatusCode::PAYLOAD_TOO_LARGE, Code::QuotaExceeded, msg)
    } else {
        ApiError::new(Code::QuotaExceeded, msg)
    }
}

/// What one namespace's existing KV or functions count, for a usage record
/// that is missing (a namespace created before quotas, or a recount after
/// an import): one scan of the group's prefixes. `None` for deployments,
/// which `deploy` counts itself (`Deployments::ensure_usage`).
pub async fn count_existing(store: &Store, ns: &str, group: Group) -> StoreResult<Option<Usage>> {
    let mut u = Usage::default();
    match group {
        Group::Kv => {
            let prefix = crate::functions::kv_prefix(ns);
            let rows = store.scan_all(&prefix).await?;
            u.set(Resource::KvKeys, rows.len() as u64);
            u.set(
                Resource::KvBytes,
                rows.iter()
                    .map(|(k, v)| ((k.len() - prefix.len()) + v.len()) as u64)
                    .sum(),
            );
        }
        Group::Functions => {
            let fns = store.scan_all(&crate::functions::fn_prefix(ns)).await?;
            u.set(Resource::Functions, fns.len() as u64);
            let vers = store.scan_all(format!("fnver/{ns}/").as_bytes()).await?;
            let bytes: u64 = vers
                .iter()
                .filter_map(|(_, v)| serde_json::from_slice::<serde_json::Value>(v).ok())
                .filter_map(|m| m.get("size_bytes").and_then(|s| s.as_u64()))
                .sum();
            u.set(Resource::ModuleBytes, bytes);
        }
        Group::Deployments => return Ok(None),
    }
    Ok(Some(u))
}

/// Stores `u` as the usage record of `group` unless one is there
/// (compare-and-swap: a record another writer made first wins).
pub async fn store_if_missing(store: &Store, ns: &str, group: Group, u: &Usage) -> StoreResult<()> {
    let _ = store
        .compare_and_swap(&usage_key(ns, group), None, Some(&u.encode()), None)
        .await?;
    Ok(())
}

/// The KV or functions usage record, counted from the data when it is
/// missing and then stored. Called before a guarded change reads it, so
/// the change always finds one.
pub async fn ensure_usage(store: &Store, ns: &str, group: Group) -> StoreResult<()> {
    if store.get(&usage_key(ns, group)).await?.is_some() {
        return Ok(());
    }
    if let Some(u) = count_existing(store, ns, group).await? {
        store_if_missing(store, ns, group, &u).await?;
    }
    Ok(())
}

/// The zeroed usage records of a new namespace, written with it.
pub fn fresh_records(ns: &str) -> Vec<BatchOp> {
    [Group::Kv, Group::Functions, Group::Deployments]
        .into_iter()
        .map(|g| BatchOp::Put(usage_key(ns, g), Usage::default().encode()))
        .collect()
}

/// A namespace's quotas as shown: each resource's limit and use. Reads
/// the usage records (missing ones count as nothing: the caller ensures
/// them first).
pub async fn report(
    store: &Store,
    ns: &str,
    limits: &Limits,
    live: &LiveCounts,
    history: (u64, u64),
) -> StoreResult<serde_json::Value> {
    let mut stored = HashMap::new();
    for g in [Group::Kv, Group::Functions, Group::Deployments] {
        let u = Usage::decode(store.get(&usage_key(ns, g)).await?.as_deref()).unwrap_or_default();
        stored.insert(g.suffix(), u);
    }
    let mut out = serde_json::Map::new();
    for r in Resource::ALL {
        let used = match r.group() {
            Some(g) => stored.get(g.suffix()).map_or(0, |u| u.get(r)),
            None if r == Resource::HistoryBytes => history.0,
            None if r == Resource::HistoryTopics => history.1,
            None => live.get(ns, r),
        };
        out.insert(
            r.name().to_string(),
            serde_json::json!({"limit": limits.get(r), "used": used, "per_node": r.is_live()}),
        );
    }
    Ok(serde_json::Value::Object(out))
}

/// The live resources (sockets, subscriptions) of every namespace on this
/// node. Cheap to clone.
#[derive(Clone, Default)]
pub struct LiveCounts(Arc<Mutex<HashMap<String, [u64; 2]>>>);

impl LiveCounts {
    fn slot(r: Resource) -> usize {
        match r {
            Resource::Subscriptions => 1,
            _ => 0,
        }
    }

    /// The count of `r` (sockets or subscriptions) of `ns` on this node.
    pub fn get(&self, ns: &str, r: Resource) -> u64 {
        self.0.lock().get(ns).map_or(0, |c| c[Self::slot(r)])
    }

    /// Takes `n` of `r` for `ns` if that stays within `limit`; the caller
    /// gives them back with [`LiveCounts::release`].
    pub fn acquire(&self, ns: &str, r: Resource, n: u64, limit: u64) -> Result<(), ApiError> {
        let mut m = self.0.lock();
        let c = m.entry(ns.to_string()).or_default();
        let used = c[Self::slot(r)];
        if used.saturating_add(n) > limit {
            return Err(exceeded(r, used, n, limit));
        }
        c[Self::slot(r)] = used + n;
        Ok(())
    }

    /// Gives back `n` of `r` taken by [`LiveCounts::acquire`].
    pub fn release(&self, ns: &str, r: Resource, n: u64) {
        let mut m = self.0.lock();
        if let Some(c) = m.get_mut(ns) {
            c[Self::slot(r)] = c[Self::slot(r)].saturating_sub(n);
            if c == &[0, 0] {
                m.remove(ns);
            }
        }
    }
}

/// One socket's hold on its namespace's live quotas: the socket itself and
/// its subscriptions, given back when it is dropped (the socket ended).
pub struct LiveHold {
    live: LiveCounts,
    ns: String,
    limits: Limits,
    subscriptions: u64,
}

impl LiveHold {
    /// Takes one of `ns`'s `sockets` (refused past the quota).
    pub fn socket(live: &LiveCounts, ns: &str, limits: Limits) -> Result<LiveHold, ApiError> {
        live.acquire(ns, Resource::Sockets, 1, limits.get(Resource::Sockets))?;
        Ok(LiveHold {
            live: live.clone(),
            ns: ns.to_string(),
            limits,
            subscriptions: 0,
        })
    }

    /// Takes one more of the namespace's `subscriptions` (refused past the quota).
    pub fn subscribe(&mut self) -> Result<(), ApiError> {
        self.live.acquire(
            &self.ns,
            Resource::Subscriptions,
            1,
            self.limits.get(Resource::Subscriptions),
        )?;
        self.subscriptions += 1;
        Ok(())
    }

    /// Gives one subscription back.
    pub fn unsubscribe(&mut self) {
        if self.subscriptions > 0 {
            self.subscriptions -= 1;
            self.live.release(&self.ns, Resource::Subscriptions, 1);
        }
    }
}

impl Drop for LiveHold {
    fn drop(&mut self) {
        self.live
            .release(&self.ns, Resource::Subscriptions, self.subscriptions);
        self.live.release(&self.ns, Resource::Sockets, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A change within the limit lands; one past it is refused whole, naming
    /// the quota and what frees it, 413 for bytes and 429 for counts, never
    /// retryable; shrinking always passes.
    #[test]
    fn usage_applies_within_limits_only() {
        let cfg = QuotaConfig {
            kv_bytes: 100,
            kv_keys: 2,
            ..QuotaConfig::default()
        };
        let limits = Limits::of(&cfg, &Overrides::new());
        let mut u = Usage::default();
        u.apply(&limits, &[(Resource::KvBytes, 60), (Resource::KvKeys, 1)])
            .expect("within");
        let e = u
            .apply(&limits, &[(Resource::KvBytes, 41), (Resource::KvKeys, 1)])
            .expect_err("past kv_bytes");
        assert_eq!((e.status.as_u16(), e.code), (413, Code::QuotaExceeded));
        assert!(e.message.contains("kv_bytes"), "{}", e.message);
        assert_eq!(u.get(Resource::KvBytes), 60, "nothing applied");
        assert_eq!(u.get(Resource::KvKeys), 1, "nothing applied");
        u.apply(&limits, &[(Resource::KvBytes, 40), (Resource::KvKeys, 1)])
            .expect("exactly at the limit");
        let e = u
            .apply(&limits, &[(Resource::KvKeys, 1)])
            .expect_err("past kv_keys");
        assert_eq!((e.status.as_u16(), e.code), (429, Code::QuotaExceeded));
        assert_eq!(
            e.retry_after, None,
            "a quota frees only when something goes"
        );
        assert!(!e.retryable());
        assert!(
            e.message.contains("delete KV keys") && e.message.contains("operator"),
            "{}",
            e.message
        );
        u.apply(
            &limits,
            &[(Resource::KvBytes, -500), (Resource::KvKeys, -1)],
        )
        .expect("shrinking");
        assert_eq!((u.get(Resource::KvBytes), u.get(Resource::KvKeys)), (0, 1));
    }

    /// Overrides replace the defaults of the named resources only; unknown
    /// names and huge values are refused.
    #[test]
    fn overrides_replace_defaults() {
        let cfg = QuotaConfig::default();
        let o: Overrides = [("hosts".to_string(), 3)].into_iter().collect();
        let l = Limits::of(&cfg, &o);
        assert_eq!(l.get(Resource::Hosts), 3);
        assert_eq!(l.get(Resource::KvKeys), cfg.kv_keys);
        check_overrides(&o).expect("known");
        let bad: Overrides = [("disk".to_string(), 3)].into_iter().collect();
        assert!(check_overrides(&bad).is_err());
        let huge: Overrides = [("hosts".to_string(), u64::MAX)].into_iter().collect();
        assert!(check_overrides(&huge).is_err());
    }

    /// Live counts are taken up to the limit and given back.
    #[test]
    fn live_counts_acquire_and_release() {
        let live = LiveCounts::default();
        live.acquire("a", Resource::Sockets, 1, 2).expect("1");
        live.acquire("a", Resource::Sockets, 1, 2).expect("2");
        assert!(live.acquire("a", Resource::Sockets, 1, 2).is_err());
        live.acquire("b", Resource::Sockets, 1, 2)
            .expect("another namespace has its own");
        live.release("a", Resource::Sockets, 1);
        live.acquire("a", Resource::Sockets, 1, 2).expect("freed");
        assert_eq!(live.get("a", Resource::Sockets), 2);
        assert_eq!(live.get("a", Resource::Subscriptions), 0);
    }

    /// A socket's hold takes its socket and subscriptions within the
    /// quotas and gives every one back when dropped.
    #[test]
    fn a_hold_gives_everything_back() {
        let cfg = QuotaConfig {
            sockets: 1,
            subscriptions: 2,
            ..QuotaConfig::default()
        };
        let limits = Limits::of(&cfg, &Overrides::new());
        let live = LiveCounts::default();
        let mut hold = LiveHold::socket(&live, "a", limits).expect("first socket");
        assert!(
            LiveHold::socket(&live, "a", limits).is_err(),
            "second socket"
        );
        hold.subscribe().expect("1");
        hold.subscribe().expect("2");
        assert!(hold.subscribe().is_err(), "third subscription");
        hold.unsubscribe();
        hold.subscribe().expect("freed");
        drop(hold);
        assert_eq!(live.get("a", Resource::Sockets), 0);
        assert_eq!(live.get("a", Resource::Subscriptions), 0);
        LiveHold::socket(&live, "a", limits).expect("socket given back");
    }
}
