//! Node configuration: `config.toml`, then `MESHGATE_<SECTION>_<KEY>` environment
//! overrides, then CLI flags. Unknown keys are rejected and every problem is
//! reported at once.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Largest `[dashboard] top_namespaces`: a snapshot stays a few hundred KB.
pub const MAX_DASHBOARD_TOP_NAMESPACES: usize = 1000;

/// Every problem found in a configuration, reported together.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  - {}", .0.join("\n  - "))]
pub struct ConfigError(pub Vec<String>);

/// The whole node configuration.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `[server]`: listener, data folder, workers, mailbox bound, hosts.
    pub server: ServerConfig,
    /// `[rate_limit]`: the GCRA buckets and the trusted proxies.
    pub rate_limit: RateLimitConfig,
    /// `[cors]`: allowed origins.
    pub cors: CorsConfig,
    /// `[auth]`: API key and token lifetimes.
    pub auth: AuthConfig,
    /// `[functions]`: the WASM worker pool and module size.
    pub functions: FunctionsConfig,
    /// `[pubsub]`: socket queues, frame size, pings.
    pub pubsub: PubSubConfig,
    /// `[cluster]`: etcd, the cluster secret, this node's id and address, the mesh.
    pub cluster: ClusterConfig,
    /// `[tls]`: the node's own certificate (empty: plain HTTP).
    pub tls: TlsConfig,
    /// `[deploy]`: static sites and upstream proxying.
    pub deploy: DeployConfig,
    /// `[debug]`: test switches, off by default.
    pub debug: DebugConfig,
    /// `[quotas]`: what one namespace may hold (the operator overrides them
    /// per namespace with `PUT /v1/namespaces/{name}/quotas`).
    pub quotas: QuotaConfig,
    /// `[metrics]`: who may read `/metrics` and `/v1/status`, and how many
    /// namespaces get their own series.
    pub metrics: MetricsConfig,
    /// `[dashboard]`: what the `/__admin` page shows.
    pub dashboard: DashboardConfig,
    /// `[telemetry]`: OTLP export of request spans (off by default).
    pub telemetry: TelemetryConfig,
    /// `[grpc]`: the gRPC listener of deployment hosts (off by default).
    pub grpc: GrpcConfig,
}

/// `[grpc]`: a listener of its own for gRPC to deployment hosts (HTTP/2
/// with trailers, served by hyper: docs/deployments.md "gRPC",
/// docs/decisions.md "gRPC on a listener of its own").
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcConfig {
    /// `host:port` of the gRPC listener: HTTP/2 with prior knowledge
    /// (h2c), or TLS with ALPN `h2` when `[tls]` is set (the node's
    /// certificate). Empty (the default): no gRPC listener.
    pub listen: String,
}

/// `[telemetry]`: spans of the requests the node serves, exported over
/// OTLP/HTTP (protobuf) to an operator's collector (`crate::telemetry`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The collector's OTLP/HTTP base URL, `http://` or `https://` (spans
    /// are posted to `<it>/v1/traces`), e.g. `"http://127.0.0.1:4318"`.
    /// Empty (the default): nothing is exported and no span is built.
    pub otlp_endpoint: String,
    /// The resource's `service.name`. Default `"meshgate"`.
    pub service_name: String,
    /// The share of the traces this node starts (no valid `traceparent`
    /// came in) that are sampled, 0 to 1; default 1. A continued trace
    /// follows its caller's `sampled` flag.
    pub sample_ratio: f64,
    /// Milliseconds between two exports of the queued spans, 1 to 60,000;
    /// default 5,000.
    pub scheduled_delay_ms: u64,
    /// Finished spans waiting for export at most (past it a new one is
    /// dropped), 1 to 65,536; default 2,048.
    pub max_queue_size: usize,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: String::new(),
            service_name: crate::telemetry::DEFAULT_SERVICE_NAME.to_string(),
            sample_ratio: 1.0,
            scheduled_delay_ms: crate::telemetry::DEFAULT_SCHEDULED_DELAY_MS,
            max_queue_size: crate::telemetry::DEFAULT_MAX_QUEUE_SIZE,
        }
    }
}

impl TelemetryConfig {
    /// What `crate::telemetry::install` takes.
    pub fn settings(&self) -> crate::telemetry::Settings<'_> {
        crate::telemetry::Settings {
            otlp_endpoint: &self.otlp_endpoint,
            service_name: &self.service_name,
            sample_ratio: self.sample_ratio,
            scheduled_delay_ms: self.scheduled_delay_ms,
            max_queue_size: self.max_queue_size,
        }
    }

    fn validate(&self, errors: &mut Vec<String>) {
        if !self.otlp_endpoint.is_empty()
            && let Err(e) = crate::telemetry::traces_url(&self.otlp_endpoint)
        {
            errors.push(format!("telemetry.otlp_endpoint: {e}"));
        }
        if self.service_name.trim().is_empty() {
            errors.push("telemetry.service_name: must not be empty".into());
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            errors.push(format!(
                "telemetry.sample_ratio: {} must be 0..=1",
                self.sample_ratio
            ));
        }
        if !(1..=60_000).contains(&self.scheduled_delay_ms) {
            errors.push("telemetry.scheduled_delay_ms: must be 1..=60000".into());
        }
        if !(1..=crate::telemetry::MAX_QUEUE_SIZE).contains(&self.max_queue_size) {
            errors.push(format!(
                "telemetry.max_queue_size: must be 1..={}",
                crate::telemetry::MAX_QUEUE_SIZE
            ));
        }
    }
}

/// `[dashboard]`: the page shows node totals and the most active namespaces;
/// any other namespace is found with its search.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DashboardConfig {
    /// Namespaces in each snapshot (and its event), the most active first by
    /// messages, publishes and invocations per second. 1 to 1,000; default 100.
    pub top_namespaces: usize,
}

impl Default for DashboardConfig {
    fn default() -> Self {
        DashboardConfig {
            top_namespaces: 100,
        }
    }
}

/// `[metrics]`: `/metrics` and `/v1/status` name every namespace, so by
/// default they need the operator key. A Prometheus scraper either sends it
/// (`Authorization: Bearer`), or scrapes a second listener on a private
/// interface (`listen`), or the operator opens them to anyone without the
/// namespace names (`public`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// `host:port` of a second listener (plain HTTP) that serves only
    /// `GET /metrics`, whole and without a key. Bind it to a private
    /// interface. Empty (the default): no second listener.
    pub listen: String,
    /// `false` (the default): `/metrics` and `/v1/status` on the main
    /// listener need the operator key. `true`: anyone may read them, without
    /// namespace names (the `namespace` label summed away; status rows
    /// without their namespace); the operator key still gets them whole.
    pub public: bool,
    /// Namespaces that keep their own `namespace` label value in `/metrics`:
    /// the most active since the node started (messages handled, publishes,
    /// invocations); every other namespace is summed into
    /// `namespace="_other"`. 1 to 10,000; default 100.
    pub namespace_series_limit: usize,
    /// (namespace, deployment, route) triples with their own series in the
    /// route metrics of deployments, and as many (namespace, deployment,
    /// instance) triples; past it a new one is counted under `_other`.
    /// 1 to 100,000; default 1,000.
    pub route_series_limit: usize,
    /// The share of `route_series_limit` one namespace may take (each of
    /// the two kinds of triples), so one tenant cannot fill the node's cap;
    /// past it the namespace's new triples are counted under `_other`.
    /// 1 to `route_series_limit`; default 100.
    pub route_series_per_namespace: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: String::new(),
            public: false,
            namespace_series_limit: crate::metrics::DEFAULT_NAMESPACE_SERIES_LIMIT,
            route_series_limit: crate::observe::DEFAULT_ROUTE_SERIES_LIMIT,
            route_series_per_namespace: crate::observe::DEFAULT_ROUTE_SERIES_PER_NAMESPACE,
        }
    }
}

/// `[quotas]`: the default quota of every namespace. Stored resources are
/// counted in the store beside the data, exact on every node of a cluster
/// and after a restart; sockets and subscriptions are live and counted per
/// node (docs/quotas.md).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuotaConfig {
    /// Bytes of KV one namespace holds: each key's length plus its value's.
    pub kv_bytes: u64,
    /// KV keys one namespace holds.
    pub kv_keys: u64,
    /// Functions one namespace holds.
    pub functions: u64,
    /// Bytes of WASM modules one namespace holds, over every kept version.
    pub module_bytes: u64,
    /// Deployments one namespace holds.
    pub deployments: u64,
    /// Hosts one namespace's deployments claim together.
    pub hosts: u64,
    /// Unpacked bytes of static sites one namespace holds, over every kept version.
    pub site_bytes: u64,
    /// Pub/sub sockets of one namespace open at once on one node.
    pub sockets: u64,
    /// Topic subscriptions of one namespace's sockets at once on one node.
    pub subscriptions: u64,
    /// Pub/sub history payload bytes one namespace keeps on one node; past
    /// it the oldest go (so does `[pubsub] max_history_bytes_per_namespace`,
    /// the node's ceiling: the lower of the two applies).
    pub history_bytes: u64,
    /// Pub/sub history topics (each with its epoch and offsets) one
    /// namespace keeps on one node; past it a new topic replaces the
    /// longest-idle one holding no publication and no subscriber, or is
    /// refused with 429.
    pub history_topics: u64,
}

impl Default for QuotaConfig {
    fn default() -> Self {
        Self {
            kv_bytes: 256 << 20,
            kv_keys: 1_000_000,
            functions: 200,
            module_bytes: 512 << 20,
            deployments: 100,
            hosts: 200,
            site_bytes: 1 << 30,
            sockets: 1_000,
            subscriptions: 10_000,
            history_bytes: 64 << 20,
            history_topics: 10_000,
        }
    }
}

