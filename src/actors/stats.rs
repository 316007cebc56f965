//! Per-actor instrumentation: bounded admission (the explicit overload answer),
//! mailbox depth, messages handled and handling time, all kept in the node's
//! metrics (`crate::metrics`), and a directory of live actors for the dashboard.

use crate::metrics::{Metrics, NsCounter, NsGauge, NsHistogram};
use actix::dev::ToEnvelope;
use actix::{Actor, Addr, Handler, Message};
use parking_lot::Mutex;
use prometheus::Histogram;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Why a request to an actor got no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AskError {
    /// The mailbox is at capacity: answer 503 OVERLOADED.
    #[error("the actor's mailbox is full")]
    Overloaded,
    /// The actor stopped before answering.
    #[error("the actor stopped")]
    Gone,
    /// No answer within the deadline.
    #[error("the actor did not answer in time")]
    Timeout,
}

/// Numbers one actor reports.
pub struct ActorStats {
    /// Unique per node, given in registration order; the dashboard's row key.
    pub id: u64,
    /// What the actor is (`node`, `namespace`); the `kind` metric label.
    pub kind: &'static str,
    /// The namespace it serves, empty for the node's own actor.
    pub namespace: String,
    /// Most messages admitted at once; [`ActorStats::admit`] refuses past it.
    capacity: i64,
    /// Messages admitted and not yet taken out of the mailbox.
    depth: AtomicI64,
    /// `depth` mirrored into `meshgate_actor_mailbox_depth` (summed per label).
    depth_gauge: NsGauge,
    /// Messages handled: the `meshgate_actor_messages_handled_total` series of
    /// this actor's labels (shared with actors whose labels match).
    handled: NsCounter,
    /// Handling time in seconds (`meshgate_actor_handling_seconds` for its labels).
    handling: NsHistogram,
    /// `meshgate_actor_restarts_total`, shared by actors with the same labels.
    restarts: NsCounter,
    /// Messages refused because the mailbox was full (`meshgate_actor_overloaded_total`).
    overloaded: NsCounter,
    /// This actor's own restarts: the labelled counter is shared (capped
    /// namespaces fold into `_other`), so the dashboard reads this one.
    restarts_local: AtomicU64,
    /// Set by every use (a message admitted or handled, a lookup of the
    /// namespace's handle), cleared by the node's idle sweep: one flag, not a
    /// clock read, on the hot path (see `NodeSupervisor`'s passivation).
    active: AtomicBool,
}

/// Records one message's handling time when dropped.
pub struct HandleTimer {
    /// Whose `handled` and `handling` the drop records into.
    stats: Arc<ActorStats>,
    /// When handling began.
    start: Instant,
}

impl Drop for HandleTimer {
    fn drop(&mut self) {
        self.stats.handled.inc();
        self.stats
            .handling
            .observe(self.start.elapsed().as_secs_f64());
    }
}

impl ActorStats {
    /// Takes a mailbox slot; false when the mailbox is full.
    pub fn admit(&self) -> bool {
        self.touch();
        let before = self.depth.fetch_add(1, Ordering::AcqRel);
        if before >= self.capacity {
            self.depth.fetch_sub(1, Ordering::AcqRel);
            self.overloaded.inc();
            return false;
        }
        self.depth_gauge.inc();
        true
    }

    /// Takes a slot even past capacity: for cleanup messages that must not be
    /// refused (a closed socket's unsubscribe), never for client requests.
    pub fn admit_always(&self) {
        self.touch();
        self.depth.fetch_add(1, Ordering::AcqRel);
        self.depth_gauge.inc();
    }

    /// Gives back a slot whose message was never handled.
    pub fn cancel(&self) {
        self.depth.fetch_sub(1, Ordering::AcqRel);
        self.depth_gauge.dec();
    }

    /// Called by a handler as it takes a message out of the mailbox.
    pub fn begin(self: &Arc<Self>) -> HandleTimer {
        self.cancel();
        self.timer()
    }

    /// Times a message that was sent past admission (it took no slot, so it
    /// gives none back); `begin` for every other message.
    pub fn timer(self: &Arc<Self>) -> HandleTimer {
        self.touch();
        HandleTimer {
            stats: self.clone(),
            start: crate::util::mono_now(),
        }
    }

