//! The pub/sub messages of a namespace's supervisor (docs/design.md §5): it owns the
//! namespace's [`TopicTable`](crate::pubsub::TopicTable) (`self.topics`) and is
//! the one place a publish is accepted, so one client's publishes are handled,
//! delivered and acknowledged in the order it sent them.

use super::namespace::{NamespaceSupervisor, NsError, NsResult};
use crate::pubsub::history::{Entry, ExportedTopic, rule_for};
use crate::pubsub::protocol::{message_frame, now_ms};
use crate::pubsub::{
    HistoryCaps, HistoryRule, Member, NsHistory, Origin, Position, PresenceEvent, SubscriberRef,
    TopicInfo,
};
use crate::storage::{OrderedKv, StoreError};
use actix::prelude::*;
use bytes::Bytes;

impl NamespaceSupervisor {
    /// Hands one message to the node's delivery path (local fan-out + mesh).
    fn deliver(&self, topic: &str, data: &Bytes) {
        let targets = self.topics.targets(topic);
        self.topics
            .service
            .deliver(&self.name, topic, data, targets, Origin::Local);
    }

    fn deliver_presence(&self, events: impl IntoIterator<Item = PresenceEvent>) {
        for ev in events {
            self.deliver(&ev.topic, &ev.data);
        }
    }

    /// What the pub/sub gauges count now: (subscriptions, topics).
    fn gauge_base(&self) -> (usize, usize) {
        (self.topics.subscriptions(), self.topics.topic_count())
    }

    /// Moves `meshgate_ws_subscribers` and `meshgate_pubsub_topics` by what a
    /// table change did since `before` (deltas: namespaces may share a capped label).
    fn pubsub_gauges(&self, before: (usize, usize)) {
        let (subs, topics) = self.gauge_base();
        let m = &self.topics.service.metrics;
        let label = m.ns_label(&self.name);
        let d = subs as i64 - before.0 as i64;
        if d != 0 {
            m.ws_subscribers.with_label_values(&[label.as_str()]).add(d);
        }
        let d = topics as i64 - before.1 as i64;
        if d != 0 {
            m.pubsub_topics.with_label_values(&[label.as_str()]).add(d);
        }
    }

    fn exists(&self) -> NsResult<()> {
        self.record.as_ref().map(|_| ()).ok_or(NsError::NotFound)
    }

    /// `[pubsub]`'s history caps, the byte cap lowered to the namespace's
    /// `history_bytes` quota when that is lower.
    fn history_caps(&self) -> HistoryCaps {
        let mut caps = HistoryCaps::from(&self.topics.service.config);
        let quota = self.limits().get(crate::quota::Resource::HistoryBytes);
        caps.max_bytes = caps.max_bytes.min(quota);
        caps
    }

    /// The history rule naming `topic`, if any (no rules: none, at once).
    fn history_rule(&self, topic: &str) -> Option<HistoryRule> {
        let rules = &self.record.as_ref()?.history;
        if rules.is_empty() {
            return None;
        }
        rule_for(rules, topic).cloned()
    }

    /// Accepts one publication: a topic without history takes today's path;
    /// one with history gets its offset first and every frame carries it.
    fn publish_one(&mut self, topic: &str, data: &Bytes) -> Option<Position> {
        let Some(rule) = self.history_rule(topic) else {
            self.deliver(topic, data);
            return None;
        };
        let caps = self.history_caps();
        let h = self.history.as_mut()?;
        let timestamp = now_ms();
        let pos = h.append(topic, &rule, data, timestamp, &caps);
        if !self.held.is_empty() {
            self.hold_live(topic, pos.offset, timestamp, data);
        }
        let targets = self.topics.targets(topic);
        self.topics.service.deliver_at(
            &self.name,
            topic,
            data,
            targets,
            Origin::Local,
            timestamp,
            Some(pos.offset),
        );
        Some(pos)
    }

    /// Loads the namespace's history from the store once (at the first
    /// start; a restart keeps it), before any other message is handled.
    pub(crate) fn load_history(&mut self, ctx: &mut Context<Self>) {
        if self.history.is_some() {
            return;
        }
        let store = self.store.clone();
        let prefix = crate::pubsub::history::prefix(&self.name);
        ctx.wait(
            async move { store.scan_all(&prefix).await }
                .into_actor(self)
                .map(|res, act, ctx| {
                    let rows = res.unwrap_or_else(|e| {
                        tracing::error!(namespace = %act.name, error = %e, "Pub/sub history could not be loaded; it starts over with new epochs.");
                        Vec::new()
                    });
                    act.history = Some(NsHistory::load(&act.name, rows));
                    act.flush_history(ctx);
                }),
        );
    }

