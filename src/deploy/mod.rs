//! Deployments (docs/design.md §7): a namespace attaches hosts to a static site or
//! to upstream instances, and the node serves or proxies the requests of those
//! hosts.
//!
//! - `model`: records, validation, store keys.
//! - `egress`: which addresses an upstream may reach (at create and at connect).
//! - `hosts`: which hosts no deployment may take (addresses, the node's own names).
//! - `canonical`: the one spelling of a path and of a header name that routes and upstreams read.
//! - `site`: tarball unpacking and its safety checks.
//! - `index`: the host → path-trie → method/priority routing index.
//! - `proxy`: the reverse proxy (streaming, WebSockets, one retry loop).
//! - `compress`: gzip of proxied answers (streamed, for clients that accept it).
//! - `pool`: instances, weights, the balancers, passive and active health state.
//! - `health`: the node's active health checker (one check per distinct
//!   instance, a minimum interval, a budget per namespace, only pools in use).
//! - `h1`, `wire`, `idle`: the proxy's pooled HTTP/1.1 clients of plain-HTTP
//!   instances (hyper for requests with a body, our own inline one for those
//!   without) and their per-thread pool of idle connections.
//! - `grpc`: gRPC to the instances: `grpc-timeout`, statuses, the HTTP/2 client.
//! - `transfer`: a namespace's deployments in a namespace export and import.
//! - `certs`: per-host certificates (checked, sealed at rest, served by SNI).
//! - `acme`: certificates of `tls: "auto"` deployments ordered from an ACME CA.
//!
//! Mutations are serialized store-wide, so across a cluster too (a host belongs
//! to one namespace at a time, which crosses namespaces): a lock key taken by
//! compare-and-swap with a time to live. Each is written in one atomic batch
//! that also rewrites a generation key, and then the in-memory index is rebuilt
//! and swapped. In a cluster every node polls the generation and rebuilds its
//! index when another node changed it.

#![forbid(unsafe_code)]

pub mod acme;
pub mod activity;
pub mod awc_client;
pub mod canonical;
pub mod certs;
pub mod compress;
pub mod egress;
pub mod files;
pub mod grpc;
pub mod h1;
pub mod headers;
pub mod health;
pub mod hosts;
pub mod idle;
pub mod index;
pub mod model;
pub mod pool;
pub mod proxy;
pub mod relay;
pub mod route_policy;
pub mod site;
pub mod transfer;
pub mod wire;

use crate::config::DeployConfig;
use crate::error::ApiError;
use crate::error::Code;
use crate::quota::{Group, Limits, Resource, Usage, usage_key};
use crate::storage::{BatchOp, OrderedKv, Store};
use egress::EgressPolicy;
use index::{Bound, Index, Serve};
use model::{
    DeploymentRecord, DeploymentVersion, HostClaim, RouteSpec, TargetSpec, dep_key, dep_prefix,
    host_key, ver_key, ver_prefix,
};
use parking_lot::Mutex;
use pool::UpstreamPool;
use serde_json::{Value, json};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

/// Deployment operations answer with the API's own errors.
pub type DeployResult<T> = Result<T, ApiError>;

/// A validated deployment request.
pub struct NewDeployment {
    /// Deployment name within the namespace; a new one or the next version of it.
    pub name: String,
    /// Hostnames the deployment serves; none may be a gateway host or another
    /// namespace's (checked again under the lock).
    pub hosts: Vec<String>,
    /// Which requests (path prefix, methods) go to the target, and their rewrites.
    pub routes: Vec<RouteSpec>,
    /// What serves: a static site's file list or upstream instances (egress-checked).
    pub target: TargetSpec,
    /// Static-site contents by sha256: the temporary file holding each (in
    /// the deploy's `site::SiteDir`), stored one at a time before the records.
    pub blobs: Vec<(String, std::path::PathBuf)>,
    /// `tls: "auto"`: certificates for the hosts by ACME.
    pub tls_auto: bool,
}

/// The node's deployments: records in the store, an index in memory.
pub struct Deployments {
    /// The node's store: records, blobs, the generation and the store-wide lock.
    store: Store,
    /// Deployment limits, proxy timeouts and health thresholds; the proxy reads it per request.
    pub config: DeployConfig,
    /// Where upstreams may connect: checked at create, rollback and connect.
    pub egress: Arc<EgressPolicy>,
    /// The hosts no deployment may take nor be routed: addresses, `localhost`,
    /// single labels, the gateway's hosts (`base_domain`, `ns-*`) and the
    /// node's and the cluster members' own names.
    pub own_names: hosts::OwnNames,
    /// The routing index by host, swapped whole on rebuild; readers clone the Arc.
    index: arc_swap::ArcSwap<Index>,
    /// Upstream pools by (namespace, deployment, version), kept across index
    /// rebuilds so passive health survives other deployments' changes.
    pools: Mutex<HashMap<(String, String, u64), Arc<UpstreamPool>>>,
    /// The routes' rate-limit buckets by (namespace, deployment, version),
    /// in route order, kept across index rebuilds as the pools are.
    buckets: Mutex<HashMap<(String, String, u64), RouteBuckets>>,
    /// Serializes this node's changes before they contend for the store-wide lock.
    writes: tokio::sync::Mutex<()>,
    /// The generation the index was built from.
    loaded: Mutex<Option<Vec<u8>>>,
    /// Site unpacks running at once, node-wide (`unpack_concurrency`).
    unpacks: Arc<tokio::sync::Semaphore>,
    /// The site files being sent, one copy each however many answers send
    /// it (`deploy/files.rs`).
    pub files: files::SiteFiles,
    /// The node's active health checker: every pool with a `health` spec is watched there.
    pub health: health::HealthChecks,
    /// Deployment certificates: their keys' seal and the map the TLS
    /// listener serves, rebuilt with the index.
    pub certs: certs::Certs,
    /// TLS-ALPN-01 challenge certificates by host (`deploy::acme`), which
    /// the TLS listener answers `acme-tls/1` handshakes with.
    pub acme_alpn: certs::ServedCerts,
    /// The deployments with `tls: "auto"` and their routed hosts, as of
    /// the last rebuild (`deploy::acme` orders their certificates).
    auto_tls: Mutex<Vec<acme::AutoTls>>,
    /// Each active deployment's certificate as of the last rebuild (read
    /// from the records the rebuild parses anyway), for the dashboard.
    tls_index: arc_swap::ArcSwap<HashMap<(String, String), certs::TlsSummary>>,
    /// The ACME state of each `tls: "auto"` deployment as this node's
    /// checker last read or wrote it (`deploy::acme`), for the dashboard.
    acme_seen: Mutex<HashMap<(String, String), acme::AcmeState>>,
}

/// Host → the certificate served for it.
type ServedMap = HashMap<String, Arc<rustls::sign::CertifiedKey>>;
/// (namespace, deployment) → its stored leaf's `(not_before, not_after)`.
type LeafValidity = HashMap<(String, String), (i64, i64)>;

/// A version's routes' rate-limit buckets, in route order (None: no `rate_limit`).
type RouteBuckets = Vec<Option<Arc<index::RouteBucket>>>;

fn unix_now() -> u64 {
    crate::util::now()
}

