//! The command-line client's key, namespace and deployment commands
//! (issue #43): what each prints, and what it did to the node, seen through
//! the node's HTTP API.

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
/// policy (and `--no-compress` turns gzip off): the printed deployment's route carries it, the host answers 401
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
            "--key",
            &owner,
        ],
    ));
    assert_eq!(out["deployment"]["target"]["compress"], false, "{out:#}");
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
