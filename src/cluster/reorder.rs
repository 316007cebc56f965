//! The receiver's ordering of mesh messages: per stream (origin node,
//! namespace, topic) messages are released in sequence order. One that comes
//! early waits in a bounded buffer (bounded by weight: a count, or bytes)
//! until the gap before it fills; a gap
//! not filled within the gap timeout (or when the buffer is full) is skipped
//! and counted. Duplicates and sequence numbers already passed are dropped.
//!
//! A stream is one incarnation of a sender's counter, named by its epoch: a
//! sender that restarts, or forgets an idle topic's counter, starts a new
//! epoch at sequence 1, and a higher epoch replaces the stream.
//!
//! Time is passed in (`now`), so tests need no sleeps.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Why a message was not released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// The same sequence number is already waiting in the buffer.
    Duplicate,
    /// Its sequence number (or epoch) was already passed.
    Stale,
}

impl Dropped {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Dropped::Duplicate => "duplicate",
            Dropped::Stale => "stale",
        }
    }
}

/// What one push did.
#[derive(Debug)]
pub struct Pushed<T> {
    /// Messages now ready, in order (the pushed one and any it unblocked).
    pub ready: Vec<T>,
    /// Set when the pushed message was dropped.
    pub dropped: Option<Dropped>,
    /// Sequence numbers given up on because the buffer overflowed.
    pub gaps_skipped: u64,
}

/// The ordering state of one stream.
struct Stream<T> {
    /// The sender's incarnation; a higher one replaces this stream.
    epoch: u64,
    /// The next sequence number to release.
    next: u64,
    /// Held-back messages with their weights.
    pending: BTreeMap<u64, (T, usize)>,
    /// The sum of the pending weights.
    weight: usize,
    /// When the current gap (pending non-empty) started waiting.
    gap_since: Option<Instant>,
    /// When a message of the stream last came: idle streams are forgotten.
    last_seen: Instant,
}

impl<T> Stream<T> {
    fn new(epoch: u64, next: u64, now: Instant) -> Self {
        Self {
            epoch,
            next,
            pending: BTreeMap::new(),
            weight: 0,
            gap_since: None,
            last_seen: now,
        }
    }

    /// Releases the run of pending messages that starts at `next`.
    fn drain_ready(&mut self, ready: &mut Vec<T>) {
        while let Some((item, w)) = self.pending.remove(&self.next) {
            self.weight -= w;
            ready.push(item);
            self.next += 1;
        }
    }

    /// Gives up on the gap before the lowest pending message; returns how
    /// many sequence numbers were skipped.
    fn skip_gap(&mut self, ready: &mut Vec<T>) -> u64 {
        let Some((&first, _)) = self.pending.first_key_value() else {
            return 0;
        };
        let skipped = first.saturating_sub(self.next);
        self.next = first;
        self.drain_ready(ready);
        skipped
    }
}

/// Per-stream reorder buffers.
pub struct Reorder<K, T> {
    /// One ordering state per (origin, namespace, topic) key.
    streams: HashMap<K, Stream<T>>,
    /// The weight one stream may hold back.
    capacity: usize,
    /// How long a gap may wait to be filled before it is skipped.
    gap_timeout: Duration,
}

impl<K: Hash + Eq + Clone, T> Reorder<K, T> {
    /// Buffers holding back at most `capacity` weight per stream (at least 1).
    pub fn new(capacity: usize, gap_timeout: Duration) -> Self {
        Self {
            streams: HashMap::new(),
            capacity: capacity.max(1),
            gap_timeout,
        }
    }

    /// Takes one message of `key`'s stream, of weight 1.
    pub fn push(&mut self, key: K, epoch: u64, seq: u64, item: T, now: Instant) -> Pushed<T> {
        self.push_weighted(key, epoch, seq, item, 1, now)
    }

