//! Operator → dashboard boundary: `/__admin` trusts no source address. Behind
//! the usual TLS proxy on loopback every public request arrives from
//! 127.0.0.1, so only the operator key or its signed-in session cookie opens
//! the dashboard. See docs/security.md.

use crate::common::{NodeOpts, OPERATOR_KEY, TEST_CONFIG, TestNode, header, http, json};

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
