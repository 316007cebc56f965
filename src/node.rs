//! The node: what one `meshgate serve` process holds, its start-up and its drain.

#![forbid(unsafe_code)]

use crate::actors::{ActorDirectory, Namespaces, NodeSupervisor};
use crate::config::Config;
/// The request log's writer, installed by the command line at start-up.
pub use crate::http::access_log::install as install_request_log;
pub use crate::http::state::{Node, NodeInner, Phase, Secrets};
use crate::metrics::Metrics;
use crate::storage::{Store, StoreError};
pub use crate::util::{hmac, hostname, num_cpus, random_bytes};
use actix::Actor;
use anyhow::Context as _;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicU8;
use std::time::Duration;

/// Writes a file readable by the owner only.
pub fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(data)?;
    f.sync_all()
}

fn load_secrets(
    data_dir: &Path,
    operator_env: Option<String>,
    shared_secret: Option<Vec<u8>>,
) -> anyhow::Result<Secrets> {
    let secret_path = data_dir.join("server.secret");
    let server_secret = match std::fs::read(&secret_path) {
        _ if shared_secret.is_some() => shared_secret.expect("checked"),
        Ok(b) if b.len() == 32 => b,
        Ok(_) => anyhow::bail!("{} is damaged (expected 32 bytes)", secret_path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let b = random_bytes::<32>().to_vec();
            write_private(&secret_path, &b)
                .with_context(|| format!("cannot write {}", secret_path.display()))?;
            b
        }
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", secret_path.display())),
    };
    let key_path = data_dir.join("operator.key");
    let operator_key = match operator_env.filter(|k| !k.is_empty()) {
        Some(k) => k,
        None => match std::fs::read_to_string(&key_path) {
            Ok(k) => k.trim().to_string(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let k = format!("mgop_{}", hex::encode(random_bytes::<32>()));
                write_private(&key_path, k.as_bytes())
                    .with_context(|| format!("cannot write {}", key_path.display()))?;
                // Printed once, on first start only.
                eprintln!("operator key (also in {}): {k}", key_path.display());
                k
            }
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", key_path.display())),
        },
    };
    Ok(Secrets::new(server_secret, &operator_key))
}

/// A started node: its bound address and the server, until it is stopped.
pub struct RunningNode {
    /// The address the listener bound (the real port when `server.listen` asked for 0).
    pub addr: SocketAddr,
    /// The node's shared handle, as its handlers see it.
    pub node: Node,
    /// The server future, taken and spawned by [`RunningNode::run_until_signal`].
    server: Option<actix_web::dev::Server>,
    /// Stops the server gracefully at the end of [`RunningNode::drain`].
    handle: actix_web::dev::ServerHandle,
    /// The `[metrics] listen` listener's address, when it is set.
    pub metrics_addr: Option<SocketAddr>,
    /// The `[grpc] listen` listener's address, when it is set.
    pub grpc_addr: Option<SocketAddr>,
    /// That listener's server (taken by `run_until_signal`) and its handle.
    metrics_server: Option<(actix_web::dev::Server, actix_web::dev::ServerHandle)>,
}

