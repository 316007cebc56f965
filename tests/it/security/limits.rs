//! The client rate limits that stand between a guesser and the sign-in
//! (issue #43): the credential bucket of the sign-in and token routes, per
//! client address, and the exemption of node-to-node hops from the client
//! limit of the member they reach.

use crate::common::*;

/// A POST of a JSON body from `local` (a loopback address of the test's
/// choice, so each is "another client") to `base`.
fn post_from(local: &str, base: &str, path: &str, body: &str) -> (u16, Option<String>, String) {
    let (s, h, b) = http_from(
        Some(local),
        "POST",
        &format!("{base}{path}"),
        &[("content-type", "application/json")],
        Some(body.as_bytes()),
    );
    (
        s,
        header(&h, "retry-after").map(str::to_string),
        String::from_utf8_lossy(&b).into_owned(),
    )
}

fn code(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
        .unwrap_or_default()
}

/// Guessing API keys at `POST /v1/auth/token` is capped per client address
/// by the credential bucket (`credential_per_minute`/`credential_burst`,
/// here 1/3 with a general bucket that never empties): three wrong keys are
/// 401, then even the right key is 429 `RATE_LIMITED` with `Retry-After`, as
/// is `/v1/auth/refresh` and `/v1/auth/challenge` (the same bucket). Another
/// address still exchanges the key, and the guessing address still reaches
/// the ordinary routes (the general bucket is another one).
#[test]
fn sign_in_guessing_is_capped_per_client_address() {
    let node = TestNode::start_with(NodeOpts {
        config: "[rate_limit]\ngeneral_per_minute = 1000000\ngeneral_burst = 100000\n\
                 credential_per_minute = 1\ncredential_burst = 3\n"
            .into(),
        ..Default::default()
    });
    let key = node.create_namespace("vault");
    let right = format!(r#"{{"api_key":"{key}"}}"#);
    for i in 0..3 {
        let wrong = format!(r#"{{"api_key":"mgk_guess_{i:030}"}}"#);
        let (s, _, b) = post_from("127.0.0.1", &node.base, "/v1/auth/token", &wrong);
        assert_eq!(s, 401, "guess {i}: {b}");
    }
    let (s, after, b) = post_from("127.0.0.1", &node.base, "/v1/auth/token", &right);
    assert_eq!((s, code(&b).as_str()), (429, "RATE_LIMITED"), "{b}");
    assert!(
        after
            .as_deref()
            .and_then(|a| a.parse::<u64>().ok())
            .is_some_and(|a| a >= 1),
        "429 with Retry-After: {after:?}"
    );
    for path in ["/v1/auth/refresh", "/v1/auth/challenge"] {
        let (s, _, b) = post_from("127.0.0.1", &node.base, path, "{}");
        assert_eq!((s, code(&b).as_str()), (429, "RATE_LIMITED"), "{path}: {b}");
    }
    // Another client address has its own bucket: the right key works there.
    let (s, _, b) = post_from("127.0.0.2", &node.base, "/v1/auth/token", &right);
    assert_eq!(s, 200, "{b}");
    let token = json(&b)["access_token"].as_str().unwrap().to_string();
    // The guessing address is not locked out of the ordinary routes.
    let auth = format!("Bearer {token}");
    let (s, _, b) = http_from(
        Some("127.0.0.1"),
        "GET",
        &node.url("/v1/auth/whoami"),
        &[("authorization", &auth)],
        None,
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
}

/// A member does not charge what another node forwards to it to that node's
/// address: B's general bucket holds 3 requests a minute, A's is
/// unbounded; ten KV reads sent to A for a namespace on B are all forwarded
/// and answered by B (A and the client share 127.0.0.1), and B's bucket of
/// 127.0.0.1 is still full afterwards: three direct requests to B pass, the
/// fourth is 429 `RATE_LIMITED`.
#[cfg(feature = "cluster")]
#[test]
fn forwarded_hops_are_not_charged_to_the_forwarding_node() {
    let etcd = crate::etcd_process::EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let start = |id: &str, strict: bool| {
        let mut opts = crate::cluster::member_opts(&etcd, id, free_port(), tmp.path());
        if strict {
            opts.config = opts.config.replace(
                "general_per_minute = 1000000\ngeneral_burst = 100000\n",
                "general_per_minute = 1\ngeneral_burst = 3\n",
            );
            assert!(opts.config.contains("general_burst = 3\n"));
        }
        TestNode::start_with(opts)
    };
    let b = start("b", true);
    let a = start("a", false);
    let (s, body) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"shop","members":["b"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    let key = json(&body)["api_key"].as_str().unwrap().to_string();
    let auth = format!("Bearer {key}");
    let read = |node: &TestNode| {
        let (s, h, body) = http(
            "GET",
            &node.url("/v1/kv/missing"),
            &[("authorization", &auth)],
            None,
        );
        (
            s,
            header(&h, "x-meshgate-member").map(str::to_string),
            String::from_utf8_lossy(&body).into_owned(),
        )
    };
    for i in 0..10 {
        let (s, member, body) = read(&a);

        assert_eq!(
            (s, member.as_deref(), code(&body).as_str()),
            (404, Some("b"), "KEY_NOT_FOUND"),
            "forwarded read {i}: {body}"
        );
    }
    // B's bucket of 127.0.0.1 was never charged by the hops.
    for i in 0..3 {
        let (s, _, body) = read(&b);
        assert_eq!(s, 404, "direct read {i}: {body}");
    }
    let (s, _, body) = read(&b);
    assert_eq!(
        (s, code(&body).as_str()),
        (429, "RATE_LIMITED"),
        "B's own limit holds for a client: {body}"
    );
}

/// The attack: 24 anonymous clients (each its own address) flood bank's
/// public site (a proxied upstream host and a static site host) while bank's
/// owner calls its API. With small buckets (namespace and anonymous 600 a
/// minute, burst 20) at least 99% of the owner's calls (here every one) are
/// answered, not 429; the flood is refused by its own bucket (429
/// `ANONYMOUS_RATE_LIMITED`) and gets no more than that bucket lets through.
#[test]
fn an_anonymous_flood_cannot_starve_the_owners_api() {
    use crate::deploy::{ALLOW_LOOPBACK, Upstream, deploy_json, deploy_static, tarball};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::{Duration, Instant};
    let node = TestNode::start_with(NodeOpts {
        config: format!(
            "[rate_limit]\ngeneral_per_minute = 1000000\ngeneral_burst = 100000\n\
             credential_per_minute = 100000\ncredential_burst = 10000\n\
             namespace_per_minute = 600\nnamespace_burst = 20\n\
             anonymous_per_minute = 600\nanonymous_burst = 20\n[deploy]\n{ALLOW_LOOPBACK}"
        ),
        ..Default::default()
    });
    let bank = node.create_namespace("bank");
    let up = Upstream::start("bank-api");
    let (s, v) = deploy_json(
        &node,
        &bank,
        serde_json::json!({"name": "www", "hosts": ["www.bank.test"], "upstream": {"instances": [up.url()]}}),
    );
    assert_eq!(s, 201, "{v}");
    let (s, b) = deploy_static(
        &node,
        &bank,
        "site",
        "site.bank.test",
        &tarball(&[("index.html", 'f', b"<h1>bank</h1>")]),
    );
    assert_eq!(s, 201, "{b}");
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, refused, other) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let start = Instant::now();
    let flood: Vec<_> = (0..24)
        .map(|i| {
            let (base, stop) = (node.base.clone(), stop.clone());
            let (ok, refused, other) = (ok.clone(), refused.clone(), other.clone());
            std::thread::spawn(move || {
                let local = format!("127.0.0.{}", 10 + i);
                let host = if i % 2 == 0 {
                    "www.bank.test"
                } else {
                    "site.bank.test"
                };
                // Bounded: until told to stop, at most 2,000 requests each.
                for _ in 0..2_000 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let (s, _, b) = http_from(
                        Some(&local),
                        "GET",
                        &format!("{base}/"),
                        &[("host", host)],
                        None,
                    );
                    match s {
                        200 => ok.fetch_add(1, Ordering::Relaxed),
                        429 if code(&String::from_utf8_lossy(&b)) == "ANONYMOUS_RATE_LIMITED" => {
                            refused.fetch_add(1, Ordering::Relaxed)
                        }
                        _ => other.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    // The owner: 30 API calls, one every 150 ms (within its 10 a second).
    let mut answered = 0;
    for _ in 0..30 {
        std::thread::sleep(Duration::from_millis(150));
        let (s, b) = node.with_key(&bank, "GET", "/v1/kv/balance", None);
        if s == 404 {
            answered += 1;
        } else {
            assert_eq!(s, 429, "{b}");
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in flood {
        t.join().unwrap();
    }
    let took = start.elapsed().as_secs_f64();
    let (ok, refused, other) = (
        ok.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        other.load(Ordering::Relaxed),
    );
    println!(
        "owner API: {answered}/30 answered ({:.0}%); anonymous flood over {took:.1} s: {ok} served, {refused} refused, {other} other",
        answered as f64 * 100.0 / 30.0
    );
    assert!(
        answered * 100 >= 30 * 99,
        "owner's calls answered: {answered}/30"
    );
    assert_eq!(
        other, 0,
        "every flood request is served or refused by its bucket"
    );
    assert!(refused > 0, "the flood met its bucket");
    // The anonymous bucket's burst and refill (10 a second), and a second's slack.
    assert!(
        ok as f64 <= 20.0 + 10.0 * (took + 1.0),
        "{ok} flood requests served in {took:.1} s"
    );
}
