//! The namespace records as their owners published them: the read-only
//! snapshots every other room reads (the chain's namespace rate limit, the
//! cluster forwarder's members, token issue's claims provider). `Locate`,
//! which decides whether a supervisor starts, reads the store itself.
//!
//! A namespace's record has one owner: its supervisor, where one runs on
//! this node. The supervisor publishes the record here when it loads it and
//! whenever it changes it (`SetClaimsProvider`), and takes it back when it
//! stops. Where none runs (a node that only forwards for the namespace, or
//! before its first use) a reader loads the record from the store, and that
//! copy is kept for at most [`RECORD_TTL`].
//!
//! A namespace found missing is remembered for [`MISSING_TTL`] (bounded by
//! [`MISSING_CAPACITY`]), by `get` and by [`Records::load`] (what `Locate`
//! reads): requests for a name that does not exist cost one store read per
//! name per TTL, not two or three each (an etcd round trip each in a
//! cluster). The name is forgotten as soon as the namespace may exist: it is
//! created on this node ([`Records::created`]), its owner publishes it, or
//! `actors/watch.rs` sees its record written on another node.
//!
//! In a cluster the record may change on another node: `actors/watch.rs` watches
//! `ns/` in the store and, on a change, has the running supervisor reload
//! (which republishes) or drops the read copy; on a delete it stops the
//! supervisor. The TTL is the safety net while that watch is being made
//! again.

#![forbid(unsafe_code)]

use crate::namespace::{NamespaceRecord, ns_key};
use crate::storage::{Store, StoreError};
use crate::util::{Clock, SystemClock};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a record read by a non-owner is trusted.
pub const RECORD_TTL: Duration = Duration::from_secs(2);

/// Read copies kept at most; past it the stale ones go, then all of them.
const READ_CAPACITY: usize = 10_000;

/// How long a namespace read as missing is answered missing without a store
/// read. Short: a namespace created on another node is seen through the
/// record watch at once, and this bounds the wait while that watch is down.
pub const MISSING_TTL: Duration = Duration::from_secs(1);

/// Missing names remembered at most; past it the stale ones go, then all.
pub const MISSING_CAPACITY: usize = 10_000;

/// How a snapshot is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// Published by the namespace's running supervisor (its stats id, so a
    /// supervisor that passivated never takes back its successor's record):
    /// current until it publishes again or stops.
    Owner(u64),
    /// Read from the store by a non-owner at this instant.
    Read(Instant),
}

struct Entry {
    /// The namespace's record, shared with readers without a copy.
    record: Arc<NamespaceRecord>,
    /// Whether the owner published it (current) or a reader read it (trusted for `RECORD_TTL`).
    source: Source,
}

/// The node's directory of published namespace records. Cheap to clone.
#[derive(Clone)]
pub struct Records(Arc<Inner>);

struct Inner {
    /// Where records are read when no supervisor on this node published one.
    store: Store,
    /// Ages the read copies; a `ManualClock` in tests.
    clock: Arc<dyn Clock>,
    /// Snapshots by namespace name; read copies bounded by `READ_CAPACITY`.
    map: RwLock<HashMap<String, Entry>>,
    /// Names read as missing, with when; bounded by `MISSING_CAPACITY`.
    missing: Mutex<HashMap<String, Instant>>,
    /// Moved whenever a namespace may have come to exist (created here,
    /// published, a record change seen): a miss read before it moved is not
    /// remembered, so a create racing the read is never hidden.
    epoch: AtomicU64,
    /// Store reads of records made here (`get` and `load`), for tests.
    reads: AtomicU64,
}

impl Records {
    /// An empty directory reading missing records from `store`.
    pub fn new(store: Store) -> Self {
        Self::with_clock(store, Arc::new(SystemClock))
    }

    /// The same with the clock that ages read copies (tests move it by hand).
    pub fn with_clock(store: Store, clock: Arc<dyn Clock>) -> Self {
        Records(Arc::new(Inner {
            store,
            clock,
            map: RwLock::new(HashMap::new()),
            missing: Mutex::new(HashMap::new()),
            epoch: AtomicU64::new(0),
            reads: AtomicU64::new(0),
        }))
    }

