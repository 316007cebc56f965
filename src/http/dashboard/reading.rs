//! Reading the node into a [`Snapshot`]: the node's Prometheus registry and
//! actor directory (the same handles `/metrics` exports), and the per-second
//! rates derived from two consecutive readings ([`Previous`]). The sampler
//! calls [`take`] once a tick.

use super::snapshot::{
    ACME_ERROR_CHARS, AcmeCell, ActorRow, BreakerRow, DeploymentRow, NamespaceRow, NodeRow,
    QUANTILE_WINDOW_TICKS, RouteRow, Snapshot, TOP_DEPLOYMENTS, TOP_ROUTES, TlsCell, activity,
};
use crate::actors::ActorStats;
use crate::http::state::Node;
use crate::metrics::{Metrics, window_quantile};
use prometheus::core::Collector;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

/// A handling-time series: `(kind, namespace label)`.
type SeriesKey = (String, String);

/// A route series: `(namespace, deployment, route)`.
type RouteKey = (String, String, String);

/// One route's cumulative numbers at one tick.
#[derive(Clone, Default)]
pub struct RouteReading {
    /// Requests answered since start, every status class.
    pub requests: u64,
    /// Of those, answered with a 5xx status.
    pub errors: u64,
    /// Its answer time buckets.
    buckets: Buckets,
}

/// Cumulative histogram buckets of one series: upper bounds and counts.
#[derive(Clone, Default)]
struct Buckets {
    /// Upper bound of each bucket, in seconds, ascending.
    bounds: Vec<f64>,
    /// Observations at or below the matching bound, since start.
    counts: Vec<u64>,
}

/// What the sampler remembers between ticks to turn totals into rates.
#[derive(Default)]
pub struct Previous {
    /// When the last snapshot was taken; None before the first (rates read 0).
    at: Option<Instant>,
    /// The last tick's sequence number.
    tick: u64,
    /// Each live actor's `handled` at the last tick, by actor id.
    actor_handled: HashMap<u64, u64>,
    /// Each namespace's `[publishes, invocations, errors]` at the last tick.
    ns_totals: HashMap<String, [u64; 3]>,
    /// HTTP requests finished, as of the last tick.
    http_total: u64,
    /// Handling-time buckets of the last [`QUANTILE_WINDOW_TICKS`] ticks,
    /// oldest first: the percentiles' window starts at the front.
    handling: VecDeque<HashMap<SeriesKey, Buckets>>,
    /// Route readings of the last [`QUANTILE_WINDOW_TICKS`] ticks, oldest
    /// first: the last one gives the rates, the front the window.
    routes: VecDeque<HashMap<RouteKey, RouteReading>>,
}

impl Previous {
    /// Forgets every reading but the tick number: after a pause (nobody
    /// watched) the next tick reads rates 0 instead of averaging over the
    /// pause, and the event ids still go on from the last one sent.
    pub fn pause(&mut self) {
        *self = Previous {
            tick: self.tick,
            ..Default::default()
        };
    }
}

/// The value of label `name` on one metric, empty when absent.
fn label<'a>(m: &'a prometheus::proto::Metric, name: &str) -> &'a str {
    m.get_label()
        .iter()
        .find(|l| l.name() == name)
        .map(|l| l.value())
        .unwrap_or("")
}

/// The current buckets of the live actors' handling-time series (the rows
/// that show percentiles; a passivated namespace's series are not read).
fn handling_buckets(actors: &[Arc<ActorStats>]) -> HashMap<SeriesKey, Buckets> {
    use prometheus::core::Metric as _;
    let mut out = HashMap::new();
    for a in actors {
        let m = a.handling_histogram().metric();
        let h = m.get_histogram();
        out.insert(
            (a.kind.to_string(), a.namespace.clone()),
            Buckets {
                bounds: h.get_bucket().iter().map(|b| b.upper_bound()).collect(),
                counts: h
                    .get_bucket()
                    .iter()
                    .map(|b| b.cumulative_count())
                    .collect(),
            },
        );
    }
    out
}

