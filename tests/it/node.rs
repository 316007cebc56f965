//! The node foundation: probes, drain, metrics, restarts, supervision, and bad input.

use crate::common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn status(node: &TestNode, path: &str) -> u16 {
    http("GET", &node.url(path), &[], None).0
}

/// Probes while starting (startupz 200, readyz 503), running (all 200) and
/// draining (readyz 503, livez 200, new work refused).
#[test]
fn probes_while_starting_running_draining() {
    let mut node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[debug]\nstartup_delay_ms = 1500\nmax_sleep_ms = 5000\n"),
        no_wait_ready: true,
        ..Default::default()
    });
    assert_eq!(status(&node, "/startupz"), 200);
    assert_eq!(status(&node, "/livez"), 200);
    assert_eq!(status(&node, "/readyz"), 503, "ready too early");
    let (s, _, b) = http("GET", &node.url("/v1/health"), &[], None);
    assert_eq!(s, 503, "work accepted while starting");
    assert!(String::from_utf8_lossy(&b).contains("STARTING"));
    node.wait_ready();
    assert_eq!(status(&node, "/readyz"), 200);
    assert_eq!(status(&node, "/v1/health"), 200);
    // Drain with a request in flight so the drain window is observable.
    let url = node.url("/v1/debug/sleep?ms=1500");
    let inflight = std::thread::spawn(move || http("GET", &url, &[], None).0);
    wait_until(Duration::from_secs(10), "the request never got in", || {
        node.metric_sum("meshgate_http_in_flight") >= 1.0
    });
    node.signal(15);
    // The signal is handled asynchronously: readyz turns 503 once it is.
    wait_until(Duration::from_secs(5), "readyz never turned 503", || {
        status(&node, "/readyz") == 503
    });
    assert_eq!(
        node.metric_sum("meshgate_http_in_flight"),
        1.0,
        "the drain was seen with the request in flight"
    );
    assert_eq!(
        status(&node, "/livez"),
        200,
        "livez stays 200 while draining"
    );
    let (s, _, b) = http("GET", &node.url("/v1/health"), &[], None);
    assert_eq!(s, 503);
    assert!(String::from_utf8_lossy(&b).contains("DRAINING"));
    assert_eq!(
        inflight.join().unwrap(),
        200,
        "the in-flight request must finish"
    );
    assert_eq!(
        node.wait_exit(Duration::from_secs(20)),
        Some(0),
        "drain must exit 0"
    );
}

/// SIGINT drains too, and a drain with nothing in flight exits promptly with 0.
#[test]
fn sigint_drains_and_exits_zero() {
    let mut node = TestNode::start();
    node.signal(2);
    assert_eq!(node.wait_exit(Duration::from_secs(20)), Some(0));
}

/// `/metrics` is Prometheus text, and probes are not counted as requests.
#[test]
fn metrics_parse_as_prometheus_text_and_skip_probes() {
    let node = TestNode::start();
    let count = |text: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with("meshgate_http_requests_total"))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    };
    let (_, _, m1) = http("GET", &node.url("/metrics"), &[OPERATOR_AUTH], None);
    let m1 = String::from_utf8(m1).unwrap();
    for _ in 0..5 {
        status(&node, "/livez");
        status(&node, "/readyz");
    }
    status(&node, "/v1/health");
    let (s, h, m2) = http("GET", &node.url("/metrics"), &[OPERATOR_AUTH], None);
    assert_eq!(s, 200);
    assert!(
        header(&h, "content-type")
            .unwrap()
            .starts_with("text/plain")
    );
    let m2 = String::from_utf8(m2).unwrap();
    // Every line is a comment or `name{labels} value`.
    for line in m2.lines().filter(|l| !l.is_empty()) {
        if line.starts_with('#') {
            assert!(
                line.starts_with("# HELP ") || line.starts_with("# TYPE "),
                "{line}"
            );
            continue;
        }
        let (name, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad line {line}"));
        assert!(
            value.parse::<f64>().is_ok() || value == "+Inf" || value == "NaN",
            "{line}"
        );
        let bare = name.split('{').next().unwrap();
        assert!(
            bare.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "{line}"
        );
    }
    assert_eq!(count(&m2) - count(&m1), 1.0, "only /v1/health counts");
    assert!(m2.contains("meshgate_actor_mailbox_depth"));
}

