//! What a guest can reach: the node's [`HostApi`], the `meshgate` imports,
//! WASI preview 1 (built lazily) and the per-store state behind them.

#![forbid(unsafe_code)]

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use wasmtime::{Caller, Linker};

use super::engine::{CompiledModule, Invocation, LogLine, Runtime, execute};
use super::error::{HostError, WasmError, codes};
use super::limits::{
    MAX_DEPTH, MAX_INPUT_BYTES, MAX_LOG_LINE_BYTES, MAX_LOG_LINES, MAX_PUBLISHES, StoreLimiter,
};
use super::wasi::{Stdio, WasiCtx, WasiView, add_to_linker, guest_memory, guest_range};

/// The node's services for the guests of one namespace.
///
/// Called synchronously from the worker thread running the guest, so an
/// implementation must not block for long (no waiting on the async runtime
/// that is itself waiting for this invocation).
pub trait HostApi: Send + Sync {
    /// Reads `key` from the namespace KV.
    fn kv_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, HostError>;
    /// Writes `key` in the namespace KV.
    fn kv_put(&self, key: &[u8], value: &[u8]) -> Result<(), HostError>;
    /// Deletes `key` from the namespace KV.
    fn kv_delete(&self, key: &[u8]) -> Result<(), HostError>;
    /// Publishes `data` to `topic` of the namespace.
    fn publish(&self, topic: &str, data: &[u8]) -> Result<(), HostError>;
    /// Resolves another function of the SAME namespace for a nested `invoke`.
    /// The engine runs it inline on the same worker thread at depth + 1, so
    /// nested calls can never deadlock the pool.
    fn resolve(&self, name: &str) -> Result<ResolvedFunction, HostError>;
}

/// A function found by [`HostApi::resolve`], with its settings.
#[derive(Clone)]
pub struct ResolvedFunction {
    /// The compiled current version.
    pub module: Arc<CompiledModule>,
    /// Its version number.
    pub version: u64,
    /// Its environment (env vars and secrets).
    pub env: Vec<(String, String)>,
    /// Its memory limit, in MiB.
    pub memory_limit_mb: u32,
    /// Its own timeout (capped by what is left of the caller's).
    pub timeout: Duration,
}

/// Log lines of one invocation: stderr lines and the `log` import, in order.
#[derive(Default)]
pub(crate) struct LogBuf {
    /// An unterminated stderr line, at most [`MAX_LOG_LINE_BYTES`].
    partial: Vec<u8>,
    /// The kept lines, at most [`MAX_LOG_LINES`].
    lines: Vec<LogLine>,
    /// Lines past [`MAX_LOG_LINES`], only counted (logged at debug on finish).
    dropped: u64,
}

impl LogBuf {
    /// Keeps one line (cut to [`MAX_LOG_LINE_BYTES`]) unless the buffer is full.
    pub(crate) fn push(&mut self, level: &str, message: &[u8]) {
        if self.lines.len() >= MAX_LOG_LINES {
            self.dropped += 1;
            return;
        }
        let cut = &message[..message.len().min(MAX_LOG_LINE_BYTES)];
        self.lines.push(LogLine {
            level: level.to_owned(),
            message: String::from_utf8_lossy(cut).into_owned(),
        });
    }

    /// Keeps a nested invocation's lines, within the same cap.
    pub(crate) fn extend(&mut self, lines: Vec<LogLine>) {
        for line in lines {
            if self.lines.len() >= MAX_LOG_LINES {
                self.dropped += 1;
            } else {
                self.lines.push(line);
            }
        }
    }

