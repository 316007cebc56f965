//! Passivation (issue #42): an idle namespace supervisor stops after
//! `[server] passivate_after_seconds` and the next use of the namespace
//! (HTTP, socket, cron, trigger, export) starts it again transparently.
//! Each node here passivates after one second; the tests observe the actor
//! list of `/v1/status` and the lifecycle counter, never a time.

use crate::common::*;
use crate::functions::{deploy, invoke};
use crate::pubsub::{Socket, next_data};
use std::time::Duration;

/// A guest that writes `hit` = `1` into its namespace's KV.
const MARK_HIT: &str = r#"(module
  (import "meshgate" "kv_put" (func $kv_put (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 512) "hit")
  (data (i32.const 528) "1")
  (func (export "_start")
    (drop (call $kv_put (i32.const 512) (i32.const 3) (i32.const 528) (i32.const 1)))))"#;

/// How long a test waits for what a one-second idle time makes happen.
const WITHIN: Duration = Duration::from_secs(20);

fn start() -> TestNode {
    TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}\n[server]\npassivate_after_seconds = 1\n[functions]\nworkers = 2\n"
        ),
        ..Default::default()
    })
}

fn echo_wasm() -> Vec<u8> {
    std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/functions/echo.wasm"
    ))
    .unwrap()
}

/// Whether `/v1/status` of any node (in cluster mode: the one the test
/// talks to, the namespace's member and the third) lists an actor of
/// namespace `ns`.
fn running(node: &TestNode, ns: &str) -> bool {
    node.every_base().iter().any(|base| {
        let (s, _, b) = http("GET", &format!("{base}/v1/status"), &[OPERATOR_AUTH], None);
        assert_eq!(s, 200);
        json(&String::from_utf8_lossy(&b))["actors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["namespace"] == ns)
    })
}

/// The node's count of supervisors `activated` or `passivated`.
fn lifecycle(node: &TestNode, event: &str) -> f64 {
    node.metric_sum(&format!(
        "meshgate_namespace_supervisors_total{{event=\"{event}\"}}"
    ))
}

fn wait_asleep(node: &TestNode, ns: &str) {
    wait_until(WITHIN, &format!("{ns} never passivated"), || {
        !running(node, ns)
    });
}

/// A namespace left idle passivates (its actor leaves the list, the
/// counter moves); a KV read wakes it with the value written before, and a
/// KV write works on the woken supervisor.
#[test]
fn idle_namespace_passivates_and_wakes_on_kv() {
    let node = start();
    let key = node.create_namespace("sleepy");
    let (s, b) = node.with_key(&key, "PUT", "/v1/kv/greeting", Some(b"hello"));
    assert_eq!(s, 200, "{b}");
    assert!(running(&node, "sleepy"));
    wait_asleep(&node, "sleepy");
    assert!(lifecycle(&node, "passivated") >= 1.0);
    let (s, b) = node.with_key(&key, "GET", "/v1/kv/greeting", None);
    assert_eq!((s, b.as_str()), (200, "hello"));
    assert!(running(&node, "sleepy"), "a KV read woke no supervisor");
    let (s, b) = node.with_key(&key, "PUT", "/v1/kv/greeting", Some(b"again"));
    assert_eq!(s, 200, "{b}");
    // And once more asleep, a write wakes it too.
    wait_asleep(&node, "sleepy");
    let (s, b) = node.with_key(&key, "PUT", "/v1/kv/other", Some(b"x"));
    assert_eq!(s, 200, "{b}");
    let (s, b) = node.with_key(&key, "GET", "/v1/kv/greeting", None);
    assert_eq!((s, b.as_str()), (200, "again"));
}

/// A function invoked after its namespace slept answers as before.
#[test]
fn sleeping_namespace_wakes_on_invoke() {
    let node = start();
    let key = node.create_namespace("nap");
    deploy(&node, &key, "echo", &echo_wasm(), &[]);
    let (s, _, b) = invoke(&node, &key, "echo", b"before");
    assert_eq!((s, &b[..]), (200, &b"before"[..]));
    wait_asleep(&node, "nap");
    let (s, _, b) = invoke(&node, &key, "echo", b"after");
    assert_eq!(
        (s, &b[..]),
        (200, &b"after"[..]),
        "{}",
        String::from_utf8_lossy(&b)
    );
}

/// Sixteen concurrent first requests to a sleeping namespace all succeed
/// and start one supervisor between them.
#[test]
fn concurrent_first_requests_start_one_supervisor() {
    let node = start();
    let key = node.create_namespace("herd");
    let (s, _) = node.with_key(&key, "PUT", "/v1/kv/k", Some(b"v"));
    assert_eq!(s, 200);
    wait_asleep(&node, "herd");
    let before = lifecycle(&node, "activated");
    let barrier = std::sync::Barrier::new(16);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..16)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    node.with_key(&key, "GET", "/v1/kv/k", None)
                })
            })
            .collect();
        for h in handles {
            let (s, b) = h.join().unwrap();
            assert_eq!((s, b.as_str()), (200, "v"));
        }
    });
    assert_eq!(lifecycle(&node, "activated") - before, 1.0);
}

