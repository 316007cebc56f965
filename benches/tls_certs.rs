//! TLS handshakes per second with many deployment certificates loaded
//! against one (docs/deployments.md "Certificates"), every part its own
//! process: two meshgate nodes (the binary, `serve`, or
//! `MESHGATE_BENCH_BIN`) with TLS on 127.0.0.1, one holding 1,000
//! deployments each with its own certificate, the other one; the load
//! generator is this process (full handshakes, no resumption, each SNI a
//! host that has a certificate, chosen in turn among all of them).
//!
//! `cargo bench --bench tls_certs` prints the table (rounds interleaved).
//! Under `cargo test` (no `--bench` argument) it runs a short smoke round
//! with 20 certificates.

#[allow(dead_code)] // its plain-HTTP node and upstream are not used here
#[path = "support/procs.rs"]
mod procs;

use procs::{Proc, spawn_node};
use rcgen::{CertificateParams, KeyPair};
use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const OPERATOR_KEY: &str = "mgop_tlsbench_0123456789abcdef0123456789abcdef0";
/// The node's own name (its pair), for API calls.
const API: &str = "node.bench";
/// Client threads doing handshakes.
const CLIENTS: usize = 4;

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

fn client_config() -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCert(provider)))
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    // Every handshake a full one: the resolver runs each time.
    cfg.resumption = rustls::client::Resumption::disabled();
    Arc::new(cfg)
}

/// One HTTP/1.1 request over TLS to the node's API.
fn api(addr: &str, key: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let name = rustls_pki_types::ServerName::try_from(API).unwrap();
    let conn = rustls::ClientConnection::new(client_config(), name).unwrap();
    let Ok(sock) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let mut tls = rustls::StreamOwned::new(conn, sock);
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {API}\r\nauthorization: Bearer {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    if tls.write_all(req.as_bytes()).is_err() {
        return (0, String::new());
    }
    let mut out = Vec::new();
    let _ = tls.read_to_end(&mut out);
    let out = String::from_utf8_lossy(&out).into_owned();
    let status = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// A self-signed pair for `names`, PEM.
fn pair(names: &[&str]) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let p =
        CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    let cert = p.self_signed(&key).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// A TLS node with `certs` deployments, each with a certificate of its own
/// for its host `h<i>.bench`; returns it with its address and the hosts.
fn node_with(dir: &std::path::Path, certs: usize) -> (Proc, String, Vec<String>) {
    let (c, k) = pair(&[API]);
    std::fs::write(dir.join("cert.pem"), c).unwrap();
    std::fs::write(dir.join("key.pem"), k).unwrap();
    let tls = format!(
        "[quotas]\ndeployments = 2000\nhosts = 2000\n[tls]\ncert_file = {:?}\nkey_file = {:?}\n",
        dir.join("cert.pem"),
        dir.join("key.pem")
    );
    let (proc_, addr) = spawn_node(dir, OPERATOR_KEY, &tls, "https");
    let deadline = Instant::now() + Duration::from_secs(30);
    while api(&addr, "", "GET", "/readyz", "").0 != 200 {
        assert!(Instant::now() < deadline, "the node never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (s, b) = api(
        &addr,
        OPERATOR_KEY,
        "POST",
        "/v1/namespaces",
        r#"{"name":"bench"}"#,
    );
    assert_eq!(s, 201, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    let key = v["api_key"].as_str().unwrap().to_string();
    let mut hosts = Vec::new();
    for i in 0..certs {
        let host = format!("h{i}.bench");
        let body = serde_json::json!({"name": format!("d{i}"), "hosts": [host],
            "upstream": {"instances": ["http://127.0.0.1:9"]}});
        let (s, b) = api(&addr, &key, "POST", "/v1/deployments", &body.to_string());
        assert_eq!(s, 201, "{b}");
        let (c, k) = pair(&[&host]);
        let body = serde_json::json!({"cert_pem": c, "key_pem": k});
        let (s, b) = api(
            &addr,
            &key,
            "PUT",
            &format!("/v1/deployments/d{i}/certificate"),
            &body.to_string(),
        );
        assert_eq!(s, 200, "{b}");
        hosts.push(host);
    }
    (proc_, addr, hosts)
}

/// Full handshakes per second against `addr` for `secs`, the SNI taken in
/// turn from `hosts`; checks the first handshake of each thread got a
/// certificate for its name.
fn handshakes(addr: &str, hosts: &[String], secs: f64) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let cfg = client_config();
    let hosts = Arc::new(hosts.to_vec());
    let threads: Vec<_> = (0..CLIENTS)
        .map(|t| {
            let (stop, done, cfg, hosts) = (stop.clone(), done.clone(), cfg.clone(), hosts.clone());
            let addr = addr.to_string();
            std::thread::spawn(move || {
                let mut i = t * 7919;
                while !stop.load(Ordering::Relaxed) {
                    let host = &hosts[i % hosts.len()];
                    i += 1;
                    let name = rustls_pki_types::ServerName::try_from(host.clone()).unwrap();
                    let mut conn = rustls::ClientConnection::new(cfg.clone(), name).unwrap();
                    let mut sock = std::net::TcpStream::connect(&addr).unwrap();
                    sock.set_nodelay(true).unwrap();
                    while conn.is_handshaking() {
                        conn.complete_io(&mut sock).unwrap();
                    }
                    if i == t * 7919 + 1 {
                        let leaf = &conn.peer_certificates().unwrap()[0];
                        let der = leaf.as_ref();
                        let needle = host.as_bytes();
                        assert!(
                            der.windows(needle.len()).any(|w| w == needle),
                            "{host} got another certificate"
                        );
                    }
                    conn.send_close_notify();
                    let _ = conn.complete_io(&mut sock);
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    stop.store(true, Ordering::Relaxed);
    let n = done.load(Ordering::Relaxed);
    let elapsed = t0.elapsed().as_secs_f64();
    for t in threads {
        t.join().unwrap();
    }
    n as f64 / elapsed
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (many, secs, rounds) = if full { (1000, 5.0, 3) } else { (20, 0.3, 1) };
    let dir_one = tempfile::tempdir().unwrap();
    let dir_many = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let (_one, one_addr, one_hosts) = node_with(dir_one.path(), 1);
    let (_many, many_addr, many_hosts) = node_with(dir_many.path(), many);
    eprintln!(
        "set up {many} certificates in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let mut one_rates = Vec::new();
    let mut many_rates = Vec::new();
    for _ in 0..rounds {
        one_rates.push(handshakes(&one_addr, &one_hosts, secs));
        many_rates.push(handshakes(&many_addr, &many_hosts, secs));
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let fmt = |v: &[f64]| {
        v.iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!("| node | handshakes/s per round | mean |");
    println!("|---|---|---:|");
    println!(
        "| 1 deployment certificate | {} | {:.0} |",
        fmt(&one_rates),
        mean(&one_rates)
    );
    println!(
        "| {many} deployment certificates | {} | {:.0} |",
        fmt(&many_rates),
        mean(&many_rates)
    );
    println!(
        "| ratio {many} / 1 (bar ≥ 0.9) | | **{:.2}** |",
        mean(&many_rates) / mean(&one_rates)
    );
}
