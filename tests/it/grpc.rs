//! gRPC through the node's `[grpc] listen` listener (docs/deployments.md
//! "gRPC"): calls proxied to a Python `grpcio` upstream over HTTP/2 with
//! their trailers, streams both ways, `grpc-timeout` enforced and capped,
//! and the node's own refusals as gRPC statuses. The client is Python
//! `grpcio` too (tests/grpc/grpc_helper.py), or curl where a call must carry
//! what grpcio will not send (a raw or malformed `grpc-timeout`).
//! scripts/test.sh installs grpcio; without it these tests fail saying so.

use crate::common::*;
use crate::deploy::{ALLOW_LOOPBACK, deploy_json};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const HELPER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/grpc/grpc_helper.py");

/// grpcio is there, or the test fails naming the install step.
fn need_grpcio() {
    let ok = Command::new("python3")
        .args(["-c", "import grpc"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "python3 with grpcio is missing: scripts/test.sh installs it (python3 -m pip install grpcio)"
    );
}

/// A `grpc_helper.py serve` upstream on a loopback port; killed on drop.
struct Upstream {
    child: Child,
    port: u16,
}

impl Upstream {
    fn start() -> Upstream {
        need_grpcio();
        let port = free_port();
        let mut child = Command::new("python3")
            .args([HELPER, "serve", &port.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line == "ready" {
                    let _ = tx.send(());
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(30))
            .expect("the grpcio upstream did not start");
        Upstream { child, port }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A node with a gRPC listener that may proxy to loopback upstreams; and
/// that listener's address.
fn grpc_node() -> (TestNode, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[deploy]\n{ALLOW_LOOPBACK}[grpc]\nlisten = \"{addr}\"\n"),
        ..Default::default()
    });
    (node, addr)
}

/// Deploys `name` on `host` to `instances` with extra upstream fields and
/// top-level fields; 201 asserted.
fn deploy(node: &TestNode, key: &str, name: &str, host: &str, upstream: Value, extra: Value) {
    let mut body = json!({"name": name, "hosts": [host], "upstream": upstream});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    let (s, v) = deploy_json(node, key, body);
    assert_eq!(s, 201, "{v}");
}

/// One call by `grpc_helper.py call`: its JSON outcome.
fn call(addr: &str, authority: &str, case: &str, arg: &str, more: &[&str]) -> Value {
    let out = Command::new("python3")
        .args([HELPER, "call", addr, authority, case, arg])
        .args(more)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "grpc_helper call failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// One raw gRPC call by curl (HTTP/2 with prior knowledge) with these
/// extra headers: the answer's status line, headers and trailers as text.
fn curl_call(addr: &str, host: &str, path: &str, headers: &[&str]) -> String {
    let frame = [0u8, 0, 0, 0, 2, b'h', b'i'];
    let dir = tempfile::tempdir().unwrap();
    let body = dir.path().join("frame");
    std::fs::write(&body, frame).unwrap();
    let mut cmd = Command::new("curl");
    cmd.args([
        "-sS",
        "--http2-prior-knowledge",
        "--max-time",
        "10",
        "-D",
        "-",
        "-o",
        "/dev/null",
        "-H",
        "content-type: application/grpc",
        "-H",
        "te: trailers",
        "-H",
    ])
    .arg(format!("host: {host}"));
    for h in headers {
        cmd.args(["-H", h]);
    }
    let out = cmd
        .arg("--data-binary")
        .arg(format!("@{}", body.display()))
        .arg(format!("http://{addr}{path}"))
        .output()
        .expect("curl");
    String::from_utf8_lossy(&out.stdout).to_ascii_lowercase()
}

/// A raw gRPC call by curl with these extra headers: the answer's body
/// (its gRPC frames) as text.
fn curl_body(addr: &str, host: &str, path: &str, headers: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let body = dir.path().join("frame");
    std::fs::write(&body, [0u8, 0, 0, 0, 2, b'h', b'i']).unwrap();
    let mut cmd = Command::new("curl");
    cmd.args([
        "-sS",
        "--http2-prior-knowledge",
        "--max-time",
        "10",
        "-o",
        "-",
    ])
    .args([
        "-H",
        "content-type: application/grpc",
        "-H",
        "te: trailers",
        "-H",
    ])
    .arg(format!("host: {host}"));
    for h in headers {
        cmd.args(["-H", h]);
    }
    let out = cmd
        .arg("--data-binary")
        .arg(format!("@{}", body.display()))
        .arg(format!("http://{addr}{path}"))
        .output()
        .expect("curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A unary and a server-streaming call through the node keep their
/// initial metadata and custom trailers; an upstream's own error status,
/// message and trailers pass unchanged; the call is counted per method.
#[test]
fn unary_and_server_stream_keep_trailers() {
    let up = Upstream::start();
    let (node, addr) = grpc_node();
    let key = node.create_namespace("grpcns");
    // A route per method the operator wants figures for; the rest share "/".
    deploy(
        &node,
        &key,
        "rpc",
        "rpc.grpc.test",
        json!({"instances": [up.url()]}),
        json!({"routes": [{"path_prefix": "/test.Echo/Unary"}, {"path_prefix": "/"}]}),
    );

    let r = call(&addr, "rpc.grpc.test", "Unary", "hello", &[]);
    assert_eq!(r["code"], "OK", "{r}");
    assert_eq!(r["messages"], json!(["hello"]));
    assert_eq!(r["trailers"]["x-custom-trailer"], "kept", "{r}");
    assert_eq!(r["initial"]["x-initial"], "hello", "{r}");
    assert!(r["initial"]["x-request-id"].is_string(), "{r}");

    let r = call(&addr, "rpc.grpc.test", "ServerStream", "5", &[]);
    assert_eq!(r["code"], "OK", "{r}");
    assert_eq!(
        r["messages"],
        json!(["msg-0", "msg-1", "msg-2", "msg-3", "msg-4"])
    );
    assert_eq!(r["trailers"]["x-stream-trailer"], "done", "{r}");

    let r = call(&addr, "rpc.grpc.test", "Fail", "", &[]);
    assert_eq!(r["code"], "NOT_FOUND", "{r}");
    assert_eq!(r["details"], "nothing here", "{r}");
    assert_eq!(r["trailers"]["x-why"], "custom", "{r}");

    // The upstream got the node's forwarding headers and request id.
    let r = call(&addr, "rpc.grpc.test", "Headers", "", &[]);
    let seen: Value = serde_json::from_str(r["messages"][0].as_str().unwrap()).unwrap();
    assert_eq!(seen["x-forwarded-host"], "rpc.grpc.test", "{seen}");
    assert!(seen["x-request-id"].is_string(), "{seen}");
    // A client's internal-auth headers never reach the upstream (the
    // chain's internal-auth gate, on this listener too).
    let echoed = curl_body(
        &addr,
        "rpc.grpc.test",
        "/test.Echo/Headers",
        &[
            "x-internal-auth-namespace: grpcns",
            "x-internal-auth-mac: 1.ab",
            "x-internal-auth-subject: root",
        ],
    );
    assert!(
        echoed.contains("x-request-id"),
        "the upstream echoed: {echoed}"
    );
    assert!(
        !echoed.contains("x-internal-auth"),
        "the upstream saw: {echoed}"
    );

    let metrics = http("GET", &node.url("/metrics"), &[OPERATOR_AUTH], None);
    let text = String::from_utf8_lossy(&metrics.2);
    assert!(
        text.lines()
            .any(|l| l.starts_with("meshgate_route_requests_total")
                && l.contains("route=\"/test.Echo/Unary\"")),
        "no series of /test.Echo/Unary"
    );
    // A method no route names is counted under the route it matched, never
    // under the name the client sent (labels are declared values only).
    assert!(
        text.lines()
            .any(|l| l.starts_with("meshgate_route_requests_total") && l.contains("route=\"/\"")),
        "no series of the / route"
    );
    assert!(
        !text.contains("ServerStream"),
        "a client's method became a label"
    );
    assert!(
        !text.contains("/test.Echo/Fail"),
        "a client's method became a label"
    );
}

/// A bidirectional stream of 1,000 messages arrives whole and in order.
#[test]
fn bidi_stream_of_a_thousand_in_order() {
    let up = Upstream::start();
    let (node, addr) = grpc_node();
    let key = node.create_namespace("grpcbidi");
    deploy(
        &node,
        &key,
        "rpc",
        "bidi.grpc.test",
        json!({"instances": [up.url()]}),
        json!({}),
    );
    let r = call(&addr, "bidi.grpc.test", "Bidi", "1000", &[]);
    assert_eq!(r["code"], "OK", "{r}");
    let got: Vec<String> = r["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap().to_string())
        .collect();
    let want: Vec<String> = (0..1000).map(|i| format!("m{i}")).collect();
    assert_eq!(got, want);
}

/// `grpc-timeout: 100m` against an upstream that sleeps 1 s is answered
/// DEADLINE_EXCEEDED by the node, well before the upstream would answer;
/// the deployment's `grpc.max_timeout_ms` caps a call that asks for
/// longer (the client's own 30 s deadline is not what ends it).
#[test]
fn deadline_is_enforced_and_capped() {
    let up = Upstream::start();
    let (node, addr) = grpc_node();
    let key = node.create_namespace("grpcdl");
    deploy(
        &node,
        &key,
        "rpc",
        "dl.grpc.test",
        json!({"instances": [up.url()]}),
        json!({}),
    );
    deploy(
        &node,
        &key,
        "capped",
        "capped.grpc.test",
        json!({"instances": [up.url()], "grpc": {"max_timeout_ms": 100}}),
        json!({}),
    );
    let (s, b) = node.with_key(&key, "GET", "/v1/deployments/capped", None);
    assert_eq!(s, 200, "{b}");
    let shown = json(&b);
    let target = &shown["deployment"]["target"];
    let target = if target.is_null() {
        &shown["target"]
    } else {
        target
    };
    assert_eq!(target["grpc"]["max_timeout_ms"], 100, "{b}");
    // Warm: the connection to the upstream is made.
    assert_eq!(call(&addr, "dl.grpc.test", "Unary", "x", &[])["code"], "OK");
    let t = Instant::now();
    let head = curl_call(
        &addr,
        "dl.grpc.test",
        "/test.Echo/Sleep",
        &["grpc-timeout: 100m"],
    );
    let took = t.elapsed();
    assert!(head.contains("grpc-status: 4"), "{head}");
    // Loose: the bound is 100 ms + 50 ms; a noisy machine gets more.
    assert!(took < Duration::from_millis(900), "took {took:?}");

    let t = Instant::now();
    let r = call(
        &addr,
        "capped.grpc.test",
        "Sleep",
        "x",
        &["--timeout", "30"],
    );
    assert_eq!(r["code"], "DEADLINE_EXCEEDED", "{r}");
    // The node's status (its message names it), not the client's deadline:
    // the client would have waited 30 s (loose: python's start on a busy machine).
    assert!(r["details"].as_str().unwrap().contains("meshgate"), "{r}");
    assert!(t.elapsed() < Duration::from_secs(20));
    // A cap outside its range is refused with nothing stored.
    let (s, v) = deploy_json(
        &node,
        &key,
        json!({"name": "bad", "hosts": ["bad.grpc.test"],
               "upstream": {"instances": [up.url()], "grpc": {"max_timeout_ms": 0}}}),
    );
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (400, Some("INVALID_UPSTREAM")),
        "{v}"
    );
    let (s, _) = node.with_key(&key, "GET", "/v1/deployments/bad", None);
    assert_eq!(s, 404);
}

/// A malformed `grpc-timeout` is answered INTERNAL (as gRPC's own servers
/// do) in a Trailers-Only answer; a request that is not gRPC is 415.
#[test]
fn malformed_timeout_is_internal() {
    let up = Upstream::start();
    let (node, addr) = grpc_node();
    let key = node.create_namespace("grpcbad");
    deploy(
        &node,
        &key,
        "rpc",
        "bad.grpc.test",
        json!({"instances": [up.url()]}),
        json!({}),
    );
    for bad in ["soon", "123456789m", "10", "-5S", "5 S"] {
        let head = curl_call(
            &addr,
            "bad.grpc.test",
            "/test.Echo/Unary",
            &[&format!("grpc-timeout: {bad}")],
        );
        assert!(head.starts_with("http/2 200"), "{bad}: {head}");
        assert!(head.contains("content-type: application/grpc"), "{head}");
        assert!(head.contains("grpc-status: 13"), "{bad}: {head}");
        assert!(head.contains("grpc-message: "), "{head}");
    }
    let out = Command::new("curl")
        .args([
            "-sS",
            "--http2-prior-knowledge",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .args([
            "-H",
            "host: bad.grpc.test",
            "-H",
            "content-type: application/json",
        ])
        .args(["--data", "{}"])
        .arg(format!("http://{addr}/test.Echo/Unary"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "415");
    // The node still serves calls.
    assert_eq!(
        call(&addr, "bad.grpc.test", "Unary", "x", &[])["code"],
        "OK"
    );
}

/// The node's own failures are gRPC statuses: no deployment on the host
/// is UNIMPLEMENTED, an instance that refuses connections is UNAVAILABLE,
/// an upstream that dies mid-stream ends the call with a status (the
/// client does not hang).
#[test]
fn own_failures_are_grpc_statuses() {
    let up = Upstream::start();
    let (node, addr) = grpc_node();
    let key = node.create_namespace("grpcfail");
    let r = call(&addr, "nobody.grpc.test", "Unary", "x", &[]);
    assert_eq!(r["code"], "UNIMPLEMENTED", "{r}");

    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    deploy(
        &node,
        &key,
        "gone",
        "gone.grpc.test",
        json!({"instances": [format!("http://127.0.0.1:{dead}")]}),
        json!({}),
    );
    let r = call(&addr, "gone.grpc.test", "Unary", "x", &[]);
    assert_eq!(r["code"], "UNAVAILABLE", "{r}");

    deploy(
        &node,
        &key,
        "dies",
        "dies.grpc.test",
        json!({"instances": [up.url()]}),
        json!({}),
    );
    let t = Instant::now();
    let r = call(&addr, "dies.grpc.test", "Die", "", &["--timeout", "20"]);
    assert_eq!(r["messages"], json!(["one", "two"]), "{r}");
    assert_eq!(r["code"], "UNAVAILABLE", "{r}");
    assert!(t.elapsed() < Duration::from_secs(15), "the client hung");
}

/// A route whose policy needs an API key: none is UNAUTHENTICATED,
/// another namespace's key PERMISSION_DENIED, the namespace's own key
/// passes and the upstream gets the checked identity; a route rate limit
/// refuses with RESOURCE_EXHAUSTED.
#[test]
fn route_policy_refusals_are_grpc_statuses() {
    let up = Upstream::start();
    let (node, addr) = grpc_node();
    let key = node.create_namespace("grpcauth");
    let other = node.create_namespace("grpcother");
    deploy(
        &node,
        &key,
        "locked",
        "locked.grpc.test",
        json!({"instances": [up.url()]}),
        json!({"routes": [
            {"path_prefix": "/test.Echo/Unary", "policy": {"rate_limit": {"requests_per_second": 1, "burst": 1}}},
            {"path_prefix": "/", "policy": {"auth": "api_key"}}
        ]}),
    );
    let r = call(&addr, "locked.grpc.test", "Headers", "", &[]);
    assert_eq!(r["code"], "UNAUTHENTICATED", "{r}");
    let r = call(&addr, "locked.grpc.test", "Headers", "", &["--key", &other]);
    assert_eq!(r["code"], "PERMISSION_DENIED", "{r}");
    let r = call(&addr, "locked.grpc.test", "Headers", "", &["--key", &key]);
    assert_eq!(r["code"], "OK", "{r}");
    let seen: Value = serde_json::from_str(r["messages"][0].as_str().unwrap()).unwrap();
    assert_eq!(seen["x-meshgate-namespace"], "grpcauth", "{seen}");
    assert_eq!(
        seen["x-api-key"],
        Value::Null,
        "the key is not forwarded: {seen}"
    );

    // One call a second, burst 1: of 20 calls back to back, the first
    // passes and most of the others are refused.
    let r = call(&addr, "locked.grpc.test", "Unary", "x", &["--repeat", "20"]);
    let codes = r["codes"].as_array().unwrap();
    assert_eq!(codes[0], "OK", "{r}");
    assert!(
        codes.iter().filter(|c| *c == "RESOURCE_EXHAUSTED").count() >= 10,
        "{r}"
    );
}

/// One raw gRPC call over TLS by curl (`-k`: the node's self-signed
/// certificate), with `sni` as the TLS server name and `host` as the
/// call's `:authority`: the answer's head and trailers as text.
fn curl_tls_call(addr: &str, sni: &str, host: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let body = dir.path().join("frame");
    std::fs::write(&body, [0u8, 0, 0, 0, 2, b'h', b'i']).unwrap();
    let out = Command::new("curl")
        .args([
            "-sS",
            "-k",
            "--http2",
            "--max-time",
            "10",
            "-D",
            "-",
            "-o",
            "/dev/null",
        ])
        .args(["-H", "content-type: application/grpc", "-H", "te: trailers"])
        .arg("-H")
        .arg(format!("host: {host}"))
        .arg("--connect-to")
        .arg(format!("{sni}:443:{addr}"))
        .arg("--data-binary")
        .arg(format!("@{}", body.display()))
        .arg(format!("https://{sni}/test.Echo/Unary"))
        .output()
        .expect("curl");
    String::from_utf8_lossy(&out.stdout).to_ascii_lowercase()
}

/// With `[tls]` set the gRPC listener is TLS with ALPN h2 and the node's
/// certificate: a call whose TLS server name is its host is proxied with
/// its trailers; one whose server name is another is refused UNAVAILABLE
/// (HTTP's 421).
#[test]
fn tls_listener_checks_the_server_name() {
    let up = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    crate::deploy::make_cert(dir.path(), "grpc-node.test");
    let data = dir.path().join("data");
    {
        // The deployment is made on a plain node, then served over TLS.
        let mut plain = TestNode::start_with(NodeOpts {
            config: format!("{TEST_CONFIG}[deploy]\n{ALLOW_LOOPBACK}"),
            data_dir: Some(data.clone()),
            ..Default::default()
        });
        let key = plain.create_namespace("grpctls");
        deploy(
            &plain,
            &key,
            "rpc",
            "tls.grpc.test",
            json!({"instances": [up.url()]}),
            json!({}),
        );
        plain.signal(15);
        assert!(plain.wait_exit(Duration::from_secs(30)).is_some());
    }
    let addr = format!("127.0.0.1:{}", free_port());
    let _node = TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}[deploy]\n{ALLOW_LOOPBACK}[grpc]\nlisten = \"{addr}\"\n[tls]\ncert_file = {:?}\nkey_file = {:?}\n",
            dir.path().join("cert.pem"),
            dir.path().join("key.pem")
        ),
        data_dir: Some(data),
        no_wait_ready: true,
        ..Default::default()
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut head = String::new();
    while !head.contains("grpc-status: 0") {
        assert!(
            Instant::now() < deadline,
            "no call over TLS answered: {head}"
        );
        std::thread::sleep(Duration::from_millis(100));
        head = curl_tls_call(&addr, "tls.grpc.test", "tls.grpc.test");
    }
    assert!(head.starts_with("http/2 200"), "{head}");
    assert!(head.contains("x-custom-trailer: kept"), "{head}");
    let head = curl_tls_call(&addr, "a.test", "tls.grpc.test");
    assert!(head.contains("grpc-status: 14"), "{head}");
    assert!(
        head.contains("does not match the tls server name"),
        "{head}"
    );
}
