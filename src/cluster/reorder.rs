//! The receiver's ordering of mesh messages: per stream (origin node,
//! namespace, topic) messages are released in sequence order. One that comes
//! early waits in a bounded buffer (bounded by weight: a count, or bytes)
//! until the gap before it fills. A stream also knows the highest sequence
//! number its sender announced (its head), so a lost tail is a gap too. The
//! mesh asks the sender for every gap that waited long enough
//! ([`Reorder::wants`]) and skips one only when told to (the sender is gone,
//! or no longer holds it) or when the buffer is full. Duplicates and
//! sequence numbers already passed are dropped.
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
    /// Sequence numbers given up on because a new epoch replaced the stream.
    pub gaps_restarted: u64,
}

/// A gap to ask the sender for: sequence numbers `from..=to` of `key`'s
/// stream in `epoch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Want<K> {
    /// The stream.
    pub key: K,
    /// Its epoch.
    pub epoch: u64,
    /// The first missing sequence number.
    pub from: u64,
    /// The last one of this gap.
    pub to: u64,
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
    /// The highest sequence number the sender announced (0: none); a head
    /// at or past `next` is a gap even with nothing pending.
    head: u64,
    /// When the current gap started waiting.
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
            head: 0,
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

    /// Whether a sequence number is missing: something pending, or a head
    /// announced past what was released.
    fn has_gap(&self) -> bool {
        !self.pending.is_empty() || self.head >= self.next
    }

    /// The first gap: `next` up to the lowest pending message, or up to
    /// the head when nothing is pending.
    fn first_gap(&self) -> Option<(u64, u64)> {
        match self.pending.first_key_value() {
            Some((&first, _)) if first > self.next => Some((self.next, first - 1)),
            Some(_) => None,
            None => (self.head >= self.next).then_some((self.next, self.head)),
        }
    }

    /// Gives up on the first gap; returns how many sequence numbers were
    /// skipped.
    fn skip_gap(&mut self, ready: &mut Vec<T>) -> u64 {
        let Some((from, to)) = self.first_gap() else {
            return 0;
        };
        self.next = to + 1;
        self.drain_ready(ready);
        to + 1 - from
    }

    /// Gives up on every gap (the sender is gone): releases all pending.
    fn skip_all(&mut self, ready: &mut Vec<T>) -> u64 {
        let mut skipped = 0;
        while self.has_gap() {
            skipped += self.skip_gap(ready);
        }
        self.gap_since = None;
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
    /// Sequence numbers given up on because the buffer overflowed.
    pub gaps_skipped: u64,
    /// Sequence numbers given up on because a new epoch replaced the stream
    /// (the sender restarted its counter).
    pub gaps_restarted: u64,
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
        out.gaps_restarted += stream.skip_all(ready);
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
        // What is still missing now waits on a new gap.
        stream.gap_since = stream.has_gap().then_some(now);
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
        stream.gap_since = stream.has_gap().then_some(now);
    }
    None
}

/// Per-stream reorder buffers.
pub struct Reorder<K, T> {
    /// One ordering state per (origin, namespace, topic) key.
    streams: HashMap<K, Stream<T>>,
    /// The weight one stream may hold back.
    capacity: usize,
}