    /// Reads `ns`'s record from the store (one read, counted); a miss is
    /// remembered for [`MISSING_TTL`] unless the namespace may have come to
    /// exist meanwhile.
    async fn read(&self, ns: &str) -> Result<Option<NamespaceRecord>, StoreError> {
        let epoch = self.0.epoch.load(Ordering::Acquire);
        self.0.reads.fetch_add(1, Ordering::Relaxed);
        let rec = self
            .0
            .store
            .get_json::<NamespaceRecord>(&ns_key(ns))
            .await?;
        if rec.is_none() {
            let mut missing = self.0.missing.lock();
            if self.0.epoch.load(Ordering::Acquire) == epoch {
                let now = self.0.clock.now();
                if missing.len() >= MISSING_CAPACITY {
                    missing.retain(|_, at| now.saturating_duration_since(*at) < MISSING_TTL);
                    if missing.len() >= MISSING_CAPACITY {
                        missing.clear();
                    }
                }
                missing.insert(ns.to_string(), now);
            }
        }
        Ok(rec)
    }

    /// Whether `ns` was read as missing less than [`MISSING_TTL`] ago.
    fn known_missing(&self, ns: &str) -> bool {
        let missing = self.0.missing.lock();
        missing
            .get(ns)
            .is_some_and(|at| self.0.clock.now().saturating_duration_since(*at) < MISSING_TTL)
    }

    /// The record of `ns` as the store holds it now, never a read copy
    /// (`Locate` decides on it whether to start a supervisor); None, without
    /// a read, while the name is remembered missing.
    pub async fn load(&self, ns: &str) -> Result<Option<NamespaceRecord>, StoreError> {
        if self.known_missing(ns) {
            return Ok(None);
        }
        self.read(ns).await
    }

    /// `ns` may exist now (created on this node, its record written
    /// elsewhere): it is no longer answered missing, and a miss being read
    /// right now is not remembered.
    pub fn created(&self, ns: &str) {
        self.0.epoch.fetch_add(1, Ordering::AcqRel);
        self.0.missing.lock().remove(ns);
    }

    /// How many times records were read from the store here.
    pub fn store_reads(&self) -> u64 {
        self.0.reads.load(Ordering::Relaxed)
    }

    /// The record of `ns`: its owner's snapshot, a fresh read copy, or the
    /// store's (kept for [`RECORD_TTL`]). None when the namespace does not
    /// exist; that is remembered for [`MISSING_TTL`] until the namespace is
    /// created here or its record is seen written elsewhere.
    pub async fn get(&self, ns: &str) -> Result<Option<Arc<NamespaceRecord>>, StoreError> {
        if let Some(r) = self.cached(ns) {
            return Ok(Some(r));
        }
        if self.known_missing(ns) {
            return Ok(None);
        }
        let read = self.0.clock.now();
        let rec = self.read(ns).await?;
        let mut map = self.0.map.write();
        // The owner may have published while we read: its snapshot wins.
        if let Some(e) = map.get(ns)
            && matches!(e.source, Source::Owner(_))
        {
            return Ok(Some(e.record.clone()));
        }
        let Some(rec) = rec else {
            map.remove(ns);
            return Ok(None);
        };
        let rec = Arc::new(rec);
        if map.len() >= READ_CAPACITY {
            let now = self.0.clock.now();
            map.retain(|_, e| fresh(e.source, now));
            if map.len() >= READ_CAPACITY {
                map.retain(|_, e| matches!(e.source, Source::Owner(_)));
            }
        }
        map.insert(
            ns.to_string(),
            Entry {
                record: rec.clone(),
                source: Source::Read(read),
            },
        );
        Ok(Some(rec))
    }

    /// The snapshot of `ns` if one is current, without reading the store.
    pub fn cached(&self, ns: &str) -> Option<Arc<NamespaceRecord>> {
        let map = self.0.map.read();
        let e = map.get(ns)?;
        match e.source {
            Source::Owner(_) => Some(e.record.clone()),
            Source::Read(_) if fresh(e.source, self.0.clock.now()) => Some(e.record.clone()),
            Source::Read(_) => None,
        }
    }

