//! Every metric the node exports, defined in one place (`/metrics`, and read by
//! the dashboard: one source of truth).
//!
//! Namespaces are recorded under their own label value (the dashboard and
//! `GET /v1/namespaces/{namespace}/stats` read them), but the exposition is
//! bounded: [`Metrics::render`] keeps the series of the top
//! `[metrics] namespace_series_limit` namespaces by activity and sums every
//! other namespace into the label value [`OTHER_NAMESPACE`] (a namespace
//! name can never start with `_`, so it cannot collide with one). The
//! families with a `namespace` label live in [`namespaced`], which keeps
//! their node totals as they move, so a scrape reads the top N and the
//! totals, never every namespace's series.

#![forbid(unsafe_code)]
// Registering the node's fixed metric set at start-up fails only on a
// programming error (a name or label set written twice): it runs before any
// request, so it may unwrap.
#![allow(clippy::unwrap_used)]

use prometheus::core::Collector;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

pub mod namespaced;
pub use namespaced::{
    NsCounter, NsCounterVec, NsGauge, NsGaugeVec, NsHistogram, NsHistogramVec, NsIndex,
    OTHER_NAMESPACE,
};

/// Default of `[metrics] namespace_series_limit`.
pub const DEFAULT_NAMESPACE_SERIES_LIMIT: usize = 100;
/// Largest `[metrics] namespace_series_limit` the configuration accepts.
pub const MAX_NAMESPACE_SERIES_LIMIT: usize = 10_000;

/// The node's metrics. Cheap to clone.
#[derive(Clone)]
pub struct Metrics(Arc<Inner>);

/// The metric handles behind [`Metrics`]; reached through its `Deref`.
pub struct Inner {
    /// Every metric below is registered here; `/metrics` renders it and the
    /// dashboard reads the same series.
    pub registry: Registry,
    /// When the metrics were created (node start); the dashboard's uptime.
    pub started: std::time::Instant,
    // Actors.
    /// Messages waiting in actor mailboxes, by `kind` and (capped) `namespace`.
    pub actor_mailbox_depth: NsGaugeVec,
    /// Messages handled, by actor `kind` and `namespace`.
    pub actor_handled: NsCounterVec,
    /// Seconds spent handling one message, by `kind` and `namespace`; the
    /// dashboard's p50/p99 come from its buckets.
    pub actor_handling_seconds: NsHistogramVec,
    /// Actor restarts after a panic, by `kind` and `namespace`.
    pub actor_restarts: NsCounterVec,
    /// Messages refused because the actor's mailbox was full.
    pub actor_overloaded: NsCounterVec,
    // HTTP.
    /// Finished HTTP requests by status `class` (`2xx` … `5xx`).
    pub http_requests: IntCounterVec,
    /// HTTP request duration in seconds, by status `class`.
    pub http_duration_seconds: HistogramVec,
    /// The two above for one class (`2xx`, `3xx`, `4xx`, other), looked up
    /// once: [`Metrics::http_class`].
    http_classes: [std::sync::OnceLock<(IntCounter, Histogram)>; 4],
    /// HTTP requests being handled now.
    pub http_in_flight: IntGauge,
    /// Requests refused by a rate limit, by `bucket` (`general`, `credential`,
    /// `namespace`, `wallet`).
    pub rate_limited: IntCounterVec,
    // Namespaces.
    /// Messages published, per namespace.
    pub publishes: NsCounterVec,
    /// Function invocations, per namespace.
    pub invocations: NsCounterVec,
    /// Function invocations that failed, per namespace.
    pub invocation_errors: NsCounterVec,
    /// WebSocket connections open now.
    pub ws_connections: IntGauge,
    /// Live topic subscriptions, per namespace.
    pub ws_subscribers: NsGaugeVec,
    /// Topics with at least one local subscriber, per namespace (set by pub/sub).
    pub pubsub_topics: NsGaugeVec,
    /// Frames handed to subscriber queues by the relays.
    pub pubsub_delivered: IntCounter,
    /// Frames not delivered, by `reason` (`gone`, `closing`, `slow_consumer`,
    /// `closed`, `relay_full`).
    pub pubsub_dropped: IntCounterVec,
    /// Subscriber sockets closed with 4008 because their queue stayed full.
    pub slow_consumers_closed: IntCounter,
    /// Snapshots the dashboard's sampler took (it takes none while nobody
    /// watches).
    pub dashboard_snapshots: IntCounter,
    /// Invocation records dropped because the invocation log's queue was full.
    pub invocation_records_dropped: IntCounter,
    /// WASM calls running a guest, on the pool or on request threads (the
    /// three pool gauges are sampled periodically by the functions service,
    /// not set per call).
    pub wasm_pool_busy: IntGauge,
    /// Invocations waiting for a free WASM worker.
    pub wasm_pool_queued: IntGauge,
    /// WASM worker threads in the pool.
    pub wasm_pool_workers: IntGauge,
    /// Instance slots of wasmtime's pooling allocator that held an instance
    /// and are free for the next (sampled with the pool gauges; 0 when the
    /// engine does not pool). Calls one after another reuse one slot, so it
    /// stays far below the calls made.
    pub wasm_instance_slots_warm: IntGauge,
    /// Breaker state per `namespace` and `member`: 0 closed, 1 half-open, 2 open.
    pub breaker_state: NsGaugeVec,
    /// Requests forwarded to a member, by outcome.
    pub forwards: IntCounterVec,
    /// Cron slots this node tried to claim: claimed, lost (another node had
    /// it) or error.
    pub cron_slots: IntCounterVec,
    /// Replacements of a gone namespace member this node attempted:
    /// `replaced` (its compare-and-swap wrote the record) or `lost`
    /// (another node's did first).
    pub member_replacements: IntCounterVec,
    /// ACME orders this node made for `tls: "auto"` deployments, by
    /// `outcome` (`issued`, `failed`).
    pub acme_orders: IntCounterVec,
    /// `tls: "auto"` deployments by the `state` of their certificate
    /// (`pending`, `valid`, `failed`), as this node last checked them.
    pub acme_certificates: IntGaugeVec,
    /// Namespace supervisors started or passivated (stopped idle), by
    /// `event` (`activated`, `passivated`); their difference is the live count.
    pub namespace_lifecycle: IntCounterVec,
    // Cluster mesh (pub/sub between nodes).
    /// Registered mesh peers this node is connected to.
    pub mesh_peers: IntGauge,
    /// Locally published messages sent into the mesh.
    pub mesh_sent: IntCounter,
    /// Valid messages received from the mesh (before ordering).
    pub mesh_received: IntCounter,
    /// Batches published into the mesh (each one GossipSub message).
    pub mesh_batches: IntCounter,
    /// Batch publishes refused because every peer's send queue was full
    /// (the batch waits and is retried).
    pub mesh_deferred: IntCounter,
    /// Mesh messages dropped, by reason (`queue_full`, `backlog_full`, `no_peers`,
    /// `too_large`, `publish_failed`, `decode`, `bad_origin`, `duplicate`, `stale`).
    pub mesh_dropped: IntCounterVec,
    /// Mesh messages whose delivery waited for room in a relay's queue (the
    /// mesh ingress held back instead of dropping).
    pub mesh_ingress_waits: IntCounter,
    /// Times a node read a history topic again from the store because its
    /// copy was behind (another node sequenced, or a mesh message was missed).
    pub history_catch_ups: IntCounter,
    /// Times a history topic's local subscribers were closed with 4011
    /// (insufficient state) to recover.
    pub history_broken: IntCounter,
    /// Flushes of the embedded store (sled): one per group of durable writes
    /// waiting at once (0 on etcd, which has none).
    pub store_flushes: IntCounter,
    /// Store records refused on read: a MAC that fails (edited, moved or
    /// swapped in the store), or a blob whose bytes do not match its hash.
    pub store_records_refused: IntCounter,
    /// Content-addressed blobs (modules, site files) stored after the last
    /// blob sweep.
    pub blobs_stored: IntGauge,
    /// Blobs deleted by blob sweeps: named by no record any more.
    pub blobs_deleted: IntCounter,
    /// Sequence numbers given up on, by `reason`: `sender_gone` (no
    /// connection to the sender left), `evicted` (no longer in the sender's
    /// resend buffer), `overflow` (the receiver's reorder buffer full),
    /// `restarted` (the sender started a new counter).
    pub mesh_gaps_skipped: IntCounterVec,
    /// Resend requests this node sent for gaps in other nodes' streams.
    pub mesh_resend_requests: IntCounter,
    /// Resend requests this node answered with messages.
    pub mesh_resends_served: IntCounter,
    /// Messages received by resend (they filled a gap).
    pub mesh_resent: IntCounter,
    /// Batches GossipSub could not queue to one peer (its send queue full,
    /// or past the send timeout); that peer gets them by resend.
    pub mesh_peer_queue_full: IntCounter,
    /// Mesh connections refused: unregistered peer or address.
    pub mesh_connections_refused: IntCounter,
    // Deployments (per route; labels bounded by `crate::deploy::activity`).
    /// Routed requests a deployment's route answered, by `namespace`,
    /// `deployment`, `route` (its declared `path_prefix`) and `status_class`.
    pub route_requests: NsCounterVec,
    /// Seconds a route took to answer (until the response headers), by
    /// `namespace`, `deployment` and `route`.
    pub route_duration_seconds: NsHistogramVec,
    /// Upstream attempts by `namespace`, `deployment`, `route`, `instance`
    /// and `outcome` (`answered`, `connect_failed`, `refused`, `timeout`, `failed`).
    pub upstream_requests: NsCounterVec,
    /// The series cap of the three above (`[metrics] route_series_limit`).
    pub route_labels: crate::observe::RouteLabels,
    /// Each deployment's latest requests on this node.
    pub route_activity: crate::observe::Activity,
    /// Every namespace's series and the node totals of their families
    /// ([`namespaced`]): what a scrape reads instead of every series.
    pub namespaced: Arc<NsIndex>,
}

