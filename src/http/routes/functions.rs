//! Functions (docs/design.md §4): deploy (multipart), list, show, versions, delete,
//! invoke, logs, secrets, and the by-namespace invoke route that a public
//! function answers without a credential. Every call goes through the target
//! namespace's supervisor, which owns the namespace's invoker.

use super::ctx::NsCtx;
use super::form::{Body, Form, Json};
use super::page::{Page, PageQuery};
use crate::actors::{CallerInfo, DeployRequest, MAX_LOGS, Reply, Trigger};
use crate::actors::{
    DeleteFunction, DeleteSecret, DeployFunction, FunctionLogs, FunctionVersions, ListFunctions,
    ListSecrets, PrepareInvoke, PutSecret, ShowFunction,
};
use crate::error::Code;
use crate::error::{ApiError, ApiResult};
use crate::functions::{FunctionMetadata, valid_function_name};
use crate::http::chain::context::{RequestId, valid_namespace_name};
use crate::http::chain::logger::fresh_request_id;
use crate::http::policy::{Policy, RouteTable};
use crate::http::request::read_limited;
use crate::http::state::Node;
use crate::identity::Identity;
use crate::wasm::MAX_INPUT_BYTES;
use actix_multipart::Multipart;
use actix_web::http::Method;
use actix_web::http::header::HeaderName;
use actix_web::{HttpMessage, HttpRequest, HttpResponse, web};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::json;

/// Largest non-module part of a deploy (`name`, limits, `metadata`).
const MAX_FIELD_BYTES: usize = 64 * 1024;
/// Names that would shadow a route.
const RESERVED_NAMES: &[&str] = &["secrets"];

pub fn register(t: &mut RouteTable) {
    t.add(
        Method::POST,
        "/v1/functions",
        Policy::ns("functions", "deploy"),
        web::post().to(deploy),
    )
    .add(
        Method::GET,
        "/v1/functions",
        Policy::ns("functions", "read"),
        web::get().to(list),
    )
    .add(
        Method::PUT,
        "/v1/functions/secrets",
        Policy::ns("functions", "write"),
        web::put().to(put_secret),
    )
    .add(
        Method::GET,
        "/v1/functions/secrets",
        Policy::ns("functions", "read"),
        web::get().to(list_secrets),
    )
    .add(
        Method::DELETE,
        "/v1/functions/secrets/{key}",
        Policy::ns("functions", "write"),
        web::delete().to(delete_secret),
    )
    .add(
        Method::GET,
        "/v1/functions/{name}",
        Policy::ns("functions", "read"),
        web::get().to(show),
    )
    .add(
        Method::DELETE,
        "/v1/functions/{name}",
        Policy::ns("functions", "deploy"),
        web::delete().to(delete),
    )
    .add(
        Method::GET,
        "/v1/functions/{name}/versions",
        Policy::ns("functions", "read"),
        web::get().to(versions),
    )
    .add(
        Method::POST,
        "/v1/functions/{name}/invoke",
        Policy::ns("functions", "invoke"),
        web::post().to(invoke),
    )
    .add(
        Method::GET,
        "/v1/functions/{name}/logs",
        Policy::ns("functions", "read"),
        web::get().to(logs),
    )
    .add(
        Method::POST,
        "/v1/invoke/{namespace}/{name}",
        Policy::NsOrAnonymous {
            domain: "functions",
            action: "invoke",
        },
        web::post().to(invoke_by_namespace),
    );
}

fn bad(code: Code, message: impl Into<String>) -> ApiError {
    ApiError::new(code, message)
}

/// The parts of a function deploy (docs/design.md §4).
const DEPLOY_FORM: Form = Form {
    route: "POST /v1/functions",
    required: &["name", "wasm"],
    optional: &[
        "memory_limit_mb",
        "timeout_seconds",
        "is_public",
        "metadata",
    ],
    example: "curl -F name=echo -F wasm=@echo.wasm",
};

