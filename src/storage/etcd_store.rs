//! The cluster backend: etcd (docs/design.md §6), built with the cargo feature `cluster`.
//!
//! # Layout in etcd
//! Everything lives under `meshgate/`, so the store can share an etcd cluster:
//! - `meshgate/d/<key>` is the record of each key: `0x00` followed by the value
//!   (inline), or `0x01` followed by a chunk header (generation, length, chunk
//!   count, CRC-32) when the value does not fit one etcd request.
//! - `meshgate/c/<generation>/<index>` holds the chunks of one write of a large
//!   value. Scans range over `meshgate/d/` only, so they never see chunks.
//!
//! # Writes
//! A write (put, CAS, batch) is one etcd transaction when it fits etcd's request
//! limits, chunks included. A larger one puts its chunks first under a pending
//! lease, then its records in a transaction that also moves the chunks to their
//! final lease: a writer that dies in between leaves nothing once the pending
//! lease runs out. Chunks a write replaced are removed after it.
//!
//! A time to live is an etcd lease, one per write (TTL rounded up to whole
//! seconds), so a lease holds at most one record and its chunks. Every request
//! has a deadline ([`REQUEST_TIMEOUT`]); every etcd or network failure is
//! [`StoreError::Unavailable`].

use super::{BatchOp, OrderedKv, StoreError, StoreResult};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, EventType, GetOptions, KeyValue,
    KvClient, LeaseClient, PutOptions, Txn, TxnOp, TxnOpResponse, WatchClient, WatchOptions,
    WatchStream,
};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Deadline of each etcd request; past it the operation fails as unavailable.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// Deadline of opening a connection to an etcd endpoint.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// HTTP/2 pings, so a connection that died silently is noticed.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// How long a keep-alive ping may go unanswered before the connection is dropped.
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(3);
/// Bytes one request may carry. etcd's default `--max-request-bytes` is 1.5 MiB;
/// the rest is left for framing.
const REQUEST_BUDGET: usize = 1_400_000;
/// Framing bytes counted for each operation of a request.
const OP_OVERHEAD: usize = 64;
/// Size of one chunk of a large value.
const CHUNK_BYTES: usize = 1 << 20;
/// Operations one transaction may hold: etcd's default `--max-txn-ops`.
const MAX_TXN_OPS: usize = 128;
/// Reads and decisions a guarded change (`transact`) makes before it gives up.
pub const TRANSACT_ATTEMPTS: usize = 64;
/// Keys read per request of a scan.
const SCAN_PAGE: i64 = 64;
/// Chunks read per request when a large value is assembled.
const CHUNK_PAGE: i64 = 16;
/// Largest response accepted from etcd (a page of a scan of large values).
const MAX_RESPONSE_BYTES: usize = 256 << 20;
/// Seconds chunks written ahead of their record live if the record never comes.
const PENDING_CHUNK_TTL: i64 = 300;

/// Prefix of every key's record; scans range over it only.
const DATA: &[u8] = b"meshgate/d/";
/// Prefix of the chunks of large values, by generation.
const CHUNKS: &[u8] = b"meshgate/c/";
/// Record tag: the value follows inline.
const INLINE: u8 = 0;
/// Record tag: a chunk header follows.
const CHUNKED: u8 = 1;
/// Random bytes naming one write's chunks, so a rewrite never mixes old and new chunks.
const GENERATION_BYTES: usize = 16;
/// Length of an encoded [`ChunkHeader`]: tag, generation, length, count, CRC-32.
const HEADER_BYTES: usize = 1 + GENERATION_BYTES + 8 + 4 + 4;

/// The store on an etcd cluster (cheap to clone). etcd-client reconnects by
/// itself when etcd comes back (tested: `unavailable_then_recovers`).
#[derive(Clone)]
pub struct EtcdStore {
    /// Shared by every clone of the store.
    clients: Arc<Clients>,
}

/// Each request runs on a clone (the clients' calls take `&mut self`).
struct Clients {
    /// Reads, writes and transactions.
    kv: KvClient,
    /// Leases: a time to live, and the pending lease of chunks written ahead.
    lease: LeaseClient,
    /// Prefix watches ([`EtcdStore::watch_prefix`]).
    watch: WatchClient,
    /// etcd's member list ([`EtcdStore::members`]).
    cluster: etcd_client::ClusterClient,
}

/// What a committed write found: whether its guard held, and the records it
/// replaced or deleted.
struct Committed {
    /// Whether the transaction's compare held (so its writes were applied).
    succeeded: bool,
    /// The previous records of the keys written: their chunks are removed after.
    replaced: Vec<KeyValue>,
}

/// The header of a chunked value.
#[derive(Debug, Clone, PartialEq)]
struct ChunkHeader {
    /// Names the chunk keys (`meshgate/c/<generation hex>/<index>`) of this write.
    generation: [u8; GENERATION_BYTES],
    /// Length of the whole value, in bytes.
    len: u64,
    /// Number of chunks, each [`CHUNK_BYTES`] but the last.
    count: u32,
    /// CRC-32 of the whole value: a torn or mixed read is reported corrupt.
    crc: u32,
}

impl ChunkHeader {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(HEADER_BYTES);
        v.push(CHUNKED);
        v.extend_from_slice(&self.generation);
        v.extend_from_slice(&self.len.to_be_bytes());
        v.extend_from_slice(&self.count.to_be_bytes());
        v.extend_from_slice(&self.crc.to_be_bytes());
        v
    }

    fn decode(raw: &[u8]) -> Option<ChunkHeader> {
        if raw.len() != HEADER_BYTES || raw[0] != CHUNKED {
            return None;
        }
        let g = 1 + GENERATION_BYTES;
        Some(ChunkHeader {
            generation: raw[1..g].try_into().ok()?,
            len: u64::from_be_bytes(raw[g..g + 8].try_into().ok()?),
            count: u32::from_be_bytes(raw[g + 8..g + 12].try_into().ok()?),
            crc: u32::from_be_bytes(raw[g + 12..g + 16].try_into().ok()?),
        })
    }

    fn prefix(&self) -> Vec<u8> {
        chunk_prefix(&self.generation)
    }
}

fn data_key(key: &[u8]) -> Vec<u8> {
    [DATA, key].concat()
}

fn chunk_prefix(generation: &[u8]) -> Vec<u8> {
    let mut k = CHUNKS.to_vec();
    k.extend_from_slice(hex::encode(generation).as_bytes());
    k.push(b'/');
    k
}

fn chunk_key(generation: &[u8], index: u32) -> Vec<u8> {
    let mut k = chunk_prefix(generation);
    k.extend_from_slice(format!("{index:08x}").as_bytes());
    k
}

/// The first key after every key that starts with `prefix` (which is never all 0xff here).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// The key right after `key` in byte order.
fn successor(key: &[u8]) -> Vec<u8> {
    let mut k = key.to_vec();
    k.push(0);
    k
}

fn new_generation() -> [u8; GENERATION_BYTES] {
    use ring::rand::SecureRandom;
    let mut g = [0u8; GENERATION_BYTES];
    ring::rand::SystemRandom::new()
        .fill(&mut g)
        .expect("OS randomness");
    g
}

fn corrupt(data_key: &[u8]) -> StoreError {
    let key = data_key.strip_prefix(DATA).unwrap_or(data_key);
    StoreError::Corrupt(String::from_utf8_lossy(key).into_owned())
}

/// Runs one etcd request under [`REQUEST_TIMEOUT`].
async fn rpc<T>(
    what: &str,
    request: impl Future<Output = Result<T, etcd_client::Error>>,
) -> StoreResult<T> {
    match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(StoreError::Unavailable(format!("etcd {what}: {e}"))),
        Err(_) => Err(StoreError::Unavailable(format!(
            "etcd {what}: no answer within {} s",
            REQUEST_TIMEOUT.as_secs()
        ))),
    }
}

/// One operation of a planned transaction.
enum Op {
    /// A record (asks for the record it replaces) or a chunk.
    Put {
        /// The full etcd key (`meshgate/d/...` or `meshgate/c/...`).
        key: Vec<u8>,
        /// The encoded record or the chunk's bytes.
        value: Vec<u8>,
        /// The etcd lease it is attached to; 0 for none.
        lease: i64,
        /// A record (its previous value is asked for), not a chunk.
        record: bool,
    },
    /// Moves an existing chunk to `lease`, keeping its value.
    Relabel {
        /// The chunk's etcd key.
        key: Vec<u8>,
        /// The lease it moves to (the record's; 0 for none).
        lease: i64,
    },
    /// Deletes a record (asks for the record it deletes).
    Delete {
        /// The record's etcd key.
        key: Vec<u8>,
    },
}

impl Op {
    fn bytes(&self) -> usize {
        OP_OVERHEAD
            + match self {
                Op::Put { key, value, .. } => key.len() + value.len(),
                Op::Relabel { key, .. } | Op::Delete { key } => key.len(),
            }
    }

    fn is_record(&self) -> bool {
        matches!(self, Op::Put { record: true, .. } | Op::Delete { .. })
    }

    fn into_txn_op(self) -> TxnOp {
        match self {
            Op::Put {
                key,
                value,
                lease,
                record,
            } => {
                let mut o = PutOptions::new().with_lease(lease);
                if record {
                    o = o.with_prev_key();
                }
                TxnOp::put(key, value, Some(o))
            }
            Op::Relabel { key, lease } => TxnOp::put(
                key,
                Vec::new(),
                Some(PutOptions::new().with_ignore_value().with_lease(lease)),
            ),
            Op::Delete { key } => TxnOp::delete(key, Some(DeleteOptions::new().with_prev_key())),
        }
    }
}

/// A write split into its records and the chunks of its large values.
struct Plan {
    /// One put or delete per distinct key (the last write of a key wins).
    records: Vec<Op>,
    /// The chunk puts of the values too large to go inline.
    chunks: Vec<Op>,
    /// The generation of each chunked value: their chunks are deleted if the
    /// write's guard fails.
    generations: Vec<[u8; GENERATION_BYTES]>,
}

/// Lays out `writes` (a value, or None to delete; the last write of a key wins):
/// values inline while the records fit one request, the largest values chunked
/// otherwise. Records and chunks carry `lease` (0: none).
fn plan(writes: Vec<(Vec<u8>, Option<Vec<u8>>)>, lease: i64) -> Plan {
    // etcd refuses a transaction that writes one key twice.
    let mut seen = std::collections::HashSet::new();
    let mut writes: Vec<_> = writes
        .into_iter()
        .rev()
        .filter(|(k, _)| seen.insert(k.clone()))
        .collect();
    writes.reverse();
    let inline_bytes = |v: &Option<Vec<u8>>| v.as_ref().map_or(0, |v| v.len() + 1);
    let mut total: usize = writes
        .iter()
        .map(|(k, v)| DATA.len() + k.len() + OP_OVERHEAD + inline_bytes(v))
        .sum();
    let mut by_size: Vec<usize> = (0..writes.len()).collect();
    by_size.sort_by_key(|&i| std::cmp::Reverse(inline_bytes(&writes[i].1)));
    let mut chunked = vec![false; writes.len()];
    for i in by_size {
        if total <= REQUEST_BUDGET || inline_bytes(&writes[i].1) <= HEADER_BYTES {
            break;
        }
        chunked[i] = true;
        total -= inline_bytes(&writes[i].1) - HEADER_BYTES;
    }
    let mut p = Plan {
        records: Vec::with_capacity(writes.len()),
        chunks: Vec::new(),
        generations: Vec::new(),
    };
    for ((key, value), chunk) in writes.into_iter().zip(chunked) {
        let key = data_key(&key);
        let Some(value) = value else {
            p.records.push(Op::Delete { key });
            continue;
        };
        let record = if chunk {
            let generation = new_generation();
            let mut count = 0u32;
            for (i, part) in value.chunks(CHUNK_BYTES).enumerate() {
                p.chunks.push(Op::Put {
                    key: chunk_key(&generation, i as u32),
                    value: part.to_vec(),
                    lease,
                    record: false,
                });
                count += 1;
            }
            p.generations.push(generation);
            ChunkHeader {
                generation,
                len: value.len() as u64,
                count,
                crc: crc32fast::hash(&value),
            }
            .encode()
        } else {
            let mut r = Vec::with_capacity(value.len() + 1);
            r.push(INLINE);
            r.extend_from_slice(&value);
            r
        };
        p.records.push(Op::Put {
            key,
            value: record,
            lease,
            record: true,
        });
    }
    p
}