/// Data written before a restart is there after it.
#[test]
fn restart_keeps_stored_data() {
    let mut node = TestNode::start();
    let key = node.create_namespace("keep");
    assert_eq!(
        node.with_key(&key, "PUT", "/v1/kv/a", Some(b"durable")).0,
        200
    );
    let dir = node.dir.clone();
    node.signal(15);
    assert_eq!(node.wait_exit(Duration::from_secs(20)), Some(0));
    drop(node.child.take());
    let node2 = TestNode::start_with(NodeOpts {
        config: TEST_CONFIG.into(),
        data_dir: Some(dir),
        ..Default::default()
    });
    let (s, b) = node2.with_key(&key, "GET", "/v1/kv/a", None);
    assert_eq!((s, b.as_str()), (200, "durable"));
    drop(node);
}

/// An acknowledged write survives SIGKILL right after the acknowledgement.
#[test]
fn acknowledged_write_survives_sigkill() {
    let mut node = TestNode::start();
    let key = node.create_namespace("crash");
    for i in 0..20 {
        let v = format!("value-{i}");
        assert_eq!(
            node.with_key(&key, "PUT", &format!("/v1/kv/k{i}"), Some(v.as_bytes()))
                .0,
            200
        );
    }
    node.kill9();
    let dir = node.dir.clone();
    let node2 = TestNode::start_with(NodeOpts {
        config: TEST_CONFIG.into(),
        data_dir: Some(dir),
        ..Default::default()
    });
    for i in 0..20 {
        let (s, b) = node2.with_key(&key, "GET", &format!("/v1/kv/k{i}"), None);
        assert_eq!((s, b), (200, format!("value-{i}")));
    }
    drop(node);
}

/// A panic in a namespace supervisor restarts it, reloads its state, and counts it.
#[test]
fn supervisor_panic_restarts_and_counts() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[debug]\nfault_injection = true\n"),
        ..Default::default()
    });
    let key = node.create_namespace("fragile");
    assert_eq!(node.with_key(&key, "PUT", "/v1/kv/x", Some(b"1")).0, 200);
    let (s, b) = node.op("POST", "/v1/namespaces/fragile/debug/panic", None);
    assert_eq!(s, 200, "{b}");
    assert_eq!(json(&b)["panicked"], true);
    // The same address answers again, with its record reloaded from the store.
    let (s, b) = node.op("GET", "/v1/namespaces/fragile", None);
    assert_eq!(s, 200, "{b}");
    let info = json(&b);
    assert_eq!(info["restarts"], 1);
    assert_eq!(info["record"]["name"], "fragile");
    assert_eq!(
        node.with_key(&key, "GET", "/v1/kv/x", None),
        (200, "1".into())
    );
    let (_, _, m) = http("GET", &node.url("/metrics"), &[OPERATOR_AUTH], None);
    let m = String::from_utf8(m).unwrap();
    assert!(
        m.lines().any(|l| l.starts_with(
            "meshgate_actor_restarts_total{kind=\"namespace\",namespace=\"fragile\"} 1"
        )),
        "{m}"
    );
    // Switched off, the routes do not exist: 404 whatever the query, never
    // a 400 that tells a prober the route is there.
    let plain = TestNode::start();
    plain.create_namespace("solid");
    for path in [
        "/v1/namespaces/solid/debug/panic",
        "/v1/namespaces/solid/debug/hold",
        "/v1/namespaces/solid/debug/hold?ms=x",
        "/v1/namespaces/solid/debug/hold-compile",
        "/v1/namespaces/solid/debug/hold-compile?ms=10",
    ] {
        let (s, b) = plain.op("POST", path, None);
        assert_eq!(s, 404, "{path}: {b}");
        assert!(b.contains("\"NOT_FOUND\""), "{path}: {b}");
    }
}

