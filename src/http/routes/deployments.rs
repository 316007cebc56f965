//! Deployment routes (docs/design.md §7, §10): create (JSON for an upstream,
//! multipart for a static site), list, show, versions, rollback, delete.

use super::ctx::NsCtx;
use super::form::{Body, Form, json_refusal};
use super::page::{Page, PageQuery};
use crate::deploy::NewDeployment;
use crate::deploy::model::{
    Balance, HealthSpec, MAX_HOSTS, MAX_INSTANCES, MAX_WEIGHT, RouteSpec, TargetSpec,
    normalize_host, normalize_instance, valid_name, validate_balancing, validate_routes,
};
use crate::deploy::site::{SiteDir, SiteLimits, unpack};
use crate::error::Code;
use crate::error::{ApiError, ApiResult};
use crate::http::policy::{Policy, RouteTable};
use crate::http::state::Node;
use actix_multipart::Multipart;
use actix_web::http::Method;
use actix_web::{HttpRequest, HttpResponse, web};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::json;

/// Adds these routes and their policies to the node's route table.
pub fn register(t: &mut RouteTable) {
    t.add(
        Method::POST,
        "/v1/deployments",
        Policy::ns("deployments", "deploy"),
        web::post().to(create),
    )
    .add(
        Method::GET,
        "/v1/deployments",
        Policy::ns("deployments", "read"),
        web::get().to(list),
    )
    .add(
        Method::GET,
        "/v1/deployments/{name}",
        Policy::ns("deployments", "read"),
        web::get().to(show),
    )
    .add(
        Method::DELETE,
        "/v1/deployments/{name}",
        Policy::ns("deployments", "deploy"),
        web::delete().to(delete),
    )
    .add(
        Method::GET,
        "/v1/deployments/{name}/versions",
        Policy::ns("deployments", "read"),
        web::get().to(versions),
    )
    .add(
        Method::GET,
        "/v1/deployments/{name}/activity",
        Policy::ns("deployments", "read"),
        web::get().to(activity),
    )
    .add(
        Method::POST,
        "/v1/deployments/{name}/rollback",
        Policy::ns("deployments", "deploy"),
        web::post().to(rollback),
    )
    .add(
        Method::PUT,
        "/v1/deployments/{name}/certificate",
        Policy::ns("deployments", "deploy"),
        web::put().to(put_certificate),
    )
    .add(
        Method::GET,
        "/v1/deployments/{name}/certificate",
        Policy::ns("deployments", "read"),
        web::get().to(show_certificate),
    )
    .add(
        Method::DELETE,
        "/v1/deployments/{name}/certificate",
        Policy::ns("deployments", "deploy"),
        web::delete().to(delete_certificate),
    );
}

fn bad(code: Code, message: impl Into<String>) -> ApiError {
    ApiError::new(code, message)
}

/// The one answer that carries a deployment (create, show, rollback):
/// `{"ok": true, "deployment": {...}}` (docs/deployments.md "Creating one").
fn deployment_answer(d: impl serde::Serialize) -> serde_json::Value {
    json!({"ok": true, "deployment": d})
}

/// The parts of a static-site deploy (docs/deployments.md "Creating one").
const SITE_FORM: Form = Form {
    route: "POST /v1/deployments",
    required: &["name", "hosts", "tarball"],
    optional: &["routes", "policy", "tls"],
    example: "curl -F name=site -F hosts=site.example.com -F tarball=@site.tar.gz",
};

/// The JSON form of a create (an upstream deployment; a static site comes as multipart).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateJson {
    /// The deployment's name; a new version if it exists.
    name: String,
    /// 1 to [`MAX_HOSTS`] host names, normalized and deduplicated.
    hosts: Vec<String>,
    /// Required: the JSON body only deploys upstreams.
    upstream: Option<UpstreamJson>,
    /// None: one route taking everything.
    #[serde(default)]
    routes: Vec<RouteSpec>,
    /// The routes' default policy: copied into every route without its own.
    #[serde(default)]
    policy: Option<crate::deploy::route_policy::RoutePolicy>,
    /// `"auto"`: certificates by ACME, refused by a node without
    /// `[tls.acme]` ([`check_tls`]).
    #[serde(default)]
    tls: Option<serde_json::Value>,
}

