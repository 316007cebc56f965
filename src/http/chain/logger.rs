//! Step 3's parts: the request's id and the span its events sit in. The
//! request log itself is `access_log.rs`; the chain (`front.rs`) and
//! the routed fast path (`deploy_serve.rs`) both call these.

use super::context::REQUEST_ID;
use actix_web::dev::ServiceRequest;

/// The request's id: the client's `X-Request-ID` when it is 1 to 128
/// printable ASCII characters, else a fresh one.
pub fn request_id(req: &ServiceRequest) -> String {
    req.headers()
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(fresh_request_id)
}

/// The span events of one request sit in; disabled (free) unless `RUST_LOG`
/// enables DEBUG for `meshgate`.
pub fn request_span(method: &actix_web::http::Method, path: &str, id: &str) -> tracing::Span {
    tracing::debug_span!("request", method = %method, path = %path, request_id = %id)
}

/// A request id no other request of this process had: 24 hex digits, 8
/// random bytes drawn once per process, then a 4-byte counter. Request ids
/// name, they do not authorize (a client may send its own), so they need to
/// be distinct, not unpredictable; drawing 12 fresh random bytes per request
/// cost a system call on every request. Each thread takes the counter in
/// blocks of [`ID_BLOCK`], so the workers do not pass one cache line between
/// them on every request; the ids stay distinct (a block is handed out once).
pub fn fresh_request_id() -> String {
    use std::cell::Cell;
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU32, Ordering};
    static PREFIX: OnceLock<[u8; 16]> = OnceLock::new();
    static NEXT_BLOCK: AtomicU32 = AtomicU32::new(0);
    thread_local! {
        /// This thread's next counter value and the end of its block.
        static BLOCK: Cell<(u32, u32)> = const { Cell::new((0, 0)) };
    }
    let prefix = PREFIX.get_or_init(|| {
        let mut hex = [0u8; 16];
        hex::encode_to_slice(crate::util::random_bytes::<8>(), &mut hex)
            .expect("8 bytes are 16 hex digits");
        hex
    });
    let n = BLOCK.with(|b| {
        let (mut next, mut end) = b.get();
        if next == end {
            next = NEXT_BLOCK.fetch_add(ID_BLOCK, Ordering::Relaxed);
            end = next.wrapping_add(ID_BLOCK);
        }
        b.set((next.wrapping_add(1), end));
        next
    });
    let mut id = [0u8; 24];
    id[..16].copy_from_slice(prefix);
    hex::encode_to_slice(n.to_be_bytes(), &mut id[16..]).expect("4 bytes are 8 hex digits");
    String::from_utf8_lossy(&id).into_owned()
}

/// How many request ids a thread takes from the shared counter at a time.
const ID_BLOCK: u32 = 256;

#[cfg(test)]
mod tests {
    use super::fresh_request_id;

    /// A generated id is 24 lowercase hex digits: the process's 16, then the
    /// counter's 8; the next id differs only in the counter.
    #[test]
    fn fresh_request_ids_are_24_hex_digits_and_distinct() {
        let a = fresh_request_id();
        let b = fresh_request_id();
        for id in [&a, &b] {
            assert_eq!(id.len(), 24, "{id}");
            assert!(
                id.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')),
                "{id}"
            );
        }
        assert_ne!(a, b);
        assert_eq!(a[..16], b[..16], "one prefix per process");
        let (na, nb) = (
            u32::from_str_radix(&a[16..], 16).unwrap(),
            u32::from_str_radix(&b[16..], 16).unwrap(),
        );
        assert!(nb > na, "the counter counts up: {a} then {b}");
    }

    /// Threads take the counter in blocks: ids made on several threads at
    /// once, each past a block's end, are still all distinct.
    #[test]
    fn fresh_request_ids_from_several_threads_are_distinct() {
        let per_thread = super::ID_BLOCK as usize * 3 + 7;
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    (0..per_thread)
                        .map(|_| fresh_request_id())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all = std::collections::HashSet::new();
        for t in threads {
            for id in t.join().unwrap() {
                assert!(all.insert(id.clone()), "{id} was made twice");
            }
        }
        assert_eq!(all.len(), per_thread * 4);
    }
}