    /// Writes every queued history change in one store batch, unless a
    /// batch is being written (then the next one takes them when it ends).
    /// The acks waiting for those changes are answered when it lands.
    fn flush_history(&mut self, ctx: &mut Context<Self>) {
        if self.history_writing {
            return;
        }
        let Some(h) = self.history.as_mut() else {
            return;
        };
        if !h.has_pending() {
            for w in self.history_waiters.drain(..) {
                let _ = w.send(true);
            }
            return;
        }
        let ops = h.take_pending();
        let waiters = std::mem::take(&mut self.history_waiters);
        self.history_writing = true;
        let store = self.store.clone();
        ctx.spawn(
            async move {
                // One batch; on etcd, one that fits a transaction at a time.
                if store.check_atomic(&ops).is_ok() {
                    return store.apply_batch(ops).await;
                }
                for chunk in ops.chunks(HISTORY_CHUNK) {
                    store.apply_batch(chunk.to_vec()).await?;
                }
                Ok(())
            }
                .into_actor(self)
                .map(move |res, act, ctx| {
                    act.history_writing = false;
                    if let Err(e) = &res {
                        tracing::error!(namespace = %act.name, error = %e, "A pub/sub history batch was not written.");
                    }
                    for w in waiters {
                        let _ = w.send(res.is_ok());
                    }
                    act.flush_history(ctx);
                }),
        );
    }

    /// An ack that resolves once the history changes queued so far are stored.
    fn history_stored(&mut self, ctx: &mut Context<Self>) -> tokio::sync::oneshot::Receiver<bool> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.history_waiters.push(tx);
        self.flush_history(ctx);
        rx
    }
}

/// Store writes per transaction when a history batch is too large for one
/// (etcd's limit on operations per transaction is 128 by default).
const HISTORY_CHUNK: usize = 64;

/// Waits for a history write; a failed one fails the publish (503, retryable).
async fn stored<T>(rx: tokio::sync::oneshot::Receiver<bool>, v: T) -> NsResult<T> {
    match rx.await {
        Ok(true) => Ok(v),
        _ => Err(NsError::Store(StoreError::Unavailable(
            "the pub/sub history could not be written".into(),
        ))),
    }
}

/// Sent by a `WsSession` to subscribe its connection to a topic (with an
/// optional presence member, and a position to recover from); replies once
/// the subscription is live, with the topic's position when it has history.
#[derive(Message)]
#[rtype(result = "NsResult<Subscribed>")]
pub struct Subscribe {
    /// Topic within the namespace the connection subscribes to.
    pub topic: String,
    /// The socket to deliver to: its relay, connection id and frame kind.
    pub sub: SubscriberRef,
    /// With presence: the client's `member_id` and `member_meta`; its join is published.
    pub presence: Option<(String, Option<String>)>,
    /// Recover from this position: the last `(offset, epoch)` the client saw.
    pub recover: Option<(u64, String)>,
}

/// What a subscribe answers beyond ok: the topic's position (history topics)
/// and, when asked to recover, whether it did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Subscribed {
    /// The topic's epoch and top offset; None when no history rule names it.
    pub position: Option<Position>,
    /// Asked to recover: whether every missed publication is in `missed`.
    pub recovered: Option<bool>,
    /// The missed publications, framed for the socket, back to back: the
    /// socket queues them right after the answer, then sends [`Release`].
    /// Meanwhile the subscription is held: live publications wait.
    pub missed: Option<Bytes>,
}

/// A recovering subscription whose socket has not yet queued its missed
/// publications: the live ones published meanwhile wait here, in offset order.
pub struct Held {
    /// The topic subscribed to.
    topic: String,
    /// The socket; subscribed for real on release.
    sub: SubscriberRef,
    /// Presence to join on release.
    presence: Option<(String, Option<String>)>,
    /// The top offset the recovery went up to: what is held comes after it.
    after: u64,
    /// The live publications held, framed for the socket.
    frames: bytes::BytesMut,
}

