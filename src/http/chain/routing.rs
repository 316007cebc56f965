//! Steps 6 and 7: CORS, the request's host, and domain routing.

use super::*;

/// Step 6: CORS. Allowed origins come from `[cors] allowed_origins`; a preflight
/// is answered 204 here. Returns the origin whose headers go on the answer.
pub(super) fn cors(req: &ServiceRequest) -> Result<Option<HeaderValue>, Early> {
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
        node_ref(req)
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
pub(super) fn cors_headers(h: &mut header::HeaderMap, origin: HeaderValue) {
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("x-request-id, retry-after"),
    );
}

/// The request's host: `:authority`/`Host`, lower-cased, port stripped.
/// One allocation: the routed fast path and the route-policy step both ask
/// (the first hands its answer to the second, [`RequestHost`]).
pub fn request_host(req: &ServiceRequest) -> Option<String> {
    let raw = match req.uri().authority() {
        Some(a) => a.as_str(),
        None => req.headers().get(header::HOST)?.to_str().ok()?,
    };
    Some(host_of(raw))
}

/// The host part of an authority: no user info, no port, lower-cased.
fn host_of(raw: &str) -> String {
    let raw = raw.rsplit('@').next().unwrap_or(raw);
    if raw.starts_with('[') {
        return match raw.find(']') {
            Some(end) => raw[..=end].to_ascii_lowercase(),
            None => format!("{}]", raw.to_ascii_lowercase()),
        };
    }
    raw.split(':').next().unwrap_or("").to_ascii_lowercase()
}

/// The request's host as `request_host` found it (set by the routed fast path
/// or the route-policy step, whichever asked first).
#[derive(Debug, Clone)]
pub struct RequestHost(pub String);

impl RequestHost {
    /// The request's host: the one an earlier step stored, else found now and
    /// stored for the steps after (`None` without a host).
    pub fn of(req: &ServiceRequest) -> Option<String> {
        if let Some(h) = req.extensions().get::<RequestHost>() {
            return Some(h.0.clone());
        }
        let h = request_host(req)?;
        req.extensions_mut().insert(RequestHost(h.clone()));
        Some(h)
    }
}

/// The TLS server name a connection presented (set when the node terminates TLS).
#[derive(Debug, Clone)]
pub struct Sni(pub Option<String>);

/// Step 7: maps the host to a deployment, a namespace (`ns-<name>.<base_domain>`)
/// or the gateway. On a TLS connection a host that disagrees with the SNI is 421.
pub(super) fn domain_routing(req: &ServiceRequest) -> Result<(), ApiError> {
    let Some(host) = RequestHost::of(req) else {
        return Ok(());
    };
    if let Some(Sni(Some(sni))) = req.conn_data::<Sni>()
        && !sni.eq_ignore_ascii_case(&host)
    {
        return Err(ApiError::new(
            Code::MisdirectedRequest,
            format!("host {host} does not match the TLS server name {sni}"),
        ));
    }
    let routed = req
        .extensions()
        .get::<crate::http::deploy_serve::RoutedHost>()
        .map(|r| r.namespace.clone());
    if let Some(ns) = routed {
        req.extensions_mut().insert(Target(ns));
        return Ok(());
    }
    let base = &node_ref(req).config.server.base_domain;
    if let Some(label) = host
        .strip_suffix(base.as_str())
        .and_then(|h| h.strip_suffix('.'))
        .and_then(|h| h.strip_prefix("ns-"))
        && crate::http::routes::valid_namespace_name(label)
    {
        req.extensions_mut().insert(Target(label.to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{RequestHost, host_of};
    use actix_web::{HttpMessage, test::TestRequest};

    #[test]
    fn request_host_is_found_once_and_kept_for_later_steps() {
        let req = TestRequest::default()
            .insert_header(("host", "Ns-Acme.Example.com:8080"))
            .to_srv_request();
        assert_eq!(
            RequestHost::of(&req).as_deref(),
            Some("ns-acme.example.com")
        );
        assert_eq!(
            req.extensions().get::<RequestHost>().map(|h| h.0.clone()),
            Some("ns-acme.example.com".to_string()),
            "the first ask stores the host for the steps after"
        );
        // The stored value wins over the header from now on.
        req.extensions_mut()
            .insert(RequestHost("kept.example".into()));
        assert_eq!(RequestHost::of(&req).as_deref(), Some("kept.example"));
        let bare = TestRequest::default().to_srv_request();
        assert_eq!(RequestHost::of(&bare), None);
        assert!(bare.extensions().get::<RequestHost>().is_none());
    }

    #[test]
    fn host_of_strips_port_and_user_info_and_lowers_case() {
        assert_eq!(host_of("Example.COM"), "example.com");
        assert_eq!(host_of("api.example.com:8443"), "api.example.com");
        assert_eq!(
            host_of("user:pw@Ns-Acme.Example.com:80"),
            "ns-acme.example.com"
        );
        assert_eq!(host_of("[::1]:8080"), "[::1]");
        assert_eq!(host_of("[FE80::1]"), "[fe80::1]");
        assert_eq!(host_of("[::1"), "[::1]");
        assert_eq!(host_of(":80"), "");
    }
}
