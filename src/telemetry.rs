//! OTLP export of spans (`[telemetry] otlp_endpoint`), layer 0.
//!
//! Off by default, and then free: nothing is installed, [`ServerSpan::begin`]
//! answers `None` after one load and no span is ever built. On, every request
//! the node serves through its logger step (the chain's `front.rs` and the
//! routed fast path) gets a SERVER span: its trace id is the request's
//! ([`crate::observe::trace`]), its span id the node's span id for the
//! request (the parent id the node already sends to the next hop: an
//! upstream, a member of the cluster, a function's guest), its parent the
//! incoming `traceparent`'s parent id (remote) when one came in. Each upstream
//! attempt of a proxied request is a CLIENT span, child of the SERVER span,
//! and the `traceparent` sent to that instance carries the CLIENT span's id
//! (`deploy::activity`), so the upstream's own span hangs under it.
//!
//! Sampling: a continued trace follows its `sampled` flag (parent based); a
//! trace the node starts is sampled with `[telemetry] sample_ratio` (by its
//! trace id), and then sent on with the flag set.
//!
//! Finished spans go to the SDK's batch processor: a bounded queue
//! (`max_queue_size`, full: the span is dropped) drained by its own thread
//! every `scheduled_delay_ms` or at 512 spans; the request path only pushes.
//! Exports post OTLP/HTTP protobuf to `<otlp_endpoint>/v1/traces` through
//! awc on that thread; a failure is logged at most once a minute (with the
//! count since) and never reaches a request. [`shutdown`] flushes.
//!
//! Attributes are declared or bounded values only (OTel semantic
//! conventions): the method, the path without its query, the status, the
//! matched route's `path_prefix` (or the chain's route pattern), the
//! upstream's host and port, the namespace, deployment or function, the
//! request id. Never a query string, a header value or a credential.

use crate::observe::trace::TraceContext;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue, Value};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SpanData, SpanEvents, SpanExporter, SpanLinks,
    SpanProcessor,
};
use std::borrow::Cow;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

/// Default of `[telemetry] service_name`.
pub const DEFAULT_SERVICE_NAME: &str = "meshgate";
/// Default of `[telemetry] scheduled_delay_ms` (the OTel default).
pub const DEFAULT_SCHEDULED_DELAY_MS: u64 = 5000;
/// Default of `[telemetry] max_queue_size` (the OTel default).
pub const DEFAULT_MAX_QUEUE_SIZE: usize = 2048;
/// Largest `[telemetry] max_queue_size`.
pub const MAX_QUEUE_SIZE: usize = 65_536;
/// Spans in one export at most.
const MAX_BATCH: usize = 512;
/// One export's deadline (retries included).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// At most one log line about failed exports per this long.
const FAILURE_LOG_EVERY: Duration = Duration::from_secs(60);

/// What `[telemetry]` asks for (`crate::config::TelemetryConfig`, checked).
pub struct Settings<'a> {
    /// The collector's base URL (`http(s)://host:port[/path]`); empty: off.
    pub otlp_endpoint: &'a str,
    /// The resource's `service.name`.
    pub service_name: &'a str,
    /// The share of traces the node starts that are sampled, 0 to 1.
    pub sample_ratio: f64,
    /// Milliseconds between two exports.
    pub scheduled_delay_ms: u64,
    /// Finished spans waiting for export, at most.
    pub max_queue_size: usize,
}

/// The installed exporter.
struct Exporting {
    processor: BatchSpanProcessor,
    scope: InstrumentationScope,
    sample_ratio: f64,
}

static EXPORT: OnceLock<Exporting> = OnceLock::new();

