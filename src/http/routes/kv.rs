//! The namespace KV (`/v1/kv`) and whole-namespace export and import
//! (`/v1/db/*`), handled by the namespace's supervisor.

use super::ctx::NsCtx;
use super::page::{Page, PageQuery};
use crate::actors::{
    Export, ExportEntry, Import, KvDelete, KvGet, KvList, KvPut, MAX_KV_KEY, MAX_KV_LIST,
    NamespaceExport,
};
use crate::deploy::transfer::ExportedDeployment;
use crate::error::Code;
use crate::error::{ApiError, ApiResult};
use crate::functions::{
    EXPORT_SEAL_V1, EXPORT_SEAL_V2, ExportBox, ExportedFunction, FunctionRecord, SecretBox,
    VersionMeta, blob_key, fn_prefix, fnver_prefix, kv_prefix, secret_key, secret_prefix,
};
use crate::http::policy::{Policy, RouteTable};
use crate::http::state::Node;
use crate::pubsub::history::ExportedTopic;
use crate::quota::{Group, Resource, Usage, usage_key};
use crate::storage::{BatchOp, OrderedKv};
use actix_web::http::Method;
use actix_web::{HttpResponse, web};
use base64::Engine;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};

/// Longest KV key, in bytes: keys travel in URLs and in every listing.
pub const MAX_KV_KEY_BYTES: usize = 1024;

/// Refuses a key over [`MAX_KV_KEY_BYTES`] before it reaches the store.
fn key_checked(key: web::Path<String>) -> ApiResult<String> {
    let key = key.into_inner();
    if key.len() > MAX_KV_KEY_BYTES {
        return Err(ApiError::new(
            Code::KeyTooLong,
            format!("the key is {} bytes; at most {MAX_KV_KEY_BYTES}", key.len()),
        ));
    }
    Ok(key)
}

pub fn register(t: &mut RouteTable) {
    t.add(
        Method::GET,
        "/v1/kv/{key:.+}",
        Policy::ns("kv", "read"),
        web::get().to(get),
    )
    .add(
        Method::PUT,
        "/v1/kv/{key:.+}",
        Policy::ns("kv", "write"),
        web::put().to(put),
    )
    .add(
        Method::DELETE,
        "/v1/kv/{key:.+}",
        Policy::ns("kv", "write"),
        web::delete().to(delete),
    )
    .add(
        Method::GET,
        "/v1/kv",
        Policy::ns("kv", "read"),
        web::get().to(list),
    )
    .add(
        Method::GET,
        "/v1/db/export",
        Policy::ns("db", "admin"),
        web::get().to(export),
    )
    .add(
        Method::PUT,
        "/v1/db/import",
        Policy::ns("db", "admin"),
        web::put().to(import),
    );
}

/// A read runs here, not in the supervisor (see [`KvGet::run`]); it still
/// counts as a message the namespace handled.
pub(crate) async fn get(
    ctx: NsCtx,
    node: web::Data<Node>,
    key: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let key = key_checked(key)?;
    ctx.require("kv", "read", &key)?;
    let _t = ctx.handle.stats.timer();
    match (KvGet { key }).run(&node.store, &ctx.name).await? {
        Some(v) => Ok(HttpResponse::Ok()
            .content_type("application/octet-stream")
            .body(v)),
        None => Err(ApiError::new(Code::KeyNotFound, "no such key")),
    }
}

async fn put(ctx: NsCtx, key: web::Path<String>, body: web::Bytes) -> ApiResult<HttpResponse> {
    let key = key_checked(key)?;
    ctx.require("kv", "write", &key)?;
    ctx.handle
        .ask(KvPut {
            key,
            value: body.to_vec(),
        })
        .await??;
    Ok(HttpResponse::Ok().json(json!({"ok": true})))
}

async fn delete(ctx: NsCtx, key: web::Path<String>) -> ApiResult<HttpResponse> {
    let key = key_checked(key)?;
    ctx.require("kv", "write", &key)?;
    let existed = ctx.handle.ask(KvDelete { key }).await??;
    if !existed {
        return Err(ApiError::new(Code::KeyNotFound, "no such key"));
    }
    Ok(HttpResponse::Ok().json(json!({"ok": true})))
}

#[derive(Deserialize)]
struct ListQuery {
    /// List only keys starting with this (default empty: all); also the authorized scope.
    #[serde(default)]
    prefix: String,
    /// Keys on the page: 1 to `MAX_PAGE`, default `DEFAULT_PAGE` (`page.rs`).
    #[serde(default)]
    limit: Option<String>,
    /// The `next_cursor` of the page before (`page.rs`).
    #[serde(default)]
    cursor: Option<String>,
    /// Consumed by the authorization step (operators naming a namespace).
    #[serde(default, rename = "namespace")]
    _namespace: Option<String>,
}

