//! Per-route observability of deployments (issue #40): the bounded label
//! values of the route series in `/metrics`, each deployment's activity ring
//! (`GET /v1/deployments/{name}/activity`) and the record of the upstream
//! instances one proxied request tried.
//!
//! Labels are declared values only: the route label is the matched route's
//! `path_prefix` (never the request's path), the instance label an instance's
//! base URL as deployed. On one node at most `[metrics] route_series_limit`
//! (namespace, deployment, route) triples and as many (namespace, deployment,
//! instance) triples get their own series; past the cap a new triple is
//! counted under `deployment="_other",route="_other"` (or `instance="_other"`).
//! The `namespace` label then follows the exposition's top-N scheme
//! ([`crate::metrics`]).

use serde::Serialize;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The label value of a deployment, route or instance past the series cap.
pub const OTHER: &str = "_other";
/// Default of `[metrics] route_series_limit`.
pub const DEFAULT_ROUTE_SERIES_LIMIT: usize = 1000;
/// Largest `[metrics] route_series_limit` the configuration accepts.
pub const MAX_ROUTE_SERIES_LIMIT: usize = 100_000;
/// Requests each deployment's ring keeps (the latest).
pub const RING_SIZE: usize = 256;
/// `?limit=` when absent.
pub const DEFAULT_LIMIT: usize = 50;
/// Deployments with a ring on one node; past it the least recently written
/// ring is dropped for a new one.
const MAX_RINGS: usize = 10_000;

/// The subject a request was authorized as, when a route policy put one in
/// the request's extensions; the activity ring shows it.
#[derive(Clone, Debug)]
pub struct Subject(pub String);

/// One request in a deployment's activity ring. Never a body, a query
/// string or a header value: the path is the request's without its query.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ActivityEntry {
    /// Unix milliseconds when the request finished.
    pub time_ms: u64,
    /// The request's method.
    pub method: String,
    /// The request's path, without its query string.
    pub path: String,
    /// The matched route's `path_prefix`.
    pub route: String,
    /// The status answered.
    pub status: u16,
    /// Milliseconds the route took to answer (headers; a streamed body may run on).
    pub duration_ms: f64,
    /// The upstream instance that answered (or the last one tried).
    pub instance: Option<String>,
    /// The request's id (`X-Request-ID`).
    pub request_id: Option<String>,
    /// The authorized subject, when a route policy established one.
    pub subject: Option<String>,
    /// The W3C trace id of the request.
    pub trace_id: Option<String>,
}

/// Each ring by (namespace, deployment), with its last write's tick.
type Rings = HashMap<(String, String), (u64, VecDeque<ActivityEntry>)>;

/// Every deployment's ring on this node, by (namespace, deployment).
#[derive(Default)]
pub struct Activity {
    rings: Mutex<Rings>,
    /// Counts writes: a ring's last write, to pick the one dropped past [`MAX_RINGS`].
    tick: AtomicUsize,
}

impl Activity {
    /// Adds a request to its deployment's ring (the oldest leaves past [`RING_SIZE`]).
    pub fn push(&self, namespace: &str, deployment: &str, entry: ActivityEntry) {
        let tick = self.tick.fetch_add(1, Ordering::Relaxed) as u64;
        let mut rings = self.rings.lock().unwrap_or_else(|e| e.into_inner());
        let key = (namespace.to_string(), deployment.to_string());
        if !rings.contains_key(&key)
            && rings.len() >= MAX_RINGS
            && let Some(oldest) = rings
                .iter()
                .min_by_key(|(_, (t, _))| *t)
                .map(|(k, _)| k.clone())
        {
            rings.remove(&oldest);
        }
        let (t, ring) = rings.entry(key).or_default();
        *t = tick;
        if ring.len() >= RING_SIZE {
            ring.pop_front();
        }
        ring.push_back(entry);
    }