    pub(crate) fn write_stderr(&mut self, mut bytes: &[u8]) {
        while let Some(nl) = bytes.iter().position(|&b| b == b'\n') {
            let (line, rest) = bytes.split_at(nl);
            if self.partial.is_empty() {
                self.push("info", line);
            } else {
                self.partial.extend_from_slice(line);
                let full = std::mem::take(&mut self.partial);
                self.push("info", &full);
            }
            bytes = &rest[1..];
        }
        // Keep at most one line's worth of an unterminated line.
        let room = MAX_LOG_LINE_BYTES.saturating_sub(self.partial.len());
        self.partial
            .extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    /// The lines, with any unterminated stderr line flushed.
    pub(crate) fn finish(&mut self) -> Vec<LogLine> {
        if !self.partial.is_empty() {
            let full = std::mem::take(&mut self.partial);
            self.push("info", &full);
        }
        if self.dropped > 0 {
            tracing::debug!(dropped = self.dropped, "Guest log lines dropped.");
        }
        std::mem::take(&mut self.lines)
    }
}

impl WasiView for HostState {
    fn wasi(&self) -> &WasiCtx {
        &self.wasi
    }
    fn wasi_mut(&mut self) -> &mut WasiCtx {
        &mut self.wasi
    }
    fn write_stderr(&mut self, bytes: &[u8]) {
        self.logs.lock().write_stderr(bytes);
    }
}

/// The data of one invocation's `Store`.
pub(crate) struct HostState {
    /// What WASI reads and writes: stdio, env, `argv[0]`, the deadline, the memory.
    pub(crate) wasi: WasiCtx,
    /// stderr and the `log` import write here; shared with the stderr sink.
    pub(crate) logs: Arc<Mutex<LogBuf>>,
    /// The store's memory and table caps.
    pub(crate) limiter: StoreLimiter,
    /// The namespace's KV, pub/sub and function lookup.
    host: Arc<dyn HostApi>,
    /// The engine and linker, for nested invocations run inline.
    runtime: Arc<Runtime>,
    /// The namespace of the call; nested calls stay in it.
    namespace: String,
    /// What the `caller` import returns; nested calls inherit it.
    caller_json: Vec<u8>,
    /// This guest's publishes, capped at [`MAX_PUBLISHES`].
    pub(crate) publishes: u32,
    /// Publishes of the nested invocations it made, reported with its own.
    pub(crate) nested_publishes: u32,
    /// Nesting depth of this guest (0 for a top-level call), at most [`MAX_DEPTH`].
    depth: u32,
}

impl HostState {
    /// The state of one invocation's store; WASI is built later, on first use.
    pub(crate) fn new(
        runtime: Arc<Runtime>,
        call: Invocation,
        host: Arc<dyn HostApi>,
        deadline: Instant,
    ) -> Self {
        Self {
            wasi: WasiCtx {
                stdio: Stdio::new(call.input),
                env: call.env,
                function: call.function,
                deadline,
                memory: None,
            },
            logs: Arc::new(Mutex::new(LogBuf::default())),
            limiter: StoreLimiter::new(call.memory_limit_mb),
            host,
            runtime,
            namespace: call.namespace,
            caller_json: call.caller_json,
            publishes: 0,
            nested_publishes: 0,
            depth: call.depth,
        }
    }

    /// The call this state was made from, whole again (its input unread),
    /// so that it can run from the start elsewhere: a speculative run on a
    /// request thread that used up its budget (`engine::invoke_here`).
    pub(crate) fn into_call(
        self,
        function: String,
        version: u64,
        memory_limit_mb: u32,
        timeout: Duration,
    ) -> Invocation {
        Invocation {
            namespace: self.namespace,
            function,
            version,
            input: self.wasi.stdio.stdin,
            env: self.wasi.env,
            memory_limit_mb,
            timeout,
            caller_json: self.caller_json,
            depth: self.depth,
        }
    }

    /// What the guest wrote to stdout (at most `MAX_OUTPUT_BYTES + 1` bytes).
    pub(crate) fn take_stdout(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.wasi.stdio.stdout)
    }
}

