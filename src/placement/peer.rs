//! The node-to-node side of a hop: the HTTP client a forwarder uses, TLS to
//! members that advertise `https://` (their certificate must chain to
//! `[cluster] peer_ca_file`, never to public roots), and the bound on the
//! bodies a hop buffers so that it can MAC their digest.

use crate::config::Config;
use rustls::RootCertStore;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use std::cell::RefCell;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Room beside the largest accepted part for multipart framing and the
/// small fields that travel with it (a site's metadata, a function's name).
const MULTIPART_SLACK: usize = 1 << 20;

/// The largest body a hop carries, in bytes: the largest any route accepts
/// (a JSON or raw body, a function module, a site tarball) plus
/// `MULTIPART_SLACK`. The forwarder and the receiver both buffer up to it
/// (more: 413 `PAYLOAD_TOO_LARGE`); the member's own per-route limits
/// still apply to what fits.
pub fn hop_body_limit(cfg: &Config) -> usize {
    cfg.server
        .max_body_bytes
        .max(cfg.functions.max_module_bytes)
        .max(cfg.deploy.max_site_bytes)
        .saturating_add(MULTIPART_SLACK)
}

/// The roots of `peer_ca_file` (checked readable at start-up by the
/// configuration). `Err` names the reason.
pub fn load_peer_roots(path: &Path) -> Result<RootCertStore, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read cluster.peer_ca_file {}: {e}", path.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("cluster.peer_ca_file {} is not PEM: {e}", path.display()))?;
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(format!(
            "cluster.peer_ca_file {} holds no usable CA certificate",
            path.display()
        ));
    }
    Ok(roots)
}

/// The TLS client config for members: the roots of `peer_ca_file`, or none
/// at all (no `https://` member is trusted) when it is empty. HTTP/1.1.
fn tls_config(peer_ca_file: &str) -> Result<Arc<rustls::ClientConfig>, String> {
    let roots = if peer_ca_file.is_empty() {
        RootCertStore::empty()
    } else {
        load_peer_roots(Path::new(peer_ca_file))?
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// Read once per process: the file is checked at start-up and a change
/// needs a restart.
static TLS: OnceLock<Result<Arc<rustls::ClientConfig>, String>> = OnceLock::new();

thread_local! {
    /// This worker thread's client and the timeouts it was built with.
    static CLIENT: RefCell<Option<((Duration, Duration), awc::Client)>> = const { RefCell::new(None) };
}

/// Timeouts of a hop: to connect (TLS handshake included) and for the
/// member's response head.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PeerTimeouts {
    /// To open the connection, TLS handshake included (`deploy.connect_timeout_seconds`).
    pub connect: Duration,
    /// For the member's response head (`deploy.upstream_timeout_seconds`).
    pub response: Duration,
}

impl PeerTimeouts {
    /// A hop's timeouts from the `[deploy]` section: the same connect and
    /// response bounds as a proxied upstream (forwarding and internal asks
    /// both use these).
    pub fn from_config(cfg: &Config) -> Self {
        Self {
            connect: Duration::from_secs(cfg.deploy.connect_timeout_seconds),
            response: Duration::from_secs(cfg.deploy.upstream_timeout_seconds),
        }
    }
}

/// The worker thread's client to other members (awc is single-threaded),
/// with keep-alive connections and TLS trusting `peer_ca_file` only. `Err`
/// if the CA file cannot be loaded.
pub fn peer_client(peer_ca_file: &str, t: PeerTimeouts) -> Result<awc::Client, String> {
    let tls = TLS.get_or_init(|| tls_config(peer_ca_file)).clone()?;
    Ok(CLIENT.with(|c| {
        let mut c = c.borrow_mut();
        if let Some((key, client)) = c.as_ref()
            && *key == (t.connect, t.response)
        {
            return client.clone();
        }
        // `rustls_0_23` after `max_http_version`, which would replace it.
        let connector = awc::Connector::new()
            .timeout(t.connect)
            .max_http_version(actix_web::http::Version::HTTP_11)
            .rustls_0_23(tls)
            .limit(1024)
            .conn_keep_alive(Duration::from_secs(30));
        let client = awc::Client::builder()
            .connector(connector)
            .disable_redirects()
            .no_default_headers()
            .timeout(t.response)
            .finish();
        *c = Some(((t.connect, t.response), client.clone()));
        client
    }))
}

/// A GET of an internal route on the peer at `base`, signed as `hop` (hop
/// MAC V4 over an empty body), answered within `within` (connect included).
/// The forwarder's client and timeouts are reused, so its keep-alive
/// connections are shared; `within` bounds the whole call. `Ok` is the body
/// of a 200; anything else is `Err` with the reason. A peer advertising
/// `https://` without `peer_ca_file` is never asked.
pub async fn internal_get(
    hop_key: Option<&crate::auth::HopKey>,
    config: &crate::config::Config,
    base: &str,
    path: &str,
    query: &str,
    hop: &crate::auth::HopIdentity,
    within: Duration,
) -> Result<bytes::Bytes, String> {
    let call = InternalCall {
        method: actix_web::http::Method::GET,
        path,
        query,
        body: bytes::Bytes::new(),
        content_type: None,
        within,
    };
    match internal_call(hop_key, config, base, hop, call).await {
        Ok(a) if a.status == actix_web::http::StatusCode::OK => Ok(a.body),
        Ok(a) => Err(format!("answered {}", a.status)),
        Err(e) => Err(e.to_string()),
    }
}

/// One call of an internal route on a peer (see [`internal_call`]).
pub struct InternalCall<'a> {
    /// GET or POST.
    pub method: actix_web::http::Method,
    /// The route's path (`/v1/internal/...`).
    pub path: &'a str,
    /// The query string, without its `?`.
    pub query: &'a str,
    /// The body (its SHA-256 goes into the hop MAC).
    pub body: bytes::Bytes,
    /// The body's `Content-Type` (None: without one).
    pub content_type: Option<&'static str>,
    /// Bound on the whole call, connect included.
    pub within: Duration,
}

