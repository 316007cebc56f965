//! The egress policy of upstream deployments (docs/deployments.md, "Egress
//! policy"): a tenant must not make the node connect where the tenant does not
//! own, such as the node's etcd, cloud metadata, private networks, loopback or
//! the node itself. Refused at create (400 `UPSTREAM_FORBIDDEN`, nothing
//! stored) by literal address and by name, and at connect time on the
//! addresses actually connected (502 `UPSTREAM_FORBIDDEN`).
//!
//! No test here sends a packet beyond loopback: names resolve through the
//! node's test-only hosts file (`MESHGATE_TEST_RESOLVE_FILE`), forbidden
//! addresses are only ever refused, and the public address some names resolve
//! to at create time (203.0.113.7, TEST-NET-3) is never connected: by the time
//! a request comes, the name resolves elsewhere.

use crate::common::*;
use crate::deploy::{ALLOW_LOOPBACK, Upstream, deploy_json, via};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};

/// The node's test resolver: a hosts-format file it re-reads at every lookup.
struct Hosts {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Hosts {
    fn new(text: &str) -> Hosts {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hosts");
        std::fs::write(&path, text).unwrap();
        Hosts { _dir: dir, path }
    }

    fn set(&self, text: &str) {
        std::fs::write(&self.path, text).unwrap();
    }
}

/// A node resolving names from `hosts`, with these `[deploy]` lines.
fn node_with(hosts: &Path, deploy: &str) -> TestNode {
    TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[deploy]\n{deploy}"),
        env: vec![(
            "MESHGATE_TEST_RESOLVE_FILE".into(),
            hosts.display().to_string(),
        )],
        ..Default::default()
    })
}

/// Whether a refusal names the node's own API address: "this node's own
/// listen address"; in cluster mode the deployment is judged by the
/// namespace's member "b", to which the test's node is "the API address of
/// cluster member a" (every member's address is refused the same way).
fn names_own_address(msg: &str) -> bool {
    msg.contains("this node's own listen address")
        || (cluster_mode() && msg.contains("the API address of cluster member a"))
}

/// Cluster mode: waits until member "b" refuses the test's node's API
/// address. "a" starts last and the others learn its address from etcd
/// shortly after it registers; a deployment made before that was accepted
/// (docs/cluster.md, "The suite on a cluster"). A probe deployment that is
/// accepted meanwhile is deleted again.
fn until_members_know_the_nodes_address(node: &TestNode, key: &str) {
    if !cluster_mode() {
        return;
    }
    let own = node.base.clone();
    wait_until(
        std::time::Duration::from_secs(10),
        "member b refusing a's API address",
        || {
            let mut body = upstream_body("probe.example", &[&own]);
            body["name"] = serde_json::json!("probe");
            let (s, v) = deploy_json(node, key, body);
            if s == 201 {
                let (d, b) = node.with_key(key, "DELETE", "/v1/deployments/probe", None);
                assert_eq!(d, 200, "{b}");
                return false;
            }
            assert_eq!((s, error_of(&v).0), (400, "UPSTREAM_FORBIDDEN"), "{v}");
            true
        },
    );
}

/// A listener on 127.0.0.1 that counts the connections made to it (each one
/// waits in its backlog), to prove nothing connected.
pub(super) struct Canary {
    listener: TcpListener,
    pub(super) port: u16,
}

impl Canary {
    pub(super) fn start() -> Canary {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        Canary { listener, port }
    }

    pub(super) fn connections(&self) -> usize {
        let mut n = 0;
        while self.listener.accept().is_ok() {
            n += 1;
        }
        n
    }
}

pub(super) fn upstream_body<S: AsRef<str>>(host: &str, instances: &[S]) -> serde_json::Value {
    let instances: Vec<&str> = instances.iter().map(AsRef::as_ref).collect();
    serde_json::json!({"name": "app", "hosts": [host], "upstream": {"instances": instances}})
}

pub(super) fn error_of(v: &serde_json::Value) -> (&str, &str) {
    (
        v["error"]["code"].as_str().unwrap_or(""),
        v["error"]["message"].as_str().unwrap_or(""),
    )
}

fn body_error(b: &[u8]) -> (String, String) {
    let v = json(&String::from_utf8_lossy(b));
    let (c, m) = error_of(&v);
    (c.to_string(), m.to_string())
}

