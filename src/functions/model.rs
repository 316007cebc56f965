//! What is stored for a function, under which keys, and the checks on what a
//! deployer sends.

use crate::error::Code;
use std::collections::BTreeMap;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::error::{FnError, FnResult};

/// Versions kept per function; deploying the eleventh drops the oldest.
pub const MAX_VERSIONS: usize = 10;
/// Memory limit range, in MiB.
pub const MEMORY_MB_RANGE: (u32, u32) = (1, 256);
/// Default memory limit, in MiB.
pub const DEFAULT_MEMORY_MB: u32 = 64;
/// Timeout range, in seconds.
pub const TIMEOUT_RANGE: (u32, u32) = (1, 60);
/// Default timeout, in seconds.
pub const DEFAULT_TIMEOUT_SECONDS: u32 = 10;
/// Most environment variables per function.
pub const MAX_ENV_VARS: usize = 64;
/// Most pub/sub patterns per function.
pub const MAX_TOPICS: usize = 16;
/// Most cron expressions per function.
pub const MAX_CRONS: usize = 8;
/// Longest env var value or secret, in bytes.
pub const MAX_VALUE_BYTES: usize = 16 * 1024;

/// The function record, `fn/<ns>/<name>`: what is current.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FunctionRecord {
    /// The function's name, unique in its namespace (see [`valid_function_name`]).
    pub name: String,
    /// The version invoked when a call names none: the newest deploy.
    pub current_version: u64,
    /// Whether `/fn/<ns>/<name>` may be called without a credential of the namespace.
    pub is_public: bool,
    /// Versions kept, oldest first (at most [`MAX_VERSIONS`]).
    pub versions: Vec<u64>,
    /// Unix seconds of the first deploy; kept across later deploys.
    pub created_at: u64,
    /// Unix seconds of the last change to this record.
    pub updated_at: u64,
}

/// One version, `fnver/<ns>/<name>/<version>`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VersionMeta {
    /// Counts up from 1 per function: one more than any version the record knows.
    pub version: u64,
    /// SHA-256 of the module: its bytes are `blob/<sha256>`.
    pub sha256: String,
    /// Size of the module, in bytes.
    pub size_bytes: usize,
    /// The guest's memory limit, in MiB, within [`MEMORY_MB_RANGE`].
    pub memory_limit_mb: u32,
    /// Wall-clock limit of one invocation, in seconds, within [`TIMEOUT_RANGE`].
    pub timeout_seconds: u32,
    /// Environment the guest sees (at most `MAX_ENV_VARS`, 64).
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    /// Topic patterns whose publishes invoke this version (glob, see [`topic_matches`]).
    #[serde(default)]
    pub pubsub_topics: Vec<String>,
    /// Cron expressions (UTC, see [`parse_cron`]) that invoke this version.
    #[serde(default)]
    pub cron: Vec<String>,
    /// Unix seconds of the deploy that made this version.
    pub created_at: u64,
}

/// Checked metadata: env vars, pub/sub patterns, cron expressions.
pub type ValidMetadata = (BTreeMap<String, String>, Vec<String>, Vec<String>);

/// The `metadata` part of a deploy.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct FunctionMetadata {
    /// Becomes [`VersionMeta::env_vars`]; names `[A-Za-z_][A-Za-z0-9_]*`.
    pub env_vars: BTreeMap<String, String>,
    /// Becomes [`VersionMeta::pubsub_topics`]; each 1 to 256 bytes.
    pub pubsub_topics: Vec<String>,
    /// Becomes [`VersionMeta::cron`]; a string or a list is accepted.
    pub cron: CronList,
}

/// One cron expression or a list of them.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum CronList {
    /// The field was absent: no cron trigger.
    #[default]
    None,
    /// `"cron": "<expr>"`.
    One(String),
    /// `"cron": ["<expr>", ...]`.
    Many(Vec<String>),
}

impl CronList {
    /// The expressions, in order.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            CronList::None => Vec::new(),
            CronList::One(s) => vec![s],
            CronList::Many(v) => v,
        }
    }
}

impl FunctionMetadata {
    /// Checks every field; the first problem is reported.
    pub fn validate(self) -> FnResult<ValidMetadata> {
        if self.env_vars.len() > MAX_ENV_VARS {
            return Err(FnError::bad(
                Code::InvalidMetadata,
                format!("at most {MAX_ENV_VARS} env_vars"),
            ));
        }
        for (k, v) in &self.env_vars {
            if !valid_env_name(k) {
                return Err(FnError::bad(
                    Code::InvalidMetadata,
                    format!("env var name {k:?} must be [A-Za-z_][A-Za-z0-9_]*"),
                ));
            }
            if v.len() > MAX_VALUE_BYTES {
                return Err(FnError::bad(
                    Code::InvalidMetadata,
                    format!("env var {k} is longer than {MAX_VALUE_BYTES} bytes"),
                ));
            }
        }
        if self.pubsub_topics.len() > MAX_TOPICS {
            return Err(FnError::bad(
                Code::InvalidMetadata,
                format!("at most {MAX_TOPICS} pubsub_topics"),
            ));
        }
        for t in &self.pubsub_topics {
            if t.is_empty() || t.len() > 256 {
                return Err(FnError::bad(
                    Code::InvalidMetadata,
                    "a pubsub_topics pattern is 1 to 256 bytes",
                ));
            }
        }
        let cron = self.cron.into_vec();
        if cron.len() > MAX_CRONS {
            return Err(FnError::bad(
                Code::InvalidMetadata,
                format!("at most {MAX_CRONS} cron expressions"),
            ));
        }
        for c in &cron {
            parse_cron(c)?;
        }
        Ok((self.env_vars, self.pubsub_topics, cron))
    }
}