/// Binds the listeners, opens the store, starts the actors. Must run inside an actix System.
pub async fn start(config: Config) -> anyhow::Result<RunningNode> {
    // First: an address another process holds ends the start before
    // anything is opened, written or spawned, so there is nothing to undo
    // (a task a failed start leaves behind must not outlive the runtime:
    // `cli::serve`).
    let crate::http::Bound {
        api: api_socket,
        metrics: metrics_socket,
        grpc: grpc_socket,
        acme_http: acme_http_socket,
    } = crate::http::bind(&config)?;
    let data_dir = config.server.data_dir.clone();
    if crate::telemetry::install(&config.telemetry.settings()).map_err(anyhow::Error::msg)? {
        tracing::info!(endpoint = %config.telemetry.otlp_endpoint, "Exporting spans over OTLP.");
    }
    let hop_secret = read_cluster_secret(&config)?;
    let cluster_mode = !config.cluster.etcd.is_empty();
    let store = open_store(&config).await?;
    if cluster_mode && hop_secret.is_none() {
        // Checked before anything is written to the shared store: without the
        // shared secret the node can neither seal what it keeps under
        // `_cluster/` nor open it.
        anyhow::bail!(
            "cluster mode ([cluster] etcd) needs the shared cluster secret: set [cluster] secret_file or MESHGATE_CLUSTER_SECRET"
        );
    }
    let operator_env = std::env::var("MESHGATE_OPERATOR_KEY").ok();
    let mut secrets = load_secrets(&data_dir, operator_env.clone(), None)?;
    let mut jwt = crate::auth::JwtKeys::load_or_generate(&data_dir.join("jwt.key"))
        .map_err(|e| anyhow::anyhow!("cannot load the JWT signing key: {e}"))?;
    if let (true, Some(cluster_secret)) = (cluster_mode, hop_secret.as_deref()) {
        // One gateway: every node adopts the first node's server secret and JWT
        // key from the shared store, so keys and tokens verify on any node.
        // Both are sealed there under the cluster secret.
        let seal = crate::storage::SealKey::derive(cluster_secret);
        // A clear record is an older version's only in a store whose records
        // never carried MACs, and only with the operator's consent: a store
        // writer can strip every MAC and delete the marker, and its own
        // clear key would be adopted; after that it is a store writer's key.
        let older = config.server.adopt_store_records
            && !store
                .records_macd(&crate::storage::RecordMac::derive(cluster_secret))
                .await
                .map_err(|e| anyhow::anyhow!("cannot check the store's record MACs: {e}"))?;
        let shared = adopt_sealed_secret(
            &store,
            &seal,
            SHARED_SERVER_SECRET,
            &secrets.server_secret,
            // An older version's clear record: the raw 32 bytes.
            |r| older && r.len() == 32,
        )
        .await?;
        if shared != secrets.server_secret {
            secrets = load_secrets(&data_dir, operator_env, Some(shared))?;
        }
        let local = std::fs::read(data_dir.join("jwt.key"))
            .with_context(|| "cannot read the JWT signing key")?;
        // An older version's clear record: PKCS#8 DER, a SEQUENCE (0x30).
        let shared = adopt_sealed_secret(&store, &seal, SHARED_JWT_KEY, &local, |r| {
            older && r.first() == Some(&0x30)
        })
        .await?;
        jwt = crate::auth::JwtKeys::from_pkcs8(&shared)
            .map_err(|e| anyhow::anyhow!("the cluster's JWT key is damaged: {e}"))?;
    }
    // Every record carries a MAC from here on (storage/record_mac.rs): under
    // the cluster secret in a cluster (whoever writes etcd does not hold
    // it), under the server secret on a single node.
    let mac_root = match (cluster_mode, hop_secret.as_deref()) {
        (true, Some(cluster_secret)) => cluster_secret,
        _ => secrets.server_secret.as_slice(),
    };
    let macs = store
        .adopt_record_macs(
            crate::storage::RecordMac::derive(mac_root),
            config.server.adopt_store_records,
        )
        .await
        .map_err(|e| anyhow::anyhow!("cannot check the store's record MACs: {e}"))?;
    if macs.migrated > 0 {
        tracing::info!(
            records = macs.migrated,
            "Records written before record MACs were MAC'd."
        );
    }
    if !macs.refused.is_empty() {
        tracing::warn!(
            records = macs.refused.len(),
            "Records whose MAC fails are refused until rewritten."
        );
    }
    let hop_key = hop_secret.map(|s| crate::auth::HopKey::from_secret(&s));
    let metrics = Metrics::new();
    metrics.route_labels.set_limit(
        config.metrics.route_series_limit,
        config.metrics.route_series_per_namespace,
    );
    if let Some(s) = store.as_sled() {
        s.count_flushes(metrics.store_flushes.clone());
    }
    store.count_refusals(metrics.store_records_refused.clone());
    let directory = ActorDirectory::default();
    let namespaces = Namespaces::default();
    let threads = if config.server.actor_threads == 0 {
        num_cpus()
    } else {
        config.server.actor_threads
    };
    let (draining, draining_rx) = tokio::sync::watch::channel(false);
    let pubsub =
        crate::pubsub::PubSubService::new(metrics.clone(), config.pubsub.clone(), draining_rx);
    let functions = start_functions(&config, &data_dir, &store, &metrics, &secrets)?;
    let records = crate::actors::Records::new(store.clone());
    let sup = NodeSupervisor::new(
        store.clone(),
        metrics.clone(),
        directory.clone(),
        namespaces.clone(),
        threads,
        config.server.mailbox_capacity,
    )
    .with_records(records.clone())
    .with_quotas(config.quotas.clone())
    .with_pubsub(pubsub.clone())
    .with_functions(functions.clone())
    .with_passivate_after(Duration::from_secs(
        config.server.passivate_after_seconds.max(1) as u64,
    ))
    .with_node_id(crate::placement::node_id(&config.cluster));
    let supervisor_stats = sup.stats();
    let supervisor = sup.start();
    crate::actors::follow_records(
        store.clone(),
        records.clone(),
        namespaces.clone(),
        supervisor.clone(),
    );
    // Temporary site folders of deploys this node did not finish.
    crate::deploy::site::clear_leftovers(&data_dir);
    let deployments = Arc::new(crate::deploy::Deployments::new(
        store.clone(),
        config.deploy.clone(),
        config.server.base_domain.clone(),
        &secrets.server_secret,
    ));
    // Noted before the index is first built: the dashboard's sign-in and
    // API calls reach the node by this name.
    if let Some(h) = crate::deploy::hosts::url_host(&config.server.public_url) {
        deployments
            .own_names
            .note(&h, "the host of this node's public_url");
    }
    deployments
        .reload()
        .await
        .map_err(|e| anyhow::anyhow!("cannot load the deployments: {e}"))?;
    {
        // `/metrics` reads the upstream instances' state from the live pools.
        let d = Arc::downgrade(&deployments);
        metrics.register_upstreams(move || {
            d.upgrade()
                .map(|d| d.upstream_samples())
                .unwrap_or_default()
        });
    }
    let blob_sweeps = crate::storage::blob_ledger::SweepRequests::default();
    let node = Node(Arc::new(NodeInner {
        config,
        store: store.clone(),
        metrics,
        directory,
        namespaces,
        supervisor,
        supervisor_stats,
        records,
        secrets,
        jwt,
        hop_key,
        token_cache: Default::default(),
        key_cache: Default::default(),
        revoked_sessions: Default::default(),
        phase: AtomicU8::new(Phase::Starting as u8),
        draining,
        pubsub,
        dashboard: Default::default(),
        functions,
        deployments,
        blob_sweeps: blob_sweeps.clone(),
        live: Default::default(),
        exports: Default::default(),
        cluster: std::sync::OnceLock::new(),
        #[cfg(feature = "cluster")]
        mesh: std::sync::OnceLock::new(),
    }));
    let (server, addr, grpc_addr) = crate::http::serve(node.clone(), api_socket, grpc_socket)?;
    let metrics = crate::http::serve_metrics(node.clone(), metrics_socket)?;
    if let Some((server, at)) = crate::http::serve_acme_http(node.clone(), acme_http_socket)? {
        tracing::info!(%at, "Answering ACME HTTP-01 challenges.");
        actix_web::rt::spawn(server);
    }
    if let Some(acme) = &node.config.tls.acme {
        crate::deploy::acme::Acme::new(
            acme.clone(),
            node.deployments.clone(),
            node.store.clone(),
            &node.metrics,
        )?
        .start();
    }
    if !node.config.cluster.etcd.is_empty() {
        let c = &node.config.cluster;
        let id = if c.node_id.is_empty() {
            hostname()
        } else {
            c.node_id.clone()
        };
        let advertise = if c.advertise.is_empty() {
            format!("http://{addr}")
        } else {
            c.advertise.trim_end_matches('/').to_string()
        };
        // Every listener is announced, so every member refuses it as an upstream.
        let mut listeners = vec![crate::placement::Listener {
            kind: "api".into(),
            addr,
        }];
        if let Some((_, m)) = &metrics {
            listeners.push(crate::placement::Listener {
                kind: "metrics".into(),
                addr: *m,
            });
        }
        if let Some(g) = grpc_addr {
            listeners.push(crate::placement::Listener {
                kind: "grpc".into(),
                addr: g,
            });
        }
        let cluster = crate::placement::Cluster::start(
            store.clone(),
            id,
            advertise,
            listeners,
            Duration::from_secs(c.register_seconds.max(1)),
        )
        .await
        .map_err(|e| anyhow::anyhow!("cannot join the cluster: {e}"))?;
        let _ = node.cluster.set(cluster);
        start_replacer(&node);
        // Deployments changed through another node reach this one's index.
        node.deployments
            .spawn_follower(crate::deploy::FOLLOW_INTERVAL);
        #[cfg(feature = "cluster")]
        start_mesh(&node, &data_dir).await?;
    }
    if let Some(sled) = store.as_sled() {
        spawn_sweeper(sled.clone());
    }
    spawn_blob_sweeper(
        store.clone(),
        blob_sweeps,
        node.metrics.clone(),
        node.functions.clone(),
    );
    crate::http::dashboard::spawn_sampler(&node);
    spawn_revocation_poller(&node);
    // Sessions opened with an operator key that is no longer the key end now.
    let sweeping = node.clone();
    actix_web::rt::spawn(async move {
        crate::http::dashboard::end_sessions_of_other_keys(&sweeping).await;
    });
    schedule_stored_crons(&node);
    // The node's own addresses, which no deployment upstream may reach.
    note_node_addresses(&node, addr).await;
    #[cfg(feature = "cluster")]
    follow_cluster_addresses(&node).await;
    if let Some((_, m)) = &metrics {
        node.deployments
            .egress
            .note_own("metrics address", &m.ip().to_string(), m.port())
            .await;
    }
    if let Some(g) = grpc_addr {
        node.deployments
            .egress
            .note_own("gRPC address", &g.ip().to_string(), g.port())
            .await;
    }
    let handle = server.handle();
    Ok(RunningNode {
        addr,
        node,
        server: Some(server),
        handle,
        metrics_addr: metrics.as_ref().map(|(_, a)| *a),
        grpc_addr,
        metrics_server: metrics.map(|(s, _)| {
            let h = s.handle();
            (s, h)
        }),
    })
}