/// `GET /v1/kv[?prefix=&limit=&cursor=]`: one page of the keys, in order.
async fn list(ctx: NsCtx, q: web::Query<ListQuery>) -> ApiResult<HttpResponse> {
    let q = q.into_inner();
    ctx.require("kv", "read", &format!("{}*", q.prefix))?;
    let page = Page::parse(
        &PageQuery {
            limit: q.limit,
            cursor: q.cursor,
        },
        "kv",
        &ctx.name,
    )?;
    // A cursor resumes inside the prefix it was made for.
    if let Some(a) = &page.after
        && !a.starts_with(q.prefix.as_bytes())
    {
        return Err(ApiError::new(
            Code::InvalidCursor,
            "the cursor belongs to a listing of another prefix: pass the same prefix as for the page before",
        ));
    }
    let (keys, last) = ctx
        .handle
        .ask(KvList {
            prefix: q.prefix,
            after: page.after.clone(),
            limit: page.limit.min(MAX_KV_LIST),
        })
        .await??;
    let next = page.next_cursor(last.as_deref());
    Ok(HttpResponse::Ok().json(json!({"keys": keys, "next_cursor": next})))
}

/// `format` of a whole-namespace export.
pub const EXPORT_FORMAT: &str = "meshgate-export";
/// `version` of the whole-namespace export this node writes and reads.
pub const EXPORT_VERSION: u32 = 2;
/// Largest import body, in bytes (the JSON, blobs in base64 included): past
/// it 413 `IMPORT_TOO_LARGE`.
pub const MAX_IMPORT_BYTES: usize = 64 << 20;

/// A whole namespace as `GET /v1/db/export` answers and `PUT /v1/db/import`
/// takes (docs/decisions.md, "Namespace export and import").
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportV2 {
    /// Always `EXPORT_FORMAT`: tells this layout from the KV-only format 1.
    format: String,
    /// `EXPORT_VERSION`; another version is refused, not half-read.
    version: u32,
    /// The namespace exported from; logged on import (the target is the caller's).
    #[serde(default)]
    namespace: String,
    /// Every KV entry, with its key relative to the namespace.
    #[serde(default)]
    kv: Vec<ExportEntry>,
    /// Each function's record with its kept versions (modules in `blobs`).
    #[serde(default)]
    functions: Vec<ExportedFunction>,
    /// The function secrets, resealed under the export key.
    #[serde(default)]
    secrets: SealedSecrets,
    /// Each deployment with its versions (site files in `blobs`).
    #[serde(default)]
    deployments: Vec<ExportedDeployment>,
    /// Function modules and site files by SHA-256 (hex), base64.
    #[serde(default)]
    blobs: BTreeMap<String, String>,
    /// The pub/sub history of this node: each topic's stream (epoch, top
    /// offset, kept publications). Absent (an export from before history):
    /// the import leaves the namespace's history as it is; present, even
    /// empty: the history becomes exactly this.
    #[serde(default)]
    history: Option<Vec<ExportedTopic>>,
}

/// The function secrets of an export, sealed under the export key of the
/// server secret ([`ExportBox`]); `key_id` names that key.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SealedSecrets {
    /// Id of the export key (`ExportBox::key_id`); an import under another server
    /// secret refuses the secrets unless `?secrets=skip`.
    #[serde(default)]
    key_id: String,
    /// What the seals are bound to: `EXPORT_SEAL_V2`, the exporting
    /// namespace and the name; absent (`EXPORT_SEAL_V1`, exports of older
    /// versions), the name only.
    #[serde(default = "seal_v1")]
    seal: u32,
    /// One sealed value per secret.
    #[serde(default)]
    entries: Vec<SealedSecret>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SealedSecret {
    /// The secret's name; also bound into the seal, so a renamed entry does not open.
    name: String,
    /// The value sealed by `ExportBox::seal`, base64.
    sealed_base64: String,
}

fn seal_v1() -> u32 {
    EXPORT_SEAL_V1
}

fn b64() -> &'static base64::engine::GeneralPurpose {
    &base64::engine::general_purpose::STANDARD
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::new(Code::InvalidExport, message)
}

fn too_large(message: impl Into<String>) -> ApiError {
    ApiError::new(Code::ImportTooLarge, message)
}

