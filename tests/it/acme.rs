//! ACME for deployment hosts with `tls: "auto"` (docs/deployments.md
//! "ACME"), against Debian's `pebble` started here, fully offline: pebble's
//! own listener has a certificate the test makes (its CA is the node's
//! `ca_bundle`), and pebble resolves every name through
//! `pebble-challtestsrv` on 127.0.0.1, which answers 127.0.0.1 for all of
//! them; its validator connects to the node's `http_listen` (HTTP-01) and
//! TLS listener (TLS-ALPN-01). No packet leaves 127.0.0.0/8.

use crate::common::*;
use crate::deploy::certs::{API, api, names_of, namespace, served_leaf, tls_node_with};
use rcgen::{CertificateParams, KeyPair};
use std::process::{Child, Command};
use std::time::Duration;

/// pebble and its DNS server, stopped on drop.
struct Pebble {
    children: Vec<Child>,
    /// The directory URL.
    directory: String,
    /// The CA that signed pebble's listener certificate (the node's `ca_bundle`).
    ca_file: std::path::PathBuf,
    /// pebble's output, for failure messages.
    log: std::path::PathBuf,
}

impl Drop for Pebble {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn need(bin: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "{bin} is missing: scripts/test.sh installs it (apt-get install pebble)"
    );
}

impl Pebble {
    /// pebble whose validator connects to `http_port` (HTTP-01) and
    /// `tls_port` (TLS-ALPN-01) on 127.0.0.1; `dir` holds its files.
    fn start(dir: &std::path::Path, http_port: u16, tls_port: u16) -> Pebble {
        need("pebble");
        need("pebble-challtestsrv");
        // A CA of the test's own, and pebble's listener certificate from it.
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "pebble listener test CA");
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        p.subject_alt_names
            .push(rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap()));
        let leaf = p.signed_by(&key, &ca_cert, &ca_key).unwrap();
        let ca_file = dir.join("pebble-ca.pem");
        std::fs::write(&ca_file, ca_cert.pem()).unwrap();
        std::fs::write(dir.join("pebble-cert.pem"), leaf.pem()).unwrap();
        std::fs::write(dir.join("pebble-key.pem"), key.serialize_pem()).unwrap();
        let (listen, mgmt, dns, dns_mgmt) = (free_port(), free_port(), free_port(), free_port());
        let config = serde_json::json!({"pebble": {
            "listenAddress": format!("127.0.0.1:{listen}"),
            "managementListenAddress": format!("127.0.0.1:{mgmt}"),
            "certificate": dir.join("pebble-cert.pem"),
            "privateKey": dir.join("pebble-key.pem"),
            "httpPort": http_port,
            "tlsPort": tls_port,
            "ocspResponderURL": "",
            "externalAccountBindingRequired": false
        }});
        std::fs::write(dir.join("pebble.json"), config.to_string()).unwrap();
        let log = dir.join("pebble.log");
        let out = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .unwrap()
        };
        let mut children = Vec::new();
        children.push(
            Command::new("pebble-challtestsrv")
                .args(["-defaultIPv4", "127.0.0.1", "-defaultIPv6", ""])
                .args(["-dns01", &format!("127.0.0.1:{dns}")])
                .args(["-http01", "", "-https01", "", "-tlsalpn01", ""])
                .args(["-management", &format!("127.0.0.1:{dns_mgmt}")])
                .stdout(out())
                .stderr(out())
                .spawn()
                .expect("start pebble-challtestsrv"),
        );
        children.push(
            Command::new("pebble")
                .arg("-config")
                .arg(dir.join("pebble.json"))
                .args(["-dnsserver", &format!("127.0.0.1:{dns}")])
                .env("PEBBLE_VA_NOSLEEP", "1")
                .env("PEBBLE_WFE_NONCEREJECT", "0")
                .env("PEBBLE_AUTHZREUSE", "0")
                .stdout(out())
                .stderr(out())
                .spawn()
                .expect("start pebble"),
        );
        let me = Pebble {
            children,
            directory: format!("https://127.0.0.1:{listen}/dir"),
            ca_file,
            log,
        };
        wait_until(Duration::from_secs(30), "pebble listens", || {
            std::net::TcpStream::connect(("127.0.0.1", listen)).is_ok()
                && std::net::TcpStream::connect(("127.0.0.1", dns_mgmt)).is_ok()
        });
        me
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Orders pebble was asked for (its log names each new order).
    fn orders(&self) -> usize {
        self.log()
            .lines()
            .filter(|l| l.contains("orders in the db"))
            .count()
    }
}

