//! The client of plain-HTTP upstream instances for requests with a body:
//! hyper's HTTP/1.1 client connection, pooled per worker thread and instance
//! ([`super::idle`]; docs/decisions.md, "The proxy's client for plain-HTTP
//! upstreams"). Requests without a body go through [`super::wire`];
//! `https://` instances and WebSocket upgrades through awc
//! ([`super::awc_client`], [`super::relay`]).
//!
//! A connection is taken from its thread's pool for one exchange and given
//! back when the upstream's answer has been read to its end; one whose answer
//! was not read to the end (the client went away) is closed. Every
//! new connection is made to an address the egress policy allows: a literal
//! instance is checked before each attempt, a named one resolves through
//! [`super::egress::EgressPolicy::resolve_checked`].

use super::egress::{EgressError, Refusal};
use super::idle::{self, IdlePool, Reusable};
use super::pool::{Instance, ProxyTimeouts, UpstreamPool};
use crate::error::ApiError;
use actix_web::body::{BodySize, MessageBody};
use actix_web::dev::Payload;
use actix_web::error::PayloadError;
use bytes::Bytes;
use futures_util::Stream;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::http;
use std::cell::RefCell;
use std::pin::Pin;
use std::task::{Context, Poll};

/// The largest answer head read from an upstream (hyper's buffer here, the
/// head's limit in [`super::wire`]).
pub const MAX_HEAD: usize = 64 * 1024 + 16 * 1024;

/// A connection's sending half (its reading half runs as a task of the thread).
type Sender = SendRequest<UpBody>;

thread_local! {
    /// This thread's idle hyper connections.
    static IDLE: RefCell<IdlePool<Sender>> = RefCell::new(IdlePool::default());
}

impl Reusable for Sender {
    fn closed(&mut self) -> bool {
        self.is_closed()
    }
    fn pool() -> &'static std::thread::LocalKey<RefCell<IdlePool<Self>>> {
        &IDLE
    }
}

/// The client's request body, sent as it arrives.
pub struct UpBody {
    payload: Option<Payload>,
    /// The client's `Content-Length`, when it sent one.
    exact: Option<u64>,
}

impl UpBody {
    /// The client's body; `exact` when its length is known.
    pub fn stream(payload: Payload, exact: Option<u64>) -> UpBody {
        UpBody {
            payload: Some(payload),
            exact,
        }
    }
}

