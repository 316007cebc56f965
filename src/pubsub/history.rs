//! Per-topic history (docs/pubsub.md "History and recovery"): the
//! publications of topics a namespace's `history` rules name, kept so a
//! subscriber that lost its socket can get what it missed.
//!
//! [`NsHistory`] is owned by the namespace's supervisor, like the topic
//! table: the supervisor handles its mailbox in order, so giving offsets,
//! appending and answering a recovery are one step each and need no lock.
//! The publications are kept in memory (bounded by the rules' sizes and
//! `[pubsub] max_history_bytes_per_namespace`) and written to the store as a
//! write-behind: each append queues its puts and deletes in `pending`; the
//! supervisor writes everything pending in **one** store batch, and the next
//! batch gathers whatever was appended while that write ran. Topics without
//! a rule never come here.
//!
//! Store layout: `hist/<ns>/p/<topic>\0<offset, 8 bytes big-endian>` holds
//! one publication (8 bytes timestamp, then the payload), so a topic's
//! publications scan in offset order; `hist/<ns>/m/<topic>` holds the
//! topic's [`Meta`] (epoch, top offset) and outlives trimmed publications,
//! so offsets keep growing after a sweep and across restarts.

use crate::storage::BatchOp;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};

/// One `history` rule of a namespace (`PUT /v1/namespaces/{ns}/pubsub`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HistoryRule {
    /// The topics kept: a glob (`*` any run, `?` one character).
    pub topics: String,
    /// Publications kept per topic, newest first (1 to `max_history_size`).
    pub size: u64,
    /// Seconds a publication is kept (1 to `max_history_ttl`).
    pub ttl_seconds: u64,
}

/// The node's caps on history (`[pubsub]`).
#[derive(Debug, Clone, Copy)]
pub struct HistoryCaps {
    /// Largest `size` a rule may set.
    pub max_size: u64,
    /// Largest `ttl_seconds` a rule may set.
    pub max_ttl: u64,
    /// Payload bytes a namespace's history may hold; past it the oldest go.
    pub max_bytes: u64,
    /// Most publications one recovery returns; a larger gap is not recovered.
    pub max_recovered: u64,
    /// Milliseconds a topic holding no publication keeps its stream after
    /// its last activity (`[pubsub] history_meta_ttl_seconds`).
    pub meta_ttl_ms: u64,
    /// Topics with a stream the namespace may keep (its `history_topics` quota).
    pub max_topics: u64,
}

impl From<&crate::config::PubSubConfig> for HistoryCaps {
    fn from(c: &crate::config::PubSubConfig) -> Self {
        Self {
            max_size: c.max_history_size,
            max_ttl: c.max_history_ttl,
            max_bytes: c.max_history_bytes_per_namespace,
            max_recovered: c.max_recovered_publications,
            meta_ttl_ms: c.history_meta_ttl_seconds.saturating_mul(1000),
            max_topics: u64::MAX,
        }
    }
}

/// Checks a topic glob: what [`check_topic`](super::check_topic) accepts for
/// a topic, with `*` and `?` as wildcards; the bracket and brace syntaxes of
/// other globs are refused rather than taken literally.
pub fn check_glob(glob: &str) -> Result<(), String> {
    if glob.is_empty()
        || glob.len() > super::protocol::MAX_TOPIC_BYTES
        || glob.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(format!(
            "a topic glob is 1 to {} bytes without spaces or control characters",
            super::protocol::MAX_TOPIC_BYTES
        ));
    }
    if glob
        .chars()
        .any(|c| matches!(c, '[' | ']' | '{' | '}' | '\\'))
    {
        return Err(format!(
            "{glob:?}: only `*` and `?` are wildcards (no [], {{}} or \\)"
        ));
    }
    if glob.starts_with(super::RESERVED_PREFIX) {
        return Err("topics under _mg/ are reserved".into());
    }
    Ok(())
}

/// Checks a namespace's rules against the node's caps; every problem at once.
pub fn check_rules(rules: &[HistoryRule], caps: &HistoryCaps) -> Result<(), String> {
    let mut errors = Vec::new();
    if rules.len() > MAX_RULES {
        errors.push(format!("at most {MAX_RULES} history rules"));
    }
    for (i, r) in rules.iter().enumerate() {
        if let Err(e) = check_glob(&r.topics) {
            errors.push(format!("history[{i}].topics: {e}"));
        }
        if r.size == 0 || r.size > caps.max_size {
            errors.push(format!(
                "history[{i}].size: 1 to {} (pubsub.max_history_size)",
                caps.max_size
            ));
        }
        if r.ttl_seconds == 0 || r.ttl_seconds > caps.max_ttl {
            errors.push(format!(
                "history[{i}].ttl_seconds: 1 to {} (pubsub.max_history_ttl)",
                caps.max_ttl
            ));
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// Most rules one namespace may have.
pub const MAX_RULES: usize = 32;

/// The first rule whose glob matches `topic`.
pub fn rule_for<'a>(rules: &'a [HistoryRule], topic: &str) -> Option<&'a HistoryRule> {
    rules
        .iter()
        .find(|r| crate::auth::glob_match(&r.topics, topic))
}

/// A topic's durable position: its epoch and the offset of its last publication.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Meta {
    /// Random; a new one means the offsets before it are gone.
    pub epoch: String,
    /// The offset of the topic's last publication (0: none yet).
    pub top: u64,
}

/// One kept publication.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Its place in the topic: 1 for the first, +1 per publication.
    pub offset: u64,
    /// Unix milliseconds when the node accepted it.
    pub timestamp: u64,
    /// The payload.
    pub data: Bytes,
}

/// The position given to a publication (the publish ack) or asked of a topic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Position {
    /// The publication's offset, or the topic's top one.
    pub offset: u64,
    /// The topic's epoch.
    pub epoch: String,
}

/// What a recovery gives: whether the gap could be filled, the topic's
/// position, and the missed publications in offset order.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    /// True when every publication after the client's offset is in `missed`.
    pub recovered: bool,
    /// The topic's epoch and top offset now.
    pub position: Position,
    /// The publications after the client's offset (empty unless `recovered`).
    pub missed: Vec<Entry>,
}

#[derive(Debug)]
struct TopicHistory {
    meta: Meta,
    entries: VecDeque<Entry>,
    /// Payload bytes of `entries`.
    bytes: u64,
    /// Unix ms of its last activity: its newest publication, or when this
    /// node gave it an epoch or read it (a load counts as activity: metas
    /// do not store it). A topic holding no publication is forgotten
    /// `meta_ttl_ms` after it, or sooner to make room ([`NsHistory::make_room`]).
    last_ms: u64,
}

impl TopicHistory {
    fn new(meta: Meta, entries: VecDeque<Entry>, bytes: u64) -> Self {
        let last_ms = entries
            .back()
            .map_or_else(super::protocol::now_ms, |e| e.timestamp);
        TopicHistory {
            meta,
            entries,
            bytes,
            last_ms,
        }
    }
}

/// A namespace's history: every topic with a [`Meta`], the kept
/// publications, and the store writes not yet made.
#[derive(Debug, Default)]
pub struct NsHistory {
    ns: String,
    topics: HashMap<String, TopicHistory>,
    /// Payload bytes over every topic, bounded by `max_bytes`.
    bytes: u64,
    /// Store writes queued by appends and trims, in order.
    pending: Vec<BatchOp>,
    /// Topics given an epoch here whose metas the store may not hold yet.
    touched: Vec<String>,
    /// Forgotten topics' stored metas to delete, each with the value this
    /// node last knew: deleted only if the store still holds exactly that
    /// (a publication sequenced meanwhile, here or on another node, keeps it).
    forgotten: Vec<(Vec<u8>, Vec<u8>)>,
}

