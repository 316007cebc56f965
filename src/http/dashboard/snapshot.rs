//! One snapshot of the node as the dashboard shows it, built from the node's
//! Prometheus registry and actor directory (the same handles `/metrics` exports),
//! and the per-second rates derived from two consecutive readings.
//!
//! A node may hold a hundred thousand namespaces, so a snapshot carries the
//! node's totals and only the `[dashboard] top_namespaces` most active
//! namespaces (and their actors); the rows of all the others stay in memory,
//! unserialised, for the search route.

use serde::Serialize;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

/// Namespaces with their own numbers in a history point (the most active
/// of the tick): ten minutes of points stay a few hundred KB.
pub const HISTORY_NAMESPACES: usize = 20;

/// How many ticks the handling-time percentiles look back over.
pub const QUANTILE_WINDOW_TICKS: usize = 10;

/// Deployments with a row in a snapshot at most: the most requested of the
/// tick (the route series hold more; a tick's payload stays small).
pub const TOP_DEPLOYMENTS: usize = 10;

/// Routes per deployment row at most, the most requested first.
pub const TOP_ROUTES: usize = 10;

/// One route of a deployment (its declared `path_prefix`, or `_other` past
/// the route series cap), from `meshgate_route_requests_total` and
/// `meshgate_route_duration_seconds`.
#[derive(Debug, Clone, Serialize, Default)]
pub struct RouteRow {
    /// The route's label: its declared `path_prefix`.
    pub route: String,
    /// Requests it answered since start, every status class.
    pub requests: u64,
    /// `requests` per second since the previous tick.
    #[serde(serialize_with = "hundredths")]
    pub requests_per_sec: f64,
    /// Share of its answers with a 5xx status over the last
    /// `QUANTILE_WINDOW_TICKS` ticks, 0 to 1; None when it answered nothing then.
    #[serde(serialize_with = "thousandths")]
    pub error_share: Option<f64>,
    /// Answer time percentiles (until the response headers) over the last
    /// `QUANTILE_WINDOW_TICKS` ticks, in seconds; None when it answered nothing then.
    #[serde(serialize_with = "tenth_micros")]
    pub p50_seconds: Option<f64>,
    /// As `p50_seconds`, the 99th percentile.
    #[serde(serialize_with = "tenth_micros")]
    pub p99_seconds: Option<f64>,
}

/// One deployment's row: its routes and its upstream instances' health.
#[derive(Debug, Clone, Serialize, Default)]
pub struct DeploymentRow {
    /// Its namespace.
    pub namespace: String,
    /// Its name (`_other` past the route series cap).
    pub deployment: String,
    /// Requests its routes answered since start.
    pub requests: u64,
    /// Sum of its routes' requests per second.
    #[serde(serialize_with = "hundredths")]
    pub requests_per_sec: f64,
    /// Its upstream instances now (0 for a static site).
    pub instances: usize,
    /// Those in rotation (neither passive nor active health has them out).
    pub instances_healthy: usize,
    /// Routes with numbers, most requested first, at most [`TOP_ROUTES`].
    pub routes: Vec<RouteRow>,
    /// Routes with numbers, shown or not.
    pub routes_ranked: usize,
    /// The certificate its hosts are served with (None: the deployment is
    /// no longer active, e.g. deleted while its route series live on).
    pub tls: Option<TlsCell>,
}

/// Most characters of an ACME error a row carries (the full one is in
/// `GET /v1/deployments/{name}/certificate`).
pub const ACME_ERROR_CHARS: usize = 120;

/// A deployment's certificate in its row.
#[derive(Debug, Clone, Serialize, Default)]
pub struct TlsCell {
    /// `node_pair` (no certificate of its own: the node's pair),
    /// `uploaded` or `acme` (`tls: "auto"`).
    pub mode: &'static str,
    /// The leaf's end of validity, RFC 3339; None without a certificate.
    pub not_after: Option<String>,
    /// The leaf's end of validity is past.
    pub expired: bool,
    /// For `acme`: its order's state as this node last saw it.
    pub acme: Option<AcmeCell>,
}

