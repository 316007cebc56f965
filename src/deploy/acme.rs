//! Certificates of deployments with `tls: "auto"`, ordered from an ACME CA
//! (RFC 8555) configured in `[tls.acme]` (docs/deployments.md "ACME").
//!
//! - Every `check_seconds` each node looks at the `tls: "auto"` deployments
//!   of its routing index: one whose certificate is missing, does not cover
//!   its hosts, or is past its renewal time (two thirds of its lifetime, or
//!   `renew_after_seconds`) is due, unless its last failure's backoff runs.
//! - One node orders per deployment: it takes `acmelock/<ns>/<name>` with a
//!   compare-and-swap that expires after `order_timeout_seconds` (sled and
//!   etcd alike), so a node that dies mid-order frees it.
//! - Challenge answers live in the store with the same time to live:
//!   HTTP-01 key authorizations under `acmechal/http/<token>` (answered on
//!   `[tls.acme] http_listen` by every node), TLS-ALPN-01 certificates under
//!   `acmechal/alpn/<host>` (every node loads them into the map its TLS
//!   resolver answers `acme-tls/1` handshakes from).
//! - The issued chain and key are stored exactly as an upload is
//!   ([`super::Deployments::store_issued`]: validated, key sealed, a new
//!   generation), so every node serves it as it follows the generation.
//! - The order's outcome is `acmestate/<ns>/<name>`: `pending`, `valid` or
//!   `failed` with the last error and the next attempt (doubling backoff
//!   from `retry_min_seconds` to `retry_max_seconds`), shown by
//!   `GET /v1/deployments/{name}/certificate` and counted in `/metrics`.

use super::Deployments;
use super::certs::CertRecord;
use crate::config::AcmeConfig;
use crate::storage::{OrderedKv, Store};
use bytes::Bytes;
use instant_acme::{
    Account, AuthorizationStatus, BodyWrapper, BytesResponse, ChallengeType, Identifier,
    NewAccount, NewOrder, OrderStatus, RetryPolicy,
};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// A deployment with `tls: "auto"` and its routed hosts.
#[derive(Debug, Clone)]
pub struct AutoTls {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub deployment: String,
    /// The hosts of its active version the node routes (one certificate
    /// names them all).
    pub hosts: Vec<String>,
}

/// The store key of a deployment's ACME state.
pub fn state_key(ns: &str, name: &str) -> Vec<u8> {
    format!("acmestate/{ns}/{name}").into_bytes()
}

/// Orders one namespace may start in any hour, cluster-wide (its deployments
/// together): a tenant churning hosts cannot spend the node's ACME account's
/// rate limits, which every tenant shares.
pub const ORDERS_PER_NAMESPACE_PER_HOUR: usize = 20;

/// `acmeorders/<ns>`: when the namespace's orders of the last hour started.
fn orders_key(ns: &str) -> Vec<u8> {
    format!("acmeorders/{ns}").into_bytes()
}

/// The start times of the last hour in `times` (as of `now`), and whether
/// another order may start now; if not, when it may (the oldest one's hour
/// over).
fn order_budget(times: &[u64], now: u64) -> (Vec<u64>, Result<(), u64>) {
    let mut kept: Vec<u64> = times.iter().copied().filter(|t| t + 3600 > now).collect();
    kept.sort_unstable();
    if kept.len() >= ORDERS_PER_NAMESPACE_PER_HOUR {
        let at = kept[kept.len() - ORDERS_PER_NAMESPACE_PER_HOUR] + 3600;
        return (kept, Err(at));
    }
    (kept, Ok(()))
}

fn lock_key(ns: &str, name: &str) -> Vec<u8> {
    format!("acmelock/{ns}/{name}").into_bytes()
}

/// The store key of an HTTP-01 key authorization.
pub fn http_token_key(token: &str) -> Vec<u8> {
    format!("acmechal/http/{token}").into_bytes()
}

/// Where TLS-ALPN-01 challenge certificates are kept, by host.
const ALPN_PREFIX: &str = "acmechal/alpn/";

