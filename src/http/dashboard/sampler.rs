//! The sampler: one task per node that reads every number once per tick, keeps a
//! bounded history for the charts, and hands the same pre-rendered frame to every
//! viewer (one snapshot per tick however many pages are open).

use super::snapshot::{self, HistoryPoint, Previous, Snapshot};
use crate::http::state::{Node, NodeInner};
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How often the sampler reads the registry and the stream sends a frame.
pub const TICK_INTERVAL: Duration = Duration::from_secs(1);
/// History points kept for the charts: ten minutes at one per tick.
pub const HISTORY_LEN: usize = 600;
/// Namespaces are re-listed from the store every this many ticks.
pub const NAMESPACE_LIST_TICKS: u64 = 5;
/// Most idle (not running) namespaces listed from the store.
pub const MAX_LISTED_NAMESPACES: usize = 1000;
/// Streams open at once; more are answered 503 (each costs a socket, not a snapshot).
pub const MAX_VIEWERS: usize = 1024;

/// One tick, rendered once and shared by every viewer.
pub struct Frame {
    /// The tick's numbers, for `/__admin/api/snapshot`.
    pub snapshot: Arc<Snapshot>,
    /// The snapshot as a server-sent event (`event: snapshot`).
    pub sse: Bytes,
}

impl Frame {
    fn render(snapshot: Snapshot) -> Frame {
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
    pub(super) sessions: super::session::SessionCache,
}

impl Default for Dashboard {
    fn default() -> Self {
        let (latest, _) = tokio::sync::watch::channel(Arc::new(Frame::render(Snapshot::default())));
        Dashboard {
            latest,
            history: Mutex::new(VecDeque::with_capacity(HISTORY_LEN)),
            viewers: Arc::new(AtomicUsize::new(0)),
            sessions: Default::default(),
        }
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
        (before < MAX_VIEWERS).then_some(guard)
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
    fn publish(&self, snapshot: Snapshot) {
        {
            let mut h = self.history.lock();
            if h.len() == HISTORY_LEN {
                h.pop_front();
            }
            h.push_back(HistoryPoint::of(&snapshot));
        }
        self.latest.send_replace(Arc::new(Frame::render(snapshot)));
    }
}

/// Starts the node's sampler; it stops when the node is dropped.
pub fn spawn_sampler(node: &Node) {
    let weak: std::sync::Weak<NodeInner> = Arc::downgrade(&node.0);
    actix_web::rt::spawn(async move {
        let mut prev = Previous::default();
        let mut tick = tokio::time::interval(TICK_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut known: Vec<String> = Vec::new();
        let mut n: u64 = 0;
        loop {
            tick.tick().await;
            let Some(inner) = weak.upgrade() else { return };
            let node = Node(inner);
            if n.is_multiple_of(NAMESPACE_LIST_TICKS) {
                known = listed_namespaces(&node).await;
            }
            n += 1;
            let snap = snapshot::take(&node, &mut prev, &known);
            node.dashboard.publish(snap);
        }
    });
}

/// Names of the namespaces in the store, so idle ones (no supervisor running yet)
/// are shown too.
async fn listed_namespaces(node: &Node) -> Vec<String> {
    use crate::storage::OrderedKv;
    match node.store.scan_prefix(b"ns/", MAX_LISTED_NAMESPACES).await {
        Ok(rows) => rows
            .into_iter()
            .filter_map(|(k, _)| String::from_utf8(k[3..].to_vec()).ok())
            .collect(),
        Err(e) => {
            tracing::warn!(error = %e, "Dashboard could not list namespaces.");
            Vec::new()
        }
    }
}
