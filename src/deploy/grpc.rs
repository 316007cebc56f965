//! gRPC to a deployment's instances (docs/deployments.md "gRPC"): the
//! `grpc-timeout` header, gRPC status codes and how the node's own errors
//! read as one, the answer body that passes the upstream's trailers and
//! ends a call whose deadline passed or whose upstream broke with a status,
//! and the HTTP/2 client (hyper) of the instances: `http://` ones with
//! prior knowledge (h2c), `https://` ones over TLS with ALPN `h2`.
//!
//! Serving the calls (the listener, the chain's steps) is
//! `crate::http::grpc`; this file has no listener and no chain.

use super::h1::{ConnectFailure, connect_tcp};
use super::pool::{ProxyTimeouts, UpstreamPool};
use crate::error::{ApiError, Code};
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use std::cell::RefCell;
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// `grpc-status`.
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// `grpc-message`.
pub const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// `grpc-timeout`.
pub const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// The gRPC status codes the node answers with (grpc/doc/statuscodes.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcCode {
    Unknown = 2,
    DeadlineExceeded = 4,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    Unauthenticated = 16,
}

impl GrpcCode {
    /// The status as `grpc-status` carries it.
    pub fn value(self) -> HeaderValue {
        HeaderValue::from(self as u16)
    }
}

/// Whether a `content-type` is gRPC's: `application/grpc`, alone or with a
/// `+format` (`+proto`, `+json`, …) or parameters. `application/grpc-web`
/// is not.
pub fn is_grpc(content_type: &[u8]) -> bool {
    let Some(rest) = content_type
        .get(..16)
        .filter(|p| p.eq_ignore_ascii_case(b"application/grpc"))
        .map(|_| &content_type[16..])
    else {
        return false;
    };
    matches!(rest.first(), None | Some(b'+') | Some(b';'))
}

/// Parses `grpc-timeout` (gRPC over HTTP/2: 1 to 8 ASCII digits, then one
/// of `H M S m u n`); None when it is malformed.
pub fn parse_timeout(v: &[u8]) -> Option<Duration> {
    let (&unit, digits) = v.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// `d` as a `grpc-timeout` value: the finest unit whose count fits in 8
/// digits, rounded up (the upstream is never told less time than it has).
pub fn encode_timeout(d: Duration) -> HeaderValue {
    let ns = d.as_nanos().max(1);
    for (unit, per) in [
        ('n', 1u128),
        ('u', 1_000),
        ('m', 1_000_000),
        ('S', 1_000_000_000),
        ('M', 60_000_000_000),
        ('H', 3_600_000_000_000),
    ] {
        let v = ns.div_ceil(per);
        if v < 100_000_000 {
            return HeaderValue::from_str(&format!("{v}{unit}"))
                .unwrap_or(HeaderValue::from_static("99999999H"));
        }
    }
    HeaderValue::from_static("99999999H")
}

/// The deadline of a call: its own `grpc-timeout` capped by the
/// deployment's `grpc.max_timeout_ms` (either alone when the other is
/// absent; neither: none). Err: a malformed `grpc-timeout`.
pub fn deadline_of(
    header: Option<&[u8]>,
    cap: Option<Duration>,
) -> Result<Option<Duration>, ApiError> {
    let asked = match header {
        None => None,
        Some(v) => Some(parse_timeout(v).ok_or_else(|| {
            ApiError::new(
                Code::InvalidGrpcTimeout,
                format!(
                    "grpc-timeout {:?} is not 1 to 8 digits and one of H M S m u n",
                    String::from_utf8_lossy(v)
                ),
            )
        })?),
    };
    Ok(match (asked, cap) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    })
}