/// The traces URL of an `otlp_endpoint`: an `http://` or `https://` URL with
/// a host, no user info, query or fragment; `/v1/traces` is appended to its
/// path (as to `OTEL_EXPORTER_OTLP_ENDPOINT`).
pub fn traces_url(endpoint: &str) -> Result<String, String> {
    let uri: actix_web::http::Uri = endpoint
        .parse()
        .map_err(|e| format!("{endpoint:?} is not a URL: {e}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(format!(
            "{endpoint:?} is not an http:// or https:// URL (the OTLP/HTTP collector, e.g. \"http://127.0.0.1:4318\")"
        ));
    }
    let Some(auth) = uri.authority() else {
        return Err(format!("{endpoint:?} has no host"));
    };
    if auth.as_str().contains('@') {
        // Not echoed: it may be a credential.
        return Err("the URL carries user info; put no credential in it".into());
    }
    if auth.host().is_empty() {
        return Err(format!("{endpoint:?} has no host"));
    }
    if uri.query().is_some() || endpoint.contains('#') {
        return Err(format!("{endpoint:?} has a query or fragment"));
    }
    let base = endpoint.trim_end_matches('/');
    Ok(format!("{base}/v1/traces"))
}

/// Installs the exporter when `otlp_endpoint` is set (once per process;
/// a second call is ignored). `Ok(true)`: exporting.
pub fn install(s: &Settings) -> Result<bool, String> {
    use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
    if s.otlp_endpoint.is_empty() {
        return Ok(false);
    }
    if EXPORT.get().is_some() {
        return Ok(true);
    }
    let url = traces_url(s.otlp_endpoint).map_err(|e| format!("telemetry.otlp_endpoint: {e}"))?;
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        .with_timeout(EXPORT_TIMEOUT)
        .with_http_client(AwcClient {
            timeout: EXPORT_TIMEOUT,
        })
        .build()
        .map_err(|e| format!("the OTLP exporter: {e}"))?;
    let resource = opentelemetry_sdk::Resource::builder_empty()
        .with_service_name(s.service_name.to_string())
        .build();
    exporter.set_resource(&resource);
    let exporter = Logged {
        inner: exporter,
        failures: Mutex::new(Failures::default()),
    };
    let queue = s.max_queue_size.max(1);
    let config = BatchConfigBuilder::default()
        .with_max_queue_size(queue)
        .with_max_export_batch_size(queue.min(MAX_BATCH))
        .with_scheduled_delay(Duration::from_millis(s.scheduled_delay_ms.max(1)))
        .build();
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(config)
        .build();
    let scope = InstrumentationScope::builder("meshgate")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let _ = EXPORT.set(Exporting {
        processor,
        scope,
        sample_ratio: s.sample_ratio.clamp(0.0, 1.0),
    });
    Ok(true)
}

/// Whether spans are exported.
pub fn enabled() -> bool {
    EXPORT.get().is_some()
}

/// Exports what is queued and stops the exporter's thread (at drain).
/// Blocks until then (up to the export timeout): call it off the runtime.
pub fn shutdown() {
    if let Some(e) = EXPORT.get()
        && let Err(err) = e.processor.shutdown()
    {
        tracing::warn!(error = %err, "Telemetry: the last spans could not be exported.");
    }
}

/// Whether a trace the node starts is sampled: its trace id's low 8 bytes
/// below the ratio (the W3C "random" part).
fn sample_fresh(trace_id: &[u8; 16], ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    let mut low = [0u8; 8];
    low.copy_from_slice(&trace_id[8..]);
    (u64::from_be_bytes(low) as f64) < ratio * (u64::MAX as f64)
}

/// One request's SERVER span while it is served (in the request's
/// extensions; cloning shares it). Ended by [`ServerSpan::finish`], or when
/// the last clone is dropped (a request abandoned mid-way), then queued.
#[derive(Clone)]
pub struct ServerSpan(Rc<RefCell<Open>>);

/// A span's data until it ends.
struct Open {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    parent: Option<[u8; 8]>,
    flags: u8,
    tracestate: Option<String>,
    start: SystemTime,
    method: String,
    route: Option<String>,
    attributes: Vec<KeyValue>,
    status: Option<u16>,
    clients: Vec<Client>,
    done: bool,
}

/// One upstream attempt (a CLIENT span).
struct Client {
    span_id: [u8; 8],
    start: SystemTime,
    end: Option<SystemTime>,
    host: String,
    port: Option<u16>,
    outcome: &'static str,
    status: Option<u16>,
}