    /// Takes one message of `key`'s stream, of weight `weight` (held-back
    /// weight per stream is bounded by the capacity). The first message seen
    /// of a stream starts it (a node that joins late does not wait for what
    /// it missed).
    pub fn push_weighted(
        &mut self,
        key: K,
        epoch: u64,
        seq: u64,
        item: T,
        weight: usize,
        now: Instant,
    ) -> Pushed<T> {
        let mut out = Pushed {
            ready: Vec::new(),
            dropped: None,
            gaps_skipped: 0,
        };
        let stream = self
            .streams
            .entry(key)
            .or_insert_with(|| Stream::new(epoch, seq, now));
        if epoch < stream.epoch {
            out.dropped = Some(Dropped::Stale);
            return out;
        }
        if epoch > stream.epoch {
            // The sender started a new counter: what the old one still held
            // back is released in order, then the new stream begins.
            while !stream.pending.is_empty() {
                out.gaps_skipped += stream.skip_gap(&mut out.ready);
            }
            *stream = Stream::new(epoch, seq, now);
        }
        stream.last_seen = now;
        if seq < stream.next {
            out.dropped = Some(Dropped::Stale);
            return out;
        }
        if seq == stream.next {
            out.ready.push(item);
            stream.next += 1;
            stream.drain_ready(&mut out.ready);
            // What is still pending now waits on a new gap.
            stream.gap_since = (!stream.pending.is_empty()).then_some(now);
            return out;
        }
        if stream.pending.contains_key(&seq) {
            out.dropped = Some(Dropped::Duplicate);
            return out;
        }
        stream.pending.insert(seq, (item, weight));
        stream.weight += weight;
        stream.gap_since.get_or_insert(now);
        while stream.weight > self.capacity {
            out.gaps_skipped += stream.skip_gap(&mut out.ready);
            stream.gap_since = (!stream.pending.is_empty()).then_some(now);
        }
        out
    }

    /// Skips every gap that has waited `gap_timeout`, releasing what it held
    /// back; forgets streams idle for `idle` with nothing pending. Returns
    /// the released messages and how many sequence numbers were skipped.
    pub fn expire(&mut self, now: Instant, idle: Duration) -> (Vec<T>, u64) {
        let mut ready = Vec::new();
        let mut skipped = 0;
        for stream in self.streams.values_mut() {
            if let Some(since) = stream.gap_since
                && now.duration_since(since) >= self.gap_timeout
            {
                skipped += stream.skip_gap(&mut ready);
                stream.gap_since = (!stream.pending.is_empty()).then_some(now);
            }
        }
        self.streams
            .retain(|_, s| !s.pending.is_empty() || now.duration_since(s.last_seen) < idle);
        (ready, skipped)
    }

