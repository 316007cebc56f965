//! Deployments (docs/design.md §7, docs/deployments.md): static sites, the reverse
//! proxy and its statuses (404, 421, 502, 503, 101), streaming (SSE, a 100 MiB
//! download with bounded memory), TLS with SNI and certificate reload, HTTP/2,
//! and the bad inputs of a deploy. The upstreams here listen on 127.0.0.1,
//! which the egress policy forbids by default: these nodes open loopback with
//! `[deploy] upstream_allow` (the policy itself: tests/it/security/egress.rs).

use crate::common::*;

mod balance;
pub(crate) mod certs;
mod compress;
mod health;
use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use futures_util::{SinkExt as _, StreamExt as _};
use std::io::{Read, Write};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod policy;

/// An upstream app in this process: echo, SSE held open until told, a large
/// download, a WebSocket echo. Its id tells instances apart.
pub struct Upstream {
    pub addr: String,
    /// Notified by the test to let `/sse` finish.
    pub release: Arc<tokio::sync::Notify>,
}

async fn echo(req: HttpRequest, body: web::Bytes, id: web::Data<String>) -> HttpResponse {
    let h = |n: &str| {
        req.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    HttpResponse::Ok().json(serde_json::json!({
        "id": id.get_ref(),
        "method": req.method().as_str(),
        "path": req.uri().path_and_query().map(|p| p.as_str()).unwrap_or(""),
        "host": h("host"),
        "xff": h("x-forwarded-for"),
        "xfp": h("x-forwarded-proto"),
        "xfh": h("x-forwarded-host"),
        "rid": h("x-request-id"),
        "authorization": h("authorization"),
        "keep_alive_header": h("keep-alive"),
        "custom": h("x-custom"),
        "traceparent": h("traceparent"),
        "tracestate": h("tracestate"),
        "body_len": body.len(),
        "body_sha": hex::encode(ring::digest::digest(&ring::digest::SHA256, &body).as_ref()),
    }))
}

async fn sse(release: web::Data<Arc<tokio::sync::Notify>>) -> HttpResponse {
    let release = release.get_ref().clone();
    let s = async_stream(release);
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("cache-control", "no-cache"))
        .streaming(s)
}

fn async_stream(
    release: Arc<tokio::sync::Notify>,
) -> impl futures_util::Stream<Item = Result<web::Bytes, actix_web::Error>> {
    futures_util::stream::unfold(0u8, move |state| {
        let release = release.clone();
        async move {
            match state {
                0 => Some((Ok(web::Bytes::from_static(b"data: first\n\n")), 1)),
                1 => {
                    // Held open until the test has seen the first event.
                    let _ = tokio::time::timeout(Duration::from_secs(20), release.notified()).await;
                    Some((Ok(web::Bytes::from_static(b"data: last\n\n")), 2))
                }
                _ => None,
            }
        }
    })
}

const BIG: u64 = 100 << 20;

async fn big() -> HttpResponse {
    let chunk = web::Bytes::from(vec![b'z'; 64 << 10]);
    let n = BIG / (64 << 10);
    let s =
        futures_util::stream::iter((0..n).map(move |_| Ok::<_, actix_web::Error>(chunk.clone())));
    HttpResponse::Ok()
        .content_type("application/octet-stream")
        .no_chunking(BIG)
        .streaming(s)
}

async fn ws_echo(req: HttpRequest, body: web::Payload) -> actix_web::Result<HttpResponse> {
    let (resp, mut session, mut stream) = actix_ws::handle(&req, body)?;
    actix_web::rt::spawn(async move {
        while let Some(Ok(m)) = stream.next().await {
            match m {
                actix_ws::Message::Text(t) => {
                    let _ = session.text(format!("echo:{t}")).await;
                }
                actix_ws::Message::Close(r) => {
                    let _ = session.close(r).await;
                    return;
                }
                _ => {}
            }
        }
    });
    Ok(resp)
}

impl Upstream {
    pub fn start(id: &str) -> Upstream {
        let (tx, rx) = std::sync::mpsc::channel();
        let release = Arc::new(tokio::sync::Notify::new());
        let r2 = release.clone();
        let id = id.to_string();
        std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let srv = HttpServer::new(move || {
                    App::new()
                        .app_data(web::Data::new(id.clone()))
                        .app_data(web::Data::new(r2.clone()))
                        .app_data(web::PayloadConfig::new(64 << 20))
                        .route("/sse", web::get().to(sse))
                        .route("/big", web::get().to(big))
                        .route("/ws", web::get().to(ws_echo))
                        .default_service(web::to(echo))
                })
                .workers(1)
                .bind("127.0.0.1:0")
                .unwrap();
                tx.send(srv.addrs()[0].to_string()).unwrap();
                srv.run().await.unwrap();
            });
        });
        Upstream {
            addr: rx.recv_timeout(Duration::from_secs(10)).unwrap(),
            release,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// The `[deploy]` line that opens loopback upstreams (the egress policy
/// forbids them by default).
pub(crate) const ALLOW_LOOPBACK: &str = "upstream_allow = [\"127.0.0.0/8\"]\n";

/// The test config with loopback upstreams allowed (and health checks as
/// often as every 100 ms, so the check tests run quickly).
pub(crate) fn loopback_config() -> String {
    format!("{TEST_CONFIG}[deploy]\n{ALLOW_LOOPBACK}health_min_interval_ms = 100\n")
}

/// A node that may proxy to this process's upstreams on 127.0.0.1.
pub(crate) fn proxy_node() -> TestNode {
    TestNode::start_with(NodeOpts {
        config: loopback_config(),
        ..Default::default()
    })
}

/// A port nothing listens on.
fn dead_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap().to_string();
    drop(l);
    format!("http://{a}")
}

pub(crate) fn deploy_json(
    node: &TestNode,
    key: &str,
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    let (s, b) = node.with_key(
        key,
        "POST",
        "/v1/deployments",
        Some(body.to_string().as_bytes()),
    );
    (s, json(&b))
}

/// Deploys `web` on `host` with the one upstream `url` (201 asserted): the
/// proxied route the tracing and telemetry tests drive.
pub(crate) fn deploy_web(node: &TestNode, key: &str, host: &str, url: &str) {
    let (s, v) = deploy_json(
        node,
        key,
        serde_json::json!({"name": "web", "hosts": [host], "upstream": {"instances": [url]}}),
    );
    assert_eq!(s, 201, "{v}");
}

/// GET through the node with a Host header.
pub(crate) fn via(
    node: &TestNode,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut h = vec![("host", host)];
    h.extend_from_slice(headers);
    http(method, &node.url(path), &h, body)
}

