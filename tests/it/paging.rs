//! Paged listings (README "Listings are paged"): every listing answers at
//! most `limit` items and a `next_cursor` that, followed, reaches every item
//! exactly once, even with items created and deleted between pages; bad
//! limits and cursors (garbled, or another namespace's) are refused with no
//! data. Each test drives a real node over HTTP.

use crate::cli::{cli, printed};
use crate::common::*;
use crate::deploy::loopback_config;
use crate::functions::deploy;
use crate::pubsub::connect;
use futures_util::{SinkExt as _, StreamExt as _};
use serde_json::Value;
use std::collections::BTreeMap;

/// Who calls a listing: the operator, or a namespace key.
#[derive(Clone, Copy)]
enum Caller<'a> {
    Operator,
    Key(&'a str),
}

fn get(node: &TestNode, who: Caller<'_>, path: &str) -> (u16, Value) {
    let (s, b) = match who {
        Caller::Operator => node.op("GET", path, None),
        Caller::Key(k) => node.with_key(k, "GET", path, None),
    };
    (s, json(&b))
}

/// `path` with `extra` query parameters (`path` may carry its own).
fn with_query(path: &str, extra: &str) -> String {
    let sep = if path.contains('?') { '&' } else { '?' };
    format!("{path}{sep}{extra}")
}

/// Follows a listing from its first page with `limit`: the names of every
/// page (`name` of each item of `field`), in order. `between(n)` runs after
/// page `n` (from 0) was read, before the next is asked for. Asserts every
/// page but the last is full and carries a cursor, and the last has none.
fn walk(
    node: &TestNode,
    who: Caller<'_>,
    path: &str,
    field: &str,
    limit: usize,
    name: impl Fn(&Value) -> String,
    mut between: impl FnMut(usize),
) -> Vec<Vec<String>> {
    let mut pages = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut q = format!("limit={limit}");
        if let Some(c) = &cursor {
            q.push_str(&format!("&cursor={c}"));
        }
        let (s, v) = get(node, who, &with_query(path, &q));
        assert_eq!(s, 200, "{path} page {}: {v}", pages.len());
        let items = v[field].as_array().unwrap_or_else(|| panic!("{v}"));
        assert!(items.len() <= limit, "{v}");
        pages.push(items.iter().map(&name).collect());
        match &v["next_cursor"] {
            Value::String(c) => {
                assert_eq!(items.len(), limit, "a page before the last is full: {v}");
                cursor = Some(c.clone());
            }
            Value::Null => return pages,
            other => panic!("next_cursor is {other}"),
        }
        between(pages.len() - 1);
        assert!(pages.len() < 1000, "the cursor never ends");
    }
}

/// How many times each name appears across the pages.
fn counts(pages: &[Vec<String>]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for n in pages.iter().flatten() {
        *m.entry(n.clone()).or_default() += 1;
    }
    m
}

/// Asserts `pages` list exactly `want`, each once, in order.
fn exactly_once(pages: &[Vec<String>], want: &[String]) {
    let c = counts(pages);
    assert!(
        c.values().all(|n| *n == 1),
        "an item repeated across pages: {pages:?}"
    );
    let got: Vec<String> = pages.iter().flatten().cloned().collect();
    assert_eq!(got, want, "pages {pages:?}");
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or_default()
}

fn kv_put(node: &TestNode, key: &str, k: &str) {
    let (s, b) = node.with_key(key, "PUT", &format!("/v1/kv/{k}"), Some(b"v"));
    assert_eq!(s, 200, "{b}");
}

fn by_name(v: &Value) -> String {
    v["name"].as_str().unwrap().to_string()
}

