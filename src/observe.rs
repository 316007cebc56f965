//! What the node tells about the requests it serves, the pure
//! parts (layer 0, below every user): the bounded label values of the route
//! series (`[metrics] route_series_limit`), each deployment's activity ring
//! (`GET /v1/deployments/{name}/activity`) and W3C trace context
//! ([`trace`]). The proxy's side (the upstream attempts of one request) is
//! `deploy::activity`.
//!
//! Labels are declared values only: the route label is the matched route's
//! `path_prefix` (never the request's path), the instance label an instance's
//! base URL as deployed. On one node at most `[metrics] route_series_limit`
//! (namespace, deployment, route) triples and as many (namespace, deployment,
//! instance) triples get their own series, and one namespace at most
//! `[metrics] route_series_per_namespace` of each; past either cap a new
//! triple is counted under `deployment="_other",route="_other"` (or
//! `instance="_other"`).
//! The `namespace` label then follows the exposition's top-N scheme
//! (`crate::metrics`).

use arc_swap::ArcSwapOption;
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The label value of a deployment, route or instance past the series cap.
pub const OTHER: &str = "_other";
/// Default of `[metrics] route_series_limit`.
pub const DEFAULT_ROUTE_SERIES_LIMIT: usize = 1000;
/// Default of `[metrics] route_series_per_namespace`.
pub const DEFAULT_ROUTE_SERIES_PER_NAMESPACE: usize = 100;
/// Largest `[metrics] route_series_limit` the configuration accepts.
pub const MAX_ROUTE_SERIES_LIMIT: usize = 100_000;
/// Requests each deployment's ring keeps (the latest).
pub const RING_SIZE: usize = 256;
/// `?limit=` when absent.
pub const DEFAULT_LIMIT: usize = 50;
/// Deployments with a ring on one node; past it the least recently written
/// ring is dropped for a new one.
const MAX_RINGS: usize = 10_000;
/// Bytes of a request's path an activity entry keeps; a longer path is cut
/// at a character boundary and ends with [`CUT`]. A path is the one part of
/// an entry a client sizes (up to the header limit, 60 KB and more): whole,
/// 256 entries per ring held 15 MB per deployment. With the other fields
/// bounded too (the request id to 128 bytes, the route and the instance as
/// deployed, the subject a key name or token subject), an entry is at most a
/// few hundred bytes, so a ring is bounded in bytes, not only in count.
pub const MAX_ACTIVITY_PATH_BYTES: usize = 256;
/// The most bytes of a request's method an activity entry keeps: HTTP lets
/// a method be any token, of any length; the registered ones fit in 7.
pub const MAX_ACTIVITY_METHOD_BYTES: usize = 32;
/// What ends a cut path.
pub const CUT: &str = "…";

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
    /// The W3C trace id of the request (hex in JSON; kept as bytes, so a
    /// request that nobody reads the activity of formats nothing).
    pub trace_id: Option<TraceId>,
}

/// A W3C trace id, written as its 32 lower-case hex digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceId(pub [u8; 16]);

impl Serialize for TraceId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(self.0))
    }
}

/// Cuts `s` to at most `max` bytes, at a character boundary, ending with
/// [`CUT`] when anything was cut.
fn cut(s: &mut String, max: usize) {
    if s.len() <= max {
        return;
    }
    let mut end = max - CUT.len();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    // A new string: truncating in place would keep the whole capacity.
    let mut kept = String::with_capacity(end + CUT.len());
    kept.push_str(&s[..end]);
    kept.push_str(CUT);
    *s = kept;
}

/// One deployment's ring: [`RING_SIZE`] slots written round robin without a
/// lock (a request's write is one counter increment and one pointer swap);
/// a reader takes the slots newest first.
pub struct Ring {
    slots: Box<[ArcSwapOption<ActivityEntry>]>,
    /// Entries ever written; the next one goes to `writes % RING_SIZE`.
    writes: AtomicU64,
    /// The node's write tick of its last write: the least recently written
    /// ring is the one dropped past [`MAX_RINGS`].
    last: AtomicU64,
    /// Cleared when the ring leaves the node's map (dropped past
    /// [`MAX_RINGS`], or its deployment deleted): a holder then asks
    /// [`Activity::ring`] again.
    live: AtomicBool,
}