fn code(b: &[u8]) -> String {
    json(&String::from_utf8_lossy(b))["error"]["code"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// A `.tar.gz` from (path, kind, data) entries, names written raw so hostile
/// names can be made: 'f' file, 'd' folder, 's' symlink, 'h' hard link.
pub(crate) fn tarball(entries: &[(&str, char, &[u8])]) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut b = tar::Builder::new(gz);
    for (path, kind, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.as_gnu_mut().unwrap().name[..path.len()].copy_from_slice(path.as_bytes());
        h.set_mode(0o644);
        let (t, size, link) = match kind {
            'f' => (tar::EntryType::Regular, data.len(), None),
            'd' => (tar::EntryType::Directory, 0, None),
            's' => (tar::EntryType::Symlink, 0, Some(*data)),
            _ => (tar::EntryType::Link, 0, Some(*data)),
        };
        h.set_entry_type(t);
        h.set_size(size as u64);
        if let Some(l) = link {
            h.set_link_name_literal(std::str::from_utf8(l).unwrap())
                .unwrap();
        }
        h.set_cksum();
        let content: &[u8] = if *kind == 'f' { data } else { &[] };
        b.append(&h, content).unwrap();
    }
    b.into_inner().unwrap().finish().unwrap()
}

fn multipart(parts: &[(&str, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "mgdeployboundary7";
    let mut body = Vec::new();
    for (name, data) in parts {
        body.extend_from_slice(
            format!("--{boundary}\r\ncontent-disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\ncontent-type: application/octet-stream\r\n\r\n").as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

pub(crate) fn deploy_static(
    node: &TestNode,
    key: &str,
    name: &str,
    hosts: &str,
    tgz: &[u8],
) -> (u16, String) {
    let (ct, body) = multipart(&[
        ("name", name.as_bytes()),
        ("hosts", hosts.as_bytes()),
        ("tarball", tgz),
    ]);
    let auth = format!("Bearer {key}");
    let (s, _, b) = http(
        "POST",
        &node.url("/v1/deployments"),
        &[("authorization", &auth), ("content-type", &ct)],
        Some(&body),
    );
    (s, String::from_utf8_lossy(&b).into_owned())
}

/// A static site: content types, index.html for folders, ETag and 304, 404 for
/// a missing file, 405 for a write, versions and rollback.
#[test]
fn static_site_serves_files_with_etags() {
    let node = TestNode::start();
    let key = node.create_namespace("site");
    let v1 = tarball(&[
        ("./index.html", 'f', b"<h1>home v1</h1>"),
        ("./docs/index.html", 'f', b"<h1>docs</h1>"),
        ("./css/app.css", 'f', b"body{color:red}"),
        ("./logo.svg", 'f', b"<svg/>"),
        ("./latest.html", 's', b"index.html"),
    ]);
    let (s, b) = deploy_static(&node, &key, "www", "www.site.test", &v1);
    assert_eq!(s, 201, "{b}");
    assert_eq!(json(&b)["deployment"]["target"]["files"], 5);

    let (s, h, body) = via(&node, "WWW.site.test:8080", "GET", "/", &[], None);
    assert_eq!((s, body.as_slice()), (200, &b"<h1>home v1</h1>"[..]));
    assert_eq!(header(&h, "content-type"), Some("text/html; charset=utf-8"));
    let etag = header(&h, "etag").unwrap().to_string();
    let (s, _, body) = via(&node, "www.site.test", "GET", "/docs", &[], None);
    assert_eq!((s, body.as_slice()), (200, &b"<h1>docs</h1>"[..]));
    let (_, h, _) = via(&node, "www.site.test", "GET", "/css/app.css", &[], None);
    assert_eq!(header(&h, "content-type"), Some("text/css; charset=utf-8"));
    let (_, h, _) = via(&node, "www.site.test", "GET", "/logo.svg", &[], None);
    assert!(
        header(&h, "content-type")
            .unwrap()
            .starts_with("image/svg+xml")
    );
    let (s, _, body) = via(&node, "www.site.test", "GET", "/latest.html", &[], None);
    assert_eq!((s, body.as_slice()), (200, &b"<h1>home v1</h1>"[..]));

    let (s, h, body) = via(
        &node,
        "www.site.test",
        "GET",
        "/index.html",
        &[("if-none-match", &etag)],
        None,
    );
    assert_eq!(s, 304);
    assert!(body.is_empty());
    assert_eq!(header(&h, "etag"), Some(etag.as_str()));
    let (s, _, body) = via(&node, "www.site.test", "GET", "/nope.html", &[], None);
    assert_eq!((s, code(&body).as_str()), (404, "FILE_NOT_FOUND"));
    let (s, _, _) = via(
        &node,
        "www.site.test",
        "POST",
        "/index.html",
        &[],
        Some(b"x"),
    );
    assert_eq!(s, 405);

    // Version 2, then roll back to 1.
    let v2 = tarball(&[("index.html", 'f', b"<h1>home v2</h1>")]);
    let (s, b) = deploy_static(&node, &key, "www", "www.site.test", &v2);
    assert_eq!(s, 201, "{b}");
    let (_, _, body) = via(&node, "www.site.test", "GET", "/", &[], None);
    assert_eq!(body, b"<h1>home v2</h1>");
    let (s, b) = node.with_key(&key, "GET", "/v1/deployments/www/versions", None);
    assert_eq!(s, 200);
    assert_eq!(json(&b)["versions"].as_array().unwrap().len(), 2);
    let (s, b) = node.with_key(
        &key,
        "POST",
        "/v1/deployments/www/rollback",
        Some(b"{\"version\": 1}"),
    );
    assert_eq!(s, 200, "{b}");
    let (_, _, body) = via(&node, "www.site.test", "GET", "/", &[], None);
    assert_eq!(body, b"<h1>home v1</h1>");
    let (s, b) = node.with_key(
        &key,
        "POST",
        "/v1/deployments/www/rollback",
        Some(b"{\"version\": 9}"),
    );
    assert_eq!(
        (s, json(&b)["error"]["code"].as_str()),
        (404, Some("VERSION_NOT_FOUND"))
    );
    let (s, _) = node.with_key(
        &key,
        "POST",
        "/v1/deployments/www/rollback",
        Some(b"{\"version\": \"x\"}"),
    );
    assert_eq!(s, 400);

    // Deleted: the host is the gateway's again.
    let (s, _) = node.with_key(&key, "DELETE", "/v1/deployments/www", None);
    assert_eq!(s, 200);
    let (s, _, body) = via(&node, "www.site.test", "GET", "/", &[], None);
    assert_eq!((s, code(&body).as_str()), (404, "NOT_FOUND"));
}

/// Tarballs that climb out of the site are refused and store nothing; bad
/// upstream URLs and hosts are 400; a host of another namespace is 409.
#[test]
fn bad_deploys_are_refused_and_store_nothing() {
    let node = proxy_node();
    let a = node.create_namespace("alpha");
    let b = node.create_namespace("beta");
    for (i, t) in [
        tarball(&[("index.html", 'f', b"ok"), ("../escape.html", 'f', b"x")]),
        tarball(&[("index.html", 'f', b"ok"), ("/etc/cron.d/x", 'f', b"x")]),
        tarball(&[
            ("index.html", 'f', b"ok"),
            ("passwd", 's', b"../../../etc/passwd"),
        ]),
        tarball(&[("index.html", 'f', b"ok"), ("abs", 's', b"/etc/passwd")]),
        tarball(&[("index.html", 'f', b"ok"), ("hard", 'h', b"../outside")]),
    ]
    .iter()
    .enumerate()
    {
        let (s, body) = deploy_static(&node, &a, "evil", "evil.test", t);
        assert_eq!(s, 400, "case {i}: {body}");
        assert_eq!(json(&body)["error"]["code"], "UNSAFE_TARBALL", "case {i}");
    }
    let (s, body) = deploy_static(&node, &a, "evil", "evil.test", b"garbage");
    assert_eq!(
        (s, json(&body)["error"]["code"].as_str()),
        (400, Some("INVALID_TARBALL"))
    );
    // Nothing was stored: no deployment, the host is not routed and still free.
    let (s, _) = node.with_key(&a, "GET", "/v1/deployments/evil", None);
    assert_eq!(s, 404);
    let (_, body) = node.with_key(&a, "GET", "/v1/deployments", None);
    assert_eq!(json(&body)["deployments"].as_array().unwrap().len(), 0);
    let (s, _, _) = via(&node, "evil.test", "GET", "/", &[], None);
    assert_eq!(s, 404);

    let up = Upstream::start("u");
    for (bad, want) in [
        ("ftp://127.0.0.1:21", "INVALID_UPSTREAM"),
        ("127.0.0.1:9000", "INVALID_UPSTREAM"),
        ("http://127.0.0.1:9000/base", "INVALID_UPSTREAM"),
    ] {
        let (s, v) = deploy_json(
            &node,
            &a,
            serde_json::json!({"name": "api", "hosts": ["api.test"], "upstream": {"instances": [bad]}}),
        );
        assert_eq!((s, v["error"]["code"].as_str()), (400, Some(want)), "{bad}");
    }
    for bad_host in [
        "api.test:80",
        "http://api.test",
        "bad host",
        "ns-alpha.localhost",
    ] {
        let (s, v) = deploy_json(
            &node,
            &a,
            serde_json::json!({"name": "api", "hosts": [bad_host], "upstream": {"instances": [up.url()]}}),
        );
        assert_eq!(s, 400, "{bad_host}: {v}");
    }
    let (s, v) = deploy_json(
        &node,
        &a,
        serde_json::json!({"name": "api", "hosts": ["api.test"], "routes": [{"path_prefix": "x"}], "upstream": {"instances": [up.url()]}}),
    );
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (400, Some("INVALID_ROUTE"))
    );
    // A client's long value is quoted back cut (64 bytes and its length),
    // and no message is a multiple of what was sent: a 100 KiB prefix, a
    // 100 KiB method, a 100 KiB unknown field each answer under 1.2 KiB.
    let long = format!("x{}", "\"\\".repeat(50 * 1024));
    for body in [
        serde_json::json!({"name": "api", "hosts": ["api.test"], "routes": [{"path_prefix": long}], "upstream": {"instances": [up.url()]}}),
        serde_json::json!({"name": "api", "hosts": ["api.test"], "routes": [{"path_prefix": "/", "methods": [long]}], "upstream": {"instances": [up.url()]}}),
        serde_json::json!({"name": "api", "hosts": ["api.test"], long.clone(): 1, "upstream": {"instances": [up.url()]}}),
    ] {
        let (s, v) = deploy_json(&node, &a, body);
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(s, 400, "{}", &message[..message.len().min(200)]);
        assert!(
            message.len() < 1200,
            "{} bytes: {}",
            message.len(),
            &message[..200]
        );
    }
    let (s, v) = deploy_json(
        &node,
        &a,
        serde_json::json!({"name": "api", "hosts": ["api.test"]}),
    );
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (400, Some("MISSING_TARGET"))
    );
    let (s, _) = node.with_key(&a, "POST", "/v1/deployments", Some(b"{not json"));
    assert_eq!(s, 400);

    // A host belongs to one namespace at a time.
    let (s, v) = deploy_json(
        &node,
        &a,
        serde_json::json!({"name": "api", "hosts": ["api.test"], "upstream": {"instances": [up.url()]}}),
    );
    assert_eq!(s, 201, "{v}");
    let (s, v) = deploy_json(
        &node,
        &b,
        serde_json::json!({"name": "steal", "hosts": ["API.test"], "upstream": {"instances": [up.url()]}}),
    );
    assert_eq!((s, v["error"]["code"].as_str()), (409, Some("HOST_TAKEN")));
    let (s, t) = deploy_static(
        &node,
        &b,
        "steal",
        "api.test",
        &tarball(&[("index.html", 'f', b"x")]),
    );
    assert_eq!(s, 409, "{t}");
    // alpha's deployment still serves, beta got nothing.
    let (s, _, body) = via(&node, "api.test", "GET", "/x", &[], None);
    assert_eq!(s, 200);
    assert_eq!(json(&String::from_utf8_lossy(&body))["id"], "u");
    let (_, body) = node.with_key(&b, "GET", "/v1/deployments", None);
    assert_eq!(json(&body)["deployments"].as_array().unwrap().len(), 0);
    // Deleting alpha's namespace frees the host.
    assert_eq!(node.op("DELETE", "/v1/namespaces/alpha", None).0, 200);
    let (s, v) = deploy_json(
        &node,
        &b,
        serde_json::json!({"name": "steal", "hosts": ["api.test"], "upstream": {"instances": [up.url()]}}),
    );
    assert_eq!(s, 201, "{v}");
    // Without a deployments grant a key cannot deploy.
    let (s, body) = node.with_key(
        &b,
        "POST",
        "/v1/auth/api-keys",
        Some(br#"{"role":"runtime"}"#),
    );
    assert_eq!(s, 201, "{body}");
    let runtime = json(&body)["api_key"].as_str().unwrap().to_string();
    let (s, _) = deploy_json(
        &node,
        &runtime,
        serde_json::json!({"name": "x", "hosts": ["x.test"], "upstream": {"instances": [up.url()]}}),
    );
    assert_eq!(s, 403);
}

/// The proxy: path rewriting with the query kept, forwarded headers,
/// hop-by-hop headers removed, the upstream's Authorization untouched,
/// round-robin, and the statuses 404, 502 and 503.
#[test]
fn proxy_routes_rewrites_and_balances() {
    let node = TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}[deploy]\n{ALLOW_LOOPBACK}unhealthy_after_failures = 2\nunhealthy_seconds = 2\n"
        ),
        ..Default::default()
    });
    let key = node.create_namespace("shop");
    let (u1, u2) = (Upstream::start("one"), Upstream::start("two"));
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({
            "name": "api", "hosts": ["shop.test"],
            "upstream": {"instances": [u1.url(), u2.url()]},
            "routes": [
                {"path_prefix": "/api", "strip_prefix": "/api", "add_prefix": "/v2"},
                {"path_prefix": "/api/admin", "methods": ["POST"], "priority": 1}
            ]
        }),
    );
    assert_eq!(s, 201, "{v}");
    let (s, h, body) = via(
        &node,
        "shop.test",
        "GET",
        "/api/users?page=2&q=a%20b",
        &[
            ("authorization", "Bearer for-the-upstream"),
            ("x-request-id", "rid-123"),
            ("keep-alive", "timeout=5"),
            ("connection", "keep-alive, x-custom"),
            ("x-custom", "hop"),
        ],
        None,
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    let e = json(&String::from_utf8_lossy(&body));
    assert_eq!(e["path"], "/v2/users?page=2&q=a%20b");
    assert_eq!(e["xfh"], "shop.test");
    assert_eq!(e["xfp"], "http");
    assert_eq!(e["xff"], "127.0.0.1");
    assert_eq!(e["rid"], "rid-123");
    assert_eq!(e["authorization"], "Bearer for-the-upstream");
    assert_eq!(e["keep_alive_header"], serde_json::Value::Null);
    assert_eq!(
        e["custom"],
        serde_json::Value::Null,
        "listed in Connection: hop-by-hop"
    );
    assert_eq!(header(&h, "x-request-id"), Some("rid-123"));
    // The more specific route takes POST /api/admin without rewriting.
    let (_, _, body) = via(&node, "shop.test", "POST", "/api/admin/x", &[], Some(b"{}"));
    assert_eq!(
        json(&String::from_utf8_lossy(&body))["path"],
        "/api/admin/x"
    );
    // Round-robin over both instances.
    let ids: Vec<String> = (0..6)
        .map(|_| {
            let (_, _, b) = via(&node, "shop.test", "GET", "/api/x", &[], None);
            json(&String::from_utf8_lossy(&b))["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(ids.iter().filter(|i| *i == "one").count(), 3, "{ids:?}");
    assert_eq!(ids.iter().filter(|i| *i == "two").count(), 3, "{ids:?}");
    // No route for the path: 404.
    let (s, _, body) = via(&node, "shop.test", "GET", "/other", &[], None);
    assert_eq!((s, code(&body).as_str()), (404, "NO_ROUTE"));

    // An upstream that is down: 502 while its instances are tried, then 503
    // once passive health has marked them all unhealthy.
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({
            "name": "down", "hosts": ["down.shop.test"],
            "upstream": {"instances": [dead_port(), dead_port()]}
        }),
    );
    assert_eq!(s, 201, "{v}");
    let (s, _, body) = via(&node, "down.shop.test", "GET", "/", &[], None);
    assert_eq!((s, code(&body).as_str()), (502, "UPSTREAM_UNAVAILABLE"));
    let (s, _, body) = via(&node, "down.shop.test", "GET", "/", &[], None);
    assert_eq!((s, code(&body).as_str()), (502, "UPSTREAM_UNAVAILABLE"));
    let (s, h, body) = via(&node, "down.shop.test", "GET", "/", &[], None);
    assert_eq!((s, code(&body).as_str()), (503, "NO_HEALTHY_UPSTREAM"));
    assert!(header(&h, "retry-after").is_some());
    let (_, b) = node.with_key(&key, "GET", "/v1/deployments/down", None);
    let inst = &json(&b)["deployment"]["target"]["instances"];
    assert_eq!(inst[0]["healthy"], false, "{b}");
    assert_eq!(inst[1]["healthy"], false, "{b}");
}

/// A dead instance is skipped by retrying the request (its body intact) on the
/// next one, and then by passive health.
#[test]
fn failed_connection_retries_on_next_instance_with_the_body() {
    let node = TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}[deploy]\n{ALLOW_LOOPBACK}unhealthy_after_failures = 1\nunhealthy_seconds = 60\n"
        ),
        ..Default::default()
    });
    let key = node.create_namespace("retry");
    let up = Upstream::start("alive");
    let dead = dead_port();
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({
            "name": "api", "hosts": ["retry.test"], "upstream": {"instances": [dead.clone(), up.url()]}
        }),
    );
    assert_eq!(s, 201, "{v}");
    let body = vec![7u8; 300_000];
    let sha = hex::encode(ring::digest::digest(&ring::digest::SHA256, &body).as_ref());
    for _ in 0..4 {
        let (s, _, b) = via(&node, "retry.test", "POST", "/upload", &[], Some(&body));
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
        let e = json(&String::from_utf8_lossy(&b));
        assert_eq!(
            (e["id"].as_str(), e["body_len"].as_u64()),
            (Some("alive"), Some(300_000))
        );
        assert_eq!(e["body_sha"], sha);
    }
    let (_, b) = node.with_key(&key, "GET", "/v1/deployments/api", None);
    assert_eq!(
        json(&b)["deployment"]["target"]["instances"][0]["healthy"],
        false,
        "{b}"
    );
}