/// One topic's stream in a namespace export (`history` of
/// `GET /v1/db/export`): its epoch and top offset, and the kept
/// publications in offset order.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExportedTopic {
    /// The topic.
    pub topic: String,
    /// Its epoch: kept by the import, so a client of the exported stream
    /// recovers from the imported one.
    pub epoch: String,
    /// The offset of its last publication.
    pub top: u64,
    /// The kept publications, oldest first.
    #[serde(default)]
    pub publications: Vec<ExportedPublication>,
}

/// One kept publication in an export.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExportedPublication {
    /// Its offset in the topic.
    pub offset: u64,
    /// Unix milliseconds when it was accepted.
    pub timestamp: u64,
    /// The payload, base64 (standard alphabet).
    pub data_base64: String,
}

/// The largest offset (a topic's `top`) an import may carry: 2^53, the
/// largest integer every JSON client reads exactly, so the topic's next
/// offsets can never wrap.
pub const MAX_IMPORTED_OFFSET: u64 = 1 << 53;

/// How far ahead of this node's clock an imported publication's timestamp
/// may be (another node's clock may run ahead): one day, in milliseconds.
const IMPORT_CLOCK_SLACK_MS: u64 = 86_400_000;

/// An imported topic that passed [`check_import`].
#[derive(Debug)]
pub struct CheckedTopic {
    topic: String,
    meta: Meta,
    entries: Vec<Entry>,
}

/// Checks an export's `history`: valid topics, each once; an epoch of 1 to
/// 64 letters, digits or `-`; a `top` at most [`MAX_IMPORTED_OFFSET`];
/// offsets from 1, strictly increasing and at most `top`; timestamps at
/// most a day ahead of the node's clock; base64 payloads; the payloads' total within `max_bytes` (the
/// namespace's `history_bytes` quota and the node's cap, whichever is lower:
/// 413 `QUOTA_EXCEEDED` past it); at most `max_topics` topics (its
/// `history_topics` quota: 429 past it). The error says which entry is wrong.
pub fn check_import(
    topics: &[ExportedTopic],
    max_bytes: u64,
    max_topics: u64,
) -> Result<Vec<CheckedTopic>, ImportError> {
    if topics.len() as u64 > max_topics {
        return Err(ImportError::TooManyTopics {
            topics: topics.len() as u64,
            max_topics,
        });
    }
    let mut seen = std::collections::HashSet::new();
    let mut total = 0u64;
    let mut out = Vec::with_capacity(topics.len());
    // A publication stamped in the future would outlive its rule's ttl.
    let latest_timestamp = super::protocol::now_ms().saturating_add(IMPORT_CLOCK_SLACK_MS);
    for t in topics {
        super::protocol::check_topic(&t.topic)
            .map_err(|e| ImportError::Invalid(format!("history topic {:?}: {e}", t.topic)))?;
        if !seen.insert(t.topic.as_str()) {
            return Err(ImportError::Invalid(format!(
                "history topic {:?} appears twice",
                t.topic
            )));
        }
        if t.epoch.is_empty()
            || t.epoch.len() > 64
            || !t
                .epoch
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-')
        {
            return Err(ImportError::Invalid(format!(
                "history topic {:?}: the epoch is 1 to 64 letters, digits or '-'",
                t.topic
            )));
        }
        // Counters continue from what is imported: a top near u64::MAX
        // would wrap the next offset to 0 (clients take 0 as "from the
        // start").
        if t.top > MAX_IMPORTED_OFFSET {
            return Err(ImportError::Invalid(format!(
                "history topic {:?}: top {} is above {MAX_IMPORTED_OFFSET}",
                t.topic, t.top
            )));
        }
        let mut last = 0u64;
        let mut entries = Vec::with_capacity(t.publications.len());
        for p in &t.publications {
            if p.offset <= last || p.offset > t.top {
                return Err(ImportError::Invalid(format!(
                    "history topic {:?}: offset {} is not above {last} and at most top {}",
                    t.topic, p.offset, t.top
                )));
            }
            last = p.offset;
            if p.timestamp > latest_timestamp {
                return Err(ImportError::Invalid(format!(
                    "history topic {:?}: the publication at offset {} is timestamped {} ms, \
                     more than a day ahead of this node's clock",
                    t.topic, p.offset, p.timestamp
                )));
            }
            let data =
                base64::Engine::decode(&base64::engine::general_purpose::STANDARD, &p.data_base64)
                    .map_err(|_| {
                        ImportError::Invalid(format!(
                            "history topic {:?}: the publication at offset {} is not base64",
                            t.topic, p.offset
                        ))
                    })?;
            total += data.len() as u64;
            if total > max_bytes {
                return Err(ImportError::TooLarge { max_bytes });
            }
            entries.push(Entry {
                offset: p.offset,
                timestamp: p.timestamp,
                data: Bytes::from(data),
            });
        }
        out.push(CheckedTopic {
            topic: t.topic.clone(),
            meta: Meta {
                epoch: t.epoch.clone(),
                top: t.top,
            },
            entries,
        });
    }
    Ok(out)
}

/// Why an export's history is refused.
#[derive(Debug, PartialEq, Eq)]
pub enum ImportError {
    /// A malformed entry (400 `INVALID_EXPORT`), what is wrong.
    Invalid(String),
    /// More payload bytes than the namespace may hold.
    TooLarge {
        /// The namespace's limit.
        max_bytes: u64,
    },
    /// More topics than the namespace may keep.
    TooManyTopics {
        /// Topics in the export.
        topics: u64,
        /// The namespace's `history_topics` quota.
        max_topics: u64,
    },
}

/// The store prefix of a namespace's history (publications and metas).
pub fn prefix(ns: &str) -> Vec<u8> {
    format!("hist/{ns}/").into_bytes()
}

fn pub_key(ns: &str, topic: &str, offset: u64) -> Vec<u8> {
    let mut k = format!("hist/{ns}/p/{topic}\0").into_bytes();
    k.extend_from_slice(&offset.to_be_bytes());
    k
}

fn meta_key(ns: &str, topic: &str) -> Vec<u8> {
    format!("hist/{ns}/m/{topic}").into_bytes()
}

/// A fresh epoch: 16 random bytes as hex (the time if the system's random fails).
pub fn new_epoch() -> String {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 16];
    if ring::rand::SystemRandom::new().fill(&mut b).is_err() {
        b[..8].copy_from_slice(&super::protocol::now_ms().to_be_bytes());
    }
    hex::encode(b)
}

/// A publication waiting for its offset: the supervisor's next sequencing
/// transaction gives it one ([`plan_sequence`]).
#[derive(Debug, Clone)]
pub struct Staged {
    /// The topic (a history rule names it).
    pub topic: String,
    /// The payload.
    pub data: Bytes,
    /// Unix milliseconds when this node accepted it.
    pub timestamp: u64,
    /// The rule's `size`: the row `size` offsets back is deleted with it.
    pub size: u64,
}

/// What one sequencing transaction found and wrote for one topic.
#[derive(Debug, Clone, PartialEq)]
pub struct TopicStep {
    /// The topic.
    pub topic: String,
    /// Its meta in the store before the transaction (None: no history yet).
    pub before: Option<Meta>,
    /// Its meta after it.
    pub after: Meta,
    /// The epoch the transaction would have started the topic with.
    pub fresh: String,
}

/// What a sequencing transaction decided: per topic (in the order of the
/// keys read) and the position of each staged publication, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Sequenced {
    /// One per distinct topic, in key order.
    pub topics: Vec<TopicStep>,
    /// One per staged publication, in staging order.
    pub positions: Vec<Position>,
}

