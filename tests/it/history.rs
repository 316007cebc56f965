//! Pub/sub history and recovery (issue #41, docs/pubsub.md "History and
//! recovery"): offsets and epochs, recovery after a dropped socket, its
//! refusals, a restart, the history read, and bad input.

use crate::common::*;
use crate::pubsub::{Socket, next_data};
use awc::ws;
use base64::Engine as _;
use futures_util::SinkExt as _;
use serde_json::{Value, json};
use std::time::Duration;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

fn opts(extra: &str) -> NodeOpts {
    NodeOpts {
        config: format!("{TEST_CONFIG}{extra}"),
        ..Default::default()
    }
}

async fn connect(node: &TestNode, path: &str, key: &str) -> (awc::ClientResponse, Socket) {
    let sep = if path.contains('?') { '&' } else { '?' };
    let url = format!("ws://{}{path}{sep}token={key}", node.addr);
    let (resp, s) = awc::Client::builder()
        .timeout(Duration::from_secs(30))
        .finish()
        .ws(url.as_str())
        .max_frame_size(4 << 20)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("ws connect {url}: {e}"));
    assert_eq!(resp.status(), 101);
    (resp, s)
}

async fn next_json(s: &mut Socket) -> Value {
    let b = next_data(s).await;
    serde_json::from_slice(&b).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&b)))
}

async fn send_json(s: &mut Socket, v: Value) {
    s.send(ws::Message::Text(v.to_string().into()))
        .await
        .unwrap();
}

/// Sends a `subscribe` frame (no recovery) and returns its answer.
async fn subscribe(s: &mut Socket, id: u64, topic: &str) -> Value {
    send_json(s, json!({"id": id, "type": "subscribe", "topic": topic})).await;
    next_json(s).await
}

/// Sets the namespace's history rules as the operator; returns the status and body.
fn set_rules(node: &TestNode, ns: &str, rules: Value) -> (u16, String) {
    node.op(
        "PUT",
        &format!("/v1/namespaces/{ns}/pubsub"),
        Some(&json!({ "history": rules }).to_string()),
    )
}

/// Publishes over HTTP; returns the answer (asserted 200).
fn publish(node: &TestNode, key: &str, topic: &str, data: &str) -> Value {
    let (s, b) = node.with_key(
        key,
        "POST",
        "/v1/pubsub/publish",
        Some(
            json!({"topic": topic, "data_base64": B64.encode(data)})
                .to_string()
                .as_bytes(),
        ),
    );
    assert_eq!(s, 200, "{b}");
    json(&b)
}

/// Creates namespace `hist` keeping `size` publications of its `chat.*`
/// topics for an hour; returns its API key.
fn keep_chat(node: &TestNode, size: u64) -> String {
    let key = node.create_namespace("hist");
    assert_eq!(
        set_rules(
            node,
            "hist",
            json!([{"topics": "chat.*", "size": size, "ttl_seconds": 3600}])
        )
        .0,
        200
    );
    key
}

/// Kills the node (SIGKILL) and starts it again on the same data folder.
fn crash_and_restart(node: TestNode) -> TestNode {
    node.crash_and_restart_with(opts(""))
}

fn history(node: &TestNode, key: &str, query: &str) -> (u16, Value) {
    let (s, b) = node.with_key(key, "GET", &format!("/v1/pubsub/history?{query}"), None);
    (s, json(&b))
}

fn offsets(page: &Value) -> Vec<u64> {
    page["publications"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["offset"].as_u64().unwrap())
        .collect()
}

/// Subscribes on a `/v1/ws` socket with `recover`; returns the answer and
/// the offsets of the `want` messages that come with it (in arrival order).
async fn subscribe_recover(
    s: &mut Socket,
    topic: &str,
    recover: Value,
    want: usize,
) -> (Value, Vec<u64>) {
    send_json(
        s,
        json!({"id": 1, "type": "subscribe", "topic": topic, "recover": recover}),
    )
    .await;
    // The answer comes first, then the missed publications.
    let answer = next_json(s).await;
    assert_eq!(answer["id"], 1, "the answer first: {answer}");
    let mut got = Vec::new();
    while got.len() < want {
        let v = next_json(s).await;
        assert_eq!(v["type"], "message", "{v}");
        got.push(v["offset"].as_u64().expect("offset on a history message"));
    }
    (answer, got)
}

/// Publish 100, drop a subscriber after it read 40, publish 30 more, then
/// recover from offset 40: the answer, exactly 41..=130, then the live ones
/// (one published on the same socket right behind the subscribe, while the
/// recovery is under way, and one after), no duplicate and no gap.
#[actix_rt::test]
async fn recovery_after_a_drop_fills_the_gap_then_goes_live() {
    let node = TestNode::start_with(opts(""));
    let key = node.create_namespace("hist");
    let (s, b) = set_rules(
        &node,
        "hist",
        json!([{"topics": "chat.*", "size": 1000, "ttl_seconds": 3600}]),
    );
    assert_eq!(s, 200, "{b}");
    let (_, mut a) = connect(&node, "/v1/ws", &key).await;
    let ans = subscribe(&mut a, 0, "chat.1").await;
    assert_eq!(
        (ans["ok"].clone(), ans["offset"].clone()),
        (json!(true), json!(0)),
        "{ans}"
    );
    let epoch = ans["epoch"].as_str().expect("an epoch").to_string();
    for i in 1..=100u64 {
        let p = publish(&node, &key, "chat.1", &format!("m{i}"));
        assert_eq!(
            (p["offset"].as_u64(), p["epoch"].as_str()),
            (Some(i), Some(epoch.as_str()))
        );
    }
    let mut last = 0;
    for i in 1..=40u64 {
        let m = next_json(&mut a).await;
        assert_eq!(m["offset"], i, "{m}");
        assert_eq!(m["data_base64"], B64.encode(format!("m{i}")));
        last = i;
    }
    drop(a);
    for i in 101..=130 {
        publish(&node, &key, "chat.1", &format!("m{i}"));
    }
    let (_, mut b) = connect(&node, "/v1/ws", &key).await;
    // The subscribe and a publish in one write: the publish is handled
    // while the recovery's frames are on their way, so it is held.
    let sub = json!({"id": 1, "type": "subscribe", "topic": "chat.1",
                     "recover": {"offset": last, "epoch": epoch}});
    let publ = json!({"id": 2, "type": "publish", "topic": "chat.1",
                      "data_base64": B64.encode("during")});
    b.feed(ws::Message::Text(sub.to_string().into()))
        .await
        .unwrap();
    b.feed(ws::Message::Text(publ.to_string().into()))
        .await
        .unwrap();
    b.flush().await.unwrap();
    let ans = next_json(&mut b).await;
    assert_eq!(ans["id"], 1, "the answer first: {ans}");
    assert_eq!(ans["recovered"], true, "{ans}");
    assert_eq!(
        (ans["epoch"].as_str(), ans["offset"].as_u64()),
        (Some(epoch.as_str()), Some(130))
    );
    let mut got = Vec::new();
    let mut ack = None;
    while got.len() < 91 || ack.is_none() {
        let v = next_json(&mut b).await;
        if v["type"] == "message" {
            got.push(v["offset"].as_u64().unwrap());
        } else {
            assert_eq!(v["id"], 2, "{v}");
            ack = Some(v);
        }
    }
    assert_eq!(got, (41..=131).collect::<Vec<_>>(), "no duplicate, no gap");
    assert_eq!(ack.unwrap()["offset"], 131);
    let p = publish(&node, &key, "chat.1", "live");
    assert_eq!(p["offset"], 132);
    let m = next_json(&mut b).await;
    assert_eq!(
        (m["offset"].clone(), m["data_base64"].clone()),
        (json!(132), json!(B64.encode("live")))
    );
}