impl NamespaceSupervisor {
    /// A live publication for the held subscriptions of `topic`. One whose
    /// held frames outgrow the socket's queue is closed as a slow consumer.
    fn hold_live(&mut self, topic: &str, offset: u64, timestamp: u64, data: &Bytes) {
        let cap = self.topics.service.config.outbound_queue_bytes;
        let mut over = Vec::new();
        for h in self.held.iter_mut().filter(|h| h.topic == topic) {
            if offset <= h.after {
                continue;
            }
            h.frames.extend_from_slice(&message_frame(
                h.sub.kind,
                topic,
                data,
                timestamp,
                Some(offset),
            ));
            if h.frames.len() > cap {
                over.push(h.sub);
            }
        }
        for sub in over {
            self.held.retain(|h| h.sub.conn != sub.conn);
            let targets = vec![(sub.relay, std::sync::Arc::new(vec![(sub.conn, sub.kind)]))];
            self.topics
                .service
                .close_all(&targets, crate::pubsub::close::SLOW_CONSUMER);
        }
    }
}

/// Sent by a socket once a recovering subscribe's answer and missed
/// publications are in its queue: the held live publications follow them
/// through the socket's relay and the subscription becomes live. Past
/// admission; a topic not held (not recovered, unsubscribed) is a no-op. No reply.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Release {
    /// The topic the socket subscribed to.
    pub topic: String,
    /// The socket's connection id.
    pub conn: u64,
}

impl Handler<Release> for NamespaceSupervisor {
    type Result = ();
    fn handle(&mut self, msg: Release, ctx: &mut Context<Self>) {
        let _t = self.stats.begin();
        let _ = self.guarded(ctx, |act| {
            let Some(i) = act
                .held
                .iter()
                .position(|h| h.conn() == msg.conn && h.topic == msg.topic)
            else {
                return Ok(());
            };
            let h = act.held.swap_remove(i);
            if !h.frames.is_empty() {
                act.topics
                    .service
                    .send_to(h.sub.relay, h.sub.conn, h.sub.kind, h.frames.freeze());
            }
            let before = act.gauge_base();
            let joined = act.topics.subscribe(&h.topic, h.sub, h.presence);
            act.pubsub_gauges(before);
            act.deliver_presence(joined);
            Ok(())
        });
    }
}

impl Held {
    fn conn(&self) -> u64 {
        self.sub.conn
    }
}

impl Handler<Subscribe> for NamespaceSupervisor {
    type Result = NsResult<Subscribed>;
    fn handle(&mut self, msg: Subscribe, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let r = self.guarded(ctx, |act| {
            act.exists()?;
            // The missed publications go back with the answer; until the
            // socket has queued them, live ones are held (each publication
            // is one step of this mailbox: none is both, none is lost).
            let answer = act.recover_into(&msg.topic, msg.sub, msg.recover);
            if answer.missed.is_some() {
                act.held
                    .retain(|h| !(h.conn() == msg.sub.conn && h.topic == msg.topic));
                act.held.push(Held {
                    topic: msg.topic.clone(),
                    sub: msg.sub,
                    presence: msg.presence,
                    after: answer.position.as_ref().map_or(0, |p| p.offset),
                    frames: bytes::BytesMut::new(),
                });
                return Ok(answer);
            }
            let before = act.gauge_base();
            let joined = act.topics.subscribe(&msg.topic, msg.sub, msg.presence);
            act.pubsub_gauges(before);
            act.deliver_presence(joined);
            Ok(answer)
        });
        self.flush_history(ctx);
        r
    }
}

impl NamespaceSupervisor {
    /// The position of `topic` and, with `recover`, its missed publications
    /// sent to `sub` as one block of frames.
    fn recover_into(
        &mut self,
        topic: &str,
        sub: SubscriberRef,
        recover: Option<(u64, String)>,
    ) -> Subscribed {
        let rule = self.history_rule(topic);
        let caps = self.history_caps();
        let (Some(rule), Some(h)) = (rule, self.history.as_mut()) else {
            return Subscribed {
                position: None,
                recovered: recover.map(|_| false),
                missed: None,
            };
        };
        let Some((offset, epoch)) = recover else {
            return Subscribed {
                position: Some(h.position_or_create(topic)),
                recovered: None,
                missed: None,
            };
        };
        let oldest = now_ms().saturating_sub(rule.ttl_seconds * 1000);
        let r = h.recover(topic, offset, &epoch, oldest, caps.max_recovered);
        let missed =
            (r.recovered && !r.missed.is_empty()).then(|| frames_of(sub.kind, topic, &r.missed));
        Subscribed {
            position: Some(r.position),
            recovered: Some(r.recovered),
            missed,
        }
    }
}