/// Seven namespaces listed three at a time reach every namespace exactly
/// once, the last page without a cursor; a namespace deleted before its
/// page and one created after the cursor change nothing else (an offset
/// would skip one when a namespace already read is deleted).
#[test]
fn namespaces_pages_reach_every_namespace_once() {
    let node = TestNode::start();
    for i in 0..7 {
        node.create_namespace(&format!("pgns{i}"));
    }
    let ours = |pages: Vec<Vec<String>>| -> Vec<Vec<String>> {
        pages
            .into_iter()
            .map(|p| p.into_iter().filter(|n| n.starts_with("pgns")).collect())
            .collect()
    };
    let all: Vec<String> = (0..7).map(|i| format!("pgns{i}")).collect();
    let pages = walk(
        &node,
        Caller::Operator,
        "/v1/namespaces",
        "namespaces",
        3,
        by_name,
        |_| {},
    );
    assert!(pages.len() >= 3, "{pages:?}");
    exactly_once(&ours(pages), &all);

    // Between the first and the second page: one read already is deleted,
    // one not yet read is deleted, one sorting after the cursor is created.
    let pages = walk(
        &node,
        Caller::Operator,
        "/v1/namespaces",
        "namespaces",
        3,
        by_name,
        |n| {
            if n == 0 {
                assert_eq!(node.op("DELETE", "/v1/namespaces/pgns1", None).0, 200);
                assert_eq!(node.op("DELETE", "/v1/namespaces/pgns5", None).0, 200);
                node.create_namespace("pgns9");
            }
        },
    );
    let want: Vec<String> = [
        "pgns0", "pgns1", "pgns2", "pgns3", "pgns4", "pgns6", "pgns9",
    ]
    .map(String::from)
    .to_vec();
    exactly_once(&ours(pages), &want);
}

/// A namespace's API keys, eight listed three at a time: every id once, in
/// id order, the same set one large page shows.
#[test]
fn api_keys_pages_reach_every_key_once() {
    let node = TestNode::start();
    let owner = node.create_namespace("pgkeys");
    for i in 0..7 {
        let body = format!(r#"{{"name":"k{i}","role":"reader"}}"#);
        let (s, b) = node.with_key(&owner, "POST", "/v1/auth/api-keys", Some(body.as_bytes()));
        assert_eq!(s, 201, "{b}");
    }
    let id = |v: &Value| v["id"].as_str().unwrap().to_string();
    let (s, one) = get(&node, Caller::Key(&owner), "/v1/auth/api-keys?limit=1000");
    assert_eq!(s, 200, "{one}");
    assert_eq!(one["next_cursor"], Value::Null, "{one}");
    let mut all: Vec<String> = one["keys"].as_array().unwrap().iter().map(id).collect();
    assert_eq!(all.len(), 8, "{one}");
    all.sort();
    let pages = walk(
        &node,
        Caller::Key(&owner),
        "/v1/auth/api-keys",
        "keys",
        3,
        id,
        |_| {},
    );
    assert_eq!(pages.len(), 3);
    exactly_once(&pages, &all);
}

/// Seven functions listed three at a time: every function once; one
/// deleted between pages (already read) does not make the next page skip.
#[test]
fn functions_pages_reach_every_function_once() {
    let node = TestNode::start();
    let key = node.create_namespace("pgfn");
    let wasm = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/functions/echo.wasm"
    ))
    .unwrap();
    let all: Vec<String> = (0..7).map(|i| format!("f{i}")).collect();
    for n in &all {
        deploy(&node, &key, n, &wasm, &[]);
    }
    let pages = walk(
        &node,
        Caller::Key(&key),
        "/v1/functions",
        "functions",
        3,
        by_name,
        |_| {},
    );
    assert_eq!(pages.len(), 3);
    exactly_once(&pages, &all);
    let pages = walk(
        &node,
        Caller::Key(&key),
        "/v1/functions",
        "functions",
        3,
        by_name,
        |n| {
            if n == 0 {
                assert_eq!(
                    node.with_key(&key, "DELETE", "/v1/functions/f0", None).0,
                    200
                );
            }
        },
    );
    exactly_once(&pages, &all);
}

/// Seven deployments listed three at a time: every deployment once.
#[test]
fn deployments_pages_reach_every_deployment_once() {
    let node = TestNode::start_with(NodeOpts {
        config: loopback_config(),
        ..Default::default()
    });
    let key = node.create_namespace("pgdep");
    let all: Vec<String> = (0..7).map(|i| format!("d{i}")).collect();
    for n in &all {
        let body = serde_json::json!({
            "name": n, "hosts": [format!("{n}.pgdep.test")],
            "upstream": {"instances": ["http://127.0.0.1:9"]},
        });
        let (s, b) = node.with_key(
            &key,
            "POST",
            "/v1/deployments",
            Some(body.to_string().as_bytes()),
        );
        assert_eq!(s, 201, "{b}");
    }
    let pages = walk(
        &node,
        Caller::Key(&key),
        "/v1/deployments",
        "deployments",
        3,
        by_name,
        |_| {},
    );
    assert_eq!(pages.len(), 3);
    exactly_once(&pages, &all);
}