/// A large value's chunks written first under the `pending` lease, and the
/// relabels that move them to `lease` in the step that makes the record
/// visible (so a record never shows before its chunks are final).
fn staged_chunks(chunks: Vec<Op>, pending: i64, lease: i64) -> (Vec<Op>, Vec<Op>) {
    let mut staged = Vec::with_capacity(chunks.len());
    let mut relabels = Vec::with_capacity(chunks.len());
    for op in chunks {
        if let Op::Put { key, value, .. } = op {
            relabels.push(Op::Relabel {
                key: key.clone(),
                lease,
            });
            staged.push(Op::Put {
                key,
                value,
                lease: pending,
                record: false,
            });
        }
    }
    (staged, relabels)
}

/// Cuts `ops` into consecutive groups that each fit one transaction.
fn groups(ops: Vec<Op>) -> Vec<Vec<Op>> {
    let mut out: Vec<Vec<Op>> = Vec::new();
    let mut bytes = 0;
    for op in ops {
        let b = op.bytes();
        match out.last_mut() {
            Some(g) if g.len() < MAX_TXN_OPS && bytes + b <= REQUEST_BUDGET => {
                bytes += b;
                g.push(op);
            }
            _ => {
                bytes = b;
                out.push(vec![op]);
            }
        }
    }
    out
}

/// Whether `ops` (as [`EtcdStore::apply_batch`] lays them out) become visible
/// in one etcd transaction, so all at once: they fit one transaction whole, or
/// their chunks go first and the records with the chunks' relabels fit one.
/// Otherwise the reason, naming the limit and the etcd setting behind it.
pub fn atomic_check(ops: &[BatchOp]) -> Result<(), String> {
    let writes = ops
        .iter()
        .map(|op| match op {
            BatchOp::Put(k, v) => (k.clone(), Some(v.clone())),
            BatchOp::Delete(k) => (k.clone(), None),
        })
        .collect();
    let p = plan(writes, 0);
    let (records, chunks) = (p.records.len(), p.chunks.len());
    let record_bytes: usize = p.records.iter().map(Op::bytes).sum();
    let chunk_bytes: usize = p.chunks.iter().map(Op::bytes).sum();
    let relabel_bytes: usize = p
        .chunks
        .iter()
        .map(|c| match c {
            Op::Put { key, .. } => OP_OVERHEAD + key.len(),
            _ => 0,
        })
        .sum();
    let fits_ops = records + chunks <= MAX_TXN_OPS;
    if fits_ops
        && (record_bytes + chunk_bytes <= REQUEST_BUDGET
            || record_bytes + relabel_bytes <= REQUEST_BUDGET)
    {
        return Ok(());
    }
    Err(format!(
        "the change is {} etcd operations ({records} records, {chunks} chunks of large values); \
         one etcd transaction holds at most {MAX_TXN_OPS} operations (etcd's --max-txn-ops \
         default) and {REQUEST_BUDGET} bytes (under etcd's --max-request-bytes)",
        records + chunks
    ))
}

/// Why the node could not open its connection to etcd.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// A file `[cluster]` names cannot be used (missing, not PEM, mismatched).
    #[error("cluster.{setting} {path}: {reason}")]
    File {
        /// The `[cluster]` setting naming the file (`etcd_ca_file`, ...).
        setting: &'static str,
        /// The file's path as configured.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// etcd answered, and refused what this node presented (its certificate,
    /// its user), or presented a certificate this node does not trust.
    #[error("{0}")]
    Refused(String),
    /// etcd did not answer.
    #[error(transparent)]
    Unavailable(#[from] StoreError),
}

/// How the node proves itself to etcd beyond the endpoints: the TLS material
/// and the user of `[cluster]`, read from their files at start-up.
#[derive(Clone, Default)]
pub struct EtcdAccess {
    /// `etcd_ca_file` and its PEM.
    ca: Option<(String, Vec<u8>)>,
    /// `etcd_cert_file` and `etcd_key_file` with their PEM.
    identity: Option<ClientIdentity>,
    /// `etcd_user`, its password and `etcd_password_file`.
    user: Option<EtcdUser>,
}

/// The client certificate presented to etcd (mutual TLS).
#[derive(Clone)]
struct ClientIdentity {
    /// `etcd_cert_file`, named in errors and `Debug`.
    cert_file: String,
    /// The certificate chain, PEM.
    cert: Vec<u8>,
    /// The private key, PEM; checked at start-up to match `cert`.
    key: Vec<u8>,
}

/// The etcd user the node authenticates as.
#[derive(Clone)]
struct EtcdUser {
    /// `etcd_user`.
    name: String,
    /// Read from `etcd_password_file` (one trailing newline dropped); never
    /// printed (`Debug` of [`EtcdAccess`] leaves it out).
    password: String,
    /// `etcd_password_file`, named in errors.
    password_file: String,
}

impl std::fmt::Debug for EtcdAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAccess")
            .field("ca_file", &self.ca.as_ref().map(|c| &c.0))
            .field("cert_file", &self.identity.as_ref().map(|i| &i.cert_file))
            .field("user", &self.user.as_ref().map(|u| &u.name))
            .finish()
    }
}

fn file_error(setting: &'static str, path: &str, reason: impl std::fmt::Display) -> ConnectError {
    ConnectError::File {
        setting,
        path: path.to_string(),
        reason: reason.to_string(),
    }
}

/// Reads a file `[cluster]` names; a missing file is named as such.
fn read_setting(setting: &'static str, path: &str) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => file_error(setting, path, "no such file"),
        _ => file_error(setting, path, format!("cannot read it: {e}")),
    })
}

/// PEM certificates, at least one.
fn read_certs(
    setting: &'static str,
    path: &str,
) -> Result<(Vec<u8>, Vec<rustls_pki_types::CertificateDer<'static>>), ConnectError> {
    use rustls_pki_types::pem::PemObject;
    let pem = read_setting(setting, path)?;
    let certs = rustls_pki_types::CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(setting, path, format!("not PEM: {e}")))?;
    if certs.is_empty() {
        return Err(file_error(
            setting,
            path,
            "not PEM: holds no CERTIFICATE block",
        ));
    }
    Ok((pem, certs))
}

impl EtcdAccess {
    /// Plain `http://`, no user.
    pub fn none() -> EtcdAccess {
        EtcdAccess::default()
    }

    /// Reads and checks the files `[cluster]` names: each must exist and be
    /// PEM of the right kind, and the key must match the certificate.
    pub fn from_config(c: &crate::config::ClusterConfig) -> Result<EtcdAccess, ConnectError> {
        let mut access = EtcdAccess::none();
        if !c.etcd_ca_file.is_empty() {
            let (pem, _) = read_certs("etcd_ca_file", &c.etcd_ca_file)?;
            access.ca = Some((c.etcd_ca_file.clone(), pem));
        }
        if !c.etcd_cert_file.is_empty() {
            use rustls_pki_types::pem::PemObject;
            let (cert, chain) = read_certs("etcd_cert_file", &c.etcd_cert_file)?;
            let key = read_setting("etcd_key_file", &c.etcd_key_file)?;
            let der = rustls_pki_types::PrivateKeyDer::from_pem_slice(&key).map_err(|e| {
                file_error(
                    "etcd_key_file",
                    &c.etcd_key_file,
                    format!("not a PEM private key: {e}"),
                )
            })?;
            let signer = rustls::crypto::ring::sign::any_supported_type(&der)
                .map_err(|e| file_error("etcd_key_file", &c.etcd_key_file, e))?;
            rustls::sign::CertifiedKey::new(chain, signer)
                .keys_match()
                .map_err(|e| {
                    file_error(
                        "etcd_key_file",
                        &c.etcd_key_file,
                        format!(
                            "does not match cluster.etcd_cert_file {}: {e}",
                            c.etcd_cert_file
                        ),
                    )
                })?;
            access.identity = Some(ClientIdentity {
                cert_file: c.etcd_cert_file.clone(),
                cert,
                key,
            });
        }
        if !c.etcd_user.is_empty() {
            let raw = read_setting("etcd_password_file", &c.etcd_password_file)?;
            let password = String::from_utf8(raw).map_err(|_| {
                file_error("etcd_password_file", &c.etcd_password_file, "not UTF-8")
            })?;
            let password = password.strip_suffix('\n').unwrap_or(&password);
            let password = password.strip_suffix('\r').unwrap_or(password);
            if password.is_empty() {
                return Err(file_error(
                    "etcd_password_file",
                    &c.etcd_password_file,
                    "empty",
                ));
            }
            access.user = Some(EtcdUser {
                name: c.etcd_user.clone(),
                password: password.to_string(),
                password_file: c.etcd_password_file.clone(),
            });
        }
        Ok(access)
    }

    fn options(&self) -> ConnectOptions {
        let mut o = ConnectOptions::new()
            .with_timeout(REQUEST_TIMEOUT)
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_keep_alive(KEEP_ALIVE_INTERVAL, KEEP_ALIVE_TIMEOUT);
        if self.ca.is_some() || self.identity.is_some() {
            let mut tls = etcd_client::TlsOptions::new();
            if let Some((_, pem)) = &self.ca {
                tls = tls.ca_certificate(etcd_client::Certificate::from_pem(pem));
            }
            if let Some(id) = &self.identity {
                tls = tls.identity(etcd_client::Identity::from_pem(&id.cert, &id.key));
            }
            o = o.with_tls(tls);
        }
        if let Some(u) = &self.user {
            // etcd's auth tokens expire (5 minutes by default): fetch a new one
            // when a request is refused for an expired token.
            o = o
                .with_user(u.name.clone(), u.password.clone())
                .with_auto_token_refresh(true);
        }
        o
    }

    /// Why etcd refused this node, in terms of its settings; None when the
    /// failure is not a refusal (etcd down, slow).
    async fn refusal(&self, endpoints: &[String], e: &etcd_client::Error) -> Option<String> {
        if let Some(m) = self.user_refusal(&endpoints.join(", "), e) {
            return Some(m);
        }
        self.ca.as_ref()?;
        // tonic says no more than "connection closed" when etcd refuses a
        // client certificate after a TLS 1.3 handshake: a handshake of our
        // own with the same settings finds the reason.
        for endpoint in endpoints {
            let (access, ep) = (self.clone(), endpoint.clone());
            let found = tokio::task::spawn_blocking(move || access.tls_problem(&ep)).await;
            if let Ok(Some(problem)) = found {
                return Some(self.tls_refusal(endpoint, problem));
            }
        }
        None
    }

    fn tls_refusal(&self, at: &str, problem: TlsProblem) -> String {
        match problem {
            TlsProblem::Untrusted(detail) => {
                let ca = self.ca.as_ref().map_or("", |c| c.0.as_str());
                format!(
                    "etcd at {at} presented a certificate that cluster.etcd_ca_file {ca} does not vouch for: {detail}"
                )
            }
            TlsProblem::Refused(detail) => match &self.identity {
                Some(id) => format!(
                    "etcd at {at} refused the TLS handshake with cluster.etcd_cert_file {}: {detail}",
                    id.cert_file
                ),
                None => format!(
                    "etcd at {at} refused the TLS handshake without a client certificate (set cluster.etcd_cert_file and cluster.etcd_key_file if etcd runs with --client-cert-auth): {detail}"
                ),
            },
        }
    }