/// The gRPC status of one of the node's own errors: by its code where one
/// has a meaning of its own, else by its HTTP status (gRPC's
/// http-grpc-status-mapping, with a rate limit as `RESOURCE_EXHAUSTED`).
pub fn code_of(code: Code, status: u16) -> GrpcCode {
    match code {
        Code::NoRoute => return GrpcCode::Unimplemented,
        Code::InvalidGrpcTimeout => return GrpcCode::Internal,
        Code::UpstreamTimeout => return GrpcCode::DeadlineExceeded,
        _ => {}
    }
    match status {
        400 => GrpcCode::Internal,
        401 => GrpcCode::Unauthenticated,
        403 => GrpcCode::PermissionDenied,
        404 => GrpcCode::Unimplemented,
        413 | 429 => GrpcCode::ResourceExhausted,
        421 | 502 | 503 => GrpcCode::Unavailable,
        504 => GrpcCode::DeadlineExceeded,
        500 => GrpcCode::Internal,
        _ => GrpcCode::Unknown,
    }
}

/// `grpc-message`'s encoding: percent-encoded outside printable ASCII, and `%`.
pub fn encode_message(msg: &str) -> HeaderValue {
    let mut out = String::with_capacity(msg.len());
    for b in msg.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    HeaderValue::from_str(&out).unwrap_or(HeaderValue::from_static("meshgate"))
}

/// The headers (or trailers) that end a call with `code` and `message`.
pub fn status_headers(code: GrpcCode, message: &str) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(2);
    h.insert(GRPC_STATUS, code.value());
    h.insert(GRPC_MESSAGE, encode_message(message));
    h
}

/// The body of a gRPC answer: none (a Trailers-Only answer, whose status is
/// in its head) or an upstream's, passed frame by frame.
pub enum GrpcBody {
    /// Ends with the head.
    Empty,
    /// An upstream's body and what ends it early.
    Proxied(Box<Proxied>),
}

/// An upstream's answer body being passed on.
pub struct Proxied {
    inner: Incoming,
    /// When the call's deadline passes: the body ends with `DEADLINE_EXCEEDED`.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Whether the answer's head carried no status, so its trailers must
    /// (made up when the upstream ended without).
    needs_status: bool,
    /// The body ended (a status sent, or the upstream's end passed on).
    ended: bool,
}

impl GrpcBody {
    /// The upstream's body, ended at `deadline` if it runs that long;
    /// `needs_status`: its head had no `grpc-status`.
    pub fn proxied(
        inner: Incoming,
        deadline: Option<tokio::time::Instant>,
        needs_status: bool,
    ) -> GrpcBody {
        GrpcBody::Proxied(Box::new(Proxied {
            inner,
            deadline: deadline.map(|d| Box::pin(tokio::time::sleep_until(d))),
            needs_status,
            ended: false,
        }))
    }
}

impl Body for GrpcBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let p = match self.get_mut() {
            GrpcBody::Empty => return Poll::Ready(None),
            GrpcBody::Proxied(p) => p,
        };
        if p.ended {
            return Poll::Ready(None);
        }
        if let Some(d) = &mut p.deadline
            && d.as_mut().poll(cx).is_ready()
        {
            p.ended = true;
            return Poll::Ready(Some(Ok(Frame::trailers(status_headers(
                GrpcCode::DeadlineExceeded,
                "the call's deadline passed (meshgate)",
            )))));
        }
        match Pin::new(&mut p.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(f))) => {
                if f.is_trailers() {
                    p.needs_status = false;
                }
                Poll::Ready(Some(Ok(f)))
            }
            Poll::Ready(Some(Err(e))) => {
                p.ended = true;
                Poll::Ready(Some(Ok(Frame::trailers(status_headers(
                    GrpcCode::Unavailable,
                    &format!("the upstream's stream broke: {e} (meshgate)"),
                )))))
            }
            Poll::Ready(None) => {
                p.ended = true;
                if p.needs_status {
                    return Poll::Ready(Some(Ok(Frame::trailers(status_headers(
                        GrpcCode::Internal,
                        "the upstream ended the call without a status (meshgate)",
                    )))));
                }
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            GrpcBody::Empty => true,
            GrpcBody::Proxied(p) => p.ended,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            GrpcBody::Empty => SizeHint::with_exact(0),
            GrpcBody::Proxied(_) => SizeHint::default(),
        }
    }
}

