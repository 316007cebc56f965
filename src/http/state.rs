//! The node's shared handle, `Node`: what the HTTP layer's handlers, the
//! sockets and the dashboard are given (`web::Data<Node>`). It holds the
//! services of the layers below (store, actors, pub/sub, functions,
//! deployments, cluster) and the HTTP layer's own caches. Built by
//! `node.rs` (the assembly); nothing below the HTTP layer sees it.

use crate::actors::{ActorDirectory, ActorStats, Namespaces, NodeSupervisor};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::storage::Store;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

/// Where the node is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Listener bound, not yet accepting work (`/readyz` 503).
    Starting = 0,
    /// Accepting work.
    Ready = 1,
    /// Draining after SIGTERM/SIGINT: new work refused, in-flight work finishing.
    Draining = 2,
}

/// Everything the node's handlers share. Holds no namespace state.
pub struct NodeInner {
    /// The validated configuration the node started with (file, env, CLI).
    pub config: Config,
    /// sled on a single node, etcd in a cluster.
    pub store: Store,
    /// The registry `/metrics` renders and the dashboard reads.
    pub metrics: Metrics,
    /// Every live actor's stats (the dashboard's actor rows, `/v1/status`).
    pub directory: ActorDirectory,
    /// The running namespace supervisors: a handler finds one without a hop.
    pub namespaces: Namespaces,
    /// The node's top actor: starts a namespace's supervisor on first use.
    pub supervisor: actix::Addr<NodeSupervisor>,
    /// The namespace records as their supervisors published them (read-only
    /// here: the chain's namespace limits, the forwarder's members, claims).
    pub records: crate::actors::Records,
    /// The top actor's mailbox admission, for [`Node::locate`].
    pub supervisor_stats: Arc<ActorStats>,
    /// The server secret and the operator key's HMAC, from the data folder.
    pub secrets: Secrets,
    /// The hop-MAC key, when this node has a cluster secret.
    pub hop_key: Option<crate::auth::HopKey>,
    /// JWTs already verified, until they expire.
    pub token_cache: crate::http::chain::credentials::TokenCache,
    /// API key records recently read (see `KeyCache`).
    pub key_cache: crate::http::chain::credentials::KeyCache,
    /// The ended sessions whose access tokens are refused (re-read from the
    /// store every `identity::REVOCATION_POLL`).
    pub revoked_sessions: crate::identity::RevokedSessions,
    /// The JWT signing key (generated on first start, `<data_dir>/jwt.key`, 0600).
    pub jwt: crate::auth::JwtKeys,
    /// The [`Phase`] as its `u8`; read by the probes and the request chain.
    pub(crate) phase: AtomicU8,
    /// Flips to true when the drain starts; sockets watch it to send close frames.
    pub draining: tokio::sync::watch::Sender<bool>,
    /// The node's single pub/sub delivery path.
    pub pubsub: crate::pubsub::PubSubService,
    /// The dashboard's latest frame, history and viewers.
    pub dashboard: crate::http::dashboard::board::Dashboard,
    /// The WASM engine, the invocation-record queue and the secret key.
    pub functions: crate::actors::FunctionsService,
    /// Host-routed deployments: records and the routing index.
    pub deployments: Arc<crate::deploy::Deployments>,
    /// Asks the node's blob sweeper for a sweep: after a change that may
    /// leave module or site-file blobs named by no record.
    pub blob_sweeps: crate::storage::blob_ledger::SweepRequests,
    /// Each namespace's sockets and subscriptions on this node, against its quotas.
    pub live: crate::quota::LiveCounts,
    /// The namespaces whose export is being built or sent from this node:
    /// one at a time each (`GET /v1/db/export`, `http/routes/kv.rs`).
    pub exports: parking_lot::Mutex<std::collections::HashSet<String>>,
    /// This node's view of the cluster (set once the listener is bound, in
    /// cluster mode only: `[cluster] etcd` set).
    pub cluster: std::sync::OnceLock<Arc<crate::placement::Cluster>>,
    /// The pub/sub mesh between the nodes (cluster mode).
    #[cfg(feature = "cluster")]
    pub mesh: std::sync::OnceLock<Arc<crate::cluster::Mesh>>,
}

/// The node's handle, cloned into every handler.
#[derive(Clone)]
pub struct Node(pub Arc<NodeInner>);

impl std::ops::Deref for Node {
    type Target = NodeInner;
    fn deref(&self) -> &NodeInner {
        &self.0
    }
}