/// The ACME part of a [`TlsCell`].
#[derive(Debug, Clone, Serialize, Default)]
pub struct AcmeCell {
    /// `pending`, `valid` or `failed`.
    pub state: String,
    /// The last failure's reason, cut to [`ACME_ERROR_CHARS`] characters.
    pub last_error: Option<String>,
    /// After a failure: no order before this, RFC 3339.
    pub next_attempt: Option<String>,
}

/// One actor's row.
#[derive(Debug, Clone, Serialize)]
pub struct ActorRow {
    /// The actor's directory id (unique per node, in start order); rows sort by it.
    pub id: u64,
    /// `node` or `namespace`.
    pub kind: &'static str,
    /// The namespace it serves; empty for the node actor.
    pub namespace: String,
    /// Messages waiting in its mailbox now.
    pub mailbox_depth: i64,
    /// Messages handled since start (its `(kind, namespace)` label series).
    pub handled: u64,
    /// `handled` per second since the previous tick.
    #[serde(serialize_with = "hundredths")]
    pub handled_per_sec: f64,
    /// Handling time percentiles over the last `QUANTILE_WINDOW_TICKS` ticks, in
    /// seconds, of the actor's `(kind, namespace)` series; None when it handled nothing then.
    #[serde(serialize_with = "tenth_micros")]
    pub p50_seconds: Option<f64>,
    /// As `p50_seconds`, the 99th percentile.
    #[serde(serialize_with = "tenth_micros")]
    pub p99_seconds: Option<f64>,
    /// Restarts of this actor after a panic.
    pub restarts: u64,
}

/// One breaker (a namespace's view of one member node).
#[derive(Debug, Clone, Serialize)]
pub struct BreakerRow {
    /// The member node's id (the breaker gauge's `member` label).
    pub member: String,
    /// `closed`, `half-open` or `open`.
    pub state: &'static str,
}

/// One namespace's row.
#[derive(Debug, Clone, Serialize, Default)]
pub struct NamespaceRow {
    /// The namespace's name, or its metric label (`_other` past the label cap).
    pub namespace: String,
    /// Whether its supervisor runs on this node now.
    pub running: bool,
    /// Live actors serving it.
    pub actors: usize,
    /// Sum of its actors' mailbox depths.
    pub mailbox_depth: i64,
    /// Sum of its actors' messages handled.
    pub handled: u64,
    /// Sum of its actors' handled per second.
    #[serde(serialize_with = "hundredths")]
    pub handled_per_sec: f64,
    /// Sum of its actors' restarts.
    pub restarts: u64,
    /// Live topic subscriptions on this node (`meshgate_ws_subscribers`).
    pub subscribers: i64,
    /// Topics with at least one local subscriber (`meshgate_pubsub_topics`).
    pub topics: i64,
    /// Messages published since start.
    pub publishes: u64,
    /// `publishes` per second since the previous tick.
    #[serde(serialize_with = "hundredths")]
    pub publishes_per_sec: f64,
    /// Function invocations since start.
    pub invocations: u64,
    /// `invocations` per second since the previous tick.
    #[serde(serialize_with = "hundredths")]
    pub invocations_per_sec: f64,
    /// Failed function invocations since start.
    pub errors: u64,
    /// `errors` per second since the previous tick.
    #[serde(serialize_with = "hundredths")]
    pub errors_per_sec: f64,
    /// Its breakers, one per member node, sorted by member.
    pub breakers: Vec<BreakerRow>,
}