/// Every route series' numbers now (read without creating series).
fn route_readings(metrics: &Metrics) -> HashMap<RouteKey, RouteReading> {
    let mut out: HashMap<RouteKey, RouteReading> = HashMap::new();
    let key = |m: &prometheus::proto::Metric| {
        (
            label(m, "namespace").to_string(),
            label(m, "deployment").to_string(),
            label(m, "route").to_string(),
        )
    };
    for fam in metrics.route_requests.collect() {
        for m in fam.get_metric() {
            let n = m.get_counter().get_value() as u64;
            let r = out.entry(key(m)).or_default();
            r.requests += n;
            if label(m, "status_class") == "5xx" {
                r.errors += n;
            }
        }
    }
    for fam in metrics.route_duration_seconds.collect() {
        for m in fam.get_metric() {
            let h = m.get_histogram();
            out.entry(key(m)).or_default().buckets = Buckets {
                bounds: h.get_bucket().iter().map(|b| b.upper_bound()).collect(),
                counts: h
                    .get_bucket()
                    .iter()
                    .map(|b| b.cumulative_count())
                    .collect(),
            };
        }
    }
    out
}

/// One route's row from its reading `now`, the previous tick's `last` (the
/// rate) and the window's first `oldest` (error share and percentiles); a
/// series missing from an earlier reading counts from zero.
pub fn route_row(
    route: &str,
    now: &RouteReading,
    last: Option<&RouteReading>,
    oldest: Option<&RouteReading>,
    secs: f64,
) -> RouteRow {
    let before = oldest.map(|o| o.requests).unwrap_or(0);
    let answered = now.requests.saturating_sub(before);
    let errors = now
        .errors
        .saturating_sub(oldest.map(|o| o.errors).unwrap_or(0));
    let counts = oldest
        .map(|o| o.buckets.counts.as_slice())
        .filter(|c| !c.is_empty());
    let q = |q| window_quantile(&now.buckets.bounds, &now.buckets.counts, counts, q);
    RouteRow {
        route: route.to_string(),
        requests: now.requests,
        requests_per_sec: rate(now.requests, last.map(|l| l.requests), secs),
        error_share: (answered > 0).then(|| errors as f64 / answered as f64),
        p50_seconds: q(0.5),
        p99_seconds: q(0.99),
    }
}

/// The deployment rows of one tick: every route series against `prev`'s
/// readings (this tick's is pushed), grouped by deployment, the `top` most
/// requested kept (instance health is filled in by [`with_health`]).
fn deployment_rows(
    readings: HashMap<RouteKey, RouteReading>,
    prev: &mut Previous,
    secs: f64,
    top: usize,
) -> (Vec<DeploymentRow>, usize) {
    let empty = HashMap::new();
    let last = prev.routes.back().unwrap_or(&empty);
    let oldest = prev.routes.front().unwrap_or(&empty);
    let mut deps: BTreeMap<(String, String), DeploymentRow> = BTreeMap::new();
    for (key, now) in &readings {
        let row = route_row(&key.2, now, last.get(key), oldest.get(key), secs);
        let d = deps.entry((key.0.clone(), key.1.clone())).or_default();
        d.requests += row.requests;
        d.requests_per_sec += row.requests_per_sec;
        d.routes.push(row);
    }
    prev.routes.push_back(readings);
    while prev.routes.len() > QUANTILE_WINDOW_TICKS {
        prev.routes.pop_front();
    }
    let ranked = deps.len();
    let mut rows: Vec<DeploymentRow> = deps
        .into_iter()
        .map(|((ns, name), mut d)| {
            d.namespace = ns;
            d.deployment = name;
            d
        })
        .collect();
    let busier = |ra: f64, ta: u64, rb: f64, tb: u64| rb.total_cmp(&ra).then(tb.cmp(&ta));
    rows.sort_by(|a, b| {
        busier(
            a.requests_per_sec,
            a.requests,
            b.requests_per_sec,
            b.requests,
        )
        .then_with(|| a.namespace.cmp(&b.namespace))
        .then_with(|| a.deployment.cmp(&b.deployment))
    });
    rows.truncate(top);
    for d in &mut rows {
        d.routes.sort_by(|a, b| {
            busier(
                a.requests_per_sec,
                a.requests,
                b.requests_per_sec,
                b.requests,
            )
            .then_with(|| a.route.cmp(&b.route))
        });
        d.routes_ranked = d.routes.len();
        d.routes.truncate(TOP_ROUTES);
    }
    (rows, ranked)
}

