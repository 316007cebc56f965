//! W3C Trace Context (https://www.w3.org/TR/trace-context/): the request's
//! `traceparent` and `tracestate`. An incoming `traceparent` of version
//! `00` with a 32-hex trace id and a 16-hex parent id (neither all zero) and
//! 2-hex flags is continued: the trace id and flags are kept and the node
//! takes a new span id, the parent id of the next hop (an upstream, a member
//! of the cluster, a function's guest as `TRACEPARENT`). A malformed one (or
//! several) is replaced by a new trace, its `tracestate` dropped; never is
//! it forwarded as it came. Trace context is not identity: nothing
//! authorizes by it, and the hop MAC does not cover it.

use actix_web::http::header::HeaderMap;

/// The `traceparent` header's name.
pub const TRACEPARENT: &str = "traceparent";
/// The `tracestate` header's name.
pub const TRACESTATE: &str = "tracestate";
/// Longest `tracestate` passed on (the spec's 32 members of at most 256
/// bytes each need no more than this in practice); a longer one is dropped.
const MAX_TRACESTATE: usize = 512;

/// One request's trace context, in its extensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    /// The trace id (never all zero).
    pub trace_id: [u8; 16],
    /// This node's span id: the parent id sent to the next hop.
    pub span_id: [u8; 8],
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
    /// The incoming `tracestate`, when the `traceparent` was valid.
    pub tracestate: Option<String>,
    /// The parent id the request came with, when it continued a trace.
    pub parent_id: Option<[u8; 8]>,
}

impl TraceContext {
    /// A new trace (no valid `traceparent` came in).
    pub fn fresh() -> TraceContext {
        TraceContext {
            trace_id: nonzero(),
            span_id: nonzero(),
            flags: 0,
            tracestate: None,
            parent_id: None,
        }
    }

    /// The context of a request: its `traceparent` continued when it is
    /// valid (and the only one), else a new trace.
    pub fn from_headers(headers: &HeaderMap) -> TraceContext {
        let mut tps = headers.get_all(TRACEPARENT);
        let (Some(tp), None) = (tps.next(), tps.next()) else {
            return TraceContext::fresh();
        };
        let Some((trace_id, parent, flags)) = tp.to_str().ok().and_then(parse_traceparent) else {
            return TraceContext::fresh();
        };
        let tracestate = {
            let parts: Vec<&str> = headers
                .get_all(TRACESTATE)
                .filter_map(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .collect();
            let joined = parts.join(",");
            (!joined.is_empty()
                && joined.len() <= MAX_TRACESTATE
                && joined.bytes().all(|b| (0x20..0x7f).contains(&b)))
            .then_some(joined)
        };
        TraceContext {
            trace_id,
            span_id: nonzero(),
            flags,
            tracestate,
            parent_id: Some(parent),
        }
    }

    /// The `traceparent` for the next hop: `00-<trace id>-<span id>-<flags>`.
    pub fn traceparent(&self) -> String {
        format!(
            "00-{}-{}-{:02x}",
            hex::encode(self.trace_id),
            hex::encode(self.span_id),
            self.flags
        )
    }

    /// The trace id in hex (logs and records).
    pub fn trace_id_hex(&self) -> String {
        hex::encode(self.trace_id)
    }
}

/// The trace id, parent id and flags of a valid version-00 `traceparent`.
pub fn parse_traceparent(s: &str) -> Option<([u8; 16], [u8; 8], u8)> {
    let s = s.trim();
    let mut parts = s.split('-');
    let (version, trace, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || version != "00" {
        return None;
    }
    let lower_hex = |p: &str, n: usize| {
        p.len() == n && p.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    if !lower_hex(trace, 32) || !lower_hex(parent, 16) || !lower_hex(flags, 2) {
        return None;
    }
    let mut t = [0u8; 16];
    let mut p = [0u8; 8];
    let mut f = [0u8; 1];
    hex::decode_to_slice(trace, &mut t).ok()?;
    hex::decode_to_slice(parent, &mut p).ok()?;
    hex::decode_to_slice(flags, &mut f).ok()?;
    if t == [0; 16] || p == [0; 8] {
        return None;
    }
    Some((t, p, f[0]))
}

/// Random-looking bytes, not all zero. Ids name, they do not authorize: a
/// per-thread SplitMix64 seeded once from the OS (no system call per
/// request, as for request ids in `chain::logger`).
fn nonzero<const N: usize>() -> [u8; N] {
    use std::cell::Cell;
    thread_local! {
        static STATE: Cell<u64> =
            Cell::new(u64::from_le_bytes(crate::util::random_bytes::<8>()));
    }
    loop {
        let mut out = [0u8; N];
        for chunk in out.chunks_mut(8) {
            let z = STATE.with(|s| {
                let mut z = s.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
                s.set(z);
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^ (z >> 31)
            });
            chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
        }
        if out.iter().any(|&x| x != 0) {
            return out;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::http::header::{HeaderName, HeaderValue};

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// A valid traceparent is continued: same trace id and flags, a new span id.
    #[test]
    fn trace_valid_traceparent_is_continued() {
        let t = TraceContext::from_headers(&headers(&[
            (TRACEPARENT, GOOD),
            (TRACESTATE, "congo=t61rcWkgMzE"),
        ]));
        assert_eq!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.flags, 1);
        assert_eq!(hex::encode(t.parent_id.unwrap()), "00f067aa0ba902b7");
        assert_ne!(hex::encode(t.span_id), "00f067aa0ba902b7");
        assert_eq!(t.tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
        let tp = t.traceparent();
        assert!(tp.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"), "{tp}");
        assert!(tp.ends_with("-01"));
        assert_eq!(parse_traceparent(&tp).map(|p| p.0), Some(t.trace_id));
    }

    /// Malformed ones are replaced by a new trace, their tracestate dropped.
    #[test]
    fn trace_malformed_traceparent_is_replaced() {
        for bad in [
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "garbage",
            "",
        ] {
            let t = TraceContext::from_headers(&headers(&[(TRACEPARENT, bad), (TRACESTATE, "a=b")]));
            assert_ne!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736", "{bad}");
            assert_eq!(t.parent_id, None, "{bad}");
            assert_eq!(t.tracestate, None, "{bad}");
            assert!(parse_traceparent(&t.traceparent()).is_some());
        }
        // Two traceparents: replaced too.
        let t = TraceContext::from_headers(&headers(&[(TRACEPARENT, GOOD), (TRACEPARENT, GOOD)]));
        assert_eq!(t.parent_id, None);
        // None: a new trace.
        let t = TraceContext::from_headers(&HeaderMap::new());
        assert!(parse_traceparent(&t.traceparent()).is_some());
    }
}