/// One invocation record, `log/<ns>/<name>/<time>`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct InvocationRecord {
    /// The request id of the call (also part of the record's key).
    pub request_id: String,
    /// The function's name.
    pub function: String,
    /// The version that ran.
    pub version: u64,
    /// `http`, `public`, `ws`, `pubsub`, `cron`.
    pub trigger: String,
    /// `ok` or the error code.
    pub status: String,
    /// The error's message when the invocation failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Time the guest ran, in milliseconds; 0 when it failed.
    pub duration_ms: u64,
    /// Unix milliseconds when the call finished (the key's time).
    pub timestamp_ms: u64,
    /// What the guest logged, in order; empty when it failed.
    pub logs: Vec<LogEntry>,
    /// The call's W3C trace id (hex): the request's, or a new trace's for
    /// a trigger. Absent in records written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

/// One guest log line in a record.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LogEntry {
    /// `debug`, `info`, `warn` or `error` from the `log` import; stderr lines are `info`.
    pub level: String,
    /// The line, cut to the host's per-line limit, invalid UTF-8 replaced.
    pub message: String,
}

/// Function names: 1–63 of `a-z`, `0-9`, `-`, `_`, starting with a letter or digit.
pub fn valid_function_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && name.as_bytes()[0].is_ascii_alphanumeric()
}

/// Secret names are environment variable names.
pub fn valid_secret_name(name: &str) -> bool {
    valid_env_name(name)
}

fn valid_env_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !name.as_bytes()[0].is_ascii_digit()
}

/// Parses a cron expression of 5 fields (minute precision) or 6 (with
/// seconds), UTC. The `cron` crate wants seconds first, so a 5-field
/// expression gets a `0 ` prefix.
pub fn parse_cron(expr: &str) -> FnResult<cron::Schedule> {
    let fields = expr.split_whitespace().count();
    let full = match fields {
        5 => format!("0 {expr}"),
        6 => expr.to_string(),
        _ => {
            return Err(FnError::bad(
                Code::InvalidCron,
                format!("cron {expr:?}: expected 5 or 6 fields, got {fields}"),
            ));
        }
    };
    cron::Schedule::from_str(&full)
        .map_err(|e| FnError::bad(Code::InvalidCron, format!("cron {expr:?}: {e}")))
}

/// Glob match of a topic against a trigger pattern: `*` any run of
/// characters (including none), `?` one character, everything else literal.
pub fn topic_matches(pattern: &str, topic: &str) -> bool {
    crate::auth::glob_match(pattern, topic)
}

/// The prefix of every namespace's function records.
pub const FN_RECORDS: &[u8] = b"fn/";

/// `fn/<ns>/<name>`.
pub fn fn_key(ns: &str, name: &str) -> Vec<u8> {
    format!("fn/{ns}/{name}").into_bytes()
}

/// `fn/<ns>/`.
pub fn fn_prefix(ns: &str) -> Vec<u8> {
    format!("fn/{ns}/").into_bytes()
}

/// `fnver/<ns>/<name>/<version>` (zero-padded so versions sort).
pub fn ver_key(ns: &str, name: &str, version: u64) -> Vec<u8> {
    format!("fnver/{ns}/{name}/{version:010}").into_bytes()
}

pub use crate::storage::blob_key;

/// `secret/<ns>/<key>`.
pub fn secret_key(ns: &str, key: &str) -> Vec<u8> {
    format!("secret/{ns}/{key}").into_bytes()
}

/// `secret/<ns>/`.
pub fn secret_prefix(ns: &str) -> Vec<u8> {
    format!("secret/{ns}/").into_bytes()
}

/// `log/<ns>/<name>/`.
pub fn log_prefix(ns: &str, name: &str) -> Vec<u8> {
    log_prefix_with(ns, name, 0)
}

/// [`log_prefix`] with room for `more` bytes after it.
fn log_prefix_with(ns: &str, name: &str, more: usize) -> Vec<u8> {
    let mut k = Vec::with_capacity(6 + ns.len() + name.len() + more);
    k.extend_from_slice(b"log/");
    k.extend_from_slice(ns.as_bytes());
    k.push(b'/');
    k.extend_from_slice(name.as_bytes());
    k.push(b'/');
    k
}

/// `log/<ns>/<name>/<time>-<request id>`, the time in milliseconds written
/// with at least 16 digits (zero-padded), so keys sort by time. Written into
/// one buffer sized up front: every invocation writes one.
pub fn log_key(ns: &str, name: &str, timestamp_ms: u64, request_id: &str) -> Vec<u8> {
    let mut k = log_prefix_with(ns, name, 21 + request_id.len());
    push_log_suffix(&mut k, timestamp_ms, request_id);
    k
}

