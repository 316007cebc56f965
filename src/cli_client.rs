//! The client half of the CLI: each command is one or two HTTP calls.

#![forbid(unsafe_code)]

use crate::cli::{
    ClientArgs, Command, DeployCommand, FnCommand, KeysCommand, KvCommand, NsCommand, PageArgs,
    PolicyArgs,
};
use serde_json::{Value, json};
use std::process::ExitCode;

/// Runs a client command in its own actix system.
pub fn run(cmd: Command) -> ExitCode {
    let system = actix_web::rt::System::new();
    match system.block_on(dispatch(cmd)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshgate: {e}");
            ExitCode::from(1)
        }
    }
}

fn credential(c: &ClientArgs) -> Option<String> {
    c.key
        .clone()
        .or_else(|| std::env::var("MESHGATE_OPERATOR_KEY").ok())
        .or_else(|| {
            std::fs::read_to_string("data/operator.key")
                .ok()
                .map(|s| s.trim().to_string())
        })
}

/// One HTTP call; a non-2xx answer becomes the error envelope's message.
pub async fn call(
    c: &ClientArgs,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> Result<Value, String> {
    let client = awc::Client::builder()
        .timeout(std::time::Duration::from_secs(60))
        .finish();
    let url = format!("{}{}", c.url.trim_end_matches('/'), path);
    let mut req = client.request(method.parse().map_err(|_| "bad method")?, &url);
    if let Some(k) = credential(c) {
        req = req.insert_header(("authorization", format!("Bearer {k}")));
    }
    if let Some(ns) = &c.namespace {
        req = req.insert_header(("x-namespace", ns.as_str()));
    }
    let mut resp = match body {
        Some(b) => req.send_json(&b).await,
        None => req.send().await,
    }
    .map_err(|e| format!("cannot reach {url}: {e}"))?;
    let bytes = resp
        .body()
        .limit(64 << 20)
        .await
        .map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    if resp.status().is_success() {
        Ok(v)
    } else {
        Err(error_text(resp.status().as_u16(), &v))
    }
}

/// One HTTP call with a raw body; returns the raw answer of a 2xx.
async fn call_raw(
    c: &ClientArgs,
    method: &str,
    path: &str,
    content_type: &str,
    body: Vec<u8>,
) -> Result<Vec<u8>, String> {
    let client = awc::Client::builder()
        .timeout(std::time::Duration::from_secs(120))
        .finish();
    let url = format!("{}{}", c.url.trim_end_matches('/'), path);
    let mut req = client
        .request(method.parse().map_err(|_| "bad method")?, &url)
        .insert_header(("content-type", content_type));
    if let Some(k) = credential(c) {
        req = req.insert_header(("authorization", format!("Bearer {k}")));
    }
    if let Some(ns) = &c.namespace {
        req = req.insert_header(("x-namespace", ns.as_str()));
    }
    let mut resp = req
        .send_body(body)
        .await
        .map_err(|e| format!("cannot reach {url}: {e}"))?;
    let bytes = resp
        .body()
        .limit(64 << 20)
        .await
        .map_err(|e| e.to_string())?;
    if resp.status().is_success() {
        return Ok(bytes.to_vec());
    }
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Err(error_text(resp.status().as_u16(), &v))
}

/// A `multipart/form-data` body of named parts.
fn multipart(boundary: &str, parts: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut b = Vec::new();
    for (name, data) in parts {
        b.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n")
                .as_bytes(),
        );
        b.extend_from_slice(data);
        b.extend_from_slice(b"\r\n");
    }
    b.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    b
}

fn read_stdin() -> Result<Vec<u8>, String> {
    let mut b = Vec::new();
    std::io::Read::read_to_end(&mut std::io::stdin(), &mut b)
        .map_err(|e| format!("cannot read standard input: {e}"))?;
    Ok(b)
}

