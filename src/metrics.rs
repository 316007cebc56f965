//! Every metric the node exports, defined in one place (`/metrics`, and read by
//! the dashboard: one source of truth). Namespace labels are capped at
//! [`MAX_NAMESPACE_LABELS`]; later namespaces share the label `_other`.

#![forbid(unsafe_code)]
// Registering the node's fixed metric set at start-up fails only on a
// programming error (a name or label set written twice): it runs before any
// request, so it may unwrap.
#![allow(clippy::unwrap_used)]

use parking_lot::Mutex;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use std::collections::HashSet;
use std::sync::Arc;

/// Namespaces that get their own label value; the rest are `_other`.
pub const MAX_NAMESPACE_LABELS: usize = 200;

/// The node's metrics. Cheap to clone.
#[derive(Clone)]
pub struct Metrics(Arc<Inner>);

/// The metric handles behind [`Metrics`]; reached through its `Deref`.
pub struct Inner {
    /// Every metric below is registered here; `/metrics` renders it and the
    /// dashboard reads the same series.
    pub registry: Registry,
    /// Namespaces already given their own label value (at most
    /// [`MAX_NAMESPACE_LABELS`]); see [`Metrics::ns_label`].
    labelled: Mutex<HashSet<String>>,
    /// When the metrics were created (node start); the dashboard's uptime.
    pub started: std::time::Instant,
    // Actors.
    /// Messages waiting in actor mailboxes, by `kind` and (capped) `namespace`.
    pub actor_mailbox_depth: IntGaugeVec,
    /// Messages handled, by actor `kind` and `namespace`.
    pub actor_handled: IntCounterVec,
    /// Seconds spent handling one message, by `kind` and `namespace`; the
    /// dashboard's p50/p99 come from its buckets.
    pub actor_handling_seconds: HistogramVec,
    /// Actor restarts after a panic, by `kind` and `namespace`.
    pub actor_restarts: IntCounterVec,
    /// Messages refused because the actor's mailbox was full.
    pub actor_overloaded: IntCounterVec,
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
    pub publishes: IntCounterVec,
    /// Function invocations, per namespace.
    pub invocations: IntCounterVec,
    /// Function invocations that failed, per namespace.
    pub invocation_errors: IntCounterVec,
    /// WebSocket connections open now.
    pub ws_connections: IntGauge,
    /// Live topic subscriptions, per namespace.
    pub ws_subscribers: IntGaugeVec,
    /// Topics with at least one local subscriber, per namespace (set by pub/sub).
    pub pubsub_topics: IntGaugeVec,
    /// Frames handed to subscriber queues by the relays.
    pub pubsub_delivered: IntCounter,
    /// Frames not delivered, by `reason` (`gone`, `closing`, `slow_consumer`,
    /// `closed`, `relay_full`).
    pub pubsub_dropped: IntCounterVec,
    /// Subscriber sockets closed with 4008 because their queue stayed full.
    pub slow_consumers_closed: IntCounter,
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
    /// Breaker state per `namespace` and `member`: 0 closed, 1 half-open, 2 open.
    pub breaker_state: IntGaugeVec,
    /// Requests forwarded to a member, by outcome.
    pub forwards: IntCounterVec,
    /// Cron slots this node tried to claim: claimed, lost (another node had
    /// it) or error.
    pub cron_slots: IntCounterVec,
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
    /// `too_large`, `publish_failed`, `decode`, `bad_origin`, `duplicate`, `stale`;
    /// at the namespace's supervisor: `mailbox_full`, `namespace_stopped`).
    pub mesh_dropped: IntCounterVec,
    /// Sequence numbers given up on after a gap timed out or a buffer filled.
    pub mesh_gaps_skipped: IntCounter,
    /// Mesh connections refused: unregistered peer or address.
    pub mesh_connections_refused: IntCounter,
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
        let inner = Inner {
            labelled: Mutex::new(HashSet::new()),
            started: crate::util::mono_now(),
            actor_mailbox_depth: reg!(
                IntGaugeVec::new(
                    Opts::new(
                        "meshgate_actor_mailbox_depth",
                        "Messages waiting in actor mailboxes"
                    ),
                    ACTOR_LABELS
                )
                .unwrap()
            ),
            actor_handled: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_actor_messages_handled_total",
                        "Messages handled by actors"
                    ),
                    ACTOR_LABELS
                )
                .unwrap()
            ),
            actor_handling_seconds: reg!(
                HistogramVec::new(
                    HistogramOpts::new(
                        "meshgate_actor_handling_seconds",
                        "Time an actor spends handling one message"
                    )
                    .buckets(latency.clone()),
                    ACTOR_LABELS
                )
                .unwrap()
            ),
            actor_restarts: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_actor_restarts_total",
                        "Actor restarts after a panic"
                    ),
                    ACTOR_LABELS
                )
                .unwrap()
            ),
            actor_overloaded: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_actor_overloaded_total",
                        "Messages refused because a mailbox was full"
                    ),
                    ACTOR_LABELS
                )
                .unwrap()
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
            publishes: reg!(
                IntCounterVec::new(
                    Opts::new("meshgate_pubsub_published_total", "Messages published"),
                    &["namespace"]
                )
                .unwrap()
            ),
            invocations: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_function_invocations_total",
                        "Function invocations"
                    ),
                    &["namespace"]
                )
                .unwrap()
            ),
            invocation_errors: reg!(
                IntCounterVec::new(
                    Opts::new(
                        "meshgate_function_errors_total",
                        "Function invocations that failed"
                    ),
                    &["namespace"]
                )
                .unwrap()
            ),
            ws_connections: reg!(
                IntGauge::new("meshgate_ws_connections", "Open WebSocket connections").unwrap()
            ),
            ws_subscribers: reg!(
                IntGaugeVec::new(
                    Opts::new("meshgate_ws_subscribers", "Live topic subscriptions"),
                    &["namespace"]
                )
                .unwrap()
            ),
            pubsub_topics: reg!(
                IntGaugeVec::new(
                    Opts::new("meshgate_pubsub_topics", "Topics with local subscribers"),
                    &["namespace"]
                )
                .unwrap()
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
            breaker_state: reg!(
                IntGaugeVec::new(
                    Opts::new(
                        "meshgate_breaker_state",
                        "Breaker state per member (0 closed, 1 half-open, 2 open)"
                    ),
                    &["namespace", "member"]
                )
                .unwrap()
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
            mesh_gaps_skipped: reg!(
                IntCounter::new(
                    "meshgate_mesh_gaps_skipped_total",
                    "Sequence numbers skipped after a gap timed out"
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
            http_classes: Default::default(),
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

    /// The label value for a namespace, capped so label cardinality stays bounded.
    pub fn ns_label(&self, namespace: &str) -> String {
        let mut set = self.0.labelled.lock();
        if set.contains(namespace) {
            return namespace.to_string();
        }
        if set.len() < MAX_NAMESPACE_LABELS {
            set.insert(namespace.to_string());
            return namespace.to_string();
        }
        "_other".to_string()
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.0.registry.gather(), &mut buf)
            .expect("text encoding");
        String::from_utf8(buf).expect("utf-8")
    }

    /// The text exposition without namespace names, for `[metrics] public =
    /// true`: every series with a `namespace` label is summed over it
    /// (counters, gauges, histogram buckets), the other labels kept.
    pub fn render_public(&self) -> String {
        let families: Vec<_> = self
            .0
            .registry
            .gather()
            .into_iter()
            .map(|f| without_label(f, "namespace"))
            .collect();
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&families, &mut buf)
            .expect("text encoding");
        String::from_utf8(buf).expect("utf-8")
    }
}

/// `family` with the label `label` dropped: the series that differed only in
/// it become one, their values summed.
fn without_label(
    mut family: prometheus::proto::MetricFamily,
    label: &str,
) -> prometheus::proto::MetricFamily {
    use prometheus::proto::{Bucket, Metric};
    if !family
        .get_metric()
        .iter()
        .any(|m| m.get_label().iter().any(|l| l.name() == label))
    {
        return family;
    }
    // Kept labels → the merged series, in first-seen order.
    let mut merged: Vec<(Vec<(String, String)>, Metric)> = Vec::new();
    for mut m in family.take_metric() {
        let labels: Vec<_> = m
            .take_label()
            .into_iter()
            .filter(|l| l.name() != label)
            .collect();
        let key: Vec<(String, String)> = labels
            .iter()
            .map(|l| (l.name().to_string(), l.value().to_string()))
            .collect();
        let Some((_, into)) = merged.iter_mut().find(|(k, _)| *k == key) else {
            m.set_label(labels);
            merged.push((key, m));
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
    family.set_metric(merged.into_iter().map(|(_, m)| m).collect());
    family
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
        let full = m.render();
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
}
