//! The cluster hop: a forwarded request can be neither altered nor read on
//! the way. A hop's MAC (V4) covers the query and the body's SHA-256, so a
//! captured hop replayed with another body or query is refused; and members
//! that advertise `https://` are reached over TLS, trusted only when their
//! certificate chains to `[cluster] peer_ca_file`. See docs/cluster.md.
//!
//! Forged hops (no MAC, an old or a wrong one) are covered by
//! `chain::hop_mac_gate` and `cluster::forged_hop_is_refused_in_a_cluster`.

#![cfg(feature = "cluster")]

use crate::common::*;
use crate::etcd_process::EtcdProcess;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SECRET: &str = "hop-security-test-cluster-secret";

/// Cluster node `id` on `port`, with `extra` lines in its `[cluster]` section
/// and `tail` (more sections) after it.
fn node_opts(
    etcd: &EtcdProcess,
    id: &str,
    port: u16,
    dir: &Path,
    extra: &str,
    tail: &str,
) -> NodeOpts {
    NodeOpts {
        config: format!(
            "{TEST_CONFIG}[cluster]\n{}node_id = \"{id}\"\nbreaker_failures = 5\nbreaker_probe_seconds = 1\nregister_seconds = 1\n{extra}{tail}",
            etcd.cluster_toml()
        ),
        env: vec![("MESHGATE_CLUSTER_SECRET".into(), SECRET.into())],
        data_dir: Some(dir.join(id)),
        listen: Some(format!("127.0.0.1:{port}")),
        ..Default::default()
    }
}

/// The bytes one connection sent, shared with the thread relaying it.
type Sent = Arc<Mutex<Vec<u8>>>;

/// A TCP relay on 127.0.0.1 in front of a node: what a member advertises so
/// that the test sees the hops sent to it, byte for byte.
struct Recorder {
    port: u16,
    /// Every byte each connection sent towards the node.
    conns: Arc<Mutex<Vec<Sent>>>,
}

