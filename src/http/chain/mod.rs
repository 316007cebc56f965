//! The request chain of docs/design.md §2: steps 0 to 11, run in one layer
//! ([`front::front`]) instead of nested middlewares (one boxed future and
//! one service hop per request instead of twelve, with the order and every
//! answer unchanged). Each step is a function of the request that lets it
//! on, or ends it with a refusal or an answer. Step 12, forwarding to the
//! member that owns the namespace or to a routed host's deployment, is
//! `forward.rs` and `deploy_serve.rs`, beside this folder.
//!
//! Its files, bottom up:
//! - `context`: what the steps put on a request and read from it (the
//!   target namespace, the client's address, the request id, the host, a
//!   routed host, an anonymous hop), the header names, the route's policy
//!   and how a step ends a request early; the route handlers read these too;
//! - `credentials`: the credential caches the node holds (`state.rs`);
//! - `canonical`: the canonical request, made once before every step (the
//!   path's one spelling, the client's reserved headers removed), called
//!   first by the outermost layer (`deploy_serve.rs`'s `routed_fast_path`);
//! - `admission` (step 0) and `logger` (step 3's request id and span), which
//!   the routed fast path (`deploy_serve.rs`) calls too;
//! - `limits` (steps 5 and 11, and the buckets), `routing` (steps 6 and 7)
//!   and `access` (steps 8 to 10, with `authenticate`);
//! - `steps`: steps 5 to 11 in order, then step 12;
//! - `front`: steps 0 to 4 around `steps`, the layer `serve` wraps.
//!
//! Every file imports from the file that defines what it uses; this one only
//! names them.

pub(crate) mod access;
pub(crate) mod admission;
pub(crate) mod canonical;
pub(crate) mod context;
pub(crate) mod credentials;
pub(crate) mod front;
pub(crate) mod limits;
pub(crate) mod logger;
pub(crate) mod routing;
pub(crate) mod steps;
