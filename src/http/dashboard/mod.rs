//! The live actor metrics dashboard (docs/design.md §12): `/__admin` serves one page
//! (assets embedded in the binary) that updates over server-sent events from
//! `/__admin/api/stream`; `/__admin/api/*` serves the same numbers as JSON.
//!
//! Every number is read from the node's Prometheus registry and actor directory,
//! the handles `/metrics` exports: one source of truth. A sampler reads them once
//! a tick, derives rates, keeps a bounded history, and renders one frame that
//! every open page receives.

//!
//! Its files, bottom up: `snapshot` (the numbers of one tick, plain data),
//! `board` (the dashboard's state the node holds: frames, history, viewers,
//! the session cache), `reading` (the node read into a snapshot), `session`
//! (the sign-in cookie), `sampler` (the task that ticks) and `routes`.
//! Every file imports from the file that defines what it uses, never from
//! here: this module only names the files and what the node's assembly uses.

pub(crate) mod board;
mod reading;
pub(crate) mod routes;
mod sampler;
pub(crate) mod session;
mod snapshot;

pub use board::{Dashboard, HISTORY_LEN, MAX_VIEWERS, SESSION_CACHE_TTL};
pub use sampler::{TICK_INTERVAL, spawn_sampler};
pub use session::{
    COOKIE, SESSION_PREFIX, SESSION_TTL_SECONDS, check_origin, cookie_identity,
    end_sessions_of_other_keys, is_dashboard_path, is_state_changing,
};
pub use snapshot::{ActorRow, BreakerRow, HistoryPoint, NamespaceRow, NodeRow, Snapshot};
