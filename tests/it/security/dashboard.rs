//! Operator → dashboard boundary: `/__admin` trusts no source address. Behind
//! the usual TLS proxy on loopback every public request arrives from
//! 127.0.0.1, so only the operator key or its signed-in session cookie opens
//! the dashboard. See docs/security.md.

use crate::common::{
    NodeOpts, OPERATOR_KEY, TEST_CONFIG, TestNode, header, http, json, single_node_only,
};

const SNAPSHOT: &str = "/__admin/api/snapshot";

fn status(
    n: &TestNode,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, Vec<(String, String)>, String) {
    let (s, h, b) = http("GET", &n.url(path), headers, None);
    (s, h, String::from_utf8_lossy(&b).into_owned())
}

/// Signs in through the form as a browser would and returns the cookie pair.
fn sign_in(n: &TestNode, headers: &[(&str, &str)]) -> String {
    let mut hs = headers.to_vec();
    hs.push(("content-type", "application/x-www-form-urlencoded"));
    let body = format!("key={OPERATOR_KEY}");
    let (s, h, _) = http("POST", &n.url("/__admin/login"), &hs, Some(body.as_bytes()));
    assert_eq!(s, 303, "sign-in answers a redirect");
    assert_eq!(header(&h, "location"), Some("/__admin"));
    header(&h, "set-cookie")
        .expect("a session cookie")
        .split(';')
        .next()
        .unwrap()
        .to_string()
}

/// The snapshot API from loopback: 401 without a key, 401 with
/// `X-Forwarded-For` (believed or not), 403 with a tenant's key, 200 with the
/// operator key, 200 with the signed-in cookie.
#[test]
fn snapshot_trusts_no_address() {
    // Once as a bare node (XFF not believed), once behind a trusted proxy on
    // loopback (XFF believed): the answer must not depend on either.
    for trusted in [false, true] {
        let config = if trusted {
            format!("{TEST_CONFIG}trusted_proxies = [\"127.0.0.1\"]\n")
        } else {
            TEST_CONFIG.to_string()
        };
        let n = TestNode::start_with(NodeOpts {
            config,
            ..Default::default()
        });
        let (s, _, body) = status(&n, SNAPSHOT, &[]);
        assert_eq!(s, 401, "loopback without a key (trusted={trusted}): {body}");
        assert_eq!(json(&body)["error"]["code"], "MISSING_CREDENTIAL");
        for xff in ["127.0.0.1", "203.0.113.9", "::1"] {
            let (s, _, body) = status(&n, SNAPSHOT, &[("x-forwarded-for", xff)]);
            assert_eq!(s, 401, "X-Forwarded-For {xff} (trusted={trusted}): {body}");
        }
        let tenant = n.create_namespace("tenant");
        let (s, _, body) = status(
            &n,
            SNAPSHOT,
            &[("authorization", &format!("Bearer {tenant}"))],
        );
        assert_eq!(s, 403, "a tenant's key: {body}");
        assert_eq!(json(&body)["error"]["code"], "OPERATOR_ONLY");
        let (s, _, body) = status(
            &n,
            SNAPSHOT,
            &[("authorization", &format!("Bearer {OPERATOR_KEY}"))],
        );
        assert_eq!(s, 200, "the operator key: {body}");
        assert!(json(&body)["node"].is_object(), "a snapshot: {body}");
        let cookie = sign_in(&n, &[("x-forwarded-for", "203.0.113.9")]);
        let (s, _, body) = status(&n, SNAPSHOT, &[("cookie", &cookie)]);
        assert_eq!(s, 200, "the signed-in cookie: {body}");
        assert!(json(&body)["node"].is_object(), "a snapshot: {body}");
    }
}

/// Every dashboard route, from loopback with no credential: 401 (the API, the
/// assets), or for a browser asking for the page a redirect to the sign-in
/// form, which itself holds no numbers.
#[test]
fn every_dashboard_route_needs_the_key_from_loopback() {
    let n = TestNode::start();
    for route in [
        "/__admin/assets/app.js",
        "/__admin/api/node",
        "/__admin/api/actors",
        "/__admin/api/namespaces",
        "/__admin/api/history",
    ] {
        let (s, _, body) = status(&n, route, &[]);
        assert_eq!(s, 401, "{route}: {body}");
    }
    // A script asking for the page gets the JSON envelope.
    let (s, _, body) = status(&n, "/__admin", &[]);
    assert_eq!(s, 401, "{body}");
    assert_eq!(json(&body)["error"]["code"], "MISSING_CREDENTIAL");
    // A browser is sent to the sign-in form.
    let accept = ("accept", "text/html,application/xhtml+xml,*/*;q=0.8");
    let (s, h, _) = status(&n, "/__admin", &[accept]);
    assert_eq!(s, 303);
    assert_eq!(header(&h, "location"), Some("/__admin/login"));
    let (s, _, page) = status(&n, "/__admin/login", &[accept]);
    assert_eq!(s, 200);
    assert!(
        page.contains("name=\"key\"") && !page.contains("uptime"),
        "{page}"
    );
    // Refused before it starts, the stream is a plain 401 answer.
    let (s, _, _) = status(&n, "/__admin/api/stream", &[]);
    assert_eq!(s, 401, "the event stream");
}

