//! Per-host certificates (docs/deployments.md "Certificates"): uploaded for
//! a deployment, checked before anything is stored, served by SNI (rustls
//! client here, the leaf's names read from the handshake), the node's own
//! pair for every other name, replaced without a restart, removed with the
//! deployment, and the key sealed on disk.

use crate::common::*;
use rcgen::{CertificateParams, KeyPair};
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

/// A certificate and its key, in PEM.
pub(crate) struct Pair {
    pub cert: String,
    pub key: String,
}

/// A self-signed certificate for `names`, valid from `from` to `until` (years).
fn self_signed(names: &[&str], from: i32, until: i32) -> Pair {
    let key = KeyPair::generate().unwrap();
    let mut p =
        CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    p.not_before = rcgen::date_time_ymd(from, 1, 1);
    p.not_after = rcgen::date_time_ymd(until, 1, 1);
    p.distinguished_name
        .push(rcgen::DnType::CommonName, names[0].to_string());
    let cert = p.self_signed(&key).unwrap();
    Pair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

/// A certificate for `names` valid now (2020 to 2090).
pub(crate) fn current(names: &[&str]) -> Pair {
    self_signed(names, 2020, 2090)
}

/// A leaf for `names` signed by a CA of its own: the chain is leaf then CA.
fn ca_signed(names: &[&str]) -> Pair {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "Test Issuing CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let p =
        CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    let leaf = p.signed_by(&key, &ca_cert, &ca_key).unwrap();
    Pair {
        cert: format!("{}{}", leaf.pem(), ca_cert.pem()),
        key: key.serialize_pem(),
    }
}

/// Accepts any server certificate: the tests read which one was served.
#[derive(Debug)]
struct AnyCert(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCert {
    fn verify_server_cert(
        &self,
        _: &rustls_pki_types::CertificateDer<'_>,
        _: &[rustls_pki_types::CertificateDer<'_>],
        _: &rustls_pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls_pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &rustls_pki_types::CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &rustls_pki_types::CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A verifier that accepts any server certificate.
pub(crate) fn any_cert(
    provider: Arc<rustls::crypto::CryptoProvider>,
) -> Arc<dyn rustls::client::danger::ServerCertVerifier> {
    Arc::new(AnyCert(provider))
}

fn client_config() -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCert(provider)))
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(cfg)
}

/// One HTTP/1.1 request over TLS with `sni` (the Host header is `host`):
/// the status, the body, and the DNS names of the leaf the node served.
pub(crate) fn tls_request(
    addr: &str,
    sni: &str,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String, Vec<String>) {
    let (s, _, b, n) = tls_exchange(addr, sni, host, method, path, headers, body);
    (s, b, n)
}

/// The same, with the answer's head (lower case) too.
pub(crate) fn tls_exchange(
    addr: &str,
    sni: &str,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String, String, Vec<String>) {
    let name = rustls_pki_types::ServerName::try_from(sni.to_string()).unwrap();
    let conn = rustls::ClientConnection::new(client_config(), name).unwrap();
    let sock = std::net::TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut tls = rustls::StreamOwned::new(conn, sock);
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    tls.write_all(req.as_bytes()).unwrap();
    tls.write_all(body).unwrap();
    tls.flush().unwrap();
    let mut raw = Vec::new();
    let _ = tls.read_to_end(&mut raw);
    let leaf = tls.conn.peer_certificates().unwrap()[0].clone();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let body = if text
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    (
        status,
        head.to_ascii_lowercase(),
        body,
        names_of(leaf.as_ref()),
    )
}

fn dechunk(mut b: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = b.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        b = &rest[n + 2..];
    }
    out
}

/// Only the handshake: the DER of the leaf served for `sni`.
pub(crate) fn served_leaf(addr: &str, sni: &str) -> Vec<u8> {
    let name = rustls_pki_types::ServerName::try_from(sni.to_string()).unwrap();
    let mut conn = rustls::ClientConnection::new(client_config(), name).unwrap();
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    while conn.is_handshaking() {
        conn.complete_io(&mut sock).unwrap();
    }
    conn.peer_certificates().unwrap()[0].as_ref().to_vec()
}

/// Only the handshake: the DNS names of the leaf served for `sni`.
pub(crate) fn served_names(addr: &str, sni: &str) -> Vec<String> {
    let name = rustls_pki_types::ServerName::try_from(sni.to_string()).unwrap();
    let mut conn = rustls::ClientConnection::new(client_config(), name).unwrap();
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    while conn.is_handshaking() {
        conn.complete_io(&mut sock).unwrap();
    }
    names_of(conn.peer_certificates().unwrap()[0].as_ref())
}

pub(crate) fn names_of(der: &[u8]) -> Vec<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).unwrap();
    let mut names: Vec<String> = cert
        .subject_alternative_name()
        .unwrap()
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|g| match g {
                    x509_parser::extensions::GeneralName::DNSName(d) => Some(d.to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// The node's own pair is for `node.test`; API calls use that name.
pub(crate) const API: &str = "node.test";

/// A TLS node whose own pair covers `node.test`, loopback upstreams allowed.
pub(crate) fn tls_node(dir: &std::path::Path) -> TestNode {
    tls_node_with(dir, "", NodeOpts::default())
}

/// The same, with `extra` after its `[tls]` section's keys (a `[tls.acme]`
/// section) and `opts`' listen address, environment and data folder.
/// A pair already in `dir` (`cert.pem`, `key.pem`) is kept.
pub(crate) fn tls_node_with(dir: &std::path::Path, extra: &str, opts: NodeOpts) -> TestNode {
    if !dir.join("cert.pem").exists() {
        let own = current(&[API]);
        std::fs::write(dir.join("cert.pem"), &own.cert).unwrap();
        std::fs::write(dir.join("key.pem"), &own.key).unwrap();
    }
    let node = TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}{}[deploy]\nupstream_allow = [\"127.0.0.0/8\"]\n[tls]\ncert_file = {:?}\nkey_file = {:?}\n{extra}",
            opts.config,
            dir.join("cert.pem"),
            dir.join("key.pem")
        ),
        no_wait_ready: true,
        ..opts
    });
    wait_until(Duration::from_secs(30), "the TLS node answers", || {
        std::net::TcpStream::connect(&node.addr).is_ok()
            && tls_request(&node.addr, API, API, "GET", "/readyz", &[], b"").0 == 200
    });
    node
}

