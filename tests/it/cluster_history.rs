//! History topics on three nodes (issue #41): one offset sequence however
//! many nodes publish, recovery served by the node the client reconnects
//! to, a killed node's stream continued with the same epoch, and sockets
//! closed with 4011 when their node's copy cannot be continued.

use crate::cluster::member_opts;
use crate::common::*;
use crate::etcd_process::EtcdProcess;
use base64::Engine as _;
use futures_util::{SinkExt as _, StreamExt as _};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

type Socket = actix_codec::Framed<awc::BoxedSocket, awc::ws::Codec>;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// What a simple socket got: a message (offset, data) or its close code.
#[derive(Debug, PartialEq)]
enum Got {
    Message(u64, String),
    Closed(u16),
    Nothing,
}

/// Opens `GET /v1/pubsub/ws` on `node` for `topic` (with `recover` as
/// `(offset, epoch)`); returns the 101's `x-meshgate-epoch`,
/// `x-meshgate-recovered` and the socket.
async fn subscribe(
    node: &TestNode,
    key: &str,
    topic: &str,
    recover: Option<(u64, &str)>,
) -> (String, Option<String>, Socket) {
    let mut url = format!("ws://{}/v1/pubsub/ws?topic={topic}&token={key}", node.addr);
    if let Some((o, e)) = recover {
        url.push_str(&format!("&recover_offset={o}&recover_epoch={e}"));
    }
    let (resp, s) = awc::Client::builder()
        .timeout(Duration::from_secs(30))
        .finish()
        .ws(url)
        .connect()
        .await
        .expect("subscribe");
    assert_eq!(resp.status(), 101);
    let h = |n: &str| {
        resp.headers()
            .get(n)
            .map(|v| v.to_str().unwrap().to_string())
    };
    (
        h("x-meshgate-epoch").expect("an epoch on a history topic"),
        h("x-meshgate-recovered"),
        s,
    )
}

async fn next(s: &mut Socket, wait: Duration) -> Got {
    loop {
        let Ok(Some(Ok(f))) = tokio::time::timeout(wait, s.next()).await else {
            return Got::Nothing;
        };
        match f {
            awc::ws::Frame::Text(b) => {
                let v: Value = serde_json::from_slice(&b).unwrap();
                let data = B64.decode(v["data_base64"].as_str().unwrap()).unwrap();
                let offset = v["offset"]
                    .as_u64()
                    .unwrap_or_else(|| panic!("no offset: {v}"));
                return Got::Message(offset, String::from_utf8(data).unwrap());
            }
            awc::ws::Frame::Close(r) => return Got::Closed(r.map_or(0, |r| r.code.into())),
            awc::ws::Frame::Ping(p) => {
                let _ = s.send(awc::ws::Message::Pong(p)).await;
            }
            _ => {}
        }
    }
}

