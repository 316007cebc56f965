//! Per-route observability of deployments (issue #40): the route series in
//! `/metrics`, the activity ring, `/__metrics` on a routed host and W3C
//! trace context, through a real node and an upstream on 127.0.0.1.

use crate::common::*;
use crate::deploy::{Upstream, deploy_json, deploy_web, proxy_node, via};
use std::collections::HashMap;

/// The samples of a Prometheus text exposition, each by its name and
/// sorted labels; panics on a line that is not valid text format.
fn parse_prometheus(text: &str) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('#') {
            let rest = rest.trim_start();
            assert!(
                rest.starts_with("HELP ") || rest.starts_with("TYPE "),
                "bad comment line: {line}"
            );
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line}"));
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => {
                let l = l.strip_suffix('}').unwrap_or_else(|| panic!("{line}"));
                let mut pairs: Vec<String> = Vec::new();
                let mut rest = l;
                while !rest.is_empty() {
                    let (k, v) = rest.split_once("=\"").unwrap_or_else(|| panic!("{line}"));
                    assert!(
                        k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
                        "{line}"
                    );
                    let end = v.find('"').unwrap_or_else(|| panic!("{line}"));
                    pairs.push(format!("{k}={}", &v[..end]));
                    rest = v[end + 1..].trim_start_matches(',');
                }
                pairs.sort();
                (n, pairs.join(","))
            }
            None => (series, String::new()),
        };
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':'),
            "{line}"
        );
        out.insert(format!("{name}{{{labels}}}"), value);
    }
    out
}

fn scrape(node: &TestNode, host: Option<&str>, path: &str) -> (u16, String) {
    let auth = format!("Bearer {}", node.operator_key);
    let mut h = vec![("authorization", auth.as_str())];
    if let Some(host) = host {
        h.push(("host", host));
    }
    let (s, _, b) = http("GET", &node.url(path), &h, None);
    (s, String::from_utf8_lossy(&b).into_owned())
}

/// The route series count exactly the requests made, by declared route
/// (never the raw path), status class and instance.
#[test]
fn route_metrics_count_the_requests_made() {
    if single_node_only() {
        return;
    }
    let node = proxy_node();
    let key = node.create_namespace("obs");
    let up = Upstream::start("one");
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({
            "name": "web", "hosts": ["obs.test"],
            "upstream": {"instances": [up.url()]},
            "routes": [{"path_prefix": "/api"}, {"path_prefix": "/"}]
        }),
    );
    assert_eq!(s, 201, "{v}");
    for i in 0..3 {
        let (s, _, _) = via(
            &node,
            "obs.test",
            "GET",
            &format!("/api/u/{i}?q=1"),
            &[],
            None,
        );
        assert_eq!(s, 200);
    }
    for i in 0..2 {
        let (s, _, _) = via(
            &node,
            "obs.test",
            "POST",
            &format!("/x{i}"),
            &[],
            Some(b"{}"),
        );
        assert_eq!(s, 200);
    }
    let (s, text) = scrape(&node, None, "/metrics");
    assert_eq!(s, 200);
    // `/__metrics` on the routed host answers as `/metrics` does, before
    // accounting (the scrapes count no route request), with the same auth.
    let (s, routed) = scrape(&node, Some("obs.test"), "/__metrics");
    assert_eq!(s, 200, "{routed}");
    assert!(
        routed.contains("meshgate_route_requests_total{"),
        "{routed}"
    );
    let (s, _, _) = http(
        "GET",
        &node.url("/__metrics"),
        &[("host", "obs.test")],
        None,
    );
    assert_eq!(s, 401);
    let m = parse_prometheus(&text);
    let get = |name: &str, labels: &[(&str, &str)]| {
        let mut l: Vec<String> = [("namespace", "obs"), ("deployment", "web")]
            .iter()
            .chain(labels)
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        l.sort();
        m.get(&format!("{name}{{{}}}", l.join(","))).copied()
    };
    let req = "meshgate_route_requests_total";
    let two = ("status_class", "2xx");
    assert_eq!(get(req, &[("route", "/api"), two]), Some(3.0), "{text}");
    assert_eq!(get(req, &[("route", "/"), two]), Some(2.0), "{text}");
    let count = "meshgate_route_duration_seconds_count";
    assert_eq!(get(count, &[("route", "/api")]), Some(3.0), "{text}");
    assert_eq!(get(count, &[("route", "/")]), Some(2.0), "{text}");
    let inst = up.url();
    let ups = "meshgate_upstream_requests_total";
    let answered = [("instance", inst.as_str()), ("outcome", "answered")];
    assert_eq!(
        get(ups, &[answered[0], answered[1], ("route", "/api")]),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        get(ups, &[answered[0], answered[1], ("route", "/")]),
        Some(2.0),
        "{text}"
    );
    assert!(!text.contains("/api/u/"), "no raw path is a label: {text}");
    let total: f64 = m
        .iter()
        .filter(|(k, _)| k.starts_with("meshgate_route_requests_total{"))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(total, 5.0, "{text}");
    let (_, again) = scrape(&node, Some("obs.test"), "/__metrics");
    let total: f64 = parse_prometheus(&again)
        .iter()
        .filter(|(k, _)| k.starts_with("meshgate_route_requests_total{"))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(total, 5.0, "the scrapes were not counted: {again}");
}