/// Starts the WASM engine (compiled artifacts cached in `<data_dir>/wasm-cache`)
/// and the functions service.
fn start_functions(
    config: &Config,
    data_dir: &Path,
    store: &Store,
    metrics: &Metrics,
    secrets: &Secrets,
) -> anyhow::Result<crate::actors::FunctionsService> {
    let f = &config.functions;
    let wasm = crate::wasm::WasmConfig {
        workers: if f.workers == 0 {
            num_cpus()
        } else {
            f.workers
        },
        queue: f.queue,
        namespace_concurrency: f.namespace_concurrency,
        queue_wait: std::time::Duration::from_millis(f.queue_wait_ms),
        max_module_bytes: f.max_module_bytes,
        max_wat_bytes: f.max_wat_bytes,
        worker_nice: f.worker_nice,
        module_limits: crate::wasm::ModuleLimits {
            max_functions: f.max_functions,
            max_locals_per_function: f.max_locals_per_function,
            max_locals_total: f.max_locals_total,
            max_function_body_bytes: f.max_function_body_bytes,
            max_globals: f.max_globals,
            max_data_segments: f.max_data_segments,
            max_data_bytes: f.max_data_bytes,
            max_element_segments: f.max_element_segments,
            max_tables: f.max_tables,
            max_memories: f.max_memories,
            max_types: f.max_types,
            max_imports: f.max_imports,
            max_nesting_depth: f.max_nesting_depth,
        },
        compile_concurrency: f.compile_concurrency,
        compile_timeout: std::time::Duration::from_millis(f.compile_timeout_ms),
        ..Default::default()
    };
    let engine = crate::wasm::WasmEngine::new(wasm, data_dir.join("wasm-cache"))
        .map_err(|e| anyhow::anyhow!("cannot start the WASM engine: {e}"))?;
    Ok(crate::actors::FunctionsService::start(
        engine,
        store.clone(),
        metrics.clone(),
        &secrets.server_secret,
    ))
}

