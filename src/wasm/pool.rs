//! The worker pool: a fixed set of OS threads sharing one queue per namespace.
//!
//! Fair share: a free worker takes the next invocation of the waiting
//! namespace with the fewest invocations running (ties in round-robin order),
//! so a namespace alone on the node may use every worker, and namespaces busy
//! at the same time converge on an equal share of them.
//!
//! Spare threads: beside the `workers`, the pool runs `spare` threads that
//! only start the call of a namespace with nothing running, and stay at the
//! request path's CPU priority (the workers run below it, `priority.rs`).
//! A neighbour's flood of long calls holds every worker, and a quiet
//! tenant's call used to wait for one of them to end and then run at the
//! flood's priority: its p99 rose 3× to 4.5× beside the flood
//! (BENCHMARKS.md). Now it starts at once on a spare thread. A flooding
//! namespace always has a call running, so a spare thread never runs more
//! than the first of its calls: the spare threads cannot be taken by a
//! flood, and a namespace alone on the node still uses exactly the workers.
//!
//! Admission is bounded
//! three ways: per namespace (`namespace_queue` waiting invocations, past it
//! `Busy`), node-wide (`queue` waiting invocations, past it `Overloaded`) and
//! in time (an invocation that waited `queue_wait` without a worker is
//! refused with `Busy`, by a timer thread, while the workers stay busy).
//! Nothing here blocks the caller: `submit` takes a lock for a few
//! instructions and the answer comes through the job.

#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::error::{Result, WasmError};
use super::limits::WORKER_STACK_BYTES;

/// A snapshot of the pool, for metrics and the dashboard.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Worker threads.
    pub workers: usize,
    /// Calls running a guest now: on the workers, the spare threads, and
    /// on their callers' threads (`Pool::try_hold`).
    pub busy: usize,
    /// Invocations waiting for a worker.
    pub queued: usize,
    /// Namespaces with invocations in flight, sorted by name.
    pub namespaces: Vec<NamespaceStats>,
}

/// In-flight invocations of one namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NamespaceStats {
    /// The namespace.
    pub namespace: String,
    /// Running on a worker.
    pub running: usize,
    /// Waiting in the namespace's queue.
    pub queued: usize,
}

/// The work of one invocation. Called exactly once: with `Ok(())` on a worker
/// when it may run, or with `Err(Busy)` when it waited past its deadline.
pub(crate) type Job = Box<dyn FnOnce(Result<()>) + Send>;

struct Task {
    /// The invocation's work, called once: to run, or with `Busy` when it waited too long.
    job: Job,
    /// When the task stops waiting (submit time plus `queue_wait`); later it is refused.
    deadline: Instant,
}

#[derive(Default)]
struct NsQueue {
    /// The namespace's invocations running now (on a worker, or on their
    /// callers' threads: `here`); `pick` favours the namespace with fewest.
    running: usize,
    /// Of `running`, those on their callers' threads ([`Pool::try_hold`]).
    here: usize,
    /// The namespace's waiting invocations, in submit order (so deadlines grow along it).
    tasks: VecDeque<Task>,
}

#[derive(Default)]
struct State {
    /// Queues of namespaces with something running or waiting; `tidy` drops empty ones.
    namespaces: HashMap<String, NsQueue>,
    /// Namespaces with waiting tasks, in round-robin order.
    ring: VecDeque<String>,
    /// Tasks waiting node-wide, across all namespaces; bounded by `Pool::queue`.
    queued: usize,
    /// Workers running a job now; the rest are idle and exempt calls from the queue bounds.
    busy: usize,
    /// Spare threads running a job now.
    spare_busy: usize,
    /// Calls running on their callers' threads ([`Pool::try_hold`]).
    here: usize,
    /// Set when the pool is dropped: workers and the timer exit, submits are refused.
    stopped: bool,
    /// The timer sleeps with no deadline (nothing was queued when it last
    /// looked): the next submit must wake it. Otherwise it sleeps until the
    /// deadline of a task submitted earlier, which comes no later than any
    /// new task's (one `queue_wait` for all), so a submit need not wake it.
    timer_idle: bool,
}