/// Resident set size of this process, from `/proc/self/status`.
pub fn memory_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| parse_vm_rss(&s))
        .unwrap_or(0)
}

fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn breaker_name(v: f64) -> &'static str {
    match v as i64 {
        0 => "closed",
        1 => "half-open",
        _ => "open",
    }
}

/// Per-second rate of a counter; a series first seen now counts from zero, and
/// the first tick (no interval yet) reads zero.
fn rate(now: u64, before: Option<u64>, secs: f64) -> f64 {
    if secs <= 0.0 {
        return 0.0;
    }
    now.saturating_sub(before.unwrap_or(0)) as f64 / secs
}

/// Reads every number once and derives rates against `prev` (updated in place).
/// `known` names the namespaces in the store (counted, searched, and listed
/// when fewer than `top` namespaces have numbers); `top` is how many
/// namespace rows the snapshot carries.
pub fn take(node: &Node, prev: &mut Previous, known: &Arc<Vec<String>>, top: usize) -> Snapshot {
    let m = &node.metrics;
    let now = crate::util::mono_now();
    let secs = prev
        .at
        .map(|t| now.duration_since(t).as_secs_f64())
        .unwrap_or(0.0);
    prev.at = Some(now);
    prev.tick += 1;

    let live = node.directory.snapshot();
    // Handling-time percentiles: this tick's buckets against the oldest kept.
    let buckets = handling_buckets(&live);
    let oldest = prev.handling.front().cloned().unwrap_or_default();
    let mut quantiles: HashMap<SeriesKey, (Option<f64>, Option<f64>)> = HashMap::new();
    for (key, b) in &buckets {
        let before = oldest.get(key).map(|o| o.counts.as_slice());
        // A series first seen inside the window: everything it holds is recent.
        let q = |q| window_quantile(&b.bounds, &b.counts, before, q);
        quantiles.insert(key.clone(), (q(0.5), q(0.99)));
    }
    prev.handling.push_back(buckets);
    while prev.handling.len() > QUANTILE_WINDOW_TICKS {
        prev.handling.pop_front();
    }

    let mut namespaces: BTreeMap<String, NamespaceRow> = BTreeMap::new();
    let mut actor_handled = HashMap::new();
    let mut actors: Vec<ActorRow> = live
        .iter()
        .map(|a| {
            let handled = a.handled();
            let before = prev.actor_handled.get(&a.id).copied();
            actor_handled.insert(a.id, handled);
            // The label the actor's series were registered under (capped).
            let ns_label = m.ns_label(&a.namespace);
            let (p50, p99) = quantiles
                .get(&(a.kind.to_string(), ns_label))
                .copied()
                .unwrap_or((None, None));
            ActorRow {
                id: a.id,
                kind: a.kind,
                namespace: a.namespace.clone(),
                mailbox_depth: a.depth(),
                handled,
                handled_per_sec: rate(handled, before, secs),
                p50_seconds: p50,
                p99_seconds: p99,
                restarts: a.restarts(),
            }
        })
        .collect();
    prev.actor_handled = actor_handled;
    actors.sort_by_key(|a| a.id);

    for a in actors.iter().filter(|a| !a.namespace.is_empty()) {
        let row = namespaces.entry(a.namespace.clone()).or_default();
        row.actors += 1;
        row.mailbox_depth += a.mailbox_depth;
        row.handled += a.handled;
        row.handled_per_sec += a.handled_per_sec;
        row.restarts += a.restarts;
    }
    for name in node.namespaces.names() {
        namespaces.entry(name).or_default().running = true;
    }
    // One pass over every namespace's series (the values, no exposition
    // records).
    let mut subscribers: HashMap<String, f64> = HashMap::new();
    let mut topics = HashMap::new();
    let mut publishes = HashMap::new();
    let mut invocations = HashMap::new();
    let mut errors = HashMap::new();
    let mut breakers: HashMap<String, Vec<BreakerRow>> = HashMap::new();
    m.namespaced.each_series(|ns, family, label, v| {
        let map = match family {
            "meshgate_ws_subscribers" => &mut subscribers,
            "meshgate_pubsub_topics" => &mut topics,
            "meshgate_pubsub_published_total" => &mut publishes,
            "meshgate_function_invocations_total" => &mut invocations,
            "meshgate_function_errors_total" => &mut errors,
            "meshgate_breaker_state" => {
                breakers
                    .entry(ns.to_string())
                    .or_default()
                    .push(BreakerRow {
                        member: label("member"),
                        state: breaker_name(v),
                    });
                return;
            }
            _ => return,
        };
        *map.entry(ns.to_string()).or_insert(0.0) += v;
    });
    for map in [&subscribers, &topics, &publishes, &invocations, &errors] {
        for ns in map.keys().filter(|k| !k.is_empty()) {
            namespaces.entry(ns.clone()).or_default();
        }
    }
    for ns in breakers.keys() {
        namespaces.entry(ns.clone()).or_default();
    }

    let mut ns_totals = HashMap::new();
    let mut node_row = NodeRow::default();
    let rows: Vec<NamespaceRow> = namespaces
        .into_iter()
        .map(|(name, mut row)| {
            row.namespace = name.clone();
            let get = |map: &HashMap<String, f64>| map.get(&name).copied().unwrap_or(0.0);
            row.subscribers = get(&subscribers) as i64;
            row.topics = get(&topics) as i64;
            row.publishes = get(&publishes) as u64;
            row.invocations = get(&invocations) as u64;
            row.errors = get(&errors) as u64;
            let before = prev.ns_totals.get(&name).copied();
            row.publishes_per_sec = rate(row.publishes, before.map(|b| b[0]), secs);
            row.invocations_per_sec = rate(row.invocations, before.map(|b| b[1]), secs);
            row.errors_per_sec = rate(row.errors, before.map(|b| b[2]), secs);
            row.breakers = breakers.remove(&name).unwrap_or_default();
            row.breakers.sort_by(|a, b| a.member.cmp(&b.member));
            ns_totals.insert(name, [row.publishes, row.invocations, row.errors]);
            node_row.publishes_per_sec += row.publishes_per_sec;
            node_row.invocations_per_sec += row.invocations_per_sec;
            node_row.errors_per_sec += row.errors_per_sec;
            row
        })
        .collect();
    prev.ns_totals = ns_totals;

    // The top N by activity; stored namespaces without numbers fill the rest.
    let mut ranked: Vec<&NamespaceRow> = rows.iter().filter(|r| !r.namespace.is_empty()).collect();
    ranked.sort_by(|a, b| {
        let (ra, ta) = activity(a);
        let (rb, tb) = activity(b);
        rb.total_cmp(&ra)
            .then(tb.cmp(&ta))
            .then(b.subscribers.cmp(&a.subscribers))
            .then_with(|| a.namespace.cmp(&b.namespace))
    });
    let mut shown: Vec<NamespaceRow> = ranked.iter().take(top).map(|r| (*r).clone()).collect();
    if shown.len() < top {
        let have: HashSet<&str> = rows.iter().map(|r| r.namespace.as_str()).collect();
        let fill: Vec<NamespaceRow> = known
            .iter()
            .filter(|n| !have.contains(n.as_str()))
            .take(top - shown.len())
            .map(|n| NamespaceRow {
                namespace: n.clone(),
                ..Default::default()
            })
            .collect();
        shown.extend(fill);
    }
    let shown_names: HashSet<&str> = shown.iter().map(|r| r.namespace.as_str()).collect();
    node_row.messages_handled = actors.iter().map(|a| a.handled).sum();
    node_row.publishes = rows.iter().map(|r| r.publishes).sum();
    node_row.invocations = rows.iter().map(|r| r.invocations).sum();
    node_row.errors = rows.iter().map(|r| r.errors).sum();
    node_row.topics = rows.iter().map(|r| r.topics).sum();
    node_row.namespaces_known = known.len();
    let node_actors = actors.len();
    let handled_per_sec: f64 = actors.iter().map(|a| a.handled_per_sec).sum();
    let actors: Vec<ActorRow> = actors
        .into_iter()
        .filter(|a| a.namespace.is_empty() || shown_names.contains(a.namespace.as_str()))
        .collect();

    // Deployments: only the route series (bounded labels) and, for the rows
    // shown, the live pools' instance health.
    let (deployments, deployments_ranked) =
        deployment_rows(route_readings(m), prev, secs, TOP_DEPLOYMENTS);
    let deployments = with_tls(node, with_health(node, deployments));

    let http_total: u64 = by_class_total(m);
    node_row.version = env!("CARGO_PKG_VERSION");
    node_row.uptime_seconds = m.started.elapsed().as_secs();
    node_row.phase = format!("{:?}", node.phase()).to_lowercase();
    node_row.http_requests = http_total;
    node_row.http_requests_per_sec = rate(http_total, Some(prev.http_total), secs);
    prev.http_total = http_total;
    node_row.http_in_flight = m.http_in_flight.get();
    node_row.ws_connections = m.ws_connections.get();
    node_row.ws_subscribers = subscribers.values().sum::<f64>() as i64;
    node_row.wasm_pool_busy = m.wasm_pool_busy.get();
    node_row.wasm_pool_queued = m.wasm_pool_queued.get();
    node_row.wasm_pool_workers = m.wasm_pool_workers.get();
    node_row.memory_rss_bytes = memory_rss_bytes();
    node_row.actors = node_actors;
    node_row.namespaces_running = node.namespaces.len();
    node_row.handled_per_sec = handled_per_sec;

    Snapshot {
        at_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as u64,
        tick: prev.tick,
        node: node_row,
        top_namespaces: top,
        namespaces_ranked: rows.len(),
        namespaces: shown,
        actors,
        top_deployments: TOP_DEPLOYMENTS,
        deployments_ranked,
        deployments,
        all: Arc::new(rows),
        known: known.clone(),
    }
}

