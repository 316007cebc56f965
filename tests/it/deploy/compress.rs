//! Gzip of proxied answers (issue #40, docs/deployments.md "Compression"):
//! applied to a compressible answer the upstream did not encode, for a
//! client that accepts gzip, streamed (what the upstream sent so far
//! reaches the client before the upstream finishes), decoding to the
//! upstream's exact bytes; never for an event stream, a range, an encoded
//! answer, a small one, a type not worth it, a client without
//! `Accept-Encoding`, a HEAD, or a deployment with `compress: false`. Bad
//! values of `compress` are refused with nothing stored. The upstream
//! listens on 127.0.0.1.

use super::{deploy_json, proxy_node, via};
use crate::common::*;
use actix_web::{App, HttpResponse, HttpServer, web};
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

/// The JSON body of `/json`: 8 KiB, compressible.
fn json_body() -> Vec<u8> {
    let mut b = b"[".to_vec();
    let mut i = 0;
    while b.len() < 8 << 10 {
        b.extend_from_slice(format!("{{\"n\":{i},\"name\":\"item-{i}\"}},").as_bytes());
        i += 1;
    }
    b.extend_from_slice(b"0]");
    b
}

fn gzip(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

fn gunzip(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(b)
        .read_to_end(&mut out)
        .unwrap_or_else(|e| panic!("not gzip ({e}): {} bytes", b.len()));
    out
}

const STREAM_FIRST: &[u8] = &[b'a'; 3000];
const STREAM_LAST: &[u8] = &[b'b'; 3000];

/// The upstream: answers of each kind the proxy must tell apart.
fn start_upstream(release: Arc<tokio::sync::Notify>) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let srv = HttpServer::new(move || {
                let release = release.clone();
                App::new()
                    .route(
                        "/json",
                        web::route().to(|| async {
                            HttpResponse::Ok()
                                .content_type("application/json")
                                .insert_header(("etag", "\"e1\""))
                                .insert_header(("accept-ranges", "bytes"))
                                .body(json_body())
                        }),
                    )
                    .route(
                        "/encoded",
                        web::get().to(|| async {
                            HttpResponse::Ok()
                                .content_type("application/json")
                                .insert_header(("content-encoding", "gzip"))
                                .body(gzip(&json_body()))
                        }),
                    )
                    .route(
                        "/range",
                        web::get().to(|| async {
                            HttpResponse::PartialContent()
                                .content_type("text/plain")
                                .insert_header(("content-range", "bytes 0-4095/10000"))
                                .body(vec![b'r'; 4096])
                        }),
                    )
                    .route(
                        "/png",
                        web::get().to(|| async {
                            HttpResponse::Ok()
                                .content_type("image/png")
                                .body(vec![7u8; 4096])
                        }),
                    )
                    .route(
                        "/small",
                        web::get().to(|| async {
                            HttpResponse::Ok()
                                .content_type("text/plain")
                                .body(vec![b's'; 100])
                        }),
                    )
                    .route(
                        "/sse",
                        web::get().to(|| async {
                            let events = (0..40).map(|i| {
                                Ok::<_, actix_web::Error>(web::Bytes::from(format!(
                                    "data: event {i} {}\n\n",
                                    "x".repeat(100)
                                )))
                            });
                            HttpResponse::Ok()
                                .content_type("text/event-stream")
                                .streaming(futures_util::stream::iter(events))
                        }),
                    )
                    .route(
                        "/stream",
                        web::get().to(move || {
                            let release = release.clone();
                            async move {
                                // The first part, then the rest once the test saw it.
                                let s = futures_util::stream::unfold(0u8, move |st| {
                                    let release = release.clone();
                                    async move {
                                        match st {
                                            0 => Some((web::Bytes::from_static(STREAM_FIRST), 1)),
                                            1 => {
                                                let _ = tokio::time::timeout(
                                                    Duration::from_secs(20),
                                                    release.notified(),
                                                )
                                                .await;
                                                Some((web::Bytes::from_static(STREAM_LAST), 2))
                                            }
                                            _ => None,
                                        }
                                    }
                                });
                                HttpResponse::Ok()
                                    .content_type("text/plain; charset=utf-8")
                                    .streaming(futures_util::StreamExt::map(
                                        s,
                                        Ok::<_, actix_web::Error>,
                                    ))
                            }
                        }),
                    )
            })
            .workers(1)
            .bind("127.0.0.1:0")
            .unwrap();
            tx.send(srv.addrs()[0].to_string()).unwrap();
            srv.run().await.unwrap();
        });
    });
    format!(
        "http://{}",
        rx.recv_timeout(Duration::from_secs(10)).unwrap()
    )
}