impl State {
    /// Takes the next task: from the waiting namespace with the fewest running
    /// tasks, the first such in the ring; that namespace moves to the back.
    fn pick(&mut self) -> Option<(String, Task)> {
        let (pos, _) = self
            .ring
            .iter()
            .enumerate()
            .min_by_key(|(_, ns)| self.running(ns))?;
        self.take_at(pos)
    }

    /// Takes the next task of a namespace with nothing running (for a spare
    /// thread): the first such in the ring, which moves to the back.
    fn pick_first_call(&mut self) -> Option<(String, Task)> {
        let pos = self.ring.iter().position(|ns| self.running(ns) == 0)?;
        self.take_at(pos)
    }

    /// Takes the first task of the ring's `pos`-th namespace, which moves to
    /// the back of the ring if it has more waiting.
    fn take_at(&mut self, pos: usize) -> Option<(String, Task)> {
        let ns = self.ring.remove(pos)?;
        let q = self.namespaces.get_mut(&ns)?;
        let task = q.tasks.pop_front()?;
        self.queued -= 1;
        if !q.tasks.is_empty() {
            self.ring.push_back(ns.clone());
        }
        Some((ns, task))
    }

    /// The namespace's calls running now (on a worker or a spare thread).
    fn running(&self, ns: &str) -> usize {
        self.namespaces.get(ns).map_or(0, |q| q.running)
    }

    /// Forgets a namespace with nothing running or waiting.
    fn tidy(&mut self, ns: &str) {
        if self
            .namespaces
            .get(ns)
            .is_some_and(|q| q.running == 0 && q.tasks.is_empty())
        {
            self.namespaces.remove(ns);
        }
    }

    /// Removes the tasks whose deadline has passed; returns them and the
    /// earliest deadline still waiting.
    fn expire(&mut self, now: Instant) -> (Vec<Task>, Option<Instant>) {
        let mut expired = Vec::new();
        let mut next: Option<Instant> = None;
        let mut emptied = Vec::new();
        for ns in &self.ring {
            let Some(q) = self.namespaces.get_mut(ns) else {
                continue;
            };
            // Deadlines grow along a queue (one `queue_wait` for all).
            while q.tasks.front().is_some_and(|t| t.deadline <= now) {
                expired.extend(q.tasks.pop_front());
            }
            match q.tasks.front() {
                Some(t) => next = Some(next.map_or(t.deadline, |n| n.min(t.deadline))),
                None => emptied.push(ns.clone()),
            }
        }
        self.queued -= expired.len();
        if !emptied.is_empty() {
            self.ring.retain(|ns| !emptied.contains(ns));
            for ns in &emptied {
                self.tidy(ns);
            }
        }
        (expired, next)
    }
}

struct Shared {
    /// Queues and counters, guarded by one lock shared with the condvars.
    state: Mutex<State>,
    /// Signals the workers: a task is waiting, or the pool stopped.
    work: Condvar,
    /// Signals the spare threads: a namespace with nothing running has a
    /// call waiting and no worker is free, or the pool stopped.
    spare: Condvar,
    /// Signals the timer: the first task of an empty pool, or the pool stopped.
    timer: Condvar,
    /// `State::queued` as last set under the lock, for an idle worker to
    /// watch without taking the lock (see [`idle_spin`]).
    queued: AtomicUsize,
}

pub(crate) struct Pool {
    /// State shared with the worker threads and the timer thread.
    shared: Arc<Shared>,
    /// Number of worker threads (at least 1).
    workers: usize,
    /// Number of spare threads (see the module's documentation).
    spare: usize,
    /// Most invocations waiting node-wide (beyond idle workers); past it, `Overloaded`.
    queue: usize,
    /// Most waiting per namespace (beyond idle workers), so one tenant cannot fill
    /// the node's queue; past it, `Busy`.
    namespace_queue: usize,
    /// Longest an invocation waits for a worker before it is refused as `Busy`.
    queue_wait: Duration,
}