/// A wrong key at the sign-in form opens nothing, and a cookie made up by the
/// client is no session.
#[test]
fn forged_sign_in_opens_nothing() {
    let n = TestNode::start();
    let (s, h, _) = http(
        "POST",
        &n.url("/__admin/login"),
        &[("content-type", "application/x-www-form-urlencoded")],
        Some(b"key=mgop_guess"),
    );
    assert_eq!(s, 303);
    assert_eq!(header(&h, "location"), Some("/__admin/login?failed=1"));
    for cookie in [
        "mg_admin=operator",
        "mg_admin=1.2.3",
        "mg_admin=9999999999.AAAA.BBBB",
    ] {
        let (s, _, body) = status(&n, SNAPSHOT, &[("cookie", cookie)]);
        assert_eq!(s, 401, "{cookie}: {body}");
    }
}

/// Whether `cookie` opens the snapshot API on `n` (200), or not (401).
fn snapshot_with(n: &TestNode, cookie: &str) -> u16 {
    status(n, SNAPSHOT, &[("cookie", cookie)]).0
}

/// Signs out with `cookie` from the node's own origin (as the page's form does).
fn sign_out(n: &TestNode, cookie: &str) {
    let origin = format!("http://{}", n.addr);
    let (s, h, b) = http(
        "POST",
        &n.url("/__admin/logout"),
        &[("cookie", cookie), ("origin", &origin)],
        None,
    );
    assert_eq!(s, 303, "{}", String::from_utf8_lossy(&b));
    assert!(header(&h, "set-cookie").unwrap().contains("Max-Age=0"));
}

/// A signed-out session is over on the server: the old cookie, replayed
/// after the sign-out, gets 401 on the snapshot API, while a fresh sign-in
/// works, and signing out of one session leaves another open.
#[test]
fn logout_ends_the_session_on_the_server() {
    let n = TestNode::start();
    let first = sign_in(&n, &[]);
    let second = sign_in(&n, &[]);
    assert_ne!(first, second, "each sign-in is its own session");
    assert_eq!(snapshot_with(&n, &first), 200);
    sign_out(&n, &first);
    let (s, _, body) = status(&n, SNAPSHOT, &[("cookie", &first)]);
    assert_eq!(s, 401, "the old cookie after sign-out: {body}");
    assert_eq!(json(&body)["error"]["code"], "MISSING_CREDENTIAL");
    assert_eq!(
        snapshot_with(&n, &second),
        200,
        "another session stays open"
    );
    let fresh = sign_in(&n, &[]);
    assert_eq!(snapshot_with(&n, &fresh), 200, "a fresh session works");
}

/// Sessions are bound to the operator key: after a restart on the same data
/// folder with another `MESHGATE_OPERATOR_KEY`, the old cookie gets 401 (the
/// new key signs in); and back on the first key, the session it opened
/// stays over (its record was deleted when the key changed).
#[test]
fn sessions_end_when_the_operator_key_changes() {
    if single_node_only() {
        return;
    }
    let mut n = TestNode::start();
    let old = sign_in(&n, &[]);
    assert_eq!(snapshot_with(&n, &old), 200);
    let dir = n.dir.clone();
    n.kill9();
    let other_key = "mgop_another_operator_key_9876543210";
    let with_key = |key: &str| NodeOpts {
        config: TEST_CONFIG.into(),
        data_dir: Some(dir.clone()),
        env: vec![("MESHGATE_OPERATOR_KEY".into(), key.into())],
        ..Default::default()
    };
    let mut n2 = TestNode::start_with(with_key(other_key));
    let (s, _, body) = status(&n2, SNAPSHOT, &[("cookie", &old)]);
    assert_eq!(s, 401, "a session of the old key: {body}");
    let (s, _, _) = status(
        &n2,
        SNAPSHOT,
        &[("authorization", &format!("Bearer {other_key}"))],
    );
    assert_eq!(s, 200, "the new key opens the dashboard");
    n2.kill9();
    let n3 = TestNode::start_with(with_key(OPERATOR_KEY));
    assert_eq!(
        snapshot_with(&n3, &old),
        401,
        "the old key back does not revive its session"
    );
    let fresh = sign_in(&n3, &[]);
    assert_eq!(snapshot_with(&n3, &fresh), 200);
    drop(n);
}

