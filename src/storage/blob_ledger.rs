//! Which content-addressed blobs (`blob/<sha256>`, [`blob_key`]) are still
//! named by a record, and the sweep that deletes the others.
//!
//! A blob is shared: two namespaces, two versions of one function, or two
//! versions of one site that store the same bytes store them once. So a
//! record's deletion cannot delete its blobs; a sweep does, by mark and
//! sweep: every blob a record names (function versions, deployment
//! versions' site files: [`NAMING_PREFIXES`]) is kept, every other blob is
//! deleted. Without it a deleted site or function kept its bytes for ever
//! (nine deploy/delete cycles of a 257 KB tarball unpacking to 252 MiB grew
//! the store by 7 GB).
//!
//! The race: a writer stores a blob (or finds it already there), then
//! writes the record naming it; a sweep that marked before the record and
//! deletes after the writer found the blob would leave the record naming
//! nothing. So a writer first **pins** each blob it is about to use: one
//! guarded change that writes a new random stamp for the blob
//! (`blobstamp/<sha>`) and a pin (`blobpin/<sha>/<stamp>`, its value the
//! pin's unix seconds), and removes the pin once its record is written (or
//! its change failed). A sweep reads the stamps first, then the pins, then
//! marks, and deletes a blob only in a guarded change that finds its stamp
//! unchanged. A writer that pinned before the sweep read the stamps is seen
//! by its pin, or (its pin gone) its record was written before the mark; one
//! that pinned after changed the stamp. Both backends guard the same way
//! ([`Store::transact`]), so this holds on sled and across an etcd cluster.
//! A pin whose writer died is ignored, and removed, after [`PIN_TTL`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use super::{BatchOp, OrderedKv, Store, StoreResult, blob_key};

/// Prefix of the content-addressed blobs.
const BLOB_PREFIX: &[u8] = b"blob/";
/// `blobstamp/<sha>`: the random stamp of the blob's last pin.
const STAMP_PREFIX: &[u8] = b"blobstamp/";
/// `blobpin/<sha>/<stamp>`: a writer about to name the blob in a record.
const PIN_PREFIX: &[u8] = b"blobpin/";
/// A key never written: the journal argument of a key scan that has none.
const NO_JOURNAL: &[u8] = b"_blobs/no-journal";
/// How long a pin protects its blob: far longer than any deploy or import
/// takes (a pin left by a writer that died is removed after it).
pub const PIN_TTL: Duration = Duration::from_secs(3600);
/// Pins written in one guarded change (two writes each).
const PINS_PER_CHANGE: usize = 32;

fn stamp_key(sha: &str) -> Vec<u8> {
    let mut k = STAMP_PREFIX.to_vec();
    k.extend_from_slice(sha.as_bytes());
    k
}

fn pin_key(sha: &str, stamp: &str) -> Vec<u8> {
    format!("blobpin/{sha}/{stamp}").into_bytes()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The pins of one writer's blobs ([`pin`]). [`BlobPins::release`] once the
/// records naming them are written, or the change failed; dropped without
/// it, the pins are removed in a task.
pub struct BlobPins {
    /// The store the pins are in.
    store: Store,
    /// The pin keys; empty once released.
    keys: Vec<Vec<u8>>,
}

impl BlobPins {
    /// Removes the pins: from now on only records keep the blobs.
    pub async fn release(mut self) {
        let keys = std::mem::take(&mut self.keys);
        remove_pins(&self.store, keys).await;
    }
}

impl Drop for BlobPins {
    fn drop(&mut self) {
        let keys = std::mem::take(&mut self.keys);
        if keys.is_empty() {
            return;
        }
        let store = self.store.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { remove_pins(&store, keys).await });
        }
    }
}

async fn remove_pins(store: &Store, keys: Vec<Vec<u8>>) {
    for chunk in keys.chunks(PINS_PER_CHANGE * 2) {
        let ops = chunk.iter().cloned().map(BatchOp::Delete).collect();
        if let Err(e) = store.apply_batch(ops).await {
            tracing::warn!(error = %e, "Could not remove blob pins; they lapse by themselves.");
        }
    }
}

