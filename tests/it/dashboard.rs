//! The `/__admin` dashboard: access rules, sessions, the JSON API against
//! `/metrics`, the event stream, and the browser test.

use crate::common::{
    NodeOpts, OPERATOR_AUTH, OPERATOR_KEY, TEST_CONFIG, TestNode, header, http, json, wait_until,
};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// A node that believes `X-Forwarded-For` from 127.0.0.1, so a test can be "another client".
fn behind_proxy() -> TestNode {
    TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}trusted_proxies = [\"127.0.0.1\"]\n"),
        ..Default::default()
    })
}

const REMOTE: (&str, &str) = ("x-forwarded-for", "203.0.113.9");

fn get(n: &TestNode, path: &str, headers: &[(&str, &str)]) -> (u16, Vec<(String, String)>, String) {
    let (s, h, b) = http("GET", &n.url(path), headers, None);
    (s, h, String::from_utf8_lossy(&b).into_owned())
}

/// A dashboard GET with the operator key (loopback is no credential).
fn admin(n: &TestNode, path: &str) -> (u16, Vec<(String, String)>, String) {
    get(
        n,
        path,
        &[("authorization", &format!("Bearer {OPERATOR_KEY}"))],
    )
}

const ROUTES: &[&str] = &[
    "/__admin",
    "/__admin/assets/app.js",
    "/__admin/assets/app.css",
    "/__admin/api/snapshot",
    "/__admin/api/node",
    "/__admin/api/actors",
    "/__admin/api/namespaces",
    "/__admin/api/namespaces/search?q=ten",
    "/__admin/api/history",
    "/__admin/api/stream",
];

/// A non-loopback client without the operator key gets 401 on every dashboard
/// route, the stream and the assets included; with the key it gets 200, and with a
/// namespace's key 403.
#[test]
fn non_loopback_needs_the_operator_key() {
    let n = behind_proxy();
    let ns_key = n.create_namespace("tenant");
    let op = format!("Bearer {OPERATOR_KEY}");
    let tenant = format!("Bearer {ns_key}");
    for route in ROUTES {
        // The stream never ends on its own: only ask for the head of it.
        let (status, _, body) = if *route == "/__admin/api/stream" {
            let (s, h, _) = stream_until(&n, route, &[REMOTE], head_read);
            (s, h, String::new())
        } else {
            get(&n, route, &[REMOTE])
        };
        assert_eq!(status, 401, "{route} without a key: {body}");
        if *route != "/__admin/api/stream" {
            assert_eq!(json(&body)["error"]["code"], "MISSING_CREDENTIAL");
        }
        let with_key = if *route == "/__admin/api/stream" {
            stream_until(&n, route, &[REMOTE, ("authorization", &op)], head_read).0
        } else {
            get(&n, route, &[REMOTE, ("authorization", &op)]).0
        };
        assert_eq!(with_key, 200, "{route} with the operator key");
        if *route != "/__admin/api/stream" {
            let (s, _, _) = get(&n, route, &[REMOTE, ("authorization", &tenant)]);
            assert_eq!(s, 403, "{route} with a namespace key");
        }
    }
    // Loopback is no credential: every proxied request comes from it.
    assert_eq!(get(&n, "/__admin/api/node", &[]).0, 401);
    // The sign-in page is public: it holds no numbers.
    let (s, _, body) = get(&n, "/__admin/login", &[REMOTE]);
    assert_eq!(s, 200);
    assert!(body.contains("name=\"key\""), "{body}");
}

fn login(n: &TestNode, key: &str) -> (u16, Vec<(String, String)>) {
    let body = format!("key={key}");
    let (s, h, _) = http(
        "POST",
        &n.url("/__admin/login"),
        &[
            REMOTE,
            ("content-type", "application/x-www-form-urlencoded"),
        ],
        Some(body.as_bytes()),
    );
    (s, h)
}

/// Signing in with the operator key gives an HttpOnly SameSite=Strict cookie that
/// opens the dashboard (stream included) for a remote browser, and nothing else; a
/// wrong key, or a forged cookie, opens nothing.
#[test]
fn sign_in_opens_a_dashboard_session() {
    let n = behind_proxy();
    let (s, h) = login(&n, "mgop_wrong");
    assert_eq!(s, 303);
    assert_eq!(header(&h, "location"), Some("/__admin/login?failed=1"));
    assert!(header(&h, "set-cookie").unwrap().contains("Max-Age=0"));

    let (s, h) = login(&n, OPERATOR_KEY);
    assert_eq!(s, 303);
    assert_eq!(header(&h, "location"), Some("/__admin"));
    let set = header(&h, "set-cookie")
        .expect("a session cookie")
        .to_string();
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/__admin", "Max-Age="] {
        assert!(set.contains(attr), "{attr} missing: {set}");
    }
    assert!(
        !set.contains(OPERATOR_KEY),
        "the key must not be in the cookie"
    );
    let cookie = set.split(';').next().unwrap().to_string();
    let (s, _, body) = get(&n, "/__admin/api/node", &[REMOTE, ("cookie", &cookie)]);
    assert_eq!(s, 200, "{body}");
    let (s, _, _) = stream_until(
        &n,
        "/__admin/api/stream",
        &[REMOTE, ("cookie", &cookie)],
        head_read,
    );
    assert_eq!(s, 200);
    // Outside /__admin the cookie is no credential.
    let (s, _, _) = get(&n, "/v1/namespaces", &[REMOTE, ("cookie", &cookie)]);
    assert_eq!(s, 401);
    // A token one digit off, or one of the old `exp.mac` shape, is no
    // session, so the request stays anonymous.
    let token = cookie.trim_start_matches("mg_admin=");
    assert_eq!(token.len(), 64, "a random token: {cookie}");
    let last = if token.ends_with('0') { "1" } else { "0" };
    let forged = format!("mg_admin={}{last}", &token[..63]);
    assert_eq!(
        get(&n, "/__admin/api/node", &[REMOTE, ("cookie", &forged)]).0,
        401
    );
    let old_shape = "mg_admin=1000.00";
    assert_eq!(
        get(&n, "/__admin/api/node", &[REMOTE, ("cookie", old_shape)]).0,
        401
    );
    // Signing out clears the cookie.
    let (s, h, _) = http("POST", &n.url("/__admin/logout"), &[REMOTE], None);
    assert_eq!(s, 303);
    assert!(header(&h, "set-cookie").unwrap().contains("Max-Age=0"));
}