const ACTOR_LABELS: &[&str] = &["kind", "namespace"];

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered; one per node.
    pub fn new() -> Metrics {
        let registry = Registry::new();
        macro_rules! reg {
            ($m:expr) => {{
                let m = $m;
                registry
                    .register(Box::new(m.clone()))
                    .expect("metric registered once");
                m
            }};
        }
        let latency = vec![
            0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5,
            1.0, 5.0,
        ];
        let ns = NsIndex::new();
        let inner = Inner {
            started: crate::util::mono_now(),
            actor_mailbox_depth: ns.gauge(
                "meshgate_actor_mailbox_depth",
                "Messages waiting in actor mailboxes",
                ACTOR_LABELS,
            ),
            actor_handled: ns.counter(
                "meshgate_actor_messages_handled_total",
                "Messages handled by actors",
                ACTOR_LABELS,
            ),
            actor_handling_seconds: ns.histogram(
                "meshgate_actor_handling_seconds",
                "Time an actor spends handling one message",
                ACTOR_LABELS,
                latency.clone(),
            ),
            actor_restarts: ns.counter(
                "meshgate_actor_restarts_total",
                "Actor restarts after a panic",
                ACTOR_LABELS,
            ),
            actor_overloaded: ns.counter(
                "meshgate_actor_overloaded_total",
                "Messages refused because a mailbox was full",
                ACTOR_LABELS,
            ),
            http_requests: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_http_requests_total",
                        "HTTP requests by status class"
                    ),
                    &["class"]
                )
                .unwrap()
            ),
            http_duration_seconds: reg!(
                HistogramVec::new(
                    HistogramOpts::new(
                        "meshgate_http_request_duration_seconds",
                        "HTTP request duration"
                    )
                    .buckets(latency),
                    &["class"]
                )
                .unwrap()
            ),
            http_in_flight: reg!(
                IntGauge::new("meshgate_http_in_flight", "HTTP requests in flight").unwrap()
            ),
            rate_limited: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_rate_limited_total",
                        "Requests refused by a rate limit"
                    ),
                    &["bucket"]
                )
                .unwrap()
            ),
            publishes: ns.counter(
                "meshgate_pubsub_published_total",
                "Messages published",
                &["namespace"],
            ),
            invocations: ns.counter(
                "meshgate_function_invocations_total",
                "Function invocations",
                &["namespace"],
            ),
            invocation_errors: ns.counter(
                "meshgate_function_errors_total",
                "Function invocations that failed",
                &["namespace"],
            ),
            ws_connections: reg!(
                IntGauge::new("meshgate_ws_connections", "Open WebSocket connections").unwrap()
            ),
            ws_subscribers: ns.gauge(
                "meshgate_ws_subscribers",
                "Live topic subscriptions",
                &["namespace"],
            ),
            pubsub_topics: ns.gauge(
                "meshgate_pubsub_topics",
                "Topics with local subscribers",
                &["namespace"],
            ),
            pubsub_delivered: reg!(
                IntCounter::new(
                    "meshgate_pubsub_delivered_total",
                    "Frames handed to subscriber queues"
                )
                .unwrap()
            ),
            pubsub_dropped: reg!(
                IntCounterVec::new(
                    Opts::new("meshgate_pubsub_dropped_total", "Frames dropped"),
                    &["reason"]
                )
                .unwrap()
            ),
            slow_consumers_closed: reg!(
                IntCounter::new(
                    "meshgate_ws_slow_consumers_closed_total",
                    "Sockets closed with 4008"
                )
                .unwrap()
            ),
            dashboard_snapshots: reg!(
                IntCounter::new(
                    "meshgate_dashboard_snapshots_total",
                    "Snapshots taken by the dashboard's sampler (none while nobody watches)"
                )
                .unwrap()
            ),
            invocation_records_dropped: reg!(
                IntCounter::new(
                    "meshgate_invocation_records_dropped_total",
                    "Invocation records dropped because the log queue was full"
                )
                .unwrap()
            ),
            wasm_pool_busy: reg!(
                IntGauge::new(
                    "meshgate_wasm_pool_busy",
                    "WASM calls running a guest (pool threads and request threads)"
                )
                .unwrap()
            ),
            wasm_pool_queued: reg!(
                IntGauge::new(
                    "meshgate_wasm_pool_queued",
                    "Invocations waiting for a worker"
                )
                .unwrap()
            ),
            wasm_pool_workers: reg!(
                IntGauge::new(
                    "meshgate_wasm_pool_workers",
                    "WASM worker threads, the spare one included"
                )
                .unwrap()
            ),
            wasm_instance_slots_warm: reg!(
                IntGauge::new(
                    "meshgate_wasm_instance_slots_warm",
                    "Pooling allocator instance slots used before and free for the next instance"
                )
                .unwrap()
            ),
            breaker_state: ns.gauge(
                "meshgate_breaker_state",
                "Breaker state per member (0 closed, 1 half-open, 2 open)",
                &["namespace", "member"],
            ),
            forwards: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_forwards_total",
                        "Requests forwarded to a namespace's member, by outcome"
                    ),
                    &["outcome"]
                )
                .unwrap()
            ),
            cron_slots: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_cron_slots_total",
                        "Cron slots this node tried to claim, by outcome"
                    ),
                    &["outcome"]
                )
                .unwrap()
            ),
            acme_orders: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_acme_orders_total",
                        "ACME orders this node made for tls \"auto\" deployments, by outcome"
                    ),
                    &["outcome"]
                )
                .unwrap()
            ),
            acme_certificates: reg!(
                IntGaugeVec::new(
                    Opts::new(
                        "meshgate_acme_certificates",
                        "tls \"auto\" deployments by the state of their certificate"
                    ),
                    &["state"]
                )
                .unwrap()
            ),
            member_replacements: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_member_replacements_total",
                        "Replacements of a gone namespace member this node attempted, by outcome"
                    ),
                    &["outcome"]
                )
                .unwrap()
            ),
            namespace_lifecycle: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_namespace_supervisors_total",
                        "Namespace supervisors activated or passivated, by event"
                    ),
                    &["event"]
                )
                .unwrap()
            ),
            mesh_peers: reg!(
                IntGauge::new("meshgate_mesh_peers", "Registered mesh peers connected").unwrap()
            ),
            mesh_sent: reg!(
                IntCounter::new(
                    "meshgate_mesh_messages_sent_total",
                    "Messages published into the cluster mesh"
                )
                .unwrap()
            ),
            mesh_received: reg!(
                IntCounter::new(
                    "meshgate_mesh_messages_received_total",
                    "Valid messages received from the cluster mesh"
                )
                .unwrap()
            ),
            mesh_batches: reg!(
                IntCounter::new(
                    "meshgate_mesh_batches_sent_total",
                    "Batches (GossipSub messages) published into the cluster mesh"
                )
                .unwrap()
            ),
            mesh_deferred: reg!(
                IntCounter::new(
                    "meshgate_mesh_publishes_deferred_total",
                    "Mesh batch publishes deferred because every peer's send queue was full"
                )
                .unwrap()
            ),
            mesh_dropped: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_mesh_messages_dropped_total",
                        "Cluster mesh messages dropped"
                    ),
                    &["reason"]
                )
                .unwrap()
            ),
            mesh_ingress_waits: reg!(
                IntCounter::new(
                    "meshgate_mesh_ingress_waits_total",
                    "Mesh deliveries that waited for room in a relay's queue"
                )
                .unwrap()
            ),
            history_catch_ups: reg!(
                IntCounter::new(
                    "meshgate_history_catch_ups_total",
                    "History topics read again from the store because this node's copy was behind"
                )
                .unwrap()
            ),
            history_broken: reg!(
                IntCounter::new(
                    "meshgate_history_insufficient_state_total",
                    "History topics whose local subscribers were closed with 4011 to recover"
                )
                .unwrap()
            ),
            store_flushes: reg!(
                IntCounter::new(
                    "meshgate_store_flushes_total",
                    "Flushes of the embedded store: one per group of durable writes waiting at once"
                )
                .unwrap()
            ),
            store_records_refused: reg!(
                IntCounter::new(
                    "meshgate_store_records_refused_total",
                    "Store records refused on read: a MAC or blob hash that does not verify"
                )
                .unwrap()
            ),
            blobs_stored: reg!(
                IntGauge::new(
                    "meshgate_blobs",
                    "Content-addressed blobs (modules, site files) stored after the last blob sweep"
                )
                .unwrap()
            ),
            blobs_deleted: reg!(
                IntCounter::new(
                    "meshgate_blobs_deleted_total",
                    "Blobs deleted by blob sweeps: named by no record any more"
                )
                .unwrap()
            ),
            mesh_gaps_skipped: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_mesh_gaps_skipped_total",
                        "Mesh sequence numbers given up on, by reason (sender_gone, evicted, overflow, restarted)"
                    ),
                    &["reason"]
                )
                .unwrap()
            ),
            mesh_resend_requests: reg!(
                IntCounter::new(
                    "meshgate_mesh_resend_requests_total",
                    "Resend requests sent for gaps in other nodes' mesh streams"
                )
                .unwrap()
            ),
            mesh_resends_served: reg!(
                IntCounter::new(
                    "meshgate_mesh_resends_served_total",
                    "Resend requests answered with messages"
                )
                .unwrap()
            ),
            mesh_resent: reg!(
                IntCounter::new(
                    "meshgate_mesh_resent_messages_total",
                    "Mesh messages received by resend"
                )
                .unwrap()
            ),
            mesh_peer_queue_full: reg!(
                IntCounter::new(
                    "meshgate_mesh_peer_queue_full_total",
                    "Mesh batches not queued to one peer (its send queue full); resent on its request"
                )
                .unwrap()
            ),
            mesh_connections_refused: reg!(
                IntCounter::new(
                    "meshgate_mesh_connections_refused_total",
                    "Mesh connections refused (unregistered peer or address)"
                )
                .unwrap()
            ),
            route_requests: ns.counter(
                "meshgate_route_requests_total",
                "Routed requests answered by a deployment's route, by status class",
                &["namespace", "deployment", "route", "status_class"],
            ),
            route_duration_seconds: ns.histogram(
                "meshgate_route_duration_seconds",
                "Time a deployment's route took to answer (response headers)",
                &["namespace", "deployment", "route"],
                vec![
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0,
                ],
            ),
            upstream_requests: ns.counter(
                "meshgate_upstream_requests_total",
                "Attempts to reach a deployment's upstream instance, by outcome",
                &["namespace", "deployment", "route", "instance", "outcome"],
            ),
            route_labels: Default::default(),
            route_activity: Default::default(),
            http_classes: Default::default(),
            namespaced: ns,
            registry,
        };
        Metrics(Arc::new(inner))
    }

    /// The request counter and duration histogram of a status's class,
    /// resolved once per class (a label lookup hashes and locks).
    pub fn http_class(&self, status: u16) -> &(IntCounter, Histogram) {
        let (i, class) = match status / 100 {
            2 => (0, "2xx"),
            3 => (1, "3xx"),
            4 => (2, "4xx"),
            _ => (3, "5xx"),
        };
        self.0.http_classes[i].get_or_init(|| {
            (
                self.0.http_requests.with_label_values(&[class]),
                self.0.http_duration_seconds.with_label_values(&[class]),
            )
        })
    }

    /// The label value a namespace's series are recorded under: its name.
    /// The registry holds one series set per namespace that was active on
    /// this node; the exposition ([`Metrics::render`]) is what is capped.
    pub fn ns_label(&self, namespace: &str) -> String {
        namespace.to_string()
    }

    /// The Prometheus text exposition: every metric, the `namespace` label
    /// bounded to the `limit` most active namespaces plus [`OTHER_NAMESPACE`]
    /// (see [`top_namespaces`]).
    pub fn render(&self, limit: usize) -> String {
        let top = self.namespaced.top(limit);
        let names: HashSet<&str> = top.iter().map(|e| e.name()).collect();
        let keep = |ns: &str| ns.is_empty() || names.contains(ns);
        // The registry holds the series without a namespace label and the
        // upstream instances (read from the live pools, bounded by quota).
        let mut families: Vec<_> = self
            .0
            .registry
            .gather()
            .into_iter()
            .map(|f| merge_label(f, "namespace", Some(&keep)))
            .collect();
        families.extend(self.namespaced.render(&top));
        families.sort_by(|a, b| a.name().cmp(b.name()));
        encode(&families)
    }

    /// The text exposition without namespace names, for `[metrics] public =
    /// true`: every series with a `namespace` label is summed over it
    /// (counters, gauges, histogram buckets), the other labels kept but
    /// `deployment`, `route` and `instance`, summed away likewise. The
    /// namespaced families are read from their node totals, kept as they move.
    pub fn render_public(&self) -> String {
        let mut families: Vec<_> = self
            .0
            .registry
            .gather()
            .into_iter()
            .map(|f| merge_label(f, "namespace", None))
            .chain(self.namespaced.totals())
            // A deployment's name, route and instance addresses are its
            // namespace's business too: summed away the same way.
            .map(|f| merge_label(f, "deployment", None))
            .map(|f| merge_label(f, "route", None))
            .map(|f| merge_label(f, "instance", None))
            .collect();
        families.sort_by(|a, b| a.name().cmp(b.name()));
        encode(&families)
    }

    /// One namespace's numbers, read from its own series (no series is
    /// created by reading); zeros for a namespace with none on this node.
    pub fn namespace_stats(&self, namespace: &str) -> NamespaceStats {
        let mut out = NamespaceStats::default();
        self.namespaced.each_of(namespace, |family, label, v| {
            let (c, g) = (v as u64, v as i64);
            match family {
                "meshgate_actor_mailbox_depth" => out.mailbox_depth += g,
                "meshgate_actor_messages_handled_total" => out.messages_handled += c,
                "meshgate_actor_restarts_total" => out.restarts += c,
                "meshgate_actor_overloaded_total" => out.overloaded += c,
                "meshgate_pubsub_published_total" => out.published += c,
                "meshgate_function_invocations_total" => out.invocations += c,
                "meshgate_function_errors_total" => out.invocation_errors += c,
                "meshgate_ws_subscribers" => out.subscribers += g,
                "meshgate_pubsub_topics" => out.topics += g,
                "meshgate_breaker_state" => {
                    out.breakers.insert(label("member"), g);
                }
                _ => {}
            }
        });
        out
    }
}

