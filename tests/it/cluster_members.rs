//! A namespace's serverless work runs on its members whatever path asks
//! (docs/cluster.md, "Placement"), and its members follow the cluster: set
//! by the operator, replaced when one dies, moved off a drained node.

use crate::cluster::{actors_of, deploy_as_operator, invocations_on, member_opts, metric_sum};
use crate::common::*;
use crate::etcd_process::EtcdProcess;
use crate::pubsub::{close_code, connect, next_json, send_json, ws_url};
use base64::Engine as _;
use std::time::{Duration, Instant};

const ECHO: &[u8] = include_bytes!("../../examples/functions/echo.wasm");
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Three nodes a, b, c on one etcd, each on its own port and folder.
fn three(etcd: &EtcdProcess, dir: &std::path::Path) -> Vec<TestNode> {
    ["a", "b", "c"]
        .iter()
        .map(|id| TestNode::start_with(member_opts(etcd, id, free_port(), dir)))
        .collect()
}

/// Creates namespace `name` on `members` through `via`; its API key.
fn create_on(via: &TestNode, name: &str, members: &[&str]) -> String {
    let body = serde_json::json!({"name": name, "members": members}).to_string();
    let (s, b) = via.op("POST", "/v1/namespaces", Some(&body));
    assert_eq!(s, 201, "{b}");
    json(&b)["api_key"].as_str().unwrap().to_string()
}