/// `[tls]`: TLS terminated by the node itself. Both files empty: plain HTTP
/// (HTTP/1.1 and HTTP/2 with prior knowledge, h2c, on the one port).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain. Reloaded without a restart when the file changes.
    pub cert_file: String,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: String,
    /// Seconds between checks of the two files for changes.
    pub reload_check_seconds: u64,
    /// `[tls.acme]`: certificates for deployment hosts with `tls: "auto"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acme: Option<AcmeConfig>,
}

impl Default for TlsConfig {
    fn default() -> Self {
        Self {
            cert_file: String::new(),
            key_file: String::new(),
            reload_check_seconds: 2,
            acme: None,
        }
    }
}

/// `[tls.acme]`: an ACME CA (RFC 8555) that issues the certificates of
/// deployment hosts with `tls: "auto"` (docs/deployments.md "ACME").
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AcmeConfig {
    /// The CA's directory URL (`https://acme-v02.api.letsencrypt.org/directory`).
    pub directory: String,
    /// The account's contact address.
    pub email: String,
    /// PEM file of the CA certificates trusted for the directory's HTTPS
    /// (a private CA); empty: the public webpki roots.
    pub ca_bundle: String,
    /// `http-01` (the default) or `tls-alpn-01`.
    pub challenge: String,
    /// `host:port` of the plain-HTTP listener that answers HTTP-01
    /// (`/.well-known/acme-challenge/{token}`); required for `http-01`.
    pub http_listen: String,
    /// Seconds between the node's checks of which hosts need a certificate.
    pub check_seconds: u64,
    /// Renew a certificate this many seconds after its `notBefore`; 0 (the
    /// default): at two thirds of its lifetime.
    pub renew_after_seconds: u64,
    /// The first retry after a failed order, in seconds; doubled per failure.
    pub retry_min_seconds: u64,
    /// The longest wait between retries, in seconds.
    pub retry_max_seconds: u64,
    /// Longest time one order may take (challenges, finalization), in seconds;
    /// also the time to live of the per-deployment order lock.
    pub order_timeout_seconds: u64,
}

impl Default for AcmeConfig {
    fn default() -> Self {
        Self {
            directory: String::new(),
            email: String::new(),
            ca_bundle: String::new(),
            challenge: "http-01".into(),
            http_listen: String::new(),
            check_seconds: 60,
            renew_after_seconds: 0,
            retry_min_seconds: 60,
            retry_max_seconds: 6 * 3600,
            order_timeout_seconds: 120,
        }
    }
}

/// `[deploy]`: host-routed deployments (static sites and upstream proxying).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeployConfig {
    /// Largest static-site tarball (`.tar.gz`) accepted, in bytes.
    pub max_site_bytes: usize,
    /// Largest unpacked static site, in bytes.
    pub max_site_unpacked_bytes: usize,
    /// Most files in one static site.
    pub max_site_files: usize,
    /// Largest single file of a static site, in bytes (a file is stored,
    /// and so held in memory, whole).
    pub max_site_file_bytes: usize,
    /// Site tarballs unpacked at once, node-wide (each streams to disk
    /// through one bounded buffer, then stores its files one at a time).
    pub unpack_concurrency: usize,
    /// Milliseconds a site deploy waits for an unpack slot before 503
    /// UNPACK_BUSY (with Retry-After).
    pub unpack_wait_ms: u64,
    /// Seconds to connect to an upstream instance.
    pub connect_timeout_seconds: u64,
    /// Seconds an upstream has to send its response head (then 504).
    pub upstream_timeout_seconds: u64,
    /// Consecutive connection failures or timeouts that mark an instance unhealthy.
    pub unhealthy_after_failures: u32,
    /// Seconds an unhealthy instance is skipped before it is tried again.
    pub unhealthy_seconds: u64,
    /// Ranges (CIDR, or one address) opened to upstreams although the egress
    /// policy forbids them by default (loopback, private, link-local, ...).
    /// The node's own addresses stay forbidden inside them (see
    /// `upstream_allow_own`).
    pub upstream_allow: Vec<String>,
    /// Ranges (CIDR, or one address) no upstream may reach; wins over `upstream_allow`.
    pub upstream_deny: Vec<String>,
    /// Lets upstreams reach the node's own addresses (its listeners, etcd's
    /// client and peer URLs, every cluster member's API and gossip
    /// addresses) when the other rules and `upstream_allow` let them. Off
    /// (false): those are refused whatever `upstream_allow` opens. For an
    /// operator who deploys an upstream on purpose at the node's own ports.
    pub upstream_allow_own: bool,
    /// Shortest `health.interval_ms` a deployment may ask for, in ms: a
    /// deployment asking for less is refused (400 `INVALID_UPSTREAM`). 100
    /// to 3,600,000; default 1,000.
    pub health_min_interval_ms: u64,
    /// Active health checks one namespace may cost this node, per second,
    /// over all its deployments: past it each of its checks is spread out
    /// evenly (its interval lengthened) so the total stays within. 1 to
    /// 100,000; default 50.
    pub health_checks_per_second: u32,
    /// Active health checks of one namespace in flight at once on this
    /// node: past it the namespace's due checks wait for its own to finish,
    /// so checks that hang (an instance that accepts and never answers,
    /// with a long `timeout_ms`) cannot take the node's 256 check slots
    /// from other namespaces. 1 to 256; default 16.
    pub health_in_flight_per_namespace: usize,
    /// Seconds a node keeps checking a deployment's instances after it last
    /// proxied a request to it: only nodes that proxy for a deployment check
    /// it. 0: always check. Default 300.
    pub health_idle_seconds: u64,
}

/// Active health checks in flight at once on a node, over every namespace
/// (`src/deploy/health.rs`): the most `health_in_flight_per_namespace` may be.
pub const HEALTH_MAX_IN_FLIGHT: usize = 256;

impl Default for DeployConfig {
    fn default() -> Self {
        Self {
            max_site_bytes: 64 << 20,
            max_site_unpacked_bytes: 256 << 20,
            max_site_files: 10_000,
            max_site_file_bytes: 64 << 20,
            unpack_concurrency: 2,
            unpack_wait_ms: 10_000,
            connect_timeout_seconds: 5,
            upstream_timeout_seconds: 60,
            unhealthy_after_failures: 3,
            unhealthy_seconds: 10,
            upstream_allow: Vec::new(),
            upstream_deny: Vec::new(),
            upstream_allow_own: false,
            health_min_interval_ms: 1_000,
            health_checks_per_second: 50,
            health_in_flight_per_namespace: 16,
            health_idle_seconds: 300,
        }
    }
}

/// `[cluster]`: the shared store (etcd), the cluster secret that keys the hop
/// MAC, this node's identity and address, the pub/sub mesh, member breakers
/// and the TLS material for etcd and peers. With `etcd` empty the node runs
/// alone on sled.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// etcd endpoints (`http://host:port`, or `https://host:port` with
    /// `etcd_ca_file`) holding the shared state; set, they replace the
    /// embedded sled store (needs a build with `--features cluster`).
    /// Empty: a single node on sled. All of one scheme.
    pub etcd: Vec<String>,
    /// File holding the cluster secret that keys the hop MAC (or set
    /// `MESHGATE_CLUSTER_SECRET`). Empty: no hop is ever believed.
    pub secret_file: String,
    /// This node's id in the cluster (unique). Empty: the host name.
    pub node_id: String,
    /// Where other nodes reach this node's HTTP. Empty: `http://<listen address>`.
    pub advertise: String,
    /// The libp2p listen address of the pub/sub mesh.
    pub gossip_listen: String,
    /// Consecutive failures of a member that open its breaker.
    pub breaker_failures: u32,
    /// Seconds between the probes an open breaker admits.
    pub breaker_probe_seconds: u64,
    /// Seconds between re-registrations in the node and mesh registries
    /// (their entries live four times as long).
    pub register_seconds: u64,
    /// Seconds a namespace member's registration must have been gone before
    /// a live node replaces it (docs/cluster.md, "Members follow the
    /// cluster"). At least 1.
    pub replace_after_seconds: u64,
    /// Seconds a starting cluster node waits to be connected to every peer
    /// registered in the mesh before it reports ready; past it the node is
    /// ready anyway and logs the peers it could not reach.
    pub ready_timeout_seconds: u64,
    /// MiB of sent pub/sub messages a node keeps to resend to a peer that
    /// missed them (docs/cluster.md, "No loss between live nodes"). At least 1.
    pub mesh_resend_mib: u64,
    /// Sent pub/sub messages a node keeps to resend, at most. At least 1.
    pub mesh_resend_messages: u64,
    /// PEM bundle of the CA(s) that sign the nodes' certificates: a member
    /// whose `advertise` is `https://` is forwarded to over TLS and trusted
    /// only if its certificate chains to one of these (never to public
    /// roots). Needed when this node's `advertise` is `https://`. Empty: an
    /// `https://` member cannot be forwarded to.
    pub peer_ca_file: String,
    /// PEM file of the CA(s) that signed etcd's server certificate. Needed for
    /// `https://` endpoints (the system roots are never trusted for etcd).
    pub etcd_ca_file: String,
    /// PEM certificate (chain) this node presents to etcd, for etcd's
    /// `--client-cert-auth`. Set with `etcd_key_file`.
    pub etcd_cert_file: String,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of `etcd_cert_file`.
    pub etcd_key_file: String,
    /// etcd user the node authenticates as (etcd `auth enable`). Empty: none.
    pub etcd_user: String,
    /// File holding the password of `etcd_user` (one line; a trailing newline
    /// is ignored).
    pub etcd_password_file: String,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            etcd: Vec::new(),
            secret_file: String::new(),
            node_id: String::new(),
            advertise: String::new(),
            gossip_listen: "/ip4/127.0.0.1/tcp/0".into(),
            breaker_failures: 5,
            breaker_probe_seconds: 30,
            register_seconds: 15,
            replace_after_seconds: 30,
            ready_timeout_seconds: 10,
            mesh_resend_mib: 64,
            mesh_resend_messages: 262_144,
            peer_ca_file: String::new(),
            etcd_ca_file: String::new(),
            etcd_cert_file: String::new(),
            etcd_key_file: String::new(),
            etcd_user: String::new(),
            etcd_password_file: String::new(),
        }
    }
}