/// A deployment's `tls`: `"auto"` asks for certificates issued by ACME
/// (true); a node without `[tls.acme]` answers 400 `ACME_NOT_CONFIGURED`,
/// nothing stored. Anything else is 400 `INVALID_FIELD`.
fn check_tls(node: &Node, tls: Option<&serde_json::Value>) -> ApiResult<bool> {
    match tls {
        None => Ok(false),
        Some(v) if v == "auto" => {
            if node.config.tls.acme.is_some() {
                Ok(true)
            } else {
                Err(bad(
                    Code::AcmeNotConfigured,
                    "tls \"auto\" needs ACME, and this node has no [tls.acme] configured; upload \
                     the hosts' certificate with PUT /v1/deployments/{name}/certificate instead",
                ))
            }
        }
        Some(v) => Err(bad(
            Code::InvalidField,
            format!("tls {v} is not a TLS mode: the one mode is \"auto\" (ACME), or leave it out"),
        )),
    }
}

impl Body for CreateJson {
    fn takes() -> String {
        format!(
            "a JSON object with the fields {} (an upstream), or a static site as multipart \
             with the parts {} (required) and {} (optional)",
            super::form::struct_fields::<CreateJson>()
                .unwrap_or_default()
                .join(", "),
            SITE_FORM.required.join(", "),
            SITE_FORM.optional.join(", ")
        )
    }
}

/// `upstream` of [`CreateJson`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpstreamJson {
    /// 1 to [`MAX_INSTANCES`] `http(s)://host:port` base URLs, each a
    /// string (weight 1) or `{url, weight}`.
    instances: Vec<InstanceJson>,
    /// `round_robin` (default), `least_request` or `{"hash": {"header": …}}`.
    #[serde(default)]
    balance: Balance,
    /// The active health check.
    #[serde(default)]
    health: Option<HealthSpec>,
    /// Gzip of answers the upstream did not encode: `true` (the default)
    /// or `false`; any other value is 400 `INVALID_UPSTREAM`.
    #[serde(default)]
    compress: Option<serde_json::Value>,
    /// Pass paths the node refuses as ambiguous to the upstream unchanged:
    /// `true` or `false` (the default).
    #[serde(default)]
    pass_ambiguous_paths: Option<serde_json::Value>,
    /// Pass header names with `_`: `true` or `false` (the default).
    #[serde(default)]
    allow_underscore_headers: Option<serde_json::Value>,
    /// gRPC settings: `{"max_timeout_ms": …}`.
    #[serde(default)]
    grpc: Option<crate::deploy::model::GrpcSpec>,
}

/// One of [`UpstreamJson`]'s instances.
#[derive(Deserialize)]
#[serde(untagged)]
enum InstanceJson {
    Url(String),
    Weighted(WeightedJson),
}

/// `{url, weight}` in [`UpstreamJson`]'s instances.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WeightedJson {
    url: String,
    /// Wide so that 0, -1 and 1001 reach the range check (400
    /// `INVALID_UPSTREAM`); 1 when absent.
    #[serde(default = "one")]
    weight: i64,
}

fn one() -> i64 {
    1
}

fn check_name(name: &str) -> ApiResult<()> {
    if valid_name(name) {
        Ok(())
    } else {
        Err(bad(
            Code::InvalidName,
            "a deployment name is 1 to 63 of a-z, 0-9, '-', '_', starting with a letter or digit",
        ))
    }
}

fn check_hosts(raw: &[String]) -> ApiResult<Vec<String>> {
    if raw.is_empty() || raw.len() > MAX_HOSTS {
        return Err(bad(
            Code::InvalidHost,
            format!("a deployment has 1 to {MAX_HOSTS} hosts"),
        ));
    }
    let mut hosts = Vec::new();
    for h in raw {
        let h = normalize_host(h)?;
        if !hosts.contains(&h) {
            hosts.push(h);
        }
    }
    Ok(hosts)
}

