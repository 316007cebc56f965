//! A worker thread's idle upstream connections, by instance base URL: the
//! pool both plain-HTTP clients of the proxy keep ([`super::h1`] for requests
//! with a body, [`super::wire`] for those without). actix's workers are
//! single-threaded, so a pool lives in a thread-local and takes no lock.
//!
//! Connections are handed out newest first. An idle connection is kept at
//! most [`IDLE_FOR`], at most [`MAX_IDLE`] per instance; the whole pool is
//! swept of expired and closed ones every [`SWEEP_EVERY`] while its thread
//! proxies (so those of deployments since deleted are closed too). A
//! connection is never handed out under another egress policy than the one
//! it was made under.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::thread::LocalKey;
use std::time::{Duration, Instant};

/// How long an idle pooled connection is kept.
pub const IDLE_FOR: Duration = Duration::from_secs(30);
/// Idle connections kept per instance and worker thread; more are closed.
pub const MAX_IDLE: usize = 256;
/// How often a thread's pool is swept of expired and closed connections of
/// every instance.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// A connection that can say it is closed (read without waiting).
pub trait Reusable: Sized + 'static {
    /// Whether the connection can no longer carry a request.
    fn closed(&mut self) -> bool;
    /// The thread-local pool of such connections.
    fn pool() -> &'static LocalKey<RefCell<IdlePool<Self>>>;
}

/// An idle connection of this thread to `base` made under `policy` ([`IdlePool::take`]).
pub fn take<T: Reusable>(base: &str, policy: usize) -> Option<T> {
    T::pool().with(|p| p.borrow_mut().take(base, policy))
}

/// Gives a connection back to this thread's pool ([`IdlePool::put`]).
pub fn put<T: Reusable>(base: &str, policy: usize, conn: T) {
    T::pool().with(|p| p.borrow_mut().put(base, policy, conn))
}

struct Idle<T> {
    conn: T,
    since: Instant,
    /// The egress policy the connection was checked by (its `Arc`'s address).
    policy: usize,
}

/// One thread's idle connections of one kind.
pub struct IdlePool<T> {
    by_base: HashMap<String, VecDeque<Idle<T>>>,
    swept: Option<Instant>,
}

impl<T> Default for IdlePool<T> {
    fn default() -> Self {
        IdlePool {
            by_base: HashMap::new(),
            swept: None,
        }
    }
}

impl<T: Reusable> IdlePool<T> {
    /// An idle connection to `base` made under `policy`, newest first; closed
    /// or expired ones met on the way are dropped.
    pub fn take(&mut self, base: &str, policy: usize) -> Option<T> {
        let q = self.by_base.get_mut(base)?;
        let now = crate::util::mono_now();
        while let Some(mut i) = q.pop_back() {
            if i.policy == policy && now - i.since < IDLE_FOR && !i.conn.closed() {
                return Some(i.conn);
            }
        }
        None
    }

    /// Gives a connection back (the oldest expired one of its instance is
    /// dropped; beyond [`MAX_IDLE`] it is closed).
    pub fn put(&mut self, base: &str, policy: usize, mut conn: T) {
        if conn.closed() {
            return;
        }
        let now = crate::util::mono_now();
        if self.swept.is_none_or(|t| now - t >= SWEEP_EVERY) {
            self.swept = Some(now);
            self.by_base.retain(|_, q| {
                q.retain_mut(|i| now - i.since < IDLE_FOR && !i.conn.closed());
                !q.is_empty()
            });
        }
        let q = match self.by_base.get_mut(base) {
            Some(q) => q,
            None => self.by_base.entry(base.to_string()).or_default(),
        };
        if q.front().is_some_and(|i| now - i.since >= IDLE_FOR) {
            q.pop_front();
        }
        if q.len() < MAX_IDLE {
            q.push_back(Idle {
                conn,
                since: now,
                policy,
            });
        }
    }
}
