//! WebSocket upgrades off the HTTP/1 dispatcher (src/http/upgrade.rs,
//! docs/decisions.md "Sockets off the HTTP/1 dispatcher"): a request with
//! `Upgrade: websocket` still goes through the whole chain; frames sent with
//! the handshake are kept; anything but a `101` is answered whole and the
//! connection closed; the same over TLS.

use crate::common::*;
use crate::pubsub::parse_frame;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A handshake for `path` on `host`, with any extra header lines.
fn handshake(path: &str, host: &str, extra: &str) -> String {
    format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
    )
}

/// A client's (masked) text frame.
fn text_frame(s: &str) -> Vec<u8> {
    let p = s.as_bytes();
    assert!(p.len() < 126);
    let mask = [0x11u8, 0x22, 0x33, 0x44];
    let mut f = vec![0x81, 0x80 | p.len() as u8];
    f.extend_from_slice(&mask);
    f.extend(p.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

/// Splits `buf` at the end of an HTTP head: (head, the rest).
fn split_head(buf: &[u8]) -> Option<(String, Vec<u8>)> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    Some((
        String::from_utf8_lossy(&buf[..end]).into_owned(),
        buf[end..].to_vec(),
    ))
}

/// A header's value in a head (case-insensitive name).
fn head_value<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Everything the node sends until it closes the connection.
fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut all = Vec::new();
    s.read_to_end(&mut all)
        .expect("the node closes the connection after answering");
    all
}

/// Text frames read from `s` (after `rest`) until `n` are in.
fn read_texts(s: &mut TcpStream, mut rest: Vec<u8>, n: usize) -> Vec<serde_json::Value> {
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut out = Vec::new();
    let mut chunk = [0u8; 4096];
    while out.len() < n {
        while let Some((op, payload, used)) = parse_frame(&rest) {
            rest.drain(..used);
            match op {
                0x1 => out.push(json(&String::from_utf8_lossy(&payload))),
                0x8 => panic!("closed: {payload:?}"),
                _ => {}
            }
        }
        if out.len() >= n {
            break;
        }
        let k = s.read(&mut chunk).expect("frame in time");
        assert!(k > 0, "closed after {} frames", out.len());
        rest.extend_from_slice(&chunk[..k]);
    }
    out
}