/// [`log_key`] of a function whose [`log_prefix`] is `prefix`.
pub fn log_key_under(prefix: &[u8], timestamp_ms: u64, request_id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(prefix.len() + 21 + request_id.len());
    k.extend_from_slice(prefix);
    push_log_suffix(&mut k, timestamp_ms, request_id);
    k
}

/// `<time>-<request id>`, the time zero-padded to at least 16 digits.
fn push_log_suffix(k: &mut Vec<u8>, timestamp_ms: u64, request_id: &str) {
    use std::io::Write;
    write!(k, "{timestamp_ms:016}-").expect("writing to a Vec cannot fail");
    k.extend_from_slice(request_id.as_bytes());
}

/// `log/<ns>/~cron/<name>/<slot>`: the claim of one cron slot (a name never starts with `~`).
pub fn cron_claim_key(ns: &str, name: &str, slot: i64) -> Vec<u8> {
    format!("log/{ns}/~cron/{name}/{slot}").into_bytes()
}

/// `kv/<ns>/`: the namespace KV, the same keys `/v1/kv` uses.
pub fn kv_prefix(ns: &str) -> Vec<u8> {
    format!("kv/{ns}/").into_bytes()
}

/// `fnver/<ns>/`: every version of every function of the namespace.
pub fn fnver_prefix(ns: &str) -> Vec<u8> {
    format!("fnver/{ns}/").into_bytes()
}

/// A function in a namespace export: its record and every version it keeps
/// (the modules travel in the export's blobs, by SHA-256).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ExportedFunction {
    /// The function record as stored; its `versions` must match those carried.
    pub record: FunctionRecord,
    /// Every version the record lists, in the same order.
    pub versions: Vec<VersionMeta>,
}

impl ExportedFunction {
    /// Checks what an import would store: the name, the versions the record
    /// lists against the ones carried, the limits of each version.
    pub fn validate(&self) -> Result<(), String> {
        let name = &self.record.name;
        if !valid_function_name(name) {
            return Err(format!("function name {name:?} is not valid"));
        }
        if self.versions.is_empty() || self.versions.len() > MAX_VERSIONS {
            return Err(format!(
                "function {name}: 1 to {MAX_VERSIONS} versions, got {}",
                self.versions.len()
            ));
        }
        let carried: Vec<u64> = self.versions.iter().map(|v| v.version).collect();
        if carried != self.record.versions {
            return Err(format!(
                "function {name}: the record lists versions {:?}, the export carries {carried:?}",
                self.record.versions
            ));
        }
        if !carried.contains(&self.record.current_version) {
            return Err(format!(
                "function {name}: current version {} is not carried",
                self.record.current_version
            ));
        }
        for v in &self.versions {
            if v.sha256.len() != 64 || !v.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!(
                    "function {name} version {}: sha256 is not 64 hex digits",
                    v.version
                ));
            }
            if !(MEMORY_MB_RANGE.0..=MEMORY_MB_RANGE.1).contains(&v.memory_limit_mb)
                || !(TIMEOUT_RANGE.0..=TIMEOUT_RANGE.1).contains(&v.timeout_seconds)
            {
                return Err(format!(
                    "function {name} version {}: memory or timeout out of range",
                    v.version
                ));
            }
            FunctionMetadata {
                env_vars: v.env_vars.clone(),
                pubsub_topics: v.pubsub_topics.clone(),
                cron: CronList::Many(v.cron.clone()),
            }
            .validate()
            .map_err(|e| format!("function {name} version {}: {e}", v.version))?;
        }
        Ok(())
    }

    /// The records an import writes into `ns`: the function record and each version.
    pub fn records(&self, ns: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
        let name = &self.record.name;
        let mut out = vec![(
            fn_key(ns, name),
            serde_json::to_vec(&self.record).expect("json"),
        )];
        for v in &self.versions {
            out.push((
                ver_key(ns, name, v.version),
                serde_json::to_vec(v).expect("json"),
            ));
        }
        out
    }
}

#[cfg(test)]
mod key_tests {
    use super::*;

    /// The hand-built keys are the ones `format!` wrote before (stored log
    /// keys must not change), at the edges of the 16-digit padding.
    #[test]
    fn log_keys_match_their_formatted_shape() {
        for t in [
            0,
            7,
            1_764_000_000_000,
            9_999_999_999_999_999,
            10_000_000_000_000_000,
            u64::MAX,
        ] {
            assert_eq!(
                log_key("ns-a", "echo", t, "rid42"),
                format!("log/ns-a/echo/{t:016}-rid42").into_bytes(),
                "{t}"
            );
        }
        assert_eq!(log_prefix("ns-a", "echo"), b"log/ns-a/echo/".to_vec());
        assert_eq!(
            log_key_under(&log_prefix("ns-a", "echo"), 7, "rid42"),
            log_key("ns-a", "echo", 7, "rid42")
        );
        assert!(log_key("n", "f", 0, "r").starts_with(&log_prefix("n", "f")));
    }
}