/// A cross-site form post to a state-changing dashboard route (sign-in,
/// sign-out) is refused 403 `CROSS_ORIGIN` before anything is done: another
/// origin, a sibling host, `Origin: null` (unless `Sec-Fetch-Site:
/// same-origin`), or no Origin with `Sec-Fetch-Site: cross-site` or
/// `same-site`. From the node's own origin, or with no Origin at all (curl),
/// the same posts are accepted.
#[test]
fn cross_origin_posts_are_refused() {
    let n = TestNode::start();
    let own = format!("http://{}", n.addr);
    let port = n.addr.rsplit(':').next().unwrap();
    let sibling = format!("http://ns-tenant.localhost:{port}");
    let form = ("content-type", "application/x-www-form-urlencoded");
    let body = format!("key={OPERATOR_KEY}");
    let session = sign_in(&n, &[]);
    for bad in [
        vec![("origin", "https://evil.example")],
        vec![("origin", sibling.as_str())],
        vec![("origin", "null")],
        vec![("origin", "null"), ("sec-fetch-site", "cross-site")],
        vec![("sec-fetch-site", "cross-site")],
        vec![("sec-fetch-site", "same-site")],
    ] {
        let mut hs = bad.clone();
        hs.push(form);
        let (s, h, b) = http("POST", &n.url("/__admin/login"), &hs, Some(body.as_bytes()));
        let b = String::from_utf8_lossy(&b);
        assert_eq!(s, 403, "sign-in with {bad:?}: {b}");
        assert_eq!(json(&b)["error"]["code"], "CROSS_ORIGIN");
        assert_eq!(header(&h, "set-cookie"), None, "no session opened");
        let mut hs = bad.clone();
        hs.push(("cookie", &session));
        let (s, _, b) = http("POST", &n.url("/__admin/logout"), &hs, None);
        assert_eq!(s, 403, "sign-out with {bad:?}");
        assert_eq!(
            json(&String::from_utf8_lossy(&b))["error"]["code"],
            "CROSS_ORIGIN"
        );
        assert_eq!(
            snapshot_with(&n, &session),
            200,
            "the session is still open"
        );
    }
    // The node's own origin (what the sign-in form sends), and no Origin.
    let cookie = sign_in(&n, &[("origin", &own), ("sec-fetch-site", "same-origin")]);
    assert_eq!(snapshot_with(&n, &cookie), 200);
    let cookie = sign_in(&n, &[]);
    assert_eq!(snapshot_with(&n, &cookie), 200);
    // What a browser sends from a page under `Referrer-Policy: no-referrer`.
    let cookie = sign_in(&n, &[("origin", "null"), ("sec-fetch-site", "same-origin")]);
    assert_eq!(snapshot_with(&n, &cookie), 200);
    sign_out(&n, &session);
    assert_eq!(
        snapshot_with(&n, &session),
        401,
        "signed out from its own origin"
    );
}

/// In a 3-node etcd cluster a session made on one node opens the dashboard on
/// every node (the record is in etcd); signed out on another node, it is
/// refused everywhere (within the nodes' short session cache), while a fresh
/// session works.
#[cfg(feature = "cluster")]
#[test]
fn logout_on_one_node_ends_the_session_on_every_node() {
    use crate::common::{free_port, wait_until};
    use crate::etcd_process::EtcdProcess;
    use std::time::Duration;
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let nodes: Vec<TestNode> = std::thread::scope(|s| {
        let started: Vec<_> = ["a", "b", "c"]
            .into_iter()
            .map(|id| {
                let opts = NodeOpts {
                    config: format!(
                        "{TEST_CONFIG}[cluster]\n{}node_id = \"{id}\"\nregister_seconds = 1\n",
                        etcd.cluster_toml()
                    ),
                    env: vec![(
                        "MESHGATE_CLUSTER_SECRET".into(),
                        "dashboard-session-cluster-secret".into(),
                    )],
                    // A folder of its own: each node's config file is
                    // written beside its data folder, at once.
                    data_dir: Some(tmp.path().join(id).join("data")),
                    listen: Some(format!("127.0.0.1:{}", free_port())),
                    ..Default::default()
                };
                s.spawn(move || TestNode::start_with(opts))
            })
            .collect();
        started.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let cookie = sign_in(&nodes[0], &[]);
    for n in &nodes {
        assert_eq!(snapshot_with(n, &cookie), 200, "on {}", n.base);
    }
    sign_out(&nodes[2], &cookie);
    for n in &nodes {
        wait_until(
            Duration::from_secs(30),
            "the signed-out session still opens the dashboard",
            || snapshot_with(n, &cookie) == 401,
        );
    }
    let fresh = sign_in(&nodes[1], &[]);
    for n in &nodes {
        assert_eq!(
            snapshot_with(n, &fresh),
            200,
            "a fresh session on {}",
            n.base
        );
    }
}
