//! The reverse proxy: requests per second (and latency) of one upstream reached
//! directly, through meshgate's proxy (a deployment on a Host, through the whole
//! chain), and through nginx (`proxy_pass` with upstream keep-alive), in one run
//! with the same load generator, as ratios.
//!
//! Every part is its own process: the upstream (this binary started again with
//! `PROXY_BENCH_UPSTREAM=1`), the meshgate node (the release binary, `serve`),
//! nginx, and the load generator (this process, one thread). The node and
//! nginx both run one worker per core and log warnings only (nginx:
//! `access_log off`, `error_log warn`; the node: `RUST_LOG=warn`).
//!
//! `cargo bench --bench proxy` prints a table. Under `cargo test` (no `--bench`
//! argument) it runs a short smoke round. `--hold` starts the three servers,
//! prints their addresses and keeps them up until Enter (for an external load
//! generator such as wrk, or a profiler). nginx comes from Debian's package
//! (`scripts/test.sh` installs it); without it this fails naming the install.
//! With `--bench` it then measures the same two proxies through `wrk` (the
//! generator the issue's numbers came from; `apt-get install -y wrk`).

#[path = "support/load.rs"]
mod load;
#[path = "support/procs.rs"]
mod procs;
#[path = "support/wrk.rs"]
mod wrk;

use procs::{http, spawn_announcing};
use std::process::{Child, Command};
use std::time::Duration;

/// Set in the environment of the upstream process.
const UPSTREAM_ENV: &str = "PROXY_BENCH_UPSTREAM";
const OPERATOR_KEY: &str = "mgop_proxybench_0123456789abcdef0123456789abcdef";

const CONNECTIONS: usize = 32;
const BODY: &[u8] = b"{\"hello\":\"world\",\"padding\":\"0123456789abcdef0123456789abcdef\"}";

fn nginx_binary() -> String {
    for p in ["/usr/sbin/nginx", "/usr/bin/nginx"] {
        if std::path::Path::new(p).exists() {
            return p.to_string();
        }
    }
    panic!("nginx not found: run scripts/test.sh (it installs nginx) or apt-get install -y nginx");
}

/// Starts nginx proxying 127.0.0.1:<port> to the upstream; killed on drop.
struct Nginx(Child, u16);

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM: the master stops its workers (SIGKILL would orphan them).
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.0.id().to_string())
            .status();
        let _ = self.0.wait();
    }
}

fn start_nginx(dir: &std::path::Path, upstream: std::net::SocketAddr) -> Nginx {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let d = dir.display();
    let conf = format!(
        "worker_processes {workers};\n\
         daemon off;\n\
         error_log {d}/error.log warn;\n\
         pid {d}/nginx.pid;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n\
           access_log off;\n\
           client_body_temp_path {d}/body;\n\
           proxy_temp_path {d}/proxy;\n\
           fastcgi_temp_path {d}/fastcgi;\n\
           uwsgi_temp_path {d}/uwsgi;\n\
           scgi_temp_path {d}/scgi;\n\
           upstream up {{ server {upstream}; keepalive 128; }}\n\
           server {{\n\
             listen 127.0.0.1:{port};\n\
             location / {{\n\
               proxy_pass http://up;\n\
               proxy_http_version 1.1;\n\
               proxy_set_header Connection \"\";\n\
               proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;\n\
               proxy_set_header X-Forwarded-Proto $scheme;\n\
               proxy_set_header X-Forwarded-Host $host;\n\
             }}\n\
           }}\n\
         }}\n",
        workers = meshgate::node::num_cpus(),
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).unwrap();
    // Owned by the guard at once, so a failed start still stops it.
    let nginx = Nginx(
        Command::new(nginx_binary())
            .arg("-c")
            .arg(&path)
            .arg("-p")
            .arg(dir)
            .spawn()
            .expect("start nginx"),
        port,
    );
    // Wait until it listens.
    for _ in 0..200 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return nginx;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("nginx did not start; see {d}/error.log");
}

