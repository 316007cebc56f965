//! The WASM sandbox: compile guest modules and run them on a bounded pool.
//!
//! One wasmtime `Engine` per node (pooling allocator, copy-on-write memory
//! images, epoch interruption driven by a ticker thread), one `InstancePre`
//! per module, a fresh `Store` per invocation with a deadline and a memory
//! limiter. Guests are WASI preview 1 command modules that may also import
//! the `meshgate` host functions (see `docs/guest-abi.md`).
//!
//! - `engine`: [`WasmEngine`], compilation and running one invocation.
//! - `host`: [`HostApi`], the `meshgate` imports and the store state.
//! - `wasi`: WASI preview 1 as a function's sandbox offers it (stdio, env,
//!   clocks, randomness, a bounded sleep; no file or socket).
//! - `pool`: the worker threads and the per-namespace queues (fair share).
//! - `cache`: compiled artifacts on disk.
//! - `shape`: what a module may declare, counted before it is compiled.
//! - `gate`: the compile slots (node-wide, one per namespace).
//! - `limits`: the fixed limits and the resource limiter.
//! - `error`: [`WasmError`], [`HostError`] and the guest error codes.

mod cache;
mod engine;
mod error;
mod gate;
mod host;
mod limits;
mod pool;
mod priority;
mod shape;
mod wasi;

#[cfg(test)]
mod tests;

pub use self::{
    engine::{CompiledModule, Invocation, InvokeOutput, LogLine, WasmConfig, WasmEngine},
    error::{HostError, Result, WasmError, codes},
    host::{HostApi, ResolvedFunction},
    limits::{MAX_DEPTH, MAX_INPUT_BYTES, MAX_OUTPUT_BYTES, MAX_PUBLISHES},
    pool::{NamespaceStats, PoolStats},
    priority::WORKER_NICE,
    shape::ModuleLimits,
};