async fn create(
    node: web::Data<Node>,
    ctx: NsCtx,
    req: HttpRequest,
    payload: web::Payload,
) -> ApiResult<HttpResponse> {
    let multipart = req
        .headers()
        .get(actix_web::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"));
    // A static site's unpacked files and its unpack slot stay until the
    // deploy is done; dropping them removes the files (on every path).
    let (new, _site) = if multipart {
        let (new, site) = parse_static(&node, Multipart::new(req.headers(), payload)).await?;
        (new, Some(site))
    } else {
        (parse_upstream(&node, payload).await?, None)
    };
    ctx.require("deployments", "deploy", &new.name)?;
    let limits = node.limits(&ctx.name).await?;
    let d = node.deployments.create(&ctx.name, new, &limits).await;
    if d.is_err() && _site.is_some() {
        // Site files stored before the refusal are named by no record.
        node.blob_sweeps.request();
    }
    let d = d?;
    Ok(HttpResponse::Created().json(deployment_answer(d)))
}

async fn parse_upstream(node: &Node, mut payload: web::Payload) -> ApiResult<NewDeployment> {
    let limit = node.config.server.max_body_bytes;
    let mut body = Vec::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| bad(Code::BadBody, e.to_string()))?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::too_large(format!(
                "the body is larger than {limit} bytes"
            )));
        }
        body.extend_from_slice(&chunk);
    }
    let c: CreateJson = serde_json::from_slice(&body).map_err(|e| {
        json_refusal::<CreateJson>(
            Code::InvalidJson,
            "POST /v1/deployments",
            format_args!("the body is not a deployment ({e})"),
        )
    })?;
    check_name(&c.name)?;
    let hosts = check_hosts(&c.hosts)?;
    let tls_auto = check_tls(node, c.tls.as_ref())?;
    let Some(up) = c.upstream else {
        return Err(bad(
            Code::MissingTarget,
            "give `upstream.instances`, or send a static site as multipart with a `tarball` part",
        ));
    };
    if up.instances.is_empty() || up.instances.len() > MAX_INSTANCES {
        return Err(bad(
            Code::InvalidUpstream,
            format!("an upstream has 1 to {MAX_INSTANCES} instances"),
        ));
    }
    let mut instances = Vec::with_capacity(up.instances.len());
    let mut weights = Vec::with_capacity(up.instances.len());
    for i in &up.instances {
        let (url, w) = match i {
            InstanceJson::Url(u) => (u, 1),
            InstanceJson::Weighted(WeightedJson { url, weight }) => (url, *weight),
        };
        instances.push(normalize_instance(url)?);
        if !(1..=i64::from(MAX_WEIGHT)).contains(&w) {
            return Err(bad(
                Code::InvalidUpstream,
                format!("weight {w} of {url} is not within 1..={MAX_WEIGHT}"),
            ));
        }
        weights.push(w as u32);
    }
    validate_balancing(
        instances.len(),
        &mut weights,
        &up.balance,
        up.health.as_ref(),
    )?;
    crate::deploy::health::check_min_interval(&node.deployments.config, up.health.as_ref())?;
    let flag = |field: &str, v: Option<serde_json::Value>, default: bool| match v {
        None => Ok(default),
        Some(serde_json::Value::Bool(b)) => Ok(b),
        Some(other) => Err(bad(
            Code::InvalidUpstream,
            format!("upstream.{field} is true or false, not {other}"),
        )),
    };
    let compress = flag("compress", up.compress, true)?;
    let pass_ambiguous_paths = flag("pass_ambiguous_paths", up.pass_ambiguous_paths, false)?;
    let allow_underscore_headers = flag(
        "allow_underscore_headers",
        up.allow_underscore_headers,
        false,
    )?;
    if let Some(g) = &up.grpc {
        g.validate()?;
    }
    let mut routes = validate_routes(c.routes)?;
    crate::deploy::route_policy::apply_default(&mut routes, c.policy)?;
    Ok(NewDeployment {
        name: c.name,
        hosts,
        routes,
        target: TargetSpec::Upstream {
            instances,
            weights,
            balance: up.balance,
            health: up.health,
            compress,
            pass_ambiguous_paths,
            allow_underscore_headers,
            grpc: up.grpc,
        },
        blobs: Vec::new(),
        tls_auto,
    })
}

/// A static site being deployed: its temporary folder (the upload and the
/// unpacked files) and its unpack slot.
struct StaticUpload {
    /// Removed, with every file in it, when this drops.
    _dir: SiteDir,
    /// One of the node's `unpack_concurrency` slots.
    _slot: tokio::sync::OwnedSemaphorePermit,
}