impl ClusterConfig {
    /// The etcd endpoints and how the node reaches them (TLS, user).
    fn validate_etcd(&self, errors: &mut Vec<String>) {
        let mut https = 0;
        for e in &self.etcd {
            let (host, tls) = match (e.strip_prefix("http://"), e.strip_prefix("https://")) {
                (Some(h), _) => (h, false),
                (_, Some(h)) => (h, true),
                _ => ("", false),
            };
            if host.is_empty() || host.contains('/') {
                errors.push(format!(
                    "cluster.etcd: {e:?} is not http://host:port or https://host:port"
                ));
            } else if tls {
                https += 1;
            }
        }
        let tls_files = [
            ("etcd_ca_file", &self.etcd_ca_file),
            ("etcd_cert_file", &self.etcd_cert_file),
            ("etcd_key_file", &self.etcd_key_file),
        ];
        if https > 0 && https < self.etcd.len() {
            errors
                .push("cluster.etcd: mixes http:// and https:// endpoints; use one scheme".into());
        }
        if https > 0 && self.etcd_ca_file.is_empty() {
            errors.push(
                "cluster.etcd_ca_file: https:// etcd endpoints need the CA that signed etcd's certificate"
                    .into(),
            );
        }
        if https == 0 && !self.etcd.is_empty() {
            for (name, v) in tls_files {
                if !v.is_empty() {
                    errors.push(format!(
                        "cluster.{name}: set, but cluster.etcd names http:// endpoints (TLS needs https://)"
                    ));
                }
            }
        }
        if self.etcd_cert_file.is_empty() != self.etcd_key_file.is_empty() {
            errors.push(
                "cluster.etcd_cert_file and cluster.etcd_key_file: set both or neither".into(),
            );
        }
        if self.etcd_user.is_empty() != self.etcd_password_file.is_empty() {
            errors.push(
                "cluster.etcd_user and cluster.etcd_password_file: set both or neither".into(),
            );
        }
        if self.etcd.is_empty() {
            for (name, v) in tls_files.into_iter().chain([
                ("etcd_user", &self.etcd_user),
                ("etcd_password_file", &self.etcd_password_file),
            ]) {
                if !v.is_empty() {
                    errors.push(format!("cluster.{name}: set, but cluster.etcd is empty"));
                }
            }
        }
    }
}

/// `[server]`: the listener, the data folder and the node's limits.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address the HTTP listener binds (`host:port`; port 0 picks a free one).
    pub listen: String,
    /// Folder of the embedded store, keys and the compiled-module cache.
    pub data_dir: PathBuf,
    /// Largest accepted JSON or raw request body, in bytes (larger: 413).
    pub max_body_bytes: usize,
    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT.
    pub drain_grace_seconds: u64,
    /// HTTP worker threads; 0 means one per core.
    pub workers: usize,
    /// Threads hosting the namespace supervisors; 0 means one per core.
    pub actor_threads: usize,
    /// Mailbox capacity of each namespace supervisor (beyond it: 503 OVERLOADED).
    pub mailbox_capacity: usize,
    /// Base domain for namespace hosts (`ns-<name>.<base_domain>`).
    pub base_domain: String,
    /// Log format: `pretty` or `json`.
    pub log_format: String,
    /// JWT issuer and audience. The host of a URL here is one of the node's
    /// own names (`deploy::hosts`): no deployment may take it.
    pub public_url: String,
    /// Seconds a namespace supervisor may sit idle (no message, no socket,
    /// no running or queued invocation) before it passivates: it stops and
    /// starts again on the next message for its namespace. Must be > 0.
    pub passivate_after_seconds: i64,
    /// Whether this start may MAC in place the store's records that carry
    /// none (a store an older version wrote). Off: a store with such
    /// records that is not marked migrated stops the start, since the same
    /// store is what a store writer leaves after stripping every MAC and
    /// deleting the marker (docs/security.md, "Node → etcd"). Set it for
    /// one start after an upgrade (`MESHGATE_SERVER_ADOPT_STORE_RECORDS=true`).
    pub adopt_store_records: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            data_dir: PathBuf::from("./data"),
            max_body_bytes: 1 << 20,
            drain_grace_seconds: 30,
            workers: 0,
            actor_threads: 0,
            mailbox_capacity: 1024,
            base_domain: "localhost".into(),
            log_format: "pretty".into(),
            public_url: "meshgate".into(),
            passivate_after_seconds: 300,
            adopt_store_records: false,
        }
    }
}

/// `[rate_limit]`: GCRA buckets (docs/design.md §2). Rates are per minute.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RateLimitConfig {
    /// General client bucket: requests per minute per client network.
    pub general_per_minute: u32,
    /// General client bucket: burst size.
    pub general_burst: u32,
    /// Credential endpoints (challenge, verify, token, refresh, api-key) per minute.
    pub credential_per_minute: u32,
    /// Credential endpoints: burst size.
    pub credential_burst: u32,
    /// `/v1/auth/challenge` per wallet, per minute.
    pub wallet_per_minute: u32,
    /// `/v1/auth/challenge` per wallet: burst size.
    pub wallet_burst: u32,
    /// Default per-namespace bucket, per minute.
    pub namespace_per_minute: u32,
    /// Default per-namespace bucket: burst size.
    pub namespace_burst: u32,
    /// Anonymous traffic to a namespace, per minute: every request to its
    /// deployment hosts (sites and proxied upstreams, whatever the route's
    /// `auth`) and every request without a credential (public invokes). One
    /// bucket per namespace, apart from its namespace bucket, so a flood of
    /// its public site cannot starve its owner's API.
    pub anonymous_per_minute: u32,
    /// Anonymous traffic to a namespace: burst size.
    pub anonymous_burst: u32,
    /// Peers whose `X-Forwarded-For` (last entry) is believed.
    pub trusted_proxies: Vec<String>,
}

impl Default for RateLimitConfig {
    fn default() -> Self {
        Self {
            general_per_minute: 10_000,
            general_burst: 5_000,
            credential_per_minute: 30,
            credential_burst: 10,
            wallet_per_minute: 10,
            wallet_burst: 5,
            namespace_per_minute: 60_000,
            namespace_burst: 10_000,
            anonymous_per_minute: 60_000,
            anonymous_burst: 10_000,
            trusted_proxies: Vec::new(),
        }
    }
}

/// `[cors]`: cross-origin requests.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct CorsConfig {
    /// Allowed origins (`*` allows any).
    pub allowed_origins: Vec<String>,
}

/// `[auth]`: credential lifetimes.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Default API key lifetime in days (at most 365).
    pub api_key_default_days: u32,
    /// Access token lifetime in seconds.
    pub access_token_seconds: u64,
    /// Refresh token lifetime in days (1..=365): each rotation issues a
    /// successor valid this long again.
    pub refresh_token_days: u32,
    /// How long a wallet challenge (its message and nonce) stays valid, in
    /// seconds (1..=3600): the `Expiration Time` of a Sign-In with Ethereum
    /// message, the `Expires At` of an Ed25519 one.
    pub challenge_seconds: u64,
}

impl AuthConfig {
    /// `refresh_token_days` in seconds.
    pub fn refresh_token_seconds(&self) -> u64 {
        u64::from(self.refresh_token_days) * 86_400
    }
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            api_key_default_days: 90,
            access_token_seconds: 900,
            refresh_token_days: 30,
            challenge_seconds: 300,
        }
    }
}

/// `[functions]`: the WASM sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FunctionsConfig {
    /// WASM worker threads; 0 means one per core.
    pub workers: usize,
    /// Invocations queued node-wide before 503 OVERLOADED.
    pub queue: usize,
    /// Invocations of one namespace waiting for a worker (its queue bound)
    /// before 429 FUNCTION_BUSY; running ones do not count (fair share).
    pub namespace_concurrency: usize,
    /// Milliseconds an invocation may wait for a worker before 429 FUNCTION_BUSY.
    pub queue_wait_ms: u64,
    /// Largest module accepted by a deploy, in bytes.
    pub max_module_bytes: usize,
    /// Largest module accepted as WAT text, in bytes; over it 413
    /// MODULE_TOO_LARGE before the text is parsed (parsing text costs far
    /// more memory than its size, and runs inside the compile gate).
    /// `max_module_bytes` applies too: the lower of the two.
    pub max_wat_bytes: usize,
    /// The WASM workers' nice value, 0 to 19: above 0 the threads serving
    /// requests run first when guests keep every core busy; 0 runs guests
    /// at the same priority.
    pub worker_nice: i32,
    /// Compiles that may run at once, node-wide (at most one per namespace:
    /// a second deploy is 429 COMPILE_BUSY, an invocation's compile waits).
    pub compile_concurrency: usize,
    /// Milliseconds a compile may take, waiting for a compile slot
    /// included; past it 503 COMPILE_TIMEOUT (the compile runs on to its
    /// end on its thread, and its result is dropped).
    pub compile_timeout_ms: u64,
    /// Most functions a module may define; over it 400 MODULE_TOO_COMPLEX,
    /// before compiling (as for every `max_*` count below).
    pub max_functions: u32,
    /// Most locals of one function (parameters not counted).
    pub max_locals_per_function: u32,
    /// Most locals of all the module's functions together.
    pub max_locals_total: u64,
    /// Largest function body (its instructions), in bytes.
    pub max_function_body_bytes: u32,
    /// Most globals a module may define.
    pub max_globals: u32,
    /// Most data segments.
    pub max_data_segments: u32,
    /// Most bytes of all data segments together.
    pub max_data_bytes: u64,
    /// Most element segments.
    pub max_element_segments: u32,
    /// Most tables, defined or imported.
    pub max_tables: u32,
    /// Most memories, defined or imported.
    pub max_memories: u32,
    /// Most type definitions.
    pub max_types: u32,
    /// Most imports.
    pub max_imports: u32,
    /// Deepest nesting of blocks (`block`, `loop`, `if`) in one function.
    pub max_nesting_depth: u32,
}