impl Recorder {
    fn start(to: u16) -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let conns: Arc<Mutex<Vec<Sent>>> = Arc::default();
        let all = conns.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(node) = TcpStream::connect(("127.0.0.1", to)) else {
                    continue;
                };
                let seen = Arc::new(Mutex::new(Vec::new()));
                all.lock().unwrap().push(seen.clone());
                let (mut c_in, mut n_out) =
                    (client.try_clone().unwrap(), node.try_clone().unwrap());
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16 * 1024];
                    while let Ok(n) = c_in.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        seen.lock().unwrap().extend_from_slice(&buf[..n]);
                        if n_out.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = n_out.shutdown(std::net::Shutdown::Write);
                });
                let (mut n_in, mut c_out) = (node, client);
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut n_in, &mut c_out);
                    let _ = c_out.shutdown(std::net::Shutdown::Write);
                });
            }
        });
        Recorder { port, conns }
    }

    /// The recorded requests, in order on each connection.
    fn requests(&self) -> Vec<Captured> {
        let conns = self.conns.lock().unwrap();
        conns
            .iter()
            .flat_map(|c| parse_requests(&c.lock().unwrap()))
            .collect()
    }

    /// The first recorded request whose method and target match, waiting
    /// for it until a deadline.
    fn captured(&self, method: &str, target: &str) -> Captured {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(c) = self
                .requests()
                .into_iter()
                .find(|c| c.method == method && c.target == target)
            {
                return c;
            }
            assert!(
                Instant::now() < deadline,
                "no {method} {target} crossed the relay: {:?}",
                self.requests()
                    .iter()
                    .map(|c| format!("{} {}", c.method, c.target))
                    .collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// One HTTP/1.1 request as it crossed the wire.
#[derive(Clone, Debug)]
struct Captured {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Captured {
    fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    /// Sends it again straight to `node`, with `body` and `target` as given
    /// (the framing headers are the client's own).
    fn replay(&self, node: &TestNode, target: &str, body: &[u8]) -> (u16, String) {
        let h: Vec<(&str, &str)> = self
            .headers
            .iter()
            .filter(|(k, _)| {
                !matches!(
                    k.as_str(),
                    "host" | "content-length" | "connection" | "transfer-encoding"
                )
            })
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let (s, _, b) = http(&self.method, &node.url(target), &h, Some(body));
        (s, String::from_utf8_lossy(&b).into_owned())
    }
}

/// Complete requests (Content-Length framed, as the forwarder sends them).
fn parse_requests(mut raw: &[u8]) -> Vec<Captured> {
    let mut out = Vec::new();
    while let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
        let head = String::from_utf8_lossy(&raw[..end]).into_owned();
        let mut lines = head.split("\r\n");
        let mut first = lines.next().unwrap_or_default().split(' ');
        let method = first.next().unwrap_or_default().to_string();
        let target = first.next().unwrap_or_default().to_string();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| {
                l.split_once(':')
                    .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            })
            .collect();
        let len: usize = header(&headers, "content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let start = end + 4;
        if raw.len() < start + len {
            break;
        }
        out.push(Captured {
            method,
            target,
            headers,
            body: raw[start..start + len].to_vec(),
        });
        raw = &raw[start + len..];
    }
    out
}

fn code(body: &str) -> String {
    json(body)["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn sha256_hex(b: &[u8]) -> String {
    meshgate::auth::hop_body_sha256(b)
}

/// A real hop, recorded on its way from A to member B, replayed straight to
/// B: as captured it is believed; with its body changed it is refused with
/// `HOP_BODY_MISMATCH` and the changed value is not stored; with the body and
/// its digest header both changed, or with the query changed or dropped, the
/// MAC fails, the identity is not believed (401) and nothing is written or
/// listed.
#[test]
fn captured_hop_replayed_altered_is_refused() {
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let b_port = free_port();
    let relay = Recorder::start(b_port);
    let a = TestNode::start_with(node_opts(&etcd, "a", free_port(), tmp.path(), "", ""));
    let advertise = format!("advertise = \"http://127.0.0.1:{}\"\n", relay.port);
    let b = TestNode::start_with(node_opts(&etcd, "b", b_port, tmp.path(), &advertise, ""));
    let (s, body) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"ledger","members":["b"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    let auth = format!("Bearer {OPERATOR_KEY}");
    let op = [("authorization", auth.as_str()), ("x-namespace", "ledger")];
    let value_on_b = |key: &str| {
        let (s, _, v) = http("GET", &b.url(&format!("/v1/kv/{key}")), &op, None);
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&v));
        String::from_utf8_lossy(&v).into_owned()
    };

    // A forwards the write to B; the relay keeps the hop.
    let (s, h, body) = http("PUT", &a.url("/v1/kv/balance"), &op, Some(b"10"));
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(header(&h, "x-meshgate-member"), Some("b"));
    let put = relay.captured("PUT", "/v1/kv/balance");
    assert_eq!(put.header("x-internal-auth-version"), Some("v4"));
    assert_eq!(
        put.header("x-internal-auth-body-sha256"),
        Some(sha256_hex(b"10").as_str())
    );
    assert_eq!(
        put.header("authorization"),
        None,
        "the credential stays on A"
    );
    assert_eq!(put.body, b"10");

    // As captured (within the MAC's window): believed.
    let (s, body) = put.replay(&b, "/v1/kv/balance", b"10");
    assert_eq!(s, 200, "{body}");
    // Another body under the same headers: refused, not written.
    let (s, body) = put.replay(&b, "/v1/kv/balance", b"1000000");
    assert_eq!(
        (s, code(&body).as_str()),
        (401, "HOP_BODY_MISMATCH"),
        "{body}"
    );
    assert_eq!(value_on_b("balance"), "10");
    // Another body with its own digest in the header: the MAC fails, so the
    // hop's identity is not believed and the request has no credential.
    let mut forged = put.clone();
    for (k, v) in forged.headers.iter_mut() {
        if k == "x-internal-auth-body-sha256" {
            *v = sha256_hex(b"1000000");
        }
    }
    let (s, body) = forged.replay(&b, "/v1/kv/balance", b"1000000");
    assert_eq!(
        (s, code(&body).as_str()),
        (401, "MISSING_CREDENTIAL"),
        "{body}"
    );
    assert_eq!(value_on_b("balance"), "10");

    // A listing under one prefix, replayed for another prefix or for all.
    for key in ["pub/menu", "priv/payroll"] {
        let (s, _, _) = http("PUT", &b.url(&format!("/v1/kv/{key}")), &op, Some(b"x"));
        assert_eq!(s, 200);
    }
    let (s, h, body) = http("GET", &a.url("/v1/kv?prefix=pub/"), &op, None);
    let body = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(
        (s, header(&h, "x-meshgate-member")),
        (200, Some("b")),
        "{body}"
    );
    assert!(
        body.contains("pub/menu") && !body.contains("priv/"),
        "{body}"
    );
    let list = relay.captured("GET", "/v1/kv?prefix=pub/");
    let (s, body) = list.replay(&b, "/v1/kv?prefix=pub/", b"");
    assert!(s == 200 && body.contains("pub/menu"), "{s} {body}");
    for target in [
        "/v1/kv?prefix=priv/",
        "/v1/kv",
        "/v1/kv?prefix=pub/&limit=1",
    ] {
        let (s, body) = list.replay(&b, target, b"");
        assert_eq!(
            (s, code(&body).as_str()),
            (401, "MISSING_CREDENTIAL"),
            "{target}: {body}"
        );
        assert!(!body.contains("payroll"), "{target}: {body}");
    }
}

fn tools_available() {
    for tool in ["curl", "openssl"] {
        let ok = Command::new(tool).arg("--version").output().is_ok()
            || Command::new(tool).arg("version").output().is_ok();
        assert!(
            ok,
            "{tool} not found: run scripts/test.sh (it installs curl and openssl) or apt-get install -y curl openssl"
        );
    }
}

fn openssl(args: &[&str], dir: &Path) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A throwaway CA `<name>.pem` / `<name>.key` in `dir`.
fn make_ca(dir: &Path, name: &str) -> PathBuf {
    openssl(
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
            "-subj",
            &format!("/CN=meshgate test {name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
        dir,
    );
    dir.join(format!("{name}.pem"))
}

/// A server certificate for 127.0.0.1 signed by CA `ca`: (cert, key).
fn make_node_cert(dir: &Path, ca: &str, name: &str) -> (PathBuf, PathBuf) {
    std::fs::write(
        dir.join(format!("{name}.ext")),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN=meshgate node {name}"),
        ],
        dir,
    );
    openssl(
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &format!("{name}.pem"),
            "-extfile",
            &format!("{name}.ext"),
        ],
        dir,
    );
    (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    )
}

/// An HTTPS request with curl, trusting `ca`: status (0 if none), headers
/// (lower-case names) and body.
fn curl(
    ca: &Path,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> (u16, Vec<(String, String)>, String) {
    let mut cmd = Command::new("curl");
    cmd.args(["-s", "-i", "--http1.1", "-m", "20", "--cacert"])
        .arg(ca)
        .args(["-X", method]);
    for (k, v) in headers {
        cmd.args(["-H", &format!("{k}: {v}")]);
    }
    if let Some(b) = body {
        cmd.args(["--data-binary", b]);
    }
    let out = cmd.arg(url).output().expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return (0, Vec::new(), String::new());
    };
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| {
            l.split_once(':')
                .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        })
        .collect();
    (status, headers, body.to_string())
}