/// A call to the node's API over TLS (SNI and Host `node.test`).
pub(crate) fn api(
    node: &TestNode,
    key: &str,
    method: &str,
    path: &str,
    content_type: &str,
    body: &[u8],
) -> (u16, serde_json::Value) {
    let auth = format!("Bearer {key}");
    let (s, b, _) = tls_request(
        &node.addr,
        API,
        API,
        method,
        path,
        &[("authorization", &auth), ("content-type", content_type)],
        body,
    );
    let v = if b.trim().is_empty() {
        serde_json::Value::Null
    } else {
        json(&b)
    };
    (s, v)
}

/// A namespace made over TLS; its owner key.
pub(crate) fn namespace(node: &TestNode, name: &str) -> String {
    let body = match node.member_of_namespaces() {
        Some(m) => format!("{{\"name\":\"{name}\",\"members\":[\"{m}\"]}}"),
        None => format!("{{\"name\":\"{name}\"}}"),
    };
    let (s, v) = api(
        node,
        OPERATOR_KEY,
        "POST",
        "/v1/namespaces",
        "application/json",
        body.as_bytes(),
    );
    assert_eq!(s, 201, "{v}");
    v["api_key"].as_str().unwrap().to_string()
}

/// A deployment `name` of `hosts` proxied to `upstream`.
pub(crate) fn deploy(node: &TestNode, key: &str, name: &str, hosts: &[&str], upstream: &str) {
    let body =
        serde_json::json!({"name": name, "hosts": hosts, "upstream": {"instances": [upstream]}});
    let (s, v) = api(
        node,
        key,
        "POST",
        "/v1/deployments",
        "application/json",
        body.to_string().as_bytes(),
    );
    assert_eq!(s, 201, "{v}");
}

/// `PUT /v1/deployments/{name}/certificate` as JSON.
pub(crate) fn put_json(
    node: &TestNode,
    key: &str,
    name: &str,
    p: &Pair,
) -> (u16, serde_json::Value) {
    let body = serde_json::json!({"cert_pem": p.cert, "key_pem": p.key});
    api(
        node,
        key,
        "PUT",
        &format!("/v1/deployments/{name}/certificate"),
        "application/json",
        body.to_string().as_bytes(),
    )
}