/// The meta keys a sequencing transaction reads, one per distinct topic of
/// `staged` and `touched`, first-seen order; the topics come second.
pub fn sequence_keys(
    ns: &str,
    staged: &[Staged],
    touched: &[String],
) -> (Vec<Vec<u8>>, Vec<String>) {
    let mut topics: Vec<String> = Vec::new();
    for t in staged.iter().map(|s| &s.topic).chain(touched.iter()) {
        if !topics.iter().any(|x| x == t) {
            topics.push(t.clone());
        }
    }
    (topics.iter().map(|t| meta_key(ns, t)).collect(), topics)
}

/// Decides one sequencing transaction from the metas as the store holds
/// them now (`metas`, one per topic of `topics`): each staged publication
/// gets the next offset of its topic's stored meta (a topic with no meta,
/// or an unreadable one, starts at 1 under `fresh[i]`), its row, the
/// deletion of the row `size` offsets back, and each changed meta its put.
/// Pure: the store calls it again when a meta changed in between, so two
/// nodes sequencing one topic never give one offset twice.
pub fn plan_sequence(
    ns: &str,
    topics: &[String],
    metas: &[Option<Vec<u8>>],
    fresh: &[String],
    staged: &[Staged],
) -> (Vec<BatchOp>, Sequenced) {
    let mut steps: Vec<TopicStep> = topics
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let before = metas
                .get(i)
                .and_then(|m| m.as_deref())
                .and_then(|v| serde_json::from_slice::<Meta>(v).ok());
            let after = before.clone().unwrap_or_else(|| Meta {
                epoch: fresh[i].clone(),
                top: 0,
            });
            TopicStep {
                topic: t.clone(),
                before,
                after,
                fresh: fresh[i].clone(),
            }
        })
        .collect();
    let mut ops = Vec::with_capacity(staged.len() * 2 + topics.len());
    let mut positions = Vec::with_capacity(staged.len());
    for s in staged {
        let Some(step) = steps.iter_mut().find(|st| st.topic == s.topic) else {
            continue;
        };
        step.after.top += 1;
        let offset = step.after.top;
        let mut value = Vec::with_capacity(8 + s.data.len());
        value.extend_from_slice(&s.timestamp.to_be_bytes());
        value.extend_from_slice(&s.data);
        ops.push(BatchOp::Put(pub_key(ns, &s.topic, offset), value));
        // The row `size` back goes in the same write; every node's copy
        // trims it without writing it again (`NsHistory::append_at`).
        if offset > s.size {
            ops.push(BatchOp::Delete(pub_key(ns, &s.topic, offset - s.size)));
        }
        positions.push(Position {
            offset,
            epoch: step.after.epoch.clone(),
        });
    }
    for st in &steps {
        if st.before.as_ref() != Some(&st.after) {
            ops.push(BatchOp::Put(
                meta_key(ns, &st.topic),
                serde_json::to_vec(&st.after).unwrap_or_default(),
            ));
        }
    }
    (
        ops,
        Sequenced {
            topics: steps,
            positions,
        },
    )
}

/// The store keys of one topic: the prefix of its publications' rows and its meta.
pub fn topic_keys(ns: &str, topic: &str) -> (Vec<u8>, Vec<u8>) {
    (
        format!("hist/{ns}/p/{topic}\0").into_bytes(),
        meta_key(ns, topic),
    )
}

/// The store key of one publication's row.
pub fn row_key(ns: &str, topic: &str, offset: u64) -> Vec<u8> {
    pub_key(ns, topic, offset)
}

/// One publication from its row's value (8 bytes timestamp, then the payload).
pub fn decode_row(offset: u64, value: &[u8]) -> Option<Entry> {
    let ts: [u8; 8] = value.get(..8)?.try_into().ok()?;
    Some(Entry {
        offset,
        timestamp: u64::from_be_bytes(ts),
        data: Bytes::copy_from_slice(&value[8..]),
    })
}

/// What a publication received from the mesh did to this node's copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaStep {
    /// It was the next offset: kept; deliver it.
    Appended,
    /// Already held (an offset at or below the top of the same epoch): drop it.
    Duplicate,
    /// A gap or another epoch: read the topic from the store ([`NsHistory::adopt`]).
    Behind,
}

/// What adopting a topic's stored state changed for this node's subscribers.
#[derive(Debug, Clone, PartialEq)]
pub struct Adopted {
    /// The publications above the old top, in offset order, to deliver
    /// (same epoch and no gap only).
    pub new: Vec<Entry>,
    /// The local subscribers cannot be continued: another epoch, or
    /// publications between the old top and the kept ones are gone. They
    /// are closed with [`close::INSUFFICIENT_STATE`](super::close) and recover.
    pub broken: bool,
}

impl NsHistory {
    /// The history of `ns` as stored (`rows`: every key under [`prefix`]).
    /// Undecodable rows are skipped (their topic keeps its meta).
    pub fn load(ns: &str, rows: Vec<(Vec<u8>, Vec<u8>)>) -> Self {
        let mut h = NsHistory {
            ns: ns.to_string(),
            ..Default::default()
        };
        let base = prefix(ns);
        let mut pubs: Vec<(String, Entry)> = Vec::new();
        for (k, v) in rows {
            let Some(rest) = k.strip_prefix(base.as_slice()) else {
                continue;
            };
            if let Some(topic) = rest.strip_prefix(b"m/") {
                let (Ok(topic), Ok(meta)) = (
                    std::str::from_utf8(topic),
                    serde_json::from_slice::<Meta>(&v),
                ) else {
                    continue;
                };
                h.topics.insert(
                    topic.to_string(),
                    TopicHistory::new(meta, VecDeque::new(), 0),
                );
            } else if let Some(p) = rest.strip_prefix(b"p/") {
                if p.len() < 9 || p[p.len() - 9] != 0 || v.len() < 8 {
                    continue;
                }
                let Ok(topic) = std::str::from_utf8(&p[..p.len() - 9]) else {
                    continue;
                };
                let mut off = [0u8; 8];
                off.copy_from_slice(&p[p.len() - 8..]);
                let mut ts = [0u8; 8];
                ts.copy_from_slice(&v[..8]);
                pubs.push((
                    topic.to_string(),
                    Entry {
                        offset: u64::from_be_bytes(off),
                        timestamp: u64::from_be_bytes(ts),
                        data: Bytes::copy_from_slice(&v[8..]),
                    },
                ));
            }
        }
        // Keys scan in byte order: each topic's publications by offset.
        for (topic, e) in pubs {
            match h.topics.get_mut(&topic) {
                Some(t) if e.offset <= t.meta.top => {
                    t.bytes += e.data.len() as u64;
                    h.bytes += e.data.len() as u64;
                    t.last_ms = e.timestamp;
                    t.entries.push_back(e);
                }
                // A publication written without its meta (or past it): the
                // meta is the truth; drop it.
                _ => h
                    .pending
                    .push(BatchOp::Delete(pub_key(ns, &topic, e.offset))),
            }
        }
        h
    }

    /// One topic as stored: its meta (`meta`, the value under its meta key)
    /// and its rows (`rows`, every key under its publications' prefix,
    /// [`topic_keys`]). None when it has no meta.
    pub fn stored_topic(
        ns: &str,
        topic: &str,
        meta: Option<Vec<u8>>,
        mut rows: Vec<(Vec<u8>, Vec<u8>)>,
    ) -> Option<(Meta, Vec<Entry>)> {
        let (_, mkey) = topic_keys(ns, topic);
        rows.push((mkey, meta?));
        rows.sort();
        let mut h = NsHistory::load(ns, rows);
        let t = h.topics.remove(topic)?;
        Some((t.meta, t.entries.into()))
    }