impl ServerSpan {
    /// The SERVER span of a request, when spans are exported and its trace
    /// is sampled. A trace the node starts (no valid `traceparent` came in)
    /// is sampled here, and its flag set on `trace` for the next hops.
    pub fn begin(
        trace: &mut TraceContext,
        method: &str,
        path: &str,
        request_id: &str,
    ) -> Option<ServerSpan> {
        let e = EXPORT.get()?;
        if trace.parent_id.is_none() && sample_fresh(&trace.trace_id, e.sample_ratio) {
            trace.flags |= 1;
        }
        if trace.flags & 1 == 0 {
            return None;
        }
        let attributes = vec![
            KeyValue::new("http.request.method", method.to_string()),
            KeyValue::new("url.path", path.to_string()),
            KeyValue::new("meshgate.request_id", request_id.to_string()),
        ];
        Some(ServerSpan(Rc::new(RefCell::new(Open {
            trace_id: trace.trace_id,
            span_id: trace.span_id,
            parent: trace.parent_id,
            flags: trace.flags,
            tracestate: trace.tracestate.clone(),
            start: SystemTime::now(),
            method: method.to_string(),
            route: None,
            attributes,
            status: None,
            clients: Vec::new(),
            done: false,
        }))))
    }

    /// The request's span, when it has one.
    pub fn of(ext: &actix_web::dev::Extensions) -> Option<ServerSpan> {
        ext.get::<ServerSpan>().cloned()
    }

    /// `http.route`: the matched route (a deployment route's `path_prefix`,
    /// a node route's pattern), never the request's path. The first set stays.
    pub fn route(&self, route: &str) {
        let mut o = self.0.borrow_mut();
        if o.route.is_none() {
            o.route = Some(route.to_string());
        }
    }

    /// An attribute (a declared value: namespace, deployment, function).
    pub fn attribute(&self, key: &'static str, value: impl Into<Value>) {
        self.0
            .borrow_mut()
            .attributes
            .push(KeyValue::new(key, value));
    }

    /// Opens a CLIENT span for an attempt to the instance at `base` (its
    /// URL as deployed); its id is the parent id the attempt sends.
    pub fn client_begins(&self, base: &str) -> [u8; 8] {
        let span_id = crate::observe::trace::TraceContext::fresh().span_id;
        let (host, port) = host_port(base);
        self.0.borrow_mut().clients.push(Client {
            span_id,
            start: SystemTime::now(),
            end: None,
            host,
            port,
            outcome: "",
            status: None,
        });
        span_id
    }

    /// Ends the open CLIENT span with the attempt's outcome.
    pub fn client_ends(&self, outcome: &'static str) {
        let mut o = self.0.borrow_mut();
        if let Some(c) = o.clients.last_mut()
            && c.end.is_none()
        {
            c.end = Some(SystemTime::now());
            c.outcome = outcome;
        }
    }

    /// The status the answering instance gave (the last attempt that answered).
    pub fn upstream_status(&self, status: u16) {
        let mut o = self.0.borrow_mut();
        if let Some(c) = o.clients.last_mut()
            && c.outcome == "answered"
        {
            c.status = Some(status);
        }
    }

    /// Ends the span with the status answered and queues it (with its
    /// CLIENT spans). `route`: the matched route when none was set.
    pub fn finish(&self, status: u16, route: Option<&str>) {
        let mut o = self.0.borrow_mut();
        if o.route.is_none() {
            o.route = route.map(str::to_string);
        }
        o.status = Some(status);
        o.end();
    }
}

