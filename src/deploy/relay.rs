//! WebSocket upgrades to an upstream: the handshake with one instance
//! through awc ([`handshake`], one attempt of the driver's loop in
//! [`super::proxy`]), the client's side accepted with the protocol the
//! upstream chose ([`accept`]), then frames relayed both ways until either
//! side closes ([`relay`]). Server-sent events need nothing of their own:
//! they are a streamed answer body, passed on as it arrives by each client.

use super::egress::refusal_of;
use super::h1::{ConnectFailure, Exchange};
use super::pool::Instance;
use crate::error::{ApiError, Code};
use actix_web::http::header::{self, HeaderMap, HeaderValue};
use actix_web::{HttpRequest, HttpResponse};
use actix_ws::Item;
use awc::ws::{CloseReason, Frame, Message};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};

/// The largest WebSocket frame relayed either way.
const MAX_FRAME: usize = 16 << 20;

/// The upstream's side of an accepted upgrade.
pub(crate) type Upstream = actix_codec::Framed<awc::BoxedSocket, awc::ws::Codec>;

/// The WebSocket URL of `path_and_query` on an instance whose base is `base`.
fn ws_url(base: &str, path_and_query: &str) -> String {
    let ws_base = base
        .replacen("http://", "ws://", 1)
        .replacen("https://", "wss://", 1);
    format!("{ws_base}{path_and_query}")
}

/// Whether the client's header `name` is passed on in the upstream
/// handshake (awc makes its own `Sec-WebSocket-*` but the protocol list).
fn handshake_header(name: &str) -> bool {
    !name.starts_with("sec-websocket-") || name == "sec-websocket-protocol"
}

/// The WebSocket handshake with instance `inst`, sending `headers` (the
/// client's, as [`super::headers::upstream_headers`] made them): the
/// protocol the upstream chose and its side of the connection.
pub(crate) async fn handshake(
    client: &awc::Client,
    inst: &Instance,
    headers: &HeaderMap,
    path_and_query: &str,
) -> Exchange<(Option<HeaderValue>, Upstream)> {
    let url = ws_url(&inst.base, path_and_query);
    let mut wreq = client.ws(url.as_str()).max_frame_size(MAX_FRAME);
    for (k, v) in headers {
        if handshake_header(k.as_str()) {
            wreq = wreq.header(k.clone(), v.clone());
        }
    }
    match wreq.connect().await {
        Ok((res, framed)) => {
            let protocol = res.headers().get(header::SEC_WEBSOCKET_PROTOCOL).cloned();
            Exchange::Answered((protocol, framed))
        }
        Err(awc::error::WsClientError::SendRequest(awc::error::SendRequestError::Connect(e))) => {
            match refusal_of(&e) {
                Some(r) => Exchange::NotConnected(ConnectFailure::Refused(r.clone())),
                None => Exchange::NotConnected(ConnectFailure::Failed(e.to_string())),
            }
        }
        Err(e) => Exchange::Ended(ApiError::new(
            Code::UpstreamFailed,
            format!("the upstream refused the WebSocket upgrade: {e}"),
        )),
    }
}

/// Why the credential a tunnel was opened with no longer holds (its token
/// expired, its session was ended), or None while it holds.
pub type Ends = Box<dyn Fn() -> Option<&'static str>>;

/// How often a tunnel opened with a token checks [`Ends`].
pub const CREDENTIAL_CHECK: std::time::Duration = std::time::Duration::from_secs(5);

/// The close code a tunnel ends with when its credential ends (as `/v1/ws`).
pub const CREDENTIAL_ENDED: u16 = 4001;

