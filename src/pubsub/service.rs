//! `PubSubService`: one per node, the single delivery path to subscribers.
//!
//! A publish accepted by a namespace's supervisor comes here once. The
//! service encodes the outgoing frame once per framing in use (shared
//! [`Bytes`]), then sends one [`Delivery`] to the relay of each worker thread
//! that owns subscribers of the topic (one thread crossing per worker, never
//! one per subscriber), and hands the
//! message to the mesh ([`MeshSink`]) in cluster mode. Messages arriving from the mesh enter
//! through the namespace's supervisor (it owns the topic table) and come back
//! here with [`Origin::Mesh`], so they are fanned out locally and never
//! re-forwarded: each subscriber receives a message by exactly one path.

use super::protocol::{FrameKind, message_frame};
use crate::config::PubSubConfig;
use crate::metrics::Metrics;
use bytes::Bytes;
use parking_lot::RwLock;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Per relay, the connections (id, framing) that subscribe to a topic.
pub type Targets = Vec<(u32, Arc<Vec<(u64, FrameKind)>>)>;

/// Deliveries a relay's channel holds before further ones are dropped and
/// counted (`pubsub_dropped{reason="relay_full"}`). A relay only moves
/// ref-counted frames into socket queues, so it drains far faster than this fills.
pub const RELAY_QUEUE: usize = 65_536;

/// One message for the subscribers one relay owns.
pub struct Delivery {
    /// The frame of each [`FrameKind`], encoded once (None when unused).
    pub frames: Arc<[Option<Bytes>; 3]>,
    /// The relay's subscribed connections and the framing each wants (the
    /// topic table's list, shared, not copied).
    pub conns: Arc<Vec<(u64, FrameKind)>>,
}

/// What a relay's channel carries.
pub enum RelayMsg {
    /// A message for some of the relay's sockets.
    Deliver(Delivery),
    /// Close these sockets with `code` (their namespace was deleted).
    Close {
        /// The relay's connections to close (ids not open there are skipped).
        conns: Arc<Vec<(u64, FrameKind)>>,
        /// The WebSocket close code sent (4004 for a deleted namespace).
        code: u16,
    },
    /// Close every socket of the relay with `code` (the node was drained).
    CloseEvery {
        /// The WebSocket close code sent.
        code: u16,
    },
}

/// Where a message came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Published on this node: deliver locally and forward into the mesh.
    Local,
    /// Received from the mesh: deliver locally only.
    Mesh,
}

/// The cluster mesh's side of the seam: receives every locally published
/// message once. Single nodes have none.
pub trait MeshSink: Send + Sync {
    /// Sends one message to the other nodes; `timestamp` (Unix ms) is the one
    /// local subscribers saw, so every node delivers the same frame.
    /// `history`: a history topic's position of it (offset, epoch), given
    /// by the store; the other nodes keep it in their copies.
    fn forward(
        &self,
        namespace: &str,
        topic: &str,
        data: &Bytes,
        timestamp: u64,
        history: Option<(u64, &str)>,
    );
}

/// The node's pub/sub delivery service. Cheap to clone.
#[derive(Clone)]
pub struct PubSubService(Arc<Inner>);

/// The state behind [`PubSubService`], reached through its `Deref`.
pub struct Inner {
    /// The node's metrics: delivered and dropped frames, slow consumers.
    pub metrics: Metrics,
    /// `[pubsub]`: the socket queue limits and frame size.
    pub config: PubSubConfig,
    /// Each worker relay's channel, indexed by relay id; relays are never removed.
    relays: RwLock<Vec<tokio::sync::mpsc::Sender<RelayMsg>>>,
    /// The next connection id (from 1).
    next_conn: AtomicU64,
    /// The cluster mesh, set once at start in cluster mode; None on a single node.
    mesh: RwLock<Option<Arc<dyn MeshSink>>>,
    /// Flips to true when the node drains; each relay closes its sockets (1001).
    pub draining: tokio::sync::watch::Receiver<bool>,
}