impl Open {
    /// Queues the span and its children, once.
    fn end(&mut self) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let Some(e) = EXPORT.get() else { return };
        let now = SystemTime::now();
        let trace_id = TraceId::from_bytes(self.trace_id);
        let state = self
            .tracestate
            .as_deref()
            .and_then(|s| s.parse::<TraceState>().ok())
            .unwrap_or_default();
        let flags = TraceFlags::new(self.flags);
        let context = |id: [u8; 8]| {
            SpanContext::new(
                trace_id,
                SpanId::from_bytes(id),
                flags,
                false,
                state.clone(),
            )
        };
        let mut attributes = std::mem::take(&mut self.attributes);
        let name = match &self.route {
            Some(r) => {
                attributes.push(KeyValue::new("http.route", r.clone()));
                format!("{} {r}", self.method)
            }
            None => self.method.clone(),
        };
        let status = match self.status {
            Some(s) => {
                attributes.push(KeyValue::new("http.response.status_code", s as i64));
                if s >= 500 {
                    attributes.push(KeyValue::new("error.type", s.to_string()));
                    Status::error("")
                } else {
                    Status::Unset
                }
            }
            None => {
                attributes.push(KeyValue::new("error.type", "abandoned"));
                Status::error("the request ended before its answer")
            }
        };
        let server_id = SpanId::from_bytes(self.span_id);
        for c in self.clients.drain(..) {
            let mut attrs = vec![
                KeyValue::new("http.request.method", self.method.clone()),
                KeyValue::new("server.address", c.host),
            ];
            if let Some(p) = c.port {
                attrs.push(KeyValue::new("server.port", p as i64));
            }
            let failed = match c.status {
                Some(s) => {
                    attrs.push(KeyValue::new("http.response.status_code", s as i64));
                    s >= 500
                }
                None => c.outcome != "answered",
            };
            if failed {
                let kind = if c.outcome == "answered" || c.outcome.is_empty() {
                    c.status
                        .map(|s| s.to_string())
                        .unwrap_or_else(|| "_OTHER".into())
                } else {
                    c.outcome.to_string()
                };
                attrs.push(KeyValue::new("error.type", kind));
            }
            e.processor.on_end(SpanData {
                span_context: context(c.span_id),
                parent_span_id: server_id,
                parent_span_is_remote: false,
                span_kind: SpanKind::Client,
                name: Cow::Owned(self.method.clone()),
                start_time: c.start,
                end_time: c.end.unwrap_or(now),
                attributes: attrs,
                dropped_attributes_count: 0,
                events: SpanEvents::default(),
                links: SpanLinks::default(),
                status: if failed {
                    Status::error("")
                } else {
                    Status::Unset
                },
                instrumentation_scope: e.scope.clone(),
            });
        }
        e.processor.on_end(SpanData {
            span_context: context(self.span_id),
            parent_span_id: self
                .parent
                .map(SpanId::from_bytes)
                .unwrap_or(SpanId::INVALID),
            parent_span_is_remote: self.parent.is_some(),
            span_kind: SpanKind::Server,
            name: Cow::Owned(name),
            start_time: self.start,
            end_time: now,
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status,
            instrumentation_scope: e.scope.clone(),
        });
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.end();
    }
}

/// The host and port of an instance's base URL (`http://h:p`), never its
/// path or user info.
fn host_port(base: &str) -> (String, Option<u16>) {
    match base.parse::<actix_web::http::Uri>() {
        Ok(u) => (
            u.host().unwrap_or_default().to_string(),
            u.port_u16().or(match u.scheme_str() {
                Some("https") => Some(443),
                Some("http") => Some(80),
                _ => None,
            }),
        ),
        Err(_) => (String::new(), None),
    }
}

/// Failed exports since the last line about them.
#[derive(Default)]
struct Failures {
    last_logged: Option<Instant>,
    batches: u64,
    spans: u64,
}

/// The OTLP exporter, its failures logged at most once a minute.
#[derive(Debug)]
struct Logged<E> {
    inner: E,
    failures: Mutex<Failures>,
}

impl std::fmt::Debug for Failures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Failures")
            .field("batches", &self.batches)
            .finish()
    }
}

impl<E: SpanExporter> Logged<E> {
    fn failed(&self, spans: usize, error: &dyn std::fmt::Display) {
        let Ok(mut f) = self.failures.lock() else {
            return;
        };
        f.batches += 1;
        f.spans += spans as u64;
        let now = crate::util::mono_now();
        if f.last_logged
            .is_some_and(|t| now.duration_since(t) < FAILURE_LOG_EVERY)
        {
            return;
        }
        tracing::warn!(
            error = %error,
            failed_batches = f.batches,
            lost_spans = f.spans,
            "Telemetry: spans could not be exported (logged at most once a minute)."
        );
        f.last_logged = Some(now);
        f.batches = 0;
        f.spans = 0;
    }
}

