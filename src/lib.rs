//! meshgate: a multi-tenant gateway node.
//!
//! # Layout
//!
//! - `src/wasm/`: the WASM sandbox (engine, worker pool, host imports, limits,
//!   artifact cache).
#![deny(unsafe_code)]

pub mod wasm;