/// Joins the pub/sub mesh: messages published here go to the other nodes, and
/// theirs are delivered here by one task, in arrival order (so each
/// publisher's order is kept), straight to the worker relays with the routes
/// each namespace's supervisor shares (`NsHandle::routes`): no supervisor
/// mailbox on the way. A full relay queue is waited for, not dropped; the
/// task's channel (65,536 batches) is the headroom before `queue_full`.
#[cfg(feature = "cluster")]
async fn start_mesh(node: &Node, data_dir: &Path) -> anyhow::Result<()> {
    let c = &node.config.cluster;
    let keypair = crate::cluster::load_or_create_keypair(data_dir)
        .map_err(|e| anyhow::anyhow!("cannot load the mesh key: {e}"))?;
    let listen: crate::cluster::Multiaddr = c
        .gossip_listen
        .parse()
        .map_err(|e| anyhow::anyhow!("cluster.gossip_listen {:?}: {e}", c.gossip_listen))?;
    // One entry per namespace per received mesh batch.
    let (tx, mut rx) =
        tokio::sync::mpsc::channel::<(String, Vec<crate::actors::MeshMessage>)>(65_536);
    let metrics = node.metrics.clone();
    let deliver: crate::cluster::DeliverFn = Arc::new(move |ns, messages| {
        let n = messages.len() as u64;
        if tx.try_send((ns, messages)).is_err() {
            metrics
                .mesh_dropped
                .with_label_values(&["queue_full"])
                .inc_by(n);
        }
    });
    let n = node.clone();
    actix_web::rt::spawn(async move {
        while let Some((ns, messages)) = rx.recv().await {
            // Only a running supervisor has local subscribers: a namespace
            // without one here is not started for a message (placement).
            let Some(h) = n.namespaces.get(&ns) else {
                tracing::debug!(namespace = %ns, "Mesh messages for a namespace with no supervisor here.");
                continue;
            };
            // Straight to the relays with the routes the supervisor shares,
            // one message after the other (order kept); a full relay queue
            // is waited for, which holds this task and so the mesh back.
            let mut sequenced = Vec::new();
            for m in messages {
                if m.history.is_some() {
                    sequenced.push(m);
                } else if let Some(route) = h.routes.get(&m.topic) {
                    n.pubsub
                        .deliver_from_mesh(&m.topic, &m.data, &route, m.timestamp)
                        .await;
                }
            }
            // History topics go through the supervisor, which keeps this
            // node's copy and holds recoveries (docs/pubsub.md); `send`
            // waits for room in its mailbox, holding the mesh back.
            if !sequenced.is_empty() {
                let _ = h
                    .addr
                    .send(crate::actors::Replicated {
                        messages: sequenced,
                    })
                    .await;
            }
        }
    });
    let every = Duration::from_secs(c.register_seconds.max(1));
    let config = crate::cluster::MeshConfig {
        registry_interval: every,
        registry_ttl: every * 8,
        resend_bytes: usize::try_from(c.mesh_resend_mib.saturating_mul(1 << 20))
            .unwrap_or(usize::MAX),
        resend_messages: usize::try_from(c.mesh_resend_messages).unwrap_or(usize::MAX),
        ..Default::default()
    };
    let mesh = crate::cluster::Mesh::start_with(
        node.store.clone(),
        keypair,
        listen,
        node.pubsub.clone(),
        deliver,
        config,
    )
    .await
    .map_err(|e| anyhow::anyhow!("cannot start the pub/sub mesh: {e}"))?;
    tracing::info!(peer_id = %mesh.peer_id(), "Joined the pub/sub mesh.");
    let _ = node.mesh.set(mesh);
    Ok(())
}

/// Readiness in a cluster: a node is not ready (`/readyz` 503) until it is
/// connected to every peer registered in the mesh, so no subscriber is sent
/// to a node deaf to the others. At most `[cluster] ready_timeout_seconds`;
/// then it is ready anyway and names the peers it could not reach.
#[cfg(feature = "cluster")]
async fn wait_for_mesh(node: &Node) {
    let Some(mesh) = node.mesh.get() else { return };
    let limit = Duration::from_secs(node.config.cluster.ready_timeout_seconds);
    match mesh.wait_connected(limit).await {
        crate::cluster::Connectedness::Connected => {
            tracing::info!("Connected to every registered mesh peer.")
        }
        crate::cluster::Connectedness::Unreached(peers) => {
            let peers: Vec<String> = peers.iter().map(|p| p.to_string()).collect();
            tracing::warn!(
                unreached = %peers.join(", "),
                timeout_seconds = limit.as_secs(),
                "Ready without a connection to every registered mesh peer; messages published there do not reach this node's subscribers until it connects."
            );
        }
        crate::cluster::Connectedness::RegistryUnread => tracing::warn!(
            timeout_seconds = limit.as_secs(),
            "Ready without having read the mesh registry (store unavailable?)."
        ),
    }
}