impl Node {
    /// The node serving a request: the app data [`serve`](crate::http::serve)
    /// gives every worker. The one way from a request to the node (a
    /// `ServiceRequest` passes its `request()`).
    pub fn of(req: &actix_web::HttpRequest) -> &Node {
        req.app_data::<actix_web::web::Data<Node>>()
            .expect("node data")
            .get_ref()
    }

    /// The running supervisor of a namespace, started now if the namespace exists.
    pub async fn locate(
        &self,
        name: &str,
    ) -> Result<crate::actors::NsHandle, crate::actors::LocateError> {
        crate::actors::locate(
            &self.supervisor,
            &self.supervisor_stats,
            &self.namespaces,
            name,
        )
        .await
    }

    /// A namespace's quota limits: its record's overrides over `[quotas]`
    /// (the defaults alone when it has no record).
    pub async fn limits(
        &self,
        ns: &str,
    ) -> Result<crate::quota::Limits, crate::storage::StoreError> {
        let rec = self.records.get(ns).await?;
        let none = crate::quota::Overrides::new();
        let overrides = rec.as_deref().map_or(&none, |r| &r.quotas);
        Ok(crate::quota::Limits::of(&self.config.quotas, overrides))
    }

    /// Where the node is in its life now.
    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Acquire) {
            0 => Phase::Starting,
            1 => Phase::Ready,
            _ => Phase::Draining,
        }
    }
    /// Moves to `p`; entering [`Phase::Draining`] also signals the sockets.
    pub fn set_phase(&self, p: Phase) {
        self.phase.store(p as u8, Ordering::Release);
        if p == Phase::Draining {
            let _ = self.draining.send(true);
        }
    }
}

/// Node secrets kept in the data folder (mode 0600).
pub struct Secrets {
    /// Keys API keys and refresh tokens are HMAC'd with.
    pub server_secret: Vec<u8>,
    /// HMAC of the operator key (the key itself is never kept in memory).
    pub operator_key_hash: [u8; 32],
    /// The operator key's length: a credential of another length is not it,
    /// and is not HMAC'd to find out (a JWT is 400-odd bytes, hashed on every
    /// request otherwise). Only this length can be learned from the timing;
    /// the key's bytes are still compared in constant time.
    operator_key_len: usize,
    /// `server_secret` as an HMAC key, prepared once (its inner and outer
    /// pads), for the checks every request makes.
    mac_key: ring::hmac::Key,
}

impl Secrets {
    /// The node's secrets: the server secret, and the operator key's HMAC
    /// and length (the key itself is not kept).
    pub fn new(server_secret: Vec<u8>, operator_key: &str) -> Secrets {
        let mac_key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &server_secret);
        let tag = ring::hmac::sign(&mac_key, operator_key.as_bytes());
        Secrets {
            operator_key_hash: tag.as_ref().try_into().expect("HMAC-SHA256 is 32 bytes"),
            operator_key_len: operator_key.len(),
            server_secret,
            mac_key,
        }
    }

    /// Whether `candidate` is the operator key: its length first, then its
    /// HMAC compared in constant time.
    pub fn is_operator_key(&self, candidate: &str) -> bool {
        candidate.len() == self.operator_key_len
            && ring::hmac::verify(&self.mac_key, candidate.as_bytes(), &self.operator_key_hash)
                .is_ok()
    }

    /// An API key's stored form, `auth::hash_api_key(server_secret, key)`,
    /// with the prepared key.
    pub fn api_key_hash(&self, key: &str) -> [u8; 32] {
        crate::auth::hash_api_key_with(&self.mac_key, key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prepared key gives the same HMACs as a key made per call: an API
    /// key hashes to what `auth::hash_api_key` stored, and only the operator
    /// key itself passes `is_operator_key`.
    #[test]
    fn the_prepared_key_gives_the_stored_forms() {
        let secret = b"0123456789abcdef0123456789abcdef".to_vec();
        let op = "mgop_test_operator_key";
        let s = Secrets::new(secret.clone(), op);
        let key = crate::auth::generate_api_key(crate::auth::KeyKind::Runtime).unwrap();
        assert_eq!(
            s.api_key_hash(&key),
            crate::auth::hash_api_key(&secret, &key)
        );
        assert!(s.is_operator_key(op));
        assert!(!s.is_operator_key("mgop_test_operator_kex"));
        assert!(!s.is_operator_key("mgop_test_operator_ke"));
        assert!(!s.is_operator_key("mgop_test_operator_keyy"));
        assert_eq!(
            s.operator_key_hash,
            crate::util::hmac(&secret, op.as_bytes()),
            "the stored form is the key's HMAC, as before"
        );
        assert!(!s.is_operator_key(&key));
    }
}
