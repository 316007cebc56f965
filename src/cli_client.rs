//! The client half of the CLI: each command is one or two HTTP calls.

#![forbid(unsafe_code)]

use crate::cli::{
    ClientArgs, Command, DeployCommand, FnCommand, KeysCommand, KvCommand, NodeArgs, NodeCommand,
    NsCommand, PageArgs, PolicyArgs, QuotasCommand, WalletCommand,
};
use serde_json::{Value, json};
use std::process::ExitCode;

/// Runs a client command in its own actix system.
pub fn run(cmd: Command) -> ExitCode {
    let system = actix_web::rt::System::new();
    match system.block_on(dispatch(cmd)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshgate: {}", printable(&e.to_string()));
            ExitCode::from(1)
        }
    }
}

/// `text` (a node's error, which a node the user did not mean to trust may
/// have written) with every control character escaped (`\u{1b}`), so what
/// reaches the terminal cannot move its cursor, set its title or write its
/// clipboard.
pub fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
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
    call_with(c, credential(c), method, path, body).await
}

/// [`call`] with this credential (None: the request carries none).
async fn call_with(
    c: &ClientArgs,
    credential: Option<String>,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> Result<Value, String> {
    let client = awc::Client::builder()
        .timeout(std::time::Duration::from_secs(60))
        .finish();
    let url = format!("{}{}", c.url.trim_end_matches('/'), path);
    let mut req = client.request(method.parse().map_err(|_| "bad method")?, &url);
    if let Some(k) = credential {
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
            tls,
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
            if let Some(t) = tls {
                parts.push(("tls", t.into_bytes()));
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
            grpc_max_timeout_ms,
            tls,
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
            if let Some(ms) = grpc_max_timeout_ms {
                upstream["grpc"] = json!({ "max_timeout_ms": ms });
            }
            let mut body =
                json!({"name": name, "hosts": hosts, "upstream": upstream, "routes": routes});
            if let Some(p) = default_policy(policy)? {
                body["policy"] = p;
            }
            if let Some(t) = tls {
                body["tls"] = json!(t);
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
        DeployCommand::Cert {
            name,
            cert,
            private_key: key,
            remove,
            client,
        } => {
            let path = format!("/v1/deployments/{name}/certificate");
            match (cert, key) {
                (Some(cert), Some(key)) => {
                    let read = |p: &std::path::Path| {
                        std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()))
                    };
                    let parts = vec![("cert", read(&cert)?), ("key", read(&key)?)];
                    let boundary =
                        format!("meshgate{}", hex::encode(crate::util::random_bytes::<12>()));
                    let body = multipart(&boundary, &parts);
                    let ct = format!("multipart/form-data; boundary={boundary}");
                    let out = call_raw(&client, "PUT", &path, &ct, body).await?;
                    print(&serde_json::from_slice(&out).unwrap_or(Value::Null));
                }
                _ if remove => print(&call(&client, "DELETE", &path, None).await?),
                _ => print(&call(&client, "GET", &path, None).await?),
            }
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
        Command::Node(NodeCommand::Drain { id, client }) => print(
            &call(
                &client,
                "POST",
                &format!("/v1/cluster/nodes/{}/drain", percent_encode(&id)),
                None,
            )
            .await?,
        ),
        Command::Ns(NsCommand::Delete { name, client }) => {
            print(&call(&client, "DELETE", &format!("/v1/namespaces/{name}"), None).await?)
        }
        Command::Keys(KeysCommand::Create {
            role,
            kind,
            grants,
            days,
            name,
            client,
        }) => {
            let mut body = json!({"name": name, "grants": grants});
            if let Some(k) = key_kind(role.as_deref(), kind.as_deref())? {
                body["kind"] = json!(k);
            }
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
        Command::Sessions {
            end,
            device,
            page,
            client,
        } => match (end, device) {
            (Some(sid), _) => {
                let path = format!("/v1/auth/sessions/{}", percent_encode(&sid));
                print(&call(&client, "DELETE", &path, None).await?)
            }
            (None, Some(d)) => {
                let path = format!("/v1/auth/sessions?device_id={}", percent_encode(&d));
                print(&call(&client, "DELETE", &path, None).await?)
            }
            (None, None) => {
                print(&list(&client, "/v1/auth/sessions", "", "sessions", &page).await?)
            }
        },
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
            offsets,
            client,
        } => subscribe(&client, &topic, Output::of(json, offsets)).await?,
        Command::History {
            topic,
            since,
            epoch,
            reverse,
            limit,
            json,
            offsets,
            client,
        } => {
            let read = HistoryRead {
                topic,
                since,
                epoch,
                reverse,
                limit,
            };
            history(&client, read, Output::of(json, offsets)).await?
        }
        Command::Quotas(QuotasCommand::Show { client }) => {
            let ns = namespace_of(&client).await?;
            let path = format!("/v1/namespaces/{}/quotas", percent_encode(&ns));
            print(&call(&client, "GET", &path, None).await?)
        }
        Command::Quotas(QuotasCommand::Set { quotas, client }) => {
            let Some(ns) = client.namespace.clone() else {
                return Err("name the namespace: -n/--namespace NAME \
                     (quotas are set with the operator key)"
                    .into());
            };
            let body = quota_overrides(&quotas)?;
            let path = format!("/v1/namespaces/{}/quotas", percent_encode(&ns));
            print(&call(&client, "PUT", &path, Some(body)).await?)
        }
        Command::Wallet(WalletCommand::SignIn {
            namespace,
            key_file,
            chain_id: Some(chain_id),
            json,
            node,
        }) => evm_sign_in(&node, &namespace, &key_file, chain_id, json).await?,
        Command::Wallet(WalletCommand::SignIn {
            namespace,
            key_file,
            chain_id: None,
            json,
            node,
        }) => wallet_sign_in(&node, &namespace, &key_file, json).await?,
        Command::Wallet(WalletCommand::Address {
            key_file,
            evm: true,
        }) => {
            let key = evm_key(&key_file)?;
            println!("{}", crate::auth::checksum_address(&evm_address(&key)));
        }
        Command::Wallet(WalletCommand::Address {
            key_file,
            evm: false,
        }) => {
            println!("{}", wallet_address(&wallet_key(&key_file)?));
        }
        Command::Status { json, client } => {
            let v = call(&client, "GET", "/v1/status", None).await?;
            if json {
                print(&v);
            } else {
                print!("{}", status_text(&v));
            }
            if v["ready"] != Value::Bool(true) {
                return Err(format!(
                    "the node is not ready (phase {})",
                    v["phase"].as_str().unwrap_or("unknown")
                ));
            }
        }
    }
    Ok(())
}

/// The mailboxes `meshgate status` lists, the fullest first.
const STATUS_MAILBOXES: usize = 5;

/// `GET /v1/status`'s answer for a person, one line per part.
fn status_text(v: &Value) -> String {
    let s = |v: &Value| match v {
        Value::String(x) => printable(x),
        Value::Null => "-".to_string(),
        other => printable(&other.to_string()),
    };
    let mut out = String::new();
    let up = v["uptime_seconds"].as_u64().unwrap_or(0);
    out.push_str(&format!(
        "node        {}  version {}  up {}h {}m {}s\n",
        s(&v["node_id"]),
        s(&v["version"]),
        up / 3600,
        up / 60 % 60,
        up % 60
    ));
    out.push_str(&format!(
        "ready       {} ({})\n",
        if v["ready"] == Value::Bool(true) {
            "yes"
        } else {
            "no"
        },
        s(&v["phase"])
    ));
    let store = &v["store"];
    out.push_str(&format!(
        "store       {}, {}{}\n",
        s(&store["backend"]),
        if store["healthy"] == Value::Bool(true) {
            "healthy"
        } else {
            "UNHEALTHY"
        },
        match store["error"].as_str() {
            Some(e) => format!(": {}", printable(e)),
            None => format!(" (read {:.1} ms)", store["read_ms"].as_f64().unwrap_or(0.0)),
        }
    ));
    let names = |v: &Value| {
        v.as_array()
            .map(|a| a.iter().map(|x| s(x)).collect::<Vec<_>>().join(", "))
            .unwrap_or_default()
    };
    match v["cluster"].as_object() {
        Some(c) => out.push_str(&format!(
            "cluster     live nodes: {}\n",
            names(&c["live_nodes"])
        )),
        None => out.push_str("cluster     off (one node)\n"),
    }
    if let Some(m) = v["mesh"].as_object() {
        // The operator's view lists the peers, the public one counts them.
        let n = |k: &str| match m.get(k) {
            Some(Value::Array(a)) => a.len() as u64,
            Some(v) => v.as_u64().unwrap_or(0),
            None => 0,
        };
        out.push_str(&format!(
            "mesh        {} registered, {} connected, {} subscribed\n",
            n("registered"),
            n("connected"),
            n("subscribed")
        ));
    }
    let breakers = v["breakers"].as_array().cloned().unwrap_or_default();
    if breakers.is_empty() {
        out.push_str("breakers    none held\n");
    }
    for b in &breakers {
        out.push_str(&format!(
            "breaker     {} -> {}  {}  {} failures{}\n",
            s(&b["namespace"]),
            s(&b["member"]),
            s(&b["state"]),
            b["consecutive_failures"].as_u64().unwrap_or(0),
            match (
                b["open_for_seconds"].as_u64(),
                b["next_probe_seconds"].as_u64()
            ) {
                (Some(o), Some(p)) => format!(", open {o} s, next probe in {p} s"),
                _ => String::new(),
            }
        ));
    }
    out.push_str(&format!(
        "namespaces  {} running\n",
        v["namespaces_running"].as_u64().unwrap_or(0)
    ));
    // The operator's view: each namespace running here with its members.
    for m in v["namespace_members"].as_array().into_iter().flatten() {
        let members = match &m["members"] {
            Value::Array(a) if a.is_empty() => "every node".to_string(),
            Value::Array(_) => names(&m["members"]),
            _ => "unknown (store unreachable)".to_string(),
        };
        out.push_str(&format!(
            "members     {}: {}{}\n",
            s(&m["namespace"]),
            members,
            if m["member_here"] == Value::Bool(false) {
                "  (not here: forwarded)"
            } else {
                ""
            }
        ));
    }
    if v["namespace_members_truncated"] == Value::Bool(true) {
        out.push_str("members     ... (the first 100 by name)\n");
    }
    let mut actors = v["actors"].as_array().cloned().unwrap_or_default();
    actors.sort_by_key(|a| std::cmp::Reverse(a["mailbox_depth"].as_u64().unwrap_or(0)));
    for a in actors.iter().take(STATUS_MAILBOXES) {
        out.push_str(&format!(
            "mailbox     {} {}{}  depth {}  handled {}  restarts {}\n",
            s(&a["kind"]),
            s(&a["id"]),
            a["namespace"]
                .as_str()
                .map(|n| format!(" ({})", printable(n)))
                .unwrap_or_default(),
            a["mailbox_depth"].as_u64().unwrap_or(0),
            a["handled"].as_u64().unwrap_or(0),
            a["restarts"].as_u64().unwrap_or(0)
        ));
    }
    out
}

/// The key kind a role pairs with (docs/auth.md "Roles"): `rk`, the data
/// plane, for `runtime`; `sk`, the control plane, for the others. None for
/// a name that is no role (the node refuses it: `UNKNOWN_ROLE`).
fn role_kind(role: &str) -> Option<&'static str> {
    match role.to_ascii_lowercase().as_str() {
        "runtime" => Some("rk"),
        "owner" | "admin" | "developer" | "reader" => Some("sk"),
        _ => None,
    }
}

/// The `kind` `keys create` sends: `--kind`, else the role's (None: the
/// node's default, `sk`). The node takes any kind with any role, so a
/// known kind the role does not pair with is refused here; a kind that is
/// neither `sk` nor `rk` is sent for the node to refuse (400).
fn key_kind(role: Option<&str>, kind: Option<&str>) -> Result<Option<String>, String> {
    let paired = role.and_then(role_kind);
    match (kind, paired) {
        (None, paired) => Ok(paired.map(str::to_string)),
        (Some(k @ ("sk" | "rk")), Some(p)) if k != p => {
            let role = role.unwrap_or_default();
            let why = match p {
                "rk" => "runtime keys are rk, the data plane a running app uses",
                _ => "rk keys are for a running app: give them --role runtime or --grant",
            };
            Err(format!(
                "--kind {k} does not go with --role {role} ({why}); leave --kind out to take the role's kind, {p}"
            ))
        }
        (Some(k), _) => Ok(Some(k.to_string())),
    }
}

/// The namespace a command acts on: `-n`, else the credential's own
/// (`GET /v1/auth/whoami`).
async fn namespace_of(c: &ClientArgs) -> Result<String, String> {
    if let Some(ns) = &c.namespace {
        return Ok(ns.clone());
    }
    let me = call(c, "GET", "/v1/auth/whoami", None).await?;
    me["namespace"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| "the node did not say which namespace the credential is of".into())
}

/// The body of `PUT /v1/namespaces/{ns}/quotas` from `QUOTA=LIMIT` pairs;
/// the node checks the names.
fn quota_overrides(pairs: &[String]) -> Result<Value, String> {
    let mut body = serde_json::Map::new();
    for p in pairs {
        let Some((name, limit)) = p.split_once('=') else {
            return Err(format!("{p:?}: give QUOTA=LIMIT, e.g. kv_keys=5000"));
        };
        let limit: u64 = limit
            .trim()
            .parse()
            .map_err(|_| format!("{p:?}: the limit after = is not a whole number"))?;
        if body.insert(name.trim().to_string(), json!(limit)).is_some() {
            return Err(format!("{} is named twice", name.trim()));
        }
    }
    Ok(Value::Object(body))
}

/// How `sub` and `history` print a message.
#[derive(Clone, Copy, PartialEq)]
enum Output {
    /// Its data, then a newline.
    Data,
    /// `OFFSET<TAB>DATA`, then a newline (`-` for a message without offset).
    Offsets,
    /// As JSON.
    Json,
}

impl Output {
    fn of(json: bool, offsets: bool) -> Output {
        match (json, offsets) {
            (true, _) => Output::Json,
            (_, true) => Output::Offsets,
            _ => Output::Data,
        }
    }
}

/// Writes one message as `how` says (not `Json`). An error is the reader
/// gone (a closed pipe): the caller stops.
fn write_message(
    out: &mut impl std::io::Write,
    how: Output,
    offset: Option<u64>,
    data: &[u8],
) -> std::io::Result<()> {
    if how == Output::Offsets {
        match offset {
            Some(o) => write!(out, "{o}\t")?,
            None => out.write_all(b"-\t")?,
        }
    }
    out.write_all(data)?;
    out.write_all(b"\n")?;
    out.flush()
}

/// A message's data and offset from a JSON frame or a history entry
/// (`data_base64`, `offset`).
fn message_of(v: &Value) -> Result<(Option<u64>, Vec<u8>), String> {
    use base64::Engine as _;
    let data = v["data_base64"]
        .as_str()
        .ok_or_else(|| format!("not a message: {v}"))?;
    let data = base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| format!("a message whose data_base64 does not decode ({e}): {v}"))?;
    Ok((v["offset"].as_u64(), data))
}