/// Runs hyper's connection tasks on the current actix worker thread (the
/// connection and its calls live there, as every proxied request does).
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalExec;

impl<F> hyper::rt::Executor<F> for LocalExec
where
    F: Future + 'static,
{
    fn execute(&self, fut: F) {
        actix_web::rt::spawn(async move {
            fut.await;
        });
    }
}

/// One HTTP/2 connection to an instance: calls are multiplexed on it.
type Sender = hyper::client::conn::http2::SendRequest<Incoming>;

thread_local! {
    /// This worker's connection to each instance of each deployment, by
    /// (namespace, deployment, base URL): HTTP/2 multiplexes a deployment's
    /// calls on one, and a closed one is replaced. Never shared between
    /// deployments: calls whose answers a client does not read fill a
    /// connection's flow-control window, and a tenant naming another's
    /// instance URL must not stall that tenant's calls.
    static CONNS: RefCell<HashMap<String, Sender>> = RefCell::new(HashMap::new());
}

/// The TLS client config of `https://` instances for gRPC: the proxy's
/// (`super::awc_client::upstream_tls`), with ALPN `h2` only.
fn h2_tls() -> Arc<rustls::ClientConfig> {
    static TLS: std::sync::OnceLock<Arc<rustls::ClientConfig>> = std::sync::OnceLock::new();
    TLS.get_or_init(|| {
        let mut cfg = (*super::awc_client::upstream_tls()).clone();
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(cfg)
    })
    .clone()
}