impl Ring {
    fn new() -> Ring {
        Ring {
            slots: (0..RING_SIZE).map(|_| ArcSwapOption::empty()).collect(),
            writes: AtomicU64::new(0),
            last: AtomicU64::new(0),
            live: AtomicBool::new(true),
        }
    }

    /// Whether the node's map still holds this ring.
    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::Relaxed)
    }

    fn latest(&self, limit: usize) -> Vec<ActivityEntry> {
        let n = self.writes.load(Ordering::Acquire);
        let take = n.min(RING_SIZE as u64).min(limit as u64);
        (0..take)
            .filter_map(|k| self.slots[((n - 1 - k) % RING_SIZE as u64) as usize].load_full())
            .map(|e| (*e).clone())
            .collect()
    }
}

/// Each ring by namespace, then deployment (nested: a lookup borrows its strings).
type Rings = HashMap<String, HashMap<String, Arc<Ring>>>;

/// Every deployment's ring on this node, by (namespace, deployment). The
/// map is locked only to find or make a ring; a routed request holds its
/// route's ring (`crate::deploy::index::Bound`) and writes it without the lock.
#[derive(Default)]
pub struct Activity {
    rings: Mutex<Rings>,
    /// Counts writes: a ring's last write, to pick the one dropped past [`MAX_RINGS`].
    tick: AtomicU64,
}

impl Activity {
    /// The ring of a deployment, made when it has none (dropping the least
    /// recently written one past [`MAX_RINGS`]).
    pub fn ring(&self, namespace: &str, deployment: &str) -> Arc<Ring> {
        let mut rings = self.rings.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = rings.get(namespace).and_then(|m| m.get(deployment)) {
            return r.clone();
        }
        let count: usize = rings.values().map(HashMap::len).sum();
        if count >= MAX_RINGS
            && let Some((ns, dep)) = rings
                .iter()
                .flat_map(|(ns, m)| {
                    m.iter()
                        .map(move |(d, r)| (r.last.load(Ordering::Relaxed), ns, d))
                })
                .min()
                .map(|(_, ns, d)| (ns.clone(), d.clone()))
        {
            Self::remove(&mut rings, &ns, &dep);
        }
        let ring = Arc::new(Ring::new());
        rings
            .entry(namespace.to_string())
            .or_default()
            .insert(deployment.to_string(), ring.clone());
        ring
    }

    /// Adds a request to its deployment's ring (the oldest leaves past [`RING_SIZE`]).
    pub fn push(&self, namespace: &str, deployment: &str, entry: ActivityEntry) {
        self.push_to(&self.ring(namespace, deployment), entry);
    }

    /// Adds a request to a ring [`Activity::ring`] gave, without the map's lock.
    pub fn push_to(&self, ring: &Ring, mut entry: ActivityEntry) {
        cut(&mut entry.path, MAX_ACTIVITY_PATH_BYTES);
        cut(&mut entry.method, MAX_ACTIVITY_METHOD_BYTES);
        if let Some(s) = entry.subject.as_mut() {
            cut(s, MAX_ACTIVITY_PATH_BYTES);
        }
        let tick = self.tick.fetch_add(1, Ordering::Relaxed);
        ring.last.store(tick, Ordering::Relaxed);
        let i = ring.writes.fetch_add(1, Ordering::AcqRel);
        ring.slots[(i % RING_SIZE as u64) as usize].store(Some(Arc::new(entry)));
    }

    /// The latest `limit` requests of a deployment, newest first.
    pub fn latest(&self, namespace: &str, deployment: &str, limit: usize) -> Vec<ActivityEntry> {
        let ring = {
            let rings = self.rings.lock().unwrap_or_else(|e| e.into_inner());
            rings
                .get(namespace)
                .and_then(|m| m.get(deployment))
                .cloned()
        };
        ring.map(|r| r.latest(limit)).unwrap_or_default()
    }

    /// Forgets a deployment's ring (it was deleted).
    pub fn forget(&self, namespace: &str, deployment: &str) {
        let mut rings = self.rings.lock().unwrap_or_else(|e| e.into_inner());
        Self::remove(&mut rings, namespace, deployment);
    }

