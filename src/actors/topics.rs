//! The pub/sub messages of a namespace's supervisor (docs/design.md §5): it owns the
//! namespace's [`TopicTable`](crate::pubsub::TopicTable) (`self.topics`) and is
//! the one place a publish is accepted, so one client's publishes are handled,
//! delivered and acknowledged in the order it sent them.

use super::namespace::{NamespaceSupervisor, NsError, NsResult};
use crate::pubsub::history::{
    Entry, ExportedTopic, Meta, ReplicaStep, Sequenced, Staged, plan_sequence, rule_for,
    sequence_keys,
};
use crate::pubsub::protocol::{message_frame, now_ms};
use crate::pubsub::{
    HistoryCaps, HistoryRule, Member, NsHistory, Origin, Position, PresenceEvent, SubscriberRef,
    TopicInfo,
};
use crate::storage::{BatchOp, OrderedKv, StoreError};
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
        let limits = self.limits();
        caps.max_bytes = caps
            .max_bytes
            .min(limits.get(crate::quota::Resource::HistoryBytes));
        caps.max_topics = limits.get(crate::quota::Resource::HistoryTopics);
        caps
    }

    /// Admits the history topics (a rule names each) among `topics` whose
    /// stream this node does not keep yet under the namespace's `history_topics` quota,
    /// forgetting the longest-idle streams that hold no publication and
    /// are not in use to make room; 429 `QUOTA_EXCEEDED` (nothing changed)
    /// when they do not fit. `staged`: they are being published (counted
    /// in `history_new` until sequenced); else a subscribe gives them a
    /// stream at once.
    fn admit_history_topics<'a>(
        &mut self,
        topics: impl IntoIterator<Item = &'a str>,
        staged: bool,
    ) -> NsResult<()> {
        let Some(h) = self.history.as_ref() else {
            return Ok(());
        };
        let topics: Vec<&str> = topics.into_iter().collect();
        let mut new: Vec<&str> = Vec::new();
        for &t in &topics {
            if !h.has_topic(t) && !self.history_new.contains(t) && !new.contains(&t) {
                new.push(t);
            }
        }
        if new.is_empty() {
            return Ok(());
        }
        let max = self.limits().get(crate::quota::Resource::HistoryTopics);
        let reserved = self.history_new.len() as u64;
        let want = reserved + new.len() as u64;
        let Some(history) = self.history.as_mut() else {
            return Ok(());
        };
        // Room is made from streams nothing is on its way to: not those
        // these publications (a batch's other topics) go to either. (The
        // set is built only when room must be made.)
        let fits = history.topic_count().saturating_add(want) <= max || {
            let mut busy = history_busy(&self.history_staged, &self.history_in_flight);
            busy.extend(topics.iter().copied());
            history.make_room(want, max, history_in_use(&self.topics, &self.held, &busy))
        };
        let used = history.topic_count() + reserved;
        if !fits {
            return Err(NsError::Refused(crate::quota::exceeded(
                crate::quota::Resource::HistoryTopics,
                used,
                new.len() as u64,
                max,
            )));
        }
        if staged {
            self.history_new.extend(new.into_iter().map(str::to_string));
        }
        Ok(())
    }

    /// The history rule naming `topic`, if any (no rules: none, at once).
    fn history_rule(&self, topic: &str) -> Option<HistoryRule> {
        let rules = &self.record.as_ref()?.history;
        if rules.is_empty() {
            return None;
        }
        rule_for(rules, topic).cloned()
    }

    /// Accepts one publication: a topic without history takes today's path
    /// (delivered now, None); one with history is staged for the next
    /// sequencing transaction, which gives its offset in the store, and is
    /// delivered once that is written. The receiver then gets its position
    /// (None: the write failed, nothing was delivered).
    /// `rule`: the history rule naming `topic` ([`history_rule`](Self::history_rule)).
    fn publish_one(&mut self, topic: &str, data: &Bytes, rule: Option<HistoryRule>) -> Option<Ack> {
        let Some(rule) = rule else {
            self.deliver(topic, data);
            return None;
        };
        if self.history.is_none() {
            self.deliver(topic, data);
            return None;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.history_staged.push((
            Staged {
                topic: topic.to_string(),
                data: data.clone(),
                timestamp: now_ms(),
                size: rule.size,
            },
            tx,
        ));
        Some(rx)
    }

    /// Delivers a publication whose position the store gave: to held
    /// recoveries, the local subscribers and (`Origin::Local`: this node
    /// sequenced it) the mesh, with the offset in every frame.
    fn deliver_sequenced(
        &mut self,
        topic: &str,
        pos: &Position,
        timestamp: u64,
        data: &Bytes,
        origin: Origin,
    ) {
        if !self.held.is_empty() {
            self.hold_live(topic, pos.offset, timestamp, data);
        }
        let targets = self.topics.targets(topic);
        self.topics.service.deliver_at(
            &self.name,
            topic,
            data,
            targets,
            origin,
            timestamp,
            Some((pos.offset, pos.epoch.as_str())),
        );
    }

    /// Closes this node's sockets subscribed to `topic` (held recoveries
    /// included) with `INSUFFICIENT_STATE`: what they hold of the topic can
    /// not be continued here (another epoch, or a gap the store no longer
    /// fills). They reconnect and recover, and are told the truth.
    fn break_topic(&mut self, topic: &str) {
        if let Some((targets, _)) = self.topics.targets(topic) {
            let targets = targets.clone();
            self.topics
                .service
                .close_all(&targets, crate::pubsub::close::INSUFFICIENT_STATE);
        }
        let held: Vec<SubscriberRef> = self
            .held
            .iter()
            .filter(|h| h.topic == topic)
            .map(|h| h.sub)
            .collect();
        self.held.retain(|h| h.topic != topic);
        for sub in held {
            let targets = vec![(sub.relay, std::sync::Arc::new(vec![(sub.conn, sub.kind)]))];
            self.topics
                .service
                .close_all(&targets, crate::pubsub::close::INSUFFICIENT_STATE);
        }
        self.topics.service.metrics.history_broken.inc();
    }

    /// After a sequencing transaction: each topic whose copy here was what
    /// the store held before it keeps and delivers this node's publications
    /// at once; any other (another node sequenced in between, or the store
    /// started a new epoch) is read again from the store first.
    fn sequenced(&mut self, ctx: &mut Context<Self>, batch: Vec<(Staged, AckTx)>, s: Sequenced) {
        let caps = self.history_caps();
        let mut replies = Vec::with_capacity(batch.len());
        let mut behind: Vec<(String, Vec<(Position, u64, Bytes)>)> = Vec::new();
        let mut ours: Vec<(Staged, Position)> = Vec::with_capacity(batch.len());
        for ((st, tx), pos) in batch.into_iter().zip(s.positions) {
            replies.push((tx, pos.clone()));
            ours.push((st, pos));
        }
        for step in &s.topics {
            let Some(h) = self.history.as_ref() else {
                break;
            };
            let held = h.meta(&step.topic);
            let fresh = Meta {
                epoch: step.fresh.clone(),
                top: 0,
            };
            let in_step = held == step.before
                || (step.before.is_none() && (held.is_none() || held.as_ref() == Some(&fresh)));
            let mine: Vec<(Position, u64, Bytes)> = ours
                .iter()
                .filter(|(st, _)| st.topic == step.topic)
                .map(|(st, p)| (p.clone(), st.timestamp, st.data.clone()))
                .collect();
            if !in_step {
                behind.push((step.topic.clone(), mine));
                continue;
            }
            let rule = self.history_rule(&step.topic);
            if held.is_none() || step.before.is_none() {
                // The meta the store holds now (a touched topic's, created).
                if let Some(h) = self.history.as_mut() {
                    h.adopt(&step.topic, Some((step.after.clone(), Vec::new())));
                    if mine.is_empty() {
                        continue;
                    }
                }
            }
            for (pos, ts, data) in mine {
                if let (Some(rule), Some(h)) = (&rule, self.history.as_mut()) {
                    h.append_at(&step.topic, &pos.epoch, pos.offset, ts, &data, rule, &caps);
                }
                self.deliver_sequenced(&step.topic, &pos, ts, &data, Origin::Local);
            }
        }
        for (tx, pos) in replies {
            let _ = tx.send(Some(pos));
        }
        for (topic, mine) in behind {
            self.catch_up(ctx, topic, mine);
        }
    }

    /// Reads `topic` from the store and makes this node's copy that,
    /// delivering what is new to the local subscribers (and this node's own
    /// publications among them, `mine`, to the mesh too), or closing them
    /// when they cannot continue. Holds the mailbox meanwhile, so every
    /// later publication of the topic is judged against the store's copy.
    fn catch_up(
        &mut self,
        ctx: &mut Context<Self>,
        topic: String,
        mine: Vec<(Position, u64, Bytes)>,
    ) {
        self.catch_up_then(ctx, topic, mine, None);
    }

    /// [`catch_up`](Self::catch_up), then `then` (before any later message).
    fn catch_up_then(
        &mut self,
        ctx: &mut Context<Self>,
        topic: String,
        mine: Vec<(Position, u64, Bytes)>,
        then: Option<AfterCatchUp>,
    ) {
        let store = self.store.clone();
        let (prefix, meta_key) = crate::pubsub::history::topic_keys(&self.name, &topic);
        self.topics.service.metrics.history_catch_ups.inc();
        let held = self.history.as_ref().and_then(|h| h.meta(&topic));
        let (ns, t) = (self.name.clone(), topic.clone());
        ctx.wait(
            async move {
                let raw = store.get(&meta_key).await?;
                let meta = raw
                    .as_deref()
                    .and_then(|v| serde_json::from_slice::<Meta>(v).ok());
                // A short gap in the same epoch: its rows one by one.
                if let (Some(m), Some(h)) = (&meta, &held)
                    && m.epoch == h.epoch
                    && m.top >= h.top
                    && m.top - h.top <= TAIL_READ
                {
                    let offsets: Vec<u64> = (h.top + 1..=m.top).collect();
                    let reads = futures_util::future::join_all(offsets.iter().map(|o| {
                        let k = crate::pubsub::history::row_key(&ns, &t, *o);
                        let store = store.clone();
                        async move { store.get(&k).await }
                    }))
                    .await;
                    let mut tail = Vec::with_capacity(offsets.len());
                    for (o, r) in offsets.iter().zip(reads) {
                        match r?.and_then(|v| crate::pubsub::history::decode_row(*o, &v)) {
                            Some(e) => tail.push(e),
                            None => break,
                        }
                    }
                    if tail.len() == offsets.len() {
                        return Ok::<_, StoreError>(Stored::Tail(m.clone(), tail));
                    }
                }
                let rows = store.scan_all(&prefix).await?;
                Ok(Stored::Whole(raw, rows))
            }
            .into_actor(self)
            .map(move |res, act, ctx| {
                act.adopt_caught_up(topic, mine, res);
                if let Some(then) = then {
                    then(act, ctx);
                }
            }),
        );
    }

    /// What a catch-up read found, made this node's copy of `topic` (see
    /// [`catch_up`](Self::catch_up)).
    fn adopt_caught_up(
        &mut self,
        topic: String,
        mine: Vec<(Position, u64, Bytes)>,
        res: Result<Stored, StoreError>,
    ) {
        let rule = self.history_rule(&topic);
        let caps = self.history_caps();
        let Some(h) = self.history.as_mut() else {
            return;
        };
        let adopted = match res {
            Ok(Stored::Tail(m, mut tail)) => match &rule {
                Some(rule) => {
                    // Judged against the copy as it is now.
                    let top = h.meta(&topic).filter(|c| c.epoch == m.epoch).map(|c| c.top);
                    if let Some(top) = top {
                        if tail.iter().any(|e| e.offset <= top) {
                            tracing::debug!(namespace = %self.name, topic = %topic, top, "A catch-up read publications this node already holds.");
                        }
                        tail.retain(|e| e.offset > top);
                    }
                    h.extend(&topic, &m.epoch, tail, rule, &caps)
                }
                None => crate::pubsub::history::Adopted {
                    new: tail,
                    broken: false,
                },
            },
            Ok(Stored::Whole(meta, rows)) => h.adopt(
                &topic,
                NsHistory::stored_topic(&self.name, &topic, meta, rows),
            ),
            Err(e) => {
                tracing::warn!(namespace = %self.name, topic = %topic, error = %e, "A pub/sub history topic could not be read again; its subscribers here are closed to recover.");
                h.adopt(&topic, None);
                crate::pubsub::history::Adopted {
                    new: Vec::new(),
                    broken: true,
                }
            }
        };
        if adopted.broken {
            self.break_topic(&topic);
        }
        let mut sent = std::collections::HashSet::new();
        for e in &adopted.new {
            let pos = Position {
                offset: e.offset,
                epoch: self
                    .history
                    .as_ref()
                    .and_then(|h| h.meta(&topic))
                    .map(|m| m.epoch)
                    .unwrap_or_default(),
            };
            let origin = match mine.iter().find(|(p, _, _)| p.offset == e.offset) {
                Some(_) => {
                    sent.insert(e.offset);
                    Origin::Local
                }
                None => Origin::Mesh,
            };
            self.deliver_sequenced(&topic, &pos, e.timestamp, &e.data, origin);
        }
        // This node's own that were not delivered here still go to
        // the other nodes: it sequenced them.
        for (pos, ts, data) in mine.iter().filter(|(p, _, _)| !sent.contains(&p.offset)) {
            self.topics.service.deliver_at(
                &self.name,
                &topic,
                data,
                None,
                Origin::Local,
                *ts,
                Some((pos.offset, pos.epoch.as_str())),
            );
        }
    }

    /// Loads the namespace's history from the store once, then runs `then`;
    /// at once when it is in memory already (a restart keeps it). Not on
    /// wake: a woken namespace loads its history when a subscriber, a
    /// reader, a history publication, a replica, the quotas or an export
    /// first needs it ([`after_history`](Self::after_history)), so waking
    /// a sleeping namespace for a KV read, an invoke or a 404 costs no
    /// history bytes. Holds the mailbox meanwhile: `then` runs before any
    /// later message is handled, so order is kept.
    pub(crate) fn load_history_then(
        &mut self,
        ctx: &mut Context<Self>,
        then: impl FnOnce(&mut Self, &mut Context<Self>) + 'static,
    ) {
        if self.history.is_some() {
            then(self, ctx);
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
                    if act.history.is_none() {
                        act.history = Some(NsHistory::load(&act.name, rows));
                    }
                    act.flush_history(ctx);
                    then(act, ctx);
                }),
        );
    }

    /// Whether `topic`'s handling needs the history and it is not in memory yet.
    fn history_unloaded_for(&self, topic: &str) -> bool {
        self.history.is_none() && self.history_rule(topic).is_some()
    }

    /// Handles `msg` once the history is in memory ([`load_history_then`](Self::load_history_then)),
    /// before any later message; the reply is the handler's.
    fn after_history<M, T>(
        &mut self,
        ctx: &mut Context<Self>,
        msg: M,
    ) -> actix::Response<NsResult<T>>
    where
        M: actix::Message<Result = NsResult<T>> + 'static,
        T: 'static,
        Self: Handler<M>,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.load_history_then(ctx, move |act, ctx| {
            let answer = <Self as Handler<M>>::handle(act, msg, ctx);
            actix::dev::MessageResponse::<Self, M>::handle(answer, ctx, Some(tx));
        });
        actix::Response::fut(async move { rx.await.unwrap_or(Err(NsError::Panicked)) })
    }

    /// Writes what waits, unless a write is in flight (the next one takes
    /// it when that ends): the staged publications (as many as fit one
    /// store transaction) and touched topics in one **sequencing
    /// transaction** ([`plan_sequence`]: offsets from the metas the store
    /// holds, guarded so no two writers give one offset), then the queued
    /// trims in one batch. The publications are delivered once it is
    /// written; the acks waiting on the trims are answered when they land.
    pub(crate) fn flush_history(&mut self, ctx: &mut Context<Self>) {
        self.arm_history_sweep(ctx);
        if self.history_writing {
            return;
        }
        let Some(h) = self.history.as_mut() else {
            return;
        };
        let touched = h.take_touched();
        let mut pending = h.take_pending();
        let mut forgotten = h.take_forgotten();
        let (max_ops, max_bytes) = if self.store.as_sled().is_some() {
            (usize::MAX, usize::MAX)
        } else {
            (SEQUENCE_OPS, SEQUENCE_BYTES)
        };
        let (mut ops, mut bytes, mut n) = (touched.len(), 0usize, 0usize);
        for (st, _) in &self.history_staged {
            if n > 0 && (ops + 3 > max_ops || bytes + st.data.len() + 128 > max_bytes) {
                break;
            }
            ops += 3;
            bytes += st.data.len() + 128;
            n += 1;
        }
        let batch: Vec<(Staged, AckTx)> = self.history_staged.drain(..n).collect();
        let waiters = std::mem::take(&mut self.history_waiters);
        if batch.is_empty() && touched.is_empty() && pending.is_empty() && forgotten.is_empty() {
            for w in waiters {
                let _ = w.send(true);
            }
            return;
        }
        let staged: Vec<Staged> = batch.iter().map(|(s, _)| s.clone()).collect();
        let (keys, topics) = sequence_keys(&self.name, &staged, &touched);
        if self.store.as_sled().is_some() {
            // The one writer of this store: a forgotten meta this write does
            // not sequence is deleted with the trims (one flush for all);
            // one it sequences keeps its guard.
            let (guarded, plain): (Vec<_>, Vec<_>) =
                forgotten.into_iter().partition(|(k, _)| keys.contains(k));
            forgotten = guarded;
            pending.extend(plain.into_iter().map(|(k, _)| BatchOp::Delete(k)));
        }
        // A topic given an epoch here but not yet stored keeps it; any
        // other topic new to the store starts a fresh one.
        let fresh: Vec<String> = topics
            .iter()
            .map(|t| match h.meta(t) {
                Some(m) if m.top == 0 => m.epoch,
                _ => crate::pubsub::history::new_epoch(),
            })
            .collect();
        self.history_writing = true;
        self.history_in_flight = topics.clone();
        let store = self.store.clone();
        let ns = self.name.clone();
        ctx.spawn(
            async move {
                let seq = if keys.is_empty() {
                    None
                } else if store.as_sled().is_some() {
                    // One node, and this supervisor the one writer of its
                    // namespace's history: the metas read, then one batch
                    // (a sled transaction over a large batch costs far more).
                    let mut vals = Vec::with_capacity(keys.len());
                    let mut read = Ok(());
                    for k in &keys {
                        match store.get(k).await {
                            Ok(v) => vals.push(v),
                            Err(e) => {
                                read = Err(e);
                                break;
                            }
                        }
                    }
                    Some(match read {
                        Ok(()) => {
                            let (ops, s) = plan_sequence(&ns, &topics, &vals, &fresh, &staged);
                            store.apply_batch(ops).await.map(|_| s)
                        }
                        Err(e) => Err(e),
                    })
                } else {
                    let r = store
                        .transact(&keys, None, |vals| {
                            Ok::<_, std::convert::Infallible>(plan_sequence(
                                &ns, &topics, vals, &fresh, &staged,
                            ))
                        })
                        .await;
                    Some(match r {
                        Ok(Some(Ok(s))) => Ok(s),
                        Ok(_) => Err(import_in_progress()),
                        Err(e) => Err(e),
                    })
                };
                // Trims: deletions any node may make (idempotent), in one
                // batch; on etcd one that fits a transaction at a time.
                let trims = async {
                    if pending.is_empty() {
                        return Ok(());
                    }
                    if store.check_atomic(&pending).is_ok() {
                        return store.apply_batch(pending).await;
                    }
                    for chunk in pending.chunks(HISTORY_CHUNK) {
                        store.apply_batch(chunk.to_vec()).await?;
                    }
                    Ok(())
                }
                .await;
                // Forgotten streams: each meta deleted only if the store
                // still holds it as this node knew it (a publication
                // sequenced since, here or elsewhere, keeps it).
                for (key, known) in forgotten {
                    if let Err(e) = store.compare_and_swap(&key, Some(&known), None, None).await {
                        tracing::warn!(namespace = %ns, error = %e, "A forgotten pub/sub history topic's meta was not deleted; the next sweep of a node that holds it tries again.");
                    }
                }
                (seq, trims)
            }
            .into_actor(self)
            .map(move |(seq, trims), act, ctx| {
                act.history_writing = false;
                act.history_in_flight.clear();
                for (st, _) in &batch {
                    act.history_new.remove(&st.topic);
                }
                if let Err(e) = &trims {
                    tracing::error!(namespace = %act.name, error = %e, "A pub/sub history batch was not written.");
                }
                for w in waiters {
                    let _ = w.send(trims.is_ok());
                }
                match seq {
                    Some(Ok(s)) => act.sequenced(ctx, batch, s),
                    Some(Err(e)) => {
                        tracing::error!(namespace = %act.name, error = %e, "Pub/sub history publications were not written; their publishers are answered 503.");
                        for (_, tx) in batch {
                            let _ = tx.send(None);
                        }
                    }
                    None => {}
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

/// A sequencing transaction the store refused: its guard (the namespace's
/// import journal) was taken.
fn import_in_progress() -> StoreError {
    StoreError::Unavailable("an import is in progress".into())
}

/// Store writes per transaction when a history batch is too large for one
/// (etcd's limit on operations per transaction is 128 by default).
const HISTORY_CHUNK: usize = 64;

/// Most operations of one sequencing transaction on etcd (a publication is
/// at most three: its row, the row it trims, its topic's meta), under
/// etcd's 128 per transaction.
const SEQUENCE_OPS: usize = 96;
/// Most payload bytes of one sequencing transaction on etcd, under its
/// request limit (1.5 MiB by default).
const SEQUENCE_BYTES: usize = 1 << 20;

/// Most missing publications a catch-up reads one by one (in one round of
/// concurrent reads) instead of scanning the topic's rows.
const TAIL_READ: u64 = 64;

/// What a catch-up read of a topic found.
enum Stored {
    /// The topic's meta and the rows right after this node's top, all there.
    Tail(Meta, Vec<Entry>),
    /// The topic's meta as stored (raw) and every row of it.
    Whole(Option<Vec<u8>>, Vec<(Vec<u8>, Vec<u8>)>),
}

/// The position of a staged publication once it is stored (None: it was not).
type AckTx = tokio::sync::oneshot::Sender<Option<Position>>;
/// The receiving end of [`AckTx`].
type Ack = tokio::sync::oneshot::Receiver<Option<Position>>;

/// Waits for the positions of staged publications: all stored, or 503.
async fn positions(acks: Vec<Ack>) -> NsResult<Vec<Position>> {
    let mut out = Vec::with_capacity(acks.len());
    for a in acks {
        match a.await {
            Ok(Some(p)) => out.push(p),
            _ => {
                return Err(NsError::Store(StoreError::Unavailable(
                    "the pub/sub history could not be written".into(),
                )));
            }
        }
    }
    Ok(out)
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
    /// The missed publications, one frame each for the socket (shared with
    /// every other socket recovering them now, [`RecoveredFrames`]): the
    /// socket queues them right after the answer, then sends [`Release`].
    /// Meanwhile the subscription is held: live publications wait.
    pub missed: Option<Vec<Bytes>>,
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
    /// At once, but for a history topic this node does not know yet on a
    /// shared store: its stored epoch is read (or created) first.
    type Result = actix::Response<NsResult<Subscribed>>;
    fn handle(&mut self, msg: Subscribe, ctx: &mut Context<Self>) -> Self::Result {
        if self.history_unloaded_for(&msg.topic) {
            return self.after_history(ctx, msg);
        }
        let _t = self.stats.begin();
        // A history topic (`unknown_shared_topic` asks for its rule).
        if self.unknown_shared_topic(&msg.topic) {
            if let Err(e) = self.admit_history_topics([msg.topic.as_str()], false) {
                return actix::Response::reply(Err(e));
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            self.learn_topic(ctx, msg.topic.clone(), move |act, ctx| {
                let _ = tx.send(act.subscribe_now(msg, ctx));
            });
            return actix::Response::fut(async move { rx.await.unwrap_or(Err(NsError::Panicked)) });
        }
        // Behind the client: read the store first, then recover from that.
        if self.copy_behind(&msg) {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let topic = msg.topic.clone();
            self.catch_up_then(
                ctx,
                topic,
                Vec::new(),
                Some(Box::new(move |act, ctx| {
                    let _ = tx.send(act.subscribe_now(msg, ctx));
                })),
            );
            return actix::Response::fut(async move { rx.await.unwrap_or(Err(NsError::Panicked)) });
        }
        actix::Response::reply(self.subscribe_now(msg, ctx))
    }
}

/// What runs once a catch-up has made this node's copy of a topic.
type AfterCatchUp = Box<dyn FnOnce(&mut NamespaceSupervisor, &mut Context<NamespaceSupervisor>)>;

impl NamespaceSupervisor {
    /// A recovering subscribe whose position (`offset` of the copy's own
    /// epoch) is beyond this node's copy of a history topic on a shared
    /// store: the copy is behind what another node delivered (the mesh has
    /// not brought the last publications yet, or that node died before
    /// sending them), while the store has them. Recovering from the copy
    /// would answer `recovered: false` and then deliver offsets the client
    /// already has.
    fn copy_behind(&self, msg: &Subscribe) -> bool {
        let Some((offset, epoch)) = &msg.recover else {
            return false;
        };
        self.store.as_sled().is_none()
            && self.history_rule(&msg.topic).is_some()
            && self
                .history
                .as_ref()
                .and_then(|h| h.meta(&msg.topic))
                .is_some_and(|m| m.epoch == *epoch && *offset > m.top)
    }

    fn subscribe_now(&mut self, msg: Subscribe, ctx: &mut Context<Self>) -> NsResult<Subscribed> {
        let r = self.guarded(ctx, |act| {
            act.exists()?;
            // A subscribe (recovering or not) gives a history topic new
            // here its stream at once: it counts.
            if act.history_rule(&msg.topic).is_some() {
                act.admit_history_topics([msg.topic.as_str()], false)?;
            }
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

    /// A history topic this node holds no copy of, on a store the nodes
    /// share: a subscriber must be told the topic's stored epoch, not one
    /// made here that another node may have beaten.
    fn unknown_shared_topic(&self, topic: &str) -> bool {
        self.store.as_sled().is_none()
            && self.record.is_some()
            && self
                .history
                .as_ref()
                .is_some_and(|h| h.meta(topic).is_none())
            && self.history_rule(topic).is_some()
    }

    /// Reads `topic` from the store, creating its meta (a fresh epoch,
    /// offset 0) when there is none, guarded like a sequencing transaction,
    /// and makes this node's copy that; then runs `then`. Holds the mailbox
    /// meanwhile, so what comes after is handled with the copy in place.
    fn learn_topic(
        &mut self,
        ctx: &mut Context<Self>,
        topic: String,
        then: impl FnOnce(&mut Self, &mut Context<Self>) + 'static,
    ) {
        let store = self.store.clone();
        let (prefix, meta_key) = crate::pubsub::history::topic_keys(&self.name, &topic);
        let ns = self.name.clone();
        let (topics, fresh) = ([topic.clone()], [crate::pubsub::history::new_epoch()]);
        ctx.wait(
            async move {
                // The sequencing transaction with nothing staged: the
                // stored meta, or a fresh one written unless another node
                // wrote one first.
                let stored = store
                    .transact(&[meta_key], None, |vals| {
                        Ok::<_, std::convert::Infallible>(plan_sequence(
                            &ns, &topics, vals, &fresh, &[],
                        ))
                    })
                    .await;
                // One topic planned, so one step: its meta after.
                let meta = match stored {
                    Ok(Some(Ok(s))) => s.topics.into_iter().next().map(|st| st.after),
                    Ok(_) => return Err(import_in_progress()),
                    Err(e) => return Err(e),
                }
                .ok_or_else(|| StoreError::Unavailable("the topic was not planned".into()))?;
                let rows = if meta.top > 0 {
                    store.scan_all(&prefix).await?
                } else {
                    Vec::new()
                };
                Ok((meta, rows))
            }
            .into_actor(self)
            .map(move |res, act, ctx| {
                match res {
                    Ok((meta, rows)) => {
                        let raw = serde_json::to_vec(&meta).ok();
                        let stored = NsHistory::stored_topic(&act.name, &topic, raw, rows);
                        if let Some(h) = act.history.as_mut()
                            && h.meta(&topic).is_none()
                        {
                            h.adopt(&topic, stored);
                        }
                    }
                    // The subscriber gets an epoch made here, as on one
                    // node; a later catch-up corrects it (4011).
                    Err(e) => {
                        tracing::warn!(namespace = %act.name, topic = %topic, error = %e, "A history topic's stored epoch could not be read for a subscriber.")
                    }
                }
                then(act, ctx);
            }),
        );
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
        let missed = (r.recovered && !r.missed.is_empty()).then(|| {
            self.recovered_frames
                .frames(sub.kind, topic, &r.position.epoch, &r.missed)
        });
        Subscribed {
            position: Some(r.position),
            recovered: Some(r.recovered),
            missed,
        }
    }
}

/// The frames of recovered publications that some socket's queue still
/// holds, by topic and offset: sockets recovering the same publications
/// share one copy of each frame (a recovery was framed per socket, so a
/// thousand sockets each holding a few MiB of missed publications held a
/// thousand copies). Weak: a frame goes with the last queue holding it.
#[derive(Default)]
pub struct RecoveredFrames {
    /// By topic: the epoch the frames belong to, and each frame by
    /// (offset, frame kind).
    topics: std::collections::HashMap<String, (String, FrameMap)>,
}

/// One topic's shared frames by (offset, [`FrameKind::index`]).
type FrameMap = std::collections::HashMap<(u64, usize), std::sync::Weak<Bytes>>;

/// Frames past which a topic's dead entries are dropped.
const FRAMES_PRUNE_AT: usize = 4096;

/// A socket queue's hold on a shared frame.
struct SharedFrame(std::sync::Arc<Bytes>);

impl AsRef<[u8]> for SharedFrame {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl RecoveredFrames {
    /// The frames of `entries` (publications of `topic` under `epoch`) for a
    /// socket of `kind`, each shared with the sockets holding it now.
    fn frames(
        &mut self,
        kind: crate::pubsub::FrameKind,
        topic: &str,
        epoch: &str,
        entries: &[Entry],
    ) -> Vec<Bytes> {
        let (held_epoch, frames) = self.topics.entry(topic.to_string()).or_default();
        if held_epoch != epoch {
            held_epoch.clear();
            held_epoch.push_str(epoch);
            frames.clear();
        }
        if frames.len() >= FRAMES_PRUNE_AT {
            frames.retain(|_, w| w.strong_count() > 0);
        }
        let out = entries
            .iter()
            .map(|e| {
                let key = (e.offset, kind.index());
                let frame = frames
                    .get(&key)
                    .and_then(std::sync::Weak::upgrade)
                    .unwrap_or_else(|| {
                        let f = std::sync::Arc::new(message_frame(
                            kind,
                            topic,
                            &e.data,
                            e.timestamp,
                            Some(e.offset),
                        ));
                        frames.insert(key, std::sync::Arc::downgrade(&f));
                        f
                    });
                Bytes::from_owner(SharedFrame(frame))
            })
            .collect();
        if self.topics.len() >= FRAMES_PRUNE_AT {
            self.topics
                .retain(|_, (_, f)| f.values().any(|w| w.strong_count() > 0));
        }
        out
    }
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
        if self.history_unloaded_for(&msg.topic) {
            return self.after_history(ctx, msg);
        }
        let _t = self.stats.begin();
        let ack = match self.guarded(ctx, |act| {
            act.exists()?;
            let rule = act.history_rule(&msg.topic);
            if rule.is_some() {
                act.admit_history_topics([msg.topic.as_str()], true)?;
            }
            Ok(act.publish_one(&msg.topic, &msg.data, rule))
        }) {
            Ok(a) => a,
            Err(e) => return actix::Response::reply(Err(e)),
        };
        self.count_publishes(1);
        self.fire_pubsub_triggers(&msg.topic, &msg.data, msg.depth);
        match ack {
            None => actix::Response::reply(Ok(None)),
            Some(a) => {
                self.flush_history(ctx);
                actix::Response::fut(async move { Ok(positions(vec![a]).await?.pop()) })
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
        if msg
            .messages
            .iter()
            .any(|(t, _)| self.history_unloaded_for(t))
        {
            return self.after_history(ctx, msg);
        }
        let _t = self.stats.begin();
        let acks = match self.guarded(ctx, |act| {
            act.exists()?;
            // Each topic's rule looked up once; the history topics admitted
            // all at once, before anything is published (all or none).
            let rules: Vec<Option<HistoryRule>> = msg
                .messages
                .iter()
                .map(|(topic, _)| act.history_rule(topic))
                .collect();
            act.admit_history_topics(
                msg.messages
                    .iter()
                    .zip(&rules)
                    .filter(|(_, r)| r.is_some())
                    .map(|((topic, _), _)| topic.as_str()),
                true,
            )?;
            Ok(msg
                .messages
                .iter()
                .zip(rules)
                .filter_map(|((topic, data), rule)| act.publish_one(topic, data, rule))
                .collect::<Vec<_>>())
        }) {
            Ok(a) => a,
            Err(e) => return actix::Response::reply(Err(e)),
        };
        self.count_publishes(msg.messages.len() as u64);
        for (topic, data) in &msg.messages {
            self.fire_pubsub_triggers(topic, data, 0);
        }
        let n = msg.messages.len();
        if !acks.is_empty() {
            self.flush_history(ctx);
            return actix::Response::fut(async move { positions(acks).await.map(|_| n) });
        }
        actix::Response::reply(Ok(n))
    }
}

pub use crate::pubsub::MeshMessage;

/// Sent by the node's mesh ingress task (`node.rs`): publications of
/// history topics that another node sequenced, in the order the mesh
/// delivered them (each with its offset and epoch). Each is kept in this
/// node's copy of the topic and delivered to the local subscribers when it
/// is the next offset; a duplicate is dropped; a gap or another epoch reads
/// the topic from the store again (where every delivered publication is),
/// which delivers what was missed or closes the subscribers with 4011.
/// Past admission (sent with `Addr::send`, which waits for room). No reply.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Replicated {
    /// The publications, each with `history` set.
    pub messages: Vec<MeshMessage>,
}

impl Handler<Replicated> for NamespaceSupervisor {
    type Result = ();
    fn handle(&mut self, msg: Replicated, ctx: &mut Context<Self>) {
        if msg
            .messages
            .iter()
            .any(|m| m.history.is_some() && self.history_unloaded_for(&m.topic))
        {
            self.load_history_then(ctx, move |act, ctx| act.handle(msg, ctx));
            return;
        }
        let _t = self.stats.begin();
        if self.record.is_none() {
            return;
        }
        let caps = self.history_caps();
        let mut behind: Vec<String> = Vec::new();
        for m in msg.messages {
            let Some((offset, epoch)) = m.history else {
                continue;
            };
            // The store holds every later publication of a topic behind here.
            if behind.iter().any(|t| **t == *m.topic) {
                continue;
            }
            let pos = Position { offset, epoch };
            let rule = self.history_rule(&m.topic);
            let step = match (&rule, self.history.as_mut()) {
                (Some(rule), Some(h)) => h.apply_replica(
                    &m.topic,
                    &pos.epoch,
                    offset,
                    m.timestamp,
                    &m.data,
                    rule,
                    &caps,
                ),
                // No rule here (yet): delivered with its offset, not kept.
                _ => ReplicaStep::Appended,
            };
            match step {
                ReplicaStep::Appended => {
                    self.deliver_sequenced(&m.topic, &pos, m.timestamp, &m.data, Origin::Mesh)
                }
                ReplicaStep::Duplicate => {}
                ReplicaStep::Behind => behind.push(m.topic.to_string()),
            }
        }
        for topic in behind {
            self.catch_up(ctx, topic, Vec::new());
        }
        self.arm_history_sweep(ctx);
    }
}

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
    /// At most this much payload (`max_history_page_bytes`), one
    /// publication at least.
    pub max_bytes: u64,
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
    /// More kept publications follow in the page's direction (it was cut
    /// by its `limit` or its bytes): read on from its last offset.
    pub more: bool,
}

impl Handler<ReadHistory> for NamespaceSupervisor {
    type Result = actix::Response<NsResult<HistoryPage>>;
    fn handle(&mut self, msg: ReadHistory, ctx: &mut Context<Self>) -> Self::Result {
        if self.history_unloaded_for(&msg.topic) {
            return self.after_history(ctx, msg);
        }
        let _t = self.stats.begin();
        actix::Response::reply(self.guarded(ctx, |act| {
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
            let (entries, more) = h.read(
                &msg.topic,
                msg.since,
                msg.limit,
                msg.max_bytes,
                msg.reverse,
                oldest,
            );
            Ok(HistoryPage {
                position: Some(position),
                entries,
                more,
            })
        }))
    }
}

/// Whether a history topic is in use on this node, so its stream is never
/// forgotten for room or age: subscribed (`table`), held by a recovery
/// (`held`), or with a publication on its way (`busy`,
/// [`history_busy`]). Takes the supervisor's fields, not the supervisor, so
/// its history can change meanwhile.
fn history_in_use<'a>(
    table: &'a crate::pubsub::TopicTable,
    held: &'a [Held],
    busy: &'a std::collections::HashSet<&'a str>,
) -> impl Fn(&str) -> bool + 'a {
    move |t: &str| {
        table.targets(t).is_some() || held.iter().any(|h| h.topic == t) || busy.contains(t)
    }
}

/// The topics a publication is on its way to: staged for the next history
/// write, or in the write in flight. (A stream forgotten meanwhile would be
/// read back from the store once the publication is written, its meta kept
/// by the guarded deletion, and would count against the quota twice over.)
fn history_busy<'a>(
    staged: &'a [(Staged, AckTx)],
    in_flight: &'a [String],
) -> std::collections::HashSet<&'a str> {
    staged
        .iter()
        .map(|(s, _)| s.topic.as_str())
        .chain(in_flight.iter().map(String::as_str))
        .collect()
}

fn bad_offset(m: impl Into<String>) -> NsError {
    NsError::Refused(crate::error::ApiError::new(
        crate::error::Code::BadOffset,
        m.into(),
    ))
}

impl NamespaceSupervisor {
    /// Sets the history sweep's timer (`[pubsub] history_sweep_seconds`)
    /// while the history holds any stream: a namespace without history
    /// has no timer (a timer per namespace would wake an idle node), and
    /// the sweep sets it again only while there is something to sweep.
    /// Called on every history write ([`flush_history`](Self::flush_history)),
    /// on replicas from the mesh, and when the supervisor (re)starts.
    pub(crate) fn arm_history_sweep(&mut self, ctx: &mut Context<Self>) {
        if self.history_sweep_armed || self.history.as_ref().is_none_or(|h| h.topic_count() == 0) {
            return;
        }
        self.history_sweep_armed = true;
        let every = self.topics.service.config.history_sweep_seconds.max(1);
        ctx.run_later(std::time::Duration::from_secs(every), |act, ctx| {
            act.history_sweep_armed = false;
            act.sweep_history(ctx);
        });
    }

    /// The history sweep, every `[pubsub] history_sweep_seconds` on this
    /// supervisor's own timer ([`arm_history_sweep`](Self::arm_history_sweep)):
    /// drops what is past its rule's age or size and forgets streams idle
    /// past `history_meta_ttl_seconds` or over the `history_topics` quota,
    /// then writes the deletions. Not counted as activity: an idle
    /// namespace still passivates.
    pub(crate) fn sweep_history(&mut self, ctx: &mut Context<Self>) {
        if self.history.as_ref().is_none_or(|h| h.topic_count() == 0) {
            return;
        }
        let caps = self.history_caps();
        let _ = self.guarded(ctx, |act| {
            let rules = act
                .record
                .as_ref()
                .map(|r| r.history.clone())
                .unwrap_or_default();
            let own_store = act.store.as_sled().is_some();
            let busy = history_busy(&act.history_staged, &act.history_in_flight);
            let in_use = history_in_use(&act.topics, &act.held, &busy);
            if let Some(h) = act.history.as_mut() {
                h.sweep(&rules, now_ms(), &caps, own_store, in_use);
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
    /// Topics with a stream kept (the `history_topics` quota's use).
    pub topics: u64,
    /// The `history_topics` quota.
    pub max_topics: u64,
    /// The streams, with `streams`; empty otherwise.
    pub streams: Vec<ExportedTopic>,
}

impl Handler<HistoryOf> for NamespaceSupervisor {
    type Result = actix::Response<NsResult<HistoryState>>;
    fn handle(&mut self, msg: HistoryOf, ctx: &mut Context<Self>) -> Self::Result {
        if self.history.is_none() {
            return self.after_history(ctx, msg);
        }
        let _t = self.stats.begin();
        let caps = self.history_caps();
        let (max_bytes, max_topics) = (caps.max_bytes, caps.max_topics);
        actix::Response::reply(self.guarded(ctx, |act| {
            act.exists()?;
            let Some(h) = act.history.as_ref() else {
                return Ok(HistoryState {
                    max_bytes,
                    max_topics,
                    ..Default::default()
                });
            };
            Ok(HistoryState {
                bytes: h.bytes(),
                max_bytes,
                topics: h.topic_count(),
                max_topics,
                streams: if msg.streams { h.export() } else { Vec::new() },
            })
        }))
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
    /// After the history is loaded: the old streams' keys must be known to
    /// be deleted.
    type Result = actix::Response<NsResult<tokio::sync::oneshot::Receiver<bool>>>;
    fn handle(&mut self, msg: ReplaceHistory, ctx: &mut Context<Self>) -> Self::Result {
        if self.history.is_none() {
            return self.after_history(ctx, msg);
        }
        let _t = self.stats.begin();
        let replaced = self.guarded(ctx, |act| {
            act.exists()?;
            if let Some(h) = act.history.as_mut() {
                h.replace(msg.topics);
            }
            Ok(())
        });
        actix::Response::reply(replaced.map(|()| self.history_stored(ctx)))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actors::stats::{ActorDirectory, ask};
    use crate::metrics::Metrics;
    use crate::pubsub::history::{row_key, topic_keys};
    use crate::storage::Store;
    use std::time::Duration;

    /// Recoveries of the same publications for the same kind of socket
    /// share each frame while any holds it; another kind, or the same
    /// offsets under a new epoch, get frames of their own.
    #[test]
    fn recovered_frames_are_shared_while_held() {
        use crate::pubsub::FrameKind;
        let entries: Vec<Entry> = (1..=3)
            .map(|o| Entry {
                offset: o,
                timestamp: 1000 + o,
                data: Bytes::from(vec![b'x'; 100]),
            })
            .collect();
        let mut shared = RecoveredFrames::default();
        let a = shared.frames(FrameKind::Full, "t", "e1", &entries);
        let b = shared.frames(FrameKind::Full, "t", "e1", &entries[1..]);
        assert_eq!(a.len(), 3);
        assert_eq!(a[1].as_ptr(), b[0].as_ptr(), "one frame for both sockets");
        assert_eq!(
            a[1],
            message_frame(FrameKind::Full, "t", &entries[1].data, 1002, Some(2))
        );
        let simple = shared.frames(FrameKind::Simple, "t", "e1", &entries);
        assert_ne!(simple[0].as_ptr(), a[0].as_ptr());
        let next_epoch = shared.frames(FrameKind::Full, "t", "e2", &entries);
        assert_ne!(next_epoch[0].as_ptr(), a[0].as_ptr());
    }

    /// A stream forgotten to make room while a history write is in flight,
    /// then published to before the next write starts, is both sequenced
    /// and forgotten by that next write: its stored meta's deletion is
    /// guarded (a compare-and-swap against the meta the node knew, made
    /// after the sequencing), so the publication continues the stored
    /// stream and the meta stays. An idle stream forgotten beside it goes
    /// with the write's trims. (Without the guard, the meta the write had
    /// just advanced was deleted: the acknowledged publication's row lost
    /// its meta, and a restart drops it.)
    #[actix_rt::test]
    async fn a_stream_forgotten_and_published_in_one_write_keeps_its_meta() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        let mut rec = crate::namespace::NamespaceRecord::new("ns", 1);
        rec.history = vec![HistoryRule {
            topics: "t.*".into(),
            size: 10,
            ttl_seconds: 3600,
        }];
        rec.quotas.insert("history_topics".into(), 3);
        store
            .put_json(&crate::namespace::ns_key("ns"), &rec)
            .await
            .unwrap();
        // Two idle streams in the store (no publication kept): t.a sorts
        // first among equally idle ones.
        let meta = |epoch: &str, top: u64| {
            serde_json::to_vec(&Meta {
                epoch: epoch.into(),
                top,
            })
            .unwrap()
        };
        let meta_of = |topic: &str| topic_keys("ns", topic).1;
        store.put(&meta_of("t.a"), &meta("ea", 5)).await.unwrap();
        store.put(&meta_of("t.b"), &meta("eb", 3)).await.unwrap();
        let metrics = Metrics::new();
        let stats = ActorDirectory::default().register(&metrics, "namespace", "ns", 64);
        let addr = NamespaceSupervisor::new("ns".into(), store.clone(), stats.clone(), 64).start();
        let publish = |topic: &str| {
            let msg = Publish {
                topic: topic.into(),
                data: Bytes::from_static(b"x"),
                depth: 0,
            };
            ask(&addr, &stats, msg, Duration::from_secs(10))
        };
        // All three are in the mailbox before the supervisor runs: t.f's
        // write starts with the first; t.u (new) makes room by forgetting
        // t.a; t.a (new again) makes room by forgetting t.b. Both wait for
        // the next write, which sequences t.u and t.a and forgets t.a and t.b.
        let (f, u, a) = futures_util::join!(publish("t.f"), publish("t.u"), publish("t.a"));
        let pos = |r: Result<NsResult<Option<Position>>, _>| r.unwrap().unwrap().unwrap();
        let (f, u, a) = (pos(f), pos(u), pos(a));
        assert_eq!((f.offset, u.offset), (1, 1));
        assert_eq!((a.offset, a.epoch.as_str()), (6, "ea"), "t.a goes on");
        let stored = store.get(&meta_of("t.a")).await.unwrap();
        assert_eq!(stored, Some(meta("ea", 6)), "its meta kept, advanced");
        assert!(
            store.get(&row_key("ns", "t.a", 6)).await.unwrap().is_some(),
            "its publication stored"
        );
        assert_eq!(
            store.get(&meta_of("t.b")).await.unwrap(),
            None,
            "the idle stream forgotten in the store"
        );
    }
}