/// The node's own numbers.
#[derive(Debug, Clone, Serialize, Default)]
pub struct NodeRow {
    /// The crate version the node was built from.
    pub version: &'static str,
    /// Seconds since the node's metrics were created (its start).
    pub uptime_seconds: u64,
    /// `starting`, `ready` or `draining`.
    pub phase: String,
    /// HTTP requests finished since start, every status class.
    pub http_requests: u64,
    /// `http_requests` per second since the previous tick.
    #[serde(serialize_with = "hundredths")]
    pub http_requests_per_sec: f64,
    /// HTTP requests being handled now.
    pub http_in_flight: i64,
    /// WebSocket connections open now.
    pub ws_connections: i64,
    /// Live topic subscriptions, every namespace.
    pub ws_subscribers: i64,
    /// WASM workers running a guest now.
    pub wasm_pool_busy: i64,
    /// Invocations waiting for a free WASM worker.
    pub wasm_pool_queued: i64,
    /// WASM worker threads in the pool.
    pub wasm_pool_workers: i64,
    /// Resident memory from `/proc/self/status` (`VmRSS`), in bytes; 0 where unknown.
    pub memory_rss_bytes: u64,
    /// Live actors, the node actor included.
    pub actors: usize,
    /// Namespaces whose supervisor runs on this node now.
    pub namespaces_running: usize,
    /// Namespaces in the store (listed every few ticks).
    pub namespaces_known: usize,
    /// Messages handled since start, summed over every actor.
    pub messages_handled: u64,
    /// Messages published since start, every namespace.
    pub publishes: u64,
    /// Function invocations since start, every namespace.
    pub invocations: u64,
    /// Failed invocations since start, every namespace.
    pub errors: u64,
    /// Topics with a local subscriber, every namespace.
    pub topics: i64,
    /// Messages handled per second, summed over every actor.
    #[serde(serialize_with = "hundredths")]
    pub handled_per_sec: f64,
    /// Publishes per second, summed over the namespace rows.
    #[serde(serialize_with = "hundredths")]
    pub publishes_per_sec: f64,
    /// Invocations per second, summed over the namespace rows.
    #[serde(serialize_with = "hundredths")]
    pub invocations_per_sec: f64,
    /// Failed invocations per second, summed over the namespace rows.
    #[serde(serialize_with = "hundredths")]
    pub errors_per_sec: f64,
}

/// Everything the page shows at one tick.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Snapshot {
    /// Unix milliseconds when taken.
    pub at_ms: u64,
    /// Sequence number of the tick (increases by one per tick).
    pub tick: u64,
    /// The node-wide numbers.
    pub node: NodeRow,
    /// How many namespaces [`Snapshot::namespaces`] holds at most
    /// (`[dashboard] top_namespaces`).
    pub top_namespaces: usize,
    /// Namespaces with numbers on this node (running, or with series); the
    /// rows ranked for the top N.
    pub namespaces_ranked: usize,
    /// The most active namespaces, most active first (handled, publishes and
    /// invocations per second, then their totals, then by name); stored
    /// namespaces with no numbers fill the list when fewer are active.
    pub namespaces: Vec<NamespaceRow>,
    /// One row per live actor of the node or of a namespace in
    /// [`Snapshot::namespaces`], by id.
    pub actors: Vec<ActorRow>,
    /// How many deployments [`Snapshot::deployments`] holds at most ([`TOP_DEPLOYMENTS`]).
    pub top_deployments: usize,
    /// Deployments with route series on this node.
    pub deployments_ranked: usize,
    /// The most requested deployments of the tick (requests per second, then
    /// requests since start, then by namespace and name).
    pub deployments: Vec<DeploymentRow>,
    /// Every ranked namespace's row, by name, for the search (not sent).
    #[serde(skip)]
    pub all: Arc<Vec<NamespaceRow>>,
    /// The stored namespaces' names as last listed, for the search (not sent).
    #[serde(skip)]
    pub known: Arc<Vec<String>>,
}

/// A rate to two decimals (the page shows at most two): `0.33`, not
/// `0.3333333333333333`; a tick's payload is mostly numbers.
fn hundredths<S: serde::Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64((v * 100.0).round() / 100.0)
}