    /// A TLS handshake with `endpoint` (`https://host:port`) as this node
    /// makes it, then a short wait for etcd's verdict on the client
    /// certificate (TLS 1.3 sends it after the handshake, as an alert).
    /// None: the handshake is fine, or etcd is not reachable at all.
    fn tls_problem(&self, endpoint: &str) -> Option<TlsProblem> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
        use std::io::Read;
        use std::net::ToSocketAddrs;
        let hostport = endpoint.strip_prefix("https://")?;
        let (host, _) = hostport.rsplit_once(':')?;
        let name = ServerName::try_from(host.trim_matches(['[', ']']).to_string()).ok()?;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(&self.ca.as_ref()?.1) {
            roots.add(c.ok()?).ok()?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(roots);
        let mut config = match &self.identity {
            Some(id) => {
                let chain = CertificateDer::pem_slice_iter(&id.cert)
                    .collect::<Result<Vec<_>, _>>()
                    .ok()?;
                let key = PrivateKeyDer::from_pem_slice(&id.key).ok()?;
                builder.with_client_auth_cert(chain, key).ok()?
            }
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        let conn = rustls::ClientConnection::new(Arc::new(config), name).ok()?;
        let addr = hostport.to_socket_addrs().ok()?.next()?;
        let sock = std::net::TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).ok()?;
        sock.set_read_timeout(Some(TLS_VERDICT_WAIT)).ok()?;
        sock.set_write_timeout(Some(TLS_VERDICT_WAIT)).ok()?;
        let mut tls = rustls::StreamOwned::new(conn, sock);
        while tls.conn.is_handshaking() {
            if let Err(e) = tls.conn.complete_io(&mut tls.sock) {
                return Some(tls_io_problem(e));
            }
        }
        let mut buf = [0u8; 64];
        match tls.read(&mut buf) {
            Ok(0) => Some(TlsProblem::Refused(
                "etcd closed the connection after the handshake".into(),
            )),
            Ok(_) => None,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                None
            }
            Err(e) => Some(tls_io_problem(e)),
        }
    }

    /// Why etcd refused this node's user.
    fn user_refusal(&self, at: &str, e: &etcd_client::Error) -> Option<String> {
        let detail = error_detail(e);
        let lower = detail.to_ascii_lowercase();
        if ["authentication", "permission denied", "user name"]
            .iter()
            .any(|w| lower.contains(w))
        {
            return Some(match &self.user {
                Some(u) if lower.contains("permission denied") => format!(
                    "etcd at {at} denied user {} access to meshgate/ (grant it a role with readwrite on the prefix meshgate/): {detail}",
                    u.name
                ),
                Some(u) => format!(
                    "etcd at {at} refused user {} with the password in cluster.etcd_password_file {}: {detail}",
                    u.name, u.password_file
                ),
                None => format!(
                    "etcd at {at} requires a user (set cluster.etcd_user and cluster.etcd_password_file): {detail}"
                ),
            });
        }
        None
    }
}

/// How long [`EtcdAccess::tls_problem`] waits for etcd's verdict on the
/// client certificate after the handshake.
const TLS_VERDICT_WAIT: Duration = Duration::from_secs(1);

/// What a TLS handshake of our own found.
enum TlsProblem {
    /// etcd's certificate does not chain to `etcd_ca_file`.
    Untrusted(String),
    /// etcd refused the handshake (an alert: an unknown or missing client certificate).
    Refused(String),
}

fn tls_io_problem(e: std::io::Error) -> TlsProblem {
    let detail = e.to_string();
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::InvalidCertificate(_)) => TlsProblem::Untrusted(detail),
        _ => TlsProblem::Refused(detail),
    }
}

/// An etcd-client error with its causes (its `Display` stops at "transport error").
fn error_detail(e: &etcd_client::Error) -> String {
    use std::error::Error as _;
    let mut out = e.to_string();
    let mut next: Option<&(dyn std::error::Error + 'static)> = match e {
        etcd_client::Error::TransportError(t) => t.source(),
        etcd_client::Error::GRpcStatus(s) => s.source(),
        _ => None,
    };
    while let Some(cause) = next {
        let c = cause.to_string();
        if !out.contains(&c) {
            out.push_str(": ");
            out.push_str(&c);
        }
        next = cause.source();
    }
    out
}

impl EtcdStore {
    /// Connects to the etcd cluster at `endpoints` (`http://host:port`) with no
    /// TLS and no user. See [`EtcdStore::connect_with`].
    pub async fn connect(endpoints: &[String]) -> StoreResult<EtcdStore> {
        match Self::connect_with(endpoints, &EtcdAccess::none()).await {
            Ok(s) => Ok(s),
            Err(ConnectError::Unavailable(e)) => Err(e),
            Err(e) => Err(StoreError::Unavailable(e.to_string())),
        }
    }

    /// Connects to the etcd cluster at `endpoints` as `access` says (TLS with
    /// a client certificate, a user) and checks that it answers, so a wrong
    /// address or a refused credential fails at start rather than on the
    /// first request.
    pub async fn connect_with(
        endpoints: &[String],
        access: &EtcdAccess,
    ) -> Result<EtcdStore, ConnectError> {
        let classify =
            async |what: &str, e: etcd_client::Error| match access.refusal(endpoints, &e).await {
                Some(refused) => ConnectError::Refused(refused),
                None => ConnectError::Unavailable(StoreError::Unavailable(format!(
                    "etcd {what}: {}",
                    error_detail(&e)
                ))),
            };
        let deadline = |what: &str| {
            ConnectError::Unavailable(StoreError::Unavailable(format!(
                "etcd {what}: no answer within {} s",
                REQUEST_TIMEOUT.as_secs()
            )))
        };
        // etcd-client connects lazily: with a user, the first round trip is
        // the authentication; without, it is the probe.
        let client = match tokio::time::timeout(
            REQUEST_TIMEOUT,
            Client::connect(endpoints, Some(access.options())),
        )
        .await
        .map_err(|_| deadline("connect"))?
        {
            Ok(c) => c,
            Err(e) => return Err(classify("connect", e).await),
        };
        let store = EtcdStore {
            clients: Arc::new(Clients {
                kv: client
                    .kv_client()
                    .max_decoding_message_size(MAX_RESPONSE_BYTES),
                lease: client.lease_client(),
                watch: client.watch_client(),
                cluster: client.cluster_client(),
            }),
        };
        let mut kv = store.clients.kv.clone();
        let probe = tokio::time::timeout(
            REQUEST_TIMEOUT,
            kv.get(DATA, Some(GetOptions::new().with_count_only())),
        )
        .await
        .map_err(|_| deadline("probe"))?;
        if let Err(e) = probe {
            return Err(classify("probe", e).await);
        }
        Ok(store)
    }

    async fn grant(&self, ttl_seconds: i64) -> StoreResult<i64> {
        let mut lease = self.clients.lease.clone();
        let r = rpc("lease grant", lease.grant(ttl_seconds, None)).await?;
        Ok(r.id())
    }

    /// The lease of a time to live: whole seconds, rounded up.
    async fn grant_ttl(&self, ttl: Duration) -> StoreResult<i64> {
        let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        self.grant(secs.clamp(1, i64::MAX as u64) as i64).await
    }

    /// Revokes a lease, deleting what is attached to it; a failure is only logged
    /// (the lease still runs out by itself).
    async fn revoke_quietly(&self, lease: i64) {
        let mut client = self.clients.lease.clone();
        if let Err(e) = rpc("lease revoke", client.revoke(lease)).await {
            tracing::warn!(lease, error = %e, "Lease revoke failed; it expires by itself.");
        }
    }

    /// Deletes the chunks of one generation; a failure is only logged.
    async fn delete_chunks_quietly(&self, generation: &[u8]) {
        let prefix = chunk_prefix(generation);
        let mut kv = self.clients.kv.clone();
        let opts = DeleteOptions::new().with_range(prefix_end(&prefix));
        if let Err(e) = rpc("delete chunks", kv.delete(prefix, Some(opts))).await {
            tracing::warn!(
                generation = %hex::encode(generation),
                error = %e,
                "Chunk cleanup failed; the chunks are orphaned."
            );
        }
    }

    async fn txn(&self, guards: Vec<Compare>, ops: Vec<Op>) -> StoreResult<(bool, Vec<KeyValue>)> {
        let mut txn = Txn::new();
        if !guards.is_empty() {
            txn = txn.when(guards);
        }
        let txn = txn.and_then(ops.into_iter().map(Op::into_txn_op).collect::<Vec<_>>());
        let mut kv = self.clients.kv.clone();
        let r = rpc("txn", kv.txn(txn)).await?;
        let mut replaced = Vec::new();
        for op in r.op_responses() {
            match op {
                TxnOpResponse::Put(p) => replaced.extend(p.prev_key().cloned()),
                TxnOpResponse::Delete(d) => replaced.extend(d.prev_kvs().iter().cloned()),
                _ => {}
            }
        }
        Ok((r.succeeded(), replaced))
    }

    /// Applies `writes` as one change, only if every compare of `guard` holds.
    /// A guard comes only with writes that fit one transaction (a CAS, a
    /// `transact`), or is checked by the last of several, so a failed guard
    /// means no record was written.
    /// Then removes what the write replaced.
    async fn commit(
        &self,
        writes: Vec<(Vec<u8>, Option<Vec<u8>>)>,
        guard: Vec<Compare>,
        lease: i64,
    ) -> StoreResult<Committed> {
        let p = plan(writes, lease);
        let chunk_bytes: usize = p.chunks.iter().map(Op::bytes).sum();
        let record_bytes: usize = p.records.iter().map(Op::bytes).sum();
        let committed = if chunk_bytes + record_bytes <= REQUEST_BUDGET
            && p.chunks.len() + p.records.len() <= MAX_TXN_OPS
        {
            let mut ops = p.chunks;
            ops.extend(p.records);
            let (succeeded, replaced) = self.txn(guard, ops).await?;
            Committed {
                succeeded,
                replaced,
            }
        } else {
            self.commit_in_steps(p, guard, lease).await?
        };
        if committed.succeeded {
            self.clean_up(&committed.replaced, lease).await;
        }
        Ok(committed)
    }

    /// A write too large for one transaction: chunks first under a pending lease,
    /// then the records with the chunks moved to `lease`.
    async fn commit_in_steps(
        &self,
        p: Plan,
        guard: Vec<Compare>,
        lease: i64,
    ) -> StoreResult<Committed> {
        let pending = if p.chunks.is_empty() {
            0
        } else {
            self.grant(PENDING_CHUNK_TTL).await?
        };
        let (chunks, relabels) = staged_chunks(p.chunks, pending, lease);
        let result = async {
            for g in groups(chunks) {
                self.txn(Vec::new(), g).await?;
            }
            // Relabels first: a record is never visible before its chunks are final.
            let mut ops = relabels;
            let records = p.records.len();
            ops.extend(p.records);
            let steps = groups(ops);
            let record_steps = steps.iter().filter(|g| g.iter().any(Op::is_record)).count();
            if record_steps > 1 {
                tracing::warn!(
                    records,
                    transactions = record_steps,
                    "Batch larger than one etcd transaction; applied in several."
                );
            }
            let last = steps.len() - 1;
            let mut replaced = Vec::new();
            let mut guard = guard;
            for (i, g) in steps.into_iter().enumerate() {
                let (ok, r) = self
                    .txn(
                        if i == last {
                            std::mem::take(&mut guard)
                        } else {
                            Vec::new()
                        },
                        g,
                    )
                    .await?;
                replaced.extend(r);
                if !ok {
                    return Ok(Committed {
                        succeeded: false,
                        replaced,
                    });
                }
            }
            Ok(Committed {
                succeeded: true,
                replaced,
            })
        }
        .await;
        match &result {
            // The guard failed, so the one record was not written: its chunks go,
            // relabelled or not.
            Ok(Committed {
                succeeded: false, ..
            }) => {
                for g in &p.generations {
                    self.delete_chunks_quietly(g).await;
                }
            }
            // The outcome of the failed request is unknown: the records may be in,
            // so only the chunks still on the pending lease (below) may go.
            Err(e) if !p.generations.is_empty() => {
                tracing::warn!(error = %e, "Large write failed; relabelled chunks may be orphaned.");
            }
            _ => {}
        }
        // Revoking only deletes chunks that were never relabelled, so never a
        // record's chunks.
        if pending != 0 {
            self.revoke_quietly(pending).await;
        }
        result
    }

    /// Removes what replaced records left: their leases (a lease holds one record
    /// and its chunks) and their chunks.
    async fn clean_up(&self, replaced: &[KeyValue], lease: i64) {
        for kv in replaced {
            if kv.lease() != 0 && kv.lease() != lease {
                self.revoke_quietly(kv.lease()).await;
            }
            if let Some(h) = ChunkHeader::decode(kv.value()) {
                self.delete_chunks_quietly(&h.generation).await;
            }
        }
    }