/// An event stream opened with a session cookie ends when that session is
/// signed out: the node ends the body (its last chunk arrives) instead of
/// streaming on.
#[test]
fn sign_out_ends_an_open_stream() {
    let n = behind_proxy();
    let (s, h) = login(&n, OPERATOR_KEY);
    assert_eq!(s, 303);
    let cookie = header(&h, "set-cookie")
        .expect("a session cookie")
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let mut sock = std::net::TcpStream::connect(n.addr.as_str()).unwrap();
    let req = format!(
        "GET /__admin/api/stream HTTP/1.1\r\nhost: {}\r\nconnection: close\r\ncookie: {cookie}\r\n\r\n",
        n.addr
    );
    sock.write_all(req.as_bytes()).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 65536];
    // Bounded: a stream that never ends (the defect) fails the test, not hangs it.
    let mut read_until = |raw: &mut Vec<u8>, done: &dyn Fn(&str) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done(&String::from_utf8_lossy(raw)) && Instant::now() < deadline {
            match sock.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(k) => raw.extend_from_slice(&buf[..k]),
            }
        }
    };
    read_until(&mut raw, &|r| r.contains("event: snapshot"));
    let text = String::from_utf8_lossy(&raw).into_owned();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.contains("event: snapshot"),
        "a frame while signed in: {text}"
    );
    let (s, _, _) = http(
        "POST",
        &n.url("/__admin/logout"),
        &[REMOTE, ("cookie", &cookie)],
        None,
    );
    assert_eq!(s, 303);
    read_until(&mut raw, &|r| r.ends_with("\r\n0\r\n\r\n"));
    assert!(
        raw.ends_with(b"\r\n0\r\n\r\n"),
        "the stream did not end after sign-out: {}",
        String::from_utf8_lossy(&raw[raw.len().saturating_sub(300)..])
    );
}