fn parse_range(text: &str, part: &str, lo: u32, hi: u32) -> ApiResult<u32> {
    match text.parse::<u32>() {
        Ok(v) if (lo..=hi).contains(&v) => Ok(v),
        _ => Err(bad(
            Code::InvalidLimit,
            format!("{part} must be an integer from {lo} to {hi}, got {text:?}"),
        )),
    }
}

/// Parses and checks every part of a deploy; nothing is stored here.
async fn parse_deploy(mut mp: Multipart, max_module: usize) -> ApiResult<DeployRequest> {
    let (mut wasm, mut name, mut mem, mut timeout, mut public, mut meta) =
        (None, None, None, None, None, None);
    while let Some(field) = mp.next().await {
        let mut field = field.map_err(|e| DEPLOY_FORM.malformed(e))?;
        let part = field.name().unwrap_or_default().to_string();
        match part.as_str() {
            "wasm" => {
                wasm = Some(
                    DEPLOY_FORM
                        .read_part(&mut field, &part, max_module, Code::ModuleTooLarge)
                        .await?,
                )
            }
            "name" | "memory_limit_mb" | "timeout_seconds" | "is_public" | "metadata" => {
                let text = DEPLOY_FORM.text(
                    DEPLOY_FORM
                        .read_part(&mut field, &part, MAX_FIELD_BYTES, Code::PayloadTooLarge)
                        .await?,
                    &part,
                )?;
                match part.as_str() {
                    "name" => name = Some(text),
                    "memory_limit_mb" => {
                        let (lo, hi) = crate::functions::MEMORY_MB_RANGE;
                        mem = Some(parse_range(&text, &part, lo, hi)?)
                    }
                    "timeout_seconds" => {
                        let (lo, hi) = crate::functions::TIMEOUT_RANGE;
                        timeout = Some(parse_range(&text, &part, lo, hi)?)
                    }
                    "is_public" => {
                        public = Some(match text.as_str() {
                            "true" | "1" | "yes" => true,
                            "false" | "0" | "no" | "" => false,
                            _ => {
                                return Err(bad(
                                    Code::InvalidField,
                                    "is_public must be true or false",
                                ));
                            }
                        })
                    }
                    _ => {
                        meta = Some(
                            serde_json::from_str::<FunctionMetadata>(&text)
                                .map_err(|e| bad(Code::InvalidMetadata, e.to_string()))?,
                        )
                    }
                }
            }
            other => return Err(DEPLOY_FORM.unknown_part(other)),
        }
    }
    let name = name.ok_or_else(|| DEPLOY_FORM.missing_part("name"))?;
    if !valid_function_name(&name) || RESERVED_NAMES.contains(&name.as_str()) {
        return Err(bad(
            Code::InvalidName,
            "a function name is 1 to 63 of a-z, 0-9, '-', '_', starting with a letter or digit",
        ));
    }
    let wasm = wasm.ok_or_else(|| DEPLOY_FORM.missing_part("wasm"))?;
    if wasm.is_empty() {
        return Err(bad(Code::InvalidModule, "the `wasm` part is empty"));
    }
    let (env_vars, pubsub_topics, cron) = meta.unwrap_or_default().validate()?;
    Ok(DeployRequest {
        name,
        wasm,
        memory_limit_mb: mem.unwrap_or(crate::functions::DEFAULT_MEMORY_MB),
        timeout_seconds: timeout.unwrap_or(crate::functions::DEFAULT_TIMEOUT_SECONDS),
        is_public: public.unwrap_or(false),
        env_vars,
        pubsub_topics,
        cron,
    })
}

async fn deploy(node: web::Data<Node>, ctx: NsCtx, mp: Multipart) -> ApiResult<HttpResponse> {
    let req = parse_deploy(mp, node.config.functions.max_module_bytes).await?;
    ctx.require("functions", "deploy", &req.name)?;
    // Validate and compile before anything is written.
    let module = node.functions.compile(&ctx.name, req.wasm.clone()).await?;
    let deployed = ctx.handle.ask(DeployFunction { req, module }).await?;
    // An evicted version's module, or the module of a refused deploy, may
    // be named by no record now.
    node.blob_sweeps.request();
    let deployed = deployed?;
    Ok(HttpResponse::Created().json(json!({"ok": true, "function": deployed})))
}