    /// The value a record stands for, reading its chunks as of `revision`.
    async fn resolve(&self, key: &[u8], record: &[u8], revision: i64) -> StoreResult<Vec<u8>> {
        match record.first() {
            Some(&INLINE) => Ok(record[1..].to_vec()),
            Some(&CHUNKED) => {
                let h = ChunkHeader::decode(record).ok_or_else(|| corrupt(key))?;
                self.read_chunks(key, &h, revision).await
            }
            _ => Err(corrupt(key)),
        }
    }

    async fn read_chunks(
        &self,
        key: &[u8],
        h: &ChunkHeader,
        revision: i64,
    ) -> StoreResult<Vec<u8>> {
        let prefix = h.prefix();
        let end = prefix_end(&prefix);
        let mut out = Vec::with_capacity(usize::try_from(h.len).unwrap_or(0).min(1 << 30));
        let mut from = prefix;
        let mut index = 0u32;
        loop {
            let opts = GetOptions::new()
                .with_range(end.clone())
                .with_revision(revision)
                .with_limit(CHUNK_PAGE);
            let mut kv = self.clients.kv.clone();
            let r = rpc("get chunks", kv.get(from, Some(opts))).await?;
            for c in r.kvs() {
                if c.key() != chunk_key(&h.generation, index) {
                    return Err(corrupt(key));
                }
                out.extend_from_slice(c.value());
                index += 1;
            }
            match r.kvs().last() {
                Some(last) if r.more() => from = successor(last.key()),
                _ => break,
            }
        }
        if index != h.count || out.len() as u64 != h.len || crc32fast::hash(&out) != h.crc {
            return Err(corrupt(key));
        }
        Ok(out)
    }

    /// Sets or deletes `key` only if it holds `expected`; retries while the record
    /// changes between the read and the write without changing its value.
    async fn swap(
        &self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
        ttl: Option<Duration>,
        lease: &mut i64,
    ) -> StoreResult<bool> {
        let dkey = data_key(key);
        loop {
            let mut kv = self.clients.kv.clone();
            let r = rpc("get", kv.get(dkey.clone(), None)).await?;
            let revision = r.header().map_or(0, |h| h.revision());
            let (current, guard) = match r.kvs().first() {
                None => (
                    None,
                    Compare::create_revision(dkey.clone(), CompareOp::Equal, 0),
                ),
                Some(found) => (
                    Some(self.resolve(&dkey, found.value(), revision).await?),
                    Compare::mod_revision(dkey.clone(), CompareOp::Equal, found.mod_revision()),
                ),
            };
            if current.as_deref() != expected {
                return Ok(false);
            }
            if let (Some(ttl), Some(_), 0) = (ttl, new, *lease) {
                *lease = self.grant_ttl(ttl).await?;
            }
            let c = self
                .commit(
                    vec![(key.to_vec(), new.map(<[u8]>::to_vec))],
                    vec![guard],
                    *lease,
                )
                .await?;
            if c.succeeded {
                return Ok(true);
            }
        }
    }
}

impl EtcdStore {
    /// Replaces the value under `key` with `new` only if it holds
    /// `expected`, on the same lease (its time to live kept): the record
    /// MAC's migration (`Store::adopt_record_macs`). Returns whether it did.
    pub async fn replace_keeping_ttl(
        &self,
        key: &[u8],
        expected: &[u8],
        new: &[u8],
    ) -> StoreResult<bool> {
        let dkey = data_key(key);
        let mut kv = self.clients.kv.clone();
        let r = rpc("get", kv.get(dkey.clone(), None)).await?;
        let revision = r.header().map_or(0, |h| h.revision());
        let Some(found) = r.kvs().first() else {
            return Ok(false);
        };
        if self.resolve(&dkey, found.value(), revision).await? != expected {
            return Ok(false);
        }
        let guard = Compare::mod_revision(dkey, CompareOp::Equal, found.mod_revision());
        let c = self
            .commit(
                vec![(key.to_vec(), Some(new.to_vec()))],
                vec![guard],
                found.lease(),
            )
            .await?;
        Ok(c.succeeded)
    }
}

/// An etcd watch on the records under a prefix (see [`EtcdStore::watch_prefix`]).
pub struct EtcdWatch {
    /// etcd's event stream for the prefix (created, not yet cancelled).
    stream: WatchStream,
}

impl EtcdWatch {
    /// The next changes etcd reports (one response's events, in order; the
    /// keys without the store's layout prefix). An error (etcd gone, the
    /// stream closed, the watch cancelled or compacted away) ends the watch.
    pub async fn next(&mut self) -> StoreResult<Vec<super::Change>> {
        let changes = self.next_with_values().await?;
        Ok(changes.into_iter().map(|(c, _)| c).collect())
    }

    /// [`EtcdWatch::next`], each put with the value it wrote when that is
    /// inline in its record (None for a large, chunked one: its reader reads
    /// the key), so the store can check it before anyone hears of it.
    pub async fn next_with_values(&mut self) -> StoreResult<Vec<(super::Change, Option<Vec<u8>>)>> {
        loop {
            let r = match self.stream.message().await {
                Ok(Some(r)) => r,
                Ok(None) => {
                    return Err(StoreError::Unavailable("etcd watch: stream closed".into()));
                }
                Err(e) => return Err(StoreError::Unavailable(format!("etcd watch: {e}"))),
            };
            if r.canceled() {
                return Err(StoreError::Unavailable(format!(
                    "etcd watch cancelled: {} (compacted at {})",
                    r.cancel_reason(),
                    r.compact_revision()
                )));
            }
            let changes: Vec<_> = r
                .events()
                .iter()
                .filter_map(|e| {
                    let kv = e.kv()?;
                    let key = kv.key().strip_prefix(DATA)?.to_vec();
                    Some(match e.event_type() {
                        EventType::Put => {
                            let inline = match kv.value().split_first() {
                                Some((&INLINE, v)) => Some(v.to_vec()),
                                _ => None,
                            };
                            (super::Change::Put(key), inline)
                        }
                        EventType::Delete => (super::Change::Delete(key), None),
                    })
                })
                .collect();
            // Progress notifications and the creation answer carry no events.
            if !changes.is_empty() {
                return Ok(changes);
            }
        }
    }
}

/// One etcd member as its member list shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdMember {
    /// The member's name (`--name`).
    pub name: String,
    /// Where the other members reach it (`--initial-advertise-peer-urls`).
    pub peer_urls: Vec<String>,
    /// Where clients reach it (`--advertise-client-urls`).
    pub client_urls: Vec<String>,
}

impl EtcdStore {
    /// etcd's members with their peer and client URLs: the node's own
    /// addresses for the egress policy, beyond the endpoints it was given.
    pub async fn members(&self) -> StoreResult<Vec<EtcdMember>> {
        let mut client = self.clients.cluster.clone();
        let r = rpc("member list", client.member_list()).await?;
        Ok(r.members()
            .iter()
            .map(|m| EtcdMember {
                name: m.name().to_string(),
                peer_urls: m.peer_urls().to_vec(),
                client_urls: m.client_urls().to_vec(),
            })
            .collect())
    }

    /// Watches the records under `prefix`: returns once etcd has created the
    /// watch, so a scan made after this call misses no change.
    pub async fn watch_prefix(&self, prefix: &[u8]) -> StoreResult<EtcdWatch> {
        let start = data_key(prefix);
        let opts = WatchOptions::new().with_range(prefix_end(&start));
        let mut client = self.clients.watch.clone();
        let mut stream = rpc("watch", client.watch(start, Some(opts))).await?;
        let created = rpc("watch", stream.message()).await?;
        match created {
            Some(r) if r.created() && !r.canceled() => Ok(EtcdWatch { stream }),
            Some(r) => Err(StoreError::Unavailable(format!(
                "etcd watch refused: {}",
                r.cancel_reason()
            ))),
            None => Err(StoreError::Unavailable("etcd watch: stream closed".into())),
        }
    }
}

/// Journaled batches (docs/decisions.md, "Namespace export and import"): a
/// batch larger than one transaction is written whole as the value of a
/// journal key first (one atomic write: the commit point), then applied in
/// steps, and its `last` part in one transaction that also deletes the
/// journal. Readers and writers that name the journal (`*_unless`) find it
/// in the same transaction as their read or write and wait; anyone may
/// finish a journal left by a writer that died ([`EtcdStore::roll_forward`]).
impl EtcdStore {
    fn journal_absent(journal: &[u8]) -> Compare {
        Compare::version(data_key(journal), CompareOp::Equal, 0)
    }

    /// Reads `key` in one transaction that checks `journal` is absent;
    /// `None` while it is present.
    pub async fn get_unless(
        &self,
        key: &[u8],
        journal: &[u8],
    ) -> StoreResult<Option<Option<Vec<u8>>>> {
        let dkey = data_key(key);
        let txn = Txn::new()
            .when(vec![Self::journal_absent(journal)])
            .and_then(vec![TxnOp::get(dkey.clone(), None)]);
        let mut kv = self.clients.kv.clone();
        let r = rpc("get", kv.txn(txn)).await?;
        if !r.succeeded() {
            return Ok(None);
        }
        let revision = r.header().map_or(0, |h| h.revision());
        for op in r.op_responses() {
            if let TxnOpResponse::Get(g) = op
                && let Some(found) = g.kvs().first()
            {
                return self
                    .resolve(&dkey, found.value(), revision)
                    .await
                    .map(|v| Some(Some(v)));
            }
        }
        Ok(Some(None))
    }

    /// Reads `keys` as of one revision at which `journal` (if named) was
    /// absent, hands their values to `decide`, and writes what it returns only
    /// if none of `keys` changed since and `journal` is still absent: else it
    /// reads again (at most [`TRANSACT_ATTEMPTS`] times). `None` while the
    /// journal is there; `Some(Err)` when `decide` refused (nothing written).
    pub async fn transact<T, E, F>(
        &self,
        keys: &[Vec<u8>],
        journal: Option<&[u8]>,
        decide: F,
    ) -> StoreResult<Option<Result<T, E>>>
    where
        F: Fn(&[Option<Vec<u8>>]) -> Result<(Vec<BatchOp>, T), E>,
    {
        for _ in 0..TRANSACT_ATTEMPTS {
            let mut txn = Txn::new();
            if let Some(j) = journal {
                txn = txn.when(vec![Self::journal_absent(j)]);
            }
            let txn = txn.and_then(
                keys.iter()
                    .map(|k| TxnOp::get(data_key(k), None))
                    .collect::<Vec<_>>(),
            );
            let mut kv = self.clients.kv.clone();
            let r = rpc("get", kv.txn(txn)).await?;
            if !r.succeeded() {
                return Ok(None);
            }
            let revision = r.header().map_or(0, |h| h.revision());
            let mut values = Vec::with_capacity(keys.len());
            let mut guards = Vec::with_capacity(keys.len() + 1);
            for (k, op) in keys.iter().zip(r.op_responses()) {
                let dkey = data_key(k);
                let found = match op {
                    TxnOpResponse::Get(g) => g.kvs().first().cloned(),
                    _ => None,
                };
                match found {
                    None => {
                        values.push(None);
                        guards.push(Compare::version(dkey, CompareOp::Equal, 0));
                    }
                    Some(found) => {
                        values.push(Some(self.resolve(&dkey, found.value(), revision).await?));
                        guards.push(Compare::mod_revision(
                            dkey,
                            CompareOp::Equal,
                            found.mod_revision(),
                        ));
                    }
                }
            }
            if let Some(j) = journal {
                guards.push(Self::journal_absent(j));
            }
            let (ops, out) = match decide(&values) {
                Ok(d) => d,
                Err(e) => return Ok(Some(Err(e))),
            };
            // Chunks may go in steps before; the records land in one guarded
            // transaction, so a failed guard writes none of them.
            atomic_check(&ops)
                .map_err(|why| StoreError::Unavailable(format!("a guarded change: {why}")))?;
            if self.commit(writes_of(ops), guards, 0).await?.succeeded {
                return Ok(Some(Ok(out)));
            }
        }
        Err(StoreError::Unavailable(
            "the keys kept changing under a guarded change; try again".into(),
        ))
    }