/// The value of one Prometheus sample in `/metrics` text.
fn prom_value(text: &str, name: &str, labels: &str) -> Option<f64> {
    let prefix = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

/// The page and its assets come from the binary; after traffic the JSON API shows
/// each namespace's actor with the same totals `/metrics` exports, and rates.
#[test]
fn api_numbers_match_metrics() {
    let n = TestNode::start();
    let (s, h, page) = admin(&n, "/__admin");
    assert_eq!(s, 200);
    assert!(header(&h, "content-type").unwrap().starts_with("text/html"));
    let csp = header(&h, "content-security-policy").unwrap();
    assert!(csp.contains("script-src 'self'"), "{csp}");
    assert!(page.contains("/__admin/assets/app.js"));
    assert!(
        !page.contains("http://") && !page.contains("https://"),
        "no off-node assets"
    );
    let (s, _, js) = admin(&n, "/__admin/assets/app.js");
    assert_eq!(s, 200);
    assert!(js.contains("EventSource"));
    assert_eq!(admin(&n, "/__admin/assets/nope.js").0, 404);

    let a = n.create_namespace("alpha");
    let b = n.create_namespace("beta");
    for i in 0..30 {
        let (s, _) = n.with_key(&a, "PUT", &format!("/v1/kv/k{i}"), Some(b"v"));
        assert_eq!(s, 200);
    }
    for i in 0..10 {
        assert_eq!(
            n.with_key(&b, "PUT", &format!("/v1/kv/k{i}"), Some(b"v")).0,
            200
        );
    }
    // While traffic flows the rate is seen; then, quiet, the totals settle.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut saw_rate = false;
    while Instant::now() < deadline && !saw_rate {
        let _ = n.with_key(&a, "GET", "/v1/kv/k1", None);
        let (_, _, body) = admin(&n, "/__admin/api/namespaces");
        saw_rate = json(&body)["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["namespace"] == "alpha" && r["handled_per_sec"].as_f64().unwrap() > 0.0);
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(saw_rate, "alpha never showed a handled/s rate");
    // Quiet: until a tick saw nothing handled since the one before (its
    // totals are the final ones), with three points in the history.
    wait_until(Duration::from_secs(10), "the totals never settled", || {
        let (_, _, body) = admin(&n, "/__admin/api/namespaces");
        let rows = json(&body)["namespaces"].as_array().unwrap().clone();
        let quiet = ["alpha", "beta"].iter().all(|ns| {
            rows.iter()
                .any(|r| r["namespace"] == *ns && r["handled_per_sec"].as_f64() == Some(0.0))
        });
        let (_, _, history) = admin(&n, "/__admin/api/history");
        quiet && json(&history)["points"].as_array().map_or(0, Vec::len) >= 3
    });
    let (_, _, metrics) = admin(&n, "/metrics");
    let (_, _, body) = admin(&n, "/__admin/api/namespaces");
    let rows = json(&body)["namespaces"].as_array().unwrap().clone();
    for ns in ["alpha", "beta"] {
        let row = rows
            .iter()
            .find(|r| r["namespace"] == ns)
            .unwrap_or_else(|| panic!("{ns} missing: {body}"));
        let from_prom = prom_value(
            &metrics,
            "meshgate_actor_messages_handled_total",
            &format!("kind=\"namespace\",namespace=\"{ns}\""),
        )
        .unwrap_or_else(|| panic!("no series for {ns}"));
        assert_eq!(row["handled"].as_f64().unwrap(), from_prom, "{ns}: {row}");
        assert!(row["running"].as_bool().unwrap());
        assert_eq!(row["actors"], 1);
        assert_eq!(row["handled_per_sec"].as_f64().unwrap(), 0.0, "quiet now");
    }
    let (_, _, body) = admin(&n, "/__admin/api/actors");
    let actors = json(&body)["actors"].as_array().unwrap().clone();
    let alpha = actors.iter().find(|a| a["namespace"] == "alpha").unwrap();
    assert_eq!(alpha["kind"], "namespace");
    assert!(alpha["handled"].as_u64().unwrap() >= 31);
    assert!(actors.iter().any(|a| a["kind"] == "node"));
    let (_, _, body) = admin(&n, "/__admin/api/node");
    let node = &json(&body)["node"];
    assert!(node["memory_rss_bytes"].as_u64().unwrap() > 1_000_000);
    assert!(node["http_requests"].as_u64().unwrap() >= 40);
    assert_eq!(node["namespaces_running"], 2);
    let (_, _, body) = admin(&n, "/__admin/api/history");
    let h = json(&body);
    let points = h["points"].as_array().unwrap();
    assert!(points.len() >= 3, "{body}");
    assert!(
        points
            .iter()
            .any(|p| p["ns"]["alpha"][0].as_f64().unwrap_or(0.0) > 0.0)
    );
    assert_eq!(h["capacity"], 600);
}

/// A subscriber on `GET /v1/pubsub/ws?topic=T` over a plain socket: the
/// subscription is live once the 101 is read, and lasts while the socket is held.
fn ws_subscriber(n: &TestNode, key: &str, topic: &str) -> std::net::TcpStream {
    let mut s = std::net::TcpStream::connect(n.addr.as_str()).unwrap();
    let req = format!(
        "GET /v1/pubsub/ws?topic={topic}&token={key} HTTP/1.1\r\nhost: {}\r\nupgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n",
        n.addr
    );
    s.write_all(req.as_bytes()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut b).unwrap(), 1, "closed during the handshake");
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    s
}

/// Pub/sub numbers per namespace: subscribers, topics and publishes in the JSON
/// API equal the `/metrics` series they come from, publishes/s moves while
/// messages flow, and the gauges fall back when the sockets close.
#[test]
fn pubsub_numbers_match_metrics() {
    let n = TestNode::start();
    let a = n.create_namespace("alpha");
    let b = n.create_namespace("beta");
    // alpha: 3 subscribers on 2 topics; beta: 1 on 1.
    let socks = vec![
        ws_subscriber(&n, &a, "t1"),
        ws_subscriber(&n, &a, "t1"),
        ws_subscriber(&n, &a, "t2"),
        ws_subscriber(&n, &b, "t1"),
    ];
    let publish = |key: &str, topic: &str| {
        let body = format!("{{\"topic\":\"{topic}\",\"data_base64\":\"aGk=\"}}");
        let (s, body) = n.with_key(key, "POST", "/v1/pubsub/publish", Some(body.as_bytes()));
        assert_eq!(s, 200, "{body}");
    };
    let row = |ns: &str| -> serde_json::Value {
        let (_, _, body) = admin(&n, "/__admin/api/namespaces");
        json(&body)["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["namespace"] == ns)
            .cloned()
            .unwrap_or_else(|| panic!("{ns} missing: {body}"))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut saw_a, mut saw_b) = (false, false);
    while Instant::now() < deadline && !(saw_a && saw_b) {
        publish(&a, "t1");
        publish(&a, "t2");
        publish(&b, "t1");
        // Before the first tick lists them the rows are missing: keep publishing.
        let (_, _, body) = admin(&n, "/__admin/api/namespaces");
        let moving = |ns: &str| {
            json(&body)["namespaces"]
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r["namespace"] == ns && r["publishes_per_sec"].as_f64().unwrap() > 0.0)
        };
        saw_a |= moving("alpha");
        saw_b |= moving("beta");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        saw_a && saw_b,
        "publishes/s never moved (alpha {saw_a}, beta {saw_b})"
    );
    // Quiet: until a tick saw no publish since the one before (it holds the
    // final totals).
    wait_until(Duration::from_secs(10), "the totals never settled", || {
        let (_, _, body) = admin(&n, "/__admin/api/namespaces");
        let rows = json(&body)["namespaces"].as_array().unwrap().clone();
        ["alpha", "beta"].iter().all(|ns| {
            rows.iter()
                .any(|r| r["namespace"] == *ns && r["publishes_per_sec"].as_f64() == Some(0.0))
        })
    });
    let (_, _, metrics) = admin(&n, "/metrics");
    for (ns, subs, topics) in [("alpha", 3.0, 2.0), ("beta", 1.0, 1.0)] {
        let r = row(ns);
        let l = format!("namespace=\"{ns}\"");
        assert_eq!(
            prom_value(&metrics, "meshgate_ws_subscribers", &l),
            Some(subs),
            "{ns}"
        );
        assert_eq!(
            prom_value(&metrics, "meshgate_pubsub_topics", &l),
            Some(topics),
            "{ns}"
        );
        assert_eq!(r["subscribers"].as_f64(), Some(subs), "{ns}: {r}");
        assert_eq!(r["topics"].as_f64(), Some(topics), "{ns}: {r}");
        let published = prom_value(&metrics, "meshgate_pubsub_published_total", &l).unwrap();
        assert!(published > 0.0);
        assert_eq!(r["publishes"].as_f64(), Some(published), "{ns}: {r}");
    }
    let (_, _, body) = admin(&n, "/__admin/api/node");
    assert_eq!(json(&body)["node"]["ws_subscribers"], 4, "{body}");
    assert_eq!(json(&body)["node"]["ws_connections"], 4, "{body}");
    // Closing the sockets brings subscribers and topics back to zero.
    drop(socks);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (ra, rb) = (row("alpha"), row("beta"));
        let zero = |r: &serde_json::Value| r["subscribers"] == 0 && r["topics"] == 0;
        if zero(&ra) && zero(&rb) {
            break;
        }
        assert!(Instant::now() < deadline, "gauges stayed up: {ra} {rb}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Whether the response's head has been read (all a test of the stream's
/// access needs: the stream never ends on its own).
fn head_read(raw: &str) -> bool {
    raw.contains("\r\n\r\n")
}

/// The complete events of an SSE body read so far: (id, data) of each
/// block that has both, in order; a block still arriving is left out.
fn sse_events(body: &str) -> Vec<(u64, String)> {
    let mut blocks: Vec<&str> = body.split("\n\n").collect();
    blocks.pop();
    blocks
        .iter()
        .filter_map(|b| {
            let id = b.lines().find_map(|l| l.strip_prefix("id: "))?;
            let data = b.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((id.trim().parse().ok()?, data.to_string()))
        })
        .collect()
}

/// Opens a raw HTTP/1.1 request and reads until `done` holds for what
/// arrived, the node closes the connection, or 10 s pass.
fn stream_until(
    n: &TestNode,
    path: &str,
    headers: &[(&str, &str)],
    done: impl Fn(&str) -> bool,
) -> (u16, Vec<(String, String)>, String) {
    let addr: std::net::SocketAddr = n.addr.parse().unwrap();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let mut req = format!(
        "GET {path} HTTP/1.1\r\nhost: {}\r\naccept: text/event-stream\r\naccept-encoding: gzip\r\n",
        n.addr
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    let mut raw = Vec::new();
    let mut buf = [0u8; 65536];
    while Instant::now() < end && !done(&String::from_utf8_lossy(&raw)) {
        s.set_read_timeout(Some(
            end.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        ))
        .unwrap();
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => raw.extend_from_slice(&buf[..k]),
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let hs = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, hs, body.to_string())
}

/// The stream sends the latest snapshot at once and a new one every tick,
/// uncompressed (a compressing encoder would hold events back) even when the
/// client accepts gzip.
#[test]
fn stream_sends_a_snapshot_every_tick() {
    let n = TestNode::start();
    let key = n.create_namespace("alpha");
    // A first use starts the namespace's supervisor, so the next tick lists it.
    assert_eq!(n.with_key(&key, "PUT", "/v1/kv/a", Some(b"1")).0, 200);
    // Until three snapshots have arrived.
    let (s, h, body) = stream_until(
        &n,
        "/__admin/api/stream",
        &[("authorization", &format!("Bearer {OPERATOR_KEY}"))],
        |raw| sse_events(raw.split_once("\r\n\r\n").map_or("", |(_, b)| b)).len() >= 3,
    );
    assert_eq!(s, 200);
    assert!(
        header(&h, "content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    assert_ne!(header(&h, "content-encoding"), Some("gzip"));
    assert!(body.contains("retry: 2000"));
    let events = sse_events(&body);
    assert!(events.len() >= 3, "{body}");
    // The id is the tick's number: one snapshot per tick, none skipped.
    let ids: Vec<u64> = events.iter().map(|(id, _)| *id).collect();
    assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "{ids:?}");
    let snap = json(&events.last().unwrap().1);
    assert!(
        snap["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["namespace"] == "alpha")
    );
    assert!(snap["node"]["uptime_seconds"].is_u64());
}

/// The dashboard in headless Chromium (scripts/e2e-dashboard.sh): two namespaces
/// with traffic, live counters that change between reads, filter, sorting, a
/// screenshot under target/e2e/. Never skipped: a missing browser fails.
#[test]
fn dashboard_in_headless_chromium() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = std::process::Command::new("bash")
        .arg(format!("{root}/scripts/e2e-dashboard.sh"))
        .env("MESHGATE_BIN", env!("CARGO_BIN_EXE_meshgate"))
        .output()
        .expect("run scripts/e2e-dashboard.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let why = match out.status.code() {
        Some(0) => return,
        Some(3) => "chromium is missing and `apt-get install -y chromium` failed",
        Some(4) => "node/npm are missing: `apt-get install -y nodejs npm`",
        Some(5) => "`npm install` of playwright-core and ws into tests/e2e failed",
        _ => "the browser test failed",
    };
    panic!("{why}\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
}

/// The sampler's snapshot count, from `/metrics` (operator key; reading
/// `/metrics` is not watching the dashboard).
fn snapshots_taken(n: &TestNode) -> f64 {
    let (s, _, text) = admin(n, "/metrics");
    assert_eq!(s, 200, "{text}");
    text.lines()
        .find_map(|l| l.strip_prefix("meshgate_dashboard_snapshots_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no meshgate_dashboard_snapshots_total: {text}"))
}

/// With nobody watching, the sampler takes no snapshot however long the
/// node runs with namespaces in use; an open event stream makes it take one
/// a tick (the stream receives them).
#[test]
fn no_snapshot_without_a_viewer() {
    let n = TestNode::start();
    for ns in ["idle-a", "idle-b", "idle-c"] {
        let key = n.create_namespace(ns);
        assert_eq!(n.with_key(&key, "PUT", "/v1/kv/k", Some(b"v")).0, 200);
    }
    // Several ticks' worth of an unwatched node.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(snapshots_taken(&n), 0.0, "a snapshot with no viewer");
    let (s, _, body) = stream_until(
        &n,
        "/__admin/api/stream",
        &[("authorization", &format!("Bearer {OPERATOR_KEY}"))],
        |raw| sse_events(raw.split_once("\r\n\r\n").map_or("", |(_, b)| b)).len() >= 3,
    );
    assert_eq!(s, 200);
    let events = sse_events(&body);
    assert!(events.len() >= 3, "{body}");
    // Every event after the stale first one is a new snapshot.
    assert!(snapshots_taken(&n) >= 2.0);
    let last = json(&events.last().unwrap().1);
    assert!(last["tick"].as_u64().unwrap() >= 2, "{last}");
}

/// A snapshot holds the node's totals and only the `[dashboard]
/// top_namespaces` most active namespaces (and their actors); the search
/// finds a namespace outside them, and an empty query is a 400 envelope.
#[test]
fn snapshot_holds_the_top_namespaces_and_search_finds_the_rest() {
    let n = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[dashboard]\ntop_namespaces = 2\n"),
        ..Default::default()
    });
    for ns in ["busy-a", "busy-b"] {
        let key = n.create_namespace(ns);
        for i in 0..20 {
            let path = format!("/v1/kv/k{i}");
            assert_eq!(n.with_key(&key, "PUT", &path, Some(b"v")).0, 200);
        }
    }
    for ns in ["quiet-1", "quiet-2", "quiet-3"] {
        let key = n.create_namespace(ns);
        assert_eq!(n.with_key(&key, "PUT", "/v1/kv/k", Some(b"v")).0, 200);
    }
    // Until the store listing (every few ticks) has counted all five.
    let mut snap = serde_json::Value::Null;
    wait_until(
        Duration::from_secs(15),
        "five namespaces never counted",
        || {
            let (s, _, body) = admin(&n, "/__admin/api/snapshot");
            assert_eq!(s, 200, "{body}");
            snap = json(&body);
            snap["node"]["namespaces_known"] == 5
        },
    );
    assert_eq!(snap["top_namespaces"], 2, "{snap}");
    assert_eq!(snap["namespaces_ranked"], 5, "{snap}");
    let names: Vec<&str> = snap["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["namespace"].as_str().unwrap())
        .collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(sorted, ["busy-a", "busy-b"], "{snap}");
    let actor_ns: Vec<&str> = snap["actors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["namespace"].as_str().unwrap())
        .collect();
    assert!(actor_ns.contains(&""), "the node actor: {actor_ns:?}");
    assert!(
        actor_ns.iter().all(|ns| !ns.starts_with("quiet")),
        "{actor_ns:?}"
    );
    let listed = snap["actors"].as_array().unwrap().len() as u64;
    let counted = snap["node"]["actors"].as_u64().unwrap();
    assert!(
        counted >= 6 && counted >= listed + 3,
        "every actor counted: {snap}"
    );
    // Totals: 2 x 20 + 3 x 1 writes published nothing and invoked nothing,
    // but every actor's messages are counted.
    assert!(
        snap["node"]["messages_handled"].as_u64().unwrap() >= 43,
        "{snap}"
    );
    let (s, _, body) = admin(&n, "/__admin/api/namespaces/search?q=quiet-2");
    assert_eq!(s, 200, "{body}");
    let found = json(&body);
    assert_eq!(found["matched"], 1, "{body}");
    assert_eq!(found["namespaces"][0]["namespace"], "quiet-2", "{body}");
    assert!(
        found["namespaces"][0]["handled"].as_u64().unwrap() >= 1,
        "{body}"
    );
    let (_, _, body) = admin(&n, "/__admin/api/namespaces/search?q=quiet");
    assert_eq!(json(&body)["matched"], 3, "{body}");
    let (s, _, body) = admin(&n, "/__admin/api/namespaces/search?q=");
    assert_eq!(s, 400, "{body}");
    assert_eq!(json(&body)["error"]["code"], "BAD_REQUEST");
}

/// The `namespace` label values of every sample in `/metrics` text.
fn namespace_labels(text: &str) -> std::collections::BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split("namespace=\"").nth(1))
        .filter_map(|l| l.split('"').next())
        .map(str::to_string)
        .collect()
}

/// With more namespaces than `[metrics] namespace_series_limit`, `/metrics`
/// has at most limit + `_other` namespace label values (the most active
/// namespaces keep theirs), and `_other` is the sum of the rest, as each
/// one's `/v1/namespaces/{ns}/stats` reports it.
#[test]
fn metrics_keep_the_top_namespaces_and_sum_the_rest() {
    let n = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[metrics]\nnamespace_series_limit = 2\n"),
        ..Default::default()
    });
    let names = ["m-a", "m-b", "m-c", "m-d", "m-e"];
    for (i, ns) in names.iter().enumerate() {
        let key = n.create_namespace(ns);
        // m-a the busiest, m-e the quietest.
        for k in 0..(2 * (names.len() - i)) {
            let path = format!("/v1/kv/k{k}");
            assert_eq!(n.with_key(&key, "PUT", &path, Some(b"v")).0, 200);
        }
    }
    let handled = |ns: &str| -> f64 {
        let (s, _, body) = admin(&n, &format!("/v1/namespaces/{ns}/stats"));
        assert_eq!(s, 200, "{body}");
        json(&body)["stats"]["messages_handled"].as_f64().unwrap()
    };
    // The numbers settle once the namespaces are quiet: retried until one
    // scrape and the stats agree.
    let mut last = String::new();
    wait_until(
        Duration::from_secs(15),
        "_other never equalled the rest",
        || {
            let before: f64 = ["m-c", "m-d", "m-e"].iter().map(|ns| handled(ns)).sum();
            let (_, _, text) = admin(&n, "/metrics");
            let labels = namespace_labels(&text);
            let want: std::collections::BTreeSet<String> = ["", "_other", "m-a", "m-b"]
                .iter()
                .map(|s| s.to_string())
                .collect();
            assert_eq!(labels, want, "{text}");
            let other = prom_value(
                &text,
                "meshgate_actor_messages_handled_total",
                "kind=\"namespace\",namespace=\"_other\"",
            )
            .unwrap_or_else(|| panic!("no _other series: {text}"));
            let rest: f64 = ["m-c", "m-d", "m-e"].iter().map(|ns| handled(ns)).sum();
            last = format!("_other {other}, the rest {before} then {rest}");
            before == rest && other == rest && rest > 0.0
        },
    );
    assert!(!last.is_empty());
}

/// The samples of the namespaced families in `/metrics` text, keyed
/// `name{labels}` without the `namespace` label, summed over it.
fn namespaced_sums(text: &str) -> std::collections::BTreeMap<String, f64> {
    let families = [
        "meshgate_actor_",
        "meshgate_pubsub_published_total",
        "meshgate_pubsub_topics",
        "meshgate_function_",
        "meshgate_ws_subscribers",
    ];
    let mut out = std::collections::BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        if !families.iter().any(|f| line.starts_with(f)) {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap();
        let (name, labels) = series.split_once('{').unwrap_or((series, "}"));
        let labels: Vec<&str> = labels
            .trim_end_matches('}')
            .split(',')
            .filter(|l| !l.is_empty() && !l.starts_with("namespace="))
            .collect();
        let key = format!("{name}{{{}}}", labels.join(","));
        *out.entry(key).or_insert(0.0) += value.parse::<f64>().unwrap();
    }
    out
}

/// The node totals `/metrics` keeps as counters move equal the sum over
/// namespaces: after KV writes and publishes in five namespaces, one of them
/// deleted and every one passivated, the public view (no namespace names,
/// read from the totals) equals the operator's view (the top 2 and
/// `_other`) summed over `namespace`, the publishes add up to the ones made
/// (the deleted namespace's included), and a passivated namespace's stats
/// still count its publishes.
#[test]
fn metrics_totals_equal_the_sum_over_namespaces_after_passivation_and_delete() {
    let n = TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}[server]\npassivate_after_seconds = 1\n[metrics]\nnamespace_series_limit = 2\npublic = true\n"
        ),
        ..Default::default()
    });
    let names = ["t-a", "t-b", "t-c", "t-d", "t-e"];
    let mut published = 0;
    for (i, ns) in names.iter().enumerate() {
        let key = n.create_namespace(ns);
        for k in 0..=i {
            let path = format!("/v1/kv/k{k}");
            assert_eq!(n.with_key(&key, "PUT", &path, Some(b"v")).0, 200);
        }
        for _ in 0..(names.len() - i) {
            let body = br#"{"topic":"t","data_base64":"aGk="}"#;
            let (s, b) = n.with_key(&key, "POST", "/v1/pubsub/publish", Some(body));
            assert_eq!(s, 200, "{b}");
            published += 1;
        }
    }
    assert_eq!(n.op("DELETE", "/v1/namespaces/t-d", None).0, 200);
    let asleep = || {
        n.every_base().iter().all(|base| {
            let (_, _, b) = http("GET", &format!("{base}/v1/status"), &[OPERATOR_AUTH], None);
            json(&String::from_utf8_lossy(&b))["actors"]
                .as_array()
                .unwrap()
                .iter()
                .all(|a| !names.iter().any(|ns| a["namespace"] == *ns))
        })
    };
    wait_until(
        Duration::from_secs(20),
        "namespaces never passivated",
        asleep,
    );
    let mut last = String::new();
    wait_until(
        Duration::from_secs(15),
        "public totals never equalled the operator's sums",
        || {
            let mut ok = true;
            let mut public_published = 0.0;
            let mut operator_published = 0.0;
            for base in n.every_base() {
                let (s, _, public) = http("GET", &format!("{base}/metrics"), &[], None);
                assert_eq!(s, 200);
                let public = String::from_utf8_lossy(&public).into_owned();
                assert!(
                    names
                        .iter()
                        .all(|ns| !public.contains(&format!("\"{ns}\""))),
                    "{public}"
                );
                let (_, _, operator) =
                    http("GET", &format!("{base}/metrics"), &[OPERATOR_AUTH], None);
                let operator = String::from_utf8_lossy(&operator).into_owned();
                let (p, o) = (namespaced_sums(&public), namespaced_sums(&operator));
                let key = "meshgate_pubsub_published_total{}";
                public_published += p.get(key).copied().unwrap_or(0.0);
                operator_published += o.get(key).copied().unwrap_or(0.0);
                last = format!("public {p:?}\noperator {o:?}\n{operator}");
                // Histogram sums are floats added in another order: equal to
                // rounding.
                ok &= p.len() == o.len()
                    && p.iter().zip(&o).all(|((kp, vp), (ko, vo))| {
                        kp == ko && (vp - vo).abs() <= 1e-9 * vp.abs().max(1.0)
                    });
            }
            ok && public_published == published as f64 && operator_published == published as f64
        },
    );
    assert!(!last.is_empty());
    let (s, _, body) = admin(&n, "/v1/namespaces/t-c/stats");
    assert_eq!(s, 200, "{body}");
    assert_eq!(json(&body)["stats"]["published"], 3, "{body}");
}