/// No deployment in the namespace, and the host routes nowhere.
fn nothing_stored(node: &TestNode, key: &str, host: &str) {
    let (s, b) = node.with_key(key, "GET", "/v1/deployments", None);
    assert_eq!(s, 200, "{b}");
    assert_eq!(json(&b)["deployments"], serde_json::json!([]), "{b}");
    let (s, _, b) = via(node, host, "GET", "/", &[], None);
    assert_eq!(s, 404, "{}", String::from_utf8_lossy(&b));
}

/// Addresses in each forbidden range, and what the refusal names.
const FORBIDDEN: &[(&str, &str, &str)] = &[
    // (instance authority, address in the message, rule in the message)
    ("127.0.0.1:2379", "127.0.0.1:2379", "loopback"),
    ("169.254.169.254", "169.254.169.254:80", "link-local"),
    ("10.0.0.1:8080", "10.0.0.1:8080", "private"),
    ("172.16.0.1", "172.16.0.1:80", "private"),
    ("192.168.1.1", "192.168.1.1:80", "private"),
    ("100.64.0.1", "100.64.0.1:80", "CGNAT"),
    ("[::1]:80", "[::1]:80", "loopback"),
    ("0.0.0.0:80", "0.0.0.0:80", "unspecified"),
    ("[::]:80", "[::]:80", "unspecified"),
    ("localhost:80", "127.0.0.1:80", "loopback"),
    ("2130706433:80", "127.0.0.1:80", "loopback"),
    ("0x7f.1:80", "127.0.0.1:80", "loopback"),
    ("0177.0.0.1:80", "127.0.0.1:80", "loopback"),
    ("127.1:80", "127.0.0.1:80", "loopback"),
    ("[::ffff:127.0.0.1]:80", "[::ffff:127.0.0.1]:80", "loopback"),
    (
        "[::ffff:169.254.169.254]",
        "[::ffff:169.254.169.254]:80",
        "link-local",
    ),
    ("[fd00:ec2::254]", "[fd00:ec2::254]:80", "private"),
    ("[fe80::1]", "[fe80::1]:80", "link-local"),
    ("224.0.0.1", "224.0.0.1:80", "multicast"),
    ("[ff02::1]", "[ff02::1]:80", "multicast"),
    ("255.255.255.255", "255.255.255.255:80", "broadcast"),
];

/// Every forbidden range, by literal address in every spelling and by a name
/// resolving to it, is refused at create with 400 `UPSTREAM_FORBIDDEN` naming
/// the address and the rule; so is a deployment with one such instance among
/// allowed ones. Nothing is stored.
#[test]
fn forbidden_upstreams_are_refused_at_create_and_store_nothing() {
    let names: String = FORBIDDEN
        .iter()
        .enumerate()
        .filter_map(|(i, (_, addr, _))| {
            let ip = addr
                .rsplit_once(':')
                .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']'))?;
            Some(format!("{ip} n{i}.test\n"))
        })
        .collect();
    let hosts = Hosts::new(&names);
    let node = node_with(&hosts.path, "");
    let key = node.create_namespace("attacker");
    for (i, (authority, addr, rule)) in FORBIDDEN.iter().enumerate() {
        let literal = format!("http://{authority}");
        let (s, v) = deploy_json(&node, &key, upstream_body("app.test", &[&literal]));
        let (code, msg) = error_of(&v);
        assert_eq!((s, code), (400, "UPSTREAM_FORBIDDEN"), "{literal}: {v}");
        assert!(
            msg.contains(addr) && msg.contains(rule),
            "{literal}: the message names {addr} and {rule}: {msg}"
        );
        let port = addr.rsplit_once(':').unwrap().1;
        let named = format!("http://n{i}.test:{port}");
        let (s, v) = deploy_json(&node, &key, upstream_body("app.test", &[&named]));
        let (code, msg) = error_of(&v);
        assert_eq!((s, code), (400, "UPSTREAM_FORBIDDEN"), "{named}: {v}");
        assert!(
            msg.contains(&format!("n{i}.test resolves to")) && msg.contains(rule),
            "{named}: {msg}"
        );
    }
    // One forbidden instance refuses the whole deployment.
    let mixed = vec![
        "http://203.0.113.7:80".to_string(),
        "http://169.254.169.254".to_string(),
    ];
    let (s, v) = deploy_json(&node, &key, upstream_body("app.test", &mixed));
    assert_eq!((s, error_of(&v).0), (400, "UPSTREAM_FORBIDDEN"), "{v}");
    // A name with several addresses, one of them forbidden, is refused.
    hosts.set("203.0.113.7 multi.test\n10.1.2.3 multi.test\n");
    let (s, v) = deploy_json(
        &node,
        &key,
        upstream_body("app.test", &["http://multi.test:80"]),
    );
    let (code, msg) = error_of(&v);
    assert_eq!((s, code), (400, "UPSTREAM_FORBIDDEN"), "{v}");
    assert!(msg.contains("10.1.2.3:80"), "{msg}");
    // A name that does not resolve cannot be checked, so it is refused too.
    let (s, v) = deploy_json(
        &node,
        &key,
        upstream_body("app.test", &["http://absent.test:80"]),
    );
    assert_eq!((s, error_of(&v).0), (400, "UPSTREAM_UNRESOLVABLE"), "{v}");
    nothing_stored(&node, &key, "app.test");
}