impl Pool {
    /// `workers` threads (at least one) and `spare` ones, as
    /// `WasmConfig::pool_threads` counts them; at most `queue` invocations
    /// waiting node-wide, at most `namespace_queue` per namespace, each for
    /// at most `queue_wait`.
    pub(crate) fn new(
        workers: usize,
        spare: usize,
        queue: usize,
        namespace_queue: usize,
        queue_wait: Duration,
        nice: i32,
    ) -> Result<Self> {
        let workers = workers.max(1);
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            spare: Condvar::new(),
            timer: Condvar::new(),
            queued: AtomicUsize::new(0),
        });
        let pool = Self {
            shared: shared.clone(),
            workers,
            spare,
            queue: queue.max(1),
            namespace_queue: namespace_queue.max(1),
            queue_wait,
        };
        for i in 0..workers {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("wasm-worker-{i}"))
                .stack_size(WORKER_STACK_BYTES)
                .spawn(move || worker(&shared, nice))
                .map_err(|e| WasmError::Internal(format!("cannot spawn a WASM worker: {e}")))?;
        }
        for i in 0..spare {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("wasm-spare-{i}"))
                .stack_size(WORKER_STACK_BYTES)
                .spawn(move || spare_thread(&shared))
                .map_err(|e| {
                    WasmError::Internal(format!("cannot spawn a WASM spare thread: {e}"))
                })?;
        }
        std::thread::Builder::new()
            .name("wasm-queue-timer".into())
            .spawn(move || timer(&shared))
            .map_err(|e| WasmError::Internal(format!("cannot spawn the queue timer: {e}")))?;
        Ok(pool)
    }

    /// Queues `job` for `namespace`, or refuses it (`Busy`: the namespace's
    /// queue is full; `Overloaded`: the node's is). An admitted job is later
    /// called once, to run or to hear it waited too long.
    pub(crate) fn submit(&self, namespace: &str, job: Job) -> Result<()> {
        let deadline = crate::util::mono_now() + self.queue_wait;
        let mut state = self.shared.state.lock();
        if state.stopped {
            return Err(WasmError::Internal("WASM worker pool stopped".into()));
        }
        // The bounds are for calls that will wait: the calls idle workers are
        // about to take do not count (calls arriving together at an idle pool
        // all run, whatever the namespace's queue bound). Spare threads are
        // not counted: they take only a namespace's first call.
        let idle = self.workers.saturating_sub(state.busy);
        let waiting = state.namespaces.get(namespace).map_or(0, |q| q.tasks.len());
        if waiting >= self.namespace_queue + idle {
            return Err(WasmError::Busy);
        }
        if state.queued >= self.queue + idle {
            return Err(WasmError::Overloaded);
        }
        let q = state.namespaces.entry(namespace.to_owned()).or_default();
        q.tasks.push_back(Task { job, deadline });
        // The namespace's first call: nothing of it running or waiting before.
        let first = q.running == 0 && q.tasks.len() == 1;
        if q.tasks.len() == 1 {
            state.ring.push_back(namespace.to_owned());
        }
        state.queued += 1;
        self.shared.queued.store(state.queued, Ordering::Release);
        // Deadlines only grow, so the timer needs a word only when it sleeps
        // without one (a wake-up per call that found the queue empty cost a
        // futex wake here and a context switch there).
        if state.timer_idle {
            state.timer_idle = false;
            self.shared.timer.notify_one();
        }
        // A free worker takes it; with none free, a spare thread takes a
        // namespace's first call (a burst at an idle pool is the workers').
        // Only one thread is woken: no wake-up in vain.
        let spare = state.queued > idle && state.spare_busy < self.spare && first;
        drop(state);
        if spare {
            self.shared.spare.notify_one();
        } else {
            self.shared.work.notify_one();
        }
        Ok(())
    }

    /// Counts a call of `namespace` that its caller runs on its own thread,
    /// when nothing waits for a worker (so no queued call is overtaken), or
    /// when the namespace has nothing running and nothing waiting (its first
    /// call, the one the fair order serves first: what the spare thread
    /// would take), and the namespace does not hold every worker already
    /// (its share of the pool is not grown by the request threads): the call
    /// counts as running for the namespace's fair share and in the stats
    /// until the hold is dropped, but takes no worker. At most as many run so
    /// at once as the pool has workers (wasmtime's instance slots are sized
    /// for that). None otherwise, or when the pool stopped.
    pub(crate) fn try_hold(&self, namespace: &str) -> Option<Hold<'_>> {
        let mut state = self.shared.state.lock();
        if state.stopped || state.here >= self.workers {
            return None;
        }
        let quiet = state
            .namespaces
            .get(namespace)
            .is_none_or(|q| q.running == 0 && q.tasks.is_empty());
        if state.queued > 0 && !quiet {
            return None;
        }
        match state.namespaces.get_mut(namespace) {
            Some(q) if q.running.saturating_sub(q.here) >= self.workers => return None,
            Some(q) => {
                q.running += 1;
                q.here += 1;
            }
            None => {
                state.namespaces.insert(
                    namespace.to_owned(),
                    NsQueue {
                        running: 1,
                        here: 1,
                        ..NsQueue::default()
                    },
                );
            }
        }
        state.here += 1;
        Some(Hold {
            shared: &self.shared,
            namespace: namespace.to_owned(),
        })
    }

    pub(crate) fn stats(&self) -> PoolStats {
        let state = self.shared.state.lock();
        let mut namespaces: Vec<NamespaceStats> = state
            .namespaces
            .iter()
            .map(|(ns, q)| NamespaceStats {
                namespace: ns.clone(),
                running: q.running,
                queued: q.tasks.len(),
            })
            .collect();
        namespaces.sort_by(|a, b| a.namespace.cmp(&b.namespace));
        PoolStats {
            workers: self.workers + self.spare,
            busy: state.busy + state.spare_busy + state.here,
            queued: state.queued,
            namespaces,
        }
    }
}

