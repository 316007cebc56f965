//! Hosts cannot shadow the node (issue #39, docs/security.md "Tenant →
//! tenant"). The attack: holding only the owner key of namespace "mallory"
//! on a node that also hosts "bank", a deployment with `hosts=127.0.0.1`
//! took every request that reached the node by its address (bank's API
//! calls and the operator's, `/__admin` too) to mallory's upstream, with
//! `Authorization: Bearer <bank's key>` and `<the operator key>`.
//!
//! Now every spelling of an address, `localhost` and its subdomains, single
//! labels and the node's own names are refused (400 `HOST_RESERVED`, nothing
//! stored), and a request whose Host is an address is the node's, even when
//! a record stored before the rule claims that host. Mallory's upstream is a
//! listener on 127.0.0.1 that counts connections (none may come) or, for the
//! old record, an echo that would show any request it got.

use super::egress::{Canary, error_of, upstream_body};
use crate::common::*;
#[cfg(feature = "cluster")]
use crate::deploy::Upstream;
use crate::deploy::{ALLOW_LOOPBACK, deploy_json, via};

/// `[server] base_domain` of these nodes, so the gateway's own hosts are
/// names of their own (the default, `localhost`, is reserved anyway).
const BASE: &str = "gw.test";

/// The hosts mallory tries: addresses in every spelling, localhost names,
/// single labels and the gateway's own hosts.
const SHADOWS: &[&str] = &[
    "127.0.0.1",
    "127.0.0.1.",
    "2130706433",
    "0x7f.1",
    "0x7f000001",
    "0177.0.0.1",
    "127.1",
    "[::1]",
    "::1",
    "[0:0:0:0:0:0:0:1]",
    "[::ffff:127.0.0.1]",
    "::FFFF:7F00:1",
    "10.0.0.1",
    "203.0.113.7",
    "1.2.3.4.5",
    "LOCALHOST",
    "localhost.",
    "api.localhost",
    "foo.localhost",
    "localhost.localdomain",
    "x.localdomain",
    "LocalHost.LocalDomain.",
    "intranet",
    "gw.test",
    "ns-bank.gw.test",
];

/// The node's config: loopback upstreams allowed (as on a developer's node,
/// where mallory's upstream would be reachable), the gateway on `BASE`.
fn config() -> String {
    format!("{TEST_CONFIG}[server]\nbase_domain = \"{BASE}\"\n[deploy]\n{ALLOW_LOOPBACK}")
}

/// Host headers that reach the node by its address, in several spellings.
fn ip_hosts(node: &TestNode) -> Vec<String> {
    let port = node.addr.rsplit_once(':').unwrap().1;
    vec![
        format!("127.0.0.1:{port}"),
        "127.0.0.1".into(),
        "2130706433".into(),
        "0x7f.1".into(),
        format!("[::1]:{port}"),
        "[::ffff:127.0.0.1]".into(),
    ]
}

/// The attack through `node`: every shadowing host refused with 400
/// `HOST_RESERVED` and nothing stored; bank's API call and the operator's
/// dashboard by the node's address (every spelling as Host) still answered
/// by the node; mallory's upstream never connected.
fn shadowing_is_refused(node: &TestNode) {
    let canary = Canary::start();
    let bank = node.create_namespace("bank");
    let mallory = node.create_namespace("mallory");
    let (s, b) = node.with_key(&bank, "PUT", "/v1/kv/balance", Some(b"100"));
    assert_eq!(s, 200, "{b}");
    let upstream = format!("http://127.0.0.1:{}", canary.port);
    for host in SHADOWS {
        let (s, v) = deploy_json(node, &mallory, upstream_body(host, &[&upstream]));
        let (code, msg) = error_of(&v);
        assert_eq!((s, code), (400, "HOST_RESERVED"), "{host}: {v}");
        assert!(msg.contains("node itself"), "{host}: {msg}");
    }
    // One ordinary host beside a reserved one refuses the whole deployment.
    let (s, v) = deploy_json(
        node,
        &mallory,
        serde_json::json!({"name": "app", "hosts": ["www.mallory.test", "127.0.0.1"],
            "upstream": {"instances": [upstream]}}),
    );
    assert_eq!((s, error_of(&v).0), (400, "HOST_RESERVED"), "{v}");
    let (s, b) = node.with_key(&mallory, "GET", "/v1/deployments", None);
    assert_eq!(
        (s, json(&b)["deployments"].clone()),
        (200, serde_json::json!([])),
        "{b}"
    );
    let (s, _, b) = via(node, "www.mallory.test", "GET", "/", &[], None);
    assert_eq!(s, 404, "nothing routes: {}", String::from_utf8_lossy(&b));

    let bank_auth = format!("Bearer {bank}");
    let op_auth = format!("Bearer {}", node.operator_key);
    for host in ip_hosts(node) {
        let (s, _, b) = http(
            "GET",
            &node.url("/v1/kv/balance"),
            &[("host", &host), ("authorization", &bank_auth)],
            None,
        );
        assert_eq!(
            (s, String::from_utf8_lossy(&b).as_ref()),
            (200, "100"),
            "bank's call with Host {host} is the node's"
        );
        let (s, _, b) = http(
            "GET",
            &node.url("/__admin/api/snapshot"),
            &[("host", &host), ("authorization", &op_auth)],
            None,
        );
        let b = String::from_utf8_lossy(&b);
        assert_eq!(s, 200, "the operator's dashboard with Host {host}: {b}");
        assert!(json(&b).is_object(), "{b}");
        assert!(json(&b).get("authorization").is_none(), "{b}");
    }
    assert_eq!(canary.connections(), 0, "mallory's upstream was connected");
}