    /// Appends a publication to `topic` under `rule` as the only writer of
    /// the store would (the next offset of this copy, its rows queued in
    /// `pending`); returns its position. The node sequences through
    /// [`plan_sequence`] instead; this is the unit tests' way to fill a copy.
    #[cfg(test)]
    pub fn append(
        &mut self,
        topic: &str,
        rule: &HistoryRule,
        data: &Bytes,
        timestamp: u64,
        caps: &HistoryCaps,
    ) -> Position {
        let mut meta = self.meta(topic).unwrap_or_else(|| Meta {
            epoch: new_epoch(),
            top: 0,
        });
        meta.top += 1;
        let mut value = Vec::with_capacity(8 + data.len());
        value.extend_from_slice(&timestamp.to_be_bytes());
        value.extend_from_slice(data);
        self.pending
            .push(BatchOp::Put(pub_key(&self.ns, topic, meta.top), value));
        if meta.top > rule.size {
            self.pending.push(BatchOp::Delete(pub_key(
                &self.ns,
                topic,
                meta.top - rule.size,
            )));
        }
        self.pending.push(BatchOp::Put(
            meta_key(&self.ns, topic),
            serde_json::to_vec(&meta).unwrap_or_default(),
        ));
        self.append_at(topic, &meta.epoch, meta.top, timestamp, data, rule, caps);
        Position {
            offset: meta.top,
            epoch: meta.epoch,
        }
    }

    /// Drops the topic's publications beyond `size` or older than
    /// `oldest_ms`, queueing their rows' deletions, but for offset `stored`:
    /// a row the store write that sequenced a publication already deleted
    /// (its row `size` back, [`plan_sequence`]).
    fn trim_topic(&mut self, topic: &str, size: u64, oldest_ms: u64, stored: Option<u64>) {
        let Some(t) = self.topics.get_mut(topic) else {
            return;
        };
        while let Some(front) = t.entries.front() {
            if (t.entries.len() as u64) <= size && front.timestamp >= oldest_ms {
                break;
            }
            let e = t.entries.pop_front().expect("a front entry");
            t.bytes -= e.data.len() as u64;
            self.bytes -= e.data.len() as u64;
            if stored != Some(e.offset) {
                self.pending
                    .push(BatchOp::Delete(pub_key(&self.ns, topic, e.offset)));
            }
        }
    }

    /// Drops the oldest publications of the namespace until it holds at most `max`.
    fn trim_bytes(&mut self, max: u64) {
        while self.bytes > max {
            let Some(topic) = self
                .topics
                .iter()
                .filter_map(|(k, t)| t.entries.front().map(|e| (e.timestamp, k)))
                .min()
                .map(|(_, k)| k.clone())
            else {
                return;
            };
            let t = self.topics.get_mut(&topic).expect("just found");
            let e = t.entries.pop_front().expect("non-empty");
            t.bytes -= e.data.len() as u64;
            self.bytes -= e.data.len() as u64;
            self.pending
                .push(BatchOp::Delete(pub_key(&self.ns, &topic, e.offset)));
        }
    }

    /// The background sweep: drops what is past its rule's age or size (and
    /// every publication of a topic no rule names any more), then forgets
    /// the topics holding no publication that are idle past
    /// `caps.meta_ttl_ms` or, past `caps.max_topics` (a quota made
    /// smaller, copies from other nodes), the longest idle; never one
    /// `in_use` names (subscribed here). Past the quota a store this node
    /// alone writes (`own_store`) loses those streams too; a shared one
    /// keeps them for the nodes that use them.
    pub fn sweep(
        &mut self,
        rules: &[HistoryRule],
        now_ms: u64,
        caps: &HistoryCaps,
        own_store: bool,
        in_use: impl Fn(&str) -> bool,
    ) {
        let topics: Vec<String> = self
            .topics
            .iter()
            .filter(|(_, t)| !t.entries.is_empty())
            .map(|(k, _)| k.clone())
            .collect();
        for topic in topics {
            match rule_for(rules, &topic) {
                Some(r) => self.trim_topic(
                    &topic,
                    r.size,
                    now_ms.saturating_sub(r.ttl_seconds * 1000),
                    None,
                ),
                None => self.trim_topic(&topic, 0, u64::MAX, None),
            }
        }
        self.trim_bytes(caps.max_bytes);
        let idle_since = now_ms.saturating_sub(caps.meta_ttl_ms);
        let expired: Vec<String> = self
            .topics
            .iter()
            .filter(|(k, t)| t.entries.is_empty() && t.last_ms < idle_since && !in_use(k))
            .map(|(k, _)| k.clone())
            .collect();
        for topic in expired {
            self.forget(&topic, true);
        }
        let over = (self.topics.len() as u64).saturating_sub(caps.max_topics);
        self.forget_idle(over, &in_use, own_store);
    }

    /// Topics with a stream kept here (the `history_topics` quota's use).
    pub fn topic_count(&self) -> u64 {
        self.topics.len() as u64
    }

    /// Room for `new` more topics under `max` (the `history_topics`
    /// quota): forgets the longest-idle topics holding no publication that
    /// `in_use` does not name until they fit. False (nothing forgotten) when
    /// they cannot.
    pub fn make_room(&mut self, new: u64, max: u64, in_use: impl Fn(&str) -> bool) -> bool {
        let count = self.topics.len() as u64;
        if count.saturating_add(new) <= max {
            return true;
        }
        let need = count.saturating_add(new) - max;
        let idle = self
            .topics
            .iter()
            .filter(|(k, t)| t.entries.is_empty() && !in_use(k))
            .count() as u64;
        if idle < need {
            return false;
        }
        self.forget_idle(need, &in_use, true);
        true
    }

    /// Forgets the `n` longest-idle topics holding no publication that
    /// `in_use` does not name, or as many as there are (`stored`: their
    /// stored metas too), in one pass over the topics.
    fn forget_idle(&mut self, n: u64, in_use: &impl Fn(&str) -> bool, stored: bool) {
        if n == 0 {
            return;
        }
        let mut idle: Vec<(u64, &String)> = self
            .topics
            .iter()
            .filter(|(k, t)| t.entries.is_empty() && !in_use(k))
            .map(|(k, t)| (t.last_ms, k))
            .collect();
        idle.sort_unstable();
        let gone: Vec<String> = idle
            .into_iter()
            .take(n as usize)
            .map(|(_, k)| k.clone())
            .collect();
        for topic in gone {
            self.forget(&topic, stored);
        }
    }

    /// Drops a topic holding no publication from this copy and, with
    /// `stored`, queues the guarded deletion of its stored meta: its next
    /// publication starts a new epoch, and a client recovering from the old
    /// one is told `recovered: false`. Without, a later publication or
    /// subscribe here reads the stored stream again.
    fn forget(&mut self, topic: &str, stored: bool) {
        let Some(t) = self.topics.remove(topic) else {
            return;
        };
        debug_assert!(t.entries.is_empty());
        self.touched.retain(|x| x != topic);
        if !stored {
            return;
        }
        // A meta never stored (given here, top 0, not yet written) has
        // nothing to delete; one that is, only as this node knows it.
        self.forgotten.push((
            meta_key(&self.ns, topic),
            serde_json::to_vec(&t.meta).unwrap_or_default(),
        ));
    }

    /// The forgotten topics' metas to delete, each with the value it must
    /// still have in the store ([`NsHistory::make_room`], the sweep).
    pub fn take_forgotten(&mut self) -> Vec<(Vec<u8>, Vec<u8>)> {
        std::mem::take(&mut self.forgotten)
    }