/// A call running on its caller's thread, counted ([`Pool::try_hold`]);
/// dropping it ends the count.
pub(crate) struct Hold<'a> {
    shared: &'a Shared,
    namespace: String,
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        let mut state = self.shared.state.lock();
        state.here -= 1;
        if let Some(q) = state.namespaces.get_mut(&self.namespace) {
            q.running = q.running.saturating_sub(1);
            q.here = q.here.saturating_sub(1);
        }
        state.tidy(&self.namespace);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.state.lock().stopped = true;
        self.shared.work.notify_all();
        self.shared.spare.notify_all();
        self.shared.timer.notify_all();
    }
}

fn worker(shared: &Shared, nice: i32) {
    // Below the request path: see `priority.rs`.
    if nice > 0 && !super::priority::lower_this_thread(nice) {
        tracing::debug!("A WASM worker keeps the default CPU priority.");
    }
    let mut state = shared.state.lock();
    loop {
        if state.stopped {
            return; // The engine is gone; waiting jobs drop and their callers hear it.
        }
        let Some((ns, task)) = state.pick() else {
            // Before sleeping, look again for a short while, giving the core
            // away between looks: a call submitted meanwhile starts without
            // a wake-up, which costs tens of µs on a virtual machine (the
            // no-op invoke bench: 56 µs through the pool against 2 µs inline).
            if state.queued == 0 && !idle_spin(shared, &mut state) {
                shared.work.wait(&mut state);
            }
            continue;
        };
        state = run_task(shared, state, &ns, task, Thread::Worker);
    }
}

