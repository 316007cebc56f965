//! The reverse proxy: requests per second (and latency) of one upstream reached
//! directly, through meshgate's proxy (a deployment on a Host, through the whole
//! chain), and through nginx (`proxy_pass` with upstream keep-alive), in one run
//! with the same load generator, as ratios.
//!
//! `cargo bench --bench proxy` prints a table. Under `cargo test` (no `--bench`
//! argument) it runs a short smoke round. nginx comes from Debian's package
//! (`scripts/test.sh` installs it); without it this fails naming the install.

#[path = "support/node.rs"]
mod node_support;

#[path = "support/load.rs"]
mod load;

use actix_web::{App, HttpResponse, HttpServer, web};
use std::process::{Child, Command};
use std::time::Duration;

const CONNECTIONS: usize = 32;
const BODY: &[u8] = b"{\"hello\":\"world\",\"padding\":\"0123456789abcdef0123456789abcdef\"}";

async fn hello() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(BODY)
}

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
    let full = std::env::args().any(|a| a == "--bench");
    let secs = if full { 5.0 } else { 0.3 };
    let nginx_bin = nginx_binary();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = node_support::config(dir.path());
    // The upstream listens on loopback, which the egress policy forbids by default.
    cfg.deploy.upstream_allow = vec!["127.0.0.0/8".into()];

    // The upstream runs on its own thread and runtime, as a separate server would.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let srv = HttpServer::new(|| App::new().default_service(web::to(hello)))
                .workers(meshgate::node::num_cpus())
                .backlog(4096)
                .bind("127.0.0.1:0")
                .unwrap();
            tx.send(srv.addrs()[0]).unwrap();
            srv.run().await.unwrap();
        });
    });
    let upstream = rx.recv().unwrap();
    let nginx_dir = dir.path().join("nginx");
    std::fs::create_dir_all(&nginx_dir).unwrap();
    let nginx = start_nginx(&nginx_dir, upstream);

    let sys = actix_web::rt::System::new();
    sys.block_on(async move {
        let started = node_support::start(cfg).await;
        let (addr, key) = (started.addr, started.key);
        let client = awc::Client::default();
        let r = client
            .post(format!("http://{addr}/v1/deployments"))
            .insert_header(("authorization", format!("Bearer {key}")))
            .send_json(&serde_json::json!({
                "name": "app", "hosts": ["app.bench.test"],
                "upstream": {"instances": [format!("http://{upstream}")]}
            }))
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 201);

        let req = |url: String| {
            let mut r = load::Request::get(url).header("host", "app.bench.test");
            r.expect_body = Some(BODY.to_vec());
            r
        };
        let direct = req(format!("http://{upstream}/hello"));
        let mesh = req(format!("http://{addr}/hello"));
        let ngx = req(format!("http://127.0.0.1:{}/hello", nginx.1));
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
            println!("nginx: {nginx_bin}; {CONNECTIONS} keep-alive connections, {secs} s per run, two runs each");
            println!("| path | req/s | p50 ms | p99 ms |");
            println!("|---|---|---|---|");
            println!("| upstream direct | {d:.0} | {:.2} | {:.2} |", ms(d1.p50), ms(d1.p99));
            println!("| through meshgate (whole chain + proxy) | {m:.0} | {:.2} | {:.2} |", ms(m1.p50), ms(m1.p99));
            println!("| through nginx (proxy_pass, keepalive) | {n:.0} | {:.2} | {:.2} |", ms(n1.p50), ms(n1.p99));
            println!("| ratio meshgate / direct | **{:.2}** | | |", m / d);
            println!("| ratio nginx / direct | **{:.2}** | | |", n / d);
            println!("| ratio meshgate / nginx | **{:.2}** | | |", m / n);
        }
        drop(nginx);
        std::process::exit(0);
    });
}
