//! Anyone → `/metrics` and `/v1/status`: both name every namespace with its
//! counters (the map of tenants an attacker tries next), so by default they
//! need the operator key; a scraper without it reads a second listener on a
//! private interface (`[metrics] listen`), or the operator opens them to
//! anyone without the names (`[metrics] public = true`). The probes stay
//! public. See docs/security.md ("Client → node", node status).

use crate::common::{
    NodeOpts, OPERATOR_AUTH, TEST_CONFIG, TestNode, free_port, http, json, single_node_only,
};

/// A namespace name no other part of a body could contain by chance.
const SECRET_NS: &str = "tenant-zeta-hidden";

fn get(base: &str, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let (s, _, b) = http("GET", &format!("{base}{path}"), headers, None);
    (s, String::from_utf8_lossy(&b).into_owned())
}

/// A node (cluster mode: every node) with `extra` config, and a namespace
/// that has run (its supervisor, its counters) on it.
fn node_with_tenant(extra: &str) -> (TestNode, String) {
    let n = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}{extra}"),
        ..Default::default()
    });
    let key = n.create_namespace(SECRET_NS);
    let (s, body) = n.with_key(&key, "PUT", "/v1/kv/k", Some(b"v"));
    assert_eq!(s, 200, "{body}");
    (n, key)
}

/// By default `/metrics` and `/v1/status` without a credential are 401 and
/// name no namespace; with a tenant's key 401 (`/metrics`) or 403
/// (`/v1/status`), still nameless; with the operator key 200, and the
/// namespace is named there (so its absence above is the refusal's doing).
/// `/livez` and `/readyz` stay public.
#[test]
fn metrics_and_status_need_the_operator_key() {
    let (n, tenant) = node_with_tenant("");
    let tenant_auth = format!("Bearer {tenant}");
    for base in n.every_base() {
        for path in ["/metrics", "/v1/status"] {
            let (s, body) = get(&base, path, &[]);
            assert_eq!(s, 401, "{base}{path} without a key: {body}");
            assert_eq!(json(&body)["error"]["code"], "MISSING_CREDENTIAL");
            assert!(!body.contains(SECRET_NS), "{base}{path}: {body}");
            let (s, body) = get(&base, path, &[("authorization", &tenant_auth)]);
            let want = if path == "/metrics" { 401 } else { 403 };
            assert_eq!(s, want, "{base}{path} with a tenant's key: {body}");
            assert!(!body.contains(SECRET_NS), "{base}{path}: {body}");
        }
        for probe in ["/livez", "/readyz"] {
            assert_eq!(get(&base, probe, &[]).0, 200, "{base}{probe}");
        }
    }
    // With the operator key: 200 on every node, and the namespace is named.
    let mut named = false;
    for base in n.every_base() {
        for path in ["/metrics", "/v1/status"] {
            let (s, body) = get(&base, path, &[OPERATOR_AUTH]);
            assert_eq!(s, 200, "{base}{path} with the operator key: {body}");
            named |= body.contains(SECRET_NS);
        }
    }
    assert!(named, "the operator's view names the namespace");
}

/// `[metrics] listen`: the second listener serves `/metrics` without a key
/// (200, whole: the namespace is named) and nothing else (404 for the
/// node's other routes); the main listener still refuses `/metrics`
/// without the key.
#[test]
fn metrics_listener_serves_without_a_key() {
    if single_node_only() {
        return;
    }
    let port = free_port();
    let (n, _) = node_with_tenant(&format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"));
    let scrape = format!("http://127.0.0.1:{port}");
    let (s, body) = get(&scrape, "/metrics", &[]);
    assert_eq!(s, 200, "{body}");
    assert!(
        body.contains("meshgate_actor_messages_handled_total"),
        "{body}"
    );
    assert!(
        body.contains(SECRET_NS),
        "the private scrape is whole: {body}"
    );
    for path in [
        "/v1/status",
        "/__admin/api/snapshot",
        "/v1/namespaces",
        "/livez",
    ] {
        let (s, body) = get(&scrape, path, &[OPERATOR_AUTH]);
        assert_eq!(s, 404, "{path} on the metrics listener: {body}");
        assert_eq!(json(&body)["error"]["code"], "NOT_FOUND");
    }
    assert_eq!(get(&n.base, "/metrics", &[]).0, 401, "the main listener");
}

/// `[metrics] public = true`: `/metrics` and `/v1/status` answer anyone,
/// without a namespace name (series summed over the namespaces; status rows
/// without their namespace); the operator key still gets them whole.
#[test]
fn public_metrics_name_no_namespace() {
    let (n, _) = node_with_tenant("[metrics]\npublic = true\n");
    let mut summed = false;
    for base in n.every_base() {
        let (s, body) = get(&base, "/metrics", &[]);
        assert_eq!(s, 200, "{base}/metrics: {body}");
        assert!(!body.contains(SECRET_NS), "{base}/metrics: {body}");
        assert!(!body.contains("namespace=\""), "no namespace label: {body}");
        summed |= body.contains("meshgate_actor_messages_handled_total{kind=\"namespace\"}");
        let (s, body) = get(&base, "/v1/status", &[]);
        assert_eq!(s, 200, "{base}/v1/status: {body}");
        assert!(!body.contains(SECRET_NS), "{base}/v1/status: {body}");
        assert!(
            json(&body)["actors"]
                .as_array()
                .is_some_and(|a| !a.is_empty())
        );
    }
    assert!(summed, "the namespaces' actor counters are there, summed");
    let named = n.every_base().iter().any(|base| {
        get(base, "/metrics", &[OPERATOR_AUTH])
            .1
            .contains(SECRET_NS)
            && get(base, "/v1/status", &[OPERATOR_AUTH])
                .1
                .contains(SECRET_NS)
    });
    assert!(named, "the operator key still gets the names");
}

/// Guessing the operator key at `/metrics` (outside the chain) is capped like
/// the sign-in: wrong keys are charged to the client's credential bucket,
/// 401 until it is empty, then 429; the right key is still served.
#[test]
fn wrong_keys_at_metrics_are_rate_limited() {
    let n = TestNode::start_with(NodeOpts {
        config: "[rate_limit]\ncredential_per_minute = 1\ncredential_burst = 3\n".into(),
        ..Default::default()
    });
    let guess = (
        "authorization",
        "Bearer mgop_guess_0000000000000000000000000",
    );
    for i in 0..3 {
        let (s, body) = get(&n.base, "/metrics", &[guess]);
        assert_eq!(s, 401, "guess {i}: {body}");
        assert_eq!(json(&body)["error"]["code"], "INVALID_OPERATOR_KEY");
    }
    let (s, body) = get(&n.base, "/metrics", &[guess]);
    assert_eq!(s, 429, "past the burst: {body}");
    assert_eq!(get(&n.base, "/metrics", &[OPERATOR_AUTH]).0, 200);
}
