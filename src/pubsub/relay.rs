//! The per-worker relay and each socket's bounded outbound queue.
//!
//! Every HTTP worker thread that hosts sockets has one relay. It owns that
//! thread's connections (`Rc`, no locks) and receives [`Delivery`]s from the
//! [`PubSubService`]: one channel message per publish per worker, whatever the
//! number of subscribers. For each subscriber it pushes a ref-counted clone of
//! the pre-encoded frame into the socket's queue. The socket's response body
//! ([`OutBody`]) yields queued frames to actix's HTTP/1 dispatcher, which
//! gathers them into one write of up to 32 KiB: socket writes are batched
//! whenever several frames are queued.
//!
//! A queue that would exceed `outbound_queue_messages` or
//! `outbound_queue_bytes` is a slow consumer: its frames are dropped (and
//! counted), a 4008 close frame is queued instead and its session is told to
//! stop. Nobody else waits for it.

use super::protocol::{close, close_frame};
use super::service::{Delivery, PubSubService, RELAY_QUEUE, RelayMsg};
use bytes::Bytes;
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

thread_local! {
    /// This worker thread's relay, once a socket opened here.
    static LOCAL: RefCell<Option<Rc<Relay>>> = const { RefCell::new(None) };
}

/// The relay of one worker thread.
pub struct Relay {
    /// Its index in the service's relay list; [`SubscriberRef::relay`](super::SubscriberRef::relay)
    /// names it so a publish reaches the right thread.
    pub id: u32,
    /// The node's pub/sub service (metrics, limits, drain signal).
    service: PubSubService,
    /// The open connections of this thread, by connection id.
    conns: RefCell<HashMap<u64, Rc<Conn>>>,
}

impl Relay {
    /// This thread's relay, started on first use.
    pub fn local(service: &PubSubService) -> Rc<Relay> {
        LOCAL.with(|l| {
            if let Some(r) = l.borrow().as_ref() {
                return r.clone();
            }
            let (tx, rx) = tokio::sync::mpsc::channel(RELAY_QUEUE);
            let relay = Rc::new(Relay {
                id: service.add_relay(tx),
                service: service.clone(),
                conns: RefCell::new(HashMap::new()),
            });
            actix_rt::spawn(run(relay.clone(), rx));
            actix_rt::spawn(watch_drain(relay.clone(), service.draining.clone()));
            *l.borrow_mut() = Some(relay.clone());
            relay
        })
    }

    /// Opens a connection's queue on this thread.
    pub fn open(&self) -> Rc<Conn> {
        let cfg = &self.service.config;
        let conn = Rc::new(Conn {
            id: self.service.next_conn_id(),
            max_messages: cfg.outbound_queue_messages,
            max_bytes: cfg.outbound_queue_bytes,
            out: RefCell::new(Outbound::default()),
            service: self.service.clone(),
        });
        self.conns.borrow_mut().insert(conn.id, conn.clone());
        conn
    }

    /// Forgets a connection: later deliveries to it are dropped (`gone`).
    pub fn forget(&self, conn: u64) {
        self.conns.borrow_mut().remove(&conn);
    }

    /// Pushes a publish's frame to each of its connections still open here.
    fn deliver(&self, d: Delivery) {
        let conns = self.conns.borrow();
        let mut delivered = 0u64;
        let mut gone = 0u64;
        for (id, kind) in d.conns.iter() {
            let (Some(c), Some(frame)) = (conns.get(id), &d.frames[kind.index()]) else {
                gone += 1;
                continue;
            };
            if c.push(frame.clone()) {
                delivered += 1;
            }
        }
        let m = &self.service.metrics;
        m.pubsub_delivered.inc_by(delivered);
        if gone > 0 {
            m.pubsub_dropped.with_label_values(&["gone"]).inc_by(gone);
        }
    }
}

