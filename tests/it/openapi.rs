//! `GET /v1/openapi.json`: the document the node makes from its route table
//! is valid OpenAPI 3.1 (checked by PyPI's `openapi-spec-validator`, which
//! scripts/test.sh installs), every operation it lists answers a bad request
//! with one of its documented statuses (never the router's 404), a path
//! the router does not know is in no operation, and every path the CLI
//! calls is a documented one (docs/api.md "OpenAPI").

use crate::common::{TestNode, http, json};
use std::process::{Command, Stdio};

/// The node's document, read without a credential (the route is public).
fn document(node: &TestNode) -> serde_json::Value {
    let (s, h, b) = http("GET", &node.url("/v1/openapi.json"), &[], None);
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert!(
        h.iter()
            .any(|(k, v)| k == "content-type" && v.starts_with("application/json")),
        "{h:?}"
    );
    serde_json::from_slice(&b).expect("the document is JSON")
}

/// A documented path with each parameter filled.
fn concrete(path: &str) -> String {
    path.split('/')
        .map(|s| if s.starts_with('{') { "nosuch1" } else { s })
        .collect::<Vec<_>>()
        .join("/")
}

/// Whether `path` (a concrete path, its query cut) is one of the document's.
fn documented(doc: &serde_json::Value, path: &str) -> bool {
    let path = path.split('?').next().unwrap_or(path);
    let segs: Vec<&str> = path.split('/').collect();
    doc["paths"].as_object().expect("paths").keys().any(|p| {
        let want: Vec<&str> = p.split('/').collect();
        // `{key}` of the KV routes takes the rest of the path.
        if let Some(last) = want.last()
            && *last == "{key}"
            && p.starts_with("/v1/kv/")
        {
            return segs.len() >= want.len() && segs[..want.len() - 1] == want[..want.len() - 1];
        }
        want.len() == segs.len()
            && want
                .iter()
                .zip(&segs)
                .all(|(w, s)| w.starts_with('{') || w == s)
    })
}

#[test]
fn the_document_is_valid_openapi() {
    let node = TestNode::start();
    let doc = document(&node);
    assert_eq!(doc["openapi"], "3.1.0");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("openapi.json");
    std::fs::write(&file, serde_json::to_vec(&doc).unwrap()).unwrap();
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys, json\n\
             try:\n    from openapi_spec_validator import validate\n\
             except ImportError:\n    sys.exit('openapi-spec-validator is missing: python3 -m pip install openapi-spec-validator (scripts/test.sh does)')\n\
             validate(json.load(open(sys.argv[1])))\n\
             print('valid')",
        ])
        .arg(&file)
        .stdin(Stdio::null())
        .output()
        .expect("python3 runs (scripts/test.sh installs it)");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // What a client generator needs: grants, the envelope with its codes.
    let kv_get = &doc["paths"]["/v1/kv/{key}"]["get"];
    assert_eq!(kv_get["x-meshgate-grants"], serde_json::json!(["kv:read"]));
    assert_eq!(kv_get["parameters"][0]["name"], "key");
    let codes = doc["components"]["schemas"]["Error"]["properties"]["error"]["properties"]["code"]
        ["enum"]
        .as_array()
        .unwrap();
    assert!(codes.iter().any(|c| c == "QUOTA_EXCEEDED"), "{codes:?}");
}

/// Every documented operation answers a request without a credential and
/// with a malformed body with one of its documented statuses; none is the
/// router's "no such route". A path outside the document is that 404.
#[test]
fn every_documented_operation_answers_as_documented() {
    let node = TestNode::start();
    let doc = document(&node);
    let mut tried = 0;
    let mut wrong = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let url = node.url(&concrete(path));
            let m = method.to_ascii_uppercase();
            let body = matches!(m.as_str(), "POST" | "PUT" | "PATCH").then_some(&b"{"[..]);
            let (s, _, b) = http(&m, &url, &[("content-type", "application/json")], body);
            let text = String::from_utf8_lossy(&b);
            let statuses: Vec<&String> = op["responses"].as_object().unwrap().keys().collect();
            if !statuses.iter().any(|k| k.as_str() == s.to_string()) {
                wrong.push(format!("{m} {path}: {s} is not among {statuses:?}: {text}"));
            }
            if s == 404 && json(&text)["error"]["message"] == "no such route" {
                wrong.push(format!("{m} {path}: the router's 404"));
            }
            tried += 1;
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(tried > 50, "{tried} operations");
    // The other direction: what the router does not know is in no operation.
    for path in ["/v1/no-such-route", "/v1/kvv", "/v1/namespaces/a/b/c/d"] {
        assert!(!documented(&doc, path), "{path}");
        let (s, _, b) = http("GET", &node.url(path), &[], None);
        assert_eq!(s, 404, "{path}");
        assert_eq!(
            json(&String::from_utf8_lossy(&b))["error"]["message"],
            "no such route"
        );
    }
}

/// Every `/v1/` path the CLI calls (its string literals, each `{…}` a
/// segment) is a path of the document: the CLI cannot drift from the API.
#[test]
fn every_path_the_cli_calls_is_documented() {
    let node = TestNode::start();
    let doc = document(&node);
    let src = include_str!("../../src/cli_client.rs");
    let mut paths = Vec::new();
    let mut rest = src;
    while let Some(i) = rest.find("\"/v1/") {
        let tail = &rest[i + 1..];
        let end = tail.find('"').unwrap();
        paths.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    assert!(paths.len() > 15, "{paths:?}");
    for p in &paths {
        // `format!` holes are one segment each.
        let mut concrete = String::new();
        let mut depth = 0;
        for c in p.chars() {
            match c {
                '{' => {
                    if depth == 0 {
                        concrete.push_str("x1");
                    }
                    depth += 1
                }
                '}' => depth -= 1,
                c if depth == 0 => concrete.push(c),
                _ => {}
            }
        }
        assert!(
            documented(&doc, &concrete),
            "the CLI calls {p}, not in the document"
        );
    }
}
