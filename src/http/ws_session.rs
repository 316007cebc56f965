//! `WsSession`: one actor per WebSocket connection. It owns the connection's
//! outbound queue ([`Conn`], shared with this thread's relay), its heartbeat
//! and read deadline, and its subscriptions; it turns client frames into typed
//! messages to the namespace's supervisor.
//!
//! Order: every request a client frame causes is *enqueued* into the
//! supervisor's mailbox while the frame is handled (not when a future first
//! runs), and each answer fills a numbered slot; answers leave in slot order.
//! So a client's publishes are handled, delivered and acknowledged in the
//! order it sent them, while many are in flight.

use crate::actors::{
    AskError, NsHandle, NsResult, Publish, Release, Subscribe, Unsubscribe, UnsubscribeAll,
};
use crate::error::ApiError;
use crate::http::state::Node;
use crate::identity::Identity;
use crate::pubsub::SubscriberRef;
use crate::pubsub::protocol::{
    self, ClientFrame, FrameError, FrameKind, Opcode, ack, ack_fields, close, error_frame, ws_frame,
};
use crate::pubsub::{Conn, Relay, Shutdown};
use actix::prelude::*;
use actix_ws::{AggregatedMessage, ProtocolError};
use bytes::Bytes;
use futures_util::future::LocalBoxFuture;
use serde_json::Value;
use std::collections::{HashSet, VecDeque};
use std::rc::Rc;
use std::time::{Duration, Instant};

/// Client frames whose answers may be pending at once; past it the session
/// stops reading until the oldest answer is in.
pub const MAX_IN_FLIGHT: usize = 256;

/// Whether the session reads its client's frames: closed while more than
/// [`MAX_IN_FLIGHT`] answers are pending, opened again once half of them
/// are out. Pausing the *stream* (rather than the actor with `ctx.wait`)
/// lets every pending answer go on meanwhile: a pipelined burst of history
/// publishes (answered once stored) is stored in a few batches, not one
/// store write per frame.
#[derive(Clone, Default)]
struct Gate(Rc<GateState>);

#[derive(Default)]
struct GateState {
    closed: std::cell::Cell<bool>,
    waker: std::cell::RefCell<Option<std::task::Waker>>,
}

impl Gate {
    fn close(&self) {
        self.0.closed.set(true);
    }

    fn is_closed(&self) -> bool {
        self.0.closed.get()
    }

    fn open(&self) {
        self.0.closed.set(false);
        if let Some(w) = self.0.waker.borrow_mut().take() {
            w.wake();
        }
    }
}

/// The client's frames, read only while the [`Gate`] is open.
struct Gated<S> {
    inner: S,
    gate: Gate,
}

impl<S: futures_util::Stream + Unpin> futures_util::Stream for Gated<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        if self.gate.is_closed() {
            *self.gate.0.waker.borrow_mut() = Some(cx.waker().clone());
            return std::task::Poll::Pending;
        }
        std::pin::Pin::new(&mut self.inner).poll_next(cx)
    }
}
/// Topics one `/v1/ws` connection may subscribe to.
pub const MAX_TOPICS_PER_CONNECTION: usize = 1000;

/// What kind of socket this is.
pub enum Mode {
    /// `/v1/pubsub/ws`: one topic; client frames are published to it.
    Simple {
        topic: String,
        kind: FrameKind,
        can_publish: bool,
    },
    /// `/v1/ws`: many topics, JSON frames with ids.
    Full { topics: HashSet<String> },
}

/// How often a socket opened with a token checks that its session was not
/// ended (and at most how long after the end reaches the node it stays open
/// for a client that sends nothing).
pub const CREDENTIAL_CHECK: Duration = Duration::from_secs(5);

