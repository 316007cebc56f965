//! What the edges read of a request before a handler acts on it: whether it
//! asks to switch protocols, and its body, read whole within a bound. One
//! copy each, for the chain, the hop gate, the forwarder, the routed hosts
//! and the routes that read a raw body.

use crate::error::{ApiError, Code};
use actix_web::http::header::{self, HeaderMap};
use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt};

/// Whether the request carries an `Upgrade` header, whatever protocol it
/// names: such a request's payload is a socket's frames, not a body.
pub fn has_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
}

/// Whether the request asks for a WebSocket: `Upgrade: websocket`, in any
/// case. Another protocol named there is not one.
pub fn is_websocket_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
}

/// The body, read whole, at most `limit` bytes. 413 `PAYLOAD_TOO_LARGE`
/// before a byte is read when `Content-Length` already declares more, else
/// as soon as what arrived passes `limit` (a body without a length, or one
/// that lies, is never held past it); a broken stream is 400
/// `MALFORMED_BODY`.
pub async fn read_limited<S, E>(
    headers: &HeaderMap,
    mut payload: S,
    limit: usize,
) -> Result<Bytes, ApiError>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let too_large = || ApiError::too_large(format!("the body is larger than {limit} bytes"));
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let mut buf = BytesMut::with_capacity(declared.unwrap_or(0) as usize);
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::new(Code::MalformedBody, e.to_string()))?;
        if buf.len() + chunk.len() > limit {
            return Err(too_large());
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// What a future on the request path may weigh (bytes, in a debug build).
/// Each layer's future is moved whole into actix's boxes on every request, so
/// a rarely-taken await that holds kilobytes (an etcd call, a hop to another
/// member, the proxy's exchange) is boxed where it is awaited instead.
#[cfg(test)]
pub(crate) const SMALL_FUTURE: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::http::header::HeaderValue;

    fn headers(pairs: &[(header::HeaderName, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(k.clone(), HeaderValue::from_static(v));
        }
        h
    }

    /// `chunks` as a body stream that ends normally.
    fn body(chunks: &[&'static [u8]]) -> impl Stream<Item = Result<Bytes, String>> + Unpin {
        futures_util::stream::iter(
            chunks
                .iter()
                .map(|c| Ok(Bytes::from_static(c)))
                .collect::<Vec<_>>(),
        )
    }

    /// Exactly `limit` bytes, in several chunks, are read whole.
    #[actix_rt::test]
    async fn reads_up_to_the_limit() {
        let got = read_limited(&HeaderMap::new(), body(&[b"abc", b"de"]), 5)
            .await
            .unwrap();
        assert_eq!(&got[..], b"abcde");
        let h = headers(&[(header::CONTENT_LENGTH, "5")]);
        let got = read_limited(&h, body(&[b"abcde"]), 5).await.unwrap();
        assert_eq!(&got[..], b"abcde");
    }

    /// One byte past the limit is 413, whether the chunks or the declared
    /// length say so; a declared length over the limit is refused before
    /// the stream is polled (here a stream that would fail if it were).
    #[actix_rt::test]
    async fn refuses_past_the_limit() {
        let e = read_limited(&HeaderMap::new(), body(&[b"abc", b"def"]), 5)
            .await
            .unwrap_err();
        assert_eq!((e.code, e.status.as_u16()), (Code::PayloadTooLarge, 413));
        let h = headers(&[(header::CONTENT_LENGTH, "6")]);
        let broken = futures_util::stream::iter(vec![Err::<Bytes, _>("never read".to_string())]);
        let e = read_limited(&h, broken, 5).await.unwrap_err();
        assert_eq!(e.code, Code::PayloadTooLarge);
    }

    /// A stream that breaks is 400 `MALFORMED_BODY`.
    #[actix_rt::test]
    async fn broken_stream_is_malformed() {
        let broken = futures_util::stream::iter(vec![
            Ok(Bytes::from_static(b"ab")),
            Err("reset".to_string()),
        ]);
        let e = read_limited(&HeaderMap::new(), broken, 5)
            .await
            .unwrap_err();
        assert_eq!((e.code, e.status.as_u16()), (Code::MalformedBody, 400));
    }

    /// Any `Upgrade` header is an upgrade; only `websocket` (any case) is a WebSocket one.
    #[test]
    fn upgrades() {
        assert!(!has_upgrade(&HeaderMap::new()));
        assert!(!is_websocket_upgrade(&HeaderMap::new()));
        let ws = headers(&[(header::UPGRADE, "WebSocket")]);
        assert!(has_upgrade(&ws) && is_websocket_upgrade(&ws));
        let h2c = headers(&[(header::UPGRADE, "h2c")]);
        assert!(has_upgrade(&h2c));
        assert!(!is_websocket_upgrade(&h2c));
    }
}