/// Where the cluster's server secret lives in the shared store (sealed).
pub const SHARED_SERVER_SECRET: &[u8] = b"_cluster/server_secret";
/// Where the cluster's JWT signing key (PKCS#8) lives in the shared store (sealed).
pub const SHARED_JWT_KEY: &[u8] = b"_cluster/jwt_key";

/// The shared cluster secret: `MESHGATE_CLUSTER_SECRET`, else the contents of
/// `[cluster] secret_file`, else none. It keys the hop MAC and the seal of
/// the shared store.
fn read_cluster_secret(config: &Config) -> anyhow::Result<Option<Vec<u8>>> {
    if let Some(s) = std::env::var("MESHGATE_CLUSTER_SECRET")
        .ok()
        .filter(|s| !s.is_empty())
    {
        return Ok(Some(s.into_bytes()));
    }
    let file = &config.cluster.secret_file;
    if file.is_empty() {
        return Ok(None);
    }
    let secret =
        std::fs::read(file).with_context(|| format!("cannot read cluster.secret_file {file}"))?;
    if secret.is_empty() {
        anyhow::bail!("cluster.secret_file {file} is empty");
    }
    Ok(Some(secret))
}

/// The cluster-wide value under `key` (see [`crate::storage::adopt_sealed`]):
/// this node's `local` one if it is the first to write it, else the one
/// already there. A record sealed under another cluster secret stops the
/// start: a node that made up keys of its own would split the gateway.
async fn adopt_sealed_secret(
    store: &Store,
    seal: &crate::storage::SealKey,
    key: &[u8],
    local: &[u8],
    is_clear: impl Fn(&[u8]) -> bool,
) -> anyhow::Result<Vec<u8>> {
    use crate::storage::{Adoption, SealError};
    let name = String::from_utf8_lossy(key);
    match crate::storage::adopt_sealed(store, seal, key, local, is_clear).await {
        Ok(a) => {
            if a.how == Adoption::Migrated {
                tracing::info!(key = %name, "Sealed a secret an older version stored in the clear.");
            }
            Ok(a.value)
        }
        Err(SealError::WrongKey) => Err(anyhow::anyhow!(
            "cannot open {name}: sealed under a different cluster secret; every node needs the same MESHGATE_CLUSTER_SECRET / cluster.secret_file"
        )),
        Err(SealError::NotSealed) => Err(anyhow::anyhow!(
            "cannot open {name}: it is neither sealed nor a clear value an older meshgate wrote (damaged?; a clear value is adopted only by a start with [server] adopt_store_records = true on a store never migrated)"
        )),
        Err(SealError::Store(e)) => Err(anyhow::anyhow!(
            "cannot share the node secrets through the store: {e}"
        )),
        Err(e @ SealError::Contended(_)) => Err(anyhow::anyhow!("cannot agree on {name}: {e}")),
    }
}

/// Holds `<data_dir>/node.lock` for the life of the process, so a second
/// meshgate process on the same data folder is refused in either mode (in
/// cluster mode no sled lock would stop it, and it would run with this node's
/// keys). The same process may open the folder again (in-process restarts).
fn lock_data_dir(dir: &Path) -> anyhow::Result<()> {
    type Held = Vec<(std::path::PathBuf, std::fs::File)>;
    static HELD: std::sync::Mutex<Held> = std::sync::Mutex::new(Vec::new());
    let unusable = |e: &dyn std::fmt::Display| {
        anyhow::anyhow!("the data folder {} is not usable: {e}", dir.display())
    };
    std::fs::create_dir_all(dir).map_err(|e| unusable(&e))?;
    let path = dir
        .canonicalize()
        .map_err(|e| unusable(&e))?
        .join("node.lock");
    let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
    if held.iter().any(|(p, _)| *p == path) {
        return Ok(());
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| unusable(&e))?;
    match file.try_lock() {
        Ok(()) => {
            held.push((path, file));
            Ok(())
        }
        Err(std::fs::TryLockError::WouldBlock) => Err(anyhow::anyhow!(
            "{}; stop the other node or pick another --data-dir",
            StoreError::Locked(dir.display().to_string())
        )),
        Err(std::fs::TryLockError::Error(e)) => Err(unusable(&e)),
    }
}

/// The store: etcd when `cluster.etcd` names endpoints, else sled in the data folder.
async fn open_store(config: &Config) -> anyhow::Result<Store> {
    // Creates the data folder: the node's keys (server secret, JWT key, mesh
    // key) and the module cache live in it in either mode.
    lock_data_dir(&config.server.data_dir)?;
    let etcd = &config.cluster.etcd;
    if !etcd.is_empty() {
        #[cfg(feature = "cluster")]
        {
            use crate::storage::EtcdConnectError;
            let access = crate::storage::EtcdAccess::from_config(&config.cluster)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            return Store::open_etcd(etcd, &access).await.map_err(|e| match e {
                EtcdConnectError::Unavailable(e) => {
                    anyhow::anyhow!("cannot reach etcd at {}: {e}", etcd.join(", "))
                }
                refused => anyhow::anyhow!("{refused}"),
            });
        }
        #[cfg(not(feature = "cluster"))]
        anyhow::bail!(
            "cluster.etcd is set, but this meshgate was built without etcd support; \
             rebuild it with `cargo build --features cluster`"
        );
    }
    Store::open_sled(&config.server.data_dir).map_err(|e| match e {
        StoreError::Locked(_) => {
            anyhow::anyhow!("{e}; stop the other node or pick another --data-dir")
        }
        other => anyhow::anyhow!(other),
    })
}

