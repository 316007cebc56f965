//! The command-line client's commands: what each prints (and what it did
//! to the node, seen through the node's HTTP API), and what a refusal or a
//! bad input prints instead.

use crate::common::*;
use serde_json::Value;
use std::io::{Read, Write};
use std::time::Duration;

/// Runs `meshgate ARGS --url BASE`; panics on a non-zero exit; returns stdout.
pub(crate) fn cli(base: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(bin())
        .args(args)
        .args(["--url", base])
        .env_remove("MESHGATE_KEY")
        .env_remove("MESHGATE_URL")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What the CLI printed, as JSON.
pub(crate) fn printed(out: &str) -> Value {
    json(out.trim())
}

/// An upstream on 127.0.0.1 that answers every request `upstream says hi`.
fn upstream() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut chunk) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
                    buf.drain(..end + 4);
                    let body = "upstream says hi";
                    let res = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if s.write_all(res.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

/// A GET of `/` on `host` through the node: status and body.
fn routed(node: &TestNode, host: &str) -> (u16, String) {
    let (s, _, b) = http("GET", &node.url("/"), &[("host", host)], None);
    (s, String::from_utf8_lossy(&b).into_owned())
}

/// `keys revoke` prints the revocation and the key stops working;
/// `deploy upstream` prints the deployment and its host is proxied,
/// `deploy show` prints it with its instance, `deploy delete` prints the
/// deletion and the host is no longer routed; `ns list` prints the
/// namespace, `ns delete` prints the deletion, and the namespace and its
/// key are gone.
#[test]
fn cli_keys_namespaces_and_deployments() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[deploy]\nupstream_allow = [\"127.0.0.0/8\"]\n"),
        ..Default::default()
    });
    let base = node.base.as_str();
    let owner = node.create_namespace("clins");
    let (s, b) = node.with_key(
        &owner,
        "POST",
        "/v1/auth/api-keys",
        Some(br#"{"name":"doomed","role":"reader"}"#),
    );
    assert_eq!(s, 201, "{b}");
    let created = json(&b);
    let reader = created["api_key"].as_str().unwrap().to_string();
    let id = created["key"]["id"].as_str().unwrap().to_string();
    assert_eq!(node.with_key(&reader, "GET", "/v1/kv/x", None).0, 404);

    // keys revoke: prints what it revoked; the key is refused from then on.
    let out = printed(&cli(base, &["keys", "revoke", &id, "--key", &owner]));
    assert_eq!(out, serde_json::json!({"ok": true, "revoked": id}));
    wait_until(Duration::from_secs(10), "the revoked key refused", || {
        node.with_key(&reader, "GET", "/v1/kv/x", None).0 == 401
    });
    let (s, b) = node.with_key(&owner, "GET", "/v1/auth/api-keys", None);
    assert_eq!(s, 200, "{b}");
    let listed = json(&b)["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["id"] == id.as_str())
        .cloned()
        .unwrap_or_else(|| panic!("{id} not listed: {b}"));
    assert_eq!(listed["revoked"], true, "{listed}");

    // deploy upstream: prints the deployment; its host is proxied.
    let up = upstream();
    let host = "api.clins.example.test";
    let out = printed(&cli(
        base,
        &[
            "deploy",
            "upstream",
            &format!("{up}=3"),
            "--host",
            host,
            "--name",
            "api",
            "--balance",
            "least_request",
            "--health-path",
            "/",
            "--health-interval-ms",
            "2000",
            "--key",
            &owner,
        ],
    ));
    let d = &out["deployment"];
    assert_eq!(
        (
            d["name"].as_str(),
            d["hosts"].clone(),
            d["namespace"].as_str()
        ),
        (Some("api"), serde_json::json!([host]), Some("clins")),
        "{out:#}"
    );
    wait_until(Duration::from_secs(10), "the host proxied", || {
        routed(&node, host) == (200, "upstream says hi".into())
    });
    // deploy show: the deployment with its instance and the instance's health,
    // in the answer every deployment route gives (`{"ok", "deployment"}`).
    let shown = printed(&cli(base, &["deploy", "show", "api", "--key", &owner]));
    assert_eq!(shown["ok"], true, "{shown:#}");
    let out = &shown["deployment"];
    assert_eq!(
        (out["name"].as_str(), out["target"]["kind"].as_str()),
        (Some("api"), Some("upstream")),
        "{out:#}"
    );
    let instances = out["target"]["instances"].as_array().unwrap();
    assert_eq!(instances.len(), 1, "{out:#}");
    assert_eq!(
        (
            instances[0]["url"].as_str(),
            instances[0]["healthy"].as_bool()
        ),
        (Some(up.as_str()), Some(true)),
        "{out:#}"
    );
    // The weight, balance and health check given as flags.
    assert_eq!(instances[0]["weight"], 3, "{out:#}");
    assert_eq!(out["target"]["balance"], "least_request", "{out:#}");
    assert_eq!(out["target"]["health"]["path"], "/", "{out:#}");
    assert_eq!(out["target"]["health"]["interval_ms"], 2000, "{out:#}");
    // Gzip of the upstream's answers: on unless --no-compress.
    assert_eq!(out["target"]["compress"], true, "{out:#}");
    // deploy activity: the latest requests this node served (per node).
    if !crate::common::cluster_mode() {
        let out = printed(&cli(
            base,
            &["deploy", "activity", "api", "--limit", "1", "--key", &owner],
        ));
        let reqs = out["requests"].as_array().unwrap();
        assert_eq!(reqs.len(), 1, "{out:#}");
        assert_eq!(reqs[0]["status"], 200, "{out:#}");
        assert_eq!(reqs[0]["instance"].as_str(), Some(up.as_str()), "{out:#}");
    }
    // deploy delete: prints the deletion; the host is routed nowhere.
    let out = printed(&cli(base, &["deploy", "delete", "api", "--key", &owner]));
    assert_eq!(out, serde_json::json!({"ok": true, "deleted": "api"}));
    wait_until(Duration::from_secs(10), "the host no longer routed", || {
        routed(&node, host).0 == 404
    });
    let (s, b) = node.with_key(&owner, "GET", "/v1/deployments/api", None);
    assert_eq!(s, 404, "{b}");

    // ns list: the namespace; ns delete: prints the deletion; it is gone.
    let names = |v: &Value| -> Vec<String> {
        v["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["name"].as_str().unwrap().to_string())
            .collect()
    };
    let out = printed(&cli(base, &["ns", "list", "--key", OPERATOR_KEY]));
    assert!(names(&out).contains(&"clins".to_string()), "{out:#}");
    let out = printed(&cli(
        base,
        &["ns", "delete", "clins", "--key", OPERATOR_KEY],
    ));
    assert_eq!(out, serde_json::json!({"ok": true, "deleted": "clins"}));
    let (s, b) = node.op("GET", "/v1/namespaces/clins", None);
    assert_eq!(s, 404, "{b}");
    wait_until(
        Duration::from_secs(10),
        "the deleted namespace's key refused",
        || node.with_key(&owner, "GET", "/v1/kv/x", None).0 == 401,
    );
    let out = printed(&cli(base, &["ns", "list", "--key", OPERATOR_KEY]));
    assert!(!names(&out).contains(&"clins".to_string()), "{out:#}");
}

/// `deploy upstream --auth jwt --require-grant G` deploys the routes' default
/// policy (and `--no-compress` turns gzip off, `--grpc-max-timeout-ms` caps gRPC deadlines): the printed deployment's route carries it, the host answers 401
/// without a token and proxies with a token holding G; a bad `--auth` is
/// refused by the node (non-zero exit).
#[test]
fn cli_deploy_upstream_with_a_policy() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[deploy]\nupstream_allow = [\"127.0.0.0/8\"]\n"),
        ..Default::default()
    });
    let base = node.base.as_str();
    let owner = node.create_namespace("clipol");
    let up = upstream();
    let host = "api.clipol.example.test";
    let out = printed(&cli(
        base,
        &[
            "deploy",
            "upstream",
            &up,
            "--host",
            host,
            "--name",
            "api",
            "--auth",
            "jwt",
            "--require-grant",
            "deployments:read:api",
            "--no-compress",
            "--grpc-max-timeout-ms",
            "2500",
            "--key",
            &owner,
        ],
    ));
    assert_eq!(out["deployment"]["target"]["compress"], false, "{out:#}");
    assert_eq!(
        out["deployment"]["target"]["grpc"]["max_timeout_ms"], 2500,
        "{out:#}"
    );
    let route = &out["deployment"]["routes"][0];
    assert_eq!(route["policy"]["auth"], "jwt", "{out:#}");
    assert_eq!(
        route["policy"]["require_grants"],
        serde_json::json!(["deployments:read:api"]),
        "{out:#}"
    );
    wait_until(Duration::from_secs(10), "the host asks for a token", || {
        routed(&node, host).0 == 401
    });
    let body = format!("{{\"api_key\":\"{owner}\"}}");
    let (s, b) = node.with_key("", "POST", "/v1/auth/token", Some(body.as_bytes()));
    assert_eq!(s, 200, "{b}");
    let token = json(&b)["access_token"].as_str().unwrap().to_string();
    let auth = format!("Bearer {token}");
    let (s, _, b) = http(
        "GET",
        &node.url("/"),
        &[("host", host), ("authorization", &auth)],
        None,
    );
    assert_eq!(
        (s, String::from_utf8_lossy(&b).as_ref()),
        (200, "upstream says hi")
    );
    let out = std::process::Command::new(bin())
        .args(["deploy", "upstream", &up, "--host", host, "--name", "api"])
        .args(["--auth", "basic", "--key", &owner, "--url", base])
        .env_remove("MESHGATE_KEY")
        .env_remove("MESHGATE_URL")
        .output()
        .unwrap();
    assert!(!out.status.success());
}