/// A namespace's export in progress on this node ([`NodeInner::exports`]):
/// taken before anything is read, given back when its body has been sent
/// (or the request dropped).
///
/// [`NodeInner::exports`]: crate::http::state::NodeInner::exports
struct ExportSlot {
    node: Node,
    namespace: String,
}

impl ExportSlot {
    /// The namespace's slot; 429 `EXPORT_BUSY` while its previous export is
    /// still being built or sent.
    fn take(node: &Node, namespace: &str) -> ApiResult<ExportSlot> {
        if !node.exports.lock().insert(namespace.to_string()) {
            return Err(ApiError::new(
                Code::ExportBusy,
                "this namespace's previous export is still being built or sent: one at a time",
            )
            .retry_after(1));
        }
        Ok(ExportSlot {
            node: node.clone(),
            namespace: namespace.to_string(),
        })
    }
}

impl Drop for ExportSlot {
    fn drop(&mut self) {
        self.node.exports.lock().remove(&self.namespace);
    }
}

/// 413 `EXPORT_TOO_LARGE`: an export that no import could take.
fn export_too_large(at_least: usize) -> ApiError {
    ApiError::new(
        Code::ExportTooLarge,
        format!(
            "this namespace's export is at least {at_least} bytes, over the {MAX_IMPORT_BYTES} an import takes; \
             read its KV with GET /v1/kv (and its history with GET /v1/pubsub/history) instead"
        ),
    )
}

/// At least the bytes a value takes in the export's JSON: its base64, its
/// key and the least JSON around them (`{"key":"…","value_base64":"…"},`
/// for a KV entry, 29 bytes; a blob's `"sha":"…",` takes less, so this
/// counts only the 6 every entry has). A lower bound, so the early checks
/// refuse only what is certainly too large; the whole document is
/// measured exactly at the end.
fn exported_bytes(key_len: usize, value_len: usize) -> usize {
    value_len.div_ceil(3) * 4 + key_len + 6
}

/// `GET /v1/db/export`. At most one export of a namespace is built or sent
/// at a time on a node (429 `EXPORT_BUSY`), and one no import could take
/// (over [`MAX_IMPORT_BYTES`]) is refused with 413 `EXPORT_TOO_LARGE` as
/// soon as its size is known: an export is built in memory and held until
/// its client has read it.
async fn export(ctx: NsCtx, node: web::Data<Node>) -> ApiResult<HttpResponse> {
    let slot = ExportSlot::take(&node, &ctx.name)?;
    // Refused before anything is read when the KV alone is over: the export
    // holds every key and value at least once, and the `kv_bytes` quota's
    // usage counts exactly those (a missing record reads as 0: no shortcut).
    let raw = node.store.get(&usage_key(&ctx.name, Group::Kv)).await?;
    let kv_bytes = Usage::decode(raw.as_deref()).map_or(0, |u| u.get(Resource::KvBytes));
    if kv_bytes > MAX_IMPORT_BYTES as u64 {
        return Err(export_too_large(kv_bytes as usize));
    }
    let rows = ctx.handle.ask(Export).await??;
    let mut size: usize = rows
        .kv
        .iter()
        .map(|(k, v)| exported_bytes(k.len(), v.len()))
        .sum();
    if size > MAX_IMPORT_BYTES {
        return Err(export_too_large(size));
    }
    let store = &node.store;
    let kv = rows
        .kv
        .into_iter()
        .map(|(key, v)| ExportEntry {
            key,
            value_base64: b64().encode(v),
        })
        .collect();
    let mut blobs = BTreeSet::new();
    // Version rows are keyed `<name>/<version>`.
    let mut versions: BTreeMap<String, Vec<VersionMeta>> = BTreeMap::new();
    for (key, v) in rows.versions {
        let meta: VersionMeta = serde_json::from_slice(&v)
            .map_err(|_| ApiError::internal("a stored function version does not decode"))?;
        let name = key.rsplit_once('/').map_or(key.as_str(), |(n, _)| n);
        versions.entry(name.to_string()).or_default().push(meta);
    }
    let mut functions = Vec::new();
    for (_, v) in rows.functions {
        let record: FunctionRecord = serde_json::from_slice(&v)
            .map_err(|_| ApiError::internal("a stored function record does not decode"))?;
        let mut kept = versions.remove(&record.name).unwrap_or_default();
        kept.retain(|m| record.versions.contains(&m.version));
        kept.sort_by_key(|m| record.versions.iter().position(|v| *v == m.version));
        blobs.extend(kept.iter().map(|m| m.sha256.clone()));
        functions.push(ExportedFunction {
            record,
            versions: kept,
        });
    }
    let seal_box = SecretBox::new(&node.secrets.server_secret);
    let export_box = ExportBox::new(&node.secrets.server_secret);
    let mut entries = Vec::new();
    for (name, sealed) in rows.secrets {
        match seal_box.open(&secret_key(&ctx.name, &name), &sealed) {
            Some(plain) => entries.push(SealedSecret {
                sealed_base64: b64().encode(export_box.seal(&ctx.name, &name, &plain)),
                name,
            }),
            None => {
                tracing::warn!(namespace = %ctx.name, secret = %name, "Secret does not open; left out of the export.")
            }
        }
    }
    let history = ctx
        .handle
        .ask(crate::actors::HistoryOf { streams: true })
        .await??
        .streams;
    let deployments = ExportedDeployment::from_rows(rows.deployments, rows.deployment_versions);
    for d in &deployments {
        blobs.extend(d.blobs().map(str::to_string));
    }
    let mut blob_map = BTreeMap::new();
    for sha in blobs {
        let bytes = store
            .get(&blob_key(&sha))
            .await?
            .ok_or_else(|| ApiError::internal(format!("blob {sha} is missing from the store")))?;
        size += exported_bytes(sha.len(), bytes.len());
        if size > MAX_IMPORT_BYTES {
            return Err(export_too_large(size));
        }
        blob_map.insert(sha, b64().encode(bytes));
    }
    let body = serde_json::to_vec(&ExportV2 {
        format: EXPORT_FORMAT.into(),
        version: EXPORT_VERSION,
        namespace: ctx.name.clone(),
        kv,
        functions,
        secrets: SealedSecrets {
            key_id: export_box.key_id().to_string(),
            seal: EXPORT_SEAL_V2,
            entries,
        },
        deployments,
        blobs: blob_map,
        history: Some(history),
    })
    .map_err(|e| ApiError::internal(format!("the export does not encode: {e}")))?;
    if body.len() > MAX_IMPORT_BYTES {
        return Err(export_too_large(body.len()));
    }
    Ok(HttpResponse::Ok()
        .content_type("application/json")
        // The slot goes with the last chunk (or the client).
        .body(crate::http::body::in_chunks(body.into(), slot)))
}