    /// The owner (its stats id) publishes its record (None: the namespace is gone).
    pub(crate) fn publish(&self, ns: &str, owner: u64, record: Option<&NamespaceRecord>) {
        if record.is_some() {
            self.created(ns);
        }
        let mut map = self.0.map.write();
        match record {
            Some(r) => {
                map.insert(
                    ns.to_string(),
                    Entry {
                        record: Arc::new(r.clone()),
                        source: Source::Owner(owner),
                    },
                );
            }
            None => {
                map.remove(ns);
            }
        }
    }

    /// The owner stopped: readers go back to the store.
    pub(crate) fn retire(&self, ns: &str, owner: u64) {
        let mut map = self.0.map.write();
        if map
            .get(ns)
            .is_some_and(|e| e.source == Source::Owner(owner))
        {
            map.remove(ns);
        }
    }

    /// The owner passivates: its snapshot becomes a read copy, trusted for
    /// [`RECORD_TTL`] from now like any other (then the store is read again).
    /// A successor's snapshot (another owner id) is left alone.
    pub(crate) fn hand_back(&self, ns: &str, owner: u64) {
        let now = self.0.clock.now();
        let mut map = self.0.map.write();
        if let Some(e) = map.get_mut(ns)
            && e.source == Source::Owner(owner)
        {
            e.source = Source::Read(now);
        }
    }

    /// Drops a read copy (the record changed in the store); an owner's
    /// Drops every read copy and moves the epoch on (a broken record watch
    /// was made again: changes may have been missed meanwhile).
    pub fn refresh_all(&self) {
        self.0
            .map
            .write()
            .retain(|_, e| matches!(e.source, Source::Owner(_)));
        self.0.epoch.fetch_add(1, Ordering::AcqRel);
        self.0.missing.lock().clear();
    }

    /// snapshot stays until the owner republishes.
    pub fn forget_read(&self, ns: &str) {
        self.created(ns);
        let mut map = self.0.map.write();
        if map
            .get(ns)
            .is_some_and(|e| !matches!(e.source, Source::Owner(_)))
        {
            map.remove(ns);
        }
    }
}

fn fresh(source: Source, now: Instant) -> bool {
    match source {
        Source::Owner(_) => true,
        Source::Read(at) => now.saturating_duration_since(at) < RECORD_TTL,
    }
}