/// The actor.
pub struct WsSession {
    /// The node: its pub/sub settings (frame size, ping, read timeout) and metrics.
    node: Node,
    /// The namespace's supervisor handle: subscribes, publishes and invokes go through it.
    ns: NsHandle,
    /// The socket's credential, checked on every frame (None: no grants at all).
    identity: Option<Identity>,
    /// The worker thread's relay that delivers pub/sub messages to this socket.
    relay: Rc<Relay>,
    /// The socket's outgoing side: frames queue here; its id keys the subscriptions.
    conn: Rc<Conn>,
    /// Single-topic `/v1/pubsub/ws` or multi-topic `/v1/ws`, with its topics.
    mode: Mode,
    /// When the client last sent anything; past the read timeout the socket closes.
    last_heard: Instant,
    /// Answers in client order: `slots[0]` answers frame number `base`.
    slots: VecDeque<Option<Bytes>>,
    /// Recovering subscribes by the sequence number of their frame: once the
    /// answer is in the socket's queue, the missed publications (set by the
    /// answer's future) go right after it, and the supervisor is told to
    /// release the live ones it holds ([`Release`]).
    recoveries: Rc<std::cell::RefCell<std::collections::HashMap<u64, Recovery>>>,
    /// Sequence number of the client frame `slots[0]` answers; grows as answers go out.
    base: u64,
    /// This socket and its subscriptions, counted against the namespace's
    /// quotas; given back when the session is dropped.
    quota: crate::quota::LiveHold,
    /// Closed while too many answers are pending: no frame is read.
    gate: Gate,
    /// The chain's rate limiters and the namespace's record as read when
    /// the socket opened: each publish or invoke frame charges the
    /// namespace's bucket, as a request does ([`WsSession::charge`]).
    limits: SocketLimits,
}

/// A recovering subscribe's topic and, once answered, its missed publications.
struct Recovery {
    topic: String,
    missed: Vec<Bytes>,
}

/// What a socket's frames are rate-limited by.
pub struct SocketLimits {
    /// The chain's limiters (the node's namespace buckets).
    pub limiters: std::sync::Arc<crate::http::chain::limits::Limiters>,
    /// The namespace's record (its own rate limit): read when the socket
    /// opened, then taken again from the node's current copy at most once
    /// a second ([`RECORD_RECHECK`]); kept while the node holds none.
    pub record: Option<std::sync::Arc<crate::namespace::NamespaceRecord>>,
    /// The namespace's name as its bucket's key.
    pub key: String,
    /// When `record` was last taken.
    pub since: Instant,
}

/// How often a socket takes its namespace's record again for its rate limit.
const RECORD_RECHECK: Duration = Duration::from_secs(1);

impl WsSession {
    pub fn new(
        node: Node,
        ns: NsHandle,
        identity: Option<Identity>,
        relay: Rc<Relay>,
        conn: Rc<Conn>,
        mode: Mode,
        quota: crate::quota::LiveHold,
        limits: SocketLimits,
    ) -> Self {
        Self {
            node,
            ns,
            identity,
            relay,
            conn,
            mode,
            last_heard: crate::util::mono_now(),
            slots: VecDeque::new(),
            recoveries: Default::default(),
            base: 0,
            quota,
            gate: Gate::default(),
            limits,
        }
    }

    /// Starts the actor on this thread, reading `stream`.
    pub fn start_with(self, stream: actix_ws::MessageStream) -> Addr<WsSession> {
        let max = self.node.config.pubsub.max_frame_bytes;
        let stream = stream
            .max_frame_size(max)
            .aggregate_continuations()
            .max_continuation_size(max);
        let stream = Gated {
            inner: stream,
            gate: self.gate.clone(),
        };
        WsSession::create(move |ctx| {
            ctx.add_stream(stream);
            self
        })
    }

    fn ping_interval(&self) -> Duration {
        Duration::from_secs(self.node.config.pubsub.ping_interval_seconds.max(1))
    }

    fn read_timeout(&self) -> Duration {
        Duration::from_secs(self.node.config.pubsub.read_timeout_seconds.max(1))
    }