    /// Scans each of `prefixes` (at most `limit` keys each) as of one
    /// revision at which `journal` was absent; `None` while it is present.
    pub async fn scan_unless(
        &self,
        prefixes: &[Vec<u8>],
        limit: usize,
        journal: &[u8],
    ) -> StoreResult<Option<Vec<Vec<(Vec<u8>, Vec<u8>)>>>> {
        let Some(revision) = self.revision_unless(journal).await? else {
            return Ok(None);
        };
        let mut out = Vec::with_capacity(prefixes.len());
        for prefix in prefixes {
            out.push(self.scan_at(prefix, prefix, limit, revision, false).await?);
        }
        Ok(Some(out))
    }

    /// The store's revision now, unless `journal` is present (`None` then).
    async fn revision_unless(&self, journal: &[u8]) -> StoreResult<Option<i64>> {
        let txn = Txn::new()
            .when(vec![Self::journal_absent(journal)])
            .and_then(vec![TxnOp::get(
                data_key(journal),
                Some(GetOptions::new().with_count_only()),
            )]);
        let mut kv = self.clients.kv.clone();
        let r = rpc("scan", kv.txn(txn)).await?;
        if !r.succeeded() {
            return Ok(None);
        }
        Ok(Some(r.header().map_or(0, |h| h.revision())))
    }

    /// The keys under `prefix` (at most `limit`), without their values, as
    /// of one revision at which `journal` was absent; `None` while it is
    /// present.
    pub async fn scan_keys_unless(
        &self,
        prefix: &[u8],
        limit: usize,
        journal: &[u8],
    ) -> StoreResult<Option<Vec<Vec<u8>>>> {
        self.scan_keys_from_unless(prefix, prefix, limit, journal)
            .await
    }

    /// [`EtcdStore::scan_keys_unless`] from `start` on (a key at or past
    /// `prefix`): the keys under `prefix` not below `start`.
    pub async fn scan_keys_from_unless(
        &self,
        prefix: &[u8],
        start: &[u8],
        limit: usize,
        journal: &[u8],
    ) -> StoreResult<Option<Vec<Vec<u8>>>> {
        let Some(revision) = self.revision_unless(journal).await? else {
            return Ok(None);
        };
        let rows = self.scan_at(prefix, start, limit, revision, true).await?;
        Ok(Some(rows.into_iter().map(|(k, _)| k).collect()))
    }

    /// Every key under `prefix` not below `start` (at most `limit`) as of
    /// `revision`, with its value, or with `keys_only` an empty one (values
    /// not even sent).
    async fn scan_at(
        &self,
        prefix: &[u8],
        start: &[u8],
        limit: usize,
        revision: i64,
        keys_only: bool,
    ) -> StoreResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let end = prefix_end(&data_key(prefix));
        let mut out = Vec::new();
        let mut from = data_key(start.max(prefix));
        while out.len() < limit {
            let page = (limit - out.len()).min(SCAN_PAGE as usize) as i64;
            let mut opts = GetOptions::new()
                .with_range(end.clone())
                .with_limit(page)
                .with_revision(revision);
            if keys_only {
                opts = opts.with_keys_only();
            }
            let mut kv = self.clients.kv.clone();
            let r = rpc("scan", kv.get(from, Some(opts))).await?;
            for found in r.kvs() {
                let value = if keys_only {
                    Vec::new()
                } else {
                    self.resolve(found.key(), found.value(), revision).await?
                };
                out.push((found.key()[DATA.len()..].to_vec(), value));
            }
            match r.kvs().last() {
                Some(last) if r.more() => from = successor(last.key()),
                _ => break,
            }
        }
        Ok(out)
    }

    /// Writes (`Some`) or deletes (`None`) `key` unless `journal` is present:
    /// `None` then, else whether the key existed before.
    pub async fn write_unless(
        &self,
        key: &[u8],
        value: Option<&[u8]>,
        journal: &[u8],
    ) -> StoreResult<Option<bool>> {
        let c = self
            .commit(
                vec![(key.to_vec(), value.map(<[u8]>::to_vec))],
                vec![Self::journal_absent(journal)],
                0,
            )
            .await?;
        Ok(c.succeeded.then_some(!c.replaced.is_empty()))
    }

    /// Applies `steps` then `last` as one change for readers that name
    /// `journal`: in one transaction when everything fits one, else through
    /// the journal. `last` (with the journal's deletion) must fit one
    /// transaction (`atomic_check`); readers that do not name the journal
    /// see `steps` land in several. Fails as unavailable while another
    /// journal is under the same key.
    ///
    /// The journal's own record is `seal` of its encoding, and `open` turns
    /// it back ([`EtcdStore::roll_forward`]): the store's MAC, as every record.
    pub async fn apply_journaled(
        &self,
        journal: &[u8],
        steps: Vec<BatchOp>,
        last: Vec<BatchOp>,
        seal: impl FnOnce(Vec<u8>) -> Vec<u8>,
        open: impl Fn(Vec<u8>) -> StoreResult<Vec<u8>>,
    ) -> StoreResult<()> {
        let busy = || {
            StoreError::Unavailable(format!(
                "another change holds {}; try again",
                String::from_utf8_lossy(journal)
            ))
        };
        let mut all = steps.clone();
        all.extend(last.iter().cloned());
        if atomic_check(&all).is_ok() {
            let c = self
                .commit(writes_of(all), vec![Self::journal_absent(journal)], 0)
                .await?;
            return if c.succeeded { Ok(()) } else { Err(busy()) };
        }
        let mut closing = last.clone();
        closing.push(BatchOp::Delete(journal.to_vec()));
        atomic_check(&closing).map_err(|why| {
            StoreError::Unavailable(format!("the last step of a journaled change: {why}"))
        })?;
        let c = self
            .commit(
                vec![(journal.to_vec(), Some(seal(encode_journal(&steps, &last))))],
                vec![Self::journal_absent(journal)],
                0,
            )
            .await?;
        if !c.succeeded {
            return Err(busy());
        }
        self.roll_forward(journal, open).await.map(|_| ())
    }

    /// Finishes the journaled change under `journal`, if there is one:
    /// applies its steps, then its last part with the journal's deletion.
    /// Every step is guarded by the journal's revision, so of several
    /// finishers (the writer, and readers that waited too long) the work of
    /// the first to end is not repeated after it. Returns whether there was
    /// one. `open` gives the journal's encoding from its record (or refuses it).
    pub async fn roll_forward(
        &self,
        journal: &[u8],
        open: impl Fn(Vec<u8>) -> StoreResult<Vec<u8>>,
    ) -> StoreResult<bool> {
        let dkey = data_key(journal);
        let mut kv = self.clients.kv.clone();
        let r = rpc("get", kv.get(dkey.clone(), None)).await?;
        let revision = r.header().map_or(0, |h| h.revision());
        let Some(found) = r.kvs().first() else {
            return Ok(false);
        };
        let guard = Compare::mod_revision(dkey.clone(), CompareOp::Equal, found.mod_revision());
        let raw = open(self.resolve(&dkey, found.value(), revision).await?)?;
        let (steps, last) = decode_journal(&raw).ok_or_else(|| corrupt(&dkey))?;
        if !self.apply_guarded(writes_of(steps), &guard).await? {
            return Ok(true);
        }
        let mut closing = writes_of(last);
        closing.push((journal.to_vec(), None));
        self.commit(closing, vec![guard], 0).await?;
        Ok(true)
    }

    /// `writes` in as many transactions as they need, each guarded by
    /// `guard`; false (and the rest not written) once the guard fails.
    async fn apply_guarded(
        &self,
        writes: Vec<(Vec<u8>, Option<Vec<u8>>)>,
        guard: &Compare,
    ) -> StoreResult<bool> {
        if writes.is_empty() {
            return Ok(true);
        }
        let p = plan(writes, 0);
        let pending = if p.chunks.is_empty() {
            0
        } else {
            self.grant(PENDING_CHUNK_TTL).await?
        };
        let (chunks, relabels) = staged_chunks(p.chunks, pending, 0);
        let result = async {
            for g in groups(chunks) {
                self.txn(Vec::new(), g).await?;
            }
            let mut ops = relabels;
            ops.extend(p.records);
            for g in groups(ops) {
                let (ok, replaced) = self.txn(vec![guard.clone()], g).await?;
                if !ok {
                    return Ok(false);
                }
                self.clean_up(&replaced, 0).await;
            }
            Ok(true)
        }
        .await;
        // Only chunks never relabelled are still on the pending lease.
        if pending != 0 {
            self.revoke_quietly(pending).await;
        }
        result
    }
}

fn writes_of(ops: Vec<BatchOp>) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
    ops.into_iter()
        .map(|op| match op {
            BatchOp::Put(k, v) => (k, Some(v)),
            BatchOp::Delete(k) => (k, None),
        })
        .collect()
}

/// A journal's value: for `steps` then `last`, a u32 count and each op as a
/// tag (0 put, 1 delete), a u32 key length and the key, for a put a u32
/// value length and the value (big-endian).
pub(crate) fn encode_journal(steps: &[BatchOp], last: &[BatchOp]) -> Vec<u8> {
    let mut out = Vec::new();
    for part in [steps, last] {
        out.extend_from_slice(&(part.len() as u32).to_be_bytes());
        for op in part {
            let (tag, key, value) = match op {
                BatchOp::Put(k, v) => (0u8, k, Some(v)),
                BatchOp::Delete(k) => (1u8, k, None),
            };
            out.push(tag);
            out.extend_from_slice(&(key.len() as u32).to_be_bytes());
            out.extend_from_slice(key);
            if let Some(v) = value {
                out.extend_from_slice(&(v.len() as u32).to_be_bytes());
                out.extend_from_slice(v);
            }
        }
    }
    out
}

fn decode_journal(mut raw: &[u8]) -> Option<(Vec<BatchOp>, Vec<BatchOp>)> {
    fn take<'a>(raw: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        if raw.len() < n {
            return None;
        }
        let (head, rest) = raw.split_at(n);
        *raw = rest;
        Some(head)
    }
    fn len(raw: &mut &[u8]) -> Option<usize> {
        Some(u32::from_be_bytes(take(raw, 4)?.try_into().ok()?) as usize)
    }
    let mut parts = Vec::with_capacity(2);
    for _ in 0..2 {
        let n = len(&mut raw)?;
        let mut ops = Vec::with_capacity(n.min(1 << 16));
        for _ in 0..n {
            let tag = take(&mut raw, 1)?[0];
            let kl = len(&mut raw)?;
            let key = take(&mut raw, kl)?.to_vec();
            ops.push(match tag {
                0 => {
                    let vl = len(&mut raw)?;
                    BatchOp::Put(key, take(&mut raw, vl)?.to_vec())
                }
                1 => BatchOp::Delete(key),
                _ => return None,
            });
        }
        parts.push(ops);
    }
    if !raw.is_empty() {
        return None;
    }
    let last = parts.pop()?;
    let steps = parts.pop()?;
    Some((steps, last))
}

impl EtcdStore {
    /// The rows under `prefix` not below `start` (a key at or past `prefix`),
    /// in key order, at most `limit`: a page of a listing resumes here
    /// without reading the keys before it.
    pub async fn scan_from(
        &self,
        prefix: &[u8],
        start: &[u8],
        limit: usize,
    ) -> StoreResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let end = prefix_end(&data_key(prefix));
        let mut out = Vec::new();
        let mut from = data_key(start.max(prefix));
        // Every page is read as of the first one's revision: one consistent snapshot.
        let mut revision = 0;
        while out.len() < limit {
            let page = (limit - out.len()).min(SCAN_PAGE as usize) as i64;
            let mut opts = GetOptions::new().with_range(end.clone()).with_limit(page);
            if revision != 0 {
                opts = opts.with_revision(revision);
            }
            let mut kv = self.clients.kv.clone();
            let r = rpc("scan", kv.get(from, Some(opts))).await?;
            if revision == 0 {
                revision = r.header().map_or(0, |h| h.revision());
            }
            for found in r.kvs() {
                let value = self.resolve(found.key(), found.value(), revision).await?;
                out.push((found.key()[DATA.len()..].to_vec(), value));
            }
            match r.kvs().last() {
                Some(last) if r.more() => from = successor(last.key()),
                _ => break,
            }
        }
        Ok(out)
    }
}