pub(crate) fn run_serve(
    args: &[&str],
    env: &[(&str, &str)],
    within: Duration,
) -> (Option<i32>, String) {
    let mut cmd = Command::new(bin());
    cmd.arg("serve")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .env("RUST_LOG", "error");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (s.code(), err);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return (None, String::new());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A config with an unknown key and bad values lists every problem and exits non-zero.
#[test]
fn bad_config_lists_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(
        &cfg,
        "[server]\nlisten = 12\ncolour = \"blue\"\n[rate_limit]\ngeneral_burst = -1\n",
    )
    .unwrap();
    let (code, err) = run_serve(
        &["--config", cfg.to_str().unwrap()],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("server.listen"), "{err}");
    assert!(err.contains("unknown key server.colour"), "{err}");
    assert!(err.contains("rate_limit.general_burst"), "{err}");
    // A bad environment override is reported the same way.
    let (code, err) = run_serve(
        &[],
        &[("MESHGATE_SERVER_MAX_BODY_BYTES", "lots")],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("MESHGATE_SERVER_MAX_BODY_BYTES"), "{err}");
}

/// A zero or negative `[server] passivate_after_seconds` is refused at
/// start (exit 2), listed with the config's other problems.
#[test]
fn bad_passivate_after_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    for bad in ["0", "-30"] {
        std::fs::write(
            &cfg,
            format!("[server]\npassivate_after_seconds = {bad}\nmax_body_bytes = 0\n"),
        )
        .unwrap();
        let (code, err) = run_serve(
            &["--config", cfg.to_str().unwrap()],
            &[],
            Duration::from_secs(20),
        );
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("server.passivate_after_seconds"), "{err}");
        assert!(err.contains("server.max_body_bytes"), "{err}");
    }
}

