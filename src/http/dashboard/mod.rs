//! The live actor metrics dashboard (docs/design.md §12): `/__admin` serves one page
//! (assets embedded in the binary) that updates over server-sent events from
//! `/__admin/api/stream`; `/__admin/api/*` serves the same numbers as JSON.
//!
//! Every number is read from the node's Prometheus registry and actor directory,
//! the handles `/metrics` exports: one source of truth. A sampler reads them once
//! a tick, derives rates, keeps a bounded history, and renders one frame that
//! every open page receives.

mod routes;
mod sampler;
mod session;
mod snapshot;

pub use routes::register;
pub use sampler::{Dashboard, HISTORY_LEN, MAX_VIEWERS, TICK_INTERVAL, spawn_sampler};
pub use session::{
    COOKIE, SESSION_CACHE_TTL, SESSION_PREFIX, SESSION_TTL_SECONDS, check_origin, cookie_identity,
    end_sessions_of_other_keys, is_dashboard_path, is_state_changing,
};
pub use snapshot::{ActorRow, BreakerRow, HistoryPoint, NamespaceRow, NodeRow, Snapshot};