/// The same as multipart parts `cert` and `key`.
fn put_multipart(
    node: &TestNode,
    key: &str,
    name: &str,
    cert: &[u8],
    k: &[u8],
) -> (u16, serde_json::Value) {
    let boundary = "certboundary7f3a";
    let mut body = Vec::new();
    for (part, bytes) in [("cert", cert), ("key", k)] {
        body.extend_from_slice(
            format!("--{boundary}\r\ncontent-disposition: form-data; name=\"{part}\"; filename=\"{part}.pem\"\r\ncontent-type: application/x-pem-file\r\n\r\n").as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    api(
        node,
        key,
        "PUT",
        &format!("/v1/deployments/{name}/certificate"),
        &format!("multipart/form-data; boundary={boundary}"),
        &body,
    )
}

/// An upstream answering 200 `up` to every request.
fn upstream() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let mut seen = Vec::new();
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s.write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nup",
                );
            });
        }
    });
    format!("http://{addr}")
}

fn sorted(v: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = v.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}

/// Two deployment hosts each get their own certificate by SNI, an unknown
/// name and the API name get the node's pair; the 421 check still holds;
/// a replaced certificate is served at the next handshake (no restart);
/// `GET` shows names, issuer and validity but never the key; `DELETE` (and
/// deleting the deployment) gives the hosts back the node's pair. On the
/// cluster suite the first upload goes through another node.
#[test]
fn hosts_get_their_own_certificates_by_sni() {
    let dir = tempfile::tempdir().unwrap();
    let node = tls_node(dir.path());
    let key = namespace(&node, "certs");
    let up = upstream();
    deploy(&node, &key, "shop", &["shop.test"], &up);
    deploy(&node, &key, "blog", &["blog.test", "www.blog.test"], &up);
    // Before any upload: the node's pair.
    assert_eq!(served_names(&node.addr, "shop.test"), sorted(&[API]));

    let shop = current(&["shop.test"]);
    let (s, v) = if node.member_of_namespaces().is_some() {
        // On a cluster: uploaded through another node (plain HTTP), served
        // by this one once it follows the deployments' generation.
        let auth = format!("Bearer {key}");
        let body = serde_json::json!({"cert_pem": shop.cert, "key_pem": shop.key}).to_string();
        let (s, _, b) = http(
            "PUT",
            &format!("{}/v1/deployments/shop/certificate", node.member_base()),
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            Some(body.as_bytes()),
        );
        (s, json(&String::from_utf8_lossy(&b)))
    } else {
        put_json(&node, &key, "shop", &shop)
    };
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["certificate"]["state"], "active", "{v}");
    // A chain (leaf, then its CA) as multipart, a wildcard among its names.
    let blog = ca_signed(&["blog.test", "*.blog.test"]);
    let (s, v) = put_multipart(
        &node,
        &key,
        "blog",
        blog.cert.as_bytes(),
        blog.key.as_bytes(),
    );
    assert_eq!(s, 200, "{v}");
    let c = &v["certificate"];
    assert_eq!(c["state"], "active", "{v}");
    assert!(
        c["issuer"].as_str().unwrap().contains("Test Issuing CA"),
        "{v}"
    );

    let shop_names = sorted(&["shop.test"]);
    let blog_names = sorted(&["*.blog.test", "blog.test"]);
    wait_until(
        Duration::from_secs(15),
        "each host served its own certificate",
        || {
            served_names(&node.addr, "shop.test") == shop_names
                && served_names(&node.addr, "blog.test") == blog_names
        },
    );
    assert_eq!(served_names(&node.addr, "www.blog.test"), blog_names);
    assert_eq!(served_names(&node.addr, "unknown.test"), sorted(&[API]));
    assert_eq!(served_names(&node.addr, API), sorted(&[API]));
    // Requests on those connections: routed by Host, 421 when it disagrees.
    let (s, b, names) = tls_request(&node.addr, "shop.test", "shop.test", "GET", "/", &[], b"");
    assert_eq!((s, b.as_str(), names), (200, "up", shop_names.clone()));
    let (s, b, _) = tls_request(&node.addr, "shop.test", "blog.test", "GET", "/", &[], b"");
    assert_eq!(s, 421, "{b}");
    assert_eq!(json(&b)["error"]["code"], "MISDIRECTED_REQUEST");

    // Shown without the key.
    let (s, v) = api(
        &node,
        &key,
        "GET",
        "/v1/deployments/blog/certificate",
        "",
        b"",
    );
    assert_eq!(s, 200, "{v}");
    let c = &v["certificate"];
    assert_eq!(
        c["names"],
        serde_json::json!(["blog.test", "*.blog.test"]),
        "{v}"
    );
    assert_eq!(c["not_after"].as_str().map(|s| s.len()), Some(20), "{v}");
    assert!(
        c["not_before"].is_string() && c["sha256"].is_string(),
        "{v}"
    );
    assert_eq!(
        c["hosts"][1],
        serde_json::json!({"host": "www.blog.test", "covered": true})
    );
    let text = v.to_string();
    assert!(
        !text.contains("PRIVATE KEY") && !text.contains("key_sealed"),
        "{text}"
    );
    let key_body: String = blog
        .key
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .collect();
    assert!(!text.contains(&key_body[..40]), "{text}");

    // Replaced: the next handshake gets the new one.
    let shop2 = current(&["shop.test", "alt.shop.test"]);
    let (s, v) = put_json(&node, &key, "shop", &shop2);
    assert_eq!(s, 200, "{v}");
    let shop2_names = sorted(&["alt.shop.test", "shop.test"]);
    wait_until(
        Duration::from_secs(15),
        "the replaced certificate served",
        || served_names(&node.addr, "shop.test") == shop2_names,
    );

    // Removed: the node's pair again; a second removal is 404.
    let (s, v) = api(
        &node,
        &key,
        "DELETE",
        "/v1/deployments/shop/certificate",
        "",
        b"",
    );
    assert_eq!(s, 200, "{v}");
    wait_until(
        Duration::from_secs(15),
        "the node's pair after DELETE",
        || served_names(&node.addr, "shop.test") == sorted(&[API]),
    );
    let (s, v) = api(
        &node,
        &key,
        "DELETE",
        "/v1/deployments/shop/certificate",
        "",
        b"",
    );
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (404, Some("CERTIFICATE_NOT_FOUND")),
        "{v}"
    );
    let (s, v) = api(
        &node,
        &key,
        "GET",
        "/v1/deployments/shop/certificate",
        "",
        b"",
    );
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (404, Some("CERTIFICATE_NOT_FOUND")),
        "{v}"
    );

    // Deleting the deployment takes its certificate with it: the same
    // deployment made again has none, and its host gets the node's pair.
    let (s, v) = api(&node, &key, "DELETE", "/v1/deployments/blog", "", b"");
    assert_eq!(s, 200, "{v}");
    wait_until(
        Duration::from_secs(15),
        "the node's pair after the deployment went",
        || served_names(&node.addr, "blog.test") == sorted(&[API]),
    );
    deploy(&node, &key, "blog", &["blog.test"], &up);
    let (s, v) = api(
        &node,
        &key,
        "GET",
        "/v1/deployments/blog/certificate",
        "",
        b"",
    );
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (404, Some("CERTIFICATE_NOT_FOUND")),
        "{v}"
    );
    assert_eq!(served_names(&node.addr, "blog.test"), sorted(&[API]));
}