/// Whether `token` can be an ACME token (base64url, RFC 8555 §8.1): the
/// HTTP-01 path takes nothing else to the store.
pub fn valid_token(token: &str) -> bool {
    !token.is_empty()
        && token.len() <= 256
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A deployment's ACME state as stored.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AcmeState {
    /// `pending`, `valid` or `failed`.
    pub state: String,
    /// The last failure's reason (cleared by a success).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Failures in a row.
    #[serde(default)]
    pub failures: u32,
    /// After a failure: no order before this (Unix seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_attempt: Option<u64>,
    /// When the last order started (Unix seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_attempt: Option<u64>,
    /// When the current certificate was issued (Unix seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issued_at: Option<u64>,
    /// When the current certificate is renewed (Unix seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_at: Option<u64>,
    /// Orders made for this deployment, all nodes together.
    #[serde(default)]
    pub orders: u64,
}

/// When `cert` is due for renewal: `renew_after` seconds after its
/// `notBefore`, or (0) at two thirds of its lifetime.
pub fn renew_at(cert: &CertRecord, renew_after: u64) -> i64 {
    if renew_after > 0 {
        cert.not_before.saturating_add(renew_after as i64)
    } else {
        cert.not_before + (cert.not_after - cert.not_before).max(0) * 2 / 3
    }
}

/// The `acme` object of `GET /v1/deployments/{name}/certificate`.
pub fn view(
    state: Option<&AcmeState>,
    cert: Option<&CertRecord>,
    hosts: &[String],
    now: i64,
) -> Value {
    let covered = cert.is_some_and(|c| {
        c.not_after > now && hosts.iter().all(|h| super::certs::record_covers(c, h))
    });
    let s = match state {
        Some(s) if !s.state.is_empty() => s.state.clone(),
        _ if covered => "valid".into(),
        _ => "pending".into(),
    };
    let t = |v: Option<u64>| v.map(|t| json!(super::certs::rfc3339(t as i64)));
    json!({
        "state": s,
        "last_error": state.and_then(|s| s.last_error.clone()),
        "failures": state.map_or(0, |s| s.failures),
        "next_attempt": t(state.and_then(|s| s.next_attempt)),
        "last_attempt": t(state.and_then(|s| s.last_attempt)),
        "issued_at": t(state.and_then(|s| s.issued_at)),
        "renew_at": t(state.and_then(|s| s.renew_at)),
        "orders": state.map_or(0, |s| s.orders),
    })
}

/// The HTTPS client instant-acme talks to the CA with: one connection per
/// request (an order makes a dozen), hyper's HTTP/1.1 over tokio-rustls on
/// ring, trusting `[tls.acme] ca_bundle` or the public webpki roots.
#[derive(Clone)]
struct AcmeHttp {
    tls: tokio_rustls::TlsConnector,
}

fn other(e: impl std::fmt::Display) -> instant_acme::Error {
    instant_acme::Error::Other(e.to_string().into())
}

impl AcmeHttp {
    fn new(cfg: &AcmeConfig) -> anyhow::Result<AcmeHttp> {
        let roots = if cfg.ca_bundle.is_empty() {
            actix_tls::connect::rustls_0_23::webpki_roots_cert_store()
        } else {
            let mut roots = rustls::RootCertStore::empty();
            let certs = CertificateDer::pem_file_iter(&cfg.ca_bundle)
                .map_err(|e| anyhow::anyhow!("tls.acme.ca_bundle {}: {e}", cfg.ca_bundle))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| anyhow::anyhow!("tls.acme.ca_bundle {}: {e}", cfg.ca_bundle))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                anyhow::bail!(
                    "tls.acme.ca_bundle {}: no usable certificate",
                    cfg.ca_bundle
                );
            }
            roots
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut c = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| anyhow::anyhow!("TLS set-up: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        c.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(AcmeHttp {
            tls: tokio_rustls::TlsConnector::from(Arc::new(c)),
        })
    }
}