    /// The latest `limit` requests of a deployment, newest first.
    pub fn latest(&self, namespace: &str, deployment: &str, limit: usize) -> Vec<ActivityEntry> {
        let rings = self.rings.lock().unwrap_or_else(|e| e.into_inner());
        rings
            .get(&(namespace.to_string(), deployment.to_string()))
            .map(|(_, r)| r.iter().rev().take(limit).cloned().collect())
            .unwrap_or_default()
    }

    /// Forgets a deployment's ring (it was deleted).
    pub fn forget(&self, namespace: &str, deployment: &str) {
        let mut rings = self.rings.lock().unwrap_or_else(|e| e.into_inner());
        rings.remove(&(namespace.to_string(), deployment.to_string()));
    }
}

/// `?limit=`: 1 to [`RING_SIZE`], [`DEFAULT_LIMIT`] when absent; anything
/// else is an error message.
pub fn parse_limit(raw: Option<&str>) -> Result<usize, String> {
    let Some(raw) = raw else {
        return Ok(DEFAULT_LIMIT);
    };
    match raw.parse::<usize>() {
        Ok(n) if (1..=RING_SIZE).contains(&n) => Ok(n),
        _ => Err(format!("limit must be 1..={RING_SIZE}, not {raw:?}")),
    }
}

/// The series cap of the route and instance labels.
pub struct RouteLabels {
    limit: AtomicUsize,
    routes: Mutex<HashSet<(String, String, String)>>,
    instances: Mutex<HashSet<(String, String, String)>>,
}

impl Default for RouteLabels {
    fn default() -> Self {
        RouteLabels {
            limit: AtomicUsize::new(DEFAULT_ROUTE_SERIES_LIMIT),
            routes: Mutex::default(),
            instances: Mutex::default(),
        }
    }
}

impl RouteLabels {
    /// Sets the cap (`[metrics] route_series_limit`), once at start-up.
    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// The `deployment` and `route` label values of a request's route:
    /// its own while the triple has (or may take) a series, else `_other` twice.
    pub fn route<'a>(
        &self,
        namespace: &str,
        deployment: &'a str,
        route: &'a str,
    ) -> (&'a str, &'a str) {
        if admit(
            &self.routes,
            self.limit.load(Ordering::Relaxed),
            namespace,
            deployment,
            route,
        ) {
            (deployment, route)
        } else {
            (OTHER, OTHER)
        }
    }

    /// The `instance` label value of an instance of a deployment.
    pub fn instance<'a>(&self, namespace: &str, deployment: &str, instance: &'a str) -> &'a str {
        if admit(
            &self.instances,
            self.limit.load(Ordering::Relaxed),
            namespace,
            deployment,
            instance,
        ) {
            instance
        } else {
            OTHER
        }
    }
}

fn admit(
    set: &Mutex<HashSet<(String, String, String)>>,
    limit: usize,
    a: &str,
    b: &str,
    c: &str,
) -> bool {
    let mut set = set.lock().unwrap_or_else(|e| e.into_inner());
    let key = (a.to_string(), b.to_string(), c.to_string());
    if set.contains(&key) {
        return true;
    }
    if set.len() >= limit {
        return false;
    }
    set.insert(key);
    true
}

/// The status class label of a status.
pub fn status_class(status: u16) -> &'static str {
    match status / 100 {
        1 => "1xx",
        2 => "2xx",
        3 => "3xx",
        4 => "4xx",
        _ => "5xx",
    }
}

/// One upstream attempt: the instance's base URL and its outcome
/// (`answered`, `connect_failed`, `refused`, `timeout`, `failed`).
pub type Attempt = (String, &'static str);

tokio::task_local! {
    static ATTEMPTS: RefCell<Vec<Attempt>>;
}

/// The `outcome` label of one exchange with an instance.
pub fn outcome<T>(e: &super::h1::Exchange<T>) -> &'static str {
    use super::h1::{ConnectFailure, Exchange};
    match e {
        Exchange::Answered(_) => "answered",
        Exchange::NotConnected(ConnectFailure::Refused(_)) => "refused",
        Exchange::NotConnected(ConnectFailure::Failed(_)) => "connect_failed",
        Exchange::TimedOut => "timeout",
        Exchange::Failed(_) | Exchange::Ended(_) => "failed",
    }
}

