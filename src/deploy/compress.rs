//! Gzip of proxied answers (docs/deployments.md "Compression"):
//! an upstream's answer that it did not encode itself, of a compressible
//! type and not too small, is gzipped as it streams for a client that
//! accepts gzip. The decision ([`decide`]) reads a few headers the answer
//! and the request already have, so uncompressed traffic pays for a header
//! lookup or two; the encoder ([`GzipBody`]) is built only for an answer
//! that is compressed, and passes on what it has whenever the upstream
//! has nothing more for now (a slow stream is not held back).

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::http::header::{self, HeaderMap, HeaderValue};
use actix_web::http::{Method, StatusCode};
use actix_web::{HttpRequest, HttpResponse};
use bytes::Bytes;
use std::io::Write;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Answers of a known length below this are sent as they are (as the node's
/// own answers: a fresh encoder costs more than it saves on them).
pub(crate) const MIN_SIZE: u64 = 1024;

/// What to do with an answer.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub(crate) enum Decision {
    /// Leave it alone: it is never compressed whatever the client accepts.
    Keep,
    /// It would be compressed for a client accepting gzip; this one does
    /// not: only `Vary: Accept-Encoding` is added (caches keep both forms apart).
    VaryOnly,
    /// Gzip it.
    Gzip,
}

/// Whether an `Accept-Encoding` value accepts gzip: `gzip` (or `x-gzip`)
/// with a non-zero q, else `*` with a non-zero q.
pub(crate) fn accepts_gzip(value: &[u8]) -> bool {
    let mut star = false;
    for item in value.split(|&b| b == b',') {
        let mut parts = item.split(|&b| b == b';');
        let name = parts.next().unwrap_or_default().trim_ascii();
        let q_zero = parts.any(|p| {
            let p = p.trim_ascii();
            p.len() >= 2
                && p[..2].eq_ignore_ascii_case(b"q=")
                && p[2..].iter().all(|&b| b == b'0' || b == b'.')
        });
        if name.eq_ignore_ascii_case(b"gzip") || name.eq_ignore_ascii_case(b"x-gzip") {
            return !q_zero;
        }
        if name == b"*" {
            star = !q_zero;
        }
    }
    star
}

/// Whether a `Content-Type` is worth compressing: text (not an event
/// stream, whose events must not wait in an encoder), JSON, JavaScript,
/// XML and SVG.
pub(crate) fn compressible(content_type: &[u8]) -> bool {
    let essence = content_type
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    let is = |t: &[u8]| essence.eq_ignore_ascii_case(t);
    let ends = |t: &[u8]| {
        essence.len() > t.len() && essence[essence.len() - t.len()..].eq_ignore_ascii_case(t)
    };
    if is(b"text/event-stream") {
        return false;
    }
    (essence.len() > 5 && essence[..5].eq_ignore_ascii_case(b"text/"))
        || is(b"application/json")
        || is(b"application/javascript")
        || is(b"application/xml")
        || is(b"image/svg+xml")
        || ends(b"+json")
        || ends(b"+xml")
}

/// Whether any value of header `name` lists `token` (comma-separated, any case).
fn lists(h: &HeaderMap, name: &header::HeaderName, token: &[u8]) -> bool {
    h.get_all(name).any(|v| {
        v.as_bytes()
            .split(|&b| b == b',')
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
    })
}

/// What to do with the upstream's answer `res` to `req`. Never for a HEAD
/// request, a request with `Range`, a 206, 204, 304 or 1xx, an answer the
/// upstream encoded (any `Content-Encoding` but `identity`), one with
/// `Content-Range` or `Cache-Control: no-transform`, a type that is not
/// [`compressible`], or one of a known length under [`MIN_SIZE`].
pub(crate) fn decide(req: &HttpRequest, res: &HttpResponse) -> Decision {
    let status = res.status();
    if status == StatusCode::PARTIAL_CONTENT
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
        || status.is_informational()
        || req.method() == Method::HEAD
    {
        return Decision::Keep;
    }
    match res.body().size() {
        BodySize::Sized(n) if n >= MIN_SIZE => {}
        BodySize::Stream => {}
        _ => return Decision::Keep,
    }
    let h = res.headers();
    if !h
        .get(header::CONTENT_TYPE)
        .is_some_and(|ct| compressible(ct.as_bytes()))
    {
        return Decision::Keep;
    }
    if h.get(header::CONTENT_ENCODING)
        .is_some_and(|ce| !ce.as_bytes().eq_ignore_ascii_case(b"identity"))
        || h.contains_key(header::CONTENT_RANGE)
        || req.headers().contains_key(header::RANGE)
        || lists(h, &header::CACHE_CONTROL, b"no-transform")
    {
        return Decision::Keep;
    }
    if req
        .headers()
        .get_all(header::ACCEPT_ENCODING)
        .any(|v| accepts_gzip(v.as_bytes()))
    {
        Decision::Gzip
    } else {
        Decision::VaryOnly
    }
}