    fn remove(rings: &mut Rings, namespace: &str, deployment: &str) {
        if let Some(m) = rings.get_mut(namespace) {
            if let Some(r) = m.remove(deployment) {
                r.live.store(false, Ordering::Relaxed);
            }
            if m.is_empty() {
                rings.remove(namespace);
            }
        }
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
    per_namespace: AtomicUsize,
    routes: Mutex<Admitted>,
    instances: Mutex<Admitted>,
}

impl Default for RouteLabels {
    fn default() -> Self {
        RouteLabels {
            limit: AtomicUsize::new(DEFAULT_ROUTE_SERIES_LIMIT),
            per_namespace: AtomicUsize::new(DEFAULT_ROUTE_SERIES_PER_NAMESPACE),
            routes: Mutex::default(),
            instances: Mutex::default(),
        }
    }
}

impl RouteLabels {
    /// Sets the caps (`[metrics] route_series_limit` and
    /// `route_series_per_namespace`), once at start-up.
    pub fn set_limit(&self, limit: usize, per_namespace: usize) {
        self.limit.store(limit, Ordering::Relaxed);
        self.per_namespace.store(per_namespace, Ordering::Relaxed);
    }

    fn caps(&self) -> (usize, usize) {
        (
            self.limit.load(Ordering::Relaxed),
            self.per_namespace.load(Ordering::Relaxed),
        )
    }

    /// The `deployment` and `route` label values of a request's route:
    /// its own while the triple has (or may take) a series, else `_other` twice.
    pub fn route<'a>(
        &self,
        namespace: &str,
        deployment: &'a str,
        route: &'a str,
    ) -> (&'a str, &'a str) {
        if admit(&self.routes, self.caps(), namespace, deployment, route) {
            (deployment, route)
        } else {
            (OTHER, OTHER)
        }
    }