/// `deploy static --auth api_key --require-grant G` (the same flags as
/// `deploy upstream`) sends the site's default policy: the printed
/// deployment's route carries it, the host answers 401 without a key and
/// serves the site with a key holding G; `--policy` JSON takes the flags on
/// top; a bad `--auth` is refused by the node (non-zero exit) and stores
/// no new version.
#[test]
fn cli_deploy_static_with_a_policy() {
    let node = TestNode::start();
    let base = node.base.as_str();
    let owner = node.create_namespace("clistat");
    let site = tempfile::tempdir().unwrap();
    std::fs::write(site.path().join("index.html"), "members only").unwrap();
    let dir = site.path().to_str().unwrap();
    let host = "www.clistat.example.test";
    let out = printed(&cli(
        base,
        &[
            "deploy",
            "static",
            dir,
            "--host",
            host,
            "--name",
            "www",
            "--policy",
            r#"{"auth": "jwt", "rate_limit": {"requests_per_second": 1000}}"#,
            "--auth",
            "api_key",
            "--require-grant",
            "deployments:read:www",
            "--key",
            &owner,
        ],
    ));
    let policy = &out["deployment"]["routes"][0]["policy"];
    assert_eq!(policy["auth"], "api_key", "{out:#}");
    assert_eq!(
        policy["require_grants"],
        serde_json::json!(["deployments:read:www"]),
        "{out:#}"
    );
    assert_eq!(policy["rate_limit"]["requests_per_second"], 1000, "{out:#}");
    wait_until(Duration::from_secs(10), "the host asks for a key", || {
        routed(&node, host).0 == 401
    });
    let (s, _, b) = http(
        "GET",
        &node.url("/"),
        &[("host", host), ("x-api-key", &owner)],
        None,
    );
    assert_eq!(
        (s, String::from_utf8_lossy(&b).as_ref()),
        (200, "members only")
    );
    let out = std::process::Command::new(bin())
        .args(["deploy", "static", dir, "--host", host, "--name", "www"])
        .args(["--auth", "basic", "--key", &owner, "--url", base])
        .env_remove("MESHGATE_KEY")
        .env_remove("MESHGATE_URL")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("INVALID_POLICY"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (s, b) = node.with_key(&owner, "GET", "/v1/deployments/www/versions", None);
    assert_eq!(s, 200, "{b}");
    assert_eq!(json(&b)["versions"].as_array().unwrap().len(), 1, "{b}");
}

/// Runs `meshgate ARGS --url BASE` that must fail: its exit code, stdout
/// and stderr.
fn cli_fails(base: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(bin())
        .args(args)
        .args(["--url", base])
        .env_remove("MESHGATE_KEY")
        .env_remove("MESHGATE_URL")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        !out.status.success(),
        "{args:?} succeeded: {stdout}{stderr}"
    );
    (out.status.code(), stdout, stderr)
}

