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
/// Bytes of publication data waiting per namespace, at most: past it too a
/// publication fires no trigger.
pub const FIRE_QUEUE_BYTES: usize = 64 << 20;
/// A batch's bytes as sent (base64 data, topic and framing), at most; a
/// publication larger than this alone travels in a batch of its own. The
/// member's fire route reads a body of up to [`body_limit`].
pub const FIRE_BATCH_BYTES: usize = 4 << 20;
/// The most bytes the member's fire route reads: a full batch, or one
/// publication of the largest frame a socket takes (`[pubsub]
/// max_frame_bytes`) as sent, with room for the framing.
pub fn body_limit(max_frame_bytes: usize) -> usize {
    FIRE_BATCH_BYTES.max(48 + max_frame_bytes.div_ceil(3) * 4 + 1024) + (64 << 10)
}

/// The bytes one publication takes in a batch as sent.
pub fn sent_bytes(topic: &str, data: &[u8]) -> usize {
    data.len().div_ceil(3) * 4 + topic.len() + 48
}

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
    pending: std::collections::VecDeque<(String, Bytes)>,
    /// The data bytes in `pending`.
    bytes: usize,
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
        if q.pending.len() >= FIRE_QUEUE_MAX || q.bytes + data.len() > FIRE_QUEUE_BYTES {
            return Queued::Full;
        }
        q.bytes += data.len();
        q.pending.push_back((topic, data));
        if std::mem::replace(&mut q.sending, true) {
            Queued::Behind
        } else {
            Queued::StartSender
        }
    }

    /// The sender's next batch of `ns`, in order: at most `max`
    /// publications and [`FIRE_BATCH_BYTES`] as sent, or one larger
    /// publication alone; None when the queue is empty, and the sender then
    /// stops (a later push starts a new one).
    pub fn next_batch(&self, ns: &str, max: usize) -> Option<Vec<(String, Bytes)>> {
        let mut map = self.0.lock();
        let q = map.get_mut(ns)?;
        if q.pending.is_empty() {
            map.remove(ns);
            return None;
        }
        let mut batch = Vec::new();
        let mut size = 0;
        while let Some((topic, data)) = q.pending.front() {
            let n = sent_bytes(topic, data);
            if batch.len() >= max || (!batch.is_empty() && size + n > FIRE_BATCH_BYTES) {
                break;
            }
            size += n;
            if let Some((topic, data)) = q.pending.pop_front() {
                q.bytes -= data.len();
                batch.push((topic, data));
            }
        }
        Some(batch)
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

    /// A batch stops before its bytes as sent pass [`FIRE_BATCH_BYTES`]; a
    /// publication larger than that travels alone; the queue is bounded in
    /// bytes too.
    #[test]
    fn batches_are_bounded_in_bytes() {
        let q = FireQueues::default();
        let big = Bytes::from(vec![0u8; 3 << 20]);
        let large = Bytes::from(vec![0u8; 5 << 20]);
        q.push("ns", "a".into(), big.clone());
        q.push("ns", "b".into(), big.clone());
        q.push("ns", "c".into(), Bytes::from_static(b"x"));
        q.push("ns", "d".into(), large);
        q.push("ns", "e".into(), Bytes::from_static(b"y"));
        let topics = |b: Vec<(String, Bytes)>| b.into_iter().map(|(t, _)| t).collect::<Vec<_>>();
        // 3 MiB is 4 MiB in base64: alone.
        assert_eq!(topics(q.next_batch("ns", 500).unwrap()), ["a"]);
        assert_eq!(topics(q.next_batch("ns", 500).unwrap()), ["b"]);
        assert_eq!(topics(q.next_batch("ns", 500).unwrap()), ["c"]);
        assert_eq!(topics(q.next_batch("ns", 500).unwrap()), ["d"]);
        assert_eq!(topics(q.next_batch("ns", 500).unwrap()), ["e"]);
        assert!(q.next_batch("ns", 500).is_none());
        // 64 MiB of data at most waits.
        for _ in 0..21 {
            assert_ne!(q.push("full", "t".into(), big.clone()), Queued::Full);
        }
        assert_eq!(q.push("full", "t".into(), big), Queued::Full);
        assert_ne!(
            q.push("full", "t".into(), Bytes::from_static(b"z")),
            Queued::Full
        );
    }
}
