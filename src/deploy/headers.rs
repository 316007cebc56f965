//! The proxy's header rules, the same for every client: which headers
//! belong to one hop and are never forwarded, what the proxy adds about the
//! client (`X-Forwarded-*`, `X-Request-ID`), how the client's body is framed,
//! and how an upstream answer's head ends (no compression by the node, the
//! length of an answer that has no body). Pure functions of heads: no I/O.

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use actix_web::http::{Method, StatusCode};
use actix_web::{HttpRequest, HttpResponse};
use bytes::Bytes;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::canonical::HOP_BY_HOP;

pub(crate) fn is_hop_by_hop(name: &HeaderName, listed: &[String]) -> bool {
    HOP_BY_HOP.contains(&name.as_str()) || listed.iter().any(|l| l == name.as_str())
}

/// Header names the `Connection` header lists (also hop-by-hop).
pub(crate) fn connection_listed(h: &HeaderMap) -> Vec<String> {
    h.get_all(header::CONNECTION)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect()
}

/// What the proxy adds about the client.
pub struct Forwarded {
    /// The client's address (from a trusted proxy's X-Forwarded-For, or the
    /// peer): sent as X-Real-IP and `Forwarded: for=`, and as X-Forwarded-For
    /// when no trusted proxy sent a chain.
    pub client_ip: Option<std::net::IpAddr>,
    /// The connection's peer: appended to a trusted proxy's X-Forwarded-For chain.
    pub peer: Option<std::net::IpAddr>,
    /// The scheme the client used (`http`/`https`), sent as X-Forwarded-Proto.
    pub proto: &'static str,
    /// The Host the client asked for, sent as X-Forwarded-Host (Host itself is not passed).
    pub host: String,
    /// The request's id, sent as X-Request-ID so upstream logs can be correlated.
    pub request_id: Option<String>,
    /// The request's W3C trace context: sent as `traceparent` (this node's
    /// span as the parent) and `tracestate`, in place of the client's.
    pub trace: Option<crate::observe::trace::TraceContext>,
}

