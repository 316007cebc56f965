//! The queues of publications whose pub/sub triggers a non-member hands to
//! a member of their namespace (docs/cluster.md, "Placement"): one queue per
//! namespace, in publish order, bounded, with at most one sender at a time.
//! The sending itself is the HTTP layer's (`http/member_call.rs`).

use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::HashMap;

/// Publications waiting for a namespace's members, at most this many per
/// namespace: past it a publication fires no trigger (the caller counts it).
pub const FIRE_QUEUE_MAX: usize = 10_000;

/// What [`FireQueues::push`] did with a publication.
#[derive(Debug, PartialEq, Eq)]
pub enum Queued {
    /// Queued; a sender is already at work on the namespace's queue.
    Behind,
    /// Queued; the caller must start the namespace's sender.
    StartSender,
    /// The queue is full: the publication was not queued.
    Full,
}

#[derive(Default)]
struct FireQueue {
    pending: Vec<(String, Bytes)>,
    sending: bool,
}

/// Every namespace's queue.
#[derive(Default)]
pub struct FireQueues(Mutex<HashMap<String, FireQueue>>);

impl FireQueues {
    /// Queues (topic, data) for `ns`.
    pub fn push(&self, ns: &str, topic: String, data: Bytes) -> Queued {
        let mut map = self.0.lock();
        let q = map.entry(ns.to_string()).or_default();
        if q.pending.len() >= FIRE_QUEUE_MAX {
            return Queued::Full;
        }
        q.pending.push((topic, data));
        if std::mem::replace(&mut q.sending, true) {
            Queued::Behind
        } else {
            Queued::StartSender
        }
    }

    /// The sender's next batch of at most `max` publications of `ns`, in
    /// order; None when the queue is empty, and the sender then stops (a
    /// later push starts a new one).
    pub fn next_batch(&self, ns: &str, max: usize) -> Option<Vec<(String, Bytes)>> {
        let mut map = self.0.lock();
        let q = map.get_mut(ns)?;
        if q.pending.is_empty() {
            map.remove(ns);
            return None;
        }
        let n = q.pending.len().min(max);
        Some(q.pending.drain(..n).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first push starts a sender, later ones queue behind it; batches
    /// come in order; an empty queue stops the sender, and the next push
    /// starts one again; a full queue refuses.
    #[test]
    fn one_sender_in_order_and_bounded() {
        let q = FireQueues::default();
        assert_eq!(q.push("ns", "a".into(), Bytes::new()), Queued::StartSender);
        assert_eq!(q.push("ns", "b".into(), Bytes::new()), Queued::Behind);
        assert_eq!(
            q.push("other", "c".into(), Bytes::new()),
            Queued::StartSender
        );
        let b = q.next_batch("ns", 1).unwrap();
        assert_eq!(b[0].0, "a");
        assert_eq!(q.next_batch("ns", 10).unwrap()[0].0, "b");
        assert!(q.next_batch("ns", 10).is_none());
        assert_eq!(q.push("ns", "d".into(), Bytes::new()), Queued::StartSender);
        for i in 1..FIRE_QUEUE_MAX {
            assert_eq!(q.push("ns", i.to_string(), Bytes::new()), Queued::Behind);
        }
        assert_eq!(q.push("ns", "over".into(), Bytes::new()), Queued::Full);
    }
}