    /// The `instance` label value of an instance of a deployment.
    pub fn instance<'a>(&self, namespace: &str, deployment: &str, instance: &'a str) -> &'a str {
        if admit(
            &self.instances,
            self.caps(),
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

/// Triples admitted to their own series: nested by their parts, so a
/// request's lookup borrows its strings and allocates nothing.
#[derive(Default)]
struct Admitted {
    count: usize,
    map: HashMap<String, HashMap<String, HashSet<String>>>,
    /// Triples admitted per namespace (the first part).
    per_namespace: HashMap<String, usize>,
}

fn admit(
    set: &Mutex<Admitted>,
    (limit, per_namespace): (usize, usize),
    a: &str,
    b: &str,
    c: &str,
) -> bool {
    let mut set = set.lock().unwrap_or_else(|e| e.into_inner());
    if set
        .map
        .get(a)
        .and_then(|m| m.get(b))
        .is_some_and(|s| s.contains(c))
    {
        return true;
    }
    if set.count >= limit || set.per_namespace.get(a).copied().unwrap_or(0) >= per_namespace {
        return false;
    }
    set.count += 1;
    *set.per_namespace.entry(a.to_string()).or_default() += 1;
    set.map
        .entry(a.to_string())
        .or_default()
        .entry(b.to_string())
        .or_default()
        .insert(c.to_string());
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

    /// A path of 60 KB (the attack: a ring of them held 15 MB) is kept cut
    /// to [`MAX_ACTIVITY_PATH_BYTES`] at a character boundary, its capacity
    /// too; a short path and a subject are kept as they came or cut alike.
    #[test]
    fn activity_entries_are_bounded_in_bytes() {
        let a = Activity::default();
        let mut long = entry(1);
        // Two-byte characters around the cut: the cut falls inside one.
        long.path = format!("/{}", "é".repeat(30_000));
        long.subject = Some("k".repeat(1000));
        // A method is any token: one of 60 KB is cut like the path.
        long.method = "M".repeat(60_000);
        a.push("ns", "web", long);
        a.push("ns", "web", entry(2));
        let got = a.latest("ns", "web", 10);
        assert_eq!(got[0].path, "/p2");
        let cut = &got[1].path;
        assert!(cut.len() <= MAX_ACTIVITY_PATH_BYTES, "{}", cut.len());
        assert!(cut.len() > MAX_ACTIVITY_PATH_BYTES - 8, "{}", cut.len());
        assert!(cut.starts_with("/éé") && cut.ends_with(CUT), "{cut}");
        assert!(got[1].subject.as_ref().unwrap().len() <= MAX_ACTIVITY_PATH_BYTES);
        assert!(got[1].method.len() <= MAX_ACTIVITY_METHOD_BYTES);
        assert!(got[1].method.starts_with("MMM") && got[1].method.ends_with(CUT));
        assert_eq!(got[0].method, "GET");
        let ring = a.ring("ns", "web");
        let held = ring.slots[0].load_full().unwrap();
        assert!(
            held.path.capacity() <= MAX_ACTIVITY_PATH_BYTES,
            "{}",
            held.path.capacity()
        );
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

    /// Past [`MAX_RINGS`] deployments, the least recently written ring goes.
    #[test]
    fn activity_rings_are_bounded() {
        let a = Activity::default();
        for i in 0..MAX_RINGS {
            a.push("ns", &format!("d{i}"), entry(0));
        }
        a.push("ns", "d0", entry(1));
        a.push("other", "new", entry(2));
        assert_eq!(a.latest("ns", "d0", 10).len(), 2, "written lately: kept");
        assert!(a.latest("ns", "d1", 10).is_empty(), "the oldest write went");
        assert_eq!(a.latest("other", "new", 10).len(), 1);
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
        l.set_limit(2, 2);
        assert_eq!(l.route("a", "d1", "/"), ("d1", "/"));
        assert_eq!(l.route("a", "d1", "/api"), ("d1", "/api"));
        assert_eq!(l.route("a", "d2", "/"), (OTHER, OTHER));
        assert_eq!(l.route("a", "d1", "/"), ("d1", "/"));
        assert_eq!(l.instance("a", "d1", "http://x:1"), "http://x:1");
        assert_eq!(l.instance("a", "d1", "http://x:2"), "http://x:2");
        assert_eq!(l.instance("a", "d1", "http://x:3"), OTHER);
    }

    /// One namespace takes at most its share of the node's cap: a tenant
    /// with many routes leaves room for the others.
    #[test]
    fn one_namespace_takes_at_most_its_share() {
        let l = RouteLabels::default();
        l.set_limit(4, 2);
        assert_eq!(l.route("greedy", "d", "/1"), ("d", "/1"));
        assert_eq!(l.route("greedy", "d", "/2"), ("d", "/2"));
        assert_eq!(l.route("greedy", "d", "/3"), (OTHER, OTHER));
        assert_eq!(l.route("greedy", "e", "/"), (OTHER, OTHER));
        assert_eq!(l.route("other", "d", "/1"), ("d", "/1"));
        assert_eq!(l.route("other", "d", "/2"), ("d", "/2"));
        // The node's cap still holds for everyone.
        assert_eq!(l.route("third", "d", "/"), (OTHER, OTHER));
        assert_eq!(l.route("greedy", "d", "/1"), ("d", "/1"));
        for i in 0..3 {
            let _ = l.instance("greedy", "d", &format!("http://x:{i}"));
        }
        assert_eq!(l.instance("other", "d", "http://y:1"), "http://y:1");
    }
}

pub mod trace {
    //! W3C Trace Context (https://www.w3.org/TR/trace-context/): the request's
    //! `traceparent` and `tracestate`. An incoming `traceparent` of version
    //! `00` with a 32-hex trace id and a 16-hex parent id (neither all zero) and
    //! 2-hex flags is continued: the trace id and flags are kept and the node
    //! takes a new span id, the parent id of the next hop (an upstream, a member
    //! of the cluster, a function's guest in its caller record). A malformed one (or
    //! several) is replaced by a new trace, its `tracestate` dropped; never is
    //! it forwarded as it came. Trace context is not identity: nothing
    //! authorizes by it, and the hop MAC does not cover it.
    use actix_web::http::header::HeaderMap;

    /// The `traceparent` header's name.
    pub const TRACEPARENT: &str = "traceparent";
    /// The `tracestate` header's name.
    pub const TRACESTATE: &str = "tracestate";
    /// Longest `tracestate` passed on (the spec's 32 members of at most 256
    /// bytes each need no more than this in practice); a longer one is dropped.
    const MAX_TRACESTATE: usize = 512;

    /// One request's trace context, in its extensions.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct TraceContext {
        /// The trace id (never all zero).
        pub trace_id: [u8; 16],
        /// This node's span id: the parent id sent to the next hop.
        pub span_id: [u8; 8],
        /// The trace flags (bit 0: sampled).
        pub flags: u8,
        /// The incoming `tracestate`, when the `traceparent` was valid.
        pub tracestate: Option<String>,
        /// The parent id the request came with, when it continued a trace.
        pub parent_id: Option<[u8; 8]>,
    }

    impl TraceContext {
        /// A new trace (no valid `traceparent` came in).
        pub fn fresh() -> TraceContext {
            TraceContext {
                trace_id: nonzero(),
                span_id: nonzero(),
                flags: 0,
                tracestate: None,
                parent_id: None,
            }
        }

        /// The context of a request: its `traceparent` continued when it is
        /// valid (and the only one), else a new trace.
        pub fn from_headers(headers: &HeaderMap) -> TraceContext {
            let mut tps = headers.get_all(TRACEPARENT);
            let (Some(tp), None) = (tps.next(), tps.next()) else {
                return TraceContext::fresh();
            };
            let Some((trace_id, parent, flags)) = tp.to_str().ok().and_then(parse_traceparent)
            else {
                return TraceContext::fresh();
            };
            let tracestate = {
                let parts: Vec<&str> = headers
                    .get_all(TRACESTATE)
                    .filter_map(|v| v.to_str().ok())
                    .map(str::trim)
                    .filter(|v| !v.is_empty())
                    .collect();
                let joined = parts.join(",");
                (!joined.is_empty()
                    && joined.len() <= MAX_TRACESTATE
                    && joined.bytes().all(|b| (0x20..0x7f).contains(&b)))
                .then_some(joined)
            };
            TraceContext {
                trace_id,
                span_id: nonzero(),
                flags,
                tracestate,
                parent_id: Some(parent),
            }
        }

        /// The `traceparent` for the next hop: `00-<trace id>-<span id>-<flags>`.
        pub fn traceparent(&self) -> String {
            self.traceparent_from(self.span_id)
        }

        /// The `traceparent` naming `parent` (a CLIENT span of this node's)
        /// as the next hop's parent. Written into one buffer of its fixed
        /// 55 bytes (every proxied request sends one).
        pub fn traceparent_from(&self, parent: [u8; 8]) -> String {
            let mut out = [0u8; 55];
            out[..3].copy_from_slice(b"00-");
            hex_into(&self.trace_id, &mut out[3..35]);
            out[35] = b'-';
            hex_into(&parent, &mut out[36..52]);
            out[52] = b'-';
            hex_into(&[self.flags], &mut out[53..55]);
            // Only ASCII hex digits and '-' were written.
            String::from_utf8_lossy(&out).into_owned()
        }

        /// The trace id in hex (logs and records).
        pub fn trace_id_hex(&self) -> String {
            hex::encode(self.trace_id)
        }
    }

    /// Lower-case hex of `bytes` into `out` (twice as long).
    fn hex_into(bytes: &[u8], out: &mut [u8]) {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        for (b, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
            pair[0] = DIGITS[usize::from(b >> 4)];
            pair[1] = DIGITS[usize::from(b & 0xf)];
        }
    }

    /// The trace id, parent id and flags of a valid version-00 `traceparent`.
    pub fn parse_traceparent(s: &str) -> Option<([u8; 16], [u8; 8], u8)> {
        let s = s.trim();
        let mut parts = s.split('-');
        let (version, trace, parent, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || version != "00" {
            return None;
        }
        let lower_hex = |p: &str, n: usize| {
            p.len() == n && p.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        if !lower_hex(trace, 32) || !lower_hex(parent, 16) || !lower_hex(flags, 2) {
            return None;
        }
        let mut t = [0u8; 16];
        let mut p = [0u8; 8];
        let mut f = [0u8; 1];
        hex::decode_to_slice(trace, &mut t).ok()?;
        hex::decode_to_slice(parent, &mut p).ok()?;
        hex::decode_to_slice(flags, &mut f).ok()?;
        if t == [0; 16] || p == [0; 8] {
            return None;
        }
        Some((t, p, f[0]))
    }

    /// Random-looking bytes, not all zero. Ids name, they do not authorize: a
    /// per-thread SplitMix64 seeded once from the OS (no system call per
    /// request, as for request ids in `chain::logger`).
    fn nonzero<const N: usize>() -> [u8; N] {
        use std::cell::Cell;
        thread_local! {
            static STATE: Cell<u64> =
                Cell::new(u64::from_le_bytes(crate::util::random_bytes::<8>()));
        }
        loop {
            let mut out = [0u8; N];
            for chunk in out.chunks_mut(8) {
                let z = STATE.with(|s| {
                    let mut z = s.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
                    s.set(z);
                    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                    z ^ (z >> 31)
                });
                chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
            }
            if out.iter().any(|&x| x != 0) {
                return out;
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use actix_web::http::header::{HeaderName, HeaderValue};

        fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(
                    HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                );
            }
            h
        }

        const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

        /// The `traceparent` written by hand is the one `format!` writes, for
        /// ids and flags of every nibble.
        #[test]
        fn traceparent_is_written_as_the_spec_spells_it() {
            for seed in 0u8..=255 {
                let t = TraceContext {
                    trace_id: std::array::from_fn(|i| {
                        seed.wrapping_mul(31).wrapping_add(i as u8 * 17)
                    }),
                    span_id: std::array::from_fn(|i| seed.wrapping_add(i as u8 * 29)),
                    flags: seed,
                    tracestate: None,
                    parent_id: None,
                };
                let want = format!(
                    "00-{}-{}-{:02x}",
                    hex::encode(t.trace_id),
                    hex::encode(t.span_id),
                    t.flags
                );
                assert_eq!(t.traceparent(), want);
                assert_eq!(t.traceparent_from([0xab; 8]).len(), 55);
                assert!(parse_traceparent(&want).is_some() || t.trace_id == [0; 16]);
            }
        }

        /// A valid traceparent is continued: same trace id and flags, a new span id.
        #[test]
        fn trace_valid_traceparent_is_continued() {
            let t = TraceContext::from_headers(&headers(&[
                (TRACEPARENT, GOOD),
                (TRACESTATE, "congo=t61rcWkgMzE"),
            ]));
            assert_eq!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
            assert_eq!(t.flags, 1);
            assert_eq!(hex::encode(t.parent_id.unwrap()), "00f067aa0ba902b7");
            assert_ne!(hex::encode(t.span_id), "00f067aa0ba902b7");
            assert_eq!(t.tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
            let tp = t.traceparent();
            assert!(
                tp.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
                "{tp}"
            );
            assert!(tp.ends_with("-01"));
            assert_eq!(parse_traceparent(&tp).map(|p| p.0), Some(t.trace_id));
        }

        /// Malformed ones are replaced by a new trace, their tracestate dropped.
        #[test]
        fn trace_malformed_traceparent_is_replaced() {
            for bad in [
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
                "garbage",
                "",
            ] {
                let t = TraceContext::from_headers(&headers(&[
                    (TRACEPARENT, bad),
                    (TRACESTATE, "a=b"),
                ]));
                assert_ne!(
                    t.trace_id_hex(),
                    "4bf92f3577b34da6a3ce929d0e0e4736",
                    "{bad}"
                );
                assert_eq!(t.parent_id, None, "{bad}");
                assert_eq!(t.tracestate, None, "{bad}");
                assert!(parse_traceparent(&t.traceparent()).is_some());
            }
            // Two traceparents: replaced too.
            let t =
                TraceContext::from_headers(&headers(&[(TRACEPARENT, GOOD), (TRACEPARENT, GOOD)]));
            assert_eq!(t.parent_id, None);
            // None: a new trace.
            let t = TraceContext::from_headers(&HeaderMap::new());
            assert!(parse_traceparent(&t.traceparent()).is_some());
        }
    }
}