/// Sweeps the blobs no record names (`storage/blob_ledger.rs`) at start,
/// when a change asks for it, and every [`BLOB_SWEEP_INTERVAL`] (changes made
/// through other members of a cluster, pins whose writer died). Requests
/// made during a sweep are answered by one more sweep. After each sweep the
/// compiled artifacts of modules no longer stored are removed from
/// `<data_dir>/wasm-cache` (storage does not know the wasm cache: the
/// sweep returns what it kept, docs/architecture.md).
fn spawn_blob_sweeper(
    store: Store,
    requests: crate::storage::blob_ledger::SweepRequests,
    metrics: Metrics,
    functions: crate::actors::FunctionsService,
) {
    actix_web::rt::spawn(async move {
        // Once at start (blobs left by a node that stopped, or by a version
        // without the sweep), then when asked or every interval.
        let mut first = true;
        loop {
            if !std::mem::take(&mut first) {
                tokio::select! {
                    () = requests.wanted() => {}
                    () = tokio::time::sleep(BLOB_SWEEP_INTERVAL) => {}
                }
            }
            // Artifacts written from here on may be of modules stored after
            // the sweep listed the blobs: they stay until the next sweep.
            let began = std::time::SystemTime::now();
            match crate::storage::blob_ledger::sweep(&store).await {
                Ok(s) => {
                    let engine = functions.engine().clone();
                    let kept = s.kept.clone();
                    let removed =
                        tokio::task::spawn_blocking(move || engine.retain_artifacts(&kept, began))
                            .await
                            .unwrap_or(0);
                    if removed > 0 {
                        tracing::info!(removed, "Unused compiled artifacts removed.");
                    }
                    if s.deleted > 0 {
                        // Durable now: on sled the freed space is given
                        // back once the deletions reach the disk.
                        let _ = crate::storage::OrderedKv::flush(&store).await;
                        tracing::info!(
                            blobs = s.blobs,
                            deleted = s.deleted,
                            "Unused blobs deleted."
                        );
                    }
                    metrics.blobs_deleted.inc_by(s.deleted as u64);
                    metrics.blobs_stored.set((s.blobs - s.deleted) as i64);
                }
                Err(e) => tracing::warn!(error = %e, "Blob sweep failed; retried at the next one."),
            }
        }
    });
}

/// How often the blob sweeper runs without being asked.
const BLOB_SWEEP_INTERVAL: Duration = Duration::from_secs(600);