/// The `[tls.acme]` section of a node ordering from `pebble`.
/// With TLS-ALPN-01 the node has no HTTP-01 listener at all (pebble's
/// `httpPort` leads nowhere), so only the TLS listener can validate.
fn acme_config(pebble: &Pebble, challenge: &str, http_port: u16, extra: &str) -> String {
    let http_listen = if challenge == "http-01" {
        format!("http_listen = \"127.0.0.1:{http_port}\"\n")
    } else {
        String::new()
    };
    format!(
        "[tls.acme]\ndirectory = {:?}\nemail = \"ops@example.test\"\nca_bundle = {:?}\n\
         challenge = {challenge:?}\n{http_listen}check_seconds = 1\n\
         retry_min_seconds = 1\nretry_max_seconds = 2\norder_timeout_seconds = 60\n{extra}",
        pebble.directory, pebble.ca_file
    )
}

/// A deployment `name` of `hosts` with `tls: "auto"`.
fn deploy_auto(node: &TestNode, key: &str, name: &str, hosts: &[&str]) -> (u16, serde_json::Value) {
    let body = serde_json::json!({"name": name, "hosts": hosts, "tls": "auto",
        "upstream": {"instances": ["http://127.0.0.1:9"]}});
    api(
        node,
        key,
        "POST",
        "/v1/deployments",
        "application/json",
        body.to_string().as_bytes(),
    )
}

/// `GET /v1/deployments/{name}/certificate`: the status and its `certificate`.
fn certificate(node: &TestNode, key: &str, name: &str) -> (u16, serde_json::Value) {
    let (s, v) = api(
        node,
        key,
        "GET",
        &format!("/v1/deployments/{name}/certificate"),
        "application/json",
        b"",
    );
    (
        s,
        if s == 200 {
            v["certificate"].clone()
        } else {
            v
        },
    )
}

/// The leaf's serial and issuer.
fn serial_issuer(der: &[u8]) -> (String, String) {
    let (_, c) = x509_parser::parse_x509_certificate(der).unwrap();
    (c.raw_serial_as_string(), c.issuer().to_string())
}