#[derive(Deserialize)]
struct ImportQuery {
    /// `skip`: import without the export's secrets, leaving the namespace's
    /// own as they are (the way to import secrets sealed under another
    /// server secret, which cannot open here). `reseal` (the operator key
    /// only): open the secrets for the namespace they were exported from and
    /// seal them for this one.
    #[serde(default)]
    secrets: Option<String>,
    /// Consumed by the authorization step (operators naming a namespace).
    #[serde(default, rename = "namespace")]
    _namespace: Option<String>,
}

/// The KV writes of an import, every entry checked.
fn kv_puts(ns: &str, entries: &[ExportEntry]) -> ApiResult<Vec<(Vec<u8>, Vec<u8>)>> {
    let base = kv_prefix(ns);
    let mut seen = BTreeSet::new();
    let mut puts = Vec::with_capacity(entries.len());
    for e in entries {
        if e.key.is_empty() || e.key.len() > MAX_KV_KEY {
            return Err(invalid(format!("a KV key is 1 to {MAX_KV_KEY} bytes")));
        }
        if !seen.insert(e.key.as_str()) {
            return Err(invalid(format!("duplicate KV key {:?}", e.key)));
        }
        let value = b64()
            .decode(&e.value_base64)
            .map_err(|_| invalid(format!("the value of KV key {:?} is not base64", e.key)))?;
        let mut k = base.clone();
        k.extend_from_slice(e.key.as_bytes());
        puts.push((k, value));
    }
    Ok(puts)
}

/// The KV usage record of a namespace whose KV becomes exactly `puts`
/// (full store keys), refused whole past its `kv_bytes` or `kv_keys` quota.
fn kv_usage(
    ns: &str,
    puts: &[(Vec<u8>, Vec<u8>)],
    limits: &crate::quota::Limits,
) -> ApiResult<BatchOp> {
    let prefix = kv_prefix(ns).len();
    let bytes: u64 = puts
        .iter()
        .map(|(k, v)| (k.len() - prefix + v.len()) as u64)
        .sum();
    let mut u = Usage::default();
    u.apply(
        limits,
        &[
            (Resource::KvKeys, puts.len() as i64),
            (Resource::KvBytes, bytes as i64),
        ],
    )?;
    Ok(BatchOp::Put(usage_key(ns, Group::Kv), u.encode()))
}