    /// Closes the read deadline check: re-armed for exactly the time left.
    fn arm_deadline(&self, ctx: &mut Context<Self>, after: Duration) {
        ctx.run_later(after, |act, ctx| {
            let idle = act.last_heard.elapsed();
            let limit = act.read_timeout();
            if idle >= limit {
                act.end(ctx, close::READ_TIMEOUT, "read timeout");
            } else {
                act.arm_deadline(ctx, limit - idle);
            }
        });
    }

    /// Why the socket's credential no longer holds (its token expired, its
    /// session was ended), if so.
    fn credential_ended(&self) -> Option<&'static str> {
        let id = self.identity.as_ref()?;
        id.ended(&self.node.revoked_sessions, crate::util::now())
    }

    /// Ends the socket (close code 4001) when its credential no longer holds:
    /// checked on every frame the client sends, every
    /// [`CREDENTIAL_CHECK`] and at the token's expiry.
    fn end_if_credential_ended(&mut self, ctx: &mut Context<Self>) -> bool {
        match self.credential_ended() {
            Some(why) => {
                self.end(ctx, close::CREDENTIAL_ENDED, why);
                true
            }
            None => false,
        }
    }

    /// Ends the connection with a close frame after what is queued.
    fn end(&mut self, ctx: &mut Context<Self>, code: u16, reason: &str) {
        self.conn.close_after_queue(code, reason);
        ctx.stop();
    }

    /// Takes a slot for the next client frame.
    fn take_slot(&mut self) -> u64 {
        self.slots.push_back(None);
        self.base + self.slots.len() as u64 - 1
    }

    /// Fills a slot and sends every answer that is now in order.
    fn fill(&mut self, seq: u64, frame: Bytes) {
        let Some(i) = seq.checked_sub(self.base) else {
            return;
        };
        if let Some(s) = self.slots.get_mut(i as usize) {
            *s = Some(frame);
        }
        while let Some(Some(_)) = self.slots.front() {
            if let Some(Some(f)) = self.slots.pop_front() {
                let done = self.base;
                self.base += 1;
                self.conn.push(f);
                let recovery = {
                    let mut r = self.recoveries.borrow_mut();
                    if r.is_empty() { None } else { r.remove(&done) }
                };
                if let Some(Recovery { topic, missed }) = recovery {
                    for frame in missed {
                        self.conn.push(frame);
                    }
                    // Past admission, like the cleanup: it must not be refused.
                    self.ns.stats.admit_always();
                    self.ns.addr.do_send(Release {
                        topic,
                        conn: self.conn.id,
                    });
                }
            }
        }
        if self.gate.is_closed() && self.slots.len() <= MAX_IN_FLIGHT / 2 {
            self.gate.open();
        }
    }

    /// Runs a frame's answer future; the slot keeps its place in the order.
    fn answer(&mut self, ctx: &mut Context<Self>, seq: u64, fut: LocalBoxFuture<'static, Bytes>) {
        let f = fut
            .into_actor(self)
            .map(move |frame, act, _| act.fill(seq, frame));
        ctx.spawn(f);
        if self.slots.len() > MAX_IN_FLIGHT {
            // Back-pressure: read no further frame until half are answered.
            self.gate.close();
        }
    }

    fn on_full_frame(&mut self, ctx: &mut Context<Self>, text: &[u8]) {
        let seq = self.take_slot();
        let (id, parsed) = protocol::parse_client_frame(text);
        let fut = match parsed {
            Err(e) => {
                self.fill(seq, error_frame(&id, &e));
                return;
            }
            Ok(frame) => self.full_request(id.clone(), frame, seq),
        };
        match fut {
            Ok(fut) => self.answer(ctx, seq, fut),
            Err(e) => self.fill(seq, error_frame(&id, &e)),
        }
    }

    /// Charges the namespace's rate-limit bucket (chain step 11's) for one
    /// publish or invoke frame: a socket is no way around the namespace's
    /// rate limit. Refused: `NAMESPACE_RATE_LIMITED`, nothing published.
    fn charge(&mut self) -> Result<(), FrameError> {
        let l = &mut self.limits;
        if l.since.elapsed() >= RECORD_RECHECK {
            l.since = crate::util::mono_now();
            if let Some(r) = self.node.records.cached(&l.key) {
                l.record = Some(r);
            }
        }
        crate::http::chain::limits::charge_namespace_now(
            &l.limiters,
            &self.node,
            &l.key,
            l.record.as_deref(),
        )
        .map_err(FrameError::from)
    }

    fn allows(&self, action: &str, topic: &str) -> Result<(), FrameError> {
        match &self.identity {
            Some(i) if i.allows("pubsub", action, topic) => Ok(()),
            _ => Err(FrameError::new(
                "MISSING_GRANT",
                format!("the credential lacks pubsub:{action}:{topic}"),
            )),
        }
    }

    /// On a non-member of the socket's namespace (a cluster node whose
    /// supervisor fires no trigger), what hands an accepted publication's
    /// pub/sub triggers to a member (`member_call.rs`): called once the
    /// supervisor accepted it, so a refused publish fires nothing.
    fn fire_elsewhere(&self, topic: &str, data: &Bytes) -> Option<impl FnOnce() + 'static> {
        if self.ns.is_member() {
            return None;
        }
        let (node, ns, topic, data) = (
            self.node.clone(),
            self.ns.name.clone(),
            topic.to_string(),
            data.clone(),
        );
        Some(move || super::member_call::fire_elsewhere(&node, &ns, topic, data))
    }

    /// Turns one `/v1/ws` frame into the future of its answer. Errors found
    /// before anything is sent are answered at once.
    fn full_request(
        &mut self,
        id: Value,
        frame: ClientFrame,
        seq: u64,
    ) -> Result<LocalBoxFuture<'static, Bytes>, FrameError> {
        let ok = move |id: Value, r: Result<(), FrameError>| match r {
            Ok(()) => ack(&id, None),
            Err(e) => error_frame(&id, &e),
        };
        match frame {
            ClientFrame::Ping => Ok(Box::pin(std::future::ready(ack(
                &id,
                Some(("pong", Value::Bool(true))),
            )))),
            ClientFrame::Subscribe {
                topic,
                presence,
                recover,
            } => {
                protocol::check_topic(&topic).map_err(ApiError::from)?;
                self.allows("subscribe", &topic)?;
                if let Some((m, meta)) = &presence {
                    protocol::check_member(m, meta.as_deref())?;
                }
                let Mode::Full { topics } = &mut self.mode else {
                    return Err(FrameError::new("BAD_FRAME", "not on this socket"));
                };
                if !topics.contains(&topic) && topics.len() >= MAX_TOPICS_PER_CONNECTION {
                    return Err(FrameError::new(
                        "TOO_MANY_TOPICS",
                        format!("at most {MAX_TOPICS_PER_CONNECTION} topics per connection"),
                    ));
                }
                if !topics.contains(&topic) {
                    self.quota.subscribe()?;
                }
                // Recorded now: if the socket ends before the answer, the
                // cleanup still covers it (unsubscribing twice is harmless).
                topics.insert(topic.clone());
                let sub = SubscriberRef {
                    relay: self.relay.id,
                    conn: self.conn.id,
                    kind: FrameKind::Full,
                };
                if recover.is_some() {
                    self.recoveries.borrow_mut().insert(
                        seq,
                        Recovery {
                            topic: topic.clone(),
                            missed: Vec::new(),
                        },
                    );
                }
                let reply = self.ns.ask_now(Subscribe {
                    topic,
                    sub,
                    presence,
                    recover,
                });
                let recoveries = self.recoveries.clone();
                Ok(Box::pin(async move {
                    match settle(reply.await) {
                        // The answer, then (queued right after it by `fill`)
                        // the missed publications.
                        Ok(mut s) => {
                            if let (Some(frames), Some(r)) =
                                (s.missed.take(), recoveries.borrow_mut().get_mut(&seq))
                            {
                                r.missed = frames;
                            }
                            ack_fields(&id, subscribed_fields(&s))
                        }
                        Err(e) => error_frame(&id, &FrameError::from(e)),
                    }
                }))
            }
            ClientFrame::Unsubscribe { topic } => {
                if let Mode::Full { topics } = &mut self.mode
                    && topics.remove(&topic)
                {
                    self.quota.unsubscribe();
                }
                let reply = self.ns.ask_now(Unsubscribe {
                    topic,
                    conn: self.conn.id,
                });
                Ok(Box::pin(async move { ok(id, flatten(reply.await)) }))
            }
            ClientFrame::Publish { topic, data } => {
                // The checks of `POST /v1/pubsub/publish`, in its order.
                protocol::check_topic(&topic).map_err(ApiError::from)?;
                self.allows("publish", &topic)?;
                protocol::check_payload(&data, self.node.config.pubsub.max_frame_bytes)
                    .map_err(ApiError::from)?;
                self.charge()?;
                let fire = self.fire_elsewhere(&topic, &data);
                let reply = self.ns.ask_now(Publish {
                    topic,
                    data,
                    depth: 0,
                });
                Ok(Box::pin(async move {
                    match settle(reply.await) {
                        Ok(pos) => {
                            if let Some(fire) = fire {
                                fire();
                            }
                            ack_fields(&id, position_fields(pos.as_ref()))
                        }
                        Err(e) => error_frame(&id, &FrameError::from(e)),
                    }
                }))
            }
            ClientFrame::Invoke { function, input } => {
                self.charge()?;
                let fut = super::ws_invoke::ws_invoke(
                    self.node.clone(),
                    self.ns.clone(),
                    self.identity.clone(),
                    function,
                    input,
                );
                Ok(Box::pin(async move {
                    match fut.await {
                        Ok(v) => ack(&id, Some(("result", v))),
                        Err(e) => error_frame(&id, &e),
                    }
                }))
            }
        }
    }

    /// A frame on the simple socket: published to the socket's topic.
    fn on_simple_frame(&mut self, ctx: &mut Context<Self>, data: Bytes) {
        let Mode::Simple {
            topic, can_publish, ..
        } = &self.mode
        else {
            return;
        };
        if !can_publish {
            let e = FrameError::new(
                "MISSING_GRANT",
                format!("the credential lacks pubsub:publish:{topic}"),
            );
            self.conn.push(error_frame(&Value::Null, &e));
            return;
        }
        let topic = topic.clone();
        if let Err(e) = self.charge() {
            self.conn.push(error_frame(&Value::Null, &e));
            return;
        }
        let fire = self.fire_elsewhere(&topic, &data);
        let reply = self.ns.ask_now(Publish {
            topic,
            data,
            depth: 0,
        });
        ctx.spawn(reply.into_actor(self).map(|r, act, _| match settle(r) {
            Ok(_) => {
                if let Some(fire) = fire {
                    fire();
                }
            }
            Err(e) => {
                act.conn
                    .push(error_frame(&Value::Null, &FrameError::from(e)));
            }
        }));
    }
}

