//! Cluster placement (docs/design.md §6): the node registry, where a namespace
//! lives, and forwarding a request to a member through per-(namespace, member)
//! breakers.
//!
//! - Nodes announce themselves under `_nodes/<id>` (id, advertised HTTP
//!   address) with a time to live, refreshed every `register_seconds`.
//! - A namespace's `members` (its record) are the nodes that serve it; empty
//!   means every node. Created without members in a cluster, a namespace is
//!   placed on three live nodes chosen by rendezvous hashing.
//! - A request for a namespace this node is not a member of is forwarded
//!   (the HTTP layer's forwarder, `http/forward.rs`): to the member the credential hashes to, then the others,
//!   skipping open breakers, with the resolved identity under a hop MAC (V4,
//!   over the query and the body's digest too), over TLS to a member that
//!   advertises `https://` ([`peer`]). Anonymous public invokes are forwarded
//!   too, under an anonymous hop that carries no identity.
//! - Placement is respected: only members run a namespace's functions, cron
//!   and triggers (the node supervisor starts a full namespace supervisor on
//!   members only). A non-member keeps nothing for a namespace it forwards
//!   but its breakers, held here ([`Cluster::breakers`]), not in a supervisor.

#![forbid(unsafe_code)]

mod breaker;
mod fire;
pub mod peer;
mod replace;

pub use breaker::{Admit, BreakerView, Breakers};
pub use fire::{FIRE_QUEUE_MAX, FireQueues, Queued, body_limit as fire_body_limit};
pub use replace::{MOVES_PER_SWEEP, Move, Outcome, Replacer, replaced_members, sweep_every};

use crate::storage::{OrderedKv, Store};
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

/// Members a namespace is placed on by default.
pub const DEFAULT_MEMBERS: usize = 3;

/// A node as announced in the registry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node's cluster id ([`node_id`]); the key of its registry entry.
    pub id: String,
    /// Base URL of its HTTP listener (`http://host:port`).
    pub advertise: String,
    /// Every socket it listens on besides `advertise`: its API listener as
    /// bound (HTTP, TLS and the dashboard share it) and its `[metrics]
    /// listen` listener. Each member's egress policy refuses all of them
    /// (docs/cluster.md, "Every address of every member").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub listeners: Vec<Listener>,
}

/// One listening socket of a node, as announced in the registry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Listener {
    /// What it is: `api` or `metrics`.
    pub kind: String,
    /// The bound address (`ip:port`; an unspecified IP means every address
    /// of the node, which its members read as the advertised host).
    pub addr: std::net::SocketAddr,
}

/// `_nodes/<id>`: a node's registry entry.
fn node_key(id: &str) -> Vec<u8> {
    format!("_nodes/{id}").into_bytes()
}

/// This node's view of the cluster.
pub struct Cluster {
    /// This node's id ([`node_id`]), unique in the cluster.
    pub node_id: String,
    /// This node's HTTP base URL as other nodes reach it.
    pub advertise: String,
    /// This node's listeners, announced with it ([`NodeInfo::listeners`]).
    listeners: Vec<Listener>,
    /// The shared store holding the registry and namespace records.
    store: Store,
    /// The live nodes as last read from the registry, this one included.
    live: RwLock<Vec<NodeInfo>>,
    /// `register_seconds`: how often this node re-announces itself.
    every: Duration,
    /// The breakers of the namespaces this node forwarded for, one
    /// [`Breakers`] (per member) per namespace: all a non-member keeps.
    breakers: RwLock<std::collections::BTreeMap<String, Arc<Breakers>>>,
    /// Publications of sockets here whose triggers go to a member of their
    /// namespace (this node not being one): see [`FireQueues`].
    pub fire_queues: FireQueues,
}