/// Bad uploads are 400 with the envelope, name what is wrong, and store
/// nothing: the certificate served and shown stays the one before.
#[test]
fn bad_certificates_are_refused_and_store_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let node = tls_node(dir.path());
    let key = namespace(&node, "badcerts");
    let up = upstream();
    deploy(&node, &key, "shop", &["shop.test", "www.shop.test"], &up);
    let good = current(&["shop.test", "www.shop.test"]);
    let (s, v) = put_json(&node, &key, "shop", &good);
    assert_eq!(s, 200, "{v}");
    let sha = v["certificate"]["sha256"].clone();
    let names = sorted(&["shop.test", "www.shop.test"]);
    wait_until(
        Duration::from_secs(15),
        "the good certificate served",
        || served_names(&node.addr, "shop.test") == names,
    );

    let other_host = current(&["shop.test", "evil.test"]);
    let expired = self_signed(&["shop.test", "www.shop.test"], 2000, 2001);
    let future = self_signed(&["shop.test", "www.shop.test"], 2099, 2100);
    let other_key = current(&["shop.test", "www.shop.test"]);
    let cases: Vec<(&str, Pair, &str, &str)> = vec![
        (
            "a certificate for another host",
            other_host,
            "CERTIFICATE_HOST_MISMATCH",
            "www.shop.test",
        ),
        (
            "an expired certificate",
            expired,
            "CERTIFICATE_EXPIRED",
            "expired",
        ),
        (
            "a not-yet-valid certificate",
            future,
            "CERTIFICATE_NOT_YET_VALID",
            "not valid before",
        ),
        (
            "a key that does not match",
            Pair {
                cert: good.cert.clone(),
                key: other_key.key.clone(),
            },
            "CERTIFICATE_KEY_MISMATCH",
            "does not belong",
        ),
        (
            "PEM garbage",
            Pair {
                cert: "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n"
                    .into(),
                key: good.key.clone(),
            },
            "INVALID_CERTIFICATE",
            "not an X.509 certificate",
        ),
        (
            "no PEM at all",
            Pair {
                cert: "hello".into(),
                key: good.key.clone(),
            },
            "INVALID_CERTIFICATE",
            "no PEM certificate",
        ),
        (
            "a private key uploaded as the chain",
            Pair {
                cert: good.key.clone(),
                key: good.key.clone(),
            },
            "INVALID_CERTIFICATE",
            "holds a private key",
        ),
        (
            "a certificate uploaded as the key",
            Pair {
                cert: good.cert.clone(),
                key: good.cert.clone(),
            },
            "INVALID_CERTIFICATE",
            "not a PEM private key",
        ),
    ];
    for (what, pair, code, says) in &cases {
        for multipart in [false, true] {
            let (s, v) = if multipart {
                put_multipart(
                    &node,
                    &key,
                    "shop",
                    pair.cert.as_bytes(),
                    pair.key.as_bytes(),
                )
            } else {
                put_json(&node, &key, "shop", pair)
            };
            assert_eq!(s, 400, "{what}: {v}");
            assert_eq!(v["ok"], false, "{what}: {v}");
            assert_eq!(v["error"]["code"], *code, "{what}: {v}");
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains(says), "{what}: {msg}");
            let key_body: String = pair
                .key
                .lines()
                .filter(|l| !l.starts_with("-----"))
                .collect();
            assert!(
                !msg.contains(&key_body[..40]),
                "{what}: the key echoed: {msg}"
            );
        }
    }
    // Malformed bodies: the envelope too.
    let (s, v) = api(
        &node,
        &key,
        "PUT",
        "/v1/deployments/shop/certificate",
        "application/json",
        b"{\"cert_pem\": 1}",
    );
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (400, Some("INVALID_JSON")),
        "{v}"
    );
    let (s, v) = put_multipart(
        &node,
        &key,
        "nosuch",
        good.cert.as_bytes(),
        good.key.as_bytes(),
    );
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (404, Some("DEPLOYMENT_NOT_FOUND")),
        "{v}"
    );

    // Nothing stored: the same certificate shown and served.
    let (s, v) = api(
        &node,
        &key,
        "GET",
        "/v1/deployments/shop/certificate",
        "",
        b"",
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["certificate"]["sha256"], sha, "{v}");
    assert_eq!(served_names(&node.addr, "shop.test"), names);

    // A key scoped to reading deployments may show but not upload.
    let (s, v) = api(
        &node,
        &key,
        "POST",
        "/v1/auth/api-keys",
        "application/json",
        br#"{"grants":["deployments:read:*"]}"#,
    );
    assert_eq!(s, 201, "{v}");
    let reader = v["api_key"].as_str().unwrap().to_string();
    let (s, v) = put_json(&node, &reader, "shop", &good);
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (403, Some("MISSING_GRANT")),
        "{v}"
    );
    let (s, v) = api(
        &node,
        &reader,
        "GET",
        "/v1/deployments/shop/certificate",
        "",
        b"",
    );
    assert_eq!(s, 200, "{v}");
}