/// A supervisor's answer, refused on the way ([`AskError`]) or by its
/// handler: one error either way. The socket's frames and the simple
/// socket's handshake (`routes/pubsub.rs`) both settle through it.
pub(crate) fn settle<T>(r: Result<NsResult<T>, AskError>) -> Result<T, ApiError> {
    r?.map_err(ApiError::from)
}

fn flatten(r: Result<NsResult<()>, AskError>) -> Result<(), FrameError> {
    settle(r).map_err(FrameError::from)
}

/// `offset` and `epoch` of a history topic's position; nothing otherwise.
pub(crate) fn position_fields(
    pos: Option<&crate::pubsub::Position>,
) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    if let Some(p) = pos {
        m.insert("offset".into(), Value::from(p.offset));
        m.insert("epoch".into(), Value::from(p.epoch.clone()));
    }
    m
}

/// A subscribe's answer fields: the position, and `recovered` when asked.
fn subscribed_fields(s: &crate::actors::Subscribed) -> serde_json::Map<String, Value> {
    let mut m = position_fields(s.position.as_ref());
    if let Some(r) = s.recovered {
        m.insert("recovered".into(), Value::Bool(r));
    }
    m
}

impl Actor for WsSession {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.node.metrics.ws_connections.inc();
        self.conn.attach(ctx.address().downgrade().recipient());
        let ping = self.ping_interval();
        ctx.run_interval(ping, |act, _| {
            act.conn.push(ws_frame(Opcode::Ping, b""));
        });
        let limit = self.read_timeout();
        self.arm_deadline(ctx, limit);
        if let Some(id) = self.identity.as_ref().filter(|i| i.may_end()) {
            ctx.run_interval(CREDENTIAL_CHECK, |act, ctx| {
                act.end_if_credential_ended(ctx);
            });
            if let Some(exp) = id.exp {
                let at = exp.saturating_add(crate::auth::JWT_LEEWAY + 1);
                let after = Duration::from_secs(at.saturating_sub(crate::util::now()));
                ctx.run_later(after, |act, ctx| {
                    act.end_if_credential_ended(ctx);
                });
            }
        }
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        self.node.metrics.ws_connections.dec();
        self.relay.forget(self.conn.id);
        // Whatever ended the socket, end the response too (no-op if closing).
        self.conn.close_after_queue(close::NORMAL, "");
        // The cleanup must not be refused by admission: it bypasses the bound.
        self.ns.stats.admit_always();
        self.ns.addr.do_send(UnsubscribeAll { conn: self.conn.id });
    }
}