/// SSE: the first event reaches the client while the upstream still holds the
/// stream open (nothing is buffered).
#[test]
fn sse_first_event_arrives_before_the_upstream_finishes() {
    let node = proxy_node();
    let key = node.create_namespace("events");
    let up = Upstream::start("sse");
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({"name": "ev", "hosts": ["events.test"], "upstream": {"instances": [up.url()]}}),
    );
    assert_eq!(s, 201, "{v}");
    let mut conn = std::net::TcpStream::connect(&node.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(conn, "GET /sse HTTP/1.1\r\nhost: events.test\r\naccept: text/event-stream\r\naccept-encoding: gzip\r\nconnection: close\r\n\r\n").unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: first") {
        let n = conn
            .read(&mut buf)
            .expect("the first event must arrive while the upstream is still open");
        assert!(
            n > 0,
            "closed before the first event: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&seen).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("content-type: text/event-stream"), "{head}");
    assert!(
        !head.contains("content-encoding: gzip"),
        "SSE must not be compressed: {head}"
    );
    assert!(!String::from_utf8_lossy(&seen).contains("data: last"));
    up.release.notify_one();
    let mut rest = Vec::new();
    let _ = conn.read_to_end(&mut rest);
    assert!(String::from_utf8_lossy(&rest).contains("data: last"));
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// A 100 MiB download streams through the proxy: the node's peak RSS grows by
/// far less than the body.
#[test]
fn large_download_streams_with_bounded_memory() {
    let node = proxy_node();
    let key = node.create_namespace("files");
    let up = Upstream::start("big");
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({"name": "dl", "hosts": ["files.test"], "upstream": {"instances": [up.url()]}}),
    );
    assert_eq!(s, 201, "{v}");
    let pid = node.child.as_ref().unwrap().id();
    // Warm up the proxy path so its one-time allocations are not counted.
    let _ = via(&node, "files.test", "GET", "/warm", &[], None);
    let before = rss_kib(pid, "VmHWM:");
    let mut conn = std::net::TcpStream::connect(&node.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(
        conn,
        "GET /big HTTP/1.1\r\nhost: files.test\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut total: u64 = 0;
    let mut head_done = false;
    let mut pending = Vec::new();
    let mut buf = vec![0u8; 256 << 10];
    let started = Instant::now();
    loop {
        let n = conn.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        if head_done {
            total += n as u64;
        } else {
            pending.extend_from_slice(&buf[..n]);
            if let Some(i) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&pending[..i]).to_ascii_lowercase();
                assert!(head.starts_with("http/1.1 200"), "{head}");
                assert!(head.contains(&format!("content-length: {BIG}")), "{head}");
                total += (pending.len() - i - 4) as u64;
                head_done = true;
            }
        }
    }
    assert_eq!(total, BIG);
    let after = rss_kib(pid, "VmHWM:");
    let grew_mib = (after.saturating_sub(before)) / 1024;
    eprintln!(
        "100 MiB through the proxy in {:?}; node peak RSS {} -> {} KiB (+{grew_mib} MiB)",
        started.elapsed(),
        before,
        after
    );
    assert!(
        grew_mib < 32,
        "peak RSS grew by {grew_mib} MiB for a 100 MiB body"
    );
}

/// A static file is read whole from the store and held until its client has
/// read it: twelve clients of one 24 MiB file, reading slowly, held twelve
/// copies (a site is public: anyone could). Now the answers sending one file
/// share one copy: the node grows by about one file, and every client still
/// gets the whole file, byte for byte.
#[test]
fn slow_clients_of_one_site_file_share_one_copy() {
    let node = TestNode::start();
    let key = node.create_namespace("bigsite");
    // Bytes that gzip cannot shrink, so the upload is the file's size.
    let mut file = vec![0u8; 24 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in file.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let tgz = tarball(&[("./index.html", 'f', b"home"), ("./big.bin", 'f', &file)]);
    let (s, b) = deploy_static(&node, &key, "dl", "dl.site.test", &tgz);
    assert_eq!(s, 201, "{b}");
    let (s, _, small) = via(&node, "dl.site.test", "GET", "/index.html", &[], None);
    assert_eq!((s, &small[..]), (200, &b"home"[..]));
    let pid = node.child.as_ref().unwrap().id();
    let before = rss_kib(pid, "VmRSS:");
    // Twelve clients ask for the file and read only the answer's head.
    let mut clients: Vec<std::net::TcpStream> = (0..12)
        .map(|_| {
            let mut c = std::net::TcpStream::connect(&node.addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            write!(
                c,
                "GET /big.bin HTTP/1.1\r\nhost: dl.site.test\r\nconnection: close\r\n\r\n"
            )
            .unwrap();
            let mut status = [0u8; 12];
            c.read_exact(&mut status).unwrap();
            assert_eq!(&status, b"HTTP/1.1 200");
            c
        })
        .collect();
    let held = rss_kib(pid, "VmRSS:");
    let grew_mib = held.saturating_sub(before) / 1024;
    eprintln!("twelve clients of a 24 MiB file: node RSS {before} -> {held} KiB (+{grew_mib} MiB)");
    assert!(
        grew_mib < 72,
        "the node grew by {grew_mib} MiB for twelve clients of one 24 MiB file"
    );
    // Each gets the whole file.
    for c in &mut clients {
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).unwrap();
        let at = rest.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        let head = String::from_utf8_lossy(&rest[..at]).to_ascii_lowercase();
        assert!(
            head.contains(&format!("content-length: {}", file.len())),
            "{head}"
        );
        assert!(rest[at + 4..] == file[..], "the whole file, byte for byte");
    }
}

/// A WebSocket upgrade through the proxy: 101, then frames both ways.
#[actix_rt::test]
async fn websocket_upgrade_is_relayed() {
    let node = proxy_node();
    let key = node.create_namespace("sockets");
    let up = Upstream::start("ws");
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({"name": "ws", "hosts": ["ws.test"], "upstream": {"instances": [up.url()]}}),
    );
    assert_eq!(s, 201, "{v}");
    let addr: std::net::SocketAddr = node.addr.parse().unwrap();
    let (res, mut sock) = awc::Client::new()
        .ws(format!("ws://ws.test:{}/ws", addr.port()))
        .address(addr)
        .connect()
        .await
        .expect("upgrade through the proxy");
    assert_eq!(res.status().as_u16(), 101);
    for i in 0..3 {
        sock.send(awc::ws::Message::Text(format!("hello {i}").into()))
            .await
            .unwrap();
        let f = tokio::time::timeout(Duration::from_secs(5), sock.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        match f {
            awc::ws::Frame::Text(t) => assert_eq!(t, format!("echo:hello {i}").as_bytes()),
            other => panic!("unexpected frame {other:?}"),
        }
    }
    sock.send(awc::ws::Message::Close(None)).await.unwrap();
}

fn curl_available() {
    for tool in ["curl", "openssl"] {
        let ok = Command::new(tool).arg("--version").output().is_ok()
            || Command::new(tool).arg("version").output().is_ok();
        assert!(
            ok,
            "{tool} not found: run scripts/test.sh (it installs curl and openssl) or apt-get install -y curl openssl"
        );
    }
}

pub(crate) fn make_cert(dir: &std::path::Path, cn: &str) {
    let out = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
        ])
        .arg("-keyout")
        .arg(dir.join("key.tmp"))
        .arg("-out")
        .arg(dir.join("cert.tmp"))
        .args([
            "-subj",
            &format!("/CN={cn}"),
            "-addext",
            "subjectAltName=DNS:a.test,DNS:b.test",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::rename(dir.join("key.tmp"), dir.join("key.pem")).unwrap();
    std::fs::rename(dir.join("cert.tmp"), dir.join("cert.pem")).unwrap();
}

/// Runs curl against the TLS node, connecting to `sni` with a `Host` header.
fn curl(node_addr: &str, sni: &str, host: &str, extra: &[&str]) -> (String, String) {
    let port = node_addr.rsplit(':').next().unwrap();
    let out = Command::new("curl")
        .args([
            "-sk",
            "-v",
            "-m",
            "10",
            "--resolve",
            &format!("{sni}:{port}:127.0.0.1"),
        ])
        .args(["-H", &format!("Host: {host}")])
        .args(extra)
        .args(["-o", "/dev/null", "-w", "%{http_code} %{http_version}"])
        .arg(format!("https://{sni}:{port}/v1/health"))
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// curl over TLS with HTTP/2: `method path` with `file` as the body and
/// `headers`; returns the status, the body it received and curl's errors.
fn curl_h2_upload(
    node_addr: &str,
    method: &str,
    path: &str,
    file: &std::path::Path,
    headers: &[&str],
) -> (String, String, String) {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "-k", "--http2", "-m", "30", "-X", method]);
    for h in headers {
        cmd.args(["-H", h]);
    }
    let out = cmd
        .arg("--data-binary")
        .arg(format!("@{}", file.display()))
        .args(["-w", "\n%{http_code}"])
        .arg(format!("https://{node_addr}{path}"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = stdout.rsplit_once('\n').unwrap_or(("", &stdout));
    (
        status.to_string(),
        body.to_string(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// HTTP/2 over TLS: refusals sent before the request body is read (404 of an
/// unknown route, 413 of an oversized KV value, 415 of a publish that is not
/// JSON) reach curl whole, status and JSON envelope, for bodies from 1 byte
/// to 4 MB, where curl used to get "Stream error in the HTTP/2 framing layer".
#[test]
fn http2_refusals_before_the_body_reach_the_client() {
    curl_available();
    let dir = tempfile::tempdir().unwrap();
    make_cert(dir.path(), "a.test");
    let node = TestNode::start_tls(dir.path(), "");
    let deadline = Instant::now() + Duration::from_secs(30);
    while curl(&node.addr, "a.test", "a.test", &["--http1.1"]).0 != "200 1.1" {
        assert!(Instant::now() < deadline, "TLS node never answered");
        std::thread::sleep(Duration::from_millis(100));
    }
    let op = format!("authorization: Bearer {OPERATOR_KEY}");
    let create = dir.path().join("create.json");
    std::fs::write(&create, r#"{"name":"h2"}"#).unwrap();
    let (status, body, err) = curl_h2_upload(
        &node.addr,
        "POST",
        "/v1/namespaces",
        &create,
        &[&op, "content-type: application/json"],
    );
    assert_eq!(status, "201", "{body} {err}");
    let key = json(&body)["api_key"].as_str().unwrap().to_string();
    let auth = format!("authorization: Bearer {key}");
    for size in [1usize, 1_500, 100_000, 1_000_000, 3_000_000, 4_000_000] {
        let file = dir.path().join(format!("body-{size}"));
        std::fs::write(&file, vec![b'x'; size]).unwrap();
        let mut cases = vec![
            ("POST", "/v1/no-such-route", "404", "NOT_FOUND"),
            (
                "POST",
                "/v1/pubsub/publish",
                "415",
                "UNSUPPORTED_MEDIA_TYPE",
            ),
        ];
        if size > 2_000_000 {
            cases.push(("PUT", "/v1/kv/x", "413", "PAYLOAD_TOO_LARGE"));
        }
        for (method, path, want, code) in cases {
            let (status, body, err) = curl_h2_upload(&node.addr, method, path, &file, &[&auth]);
            assert_eq!(
                status, want,
                "{method} {path} with {size} bytes: {body} {err}"
            );
            assert_eq!(
                json(&body)["error"]["code"].as_str(),
                Some(code),
                "{method} {path} with {size} bytes: {body}"
            );
        }
    }
}

/// TLS: a Host that disagrees with the SNI is 421; HTTP/2 by ALPN; h2c with
/// prior knowledge on a plain node; the certificate is reloaded from its files
/// without a restart.
#[test]
fn tls_sni_mismatch_http2_and_certificate_reload() {
    curl_available();
    let dir = tempfile::tempdir().unwrap();
    make_cert(dir.path(), "first.test");
    let node = TestNode::start_tls(dir.path(), "reload_check_seconds = 1\n");
    assert!(node.base.starts_with("https://"), "{}", node.base);
    let deadline = Instant::now() + Duration::from_secs(30);
    while curl(&node.addr, "a.test", "a.test", &["--http1.1"]).0 != "200 1.1" {
        assert!(Instant::now() < deadline, "TLS node never answered");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (out, _) = curl(&node.addr, "a.test", "a.test", &["--http2"]);
    assert_eq!(out, "200 2");
    let (out, _) = curl(&node.addr, "a.test", "b.test", &["--http1.1"]);
    assert_eq!(out, "421 1.1");
    let (out, _) = curl(&node.addr, "a.test", "b.test", &["--http2"]);
    assert_eq!(out, "421 2");
    let (_, verbose) = curl(&node.addr, "a.test", "a.test", &["--http1.1"]);
    assert!(verbose.contains("CN=first.test"), "{verbose}");

    // New files: served without a restart. The reload follows the files'
    // modification times: the new ones are set 2 s past the old ones, so the
    // change shows whatever the file system's time granularity.
    let mtime = |f: &str| {
        std::fs::metadata(dir.path().join(f))
            .and_then(|m| m.modified())
            .unwrap()
    };
    let newer = mtime("cert.pem").max(mtime("key.pem")) + Duration::from_secs(2);
    make_cert(dir.path(), "second.test");
    for f in ["key.pem", "cert.pem"] {
        std::fs::File::options()
            .write(true)
            .open(dir.path().join(f))
            .and_then(|file| file.set_modified(newer))
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (out, verbose) = curl(&node.addr, "a.test", "a.test", &["--http1.1"]);
        if verbose.contains("CN=second.test") {
            assert_eq!(out, "200 1.1");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "certificate never reloaded: {verbose}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A plain node speaks HTTP/2 with prior knowledge on the same port as HTTP/1.1.
    let plain = proxy_node();
    let out = Command::new("curl")
        .args([
            "-s",
            "--http2-prior-knowledge",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{http_version}",
        ])
        .arg(plain.url("/v1/health"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200 2");
    // ... and routes a deployment by the HTTP/2 `:authority`.
    let key = plain.create_namespace("h2");
    let up = Upstream::start("h2up");
    let (s, v) = deploy_json(
        &plain,
        &key,
        serde_json::json!({"name": "h2", "hosts": ["h2.test"], "upstream": {"instances": [up.url()]}}),
    );
    assert_eq!(s, 201, "{v}");
    let port = plain.addr.rsplit(':').next().unwrap();
    let out = Command::new("curl")
        .args([
            "-s",
            "--http2-prior-knowledge",
            "-w",
            "\n%{http_version}",
            "--resolve",
            &format!("h2.test:{port}:127.0.0.1"),
        ])
        .arg(format!("http://h2.test:{port}/over-h2?x=1"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, version) = text.rsplit_once('\n').unwrap();
    assert_eq!(version, "2");
    let e = json(body);
    assert_eq!(
        (e["id"].as_str(), e["path"].as_str()),
        (Some("h2up"), Some("/over-h2?x=1"))
    );
    assert_eq!(e["xfh"], "h2.test");
}

/// Routed upstream requests take the deployment fast path; the client bucket
/// still applies to them (here a client behind a trusted proxy: a burst of 5,
/// then 429 `RATE_LIMITED` with `Retry-After` and the request id echoed),
/// and another client is unaffected.
#[test]
fn routed_requests_keep_the_client_rate_limit() {
    let node = TestNode::start_with(NodeOpts {
        config: format!(
            "[rate_limit]\ngeneral_per_minute = 1\ngeneral_burst = 5\n\
             trusted_proxies = [\"127.0.0.1\"]\n[deploy]\n{ALLOW_LOOPBACK}"
        ),
        ..Default::default()
    });
    let key = node.create_namespace("limited");
    let up = Upstream::start("one");
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({"name": "app", "hosts": ["limited.test"], "upstream": {"instances": [up.url()]}}),
    );
    assert_eq!(s, 201, "{v}");
    let get = |client: &str| {
        via(
            &node,
            "limited.test",
            "GET",
            "/x",
            &[("x-forwarded-for", client), ("x-request-id", "rid-rl")],
            None,
        )
    };
    for i in 0..5 {
        let (s, _, b) = get("10.9.9.9");
        assert_eq!(s, 200, "request {i}: {}", String::from_utf8_lossy(&b));
    }
    let (s, h, b) = get("10.9.9.9");
    assert_eq!(s, 429, "{}", String::from_utf8_lossy(&b));
    assert_eq!(code(&b), "RATE_LIMITED");
    assert!(header(&h, "retry-after").is_some(), "{h:?}");
    assert_eq!(header(&h, "x-request-id"), Some("rid-rl"));
    let (s, _, _) = get("10.8.8.8");
    assert_eq!(s, 200, "another client has its own bucket");
}

/// Routed upstream requests draw on the namespace's anonymous bucket (not
/// its namespace bucket, which its API keeps): past its burst, 429
/// `ANONYMOUS_RATE_LIMITED` with Retry-After.
#[test]
fn routed_requests_keep_the_anonymous_rate_limit() {
    let node = TestNode::start_with(NodeOpts {
        config: format!(
            "[rate_limit]\ngeneral_per_minute = 1000000\ngeneral_burst = 100000\n\
             anonymous_per_minute = 1\nanonymous_burst = 3\n[deploy]\n{ALLOW_LOOPBACK}"
        ),
        ..Default::default()
    });
    let key = node.create_namespace("nsl");
    let up = Upstream::start("one");
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({"name": "app", "hosts": ["nsl.test"], "upstream": {"instances": [up.url()]}}),
    );
    assert_eq!(s, 201, "{v}");
    // The deploy (the owner's API) took none of the anonymous bucket's 3;
    // the proxied requests take them, then get 429.
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let (s, h, b) = via(&node, "nsl.test", "GET", "/x", &[], None);
        if s == 429 {
            assert_eq!(code(&b), "ANONYMOUS_RATE_LIMITED");
            assert!(header(&h, "retry-after").is_some(), "{h:?}");
        }
        statuses.push(s);
    }
    let want: Vec<u16> = (0..5).map(|i| if i < 3 { 200 } else { 429 }).collect();
    assert_eq!(statuses, want);
}

/// A raw HTTP/1.1 upstream on 127.0.0.1 answering `ok` to every request of
/// a connection (keep-alive), counting the connections it accepts. With
/// `close_idle_after`, it closes each connection that long after answering
/// (as an upstream's keep-alive timeout does).
/// The next request head read from `s` (`buf` keeps what was read past
/// it); None when the connection ended first. These requests have no body.
fn read_head(s: &mut std::net::TcpStream, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(buf.drain(..i + 4).collect());
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
        }
    }
}

fn counting_upstream(
    close_idle_after: Option<Duration>,
) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let n = accepted.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                loop {
                    // One request head (these requests have no body).
                    if read_head(&mut s, &mut buf).is_none() {
                        return;
                    }
                    if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                        .is_err()
                    {
                        return;
                    }
                    if let Some(d) = close_idle_after {
                        std::thread::sleep(d);
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), accepted)
}

/// The proxy keeps its upstream connections: sequential requests from new
/// client connections reuse one upstream connection per HTTP worker.
#[test]
fn upstream_connections_are_pooled() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[server]\nworkers = 1\n[deploy]\n{ALLOW_LOOPBACK}"),
        ..Default::default()
    });
    let key = node.create_namespace("pooled");
    let (url, accepted) = counting_upstream(None);
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({"name": "api", "hosts": ["pooled.test"], "upstream": {"instances": [url]}}),
    );
    assert_eq!(s, 201, "{v}");
    for _ in 0..6 {
        let (s, _, b) = via(&node, "pooled.test", "GET", "/x", &[], None);
        assert_eq!((s, b.as_slice()), (200, &b"ok"[..]));
    }
    // In cluster mode the other nodes route nothing here: one worker, one connection.
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// An upstream that closes idle keep-alive connections: a pooled connection
/// it closed is never used for a request (no 502), a new one is made.
#[test]
fn an_upstream_closing_idle_connections_costs_no_request() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[server]\nworkers = 1\n[deploy]\n{ALLOW_LOOPBACK}"),
        ..Default::default()
    });
    let key = node.create_namespace("closing");
    let (url, accepted) = counting_upstream(Some(Duration::from_millis(30)));
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({"name": "api", "hosts": ["closing.test"], "upstream": {"instances": [url]}}),
    );
    assert_eq!(s, 201, "{v}");
    for _ in 0..5 {
        let (s, _, b) = via(&node, "closing.test", "GET", "/x", &[], None);
        assert_eq!(
            (s, b.as_slice()),
            (200, &b"ok"[..]),
            "{}",
            String::from_utf8_lossy(&b)
        );
        std::thread::sleep(Duration::from_millis(150));
    }
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 5);
}