/// Fills the rows' instance counts from the live upstream pools (read only
/// when some deployment has a row).
fn with_health(node: &Node, mut rows: Vec<DeploymentRow>) -> Vec<DeploymentRow> {
    if rows.is_empty() {
        return rows;
    }
    let mut health: HashMap<(String, String), (usize, usize)> = HashMap::new();
    for s in node.deployments.upstream_samples() {
        let h = health.entry((s.namespace, s.deployment)).or_default();
        h.0 += 1;
        h.1 += usize::from(s.healthy);
    }
    for d in &mut rows {
        let key = (d.namespace.clone(), d.deployment.clone());
        (d.instances, d.instances_healthy) = health.get(&key).copied().unwrap_or((0, 0));
    }
    rows
}

/// Fills the rows' certificate cells from memory: the summaries the index
/// rebuild keeps and the ACME states the checker last saw (no store read).
fn with_tls(node: &Node, mut rows: Vec<DeploymentRow>) -> Vec<DeploymentRow> {
    if rows.is_empty() {
        return rows;
    }
    let summaries = node.deployments.tls_summaries();
    let now = crate::util::now() as i64;
    for d in &mut rows {
        let Some(t) = summaries.get(&(d.namespace.clone(), d.deployment.clone())) else {
            continue;
        };
        let acme = t.auto.then(|| {
            let seen = node.deployments.acme_seen(&d.namespace, &d.deployment);
            acme_cell(seen.as_ref(), t.leaf, now)
        });
        d.tls = Some(tls_cell(t.auto, t.leaf, acme, now));
    }
    rows
}

