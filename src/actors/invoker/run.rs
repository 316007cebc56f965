//! Resolving a call (record, version, module, secrets; kept until a change)
//! and running it on the pool.

use super::host::NsHost;
use super::*;
use std::sync::atomic::Ordering;

impl Invoker {
    /// The store's count of function-record writes, when resolutions are
    /// kept: on the node's own sled store, where every write to a function,
    /// its versions or the namespace's secrets goes through this invoker
    /// (which forgets what it kept) or changes the function record (checked
    /// when that count moved). On etcd another node may change secrets
    /// unseen, so every call resolves afresh there.
    fn fn_writes(&self) -> Option<&AtomicU64> {
        self.st.fn_writes.as_deref()
    }

    /// A kept resolution of `name`, if the stored function record is still
    /// byte for byte the one it was resolved from. While no function record
    /// was written since it was last read, that is known without a read: one
    /// atomic load (a store read per call took sled's lock, which its
    /// writers hold; BENCHMARKS.md). After such a write, one local sled read
    /// compares the record (no blocking thread) and stamps the resolution
    /// anew when it is unchanged.
    pub(super) async fn cached(
        &self,
        name: &str,
        version: Option<u64>,
    ) -> FnResult<Option<Arc<Resolved>>> {
        let Some(writes) = self.fn_writes() else {
            return Ok(None);
        };
        let key = (name.to_string(), version);
        let kept = {
            let c = self.st.resolved.load();
            if c.generation != self.st.snapshot.load().generation {
                return Ok(None);
            }
            match c.map.get(&key) {
                Some(k) => k.clone(),
                None => return Ok(None),
            }
        };
        let count = writes.load(Ordering::Acquire);
        if count == kept.stamp.load(Ordering::Acquire) {
            return Ok(Some(kept.r.clone()));
        }
        let now = self.store().get(&fn_key(&self.ns, name)).await?;
        if now.as_deref() == Some(&kept.r.record_bytes[..]) {
            kept.stamp.fetch_max(count, Ordering::AcqRel);
            return Ok(Some(kept.r.clone()));
        }
        self.forget_resolutions();
        Ok(None)
    }

    /// The generation of the snapshot and the count of function-record
    /// writes before a resolution reads the record (0 where none is kept).
    pub(super) fn stamp_now(&self) -> (u64, u64) {
        (
            self.st.snapshot.load().generation,
            self.fn_writes().map_or(0, |w| w.load(Ordering::Acquire)),
        )
    }

    /// Keeps a resolution made under `generation` from a record read after
    /// the write count was `count`, unless something changed since.
    pub(super) fn keep(
        &self,
        name: &str,
        version: Option<u64>,
        (generation, count): (u64, u64),
        r: &Arc<Resolved>,
    ) {
        if self.fn_writes().is_none() || self.st.snapshot.load().generation != generation {
            return;
        }
        let kept = Arc::new(Kept {
            r: r.clone(),
            stamp: AtomicU64::new(count),
        });
        self.st.resolved.rcu(|c| {
            let mut c = if c.generation == generation {
                ResolvedCache::clone(c)
            } else {
                ResolvedCache {
                    generation,
                    map: HashMap::new(),
                }
            };
            if c.map.len() >= MAX_CACHED_RESOLVED {
                c.map.clear();
            }
            c.map.insert((name.to_string(), version), kept.clone());
            c
        });
    }

    /// Forgets every kept resolution (a record found changed on a call).
    pub(super) fn forget_resolutions(&self) {
        self.st.resolved.store(Arc::new(ResolvedCache {
            generation: self.st.snapshot.load().generation,
            map: HashMap::new(),
        }));
    }