/// Keeps the node's copy of the ended sessions: re-read from the store when
/// a watch on the list reports a change (another node ended a session: on
/// etcd, within milliseconds), and every
/// [`REVOCATION_POLL`](crate::identity::REVOCATION_POLL) whatever the watch
/// says, so a broken watch delays a refusal by that much at most.
fn spawn_revocation_poller(node: &Node) {
    let node = node.clone();
    actix_web::rt::spawn(async move {
        let reread = |node: &Node| {
            let node = node.clone();
            async move {
                match crate::identity::revoked_sessions(&node.store).await {
                    Ok(list) => node.revoked_sessions.merge(list, crate::util::now()),
                    Err(e) => {
                        tracing::warn!(error = %e, "Cannot read the ended sessions; the last list read stays in force.")
                    }
                }
            }
        };
        let mut tick = tokio::time::interval(crate::identity::REVOCATION_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // Watch first: a scan after it misses no later change.
            let mut watch = node
                .store
                .watch_prefix(crate::identity::REVOKED_PREFIX.as_bytes())
                .await
                .ok();
            reread(&node).await;
            loop {
                let changed = async {
                    match watch.as_mut() {
                        Some(w) => w.next().await.is_ok(),
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = tick.tick() => {
                        reread(&node).await;
                        if watch.is_none() {
                            break;
                        }
                    }
                    ok = changed => {
                        if !ok {
                            break;
                        }
                        reread(&node).await;
                    }
                }
            }
        }
    });
}

fn spawn_sweeper(store: crate::storage::SledStore) {
    actix_web::rt::spawn(async move {
        let mut tick = tokio::time::interval(crate::storage::SWEEP_INTERVAL);
        loop {
            tick.tick().await;
            let s = store.clone();
            let _ = tokio::task::spawn_blocking(move || s.sweep_expired()).await;
        }
    });
}

impl RunningNode {
    /// Finishes start-up work, then serves until SIGTERM or SIGINT, then drains.
    pub async fn run_until_signal(mut self) -> anyhow::Result<()> {
        let delay = self.node.config.debug.startup_delay_ms;
        let node = self.node.clone();
        actix_web::rt::spawn(async move {
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            #[cfg(feature = "cluster")]
            wait_for_mesh(&node).await;
            if node.phase() == Phase::Starting {
                node.set_phase(Phase::Ready);
                tracing::info!("Node ready.");
            }
        });
        let server = self.server.take().expect("run once");
        let serving = actix_web::rt::spawn(server);
        let metrics_handle = self.metrics_server.take().map(|(s, h)| {
            actix_web::rt::spawn(s);
            h
        });
        wait_for_signal().await;
        self.drain().await;
        if let Some(h) = metrics_handle {
            h.stop(true).await;
        }
        let _ = serving.await;
        Ok(())
    }

    /// The drain of docs/design.md §11: readyz 503 at once, new work refused, in-flight
    /// requests given the grace period, sockets closed, store flushed.
    pub async fn drain(&self) {
        let grace = Duration::from_secs(self.node.config.server.drain_grace_seconds);
        tracing::info!(grace_seconds = grace.as_secs(), "Draining.");
        self.node.set_phase(Phase::Draining);
        let deadline = tokio::time::Instant::now() + grace;
        while self.node.metrics.http_in_flight.get() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Give sockets a moment to send their close frames.
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.handle.stop(true).await;
        #[cfg(feature = "cluster")]
        if let Some(mesh) = self.node.mesh.get() {
            mesh.stop().await;
        }
        if let Err(e) = crate::storage::OrderedKv::flush(&self.node.store).await {
            tracing::error!(error = %e, "Store flush failed during drain.");
        }
        // The spans of the last requests (blocks until exported or timed out).
        if crate::telemetry::enabled() {
            let _ = actix_web::rt::task::spawn_blocking(crate::telemetry::shutdown).await;
        }
        tracing::info!("Drained; bye.");
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received."),
        _ = int.recv() => tracing::info!("SIGINT received."),
    }
}

/// Notes the node's own addresses once it is up: the bound listener, the
/// advertised URL, the etcd endpoints and the mesh's listen addresses.
async fn note_node_addresses(node: &Node, bound: SocketAddr) {
    use crate::deploy::egress::{host_port, multiaddr_host_port};
    let egress = &node.deployments.egress;
    let names = &node.deployments.own_names;
    egress
        .note_own("listen address", &bound.ip().to_string(), bound.port())
        .await;
    if let Some((h, _)) = node.config.server.listen.rsplit_once(':') {
        names.note(h, "this node's listen name");
    }
    let c = &node.config.cluster;
    let advertise = node
        .cluster
        .get()
        .map(|cl| cl.advertise.clone())
        .unwrap_or_else(|| c.advertise.clone());
    if let Some((h, p)) = host_port(&advertise) {
        egress.note_own("advertise address", &h, p).await;
        // A request with this node's own name as Host is the node's.
        names.note(&h, "this node's advertise name");
    }
    for e in &c.etcd {
        if let Some((h, p)) = host_port(e) {
            egress.note_own("etcd endpoint", &h, p).await;
        }
    }
    if let Some((h, p)) = multiaddr_host_port(&c.gossip_listen)
        && p != 0
    {
        egress.note_own("gossip address", &h, p).await;
    }
    #[cfg(feature = "cluster")]
    if let Some(mesh) = node.mesh.get()
        && let Some(status) = mesh.status().await
    {
        for a in status.listen_addrs {
            if let Some((h, p)) = multiaddr_host_port(&a.to_string()) {
                egress.note_own("gossip address", &h, p).await;
            }
        }
    }
}

/// In a cluster, the addresses of the whole cluster are the node's own too:
/// etcd's members (peer and client URLs, from its member list), every
/// registered node's API (advertise) address and name, every gossip listen
/// address in the mesh registry. Read once now (before the node serves), then
/// again whenever the node or mesh registry changes (etcd watches) and every
/// `register_seconds` (the safety net, which also follows etcd's members).
#[cfg(feature = "cluster")]
async fn follow_cluster_addresses(node: &Node) {
    /// Registry changes this close together make one re-read.
    const CLUSTER_ADDRESSES_SPACING: Duration = Duration::from_millis(200);
    let Some(cluster) = node.cluster.get() else {
        return;
    };
    let store = node.store.clone();
    refresh_cluster_addresses(&store, &node.deployments, cluster).await;
    let deployments = Arc::downgrade(&node.deployments);
    let cluster = Arc::downgrade(cluster);
    let every = Duration::from_secs(node.config.cluster.register_seconds.max(1));
    actix_web::rt::spawn(async move {
        let mut watches = None;
        loop {
            if watches.is_none() {
                let nodes = store.watch_prefix(crate::placement::NODES_PREFIX).await;
                let mesh = store
                    .watch_prefix(crate::cluster::REGISTRY_PREFIX.as_bytes())
                    .await;
                watches = match (nodes, mesh) {
                    (Ok(n), Ok(m)) => Some((n, m)),
                    (Err(e), _) | (_, Err(e)) => {
                        tracing::debug!(error = %e, "Registry watch for the egress policy not started; re-read on a timer.");
                        None
                    }
                };
            }
            let broke = match &mut watches {
                Some((n, m)) => tokio::select! {
                    r = n.next() => r.is_err(),
                    r = m.next() => r.is_err(),
                    _ = tokio::time::sleep(every) => false,
                },
                None => {
                    tokio::time::sleep(every).await;
                    false
                }
            };
            if broke {
                watches = None;
            }
            // Every node re-announces itself every `register_seconds`, each a
            // change: the changes of one short spell make one re-read.
            if let Some((n, m)) = &mut watches {
                tokio::time::sleep(CLUSTER_ADDRESSES_SPACING).await;
                use futures_util::FutureExt as _;
                while let Some(r) = n.next().now_or_never().or_else(|| m.next().now_or_never()) {
                    if r.is_err() {
                        watches = None;
                        break;
                    }
                }
            }
            let (Some(d), Some(c)) = (deployments.upgrade(), cluster.upgrade()) else {
                return;
            };
            refresh_cluster_addresses(&store, &d, &c).await;
        }
    });
}

/// One read of the cluster's addresses into the egress policy and the
/// reserved hosts; a source that cannot be read keeps its last set.
#[cfg(feature = "cluster")]
async fn refresh_cluster_addresses(
    store: &Store,
    deployments: &crate::deploy::Deployments,
    cluster: &crate::placement::Cluster,
) {
    use crate::deploy::egress::{host_port, multiaddr_host_port};
    use crate::storage::OrderedKv;
    let egress = &deployments.egress;
    if let Some(etcd) = store.as_etcd() {
        match etcd.members().await {
            Ok(members) => {
                let mut own = Vec::new();
                for m in &members {
                    for (urls, kind) in [(&m.peer_urls, "peer"), (&m.client_urls, "client")] {
                        for (h, p) in urls.iter().filter_map(|u| host_port(u)) {
                            own.push((format!("the etcd {kind} URL of member {}", m.name), h, p));
                        }
                    }
                }
                egress.set_own("etcd members", &own).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "etcd's member list not read; its last one stays refused.")
            }
        }
    }
    let mut own = Vec::new();
    let mut names = Vec::new();
    for n in cluster.live_now().await {
        let advertised = host_port(&n.advertise);
        if let Some((h, p)) = &advertised {
            own.push((
                format!("the API address of cluster member {}", n.id),
                h.clone(),
                *p,
            ));
            names.push((
                h.clone(),
                format!("the advertise name of cluster member {}", n.id),
            ));
        }
        // Every listener it announced (docs/cluster.md, "Every address of
        // every member"); one bound to every address is reached at the
        // advertised host.
        for l in &n.listeners {
            let what = format!("the {} listener of cluster member {}", l.kind, n.id);
            let port = l.addr.port();
            if !l.addr.ip().is_unspecified() {
                own.push((what.clone(), l.addr.ip().to_string(), port));
            }
            if let Some((h, _)) = &advertised
                && (l.addr.ip().is_unspecified() || l.kind != "api")
            {
                own.push((what, h.clone(), port));
            }
        }
    }
    match store
        .scan_prefix(crate::cluster::REGISTRY_PREFIX.as_bytes(), usize::MAX)
        .await
    {
        Ok(rows) => {
            for a in crate::cluster::registered_addrs(&rows) {
                if let Some((h, p)) = multiaddr_host_port(&a)
                    && p != 0
                {
                    own.push(("a gossip address of the cluster".to_string(), h, p));
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "The mesh registry not read; the cluster's last addresses stay refused.");
            return;
        }
    }
    egress.set_own("cluster members", &own).await;
    deployments.own_names.set_members(names);
    deployments.drop_reserved_certs();
}

/// Hands the node's cron timer (in the node supervisor) the stored cron
/// schedules of every namespace, at start: no supervisor is started for
/// them; the timer wakes each when a slot is due. In a cluster only the
/// namespaces this node is a member of: cron and triggers run on members
/// only (each cron slot still fires once in the cluster: the member that
/// claims it runs it).
/// The node's sweep that replaces namespace members whose node has been
/// gone for `[cluster] replace_after_seconds` (`placement/replace.rs`;
/// docs/cluster.md, "Members follow the cluster"). Ends with the cluster.
fn start_replacer(node: &Node) {
    let Some(cluster) = node.cluster.get() else {
        return;
    };
    let weak = Arc::downgrade(cluster);
    let after = Duration::from_secs(node.config.cluster.replace_after_seconds.max(1));
    let metrics = node.metrics.clone();
    actix_web::rt::spawn(async move {
        let mut replacer: Option<crate::placement::Replacer> = None;
        let mut tick = tokio::time::interval(crate::placement::sweep_every(after));
        loop {
            tick.tick().await;
            let r = match &mut replacer {
                Some(r) => r,
                None => {
                    let Some(c) = weak.upgrade() else { return };
                    replacer.insert(crate::placement::Replacer::new(c, after))
                }
            };
            if weak.strong_count() <= 1 {
                return;
            }
            match r.sweep(crate::util::mono_now()).await {
                Ok(done) => {
                    for (_, outcome) in done {
                        metrics
                            .member_replacements
                            .with_label_values(&[outcome.as_str()])
                            .inc();
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "Member replacement sweep failed; next sweep retries.")
                }
            }
        }
    });
}

fn schedule_stored_crons(node: &Node) {
    let node = node.clone();
    actix_web::rt::spawn(async move {
        let all = match crate::actors::stored_crons(&node.store).await {
            Ok(all) => all,
            Err(e) => {
                tracing::warn!(error = %e, "Cron schedules could not be read at start.");
                return;
            }
        };
        for (ns, entries) in all {
            if let Some(c) = node.cluster.get() {
                match node.records.get(&ns).await {
                    Ok(Some(r)) if crate::placement::is_member(&r.members, &c.node_id) => {}
                    Ok(_) => continue,
                    Err(e) => {
                        tracing::warn!(namespace = %ns, error = %e, "Members unknown at start; its cron waits for a request.");
                        continue;
                    }
                }
            }
            node.supervisor.do_send(crate::actors::CronSet {
                namespace: ns,
                entries,
            });
        }
    });
}