impl Default for FunctionsConfig {
    fn default() -> Self {
        Self {
            workers: 0,
            queue: 256,
            namespace_concurrency: 64,
            queue_wait_ms: 3_000,
            max_module_bytes: 16 << 20,
            max_wat_bytes: 4 << 20,
            worker_nice: 10,
            compile_concurrency: 2,
            compile_timeout_ms: 10_000,
            max_functions: 10_000,
            max_locals_per_function: 50_000,
            max_locals_total: 500_000,
            max_function_body_bytes: 1 << 20,
            max_globals: 10_000,
            max_data_segments: 10_000,
            max_data_bytes: 16 << 20,
            max_element_segments: 10_000,
            max_tables: 1,
            max_memories: 1,
            max_types: 10_000,
            max_imports: 10_000,
            max_nesting_depth: 4_096,
        }
    }
}

/// `[pubsub]`: sockets and fan-out.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PubSubConfig {
    /// Frames queued per connection before it is closed as a slow consumer (4008).
    pub outbound_queue_messages: usize,
    /// Bytes queued per connection before it is closed as a slow consumer (4008).
    pub outbound_queue_bytes: usize,
    /// Largest frame a client may send, in bytes.
    pub max_frame_bytes: usize,
    /// Seconds between server pings.
    pub ping_interval_seconds: u64,
    /// Seconds without any client frame before the socket is closed.
    pub read_timeout_seconds: u64,
    /// Largest `size` (publications kept per topic) a namespace's history rule may set.
    pub max_history_size: u64,
    /// Largest `ttl_seconds` (seconds a publication is kept) a history rule may set.
    pub max_history_ttl: u64,
    /// Payload bytes one namespace's history may hold; past it the oldest publications go.
    pub max_history_bytes_per_namespace: u64,
    /// Most publications one recovery (or one `GET /v1/pubsub/history`) returns;
    /// a larger gap is answered `recovered: false`.
    pub max_recovered_publications: u64,
    /// Payload bytes one `GET /v1/pubsub/history` page holds at most (it
    /// always holds one publication when there is one): a page is built in
    /// memory and held until the client has read it.
    pub max_history_page_bytes: u64,
    /// Seconds between history sweeps (each namespace supervisor sweeps its own).
    pub history_sweep_seconds: u64,
    /// Seconds a history topic's stream (its epoch and top offset) is kept
    /// once it holds no publication and nothing was published to it, like
    /// Centrifugo's `history_meta_ttl`; then it is forgotten, and a client
    /// recovering from it is told `recovered: false`.
    pub history_meta_ttl_seconds: u64,
    /// Milliseconds `POST /v1/pubsub/publish[-batch]` waits for the
    /// namespace's supervisor (a history topic's ack waits for its store
    /// write); past it 504 `TIMEOUT`. Must be > 0.
    pub publish_timeout_ms: u64,
}

impl Default for PubSubConfig {
    fn default() -> Self {
        Self {
            outbound_queue_messages: 1024,
            outbound_queue_bytes: 4 << 20,
            max_frame_bytes: 1 << 20,
            ping_interval_seconds: 30,
            read_timeout_seconds: 75,
            max_history_size: 10_000,
            max_history_ttl: 86_400,
            max_history_bytes_per_namespace: 64 << 20,
            max_recovered_publications: 300,
            max_history_page_bytes: 1 << 20,
            history_sweep_seconds: 5,
            history_meta_ttl_seconds: 30 * 86_400,
            publish_timeout_ms: 10_000,
        }
    }
}

/// `[debug]`: switches for tests; keep them off in production.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct DebugConfig {
    /// Enables the operator's `POST /v1/namespaces/{name}/debug/panic`,
    /// `debug/hold?ms=` and `debug/hold-compile?ms=`: a supervisor panic, a
    /// supervisor that holds its mailbox (the overload answer) and a compile
    /// slot held for the namespace (the compile gate's answers).
    pub fault_injection: bool,
    /// Milliseconds `GET /v1/debug/sleep` may wait at most (0 disables the route).
    pub max_sleep_ms: u64,
    /// Milliseconds the node stays in its starting phase after binding (probe tests).
    pub startup_delay_ms: u64,
}

/// Command-line overrides, applied last.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `--listen`: replaces `server.listen`.
    pub listen: Option<String>,
    /// `--data-dir`: replaces `server.data_dir`.
    pub data_dir: Option<PathBuf>,
    /// `--log-format`: replaces `server.log_format`.
    pub log_format: Option<String>,
}