    /// Resolves a function of THIS namespace synchronously (on a blocking or
    /// worker thread): record, version, module (cached or compiled), env.
    pub(super) fn resolve_sync(&self, name: &str, version: Option<u64>) -> FnResult<Resolved> {
        if !valid_function_name(name) {
            return Err(FnError::NotFound(format!("no function {name:?}")));
        }
        let key = fn_key(&self.ns, name);
        let record_bytes = self
            .svc
            .store_wait(move |s| async move { s.get(&key).await })?
            .ok_or_else(|| FnError::NotFound(format!("no function {name:?}")))?;
        let record: FunctionRecord = serde_json::from_slice(&record_bytes).map_err(|e| {
            FnError::Internal(format!("function record {name:?} does not parse: {e}"))
        })?;
        let version = version.unwrap_or(record.current_version);
        if !record.versions.contains(&version) {
            return Err(FnError::NotFound(format!(
                "function {name:?} has no version {version}"
            )));
        }
        let key = ver_key(&self.ns, name, version);
        let meta: VersionMeta = self
            .svc
            .store_wait(move |s| async move { s.get_json(&key).await })?
            .ok_or_else(|| {
                FnError::NotFound(format!("function {name:?} has no version {version}"))
            })?;
        let cached = self
            .st
            .modules
            .load()
            .get(&(name.to_string(), version))
            .cloned();
        let module = match cached {
            Some(m) => m,
            None => {
                let key = blob_key(&meta.sha256);
                let bytes = self
                    .svc
                    .store_wait(move |s| async move { s.get(&key).await })?
                    .ok_or_else(|| {
                        FnError::Internal(format!("module blob {} is missing", meta.sha256))
                    })?;
                let m = self.svc.sync_compile(&self.ns, &bytes)?;
                self.st.modules.rcu(|modules| {
                    let mut modules = ModuleCache::clone(modules);
                    if modules.len() >= MAX_CACHED_MODULES {
                        modules.clear();
                    }
                    modules.insert((name.to_string(), version), m.clone());
                    modules
                });
                m
            }
        };
        let mut env: Vec<(String, String)> = meta
            .env_vars
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let p = secret_prefix(&self.ns);
        let prefix = p.clone();
        let sealed_secrets = self
            .svc
            .store_wait(move |s| async move { s.scan_all(&prefix).await })?;
        for (k, sealed) in sealed_secrets {
            let name = String::from_utf8_lossy(&k[p.len()..]).into_owned();
            match self.svc.0.secrets.open(&k, &sealed) {
                Some(v) => {
                    env.retain(|(n, _)| *n != name);
                    env.push((name, String::from_utf8_lossy(&v).into_owned()));
                }
                None => {
                    tracing::warn!(namespace = %self.ns, secret = %name, "Secret does not open; skipped.")
                }
            }
        }
        Ok(Resolved {
            record_bytes,
            record,
            meta,
            module,
            env,
        })
    }

    /// Whether `name` may be called without a credential of this namespace,
    /// from its function record alone: the public route asks this before it
    /// resolves anything for an outside caller, so a private function's
    /// module is never read nor compiled for one. A kept resolution answers
    /// without a read; otherwise one store read of the record.
    pub async fn is_public(&self, name: &str) -> FnResult<bool> {
        if let Some(r) = self.cached(name, None).await? {
            return Ok(r.record.is_public);
        }
        Ok(self.record_of(name).await?.is_public)
    }