impl OrderedKv for EtcdStore {
    async fn get(&self, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        let dkey = data_key(key);
        let mut kv = self.clients.kv.clone();
        let r = rpc("get", kv.get(dkey.clone(), None)).await?;
        let revision = r.header().map_or(0, |h| h.revision());
        match r.kvs().first() {
            None => Ok(None),
            Some(found) => self.resolve(&dkey, found.value(), revision).await.map(Some),
        }
    }

    async fn put(&self, key: &[u8], value: &[u8]) -> StoreResult<()> {
        self.commit(vec![(key.to_vec(), Some(value.to_vec()))], Vec::new(), 0)
            .await
            .map(|_| ())
    }

    async fn put_ttl(&self, key: &[u8], value: &[u8], ttl: Duration) -> StoreResult<()> {
        let lease = self.grant_ttl(ttl).await?;
        // On failure the lease is left to run out: the write may have landed, and
        // revoking would delete it.
        self.commit(
            vec![(key.to_vec(), Some(value.to_vec()))],
            Vec::new(),
            lease,
        )
        .await
        .map(|_| ())
    }

    async fn delete(&self, key: &[u8]) -> StoreResult<bool> {
        let c = self
            .commit(vec![(key.to_vec(), None)], Vec::new(), 0)
            .await?;
        Ok(!c.replaced.is_empty())
    }

    async fn scan_prefix(
        &self,
        prefix: &[u8],
        limit: usize,
    ) -> StoreResult<Vec<(Vec<u8>, Vec<u8>)>> {
        self.scan_from(prefix, prefix, limit).await
    }

    async fn compare_and_swap(
        &self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
        ttl: Option<Duration>,
    ) -> StoreResult<bool> {
        let mut lease = 0;
        let r = self.swap(key, expected, new, ttl, &mut lease).await;
        // Revoke the lease only when the swap surely did not happen; after an
        // error the write may have landed.
        if lease != 0 && matches!(r, Ok(false)) {
            self.revoke_quietly(lease).await;
        }
        r
    }

    async fn apply_batch(&self, ops: Vec<BatchOp>) -> StoreResult<()> {
        let writes = ops
            .into_iter()
            .map(|op| match op {
                BatchOp::Put(k, v) => (k, Some(v)),
                BatchOp::Delete(k) => (k, None),
            })
            .collect();
        self.commit(writes, Vec::new(), 0).await.map(|_| ())
    }

    /// etcd acknowledges a write once a quorum has it on disk: nothing to flush.
    async fn flush(&self) -> StoreResult<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::etcd_process::EtcdProcess;
    use std::time::Instant;

    async fn store() -> (EtcdProcess, EtcdStore) {
        let e = EtcdProcess::start();
        let s = EtcdStore::connect_with(&[e.url()], &access_for(&e))
            .await
            .unwrap();
        (e, s)
    }

    /// The `[cluster]` settings that reach `e` (TLS files, user), loaded.
    fn access_for(e: &EtcdProcess) -> EtcdAccess {
        EtcdAccess::from_config(&cluster_config(&e.cluster_toml())).unwrap()
    }

    fn cluster_config(toml_text: &str) -> crate::config::ClusterConfig {
        toml::from_str(toml_text).unwrap()
    }

    async fn refused(e: &EtcdProcess, c: &crate::config::ClusterConfig) -> String {
        let access = EtcdAccess::from_config(c).unwrap();
        match EtcdStore::connect_with(&[e.url()], &access).await {
            Err(ConnectError::Refused(m)) => m,
            Err(other) => panic!("not a refusal: {other}"),
            Ok(_) => panic!("connected"),
        }
    }

    /// etcd with `--client-cert-auth`: the node's client certificate from the
    /// CA etcd trusts connects and writes; a client certificate from another
    /// CA is refused naming cluster.etcd_cert_file; no client certificate is
    /// refused too; a CA that did not sign etcd's certificate is named.
    #[tokio::test]
    async fn tls_client_certificates() {
        use crate::storage::etcd_process::TestPki;
        let e = EtcdProcess::start_tls();
        assert!(e.url().starts_with("https://127.0.0.1:"));
        let s = EtcdStore::connect_with(&[e.url()], &access_for(&e))
            .await
            .unwrap();
        s.put(b"k", b"v").await.unwrap();
        assert_eq!(s.get(b"k").await.unwrap(), Some(b"v".to_vec()));

        let other_dir = tempfile::tempdir().unwrap();
        let other = TestPki::generate(other_dir.path(), "other");
        let pki = e.pki().unwrap();
        let mut c = cluster_config(&e.cluster_toml());
        c.etcd_cert_file = other.client_cert.display().to_string();
        c.etcd_key_file = other.client_key.display().to_string();
        let m = refused(&e, &c).await;
        assert!(
            m.contains("refused the TLS handshake with cluster.etcd_cert_file")
                && m.contains(&c.etcd_cert_file)
                && m.contains(&e.url()),
            "{m}"
        );

        let mut c = cluster_config(&e.cluster_toml());
        c.etcd_cert_file.clear();
        c.etcd_key_file.clear();
        let m = refused(&e, &c).await;
        assert!(m.contains("without a client certificate"), "{m}");

        let mut c = cluster_config(&e.cluster_toml());
        c.etcd_ca_file = other.ca.display().to_string();
        let m = refused(&e, &c).await;
        assert!(
            m.contains("cluster.etcd_ca_file") && m.contains(&c.etcd_ca_file),
            "{m}"
        );
        // The right files again: still fine (nothing was cached wrongly).
        assert!(pki.client_cert.exists());
        EtcdStore::connect_with(&[e.url()], &access_for(&e))
            .await
            .unwrap();
    }

    /// Each unusable file is named with its reason before any connection.
    #[test]
    fn tls_files_checked() {
        let dir = tempfile::tempdir().unwrap();
        let pki = crate::storage::etcd_process::TestPki::generate(dir.path(), "files");
        let other = crate::storage::etcd_process::TestPki::generate(dir.path(), "other");
        use std::path::Path;
        let not_pem = dir.path().join("not.pem");
        std::fs::write(&not_pem, "hello\n").unwrap();
        let base = |ca: &Path, cert: &Path, key: &Path| crate::config::ClusterConfig {
            etcd: vec!["https://127.0.0.1:1".into()],
            etcd_ca_file: ca.display().to_string(),
            etcd_cert_file: cert.display().to_string(),
            etcd_key_file: key.display().to_string(),
            ..Default::default()
        };
        let missing = dir.path().join("missing.pem");
        for (c, want) in [
            (
                base(&missing, &pki.client_cert, &pki.client_key),
                format!("cluster.etcd_ca_file {}: no such file", missing.display()),
            ),
            (
                base(&pki.ca, &missing, &pki.client_key),
                format!("cluster.etcd_cert_file {}: no such file", missing.display()),
            ),
            (
                base(&pki.ca, &not_pem, &pki.client_key),
                format!("cluster.etcd_cert_file {}: not PEM", not_pem.display()),
            ),
            (
                base(&pki.ca, &pki.client_cert, &not_pem),
                format!(
                    "cluster.etcd_key_file {}: not a PEM private key",
                    not_pem.display()
                ),
            ),
            (
                base(&pki.ca, &pki.client_cert, &other.client_key),
                format!(
                    "cluster.etcd_key_file {}: does not match cluster.etcd_cert_file",
                    other.client_key.display()
                ),
            ),
        ] {
            let e = EtcdAccess::from_config(&c).unwrap_err().to_string();
            assert!(e.starts_with(&want), "{e}\nwanted {want}");
        }
        assert!(EtcdAccess::from_config(&base(&pki.ca, &pki.client_cert, &pki.client_key)).is_ok());
    }

    /// etcd with auth on: the user with its password connects and writes
    /// under `meshgate/`; a wrong password is refused naming the user and
    /// cluster.etcd_password_file; no user at all is refused too.
    #[tokio::test]
    async fn etcd_users() {
        let mut e = EtcdProcess::start_plain();
        e.enable_auth("mg", "right-password");
        let c = cluster_config(&e.cluster_toml());
        assert_eq!(c.etcd_user, "mg");
        let s = EtcdStore::connect_with(&[e.url()], &EtcdAccess::from_config(&c).unwrap())
            .await
            .unwrap();
        s.put(b"k", b"v").await.unwrap();
        s.put_ttl(b"t", b"v", Duration::from_secs(30))
            .await
            .unwrap();
        assert!(
            s.compare_and_swap(b"k", Some(b"v"), Some(b"w"), None)
                .await
                .unwrap()
        );
        assert_eq!(s.get(b"k").await.unwrap(), Some(b"w".to_vec()));

        let dir = tempfile::tempdir().unwrap();
        let wrong = dir.path().join("wrong");
        std::fs::write(&wrong, "wrong-password\n").unwrap();
        let mut bad = c.clone();
        bad.etcd_password_file = wrong.display().to_string();
        let m = refused(&e, &bad).await;
        assert!(
            m.contains("refused user mg") && m.contains(&bad.etcd_password_file),
            "{m}"
        );
        let mut none = c.clone();
        none.etcd_user.clear();
        none.etcd_password_file.clear();
        let m = refused(&e, &none).await;
        assert!(m.contains("set cluster.etcd_user"), "{m}");
    }

    /// How many raw etcd keys start with `prefix` (chunks, records).
    async fn raw_count(s: &EtcdStore, prefix: &[u8]) -> i64 {
        let opts = GetOptions::new()
            .with_range(prefix_end(prefix))
            .with_count_only();
        let mut kv = s.clients.kv.clone();
        kv.get(prefix, Some(opts)).await.unwrap().count()
    }

    fn big(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
    }

    /// The member list names etcd's peer URL and client URL, which the node
    /// adds to its own addresses (an upstream may reach neither).
    #[tokio::test]
    async fn members_name_peer_and_client_urls() {
        let (e, s) = store().await;
        let members = s.members().await.unwrap();
        assert_eq!(members.len(), 1, "{members:?}");
        assert_eq!(members[0].name, "test");
        assert_eq!(members[0].peer_urls, [e.peer_url()]);
        assert_eq!(members[0].client_urls, [e.url()]);
    }

    /// Put, get, overwrite and delete; delete says whether the key existed.
    #[tokio::test]
    async fn get_put_delete() {
        let (_e, s) = store().await;
        assert_eq!(s.get(b"k").await.unwrap(), None);
        s.put(b"k", b"v1").await.unwrap();
        assert_eq!(s.get(b"k").await.unwrap().as_deref(), Some(&b"v1"[..]));
        s.put(b"k", b"").await.unwrap();
        assert_eq!(s.get(b"k").await.unwrap().as_deref(), Some(&b""[..]));
        assert!(s.delete(b"k").await.unwrap());
        assert!(!s.delete(b"k").await.unwrap());
        assert_eq!(s.get(b"k").await.unwrap(), None);
        s.flush().await.unwrap();
    }