impl Config {
    /// Reads `path` (if any), applies environment and CLI overrides, validates.
    pub fn load(
        path: Option<&Path>,
        env: &[(String, String)],
        cli: &Overrides,
    ) -> Result<Config, ConfigError> {
        let mut table = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| ConfigError(vec![format!("cannot read {}: {e}", p.display())]))?;
                text.parse::<toml::Table>()
                    .map_err(|e| ConfigError(vec![format!("{}: {}", p.display(), e.message())]))?
            }
            None => toml::Table::new(),
        };
        let defaults = toml::Table::try_from(Config::default()).expect("defaults serialize");
        let mut errors = Vec::new();
        apply_env(&mut table, &defaults, env, &mut errors);
        if let Some(v) = &cli.listen {
            set(
                &mut table,
                "server",
                "listen",
                toml::Value::String(v.clone()),
            );
        }
        if let Some(v) = &cli.data_dir {
            set(
                &mut table,
                "server",
                "data_dir",
                toml::Value::String(v.display().to_string()),
            );
        }
        if let Some(v) = &cli.log_format {
            set(
                &mut table,
                "server",
                "log_format",
                toml::Value::String(v.clone()),
            );
        }
        check_keys(&table, &defaults, &mut errors);
        if !errors.is_empty() {
            return Err(ConfigError(errors));
        }
        let config: Config = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError(vec![e.message().to_string()]))?;
        config.validate()?;
        Ok(config)
    }

    /// Semantic checks, all at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut errors = Vec::new();
        if self.server.listen.parse::<SocketAddr>().is_err() {
            errors.push(format!(
                "server.listen: {:?} is not host:port",
                self.server.listen
            ));
        }
        if !matches!(self.server.log_format.as_str(), "pretty" | "json") {
            errors.push(format!(
                "server.log_format: {:?} must be \"pretty\" or \"json\"",
                self.server.log_format
            ));
        }
        if self.server.max_body_bytes == 0 {
            errors.push("server.max_body_bytes: must be > 0".into());
        }
        if self.server.mailbox_capacity == 0 {
            errors.push("server.mailbox_capacity: must be > 0".into());
        }
        if self.server.passivate_after_seconds <= 0 {
            errors.push(format!(
                "server.passivate_after_seconds: {} must be > 0 (seconds an idle namespace supervisor runs before it stops)",
                self.server.passivate_after_seconds
            ));
        }
        let rl = &self.rate_limit;
        for (name, v) in [
            ("general_per_minute", rl.general_per_minute),
            ("general_burst", rl.general_burst),
            ("credential_per_minute", rl.credential_per_minute),
            ("credential_burst", rl.credential_burst),
            ("wallet_per_minute", rl.wallet_per_minute),
            ("wallet_burst", rl.wallet_burst),
            ("namespace_per_minute", rl.namespace_per_minute),
            ("namespace_burst", rl.namespace_burst),
            ("anonymous_per_minute", rl.anonymous_per_minute),
            ("anonymous_burst", rl.anonymous_burst),
        ] {
            if v == 0 {
                errors.push(format!("rate_limit.{name}: must be > 0"));
            }
        }
        for p in &rl.trusted_proxies {
            if p.parse::<std::net::IpAddr>().is_err() {
                errors.push(format!(
                    "rate_limit.trusted_proxies: {p:?} is not an IP address"
                ));
            }
        }
        if self.auth.api_key_default_days == 0 || self.auth.api_key_default_days > 365 {
            errors.push("auth.api_key_default_days: must be 1..=365".into());
        }
        if self.auth.challenge_seconds == 0 || self.auth.challenge_seconds > 3600 {
            errors.push("auth.challenge_seconds: must be 1..=3600".into());
        }
        if self.auth.refresh_token_days == 0 || self.auth.refresh_token_days > 365 {
            errors.push("auth.refresh_token_days: must be 1..=365".into());
        }
        if self.functions.namespace_concurrency == 0 || self.functions.queue == 0 {
            errors.push("functions.namespace_concurrency and functions.queue: must be > 0".into());
        }
        if !(1..=60_000).contains(&self.functions.queue_wait_ms) {
            errors.push("functions.queue_wait_ms: must be 1..=60000".into());
        }
        if !(0..=19).contains(&self.functions.worker_nice) {
            errors.push("functions.worker_nice: must be 0..=19".into());
        }
        if self.functions.compile_concurrency == 0 {
            errors.push("functions.compile_concurrency: must be > 0".into());
        }
        if self.functions.max_nesting_depth == 0 {
            errors.push("functions.max_nesting_depth: must be > 0".into());
        }
        if !(1..=600_000).contains(&self.functions.compile_timeout_ms) {
            errors.push("functions.compile_timeout_ms: must be 1..=600000".into());
        }
        if self.deploy.unpack_concurrency == 0 {
            errors.push("deploy.unpack_concurrency: must be > 0".into());
        }
        if !(1..=600_000).contains(&self.deploy.unpack_wait_ms) {
            errors.push("deploy.unpack_wait_ms: must be 1..=600000".into());
        }
        if self.deploy.max_site_file_bytes == 0 {
            errors.push("deploy.max_site_file_bytes: must be > 0".into());
        }
        if self.pubsub.outbound_queue_messages == 0 || self.pubsub.ping_interval_seconds == 0 {
            errors.push(
                "pubsub.outbound_queue_messages and pubsub.ping_interval_seconds: must be > 0"
                    .into(),
            );
        }
        let p = &self.pubsub;
        if p.max_history_size == 0
            || p.max_history_ttl == 0
            || p.max_history_bytes_per_namespace == 0
            || p.max_recovered_publications == 0
            || p.max_history_page_bytes == 0
            || p.history_sweep_seconds == 0
            || p.history_meta_ttl_seconds == 0
            || p.publish_timeout_ms == 0
        {
            errors.push(
                "pubsub.max_history_size, max_history_ttl, max_history_bytes_per_namespace, max_recovered_publications, max_history_page_bytes, history_sweep_seconds, history_meta_ttl_seconds and publish_timeout_ms: must be > 0"
                    .into(),
            );
        }
        if self.tls.cert_file.is_empty() != self.tls.key_file.is_empty() {
            errors.push("tls.cert_file and tls.key_file: set both or neither".into());
        }
        if self.tls.reload_check_seconds == 0 {
            errors.push("tls.reload_check_seconds: must be > 0".into());
        }
        if let Some(a) = &self.tls.acme {
            if self.tls.cert_file.is_empty() {
                errors.push(
                    "tls.acme: needs the node's own pair (tls.cert_file, tls.key_file): \
                     issued certificates are served on the TLS listener"
                        .into(),
                );
            }
            if !a.directory.starts_with("https://") {
                errors.push("tls.acme.directory: an https:// URL of the CA's directory".into());
            }
            if a.email.trim().is_empty() || !a.email.contains('@') {
                errors.push("tls.acme.email: the account's contact address".into());
            }
            match a.challenge.as_str() {
                "http-01" => {
                    if a.http_listen.trim().parse::<SocketAddr>().is_err() {
                        errors.push(
                            "tls.acme.http_listen: host:port of the plain listener that answers \
                             HTTP-01 (required with challenge = \"http-01\")"
                                .into(),
                        );
                    }
                }
                "tls-alpn-01" => {
                    if !a.http_listen.trim().is_empty()
                        && a.http_listen.trim().parse::<SocketAddr>().is_err()
                    {
                        errors.push("tls.acme.http_listen: host:port".into());
                    }
                }
                other => errors.push(format!(
                    "tls.acme.challenge: {other:?} is not \"http-01\" or \"tls-alpn-01\""
                )),
            }
            if a.check_seconds == 0
                || a.retry_min_seconds == 0
                || a.retry_max_seconds < a.retry_min_seconds
                || a.order_timeout_seconds == 0
            {
                errors.push(
                    "tls.acme.check_seconds, retry_min_seconds, order_timeout_seconds: must be > 0; \
                     retry_max_seconds >= retry_min_seconds"
                        .into(),
                );
            }
            if !a.ca_bundle.is_empty() {
                match std::fs::read(&a.ca_bundle) {
                    Ok(pem) => {
                        use rustls_pki_types::CertificateDer;
                        use rustls_pki_types::pem::PemObject;
                        if CertificateDer::pem_slice_iter(&pem)
                            .filter_map(Result::ok)
                            .next()
                            .is_none()
                        {
                            errors.push(format!(
                                "tls.acme.ca_bundle {}: holds no PEM certificate",
                                a.ca_bundle
                            ));
                        }
                    }
                    Err(e) => errors.push(format!("tls.acme.ca_bundle {}: {e}", a.ca_bundle)),
                }
            }
        }
        self.check_peer_ca(&mut errors);
        let d = &self.deploy;
        if d.max_site_bytes == 0
            || d.max_site_files == 0
            || d.connect_timeout_seconds == 0
            || d.upstream_timeout_seconds == 0
            || d.unhealthy_after_failures == 0
        {
            errors.push(
                "deploy.max_site_bytes, max_site_files, connect_timeout_seconds, upstream_timeout_seconds and unhealthy_after_failures: must be > 0"
                    .into(),
            );
        }
        for (key, list) in [
            ("upstream_allow", &d.upstream_allow),
            ("upstream_deny", &d.upstream_deny),
        ] {
            for r in list {
                if parse_range(r).is_none() {
                    errors.push(format!(
                        "deploy.{key}: {r:?} is not a CIDR range (\"10.0.0.0/8\", \"fc00::/7\") or an IP address"
                    ));
                }
            }
        }
        if !(100..=3_600_000).contains(&d.health_min_interval_ms) {
            errors.push(format!(
                "deploy.health_min_interval_ms: {} is not within 100..=3600000",
                d.health_min_interval_ms
            ));
        }
        if !(1..=100_000).contains(&d.health_checks_per_second) {
            errors.push(format!(
                "deploy.health_checks_per_second: {} is not within 1..=100000",
                d.health_checks_per_second
            ));
        }
        if !(1..=HEALTH_MAX_IN_FLIGHT).contains(&d.health_in_flight_per_namespace) {
            errors.push(format!(
                "deploy.health_in_flight_per_namespace: {} is not within 1..={}",
                d.health_in_flight_per_namespace, HEALTH_MAX_IN_FLIGHT
            ));
        }
        self.cluster.validate_etcd(&mut errors);
        if self.cluster.mesh_resend_mib == 0 || self.cluster.mesh_resend_mib > 65_536 {
            errors.push("cluster.mesh_resend_mib: must be 1 to 65536".into());
        }
        if self.cluster.mesh_resend_messages == 0 || self.cluster.mesh_resend_messages > 1 << 26 {
            errors.push("cluster.mesh_resend_messages: must be 1 to 67108864".into());
        }
        if self.cluster.replace_after_seconds == 0 {
            errors.push("cluster.replace_after_seconds: must be at least 1".into());
        }
        if let Some(m) = self.metrics_listen_addr() {
            match m.parse::<SocketAddr>() {
                Err(_) => errors.push(format!("metrics.listen: {m:?} is not host:port")),
                Ok(a) if a.port() != 0 && m == self.server.listen => errors.push(format!(
                    "metrics.listen: {m:?} is server.listen; give the metrics listener its own address"
                )),
                Ok(_) => {}
            }
        }
        if let Some(g) = self.grpc_listen_addr() {
            match g.parse::<SocketAddr>() {
                Err(_) => errors.push(format!("grpc.listen: {g:?} is not host:port")),
                Ok(a) if a.port() != 0
                    && (g == self.server.listen || Some(g) == self.metrics_listen_addr()) =>
                {
                    errors.push(format!(
                        "grpc.listen: {g:?} is another listener's address; give the gRPC listener its own"
                    ))
                }
                Ok(_) => {}
            }
        }
        let limit = self.metrics.namespace_series_limit;
        if !(1..=crate::metrics::MAX_NAMESPACE_SERIES_LIMIT).contains(&limit) {
            errors.push(format!(
                "metrics.namespace_series_limit: {limit} must be 1..={} (namespaces with their own series in /metrics)",
                crate::metrics::MAX_NAMESPACE_SERIES_LIMIT
            ));
        }
        let routes = self.metrics.route_series_limit;
        if !(1..=crate::observe::MAX_ROUTE_SERIES_LIMIT).contains(&routes) {
            errors.push(format!(
                "metrics.route_series_limit: {routes} must be 1..={} (deployment routes with their own series in /metrics)",
                crate::observe::MAX_ROUTE_SERIES_LIMIT
            ));
        }
        let share = self.metrics.route_series_per_namespace;
        if !(1..=routes.max(1)).contains(&share) {
            errors.push(format!(
                "metrics.route_series_per_namespace: {share} must be 1..=metrics.route_series_limit ({routes})"
            ));
        }
        self.telemetry.validate(&mut errors);
        let top = self.dashboard.top_namespaces;
        if !(1..=MAX_DASHBOARD_TOP_NAMESPACES).contains(&top) {
            errors.push(format!(
                "dashboard.top_namespaces: {top} must be 1..={MAX_DASHBOARD_TOP_NAMESPACES}"
            ));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ConfigError(errors))
        }
    }

    /// `cluster.peer_ca_file`: readable PEM with at least one certificate,
    /// and set whenever this node advertises `https://` (its peers are then
    /// TLS too, and are never checked against public roots).
    fn check_peer_ca(&self, errors: &mut Vec<String>) {
        use rustls_pki_types::CertificateDer;
        use rustls_pki_types::pem::PemObject;
        let c = &self.cluster;
        if c.peer_ca_file.is_empty() {
            if c.advertise.starts_with("https://") {
                errors.push(format!(
                    "cluster.advertise {:?} is https://: set cluster.peer_ca_file to the CA bundle that signs the nodes' certificates",
                    c.advertise
                ));
            }
            return;
        }
        match CertificateDer::pem_file_iter(&c.peer_ca_file)
            .map(|it| it.collect::<Result<Vec<_>, _>>())
        {
            Err(e) => errors.push(format!(
                "cluster.peer_ca_file: cannot read {}: {e}",
                c.peer_ca_file
            )),
            Ok(Err(e)) => errors.push(format!(
                "cluster.peer_ca_file: {} is not PEM: {e}",
                c.peer_ca_file
            )),
            Ok(Ok(certs)) => {
                let (usable, _) = rustls::RootCertStore::empty().add_parsable_certificates(certs);
                if usable == 0 {
                    errors.push(format!(
                        "cluster.peer_ca_file: {} holds no usable CA certificate",
                        c.peer_ca_file
                    ));
                }
            }
        }
    }

    /// The bound address to listen on.
    pub fn listen_addr(&self) -> SocketAddr {
        self.server.listen.parse().expect("validated")
    }

    /// `[metrics] listen`, when set.
    pub fn metrics_listen_addr(&self) -> Option<&str> {
        Some(self.metrics.listen.trim()).filter(|l| !l.is_empty())
    }

    /// `[tls.acme] http_listen`, when ACME is configured and it is set.
    pub fn acme_http_listen_addr(&self) -> Option<SocketAddr> {
        let a = self.tls.acme.as_ref()?;
        a.http_listen.trim().parse().ok()
    }

    /// `[grpc] listen`, when set.
    pub fn grpc_listen_addr(&self) -> Option<&str> {
        Some(self.grpc.listen.trim()).filter(|l| !l.is_empty())
    }
}