/// The `/v1/ws` invoke frame and the claims provider, used through nodes
/// that are not members of the namespace (placed on b): the member runs
/// both, the frames around the invokes are answered in order on the same
/// socket, a member's refusal (an unknown function) comes back as the
/// frame's error, and the non-members count no invocation. Issuing a token
/// through a non-member starts nothing of the namespace there.
#[actix_rt::test]
async fn socket_invokes_and_claims_run_on_the_member() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let nodes = three(&etcd, tmp.path());
    let (a, b, c) = (&nodes[0], &nodes[1], &nodes[2]);
    let key = create_on(a, "sock", &["b"]);
    deploy_as_operator(a, "sock", "echo", ECHO, &[]);
    let (s, body) = a.op(
        "PUT",
        "/v1/namespaces/sock/claims-provider",
        Some(r#"{"function":"echo"}"#),
    );
    assert_eq!(s, 200, "{body}");

    let mut ws = connect(&ws_url(a, "/v1/ws", &key)).await;
    send_json(&mut ws, serde_json::json!({"id": 1, "type": "ping"})).await;
    send_json(
        &mut ws,
        serde_json::json!({"id": 2, "type": "invoke", "function": "echo",
                           "input_base64": B64.encode(r#"{"hello":"ws"}"#)}),
    )
    .await;
    send_json(
        &mut ws,
        serde_json::json!({"id": 3, "type": "invoke", "function": "nope"}),
    )
    .await;
    send_json(
        &mut ws,
        serde_json::json!({"id": 4, "type": "invoke", "function": "echo@1",
                           "input_base64": B64.encode("plain")}),
    )
    .await;
    send_json(&mut ws, serde_json::json!({"id": 5, "type": "ping"})).await;
    assert_eq!(
        next_json(&mut ws).await,
        serde_json::json!({"id": 1, "ok": true, "pong": true})
    );
    assert_eq!(
        next_json(&mut ws).await,
        serde_json::json!({"id": 2, "ok": true, "result": {"hello": "ws"}})
    );
    let v = next_json(&mut ws).await;
    assert_eq!(v["id"], 3, "{v}");
    assert_eq!(v["error"]["code"], "FUNCTION_NOT_FOUND", "{v}");
    assert_eq!(
        next_json(&mut ws).await,
        serde_json::json!({"id": 4, "ok": true, "result": {"output_base64": B64.encode("plain")}})
    );
    assert_eq!(
        next_json(&mut ws).await,
        serde_json::json!({"id": 5, "ok": true, "pong": true})
    );

    // A token issued through c (a member of nothing): the provider ran on b.
    let body = format!(r#"{{"api_key":"{key}"}}"#);
    let (s, t) = c.with_key("", "POST", "/v1/auth/token", Some(body.as_bytes()));
    assert_eq!(s, 200, "{t}");
    let tok = json(&t)["access_token"].as_str().unwrap().to_string();
    let (s, who) = c.with_key(&tok, "GET", "/v1/auth/whoami", None);
    assert_eq!(s, 200, "{who}");
    assert_eq!(json(&who)["custom"]["namespace"], "sock", "{who}");

    assert_eq!(invocations_on(a, "sock"), 0.0, "a ran functions of sock");
    assert_eq!(invocations_on(c, "sock"), 0.0, "c ran functions of sock");
    assert!(
        invocations_on(b, "sock") >= 3.0,
        "b ran {}",
        invocations_on(b, "sock")
    );
    // The token's claims started nothing of sock on c.
    let on_c = actors_of(c, "sock");
    assert!(on_c.is_empty(), "c runs actors of sock: {on_c:?}");
}

/// Publications made on sockets of a non-member (a `/v1/ws` publish frame
/// and the simple socket's frames, on a; the namespace on b) fire the
/// namespace's pub/sub trigger exactly once each, on b; a and c run nothing.
#[actix_rt::test]
async fn socket_publishes_through_a_non_member_fire_the_trigger_once() {
    use futures_util::SinkExt as _;
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let nodes = three(&etcd, tmp.path());
    let (a, b, c) = (&nodes[0], &nodes[1], &nodes[2]);
    let key = create_on(a, "fire", &["b"]);
    deploy_as_operator(
        a,
        "fire",
        "onevent",
        ECHO,
        &[("metadata", r#"{"pubsub_topics":["events"]}"#)],
    );
    let mut full = connect(&ws_url(a, "/v1/ws", &key)).await;
    for i in 1..=3 {
        send_json(
            &mut full,
            serde_json::json!({"id": i, "type": "publish", "topic": "events",
                               "data_base64": B64.encode(format!("full-{i}"))}),
        )
        .await;
        assert_eq!(
            next_json(&mut full).await,
            serde_json::json!({"id": i, "ok": true})
        );
    }
    let mut simple = connect(&ws_url(a, "/v1/pubsub/ws?topic=events", &key)).await;
    for i in 1..=2 {
        simple
            .send(awc::ws::Message::Text(format!("simple-{i}").into()))
            .await
            .unwrap();
    }
    let fired = || {
        let (s, body) = b.with_key(&key, "GET", "/v1/functions/onevent/logs", None);
        assert_eq!(s, 200, "{body}");
        json(&body)["logs"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["trigger"] == "pubsub")
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while fired() < 5 {
        assert!(
            Instant::now() < deadline,
            "the trigger fired {} times of 5; a: {}; b: {}",
            fired(),
            a.stderr.lock().unwrap(),
            b.stderr.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Nothing fires a second time (from the mesh, or from a's socket).
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(fired(), 5);
    assert_eq!(invocations_on(b, "fire"), 5.0);
    for (id, n) in [("a", a), ("c", c)] {
        assert_eq!(invocations_on(n, "fire"), 0.0, "{id} ran functions of fire");
    }
    assert_eq!(
        metric_sum(a, "meshgate_forwards_total{outcome=\"trigger_dropped\"}"),
        0.0
    );
    // The member's route is for cluster peers only.
    let (s, body) = a.with_key(
        &key,
        "POST",
        "/v1/internal/pubsub/fire",
        Some(br#"{"messages":[{"topic":"events","data_base64":"aGk="}]}"#),
    );
    assert_eq!(s, 403, "{body}");
    assert_eq!(json(&body)["error"]["code"], "INTERNAL_ONLY");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(fired(), 5);

    // Large publications: a batch to the member is bounded in bytes and
    // its route reads it whole, so 3 publications of 600 KB and 5 small
    // ones behind them fire 8 more, none dropped.
    for _ in 0..3 {
        simple
            .send(awc::ws::Message::Text("x".repeat(600_000).into()))
            .await
            .unwrap();
    }
    for i in 1..=5 {
        simple
            .send(awc::ws::Message::Text(format!("small-{i}").into()))
            .await
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while fired() < 13 {
        assert!(
            Instant::now() < deadline,
            "the trigger fired {} times of 13; a: {}",
            fired(),
            a.stderr.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        metric_sum(a, "meshgate_forwards_total{outcome=\"trigger_dropped\"}"),
        0.0
    );
}

/// The namespace's members as `GET /v1/namespaces/{ns}` through `via` shows them.
fn members_of(via: &TestNode, ns: &str) -> Vec<String> {
    let (s, b) = via.op("GET", &format!("/v1/namespaces/{ns}"), None);
    assert_eq!(s, 200, "{b}");
    let v = json(&b);
    let rec = if v["record"].is_object() {
        &v["record"]
    } else {
        &v["namespace"]
    };
    serde_json::from_value(rec["members"].clone()).unwrap_or_else(|_| panic!("{b}"))
}

/// The live node ids `/v1/status` of `via` lists.
fn live_nodes(via: &TestNode) -> Vec<String> {
    let (s, b) = via.op("GET", "/v1/status", None);
    assert_eq!(s, 200, "{b}");
    serde_json::from_value(json(&b)["cluster"]["live_nodes"].clone()).unwrap()
}

/// A KV read of `greeting` through `via` with `key`: status, serving member, body.
fn read_greeting(via: &TestNode, key: &str) -> (u16, Option<String>, String) {
    let auth = format!("Bearer {key}");
    let (s, h, b) = http(
        "GET",
        &via.url("/v1/kv/greeting"),
        &[("authorization", &auth)],
        None,
    );
    (
        s,
        header(&h, "x-meshgate-member").map(str::to_string),
        String::from_utf8_lossy(&b).into_owned(),
    )
}

/// `PUT /v1/namespaces/{ns}/members` moves a namespace from b to c: the
/// record says so on every node, and the next requests through a are
/// served by c with the namespace's KV and functions (compiled there on
/// first use). Bad input is 400 `INVALID_MEMBER` (or 404 for an unknown
/// namespace) and changes nothing: an empty list, a duplicate, a node that
/// never was, a node that died, a non-node id.
#[actix_rt::test]
async fn operator_sets_members_and_the_new_member_serves_at_once() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let nodes = three(&etcd, tmp.path());
    let (a, b, c) = (&nodes[0], &nodes[1], &nodes[2]);
    let key = create_on(a, "moving", &["b"]);
    deploy_as_operator(a, "moving", "echo", ECHO, &[]);
    let (s, body) = a.with_key(&key, "PUT", "/v1/kv/greeting", Some(b"kept"));
    assert!(s == 200 || s == 204, "{s} {body}");
    let (s, member, _) = read_greeting(a, &key);
    assert_eq!((s, member.as_deref()), (200, Some("b")));

    // A fourth node that dies: its registration goes within 4 s.
    let mut d = TestNode::start_with(member_opts(&etcd, "d", free_port(), tmp.path()));
    wait_until(Duration::from_secs(20), "d is live", || {
        live_nodes(a).contains(&"d".to_string())
    });
    d.kill9();
    wait_until(Duration::from_secs(30), "d is gone", || {
        !live_nodes(a).contains(&"d".to_string())
    });
    for (bad, why) in [
        (r#"{"members":[]}"#, "empty"),
        (r#"{"members":["c","c"]}"#, "duplicate"),
        (r#"{"members":["c","nowhere"]}"#, "unknown"),
        (r#"{"members":["d"]}"#, "dead"),
        (r#"{"members":["c d"]}"#, "not an id"),
    ] {
        let (s, body) = a.op("PUT", "/v1/namespaces/moving/members", Some(bad));
        assert_eq!(s, 400, "{why}: {body}");
        assert_eq!(
            json(&body)["error"]["code"],
            "INVALID_MEMBER",
            "{why}: {body}"
        );
        assert_eq!(
            members_of(a, "moving"),
            vec!["b"],
            "{why} changed the members"
        );
    }
    let (s, body) = a.op(
        "PUT",
        "/v1/namespaces/nowhere/members",
        Some(r#"{"members":["c"]}"#),
    );
    assert_eq!(s, 404, "{body}");
    // A client key cannot move its namespace.
    let (s, body) = a.with_key(
        &key,
        "PUT",
        "/v1/namespaces/moving/members",
        Some(br#"{"members":["c"]}"#),
    );
    assert_eq!(s, 403, "{body}");
    assert_eq!(members_of(a, "moving"), vec!["b"]);

    let (s, body) = a.op(
        "PUT",
        "/v1/namespaces/moving/members",
        Some(r#"{"members":["c"]}"#),
    );
    assert_eq!(s, 200, "{body}");
    assert_eq!(
        json(&body)["namespace"]["members"],
        serde_json::json!(["c"])
    );
    for n in [a, b, c] {
        assert_eq!(members_of(n, "moving"), vec!["c"]);
    }
    // Served by c at once, with what b wrote.
    let (s, member, body) = read_greeting(a, &key);
    assert_eq!((s, member.as_deref()), (200, Some("c")), "{body}");
    assert_eq!(body, "kept");
    let before = invocations_on(b, "moving");
    let (s, h, out) = http(
        "POST",
        &a.url("/v1/functions/echo/invoke"),
        &[("authorization", &format!("Bearer {key}"))],
        Some(b"{\"moved\":true}"),
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&out));
    assert_eq!(header(&h, "x-meshgate-member"), Some("c"));
    assert_eq!(invocations_on(c, "moving"), 1.0);
    assert_eq!(invocations_on(b, "moving"), before);

    // `/v1/status` and `meshgate status` show the members as they are now:
    // on c (the member) and on b (which ran it and runs it light now).
    assert_eq!(
        status_members(c, "moving"),
        Some((serde_json::json!(["c"]), true))
    );
    assert_eq!(
        status_members(b, "moving"),
        Some((serde_json::json!(["c"]), false))
    );
    let text = crate::cli::cli(&b.base, &["status", "--key", OPERATOR_KEY]);
    assert!(
        text.lines()
            .any(|l| l == "members     moving: c  (not here: forwarded)"),
        "{text}"
    );
    let text = crate::cli::cli(&c.base, &["status", "--key", OPERATOR_KEY]);
    assert!(text.lines().any(|l| l == "members     moving: c"), "{text}");
}

/// The members `/v1/status` of `node` shows for namespace `ns` (and whether
/// `node` is one), None when it does not list `ns`.
fn status_members(node: &TestNode, ns: &str) -> Option<(serde_json::Value, bool)> {
    let (s, b) = node.op("GET", "/v1/status", None);
    assert_eq!(s, 200, "{b}");
    let v = json(&b);
    assert_eq!(v["namespace_members_truncated"], false, "{b}");
    v["namespace_members"]
        .as_array()
        .unwrap_or_else(|| panic!("{b}"))
        .iter()
        .find(|r| r["namespace"] == ns)
        .map(|r| (r["members"].clone(), r["member_here"] == true))
}

/// A member SIGKILLed (`replace_after_seconds` = 5, registrations living
/// 4 s): within 15 s the namespace's members name a live node instead, and
/// its KV and functions are served through the others again. The nodes
/// left both sweep; the record was rewritten once (`replaced` summed over
/// them is 1).
#[test]
fn a_dead_member_is_replaced_once_and_the_namespace_continues() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let mut nodes: Vec<TestNode> = ["a", "b", "c"]
        .iter()
        .map(|id| {
            let mut o = member_opts(&etcd, id, free_port(), tmp.path());
            o.config.push_str("replace_after_seconds = 5\n");
            TestNode::start_with(o)
        })
        .collect();
    let key = create_on(&nodes[0], "phoenix", &["b"]);
    deploy_as_operator(&nodes[0], "phoenix", "echo", ECHO, &[]);
    let (s, body) = nodes[0].with_key(&key, "PUT", "/v1/kv/greeting", Some(b"kept"));
    assert!(s == 200 || s == 204, "{s} {body}");
    // Long enough that a node's clock would have replaced a live member.
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(members_of(&nodes[0], "phoenix"), vec!["b"]);

    nodes[1].kill9();
    let killed = Instant::now();
    let (a, c) = (&nodes[0], &nodes[2]);
    let members = loop {
        let m = members_of(a, "phoenix");
        if !m.contains(&"b".to_string()) {
            break m;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(15),
            "still on b after 15 s: {m:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    assert_eq!(members.len(), 1, "{members:?}");
    let new = members[0].clone();
    assert!(new == "a" || new == "c", "{new}");
    assert_eq!(members_of(c, "phoenix"), members);

    let (s, member, body) = read_greeting(a, &key);
    assert_eq!(s, 200, "{body}");
    assert_eq!(body, "kept");
    if new == "c" {
        assert_eq!(member.as_deref(), Some("c"));
    }
    let (s, h, out) = http(
        "POST",
        &c.url("/v1/functions/echo/invoke"),
        &[("authorization", &format!("Bearer {key}"))],
        Some(b"{\"again\":1}"),
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&out));
    if new == "a" {
        assert_eq!(header(&h, "x-meshgate-member"), Some("a"));
    }
    let replaced = |n: &TestNode| {
        metric_sum(
            n,
            "meshgate_member_replacements_total{outcome=\"replaced\"}",
        )
    };
    assert_eq!(replaced(a) + replaced(c), 1.0);
}

/// `meshgate node drain ID` through the CLI: its exit status and output.
fn cli_drain(via: &TestNode, id: &str) -> (bool, String) {
    let out = std::process::Command::new(bin())
        .args([
            "node",
            "drain",
            id,
            "--url",
            &via.url(""),
            "--key",
            OPERATOR_KEY,
        ])
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Draining b (through a, with the CLI) moves every namespace that named
/// it to other live nodes and closes b's sockets with 4012; the moved
/// namespace answers through a from its new member with its KV. Draining a
/// node that is not live is 404 `NODE_NOT_FOUND` (the CLI fails); a client
/// key is refused; draining the only node of a cluster is 409 `LAST_NODE`
/// and changes nothing.
#[actix_rt::test]
async fn drain_moves_every_namespace_and_closes_the_nodes_sockets() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let nodes = three(&etcd, tmp.path());
    let (a, b) = (&nodes[0], &nodes[1]);
    let key = create_on(a, "d-one", &["b"]);
    create_on(a, "d-two", &["b", "c"]);
    create_on(a, "d-none", &["c"]);
    let (s, body) = a.with_key(&key, "PUT", "/v1/kv/greeting", Some(b"kept"));
    assert!(s == 200 || s == 204, "{s} {body}");
    let mut on_b = connect(&ws_url(b, "/v1/ws", &key)).await;
    send_json(
        &mut on_b,
        serde_json::json!({"id": 1, "type": "subscribe", "topic": "t"}),
    )
    .await;
    assert_eq!(next_json(&mut on_b).await["ok"], true);

    let (ok, out) = cli_drain(a, "nowhere");
    assert!(!ok, "{out}");
    assert!(out.contains("NODE_NOT_FOUND"), "{out}");
    let (s, body) = a.with_key(&key, "POST", "/v1/cluster/nodes/b/drain", None);
    assert_eq!(s, 403, "{body}");
    assert_eq!(members_of(a, "d-one"), vec!["b"]);

    let (ok, out) = cli_drain(a, "b");
    assert!(ok, "{out}");
    let answer = json(&out);
    assert_eq!(answer["sockets_closed"], true, "{out}");
    assert_eq!(answer["moved"].as_array().unwrap().len(), 2, "{out}");
    let one = members_of(a, "d-one");
    assert_eq!(one.len(), 1);
    assert!(one[0] == "a" || one[0] == "c", "{one:?}");
    let two = members_of(a, "d-two");
    assert_eq!(two.len(), 2);
    assert!(
        !two.contains(&"b".to_string()) && two.contains(&"c".to_string()),
        "{two:?}"
    );
    assert_eq!(members_of(a, "d-none"), vec!["c"]);
    assert_eq!(close_code(&mut on_b).await, 4012);
    let (s, member, body) = read_greeting(a, &key);
    assert_eq!(s, 200, "{body}");
    assert_eq!(body, "kept");
    if one[0] == "c" {
        assert_eq!(member.as_deref(), Some("c"));
    }

    // A cluster of one node: nothing could take its namespaces.
    let lone_etcd = EtcdProcess::start();
    let lone = TestNode::start_with(member_opts(&lone_etcd, "solo", free_port(), tmp.path()));
    create_on(&lone, "alone", &["solo"]);
    let (s, body) = lone.op("POST", "/v1/cluster/nodes/solo/drain", None);
    assert_eq!(s, 409, "{body}");
    assert_eq!(json(&body)["error"]["code"], "LAST_NODE");
    assert_eq!(members_of(&lone, "alone"), vec!["solo"]);
}