/// The request headers every client sends upstream, given to `emit` in
/// order as name and value: the client's, minus hop-by-hop ones, `Host` and
/// those only the node sets (every name that reads as `x-forwarded-*`,
/// `forwarded`, `x-real-ip` or `x-meshgate-*`, `_` read as `-`); then
/// `X-Forwarded-For` (a trusted proxy's chain with the peer appended, else
/// the client's address; the canonical step removed any other peer's),
/// `X-Forwarded-Proto`, `X-Forwarded-Host` (the routed host), `X-Real-IP`
/// and `Forwarded` (what the node saw) and `X-Request-ID` (the chain's; the
/// client's passes only when the chain has none). Each client sets `Host`
/// itself.
pub(crate) fn upstream_header_lines(
    req: &HttpRequest,
    fwd: &Forwarded,
    mut emit: impl FnMut(&str, &[u8]),
) {
    let own_id = fwd
        .request_id
        .as_deref()
        .filter(|id| value_ok(id.as_bytes()));
    let listed = connection_listed(req.headers());
    // A route's policy (http/route_policy.rs): forged X-Meshgate-* headers
    // always go, the credential unless forwarded, the checked identity is added.
    let policy_view = actix_web::HttpMessage::extensions(req)
        .get::<std::sync::Arc<super::route_policy::UpstreamView>>()
        .cloned();
    let mut prev_xff: Option<&[u8]> = None;
    for (k, v) in req.headers() {
        if super::route_policy::stripped(k.as_str(), policy_view.as_deref()) {
            continue;
        }
        match k.as_str() {
            "host" | "x-forwarded-proto" | "x-forwarded-host" => continue,
            "x-forwarded-for" => {
                prev_xff = Some(v.as_bytes());
                continue;
            }
            "x-request-id" if own_id.is_some() => continue,
            // Never forwarded as they came: replaced by the request's context.
            "traceparent" | "tracestate" => continue,
            _ => {}
        }
        // Only the node sets these, in any spelling.
        if super::canonical::judge_header(k.as_str(), true, false)
            == super::canonical::HeaderName::Drop
            || is_hop_by_hop(k, &listed)
        {
            continue;
        }
        emit(k.as_str(), v.as_bytes());
    }
    // A chain is extended only when a trusted proxy sent one (the canonical
    // step removed any other peer's): by that proxy's own address.
    let last = if prev_xff.is_some() {
        fwd.peer.or(fwd.client_ip)
    } else {
        fwd.client_ip
    };
    // One buffer for the values the node writes.
    let mut buf = Vec::with_capacity(128);
    if prev_xff.is_some() || last.is_some() {
        let xff = &mut buf;
        if let Some(prev) = prev_xff {
            xff.extend_from_slice(prev);
            if last.is_some() {
                xff.extend_from_slice(b", ");
            }
        }
        if let Some(ip) = last {
            write_ip(xff, ip);
        }
        emit("x-forwarded-for", xff);
    }
    emit("x-forwarded-proto", fwd.proto.as_bytes());
    let host_ok = value_ok(fwd.host.as_bytes());
    if host_ok {
        emit("x-forwarded-host", fwd.host.as_bytes());
    }
    if let Some(ip) = fwd.client_ip {
        buf.clear();
        write_ip(&mut buf, ip);
        emit("x-real-ip", &buf);
        // RFC 7239: an IPv6 address in brackets and quotes, the host quoted.
        let f = &mut buf;
        let len = f.len();
        f.extend_from_slice(b"for=");
        if ip.is_ipv6() {
            f.extend_from_slice(b"\"[");
            f.extend_from_within(..len);
            f.extend_from_slice(b"]\"");
        } else {
            f.extend_from_within(..len);
        }
        f.drain(..len);
        if host_ok && !fwd.host.contains('"') && !fwd.host.is_empty() {
            f.extend_from_slice(b";host=\"");
            f.extend_from_slice(fwd.host.as_bytes());
            f.push(b'"');
        }
        f.extend_from_slice(b";proto=");
        f.extend_from_slice(fwd.proto.as_bytes());
        emit("forwarded", f);
    }
    if let Some(id) = own_id {
        emit("x-request-id", id.as_bytes());
    }
    if let Some(view) = &policy_view {
        view.emit(&mut emit);
    }
    if let Some(t) = &fwd.trace {
        emit("traceparent", super::activity::traceparent(t).as_bytes());
        if let Some(ts) = &t.tracestate {
            emit("tracestate", ts.as_bytes());
        }
    }
}

/// Whether `b` may stand in a header value (no control character but tab).
pub(crate) fn value_ok(b: &[u8]) -> bool {
    b.iter().all(|&c| (c >= b' ' && c != 0x7f) || c == b'\t')
}

/// Writes `ip` as text (an IPv4 address without the formatting machinery).
pub(crate) fn write_ip(out: &mut Vec<u8>, ip: std::net::IpAddr) {
    match ip {
        std::net::IpAddr::V4(v4) => {
            for (i, o) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                if o >= 100 {
                    out.push(b'0' + o / 100);
                }
                if o >= 10 {
                    out.push(b'0' + o / 10 % 10);
                }
                out.push(b'0' + o % 10);
            }
        }
        std::net::IpAddr::V6(_) => {
            use std::io::Write;
            let _ = write!(out, "{ip}");
        }
    }
}

/// [`upstream_header_lines`] as actix's header map (awc's requests).
pub(crate) fn upstream_headers(req: &HttpRequest, fwd: &Forwarded) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(req.headers().len() + 4);
    upstream_header_lines(req, fwd, |k, v| {
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_bytes(v),
        ) {
            out.append(k, v);
        }
    });
    out
}

/// [`upstream_header_lines`] as hyper's header map (`Host` is set per instance).
pub(crate) fn h1_headers(req: &HttpRequest, fwd: &Forwarded) -> hyper::HeaderMap {
    use hyper::header::{HeaderName as HName, HeaderValue as HValue};
    let mut out = hyper::HeaderMap::with_capacity(req.headers().len() + 5);
    upstream_header_lines(req, fwd, |k, v| {
        if let (Ok(k), Ok(v)) = (HName::from_bytes(k.as_bytes()), HValue::from_bytes(v)) {
            out.append(k, v);
        }
    });
    out
}

/// How the client's body is framed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum BodyKind {
    None,
    Sized(u64),
    Chunked,
}

