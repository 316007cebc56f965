//! The proxy's client of plain-HTTP upstream instances for requests without a
//! body (docs/decisions.md, "The proxy's client for plain-HTTP upstreams"):
//! the exchange is driven in the request's own task on a pooled TCP
//! connection ([`super::idle`]), with no connection task and no channel
//! between them. The request head is written straight from actix's header
//! map and the answer's head parsed (httparse) straight into one, its header
//! values sharing the read buffer. A small answer that arrived whole with its
//! head is passed on as one buffer, its connection back in the pool before
//! the client is answered; a longer one is streamed (sized, chunked, or up to
//! the upstream's close).
//!
//! Requests with a body go through [`super::h1`] (hyper), which reads the
//! answer while it still sends the body.
//!
//! A pooled connection is checked before it is used, from the readiness the
//! runtime already holds (a system call only when the socket was reported
//! readable: a close or stray bytes, and then it is dropped). Should the
//! upstream close it anyway as the request goes out, the request is sent
//! again on a new connection when that cannot act twice: nothing was written,
//! or nothing was answered and the method is idempotent (RFC 9110 §9.2.2).

use super::h1::{Exchange, MAX_HEAD, connect_tcp};
use super::headers::Forwarded;
use super::idle::{self, IdlePool, Reusable};
use super::pool::{Instance, ProxyTimeouts, UpstreamPool};
use actix_web::HttpRequest;
use actix_web::body::{BodySize, MessageBody};
use actix_web::http::header::{HeaderMap, HeaderName, HeaderValue};
use actix_web::http::{Method, StatusCode};
use bytes::{Buf, Bytes, BytesMut};
use std::cell::RefCell;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// The most header lines an answer head may have.
const MAX_HEADERS: usize = 128;
/// Room made in the read buffer before each read.
const READ_CHUNK: usize = 16 * 1024;
/// The longest chunk-size line, and all trailer lines together, of a chunked answer.
const MAX_CHUNK_LINE: usize = 4 * 1024;
const MAX_TRAILERS: usize = 64 * 1024;

/// One upstream connection and what was read of it and not yet used.
pub struct Conn {
    io: TcpStream,
    buf: BytesMut,
}

thread_local! {
    /// This thread's idle connections of this client.
    static IDLE: RefCell<IdlePool<Conn>> = RefCell::new(IdlePool::default());
}

impl Reusable for Conn {
    fn pool() -> &'static std::thread::LocalKey<RefCell<IdlePool<Self>>> {
        &IDLE
    }

    /// From the runtime's cached readiness: a socket not reported readable
    /// is open (no system call); one reported readable is read once without
    /// waiting: an end of stream, stray bytes or an error close it.
    fn closed(&mut self) -> bool {
        if !self.buf.is_empty() {
            return true;
        }
        let mut cx = Context::from_waker(Waker::noop());
        match self.io.poll_read_ready(&mut cx) {
            Poll::Pending => false,
            Poll::Ready(Err(_)) => true,
            Poll::Ready(Ok(())) => {
                let mut b = [0u8; 1];
                !matches!(self.io.try_read(&mut b), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
            }
        }
    }
}

/// Whether `b` may stand in a request target (visible ASCII only).
fn target_ok(b: &[u8]) -> bool {
    !b.is_empty() && b.iter().all(|&c| c > b' ' && c < 0x7f)
}

/// The request head sent to an instance whose `Host` is `host`: the
/// request line, `Host`, then the headers of
/// [`super::headers::upstream_header_lines`].
pub fn request_head(
    req: &HttpRequest,
    path_and_query: &str,
    host: &[u8],
    fwd: &Forwarded,
) -> Result<Vec<u8>, String> {
    if !target_ok(path_and_query.as_bytes()) {
        return Err(format!("{path_and_query:?} is not a request target"));
    }
    let mut out = Vec::with_capacity(256 + 64 * req.headers().len());
    out.extend_from_slice(req.method().as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path_and_query.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(host);
    out.extend_from_slice(b"\r\n");
    super::headers::upstream_header_lines(req, fwd, |k, v| {
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(v);
        out.extend_from_slice(b"\r\n");
    });
    out.extend_from_slice(b"\r\n");
    Ok(out)
}

/// An upstream's answer head, ready for the client.
pub struct Answer {
    pub status: StatusCode,
    /// Its headers without the hop-by-hop ones and `Content-Length`.
    pub headers: HeaderMap,
    /// Its `Content-Length`, when it framed its body by one.
    pub len: Option<u64>,
    pub body: AnswerBody,
}

/// The body of an [`Answer`].
pub enum AnswerBody {
    /// None (a HEAD request, 204, 304).
    Empty,
    /// All of it, read with the head (its connection is already back in the pool).
    Whole(Bytes),
    /// The rest streams from the connection.
    Stream(WireBody),
}

/// Why a round trip on one connection failed.
enum Trip {
    /// The request could not be written: the upstream never saw it.
    NotWritten,
    /// Written, and the connection ended before any byte of an answer.
    Unanswered(String),
    /// Anything else: never sent again.
    Bad(String),
}

/// Sends the request `head` (of a request without a body, `method`) to
/// instance `inst` on a pooled connection or a new one.
pub async fn exchange(
    pool: &UpstreamPool,
    inst: &Instance,
    head: &[u8],
    method: &Method,
    t: ProxyTimeouts,
) -> Exchange<Answer> {
    let policy = std::sync::Arc::as_ptr(&pool.egress) as usize;
    let deadline = tokio::time::Instant::now() + t.response;
    let idempotent = matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    );
    let head_only = *method == Method::HEAD;
    let mut pooled = idle::take(&inst.base, policy);
    loop {
        let reused = pooled.is_some();
        let mut conn = match pooled.take() {
            Some(c) => c,
            None => match connect_tcp(pool, inst, t).await {
                Ok(io) => Conn {
                    io,
                    buf: BytesMut::new(),
                },
                Err(f) => return Exchange::NotConnected(f),
            },
        };
        let trip = tokio::time::timeout_at(deadline, round_trip(&mut conn, head, head_only)).await;
        let failure = match trip {
            Err(_) => return Exchange::TimedOut,
            Ok(Ok(parsed)) => {
                return Exchange::Answered(parsed.into_answer(conn, &inst.base, policy));
            }
            Ok(Err(f)) => f,
        };
        match failure {
            // A pooled connection the upstream had closed: once more on a new one.
            Trip::NotWritten if reused => continue,
            Trip::Unanswered(_) if reused && idempotent => continue,
            Trip::NotWritten => {
                return Exchange::Failed("the upstream closed the connection".into());
            }
            Trip::Unanswered(e) | Trip::Bad(e) => return Exchange::Failed(e),
        }
    }
}

