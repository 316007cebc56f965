//! The on-disk cache of compiled artifacts, so a restart does not recompile.
//!
//! A file is `<sha256 of the wasm>-<engine fingerprint>.cwasm`; the fingerprint
//! covers the wasmtime version and every compiler setting, so an artifact is
//! only ever loaded by an engine that could have written it.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use wasmtime::{Engine, Module};

use super::error::{Result, WasmError};

/// Compiled modules on disk, one file per module and engine fingerprint.
pub(crate) struct ArtifactCache {
    /// The folder of the `.cwasm` files, created at start.
    dir: PathBuf,
    /// 16 hex digits of the engine's compatibility hash, in every file name.
    fingerprint: String,
    /// Modules loaded from a file ([`WasmEngine::cache_hits`](super::WasmEngine::cache_hits)).
    hits: AtomicU64,
    /// Lookups that found no usable file.
    misses: AtomicU64,
}

impl ArtifactCache {
    /// A cache in `dir` (created if missing) for artifacts of `engine`.
    pub(crate) fn new(engine: &Engine, dir: PathBuf) -> Result<Self> {
        std::fs::create_dir_all(&dir).map_err(|e| {
            WasmError::Internal(format!("cannot create cache dir {}: {e}", dir.display()))
        })?;
        // `DefaultHasher::new()` has fixed keys, so this is stable across
        // restarts of the same binary, which is all the cache needs.
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        let fingerprint = format!("{:016x}", hasher.finish());
        Ok(Self {
            dir,
            fingerprint,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        })
    }

    fn path(&self, sha256: &[u8; 32]) -> PathBuf {
        self.dir.join(format!(
            "{}-{}.cwasm",
            hex::encode(sha256),
            self.fingerprint
        ))
    }

    /// The cached module for `sha256`, counting a hit or a miss.
    pub(crate) fn load(&self, engine: &Engine, sha256: &[u8; 32]) -> Option<Module> {
        let path = self.path(sha256);
        if path.is_file() {
            match load(engine, &path) {
                Ok(module) => {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Some(module);
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "Dropping unreadable cached artifact.");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Writes `module`'s artifact; a failure only costs a recompile later.
    pub(crate) fn store(&self, module: &Module, sha256: &[u8; 32]) {
        let path = self.path(sha256);
        if let Err(e) = store(module, &path) {
            tracing::warn!(path = %path.display(), error = %e, "Cannot write compiled artifact.");
        }
    }

    /// Removes every artifact (of any engine fingerprint) whose module is
    /// not in `kept` (SHA-256 hex), except files written at or after
    /// `since` (a module stored after the caller listed `kept`). Called
    /// after each blob sweep: a deleted module's artifacts would otherwise
    /// stay on disk for ever, counted against no quota
    /// (docs/security.md, "Compiled modules are swept with their blobs").
    /// Returns how many files were removed; a removed file only costs a
    /// recompile if its module comes back.
    pub(crate) fn retain(
        &self,
        kept: &std::collections::BTreeSet<String>,
        since: std::time::SystemTime,
    ) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            // `<sha>-<fingerprint>.cwasm` or a temporary `<sha>-<fingerprint>.tmp…`.
            let Some((sha, _)) = name.split_once('-') else {
                continue;
            };
            if kept.contains(sha) {
                continue;
            }
            let written = entry.metadata().and_then(|m| m.modified());
            if !matches!(written, Ok(t) if t < since) {
                continue;
            }
            match std::fs::remove_file(entry.path()) {
                Ok(()) => removed += 1,
                Err(e) => {
                    tracing::warn!(file = %name, error = %e, "Cannot remove an unused compiled artifact.");
                }
            }
        }
        removed
    }

    /// Modules loaded from disk since start.
    pub(crate) fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Lookups that had to compile since start.
    pub(crate) fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }
}

#[allow(unsafe_code)]
fn load(engine: &Engine, path: &Path) -> wasmtime::Result<Module> {
    // SAFETY: `deserialize_file` trusts the file to be an artifact produced by
    // a compatible wasmtime. Only this module writes into the cache directory
    // (atomically, via a temporary file and a rename), the file name carries
    // the engine fingerprint, and wasmtime re-checks the version and settings
    // in the artifact header before mapping it.
    unsafe { Module::deserialize_file(engine, path) }
}

fn store(module: &Module, path: &Path) -> std::io::Result<()> {
    let bytes = module.serialize().map_err(std::io::Error::other)?;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}