/// One namespace's totals on this node since it started
/// (`GET /v1/namespaces/{namespace}/stats`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct NamespaceStats {
    /// Messages its actors handled.
    pub messages_handled: u64,
    /// Messages waiting in its actors' mailboxes now.
    pub mailbox_depth: i64,
    /// Its actors' restarts after a panic.
    pub restarts: u64,
    /// Messages refused because one of its mailboxes was full.
    pub overloaded: u64,
    /// Messages published.
    pub published: u64,
    /// Function invocations.
    pub invocations: u64,
    /// Function invocations that failed.
    pub invocation_errors: u64,
    /// Live topic subscriptions.
    pub subscribers: i64,
    /// Topics with at least one local subscriber.
    pub topics: i64,
    /// Breaker state per member node: 0 closed, 1 half-open, 2 open.
    pub breakers: std::collections::BTreeMap<String, i64>,
}

/// One namespace's deployments on this node, by deployment name then by
/// route (its declared `path_prefix`), as `GET /v1/namespaces/{namespace}/stats`
/// answers them under `deployments`.
pub type DeploymentStats = BTreeMap<String, BTreeMap<String, RouteStats>>;

/// One deployment route's figures on this node since it started: what
/// `meshgate_route_requests_total`, `meshgate_route_duration_seconds` and
/// `meshgate_upstream_requests_total` hold for it.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RouteStats {
    /// Requests the route answered, by status class (`1xx` to `5xx`); a
    /// class it never answered is left out.
    pub requests: BTreeMap<String, u64>,
    /// Time to the response headers.
    pub latency: Latency,
    /// Attempts to reach an upstream instance, by outcome (`answered`,
    /// `connect_failed`, `refused`, `timeout`, `failed`), every instance
    /// summed; empty for a static site.
    pub upstream_attempts: BTreeMap<String, u64>,
}

