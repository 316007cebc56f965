//! OTLP export of spans (`[telemetry]`, issue #40): a collector in this
//! process on 127.0.0.1 (OTLP/HTTP, protobuf `ExportTraceServiceRequest`)
//! receives the SERVER span of a proxied request and the CLIENT span of its
//! upstream attempt, linked as the `traceparent`s say; a function
//! invocation's span; nothing without an endpoint; a collector that is down
//! costs no request; a bad endpoint is refused at start-up.

use crate::common::*;
use crate::deploy::{Upstream, deploy_json, deploy_web, loopback_config, via};
use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SERVER: i32 = 2;
const CLIENT: i32 = 3;
const STATUS_ERROR: i32 = 2;

/// What the collector received: each span with its resource's `service.name`,
/// and each request's content type.
#[derive(Default)]
struct Received {
    spans: Vec<(String, Span)>,
    content_types: Vec<String>,
}

/// An OTLP/HTTP collector on 127.0.0.1: `POST /v1/traces`, protobuf.
struct Collector {
    addr: String,
    got: Arc<Mutex<Received>>,
}

async fn traces(
    req: HttpRequest,
    body: web::Bytes,
    got: web::Data<Arc<Mutex<Received>>>,
) -> HttpResponse {
    let ct = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let Ok(msg) = ExportTraceServiceRequest::decode(body.as_ref()) else {
        return HttpResponse::BadRequest().finish();
    };
    let mut g = got.lock().unwrap();
    g.content_types.push(ct);
    for rs in msg.resource_spans {
        let service = rs
            .resource
            .as_ref()
            .and_then(|r| {
                r.attributes
                    .iter()
                    .find(|a| a.key == "service.name")
                    .and_then(|a| text(a.value.as_ref()?.value.as_ref()?))
            })
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                g.spans.push((service.clone(), s));
            }
        }
    }
    // An empty `ExportTraceServiceResponse`: all accepted.
    HttpResponse::Ok()
        .content_type("application/x-protobuf")
        .finish()
}

impl Collector {
    fn start() -> Collector {
        let got = Arc::new(Mutex::new(Received::default()));
        let g2 = got.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let srv = HttpServer::new(move || {
                    App::new()
                        .app_data(web::Data::new(g2.clone()))
                        .route("/v1/traces", web::post().to(traces))
                })
                .workers(1)
                .bind("127.0.0.1:0")
                .unwrap();
                tx.send(srv.addrs()[0].to_string()).unwrap();
                srv.run().await.unwrap();
            });
        });
        Collector {
            addr: rx.recv_timeout(Duration::from_secs(10)).unwrap(),
            got,
        }
    }

    /// Waits for a span `pick` chooses, and returns it (with every span seen).
    fn wait_for(&self, what: &str, pick: impl Fn(&Span) -> bool) -> (Span, Vec<(String, Span)>) {
        let mut found = None;
        wait_until(Duration::from_secs(30), what, || {
            let g = self.got.lock().unwrap();
            found = g
                .spans
                .iter()
                .find(|(_, s)| pick(s))
                .map(|(_, s)| s.clone());
            found.is_some()
        });
        (found.unwrap(), self.got.lock().unwrap().spans.clone())
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::StringValue(s) => Some(s.clone()),
        Value::IntValue(i) => Some(i.to_string()),
        Value::BoolValue(b) => Some(b.to_string()),
        _ => None,
    }
}

/// A span's attribute, as text.
fn attr(s: &Span, key: &str) -> Option<String> {
    s.attributes
        .iter()
        .find(|a| a.key == key)
        .and_then(|a| text(a.value.as_ref()?.value.as_ref()?))
}

/// Every attribute value of a span, as text.
fn all_values(s: &Span) -> Vec<String> {
    s.attributes
        .iter()
        .filter_map(|a| text(a.value.as_ref()?.value.as_ref()?))
        .collect()
}

/// The test config, loopback upstreams allowed, spans exported to `c` every 100 ms.
fn exporting_config(endpoint: &str) -> String {
    format!(
        "{}[telemetry]\notlp_endpoint = \"{endpoint}\"\nservice_name = \"mg-test\"\nscheduled_delay_ms = 100\n",
        loopback_config()
    )
}