    /// Streams tracked now.
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// Messages held back in all streams.
    pub fn pending(&self) -> usize {
        self.streams.values().map(|s| s.pending.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GAP: Duration = Duration::from_secs(2);
    const IDLE: Duration = Duration::from_secs(600);

    fn buf() -> Reorder<&'static str, u64> {
        Reorder::new(8, GAP)
    }

    /// In-order messages are released at once, one by one.
    #[test]
    fn in_order_messages_pass_through() {
        let mut r = buf();
        let t = Instant::now();
        for seq in 1..=5 {
            let p = r.push("a", 1, seq, seq, t);
            assert_eq!(p.ready, vec![seq]);
            assert_eq!(p.dropped, None);
        }
        assert_eq!(r.pending(), 0);
    }

    /// A message that comes early waits until the gap before it fills, then
    /// both are released in order.
    #[test]
    fn out_of_order_waits_for_the_gap() {
        let mut r = buf();
        let t = Instant::now();
        assert_eq!(r.push("a", 1, 1, 1, t).ready, vec![1]);
        let p = r.push("a", 1, 3, 3, t);
        assert!(p.ready.is_empty());
        assert_eq!(r.pending(), 1);
        let p = r.push("a", 1, 4, 4, t);
        assert!(p.ready.is_empty());
        assert_eq!(r.push("a", 1, 2, 2, t).ready, vec![2, 3, 4]);
        assert_eq!(r.pending(), 0);
    }

    /// A repeated message is dropped, whether it is waiting or already released.
    #[test]
    fn duplicates_are_dropped() {
        let mut r = buf();
        let t = Instant::now();
        r.push("a", 1, 1, 1, t);
        r.push("a", 1, 3, 3, t);
        let p = r.push("a", 1, 3, 3, t);
        assert_eq!(p.dropped, Some(Dropped::Duplicate));
        let p = r.push("a", 1, 1, 1, t);
        assert_eq!(p.dropped, Some(Dropped::Stale));
        assert!(p.ready.is_empty());
        assert_eq!(r.push("a", 1, 2, 2, t).ready, vec![2, 3]);
    }

    /// A gap not filled within the timeout is skipped and counted; a message
    /// of the gap that comes later is dropped as stale.
    #[test]
    fn gap_times_out_and_is_skipped() {
        let mut r = buf();
        let t = Instant::now();
        r.push("a", 1, 1, 1, t);
        r.push("a", 1, 4, 4, t);
        r.push("a", 1, 5, 5, t);
        let (ready, skipped) = r.expire(t + GAP - Duration::from_millis(1), IDLE);
        assert!(ready.is_empty());
        assert_eq!(skipped, 0);
        let (ready, skipped) = r.expire(t + GAP, IDLE);
        assert_eq!(ready, vec![4, 5]);
        assert_eq!(skipped, 2);
        assert_eq!(r.push("a", 1, 2, 2, t + GAP).dropped, Some(Dropped::Stale));
        assert_eq!(r.push("a", 1, 6, 6, t + GAP).ready, vec![6]);
    }

    /// A second gap waits its own full timeout, counted from when the first
    /// was skipped.
    #[test]
    fn second_gap_gets_its_own_timeout() {
        let mut r = buf();
        let t = Instant::now();
        r.push("a", 1, 1, 1, t);
        r.push("a", 1, 3, 3, t);
        r.push("a", 1, 5, 5, t);
        let (ready, skipped) = r.expire(t + GAP, IDLE);
        assert_eq!((ready, skipped), (vec![3], 1));
        let (ready, _) = r.expire(t + GAP + Duration::from_secs(1), IDLE);
        assert!(ready.is_empty());
        assert_eq!(r.push("a", 1, 4, 4, t + GAP).ready, vec![4, 5]);
    }

    /// A full buffer skips its oldest gap at once rather than grow.
    #[test]
    fn full_buffer_skips_the_gap() {
        let mut r = buf();
        let t = Instant::now();
        r.push("a", 1, 1, 1, t);
        for seq in 3..=10 {
            assert!(r.push("a", 1, seq, seq, t).ready.is_empty());
        }
        assert_eq!(r.pending(), 8);
        let p = r.push("a", 1, 11, 11, t);
        assert_eq!(p.ready, (3..=11).collect::<Vec<_>>());
        assert_eq!(p.gaps_skipped, 1);
        assert_eq!(r.pending(), 0);
    }

    /// Streams are independent: a gap in one holds nothing back in another.
    #[test]
    fn streams_are_independent() {
        let mut r = buf();
        let t = Instant::now();
        r.push("a", 1, 1, 1, t);
        r.push("a", 1, 3, 3, t);
        assert_eq!(r.push("b", 1, 1, 10, t).ready, vec![10]);
        assert_eq!(r.push("b", 1, 2, 20, t).ready, vec![20]);
        assert_eq!(r.pending(), 1);
    }

    /// A sender's new epoch restarts the stream at its sequence; the old
    /// epoch's late messages are stale.
    #[test]
    fn new_epoch_restarts_the_stream() {
        let mut r = buf();
        let t = Instant::now();
        r.push("a", 1, 1, 1, t);
        r.push("a", 1, 2, 2, t);
        r.push("a", 1, 4, 4, t);
        let p = r.push("a", 2, 1, 100, t);
        assert_eq!(p.ready, vec![4, 100]);
        assert_eq!(p.gaps_skipped, 1);
        assert_eq!(r.push("a", 1, 3, 3, t).dropped, Some(Dropped::Stale));
        assert_eq!(r.push("a", 2, 2, 200, t).ready, vec![200]);
    }

    /// A node that joins late starts at the first sequence it sees.
    #[test]
    fn late_joiner_starts_where_it_joins() {
        let mut r = buf();
        let t = Instant::now();
        assert_eq!(r.push("a", 1, 41, 41, t).ready, vec![41]);
        assert_eq!(r.push("a", 1, 42, 42, t).ready, vec![42]);
    }

    /// Idle streams with nothing pending are forgotten; busy ones are kept.
    #[test]
    fn idle_streams_are_forgotten() {
        let mut r = buf();
        let t = Instant::now();
        r.push("a", 1, 1, 1, t);
        r.push("b", 1, 1, 1, t + IDLE);
        r.expire(t + IDLE, IDLE);
        assert_eq!(r.streams(), 1);
    }
}