/// A route's answer times, from its histogram (the buckets of
/// `meshgate_route_duration_seconds`, so a quantile is interpolated within
/// a bucket; past the last bucket, 30 s, it reads as the bound).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Latency {
    /// Requests timed.
    pub count: u64,
    /// Their seconds, summed.
    pub sum_seconds: f64,
    /// Median, in seconds; null before the first request.
    pub p50_seconds: Option<f64>,
    /// 90th percentile, in seconds.
    pub p90_seconds: Option<f64>,
    /// 99th percentile, in seconds.
    pub p99_seconds: Option<f64>,
}

/// The figures of the route a series' labels name, made on first use.
fn route_in<'a>(
    out: &'a mut DeploymentStats,
    label: &dyn Fn(&str) -> String,
) -> &'a mut RouteStats {
    out.entry(label("deployment"))
        .or_default()
        .entry(label("route"))
        .or_default()
}

impl Metrics {
    /// One namespace's deployment routes' figures, read from its own series
    /// (no series is created by reading; another namespace's are never
    /// read). A route counted past `[metrics] route_series_limit` is in the
    /// deployment and route `_other`.
    pub fn deployment_stats(&self, namespace: &str) -> DeploymentStats {
        let mut out = DeploymentStats::new();
        self.namespaced
            .each_record_of(namespace, |family, label, m| match family {
                "meshgate_route_requests_total" => {
                    let n = m.get_counter().get_value() as u64;
                    *route_in(&mut out, label)
                        .requests
                        .entry(label("status_class"))
                        .or_default() += n;
                }
                "meshgate_upstream_requests_total" => {
                    let n = m.get_counter().get_value() as u64;
                    *route_in(&mut out, label)
                        .upstream_attempts
                        .entry(label("outcome"))
                        .or_default() += n;
                }
                "meshgate_route_duration_seconds" => {
                    let h = m.get_histogram();
                    let bounds: Vec<f64> = h.get_bucket().iter().map(|b| b.upper_bound()).collect();
                    let counts: Vec<u64> = h
                        .get_bucket()
                        .iter()
                        .map(|b| b.cumulative_count())
                        .collect();
                    let q = |q| window_quantile(&bounds, &counts, None, q);
                    route_in(&mut out, label).latency = Latency {
                        count: h.get_sample_count(),
                        sum_seconds: h.get_sample_sum(),
                        p50_seconds: q(0.5),
                        p90_seconds: q(0.9),
                        p99_seconds: q(0.99),
                    };
                }
                _ => {}
            });
        out
    }
}