    /// The store writes queued since the last call, to write as one batch:
    /// only the last write of each key (a topic's meta is written once per
    /// batch, a publication trimmed within the batch only deleted).
    pub fn take_pending(&mut self) -> Vec<BatchOp> {
        let ops = std::mem::take(&mut self.pending);
        let mut seen = std::collections::HashSet::new();
        let mut out: Vec<BatchOp> = ops
            .into_iter()
            .rev()
            .filter(|op| {
                let k = match op {
                    BatchOp::Put(k, _) | BatchOp::Delete(k) => k,
                };
                seen.insert(k.clone())
            })
            .collect();
        out.reverse();
        out
    }

    /// Payload bytes held over every topic (the `history_bytes` quota's use).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Every topic's stream as an export carries it, topics in name order.
    pub fn export(&self) -> Vec<ExportedTopic> {
        let mut out: Vec<ExportedTopic> = self
            .topics
            .iter()
            .map(|(topic, t)| ExportedTopic {
                topic: topic.clone(),
                epoch: t.meta.epoch.clone(),
                top: t.meta.top,
                publications: t
                    .entries
                    .iter()
                    .map(|e| ExportedPublication {
                        offset: e.offset,
                        timestamp: e.timestamp,
                        data_base64: base64::Engine::encode(
                            &base64::engine::general_purpose::STANDARD,
                            &e.data,
                        ),
                    })
                    .collect(),
            })
            .collect();
        out.sort_by(|a, b| a.topic.cmp(&b.topic));
        out
    }

    /// Makes the history exactly `imported` (checked by [`check_import`]):
    /// every stored key of the old history is deleted and the new rows are
    /// written, queued behind any write in flight, so nothing of the old
    /// history lands after the new.
    pub fn replace(&mut self, imported: Vec<CheckedTopic>) {
        let ns = self.ns.clone();
        self.forgotten.clear();
        self.touched.clear();
        for (topic, t) in std::mem::take(&mut self.topics) {
            for e in &t.entries {
                self.pending
                    .push(BatchOp::Delete(pub_key(&ns, &topic, e.offset)));
            }
            self.pending.push(BatchOp::Delete(meta_key(&ns, &topic)));
        }
        self.bytes = 0;
        for c in imported {
            let mut t = TopicHistory::new(c.meta, VecDeque::new(), 0);
            self.pending.push(BatchOp::Put(
                meta_key(&ns, &c.topic),
                serde_json::to_vec(&t.meta).unwrap_or_default(),
            ));
            for e in c.entries {
                let mut value = Vec::with_capacity(8 + e.data.len());
                value.extend_from_slice(&e.timestamp.to_be_bytes());
                value.extend_from_slice(&e.data);
                self.pending
                    .push(BatchOp::Put(pub_key(&ns, &c.topic, e.offset), value));
                t.bytes += e.data.len() as u64;
                t.last_ms = e.timestamp;
                t.entries.push_back(e);
            }
            self.bytes += t.bytes;
            self.topics.insert(c.topic, t);
        }
    }

    /// Whether this node keeps a stream of `topic`.
    pub fn has_topic(&self, topic: &str) -> bool {
        self.topics.contains_key(topic)
    }

    /// The topic's meta as this node holds it; None when it has no history here.
    pub fn meta(&self, topic: &str) -> Option<Meta> {
        self.topics.get(topic).map(|t| t.meta.clone())
    }

    /// Keeps a publication whose offset the store already gave (this node's
    /// own, once its transaction is written, or one received from the
    /// mesh): the topic's top becomes `offset` under `epoch`; trimmed as
    /// [`append`](Self::append) trims.
    #[allow(clippy::too_many_arguments)]
    pub fn append_at(
        &mut self,
        topic: &str,
        epoch: &str,
        offset: u64,
        timestamp: u64,
        data: &Bytes,
        rule: &HistoryRule,
        caps: &HistoryCaps,
    ) -> bool {
        let t = self
            .topics
            .entry(topic.to_string())
            .or_insert_with(|| TopicHistory {
                meta: Meta {
                    epoch: epoch.to_string(),
                    top: 0,
                },
                entries: VecDeque::new(),
                bytes: 0,
                last_ms: timestamp,
            });
        // Held already: never kept (or delivered) twice.
        if t.meta.epoch == epoch
            && offset <= t.meta.top
            && t.entries.back().is_some_and(|e| e.offset >= offset)
        {
            return false;
        }
        t.meta = Meta {
            epoch: epoch.to_string(),
            top: offset,
        };
        t.entries.push_back(Entry {
            offset,
            timestamp,
            data: data.clone(),
        });
        t.last_ms = t.last_ms.max(timestamp);
        t.bytes += data.len() as u64;
        self.bytes += data.len() as u64;
        // The row `size` back went with the publication's own store write,
        // on whichever node sequenced it: not written again from here.
        self.trim_topic(
            topic,
            rule.size,
            timestamp.saturating_sub(rule.ttl_seconds * 1000),
            offset.checked_sub(rule.size).filter(|o| *o > 0),
        );
        self.trim_bytes(caps.max_bytes);
        true
    }

    /// A publication of another node, received from the mesh with its
    /// position: kept when it is the next offset of the epoch held here.
    #[allow(clippy::too_many_arguments)]
    pub fn apply_replica(
        &mut self,
        topic: &str,
        epoch: &str,
        offset: u64,
        timestamp: u64,
        data: &Bytes,
        rule: &HistoryRule,
        caps: &HistoryCaps,
    ) -> ReplicaStep {
        match self.topics.get(topic) {
            None if offset == 1 => {}
            None => return ReplicaStep::Behind,
            Some(t) if t.meta.epoch != epoch => return ReplicaStep::Behind,
            Some(t) if offset <= t.meta.top => return ReplicaStep::Duplicate,
            Some(t) if offset != t.meta.top + 1 => return ReplicaStep::Behind,
            Some(_) => {}
        }
        self.append_at(topic, epoch, offset, timestamp, data, rule, caps);
        ReplicaStep::Appended
    }

    /// Makes this node's copy of `topic` what the store holds (`stored`:
    /// its meta and kept publications, None when it has no history there).
    /// Returns what the topic's local subscribers must be sent or told.
    pub fn adopt(&mut self, topic: &str, stored: Option<(Meta, Vec<Entry>)>) -> Adopted {
        let old = self.topics.remove(topic);
        if let Some(t) = &old {
            self.bytes -= t.bytes;
        }
        let Some((meta, entries)) = stored else {
            // Nothing stored: a subscriber told an epoch here cannot continue.
            return Adopted {
                new: Vec::new(),
                broken: old.is_some_and(|t| t.meta.top > 0),
            };
        };
        let (new, broken) = match &old {
            Some(o) if o.meta.epoch == meta.epoch => {
                let new: Vec<Entry> = entries
                    .iter()
                    .filter(|e| e.offset > o.meta.top)
                    .cloned()
                    .collect();
                let gap =
                    meta.top > o.meta.top && new.first().is_none_or(|e| e.offset != o.meta.top + 1);
                (if gap { Vec::new() } else { new }, gap)
            }
            // A topic first seen here: its subscribers were told offset 0
            // of no epoch they can hold on to, only if there is one.
            None => (Vec::new(), false),
            Some(o) => (Vec::new(), o.meta.top > 0 || meta.top > 0),
        };
        let bytes: u64 = entries.iter().map(|e| e.data.len() as u64).sum();
        self.bytes += bytes;
        self.topics.insert(
            topic.to_string(),
            TopicHistory::new(meta, entries.into(), bytes),
        );
        Adopted { new, broken }
    }

