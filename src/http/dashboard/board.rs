//! The dashboard's state on the node, what [`Node`](crate::http::state::Node)
//! holds: the latest frame, the history for the charts, the viewers, and the
//! sign-in sessions read recently. Below `state.rs`: the sampler and the
//! routes, which take the node, fill and read it.

use super::snapshot::{HistoryPoint, Snapshot};
use crate::util::{Clock, SystemClock};
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// History points kept for the charts: ten minutes at one per tick.
pub const HISTORY_LEN: usize = 600;
/// An API request keeps the sampler ticking this long after it (a page that
/// polls instead of streaming).
pub const POLL_KEEPALIVE: Duration = Duration::from_secs(10);
/// A frame younger than this is fresh enough to answer an API request with.
const FRESH: Duration = Duration::from_millis(2500);
/// How long an API request waits for the first frame after a pause.
const FIRST_FRAME_WAIT: Duration = Duration::from_secs(3);
/// Streams open at once; more are answered 503 (each costs a socket, not a snapshot).
pub const MAX_VIEWERS: usize = 1024;

/// One tick, rendered once and shared by every viewer.
pub struct Frame {
    /// The tick's numbers, for `/__admin/api/snapshot`.
    pub snapshot: Arc<Snapshot>,
    /// The snapshot as a server-sent event (`event: snapshot`).
    pub sse: Bytes,
    /// When the sampler took it; None for the empty frame before the first.
    taken: Option<Instant>,
}

impl Frame {
    fn render(snapshot: Snapshot, taken: Option<Instant>) -> Frame {
        let json = serde_json::to_string(&snapshot).expect("snapshot serialises");
        let mut sse = String::with_capacity(json.len() + 40);
        sse.push_str("event: snapshot\nid: ");
        sse.push_str(&snapshot.tick.to_string());
        sse.push_str("\ndata: ");
        sse.push_str(&json);
        sse.push_str("\n\n");
        Frame {
            snapshot: Arc::new(snapshot),
            sse: Bytes::from(sse),
            taken,
        }
    }
}

/// The dashboard's state on the node: the latest frame, the history, the viewers.
pub struct Dashboard {
    /// The latest frame; every stream holds a receiver and wakes on a new one.
    latest: tokio::sync::watch::Sender<Arc<Frame>>,
    /// Chart points, oldest first, at most [`HISTORY_LEN`].
    history: Mutex<VecDeque<HistoryPoint>>,
    /// Streams open now (shared with each [`ViewerGuard`]), capped by [`MAX_VIEWERS`].
    viewers: Arc<AtomicUsize>,
    /// Sign-in sessions this node read from the store recently (`session.rs`).
    pub(crate) sessions: SessionCache,
    /// Wakes the idle sampler: a stream opened, an API request, the node dropped.
    pub(crate) wake: Arc<Notify>,
    /// When the last API request came, in milliseconds after `born`; 0: never.
    last_poll_ms: AtomicU64,
    /// The origin of `last_poll_ms`.
    born: Instant,
}

impl Default for Dashboard {
    fn default() -> Self {
        let (latest, _) =
            tokio::sync::watch::channel(Arc::new(Frame::render(Snapshot::default(), None)));
        Dashboard {
            latest,
            history: Mutex::new(VecDeque::with_capacity(HISTORY_LEN)),
            viewers: Arc::new(AtomicUsize::new(0)),
            sessions: Default::default(),
            wake: Arc::new(Notify::new()),
            last_poll_ms: AtomicU64::new(0),
            born: crate::util::mono_now(),
        }
    }
}

impl Drop for Dashboard {
    /// Lets an idle sampler see that its node is gone, and end.
    fn drop(&mut self) {
        self.wake.notify_one();
    }
}

/// Counts an open stream; dropped when the stream ends.
pub struct ViewerGuard(Arc<AtomicUsize>);

impl Drop for ViewerGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Dashboard {
    /// The latest frame.
    pub fn latest(&self) -> Arc<Frame> {
        self.latest.borrow().clone()
    }