fn metric(node: &TestNode, series: &str) -> f64 {
    let (_, b, _) = crate::deploy::certs::tls_request(
        &node.addr,
        API,
        API,
        "GET",
        "/metrics",
        &[OPERATOR_AUTH],
        b"",
    );
    b.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// A node (own pair for `node.test`) ordering from pebble with `challenge`,
/// pebble's validator pointed at its listeners.
fn node_and_pebble(tmp: &std::path::Path, challenge: &str, extra: &str) -> (TestNode, Pebble) {
    let (tls_port, http_port) = (free_port(), free_port());
    let pebble = Pebble::start(tmp, http_port, tls_port);
    let node = tls_node_with(
        tmp,
        &acme_config(&pebble, challenge, http_port, extra),
        NodeOpts {
            listen: Some(format!("127.0.0.1:{tls_port}")),
            ..Default::default()
        },
    );
    (node, pebble)
}

/// Waits for pebble's certificate (issuer "Pebble Intermediate CA") on
/// `host`; returns its leaf's DER.
fn wait_issued(node: &TestNode, pebble: &Pebble, host: &str, not_serial: Option<&str>) -> Vec<u8> {
    let mut leaf = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let der = served_leaf(&node.addr, host);
        let (serial, issuer) = serial_issuer(&der);
        if issuer.contains("Pebble") && not_serial != Some(serial.as_str()) {
            leaf = der;
        }
        if !leaf.is_empty() {
            return leaf;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no certificate from pebble for {host}\n--- node ---\n{}\n--- pebble ---\n{}",
            node.stderr.lock().unwrap(),
            pebble.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// HTTP-01: a host with `tls: "auto"` gets pebble's certificate, served by
/// SNI; the certificate view shows it `valid`; unknown tokens are 404.
#[test]
fn http01_certificate_is_issued_and_served() {
    let tmp = tempfile::tempdir().unwrap();
    let (node, pebble) = node_and_pebble(tmp.path(), "http-01", "");
    let key = namespace(&node, "acmehttp");
    let (s, v) = deploy_auto(
        &node,
        &key,
        "shop",
        &["shop.acme-http.test", "www.acme-http.test"],
    );
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["deployment"]["tls"], "auto", "{v}");
    let leaf = wait_issued(&node, &pebble, "shop.acme-http.test", None);
    assert_eq!(
        names_of(&leaf),
        vec!["shop.acme-http.test", "www.acme-http.test"]
    );
    // The other host is served the same certificate; the API name keeps the node's pair.
    assert_eq!(served_leaf(&node.addr, "www.acme-http.test"), leaf);
    assert_eq!(names_of(&served_leaf(&node.addr, API)), vec![API]);
    wait_until(Duration::from_secs(30), "the state is valid", || {
        certificate(&node, &key, "shop").1["acme"]["state"] == "valid"
    });
    let (s, v) = certificate(&node, &key, "shop");
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["state"], "active", "{v}");
    assert!(v["issuer"].as_str().unwrap().contains("Pebble"), "{v}");
    assert_eq!(v["acme"]["last_error"], serde_json::Value::Null, "{v}");
    assert!(v["acme"]["renew_at"].is_string(), "{v}");
    assert!(v.get("key_pem").is_none() && !v.to_string().contains("PRIVATE KEY"));
    assert_eq!(
        metric(&node, "meshgate_acme_orders_total{outcome=\"issued\"}"),
        1.0
    );
    assert_eq!(pebble.orders(), 1, "{}", pebble.log());
    wait_until(Duration::from_secs(10), "the gauge counts it valid", || {
        metric(&node, "meshgate_acme_certificates{state=\"valid\"}") == 1.0
    });
    // The challenge listener answers nothing but known tokens.
    let http_port = acme_http_port(&node);
    for path in [
        "/.well-known/acme-challenge/unknownToken123",
        "/.well-known/acme-challenge/..%2f..%2fetc",
        "/v1/namespaces",
    ] {
        let (s, _, b) = http(
            "GET",
            &format!("http://127.0.0.1:{http_port}{path}"),
            &[],
            None,
        );
        assert_eq!(s, 404, "{path}: {}", String::from_utf8_lossy(&b));
    }
}

fn acme_http_port(node: &TestNode) -> u16 {
    let cfg = std::fs::read_dir(node.dir.parent().unwrap())
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("config-"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .unwrap();
    cfg.lines()
        .find_map(|l| l.strip_prefix("http_listen = \"127.0.0.1:"))
        .and_then(|p| p.trim_end_matches('"').parse().ok())
        .unwrap()
}

/// TLS-ALPN-01: the validator's `acme-tls/1` handshake gets the challenge
/// certificate; the issued certificate is then served by SNI.
#[test]
fn tls_alpn01_certificate_is_issued_and_served() {
    let tmp = tempfile::tempdir().unwrap();
    let (node, pebble) = node_and_pebble(tmp.path(), "tls-alpn-01", "");
    let key = namespace(&node, "acmealpn");
    let (s, v) = deploy_auto(&node, &key, "site", &["site.acme-alpn.test"]);
    assert_eq!(s, 201, "{v}");
    let leaf = wait_issued(&node, &pebble, "site.acme-alpn.test", None);
    assert_eq!(names_of(&leaf), vec!["site.acme-alpn.test"]);
    assert_eq!(pebble.orders(), 1, "{}", pebble.log());
    wait_until(Duration::from_secs(30), "the state is valid", || {
        certificate(&node, &key, "site").1["acme"]["state"] == "valid"
    });
    // The challenge is gone: an `acme-tls/1` handshake gets no certificate
    // (never the served one, never the node's pair), for this host or another.
    for sni in ["site.acme-alpn.test", API] {
        assert!(acme_tls_handshake(&node.addr, sni).is_err(), "{sni}");
    }
}

/// A handshake offering only ALPN `acme-tls/1`, as a CA's validator does.
fn acme_tls_handshake(addr: &str, sni: &str) -> Result<(), rustls::Error> {
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(crate::deploy::certs::any_cert(provider))
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"acme-tls/1".to_vec()];
    let name = rustls_pki_types::ServerName::try_from(sni.to_string()).unwrap();
    let mut conn = rustls::ClientConnection::new(std::sync::Arc::new(cfg), name).unwrap();
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    while conn.is_handshaking() {
        conn.complete_io(&mut sock)
            .map_err(|e| rustls::Error::General(e.to_string()))?;
    }
    Ok(())
}

/// A renewal window set by config: the certificate is ordered again once
/// it is `renew_after_seconds` old, and the next handshake gets the new one.
#[test]
fn certificate_is_renewed_when_due() {
    let tmp = tempfile::tempdir().unwrap();
    let (node, pebble) = node_and_pebble(tmp.path(), "http-01", "renew_after_seconds = 5\n");
    let key = namespace(&node, "acmerenew");
    let (s, v) = deploy_auto(&node, &key, "shop", &["shop.acme-renew.test"]);
    assert_eq!(s, 201, "{v}");
    let first = wait_issued(&node, &pebble, "shop.acme-renew.test", None);
    let (serial, _) = serial_issuer(&first);
    let second = wait_issued(&node, &pebble, "shop.acme-renew.test", Some(&serial));
    assert_ne!(serial_issuer(&second).0, serial);
    assert_eq!(names_of(&second), vec!["shop.acme-renew.test"]);
    wait_until(Duration::from_secs(30), "two orders counted", || {
        metric(&node, "meshgate_acme_orders_total{outcome=\"issued\"}") >= 2.0
    });
}

/// A CA that cannot be reached: the deployment is created, its certificate
/// shows `failed` with the error and the next attempt, `/metrics` counts
/// the failure, and its hosts keep the node's pair.
#[test]
fn unreachable_ca_is_shown_as_failed() {
    let tmp = tempfile::tempdir().unwrap();
    let own = tmp.path();
    // A CA file that parses, and a directory nothing listens on.
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    std::fs::write(own.join("ca.pem"), ca.self_signed(&ca_key).unwrap().pem()).unwrap();
    let dead = free_port();
    let http_port = free_port();
    let node = tls_node_with(
        own,
        &format!(
            "[tls.acme]\ndirectory = \"https://127.0.0.1:{dead}/dir\"\nemail = \"ops@example.test\"\n\
             ca_bundle = {:?}\nhttp_listen = \"127.0.0.1:{http_port}\"\ncheck_seconds = 1\n\
             retry_min_seconds = 30\nretry_max_seconds = 60\n",
            own.join("ca.pem")
        ),
        NodeOpts::default(),
    );
    let key = namespace(&node, "acmefail");
    let (s, v) = deploy_auto(&node, &key, "shop", &["shop.acme-fail.test"]);
    assert_eq!(s, 201, "{v}");
    let mut last = serde_json::Value::Null;
    wait_until(Duration::from_secs(60), "the state is failed", || {
        last = certificate(&node, &key, "shop").1;
        last["acme"]["state"] == "failed"
    });
    let err = last["acme"]["last_error"].as_str().unwrap_or_default();
    assert!(err.contains(&dead.to_string()), "{last}");
    assert!(last["acme"]["next_attempt"].is_string(), "{last}");
    assert_eq!(last["acme"]["failures"], 1, "{last}");
    assert_eq!(last["state"], "none", "{last}");
    assert_eq!(
        metric(&node, "meshgate_acme_orders_total{outcome=\"failed\"}"),
        1.0
    );
    wait_until(
        Duration::from_secs(10),
        "the gauge counts it failed",
        || metric(&node, "meshgate_acme_certificates{state=\"failed\"}") == 1.0,
    );
    // Backoff: no second attempt within the first retry's 30 s.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        metric(&node, "meshgate_acme_orders_total{outcome=\"failed\"}"),
        1.0
    );
    assert_eq!(
        names_of(&served_leaf(&node.addr, "shop.acme-fail.test")),
        vec![API]
    );
}