fn vary_lists_accept_encoding(h: &[(String, String)]) -> bool {
    h.iter()
        .filter(|(k, _)| k == "vary")
        .any(|(_, v)| v.to_ascii_lowercase().contains("accept-encoding"))
}

/// The complete chunks of a chunked body read so far.
fn complete_chunks(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = b.windows(2).position(|w| w == b"\r\n") {
        let Ok(size) = usize::from_str_radix(String::from_utf8_lossy(&b[..i]).trim(), 16) else {
            break;
        };
        if size == 0 || b.len() < i + 2 + size + 2 {
            break;
        }
        out.extend_from_slice(&b[i + 2..i + 2 + size]);
        b = &b[i + 2 + size + 2..];
    }
    out
}

/// What a gzip stream read so far decodes to.
fn gunzip_prefix(b: &[u8]) -> Vec<u8> {
    let mut d = flate2::write::GzDecoder::new(Vec::new());
    let _ = d.write_all(b);
    let _ = d.flush();
    d.get_ref().clone()
}

/// A compressible answer is gzipped for a client that accepts it, and
/// decodes to the upstream's exact bytes; every case that must not be
/// compressed reaches the client as the upstream sent it.
#[test]
fn proxied_answers_are_gzipped_only_when_they_should_be() {
    let node = proxy_node();
    let key = node.create_namespace("gzip");
    let release = Arc::new(tokio::sync::Notify::new());
    let up = start_upstream(release.clone());
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({"name": "zip", "hosts": ["zip.test"], "upstream": {"instances": [up]}}),
    );
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["deployment"]["target"]["compress"], true, "{v}");
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({"name": "raw", "hosts": ["raw.test"],
            "upstream": {"instances": [up], "compress": false}}),
    );
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["deployment"]["target"]["compress"], false, "{v}");
    let gz = [("accept-encoding", "br;q=1, gzip;q=0.8")];
    let body = json_body();

    // Applied: gzip, chunked, Vary, weak ETag, no Accept-Ranges; exact bytes.
    let (s, h, b) = via(&node, "zip.test", "GET", "/json", &gz, None);
    assert_eq!(s, 200);
    assert_eq!(header(&h, "content-encoding"), Some("gzip"), "{h:?}");
    assert_eq!(header(&h, "content-length"), None, "{h:?}");
    assert_eq!(header(&h, "transfer-encoding"), Some("chunked"), "{h:?}");
    assert!(vary_lists_accept_encoding(&h), "{h:?}");
    assert_eq!(header(&h, "etag"), Some("W/\"e1\""), "{h:?}");
    assert_eq!(header(&h, "accept-ranges"), None, "{h:?}");
    assert!(b.len() < body.len() / 3, "{} of {}", b.len(), body.len());
    assert_eq!(gunzip(&b), body);

    // A client without Accept-Encoding: the upstream's bytes, its length and
    // ETag, and Vary (the answer depends on the header).
    let (s, h, b) = via(&node, "zip.test", "GET", "/json", &[], None);
    assert_eq!((s, header(&h, "content-encoding")), (200, None), "{h:?}");
    assert_eq!(b, body);
    let len = body.len().to_string();
    assert_eq!(header(&h, "content-length"), Some(len.as_str()));
    assert_eq!(header(&h, "etag"), Some("\"e1\""));
    assert!(vary_lists_accept_encoding(&h), "{h:?}");
    // A client refusing gzip.
    let (_, h, b) = via(
        &node,
        "zip.test",
        "GET",
        "/json",
        &[("accept-encoding", "gzip;q=0, br")],
        None,
    );
    assert_eq!((header(&h, "content-encoding"), b == body), (None, true));

    // Never: a HEAD (its length kept), a request with Range, a 206, an
    // event stream, an answer the upstream encoded, a small one, an image.
    let (s, h, b) = via(&node, "zip.test", "HEAD", "/json", &gz, None);
    assert_eq!((s, header(&h, "content-encoding"), b.len()), (200, None, 0));
    assert_eq!(header(&h, "content-length"), Some(len.as_str()));
    let (s, h, b) = via(
        &node,
        "zip.test",
        "GET",
        "/json",
        &[("accept-encoding", "gzip"), ("range", "bytes=0-9")],
        None,
    );
    assert_eq!((s, header(&h, "content-encoding")), (200, None), "{h:?}");
    assert_eq!(b, body);
    let (s, h, b) = via(&node, "zip.test", "GET", "/range", &gz, None);
    assert_eq!((s, header(&h, "content-encoding")), (206, None), "{h:?}");
    assert_eq!(b, vec![b'r'; 4096]);
    let (s, h, b) = via(&node, "zip.test", "GET", "/sse", &gz, None);
    assert_eq!((s, header(&h, "content-encoding")), (200, None), "{h:?}");
    assert!(!vary_lists_accept_encoding(&h), "{h:?}");
    let text = String::from_utf8(b).unwrap();
    assert!(
        text.starts_with("data: event 0 ") && text.contains("data: event 39 "),
        "{text}"
    );
    let (s, h, b) = via(&node, "zip.test", "GET", "/encoded", &gz, None);
    assert_eq!(s, 200);
    assert_eq!(header(&h, "content-encoding"), Some("gzip"), "{h:?}");
    assert_eq!(b, gzip(&body), "passed as the upstream encoded it, once");
    let (_, h, b) = via(&node, "zip.test", "GET", "/small", &gz, None);
    assert_eq!((header(&h, "content-encoding"), b), (None, vec![b's'; 100]));
    assert!(!vary_lists_accept_encoding(&h), "{h:?}");
    let (_, h, b) = via(&node, "zip.test", "GET", "/png", &gz, None);
    assert_eq!((header(&h, "content-encoding"), b), (None, vec![7u8; 4096]));

    // A deployment with compression off passes the upstream's bytes.
    let (s, h, b) = via(&node, "raw.test", "GET", "/json", &gz, None);
    assert_eq!((s, header(&h, "content-encoding")), (200, None), "{h:?}");
    assert!(!vary_lists_accept_encoding(&h), "{h:?}");
    assert_eq!(header(&h, "etag"), Some("\"e1\""));
    assert_eq!(b, body);

    // Streamed: the first part decodes at the client while the upstream
    // still holds the rest.
    let addr: std::net::SocketAddr = node.addr.parse().unwrap();
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    sock.write_all(
        b"GET /stream HTTP/1.1\r\nhost: zip.test\r\naccept-encoding: gzip\r\nconnection: close\r\n\r\n",
    )
    .unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 << 10];
    // Reads of at most 200 ms each: 15 s in all.
    let mut reads = 0;
    let body_at = loop {
        reads += 1;
        assert!(
            reads < 75,
            "the first part never arrived: {}",
            String::from_utf8_lossy(&raw)
        );
        if let Ok(n) = sock.read(&mut buf) {
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&raw));
            raw.extend_from_slice(&buf[..n]);
        }
        let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let got = gunzip_prefix(&complete_chunks(&raw[end + 4..]));
        if got.len() >= STREAM_FIRST.len() {
            assert_eq!(got, STREAM_FIRST);
            break end + 4;
        }
    };
    let head = String::from_utf8_lossy(&raw[..body_at]).to_ascii_lowercase();
    assert!(head.contains("content-encoding: gzip"), "{head}");
    release.notify_one();
    sock.set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    sock.read_to_end(&mut raw).unwrap();
    let mut whole = STREAM_FIRST.to_vec();
    whole.extend_from_slice(STREAM_LAST);
    assert_eq!(gunzip(&complete_chunks(&raw[body_at..])), whole);
}

/// `compress` is true or false; anything else is 400 `INVALID_UPSTREAM`
/// and nothing is stored.
#[test]
fn bad_compress_values_are_refused_and_store_nothing() {
    let node = proxy_node();
    let key = node.create_namespace("gzipbad");
    for bad in [
        serde_json::json!("yes"),
        serde_json::json!(1),
        serde_json::json!({"level": 9}),
    ] {
        let (s, v) = deploy_json(
            &node,
            &key,
            serde_json::json!({"name": "z", "hosts": ["gzbad.test"],
                "upstream": {"instances": ["http://127.0.0.1:9"], "compress": bad}}),
        );
        assert_eq!(s, 400, "{bad}: {v}");
        assert_eq!(v["error"]["code"], "INVALID_UPSTREAM", "{bad}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("compress"),
            "{v}"
        );
    }
    let (s, _) = node.with_key(&key, "GET", "/v1/deployments/z", None);
    assert_eq!(s, 404);
    let (_, b) = node.with_key(&key, "GET", "/v1/deployments", None);
    assert_eq!(json(&b)["deployments"].as_array().unwrap().len(), 0);
    let (s, _, _) = via(&node, "gzbad.test", "GET", "/", &[], None);
    assert_eq!(s, 404);
}