/// The `q` quantile of the observations between two cumulative readings.
pub fn window_quantile(bounds: &[f64], now: &[u64], before: Option<&[u64]>, q: f64) -> Option<f64> {
    let diff: Vec<u64> = now
        .iter()
        .enumerate()
        .map(|(i, c)| c.saturating_sub(before.and_then(|b| b.get(i)).copied().unwrap_or(0)))
        .collect();
    let total = *diff.last()?;
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let (mut prev_bound, mut prev_count) = (0.0, 0u64);
    for (bound, count) in bounds.iter().zip(&diff) {
        if *count as f64 >= rank {
            let in_bucket = (count - prev_count).max(1) as f64;
            let frac = ((rank - prev_count as f64) / in_bucket).clamp(0.0, 1.0);
            return Some(prev_bound + (bound - prev_bound) * frac);
        }
        prev_bound = *bound;
        prev_count = *count;
    }
    // Past the last finite bucket: report its bound (a lower bound of the truth).
    Some(prev_bound)
}

/// The text encoding of `families`.
fn encode(families: &[prometheus::proto::MetricFamily]) -> String {
    let mut buf = Vec::new();
    TextEncoder::new()
        .encode(families, &mut buf)
        .expect("text encoding");
    String::from_utf8(buf).expect("utf-8")
}

/// `family` with the label `label` rewritten: with `keep`, a series whose
/// value `keep` accepts is left as it is and any other gets
/// `label="_other"`; without `keep` every series loses the label. The series
/// that then share their labels become one, their values summed (counters,
/// gauges, histogram buckets).
fn merge_label(
    mut family: prometheus::proto::MetricFamily,
    label: &str,
    keep: Option<&dyn Fn(&str) -> bool>,
) -> prometheus::proto::MetricFamily {
    use prometheus::proto::{Bucket, LabelPair, Metric};
    if !family
        .get_metric()
        .iter()
        .any(|m| m.get_label().iter().any(|l| l.name() == label))
    {
        return family;
    }
    // The merged series in first-seen order, and each one's index by its labels.
    let mut merged: Vec<Metric> = Vec::new();
    let mut index: HashMap<Vec<(String, String)>, usize> = HashMap::new();
    for mut m in family.take_metric() {
        // A series that keeps its value is unique already: no merging.
        if let Some(keep) = keep
            && m.get_label()
                .iter()
                .any(|l| l.name() == label && keep(l.value()))
        {
            merged.push(m);
            continue;
        }
        let labels: Vec<_> = m
            .take_label()
            .into_iter()
            .filter_map(|mut l| {
                if l.name() != label {
                    return Some(l);
                }
                let keep = keep?;
                if !keep(l.value()) {
                    l.set_value(OTHER_NAMESPACE.to_string());
                }
                Some(l)
            })
            .collect::<Vec<LabelPair>>();
        let key: Vec<(String, String)> = labels
            .iter()
            .map(|l| (l.name().to_string(), l.value().to_string()))
            .collect();
        let Some(into) = index.get(&key).and_then(|&i| merged.get_mut(i)) else {
            m.set_label(labels);
            index.insert(key, merged.len());
            merged.push(m);
            continue;
        };
        let mut c = into.get_counter().clone();
        c.set_value(c.get_value() + m.get_counter().get_value());
        into.set_counter(c);
        let mut g = into.get_gauge().clone();
        g.set_value(g.get_value() + m.get_gauge().get_value());
        into.set_gauge(g);
        let (a, b) = (into.get_histogram(), m.get_histogram());
        let mut h = a.clone();
        h.set_sample_count(a.get_sample_count() + b.get_sample_count());
        h.set_sample_sum(a.get_sample_sum() + b.get_sample_sum());
        let buckets: Vec<Bucket> = a
            .get_bucket()
            .iter()
            .zip(b.get_bucket())
            .map(|(x, y)| {
                let mut z = x.clone();
                z.set_cumulative_count(x.cumulative_count() + y.cumulative_count());
                z
            })
            .collect();
        h.set_bucket(buckets);
        into.set_histogram(h);
    }
    family.set_metric(merged);
    family
}

