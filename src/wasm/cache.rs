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