/// Builds the linker shared by every module: WASI preview 1 and `meshgate`.
pub(crate) fn build_linker(engine: &wasmtime::Engine) -> wasmtime::Result<Linker<HostState>> {
    let mut linker = Linker::new(engine);
    add_to_linker(&mut linker)?;
    linker.func_wrap("meshgate", "publish", publish)?;
    linker.func_wrap("meshgate", "kv_get", kv_get)?;
    linker.func_wrap("meshgate", "kv_put", kv_put)?;
    linker.func_wrap("meshgate", "kv_delete", kv_delete)?;
    linker.func_wrap("meshgate", "invoke", invoke)?;
    linker.func_wrap("meshgate", "caller", caller_info)?;
    linker.func_wrap("meshgate", "log", log)?;
    Ok(linker)
}

/// The `kv_get` protocol: write `value` only if it fits, return its length.
fn write_out(data: &mut [u8], out: Range<usize>, value: &[u8]) -> i64 {
    if value.len() <= out.len() {
        data[out.start..out.start + value.len()].copy_from_slice(value);
    }
    value.len() as i64
}

fn publish(
    mut caller: Caller<'_, HostState>,
    topic_ptr: i32,
    topic_len: i32,
    data_ptr: i32,
    data_len: i32,
) -> i32 {
    let Some(mem) = guest_memory(&mut caller) else {
        return codes::BAD_ARGUMENT;
    };
    let (data, state) = mem.data_and_store_mut(&mut caller);
    let (Some(t), Some(d)) = (
        guest_range(topic_ptr, topic_len, data.len()),
        guest_range(data_ptr, data_len, data.len()),
    ) else {
        return codes::BAD_ARGUMENT;
    };
    let Ok(topic) = std::str::from_utf8(&data[t]) else {
        return codes::BAD_ARGUMENT;
    };
    if topic.is_empty() {
        return codes::BAD_ARGUMENT;
    }
    if state.publishes >= MAX_PUBLISHES {
        return codes::LIMIT;
    }
    state.publishes += 1;
    match state.host.publish(topic, &data[d]) {
        Ok(()) => 0,
        Err(e) => e.code(),
    }
}

fn kv_get(
    mut caller: Caller<'_, HostState>,
    key_ptr: i32,
    key_len: i32,
    out_ptr: i32,
    out_cap: i32,
) -> i64 {
    let Some(mem) = guest_memory(&mut caller) else {
        return codes::BAD_ARGUMENT.into();
    };
    let (data, state) = mem.data_and_store_mut(&mut caller);
    let (Some(k), Some(out)) = (
        guest_range(key_ptr, key_len, data.len()),
        guest_range(out_ptr, out_cap, data.len()),
    ) else {
        return codes::BAD_ARGUMENT.into();
    };
    match state.host.kv_get(&data[k]) {
        Ok(Some(value)) => write_out(data, out, &value),
        Ok(None) => codes::NOT_FOUND.into(),
        Err(e) => e.code().into(),
    }
}

fn kv_put(
    mut caller: Caller<'_, HostState>,
    key_ptr: i32,
    key_len: i32,
    val_ptr: i32,
    val_len: i32,
) -> i32 {
    let Some(mem) = guest_memory(&mut caller) else {
        return codes::BAD_ARGUMENT;
    };
    let (data, state) = mem.data_and_store_mut(&mut caller);
    let (Some(k), Some(v)) = (
        guest_range(key_ptr, key_len, data.len()),
        guest_range(val_ptr, val_len, data.len()),
    ) else {
        return codes::BAD_ARGUMENT;
    };
    match state.host.kv_put(&data[k], &data[v]) {
        Ok(()) => 0,
        Err(e) => e.code(),
    }
}

fn kv_delete(mut caller: Caller<'_, HostState>, key_ptr: i32, key_len: i32) -> i32 {
    let Some(mem) = guest_memory(&mut caller) else {
        return codes::BAD_ARGUMENT;
    };
    let (data, state) = mem.data_and_store_mut(&mut caller);
    let Some(k) = guest_range(key_ptr, key_len, data.len()) else {
        return codes::BAD_ARGUMENT;
    };
    match state.host.kv_delete(&data[k]) {
        Ok(()) => 0,
        Err(e) => e.code(),
    }
}