impl std::ops::Deref for PubSubService {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl Default for PubSubService {
    /// A service with its own metrics and default config (unit tests).
    fn default() -> Self {
        let (_tx, rx) = tokio::sync::watch::channel(false);
        Self::new(Metrics::new(), PubSubConfig::default(), rx)
    }
}

impl PubSubService {
    /// A service with no relays yet (they register as sockets open) and no mesh.
    pub fn new(
        metrics: Metrics,
        config: PubSubConfig,
        draining: tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        Self(Arc::new(Inner {
            metrics,
            config,
            relays: RwLock::new(Vec::new()),
            next_conn: AtomicU64::new(1),
            mesh: RwLock::new(None),
            draining,
        }))
    }

    /// Plugs the cluster mesh in (the node calls this once at start in cluster mode).
    pub fn set_mesh(&self, mesh: Arc<dyn MeshSink>) {
        *self.0.mesh.write() = Some(mesh);
    }

    /// A fresh connection id, unique on this node.
    pub fn next_conn_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers a worker thread's relay; returns its id.
    pub(crate) fn add_relay(&self, tx: tokio::sync::mpsc::Sender<RelayMsg>) -> u32 {
        let mut r = self.relays.write();
        r.push(tx);
        (r.len() - 1) as u32
    }

    /// Delivers one message: local fan-out through the relays, then (for local
    /// publishes) the mesh. Called by namespace supervisors only, in mailbox
    /// order, so one publisher's messages keep their order.
    pub fn deliver(
        &self,
        namespace: &str,
        topic: &str,
        data: &Bytes,
        targets: Option<(&Targets, [bool; 3])>,
        origin: Origin,
    ) {
        let timestamp = super::protocol::now_ms();
        self.deliver_at(namespace, topic, data, targets, origin, timestamp, None);
    }

    /// [`deliver`](Self::deliver) with the message's timestamp given: a
    /// message from the mesh keeps the one its origin node gave it.
    /// `history`: the publication's place in its topic's history (offset,
    /// epoch; history topics only): every frame carries the offset, the
    /// mesh both.
    #[allow(clippy::too_many_arguments)]
    pub fn deliver_at(
        &self,
        namespace: &str,
        topic: &str,
        data: &Bytes,
        targets: Option<(&Targets, [bool; 3])>,
        origin: Origin,
        timestamp: u64,
        history: Option<(u64, &str)>,
    ) {
        let offset = history.map(|(o, _)| o);
        if let Some((targets, kinds)) = targets {
            let frames: Arc<[Option<Bytes>; 3]> = Arc::new(FrameKind::ALL.map(|k| {
                kinds[k.index()].then(|| message_frame(k, topic, data, timestamp, offset))
            }));
            let relays = self.relays.read();
            for (relay, conns) in targets {
                let Some(tx) = relays.get(*relay as usize) else {
                    continue;
                };
                let d = RelayMsg::Deliver(Delivery {
                    frames: frames.clone(),
                    conns: conns.clone(),
                });
                if tx.try_send(d).is_err() {
                    self.metrics
                        .pubsub_dropped
                        .with_label_values(&["relay_full"])
                        .inc_by(conns.len() as u64);
                }
            }
        }
        if origin == Origin::Local
            && let Some(mesh) = self.0.mesh.read().as_ref()
        {
            mesh.forward(namespace, topic, data, timestamp, history);
        }
    }

    /// Delivers one message received from the mesh to this node's
    /// subscribers of its topic (`route`, read from the namespace's
    /// [`MeshRoutes`](super::MeshRoutes) without its supervisor), with the
    /// origin's timestamp. Unlike [`deliver_at`](Self::deliver_at) it never
    /// drops at a full relay queue: it waits for room, which holds the mesh
    /// ingress back (its caller delivers one message after the other, so the
    /// order is kept). A socket that cannot keep up is still closed as a slow
    /// consumer by its own bounded queue, in its relay.
    pub async fn deliver_from_mesh(
        &self,
        topic: &str,
        data: &Bytes,
        route: &super::Route,
        timestamp: u64,
    ) {
        let frames: Arc<[Option<Bytes>; 3]> = Arc::new(FrameKind::ALL.map(|k| {
            route.kinds[k.index()].then(|| message_frame(k, topic, data, timestamp, None))
        }));
        for (relay, conns) in &route.targets {
            let d = RelayMsg::Deliver(Delivery {
                frames: frames.clone(),
                conns: conns.clone(),
            });
            // Fast path: room in the relay's queue.
            let full = {
                let relays = self.relays.read();
                let Some(tx) = relays.get(*relay as usize) else {
                    continue;
                };
                match tx.try_send(d) {
                    Ok(()) => None,
                    Err(tokio::sync::mpsc::error::TrySendError::Full(d)) => Some((tx.clone(), d)),
                    Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => None,
                }
            };
            if let Some((tx, d)) = full {
                self.metrics.mesh_ingress_waits.inc();
                let _ = tx.send(d).await;
            }
        }
    }