impl Metrics {
    /// Counts one request a deployment's route answered and the upstream
    /// attempts it made, under the bounded labels of
    /// [`crate::observe::RouteLabels`].
    pub fn observe_route(
        &self,
        namespace: &str,
        deployment: &str,
        route: &str,
        status: u16,
        seconds: f64,
        attempts: &[crate::observe::Attempt],
    ) {
        self.observe_route_series(
            &RouteSeries::default(),
            namespace,
            deployment,
            route,
            status,
            seconds,
            attempts,
        );
    }

    /// [`Metrics::observe_route`] through a route's [`RouteSeries`]: the
    /// label admission and the series lookups are done on the route's first
    /// request and kept with it.
    #[allow(clippy::too_many_arguments)]
    pub fn observe_route_series(
        &self,
        series: &RouteSeries,
        namespace: &str,
        deployment: &str,
        route: &str,
        status: u16,
        seconds: f64,
        attempts: &[crate::observe::Attempt],
    ) {
        let r = series.0.get_or_init(|| {
            let (dep, rt) = self.route_labels.route(namespace, deployment, route);
            ResolvedRoute {
                duration: self
                    .route_duration_seconds
                    .with_label_values(&[namespace, dep, rt]),
                requests: Default::default(),
                dep: dep.to_string(),
                rt: rt.to_string(),
                attempts: Default::default(),
            }
        });
        // The index of `status_class`'s value.
        let class = match status / 100 {
            1 => 0,
            2 => 1,
            3 => 2,
            4 => 3,
            _ => 4,
        };
        r.requests[class]
            .get_or_init(|| {
                self.route_requests.with_label_values(&[
                    namespace,
                    &r.dep,
                    &r.rt,
                    crate::observe::status_class(status),
                ])
            })
            .inc();
        r.duration.observe(seconds);
        for (instance, outcome) in attempts {
            let known = r.attempts.load();
            if let Some((_, _, c)) = known.iter().find(|(i, o, _)| o == outcome && i == instance) {
                c.inc();
                continue;
            }
            let inst = self.route_labels.instance(namespace, deployment, instance);
            let c = self
                .upstream_requests
                .with_label_values(&[namespace, &r.dep, &r.rt, inst, outcome]);
            c.inc();
            // Kept for the next requests, up to a few instances and outcomes
            // (an instance list is at most 64 long; past this, looked up).
            if known.len() < MAX_KEPT_ATTEMPT_SERIES {
                r.attempts.rcu(|v| {
                    let mut v = Vec::clone(v);
                    if !v.iter().any(|(i, o, _)| o == outcome && i == instance) {
                        v.push((instance.clone(), *outcome, c.clone()));
                    }
                    v
                });
            }
        }
    }
}

/// Upstream-attempt series a route keeps resolved (instance, outcome).
const MAX_KEPT_ATTEMPT_SERIES: usize = 64;

/// A bound route's series (`crate::deploy::index::Bound`): resolved on its
/// first request, then counted without the label admission's lock or the
/// vectors' label hashing.
#[derive(Default)]
pub struct RouteSeries(std::sync::OnceLock<ResolvedRoute>);

struct ResolvedRoute {
    /// `route_requests` by status class (1xx to 5xx), each made on its first use.
    requests: [std::sync::OnceLock<NsCounter>; 5],
    duration: NsHistogram,
    /// The `deployment` and `route` label values (`_other` past the cap).
    dep: String,
    rt: String,
    /// `upstream_requests` by (instance, outcome), copied on write.
    attempts: arc_swap::ArcSwap<Vec<(String, &'static str, NsCounter)>>,
}

impl std::ops::Deref for Metrics {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

#[cfg(test)]
mod public_tests {
    use super::*;

    /// The public exposition names no namespace: each series is summed over
    /// the namespaces (counters, gauges and histograms), other labels kept.
    #[test]
    fn public_render_sums_namespaces_away() {
        let m = Metrics::new();
        m.publishes.with_label_values(&["alpha"]).inc_by(3);
        m.publishes.with_label_values(&["beta"]).inc_by(4);
        m.actor_handled
            .with_label_values(&["namespace", "alpha"])
            .inc_by(2);
        m.actor_handled
            .with_label_values(&["namespace", "beta"])
            .inc_by(5);
        m.actor_handled.with_label_values(&["node", ""]).inc();
        for (ns, secs) in [("alpha", 0.001), ("beta", 0.002)] {
            m.actor_handling_seconds
                .with_label_values(&["namespace", ns])
                .observe(secs);
        }
        let full = m.render(100);
        assert!(full.contains("alpha") && full.contains("beta"));
        let public = m.render_public();
        assert!(
            !public.contains("alpha") && !public.contains("beta"),
            "{public}"
        );
        assert!(
            public.contains("meshgate_pubsub_published_total 7\n"),
            "{public}"
        );
        assert!(
            public.contains("meshgate_actor_messages_handled_total{kind=\"namespace\"} 7\n"),
            "{public}"
        );
        assert!(
            public.contains("meshgate_actor_messages_handled_total{kind=\"node\"} 1\n"),
            "{public}"
        );
        assert!(
            public.contains("_count{kind=\"namespace\"} 2\n"),
            "{public}"
        );
    }