/// Bad input: `tls` other than `"auto"` is 400 `INVALID_FIELD` on a node with ACME.
#[test]
fn tls_mode_other_than_auto_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let own = tmp.path();
    let ca_key = KeyPair::generate().unwrap();
    let ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    std::fs::write(own.join("ca.pem"), ca.self_signed(&ca_key).unwrap().pem()).unwrap();
    let node = tls_node_with(
        own,
        &format!(
            "[tls.acme]\ndirectory = \"https://127.0.0.1:{}/dir\"\nemail = \"ops@example.test\"\n\
             ca_bundle = {:?}\nchallenge = \"tls-alpn-01\"\n",
            free_port(),
            own.join("ca.pem")
        ),
        NodeOpts::default(),
    );
    let key = namespace(&node, "acmebad");
    let body = serde_json::json!({"name": "x", "hosts": ["x.acme-bad.test"], "tls": "manual",
        "upstream": {"instances": ["http://127.0.0.1:9"]}});
    let (s, v) = api(
        &node,
        &key,
        "POST",
        "/v1/deployments",
        "application/json",
        body.to_string().as_bytes(),
    );
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["code"], "INVALID_FIELD", "{v}");
    let (s, _) = api(
        &node,
        &key,
        "GET",
        "/v1/deployments/x",
        "application/json",
        b"",
    );
    assert_eq!(s, 404);
}

