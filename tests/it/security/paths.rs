//! One canonical request (docs/security.md "One canonical request"): a
//! route's policy cannot be skipped by spelling the path differently, and
//! the client cannot forge the headers only the node sets. The upstreams are
//! real servers the test starts on 127.0.0.1: nginx (`location` blocks
//! answering "admin", "health" or "root") and python3's stdlib `wsgiref`
//! (which decodes the path and reads header names with `_` as `-`), reached
//! over HTTP/1.1 and HTTP/2 (prior knowledge) with `curl --path-as-is`.

use crate::common::*;
use crate::deploy::{ALLOW_LOOPBACK, deploy_json};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Fails (never skips) when a tool the test drives is missing.
fn need(tool: &str, args: &[&str], install: &str) {
    let ok = Command::new(tool)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    assert!(
        ok,
        "{tool} not found: run scripts/test.sh (it installs it) or `{install}`"
    );
}

fn nginx_binary() -> &'static str {
    for p in ["/usr/sbin/nginx", "/usr/bin/nginx"] {
        if std::path::Path::new(p).exists() {
            return p;
        }
    }
    panic!(
        "nginx not found: run scripts/test.sh (it installs nginx) or `apt-get install -y nginx`"
    );
}

/// A process the test started; killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// nginx on 127.0.0.1 with plain `location` blocks: `/admin…` answers
/// "admin", `/health…` "health", anything else "root". nginx decodes the
/// path, resolves dot segments and merges slashes before it picks one.
fn start_nginx(dir: &std::path::Path) -> (Proc, String) {
    let bin = nginx_binary();
    let port = free_port();
    let d = dir.display();
    let conf = format!(
        "worker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 64; }}\n\
         http {{\n access_log off;\n client_body_temp_path {d}/body;\n proxy_temp_path {d}/proxy;\n\
          fastcgi_temp_path {d}/fcgi;\n uwsgi_temp_path {d}/uwsgi;\n scgi_temp_path {d}/scgi;\n\
          server {{\n  listen 127.0.0.1:{port};\n  default_type text/plain;\n\
           location /admin {{ return 200 \"admin\"; }}\n\
           location /health {{ return 200 \"health\"; }}\n\
           location / {{ return 200 \"root\"; }}\n  }}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).unwrap();
    let child = Command::new(bin)
        .args(["-p", &d.to_string(), "-c"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start nginx");
    let proc = Proc(child);
    let addr = format!("127.0.0.1:{port}");
    wait_until(Duration::from_secs(10), "nginx listening", || {
        std::net::TcpStream::connect(&addr).is_ok()
    });
    (proc, format!("http://{addr}"))
}

/// A WSGI app on python3's `wsgiref`: it routes as a lenient framework
/// would (the decoded `PATH_INFO`, backslashes as slashes, dot segments
/// resolved, `;` parameters and NUL cut off) and answers JSON with its pick,
/// the path as it arrived (`raw`) and every `HTTP_*` variable.
const WSGI_APP: &str = r#"
import json, posixpath, re, sys
from wsgiref.simple_server import make_server, WSGIRequestHandler

class Handler(WSGIRequestHandler):
    def get_environ(self):
        env = super().get_environ()
        env['RAW_PATH'] = self.path
        return env
    def log_message(self, *args):
        pass

def app(environ, start_response):
    path = environ.get('PATH_INFO', '/').replace('\\', '/')
    norm = posixpath.normpath(path) if path else '/'
    first = re.split(r'[;\x00]', norm.lstrip('/').split('/')[0])[0]
    pick = first if first in ('admin', 'health') else 'root'
    body = json.dumps({
        'answer': pick,
        'raw': environ.get('RAW_PATH'),
        'path_info': environ.get('PATH_INFO'),
        'headers': {k: v for k, v in environ.items() if k.startswith('HTTP_')},
    }).encode()
    start_response('200 OK', [('Content-Type', 'application/json'),
                              ('Content-Length', str(len(body)))])
    return [body]

srv = make_server('127.0.0.1', 0, app, handler_class=Handler)
print(srv.server_port, flush=True)
srv.serve_forever()
"#;

fn start_wsgi(dir: &std::path::Path) -> (Proc, String) {
    let script = dir.join("app.py");
    std::fs::write(&script, WSGI_APP).unwrap();
    let mut child = Command::new("python3")
        .arg(&script)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("python3 not found: apt-get install -y python3");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line.trim().parse().expect("the WSGI server's port");
    (Proc(child), format!("http://127.0.0.1:{port}"))
}

/// What the upstream (or the node) answered: status, body and the version
/// curl spoke, the path sent exactly as written (`--path-as-is`).
fn curl(
    node: &TestNode,
    h2: bool,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, String) {
    let port = node.addr.rsplit(':').next().unwrap();
    let mut cmd = Command::new("curl");
    cmd.args(["-s", "--path-as-is", "--max-time", "20"])
        .arg(if h2 {
            "--http2-prior-knowledge"
        } else {
            "--http1.1"
        })
        .args(["-w", "\n%{http_code} %{http_version}"])
        .arg("--resolve")
        .arg(format!("{host}:{port}:127.0.0.1"));
    for (k, v) in headers {
        cmd.arg("-H").arg(format!("{k}: {v}"));
    }
    let out = cmd
        .arg(format!("http://{host}:{port}{path}"))
        .output()
        .expect("curl not found: apt-get install -y curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, tail) = text.rsplit_once('\n').unwrap_or(("", &text));
    let (status, version) = tail.split_once(' ').unwrap_or((tail, ""));
    assert_eq!(
        version,
        if h2 { "2" } else { "1.1" },
        "curl spoke another version for {host}{path}: {text}"
    );
    (status.parse().unwrap_or(0), body.to_string())
}

fn code(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
        .unwrap_or_default()
}

/// A JWT of the namespace whose owner key is `key`.
fn jwt(node: &TestNode, key: &str) -> String {
    let body = format!("{{\"api_key\":\"{key}\"}}");
    let (s, b) = node.with_key("", "POST", "/v1/auth/token", Some(body.as_bytes()));
    assert_eq!(s, 200, "{b}");
    json(&b)["access_token"].as_str().unwrap().to_string()
}

fn node_with(extra: &str) -> TestNode {
    TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}{extra}[deploy]\n{ALLOW_LOOPBACK}"),
        ..Default::default()
    })
}

/// The spellings of `/admin` behind an open `/health` route.
const BEHIND_HEALTH: &[&str] = &[
    "/health/../admin",
    "/health/%2e%2e/admin",
    "/health//../admin",
    "/health/%2E%2E/admin",
    "/health/./../admin",
    "/health/..%2fadmin",
];

/// The spellings of `/admin` when `/admin` is the protected route and `/` open.
const SPELLINGS: &[&str] = &[
    "/admin",
    "/%61dmin",
    "/./admin",
    "/x/../admin",
    "//admin",
    "/admin%2f",
    "/admin%2F",
    "/admin;a=b",
    "/admin%00",
    "/admin%5c",
    "/x\\..\\admin",
    "/admin\\",
    "/%2e/admin",
    "/x/%2e%2e/admin",
    "/ad%6Din/",
];

/// bank's API host with `{"auth":"jwt"}` by default and `/health` open, and
/// one with `/admin` protected and `/` open, on nginx and on wsgiref: no
/// spelling of `/admin` (dot segments, escapes, `//`, `%2f`, `;`, NUL,
/// backslash) reaches either upstream's "admin" without a credential, over
/// HTTP/1.1 or HTTP/2: each is 401 or 400 `AMBIGUOUS_PATH`. With a JWT the
/// canonical spellings do reach "admin", and the upstream receives the
/// canonical path.
#[test]
fn path_spellings_cannot_skip_a_route_policy() {
    need("curl", &["--version"], "apt-get install -y curl");
    need("python3", &["--version"], "apt-get install -y python3");
    let tmp = tempfile::tempdir().unwrap();
    let (_nginx, nginx_url) = start_nginx(tmp.path());
    let (_wsgi, wsgi_url) = start_wsgi(tmp.path());
    let node = node_with("");
    let bank = node.create_namespace("bank");
    let token = jwt(&node, &bank);
    for (up, url) in [("nginx", &nginx_url), ("wsgi", &wsgi_url)] {
        let (s, v) = deploy_json(
            &node,
            &bank,
            serde_json::json!({
                "name": format!("api-{up}"), "hosts": [format!("api-{up}.bank.test")],
                "upstream": {"instances": [url]},
                "policy": {"auth": "jwt"},
                "routes": [{"path_prefix": "/"}, {"path_prefix": "/health", "policy": {}}]
            }),
        );
        assert_eq!(s, 201, "{v}");
        let (s, v) = deploy_json(
            &node,
            &bank,
            serde_json::json!({
                "name": format!("adm-{up}"), "hosts": [format!("adm-{up}.bank.test")],
                "upstream": {"instances": [url]},
                "routes": [{"path_prefix": "/"},
                           {"path_prefix": "/admin", "policy": {"auth": "jwt"}}]
            }),
        );
        assert_eq!(s, 201, "{v}");
    }
    let answered_admin = |up: &str, body: &str| match up {
        "nginx" => body == "admin",
        _ => body.contains("\"answer\": \"admin\""),
    };
    for h2 in [false, true] {
        for up in ["nginx", "wsgi"] {
            let api = format!("api-{up}.bank.test");
            let adm = format!("adm-{up}.bank.test");
            // The open routes answer: the upstreams and the node work.
            let (s, b) = curl(&node, h2, &api, "/health", &[]);
            assert_eq!(s, 200, "{up} h2={h2}: {b}");
            assert!(b.contains("health"), "{b}");
            let (s, b) = curl(&node, h2, &adm, "/", &[]);
            assert!(s == 200 && b.contains("root"), "{up} h2={h2}: {s} {b}");
            for (host, paths) in [(&api, BEHIND_HEALTH), (&adm, SPELLINGS)] {
                for path in paths {
                    let (s, b) = curl(&node, h2, host, path, &[]);
                    assert!(
                        (s == 401 && code(&b) == "MISSING_CREDENTIAL")
                            || (s == 400 && code(&b) == "AMBIGUOUS_PATH"),
                        "{up} h2={h2} {host}{path}: {s} {b}"
                    );
                    assert!(
                        !answered_admin(up, &b),
                        "{up} h2={h2} {host}{path} reached admin"
                    );
                }
            }
            // With a credential the canonical spellings reach /admin, sent canonical.
            let auth = format!("Bearer {token}");
            for path in ["/admin", "/%61dmin", "/x/../admin", "//admin", "/./admin"] {
                let (s, b) = curl(&node, h2, &adm, path, &[("authorization", &auth)]);
                assert!(
                    s == 200 && answered_admin(up, &b),
                    "{up} h2={h2} {path} with a JWT: {s} {b}"
                );
                if up == "wsgi" {
                    assert_eq!(json(&b)["raw"], "/admin", "{path}: the upstream got {b}");
                }
            }
        }
    }
    // The node's own API is matched on the canonical path too: an escaped
    // spelling of a credential route is that route (401 without a key), and
    // an ambiguous one is refused before any route.
    let base = node.addr.clone();
    for (path, want) in [
        ("/v1/%6bv/x", (401, "MISSING_CREDENTIAL")),
        ("/v1/health/../kv/x", (401, "MISSING_CREDENTIAL")),
        ("/v1/kv%2fx", (400, "AMBIGUOUS_PATH")),
    ] {
        let (s, _, b) = http("GET", &format!("http://{base}{path}"), &[], None);
        let b = String::from_utf8_lossy(&b).into_owned();
        assert_eq!((s, code(&b).as_str()), want, "{path}: {b}");
    }
    // An absolute-form target naming another host than Host is refused.
    let port = node.addr.rsplit(':').next().unwrap();
    let out = Command::new("curl")
        .args([
            "-s",
            "--http1.1",
            "-w",
            "\n%{http_code}",
            "--request-target",
        ])
        .arg("http://adm-nginx.bank.test/admin")
        .arg("-H")
        .arg("Host: adm-wsgi.bank.test")
        .arg(format!("http://127.0.0.1:{port}/"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').unwrap();
    assert_eq!(
        (status, code(body).as_str()),
        ("400", "AMBIGUOUS_PATH"),
        "{text}"
    );
}

/// The headers only the node sets: `X-Meshgate_Subject`/`_Grants` (read as
/// `HTTP_X_MESHGATE_SUBJECT` by WSGI), a client's `X-Forwarded-Proto:
/// https`, `Forwarded`, `X-Real-IP`, `X-Forwarded-For` and any other
/// underscore name never reach the upstream; it gets the node's own values
/// (the vouched subject on an authenticated route). A deployment with
/// `allow_underscore_headers` gets other underscore names, never a reserved one.
#[test]
fn forged_headers_never_reach_the_upstream() {
    need("python3", &["--version"], "apt-get install -y python3");
    let tmp = tempfile::tempdir().unwrap();
    let (_wsgi, wsgi_url) = start_wsgi(tmp.path());
    let node = node_with("");
    let bank = node.create_namespace("bank");
    let token = jwt(&node, &bank);
    let (s, b) = node.with_key(&token, "GET", "/v1/auth/whoami", None);
    assert_eq!(s, 200, "{b}");
    let subject = json(&b)["subject"].as_str().unwrap().to_string();
    for (name, underscores) in [("strict", false), ("lenient", true)] {
        let (s, v) = deploy_json(
            &node,
            &bank,
            serde_json::json!({
                "name": name, "hosts": [format!("{name}.bank.test")],
                "upstream": {"instances": [wsgi_url], "allow_underscore_headers": underscores},
                "routes": [{"path_prefix": "/", "policy": {"auth": "jwt"}},
                           {"path_prefix": "/open"}]
            }),
        );
        assert_eq!(s, 201, "{v}");
    }
    let auth = format!("Bearer {token}");
    // The grants the node vouches for, asked without forged headers.
    let (s, _, b) = http(
        "GET",
        &node.url("/x"),
        &[("host", "strict.bank.test"), ("authorization", &auth)],
        None,
    );
    assert_eq!(s, 200);
    let grants = json(&String::from_utf8_lossy(&b))["headers"]["HTTP_X_MESHGATE_GRANTS"]
        .as_str()
        .unwrap()
        .to_string();
    let forged: &[(&str, &str)] = &[
        ("X-Meshgate_Subject", "key:bank-owner"),
        ("X-Meshgate_Grants", "*:*:*"),
        ("X_Meshgate_Namespace", "evil"),
        ("X-Forwarded-Proto", "https"),
        ("X-Forwarded_Proto", "https"),
        ("Forwarded", "for=6.6.6.6;proto=https"),
        ("X-Real-IP", "6.6.6.6"),
        ("X_Real_IP", "6.6.6.6"),
        ("X-Forwarded-For", "6.6.6.6"),
        ("X-Forwarded-Host", "evil.test"),
        ("X-Internal_Auth-Subject", "operator"),
        ("My_Header", "1"),
        ("X-Plain", "kept"),
    ];
    for (host, path, authed) in [
        ("strict.bank.test", "/x", true),
        ("strict.bank.test", "/open", false),
        ("lenient.bank.test", "/x", true),
        ("lenient.bank.test", "/open", false),
    ] {
        let mut headers = forged.to_vec();
        if authed {
            headers.push(("authorization", &auth));
        }
        let mut h = vec![("host", host)];
        h.extend_from_slice(&headers);
        let (s, _, b) = http("GET", &node.url(path), &h, None);
        let b = String::from_utf8_lossy(&b).into_owned();
        assert_eq!(s, 200, "{host}{path}: {b}");
        let seen = json(&b)["headers"].clone();
        let get = |k: &str| seen[k].as_str().map(str::to_string);
        let what = format!("{host}{path}: {seen}");
        // The identity is the node's alone.
        if authed {
            assert_eq!(
                get("HTTP_X_MESHGATE_SUBJECT"),
                Some(subject.clone()),
                "{what}"
            );
            assert_eq!(
                get("HTTP_X_MESHGATE_NAMESPACE").as_deref(),
                Some("bank"),
                "{what}"
            );
            assert_eq!(
                get("HTTP_X_MESHGATE_GRANTS"),
                Some(grants.clone()),
                "{what}"
            );
        } else {
            for k in [
                "HTTP_X_MESHGATE_SUBJECT",
                "HTTP_X_MESHGATE_GRANTS",
                "HTTP_X_MESHGATE_NAMESPACE",
            ] {
                assert_eq!(get(k), None, "{what}");
            }
        }
        // The forwarding headers are what the node saw.
        assert_eq!(
            get("HTTP_X_FORWARDED_PROTO").as_deref(),
            Some("http"),
            "{what}"
        );
        assert_eq!(
            get("HTTP_X_FORWARDED_FOR").as_deref(),
            Some("127.0.0.1"),
            "{what}"
        );
        assert_eq!(
            get("HTTP_X_REAL_IP").as_deref(),
            Some("127.0.0.1"),
            "{what}"
        );
        assert_eq!(
            get("HTTP_X_FORWARDED_HOST").as_deref(),
            Some(host),
            "{what}"
        );
        assert_eq!(
            get("HTTP_FORWARDED"),
            Some(format!("for=127.0.0.1;host=\"{host}\";proto=http")),
            "{what}"
        );
        assert_eq!(get("HTTP_X_INTERNAL_AUTH_SUBJECT"), None, "{what}");
        assert_eq!(get("HTTP_X_PLAIN").as_deref(), Some("kept"), "{what}");
        // Other underscore names pass only where the deployment allows them.
        let lenient = host.starts_with("lenient");
        assert_eq!(
            get("HTTP_MY_HEADER").as_deref(),
            lenient.then_some("1"),
            "{what}"
        );
    }
}

/// The upstream's view of one request written raw to the node: the JSON
/// body the echoing upstream answered (between its first `{` and last `}`).
fn echoed(raw: &[u8]) -> serde_json::Value {
    let text = String::from_utf8_lossy(raw);
    let (Some(a), Some(b)) = (text.find('{'), text.rfind('}')) else {
        panic!("no JSON in the answer: {text}");
    };
    serde_json::from_str(&text[a..=b]).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// Sends `request` as written over a fresh connection to the node and reads
/// until the node closes it.
fn raw_http1(node: &TestNode, request: &str) -> Vec<u8> {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(&node.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(request.as_bytes()).unwrap();
    let mut out = Vec::new();
    let _ = c.read_to_end(&mut out);
    out
}

/// One h2c (prior knowledge) GET with these pseudo-headers and headers,
/// each an HPACK literal without indexing; the DATA of stream 1 until it ends.
fn raw_h2c(node: &TestNode, headers: &[(&str, &str)]) -> Vec<u8> {
    use std::io::{Read, Write};
    let frame = |kind: u8, flags: u8, stream: u32, payload: &[u8]| {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend([kind, flags]);
        f.extend(stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    };
    let mut block = Vec::new();
    for (k, v) in headers {
        assert!(k.len() < 127 && v.len() < 127);
        block.push(0);
        block.push(k.len() as u8);
        block.extend(k.as_bytes());
        block.push(v.len() as u8);
        block.extend(v.as_bytes());
    }
    let mut c = std::net::TcpStream::connect(&node.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(4, 0, 0, &[]));
    // END_STREAM | END_HEADERS on stream 1.
    out.extend(frame(1, 0x5, 1, &block));
    c.write_all(&out).unwrap();
    let mut data = Vec::new();
    loop {
        let mut head = [0u8; 9];
        if c.read_exact(&mut head).is_err() {
            panic!(
                "the node closed the h2 connection early: {:?}",
                String::from_utf8_lossy(&data)
            );
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        c.read_exact(&mut payload).unwrap();
        match kind {
            // SETTINGS from the node: acknowledged.
            4 if flags & 1 == 0 => c.write_all(&frame(4, 1, 0, &[])).unwrap(),
            0 if stream == 1 => {
                data.extend_from_slice(&payload);
                if flags & 1 != 0 {
                    return data;
                }
            }
            1 if stream == 1 && flags & 1 != 0 => return data,
            // GOAWAY or RST_STREAM.
            7 | 3 => panic!("the node ended the h2 stream: frame {kind} {payload:?}"),
            _ => {}
        }
    }
}

/// The attack: on the plain-HTTP listener, an HTTP/1.1 absolute-form target
/// `GET https://host/open` and an h2c request with `:scheme: https` claim
/// the client came over TLS. The upstream still sees `X-Forwarded-Proto:
/// http` and `Forwarded: ...;proto=http`: the proto is the listener's (or a
/// trusted proxy's), never the request's own scheme.
#[test]
fn the_request_scheme_never_sets_the_forwarded_proto() {
    need("python3", &["--version"], "apt-get install -y python3");
    let tmp = tempfile::tempdir().unwrap();
    let (_wsgi, wsgi_url) = start_wsgi(tmp.path());
    let node = node_with("");
    let bank = node.create_namespace("bank");
    let (s, v) = deploy_json(
        &node,
        &bank,
        serde_json::json!({"name": "wsgi", "hosts": ["wsgi.bank.test"],
                           "upstream": {"instances": [wsgi_url]}}),
    );
    assert_eq!(s, 201, "{v}");
    let absolute = raw_http1(
        &node,
        "GET https://wsgi.bank.test/health HTTP/1.1\r\nHost: wsgi.bank.test\r\nConnection: close\r\n\r\n",
    );
    let h2 = raw_h2c(
        &node,
        &[
            (":method", "GET"),
            (":scheme", "https"),
            (":authority", "wsgi.bank.test"),
            (":path", "/health"),
        ],
    );
    let mut forged = Vec::new();
    for (what, raw) in [("absolute-form", absolute), ("h2c", h2)] {
        let seen = echoed(&raw)["headers"].clone();
        let fwd = seen["HTTP_FORWARDED"].as_str().unwrap_or_default();
        if seen["HTTP_X_FORWARDED_PROTO"] != "http" || !fwd.ends_with(";proto=http") {
            forged.push(format!("{what}: {seen}"));
        }
    }
    assert!(forged.is_empty(), "{forged:#?}");
}

/// A trusted proxy (`[rate_limit] trusted_proxies`) extends the chain: its
/// `X-Forwarded-For` gets its own address appended, its `X-Forwarded-Proto`
/// is believed, and the client it names is `X-Real-IP`; the same headers
/// from any other peer are replaced.
#[test]
fn only_a_trusted_proxy_extends_the_forwarding_chain() {
    need("python3", &["--version"], "apt-get install -y python3");
    let tmp = tempfile::tempdir().unwrap();
    let (_wsgi, wsgi_url) = start_wsgi(tmp.path());
    let node = node_with("trusted_proxies = [\"127.0.0.2\"]\n");
    let bank = node.create_namespace("bank");
    let (s, v) = deploy_json(
        &node,
        &bank,
        serde_json::json!({"name": "web", "hosts": ["web.bank.test"],
                           "upstream": {"instances": [wsgi_url]}}),
    );
    assert_eq!(s, 201, "{v}");
    let h: &[(&str, &str)] = &[
        ("host", "web.bank.test"),
        ("x-forwarded-for", "203.0.113.9"),
        ("x-forwarded-proto", "https"),
        ("x-real-ip", "6.6.6.6"),
    ];
    for (from, xff, proto, real) in [
        (
            Some("127.0.0.2"),
            "203.0.113.9, 127.0.0.2",
            "https",
            "203.0.113.9",
        ),
        (None, "127.0.0.1", "http", "127.0.0.1"),
    ] {
        let (s, _, b) = http_from(from, "GET", &node.url("/"), h, None);
        let b = String::from_utf8_lossy(&b).into_owned();
        assert_eq!(s, 200, "{b}");
        let seen = json(&b)["headers"].clone();
        assert_eq!(seen["HTTP_X_FORWARDED_FOR"], xff, "from {from:?}: {seen}");
        assert_eq!(
            seen["HTTP_X_FORWARDED_PROTO"], proto,
            "from {from:?}: {seen}"
        );
        assert_eq!(seen["HTTP_X_REAL_IP"], real, "from {from:?}: {seen}");
    }
}

/// A deployment with `pass_ambiguous_paths` gets such paths unchanged, and
/// its routes are matched on how a decoding upstream reads them: `/files/a%2Fb`
/// reaches the open route as sent, while `/admin%2f` and
/// `/health/%2e%2e/admin` still meet `/admin`'s policy (401). A deployment
/// without it refuses them (400 `AMBIGUOUS_PATH`); a bad setting is refused
/// with nothing stored.
#[test]
fn pass_ambiguous_paths_passes_them_unchanged_under_the_same_policy() {
    need("python3", &["--version"], "apt-get install -y python3");
    let tmp = tempfile::tempdir().unwrap();
    let (_wsgi, wsgi_url) = start_wsgi(tmp.path());
    let node = node_with("");
    let bank = node.create_namespace("bank");
    let (s, v) = deploy_json(
        &node,
        &bank,
        serde_json::json!({"name": "bad", "hosts": ["bad.bank.test"],
                           "upstream": {"instances": [wsgi_url], "pass_ambiguous_paths": "yes"}}),
    );
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (400, Some("INVALID_UPSTREAM")),
        "{v}"
    );
    let (s, b) = node.with_key(&bank, "GET", "/v1/deployments", None);
    assert_eq!(
        (s, json(&b)["deployments"].clone()),
        (200, serde_json::json!([]))
    );
    for (name, pass) in [("raw", true), ("plain", false)] {
        let (s, v) = deploy_json(
            &node,
            &bank,
            serde_json::json!({
                "name": name, "hosts": [format!("{name}.bank.test")],
                "upstream": {"instances": [wsgi_url], "pass_ambiguous_paths": pass},
                "routes": [{"path_prefix": "/"},
                           {"path_prefix": "/admin", "policy": {"auth": "jwt"}}]
            }),
        );
        assert_eq!(s, 201, "{v}");
    }
    let get = |host: &str, path: &str| {
        let (s, _, b) = http("GET", &node.url(path), &[("host", host)], None);
        (s, String::from_utf8_lossy(&b).into_owned())
    };
    let (s, b) = get("raw.bank.test", "/files/a%2Fb;v=1");
    assert_eq!(s, 200, "{b}");
    assert_eq!(json(&b)["raw"], "/files/a%2Fb;v=1", "{b}");
    for path in [
        "/admin%2f",
        "/health/%2e%2e/admin",
        "/admin;x=1",
        "/x/..%2Fadmin",
    ] {
        let (s, b) = get("raw.bank.test", path);
        assert_eq!(
            (s, code(&b).as_str()),
            (401, "MISSING_CREDENTIAL"),
            "{path}: {b}"
        );
    }
    let (s, b) = get("raw.bank.test", "/admin%00");
    assert_eq!(
        (s, code(&b).as_str()),
        (400, "AMBIGUOUS_PATH"),
        "NUL is never passed: {b}"
    );
    let (s, b) = get("plain.bank.test", "/files/a%2Fb");
    assert_eq!((s, code(&b).as_str()), (400, "AMBIGUOUS_PATH"), "{b}");
}