/// Rewritten by every deployment change: a node whose index was built from
/// another generation rebuilds it.
const GENERATION_KEY: &[u8] = b"_deploy/generation";
/// The store-wide lock of deployment changes (value: the holder's random token).
const LOCK_KEY: &[u8] = b"_deploy/lock";
/// A holder that dies keeps the lock at most this long.
const LOCK_TTL: Duration = Duration::from_secs(30);
/// How long a change waits for the lock before answering 503.
const LOCK_WAIT: Duration = Duration::from_secs(10);
/// How often a cluster node checks the generation.
pub const FOLLOW_INTERVAL: Duration = Duration::from_secs(1);

/// Holds the node's write mutex and the store-wide lock; dropping it releases
/// both (the store lock by a compare-and-swap of our token, in a task).
struct WriteLock<'a> {
    /// The store holding the lock, released on drop.
    store: Store,
    /// This holder's random token: the release deletes the lock only if it is still ours.
    token: Vec<u8>,
    /// The node's write mutex, held for as long as the store lock.
    _local: tokio::sync::MutexGuard<'a, ()>,
}

impl Drop for WriteLock<'_> {
    fn drop(&mut self) {
        let store = self.store.clone();
        let token = std::mem::take(&mut self.token);
        tokio::spawn(async move {
            if let Err(e) = store
                .compare_and_swap(LOCK_KEY, Some(&token), None, None)
                .await
            {
                tracing::warn!(error = %e, "Could not release the deployment lock; it expires by itself.");
            }
        });
    }
}

impl Deployments {
    /// `server_secret` seals certificate keys (cluster-wide in a cluster).
    pub fn new(
        store: Store,
        config: DeployConfig,
        base_domain: String,
        server_secret: &[u8],
    ) -> Deployments {
        let unpacks = Arc::new(tokio::sync::Semaphore::new(
            config.unpack_concurrency.max(1),
        ));
        Deployments {
            store,
            egress: Arc::new(EgressPolicy::from_config(&config)),
            health: health::HealthChecks::new(&config),
            config,
            own_names: hosts::OwnNames::new(&base_domain),
            index: arc_swap::ArcSwap::from_pointee(Index::default()),
            pools: Mutex::new(HashMap::new()),
            buckets: Mutex::new(HashMap::new()),
            writes: tokio::sync::Mutex::new(()),
            loaded: Mutex::new(None),
            unpacks,
            files: files::SiteFiles::default(),
            certs: certs::Certs::new(server_secret),
            acme_alpn: Default::default(),
            auto_tls: Mutex::new(Vec::new()),
            tls_index: arc_swap::ArcSwap::from_pointee(HashMap::new()),
            acme_seen: Mutex::new(HashMap::new()),
        }
    }

