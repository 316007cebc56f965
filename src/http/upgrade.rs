//! WebSocket upgrades off actix-http's HTTP/1 dispatcher.
//!
//! actix-http's dispatcher keeps a read and a write buffer of 8 KiB for as
//! long as it holds a connection (a constant there), so every idle socket
//! cost at least two resident pages for them (BENCHMARKS.md, "Pub/sub
//! against nats-server"). A request with `Upgrade: websocket` is handed to
//! this service instead, with the connection: the request still goes
//! through the node's whole app (the chain, the route, its handler) with the
//! connection's bytes after the head as its payload; the answer's head is
//! written with the dispatcher's own codec, and a `101` answer's body (the
//! socket's frames) is then written as it comes. Nothing is buffered while
//! the socket is idle: reads go through a buffer on the stack, and writes
//! copy only when several frames are ready at once. Any other answer is
//! written whole and the connection closed (docs/decisions.md "Sockets off
//! the HTTP/1 dispatcher").

use actix_codec::{AsyncRead, AsyncWrite, Encoder, Framed, ReadBuf};
use actix_http::body::{BodySize, BoxBody, MessageBody};
use actix_http::error::PayloadError;
use actix_http::h1;
use actix_http::{ConnectionType, Payload, Request, Response, StatusCode};
use actix_service::{IntoServiceFactory, Service, ServiceFactory, fn_factory, fn_service};
use actix_web::dev::{AppConfig, ServiceResponse};
use bytes::{Bytes, BytesMut};
use futures_util::Stream;
use std::convert::Infallible;
use std::future::poll_fn;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};

/// Bytes read from a socket at a time (a buffer on the stack, copied out).
const READ_CHUNK: usize = 8 * 1024;
/// Ready frames gathered into one write, at most.
const WRITE_BATCH: usize = 64 * 1024;

/// The upgrade service of one worker: its own instance of the node's app
/// (made by `app`, under `config`), called with each upgraded request.
pub(super) fn factory<T, F, A, AF, B>(
    app: F,
    config: AppConfig,
    stall: Duration,
) -> impl ServiceFactory<
    (Request, Framed<T, h1::Codec>),
    Config = (),
    Response = (),
    Error = Infallible,
    InitError = (),
>
where
    T: AsyncRead + AsyncWrite + Unpin + 'static,
    F: Fn() -> A + 'static,
    A: IntoServiceFactory<AF, Request>,
    AF: ServiceFactory<
            Request,
            Config = AppConfig,
            Response = ServiceResponse<B>,
            Error = actix_web::Error,
            InitError = (),
        > + 'static,
    B: MessageBody + 'static,
{
    fn_factory(move || {
        let made = app().into_factory().new_service(config.clone());
        async move {
            let app = Rc::new(made.await?);
            // Boxed: the connection's task is as large as its largest
            // state, and most connections never upgrade.
            Ok(fn_service(move |(req, framed)| {
                Box::pin(upgraded(Rc::clone(&app), req, framed, stall))
            }))
        }
    })
}

/// One upgraded connection, from its request to its close.
async fn upgraded<T, S, B>(
    app: Rc<S>,
    req: Request,
    framed: Framed<T, h1::Codec>,
    stall: Duration,
) -> Result<(), Infallible>
where
    T: AsyncRead + AsyncWrite + Unpin + 'static,
    S: Service<Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody + 'static,
{
    let parts = framed.into_parts();
    let codec = parts.codec;
    // What the client sent after the head (often its first frames); the
    // dispatcher's buffers are let go here, not when this future ends.
    let first = Bytes::copy_from_slice(&parts.read_buf);
    drop(parts.read_buf);
    drop(parts.write_buf);
    let (rd, wr) = tokio::io::split(parts.io);
    let payload: actix_http::BoxedPayloadStream = Box::pin(Reader {
        first,
        io: rd,
        done: false,
    });
    let (req, _none) = req.replace_payload(Payload::from(payload));
    let res: Response<BoxBody> = match app.call(req).await {
        Ok(r) => Response::from(r).map_into_boxed_body(),
        Err(e) => e.error_response().into(),
    };
    let switched = res.status() == StatusCode::SWITCHING_PROTOCOLS;
    let (mut head, body) = res.into_parts();
    let mut out = Out { wr, stall };
    let written = if switched {
        relay(codec, head, body, &mut out).await
    } else {
        head.head_mut().set_connection_type(ConnectionType::Close);
        answer(codec, head, body, &mut out).await
    };
    if let Err(e) = written {
        tracing::debug!(error = %e, "An upgraded connection ended with an error.");
    }
    // As the dispatcher's disconnect timeout: a second, then the connection
    // goes whatever the peer does.
    let _ = tokio::time::timeout(Duration::from_secs(1), out.wr.shutdown()).await;
    Ok(())
}