/// On one node: every spelling of the node's address, localhost names,
/// single labels and the gateway's hosts are refused (400 `HOST_RESERVED`,
/// nothing stored); bank's and the operator's calls by address stay the
/// node's; mallory's upstream counts no connection.
#[test]
fn hosts_cannot_shadow_the_node() {
    let node = TestNode::start_with(NodeOpts {
        config: config(),
        ..Default::default()
    });
    shadowing_is_refused(&node);
}

/// Three nodes on etcd: the same attack through node a (bank and mallory
/// placed on b) is refused the same way. A deployment record written into
/// etcd as an older node stored it, claiming `127.0.0.1`, `[::1]` and an
/// ordinary host, serves the ordinary host (every node rebuilt its index)
/// while bank's and the operator's calls by address stay the nodes' own:
/// the echo upstream never answers them.
#[cfg(feature = "cluster")]
#[test]
fn hosts_cannot_shadow_a_cluster_even_from_an_old_record() {
    use meshgate::deploy::model::{
        DeploymentRecord, DeploymentVersion, HostClaim, RouteSpec, TargetSpec, dep_key, host_key,
        ver_key,
    };
    use meshgate::storage::{BatchOp, EtcdStore, OrderedKv};
    let etcd = crate::etcd_process::EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let start = |id: &str| {
        TestNode::start_with(NodeOpts {
            config: format!(
                "{}[cluster]\n{}node_id = \"{id}\"\nregister_seconds = 1\n",
                config(),
                etcd.cluster_toml()
            ),
            env: vec![(
                "MESHGATE_CLUSTER_SECRET".into(),
                "hosts-test-cluster-secret".into(),
            )],
            data_dir: Some(tmp.path().join(id)),
            ..Default::default()
        })
    };
    let (b, c) = (start("b"), start("c"));
    let a = start("a");
    let create = |name: &str| {
        let (s, body) = a.op(
            "POST",
            "/v1/namespaces",
            Some(&format!(r#"{{"name":"{name}","members":["b"]}}"#)),
        );
        assert_eq!(s, 201, "{body}");
        json(&body)["api_key"].as_str().unwrap().to_string()
    };
    let canary = Canary::start();
    let bank = create("bank");
    let mallory = create("mallory");
    let (s, body) = a.with_key(&bank, "PUT", "/v1/kv/balance", Some(b"100"));
    assert_eq!(s, 200, "{body}");
    let upstream = format!("http://127.0.0.1:{}", canary.port);
    for host in SHADOWS {
        let (s, v) = deploy_json(&a, &mallory, upstream_body(host, &[&upstream]));
        assert_eq!((s, error_of(&v).0), (400, "HOST_RESERVED"), "{host}: {v}");
    }
    let (s, body) = a.with_key(&mallory, "GET", "/v1/deployments", None);
    assert_eq!(
        (s, json(&body)["deployments"].clone()),
        (200, serde_json::json!([])),
        "{body}"
    );
    assert_eq!(canary.connections(), 0, "mallory's upstream was connected");

    // A record an older node stored, written straight into etcd.
    let echo = Upstream::start("mallory");
    let hosts: Vec<String> = ["legacy.mallory.test", "127.0.0.1", "[::1]"]
        .map(String::from)
        .to_vec();
    let ver = DeploymentVersion {
        version: 1,
        hosts: hosts.clone(),
        routes: vec![RouteSpec::everything()],
        target: TargetSpec::Upstream {
            instances: vec![echo.url()],
            weights: vec![],
            balance: Default::default(),
            health: None,
            compress: true,
            pass_ambiguous_paths: false,
            allow_underscore_headers: false,
            grpc: None,
        },
        created_at: 0,
        tls_auto: false,
    };
    let rec = DeploymentRecord {
        name: "old".into(),
        namespace: "mallory".into(),
        active: 1,
        latest: 1,
        created_at: 0,
        updated_at: 0,
    };
    let claim = serde_json::to_vec(&HostClaim {
        namespace: "mallory".into(),
    })
    .unwrap();
    let mut ops = vec![
        BatchOp::Put(
            ver_key("mallory", "old", 1),
            serde_json::to_vec(&ver).unwrap(),
        ),
        BatchOp::Put(dep_key("mallory", "old"), serde_json::to_vec(&rec).unwrap()),
        BatchOp::Put(b"_deploy/generation".to_vec(), b"legacy-record".to_vec()),
    ];
    ops.extend(
        hosts
            .iter()
            .map(|h| BatchOp::Put(host_key(h), claim.clone())),
    );
    // MAC'd as a node writes every record (`storage/record_mac.rs`): an
    // old record's contents, not a store writer's forgery.
    let mac = meshgate::storage::RecordMac::derive(b"hosts-test-cluster-secret");
    for op in &mut ops {
        if let BatchOp::Put(k, v) = op {
            *v = mac.wrap(k, v);
        }
    }
    actix_web::rt::System::new().block_on(async {
        let store = EtcdStore::connect(&[etcd.url()]).await.unwrap();
        store.apply_batch(ops).await.unwrap();
    });
    for node in [&a, &b, &c] {
        wait_until(
            std::time::Duration::from_secs(30),
            "the old record's ordinary host routes",
            || {
                let (s, _, body) = via(node, "legacy.mallory.test", "GET", "/", &[], None);
                s == 200 && json(&String::from_utf8_lossy(&body))["id"] == "mallory"
            },
        );
        let bank_auth = format!("Bearer {bank}");
        let op_auth = format!("Bearer {}", node.operator_key);
        for host in ip_hosts(node) {
            let (s, _, body) = http(
                "GET",
                &node.url("/v1/kv/balance"),
                &[("host", &host), ("authorization", &bank_auth)],
                None,
            );
            assert_eq!(
                (s, String::from_utf8_lossy(&body).as_ref()),
                (200, "100"),
                "bank's call with Host {host} through {} is the node's",
                node.base
            );
            let (s, _, body) = http(
                "GET",
                &node.url("/__admin/api/snapshot"),
                &[("host", &host), ("authorization", &op_auth)],
                None,
            );
            let body = String::from_utf8_lossy(&body);
            assert_eq!(s, 200, "the operator's dashboard with Host {host}: {body}");
            assert!(
                json(&body).get("authorization").is_none(),
                "mallory's echo answered: {body}"
            );
        }
    }
}

/// Names near the reserved ones: the loopback names of `/etc/hosts` under
/// `localdomain4` and `localdomain6`, and names under the gateway's base
/// domain (a namespace host's subdomain, which a cookie with
/// `Domain=ns-bank.<base_domain>` reaches).
const NEAR: &[&str] = &[
    "localhost4.localdomain4",
    "localhost6.localdomain6",
    "LOCALHOST6.LOCALDOMAIN6.",
    "x.localdomain4",
    "a.b.localdomain6",
    "localdomain4",
    "localdomain6.",
    "x.ns-bank.gw.test",
    "www.gw.test",
    "a.b.gw.test",
];

/// Mallory's deployment claiming a loopback name under `localdomain4`/
/// `localdomain6` or any name under the base domain (`x.ns-bank.gw.test`,
/// `www.gw.test`) is refused with 400 `HOST_RESERVED`; nothing is stored
/// and mallory's upstream is never connected.
#[test]
fn near_reserved_hosts_are_refused() {
    let node = TestNode::start_with(NodeOpts {
        config: config(),
        ..Default::default()
    });
    let canary = Canary::start();
    let mallory = node.create_namespace("mallory");
    let upstream = format!("http://127.0.0.1:{}", canary.port);
    for host in NEAR {
        let (s, v) = deploy_json(&node, &mallory, upstream_body(host, &[&upstream]));
        let (code, msg) = error_of(&v);
        assert_eq!((s, code), (400, "HOST_RESERVED"), "{host}: {v}");
        assert!(msg.contains("node itself"), "{host}: {msg}");
    }
    let (s, b) = node.with_key(&mallory, "GET", "/v1/deployments", None);
    assert_eq!(
        (s, json(&b)["deployments"].clone()),
        (200, serde_json::json!([])),
        "{b}"
    );
    assert_eq!(canary.connections(), 0, "mallory's upstream was connected");
}

/// The host of `[server] public_url` is the node's: mallory's deployment
/// claiming it (any case, trailing dot) is refused with 400
/// `HOST_RESERVED` and nothing stored; bank's API call and the operator's
/// dashboard with that Host are answered by the node, and mallory's
/// upstream is never connected.
#[test]
fn the_public_url_host_is_the_nodes() {
    let node = TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}[server]\nbase_domain = \"{BASE}\"\npublic_url = \"https://Gate.Example.test:8443/base\"\n[deploy]\n{ALLOW_LOOPBACK}"
        ),
        ..Default::default()
    });
    let canary = Canary::start();
    let bank = node.create_namespace("bank");
    let mallory = node.create_namespace("mallory");
    let (s, b) = node.with_key(&bank, "PUT", "/v1/kv/balance", Some(b"100"));
    assert_eq!(s, 200, "{b}");
    let upstream = format!("http://127.0.0.1:{}", canary.port);
    for host in ["gate.example.test", "GATE.Example.test."] {
        let (s, v) = deploy_json(&node, &mallory, upstream_body(host, &[&upstream]));
        let (code, msg) = error_of(&v);
        assert_eq!((s, code), (400, "HOST_RESERVED"), "{host}: {v}");
        assert!(msg.contains("public_url"), "{host}: {msg}");
    }
    let (s, b) = node.with_key(&mallory, "GET", "/v1/deployments", None);
    assert_eq!(
        (s, json(&b)["deployments"].clone()),
        (200, serde_json::json!([])),
        "{b}"
    );
    let bank_auth = format!("Bearer {bank}");
    let op_auth = format!("Bearer {}", node.operator_key);
    for host in ["gate.example.test", "gate.example.test:8443"] {
        let (s, _, b) = via(
            &node,
            host,
            "GET",
            "/v1/kv/balance",
            &[("authorization", &bank_auth)],
            None,
        );
        assert_eq!(
            (s, String::from_utf8_lossy(&b).as_ref()),
            (200, "100"),
            "bank's call with Host {host} is the node's"
        );
        let (s, _, b) = via(
            &node,
            host,
            "GET",
            "/__admin/api/snapshot",
            &[("authorization", &op_auth)],
            None,
        );
        let b = String::from_utf8_lossy(&b);
        assert_eq!(s, 200, "the operator's dashboard with Host {host}: {b}");
        assert!(json(&b).is_object(), "{b}");
    }
    assert_eq!(canary.connections(), 0, "mallory's upstream was connected");
}

