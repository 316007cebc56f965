//! Client → node boundary: bad input stays solid. Oversized keys, bodies and
//! headers, malformed JSON and multipart, request smuggling, garbage on the
//! socket, and generated inputs by the thousand through the running node:
//! every answer is a 4xx (or a closed connection), nothing is stored, the
//! node keeps serving and another tenant's data is untouched. See
//! docs/security.md.

use crate::common::{TestNode, http, json};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Writes `bytes` on a fresh connection, closes its sending half (so the node
/// has read everything there is), and reads until the node closes the
/// connection: every answer the bytes got is then in hand, none can come
/// later. Returns everything read, as text.
fn raw(n: &TestNode, bytes: &[u8]) -> String {
    raw_until_closed(n, bytes, true)
}

/// The same; with `half_close` false the connection stays open on the
/// client's side, so only the node can end it.
fn raw_until_closed(n: &TestNode, bytes: &[u8], half_close: bool) -> String {
    let mut s = TcpStream::connect(&n.addr).expect("connect");
    // The node may close before everything is written: that is an answer too.
    let _ = s.write_all(bytes);
    let _ = s.flush();
    if half_close {
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
    let end = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "the node kept the connection open after the client's end: {:?}",
            String::from_utf8_lossy(&out)
        );
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => out.extend_from_slice(&buf[..k]),
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            // A reset is the node closing too.
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The status codes of every response in `text`, in order.
fn statuses(text: &str) -> Vec<u16> {
    text.match_indices("HTTP/1.1 ")
        .filter_map(|(i, _)| text.get(i + 9..i + 12)?.parse().ok())
        .collect()
}

/// A tenant whose data must survive everything the attacker tries.
struct Bystander {
    key: String,
}

impl Bystander {
    fn new(n: &TestNode) -> Bystander {
        let key = n.create_namespace("bystander");
        assert_eq!(
            n.with_key(&key, "PUT", "/v1/kv/precious", Some(b"gold")).0,
            200
        );
        Bystander { key }
    }

    /// The node still serves, and the bystander's value is whole.
    fn check(&self, n: &TestNode) {
        let (s, _, _) = http("GET", &n.url("/livez"), &[], None);
        assert_eq!(s, 200, "the node is alive");
        let (s, v) = n.with_key(&self.key, "GET", "/v1/kv/precious", None);
        assert_eq!((s, v.as_str()), (200, "gold"), "the bystander's data");
    }
}

/// Content-Length and Transfer-Encoding together (CL.TE and TE.CL): refused
/// with 400 and the connection closed, so nothing smuggled behind the body is
/// ever read as a second request.
#[test]
fn request_smuggling_cl_te_is_refused() {
    let n = TestNode::start();
    let by = Bystander::new(&n);
    let key = n.create_namespace("attacker");
    let smuggled = format!(
        "PUT /v1/kv/smuggled HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ncontent-length: 3\r\n\r\nbad"
    );
    let cases = [
        // CL.TE: a front end reading Content-Length forwards the smuggled request.
        format!(
            "PUT /v1/kv/a HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ncontent-length: 6\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n{smuggled}"
        ),
        // TE.CL with an obfuscated Transfer-Encoding.
        format!(
            "PUT /v1/kv/a HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ntransfer-encoding: xchunked\r\ncontent-length: 4\r\n\r\n5c\r\n{smuggled}\r\n0\r\n\r\n"
        ),
        // Two Content-Lengths that disagree.
        format!(
            "PUT /v1/kv/a HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ncontent-length: 3\r\ncontent-length: 120\r\n\r\nabc{smuggled}"
        ),
    ];
    for (i, c) in cases.iter().enumerate() {
        // The client keeps its side open (an end of input could stop the
        // node before a smuggled request): the node answers the framing
        // error and closes, and everything it answered is read by then.
        let got = raw_until_closed(&n, c.as_bytes(), false);
        let codes = statuses(&got);
        assert_eq!(codes.len(), 1, "case {i}: exactly one answer, got {got:?}");
        assert!(
            (400..500).contains(&codes[0]),
            "case {i}: a 4xx, got {got:?}"
        );
    }
    let (s, _) = n.with_key(&key, "GET", "/v1/kv/smuggled", None);
    assert_eq!(s, 404, "the smuggled request never ran");
    let (s, _) = n.with_key(&key, "GET", "/v1/kv/a", None);
    assert_eq!(s, 404, "the refused request stored nothing");
    by.check(&n);
}

/// Headers over the node's limit (one huge header, thousands of small ones):
/// a 4xx, the node unharmed.
#[test]
fn oversized_headers_are_refused() {
    let n = TestNode::start();
    let by = Bystander::new(&n);
    let big = format!(
        "GET /v1/health HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
        "a".repeat(128 * 1024)
    );
    let mut many = String::from("GET /v1/health HTTP/1.1\r\nhost: x\r\n");
    for i in 0..5000 {
        many.push_str(&format!("x-h{i}: v\r\n"));
    }
    many.push_str("\r\n");
    for (name, req) in [("one huge header", big), ("5,000 headers", many)] {
        let got = raw(&n, req.as_bytes());
        let codes = statuses(&got);
        assert!(
            codes.is_empty() || codes.iter().all(|c| (400..500).contains(c)),
            "{name}: {got:?}"
        );
    }
    by.check(&n);
}

/// A body over `server.max_body_bytes` gets 413 and stores nothing; a key over
/// 1 KiB gets 400 `KEY_TOO_LONG` on every verb.
#[test]
fn oversized_bodies_and_keys_are_refused() {
    let n = TestNode::start();
    let by = Bystander::new(&n);
    let key = n.create_namespace("attacker");
    let body = vec![b'x'; (1 << 20) + 1];
    let (s, text) = n.with_key(&key, "PUT", "/v1/kv/big", Some(&body));
    assert_eq!(s, 413, "{text}");
    assert_eq!(json(&text)["error"]["code"], "PAYLOAD_TOO_LARGE");
    assert_eq!(n.with_key(&key, "GET", "/v1/kv/big", None).0, 404);
    let long = format!("/v1/kv/{}", "k".repeat(1025));
    for method in ["PUT", "GET", "DELETE"] {
        let (s, text) = n.with_key(&key, method, &long, Some(b"v"));
        assert_eq!(s, 400, "{method}: {text}");
        assert_eq!(json(&text)["error"]["code"], "KEY_TOO_LONG");
    }
    let (s, text) = n.with_key(&key, "GET", "/v1/kv", None);
    assert_eq!(s, 200);
    assert_eq!(
        json(&text)["keys"].as_array().map(Vec::len),
        Some(0),
        "{text}"
    );
    by.check(&n);
}

/// Malformed JSON on every JSON route: 400 in the envelope, nothing created.
#[test]
fn malformed_json_is_refused_and_stores_nothing() {
    let n = TestNode::start();
    let by = Bystander::new(&n);
    let key = n.create_namespace("attacker");
    let bodies: [&[u8]; 7] = [
        b"{",
        b"[]",
        b"null",
        b"{\"name\": 5}",
        b"{\"name\": \"x\"} trailing",
        b"\xff\xfe\x00{}",
        b"{\"name\": [\"a\"], \"hosts\": \"not-a-list\"}",
    ];
    for body in bodies {
        for (route, cred) in [
            ("/v1/namespaces", None),
            ("/v1/deployments", Some(&key)),
            ("/v1/auth/token", None),
            ("/v1/auth/api-keys", Some(&key)),
            ("/v1/pubsub/publish", Some(&key)),
        ] {
            let (s, text) = match cred {
                Some(k) => n.with_key(k, "POST", route, Some(body)),
                None => n.op("POST", route, Some(&String::from_utf8_lossy(body))),
            };
            assert!(
                (400..500).contains(&s),
                "{route} {:?}: {s} {text}",
                String::from_utf8_lossy(body)
            );
            let v = json(&text);
            assert_eq!(v["ok"], false, "{route}: {text}");
            assert!(v["error"]["code"].is_string(), "{route}: {text}");
        }
    }
    let (_, list) = n.op("GET", "/v1/namespaces", None);
    let names: Vec<String> = json(&list)["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(names.len(), 2, "only the two namespaces: {list}");
    let (_, deps) = n.with_key(&key, "GET", "/v1/deployments", None);
    assert_eq!(
        json(&deps)["deployments"].as_array().map(Vec::len),
        Some(0),
        "{deps}"
    );
    by.check(&n);
}

const BOUNDARY: &str = "mgsecboundary42";

fn multipart(parts: &[(&str, &[u8])]) -> Vec<u8> {
    let mut body = Vec::new();
    for (name, data) in parts {
        body.extend_from_slice(
            format!(
                "--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\ncontent-type: application/octet-stream\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    body
}

fn post_multipart(n: &TestNode, key: &str, route: &str, ct: &str, body: &[u8]) -> (u16, String) {
    let auth = format!("Bearer {key}");
    let (s, _, b) = http(
        "POST",
        &n.url(route),
        &[("authorization", &auth), ("content-type", ct)],
        Some(body),
    );
    (s, String::from_utf8_lossy(&b).into_owned())
}

/// Malformed multipart to the function and site deploys: 400 with a code a
/// person can read, and neither a function nor a deployment appears.
#[test]
fn malformed_multipart_is_refused_and_stores_nothing() {
    let n = TestNode::start();
    let by = Bystander::new(&n);
    let key = n.create_namespace("attacker");
    let ct = format!("multipart/form-data; boundary={BOUNDARY}");
    let good_fn = multipart(&[("name", b"f"), ("wasm", b"(module)")]);
    let truncated = &good_fn[..good_fn.len() / 2];
    let cases: Vec<(&str, String, Vec<u8>)> = vec![
        (
            "raw body",
            "application/octet-stream".into(),
            b"\0asm\x01\0\0\0".to_vec(),
        ),
        ("no boundary", "multipart/form-data".into(), good_fn.clone()),
        (
            "wrong boundary",
            "multipart/form-data; boundary=other".into(),
            good_fn.clone(),
        ),
        ("truncated", ct.clone(), truncated.to_vec()),
        (
            "no parts",
            ct.clone(),
            format!("--{BOUNDARY}--\r\n").into_bytes(),
        ),
        (
            "unknown part",
            ct.clone(),
            multipart(&[("name", b"f"), ("evil", b"x")]),
        ),
        (
            "not wasm",
            ct.clone(),
            multipart(&[("name", b"f"), ("wasm", b"hello there")]),
        ),
        (
            "bad name",
            ct.clone(),
            multipart(&[("name", b"../../etc"), ("wasm", b"(module)")]),
        ),
        (
            "garbage",
            ct.clone(),
            b"\r\n--\r\n\x00\xff--mgsecboundary42\r\n\r\n".to_vec(),
        ),
    ];
    for (name, ctype, body) in &cases {
        for route in ["/v1/functions", "/v1/deployments"] {
            let (s, text) = post_multipart(&n, &key, route, ctype, body);
            assert!((400..500).contains(&s), "{route} {name}: {s} {text}");
            let v = json(&text);
            let code = v["error"]["code"].as_str().unwrap_or_default().to_string();
            assert!(!code.is_empty(), "{route} {name}: {text}");
        }
    }
    let (_, fns) = n.with_key(&key, "GET", "/v1/functions", None);
    assert_eq!(
        json(&fns)["functions"].as_array().map(Vec::len),
        Some(0),
        "{fns}"
    );
    let (_, deps) = n.with_key(&key, "GET", "/v1/deployments", None);
    assert_eq!(
        json(&deps)["deployments"].as_array().map(Vec::len),
        Some(0),
        "{deps}"
    );
    by.check(&n);
}

/// Garbage on the socket instead of HTTP: a 400 or a closed connection, never
/// a hang or a crash; the node keeps serving.
#[test]
fn garbage_on_the_socket_is_answered_and_forgotten() {
    let n = TestNode::start();
    let by = Bystander::new(&n);
    let mut runner = TestRunner::new(Config {
        cases: 300,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = prop_oneof![
        proptest::collection::vec(any::<u8>(), 1..2048),
        // Request-line shaped garbage.
        "[A-Z]{1,8} [ -~]{0,64} HTTP/[0-9]\\.[0-9]\r\n([ -~]{0,32}\r\n){0,4}\r\n"
            .prop_map(String::into_bytes),
    ];
    runner
        .run(&strategy, |bytes| {
            let got = raw(&n, &bytes);
            for code in statuses(&got) {
                if code >= 500 {
                    return Err(TestCaseError::fail(format!(
                        "{code} for {bytes:?}: {got:?}"
                    )));
                }
            }
            Ok(())
        })
        .unwrap();
    by.check(&n);
}

/// A small valid gzip tarball (one index.html), for mutation.
fn site_tarball() -> Vec<u8> {
    let mut tar = tar::Builder::new(Vec::new());
    let data = b"<h1>hi</h1>";
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    tar.append_data(&mut h, "index.html", &data[..]).unwrap();
    let raw = tar.into_inner().unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&raw).unwrap();
    gz.finish().unwrap()
}

/// Generated deploys through the running node: function modules of random
/// bytes or mutated WAT, site tarballs of random bytes or a valid tarball with
/// bytes flipped, under random part names. Every answer is < 500; a module or
/// tarball that is not valid is never stored.
#[test]
fn generated_deploys_never_break_the_node() {
    let n = TestNode::start();
    let by = Bystander::new(&n);
    let key = n.create_namespace("fuzz");
    let ct = format!("multipart/form-data; boundary={BOUNDARY}");
    let tarball = site_tarball();
    let mut runner = TestRunner::new(Config {
        cases: 1500,
        failure_persistence: None,
        ..Config::default()
    });
    let module = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..512),
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(|mut b| {
            let mut m = b"\0asm\x01\0\0\0".to_vec();
            m.append(&mut b);
            m
        }),
        "\\(module[ ()a-z0-9\"$.]{0,64}".prop_map(String::into_bytes),
    ];
    let flips = proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4);
    let site = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..512),
        flips.prop_map(move |fl| {
            let mut t = tarball.clone();
            for (i, b) in fl {
                let at = i.index(t.len());
                t[at] ^= b | 1;
            }
            t
        }),
    ];
    let part = prop_oneof![
        Just("name".to_string()),
        Just("wasm".to_string()),
        Just("tarball".to_string()),
        Just("hosts".to_string()),
        "[a-z_]{1,12}",
    ];
    let case = (module, site, part, "[a-z0-9.-]{0,20}");
    runner
        .run(&case, |(module, site, extra, name)| {
            let f = multipart(&[
                ("name", b"fz"),
                ("wasm", &module),
                (&extra, name.as_bytes()),
            ]);
            let (s, text) = post_multipart(&n, &key, "/v1/functions", &ct, &f);
            if s >= 500 || s == 0 {
                return Err(TestCaseError::fail(format!("function deploy {s}: {text}")));
            }
            let d = multipart(&[
                ("name", b"site"),
                ("hosts", format!("{name}.fuzz.test").as_bytes()),
                ("tarball", &site),
            ]);
            let (s, text) = post_multipart(&n, &key, "/v1/deployments", &ct, &d);
            if s >= 500 || s == 0 {
                return Err(TestCaseError::fail(format!("site deploy {s}: {text}")));
            }
            Ok(())
        })
        .unwrap();
    // Whatever was refused left nothing: every stored function is a module the
    // node compiled, and it answers for each.
    let (_, fns) = n.with_key(&key, "GET", "/v1/functions", None);
    for f in json(&fns)["functions"].as_array().unwrap() {
        let name = f["name"].as_str().unwrap();
        let (s, text) = n.with_key(&key, "GET", &format!("/v1/functions/{name}"), None);
        assert_eq!(s, 200, "{name}: {text}");
    }
    by.check(&n);
}

/// Generated JSON bodies against the JSON routes: never a 5xx, always the
/// envelope on a refusal.
#[test]
fn generated_json_never_breaks_the_node() {
    let n = TestNode::start();
    let by = Bystander::new(&n);
    let key = n.create_namespace("fuzz");
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        "[ -~]{0,24}".prop_map(serde_json::Value::from),
    ];
    let value = leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("name".to_string()),
                    Just("topic".to_string()),
                    Just("data".to_string()),
                    Just("data_base64".to_string()),
                    Just("hosts".to_string()),
                    Just("upstream".to_string()),
                    Just("instances".to_string()),
                    Just("routes".to_string()),
                    Just("role".to_string()),
                    Just("grants".to_string()),
                    Just("api_key".to_string()),
                    Just("refresh_token".to_string()),
                    "[a-z_]{1,10}",
                ],
                inner,
                0..5,
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    });
    let routes = prop::sample::select(vec![
        "/v1/deployments",
        "/v1/pubsub/publish",
        "/v1/pubsub/publish-batch",
        "/v1/auth/api-keys",
        "/v1/auth/token",
        "/v1/auth/refresh",
        "/v1/auth/challenge",
        "/v1/auth/verify",
    ]);
    let mut runner = TestRunner::new(Config {
        cases: 2000,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&(routes, value), |(route, v)| {
            let body = v.to_string();
            let (s, text) = n.with_key(&key, "POST", route, Some(body.as_bytes()));
            if s >= 500 || s == 0 {
                return Err(TestCaseError::fail(format!("{route} {body}: {s} {text}")));
            }
            if s >= 400 && !text.contains("\"error\"") {
                return Err(TestCaseError::fail(format!(
                    "{route} {body}: no envelope: {text}"
                )));
            }
            Ok(())
        })
        .unwrap();
    by.check(&n);
}