/// A share to three decimals.
fn thousandths<S: serde::Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.serialize_some(&((v * 1000.0).round() / 1000.0)),
        None => s.serialize_none(),
    }
}

/// A duration in seconds to a tenth of a microsecond.
fn tenth_micros<S: serde::Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.serialize_some(&((v * 1e7).round() / 1e7)),
        None => s.serialize_none(),
    }
}

/// How many rows a search answers at most.
pub const SEARCH_LIMIT: usize = 50;

impl Snapshot {
    /// Namespaces whose name contains `q` (lower-cased), exact match first,
    /// then by name; at most [`SEARCH_LIMIT`]. A stored namespace with no
    /// numbers on this node is answered with an empty row.
    pub fn search(&self, q: &str) -> (Vec<NamespaceRow>, usize) {
        let q = q.trim().to_lowercase();
        let mut rows: Vec<NamespaceRow> = Vec::new();
        let mut seen = HashSet::new();
        let mut matched = 0usize;
        for r in self.all.iter().filter(|r| r.namespace.contains(&q)) {
            matched += 1;
            seen.insert(r.namespace.as_str());
            rows.push(r.clone());
        }
        for name in self.known.iter().filter(|n| n.contains(&q)) {
            if !seen.contains(name.as_str()) {
                matched += 1;
                rows.push(NamespaceRow {
                    namespace: name.clone(),
                    ..Default::default()
                });
            }
        }
        rows.sort_by(|a, b| {
            (b.namespace == q)
                .cmp(&(a.namespace == q))
                .then_with(|| a.namespace.cmp(&b.namespace))
        });
        rows.truncate(SEARCH_LIMIT);
        (rows, matched)
    }
}

/// A namespace row's rank key: more activity first.
pub(crate) fn activity(r: &NamespaceRow) -> (f64, u64) {
    (
        r.handled_per_sec + r.publishes_per_sec + r.invocations_per_sec,
        r.handled + r.publishes + r.invocations,
    )
}

/// One point of history, for the charts.
#[derive(Debug, Clone, Serialize)]
pub struct HistoryPoint {
    /// The snapshot's time, Unix milliseconds.
    pub at_ms: u64,
    /// HTTP requests per second ([`NodeRow::http_requests_per_sec`]).
    pub http_rps: f64,
    /// Actor messages handled per second, node-wide.
    pub handled_ps: f64,
    /// Publishes per second, node-wide.
    pub publishes_ps: f64,
    /// Invocations per second, node-wide.
    pub invocations_ps: f64,
    /// Failed invocations per second, node-wide.
    pub errors_ps: f64,
    /// WebSocket connections open.
    pub connections: i64,
    /// Live topic subscriptions.
    pub subscribers: i64,
    /// Resident memory in bytes.
    pub memory_rss_bytes: u64,
    /// Per namespace, for the [`HISTORY_NAMESPACES`] most active of the
    /// tick: `[handled/s, publishes/s, invocations/s]`.
    pub ns: BTreeMap<String, [f64; 3]>,
}

