//! The pub/sub messages of a namespace's supervisor (docs/design.md §5): it owns the
//! namespace's [`TopicTable`](crate::pubsub::TopicTable) (`self.topics`) and is
//! the one place a publish is accepted, so one client's publishes are handled,
//! delivered and acknowledged in the order it sent them.

use super::namespace::{NamespaceSupervisor, NsError, NsResult};
use super::stats::ActorStats;
use crate::metrics::Metrics;
use crate::pubsub::{Member, Origin, PresenceEvent, SubscriberRef, TopicInfo};
use actix::dev::SendError;
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
}

/// Sent by a `WsSession` to subscribe its connection to a topic (with an
/// optional presence member); replies once the subscription is live.
#[derive(Message)]
#[rtype(result = "NsResult<()>")]
pub struct Subscribe {
    /// Topic within the namespace the connection subscribes to.
    pub topic: String,
    /// The socket to deliver to: its relay, connection id and frame kind.
    pub sub: SubscriberRef,
    /// With presence: the client's `member_id` and `member_meta`; its join is published.
    pub presence: Option<(String, Option<String>)>,
}

impl Handler<Subscribe> for NamespaceSupervisor {
    type Result = NsResult<()>;
    fn handle(&mut self, msg: Subscribe, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        self.guarded(ctx, |act| {
            act.exists()?;
            let before = act.gauge_base();
            let joined = act.topics.subscribe(&msg.topic, msg.sub, msg.presence);
            act.pubsub_gauges(before);
            act.deliver_presence(joined);
            Ok(())
        })
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
#[derive(Message)]
#[rtype(result = "NsResult<()>")]
pub struct Publish {
    /// Topic within the namespace, already checked by the sender.
    pub topic: String,
    /// The payload, size-checked by the sender; shared, not copied, per subscriber.
    pub data: Bytes,
    /// Trigger depth of the publisher (0 for clients).
    pub depth: u8,
}

impl Handler<Publish> for NamespaceSupervisor {
    type Result = NsResult<()>;
    fn handle(&mut self, msg: Publish, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        self.guarded(ctx, |act| {
            act.exists()?;
            act.deliver(&msg.topic, &msg.data);
            Ok(())
        })?;
        self.count_publishes(1);
        self.fire_pubsub_triggers(&msg.topic, &msg.data, msg.depth);
        Ok(())
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
    type Result = NsResult<usize>;
    fn handle(&mut self, msg: PublishBatch, ctx: &mut Context<Self>) -> Self::Result {
        let _t = self.stats.begin();
        self.guarded(ctx, |act| {
            act.exists()?;
            for (topic, data) in &msg.messages {
                act.deliver(topic, data);
            }
            Ok(())
        })?;
        self.count_publishes(msg.messages.len() as u64);
        for (topic, data) in &msg.messages {
            self.fire_pubsub_triggers(topic, data, 0);
        }
        Ok(msg.messages.len())
    }
}

pub use crate::pubsub::MeshMessage;

/// Sent by the cluster mesh (through [`FromMesh::send_to`], the bounded
/// admission) with the messages of one received mesh batch for this
/// namespace, in stream order: delivered to this node's subscribers only,
/// with the origin's timestamps. Never forwarded back into the mesh and
/// fires no pub/sub triggers (the origin node fired them). One supervisor
/// message per batch, but admitted by its message count: each message takes
/// a mailbox slot. No reply.
#[derive(Message)]
#[rtype(result = "()")]
pub struct FromMesh {
    /// One mesh batch's messages for this namespace, in stream order, each with
    /// its origin's timestamp; each took a mailbox slot.
    pub messages: Vec<MeshMessage>,
}

/// Why a mesh message was dropped at a namespace's supervisor: the label of
/// `meshgate_mesh_messages_dropped_total`.
pub const MESH_DROP_MAILBOX_FULL: &str = "mailbox_full";
/// The supervisor stopped (its namespace was deleted) before taking the message.
pub const MESH_DROP_NAMESPACE_STOPPED: &str = "namespace_stopped";

impl FromMesh {
    /// Hands the messages to the namespace's supervisor through the same
    /// bounded admission as local publishes, one slot per message: as many
    /// as there are free slots are admitted (the first ones, so what is
    /// delivered keeps its order), the rest is dropped and counted in
    /// `meshgate_mesh_messages_dropped_total{reason="mailbox_full"}`; with
    /// the supervisor gone all of them are (`reason="namespace_stopped"`).
    /// Returns how many were admitted.
    pub fn send_to(
        mut self,
        addr: &Addr<NamespaceSupervisor>,
        stats: &ActorStats,
        metrics: &Metrics,
    ) -> usize {
        let total = self.messages.len();
        let mut admitted = 0;
        while admitted < total && stats.admit() {
            admitted += 1;
        }
        let dropped = |reason: &str, n: usize| {
            if n > 0 {
                metrics
                    .mesh_dropped
                    .with_label_values(&[reason])
                    .inc_by(n as u64);
            }
        };
        dropped(MESH_DROP_MAILBOX_FULL, total - admitted);
        if admitted == 0 {
            return 0;
        }
        self.messages.truncate(admitted);
        let give_back = |stats: &ActorStats| {
            for _ in 0..admitted {
                stats.cancel();
            }
        };
        match addr.try_send(self) {
            Ok(()) => admitted,
            Err(SendError::Full(_)) => {
                // The mailbox's backstop (envelopes, not messages) is full.
                give_back(stats);
                dropped(MESH_DROP_MAILBOX_FULL, admitted);
                0
            }
            Err(SendError::Closed(_)) => {
                give_back(stats);
                dropped(MESH_DROP_NAMESPACE_STOPPED, admitted);
                0
            }
        }
    }
}

impl Handler<FromMesh> for NamespaceSupervisor {
    type Result = ();
    fn handle(&mut self, msg: FromMesh, ctx: &mut Context<Self>) {
        // Every message of the batch took a slot: one is given back by
        // `begin`, the others here.
        let _t = self.stats.begin();
        for _ in 1..msg.messages.len() {
            self.stats.cancel();
        }
        let _ = self.guarded(ctx, |act| {
            act.exists()?;
            for m in &msg.messages {
                let targets = act.topics.targets(&m.topic);
                act.topics.service.deliver_at(
                    &act.name,
                    &m.topic,
                    &m.data,
                    targets,
                    Origin::Mesh,
                    m.timestamp,
                );
            }
            Ok(())
        });
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
    use crate::actors::ActorDirectory;
    use crate::storage::Store;
    use std::time::{Duration, Instant};

    fn batch(range: std::ops::Range<usize>) -> FromMesh {
        FromMesh {
            messages: range
                .map(|i| MeshMessage {
                    topic: "room".into(),
                    data: Bytes::from(i.to_string()),
                    timestamp: 0,
                })
                .collect(),
        }
    }

    /// Mesh messages take a mailbox slot each like local ones, though a
    /// batch is one supervisor message: over the bound the rest of a batch
    /// is dropped and counted (`mailbox_full`), and the depth gauge, counted
    /// in at admission and out by the handler, ends at 0, never below.
    #[actix_rt::test]
    async fn from_mesh_goes_through_admission() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Metrics::new();
        let stats = ActorDirectory::default().register(&metrics, "namespace", "chat", 4);
        let store = Store::open_sled(dir.path()).unwrap();
        let addr = NamespaceSupervisor::new("chat".into(), store, stats.clone(), 4).start();
        let gauge = metrics
            .actor_mailbox_depth
            .with_label_values(&["namespace", metrics.ns_label("chat").as_str()]);
        let dropped = |reason| metrics.mesh_dropped.with_label_values(&[reason]).get();
        // No await between the sends: the supervisor (on this thread) takes none yet.
        assert_eq!(batch(0..3).send_to(&addr, &stats, &metrics), 3);
        assert_eq!(gauge.get(), 3);
        // One slot left: the first message of the next batch takes it.
        assert_eq!(batch(3..10).send_to(&addr, &stats, &metrics), 1);
        assert_eq!(batch(10..12).send_to(&addr, &stats, &metrics), 0);
        assert_eq!(gauge.get(), 4);
        assert_eq!(dropped(MESH_DROP_MAILBOX_FULL), 6 + 2);
        let deadline = Instant::now() + Duration::from_secs(10);
        while stats.handled() < 2 {
            assert!(gauge.get() >= 0, "depth {}", gauge.get());
            assert!(Instant::now() < deadline, "handled {}", stats.handled());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(gauge.get(), 0);
        // The slots are free again: a whole batch of 4 fits.
        assert_eq!(batch(20..24).send_to(&addr, &stats, &metrics), 4);
        assert_eq!(dropped(MESH_DROP_MAILBOX_FULL), 8);
        assert_eq!(batch(30..30).send_to(&addr, &stats, &metrics), 0);
        while stats.handled() < 3 {
            assert!(Instant::now() < deadline, "handled {}", stats.handled());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(gauge.get(), 0);
    }

    /// A stopped supervisor takes nothing: the batch is counted as
    /// `namespace_stopped` and its slots are given back.
    #[actix_rt::test]
    async fn from_mesh_to_a_stopped_supervisor_is_counted() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Metrics::new();
        let stats = ActorDirectory::default().register(&metrics, "namespace", "gone", 8);
        let store = Store::open_sled(dir.path()).unwrap();
        let addr = NamespaceSupervisor::new("gone".into(), store, stats.clone(), 8).start();
        addr.send(StopForTest).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while addr.connected() {
            assert!(Instant::now() < deadline, "never stopped");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(batch(0..5).send_to(&addr, &stats, &metrics), 0);
        let dropped = |reason| metrics.mesh_dropped.with_label_values(&[reason]).get();
        assert_eq!(dropped(MESH_DROP_NAMESPACE_STOPPED), 5);
        assert_eq!(dropped(MESH_DROP_MAILBOX_FULL), 0);
        assert_eq!(stats.depth(), 0);
    }

    #[derive(Message)]
    #[rtype(result = "()")]
    struct StopForTest;

    impl Handler<StopForTest> for NamespaceSupervisor {
        type Result = ();
        fn handle(&mut self, _: StopForTest, ctx: &mut Context<Self>) {
            ctx.stop();
        }
    }
}
