//! The proxy's client of pools with an `https://` instance (and of
//! WebSocket handshakes, [`super::relay`]): awc, one client per worker
//! thread, every name resolved through the egress policy. The client's body
//! is handed to at most one attempt ([`send_once`]); the answer streams back
//! ([`stream_response`], also used by the node's own forwarding).

use super::egress::{CheckedResolver, EgressPolicy, refusal_of};
use super::h1::{ConnectFailure, Exchange};
use super::headers::{BodyKind, Forwarded, connection_listed, finish_head, is_hop_by_hop};
use super::pool::{Instance, ProxyTimeouts};
use crate::error::{ApiError, Code};
use actix_web::body::{BodySize, BoxBody, MessageBody, SizedStream};
use actix_web::http::header;
use actix_web::{HttpRequest, HttpResponse, dev::Payload};
use bytes::Bytes;
use futures_util::Stream;
use std::cell::RefCell;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// The TLS client config of `https://` instances, for the proxy's awc
/// and the active health checks ([`super::health`]): the webpki roots (as
/// awc's own default), no client certificate, HTTP/1.1 by ALPN.
pub(crate) fn upstream_tls() -> Arc<rustls::ClientConfig> {
    static TLS: std::sync::OnceLock<Arc<rustls::ClientConfig>> = std::sync::OnceLock::new();
    TLS.get_or_init(|| {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_root_certificates(actix_tls::connect::rustls_0_23::webpki_roots_cert_store())
            .with_no_client_auth();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(cfg)
    })
    .clone()
}

thread_local! {
    static UPSTREAM_CLIENT: RefCell<Option<(Duration, Arc<EgressPolicy>, awc::Client)>> =
        const { RefCell::new(None) };
}

/// The worker thread's client for deployment upstreams (awc is
/// single-threaded; pooled keep-alive connections). Every name resolves
/// through the egress policy, so only checked addresses are connected.
/// Redirects are never followed.
pub(crate) fn upstream_client(t: ProxyTimeouts, egress: &Arc<EgressPolicy>) -> awc::Client {
    UPSTREAM_CLIENT.with(|c| {
        let mut c = c.borrow_mut();
        if let Some((ct, policy, client)) = c.as_ref()
            && *ct == t.connect
            && Arc::ptr_eq(policy, egress)
        {
            return client.clone();
        }
        let resolver = actix_tls::connect::Resolver::custom(CheckedResolver(egress.clone()));
        let tcp = actix_tls::connect::Connector::new(resolver).service();
        let connector = awc::Connector::new()
            .connector(tcp)
            .timeout(t.connect)
            .max_http_version(actix_web::http::Version::HTTP_11)
            // After `max_http_version`, which would replace it.
            .rustls_0_23(upstream_tls())
            .limit(1024)
            .conn_keep_alive(Duration::from_secs(30));
        let client = awc::Client::builder()
            .connector(connector)
            .disable_redirects()
            .no_default_headers()
            .timeout(t.response)
            .finish();
        *c = Some((t.connect, egress.clone(), client.clone()));
        client
    })
}

/// The request body, handed to at most one upstream attempt. An attempt whose
/// connection failed never polled it, so the next instance can still take it;
/// once polled it is gone and no retry happens.
struct OnceBody {
    /// The client's body, shared by the attempts: the first poll takes it out.
    slot: Rc<RefCell<Option<Payload>>>,
    /// The body once this attempt took it; afterwards no other attempt can retry.
    taken: Option<Payload>,
}

/// The client's body, waiting in its slot for the one attempt that polls it.
pub(crate) type BodySlot = Rc<RefCell<Option<Payload>>>;

/// Sends `creq` with the client's body from `slot`, framed as `kind`.
pub(crate) fn send_once(
    creq: awc::ClientRequest,
    kind: BodyKind,
    slot: &BodySlot,
) -> awc::SendClientRequest {
    let body = OnceBody {
        slot: slot.clone(),
        taken: None,
    };
    match kind {
        BodyKind::None => creq.send(),
        BodyKind::Sized(n) => creq.send_body(SizedStream::new(n, body)),
        BodyKind::Chunked => creq.send_stream(body),
    }
}

/// Whether a failed attempt left the body for another one (it never polled it).
pub(crate) fn body_untouched(kind: BodyKind, slot: &BodySlot) -> bool {
    slot.borrow().is_some() || matches!(kind, BodyKind::None)
}

impl Stream for OnceBody {
    type Item = Result<Bytes, actix_web::error::PayloadError>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.taken.is_none() {
            let p = self.slot.borrow_mut().take();
            match p {
                Some(p) => self.taken = Some(p),
                None => return Poll::Ready(None),
            }
        }
        Pin::new(self.taken.as_mut().expect("taken")).poll_next(cx)
    }
}

