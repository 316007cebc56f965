//! meshgate: a multi-tenant gateway node.
//!
//! # Layout
//!
//! - `src/auth/`: identity primitives — API keys, grants and roles, EdDSA
//!   JWTs, refresh rotation, wallet sign-in, the cluster hop MAC. Pure and
//!   synchronous; time is a parameter.

pub mod auth;
