//! meshgate: a multi-tenant gateway node built on actors. One process hosts many
//! namespaces; for each it runs WASM functions, carries pub/sub between WebSocket
//! clients, and guards every request with one fixed middleware chain.
//!
//! # Layout
//! - `actors/`: the node supervisor, one supervisor per namespace (its KV, and
//!   the hooks functions and pub/sub plug into), and per-actor instrumentation.
//! - `http/`: the listener (`mod.rs`), the node handle (`state.rs`), the
//!   request chain of docs/design.md §2 in `http/chain/` (one function per
//!   step; what the steps put on a request in `context.rs`), cluster
//!   forwarding and the hop check (`forward.rs`, `hop.rs`), a routed host's
//!   deployment (`deploy_serve.rs`), the gRPC listener (`grpc.rs`), route
//!   policies, the error envelope, the
//!   route handlers (`http/routes/`) and the `/v1/ws` socket. Layered inside:
//!   docs/architecture.md, "Inside the folders".
//! - `auth/`: pure identity primitives: API key format, grants and roles, EdDSA
//!   JWTs, refresh rotation rules, wallet challenges, the cluster hop MAC.
//! - `namespace.rs`: the namespace record (members, limits, claims provider).
//! - `quota.rs`: per-namespace quotas: limits, usage records kept beside the
//!   data they count, live socket and subscription counts.
//! - `identity.rs`: the store-backed side of identity (key records, refresh
//!   families, wallet nonces).
//! - `storage/`: the ordered-KV trait and its backends (sled; etcd with `cluster`,
//!   over TLS and with users), the seal of the secrets kept in the shared store,
//!   the MAC on the records that confer authority (keys, namespaces, refresh tokens),
//!   and the blob ledger (pins, and the sweep of blobs no record names).
//! - `cluster/` (cargo feature `cluster`): the pub/sub mesh between nodes
//!   (gated libp2p GossipSub, registry in the shared store, per-publisher
//!   ordering) and the node's mesh identity.
//! - `pubsub/`: the node's delivery service, per-worker relays with bounded
//!   socket queues, the `WsSession` actor, topic tables, the socket protocol,
//!   per-topic history (offsets, epochs, recovery; `history.rs`).
//! - `http/dashboard/`: the live `/__admin` page: a sampler over the metrics
//!   registry (`reading.rs`), the frames the node holds (`board.rs`), the JSON
//!   API and event stream, operator sessions, embedded assets.
//! - `wasm/`: the wasmtime sandbox: engine, worker pool, host imports, limits.
//! - `functions/`: deploy, versions, secrets, each namespace's invoker (the
//!   host services of its guests), pub/sub and cron triggers, invocation records.
//! - `deploy/`: host-routed deployments: static sites, the reverse proxy
//!   (HTTP, WebSocket, gRPC), the routing index, TLS with SNI checks.
//! - `placement/`: cluster placement: the node registry, namespace members,
//!   forwarding to a member through per-(namespace, member) breakers.
//! - `config.rs`: `config.toml`, environment and CLI overrides, validation.
//! - `metrics.rs`: every Prometheus metric, in one registry.
//! - `telemetry.rs`: OTLP export of request spans (`[telemetry]`, off by default).
//! - `node.rs`: start-up (it builds the node's handle, `http/state.rs`), the
//!   background tasks, and the drain.
//! - `error.rs`: `ApiError`, the error every layer returns toward a client.
//! - `util.rs`: the clock, random bytes, host name, CPU count (imports nothing).
//! - `cli.rs`: the `meshgate` command line, server and client.
#![deny(unsafe_code)]

pub mod actors;
pub mod auth;
pub mod cli;
mod cli_client;
#[cfg(feature = "cluster")]
pub mod cluster;
pub mod config;
pub mod deploy;
pub mod error;
pub mod functions;
pub mod http;
pub mod identity;
pub mod metrics;
pub mod namespace;
pub mod node;
pub mod observe;
pub mod placement;
pub mod pubsub;
pub mod quota;
pub mod storage;
pub mod telemetry;
pub mod util;
pub mod wasm;
