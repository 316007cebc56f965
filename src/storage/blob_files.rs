//! On sled, content-addressed blobs (`blob/<sha256>`) are files of their
//! own, `<data_dir>/blobs/<sha256>`, not values in the tree.
//!
//! Why: sled keeps up to 16 entries in one leaf page and writes a page
//! whose size is over a fraction of its segment as a file of its own, the
//! whole page each time it is rewritten; a deleted page's file goes only
//! when the segment that replaced it is retired, which few writes after a
//! delete never bring. Four 16 MiB site files cost 160 MiB of pages, and
//! six deploy/delete cycles grew the folder by 912 MiB with every blob
//! deleted. A file per blob costs its bytes and is gone when it is
//! deleted. Blobs are content-addressed and written whole, so a file is
//! written to a temporary name, synced, and renamed: a reader sees the
//! whole blob or none.
//!
//! The store's other semantics stay: a guarded change that deletes a blob
//! ([`super::SledStore::transact`]) removes its file under the same lock
//! as the change, so a guarded change after it (a writer's pin,
//! `blob_ledger.rs`) is ordered after the file is gone. Blobs stored in the
//! tree by an older version are still read, listed and deleted there.

use std::path::{Path, PathBuf};

/// The store keys kept as files: `blob/` and a name of 1 to 128 letters,
/// digits, `-` or `_` (a SHA-256 in hex; tests use shorter names).
const PREFIX: &[u8] = b"blob/";

/// The blob files of one sled store.
pub(crate) struct BlobFiles {
    /// `<data_dir>/blobs`.
    dir: PathBuf,
    /// Held by a guarded change from its read to its file deletions.
    pub(crate) lock: parking_lot::Mutex<()>,
}

impl BlobFiles {
    /// Opens (creates) `<data_dir>/blobs`, removing the temporary files of
    /// writes that did not finish.
    pub(crate) fn open(data_dir: &Path) -> std::io::Result<BlobFiles> {
        let dir = data_dir.join("blobs");
        std::fs::create_dir_all(&dir)?;
        for e in std::fs::read_dir(&dir)?.flatten() {
            if e.file_name().to_string_lossy().ends_with(".tmp") {
                let _ = std::fs::remove_file(e.path());
            }
        }
        Ok(BlobFiles {
            dir,
            lock: parking_lot::Mutex::new(()),
        })
    }

    /// The blob's name when `key` is one kept as a file.
    pub(crate) fn name(key: &[u8]) -> Option<&str> {
        let name = key.strip_prefix(PREFIX)?;
        let ok = !name.is_empty()
            && name.len() <= 128
            && name
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_');
        ok.then(|| std::str::from_utf8(name).ok()).flatten()
    }

    /// Whether a scan of `prefix` covers blob files.
    pub(crate) fn covers(prefix: &[u8]) -> bool {
        prefix.starts_with(PREFIX)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The blob's bytes, if its file is there.
    pub(crate) fn get(&self, name: &str) -> std::io::Result<Option<Vec<u8>>> {
        match std::fs::read(self.path(name)) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Writes the blob whole: a temporary file, synced, renamed over the name.
    pub(crate) fn put(&self, name: &str, value: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        let tmp = self.dir.join(format!(
            "{name}.{}.tmp",
            hex::encode(crate::util::random_bytes::<8>())
        ));
        let written = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(value)?;
            f.sync_all()?;
            std::fs::rename(&tmp, self.path(name))?;
            // The rename itself, durable.
            std::fs::File::open(&self.dir)?.sync_all()
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }

    /// Deletes the blob's file; whether it was there.
    pub(crate) fn delete(&self, name: &str) -> std::io::Result<bool> {
        match std::fs::remove_file(self.path(name)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The keys (`blob/<name>`) of the blob files starting with `prefix`,
    /// in order.
    pub(crate) fn keys(&self, prefix: &[u8]) -> std::io::Result<Vec<Vec<u8>>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir)? {
            let name = e?.file_name();
            let Some(name) = name.to_str() else { continue };
            let mut key = PREFIX.to_vec();
            key.extend_from_slice(name.as_bytes());
            if Self::name(&key).is_some() && key.starts_with(prefix) {
                out.push(key);
            }
        }
        out.sort();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A blob written is read back whole, listed, and gone once deleted; a
    /// key that is not a blob name is not one of them.
    #[test]
    fn blob_files_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let f = BlobFiles::open(dir.path()).unwrap();
        assert_eq!(BlobFiles::name(b"blob/ab12"), Some("ab12"));
        assert_eq!(BlobFiles::name(b"blob/../x"), None);
        assert_eq!(BlobFiles::name(b"blobs/x"), None);
        f.put("ab12", b"bytes").unwrap();
        assert_eq!(f.get("ab12").unwrap().as_deref(), Some(&b"bytes"[..]));
        assert_eq!(f.keys(b"blob/").unwrap(), vec![b"blob/ab12".to_vec()]);
        assert!(f.delete("ab12").unwrap());
        assert!(!f.delete("ab12").unwrap());
        assert_eq!(f.get("ab12").unwrap(), None);
    }
}