/// The upstream's answer, gzipped when [`decide`] says so: `Vary:
/// Accept-Encoding` added to any answer that could be; a gzipped one gets
/// `Content-Encoding: gzip`, loses its length (sent chunked) and
/// `Accept-Ranges`, and a strong `ETag` is made weak (the bytes differ
/// from the upstream's, the content does not).
pub(crate) fn apply(req: &HttpRequest, mut res: HttpResponse) -> HttpResponse {
    let d = decide(req, &res);
    if d == Decision::Keep {
        return res;
    }
    let h = res.headers_mut();
    if !lists(h, &header::VARY, b"accept-encoding") && !lists(h, &header::VARY, b"*") {
        h.append(header::VARY, HeaderValue::from_static("accept-encoding"));
    }
    if d == Decision::VaryOnly {
        return res;
    }
    h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    h.remove(header::CONTENT_LENGTH);
    h.remove(header::ACCEPT_RANGES);
    if let Some(etag) = h.get(header::ETAG)
        && etag.as_bytes().first() == Some(&b'"')
    {
        let mut weak = Vec::with_capacity(etag.len() + 2);
        weak.extend_from_slice(b"W/");
        weak.extend_from_slice(etag.as_bytes());
        match HeaderValue::from_bytes(&weak) {
            Ok(v) => {
                h.insert(header::ETAG, v);
            }
            Err(_) => {
                h.remove(header::ETAG);
            }
        }
    }
    res.map_body(|_, body| BoxBody::new(GzipBody::new(body)))
}

/// A body gzipped as it streams: what the encoder has is passed on after
/// each chunk it produced output for, and flushed (a sync flush) whenever
/// the upstream has nothing more for now.
pub(crate) struct GzipBody {
    inner: BoxBody,
    /// None once the gzip trailer went out.
    enc: Option<flate2::write::GzEncoder<Vec<u8>>>,
    /// Input was written since the last flush.
    unflushed: bool,
}

impl GzipBody {
    pub(crate) fn new(inner: BoxBody) -> GzipBody {
        GzipBody {
            inner,
            enc: Some(flate2::write::GzEncoder::new(
                Vec::with_capacity(8 << 10),
                flate2::Compression::fast(),
            )),
            unflushed: false,
        }
    }
}

type BoxError = Box<dyn std::error::Error>;

/// The encoder's output so far, taken out of its buffer.
fn take(enc: &mut flate2::write::GzEncoder<Vec<u8>>) -> Bytes {
    Bytes::from(std::mem::take(enc.get_mut()))
}

impl MessageBody for GzipBody {
    type Error = BoxError;

