//! The pub/sub messages of a namespace's supervisor (docs/design.md §5): it owns the
//! namespace's [`TopicTable`](crate::pubsub::TopicTable) (`self.topics`) and is
//! the one place a publish is accepted, so one client's publishes are handled,
//! delivered and acknowledged in the order it sent them.

use super::namespace::{NamespaceSupervisor, NsError, NsResult};
use super::stats::{ActorStats, AskError, tell};
use crate::metrics::Metrics;
use crate::pubsub::{Member, Origin, PresenceEvent, SubscriberRef, TopicInfo};
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

    /// The hook the namespace's pub/sub triggers plug into: called once for
    /// every accepted client publish (not for presence events), after local
    /// delivery, with the trigger depth of the publisher (0 for clients; a
    /// function publishing from a trigger passes its depth + 1, and triggers
    /// stop at depth 5). Fires the namespace's pub/sub triggers (`actors/functions.rs`).
    pub fn on_published(&mut self, _ctx: &mut Context<Self>, topic: &str, data: &Bytes, depth: u8) {
        self.fire_pubsub_triggers(topic, data, depth);
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
    pub topic: String,
    pub sub: SubscriberRef,
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
    pub topic: String,
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
#[derive(Message)]
#[rtype(result = "NsResult<()>")]
pub struct Publish {
    pub topic: String,
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
        self.on_published(ctx, &msg.topic, &msg.data, msg.depth);
        Ok(())
    }
}

/// Sent by `POST /v1/pubsub/publish-batch` (already validated, ≤ 100
/// messages); replies with the number accepted, all of them or none.
#[derive(Message)]
#[rtype(result = "NsResult<usize>")]
pub struct PublishBatch {
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
            self.on_published(ctx, topic, data, 0);
        }
        Ok(msg.messages.len())
    }
}

/// Sent by the cluster mesh (through `node.locate(ns)` and [`FromMesh::send_to`],
/// the bounded admission) for a message
/// published on another node: delivered to this node's subscribers only, with
/// the origin's timestamp. Never forwarded back into the mesh and fires no
/// pub/sub triggers (the origin node fired them). No reply.
#[derive(Message)]
#[rtype(result = "()")]
pub struct FromMesh {
    pub topic: String,
    pub data: Bytes,
    /// When the origin node accepted the message (ms since the Unix epoch).
    pub timestamp: u64,
}

/// Why a mesh message was dropped at a namespace's supervisor: the label of
/// `meshgate_mesh_messages_dropped_total`.
pub const MESH_DROP_MAILBOX_FULL: &str = "mailbox_full";
/// The supervisor stopped (its namespace was deleted) before taking the message.
pub const MESH_DROP_NAMESPACE_STOPPED: &str = "namespace_stopped";

impl FromMesh {
    /// Hands the message to the namespace's supervisor through the same
    /// bounded admission as a local publish. Over the bound (or with the
    /// supervisor gone) it is dropped and counted in
    /// `meshgate_mesh_messages_dropped_total` by reason. Returns whether it was admitted.
    pub fn send_to(
        self,
        addr: &Addr<NamespaceSupervisor>,
        stats: &ActorStats,
        metrics: &Metrics,
    ) -> bool {
        let reason = match tell(addr, stats, self) {
            Ok(()) => return true,
            Err(AskError::Overloaded | AskError::Timeout) => MESH_DROP_MAILBOX_FULL,
            Err(AskError::Gone) => MESH_DROP_NAMESPACE_STOPPED,
        };
        metrics.mesh_dropped.with_label_values(&[reason]).inc();
        false
    }
}

impl Handler<FromMesh> for NamespaceSupervisor {
    type Result = ();
    fn handle(&mut self, msg: FromMesh, ctx: &mut Context<Self>) {
        let _t = self.stats.begin();
        let _ = self.guarded(ctx, |act| {
            act.exists()?;
            let targets = act.topics.targets(&msg.topic);
            act.topics.service.deliver_at(
                &act.name,
                &msg.topic,
                &msg.data,
                targets,
                Origin::Mesh,
                msg.timestamp,
            );
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

    /// Mesh messages take a mailbox slot like local ones: over the bound they
    /// are dropped and counted (`mailbox_full`), and the depth gauge, counted
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
        // No await between the sends: the supervisor (on this thread) takes none yet.
        let admitted = (0..10)
            .filter(|i| {
                FromMesh {
                    topic: "room".into(),
                    data: Bytes::from(i.to_string()),
                    timestamp: 0,
                }
                .send_to(&addr, &stats, &metrics)
            })
            .count();
        assert_eq!(admitted, 4);
        assert_eq!(gauge.get(), 4);
        let dropped = |reason| metrics.mesh_dropped.with_label_values(&[reason]).get();
        assert_eq!(dropped(MESH_DROP_MAILBOX_FULL), 6);
        let deadline = Instant::now() + Duration::from_secs(10);
        while stats.handled() < 4 {
            assert!(gauge.get() >= 0, "depth {}", gauge.get());
            assert!(Instant::now() < deadline, "handled {}", stats.handled());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(gauge.get(), 0);
        // The slots are free again.
        assert!(
            FromMesh {
                topic: "room".into(),
                data: Bytes::from_static(b"again"),
                timestamp: 0,
            }
            .send_to(&addr, &stats, &metrics)
        );
        assert_eq!(dropped(MESH_DROP_MAILBOX_FULL), 6);
    }
}