/// A row's certificate cell: `leaf` is the stored leaf's validity.
pub fn tls_cell(auto: bool, leaf: Option<(i64, i64)>, acme: Option<AcmeCell>, now: i64) -> TlsCell {
    let mode = match (auto, leaf) {
        (true, _) => "acme",
        (false, Some(_)) => "uploaded",
        (false, None) => "node_pair",
    };
    TlsCell {
        mode,
        not_after: leaf.map(|(_, end)| crate::deploy::certs::rfc3339(end)),
        expired: leaf.is_some_and(|(_, end)| end < now),
        acme,
    }
}

/// The ACME part of a cell from the state the checker last saw; before its
/// first pass, `valid` when a certificate in its validity is stored, else
/// `pending` (as `GET /v1/deployments/{name}/certificate` reads it).
pub fn acme_cell(
    seen: Option<&crate::deploy::acme::AcmeState>,
    leaf: Option<(i64, i64)>,
    now: i64,
) -> AcmeCell {
    let state = match seen {
        Some(s) if !s.state.is_empty() => s.state.clone(),
        _ if leaf.is_some_and(|(_, end)| end > now) => "valid".into(),
        _ => "pending".into(),
    };
    let last_error = seen.and_then(|s| s.last_error.as_deref()).map(|e| {
        if e.chars().count() > ACME_ERROR_CHARS {
            let cut: String = e.chars().take(ACME_ERROR_CHARS - 1).collect();
            format!("{cut}…")
        } else {
            e.to_string()
        }
    });
    AcmeCell {
        state,
        last_error,
        next_attempt: seen
            .and_then(|s| s.next_attempt)
            .map(|t| crate::deploy::certs::rfc3339(t as i64)),
    }
}