async fn functions(cmd: FnCommand) -> Result<(), String> {
    match cmd {
        FnCommand::Deploy {
            file,
            name,
            memory_mb,
            timeout,
            public,
            metadata,
            client,
        } => {
            let wasm =
                std::fs::read(&file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
            let mut parts = vec![("name", name.into_bytes()), ("wasm", wasm)];
            if let Some(m) = memory_mb {
                parts.push(("memory_limit_mb", m.to_string().into_bytes()));
            }
            if let Some(t) = timeout {
                parts.push(("timeout_seconds", t.to_string().into_bytes()));
            }
            if public {
                parts.push(("is_public", b"true".to_vec()));
            }
            if let Some(m) = metadata {
                parts.push(("metadata", m.into_bytes()));
            }
            let boundary = format!("meshgate{}", hex::encode(crate::util::random_bytes::<12>()));
            let body = multipart(&boundary, &parts);
            let ct = format!("multipart/form-data; boundary={boundary}");
            let out = call_raw(&client, "POST", "/v1/functions", &ct, body).await?;
            let v: Value = serde_json::from_slice(&out).unwrap_or(Value::Null);
            print(&v);
        }
        FnCommand::List { page, client } => {
            print(&list(&client, "/v1/functions", "", "functions", &page).await?)
        }
        FnCommand::Invoke { name, data, client } => {
            let input = match data {
                Some(d) => d.into_bytes(),
                None => read_stdin()?,
            };
            let path = format!("/v1/functions/{name}/invoke");
            let out = call_raw(&client, "POST", &path, "application/octet-stream", input).await?;
            use std::io::Write as _;
            std::io::stdout()
                .write_all(&out)
                .map_err(|e| e.to_string())?;
        }
        FnCommand::Logs { name, client } => {
            print(&call(&client, "GET", &format!("/v1/functions/{name}/logs"), None).await?)
        }
        FnCommand::Delete { name, client } => {
            print(&call(&client, "DELETE", &format!("/v1/functions/{name}"), None).await?)
        }
    }
    Ok(())
}

/// A name a deployment may take, from a folder or host name.
/// The deployment's default route policy from `--policy` and the flags set on
/// top of it (None: no flag given, no `policy` in the body). The node checks it.
fn default_policy(args: PolicyArgs) -> Result<Option<Value>, String> {
    let PolicyArgs {
        auth,
        require_grants,
        forward_credentials,
        policy,
    } = args;
    let mut p: Value = match policy {
        Some(p) => serde_json::from_str(&p).map_err(|e| format!("--policy is not JSON: {e}"))?,
        None if auth.is_none() && require_grants.is_empty() && !forward_credentials => {
            return Ok(None);
        }
        None => json!({}),
    };
    if !p.is_object() {
        return Err("--policy must be a JSON object".into());
    }
    if let Some(a) = auth {
        p["auth"] = json!(a);
    }
    if !require_grants.is_empty() {
        p["require_grants"] = json!(require_grants);
    }
    if forward_credentials {
        p["forward_credentials"] = json!(true);
    }
    Ok(Some(p))
}

fn default_name(s: &str) -> String {
    let n: String = s
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let n = n.trim_matches('-').to_string();
    if n.is_empty() {
        "site".into()
    } else {
        n.chars().take(63).collect()
    }
}

async fn deployments(cmd: DeployCommand) -> Result<(), String> {
    match cmd {
        DeployCommand::Static {
            dir,
            hosts,
            name,
            policy,
            client,
        } => {
            if !dir.is_dir() {
                return Err(format!(
                    "{} is not a folder (give the folder holding the site's files, e.g. ./public)",
                    dir.display()
                ));
            }
            let name = name.unwrap_or_else(|| {
                let abs = std::fs::canonicalize(&dir).unwrap_or(dir.clone());
                default_name(&abs.file_name().unwrap_or_default().to_string_lossy())
            });
            let tgz = crate::deploy::site::pack_dir(&dir)
                .map_err(|e| format!("cannot pack {}: {e}", dir.display()))?;
            let mut parts = vec![
                ("name", name.clone().into_bytes()),
                ("hosts", hosts.join(",").into_bytes()),
            ];
            if let Some(p) = default_policy(policy)? {
                parts.push(("policy", p.to_string().into_bytes()));
            }
            parts.push(("tarball", tgz));
            let boundary = format!("meshgate{}", hex::encode(crate::util::random_bytes::<12>()));
            let body = multipart(&boundary, &parts);
            let ct = format!("multipart/form-data; boundary={boundary}");
            eprintln!("deploying {} as deployment {name:?}", dir.display());
            let out = call_raw(&client, "POST", "/v1/deployments", &ct, body).await?;
            print(&serde_json::from_slice(&out).unwrap_or(Value::Null));
        }
        DeployCommand::Upstream {
            urls,
            hosts,
            name,
            routes,
            policy,
            weights,
            balance,
            hash_header,
            health_path,
            health_interval_ms,
            health_timeout_ms,
            healthy_threshold,
            unhealthy_threshold,
            no_compress,
            client,
        } => {
            let routes: Value = match routes {
                Some(r) => {
                    serde_json::from_str(&r).map_err(|e| format!("--routes is not JSON: {e}"))?
                }
                None => json!([]),
            };
            let name = name.unwrap_or_else(|| default_name(&hosts[0]));
            let health = health_path.map(|path| {
                let mut h = serde_json::Map::new();
                h.insert("path".into(), json!(path));
                for (k, v) in [
                    ("interval_ms", health_interval_ms),
                    ("timeout_ms", health_timeout_ms),
                    ("healthy_threshold", healthy_threshold.map(u64::from)),
                    ("unhealthy_threshold", unhealthy_threshold.map(u64::from)),
                ] {
                    if let Some(v) = v {
                        h.insert(k.into(), json!(v));
                    }
                }
                Value::Object(h)
            });
            let mut upstream =
                upstream_json(&urls, &weights, balance.as_deref(), hash_header, health)?;
            if no_compress {
                upstream["compress"] = json!(false);
            }
            let mut body =
                json!({"name": name, "hosts": hosts, "upstream": upstream, "routes": routes});
            if let Some(p) = default_policy(policy)? {
                body["policy"] = p;
            }
            print(&call(&client, "POST", "/v1/deployments", Some(body)).await?);
        }
        DeployCommand::List { page, client } => {
            print(&list(&client, "/v1/deployments", "", "deployments", &page).await?)
        }
        DeployCommand::Show { name, client } => {
            print(&call(&client, "GET", &format!("/v1/deployments/{name}"), None).await?)
        }
        DeployCommand::Activity {
            name,
            limit,
            client,
        } => {
            let mut path = format!("/v1/deployments/{name}/activity");
            if let Some(n) = limit {
                path.push_str(&format!("?limit={n}"));
            }
            print(&call(&client, "GET", &path, None).await?)
        }
        DeployCommand::Rollback {
            name,
            version,
            client,
        } => {
            let body = json!({"version": version});
            let path = format!("/v1/deployments/{name}/rollback");
            print(&call(&client, "POST", &path, Some(body)).await?)
        }
        DeployCommand::Delete { name, client } => {
            print(&call(&client, "DELETE", &format!("/v1/deployments/{name}"), None).await?)
        }
    }
    Ok(())
}

/// The `upstream` of `meshgate deploy upstream`: each instance a URL, or
/// `{url, weight}` when `URL=WEIGHT` (in the list or a `--weight`) gives one.
fn upstream_json(
    urls: &[String],
    weights: &[String],
    balance: Option<&str>,
    hash_header: Option<String>,
    health: Option<Value>,
) -> Result<Value, String> {
    let split = |s: &str| -> Result<(String, Option<u32>), String> {
        match s.rsplit_once('=') {
            Some((u, w)) => w
                .parse()
                .map(|w| (u.to_string(), Some(w)))
                .map_err(|_| format!("{s:?}: the weight after = is not a number")),
            None => Ok((s.to_string(), None)),
        }
    };
    let mut list: Vec<(String, Option<u32>)> =
        urls.iter().map(|u| split(u)).collect::<Result<_, _>>()?;
    for w in weights {
        let (url, weight) = split(w)?;
        let Some(weight) = weight else {
            return Err(format!("--weight {w:?}: give URL=WEIGHT"));
        };
        match list
            .iter_mut()
            .find(|(u, _)| u.trim_end_matches('/') == url.trim_end_matches('/'))
        {
            Some(e) => e.1 = Some(weight),
            None => return Err(format!("--weight {w:?}: {url} is not one of the instances")),
        }
    }
    let instances: Vec<Value> = list
        .into_iter()
        .map(|(u, w)| match w {
            Some(w) => json!({"url": u, "weight": w}),
            None => json!(u),
        })
        .collect();
    let mut up = json!({"instances": instances});
    match (balance, hash_header) {
        (None | Some("hash"), Some(h)) => up["balance"] = json!({"hash": {"header": h}}),
        (Some(_), Some(_)) => return Err("--hash-header goes with --balance hash".into()),
        (Some("hash"), None) => up["balance"] = json!({"hash": {}}),
        (Some(b), None) => up["balance"] = json!(b),
        (None, None) => {}
    }
    if let Some(h) = health {
        up["health"] = h;
    }
    Ok(up)
}

/// A paged listing (`path`, answering `field` and `next_cursor`): with
/// `--limit` the one page as answered; otherwise every page, the cursor
/// followed until the last, as one `{field: [...]}`.
async fn list(
    client: &ClientArgs,
    path: &str,
    query: &str,
    field: &str,
    page: &PageArgs,
) -> Result<Value, String> {
    let url = |limit: Option<u32>, cursor: Option<&str>| {
        let mut q: Vec<String> = Vec::new();
        if !query.is_empty() {
            q.push(query.to_string());
        }
        if let Some(l) = limit {
            q.push(format!("limit={l}"));
        }
        if let Some(c) = cursor {
            q.push(format!("cursor={}", percent_encode(c)));
        }
        match q.is_empty() {
            true => path.to_string(),
            false => format!("{path}?{}", q.join("&")),
        }
    };
    if page.limit.is_some() {
        return call(
            client,
            "GET",
            &url(page.limit, page.cursor.as_deref()),
            None,
        )
        .await;
    }
    let mut all = Vec::new();
    let mut cursor = page.cursor.clone();
    loop {
        let mut v = call(client, "GET", &url(page.page_size, cursor.as_deref()), None).await?;
        match v.get_mut(field).map(Value::take) {
            Some(Value::Array(items)) => all.extend(items),
            _ => return Err(format!("{path} answered no {field} list")),
        }
        match v.get("next_cursor").and_then(Value::as_str) {
            // A cursor that does not move would loop for ever.
            Some(c) if cursor.as_deref() != Some(c) => cursor = Some(c.to_string()),
            Some(_) => return Err(format!("{path} answered the same cursor twice")),
            None => break,
        }
    }
    Ok(json!({ field: all }))
}

/// `s` for a query string: unreserved ASCII kept, every other byte as `%XX`.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn print(v: &Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

async fn dispatch(cmd: Command) -> Result<(), String> {
    match cmd {
        Command::Serve(_) => unreachable!("handled by cli::main"),
        Command::Ns(NsCommand::Create { name, client }) => {
            let v = call(
                &client,
                "POST",
                "/v1/namespaces",
                Some(json!({"name": name})),
            )
            .await?;
            eprintln!(
                "namespace {name} created; its owner API key {} (shown once):",
                v["key"]["id"].as_str().unwrap_or_default()
            );
            println!("{}", v["api_key"].as_str().unwrap_or_default());
        }
        Command::Ns(NsCommand::List { page, client }) => {
            print(&list(&client, "/v1/namespaces", "", "namespaces", &page).await?)
        }
        Command::Ns(NsCommand::Delete { name, client }) => {
            print(&call(&client, "DELETE", &format!("/v1/namespaces/{name}"), None).await?)
        }
        Command::Keys(KeysCommand::Create {
            role,
            grants,
            days,
            name,
            client,
        }) => {
            let mut body = json!({"name": name, "grants": grants});
            if let Some(r) = role {
                body["role"] = json!(r);
            }
            if let Some(d) = days {
                body["expires_in_days"] = json!(d);
            }
            let v = call(&client, "POST", "/v1/auth/api-keys", Some(body)).await?;
            eprintln!(
                "key {} created (shown once):",
                v["key"]["id"].as_str().unwrap_or_default()
            );
            println!("{}", v["api_key"].as_str().unwrap_or_default());
        }
        Command::Keys(KeysCommand::List { page, client }) => {
            print(&list(&client, "/v1/auth/api-keys", "", "keys", &page).await?)
        }
        Command::Kv(KvCommand::List {
            prefix,
            page,
            client,
        }) => {
            let query = format!("prefix={}", percent_encode(&prefix));
            print(&list(&client, "/v1/kv", &query, "keys", &page).await?)
        }
        Command::Keys(KeysCommand::Revoke { id, client }) => {
            print(&call(&client, "DELETE", &format!("/v1/auth/api-keys/{id}"), None).await?)
        }
        Command::Fn(cmd) => functions(cmd).await?,
        Command::Deploy(cmd) => deployments(cmd).await?,
        Command::Pub {
            topic,
            data,
            client,
        } => {
            use base64::Engine as _;
            let data = match data {
                Some(d) => d.into_bytes(),
                None => {
                    let mut b = Vec::new();
                    std::io::Read::read_to_end(&mut std::io::stdin(), &mut b)
                        .map_err(|e| format!("cannot read standard input: {e}"))?;
                    b
                }
            };
            let body = json!({
                "topic": topic,
                "data_base64": base64::engine::general_purpose::STANDARD.encode(data),
            });
            call(&client, "POST", "/v1/pubsub/publish", Some(body)).await?;
        }
        Command::Sub {
            topic,
            json,
            client,
        } => subscribe(&client, &topic, json).await?,
    }
    Ok(())
}

/// `meshgate sub`: one simple socket; prints messages until the node closes it.
async fn subscribe(c: &ClientArgs, topic: &str, as_json: bool) -> Result<(), String> {
    use futures_util::{SinkExt as _, StreamExt as _};
    use std::io::Write as _;
    let base = c.url.trim_end_matches('/');
    let ws_base = base
        .strip_prefix("https://")
        .map(|r| format!("wss://{r}"))
        .or_else(|| base.strip_prefix("http://").map(|r| format!("ws://{r}")))
        .ok_or_else(|| format!("not an http(s) URL: {base}"))?;
    let format = if as_json { "json" } else { "binary" };
    let mut url = format!(
        "{ws_base}/v1/pubsub/ws?topic={}&format={format}",
        urlencode(topic)
    );
    if let Some(ns) = &c.namespace {
        url.push_str(&format!("&namespace={}", urlencode(ns)));
    }
    let mut req = awc::Client::new().ws(&url).max_frame_size(64 << 20);
    if let Some(k) = credential(c) {
        req = req.bearer_auth(k);
    }
    let (_, mut socket) = req
        .connect()
        .await
        .map_err(|e| format!("cannot subscribe at {url}: {e}"))?;
    // On stderr, so a script can wait for it while stdout carries only data.
    eprintln!("subscribed to {topic}");
    let mut out = std::io::stdout();
    while let Some(frame) = socket.next().await {
        match frame.map_err(|e| e.to_string())? {
            awc::ws::Frame::Binary(b) | awc::ws::Frame::Text(b) => {
                let _ = out.write_all(&b);
                let _ = out.write_all(b"\n");
                let _ = out.flush();
            }
            awc::ws::Frame::Ping(p) => {
                let _ = socket.send(awc::ws::Message::Pong(p)).await;
            }
            awc::ws::Frame::Close(r) => {
                return match r {
                    Some(r) if u16::from(r.code) != 1000 => Err(format!(
                        "closed by the node: {} {}",
                        u16::from(r.code),
                        r.description.unwrap_or_default()
                    )),
                    _ => Ok(()),
                };
            }
            _ => {}
        }
    }
    Ok(())
}

/// Percent-encodes a query value.
fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `STATUS CODE: message` from the JSON error envelope.
fn error_text(status: u16, v: &Value) -> String {
    let code = v
        .pointer("/error/code")
        .and_then(Value::as_str)
        .unwrap_or("ERROR");
    let msg = v
        .pointer("/error/message")
        .and_then(Value::as_str)
        .unwrap_or("");
    // The node speaks of HTTP headers; the CLI's user has flags.
    let hint = match code {
        "NAMESPACE_REQUIRED" => {
            " (with the operator key, name the namespace: -n/--namespace NAME; \
             or use one of the namespace's keys with --key)"
        }
        "MISSING_CREDENTIAL" => " (pass --key, or set MESHGATE_KEY)",
        _ => "",
    };
    format!("{status} {code}: {msg}{hint}")
}

#[cfg(test)]
mod balance_tests {
    use super::*;

    /// `URL=WEIGHT` in the list or as `--weight`; balance and hash header.
    #[test]
    fn upstream_json_takes_weights_and_balance() {
        let urls = vec!["http://a:1=3".to_string(), "http://b:2".to_string()];
        let up = upstream_json(&urls, &[], None, None, None).unwrap();
        assert_eq!(
            up,
            json!({"instances": [{"url": "http://a:1", "weight": 3}, "http://b:2"]})
        );
        let w = vec!["http://b:2=5".to_string()];
        let up = upstream_json(&urls, &w, Some("least_request"), None, None).unwrap();
        assert_eq!(
            up["instances"][1],
            json!({"url": "http://b:2", "weight": 5})
        );
        assert_eq!(up["balance"], "least_request");
        let up = upstream_json(&urls, &[], None, Some("X-User".into()), None).unwrap();
        assert_eq!(up["balance"], json!({"hash": {"header": "X-User"}}));
        assert_eq!(
            upstream_json(&urls, &[], Some("hash"), None, Some(json!({"path": "/h"}))).unwrap()["balance"],
            json!({"hash": {}})
        );
        assert!(upstream_json(&urls, &["http://c:3=1".into()], None, None, None).is_err());
        assert!(upstream_json(&urls, &["http://b:2".into()], None, None, None).is_err());
        assert!(upstream_json(&["http://a:1=x".into()], &[], None, None, None).is_err());
    }
}