/// A parsed answer head and how its body is framed.
struct Parsed {
    status: StatusCode,
    headers: HeaderMap,
    len: Option<u64>,
    framing: Framing,
    /// Whether the connection may carry another request after this answer.
    reusable: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Framing {
    None,
    Sized(u64),
    Chunked,
    /// Up to the upstream's close.
    Close,
}

impl Parsed {
    fn into_answer(self, mut conn: Conn, base: &str, policy: usize) -> Answer {
        let body = match self.framing {
            Framing::None => {
                if self.reusable {
                    idle::put(base, policy, conn);
                }
                AnswerBody::Empty
            }
            Framing::Sized(n) if conn.buf.len() as u64 >= n => {
                let b = conn.buf.split_to(n as usize).freeze();
                if self.reusable {
                    // Stray bytes after the body close it (`closed`).
                    idle::put(base, policy, conn);
                }
                AnswerBody::Whole(b)
            }
            framing => AnswerBody::Stream(WireBody {
                conn: Some(conn),
                state: match framing {
                    Framing::Sized(n) => State::Sized(n),
                    Framing::Chunked => State::Chunked(Chunked::default()),
                    _ => State::Close,
                },
                total: match framing {
                    Framing::Sized(n) => Some(n),
                    _ => None,
                },
                back: self.reusable.then(|| (base.to_string(), policy)),
            }),
        };
        Answer {
            status: self.status,
            headers: self.headers,
            len: self.len,
            body,
        }
    }
}

/// Writes the request and reads the answer's head (interim 1xx answers skipped).
async fn round_trip(conn: &mut Conn, head: &[u8], head_only: bool) -> Result<Parsed, Trip> {
    if conn.io.write_all(head).await.is_err() {
        return Err(Trip::NotWritten);
    }
    let mut answered = false;
    loop {
        if !conn.buf.is_empty() {
            answered = true;
            match parse_head(&mut conn.buf, head_only).map_err(Trip::Bad)? {
                Some(Some(p)) => return Ok(p),
                // An interim answer, dropped: read on.
                Some(None) => continue,
                None if conn.buf.len() >= MAX_HEAD => {
                    return Err(Trip::Bad(format!(
                        "the upstream's answer head is longer than {MAX_HEAD} bytes"
                    )));
                }
                None => {}
            }
        }
        conn.buf.reserve(READ_CHUNK);
        let read = std::future::poll_fn(|cx| {
            tokio_util::io::poll_read_buf(Pin::new(&mut conn.io), cx, &mut conn.buf)
        })
        .await;
        match read {
            Ok(0) | Err(_) if !answered => {
                return Err(Trip::Unanswered(
                    "the upstream closed the connection without answering".into(),
                ));
            }
            Ok(0) => {
                return Err(Trip::Bad(
                    "the upstream closed the connection in its answer's head".into(),
                ));
            }
            Err(e) => return Err(Trip::Bad(format!("reading the upstream's answer: {e}"))),
            Ok(_) => {}
        }
    }
}

/// Parses an answer head at the start of `buf`. None: not whole yet;
/// Some(None): an interim (1xx) answer, taken off `buf`; Some(Some): the
/// answer, its head taken off `buf` (what follows is its body).
fn parse_head(buf: &mut BytesMut, head_only: bool) -> Result<Option<Option<Parsed>>, String> {
    // Uninitialized slots: no 4 KiB cleared per answer.
    let mut slots =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut res = httparse::Response::new(&mut []);
    let head_len = match httparse::ParserConfig::default()
        .parse_response_with_uninit_headers(&mut res, buf, &mut slots)
    {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(format!(
                "the upstream's answer has more than {MAX_HEADERS} headers"
            ));
        }
        Err(e) => return Err(format!("the upstream's answer is not HTTP/1.1: {e}")),
    };
    let code = res.code.unwrap_or(0);
    if code == 101 {
        return Err("the upstream switched protocols on a plain request".into());
    }
    if (100..200).contains(&code) {
        buf.advance(head_len);
        return Ok(Some(None));
    }
    let status = StatusCode::from_u16(code).map_err(|e| format!("bad status {code}: {e}"))?;
    // Where each header's name and value lie in the head, to slice them out
    // of it once it is frozen (no copy of a value).
    let base = buf.as_ptr() as usize;
    let mut spans = Vec::with_capacity(res.headers.len());
    let mut len_header: Option<u64> = None;
    let mut te: Option<bool> = None;
    let mut close = res.version != Some(1);
    let mut listed: Vec<String> = Vec::new();
    for h in res.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            let n = std::str::from_utf8(h.value)
                .ok()
                .map(str::trim)
                .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or("the upstream's Content-Length is not a number")?;
            if len_header.is_some_and(|m| m != n) {
                return Err("the upstream sent two different Content-Lengths".into());
            }
            len_header = Some(n);
            continue;
        }
        if name.eq_ignore_ascii_case("transfer-encoding") {
            let last = h.value.rsplit(|&b| b == b',').next().unwrap_or_default();
            te = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name.eq_ignore_ascii_case("connection") {
            for token in h.value.split(|&b| b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    close = true;
                }
                if !token.is_empty() {
                    listed.push(String::from_utf8_lossy(token).to_ascii_lowercase());
                }
            }
        }
        let n = name.as_ptr() as usize - base;
        let v = h.value.as_ptr() as usize - base;
        spans.push((n, n + name.len(), v, v + h.value.len()));
    }
    let no_body = head_only || code == 204 || code == 304;
    let (framing, reusable, len) = match (no_body, te, len_header) {
        (true, _, len) => (Framing::None, !close, len),
        (false, Some(true), None) => (Framing::Chunked, !close, None),
        // Both framings (a smuggling shape): the chunks, then the connection closes.
        (false, Some(true), Some(_)) => (Framing::Chunked, false, None),
        (false, Some(false), _) => (Framing::Close, false, None),
        (false, None, Some(n)) => (Framing::Sized(n), !close, Some(n)),
        (false, None, None) => (Framing::Close, false, None),
    };
    let head = buf.split_to(head_len).freeze();
    let mut headers = HeaderMap::with_capacity(spans.len());
    for (n0, n1, v0, v1) in spans {
        let Ok(name) = HeaderName::from_bytes(&head[n0..n1]) else {
            continue;
        };
        if super::headers::is_hop_by_hop(&name, &listed) {
            continue;
        }
        if let Ok(value) = HeaderValue::from_maybe_shared(head.slice(v0..v1)) {
            headers.append(name, value);
        }
    }
    Ok(Some(Some(Parsed {
        status,
        headers,
        len,
        framing,
        reusable,
    })))
}