    /// A slot to unpack and store one site, held until the deploy is done:
    /// at most `unpack_concurrency` at once node-wide. Waits up to
    /// `unpack_wait_ms`, then 503 `UNPACK_BUSY` with `Retry-After`.
    pub async fn unpack_slot(&self) -> DeployResult<tokio::sync::OwnedSemaphorePermit> {
        let wait = Duration::from_millis(self.config.unpack_wait_ms);
        match tokio::time::timeout(wait, self.unpacks.clone().acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) => Err(ApiError::internal("the unpack slots are closed")),
            Err(_) => Err(ApiError::new(
                Code::UnpackBusy,
                format!(
                    "every site-unpack slot of the node stayed taken for {} ms; try again",
                    wait.as_millis()
                ),
            )
            .retry_after(1)),
        }
    }

    /// The current routing index.
    pub fn index(&self) -> Arc<Index> {
        self.index.load_full()
    }

    /// Takes the node's write mutex, then the store-wide lock; 503
    /// `DEPLOY_BUSY` if another change holds it for longer than `LOCK_WAIT`.
    async fn write_lock(&self) -> DeployResult<WriteLock<'_>> {
        let local = self.writes.lock().await;
        let token = crate::util::random_bytes::<16>().to_vec();
        let deadline = tokio::time::Instant::now() + LOCK_WAIT;
        let mut pause = Duration::from_millis(10);
        while !self
            .store
            .compare_and_swap(LOCK_KEY, None, Some(&token), Some(LOCK_TTL))
            .await?
        {
            if tokio::time::Instant::now() + pause > deadline {
                return Err(ApiError::new(
                    Code::DeployBusy,
                    "another deployment change is in progress; try again",
                )
                .retry_after(1));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(200));
        }
        Ok(WriteLock {
            store: self.store.clone(),
            token,
            _local: local,
        })
    }

    /// Writes a change's batch with a new generation, then rebuilds the index.
    async fn commit(&self, mut ops: Vec<BatchOp>) -> DeployResult<()> {
        ops.push(BatchOp::Put(
            GENERATION_KEY.to_vec(),
            crate::util::random_bytes::<16>().to_vec(),
        ));
        self.store.apply_batch(ops).await?;
        self.reload().await
    }

    /// Rebuilds the index when the store's generation is not the one it was
    /// built from (another node changed a deployment). Returns whether it did.
    pub async fn follow(&self) -> DeployResult<bool> {
        let current = self.store.get(GENERATION_KEY).await?;
        if *self.loaded.lock() == current {
            return Ok(false);
        }
        self.reload().await?;
        Ok(true)
    }

    /// In a cluster: checks the generation every `every` for as long as the
    /// node runs.
    pub fn spawn_follower(self: &Arc<Self>, every: Duration) {
        let me = Arc::downgrade(self);
        actix_web::rt::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(me) = me.upgrade() else { return };
                match me.follow().await {
                    Ok(true) => {
                        tracing::info!("Deployments changed on another node; index rebuilt.")
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "Could not check the deployments' generation.")
                    }
                }
            }
        });
    }

    /// Rebuilds the index from the store (at start and after every change).
    pub async fn reload(&self) -> DeployResult<()> {
        // Read before the records: a change landing during the scan leaves
        // the old generation noted, so the next check rebuilds again.
        let generation = self.store.get(GENERATION_KEY).await?;
        let heads = self.store.scan_prefix(b"dep/", usize::MAX).await?;
        // Read before any host is classified: a name noted while this runs
        // leaves the index a generation behind, and `route` checks again.
        let mut ix = Index::default();
        ix.names_generation = self.own_names.generation();
        let mut live = BTreeSet::new();
        let mut live_buckets = BTreeSet::new();
        // Each deployment's routed hosts, for its certificate.
        let mut routed: HashMap<(String, String), Vec<String>> = HashMap::new();
        let mut auto_tls = Vec::new();
        // The deployments asking for `tls: "auto"`, routed hosts or not.
        let mut auto_keys: HashSet<(String, String)> = HashSet::new();
        for (_, v) in heads {
            let Ok(rec) = serde_json::from_slice::<DeploymentRecord>(&v) else {
                continue;
            };
            let Some(ver) = self
                .store
                .get_json::<DeploymentVersion>(&ver_key(&rec.namespace, &rec.name, rec.active))
                .await?
            else {
                continue;
            };
            let serve = match &ver.target {
                TargetSpec::Static { files, .. } => Serve::Static(Arc::new(files.clone())),
                TargetSpec::Upstream {
                    instances,
                    weights,
                    balance,
                    health,
                    compress,
                    pass_ambiguous_paths,
                    allow_underscore_headers,
                    grpc,
                } => {
                    let key = (rec.namespace.clone(), rec.name.clone(), ver.version);
                    live.insert(key.clone());
                    let pool = self
                        .pools
                        .lock()
                        .entry(key)
                        .or_insert_with(|| {
                            let p = Arc::new(
                                UpstreamPool::new(
                                    instances,
                                    self.egress.clone(),
                                    self.config.unhealthy_after_failures,
                                    Duration::from_secs(self.config.unhealthy_seconds),
                                )
                                .with_balancing(weights, balance, health.clone())
                                .with_compress(*compress)
                                .with_request_rules(
                                    *pass_ambiguous_paths,
                                    *allow_underscore_headers,
                                )
                                .with_grpc(*grpc),
                            );
                            // Its instances join the node's checks (shared ones once).
                            self.health.watch(&rec.namespace, &p);
                            p
                        })
                        .clone();
                    Serve::Upstream(pool)
                }
            };
            let key = (rec.namespace.clone(), rec.name.clone(), ver.version);
            let buckets = self
                .buckets
                .lock()
                .entry(key.clone())
                .or_insert_with(|| index::RouteBucket::for_routes(&ver.routes))
                .clone();
            live_buckets.insert(key);
            if ver.tls_auto {
                auto_keys.insert((rec.namespace.clone(), rec.name.clone()));
                let hosts: Vec<String> = ver
                    .hosts
                    .iter()
                    .filter(|h| self.reserved_host(h).is_none())
                    .cloned()
                    .collect();
                if !hosts.is_empty() {
                    auto_tls.push(acme::AutoTls {
                        namespace: rec.namespace.clone(),
                        deployment: rec.name.clone(),
                        hosts,
                    });
                }
            }
            routed.insert(
                (rec.namespace.clone(), rec.name.clone()),
                ver.hosts
                    .iter()
                    .filter(|h| self.reserved_host(h).is_none())
                    .cloned()
                    .collect(),
            );
            for (i, route) in ver.routes.iter().enumerate() {
                let bound = Arc::new(Bound {
                    namespace: rec.namespace.clone(),
                    deployment: rec.name.clone(),
                    version: ver.version,
                    route: route.clone(),
                    serve: serve.clone(),
                    bucket: buckets.get(i).cloned().flatten(),
                    observed: Default::default(),
                });
                for h in &ver.hosts {
                    if let Some(why) = self.reserved_host(h) {
                        // A claim stored before the host was reserved: kept,
                        // never routed (`route` checks again on every request).
                        tracing::warn!(namespace = %rec.namespace, deployment = %rec.name, host = %h, reason = %why, "A deployment claims a reserved host; it is not routed.");
                        continue;
                    }
                    ix.insert(h, bound.clone());
                }
            }
        }
        // A deleted or replaced deployment's checker stops now (requests
        // still holding its pool finish without it).
        self.pools.lock().retain(|k, p| {
            let keep = live.contains(k);
            if !keep {
                p.stop_checker();
            }
            keep
        });
        // A deleted or replaced version's buckets go with it.
        self.buckets.lock().retain(|k, _| live_buckets.contains(k));
        let (served, leaves) = self.load_certs(&routed).await?;
        let tls_index: HashMap<(String, String), certs::TlsSummary> = routed
            .into_keys()
            .map(|key| {
                let summary = certs::TlsSummary {
                    auto: auto_keys.contains(&key),
                    leaf: leaves.get(&key).copied(),
                };
                (key, summary)
            })
            .collect();
        self.acme_seen
            .lock()
            .retain(|k, _| tls_index.get(k).is_some_and(|t| t.auto));
        self.index.store(Arc::new(ix));
        self.certs.served.store(Arc::new(served));
        self.tls_index.store(Arc::new(tls_index));
        *self.auto_tls.lock() = auto_tls;
        *self.loaded.lock() = generation;
        Ok(())
    }

    /// The host → certificate map of the stored certificates: each
    /// deployment's certificate for those of its routed hosts it covers
    /// (a host added since it was uploaded gets the node's own pair); with
    /// each active deployment's leaf validity `(not_before, not_after)`.
    async fn load_certs(
        &self,
        routed: &HashMap<(String, String), Vec<String>>,
    ) -> DeployResult<(ServedMap, LeafValidity)> {
        let mut served = HashMap::new();
        let mut leaves = HashMap::new();
        let mut live = BTreeSet::new();
        for (k, v) in self
            .store
            .scan_prefix(certs::CERT_PREFIX, usize::MAX)
            .await?
        {
            let Ok(rec) = serde_json::from_slice::<certs::CertRecord>(&v) else {
                continue;
            };
            live.insert(k.clone());
            let Some(hosts) = routed.get(&(rec.namespace.clone(), rec.deployment.clone())) else {
                continue;
            };
            leaves.insert(
                (rec.namespace.clone(), rec.deployment.clone()),
                (rec.not_before, rec.not_after),
            );
            let Some(ck) = self.certs.open(&k, &v, &rec) else {
                continue;
            };
            for h in hosts {
                if certs::record_covers(&rec, h) {
                    served.insert(h.clone(), ck.clone());
                }
            }
        }
        self.certs.retain(&live);
        Ok((served, leaves))
    }

    /// Stops serving deployment certificates for hosts that became the
    /// node's own names since the map was built (a name on a reloaded node
    /// certificate, a cluster member's name): their handshakes get the
    /// node's pair at once, as their requests go to the node's API. Called
    /// after the node notes its names.
    pub fn drop_reserved_certs(&self) {
        let current = self.certs.served.load_full();
        if current.keys().all(|h| self.reserved_host(h).is_none()) {
            return;
        }
        let kept = current
            .iter()
            .filter(|(h, _)| self.reserved_host(h).is_none())
            .map(|(h, ck)| (h.clone(), ck.clone()))
            .collect();
        self.certs.served.store(Arc::new(kept));
    }

    /// Stores a deployment's certificate (replacing one it had) after
    /// [`certs::validate`] against the hosts of its active version, then
    /// serves it (on every node of a cluster, as they follow the generation).
    pub async fn put_certificate(
        &self,
        ns: &str,
        name: &str,
        cert_pem: &[u8],
        key_pem: &[u8],
    ) -> DeployResult<Value> {
        let _w = self.write_lock().await?;
        let rec = self.head(ns, name).await?;
        let ver = self.version(ns, name, rec.active).await?;
        let now = unix_now();
        let record = self
            .store_certificate(ns, name, &ver.hosts, cert_pem, key_pem, now, "uploaded")
            .await?;
        Ok(certs::view(&record, &ver.hosts, now as i64))
    }

    /// With the write lock held: [`certs::validate`] against `hosts`, the
    /// sealed record committed (the generation moves, so every node serves
    /// it), and logged as `how` it came.
    #[allow(clippy::too_many_arguments)]
    async fn store_certificate(
        &self,
        ns: &str,
        name: &str,
        hosts: &[String],
        cert_pem: &[u8],
        key_pem: &[u8],
        now: u64,
        how: &str,
    ) -> DeployResult<certs::CertRecord> {
        let valid = certs::validate(cert_pem, key_pem, hosts, now as i64)?;
        let record = self.certs.record(ns, name, valid, now);
        self.commit(vec![BatchOp::Put(
            certs::cert_key(ns, name),
            serde_json::to_vec(&record).expect("json"),
        )])
        .await?;
        tracing::info!(namespace = ns, deployment = %name, how, not_after = %certs::rfc3339(record.not_after), "Certificate stored.");
        Ok(record)
    }

    /// A deployment's certificate as shown (404 when it has none, unless
    /// its certificate is ordered by ACME: then its order's state, with the
    /// certificate once there is one).
    pub async fn certificate(&self, ns: &str, name: &str) -> DeployResult<Value> {
        let rec = self.head(ns, name).await?;
        let ver = self.version(ns, name, rec.active).await?;
        let now = unix_now() as i64;
        if !ver.tls_auto {
            let cert = self.cert_record(ns, name).await?;
            return Ok(certs::view(&cert, &ver.hosts, now));
        }
        let cert = self
            .store
            .get_json::<certs::CertRecord>(&certs::cert_key(ns, name))
            .await?;
        let state = self
            .store
            .get_json::<acme::AcmeState>(&acme::state_key(ns, name))
            .await?;
        let mut v = match &cert {
            Some(c) => certs::view(c, &ver.hosts, now),
            None => {
                json!({"deployment": name, "state": "none", "hosts": ver.hosts.iter().map(|h| json!({"host": h, "covered": false})).collect::<Vec<_>>()})
            }
        };
        v["acme"] = acme::view(state.as_ref(), cert.as_ref(), &ver.hosts, now);
        Ok(v)
    }

    /// Each active deployment's certificate summary, as of the last
    /// rebuild: read from memory (the dashboard samples it every tick).
    pub fn tls_summaries(&self) -> Arc<HashMap<(String, String), certs::TlsSummary>> {
        self.tls_index.load_full()
    }

    /// The ACME state of a `tls: "auto"` deployment as this node's checker
    /// last read or wrote it; None before its first pass.
    pub fn acme_seen(&self, ns: &str, name: &str) -> Option<acme::AcmeState> {
        self.acme_seen
            .lock()
            .get(&(ns.to_string(), name.to_string()))
            .cloned()
    }

    /// Notes a deployment's ACME state as read or written by the checker.
    pub(crate) fn note_acme(&self, ns: &str, name: &str, state: Option<&acme::AcmeState>) {
        let key = (ns.to_string(), name.to_string());
        let mut seen = self.acme_seen.lock();
        match state {
            Some(s) => {
                seen.insert(key, s.clone());
            }
            None => {
                seen.remove(&key);
            }
        }
    }

    /// The deployments with `tls: "auto"`, as of the last rebuild.
    pub fn auto_tls(&self) -> Vec<acme::AutoTls> {
        self.auto_tls.lock().clone()
    }

    /// Stores a certificate issued by ACME for a deployment with `tls:
    /// "auto"`, checked as an upload is (against the hosts of its active
    /// version, which must still ask for `auto`), then served as an
    /// uploaded one is.
    pub async fn store_issued(
        &self,
        ns: &str,
        name: &str,
        cert_pem: &[u8],
        key_pem: &[u8],
    ) -> DeployResult<certs::CertRecord> {
        let _w = self.write_lock().await?;
        let rec = self.head(ns, name).await?;
        let ver = self.version(ns, name, rec.active).await?;
        if !ver.tls_auto {
            return Err(ApiError::internal(format!(
                "deployment {name} no longer asks for tls \"auto\""
            )));
        }
        self.store_certificate(ns, name, &ver.hosts, cert_pem, key_pem, unix_now(), "acme")
            .await
    }

    async fn cert_record(&self, ns: &str, name: &str) -> DeployResult<certs::CertRecord> {
        self.store
            .get_json::<certs::CertRecord>(&certs::cert_key(ns, name))
            .await?
            .ok_or_else(|| {
                ApiError::new(
                    Code::CertificateNotFound,
                    format!("deployment {name} has no certificate"),
                )
            })
    }

    /// Removes a deployment's certificate: its hosts get the node's own pair.
    pub async fn delete_certificate(&self, ns: &str, name: &str) -> DeployResult<()> {
        let _w = self.write_lock().await?;
        self.head(ns, name).await?;
        self.cert_record(ns, name).await?;
        self.commit(vec![BatchOp::Delete(certs::cert_key(ns, name))])
            .await
    }

    /// Why a host may not be a deployment's, if it may not (see [`hosts`]).
    fn reserved_host(&self, host: &str) -> Option<hosts::Reserved> {
        self.own_names.classify(host)
    }

    /// The route taking `method path` on `host`. A reserved host (an address,
    /// one of the node's own names) never routes, even when a record stored
    /// before it was reserved claims it: its requests go to the node's API.
    pub fn route(&self, host: &str, method: &str, path: &str) -> Option<Arc<Bound>> {
        let ix = self.index.load();
        let bound = ix.lookup(host, method, path)?;
        // The index left out every host reserved when it was built; only a
        // name noted since needs the check.
        (ix.names_generation == self.own_names.generation() || self.reserved_host(host).is_none())
            .then_some(bound)
    }

    /// The namespace whose deployment `host` routes to (never a reserved host).
    pub fn host_namespace(&self, host: &str) -> Option<String> {
        let ix = self.index.load();
        let ns = ix.host_namespace(host)?;
        (ix.names_generation == self.own_names.generation() || self.reserved_host(host).is_none())
            .then(|| ns.to_string())
    }

    /// Creates a deployment, or a new version of it, and makes it serve.
    pub async fn create(
        &self,
        ns: &str,
        new: NewDeployment,
        limits: &Limits,
    ) -> DeployResult<Value> {
        // Where the upstream would connect, before anything is stored.
        self.check_egress(&new.target).await?;
        for h in &new.hosts {
            if let Some(why) = self.reserved_host(h) {
                return Err(hosts::refusal(h, &why));
            }
        }
        // A host already taken fails before any upload work.
        self.check_hosts(ns, &new.hosts).await?;
        // So does a quota it cannot fit (the exact check is under the lock):
        // a namespace at its quota leaves no blobs behind.
        {
            let head = self.store.get(&dep_key(ns, &new.name)).await?;
            let mut u = self.usage(ns).await?;
            u.apply(
                limits,
                &[
                    (Resource::Deployments, i64::from(head.is_none())),
                    (Resource::SiteBytes, site_bytes(&new.target) as i64),
                ],
            )?;
        }
        // Content-addressed blobs first, outside the lock (a large site must
        // not hold it near its time to live): a failure after this leaves
        // only unreferenced blobs, never a record pointing at missing bytes.
        // One file in memory at a time (at most `max_site_file_bytes`).
        // Each pinned until the version naming it is written: a blob sweep
        // in between would delete it (`storage/blob_ledger.rs`); dropped on
        // a failure, the pins go and so do the blobs, at the next sweep.
        let pins = crate::storage::blob_ledger::pin(
            &self.store,
            new.blobs.iter().map(|(sha, _)| sha.as_str()),
        )
        .await?;
        for (sha, path) in &new.blobs {
            let key = crate::storage::blob_key(sha);
            if self.store.get(&key).await?.is_none() {
                let bytes = tokio::fs::read(path).await.map_err(|e| {
                    ApiError::internal(format!("cannot read an unpacked site file: {e}"))
                })?;
                self.store.put(&key, &bytes).await?;
            }
        }
        let _w = self.write_lock().await?;
        // Again under the lock: this is the check that counts.
        self.check_hosts(ns, &new.hosts).await?;
        let now = unix_now();
        let head = self
            .store
            .get_json::<DeploymentRecord>(&dep_key(ns, &new.name))
            .await?;
        let version = head.as_ref().map_or(1, |h| h.latest + 1);
        let ver = DeploymentVersion {
            version,
            hosts: new.hosts.clone(),
            routes: new.routes,
            target: new.target,
            created_at: now,
            tls_auto: new.tls_auto,
        };
        let rec = DeploymentRecord {
            name: new.name.clone(),
            namespace: ns.to_string(),
            active: version,
            latest: version,
            created_at: head.as_ref().map_or(now, |h| h.created_at),
            updated_at: now,
        };
        let mut ops = vec![
            BatchOp::Put(
                ver_key(ns, &new.name, version),
                serde_json::to_vec(&ver).expect("json"),
            ),
            BatchOp::Put(
                dep_key(ns, &new.name),
                serde_json::to_vec(&rec).expect("json"),
            ),
        ];
        let (host_ops, hosts) = self
            .host_ops(ns, Some((&new.name, &new.hosts)), None)
            .await?;
        ops.extend(host_ops);
        let mut u = self.usage(ns).await?;
        let hosts_delta = hosts as i64 - u.get(Resource::Hosts) as i64;
        u.apply(
            limits,
            &[
                (Resource::Deployments, i64::from(head.is_none())),
                (Resource::Hosts, hosts_delta),
                (Resource::SiteBytes, site_bytes(&ver.target) as i64),
            ],
        )?;
        ops.push(BatchOp::Put(usage_key(ns, Group::Deployments), u.encode()));
        self.commit(ops).await?;
        pins.release().await;
        tracing::info!(namespace = ns, deployment = %new.name, version, "Deployment created.");
        Ok(view(&rec, &ver, None))
    }

    /// Refuses upstream instances the egress policy forbids (400
    /// `UPSTREAM_FORBIDDEN`): each literal address, each address a name
    /// resolves to now.
    async fn check_egress(&self, target: &TargetSpec) -> DeployResult<()> {
        if let TargetSpec::Upstream { instances, .. } = target {
            for base in instances {
                self.egress.check_instance(base).await?;
            }
        }
        Ok(())
    }

    /// Refuses hosts owned by another namespace (409).
    async fn check_hosts(&self, ns: &str, hosts: &[String]) -> DeployResult<()> {
        for h in hosts {
            if let Some(c) = self.store.get_json::<HostClaim>(&host_key(h)).await?
                && c.namespace != ns
            {
                return Err(ApiError::new(
                    Code::HostTaken,
                    format!("host {h} belongs to another namespace"),
                ));
            }
        }
        Ok(())
    }

    /// The host-claim writes that make the namespace own exactly the hosts its
    /// deployments use after a change: `changed` replaces one deployment's
    /// hosts, `removed` drops one deployment. With them, how many hosts the
    /// namespace then claims.
    async fn host_ops(
        &self,
        ns: &str,
        changed: Option<(&str, &[String])>,
        removed: Option<&str>,
    ) -> DeployResult<(Vec<BatchOp>, usize)> {
        let mut used = BTreeSet::new();
        let mut owned = BTreeSet::new();
        for (_, v) in self.store.scan_prefix(&dep_prefix(ns), usize::MAX).await? {
            let Ok(rec) = serde_json::from_slice::<DeploymentRecord>(&v) else {
                continue;
            };
            let hosts = self
                .store
                .get_json::<DeploymentVersion>(&ver_key(ns, &rec.name, rec.active))
                .await?
                .map(|v| v.hosts)
                .unwrap_or_default();
            owned.extend(hosts.iter().cloned());
            if Some(rec.name.as_str()) == removed || changed.is_some_and(|(n, _)| n == rec.name) {
                continue;
            }
            used.extend(hosts);
        }
        if let Some((_, hosts)) = changed {
            used.extend(hosts.iter().cloned());
        }
        let claim = serde_json::to_vec(&HostClaim {
            namespace: ns.to_string(),
        })
        .expect("json");
        let mut ops: Vec<BatchOp> = used
            .iter()
            .filter(|h| !owned.contains(*h))
            .map(|h| BatchOp::Put(host_key(h), claim.clone()))
            .collect();
        ops.extend(
            owned
                .iter()
                .filter(|h| !used.contains(*h))
                .map(|h| BatchOp::Delete(host_key(h))),
        );
        Ok((ops, used.len()))
    }

    /// The namespace's deployment usage record (`usage/<ns>/dep`), counted
    /// from its deployments when it is missing (a namespace from before
    /// quotas). Read under the deployment lock for a change: every writer
    /// of the record holds it, so the count the change writes back is exact.
    pub async fn usage(&self, ns: &str) -> DeployResult<Usage> {
        let key = usage_key(ns, Group::Deployments);
        if let Some(u) = Usage::decode(self.store.get(&key).await?.as_deref()) {
            return Ok(u);
        }
        let u = usage_of(&self.store, ns).await?;
        crate::quota::store_if_missing(&self.store, ns, Group::Deployments, &u).await?;
        Ok(u)
    }

    async fn head(&self, ns: &str, name: &str) -> DeployResult<DeploymentRecord> {
        self.store
            .get_json::<DeploymentRecord>(&dep_key(ns, name))
            .await?
            .ok_or_else(|| {
                ApiError::new(
                    Code::DeploymentNotFound,
                    format!("no deployment named {name}"),
                )
            })
    }

    async fn version(&self, ns: &str, name: &str, v: u64) -> DeployResult<DeploymentVersion> {
        self.store
            .get_json::<DeploymentVersion>(&ver_key(ns, name, v))
            .await?
            .ok_or_else(|| {
                ApiError::new(
                    Code::VersionNotFound,
                    format!("deployment {name} has no version {v}"),
                )
            })
    }

    /// One page of the namespace's deployments with their active versions,
    /// by name: those named strictly after `after` (None: from the first),
    /// at most `limit`, and the name the next page resumes after (None on
    /// the last page).
    pub async fn list(
        &self,
        ns: &str,
        after: Option<&[u8]>,
        limit: usize,
    ) -> DeployResult<(Vec<Value>, Option<Vec<u8>>)> {
        let prefix = dep_prefix(ns);
        let after = after.map(|a| [prefix.as_slice(), a].concat());
        let (rows, last) = self
            .store
            .scan_page(&prefix, after.as_deref(), limit)
            .await?;
        let mut out = Vec::new();
        for (_, v) in rows {
            let Ok(rec) = serde_json::from_slice::<DeploymentRecord>(&v) else {
                continue;
            };
            if let Ok(ver) = self.version(ns, &rec.name, rec.active).await {
                out.push(view(&rec, &ver, None));
            }
        }
        Ok((out, last.map(|k| k[prefix.len()..].to_vec())))
    }

    /// Every live upstream instance's state, for `/metrics`.
    pub fn upstream_samples(&self) -> Vec<crate::metrics::UpstreamSample> {
        let pools: Vec<_> = self
            .pools
            .lock()
            .iter()
            .map(|((ns, name, _), p)| (ns.clone(), name.clone(), p.clone()))
            .collect();
        let mut out = Vec::new();
        for (ns, name, p) in pools {
            for s in p.states() {
                out.push(crate::metrics::UpstreamSample {
                    namespace: ns.clone(),
                    deployment: name.clone(),
                    instance: s.url,
                    healthy: s.healthy,
                    in_flight: s.in_flight,
                    weight: s.weight,
                });
            }
        }
        out
    }

    /// One deployment, with the live health of its upstream instances.
    pub async fn show(&self, ns: &str, name: &str) -> DeployResult<Value> {
        let rec = self.head(ns, name).await?;
        let ver = self.version(ns, name, rec.active).await?;
        let pool = self
            .pools
            .lock()
            .get(&(ns.to_string(), name.to_string(), rec.active))
            .cloned();
        Ok(view(&rec, &ver, pool.as_deref()))
    }

    /// Every version of a deployment, oldest first.
    pub async fn versions(&self, ns: &str, name: &str) -> DeployResult<Vec<Value>> {
        let rec = self.head(ns, name).await?;
        let mut out = Vec::new();
        for (_, v) in self
            .store
            .scan_prefix(&ver_prefix(ns, name), usize::MAX)
            .await?
        {
            if let Ok(ver) = serde_json::from_slice::<DeploymentVersion>(&v) {
                out.push(json!({
                    "version": ver.version,
                    "active": ver.version == rec.active,
                    "hosts": ver.hosts,
                    "kind": kind_name(&ver.target),
                    "created_at": ver.created_at,
                }));
            }
        }
        Ok(out)
    }

    /// Makes an earlier version serve again (`None`: the one before the active one).
    pub async fn rollback(&self, ns: &str, name: &str, to: Option<u64>) -> DeployResult<Value> {
        let _w = self.write_lock().await?;
        let mut rec = self.head(ns, name).await?;
        let target = match to {
            Some(v) => v,
            None => {
                let mut earlier = None;
                for (_, v) in self
                    .store
                    .scan_prefix(&ver_prefix(ns, name), usize::MAX)
                    .await?
                {
                    if let Ok(ver) = serde_json::from_slice::<DeploymentVersion>(&v)
                        && ver.version < rec.active
                    {
                        earlier = Some(ver.version);
                    }
                }
                earlier.ok_or_else(|| {
                    ApiError::new(
                        Code::NoEarlierVersion,
                        format!("deployment {name} has no version before {}", rec.active),
                    )
                })?
            }
        };
        let ver = self.version(ns, name, target).await?;
        self.check_egress(&ver.target).await?;
        // A version stored before its host was reserved is not made to serve again.
        if let Some((h, why)) = ver
            .hosts
            .iter()
            .find_map(|h| Some((h, self.reserved_host(h)?)))
        {
            return Err(hosts::refusal(h, &why));
        }
        self.check_hosts(ns, &ver.hosts).await?;
        rec.active = target;
        rec.updated_at = unix_now();
        let mut ops = vec![BatchOp::Put(
            dep_key(ns, name),
            serde_json::to_vec(&rec).expect("json"),
        )];
        let (host_ops, hosts) = self.host_ops(ns, Some((name, &ver.hosts)), None).await?;
        ops.extend(host_ops);
        let mut u = self.usage(ns).await?;
        u.set(Resource::Hosts, hosts as u64);
        ops.push(BatchOp::Put(usage_key(ns, Group::Deployments), u.encode()));
        self.commit(ops).await?;
        tracing::info!(
            namespace = ns,
            deployment = name,
            version = target,
            "Deployment rolled back."
        );
        Ok(view(&rec, &ver, None))
    }

    /// Deletes a deployment, its versions and the host claims no other deployment uses.
    pub async fn delete(&self, ns: &str, name: &str) -> DeployResult<()> {
        let _w = self.write_lock().await?;
        self.head(ns, name).await?;
        let (mut ops, hosts) = self.host_ops(ns, None, Some(name)).await?;
        ops.push(BatchOp::Delete(dep_key(ns, name)));
        ops.push(BatchOp::Delete(certs::cert_key(ns, name)));
        ops.push(BatchOp::Delete(acme::state_key(ns, name)));
        let mut bytes = 0u64;
        for (k, v) in self
            .store
            .scan_prefix(&ver_prefix(ns, name), usize::MAX)
            .await?
        {
            if let Ok(ver) = serde_json::from_slice::<DeploymentVersion>(&v) {
                bytes += site_bytes(&ver.target);
            }
            ops.push(BatchOp::Delete(k));
        }
        let mut u = self.usage(ns).await?;
        u.set(Resource::Hosts, hosts as u64);
        u.set(
            Resource::Deployments,
            u.get(Resource::Deployments).saturating_sub(1),
        );
        u.set(
            Resource::SiteBytes,
            u.get(Resource::SiteBytes).saturating_sub(bytes),
        );
        ops.push(BatchOp::Put(usage_key(ns, Group::Deployments), u.encode()));
        self.commit(ops).await
    }

    /// Deletes every deployment of a namespace (the namespace is being deleted).
    pub async fn delete_namespace(&self, ns: &str) -> DeployResult<()> {
        let names: Vec<String> = self
            .store
            .scan_prefix(&dep_prefix(ns), usize::MAX)
            .await?
            .into_iter()
            .filter_map(|(_, v)| serde_json::from_slice::<DeploymentRecord>(&v).ok())
            .map(|r| r.name)
            .collect();
        for n in names {
            self.delete(ns, &n).await?;
        }
        Ok(())
    }
}

