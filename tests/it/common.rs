//! A real node for tests: the `meshgate` binary started on 127.0.0.1:0 with a
//! temporary data folder, and a small HTTP client.
//!
//! Cluster mode (`MESHGATE_TEST_CLUSTER=1`, needs `--features cluster`):
//! [`TestNode::start`]/[`TestNode::start_with`] start one etcd and three nodes
//! on it ("a", "b", "c", one cluster secret); the test talks to "a", and
//! [`TestNode::create_namespace`] places the namespace on "b" only, so every
//! namespace request of the test is forwarded by a node that is not its
//! member, and what is published crosses the pub/sub mesh. See
//! [`single_node_only`] for the few tests that cannot mean anything there.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct TestNode {
    pub child: Option<Child>,
    pub base: String,
    pub addr: String,
    pub dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    pub operator_key: String,
    pub stderr: std::sync::Arc<std::sync::Mutex<String>>,
    /// Cluster mode: the etcd and the two other nodes this one runs with.
    #[cfg(feature = "cluster")]
    cluster: Option<std::sync::Arc<on_cluster::Cluster>>,
}

/// Options for starting a node.
#[derive(Default, Clone)]
pub struct NodeOpts {
    /// Extra `config.toml` text.
    pub config: String,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
    /// Reuse this data folder instead of a fresh one.
    pub data_dir: Option<PathBuf>,
    /// Listen address (default 127.0.0.1:0).
    pub listen: Option<String>,
    /// Return as soon as the listener is bound, before `/readyz` is 200.
    pub no_wait_ready: bool,
}

/// A free loopback port for a node the test starts (or restarts) on a
/// fixed address. Taken below the kernel's ephemeral range (where `bind` to
/// port 0 and every outgoing connection get theirs): a port probed there and
/// released can be taken by any connection of a test running beside this
/// one before the node binds it ("address already in use"). Below that
/// range only an explicit choice takes a port; within this process a
/// counter keeps choices distinct, and a bind checks that nothing else
/// holds it.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    if low < 12_000 {
        // No room below the range: a probed ephemeral port, as before.
        return std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
    }
    // The ports [low - 10000, low), entered at a point of this process's own.
    let span = 10_000;
    let start = std::process::id() % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (low - span + (start + n) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port below {low}");
}

pub const OPERATOR_KEY: &str = "mgop_test_operator_key_0123456789";
/// The operator key as a header, for `/metrics` and `/v1/status` (which need it).
pub const OPERATOR_AUTH: (&str, &str) =
    ("authorization", "Bearer mgop_test_operator_key_0123456789");

/// Generous limits so tests are not throttled unless they mean to be.
pub const TEST_CONFIG: &str = "[rate_limit]\ngeneral_per_minute = 1000000\ngeneral_burst = 100000\ncredential_per_minute = 100000\ncredential_burst = 10000\nnamespace_per_minute = 1000000\nnamespace_burst = 100000\nanonymous_per_minute = 1000000\nanonymous_burst = 100000\n";

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_meshgate")
}

impl TestNode {
    pub fn start() -> TestNode {
        Self::start_with(NodeOpts {
            config: TEST_CONFIG.into(),
            ..Default::default()
        })
    }

    /// A node serving TLS with the certificate and key `cert.pem` and
    /// `key.pem` in `dir` (and `extra` lines in its `[tls]` section); not
    /// waited for ready, which a plain-HTTP probe could not tell.
    pub fn start_tls(dir: &std::path::Path, extra: &str) -> TestNode {
        Self::start_with(NodeOpts {
            config: format!(
                "{TEST_CONFIG}[tls]\ncert_file = {:?}\nkey_file = {:?}\n{extra}",
                dir.join("cert.pem"),
                dir.join("key.pem")
            ),
            no_wait_ready: true,
            ..Default::default()
        })
    }