impl instant_acme::HttpClient for AcmeHttp {
    fn request(
        &self,
        req: http::Request<BodyWrapper<Bytes>>,
    ) -> Pin<Box<dyn Future<Output = Result<BytesResponse, instant_acme::Error>> + Send>> {
        let tls = self.tls.clone();
        Box::pin(async move {
            let (mut parts, body) = req.into_parts();
            if parts.uri.scheme_str() != Some("https") {
                return Err(other(format!("{} is not an https:// URL", parts.uri)));
            }
            let authority = parts
                .uri
                .authority()
                .cloned()
                .ok_or_else(|| other("a URL without a host"))?;
            let host = authority
                .host()
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = authority.port_u16().unwrap_or(443);
            let io = tokio::time::timeout(
                Duration::from_secs(30),
                tokio::net::TcpStream::connect((host.as_str(), port)),
            )
            .await
            .map_err(|_| other(format!("connecting to {authority} timed out")))?
            .map_err(|e| other(format!("cannot connect to {authority}: {e}")))?;
            let _ = io.set_nodelay(true);
            let name = ServerName::try_from(host.clone()).map_err(other)?;
            let stream = tokio::time::timeout(Duration::from_secs(30), tls.connect(name, io))
                .await
                .map_err(|_| other(format!("TLS to {authority} timed out")))?
                .map_err(|e| other(format!("TLS to {authority}: {e}")))?;
            let (mut send, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .map_err(other)?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            let origin = parts
                .uri
                .path_and_query()
                .map_or("/", |p| p.as_str())
                .to_string();
            parts.uri = origin.parse().map_err(other)?;
            parts.headers.insert(
                http::header::HOST,
                http::HeaderValue::from_str(authority.as_str()).map_err(other)?,
            );
            let rsp = tokio::time::timeout(
                Duration::from_secs(60),
                send.send_request(http::Request::from_parts(parts, body)),
            )
            .await
            .map_err(|_| other(format!("{authority} did not answer in time")))?
            .map_err(other)?;
            Ok(BytesResponse::from(rsp))
        })
    }
}

/// Orders and renews the certificates of `tls: "auto"` deployments.
pub struct Acme {
    cfg: AcmeConfig,
    deployments: Arc<Deployments>,
    store: Store,
    http: AcmeHttp,
    account: tokio::sync::Mutex<Option<Account>>,
    orders: prometheus::IntCounterVec,
    certificates: prometheus::IntGaugeVec,
}

fn alpn_challenge(challenge: &str) -> bool {
    challenge == "tls-alpn-01"
}

/// A TLS-ALPN-01 certificate as stored.
#[derive(Serialize, Deserialize)]
struct AlpnCert {
    cert_pem: String,
    key_pem: String,
}

impl AlpnCert {
    fn certified(&self) -> Option<Arc<CertifiedKey>> {
        let chain = CertificateDer::pem_slice_iter(self.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .ok()?;
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).ok()?;
        let signer = rustls::crypto::ring::sign::any_supported_type(&key).ok()?;
        Some(Arc::new(CertifiedKey::new(chain, signer)))
    }
}

/// The RFC 8737 certificate for `host`: self-signed, its one name `host`,
/// the critical `acmeIdentifier` extension holding `digest` (SHA-256 of the
/// key authorization).
fn alpn_cert(host: &str, digest: &[u8]) -> Result<AlpnCert, String> {
    let key = acme_rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    let mut p =
        acme_rcgen::CertificateParams::new(vec![host.to_string()]).map_err(|e| e.to_string())?;
    p.custom_extensions = vec![acme_rcgen::CustomExtension::new_acme_identifier(digest)];
    let cert = p.self_signed(&key).map_err(|e| e.to_string())?;
    Ok(AlpnCert {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

impl Acme {
    /// The manager of `cfg`, counting into `metrics`.
    pub fn new(
        cfg: AcmeConfig,
        deployments: Arc<Deployments>,
        store: Store,
        metrics: &crate::metrics::Metrics,
    ) -> anyhow::Result<Arc<Acme>> {
        Ok(Arc::new(Acme {
            http: AcmeHttp::new(&cfg)?,
            cfg,
            deployments,
            store,
            account: tokio::sync::Mutex::new(None),
            orders: metrics.acme_orders.clone(),
            certificates: metrics.acme_certificates.clone(),
        }))
    }

    /// Starts the node's checks (and, for TLS-ALPN-01, the refresh of the
    /// challenge certificates every second). They end with the runtime.
    pub fn start(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(me.cfg.check_seconds));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                me.check().await;
            }
        });
        if alpn_challenge(&self.cfg.challenge) {
            let me = self.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    if let Err(e) = me.refresh_alpn().await {
                        tracing::warn!(error = %e, "Could not read the TLS-ALPN-01 challenges.");
                    }
                }
            });
        }
    }

    /// Loads the stored TLS-ALPN-01 certificates into the TLS resolver's map.
    async fn refresh_alpn(&self) -> crate::storage::StoreResult<()> {
        let mut map = HashMap::new();
        for (k, v) in self.store.scan_prefix(ALPN_PREFIX.as_bytes(), 1024).await? {
            let host = String::from_utf8_lossy(&k[ALPN_PREFIX.len()..]).into_owned();
            if let Some(ck) = serde_json::from_slice::<AlpnCert>(&v)
                .ok()
                .and_then(|c| c.certified())
            {
                map.insert(host, ck);
            }
        }
        let current = self.deployments.acme_alpn.load();
        if current.len() != map.len() || map.keys().any(|h| !current.contains_key(h)) {
            self.deployments.acme_alpn.store(Arc::new(map));
        }
        Ok(())
    }

    /// One pass over the `tls: "auto"` deployments.
    async fn check(&self) {
        let now = crate::util::now();
        let mut counts: HashMap<&'static str, i64> = [("pending", 0), ("valid", 0), ("failed", 0)]
            .into_iter()
            .collect();
        for a in self.deployments.auto_tls() {
            let state = match self.ensure(&a, now).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(namespace = %a.namespace, deployment = %a.deployment, error = %e, "ACME check failed.");
                    "pending"
                }
            };
            *counts.entry(state).or_default() += 1;
        }
        for (s, n) in counts {
            self.certificates.with_label_values(&[s]).set(n);
        }
    }

    /// Orders `a`'s certificate if it is due and this node wins its lock.
    /// Returns its state afterwards.
    async fn ensure(&self, a: &AutoTls, now: u64) -> Result<&'static str, String> {
        let (ns, name) = (a.namespace.as_str(), a.deployment.as_str());
        let state = self.read_state(ns, name).await?;
        let cert = self
            .store
            .get_json::<CertRecord>(&super::certs::cert_key(ns, name))
            .await
            .map_err(|e| e.to_string())?;
        if !self.due(cert.as_ref(), &a.hosts, now) {
            // A certificate that serves (uploaded after a failure, say) ends
            // the failed state.
            if let Some(mut s) = state.filter(|s| s.state != "valid") {
                s.state = "valid".into();
                s.last_error = None;
                s.failures = 0;
                s.next_attempt = None;
                self.write_state(ns, name, &s).await?;
            }
            return Ok("valid");
        }
        let label = match &state {
            Some(s) if s.state == "failed" => "failed",
            _ => "pending",
        };
        if state
            .as_ref()
            .and_then(|s| s.next_attempt)
            .is_some_and(|t| t > now)
        {
            return Ok(label);
        }
        let token = crate::util::random_bytes::<16>().to_vec();
        let lock = lock_key(ns, name);
        let ttl = Duration::from_secs(self.cfg.order_timeout_seconds + 30);
        if !self
            .store
            .compare_and_swap(&lock, None, Some(&token), Some(ttl))
            .await
            .map_err(|e| e.to_string())?
        {
            // Another node orders it.
            return Ok(label);
        }
        let outcome = self.ordered_under_lock(a, now).await;
        if let Err(e) = self
            .store
            .compare_and_swap(&lock, Some(&token), None, None)
            .await
        {
            tracing::warn!(error = %e, "Could not release the ACME order lock; it expires by itself.");
        }
        outcome
    }

    /// With the lock held: checks again (another node may have just
    /// finished), then orders and records the outcome.
    async fn ordered_under_lock(&self, a: &AutoTls, now: u64) -> Result<&'static str, String> {
        let (ns, name) = (a.namespace.as_str(), a.deployment.as_str());
        let mut state = self.read_state(ns, name).await?.unwrap_or_default();
        let cert = self
            .store
            .get_json::<CertRecord>(&super::certs::cert_key(ns, name))
            .await
            .map_err(|e| e.to_string())?;
        if !self.due(cert.as_ref(), &a.hosts, now) {
            return Ok("valid");
        }
        if state.next_attempt.is_some_and(|t| t > now) {
            return Ok(if state.state == "failed" {
                "failed"
            } else {
                "pending"
            });
        }
        if let Err(at) = self.take_order_slot(ns, now).await? {
            state.state = if state.state == "failed" {
                "failed".into()
            } else {
                "pending".into()
            };
            state.last_error = Some(format!(
                "the namespace started {ORDERS_PER_NAMESPACE_PER_HOUR} certificate orders in the last hour (the limit)"
            ));
            state.next_attempt = Some(at);
            self.write_state(ns, name, &state).await?;
            return Ok(if state.state == "failed" {
                "failed"
            } else {
                "pending"
            });
        }
        state.last_attempt = Some(now);
        state.orders += 1;
        if state.state.is_empty() {
            state.state = "pending".into();
        }
        self.write_state(ns, name, &state).await?;
        tracing::info!(namespace = ns, deployment = name, hosts = ?a.hosts, challenge = %self.cfg.challenge, "Ordering a certificate by ACME.");
        let timeout = Duration::from_secs(self.cfg.order_timeout_seconds);
        let result = match tokio::time::timeout(timeout, self.order(a)).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "the order took longer than {}s (tls.acme.order_timeout_seconds)",
                self.cfg.order_timeout_seconds
            )),
        };
        let result = match result {
            Ok((chain, key)) => self
                .deployments
                .store_issued(ns, name, chain.as_bytes(), key.as_bytes())
                .await
                .map_err(|e| format!("the issued certificate was not stored: {}", e.message)),
            Err(e) => Err(e),
        };
        let done = crate::util::now();
        match result {
            Ok(rec) => {
                self.orders.with_label_values(&["issued"]).inc();
                state.state = "valid".into();
                state.last_error = None;
                state.failures = 0;
                state.next_attempt = None;
                state.issued_at = Some(done);
                state.renew_at = Some(renew_at(&rec, self.cfg.renew_after_seconds).max(0) as u64);
                tracing::info!(namespace = ns, deployment = name, not_after = %super::certs::rfc3339(rec.not_after), "Certificate issued by ACME.");
                self.write_state(ns, name, &state).await?;
                Ok("valid")
            }
            Err(e) => {
                self.orders.with_label_values(&["failed"]).inc();
                state.state = "failed".into();
                state.failures = state.failures.saturating_add(1);
                let wait = self
                    .cfg
                    .retry_min_seconds
                    .saturating_mul(1u64 << (state.failures - 1).min(30))
                    .min(self.cfg.retry_max_seconds);
                state.next_attempt = Some(done + wait);
                tracing::warn!(namespace = ns, deployment = name, error = %e, retry_in_seconds = wait, "ACME order failed.");
                state.last_error = Some(e);
                self.write_state(ns, name, &state).await?;
                Ok("failed")
            }
        }
    }

    /// Takes one of the namespace's orders of this hour
    /// ([`ORDERS_PER_NAMESPACE_PER_HOUR`], kept in the store so every node
    /// counts the same), or says when the next one is free.
    async fn take_order_slot(&self, ns: &str, now: u64) -> Result<Result<(), u64>, String> {
        let key = orders_key(ns);
        loop {
            let raw = self.store.get(&key).await.map_err(|e| e.to_string())?;
            let times: Vec<u64> = raw
                .as_deref()
                .and_then(|r| serde_json::from_slice(r).ok())
                .unwrap_or_default();
            let (mut kept, verdict) = order_budget(&times, now);
            if let Err(at) = verdict {
                return Ok(Err(at));
            }
            kept.push(now);
            let new = serde_json::to_vec(&kept).map_err(|e| e.to_string())?;
            if self
                .store
                .compare_and_swap(
                    &key,
                    raw.as_deref(),
                    Some(&new),
                    Some(Duration::from_secs(3600)),
                )
                .await
                .map_err(|e| e.to_string())?
            {
                return Ok(Ok(()));
            }
        }
    }

    /// Whether a deployment with `cert` (if any) needs a new one at `now`.
    fn due(&self, cert: Option<&CertRecord>, hosts: &[String], now: u64) -> bool {
        match cert {
            None => true,
            Some(c) => {
                !hosts.iter().all(|h| super::certs::record_covers(c, h))
                    || now as i64 >= renew_at(c, self.cfg.renew_after_seconds)
            }
        }
    }

    /// The stored state, noted in memory for the dashboard as read.
    async fn read_state(&self, ns: &str, name: &str) -> Result<Option<AcmeState>, String> {
        let s = self
            .store
            .get_json::<AcmeState>(&state_key(ns, name))
            .await
            .map_err(|e| e.to_string())?;
        self.deployments.note_acme(ns, name, s.as_ref());
        Ok(s)
    }

    async fn write_state(&self, ns: &str, name: &str, s: &AcmeState) -> Result<(), String> {
        // A deployment deleted meanwhile keeps no state.
        if self
            .store
            .get(&super::model::dep_key(ns, name))
            .await
            .map_err(|e| e.to_string())?
            .is_none()
        {
            return Ok(());
        }
        self.store
            .put_json(&state_key(ns, name), s)
            .await
            .map_err(|e| e.to_string())?;
        self.deployments.note_acme(ns, name, Some(s));
        Ok(())
    }

    /// The node's account at the CA (created on first use, kept in memory).
    async fn account(&self) -> Result<Account, String> {
        let mut slot = self.account.lock().await;
        if let Some(a) = slot.as_ref() {
            return Ok(a.clone());
        }
        let contact = format!("mailto:{}", self.cfg.email.trim());
        let (account, _) = Account::builder_with_http(Box::new(self.http.clone()))
            .create(
                &NewAccount {
                    contact: &[&contact],
                    terms_of_service_agreed: true,
                    only_return_existing: false,
                },
                self.cfg.directory.clone(),
                None,
            )
            .await
            .map_err(|e| {
                format!(
                    "the ACME account at {} could not be created: {e}",
                    self.cfg.directory
                )
            })?;
        *slot = Some(account.clone());
        Ok(account)
    }

    /// One order for `a`'s hosts: its challenges answered, then finalized.
    /// Returns the chain and the private key, in PEM.
    async fn order(&self, a: &AutoTls) -> Result<(String, String), String> {
        let account = self.account().await?;
        let ids: Vec<Identifier> = a.hosts.iter().map(|h| Identifier::Dns(h.clone())).collect();
        let mut order = account
            .new_order(&NewOrder::new(&ids))
            .await
            .map_err(|e| format!("new order: {e}"))?;
        let alpn = alpn_challenge(&self.cfg.challenge);
        let ttl = Duration::from_secs(self.cfg.order_timeout_seconds + 30);
        let mut written: Vec<Vec<u8>> = Vec::new();
        let result = async {
            let mut authzs = order.authorizations();
            while let Some(r) = authzs.next().await {
                let mut authz = r.map_err(|e| format!("authorization: {e}"))?;
                match authz.status {
                    AuthorizationStatus::Pending => {}
                    AuthorizationStatus::Valid => continue,
                    other => return Err(format!("an authorization is {other:?}")),
                }
                let ty = if alpn {
                    ChallengeType::TlsAlpn01
                } else {
                    ChallengeType::Http01
                };
                let mut ch = authz
                    .challenge(ty.clone())
                    .ok_or_else(|| format!("the CA offers no {ty:?} challenge"))?;
                let host = ch.identifier().to_string();
                let ka = ch.key_authorization();
                if alpn {
                    let c = alpn_cert(&host, ka.digest().as_ref())?;
                    let key = format!("{ALPN_PREFIX}{host}").into_bytes();
                    self.store
                        .put_ttl(
                            &key,
                            &serde_json::to_vec(&c).map_err(|e| e.to_string())?,
                            ttl,
                        )
                        .await
                        .map_err(|e| e.to_string())?;
                    written.push(key);
                    self.refresh_alpn().await.map_err(|e| e.to_string())?;
                } else {
                    let key = http_token_key(&ch.token);
                    self.store
                        .put_ttl(&key, ka.as_str().as_bytes(), ttl)
                        .await
                        .map_err(|e| e.to_string())?;
                    written.push(key);
                }
                ch.set_ready()
                    .await
                    .map_err(|e| format!("challenge for {host}: {e}"))?;
            }
            let policy = RetryPolicy::new()
                .initial_delay(Duration::from_millis(250))
                .backoff(1.5)
                .timeout(Duration::from_secs(self.cfg.order_timeout_seconds));
            let status = order
                .poll_ready(&policy)
                .await
                .map_err(|e| format!("waiting for validation: {e}"))?;
            if status != OrderStatus::Ready {
                let mut why = Vec::new();
                let mut authzs = order.authorizations();
                while let Some(Ok(authz)) = authzs.next().await {
                    for c in &authz.challenges {
                        if let Some(p) = &c.error {
                            why.push(format!(
                                "{}: {}",
                                authz.identifier(),
                                p.detail.clone().unwrap_or_else(|| format!("{p:?}"))
                            ));
                        }
                    }
                }
                return Err(format!(
                    "the order is {status:?}{}",
                    if why.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", why.join("; "))
                    }
                ));
            }
            let key_pem = order
                .finalize()
                .await
                .map_err(|e| format!("finalize: {e}"))?;
            let chain = order
                .poll_certificate(&policy)
                .await
                .map_err(|e| format!("certificate: {e}"))?;
            Ok((chain, key_pem))
        }
        .await;
        for k in written {
            let _ = self.store.delete(&k).await;
        }
        if alpn {
            let _ = self.refresh_alpn().await;
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A namespace starts at most the hourly number of orders: the next is
    /// refused until the oldest of the hour is an hour old; older starts do
    /// not count and are dropped.
    #[test]
    fn orders_per_namespace_are_bounded_per_hour() {
        let now = 100_000;
        let full: Vec<u64> = (0..ORDERS_PER_NAMESPACE_PER_HOUR as u64)
            .map(|i| now - 3000 + i)
            .collect();
        let (kept, verdict) = order_budget(&full, now);
        assert_eq!(kept.len(), ORDERS_PER_NAMESPACE_PER_HOUR);
        assert_eq!(verdict, Err(now - 3000 + 3600));
        // One fewer: allowed.
        assert_eq!(order_budget(&full[1..], now).1, Ok(()));
        // Starts older than an hour are dropped and free the budget.
        let mut old = full.clone();
        old[0] = now - 3600;
        let (kept, verdict) = order_budget(&old, now);
        assert_eq!(kept.len(), ORDERS_PER_NAMESPACE_PER_HOUR - 1);
        assert_eq!(verdict, Ok(()));
        // Once the oldest's hour is over, the next order may start.
        assert_eq!(order_budget(&full, now - 3000 + 3600).1, Ok(()));
    }
}