/// The relay's loop: deliveries and closes from the service, in order.
///
/// It pushes at most a **turn** at a time, then yields so the response bodies
/// of this thread's sockets (woken by the pushes) write what was queued
/// before it takes more: a turn ends after a quarter of a socket queue's
/// limits (`outbound_queue_messages / 4` deliveries, at most 64, or
/// `outbound_queue_bytes / 4` of the largest frame of each delivery), which
/// is the most one socket can have been given in it. A burst (the mesh
/// hands over whole batches at once) therefore never fills the queue of a
/// socket that keeps up; one whose client does not read stays a slow
/// consumer.
async fn run(relay: Rc<Relay>, mut rx: tokio::sync::mpsc::Receiver<RelayMsg>) {
    let cfg = &relay.service.config;
    let turn_msgs = (cfg.outbound_queue_messages / 4).clamp(1, 64);
    let turn_bytes = (cfg.outbound_queue_bytes / 4).max(1);
    let (mut msgs, mut bytes) = (0usize, 0usize);
    let mut batch = Vec::with_capacity(64);
    while rx.recv_many(&mut batch, 64).await > 0 {
        for m in batch.drain(..) {
            match m {
                RelayMsg::Deliver(d) => {
                    msgs += 1;
                    bytes += d
                        .frames
                        .iter()
                        .flatten()
                        .map(|f| f.len())
                        .max()
                        .unwrap_or(0);
                    relay.deliver(d);
                    if msgs >= turn_msgs || bytes >= turn_bytes {
                        msgs = 0;
                        bytes = 0;
                        tokio::task::yield_now().await;
                    }
                }
                RelayMsg::CloseEvery { code } => {
                    let all: Vec<Rc<Conn>> = relay.conns.borrow().values().cloned().collect();
                    for c in all {
                        c.shutdown(code, close::reason(code));
                    }
                }
                RelayMsg::Close { conns, code } => {
                    let found: Vec<Rc<Conn>> = {
                        let map = relay.conns.borrow();
                        conns
                            .iter()
                            .filter_map(|(id, _)| map.get(id).cloned())
                            .collect()
                    };
                    for c in found {
                        c.shutdown(code, close::reason(code));
                    }
                }
            }
        }
    }
}

/// On drain, every socket of this thread gets a 1001 close frame.
async fn watch_drain(relay: Rc<Relay>, mut draining: tokio::sync::watch::Receiver<bool>) {
    if draining.wait_for(|d| *d).await.is_err() {
        return;
    }
    let conns: Vec<Rc<Conn>> = relay.conns.borrow().values().cloned().collect();
    for c in conns {
        c.shutdown(close::GOING_AWAY, "node draining");
    }
}

/// Whether a queue still takes frames.
#[derive(Default, PartialEq, Eq, Clone, Copy)]
enum State {
    /// Takes frames.
    #[default]
    Open,
    /// A close frame is the last thing queued.
    Closing,
}

/// Sent by the relay or the response body (same thread) to the socket's
/// session when the connection must end: slow consumer, node drain, or the
/// TCP connection is gone.
#[derive(actix::Message)]
#[rtype(result = "()")]
pub struct Shutdown;

/// The mutable part of a [`Conn`].
#[derive(Default)]
struct Outbound {
    /// Encoded WebSocket frames not yet handed to the dispatcher.
    queue: VecDeque<Bytes>,
    /// Bytes in `queue`, checked against `outbound_queue_bytes`.
    bytes: usize,
    /// The response body's task, woken when a frame is queued.
    waker: Option<Waker>,
    /// Open, or closing with a close frame last in the queue.
    state: State,
    /// The socket's session, told to stop on shutdown (weak: the queue must
    /// not keep it alive).
    session: Option<actix::WeakRecipient<Shutdown>>,
}

/// One socket's bounded outbound queue, shared by its relay, its session and
/// its response body (all on the same thread).
pub struct Conn {
    /// Unique per node (from the service); the subscriber's key in topic tables.
    pub id: u64,
    /// Frames queued at most (`pubsub.outbound_queue_messages`); past it: 4008.
    max_messages: usize,
    /// Bytes queued at most (`pubsub.outbound_queue_bytes`); past it: 4008.
    max_bytes: usize,
    /// The queue and its state.
    out: RefCell<Outbound>,
    /// For the drop counters.
    service: PubSubService,
}