/// What `meshgate history` reads.
struct HistoryRead {
    topic: String,
    since: Option<u64>,
    epoch: Option<String>,
    reverse: bool,
    limit: Option<u32>,
}

/// `meshgate history`: `GET /v1/pubsub/history`, one page with `--limit`,
/// else every page in turn (each from the last one's last offset, pinned to
/// the first page's epoch, so a history recreated meanwhile is refused
/// rather than mixed in).
async fn history(c: &ClientArgs, read: HistoryRead, how: Output) -> Result<(), String> {
    use std::io::Write as _;
    let HistoryRead {
        topic,
        mut since,
        mut epoch,
        reverse,
        limit,
    } = read;
    let mut out = std::io::stdout();
    // The last page read.
    let mut answer;
    let mut all = Vec::new();
    loop {
        let mut q = vec![format!("topic={}", percent_encode(&topic))];
        if let Some(s) = since {
            q.push(format!("since_offset={s}"));
        }
        if let Some(e) = &epoch {
            q.push(format!("epoch={}", percent_encode(e)));
        }
        if let Some(l) = limit {
            q.push(format!("limit={l}"));
        }
        if reverse {
            q.push("reverse=true".into());
        }
        let path = format!("/v1/pubsub/history?{}", q.join("&"));
        let mut page = call(c, "GET", &path, None).await?;
        let publications = match page.get_mut("publications").map(Value::take) {
            Some(Value::Array(p)) => p,
            _ => return Err(format!("{path} answered no publications list")),
        };
        if page["epoch"].is_null() {
            eprintln!(
                "meshgate: {topic} keeps no history (no history rule of the namespace names it)"
            );
        }
        let more = page["more"].as_bool() == Some(true);
        let last = publications.last().and_then(|p| p["offset"].as_u64());
        if how == Output::Json {
            all.extend(publications);
        } else {
            for p in &publications {
                let (offset, data) = message_of(p)?;
                if write_message(&mut out, how, offset, &data).is_err() {
                    return Ok(());
                }
            }
        }
        epoch = page["epoch"].as_str().map(str::to_string);
        answer = page;
        match (more, last) {
            (true, Some(l)) if limit.is_none() => {
                // An offset that does not move would loop for ever.
                if since == Some(l) {
                    return Err(format!("{path} answered the same page twice"));
                }
                since = Some(l);
            }
            (true, Some(l)) if how != Output::Json => {
                eprintln!("meshgate: more kept messages follow: --since {l}");
                break;
            }
            _ => break,
        }
    }
    if how == Output::Json {
        answer["publications"] = Value::Array(all);
        print(&answer);
    }
    let _ = out.flush();
    Ok(())
}