/// The unpacked bytes of a static site (0 for upstreams): what it counts
/// against `site_bytes`.
pub fn site_bytes(t: &TargetSpec) -> u64 {
    match t {
        TargetSpec::Static { total_bytes, .. } => *total_bytes,
        TargetSpec::Upstream { .. } => 0,
    }
}

/// What a namespace's deployments count, read from their records: how
/// many, the hosts their active versions claim, and the site bytes of every
/// kept version. For a usage record that is missing.
pub async fn usage_of(store: &Store, ns: &str) -> crate::storage::StoreResult<Usage> {
    let mut deployments = 0u64;
    let mut hosts = BTreeSet::new();
    for (_, v) in store.scan_all(&dep_prefix(ns)).await? {
        let Ok(rec) = serde_json::from_slice::<DeploymentRecord>(&v) else {
            continue;
        };
        deployments += 1;
        if let Some(ver) = store
            .get_json::<DeploymentVersion>(&ver_key(ns, &rec.name, rec.active))
            .await?
        {
            hosts.extend(ver.hosts);
        }
    }
    let mut bytes = 0u64;
    for (_, v) in store.scan_all(format!("depv/{ns}/").as_bytes()).await? {
        if let Ok(ver) = serde_json::from_slice::<DeploymentVersion>(&v) {
            bytes += site_bytes(&ver.target);
        }
    }
    let mut u = Usage::default();
    u.set(Resource::Deployments, deployments);
    u.set(Resource::Hosts, hosts.len() as u64);
    u.set(Resource::SiteBytes, bytes);
    Ok(u)
}