/// Writes a multipart part to `path` as it arrives, refusing more than
/// `limit` bytes with 413 `SITE_TOO_LARGE`.
async fn save_field(
    field: &mut actix_multipart::Field,
    path: &std::path::Path,
    limit: usize,
) -> ApiResult<()> {
    use tokio::io::AsyncWriteExt;
    let io = |e: std::io::Error| ApiError::internal(format!("cannot write the upload: {e}"));
    let mut file = tokio::fs::File::create(path).await.map_err(io)?;
    let mut size = 0usize;
    while let Some(chunk) = field.next().await {
        let chunk = chunk.map_err(|e| SITE_FORM.malformed(e))?;
        size += chunk.len();
        if size > limit {
            return Err(ApiError::new(
                Code::SiteTooLarge,
                format!("part \"tarball\" is larger than {limit} bytes"),
            ));
        }
        file.write_all(&chunk).await.map_err(io)?;
    }
    file.flush().await.map_err(io)
}

/// Parses the parts of a static-site deploy; the tarball is written to a
/// temporary folder as it arrives, then unpacked there (streaming, one
/// unpack slot of the node held) and checked whole before anything is
/// stored.
async fn parse_static(node: &Node, mut mp: Multipart) -> ApiResult<(NewDeployment, StaticUpload)> {
    let cfg = &node.deployments.config;
    let dir = SiteDir::create(&node.config.server.data_dir)
        .map_err(|e| ApiError::internal(format!("cannot create a temporary site folder: {e}")))?;
    let (mut name, mut hosts, mut tarball, mut routes) = (None, None, None, None);
    let mut policy = None;
    let mut tls_auto = false;
    while let Some(field) = mp.next().await {
        let mut field = field.map_err(|e| SITE_FORM.malformed(e))?;
        let part = field.name().unwrap_or_default().to_string();
        match part.as_str() {
            "tarball" => {
                let upload = dir.upload_path();
                save_field(&mut field, &upload, cfg.max_site_bytes).await?;
                tarball = Some(upload);
            }
            "name" | "hosts" | "routes" | "policy" | "tls" => {
                let text = SITE_FORM.text(
                    SITE_FORM
                        .read_part(&mut field, &part, 64 * 1024, Code::PayloadTooLarge)
                        .await?,
                    &part,
                )?;
                match part.as_str() {
                    "name" => name = Some(text),
                    "hosts" => hosts = Some(text),
                    "tls" => tls_auto = check_tls(node, Some(&serde_json::Value::String(text)))?,
                    "policy" => {
                        policy = Some(
                            serde_json::from_str::<crate::deploy::route_policy::RoutePolicy>(&text)
                                .map_err(|e| bad(Code::InvalidPolicy, e.to_string()))?,
                        )
                    }
                    _ => {
                        routes = Some(
                            serde_json::from_str::<Vec<RouteSpec>>(&text)
                                .map_err(|e| bad(Code::InvalidRoute, e.to_string()))?,
                        )
                    }
                }
            }
            other => return Err(SITE_FORM.unknown_part(other)),
        }
    }
    let name = name.ok_or_else(|| SITE_FORM.missing_part("name"))?;
    check_name(&name)?;
    let hosts: Vec<String> = hosts
        .ok_or_else(|| SITE_FORM.missing_part("hosts"))?
        .split(',')
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .collect();
    let hosts = check_hosts(&hosts)?;
    let tarball = tarball.ok_or_else(|| SITE_FORM.missing_part("tarball"))?;
    let mut routes = validate_routes(routes.unwrap_or_default())?;
    crate::deploy::route_policy::apply_default(&mut routes, policy)?;
    let limits = SiteLimits {
        max_unpacked_bytes: cfg.max_site_unpacked_bytes as u64,
        max_files: cfg.max_site_files,
        max_file_bytes: cfg.max_site_file_bytes as u64,
    };
    let slot = node.deployments.unpack_slot().await?;
    let into = dir.path().to_path_buf();
    let site = web::block(move || {
        let file = std::fs::File::open(&tarball)
            .map_err(|e| ApiError::internal(format!("cannot read the upload: {e}")))?;
        unpack(file, &into, limits)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    let new = NewDeployment {
        name,
        hosts,
        routes,
        target: TargetSpec::Static {
            files: site.files,
            total_bytes: site.total_bytes,
        },
        blobs: site.blobs.into_iter().collect(),
        tls_auto,
    };
    Ok((
        new,
        StaticUpload {
            _dir: dir,
            _slot: slot,
        },
    ))
}

/// `GET /v1/deployments[?limit=&cursor=]`: one page of the deployments, by
/// name, those the caller may read.
async fn list(
    node: web::Data<Node>,
    ctx: NsCtx,
    q: web::Query<PageQuery>,
) -> ApiResult<HttpResponse> {
    let page = Page::parse(&q, "deployments", &ctx.name)?;
    let (mut d, last) = node
        .deployments
        .list(&ctx.name, page.after.as_deref(), page.limit)
        .await?;
    // A credential scoped to some deployments lists only those; the cursor
    // still moves past every record read, so a page may hold fewer.
    d.retain(|v| {
        v.get("name")
            .and_then(|n| n.as_str())
            .is_some_and(|n| ctx.may("deployments", "read", n))
    });
    let next = page.next_cursor(last.as_deref());
    Ok(HttpResponse::Ok().json(json!({"deployments": d, "next_cursor": next})))
}

async fn show(
    node: web::Data<Node>,
    ctx: NsCtx,
    name: web::Path<String>,
) -> ApiResult<HttpResponse> {
    ctx.require("deployments", "read", &name)?;
    let d = node.deployments.show(&ctx.name, &name).await?;
    Ok(HttpResponse::Ok().json(deployment_answer(d)))
}

async fn versions(
    node: web::Data<Node>,
    ctx: NsCtx,
    name: web::Path<String>,
) -> ApiResult<HttpResponse> {
    ctx.require("deployments", "read", &name)?;
    let v = node.deployments.versions(&ctx.name, &name).await?;
    Ok(HttpResponse::Ok().json(json!({"versions": v})))
}

/// `GET /v1/deployments/{name}/activity?limit=N`: the deployment's latest
/// requests on this node, newest first (`crate::deploy::activity`).
async fn activity(
    node: web::Data<Node>,
    ctx: NsCtx,
    name: web::Path<String>,
    query: web::Query<std::collections::HashMap<String, String>>,
) -> ApiResult<HttpResponse> {
    ctx.require("deployments", "read", &name)?;
    let limit = crate::observe::parse_limit(query.get("limit").map(String::as_str))
        .map_err(|m| bad(Code::InvalidLimit, m))?;
    // A deployment that does not exist is 404, as for `GET /v1/deployments/{name}`.
    node.deployments.show(&ctx.name, &name).await?;
    let requests = node.metrics.route_activity.latest(&ctx.name, &name, limit);
    Ok(HttpResponse::Ok().json(json!({"requests": requests})))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RollbackBody {
    /// The kept version to serve; None (or no body): the one before the active.
    version: Option<u64>,
}

impl Body for RollbackBody {}

async fn rollback(
    node: web::Data<Node>,
    ctx: NsCtx,
    name: web::Path<String>,
    body: web::Bytes,
) -> ApiResult<HttpResponse> {
    ctx.require("deployments", "deploy", &name)?;
    let to = if body.iter().all(u8::is_ascii_whitespace) {
        None
    } else {
        serde_json::from_slice::<RollbackBody>(&body)
            .map_err(|e| {
                json_refusal::<RollbackBody>(
                    Code::InvalidJson,
                    "POST /v1/deployments/{name}/rollback",
                    e,
                )
            })?
            .version
    };
    let d = node.deployments.rollback(&ctx.name, &name, to).await?;
    Ok(HttpResponse::Ok().json(deployment_answer(d)))
}

async fn delete(
    node: web::Data<Node>,
    ctx: NsCtx,
    name: web::Path<String>,
) -> ApiResult<HttpResponse> {
    ctx.require("deployments", "deploy", &name)?;
    node.deployments.delete(&ctx.name, &name).await?;
    // Its site files go once no other record names them.
    node.blob_sweeps.request();
    node.metrics.route_activity.forget(&ctx.name, &name);
    Ok(HttpResponse::Ok().json(json!({"ok": true, "deleted": name.into_inner()})))
}

/// The parts of a certificate upload (docs/deployments.md "Certificates").
const CERT_FORM: Form = Form {
    route: "PUT /v1/deployments/{name}/certificate",
    required: &["cert", "key"],
    optional: &[],
    example: "curl -X PUT -F cert=@fullchain.pem -F key=@key.pem",
};

/// The JSON form of a certificate upload.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CertJson {
    /// The PEM chain, leaf first.
    cert_pem: String,
    /// The PEM private key of the leaf.
    key_pem: String,
}

impl Body for CertJson {}

/// `PUT /v1/deployments/{name}/certificate`: multipart (`cert`, `key`) or
/// JSON (`cert_pem`, `key_pem`); checked whole before anything is stored.
async fn put_certificate(
    node: web::Data<Node>,
    ctx: NsCtx,
    name: web::Path<String>,
    req: HttpRequest,
    mut payload: web::Payload,
) -> ApiResult<HttpResponse> {
    use crate::deploy::certs::{MAX_CHAIN_BYTES, MAX_KEY_BYTES};
    ctx.require("deployments", "deploy", &name)?;
    let multipart = req
        .headers()
        .get(actix_web::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"));
    let (cert, key) = if multipart {
        let mut mp = Multipart::new(req.headers(), payload);
        let (mut cert, mut key) = (None, None);
        while let Some(field) = mp.next().await {
            let mut field = field.map_err(|e| CERT_FORM.malformed(e))?;
            let part = field.name().unwrap_or_default().to_string();
            match part.as_str() {
                "cert" => {
                    cert = Some(
                        CERT_FORM
                            .read_part(&mut field, &part, MAX_CHAIN_BYTES, Code::PayloadTooLarge)
                            .await?,
                    )
                }
                "key" => {
                    key = Some(
                        CERT_FORM
                            .read_part(&mut field, &part, MAX_KEY_BYTES, Code::PayloadTooLarge)
                            .await?,
                    )
                }
                other => return Err(CERT_FORM.unknown_part(other)),
            }
        }
        (
            cert.ok_or_else(|| CERT_FORM.missing_part("cert"))?,
            key.ok_or_else(|| CERT_FORM.missing_part("key"))?,
        )
    } else {
        let limit = MAX_CHAIN_BYTES + MAX_KEY_BYTES + 1024;
        let mut body = Vec::new();
        while let Some(chunk) = payload.next().await {
            let chunk = chunk.map_err(|e| bad(Code::BadBody, e.to_string()))?;
            if body.len() + chunk.len() > limit {
                return Err(bad(
                    Code::PayloadTooLarge,
                    format!("the body is larger than {limit} bytes"),
                ));
            }
            body.extend_from_slice(&chunk);
        }
        let c = serde_json::from_slice::<CertJson>(&body).map_err(|e| {
            json_refusal::<CertJson>(
                Code::InvalidJson,
                "PUT /v1/deployments/{name}/certificate",
                e,
            )
        })?;
        (c.cert_pem.into_bytes(), c.key_pem.into_bytes())
    };
    let c = node
        .deployments
        .put_certificate(&ctx.name, &name, &cert, &key)
        .await?;
    Ok(HttpResponse::Ok().json(json!({"ok": true, "certificate": c})))
}

/// `GET /v1/deployments/{name}/certificate`: names, issuer, validity and
/// state; never the key.
async fn show_certificate(
    node: web::Data<Node>,
    ctx: NsCtx,
    name: web::Path<String>,
) -> ApiResult<HttpResponse> {
    ctx.require("deployments", "read", &name)?;
    let c = node.deployments.certificate(&ctx.name, &name).await?;
    Ok(HttpResponse::Ok().json(json!({"ok": true, "certificate": c})))
}

/// `DELETE /v1/deployments/{name}/certificate`: its hosts get the node's pair.
async fn delete_certificate(
    node: web::Data<Node>,
    ctx: NsCtx,
    name: web::Path<String>,
) -> ApiResult<HttpResponse> {
    ctx.require("deployments", "deploy", &name)?;
    node.deployments
        .delete_certificate(&ctx.name, &name)
        .await?;
    Ok(HttpResponse::Ok()
        .json(json!({"ok": true, "deleted": "certificate", "deployment": name.into_inner()})))
}