/// The rest of an answer's body, read from its connection as the client
/// takes it; the connection goes back to the pool once the body has been
/// read to its end (never when the client went away first).
pub struct WireBody {
    conn: Option<Conn>,
    state: State,
    /// The whole body's length, when sized.
    total: Option<u64>,
    /// The pool to give the connection back to, when it may be reused.
    back: Option<(String, usize)>,
}

enum State {
    /// Bytes still to come.
    Sized(u64),
    Chunked(Chunked),
    Close,
}

impl WireBody {
    /// The body has ended: the connection goes back to the pool, unless it
    /// may not be reused or stray bytes followed the body.
    fn finish(&mut self) {
        if let (Some(c), Some((base, policy))) = (self.conn.take(), self.back.take())
            && c.buf.is_empty()
        {
            idle::put(&base, policy, c);
        }
    }
}

impl MessageBody for WireBody {
    type Error = io::Error;

    fn size(&self) -> BodySize {
        match self.total {
            Some(n) => BodySize::Sized(n),
            None => BodySize::Stream,
        }
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, io::Error>>> {
        let this = self.get_mut();
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            match &mut this.state {
                State::Sized(0) => {
                    this.finish();
                    return Poll::Ready(None);
                }
                State::Sized(left) if !conn.buf.is_empty() => {
                    let k = (*left).min(conn.buf.len() as u64);
                    *left -= k;
                    let chunk = conn.buf.split_to(k as usize).freeze();
                    if *left == 0 {
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(chunk)));
                }
                State::Close if !conn.buf.is_empty() => {
                    return Poll::Ready(Some(Ok(conn.buf.split().freeze())));
                }
                State::Chunked(dec) => match dec.decode(&mut conn.buf) {
                    Err(e) => {
                        this.conn = None;
                        return Poll::Ready(Some(Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            e,
                        ))));
                    }
                    Ok(Decoded::Data(b)) => return Poll::Ready(Some(Ok(b))),
                    Ok(Decoded::Done) => {
                        this.finish();
                        return Poll::Ready(None);
                    }
                    Ok(Decoded::More) => {}
                },
                State::Sized(_) | State::Close => {}
            }
            // Nothing buffered to pass on: read.
            conn.buf.reserve(READ_CHUNK);
            let read = ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut conn.io),
                cx,
                &mut conn.buf
            ));
            match read {
                Ok(0) if matches!(this.state, State::Close) => {
                    this.conn = None;
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the upstream closed the connection before the body's end",
                    ))));
                }
                Ok(_) => {}
                Err(e) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }
}

/// What [`Chunked::decode`] found in the buffer.
#[derive(Debug, PartialEq)]
enum Decoded {
    Data(Bytes),
    /// The last chunk and the trailers (dropped) have been read.
    Done,
    /// More bytes are needed.
    More,
}