fn by_class_total(m: &Metrics) -> u64 {
    m.http_requests
        .collect()
        .iter()
        .flat_map(|f| f.get_metric())
        .map(|x| x.get_counter().get_value() as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The certificate cell names the node pair, an upload or ACME, marks
    /// an expired leaf, and cuts a long ACME error.
    #[test]
    fn tls_cells() {
        let now = 1_800_000_000;
        let none = tls_cell(false, None, None, now);
        assert_eq!(
            (none.mode, none.not_after, none.expired),
            ("node_pair", None, false)
        );
        let up = tls_cell(false, Some((now - 10, now + 86_400)), None, now);
        assert_eq!(up.mode, "uploaded");
        assert_eq!(up.not_after.as_deref(), Some("2027-01-16T08:00:00Z"));
        assert!(!up.expired);
        assert!(tls_cell(false, Some((now - 10, now - 1)), None, now).expired);
        let failed = crate::deploy::acme::AcmeState {
            state: "failed".into(),
            last_error: Some("x".repeat(500)),
            next_attempt: Some(now as u64 + 60),
            ..Default::default()
        };
        let a = acme_cell(Some(&failed), None, now);
        assert_eq!(a.state, "failed");
        assert_eq!(
            a.last_error.as_ref().unwrap().chars().count(),
            ACME_ERROR_CHARS
        );
        assert_eq!(a.next_attempt.as_deref(), Some("2027-01-15T08:01:00Z"));
        assert_eq!(acme_cell(None, None, now).state, "pending");
        assert_eq!(
            acme_cell(None, Some((now - 10, now + 10)), now).state,
            "valid"
        );
        let c = tls_cell(true, None, Some(a), now);
        assert_eq!(c.mode, "acme");
    }

    /// Percentiles come from the observations inside the window only.
    #[test]
    fn window_quantile_uses_the_difference() {
        let bounds = [0.001, 0.01, 0.1, 1.0];
        // 100 fast observations long ago, then 100 slow ones in the window.
        let before = [100, 100, 100, 100];
        let now = [100, 100, 100, 200];
        let p50 = window_quantile(&bounds, &now, Some(&before), 0.5).unwrap();
        assert!(p50 > 0.1 && p50 <= 1.0, "{p50}");
        assert_eq!(window_quantile(&bounds, &before, Some(&before), 0.5), None);
        // Without an earlier reading everything counts.
        let all = window_quantile(&bounds, &now, None, 0.25).unwrap();
        assert!(all <= 0.001, "{all}");
    }

    fn reading(requests: u64, errors: u64, counts: &[u64]) -> RouteReading {
        RouteReading {
            requests,
            errors,
            buckets: Buckets {
                bounds: vec![0.005, 0.05, 0.5, 5.0],
                counts: counts.to_vec(),
            },
        }
    }

    /// Rate over the last tick, error share and percentiles over the window,
    /// from two readings of one route.
    #[test]
    fn route_row_from_two_readings() {
        // Long before: 100 fast answers, none failed.
        let oldest = reading(100, 0, &[100, 100, 100, 100]);
        // The last tick: 20 more (10 of them 5xx, slow).
        let last = reading(120, 10, &[110, 110, 110, 120]);
        // Now, 2 s later: 20 more again, 10 fast, 10 slow and failed.
        let now = reading(140, 20, &[120, 120, 120, 140]);
        let r = route_row("/api", &now, Some(&last), Some(&oldest), 2.0);
        assert_eq!(r.route, "/api");
        assert_eq!(r.requests, 140);
        assert_eq!(r.requests_per_sec, 10.0);
        assert_eq!(r.error_share, Some(0.5));
        // 20 fast (<= 5 ms) and 20 slow (0.5 s to 5 s) in the window.
        let p50 = r.p50_seconds.unwrap();
        assert!(p50 <= 0.005, "{p50}");
        let p99 = r.p99_seconds.unwrap();
        assert!(p99 > 0.5 && p99 <= 5.0, "{p99}");
        // Nothing in the window: no share, no percentiles, rate 0.
        let idle = route_row("/api", &oldest, Some(&oldest), Some(&oldest), 1.0);
        assert_eq!(idle.requests_per_sec, 0.0);
        assert_eq!((idle.error_share, idle.p50_seconds), (None, None));
        // A series first seen now counts from zero; the first tick's rate is 0.
        let fresh = route_row("/", &last, None, None, 0.0);
        assert_eq!(fresh.requests_per_sec, 0.0);
        assert_eq!(fresh.error_share, Some(10.0 / 120.0));
    }

    /// Deployments are grouped from route series, ranked by rate, the top
    /// kept; readings are kept for the window only.
    #[test]
    fn deployment_rows_rank_and_bound() {
        let mut prev = Previous::default();
        let key = |d: &str, r: &str| ("ns".to_string(), d.to_string(), r.to_string());
        let tick = |prev: &mut Previous, busy: u64| {
            let mut m = HashMap::new();
            m.insert(key("web", "/"), reading(busy, 0, &[busy; 4]));
            m.insert(key("web", "/api"), reading(2 * busy, busy, &[2 * busy; 4]));
            m.insert(key("shop", "/"), reading(busy / 2, 0, &[busy / 2; 4]));
            deployment_rows(m, prev, 1.0, 1)
        };
        tick(&mut prev, 10);
        let (rows, ranked) = tick(&mut prev, 20);
        assert_eq!(ranked, 2);
        assert_eq!(rows.len(), 1);
        let web = &rows[0];
        assert_eq!(web.deployment, "web");
        assert_eq!(web.requests_per_sec, 30.0);
        assert_eq!(web.routes[0].route, "/api");
        assert_eq!(web.routes[0].error_share, Some(0.5));
        for i in 0..2 * QUANTILE_WINDOW_TICKS as u64 {
            tick(&mut prev, 30 + i);
        }
        assert_eq!(prev.routes.len(), QUANTILE_WINDOW_TICKS);
    }

    /// VmRSS is read in kB and reported in bytes.
    #[test]
    fn parses_vm_rss() {
        let s = "Name:\tmeshgate\nVmPeak:\t  9000 kB\nVmRSS:\t   2048 kB\n";
        assert_eq!(parse_vm_rss(s), Some(2048 * 1024));
        assert_eq!(parse_vm_rss("Name: x\n"), None);
        assert!(memory_rss_bytes() > 0);
    }
}