impl Body for UpBody {
    type Data = Bytes;
    type Error = PayloadError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, PayloadError>>> {
        let Some(p) = self.payload.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(p).poll_next(cx) {
            Poll::Ready(None) => {
                self.payload = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(r)) => Poll::Ready(Some(r.map(Frame::data))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.payload.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.exact {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

/// Why no connection could be had.
pub enum ConnectFailure {
    /// The egress policy refused every address the name resolved to.
    Refused(Refusal),
    /// Resolution, the TCP connect or the handshake failed, or timed out.
    Failed(String),
}

/// A new TCP connection to instance `inst`, within the connect timeout, to
/// an address the egress policy allows (a named instance resolves through
/// the policy; a literal one was checked by the caller).
pub(crate) async fn connect_tcp(
    pool: &UpstreamPool,
    inst: &Instance,
    t: ProxyTimeouts,
) -> Result<tokio::net::TcpStream, ConnectFailure> {
    let attempt = async {
        let addrs = match inst.literal {
            Some(a) => vec![a],
            None => {
                let Some((host, port)) = &inst.host_port else {
                    return Err(ConnectFailure::Failed(format!(
                        "{} names no host and port",
                        inst.base
                    )));
                };
                pool.egress
                    .resolve_checked(host, *port)
                    .await
                    .map_err(|e| match e {
                        EgressError::Forbidden(r) => ConnectFailure::Refused(r),
                        EgressError::Unresolved(e) => ConnectFailure::Failed(e),
                    })?
            }
        };
        let mut last = String::from("no address");
        for a in addrs {
            match tokio::net::TcpStream::connect(a).await {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) => last = format!("{a}: {e}"),
            }
        }
        Err(ConnectFailure::Failed(last))
    };
    match tokio::time::timeout(t.connect, attempt).await {
        Ok(r) => r,
        Err(_) => Err(ConnectFailure::Failed(format!(
            "connecting to {} timed out after {:?}",
            inst.base, t.connect
        ))),
    }
}

/// A new hyper connection to instance `inst`. Its reading half is spawned
/// on the current (worker) thread.
async fn connect(
    pool: &UpstreamPool,
    inst: &Instance,
    t: ProxyTimeouts,
) -> Result<Sender, ConnectFailure> {
    let s = connect_tcp(pool, inst, t).await?;
    let (tx, conn) = http1::Builder::new()
        .max_buf_size(MAX_HEAD)
        .handshake(hyper_util::rt::TokioIo::new(s))
        .await
        .map_err(|e| ConnectFailure::Failed(e.to_string()))?;
    actix_web::rt::spawn(async move {
        let _ = conn.await;
    });
    Ok(tx)
}

/// How an exchange with one instance ended (of any of the proxy's clients):
/// what the driver's one retry loop ([`super::proxy`]) decides on.
pub enum Exchange<T> {
    /// The upstream's answer head; its body follows.
    Answered(T),
    /// No connection: the next instance may be tried (nothing was sent).
    NotConnected(ConnectFailure),
    /// No answer head within the response timeout.
    TimedOut,
    /// Reached and failed after the request was (maybe partly) sent.
    Failed(String),
    /// The request ends with this error as it is, not retried, the
    /// instance's health untouched (awc: a URI it cannot make, a refused
    /// WebSocket upgrade).
    Ended(ApiError),
}

/// Sends the request in `pending` to instance `inst` of `pool` on a pooled
/// connection, or a new one; when no connection could be made the request
/// is put back in `pending` (nothing was sent) for the next instance. A
/// pooled connection found closed before the request was written is
/// replaced by a new one (the request was not sent, so it is not a retry).
pub async fn exchange(
    pool: &UpstreamPool,
    inst: &Instance,
    pending: &mut Option<http::Request<UpBody>>,
    t: ProxyTimeouts,
) -> Exchange<http::Response<UpstreamBody>> {
    let Some(mut req) = pending.take() else {
        return Exchange::Failed("the request was already sent".into());
    };
    if let Some(h) = &inst.plain_host {
        req.headers_mut().insert(http::header::HOST, h.clone());
    }
    let policy = std::sync::Arc::as_ptr(&pool.egress) as usize;
    let deadline = tokio::time::Instant::now() + t.response;
    // At most one pooled connection found dead, then a new one.
    let mut pooled = idle::take(&inst.base, policy);
    loop {
        let fresh = pooled.is_none();
        let mut tx = match pooled.take() {
            Some(tx) => tx,
            None => match connect(pool, inst, t).await {
                Ok(tx) => tx,
                Err(f) => {
                    *pending = Some(req);
                    return Exchange::NotConnected(f);
                }
            },
        };
        let sent = tokio::time::timeout_at(deadline, tx.try_send_request(req)).await;
        match sent {
            Err(_) => return Exchange::TimedOut,
            Ok(Ok(res)) => {
                let (parts, body) = res.into_parts();
                let mut body = UpstreamBody {
                    body,
                    back: Some((inst.base.clone(), policy, tx)),
                };
                if body.body.is_end_stream() {
                    body.release();
                }
                return Exchange::Answered(http::Response::from_parts(parts, body));
            }
            Ok(Err(mut e)) => match e.take_message() {
                // Not written: the connection was closed while idle.
                Some(r) if !fresh => req = r,
                Some(r) => {
                    *pending = Some(r);
                    return Exchange::NotConnected(ConnectFailure::Failed(
                        e.into_error().to_string(),
                    ));
                }
                None => return Exchange::Failed(e.into_error().to_string()),
            },
        }
    }
}

/// The upstream's answer body, streamed to the client. Its connection goes
/// back to the pool once the body has been read to its end.
pub struct UpstreamBody {
    body: Incoming,
    back: Option<(String, usize, Sender)>,
}

impl UpstreamBody {
    fn release(&mut self) {
        if let Some((base, policy, tx)) = self.back.take() {
            idle::put(&base, policy, tx);
        }
    }
}

impl MessageBody for UpstreamBody {
    type Error = hyper::Error;

    fn size(&self) -> BodySize {
        match self.body.size_hint().exact() {
            Some(n) => BodySize::Sized(n),
            None => BodySize::Stream,
        }
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, hyper::Error>>> {
        let this = self.get_mut();
        loop {
            match Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    this.release();
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => {
                    this.back = None;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Some(Ok(f))) => {
                    // Trailers are not passed on (HTTP/1.1 clients rarely take them).
                    let Ok(data) = f.into_data() else { continue };
                    if this.body.is_end_stream() {
                        this.release();
                    }
                    if data.is_empty() {
                        continue;
                    }
                    return Poll::Ready(Some(Ok(data)));
                }
            }
        }
    }
}

/// The client's answer from the upstream's, its body streamed as it arrives.
pub(crate) fn into_response(
    req: &actix_web::HttpRequest,
    res: http::Response<UpstreamBody>,
) -> actix_web::HttpResponse {
    use actix_web::http::StatusCode;
    use actix_web::http::header::{HeaderName, HeaderValue};
    use std::ops::ControlFlow;
    let (parts, body) = res.into_parts();
    let status = StatusCode::from_u16(parts.status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let listed: Vec<String> = parts
        .headers
        .get_all(hyper::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect();
    let mut out = actix_web::HttpResponse::new(status);
    let mut len = None;
    {
        let h = out.headers_mut();
        for (k, v) in &parts.headers {
            if *k == hyper::header::CONTENT_LENGTH {
                len = v.to_str().ok().and_then(|s| s.parse::<u64>().ok());
                continue;
            }
            let Ok(name) = HeaderName::from_bytes(k.as_str().as_bytes()) else {
                continue;
            };
            if super::headers::is_hop_by_hop(&name, &listed) {
                continue;
            }
            if let Ok(v) = HeaderValue::from_bytes(v.as_bytes()) {
                h.append(name, v);
            }
        }
    }
    match super::headers::finish_head(req, out, len) {
        ControlFlow::Break(done) => done,
        ControlFlow::Continue(out) => out.set_body(actix_web::body::BoxBody::new(body)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deploy::pool::tests::{echo_upstream, pool};
    use actix_web::test::TestRequest;
    use std::time::Duration;

    fn request(body: &'static str) -> http::Request<UpBody> {
        let (_, payload) = TestRequest::default().set_payload(body).to_http_parts();
        let mut r = http::Request::new(UpBody::stream(payload, Some(body.len() as u64)));
        *r.method_mut() = http::Method::POST;
        *r.uri_mut() = "/up".parse().unwrap();
        r
    }

    /// A port nobody listens on gives the request back (nothing was sent);
    /// a live instance answers it, its body streams to the client, and the
    /// connection, back in the pool once the body was read, carries the next.
    #[actix_rt::test]
    async fn requests_go_back_when_not_connected_and_connections_are_reused() {
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let (port, accepted, task) = echo_upstream().await;
        let p = pool(
            &[
                &format!("http://127.0.0.1:{closed}"),
                &format!("http://127.0.0.1:{port}"),
            ],
            1,
            Duration::from_secs(60),
        );
        let t = ProxyTimeouts {
            connect: Duration::from_secs(10),
            response: Duration::from_secs(30),
        };
        let mut pending = Some(request("abc"));
        assert!(matches!(
            exchange(&p, &p.instances[0], &mut pending, t).await,
            Exchange::NotConnected(ConnectFailure::Failed(_))
        ));
        assert!(pending.is_some());
        let client = TestRequest::post().to_http_request();
        for body in ["abc", "de"] {
            let mut pending = Some(request(body));
            let Exchange::Answered(res) = exchange(&p, &p.instances[1], &mut pending, t).await
            else {
                panic!("no answer")
            };
            assert!(pending.is_none());
            let out = into_response(&client, res);
            assert!(out.headers().get("x-hop").is_none());
            assert!(out.headers().get("connection").is_none());
            let got = actix_web::body::to_bytes(out.into_body())
                .await
                .ok()
                .unwrap();
            assert_eq!(got, format!("POST /up HTTP/1.1 {body}").as_bytes());
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::Relaxed), 1);
        task.abort();
    }
}