/// A self-signed certificate for `names` (and its key) into `dir`.
fn write_cert(dir: &std::path::Path, names: &[&str]) -> String {
    let cert =
        rcgen::generate_simple_self_signed(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
    std::fs::write(dir.join("key.pem"), cert.key_pair.serialize_pem()).unwrap();
    std::fs::write(dir.join("cert.pem"), cert.cert.pem()).unwrap();
    cert.cert.pem()
}

/// One HTTPS request to `node` by the name `host` (curl, `--resolve` to its
/// address; `ca`: the certificate to trust, else any): status and body.
fn https(
    node: &TestNode,
    host: &str,
    ca: Option<&std::path::Path>,
    method: &str,
    path: &str,
    key: &str,
    body: Option<&str>,
) -> (u16, String) {
    let port = node.addr.rsplit_once(':').unwrap().1;
    let mut cmd = std::process::Command::new("curl");
    cmd.args(["-sS", "--http1.1", "-m", "20", "-X", method, "--resolve"])
        .arg(format!("{host}:{port}:127.0.0.1"))
        .args(["-w", "\n%{http_code}"]);
    if !key.is_empty() {
        cmd.args(["-H", &format!("authorization: Bearer {key}")]);
    }
    match ca {
        Some(ca) => cmd.arg("--cacert").arg(ca),
        None => cmd.arg("-k"),
    };
    if let Some(b) = body {
        cmd.args(["-H", "content-type: application/json", "--data-binary", b]);
    }
    let out = cmd
        .arg(format!("https://{host}:{port}{path}"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = stdout.rsplit_once('\n').unwrap_or(("", &stdout));
    (status.trim().parse().unwrap_or(0), body.to_string())
}

/// A TLS node without an advertise name: mallory's deployment claiming a
/// DNS name on the node's certificate (exact, or under its wildcard name
/// `*.wild.example.test`) is refused with 400 `HOST_RESERVED` and nothing
/// stored; bank's and the operator's calls by those names are the node's;
/// after the certificate files are replaced, the new certificate's name is
/// refused as soon as it is served; mallory's upstream is never connected.
#[test]
fn a_tls_nodes_certificate_names_are_its_own() {
    let dir = tempfile::tempdir().unwrap();
    write_cert(dir.path(), &["tls.example.test", "*.wild.example.test"]);
    let node = TestNode::start_tls(
        dir.path(),
        &format!(
            "reload_check_seconds = 1\n[server]\nbase_domain = \"{BASE}\"\n[deploy]\n{ALLOW_LOOPBACK}"
        ),
    );
    wait_until(
        std::time::Duration::from_secs(30),
        "the TLS node answers",
        || {
            https(
                &node,
                "tls.example.test",
                None,
                "GET",
                "/v1/health",
                "",
                None,
            )
            .0 == 200
        },
    );
    let op = node.operator_key.clone();
    let create = |name: &str| {
        let (s, b) = https(
            &node,
            "tls.example.test",
            None,
            "POST",
            "/v1/namespaces",
            &op,
            Some(&format!(r#"{{"name":"{name}"}}"#)),
        );
        assert_eq!(s, 201, "{b}");
        json(&b)["api_key"].as_str().unwrap().to_string()
    };
    let bank = create("bank");
    let mallory = create("mallory");
    let (s, b) = https(
        &node,
        "tls.example.test",
        None,
        "PUT",
        "/v1/kv/balance",
        &bank,
        Some("100"),
    );
    assert_eq!(s, 200, "{b}");
    let canary = Canary::start();
    let upstream = format!("http://127.0.0.1:{}", canary.port);
    let refused = |host: &str| {
        let body = upstream_body(host, &[&upstream]).to_string();
        let (s, b) = https(
            &node,
            "tls.example.test",
            None,
            "POST",
            "/v1/deployments",
            &mallory,
            Some(&body),
        );
        let v = json(&b);
        let (code, msg) = error_of(&v);
        assert_eq!((s, code), (400, "HOST_RESERVED"), "{host}: {b}");
        assert!(msg.contains("TLS certificate"), "{host}: {msg}");
    };
    for host in [
        "tls.example.test",
        "TLS.Example.Test.",
        "a.wild.example.test",
        "b.c.wild.example.test",
    ] {
        refused(host);
    }
    let (s, b) = https(
        &node,
        "tls.example.test",
        None,
        "GET",
        "/v1/deployments",
        &mallory,
        None,
    );
    assert_eq!(
        (s, json(&b)["deployments"].clone()),
        (200, serde_json::json!([])),
        "{b}"
    );
    for host in ["tls.example.test", "a.wild.example.test"] {
        let (s, b) = https(&node, host, None, "GET", "/v1/kv/balance", &bank, None);
        assert_eq!((s, b.as_str()), (200, "100"), "bank's call by {host}");
        let (s, b) = https(&node, host, None, "GET", "/__admin/api/snapshot", &op, None);
        assert_eq!(s, 200, "the operator's dashboard by {host}: {b}");
        assert!(json(&b).is_object(), "{b}");
    }

    // New files, 2 s newer (whatever the file system's time granularity):
    // once a client trusting only the new certificate connects, its name
    // is the node's.
    let mtime = |f: &str| {
        std::fs::metadata(dir.path().join(f))
            .and_then(|m| m.modified())
            .unwrap()
    };
    let newer = mtime("cert.pem").max(mtime("key.pem")) + std::time::Duration::from_secs(2);
    let pem = write_cert(dir.path(), &["second.example.test"]);
    let ca = dir.path().join("second-ca.pem");
    std::fs::write(&ca, pem).unwrap();
    for f in ["key.pem", "cert.pem"] {
        std::fs::File::options()
            .write(true)
            .open(dir.path().join(f))
            .and_then(|file| file.set_modified(newer))
            .unwrap();
    }
    wait_until(
        std::time::Duration::from_secs(30),
        "the new certificate is served",
        || {
            https(
                &node,
                "second.example.test",
                Some(&ca),
                "GET",
                "/v1/health",
                "",
                None,
            )
            .0 == 200
        },
    );
    refused("second.example.test");
    refused("tls.example.test");
    assert_eq!(canary.connections(), 0, "mallory's upstream was connected");
}