/// Upgrades a WebSocket on `/v1/pubsub/ws` and returns the raw stream.
fn ws_open(n: &TestNode, key: &str) -> TcpStream {
    let mut s = TcpStream::connect(&n.addr).unwrap();
    let req = format!(
        "GET /v1/pubsub/ws?topic=t HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\nauthorization: Bearer {key}\r\n\r\n"
    );
    s.write_all(req.as_bytes()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut b).expect("handshake");
        head.push(b[0]);
    }
    let text = String::from_utf8_lossy(&head);
    assert!(text.starts_with("HTTP/1.1 101"), "{text}");
    s
}

/// A masked client frame of any opcode (including reserved ones), with the
/// header's flags as generated.
fn ws_frame(first: u8, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
    let mut f = vec![first];
    match payload.len() {
        l if l < 126 => f.push(0x80 | l as u8),
        l if l <= 0xffff => {
            f.push(0x80 | 126);
            f.extend_from_slice(&(l as u16).to_be_bytes());
        }
        l => {
            f.push(0x80 | 127);
            f.extend_from_slice(&(l as u64).to_be_bytes());
        }
    }
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

/// Generated WebSocket frames (any opcode and flag, text that is not JSON or
/// not UTF-8, JSON of the wrong shape, raw bytes that are no frame at all):
/// the socket answers with error frames or closes, and the node keeps serving
/// subscribers.
#[test]
fn generated_websocket_frames_never_break_the_node() {
    let n = TestNode::start();
    let by = Bystander::new(&n);
    let key = n.create_namespace("fuzz");
    let payload = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..300),
        "\\{\"(op|type|topic|id|data)\": ?[ -~]{0,40}\\}".prop_map(String::into_bytes),
    ];
    let frame = prop_oneof![
        (any::<u8>(), payload.clone(), any::<[u8; 4]>())
            .prop_map(|(first, p, m)| ws_frame(first, &p, m)),
        (payload, any::<[u8; 4]>()).prop_map(|(p, m)| ws_frame(0x81, &p, m)),
        proptest::collection::vec(any::<u8>(), 1..64),
    ];
    let mut runner = TestRunner::new(Config {
        cases: 1000,
        failure_persistence: None,
        ..Config::default()
    });
    // Several frames share a socket until the node closes it.
    let sock: std::cell::RefCell<Option<TcpStream>> = std::cell::RefCell::new(None);
    runner
        .run(&frame, |bytes| {
            let mut slot = sock.borrow_mut();
            let s = slot.get_or_insert_with(|| ws_open(&n, &key));
            if s.write_all(&bytes).is_err() {
                *slot = None;
                return Ok(());
            }
            s.set_read_timeout(Some(Duration::from_millis(5))).unwrap();
            let mut buf = [0u8; 4096];
            match s.read(&mut buf) {
                Ok(0) => *slot = None,
                Ok(_) => {}
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(_) => *slot = None,
            }
            Ok(())
        })
        .unwrap();
    drop(sock);
    // A fresh subscriber still gets a published message.
    let mut s = ws_open(&n, &key);
    let (st, text) = n.with_key(
        &key,
        "POST",
        "/v1/pubsub/publish",
        Some(br#"{"topic":"t","data_base64":"YWZ0ZXIgdGhlIHN0b3Jt"}"#),
    );
    assert_eq!(st, 200, "{text}");
    let mut got = Vec::new();
    let end = Instant::now() + Duration::from_secs(5);
    let mut buf = [0u8; 4096];
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    while Instant::now() < end && !String::from_utf8_lossy(&got).contains("YWZ0ZXIgdGhlIHN0b3Jt") {
        if let Ok(k) = s.read(&mut buf) {
            got.extend_from_slice(&buf[..k]);
        }
    }
    assert!(
        String::from_utf8_lossy(&got).contains("YWZ0ZXIgdGhlIHN0b3Jt"),
        "a new subscriber is served: {:?}",
        String::from_utf8_lossy(&got)
    );
    by.check(&n);
}