fn set(table: &mut toml::Table, section: &str, key: &str, value: toml::Value) {
    let entry = table
        .entry(section.to_string())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    if let toml::Value::Table(t) = entry {
        t.insert(key.to_string(), value);
    }
}

/// `MESHGATE_<SECTION>_<KEY>=value`; the value is read as TOML when it parses, else as a
/// string. A list setting also takes a comma-separated list (`a,b`; empty: no items).
fn apply_env(
    table: &mut toml::Table,
    defaults: &toml::Table,
    env: &[(String, String)],
    errors: &mut Vec<String>,
) {
    for (section, keys) in defaults {
        let toml::Value::Table(keys) = keys else {
            continue;
        };
        for (key, default) in keys {
            let name = format!("MESHGATE_{}_{}", section.to_uppercase(), key.to_uppercase());
            let Some((_, raw)) = env.iter().find(|(k, _)| *k == name) else {
                continue;
            };
            let value = match default {
                toml::Value::String(_) => toml::Value::String(raw.clone()),
                toml::Value::Array(_) if !raw.trim_start().starts_with('[') => {
                    env_list(raw, |v| fits(defaults, section, key, v))
                }
                _ => match format!("v = {raw}").parse::<toml::Table>() {
                    Ok(mut t) => t.remove("v").expect("parsed"),
                    Err(_) => {
                        errors.push(format!(
                            "{name}: {raw:?} is not a valid value for {section}.{key}"
                        ));
                        continue;
                    }
                },
            };
            set(table, section, key, value);
        }
    }
}

/// A comma-separated list from the environment. The items are strings, unless
/// the setting takes other values (numbers, booleans): then each item is read
/// as TOML where it parses. A value neither reading fits is left as strings,
/// for `check_keys` to name.
fn env_list(raw: &str, fits: impl Fn(&toml::Value) -> bool) -> toml::Value {
    let items: Vec<&str> = raw
        .split(',')
        .map(str::trim)
        .filter(|i| !i.is_empty())
        .collect();
    let strings = toml::Value::Array(
        items
            .iter()
            .map(|i| toml::Value::String(i.to_string()))
            .collect(),
    );
    if fits(&strings) {
        return strings;
    }
    let typed = toml::Value::Array(
        items
            .iter()
            .map(|i| match format!("v = {i}").parse::<toml::Table>() {
                Ok(mut t) => t.remove("v").expect("parsed"),
                Err(_) => toml::Value::String(i.to_string()),
            })
            .collect(),
    );
    if fits(&typed) { typed } else { strings }
}

/// Whether the defaults with `section.key` set to `value` deserialize.
fn fits(defaults: &toml::Table, section: &str, key: &str, value: &toml::Value) -> bool {
    let mut probe = defaults.clone();
    set(&mut probe, section, key, value.clone());
    toml::Value::Table(probe).try_into::<Config>().is_ok()
}

/// The same for the `[tls.acme]` table (a section of its own inside `[tls]`).
fn check_acme_keys(value: &toml::Value, errors: &mut Vec<String>) {
    let toml::Value::Table(keys) = value else {
        errors.push("[tls.acme] must be a table".into());
        return;
    };
    let Ok(toml::Value::Table(defaults)) = toml::Value::try_from(AcmeConfig::default()) else {
        return;
    };
    for (key, v) in keys {
        if !defaults.contains_key(key) {
            errors.push(format!("unknown key tls.acme.{key}"));
            continue;
        }
        let mut probe = defaults.clone();
        probe.insert(key.clone(), v.clone());
        if let Err(e) = toml::Value::Table(probe).try_into::<AcmeConfig>() {
            errors.push(format!("tls.acme.{key}: {}", e.message()));
        }
    }
}