/// The namespace a changed store key names, if it is a record's (`ns/<name>`).
pub fn changed_namespace(key: &[u8]) -> Option<&str> {
    let name = std::str::from_utf8(key.strip_prefix(b"ns/")?).ok()?;
    (!name.is_empty() && !name.contains('/')).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::ManualClock;

    fn record(name: &str, rate: Option<u32>) -> NamespaceRecord {
        NamespaceRecord {
            rate_per_minute: rate,
            ..NamespaceRecord::new(name, 1)
        }
    }

    fn store() -> (Store, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        (Store::open_sled(dir.path()).unwrap(), dir)
    }

    #[actix_rt::test]
    async fn a_read_copy_is_kept_for_the_ttl_then_read_again() {
        let (store, _dir) = store();
        let clock = Arc::new(ManualClock::default());
        let records = Records::with_clock(store.clone(), clock.clone());
        store
            .put_json(&ns_key("a"), &record("a", Some(10)))
            .await
            .unwrap();
        assert_eq!(
            records.get("a").await.unwrap().unwrap().rate_per_minute,
            Some(10)
        );
        store
            .put_json(&ns_key("a"), &record("a", Some(20)))
            .await
            .unwrap();
        // Within the TTL the copy stands; past it the store is read again.
        assert_eq!(
            records.get("a").await.unwrap().unwrap().rate_per_minute,
            Some(10)
        );
        clock.advance(RECORD_TTL);
        assert!(records.cached("a").is_none());
        assert_eq!(
            records.get("a").await.unwrap().unwrap().rate_per_minute,
            Some(20)
        );
    }

    #[actix_rt::test]
    async fn the_owners_snapshot_wins_and_never_ages() {
        let (store, _dir) = store();
        let clock = Arc::new(ManualClock::default());
        let records = Records::with_clock(store.clone(), clock.clone());
        store
            .put_json(&ns_key("a"), &record("a", Some(10)))
            .await
            .unwrap();
        records.publish("a", 1, Some(&record("a", Some(30))));
        clock.advance(RECORD_TTL * 10);
        assert_eq!(
            records.get("a").await.unwrap().unwrap().rate_per_minute,
            Some(30)
        );
        // A store change does not drop it: the owner reloads and republishes.
        records.forget_read("a");
        assert_eq!(records.cached("a").unwrap().rate_per_minute, Some(30));
        // Once the owner stops, readers go to the store again.
        records.retire("a", 1);
        assert_eq!(
            records.get("a").await.unwrap().unwrap().rate_per_minute,
            Some(10)
        );
    }

    /// Many requests for a namespace that does not exist, through `get`
    /// and `load` (what `Locate` reads): one store read per name per
    /// `MISSING_TTL`, and one more once it has passed.
    #[actix_rt::test]
    async fn a_missing_namespace_costs_one_read_per_ttl() {
        let (store, _dir) = store();
        let clock = Arc::new(ManualClock::default());
        let records = Records::with_clock(store.clone(), clock.clone());
        for _ in 0..10 {
            assert!(records.get("ghost").await.unwrap().is_none());
            assert!(records.load("ghost").await.unwrap().is_none());
        }
        assert_eq!(records.store_reads(), 1);
        assert!(records.get("other").await.unwrap().is_none());
        assert_eq!(records.store_reads(), 2, "one read per name");
        clock.advance(MISSING_TTL);
        assert!(records.load("ghost").await.unwrap().is_none());
        assert_eq!(records.store_reads(), 3, "read again past the TTL");
    }

    /// A namespace read as missing and then created is found at once: on
    /// this node (`created`), by the record watch (`forget_read`) and when
    /// its owner publishes it.
    #[actix_rt::test]
    async fn a_namespace_created_after_a_miss_is_found_at_once() {
        let (store, _dir) = store();
        let clock = Arc::new(ManualClock::default());
        let records = Records::with_clock(store.clone(), clock.clone());
        for ns in ["here", "there", "owned"] {
            assert!(records.get(ns).await.unwrap().is_none());
            store
                .put_json(&ns_key(ns), &record(ns, None))
                .await
                .unwrap();
        }
        records.created("here");
        assert!(records.get("here").await.unwrap().is_some());
        records.forget_read("there");
        assert!(records.load("there").await.unwrap().is_some());
        records.publish("owned", 1, Some(&record("owned", None)));
        assert!(records.get("owned").await.unwrap().is_some());
        // The owner publishing a delete removes the snapshot.
        records.publish("owned", 1, None);
        assert!(records.cached("owned").is_none());
    }

    /// Requests for ever new missing names: the remembered set never holds
    /// more than `MISSING_CAPACITY`.
    #[actix_rt::test]
    async fn missing_names_are_bounded() {
        let (store, _dir) = store();
        let records = Records::new(store.clone());
        for i in 0..MISSING_CAPACITY + 5 {
            assert!(records.load(&format!("n{i}")).await.unwrap().is_none());
        }
        assert!(records.0.missing.lock().len() <= MISSING_CAPACITY);
    }

    /// A passivating owner hands its snapshot back as a read copy that ages
    /// like any other; it never touches a successor's snapshot.
    #[actix_rt::test]
    async fn a_handed_back_snapshot_is_a_read_copy() {
        let (store, _dir) = store();
        let clock = Arc::new(ManualClock::default());
        let records = Records::with_clock(store.clone(), clock.clone());
        store
            .put_json(&ns_key("a"), &record("a", Some(10)))
            .await
            .unwrap();
        records.publish("a", 1, Some(&record("a", Some(30))));
        records.hand_back("a", 1);
        assert_eq!(records.cached("a").unwrap().rate_per_minute, Some(30));
        clock.advance(RECORD_TTL);
        assert!(records.cached("a").is_none());
        // The successor (owner 2) publishes; the old owner's late calls leave it.
        records.publish("a", 2, Some(&record("a", Some(40))));
        records.hand_back("a", 1);
        records.retire("a", 1);
        clock.advance(RECORD_TTL * 10);
        assert_eq!(records.cached("a").unwrap().rate_per_minute, Some(40));
    }

    #[test]
    fn only_record_keys_name_a_namespace() {
        assert_eq!(changed_namespace(b"ns/acme"), Some("acme"));
        assert_eq!(changed_namespace(b"ns/"), None);
        assert_eq!(changed_namespace(b"nskeys/acme/x"), None);
        assert_eq!(changed_namespace(b"ns/acme/x"), None);
    }
}