pub(crate) fn body_kind(req: &HttpRequest) -> BodyKind {
    if let Some(len) = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        return if len == 0 {
            BodyKind::None
        } else {
            BodyKind::Sized(len)
        };
    }
    if req.headers().contains_key(header::TRANSFER_ENCODING)
        || req.version() == actix_web::http::Version::HTTP_2
            && !matches!(*req.method(), Method::GET | Method::HEAD)
    {
        return BodyKind::Chunked;
    }
    BodyKind::None
}

/// Ends an upstream answer's head (its headers copied): the marker that keeps
/// the node's `Compress` off, and for an answer that has no body (HEAD, 204,
/// 304, 1xx) the upstream's length kept. `Break` with the whole answer when
/// it has no body; `Continue` with the head to put the body in.
pub(crate) fn finish_head(
    req: &HttpRequest,
    mut out: HttpResponse,
    len: Option<u64>,
) -> ControlFlow<HttpResponse, HttpResponse> {
    let h = out.headers_mut();
    if !h.contains_key(header::CONTENT_ENCODING) {
        h.insert(
            header::CONTENT_ENCODING,
            HeaderValue::from_static("identity"),
        );
    }
    let status = out.status();
    let no_body = req.method() == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
        || status.is_informational();
    if !no_body {
        return ControlFlow::Continue(out);
    }
    if let Some(n) = len {
        out.head_mut().no_chunking(true);
        out.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        // A body of no told size: actix then sends the head's own
        // Content-Length (for an empty body it would send 0), and no body.
        return ControlFlow::Break(out.set_body(BoxBody::new(NoBody)));
    }
    ControlFlow::Break(out)
}

/// The body of an answer that has none, whose head tells the length it
/// would have (a HEAD request's answer).
struct NoBody;

impl MessageBody for NoBody {
    type Error = std::convert::Infallible;

    fn size(&self) -> BodySize {
        BodySize::Stream
    }