fn main() {
    if std::env::var_os(UPSTREAM_ENV).is_some() {
        return procs::run_upstream(BODY);
    }
    let full = std::env::args().any(|a| a == "--bench");
    let hold = std::env::args().any(|a| a == "--hold");
    let secs = if full { 5.0 } else { 0.3 };
    let nginx_bin = nginx_binary();
    let dir = tempfile::tempdir().unwrap();

    let mut up_cmd = Command::new(std::env::current_exe().unwrap());
    up_cmd.env(UPSTREAM_ENV, "1");
    let (_upstream_proc, upstream) =
        spawn_announcing(up_cmd, "upstream listening on ", "the upstream");
    let upstream: std::net::SocketAddr = upstream.parse().unwrap();
    let nginx_dir = dir.path().join("nginx");
    std::fs::create_dir_all(&nginx_dir).unwrap();
    let nginx = start_nginx(&nginx_dir, upstream);
    let (node_proc, addr) = procs::start_node(dir.path(), OPERATOR_KEY, "");

    let (s, b) = http(
        &addr,
        "POST",
        "/v1/namespaces",
        Some(OPERATOR_KEY),
        Some(r#"{"name":"bench"}"#),
    );
    assert_eq!(s, 201, "create namespace: {b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    let key = v["api_key"].as_str().unwrap().to_string();
    let dep = serde_json::json!({
        "name": "app", "hosts": ["app.bench.test"],
        "upstream": {"instances": [format!("http://{upstream}")]}
    });
    let (s, b) = http(
        &addr,
        "POST",
        "/v1/deployments",
        Some(&key),
        Some(&dep.to_string()),
    );
    assert_eq!(s, 201, "create deployment: {b}");

    if hold {
        println!("upstream  http://{upstream}/hello");
        println!(
            "meshgate  http://{addr}/hello  (Host: app.bench.test; node pid {})",
            node_proc.0.id()
        );
        println!(
            "nginx     http://127.0.0.1:{}/hello  (master pid {})",
            nginx.1,
            nginx.0.id()
        );
        println!("press Enter to stop");
        let _ = std::io::stdin().read_line(&mut String::new());
        return;
    }

    let nginx_port = nginx.1;
    let (mesh_url, nginx_url) = (
        format!("http://{addr}/hello"),
        format!("http://127.0.0.1:{nginx_port}/hello"),
    );
    let sys = actix_web::rt::System::new();
    sys.block_on(async move {
        let req = |url: String| {
            let mut r = load::Request::get(url).header("host", "app.bench.test");
            r.expect_body = Some(BODY.to_vec());
            r
        };
        let direct = req(format!("http://{upstream}/hello"));
        let mesh = req(format!("http://{addr}/hello"));
        let ngx = req(format!("http://127.0.0.1:{nginx_port}/hello"));
        // Warm all three, then measure in an interleaved order.
        for r in [&direct, &mesh, &ngx] {
            load::run(r.clone(), CONNECTIONS, secs / 3.0).await;
        }
        let d1 = load::run(direct.clone(), CONNECTIONS, secs).await;
        let m1 = load::run(mesh.clone(), CONNECTIONS, secs).await;
        let n1 = load::run(ngx.clone(), CONNECTIONS, secs).await;
        let n2 = load::run(ngx, CONNECTIONS, secs).await;
        let m2 = load::run(mesh, CONNECTIONS, secs).await;
        let d2 = load::run(direct, CONNECTIONS, secs).await;
        let avg = |a: &load::Outcome, b: &load::Outcome| (a.rps + b.rps) / 2.0;
        let (d, m, n) = (avg(&d1, &d2), avg(&m1, &m2), avg(&n1, &n2));
        let ms = |x: Duration| x.as_secs_f64() * 1000.0;
        // A smoke run under `cargo test` keeps quiet unless it fails.
        if full {
            println!("nginx: {nginx_bin}; {CONNECTIONS} keep-alive connections, {secs} s per run, two runs each; every part its own process");
            println!("| path | req/s | p50 ms | p99 ms |");
            println!("|---|---|---|---|");
            println!("| upstream direct | {d:.0} | {:.2} | {:.2} |", ms(d1.p50), ms(d1.p99));
            println!("| through meshgate (whole chain + proxy) | {m:.0} | {:.2} | {:.2} |", ms(m1.p50), ms(m1.p99));
            println!("| through nginx (proxy_pass, keepalive) | {n:.0} | {:.2} | {:.2} |", ms(n1.p50), ms(n1.p99));
            println!("| ratio meshgate / direct | **{:.2}** | | |", m / d);
            println!("| ratio nginx / direct | **{:.2}** | | |", n / d);
            println!("| ratio meshgate / nginx | **{:.2}** | | |", m / n);
        }
    });
    if full {
        // wrk spends less CPU per request than the generator above, so the
        // proxies' own costs weigh more in its ratio.
        let host = ["Host: app.bench.test"];
        wrk::ratio_table(
            "meshgate",
            &wrk::Wrk::get(&mesh_url, &host),
            "nginx",
            &wrk::Wrk::get(&nginx_url, &host),
            3,
        );
    }
    drop(node_proc);
    drop(nginx);
}