/// `GET /v1/functions[?limit=&cursor=]`: one page of the functions, by
/// name, those the caller may read.
async fn list(ctx: NsCtx, q: web::Query<PageQuery>) -> ApiResult<HttpResponse> {
    let page = Page::parse(&q, "functions", &ctx.name)?;
    let (mut functions, last) = ctx
        .handle
        .ask(ListFunctions {
            after: page.after.clone(),
            limit: page.limit,
        })
        .await??;
    // A credential scoped to some functions lists only those; the cursor
    // still moves past every record read, so a page may hold fewer.
    functions.retain(|f| ctx.may("functions", "read", &f.name));
    let next = page.next_cursor(last.as_deref());
    Ok(HttpResponse::Ok().json(json!({"functions": functions, "next_cursor": next})))
}

async fn show(ctx: NsCtx, name: web::Path<String>) -> ApiResult<HttpResponse> {
    ctx.require("functions", "read", &name)?;
    let v = ctx
        .handle
        .ask(ShowFunction {
            name: name.into_inner(),
        })
        .await??;
    Ok(HttpResponse::Ok().json(v))
}

async fn versions(ctx: NsCtx, name: web::Path<String>) -> ApiResult<HttpResponse> {
    ctx.require("functions", "read", &name)?;
    let v = ctx
        .handle
        .ask(FunctionVersions {
            name: name.into_inner(),
        })
        .await??;
    Ok(HttpResponse::Ok().json(json!({"versions": v})))
}

async fn delete(
    node: web::Data<Node>,
    ctx: NsCtx,
    name: web::Path<String>,
) -> ApiResult<HttpResponse> {
    ctx.require("functions", "deploy", &name)?;
    ctx.handle
        .ask(DeleteFunction {
            name: name.into_inner(),
        })
        .await??;
    // Its modules go once no other record names them.
    node.blob_sweeps.request();
    Ok(HttpResponse::Ok().json(json!({"ok": true})))
}

#[derive(Deserialize)]
struct LogsQuery {
    /// Most records wanted, newest first; absent means `MAX_LOGS`, clamped to 1..=`MAX_LOGS`.
    #[serde(default)]
    limit: Option<usize>,
    /// Consumed by the authorization step (operators naming a namespace).
    #[serde(default, rename = "namespace")]
    _namespace: Option<String>,
}