    fn size(&self) -> BodySize {
        BodySize::Stream
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, BoxError>>> {
        let this = self.get_mut();
        loop {
            let Some(enc) = this.enc.as_mut() else {
                return Poll::Ready(None);
            };
            match Pin::new(&mut this.inner).poll_next(cx) {
                Poll::Ready(Some(Ok(chunk))) => {
                    enc.write_all(&chunk)?;
                    this.unflushed = true;
                    if !enc.get_ref().is_empty() {
                        return Poll::Ready(Some(Ok(take(enc))));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    this.enc = None;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    let out = this.enc.take().expect("checked").finish()?;
                    return Poll::Ready(Some(Ok(Bytes::from(out))));
                }
                Poll::Pending => {
                    if this.unflushed {
                        this.unflushed = false;
                        enc.flush()?;
                        if !enc.get_ref().is_empty() {
                            return Poll::Ready(Some(Ok(take(enc))));
                        }
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;
    use std::io::Read;

    #[test]
    fn accept_encoding_is_read_with_q_values() {
        for yes in [
            &b"gzip"[..],
            b"deflate, GZip;q=0.5",
            b"br, *",
            b"x-gzip",
            b"gzip;q=1.0",
        ] {
            assert!(accepts_gzip(yes), "{}", String::from_utf8_lossy(yes));
        }
        for no in [
            &b""[..],
            b"br",
            b"identity",
            b"gzip;q=0",
            b"*, gzip;q=0.0",
            b"*;q=0",
            b"gzipx",
        ] {
            assert!(!accepts_gzip(no), "{}", String::from_utf8_lossy(no));
        }
    }

    #[test]
    fn compressible_types() {
        for yes in [
            "text/html; charset=utf-8",
            "TEXT/plain",
            "application/json",
            "application/problem+json",
            "application/javascript",
            "image/svg+xml",
            "application/atom+xml",
            "application/xml",
        ] {
            assert!(compressible(yes.as_bytes()), "{yes}");
        }
        for no in [
            "text/event-stream",
            "text/event-stream; charset=utf-8",
            "image/png",
            "application/octet-stream",
            "application/zip",
            "+json",
            "text/",
        ] {
            assert!(!compressible(no.as_bytes()), "{no}");
        }
    }

    fn answer(ct: &str, body: &'static [u8]) -> HttpResponse {
        HttpResponse::Ok()
            .insert_header(("content-type", ct))
            .insert_header(("etag", "\"v1\""))
            .insert_header(("accept-ranges", "bytes"))
            .body(body)
    }

    const BIG: &[u8] = &[b'a'; 4096];

    #[test]
    fn decisions() {
        let gz = TestRequest::get()
            .insert_header(("accept-encoding", "gzip"))
            .to_http_request();
        let plain = TestRequest::get().to_http_request();
        assert_eq!(decide(&gz, &answer("text/plain", BIG)), Decision::Gzip);
        assert_eq!(
            decide(&plain, &answer("text/plain", BIG)),
            Decision::VaryOnly
        );
        assert_eq!(decide(&gz, &answer("text/plain", b"small")), Decision::Keep);
        assert_eq!(decide(&gz, &answer("image/png", BIG)), Decision::Keep);
        let head = TestRequest::default()
            .method(Method::HEAD)
            .insert_header(("accept-encoding", "gzip"))
            .to_http_request();
        assert_eq!(decide(&head, &answer("text/plain", BIG)), Decision::Keep);
        let range = TestRequest::get()
            .insert_header(("accept-encoding", "gzip"))
            .insert_header(("range", "bytes=0-9"))
            .to_http_request();
        assert_eq!(decide(&range, &answer("text/plain", BIG)), Decision::Keep);
        let mut encoded = answer("text/plain", BIG);
        encoded
            .headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("br"));
        assert_eq!(decide(&gz, &encoded), Decision::Keep);
        let mut identity = answer("text/plain", BIG);
        identity.headers_mut().insert(
            header::CONTENT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        assert_eq!(decide(&gz, &identity), Decision::Gzip);
        let mut partial = answer("text/plain", BIG);
        *partial.status_mut() = StatusCode::PARTIAL_CONTENT;
        assert_eq!(decide(&gz, &partial), Decision::Keep);
        let mut no_transform = answer("text/plain", BIG);
        no_transform.headers_mut().insert(
            header::CACHE_CONTROL,
            HeaderValue::from_static("public, No-Transform"),
        );
        assert_eq!(decide(&gz, &no_transform), Decision::Keep);
    }

    /// The gzipped answer decodes to the upstream's bytes, its strong ETag
    /// is weak, its length and Accept-Ranges are gone, Vary is added once.
    #[actix_rt::test]
    async fn applied_answers_decode_to_the_body() {
        let gz = TestRequest::get()
            .insert_header(("accept-encoding", "gzip"))
            .to_http_request();
        let mut res = answer("text/plain", BIG);
        res.headers_mut()
            .insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
        let res = apply(&gz, res);
        let h = res.headers();
        assert_eq!(h.get(header::CONTENT_ENCODING).unwrap(), "gzip");
        assert_eq!(h.get(header::ETAG).unwrap(), "W/\"v1\"");
        assert!(h.get(header::ACCEPT_RANGES).is_none());
        assert_eq!(h.get_all(header::VARY).count(), 1);
        assert_eq!(res.body().size(), BodySize::Stream);
        let bytes = actix_web::body::to_bytes(res.into_body()).await.unwrap();
        assert!(bytes.len() < BIG.len() / 10);
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&bytes[..])
            .read_to_end(&mut out)
            .unwrap();
        assert_eq!(out, BIG);
        let plain = TestRequest::get().to_http_request();
        let res = apply(&plain, answer("text/plain", BIG));
        assert_eq!(res.headers().get(header::VARY).unwrap(), "accept-encoding");
        assert!(res.headers().get(header::CONTENT_ENCODING).is_none());
        assert_eq!(res.headers().get(header::ETAG).unwrap(), "\"v1\"");
    }
}