/// Notes an attempt of the request being served (called by the proxy's
/// retry loop); nothing outside [`recording`].
pub fn attempted(instance: &str, outcome: &'static str) {
    let _ = ATTEMPTS.try_with(|a| a.borrow_mut().push((instance.to_string(), outcome)));
}

/// Runs `f`, returning its output and the upstream attempts made in it.
pub async fn recording<F: std::future::Future>(f: F) -> (F::Output, Vec<Attempt>) {
    ATTEMPTS
        .scope(RefCell::new(Vec::new()), async {
            let out = f.await;
            let attempts = ATTEMPTS.with(|a| a.take());
            (out, attempts)
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: u16) -> ActivityEntry {
        ActivityEntry {
            time_ms: i as u64,
            method: "GET".into(),
            path: format!("/p{i}"),
            route: "/".into(),
            status: 200 + i,
            duration_ms: 1.0,
            instance: None,
            request_id: None,
            subject: None,
            trace_id: None,
        }
    }

    /// A ring keeps the latest [`RING_SIZE`], newest first, per deployment.
    #[test]
    fn activity_ring_keeps_the_latest() {
        let a = Activity::default();
        for i in 0..(RING_SIZE as u16 + 10) {
            a.push("ns", "web", entry(i));
        }
        a.push("ns", "other", entry(0));
        let all = a.latest("ns", "web", 1000);
        assert_eq!(all.len(), RING_SIZE);
        assert_eq!(all[0].path, format!("/p{}", RING_SIZE + 9));
        assert_eq!(all.last().unwrap().path, "/p10");
        assert_eq!(a.latest("ns", "web", 3).len(), 3);
        assert_eq!(a.latest("ns", "other", 10).len(), 1);
        assert!(a.latest("ns2", "web", 10).is_empty());
        a.forget("ns", "web");
        assert!(a.latest("ns", "web", 10).is_empty());
    }

    /// `?limit=` is 1..=256, 50 by default.
    #[test]
    fn activity_limits_parse() {
        assert_eq!(parse_limit(None), Ok(DEFAULT_LIMIT));
        assert_eq!(parse_limit(Some("3")), Ok(3));
        assert_eq!(parse_limit(Some("256")), Ok(256));
        for bad in ["0", "257", "-1", "x", ""] {
            assert!(parse_limit(Some(bad)).is_err(), "{bad}");
        }
    }

    /// Past the cap, new triples go to `_other`; admitted ones keep theirs.
    #[test]
    fn activity_labels_are_capped() {
        let l = RouteLabels::default();
        l.set_limit(2);
        assert_eq!(l.route("a", "d1", "/"), ("d1", "/"));
        assert_eq!(l.route("a", "d1", "/api"), ("d1", "/api"));
        assert_eq!(l.route("a", "d2", "/"), (OTHER, OTHER));
        assert_eq!(l.route("a", "d1", "/"), ("d1", "/"));
        assert_eq!(l.instance("a", "d1", "http://x:1"), "http://x:1");
        assert_eq!(l.instance("a", "d1", "http://x:2"), "http://x:2");
        assert_eq!(l.instance("a", "d1", "http://x:3"), OTHER);
    }

    /// Attempts noted inside [`recording`] are returned; outside, ignored.
    #[actix_rt::test]
    async fn activity_attempts_are_recorded() {
        attempted("http://x:0", "answered");
        let ((), a) = recording(async {
            attempted("http://x:1", "connect_failed");
            attempted("http://x:2", "answered");
        })
        .await;
        assert_eq!(
            a,
            vec![
                ("http://x:1".to_string(), "connect_failed"),
                ("http://x:2".to_string(), "answered")
            ]
        );
    }
}
