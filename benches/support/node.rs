//! The in-process node the HTTP benches drive: a config with the rate limits
//! lifted, the node started on a free port, and a `bench` namespace.

use meshgate::config::Config;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

/// A config on a free port with data under `dir` and no rate limit in the way.
pub fn config(dir: &Path) -> Config {
    let mut cfg = Config::default();
    cfg.server.listen = "127.0.0.1:0".into();
    cfg.server.data_dir = dir.join("data");
    cfg.rate_limit.general_per_minute = u32::MAX / 2;
    cfg.rate_limit.general_burst = u32::MAX / 2;
    cfg.rate_limit.namespace_per_minute = u32::MAX / 2;
    cfg.rate_limit.namespace_burst = u32::MAX / 2;
    cfg.rate_limit.anonymous_per_minute = u32::MAX / 2;
    cfg.rate_limit.anonymous_burst = u32::MAX / 2;
    cfg
}

/// A running node and the owner key of its `bench` namespace.
pub struct Started {
    pub addr: SocketAddr,
    #[allow(dead_code)] // not every bench reaches into the node
    pub node: meshgate::node::Node,
    pub key: String,
}

/// Starts the node (inside an actix System) and creates the `bench` namespace.
pub async fn start(cfg: Config) -> Started {
    let data_dir = cfg.server.data_dir.clone();
    // An operator key of its own, so the node does not print a generated one.
    std::fs::create_dir_all(&data_dir).unwrap();
    let key_path = data_dir.join("operator.key");
    if !key_path.exists() {
        use std::os::unix::fs::OpenOptionsExt;
        let key = format!(
            "mgop_bench_{}",
            hex::encode(meshgate::node::random_bytes::<16>())
        );
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&key_path)
            .unwrap();
        std::io::Write::write_all(&mut f, key.as_bytes()).unwrap();
    }
    let running = meshgate::node::start(cfg).await.unwrap();
    let node = running.node.clone();
    let addr = running.addr;
    actix_web::rt::spawn(running.run_until_signal());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let op = std::fs::read_to_string(data_dir.join("operator.key")).unwrap();
    let mut r = awc::Client::default()
        .post(format!("http://{addr}/v1/namespaces"))
        .insert_header(("authorization", format!("Bearer {}", op.trim())))
        .send_json(&serde_json::json!({"name": "bench"}))
        .await
        .unwrap();
    let v: serde_json::Value = r.json().await.unwrap();
    Started {
        addr,
        node,
        key: v["api_key"].as_str().unwrap().to_string(),
    }
}