/// The upstream's view of a request through the node: its `traceparent`.
fn upstream_traceparent(b: &[u8]) -> String {
    json(&String::from_utf8_lossy(b))["traceparent"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// A proxied request with a `traceparent`: a SERVER span with its trace id
/// and the sent parent id, a CLIENT span under it, and the upstream saw the
/// CLIENT span's id as its parent. Attributes per the conventions, with no
/// query string and no credential anywhere. A request with a body (the
/// other client) and one without a `traceparent` (a trace the node starts,
/// sampled) are linked the same way.
#[test]
fn otlp_spans_of_a_proxied_request_link_as_the_traceparents_say() {
    if single_node_only() {
        return;
    }
    let col = Collector::start();
    let node = TestNode::start_with(NodeOpts {
        config: exporting_config(&format!("http://{}", col.addr)),
        ..Default::default()
    });
    let key = node.create_namespace("otl");
    let up = Upstream::start("one");
    deploy_web(&node, &key, "otl.test", &up.url());
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let sent = format!("00-{trace}-{parent}-01");
    let (s, _, b) = via(
        &node,
        "otl.test",
        "GET",
        "/x/y?token=querysecret",
        &[
            ("traceparent", &sent),
            ("authorization", "Bearer credsecret-123"),
            ("x-request-id", "otlp-rid-1"),
        ],
        None,
    );
    assert_eq!(s, 200);
    let seen = upstream_traceparent(&b);
    let parts: Vec<&str> = seen.split('-').collect();
    assert_eq!(parts.len(), 4, "{seen}");
    assert_eq!(
        (parts[0], parts[1], parts[3]),
        ("00", trace, "01"),
        "{seen}"
    );

    let trace_bytes = hex::decode(trace).unwrap();
    let (server, all) = col.wait_for("the SERVER span", |s| {
        s.kind == SERVER && s.trace_id == trace_bytes
    });
    assert_eq!(hex::encode(&server.parent_span_id), parent, "remote parent");
    assert_eq!(server.span_id.len(), 8);
    assert_eq!(attr(&server, "http.request.method").as_deref(), Some("GET"));
    assert_eq!(attr(&server, "url.path").as_deref(), Some("/x/y"));
    assert_eq!(
        attr(&server, "http.response.status_code").as_deref(),
        Some("200")
    );
    assert_eq!(attr(&server, "http.route").as_deref(), Some("/"));
    assert_eq!(attr(&server, "meshgate.namespace").as_deref(), Some("otl"));
    assert_eq!(attr(&server, "meshgate.deployment").as_deref(), Some("web"));
    assert_eq!(
        attr(&server, "meshgate.request_id").as_deref(),
        Some("otlp-rid-1")
    );
    assert_eq!(server.name, "GET /");
    assert_ne!(server.status.as_ref().map(|s| s.code), Some(STATUS_ERROR));
    // The CLIENT span of the attempt: a child of the SERVER span, the
    // upstream's parent.
    let (client, all) = if let Some((_, c)) = all
        .iter()
        .find(|(_, s)| s.kind == CLIENT && s.parent_span_id == server.span_id)
    {
        (c.clone(), all)
    } else {
        col.wait_for("the CLIENT span", |s| {
            s.kind == CLIENT && s.parent_span_id == server.span_id
        })
    };
    assert_eq!(client.trace_id, trace_bytes);
    assert_eq!(
        hex::encode(&client.span_id),
        parts[2],
        "the upstream's parent is the CLIENT span"
    );
    assert_ne!(client.span_id, server.span_id);
    assert_eq!(
        attr(&client, "server.address").as_deref(),
        Some("127.0.0.1")
    );
    let port = up.addr.rsplit_once(':').unwrap().1;
    assert_eq!(attr(&client, "server.port").as_deref(), Some(port));
    assert_eq!(
        attr(&client, "http.response.status_code").as_deref(),
        Some("200")
    );
    assert!(client.start_time_unix_nano >= server.start_time_unix_nano);
    assert!(client.end_time_unix_nano <= server.end_time_unix_nano);
    // No query string, no credential, in any attribute of any span.
    for (service, s) in &all {
        assert_eq!(service, "mg-test");
        for v in all_values(s) {
            assert!(
                !v.contains("querysecret") && !v.contains("token=") && !v.contains("credsecret"),
                "{} carries {v:?}",
                s.name
            );
        }
    }
    assert!(
        col.got
            .lock()
            .unwrap()
            .content_types
            .iter()
            .all(|c| c == "application/x-protobuf")
    );

    // A request with a body (the proxy's other client): linked the same way.
    let trace2 = "5bf92f3577b34da6a3ce929d0e0e4737";
    let (s, _, b) = via(
        &node,
        "otl.test",
        "POST",
        "/post",
        &[("traceparent", &format!("00-{trace2}-10f067aa0ba902b7-01"))],
        Some(b"a body"),
    );
    assert_eq!(s, 200);
    let seen2 = upstream_traceparent(&b);
    let id2 = seen2.split('-').nth(2).unwrap_or("").to_string();
    let t2 = hex::decode(trace2).unwrap();
    let (client2, _) = col.wait_for("the CLIENT span of the POST", |s| {
        s.kind == CLIENT && s.trace_id == t2
    });
    assert_eq!(hex::encode(&client2.span_id), id2, "{seen2}");

    // No traceparent: the node starts a sampled trace, and sends it on so.
    let (s, _, b) = via(&node, "otl.test", "GET", "/fresh", &[], None);
    assert_eq!(s, 200);
    let seen3 = upstream_traceparent(&b);
    assert!(seen3.ends_with("-01"), "sampled: {seen3}");
    let t3 = hex::decode(seen3.split('-').nth(1).unwrap()).unwrap();
    let (server3, _) = col.wait_for("the SERVER span of a new trace", |s| {
        s.kind == SERVER && s.trace_id == t3
    });
    assert!(server3.parent_span_id.is_empty(), "a root span");

    // A failing upstream: its SERVER span is an error (5xx).
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({
            "name": "dead", "hosts": ["dead.otl.test"],
            "upstream": {"instances": ["http://127.0.0.1:9"]}
        }),
    );
    assert_eq!(s, 201, "{v}");
    let trace4 = "6bf92f3577b34da6a3ce929d0e0e4738";
    let (s, _, _) = via(
        &node,
        "dead.otl.test",
        "GET",
        "/",
        &[("traceparent", &format!("00-{trace4}-20f067aa0ba902b7-01"))],
        None,
    );
    assert!(s >= 500, "{s}");
    let t4 = hex::decode(trace4).unwrap();
    let (server4, _) = col.wait_for("the SERVER span of a 5xx", |s| {
        s.kind == SERVER && s.trace_id == t4
    });
    assert_eq!(server4.status.as_ref().map(|s| s.code), Some(STATUS_ERROR));
    let (client4, _) = col.wait_for("the failed attempt", |s| {
        s.kind == CLIENT && s.trace_id == t4
    });
    assert_eq!(client4.status.as_ref().map(|s| s.code), Some(STATUS_ERROR));
    assert!(attr(&client4, "error.type").is_some());
}

/// A function invocation's SERVER span: the `traceparent` of the guest's
/// caller record names it as the parent; it carries the namespace, the
/// function and the route pattern.
#[test]
fn otlp_span_of_a_function_invocation() {
    if single_node_only() {
        return;
    }
    let col = Collector::start();
    let node = TestNode::start_with(NodeOpts {
        config: exporting_config(&format!("http://{}", col.addr)),
        ..Default::default()
    });
    let key = node.create_namespace("otf");
    crate::functions::deploy(
        &node,
        &key,
        "env",
        crate::observe::CALLER_ECHO.as_bytes(),
        &[],
    );
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let parent = "b7ad6b7169203331";
    let auth = format!("Bearer {key}");
    let (s, _, b) = http(
        "POST",
        &node.url("/v1/functions/env/invoke?x=querysecret"),
        &[
            ("authorization", &auth),
            ("traceparent", &format!("00-{trace}-{parent}-01")),
        ],
        Some(b"{}"),
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let record = json(&String::from_utf8_lossy(&b));
    let guest = record["traceparent"]
        .as_str()
        .unwrap_or_else(|| panic!("no traceparent in {record}"))
        .to_string();
    let t = hex::decode(trace).unwrap();
    let (server, _) = col.wait_for("the invocation's SERVER span", |s| {
        s.kind == SERVER && s.trace_id == t
    });
    assert_eq!(hex::encode(&server.parent_span_id), parent);
    assert_eq!(
        guest.split('-').nth(2),
        Some(hex::encode(&server.span_id).as_str()),
        "the guest's parent is the SERVER span: {guest}"
    );
    assert_eq!(attr(&server, "meshgate.namespace").as_deref(), Some("otf"));
    assert_eq!(attr(&server, "meshgate.function").as_deref(), Some("env"));
    assert_eq!(
        attr(&server, "url.path").as_deref(),
        Some("/v1/functions/env/invoke")
    );
    assert_eq!(
        attr(&server, "http.response.status_code").as_deref(),
        Some("200")
    );
    let route = attr(&server, "http.route").unwrap_or_default();
    assert!(
        route.starts_with("/v1/functions/") && route.contains('{'),
        "{route}"
    );
    for v in all_values(&server) {
        assert!(!v.contains("querysecret") && !v.contains(&key), "{v}");
    }
}

/// Without an endpoint nothing is exported: no exporter is started (no log
/// line of it), a trace the node starts is not sampled (flags `00`, as
/// before telemetry), and requests are served as ever.
#[test]
fn otlp_off_without_an_endpoint() {
    let node = TestNode::start_with(NodeOpts {
        config: loopback_config(),
        env: vec![("RUST_LOG".into(), "info".into())],
        ..Default::default()
    });
    let key = node.create_namespace("otn");
    let up = Upstream::start("one");
    deploy_web(&node, &key, "otn.test", &up.url());
    let (s, _, b) = via(&node, "otn.test", "GET", "/", &[], None);
    assert_eq!(s, 200);
    let tp = upstream_traceparent(&b);
    assert!(tp.ends_with("-00"), "not sampled: {tp}");
    let log = node.stderr.lock().unwrap().clone();
    assert!(!log.contains("OTLP"), "{log}");
    assert!(!log.contains("Telemetry"), "{log}");
}

/// A collector that is down: requests are served as ever, and the failed
/// exports are logged (once a minute at most).
#[test]
fn otlp_collector_down_costs_no_request() {
    if single_node_only() {
        return;
    }
    // A port nothing listens on.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let mut config = exporting_config(&format!("http://{dead}"));
    config.push_str("max_queue_size = 16\n");
    let node = TestNode::start_with(NodeOpts {
        config,
        env: vec![("RUST_LOG".into(), "warn".into())],
        ..Default::default()
    });
    let key = node.create_namespace("otd");
    let up = Upstream::start("one");
    deploy_web(&node, &key, "otd.test", &up.url());
    // More requests than the queue holds: the extra spans are dropped.
    for _ in 0..40 {
        let (s, _, _) = via(&node, "otd.test", "GET", "/", &[], None);
        assert_eq!(s, 200);
    }
    wait_until(
        Duration::from_secs(60),
        "the failed export's log line",
        || {
            node.stderr
                .lock()
                .unwrap()
                .contains("spans could not be exported")
        },
    );
    let (s, _, _) = via(&node, "otd.test", "GET", "/", &[], None);
    assert_eq!(s, 200);
    let log = node.stderr.lock().unwrap().clone();
    assert_eq!(
        log.matches("spans could not be exported").count(),
        1,
        "rate limited: {log}"
    );
}

/// An endpoint that is not an http(s) URL is refused at start-up, named.
#[test]
fn otlp_bad_endpoint_is_refused_at_start() {
    for bad in [
        "grpc://127.0.0.1:4317",
        "127.0.0.1:4318",
        "http://u:p@127.0.0.1:4318",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("config.toml");
        std::fs::write(&cfg, format!("[telemetry]\notlp_endpoint = \"{bad}\"\n")).unwrap();
        let (code, err) = crate::node::run_serve(
            &[
                "--config",
                cfg.to_str().unwrap(),
                "--data-dir",
                dir.path().join("data").to_str().unwrap(),
            ],
            &[],
            Duration::from_secs(20),
        );
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(err.contains("telemetry.otlp_endpoint"), "{bad}: {err}");
        assert!(!err.contains("u:p@"), "the credential is not echoed: {err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, "[telemetry]\nsample_ratio = 2.0\n").unwrap();
    let (code, err) = crate::node::run_serve(
        &["--config", cfg.to_str().unwrap()],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("telemetry.sample_ratio"), "{err}");
}

/// Drain flushes: with exports a minute apart, the span of the last request
/// still reaches the collector when the node stops on SIGTERM.
#[test]
fn otlp_drain_flushes_the_queued_spans() {
    if single_node_only() {
        return;
    }
    let col = Collector::start();
    let mut node = TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}[server]\ndrain_grace_seconds = 1\n[telemetry]\notlp_endpoint = \"http://{}\"\nscheduled_delay_ms = 60000\n",
            col.addr
        ),
        ..Default::default()
    });
    let trace = "7bf92f3577b34da6a3ce929d0e0e4739";
    let (s, _, _) = http(
        "GET",
        &node.url("/livez"),
        &[("traceparent", &format!("00-{trace}-30f067aa0ba902b7-01"))],
        None,
    );
    assert_eq!(s, 200);
    let (s, _, _) = http(
        "GET",
        &node.url("/v1/nothing-here"),
        &[("traceparent", &format!("00-{trace}-40f067aa0ba902b7-01"))],
        None,
    );
    assert_eq!(s, 404);
    assert!(
        col.got.lock().unwrap().spans.is_empty(),
        "not before a minute"
    );
    node.signal(15);
    assert_eq!(node.wait_exit(Duration::from_secs(30)), Some(0));
    let t = hex::decode(trace).unwrap();
    let (server, _) = col.wait_for("the flushed span", |s| s.kind == SERVER && s.trace_id == t);
    assert_eq!(
        attr(&server, "url.path").as_deref(),
        Some("/v1/nothing-here")
    );
    assert_eq!(
        attr(&server, "http.response.status_code").as_deref(),
        Some("404")
    );
}