/// Accepts the client's upgrade once the upstream accepted its own, with
/// the upstream's protocol, and starts relaying on this (worker) thread;
/// `ends` (a tunnel opened with a token) ends it when the token does.
pub(crate) fn accept(
    req: &HttpRequest,
    payload: actix_web::web::Payload,
    protocol: Option<HeaderValue>,
    upstream: Upstream,
    ends: Option<Ends>,
) -> Result<HttpResponse, ApiError> {
    let (mut resp, session, stream) = actix_ws::handle(req, payload)
        .map_err(|e| ApiError::new(Code::BadUpgrade, e.to_string()))?;
    if let Some(p) = protocol {
        resp.headers_mut().insert(header::SEC_WEBSOCKET_PROTOCOL, p);
    }
    actix_web::rt::spawn(relay(
        session,
        stream.max_frame_size(MAX_FRAME),
        upstream,
        ends,
    ));
    Ok(resp)
}

/// What to do with what the client sent.
#[derive(Debug, PartialEq)]
enum ToUpstream {
    /// Send it on.
    Send(Message),
    /// Send it on (a close), then stop.
    Last(Message),
    /// Nothing to send.
    Skip,
}

fn from_client(m: Option<Result<actix_ws::Message, actix_ws::ProtocolError>>) -> ToUpstream {
    match m {
        Some(Ok(actix_ws::Message::Text(t))) => ToUpstream::Send(Message::Text(t)),
        Some(Ok(actix_ws::Message::Binary(b))) => ToUpstream::Send(Message::Binary(b)),
        Some(Ok(actix_ws::Message::Continuation(c))) => ToUpstream::Send(Message::Continuation(c)),
        Some(Ok(actix_ws::Message::Ping(p))) => ToUpstream::Send(Message::Ping(p)),
        Some(Ok(actix_ws::Message::Pong(p))) => ToUpstream::Send(Message::Pong(p)),
        Some(Ok(actix_ws::Message::Close(r))) => ToUpstream::Last(Message::Close(r)),
        Some(Ok(actix_ws::Message::Nop)) => ToUpstream::Skip,
        Some(Err(_)) | None => ToUpstream::Last(Message::Close(None)),
    }
}

/// What to send the client for what the upstream sent.
#[derive(Debug, PartialEq)]
enum ToClient {
    Text(String),
    Binary(Bytes),
    Continuation(Item),
    Ping(Bytes),
    Pong(Bytes),
    /// Close the client's side, then stop.
    Close(Option<CloseReason>),
}

fn from_upstream(f: Option<Result<Frame, awc::error::WsProtocolError>>) -> ToClient {
    match f {
        // A text frame that is not UTF-8 is passed on as binary.
        Some(Ok(Frame::Text(t))) => match std::str::from_utf8(&t) {
            Ok(s) => ToClient::Text(s.to_string()),
            Err(_) => ToClient::Binary(t),
        },
        Some(Ok(Frame::Binary(b))) => ToClient::Binary(b),
        Some(Ok(Frame::Continuation(c))) => ToClient::Continuation(c),
        Some(Ok(Frame::Ping(p))) => ToClient::Ping(p),
        Some(Ok(Frame::Pong(p))) => ToClient::Pong(p),
        Some(Ok(Frame::Close(r))) => ToClient::Close(r),
        Some(Err(_)) | None => ToClient::Close(None),
    }
}

/// Ends a tunnel whose credential ended: the upstream's side closed, the
/// client's with 4001 and why.
async fn end_tunnel(
    session: actix_ws::Session,
    up_tx: &mut futures_util::stream::SplitSink<Upstream, Message>,
    why: &'static str,
) {
    let _ = up_tx.send(Message::Close(None)).await;
    let _ = session
        .close(Some(CloseReason {
            code: awc::ws::CloseCode::Other(CREDENTIAL_ENDED),
            description: Some(why.to_string()),
        }))
        .await;
}