/// `GET /v1/namespaces/{namespace}/stats` answers the namespace's own key
/// and the operator, refuses another namespace's key (403) and names an
/// unknown namespace (404).
#[test]
fn namespace_stats_answer_the_owner_and_the_operator() {
    let n = TestNode::start();
    let a = n.create_namespace("alpha");
    let b = n.create_namespace("beta");
    for i in 0..3 {
        let path = format!("/v1/kv/k{i}");
        assert_eq!(n.with_key(&a, "PUT", &path, Some(b"v")).0, 200);
    }
    let (s, body) = n.with_key(&a, "GET", "/v1/namespaces/alpha/stats", None);
    assert_eq!(s, 200, "{body}");
    let own = json(&body);
    assert_eq!(own["namespace"], "alpha");
    assert!(
        own["stats"]["messages_handled"].as_u64().unwrap() >= 3,
        "{body}"
    );
    let (s, _, body) = admin(&n, "/v1/namespaces/alpha/stats");
    assert_eq!(s, 200, "{body}");
    assert!(json(&body)["stats"]["messages_handled"].as_u64().unwrap() >= 3);
    let (s, body) = n.with_key(&b, "GET", "/v1/namespaces/alpha/stats", None);
    assert_eq!(s, 403, "{body}");
    assert_eq!(json(&body)["ok"], false, "{body}");
    let (s, _, body) = admin(&n, "/v1/namespaces/nobody/stats");
    assert_eq!(s, 404, "{body}");
    assert_eq!(json(&body)["error"]["code"], "NAMESPACE_NOT_FOUND");
}