    /// Past the limit, `/metrics` keeps the most active namespaces' series and
    /// sums every other namespace into `_other`: at most limit + 1 namespace
    /// label values, and the totals unchanged.
    #[test]
    fn render_keeps_the_top_namespaces_and_sums_the_rest() {
        let m = Metrics::new();
        // ns0 is the busiest (10 messages), ns9 the quietest (1).
        for i in 0..10u64 {
            let ns = format!("ns{i}");
            m.actor_handled
                .with_label_values(&["namespace", &ns])
                .inc_by(10 - i);
            m.actor_handling_seconds
                .with_label_values(&["namespace", &ns])
                .observe(0.001);
        }
        m.actor_handled.with_label_values(&["node", ""]).inc_by(7);
        let text = m.render(3);
        let labels: HashSet<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split("namespace=\"").nth(1))
            .filter_map(|l| l.split('"').next())
            .collect();
        let want: HashSet<&str> = ["ns0", "ns1", "ns2", OTHER_NAMESPACE, ""].into();
        assert_eq!(labels, want, "{text}");
        let line = |labels: &str| {
            let prefix = format!("meshgate_actor_messages_handled_total{{{labels}}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix))
                .map(|v| v.trim().to_string())
        };
        // ns3..ns9 handled 7+6+5+4+3+2+1.
        assert_eq!(
            line("kind=\"namespace\",namespace=\"_other\"").as_deref(),
            Some("28"),
            "{text}"
        );
        assert_eq!(
            line("kind=\"namespace\",namespace=\"ns0\"").as_deref(),
            Some("10")
        );
        assert_eq!(line("kind=\"node\",namespace=\"\"").as_deref(), Some("7"));
        assert!(
            text.contains(
                "meshgate_actor_handling_seconds_count{kind=\"namespace\",namespace=\"_other\"} 7\n"
            ),
            "{text}"
        );
        // Under the limit nothing is merged.
        assert!(!m.render(100).contains("_other"));
    }

    /// Route series: counted under their declared labels, capped into
    /// `_other`, and without deployment, route or instance in the public
    /// exposition.
    #[test]
    fn route_series_are_bounded_and_public_hides_them() {
        let m = Metrics::new();
        m.route_labels.set_limit(1, 1);
        let a = [("http://10.0.0.1:80".to_string(), "answered")];
        m.observe_route("alpha", "web", "/api", 200, 0.01, &a);
        m.observe_route("alpha", "web", "/api", 503, 0.01, &a);
        m.observe_route("alpha", "shop", "/", 200, 0.01, &[]);
        let full = m.render(100);
        assert!(
            full.contains("meshgate_route_requests_total{deployment=\"web\",namespace=\"alpha\",route=\"/api\",status_class=\"5xx\"} 1\n"),
            "{full}"
        );
        assert!(
            full.contains("meshgate_route_requests_total{deployment=\"_other\",namespace=\"alpha\",route=\"_other\",status_class=\"2xx\"} 1\n"),
            "{full}"
        );
        assert!(full.contains("instance=\"http://10.0.0.1:80\""), "{full}");
        let public = m.render_public();
        assert!(
            !public.contains("web") && !public.contains("10.0.0.1") && !public.contains("alpha"),
            "{public}"
        );
        assert!(
            public.contains("meshgate_route_requests_total{status_class=\"2xx\"} 2\n"),
            "{public}"
        );
        assert!(
            public.contains("meshgate_upstream_requests_total{outcome=\"answered\"} 2\n"),
            "{public}"
        );
    }

    /// Every sample of an exposition: `name{labels}` with the `namespace`
    /// label dropped, summed over it.
    fn summed(text: &str) -> std::collections::BTreeMap<String, f64> {
        let mut out = std::collections::BTreeMap::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let (name, labels) = series.split_once('{').unwrap_or((series, "}"));
            let labels: Vec<&str> = labels
                .trim_end_matches('}')
                .split(',')
                .filter(|l| !l.is_empty() && !l.starts_with("namespace="))
                .collect();
            let key = if labels.is_empty() {
                name.to_string()
            } else {
                format!("{name}{{{}}}", labels.join(","))
            };
            *out.entry(key).or_insert(0.0) += value.parse::<f64>().unwrap();
        }
        out
    }

    /// After a mix of counters, gauges (moved and set) and histograms in
    /// several namespaces and the node's own series, the public exposition
    /// (the node totals kept as they move) equals the operator's summed over
    /// `namespace`, whatever the series limit (`_other` holds the rest), and
    /// a namespace's series still counts after its actors are gone.
    #[test]
    fn totals_equal_the_sum_over_namespaces() {
        let m = Metrics::new();
        for i in 0..12u64 {
            let ns = format!("ns{i}");
            let kind = ["namespace", "ns"];
            let stats = [kind[0], ns.as_str()];
            m.actor_handled.with_label_values(&stats).inc_by(i * 3 + 1);
            m.actor_handling_seconds
                .with_label_values(&stats)
                .observe(0.0001 * i as f64);
            m.actor_mailbox_depth
                .with_label_values(&stats)
                .add(i as i64);
            m.actor_mailbox_depth.with_label_values(&stats).dec();
            if i % 2 == 0 {
                m.publishes.with_label_values(&[&ns]).inc_by(i);
                m.ws_subscribers.with_label_values(&[&ns]).add(3);
                m.ws_subscribers.with_label_values(&[&ns]).add(-1);
            }
            if i % 3 == 0 {
                m.invocations.with_label_values(&[&ns]).inc();
                m.invocation_errors.with_label_values(&[&ns]).inc();
                m.breaker_state.with_label_values(&[&ns, "b"]).set(2);
                m.breaker_state
                    .with_label_values(&[&ns, "b"])
                    .set(i as i64 % 2);
            }
        }
        m.actor_handled.with_label_values(&["node", ""]).inc_by(5);
        m.observe_route("ns1", "web", "/", 200, 0.01, &[]);
        m.observe_route("ns2", "web", "/", 500, 0.02, &[]);
        let public = summed(&m.render_public());
        for limit in [100, 4, 1] {
            let text = m.render(limit);
            let mut operator = summed(&text);
            // The public view sums deployment and route away too.
            for k in [
                "meshgate_route_requests_total",
                "meshgate_route_duration_seconds",
            ] {
                operator.retain(|name, _| !name.starts_with(k));
            }
            let mut public = public.clone();
            public.retain(|name, _| !name.starts_with("meshgate_route_"));
            assert_eq!(operator, public, "limit {limit}:\n{text}");
        }
        assert!(public["meshgate_actor_messages_handled_total{kind=\"namespace\"}"] > 0.0);
        assert_eq!(public["meshgate_breaker_state{member=\"b\"}"], 2.0);
        assert_eq!(
            public["meshgate_route_requests_total{status_class=\"5xx\"}"],
            1.0
        );
        // Every namespace's series, summed by hand, is the total.
        let handled: u64 = (0..12u64).map(|i| i * 3 + 1).sum();
        assert_eq!(
            public["meshgate_actor_messages_handled_total{kind=\"namespace\"}"],
            handled as f64
        );
        let stats: u64 = (0..12)
            .map(|i| m.namespace_stats(&format!("ns{i}")).messages_handled)
            .sum();
        assert_eq!(stats, handled);
    }