/// KV keys under a prefix, seven listed three at a time: every key once
/// and none of another prefix, with a key written between pages after the
/// cursor listed, one deleted before its page not, and the cursor's own key
/// deleted changing nothing; a cursor of one
/// prefix is refused for another; with no limit a page holds 100 keys.
#[test]
fn kv_pages_reach_every_key_once_within_the_prefix() {
    let node = TestNode::start();
    let key = node.create_namespace("pgkv");
    for i in 0..7 {
        kv_put(&node, &key, &format!("p/{i}"));
        kv_put(&node, &key, &format!("q/{i}"));
    }
    let name = |v: &Value| v.as_str().unwrap().to_string();
    let all: Vec<String> = (0..7).map(|i| format!("p/{i}")).collect();
    let pages = walk(
        &node,
        Caller::Key(&key),
        "/v1/kv?prefix=p/",
        "keys",
        3,
        name,
        |_| {},
    );
    assert_eq!(pages.len(), 3);
    exactly_once(&pages, &all);

    let pages = walk(
        &node,
        Caller::Key(&key),
        "/v1/kv?prefix=p/",
        "keys",
        3,
        name,
        |n| {
            if n == 0 {
                // The very key the cursor names: the next page still starts after it.
                assert_eq!(node.with_key(&key, "DELETE", "/v1/kv/p/2", None).0, 200);
                assert_eq!(node.with_key(&key, "DELETE", "/v1/kv/p/4", None).0, 200);
                kv_put(&node, &key, "p/8");
            }
        },
    );
    let want: Vec<String> = ["p/0", "p/1", "p/2", "p/3", "p/5", "p/6", "p/8"]
        .map(String::from)
        .to_vec();
    exactly_once(&pages, &want);

    let (_, first) = get(&node, Caller::Key(&key), "/v1/kv?prefix=p/&limit=2");
    let c = first["next_cursor"].as_str().unwrap().to_string();
    let (s, v) = get(
        &node,
        Caller::Key(&key),
        &format!("/v1/kv?prefix=q/&cursor={c}"),
    );
    assert_eq!((s, code(&v)), (400, "INVALID_CURSOR"), "{v}");
    assert!(v.get("keys").is_none(), "{v}");

    for i in 0..100 {
        kv_put(&node, &key, &format!("r/{i:03}"));
    }
    let (s, v) = get(&node, Caller::Key(&key), "/v1/kv?prefix=r/");
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["keys"].as_array().unwrap().len(), 100, "the default page");
    assert_eq!(v["next_cursor"], Value::Null, "exactly 100: no next page");
    kv_put(&node, &key, "r/100");
    let (_, v) = get(&node, Caller::Key(&key), "/v1/kv?prefix=r/");
    assert_eq!(v["keys"].as_array().unwrap().len(), 100, "{v}");
    let c = v["next_cursor"].as_str().expect("a cursor past 100 keys");
    let (_, v) = get(
        &node,
        Caller::Key(&key),
        &format!("/v1/kv?prefix=r/&cursor={c}"),
    );
    assert_eq!(v["keys"], serde_json::json!(["r/100"]), "{v}");
}

/// The live topics of a socket subscribed to seven, listed three at a
/// time: every topic once.
#[actix_rt::test]
async fn topics_pages_reach_every_topic_once() {
    let node = TestNode::start();
    let key = node.create_namespace("pgtopics");
    let mut s = connect(&format!("ws://{}/v1/ws?token={key}", node.addr)).await;
    let all: Vec<String> = (0..7).map(|i| format!("t{i}")).collect();
    for (i, t) in all.iter().enumerate() {
        let f = serde_json::json!({"id": i, "type": "subscribe", "topic": t});
        s.send(awc::ws::Message::Text(f.to_string().into()))
            .await
            .unwrap();
        loop {
            let frame = s.next().await.expect("open").expect("frame");
            if let awc::ws::Frame::Text(b) = frame {
                let v: Value = serde_json::from_slice(&b).unwrap();
                if v["id"] == i {
                    assert_eq!(v["ok"], true, "{v}");
                    break;
                }
            }
        }
    }
    let topic = |v: &Value| v["topic"].as_str().unwrap().to_string();
    let pages = walk(
        &node,
        Caller::Key(&key),
        "/v1/pubsub/topics",
        "topics",
        3,
        topic,
        |_| {},
    );
    assert_eq!(pages.len(), 3);
    exactly_once(&pages, &all);
    drop(s);
}