impl<K: Hash + Eq + Clone, T> Reorder<K, T> {
    /// Buffers holding back at most `capacity` weight per stream (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            streams: HashMap::new(),
            capacity: capacity.max(1),
        }
    }

    /// Whether `key`'s stream is tracked.
    pub fn has(&self, key: &K) -> bool {
        self.streams.contains_key(key)
    }

    /// Starts `key`'s stream at `next` in `epoch` unless it is tracked (a
    /// stream the receiver saw begin: what came before its first message
    /// is a gap, not history).
    pub fn start(&mut self, key: K, epoch: u64, next: u64, now: Instant) {
        self.streams
            .entry(key)
            .or_insert_with(|| Stream::new(epoch, next.max(1), now));
    }

    /// Takes the sender's announcement that `key`'s stream reached `last`
    /// in `epoch`: anything up to it not yet released is a gap. An unknown
    /// stream is ignored unless `start` (it then begins at 1); another
    /// epoch is ignored (its messages decide).
    pub fn note_head(&mut self, key: K, epoch: u64, last: u64, start: bool, now: Instant) {
        if start {
            self.start(key.clone(), epoch, 1, now);
        }
        let Some(stream) = self.streams.get_mut(&key) else {
            return;
        };
        if stream.epoch != epoch || last < stream.next || last <= stream.head {
            return;
        }
        stream.head = last;
        stream.last_seen = now;
        stream.gap_since.get_or_insert(now);
    }

    /// The first gap of every stream whose gap has waited `after` (a gap
    /// ending at the head with nothing pending: `tail_after`), at most
    /// `max_len` sequence numbers each, for streams `pick` chooses.
    pub fn wants(
        &self,
        now: Instant,
        after: Duration,
        tail_after: Duration,
        max_len: u64,
        mut pick: impl FnMut(&K) -> bool,
    ) -> Vec<Want<K>> {
        let mut out = Vec::new();
        for (key, s) in &self.streams {
            let Some(since) = s.gap_since else { continue };
            let Some((from, to)) = s.first_gap() else {
                continue;
            };
            let wait = if s.pending.is_empty() {
                tail_after
            } else {
                after
            };
            if now.duration_since(since) < wait || !pick(key) {
                continue;
            }
            out.push(Want {
                key: key.clone(),
                epoch: s.epoch,
                from,
                to: to.min(from.saturating_add(max_len.max(1) - 1)),
            });
        }
        out
    }

    /// Gives up on `key`'s sequence numbers up to `to` in `epoch` (the
    /// sender no longer holds them), releasing what waited behind them.
    /// Returns how many were skipped.
    pub fn skip_through(
        &mut self,
        key: &K,
        epoch: u64,
        to: u64,
        now: Instant,
        ready: &mut Vec<T>,
    ) -> u64 {
        let Some(s) = self.streams.get_mut(key) else {
            return 0;
        };
        if s.epoch != epoch || to < s.next {
            return 0;
        }
        let mut skipped = 0;
        while s.next <= to {
            match s.pending.first_key_value() {
                Some((&first, _)) if first <= to => {
                    skipped += first - s.next;
                    s.next = first;
                    s.drain_ready(ready);
                }
                _ => {
                    skipped += to + 1 - s.next;
                    s.next = to + 1;
                    s.drain_ready(ready);
                }
            }
        }
        s.gap_since = s.has_gap().then_some(now);
        skipped
    }

    /// Gives up on every gap of the streams `pick` chooses (their sender is
    /// gone), releasing everything they held back. Returns how many
    /// sequence numbers were skipped.
    pub fn skip_all(&mut self, mut pick: impl FnMut(&K) -> bool, ready: &mut Vec<T>) -> u64 {
        let mut skipped = 0;
        for (key, s) in self.streams.iter_mut() {
            if pick(key) && s.has_gap() {
                skipped += s.skip_all(ready);
            }
        }
        skipped
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
            gaps_restarted: run.gaps_restarted,
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

    /// Forgets streams idle for `idle` with no gap (a gap stays until it
    /// is filled or skipped).
    pub fn forget_idle(&mut self, now: Instant, idle: Duration) {
        self.streams
            .retain(|_, s| s.has_gap() || now.duration_since(s.last_seen) < idle);
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
        Reorder::new(8)
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

    /// A gap is asked for once it waited `after` (a lost tail, announced by
    /// the head only, once it waited `tail_after`), and never skipped by
    /// waiting: what fills it is released in order however late.
    #[test]
    fn gaps_are_wanted_not_skipped() {
        let mut r = buf();
        let t = Instant::now();
        let tail = Duration::from_secs(1);
        r.push("a", 1, 1, 1, t);
        r.push("a", 1, 4, 4, t);
        r.push("a", 1, 5, 5, t);
        let all = |_: &&str| true;
        assert!(
            r.wants(t + GAP - Duration::from_millis(1), GAP, tail, 100, all)
                .is_empty()
        );
        let w = r.wants(t + GAP, GAP, tail, 100, all);
        assert_eq!(
            w,
            vec![Want {
                key: "a",
                epoch: 1,
                from: 2,
                to: 3
            }]
        );
        assert_eq!(r.wants(t + GAP, GAP, tail, 1, all)[0].to, 2);
        assert!(r.wants(t + GAP, GAP, tail, 100, |_| false).is_empty());
        r.forget_idle(t + IDLE * 2, IDLE);
        assert_eq!(r.pending(), 2, "a gap is never forgotten");
        assert!(r.push("a", 1, 2, 2, t).ready == vec![2]);
        assert_eq!(r.push("a", 1, 3, 3, t).ready, vec![3, 4, 5]);
        // The head says 7 was sent: 6 and 7 are a gap with nothing pending.
        r.note_head("a", 1, 7, false, t);
        assert!(r.wants(t + GAP, GAP, tail * 10, 100, all).is_empty());
        let w = r.wants(t + tail * 10, GAP, tail * 10, 100, all);
        assert_eq!((w[0].from, w[0].to), (6, 7));
        // A head of another epoch, or of an unknown stream, is ignored
        // unless the stream is to start.
        r.note_head("a", 2, 9, false, t);
        r.note_head("b", 1, 3, false, t);
        assert!(!r.has(&"b"));
        r.note_head("c", 1, 2, true, t);
        let w = r.wants(t + tail * 10, GAP, tail * 10, 100, |k| *k == "c");
        assert_eq!((w[0].from, w[0].to), (1, 2));
        assert_eq!(r.push("a", 1, 6, 6, t).ready, vec![6]);
        assert_eq!(r.push("a", 1, 7, 7, t).ready, vec![7]);
        assert!(
            r.wants(t + tail * 10, GAP, tail, 100, |k| *k == "a")
                .is_empty()
        );
    }

    /// Skipping through a sequence number (the sender no longer holds it)
    /// releases what waited behind it and counts what was skipped; skipping
    /// all (the sender is gone) releases everything and counts every gap.
    #[test]
    fn gaps_are_skipped_when_told() {
        let mut r = buf();
        let t = Instant::now();
        r.push("a", 1, 1, 1, t);
        r.push("a", 1, 4, 4, t);
        r.push("a", 1, 6, 6, t);
        let mut ready = Vec::new();
        assert_eq!(
            r.skip_through(&"a", 2, 3, t, &mut ready),
            0,
            "another epoch"
        );
        assert_eq!(r.skip_through(&"a", 1, 3, t, &mut ready), 2);
        assert_eq!(ready, vec![4]);
        assert_eq!(r.push("a", 1, 2, 2, t).dropped, Some(Dropped::Stale));
        r.note_head("a", 1, 8, false, t);
        r.push("b", 1, 1, 1, t);
        r.push("b", 1, 3, 3, t);
        let mut ready = Vec::new();
        assert_eq!(r.skip_all(|k| *k == "a", &mut ready), 3, "5, 7 and 8");
        assert_eq!(ready, vec![6]);
        assert_eq!(r.pending(), 1, "b is another sender's");
        assert_eq!(r.push("a", 1, 9, 9, t).ready, vec![9]);
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
        assert_eq!(p.gaps_restarted, 1);
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
        r.forget_idle(t + IDLE, IDLE);
        assert_eq!(r.streams(), 1);
    }

    /// A run pushed at once releases and drops exactly what the same
    /// messages pushed one by one do (order, early, duplicate, stale, a new
    /// epoch, an overflowing buffer), whatever the run.
    #[test]
    fn a_run_is_the_same_as_its_messages_one_by_one() {
        let t = Instant::now();
        let check = |msgs: &[(u64, u64)]| {
            let mut one = Reorder::<&str, (u64, u64)>::new(4);
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
                gaps += p.gaps_skipped + p.gaps_restarted;
            }
            let mut run = Reorder::<&str, (u64, u64)>::new(4);
            let mut run_ready = Vec::new();
            let r = run.push_run(
                "a",
                msgs.iter().map(|&(e, q)| (e, q, (e, q), 1)),
                t,
                &mut run_ready,
            );
            assert_eq!(run_ready, one_ready, "{msgs:?}");
            assert_eq!(
                (r.duplicates, r.stale, r.gaps_skipped + r.gaps_restarted),
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