/// The key is ciphertext on disk: the sled files hold the chain (public)
/// but neither the key's PEM body nor its DER.
#[test]
fn certificate_keys_are_sealed_on_disk() {
    if single_node_only() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let node = tls_node(dir.path());
    let key = namespace(&node, "sealed");
    deploy(&node, &key, "shop", &["shop.test"], &upstream());
    let pair = current(&["shop.test"]);
    let (s, v) = put_json(&node, &key, "shop", &pair);
    assert_eq!(s, 200, "{v}");
    let body = |pem: &str| -> String { pem.lines().filter(|l| !l.starts_with("-----")).collect() };
    let key_b64 = body(&pair.key);
    let key_der = base64_decode(&key_b64);
    let cert_line: String = pair.cert.lines().nth(1).unwrap().to_string();
    let mut files = Vec::new();
    fn walk(p: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(p).unwrap().flatten() {
            let path = e.path();
            if path.is_dir() {
                walk(&path, out);
            } else {
                out.push(path);
            }
        }
    }
    walk(&node.dir, &mut files);
    let mut all = Vec::new();
    for f in &files {
        all.extend(std::fs::read(f).unwrap_or_default());
    }
    let has = |needle: &[u8]| all.windows(needle.len()).any(|w| w == needle);
    // The scan sees the record: its public chain is there.
    assert!(
        has(cert_line.as_bytes()),
        "the chain is not in the data folder: the scan misses the store"
    );
    for n in [&key_b64[..48], &key_b64[key_b64.len() - 48..]] {
        assert!(
            !has(n.as_bytes()),
            "the key's PEM body is on disk in the clear"
        );
    }
    assert!(
        !has(&key_der[key_der.len() - 32..]),
        "the key's DER is on disk in the clear"
    );
}