/// The wallet's Ed25519 key pair from `path`: PKCS#8 in PEM or DER (v1, as
/// OpenSSL writes it, or v2), or the 32-byte seed as 64 hex characters.
fn wallet_key(path: &std::path::Path) -> Result<ring::signature::Ed25519KeyPair, String> {
    use base64::Engine as _;
    use ring::signature::Ed25519KeyPair;
    let raw = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let bad = |why: String| {
        format!(
            "{}: {why}; give an Ed25519 private key: PKCS#8 PEM \
             (`openssl genpkey -algorithm ed25519 -out wallet.pem`), PKCS#8 DER, \
             or the 32-byte seed as 64 hex characters",
            path.display()
        )
    };
    let text = std::str::from_utf8(&raw).map(str::trim).unwrap_or_default();
    let der = if text.starts_with("-----BEGIN") {
        if !text.starts_with("-----BEGIN PRIVATE KEY-----") {
            let label = text.lines().next().unwrap_or_default();
            return Err(bad(format!("{label} is not an unencrypted PKCS#8 key")));
        }
        let b64: String = text
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .map(str::trim)
            .collect();
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| bad(format!("its PEM does not decode: {e}")))?
    } else if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
        let seed = hex::decode(text).map_err(|e| bad(e.to_string()))?;
        return Ed25519KeyPair::from_seed_unchecked(&seed)
            .map_err(|e| bad(format!("not an Ed25519 seed: {e}")));
    } else {
        raw
    };
    Ed25519KeyPair::from_pkcs8_maybe_unchecked(&der)
        .map_err(|e| bad(format!("not an Ed25519 PKCS#8 key: {e}")))
}