    /// Appends the publications the store holds right after this node's
    /// top of `topic` (read one by one, every offset present, same epoch):
    /// the cheap form of [`adopt`](Self::adopt) for a short gap.
    pub fn extend(
        &mut self,
        topic: &str,
        epoch: &str,
        entries: Vec<Entry>,
        rule: &HistoryRule,
        caps: &HistoryCaps,
    ) -> Adopted {
        let new: Vec<Entry> = entries
            .into_iter()
            .filter(|e| self.append_at(topic, epoch, e.offset, e.timestamp, &e.data, rule, caps))
            .collect();
        Adopted { new, broken: false }
    }

    /// The topics given an epoch here by [`position_or_create`](Self::position_or_create)
    /// since the last call: their metas are created in the store (unless
    /// another node created them first) by the next sequencing transaction.
    pub fn take_touched(&mut self) -> Vec<String> {
        std::mem::take(&mut self.touched)
    }

    /// The topic's epoch and top offset; None when it has no history yet.
    pub fn position(&self, topic: &str) -> Option<Position> {
        self.topics.get(topic).map(|t| Position {
            offset: t.meta.top,
            epoch: t.meta.epoch.clone(),
        })
    }

    /// The position of `topic`, creating its meta (a fresh epoch, offset 0)
    /// when it has none: a subscriber is told an epoch before the first publication.
    pub fn position_or_create(&mut self, topic: &str) -> Position {
        if let Some(p) = self.position(topic) {
            return p;
        }
        let meta = Meta {
            epoch: new_epoch(),
            top: 0,
        };
        self.touched.push(topic.to_string());
        self.topics.insert(
            topic.to_string(),
            TopicHistory::new(meta, VecDeque::new(), 0),
        );
        self.position(topic).expect("just inserted")
    }

    /// The kept publications of `topic` newer than `oldest_ms`: those with
    /// an offset above `since` (oldest first), or, with `reverse`, below
    /// `since` (newest first; `since` None: from the top). At most `limit`,
    /// and no more payload than `max_bytes` unless one publication alone is
    /// larger (then it alone). The flag: more publications follow the page
    /// in its direction.
    pub fn read(
        &self,
        topic: &str,
        since: Option<u64>,
        limit: usize,
        max_bytes: u64,
        reverse: bool,
        oldest_ms: u64,
    ) -> (Vec<Entry>, bool) {
        let Some(t) = self.topics.get(topic) else {
            return (Vec::new(), false);
        };
        let live = |e: &&Entry| e.timestamp >= oldest_ms;
        let kept: Box<dyn Iterator<Item = &Entry>> = if reverse {
            let below = since.unwrap_or(u64::MAX);
            Box::new(t.entries.iter().rev().filter(move |e| e.offset < below))
        } else {
            let above = since.unwrap_or(0);
            Box::new(t.entries.iter().filter(move |e| e.offset > above))
        };
        let mut page = Vec::new();
        let mut bytes = 0u64;
        for e in kept.filter(live) {
            let size = e.data.len() as u64;
            if page.len() == limit || (!page.is_empty() && bytes + size > max_bytes) {
                return (page, true);
            }
            bytes += size;
            page.push(e.clone());
        }
        (page, false)
    }