/// A peer's answer to an internal call: its status, whether its gateway
/// produced it (`x-meshgate-fault: gateway`), and its body.
pub struct PeerAnswer {
    /// The HTTP status.
    pub status: actix_web::http::StatusCode,
    /// A 502/503/504 of the peer's gateway itself, not of a function.
    pub gateway_fault: bool,
    /// The body, read whole.
    pub body: bytes::Bytes,
}

/// Why an internal call got no answer.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The peer was never reached (refused, unreachable, TLS refused, no
    /// client): it did not see the call, which may go to another peer.
    #[error("not connected: {0}")]
    Unconnected(String),
    /// The peer was reached (or may have been) and gave no whole answer in
    /// time: it may have acted on the call.
    #[error("no answer: {0}")]
    Failed(String),
}

/// Calls an internal route on the peer at `base` signed as `hop` (hop MAC
/// V4 over the body's digest), with the forwarder's client (keep-alive
/// connections shared). A peer advertising `https://` without
/// `peer_ca_file` is never asked (`Unconnected`).
pub async fn internal_call(
    hop_key: Option<&crate::auth::HopKey>,
    config: &crate::config::Config,
    base: &str,
    hop: &crate::auth::HopIdentity,
    call: InternalCall<'_>,
) -> Result<PeerAnswer, PeerError> {
    let key =
        hop_key.ok_or_else(|| PeerError::Unconnected("this node has no cluster secret".into()))?;
    let peer_ca = &config.cluster.peer_ca_file;
    if base.starts_with("https://") && peer_ca.is_empty() {
        return Err(PeerError::Unconnected(
            "the peer advertises https:// and peer_ca_file is not set".into(),
        ));
    }
    let client =
        peer_client(peer_ca, PeerTimeouts::from_config(config)).map_err(PeerError::Unconnected)?;
    let digest = crate::auth::hop_body_sha256(&call.body);
    let signed = crate::auth::HopRequest {
        method: call.method.as_str(),
        path: call.path,
        query: call.query,
        body_sha256: &digest,
    };
    let url = if call.query.is_empty() {
        format!("{base}{}", call.path)
    } else {
        format!("{base}{}?{}", call.path, call.query)
    };
    let mut req = client.request(call.method.clone(), url);
    for (k, v) in key.sign_headers(&signed, hop, crate::util::now()) {
        req = req.insert_header((k, v));
    }
    if let Some(ct) = call.content_type {
        req = req.insert_header(("content-type", ct));
    }
    let has_body = call.method != actix_web::http::Method::GET;
    let body = call.body.clone();
    let exchange = async {
        let sent = if has_body {
            req.send_body(body).await
        } else {
            req.send().await
        };
        let mut res = match sent {
            Ok(r) => r,
            Err(awc::error::SendRequestError::Connect(e)) => {
                return Err(PeerError::Unconnected(e.to_string()));
            }
            Err(e) => return Err(PeerError::Failed(e.to_string())),
        };
        let status = res.status();
        let gateway_fault = matches!(status.as_u16(), 502..=504)
            && res.headers().contains_key(GATEWAY_FAULT_HEADER);
        let body = res
            .body()
            .limit(MAX_INTERNAL_ANSWER)
            .await
            .map_err(|e| PeerError::Failed(e.to_string()))?;
        Ok(PeerAnswer {
            status,
            gateway_fault,
            body,
        })
    };
    match actix_web::rt::time::timeout(call.within, exchange).await {
        Ok(r) => r,
        Err(_) => Err(PeerError::Failed(format!(
            "no answer within {:?}",
            call.within
        ))),
    }
}

/// The header a node's own 502/503/504 carries (`http/error.rs`
/// `GATEWAY_FAULT`; named here so placement does not import the HTTP layer).
const GATEWAY_FAULT_HEADER: &str = "x-meshgate-fault";

/// Largest answer an internal call reads: a function's output (1 MiB at
/// most) as JSON, or an error envelope, with room to spare.
const MAX_INTERNAL_ANSWER: usize = 16 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    /// The bound covers the largest route limit and then some.
    #[test]
    fn body_limit_covers_every_route() {
        let mut cfg = Config::default();
        cfg.server.max_body_bytes = 10;
        cfg.functions.max_module_bytes = 20;
        cfg.deploy.max_site_bytes = 30;
        assert_eq!(hop_body_limit(&cfg), 30 + MULTIPART_SLACK);
        cfg.server.max_body_bytes = 100;
        assert_eq!(hop_body_limit(&cfg), 100 + MULTIPART_SLACK);
    }

    /// A hop's timeouts are the `[deploy]` connect and upstream ones, each in its field.
    #[test]
    fn timeouts_from_deploy_config() {
        let mut cfg = Config::default();
        cfg.deploy.connect_timeout_seconds = 3;
        cfg.deploy.upstream_timeout_seconds = 17;
        let t = PeerTimeouts::from_config(&cfg);
        assert_eq!(t.connect, Duration::from_secs(3));
        assert_eq!(t.response, Duration::from_secs(17));
    }

    /// A file with no certificate, or none at all, is refused with its name.
    #[test]
    fn peer_roots_refused() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "nothing here\n").unwrap();
        let e = load_peer_roots(&empty).unwrap_err();
        assert!(e.contains("empty.pem"), "{e}");
        let e = load_peer_roots(&dir.path().join("missing.pem")).unwrap_err();
        assert!(e.contains("cannot read"), "{e}");
    }
}