/// Publishes `data` to `topic` over HTTP; returns the ack.
fn publish(node: &TestNode, key: &str, topic: &str, data: &str) -> Value {
    use base64::Engine as _;
    let body = serde_json::json!({
        "topic": topic,
        "data_base64": base64::engine::general_purpose::STANDARD.encode(data),
    });
    let (s, b) = node.with_key(
        key,
        "POST",
        "/v1/pubsub/publish",
        Some(body.to_string().as_bytes()),
    );
    assert_eq!(s, 200, "{b}");
    json(&b)
}

/// Gives the namespace's `chat.*` topics a history (100 kept, for an hour).
fn keep_chat_history(node: &TestNode, ns: &str, key: &str) {
    let rules = br#"{"history":[{"topics":"chat.*","size":100,"ttl_seconds":3600}]}"#;
    let (s, b) = node.with_key(
        key,
        "PUT",
        &format!("/v1/namespaces/{ns}/pubsub"),
        Some(rules),
    );
    assert_eq!(s, 200, "{b}");
}

/// A `meshgate sub` running in the background, its output gathered.
struct Sub {
    child: std::process::Child,
    stdout: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Sub {
    /// Starts `meshgate sub ARGS --url BASE` and waits for its
    /// "subscribed to" line.
    fn start(base: &str, args: &[&str]) -> Sub {
        use std::process::Stdio;
        let mut child = std::process::Command::new(bin())
            .arg("sub")
            .args(args)
            .args(["--url", base])
            .env_remove("MESHGATE_KEY")
            .env_remove("MESHGATE_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (mut o, mut e) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        let (so, se) = (stdout.clone(), stderr.clone());
        let readers = vec![
            std::thread::spawn(move || {
                let mut b = [0u8; 4096];
                while let Ok(n @ 1..) = o.read(&mut b) {
                    so.lock().unwrap().extend_from_slice(&b[..n]);
                }
            }),
            std::thread::spawn(move || {
                let mut b = [0u8; 4096];
                while let Ok(n @ 1..) = e.read(&mut b) {
                    se.lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&b[..n]));
                }
            }),
        ];
        let sub = Sub {
            child,
            stdout,
            stderr,
            readers,
        };
        wait_until(Duration::from_secs(20), "sub subscribed", || {
            sub.stderr.lock().unwrap().contains("subscribed to")
        });
        sub
    }

    /// Waits until stdout holds `n` bytes, stops the subscriber and
    /// returns everything it printed.
    fn stop_after(mut self, n: usize) -> Vec<u8> {
        wait_until(Duration::from_secs(20), "sub printed the messages", || {
            self.stdout.lock().unwrap().len() >= n
        });
        let _ = self.child.kill();
        let _ = self.child.wait();
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        self.stdout.lock().unwrap().clone()
    }
}