/// What a scripted upstream does with the next request it reads.
#[derive(Clone, Copy)]
enum Step {
    /// Writes these bytes and waits for the next request on the connection.
    Answer(&'static [u8]),
    /// Writes these bytes and closes the connection.
    AnswerAndClose(&'static [u8]),
    /// Closes the connection without answering.
    Close,
}

/// An upstream that takes each request head it reads, on whatever
/// connection, and does the next of `steps` (a request past the last gets
/// nothing and its connection closed). Returns its URL, the connections it
/// accepted and the request heads it read.
fn scripted_upstream(
    steps: Vec<Step>,
) -> (
    String,
    Arc<std::sync::atomic::AtomicUsize>,
    Arc<std::sync::Mutex<Vec<String>>>,
) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let heads = Arc::new(std::sync::Mutex::new(Vec::new()));
    let steps = Arc::new(std::sync::Mutex::new(
        steps.into_iter().collect::<std::collections::VecDeque<_>>(),
    ));
    let (n, seen) = (accepted.clone(), heads.clone());
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let (steps, seen) = (steps.clone(), seen.clone());
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                loop {
                    let Some(head) = read_head(&mut s, &mut buf) else {
                        return;
                    };
                    seen.lock()
                        .unwrap()
                        .push(String::from_utf8_lossy(&head).into_owned());
                    let step = steps.lock().unwrap().pop_front().unwrap_or(Step::Close);
                    match step {
                        Step::Answer(b) => {
                            if s.write_all(b).is_err() {
                                return;
                            }
                        }
                        Step::AnswerAndClose(b) => {
                            let _ = s.write_all(b);
                            return;
                        }
                        Step::Close => return,
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), accepted, heads)
}

/// A node with one HTTP worker (one pool of upstream connections) and one
/// deployment on `host` to the scripted upstream `url`.
fn node_to(host: &str, url: &str) -> TestNode {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[server]\nworkers = 1\n[deploy]\n{ALLOW_LOOPBACK}"),
        ..Default::default()
    });
    let key = node.create_namespace("scripted");
    let (s, v) = deploy_json(
        &node,
        &key,
        serde_json::json!({"name": "api", "hosts": [host], "upstream": {"instances": [url]}}),
    );
    assert_eq!(s, 201, "{v}");
    node
}

