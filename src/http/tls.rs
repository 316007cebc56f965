//! TLS terminated by the node (docs/design.md §2): rustls with the ring provider, a
//! certificate resolver that picks a deployment host's own certificate by SNI
//! (`deploy::certs`, a map swapped whole: no lock on a handshake) and
//! otherwise serves the node's pair, re-read from its files when they change (no restart),
//! ALPN for HTTP/2 and HTTP/1.1, and the connection's SNI kept so that domain
//! routing can answer 421 when a request's Host disagrees with it.

use crate::deploy::certs::ServedCerts;
use crate::http::chain::context::Sni;
use arc_swap::ArcSwap;
use rustls::crypto::ring::sign::any_supported_type;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Reads a certificate chain and its key from PEM files.
pub fn load_certified_key(cert: &Path, key: &Path) -> anyhow::Result<CertifiedKey> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| anyhow::anyhow!("cannot read tls.cert_file {}: {e}", cert.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("tls.cert_file {} is not PEM: {e}", cert.display()))?;
    if chain.is_empty() {
        anyhow::bail!("tls.cert_file {} holds no certificate", cert.display());
    }
    let key_der = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| anyhow::anyhow!("cannot read tls.key_file {}: {e}", key.display()))?;
    let signer = any_supported_type(&key_der)
        .map_err(|e| anyhow::anyhow!("tls.key_file {}: {e}", key.display()))?;
    let ck = CertifiedKey::new(chain, signer);
    ck.keys_match()
        .map_err(|e| anyhow::anyhow!("the TLS key does not match the certificate: {e}"))?;
    Ok(ck)
}

/// The DNS names on the certificate's end-entity certificate (its subject
/// alternative names, wildcards such as `*.example.com` included): requests
/// by these names are the node's (`crate::deploy::hosts`).
pub fn dns_names(ck: &CertifiedKey) -> Vec<String> {
    let Ok(der) = ck.end_entity_cert() else {
        return Vec::new();
    };
    match webpki::EndEntityCert::try_from(der) {
        Ok(cert) => cert.valid_dns_names().map(str::to_string).collect(),
        Err(e) => {
            tracing::warn!(error = %e, "The TLS certificate's names could not be read.");
            Vec::new()
        }
    }
}

/// The certificate for each connection: the deployment host's own when the
/// SNI names one that has one, else the node's pair (swapped when its files
/// change). Both are read lock-free.
#[derive(Debug)]
pub struct ReloadingResolver {
    /// The node's own pair: API hosts, unknown names, no SNI.
    current: ArcSwap<CertifiedKey>,
    /// Deployment hosts' certificates, by host (lower case).
    hosts: ServedCerts,
    /// TLS-ALPN-01 challenge certificates, by host (`deploy::acme`): a
    /// handshake offering ALPN `acme-tls/1` gets one of these or nothing.
    acme: ServedCerts,
}

/// The ALPN protocol of TLS-ALPN-01 validation (RFC 8737).
pub const ACME_TLS_ALPN: &[u8] = b"acme-tls/1";

impl ResolvesServerCert for ReloadingResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        if hello
            .alpn()
            .is_some_and(|mut protos| protos.any(|p| p == ACME_TLS_ALPN))
        {
            // A CA's validator: the challenge certificate, never a served one.
            let name = hello.server_name()?.to_ascii_lowercase();
            return self.acme.load().get(&name).cloned();
        }
        if let Some(name) = hello.server_name() {
            let hosts = self.hosts.load();
            if !hosts.is_empty() {
                let found = if name.bytes().any(|b| b.is_ascii_uppercase()) {
                    hosts.get(&name.to_ascii_lowercase())
                } else {
                    hosts.get(name)
                };
                if let Some(ck) = found {
                    return Some(ck.clone());
                }
            }
        }
        Some(self.current.load_full())
    }
}

fn mtimes(a: &Path, b: &Path) -> Option<(SystemTime, SystemTime)> {
    let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    Some((m(a)?, m(b)?))
}

/// The server config for `cert`/`key`, and a thread that reloads them when their
/// modification times change. A broken new pair is logged and the old one kept.
/// `on_names` gets each certificate's DNS names ([`dns_names`]) before it is
/// served: the first one's, then each reloaded one's. `hosts` are the
/// deployment hosts' own certificates, chosen by SNI before the node's pair.
pub fn server_config(
    cert: PathBuf,
    key: PathBuf,
    hosts: ServedCerts,
    acme: ServedCerts,
    check_every: Duration,
    acme_alpn: bool,
    on_names: impl Fn(&[String]) + Send + 'static,
) -> anyhow::Result<rustls::ServerConfig> {
    let first = load_certified_key(&cert, &key)?;
    on_names(&dns_names(&first));
    let resolver = Arc::new(ReloadingResolver {
        current: ArcSwap::from_pointee(first),
        hosts,
        acme,
    });
    let weak = Arc::downgrade(&resolver);
    let mut seen = mtimes(&cert, &key);
    std::thread::Builder::new()
        .name("tls-reload".into())
        .spawn(move || {
            loop {
                // Audited: this thread only polls two files' times.
                #[allow(clippy::disallowed_methods)]
                std::thread::sleep(check_every);
                let Some(r) = weak.upgrade() else { return };
                let now = mtimes(&cert, &key);
                if now.is_none() || now == seen {
                    continue;
                }
                match load_certified_key(&cert, &key) {
                    Ok(ck) => {
                        on_names(&dns_names(&ck));
                        r.current.store(Arc::new(ck));
                        seen = now;
                        tracing::info!(cert = %cert.display(), "TLS certificate reloaded.");
                    }
                    // Possibly caught between the two files being written: try again next tick.
                    Err(e) => tracing::warn!(error = %e, "TLS certificate not reloaded."),
                }
            }
        })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| anyhow::anyhow!("TLS set-up: {e}"))?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    if acme_alpn {
        cfg.alpn_protocols.push(ACME_TLS_ALPN.to_vec());
    }
    Ok(cfg)
}

/// Keeps the SNI of each TLS connection in its connection data.
pub fn on_connect(conn: &dyn std::any::Any, ext: &mut actix_web::dev::Extensions) {
    if let Some(tls) = conn
        .downcast_ref::<actix_tls::accept::rustls_0_23::TlsStream<actix_web::rt::net::TcpStream>>()
    {
        let sni = tls.get_ref().1.server_name().map(str::to_ascii_lowercase);
        ext.insert(Sni(sni));
    }
}