/// Frames written in the same write as the handshake are not lost: the
/// bytes read with the head are the socket's first; the subscription then
/// gets a publication made over HTTP.
#[test]
fn frames_sent_with_the_handshake_are_kept() {
    let node = TestNode::start();
    let key = node.create_namespace("upfirst");
    let mut s = TcpStream::connect(&node.addr).unwrap();
    let mut out = handshake(&format!("/v1/ws?token={key}"), &node.addr, "").into_bytes();
    out.extend(text_frame(r#"{"id":1,"type":"ping"}"#));
    out.extend(text_frame(r#"{"id":2,"type":"subscribe","topic":"first"}"#));
    s.write_all(&out).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let (head, rest) = loop {
        let k = s.read(&mut chunk).unwrap();
        assert!(k > 0, "closed during the handshake");
        buf.extend_from_slice(&chunk[..k]);
        if let Some(split) = split_head(&buf) {
            break split;
        }
    };
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert_eq!(head_value(&head, "upgrade"), Some("websocket"), "{head}");
    let answers = read_texts(&mut s, rest, 2);
    assert_eq!(answers[0]["id"], 1, "{answers:?}");
    assert_eq!(answers[0]["ok"], true, "{answers:?}");
    assert_eq!(answers[1]["id"], 2, "{answers:?}");
    assert_eq!(answers[1]["ok"], true, "{answers:?}");
    let (st, b) = node.with_key(
        &key,
        "POST",
        "/v1/pubsub/publish",
        Some(br#"{"topic":"first","data_base64":"aGk="}"#),
    );
    assert_eq!(st, 200, "{b}");
    let got = read_texts(&mut s, Vec::new(), 1);
    assert_eq!(got[0]["topic"], "first", "{got:?}");
    assert_eq!(got[0]["data_base64"], "aGk=", "{got:?}");
}

/// An upgrade the chain refuses (no credential) gets its JSON envelope
/// whole, framed by its length, says `Connection: close`, and the node
/// closes the connection.
#[test]
fn an_upgrade_the_chain_refuses_is_answered_whole_then_closed() {
    let node = TestNode::start();
    let mut s = TcpStream::connect(&node.addr).unwrap();
    s.write_all(handshake("/v1/ws", &node.addr, "").as_bytes())
        .unwrap();
    let all = read_to_close(&mut s);
    let (head, body) = split_head(&all).expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 401"), "{head}");
    assert_eq!(head_value(&head, "connection"), Some("close"), "{head}");
    let len: usize = head_value(&head, "content-length")
        .expect("framed by its length")
        .parse()
        .unwrap();
    assert_eq!(body.len(), len, "{head}");
    let v = json(&String::from_utf8_lossy(&body));
    assert!(v["error"]["code"].is_string(), "{v}");
}

/// `Upgrade: websocket` on a route that is no socket (a KV read of 200 KB)
/// is answered as without it: status, the whole body, then a close.
#[test]
fn an_upgrade_on_a_route_that_is_no_socket_is_answered_in_full() {
    let node = TestNode::start();
    let key = node.create_namespace("upplain");
    let value: Vec<u8> = (0..200_000u32).map(|i| b'a' + (i % 26) as u8).collect();
    let (st, b) = node.with_key(&key, "PUT", "/v1/kv/big", Some(&value));
    assert!(st == 200 || st == 201 || st == 204, "{st} {b}");
    let mut s = TcpStream::connect(&node.addr).unwrap();
    let auth = format!("Authorization: Bearer {key}\r\n");
    s.write_all(handshake("/v1/kv/big", &node.addr, &auth).as_bytes())
        .unwrap();
    let all = read_to_close(&mut s);
    let (head, body) = split_head(&all).expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(head_value(&head, "connection"), Some("close"), "{head}");
    let body = if head_value(&head, "transfer-encoding") == Some("chunked") {
        dechunk(&body)
    } else {
        body
    };
    assert_eq!(body.len(), value.len(), "{head}");
    assert!(body == value, "the body differs");
}

/// A chunked body, decoded.
fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n").expect("chunk size");
        let n = usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap().trim(), 16).unwrap();
        b = &b[eol + 2..];
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&b[..n]);
        b = &b[n + 2..];
    }
}

/// Over TLS: the handshake, a frame sent with it, and a publication, on a
/// node with a certificate (the upgrade service of the TLS listener).
#[actix_rt::test]
async fn an_upgrade_over_tls_carries_frames_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["up.test".to_string()]).unwrap();
    std::fs::write(dir.path().join("cert.pem"), cert.cert.pem()).unwrap();
    std::fs::write(dir.path().join("key.pem"), cert.key_pair.serialize_pem()).unwrap();
    let node = TestNode::start_tls(dir.path(), "");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
    let name = rustls_pki_types::ServerName::try_from("up.test").unwrap();
    let connect = || async {
        let tcp = tokio::net::TcpStream::connect(&node.addr).await.unwrap();
        connector.connect(name.clone(), tcp).await
    };
    // The TLS node answers once it listens; the namespace is made over TLS.
    let mut tls = None;
    for _ in 0..300 {
        if let Ok(t) = connect().await {
            tls = Some(t);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut t = tls.expect("the TLS node listens");
    let create = br#"{"name":"uptls"}"#;
    let req = format!(
        "POST /v1/namespaces HTTP/1.1\r\nHost: up.test\r\nAuthorization: Bearer {OPERATOR_KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        create.len()
    );
    t.write_all(req.as_bytes()).await.unwrap();
    t.write_all(create).await.unwrap();
    let mut all = Vec::new();
    t.read_to_end(&mut all).await.unwrap();
    let (head, body) = split_head(&all).unwrap();
    assert!(head.starts_with("HTTP/1.1 201"), "{head}");
    let body = if head_value(&head, "transfer-encoding") == Some("chunked") {
        dechunk(&body)
    } else {
        body
    };
    let key = json(&String::from_utf8_lossy(&body))["api_key"]
        .as_str()
        .unwrap()
        .to_string();

    let mut t = connect().await.unwrap();
    let mut out = handshake(&format!("/v1/ws?token={key}"), "up.test", "").into_bytes();
    out.extend(text_frame(r#"{"id":7,"type":"subscribe","topic":"tls"}"#));
    t.write_all(&out).await.unwrap();
    out = text_frame(r#"{"id":8,"type":"publish","topic":"tls","data_base64":"b2s="}"#);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let mut sent_publish = false;
    let mut texts = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while texts.len() < 3 {
        if !sent_publish && split_head(&buf).is_some() {
            // After the subscription's answer: the publication.
            if texts.iter().any(|v: &serde_json::Value| v["id"] == 7) {
                t.write_all(&out).await.unwrap();
                sent_publish = true;
            }
        }
        let k = tokio::time::timeout_at(deadline, t.read(&mut chunk))
            .await
            .expect("frames in time")
            .unwrap();
        assert!(k > 0, "closed: {texts:?}");
        buf.extend_from_slice(&chunk[..k]);
        if let Some((head, mut rest)) = split_head(&buf) {
            assert!(head.starts_with("HTTP/1.1 101"), "{head}");
            texts.clear();
            while let Some((op, payload, used)) = parse_frame(&rest) {
                rest.drain(..used);
                if op == 0x1 {
                    texts.push(json(&String::from_utf8_lossy(&payload)));
                }
            }
        }
    }
    assert_eq!(texts[0]["id"], 7, "{texts:?}");
    assert!(
        texts[1..].iter().any(|v| v["id"] == 8 && v["ok"] == true),
        "{texts:?}"
    );
    assert!(
        texts[1..]
            .iter()
            .any(|v| v["topic"] == "tls" && v["data_base64"] == "b2s="),
        "{texts:?}"
    );
}

/// The node's open file descriptors.
fn open_fds(node: &TestNode) -> usize {
    let pid = node.child.as_ref().expect("a node process").id();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the node's fds")
        .count()
}

/// Subscribers that never read again (their receive window shut) are let
/// go: each is closed as a slow consumer or for its missed pongs, and the
/// write stuck on its full socket gives up after two ping intervals, so the
/// node closes the connections while the peers still hold them open.
#[actix_rt::test]
async fn peers_that_stop_reading_are_let_go() {
    let node = TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}[pubsub]\nping_interval_seconds = 1\noutbound_queue_messages = 64\noutbound_queue_bytes = 65536\n"
        ),
        ..Default::default()
    });
    let key = node.create_namespace("upstall");
    // The least over a second: a connection of the call above may still be
    // closing.
    let mut baseline = open_fds(&node);
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        baseline = baseline.min(open_fds(&node));
    }
    let addr: std::net::SocketAddr = node.addr.parse().unwrap();
    let mut peers = Vec::new();
    for _ in 0..5 {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        let mut s = sock.connect(addr).await.unwrap();
        let path = format!("/v1/pubsub/ws?topic=t&format=binary&token={key}");
        s.write_all(handshake(&path, &node.addr, "").as_bytes())
            .await
            .unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 1024];
        while split_head(&buf).is_none() {
            let k = s.read(&mut chunk).await.unwrap();
            assert!(k > 0, "closed during the handshake");
            buf.extend_from_slice(&chunk[..k]);
        }
        assert!(buf.starts_with(b"HTTP/1.1 101"));
        peers.push(s);
    }
    assert!(open_fds(&node) >= baseline + 5, "the five sockets are open");
    // More than the kernel's buffers hold for each peer.
    let c = awc::Client::builder()
        .timeout(Duration::from_secs(30))
        .finish();
    let payload = vec![b'x'; 32 * 1024];
    for _ in 0..250 {
        assert_eq!(
            crate::pubsub::http_publish(&c, &node, &key, "t", &payload).await,
            200
        );
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while open_fds(&node) > baseline {
        assert!(
            std::time::Instant::now() < deadline,
            "the node still holds {} fds more than before the sockets (peers not reading)",
            open_fds(&node) - baseline
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(peers);
}
