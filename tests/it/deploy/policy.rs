//! Route policies of proxied deployments (issue #40, docs/deployments.md
//! "Route policy"): credentials checked against the deployment's namespace
//! and grants, the identity headers the upstream gets (never a client's
//! forged ones), the credential dropped unless forwarded, a route's CORS
//! preflight, its rate limit, and bad policies refused with nothing stored.
//! Upstreams listen on 127.0.0.1.

use super::{deploy_json, proxy_node, via};
use crate::common::*;
use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use std::collections::BTreeMap;
use std::time::Duration;

/// An upstream that answers every request with its headers (lower-case
/// names; repeated ones joined with `|`), and counts what it served.
struct HeaderEcho {
    addr: String,
}

async fn headers(req: HttpRequest) -> HttpResponse {
    let mut m: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in req.headers() {
        let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
        m.entry(k.as_str().to_string())
            .and_modify(|e| {
                e.push('|');
                e.push_str(&v);
            })
            .or_insert(v);
    }
    HttpResponse::Ok()
        .insert_header(("access-control-allow-origin", "https://upstream-says.test"))
        .json(serde_json::json!({"path": req.path(), "headers": m}))
}

impl HeaderEcho {
    fn start() -> HeaderEcho {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let srv = HttpServer::new(|| App::new().default_service(web::to(headers)))
                    .workers(1)
                    .bind("127.0.0.1:0")
                    .unwrap();
                tx.send(srv.addrs()[0].to_string()).unwrap();
                srv.run().await.unwrap();
            });
        });
        HeaderEcho {
            addr: rx.recv_timeout(Duration::from_secs(10)).unwrap(),
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// A new API key of the namespace with these grants; returns (key, id).
fn key_with(node: &TestNode, owner: &str, name: &str, grants: &[&str]) -> (String, String) {
    let body = serde_json::json!({"name": name, "grants": grants}).to_string();
    let (s, b) = node.with_key(owner, "POST", "/v1/auth/api-keys", Some(body.as_bytes()));
    assert_eq!(s, 201, "{b}");
    let v = json(&b);
    (
        v["api_key"].as_str().unwrap().to_string(),
        v["key"]["id"].as_str().unwrap().to_string(),
    )
}

/// A JWT for an API key, and the subject the node sees for it.
fn jwt_for(node: &TestNode, key: &str) -> (String, String) {
    let body = format!("{{\"api_key\":\"{key}\"}}");
    let (s, b) = node.with_key("", "POST", "/v1/auth/token", Some(body.as_bytes()));
    assert_eq!(s, 200, "{b}");
    let token = json(&b)["access_token"].as_str().unwrap().to_string();
    let (s, b) = node.with_key(&token, "GET", "/v1/auth/whoami", None);
    assert_eq!(s, 200, "{b}");
    let sub = json(&b)["subject"].as_str().unwrap().to_string();
    (token, sub)
}

fn code(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(b);
    serde_json::from_str::<serde_json::Value>(&s)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
        .unwrap_or_default()
}

/// What the upstream saw: its headers.
fn seen(b: &[u8]) -> serde_json::Value {
    json(&String::from_utf8_lossy(b))["headers"].clone()
}

/// `auth: jwt` answers 401 (with WWW-Authenticate) without a token, 403 for a
/// token lacking the grant or of another namespace, and proxies with a good
/// one; the upstream sees the token's subject, never a forged one (on
/// `auth: none` either), and no credential unless `forward_credentials`. An
/// `api_key` route takes keys only and names the key.
#[test]
fn policy_routes_authenticate_and_vouch_for_the_caller() {
    let node = proxy_node();
    let owner = node.create_namespace("polauth");
    let other_owner = node.create_namespace("polother");
    let up = HeaderEcho::start();
    let (good_key, good_id) = key_with(&node, &owner, "good-key", &["deployments:read:*"]);
    let (weak_key, _) = key_with(&node, &owner, "weak", &["kv:read:*"]);
    let (other_key, _) = key_with(&node, &other_owner, "x", &["deployments:read:*"]);
    let (good_jwt, good_sub) = jwt_for(&node, &good_key);
    let (weak_jwt, _) = jwt_for(&node, &weak_key);
    let (other_jwt, _) = jwt_for(&node, &other_key);
    let (s, v) = deploy_json(
        &node,
        &owner,
        serde_json::json!({
            "name": "api", "hosts": ["polauth.test"],
            "upstream": {"instances": [up.url()]},
            "policy": {"auth": "jwt", "require_grants": ["deployments:read:api"]},
            "routes": [
                {"path_prefix": "/"},
                {"path_prefix": "/open", "policy": {}},
                {"path_prefix": "/keyed", "policy": {"auth": "api_key"}},
                {"path_prefix": "/fwd", "policy": {"auth": "any", "forward_credentials": true}},
                {"path_prefix": "/per-subject", "policy": {"auth": "any",
                    "rate_limit": {"requests_per_second": 1, "burst": 1, "key": "subject"}}}
            ]
        }),
    );
    assert_eq!(s, 201, "{v}");
    let host = "polauth.test";
    let bearer = |t: &str| format!("Bearer {t}");
    // No token: 401 with a challenge.
    let (s, h, b) = via(&node, host, "GET", "/x", &[], None);
    assert_eq!((s, code(&b).as_str()), (401, "MISSING_CREDENTIAL"));
    assert!(header(&h, "www-authenticate").is_some_and(|v| v.starts_with("Bearer")));
    // A token that does not verify: 401 too.
    let (s, h, _) = via(
        &node,
        host,
        "GET",
        "/x",
        &[("authorization", "Bearer not.a.jwt")],
        None,
    );
    assert_eq!(s, 401);
    assert!(header(&h, "www-authenticate").is_some());
    // A token without the grant, another namespace's token, an API key on a jwt route.
    let (s, _, b) = via(
        &node,
        host,
        "GET",
        "/x",
        &[("authorization", &bearer(&weak_jwt))],
        None,
    );
    assert_eq!((s, code(&b).as_str()), (403, "MISSING_GRANT"));
    let (s, _, b) = via(
        &node,
        host,
        "GET",
        "/x",
        &[("authorization", &bearer(&other_jwt))],
        None,
    );
    assert_eq!((s, code(&b).as_str()), (403, "NAMESPACE_MISMATCH"));
    let (s, _, _) = via(
        &node,
        host,
        "GET",
        "/x",
        &[("authorization", &bearer(&good_key))],
        None,
    );
    assert_eq!(s, 401, "an API key on an auth: jwt route");
    // A good token: proxied, with the vouched identity and without the credential.
    let (s, _, b) = via(
        &node,
        host,
        "GET",
        "/x",
        &[
            ("authorization", &bearer(&good_jwt)),
            ("x-meshgate-subject", "forged"),
            ("x-meshgate-namespace", "forged"),
            ("x-meshgate-grants", "*:*:*"),
            ("x-api-key", "mg_forged"),
        ],
        None,
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let u = seen(&b);
    assert_eq!(u["x-meshgate-subject"], good_sub.as_str());
    assert_eq!(u["x-meshgate-namespace"], "polauth");
    assert_eq!(u["x-meshgate-grants"], "deployments:read:*");
    assert_eq!(u["x-meshgate-key-name"], serde_json::Value::Null);
    assert_eq!(u["authorization"], serde_json::Value::Null);
    assert_eq!(u["x-api-key"], serde_json::Value::Null);
    // The policy holds on every node (the whole cluster in cluster mode).
    for base in node.every_base() {
        let url = format!("{base}/x");
        // A deployment routes on every node within about a second.
        wait_until(
            Duration::from_secs(10),
            &format!("the host routed by {base}"),
            || http("GET", &url, &[("host", host)], None).0 != 404,
        );
        let (s, _, _) = http("GET", &url, &[("host", host)], None);
        assert_eq!(s, 401, "no token through {base}");
        let (s, _, b) = http(
            "GET",
            &url,
            &[("host", host), ("authorization", &bearer(&weak_jwt))],
            None,
        );
        assert_eq!(
            (s, code(&b).as_str()),
            (403, "MISSING_GRANT"),
            "through {base}"
        );
        let (s, _, b) = http(
            "GET",
            &url,
            &[("host", host), ("authorization", &bearer(&good_jwt))],
            None,
        );
        assert_eq!(s, 200, "through {base}");
        assert_eq!(
            seen(&b)["x-meshgate-subject"],
            good_sub.as_str(),
            "through {base}"
        );
    }
    // The deployment's activity ring names the verified subject (the ring is
    // per node: in cluster mode the request and the read meet other nodes).
    if !crate::common::cluster_mode() {
        let (s, b) = node.with_key(&owner, "GET", "/v1/deployments/api/activity?limit=1", None);
        assert_eq!(s, 200, "{b}");
        let last = &json(&b)["requests"][0];
        assert_eq!(last["subject"], good_sub.as_str(), "{b}");
        assert!(!b.contains(&good_jwt), "the credential is never kept: {b}");
    }
    // auth: none: today's behaviour, but forged identity headers never pass.
    let (s, _, b) = via(
        &node,
        host,
        "GET",
        "/open/x",
        &[
            ("authorization", "Bearer for-the-upstream"),
            ("x-meshgate-subject", "forged"),
            ("X-Meshgate-Key-Name", "forged"),
        ],
        None,
    );
    assert_eq!(s, 200);
    let u = seen(&b);
    assert_eq!(u["x-meshgate-subject"], serde_json::Value::Null);
    assert_eq!(u["x-meshgate-key-name"], serde_json::Value::Null);
    assert_eq!(u["authorization"], "Bearer for-the-upstream");
    // auth: api_key: a key (X-API-Key), named; a JWT is refused.
    let (s, _, b) = via(
        &node,
        host,
        "GET",
        "/keyed",
        &[("x-api-key", &good_key)],
        None,
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let u = seen(&b);
    assert_eq!(u["x-meshgate-subject"], format!("key:{good_id}").as_str());
    assert_eq!(u["x-meshgate-key-name"], "good-key");
    assert_eq!(u["x-api-key"], serde_json::Value::Null);
    let (s, _, _) = via(
        &node,
        host,
        "GET",
        "/keyed",
        &[("authorization", &bearer(&good_jwt))],
        None,
    );
    assert_eq!(s, 401);
    let (s, _, b) = via(
        &node,
        host,
        "GET",
        "/keyed",
        &[("x-api-key", &other_key)],
        None,
    );
    assert_eq!((s, code(&b).as_str()), (403, "NAMESPACE_MISMATCH"));
    // forward_credentials: the upstream gets the token as sent.
    let (s, _, b) = via(
        &node,
        host,
        "GET",
        "/fwd",
        &[("authorization", &bearer(&good_jwt))],
        None,
    );
    assert_eq!(s, 200);
    let u = seen(&b);
    assert_eq!(u["authorization"], bearer(&good_jwt).as_str());
    assert_eq!(u["x-meshgate-subject"], good_sub.as_str());
    // key: subject: one subject's bucket runs out; another subject's first
    // request still passes (its bucket is full, whatever the time).
    let sub_get = |cred: &str| {
        via(
            &node,
            host,
            "GET",
            "/per-subject",
            &[("authorization", &bearer(cred))],
            None,
        )
    };
    let refused = (0..20).find_map(|_| {
        let (s, h, b) = sub_get(&good_jwt);
        (s == 429).then(|| (code(&b), header(&h, "retry-after").is_some()))
    });
    assert_eq!(refused, Some(("ROUTE_RATE_LIMITED".to_string(), true)));
    assert_eq!(
        sub_get(&weak_key).0,
        200,
        "another subject has its own bucket"
    );
}

/// A route's CORS override answers preflights itself and replaces the
/// upstream's CORS headers; a route's rate limit answers 429 with Retry-After.
#[test]
fn policy_cors_preflight_and_route_rate_limit() {
    let node = proxy_node();
    let owner = node.create_namespace("polcors");
    let up = HeaderEcho::start();
    let (s, v) = deploy_json(
        &node,
        &owner,
        serde_json::json!({
            "name": "web", "hosts": ["polcors.test"],
            "upstream": {"instances": [up.url()]},
            "routes": [
                {"path_prefix": "/cors", "policy": {"cors": {
                    "origins": ["https://App.test"], "methods": ["GET", "POST"],
                    "headers": ["content-type"], "credentials": true, "max_age": 60}}},
                {"path_prefix": "/limited", "policy": {"rate_limit": {"requests_per_second": 1, "burst": 1}}}
            ]
        }),
    );
    assert_eq!(s, 201, "{v}");
    let host = "polcors.test";
    let (s, h, _) = via(
        &node,
        host,
        "OPTIONS",
        "/cors/x",
        &[
            ("origin", "https://app.test"),
            ("access-control-request-method", "POST"),
        ],
        None,
    );
    assert_eq!(s, 204);
    assert_eq!(
        header(&h, "access-control-allow-origin"),
        Some("https://app.test")
    );
    assert_eq!(
        header(&h, "access-control-allow-methods"),
        Some("GET, POST")
    );
    assert_eq!(
        header(&h, "access-control-allow-headers"),
        Some("content-type")
    );
    assert_eq!(header(&h, "access-control-allow-credentials"), Some("true"));
    assert_eq!(header(&h, "access-control-max-age"), Some("60"));
    let (s, _, b) = via(
        &node,
        host,
        "OPTIONS",
        "/cors/x",
        &[
            ("origin", "https://evil.test"),
            ("access-control-request-method", "POST"),
        ],
        None,
    );
    assert_eq!((s, code(&b).as_str()), (403, "CORS_ORIGIN_DENIED"));
    // A normal answer: the override's headers, not the upstream's.
    let (s, h, _) = via(
        &node,
        host,
        "GET",
        "/cors/x",
        &[("origin", "https://app.test")],
        None,
    );
    assert_eq!(s, 200);
    assert_eq!(
        header(&h, "access-control-allow-origin"),
        Some("https://app.test")
    );
    let (s, h, _) = via(
        &node,
        host,
        "GET",
        "/cors/x",
        &[("origin", "https://evil.test")],
        None,
    );
    assert_eq!(s, 200);
    assert_eq!(header(&h, "access-control-allow-origin"), None);
    // Without an override the upstream's CORS passes as it is.
    let (_, h, _) = via(
        &node,
        host,
        "GET",
        "/limited",
        &[("origin", "https://app.test")],
        None,
    );
    assert_eq!(
        header(&h, "access-control-allow-origin"),
        Some("https://upstream-says.test")
    );
    // The route's bucket (burst 1) runs out within a few requests.
    let mut refused = None;
    for _ in 0..20 {
        let (s, h, b) = via(&node, host, "GET", "/limited", &[], None);
        if s == 429 {
            refused = Some((code(&b), header(&h, "retry-after").map(str::to_string)));
            break;
        }
        assert_eq!(s, 200);
    }
    let (c, retry) = refused.expect("a 429 from the route's bucket");
    assert_eq!(c, "ROUTE_RATE_LIMITED");
    assert!(retry.is_some_and(|r| r.parse::<u64>().is_ok_and(|n| n >= 1)));
    // Another route of the host has no such bucket.
    let (s, _, _) = via(&node, host, "GET", "/cors/y", &[], None);
    assert_eq!(s, 200);
}

/// Each bad policy is 400 with the envelope, and the deployment is unchanged.
#[test]
fn bad_policies_are_refused_and_change_nothing() {
    let node = proxy_node();
    let owner = node.create_namespace("polbad");
    let up = HeaderEcho::start();
    let base = || {
        serde_json::json!({
            "name": "svc", "hosts": ["polbad.test"],
            "upstream": {"instances": [up.url()]},
        })
    };
    let (s, v) = deploy_json(&node, &owner, base());
    assert_eq!(s, 201, "{v}");
    let with = |k: &str, p: serde_json::Value| {
        let mut b = base();
        b[k] = p;
        b
    };
    for (i, body) in [
        with("policy", serde_json::json!({"auth": "basic"})),
        with(
            "policy",
            serde_json::json!({"auth": "jwt", "require_grants": ["not-a-grant"]}),
        ),
        with(
            "policy",
            serde_json::json!({"auth": "jwt", "require_grants": ["kv:fly:*"]}),
        ),
        with(
            "routes",
            serde_json::json!([{"policy": {"cors": {"origins": ["app.test"]}}}]),
        ),
        with(
            "routes",
            serde_json::json!([{"policy": {"cors": {"origins": ["https://app.test/x"]}}}]),
        ),
        with(
            "policy",
            serde_json::json!({"rate_limit": {"requests_per_second": 0}}),
        ),
        with(
            "policy",
            serde_json::json!({"rate_limit": {"requests_per_second": 5, "burst": 0}}),
        ),
        with(
            "policy",
            serde_json::json!({"auth": "jwt", "colour": "red"}),
        ),
        with(
            "routes",
            serde_json::json!([{"policy": {"auth": "any", "cors": {"origins": ["*"], "max": 1}}}]),
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let (s, v) = deploy_json(&node, &owner, body);
        assert_eq!(s, 400, "case {i}: {v}");
        assert_eq!(v["ok"], false, "case {i}: {v}");
        assert!(v["error"]["code"].is_string(), "case {i}: {v}");
    }
    // Still one version, still open (auth: none).
    let (s, b) = node.with_key(&owner, "GET", "/v1/deployments/svc/versions", None);
    assert_eq!(s, 200, "{b}");
    assert_eq!(json(&b)["versions"].as_array().unwrap().len(), 1, "{b}");
    let (s, _, _) = via(&node, "polbad.test", "GET", "/", &[], None);
    assert_eq!(s, 200);
}

/// A static site takes a default `policy` part: an `api_key` site answers
/// 401 without a key and serves with one; a bad part is 400.
#[test]
fn a_static_site_takes_a_policy_part() {
    let node = proxy_node();
    let owner = node.create_namespace("polsite");
    let tgz = super::tarball(&[("index.html", 'f', b"members only")]);
    let post = |policy: &str| {
        let (ct, body) = super::multipart(&[
            ("name", b"www".as_slice()),
            ("hosts", b"polsite.test".as_slice()),
            ("policy", policy.as_bytes()),
            ("tarball", &tgz),
        ]);
        let auth = format!("Bearer {owner}");
        let (s, _, b) = http(
            "POST",
            &node.url("/v1/deployments"),
            &[("authorization", &auth), ("content-type", &ct)],
            Some(&body),
        );
        (s, String::from_utf8_lossy(&b).into_owned())
    };
    let (s, b) = post(r#"{"auth": "sometimes"}"#);
    assert_eq!(
        (s, code(b.as_bytes()).as_str()),
        (400, "INVALID_POLICY"),
        "{b}"
    );
    let (s, b) = post(r#"{"auth": "api_key"}"#);
    assert_eq!(s, 201, "{b}");
    let (s, h, _) = via(&node, "polsite.test", "GET", "/", &[], None);
    assert_eq!(s, 401);
    assert!(header(&h, "www-authenticate").is_some());
    let (s, _, b) = via(
        &node,
        "polsite.test",
        "GET",
        "/",
        &[("x-api-key", &owner)],
        None,
    );
    assert_eq!((s, b.as_slice()), (200, b"members only".as_slice()));
}

/// A WebSocket upstream: on each upgrade it sends one text frame, what it
/// saw (path with query, the subject header, `Authorization`), then closes.
fn ws_seen_upstream() -> String {
    ws_seen_upstream_for(2)
}

/// [`ws_seen_upstream`] holding each socket open `hold` seconds.
fn ws_seen_upstream_for(hold: u64) -> String {
    let seen_ws = move |req: HttpRequest, body: web::Payload| seen_ws(req, body, hold);
    async fn seen_ws(
        req: HttpRequest,
        body: web::Payload,
        hold: u64,
    ) -> actix_web::Result<HttpResponse> {
        let h = |n: &str| {
            req.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let saw = serde_json::json!({
            "path": req.uri().path_and_query().map(|p| p.as_str()).unwrap_or(""),
            "subject": h("x-meshgate-subject"),
            "authorization": h("authorization"),
        })
        .to_string();
        let (resp, mut session, _stream) = actix_ws::handle(&req, body)?;
        actix_web::rt::spawn(async move {
            let _ = session.text(saw).await;
            tokio::time::sleep(Duration::from_secs(hold)).await;
            let _ = session.close(None).await;
        });
        Ok(resp)
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let srv = HttpServer::new(move || App::new().default_service(web::to(seen_ws)))
                .workers(1)
                .bind("127.0.0.1:0")
                .unwrap();
            tx.send(srv.addrs()[0].to_string()).unwrap();
            srv.run().await.unwrap();
        });
    });
    format!(
        "http://{}",
        rx.recv_timeout(Duration::from_secs(10)).unwrap()
    )
}

/// A WebSocket upgrade through `node` to `host` `path`: the status, and on
/// 101 the upstream's first text frame as JSON.
async fn ws_through(node: &TestNode, host: &str, path: &str) -> (u16, serde_json::Value) {
    use futures_util::StreamExt as _;
    let addr: std::net::SocketAddr = node.addr.parse().unwrap();
    match awc::Client::new()
        .ws(format!("ws://{host}:{}{path}", addr.port()))
        .address(addr)
        .connect()
        .await
    {
        Ok((res, mut sock)) => {
            let f = tokio::time::timeout(Duration::from_secs(10), sock.next())
                .await
                .expect("a frame from the upstream")
                .expect("a frame")
                .expect("a good frame");
            let awc::ws::Frame::Text(t) = f else {
                panic!("unexpected frame {f:?}")
            };
            (res.status().as_u16(), json(&String::from_utf8_lossy(&t)))
        }
        Err(awc::error::WsClientError::InvalidResponseStatus(s)) => {
            (s.as_u16(), serde_json::Value::Null)
        }
        Err(e) => panic!("upgrade failed: {e}"),
    }
}

/// On a route with `auth`, a WebSocket upgrade may bring its credential as
/// `?token=` (browsers cannot set headers on a WebSocket): without one 401,
/// a bad one 401, a good one 101 and the upstream sees the subject and no
/// token in its query (unless `forward_credentials`). A plain request's
/// `?token=` is no credential.
#[actix_rt::test]
async fn websocket_upgrades_take_a_query_token() {
    let node = proxy_node();
    let owner = node.create_namespace("polws");
    let up = ws_seen_upstream();
    let (key, _) = key_with(&node, &owner, "ws", &["deployments:read:*"]);
    let (token, sub) = jwt_for(&node, &key);
    let (s, v) = deploy_json(
        &node,
        &owner,
        serde_json::json!({
            "name": "sock", "hosts": ["polws.test"],
            "upstream": {"instances": [up]},
            "policy": {"auth": "jwt"},
            "routes": [
                {"path_prefix": "/"},
                {"path_prefix": "/keyed", "policy": {"auth": "api_key"}},
                {"path_prefix": "/fwd", "policy": {"auth": "any", "forward_credentials": true}}
            ]
        }),
    );
    assert_eq!(s, 201, "{v}");
    let host = "polws.test";
    assert_eq!(ws_through(&node, host, "/ws?a=1").await.0, 401);
    assert_eq!(ws_through(&node, host, "/ws?token=garbage").await.0, 401);
    assert_eq!(ws_through(&node, host, "/ws?token=").await.0, 401);
    // An API key as ?token= on a jwt route is the wrong kind: 401.
    assert_eq!(
        ws_through(&node, host, &format!("/ws?token={key}")).await.0,
        401
    );
    let (s, saw) = ws_through(&node, host, &format!("/ws?a=1&token={token}&b=2")).await;
    assert_eq!(s, 101);
    assert_eq!(saw["path"], "/ws?a=1&b=2", "{saw}");
    assert_eq!(saw["subject"], sub.as_str(), "{saw}");
    assert_eq!(saw["authorization"], serde_json::Value::Null, "{saw}");
    let (s, saw) = ws_through(&node, host, &format!("/ws?token={token}")).await;
    assert_eq!((s, saw["path"].as_str()), (101, Some("/ws")), "{saw}");
    // An API key on an api_key route.
    let (s, saw) = ws_through(&node, host, &format!("/keyed/ws?token={key}")).await;
    assert_eq!((s, saw["path"].as_str()), (101, Some("/keyed/ws")), "{saw}");
    // forward_credentials: the token stays in the query.
    let (s, saw) = ws_through(&node, host, &format!("/fwd/ws?token={token}&a=1")).await;
    assert_eq!(s, 101);
    assert_eq!(
        saw["path"].as_str(),
        Some(format!("/fwd/ws?token={token}&a=1").as_str()),
        "{saw}"
    );
    assert_eq!(saw["subject"], sub.as_str(), "{saw}");
    // Not an upgrade: ?token= is no credential.
    let (s, _, b) = via(&node, host, "GET", &format!("/x?token={token}"), &[], None);
    assert_eq!((s, code(&b).as_str()), (401, "MISSING_CREDENTIAL"));
}

/// A tunnel opened with a token ends with its session: after
/// `DELETE /v1/auth/sessions/{sid}`, the next frame the client sends is not
/// passed on and the tunnel closes with 4001 (docs/auth.md, "Sessions and
/// devices"); a new upgrade with the token is 401.
#[actix_rt::test]
async fn websocket_tunnels_end_with_their_session() {
    use futures_util::{SinkExt as _, StreamExt as _};
    let node = proxy_node();
    let owner = node.create_namespace("polwsend");
    let up = ws_seen_upstream_for(60);
    let (key, _) = key_with(&node, &owner, "ws", &["deployments:read:*"]);
    let (token, _) = jwt_for(&node, &key);
    let (s, b) = node.with_key(&token, "GET", "/v1/auth/whoami", None);
    assert_eq!(s, 200);
    let sid = json(&b)["session_id"].as_str().unwrap().to_string();
    let (s, v) = deploy_json(
        &node,
        &owner,
        serde_json::json!({
            "name": "sock", "hosts": ["polwsend.test"],
            "upstream": {"instances": [up]},
            "policy": {"auth": "jwt"}
        }),
    );
    assert_eq!(s, 201, "{v}");
    let addr: std::net::SocketAddr = node.addr.parse().unwrap();
    let (res, mut sock) = awc::Client::new()
        .ws(format!(
            "ws://polwsend.test:{}/ws?token={token}",
            addr.port()
        ))
        .address(addr)
        .connect()
        .await
        .expect("upgrade");
    assert_eq!(res.status().as_u16(), 101);
    let first = sock.next().await.unwrap().unwrap();
    assert!(matches!(first, awc::ws::Frame::Text(_)), "{first:?}");
    let (s, b) = node.with_key(&token, "DELETE", &format!("/v1/auth/sessions/{sid}"), None);
    assert_eq!(s, 200, "{b}");
    sock.send(awc::ws::Message::Text("after the end".into()))
        .await
        .unwrap();
    let code = loop {
        match tokio::time::timeout(Duration::from_secs(20), sock.next())
            .await
            .expect("a close within 20 s")
        {
            Some(Ok(awc::ws::Frame::Close(r))) => break r.map(|r| u16::from(r.code)),
            Some(Ok(_)) => {}
            other => panic!("no close frame: {other:?}"),
        }
    };
    assert_eq!(code, Some(4001));
    assert_eq!(
        ws_through(&node, "polwsend.test", &format!("/ws?token={token}"))
            .await
            .0,
        401
    );
}

/// A route's bucket lives with the deployment's version in the index: it
/// is not refilled when another deployment changes (the index is rebuilt),
/// and a new version of its own deployment starts with a full one.
#[test]
fn route_buckets_survive_other_changes_and_refill_with_a_new_version() {
    let node = proxy_node();
    let owner = node.create_namespace("polbucket");
    let up = HeaderEcho::start();
    let limited = serde_json::json!({
        "name": "svc", "hosts": ["polbucket.test"],
        "upstream": {"instances": [up.url()]},
        "policy": {"rate_limit": {"requests_per_second": 1, "burst": 30}}
    });
    let (s, v) = deploy_json(&node, &owner, limited.clone());
    assert_eq!(s, 201, "{v}");
    let host = "polbucket.test";
    let get = || via(&node, host, "GET", "/x", &[], None).0;
    for i in 0..20 {
        assert_eq!(get(), 200, "request {i} within the burst");
    }
    // Another deployment: the index is rebuilt, this bucket kept (about 10
    // tokens left, plus one a second since).
    let (s, v) = deploy_json(
        &node,
        &owner,
        serde_json::json!({"name": "other", "hosts": ["polother.test"],
            "upstream": {"instances": [up.url()]}}),
    );
    assert_eq!(s, 201, "{v}");
    let passed = (0..15).take_while(|_| get() == 200).count();
    assert!(
        passed < 15,
        "the bucket was refilled by another deployment's change"
    );
    assert_eq!(get(), 429);
    // A new version of this deployment: a full bucket.
    let (s, v) = deploy_json(&node, &owner, limited);
    assert_eq!(s, 201, "{v}");
    for i in 0..25 {
        assert_eq!(get(), 200, "request {i} of the new version");
    }
}