/// A decoder of the chunked transfer coding (RFC 9112 §7.1); chunk
/// extensions and trailers are read and dropped. A line may end in CRLF or LF.
#[derive(Default)]
struct Chunked {
    state: ChunkState,
    /// Trailer bytes read so far.
    trailers: usize,
}

#[derive(Default)]
enum ChunkState {
    #[default]
    Size,
    Data(u64),
    /// The line end after a chunk's data.
    DataEnd,
    Trailers,
    Done,
}

/// The length of the line at the start of `buf` without its end, and with it;
/// None when no line end has arrived yet.
fn line(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.iter().position(|&b| b == b'\n')?;
    let end = if lf > 0 && buf[lf - 1] == b'\r' {
        lf - 1
    } else {
        lf
    };
    Some((end, lf + 1))
}

impl Chunked {
    fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, String> {
        loop {
            match &mut self.state {
                ChunkState::Size => {
                    let Some((end, next)) = line(buf) else {
                        if buf.len() > MAX_CHUNK_LINE {
                            return Err("a chunk-size line is too long".into());
                        }
                        return Ok(Decoded::More);
                    };
                    if end > MAX_CHUNK_LINE {
                        return Err("a chunk-size line is too long".into());
                    }
                    let l = &buf[..end];
                    let digits = l.iter().take_while(|b| b.is_ascii_hexdigit()).count();
                    let rest = l[digits..].trim_ascii_start();
                    if digits == 0 || digits > 16 || !(rest.is_empty() || rest[0] == b';') {
                        return Err("a chunk size is not a hexadecimal number".into());
                    }
                    let hex = std::str::from_utf8(&l[..digits]).map_err(|e| e.to_string())?;
                    let size = u64::from_str_radix(hex, 16).map_err(|e| e.to_string())?;
                    buf.advance(next);
                    self.state = if size == 0 {
                        ChunkState::Trailers
                    } else {
                        ChunkState::Data(size)
                    };
                }
                ChunkState::Data(left) => {
                    if buf.is_empty() {
                        return Ok(Decoded::More);
                    }
                    let k = (*left).min(buf.len() as u64);
                    *left -= k;
                    if *left == 0 {
                        self.state = ChunkState::DataEnd;
                    }
                    return Ok(Decoded::Data(buf.split_to(k as usize).freeze()));
                }
                ChunkState::DataEnd => {
                    match buf.first() {
                        None => return Ok(Decoded::More),
                        Some(b'\n') => buf.advance(1),
                        Some(b'\r') if buf.len() < 2 => return Ok(Decoded::More),
                        Some(b'\r') if buf[1] == b'\n' => buf.advance(2),
                        Some(_) => return Err("a chunk does not end where its size says".into()),
                    }
                    self.state = ChunkState::Size;
                }
                ChunkState::Trailers => {
                    let Some((end, next)) = line(buf) else {
                        if self.trailers + buf.len() > MAX_TRAILERS {
                            return Err("the trailers are too long".into());
                        }
                        return Ok(Decoded::More);
                    };
                    buf.advance(next);
                    self.trailers += next;
                    if self.trailers > MAX_TRAILERS {
                        return Err("the trailers are too long".into());
                    }
                    if end == 0 {
                        self.state = ChunkState::Done;
                    }
                }
                ChunkState::Done => return Ok(Decoded::Done),
            }
        }
    }
}

/// Sends a request without a body to one instance (see [`exchange`]).
pub async fn attempt(
    req: &HttpRequest,
    pool: &UpstreamPool,
    inst: &Instance,
    path_and_query: &str,
    fwd: &Forwarded,
    t: ProxyTimeouts,
) -> Exchange<Answer> {
    let host = match &inst.plain_host {
        Some(h) => h.as_bytes(),
        None => inst.base.as_bytes(),
    };
    let head = match request_head(req, path_and_query, host, fwd) {
        Ok(h) => h,
        Err(e) => return Exchange::Failed(format!("the upstream URI is not valid: {e}")),
    };
    exchange(pool, inst, &head, req.method(), t).await
}