impl<E: SpanExporter> SpanExporter for Logged<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        let r = self.inner.export(batch).await;
        if let Err(e) = &r {
            self.failed(n, e);
        }
        r
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The exporter's HTTP client: awc (already the node's, with its rustls and
/// web PKI roots), driven by a runtime of the batch processor's own thread.
#[derive(Debug)]
struct AwcClient {
    timeout: Duration,
}

thread_local! {
    /// The export thread's runtime and client, made at its first export.
    static AWC: RefCell<Option<(actix_rt::Runtime, awc::Client)>> = const { RefCell::new(None) };
}

type HttpResult = Result<opentelemetry_http::Response<bytes::Bytes>, opentelemetry_http::HttpError>;

impl AwcClient {
    /// Posts `request` and reads the answer, blocking this (the export) thread.
    fn post(&self, request: opentelemetry_http::Request<bytes::Bytes>) -> HttpResult {
        AWC.with_borrow_mut(|slot| {
            if slot.is_none() {
                let rt = actix_rt::Runtime::new()?;
                let timeout = self.timeout;
                let client = rt.block_on(async move {
                    awc::Client::builder()
                        .timeout(timeout)
                        .disable_redirects()
                        .finish()
                });
                *slot = Some((rt, client));
            }
            let Some((rt, client)) = slot.as_ref() else {
                return Err("no runtime".into());
            };
            let (parts, body) = request.into_parts();
            rt.block_on(async {
                let mut req = client.request(
                    awc::http::Method::from_bytes(parts.method.as_str().as_bytes())?,
                    parts.uri.to_string(),
                );
                for (k, v) in &parts.headers {
                    req = req.insert_header((k.as_str(), v.as_bytes()));
                }
                let mut resp = req.send_body(body).await.map_err(|e| e.to_string())?;
                let status = resp.status().as_u16();
                let body = resp
                    .body()
                    .limit(1 << 20)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(opentelemetry_http::Response::builder()
                    .status(status)
                    .body(body)?)
            })
        })
    }
}

impl opentelemetry_http::HttpClient for AwcClient {
    fn send_bytes<'a, 'b>(
        &'a self,
        request: opentelemetry_http::Request<bytes::Bytes>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = HttpResult> + Send + 'b>>
    where
        'a: 'b,
        Self: 'b,
    {
        // Called on the batch processor's thread (outside any runtime): the
        // exchange runs to its end on the thread's own runtime.
        let r = self.post(request);
        Box::pin(std::future::ready(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn telemetry_endpoints_are_http_urls() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318").as_deref(),
            Ok("http://127.0.0.1:4318/v1/traces")
        );
        assert_eq!(
            traces_url("https://otel.example/base/").as_deref(),
            Ok("https://otel.example/base/v1/traces")
        );
        for bad in [
            "127.0.0.1:4318",
            "grpc://x:4317",
            "ftp://x",
            "http://",
            "http://user:pw@x:4318",
            "http://x:4318/?k=v",
            "not a url",
        ] {
            assert!(traces_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn telemetry_ratio_samples_by_trace_id() {
        let mut id = [0u8; 16];
        assert!(sample_fresh(&id, 1.0));
        id[8..].copy_from_slice(&[0xff; 8]);
        assert!(!sample_fresh(&id, 0.5));
        assert!(!sample_fresh(&id, 0.0));
        id[8..].copy_from_slice(&[0x10, 0, 0, 0, 0, 0, 0, 0]);
        assert!(sample_fresh(&id, 0.5));
    }

    #[test]
    fn telemetry_off_builds_no_span() {
        let mut t = TraceContext::fresh();
        if !enabled() {
            assert!(ServerSpan::begin(&mut t, "GET", "/", "r").is_none());
            assert_eq!(t.flags, 0);
        }
    }

    #[test]
    fn telemetry_instances_give_host_and_port() {
        assert_eq!(
            host_port("http://10.0.0.1:8080"),
            ("10.0.0.1".into(), Some(8080))
        );
        assert_eq!(
            host_port("https://up.example"),
            ("up.example".into(), Some(443))
        );
    }
}