/// A request forwarded to the namespace's member: the first node's SERVER
/// span, its CLIENT span of the hop, and the member's SERVER span whose
/// parent is that CLIENT span, one trace.
#[cfg(feature = "cluster")]
#[test]
fn otlp_spans_of_a_forwarded_hop() {
    use crate::cluster::member_opts;
    let col = Collector::start();
    let etcd = crate::etcd_process::EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let start = |id: &str| {
        let mut o = member_opts(&etcd, id, free_port(), tmp.path());
        o.config.push_str(&format!(
            "[telemetry]\notlp_endpoint = \"http://{}\"\nservice_name = \"node-{id}\"\nscheduled_delay_ms = 100\n",
            col.addr
        ));
        TestNode::start_with(o)
    };
    let (a, b) = (start("a"), start("b"));
    let (s, body) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"shop","members":["b"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    let trace = "8bf92f3577b34da6a3ce929d0e0e473a";
    let parent = "50f067aa0ba902b7";
    let auth = format!("Bearer {OPERATOR_KEY}");
    let (s, h, body) = http(
        "PUT",
        &a.url("/v1/kv/greeting"),
        &[
            ("authorization", &auth),
            ("x-namespace", "shop"),
            ("traceparent", &format!("00-{trace}-{parent}-01")),
        ],
        Some(b"hello"),
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(header(&h, "x-meshgate-member"), Some("b"));
    let t = hex::decode(trace).unwrap();
    let (member, _) = col.wait_for("the member's SERVER span", |s| {
        s.kind == SERVER && s.trace_id == t && s.parent_span_id != hex::decode(parent).unwrap()
    });
    let (hop, _) = col.wait_for("the hop's CLIENT span", |s| {
        s.kind == CLIENT && s.trace_id == t
    });
    let (first, all) = col.wait_for("the first node's SERVER span", |s| {
        s.kind == SERVER && s.trace_id == t && hex::encode(&s.parent_span_id) == parent
    });
    assert_eq!(
        member.parent_span_id, hop.span_id,
        "the member continues the hop"
    );
    assert_eq!(
        hop.parent_span_id, first.span_id,
        "the hop is the first node's"
    );
    assert_eq!(attr(&first, "meshgate.namespace").as_deref(), Some("shop"));
    let services: Vec<&str> = all
        .iter()
        .filter(|(_, s)| s.trace_id == t)
        .map(|(n, _)| n.as_str())
        .collect();
    assert!(
        services.contains(&"node-a") && services.contains(&"node-b"),
        "{services:?}"
    );
    drop((a, b));
}
