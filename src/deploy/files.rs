//! Site files as the node serves them: one copy of a file in memory however
//! many requests are sending it.
//!
//! A static file is read whole from the store (up to `max_site_file_bytes`,
//! 64 MiB) and held until its client has read it. Read per request, thirty
//! clients reading one large file slowly held thirty copies; a site is public,
//! so anyone could. A file is named by its SHA-256 and never changes, so the
//! requests for it share one read: the first reads it from the store, the
//! others wait for that read, and each answer holds a reference to the one
//! copy, which goes when the last answer has been sent.

use crate::storage::{OrderedKv, Store, StoreResult, blob_key};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::{Arc, Weak};

/// One file's read, shared by the answers sending it.
type Open = tokio::sync::OnceCell<Vec<u8>>;

/// The site files being sent by this node, by SHA-256 (weak: an entry lives
/// as long as an answer holds its file).
#[derive(Default)]
pub struct SiteFiles {
    open: parking_lot::Mutex<HashMap<String, Weak<Open>>>,
}

/// Entries past which dead ones are dropped before a new one goes in.
const PRUNE_AT: usize = 1024;

/// An answer's hold on a shared file (the body's owner).
struct Held(Arc<Open>);

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        self.0.get().map_or(&[], Vec::as_slice)
    }
}

/// Why a read found nothing to share (not kept in the cell: the next
/// request reads again).
enum Missing {
    Absent,
    Store(crate::storage::StoreError),
}

impl SiteFiles {
    /// The file whose SHA-256 is `sha`, shared with every other request
    /// sending it now; None when the store has no such blob.
    pub async fn read(&self, store: &Store, sha: &str) -> StoreResult<Option<Bytes>> {
        let open = {
            let mut files = self.open.lock();
            match files.get(sha).and_then(Weak::upgrade) {
                Some(open) => open,
                None => {
                    if files.len() >= PRUNE_AT {
                        files.retain(|_, w| w.strong_count() > 0);
                    }
                    let open = Arc::new(Open::new());
                    files.insert(sha.to_string(), Arc::downgrade(&open));
                    open
                }
            }
        };
        let read = open
            .get_or_try_init(|| async {
                match store.get(&blob_key(sha)).await {
                    Ok(Some(v)) => Ok(v),
                    Ok(None) => Err(Missing::Absent),
                    Err(e) => Err(Missing::Store(e)),
                }
            })
            .await;
        match read {
            Ok(_) => Ok(Some(Bytes::from_owner(Held(open)))),
            Err(Missing::Absent) => Ok(None),
            Err(Missing::Store(e)) => Err(e),
        }
    }

    /// Files some answer holds now.
    pub fn open_count(&self) -> usize {
        self.open
            .lock()
            .values()
            .filter(|w| w.strong_count() > 0)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::BatchOp;

    /// Answers sending one file at the same time share one copy of it
    /// (read once from the store); once none holds it, it is gone from
    /// memory; a file the store lacks is None, and the next request asks
    /// the store again.
    #[tokio::test]
    async fn answers_sending_one_file_share_one_copy() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        let data = vec![7u8; 1 << 20];
        store
            .apply_batch(vec![BatchOp::Put(blob_key("aa"), data.clone())])
            .await
            .unwrap();
        let files = SiteFiles::default();
        let (a, b) = tokio::join!(files.read(&store, "aa"), files.read(&store, "aa"));
        let (a, b) = (a.unwrap().unwrap(), b.unwrap().unwrap());
        assert_eq!(&a[..], &data[..]);
        assert_eq!(a.as_ptr(), b.as_ptr(), "one copy for both");
        let c = files.read(&store, "aa").await.unwrap().unwrap();
        assert_eq!(c.as_ptr(), a.as_ptr(), "and for a third while they hold it");
        // A slice of an answer (a range, a chunk) still holds the copy.
        let part = a.slice(10..20);
        drop((a, b, c));
        assert_eq!(files.open_count(), 1);
        drop(part);
        assert_eq!(files.open_count(), 0, "gone with the last answer");
        assert!(files.read(&store, "bb").await.unwrap().is_none());
        store
            .apply_batch(vec![BatchOp::Put(blob_key("bb"), b"late".to_vec())])
            .await
            .unwrap();
        let late = files.read(&store, "bb").await.unwrap().unwrap();
        assert_eq!(&late[..], b"late", "a miss is not remembered");
    }
}