/// A recovery is `recovered:false`, with nothing replayed, past the
/// topic's size, past `max_recovered_publications`, with another epoch,
/// and past the ttl once the node's sweep dropped the publications.
#[actix_rt::test]
async fn recovery_refused_past_size_cap_epoch_and_ttl() {
    let node = TestNode::start_with(opts(
        "[pubsub]\nmax_recovered_publications = 20\nhistory_sweep_seconds = 1\n",
    ));
    let key = node.create_namespace("hist");
    let rules = json!([
        {"topics": "small.*", "size": 10, "ttl_seconds": 3600},
        {"topics": "short.*", "size": 100, "ttl_seconds": 1},
        {"topics": "*", "size": 1000, "ttl_seconds": 3600},
    ]);
    assert_eq!(set_rules(&node, "hist", rules).0, 200);
    let mut epoch = String::new();
    for i in 0..30 {
        epoch = publish(&node, &key, "small.1", &i.to_string())["epoch"]
            .as_str()
            .unwrap()
            .into();
    }
    let (_, mut s) = connect(&node, "/v1/ws", &key).await;
    // Past the size: offsets 1..=20 are gone, 5 is not recoverable.
    let (ans, got) =
        subscribe_recover(&mut s, "small.1", json!({"offset": 5, "epoch": epoch}), 0).await;
    assert_eq!(
        (ans["recovered"].clone(), ans["offset"].clone()),
        (json!(false), json!(30)),
        "{ans}"
    );
    assert!(got.is_empty());
    // Within the size it recovers (the pair: obeyed, violated).
    let (_, mut s) = connect(&node, "/v1/ws", &key).await;
    let (ans, got) =
        subscribe_recover(&mut s, "small.1", json!({"offset": 25, "epoch": epoch}), 5).await;
    assert_eq!(ans["recovered"], true, "{ans}");
    assert_eq!(got, vec![26, 27, 28, 29, 30]);

    let mut big_epoch = String::new();
    for i in 0..50 {
        big_epoch = publish(&node, &key, "big.1", &i.to_string())["epoch"]
            .as_str()
            .unwrap()
            .into();
    }
    // A gap of 40 is over max_recovered_publications (20); 20 is not.
    let (_, mut s) = connect(&node, "/v1/ws", &key).await;
    let (ans, _) = subscribe_recover(
        &mut s,
        "big.1",
        json!({"offset": 10, "epoch": big_epoch}),
        0,
    )
    .await;
    assert_eq!(ans["recovered"], false, "{ans}");
    let (_, mut s) = connect(&node, "/v1/ws", &key).await;
    let (ans, got) = subscribe_recover(
        &mut s,
        "big.1",
        json!({"offset": 30, "epoch": big_epoch}),
        20,
    )
    .await;
    assert_eq!(ans["recovered"], true, "{ans}");
    assert_eq!(got, (31..=50).collect::<Vec<_>>());
    // Another epoch (the small topic's) is not this topic's.
    let (_, mut s) = connect(&node, "/v1/ws", &key).await;
    let (ans, _) =
        subscribe_recover(&mut s, "big.1", json!({"offset": 45, "epoch": epoch}), 0).await;
    assert_eq!(
        (ans["recovered"].clone(), ans["epoch"].clone()),
        (json!(false), json!(big_epoch)),
        "{ans}"
    );

    // Past the ttl: the sweep empties the topic, then recovery is refused.
    let mut short_epoch = String::new();
    for i in 0..5 {
        short_epoch = publish(&node, &key, "short.1", &i.to_string())["epoch"]
            .as_str()
            .unwrap()
            .into();
    }
    wait_until(
        Duration::from_secs(30),
        "the sweep drops the expired history",
        || {
            let (s, page) = history(&node, &key, "topic=short.1");
            s == 200 && offsets(&page).is_empty() && page["offset"] == 5
        },
    );
    let (_, mut s) = connect(&node, "/v1/ws", &key).await;
    let (ans, _) = subscribe_recover(
        &mut s,
        "short.1",
        json!({"offset": 2, "epoch": short_epoch}),
        0,
    )
    .await;
    assert_eq!(
        (ans["recovered"].clone(), ans["offset"].clone()),
        (json!(false), json!(5)),
        "{ans}"
    );
}