impl HistoryPoint {
    /// The chart numbers of one snapshot.
    pub fn of(s: &Snapshot) -> HistoryPoint {
        HistoryPoint {
            at_ms: s.at_ms,
            http_rps: s.node.http_requests_per_sec,
            handled_ps: s.node.handled_per_sec,
            publishes_ps: s.node.publishes_per_sec,
            invocations_ps: s.node.invocations_per_sec,
            errors_ps: s.node.errors_per_sec,
            connections: s.node.ws_connections,
            subscribers: s.node.ws_subscribers,
            memory_rss_bytes: s.node.memory_rss_bytes,
            ns: s
                .namespaces
                .iter()
                .take(HISTORY_NAMESPACES)
                .map(|n| {
                    (
                        n.namespace.clone(),
                        [
                            n.handled_per_sec,
                            n.publishes_per_sec,
                            n.invocations_per_sec,
                        ],
                    )
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One tick at the default 100 namespaces stays under 64 KB on a single
    /// node with the longest names (63 characters), large counters, rates
    /// that do not divide evenly, one actor per namespace. (In a cluster
    /// each member's breaker adds about 40 bytes per namespace.)
    #[test]
    fn a_tick_of_100_namespaces_stays_under_64_kb() {
        let name = |i: usize| format!("{i:03}{}", "n".repeat(60));
        let namespaces: Vec<NamespaceRow> = (0..100)
            .map(|i| NamespaceRow {
                namespace: name(i),
                running: true,
                actors: 1,
                mailbox_depth: 1_000,
                handled: 123_456_789_012,
                handled_per_sec: 10_000.0 / 3.0,
                restarts: 12,
                subscribers: 10_000,
                topics: 1_000,
                publishes: 123_456_789_012,
                publishes_per_sec: 10_000.0 / 7.0,
                invocations: 123_456_789_012,
                invocations_per_sec: 1_000.0 / 3.0,
                errors: 123_456,
                errors_per_sec: 1.0 / 3.0,
                breakers: Vec::new(),
            })
            .collect();
        let actors: Vec<ActorRow> = (0..101)
            .map(|i| ActorRow {
                id: 1_000_000 + i as u64,
                kind: "namespace",
                namespace: name(i),
                mailbox_depth: 1_000,
                handled: 123_456_789_012,
                handled_per_sec: 10_000.0 / 3.0,
                p50_seconds: Some(1.0 / 3_000.0),
                p99_seconds: Some(1.0 / 30.0),
                restarts: 12,
            })
            .collect();
        let snap = Snapshot {
            at_ms: 1_800_000_000_000,
            tick: 1_000_000,
            top_namespaces: 100,
            namespaces_ranked: 100_000,
            namespaces,
            actors,
            ..Default::default()
        };
        let json = serde_json::to_string(&snap).unwrap();
        assert!(json.len() <= 64 * 1024, "{} bytes", json.len());
        assert!(
            json.contains("\"handled_per_sec\":3333.33,"),
            "rates rounded"
        );
    }

    /// The Deployments panel at its bound ([`TOP_DEPLOYMENTS`] rows of
    /// [`TOP_ROUTES`] routes, 63-character names, 64-character routes, an
    /// ACME certificate cell with an error at its cut) adds under 28 KB to a
    /// tick.
    #[test]
    fn the_deployments_of_a_tick_stay_under_28_kb() {
        let deployments: Vec<DeploymentRow> = (0..TOP_DEPLOYMENTS)
            .map(|i| DeploymentRow {
                namespace: format!("{i:03}{}", "n".repeat(60)),
                deployment: format!("{i:03}{}", "d".repeat(60)),
                requests: 123_456_789_012,
                requests_per_sec: 10_000.0 / 3.0,
                instances: 16,
                instances_healthy: 15,
                routes_ranked: 1_000,
                tls: Some(TlsCell {
                    mode: "acme",
                    not_after: Some("2027-03-07T17:00:00Z".into()),
                    expired: false,
                    acme: Some(AcmeCell {
                        state: "failed".into(),
                        last_error: Some("e".repeat(ACME_ERROR_CHARS + 1)),
                        next_attempt: Some("2026-12-07T17:00:00Z".into()),
                    }),
                }),
                routes: (0..TOP_ROUTES)
                    .map(|j| RouteRow {
                        route: format!("/{j:03}{}", "r".repeat(60)),
                        requests: 123_456_789_012,
                        requests_per_sec: 1_000.0 / 3.0,
                        error_share: Some(1.0 / 3.0),
                        p50_seconds: Some(1.0 / 3_000.0),
                        p99_seconds: Some(1.0 / 30.0),
                    })
                    .collect(),
            })
            .collect();
        let json = serde_json::to_string(&deployments).unwrap();
        assert!(json.len() <= 28 * 1024, "{} bytes", json.len());
        assert!(json.contains("\"error_share\":0.333,"), "shares rounded");
    }
}