/// This node's id in cluster mode (`[cluster] node_id`, by default the host
/// name); None on a single node.
pub fn node_id(c: &crate::config::ClusterConfig) -> Option<String> {
    if c.etcd.is_empty() {
        return None;
    }
    Some(if c.node_id.is_empty() {
        crate::util::hostname()
    } else {
        c.node_id.clone()
    })
}

/// Whether node `id` serves a namespace placed on `members` (empty: every node).
pub fn is_member(members: &[String], id: &str) -> bool {
    members.is_empty() || members.iter().any(|m| m == id)
}

/// Rendezvous (highest random weight) order of `candidates` for `key`.
pub fn rendezvous<'a>(candidates: &'a [String], key: &str) -> Vec<&'a String> {
    let mut scored: Vec<(u64, &String)> = candidates
        .iter()
        .map(|c| {
            let d = ring::digest::digest(&ring::digest::SHA256, format!("{c}\n{key}").as_bytes());
            let w = u64::from_be_bytes(d.as_ref()[..8].try_into().expect("8 bytes"));
            (w, c)
        })
        .collect();
    scored.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    scored.into_iter().map(|(_, c)| c).collect()
}

/// Where nodes announce themselves in the shared store.
pub const NODES_PREFIX: &[u8] = b"_nodes/";
/// First wait before a broken registry watch is made again.
const REGISTRY_WATCH_BACKOFF_MIN: Duration = Duration::from_millis(250);
/// Longest wait between attempts to re-make a broken registry watch.
const REGISTRY_WATCH_BACKOFF_MAX: Duration = Duration::from_secs(10);