    /// A namespace's stats read its own series only, and create none.
    #[test]
    fn namespace_stats_read_one_namespace() {
        let m = Metrics::new();
        m.actor_handled
            .with_label_values(&["namespace", "alpha"])
            .inc_by(4);
        m.actor_handled
            .with_label_values(&["namespace", "beta"])
            .inc_by(9);
        m.publishes.with_label_values(&["alpha"]).inc_by(2);
        m.ws_subscribers.with_label_values(&["alpha"]).set(3);
        let a = m.namespace_stats("alpha");
        assert_eq!(a.messages_handled, 4);
        assert_eq!(a.published, 2);
        assert_eq!(a.subscribers, 3);
        assert_eq!(m.namespace_stats("gamma").messages_handled, 0);
        assert!(!m.render(100).contains("gamma"), "reading made no series");
    }

    /// A namespace's deployment stats are its own routes' series, by
    /// deployment and route: requests by class, latency, upstream attempts;
    /// another namespace's same-named deployment is not in them.
    #[test]
    fn deployment_stats_read_one_namespace() {
        let m = Metrics::new();
        let a = vec![("http://10.0.0.1:80".to_string(), "answered")];
        m.observe_route("alpha", "web", "/api", 200, 0.01, &a);
        m.observe_route("alpha", "web", "/api", 503, 0.02, &a);
        m.observe_route("alpha", "site", "/", 404, 0.001, &[]);
        m.observe_route("beta", "web", "/api", 500, 5.0, &a);
        let s = m.deployment_stats("alpha");
        assert_eq!(s.keys().collect::<Vec<_>>(), ["site", "web"]);
        let api = &s["web"]["/api"];
        assert_eq!(
            api.requests,
            BTreeMap::from([("2xx".to_string(), 1), ("5xx".to_string(), 1)])
        );
        assert_eq!(api.upstream_attempts["answered"], 2);
        assert_eq!(api.latency.count, 2);
        assert!((api.latency.sum_seconds - 0.03).abs() < 1e-9);
        let p99 = api.latency.p99_seconds.expect("timed");
        assert!(p99 > 0.005 && p99 <= 0.025, "{p99}");
        assert!(s["site"]["/"].upstream_attempts.is_empty());
        assert_eq!(m.deployment_stats("beta")["web"]["/api"].requests["5xx"], 1);
        assert!(m.deployment_stats("gamma").is_empty());
    }
}

// Upstream instances: read from the live upstream pools at each
// scrape, so a deleted or replaced deployment's series go with it. Bounded:
// at most `MAX_INSTANCES` instances per deployment, deployments by quota,
// and the `namespace` label by `render`'s top N like every other series.

/// One upstream instance's state, for [`UpstreamSeries`].
pub struct UpstreamSample {
    pub namespace: String,
    pub deployment: String,
    /// The instance's base URL.
    pub instance: String,
    /// In rotation (neither passive nor active health has it out).
    pub healthy: bool,
    /// Requests sent to it and not yet answered.
    pub in_flight: u32,
    /// Its weight.
    pub weight: u32,
}

/// Reads the samples at scrape time.
type ReadSamples = Box<dyn Fn() -> Vec<UpstreamSample> + Send + Sync>;

/// A collector of `meshgate_upstream_healthy`, `meshgate_upstream_in_flight`
/// and `meshgate_upstream_weight` (`namespace`, `deployment`, `instance`).
pub struct UpstreamSeries {
    read: ReadSamples,
    /// Templates: their descriptions, and the options of each scrape's gauges.
    templates: [IntGaugeVec; 3],
}

const UPSTREAM_LABELS: &[&str] = &["namespace", "deployment", "instance"];

fn upstream_gauges() -> [IntGaugeVec; 3] {
    let g =
        |name: &str, help: &str| IntGaugeVec::new(Opts::new(name, help), UPSTREAM_LABELS).unwrap();
    [
        g(
            "meshgate_upstream_healthy",
            "1 while an upstream instance is in rotation (passive and active health), else 0",
        ),
        g(
            "meshgate_upstream_in_flight",
            "Requests sent to an upstream instance and not yet answered",
        ),
        g(
            "meshgate_upstream_weight",
            "An upstream instance's balancing weight",
        ),
    ]
}

impl Collector for UpstreamSeries {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.templates.iter().flat_map(|t| t.desc()).collect()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let [healthy, in_flight, weight] = upstream_gauges();
        for s in (self.read)() {
            let l = [
                s.namespace.as_str(),
                s.deployment.as_str(),
                s.instance.as_str(),
            ];
            healthy.with_label_values(&l).set(i64::from(s.healthy));
            in_flight.with_label_values(&l).set(i64::from(s.in_flight));
            weight.with_label_values(&l).set(i64::from(s.weight));
        }
        [healthy, in_flight, weight]
            .iter()
            .flat_map(|g| g.collect())
            .collect()
    }
}

impl Metrics {
    /// Registers the upstream instance series, read by `read` at each scrape
    /// (once per node, when its deployments service exists).
    pub fn register_upstreams(
        &self,
        read: impl Fn() -> Vec<UpstreamSample> + Send + Sync + 'static,
    ) {
        let c = UpstreamSeries {
            read: Box::new(read),
            templates: upstream_gauges(),
        };
        if let Err(e) = self.0.registry.register(Box::new(c)) {
            tracing::warn!(error = %e, "Upstream series not registered.");
        }
    }
}