impl Drop for Sub {
    /// A test that fails midway leaves no subscriber running.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `sub` on a history topic prints each message's data on its own line and
/// nothing else (no 8-byte offset before it); `--offsets` prints
/// `OFFSET<TAB>DATA`, `-` for the offset of a topic without history.
#[test]
fn cli_sub_prints_the_data_and_offsets_on_request() {
    let node = TestNode::start();
    let base = node.base.as_str();
    let key = node.create_namespace("clisub");
    keep_chat_history(&node, "clisub", &key);
    let plain = Sub::start(base, &["chat.1", "--key", &key]);
    let offsets = Sub::start(base, &["chat.1", "--offsets", "--key", &key]);
    let no_history = Sub::start(base, &["news", "--offsets", "--key", &key]);
    assert_eq!(publish(&node, &key, "chat.1", "hello")["offset"], 1);
    assert_eq!(publish(&node, &key, "chat.1", "again")["offset"], 2);
    publish(&node, &key, "news", "plain");
    let out = plain.stop_after("hello\nagain\n".len());
    assert_eq!(String::from_utf8_lossy(&out), "hello\nagain\n");
    let out = offsets.stop_after("1\thello\n2\tagain\n".len());
    assert_eq!(String::from_utf8_lossy(&out), "1\thello\n2\tagain\n");
    let out = no_history.stop_after("-\tplain\n".len());
    assert_eq!(String::from_utf8_lossy(&out), "-\tplain\n");
}

/// A refused `sub` handshake says the node's status, code and message
/// (not awc's "Invalid response status"), prints nothing on stdout and
/// exits non-zero: a bad key, a missing grant, a reserved topic.
#[test]
fn cli_sub_refused_prints_the_nodes_code() {
    let node = TestNode::start();
    let base = node.base.as_str();
    let owner = node.create_namespace("clisubno");
    let (s, b) = node.with_key(
        &owner,
        "POST",
        "/v1/auth/api-keys",
        Some(br#"{"name":"chat only","grants":["pubsub:subscribe:chat.*"]}"#),
    );
    assert_eq!(s, 201, "{b}");
    let chat_only = json(&b)["api_key"].as_str().unwrap().to_string();
    let (owner, chat_only) = (owner.as_str(), chat_only.as_str());
    for (args, expected) in [
        (
            vec!["sub", "chat.1", "--key", "nope"],
            "401 MALFORMED_TOKEN: ",
        ),
        (
            vec!["sub", "news", "--key", chat_only],
            "403 MISSING_GRANT: ",
        ),
        (
            vec!["sub", "_mg/internal", "--key", owner],
            "403 RESERVED_TOPIC: ",
        ),
    ] {
        let (code, stdout, stderr) = cli_fails(base, &args);
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with(&format!("meshgate: {expected}")),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("Invalid response status"), "{stderr}");
        assert!(!stderr.contains("subscribed"), "{stderr}");
        assert_eq!(stdout, "", "{args:?}");
    }
}

/// A second `serve` on an address a node holds fails with one line that
/// names the address and how to pick another (`--listen`,
/// `MESHGATE_SERVER_LISTEN`): exit 1, no panic and no backtrace (even with
/// RUST_BACKTRACE=1), and nothing opened or written (the data folder is
/// never made).
#[test]
fn cli_serve_on_a_taken_port_says_so_in_one_line() {
    let node = TestNode::start();
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let (code, err) = crate::node::run_serve(
        &["--listen", &node.addr, "--data-dir", data.to_str().unwrap()],
        &[("RUST_BACKTRACE", "1")],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(1), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    let line = lines[0];
    assert!(
        line.starts_with(&format!("meshgate: cannot listen on {}: ", node.addr)),
        "{line}"
    );
    for part in ["already in use", "--listen", "MESHGATE_SERVER_LISTEN"] {
        assert!(line.contains(part), "{part:?} missing: {line}");
    }
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );
    assert!(!data.exists(), "a start that cannot listen opens nothing");
    // The node holding the address is unharmed.
    assert_eq!(http("GET", &node.url("/readyz"), &[], None).0, 200);
}

/// `keys create`: the kind follows the role (`rk` for runtime, `sk` for
/// the others and for a key of grants only); `--kind` chooses it for a key
/// of grants; a kind the role does not pair with is refused before any key
/// is made; an unknown kind is refused by the node (400).
#[test]
fn cli_keys_create_kind_follows_the_role() {
    let node = TestNode::start();
    let base = node.base.as_str();
    let owner = node.create_namespace("clikind");
    let create = |args: &[&str]| -> String {
        let mut all: Vec<&str> = vec!["keys", "create", "--key", &owner];
        all.extend_from_slice(args);
        cli(base, &all).trim().to_string()
    };
    let kind = |key: &str| key.get(..6).unwrap_or_default().to_string();
    assert_eq!(kind(&create(&["--role", "runtime"])), "mg_rk_");
    assert_eq!(kind(&create(&["--role", "Runtime"])), "mg_rk_");
    assert_eq!(kind(&create(&["--role", "developer"])), "mg_sk_");
    assert_eq!(kind(&create(&["--role", "reader"])), "mg_sk_");
    assert_eq!(kind(&create(&["--grant", "kv:read:*"])), "mg_sk_");
    assert_eq!(
        kind(&create(&["--grant", "kv:read:*", "--kind", "rk"])),
        "mg_rk_"
    );
    assert_eq!(
        kind(&create(&["--role", "runtime", "--kind", "rk"])),
        "mg_rk_"
    );
    // The runtime key works: it reads KV (404: no such key, not 401/403).
    let rk = create(&["--role", "runtime"]);
    assert_eq!(node.with_key(&rk, "GET", "/v1/kv/x", None).0, 404);

    let count = || {
        let (s, b) = node.with_key(&owner, "GET", "/v1/auth/api-keys", None);
        assert_eq!(s, 200, "{b}");
        json(&b)["keys"].as_array().unwrap().len()
    };
    let before = count();
    for (args, expected) in [
        (
            vec!["--role", "runtime", "--kind", "sk"],
            "meshgate: --kind sk does not go with --role runtime",
        ),
        (
            vec!["--role", "owner", "--kind", "rk"],
            "meshgate: --kind rk does not go with --role owner",
        ),
        (
            vec!["--grant", "kv:read:*", "--kind", "xk"],
            "meshgate: 400 BAD_REQUEST: kind \"xk\" is not sk or rk",
        ),
    ] {
        let mut all: Vec<&str> = vec!["keys", "create", "--key", &owner];
        all.extend_from_slice(&args);
        let (code, stdout, stderr) = cli_fails(base, &all);
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        assert!(stderr.starts_with(expected), "{args:?}: {stderr}");
        assert_eq!(stdout, "", "{args:?}");
    }
    assert_eq!(count(), before, "no key made by a refused create");
}

/// `history` prints the kept messages' data, oldest first, following
/// every page (pages of 2 here); `--since`, `--offsets`, `--reverse`,
/// `--limit` (one page, and where to read on) and `--json`; a wrong epoch
/// is the node's 400 BAD_OFFSET; a topic without history prints nothing
/// and says so.
#[test]
fn cli_history_reads_the_kept_messages() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[pubsub]\nmax_recovered_publications = 2\n"),
        ..Default::default()
    });
    let base = node.base.as_str();
    let key = node.create_namespace("clihist");
    keep_chat_history(&node, "clihist", &key);
    let mut epoch = String::new();
    for (i, m) in ["m1", "m2", "m3"].into_iter().enumerate() {
        let ack = publish(&node, &key, "chat.1", m);
        assert_eq!(ack["offset"], i as u64 + 1, "{ack}");
        epoch = ack["epoch"].as_str().unwrap().to_string();
    }
    let history = |args: &[&str]| {
        let mut all: Vec<&str> = vec!["history", "chat.1", "--key", &key];
        all.extend_from_slice(args);
        cli(base, &all)
    };
    assert_eq!(history(&[]), "m1\nm2\nm3\n");
    assert_eq!(history(&["--since", "1", "--offsets"]), "2\tm2\n3\tm3\n");
    assert_eq!(history(&["--reverse"]), "m3\nm2\nm1\n");
    assert_eq!(history(&["--since", "1", "--epoch", &epoch]), "m2\nm3\n");
    // One page: what is left is named on stderr.
    let out = std::process::Command::new(bin())
        .args([
            "history", "chat.1", "--limit", "1", "--key", &key, "--url", base,
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "m1\n");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--since 1"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // --json: the node's answer, every page's publications in one list.
    let v = printed(&history(&["--json"]));
    assert_eq!(v["topic"], "chat.1", "{v:#}");
    assert_eq!(v["epoch"], epoch.as_str(), "{v:#}");
    let offsets: Vec<u64> = v["publications"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["offset"].as_u64().unwrap())
        .collect();
    assert_eq!(offsets, [1, 2, 3], "{v:#}");
    assert_eq!(v["publications"][0]["data_base64"], "bTE=", "{v:#}");

    let (code, stdout, stderr) = cli_fails(
        base,
        &[
            "history", "chat.1", "--since", "1", "--epoch", "nope", "--key", &key,
        ],
    );
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.starts_with("meshgate: 400 BAD_OFFSET: "), "{stderr}");
    assert_eq!(stdout, "");

    let out = std::process::Command::new(bin())
        .args(["history", "news", "--key", &key, "--url", base])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("news keeps no history"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `quotas show` prints each quota's limit and use for the key's own
/// namespace (or the operator's `-n`); `quotas set` (operator) replaces the
/// overrides and prints the new limits; a namespace key may not set them
/// (the node's 403), a limit that is no number is refused by the CLI, an
/// unknown quota by the node (400).
#[test]
fn cli_quotas_show_and_set() {
    let node = TestNode::start();
    let base = node.base.as_str();
    let owner = node.create_namespace("cliquota");
    let (s, b) = node.with_key(&owner, "PUT", "/v1/kv/a", Some(b"1"));
    assert_eq!(s, 200, "{b}");
    let out = printed(&cli(base, &["quotas", "show", "--key", &owner]));
    assert_eq!(out["namespace"], "cliquota", "{out:#}");
    assert_eq!(out["quotas"]["kv_keys"]["used"], 1, "{out:#}");
    let default_keys = out["quotas"]["kv_keys"]["limit"].as_u64().unwrap();
    assert!(default_keys > 5, "{out:#}");

    let out = printed(&cli(
        base,
        &[
            "quotas",
            "set",
            "kv_keys=5",
            "sockets=3",
            "-n",
            "cliquota",
            "--key",
            OPERATOR_KEY,
        ],
    ));
    assert_eq!(out["quotas"]["kv_keys"]["limit"], 5, "{out:#}");
    assert_eq!(out["quotas"]["sockets"]["limit"], 3, "{out:#}");
    let out = printed(&cli(
        base,
        &["quotas", "show", "-n", "cliquota", "--key", OPERATOR_KEY],
    ));
    assert_eq!(out["quotas"]["kv_keys"]["limit"], 5, "{out:#}");
    // Replaced whole: sockets is the default again.
    let out = printed(&cli(
        base,
        &[
            "quotas",
            "set",
            "kv_keys=6",
            "-n",
            "cliquota",
            "--key",
            OPERATOR_KEY,
        ],
    ));
    assert_eq!(out["quotas"]["kv_keys"]["limit"], 6, "{out:#}");
    assert_ne!(out["quotas"]["sockets"]["limit"], 3, "{out:#}");

    let owner_key = owner.as_str();
    for (args, expected) in [
        (
            vec![
                "quotas",
                "set",
                "kv_keys=1",
                "-n",
                "cliquota",
                "--key",
                owner_key,
            ],
            "meshgate: 403 OPERATOR_ONLY: ",
        ),
        (
            vec![
                "quotas",
                "set",
                "kv_keys=lots",
                "-n",
                "cliquota",
                "--key",
                OPERATOR_KEY,
            ],
            "meshgate: \"kv_keys=lots\": the limit after = is not a whole number",
        ),
        (
            vec![
                "quotas",
                "set",
                "nope=1",
                "-n",
                "cliquota",
                "--key",
                OPERATOR_KEY,
            ],
            "meshgate: 400 BAD_REQUEST: \"nope\" is not a quota",
        ),
        (
            vec!["quotas", "set", "kv_keys=1", "--key", OPERATOR_KEY],
            "meshgate: name the namespace: -n/--namespace NAME",
        ),
    ] {
        let (code, stdout, stderr) = cli_fails(base, &args);
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        assert!(stderr.starts_with(expected), "{args:?}: {stderr}");
        assert_eq!(stdout, "", "{args:?}");
    }
    // None of the refused sets changed the limit.
    let out = printed(&cli(base, &["quotas", "show", "--key", &owner]));
    assert_eq!(out["quotas"]["kv_keys"]["limit"], 6, "{out:#}");
}

/// `wallet sign-in` asks a challenge, signs it with the key file's Ed25519
/// key and prints the access token, which speaks for `wallet:<address>`
/// (the address `wallet address` prints); a namespace that has not enabled
/// wallet sign-in is the node's 403, a file that is no key a clear error.
#[test]
fn cli_wallet_sign_in_prints_a_token() {
    use base64::Engine as _;
    let node = TestNode::start();
    let base = node.base.as_str();
    let owner = node.create_namespace("cliwallet");
    node.create_namespace("clinowallet");
    let setting =
        br#"{"enabled":true,"role":"member","grants":["kv:read:users/{sub}/*"],"allow":"any"}"#;
    let (s, b) = node.with_key(
        &owner,
        "PUT",
        "/v1/namespaces/cliwallet/wallet-sign-in",
        Some(setting),
    );
    assert_eq!(s, 200, "{b}");
    // A PKCS#8 key in PEM, as `openssl genpkey -algorithm ed25519` writes one.
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = ring::signature::Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
    let pem = format!(
        "-----BEGIN PRIVATE KEY-----\n{}\n-----END PRIVATE KEY-----\n",
        base64::engine::general_purpose::STANDARD.encode(pkcs8.as_ref())
    );
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("wallet.pem");
    std::fs::write(&key_file, pem).unwrap();
    let key_path = key_file.to_str().unwrap();

    let out = std::process::Command::new(bin())
        .args(["wallet", "address", "--key-file", key_path])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let address = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(address.len(), 64, "{address}");

    let token = cli(
        base,
        &[
            "wallet",
            "sign-in",
            "-n",
            "cliwallet",
            "--key-file",
            key_path,
        ],
    )
    .trim()
    .to_string();
    let (s, b) = node.with_key(&token, "GET", "/v1/auth/whoami", None);
    assert_eq!(s, 200, "{b}");
    let me = json(&b);
    assert_eq!(me["subject"], format!("wallet:{address}"), "{me:#}");
    assert_eq!(me["namespace"], "cliwallet", "{me:#}");
    assert_eq!(
        me["grants"],
        serde_json::json!([format!("kv:read:users/{address}/*")]),
        "{me:#}"
    );
    // --json: the whole answer, with the refresh token and the role.
    let v = printed(&cli(
        base,
        &[
            "wallet",
            "sign-in",
            "-n",
            "cliwallet",
            "--key-file",
            key_path,
            "--json",
        ],
    ));
    assert_eq!(v["role"], "member", "{v:#}");
    assert!(
        v["refresh_token"]
            .as_str()
            .is_some_and(|t| t.starts_with("mgr_")),
        "{v:#}"
    );

    let (code, stdout, stderr) = cli_fails(
        base,
        &[
            "wallet",
            "sign-in",
            "-n",
            "clinowallet",
            "--key-file",
            key_path,
        ],
    );
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.starts_with("meshgate: 403 WALLET_SIGN_IN_DISABLED: "),
        "{stderr}"
    );
    assert_eq!(stdout, "");
    let junk = dir.path().join("junk");
    std::fs::write(&junk, "not a key").unwrap();
    let (code, _, stderr) = cli_fails(
        base,
        &[
            "wallet",
            "sign-in",
            "-n",
            "cliwallet",
            "--key-file",
            junk.to_str().unwrap(),
        ],
    );
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("junk: not an Ed25519 PKCS#8 key"),
        "{stderr}"
    );
}

