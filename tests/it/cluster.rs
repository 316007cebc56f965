//! Three nodes on one etcd (docs/design.md §6): forwarding to a namespace's members
//! through per-(namespace, member) breakers, and cron slots that fire once in
//! the whole cluster.

use crate::common::*;
use crate::etcd_process::EtcdProcess;
use std::time::{Duration, Instant};

pub(crate) const SECRET: &str = "three-node-test-cluster-secret";

/// Options of cluster node `id` on a fixed port and data folder (so it can be
/// restarted as the same member).
pub(crate) fn member_opts(
    etcd: &EtcdProcess,
    id: &str,
    port: u16,
    dir: &std::path::Path,
) -> NodeOpts {
    NodeOpts {
        config: format!(
            "{TEST_CONFIG}[cluster]\n{}node_id = \"{id}\"\nbreaker_failures = 5\nbreaker_probe_seconds = 1\nregister_seconds = 1\n",
            etcd.cluster_toml()
        ),
        env: vec![("MESHGATE_CLUSTER_SECRET".into(), SECRET.into())],
        data_dir: Some(dir.join(id)),
        listen: Some(format!("127.0.0.1:{port}")),
        ..Default::default()
    }
}

/// The breaker of (namespace, member) as `/v1/status` shows it.
fn breaker(node: &TestNode, ns: &str, member: &str) -> Option<serde_json::Value> {
    let (_, _, b) = http("GET", &node.url("/v1/status"), &[OPERATOR_AUTH], None);
    json(&String::from_utf8_lossy(&b))["breakers"]
        .as_array()?
        .iter()
        .find(|x| x["namespace"] == ns && x["member"] == member)
        .cloned()
}

/// A KV read through `node` with the operator key; returns status and the
/// member that served it.
fn read_via(node: &TestNode, ns: &str) -> (u16, Option<String>, String) {
    let auth = format!("Bearer {OPERATOR_KEY}");
    let (s, h, b) = http(
        "GET",
        &node.url("/v1/kv/greeting"),
        &[("authorization", &auth), ("x-namespace", ns)],
        None,
    );
    (
        s,
        header(&h, "x-meshgate-member").map(str::to_string),
        String::from_utf8_lossy(&b).into_owned(),
    )
}

/// A namespace on members b and c, reached through a: requests are forwarded;
/// the serving member killed, its breaker opens after 5 failures while the
/// other member serves; the member back, the probe after the interval closes
/// the breaker. `/v1/status` shows each state.
#[test]
fn forwarding_and_breakers_across_three_nodes() {
    forwarding_and_breakers_on(&EtcdProcess::start());
}

/// The scenario of `forwarding_and_breakers_across_three_nodes` on a given
/// etcd (the security suite runs it on etcd with TLS client certificates).
pub(crate) fn forwarding_and_breakers_on(etcd: &EtcdProcess) {
    let tmp = tempfile::tempdir().unwrap();
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let ids = ["a", "b", "c"];
    let mut nodes: Vec<Option<TestNode>> = ids
        .iter()
        .zip(&ports)
        .map(|(id, p)| Some(TestNode::start_with(member_opts(etcd, id, *p, tmp.path()))))
        .collect();
    let a = nodes[0].take().unwrap();
    let (s, b) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"shop","members":["b","c"]}"#),
    );
    assert_eq!(s, 201, "{b}");
    assert_eq!(
        json(&b)["namespace"]["members"],
        serde_json::json!(["b", "c"])
    );
    let auth = format!("Bearer {OPERATOR_KEY}");
    let (s, h, body) = http(
        "PUT",
        &a.url("/v1/kv/greeting"),
        &[("authorization", &auth), ("x-namespace", "shop")],
        Some(b"hello"),
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    let first = header(&h, "x-meshgate-member")
        .expect("forwarded")
        .to_string();
    assert!(first == "b" || first == "c", "{first}");
    let other = if first == "b" { "c" } else { "b" };
    let (s, m, body) = read_via(&a, "shop");
    assert_eq!(
        (s, m.as_deref(), body.as_str()),
        (200, Some(first.as_str()), "hello")
    );

    // Kill the member the operator's requests hash to.
    let idx = ids.iter().position(|i| *i == first).unwrap();
    let mut dead = nodes[idx].take().unwrap();
    dead.kill9();
    for i in 1..=5 {
        let (s, m, body) = read_via(&a, "shop");
        assert_eq!(
            (s, m.as_deref(), body.as_str()),
            (200, Some(other), "hello"),
            "request {i}"
        );
        let br = breaker(&a, "shop", &first).expect("a breaker for the dead member");
        if i < 5 {
            assert_eq!(br["state"], "closed", "after {i} failures: {br}");
            assert_eq!(br["consecutive_failures"], i, "{br}");
        } else {
            assert_eq!(br["state"], "open", "after 5 failures: {br}");
        }
    }
    // The operator's `meshgate status` shows the open breaker and when it
    // probes next (the dead node stays in the live list until its lease
    // runs out: the breaker is what tells it now).
    let text = crate::cli::cli(&a.base, &["status", "--key", OPERATOR_KEY]);
    assert!(
        text.lines().any(|l| l.starts_with("breaker     shop -> ")
            && l.contains(&format!("-> {first}  open"))
            && l.contains("next probe in")),
        "{text}"
    );
    assert!(text.contains("store       etcd, healthy"), "{text}");
    let v = crate::cli::printed(&crate::cli::cli(
        &a.base,
        &["status", "--json", "--key", OPERATOR_KEY],
    ));
    assert_eq!(v["node_id"], "a", "{v:#}");
    let open = v["breakers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["member"] == first.as_str())
        .cloned()
        .unwrap_or_default();
    assert_eq!(open["state"], "open", "{v:#}");
    assert!(open["next_probe_seconds"].is_u64(), "{v:#}");
    // Open: the dead member is skipped (no connection attempt, no new failure).
    let (s, m, _) = read_via(&a, "shop");
    assert_eq!((s, m.as_deref()), (200, Some(other)));
    let (_, _, metrics) = http("GET", &a.url("/metrics"), &[OPERATOR_AUTH], None);
    let metrics = String::from_utf8_lossy(&metrics).into_owned();
    assert!(
        metrics.contains("meshgate_forwards_total{outcome=\"skipped_open\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "meshgate_breaker_state{{member=\"{first}\",namespace=\"shop\"}} 2"
        )),
        "{metrics}"
    );

    // The member comes back on its port; after the probe interval a request
    // probes it, succeeds, and closes the breaker (until then the open
    // breaker skips it and the other member serves).
    let back = TestNode::start_with(member_opts(etcd, &first, ports[idx], tmp.path()));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (s, m, _) = read_via(&a, "shop");
        assert_eq!(s, 200);
        if m.as_deref() == Some(first.as_str()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the probe never reached the member"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let br = breaker(&a, "shop", &first).unwrap();
    assert_eq!(br["state"], "closed", "{br}");
    assert_eq!(br["consecutive_failures"], 0, "{br}");
    drop(back);
}

/// A request that claims to come from a peer without a valid hop MAC is
/// served as anonymous (the forged identity is dropped), in cluster mode too.
#[test]
fn forged_hop_is_refused_in_a_cluster() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let a = TestNode::start_with(member_opts(&etcd, "a", free_port(), tmp.path()));
    let (s, _) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"vault","members":["a"]}"#),
    );
    assert_eq!(s, 201);
    let now = meshgate::http::now();
    for mac in [
        None,
        Some(format!("{now}.{}", "00".repeat(32))),
        Some(format!("{}.{}", now - 120, "11".repeat(32))),
    ] {
        let mut h = vec![
            ("x-internal-auth-namespace", "vault".to_string()),
            ("x-internal-auth-subject", "intruder".to_string()),
            ("x-internal-auth-grants", "*:*:*".to_string()),
            ("x-internal-auth-version", "v3".to_string()),
        ];
        if let Some(m) = mac {
            h.push(("x-internal-auth-mac", m));
        }
        let hr: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (s, _, b) = http("GET", &a.url("/v1/kv/secret"), &hr, None);
        assert_eq!(s, 401, "{}", String::from_utf8_lossy(&b));
    }
}