/// Sends the client's request to instance `inst` through awc, the body
/// from `slot` (see [`send_once`]): one attempt of the driver's loop
/// ([`super::proxy`]).
pub(crate) async fn attempt(
    client: &awc::Client,
    req: &HttpRequest,
    inst: &Instance,
    path_and_query: &str,
    fwd: &Forwarded,
    kind: BodyKind,
    slot: &BodySlot,
) -> Exchange<HttpResponse> {
    let uri = match inst.uri(path_and_query) {
        Ok(u) => u,
        Err(e) => {
            return Exchange::Ended(ApiError::new(
                Code::UpstreamFailed,
                format!("the upstream URI is not valid: {e}"),
            ));
        }
    };
    let mut creq = client.request(req.method().clone(), uri).no_decompress();
    // The header map is set whole (the builder moves on each header added),
    // built for this attempt (retries are rare).
    *creq.headers_mut() = super::headers::upstream_headers(req, fwd);
    match send_once(creq, kind, slot).await {
        Ok(res) => Exchange::Answered(stream_response(req, res)),
        // A policy refusal, not a health failure; nothing was sent.
        Err(awc::error::SendRequestError::Connect(e)) => match refusal_of(&e) {
            Some(r) => Exchange::NotConnected(ConnectFailure::Refused(r.clone())),
            None => Exchange::NotConnected(ConnectFailure::Failed(format!("{e}"))),
        },
        Err(awc::error::SendRequestError::Timeout) => Exchange::TimedOut,
        // Reached and failed: never retried.
        Err(e) => Exchange::Failed(format!("{e}")),
    }
}

/// The upstream's answer, its body streamed as it arrives.
pub(crate) fn stream_response<S>(req: &HttpRequest, res: awc::ClientResponse<S>) -> HttpResponse
where
    S: Stream<Item = Result<Bytes, actix_web::error::PayloadError>> + Unpin + 'static,
{
    let status = res.status();
    let listed = connection_listed(res.headers());
    let mut out = HttpResponse::new(status);
    let mut len = None;
    {
        let h = out.headers_mut();
        for (k, v) in res.headers() {
            if k == header::CONTENT_LENGTH {
                len = v.to_str().ok().and_then(|s| s.parse::<u64>().ok());
                continue;
            }
            if is_hop_by_hop(k, &listed) {
                continue;
            }
            h.append(k.clone(), v.clone());
        }
    }
    let out = match finish_head(req, out, len) {
        ControlFlow::Break(done) => return done,
        ControlFlow::Continue(out) => out,
    };
    let body: BoxBody = match len {
        Some(n) => SizedStream::new(n, res).boxed(),
        None => actix_web::body::BodyStream::new(res).boxed(),
    };
    debug_assert!(!matches!(body.size(), BodySize::None));
    out.set_body(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;
    use futures_util::StreamExt;

    fn slot(body: &'static [u8]) -> BodySlot {
        let (_, p) = TestRequest::default().set_payload(body).to_http_parts();
        Rc::new(RefCell::new(Some(p)))
    }

    /// The first attempt that polls the body takes it; a later one finds
    /// nothing, and the slot then says no retry may happen.
    #[actix_rt::test]
    async fn the_body_goes_to_one_attempt_only() {
        let s = slot(b"hello");
        assert!(body_untouched(BodyKind::Sized(5), &s));
        let mut first = OnceBody {
            slot: s.clone(),
            taken: None,
        };
        let mut second = OnceBody {
            slot: s.clone(),
            taken: None,
        };
        assert_eq!(
            first.next().await.unwrap().unwrap(),
            Bytes::from_static(b"hello")
        );
        assert!(!body_untouched(BodyKind::Sized(5), &s));
        assert!(second.next().await.is_none());
        // A request without a body can always be sent again.
        assert!(body_untouched(BodyKind::None, &s));
    }

    /// The upstream's hop-by-hop headers are dropped, its length kept for the
    /// framing, and its body streamed.
    #[actix_rt::test]
    async fn answers_stream_with_their_own_headers() {
        let req = TestRequest::get().to_http_request();
        let res = awc::test::TestResponse::default()
            .insert_header(("connection", "x-hop"))
            .insert_header(("x-hop", "1"))
            .insert_header(("keep-alive", "5"))
            .insert_header(("x-app", "2"))
            .insert_header(("content-length", "3"))
            .set_payload(Bytes::from_static(b"abc"))
            .finish();
        let out = stream_response(&req, res);
        assert_eq!(out.status(), actix_web::http::StatusCode::OK);
        assert_eq!(out.headers().get("x-app").unwrap(), "2");
        assert_eq!(out.headers().get("content-encoding").unwrap(), "identity");
        for h in ["connection", "x-hop", "keep-alive", "content-length"] {
            assert!(out.headers().get(h).is_none(), "{h}");
        }
        assert!(matches!(out.body().size(), BodySize::Sized(3)));
        let body = actix_web::body::to_bytes(out.into_body()).await.unwrap();
        assert_eq!(&body[..], b"abc");
    }

    /// One client per thread, made again only for another policy or connect timeout.
    #[actix_rt::test]
    async fn the_client_is_made_once_per_policy() {
        let p = crate::deploy::pool::tests::loopback_policy();
        let t = ProxyTimeouts {
            connect: Duration::from_secs(1),
            response: Duration::from_secs(2),
        };
        let _a = upstream_client(t, &p);
        UPSTREAM_CLIENT.with(|c| assert!(Arc::ptr_eq(&c.borrow().as_ref().unwrap().1, &p)));
        let q = crate::deploy::pool::tests::loopback_policy();
        let _b = upstream_client(t, &q);
        UPSTREAM_CLIENT.with(|c| assert!(Arc::ptr_eq(&c.borrow().as_ref().unwrap().1, &q)));
    }
}