/// Runs `meshgate ARGS --url BASE`; panics on a non-zero exit; returns
/// stdout and stderr.
fn cli_both(base: &str, args: &[&str]) -> (String, String) {
    let out = std::process::Command::new(bin())
        .args(args)
        .args(["--url", base])
        .env_remove("MESHGATE_KEY")
        .env_remove("MESHGATE_URL")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{args:?}: {err}");
    (String::from_utf8_lossy(&out.stdout).into_owned(), err)
}

/// `ns create` and `keys create` print the new secret alone on stdout (a
/// script captures it) and name the key's id on stderr, the id the key
/// list shows and `keys revoke` takes; both secrets work.
#[test]
fn key_creating_commands_print_the_secret_and_name_its_id() {
    let node = TestNode::start();
    let base = node.base.as_str();
    let ids = |key: &str| -> Vec<String> {
        let (s, b) = node.with_key(key, "GET", "/v1/auth/api-keys", None);
        assert_eq!(s, 200, "{b}");
        json(&b)["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["id"].as_str().unwrap().to_string())
            .collect()
    };
    let (out, err) = cli_both(base, &["ns", "create", "clikeys", "--key", OPERATOR_KEY]);
    let owner = out.trim().to_string();
    assert!(owner.starts_with("mg_sk_"), "{out}");
    assert_eq!(node.with_key(&owner, "GET", "/v1/auth/whoami", None).0, 200);
    let owner_id = ids(&owner).pop().expect("the owner key listed");
    assert!(err.contains(&format!("owner API key {owner_id} ")), "{err}");

    let (out, err) = cli_both(
        base,
        &[
            "keys", "create", "--role", "reader", "--name", "r", "--key", &owner,
        ],
    );
    let reader = out.trim().to_string();
    assert!(reader.starts_with("mg_sk_"), "{out}");
    assert_eq!(
        node.with_key(&reader, "GET", "/v1/auth/whoami", None).0,
        200
    );
    let listed = ids(&owner);
    let id = listed
        .iter()
        .find(|i| **i != owner_id)
        .expect("the new key listed");
    assert!(err.contains(&format!("key {id} created")), "{err}");
}

/// `meshgate status` on one node: its id, readiness, store and namespaces
/// for a person, the node's answer with `--json`; a wrong key exits 1 with
/// the node's code; a node not yet ready exits 1 saying so.
#[test]
fn cli_status_shows_the_node_and_exits_non_zero_when_not_ready() {
    let node = TestNode::start();
    let base = node.base.as_str();
    node.create_namespace("statusns");
    let op = node.operator_key.clone();
    let text = cli(base, &["status", "--key", &op]);
    assert!(text.contains("ready       yes (ready)"), "{text}");
    // On the cluster suite the node is one of three on etcd.
    let (backend, cluster_line) = if crate::common::cluster_mode() {
        ("etcd", "cluster     live nodes: ")
    } else {
        ("sled", "cluster     off (one node)")
    };
    assert!(
        text.contains(&format!("store       {backend}, healthy")),
        "{text}"
    );
    assert!(text.contains(cluster_line), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("namespaces  ")),
        "{text}"
    );
    let v = printed(&cli(base, &["status", "--json", "--key", &op]));
    assert_eq!(v["ready"], true, "{v:#}");
    assert_eq!(v["store"]["backend"], backend, "{v:#}");
    assert!(
        v["node_id"].as_str().is_some_and(|n| !n.is_empty()),
        "{v:#}"
    );
    let (code, _, err) = cli_fails(base, &["status", "--key", "not-the-operator-key"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("401") || err.contains("INVALID"), "{err}");
    if !crate::common::cluster_mode() {
        // One node: each namespace running here, on every node (`[]`).
        let owner = node.create_namespace("statusmembers");
        let (s, b) = node.with_key(&owner, "PUT", "/v1/kv/k", Some(b"v"));
        assert!(s == 200 || s == 204, "{s} {b}");
        let v = printed(&cli(base, &["status", "--json", "--key", &op]));
        let row = v["namespace_members"]
            .as_array()
            .and_then(|a| a.iter().find(|r| r["namespace"] == "statusmembers"))
            .cloned()
            .unwrap_or_else(|| panic!("{v:#}"));
        assert_eq!(row["members"], serde_json::json!([]), "{v:#}");
        assert_eq!(row["member_here"], true, "{v:#}");
        assert_eq!(v["namespace_members_truncated"], false, "{v:#}");
        let text = cli(base, &["status", "--key", &op]);
        assert!(
            text.lines()
                .any(|l| l == "members     statusmembers: every node"),
            "{text}"
        );
        // The public view (`[metrics] public`) names no namespace: no members.
        let public = TestNode::start_with(NodeOpts {
            config: format!("{TEST_CONFIG}[metrics]\npublic = true\n"),
            ..Default::default()
        });
        let k = public.create_namespace("hiddenmembers");
        let (s, b) = public.with_key(&k, "PUT", "/v1/kv/k", Some(b"v"));
        assert!(s == 200 || s == 204, "{s} {b}");
        let (s, _, b) = http("GET", &public.url("/v1/status"), &[], None);
        assert_eq!(s, 200);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert!(v.get("namespace_members").is_none(), "{v:#}");
        assert!(v.get("namespace_members_truncated").is_none(), "{v:#}");
        assert!(
            !String::from_utf8_lossy(&b).contains("hiddenmembers"),
            "{v:#}"
        );
        assert_eq!(v["namespaces_running"], 1, "{v:#}");
        let (_, _, b) = http("GET", &public.url("/v1/status"), &[OPERATOR_AUTH], None);
        assert!(String::from_utf8_lossy(&b).contains("hiddenmembers"));
    }

    // Starting: the node answers, but is not ready.
    let slow = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[debug]\nstartup_delay_ms = 4000\n"),
        no_wait_ready: true,
        ..Default::default()
    });
    let key = slow.operator_key.clone();
    let (code, out, err) = cli_fails(&slow.base, &["status", "--key", &key]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        err.contains("not ready") || err.contains("STARTING"),
        "{out}{err}"
    );
}