    /// Starts the binary and waits for its "listening on" line (and, unless
    /// `no_wait_ready`, for `/readyz`). In cluster mode: the node the test
    /// talks to, with two more nodes and an etcd (see the module's comment);
    /// a node the test itself configures with a `[cluster]` section is
    /// started as configured.
    pub fn start_with(opts: NodeOpts) -> TestNode {
        if cluster_mode() && !opts.config.contains("[cluster]") {
            #[cfg(feature = "cluster")]
            return on_cluster::start(opts);
            #[cfg(not(feature = "cluster"))]
            panic!("MESHGATE_TEST_CLUSTER=1 needs a build with --features cluster");
        }
        Self::spawn(opts)
    }

    /// One `meshgate serve` process, as `opts` says.
    fn spawn(opts: NodeOpts) -> TestNode {
        Self::try_spawn(opts).unwrap_or_else(|log| panic!("node did not start: {log}"))
    }

    /// The same; a node that exits before it listens is an error with its stderr.
    fn try_spawn(opts: NodeOpts) -> Result<TestNode, String> {
        let (tmp, dir) = match &opts.data_dir {
            Some(d) => (None, d.clone()),
            None => {
                let t = tempfile::tempdir().unwrap();
                let d = t.path().join("data");
                (Some(t), d)
            }
        };
        std::fs::create_dir_all(&dir).unwrap();
        // Named after the data folder too: nodes whose data folders share a
        // parent (`cluster::member_opts`) and start at once must not write
        // one file (each read the other's `node_id`).
        let cfg_path = dir.parent().unwrap().join(format!(
            "config-{}-{}.toml",
            std::process::id(),
            dir.file_name().unwrap_or_default().to_string_lossy()
        ));
        std::fs::write(&cfg_path, &opts.config).unwrap();
        let mut cmd = Command::new(bin());
        cmd.arg("serve")
            .arg("--config")
            .arg(&cfg_path)
            .arg("--listen")
            .arg(opts.listen.as_deref().unwrap_or("127.0.0.1:0"))
            .arg("--data-dir")
            .arg(&dir)
            .env("MESHGATE_OPERATOR_KEY", OPERATOR_KEY)
            .env(
                "RUST_LOG",
                std::env::var("TEST_RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn meshgate");
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let log2 = log.clone();
        // Says when the reader has read the whole of stderr (the process is gone).
        let (read_all, stderr_read) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut l = log2.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
            let _ = read_all.send(());
        });
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if !sent && let Some(a) = line.strip_prefix("meshgate listening on ") {
                    let _ = tx.send(a.to_string());
                    sent = true;
                }
            }
        });
        let (scheme, addr) = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => {
                let (s, a) = a.split_once("://").expect("scheme://addr");
                (s.to_string(), a.to_string())
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                // Until the stderr reader has read the pipe to its end.
                let _ = stderr_read.recv_timeout(Duration::from_secs(10));
                return Err(log.lock().unwrap().clone());
            }
        };
        let node = TestNode {
            child: Some(child),
            base: format!("{scheme}://{addr}"),
            addr,
            dir,
            _tmp: tmp,
            operator_key: OPERATOR_KEY.into(),
            stderr: log,
            #[cfg(feature = "cluster")]
            cluster: None,
        };
        if !opts.no_wait_ready {
            node.wait_ready();
        }
        Ok(node)
    }

    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if http("GET", &format!("{}/readyz", self.base), &[], None).0 == 200 {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("node never became ready: {}", self.stderr.lock().unwrap());
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Sends a signal to the node.
    pub fn signal(&self, sig: i32) {
        let pid = self.child.as_ref().unwrap().id() as i32;
        unsafe_kill(pid, sig);
    }

    /// Waits for the process to exit and returns its exit code.
    pub fn wait_exit(&mut self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        let child = self.child.as_mut().unwrap();
        while Instant::now() < deadline {
            if let Some(s) = child.try_wait().unwrap() {
                return s.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Kills the node with SIGKILL and reaps it. In cluster mode the whole
    /// cluster crashes (every node; etcd keeps running): a later
    /// `start_with` on the same `data_dir` starts them again.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        #[cfg(feature = "cluster")]
        if let Some(c) = &self.cluster {
            c.kill_members();
        }
    }

    /// Kills the node (SIGKILL) and starts one again on its data folder
    /// with `opts`; the new node keeps the folder (dropping this one would
    /// remove its temporary folder under the new node, whose lazily opened
    /// files, such as sled's blobs of large values, would then be gone).
    pub fn crash_and_restart_with(mut self, opts: NodeOpts) -> TestNode {
        let tmp = self._tmp.take();
        let dir = self.dir.clone();
        self.kill9();
        let mut node = TestNode::start_with(NodeOpts {
            data_dir: Some(dir),
            ..opts
        });
        node._tmp = tmp;
        node
    }

    /// Creates a namespace from the operator's request `body` as written
    /// (placed as the node places it); returns its owner API key.
    pub fn create_namespace_from(&self, body: &str) -> String {
        let (s, b) = self.op("POST", "/v1/namespaces", Some(body));
        assert_eq!(s, 201, "create namespace: {b}");
        json(&b)["api_key"].as_str().unwrap().to_string()
    }

    /// Creates a namespace; returns its owner API key. In cluster mode its
    /// only member is another node than the one the test talks to.
    pub fn create_namespace(&self, name: &str) -> String {
        let body = match self.member_of_namespaces() {
            Some(m) => format!("{{\"name\":\"{name}\",\"members\":[\"{m}\"]}}"),
            None => format!("{{\"name\":\"{name}\"}}"),
        };
        let (s, b) = self.op("POST", "/v1/namespaces", Some(&body));
        assert_eq!(s, 201, "create namespace: {b}");
        let key = json(&b)["api_key"].as_str().unwrap().to_string();
        if let Some(m) = self.member_of_namespaces() {
            // The cluster mode's premise: this node forwards to the member.
            let auth = format!("Bearer {key}");
            let (s, h, b) = http(
                "GET",
                &self.url("/v1/kv/_cluster_mode_probe"),
                &[("authorization", &auth)],
                None,
            );
            assert_eq!(
                (s, header(&h, "x-meshgate-member")),
                (404, Some(m)),
                "a KV read of {name} through {} is not served by member {m}: {}",
                self.base,
                String::from_utf8_lossy(&b)
            );
        }
        key
    }

    /// Cluster mode: the node id `create_namespace` places namespaces on.
    pub fn member_of_namespaces(&self) -> Option<&'static str> {
        #[cfg(feature = "cluster")]
        if self.cluster.is_some() {
            return Some(on_cluster::MEMBER);
        }
        None
    }

    /// The base URL of the node that runs the namespaces `create_namespace`
    /// makes: this one, or in cluster mode their member (for what acts on
    /// one node's own actors, e.g. the operator's fault injection, which
    /// is not forwarded).
    pub fn member_base(&self) -> String {
        #[cfg(feature = "cluster")]
        if let Some(c) = &self.cluster {
            return c.base_of(on_cluster::MEMBER);
        }
        self.base.clone()
    }

    /// The base URL of every node: this one first, then (cluster mode) the others.
    pub fn every_base(&self) -> Vec<String> {
        #[allow(unused_mut)]
        let mut v = vec![self.base.clone()];
        #[cfg(feature = "cluster")]
        if let Some(c) = &self.cluster {
            v.extend(c.bases());
        }
        v
    }

    /// The sum over every node (cluster mode: the whole cluster) of the
    /// `/metrics` series named `series` (a name, or a name with its labels
    /// as `/metrics` writes them); 0 if no node has it.
    pub fn metric_sum(&self, series: &str) -> f64 {
        self.every_base()
            .iter()
            .map(|base| {
                let (_, _, b) = http("GET", &format!("{base}/metrics"), &[OPERATOR_AUTH], None);
                String::from_utf8_lossy(&b)
                    .lines()
                    .filter(|l| {
                        l.strip_prefix(series)
                            .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
                    })
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum::<f64>()
            })
            .sum()
    }

    /// A call with the operator key.
    pub fn op(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        let auth = format!("Bearer {}", self.operator_key);
        let (s, _, b) = http(
            method,
            &self.url(path),
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            body.map(str::as_bytes),
        );
        (s, String::from_utf8_lossy(&b).into_owned())
    }

    /// A call with a credential.
    pub fn with_key(
        &self,
        key: &str,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> (u16, String) {
        let auth = format!("Bearer {key}");
        let (s, _, b) = http(
            method,
            &self.url(path),
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            body,
        );
        (s, String::from_utf8_lossy(&b).into_owned())
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        // Only this process: in cluster mode the other nodes belong to the
        // cluster, which a restarted `TestNode` may share; they stop when
        // the last `TestNode` of the cluster is gone.
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Polls `cond` (every 20 ms) until it holds; panics naming `what` when it
/// still does not after `within`. The way a test waits for something the
/// node does in the background, instead of sleeping a fixed time.
pub fn wait_until(within: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether the suite runs in cluster mode (`MESHGATE_TEST_CLUSTER=1`).
pub fn cluster_mode() -> bool {
    std::env::var("MESHGATE_TEST_CLUSTER").is_ok_and(|v| v == "1")
}

/// The explicit scoping of a test that means one node (a single process's
/// drain or data folder, sled, node-level limits): in cluster mode it says
/// why on stderr and returns true (the test returns); in single mode false.
/// `if single_node_only() { return; }`. The reason is the test's entry in
/// [`crate::single_node::SINGLE_NODE_ONLY`], found by the test's name (the
/// name of the thread libtest runs it on): an unlisted caller panics in
/// either mode.
pub fn single_node_only() -> bool {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("");
    let reason = crate::single_node::reason(test).unwrap_or_else(|| {
        panic!("single_node_only() called by {test:?}, which tests/it/single_node.rs does not list")
    });
    if cluster_mode() {
        eprintln!("single-node only, not run on the cluster: {reason}");
        return true;
    }
    false
}

/// Cluster mode of [`TestNode`].
#[cfg(feature = "cluster")]
mod on_cluster {
    use super::*;
    use crate::etcd_process::EtcdProcess;
    use std::path::Path;
    use std::sync::{Arc, Mutex, Weak};

    /// The node the test talks to, and the one namespaces are placed on.
    const CLIENT: &str = "a";
    pub const MEMBER: &str = "b";
    const SECRET: &str = "test-suite-cluster-secret";

    /// The other two nodes and their etcd.
    pub struct Cluster {
        peers: Mutex<Vec<Peer>>,
        /// Dropped after the peers (fields drop in order).
        etcd: EtcdProcess,
        _tmp: tempfile::TempDir,
    }

    struct Peer {
        id: &'static str,
        /// The port it listened on (taken again by a restart).
        port: Option<u16>,
        dir: PathBuf,
        node: Option<TestNode>,
    }

    /// Each cluster by the data folder of its node "a", so a `start_with` on
    /// that folder (a restart) joins the same etcd and nodes while a
    /// `TestNode` of the cluster is alive.
    static BY_DIR: Mutex<Vec<(PathBuf, Weak<Cluster>)>> = Mutex::new(Vec::new());

    impl Cluster {
        fn new() -> Cluster {
            let tmp = tempfile::tempdir().unwrap();
            let peers = ["b", "c"]
                .into_iter()
                .map(|id| Peer {
                    id,
                    port: None,
                    dir: tmp.path().join(id).join("data"),
                    node: None,
                })
                .collect();
            Cluster {
                peers: Mutex::new(peers),
                etcd: EtcdProcess::start(),
                _tmp: tmp,
            }
        }

        /// A node's config: the test's, and its `[cluster]` section.
        fn config(&self, test_config: &str, id: &str) -> String {
            format!(
                "{test_config}\n[cluster]\n{}node_id = \"{id}\"\nregister_seconds = 1\n",
                self.etcd.cluster_toml()
            )
        }

        /// Starts the peers that are not running (all at once).
        fn start_peers(&self, opts: &NodeOpts) {
            // The other nodes serve plain HTTP: a `[tls]` section is the
            // test's listener only.
            let mut cfg: toml::Table = opts.config.parse().expect("the test's config is TOML");
            cfg.remove("tls");
            let cfg = cfg.to_string();
            let mut peers = self.peers.lock().unwrap();
            std::thread::scope(|s| {
                for p in peers.iter_mut() {
                    let running = p.node.as_mut().is_some_and(|n| {
                        n.child
                            .as_mut()
                            .is_some_and(|c| c.try_wait().unwrap().is_none())
                    });
                    if running {
                        continue;
                    }
                    let mut popts = NodeOpts {
                        config: self.config(&cfg, p.id),
                        env: env(opts),
                        data_dir: Some(p.dir.clone()),
                        listen: Some(format!("127.0.0.1:{}", p.port.unwrap_or(0))),
                        no_wait_ready: false,
                    };
                    s.spawn(move || {
                        // A restart takes the port it had; if something else
                        // took it meanwhile, another one (the node registers
                        // its new address).
                        let node = match TestNode::try_spawn(popts.clone()) {
                            Ok(n) => n,
                            Err(log) if p.port.is_some() => {
                                eprintln!(
                                    "node {} not restarted on its port ({log}); on another",
                                    p.id
                                );
                                popts.listen = Some("127.0.0.1:0".into());
                                TestNode::spawn(popts)
                            }
                            Err(log) => panic!("node {} did not start: {log}", p.id),
                        };
                        p.port = node.addr.rsplit(':').next().and_then(|x| x.parse().ok());
                        p.node = Some(node);
                    });
                }
            });
        }

        pub fn kill_members(&self) {
            for p in self.peers.lock().unwrap().iter_mut() {
                if let Some(mut n) = p.node.take() {
                    n.kill9();
                }
            }
        }

        pub fn base_of(&self, id: &str) -> String {
            self.peers
                .lock()
                .unwrap()
                .iter()
                .find(|p| p.id == id)
                .and_then(|p| Some(p.node.as_ref()?.base.clone()))
                .unwrap_or_else(|| panic!("node {id} is not running"))
        }

        pub fn bases(&self) -> Vec<String> {
            self.peers
                .lock()
                .unwrap()
                .iter()
                .filter_map(|p| Some(p.node.as_ref()?.base.clone()))
                .collect()
        }

        fn stderr(&self) -> String {
            let mut out = String::new();
            for p in self.peers.lock().unwrap().iter() {
                if let Some(n) = &p.node {
                    out.push_str(&format!(
                        "--- node {} ---\n{}",
                        p.id,
                        n.stderr.lock().unwrap()
                    ));
                }
            }
            out
        }
    }

    /// The test's environment, with the cluster secret unless the test sets its own.
    fn env(opts: &NodeOpts) -> Vec<(String, String)> {
        let mut env = opts.env.clone();
        if !env.iter().any(|(k, _)| k == "MESHGATE_CLUSTER_SECRET") {
            env.push(("MESHGATE_CLUSTER_SECRET".into(), SECRET.into()));
        }
        env
    }

    /// The running cluster whose node "a" had the data folder `dir`, or a new one.
    /// The lock is not held while a new cluster starts, and a test that
    /// panicked holding it does not fail every later one.
    fn cluster_for(dir: Option<&Path>) -> Arc<Cluster> {
        let running = {
            let mut by_dir = by_dir();
            by_dir.retain(|(_, w)| w.strong_count() > 0);
            dir.and_then(|d| {
                by_dir
                    .iter()
                    .find(|(p, _)| p == d)
                    .and_then(|(_, w)| w.upgrade())
            })
        };
        running.unwrap_or_else(|| Arc::new(Cluster::new()))
    }

    fn by_dir() -> std::sync::MutexGuard<'static, Vec<(PathBuf, Weak<Cluster>)>> {
        BY_DIR.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The node the test talks to ("a", member of no namespace it creates),
    /// with "b" and "c" running on the same etcd, the mesh connected.
    pub fn start(opts: NodeOpts) -> TestNode {
        let cluster = cluster_for(opts.data_dir.as_deref());
        cluster.start_peers(&opts);
        let mut node = TestNode::spawn(NodeOpts {
            config: cluster.config(&opts.config, CLIENT),
            env: env(&opts),
            ..opts.clone()
        });
        {
            let mut by_dir = by_dir();
            if !by_dir.iter().any(|(p, _)| *p == node.dir) {
                by_dir.push((node.dir.clone(), Arc::downgrade(&cluster)));
            }
        }
        node.cluster = Some(cluster);
        if !opts.no_wait_ready {
            wait_mesh(&node);
        }
        node
    }

    /// Until every node has both others as mesh peers (what is published
    /// through one node reaches the subscribers of the others).
    fn wait_mesh(node: &TestNode) {
        let c = node.cluster.as_ref().unwrap();
        let mut bases = c.bases();
        if node.base.starts_with("http://") {
            bases.push(node.base.clone());
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let peers = |base: &String| {
            let (_, _, b) = http("GET", &format!("{base}/metrics"), &[OPERATOR_AUTH], None);
            String::from_utf8_lossy(&b)
                .lines()
                .find_map(|l| l.strip_prefix("meshgate_mesh_peers ")?.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        while !bases.iter().all(|b| peers(b) >= 2.0) {
            assert!(
                Instant::now() < deadline,
                "the mesh never connected: {:?}\n--- node a ---\n{}{}",
                bases.iter().map(|b| (b, peers(b))).collect::<Vec<_>>(),
                node.stderr.lock().unwrap(),
                c.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn unsafe_kill(pid: i32, sig: i32) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success());
}

pub fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

/// A minimal blocking HTTP/1.1 client (one request per connection), so tests
/// need no async runtime. Returns status, headers (lower-case names) and body.
pub fn http(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    http_from(None, method, url, headers, body)
}

/// The same, from a chosen local address (e.g. 127.0.0.2 to be "another client").
pub fn http_from(
    local: Option<&str>,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("http url");
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let addr: std::net::SocketAddr = hostport.parse().expect("ip:port");
    let stream = match local {
        Some(l) => socket2_connect(l, addr),
        None => {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(10)).expect("connect")
        }
    };
    let mut stream = stream;
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let body = body.unwrap_or(&[]);
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("host: {hostport}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes()).unwrap();
    stream.write_all(body).unwrap();
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    parse_response(&raw)
}

fn socket2_connect(local: &str, addr: std::net::SocketAddr) -> std::net::TcpStream {
    tokio_free::bind_connect(local.parse().expect("local ip"), addr)
}

mod tokio_free {
    /// Connect from a chosen local IP using a blocking tokio-free path: tokio's
    /// TcpSocket supports bind-before-connect, run on a throwaway runtime.
    pub fn bind_connect(
        local: std::net::IpAddr,
        addr: std::net::SocketAddr,
    ) -> std::net::TcpStream {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let sock = tokio::net::TcpSocket::new_v4().unwrap();
            sock.bind(std::net::SocketAddr::new(local, 0)).unwrap();
            let s = sock.connect(addr).await.unwrap();
            let std = s.into_std().unwrap();
            std.set_nonblocking(false).unwrap();
            std
        })
    }
}

fn parse_response(raw: &[u8]) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end: {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| {
            l.split_once(':')
                .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        })
        .collect();
    let mut body = raw[end + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
    {
        body = dechunk(&body);
    }
    (status, headers, body)
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = b.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..i]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        out.extend_from_slice(&b[i + 2..i + 2 + size]);
        b = &b[i + 2 + size + 2..];
    }
    out
}

pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}