/// A key pair's wallet address: its public key in lower-case hex.
fn wallet_address(key: &ring::signature::Ed25519KeyPair) -> String {
    use ring::signature::KeyPair as _;
    hex::encode(key.public_key().as_ref())
}

/// `meshgate wallet sign-in`: `POST /v1/auth/challenge`, the challenge
/// signed with the key, `POST /v1/auth/verify`; no credential is sent
/// (docs/auth.md "Wallet sign-in").
async fn wallet_sign_in(
    node: &NodeArgs,
    namespace: &str,
    key_file: &std::path::Path,
    as_json: bool,
) -> Result<(), String> {
    let key = wallet_key(key_file)?;
    let wallet = wallet_address(&key);
    let c = ClientArgs {
        url: node.url.clone(),
        key: None,
        namespace: None,
    };
    let body = json!({"wallet": wallet, "namespace": namespace});
    let challenge = call_with(&c, None, "POST", "/v1/auth/challenge", Some(body)).await?;
    let message = challenge["message"]
        .as_str()
        .ok_or("the node's challenge holds no message")?;
    let signature = hex::encode(key.sign(message.as_bytes()).as_ref());
    let body = json!({"message": message, "signature": signature});
    let v = call_with(&c, None, "POST", "/v1/auth/verify", Some(body)).await?;
    if as_json {
        print(&v);
        return Ok(());
    }
    eprintln!(
        "wallet {wallet} signed in to {namespace} as {}; its access token (for {} s):",
        v["role"].as_str().unwrap_or("wallet"),
        v["expires_in"].as_u64().unwrap_or_default()
    );
    println!("{}", v["access_token"].as_str().unwrap_or_default());
    Ok(())
}