fn kind_name(t: &TargetSpec) -> &'static str {
    match t {
        TargetSpec::Static { .. } => "static",
        TargetSpec::Upstream { .. } => "upstream",
    }
}

/// The JSON shape of a deployment.
fn view(rec: &DeploymentRecord, ver: &DeploymentVersion, pool: Option<&UpstreamPool>) -> Value {
    let target = match &ver.target {
        TargetSpec::Static { files, total_bytes } => json!({
            "kind": "static",
            "files": files.len(),
            "total_bytes": total_bytes,
        }),
        TargetSpec::Upstream {
            instances,
            weights,
            balance,
            health,
            compress,
            pass_ambiguous_paths,
            allow_underscore_headers,
            grpc,
        } => {
            let states: Vec<Value> = match pool {
                Some(p) => p
                    .states()
                    .into_iter()
                    .map(|s| {
                        json!({
                            "url": s.url,
                            "weight": s.weight,
                            "healthy": s.healthy,
                            "consecutive_failures": s.failures,
                            "in_flight": s.in_flight,
                            "check": s.check.map(|c| json!({
                                "healthy": c.healthy,
                                "consecutive_passes": c.passes,
                                "consecutive_failures": c.failures,
                                "last_check_ms": (c.last_ms != 0).then_some(c.last_ms),
                                "last_status": (c.last_status != 0).then_some(c.last_status),
                            })),
                        })
                    })
                    .collect(),
                None => instances
                    .iter()
                    .enumerate()
                    .map(|(i, u)| json!({"url": u, "weight": weights.get(i).copied().unwrap_or(1)}))
                    .collect(),
            };
            let mut v = json!({"kind": "upstream", "instances": states, "balance": balance, "health": health, "compress": compress,
                "pass_ambiguous_paths": pass_ambiguous_paths, "allow_underscore_headers": allow_underscore_headers});
            if let Some(g) = grpc {
                v["grpc"] = json!(g);
            }
            v
        }
    };
    json!({
        "name": rec.name,
        "namespace": rec.namespace,
        "version": rec.active,
        "latest_version": rec.latest,
        "hosts": ver.hosts,
        "routes": ver.routes,
        "target": target,
        "tls": if ver.tls_auto { json!("auto") } else { Value::Null },
        "created_at": rec.created_at,
        "updated_at": rec.updated_at,
    })
}