impl Handler<Shutdown> for WsSession {
    type Result = ();
    fn handle(&mut self, _: Shutdown, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}

impl StreamHandler<Result<AggregatedMessage, ProtocolError>> for WsSession {
    fn handle(&mut self, item: Result<AggregatedMessage, ProtocolError>, ctx: &mut Context<Self>) {
        self.last_heard = crate::util::mono_now();
        let msg = match item {
            Ok(m) => m,
            Err(ProtocolError::Overflow) => {
                return self.end(ctx, close::TOO_BIG, "frame too large");
            }
            Err(ProtocolError::Io(e)) if e.to_string().contains("continuation size") => {
                return self.end(ctx, close::TOO_BIG, "message too large");
            }
            Err(e) => {
                tracing::debug!(error = %e, "WebSocket protocol error.");
                return self.end(ctx, close::PROTOCOL_ERROR, "protocol error");
            }
        };
        match msg {
            AggregatedMessage::Ping(p) => {
                self.conn.push(ws_frame(Opcode::Pong, &p));
            }
            AggregatedMessage::Pong(_) => {}
            AggregatedMessage::Close(reason) => {
                // Echo the client's code, except those that must never be sent.
                let code = reason
                    .map(|r| u16::from(r.code))
                    .filter(|c| (1000..5000).contains(c) && ![1005, 1006, 1015].contains(c))
                    .unwrap_or(close::NORMAL);
                self.end(ctx, code, "");
            }
            AggregatedMessage::Text(_) | AggregatedMessage::Binary(_)
                if self.end_if_credential_ended(ctx) => {}
            AggregatedMessage::Text(t) => match self.mode {
                Mode::Full { .. } => self.on_full_frame(ctx, t.as_bytes()),
                Mode::Simple { .. } => self.on_simple_frame(ctx, t.into_bytes()),
            },
            AggregatedMessage::Binary(b) => match self.mode {
                Mode::Full { .. } => self.on_full_frame(ctx, &b),
                Mode::Simple { .. } => self.on_simple_frame(ctx, b),
            },
        }
    }

    fn finished(&mut self, ctx: &mut Context<Self>) {
        // The client's half ended (TCP closed or reset): clean up.
        ctx.stop();
    }
}