pub(crate) fn metric_sum(node: &TestNode, prefix: &str) -> f64 {
    let (_, _, b) = http("GET", &node.url("/metrics"), &[OPERATOR_AUTH], None);
    String::from_utf8_lossy(&b)
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub(crate) const EVERY_SECOND: &[u8] = include_bytes!("../../examples/functions/echo.wasm");

/// A cron function in a three-node cluster: every node ticks and tries each
/// slot, exactly one claims it, so the function fires once per slot.
#[test]
fn cron_fires_once_per_slot_in_the_cluster() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let ids = ["a", "b", "c"];
    let a = TestNode::start_with(member_opts(&etcd, "a", ports[0], tmp.path()));
    // No members named and none placed explicitly: every node serves it.
    let (s, b) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"clock","members":["a","b","c"]}"#),
    );
    assert_eq!(s, 201, "{b}");
    let boundary = "mgcronboundary";
    let mut body = Vec::new();
    for (name, data) in [
        ("name", &b"tick"[..]),
        ("metadata", br#"{"cron":"* * * * * *"}"#),
        ("wasm", EVERY_SECOND),
    ] {
        body.extend_from_slice(
            format!("--{boundary}\r\ncontent-disposition: form-data; name=\"{name}\"\r\n\r\n")
                .as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    let auth = format!("Bearer {OPERATOR_KEY}");
    let ct = format!("multipart/form-data; boundary={boundary}");
    let (s, _, b) = http(
        "POST",
        &a.url("/v1/functions"),
        &[
            ("authorization", &auth),
            ("x-namespace", "clock"),
            ("content-type", &ct),
        ],
        Some(&body),
    );
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    // B and C start after the deploy: they wake the namespace from etcd and tick too.
    let nodes = [
        a,
        TestNode::start_with(member_opts(&etcd, ids[1], ports[1], tmp.path())),
        TestNode::start_with(member_opts(&etcd, ids[2], ports[2], tmp.path())),
    ];
    // Let every node tick a few slots.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let tried: Vec<f64> = nodes
            .iter()
            .map(|n| metric_sum(n, "meshgate_cron_slots_total"))
            .collect();
        if tried.iter().all(|t| *t >= 3.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every node ticked: {tried:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let start = Instant::now();
    let claimed0: f64 = nodes
        .iter()
        .map(|n| metric_sum(n, "meshgate_cron_slots_total{outcome=\"claimed\""))
        .sum();
    let fired0: f64 = nodes
        .iter()
        .map(|n| metric_sum(n, "meshgate_function_invocations_total{namespace=\"clock\""))
        .sum();
    // A window of six claims: about 6 s when each slot is claimed once,
    // about 3 s (or less) when two or three nodes claim each one, which the
    // claims-per-second check below tells apart.
    let claimed_since = || {
        nodes
            .iter()
            .map(|n| metric_sum(n, "meshgate_cron_slots_total{outcome=\"claimed\""))
            .sum::<f64>()
            - claimed0
    };
    wait_until(Duration::from_secs(30), "six slots never claimed", || {
        claimed_since() >= 6.0
    });
    let claimed = claimed_since();
    let lost: f64 = nodes
        .iter()
        .map(|n| metric_sum(n, "meshgate_cron_slots_total{outcome=\"lost\""))
        .sum();
    let fired: f64 = nodes
        .iter()
        .map(|n| metric_sum(n, "meshgate_function_invocations_total{namespace=\"clock\""))
        .sum::<f64>()
        - fired0;
    let secs = start.elapsed().as_secs_f64();
    // One claim per slot in the whole cluster (three nodes tried each).
    assert!(
        claimed >= secs - 2.0 && claimed <= secs + 2.0,
        "claimed {claimed} slots in {secs:.1} s"
    );
    assert!(
        lost >= claimed,
        "the other nodes lost their claims: lost {lost}, claimed {claimed}"
    );
    assert!(
        fired <= claimed + 1.0,
        "fired {fired} times for {claimed} slots"
    );
}

type Socket = actix_codec::Framed<awc::BoxedSocket, awc::ws::Codec>;

async fn subscribe(node: &TestNode, key: &str, topic: &str) -> Socket {
    let url = format!("ws://{}/v1/pubsub/ws?topic={topic}&token={key}", node.addr);
    let (resp, s) = awc::Client::builder()
        .timeout(Duration::from_secs(30))
        .finish()
        .ws(url)
        .connect()
        .await
        .expect("subscribe");
    assert_eq!(resp.status(), 101);
    s
}

/// The next message's data, or None when nothing comes within `wait`.
async fn next_message(s: &mut Socket, wait: Duration) -> Option<String> {
    use base64::Engine as _;
    use futures_util::{SinkExt as _, StreamExt as _};
    loop {
        let f = tokio::time::timeout(wait, s.next()).await.ok()??.ok()?;
        match f {
            awc::ws::Frame::Text(b) | awc::ws::Frame::Binary(b) => {
                let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
                let data = base64::engine::general_purpose::STANDARD
                    .decode(v["data_base64"].as_str().unwrap())
                    .unwrap();
                return Some(String::from_utf8(data).unwrap());
            }
            awc::ws::Frame::Ping(p) => {
                let _ = s.send(awc::ws::Message::Pong(p)).await;
            }
            _ => {}
        }
    }
}

fn publish(node: &TestNode, key: &str, topic: &str, data: &str) {
    use base64::Engine as _;
    let body = serde_json::json!({"topic": topic,
        "data_base64": base64::engine::general_purpose::STANDARD.encode(data)});
    let (s, b) = node.with_key(
        key,
        "POST",
        "/v1/pubsub/publish",
        Some(body.to_string().as_bytes()),
    );
    assert_eq!(s, 200, "{b}");
}

/// The mesh: 1,000 messages published one after another on A reach the
/// subscribers on A, B and C exactly once each, in publish order.
#[actix_rt::test]
async fn thousand_messages_cross_the_mesh_once_in_order() {
    thousand_messages_on(&EtcdProcess::start()).await;
}

/// The scenario of `thousand_messages_cross_the_mesh_once_in_order` on a
/// given etcd (the security suite runs it on etcd with TLS client certificates).
pub(crate) async fn thousand_messages_on(etcd: &EtcdProcess) {
    let tmp = tempfile::tempdir().unwrap();
    let nodes: Vec<TestNode> = ["a", "b", "c"]
        .iter()
        .map(|id| TestNode::start_with(member_opts(etcd, id, free_port(), tmp.path())))
        .collect();
    let key = nodes[0].create_namespace("chat");
    // Every node connected to the two others.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !nodes
        .iter()
        .all(|n| metric_sum(n, "meshgate_mesh_peers") >= 2.0)
    {
        assert!(Instant::now() < deadline, "the mesh never formed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut subs = Vec::new();
    for n in &nodes {
        subs.push(subscribe(n, &key, "room").await);
    }
    // Warm up until a message from A reaches every subscriber.
    let mut warm = vec![false; 3];
    for round in 0.. {
        assert!(
            round < 60,
            "a warm-up message never crossed the mesh: {warm:?}"
        );
        publish(&nodes[0], &key, "room", &format!("warm-{round}"));
        for (i, s) in subs.iter_mut().enumerate() {
            while let Some(m) = next_message(s, Duration::from_millis(300)).await {
                if m.starts_with("warm-") {
                    warm[i] = true;
                }
            }
        }
        if warm.iter().all(|w| *w) {
            break;
        }
    }
    let a = nodes[0].base.clone();
    let key2 = key.clone();
    let publisher = std::thread::spawn(move || {
        for i in 0..1000 {
            use base64::Engine as _;
            let body = serde_json::json!({"topic": "room",
                "data_base64": base64::engine::general_purpose::STANDARD.encode(i.to_string())});
            let auth = format!("Bearer {key2}");
            let (s, _, b) = http(
                "POST",
                &format!("{a}/v1/pubsub/publish"),
                &[
                    ("authorization", &auth),
                    ("content-type", "application/json"),
                ],
                Some(body.to_string().as_bytes()),
            );
            assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
        }
    });
    for (n, s) in subs.iter_mut().enumerate() {
        let mut want = 0;
        while want < 1000 {
            let m = next_message(s, Duration::from_secs(20))
                .await
                .unwrap_or_else(|| panic!("node {n}: message {want} never came"));
            if m.starts_with("warm-") {
                continue;
            }
            assert_eq!(m, want.to_string(), "node {n}: out of order or duplicated");
            want += 1;
        }
    }
    publisher.join().unwrap();
    // A last message behind the thousand: each subscriber's next message is
    // that one (messages come in publish order), so no message came twice.
    publish(&nodes[0], &key, "room", "end");
    for (n, s) in subs.iter_mut().enumerate() {
        assert_eq!(
            next_message(s, Duration::from_secs(20)).await.as_deref(),
            Some("end"),
            "node {n} got a message twice"
        );
    }
}

/// Deployments in a cluster: two namespaces racing for one host through two
/// nodes get exactly one 201 and one 409 (the change lock is store-wide), and
/// both nodes then route the host to the winner (each node follows the
/// deployments' generation).
#[test]
fn deployments_are_cluster_wide() {
    use crate::deploy::{Upstream, deploy_json, via};
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    // The upstreams listen on loopback, which the egress policy forbids by default.
    let member = |id| {
        let mut o = member_opts(&etcd, id, free_port(), tmp.path());
        o.env.push((
            "MESHGATE_DEPLOY_UPSTREAM_ALLOW".into(),
            "127.0.0.0/8".into(),
        ));
        o
    };
    let a = TestNode::start_with(member("a"));
    let b = TestNode::start_with(member("b"));
    let ns_key = |node: &TestNode, body: &str| {
        let (s, b) = node.op("POST", "/v1/namespaces", Some(body));
        assert_eq!(s, 201, "{b}");
        json(&b)["api_key"].as_str().unwrap().to_string()
    };
    let key_x = ns_key(&a, r#"{"name":"x","members":["a"]}"#);
    let key_y = ns_key(&b, r#"{"name":"y","members":["b"]}"#);
    let (up_x, up_y) = (Upstream::start("ux"), Upstream::start("uy"));
    for round in 0..4 {
        let host = format!("race{round}.example.test");
        let body = |up: &Upstream| {
            serde_json::json!({"name": format!("site{round}"), "hosts": [host],
                "upstream": {"instances": [up.url()]}})
        };
        let (bx, by) = (body(&up_x), body(&up_y));
        let (sx, sy) = std::thread::scope(|s| {
            let tx = s.spawn(|| deploy_json(&a, &key_x, bx));
            let ty = s.spawn(|| deploy_json(&b, &key_y, by));
            (tx.join().unwrap(), ty.join().unwrap())
        });
        let mut statuses = [sx.0, sy.0];
        statuses.sort();
        assert_eq!(statuses, [201, 409], "round {round}: {sx:?} {sy:?}");
        let loser = if sx.0 == 409 { &sx.1 } else { &sy.1 };
        assert_eq!(loser["error"]["code"], "HOST_TAKEN");
        let winner = if sx.0 == 201 { "ux" } else { "uy" };
        for (name, node) in [("a", &a), ("b", &b)] {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let (s, _, body) = via(node, &host, "GET", "/who", &[], None);
                let served = json(&String::from_utf8_lossy(&body))["id"].clone();
                if s == 200 && served == winner {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "round {round}: node {name} does not route {host} to {winner}: {s} {served}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Every `meshgate_actor_mailbox_depth` gauge of a node: (series, value).
fn mailbox_depths(node: &TestNode) -> Vec<(String, f64)> {
    let (_, _, b) = http("GET", &node.url("/metrics"), &[OPERATOR_AUTH], None);
    String::from_utf8_lossy(&b)
        .lines()
        .filter(|l| l.starts_with("meshgate_actor_mailbox_depth{"))
        .filter_map(|l| {
            let (series, v) = l.rsplit_once(' ')?;
            Some((series.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// Asserts that no mailbox depth gauge of `node` is below 0; returns whether all are 0.
fn depths_never_negative(node: &TestNode, when: &str) -> bool {
    let depths = mailbox_depths(node);
    assert!(!depths.is_empty(), "{when}: no mailbox depth gauges");
    for (series, v) in &depths {
        assert!(*v >= 0.0, "{when}: {series} {v}");
    }
    depths.iter().all(|(_, v)| *v == 0.0)
}

/// A WebSocket on a plain TCP stream, for clients that pipeline or never
/// read: the stream and what came after the 101.
async fn raw_ws(
    node: &TestNode,
    path: &str,
    recv_buffer: Option<u32>,
) -> (tokio::net::TcpStream, Vec<u8>) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let addr: std::net::SocketAddr = node.addr.parse().unwrap();
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    if let Some(n) = recv_buffer {
        sock.set_recv_buffer_size(n).unwrap();
    }
    let mut stream = sock.connect(addr).await.unwrap();
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    );
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let end = loop {
        let n = stream.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed during the handshake");
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    buf.drain(..end);
    (stream, buf)
}

/// A masked client frame.
fn client_frame(op: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0x80 | op];
    let len = payload.len();
    if len < 126 {
        f.push(0x80 | len as u8);
    } else if len <= 65535 {
        f.push(0x80 | 126);
        f.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        f.push(0x80 | 127);
        f.extend_from_slice(&(len as u64).to_be_bytes());
    }
    let mask = [1u8, 2, 3, 4];
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i & 3]));
    f
}

/// Takes every complete server frame off the front of `buf`: (opcode, payload).
fn server_frames(buf: &mut Vec<u8>) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    loop {
        if buf.len() < 2 {
            return out;
        }
        let (len, at) = match buf[1] & 0x7f {
            126 if buf.len() >= 4 => (u16::from_be_bytes([buf[2], buf[3]]) as usize, 4),
            127 if buf.len() >= 10 => (
                u64::from_be_bytes(buf[2..10].try_into().unwrap()) as usize,
                10,
            ),
            126 | 127 => return out,
            n => (n as usize, 2),
        };
        if buf.len() < at + len {
            return out;
        }
        out.push((buf[0] & 0x0f, buf[at..at + len].to_vec()));
        buf.drain(..at + len);
    }
}

/// Reads a `format=binary` subscriber until `n` numbered messages (the
/// payload's first 8 bytes, big-endian; numbers from 2^62 are warm-ups and
/// skipped) or a close frame; returns the numbers and the close code.
async fn read_numbers(
    stream: &mut tokio::net::TcpStream,
    buf: &mut Vec<u8>,
    n: usize,
    quiet: Duration,
) -> (Vec<u64>, Option<u16>) {
    use tokio::io::AsyncReadExt as _;
    let mut got = Vec::with_capacity(n);
    let mut chunk = vec![0u8; 1 << 16];
    while got.len() < n {
        for (op, payload) in server_frames(buf) {
            match op {
                0x2 if payload.len() >= 8 => {
                    let v = u64::from_be_bytes(payload[..8].try_into().unwrap());
                    if v < 1 << 62 {
                        got.push(v);
                    }
                }
                0x8 => {
                    let code = payload.get(..2).map(|c| u16::from_be_bytes([c[0], c[1]]));
                    return (got, code);
                }
                _ => {}
            }
        }
        if got.len() >= n {
            break;
        }
        match tokio::time::timeout(quiet, stream.read(&mut chunk)).await {
            Ok(Ok(k)) if k > 0 => buf.extend_from_slice(&chunk[..k]),
            _ => break,
        }
    }
    (got, None)
}

/// A `/v1/ws` publish frame of a 128-byte payload numbered `n`.
fn numbered_publish(n: u64, topic: &str) -> Vec<u8> {
    use base64::Engine as _;
    let mut data = n.to_be_bytes().to_vec();
    data.resize(128, b'x');
    let b64 = base64::engine::general_purpose::STANDARD.encode(&data);
    client_frame(
        0x1,
        format!(r#"{{"id":{n},"type":"publish","topic":"{topic}","data_base64":"{b64}"}}"#)
            .as_bytes(),
    )
}

/// Two members `a` and `b` (b with `b_extra` config) with the mesh formed
/// and a namespace `chat` on both; returns them and the namespace's key.
async fn mesh_pair(
    etcd: &EtcdProcess,
    dir: &std::path::Path,
    b_extra: &str,
) -> (TestNode, TestNode, String) {
    let a = TestNode::start_with(member_opts(etcd, "a", free_port(), dir));
    let mut b_opts = member_opts(etcd, "b", free_port(), dir);
    b_opts.config.push_str(b_extra);
    let b = TestNode::start_with(b_opts);
    let (s, body) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"chat","members":["a","b"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    let key = json(&body)["api_key"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric_sum(&a, "meshgate_mesh_peers") < 1.0 || metric_sum(&b, "meshgate_mesh_peers") < 1.0
    {
        assert!(Instant::now() < deadline, "the mesh never formed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (a, b, key)
}

/// Publishes numbered warm-ups (from 2^62) on `node` over HTTP until one
/// reaches the subscriber (the mesh's first message to a topic may take a
/// heartbeat); what follows them is skipped by [`read_numbers`].
async fn warm_up(
    node: &TestNode,
    key: &str,
    topic: &str,
    sub: &mut tokio::net::TcpStream,
    buf: &mut Vec<u8>,
) {
    use base64::Engine as _;
    use tokio::io::AsyncReadExt as _;
    let mut chunk = vec![0u8; 1 << 16];
    for round in 0u64..60 {
        let mut data = ((1u64 << 62) + round).to_be_bytes().to_vec();
        data.resize(128, b'x');
        let body = serde_json::json!({"topic": topic,
            "data_base64": base64::engine::general_purpose::STANDARD.encode(&data)});
        let (s, b) = node.with_key(
            key,
            "POST",
            "/v1/pubsub/publish",
            Some(body.to_string().as_bytes()),
        );
        assert_eq!(s, 200, "{b}");
        if let Ok(Ok(k)) =
            tokio::time::timeout(Duration::from_millis(300), sub.read(&mut chunk)).await
            && k > 0
        {
            // Keep the bytes (frames of the warm-ups, skipped later).
            buf.extend_from_slice(&chunk[..k]);
            return;
        }
    }
    panic!("a warm-up message never crossed the mesh");
}

/// Issue #41: a publisher on A pipelining a burst of 5,000 messages on one
/// `/v1/ws` socket (every frame written at once, the answers read as they
/// come) to a subscriber on B that keeps reading: every message arrives,
/// once, in publish order, and nothing is dropped on the way. B's namespace
/// mailbox admits only 4: mesh deliveries do not go through it (before, a
/// burst from the mesh overflowed it and was dropped as `mailbox_full`).
#[actix_rt::test]
async fn pipelined_burst_crosses_the_mesh_complete_and_in_order() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    const N: u64 = 5_000;
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, key) = mesh_pair(&etcd, tmp.path(), "[server]\nmailbox_capacity = 4\n").await;
    let (mut sub, mut buf) = raw_ws(
        &b,
        &format!("/v1/pubsub/ws?topic=room&format=binary&token={key}"),
        None,
    )
    .await;
    warm_up(&a, &key, "room", &mut sub, &mut buf).await;
    let (publisher, _) = raw_ws(&a, &format!("/v1/ws?token={key}"), None).await;
    let (mut rd, mut wr) = publisher.into_split();
    let writer = actix_rt::spawn(async move {
        let mut all = Vec::new();
        for n in 0..N {
            all.extend(numbered_publish(n, "room"));
        }
        wr.write_all(&all).await.unwrap();
        wr
    });
    let acks = actix_rt::spawn(async move {
        let (mut acked, mut refused) = (0u64, Vec::new());
        let mut pbuf = Vec::new();
        let mut chunk = vec![0u8; 1 << 16];
        while acked < N {
            let k = tokio::time::timeout(Duration::from_secs(60), rd.read(&mut chunk))
                .await
                .expect("the publisher's answers stopped")
                .unwrap();
            assert!(k > 0, "the publisher's socket closed");
            pbuf.extend_from_slice(&chunk[..k]);
            for (op, payload) in server_frames(&mut pbuf) {
                if op == 0x1 && payload.starts_with(b"{\"id\"") {
                    acked += 1;
                    if !payload.windows(9).any(|w| w == b"\"ok\":true") {
                        refused.push(String::from_utf8_lossy(&payload).to_string());
                    }
                }
            }
        }
        refused
    });
    let (got, close) = read_numbers(&mut sub, &mut buf, N as usize, Duration::from_secs(30)).await;
    let refused = acks.await.unwrap();
    let _wr = writer.await.unwrap();
    assert!(
        refused.is_empty(),
        "publishes refused: {:?}",
        &refused[..refused.len().min(3)]
    );
    assert_eq!(close, None, "the subscriber was closed");
    let first_wrong = got.iter().enumerate().find(|(i, v)| **v != *i as u64);
    assert!(
        got.len() == N as usize && first_wrong.is_none(),
        "B's subscriber got {} of {N}; first out of place: {first_wrong:?}; B dropped {} at the mesh, {} in pub/sub",
        got.len(),
        metric_sum(&b, "meshgate_mesh_messages_dropped_total"),
        metric_sum(&b, "meshgate_pubsub_dropped_total"),
    );
    assert_eq!(metric_sum(&b, "meshgate_mesh_messages_dropped_total"), 0.0);
    assert_eq!(
        metric_sum(&b, "meshgate_ws_slow_consumers_closed_total"),
        0.0
    );
    // Nothing more behind them (no duplicate).
    let (extra, _) = read_numbers(&mut sub, &mut buf, 1, Duration::from_millis(500)).await;
    assert!(extra.is_empty(), "more than {N}: {extra:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(depths_never_negative(&a, "at rest (a)") & depths_never_negative(&b, "at rest (b)")) {
        assert!(
            Instant::now() < deadline,
            "depths not back at 0: a {:?} b {:?}",
            mailbox_depths(&a),
            mailbox_depths(&b)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The slow-consumer limit still holds for mesh deliveries: on B, a
/// subscriber that never reads (small TCP buffer) is closed with 4008 once
/// its outbound queue overflows, while another subscriber on B gets every
/// message A published, in order; the mesh itself drops nothing.
#[actix_rt::test]
async fn slow_consumer_on_the_far_node_is_still_closed() {
    use base64::Engine as _;
    const N: u64 = 1_500;
    const BATCH: u64 = 25;
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, key) = mesh_pair(
        &etcd,
        tmp.path(),
        "[pubsub]\noutbound_queue_messages = 1024\noutbound_queue_bytes = 262144\n",
    )
    .await;
    let path = format!("/v1/pubsub/ws?topic=room&format=binary&token={key}");
    let (mut good, mut good_buf) = raw_ws(&b, &path, None).await;
    warm_up(&a, &key, "room", &mut good, &mut good_buf).await;
    let (mut slow, mut slow_buf) = raw_ws(&b, &path, Some(4096)).await;
    let a_base = a.base.clone();
    let key2 = key.clone();
    // 8 KiB messages, 25 per request: 12 MiB in all, far beyond what the
    // slow socket's queue (256 KiB) and TCP buffers hold.
    let publisher = std::thread::spawn(move || {
        let auth = format!("Bearer {key2}");
        for first in (0..N).step_by(BATCH as usize) {
            let messages: Vec<_> = (first..first + BATCH)
                .map(|n| {
                    let mut data = n.to_be_bytes().to_vec();
                    data.resize(8 * 1024, b'x');
                    serde_json::json!({"topic": "room",
                        "data_base64": base64::engine::general_purpose::STANDARD.encode(&data)})
                })
                .collect();
            let body = serde_json::json!({ "messages": messages }).to_string();
            let (s, _, b) = http(
                "POST",
                &format!("{a_base}/v1/pubsub/publish-batch"),
                &[
                    ("authorization", &auth),
                    ("content-type", "application/json"),
                ],
                Some(body.as_bytes()),
            );
            assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
        }
    });
    let (got, close) = read_numbers(
        &mut good,
        &mut good_buf,
        N as usize,
        Duration::from_secs(30),
    )
    .await;
    publisher.join().unwrap();
    assert_eq!(close, None, "the reading subscriber was closed");
    assert_eq!(
        got.len(),
        N as usize,
        "the reading subscriber got {} of {N}",
        got.len()
    );
    assert!(
        got.iter().enumerate().all(|(i, v)| *v == i as u64),
        "out of order"
    );
    let (frames, code) = read_numbers(
        &mut slow,
        &mut slow_buf,
        N as usize,
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(
        code,
        Some(4008),
        "the slow consumer's close code (after {} frames)",
        frames.len()
    );
    assert!(
        (frames.len() as u64) < N,
        "the slow consumer cannot have everything"
    );
    assert_eq!(
        metric_sum(&b, "meshgate_ws_slow_consumers_closed_total"),
        1.0
    );
    assert_eq!(metric_sum(&b, "meshgate_mesh_messages_dropped_total"), 0.0);
}

/// A `multipart/form-data` deploy of `wasm` as `name` into namespace `ns`
/// with the operator key through `node`, plus extra text parts.
pub(crate) fn deploy_as_operator(
    node: &TestNode,
    ns: &str,
    name: &str,
    wasm: &[u8],
    extra: &[(&str, &str)],
) {
    let boundary = "mgplacementboundary";
    let mut body = Vec::new();
    let mut parts: Vec<(&str, &[u8])> = vec![("name", name.as_bytes()), ("wasm", wasm)];
    for (k, v) in extra {
        parts.push((k, v.as_bytes()));
    }
    for (name, data) in parts {
        body.extend_from_slice(
            format!("--{boundary}\r\ncontent-disposition: form-data; name=\"{name}\"\r\n\r\n")
                .as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    let auth = format!("Bearer {OPERATOR_KEY}");
    let ct = format!("multipart/form-data; boundary={boundary}");
    let (s, _, b) = http(
        "POST",
        &node.url("/v1/functions"),
        &[
            ("authorization", &auth),
            ("x-namespace", ns),
            ("content-type", &ct),
        ],
        Some(&body),
    );
    assert_eq!(s, 201, "deploy {name}: {}", String::from_utf8_lossy(&b));
}

/// The actors `/v1/status` lists for namespace `ns` on `node` (a namespace
/// supervisor registers one).
pub(crate) fn actors_of(node: &TestNode, ns: &str) -> Vec<serde_json::Value> {
    let (s, _, b) = http("GET", &node.url("/v1/status"), &[OPERATOR_AUTH], None);
    assert_eq!(s, 200);
    json(&String::from_utf8_lossy(&b))["actors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["namespace"] == ns)
        .cloned()
        .collect()
}

/// `meshgate_function_invocations_total` of namespace `ns` on one node.
pub(crate) fn invocations_on(node: &TestNode, ns: &str) -> f64 {
    metric_sum(
        node,
        &format!("meshgate_function_invocations_total{{namespace=\"{ns}\"}}"),
    )
}

pub(crate) fn error_code(body: &[u8]) -> String {
    json(&String::from_utf8_lossy(body))["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// `POST /v1/invoke/{ns}/{fn}` through nodes that are not members of `ns`
/// runs on a member of `ns`, the namespace the path names: without a
/// credential (a public function answers, a private one is 401 from the
/// member), and with a credential of another namespace, whose own members
/// are elsewhere (a public function answers, a private one is 403). The
/// non-members ran nothing of `ns`, started no supervisor for it and hold
/// only its breakers.
#[test]
fn public_invokes_are_forwarded_to_the_named_namespace() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let nodes: Vec<TestNode> = ["a", "b", "c"]
        .iter()
        .map(|id| TestNode::start_with(member_opts(&etcd, id, free_port(), tmp.path())))
        .collect();
    let (a, b, c) = (&nodes[0], &nodes[1], &nodes[2]);
    let (s, body) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"web","members":["b"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    let (s, body) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"other","members":["c"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    let other_key = json(&body)["api_key"].as_str().unwrap().to_string();
    deploy_as_operator(a, "web", "hello", EVERY_SECOND, &[("is_public", "true")]);
    deploy_as_operator(a, "web", "private", EVERY_SECOND, &[]);

    // No credential, through a (a member of nothing) and c (a member of
    // "other" only): the member of "web" runs it.
    for via in [a, c] {
        let (s, h, out) = http(
            "POST",
            &via.url("/v1/invoke/web/hello"),
            &[],
            Some(b"{\"hi\":1}"),
        );
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&out));
        assert_eq!(header(&h, "x-meshgate-member"), Some("b"));
        assert_eq!(json(&String::from_utf8_lossy(&out))["hi"], 1);
        // The anonymous hop grants nothing: a private function still needs a
        // credential of its namespace, and the member says so.
        let (s, h, out) = http("POST", &via.url("/v1/invoke/web/private"), &[], Some(b"{}"));
        assert_eq!(s, 401, "{}", String::from_utf8_lossy(&out));
        assert_eq!(error_code(&out), "MISSING_CREDENTIAL");
        assert_eq!(header(&h, "x-meshgate-member"), Some("b"));
    }
    // A credential of "other" (members: c) through a, and through c itself:
    // forwarded to the members of "web", not of "other".
    let auth = format!("Bearer {other_key}");
    for via in [a, c] {
        let (s, h, out) = http(
            "POST",
            &via.url("/v1/invoke/web/hello"),
            &[("authorization", &auth)],
            Some(b"{\"from\":\"other\"}"),
        );
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&out));
        assert_eq!(header(&h, "x-meshgate-member"), Some("b"));
        assert_eq!(json(&String::from_utf8_lossy(&out))["from"], "other");
        // Its grants are of "other": they open nothing private in "web".
        let (s, h, out) = http(
            "POST",
            &via.url("/v1/invoke/web/private"),
            &[("authorization", &auth)],
            Some(b"{}"),
        );
        assert_eq!(s, 403, "{}", String::from_utf8_lossy(&out));
        assert_eq!(error_code(&out), "NAMESPACE_MISMATCH");
        assert_eq!(header(&h, "x-meshgate-member"), Some("b"));
    }
    // A function or namespace that does not exist is still an answer.
    let (s, _, out) = http("POST", &a.url("/v1/invoke/web/nothing"), &[], Some(b"{}"));
    assert_eq!(s, 404, "{}", String::from_utf8_lossy(&out));
    let (s, _, out) = http("POST", &a.url("/v1/invoke/nowhere/hello"), &[], Some(b"{}"));
    assert_eq!(s, 404, "{}", String::from_utf8_lossy(&out));

    // Only b ran "web"'s functions.
    assert!(
        invocations_on(b, "web") >= 4.0,
        "{}",
        invocations_on(b, "web")
    );
    assert_eq!(invocations_on(a, "web"), 0.0);
    assert_eq!(invocations_on(c, "web"), 0.0);
    // The non-members forwarded without a namespace supervisor for "web":
    // they hold its breakers (in /v1/status and /metrics), nothing else.
    for (id, via) in [("a", a), ("c", c)] {
        let actors = actors_of(via, "web");
        assert!(actors.is_empty(), "{id} runs actors of web: {actors:?}");
        let br = breaker(via, "web", "b").unwrap_or_else(|| panic!("no breaker of web on {id}"));
        assert_eq!(br["state"], "closed", "{br}");
        assert_eq!(
            metric_sum(
                via,
                "meshgate_breaker_state{member=\"b\",namespace=\"web\"}"
            ),
            0.0
        );
        let (_, _, m) = http("GET", &via.url("/metrics"), &[OPERATOR_AUTH], None);
        assert!(
            String::from_utf8_lossy(&m)
                .contains("meshgate_breaker_state{member=\"b\",namespace=\"web\"}"),
            "{id} does not show the breaker of web/b in /metrics"
        );
    }
    assert!(!actors_of(b, "web").is_empty(), "the member runs web");
}

/// A namespace placed on b alone, with a cron function (every second) and a
/// pub/sub trigger function: b runs both; a and c, started after the deploy
/// (so they would wake every namespace with functions at start-up), tick no
/// cron slot, run nothing of it and start no supervisor for it, while
/// publishes sent through them fire the trigger on b.
#[test]
fn cron_and_triggers_run_on_members_only() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let b = TestNode::start_with(member_opts(&etcd, "b", free_port(), tmp.path()));
    let (s, body) = b.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"timer","members":["b"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    let key = json(&body)["api_key"].as_str().unwrap().to_string();
    deploy_as_operator(
        &b,
        "timer",
        "tick",
        EVERY_SECOND,
        &[("metadata", r#"{"cron":"* * * * * *"}"#)],
    );
    deploy_as_operator(
        &b,
        "timer",
        "onevent",
        EVERY_SECOND,
        &[("metadata", r#"{"pubsub_topics":["events"]}"#)],
    );
    let a = TestNode::start_with(member_opts(&etcd, "a", free_port(), tmp.path()));
    let c = TestNode::start_with(member_opts(&etcd, "c", free_port(), tmp.path()));
    // b claims and runs three more slots while a and c are up.
    let claimed = |n: &TestNode| metric_sum(n, "meshgate_cron_slots_total{outcome=\"claimed\"}");
    let from = claimed(&b);
    let deadline = Instant::now() + Duration::from_secs(20);
    while claimed(&b) < from + 3.0 {
        assert!(Instant::now() < deadline, "b does not run its cron");
        std::thread::sleep(Duration::from_millis(200));
    }
    // Publishes through the non-members are forwarded; b fires the trigger.
    let before = metric_sum(
        &b,
        "meshgate_function_invocations_total{namespace=\"timer\"}",
    );
    for via in [&a, &c] {
        let (s, body) = via.with_key(
            &key,
            "POST",
            "/v1/pubsub/publish",
            Some(br#"{"topic":"events","data_base64":"aGk="}"#),
        );
        assert_eq!(s, 200, "{body}");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (s, body) = b.with_key(&key, "GET", "/v1/functions/onevent/logs", None);
        assert_eq!(s, 200, "{body}");
        let fired = json(&body)["logs"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["trigger"] == "pubsub")
            .count();
        if fired >= 2 {
            break;
        }
        assert!(Instant::now() < deadline, "the trigger fired {fired} times");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        metric_sum(
            &b,
            "meshgate_function_invocations_total{namespace=\"timer\"}"
        ) > before
    );
    // a and c have been up for several cron slots by now: none tried.
    for (id, n) in [("a", &a), ("c", &c)] {
        assert_eq!(
            metric_sum(n, "meshgate_cron_slots_total"),
            0.0,
            "{id} tried cron slots of a namespace it is not a member of"
        );
        assert_eq!(
            invocations_on(n, "timer"),
            0.0,
            "{id} ran functions of timer"
        );
        let actors = actors_of(n, "timer");
        assert!(actors.is_empty(), "{id} runs actors of timer: {actors:?}");
    }
}

// ---- Live mesh membership and readiness (issue #14). ----

/// Options of mesh node `id` with the production registry interval
/// (`register_seconds` 15): only the registry watch can make a change known
/// within seconds. Returns before `/readyz` is 200.
fn mesh_member(etcd: &EtcdProcess, id: &str, dir: &std::path::Path) -> NodeOpts {
    NodeOpts {
        config: format!(
            "{TEST_CONFIG}[cluster]\n{}node_id = \"{id}\"\nready_timeout_seconds = 10\n",
            etcd.cluster_toml()
        ),
        env: vec![("MESHGATE_CLUSTER_SECRET".into(), SECRET.into())],
        data_dir: Some(dir.join(id)),
        no_wait_ready: true,
        ..Default::default()
    }
}

fn is_ready(node: &TestNode) -> bool {
    http("GET", &node.url("/readyz"), &[], None).0 == 200
}

/// Polls `/readyz` every 10 ms until 200; returns when it was seen.
fn ready_at(node: &TestNode) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !is_ready(node) {
        assert!(
            Instant::now() < deadline,
            "never ready: {}",
            node.stderr.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    Instant::now()
}

/// The node's mesh as `/v1/status` shows it.
fn mesh_status(node: &TestNode) -> serde_json::Value {
    let (s, _, b) = http("GET", &node.url("/v1/status"), &[OPERATOR_AUTH], None);
    assert_eq!(s, 200);
    json(&String::from_utf8_lossy(&b))["mesh"].clone()
}

fn listed(mesh: &serde_json::Value, field: &str, peer: &str) -> bool {
    mesh[field]
        .as_array()
        .is_some_and(|a| a.iter().any(|p| p == peer))
}

/// Three nodes started together: the moment the last `/readyz` turns 200,
/// every node is connected to both others (`meshgate_mesh_peers` 2, read at
/// once, no extra wait), and none gave up waiting for a peer.
#[test]
fn ready_means_connected_to_every_peer() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let nodes: Vec<TestNode> = ["a", "b", "c"]
        .iter()
        .map(|id| TestNode::start_with(mesh_member(&etcd, id, tmp.path())))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut ready = [false; 3];
    while !ready.iter().all(|r| *r) {
        assert!(Instant::now() < deadline, "not all ready: {ready:?}");
        for (i, n) in nodes.iter().enumerate() {
            ready[i] = ready[i] || is_ready(n);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let peers: Vec<f64> = nodes
        .iter()
        .map(|n| metric_sum(n, "meshgate_mesh_peers"))
        .collect();
    assert_eq!(peers, [2.0, 2.0, 2.0], "mesh peers right after ready");
    for n in &nodes {
        let log = n.stderr.lock().unwrap();
        assert!(!log.contains("Ready without"), "{log}");
    }
}

/// A node added to a running cluster: once its `/readyz` is 200, a message
/// published on another node at most 1 s later reaches a subscriber on it
/// (and the subscriber that was there before).
#[actix_rt::test]
async fn node_added_to_a_running_cluster_hears_the_next_publish() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let a = TestNode::start_with(mesh_member(&etcd, "a", tmp.path()));
    a.wait_ready();
    let b = TestNode::start_with(mesh_member(&etcd, "b", tmp.path()));
    b.wait_ready();
    let key = a.create_namespace("late");
    let mut on_b = subscribe(&b, &key, "news").await;
    let c = TestNode::start_with(mesh_member(&etcd, "c", tmp.path()));
    let ready = ready_at(&c);
    let mut on_c = subscribe(&c, &key, "news").await;
    publish(&a, &key, "news", "first");
    let published = ready.elapsed();
    assert!(
        published <= Duration::from_secs(1),
        "published {published:?} after ready: too late to show anything"
    );
    assert_eq!(
        next_message(&mut on_c, Duration::from_secs(5))
            .await
            .as_deref(),
        Some("first"),
        "the new node's subscriber missed a message published {published:?} after it became ready"
    );
    assert_eq!(
        next_message(&mut on_b, Duration::from_secs(5))
            .await
            .as_deref(),
        Some("first")
    );
}

/// A node stopped cleanly removes its registration; the others drop it from
/// their registry and their connections within 3 s of its exit (the
/// periodic re-read, every 15 s here, would be far later), and it comes back
/// when the node restarts.
#[test]
fn stopped_node_is_dropped_from_the_mesh_at_once() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let mut nodes: Vec<TestNode> = ["a", "b", "c"]
        .iter()
        .map(|id| TestNode::start_with(mesh_member(&etcd, id, tmp.path())))
        .collect();
    for n in &nodes {
        n.wait_ready();
    }
    let c_id = mesh_status(&nodes[2])["peer_id"]
        .as_str()
        .unwrap()
        .to_string();
    for n in &nodes[..2] {
        let m = mesh_status(n);
        assert!(listed(&m, "registered", &c_id) && listed(&m, "connected", &c_id));
    }
    nodes[2].signal(15);
    assert_eq!(nodes[2].wait_exit(Duration::from_secs(20)), Some(0));
    let gone = Instant::now();
    for n in &nodes[..2] {
        loop {
            let m = mesh_status(n);
            if !listed(&m, "registered", &c_id) && !listed(&m, "connected", &c_id) {
                break;
            }
            assert!(
                gone.elapsed() < Duration::from_secs(3),
                "the stopped node is still in the mesh: {m}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(metric_sum(n, "meshgate_mesh_peers"), 1.0);
    }
    // Back under the same key (same data folder): dialed and ready again.
    let c = TestNode::start_with(mesh_member(&etcd, "c", tmp.path()));
    c.wait_ready();
    for n in &nodes[..2] {
        let deadline = Instant::now() + Duration::from_secs(3);
        while !listed(&mesh_status(n), "connected", &c_id) {
            assert!(
                Instant::now() < deadline,
                "the restarted node never rejoined"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A well-signed anonymous hop (what a non-member sends for a caller without
/// a credential) grants nothing: the member serves it as an anonymous
/// request, so it reaches a public function and nothing else (a private
/// function, the KV, whoami are all 401), and a hop without a namespace that
/// carries grants is not believed at all.
#[test]
fn anonymous_hop_grants_nothing_but_public_invokes() {
    use meshgate::auth::{
        HopIdentity, HopKey, HopRequest, HopVersion, hop_body_sha256, hop_to_headers,
    };
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let a = TestNode::start_with(member_opts(&etcd, "a", free_port(), tmp.path()));
    let (s, body) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"vault","members":["a"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    deploy_as_operator(&a, "vault", "hello", EVERY_SECOND, &[("is_public", "true")]);
    deploy_as_operator(&a, "vault", "private", EVERY_SECOND, &[]);
    let key = HopKey::from_secret(SECRET.as_bytes());
    let anonymous = HopIdentity {
        namespace: String::new(),
        subject: "anonymous".into(),
        custom: String::new(),
        grants: vec![],
        exp: None,
        iat: None,
        jti: None,
        device: None,
        session: None,
        operator: false,
    };
    let send = |id: &HopIdentity, method: &str, path: &str, body: &[u8]| {
        let digest = hop_body_sha256(body);
        let req = HopRequest {
            method,
            path,
            query: "",
            body_sha256: &digest,
        };
        let mac = key.sign(HopVersion::V4, &req, id, meshgate::http::now());
        let h = hop_to_headers(id, HopVersion::V4, &digest, &mac);
        let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (s, _, b) = http(method, &a.url(path), &h, (!body.is_empty()).then_some(body));
        (s, String::from_utf8_lossy(&b).into_owned())
    };
    let (s, b) = send(&anonymous, "POST", "/v1/invoke/vault/hello", b"{\"x\":2}");
    assert_eq!(s, 200, "{b}");
    assert_eq!(json(&b)["x"], 2);
    for (method, path, body) in [
        ("POST", "/v1/invoke/vault/private", &b"{}"[..]),
        ("GET", "/v1/kv/k?namespace=vault", &b""[..]),
        ("GET", "/v1/auth/whoami", &b""[..]),
    ] {
        let (s, b) = send(&anonymous, method, path, body);
        assert_eq!(s, 401, "{method} {path}: {b}");
        assert_eq!(json(&b)["error"]["code"], "MISSING_CREDENTIAL", "{b}");
    }
    // No namespace but grants: not the anonymous hop, not believed.
    let mut granted = anonymous.clone();
    granted.grants = vec!["*:*:*".into()];
    let (s, b) = send(&granted, "GET", "/v1/kv/k?namespace=vault", b"");
    assert_eq!(s, 401, "{b}");
    let (s, b) = send(&granted, "POST", "/v1/invoke/vault/private", b"{}");
    assert_eq!(s, 401, "{b}");
}

/// Topics and presence of a namespace whose only member is b, with present
/// subscribers on a and c (sockets stay on the node they reached): asked
/// through each of the three nodes, both topics with their subscribers and
/// both members are listed, and no node is missing from the answer. With c
/// killed (still registered), the answer through a leaves c out and says so
/// (`partial`, `nodes_missing`) rather than failing; the client cannot call
/// the internal route itself.
#[actix_rt::test]
async fn topics_and_presence_span_the_cluster() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    // Entries live 4 × 5 s: a killed node stays registered for the test.
    let mut nodes: Vec<TestNode> = ["a", "b", "c"]
        .iter()
        .map(|id| {
            let mut o = member_opts(&etcd, id, free_port(), tmp.path());
            o.config = o
                .config
                .replace("register_seconds = 1", "register_seconds = 5");
            TestNode::start_with(o)
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !nodes
        .iter()
        .all(|n| metric_sum(n, "meshgate_mesh_peers") >= 2.0)
    {
        assert!(Instant::now() < deadline, "the mesh never formed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (s, b) = nodes[0].op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"lobby","members":["b"]}"#),
    );
    assert_eq!(s, 201, "{b}");
    let key = json(&b)["api_key"].as_str().unwrap().to_string();
    let present = |node: &TestNode, topic: &str, member: &str| {
        format!(
            "ws://{}/v1/pubsub/ws?topic={topic}&presence=true&member_id={member}&token={key}",
            node.addr
        )
    };
    let mut sockets = Vec::new();
    for (node, topic, member) in [(&nodes[0], "room", "ann"), (&nodes[2], "room", "cid")]
        .into_iter()
        .chain([(&nodes[2], "hall", "cid")])
    {
        let (resp, s) = awc::Client::builder()
            .timeout(Duration::from_secs(30))
            .finish()
            .ws(present(node, topic, member))
            .connect()
            .await
            .expect("subscribe");
        assert_eq!(resp.status(), 101);
        sockets.push(s);
    }
    for (i, node) in nodes.iter().enumerate() {
        let (s, b) = node.with_key(&key, "GET", "/v1/pubsub/topics", None);
        assert_eq!(s, 200, "node {i}: {b}");
        let v = json(&b);
        let topics: Vec<(String, u64)> = v["topics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["topic"].as_str().unwrap().into(),
                    t["subscribers"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            topics,
            vec![("hall".to_string(), 1), ("room".to_string(), 2)],
            "topics through node {i}: {b}"
        );
        assert_eq!(v["partial"], false, "node {i}: {b}");
        assert_eq!(v["nodes_missing"], serde_json::json!([]), "node {i}: {b}");
        let (s, b) = node.with_key(&key, "GET", "/v1/pubsub/presence?topic=room", None);
        assert_eq!(s, 200, "node {i}: {b}");
        let v = json(&b);
        let members: Vec<&str> = v["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["member_id"].as_str().unwrap())
            .collect();
        assert_eq!(
            members,
            vec!["ann", "cid"],
            "presence through node {i}: {b}"
        );
        assert_eq!(v["partial"], false, "node {i}: {b}");
    }
    // Only for cluster peers (a valid hop).
    let (s, b) = nodes[0].with_key(&key, "GET", "/v1/internal/pubsub/local", None);
    assert_eq!(s, 403, "{b}");
    assert!(b.contains("INTERNAL_ONLY"), "{b}");
    // c gone: a and b still answer, c is named as missing.
    nodes[2].kill9();
    let (s, b) = nodes[0].with_key(&key, "GET", "/v1/pubsub/presence?topic=room", None);
    assert_eq!(s, 200, "{b}");
    let v = json(&b);
    assert_eq!(v["members"].as_array().unwrap().len(), 1, "{b}");
    assert_eq!(v["members"][0]["member_id"], "ann", "{b}");
    assert_eq!(v["partial"], true, "{b}");
    assert_eq!(v["nodes_missing"], serde_json::json!(["c"]), "{b}");
    let (s, b) = nodes[1].with_key(&key, "GET", "/v1/pubsub/topics", None);
    assert_eq!(s, 200, "{b}");
    let v = json(&b);
    assert_eq!(v["topics"][0]["topic"], "room", "{b}");
    assert_eq!(v["topics"][0]["subscribers"], 1, "{b}");
    assert_eq!(v["nodes_missing"], serde_json::json!(["c"]), "{b}");
    drop(sockets);
}

/// The claims provider `GET /v1/namespaces/{ns}` shows through `node`.
fn shown_provider(node: &TestNode, ns: &str) -> serde_json::Value {
    let (s, b) = node.op("GET", &format!("/v1/namespaces/{ns}"), None);
    assert_eq!(s, 200, "{b}");
    json(&b)["record"]["claims_provider"].clone()
}

/// A namespace record has one owner per node, its supervisor, which
/// publishes it: a change written through one node reaches the supervisors
/// already running on the others (the store watch has them reload), and a
/// namespace deleted through one node stops its supervisors everywhere, so
/// a socket held on another node is closed with 4004 instead of staying
/// open on a namespace that no longer exists.
#[actix_rt::test]
async fn record_changes_and_deletes_reach_every_node() {
    use futures_util::StreamExt as _;
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let nodes: Vec<TestNode> = ["a", "b", "c"]
        .iter()
        .map(|id| TestNode::start_with(member_opts(&etcd, id, free_port(), tmp.path())))
        .collect();
    let (s, body) = nodes[0].op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"shared","members":["a","b","c"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    let key = json(&body)["api_key"].as_str().unwrap().to_string();
    deploy_as_operator(&nodes[0], "shared", "claims", EVERY_SECOND, &[]);
    // A supervisor runs on every node (each is a member and answers itself).
    for n in &nodes {
        assert_eq!(shown_provider(n, "shared"), serde_json::Value::Null);
    }
    let mut socket = subscribe(&nodes[2], &key, "t").await;

    let (s, b) = nodes[0].op(
        "PUT",
        "/v1/namespaces/shared/claims-provider",
        Some(r#"{"function":"claims"}"#),
    );
    assert_eq!(s, 200, "{b}");
    assert_eq!(json(&b)["namespace"]["claims_provider"], "claims");
    for (i, n) in nodes.iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(10);
        while shown_provider(n, "shared") != "claims" {
            assert!(
                Instant::now() < deadline,
                "node {i}'s supervisor never saw the new record"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    let (s, b) = nodes[0].op("DELETE", "/v1/namespaces/shared", None);
    assert_eq!(s, 200, "{b}");
    let code = loop {
        match tokio::time::timeout(Duration::from_secs(10), socket.next())
            .await
            .expect("the socket on node c closes within 10 s")
        {
            Some(Ok(awc::ws::Frame::Close(r))) => {
                break r.map(|r| u16::from(r.code)).unwrap_or(1005);
            }
            Some(Ok(_)) => {}
            other => panic!("no close frame: {other:?}"),
        }
    };
    assert_eq!(code, 4004);
    for (i, n) in nodes.iter().enumerate() {
        let (s, b) = n.op("GET", "/v1/namespaces/shared", None);
        assert_eq!(s, 404, "node {i}: {b}");
    }
}

/// A stand-in for a member's HTTP API on 127.0.0.1: answers every request
/// with the status it is told, with or without the gateway-fault header a
/// node puts on the 502–504 it produces itself; counts the KV requests.
struct FakeMember {
    port: u16,
    /// (status, gateway fault) of the next answers.
    answer: std::sync::Arc<std::sync::Mutex<(u16, bool)>>,
    kv_requests: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl FakeMember {
    fn start() -> FakeMember {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let answer = std::sync::Arc::new(std::sync::Mutex::new((503, false)));
        let kv_requests = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (ans, count) = (answer.clone(), kv_requests.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let (ans, count) = (ans.clone(), count.clone());
                std::thread::spawn(move || {
                    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
                    // One request at a time on the connection: head, then the body.
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n");
                        if let Some(end) = head_end {
                            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                            let len: usize = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .and_then(|v| v.trim().parse().ok())
                                .unwrap_or(0);
                            if buf.len() >= end + 4 + len {
                                if head.contains(" /v1/kv/") {
                                    count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                                }
                                buf.drain(..end + 4 + len);
                                let (status, fault) = *ans.lock().unwrap();
                                let body = r#"{"ok":false,"error":{"code":"FAKE","message":"fake member","retryable":true}}"#;
                                let fault = if fault {
                                    "x-meshgate-fault: gateway\r\n"
                                } else {
                                    ""
                                };
                                let res = format!(
                                    "HTTP/1.1 {status} Fake\r\ncontent-type: application/json\r\n{fault}content-length: {}\r\n\r\n{body}",
                                    body.len()
                                );
                                if conn.write_all(res.as_bytes()).is_err() {
                                    return;
                                }
                                continue;
                            }
                        }
                        match conn.read(&mut chunk) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                });
            }
        });
        FakeMember {
            port,
            answer,
            kv_requests,
        }
    }

    fn answer(&self, status: u16, gateway_fault: bool) {
        *self.answer.lock().unwrap() = (status, gateway_fault);
    }

    fn kv_requests(&self) -> usize {
        self.kv_requests.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The breaker counts a member's 502/503/504 only when the member's node
/// produced it (`x-meshgate-fault: gateway`): node C advertises a stand-in
/// that answers for it. Six 502–504 without the header (a function's or an
/// upstream's own answer) are passed through and leave C's breaker closed;
/// five with it (502, 503, 504 in turn) are passed through and open it
/// (`breaker_failures = 5`; the probe interval is long, so it stays open);
/// the next request is 503 `NO_MEMBER_AVAILABLE` and does not reach C.
#[test]
fn a_members_gateway_faults_open_its_breaker() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let fake = FakeMember::start();
    let opts = |id: &str, extra: &str| {
        let mut o = member_opts(&etcd, id, free_port(), tmp.path());
        o.config = o.config.replace(
            "breaker_probe_seconds = 1\n",
            "breaker_probe_seconds = 3600\n",
        );
        o.config.push_str(extra);
        o
    };
    let _c = TestNode::start_with(opts(
        "c",
        &format!("advertise = \"http://127.0.0.1:{}\"\n", fake.port),
    ));
    let a = TestNode::start_with(opts("a", ""));
    let (s, b) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"shop","members":["c"]}"#),
    );
    assert_eq!(s, 201, "{b}");
    let auth = format!("Bearer {OPERATOR_KEY}");
    let put = || {
        let (s, h, b) = http(
            "PUT",
            &a.url("/v1/kv/greeting"),
            &[("authorization", &auth), ("x-namespace", "shop")],
            Some(b"hello"),
        );
        (
            s,
            header(&h, "x-meshgate-member").map(str::to_string),
            String::from_utf8_lossy(&b).into_owned(),
        )
    };
    let closed = |after: &str| {
        if let Some(br) = breaker(&a, "shop", "c") {
            assert_eq!(br["state"], "closed", "{after}: {br}");
            assert_eq!(br["consecutive_failures"], 0, "{after}: {br}");
        }
    };
    for (i, status) in [502, 503, 504, 502, 503, 504].into_iter().enumerate() {
        fake.answer(status, false);
        let (s, m, body) = put();
        assert_eq!(
            (s, m.as_deref()),
            (status, Some("c")),
            "plain {status}: {body}"
        );
        closed(&format!("after {} plain 5xx", i + 1));
    }
    assert_eq!(fake.kv_requests(), 6);
    for (i, status) in [502, 503, 504, 502, 503].into_iter().enumerate() {
        fake.answer(status, true);
        let (s, m, body) = put();
        assert_eq!(
            (s, m.as_deref()),
            (status, Some("c")),
            "gateway fault {status}: {body}"
        );
        let br = breaker(&a, "shop", "c").expect("a breaker for c");
        let failures = i + 1;
        if failures < 5 {
            assert_eq!(
                br["state"], "closed",
                "after {failures} gateway faults: {br}"
            );
            assert_eq!(br["consecutive_failures"], failures, "{br}");
        } else {
            assert_eq!(br["state"], "open", "after 5 gateway faults: {br}");
        }
    }
    assert_eq!(fake.kv_requests(), 11);
    // Open: C is skipped, nothing reaches it.
    fake.answer(200, false);
    let (s, m, body) = put();
    assert_eq!(
        (s, m.as_deref(), json(&body)["error"]["code"].as_str()),
        (503, None, Some("NO_MEMBER_AVAILABLE")),
        "{body}"
    );
    assert_eq!(fake.kv_requests(), 11, "the open breaker sent nothing to C");
}
