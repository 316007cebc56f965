//! Fixed limits of the guest ABI and the per-store resource limiter.

#![forbid(unsafe_code)]

use std::time::Duration;

/// Largest input (stdin) of one invocation.
pub const MAX_INPUT_BYTES: usize = 1 << 20;
/// Largest output (stdout) of one invocation.
pub const MAX_OUTPUT_BYTES: usize = 1 << 20;
/// Publishes allowed per invocation; the next one gets `LIMIT`.
pub const MAX_PUBLISHES: u32 = 1_000;
/// Deepest nested `invoke` (a top-level call is depth 0).
pub const MAX_DEPTH: u32 = 5;
/// Log lines kept per invocation.
pub const MAX_LOG_LINES: usize = 1_000;
/// Longest log line kept, in bytes (longer ones are cut).
pub const MAX_LOG_LINE_BYTES: usize = 16 * 1024;
/// Largest memory a guest may have, whatever its function asks.
pub const MAX_MEMORY_MB: u32 = 256;
/// Table elements a guest may grow to.
pub const MAX_TABLE_ELEMENTS: usize = 20_000;
/// Native stack the guest may use (per nesting level).
pub const MAX_WASM_STACK: usize = 512 * 1024;
/// Stack of a worker thread: room for `MAX_DEPTH + 1` nested guests plus host frames.
pub const WORKER_STACK_BYTES: usize = 8 * 1024 * 1024 + (MAX_DEPTH as usize + 1) * MAX_WASM_STACK;
/// Default timeout of an [`Invocation`](super::Invocation) built with `Invocation::new`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default memory limit of an [`Invocation`](super::Invocation) built with `Invocation::new`.
pub const DEFAULT_MEMORY_MB: u32 = 64;

/// Caps one store's memories and tables; remembers whether it refused a growth
/// so a later trap can be reported as `MemoryLimit`.
pub(crate) struct StoreLimiter {
    /// The function's memory limit in bytes, clamped to 1..=[`MAX_MEMORY_MB`] MiB.
    pub(crate) max_memory_bytes: usize,
    /// Set when a `memory.grow` past the limit was refused.
    pub(crate) memory_refused: bool,
}

impl StoreLimiter {
    /// A limiter for a guest of `memory_limit_mb` MiB.
    pub(crate) fn new(memory_limit_mb: u32) -> Self {
        let mb = memory_limit_mb.clamp(1, MAX_MEMORY_MB) as usize;
        Self {
            max_memory_bytes: mb << 20,
            memory_refused: false,
        }
    }
}

impl wasmtime::ResourceLimiter for StoreLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.max_memory_bytes {
            self.memory_refused = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS)
    }

    fn instances(&self) -> usize {
        1
    }

    fn tables(&self) -> usize {
        4
    }

    fn memories(&self) -> usize {
        1
    }
}