impl Cluster {
    /// Announces this node now and every `every` (entries live 4 × `every`).
    pub async fn start(
        store: Store,
        node_id: String,
        advertise: String,
        listeners: Vec<Listener>,
        every: Duration,
    ) -> Result<Arc<Cluster>, crate::storage::StoreError> {
        let c = Arc::new(Cluster {
            node_id,
            advertise,
            listeners,
            store,
            live: RwLock::new(Vec::new()),
            every,
            breakers: Default::default(),
            fire_queues: FireQueues::default(),
        });
        c.announce().await?;
        Self::follow_registry(&c);
        let weak = Arc::downgrade(&c);
        actix_web::rt::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(c) = weak.upgrade() else { return };
                if let Err(e) = c.announce().await {
                    tracing::warn!(error = %e, "Cluster announcement failed; retrying.");
                }
            }
        });
        Ok(c)
    }

    /// Membership is live: a watch on the registry re-reads the live nodes
    /// as soon as one registers or leaves (the periodic announcement stays
    /// as the safety net). A broken watch is made again with backoff, and
    /// the registry re-read once it exists, so no change is missed.
    fn follow_registry(c: &Arc<Cluster>) {
        let weak = Arc::downgrade(c);
        let store = c.store.clone();
        actix_web::rt::spawn(async move {
            let mut backoff = REGISTRY_WATCH_BACKOFF_MIN;
            loop {
                match store.watch_prefix(NODES_PREFIX).await {
                    Ok(mut watch) => {
                        backoff = REGISTRY_WATCH_BACKOFF_MIN;
                        loop {
                            let Some(c) = weak.upgrade() else { return };
                            if let Err(e) = c.refresh().await {
                                tracing::warn!(error = %e, "Live nodes not re-read after a registry change.");
                            }
                            drop(c);
                            if let Err(e) = watch.next().await {
                                tracing::warn!(error = %e, "Node registry watch broke; watching again.");
                                break;
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "Node registry watch not started; retrying.");
                    }
                }
                if weak.strong_count() == 0 {
                    return;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(REGISTRY_WATCH_BACKOFF_MAX);
            }
        });
    }

    /// The breakers of namespace `ns`'s members, created (with `threshold`
    /// and `probe_every`) the first time this node forwards for it. A
    /// deleted namespace's breakers go with [`Cluster::forget_breakers`].
    pub fn breakers(&self, ns: &str, threshold: u32, probe_every: Duration) -> Arc<Breakers> {
        if let Some(b) = self.breakers.read().get(ns) {
            return b.clone();
        }
        self.breakers
            .write()
            .entry(ns.to_string())
            .or_insert_with(|| Arc::new(Breakers::new(threshold, probe_every)))
            .clone()
    }

    /// Every namespace's breakers, by namespace name.
    pub fn all_breakers(&self) -> Vec<(String, Arc<Breakers>)> {
        self.breakers
            .read()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Drops a namespace's breakers (it was deleted).
    pub fn forget_breakers(&self, ns: &str) {
        self.breakers.write().remove(ns);
    }

    /// Writes this node's entry and re-reads the live nodes.
    async fn announce(&self) -> Result<(), crate::storage::StoreError> {
        let me = NodeInfo {
            id: self.node_id.clone(),
            advertise: self.advertise.clone(),
            listeners: self.listeners.clone(),
        };
        self.store
            .put_ttl(
                &node_key(&self.node_id),
                &serde_json::to_vec(&me).expect("json"),
                self.every * 4,
            )
            .await?;
        self.refresh().await
    }

    async fn refresh(&self) -> Result<(), crate::storage::StoreError> {
        let nodes: Vec<NodeInfo> = self
            .store
            .scan_prefix(NODES_PREFIX, usize::MAX)
            .await?
            .into_iter()
            .filter_map(|(_, v)| serde_json::from_slice(&v).ok())
            .collect();
        *self.live.write() = nodes;
        Ok(())
    }

    /// The live nodes, as last read.
    pub fn live(&self) -> Vec<NodeInfo> {
        self.live.read().clone()
    }

    /// The live nodes re-read from the registry now (the last read if the
    /// store does not answer): for a question every node must answer, where
    /// a node that joined since the last periodic read must not be missed.
    pub async fn live_now(&self) -> Vec<NodeInfo> {
        if let Err(e) = self.refresh().await {
            tracing::warn!(error = %e, "Live nodes not re-read; the last read is used.");
        }
        self.live()
    }

    /// Where a member is reached (re-reading the registry when it is unknown).
    pub async fn address_of(&self, id: &str) -> Option<String> {
        if let Some(n) = self.live.read().iter().find(|n| n.id == id) {
            return Some(n.advertise.clone());
        }
        let _ = self.refresh().await;
        self.live
            .read()
            .iter()
            .find(|n| n.id == id)
            .map(|n| n.advertise.clone())
    }

    /// The default members of a new namespace: three live nodes by rendezvous.
    pub async fn place(&self, namespace: &str) -> Vec<String> {
        let _ = self.refresh().await;
        let ids: Vec<String> = self.live.read().iter().map(|n| n.id.clone()).collect();
        rendezvous(&ids, namespace)
            .into_iter()
            .take(DEFAULT_MEMBERS)
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rendezvous order is a permutation, stable for a key, and spreads keys.
    #[test]
    fn rendezvous_is_stable_and_spreads() {
        let nodes: Vec<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
        let o1 = rendezvous(&nodes, "ns-1");
        assert_eq!(o1, rendezvous(&nodes, "ns-1"));
        let mut sorted: Vec<&String> = o1.clone();
        sorted.sort();
        assert_eq!(sorted, nodes.iter().collect::<Vec<_>>());
        let firsts: std::collections::BTreeSet<&String> = (0..64)
            .map(|i| rendezvous(&nodes, &format!("k{i}"))[0])
            .collect();
        assert!(firsts.len() >= 3, "{firsts:?}");
        // Removing a node moves only the keys that ranked it first.
        let three: Vec<String> = nodes[..3].to_vec();
        for i in 0..64 {
            let k = format!("k{i}");
            let full = rendezvous(&nodes, &k);
            if full[0] != "d" {
                assert_eq!(rendezvous(&three, &k)[0], full[0]);
            }
        }
    }
}