/// The client's answer from an upstream's [`Answer`].
pub fn into_response(req: &HttpRequest, a: Answer) -> actix_web::HttpResponse {
    let mut out = actix_web::HttpResponse::new(a.status);
    *out.headers_mut() = a.headers;
    let out = match super::headers::finish_head(req, out, a.len) {
        std::ops::ControlFlow::Break(done) => return done,
        std::ops::ControlFlow::Continue(out) => out,
    };
    match a.body {
        AnswerBody::Empty => out,
        AnswerBody::Whole(b) => out.set_body(actix_web::body::BoxBody::new(b)),
        AnswerBody::Stream(s) => out.set_body(actix_web::body::BoxBody::new(s)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(input: &[u8], split: usize) -> Result<(Vec<u8>, bool), String> {
        let mut dec = Chunked::default();
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for part in [&input[..split], &input[split..]] {
            buf.extend_from_slice(part);
            loop {
                match dec.decode(&mut buf)? {
                    Decoded::Data(b) => out.extend_from_slice(&b),
                    Decoded::Done => return Ok((out, buf.is_empty())),
                    Decoded::More => break,
                }
            }
        }
        Ok((out, false))
    }

    /// Chunks, extensions, trailers and either line end decode the same,
    /// however the bytes arrive; bytes after the last chunk stay unread.
    #[test]
    fn chunked_decodes_wherever_the_bytes_split() {
        let input: &[u8] = b"5;ext=1\r\nhello\r\n7\n, world\n000\r\nx-trailer: 1\r\n\r\n";
        for split in 0..=input.len() {
            let (body, rest_empty) = decode_all(input, split).unwrap();
            assert_eq!(body, b"hello, world", "split at {split}");
            assert!(rest_empty, "split at {split}");
        }
        let (body, _) = decode_all(b"0\r\n\r\n", 2).unwrap();
        assert!(body.is_empty());
        // What follows the body is left in the buffer (the connection is then not reused).
        let mut dec = Chunked::default();
        let mut buf = BytesMut::from(&b"1\r\na\r\n0\r\n\r\nHTTP/1.1"[..]);
        assert_eq!(
            dec.decode(&mut buf),
            Ok(Decoded::Data(Bytes::from_static(b"a")))
        );
        assert_eq!(dec.decode(&mut buf), Ok(Decoded::Done));
        assert_eq!(&buf[..], b"HTTP/1.1");
    }

    /// Bad sizes, a chunk longer than its size, and endless lines are refused.
    #[test]
    fn chunked_refuses_bad_framing() {
        for bad in [
            &b"zz\r\n"[..],
            b"\r\n",
            b"-1\r\n",
            b"5 x\r\nhello\r\n",
            b"11112222333344445\r\n",
            b"2\r\nabc\r\n",
        ] {
            let r = decode_all(bad, bad.len());
            assert!(r.is_err(), "{:?} gave {r:?}", String::from_utf8_lossy(bad));
        }
        let long = vec![b'1'; MAX_CHUNK_LINE + 2];
        assert!(decode_all(&long, long.len()).is_err());
        let mut trailers = b"0\r\n".to_vec();
        while trailers.len() < MAX_TRAILERS + 100 {
            trailers.extend_from_slice(
                b"x-t: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n",
            );
        }
        assert!(decode_all(&trailers, trailers.len()).is_err());
    }

    fn parse(head: &[u8], head_only: bool) -> Result<Parsed, String> {
        let mut buf = BytesMut::from(head);
        loop {
            match parse_head(&mut buf, head_only)? {
                Some(Some(p)) => return Ok(p),
                Some(None) => continue,
                None => return Err("partial".into()),
            }
        }
    }

    /// An answer's framing decides its body and whether its connection is reused.
    #[test]
    fn answer_heads_frame_their_bodies() {
        let p = parse(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\n",
            false,
        )
        .unwrap();
        assert_eq!(
            (p.framing, p.reusable, p.len),
            (Framing::Sized(5), true, Some(5))
        );
        assert_eq!(p.headers.get("x-a").unwrap(), "1");
        assert!(p.headers.get("content-length").is_none());
        // HEAD, 204 and 304 have no body; HEAD keeps the length for the client.
        let p = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", true).unwrap();
        assert_eq!((p.framing, p.len), (Framing::None, Some(5)));
        let p = parse(b"HTTP/1.1 304 Not Modified\r\n\r\n", false).unwrap();
        assert_eq!(p.framing, Framing::None);
        // Chunked, with hop-by-hop headers and those the Connection header lists dropped.
        let p = parse(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: x-hop\r\nX-Hop: 1\r\nKeep-Alive: 5\r\n\r\n",
            false,
        )
        .unwrap();
        assert_eq!((p.framing, p.reusable), (Framing::Chunked, true));
        assert!(p.headers.is_empty(), "{:?}", p.headers);
        // Both framings: the chunks, then the connection closes.
        let p = parse(
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            false,
        )
        .unwrap();
        assert_eq!(
            (p.framing, p.reusable, p.len),
            (Framing::Chunked, false, None)
        );
        // No length: up to the close. HTTP/1.0 and Connection: close are not reused.
        let p = parse(b"HTTP/1.1 200 OK\r\n\r\n", false).unwrap();
        assert_eq!((p.framing, p.reusable), (Framing::Close, false));
        let p = parse(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", false).unwrap();
        assert!(!p.reusable);
        let p = parse(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
            false,
        )
        .unwrap();
        assert!(!p.reusable);
        // Interim answers are skipped.
        let p = parse(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early\r\nLink: x\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n", false).unwrap();
        assert_eq!(p.status, StatusCode::CREATED);
    }

    /// Heads that cannot be framed safely are refused.
    #[test]
    fn bad_answer_heads_are_refused() {
        for bad in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 5x\r\n\r\n",
            b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
            b"SSH-2.0-OpenSSH\r\n\r\n",
        ] {
            assert!(
                parse(bad, false).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("x-{i}: 1\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert!(
            parse(&many, false)
                .err()
                .is_some_and(|e| e.contains("headers"))
        );
        assert_eq!(
            parse(b"HTTP/1.1 200 OK\r\nX-A: 1\r\n", false)
                .err()
                .as_deref(),
            Some("partial")
        );
    }

    /// Targets and values that would split the request are refused.
    #[test]
    fn request_targets_and_values_are_checked() {
        assert!(target_ok(b"/a?b=c%20d"));
        assert!(!target_ok(b"/a b"));
        assert!(!target_ok(b"/a\r\nx: y"));
        assert!(!target_ok(b""));
    }

    // -----------------------------------------------------------------
    // Differential tests against hyper: a tenant's upstream chooses every
    // byte this client parses, so the same generated answers go through
    // [`parse_head`] and [`Chunked`] and through hyper's HTTP/1 client (on
    // an in-memory pipe): the same status, the same headers passed on, the
    // same framing (a known length or not), the same body, and both refuse
    // the same malformed answers. The deliberate differences are listed in
    // [`deliberate`] (and tested one by one below).

    use proptest::prelude::*;

    /// What a client made of an answer: status, the body's known length,
    /// the headers passed on (sorted), the body.
    type Outcome = (u16, Option<u64>, Vec<(String, Vec<u8>)>, Vec<u8>);

    /// This client: the head, then the body as its framing says, the
    /// upstream's close after the bytes.
    fn ours(bytes: &[u8], head_only: bool) -> Result<Outcome, String> {
        let mut buf = BytesMut::from(bytes);
        let p = loop {
            match parse_head(&mut buf, head_only)? {
                Some(Some(p)) => break p,
                Some(None) => continue,
                None => return Err("the head is not whole".into()),
            }
        };
        let (exact, body) = match p.framing {
            Framing::None => (Some(0), Vec::new()),
            Framing::Sized(n) if (buf.len() as u64) < n => return Err("eof in body".into()),
            Framing::Sized(n) => (Some(n), buf[..n as usize].to_vec()),
            Framing::Close => (None, buf.to_vec()),
            Framing::Chunked => {
                let mut dec = Chunked::default();
                let mut out = Vec::new();
                loop {
                    match dec.decode(&mut buf)? {
                        Decoded::Data(b) => out.extend_from_slice(&b),
                        Decoded::Done => break,
                        Decoded::More => return Err("eof in chunks".into()),
                    }
                }
                (None, out)
            }
        };
        let mut headers: Vec<(String, Vec<u8>)> = p
            .headers
            .iter()
            .map(|(k, v)| (k.as_str().to_string(), v.as_bytes().to_vec()))
            .collect();
        headers.sort();
        Ok((p.status.as_u16(), exact, headers, body))
    }

    thread_local! {
        static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
    }

    /// hyper's HTTP/1 client (as [`super::super::h1`] sets it up), the
    /// answer written by a peer that then closes; its headers filtered by
    /// the same hop-by-hop rule.
    fn hyper_answer(bytes: &[u8], head_only: bool) -> Result<Outcome, String> {
        use hyper::body::Body as _;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let bytes = bytes.to_vec();
        RT.with(|rt| {
            rt.block_on(async move {
                let (client, mut server) = tokio::io::duplex(1 << 16);
                let (mut tx, conn) = hyper::client::conn::http1::Builder::new()
                    .max_buf_size(MAX_HEAD)
                    .handshake::<_, String>(hyper_util::rt::TokioIo::new(client))
                    .await
                    .map_err(|e| e.to_string())?;
                let conn = tokio::spawn(conn);
                let peer = tokio::spawn(async move {
                    let mut got = Vec::new();
                    let mut b = [0u8; 1024];
                    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                        match server.read(&mut b).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => got.extend_from_slice(&b[..n]),
                        }
                    }
                    let _ = server.write_all(&bytes).await;
                    let _ = server.shutdown().await;
                    // Held until the client has read all (then dropped).
                    let _ = server.read(&mut b).await;
                });
                let req = hyper::Request::builder()
                    .method(if head_only { "HEAD" } else { "GET" })
                    .uri("/")
                    .header("host", "upstream")
                    .body(String::new())
                    .unwrap();
                let out = async {
                    let res = tx.send_request(req).await.map_err(|e| e.to_string())?;
                    let status = res.status().as_u16();
                    let listed: Vec<String> = res
                        .headers()
                        .get_all(hyper::header::CONNECTION)
                        .iter()
                        .filter_map(|v| v.to_str().ok())
                        .flat_map(|v| v.split(','))
                        .map(|s| s.trim().to_ascii_lowercase())
                        .filter(|s| !s.is_empty())
                        .collect();
                    let mut headers: Vec<(String, Vec<u8>)> = res
                        .headers()
                        .iter()
                        .filter(|(k, _)| *k != hyper::header::CONTENT_LENGTH)
                        .filter_map(|(k, v)| {
                            let name = HeaderName::from_bytes(k.as_str().as_bytes()).ok()?;
                            (!crate::deploy::headers::is_hop_by_hop(&name, &listed))
                                .then(|| (k.as_str().to_string(), v.as_bytes().to_vec()))
                        })
                        .collect();
                    headers.sort();
                    let mut body = res.into_body();
                    let exact = body.size_hint().exact();
                    let mut out = Vec::new();
                    while let Some(f) =
                        std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
                    {
                        if let Ok(d) = f.map_err(|e| e.to_string())?.into_data() {
                            out.extend_from_slice(&d);
                        }
                    }
                    Ok::<_, String>((status, exact, headers, out))
                }
                .await;
                drop(tx);
                peer.abort();
                conn.abort();
                out
            })
        })
    }

    /// One generated answer: its parts, kept to tell a deliberate difference.
    #[derive(Debug, Clone)]
    struct Case {
        interim: bool,
        version: &'static str,
        status: String,
        reason: &'static str,
        headers: Vec<(String, String)>,
        /// The Content-Length written (`None`: the body's true length).
        body: Vec<u8>,
        /// Where the bytes are cut short (the upstream closed early).
        cut: Option<usize>,
        head_only: bool,
    }

    impl Case {
        fn bytes(&self) -> Vec<u8> {
            let mut out = Vec::new();
            if self.interim {
                out.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
            }
            out.extend_from_slice(
                format!("{} {} {}\r\n", self.version, self.status, self.reason).as_bytes(),
            );
            for (k, v) in &self.headers {
                let v = if v == "{len}" {
                    self.body.len().to_string()
                } else {
                    v.clone()
                };
                out.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
            }
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(&self.body);
            if let Some(c) = self.cut {
                out.truncate(c % (out.len() + 1));
            }
            out
        }

        fn values(&self, name: &str) -> Vec<&str> {
            self.headers
                .iter()
                .filter(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
                .collect()
        }
    }

    /// Why this client and hyper may answer differently on purpose.
    fn deliberate(c: &Case) -> Option<&'static str> {
        let te = !c.values("transfer-encoding").is_empty();
        let cls = c.values("content-length");
        let digits = |v: &str| {
            let v = v.trim();
            v == "{len}" || v.bytes().all(|b| b.is_ascii_digit()) && v.parse::<u64>().is_ok()
        };
        if c.status == "101" {
            return Some(
                "101: hyper hands over an upgrade; this client never asked for one and refuses it",
            );
        }
        if cls
            .iter()
            .any(|v| v.contains(',') && v.split(',').all(digits))
        {
            return Some(
                "a Content-Length list (`5, 5`): hyper takes equal values; this client refuses a list",
            );
        }
        let len = |v: &str| match v.trim() {
            "{len}" => c.body.len().to_string(),
            v => v.to_string(),
        };
        let conflicting = cls.iter().any(|v| len(v) != len(cls[0]));
        let unused = te || c.head_only || c.status == "204" || c.status == "304";
        if (conflicting || cls.iter().any(|v| !digits(v))) && unused {
            return Some(
                "an invalid Content-Length (or one past u64, or two that differ): this client refuses it even where hyper ignores it (under Transfer-Encoding, or for HEAD/204/304)",
            );
        }
        if te && c.version == "HTTP/1.0" {
            return Some(
                "Transfer-Encoding in an HTTP/1.0 answer: hyper refuses it; this client frames by it and closes the connection",
            );
        }
        None
    }

    fn chunked_body() -> impl Strategy<Value = Vec<u8>> {
        (
            proptest::collection::vec(
                (
                    proptest::collection::vec(any::<u8>(), 1..24),
                    0usize..3,
                    any::<bool>(),
                    prop_oneof![Just(""), Just(";a=b"), Just(" ;x"), Just(";q=\"1\"")],
                ),
                0..4,
            ),
            prop_oneof![Just(""), Just("x-t: 1\r\n"), Just("a: b\r\nc: d\r\n")],
            prop_oneof![Just("0"), Just("000")],
        )
            .prop_map(|(chunks, trailers, last)| {
                let mut out = Vec::new();
                for (data, zeros, upper, ext) in chunks {
                    let size = if upper {
                        format!("{:X}", data.len())
                    } else {
                        format!("{:x}", data.len())
                    };
                    out.extend_from_slice(
                        format!("{}{size}{ext}\r\n", "0".repeat(zeros)).as_bytes(),
                    );
                    out.extend_from_slice(&data);
                    out.extend_from_slice(b"\r\n");
                }
                out.extend_from_slice(format!("{last}\r\n{trailers}\r\n").as_bytes());
                out
            })
    }

    fn header() -> impl Strategy<Value = (String, String)> {
        let h = |k: &str, v: &str| (k.to_string(), v.to_string());
        prop_oneof![
            4 => Just(h("Content-Length", "{len}")),
            1 => prop_oneof![
                Just("0"), Just("3"), Just("05"), Just(" 7 "), Just("+5"), Just("-1"),
                Just("5x"), Just(""), Just("5, 5"), Just("5, 6"),
                Just("99999999999999999999"), Just("18446744073709551615"),
            ].prop_map(move |v| h("Content-Length", v)),
            3 => prop_oneof![
                Just("chunked"), Just("Chunked"), Just("gzip, chunked"),
                Just("chunked, gzip"), Just("identity"), Just(" chunked "),
            ].prop_map(move |v| h("Transfer-Encoding", v)),
            1 => prop_oneof![Just("close"), Just("keep-alive"), Just("x-a, X-B")]
                .prop_map(move |v| h("Connection", v)),
            3 => ("[a-zA-Z][a-zA-Z0-9-]{0,8}", "[ -~]{0,12}").prop_map(|(k, v)| (k, v)),
            1 => prop_oneof![Just(h("X-A", "1")), Just(h("x-b", "2")), Just(h("Keep-Alive", "5"))],
        ]
    }

    fn case() -> impl Strategy<Value = Case> {
        (
            proptest::bool::weighted(0.1),
            prop_oneof![8 => Just("HTTP/1.1"), 2 => Just("HTTP/1.0"), 1 => Just("HTTP/2.0"), 1 => Just("HTTP/1.1 ")],
            prop_oneof![
                6 => prop_oneof![Just(200u16), Just(201), Just(404), Just(502)].prop_map(|s| s.to_string()),
                2 => prop_oneof![Just("204"), Just("304"), Just("101"), Just("103"), Just("099"), Just("999"), Just("20"), Just("2000"), Just("abc")].prop_map(str::to_string),
                1 => (100u16..1000).prop_map(|s| s.to_string()),
            ],
            prop_oneof![Just("OK"), Just(""), Just("Some Reason")],
            proptest::collection::vec(header(), 0..5),
            prop_oneof![
                2 => proptest::collection::vec(any::<u8>(), 0..40),
                3 => chunked_body(),
            ],
            proptest::option::weighted(0.15, any::<usize>()),
            proptest::bool::weighted(0.15),
        )
            .prop_map(|(interim, version, status, reason, headers, body, cut, head_only)| Case {
                interim,
                version,
                status,
                reason,
                headers,
                body,
                cut,
                head_only,
            })
    }

    proptest! {
        // A few thousand answers; each goes through hyper on a pipe.
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// The same answer, the same outcome as hyper's (but the deliberate differences).
        #[test]
        fn answers_parse_as_hyper_parses_them(c in case()) {
            let bytes = c.bytes();
            let a = ours(&bytes, c.head_only);
            let b = hyper_answer(&bytes, c.head_only);
            if deliberate(&c).is_none() {
                match (&a, &b) {
                    (Ok(x), Ok(y)) => prop_assert_eq!(x, y, "{:?}", String::from_utf8_lossy(&bytes)),
                    (Err(_), Err(_)) => {}
                    _ => prop_assert!(false, "ours {:?}\nhyper {:?}\n{:?}", a, b, String::from_utf8_lossy(&bytes)),
                }
            }
        }

        /// Chunked bodies decode the same (as hyper's, through the property
        /// above) wherever the bytes are split by the reads.
        #[test]
        fn chunked_decodes_the_same_across_reads(
            body in chunked_body(),
            cuts in proptest::collection::vec(any::<usize>(), 0..6),
        ) {
            let whole = decode_all(&body, body.len()).unwrap();
            let mut dec = Chunked::default();
            let mut buf = BytesMut::new();
            let mut out = Vec::new();
            let mut at: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
            at.push(body.len());
            at.sort();
            let mut from = 0;
            let mut done = false;
            for to in at {
                buf.extend_from_slice(&body[from..to]);
                from = to;
                while !done {
                    match dec.decode(&mut buf).unwrap() {
                        Decoded::Data(b) => out.extend_from_slice(&b),
                        Decoded::Done => done = true,
                        Decoded::More => break,
                    }
                }
            }
            prop_assert!(done);
            prop_assert_eq!(out, whole.0);
        }

        /// Any bytes: no panic, and the decoder never holds more than its
        /// limits while it waits (a line or the trailers): memory is bounded
        /// whatever the upstream sends.
        #[test]
        fn any_bytes_are_decoded_or_refused_in_bounded_memory(
            input in proptest::collection::vec(
                prop_oneof![4 => any::<u8>(), 1 => Just(b'\n'), 1 => Just(b'\r'), 1 => Just(b'0')],
                0..600,
            ),
            step in 1usize..64,
            head_only in any::<bool>(),
        ) {
            let mut buf = BytesMut::from(&input[..]);
            let _ = parse_head(&mut buf, head_only);
            let mut dec = Chunked::default();
            let mut buf = BytesMut::new();
            'feed: for piece in input.chunks(step) {
                buf.extend_from_slice(piece);
                loop {
                    match dec.decode(&mut buf) {
                        Err(_) | Ok(Decoded::Done) => break 'feed,
                        Ok(Decoded::Data(b)) => prop_assert!(!b.is_empty()),
                        Ok(Decoded::More) => {
                            prop_assert!(buf.len() <= MAX_TRAILERS.max(MAX_CHUNK_LINE));
                            break;
                        }
                    }
                }
            }
        }
    }

    /// An endless chunk-size line or trailer section is refused once past its
    /// limit, however it arrives: the buffer never grows past it.
    #[test]
    fn endless_lines_are_refused_at_their_limit() {
        for (start, limit) in [(&b""[..], MAX_CHUNK_LINE), (b"0\r\n", MAX_TRAILERS)] {
            let mut dec = Chunked::default();
            let mut buf = BytesMut::from(start);
            let mut fed = 0;
            let r = loop {
                match dec.decode(&mut buf) {
                    Ok(Decoded::More) => {
                        buf.extend_from_slice(&[b'a'; 1024]);
                        fed += 1024;
                        assert!(fed <= limit + 2048, "not refused after {fed} bytes");
                    }
                    other => break other,
                }
            };
            assert!(r.is_err(), "{r:?}");
        }
    }

    /// The deliberate differences, one by one: what hyper does, what this
    /// client does.
    #[test]
    fn deliberate_differences_from_hyper() {
        let cases: &[(&[u8], bool, bool)] = &[
            // (answer, hyper accepts, this client accepts)
            (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", true, false),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nab", true, false),
            (b"HTTP/1.1 204 No Content\r\nContent-Length: x\r\n\r\n", true, false),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: x\r\n\r\n0\r\n\r\n", true, false),
            (b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", false, true),
            // Bare LF line ends in a chunked body (RFC 9112 §2.2 lets a recipient take them).
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\na\n0\n\n", false, true),
            // More than 16 hex digits of chunk size (leading zeros).
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n000000000000000001\r\na\r\n0\r\n\r\n", true, false),
        ];
        for (bytes, hyper_ok, ours_ok) in cases {
            let text = String::from_utf8_lossy(bytes);
            assert_eq!(
                hyper_answer(bytes, false).is_ok(),
                *hyper_ok,
                "hyper: {text}"
            );
            assert_eq!(ours(bytes, false).is_ok(), *ours_ok, "ours: {text}");
        }
    }
}
