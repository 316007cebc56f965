//! Active health checks on a budget (docs/deployments.md, "Health checks"):
//! end to end on a real node, counting the checks its upstreams receive.

use super::{ALLOW_LOOPBACK, deploy_json};
use crate::common::*;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `n` listeners on 127.0.0.1 answering 200 to every request and counting
/// them by (listener, path).
struct Counting {
    urls: Vec<String>,
    seen: Arc<Mutex<HashMap<(usize, String), u64>>>,
}

impl Counting {
    fn start(n: usize) -> Counting {
        let seen: Arc<Mutex<HashMap<(usize, String), u64>>> = Default::default();
        let mut urls = Vec::new();
        for i in 0..n {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            urls.push(format!("http://{}", l.local_addr().unwrap()));
            let seen = seen.clone();
            std::thread::spawn(move || {
                for s in l.incoming() {
                    let Ok(mut s) = s else { return };
                    let mut buf = Vec::new();
                    let mut b = [0u8; 1024];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 8192 {
                        match s.read(&mut b) {
                            Ok(0) | Err(_) => break,
                            Ok(k) => buf.extend_from_slice(&b[..k]),
                        }
                    }
                    let head = String::from_utf8_lossy(&buf);
                    let path = head.split(' ').nth(1).unwrap_or("").to_string();
                    *seen.lock().unwrap().entry((i, path)).or_default() += 1;
                    let _ = s.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    );
                }
            });
        }
        Counting { urls, seen }
    }

    /// Requests so far whose path starts with `prefix`, over all listeners.
    fn count(&self, prefix: &str) -> u64 {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|((_, p), _)| p.starts_with(prefix))
            .map(|(_, n)| n)
            .sum()
    }

    /// Requests so far to listener `i` with exactly `path`.
    fn at(&self, i: usize, path: &str) -> u64 {
        self.seen
            .lock()
            .unwrap()
            .get(&(i, path.to_string()))
            .copied()
            .unwrap_or(0)
    }
}

/// A node with these `[deploy]` health settings and loopback upstreams.
fn node_with_budget(per_second: u32) -> TestNode {
    TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}[deploy]\n{ALLOW_LOOPBACK}health_min_interval_ms = 100\nhealth_checks_per_second = {per_second}\n"
        ),
        ..Default::default()
    })
}

/// The attack's shape: one namespace deploys 100 upstreams of 32 instances,
/// each asking for 100 ms checks (3,200 distinct checks, 32,000 a second
/// asked). Over a 5 s window the instances receive no more than the
/// namespace's budget (`health_checks_per_second` = 20, so ≤ 100 plus one
/// tick's credit), and the budget is used.
#[test]
fn checks_stay_within_the_namespace_budget() {
    if single_node_only() {
        return;
    }
    let node = node_with_budget(20);
    let ups = Counting::start(32);
    let evil = node.create_namespace("evil");
    for d in 0..100 {
        let (s, v) = deploy_json(
            &node,
            &evil,
            serde_json::json!({
                "name": format!("d{d}"), "hosts": [format!("d{d}.evil.test")],
                "upstream": {"instances": ups.urls,
                             "health": {"path": format!("/evil/{d}"), "interval_ms": 100}}
            }),
        );
        assert_eq!(s, 201, "{v}");
    }
    // The window starts once the first checks ran.
    wait_until(Duration::from_secs(10), "evil's first checks", || {
        ups.count("/evil/") > 0
    });
    let window = Duration::from_secs(5);
    let evil0 = ups.count("/evil/");
    let t0 = Instant::now();
    std::thread::sleep(window);
    let took = t0.elapsed().as_secs_f64();
    let evil_checks = ups.count("/evil/") - evil0;
    println!(
        "evil: {evil_checks} checks in {took:.1} s ({:.1}/s, budget 20/s)",
        evil_checks as f64 / took
    );
    // The budget, plus a tick's credit and the checks in flight at each end.
    assert!(
        evil_checks as f64 <= 20.0 * took + 6.0,
        "{evil_checks} checks in {took:.1} s"
    );
    assert!(evil_checks >= 40, "the budget is used: {evil_checks}");
}

