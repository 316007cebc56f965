//! The load generator the HTTP benches share: keep-alive connections, each
//! sending one request after another for a fixed time, checking every answer.

use std::sync::Arc;
use std::time::{Duration, Instant};

/// One kind of request to repeat.
#[derive(Clone)]
pub struct Request {
    pub method: &'static str,
    pub url: String,
    pub headers: Vec<(String, String)>,
    pub body: Option<Vec<u8>>,
    /// When set, every answer's body must equal it.
    pub expect_body: Option<Vec<u8>>,
}

impl Request {
    pub fn get(url: impl Into<String>) -> Request {
        Request {
            method: "GET",
            url: url.into(),
            headers: Vec::new(),
            body: None,
            expect_body: None,
        }
    }
    pub fn header(mut self, k: &str, v: impl Into<String>) -> Request {
        self.headers.push((k.to_string(), v.into()));
        self
    }
}

/// What a run measured.
pub struct Outcome {
    pub rps: f64,
    pub p50: Duration,
    pub p99: Duration,
}

/// Drives `req` from `connections` keep-alive clients for `secs`.
pub async fn run(req: Request, connections: usize, secs: f64) -> Outcome {
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let req = Arc::new(req);
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let req = req.clone();
        tasks.push(actix_web::rt::spawn(async move {
            let client = awc::Client::builder()
                .connector(awc::Connector::new().limit(1))
                .timeout(Duration::from_secs(30))
                .finish();
            let mut lat = Vec::new();
            while Instant::now() < end {
                let t = Instant::now();
                let mut r = client.request(req.method.parse().unwrap(), &req.url);
                for (k, v) in &req.headers {
                    r = r.insert_header((k.as_str(), v.as_str()));
                }
                let mut resp = match &req.body {
                    Some(b) => r.send_body(b.clone()).await,
                    None => r.send().await,
                }
                .expect("request");
                assert!(
                    resp.status().is_success(),
                    "{} from {}",
                    resp.status(),
                    req.url
                );
                let b = resp.body().limit(64 << 20).await.unwrap();
                if let Some(want) = &req.expect_body {
                    assert_eq!(&b[..], &want[..], "answer of {}", req.url);
                }
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort();
    let pct = |p: f64| {
        all.get(((all.len() as f64 * p) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    Outcome {
        rps: all.len() as f64 / secs,
        p50: pct(0.50),
        p99: pct(0.99),
    }
}
