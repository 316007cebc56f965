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

/// What a run of pushes did besides releasing ([`Reorder::push_run`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Messages dropped: their sequence number was already waiting.
    pub duplicates: u64,
    /// Messages dropped: their sequence number (or epoch) was already passed.
    pub stale: u64,
    /// Sequence numbers given up on because the buffer overflowed (or a new
    /// epoch replaced the stream).
    pub gaps_skipped: u64,
}

/// One message into its stream: released (with what it unblocked) into
/// `ready`, held back, or dropped (returned).
#[allow(clippy::too_many_arguments)]
fn push_one<T>(
    stream: &mut Stream<T>,
    capacity: usize,
    epoch: u64,
    seq: u64,
    item: T,
    weight: usize,
    now: Instant,
    ready: &mut Vec<T>,
    out: &mut Run,
) -> Option<Dropped> {
    if epoch < stream.epoch {
        return Some(Dropped::Stale);
    }
    if epoch > stream.epoch {
        // The sender started a new counter: what the old one still held
        // back is released in order, then the new stream begins.
        while !stream.pending.is_empty() {
            out.gaps_skipped += stream.skip_gap(ready);
        }
        *stream = Stream::new(epoch, seq, now);
    }
    stream.last_seen = now;
    if seq < stream.next {
        return Some(Dropped::Stale);
    }
    if seq == stream.next {
        ready.push(item);
        stream.next += 1;
        stream.drain_ready(ready);
        // What is still pending now waits on a new gap.
        stream.gap_since = (!stream.pending.is_empty()).then_some(now);
        return None;
    }
    if stream.pending.contains_key(&seq) {
        return Some(Dropped::Duplicate);
    }
    stream.pending.insert(seq, (item, weight));
    stream.weight += weight;
    stream.gap_since.get_or_insert(now);
    while stream.weight > capacity {
        out.gaps_skipped += stream.skip_gap(ready);
        stream.gap_since = (!stream.pending.is_empty()).then_some(now);
    }
    None
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
        let mut ready = Vec::new();
        let run = self.push_run(key, [(epoch, seq, item, weight)], now, &mut ready);
        let dropped = if run.stale > 0 {
            Some(Dropped::Stale)
        } else if run.duplicates > 0 {
            Some(Dropped::Duplicate)
        } else {
            None
        };
        Pushed {
            ready,
            dropped,
            gaps_skipped: run.gaps_skipped,
        }
    }

    /// Takes a run of messages of one stream (`key`), each `(epoch, seq,
    /// item, weight)`, in the order given, as [`Reorder::push_weighted`]
    /// would one by one, with one lookup of the stream for the run (the mesh
    /// receives a burst of one topic as runs). What is released is appended
    /// to `ready`, in order.
    pub fn push_run(
        &mut self,
        key: K,
        run: impl IntoIterator<Item = (u64, u64, T, usize)>,
        now: Instant,
        ready: &mut Vec<T>,
    ) -> Run {
        let mut out = Run::default();
        let mut run = run.into_iter().peekable();
        let Some(&(epoch, seq, _, _)) = run.peek() else {
            return out;
        };
        let capacity = self.capacity;
        let stream = self
            .streams
            .entry(key)
            .or_insert_with(|| Stream::new(epoch, seq, now));
        for (epoch, seq, item, weight) in run {
            match push_one(
                stream, capacity, epoch, seq, item, weight, now, ready, &mut out,
            ) {
                Some(Dropped::Stale) => out.stale += 1,
                Some(Dropped::Duplicate) => out.duplicates += 1,
                None => {}
            }
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

    /// A run pushed at once releases and drops exactly what the same
    /// messages pushed one by one do (order, early, duplicate, stale, a new
    /// epoch, an overflowing buffer), whatever the run.
    #[test]
    fn a_run_is_the_same_as_its_messages_one_by_one() {
        let t = Instant::now();
        let check = |msgs: &[(u64, u64)]| {
            let mut one = Reorder::<&str, (u64, u64)>::new(4, GAP);
            let mut one_ready = Vec::new();
            let (mut dup, mut stale, mut gaps) = (0, 0, 0);
            for &(e, q) in msgs {
                let p = one.push("a", e, q, (e, q), t);
                one_ready.extend(p.ready);
                match p.dropped {
                    Some(Dropped::Duplicate) => dup += 1,
                    Some(Dropped::Stale) => stale += 1,
                    None => {}
                }
                gaps += p.gaps_skipped;
            }
            let mut run = Reorder::<&str, (u64, u64)>::new(4, GAP);
            let mut run_ready = Vec::new();
            let r = run.push_run(
                "a",
                msgs.iter().map(|&(e, q)| (e, q, (e, q), 1)),
                t,
                &mut run_ready,
            );
            assert_eq!(run_ready, one_ready, "{msgs:?}");
            assert_eq!(
                (r.duplicates, r.stale, r.gaps_skipped),
                (dup, stale, gaps),
                "{msgs:?}"
            );
            assert_eq!(run.pending(), one.pending());
        };
        check(&[
            (1, 1),
            (1, 3),
            (1, 3),
            (1, 2),
            (1, 1),
            (1, 9),
            (1, 10),
            (1, 11),
            (1, 12),
            (1, 13),
            (2, 1),
            (1, 14),
        ]);
        check(&[]);
        proptest::proptest!(|(msgs: Vec<(u8, u8)>)| {
            let msgs: Vec<(u64, u64)> = msgs.iter().map(|&(e, q)| (u64::from(e % 3), u64::from(q % 16))).collect();
            check(&msgs);
        });
    }
}
