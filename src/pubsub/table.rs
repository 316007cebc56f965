//! `TopicTable`: a namespace's live topics, their local subscribers (grouped by
//! the relay of the worker thread that owns each socket) and presence members.
//! Owned by the namespace's supervisor, the only code that touches it.
//!
//! The table is soft state describing live sockets. It is *kept* across a
//! supervisor restart (`restarting` does not clear it): the sockets did not
//! restart, so their subscriptions stay valid and nothing is lost. Each
//! mutation below is complete before it returns, so a panic elsewhere in a
//! handler cannot leave it half-updated.

use super::protocol::{FrameKind, now_ms};
use super::service::{PubSubService, Targets};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;

/// A local subscriber: which relay owns its socket, its connection id and framing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubscriberRef {
    /// The id of the relay (one per worker thread) that owns the socket.
    pub relay: u32,
    /// The connection's id, unique per node; the key of its subscriptions.
    pub conn: u64,
    /// How a message is framed for this socket.
    pub kind: FrameKind,
}

/// A presence member as `GET /v1/pubsub/presence` lists it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Member {
    /// Chosen by the client (`member_id`); several sockets may share it.
    pub member_id: String,
    /// The `member_meta` of the first join: JSON when it parses, else a string.
    pub meta: Option<serde_json::Value>,
    /// Unix milliseconds when the first connection under this id joined.
    pub joined_at: u64,
    /// Connections present under this id (a member may join from several).
    pub connections: usize,
}

/// A live topic as `GET /v1/pubsub/topics` lists it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TopicInfo {
    /// The topic's name.
    pub topic: String,
    /// Local subscriptions to it.
    pub subscribers: usize,
    /// Distinct presence members on it.
    pub members: usize,
}

/// One topic with at least one local subscriber (removed with its last).
#[derive(Default)]
struct Topic {
    /// The subscribers by connection id.
    subs: HashMap<u64, SubscriberRef>,
    /// Per relay, the connections to hand a message to. Copy-on-write: a
    /// delivery in flight holds the old list, the next one sees the new.
    targets: Targets,
    /// Subscribers per [`FrameKind`] (by its index): a publish renders only
    /// the frame kinds someone needs.
    kinds: [usize; 3],
    /// Presence members by id.
    members: HashMap<String, Member>,
    /// Which member each present connection joined as, to leave on unsubscribe.
    member_of_conn: HashMap<u64, String>,
}

/// A join or leave to publish on the topic (the event is the message's data).
#[derive(Debug, Clone, PartialEq)]
pub struct PresenceEvent {
    /// The topic joined or left; the event is published on it.
    pub topic: String,
    /// The JSON event: `{"type":"presence","event":"join"|"leave",...}`.
    pub data: bytes::Bytes,
}

fn presence_event(event: &str, topic: &str, m: &Member) -> PresenceEvent {
    let v = serde_json::json!({
        "type": "presence",
        "event": event,
        "topic": topic,
        "member_id": m.member_id,
        "meta": m.meta,
        "timestamp": now_ms(),
    });
    PresenceEvent {
        topic: topic.to_string(),
        data: serde_json::to_vec(&v).unwrap_or_default().into(),
    }
}

/// Where a message on one topic goes: the topic's per-relay connection
/// lists and which frame kinds are needed (what [`TopicTable::targets`] gives).
#[derive(Clone)]
pub struct Route {
    /// Per relay, the connections subscribed (shared lists, not copies).
    pub targets: Targets,
    /// Which [`FrameKind`]s someone needs, by index.
    pub kinds: [bool; 3],
}

/// A read-only copy of a namespace's routes (topic → [`Route`]) for the
/// cluster mesh's ingress, which delivers messages from other nodes without
/// going through the namespace's supervisor (docs/pubsub.md, "Messages from
/// the mesh"). The supervisor's [`TopicTable`] is its only writer and updates
/// it in the same step as its own table, so a subscription is in it before
/// the subscribe is answered. Cheap to clone (shared).
#[derive(Clone, Default)]
pub struct MeshRoutes(Arc<parking_lot::RwLock<HashMap<String, Route>>>);

impl MeshRoutes {
    /// The route of `topic`, if anyone subscribes to it on this node.
    pub fn get(&self, topic: &str) -> Option<Route> {
        self.0.read().get(topic).cloned()
    }

    /// Topics with a route (tests, metrics).
    pub fn len(&self) -> usize {
        self.0.read().len()
    }

    /// Whether no topic has a route.
    pub fn is_empty(&self) -> bool {
        self.0.read().is_empty()
    }

    fn set(&self, topic: &str, t: Option<&Topic>) {
        let mut map = self.0.write();
        match t {
            Some(t) => {
                let route = Route {
                    targets: t.targets.clone(),
                    kinds: t.kinds.map(|n| n > 0),
                };
                match map.get_mut(topic) {
                    Some(r) => *r = route,
                    None => {
                        map.insert(topic.to_string(), route);
                    }
                }
            }
            None => {
                map.remove(topic);
            }
        }
    }