fn base64_decode(s: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

/// `tls: "auto"` (certificates by ACME) on a node without `[tls.acme]`:
/// 400 `ACME_NOT_CONFIGURED` for an upstream (JSON) and a static site
/// (multipart part `tls`), and no deployment stored; a `tls` that is not a
/// mode is 400 `INVALID_FIELD`.
#[test]
fn tls_auto_without_acme_is_refused() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[deploy]\nupstream_allow = [\"127.0.0.0/8\"]\n"),
        ..Default::default()
    });
    let key = node.create_namespace("autotls");
    let up = upstream();
    for (tls, code) in [
        (serde_json::json!("auto"), "ACME_NOT_CONFIGURED"),
        (serde_json::json!("manual"), "INVALID_FIELD"),
        (serde_json::json!(true), "INVALID_FIELD"),
    ] {
        let body = serde_json::json!({"name": "auto", "hosts": ["auto.test"],
            "upstream": {"instances": [up]}, "tls": tls});
        let (s, b) = node.with_key(
            &key,
            "POST",
            "/v1/deployments",
            Some(body.to_string().as_bytes()),
        );
        let v = json(&b);
        assert_eq!(
            (s, v["error"]["code"].as_str()),
            (400, Some(code)),
            "{tls}: {b}"
        );
    }
    let boundary = "autotlsboundary";
    let mut body = Vec::new();
    for (part, bytes) in [
        ("name", &b"site"[..]),
        ("hosts", b"site.auto.test"),
        ("tls", b"auto"),
        (
            "tarball",
            &crate::deploy::tarball(&[("index.html", '0', b"hi")]),
        ),
    ] {
        body.extend_from_slice(
            format!("--{boundary}\r\ncontent-disposition: form-data; name=\"{part}\"\r\n\r\n")
                .as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    let auth = format!("Bearer {key}");
    let ct = format!("multipart/form-data; boundary={boundary}");
    let (s, _, b) = http(
        "POST",
        &node.url("/v1/deployments"),
        &[("authorization", &auth), ("content-type", &ct)],
        Some(&body),
    );
    let b = String::from_utf8_lossy(&b);
    assert_eq!(
        (s, json(&b)["error"]["code"].as_str()),
        (400, Some("ACME_NOT_CONFIGURED")),
        "{b}"
    );
    let (s, b) = node.with_key(&key, "GET", "/v1/deployments", None);
    assert_eq!(s, 200, "{b}");
    assert_eq!(json(&b)["deployments"], serde_json::json!([]), "{b}");
}
