//! The WASM workers' CPU priority: below the threads that serve requests.
//!
//! Guests are tenants' code and may compute for their whole timeout; the
//! HTTP workers, the actors and the socket relays move everyone's requests.
//! On a node whose cores the workers keep busy, a request of another tenant
//! (or of the same one) would otherwise wait for the scheduler's time slice
//! behind a guest. Linux keeps a nice value per thread, so each worker lowers
//! its own; the scheduler still gives the workers every cycle nothing else
//! wants.

/// The nice value of a WASM worker thread (0 is the default; 19 the lowest).
pub const WORKER_NICE: i32 = 10;

/// Lowers the calling thread's priority to nice value `nice`, or leaves it
/// where it is if it is already lower (a node started with `nice` keeps its
/// order); false where that is not possible (another OS, or refused). A
/// thread that keeps its priority works the same, only without the head
/// start it gives the request path.
#[allow(unsafe_code)]
pub fn lower_this_thread(nice: i32) -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid, getpriority and setpriority take and return plain
        // integers and touch no memory of ours; on PRIO_PROCESS with a thread
        // id they read and change only that thread's nice value.
        unsafe {
            let tid = libc::gettid() as libc::id_t;
            let now = libc::getpriority(libc::PRIO_PROCESS, tid);
            libc::setpriority(libc::PRIO_PROCESS, tid, nice.max(now)) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = nice;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node's `[functions] worker_nice` default is this engine's default.
    #[test]
    fn the_config_default_is_the_engine_default() {
        assert_eq!(
            crate::config::Config::default().functions.worker_nice,
            WORKER_NICE
        );
    }

    /// A thread that lowers itself reads its new nice value back; another
    /// thread of the process keeps its own.
    #[test]
    #[cfg(target_os = "linux")]
    fn a_worker_lowers_only_itself() {
        #[allow(unsafe_code)]
        fn nice_of_this_thread() -> i32 {
            // SAFETY: as above; getpriority reads one integer.
            unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
        }
        let before = nice_of_this_thread();
        let lowered =
            std::thread::spawn(|| (lower_this_thread(WORKER_NICE), nice_of_this_thread()))
                .join()
                .unwrap();
        assert_eq!(lowered, (true, WORKER_NICE.max(before)));
        assert_eq!(
            nice_of_this_thread(),
            before,
            "the caller keeps its priority"
        );
    }
}
