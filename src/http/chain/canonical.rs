//! The canonical request (docs/design.md §2; docs/security.md "One
//! canonical request"), made once before every step of the chain, the
//! routed fast path included: the path in its one spelling (or refused 400
//! `AMBIGUOUS_PATH`), an absolute-form target that names another host than
//! `Host` refused, and the client's headers that read as reserved ones
//! removed. Every route match, every step and the upstream see that request.
//! The spelling rules are `crate::deploy::canonical`'s; this file applies
//! them to a request.
//!
//! The common request is canonical already: one scan of the path's bytes
//! and of the header names' first bytes, no allocation, nothing rewritten.

use super::context::{PathReading, host_of, request_host};
use crate::deploy::canonical::{
    HeaderName as Verdict, canonical_path, judge_header, needs_judging, upstream_reading,
};
use crate::deploy::index::Serve;
use crate::deploy::pool::UpstreamPool;
use crate::error::{ApiError, Code};
use crate::http::state::Node;
use actix_web::HttpMessage;
use actix_web::dev::ServiceRequest;
use actix_web::http::Uri;
use actix_web::http::header::{self, HeaderName};
use actix_web::http::uri::PathAndQuery;
use std::borrow::Cow;
use std::sync::Arc;

/// Makes `req` canonical in place, or refuses it (400 `AMBIGUOUS_PATH`).
/// The node is looked at only when the request is not canonical already.
pub fn canonicalize(req: &mut ServiceRequest) -> Result<(), ApiError> {
    check_target(req)?;
    let canonical = canonical_path(req.path()).map(|c| match c {
        Cow::Borrowed(_) => None,
        Cow::Owned(p) => Some(p),
    });
    match canonical {
        Ok(None) => {}
        Ok(Some(p)) => set_path(req, &p)?,
        Err(why) => {
            // A deployment may take such paths unchanged; its routes are
            // matched on how a decoding upstream reads the path.
            let reading = upstream_reading(req.path())
                .filter(|r| upstream_of(req, r).is_some_and(|p| p.pass_ambiguous_paths));
            let Some(reading) = reading else {
                return Err(ApiError::new(
                    Code::AmbiguousPath,
                    format!(
                        "the path has {}, which an upstream may read otherwise than the node: spell it plainly",
                        why.reason()
                    ),
                ));
            };
            req.extensions_mut().insert(PathReading(reading));
        }
    }
    strip_headers(req);
    Ok(())
}

/// An absolute-form target (`GET http://other/… HTTP/1.1`), or an HTTP/2
/// `:authority`, naming another host than the `Host` header: which one an
/// upstream believes is not the node's to guess.
fn check_target(req: &ServiceRequest) -> Result<(), ApiError> {
    let (Some(authority), Some(host)) = (req.uri().authority(), req.headers().get(header::HOST))
    else {
        return Ok(());
    };
    let same = host
        .to_str()
        .is_ok_and(|h| host_of(h) == host_of(authority.as_str()));
    if same {
        return Ok(());
    }
    Err(ApiError::new(
        Code::AmbiguousPath,
        "the request target names another host than the Host header",
    ))
}

/// Puts the canonical path on the request: its URI (what handlers, the
/// steps and the proxy read) and the router's copy of it.
fn set_path(req: &mut ServiceRequest, path: &str) -> Result<(), ApiError> {
    let bad = || ApiError::new(Code::AmbiguousPath, "the path cannot be made canonical");
    let pq = match req.uri().query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    let mut parts = req.uri().clone().into_parts();
    parts.path_and_query = Some(PathAndQuery::try_from(pq).map_err(|_| bad())?);
    let uri = Uri::from_parts(parts).map_err(|_| bad())?;
    req.match_info_mut().get_mut().update(&uri);
    req.head_mut().uri = uri;
    Ok(())
}

/// The upstream pool the request's host and `path` route to, if any.
fn upstream_of(req: &ServiceRequest, path: &str) -> Option<Arc<UpstreamPool>> {
    let node = Node::of(req.request());
    let host = request_host(req)?;
    let bound = node.deployments.route(&host, req.method().as_str(), path)?;
    match &bound.serve {
        Serve::Upstream(pool) => Some(pool.clone()),
        Serve::Static(_) => None,
    }
}

/// Removes the client's headers that read as reserved ones
/// ([`judge_header`]): those with `_` unless the routed deployment allows
/// them, and `X-Forwarded-For`/`-Proto` unless the peer is a trusted proxy
/// (`[rate_limit] trusted_proxies`). Headers without `_`, `x-meshgate-`,
/// `x-forwarded-`, `x-real-ip` or `forwarded` in their names are not looked at twice.
fn strip_headers(req: &mut ServiceRequest) {
    if !needs_judging(req.headers().keys().map(HeaderName::as_str)) {
        return;
    }
    let peer = req.peer_addr().map(|a| a.ip());
    let trusted = peer.is_some_and(|ip| {
        Node::of(req.request())
            .config
            .rate_limit
            .trusted_proxies
            .iter()
            .any(|p| p.parse::<std::net::IpAddr>().ok() == Some(ip))
    });
    let underscores = req.headers().keys().any(|k| k.as_str().contains('_')) && {
        let path = PathReading::of(&req.extensions(), req.path()).to_string();
        upstream_of(req, &path).is_some_and(|p| p.allow_underscore_headers)
    };
    let dropped: Vec<HeaderName> = req
        .headers()
        .keys()
        .filter(|k| judge_header(k.as_str(), underscores, trusted) == Verdict::Drop)
        .cloned()
        .collect();
    let headers = req.headers_mut();
    for name in dropped {
        headers.remove(name);
    }
}