/// The connection's writing half, each write bounded: a peer that takes no
/// byte of one for `stall` (two ping intervals) is gone, and the connection
/// is dropped instead of holding this task (and its socket) for as long as
/// the peer keeps its receive window shut.
struct Out<T> {
    wr: WriteHalf<T>,
    stall: Duration,
}

impl<T: AsyncWrite> Out<T> {
    async fn send(&mut self, buf: &[u8]) -> std::io::Result<()> {
        let write = async {
            self.wr.write_all(buf).await?;
            self.wr.flush().await
        };
        match tokio::time::timeout(self.stall, write).await {
            Ok(r) => r,
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the peer took no bytes",
            )),
        }
    }
}

/// Writes a `101` head, then the body's chunks as they come (the socket's
/// frames, already encoded), gathering those ready at once into one write.
async fn relay<T: AsyncWrite>(
    mut codec: h1::Codec,
    head: Response<()>,
    body: BoxBody,
    out: &mut Out<T>,
) -> std::io::Result<()> {
    let buf = encode_head(&mut codec, head, BodySize::None)?;
    // Neither is needed again while the socket lives.
    drop(codec);
    out.send(&buf).await?;
    drop(buf);
    let mut body = std::pin::pin!(body);
    loop {
        let Some(chunk) = poll_fn(|cx| body.as_mut().poll_next(cx)).await else {
            return Ok(());
        };
        let chunk = chunk.map_err(body_error)?;
        let mut ended = false;
        // Whatever else is ready now goes in the same write.
        let mut more = BytesMut::new();
        while more.len() + chunk.len() < WRITE_BATCH {
            match poll_fn(|cx| Poll::Ready(body.as_mut().poll_next(cx))).await {
                Poll::Ready(Some(Ok(b))) => {
                    if more.is_empty() {
                        more.reserve(chunk.len() + b.len());
                        more.extend_from_slice(&chunk);
                    }
                    more.extend_from_slice(&b);
                }
                Poll::Ready(Some(Err(e))) => return Err(body_error(e)),
                Poll::Ready(None) => {
                    ended = true;
                    break;
                }
                Poll::Pending => break,
            }
        }
        if more.is_empty() {
            out.send(&chunk).await?;
        } else {
            out.send(&more).await?;
        }
        if ended {
            return Ok(());
        }
    }
}

/// An answer's head, encoded by the connection's codec for a body of `size`.
fn encode_head(
    codec: &mut h1::Codec,
    head: Response<()>,
    size: BodySize,
) -> std::io::Result<BytesMut> {
    let mut buf = BytesMut::new();
    codec.encode(h1::Message::Item((head, size)), &mut buf)?;
    Ok(buf)
}

/// A body that failed mid-answer, as the connection's write error.
fn body_error(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// Writes any other answer whole (head and body through the codec, which
/// frames the body by its size or in chunks); the connection then closes.
async fn answer<T: AsyncWrite>(
    mut codec: h1::Codec,
    head: Response<()>,
    body: BoxBody,
    out: &mut Out<T>,
) -> std::io::Result<()> {
    let size = body.size();
    let mut buf = encode_head(&mut codec, head, size)?;
    if !matches!(size, BodySize::None) {
        let mut body = std::pin::pin!(body);
        while let Some(chunk) = poll_fn(|cx| body.as_mut().poll_next(cx)).await {
            let chunk = chunk.map_err(body_error)?;
            codec.encode(h1::Message::Chunk(Some(chunk)), &mut buf)?;
            out.send(&buf).await?;
            buf.clear();
        }
        codec.encode(h1::Message::Chunk(None), &mut buf)?;
    }
    out.send(&buf).await
}

/// The request's payload: the bytes already read with the head, then the
/// connection's, read through a buffer on the stack so that an idle socket
/// holds none.
struct Reader<T> {
    first: Bytes,
    io: ReadHalf<T>,
    done: bool,
}

impl<T: AsyncRead> Stream for Reader<T> {
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if !this.first.is_empty() {
            return Poll::Ready(Some(Ok(std::mem::take(&mut this.first))));
        }
        if this.done {
            return Poll::Ready(None);
        }
        let mut buf = [MaybeUninit::<u8>::uninit(); READ_CHUNK];
        let mut rb = ReadBuf::uninit(&mut buf);
        match Pin::new(&mut this.io).poll_read(cx, &mut rb) {
            Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Ok(())) => Poll::Ready(Some(Ok(Bytes::copy_from_slice(rb.filled())))),
            Poll::Ready(Err(e)) => {
                this.done = true;
                Poll::Ready(Some(Err(PayloadError::Io(e))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