    fn poll_next(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        Poll::Ready(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;

    fn fwd(ip: Option<&str>, id: Option<&str>) -> Forwarded {
        Forwarded {
            client_ip: ip.map(|s| s.parse().unwrap()),
            peer: None,
            proto: "https",
            host: "app.example".into(),
            request_id: id.map(str::to_string),
            trace: None,
        }
    }

    fn lines(req: &HttpRequest, f: &Forwarded) -> Vec<(String, String)> {
        let mut out = Vec::new();
        upstream_header_lines(req, f, |k, v| {
            out.push((k.to_string(), String::from_utf8(v.to_vec()).unwrap()))
        });
        out
    }

    /// Hop-by-hop headers, those `Connection` lists, `Host` and the ones the
    /// proxy sets are dropped; the proxy's own follow, in order.
    #[test]
    fn upstream_headers_drop_hops_and_add_forwarding() {
        let req = TestRequest::default()
            .insert_header(("host", "app.example"))
            .insert_header(("connection", "x-secret, Keep-Alive"))
            .insert_header(("x-secret", "1"))
            .insert_header(("keep-alive", "5"))
            .insert_header(("te", "trailers"))
            .insert_header(("x-forwarded-proto", "http"))
            .insert_header(("x-forwarded-host", "evil"))
            .insert_header(("x-forwarded-for", "1.2.3.4"))
            .insert_header(("x-request-id", "client-id"))
            .insert_header(("accept", "text/html"))
            .to_http_request();
        let got = lines(&req, &fwd(Some("10.0.0.7"), Some("chain-id")));
        let want: Vec<(String, String)> = [
            ("accept", "text/html"),
            ("x-forwarded-for", "1.2.3.4, 10.0.0.7"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "app.example"),
            ("x-real-ip", "10.0.0.7"),
            ("forwarded", "for=10.0.0.7;host=\"app.example\";proto=https"),
            ("x-request-id", "chain-id"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(got, want);
        // Without a chain id the client's passes; without an address no XFF is made up.
        let got = lines(&req, &fwd(None, None));
        assert!(got.contains(&("x-request-id".into(), "client-id".into())));
        assert!(got.contains(&("x-forwarded-for".into(), "1.2.3.4".into())));
        let bare = TestRequest::default().to_http_request();
        let got = lines(&bare, &fwd(None, Some("bad\nid")));
        assert!(
            got.iter()
                .all(|(k, _)| k != "x-forwarded-for" && k != "x-request-id")
        );
        // The three maps carry the same lines.
        let f = fwd(Some("::1"), Some("r"));
        assert_eq!(upstream_headers(&req, &f).len(), lines(&req, &f).len());
        assert_eq!(h1_headers(&req, &f).len(), lines(&req, &f).len());
        assert_eq!(h1_headers(&req, &f)["x-forwarded-for"], "1.2.3.4, ::1");
    }

    #[test]
    fn connection_lists_are_split_and_lowercased() {
        let mut h = HeaderMap::new();
        h.append(header::CONNECTION, HeaderValue::from_static("X-A , ,close"));
        h.append(header::CONNECTION, HeaderValue::from_static("x-b"));
        let listed = connection_listed(&h);
        assert_eq!(listed, vec!["x-a", "close", "x-b"]);
        assert!(is_hop_by_hop(&HeaderName::from_static("x-a"), &listed));
        assert!(is_hop_by_hop(&HeaderName::from_static("upgrade"), &[]));
        assert!(!is_hop_by_hop(&HeaderName::from_static("x-c"), &listed));
    }

    /// Addresses are written as `Display` writes them.
    #[test]
    fn addresses_are_written_as_text() {
        for ip in [
            "0.0.0.0",
            "127.0.0.1",
            "10.20.30.40",
            "255.199.100.9",
            "::1",
            "2001:db8::7",
        ] {
            let mut out = Vec::new();
            write_ip(&mut out, ip.parse().unwrap());
            assert_eq!(String::from_utf8(out).unwrap(), ip);
        }
        assert!(value_ok(b"a\tb c"));
        assert!(!value_ok(b"a\r\nb"));
        assert!(!value_ok(b"a\x7f"));
    }

    #[test]
    fn the_clients_body_framing_comes_from_its_head() {
        let k = |r: TestRequest| body_kind(&r.to_http_request());
        assert_eq!(k(TestRequest::get()), BodyKind::None);
        assert_eq!(
            k(TestRequest::post().insert_header(("content-length", "0"))),
            BodyKind::None
        );
        assert_eq!(
            k(TestRequest::post().insert_header(("content-length", "12"))),
            BodyKind::Sized(12)
        );
        assert_eq!(
            k(TestRequest::post().insert_header(("transfer-encoding", "chunked"))),
            BodyKind::Chunked
        );
        assert_eq!(
            k(TestRequest::post().version(actix_web::http::Version::HTTP_2)),
            BodyKind::Chunked
        );
        assert_eq!(
            k(TestRequest::get().version(actix_web::http::Version::HTTP_2)),
            BodyKind::None
        );
    }

    /// Answers without a body keep the upstream's length; all are marked identity.
    #[test]
    fn answer_heads_end_by_their_status_and_method() {
        let get = TestRequest::get().to_http_request();
        let head = TestRequest::default()
            .method(Method::HEAD)
            .to_http_request();
        let ok = || HttpResponse::new(StatusCode::OK);
        let ControlFlow::Continue(r) = finish_head(&get, ok(), Some(5)) else {
            panic!("a GET's 200 has a body")
        };
        assert_eq!(
            r.headers().get(header::CONTENT_ENCODING).unwrap(),
            "identity"
        );
        let ControlFlow::Break(r) = finish_head(&head, ok(), Some(5)) else {
            panic!("a HEAD's answer has no body")
        };
        assert_eq!(r.headers().get(header::CONTENT_LENGTH).unwrap(), "5");
        assert!(matches!(r.body().size(), BodySize::Stream));
        for s in [
            StatusCode::NO_CONTENT,
            StatusCode::NOT_MODIFIED,
            StatusCode::CONTINUE,
        ] {
            let ControlFlow::Break(r) = finish_head(&get, HttpResponse::new(s), None) else {
                panic!("{s} has no body")
            };
            assert!(r.headers().get(header::CONTENT_LENGTH).is_none());
        }
        let mut gz = ok();
        gz.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        let ControlFlow::Continue(r) = finish_head(&get, gz, None) else {
            panic!()
        };
        assert_eq!(r.headers().get(header::CONTENT_ENCODING).unwrap(), "gzip");
    }
}
