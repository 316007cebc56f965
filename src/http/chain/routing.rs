//! Steps 6 and 7: CORS and domain routing (the request's host is `context.rs`'s).

use super::context::{
    Early, RequestHost, RoutedHost, Sni, Target, policy_of, valid_namespace_name,
};
use crate::error::{ApiError, Code};
use crate::http::policy::Policy;
use crate::http::state::Node;
use actix_web::dev::ServiceRequest;
use actix_web::http::Method;
use actix_web::http::header::{self, HeaderValue};
use actix_web::{HttpMessage, HttpResponse};

/// Step 6: CORS. Allowed origins come from `[cors] allowed_origins`; a preflight
/// is answered 204 here. Returns the origin whose headers go on the answer.
pub(crate) fn cors(req: &ServiceRequest) -> Result<Option<HeaderValue>, Early> {
    // A deployment answers its own CORS.
    let Some(origin) = req
        .headers()
        .get(header::ORIGIN)
        .filter(|_| policy_of(req) != Some(Policy::Deployment))
    else {
        return Ok(None);
    };
    let allowed = {
        let o = origin.to_str().unwrap_or("");
        Node::of(req.request())
            .config
            .cors
            .allowed_origins
            .iter()
            .any(|a| a == "*" || a == o)
    };
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        if !allowed {
            return Err(Early::Refuse(ApiError::new(
                Code::CorsOriginDenied,
                "this origin is not allowed",
            )));
        }
        return Err(Early::Answer(
            HttpResponse::NoContent()
                .insert_header((header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone()))
                .insert_header((
                    header::ACCESS_CONTROL_ALLOW_METHODS,
                    "GET, POST, PUT, DELETE, PATCH, OPTIONS",
                ))
                .insert_header((
                    header::ACCESS_CONTROL_ALLOW_HEADERS,
                    "authorization, content-type, x-api-key, x-request-id, x-namespace",
                ))
                .insert_header((header::ACCESS_CONTROL_MAX_AGE, "600"))
                .insert_header((header::VARY, "Origin"))
                .finish(),
        ));
    }
    Ok(allowed.then(|| origin.clone()))
}

/// Puts an allowed origin's CORS headers on the answer (step 6's second half).
pub(crate) fn cors_headers(h: &mut header::HeaderMap, origin: HeaderValue) {
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("x-request-id, retry-after"),
    );
}

/// Step 7's check of a TLS connection: the request's host must be the
/// server name the connection presented (421 otherwise).
pub fn check_server_name(sni: Option<&Sni>, host: &str) -> Result<(), ApiError> {
    if let Some(Sni(Some(sni))) = sni
        && !sni.eq_ignore_ascii_case(host)
    {
        return Err(ApiError::new(
            Code::MisdirectedRequest,
            format!("host {host} does not match the TLS server name {sni}"),
        ));
    }
    Ok(())
}

/// Step 7: maps the host to a deployment, a namespace (`ns-<name>.<base_domain>`)
/// or the gateway. On a TLS connection a host that disagrees with the SNI is 421.
pub(crate) fn domain_routing(req: &ServiceRequest) -> Result<(), ApiError> {
    let Some(host) = RequestHost::of(req) else {
        return Ok(());
    };
    check_server_name(req.conn_data::<Sni>(), &host)?;
    let routed = req
        .extensions()
        .get::<RoutedHost>()
        .map(|r| r.namespace.clone());
    if let Some(ns) = routed {
        req.extensions_mut().insert(Target(ns));
        return Ok(());
    }
    let base = &Node::of(req.request()).config.server.base_domain;
    if let Some(label) = host
        .strip_suffix(base.as_str())
        .and_then(|h| h.strip_suffix('.'))
        .and_then(|h| h.strip_prefix("ns-"))
        && valid_namespace_name(label)
    {
        req.extensions_mut().insert(Target(label.to_string()));
    }
    Ok(())
}