/// A spare thread: starts the first call of namespaces with nothing running,
/// at the request path's priority (never lowered: it runs one call of a
/// namespace at most, so no namespace can hold it with a flood).
fn spare_thread(shared: &Shared) {
    let mut state = shared.state.lock();
    loop {
        if state.stopped {
            return;
        }
        let Some((ns, task)) = state.pick_first_call() else {
            shared.spare.wait(&mut state);
            continue;
        };
        state = run_task(shared, state, &ns, task, Thread::Spare);
    }
}

/// Which kind of pool thread runs a task (each has its busy count).
#[derive(Clone, Copy)]
enum Thread {
    Worker,
    Spare,
}

impl State {
    fn busy_of(&mut self, thread: Thread) -> &mut usize {
        match thread {
            Thread::Worker => &mut self.busy,
            Thread::Spare => &mut self.spare_busy,
        }
    }
}

/// Runs a picked task of `ns` without the lock (or refuses it, Busy, when it
/// waited past its deadline, as the timer would have), counting it as
/// running meanwhile; returns the lock again.
fn run_task<'a>(
    shared: &'a Shared,
    mut state: parking_lot::MutexGuard<'a, State>,
    ns: &str,
    task: Task,
    thread: Thread,
) -> parking_lot::MutexGuard<'a, State> {
    shared.queued.store(state.queued, Ordering::Release);
    if task.deadline <= crate::util::mono_now() {
        state.tidy(ns);
        drop(state);
        (task.job)(Err(WasmError::Busy));
        return shared.state.lock();
    }
    if let Some(q) = state.namespaces.get_mut(ns) {
        q.running += 1;
    }
    *state.busy_of(thread) += 1;
    drop(state);
    let job = task.job;
    if std::panic::catch_unwind(AssertUnwindSafe(move || job(Ok(())))).is_err() {
        tracing::error!("A WASM job panicked; the thread carries on.");
    }
    let mut state = shared.state.lock();
    *state.busy_of(thread) -= 1;
    if let Some(q) = state.namespaces.get_mut(ns) {
        q.running = q.running.saturating_sub(1);
    }
    state.tidy(ns);
    state
}

/// How long an idle worker keeps looking for work before it sleeps.
const IDLE_SPIN: Duration = Duration::from_micros(50);

/// Looks for work for [`IDLE_SPIN`], yielding the core between looks (so a
/// runnable thread, such as an HTTP worker, is never kept waiting by it).
/// It watches `Shared::queued` without the lock: a spinning worker that
/// took the lock between looks made a submit that met it park on the lock
/// and wait for a wake-up, the very cost the spin is there to avoid (the
/// pooled no-op call doubled, BENCHMARKS.md). True when work arrived or the
/// pool stopped; the lock is held again on return.
fn idle_spin(shared: &Shared, state: &mut parking_lot::MutexGuard<'_, State>) -> bool {
    let until = crate::util::mono_now() + IDLE_SPIN;
    parking_lot::MutexGuard::unlocked(state, || {
        loop {
            std::thread::yield_now();
            if shared.queued.load(Ordering::Acquire) > 0 || crate::util::mono_now() >= until {
                return;
            }
        }
    });
    state.queued > 0 || state.stopped
}

/// Refuses the invocations that waited past their deadline, as it passes.
fn timer(shared: &Shared) {
    let mut state = shared.state.lock();
    loop {
        if state.stopped {
            return;
        }
        let (expired, next) = state.expire(crate::util::mono_now());
        shared.queued.store(state.queued, Ordering::Release);
        if !expired.is_empty() {
            drop(state);
            for task in expired {
                (task.job)(Err(WasmError::Busy));
            }
            state = shared.state.lock();
            continue;
        }
        state.timer_idle = next.is_none();
        match next {
            Some(at) => {
                shared.timer.wait_until(&mut state, at);
            }
            None => shared.timer.wait(&mut state),
        }
    }
}