    /// Resolves the function and builds the call; the guest does not run yet.
    /// `input` is taken as it is: the edge that read it checked the engine's
    /// input limit (the HTTP body read, the socket's `invoke` frame), and a
    /// trigger's input meets the engine's own check when it runs.
    pub async fn prepare(
        &self,
        name: String,
        version: Option<u64>,
        input: Vec<u8>,
        caller: CallerInfo,
        trigger: Trigger,
        depth: u8,
    ) -> FnResult<Prepared> {
        let r = match self.cached(&name, version).await? {
            Some(r) => r,
            None => {
                let stamp = self.stamp_now();
                let inv = self.clone();
                let n = name.clone();
                let r = tokio::task::spawn_blocking(move || inv.resolve_sync(&n, version))
                    .await
                    .map_err(|e| FnError::Internal(format!("resolve task failed: {e}")))??;
                let r = Arc::new(r);
                self.keep(&name, version, stamp, &r);
                r
            }
        };
        // The guest continues the caller's trace (this node's span as its
        // parent), or starts one. It reads it from the caller record: the
        // guest's environment is exactly what its deployer set
        // (docs/guest-abi.md).
        let trace = caller
            .trace
            .unwrap_or_else(crate::observe::trace::TraceContext::fresh);
        /// What the `caller` import hands the guest.
        #[derive(serde::Serialize)]
        struct CallerJson<'a> {
            /// The credential's subject; null for an anonymous public call.
            subject: &'a Option<String>,
            /// This namespace.
            namespace: &'a str,
            /// The request id of the call.
            request_id: &'a str,
            /// What started the call.
            trigger: &'a str,
            /// The W3C `traceparent` the guest continues.
            traceparent: String,
            /// The incoming `tracestate`, when there was one.
            #[serde(skip_serializing_if = "Option::is_none")]
            tracestate: Option<&'a str>,
        }
        let caller_json = serde_json::to_vec(&CallerJson {
            subject: &caller.subject,
            namespace: &self.ns,
            request_id: &caller.request_id,
            trigger: trigger.as_str(),
            traceparent: trace.traceparent(),
            tracestate: trace.tracestate.as_deref(),
        })
        .expect("serializable");
        let env = r.env.clone();
        let call = Invocation {
            namespace: self.ns.to_string(),
            function: name,
            version: r.meta.version,
            input,
            env,
            memory_limit_mb: r.meta.memory_limit_mb,
            timeout: Duration::from_secs(r.meta.timeout_seconds.into()),
            caller_json,
            depth: 0,
        };
        Ok(Prepared {
            host: Arc::new(NsHost {
                inv: self.clone(),
                depth,
                _busy: Busy::new(&self.st),
            }),
            inv: self.clone(),
            module: r.module.clone(),
            call,
            request_id: caller.request_id,
            trace_id: trace.trace_id_hex(),
            trigger,
            version: r.meta.version,
            is_public: r.record.is_public,
        })
    }
}

impl Prepared {
    /// Runs the guest on the worker pool, counts it and queues its record.
    pub async fn run(self) -> FnResult<Reply> {
        let Prepared {
            inv,
            module,
            call,
            host,
            request_id,
            trace_id,
            trigger,
            version,
            ..
        } = self;
        let name = call.function.clone();
        let engine = inv.svc.0.engine.clone();
        // The pool gauges are refreshed by the sampler (every second), not
        // per call: a snapshot takes the pool's lock and copies its queues.
        // A request's own call may run on the request's thread when its
        // guest is short and pure (`WasmEngine::invoke_here`); triggers run
        // on the actor threads, which serve every namespace, so they go to
        // the pool.
        let mut result = match trigger {
            Trigger::Http | Trigger::Public | Trigger::Ws => {
                engine.invoke_here(module, call, host).await
            }
            Trigger::Pubsub | Trigger::Cron | Trigger::Claims => {
                engine.invoke(module, call, host).await
            }
        };
        let (calls, errors) = inv.st.counters.get_or_init(|| {
            let m = &inv.svc.0.metrics;
            let label = m.ns_label(&inv.ns);
            (
                m.invocations.with_label_values(&[label.as_str()]),
                m.invocation_errors.with_label_values(&[label.as_str()]),
            )
        });
        calls.inc();
        let (status, error, duration, logs) = match &mut result {
            Ok(out) => (
                "ok".to_string(),
                None,
                out.duration,
                std::mem::take(&mut out.logs),
            ),
            Err(e) => {
                errors.inc();
                (
                    crate::functions::wasm_error_code(e).to_string(),
                    Some(e.to_string()),
                    Duration::ZERO,
                    Vec::new(),
                )
            }
        };
        inv.record(InvocationRecord {
            request_id,
            function: name,
            version,
            trigger: trigger.as_str().into(),
            status,
            error,
            duration_ms: duration.as_millis() as u64,
            timestamp_ms: now_ms(),
            logs: logs
                .into_iter()
                .map(|l| LogEntry {
                    level: l.level,
                    message: l.message,
                })
                .collect(),
            trace_id: Some(trace_id),
        });
        let out = result?;
        Ok(Reply {
            output: out.stdout,
            duration: out.duration,
            version,
        })
    }
}