/// `deploy cert NAME --cert F --private-key F` uploads the deployment's certificate
/// (the node shows it after), `deploy cert NAME` prints it without the key,
/// a bad pair exits non-zero with the node's code and stores nothing, and
/// `deploy cert NAME --remove` removes it.
#[test]
fn cli_deploy_cert_upload_show_remove() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[deploy]\nupstream_allow = [\"127.0.0.0/8\"]\n"),
        ..Default::default()
    });
    let base = node.base.as_str();
    let owner = node.create_namespace("clicert");
    let up = upstream();
    let host = "shop.clicert.example.test";
    cli(
        base,
        &[
            "deploy", "upstream", &up, "--host", host, "--name", "shop", "--key", &owner,
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let good = crate::deploy::certs::current(&[host]);
    let other = crate::deploy::certs::current(&["elsewhere.example.test"]);
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_string_lossy().into_owned()
    };
    let (cert, key) = (write("cert.pem", &good.cert), write("key.pem", &good.key));
    let (other_cert, other_key) = (write("o.pem", &other.cert), write("ok.pem", &other.key));

    let out = printed(&cli(
        base,
        &[
            "deploy",
            "cert",
            "shop",
            "--cert",
            &cert,
            "--private-key",
            &key,
            "--key",
            &owner,
        ],
    ));
    assert_eq!(out["certificate"]["state"], "active", "{out:#}");
    assert_eq!(
        out["certificate"]["names"],
        serde_json::json!([host]),
        "{out:#}"
    );
    let sha = out["certificate"]["sha256"].clone();
    let (s, b) = node.with_key(&owner, "GET", "/v1/deployments/shop/certificate", None);
    assert_eq!((s, &json(&b)["certificate"]["sha256"]), (200, &sha), "{b}");

    let shown = cli(base, &["deploy", "cert", "shop", "--key", &owner]);
    assert_eq!(printed(&shown)["certificate"]["sha256"], sha, "{shown}");
    assert!(!shown.contains("PRIVATE KEY"), "{shown}");

    let (code, _, err) = cli_fails(
        base,
        &[
            "deploy",
            "cert",
            "shop",
            "--cert",
            &other_cert,
            "--private-key",
            &other_key,
            "--key",
            &owner,
        ],
    );
    assert_ne!(code, Some(0));
    assert!(err.contains("CERTIFICATE_HOST_MISMATCH"), "{err}");
    let (_, b) = node.with_key(&owner, "GET", "/v1/deployments/shop/certificate", None);
    assert_eq!(json(&b)["certificate"]["sha256"], sha, "{b}");

    let out = printed(&cli(
        base,
        &["deploy", "cert", "shop", "--remove", "--key", &owner],
    ));
    assert_eq!(out["ok"], true, "{out:#}");
    let (s, b) = node.with_key(&owner, "GET", "/v1/deployments/shop/certificate", None);
    assert_eq!(
        (s, json(&b)["error"]["code"].as_str()),
        (404, Some("CERTIFICATE_NOT_FOUND")),
        "{b}"
    );
}