/// Every framing of an upstream's answer to a request without a body
/// reaches the client whole: chunks (with an extension and a trailer), a
/// HEAD answer keeping its length, a 304, interim 1xx answers skipped, a
/// body up to the upstream's close. The connection carries them all until
/// the upstream closes it; the next request then takes a new one.
#[test]
fn upstream_answers_of_every_framing_reach_the_client() {
    let (url, accepted, heads) = scripted_upstream(vec![
        Step::Answer(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Up: 1\r\n\r\n\
              5;x=y\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n",
        ),
        Step::Answer(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: text/plain\r\n\r\n"),
        Step::Answer(b"HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\n\r\n"),
        Step::Answer(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n\
              HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
        ),
        Step::AnswerAndClose(b"HTTP/1.1 200 OK\r\nX-Until: close\r\n\r\nuntil the close"),
        Step::Answer(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nnew"),
    ]);
    let node = node_to("framing.test", &url);
    let (s, h, b) = via(&node, "framing.test", "GET", "/chunks", &[], None);
    assert_eq!((s, b.as_slice()), (200, &b"hello world"[..]));
    assert_eq!(header(&h, "x-up"), Some("1"));
    let (s, h, b) = via(&node, "framing.test", "HEAD", "/head", &[], None);
    assert_eq!(s, 200);
    assert!(b.is_empty(), "{}", String::from_utf8_lossy(&b));
    assert_eq!(header(&h, "content-length"), Some("5"), "{h:?}");
    let (s, h, b) = via(
        &node,
        "framing.test",
        "GET",
        "/cached",
        &[("if-none-match", "\"v1\"")],
        None,
    );
    assert_eq!((s, header(&h, "etag"), b.len()), (304, Some("\"v1\""), 0));
    let (s, _, b) = via(&node, "framing.test", "GET", "/interim", &[], None);
    assert_eq!((s, b.as_slice()), (201, &b"ok"[..]));
    let (s, h, b) = via(&node, "framing.test", "GET", "/close", &[], None);
    assert_eq!((s, b.as_slice()), (200, &b"until the close"[..]));
    assert_eq!(header(&h, "x-until"), Some("close"));
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
    let (s, _, b) = via(&node, "framing.test", "GET", "/after", &[], None);
    assert_eq!((s, b.as_slice()), (200, &b"new"[..]));
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    let heads = heads.lock().unwrap();
    assert!(
        heads[1].starts_with("HEAD /head HTTP/1.1\r\n"),
        "{}",
        heads[1]
    );
    assert!(
        heads[2].contains("if-none-match: \"v1\"\r\n"),
        "{}",
        heads[2]
    );
}

/// An answer that cannot be framed safely is a 502 envelope, and its
/// connection is not used again: two different lengths, a length that is
/// not a number, a protocol switch nobody asked for, not HTTP at all.
#[test]
fn an_upstream_answer_that_cannot_be_framed_is_a_502() {
    let (url, accepted, _) = scripted_upstream(vec![
        Step::Answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc"),
        Step::Answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2x\r\n\r\nab"),
        Step::Answer(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n"),
        Step::Answer(b"SSH-2.0-OpenSSH_9.2\r\n\r\n"),
        Step::Answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
    ]);
    let node = node_to("bad.test", &url);
    for i in 0..4 {
        let (s, _, b) = via(&node, "bad.test", "GET", "/", &[], None);
        assert_eq!(
            (s, code(&b).as_str()),
            (502, "UPSTREAM_FAILED"),
            "answer {i}"
        );
    }
    let (s, _, b) = via(&node, "bad.test", "GET", "/", &[], None);
    assert_eq!((s, b.as_slice()), (200, &b"ok"[..]));
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 5);
}

/// A pooled connection the upstream closes as the next request arrives (it
/// read the request, then closed without a byte of answer): a GET is sent
/// again on a new connection, a POST is not (it may have acted) and is a
/// 502 envelope.
#[test]
fn a_connection_closed_under_a_request_retries_only_what_is_idempotent() {
    let ok: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
    let (url, accepted, heads) = scripted_upstream(vec![
        Step::Answer(ok),
        Step::Close,
        Step::Answer(ok),
        Step::Close,
        Step::Answer(ok),
    ]);
    let node = node_to("retry.test", &url);
    let (s, _, b) = via(&node, "retry.test", "GET", "/first", &[], None);
    assert_eq!((s, b.as_slice()), (200, &b"ok"[..]));
    let (s, _, b) = via(&node, "retry.test", "GET", "/again", &[], None);
    assert_eq!((s, b.as_slice()), (200, &b"ok"[..]));
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    let (s, _, b) = via(&node, "retry.test", "POST", "/once", &[], None);
    assert_eq!((s, code(&b).as_str()), (502, "UPSTREAM_FAILED"));
    let (s, _, b) = via(&node, "retry.test", "GET", "/last", &[], None);
    assert_eq!((s, b.as_slice()), (200, &b"ok"[..]));
    let heads = heads.lock().unwrap();
    let lines: Vec<&str> = heads.iter().map(|h| h.lines().next().unwrap()).collect();
    assert_eq!(
        lines,
        [
            "GET /first HTTP/1.1",
            "GET /again HTTP/1.1",
            "GET /again HTTP/1.1",
            "POST /once HTTP/1.1",
            "GET /last HTTP/1.1"
        ]
    );
}
