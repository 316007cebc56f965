//! Load balancing and active health checks (issue #40, docs/deployments.md
//! "Load balancing", "Health checks"), end to end: a real node and real
//! upstreams on 127.0.0.1 that count what they serve.

use super::{deploy_json, proxy_node, via};
use crate::common::*;
use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// An upstream answering `GET /healthz` with 200 or 503 (as `healthy`
/// says) and any other request with its id, after `delay`; it counts both.
struct Counted {
    url: String,
    healthy: Arc<AtomicBool>,
    served: Arc<AtomicUsize>,
    checks: Arc<AtomicUsize>,
}

impl Counted {
    fn start(id: &str, delay: Duration) -> Counted {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let healthy = Arc::new(AtomicBool::new(true));
        let served = Arc::new(AtomicUsize::new(0));
        let checks = Arc::new(AtomicUsize::new(0));
        let (h, s, c, id) = (
            healthy.clone(),
            served.clone(),
            checks.clone(),
            id.to_string(),
        );
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(mut conn) = conn else { return };
                let (h, s, c, id) = (h.clone(), s.clone(), c.clone(), id.clone());
                std::thread::spawn(move || {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        let end = loop {
                            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                break i + 4;
                            }
                            match conn.read(&mut chunk) {
                                Ok(0) | Err(_) => return,
                                Ok(k) => buf.extend_from_slice(&chunk[..k]),
                            }
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).to_string();
                        buf.drain(..end);
                        let out = if head.starts_with("GET /healthz ") {
                            c.fetch_add(1, Ordering::SeqCst);
                            if h.load(Ordering::SeqCst) {
                                "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_string()
                            } else {
                                "HTTP/1.1 503 Down\r\nContent-Length: 0\r\n\r\n".to_string()
                            }
                        } else {
                            s.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(delay);
                            format!(
                                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{id}",
                                id.len()
                            )
                        };
                        if conn.write_all(out.as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Counted {
            url,
            healthy,
            served,
            checks,
        }
    }

    fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }
}

/// The id that answered a GET through the node on `host`.
fn who(node: &TestNode, host: &str, headers: &[(&str, &str)]) -> String {
    let (s, _, b) = via(node, host, "GET", "/", headers, None);
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    String::from_utf8_lossy(&b).to_string()
}

/// The value of `family`'s series for deployment `dep` and `instance` in
/// the node's `/metrics`, if it has one.
fn upstream_metric(node: &TestNode, family: &str, dep: &str, instance: &str) -> Option<f64> {
    let (_, _, b) = http("GET", &node.url("/metrics"), &[OPERATOR_AUTH], None);
    String::from_utf8_lossy(&b)
        .lines()
        .find(|l| {
            l.starts_with(&format!("{family}{{"))
                && l.contains(&format!("deployment=\"{dep}\""))
                && l.contains(&format!("instance=\"{instance}\""))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Waits (up to 20 s) until `cond` holds of the deployment's JSON.
fn wait_for(
    node: &TestNode,
    key: &str,
    name: &str,
    what: &str,
    cond: impl Fn(&serde_json::Value) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, b) = node.with_key(key, "GET", &format!("/v1/deployments/{name}"), None);
        let v = json(&b)["deployment"].clone();
        if cond(&v) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Weights 3:1 send 75 % (± 5 %) of 1,000 requests to the first instance;
/// the deployment shows each instance's weight.
#[test]
fn weights_share_requests() {
    let node = proxy_node();
    let key = node.create_namespace("lb");
    let (a, b) = (
        Counted::start("a", Duration::ZERO),
        Counted::start("b", Duration::ZERO),
    );
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({
            "name": "web", "hosts": ["web.lb.test"],
            "upstream": {"instances": [{"url": a.url, "weight": 3}, b.url]}
        }),
    );
    assert_eq!(s, 201, "{v}");
    assert_eq!(
        v["deployment"]["target"]["instances"][0]["weight"], 3,
        "{v}"
    );
    assert_eq!(
        v["deployment"]["target"]["instances"][1]["weight"], 1,
        "{v}"
    );
    let mut on_a = 0;
    for _ in 0..1000 {
        if who(&node, "web.lb.test", &[]) == "a" {
            on_a += 1;
        }
    }
    assert!(
        (700..=800).contains(&on_a),
        "{on_a} of 1000 on the weight-3 instance"
    );
    assert_eq!(a.served() + b.served(), 1000);
    let (_, body) = node.with_key(&key, "GET", "/v1/deployments/web", None);
    let v = json(&body)["deployment"].clone();
    let inst = &v["target"]["instances"];
    assert_eq!(
        (inst[0]["weight"].as_u64(), inst[0]["healthy"].as_bool()),
        (Some(3), Some(true)),
        "{v}"
    );
    assert_eq!(inst[1]["in_flight"], 0, "{v}");
    assert_eq!(v["target"]["balance"], "round_robin", "{v}");
    assert_eq!(
        upstream_metric(&node, "meshgate_upstream_weight", "web", &a.url),
        Some(3.0)
    );
    assert_eq!(
        upstream_metric(&node, "meshgate_upstream_healthy", "web", &b.url),
        Some(1.0)
    );
}

/// `least_request`: while one instance stalls each request (200 ms) and
/// requests run concurrently, most new requests go to the other.
#[test]
fn least_request_avoids_a_stalled_instance() {
    let node = proxy_node();
    let key = node.create_namespace("lb");
    let slow = Counted::start("slow", Duration::from_millis(200));
    let fast = Counted::start("fast", Duration::ZERO);
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({
            "name": "lr", "hosts": ["lr.lb.test"],
            "upstream": {"instances": [slow.url, fast.url], "balance": "least_request"}
        }),
    );
    assert_eq!(s, 201, "{v}");
    let node = Arc::new(node);
    let clients: Vec<_> = (0..6)
        .map(|_| {
            let node = node.clone();
            std::thread::spawn(move || {
                for _ in 0..20 {
                    who(&node, "lr.lb.test", &[]);
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    let (s, f) = (slow.served(), fast.served());
    assert_eq!(s + f, 120);
    assert!(
        f >= 100,
        "fast {f}, slow {s}: the stalled instance took too many"
    );
}

/// An instance failing its active check leaves rotation (no request reaches
/// it meanwhile) and comes back after `healthy_threshold` passes; with every
/// instance failing, 503 NO_HEALTHY_UPSTREAM.
#[test]
fn active_checks_take_instances_out_and_back() {
    let node = proxy_node();
    let key = node.create_namespace("lb");
    let (a, b) = (
        Counted::start("a", Duration::ZERO),
        Counted::start("b", Duration::ZERO),
    );
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({
            "name": "hc", "hosts": ["hc.lb.test"],
            "upstream": {
                "instances": [a.url, b.url],
                "health": {"path": "/healthz", "interval_ms": 100, "timeout_ms": 1000,
                           "healthy_threshold": 2, "unhealthy_threshold": 1}
            }
        }),
    );
    assert_eq!(s, 201, "{v}");
    let check_healthy = |i: usize, want: bool| {
        move |v: &serde_json::Value| {
            let inst = &v["target"]["instances"][i];
            inst["healthy"] == want && inst["check"]["healthy"] == want
        }
    };
    wait_for(&node, &key, "hc", "checks ran", |v| {
        v["target"]["instances"][1]["check"]["last_status"] == 200
    });
    b.healthy.store(false, Ordering::SeqCst);
    wait_for(&node, &key, "hc", "b out", check_healthy(1, false));
    // Each node checks for itself (the whole cluster in cluster mode): b
    // is out on every node, and no node sends it a request.
    let bases = node.every_base();
    for base in &bases {
        wait_until(Duration::from_secs(20), &format!("b out on {base}"), || {
            let (_, _, m) = http("GET", &format!("{base}/metrics"), &[OPERATOR_AUTH], None);
            String::from_utf8_lossy(&m).lines().any(|l| {
                l.starts_with("meshgate_upstream_healthy{")
                    && l.contains("deployment=\"hc\"")
                    && l.contains(&format!("instance=\"{}\"", b.url))
                    && l.ends_with(" 0")
            })
        });
    }
    let before = b.served();
    for _ in 0..30 {
        assert_eq!(who(&node, "hc.lb.test", &[]), "a");
    }
    for base in &bases {
        for _ in 0..10 {
            let (s, _, body) = http("GET", &format!("{base}/"), &[("host", "hc.lb.test")], None);
            assert_eq!(
                (s, String::from_utf8_lossy(&body).as_ref()),
                (200, "a"),
                "through {base}"
            );
        }
    }
    assert_eq!(b.served(), before, "a request reached the failing instance");
    let (_, body) = node.with_key(&key, "GET", "/v1/deployments/hc", None);
    let v = json(&body)["deployment"].clone();
    assert_eq!(
        v["target"]["instances"][1]["check"]["last_status"], 503,
        "{v}"
    );
    // Every instance failing: 503 NO_HEALTHY_UPSTREAM, with Retry-After.
    a.healthy.store(false, Ordering::SeqCst);
    wait_for(&node, &key, "hc", "a out", check_healthy(0, false));
    let (s, h, body) = via(&node, "hc.lb.test", "GET", "/", &[], None);
    assert_eq!(s, 503);
    assert_eq!(
        json(&String::from_utf8_lossy(&body))["error"]["code"],
        "NO_HEALTHY_UPSTREAM"
    );
    assert!(header(&h, "retry-after").is_some());
    // Passing again: back after two passes in a row.
    a.healthy.store(true, Ordering::SeqCst);
    b.healthy.store(true, Ordering::SeqCst);
    wait_for(&node, &key, "hc", "b back", check_healthy(1, true));
    wait_for(&node, &key, "hc", "a back", check_healthy(0, true));
    let ids: Vec<String> = (0..10).map(|_| who(&node, "hc.lb.test", &[])).collect();
    assert!(
        ids.iter().any(|i| i == "b") && ids.iter().any(|i| i == "a"),
        "{ids:?}"
    );
    assert!(b.checks.load(Ordering::SeqCst) >= 3);
    // No check reaches the instances once the checker is stopped (the
    // first wait lets a check already under way land).
    // On a cluster the other nodes' checkers stop when their routing index
    // follows the change (each node polls the deployments' generation every
    // second).
    let settle = if cluster_mode() { 1800 } else { 300 };
    let no_more_checks = |why: &str| {
        std::thread::sleep(Duration::from_millis(settle));
        let n = b.checks.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(600));
        assert_eq!(b.checks.load(Ordering::SeqCst), n, "checks after {why}");
    };
    // Replaced by a version without a check: the old checker stops.
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({"name": "hc", "hosts": ["hc.lb.test"], "upstream": {"instances": [a.url, b.url]}}),
    );
    assert_eq!(s, 201, "{v}");
    no_more_checks("the replacement");
    // Replaced again with one: checks resume; deleted: they stop.
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({"name": "hc", "hosts": ["hc.lb.test"], "upstream": {
            "instances": [a.url, b.url], "health": {"path": "/healthz", "interval_ms": 100}}}),
    );
    assert_eq!(s, 201, "{v}");
    let n = b.checks.load(Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(20);
    while b.checks.load(Ordering::SeqCst) == n {
        assert!(Instant::now() < deadline, "no checks after the new version");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (s, _) = node.with_key(&key, "DELETE", "/v1/deployments/hc", None);
    assert_eq!(s, 200);
    no_more_checks("the delete");
}

/// `hash` on a header: a client stays on one instance; when an instance is
/// removed, only the keys that were on it move.
#[test]
fn hash_keeps_clients_and_moves_only_the_lost_share() {
    let node = proxy_node();
    let key = node.create_namespace("lb");
    let ups: Vec<Counted> = ["a", "b", "c", "d"]
        .iter()
        .map(|id| Counted::start(id, Duration::ZERO))
        .collect();
    let deploy = |urls: Vec<&str>| {
        let (s, v) = deploy_json(
            &node,
            &key,
            serde_json::json!({
                "name": "sticky", "hosts": ["sticky.lb.test"],
                "upstream": {"instances": urls, "balance": {"hash": {"header": "X-User"}}}
            }),
        );
        assert_eq!(s, 201, "{v}");
    };
    deploy(ups.iter().map(|u| u.url.as_str()).collect());
    let users: Vec<String> = (0..200).map(|i| format!("user-{i}")).collect();
    let placed: Vec<String> = users
        .iter()
        .map(|u| who(&node, "sticky.lb.test", &[("x-user", u)]))
        .collect();
    for (u, p) in users.iter().zip(&placed).take(50) {
        for _ in 0..3 {
            assert_eq!(
                &who(&node, "sticky.lb.test", &[("x-user", u)]),
                p,
                "{u} moved"
            );
        }
    }
    for id in ["a", "b", "c", "d"] {
        assert!(
            placed.iter().filter(|p| *p == id).count() > 20,
            "{id}: {placed:?}"
        );
    }
    // Without "c": its keys move, every other key stays.
    deploy(
        ups.iter()
            .enumerate()
            .filter(|(i, _)| *i != 2)
            .map(|(_, u)| u.url.as_str())
            .collect(),
    );
    for (u, p) in users.iter().zip(&placed) {
        let now = who(&node, "sticky.lb.test", &[("x-user", u)]);
        if p == "c" {
            assert_ne!(now, "c", "{u}");
        } else {
            assert_eq!(&now, p, "{u} moved off a kept instance");
        }
    }
}

/// Bad weights and health checks are 400 with the error envelope, and the
/// deployment is left as it was.
#[test]
fn bad_balancing_inputs_are_refused_and_change_nothing() {
    let node = proxy_node();
    let key = node.create_namespace("lb");
    let a = Counted::start("a", Duration::ZERO);
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({"name": "keep", "hosts": ["keep.lb.test"], "upstream": {"instances": [a.url]}}),
    );
    assert_eq!(s, 201, "{v}");
    let bad = [
        serde_json::json!({"instances": [{"url": a.url, "weight": 0}]}),
        serde_json::json!({"instances": [{"url": a.url, "weight": -1}]}),
        serde_json::json!({"instances": [{"url": a.url, "weight": 1001}]}),
        serde_json::json!({"instances": [a.url], "health": {"path": "healthz"}}),
        serde_json::json!({"instances": [a.url], "health": {"path": "/healthz", "interval_ms": 50}}),
        serde_json::json!({"instances": [a.url], "balance": "random"}),
        serde_json::json!({"instances": [{"url": a.url, "weight": 2, "extra": 1}]}),
        serde_json::json!({"instances": [{"url": a.url, "weight": 1.5}]}),
    ];
    for up in bad {
        let (s, v) = deploy_json(
            &node,
            &key,
            serde_json::json!({"name": "keep", "hosts": ["keep.lb.test"], "upstream": up}),
        );
        assert_eq!(s, 400, "{up}: {v}");
        assert_eq!(v["ok"], false, "{v}");
        assert!(
            v["error"]["code"].as_str().is_some_and(|c| !c.is_empty()),
            "{v}"
        );
        let (_, b) = node.with_key(&key, "GET", "/v1/deployments/keep", None);
        let d = json(&b)["deployment"].clone();
        assert_eq!(
            (d["version"].as_u64(), d["latest_version"].as_u64()),
            (Some(1), Some(1)),
            "{d}"
        );
        assert!(d["target"]["health"].is_null(), "{d}");
    }
    assert_eq!(who(&node, "keep.lb.test", &[]), "a");
}

/// `hash` without a header: the client's address is the key, so each
/// client address stays on one instance.
#[test]
fn hash_on_the_client_address_keeps_each_client() {
    let node = proxy_node();
    let key = node.create_namespace("lb");
    let ups: Vec<Counted> = ["a", "b", "c"]
        .iter()
        .map(|id| Counted::start(id, Duration::ZERO))
        .collect();
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({
            "name": "ip", "hosts": ["ip.lb.test"],
            "upstream": {"instances": ups.iter().map(|u| u.url.clone()).collect::<Vec<_>>(),
                         "balance": {"hash": {}}}
        }),
    );
    assert_eq!(s, 201, "{v}");
    assert_eq!(
        v["deployment"]["target"]["balance"],
        serde_json::json!({"hash": {}}),
        "{v}"
    );
    let from = |local: &str| {
        let (s, _, b) = http_from(
            Some(local),
            "GET",
            &node.url("/"),
            &[("host", "ip.lb.test")],
            None,
        );
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
        String::from_utf8_lossy(&b).to_string()
    };
    let mut seen = std::collections::BTreeSet::new();
    for k in 2..12 {
        let local = format!("127.0.0.{k}");
        let first = from(&local);
        for _ in 0..4 {
            assert_eq!(from(&local), first, "{local} moved");
        }
        seen.insert(first);
    }
    assert!(seen.len() >= 2, "ten clients all on {seen:?}");
}

/// An `https://` instance is checked over TLS, not by its TCP connect: a
/// listener that answers plain HTTP (and would pass a TCP check) is taken
/// out with no status, while the plain-HTTP instance beside it passes.
#[test]
fn https_instances_are_checked_over_tls_not_by_a_tcp_connect() {
    let node = proxy_node();
    let key = node.create_namespace("lbtls");
    let (plain, not_tls) = (
        Counted::start("plain", Duration::ZERO),
        Counted::start("not-tls", Duration::ZERO),
    );
    let https = not_tls.url.replacen("http://", "https://", 1);
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({
            "name": "tls", "hosts": ["tls.lb.test"],
            "upstream": {
                "instances": [plain.url, https],
                "health": {"path": "/healthz", "interval_ms": 100, "timeout_ms": 500,
                           "healthy_threshold": 1, "unhealthy_threshold": 1}
            }
        }),
    );
    assert_eq!(s, 201, "{v}");
    wait_for(&node, &key, "tls", "the https instance checked out", |v| {
        let i = &v["target"]["instances"];
        i[0]["check"]["last_status"] == 200
            && i[1]["check"]["healthy"] == false
            && i[1]["check"]["last_check_ms"].is_u64()
    });
    let (_, body) = node.with_key(&key, "GET", "/v1/deployments/tls", None);
    let v = json(&body)["deployment"].clone();
    let i = &v["target"]["instances"];
    assert_eq!(i[1]["check"]["last_status"], serde_json::Value::Null, "{v}");
    assert_eq!(i[1]["healthy"], false, "{v}");
    assert_eq!(i[0]["healthy"], true, "{v}");
    // The plain-HTTP check of the other listener never saw an HTTP request.
    assert_eq!(not_tls.checks.load(Ordering::SeqCst), 0);
}