/// A `[metrics] namespace_series_limit` of 0 or over 10,000 stops the node at
/// start (exit 2) with the key named.
#[test]
fn bad_namespace_series_limit_is_refused_at_start() {
    for bad in ["0", "10001"] {
        let (code, err) = crate::node::run_serve(
            &[],
            &[("MESHGATE_METRICS_NAMESPACE_SERIES_LIMIT", bad)],
            Duration::from_secs(20),
        );
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("metrics.namespace_series_limit"), "{err}");
    }
}

/// An upstream on 127.0.0.1 answering every request on its connection (keep-alive):
/// 500 for a path under `/api/fail`, 200 otherwise. Returns its URL.
fn failing_upstream() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    // Requests without a body: a head ends at the blank line.
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut chunk) {
                            Ok(0) | Err(_) => return,
                            Ok(k) => buf.extend_from_slice(&chunk[..k]),
                        }
                    }
                    let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    buf.drain(..end);
                    let path = head.split(' ').nth(1).unwrap_or("");
                    let answer: &[u8] = if path.starts_with("/api/fail") {
                        b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\nfail"
                    } else {
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                    };
                    if s.write_all(answer).is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}

/// The Deployments panel's numbers: a deployment proxied to an upstream on
/// 127.0.0.1 gets requests while the stream is open (4 of 12 answered 500 by
/// the upstream); a later snapshot has the route's row with a non-zero rate,
/// an error share of 1/3, percentiles, and its one instance healthy.
#[test]
fn deployment_routes_show_rate_percentiles_and_error_share() {
    let n = TestNode::start_with(NodeOpts {
        config: crate::deploy::loopback_config(),
        ..Default::default()
    });
    let key = n.create_namespace("shop");
    let upstream = failing_upstream();
    let (s, v) = crate::deploy::deploy_json(
        &n,
        &key,
        serde_json::json!({"name": "web", "hosts": ["web.test"],
            "upstream": {"instances": [upstream]},
            "routes": [{"path_prefix": "/api"}, {"path_prefix": "/"}]}),
    );
    assert_eq!(s, 201, "{v}");
    let sent = std::cell::Cell::new(false);
    let route_row = |snap: &serde_json::Value| -> Option<serde_json::Value> {
        let dep = snap["deployments"]
            .as_array()?
            .iter()
            .find(|d| d["namespace"] == "shop" && d["deployment"] == "web")?
            .clone();
        let route = dep["routes"]
            .as_array()?
            .iter()
            .find(|r| r["route"] == "/api")?
            .clone();
        Some(serde_json::json!({"dep": dep, "route": route}))
    };
    let done = |raw: &str| {
        let events = sse_events(raw.split_once("\r\n\r\n").map_or("", |(_, b)| b));
        let snaps: Vec<serde_json::Value> = events.iter().map(|(_, d)| json(d)).collect();
        // After the sampler's first tick (whose rates read 0), the traffic.
        if !sent.get() && snaps.iter().any(|s| s["tick"].as_u64() >= Some(1)) {
            sent.set(true);
            for i in 0..12 {
                let path = if i % 3 == 0 {
                    format!("/api/fail/{i}")
                } else {
                    format!("/api/ok/{i}")
                };
                let (st, _, _) = crate::deploy::via(&n, "web.test", "GET", &path, &[], None);
                assert_eq!(st, if i % 3 == 0 { 500 } else { 200 }, "{path}");
            }
            return false;
        }
        snaps
            .iter()
            .filter_map(route_row)
            .any(|r| r["route"]["requests"] == 12)
    };
    let (s, _, body) = stream_until(
        &n,
        "/__admin/api/stream",
        &[("authorization", &format!("Bearer {OPERATOR_KEY}"))],
        done,
    );
    assert_eq!(s, 200);
    assert!(sent.get(), "no tick arrived: {body}");
    let rows: Vec<serde_json::Value> = sse_events(&body)
        .iter()
        .filter_map(|(_, d)| route_row(&json(d)))
        .collect();
    let last = rows
        .last()
        .unwrap_or_else(|| panic!("no route row: {body}"));
    assert_eq!(last["route"]["requests"], 12, "{last}");
    assert_eq!(last["route"]["error_share"], 0.333, "{last}");
    assert!(
        last["route"]["p50_seconds"].as_f64().unwrap() > 0.0,
        "{last}"
    );
    assert!(
        last["route"]["p99_seconds"].as_f64().unwrap() > 0.0,
        "{last}"
    );
    assert_eq!(last["dep"]["instances"], 1, "{last}");
    assert_eq!(last["dep"]["instances_healthy"], 1, "{last}");
    // Every request arrived after a tick, so some tick saw them at a non-zero rate.
    assert!(
        rows.iter()
            .any(|r| r["route"]["requests_per_sec"].as_f64().unwrap() > 0.0),
        "{rows:?}"
    );
    // The route "/" had no request: no row for it.
    assert!(
        last["dep"]["routes"].as_array().unwrap().len() == 1,
        "{last}"
    );
}