    /// Hands `frame` (one or several complete frames) to one socket through
    /// its relay: the same channel as live deliveries, so what is sent here
    /// reaches the socket before any publication delivered after it (a
    /// recovery's missed publications). False when the relay's queue is full.
    pub fn send_to(&self, relay: u32, conn: u64, kind: FrameKind, frame: Bytes) -> bool {
        let relays = self.relays.read();
        let Some(tx) = relays.get(relay as usize) else {
            return false;
        };
        let mut frames: [Option<Bytes>; 3] = [None, None, None];
        frames[kind.index()] = Some(frame);
        let d = RelayMsg::Deliver(Delivery {
            frames: Arc::new(frames),
            conns: Arc::new(vec![(conn, kind)]),
        });
        if tx.try_send(d).is_err() {
            self.metrics
                .pubsub_dropped
                .with_label_values(&["relay_full"])
                .inc();
            return false;
        }
        true
    }

    /// Closes every socket of this node with `code` (best effort: a relay
    /// whose queue is full is passed over).
    pub fn close_every(&self, code: u16) {
        for tx in self.relays.read().iter() {
            let _ = tx.try_send(RelayMsg::CloseEvery { code });
        }
    }

    /// Closes every socket in `targets` with `code` (best effort, bounded).
    pub fn close_all(&self, targets: &Targets, code: u16) {
        let relays = self.relays.read();
        for (relay, conns) in targets {
            if let Some(tx) = relays.get(*relay as usize) {
                let _ = tx.try_send(RelayMsg::Close {
                    conns: conns.clone(),
                    code,
                });
            }
        }
    }
}

/// One message published on another node, as the mesh hands it to this
/// node's namespace supervisor.
#[derive(Debug, Clone, PartialEq)]
pub struct MeshMessage {
    /// The topic within the supervisor's namespace the origin published to
    /// (shared by the messages of one topic in a received batch).
    pub topic: std::sync::Arc<str>,
    /// The payload as published on the origin node.
    pub data: Bytes,
    /// When the origin node accepted the message (ms since the Unix epoch).
    pub timestamp: u64,
    /// A history topic's publication: its offset and epoch, as the store gave them.
    pub history: Option<(u64, String)>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pubsub::Route;

    /// A mesh delivery waits for room in a full relay queue instead of
    /// dropping (a local one counts `relay_full`), and keeps the order.
    #[tokio::test]
    async fn mesh_delivery_waits_for_a_full_relay() {
        let service = PubSubService::default();
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let relay = service.add_relay(tx);
        let route = Route {
            targets: vec![(relay, Arc::new(vec![(7, FrameKind::Binary)]))],
            kinds: [false, false, true],
        };
        let s = service.clone();
        let r = route.clone();
        let sender = tokio::spawn(async move {
            for i in 0..5u8 {
                s.deliver_from_mesh("t", &Bytes::from(vec![i]), &r, 0).await;
            }
        });
        let mut got = Vec::new();
        while got.len() < 5 {
            match rx.recv().await.expect("relay channel open") {
                RelayMsg::Deliver(d) => {
                    let f = d.frames[FrameKind::Binary.index()].clone().unwrap();
                    got.push(*f.last().unwrap());
                }
                RelayMsg::Close { .. } | RelayMsg::CloseEvery { .. } => panic!("a close"),
            }
        }
        sender.await.unwrap();
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
        let dropped = service
            .metrics
            .pubsub_dropped
            .with_label_values(&["relay_full"])
            .get();
        assert_eq!(dropped, 0);
        assert!(service.metrics.mesh_ingress_waits.get() >= 1);
    }
}