    /// What a subscriber that saw `offset` of `epoch` missed. Recovered only
    /// when the epoch is the topic's, every publication after `offset` is
    /// still kept (none trimmed by size, age or bytes, judged by `oldest_ms`
    /// for age), and there are at most `max` of them.
    pub fn recover(
        &mut self,
        topic: &str,
        offset: u64,
        epoch: &str,
        oldest_ms: u64,
        max: u64,
    ) -> Recovery {
        let position = self.position_or_create(topic);
        let t = self.topics.get(topic).expect("created above");
        let gap = position.offset.saturating_sub(offset);
        let missed: Vec<Entry> = t
            .entries
            .iter()
            .filter(|e| e.offset > offset && e.timestamp >= oldest_ms)
            .cloned()
            .collect();
        let complete =
            missed.len() as u64 == gap && missed.first().is_none_or(|e| e.offset == offset + 1);
        let recovered =
            epoch == position.epoch && offset <= position.offset && gap <= max && complete;
        Recovery {
            recovered,
            position,
            missed: if recovered { missed } else { Vec::new() },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAPS: HistoryCaps = HistoryCaps {
        max_size: 1000,
        max_ttl: 3600,
        max_bytes: 1 << 20,
        max_recovered: 300,
        meta_ttl_ms: 86_400_000,
        max_topics: 1000,
    };

    fn rule(size: u64) -> HistoryRule {
        HistoryRule {
            topics: "chat.*".into(),
            size,
            ttl_seconds: 60,
        }
    }

    /// Offsets grow by one per publication; the size trims the oldest and
    /// what was written loads back with the same offsets and epoch.
    #[test]
    fn offsets_trim_and_reload() {
        let mut h = NsHistory::load("ns", Vec::new());
        let mut rows = std::collections::BTreeMap::<Vec<u8>, Vec<u8>>::new();
        let d = Bytes::from_static(b"x");
        let first = h.append("chat.1", &rule(3), &d, 1000, &CAPS);
        for i in 2..=5 {
            let p = h.append("chat.1", &rule(3), &d, 1000 + i, &CAPS);
            assert_eq!((p.offset, &p.epoch), (i, &first.epoch));
        }
        let pending = h.take_pending();
        // Five publications, two trimmed in the batch: 3 puts, 2 deletes, one meta.
        assert_eq!(pending.len(), 6);
        for op in pending {
            match op {
                BatchOp::Put(k, v) => {
                    rows.insert(k, v);
                }
                BatchOp::Delete(k) => {
                    rows.remove(&k);
                }
            }
        }
        let offs: Vec<u64> = h
            .read("chat.1", None, 10, u64::MAX, false, 0)
            .0
            .iter()
            .map(|e| e.offset)
            .collect();
        assert_eq!(offs, vec![3, 4, 5]);
        let again = NsHistory::load("ns", rows.into_iter().collect());
        assert_eq!(
            again.position("chat.1"),
            Some(Position {
                offset: 5,
                epoch: first.epoch.clone()
            })
        );
        let offs: Vec<u64> = again
            .read("chat.1", None, 10, u64::MAX, true, 0)
            .0
            .iter()
            .map(|e| e.offset)
            .collect();
        assert_eq!(offs, vec![5, 4, 3]);
    }

    /// A page stops at its `limit` or at its payload bytes, whichever comes
    /// first, holds a publication larger than the byte cap alone, and says
    /// whether more follow in its direction; read on from its last offset,
    /// the pages cover every kept publication once, both ways.
    #[test]
    fn a_page_is_bounded_by_bytes_and_says_more_follow() {
        let mut h = NsHistory::load("ns", Vec::new());
        // Offsets 1..=6 of 100 bytes, then 7 of 1,000, then 8 of 100.
        for i in 1..=8u64 {
            let d = Bytes::from(vec![b'x'; if i == 7 { 1000 } else { 100 }]);
            h.append("chat.1", &rule(100), &d, 1000 + i, &CAPS);
        }
        let page = |since, limit, reverse| {
            let (es, more) = h.read("chat.1", since, limit, 250, reverse, 0);
            (es.iter().map(|e| e.offset).collect::<Vec<_>>(), more)
        };
        assert_eq!(page(None, 10, false), (vec![1, 2], true), "250 bytes: two");
        assert_eq!(page(Some(2), 1, false), (vec![3], true), "the limit first");
        assert_eq!(page(Some(4), 10, false), (vec![5, 6], true));
        assert_eq!(
            page(Some(6), 10, false),
            (vec![7], true),
            "alone, over the cap"
        );
        assert_eq!(page(Some(7), 10, false), (vec![8], false));
        assert_eq!(page(Some(8), 10, false), (vec![], false));
        assert_eq!(
            page(None, 10, true),
            (vec![8], true),
            "8 and then 7 would pass 250"
        );
        assert_eq!(page(Some(8), 10, true), (vec![7], true));
        assert_eq!(page(Some(3), 10, true), (vec![2, 1], false));
        // Paging on covers each kept publication once, in both directions.
        for reverse in [false, true] {
            let (mut seen, mut since) = (Vec::new(), None);
            loop {
                let (offs, more) = page(since, 300, reverse);
                since = offs.last().copied().or(since);
                seen.extend(offs);
                if !more {
                    break;
                }
            }
            if reverse {
                seen.reverse();
            }
            assert_eq!(seen, (1..=8).collect::<Vec<u64>>());
        }
    }

    /// A recovery is refused for another epoch, a trimmed gap or one over the cap.
    #[test]
    fn recovery_rules() {
        let mut h = NsHistory::load("ns", Vec::new());
        let d = Bytes::from_static(b"x");
        let mut epoch = String::new();
        for i in 0..10 {
            epoch = h.append("chat.1", &rule(5), &d, 1000 + i, &CAPS).epoch;
        }
        let r = h.recover("chat.1", 6, &epoch, 0, 300);
        assert!(r.recovered);
        assert_eq!(
            r.missed.iter().map(|e| e.offset).collect::<Vec<_>>(),
            vec![7, 8, 9, 10]
        );
        assert!(h.recover("chat.1", 10, &epoch, 0, 300).recovered);
        assert!(!h.recover("chat.1", 4, &epoch, 0, 300).recovered);
        assert!(!h.recover("chat.1", 6, "other", 0, 300).recovered);
        assert!(!h.recover("chat.1", 6, &epoch, 0, 3).recovered);
        assert!(!h.recover("chat.1", 11, &epoch, 0, 300).recovered);
        assert!(!h.recover("chat.1", 6, &epoch, 1008, 300).recovered);
    }

    /// The sweep drops what is past the ttl (the meta stays, so the next
    /// offset continues); the byte cap drops the namespace's oldest first.
    #[test]
    fn sweep_and_byte_cap() {
        let mut h = NsHistory::load("ns", Vec::new());
        let r = rule(100);
        let d = Bytes::from_static(b"0123456789");
        for i in 0..3 {
            h.append("chat.1", &r, &d, 1000 + i, &CAPS);
        }
        h.sweep(&[r.clone()], 1002 + 60_001, &CAPS, true, |_| false);
        assert!(h.read("chat.1", None, 10, u64::MAX, false, 0).0.is_empty());
        assert_eq!(h.append("chat.1", &r, &d, 100_000, &CAPS).offset, 4);
        // No rule names the topic any more: the sweep empties it.
        h.sweep(&[], 100_001, &CAPS, true, |_| false);
        assert!(h.read("chat.1", None, 10, u64::MAX, false, 0).0.is_empty());
        let caps = HistoryCaps {
            max_bytes: 25,
            ..CAPS
        };
        h.append("chat.a", &r, &d, 200_000, &caps);
        h.append("chat.b", &r, &d, 200_001, &caps);
        h.append("chat.b", &r, &d, 200_002, &caps);
        assert!(h.read("chat.a", None, 10, u64::MAX, false, 0).0.is_empty());
        assert_eq!(h.read("chat.b", None, 10, u64::MAX, false, 0).0.len(), 2);
    }

    /// A topic whose publications are all gone keeps its stream for the
    /// meta TTL after its last publication, then is forgotten: its stored
    /// meta queued for a deletion guarded by the value this node knew, its
    /// next publication a new epoch. In use, or holding publications, it stays.
    #[test]
    fn idle_streams_are_forgotten_after_the_meta_ttl() {
        let mut h = NsHistory::load("ns", Vec::new());
        let r = rule(100);
        let d = Bytes::from_static(b"x");
        let caps = HistoryCaps {
            meta_ttl_ms: 100_000,
            ..CAPS
        };
        for t in ["chat.idle", "chat.used"] {
            h.append(t, &r, &d, 1_000, &caps);
        }
        h.append("chat.kept", &r, &d, 1_000, &caps);
        let old = h.meta("chat.idle").unwrap();
        h.take_pending();
        // Past the rule's 60 s every publication is gone; the streams stay.
        h.sweep(&[r.clone()], 62_000, &caps, true, |_| false);
        assert_eq!(h.topic_count(), 3);
        assert!(h.take_forgotten().is_empty());
        // A publication at 90 s keeps chat.kept busy; past 101 s the idle
        // ones go, but for the one a subscriber uses.
        h.append("chat.kept", &r, &d, 90_000, &caps);
        h.sweep(&[r.clone()], 101_001, &caps, true, |t| t == "chat.used");
        assert!(!h.has_topic("chat.idle"));
        assert!(h.has_topic("chat.used") && h.has_topic("chat.kept"));
        assert_eq!(
            h.take_forgotten(),
            vec![(
                meta_key("ns", "chat.idle"),
                serde_json::to_vec(&old).unwrap()
            )]
        );
        let again = h.append("chat.idle", &r, &d, 101_002, &caps);
        assert_eq!(again.offset, 1);
        assert_ne!(
            again.epoch, old.epoch,
            "a forgotten stream starts a new epoch"
        );
        assert_eq!(
            h.recover("chat.idle", 1, &old.epoch, 0, 300).recovered,
            false,
            "a client of the old stream is told it is gone"
        );
    }

    /// The topic quota: room for new topics is made by forgetting the
    /// longest-idle streams holding no publication and not in use, all or
    /// nothing; a quota made smaller is reached by the sweep the same way.
    #[test]
    fn room_for_new_topics_is_made_from_idle_streams_only() {
        let mut h = NsHistory::load("ns", Vec::new());
        let r = rule(100);
        let d = Bytes::from_static(b"x");
        for (i, t) in ["chat.1", "chat.2", "chat.3", "chat.4"].iter().enumerate() {
            h.append(t, &r, &d, 1_000 + i as u64, &CAPS);
        }
        // chat.1 and chat.2 hold publications; chat.3 and chat.4 none.
        h.sweep(&[r.clone()], 62_000, &CAPS, true, |_| false);
        h.append("chat.1", &r, &d, 70_000, &CAPS);
        h.append("chat.2", &r, &d, 70_000, &CAPS);
        h.take_pending();
        assert!(h.make_room(1, 5, |_| false), "fits without forgetting");
        assert!(h.take_forgotten().is_empty());
        // Four more under 5 needs three forgotten: only two streams are
        // idle, so none is.
        assert!(!h.make_room(4, 5, |_| false));
        assert_eq!(h.topic_count(), 4);
        assert!(h.take_forgotten().is_empty());
        // Two more: the idle two go; one more when chat.3 is in use: chat.4.
        assert!(!h.make_room(2, 4, |t| t == "chat.3"));
        assert!(h.make_room(1, 4, |t| t == "chat.3"));
        assert!(!h.has_topic("chat.4") && h.has_topic("chat.3"));
        assert_eq!(h.take_forgotten().len(), 1);
        assert!(h.make_room(1, 3, |_| false));
        assert!(!h.has_topic("chat.3"));
        assert_eq!(h.topic_count(), 2);
        assert_eq!(h.take_forgotten().len(), 1);
        // Streams with publications are never forgotten for room.
        assert!(!h.make_room(1, 2, |_| false));
        // A quota lowered under the count: the sweep forgets idle ones only.
        h.append("chat.5", &r, &d, 70_001, &CAPS);
        h.sweep(&[r.clone()], 130_002, &CAPS, true, |_| false);
        let caps = HistoryCaps {
            max_topics: 2,
            ..CAPS
        };
        // On a shared store the copy shrinks, the stored streams stay; on
        // the node's own store they go.
        h.sweep(&[r.clone()], 130_002, &caps, false, |_| false);
        assert_eq!(h.topic_count(), 2);
        assert!(h.take_forgotten().is_empty());
        let caps = HistoryCaps {
            max_topics: 1,
            ..CAPS
        };
        h.sweep(&[r.clone()], 130_002, &caps, true, |_| false);
        assert_eq!(h.topic_count(), 1);
        assert_eq!(h.take_forgotten().len(), 1);
    }

    /// An import with more topics than the `history_topics` quota is
    /// refused whole, before anything else is checked.
    #[test]
    fn an_import_past_the_topic_quota_is_refused() {
        let t = |name: &str| ExportedTopic {
            topic: name.into(),
            epoch: "e1".into(),
            top: 0,
            publications: Vec::new(),
        };
        let topics = vec![t("a"), t("b"), t("c")];
        assert_eq!(
            check_import(&topics, 1 << 20, 2).unwrap_err(),
            ImportError::TooManyTopics {
                topics: 3,
                max_topics: 2
            }
        );
        assert_eq!(check_import(&topics, 1 << 20, 3).unwrap().len(), 3);
    }

    fn staged(topic: &str, data: &str, size: u64) -> Staged {
        Staged {
            topic: topic.into(),
            data: Bytes::from(data.to_string()),
            timestamp: 1000,
            size,
        }
    }

    /// A sequencing transaction continues the meta the store holds (not
    /// this node's idea of it), starts a topic without one at 1 under the
    /// fresh epoch, trims the row `size` back, and writes each meta once.
    #[test]
    fn sequencing_continues_the_stored_meta() {
        let batch = [
            staged("chat.a", "1", 2),
            staged("chat.b", "2", 10),
            staged("chat.a", "3", 2),
        ];
        let (keys, topics) = sequence_keys("ns", &batch, &["chat.c".to_string()]);
        assert_eq!(topics, vec!["chat.a", "chat.b", "chat.c"]);
        assert_eq!(keys[0], meta_key("ns", "chat.a"));
        let stored = serde_json::to_vec(&Meta {
            epoch: "e1".into(),
            top: 7,
        })
        .unwrap();
        let fresh = vec!["fa".to_string(), "fb".to_string(), "fc".to_string()];
        let (ops, s) = plan_sequence("ns", &topics, &[Some(stored), None, None], &fresh, &batch);
        let pos: Vec<(u64, &str)> = s
            .positions
            .iter()
            .map(|p| (p.offset, p.epoch.as_str()))
            .collect();
        assert_eq!(pos, vec![(8, "e1"), (1, "fb"), (9, "e1")]);
        assert_eq!(
            s.topics[2].after,
            Meta {
                epoch: "fc".into(),
                top: 0
            }
        );
        let deletes: Vec<&Vec<u8>> = ops
            .iter()
            .filter_map(|o| match o {
                BatchOp::Delete(k) => Some(k),
                _ => None,
            })
            .collect();
        assert_eq!(
            deletes,
            vec![&pub_key("ns", "chat.a", 6), &pub_key("ns", "chat.a", 7)]
        );
        let metas = ops
            .iter()
            .filter(|o| matches!(o, BatchOp::Put(k, _) if k.starts_with(b"hist/ns/m/")))
            .count();
        assert_eq!(metas, 3, "one put per changed meta");
        // The same decision again on the same metas: the store may call it twice.
        let again = plan_sequence("ns", &topics, &[None, None, None], &fresh, &batch).1;
        assert_eq!(
            again.positions[0],
            Position {
                offset: 1,
                epoch: "fa".into()
            }
        );
    }

    /// A copy (this node's or a replica's) does not queue the deletion of
    /// the row `size` back, which the publication's own store write made;
    /// other trims (age, a rule made smaller) are queued.
    #[test]
    fn trims_the_store_write_made_are_not_queued_again() {
        let mut h = NsHistory::load("ns", Vec::new());
        let caps = HistoryCaps {
            max_size: 100,
            ..CAPS
        };
        let x = Bytes::from_static(b"x");
        for i in 1..=4u64 {
            h.append_at("chat.a", "e1", i, 1000, &x, &rule(2), &caps);
        }
        assert!(
            h.take_pending().is_empty(),
            "1 and 2 went with 3's and 4's writes"
        );
        // A replica's next publication, after the rule went down to 1: 4
        // (5 - 1) is the store's trim, 3 this copy's own.
        assert_eq!(
            h.apply_replica("chat.a", "e1", 5, 1000, &x, &rule(1), &caps),
            ReplicaStep::Appended
        );
        let deletes: Vec<Vec<u8>> = h
            .take_pending()
            .into_iter()
            .filter_map(|op| match op {
                BatchOp::Delete(k) => Some(k),
                BatchOp::Put(..) => None,
            })
            .collect();
        assert_eq!(deletes, vec![pub_key("ns", "chat.a", 3)]);
    }

    /// A copy kept from the mesh takes the next offset, drops a duplicate,
    /// and is behind on a gap or another epoch; adopting the store's state
    /// delivers what was missed, or says the subscribers cannot continue.
    #[test]
    fn replica_steps_and_adoption() {
        let mut h = NsHistory::load("ns", Vec::new());
        let r = rule(100);
        let d = Bytes::from_static(b"x");
        use ReplicaStep::{Appended, Behind, Duplicate};
        for (epoch, offset, step) in [
            ("e1", 2, Behind),
            ("e1", 1, Appended),
            ("e1", 2, Appended),
            ("e1", 2, Duplicate),
            ("e1", 4, Behind),
            ("e2", 3, Behind),
        ] {
            let got = h.apply_replica("chat.1", epoch, offset, 1, &d, &r, &CAPS);
            assert_eq!(got, step, "{epoch} {offset}");
        }
        let entry = |o| Entry {
            offset: o,
            timestamp: 1,
            data: d.clone(),
        };
        let meta = |e: &str, top| Meta {
            epoch: e.into(),
            top,
        };
        // The store holds 1..4 of e1: 3 and 4 are new here.
        let a = h.adopt(
            "chat.1",
            Some((meta("e1", 4), (1..=4).map(entry).collect())),
        );
        assert_eq!(
            (a.new.iter().map(|e| e.offset).collect::<Vec<_>>(), a.broken),
            (vec![3, 4], false)
        );
        assert_eq!(h.position("chat.1").unwrap().offset, 4);
        // 5 and 6 were trimmed before this node saw them: a gap.
        let a = h.adopt(
            "chat.1",
            Some((meta("e1", 8), (7..=8).map(entry).collect())),
        );
        assert!(a.broken && a.new.is_empty());
        // Another epoch.
        let a = h.adopt("chat.1", Some((meta("e2", 1), vec![entry(1)])));
        assert!(a.broken);
        assert_eq!(h.position("chat.1").unwrap().epoch, "e2");
        assert_eq!(h.bytes(), 1, "bytes follow the adopted copy");
    }

    /// Globs: wildcards `*` and `?` only; caps checked.
    #[test]
    fn rules_checked() {
        assert!(check_glob("chat.*").is_ok());
        assert!(check_glob("chat.[ab]").is_err());
        assert!(check_glob("").is_err());
        assert!(check_glob("a b").is_err());
        assert!(check_rules(&[rule(0)], &CAPS).is_err());
        assert!(check_rules(&[rule(1001)], &CAPS).is_err());
        assert!(check_rules(&[rule(10)], &CAPS).is_ok());
    }
}