/// A subscriber on `node` told `epoch`: a node that does not know the topic
/// yet gives a subscriber its own fresh epoch and closes it with 4011 once it
/// learns the stored one (docs/pubsub.md), so subscribe until it knows.
async fn subscribed_under(node: &TestNode, key: &str, topic: &str, epoch: &str) -> Socket {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (e, _, s) = subscribe(node, key, topic, None).await;
        if e == epoch {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "{} never learnt the epoch of {topic}",
            node.base
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The next `n` messages' offsets and data; panics on a close or a pause.
async fn take(s: &mut Socket, n: usize, who: &str) -> Vec<(u64, String)> {
    let mut out = Vec::new();
    while out.len() < n {
        match next(s, Duration::from_secs(20)).await {
            Got::Message(o, d) => out.push((o, d)),
            other => panic!("{who}: {other:?} after {out:?}"),
        }
    }
    out
}

/// Publishes through `node`; returns the ack's (offset, epoch).
fn publish(node: &TestNode, key: &str, topic: &str, data: &str) -> (u64, String) {
    let body = json!({"topic": topic, "data_base64": B64.encode(data)});
    let (s, b) = node.with_key(
        key,
        "POST",
        "/v1/pubsub/publish",
        Some(body.to_string().as_bytes()),
    );
    assert_eq!(s, 200, "{b}");
    let v = json(&b);
    (
        v["offset"].as_u64().expect("an offset in the ack"),
        v["epoch"].as_str().unwrap().to_string(),
    )
}

/// Waits (at most 30 s) until every node has all the others as mesh peers.
async fn mesh_formed(nodes: &[TestNode]) {
    let peers = (nodes.len() - 1) as f64;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !nodes
        .iter()
        .all(|n| n.metric_sum("meshgate_mesh_peers") >= peers)
    {
        assert!(Instant::now() < deadline, "the mesh never formed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Keeps `room.*` of `ns`: 1,000 publications for an hour.
fn set_rules(node: &TestNode, ns: &str) {
    set_rule(node, ns, 1000, 3600);
}

/// Keeps `size` publications of `ns`'s `room.*` topics for `ttl` seconds.
fn set_rule(node: &TestNode, ns: &str, size: u64, ttl: u64) {
    let (s, _, b) = http(
        "PUT",
        &node.url(&format!("/v1/namespaces/{ns}/pubsub")),
        &[OPERATOR_AUTH, ("content-type", "application/json")],
        Some(
            json!({"history": [{"topics": "room.*", "size": size, "ttl_seconds": ttl}]})
                .to_string()
                .as_bytes(),
        ),
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
}

/// Three nodes, history topics:
/// - a new topic subscribed on the three nodes at once: all told one epoch,
///   the one its first publication gets;
/// - 90 publications racing through the three nodes get 2..=91, each once,
///   and reach a subscriber on every node in offset order;
/// - 30 publications sent round robin through a, b and c get offsets 2..=31
///   in one epoch, and a subscriber on c gets exactly those, in order;
/// - away while 20 more are published through a and b, it reconnects to c
///   with its position and gets 32..=51 from c's copy (`recovered: true`),
///   then the live ones;
/// - a killed (SIGKILL): publications through b continue at 52 in the same
///   epoch (the store's meta is the sequence, nothing past it was ever
///   delivered), and a client of a recovers them on b;
/// - the topic's stream replaced by an import through b (a new epoch): the
///   subscriber on c, whose copy cannot continue, is closed with 4011 and,
///   reconnecting with its old position, is told `recovered: false` and
///   the new epoch.
#[actix_rt::test]
async fn history_is_one_sequence_across_the_cluster_and_recovers_anywhere() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let mut nodes: Vec<TestNode> = ["a", "b", "c"]
        .iter()
        .map(|id| TestNode::start_with(member_opts(&etcd, id, free_port(), tmp.path())))
        .collect();
    let key = nodes[0].create_namespace("hist");
    set_rules(&nodes[0], "hist");
    mesh_formed(&nodes).await;
    // The rule has reached every node once a publication through each has an offset.
    for n in &nodes {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let body = json!({"topic": "room.warm", "data_base64": ""});
            let (s, b) = n.with_key(
                &key,
                "POST",
                "/v1/pubsub/publish",
                Some(body.to_string().as_bytes()),
            );
            assert_eq!(s, 200, "{b}");
            if json(&b)["offset"].is_u64() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the history rule never reached a node"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // A topic nobody published to yet, subscribed on the three nodes at
    // once: each node reads (or creates) its stored epoch before answering,
    // so all three are told one epoch, the first publication's.
    let fresh =
        futures_util::future::join_all(nodes.iter().map(|n| subscribe(n, &key, "room.new", None)))
            .await;
    let (o, e) = publish(&nodes[1], &key, "room.new", "first");
    assert_eq!(o, 1);
    for (i, (told, _, mut s)) in fresh.into_iter().enumerate() {
        assert_eq!(told, e, "node {i} told the stored epoch");
        assert_eq!(
            next(&mut s, Duration::from_secs(20)).await,
            Got::Message(1, "first".into()),
            "node {i}"
        );
    }

    // Publications racing through the three nodes at once: every offset
    // given once, 2..=91 with no gap, and each node's subscriber gets all
    // of them in offset order (its copy catches up from the store when
    // another node's publication comes first).
    // The topic exists first (a subscribe racing its creation on another
    // node is told another epoch and closed with 4011: docs/pubsub.md), and
    // each racer is subscribed under its epoch.
    let (_, race_epoch) = publish(&nodes[0], &key, "room.race", "start");
    let mut racers = Vec::new();
    for n in &nodes {
        racers.push(subscribed_under(n, &key, "room.race", &race_epoch).await);
    }
    let handles: Vec<_> = (0..3)
        .map(|i| {
            let (base, key) = (nodes[i].base.clone(), key.clone());
            std::thread::spawn(move || {
                (0..30)
                    .map(|j| {
                        let body = json!({"topic": "room.race", "data_base64": B64.encode(format!("{i}-{j}"))});
                        let auth = format!("Bearer {key}");
                        let (s, _, b) = http(
                            "POST",
                            &format!("{base}/v1/pubsub/publish"),
                            &[("authorization", &auth), ("content-type", "application/json")],
                            Some(body.to_string().as_bytes()),
                        );
                        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
                        json(&String::from_utf8_lossy(&b))["offset"].as_u64().unwrap()
                    })
                    .collect::<Vec<u64>>()
            })
        })
        .collect();
    let mut given: Vec<u64> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    given.sort();
    assert_eq!(
        given,
        (2..=91).collect::<Vec<_>>(),
        "each offset given once"
    );
    for (i, s) in racers.iter_mut().enumerate() {
        let got = take(s, 90, &format!("racer on node {i}")).await;
        assert_eq!(
            got.iter().map(|g| g.0).collect::<Vec<_>>(),
            (2..=91).collect::<Vec<_>>(),
            "node {i}: offset order, no gap, no duplicate"
        );
    }
    drop(racers);

    // The topic created first, and c's subscriber under its epoch (as above).
    let (_, epoch) = publish(&nodes[0], &key, "room.1", "m0");
    let mut on_c = subscribed_under(&nodes[2], &key, "room.1", &epoch).await;
    let mut acks = Vec::new();
    for i in 2..=31u64 {
        let (o, e) = publish(&nodes[(i % 3) as usize], &key, "room.1", &format!("m{i}"));
        assert_eq!(e, epoch, "one epoch whichever node publishes");
        acks.push(o);
    }
    assert_eq!(acks, (2..=31).collect::<Vec<_>>(), "one offset sequence");
    let got = take(&mut on_c, 30, "c").await;
    assert_eq!(
        got,
        (2..=31).map(|i| (i, format!("m{i}"))).collect::<Vec<_>>()
    );

    // Away from c while 20 more are published through a and b.
    drop(on_c);
    for i in 32..=51u64 {
        publish(&nodes[(i % 2) as usize], &key, "room.1", &format!("m{i}"));
    }
    let (e, recovered, mut on_c) = subscribe(&nodes[2], &key, "room.1", Some((31, &epoch))).await;
    assert_eq!(
        (e.as_str(), recovered.as_deref()),
        (epoch.as_str(), Some("true"))
    );
    let got = take(&mut on_c, 20, "c recovering").await;
    assert_eq!(
        got,
        (32..=51).map(|i| (i, format!("m{i}"))).collect::<Vec<_>>()
    );
    // A client of a that saw 50 before a dies.
    let (_, _, mut on_a) = subscribe(&nodes[0], &key, "room.1", None).await;

    // a killed: b continues the stream.
    nodes[0].kill9();
    drop(on_a.close().await);
    for i in 52..=56u64 {
        let (o, e) = publish(&nodes[1], &key, "room.1", &format!("m{i}"));
        assert_eq!((o, e.as_str()), (i, epoch.as_str()), "the stream continues");
    }
    let got = take(&mut on_c, 5, "c after a died").await;
    assert_eq!(
        got.iter().map(|g| g.0).collect::<Vec<_>>(),
        vec![52, 53, 54, 55, 56]
    );
    let (_, recovered, mut on_b) = subscribe(&nodes[1], &key, "room.1", Some((51, &epoch))).await;
    assert_eq!(recovered.as_deref(), Some("true"));
    let got = take(&mut on_b, 5, "a's client on b").await;
    assert_eq!(
        got.iter().map(|g| g.0).collect::<Vec<_>>(),
        vec![52, 53, 54, 55, 56]
    );
    drop(on_b);

    // Another stream of the topic imported through b: a new epoch.
    let other = nodes[1].create_namespace("hist2");
    set_rules(&nodes[1], "hist2");
    let (_, new_epoch) = publish(&nodes[1], &other, "room.1", "x1");
    assert_ne!(new_epoch, epoch);
    let (s, export) = nodes[1].with_key(&other, "GET", "/v1/db/export", None);
    assert_eq!(s, 200, "{export}");
    let (s, body) = nodes[1].with_key(&key, "PUT", "/v1/db/import", Some(export.as_bytes()));
    assert_eq!(s, 200, "{body}");
    let (o, e) = publish(&nodes[1], &key, "room.1", "after-import");
    assert_eq!((o, e.as_str()), (2, new_epoch.as_str()));
    // c's copy is of the old epoch: its subscriber is closed to recover.
    assert_eq!(
        next(&mut on_c, Duration::from_secs(20)).await,
        Got::Closed(4011)
    );
    assert!(nodes[2].metric_sum("meshgate_history_insufficient_state_total") >= 1.0);
    let (e, recovered, mut on_c) = subscribe(&nodes[2], &key, "room.1", Some((56, &epoch))).await;
    assert_eq!(
        (e.as_str(), recovered.as_deref()),
        (new_epoch.as_str(), Some("false"))
    );
    publish(&nodes[2], &key, "room.1", "live");
    assert_eq!(
        next(&mut on_c, Duration::from_secs(20)).await,
        Got::Message(3, "live".into())
    );
}

/// The `history_topics` quota on two nodes sharing etcd (each node counts
/// its own copy): past it a new topic is refused; once
/// the streams hold no publication, a new topic through `a` takes the place
/// of the longest-idle one, whose meta `a` deletes from etcd (guarded), so
/// the forgotten topic's next publication, through `b`, starts a new epoch
/// at offset 1 although `b` still knew the old stream.
#[actix_rt::test]
async fn the_stream_quota_holds_on_each_node_and_forgets_in_the_shared_store() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let nodes: Vec<TestNode> = ["a", "b"]
        .iter()
        .map(|id| {
            let mut o = member_opts(&etcd, id, free_port(), tmp.path());
            o.config
                .push_str("[quotas]\nhistory_topics = 2\n[pubsub]\nhistory_sweep_seconds = 1\n");
            TestNode::start_with(o)
        })
        .collect();
    let (a, b) = (&nodes[0], &nodes[1]);
    let key = a.create_namespace("hq");
    set_rules(a, "hq");
    mesh_formed(&nodes).await;
    let refused = |n: &TestNode, topic: &str| {
        let body = json!({"topic": topic, "data_base64": ""}).to_string();
        let (s, b) = n.with_key(&key, "POST", "/v1/pubsub/publish", Some(body.as_bytes()));
        (s, json(&b)["error"]["code"].as_str().map(str::to_string))
    };
    // The rule reaches b through its record; a publication through b has an offset then.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (_, first) = loop {
        let body = json!({"topic": "room.1", "data_base64": ""}).to_string();
        let (s, r) = b.with_key(&key, "POST", "/v1/pubsub/publish", Some(body.as_bytes()));
        assert_eq!(s, 200, "{r}");
        let v = json(&r);
        if let Some(o) = v["offset"].as_u64() {
            break (o, v["epoch"].as_str().unwrap().to_string());
        }
        assert!(
            Instant::now() < deadline,
            "the history rule never reached b"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    publish(a, &key, "room.2", "x");
    let quota = (429, Some("QUOTA_EXCEEDED".to_string()));
    assert_eq!(refused(a, "room.3"), quota, "through a");
    // Every publication expires (a rule of one second); then room.3 through
    // a takes the place of room.1, the longest idle.
    set_rule(a, "hq", 10, 1);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (s, c) = refused(a, "room.3");
        if s == 200 {
            break;
        }
        assert_eq!((s, c), quota.clone());
        assert!(Instant::now() < deadline, "room.3 never found room on a");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // room.1's stream is gone from etcd: through b its next publication
    // starts a new epoch at 1 (b's own copy of room.1 goes with it).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let body = json!({"topic": "room.1", "data_base64": ""}).to_string();
        let (s, r) = b.with_key(&key, "POST", "/v1/pubsub/publish", Some(body.as_bytes()));
        if s == 200 {
            let v = json(&r);
            assert_eq!(v["offset"], 1, "{v}");
            assert_ne!(v["epoch"].as_str().unwrap(), first, "{v}");
            break;
        }
        // b's copy is full until its sweep drops its idle streams.
        assert_eq!(
            (s, json(&r)["error"]["code"].as_str().map(str::to_string)),
            quota.clone()
        );
        assert!(Instant::now() < deadline, "room.1 never found room on b");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