async fn connect(node: &TestNode, path: &str, key: &str) -> Socket {
    crate::pubsub::connect(&format!("ws://{}{path}&token={key}", node.addr)).await
}

/// A socket subscribe wakes a sleeping namespace, and a namespace with a
/// subscriber never passivates: a sentinel namespace made idle after the
/// subscription passivates while the subscribed one stays, and a publish
/// still reaches the subscriber.
#[actix_rt::test]
async fn subscriber_wakes_and_keeps_namespace_awake() {
    let node = start();
    let key = node.create_namespace("listening");
    let sentinel = node.create_namespace("sentinel");
    wait_asleep(&node, "listening");
    let mut sub = connect(&node, "/v1/pubsub/ws?topic=news&format=binary", &key).await;
    assert!(running(&node, "listening"), "the subscribe woke nothing");
    // The sentinel is used after the subscription, so it idles no longer.
    let (s, _) = node.with_key(&sentinel, "PUT", "/v1/kv/k", Some(b"v"));
    assert_eq!(s, 200);
    wait_asleep(&node, "sentinel");
    assert!(
        running(&node, "listening"),
        "a namespace with a subscriber passivated"
    );
    let (s, b) = node.with_key(
        &key,
        "POST",
        "/v1/pubsub/publish",
        Some(br#"{"topic":"news","data_base64":"aGk="}"#),
    );
    assert_eq!(s, 200, "{b}");
    assert_eq!(next_data(&mut sub).await, b"hi");
}

/// Cron fires for a sleeping namespace: a slot due while the namespace is
/// passivated wakes it and runs the function.
#[test]
fn cron_fires_for_a_sleeping_namespace() {
    let node = start();
    let key = node.create_namespace("alarm");
    // Every 4 s: the namespace sleeps between slots (idle after 1 s).
    deploy(
        &node,
        &key,
        "tick",
        MARK_HIT.as_bytes(),
        &[("metadata", r#"{"cron":"*/4 * * * * *"}"#)],
    );
    wait_asleep(&node, "alarm");
    let runs =
        |n: &TestNode| n.metric_sum("meshgate_function_invocations_total{namespace=\"alarm\"}");
    let asleep_at = runs(&node);
    let activated = lifecycle(&node, "activated");
    wait_until(
        WITHIN,
        "no cron slot ran for the sleeping namespace",
        || runs(&node) > asleep_at,
    );
    assert!(
        lifecycle(&node, "activated") > activated,
        "the slot ran without waking the namespace"
    );
    let (s, b) = node.with_key(&key, "GET", "/v1/kv/hit", None);
    assert_eq!((s, b.as_str()), (200, "1"));
}

/// A publish to a sleeping namespace fires its pub/sub trigger, and an
/// export after it slept again holds what the trigger wrote.
#[test]
fn publish_trigger_and_export_on_a_sleeping_namespace() {
    let node = start();
    let key = node.create_namespace("quiet");
    deploy(
        &node,
        &key,
        "mark",
        MARK_HIT.as_bytes(),
        &[("metadata", r#"{"pubsub_topics":["ev*"]}"#)],
    );
    wait_asleep(&node, "quiet");
    let (s, b) = node.with_key(
        &key,
        "POST",
        "/v1/pubsub/publish",
        Some(br#"{"topic":"events","data_base64":"aGk="}"#),
    );
    assert_eq!(s, 200, "{b}");
    wait_until(WITHIN, "the trigger never wrote hit", || {
        node.with_key(&key, "GET", "/v1/kv/hit", None).0 == 200
    });
    wait_asleep(&node, "quiet");
    let (s, b) = node.with_key(&key, "GET", "/v1/db/export", None);
    assert_eq!(s, 200, "{b}");
    assert!(b.contains("\"hit\""), "{b}");
}
