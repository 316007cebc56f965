//! The compile gate: at most `compile_concurrency` compiles run on the node
//! at once, and at most one per namespace.
//!
//! A compile is CPU and memory the node spends on a tenant's behalf before
//! anything is stored: two at once of one heavy module doubled the node's
//! memory. A namespace that asks for a second compile while its first one
//! waits or runs is refused at once (`CompileBusy`, 429 `COMPILE_BUSY`), so
//! a tenant never holds more than one slot nor queues behind itself; other
//! namespaces wait for a free slot until their deadline (`CompileTimeout`,
//! 503 `COMPILE_TIMEOUT`). An invocation's compile of a stored module (a
//! cache miss: a new member of a cluster, a wiped cache) takes a slot too,
//! but waits behind its namespace's compile instead of being refused. A
//! module sent as WAT text is parsed inside its slot too: parsing text
//! costs more memory than compiling what it describes (a 16 MiB text of
//! empty functions took +1 GiB), so it must not run beside the gate. A compile that is running cannot be stopped:
//! past its deadline its caller is answered and its result is dropped, and
//! it keeps its slot until it ends, so the bound holds for what really runs.

#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::error::{Result, WasmError};

/// Who compiles now.
#[derive(Default)]
struct Slots {
    /// Compiles running (at most `CompileGate::slots`).
    running: usize,
    /// Namespaces with a compile waiting or running.
    namespaces: HashSet<String>,
}

/// Bounds the compiles of the node; see the module's doc.
pub(crate) struct CompileGate {
    /// Compiles that may run at once, node-wide (at least 1).
    slots: usize,
    /// The running count and the namespaces in the gate.
    state: Mutex<Slots>,
    /// Signalled when a slot frees.
    freed: Condvar,
}

/// A slot of the gate, held while one compile runs; frees it on drop.
pub(crate) struct CompileSlot<'a> {
    /// The gate the slot belongs to.
    gate: &'a CompileGate,
    /// The namespace that holds it.
    namespace: String,
}

impl CompileGate {
    /// A gate of `slots` compiles at once (0 is taken as 1).
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            slots: slots.max(1),
            state: Mutex::new(Slots::default()),
            freed: Condvar::new(),
        }
    }

    /// Takes a slot for `namespace`, waiting until `deadline` for one to
    /// free. When the namespace already has a compile in the gate:
    /// `CompileBusy` at once (a deploy), or with `queue_behind` a wait for
    /// it to end (an invocation's compile of a stored module, which should
    /// not fail as busy). `CompileTimeout` when no slot freed in time.
    /// Blocks: call it from a blocking thread.
    pub(crate) fn enter(
        &self,
        namespace: &str,
        deadline: Instant,
        queue_behind: bool,
    ) -> Result<CompileSlot<'_>> {
        let mut s = self.state.lock();
        if s.namespaces.contains(namespace) && !queue_behind {
            return Err(WasmError::CompileBusy);
        }
        while s.namespaces.contains(namespace) || s.running >= self.slots {
            if self.freed.wait_until(&mut s, deadline).timed_out()
                && (s.namespaces.contains(namespace) || s.running >= self.slots)
            {
                return Err(WasmError::CompileTimeout(
                    "no compile slot freed before the deadline".into(),
                ));
            }
        }
        s.namespaces.insert(namespace.to_string());
        s.running += 1;
        Ok(CompileSlot {
            gate: self,
            namespace: namespace.to_string(),
        })
    }

    /// Compiles running now.
    pub(crate) fn running(&self) -> usize {
        self.state.lock().running
    }
}

impl Drop for CompileSlot<'_> {
    fn drop(&mut self) {
        let mut s = self.gate.state.lock();
        s.running -= 1;
        s.namespaces.remove(&self.namespace);
        drop(s);
        // Waiters wait for different things (a slot, their namespace).
        self.gate.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn soon(ms: u64) -> Instant {
        crate::util::mono_now() + Duration::from_millis(ms)
    }

    /// Obeyed: two namespaces share one slot in turn; the second gets it
    /// once the first frees it.
    #[test]
    fn compile_slots_obeyed() {
        let gate = std::sync::Arc::new(CompileGate::new(1));
        let first = gate.enter("a", soon(1_000), false).unwrap();
        assert_eq!(gate.running(), 1);
        let g = gate.clone();
        let waiter = std::thread::spawn(move || g.enter("b", soon(30_000), false).map(|_| ()));
        std::thread::sleep(Duration::from_millis(20));
        // The waiter cannot get the slot while `first` holds it.
        assert!(!waiter.is_finished());
        assert_eq!(gate.running(), 1);
        drop(first);
        assert_eq!(waiter.join().unwrap(), Ok(()));
        assert_eq!(gate.running(), 0);

        // An invocation's compile queues behind its namespace's own.
        let two = std::sync::Arc::new(CompileGate::new(2));
        let deploy = two.enter("a", soon(1_000), false).unwrap();
        let g = two.clone();
        let queued = std::thread::spawn(move || g.enter("a", soon(30_000), true).map(|_| ()));
        std::thread::sleep(Duration::from_millis(20));
        assert!(!queued.is_finished(), "ran beside its namespace's compile");
        drop(deploy);
        assert_eq!(queued.join().unwrap(), Ok(()));
    }

    /// Violated: the node's only slot stays taken past the deadline
    /// (`CompileTimeout`), and a namespace's second compile is refused at
    /// once (`CompileBusy`) while its first one holds a slot, even a free
    /// slot being there.
    #[test]
    fn compile_slots_violated() {
        let gate = CompileGate::new(1);
        let _held = gate.enter("a", soon(1_000), false).unwrap();
        let e = gate.enter("b", soon(20), false).err().unwrap();
        assert!(matches!(e, WasmError::CompileTimeout(_)), "{e:?}");
        // The namespace that timed out is not in the gate: it may ask again.
        assert!(!gate.state.lock().namespaces.contains("b"));

        let two = CompileGate::new(2);
        let _a = two.enter("a", soon(1_000), false).unwrap();
        assert_eq!(
            two.enter("a", soon(1_000), false).err().unwrap(),
            WasmError::CompileBusy
        );
        // Queued behind its namespace's compile, until the deadline.
        let e = two.enter("a", soon(20), true).err().unwrap();
        assert!(matches!(e, WasmError::CompileTimeout(_)), "{e:?}");
        assert!(two.enter("b", soon(1_000), false).is_ok());
    }
}