/// Pins each of `shas` before the caller stores it or names it in a record
/// (see the module's doc): until released, no sweep deletes them.
pub async fn pin<'a>(
    store: &Store,
    shas: impl IntoIterator<Item = &'a str>,
) -> StoreResult<BlobPins> {
    let shas: BTreeSet<&str> = shas.into_iter().collect();
    let shas: Vec<&str> = shas.into_iter().collect();
    let mut pins = BlobPins {
        store: store.clone(),
        keys: Vec::with_capacity(shas.len()),
    };
    let now = unix_now().to_string().into_bytes();
    for chunk in shas.chunks(PINS_PER_CHANGE) {
        let stamps: Vec<(Vec<u8>, String)> = chunk
            .iter()
            .map(|sha| {
                let stamp = hex::encode(crate::util::random_bytes::<16>());
                (stamp_key(sha), stamp)
            })
            .collect();
        let keys: Vec<Vec<u8>> = stamps.iter().map(|(k, _)| k.clone()).collect();
        let ops: Vec<BatchOp> = chunk
            .iter()
            .zip(&stamps)
            .flat_map(|(sha, (k, stamp))| {
                [
                    BatchOp::Put(k.clone(), stamp.clone().into_bytes()),
                    BatchOp::Put(pin_key(sha, stamp), now.clone()),
                ]
            })
            .collect();
        // Guarded on the stamps: a sweep deciding on one of these blobs
        // sees its stamp change (the values written do not depend on the
        // ones read).
        store
            .transact::<(), (), _>(&keys, None, |_| Ok((ops.clone(), ())))
            .await?;
        pins.keys.extend(
            chunk
                .iter()
                .zip(&stamps)
                .map(|(sha, (_, stamp))| pin_key(sha, stamp)),
        );
    }
    Ok(pins)
}

/// What a sweep read before it marks: every blob, the stamps and the
/// blobs pinned now ([`snapshot`]).
pub struct Snapshot {
    /// Every stored blob's SHA-256 (hex).
    blobs: BTreeSet<String>,
    /// Each stamp, by SHA-256.
    stamps: BTreeMap<String, Vec<u8>>,
    /// Blobs with a pin younger than [`PIN_TTL`].
    pinned: BTreeSet<String>,
}

/// The store prefixes whose records name blobs: function versions
/// (`fnver/<ns>/<name>/<version>`, the module's `sha256`) and deployment
/// versions (`depv/<ns>/<name>/<version>`, each site file's `sha256`).
/// A new kind of record that names a blob is added here.
pub const NAMING_PREFIXES: [&[u8]; 2] = [b"fnver/", b"depv/"];