/// A connection to instance `i` of `pool`, the pool of deployment `owner`
/// (namespace, name): this worker's open one, or a new one (the egress
/// policy checked, within the connect timeout).
pub async fn sender(
    owner: (&str, &str),
    pool: &UpstreamPool,
    i: usize,
    t: ProxyTimeouts,
) -> Result<Sender, ConnectFailure> {
    let inst = &pool.instances[i];
    let key = format!("{}\0{}\0{}", owner.0, owner.1, inst.base);
    let held = CONNS.with(|c| c.borrow().get(&key).cloned());
    if let Some(mut s) = held {
        if !s.is_closed() && s.ready().await.is_ok() {
            return Ok(s);
        }
        CONNS.with(|c| c.borrow_mut().remove(&key));
    }
    if let Some(r) = pool.refused(i) {
        return Err(ConnectFailure::Refused(r));
    }
    let tcp = connect_tcp(pool, inst, t).await?;
    let builder = hyper::client::conn::http2::Builder::new(LocalExec);
    let failed = |e: &dyn std::fmt::Display| ConnectFailure::Failed(format!("{}: {e}", inst.base));
    let (tx, spawned) = if inst.base.starts_with("https://") {
        let host = inst
            .host_port
            .as_ref()
            .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']').to_string())
            .unwrap_or_default();
        let name = rustls_pki_types::ServerName::try_from(host).map_err(|e| failed(&e))?;
        let tls = tokio::time::timeout(
            t.connect,
            tokio_rustls::TlsConnector::from(h2_tls()).connect(name, tcp),
        )
        .await
        .map_err(|_| failed(&"the TLS handshake timed out"))?
        .map_err(|e| failed(&e))?;
        let (tx, conn) = builder
            .handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|e| failed(&e))?;
        (tx, actix_web::rt::spawn(async move { conn.await.is_ok() }))
    } else {
        let (tx, conn) = builder
            .handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .map_err(|e| failed(&e))?;
        (tx, actix_web::rt::spawn(async move { conn.await.is_ok() }))
    };
    drop(spawned);
    CONNS.with(|c| c.borrow_mut().insert(key, tx.clone()));
    Ok(tx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every unit parses; malformed values (no digits, nine digits, a
    /// sign, an unknown unit, spaces) are refused, never a panic.
    #[test]
    fn timeouts_parse_and_malformed_are_refused() {
        assert_eq!(parse_timeout(b"100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse_timeout(b"1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_timeout(b"2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_timeout(b"3S"), Some(Duration::from_secs(3)));
        assert_eq!(parse_timeout(b"7u"), Some(Duration::from_micros(7)));
        assert_eq!(
            parse_timeout(b"99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        assert_eq!(
            parse_timeout(b"99999999H"),
            Some(Duration::from_secs(99_999_999 * 3600))
        );
        for bad in [
            &b""[..],
            b"m",
            b"100",
            b"100x",
            b"123456789m",
            b"-1m",
            b"+1m",
            b" 1m",
            b"1 m",
            b"1.5S",
            b"\xff\xfem",
        ] {
            assert_eq!(parse_timeout(bad), None, "{bad:?}");
        }
    }

    /// Any bytes at all: a value or None, never a panic.
    #[test]
    fn timeout_parser_never_panics() {
        use proptest::prelude::*;
        proptest!(|(v in proptest::collection::vec(any::<u8>(), 0..12))| {
            let _ = parse_timeout(&v);
        });
    }

    /// An encoded timeout reads back as at least as long, within 8 digits.
    #[test]
    fn timeouts_encode_within_eight_digits() {
        for d in [
            Duration::from_nanos(1),
            Duration::from_millis(100),
            Duration::from_secs(1),
            Duration::from_secs(86_400 * 365),
        ] {
            let v = encode_timeout(d);
            let back = parse_timeout(v.as_bytes()).expect("parses");
            assert!(back >= d, "{d:?} -> {v:?}");
            assert!(v.len() <= 9);
        }
    }

    /// The cap wins when lower; either alone stands; a malformed header is
    /// `INVALID_GRPC_TIMEOUT`, answered as `INTERNAL`.
    #[test]
    fn deadline_is_capped() {
        let cap = Some(Duration::from_millis(500));
        assert_eq!(
            deadline_of(Some(b"2S"), cap).unwrap(),
            Some(Duration::from_millis(500))
        );
        assert_eq!(
            deadline_of(Some(b"100m"), cap).unwrap(),
            Some(Duration::from_millis(100))
        );
        assert_eq!(deadline_of(None, cap).unwrap(), cap);
        assert_eq!(deadline_of(None, None).unwrap(), None);
        let e = deadline_of(Some(b"soon"), cap).unwrap_err();
        assert_eq!(e.code, Code::InvalidGrpcTimeout);
        assert_eq!(code_of(e.code, e.status.as_u16()), GrpcCode::Internal);
    }

    /// The content types of gRPC, and not gRPC-Web's.
    #[test]
    fn grpc_content_types() {
        for ok in [
            &b"application/grpc"[..],
            b"application/grpc+proto",
            b"application/grpc+json",
            b"Application/GRPC;charset=utf-8",
        ] {
            assert!(is_grpc(ok), "{ok:?}");
        }
        for no in [
            &b"application/grpc-web"[..],
            b"application/grpcx",
            b"application/json",
            b"",
        ] {
            assert!(!is_grpc(no), "{no:?}");
        }
    }

    /// The node's refusals read as the gRPC statuses clients expect.
    #[test]
    fn refusals_map_to_statuses() {
        assert_eq!(code_of(Code::NoRoute, 404), GrpcCode::Unimplemented);
        assert_eq!(code_of(Code::NoHealthyUpstream, 503), GrpcCode::Unavailable);
        assert_eq!(code_of(Code::UpstreamFailed, 502), GrpcCode::Unavailable);
        assert_eq!(
            code_of(Code::UpstreamTimeout, 504),
            GrpcCode::DeadlineExceeded
        );
        assert_eq!(
            code_of(Code::MissingCredential, 401),
            GrpcCode::Unauthenticated
        );
        assert_eq!(
            code_of(Code::NamespaceMismatch, 403),
            GrpcCode::PermissionDenied
        );
        assert_eq!(code_of(Code::RateLimited, 429), GrpcCode::ResourceExhausted);
        assert_eq!(
            encode_message("50% done\n").to_str().unwrap(),
            "50%25 done%0A"
        );
    }
}