fn caller_info(mut caller: Caller<'_, HostState>, out_ptr: i32, out_cap: i32) -> i64 {
    let Some(mem) = guest_memory(&mut caller) else {
        return codes::BAD_ARGUMENT.into();
    };
    let (data, state) = mem.data_and_store_mut(&mut caller);
    let Some(out) = guest_range(out_ptr, out_cap, data.len()) else {
        return codes::BAD_ARGUMENT.into();
    };
    write_out(data, out, &state.caller_json)
}

fn log(mut caller: Caller<'_, HostState>, level: i32, msg_ptr: i32, msg_len: i32) -> i32 {
    let level = match level {
        0 => "debug",
        1 => "info",
        2 => "warn",
        3 => "error",
        _ => return codes::BAD_ARGUMENT,
    };
    let Some(mem) = guest_memory(&mut caller) else {
        return codes::BAD_ARGUMENT;
    };
    let (data, state) = mem.data_and_store_mut(&mut caller);
    let Some(m) = guest_range(msg_ptr, msg_len, data.len()) else {
        return codes::BAD_ARGUMENT;
    };
    state.logs.lock().push(level, &data[m]);
    0
}

fn invoke(
    mut caller: Caller<'_, HostState>,
    name_ptr: i32,
    name_len: i32,
    in_ptr: i32,
    in_len: i32,
    out_ptr: i32,
    out_cap: i32,
) -> i64 {
    let Some(mem) = guest_memory(&mut caller) else {
        return codes::BAD_ARGUMENT.into();
    };
    let (name, input, out) = {
        let data = mem.data(&caller);
        let (Some(n), Some(i), Some(out)) = (
            guest_range(name_ptr, name_len, data.len()),
            guest_range(in_ptr, in_len, data.len()),
            guest_range(out_ptr, out_cap, data.len()),
        ) else {
            return codes::BAD_ARGUMENT.into();
        };
        let Ok(name) = std::str::from_utf8(&data[n]) else {
            return codes::BAD_ARGUMENT.into();
        };
        if name.is_empty() || i.len() > MAX_INPUT_BYTES {
            return codes::BAD_ARGUMENT.into();
        }
        (name.to_owned(), data[i].to_vec(), out)
    };
    let state = caller.data_mut();
    if state.depth >= MAX_DEPTH {
        return codes::LIMIT.into();
    }
    let resolved = match state.host.resolve(&name) {
        Ok(r) => r,
        Err(e) => return e.code().into(),
    };
    let call = Invocation {
        namespace: state.namespace.clone(),
        function: name,
        version: resolved.version,
        input,
        env: resolved.env,
        memory_limit_mb: resolved.memory_limit_mb,
        timeout: resolved.timeout,
        caller_json: state.caller_json.clone(),
        depth: state.depth + 1,
    };
    let function = call.function.clone();
    // Inline on this worker thread: a nested call never waits for the pool.
    let result = execute(
        &state.runtime,
        &resolved.module,
        call,
        state.host.clone(),
        Some(state.wasi.deadline),
    );
    match result {
        Ok(output) => {
            state.logs.lock().extend(output.logs);
            state.nested_publishes = state.nested_publishes.saturating_add(output.publishes);
            let data = mem.data_mut(&mut caller);
            if out.end > data.len() {
                return codes::BAD_ARGUMENT.into();
            }
            write_out(data, out, &output.stdout)
        }
        Err(WasmError::DepthExceeded) => codes::LIMIT.into(),
        Err(WasmError::InputTooLarge) => codes::BAD_ARGUMENT.into(),
        Err(e) => {
            let line = format!("nested invoke of {function} failed: {e}");
            state.logs.lock().push("error", line.as_bytes());
            codes::INTERNAL.into()
        }
    }
}