/// Two deployments of a namespace naming the same two instances with the
/// same check (`/shared` every second) share one check per instance: over
/// a 5 s window each instance sees about five checks (4 to 7 with the
/// ±10 % jitter), not the ten two checkers would send.
#[test]
fn shared_instances_are_checked_once() {
    if single_node_only() {
        return;
    }
    let node = node_with_budget(50);
    let ups = Counting::start(2);
    let bank = node.create_namespace("bank");
    for name in ["one", "two"] {
        let (s, v) = deploy_json(
            &node,
            &bank,
            serde_json::json!({
                "name": name, "hosts": [format!("{name}.bank.test")],
                "upstream": {"instances": ups.urls,
                             "health": {"path": "/shared", "interval_ms": 1000}}
            }),
        );
        assert_eq!(s, 201, "{v}");
    }
    wait_until(Duration::from_secs(10), "bank's first checks", || {
        ups.at(0, "/shared") > 0 && ups.at(1, "/shared") > 0
    });
    let before = [ups.at(0, "/shared"), ups.at(1, "/shared")];
    std::thread::sleep(Duration::from_secs(5));
    let shared = [
        ups.at(0, "/shared") - before[0],
        ups.at(1, "/shared") - before[1],
    ];
    println!("bank's shared instances, checks in 5 s: {shared:?}");
    for n in shared {
        assert!((3..=7).contains(&n), "{shared:?}");
    }
}

/// `n` listeners on 127.0.0.1 that accept every connection and never
/// answer (the attack's instances): each check of them hangs until its
/// `timeout_ms`. Returns their URLs and the connections accepted so far.
fn blackholes(n: usize) -> (Vec<String>, Arc<Mutex<u64>>) {
    let accepted: Arc<Mutex<u64>> = Default::default();
    let mut urls = Vec::new();
    for _ in 0..n {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        urls.push(format!("http://{}", l.local_addr().unwrap()));
        let accepted = accepted.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for s in l.incoming() {
                let Ok(s) = s else { return };
                held.push(s);
                *accepted.lock().unwrap() += 1;
            }
        });
    }
    (urls, accepted)
}

/// The attack: evil's 10 deployments × 32 instances that accept and never
/// answer, checked with `timeout_ms: 60000`, hold a check slot each for a
/// minute. With `health_in_flight_per_namespace` they hold at most their
/// share, so bank's check, deployed after evil's took what they could,
/// keeps reaching its instance (before, the node's 256 slots filled within
/// seconds and bank's checks stopped until evil's timed out).
#[test]
fn hanging_checks_do_not_stop_another_namespaces() {
    if single_node_only() {
        return;
    }
    let node = node_with_budget(50);
    let (holes, accepted) = blackholes(32);
    let evil = node.create_namespace("evil");
    for d in 0..10 {
        let (s, v) = deploy_json(
            &node,
            &evil,
            serde_json::json!({
                "name": format!("d{d}"), "hosts": [format!("d{d}.evil.test")],
                "upstream": {"instances": holes,
                             "health": {"path": format!("/evil/{d}"), "interval_ms": 1000,
                                        "timeout_ms": 60000}}
            }),
        );
        assert_eq!(s, 201, "{v}");
    }
    wait_until(Duration::from_secs(20), "evil's checks hanging", || {
        *accepted.lock().unwrap() >= 16
    });
    // Let evil's checks take every slot they can (at 50 a second, all 256
    // within about 6 s without the per-namespace share).
    std::thread::sleep(Duration::from_secs(8));
    let ups = Counting::start(1);
    let bank = node.create_namespace("bank");
    let (s, v) = deploy_json(
        &node,
        &bank,
        serde_json::json!({
            "name": "app", "hosts": ["app.bank.test"],
            "upstream": {"instances": ups.urls,
                         "health": {"path": "/bank", "interval_ms": 1000}}
        }),
    );
    assert_eq!(s, 201, "{v}");
    wait_until(Duration::from_secs(20), "bank's checks running", || {
        ups.count("/bank") >= 3
    });
    let held = *accepted.lock().unwrap();
    assert!(held < 256, "evil held {held} check connections");
}