/// `wallet sign-in --chain-id` signs in an Ethereum account (Sign-In with
/// Ethereum): the key file holds the secp256k1 private key of web3.py's
/// documentation, whose address (0x2c75…5c23, as eth-account derives it)
/// `wallet address --evm` prints checksummed; the token speaks for
/// `wallet:<address>` in lower case. A file that is no such key is a
/// clear error, before any request.
#[test]
fn cli_wallet_sign_in_with_an_ethereum_key() {
    let node = TestNode::start();
    let base = node.base.as_str();
    let owner = node.create_namespace("clievm");
    let setting = br#"{"enabled":true,"role":"member","grants":["kv:read:users/{sub}/*"],"allow":["0x2c7536E3605D9C16a7a3D7b1898e529396a65c23"]}"#;
    let (s, b) = node.with_key(
        &owner,
        "PUT",
        "/v1/namespaces/clievm/wallet-sign-in",
        Some(setting),
    );
    assert_eq!(s, 200, "{b}");
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("eth.key");
    std::fs::write(
        &key_file,
        "0x4c0883a69102937d6231471b5dbb6204fe5129617082792ae468d01a3f362318\n",
    )
    .unwrap();
    let key_path = key_file.to_str().unwrap();
    let out = std::process::Command::new(bin())
        .args(["wallet", "address", "--evm", "--key-file", key_path])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0x2c7536E3605D9C16a7a3D7b1898e529396a65c23"
    );
    let token = cli(
        base,
        &[
            "wallet",
            "sign-in",
            "-n",
            "clievm",
            "--key-file",
            key_path,
            "--chain-id",
            "1",
        ],
    )
    .trim()
    .to_string();
    let (s, b) = node.with_key(&token, "GET", "/v1/auth/whoami", None);
    assert_eq!(s, 200, "{b}");
    assert_eq!(
        json(&b)["subject"],
        "wallet:0x2c7536e3605d9c16a7a3d7b1898e529396a65c23"
    );
    let bad = dir.path().join("bad.key");
    std::fs::write(&bad, "not a key").unwrap();
    let out = std::process::Command::new(bin())
        .args([
            "wallet",
            "sign-in",
            "-n",
            "clievm",
            "--chain-id",
            "1",
            "--url",
            base,
        ])
        .args(["--key-file", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not an Ethereum private key"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `deploy upstream|static --tls auto` asks for ACME: a node without
/// `[tls.acme]` refuses both with `ACME_NOT_CONFIGURED` (non-zero exit, the
/// code printed) and stores nothing.
#[test]
fn cli_deploy_tls_auto_is_sent() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[deploy]\nupstream_allow = [\"127.0.0.0/8\"]\n"),
        ..Default::default()
    });
    let base = node.base.as_str();
    let owner = node.create_namespace("clitls");
    let site = tempfile::tempdir().unwrap();
    std::fs::write(site.path().join("index.html"), "hi").unwrap();
    let site_dir = site.path().to_string_lossy().into_owned();
    for args in [
        vec!["deploy", "upstream", "http://127.0.0.1:9", "--name", "up"],
        vec!["deploy", "static", site_dir.as_str(), "--name", "st"],
    ] {
        let out = std::process::Command::new(bin())
            .args(&args)
            .args(["--host", "x.clitls.example.test", "--tls", "auto"])
            .args(["--key", &owner, "--url", base])
            .env_remove("MESHGATE_KEY")
            .env_remove("MESHGATE_URL")
            .output()
            .unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "{args:?}: {said}");
        assert!(said.contains("ACME_NOT_CONFIGURED"), "{args:?}: {said}");
    }
    for name in ["up", "st"] {
        let (s, _) = node.with_key(&owner, "GET", &format!("/v1/deployments/{name}"), None);
        assert_eq!(s, 404);
    }
}