/// A port already in use, an unwritable data folder and a second node on the
/// same data folder each fail start-up with a clear message (and no panic
/// after it).
#[test]
fn start_up_failures_are_clear() {
    let node = TestNode::start();
    let other = tempfile::tempdir().unwrap();
    let (code, err) = run_serve(
        &[
            "--listen",
            &node.addr,
            "--data-dir",
            other.path().join("d").to_str().unwrap(),
        ],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("already in use"), "{err}");
    assert!(
        !err.contains("panicked"),
        "a clear message, then no panic: {err}"
    );

    let file = other.path().join("plainfile");
    std::fs::write(&file, "x").unwrap();
    let (code, err) = run_serve(
        &[
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            file.join("data").to_str().unwrap(),
        ],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not usable"), "{err}");

    let (code, err) = run_serve(
        &[
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            node.dir.to_str().unwrap(),
        ],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("in use by another meshgate process"), "{err}");
    // The first node is unharmed.
    assert_eq!(status(&node, "/readyz"), 200);
}

/// An oversized body is 413, malformed JSON 400, an unknown route 404: each the JSON envelope.
#[test]
fn bad_requests_get_the_envelope() {
    let node = TestNode::start();
    let key = node.create_namespace("bodies");
    let big = vec![b'x'; (1 << 20) + 10];
    let (s, b) = node.with_key(&key, "PUT", "/v1/kv/big", Some(&big));
    assert_eq!(s, 413, "{b}");
    assert_eq!(json(&b)["error"]["code"], "PAYLOAD_TOO_LARGE");
    assert_eq!(
        node.with_key(&key, "GET", "/v1/kv/big", None).0,
        404,
        "nothing stored"
    );

    let (s, b) = node.op("POST", "/v1/namespaces", Some("{\"name\": "));
    assert_eq!(s, 400, "{b}");
    let v = json(&b);
    assert_eq!(v["ok"], false);
    assert_eq!(v["error"]["code"], "MALFORMED_JSON");
    assert_eq!(v["error"]["retryable"], false);

    let (s, h, b) = http(
        "GET",
        &node.url("/v1/nope"),
        &[("x-request-id", "abc-123")],
        None,
    );
    assert_eq!(s, 404);
    assert_eq!(
        json(&String::from_utf8_lossy(&b))["error"]["code"],
        "NOT_FOUND"
    );
    assert_eq!(
        header(&h, "x-request-id"),
        Some("abc-123"),
        "request id echoed"
    );
    let (_, h, _) = http("GET", &node.url("/v1/health"), &[], None);
    assert_eq!(
        header(&h, "x-request-id").map(str::len),
        Some(24),
        "request id generated"
    );
    assert_eq!(header(&h, "x-content-type-options"), Some("nosniff"));
    assert_eq!(header(&h, "cache-control"), Some("no-store"));
}

/// Compression wraps the chain: a large answer is gzipped for a client that
/// accepts it; a small one is sent as is (an encoder per tiny body costs more
/// than it saves).
#[test]
fn large_answers_compressed_small_ones_not() {
    let node = TestNode::start();
    let key = node.create_namespace("gz");
    let big = vec![b'a'; 64 * 1024];
    assert_eq!(node.with_key(&key, "PUT", "/v1/kv/big", Some(&big)).0, 200);
    let auth = format!("Bearer {key}");
    let gz = [
        ("authorization", auth.as_str()),
        ("accept-encoding", "gzip"),
    ];
    let (s, h, body) = http("GET", &node.url("/v1/kv/big"), &gz, None);
    assert_eq!(s, 200);
    assert_eq!(header(&h, "content-encoding"), Some("gzip"));
    assert!(body.len() < big.len() / 10, "{} bytes", body.len());
    let (s, h, body) = http("GET", &node.url("/v1/health"), &gz, None);
    assert_eq!(s, 200);
    assert_eq!(header(&h, "content-encoding"), None);
    assert!(body.starts_with(b"{"));
}

/// The request log (docs/decisions.md "The request log"): one line per
/// request with method, path, the request id (the client's, or the one the
/// node generated and echoed), status and duration, in text and in JSON;
/// `RUST_LOG=warn` keeps only failed requests, so a 200 and a 404 leave none.
#[test]
fn request_log_lines_carry_the_request_and_follow_the_filter() {
    let start = |format: &str, filter: &str| {
        TestNode::start_with(NodeOpts {
            config: format!("{TEST_CONFIG}[server]\nlog_format = \"{format}\"\n"),
            env: vec![("RUST_LOG".into(), filter.into())],
            ..Default::default()
        })
    };
    let line_with = |node: &TestNode, needle: &str| -> String {
        let mut found = String::new();
        wait_until(
            Duration::from_secs(10),
            "the request's log line never came",
            || {
                let log = node.stderr.lock().unwrap();
                match log.lines().find(|l| l.contains(needle)) {
                    Some(l) => {
                        found = l.to_string();
                        true
                    }
                    None => false,
                }
            },
        );
        found
    };

    // Text, at INFO: the client's id, then a generated one (echoed).
    let node = start("pretty", "info");
    let (s, _, _) = http(
        "GET",
        &node.url("/v1/health"),
        &[("x-request-id", "it-log-1")],
        None,
    );
    assert_eq!(s, 200);
    let l = line_with(&node, "request_id=it-log-1");
    assert!(
        l.contains("INFO request{method=GET path=/v1/health request_id=it-log-1 trace_id=")
            && l.contains("}: meshgate::access: Request served. status=200 duration_ms="),
        "{l}"
    );
    let (s, headers, _) = http("GET", &node.url("/v1/no-such-route"), &[], None);
    assert_eq!(s, 404);
    let id = header(&headers, "x-request-id")
        .expect("a generated request id")
        .to_string();
    let l = line_with(&node, &format!("request_id={id}"));
    assert!(
        l.contains("path=/v1/no-such-route ") && l.contains("status=404 "),
        "{l}"
    );
    // Probes are outside the chain and not logged.
    assert_eq!(
        http(
            "GET",
            &node.url("/livez"),
            &[("x-request-id", "it-probe")],
            None
        )
        .0,
        200
    );
    drop(node);

    // JSON: one object per line, the fields where a log collector finds them.
    let node = start("json", "info");
    http(
        "GET",
        &node.url("/v1/health"),
        &[("x-request-id", "it-log-2")],
        None,
    );
    let l = line_with(&node, "\"it-log-2\"");
    let v = json(&l);
    assert_eq!(v["target"], "meshgate::access", "{l}");
    assert_eq!(v["level"], "INFO");
    assert_eq!(v["fields"]["status"], 200);
    assert!(v["fields"]["duration_ms"].as_f64().is_some(), "{l}");
    assert_eq!(v["span"]["method"], "GET");
    assert_eq!(v["span"]["path"], "/v1/health");
    drop(node);

    // WARN for the request log (INFO for the node's own events): neither a
    // 200 nor a 404 is logged. The drain writes what the writer thread still
    // held before the process exits; its last line says the log was read to
    // its end.
    let mut node = start("pretty", "warn,meshgate::node=info");
    assert_eq!(
        http(
            "GET",
            &node.url("/v1/health"),
            &[("x-request-id", "it-log-3")],
            None
        )
        .0,
        200
    );
    assert_eq!(
        http(
            "GET",
            &node.url("/v1/nope"),
            &[("x-request-id", "it-log-4")],
            None
        )
        .0,
        404
    );
    node.signal(15);
    assert_eq!(node.wait_exit(Duration::from_secs(20)), Some(0));
    let _ = line_with(&node, "Drained; bye.");
    let log = node.stderr.lock().unwrap().clone();
    assert!(
        !log.contains("it-log-3") && !log.contains("it-log-4") && !log.contains("meshgate::access"),
        "{log}"
    );
}

/// A namespace that was asked for while it did not exist (and is remembered
/// missing for a moment) is found at once once it is created on this node.
#[test]
fn a_namespace_created_right_after_a_miss_is_found_at_once() {
    let node = TestNode::start();
    for _ in 0..3 {
        let (s, b) = node.op("GET", "/v1/namespaces/late", None);
        assert_eq!(s, 404, "{b}");
        assert_eq!(json(&b)["error"]["code"], "NAMESPACE_NOT_FOUND", "{b}");
        let (s, _, b) = http("POST", &node.url("/v1/invoke/late/f"), &[], Some(b""));
        assert_eq!(s, 404, "{}", String::from_utf8_lossy(&b));
    }
    node.create_namespace("late");
    let (s, b) = node.op("GET", "/v1/namespaces/late", None);
    assert_eq!(s, 200, "{b}");
    let (s, _, b) = http("POST", &node.url("/v1/invoke/late/f"), &[], Some(b""));
    assert_eq!(
        json(&String::from_utf8_lossy(&b))["error"]["code"],
        "FUNCTION_NOT_FOUND",
        "status {s}"
    );
}

/// Messages the node supervisor has handled, from this node's `/metrics`
/// (read with the operator key).
fn node_actor_handled(node: &TestNode) -> f64 {
    let auth = format!("Bearer {}", node.operator_key);
    let (s, _, b) = http(
        "GET",
        &node.url("/metrics"),
        &[("authorization", &auth)],
        None,
    );
    assert_eq!(s, 200);
    String::from_utf8_lossy(&b)
        .lines()
        .filter(|l| l.starts_with("meshgate_actor_messages_handled_total{"))
        .filter(|l| l.contains("kind=\"node\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Namespace create and delete go through the node supervisor, the one
/// writer docs/architecture.md names: each is a message it handles (a
/// delete also its supervisor's stop), and the namespace is there, then gone.
#[test]
fn namespace_create_and_delete_are_the_node_supervisors() {
    if single_node_only() {
        return;
    }
    let node = TestNode::start();
    let before = node_actor_handled(&node);
    let (s, b) = node.op("POST", "/v1/namespaces", Some(r#"{"name":"owned"}"#));
    assert_eq!(s, 201, "{b}");
    let created = node_actor_handled(&node);
    assert_eq!(
        created,
        before + 1.0,
        "the create was not a node supervisor message"
    );
    let (s, b) = node.op("POST", "/v1/namespaces", Some(r#"{"name":"owned"}"#));
    assert_eq!(
        (s, json(&b)["error"]["code"].as_str()),
        (409, Some("NAMESPACE_EXISTS"))
    );
    let after_second = node_actor_handled(&node);
    let (s, b) = node.op("DELETE", "/v1/namespaces/owned", None);
    assert_eq!(s, 200, "{b}");
    // DeleteNamespace, then the Forget it sends itself.
    wait_until(
        Duration::from_secs(5),
        "delete and stop not handled",
        || node_actor_handled(&node) >= after_second + 2.0,
    );
    assert_eq!(node.op("GET", "/v1/namespaces/owned", None).0, 404);
    assert_eq!(node.op("DELETE", "/v1/namespaces/owned", None).0, 404);
}

/// Step 4's headers, exact, on every answer the chain gives: a public
/// route, a namespace route's answer and its 404, a refusal of the chain
/// itself (401), an unknown route, a route outside `/v1/` (no
/// `Cache-Control` forced there), and the dashboard.
#[test]
fn security_headers_on_every_answer_of_the_chain() {
    let node = TestNode::start();
    let key = node.create_namespace("headers");
    let auth = format!("Bearer {key}");
    assert_eq!(node.with_key(&key, "PUT", "/v1/kv/k", Some(b"v")).0, 200);
    for (what, path, headers, status, no_store) in [
        ("public", "/v1/health", vec![], 200, true),
        (
            "namespace",
            "/v1/kv/k",
            vec![("authorization", auth.as_str())],
            200,
            true,
        ),
        (
            "handler's 404",
            "/v1/kv/none",
            vec![("authorization", auth.as_str())],
            404,
            true,
        ),
        ("chain's 401", "/v1/kv/k", vec![], 401, true),
        ("unknown route", "/v1/nope", vec![], 404, true),
        ("outside /v1", "/.well-known/jwks.json", vec![], 200, false),
        ("dashboard", "/__admin", vec![], 401, false),
    ] {
        let (s, h, _) = http("GET", &node.url(path), &headers, None);
        assert_eq!(s, status, "{what}");
        assert_eq!(
            (
                header(&h, "x-content-type-options"),
                header(&h, "x-frame-options"),
                header(&h, "referrer-policy"),
            ),
            (Some("nosniff"), Some("DENY"), Some("no-referrer")),
            "{what}: {h:?}"
        );
        if no_store {
            assert_eq!(header(&h, "cache-control"), Some("no-store"), "{what}");
        }
    }
}

/// A namespace supervisor whose mailbox is full answers 503 `OVERLOADED`
/// (retryable, `Retry-After: 1`) at once, not after a wait, and nothing is
/// written; another namespace is served meanwhile. The mailbox is one
/// message (`[server] mailbox_capacity = 1`), held by the fault-injection
/// route `debug/hold`; every node has the configuration.
#[test]
fn a_full_mailbox_answers_503_overloaded() {
    let node = TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}[server]\nmailbox_capacity = 1\n[debug]\nfault_injection = true\n"
        ),
        ..Default::default()
    });
    let busy = node.create_namespace("busy");
    let calm = node.create_namespace("calm");
    // Obeyed: one message at a time goes through.
    assert_eq!(node.with_key(&busy, "PUT", "/v1/kv/k", Some(b"1")).0, 200);
    // On the node that runs the namespace (cluster mode: its member, which
    // answers the forwarded requests below).
    let (s, _, b) = http(
        "POST",
        &format!(
            "{}/v1/namespaces/busy/debug/hold?ms=60000",
            node.member_base()
        ),
        &[OPERATOR_AUTH],
        None,
    );
    assert_eq!(s, 202, "{}", String::from_utf8_lossy(&b));
    // Violated: the hold fills the mailbox until it ends (a minute).
    let auth = format!("Bearer {busy}");
    let (s, h, b) = http(
        "PUT",
        &node.url("/v1/kv/k"),
        &[("authorization", &auth)],
        Some(b"2"),
    );
    let v = json(&String::from_utf8_lossy(&b));
    assert_eq!(
        (
            s,
            v["error"]["code"].as_str(),
            v["error"]["retryable"].as_bool()
        ),
        (503, Some("OVERLOADED"), Some(true)),
        "{v}"
    );
    assert_eq!(header(&h, "retry-after"), Some("1"));
    assert!(
        node.metric_sum("meshgate_actor_overloaded_total") >= 1.0,
        "the refusal is counted"
    );
    assert_eq!(node.with_key(&calm, "PUT", "/v1/kv/k", Some(b"x")).0, 200);
    // Nothing was written (a read does not go through the mailbox).
    assert_eq!(
        node.with_key(&busy, "GET", "/v1/kv/k", None),
        (200, "1".into())
    );
}