/// DNS rebinding: a name that resolved to a public address when it was
/// deployed, and to loopback when a request comes, is never connected: 502
/// `UPSTREAM_FORBIDDEN` for HTTP, a body-carrying request and a WebSocket
/// upgrade alike, and the refusal is no health failure (it stays 502, never
/// 503 `NO_HEALTHY_UPSTREAM`).
#[test]
fn a_name_rebound_to_loopback_is_never_connected() {
    let canary = Canary::start();
    let hosts = Hosts::new("203.0.113.7 rebind.test\n");
    let node = node_with(&hosts.path, "");
    let key = node.create_namespace("rebinder");
    let instance = format!("http://rebind.test:{}", canary.port);
    let (s, v) = deploy_json(&node, &key, upstream_body("rebind.example", &[instance]));
    assert_eq!(s, 201, "{v}");
    hosts.set("127.0.0.1 rebind.test\n");
    let want_msg = format!("rebind.test resolves to 127.0.0.1:{}", canary.port);
    for _ in 0..4 {
        let (s, _, b) = via(
            &node,
            "rebind.example",
            "GET",
            "/latest/meta-data",
            &[],
            None,
        );
        let (code, msg) = body_error(&b);
        assert_eq!((s, code.as_str()), (502, "UPSTREAM_FORBIDDEN"), "{msg}");
        assert!(msg.contains(&want_msg) && msg.contains("loopback"), "{msg}");
    }
    let (s, _, b) = via(
        &node,
        "rebind.example",
        "POST",
        "/v2/keys/x",
        &[("content-type", "application/x-www-form-urlencoded")],
        Some(b"value=owned"),
    );
    assert_eq!((s, body_error(&b).0.as_str()), (502, "UPSTREAM_FORBIDDEN"));
    let (s, _, b) = via(
        &node,
        "rebind.example",
        "GET",
        "/ws",
        &[
            ("upgrade", "websocket"),
            ("sec-websocket-version", "13"),
            ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ],
        None,
    );
    assert_eq!((s, body_error(&b).0.as_str()), (502, "UPSTREAM_FORBIDDEN"));
    assert_eq!(canary.connections(), 0, "the node connected to loopback");
    let (_, b) = node.with_key(&key, "GET", "/v1/deployments/app", None);
    assert_eq!(
        json(&b)["deployment"]["target"]["instances"][0]["healthy"],
        true,
        "{b}"
    );
}