/// A proxy node with namespace `act` (its key returned) and its deployment
/// `web` on host `act.test`, route `/api`, proxying to one upstream.
fn web_on_act_test() -> (TestNode, String, Upstream) {
    let node = proxy_node();
    let key = node.create_namespace("act");
    let up = Upstream::start("one");
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({
            "name": "web", "hosts": ["act.test"],
            "upstream": {"instances": [up.url()]},
            "routes": [{"path_prefix": "/api"}]
        }),
    );
    assert_eq!(s, 201, "{v}");
    (node, key, up)
}

/// The activity ring holds the latest requests of a deployment, newest
/// first, capped by `limit`; never a query string or a credential; a bad
/// limit is 400, another namespace's key 404/403.
#[test]
fn activity_holds_the_latest_requests_without_secrets() {
    if single_node_only() {
        return;
    }
    let (node, key, up) = web_on_act_test();
    for i in 0..5 {
        let (s, _, _) = via(
            &node,
            "act.test",
            "GET",
            &format!("/api/item/{i}?token=sekrit-query-{i}"),
            &[
                ("authorization", "Bearer sekrit-bearer"),
                ("cookie", "session=sekrit-cookie"),
                ("x-request-id", &format!("rid-{i}")),
            ],
            None,
        );
        assert_eq!(s, 200);
    }
    let (s, b) = node.with_key(&key, "GET", "/v1/deployments/web/activity?limit=3", None);
    assert_eq!(s, 200, "{b}");
    assert!(!b.contains("sekrit"), "{b}");
    assert!(!b.contains('?'), "{b}");
    let v = json(&b);
    let reqs = v["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), 3, "{b}");
    let paths: Vec<&str> = reqs.iter().map(|r| r["path"].as_str().unwrap()).collect();
    assert_eq!(paths, ["/api/item/4", "/api/item/3", "/api/item/2"], "{b}");
    let r = &reqs[0];
    assert_eq!(r["method"], "GET");
    assert_eq!(r["route"], "/api");
    assert_eq!(r["status"], 200);
    assert_eq!(r["request_id"], "rid-4");
    assert_eq!(r["instance"], up.url().as_str());
    assert!(r["duration_ms"].as_f64().is_some(), "{b}");
    assert!(r["time_ms"].as_u64().is_some(), "{b}");
    // trace_id: see trace_context_reaches_the_upstream_and_the_logs.
    // Every one by default (fewer than 50 made).
    let (s, b) = node.with_key(&key, "GET", "/v1/deployments/web/activity", None);
    assert_eq!(s, 200, "{b}");
    assert_eq!(json(&b)["requests"].as_array().unwrap().len(), 5);
    for bad in ["0", "257", "x"] {
        let (s, b) = node.with_key(
            &key,
            "GET",
            &format!("/v1/deployments/web/activity?limit={bad}"),
            None,
        );
        assert_eq!(s, 400, "{bad}: {b}");
    }
    let (s, _) = node.with_key(&key, "GET", "/v1/deployments/nope/activity", None);
    assert_eq!(s, 404);
    let other = node.create_namespace("other");
    let (s, b) = node.with_key(&other, "GET", "/v1/deployments/web/activity", None);
    assert!(s == 404 || s == 403, "{s} {b}");
    let (s, _, _) = http("GET", &node.url("/v1/deployments/web/activity"), &[], None);
    assert_eq!(s, 401);
}

/// A client sizes the path (60 KB here, under the header limit): a full
/// ring of such requests held 15 MB per deployment and answered 15 MB.
/// Each entry keeps at most 256 bytes of it, cut with `…`, so the full
/// ring answers in well under 256 KB.
#[test]
fn activity_entries_keep_a_bounded_path() {
    if single_node_only() {
        return;
    }
    let (node, key, _up) = web_on_act_test();
    let long = format!("/api/{}", "a".repeat(60_000));
    for _ in 0..256 {
        let (s, _, _) = via(&node, "act.test", "GET", &long, &[], None);
        assert_eq!(s, 200);
    }
    let (s, b) = node.with_key(&key, "GET", "/v1/deployments/web/activity?limit=256", None);
    assert_eq!(s, 200);
    assert!(
        b.len() < 256 << 10,
        "the activity answer is {} bytes",
        b.len()
    );
    let v = json(&b);
    let reqs = v["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), 256);
    for r in reqs {
        let p = r["path"].as_str().unwrap();
        assert!(
            p.len() <= 256 && p.starts_with("/api/aaa") && p.ends_with('…'),
            "{p}"
        );
    }
}

/// A valid `traceparent` reaches the upstream with the same trace id and a
/// new parent id (its `tracestate` kept); a malformed one is replaced, never
/// forwarded; none starts a trace. The request log and the activity ring
/// carry the trace id.
#[test]
fn trace_context_reaches_the_upstream_and_the_logs() {
    if single_node_only() {
        return;
    }
    let node = TestNode::start_with(NodeOpts {
        config: crate::deploy::loopback_config(),
        env: vec![("RUST_LOG".into(), "info".into())],
        ..Default::default()
    });
    let key = node.create_namespace("trc");
    let up = Upstream::start("one");
    deploy_web(&node, &key, "trc.test", &up.url());
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let sent = format!("00-{trace}-{parent}-01");
    let upstream_saw = |headers: &[(&str, &str)]| {
        let (s, _, b) = via(&node, "trc.test", "GET", "/x", headers, None);
        assert_eq!(s, 200);
        let e = json(&String::from_utf8_lossy(&b));
        (
            e["traceparent"].as_str().unwrap_or("").to_string(),
            e["tracestate"].as_str().map(str::to_string),
        )
    };
    // Continued: same trace id and flags, a new parent id.
    let (tp, ts) = upstream_saw(&[
        ("traceparent", &sent),
        ("tracestate", "vendor=abc"),
        ("x-request-id", "trace-rid-1"),
    ]);
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!((parts[0], parts[1], parts[3]), ("00", trace, "01"), "{tp}");
    assert_eq!(parts[2].len(), 16, "{tp}");
    assert_ne!(parts[2], parent, "a new parent id: {tp}");
    assert_ne!(parts[2], "0000000000000000");
    assert_eq!(ts.as_deref(), Some("vendor=abc"));
    // Malformed: replaced by a new trace, the tracestate dropped.
    let bad = format!("00-{trace}-0000000000000000-01");
    let (tp, ts) = upstream_saw(&[("traceparent", &bad), ("tracestate", "vendor=abc")]);
    assert_ne!(tp, bad);
    assert!(!tp.contains(trace), "{tp}");
    assert_eq!(tp.len(), 55, "{tp}");
    assert_eq!(ts, None);
    let (tp, _) = upstream_saw(&[("traceparent", "garbage")]);
    assert_eq!(tp.len(), 55, "{tp}");
    // Absent: a new trace.
    let (tp, _) = upstream_saw(&[]);
    assert_eq!(tp.len(), 55, "{tp}");
    assert!(tp.starts_with("00-"), "{tp}");
    // The request log line and the activity ring carry the trace id.
    let mut line = String::new();
    wait_until(
        std::time::Duration::from_secs(10),
        "the request's log line",
        || {
            let log = node.stderr.lock().unwrap();
            match log.lines().find(|l| l.contains("request_id=trace-rid-1")) {
                Some(l) => {
                    line = l.to_string();
                    true
                }
                None => false,
            }
        },
    );
    assert!(line.contains(&format!("trace_id={trace}")), "{line}");
    let (s, b) = node.with_key(&key, "GET", "/v1/deployments/web/activity", None);
    assert_eq!(s, 200, "{b}");
    let v = json(&b);
    let reqs = v["requests"].as_array().unwrap();
    let first = reqs
        .iter()
        .find(|r| r["request_id"] == "trace-rid-1")
        .expect("in the ring");
    assert_eq!(first["trace_id"], trace, "{b}");
    assert!(
        reqs.iter()
            .all(|r| r["trace_id"].as_str().map(str::len) == Some(32)),
        "{b}"
    );
}

/// Writes its environment (`K=V` strings, NUL-separated) to stdout.
pub(crate) const ENV_ECHO: &str = r#"(module
  (import "wasi_snapshot_preview1" "environ_sizes_get" (func $sizes (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "environ_get" (func $env (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (drop (call $sizes (i32.const 0) (i32.const 4)))
    (drop (call $env (i32.const 1024) (i32.const 4096)))
    (i32.store (i32.const 16) (i32.const 4096))
    (i32.store (i32.const 20) (i32.load (i32.const 4)))
    (drop (call $write (i32.const 1) (i32.const 16) (i32.const 1) (i32.const 24)))))"#;

/// Writes its caller record (the `caller` import's JSON) to stdout.
pub(crate) const CALLER_ECHO: &str = r#"(module
  (import "meshgate" "caller" (func $caller (param i32 i32) (result i64)))
  (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (i32.store (i32.const 16) (i32.const 1024))
    (i32.store (i32.const 20) (i32.wrap_i64 (call $caller (i32.const 1024) (i32.const 8192))))
    (drop (call $write (i32.const 1) (i32.const 16) (i32.const 1) (i32.const 24)))))"#;

/// A function's guest reads the trace context in its caller record
/// (`traceparent` continuing the caller's trace with a new parent id,
/// `tracestate` as it came), not in its environment, which stays empty;
/// its invocation record carries the trace id.
#[test]
fn trace_context_reaches_the_guest_and_the_invocation_record() {
    let node = TestNode::start();
    let key = node.create_namespace("trf");
    crate::functions::deploy(&node, &key, "env", ENV_ECHO.as_bytes(), &[]);
    crate::functions::deploy(&node, &key, "who", CALLER_ECHO.as_bytes(), &[]);
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let parent = "b7ad6b7169203331";
    let auth = format!("Bearer {key}");
    let tp = format!("00-{trace}-{parent}-01");
    let call = |name: &str, headers: &[(&str, &str)]| {
        let mut h = vec![("authorization", auth.as_str())];
        h.extend_from_slice(headers);
        let (s, _, b) = http(
            "POST",
            &node.url(&format!("/v1/functions/{name}/invoke")),
            &h,
            Some(b"{}"),
        );
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
        b
    };
    let who = json(&String::from_utf8_lossy(&call(
        "who",
        &[("traceparent", &tp), ("tracestate", "vendor=v1")],
    )));
    let seen = who["traceparent"]
        .as_str()
        .unwrap_or_else(|| panic!("no traceparent in {who}"));
    let parts: Vec<&str> = seen.split('-').collect();
    assert_eq!(parts.len(), 4, "{seen}");
    assert_eq!(
        (parts[0], parts[1], parts[3]),
        ("00", trace, "01"),
        "{seen}"
    );
    assert_ne!(parts[2], parent, "a new parent id: {seen}");
    assert_eq!(parts[2].len(), 16, "{seen}");
    assert_eq!(who["tracestate"], "vendor=v1", "{who}");
    // Without one, the guest still gets a (new) trace, and no tracestate.
    let who = json(&String::from_utf8_lossy(&call("who", &[])));
    let fresh = who["traceparent"].as_str().unwrap_or_default();
    assert!(fresh.starts_with("00-") && !fresh.contains(trace), "{who}");
    assert!(who.get("tracestate").is_none(), "{who}");
    // The environment is the deployer's alone: here, nothing.
    let env = call(
        "env",
        &[("traceparent", &tp), ("x-request-id", "trace-fn-1")],
    );
    assert_eq!(
        String::from_utf8_lossy(&env),
        "",
        "a guest deployed without variables sees none"
    );
    // The invocation record carries the trace id.
    let mut record = serde_json::Value::Null;
    wait_until(
        std::time::Duration::from_secs(10),
        "the invocation record",
        || {
            let (_, b) = node.with_key(&key, "GET", "/v1/functions/env/logs", None);
            let v = json(&b);
            match v["logs"]
                .as_array()
                .and_then(|l| l.iter().find(|r| r["request_id"] == "trace-fn-1"))
            {
                Some(r) => {
                    record = r.clone();
                    true
                }
                None => false,
            }
        },
    );
    assert_eq!(record["trace_id"], trace, "{record}");
}

/// A request forwarded to the namespace's member carries the trace on: the
/// member's request-log line has the client's trace id (a hop without it
/// would start a new trace there).
#[cfg(feature = "cluster")]
#[test]
fn trace_context_reaches_the_member_on_a_forwarded_hop() {
    use crate::cluster::member_opts;
    let etcd = crate::etcd_process::EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let start = |id: &str| {
        let mut o = member_opts(&etcd, id, free_port(), tmp.path());
        o.env.push(("RUST_LOG".into(), "info".into()));
        TestNode::start_with(o)
    };
    let (a, b) = (start("a"), start("b"));
    let (s, body) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"shop","members":["b"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    let trace = "5bf92f3577b34da6a3ce929d0e0e4737";
    let tp = format!("00-{trace}-10f067aa0ba902b7-01");
    let auth = format!("Bearer {OPERATOR_KEY}");
    let (s, h, body) = http(
        "PUT",
        &a.url("/v1/kv/greeting"),
        &[
            ("authorization", &auth),
            ("x-namespace", "shop"),
            ("traceparent", &tp),
            ("x-request-id", "trace-hop-1"),
        ],
        Some(b"hello"),
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(header(&h, "x-meshgate-member"), Some("b"));
    for (node, name) in [(&a, "a"), (&b, "b")] {
        let mut line = String::new();
        wait_until(
            std::time::Duration::from_secs(10),
            &format!("the request's log line on {name}"),
            || {
                let log = node.stderr.lock().unwrap();
                match log.lines().find(|l| l.contains("request_id=trace-hop-1")) {
                    Some(l) => {
                        line = l.to_string();
                        true
                    }
                    None => false,
                }
            },
        );
        assert!(
            line.contains(&format!("trace_id={trace}")),
            "{name}: {line}"
        );
    }
}

/// A static site's route is counted too (status class by status, no
/// upstream attempt), and its activity names no instance.
#[test]
fn static_routes_are_counted_without_instances() {
    if single_node_only() {
        return;
    }
    let node = proxy_node();
    let key = node.create_namespace("sta");
    let tgz = crate::deploy::tarball(&[("index.html", 'f', b"<h1>hi</h1>")]);
    let (s, b) = crate::deploy::deploy_static(&node, &key, "site", "sta.test", &tgz);
    assert_eq!(s, 201, "{b}");
    assert_eq!(via(&node, "sta.test", "GET", "/", &[], None).0, 200);
    assert_eq!(via(&node, "sta.test", "GET", "/missing", &[], None).0, 404);
    let (_, text) = scrape(&node, None, "/metrics");
    let m = parse_prometheus(&text);
    for class in ["2xx", "4xx"] {
        let k = format!(
            "meshgate_route_requests_total{{deployment=site,namespace=sta,route=/,status_class={class}}}"
        );
        assert_eq!(m.get(&k), Some(&1.0), "{k}: {text}");
    }
    assert!(
        !text.contains("meshgate_upstream_requests_total{deployment=\"site\""),
        "{text}"
    );
    let (s, b) = node.with_key(&key, "GET", "/v1/deployments/site/activity", None);
    assert_eq!(s, 200, "{b}");
    let v = json(&b);
    let reqs = v["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), 2, "{b}");
    assert_eq!(reqs[0]["status"], 404);
    assert_eq!(reqs[0]["path"], "/missing");
    assert!(reqs.iter().all(|r| r["instance"].is_null()), "{b}");
}

/// An instance that cannot be connected is counted as `connect_failed` on
/// its own instance label; the request itself is counted once.
#[test]
fn upstream_attempts_are_counted_per_instance_and_outcome() {
    if single_node_only() {
        return;
    }
    let node = proxy_node();
    let key = node.create_namespace("att");
    let up = Upstream::start("one");
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        drop(l);
        format!("http://{a}")
    };
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({
            "name": "web", "hosts": ["att.test"],
            "upstream": {"instances": [dead, up.url()]}
        }),
    );
    assert_eq!(s, 201, "{v}");
    for _ in 0..2 {
        assert_eq!(via(&node, "att.test", "GET", "/", &[], None).0, 200);
    }
    let (_, text) = scrape(&node, None, "/metrics");
    let m = parse_prometheus(&text);
    let sum = |pred: &dyn Fn(&str) -> bool| -> f64 {
        m.iter().filter(|(k, _)| pred(k)).map(|(_, v)| v).sum()
    };
    let ups = "meshgate_upstream_requests_total{";
    let live = format!("instance={}", up.url());
    let gone = format!("instance={dead}");
    assert_eq!(
        sum(&|k| k.starts_with(ups) && k.contains(&live) && k.contains("outcome=answered")),
        2.0,
        "{text}"
    );
    assert!(
        sum(&|k| k.starts_with(ups) && k.contains(&gone) && k.contains("outcome=connect_failed"))
            >= 1.0,
        "{text}"
    );
    assert_eq!(
        sum(&|k| k.starts_with("meshgate_route_requests_total{") && k.contains("namespace=att")),
        2.0,
        "{text}"
    );
}
