//! The HTTP API as a new user meets it: a refused body names the parts or
//! fields its route takes; a quota's refusal says what frees it and is not
//! retryable; a created key is answered in one shape whether it comes with
//! a namespace or alone; a deployment is answered in one shape by create,
//! show and rollback; a namespace's stats carry its own deployments' route
//! figures and no other namespace's.

use crate::common::*;
use crate::deploy::{deploy_static, tarball, via};
use serde_json::Value;

/// The error envelope of `body`: (code, retryable, message); `ok` is false.
fn envelope(body: &str) -> (String, bool, String) {
    let v = json(body);
    assert_eq!(v["ok"], false, "{body}");
    let e = &v["error"];
    (
        e["code"].as_str().unwrap_or_default().to_string(),
        e["retryable"]
            .as_bool()
            .unwrap_or_else(|| panic!("no retryable: {body}")),
        e["message"].as_str().unwrap_or_default().to_string(),
    )
}

/// A request with the credential `key` and these headers: (status, headers, body).
fn call(
    node: &TestNode,
    key: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, Vec<(String, String)>, String) {
    let auth = format!("Bearer {key}");
    let mut h = vec![("authorization", auth.as_str())];
    h.extend_from_slice(headers);
    let (s, h, b) = http(method, &node.url(path), &h, body);
    (s, h, String::from_utf8_lossy(&b).into_owned())
}

const BOUNDARY: &str = "mgapiboundary3";
const FORM: (&str, &str) = (
    "content-type",
    "multipart/form-data; boundary=mgapiboundary3",
);

/// A `multipart/form-data` body of these parts.
fn multipart(parts: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = Vec::new();
    for (name, data) in parts {
        b.extend_from_slice(
            format!(
                "--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"{name}\"; \
                 filename=\"{name}\"\r\n\r\n"
            )
            .as_bytes(),
        );
        b.extend_from_slice(data);
        b.extend_from_slice(b"\r\n");
    }
    b.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    b
}

fn echo_wasm() -> Vec<u8> {
    std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/functions/echo.wasm"
    ))
    .unwrap()
}

/// A 400 naming `what`, with every one of `takes` in its message.
fn names_what_it_takes(
    (s, _, b): (u16, Vec<(String, String)>, String),
    status: u16,
    code: &str,
    takes: &[&str],
) -> String {
    assert_eq!(s, status, "{b}");
    let (c, retryable, message) = envelope(&b);
    assert_eq!((c.as_str(), retryable), (code, false), "{b}");
    for t in takes {
        assert!(message.contains(t), "{t:?} not named: {message}");
    }
    message
}