/// An export's history checked against the namespace's byte cap and topic
/// quota: 400 `INVALID_EXPORT` naming the bad entry, 413 `QUOTA_EXCEEDED`
/// past the byte cap, 429 past the topics.
fn check_history(
    topics: &[ExportedTopic],
    max_bytes: u64,
    max_topics: u64,
) -> ApiResult<Vec<crate::pubsub::history::CheckedTopic>> {
    use crate::pubsub::history::{ImportError, check_import};
    check_import(topics, max_bytes, max_topics).map_err(|e| match e {
        ImportError::TooManyTopics { topics, max_topics } => {
            crate::quota::exceeded(Resource::HistoryTopics, 0, topics, max_topics)
        }
        ImportError::Invalid(why) => invalid(why),
        ImportError::TooLarge { max_bytes } => ApiError::with_status(
            actix_web::http::StatusCode::PAYLOAD_TOO_LARGE,
            Code::QuotaExceeded,
            format!(
                "quota history_bytes exceeded: the export's history holds more than the \
                 {max_bytes} bytes this namespace may keep on this node; import less \
                 history, or ask the operator to raise the quota"
            ),
        ),
    })
}

/// 413 for an import whose non-KV part cannot be one store transaction.
fn not_atomic(why: &str) -> ApiError {
    too_large(format!(
        "the functions, secrets and deployments of this import cannot be applied \
         atomically: {why}. Nothing was imported; import fewer of them (the KV has no \
         such limit; a single node on sled has none at all)"
    ))
}

/// Hands a checked import to the supervisor (see [`Import`]).
async fn apply(ctx: &NsCtx, import: Import) -> ApiResult<()> {
    match ctx.handle.ask(import).await?? {
        Ok(()) => Ok(()),
        Err(why) => Err(not_atomic(&why)),
    }
}

async fn import(
    ctx: NsCtx,
    node: web::Data<Node>,
    q: web::Query<ImportQuery>,
    mut payload: web::Payload,
) -> ApiResult<HttpResponse> {
    let secrets = match q.secrets.as_deref() {
        None => SecretsMode::Bound,
        Some("skip") => SecretsMode::Skip,
        Some("reseal") if ctx.identity.as_ref().is_some_and(|i| i.operator) => SecretsMode::Reseal,
        Some("reseal") => {
            return Err(ApiError::new(
                Code::OperatorOnly,
                "secrets=reseal re-seals another namespace's secrets for this one: \
                 the operator key only",
            ));
        }
        Some(other) => {
            return Err(ApiError::new(
                Code::BadQuery,
                format!("secrets={other:?}: the values are `skip` and `reseal` (operator)"),
            ));
        }
    };
    let mut body = Vec::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::new(Code::BadBody, e.to_string()))?;
        if body.len() + chunk.len() > MAX_IMPORT_BYTES {
            return Err(too_large(format!(
                "an import body is at most {MAX_IMPORT_BYTES} bytes"
            )));
        }
        body.extend_from_slice(&chunk);
    }
    let value: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(Code::MalformedJson, format!("the body is not JSON: {e}")))?;
    drop(body);
    let format = value.get("format").cloned();
    match format {
        Some(f) if f.as_u64() == Some(1) => {
            // The KV-only format: replaces the KV, nothing else.
            let e: NamespaceExport = serde_json::from_value(value)
                .map_err(|e| invalid(format!("not a format 1 export: {e}")))?;
            let puts = kv_puts(&ctx.name, &e.kv)?;
            let n = puts.len();
            let limits = node.limits(&ctx.name).await?;
            let usage = kv_usage(&ctx.name, &puts, &limits)?;
            apply(
                &ctx,
                Import {
                    kv: puts,
                    replace: Vec::new(),
                    records: Vec::new(),
                    extra: vec![usage],
                },
            )
            .await?;
            Ok(HttpResponse::Ok().json(json!({"ok": true, "imported": n})))
        }
        Some(f) if f.as_str() == Some(EXPORT_FORMAT) => {
            let version = value.get("version").and_then(|v| v.as_u64());
            if version != Some(u64::from(EXPORT_VERSION)) {
                return Err(ApiError::new(
                    Code::UnsupportedExportVersion,
                    format!(
                        "export version {}: this node reads version {EXPORT_VERSION} (and the KV-only format 1)",
                        value
                            .get("version")
                            .map_or("(none)".into(), |v| v.to_string())
                    ),
                ));
            }
            let e: ExportV2 = serde_json::from_value(value)
                .map_err(|e| invalid(format!("not a version {EXPORT_VERSION} export: {e}")))?;
            import_v2(ctx, &node, e, secrets).await
        }
        _ => Err(ApiError::new(
            Code::UnsupportedExportFormat,
            format!(
                "`format` must be \"{EXPORT_FORMAT}\" (with `version` {EXPORT_VERSION}) or 1 (KV only)"
            ),
        )),
    }
}