impl Conn {
    /// Tells the queue which session to notify when it closes.
    pub fn attach(&self, session: actix::WeakRecipient<Shutdown>) {
        self.out.borrow_mut().session = Some(session);
    }

    /// Queues a frame. False when the socket is closing or the frame overflowed
    /// the queue (then the socket is closed with 4008).
    pub fn push(&self, frame: Bytes) -> bool {
        let mut o = self.out.borrow_mut();
        if o.state != State::Open {
            drop(o);
            self.service
                .metrics
                .pubsub_dropped
                .with_label_values(&["closing"])
                .inc();
            return false;
        }
        if o.queue.len() >= self.max_messages || o.bytes + frame.len() > self.max_bytes {
            drop(o);
            self.service.metrics.slow_consumers_closed.inc();
            self.service
                .metrics
                .pubsub_dropped
                .with_label_values(&["slow_consumer"])
                .inc();
            self.shutdown(close::SLOW_CONSUMER, "slow consumer");
            return false;
        }
        o.bytes += frame.len();
        o.queue.push_back(frame);
        if let Some(w) = o.waker.take() {
            w.wake();
        }
        true
    }

    /// Replaces whatever is queued by a close frame (the dropped frames are
    /// counted) and tells the session to stop. Idempotent.
    pub fn shutdown(&self, code: u16, reason: &str) {
        let session = {
            let mut o = self.out.borrow_mut();
            if o.state != State::Open {
                return;
            }
            if !o.queue.is_empty() {
                self.service
                    .metrics
                    .pubsub_dropped
                    .with_label_values(&["closed"])
                    .inc_by(o.queue.len() as u64);
            }
            o.queue.clear();
            let f = close_frame(code, reason);
            o.bytes = f.len();
            o.queue.push_back(f);
            o.state = State::Closing;
            if let Some(w) = o.waker.take() {
                w.wake();
            }
            o.session.take()
        };
        if let Some(addr) = session.and_then(|s| s.upgrade()) {
            addr.do_send(Shutdown);
        }
    }

    /// Queues a close frame after what is already queued (a normal close).
    pub fn close_after_queue(&self, code: u16, reason: &str) {
        let mut o = self.out.borrow_mut();
        if o.state != State::Open {
            return;
        }
        let f = close_frame(code, reason);
        o.bytes += f.len();
        o.queue.push_back(f);
        o.state = State::Closing;
        o.session = None;
        if let Some(w) = o.waker.take() {
            w.wake();
        }
    }

    /// Frames and bytes queued now.
    pub fn queued(&self) -> (usize, usize) {
        let o = self.out.borrow();
        (o.queue.len(), o.bytes)
    }
}

/// The socket's response body: yields queued frames, ends after a close frame.
pub struct OutBody(pub Rc<Conn>);

impl futures_util::Stream for OutBody {
    type Item = Result<Bytes, std::convert::Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut o = self.0.out.borrow_mut();
        if let Some(f) = o.queue.pop_front() {
            o.bytes -= f.len();
            return Poll::Ready(Some(Ok(f)));
        }
        if o.state == State::Closing {
            return Poll::Ready(None);
        }
        o.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for OutBody {
    /// The socket's writer dropped the body: the TCP connection is gone
    /// (reset, closed after our close frame, or a write stalled past its
    /// bound). Make sure the session stops.
    fn drop(&mut self) {
        let session = {
            let mut o = self.0.out.borrow_mut();
            o.state = State::Closing;
            o.queue.clear();
            o.bytes = 0;
            o.session.take()
        };
        if let Some(addr) = session.and_then(|s| s.upgrade()) {
            addr.do_send(Shutdown);
        }
    }
}