/// `limit` of 0, above 1000 or not a number is 400 `INVALID_LIMIT` naming
/// the bounds, on every listing; a garbled cursor is 400 `INVALID_CURSOR`.
#[test]
fn bad_limits_and_garbled_cursors_are_refused() {
    let node = TestNode::start();
    let key = node.create_namespace("pgbad");
    kv_put(&node, &key, "a");
    let listings = [
        (Caller::Operator, "/v1/namespaces"),
        (Caller::Key(&key), "/v1/auth/api-keys"),
        (Caller::Key(&key), "/v1/functions"),
        (Caller::Key(&key), "/v1/deployments"),
        (Caller::Key(&key), "/v1/kv"),
        (Caller::Key(&key), "/v1/pubsub/topics"),
    ];
    for (who, path) in listings {
        for bad in ["0", "1001", "ten", "-1"] {
            let (s, v) = get(&node, who, &format!("{path}?limit={bad}"));
            assert_eq!(
                (s, code(&v)),
                (400, "INVALID_LIMIT"),
                "{path} limit={bad}: {v}"
            );
            let m = v["error"]["message"].as_str().unwrap();
            assert!(m.contains("1 to 1000") && m.contains("100"), "{m}");
        }
        assert_eq!(
            get(&node, who, &format!("{path}?limit=1000")).0,
            200,
            "{path}"
        );
        for bad in ["%25%25", "bm9wZQ", "AAAA"] {
            let (s, v) = get(&node, who, &format!("{path}?cursor={bad}"));
            assert_eq!(
                (s, code(&v)),
                (400, "INVALID_CURSOR"),
                "{path} cursor={bad}: {v}"
            );
        }
    }
}

/// A cursor namespace A's listing returned, sent with namespace B's key (or
/// by the operator for B), is 400 `INVALID_CURSOR` and shows nothing of A;
/// a cursor of one listing is refused by another.
#[test]
fn a_cursor_of_another_namespace_is_refused() {
    let node = TestNode::start();
    let a = node.create_namespace("pgcura");
    let b = node.create_namespace("pgcurb");
    for i in 0..3 {
        kv_put(&node, &a, &format!("secret-a-{i}"));
        kv_put(&node, &b, &format!("b-{i}"));
    }
    let (_, first) = get(&node, Caller::Key(&a), "/v1/kv?limit=1");
    assert_eq!(first["keys"], serde_json::json!(["secret-a-0"]));
    let c = first["next_cursor"].as_str().unwrap().to_string();
    // A's own next page works.
    let (s, v) = get(&node, Caller::Key(&a), &format!("/v1/kv?cursor={c}"));
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["keys"], serde_json::json!(["secret-a-1", "secret-a-2"]));
    for (who, path) in [
        (Caller::Key(&b), format!("/v1/kv?cursor={c}")),
        (
            Caller::Operator,
            format!("/v1/kv?namespace=pgcurb&cursor={c}"),
        ),
        (Caller::Key(&a), format!("/v1/functions?cursor={c}")),
        (Caller::Key(&a), format!("/v1/auth/api-keys?cursor={c}")),
    ] {
        let (s, v) = get(&node, who, &path);
        assert_eq!((s, code(&v)), (400, "INVALID_CURSOR"), "{path}: {v}");
        assert!(!v.to_string().contains("secret-a"), "{v}");
    }
}