    /// Marks the actor used now (what keeps a namespace supervisor from
    /// passivating). Writes only when the flag is clear.
    pub fn touch(&self) {
        if !self.active.load(Ordering::Relaxed) {
            self.active.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the actor was used since the last call (which clears the
    /// flag): read by the node's idle sweep only.
    pub fn take_active(&self) -> bool {
        self.active.swap(false, Ordering::Relaxed)
    }

    /// Counts a restart.
    pub fn restarted(&self) {
        self.restarts.inc();
        self.restarts_local.fetch_add(1, Ordering::Relaxed);
    }

    /// Messages waiting in the mailbox now (never negative).
    pub fn depth(&self) -> i64 {
        self.depth.load(Ordering::Relaxed).max(0)
    }
    /// Messages handled by this actor's label series (its own unless its
    /// namespace folded into `_other`).
    pub fn handled(&self) -> u64 {
        self.handled.get()
    }
    /// Restarts of this actor after a panic.
    pub fn restarts(&self) -> u64 {
        self.restarts_local.load(Ordering::Relaxed)
    }
    /// This actor's handling-time histogram (its labels' series).
    pub fn handling_histogram(&self) -> &Histogram {
        self.handling.histogram()
    }
    /// Handling time quantile estimated from this actor's histogram (seconds).
    pub fn handling_quantile(&self, q: f64) -> f64 {
        histogram_quantile(self.handling.histogram(), q)
    }
}

/// A quantile estimated from a Prometheus histogram's cumulative buckets.
pub fn histogram_quantile(h: &Histogram, q: f64) -> f64 {
    use prometheus::core::Collector;
    let families = h.collect();
    let Some(m) = families.first().and_then(|f| f.get_metric().first()) else {
        return 0.0;
    };
    let hist = m.get_histogram();
    let total = hist.get_sample_count();
    if total == 0 {
        return 0.0;
    }
    let rank = q * total as f64;
    let mut prev_bound = 0.0;
    let mut prev_count = 0u64;
    for b in hist.get_bucket() {
        let count = b.cumulative_count();
        if count as f64 >= rank {
            let in_bucket = (count - prev_count).max(1) as f64;
            let frac = (rank - prev_count as f64) / in_bucket;
            return prev_bound + (b.upper_bound() - prev_bound) * frac.clamp(0.0, 1.0);
        }
        prev_bound = b.upper_bound();
        prev_count = count;
    }
    prev_bound
}

/// Every live actor's stats, for the dashboard and `/v1/status`.
#[derive(Clone, Default)]
pub struct ActorDirectory {
    /// Weak, so a stopped actor leaves the list; dead entries are pruned on register.
    actors: Arc<Mutex<Vec<Weak<ActorStats>>>>,
    /// The next [`ActorStats::id`].
    next_id: Arc<AtomicU64>,
}

impl ActorDirectory {
    /// Creates and lists the stats of a new actor.
    pub fn register(
        &self,
        metrics: &Metrics,
        kind: &'static str,
        namespace: &str,
        capacity: usize,
    ) -> Arc<ActorStats> {
        let label = metrics.ns_label(namespace);
        let labels = [kind, label.as_str()];
        let stats = Arc::new(ActorStats {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            kind,
            namespace: namespace.to_string(),
            capacity: capacity as i64,
            depth: AtomicI64::new(0),
            depth_gauge: metrics.actor_mailbox_depth.with_label_values(&labels),
            handled: metrics.actor_handled.with_label_values(&labels),
            handling: metrics.actor_handling_seconds.with_label_values(&labels),
            restarts: metrics.actor_restarts.with_label_values(&labels),
            overloaded: metrics.actor_overloaded.with_label_values(&labels),
            restarts_local: AtomicU64::new(0),
            active: AtomicBool::new(true),
        });
        let mut list = self.actors.lock();
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(&stats));
        stats
    }

    /// The stats of every actor still alive.
    pub fn snapshot(&self) -> Vec<Arc<ActorStats>> {
        self.actors
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }
}

/// Sends `msg` through the actor's bounded admission without waiting for a
/// reply. `Overloaded` (the mailbox is full) or `Gone`: the message was dropped.
pub fn tell<A, M>(addr: &Addr<A>, stats: &ActorStats, msg: M) -> Result<(), AskError>
where
    A: Actor + Handler<M>,
    A::Context: ToEnvelope<A, M>,
    M: Message + Send + 'static,
    M::Result: Send,
{
    if !stats.admit() {
        return Err(AskError::Overloaded);
    }
    match addr.try_send(msg) {
        Ok(()) => Ok(()),
        Err(actix::dev::SendError::Full(_)) => {
            stats.cancel();
            stats.overloaded.inc();
            Err(AskError::Overloaded)
        }
        Err(actix::dev::SendError::Closed(_)) => {
            stats.cancel();
            Err(AskError::Gone)
        }
    }
}

/// Sends `msg` through the actor's bounded admission and awaits its reply.
pub async fn ask<A, M>(
    addr: &Addr<A>,
    stats: &ActorStats,
    msg: M,
    timeout: Duration,
) -> Result<M::Result, AskError>
where
    A: Actor + Handler<M>,
    A::Context: ToEnvelope<A, M>,
    M: Message + Send + 'static,
    M::Result: Send,
{
    if !stats.admit() {
        return Err(AskError::Overloaded);
    }
    match addr.send(msg).timeout(timeout).await {
        Ok(r) => Ok(r),
        Err(actix::MailboxError::Timeout) => Err(AskError::Timeout),
        Err(actix::MailboxError::Closed) => {
            stats.cancel();
            Err(AskError::Gone)
        }
    }
}