/// Relays frames both ways until either side closes or fails.
async fn relay(
    mut session: actix_ws::Session,
    mut client_rx: actix_ws::MessageStream,
    framed: Upstream,
    ends: Option<Ends>,
) {
    let (mut up_tx, mut up_rx) = framed.split();
    let mut check = tokio::time::interval(CREDENTIAL_CHECK);
    loop {
        tokio::select! {
            _ = check.tick(), if ends.is_some() => {
                if let Some(why) = ends.as_ref().and_then(|e| e()) {
                    return end_tunnel(session, &mut up_tx, why).await;
                }
            }
            m = client_rx.next() => {
                // What the client sends after its credential ended is not passed on.
                if let Some(why) = ends.as_ref().and_then(|e| e()) {
                    return end_tunnel(session, &mut up_tx, why).await;
                }
                match from_client(m) {
                    ToUpstream::Skip => continue,
                    ToUpstream::Last(out) => {
                        let _ = up_tx.send(out).await;
                        break;
                    }
                    ToUpstream::Send(out) => {
                        if up_tx.send(out).await.is_err() {
                            let _ = session.close(None).await;
                            return;
                        }
                    }
                }
            }
            f = up_rx.next() => {
                let sent = match from_upstream(f) {
                    ToClient::Text(s) => session.text(s).await,
                    ToClient::Binary(b) => session.binary(b).await,
                    ToClient::Continuation(c) => session.continuation(c).await,
                    ToClient::Ping(p) => session.ping(&p).await,
                    ToClient::Pong(p) => session.pong(&p).await,
                    ToClient::Close(r) => {
                        let _ = session.close(r).await;
                        return;
                    }
                };
                if sent.is_err() {
                    let _ = up_tx.send(Message::Close(None)).await;
                    return;
                }
            }
        }
    }
    let _ = session.close(None).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use awc::ws::CloseCode;

    #[test]
    fn urls_and_handshake_headers() {
        assert_eq!(
            ws_url("http://127.0.0.1:1", "/s?a=1"),
            "ws://127.0.0.1:1/s?a=1"
        );
        assert_eq!(ws_url("https://a.test", "/"), "wss://a.test/");
        assert!(handshake_header("sec-websocket-protocol"));
        assert!(handshake_header("x-forwarded-for"));
        assert!(!handshake_header("sec-websocket-key"));
        assert!(!handshake_header("sec-websocket-extensions"));
    }

    /// Data and control frames pass as they are; a close, an error or the
    /// end of the client's stream closes the upstream and ends the relay.
    #[test]
    fn client_messages_map_to_upstream_frames() {
        let b = Bytes::from_static(b"x");
        assert_eq!(
            from_client(Some(Ok(actix_ws::Message::Binary(b.clone())))),
            ToUpstream::Send(Message::Binary(b.clone()))
        );
        assert_eq!(
            from_client(Some(Ok(actix_ws::Message::Ping(b.clone())))),
            ToUpstream::Send(Message::Ping(b.clone()))
        );
        assert_eq!(
            from_client(Some(Ok(actix_ws::Message::Nop))),
            ToUpstream::Skip
        );
        let r = Some(CloseReason::from(CloseCode::Away));
        assert_eq!(
            from_client(Some(Ok(actix_ws::Message::Close(r.clone())))),
            ToUpstream::Last(Message::Close(r))
        );
        assert_eq!(from_client(None), ToUpstream::Last(Message::Close(None)));
        assert_eq!(
            from_client(Some(Err(actix_ws::ProtocolError::BadOpCode))),
            ToUpstream::Last(Message::Close(None))
        );
    }

    /// Text that is not UTF-8 is passed as binary; a close keeps its reason.
    #[test]
    fn upstream_frames_map_to_client_messages() {
        assert_eq!(
            from_upstream(Some(Ok(Frame::Text(Bytes::from_static(b"hi"))))),
            ToClient::Text("hi".into())
        );
        assert_eq!(
            from_upstream(Some(Ok(Frame::Text(Bytes::from_static(b"\xff"))))),
            ToClient::Binary(Bytes::from_static(b"\xff"))
        );
        assert_eq!(
            from_upstream(Some(Ok(Frame::Pong(Bytes::new())))),
            ToClient::Pong(Bytes::new())
        );
        let r = Some(CloseReason::from(CloseCode::Normal));
        assert_eq!(
            from_upstream(Some(Ok(Frame::Close(r.clone())))),
            ToClient::Close(r)
        );
        assert_eq!(from_upstream(None), ToClient::Close(None));
    }
}