/// An Ethereum account's secp256k1 private key from `path`: 64 hex
/// characters, `0x` optional.
fn evm_key(path: &std::path::Path) -> Result<k256::ecdsa::SigningKey, String> {
    let raw = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let text = raw.trim();
    let text = text.strip_prefix("0x").unwrap_or(text);
    let bad = || {
        format!(
            "{}: not an Ethereum private key; give its 32 bytes as 64 hex characters",
            path.display()
        )
    };
    if text.len() != 64 {
        return Err(bad());
    }
    let bytes = hex::decode(text).map_err(|_| bad())?;
    k256::ecdsa::SigningKey::from_slice(&bytes).map_err(|_| bad())
}

/// The account's address, lower case with `0x`: the last 20 bytes of the
/// keccak-256 of its uncompressed public key.
fn evm_address(key: &k256::ecdsa::SigningKey) -> String {
    use sha3::Digest as _;
    let point = key.verifying_key().to_encoded_point(false);
    let hash = sha3::Keccak256::digest(&point.as_bytes()[1..]);
    format!("0x{}", hex::encode(&hash[12..]))
}

/// `meshgate wallet sign-in --chain-id N`: Sign-In with Ethereum. The
/// node's EIP-4361 message is signed as `personal_sign` does (EIP-191,
/// low s, v 27/28); no credential is sent (docs/auth.md "Sign-In with
/// Ethereum").
async fn evm_sign_in(
    node: &NodeArgs,
    namespace: &str,
    key_file: &std::path::Path,
    chain_id: u64,
    as_json: bool,
) -> Result<(), String> {
    let key = evm_key(key_file)?;
    let address = crate::auth::checksum_address(&evm_address(&key));
    let c = ClientArgs {
        url: node.url.clone(),
        key: None,
        namespace: None,
    };
    let body =
        json!({"chain": "evm", "address": address, "chain_id": chain_id, "namespace": namespace});
    let challenge = call_with(&c, None, "POST", "/v1/auth/challenge", Some(body)).await?;
    let message = challenge["message"]
        .as_str()
        .ok_or("the node's challenge holds no message")?;
    let digest = crate::auth::eip191_digest(message.as_bytes());
    let (sig, recid) = key
        .sign_prehash_recoverable(&digest)
        .map_err(|e| format!("signing failed: {e}"))?;
    let signature = format!(
        "{}{:02x}",
        hex::encode(sig.to_bytes()),
        27 + recid.to_byte()
    );
    let body = json!({"message": message, "signature": signature});
    let v = call_with(&c, None, "POST", "/v1/auth/verify", Some(body)).await?;
    if as_json {
        print(&v);
        return Ok(());
    }
    eprintln!(
        "account {address} signed in to {namespace} as {}; its access token (for {} s):",
        v["role"].as_str().unwrap_or("wallet"),
        v["expires_in"].as_u64().unwrap_or_default()
    );
    println!("{}", v["access_token"].as_str().unwrap_or_default());
    Ok(())
}