/// The allow list opens 127.0.0.0/8 (what the proxy tests rely on) but not the
/// node's own port, by address, by `localhost` or by a name; `upstream_deny`
/// closes a range again, at create and at connect time.
#[test]
fn allow_opens_loopback_but_not_the_node_itself_and_deny_closes_again() {
    let hosts = Hosts::new("127.0.0.1 self.test\n");
    let node = node_with(&hosts.path, ALLOW_LOOPBACK);
    let key = node.create_namespace("dev");
    let up = Upstream::start("allowed");
    let (s, v) = deploy_json(&node, &key, upstream_body("dev.test", &[up.url()]));
    assert_eq!(s, 201, "{v}");
    let (s, _, b) = via(&node, "dev.test", "GET", "/x", &[], None);
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json(&String::from_utf8_lossy(&b))["id"], "allowed");
    let port = node.addr.rsplit_once(':').unwrap().1;
    until_members_know_the_nodes_address(&node, &key);
    for own in [
        format!("http://127.0.0.1:{port}"),
        format!("http://localhost:{port}"),
        format!("http://self.test:{port}"),
        format!("http://[::ffff:127.0.0.1]:{port}"),
        format!("http://0.0.0.0:{port}"),
    ] {
        let (s, v) = deploy_json(&node, &key, upstream_body("self.example", &[&own]));
        let (code, msg) = error_of(&v);
        assert_eq!((s, code), (400, "UPSTREAM_FORBIDDEN"), "{own}: {v}");
        assert!(
            names_own_address(&msg) || msg.contains("unspecified"),
            "{own}: {msg}"
        );
    }
    // Opening loopback opens nothing else.
    let (s, v) = deploy_json(
        &node,
        &key,
        upstream_body("other.example", &["http://10.0.0.1:80"]),
    );
    assert_eq!((s, error_of(&v).0), (400, "UPSTREAM_FORBIDDEN"), "{v}");

    // Deny wins over allow: 127.0.0.1 closed again, the rest of 127/8 open.
    let canary = Canary::start();
    let hosts = Hosts::new("127.0.0.2 flip.test\n");
    let node = node_with(
        &hosts.path,
        &format!("{ALLOW_LOOPBACK}upstream_deny = [\"127.0.0.1/32\"]\n"),
    );
    let key = node.create_namespace("dev");
    let (s, v) = deploy_json(&node, &key, upstream_body("dev.test", &[up.url()]));
    let (code, msg) = error_of(&v);
    assert_eq!((s, code), (400, "UPSTREAM_FORBIDDEN"), "{v}");
    assert!(msg.contains("upstream_deny (127.0.0.1/32)"), "{msg}");
    let flip = format!("http://flip.test:{}", canary.port);
    let (s, v) = deploy_json(&node, &key, upstream_body("flip.example", &[flip]));
    assert_eq!(s, 201, "{v}");
    hosts.set("127.0.0.1 flip.test\n");
    let (s, _, b) = via(&node, "flip.example", "GET", "/", &[], None);
    let (code, msg) = body_error(&b);
    assert_eq!((s, code.as_str()), (502, "UPSTREAM_FORBIDDEN"), "{msg}");
    assert!(msg.contains("upstream_deny"), "{msg}");
    assert_eq!(
        canary.connections(),
        0,
        "the node connected to a denied address"
    );
}

/// A server on 127.0.0.1 that answers every request with a redirect.
fn redirector(location: String) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut c in l.incoming().map_while(Result::ok) {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 1024];
            while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                match c.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            let _ = write!(
                c,
                "HTTP/1.1 302 Found\r\nlocation: {location}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            );
        }
    });
    port
}

/// Redirects are the upstream's answer, passed to the client: the node never
/// follows one (to a loopback canary here).
#[test]
fn redirects_are_passed_on_never_followed() {
    let hosts = Hosts::new("");
    let node = node_with(&hosts.path, ALLOW_LOOPBACK);
    let canary = Canary::start();
    let target = format!("http://127.0.0.1:{}/secret", canary.port);
    let port = redirector(target.clone());
    let key = node.create_namespace("redir");
    let (s, v) = deploy_json(
        &node,
        &key,
        upstream_body("redir.test", &[format!("http://127.0.0.1:{port}")]),
    );
    assert_eq!(s, 201, "{v}");
    let (s, h, _) = via(&node, "redir.test", "GET", "/", &[], None);
    assert_eq!(s, 302);
    assert_eq!(header(&h, "location"), Some(target.as_str()));
    // The client got the upstream's own 302: a node that follows redirects
    // answers with what the redirect led to, so it is done with the request
    // without following. Had it connected to the canary on the way, the
    // kernel would already hold that connection in the canary's backlog.
    assert_eq!(canary.connections(), 0, "the redirect was followed");
}