/// What an import does with the export's secrets (`?secrets=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SecretsMode {
    /// Import them if they are sealed to this namespace (the default).
    Bound,
    /// Leave them out, keeping the namespace's own.
    Skip,
    /// The operator re-seals them from the exporting namespace for this one.
    Reseal,
}

/// Opens one secret of an export for namespace `ns` (see [`ExportBox`]):
/// a version 2 seal opens for its own namespace; for another one only in
/// `Reseal` mode (opened for the exporting namespace the export names, which
/// the seal authenticates). A version 1 seal (name only) proves no namespace:
/// the operator's `Reseal` only.
fn open_export_secret(
    export_box: &ExportBox,
    e: &ExportV2,
    ns: &str,
    mode: SecretsMode,
    s: &SealedSecret,
) -> ApiResult<Vec<u8>> {
    let sealed = b64()
        .decode(&s.sealed_base64)
        .map_err(|_| invalid(format!("secret {} is not base64", s.name)))?;
    let bound_elsewhere = |why: String| {
        ApiError::new(
            Code::SecretsBoundElsewhere,
            format!(
                "{why}; import them into that namespace, add ?secrets=skip to import \
                 without them, or have the operator import with ?secrets=reseal"
            ),
        )
    };
    match e.secrets.seal {
        EXPORT_SEAL_V2 => {
            if let Some(plain) = export_box.open(ns, &s.name, &sealed) {
                return Ok(plain);
            }
            match export_box.open(&e.namespace, &s.name, &sealed) {
                Some(plain) if mode == SecretsMode::Reseal => Ok(plain),
                Some(_) => Err(bound_elsewhere(format!(
                    "the export's secrets are sealed to namespace {:?}, not {ns:?}",
                    e.namespace
                ))),
                None => Err(invalid(format!("secret {} does not open", s.name))),
            }
        }
        EXPORT_SEAL_V1 => match export_box.open_v1(&s.name, &sealed) {
            Some(plain) if mode == SecretsMode::Reseal => Ok(plain),
            Some(_) => Err(bound_elsewhere(
                "the export's secrets were sealed by an older meshgate without their \
                 namespace, so nothing shows which namespace they belong to"
                    .into(),
            )),
            None => Err(invalid(format!("secret {} does not open", s.name))),
        },
        other => Err(invalid(format!(
            "secrets.seal {other}: this node reads {EXPORT_SEAL_V1} and {EXPORT_SEAL_V2}"
        ))),
    }
}

/// The largest version number, and the largest byte count, an import may
/// declare: 2^53, the largest integer every JSON client reads exactly; the
/// next version (one more) can never wrap, and a size never turns negative
/// where usage is counted.
pub const MAX_IMPORTED_COUNT: u64 = 1 << 53;

/// The counters an import declares (version numbers, a deployment's
/// `latest` and `active`) within [`MAX_IMPORTED_COUNT`] (400
/// `INVALID_EXPORT`), and the sizes it declares against the bytes it
/// carries (400 `IMPORT_SIZE_MISMATCH`): a function version's `size_bytes` is its
/// module's length, a site file's `size` its blob's length, and a site's
/// `total_bytes` at least the sum of its files (a tarball's overwritten
/// entries count too) and at most [`MAX_IMPORTED_COUNT`]. Quotas are
/// counted from these, so a lie would store bytes the namespace is never
/// charged for. Every referenced blob is carried (checked by the caller).
fn check_declared(
    functions: &[ExportedFunction],
    deployments: &[ExportedDeployment],
    blobs: &BTreeMap<String, Vec<u8>>,
) -> ApiResult<()> {
    let mismatch = |m: String| ApiError::new(Code::ImportSizeMismatch, m);
    let counter = |what: String, n: u64| {
        if n > MAX_IMPORTED_COUNT {
            return Err(invalid(format!(
                "{what} is {n}; an import takes at most {MAX_IMPORTED_COUNT}"
            )));
        }
        Ok(())
    };
    for f in functions {
        let name = &f.record.name;
        counter(
            format!("function {name}: current_version"),
            f.record.current_version,
        )?;
        for v in &f.versions {
            counter(format!("function {name}: a version"), v.version)?;
            let carried = blobs.get(&v.sha256).map(Vec::len);
            if carried.is_some_and(|n| n != v.size_bytes) {
                return Err(mismatch(format!(
                    "function {} version {}: size_bytes is {}, its module is {} bytes",
                    f.record.name,
                    v.version,
                    v.size_bytes,
                    carried.unwrap_or(0)
                )));
            }
        }
    }
    for d in deployments {
        let name = &d.record.name;
        counter(format!("deployment {name}: latest"), d.record.latest)?;
        counter(format!("deployment {name}: active"), d.record.active)?;
        for v in &d.versions {
            counter(format!("deployment {name}: a version"), v.version)?;
            let crate::deploy::model::TargetSpec::Static { files, total_bytes } = &v.target else {
                continue;
            };
            let mut sum = 0u64;
            for (path, f) in files {
                let carried = blobs.get(&f.sha256).map(|b| b.len() as u64);
                if carried.is_some_and(|n| n != f.size) {
                    return Err(mismatch(format!(
                        "deployment {} version {}: file {path:?} declares {} bytes, its blob is {}",
                        d.record.name,
                        v.version,
                        f.size,
                        carried.unwrap_or(0)
                    )));
                }
                sum = sum.saturating_add(f.size);
            }
            if *total_bytes < sum || *total_bytes > MAX_IMPORTED_COUNT {
                return Err(mismatch(format!(
                    "deployment {} version {}: total_bytes is {total_bytes}, its files hold \
                     {sum} (at most {MAX_IMPORTED_COUNT})",
                    d.record.name, v.version
                )));
            }
        }
    }
    Ok(())
}