async fn logs(
    ctx: NsCtx,
    name: web::Path<String>,
    q: web::Query<LogsQuery>,
) -> ApiResult<HttpResponse> {
    ctx.require("functions", "read", &name)?;
    let records = ctx
        .handle
        .ask(FunctionLogs {
            name: name.into_inner(),
            limit: q.limit.unwrap_or(MAX_LOGS),
        })
        .await??;
    Ok(HttpResponse::Ok().json(json!({"logs": records})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SecretBody {
    /// The secret's name (checked by the invoker), also the resource the grant must cover.
    key: String,
    /// The secret's value, sealed before it is stored; never returned by the API.
    value: String,
}

impl Body for SecretBody {}

async fn put_secret(ctx: NsCtx, body: Json<SecretBody>) -> ApiResult<HttpResponse> {
    let b = body.into_inner();
    ctx.require("functions", "write", &b.key)?;
    ctx.handle
        .ask(PutSecret {
            key: b.key,
            value: b.value,
        })
        .await??;
    Ok(HttpResponse::Ok().json(json!({"ok": true})))
}

async fn list_secrets(ctx: NsCtx) -> ApiResult<HttpResponse> {
    let names = ctx.handle.ask(ListSecrets).await??;
    Ok(HttpResponse::Ok().json(json!({"secrets": names})))
}

async fn delete_secret(ctx: NsCtx, key: web::Path<String>) -> ApiResult<HttpResponse> {
    ctx.require("functions", "write", &key)?;
    ctx.handle
        .ask(DeleteSecret {
            key: key.into_inner(),
        })
        .await??;
    Ok(HttpResponse::Ok().json(json!({"ok": true})))
}

/// `name` or `name@version`.
fn split_version(target: &str) -> ApiResult<(String, Option<u64>)> {
    match target.split_once('@') {
        None => Ok((target.to_string(), None)),
        Some((name, v)) => match v.parse::<u64>() {
            Ok(v) => Ok((name.to_string(), Some(v))),
            Err(_) => Err(bad(
                Code::BadVersion,
                format!("version {v:?} is not a number"),
            )),
        },
    }
}

/// Reads the raw body, the guest's input: the HTTP invoke paths' check of
/// the engine's input limit, as the bytes are read (413 `PAYLOAD_TOO_LARGE`
/// above it, before reading when the Content-Length says so).
/// `PrepareInvoke` and the invoker take the input as read.
async fn read_input(req: &HttpRequest, payload: web::Payload) -> ApiResult<Vec<u8>> {
    let body = read_limited(req.headers(), payload, MAX_INPUT_BYTES).await?;
    Ok(body.into())
}

/// The chain's request id (the logger sets it on every request), else a
/// fresh one of the same kind.
fn request_id(req: &HttpRequest) -> String {
    req.extensions()
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_else(fresh_request_id)
}

// Built once: a name given as `&str` is parsed and copied on every answer.
const X_DURATION_MS: HeaderName = HeaderName::from_static("x-duration-ms");
const X_FUNCTION_VERSION: HeaderName = HeaderName::from_static("x-function-version");

/// The guest's stdout, typed JSON when it parses as JSON.
pub fn reply(r: Reply) -> HttpResponse {
    let is_json = serde_json::from_slice::<serde::de::IgnoredAny>(&r.output).is_ok();
    HttpResponse::Ok()
        .content_type(if is_json {
            "application/json"
        } else {
            "application/octet-stream"
        })
        .insert_header((X_DURATION_MS, r.duration.as_millis() as u64))
        .insert_header((X_FUNCTION_VERSION, r.version))
        // `X-Request-ID` is set by the chain's request log, as on every answer.
        .body(r.output)
}

/// The invocation's namespace and function on the request's SERVER span,
/// when spans are exported.
fn note_span(req: &HttpRequest, namespace: &str, function: &str) {
    if let Some(s) = crate::telemetry::ServerSpan::of(&req.extensions()) {
        s.attribute("meshgate.namespace", namespace.to_string());
        s.attribute("meshgate.function", function.to_string());
    }
}

pub(crate) async fn invoke(
    req: HttpRequest,
    ctx: NsCtx,
    target: web::Path<String>,
    payload: web::Payload,
) -> ApiResult<HttpResponse> {
    let (name, version) = split_version(&target)?;
    note_span(&req, &ctx.name, &name);
    ctx.require("functions", "invoke", &name)?;
    let input = read_input(&req, payload).await?;
    let caller = CallerInfo {
        subject: ctx.identity.as_ref().map(|i| i.subject.clone()),
        request_id: request_id(&req),
        trace: req
            .extensions()
            .get::<crate::observe::trace::TraceContext>()
            .cloned(),
    };
    let prepared = ctx
        .handle
        .prepare(PrepareInvoke {
            name,
            version,
            input,
            caller,
            trigger: Trigger::Http,
        })
        .await?;
    Ok(reply(prepared.run().await?))
}

/// `POST /v1/invoke/{namespace}/{name}`: a credential of that namespace (or
/// the operator) with `functions:invoke` may call any of its functions; anyone
/// else only a function deployed public.
async fn invoke_by_namespace(
    req: HttpRequest,
    node: web::Data<Node>,
    path: web::Path<(String, String)>,
    payload: web::Payload,
) -> ApiResult<HttpResponse> {
    let (ns, target) = path.into_inner();
    if !valid_namespace_name(&ns) {
        return Err(ApiError::new(
            Code::NamespaceNotFound,
            "namespace not found",
        ));
    }
    let (name, version) = split_version(&target)?;
    note_span(&req, &ns, &name);
    let identity = req.extensions().get::<Identity>().cloned();
    let member = match &identity {
        Some(i) if i.operator => true,
        Some(i) if i.namespace.as_deref() == Some(ns.as_str()) => {
            if !i.allows("functions", "invoke", &name) {
                return Err(ApiError::new(
                    Code::MissingGrant,
                    format!("the credential lacks functions:invoke:{name}"),
                ));
            }
            true
        }
        _ => false,
    };
    let input = read_input(&req, payload).await?;
    let handle = node.locate(&ns).await?;
    let refusal = || match &identity {
        None => ApiError::new(
            Code::MissingCredential,
            "this function is not public; it needs a credential of its namespace",
        ),
        Some(_) => ApiError::new(
            Code::NamespaceMismatch,
            "the credential belongs to another namespace and the function is not public",
        ),
    };
    // Refused from the function record before anything is resolved: an
    // outside caller must not make the node read or compile a private
    // module.
    if !member && !handle.is_public(&name).await? {
        return Err(refusal());
    }
    let caller = CallerInfo {
        subject: identity.as_ref().map(|i| i.subject.clone()),
        request_id: request_id(&req),
        trace: req
            .extensions()
            .get::<crate::observe::trace::TraceContext>()
            .cloned(),
    };
    let prepared = handle
        .prepare(PrepareInvoke {
            name,
            version,
            input,
            caller,
            trigger: Trigger::Public,
        })
        .await?;
    // Checked again on what was resolved: a deploy may have made it private
    // in between.
    if !member && !prepared.is_public {
        return Err(refusal());
    }
    Ok(reply(prepared.run().await?))
}

#[cfg(test)]
mod multipart_tests {
    //! Property tests of the function deploy's multipart parsing (actix's
    //! parser and [`parse_deploy`] over it): generated bodies, well formed or
    //! cut, garbled, without a boundary or a disposition, with parts over
    //! their limits, read in chunks of any size, never panic; a refusal
    //! carries one of the documented codes; what parses is what was sent,
    //! within the limits.
    use super::*;
    use bytes::Bytes;
    use proptest::prelude::*;

    /// The codes a function deploy's parts are refused with (docs/functions.md).
    const CODES: &[&str] = &[
        "MALFORMED_MULTIPART",
        "MODULE_TOO_LARGE",
        "PAYLOAD_TOO_LARGE",
        "UNKNOWN_PART",
        "MISSING_PART",
        "INVALID_NAME",
        "INVALID_MODULE",
        "INVALID_LIMIT",
        "INVALID_FIELD",
        "INVALID_METADATA",
    ];

    #[derive(Debug, Clone)]
    struct Part {
        name: &'static str,
        /// Whether the part has its Content-Disposition header.
        disposition: bool,
        content: Vec<u8>,
    }

    fn part() -> impl Strategy<Value = Part> {
        let text = |vs: &'static [&'static str]| {
            proptest::sample::select(vs).prop_map(|s| s.as_bytes().to_vec())
        };
        (
            prop_oneof![
                4 => (Just("wasm"), proptest::collection::vec(any::<u8>(), 0..80)),
                2 => (Just("name"), text(&["fn-1", " a ", "Bad Name", "", "secrets", "é"])),
                1 => (Just("memory_limit_mb"), text(&["128", "0", "abc", "99999"])),
                1 => (Just("timeout_seconds"), text(&["5", "0", "x"])),
                1 => (Just("is_public"), text(&["true", "no", "maybe", ""])),
                1 => (Just("metadata"), text(&["{}", "{\"env_vars\":{\"A\":\"b\"}}", "not json", "{\"cron\":7}"])),
                1 => (Just("bogus"), text(&["x"])),
                1 => (Just("name"), proptest::collection::vec(any::<u8>(), 0..8)),
            ],
            proptest::bool::weighted(0.95),
        )
            .prop_map(|((name, content), disposition)| Part {
                name,
                disposition,
                content,
            })
    }

    fn body(boundary: &str, parts: &[Part], closed: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for p in parts {
            out.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
            if p.disposition {
                out.extend_from_slice(
                    format!("Content-Disposition: form-data; name=\"{}\"\r\n", p.name).as_bytes(),
                );
            }
            out.extend_from_slice(b"Content-Type: application/octet-stream\r\n\r\n");
            out.extend_from_slice(&p.content);
            out.extend_from_slice(b"\r\n");
        }
        if closed {
            out.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        }
        out
    }

    thread_local! {
        static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
    }

    fn parse(
        ct: &str,
        bytes: Vec<u8>,
        chunk: usize,
        max_module: usize,
    ) -> ApiResult<DeployRequest> {
        let mut headers = actix_web::http::header::HeaderMap::new();
        headers.insert(
            actix_web::http::header::CONTENT_TYPE,
            actix_web::http::header::HeaderValue::from_str(ct).unwrap(),
        );
        let chunks: Vec<Result<Bytes, actix_web::error::PayloadError>> = bytes
            .chunks(chunk)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let mp = Multipart::new(&headers, futures_util::stream::iter(chunks));
        RT.with(|rt| rt.block_on(parse_deploy(mp, max_module)))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        #[test]
        fn deploy_bodies_parse_or_are_refused_with_a_documented_code(
            boundary in "[A-Za-z0-9_-]{8,40}",
            parts in proptest::collection::vec(part(), 0..6),
            closed in proptest::bool::weighted(0.9),
            cut in proptest::option::weighted(0.1, any::<usize>()),
            garble in proptest::option::weighted(0.1, (any::<usize>(), any::<u8>())),
            ct in prop_oneof![
                8 => Just("multipart/form-data; boundary={b}"),
                1 => Just("multipart/form-data; boundary=\"{b}\""),
                1 => Just("multipart/form-data"),
                1 => Just("text/plain; boundary={b}"),
            ],
            chunk in 1usize..200,
            max_module in 1usize..64,
            valid_tail in any::<bool>(),
        ) {
            // Half the bodies end in a valid name and module (the last of a part counts).
            let mut parts = parts;
            if valid_tail {
                for (name, content) in [("name", b"fn-1".to_vec()), ("wasm", vec![7; max_module.min(9)])] {
                    parts.push(Part { name, disposition: true, content });
                }
            }
            let mut bytes = body(&boundary, &parts, closed);
            if let Some(c) = cut {
                bytes.truncate(c % (bytes.len() + 1));
            }
            if let Some((at, b)) = garble
                && !bytes.is_empty()
            {
                let n = bytes.len();
                bytes[at % n] = b;
            }
            let whole = cut.is_none() && garble.is_none();
            match parse(&ct.replace("{b}", &boundary), bytes, chunk, max_module) {
                Err(e) => prop_assert!(CODES.contains(&e.code.as_str()), "{e:?}"),
                Ok(req) => {
                    // What parsed is what was sent (the last of each part), within the limits.
                    let last = |n: &str| parts.iter().rev().find(|p| p.name == n && p.disposition);
                    prop_assert!(req.wasm.len() <= max_module && !req.wasm.is_empty());
                    if whole {
                        prop_assert_eq!(&req.wasm, &last("wasm").unwrap().content);
                        let name = String::from_utf8(last("name").unwrap().content.clone()).unwrap();
                        prop_assert_eq!(req.name, name.trim());
                        prop_assert!(parts.iter().all(|p| p.name != "bogus"));
                    }
                }
            }
        }
    }

    /// A part over its limit is refused as soon as it passes it, with its code.
    #[test]
    fn parts_over_their_limits_are_refused() {
        let big = Part {
            name: "metadata",
            disposition: true,
            content: vec![b' '; MAX_FIELD_BYTES + 1],
        };
        let e = parse(
            "multipart/form-data; boundary=abcdefgh",
            body("abcdefgh", &[big], true),
            4096,
            64,
        )
        .err()
        .unwrap();
        assert_eq!(e.code.as_str(), "PAYLOAD_TOO_LARGE");
        let wasm = Part {
            name: "wasm",
            disposition: true,
            content: vec![0; 65],
        };
        let e = parse(
            "multipart/form-data; boundary=abcdefgh",
            body("abcdefgh", &[wasm], true),
            7,
            64,
        )
        .err()
        .unwrap();
        assert_eq!(e.code.as_str(), "MODULE_TOO_LARGE");
    }
}