#[cfg(test)]
mod tests {
    /// The default quotas, for deployments made by these tests.
    fn limits() -> crate::quota::Limits {
        crate::quota::Limits::of(&Default::default(), &Default::default())
    }

    use super::*;

    /// Two nodes' deployment services on one store.
    fn two_nodes() -> (tempfile::TempDir, Arc<Deployments>, Arc<Deployments>) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        let node = || {
            Arc::new(Deployments::new(
                store.clone(),
                DeployConfig {
                    upstream_allow: vec!["127.0.0.0/8".into()],
                    ..DeployConfig::default()
                },
                "gateway.test".into(),
                &[7u8; 32],
            ))
        };
        (dir, node(), node())
    }

    fn upstream(name: &str, host: &str) -> NewDeployment {
        NewDeployment {
            name: name.into(),
            hosts: vec![host.into()],
            routes: vec![RouteSpec::everything()],
            target: TargetSpec::Upstream {
                instances: vec!["http://127.0.0.1:9".into()],
                weights: vec![],
                balance: Default::default(),
                health: None,
                compress: true,
                pass_ambiguous_paths: false,
                allow_underscore_headers: false,
                grpc: None,
            },
            blobs: Vec::new(),
            tls_auto: false,
        }
    }

    /// Eight namespaces racing for one host through two nodes: one wins,
    /// seven get 409 `HOST_TAKEN`, and the claim names the winner.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn racing_claims_through_two_nodes_have_one_winner() {
        let (_d, a, b) = two_nodes();
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let node = if i % 2 == 0 { a.clone() } else { b.clone() };
                tokio::spawn(async move {
                    let ns = format!("ns{i}");
                    (
                        ns.clone(),
                        node.create(&ns, upstream("site", "race.test"), &limits())
                            .await,
                    )
                })
            })
            .collect();
        let mut winners = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                (ns, Ok(_)) => winners.push(ns),
                (_, Err(e)) => assert_eq!(e.code, "HOST_TAKEN", "{e}"),
            }
        }
        assert_eq!(winners.len(), 1, "{winners:?}");
        let claim: HostClaim = a
            .store
            .get_json(&host_key("race.test"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(claim.namespace, winners[0]);
        // The lock is released once the changes are done.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(a.store.get(LOCK_KEY).await.unwrap(), None);
    }

    /// A change made through one node reaches the other's index by `follow`,
    /// which rebuilds only when the generation moved.
    #[tokio::test]
    async fn follow_rebuilds_only_after_a_change_elsewhere() {
        let (_d, a, b) = two_nodes();
        b.reload().await.unwrap();
        assert!(!b.follow().await.unwrap());
        a.create("n", upstream("site", "www.test"), &limits())
            .await
            .unwrap();
        assert!(a.index().host_namespace("www.test").is_some());
        assert!(b.index().host_namespace("www.test").is_none());
        assert!(b.follow().await.unwrap());
        assert_eq!(b.index().host_namespace("www.test"), Some("n"));
        assert!(!b.follow().await.unwrap());
        a.delete("n", "site").await.unwrap();
        assert!(b.follow().await.unwrap());
        assert!(b.index().host_namespace("www.test").is_none());
    }

    /// A certificate stored through one node is served by the other once it
    /// follows the generation (a cluster's nodes share the store), for the
    /// hosts it covers only; removed with the deployment on both.
    #[tokio::test]
    async fn a_certificate_put_through_one_node_is_served_by_the_other() {
        let (_d, a, b) = two_nodes();
        let mut new = upstream("site", "www.test");
        new.hosts.push("api.test".into());
        a.create("n", new, &limits()).await.unwrap();
        b.follow().await.unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["www.test".into(), "api.test".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let shown = a
            .put_certificate(
                "n",
                "site",
                cert.pem().as_bytes(),
                key.serialize_pem().as_bytes(),
            )
            .await
            .unwrap();
        assert_eq!(shown["state"], "active", "{shown}");
        assert!(b.certs.served.load().is_empty());
        assert!(b.follow().await.unwrap());
        let served = b.certs.served.load_full();
        let leaf = |h: &str| served.get(h).map(|ck| ck.cert[0].as_ref().to_vec());
        assert_eq!(leaf("www.test").as_deref(), Some(cert.der().as_ref()));
        assert_eq!(leaf("api.test").as_deref(), Some(cert.der().as_ref()));
        assert_eq!(served.len(), 2);
        // The stored record holds the key sealed: its DER is not in it.
        let raw = a
            .store
            .get(&certs::cert_key("n", "site"))
            .await
            .unwrap()
            .unwrap();
        let der = key.serialize_der();
        assert!(!raw.windows(32).any(|w| w == &der[der.len() - 32..]));
        // A host that becomes one of the node's own names gets the node's
        // pair at once, before any rebuild.
        b.own_names
            .note("api.test", "a DNS name on this node's TLS certificate");
        b.drop_reserved_certs();
        let served = b.certs.served.load_full();
        assert!(served.contains_key("www.test") && !served.contains_key("api.test"));
        a.delete("n", "site").await.unwrap();
        assert!(b.follow().await.unwrap());
        assert!(b.certs.served.load().is_empty());
        assert!(
            a.store
                .get(&certs::cert_key("n", "site"))
                .await
                .unwrap()
                .is_none()
        );
    }

    /// Rolling back checks the egress policy again: a node whose policy
    /// forbids the old version's upstream refuses with 400
    /// `UPSTREAM_FORBIDDEN` and the active version stays; its create refuses
    /// the same upstream and stores nothing.
    #[tokio::test]
    async fn rollback_and_create_check_the_egress_policy() {
        let (_d, open, _) = two_nodes();
        let strict = Deployments::new(
            open.store.clone(),
            DeployConfig::default(),
            "gateway.test".into(),
            &[7u8; 32],
        );
        open.create("n", upstream("site", "www.test"), &limits())
            .await
            .unwrap();
        let mut v2 = upstream("site", "www.test");
        v2.target = TargetSpec::Upstream {
            weights: vec![],
            balance: Default::default(),
            health: None,
            compress: true,
            pass_ambiguous_paths: false,
            allow_underscore_headers: false,
            grpc: None,
            instances: vec!["http://203.0.113.7:80".into()],
        };
        open.create("n", v2, &limits()).await.unwrap();
        let e = strict.rollback("n", "site", Some(1)).await.unwrap_err();
        assert_eq!(e.code, "UPSTREAM_FORBIDDEN", "{e}");
        assert!(e.message.contains("127.0.0.1:9"), "{e}");
        assert_eq!(strict.head("n", "site").await.unwrap().active, 2);
        let e = strict
            .create("m", upstream("other", "other.test"), &limits())
            .await
            .unwrap_err();
        assert_eq!(e.code, "UPSTREAM_FORBIDDEN", "{e}");
        assert!(strict.list("m", None, 10).await.unwrap().0.is_empty());
        assert!(
            strict
                .store
                .get(&host_key("other.test"))
                .await
                .unwrap()
                .is_none()
        );
        open.rollback("n", "site", Some(1)).await.unwrap();
    }

    /// Reserved hosts are refused at create with 400 `HOST_RESERVED`, and
    /// nothing is stored; a record stored before they were reserved (written
    /// here straight into the store) keeps its ordinary host routed, but its
    /// address, localhost and own-name hosts never route, nor a name the
    /// cluster registry makes one of the node's own later.
    #[tokio::test]
    async fn reserved_hosts_are_refused_and_never_routed() {
        let (_d, a, _) = two_nodes();
        a.own_names
            .note("node-a.internal", "this node's advertise name");
        for h in [
            "127.0.0.1",
            "localhost",
            "app.localhost",
            "intranet",
            "gateway.test",
            "ns-bank.gateway.test",
            "x.ns-bank.gateway.test",
            "www.gateway.test",
            "localhost6.localdomain6",
            "node-a.internal",
        ] {
            let e = a
                .create("mallory", upstream("site", h), &limits())
                .await
                .unwrap_err();
            assert_eq!(e.code, "HOST_RESERVED", "{h}: {e}");
            assert!(a.store.get(&host_key(h)).await.unwrap().is_none(), "{h}");
        }
        assert!(a.list("mallory", None, 10).await.unwrap().0.is_empty());
        // An old record claiming reserved hosts beside an ordinary one.
        let hosts: Vec<String> = [
            "legacy.test",
            "127.0.0.1",
            "[::1]",
            "localhost",
            "node-a.internal",
            "node-b.internal",
            "x.ns-bank.gateway.test",
            "localhost4.localdomain4",
            "cert.example",
            "a.wild.example",
        ]
        .map(String::from)
        .to_vec();
        let ver = DeploymentVersion {
            version: 1,
            hosts: hosts.clone(),
            routes: vec![RouteSpec::everything()],
            target: TargetSpec::Upstream {
                instances: vec!["http://127.0.0.1:9".into()],
                weights: vec![],
                balance: Default::default(),
                health: None,
                compress: true,
                pass_ambiguous_paths: false,
                allow_underscore_headers: false,
                grpc: None,
            },
            created_at: 0,
            tls_auto: false,
        };
        let rec = DeploymentRecord {
            name: "old".into(),
            namespace: "mallory".into(),
            active: 1,
            latest: 1,
            created_at: 0,
            updated_at: 0,
        };
        let claim = serde_json::to_vec(&HostClaim {
            namespace: "mallory".into(),
        })
        .unwrap();
        let mut ops = vec![
            BatchOp::Put(
                ver_key("mallory", "old", 1),
                serde_json::to_vec(&ver).unwrap(),
            ),
            BatchOp::Put(dep_key("mallory", "old"), serde_json::to_vec(&rec).unwrap()),
        ];
        ops.extend(
            hosts
                .iter()
                .map(|h| BatchOp::Put(host_key(h), claim.clone())),
        );
        a.store.apply_batch(ops).await.unwrap();
        a.reload().await.unwrap();
        assert_eq!(a.host_namespace("legacy.test").as_deref(), Some("mallory"));
        assert!(a.route("legacy.test", "GET", "/").is_some());
        assert_eq!(
            a.host_namespace("node-b.internal").as_deref(),
            Some("mallory")
        );
        for h in [
            "127.0.0.1",
            "[::1]",
            "localhost",
            "node-a.internal",
            "x.ns-bank.gateway.test",
            "localhost4.localdomain4",
        ] {
            assert_eq!(a.host_namespace(h), None, "{h}");
            assert!(a.route(h, "GET", "/").is_none(), "{h}");
        }
        // A reloaded TLS certificate's names (one a wildcard): from then on
        // they never route.
        assert!(a.route("cert.example", "GET", "/").is_some());
        assert!(a.route("a.wild.example", "GET", "/").is_some());
        for n in ["cert.example", "*.wild.example"] {
            a.own_names
                .note(n, "a DNS name on this node's TLS certificate");
        }
        for h in ["cert.example", "a.wild.example"] {
            assert_eq!(a.host_namespace(h), None, "{h}");
            assert!(a.route(h, "GET", "/").is_none(), "{h}");
        }
        // node-b.internal becomes a member's name: from then on it never routes.
        a.own_names.set_members([(
            "node-b.internal".to_string(),
            "the advertise name of cluster member b".to_string(),
        )]);
        assert_eq!(a.host_namespace("node-b.internal"), None);
        assert!(a.route("node-b.internal", "GET", "/").is_none());
        assert!(a.route("legacy.test", "GET", "/").is_some());
        // Rolling back to a version that claims reserved hosts is refused.
        a.create("mallory", upstream("old", "new.test"), &limits())
            .await
            .unwrap();
        let e = a.rollback("mallory", "old", Some(1)).await.unwrap_err();
        assert_eq!(e.code, "HOST_RESERVED", "{e}");
        assert_eq!(a.head("mallory", "old").await.unwrap().active, 2);
    }

    /// A lock left by a holder that died is taken once it expires.
    #[tokio::test]
    async fn a_dead_holders_lock_expires() {
        let (_d, a, _) = two_nodes();
        a.store
            .compare_and_swap(
                LOCK_KEY,
                None,
                Some(b"dead"),
                Some(Duration::from_millis(300)),
            )
            .await
            .unwrap();
        let t0 = std::time::Instant::now();
        a.create("n", upstream("site", "www.test"), &limits())
            .await
            .unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(250));
    }

    /// The unpack slots as a pair: with one slot, a second deploy waits
    /// (obeyed: it gets the slot once the first frees it) and, while the
    /// slot stays taken past `unpack_wait_ms`, is refused with 503
    /// `UNPACK_BUSY` and a `Retry-After` (violated).
    #[tokio::test]
    async fn unpack_slots_obeyed_and_violated() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        let d = Arc::new(Deployments::new(
            store,
            DeployConfig {
                unpack_concurrency: 1,
                unpack_wait_ms: 50,
                ..DeployConfig::default()
            },
            "gateway.test".into(),
            &[7u8; 32],
        ));
        let first = d.unpack_slot().await.unwrap();
        let e = d.unpack_slot().await.unwrap_err();
        assert_eq!(e.code, "UNPACK_BUSY", "{e}");
        assert_eq!(e.code.status(), 503);
        assert_eq!(e.retry_after, Some(1));
        let d2 = d.clone();
        let waiter = tokio::spawn(async move { d2.unpack_slot().await.map(drop) });
        tokio::task::yield_now().await;
        drop(first);
        assert!(waiter.await.unwrap().is_ok());
    }
}