/// Three nodes on one etcd (TLS between them): the deployment is made
/// through one, pebble's validator reaches only another, and exactly one
/// order is made (pebble's count and the nodes' metrics); all three serve
/// the issued certificate.
#[cfg(feature = "cluster")]
#[test]
fn three_nodes_make_one_order_and_all_serve_it() {
    use crate::cluster::member_opts;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // The nodes' own pair: `node.test` and 127.0.0.1 (their advertise
    // address), from a CA that is their peer CA.
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec![API.to_string()]).unwrap();
    p.subject_alt_names
        .push(rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap()));
    let leaf = p.signed_by(&key, &ca_cert, &ca_key).unwrap();
    std::fs::write(dir.join("cert.pem"), leaf.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
    std::fs::write(dir.join("peer-ca.pem"), ca_cert.pem()).unwrap();
    let etcd = crate::etcd_process::EtcdProcess::start();
    let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
    // The validator reaches node "b" only.
    let pebble = Pebble::start(dir, ports[1].1, ports[1].0);
    let nodes: Vec<TestNode> = ["a", "b", "c"]
        .iter()
        .zip(&ports)
        .map(|(id, (tls, http))| {
            let mut o = member_opts(&etcd, id, *tls, dir);
            o.config = format!(
                "{}advertise = \"https://127.0.0.1:{tls}\"\npeer_ca_file = {:?}\n",
                o.config.replacen(TEST_CONFIG, "", 1),
                dir.join("peer-ca.pem")
            );
            tls_node_with(dir, &acme_config(&pebble, "http-01", *http, ""), o)
        })
        .collect();
    let key = namespace(&nodes[0], "acmecluster");
    let (s, v) = deploy_auto(&nodes[0], &key, "shop", &["shop.acme-cluster.test"]);
    assert_eq!(s, 201, "{v}");
    let leaf = wait_issued(&nodes[0], &pebble, "shop.acme-cluster.test", None);
    for n in &nodes {
        wait_until(Duration::from_secs(10), "every node serves it", || {
            served_leaf(&n.addr, "shop.acme-cluster.test") == leaf
        });
    }
    // Several check rounds later still one order, made by one node.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(pebble.orders(), 1, "{}", pebble.log());
    let issued: f64 = nodes
        .iter()
        .map(|n| metric(n, "meshgate_acme_orders_total{outcome=\"issued\"}"))
        .sum();
    assert_eq!(issued, 1.0);
    let failed: f64 = nodes
        .iter()
        .map(|n| metric(n, "meshgate_acme_orders_total{outcome=\"failed\"}"))
        .sum();
    assert_eq!(failed, 0.0);
}