/// A whole-namespace import: everything is checked, then the blobs are
/// stored (content-addressed, so unreferenced ones harm nothing), then the
/// records, secrets, deployments and host claims are written in one atomic
/// batch under the deployment lock.
async fn import_v2(
    ctx: NsCtx,
    node: &Node,
    mut e: ExportV2,
    mode: SecretsMode,
) -> ApiResult<HttpResponse> {
    let skip_secrets = mode == SecretsMode::Skip;
    let ns = ctx.name.clone();
    let store = &node.store;
    let kv = kv_puts(&ns, &e.kv)?;
    let history = match e.history.take() {
        None => None,
        Some(topics) => {
            let state = ctx
                .handle
                .ask(crate::actors::HistoryOf { streams: false })
                .await??;
            Some(check_history(&topics, state.max_bytes, state.max_topics)?)
        }
    };
    let mut blobs = BTreeMap::new();
    for (sha, data) in std::mem::take(&mut e.blobs) {
        let bytes = b64()
            .decode(&data)
            .map_err(|_| invalid(format!("blob {sha} is not base64")))?;
        let digest = hex::encode(ring::digest::digest(&ring::digest::SHA256, &bytes));
        if digest != sha {
            return Err(invalid(format!(
                "blob {sha} does not match its SHA-256 ({digest})"
            )));
        }
        blobs.insert(sha, bytes);
    }
    let mut needed = BTreeSet::new();
    let mut records = Vec::new();
    let mut names = BTreeSet::new();
    for f in &e.functions {
        f.validate().map_err(invalid)?;
        if !names.insert(f.record.name.clone()) {
            return Err(invalid(format!("function {} appears twice", f.record.name)));
        }
        needed.extend(f.versions.iter().map(|v| v.sha256.clone()));
        records.extend(f.records(&ns));
    }
    let mut secrets = Vec::new();
    if !skip_secrets && !e.secrets.entries.is_empty() {
        let export_box = ExportBox::new(&node.secrets.server_secret);
        if e.secrets.key_id != export_box.key_id() {
            return Err(ApiError::new(
                Code::SecretsSealedElsewhere,
                format!(
                    "the export's secrets were sealed under another server secret (key id {:?}, \
                     this node's {}); import on a node of the exporting cluster, or add \
                     ?secrets=skip to import without them",
                    e.secrets.key_id,
                    export_box.key_id()
                ),
            ));
        }
        let seal_box = SecretBox::new(&node.secrets.server_secret);
        let mut seen = BTreeSet::new();
        for s in &e.secrets.entries {
            if !crate::functions::valid_secret_name(&s.name) || !seen.insert(s.name.as_str()) {
                return Err(invalid(format!(
                    "secret name {:?} is not valid or appears twice",
                    s.name
                )));
            }
            let plain = open_export_secret(&export_box, &e, &ns, mode, s)?;
            let key = secret_key(&ns, &s.name);
            let sealed = seal_box.seal(&key, &plain);
            secrets.push((key, sealed));
        }
    }
    node.deployments.check_import(&ns, &mut e.deployments)?;
    for d in &e.deployments {
        needed.extend(d.blobs().map(str::to_string));
    }
    // Function modules pass the checks of a deploy: size, then compile
    // (which also warms the compiled-artifact cache).
    let modules: BTreeSet<&str> = e
        .functions
        .iter()
        .flat_map(|f| f.versions.iter().map(|v| v.sha256.as_str()))
        .collect();
    let max_module = node.config.functions.max_module_bytes;
    for sha in modules {
        if let Some(bytes) = blobs.get(sha) {
            if bytes.len() > max_module {
                return Err(ApiError::new(
                    Code::ModuleTooLarge,
                    format!(
                        "module {sha} is {} bytes; this node takes at most {max_module}",
                        bytes.len()
                    ),
                ));
            }
            node.functions.compile(&ns, bytes.clone()).await?;
        }
    }
    // The declared sizes and counters, once each module is known to be one.
    check_declared(&e.functions, &e.deployments, &blobs)?;
    // Every referenced blob must travel in the export, even one the store
    // already holds: a blob of another namespace is never reachable by
    // naming its hash.
    for sha in &needed {
        if !blobs.contains_key(sha) {
            return Err(invalid(format!("blob {sha} is referenced but not carried")));
        }
    }
    node.deployments
        .precheck_import(&ns, &e.deployments)
        .await?;
    let mut counts = json!({
        "kv": kv.len(),
        "functions": e.functions.len(),
        "secrets": secrets.len(),
        "deployments": e.deployments.len(),
    });
    if let Some(h) = &history {
        counts["history_topics"] = json!(h.len());
    }
    let mut replace = vec![fn_prefix(&ns), fnver_prefix(&ns)];
    if !skip_secrets {
        records.extend(secrets);
        replace.push(secret_prefix(&ns));
    }
    // Refuse early what cannot be atomic, before storing any blob (the
    // supervisor checks again with the deletions and the deployments).
    let early: Vec<_> = records
        .iter()
        .map(|(k, v)| crate::storage::BatchOp::Put(k.clone(), v.clone()))
        .collect();
    store.check_atomic(&early).map_err(|why| not_atomic(&why))?;
    drop(early);
    // Pinned until the records naming them are written: a blob sweep in
    // between would delete them (`storage/blob_ledger.rs`).
    let pins = crate::storage::blob_ledger::pin(store, needed.iter().map(String::as_str)).await?;
    for (sha, bytes) in &blobs {
        if needed.contains(sha) {
            let key = blob_key(sha);
            if store.get(&key).await?.is_none() {
                store.put(&key, bytes).await?;
            }
        }
    }
    let limits = node.limits(&ns).await?;
    let mut usage = vec![kv_usage(&ns, &kv, &limits)?];
    {
        // The functions become exactly the export's: so does their usage.
        let mut u = Usage::default();
        let bytes: u64 = e
            .functions
            .iter()
            .flat_map(|f| f.versions.iter())
            .map(|v| v.size_bytes as u64)
            .sum();
        u.apply(
            &limits,
            &[
                (Resource::Functions, e.functions.len() as i64),
                (Resource::ModuleBytes, bytes as i64),
            ],
        )?;
        usage.push(BatchOp::Put(usage_key(&ns, Group::Functions), u.encode()));
    }
    let (lock, mut extra) = node
        .deployments
        .import_ops(&ns, &e.deployments, &limits)
        .await?;
    extra.extend(usage);
    let applied = apply(
        &ctx,
        Import {
            kv,
            replace,
            records,
            extra,
        },
    )
    .await;
    if let Err(e) = applied {
        drop(lock);
        return Err(e);
    }
    pins.release().await;
    // The namespace's former functions and sites may have left blobs unused.
    node.blob_sweeps.request();
    let reloaded = node.deployments.reload().await;
    drop(lock);
    reloaded?;
    // The history last, through its own write queue (behind any write of
    // the old history in flight); a failure here leaves the rest imported
    // and answers 503: the import is a replacement, so running it again
    // completes it.
    if let Some(topics) = history {
        let stored = ctx
            .handle
            .ask(crate::actors::ReplaceHistory { topics })
            .await??;
        if !stored.await.unwrap_or(false) {
            return Err(ApiError::new(
                Code::StoreUnavailable,
                "the namespace was imported but its pub/sub history could not be written; \
                 run the import again",
            ));
        }
    }
    tracing::info!(namespace = %ns, from = %e.namespace, imported = %counts, "Namespace imported.");
    if mode == SecretsMode::Reseal && e.namespace != ns {
        tracing::warn!(namespace = %ns, from = %e.namespace, "Another namespace's secrets re-sealed for this one by the operator.");
    }
    Ok(HttpResponse::Ok().json(json!({
        "ok": true,
        "imported": counts["kv"],
        "counts": counts,
    })))
}