/// Waits until the TLS node at `base` answers `/readyz` with a certificate
/// `ca` trusts.
fn wait_ready_tls(node: &TestNode, ca: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while curl(ca, "GET", &format!("{}/readyz", node.base), &[], None).0 != 200 {
        assert!(
            Instant::now() < deadline,
            "TLS node never became ready: {}",
            node.stderr.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Three nodes serving TLS, advertising `https://127.0.0.1:PORT`, with
/// `peer_ca_file` the CA of A's and B's certificates: a request to A for a
/// namespace on B is forwarded over TLS and answered by B. C's certificate
/// comes from another CA: a namespace on C is not served through A (503
/// `NO_MEMBER_AVAILABLE`, a failure on C's breaker, A's log naming the
/// certificate problem) although C itself answers.
#[test]
fn forwarding_over_tls_trusts_only_the_peer_ca() {
    tools_available();
    let pki = tempfile::tempdir().unwrap();
    let ca = make_ca(pki.path(), "peers");
    let other_ca = make_ca(pki.path(), "stranger");
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let start = |id: &str, signer: &str| {
        let (cert, key) = make_node_cert(pki.path(), signer, id);
        let port = free_port();
        let extra = format!(
            "advertise = \"https://127.0.0.1:{port}\"\npeer_ca_file = {:?}\n",
            ca
        );
        let tls = format!("[tls]\ncert_file = {cert:?}\nkey_file = {key:?}\n");
        let mut opts = node_opts(&etcd, id, port, tmp.path(), &extra, &tls);
        opts.no_wait_ready = true;
        let node = TestNode::start_with(opts);
        assert!(node.base.starts_with("https://"), "{}", node.base);
        node
    };
    let a = start("a", "peers");
    let b = start("b", "peers");
    let c = start("c", "stranger");
    wait_ready_tls(&a, &ca);
    wait_ready_tls(&b, &ca);
    // C is up and serving, with a certificate only the other CA vouches for.
    wait_ready_tls(&c, &other_ca);
    assert_eq!(
        curl(&ca, "GET", &format!("{}/readyz", c.base), &[], None).0,
        0,
        "C's certificate must not be trusted by the peers' CA"
    );

    let auth = format!("Bearer {OPERATOR_KEY}");
    for (ns, member) in [("vault", "b"), ("rogue", "c")] {
        let body = format!(r#"{{"name":"{ns}","members":["{member}"]}}"#);
        let (s, _, b) = curl(
            &ca,
            "POST",
            &format!("{}/v1/namespaces", a.base),
            &[
                ("authorization", auth.as_str()),
                ("content-type", "application/json"),
            ],
            Some(&body),
        );
        assert_eq!(s, 201, "{b}");
    }
    let call = |method: &str, node: &TestNode, path: &str, ns: &str, body: Option<&str>| {
        let h = [("authorization", auth.as_str()), ("x-namespace", ns)];
        curl(&ca, method, &format!("{}{path}", node.base), &h, body)
    };

    // Forwarded over TLS to B, and answered by it.
    let (s, h, body) = call("PUT", &a, "/v1/kv/door", "vault", Some("open sesame"));
    assert_eq!(s, 200, "{body}");
    assert_eq!(header(&h, "x-meshgate-member"), Some("b"));
    let (s, h, body) = call("GET", &a, "/v1/kv/door", "vault", None);
    assert_eq!((s, body.as_str()), (200, "open sesame"));
    assert_eq!(header(&h, "x-meshgate-member"), Some("b"));
    let (s, _, body) = call("GET", &b, "/v1/kv/door", "vault", None);
    assert_eq!((s, body.as_str()), (200, "open sesame"), "stored on B");

    // C is not trusted: the hop fails as a member failure, nothing is served.
    let (s, h, body) = call("PUT", &a, "/v1/kv/door", "rogue", Some("planted"));
    assert_eq!(
        (s, code(&body).as_str()),
        (503, "NO_MEMBER_AVAILABLE"),
        "{body}"
    );
    assert_eq!(header(&h, "x-meshgate-member"), None);
    let (s, _, body) = curl(
        &ca,
        "GET",
        &format!("{}/v1/status", a.base),
        &[OPERATOR_AUTH],
        None,
    );
    assert_eq!(s, 200, "{body}");
    let breakers = json(&body)["breakers"].clone();
    let br = breakers
        .as_array()
        .and_then(|l| {
            l.iter()
                .find(|x| x["namespace"] == "rogue" && x["member"] == "c")
        })
        .unwrap_or_else(|| panic!("no breaker for (rogue, c): {breakers}"));
    assert_eq!(br["consecutive_failures"], 1, "{br}");
    // The log writer thread writes shortly after the line is logged.
    wait_until(
        std::time::Duration::from_secs(10),
        "A's log naming the certificate problem",
        || {
            a.stderr
                .lock()
                .unwrap()
                .contains("invalid peer certificate")
        },
    );
    // Nothing reached C.
    let (s, _, body) = curl(
        &other_ca,
        "GET",
        &format!("{}/v1/kv/door", c.base),
        &[("authorization", auth.as_str()), ("x-namespace", "rogue")],
        None,
    );
    assert_eq!((s, code(&body).as_str()), (404, "KEY_NOT_FOUND"), "{body}");
}