/// The attack's first step: a tenant of a cluster node deploys an upstream at
/// the node's own etcd. Refused with 400 `UPSTREAM_FORBIDDEN` as the node's
/// own etcd endpoint, on a node with the default policy and on one whose
/// operator opened loopback for development, by address and by a name
/// resolving to it; nothing is stored.
#[cfg(feature = "cluster")]
#[test]
fn a_tenant_cannot_point_a_deployment_at_the_nodes_etcd() {
    let etcd = crate::etcd_process::EtcdProcess::start();
    let etcd_url = etcd.url();
    let (_, etcd_authority) = etcd_url.split_once("://").unwrap();
    let (etcd_ip, etcd_port) = etcd_authority.rsplit_once(':').unwrap();
    let hosts = Hosts::new(&format!("{etcd_ip} etcd.internal.test\n"));
    let tmp = tempfile::tempdir().unwrap();
    let start = |id: &str, deploy: &str| {
        TestNode::start_with(NodeOpts {
            config: format!(
                "{TEST_CONFIG}[cluster]\n{}node_id = \"{id}\"\n[deploy]\n{deploy}",
                etcd.cluster_toml()
            ),
            env: vec![
                (
                    "MESHGATE_CLUSTER_SECRET".into(),
                    "egress-test-cluster-secret".into(),
                ),
                (
                    "MESHGATE_TEST_RESOLVE_FILE".into(),
                    hosts.path.display().to_string(),
                ),
            ],
            data_dir: Some(tmp.path().join(id)),
            ..Default::default()
        })
    };
    let strict = start("strict", "");
    let dev = start("dev", ALLOW_LOOPBACK);
    for (node, ns) in [(&strict, "attacker1"), (&dev, "attacker2")] {
        let key = node.create_namespace(ns);
        for instance in [
            etcd_url.clone(),
            format!("http://etcd.internal.test:{etcd_port}"),
        ] {
            let (s, v) = deploy_json(node, &key, upstream_body("etcd.example", &[&instance]));
            let (code, msg) = error_of(&v);
            assert_eq!((s, code), (400, "UPSTREAM_FORBIDDEN"), "{instance}: {v}");
            assert!(
                msg.contains(&format!("{etcd_ip}:{etcd_port}"))
                    && msg.contains("this node's own etcd endpoint"),
                "{instance}: {msg}"
            );
        }
        nothing_stored(node, &key, "etcd.example");
    }
}

/// An allow entry naming the node's exact address no longer opens the node
/// itself: its own port stays refused (400 `UPSTREAM_FORBIDDEN`, nothing
/// stored) until the operator sets `upstream_allow_own = true`, and then the
/// same deployment is made.
#[test]
fn only_allow_own_opens_the_nodes_own_addresses() {
    let hosts = Hosts::new("");
    let node = node_with(&hosts.path, "upstream_allow = [\"127.0.0.1/32\"]\n");
    let key = node.create_namespace("dev");
    until_members_know_the_nodes_address(&node, &key);
    let own = node.base.clone();
    let (s, v) = deploy_json(&node, &key, upstream_body("self.example", &[&own]));
    let (code, msg) = error_of(&v);
    assert_eq!((s, code), (400, "UPSTREAM_FORBIDDEN"), "{own}: {v}");
    assert!(names_own_address(&msg), "{msg}");
    nothing_stored(&node, &key, "self.example");

    let node = node_with(
        &hosts.path,
        &format!("{ALLOW_LOOPBACK}upstream_allow_own = true\n"),
    );
    let key = node.create_namespace("dev");
    let own = node.base.clone();
    let (s, v) = deploy_json(&node, &key, upstream_body("self.example", &[&own]));
    assert_eq!(s, 201, "upstream_allow_own opens {own}: {v}");
}