    fn clear(&self) {
        self.0.write().clear();
    }
}

/// The topics of one namespace.
#[derive(Default)]
pub struct TopicTable {
    /// The node's delivery path (every publish goes through it).
    pub service: PubSubService,
    /// The topics with at least one local subscriber.
    topics: HashMap<String, Topic>,
    /// Each connection's topics, so a closed socket unsubscribes from all.
    conn_topics: HashMap<u64, Vec<String>>,
    /// Subscriptions over every topic ([`TopicTable::subscriptions`]).
    count: usize,
    /// The copy of every topic's route the mesh ingress reads.
    routes: MeshRoutes,
}

impl TopicTable {
    /// An empty table delivering through `service`.
    pub fn new(service: PubSubService) -> Self {
        Self {
            service,
            topics: HashMap::new(),
            conn_topics: HashMap::new(),
            count: 0,
            routes: MeshRoutes::default(),
        }
    }

    /// Keeps `routes` (shared with the mesh ingress) in step with this
    /// table from now on, starting with what the table holds.
    pub fn share_routes(&mut self, routes: MeshRoutes) {
        routes.clear();
        for (topic, t) in &self.topics {
            routes.set(topic, Some(t));
        }
        self.routes = routes;
    }

    /// The routes copy this table keeps current.
    pub fn routes(&self) -> &MeshRoutes {
        &self.routes
    }

    /// Adds a subscriber (idempotent per connection and topic); returns the
    /// join event when a new presence member appeared.
    pub fn subscribe(
        &mut self,
        topic: &str,
        sub: SubscriberRef,
        presence: Option<(String, Option<String>)>,
    ) -> Option<PresenceEvent> {
        let t = self.topics.entry(topic.to_string()).or_default();
        if t.subs.insert(sub.conn, sub).is_none() {
            t.kinds[sub.kind.index()] += 1;
            self.count += 1;
            match t.targets.iter_mut().find(|(r, _)| *r == sub.relay) {
                Some((_, list)) => Arc::make_mut(list).push((sub.conn, sub.kind)),
                None => t
                    .targets
                    .push((sub.relay, Arc::new(vec![(sub.conn, sub.kind)]))),
            }
            self.conn_topics
                .entry(sub.conn)
                .or_default()
                .push(topic.to_string());
            self.routes.set(topic, Some(t));
        }
        let (member_id, meta) = presence?;
        if t.member_of_conn.contains_key(&sub.conn) {
            return None;
        }
        t.member_of_conn.insert(sub.conn, member_id.clone());
        let meta = meta.map(|m| serde_json::from_str(&m).unwrap_or(serde_json::Value::String(m)));
        match t.members.get_mut(&member_id) {
            Some(m) => {
                m.connections += 1;
                None
            }
            None => {
                let m = Member {
                    member_id: member_id.clone(),
                    meta,
                    joined_at: now_ms(),
                    connections: 1,
                };
                let ev = presence_event("join", topic, &m);
                t.members.insert(member_id, m);
                Some(ev)
            }
        }
    }

    /// Removes one subscription; returns the leave event when a member left.
    pub fn unsubscribe(&mut self, topic: &str, conn: u64) -> Option<PresenceEvent> {
        if let Some(list) = self.conn_topics.get_mut(&conn) {
            list.retain(|t| t != topic);
            if list.is_empty() {
                self.conn_topics.remove(&conn);
            }
        }
        self.remove(topic, conn)
    }

    /// Removes every subscription of a connection (however its socket ended);
    /// returns the leave events.
    pub fn unsubscribe_all(&mut self, conn: u64) -> Vec<PresenceEvent> {
        let topics = self.conn_topics.remove(&conn).unwrap_or_default();
        topics.iter().filter_map(|t| self.remove(t, conn)).collect()
    }

    fn remove(&mut self, topic: &str, conn: u64) -> Option<PresenceEvent> {
        let t = self.topics.get_mut(topic)?;
        let sub = t.subs.remove(&conn)?;
        t.kinds[sub.kind.index()] -= 1;
        self.count -= 1;
        if let Some(pos) = t.targets.iter().position(|(r, _)| *r == sub.relay) {
            let list = Arc::make_mut(&mut t.targets[pos].1);
            list.retain(|(c, _)| *c != conn);
            if list.is_empty() {
                t.targets.swap_remove(pos);
            }
        }
        let mut ev = None;
        if let Some(member_id) = t.member_of_conn.remove(&conn)
            && let Some(m) = t.members.get_mut(&member_id)
        {
            m.connections -= 1;
            if m.connections == 0 {
                let m = t.members.remove(&member_id).expect("present");
                ev = Some(presence_event("leave", topic, &m));
            }
        }
        if t.subs.is_empty() {
            self.topics.remove(topic);
            self.routes.set(topic, None);
        } else {
            self.routes.set(topic, Some(t));
        }
        ev
    }