/// Offsets and the epoch survive a crash (SIGKILL) and restart: the next
/// publication continues the count, the history reads back the same.
#[actix_rt::test]
async fn restart_keeps_offsets_and_epoch() {
    let node = TestNode::start_with(opts(""));
    let key = keep_chat(&node, 100);
    let mut epoch = String::new();
    for i in 1..=5 {
        epoch = publish(&node, &key, "chat.1", &format!("m{i}"))["epoch"]
            .as_str()
            .unwrap()
            .into();
    }
    let node = crash_and_restart(node);
    let p = publish(&node, &key, "chat.1", "m6");
    assert_eq!(
        (p["offset"].as_u64(), p["epoch"].as_str()),
        (Some(6), Some(epoch.as_str()))
    );
    let (s, page) = history(&node, &key, "topic=chat.1");
    assert_eq!(s, 200, "{page}");
    assert_eq!(page["epoch"], epoch.as_str());
    assert_eq!(offsets(&page), vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(page["publications"][0]["data_base64"], B64.encode("m1"));
}

/// Past a topic's `size` every publication trims the oldest one, in the
/// publication's own store batch: one flush per publication (the copy's trim
/// of the same row was written again in a round of its own, a second flush
/// the next publication waited behind), and the trims are on disk: after a
/// crash the topic holds its last `size`, no more.
#[actix_rt::test]
async fn a_publication_and_its_trim_take_one_flush_and_survive_a_crash() {
    if single_node_only() {
        return;
    }
    let node = TestNode::start_with(opts(""));
    let key = keep_chat(&node, 5);
    for i in 1..=5 {
        publish(&node, &key, "chat.1", &format!("m{i}"));
    }
    let before = node.metric_sum("meshgate_store_flushes_total");
    assert!(before > 0.0, "the store's flushes are counted");
    // One at a time: each answered once stored, so each its own round.
    for i in 6..=25 {
        publish(&node, &key, "chat.1", &format!("m{i}"));
    }
    let flushes = node.metric_sum("meshgate_store_flushes_total") - before;
    assert!(
        (20.0..=25.0).contains(&flushes),
        "20 publications past the size, each with a trim: {flushes} flushes (two per publication before)"
    );
    let node = crash_and_restart(node);
    let (s, page) = history(&node, &key, "topic=chat.1&limit=100");
    assert_eq!(s, 200, "{page}");
    assert_eq!(offsets(&page), (21..=25).collect::<Vec<u64>>());
    assert_eq!(page["publications"][0]["data_base64"], B64.encode("m21"));
}

/// `GET /v1/pubsub/history` answers the same publications forwards and
/// backwards, by offset, within `limit`; the simple socket recovers through
/// its query and says so in the 101's headers, and binary frames carry the offset.
#[actix_rt::test]
async fn history_reads_both_ways_and_the_simple_socket_recovers() {
    let node = TestNode::start_with(opts(""));
    let key = keep_chat(&node, 100);
    let mut epoch = String::new();
    for i in 1..=10 {
        epoch = publish(&node, &key, "chat.1", &format!("m{i}"))["epoch"]
            .as_str()
            .unwrap()
            .into();
    }
    let (s, fwd) = history(
        &node,
        &key,
        &format!("topic=chat.1&since_offset=3&limit=4&epoch={epoch}"),
    );
    assert_eq!(s, 200, "{fwd}");
    assert_eq!(offsets(&fwd), vec![4, 5, 6, 7]);
    let (_, back) = history(
        &node,
        &key,
        "topic=chat.1&since_offset=8&limit=4&reverse=true",
    );
    assert_eq!(offsets(&back), vec![7, 6, 5, 4]);
    let f: Vec<&Value> = fwd["publications"].as_array().unwrap().iter().collect();
    let b: Vec<&Value> = back["publications"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .collect();
    assert_eq!(f, b, "the same publications both ways");
    let (_, top) = history(&node, &key, "topic=chat.1&reverse=true&limit=2");
    assert_eq!(
        (offsets(&top), top["offset"].clone()),
        (vec![10, 9], json!(10))
    );

    let (resp, mut s) = connect(
        &node,
        &format!("/v1/pubsub/ws?topic=chat.1&format=binary&recover_offset=8&recover_epoch={epoch}"),
        &key,
    )
    .await;
    let h = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    assert_eq!(h("x-meshgate-recovered").as_deref(), Some("true"));
    assert_eq!(h("x-meshgate-epoch"), Some(epoch.clone()));
    assert_eq!(h("x-meshgate-offset").as_deref(), Some("10"));
    for i in 9..=10u64 {
        let f = next_data(&mut s).await;
        assert_eq!(&f[..8], &i.to_be_bytes(), "the offset, 8 bytes big-endian");
        assert_eq!(&f[8..], format!("m{i}").as_bytes());
    }
    publish(&node, &key, "chat.1", "m11");
    let f = next_data(&mut s).await;
    assert_eq!((&f[..8], &f[8..]), (&11u64.to_be_bytes()[..], &b"m11"[..]));
}

/// Bad input is answered 400 with the envelope and nothing is stored:
/// rules with size 0, size above the cap, ttl 0, a glob that does not
/// parse; a non-numeric recover offset (socket frame and query); a
/// since_offset beyond the top; a limit over the cap. Only the operator or
/// a pubsub:admin / namespace:admin credential sets the rules.
#[actix_rt::test]
async fn bad_input_refused_and_nothing_stored() {
    let node = TestNode::start_with(opts("[pubsub]\nmax_history_size = 50\n"));
    let key = node.create_namespace("hist");
    let rule = |topics: &str, size: u64, ttl: u64| json!([{"topics": topics, "size": size, "ttl_seconds": ttl}]);
    for (rules, what) in [
        (rule("chat.*", 0, 60), "size 0"),
        (rule("chat.*", 51, 60), "size above the cap"),
        (rule("chat.*", 10, 0), "ttl 0"),
        (rule("chat.[ab]", 10, 60), "a bad glob"),
        (json!([{"topics": "chat.*", "size": 10}]), "no ttl"),
    ] {
        let (s, b) = set_rules(&node, "hist", rules);
        assert_eq!(s, 400, "{what}: {b}");
        let v = json(&b);
        assert_eq!(v["ok"], false, "{what}: {b}");
        assert!(v["error"]["code"].is_string(), "{what}: {b}");
    }
    let (s, b) = node.op("GET", "/v1/namespaces/hist/pubsub", None);
    assert_eq!((s, json(&b)["history"].clone()), (200, json!([])), "{b}");
    // Who may set them: not a publisher; a pubsub:admin key may.
    let grant = |g: &str| {
        let (s, b) = node.with_key(
            &key,
            "POST",
            "/v1/auth/api-keys",
            Some(json!({"grants": [g], "name": "t"}).to_string().as_bytes()),
        );
        assert_eq!(s, 201, "{b}");
        json(&b)["api_key"].as_str().unwrap().to_string()
    };
    let body = json!({"history": rule("chat.*", 10, 60)}).to_string();
    let publisher = grant("pubsub:publish:*");
    let (s, b) = node.with_key(
        &publisher,
        "PUT",
        "/v1/namespaces/hist/pubsub",
        Some(body.as_bytes()),
    );
    assert_eq!(
        (s, json(&b)["error"]["code"].clone()),
        (403, json!("MISSING_GRANT")),
        "{b}"
    );
    let admin = grant("pubsub:admin:*");
    let (s, b) = node.with_key(
        &admin,
        "PUT",
        "/v1/namespaces/hist/pubsub",
        Some(body.as_bytes()),
    );
    assert_eq!(s, 200, "{b}");
    let (s, b) = node.with_key(&admin, "GET", "/v1/namespaces/hist/pubsub", None);
    assert_eq!(
        (s, json(&b)["history"][0]["size"].clone()),
        (200, json!(10)),
        "{b}"
    );

    let p = publish(&node, &key, "chat.1", "x");
    let epoch = p["epoch"].as_str().unwrap().to_string();
    let (_, mut s) = connect(&node, "/v1/ws", &key).await;
    send_json(
        &mut s,
        json!({"id": 7, "type": "subscribe", "topic": "chat.1", "recover": {"offset": "abc", "epoch": epoch}}),
    )
    .await;
    let e = next_json(&mut s).await;
    assert_eq!(
        (e["id"].clone(), e["error"]["code"].clone()),
        (json!(7), json!("BAD_OFFSET")),
        "{e}"
    );
    let (st, b) = node.with_key(
        &key,
        "GET",
        &format!("/v1/pubsub/ws?topic=chat.1&recover_offset=abc&recover_epoch={epoch}"),
        None,
    );
    assert_eq!(
        (st, json(&b)["error"]["code"].clone()),
        (400, json!("BAD_OFFSET")),
        "{b}"
    );
    let (st, v) = history(
        &node,
        &key,
        &format!("topic=chat.1&since_offset=2&epoch={epoch}"),
    );
    assert_eq!(
        (st, v["error"]["code"].clone()),
        (400, json!("BAD_OFFSET")),
        "{v}"
    );
    let (st, v) = history(&node, &key, "topic=chat.1&limit=many");
    assert_eq!(
        (st, v["error"]["code"].clone()),
        (400, json!("INVALID_LIMIT")),
        "{v}"
    );
    let (st, v) = history(&node, &key, "topic=chat.1&since_offset=x");
    assert_eq!(
        (st, v["error"]["code"].clone()),
        (400, json!("BAD_OFFSET")),
        "{v}"
    );
    let (st, v) = history(&node, &key, "topic=chat.1&limit=301");
    assert_eq!(
        (st, v["error"]["code"].clone()),
        (400, json!("INVALID_LIMIT")),
        "{v}"
    );
    // Nothing of that was stored: the topic still holds its one publication.
    let (_, page) = history(&node, &key, "topic=chat.1");
    assert_eq!(offsets(&page), vec![1]);
}

/// A namespace's history counts against its `history_bytes` quota: the
/// quota shows what is kept, the oldest go once it is full (the quota is a
/// cap, as Centrifugo's history size is), and an override lowers it.
#[actix_rt::test]
async fn history_counts_against_the_namespace_quota() {
    let node = TestNode::start_with(opts(""));
    let key = node.create_namespace("hq");
    let rule = json!([{"topics": "t.*", "size": 1000, "ttl_seconds": 3600}]);
    assert_eq!(set_rules(&node, "hq", rule).0, 200);
    let quota = |node: &TestNode| {
        let (s, b) = node.op("GET", "/v1/namespaces/hq/quotas", None);
        assert_eq!(s, 200, "{b}");
        json(&b)["quotas"]["history_bytes"].clone()
    };
    assert_eq!(quota(&node)["used"], 0);
    assert_eq!(quota(&node)["limit"], 64 << 20);
    // Ten publications of 100 bytes: 1,000 bytes kept.
    for i in 0..10 {
        publish(&node, &key, "t.a", &format!("{i:0>100}"));
    }
    assert_eq!(quota(&node)["used"], 1000);
    // The operator lowers the quota to 450 bytes: the next publication
    // trims the oldest until four (400 bytes) are kept, itself included.
    let (s, b) = node.op(
        "PUT",
        "/v1/namespaces/hq/quotas",
        Some(r#"{"history_bytes": 450}"#),
    );
    assert_eq!(s, 200, "{b}");
    publish(&node, &key, "t.a", &format!("{:0>100}", 10));
    let q = quota(&node);
    assert_eq!(
        (q["limit"].as_u64(), q["used"].as_u64()),
        (Some(450), Some(400))
    );
    let (s, page) = history(&node, &key, "topic=t.a");
    assert_eq!(s, 200, "{page}");
    assert_eq!(offsets(&page), vec![8, 9, 10, 11]);
    assert_eq!(page["offset"], 11, "the offsets go on: {page}");
}

/// The history travels with a whole-namespace export: imported into another
/// namespace, each topic keeps its epoch and offsets, so a subscriber of
/// the exported stream recovers from the imported one; the import replaces
/// the target's own history whole.
#[actix_rt::test]
async fn history_is_exported_and_imported_whole() {
    let node = TestNode::start_with(opts(""));
    let rule = json!([{"topics": "chat.*", "size": 100, "ttl_seconds": 3600}]);
    let a = node.create_namespace("ha");
    let b = node.create_namespace("hb");
    assert_eq!(set_rules(&node, "ha", rule.clone()).0, 200);
    assert_eq!(set_rules(&node, "hb", rule).0, 200);
    let mut epoch = String::new();
    for i in 1..=10 {
        epoch = publish(&node, &a, "chat.1", &format!("a{i}"))["epoch"]
            .as_str()
            .unwrap()
            .into();
    }
    // B's own history, which the import replaces.
    publish(&node, &b, "chat.1", "b1");
    publish(&node, &b, "chat.only-b", "b2");
    let (s, export) = node.with_key(&a, "GET", "/v1/db/export", None);
    assert_eq!(s, 200, "{export}");
    let export = json(&export);
    let topics = export["history"].as_array().expect("history in the export");
    assert_eq!(topics.len(), 1, "{export}");
    assert_eq!(topics[0]["epoch"], epoch.as_str());
    assert_eq!(topics[0]["top"], 10);
    let (s, body) = node.with_key(
        &b,
        "PUT",
        "/v1/db/import",
        Some(export.to_string().as_bytes()),
    );
    assert_eq!(s, 200, "{body}");
    assert_eq!(json(&body)["counts"]["history_topics"], 1, "{body}");

    // In B: A's stream, the same epoch and offsets; B's own topics gone.
    let (s, page) = history(&node, &b, "topic=chat.1");
    assert_eq!(s, 200, "{page}");
    assert_eq!(page["epoch"], epoch.as_str());
    assert_eq!(offsets(&page), (1..=10).collect::<Vec<_>>());
    assert_eq!(page["publications"][0]["data_base64"], B64.encode("a1"));
    let (_, page) = history(&node, &b, "topic=chat.only-b");
    assert_eq!(offsets(&page), Vec::<u64>::new(), "{page}");
    // A subscriber of A's stream at offset 6 recovers 7..10 from B.
    let (_, mut s) = connect(&node, "/v1/ws", &b).await;
    let (answer, got) =
        subscribe_recover(&mut s, "chat.1", json!({"offset": 6, "epoch": epoch}), 4).await;
    assert_eq!(answer["recovered"], true, "{answer}");
    assert_eq!(got, vec![7, 8, 9, 10]);
    // And the next publication in B continues the stream.
    let p = publish(&node, &b, "chat.1", "b-next");
    assert_eq!(
        (p["offset"].as_u64(), p["epoch"].as_str()),
        (Some(11), Some(epoch.as_str()))
    );
}

/// An export's history with bad entries is refused whole, naming the
/// entry; a history past the namespace's quota is 413; nothing is changed.
#[actix_rt::test]
async fn a_bad_history_in_an_import_changes_nothing() {
    let node = TestNode::start_with(opts(""));
    let key = node.create_namespace("hbad");
    let rule = json!([{"topics": "t.*", "size": 100, "ttl_seconds": 3600}]);
    assert_eq!(set_rules(&node, "hbad", rule).0, 200);
    let before = publish(&node, &key, "t.x", "kept");
    assert_eq!(
        node.with_key(&key, "PUT", "/v1/kv/k", Some(b"v1".as_slice()))
            .0,
        200
    );
    let (s, export) = node.with_key(&key, "GET", "/v1/db/export", None);
    assert_eq!(s, 200);
    let export = json(&export);
    let with_history = |h: Value| {
        let mut e = export.clone();
        e["history"] = h;
        // The import would also change the KV: it must not.
        e["kv"] = json!([]);
        e.to_string()
    };
    let publication = |offset: u64, data: &str| json!({"offset": offset, "timestamp": 1, "data_base64": B64.encode(data)});
    let bad = [
        (
            "offsets not increasing",
            json!([{"topic": "t.y", "epoch": "e1", "top": 5,
                    "publications": [publication(3, "a"), publication(3, "b")]}]),
            400,
        ),
        (
            "offset above top",
            json!([{"topic": "t.y", "epoch": "e1", "top": 2,
                    "publications": [publication(3, "a")]}]),
            400,
        ),
        (
            "bad epoch",
            json!([{"topic": "t.y", "epoch": "no spaces", "top": 1, "publications": []}]),
            400,
        ),
        (
            "reserved topic",
            json!([{"topic": "_mg/x", "epoch": "e1", "top": 0, "publications": []}]),
            400,
        ),
        (
            "topic twice",
            json!([{"topic": "t.y", "epoch": "e1", "top": 0},
                   {"topic": "t.y", "epoch": "e2", "top": 0}]),
            400,
        ),
        (
            "not base64",
            json!([{"topic": "t.y", "epoch": "e1", "top": 1,
                    "publications": [{"offset": 1, "timestamp": 1, "data_base64": "%%%"}]}]),
            400,
        ),
        (
            "unknown field",
            json!([{"topic": "t.y", "epoch": "e1", "top": 0, "extra": 1}]),
            400,
        ),
    ];
    for (what, h, status) in bad {
        let (s, b) = node.with_key(
            &key,
            "PUT",
            "/v1/db/import",
            Some(with_history(h).as_bytes()),
        );
        assert_eq!(s, status, "{what}: {b}");
        assert!(
            b.contains("INVALID_EXPORT") || b.contains("BAD_REQUEST") || b.contains("INVALID"),
            "{what}: {b}"
        );
    }
    // Past the quota: 413 QUOTA_EXCEEDED.
    let (s, b) = node.op(
        "PUT",
        "/v1/namespaces/hbad/quotas",
        Some(r#"{"history_bytes": 10}"#),
    );
    assert_eq!(s, 200, "{b}");
    let big = json!([{"topic": "t.y", "epoch": "e1", "top": 1,
                      "publications": [publication(1, &"x".repeat(11))]}]);
    let (s, b) = node.with_key(
        &key,
        "PUT",
        "/v1/db/import",
        Some(with_history(big).as_bytes()),
    );
    assert_eq!(s, 413, "{b}");
    assert!(
        b.contains("QUOTA_EXCEEDED") && b.contains("history_bytes"),
        "{b}"
    );
    // Nothing changed: the KV and the history are as before.
    assert_eq!(
        node.with_key(&key, "GET", "/v1/kv/k", None),
        (200, "v1".into())
    );
    let (_, page) = history(&node, &key, "topic=t.x");
    assert_eq!(page["epoch"], before["epoch"]);
    assert_eq!(offsets(&page), vec![1]);
    let (_, page) = history(&node, &key, "topic=t.y");
    assert_eq!(offsets(&page), Vec::<u64>::new());
}

/// Publishes `messages` (topic, text) in one `publish-batch`; returns the
/// status and the answer.
fn publish_batch(node: &TestNode, key: &str, messages: &[(&str, &str)]) -> (u16, Value) {
    let messages: Vec<Value> = messages
        .iter()
        .map(|(t, d)| json!({"topic": t, "data_base64": B64.encode(d)}))
        .collect();
    let body = json!({ "messages": messages }).to_string();
    let (s, b) = node.with_key(
        key,
        "POST",
        "/v1/pubsub/publish-batch",
        Some(body.as_bytes()),
    );
    (s, json(&b))
}

/// Publishes over HTTP; returns the status and the answer, whatever it is.
fn try_publish(node: &TestNode, key: &str, topic: &str) -> (u16, Value) {
    let body = json!({"topic": topic, "data_base64": B64.encode("x")}).to_string();
    let (s, b) = node.with_key(key, "POST", "/v1/pubsub/publish", Some(body.as_bytes()));
    (s, json(&b))
}

/// The `history_topics` quota of `ns` as the operator reads it: (used, limit).
fn topics_quota(node: &TestNode, ns: &str) -> (u64, u64) {
    let (s, b) = node.op("GET", &format!("/v1/namespaces/{ns}/quotas"), None);
    assert_eq!(s, 200, "{b}");
    let q = &json(&b)["quotas"]["history_topics"];
    (q["used"].as_u64().unwrap(), q["limit"].as_u64().unwrap())
}

fn assert_topics_refused(s: u16, answer: &Value) {
    assert_eq!(s, 429, "{answer}");
    assert_eq!(answer["error"]["code"], "QUOTA_EXCEEDED", "{answer}");
    let msg = answer["error"]["message"].as_str().unwrap();
    assert!(msg.contains("history_topics"), "{msg}");
}

/// Waits (at most 20 s) until `f` holds.
async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..200 {
        if f() {
            return;
        }
        actix_rt::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("never: {what}");
}

/// An attacker publishing (or subscribing) to ever new history topics: a
/// topic's stream outlives its publications, so without a bound every new
/// name cost the node memory and store for good (200,000 names grew a node
/// by 190 MB). Now a namespace keeps at most its `history_topics` streams
/// per node: past it a new topic is refused with 429 `QUOTA_EXCEEDED` (an
/// HTTP publish, a whole batch, a socket's subscribe), nothing of it kept
/// and other namespaces untouched; once streams hold no publication, a new
/// topic takes the place of the longest-idle one no subscriber uses, which
/// is forgotten in the store too (a crash does not bring it back) and tells
/// a client recovering from it `recovered: false`.
#[actix_rt::test]
async fn a_namespace_keeps_at_most_its_history_topics() {
    if single_node_only() {
        return;
    }
    let node = TestNode::start_with(opts("[pubsub]\nhistory_sweep_seconds = 1\n"));
    let key = node.create_namespace("ht");
    let other = node.create_namespace("ho");
    let rules = |ttl: u64| json!([{"topics": "t.*", "size": 10, "ttl_seconds": ttl}]);
    assert_eq!(set_rules(&node, "ht", rules(3600)).0, 200);
    assert_eq!(set_rules(&node, "ho", rules(3600)).0, 200);
    let (s, b) = node.op(
        "PUT",
        "/v1/namespaces/ht/quotas",
        Some(r#"{"history_topics": 3}"#),
    );
    assert_eq!(s, 200, "{b}");
    let first = publish(&node, &key, "t.0", "x");
    publish(&node, &key, "t.1", "x");
    publish(&node, &key, "t.2", "x");
    assert_eq!(topics_quota(&node, "ht"), (3, 3));

    // A fourth topic, alone, in a batch, on a socket: refused, nothing kept.
    let (s, a) = try_publish(&node, &key, "t.3");
    assert_topics_refused(s, &a);
    let (s, a) = publish_batch(&node, &key, &[("t.1", "y"), ("t.3", "y")]);
    assert_topics_refused(s, &a);
    let (_, page) = history(&node, &key, "topic=t.1");
    assert_eq!(page["offset"], 1, "the batch is all or nothing: {page}");
    let (_, mut sock) = connect(&node, "/v1/ws", &key).await;
    let answer = subscribe(&mut sock, 7, "t.3").await;
    assert_eq!(
        (answer["id"].as_u64(), answer["ok"].as_bool()),
        (Some(7), Some(false)),
        "{answer}"
    );
    assert_eq!(answer["error"]["code"], "QUOTA_EXCEEDED", "{answer}");
    let (_, page) = history(&node, &key, "topic=t.3");
    assert!(page["epoch"].is_null(), "no stream kept for t.3: {page}");
    assert_eq!(topics_quota(&node, "ht"), (3, 3));
    // Known topics go on; another namespace is not touched.
    assert_eq!(publish(&node, &key, "t.2", "x")["offset"], 2);
    for i in 0..5 {
        publish(&node, &other, &format!("t.{i}"), "x");
    }
    assert_eq!(topics_quota(&node, "ho").0, 5);

    // A subscriber holds t.1; then every publication expires (ttl 1 s).
    assert_eq!(subscribe(&mut sock, 8, "t.1").await["ok"], true);
    assert_eq!(set_rules(&node, "ht", rules(1)).0, 200);
    eventually("the sweep dropped every publication", || {
        let (_, b) = node.op("GET", "/v1/namespaces/ht/quotas", None);
        json(&b)["quotas"]["history_bytes"]["used"] == 0
    })
    .await;
    // t.3 takes the place of t.0 (the longest idle), t.4 that of t.2 (t.1
    // is subscribed); t.5 finds only streams in use or holding publications.
    assert_eq!(publish(&node, &key, "t.3", "x")["offset"], 1);
    assert_eq!(publish(&node, &key, "t.4", "x")["offset"], 1);
    let (s, a) = try_publish(&node, &key, "t.5");
    assert_topics_refused(s, &a);
    assert_eq!(topics_quota(&node, "ht"), (3, 3));
    let (_, page) = history(&node, &key, "topic=t.0");
    assert!(page["epoch"].is_null(), "t.0 forgotten: {page}");
    let (_, page) = history(&node, &key, "topic=t.1");
    assert_eq!(page["offset"], 1, "t.1 kept: {page}");
    // A client of t.0's old stream: a subscribe, recovering or not, would
    // give t.0 a stream again, so it needs room too.
    send_json(
        &mut sock,
        json!({"id": 9, "type": "subscribe", "topic": "t.0",
               "recover": {"offset": 1, "epoch": first["epoch"]}}),
    )
    .await;
    let answer = next_json(&mut sock).await;
    assert_eq!(answer["error"]["code"], "QUOTA_EXCEEDED", "{answer}");
    let (s, b) = node.op(
        "PUT",
        "/v1/namespaces/ht/quotas",
        Some(r#"{"history_topics": 4}"#),
    );
    assert_eq!(s, 200, "{b}");
    // With room it is told the truth: not recovered, a new epoch.
    let (answer, _) = subscribe_recover(
        &mut sock,
        "t.0",
        json!({"offset": 1, "epoch": first["epoch"]}),
        0,
    )
    .await;
    assert_eq!(answer["recovered"], false, "{answer}");
    let fresh = answer["epoch"].clone();
    assert!(fresh.is_string() && fresh != first["epoch"], "{answer}");
    assert_eq!(topics_quota(&node, "ht"), (4, 4));
    drop(sock);

    // Forgotten in the store too: after a crash t.0 (its new stream), t.1,
    // t.3 and t.4 come back, t.2 does not.
    let node = crash_and_restart(node);
    assert_eq!(topics_quota(&node, "ht"), (4, 4));
    let (_, page) = history(&node, &key, "topic=t.2");
    assert!(page["epoch"].is_null(), "t.2 forgotten: {page}");
    let again = publish(&node, &key, "t.0", "x");
    assert_eq!(
        (again["offset"].as_u64(), &again["epoch"]),
        (Some(1), &fresh),
        "{again}"
    );
}

/// A publish-batch makes room for its new topics from streams it does not
/// publish to: with two idle streams and room for two, a batch to a new
/// topic and the longest-idle stream forgets the other one, the stream it
/// publishes to goes on under its epoch, and the quota holds at once and
/// after a crash. (It forgot the stream it was publishing to: the copy
/// read that stream back from the store after the write, and the namespace
/// held three streams against its two until the next sweep.)
#[actix_rt::test]
async fn a_batch_makes_room_from_streams_it_does_not_publish_to() {
    if single_node_only() {
        return;
    }
    let node = TestNode::start_with(opts("[pubsub]\nhistory_sweep_seconds = 3600\n"));
    let key = node.create_namespace("hb");
    let rule = json!([{"topics": "t.*", "size": 10, "ttl_seconds": 3600}]);
    assert_eq!(set_rules(&node, "hb", rule).0, 200);
    let (s, b) = node.op(
        "PUT",
        "/v1/namespaces/hb/quotas",
        Some(r#"{"history_topics": 2}"#),
    );
    assert_eq!(s, 200, "{b}");
    // Two streams without a publication (a subscribe gives a history topic
    // its stream), left idle; t.a is the longer idle.
    let (_, mut sock) = connect(&node, "/v1/ws", &key).await;
    let mut epochs = Vec::new();
    for (id, topic) in [(1, "t.a"), (2, "t.b")] {
        let answer = subscribe(&mut sock, id, topic).await;
        assert_eq!(answer["ok"], true, "{answer}");
        epochs.push(answer["epoch"].clone());
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    for (id, topic) in [(3, "t.a"), (4, "t.b")] {
        send_json(
            &mut sock,
            json!({"id": id, "type": "unsubscribe", "topic": topic}),
        )
        .await;
        assert_eq!(next_json(&mut sock).await["ok"], true);
    }
    assert!(epochs[0].is_string(), "{epochs:?}");
    assert_eq!(topics_quota(&node, "hb"), (2, 2));

    let (s, b) = publish_batch(&node, &key, &[("t.c", "c"), ("t.a", "a")]);
    assert_eq!(s, 200, "{b}");
    assert_eq!(topics_quota(&node, "hb"), (2, 2), "room made, not overrun");
    let (_, page) = history(&node, &key, "topic=t.b");
    assert!(
        page["epoch"].is_null(),
        "t.b, idle and not published to, went: {page}"
    );
    let (_, page) = history(&node, &key, "topic=t.a");
    assert_eq!(
        (&page["epoch"], offsets(&page)),
        (&epochs[0], vec![1]),
        "t.a goes on: {page}"
    );
    drop(sock);

    let node = crash_and_restart(node);
    assert_eq!(topics_quota(&node, "hb"), (2, 2));
    let (_, page) = history(&node, &key, "topic=t.a");
    assert_eq!(
        (&page["epoch"], offsets(&page)),
        (&epochs[0], vec![1]),
        "{page}"
    );
    let (_, page) = history(&node, &key, "topic=t.c");
    assert_eq!(offsets(&page), vec![1], "{page}");
    let (_, page) = history(&node, &key, "topic=t.b");
    assert!(page["epoch"].is_null(), "{page}");
}

/// A history page is held in memory until its client has read it: one
/// page of a topic holding the namespace's 64 MiB could be 85 MB of JSON,
/// and thirty slow readers held 3 GB of the node (BENCHMARKS.md). A page
/// now holds at most `[pubsub] max_history_page_bytes` of payload (1 MiB;
/// one publication alone when it is larger) and says `more`; the client
/// reads on from its last offset, both ways, and gets every publication once.
#[actix_rt::test]
async fn a_history_page_is_bounded_by_bytes_and_read_on_from_its_last_offset() {
    let node = TestNode::start();
    let key = node.create_namespace("hp");
    let rule = json!([{"topics": "big", "size": 100, "ttl_seconds": 3600}]);
    assert_eq!(set_rules(&node, "hp", rule).0, 200);
    let big = "x".repeat(600 << 10);
    for _ in 0..6 {
        publish(&node, &key, "big", &big);
    }
    for _ in 0..20 {
        publish(&node, &key, "big", &"y".repeat(1024));
    }
    let page = |query: &str| {
        let (s, b) = node.with_key(
            &key,
            "GET",
            &format!("/v1/pubsub/history?topic=big&{query}"),
            None,
        );
        assert_eq!(s, 200, "{query}");
        assert!(
            b.len() < (1 << 20) * 4 / 3 + 4096,
            "{query}: a page of {} bytes",
            b.len()
        );
        let v = json(&b);
        (offsets(&v), v["more"].as_bool().expect("more"))
    };
    // The largest page asked for holds one 600 KiB publication.
    assert_eq!(page("limit=300"), (vec![1], true));
    // Read on: each page goes on from the last offset of the one before.
    let mut seen: Vec<u64> = Vec::new();
    let mut since = 0;
    loop {
        let (offs, more) = page(&format!("since_offset={since}&limit=300"));
        seen.extend(&offs);
        since = *offs.last().unwrap_or(&since);
        if !more {
            break;
        }
    }
    assert_eq!(seen, (1..=26).collect::<Vec<u64>>());
    // Newest first: the twenty small ones and the last large one fit.
    let (offs, more) = page("reverse=true");
    assert_eq!(offs, (6..=26).rev().collect::<Vec<u64>>());
    assert!(more);
    assert_eq!(page("reverse=true&since_offset=6"), (vec![5], true));
    assert_eq!(page("reverse=true&since_offset=2"), (vec![1], false));
    // Cut by its limit too.
    assert_eq!(page("since_offset=6&limit=5"), ((7..=11).collect(), true));
}

/// Sockets recovering the same publications share their frames: each
/// recovery was framed for its socket alone, so sixteen sockets recovering
/// 30 MB of history and reading nothing held sixteen copies in their queues
/// (a namespace may hold 1,000 sockets per node, each queue up to
/// `outbound_queue_bytes`). Now the node holds about one copy.
#[actix_rt::test]
async fn sockets_recovering_the_same_publications_share_their_frames() {
    use std::io::{Read, Write};
    let node = TestNode::start_with(opts("[pubsub]\noutbound_queue_bytes = 134217728\n"));
    let key = node.create_namespace("hr");
    let rule = json!([{"topics": "big", "size": 100, "ttl_seconds": 3600}]);
    assert_eq!(set_rules(&node, "hr", rule).0, 200);
    let payload = "p".repeat(750_000);
    let mut epoch = Value::Null;
    for _ in 0..40 {
        epoch = publish(&node, &key, "big", &payload)["epoch"].clone();
    }
    let epoch = epoch.as_str().unwrap().to_string();
    let before = crate::pubsub::rss_kib(&node);
    // Sixteen sockets recover everything and read only the 101.
    let socks: Vec<std::net::TcpStream> = (0..16)
        .map(|_| {
            let mut c = std::net::TcpStream::connect(&node.addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            write!(
                c,
                "GET /v1/pubsub/ws?topic=big&recover_offset=0&recover_epoch={epoch}&token={key} HTTP/1.1\r\n\
                 host: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
                 sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
            )
            .unwrap();
            let mut status = [0u8; 12];
            c.read_exact(&mut status).unwrap();
            assert_eq!(&status, b"HTTP/1.1 101");
            c
        })
        .collect();
    // Each recovery is in its socket's queue once the 101 is out.
    actix_rt::time::sleep(Duration::from_millis(500)).await;
    let held = crate::pubsub::rss_kib(&node);
    let grew_mib = held.saturating_sub(before) / 1024;
    eprintln!("sixteen recoveries of 30 MB: node RSS {before} -> {held} KiB (+{grew_mib} MiB)");
    assert!(
        grew_mib < 200,
        "the node grew by {grew_mib} MiB for sixteen recoveries of the same 30 MB"
    );
    drop(socks);
}

/// A stream that holds no publication and sees none is forgotten
/// `history_meta_ttl_seconds` after its last one (in the store too), unless
/// a subscriber here uses it; its next publication starts a new epoch.
#[actix_rt::test]
async fn idle_history_streams_are_forgotten_after_the_meta_ttl() {
    if single_node_only() {
        return;
    }
    let node = TestNode::start_with(opts(
        "[pubsub]\nhistory_sweep_seconds = 1\nhistory_meta_ttl_seconds = 2\n",
    ));
    let key = node.create_namespace("hm");
    let rule = json!([{"topics": "t.*", "size": 10, "ttl_seconds": 1}]);
    assert_eq!(set_rules(&node, "hm", rule).0, 200);
    let a = publish(&node, &key, "t.a", "x");
    publish(&node, &key, "t.b", "x");
    let (_, mut sock) = connect(&node, "/v1/ws", &key).await;
    assert_eq!(subscribe(&mut sock, 1, "t.b").await["ok"], true);
    eventually("t.a forgotten", || topics_quota(&node, "hm").0 == 1).await;
    let (_, page) = history(&node, &key, "topic=t.b");
    assert_eq!(page["offset"], 1, "the subscribed stream stays: {page}");
    // Two more seconds: still there while subscribed.
    actix_rt::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(topics_quota(&node, "hm").0, 1);
    drop(sock);
    eventually("t.b forgotten once unsubscribed", || {
        topics_quota(&node, "hm").0 == 0
    })
    .await;
    let node = crash_and_restart(node);
    assert_eq!(
        topics_quota(&node, "hm").0,
        0,
        "nothing comes back from the store"
    );
    let again = publish(&node, &key, "t.a", "x");
    assert_eq!(again["offset"], 1);
    assert_ne!(again["epoch"], a["epoch"]);
}

/// A supervisor that panics while history writes are in flight restarts
/// and goes on writing: the publications of the lost write are answered
/// (an error, or their position if they were stored) and every later
/// history publish is answered with its position (it stalled for good: the
/// write in flight was dropped with the restart and still counted as in
/// flight, so no history write ever started again).
#[actix_rt::test]
async fn history_writes_go_on_after_the_supervisor_restarts() {
    let node = TestNode::start_with(opts(
        "[debug]\nfault_injection = true\n[pubsub]\npublish_timeout_ms = 5000\n",
    ));
    // Kept whole, so a lost write is always caught up (with a smaller size
    // a gap past it closes the subscriber with 4011 instead, truthfully).
    let key = keep_chat(&node, 10_000);
    let (_, mut sub) = connect(&node, "/v1/pubsub/ws?topic=chat.a", &key).await;
    let (_, mut s) = connect(&node, "/v1/ws", &key).await;
    let mut top = 0;
    for round in 0..5u64 {
        // History writes back to back, and a panic among them.
        for i in 0..300u64 {
            send_json(
                &mut s,
                json!({"id": round * 1000 + i, "type": "publish", "topic": "chat.a",
                       "data_base64": B64.encode("x")}),
            )
            .await;
        }
        let (st, b) = node.op("POST", "/v1/namespaces/hist/debug/panic", None);
        assert_eq!(
            (st, json(&b)["panicked"].as_bool()),
            (200, Some(true)),
            "{b}"
        );
        for _ in 0..300 {
            let a = next_json(&mut s).await;
            assert!(a["ok"] == true || a["error"]["code"].is_string(), "{a}");
        }
        let (st, b) = node.with_key(
            &key,
            "POST",
            "/v1/pubsub/publish",
            Some(
                json!({"topic": "chat.a", "data_base64": "eA=="})
                    .to_string()
                    .as_bytes(),
            ),
        );
        assert_eq!(
            st, 200,
            "round {round}: a history publish after the restart: {b}"
        );
        top = json(&b)["offset"].as_u64().unwrap();
    }
    // The subscriber saw every stored offset once, in order: a lost write
    // that was stored is caught up and delivered before the next.
    let mut seen = Vec::new();
    while seen.last() != Some(&top) {
        seen.push(next_json(&mut sub).await["offset"].as_u64().unwrap());
    }
    assert_eq!(seen, (1..=top).collect::<Vec<_>>());
}

/// Namespaces woken after a restart by an anonymous invoke of a function
/// they lack (404) and a publication to a topic without history load no
/// history: eight namespaces each keeping 16 MiB of
/// history cost the node almost nothing to wake (each loaded it whole
/// before, +16 MiB apiece); a history read then loads it, and every
/// publication is there.
#[test]
fn a_woken_namespace_loads_its_history_only_when_needed() {
    if single_node_only() {
        return;
    }
    const NAMESPACES: usize = 8;
    const KEPT: usize = 32;
    let node = TestNode::start_with(opts(""));
    let payload = "h".repeat(512 << 10);
    let mut keys = Vec::new();
    for i in 0..NAMESPACES {
        let ns = format!("wake{i}");
        let key = node.create_namespace(&ns);
        let rules = json!([{"topics": "big.*", "size": KEPT, "ttl_seconds": 3600}]);
        assert_eq!(set_rules(&node, &ns, rules).0, 200);
        for _ in 0..KEPT {
            publish(&node, &key, "big.t", &payload);
        }
        keys.push(key);
    }
    let (s, page) = history(&node, &keys[0], "topic=big.t&limit=1");
    assert_eq!((s, page["offset"].clone()), (200, json!(KEPT)), "{page}");
    let node = crash_and_restart(node);
    let before = rss_kib(&node);
    for i in 0..NAMESPACES {
        let (s, _, b) = http(
            "POST",
            &node.url(&format!("/v1/invoke/wake{i}/nope")),
            &[],
            Some(b"{}"),
        );
        assert_eq!(s, 404, "{}", String::from_utf8_lossy(&b));
    }
    // Each supervisor has handled a message after its start (a history
    // loaded on start would be in memory by then): a publication to a
    // topic no rule names.
    for key in &keys {
        publish(&node, key, "plain", "x");
    }
    let woken = rss_kib(&node);
    for key in &keys {
        let (s, page) = history(&node, key, "topic=big.t&limit=1");
        assert_eq!(s, 200, "{page}");
        assert_eq!(page["offset"], KEPT as u64, "{page}");
        assert_eq!(offsets(&page), vec![1]);
    }
    let read = rss_kib(&node);
    let woken_mib = woken.saturating_sub(before) / 1024;
    let read_mib = read.saturating_sub(woken) / 1024;
    eprintln!(
        "RSS: {before} KiB at start, +{woken_mib} MiB woken, +{read_mib} MiB after the reads"
    );
    // Eight histories of 16 MiB: woken without them, loaded by the reads
    // (the same measure sees them: the test can tell).
    assert!(woken_mib < 32, "waking held +{woken_mib} MiB");
    assert!(read_mib >= 64, "the reads loaded only +{read_mib} MiB");
}

fn rss_kib(node: &TestNode) -> u64 {
    crate::pubsub::rss_kib(node)
}