/// Finds every unknown section or key and every value of the wrong type.
fn check_keys(table: &toml::Table, defaults: &toml::Table, errors: &mut Vec<String>) {
    for (section, value) in table {
        let Some(toml::Value::Table(default_keys)) = defaults.get(section) else {
            errors.push(format!("unknown section [{section}]"));
            continue;
        };
        let toml::Value::Table(keys) = value else {
            errors.push(format!("[{section}] must be a table"));
            continue;
        };
        for (key, v) in keys {
            if section == "tls" && key == "acme" {
                check_acme_keys(v, errors);
                continue;
            }
            if !default_keys.contains_key(key) {
                errors.push(format!("unknown key {section}.{key}"));
                continue;
            }
            // Deserialize the defaults with only this key replaced, so each bad value is named.
            let mut probe = defaults.clone();
            set(&mut probe, section, key, v.clone());
            if let Err(e) = toml::Value::Table(probe).try_into::<Config>() {
                errors.push(format!("{section}.{key}: {}", e.message()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_str(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, text).unwrap();
        let env: Vec<_> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::load(Some(&path), &env, &Overrides::default())
    }

    /// No file at all gives the documented single-node defaults.
    #[test]
    fn defaults_without_file() {
        let c = Config::load(None, &[], &Overrides::default()).unwrap();
        assert_eq!(c.server.listen, "127.0.0.1:8080");
        assert_eq!(c.server.data_dir, PathBuf::from("./data"));
        assert_eq!(c.rate_limit.general_per_minute, 10_000);
    }

    /// Each history bound of `[pubsub]` set to 0 is refused with the keys
    /// named; the page's byte bound is 1 MiB by default.
    #[test]
    fn pubsub_history_bounds_must_be_positive() {
        let c = Config::load(None, &[], &Overrides::default()).unwrap();
        assert_eq!(c.pubsub.max_history_page_bytes, 1 << 20);
        for key in [
            "max_history_size",
            "max_recovered_publications",
            "max_history_page_bytes",
            "history_meta_ttl_seconds",
        ] {
            let err = load_str(&format!("[pubsub]\n{key} = 0\n"), &[]).unwrap_err();
            let all = err.0.join("\n");
            assert!(all.contains("max_history_page_bytes"), "{key}: {all}");
        }
        let ok = load_str("[pubsub]\nmax_history_page_bytes = 4096\n", &[]).unwrap();
        assert_eq!(ok.pubsub.max_history_page_bytes, 4096);
    }

    /// A zero or negative `passivate_after_seconds` is refused, alongside
    /// the other problems; the default is 300.
    #[test]
    fn passivate_after_must_be_positive() {
        assert_eq!(
            Config::load(None, &[], &Overrides::default())
                .unwrap()
                .server
                .passivate_after_seconds,
            300
        );
        for bad in ["0", "-5"] {
            let err = load_str(
                &format!("[server]\npassivate_after_seconds = {bad}\nmailbox_capacity = 0\n"),
                &[],
            )
            .unwrap_err();
            let all = err.0.join("\n");
            assert!(all.contains("server.passivate_after_seconds"), "{all}");
            assert!(all.contains("server.mailbox_capacity"), "{all}");
        }
        assert!(load_str("[server]\npassivate_after_seconds = 1\n", &[]).is_ok());
    }

    /// `[tls.acme]`: its keys checked like a section's, and what it needs.
    #[test]
    fn acme_section_is_checked() {
        let tls = "[tls]\ncert_file = \"c.pem\"\nkey_file = \"k.pem\"\n";
        let err = |text: &str| {
            load_str(text, &[])
                .err()
                .map(|e| e.0.join("\n"))
                .unwrap_or_default()
        };
        let all = err(&format!(
            "{tls}[tls.acme]\ndirectory = \"https://ca.test/dir\"\nemail = \"a@b.test\"\nbogus = 1\ncheck_seconds = \"x\"\n"
        ));
        assert!(all.contains("unknown key tls.acme.bogus"), "{all}");
        assert!(all.contains("tls.acme.check_seconds"), "{all}");
        let all = err(&format!(
            "{tls}[tls.acme]\ndirectory = \"http://ca.test/dir\"\nemail = \"nobody\"\nchallenge = \"dns-01\"\n"
        ));
        assert!(all.contains("tls.acme.directory"), "{all}");
        assert!(all.contains("tls.acme.email"), "{all}");
        assert!(all.contains("tls.acme.challenge"), "{all}");
        // HTTP-01 needs its listener; TLS-ALPN-01 does not.
        let base = "[tls.acme]\ndirectory = \"https://ca.test/dir\"\nemail = \"a@b.test\"\n";
        assert!(err(&format!("{tls}{base}")).contains("tls.acme.http_listen"));
        assert!(
            !err(&format!("{tls}{base}challenge = \"tls-alpn-01\"\n")).contains("tls.acme"),
            "{}",
            err(&format!("{tls}{base}challenge = \"tls-alpn-01\"\n"))
        );
        // Without the node's own pair there is no listener to serve on.
        assert!(
            err(&format!("{base}http_listen = \"127.0.0.1:80\"\n"))
                .contains("needs the node's own pair")
        );
    }

    /// Unknown keys and bad values are all reported in one error.
    #[test]
    fn every_problem_reported_at_once() {
        let err = load_str(
            "[server]\nlisten = 5\nbogus = 1\n[rate_limit]\ngeneral_burst = \"x\"\n[nope]\na = 1\n",
            &[],
        )
        .unwrap_err();
        let all = err.0.join("\n");
        assert!(all.contains("server.listen"), "{all}");
        assert!(all.contains("unknown key server.bogus"), "{all}");
        assert!(all.contains("rate_limit.general_burst"), "{all}");
        assert!(all.contains("unknown section [nope]"), "{all}");
        assert_eq!(err.0.len(), 4, "{all}");
    }

    /// Environment variables override the file, typed by the default's type.
    #[test]
    fn env_overrides_file() {
        let c = load_str(
            "[server]\nlisten = \"127.0.0.1:9000\"\n",
            &[
                ("MESHGATE_SERVER_LISTEN", "127.0.0.1:9001"),
                ("MESHGATE_RATE_LIMIT_GENERAL_BURST", "7"),
            ],
        )
        .unwrap();
        assert_eq!(c.server.listen, "127.0.0.1:9001");
        assert_eq!(c.rate_limit.general_burst, 7);
        let err = load_str("", &[("MESHGATE_RATE_LIMIT_GENERAL_BURST", "many")]).unwrap_err();
        assert!(
            err.0[0].contains("MESHGATE_RATE_LIMIT_GENERAL_BURST"),
            "{:?}",
            err.0
        );
    }

    /// `cluster.peer_ca_file`: required by an https:// advertise, set by its
    /// environment variable, and refused when unreadable or without a
    /// certificate.
    #[test]
    fn peer_ca_file() {
        let err = load_str("[cluster]\nadvertise = \"https://10.0.0.1:8443\"\n", &[]).unwrap_err();
        assert!(
            err.0.iter().any(|e| e.contains("cluster.peer_ca_file")),
            "{:?}",
            err.0
        );
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, TEST_CA_PEM).unwrap();
        let ca = ca.to_str().unwrap();
        let c = load_str(
            "[cluster]\nadvertise = \"https://10.0.0.1:8443\"\n",
            &[("MESHGATE_CLUSTER_PEER_CA_FILE", ca)],
        )
        .unwrap();
        assert_eq!(c.cluster.peer_ca_file, ca);
        let missing = dir.path().join("missing.pem");
        let err = load_str(&format!("[cluster]\npeer_ca_file = {:?}\n", missing), &[]).unwrap_err();
        assert!(
            err.0
                .iter()
                .any(|e| e.starts_with("cluster.peer_ca_file: cannot read")),
            "{:?}",
            err.0
        );
        // No PEM block at all, and a block that is no certificate.
        for (name, text) in [
            ("empty.pem", "no certificate\n"),
            (
                "junk.pem",
                "-----BEGIN CERTIFICATE-----\nMAAA\n-----END CERTIFICATE-----\n",
            ),
        ] {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            let err = load_str(&format!("[cluster]\npeer_ca_file = {path:?}\n"), &[]).unwrap_err();
            assert!(
                err.0
                    .iter()
                    .any(|e| e.contains("holds no usable CA certificate")),
                "{name}: {:?}",
                err.0
            );
        }
    }

    /// A self-signed CA (P-256), only ever parsed.
    const TEST_CA_PEM: &str = "-----BEGIN CERTIFICATE-----
MIIBmDCCAT+gAwIBAgIUYPMQGMDCVnBr/GmDckjx8Ah5aqEwCgYIKoZIzj0EAwIw
IjEgMB4GA1UEAwwXbWVzaGdhdGUgY29uZmlnIHRlc3QgQ0EwHhcNMjYxMjAxMDIz
MjI3WhcNMzYxMTI4MDIzMjI3WjAiMSAwHgYDVQQDDBdtZXNoZ2F0ZSBjb25maWcg
dGVzdCBDQTBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABAwLTFubmfoeUAm36SE1
O0UoTFCxM9Q/1b9sbH3Kqj3F098doiYbMrobt6wpRVGWFp29QzFxo+ym8pWtba6Y
9oSjUzBRMB0GA1UdDgQWBBQ2Phj00jd5SW1pvrn3ik3lqBl56zAfBgNVHSMEGDAW
gBQ2Phj00jd5SW1pvrn3ik3lqBl56zAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49
BAMCA0cAMEQCIF4X18I+Meh0QyiHnyJQg9veZMwsFeYAFzZkJmF2w7T8AiBzcUlU
PNfgJ9loRPpJb1LMrytoEbopSvjUL9ez11Jdyg==
-----END CERTIFICATE-----
";

    /// The example `config.toml` at the repository root lists every key with its default.
    #[test]
    fn example_config_is_complete_and_default() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config.toml");
        let c = Config::load(Some(&path), &[], &Overrides::default()).unwrap();
        let example = toml::Table::try_from(&c).unwrap();
        let defaults = toml::Table::try_from(Config::default()).unwrap();
        assert_eq!(example, defaults);
        let text: toml::Table = std::fs::read_to_string(&path).unwrap().parse().unwrap();
        for (section, keys) in &defaults {
            for key in keys.as_table().unwrap().keys() {
                assert!(
                    text.get(section).and_then(|s| s.get(key)).is_some(),
                    "config.toml lacks {section}.{key}"
                );
            }
        }
    }

    /// `cluster.etcd` takes http:// endpoints (from the file or the environment) and names each bad one.
    #[test]
    fn etcd_endpoints() {
        assert!(load_str("", &[]).unwrap().cluster.etcd.is_empty());
        let c = load_str(
            "[cluster]\netcd = [\"http://127.0.0.1:2379\", \"http://10.0.0.2:2379\"]\n",
            &[],
        )
        .unwrap();
        assert_eq!(c.cluster.etcd.len(), 2);
        let c = load_str("", &[("MESHGATE_CLUSTER_ETCD", "[\"http://e:2379\"]")]).unwrap();
        assert_eq!(c.cluster.etcd, ["http://e:2379"]);
        let err = load_str(
            "[cluster]\netcd = [\"127.0.0.1:2379\", \"ftp://e:2379\", \"http://\"]\n",
            &[],
        )
        .unwrap_err();
        assert_eq!(err.0.len(), 3, "{:?}", err.0);
        assert!(
            err.0.iter().all(|e| e.starts_with("cluster.etcd")),
            "{:?}",
            err.0
        );
    }

    /// Every list setting, present and future, takes a comma-separated list
    /// from the environment as well as a TOML array; an empty value is no items.
    #[test]
    fn every_list_setting_takes_a_comma_list_from_the_environment() {
        let defaults = toml::Table::try_from(Config::default()).unwrap();
        let mut lists = 0;
        for (section, keys) in &defaults {
            for (key, default) in keys.as_table().unwrap() {
                if !default.is_array() {
                    continue;
                }
                lists += 1;
                let name = format!("MESHGATE_{}_{}", section.to_uppercase(), key.to_uppercase());
                for (raw, want) in [
                    ("10.0.0.1", vec!["10.0.0.1"]),
                    (" 10.0.0.1 , 10.0.0.2,", vec!["10.0.0.1", "10.0.0.2"]),
                    ("[\"10.0.0.3\"]", vec!["10.0.0.3"]),
                    ("", vec![]),
                ] {
                    let mut table = toml::Table::new();
                    let mut errors = Vec::new();
                    apply_env(
                        &mut table,
                        &defaults,
                        &[(name.clone(), raw.to_string())],
                        &mut errors,
                    );
                    assert!(errors.is_empty(), "{name}={raw:?}: {errors:?}");
                    let got = &table[section.as_str()][key.as_str()];
                    let want = toml::Value::Array(
                        want.into_iter()
                            .map(|w| toml::Value::String(w.into()))
                            .collect(),
                    );
                    assert_eq!(got, &want, "{name}={raw:?}");
                    let mut problems = Vec::new();
                    check_keys(&table, &defaults, &mut problems);
                    assert!(problems.is_empty(), "{name}={raw:?}: {problems:?}");
                }
            }
        }
        assert!(lists >= 3, "only {lists} list settings found");
    }

    /// A comma list is read as strings, or as typed TOML items when the
    /// setting takes those; neither fitting, strings are kept for the type error.
    #[test]
    fn comma_list_items_follow_the_setting_type() {
        let ints = |v: &toml::Value| v.as_array().unwrap().iter().all(|i| i.is_integer());
        let strs = |v: &toml::Value| v.as_array().unwrap().iter().all(|i| i.is_str());
        assert_eq!(
            env_list("1, 2", ints),
            toml::Value::Array(vec![toml::Value::Integer(1), toml::Value::Integer(2)])
        );
        assert_eq!(
            env_list("1,x", strs),
            toml::Value::Array(vec![
                toml::Value::String("1".into()),
                toml::Value::String("x".into())
            ])
        );
        assert_eq!(
            env_list("1,x", ints),
            toml::Value::Array(vec![
                toml::Value::String("1".into()),
                toml::Value::String("x".into())
            ])
        );
    }

    /// `MESHGATE_CLUSTER_ETCD` takes one endpoint, or several comma-separated,
    /// and still validates each; a non-list setting keeps refusing a bad value.
    #[test]
    fn etcd_endpoints_from_a_comma_list() {
        let c = load_str("", &[("MESHGATE_CLUSTER_ETCD", "http://127.0.0.1:2379")]).unwrap();
        assert_eq!(c.cluster.etcd, ["http://127.0.0.1:2379"]);
        let c = load_str(
            "[cluster]\netcd = [\"http://file:2379\"]\n",
            &[(
                "MESHGATE_CLUSTER_ETCD",
                "http://127.0.0.1:2379,http://127.0.0.2:2379",
            )],
        )
        .unwrap();
        assert_eq!(
            c.cluster.etcd,
            ["http://127.0.0.1:2379", "http://127.0.0.2:2379"]
        );
        let err = load_str(
            "",
            &[(
                "MESHGATE_CLUSTER_ETCD",
                "http://127.0.0.1:2379,127.0.0.2:2379",
            )],
        )
        .unwrap_err();
        assert_eq!(err.0.len(), 1, "{:?}", err.0);
        assert!(err.0[0].contains("\"127.0.0.2:2379\""), "{:?}", err.0);
        let c = load_str(
            "",
            &[("MESHGATE_RATE_LIMIT_TRUSTED_PROXIES", "10.0.0.1,::1")],
        )
        .unwrap();
        assert_eq!(c.rate_limit.trusted_proxies, ["10.0.0.1", "::1"]);
        assert!(load_str("", &[("MESHGATE_SERVER_WORKERS", "1,2")]).is_err());
    }

    /// https:// etcd endpoints with a CA, a client certificate and a user are
    /// accepted, also from the environment; each incomplete or contradictory
    /// setting is named.
    #[test]
    fn etcd_tls_and_user() {
        let c = load_str(
            "[cluster]\netcd = [\"https://127.0.0.1:2379\"]\netcd_ca_file = \"ca.pem\"\netcd_cert_file = \"c.pem\"\netcd_key_file = \"c.key\"\netcd_user = \"mg\"\netcd_password_file = \"pw\"\n",
            &[],
        )
        .unwrap();
        assert_eq!(c.cluster.etcd_ca_file, "ca.pem");
        assert_eq!(c.cluster.etcd_user, "mg");
        let c = load_str(
            "[cluster]\netcd = [\"https://127.0.0.1:2379\"]\n",
            &[
                ("MESHGATE_CLUSTER_ETCD_CA_FILE", "/etc/ca.pem"),
                ("MESHGATE_CLUSTER_ETCD_CERT_FILE", "/etc/c.pem"),
                ("MESHGATE_CLUSTER_ETCD_KEY_FILE", "/etc/c.key"),
                ("MESHGATE_CLUSTER_ETCD_USER", "mg"),
                ("MESHGATE_CLUSTER_ETCD_PASSWORD_FILE", "/etc/pw"),
            ],
        )
        .unwrap();
        assert_eq!(
            (
                c.cluster.etcd_ca_file.as_str(),
                c.cluster.etcd_cert_file.as_str(),
                c.cluster.etcd_key_file.as_str(),
                c.cluster.etcd_user.as_str(),
                c.cluster.etcd_password_file.as_str()
            ),
            ("/etc/ca.pem", "/etc/c.pem", "/etc/c.key", "mg", "/etc/pw")
        );
        for (text, want) in [
            (
                "etcd = [\"https://e:2379\"]\n",
                "cluster.etcd_ca_file: https://",
            ),
            (
                "etcd = [\"https://e:2379\"]\netcd_ca_file = \"ca\"\netcd_cert_file = \"c\"\n",
                "cluster.etcd_cert_file and cluster.etcd_key_file",
            ),
            (
                "etcd = [\"http://e:2379\"]\netcd_user = \"u\"\n",
                "cluster.etcd_user and cluster.etcd_password_file",
            ),
            (
                "etcd = [\"http://e:2379\"]\netcd_ca_file = \"ca\"\n",
                "cluster.etcd_ca_file: set, but cluster.etcd names http://",
            ),
            (
                "etcd = [\"http://e:2379\", \"https://f:2379\"]\netcd_ca_file = \"ca\"\n",
                "cluster.etcd: mixes http:// and https://",
            ),
            (
                "etcd_password_file = \"pw\"\netcd_user = \"u\"\n",
                "cluster.etcd_user: set, but cluster.etcd is empty",
            ),
        ] {
            let err = load_str(&format!("[cluster]\n{text}"), &[]).unwrap_err();
            assert!(
                err.0.iter().any(|e| e.starts_with(want)),
                "{text:?}: {:?}",
                err.0
            );
        }
    }

    /// Semantic validation names each bad value.
    #[test]
    fn validation_of_values() {
        let err = load_str(
            "[server]\nlisten = \"nowhere\"\nlog_format = \"xml\"\n",
            &[],
        )
        .unwrap_err();
        assert_eq!(err.0.len(), 2, "{:?}", err.0);
    }

    /// The workers' nice value is 0..=19: below is a priority above the
    /// request path's (and needs privileges), above is not a nice value.
    #[test]
    fn worker_nice_is_bounded() {
        for bad in ["-1", "20"] {
            let err = load_str(&format!("[functions]\nworker_nice = {bad}\n"), &[]).unwrap_err();
            assert!(
                err.0.iter().any(|e| e.contains("functions.worker_nice")),
                "{err:?}"
            );
        }
        let c = load_str("", &[("MESHGATE_FUNCTIONS_WORKER_NICE", "0")]).unwrap();
        assert_eq!(c.functions.worker_nice, 0);
        assert_eq!(Config::default().functions.worker_nice, 10);
    }

    /// `[metrics]`: closed by default with no second listener; `listen` must
    /// be host:port other than the main listener; both keys from the
    /// environment too.
    #[test]
    fn metrics_section() {
        let c = load_str("", &[]).unwrap();
        assert!(!c.metrics.public);
        assert_eq!(c.metrics_listen_addr(), None);
        let c = load_str(
            "[metrics]\nlisten = \"127.0.0.1:9100\"\npublic = true\n",
            &[],
        )
        .unwrap();
        assert_eq!(c.metrics_listen_addr(), Some("127.0.0.1:9100"));
        assert!(c.metrics.public);
        let c = load_str(
            "",
            &[
                ("MESHGATE_METRICS_LISTEN", "127.0.0.1:9101"),
                ("MESHGATE_METRICS_PUBLIC", "true"),
            ],
        )
        .unwrap();
        assert_eq!(c.metrics_listen_addr(), Some("127.0.0.1:9101"));
        assert!(c.metrics.public);
        let err = load_str("[metrics]\nlisten = \"nowhere\"\n", &[]).unwrap_err();
        assert!(
            err.0.iter().any(|e| e.contains("metrics.listen")),
            "{err:?}"
        );
        assert_eq!(c.metrics.namespace_series_limit, 100);
        let err = load_str(
            "[server]\nlisten = \"127.0.0.1:9000\"\n[metrics]\nlisten = \"127.0.0.1:9000\"\n",
            &[],
        )
        .unwrap_err();
        assert!(
            err.0.iter().any(|e| e.contains("metrics.listen")),
            "{err:?}"
        );
    }

    /// `[grpc]`: no listener by default; `listen` is host:port, not another
    /// listener's; from the environment too.
    #[test]
    fn grpc_section() {
        let c = load_str("", &[]).unwrap();
        assert_eq!(c.grpc_listen_addr(), None);
        let c = load_str("[grpc]\nlisten = \"127.0.0.1:9200\"\n", &[]).unwrap();
        assert_eq!(c.grpc_listen_addr(), Some("127.0.0.1:9200"));
        let c = load_str("", &[("MESHGATE_GRPC_LISTEN", "127.0.0.1:9201")]).unwrap();
        assert_eq!(c.grpc_listen_addr(), Some("127.0.0.1:9201"));
        for bad in [
            "[grpc]\nlisten = \"nowhere\"\n",
            "[server]\nlisten = \"127.0.0.1:9000\"\n[grpc]\nlisten = \"127.0.0.1:9000\"\n",
            "[metrics]\nlisten = \"127.0.0.1:9100\"\n[grpc]\nlisten = \"127.0.0.1:9100\"\n",
            "[grpc]\nport = 1\n",
        ] {
            let err = load_str(bad, &[]).unwrap_err();
            assert!(err.0.iter().any(|e| e.contains("grpc")), "{bad}: {err:?}");
        }
    }
}

#[cfg(test)]
mod scale_tests {
    use super::*;

    fn load_str(text: &str) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, text).unwrap();
        Config::load(Some(&path), &[], &Overrides::default())
    }

    /// `[metrics] namespace_series_limit` and `[dashboard] top_namespaces`:
    /// 100 by default; 0 or past their cap is refused, both named at once.
    #[test]
    fn series_limit_and_top_namespaces_are_bounded() {
        let c = load_str("").unwrap();
        assert_eq!(c.metrics.namespace_series_limit, 100);
        assert_eq!(c.dashboard.top_namespaces, 100);
        let c = load_str(
            "[metrics]\nnamespace_series_limit = 10000\n[dashboard]\ntop_namespaces = 5\n",
        )
        .unwrap();
        assert_eq!(c.metrics.namespace_series_limit, 10_000);
        assert_eq!(c.dashboard.top_namespaces, 5);
        for bad in [0, 10_001] {
            let err = load_str(&format!(
                "[metrics]\nnamespace_series_limit = {bad}\n[dashboard]\ntop_namespaces = 0\n"
            ))
            .unwrap_err();
            assert!(
                err.0
                    .iter()
                    .any(|e| e.contains("metrics.namespace_series_limit")),
                "{err:?}"
            );
            assert!(
                err.0.iter().any(|e| e.contains("dashboard.top_namespaces")),
                "{err:?}"
            );
        }
    }
}

/// A range of `upstream_allow` / `upstream_deny`: CIDR, or one address.
pub fn parse_range(s: &str) -> Option<ipnet::IpNet> {
    let s = s.trim();
    s.parse::<ipnet::IpNet>()
        .ok()
        .or_else(|| s.parse::<std::net::IpAddr>().ok().map(ipnet::IpNet::from))
}