/// A function deploy sent as JSON is told to send multipart with the parts
/// it takes (`wasm`, not `file`); following that with a wrong part, or
/// without one, names the parts again; a static-site deploy and the JSON
/// routes name theirs (fields, or quota names); a body that is not JSON at
/// all names the fields too. Each is the envelope, not retryable.
#[test]
fn body_refusals_name_what_the_route_takes() {
    let node = TestNode::start();
    let key = node.create_namespace("forms");
    let fn_parts = [
        "name",
        "wasm",
        "memory_limit_mb",
        "timeout_seconds",
        "is_public",
        "metadata",
    ];

    // Not multipart: the hint shows the right parts.
    let m = names_what_it_takes(
        call(
            &node,
            &key,
            "POST",
            "/v1/functions",
            &[("content-type", "application/json")],
            Some(br#"{"name":"echo"}"#),
        ),
        400,
        "MALFORMED_MULTIPART",
        &fn_parts,
    );
    assert!(m.contains("-F wasm=@"), "{m}");
    assert!(!m.contains("file=@"), "the old hint: {m}");

    // The part a user guessed from a generic hint.
    let echo = echo_wasm();
    let m = names_what_it_takes(
        call(
            &node,
            &key,
            "POST",
            "/v1/functions",
            &[FORM],
            Some(&multipart(&[("name", b"echo"), ("file", &echo)])),
        ),
        400,
        "UNKNOWN_PART",
        &fn_parts,
    );
    assert!(m.starts_with("unknown part \"file\";"), "{m}");
    let m = names_what_it_takes(
        call(
            &node,
            &key,
            "POST",
            "/v1/functions",
            &[FORM],
            Some(&multipart(&[("name", b"echo")])),
        ),
        400,
        "MISSING_PART",
        &fn_parts,
    );
    assert!(m.starts_with("the \"wasm\" part is required;"), "{m}");
    // The parts the hint names deploy.
    let (s, _, b) = call(
        &node,
        &key,
        "POST",
        "/v1/functions",
        &[FORM],
        Some(&multipart(&[("name", b"echo"), ("wasm", &echo)])),
    );
    assert_eq!(s, 201, "{b}");

    // A static site's parts.
    let site = ["name", "hosts", "tarball", "routes", "policy"];
    names_what_it_takes(
        call(
            &node,
            &key,
            "POST",
            "/v1/deployments",
            &[FORM],
            Some(&multipart(&[
                ("name", b"s"),
                ("hosts", b"s.forms.test"),
                ("site", b"x"),
            ])),
        ),
        400,
        "UNKNOWN_PART",
        &site,
    );
    names_what_it_takes(
        call(
            &node,
            &key,
            "POST",
            "/v1/deployments",
            &[FORM],
            Some(&multipart(&[("name", b"s"), ("hosts", b"s.forms.test")])),
        ),
        400,
        "MISSING_PART",
        &site,
    );
    // An upstream deployment's fields (a typo: `host`), and the site's parts.
    names_what_it_takes(
        call(
            &node,
            &key,
            "POST",
            "/v1/deployments",
            &[("content-type", "application/json")],
            Some(br#"{"name":"s","host":["s.forms.test"]}"#),
        ),
        400,
        "INVALID_JSON",
        &["name, hosts, upstream, routes, policy", "tarball"],
    );
    names_what_it_takes(
        call(
            &node,
            &key,
            "POST",
            "/v1/deployments/s/rollback",
            &[],
            Some(br#"{"to": 1}"#),
        ),
        400,
        "INVALID_JSON",
        &["with the fields version"],
    );

    // JSON routes: an unknown field, a missing one, the wrong media type,
    // a body that is no JSON.
    let key_fields = "POST /v1/auth/api-keys takes a JSON object with the fields \
                      name, role, grants, expires_in_days, kind";
    let json_ct = [("content-type", "application/json")];
    names_what_it_takes(
        call(
            &node,
            &key,
            "POST",
            "/v1/auth/api-keys",
            &json_ct,
            Some(br#"{"roles":"reader"}"#),
        ),
        400,
        "MALFORMED_JSON",
        &["roles", key_fields],
    );
    names_what_it_takes(
        call(
            &node,
            &key,
            "POST",
            "/v1/auth/api-keys",
            &json_ct,
            Some(b"role=reader"),
        ),
        400,
        "MALFORMED_JSON",
        &[key_fields],
    );
    names_what_it_takes(
        call(
            &node,
            &key,
            "POST",
            "/v1/auth/api-keys",
            &[("content-type", "text/plain")],
            Some(br#"{"role":"reader"}"#),
        ),
        415,
        "UNSUPPORTED_MEDIA_TYPE",
        &[key_fields],
    );
    names_what_it_takes(
        call(
            &node,
            OPERATOR_KEY,
            "POST",
            "/v1/namespaces",
            &json_ct,
            Some(br#"{"nmae":"x"}"#),
        ),
        400,
        "MALFORMED_JSON",
        &[
            "POST /v1/namespaces takes a JSON object with the fields name, members, \
           rate_per_minute, rate_burst",
        ],
    );
    names_what_it_takes(
        call(
            &node,
            &key,
            "POST",
            "/v1/pubsub/publish",
            &json_ct,
            Some(br#"{"topic":"t","data":"aGk="}"#),
        ),
        400,
        "MALFORMED_JSON",
        &["POST /v1/pubsub/publish takes a JSON object with the fields topic, data_base64"],
    );
    names_what_it_takes(
        call(
            &node,
            OPERATOR_KEY,
            "PUT",
            "/v1/namespaces/forms/quotas",
            &json_ct,
            Some(br#"{"kv_keys":"lots"}"#),
        ),
        400,
        "MALFORMED_JSON",
        &[
            "PUT /v1/namespaces/{namespace}/quotas takes",
            "history_topics",
        ],
    );
    names_what_it_takes(
        call(
            &node,
            OPERATOR_KEY,
            "PUT",
            "/v1/namespaces/forms/quotas",
            &json_ct,
            Some(br#"{"kv_key":5}"#),
        ),
        400,
        "BAD_REQUEST",
        &["\"kv_key\" is not a quota", "kv_keys", "history_topics"],
    );
}

/// Quotas for [`quota_refusals_say_what_frees_them_and_are_not_retryable`].
const QUOTAS: &str = "[quotas]\nkv_bytes = 100\nkv_keys = 1\nfunctions = 1\n";

/// A write past a count quota (KV keys, functions) is 429 and past a byte
/// quota 413, `QUOTA_EXCEEDED`, `retryable: false`, without `Retry-After`,
/// its message naming the quota, what frees it and the operator; once
/// something is deleted the same write passes.
#[test]
fn quota_refusals_say_what_frees_them_and_are_not_retryable() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}{QUOTAS}"),
        ..Default::default()
    });
    let key = node.create_namespace("quota");
    let refused = |(s, h, b): (u16, Vec<(String, String)>, String), status: u16, names: &[&str]| {
        assert_eq!(s, status, "{b}");
        assert_eq!(header(&h, "retry-after"), None, "{h:?}");
        let (code, retryable, message) = envelope(&b);
        assert_eq!((code.as_str(), retryable), ("QUOTA_EXCEEDED", false), "{b}");
        for n in names {
            assert!(message.contains(n), "{n:?} not in: {message}");
        }
    };
    let put = |k: &str, v: &[u8]| call(&node, &key, "PUT", &format!("/v1/kv/{k}"), &[], Some(v));
    assert_eq!(put("a", b"1").0, 200);
    refused(
        put("b", b"2"),
        429,
        &[
            "quota kv_keys exceeded: 1 of 1 used",
            "delete KV keys",
            "ask the operator to raise the quota",
        ],
    );
    refused(
        put("a", &[b'x'; 200]),
        413,
        &["quota kv_bytes exceeded", "delete KV keys", "operator"],
    );
    assert_eq!(call(&node, &key, "DELETE", "/v1/kv/a", &[], None).0, 200);
    assert_eq!(put("b", b"2").0, 200, "deleting made room");

    let echo = echo_wasm();
    let deploy = |name: &[u8]| {
        call(
            &node,
            &key,
            "POST",
            "/v1/functions",
            &[FORM],
            Some(&multipart(&[("name", name), ("wasm", &echo)])),
        )
    };
    assert_eq!(deploy(b"one").0, 201);
    refused(
        deploy(b"two"),
        429,
        &["quota functions exceeded", "delete a function", "operator"],
    );
    assert_eq!(
        call(&node, &key, "DELETE", "/v1/functions/one", &[], None).0,
        200
    );
    assert_eq!(deploy(b"two").0, 201, "deleting made room");
}

/// The field names of a JSON object, sorted.
fn fields(v: &Value) -> Vec<String> {
    let mut f: Vec<String> = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"))
        .keys()
        .cloned()
        .collect();
    f.sort();
    f
}

/// A namespace's owner key and a key made later are answered alike: the
/// secret as `api_key` (a string, shown once) and the key as `key`, the
/// object the key list shows (its `id` revokes it); the namespace's answer
/// adds `namespace`. Both secrets work.
#[test]
fn a_created_key_has_one_shape() {
    let node = TestNode::start();
    let (s, b) = node.op("POST", "/v1/namespaces", Some(r#"{"name":"keys"}"#));
    assert_eq!(s, 201, "{b}");
    let ns = json(&b);
    assert_eq!(fields(&ns), ["api_key", "key", "namespace"], "{b}");
    assert_eq!(ns["namespace"]["name"], "keys", "{b}");
    let owner = ns["api_key"].as_str().expect("the secret").to_string();
    let owner_key = &ns["key"];
    assert_eq!(
        (owner_key["name"].as_str(), owner_key["role"].as_str()),
        (Some("owner"), Some("owner")),
        "{b}"
    );

    let (s, b) = node.with_key(
        &owner,
        "POST",
        "/v1/auth/api-keys",
        Some(br#"{"name":"r","role":"reader"}"#),
    );
    assert_eq!(s, 201, "{b}");
    let made = json(&b);
    assert_eq!(fields(&made), ["api_key", "key"], "{b}");
    let reader = made["api_key"].as_str().expect("the secret").to_string();
    assert_eq!(fields(&made["key"]), fields(owner_key), "one key object");
    assert_eq!(made["key"]["role"], "reader");
    assert!(!b.contains("\"record\"") && !b.contains("key_id"), "{b}");

    // The key list shows the same objects, never a secret.
    let (s, b) = node.with_key(&owner, "GET", "/v1/auth/api-keys", None);
    assert_eq!(s, 200, "{b}");
    let listed = json(&b)["keys"].as_array().unwrap().clone();
    for k in [owner_key, &made["key"]] {
        assert!(listed.contains(k), "{k} not listed as answered: {b}");
    }
    assert!(!b.contains(&owner) && !b.contains(&reader));
    for secret in [&owner, &reader] {
        assert_eq!(node.with_key(secret, "GET", "/v1/auth/whoami", None).0, 200);
    }
    // The `id` answered is the one that revokes it.
    let id = made["key"]["id"].as_str().unwrap();
    let path = format!("/v1/auth/api-keys/{id}");
    assert_eq!(node.with_key(&owner, "DELETE", &path, None).0, 200);
    wait_until(
        std::time::Duration::from_secs(10),
        "the revoked key refused",
        || node.with_key(&reader, "GET", "/v1/auth/whoami", None).0 == 401,
    );
}

/// Create (201), show (200) and rollback (200) of a deployment answer the
/// same shape, `{"ok": true, "deployment": {...}}`, and show's deployment
/// is the one create answered.
#[test]
fn a_deployment_has_one_shape() {
    let node = TestNode::start();
    let key = node.create_namespace("shape");
    let site = |text: &[u8]| tarball(&[("./index.html", 'f', text)]);
    let (s, b) = deploy_static(&node, &key, "www", "www.shape.test", &site(b"v1"));
    assert_eq!(s, 201, "{b}");
    let created = json(&b);
    assert_eq!(fields(&created), ["deployment", "ok"], "{b}");
    assert_eq!(created["ok"], true);
    assert_eq!(created["deployment"]["version"], 1, "{b}");

    let (s, b) = node.with_key(&key, "GET", "/v1/deployments/www", None);
    assert_eq!(s, 200, "{b}");
    let shown = json(&b);
    assert_eq!(fields(&shown), ["deployment", "ok"], "{b}");
    assert_eq!(shown, created, "show answers what create answered");

    let (s, b) = deploy_static(&node, &key, "www", "www.shape.test", &site(b"v2"));
    assert_eq!(s, 201, "{b}");
    assert_eq!(json(&b)["deployment"]["version"], 2, "{b}");
    let (s, b) = node.with_key(&key, "POST", "/v1/deployments/www/rollback", None);
    assert_eq!(s, 200, "{b}");
    let rolled = json(&b);
    assert_eq!(fields(&rolled), ["deployment", "ok"], "{b}");
    assert_eq!(rolled["deployment"]["version"], 1, "{b}");
    assert_eq!(
        fields(&rolled["deployment"]),
        fields(&created["deployment"]),
        "one deployment object"
    );
    let (s, _, body) = via(&node, "www.shape.test", "GET", "/", &[], None);
    assert_eq!((s, body.as_slice()), (200, &b"v1"[..]));
}

/// Each of two namespaces serves a site named `web`; each one's
/// `GET /v1/namespaces/{ns}/stats` shows its own route's figures (requests
/// by status class, latency), never the other's; another namespace's key
/// and a key without `namespace:read` are refused.
#[test]
fn namespace_stats_show_its_own_deployment_routes() {
    if single_node_only() {
        return;
    }
    let node = TestNode::start();
    let a = node.create_namespace("stats-a");
    let b = node.create_namespace("stats-b");
    let site = tarball(&[("./index.html", 'f', b"hi")]);
    for (key, host) in [(&a, "web.stats-a.test"), (&b, "web.stats-b.test")] {
        let (s, body) = deploy_static(&node, key, "web", host, &site);
        assert_eq!(s, 201, "{body}");
    }
    for _ in 0..3 {
        assert_eq!(via(&node, "web.stats-a.test", "GET", "/", &[], None).0, 200);
    }
    assert_eq!(
        via(&node, "web.stats-a.test", "GET", "/missing", &[], None).0,
        404
    );
    for _ in 0..5 {
        assert_eq!(
            via(&node, "web.stats-b.test", "GET", "/missing", &[], None).0,
            404
        );
    }

    let stats = |key: &str, ns: &str| {
        let (s, body) = node.with_key(key, "GET", &format!("/v1/namespaces/{ns}/stats"), None);
        assert_eq!(s, 200, "{body}");
        json(&body)
    };
    let own = stats(&a, "stats-a");
    assert_eq!(fields(&own["deployments"]), ["web"], "{own}");
    assert_eq!(fields(&own["deployments"]["web"]), ["/"], "{own}");
    let route = &own["deployments"]["web"]["/"];
    assert_eq!(
        route["requests"],
        serde_json::json!({"2xx": 3, "4xx": 1}),
        "stats-a's requests only: {own}"
    );
    assert_eq!(route["latency"]["count"], 4, "{own}");
    assert!(
        route["latency"]["sum_seconds"].as_f64().unwrap() > 0.0,
        "{own}"
    );
    let p50 = route["latency"]["p50_seconds"].as_f64().unwrap();
    let p99 = route["latency"]["p99_seconds"].as_f64().unwrap();
    assert!(p50 > 0.0 && p50 <= p99, "{own}");
    assert_eq!(route["upstream_attempts"], serde_json::json!({}), "{own}");

    let theirs = stats(&b, "stats-b");
    assert_eq!(
        theirs["deployments"]["web"]["/"]["requests"],
        serde_json::json!({"4xx": 5}),
        "{theirs}"
    );

    // stats-b's key on stats-a's stats, and a key of stats-a without the grant.
    let (s, body) = node.with_key(&b, "GET", "/v1/namespaces/stats-a/stats", None);
    assert_eq!(s, 403, "{body}");
    assert!(!body.contains("\"2xx\""), "{body}");
    let (s, body) = node.with_key(
        &a,
        "POST",
        "/v1/auth/api-keys",
        Some(br#"{"grants":["kv:read:*"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    let narrow = json(&body)["api_key"].as_str().unwrap().to_string();
    let (s, body) = node.with_key(&narrow, "GET", "/v1/namespaces/stats-a/stats", None);
    assert_eq!(s, 403, "{body}");
    assert_eq!(envelope(&body).0, "MISSING_GRANT", "{body}");
}

/// The node pairs a key's kind with what it carries: without `kind`, the
/// runtime role makes an `rk` key and every other role an `sk` key; an
/// `rk` key carries data-plane grants only (publish, subscribe, read,
/// invoke, KV), so `{"role":"owner","kind":"rk"}` or an `rk` key with a
/// deploy grant is 400 and no key is made.
#[test]
fn a_keys_kind_follows_what_it_carries() {
    let node = TestNode::start();
    let owner = node.create_namespace("kinds");
    let make =
        |body: &str| node.with_key(&owner, "POST", "/v1/auth/api-keys", Some(body.as_bytes()));
    let secret = |b: &str| json(b)["api_key"].as_str().unwrap_or_default().to_string();
    let (s, b) = make(r#"{"name":"app","role":"runtime"}"#);
    assert_eq!(s, 201, "{b}");
    assert!(secret(&b).starts_with("mg_rk_"), "{b}");
    let (s, b) = make(r#"{"name":"dev","role":"developer"}"#);
    assert_eq!(s, 201, "{b}");
    assert!(secret(&b).starts_with("mg_sk_"), "{b}");
    let (s, b) =
        make(r#"{"name":"reads","grants":["kv:read:*","pubsub:subscribe:chat.*"],"kind":"rk"}"#);
    assert_eq!(s, 201, "{b}");
    assert!(secret(&b).starts_with("mg_rk_"), "{b}");
    let before = node.with_key(&owner, "GET", "/v1/auth/api-keys", None).1;
    for bad in [
        r#"{"name":"x","role":"owner","kind":"rk"}"#,
        r#"{"name":"x","role":"developer","kind":"rk"}"#,
        r#"{"name":"x","grants":["functions:deploy:*"],"kind":"rk"}"#,
        r#"{"name":"x","grants":["kv:*:*"],"kind":"rk"}"#,
        r#"{"name":"x","role":"runtime","grants":["keys:write:*"]}"#,
    ] {
        let (s, b) = make(bad);
        assert_eq!(s, 400, "{bad}: {b}");
        assert!(b.contains("data-plane grants only"), "{bad}: {b}");
    }
    let after = node.with_key(&owner, "GET", "/v1/auth/api-keys", None).1;
    assert_eq!(
        json(&before)["keys"].as_array().map(Vec::len),
        json(&after)["keys"].as_array().map(Vec::len),
        "no key was made"
    );
}