/// `meshgate sub`: one simple socket, in JSON frames whatever `how` prints
/// (a binary frame carries a history topic's offset as 8 leading bytes, and
/// nothing in the frame says whether it does); prints messages until the
/// node closes it. A refused handshake is its status and the node's envelope.
async fn subscribe(c: &ClientArgs, topic: &str, how: Output) -> Result<(), String> {
    use futures_util::{SinkExt as _, StreamExt as _};
    let base = c.url.trim_end_matches('/');
    let ws_base = base
        .strip_prefix("https://")
        .map(|r| format!("wss://{r}"))
        .or_else(|| base.strip_prefix("http://").map(|r| format!("ws://{r}")))
        .ok_or_else(|| format!("not an http(s) URL: {base}"))?;
    let mut url = format!(
        "{ws_base}/v1/pubsub/ws?topic={}&format=json",
        urlencode(topic)
    );
    if let Some(ns) = &c.namespace {
        url.push_str(&format!("&namespace={}", urlencode(ns)));
    }
    let refusal = refusal::Kept::default();
    let client = awc::Client::builder().wrap(refusal.clone()).finish();
    let mut req = client.ws(&url).max_frame_size(64 << 20);
    if let Some(k) = credential(c) {
        req = req.bearer_auth(k);
    }
    let (_, mut socket) = match req.connect().await {
        Ok(connected) => connected,
        Err(awc::error::WsClientError::InvalidResponseStatus(status)) => {
            let body = refusal.take().unwrap_or_default();
            let v: Value = serde_json::from_slice(&body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into()));
            return Err(error_text(status.as_u16(), &v));
        }
        Err(e) => return Err(format!("cannot subscribe at {url}: {e}")),
    };
    // On stderr, so a script can wait for it while stdout carries only data.
    eprintln!("subscribed to {topic}");
    let mut out = std::io::stdout();
    while let Some(frame) = socket.next().await {
        match frame.map_err(|e| e.to_string())? {
            awc::ws::Frame::Text(b) | awc::ws::Frame::Binary(b) => {
                let written = if how == Output::Json {
                    write_line(&mut out, &b)
                } else {
                    let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
                    match message_of(&v) {
                        Ok((offset, data)) => write_message(&mut out, how, offset, &data),
                        // An error frame, or anything else that is no message.
                        Err(_) => {
                            eprintln!("meshgate: {}", printable(&String::from_utf8_lossy(&b)));
                            Ok(())
                        }
                    }
                };
                if written.is_err() {
                    // The reader is gone (a closed pipe).
                    return Ok(());
                }
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

/// `line` and a newline on `out`, flushed.
fn write_line(out: &mut impl std::io::Write, line: &[u8]) -> std::io::Result<()> {
    out.write_all(line)?;
    out.write_all(b"\n")?;
    out.flush()
}

/// The body of a refused WebSocket handshake. awc's `ws().connect()`
/// reports a status other than 101 by the status alone; this layer of its
/// connector reads the answer's body first (the node's JSON envelope:
/// `{"error":{"code","message"}}`), so `sub` can say why.
mod refusal {
    use actix_http::h1::MessageType;
    use actix_service::Service;
    use awc::error::SendRequestError;
    use awc::{ConnectRequest, ConnectResponse};
    use futures_util::StreamExt as _;
    use futures_util::future::LocalBoxFuture;
    use std::cell::RefCell;
    use std::rc::Rc;

    /// The most of a refusal's body kept (an envelope is far smaller).
    const MAX_BODY: usize = 64 << 10;

    /// Where the refusal's body is left, for the caller to take.
    #[derive(Clone, Default)]
    pub struct Kept(Rc<RefCell<Option<Vec<u8>>>>);

    impl Kept {
        /// The body of the last refused handshake, if one was read.
        pub fn take(&self) -> Option<Vec<u8>> {
            self.0.borrow_mut().take()
        }
    }

    impl<S> awc::middleware::Transform<S, ConnectRequest> for Kept
    where
        S: Service<ConnectRequest, Response = ConnectResponse, Error = SendRequestError> + 'static,
    {
        type Transform = KeepBody<S>;

        fn new_transform(self, service: S) -> KeepBody<S> {
            KeepBody {
                service: Rc::new(service),
                kept: self,
            }
        }
    }

    /// The connector with [`Kept`] around it.
    pub struct KeepBody<S> {
        /// awc's connector.
        service: Rc<S>,
        /// Where a refusal's body goes.
        kept: Kept,
    }

    impl<S> Service<ConnectRequest> for KeepBody<S>
    where
        S: Service<ConnectRequest, Response = ConnectResponse, Error = SendRequestError> + 'static,
    {
        type Response = ConnectResponse;
        type Error = SendRequestError;
        type Future = LocalBoxFuture<'static, Result<ConnectResponse, SendRequestError>>;

        actix_service::forward_ready!(service);

        fn call(&self, req: ConnectRequest) -> Self::Future {
            let service = self.service.clone();
            let kept = self.kept.clone();
            Box::pin(async move {
                match service.call(req).await? {
                    ConnectResponse::Tunnel(head, framed)
                        if head.status != awc::http::StatusCode::SWITCHING_PROTOCOLS
                            && framed.codec_ref().message_type() != MessageType::None =>
                    {
                        let mut payload = framed.into_map_codec(|c| c.into_payload_codec());
                        let mut body = Vec::new();
                        while let Some(Ok(Some(chunk))) = payload.next().await {
                            body.extend_from_slice(&chunk);
                            if body.len() >= MAX_BODY {
                                break;
                            }
                        }
                        body.truncate(MAX_BODY);
                        *kept.0.borrow_mut() = Some(body);
                        let framed = payload.into_map_codec(|c| c.into_message_codec());
                        Ok(ConnectResponse::Tunnel(head, framed))
                    }
                    other => Ok(other),
                }
            })
        }
    }
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
    // An answer without the envelope (a proxy's page, say): its first line.
    let msg = v
        .pointer("/error/message")
        .and_then(Value::as_str)
        .or_else(|| v.as_str().and_then(|t| t.trim().lines().next()))
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

    /// A node's error holding terminal escapes (title, clear screen, an
    /// OSC 52 clipboard write) is printed with every control character
    /// escaped; other text, non-ASCII included, as it came.
    #[test]
    fn a_nodes_text_is_printed_without_control_characters() {
        let hostile = "401 X: \u{1b}]0;PWNED\u{7}\u{1b}[2J\u{1b}]52;c;aGk=\u{7}\u{85}é ok";
        let shown = printable(hostile);
        assert!(!shown.chars().any(char::is_control), "{shown:?}");
        assert_eq!(
            shown,
            "401 X: \\u{1b}]0;PWNED\\u{7}\\u{1b}[2J\\u{1b}]52;c;aGk=\\u{7}\\u{85}é ok"
        );
        assert_eq!(printable("403 MISSING_GRANT: no"), "403 MISSING_GRANT: no");
    }

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