/// The frames of `entries` for one socket, back to back in one buffer.
fn frames_of(kind: crate::pubsub::FrameKind, topic: &str, entries: &[Entry]) -> Bytes {
    let mut b = bytes::BytesMut::new();
    for e in entries {
        b.extend_from_slice(&message_frame(
            kind,
            topic,
            &e.data,
            e.timestamp,
            Some(e.offset),
        ));
    }
    b.freeze()
}

/// Sent by a `WsSession` (`unsubscribe` frame); replies once it is gone.
#[derive(Message)]
#[rtype(result = "NsResult<()>")]
pub struct Unsubscribe {
    /// The topic the connection leaves.
    pub topic: String,
    /// The leaving connection's node-wide id (`SubscriberRef::conn`).
    pub conn: u64,
}

impl Handler<Unsubscribe> for NamespaceSupervisor {
    type Result = NsResult<()>;
    fn handle(&mut self, msg: Unsubscribe, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        self.guarded(ctx, |act| {
            act.held
                .retain(|h| !(h.conn() == msg.conn && h.topic == msg.topic));
            let before = act.gauge_base();
            let left = act.topics.unsubscribe(&msg.topic, msg.conn);
            act.pubsub_gauges(before);
            act.deliver_presence(left);
            Ok(())
        })
    }
}

/// Sent by a `WsSession` as it stops, however its socket ended: removes every
/// subscription and presence of the connection (leave events are published).
/// Sent past admission (it must never be refused); no reply.
#[derive(Message)]
#[rtype(result = "()")]
pub struct UnsubscribeAll {
    /// Node-wide id of the ended connection whose subscriptions and presence all go.
    pub conn: u64,
}

impl Handler<UnsubscribeAll> for NamespaceSupervisor {
    type Result = ();
    fn handle(&mut self, msg: UnsubscribeAll, ctx: &mut Context<Self>) {
        let _t = self.stats.begin();
        let _ = self.guarded(ctx, |act| {
            if !act.held.is_empty() {
                act.held.retain(|h| h.conn() != msg.conn);
            }
            let before = act.gauge_base();
            let left = act.topics.unsubscribe_all(msg.conn);
            act.pubsub_gauges(before);
            act.deliver_presence(left);
            Ok(())
        });
    }
}

/// Sent by `POST /v1/pubsub/publish` and socket publishes; replies once the
/// message is accepted (handed to the delivery path; delivery is at most once).
/// The topic and the payload's size were checked by the sender
/// ([`check_topic`](crate::pubsub::check_topic),
/// [`check_payload`](crate::pubsub::check_payload)): not again here.
/// A topic a history rule names gets its position in the reply.
#[derive(Message)]
#[rtype(result = "NsResult<Option<Position>>")]
pub struct Publish {
    /// Topic within the namespace, already checked by the sender.
    pub topic: String,
    /// The payload, size-checked by the sender; shared, not copied, per subscriber.
    pub data: Bytes,
    /// Trigger depth of the publisher (0 for clients).
    pub depth: u8,
}

impl Handler<Publish> for NamespaceSupervisor {
    /// None for a topic without history (answered at once); a history
    /// topic's position, once the publication is stored.
    type Result = actix::Response<NsResult<Option<Position>>>;
    fn handle(&mut self, msg: Publish, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let pos = match self.guarded(ctx, |act| {
            act.exists()?;
            Ok(act.publish_one(&msg.topic, &msg.data))
        }) {
            Ok(p) => p,
            Err(e) => return actix::Response::reply(Err(e)),
        };
        self.count_publishes(1);
        self.fire_pubsub_triggers(&msg.topic, &msg.data, msg.depth);
        match pos {
            None => actix::Response::reply(Ok(None)),
            Some(p) => {
                let rx = self.history_stored(ctx);
                actix::Response::fut(stored(rx, Some(p)))
            }
        }
    }
}

/// Sent by `POST /v1/pubsub/publish-batch` (already validated, ≤ 100
/// messages); replies with the number accepted, all of them or none.
#[derive(Message)]
#[rtype(result = "NsResult<usize>")]
pub struct PublishBatch {
    /// (topic, payload) pairs in publish order, delivered all or none.
    pub messages: Vec<(String, Bytes)>,
}