/// The Deployments panel's certificate column: of two deployments with
/// traffic, the one with an uploaded certificate shows `uploaded` with its
/// leaf's expiry, the other the node's pair; once the certificate is
/// removed its row shows the node's pair too (read from memory, following
/// the index).
#[test]
fn deployment_rows_show_their_certificate() {
    let n = TestNode::start_with(NodeOpts {
        config: crate::deploy::loopback_config(),
        ..Default::default()
    });
    let key = n.create_namespace("shop");
    let upstream = failing_upstream();
    for (name, host) in [("web", "web.test"), ("store", "store.test")] {
        let (s, v) = crate::deploy::deploy_json(
            &n,
            &key,
            serde_json::json!({"name": name, "hosts": [host],
                "upstream": {"instances": [upstream.clone()]},
                "routes": [{"path_prefix": "/"}]}),
        );
        assert_eq!(s, 201, "{v}");
    }
    // 2020-01-01 to 2090-01-01.
    let pair = crate::deploy::certs::current(&["store.test"]);
    let body = serde_json::json!({"cert_pem": pair.cert, "key_pem": pair.key}).to_string();
    let (s, b) = n.with_key(
        &key,
        "PUT",
        "/v1/deployments/store/certificate",
        Some(body.as_bytes()),
    );
    assert_eq!(s, 200, "{b}");
    // The first snapshot read starts the sampler; then traffic to both.
    let tls_of = |want: &dyn Fn(&serde_json::Value) -> bool| -> serde_json::Value {
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            for host in ["web.test", "store.test"] {
                let (st, _, _) = crate::deploy::via(&n, host, "GET", "/ok", &[], None);
                assert_eq!(st, 200, "{host}");
            }
            let (s, _, body) = admin(&n, "/__admin/api/snapshot");
            assert_eq!(s, 200, "{body}");
            let snap = json(&body);
            let rows: serde_json::Value = snap["deployments"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["namespace"] == "shop")
                .map(|d| {
                    (
                        d["deployment"].as_str().unwrap().to_string(),
                        d["tls"].clone(),
                    )
                })
                .collect::<serde_json::Map<_, _>>()
                .into();
            if want(&rows) {
                return rows;
            }
            assert!(Instant::now() < end, "not within 20 s: {rows}");
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let rows = tls_of(&|r| r["web"].is_object() && r["store"].is_object());
    assert_eq!(
        rows["store"],
        serde_json::json!({"mode": "uploaded", "not_after": "2090-01-01T00:00:00Z",
            "expired": false, "acme": null}),
        "{rows}"
    );
    assert_eq!(
        rows["web"],
        serde_json::json!({"mode": "node_pair", "not_after": null, "expired": false, "acme": null}),
        "{rows}"
    );
    // Removed: its hosts get the node's pair, and the row says so.
    let (s, b) = n.with_key(&key, "DELETE", "/v1/deployments/store/certificate", None);
    assert!(s == 200 || s == 204, "{s} {b}");
    let rows = tls_of(&|r| r["store"]["mode"] == "node_pair");
    assert_eq!(
        rows["store"]["not_after"],
        serde_json::Value::Null,
        "{rows}"
    );
    assert_eq!(rows["web"]["mode"], "node_pair", "{rows}");
}

/// The certificate column of a `tls: "auto"` deployment whose CA cannot be
/// reached: `acme`, `failed`, the error (naming the dead port, cut to at
/// most 120 characters) and the next attempt, as the node's ACME checker
/// last saw them; no certificate, so no expiry.
#[test]
fn acme_deployment_row_shows_its_failed_order() {
    use crate::deploy::certs::{API, namespace, tls_node_with, tls_request};
    let tmp = tempfile::tempdir().unwrap();
    let own = tmp.path();
    // A CA file that parses, and a directory nothing listens on.
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    std::fs::write(own.join("ca.pem"), ca.self_signed(&ca_key).unwrap().pem()).unwrap();
    let dead = crate::common::free_port();
    let http_port = crate::common::free_port();
    let node = tls_node_with(
        own,
        &format!(
            "[tls.acme]\ndirectory = \"https://127.0.0.1:{dead}/dir\"\nemail = \"ops@example.test\"\n\
             ca_bundle = {:?}\nhttp_listen = \"127.0.0.1:{http_port}\"\ncheck_seconds = 1\n\
             retry_min_seconds = 300\nretry_max_seconds = 600\n",
            own.join("ca.pem")
        ),
        NodeOpts::default(),
    );
    let key = namespace(&node, "acmedash");
    let host = "shop.acme-dash.test";
    let body = serde_json::json!({"name": "shop", "hosts": [host], "tls": "auto",
        "upstream": {"instances": [failing_upstream()]}});
    let auth = format!("Bearer {key}");
    let (s, b, _) = tls_request(
        &node.addr,
        API,
        API,
        "POST",
        "/v1/deployments",
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
        body.to_string().as_bytes(),
    );
    assert_eq!(s, 201, "{b}");
    let mut last = serde_json::Value::Null;
    wait_until(
        Duration::from_secs(60),
        "the row shows a failed order",
        || {
            // Its host still gets the node's pair; the request makes its row.
            let (st, _, _) = tls_request(&node.addr, host, host, "GET", "/ok", &[], b"");
            assert_eq!(st, 200);
            let (s, body, _) = tls_request(
                &node.addr,
                API,
                API,
                "GET",
                "/__admin/api/snapshot",
                &[OPERATOR_AUTH],
                b"",
            );
            assert_eq!(s, 200, "{body}");
            last = json(&body)["deployments"]
                .as_array()
                .unwrap()
                .iter()
                .find(|d| d["namespace"] == "acmedash" && d["deployment"] == "shop")
                .map(|d| d["tls"].clone())
                .unwrap_or_default();
            last["acme"]["state"] == "failed"
        },
    );
    assert_eq!(last["mode"], "acme", "{last}");
    assert_eq!(last["not_after"], serde_json::Value::Null, "{last}");
    let err = last["acme"]["last_error"].as_str().unwrap_or_default();
    assert!(err.contains(&dead.to_string()), "{last}");
    assert!(err.chars().count() <= 120, "{last}");
    assert!(last["acme"]["next_attempt"].is_string(), "{last}");
}