/// With loopback opened (`upstream_allow = ["127.0.0.0/8"]`), a tenant of a
/// three-node cluster still cannot deploy an upstream at etcd's peer port
/// (`/members`, `/raft`; the node learns it from etcd's member list) nor at
/// another member's API (from the node registry): 400 `UPSTREAM_FORBIDDEN`
/// naming which address it is, nothing stored; a member that joins later
/// (c) is refused once the node has read the registry again. A node of the
/// same cluster with `upstream_allow_own = true` makes both deployments.
#[cfg(feature = "cluster")]
#[test]
fn a_tenant_cannot_reach_etcds_peer_port_nor_another_member() {
    let etcd = crate::etcd_process::EtcdProcess::start();
    let hosts = Hosts::new("");
    let tmp = tempfile::tempdir().unwrap();
    let start = |id: &str, deploy: &str| {
        TestNode::start_with(NodeOpts {
            config: format!(
                "{TEST_CONFIG}[cluster]\n{}node_id = \"{id}\"\nregister_seconds = 1\n[deploy]\n{ALLOW_LOOPBACK}{deploy}",
                etcd.cluster_toml()
            ),
            env: vec![
                (
                    "MESHGATE_CLUSTER_SECRET".into(),
                    "egress-test-cluster-secret".into(),
                ),
                (
                    "MESHGATE_TEST_RESOLVE_FILE".into(),
                    hosts.path.display().to_string(),
                ),
            ],
            data_dir: Some(tmp.path().join(id)),
            ..Default::default()
        })
    };
    // b first: a (and later d) find it in the registry when they start.
    let b = start("b", "");
    let strict = start("a", "");
    let peer = etcd.peer_url();
    let cases = [
        (peer.clone(), "the etcd peer URL of member test"),
        (b.base.clone(), "the API address of cluster member b"),
    ];
    // Each namespace lives on the node the test talks to, so that node
    // (not b) judges the upstream: b's API is another member's there.
    let ns_key = |node: &TestNode, name: &str, member: &str| {
        let (s, body) = node.op(
            "POST",
            "/v1/namespaces",
            Some(&format!(r#"{{"name":"{name}","members":["{member}"]}}"#)),
        );
        assert_eq!(s, 201, "{body}");
        json(&body)["api_key"].as_str().unwrap().to_string()
    };
    let key = ns_key(&strict, "attacker", "a");
    for (instance, what) in &cases {
        let (s, v) = deploy_json(&strict, &key, upstream_body("inside.example", &[instance]));
        let (code, msg) = error_of(&v);
        assert_eq!((s, code), (400, "UPSTREAM_FORBIDDEN"), "{instance}: {v}");
        assert!(msg.contains(what), "{instance}: {msg}");
    }
    nothing_stored(&strict, &key, "inside.example");
    // A member that joins later is refused from then on: a follows the
    // registry (a deployment made before it noticed would be a later one).
    let c = start("c", "");
    let mut attempt = 0;
    wait_until(
        std::time::Duration::from_secs(30),
        "member c's API refused through a",
        || {
            attempt += 1;
            let host = format!("late{attempt}.example");
            let (s, v) = deploy_json(&strict, &key, upstream_body(&host, &[&c.base]));
            s == 400
                && error_of(&v)
                    .1
                    .contains("the API address of cluster member c")
        },
    );
    let open = start("d", "upstream_allow_own = true\n");
    let key = ns_key(&open, "tooling", "d");
    for (i, (instance, _)) in cases.iter().enumerate() {
        let (s, v) = deploy_json(
            &open,
            &key,
            upstream_body(&format!("inside{i}.example"), &[instance]),
        );
        assert_eq!(s, 201, "upstream_allow_own opens {instance}: {v}");
    }
}

/// The attack: three nodes on etcd, loopback opened for development, a
/// `[metrics] listen` listener on each; a tenant of node x points
/// deployments at x's, y's and z's metrics listeners (every namespace's
/// deployment names, upstream URLs and counters). Each is refused with 400
/// `UPSTREAM_FORBIDDEN` naming the member's metrics listener, nothing is
/// stored; so is y's API listener as bound, and the metrics listener of a
/// member w that joins later, once x has read the registry again. Then y
/// stops and a store writer deletes its registry records (`_nodes/y` and
/// the mesh's): once x has re-read the registry (a member v joining after
/// the deletion is refused), y's metrics and API listeners are still refused.
#[cfg(feature = "cluster")]
#[test]
fn every_listener_of_every_member_is_refused() {
    let etcd = crate::etcd_process::EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let start = |id: &str| {
        let metrics = free_port();
        let node = TestNode::start_with(NodeOpts {
            config: format!(
                "{TEST_CONFIG}[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n[cluster]\n{}node_id = \"{id}\"\nregister_seconds = 1\n[deploy]\n{ALLOW_LOOPBACK}",
                etcd.cluster_toml()
            ),
            env: vec![(
                "MESHGATE_CLUSTER_SECRET".into(),
                "egress-test-cluster-secret".into(),
            )],
            data_dir: Some(tmp.path().join(id)),
            ..Default::default()
        });
        (node, format!("http://127.0.0.1:{metrics}"))
    };
    let (y, y_metrics) = start("y");
    let (z, z_metrics) = start("z");
    let (x, x_metrics) = start("x");
    // The listeners answer: they are what the attack reached.
    for m in [&x_metrics, &y_metrics, &z_metrics] {
        assert_eq!(
            http("GET", &format!("{m}/metrics"), &[], None).0,
            200,
            "{m}"
        );
    }
    let (s, body) = x.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"evil","members":["x"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    let key = json(&body)["api_key"].as_str().unwrap().to_string();
    // A deployment made before x read a member's record is accepted: it is
    // deleted again, and the wait goes on (docs/cluster.md, "Every address
    // of every member": the registry is re-read as it changes).
    let refused = |instance: &str, what: &str| {
        let (s, v) = deploy_json(&x, &key, upstream_body("inside.example", &[instance]));
        if s == 201 {
            eprintln!("accepted before x read the registry: {instance}");
            let (d, b) = x.with_key(&key, "DELETE", "/v1/deployments/app", None);
            assert_eq!(d, 200, "{b}");
            return false;
        }
        let (code, msg) = error_of(&v);
        (s, code) == (400, "UPSTREAM_FORBIDDEN") && msg.contains(what)
    };
    // y and z registered before x started; x's own is noted at its start.
    wait_until(
        std::time::Duration::from_secs(10),
        "x refusing y's and z's metrics listeners",
        || {
            refused(&y_metrics, "the metrics listener of cluster member y")
                && refused(&z_metrics, "the metrics listener of cluster member z")
        },
    );
    let (s, v) = deploy_json(&x, &key, upstream_body("inside.example", &[&x_metrics]));
    let (code, msg) = error_of(&v);
    assert_eq!((s, code), (400, "UPSTREAM_FORBIDDEN"), "{v}");
    assert!(msg.contains("metrics"), "{msg}");
    // y's API listener as bound (the same socket as its advertised address).
    let (s, v) = deploy_json(&x, &key, upstream_body("inside.example", &[&y.base]));
    assert_eq!((s, error_of(&v).0), (400, "UPSTREAM_FORBIDDEN"), "{v}");
    nothing_stored(&x, &key, "inside.example");
    // A member that joins later is refused from then on.
    let (_w, w_metrics) = start("w");
    wait_until(
        std::time::Duration::from_secs(30),
        "member w's metrics listener refused through x",
        || refused(&w_metrics, "the metrics listener of cluster member w"),
    );
    nothing_stored(&x, &key, "inside.example");
    // y stops; the store writer deletes its record and every mesh record
    // (the live ones come back at their next registration).
    let y_api = y.base.clone();
    drop(y);
    for (k, _) in super::secrets::dump(&etcd) {
        if let Some(k) = k.strip_prefix(super::secrets::DATA)
            && (k == b"_nodes/y" || k.starts_with(b"_pubsub_mesh_peers/"))
        {
            super::secrets::raw_delete(&etcd, k);
        }
    }
    // v's record is written after the deletion: once x refuses v, x has read
    // a registry without y.
    let (_v, v_metrics) = start("v");
    wait_until(
        std::time::Duration::from_secs(30),
        "member v's metrics listener refused through x",
        || refused(&v_metrics, "the metrics listener of cluster member v"),
    );
    for (instance, what) in [
        (&y_metrics, "the metrics listener of cluster member y"),
        (&y_api, "cluster member y"),
    ] {
        let (s, v) = deploy_json(&x, &key, upstream_body("inside.example", &[instance]));
        let (code, msg) = error_of(&v);
        assert_eq!((s, code), (400, "UPSTREAM_FORBIDDEN"), "{instance}: {v}");
        assert!(msg.contains(what), "{msg}");
    }
    nothing_stored(&x, &key, "inside.example");
    drop(z);
}
