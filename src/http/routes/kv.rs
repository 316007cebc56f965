//! The namespace KV (`/v1/kv`) and whole-namespace export and import
//! (`/v1/db/*`), handled by the namespace's supervisor.

use super::NsCtx;
use crate::actors::{Export, Import, KvDelete, KvGet, KvList, KvPut, MAX_KV_LIST, NamespaceExport};
use crate::http::error::{ApiError, ApiResult};
use crate::http::policy::{Policy, RouteTable};
use actix_web::http::Method;
use actix_web::{HttpResponse, web};
use serde::Deserialize;
use serde_json::json;

/// Longest KV key, in bytes: keys travel in URLs and in every listing.
pub const MAX_KV_KEY_BYTES: usize = 1024;

/// Refuses a key over [`MAX_KV_KEY_BYTES`] before it reaches the store.
fn key_checked(key: web::Path<String>) -> ApiResult<String> {
    let key = key.into_inner();
    if key.len() > MAX_KV_KEY_BYTES {
        return Err(ApiError::bad_request(
            "KEY_TOO_LONG",
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

async fn get(ctx: NsCtx, key: web::Path<String>) -> ApiResult<HttpResponse> {
    let key = key_checked(key)?;
    ctx.require("kv", "read", &key)?;
    match ctx.handle.ask(KvGet { key }).await?? {
        Some(v) => Ok(HttpResponse::Ok()
            .content_type("application/octet-stream")
            .body(v)),
        None => Err(ApiError::not_found("KEY_NOT_FOUND", "no such key")),
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
        return Err(ApiError::not_found("KEY_NOT_FOUND", "no such key"));
    }
    Ok(HttpResponse::Ok().json(json!({"ok": true})))
}

#[derive(Deserialize)]
struct ListQuery {
    #[serde(default)]
    prefix: String,
    #[serde(default)]
    limit: Option<usize>,
    /// Consumed by the authorization step (operators naming a namespace).
    #[serde(default, rename = "namespace")]
    _namespace: Option<String>,
}

async fn list(ctx: NsCtx, q: web::Query<ListQuery>) -> ApiResult<HttpResponse> {
    let q = q.into_inner();
    ctx.require("kv", "read", &format!("{}*", q.prefix))?;
    let limit = q.limit.unwrap_or(MAX_KV_LIST).min(MAX_KV_LIST);
    let keys = ctx
        .handle
        .ask(KvList {
            prefix: q.prefix,
            limit,
        })
        .await??;
    Ok(HttpResponse::Ok().json(json!({"keys": keys})))
}

async fn export(ctx: NsCtx) -> ApiResult<HttpResponse> {
    let data = ctx.handle.ask(Export).await??;
    Ok(HttpResponse::Ok().json(data))
}

async fn import(ctx: NsCtx, body: web::Json<NamespaceExport>) -> ApiResult<HttpResponse> {
    let n = ctx.handle.ask(Import(body.into_inner())).await??;
    Ok(HttpResponse::Ok().json(json!({"ok": true, "imported": n})))
}
