//! `wrk` as the second load generator of the HTTP benches: the one issue #16's
//! numbers came from (1 thread, 32 keep-alive connections, 4 s runs, the two
//! paths alternated A B B A). wrk spends less CPU per request than the
//! benches' own generators, so the node's own costs weigh more in its ratios.
//! Debian's package: `apt-get install -y wrk`.

use std::process::Command;

/// One request for wrk: a URL, its headers and, for a POST, a body (sent
/// through a Lua script that wrk reads).
pub struct Wrk {
    url: String,
    headers: Vec<String>,
    /// Keeps the script file alive as long as the request.
    script: Option<tempfile::NamedTempFile>,
}

impl Wrk {
    /// A GET of `url` with `headers` (`name: value`).
    pub fn get(url: &str, headers: &[&str]) -> Wrk {
        Wrk {
            url: url.to_string(),
            headers: headers.iter().map(|h| h.to_string()).collect(),
            script: None,
        }
    }

    /// A POST of `body` to `url` with `headers`.
    #[allow(dead_code)] // not every bench posts
    pub fn post(url: &str, headers: &[&str], body: &[u8]) -> Wrk {
        use std::io::Write;
        // Every byte as a decimal escape: any body is a valid Lua string.
        let lua_body: String = body.iter().map(|b| format!("\\{b}")).collect();
        let mut script = tempfile::NamedTempFile::new().unwrap();
        write!(script, "wrk.method = \"POST\"\nwrk.body = \"{lua_body}\"\n").unwrap();
        Wrk {
            script: Some(script),
            ..Wrk::get(url, headers)
        }
    }

    /// One `wrk -t1 -c32 -d4s` run; its requests per second. Every answer
    /// must be a 2xx without a socket error.
    pub fn rps(&self) -> f64 {
        let mut cmd = Command::new("wrk");
        cmd.args(["-t1", "-c32", "-d4s"]);
        for h in &self.headers {
            cmd.arg("-H").arg(h);
        }
        if let Some(s) = &self.script {
            cmd.arg("-s").arg(s.path());
        }
        let out = cmd
            .arg(&self.url)
            .output()
            .unwrap_or_else(|e| panic!("wrk cannot run ({e}): apt-get install -y wrk"));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "wrk failed: {text}");
        assert!(
            !text.contains("Non-2xx") && !text.contains("Socket errors"),
            "wrk saw failed requests on {}: {text}",
            self.url
        );
        text.lines()
            .find_map(|l| l.strip_prefix("Requests/sec:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no Requests/sec in wrk's output: {text}"))
    }
}

/// Prints the ratio `top / bottom` through wrk: one warm-up run of each, then
/// `rounds` rounds alternated `top bottom bottom top`, a table row per round
/// and their mean.
pub fn ratio_table(top_name: &str, top: &Wrk, bottom_name: &str, bottom: &Wrk, rounds: usize) {
    println!();
    println!("wrk -t1 -c32 -d4s, alternated A B B A; each row one round");
    println!("| round | {top_name} req/s | {bottom_name} req/s | {top_name} / {bottom_name} |");
    println!("|---|---|---|---|");
    top.rps();
    bottom.rps();
    let mut ratios = Vec::new();
    for round in 1..=rounds {
        let t1 = top.rps();
        let b1 = bottom.rps();
        let b2 = bottom.rps();
        let t2 = top.rps();
        let (t, b) = ((t1 + t2) / 2.0, (b1 + b2) / 2.0);
        ratios.push(t / b);
        println!("| {round} | {t:.0} | {b:.0} | {:.2} |", t / b);
    }
    let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
    println!("| mean | | | **{mean:.2}** |");
}