impl Handler<PublishBatch> for NamespaceSupervisor {
    /// The number published; with history topics among them, once stored.
    type Result = actix::Response<NsResult<usize>>;
    fn handle(&mut self, msg: PublishBatch, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let kept = match self.guarded(ctx, |act| {
            act.exists()?;
            let mut kept = false;
            for (topic, data) in &msg.messages {
                kept |= act.publish_one(topic, data).is_some();
            }
            Ok(kept)
        }) {
            Ok(k) => k,
            Err(e) => return actix::Response::reply(Err(e)),
        };
        self.count_publishes(msg.messages.len() as u64);
        for (topic, data) in &msg.messages {
            self.fire_pubsub_triggers(topic, data, 0);
        }
        let n = msg.messages.len();
        if kept {
            let rx = self.history_stored(ctx);
            return actix::Response::fut(stored(rx, n));
        }
        actix::Response::reply(Ok(n))
    }
}

pub use crate::pubsub::MeshMessage;

impl NamespaceSupervisor {
    fn count_publishes(&self, n: u64) {
        let m = &self.topics.service.metrics;
        m.publishes
            .with_label_values(&[m.ns_label(&self.name).as_str()])
            .inc_by(n);
    }
}

/// Sent by `GET /v1/pubsub/history`: a page of a topic's kept publications
/// (checked by the sender); replies with the topic's position and the page.
#[derive(Message)]
#[rtype(result = "NsResult<HistoryPage>")]
pub struct ReadHistory {
    /// The topic read.
    pub topic: String,
    /// Publications after this offset (before it with `reverse`).
    pub since: Option<u64>,
    /// The epoch `since` belongs to; another one is refused (`BAD_OFFSET`).
    pub epoch: Option<String>,
    /// At most this many (checked against `max_recovered_publications`).
    pub limit: usize,
    /// Newest first.
    pub reverse: bool,
}

/// A page of history: the topic's position (None: no rule names it) and publications.
#[derive(Debug, Clone, Default)]
pub struct HistoryPage {
    /// The topic's epoch and top offset.
    pub position: Option<Position>,
    /// In offset order, or reversed.
    pub entries: Vec<Entry>,
}

impl Handler<ReadHistory> for NamespaceSupervisor {
    type Result = NsResult<HistoryPage>;
    fn handle(&mut self, msg: ReadHistory, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        self.guarded(ctx, |act| {
            act.exists()?;
            let rule = act.history_rule(&msg.topic);
            let (Some(rule), Some(h)) = (rule, act.history.as_ref()) else {
                return Ok(HistoryPage::default());
            };
            let Some(position) = h.position(&msg.topic) else {
                if msg.since.is_some_and(|s| s > 0) || msg.epoch.is_some() {
                    return Err(bad_offset("the topic has no publications yet"));
                }
                return Ok(HistoryPage::default());
            };
            if msg.epoch.as_ref().is_some_and(|e| *e != position.epoch) {
                return Err(bad_offset(format!(
                    "the topic's epoch is {}; offsets of another epoch mean nothing",
                    position.epoch
                )));
            }
            if msg.since.is_some_and(|s| s > position.offset) {
                return Err(bad_offset(format!(
                    "since_offset is beyond the topic's top offset {}",
                    position.offset
                )));
            }
            let oldest = now_ms().saturating_sub(rule.ttl_seconds * 1000);
            let entries = h.read(&msg.topic, msg.since, msg.limit, msg.reverse, oldest);
            Ok(HistoryPage {
                position: Some(position),
                entries,
            })
        })
    }
}

fn bad_offset(m: impl Into<String>) -> NsError {
    NsError::Refused(crate::error::ApiError::new(
        crate::error::Code::BadOffset,
        m.into(),
    ))
}

/// Sent by the node's history sweep (one task for every namespace, `node.rs`)
/// through admission: drops what is past its rule's age or size. No reply.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SweepHistory;

impl Handler<SweepHistory> for NamespaceSupervisor {
    type Result = ();
    fn handle(&mut self, _: SweepHistory, ctx: &mut Context<Self>) {
        let _t = self.stats.begin();
        let caps = self.history_caps();
        let _ = self.guarded(ctx, |act| {
            let rules = act
                .record
                .as_ref()
                .map(|r| r.history.clone())
                .unwrap_or_default();
            if let Some(h) = act.history.as_mut() {
                h.sweep(&rules, now_ms(), &caps);
            }
            Ok(())
        });
        self.flush_history(ctx);
    }
}