    /// Prefix scans return keys in byte order, stop at the prefix's end and the
    /// limit, and page through more keys than one request reads.
    #[tokio::test]
    async fn prefix_scan_order_and_limit() {
        let (_e, s) = store().await;
        for k in ["a/3", "a/1", "b/1", "a/2", "a/10", "a", "a/\u{ff}"] {
            s.put(k.as_bytes(), k.as_bytes()).await.unwrap();
        }
        let got = s.scan_prefix(b"a/", 100).await.unwrap();
        let keys: Vec<String> = got
            .iter()
            .map(|(k, _)| String::from_utf8(k.clone()).unwrap())
            .collect();
        assert_eq!(keys, ["a/1", "a/10", "a/2", "a/3", "a/\u{ff}"]);
        assert!(got.iter().all(|(k, v)| k == v));
        assert_eq!(s.scan_prefix(b"a/", 2).await.unwrap().len(), 2);
        assert!(s.scan_prefix(b"a/", 0).await.unwrap().is_empty());
        let n = SCAN_PAGE as usize * 2 + 7;
        let batch = (0..n)
            .map(|i| BatchOp::Put(format!("p/{i:04}").into_bytes(), vec![1]))
            .collect();
        s.apply_batch(batch).await.unwrap();
        let all = s.scan_prefix(b"p/", usize::MAX).await.unwrap();
        assert_eq!(all.len(), n);
        assert!(all.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(s.scan_prefix(b"p/", n - 3).await.unwrap().len(), n - 3);
        assert_eq!(s.scan_prefix(b"", usize::MAX).await.unwrap().len(), n + 7);
    }

    /// A scan from a key inside the prefix (a listing's next page) starts
    /// there, stops at the prefix's end and the limit, across more keys
    /// than one request reads; keys-only the same.
    #[tokio::test]
    async fn scan_from_resumes_inside_the_prefix() {
        let (_e, s) = store().await;
        let n = SCAN_PAGE as usize * 2 + 7;
        let mut batch: Vec<BatchOp> = (0..n)
            .map(|i| BatchOp::Put(format!("p/{i:04}").into_bytes(), vec![1]))
            .collect();
        batch.push(BatchOp::Put(b"p".to_vec(), vec![1]));
        batch.push(BatchOp::Put(b"q/0".to_vec(), vec![1]));
        s.apply_batch(batch).await.unwrap();
        let keys = |rows: Vec<(Vec<u8>, Vec<u8>)>| -> Vec<Vec<u8>> {
            rows.into_iter().map(|(k, _)| k).collect()
        };
        let from = s.scan_from(b"p/", b"p/0005\0", 3).await.unwrap();
        assert_eq!(
            keys(from),
            [b"p/0006".to_vec(), b"p/0007".to_vec(), b"p/0008".to_vec()]
        );
        let rest = s.scan_from(b"p/", b"p/0010", usize::MAX).await.unwrap();
        assert_eq!(rest.len(), n - 10);
        assert_eq!(
            rest.last().unwrap().0,
            format!("p/{:04}", n - 1).into_bytes()
        );
        // A start below the prefix reads from the prefix; past it, nothing.
        assert_eq!(s.scan_from(b"p/", b"a", 1).await.unwrap()[0].0, b"p/0000");
        assert!(s.scan_from(b"p/", b"q", 5).await.unwrap().is_empty());
        let k = s
            .scan_keys_from_unless(b"p/", b"p/0100", 500, b"_j")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(k.len(), n - 100);
        assert_eq!(k[0], b"p/0100");
    }

    /// Guarded changes that each write a key and count it on a shared
    /// counter, many at once: the counter ends exact, and a refused
    /// decision writes nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn transact_keeps_a_counter_exact_under_concurrent_writers() {
        let (_e, s) = store().await;
        let mut tasks = Vec::new();
        for t in 0..8u32 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..10u64 {
                    let key = format!("item/{t}/{i}").into_bytes();
                    let keys = [key.clone(), b"count".to_vec()];
                    let r = s
                        .transact(&keys, None, |vals: &[Option<Vec<u8>>]| {
                            let n: u64 = vals[1]
                                .as_deref()
                                .map_or(0, |v| String::from_utf8_lossy(v).parse().unwrap());
                            Ok::<_, ()>((
                                vec![
                                    BatchOp::Put(key.clone(), b"x".to_vec()),
                                    BatchOp::Put(
                                        b"count".to_vec(),
                                        (n + 1).to_string().into_bytes(),
                                    ),
                                ],
                                n + 1,
                            ))
                        })
                        .await
                        .unwrap();
                    assert!(matches!(r, Some(Ok(_))));
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let count = s.get(b"count").await.unwrap().unwrap();
        assert_eq!(String::from_utf8(count).unwrap(), (8 * 10).to_string());
        assert_eq!(
            s.scan_prefix(b"item/", usize::MAX).await.unwrap().len(),
            8 * 10 as usize
        );
        let keys = [b"item/refused".to_vec(), b"count".to_vec()];
        let r = s
            .transact(&keys, None, |_: &[Option<Vec<u8>>]| {
                Err::<(Vec<BatchOp>, ()), _>("no")
            })
            .await
            .unwrap();
        assert_eq!(r, Some(Err("no")));
        assert!(s.get(b"item/refused").await.unwrap().is_none());
        assert_eq!(
            String::from_utf8(s.get(b"count").await.unwrap().unwrap()).unwrap(),
            (8 * 10).to_string()
        );
    }

    /// Of many concurrent writers doing CAS from the same expected value, exactly one wins.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn cas_exactly_one_winner() {
        let (_e, s) = store().await;
        s.put(b"slot", b"free").await.unwrap();
        let mut tasks = Vec::new();
        for i in 0..32u32 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                s.compare_and_swap(
                    b"slot",
                    Some(b"free"),
                    Some(format!("w{i}").as_bytes()),
                    None,
                )
                .await
                .unwrap()
            }));
        }
        let mut wins = 0;
        for t in tasks {
            wins += t.await.unwrap() as usize;
        }
        assert_eq!(wins, 1);
        assert!(s.get(b"slot").await.unwrap().unwrap().starts_with(b"w"));
    }

    /// Of many concurrent writers claiming an absent key, exactly one wins.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn cas_on_absent_one_winner() {
        let (_e, s) = store().await;
        let mut tasks = Vec::new();
        for i in 0..16u32 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                s.compare_and_swap(b"claim", None, Some(&i.to_be_bytes()), None)
                    .await
                    .unwrap()
            }));
        }
        let mut wins = 0;
        for t in tasks {
            wins += t.await.unwrap() as usize;
        }
        assert_eq!(wins, 1);
    }

    /// CAS on an absent key succeeds once; CAS with the wrong expected value fails;
    /// CAS to None deletes.
    #[tokio::test]
    async fn cas_absent_and_mismatch() {
        let (_e, s) = store().await;
        assert!(
            s.compare_and_swap(b"k", None, Some(b"1"), None)
                .await
                .unwrap()
        );
        assert!(
            !s.compare_and_swap(b"k", None, Some(b"2"), None)
                .await
                .unwrap()
        );
        assert!(
            !s.compare_and_swap(b"k", Some(b"9"), Some(b"2"), None)
                .await
                .unwrap()
        );
        assert_eq!(s.get(b"k").await.unwrap().as_deref(), Some(&b"1"[..]));
        assert!(
            s.compare_and_swap(b"k", Some(b"1"), None, None)
                .await
                .unwrap()
        );
        assert_eq!(s.get(b"k").await.unwrap(), None);
        assert!(
            !s.compare_and_swap(b"k", Some(b"1"), None, None)
                .await
                .unwrap()
        );
    }

    /// Polls until `key` is gone; returns how long that took.
    async fn wait_gone(s: &EtcdStore, key: &[u8], within: Duration) -> Duration {
        let start = Instant::now();
        while s.get(key).await.unwrap().is_some() {
            assert!(start.elapsed() < within, "key still there after {within:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        start.elapsed()
    }

    /// A value put with a TTL is readable, then gone (scan and CAS see it absent);
    /// a plain put over it keeps the key for good.
    #[tokio::test]
    async fn ttl_expiry() {
        let (_e, s) = store().await;
        s.put_ttl(b"t", b"v", Duration::from_millis(1500))
            .await
            .unwrap();
        s.put_ttl(b"kept", b"v", Duration::from_secs(1))
            .await
            .unwrap();
        s.put(b"kept", b"plain").await.unwrap();
        assert_eq!(s.get(b"t").await.unwrap().as_deref(), Some(&b"v"[..]));
        let took = wait_gone(&s, b"t", Duration::from_secs(10)).await;
        assert!(took >= Duration::from_millis(1000), "gone early: {took:?}");
        assert!(s.scan_prefix(b"t", 10).await.unwrap().is_empty());
        assert!(
            s.compare_and_swap(b"t", None, Some(b"b"), None)
                .await
                .unwrap()
        );
        assert_eq!(
            s.get(b"kept").await.unwrap().as_deref(),
            Some(&b"plain"[..])
        );
        // A CAS with a TTL sets one; a large value under a TTL takes its chunks with it.
        assert!(
            s.compare_and_swap(b"c", None, Some(b"x"), Some(Duration::from_secs(1)))
                .await
                .unwrap()
        );
        s.put_ttl(b"big", &big(3 << 20, 1), Duration::from_secs(1))
            .await
            .unwrap();
        assert!(raw_count(&s, CHUNKS).await > 0);
        wait_gone(&s, b"c", Duration::from_secs(10)).await;
        wait_gone(&s, b"big", Duration::from_secs(10)).await;
        assert_eq!(raw_count(&s, CHUNKS).await, 0);
    }

    /// A batch applies all its writes together: a reader never sees a half.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn batch_is_applied_whole() {
        let (_e, s) = store().await;
        s.put(b"old", b"1").await.unwrap();
        s.apply_batch(vec![
            BatchOp::Put(b"new".to_vec(), b"2".to_vec()),
            BatchOp::Delete(b"old".to_vec()),
            BatchOp::Put(b"twice".to_vec(), b"a".to_vec()),
            BatchOp::Put(b"twice".to_vec(), b"b".to_vec()),
        ])
        .await
        .unwrap();
        assert_eq!(s.get(b"old").await.unwrap(), None);
        assert_eq!(s.get(b"new").await.unwrap().as_deref(), Some(&b"2"[..]));
        assert_eq!(s.get(b"twice").await.unwrap().as_deref(), Some(&b"b"[..]));
        // A value moves between two keys, with a large value alongside, while a reader watches.
        s.put(b"m/a", b"x").await.unwrap();
        let writer = {
            let s = s.clone();
            tokio::spawn(async move {
                for i in 0..20u8 {
                    let (from, to): (&[u8], &[u8]) = if i % 2 == 0 {
                        (b"m/a", b"m/b")
                    } else {
                        (b"m/b", b"m/a")
                    };
                    s.apply_batch(vec![
                        BatchOp::Put(to.to_vec(), b"x".to_vec()),
                        BatchOp::Put(b"m/big".to_vec(), big(2 << 20, i)),
                        BatchOp::Delete(from.to_vec()),
                    ])
                    .await
                    .unwrap();
                }
            })
        };
        let mut reads = 0;
        while !writer.is_finished() {
            let seen = s.scan_prefix(b"m/", 10).await.unwrap();
            let movers = seen.iter().filter(|(k, _)| k != b"m/big").count();
            assert_eq!(movers, 1, "half a batch seen: {:?}", seen.len());
            reads += 1;
        }
        writer.await.unwrap();
        assert!(reads > 0);
        assert_eq!(s.get(b"m/big").await.unwrap().unwrap(), big(2 << 20, 19));
        // Only the last large value's chunks remain.
        assert_eq!(raw_count(&s, CHUNKS).await, 2);
    }

    /// A batch of more operations than one etcd transaction holds, and of more
    /// bytes than one request carries, is applied in full.
    #[tokio::test]
    async fn oversized_batch_applies() {
        let (_e, s) = store().await;
        let many = (0..300)
            .map(|i| BatchOp::Put(format!("n/{i:03}").into_bytes(), vec![7; 10]))
            .collect();
        s.apply_batch(many).await.unwrap();
        assert_eq!(s.scan_prefix(b"n/", usize::MAX).await.unwrap().len(), 300);
        let medium: Vec<BatchOp> = (0..8u8)
            .map(|i| BatchOp::Put(vec![b'q', i], big(400 << 10, i)))
            .collect();
        s.apply_batch(medium).await.unwrap();
        let got = s.scan_prefix(b"q", 100).await.unwrap();
        assert_eq!(got.len(), 8);
        for (i, (_, v)) in got.iter().enumerate() {
            assert_eq!(*v, big(400 << 10, i as u8));
        }
    }

    /// A 5 MiB value round-trips through get, scan and CAS; its chunks never show
    /// in scans, and overwriting or deleting it removes them.
    #[tokio::test]
    async fn large_value_round_trip() {
        let (_e, s) = store().await;
        let v = big(5 << 20, 3);
        s.put(b"blob/x", &v).await.unwrap();
        s.put(b"blob/y", b"small").await.unwrap();
        assert_eq!(s.get(b"blob/x").await.unwrap().unwrap(), v);
        assert_eq!(raw_count(&s, CHUNKS).await, 5);
        let scanned = s.scan_prefix(b"", usize::MAX).await.unwrap();
        assert_eq!(scanned.len(), 2);
        assert_eq!(scanned[0], (b"blob/x".to_vec(), v.clone()));
        let w = big(5 << 20, 4);
        assert!(
            !s.compare_and_swap(b"blob/x", Some(&w), Some(b"no"), None)
                .await
                .unwrap()
        );
        assert!(
            s.compare_and_swap(b"blob/x", Some(&v), Some(&w), None)
                .await
                .unwrap()
        );
        assert_eq!(s.get(b"blob/x").await.unwrap().unwrap(), w);
        assert_eq!(raw_count(&s, CHUNKS).await, 5);
        s.put(b"blob/x", b"now small").await.unwrap();
        assert_eq!(raw_count(&s, CHUNKS).await, 0);
        s.put(b"blob/x", &v).await.unwrap();
        assert!(s.delete(b"blob/x").await.unwrap());
        assert_eq!(raw_count(&s, CHUNKS).await, 0);
        assert_eq!(s.get(b"blob/x").await.unwrap(), None);
    }

    /// A chunk that does not match its header reads as corrupt, not as a wrong value.
    #[tokio::test]
    async fn damaged_chunk_is_corrupt() {
        let (_e, s) = store().await;
        s.put(b"d", &big(3 << 20, 5)).await.unwrap();
        let mut kv = s.clients.kv.clone();
        let first = kv
            .get(CHUNKS, Some(GetOptions::new().with_prefix().with_limit(1)))
            .await
            .unwrap();
        let key = first.kvs()[0].key().to_vec();
        kv.put(key, vec![0u8; 10], None).await.unwrap();
        assert!(matches!(s.get(b"d").await, Err(StoreError::Corrupt(k)) if k == "d"));
    }

    /// A prefix watch reports puts, deletes and expired leases under its
    /// prefix only, with the store's keys, also after the request timeout
    /// (a watch is no request with a deadline).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn watch_reports_changes_under_its_prefix() {
        use crate::storage::Change;
        let (_e, s) = store().await;
        let mut w = s.watch_prefix(b"reg/").await.unwrap();
        s.put(b"other", b"x").await.unwrap();
        s.put(b"reg/a", b"1").await.unwrap();
        let next = async |w: &mut EtcdWatch| {
            tokio::time::timeout(Duration::from_secs(10), w.next())
                .await
                .expect("a change within 10 s")
                .unwrap()
        };
        assert_eq!(next(&mut w).await, [Change::Put(b"reg/a".to_vec())]);
        tokio::time::sleep(REQUEST_TIMEOUT + Duration::from_secs(1)).await;
        s.put_ttl(b"reg/b", b"2", Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(next(&mut w).await, [Change::Put(b"reg/b".to_vec())]);
        assert!(s.delete(b"reg/a").await.unwrap());
        assert_eq!(next(&mut w).await, [Change::Delete(b"reg/a".to_vec())]);
        // The lease runs out (etcd checks leases about every 500 ms).
        assert_eq!(next(&mut w).await, [Change::Delete(b"reg/b".to_vec())]);
    }

    /// etcd stopped: a watch ends with an error (the caller makes it again).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn watch_breaks_when_etcd_goes() {
        let (mut e, s) = store().await;
        let mut w = s.watch_prefix(b"reg/").await.unwrap();
        e.stop();
        let r = tokio::time::timeout(Duration::from_secs(30), w.next())
            .await
            .expect("the watch noticed within 30 s");
        assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
        assert!(s.watch_prefix(b"reg/").await.is_err());
    }

    /// etcd stopped: operations fail as unavailable within the request timeout;
    /// etcd back on the same data: the same handle works again, data intact.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unavailable_then_recovers() {
        let (mut e, s) = store().await;
        s.put(b"k", b"v").await.unwrap();
        s.put(b"large", &big(2 << 20, 9)).await.unwrap();
        e.stop();
        for _ in 0..2 {
            let start = Instant::now();
            let r = s.get(b"k").await;
            assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
            assert!(start.elapsed() < REQUEST_TIMEOUT + Duration::from_secs(1));
            let start = Instant::now();
            let r = s.put(b"k2", b"v").await;
            assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
            assert!(start.elapsed() < REQUEST_TIMEOUT + Duration::from_secs(1));
        }
        e.resume();
        let start = Instant::now();
        let value = loop {
            match s.get(b"k").await {
                Ok(v) => break v,
                Err(err) => {
                    assert!(
                        start.elapsed() < Duration::from_secs(15),
                        "not recovered: {err}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        assert_eq!(value.as_deref(), Some(&b"v"[..]));
        assert_eq!(s.get(b"large").await.unwrap().unwrap(), big(2 << 20, 9));
        s.put(b"k2", b"w").await.unwrap();
        assert_eq!(s.get(b"k2").await.unwrap().as_deref(), Some(&b"w"[..]));
    }

    /// etcd frozen (connections open, no answers): an operation fails as
    /// unavailable at the request timeout, not later; thawed, the handle works.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frozen_etcd_times_out() {
        let (e, s) = store().await;
        s.put(b"k", b"v").await.unwrap();
        e.freeze();
        let start = Instant::now();
        let r = s.get(b"k").await;
        let took = start.elapsed();
        e.thaw();
        assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
        assert!(took < REQUEST_TIMEOUT + Duration::from_secs(1), "{took:?}");
        let start = Instant::now();
        loop {
            match s.get(b"k").await {
                Ok(v) => break assert_eq!(v.as_deref(), Some(&b"v"[..])),
                Err(err) => assert!(start.elapsed() < Duration::from_secs(15), "{err}"),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A write of chunks too large for one transaction leaves nothing when its guard fails.
    #[tokio::test]
    async fn failed_large_cas_leaves_no_chunks() {
        let (_e, s) = store().await;
        s.put(b"k", b"theirs").await.unwrap();
        // The guard is checked after the read: simulate a racing writer by a
        // direct guard on a stale revision.
        let stale = Compare::mod_revision(data_key(b"k"), CompareOp::Equal, 1);
        let c = s
            .commit(vec![(b"k".to_vec(), Some(big(4 << 20, 2)))], vec![stale], 0)
            .await
            .unwrap();
        assert!(!c.succeeded);
        assert_eq!(raw_count(&s, CHUNKS).await, 0);
        assert_eq!(s.get(b"k").await.unwrap().as_deref(), Some(&b"theirs"[..]));
    }

    /// The chunk header round-trips and rejects damaged records.
    #[test]
    fn chunk_header_codec() {
        let h = ChunkHeader {
            generation: [7; GENERATION_BYTES],
            len: 5 << 20,
            count: 5,
            crc: 0xdead_beef,
        };
        let raw = h.encode();
        assert_eq!(raw.len(), HEADER_BYTES);
        assert_eq!(ChunkHeader::decode(&raw), Some(h));
        assert_eq!(ChunkHeader::decode(&raw[..HEADER_BYTES - 1]), None);
        let mut inline = raw.clone();
        inline[0] = INLINE;
        assert_eq!(ChunkHeader::decode(&inline), None);
    }

    /// Small values stay inline; in a batch too large for one request the largest go to chunks.
    #[test]
    fn plan_chunks_only_what_does_not_fit() {
        let small = plan(vec![(b"a".to_vec(), Some(vec![1; 1000]))], 0);
        assert!(small.chunks.is_empty());
        let large = plan(vec![(b"a".to_vec(), Some(vec![1; 3 << 20]))], 0);
        assert_eq!(large.chunks.len(), 3);
        let mixed = plan(
            vec![
                (b"a".to_vec(), Some(vec![1; 900_000])),
                (b"b".to_vec(), Some(vec![1; 600_000])),
                (b"c".to_vec(), Some(vec![1; 10])),
                (b"d".to_vec(), None),
            ],
            0,
        );
        assert_eq!(mixed.generations.len(), 1);
        assert_eq!(mixed.records.len(), 4);
        assert!(groups(mixed.records).len() == 1);
    }

    /// A journaled change of 300 keys (more than one transaction): while its
    /// journal is there, readers and writers that name it are refused; a
    /// journal left by a writer that died is finished by `roll_forward`; a
    /// concurrent guarded reader never sees a mix of old and new values; a
    /// last part too large for one transaction is refused before anything is
    /// written. The journal encoding round-trips.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn journaled_change_is_all_or_nothing_for_guarded_readers() {
        let (_e, s) = store().await;
        let journal = b"_import/j";
        let keys: Vec<Vec<u8>> = (0..300)
            .map(|i| format!("j/k{i:03}").into_bytes())
            .collect();
        let all = |v: &[u8]| -> Vec<BatchOp> {
            keys.iter()
                .map(|k| BatchOp::Put(k.clone(), v.to_vec()))
                .collect()
        };
        s.apply_journaled(
            journal,
            all(b"a"),
            vec![BatchOp::Put(b"meta".to_vec(), b"a".to_vec())],
            std::convert::identity,
            Ok,
        )
        .await
        .unwrap();
        assert_eq!(s.scan_prefix(b"j/", 1000).await.unwrap().len(), 300);
        assert_eq!(s.get(journal).await.unwrap(), None);

        let (steps, last) = (
            all(b"b"),
            vec![BatchOp::Put(b"meta".to_vec(), b"b".to_vec())],
        );
        let raw = encode_journal(&steps, &last);
        let (s2, l2) = decode_journal(&raw).unwrap();
        assert_eq!((s2.len(), l2.len()), (300, 1));
        assert!(decode_journal(&raw[..raw.len() - 1]).is_none());
        // The writer dies right after its commit point.
        s.put(journal, &raw).await.unwrap();
        assert_eq!(s.get_unless(b"j/k000", journal).await.unwrap(), None);
        assert_eq!(
            s.scan_unless(&[b"j/".to_vec()], 1000, journal)
                .await
                .unwrap(),
            None
        );
        assert_eq!(
            s.write_unless(b"j/k000", Some(b"x"), journal)
                .await
                .unwrap(),
            None
        );
        assert!(s.roll_forward(journal, Ok).await.unwrap());
        assert!(!s.roll_forward(journal, Ok).await.unwrap());
        assert_eq!(
            s.get_unless(b"j/k299", journal).await.unwrap(),
            Some(Some(b"b".to_vec()))
        );
        assert_eq!(s.get(b"meta").await.unwrap(), Some(b"b".to_vec()));

        // A reader loop while changes alternate between all-c and all-d.
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (s, stop) = (s.clone(), stop.clone());
            tokio::spawn(async move {
                let mut seen = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let Some(mut parts) = s
                        .scan_unless(&[b"j/".to_vec(), b"meta".to_vec()], 1000, b"_import/j")
                        .await
                        .unwrap()
                    else {
                        continue;
                    };
                    let meta = parts.pop().unwrap();
                    let rows = parts.pop().unwrap();
                    assert_eq!(rows.len(), 300);
                    let first = rows[0].1.clone();
                    assert!(rows.iter().all(|(_, v)| *v == first), "a mix");
                    assert_eq!(meta[0].1, first, "the last part with its steps");
                    seen += 1;
                }
                seen
            })
        };
        for round in 0..6 {
            let v: &[u8] = if round % 2 == 0 { b"c" } else { b"d" };
            s.apply_journaled(
                journal,
                all(v),
                vec![BatchOp::Put(b"meta".to_vec(), v.to_vec())],
                std::convert::identity,
                Ok,
            )
            .await
            .unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(reader.await.unwrap() > 0);
        assert_eq!(s.get(b"j/k150").await.unwrap(), Some(b"d".to_vec()));

        // A last part of 200 writes cannot be one transaction: refused, nothing written.
        let e = s
            .apply_journaled(journal, all(b"e"), all(b"e"), std::convert::identity, Ok)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("--max-txn-ops"), "{e}");
        assert_eq!(s.get(b"j/k150").await.unwrap(), Some(b"d".to_vec()));
        assert_eq!(s.get(journal).await.unwrap(), None);
    }
}
