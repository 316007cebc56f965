//! Answering a request whose host is routed to a deployment: a static file, or
//! the proxy.

use super::index::Serve;
use super::model::SiteFile;
use super::proxy::{Forwarded, ProxyTimeouts, proxy_http, proxy_ws};
use crate::http::ApiError;
use crate::node::Node;
use crate::storage::OrderedKv;
use actix_web::dev::Payload;
use actix_web::http::header::{self, HeaderValue};
use actix_web::http::{Method, StatusCode};
use actix_web::{HttpMessage, HttpRequest, HttpResponse};
use std::collections::BTreeMap;
use std::time::Duration;

/// Put on a request by domain routing when its host belongs to a deployment.
#[derive(Debug, Clone)]
pub struct RoutedHost {
    pub namespace: String,
    pub host: String,
}

/// Serves a routed request; every failure is the JSON envelope.
pub async fn serve_routed(node: &Node, req: HttpRequest, payload: Payload) -> HttpResponse {
    let Some(routed) = req.extensions().get::<RoutedHost>().cloned() else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "NO_ROUTE",
            "no deployment serves this host",
        )
        .error_response_owned();
    };
    let index = node.deployments.index();
    let Some(bound) = index.lookup(&routed.host, req.method().as_str(), req.path()) else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "NO_ROUTE",
            format!(
                "no route of {} takes {} {}",
                routed.host,
                req.method(),
                req.path()
            ),
        )
        .error_response_owned();
    };
    let path = bound.route.rewrite(req.path());
    let result = match &bound.serve {
        Serve::Static(files) => serve_static(node, &req, files, &path).await,
        Serve::Upstream(pool) => {
            let mut pq = path;
            if !req.query_string().is_empty() {
                pq.push('?');
                pq.push_str(req.query_string());
            }
            // Each borrow of the request's extensions ends before the next begins
            // (`connection_info` borrows them mutably).
            let client_ip = req.extensions().get::<crate::http::ClientIp>().map(|c| c.0);
            let request_id = req
                .extensions()
                .get::<crate::http::RequestId>()
                .map(|r| r.0.clone());
            let https = req.connection_info().scheme() == "https";
            let fwd = Forwarded {
                client_ip: client_ip.or_else(|| req.peer_addr().map(|a| a.ip())),
                proto: if https { "https" } else { "http" },
                host: routed.host.clone(),
                request_id,
            };
            let cfg = &node.deployments.config;
            let t = ProxyTimeouts {
                connect: Duration::from_secs(cfg.connect_timeout_seconds),
                response: Duration::from_secs(cfg.upstream_timeout_seconds),
            };
            let upgrade = req
                .headers()
                .get(header::UPGRADE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
            if upgrade {
                proxy_ws(&req, payload, pool, &pq, &fwd, t).await
            } else {
                proxy_http(&req, payload, pool, &pq, &fwd, t).await
            }
        }
    };
    result.unwrap_or_else(|e| e.error_response_owned())
}

/// Decodes `%XX` escapes; None for bad escapes, non-UTF-8, NUL or dot segments.
fn decode_path(raw: &str) -> Option<String> {
    let b = raw.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    let s = String::from_utf8(out).ok()?;
    if s.contains('\0') || s.split('/').any(|seg| seg == ".." || seg == ".") {
        return None;
    }
    Some(s)
}

/// The file a path names: itself, or `index.html` for a folder.
fn find<'a>(files: &'a BTreeMap<String, SiteFile>, path: &str) -> Option<&'a SiteFile> {
    let p = path.trim_start_matches('/');
    if p.is_empty() || p.ends_with('/') {
        return files.get(&format!("{p}index.html"));
    }
    files
        .get(p)
        .or_else(|| files.get(&format!("{p}/index.html")))
}

async fn serve_static(
    node: &Node,
    req: &HttpRequest,
    files: &BTreeMap<String, SiteFile>,
    path: &str,
) -> Result<HttpResponse, ApiError> {
    if !matches!(*req.method(), Method::GET | Method::HEAD) {
        let mut r = ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "METHOD_NOT_ALLOWED",
            "a static site answers GET and HEAD",
        )
        .error_response_owned();
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Ok(r);
    }
    let Some(file) = decode_path(path).and_then(|p| find(files, &p)) else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "FILE_NOT_FOUND",
            format!("no file at {path}"),
        ));
    };
    let etag = format!("\"{}\"", file.sha256);
    let fresh = req
        .headers()
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .map(|t| t.trim().trim_start_matches("W/"))
                .any(|t| t == etag || t == "*")
        });
    if fresh {
        return Ok(HttpResponse::NotModified()
            .insert_header((header::ETAG, etag))
            .insert_header((header::CACHE_CONTROL, "no-cache"))
            .finish());
    }
    let bytes = node
        .store
        .get(&crate::functions::blob_key(&file.sha256))
        .await?
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "INTERNAL",
                "a file of this site is missing from the store",
            )
        })?;
    Ok(HttpResponse::Ok()
        .insert_header((header::CONTENT_TYPE, file.content_type.as_str()))
        .insert_header((header::ETAG, etag))
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .body(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Escapes decode; dot segments, NUL and bad escapes are refused.
    #[test]
    fn decodes_paths() {
        assert_eq!(decode_path("/a%20b.html").as_deref(), Some("/a b.html"));
        assert_eq!(decode_path("/%2e%2e/x"), None);
        assert_eq!(decode_path("/a/../x"), None);
        assert_eq!(decode_path("/a%00"), None);
        assert_eq!(decode_path("/a%zz"), None);
        assert_eq!(decode_path("/a%4"), None);
    }

    /// Folders serve their index.html, with or without the trailing slash.
    #[test]
    fn folders_serve_index() {
        let f = |sha: &str| SiteFile {
            sha256: sha.into(),
            size: 1,
            content_type: "text/html".into(),
        };
        let files: BTreeMap<String, SiteFile> = [
            ("index.html".to_string(), f("root")),
            ("docs/index.html".to_string(), f("docs")),
            ("a.css".to_string(), f("css")),
        ]
        .into_iter()
        .collect();
        assert_eq!(find(&files, "/").unwrap().sha256, "root");
        assert_eq!(find(&files, "/docs/").unwrap().sha256, "docs");
        assert_eq!(find(&files, "/docs").unwrap().sha256, "docs");
        assert_eq!(find(&files, "/a.css").unwrap().sha256, "css");
        assert!(find(&files, "/missing").is_none());
    }
}