/// Sent by `PUT /v1/namespaces/{ns}/pubsub` (rules checked by the caller):
/// replaces the namespace's history rules in its record, written and
/// published; replies with the record.
#[derive(Message)]
#[rtype(result = "NsResult<crate::namespace::NamespaceRecord>")]
pub struct SetHistory {
    /// The new rules; the first whose glob matches a topic applies.
    pub rules: Vec<HistoryRule>,
}

impl Handler<SetHistory> for NamespaceSupervisor {
    type Result = ResponseActFuture<Self, NsResult<crate::namespace::NamespaceRecord>>;
    fn handle(&mut self, msg: SetHistory, _: &mut Context<Self>) -> Self::Result {
        self.change_record(move |rec| rec.history = msg.rules)
    }
}

/// Sent by `GET /v1/namespaces/{ns}/quotas` and the export: the history's
/// payload bytes (the `history_bytes` quota's use on this node), its byte
/// cap, and, with `streams`, every topic's stream as an export carries it.
#[derive(Message)]
#[rtype(result = "NsResult<HistoryState>")]
pub struct HistoryOf {
    /// Whether to copy out every stream (the export) or only count.
    pub streams: bool,
}

/// What [`HistoryOf`] answers.
#[derive(Debug, Default)]
pub struct HistoryState {
    /// Payload bytes kept.
    pub bytes: u64,
    /// The most it may keep (the quota or the node's cap, the lower).
    pub max_bytes: u64,
    /// The streams, with `streams`; empty otherwise.
    pub streams: Vec<ExportedTopic>,
}

impl Handler<HistoryOf> for NamespaceSupervisor {
    type Result = NsResult<HistoryState>;
    fn handle(&mut self, msg: HistoryOf, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        let max_bytes = self.history_caps().max_bytes;
        self.guarded(ctx, |act| {
            act.exists()?;
            let Some(h) = act.history.as_ref() else {
                return Ok(HistoryState {
                    max_bytes,
                    ..Default::default()
                });
            };
            Ok(HistoryState {
                bytes: h.bytes(),
                max_bytes,
                streams: if msg.streams { h.export() } else { Vec::new() },
            })
        })
    }
}

/// Sent by an import that carries `history` (checked by the caller against
/// [`HistoryOf`]'s `max_bytes`): the history becomes exactly the imported
/// streams; the old one's keys are deleted in the same write-behind queue,
/// after any write in flight. Replies with a receiver that resolves once
/// the new history is stored (true) or its write failed (false).
#[derive(Message)]
#[rtype(result = "NsResult<tokio::sync::oneshot::Receiver<bool>>")]
pub struct ReplaceHistory {
    /// The imported streams.
    pub topics: Vec<crate::pubsub::history::CheckedTopic>,
}

impl Handler<ReplaceHistory> for NamespaceSupervisor {
    type Result = NsResult<tokio::sync::oneshot::Receiver<bool>>;
    fn handle(&mut self, msg: ReplaceHistory, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        self.guarded(ctx, |act| {
            act.exists()?;
            act.history
                .get_or_insert_with(|| NsHistory::load(&act.name, Vec::new()))
                .replace(msg.topics);
            Ok(())
        })?;
        Ok(self.history_stored(ctx))
    }
}

/// Sent by `GET /v1/pubsub/presence`; replies with the topic's members.
#[derive(Message)]
#[rtype(result = "NsResult<Vec<Member>>")]
pub struct Presence {
    /// The topic whose presence members are listed.
    pub topic: String,
}

impl Handler<Presence> for NamespaceSupervisor {
    type Result = NsResult<Vec<Member>>;
    fn handle(&mut self, msg: Presence, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        self.guarded(ctx, |act| {
            act.exists()?;
            Ok(act.topics.presence(&msg.topic))
        })
    }
}

/// Sent by `GET /v1/pubsub/topics`; replies with the live topics.
#[derive(Message)]
#[rtype(result = "NsResult<Vec<TopicInfo>>")]
pub struct Topics;

impl Handler<Topics> for NamespaceSupervisor {
    type Result = NsResult<Vec<TopicInfo>>;
    fn handle(&mut self, _: Topics, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        self.guarded(ctx, |act| {
            act.exists()?;
            Ok(act.topics.list())
        })
    }
}