    /// A receiver that wakes on every new frame.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Arc<Frame>> {
        self.latest.subscribe()
    }

    /// Takes a viewer slot; None when [`MAX_VIEWERS`] streams are open.
    pub fn admit_viewer(&self) -> Option<ViewerGuard> {
        let before = self.viewers.fetch_add(1, Ordering::AcqRel);
        let guard = ViewerGuard(self.viewers.clone());
        self.wake.notify_one();
        (before < MAX_VIEWERS).then_some(guard)
    }

    /// Whether the sampler should tick: a stream is open, or an API request
    /// came in the last [`POLL_KEEPALIVE`].
    pub fn watched(&self) -> bool {
        if self.viewers() > 0 {
            return true;
        }
        let last = self.last_poll_ms.load(Ordering::Acquire);
        last != 0 && self.ms_now().saturating_sub(last) <= POLL_KEEPALIVE.as_millis() as u64
    }

    fn ms_now(&self) -> u64 {
        (self.born.elapsed().as_millis() as u64).max(1)
    }

    /// The latest frame for an API request: marks the request (it keeps the
    /// sampler ticking for [`POLL_KEEPALIVE`]) and, when the sampler was
    /// paused, waits for its first new frame (at most a few seconds).
    pub async fn fresh(&self) -> Arc<Frame> {
        self.last_poll_ms.store(self.ms_now(), Ordering::Release);
        self.wake.notify_one();
        let mut rx = self.latest.subscribe();
        let stale = |f: &Frame| f.taken.is_none_or(|t| t.elapsed() > FRESH);
        if stale(&rx.borrow_and_update()) {
            let _ = tokio::time::timeout(FIRST_FRAME_WAIT, rx.changed()).await;
        }
        self.latest()
    }

    /// Streams open now.
    pub fn viewers(&self) -> usize {
        self.viewers.load(Ordering::Acquire)
    }

    /// The history, oldest first.
    pub fn history(&self) -> Vec<HistoryPoint> {
        self.history.lock().iter().cloned().collect()
    }

    /// Appends the snapshot to the history and hands it to every viewer.
    pub(crate) fn publish(&self, snapshot: Snapshot) {
        {
            let mut h = self.history.lock();
            if h.len() == HISTORY_LEN {
                h.pop_front();
            }
            h.push_back(HistoryPoint::of(&snapshot));
        }
        self.latest.send_replace(Arc::new(Frame::render(
            snapshot,
            Some(crate::util::mono_now()),
        )));
    }
}

/// How long a node keeps a session it read from the store before reading it
/// again: the longest another node honours a session after a sign-out.
pub const SESSION_CACHE_TTL: Duration = Duration::from_secs(5);
/// Most sessions a node keeps in memory; past it the cache starts over.
pub const SESSION_CACHE_MAX: usize = 1024;
/// Sessions this node read recently: session id → (expiry, read at), aged
/// by its clock ([`SystemClock`] but in tests).
pub struct SessionCache {
    entries: Mutex<HashMap<String, (u64, Instant)>>,
    clock: Arc<dyn Clock>,
}

impl Default for SessionCache {
    fn default() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }
}

impl SessionCache {
    /// An empty cache aged by `clock`.
    pub fn with_clock(clock: Arc<dyn Clock>) -> SessionCache {
        SessionCache {
            entries: Mutex::new(HashMap::new()),
            clock,
        }
    }

    /// The expiry of a session read less than [`SESSION_CACHE_TTL`] ago.
    pub(crate) fn get(&self, id: &str) -> Option<u64> {
        let now = self.clock.now();
        let map = self.entries.lock();
        let (exp, at) = map.get(id)?;
        (now.saturating_duration_since(*at) < SESSION_CACHE_TTL).then_some(*exp)
    }

    pub(crate) fn insert(&self, id: String, exp: u64) {
        let now = self.clock.now();
        let mut map = self.entries.lock();
        if map.len() >= SESSION_CACHE_MAX {
            map.clear();
        }
        map.insert(id, (exp, now));
    }

    pub(crate) fn evict(&self, id: &str) {
        self.entries.lock().remove(id);
    }
}