    /// Where a message on `topic` goes: per relay connection lists, and which
    /// frame kinds are needed. None when nobody listens here.
    pub fn targets(&self, topic: &str) -> Option<(&Targets, [bool; 3])> {
        let t = self.topics.get(topic)?;
        Some((&t.targets, t.kinds.map(|n| n > 0)))
    }

    /// Number of live subscriptions.
    pub fn subscriptions(&self) -> usize {
        self.count
    }

    /// Number of topics with at least one local subscriber.
    pub fn topic_count(&self) -> usize {
        self.topics.len()
    }

    /// The live topics, sorted.
    pub fn list(&self) -> Vec<TopicInfo> {
        let mut v: Vec<TopicInfo> = self
            .topics
            .iter()
            .map(|(k, t)| TopicInfo {
                topic: k.clone(),
                subscribers: t.subs.len(),
                members: t.members.len(),
            })
            .collect();
        v.sort_by(|a, b| a.topic.cmp(&b.topic));
        v
    }

    /// The presence members of a topic, sorted by id.
    pub fn presence(&self, topic: &str) -> Vec<Member> {
        let mut v: Vec<Member> = self
            .topics
            .get(topic)
            .map(|t| t.members.values().cloned().collect())
            .unwrap_or_default();
        v.sort_by(|a, b| a.member_id.cmp(&b.member_id));
        v
    }
}

impl TopicTable {
    /// The namespace is gone: closes its sockets with 4004 rather than
    /// leaving them mute. Their sessions then unsubscribe as usual, which
    /// keeps the subscriber gauge right.
    pub fn close_all_sockets(&self) {
        self.routes.clear();
        for t in self.topics.values() {
            self.service
                .close_all(&t.targets, super::protocol::close::NAMESPACE_GONE);
        }
    }
}

impl Drop for TopicTable {
    /// The namespace's supervisor ended for good: same as a deleted namespace.
    fn drop(&mut self) {
        self.close_all_sockets();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub(relay: u32, conn: u64) -> SubscriberRef {
        SubscriberRef {
            relay,
            conn,
            kind: FrameKind::Full,
        }
    }

    /// Subscribers are grouped per relay and removed cleanly; empty topics vanish.
    #[test]
    fn subscribe_and_unsubscribe() {
        let mut t = TopicTable::default();
        t.subscribe("a", sub(0, 1), None);
        t.subscribe("a", sub(1, 2), None);
        t.subscribe("a", sub(0, 3), None);
        t.subscribe("a", sub(0, 3), None);
        t.subscribe("b", sub(0, 1), None);
        let (targets, kinds) = t.targets("a").unwrap();
        assert_eq!(kinds, [false, true, false]);
        let n: usize = targets.iter().map(|(_, l)| l.len()).sum();
        assert_eq!(n, 3);
        assert_eq!(t.subscriptions(), 4);
        t.unsubscribe_all(1);
        assert_eq!(t.subscriptions(), 2);
        assert!(t.targets("b").is_none());
        t.unsubscribe("a", 2);
        t.unsubscribe("a", 3);
        assert!(t.list().is_empty());
    }

    /// The mesh's copy of the routes follows every change of the table,
    /// from the moment it is shared (with what was there before).
    #[test]
    fn shared_routes_follow_the_table() {
        let mut t = TopicTable::default();
        t.subscribe("a", sub(0, 1), None);
        let routes = MeshRoutes::default();
        t.share_routes(routes.clone());
        assert_eq!(routes.get("a").unwrap().targets[0].1.len(), 1);
        t.subscribe("a", sub(1, 2), None);
        t.subscribe("b", sub(0, 2), None);
        let a = routes.get("a").unwrap();
        assert_eq!(a.targets.len(), 2);
        assert_eq!(a.kinds, [false, true, false]);
        assert_eq!(routes.len(), 2);
        t.unsubscribe_all(2);
        assert_eq!(routes.get("a").unwrap().targets.len(), 1);
        assert!(routes.get("b").is_none());
        t.unsubscribe("a", 1);
        assert!(routes.is_empty());
        t.subscribe("c", sub(0, 3), None);
        t.close_all_sockets();
        assert!(routes.is_empty());
    }

    /// A member joins once, stays while any of its connections remains, then leaves.
    #[test]
    fn presence_refcounts_connections() {
        let mut t = TopicTable::default();
        let j = t.subscribe("a", sub(0, 1), Some(("m".into(), Some("{\"n\":1}".into()))));
        assert!(j.is_some());
        assert!(
            t.subscribe("a", sub(0, 2), Some(("m".into(), None)))
                .is_none()
        );
        assert_eq!(t.presence("a")[0].connections, 2);
        assert_eq!(t.presence("a")[0].meta, Some(serde_json::json!({"n": 1})));
        assert!(t.unsubscribe_all(1).is_empty());
        let ev = t.unsubscribe_all(2);
        assert_eq!(ev.len(), 1);
        let v: serde_json::Value = serde_json::from_slice(&ev[0].data).unwrap();
        assert_eq!(v["event"], "leave");
        assert_eq!(v["member_id"], "m");
        assert!(t.presence("a").is_empty());
    }
}