/// `meshgate kv list` and `ns list` follow `next_cursor` to print every
/// item (asking three at a time); `--limit` prints one page and its cursor,
/// which `--cursor` resumes after.
#[test]
fn cli_lists_follow_the_cursor() {
    let node = TestNode::start();
    let base = node.base.as_str();
    let key = node.create_namespace("pgcli");
    let all: Vec<String> = (0..7).map(|i| format!("k{i}")).collect();
    for k in &all {
        kv_put(&node, &key, k);
    }
    let out = printed(&cli(
        base,
        &["kv", "list", "--page-size", "3", "--key", &key],
    ));
    assert_eq!(out, serde_json::json!({"keys": all}));

    let one = printed(&cli(base, &["kv", "list", "--limit", "3", "--key", &key]));
    assert_eq!(one["keys"], serde_json::json!(["k0", "k1", "k2"]));
    let c = one["next_cursor"].as_str().unwrap();
    let rest = printed(&cli(
        base,
        &[
            "kv",
            "list",
            "--cursor",
            c,
            "--page-size",
            "2",
            "--key",
            &key,
        ],
    ));
    assert_eq!(rest, serde_json::json!({"keys": all[3..]}));

    for i in 0..4 {
        node.create_namespace(&format!("pgcli{i}"));
    }
    let out = printed(&cli(
        base,
        &["ns", "list", "--page-size", "2", "--key", OPERATOR_KEY],
    ));
    let names: Vec<String> = out["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(by_name)
        .filter(|n| n.starts_with("pgcli"))
        .collect();
    assert_eq!(names, ["pgcli", "pgcli0", "pgcli1", "pgcli2", "pgcli3"]);
}

/// Follows a listing to its end, `limit` at a time, without asserting
/// full pages (a scoped caller's pages may hold fewer): every name seen.
fn follow_all(node: &TestNode, key: &str, path: &str, field: &str, limit: usize) -> Vec<String> {
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..100 {
        let mut q = format!("limit={limit}");
        if let Some(c) = &cursor {
            q.push_str(&format!("&cursor={c}"));
        }
        let (s, v) = get(node, Caller::Key(key), &with_query(path, &q));
        assert_eq!(s, 200, "{path}: {v}");
        for item in v[field].as_array().unwrap_or_else(|| panic!("{v}")) {
            seen.push(by_name(item));
        }
        match v["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => return seen,
        }
    }
    panic!("{path}: the cursor never ended");
}

/// A key whose grants name some functions and deployments (`a*`) lists
/// only those, across pages, while the owner's key lists all; the scoped
/// key reads no other item either.
#[test]
fn scoped_keys_list_only_the_items_their_grants_name() {
    let node = TestNode::start_with(NodeOpts {
        config: loopback_config(),
        ..Default::default()
    });
    let owner = node.create_namespace("pgscope");
    let wasm = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/functions/echo.wasm"
    ))
    .unwrap();
    let names = ["a1", "b1", "a2", "b2", "a3"];
    for n in names {
        deploy(&node, &owner, n, &wasm, &[]);
        let body = serde_json::json!({
            "name": n, "hosts": [format!("{n}.pgscope.test")],
            "upstream": {"instances": ["http://127.0.0.1:9"]},
        });
        let (s, b) = node.with_key(
            &owner,
            "POST",
            "/v1/deployments",
            Some(body.to_string().as_bytes()),
        );
        assert_eq!(s, 201, "{b}");
    }
    let (s, b) = node.with_key(
        &owner,
        "POST",
        "/v1/auth/api-keys",
        Some(br#"{"grants":["functions:read:a*","deployments:read:a*"]}"#),
    );
    assert_eq!(s, 201, "{b}");
    let scoped = json(&b)["api_key"].as_str().unwrap().to_string();
    let mut all: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    all.sort();
    let mine: Vec<String> = all.iter().filter(|n| n.starts_with('a')).cloned().collect();
    for (path, field) in [
        ("/v1/functions", "functions"),
        ("/v1/deployments", "deployments"),
    ] {
        assert_eq!(follow_all(&node, &owner, path, field, 2), all, "{path}");
        assert_eq!(follow_all(&node, &scoped, path, field, 2), mine, "{path}");
        assert_eq!(follow_all(&node, &scoped, path, field, 100), mine, "{path}");
        let (s, v) = get(&node, Caller::Key(&scoped), &format!("{path}/b1"));
        assert_eq!((s, code(&v)), (403, "MISSING_GRANT"), "{path}/b1: {v}");
    }
}
