//! The bounded worker pool: a fixed set of OS threads fed by a bounded queue,
//! with a cap of running + queued invocations per namespace.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use parking_lot::Mutex;

use super::error::{Result, WasmError};
use super::limits::WORKER_STACK_BYTES;

/// A snapshot of the pool, for metrics and the dashboard.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Worker threads.
    pub workers: usize,
    /// Workers running a guest now.
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
    /// Waiting in the queue.
    pub queued: usize,
}

#[derive(Default)]
struct NsCount {
    running: usize,
    queued: usize,
}

struct Shared {
    rx: Mutex<Receiver<Task>>,
    busy: AtomicUsize,
    queued: AtomicUsize,
    namespaces: Mutex<HashMap<String, NsCount>>,
}

/// One namespace slot, held from admission until the job is done (or dropped).
struct Permit {
    shared: Arc<Shared>,
    namespace: String,
    started: bool,
}

impl Permit {
    fn start(&mut self) {
        let mut map = self.shared.namespaces.lock();
        if let Some(c) = map.get_mut(&self.namespace) {
            c.queued = c.queued.saturating_sub(1);
            c.running += 1;
        }
        self.started = true;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut map = self.shared.namespaces.lock();
        if let Some(c) = map.get_mut(&self.namespace) {
            if self.started {
                c.running = c.running.saturating_sub(1);
            } else {
                c.queued = c.queued.saturating_sub(1);
            }
            if c.running == 0 && c.queued == 0 {
                map.remove(&self.namespace);
            }
        }
    }
}

struct Task {
    permit: Permit,
    job: Box<dyn FnOnce() + Send>,
}

pub(crate) struct Pool {
    tx: SyncSender<Task>,
    shared: Arc<Shared>,
    workers: usize,
    namespace_cap: usize,
}

impl Pool {
    pub(crate) fn new(workers: usize, queue: usize, namespace_cap: usize) -> Result<Self> {
        let workers = workers.max(1);
        let (tx, rx) = sync_channel(queue);
        let shared = Arc::new(Shared {
            rx: Mutex::new(rx),
            busy: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            namespaces: Mutex::new(HashMap::new()),
        });
        for i in 0..workers {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("wasm-worker-{i}"))
                .stack_size(WORKER_STACK_BYTES)
                .spawn(move || worker(&shared))
                .map_err(|e| WasmError::Internal(format!("cannot spawn a WASM worker: {e}")))?;
        }
        Ok(Self {
            tx,
            shared,
            workers,
            namespace_cap: namespace_cap.max(1),
        })
    }

    /// Queues `job` for `namespace`, or refuses it (`Busy`, `Overloaded`).
    pub(crate) fn submit(&self, namespace: &str, job: Box<dyn FnOnce() + Send>) -> Result<()> {
        {
            let mut map = self.shared.namespaces.lock();
            let count = map.entry(namespace.to_owned()).or_default();
            if count.running + count.queued >= self.namespace_cap {
                return Err(WasmError::Busy);
            }
            count.queued += 1;
        }
        let permit = Permit {
            shared: self.shared.clone(),
            namespace: namespace.to_owned(),
            started: false,
        };
        self.shared.queued.fetch_add(1, Ordering::Relaxed);
        match self.tx.try_send(Task { permit, job }) {
            Ok(()) => Ok(()),
            // Dropping the returned task releases its namespace slot.
            Err(TrySendError::Full(_)) => {
                self.shared.queued.fetch_sub(1, Ordering::Relaxed);
                Err(WasmError::Overloaded)
            }
            Err(TrySendError::Disconnected(_)) => {
                self.shared.queued.fetch_sub(1, Ordering::Relaxed);
                Err(WasmError::Internal("WASM worker pool stopped".into()))
            }
        }
    }

    pub(crate) fn stats(&self) -> PoolStats {
        let mut namespaces: Vec<NamespaceStats> = self
            .shared
            .namespaces
            .lock()
            .iter()
            .map(|(ns, c)| NamespaceStats {
                namespace: ns.clone(),
                running: c.running,
                queued: c.queued,
            })
            .collect();
        namespaces.sort_by(|a, b| a.namespace.cmp(&b.namespace));
        PoolStats {
            workers: self.workers,
            busy: self.shared.busy.load(Ordering::Relaxed),
            queued: self.shared.queued.load(Ordering::Relaxed),
            namespaces,
        }
    }
}

fn worker(shared: &Shared) {
    loop {
        // Only one idle worker waits in `recv`; the others wait for the lock.
        let task = shared.rx.lock().recv();
        let Ok(Task { mut permit, job }) = task else {
            return; // The engine is gone.
        };
        shared.queued.fetch_sub(1, Ordering::Relaxed);
        permit.start();
        shared.busy.fetch_add(1, Ordering::Relaxed);
        if std::panic::catch_unwind(AssertUnwindSafe(job)).is_err() {
            tracing::error!("A WASM job panicked; the worker carries on.");
        }
        shared.busy.fetch_sub(1, Ordering::Relaxed);
        drop(permit);
    }
}