/// Every blob a record under [`NAMING_PREFIXES`] names: each `"sha256"`
/// string anywhere in its JSON, so a field added to a record later is
/// still seen. A record that is not JSON fails the mark (`Corrupt`), and so
/// does one the store refuses (its MAC fails: [`Store::scan_all_strict`]): a
/// sweep that cannot read every record deletes nothing.
pub async fn mark(store: &Store) -> StoreResult<BTreeSet<String>> {
    fn walk(v: &serde_json::Value, out: &mut BTreeSet<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match v {
                        serde_json::Value::String(s) if k == "sha256" => {
                            out.insert(s.clone());
                        }
                        other => walk(other, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut live = BTreeSet::new();
    for prefix in NAMING_PREFIXES {
        for (k, v) in store.scan_all_strict(prefix).await? {
            let json: serde_json::Value = serde_json::from_slice(&v)
                .map_err(|_| super::StoreError::Corrupt(String::from_utf8_lossy(&k).into()))?;
            walk(&json, &mut live);
        }
    }
    Ok(live)
}

/// One whole sweep: [`snapshot`], [`mark`], [`collect`].
pub async fn sweep(store: &Store) -> StoreResult<Swept> {
    let snap = snapshot(store).await?;
    let live = mark(store).await?;
    collect(store, snap, &live).await
}

/// What one sweep did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    /// Blobs stored when the sweep began.
    pub blobs: usize,
    /// Blobs deleted.
    pub deleted: usize,
    /// The SHA-256 (hex) of each blob stored when the sweep began that it
    /// did not delete: what the caller keeps derived data of (the compiled
    /// modules' cache, `src/node.rs`); storage never reaches into it.
    pub kept: BTreeSet<String>,
}

/// The first half of a sweep, before the caller marks: reads the stamps,
/// then the pins (removing those older than [`PIN_TTL`]), then the blobs'
/// keys (never their bytes).
pub async fn snapshot(store: &Store) -> StoreResult<Snapshot> {
    let stamps = store
        .scan_all(STAMP_PREFIX)
        .await?
        .into_iter()
        .filter_map(|(k, v)| {
            let sha = std::str::from_utf8(&k[STAMP_PREFIX.len()..]).ok()?;
            Some((sha.to_string(), v))
        })
        .collect();
    let now = unix_now();
    let mut pinned = BTreeSet::new();
    let mut stale = Vec::new();
    for (k, v) in store.scan_all(PIN_PREFIX).await? {
        let Some(sha) = std::str::from_utf8(&k[PIN_PREFIX.len()..])
            .ok()
            .and_then(|rest| rest.split_once('/'))
            .map(|(sha, _)| sha.to_string())
        else {
            continue;
        };
        let at = std::str::from_utf8(&v)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0);
        if now.saturating_sub(at) > PIN_TTL.as_secs() {
            stale.push(k);
        } else {
            pinned.insert(sha);
        }
    }
    if !stale.is_empty() {
        remove_pins(store, stale).await;
    }
    let blobs = store
        .scan_keys_unless(BLOB_PREFIX, usize::MAX, NO_JOURNAL)
        .await?
        .unwrap_or_default()
        .into_iter()
        .filter_map(|k| {
            std::str::from_utf8(&k[BLOB_PREFIX.len()..])
                .ok()
                .map(str::to_string)
        })
        .collect();
    Ok(Snapshot {
        blobs,
        stamps,
        pinned,
    })
}

/// The second half of a sweep, after the caller marked `live` (every blob
/// a record names, read after [`snapshot`]): deletes each other blob not
/// pinned, with its stamp, in a change guarded on the stamp being the one
/// the snapshot read. Stamps of blobs no longer stored go the same way.
pub async fn collect(store: &Store, snap: Snapshot, live: &BTreeSet<String>) -> StoreResult<Swept> {
    let mut swept = Swept {
        blobs: snap.blobs.len(),
        deleted: 0,
        kept: snap.blobs.clone(),
    };
    let candidates: BTreeSet<&String> = snap.blobs.iter().chain(snap.stamps.keys()).collect();
    for sha in candidates {
        if live.contains(sha) || snap.pinned.contains(sha) {
            continue;
        }
        let expected = snap.stamps.get(sha).cloned();
        let stamp = stamp_key(sha);
        let blob = blob_key(sha);
        let deleted = store
            .transact::<bool, (), _>(std::slice::from_ref(&stamp), None, |found| {
                if found.first().cloned().flatten() != expected {
                    // Pinned since the snapshot: a writer is about to use it.
                    return Ok((Vec::new(), false));
                }
                Ok((
                    vec![
                        BatchOp::Delete(blob.clone()),
                        BatchOp::Delete(stamp.clone()),
                    ],
                    true,
                ))
            })
            .await?;
        if matches!(deleted, Some(Ok(true))) && snap.blobs.contains(sha) {
            swept.deleted += 1;
            swept.kept.remove(sha);
        }
    }
    Ok(swept)
}

/// Asks the node's blob sweeper for a sweep soon ([`SweepRequests::wanted`]):
/// after a change that may leave blobs unused. Requests made while a sweep
/// runs are answered by one more sweep, never one each.
#[derive(Clone, Default)]
pub struct SweepRequests {
    /// Woken once for any number of requests.
    notify: Arc<tokio::sync::Notify>,
}

impl SweepRequests {
    /// Asks for a sweep.
    pub fn request(&self) {
        self.notify.notify_one();
    }

    /// Waits until a sweep is asked for.
    pub async fn wanted(&self) {
        self.notify.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn put_blob(store: &Store, sha: &str) {
        store.put(&blob_key(sha), b"bytes").await.unwrap();
    }

    async fn sweep_with(store: &Store, live: &[&str]) -> Swept {
        let snap = snapshot(store).await.unwrap();
        let live = live.iter().map(|s| s.to_string()).collect();
        collect(store, snap, &live).await.unwrap()
    }

    /// Obeyed: a blob a record names stays, one no record names goes with
    /// its stamp; a pinned blob stays until its pin is released.
    #[tokio::test]
    async fn sweep_keeps_live_and_pinned_blobs() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        put_blob(&store, "aa").await;
        put_blob(&store, "bb").await;
        let pins = pin(&store, ["cc"]).await.unwrap();
        put_blob(&store, "cc").await;
        let s = sweep_with(&store, &["aa"]).await;
        assert_eq!((s.blobs, s.deleted), (3, 1));
        assert_eq!(s.kept, ["aa", "cc"].into_iter().map(String::from).collect());
        assert!(store.get(&blob_key("aa")).await.unwrap().is_some());
        assert!(store.get(&blob_key("bb")).await.unwrap().is_none());
        assert!(store.get(&blob_key("cc")).await.unwrap().is_some());
        pins.release().await;
        let s = sweep_with(&store, &["aa"]).await;
        assert_eq!(s.deleted, 1);
        assert!(store.get(&blob_key("cc")).await.unwrap().is_none());
        assert!(store.get(&stamp_key("cc")).await.unwrap().is_none());
        assert!(store.scan_all(PIN_PREFIX).await.unwrap().is_empty());
    }

    /// A record the store refuses (a store writer's edit: no valid MAC)
    /// fails the mark, so the sweep deletes nothing: the blob the genuine
    /// record named stays. (A scan that left the record out would have
    /// deleted it.)
    #[tokio::test]
    async fn a_refused_record_stops_the_sweep() {
        use crate::storage::{OrderedKv, RecordMac};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        store
            .adopt_record_macs(RecordMac::derive(b"secret"), true)
            .await
            .unwrap();
        let bytes = b"bank's module";
        let sha = hex::encode(ring::digest::digest(&ring::digest::SHA256, bytes));
        let key = b"fnver/bank/pay/0000000001";
        let record = format!(r#"{{"version":1,"sha256":"{sha}"}}"#);
        store.put(key, record.as_bytes()).await.unwrap();
        store.put(&blob_key(&sha), bytes).await.unwrap();
        assert_eq!(sweep(&store).await.unwrap().deleted, 0);
        // The writer's edit, without the MAC it cannot make.
        let sled = store.as_sled().unwrap();
        sled.put(key, br#"{"version":1,"sha256":"ee"}"#)
            .await
            .unwrap();
        assert!(sweep(&store).await.is_err());
        assert_eq!(
            store.get(&blob_key(&sha)).await.unwrap().as_deref(),
            Some(&bytes[..])
        );
    }

    /// The mark reads every `sha256` a function or deployment version
    /// names, however deep; a record that is not JSON stops the sweep
    /// before anything is deleted.
    #[tokio::test]
    async fn mark_reads_function_and_site_versions() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        store
            .put(b"fnver/ns/f/0000000001", br#"{"version":1,"sha256":"aa"}"#)
            .await
            .unwrap();
        store
            .put(
                b"depv/ns/site/00000000000000000001",
                br#"{"target":{"kind":"static","files":{"a":{"sha256":"bb","size":1}}}}"#,
            )
            .await
            .unwrap();
        store.put(b"fn/ns/f", br#"{"sha256":"cc"}"#).await.unwrap();
        let live = mark(&store).await.unwrap();
        assert_eq!(live, ["aa", "bb"].iter().map(|s| s.to_string()).collect());
        put_blob(&store, "dd").await;
        store.put(b"depv/ns/x/1", b"not json").await.unwrap();
        assert!(sweep(&store).await.is_err());
        assert!(store.get(&blob_key("dd")).await.unwrap().is_some());
    }

    /// Violated race: a writer pins a blob after a sweep's snapshot and
    /// before its collect (its record written later than the mark); the
    /// sweep finds the stamp changed and leaves the blob.
    #[tokio::test]
    async fn a_pin_during_a_sweep_keeps_the_blob() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        put_blob(&store, "aa").await;
        let snap = snapshot(&store).await.unwrap();
        // The writer: pins, finds the blob there, writes its record, releases.
        let pins = pin(&store, ["aa"]).await.unwrap();
        pins.release().await;
        // The sweep marked before that record: "aa" looks unused.
        let s = collect(&store, snap, &BTreeSet::new()).await.unwrap();
        assert_eq!(s.deleted, 0);
        assert!(store.get(&blob_key("aa")).await.unwrap().is_some());
    }
}
