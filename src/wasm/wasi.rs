//! WASI preview 1 as a function's sandbox offers it: stdin (the call's
//! input), stdout (its answer, capped), stderr (log lines), the env, the
//! clocks, randomness, sleeping, and nothing else: no file, directory or
//! socket can be named, so every such call answers `EBADF` (the socket
//! calls on a standard stream `ENOTSOCK`). `argv[0]` is the function's name.
//!
//! wasmtime-wasi implements the whole of preview 1 over preview 2's
//! resources; each call entered a Tokio runtime (`in_tokio`, a seed drawn
//! under a lock), built a tracing span and went through a resource table, and
//! the context itself (two ChaCha generators, the table, the clocks) was
//! built per call: about 5 of the C echo guest's 6.6 µs. What a function can
//! reach is this much smaller surface, so it is implemented here, on the
//! guest's memory directly: every pointer and length the guest passes is
//! checked against its memory (`EFAULT` otherwise), nothing blocks but
//! `poll_oneoff`'s clock, which never sleeps past the call's deadline, and no
//! call enters an async runtime, so a guest can also run on a thread that is
//! itself inside one (docs/decisions.md, "Our own WASI preview 1").
//!
//! Every function of `wasi_snapshot_preview1` is defined, with its standard
//! signature, so a module built against a full libc links as before.

#![forbid(unsafe_code)]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::ops::Range;
use std::time::Instant;

use wasmtime::{Caller, Extern, Linker, Memory, Trap};

use super::limits::MAX_OUTPUT_BYTES;

/// The module name of WASI preview 1's imports.
pub(crate) const MODULE: &str = "wasi_snapshot_preview1";

/// The imports of preview 1 that may wait: a guest importing one is not
/// run speculatively on a request thread (`CompiledModule::pure`).
pub(crate) const BLOCKING: &[&str] = &["poll_oneoff"];

const SUCCESS: i32 = 0;
const EBADF: i32 = 8;
const EFAULT: i32 = 21;
const EINVAL: i32 = 28;
const ENOSYS: i32 = 52;
const ENOTSOCK: i32 = 57;
const ESPIPE: i32 = 70;

/// Most iovecs in one `fd_read`/`fd_write` (POSIX's `IOV_MAX`), and most
/// subscriptions in one `poll_oneoff`: past it `EINVAL`. A guest's memory
/// could hold millions, each a host allocation.
const MAX_VECTORS: usize = 1024;
/// Most stderr bytes one `fd_write` takes (a partial write, as a pipe's;
/// libc writes the rest in its next call): a host call is not interrupted
/// by the deadline, so its work is bounded.
const MAX_STDERR_PER_CALL: usize = 64 << 10;
/// Most bytes one `random_get` fills (`EINVAL` past it), for the same reason.
const MAX_RANDOM_PER_CALL: usize = 1 << 20;

/// `filetype::unknown`: stdio is a pipe, not a terminal (so libc buffers it).
const FILETYPE_UNKNOWN: u8 = 0;
/// `rights::fd_read`.
const RIGHT_FD_READ: u64 = 1 << 1;
/// `rights::fd_write`.
const RIGHT_FD_WRITE: u64 = 1 << 6;

/// How `proc_exit` ends a guest: its exit code, as an error that unwinds
/// the guest's stack (the engine reads 0 as success).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Exit(pub(crate) i32);

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit code {}", self.0)
    }
}

impl std::error::Error for Exit {}

/// What WASI needs of a store's data: its [`WasiCtx`]. The store's data
/// type (`host::HostState`) implements it; this file names no other.
pub(crate) trait WasiView: 'static {
    /// The call's WASI state.
    fn wasi(&self) -> &WasiCtx;
    /// The call's WASI state, to change.
    fn wasi_mut(&mut self) -> &mut WasiCtx;
    /// Takes bytes the guest wrote to stderr.
    fn write_stderr(&mut self, bytes: &[u8]);
}

/// The part of one invocation's store data that WASI reads and writes.
pub(crate) struct WasiCtx {
    /// stdin (the input), stdout (capped at `MAX_OUTPUT_BYTES + 1`, so an
    /// overflow shows) and which of the three the guest closed.
    pub(crate) stdio: Stdio,
    /// Env vars and secrets, as `environ_get` hands them out.
    pub(crate) env: Vec<(String, String)>,
    /// The function called: `argv[0]`.
    pub(crate) function: String,
    /// When the whole call chain must end; nested calls share it.
    pub(crate) deadline: Instant,
    /// The instance's exported memory, set once it is instantiated (a host
    /// function called before, from a start function, looks it up).
    pub(crate) memory: Option<Memory>,
}

/// The guest's exported memory: the one set at instantiation, else looked up.
pub(crate) fn guest_memory(caller: &mut Caller<'_, impl WasiView>) -> Option<Memory> {
    if let Some(m) = caller.data().wasi().memory {
        return Some(m);
    }
    match caller.get_export("memory") {
        Some(Extern::Memory(m)) => Some(m),
        _ => None,
    }
}

/// The bytes `[ptr, ptr + len)` as a range of a memory of `size` bytes, if in bounds.
/// Pointers and lengths are unsigned 32-bit values passed as `i32`.
pub(crate) fn guest_range(ptr: i32, len: i32, size: usize) -> Option<Range<usize>> {
    let start = ptr as u32 as usize;
    let end = start.checked_add(len as u32 as usize)?;
    (end <= size).then_some(start..end)
}

/// The standard streams of one call.
#[derive(Default)]
pub(crate) struct Stdio {
    /// The call's input.
    pub(crate) stdin: Vec<u8>,
    /// How much of `stdin` the guest has read.
    read: usize,
    /// What the guest wrote to stdout, at most `MAX_OUTPUT_BYTES + 1` bytes
    /// (so an overflow shows; the rest is dropped).
    pub(crate) stdout: Vec<u8>,
    /// Bit `fd` set: the guest closed that standard stream.
    closed: u8,
}

impl Stdio {
    /// The streams of a call whose input is `stdin`.
    pub(crate) fn new(stdin: Vec<u8>) -> Self {
        Self {
            stdin,
            ..Self::default()
        }
    }

    /// Whether `fd` is a standard stream the guest has not closed.
    fn open(&self, fd: i32) -> bool {
        (0..3).contains(&fd) && self.closed & (1 << fd) == 0
    }
}

/// `len` bytes at guest address `ptr`, if they lie inside `mem`: the
/// `meshgate` imports' bounds check ([`guest_range`]), for lengths counted
/// on the host (a length past 32 bits is never inside).
fn span(mem: &[u8], ptr: u32, len: usize) -> Option<std::ops::Range<usize>> {
    guest_range(ptr as i32, u32::try_from(len).ok()? as i32, mem.len())
}

fn put_u32(mem: &mut [u8], ptr: i32, v: u32) -> Result<(), i32> {
    let r = span(mem, ptr as u32, 4).ok_or(EFAULT)?;
    mem[r].copy_from_slice(&v.to_le_bytes());
    Ok(())
}

fn put_u64(mem: &mut [u8], ptr: i32, v: u64) -> Result<(), i32> {
    let r = span(mem, ptr as u32, 8).ok_or(EFAULT)?;
    mem[r].copy_from_slice(&v.to_le_bytes());
    Ok(())
}

fn get_u32(mem: &[u8], at: usize) -> Result<u32, i32> {
    let r = span(mem, at as u32, 4)
        .filter(|_| at <= u32::MAX as usize)
        .ok_or(EFAULT)?;
    Ok(u32::from_le_bytes(mem[r].try_into().expect("4 bytes")))
}

fn get_u64(mem: &[u8], at: usize) -> Result<u64, i32> {
    let r = span(mem, at as u32, 8)
        .filter(|_| at <= u32::MAX as usize)
        .ok_or(EFAULT)?;
    Ok(u64::from_le_bytes(mem[r].try_into().expect("8 bytes")))
}

/// The (address, length) pairs of an iovec array, each checked against `mem`.
fn iovecs(mem: &[u8], iovs: i32, count: i32) -> Result<Vec<std::ops::Range<usize>>, i32> {
    let count = count as u32 as usize;
    if count > MAX_VECTORS {
        return Err(EINVAL);
    }
    // Each entry is 8 bytes: the whole array must lie in memory.
    span(mem, iovs as u32, count.checked_mul(8).ok_or(EFAULT)?).ok_or(EFAULT)?;
    (0..count)
        .map(|i| {
            let at = iovs as u32 as usize + i * 8;
            let ptr = get_u32(mem, at)?;
            let len = get_u32(mem, at + 4)? as usize;
            span(mem, ptr, len).ok_or(EFAULT)
        })
        .collect()
}

/// Runs `f` on the guest's memory and state; `EFAULT`'s kin when the
/// guest has no memory. The errno is the function's result.
fn with_mem(
    caller: &mut Caller<'_, impl WasiView>,
    f: impl FnOnce(&mut [u8], &mut WasiCtx) -> Result<(), i32>,
) -> i32 {
    let Some(m) = guest_memory(caller) else {
        return EFAULT;
    };
    let (mem, state) = m.data_and_store_mut(caller);
    match f(mem, state.wasi_mut()) {
        Ok(()) => SUCCESS,
        Err(errno) => errno,
    }
}

fn fd_read(mut caller: Caller<'_, impl WasiView>, fd: i32, iovs: i32, n: i32, nread: i32) -> i32 {
    with_mem(&mut caller, |mem, st| {
        let io = &mut st.stdio;
        if fd != 0 || !io.open(0) {
            return Err(EBADF);
        }
        let mut total = 0usize;
        for r in iovecs(mem, iovs, n)? {
            let rest = &io.stdin[io.read..];
            let k = rest.len().min(r.len());
            mem[r.start..r.start + k].copy_from_slice(&rest[..k]);
            io.read += k;
            total += k;
            if io.read == io.stdin.len() {
                break;
            }
        }
        put_u32(mem, nread, total as u32)
    })
}

fn fd_write(
    mut caller: Caller<'_, impl WasiView>,
    fd: i32,
    iovs: i32,
    n: i32,
    nwritten: i32,
) -> i32 {
    let Some(m) = guest_memory(&mut caller) else {
        return EFAULT;
    };
    let (mem, st) = m.data_and_store_mut(&mut caller);
    let written = (|| {
        if !(fd == 1 || fd == 2) || !st.wasi().stdio.open(fd) {
            return Err(EBADF);
        }
        let mut total = 0usize;
        for r in iovecs(mem, iovs, n)? {
            let bytes = &mem[r];
            if fd == 1 {
                // Past the cap the bytes are dropped but counted as written
                // (the call fails as OutputTooLarge when the guest ends).
                let out = &mut st.wasi_mut().stdio.stdout;
                let room = (MAX_OUTPUT_BYTES + 1).saturating_sub(out.len());
                out.extend_from_slice(&bytes[..bytes.len().min(room)]);
                total = total.saturating_add(bytes.len());
            } else {
                let take = bytes.len().min(MAX_STDERR_PER_CALL - total);
                st.write_stderr(&bytes[..take]);
                total += take;
                if total == MAX_STDERR_PER_CALL {
                    break;
                }
            }
        }
        put_u32(mem, nwritten, total.min(u32::MAX as usize) as u32)
    })();
    written.err().unwrap_or(SUCCESS)
}

fn fd_close(mut caller: Caller<'_, impl WasiView>, fd: i32) -> i32 {
    let st = caller.data_mut().wasi_mut();
    if !st.stdio.open(fd) {
        return EBADF;
    }
    st.stdio.closed |= 1 << fd;
    SUCCESS
}

fn fd_fdstat_get(mut caller: Caller<'_, impl WasiView>, fd: i32, out: i32) -> i32 {
    with_mem(&mut caller, |mem, st| {
        if !st.stdio.open(fd) {
            return Err(EBADF);
        }
        let rights = if fd == 0 {
            RIGHT_FD_READ
        } else {
            RIGHT_FD_WRITE
        };
        // fdstat: filetype u8, flags u16 at 2, rights base at 8, inheriting at 16.
        let r = span(mem, out as u32, 24).ok_or(EFAULT)?;
        let b = &mut mem[r];
        b.fill(0);
        b[0] = FILETYPE_UNKNOWN;
        b[8..16].copy_from_slice(&rights.to_le_bytes());
        b[16..24].copy_from_slice(&rights.to_le_bytes());
        Ok(())
    })
}

fn fd_filestat_get(mut caller: Caller<'_, impl WasiView>, fd: i32, out: i32) -> i32 {
    with_mem(&mut caller, |mem, st| {
        if !st.stdio.open(fd) {
            return Err(EBADF);
        }
        // A pipe: every field zero (filetype unknown, no size, no times).
        let r = span(mem, out as u32, 64).ok_or(EFAULT)?;
        mem[r].fill(0);
        Ok(())
    })
}

/// `fd_seek` and `fd_tell`: a stream cannot seek.
fn seek_errno(caller: &Caller<'_, impl WasiView>, fd: i32) -> i32 {
    if caller.data().wasi().stdio.open(fd) {
        ESPIPE
    } else {
        EBADF
    }
}

fn fd_seek(caller: Caller<'_, impl WasiView>, fd: i32, _off: i64, _whence: i32, _out: i32) -> i32 {
    seek_errno(&caller, fd)
}

fn fd_tell(caller: Caller<'_, impl WasiView>, fd: i32, _out: i32) -> i32 {
    seek_errno(&caller, fd)
}

fn fd_pread(caller: Caller<'_, impl WasiView>, fd: i32, _: i32, _: i32, _: i64, _: i32) -> i32 {
    seek_errno(&caller, fd)
}

fn fd_pwrite(caller: Caller<'_, impl WasiView>, fd: i32, _: i32, _: i32, _: i64, _: i32) -> i32 {
    seek_errno(&caller, fd)
}

/// The `NAME=value` strings of the env, in order.
fn env_strings(st: &WasiCtx) -> impl Iterator<Item = (&str, &str)> {
    st.env.iter().map(|(k, v)| (k.as_str(), v.as_str()))
}

fn environ_sizes_get(mut caller: Caller<'_, impl WasiView>, count: i32, size: i32) -> i32 {
    with_mem(&mut caller, |mem, st| {
        let n = st.env.len() as u32;
        let bytes: usize = env_strings(st).map(|(k, v)| k.len() + v.len() + 2).sum();
        put_u32(mem, count, n)?;
        put_u32(mem, size, bytes as u32)
    })
}

fn environ_get(mut caller: Caller<'_, impl WasiView>, ptrs: i32, buf: i32) -> i32 {
    with_mem(&mut caller, |mem, st| {
        let mut at = buf as u32 as usize;
        for (i, (k, v)) in env_strings(st).enumerate() {
            let len = k.len() + v.len() + 2;
            let r = span(mem, at as u32, len)
                .filter(|_| at <= u32::MAX as usize)
                .ok_or(EFAULT)?;
            let slot = (ptrs as u32 as usize)
                .checked_add(i * 4)
                .filter(|p| *p <= u32::MAX as usize)
                .ok_or(EFAULT)?;
            put_u32(mem, slot as u32 as i32, at as u32)?;
            let b = &mut mem[r];
            b[..k.len()].copy_from_slice(k.as_bytes());
            b[k.len()] = b'=';
            b[k.len() + 1..len - 1].copy_from_slice(v.as_bytes());
            b[len - 1] = 0;
            at += len;
        }
        Ok(())
    })
}

/// One argument, `argv[0]`: the function's name, as a WASI runtime gives
/// a command its program name (libc's `main` and `getopt` expect one).
fn args_sizes_get(mut caller: Caller<'_, impl WasiView>, count: i32, size: i32) -> i32 {
    with_mem(&mut caller, |mem, st| {
        put_u32(mem, count, 1)?;
        put_u32(mem, size, st.function.len() as u32 + 1)
    })
}

fn args_get(mut caller: Caller<'_, impl WasiView>, argv: i32, buf: i32) -> i32 {
    with_mem(&mut caller, |mem, st| {
        let name = st.function.as_bytes();
        let r = span(mem, buf as u32, name.len() + 1).ok_or(EFAULT)?;
        put_u32(mem, argv, buf as u32)?;
        let b = &mut mem[r];
        b[..name.len()].copy_from_slice(name);
        b[name.len()] = 0;
        Ok(())
    })
}

/// The `sock_*` calls: stdio is no socket (`ENOTSOCK`, as wasmtime-wasi
/// answers), and no other descriptor exists (`EBADF`).
fn sock_errno(caller: &Caller<'_, impl WasiView>, fd: i32) -> i32 {
    if caller.data().wasi().stdio.open(fd) {
        ENOTSOCK
    } else {
        EBADF
    }
}

/// Nanoseconds on clock `id` (0 realtime, 1 monotonic); the CPU-time clocks
/// are not offered (`EBADF`, as wasmtime-wasi answers).
fn clock_now(id: i32) -> Result<u64, i32> {
    match id {
        0 => Ok(SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64),
        1 => Ok(crate::util::mono_now()
            .duration_since(*MONO_BASE)
            .as_nanos() as u64),
        2 | 3 => Err(EBADF),
        _ => Err(EINVAL),
    }
}

/// Where the monotonic clock counts from (the node's start, near enough).
static MONO_BASE: std::sync::LazyLock<std::time::Instant> =
    std::sync::LazyLock::new(crate::util::mono_now);

fn clock_res_get(mut caller: Caller<'_, impl WasiView>, id: i32, out: i32) -> i32 {
    with_mem(&mut caller, |mem, _| {
        clock_now(id)?;
        put_u64(mem, out, 1)
    })
}

fn clock_time_get(
    mut caller: Caller<'_, impl WasiView>,
    id: i32,
    _precision: i64,
    out: i32,
) -> i32 {
    with_mem(&mut caller, |mem, _| {
        let now = clock_now(id)?;
        put_u64(mem, out, now)
    })
}

fn random_get(mut caller: Caller<'_, impl WasiView>, buf: i32, len: i32) -> i32 {
    with_mem(&mut caller, |mem, _| {
        if len as u32 as usize > MAX_RANDOM_PER_CALL {
            return Err(EINVAL);
        }
        let r = span(mem, buf as u32, len as u32 as usize).ok_or(EFAULT)?;
        use ring::rand::SecureRandom;
        ring::rand::SystemRandom::new()
            .fill(&mut mem[r])
            .map_err(|_| 29) // EIO
    })
}

fn sched_yield(_: Caller<'_, impl WasiView>) -> i32 {
    SUCCESS
}

fn proc_exit(_: Caller<'_, impl WasiView>, code: i32) -> wasmtime::Result<()> {
    Err(wasmtime::Error::new(Exit(code)))
}

fn proc_raise(_: Caller<'_, impl WasiView>, _sig: i32) -> i32 {
    ENOSYS
}

/// One `poll_oneoff` subscription, as read from the guest.
enum Sub {
    /// Wait until this much time has passed.
    Clock { userdata: u64, after: Duration },
    /// A stream ready to read (`read`) or write.
    Fd { userdata: u64, fd: i32, read: bool },
}

/// Reads `n` subscriptions (48 bytes each) at `ptr`.
fn subscriptions(mem: &[u8], ptr: i32, n: u32) -> Result<Vec<Sub>, i32> {
    let base = ptr as u32 as usize;
    span(mem, ptr as u32, (n as usize).checked_mul(48).ok_or(EFAULT)?).ok_or(EFAULT)?;
    (0..n as usize)
        .map(|i| {
            let at = base + i * 48;
            let userdata = get_u64(mem, at)?;
            match mem[at + 8] {
                0 => {
                    let id = get_u32(mem, at + 16)? as i32;
                    let timeout = get_u64(mem, at + 24)?;
                    let abstime = mem[at + 40] & 1 == 1;
                    let after = if abstime {
                        timeout.saturating_sub(clock_now(id)?)
                    } else {
                        clock_now(id)?;
                        timeout
                    };
                    Ok(Sub::Clock {
                        userdata,
                        after: Duration::from_nanos(after),
                    })
                }
                tag @ (1 | 2) => Ok(Sub::Fd {
                    userdata,
                    fd: get_u32(mem, at + 16)? as i32,
                    read: tag == 1,
                }),
                _ => Err(EINVAL),
            }
        })
        .collect()
}

/// Writes one event (32 bytes) at `out`.
fn put_event(
    mem: &mut [u8],
    out: usize,
    userdata: u64,
    errno: u16,
    kind: u8,
    nbytes: u64,
) -> Result<(), i32> {
    let r = span(mem, out as u32, 32)
        .filter(|_| out <= u32::MAX as usize)
        .ok_or(EFAULT)?;
    let b = &mut mem[r];
    b.fill(0);
    b[0..8].copy_from_slice(&userdata.to_le_bytes());
    b[8..10].copy_from_slice(&errno.to_le_bytes());
    b[10] = kind;
    b[16..24].copy_from_slice(&nbytes.to_le_bytes());
    Ok(())
}

/// Streams are always ready; otherwise the guest sleeps until its earliest
/// clock, never past the call's deadline (then it traps as timed out).
fn poll_oneoff(
    mut caller: Caller<'_, impl WasiView>,
    subs: i32,
    events: i32,
    n: i32,
    nevents: i32,
) -> wasmtime::Result<i32> {
    let Some(m) = guest_memory(&mut caller) else {
        return Ok(EFAULT);
    };
    let (mem, st) = m.data_and_store_mut(&mut caller);
    let st = st.wasi_mut();
    if n == 0 || n as u32 as usize > MAX_VECTORS {
        return Ok(EINVAL);
    }
    let subs = match subscriptions(mem, subs, n as u32) {
        Ok(s) => s,
        Err(e) => return Ok(e),
    };
    let mut out = events as u32 as usize;
    let mut count = 0u32;
    for s in &subs {
        if let Sub::Fd { userdata, fd, read } = *s {
            let ok = st.stdio.open(fd) && (if read { fd == 0 } else { fd == 1 || fd == 2 });
            let nbytes = if read && ok {
                (st.stdio.stdin.len() - st.stdio.read) as u64
            } else {
                0
            };
            let errno = if ok { 0 } else { EBADF as u16 };
            if let Err(e) = put_event(mem, out, userdata, errno, if read { 1 } else { 2 }, nbytes) {
                return Ok(e);
            }
            out += 32;
            count += 1;
        }
    }
    if count == 0 {
        let wait = subs
            .iter()
            .filter_map(|s| match s {
                Sub::Clock { after, .. } => Some(*after),
                Sub::Fd { .. } => None,
            })
            .min()
            .unwrap_or_default();
        let left = st
            .deadline
            .saturating_duration_since(crate::util::mono_now());
        if wait > left {
            // Audited: a guest's sleep, on the pool thread running it (a
            // guest importing poll_oneoff never runs on a request thread).
            #[allow(clippy::disallowed_methods)]
            std::thread::sleep(left);
            return Err(wasmtime::Error::new(Trap::Interrupt));
        }
        // Audited: as above.
        #[allow(clippy::disallowed_methods)]
        std::thread::sleep(wait);
        for s in &subs {
            if let Sub::Clock { userdata, after } = *s
                && after <= wait
            {
                if let Err(e) = put_event(mem, out, userdata, 0, 0, 0) {
                    return Ok(e);
                }
                out += 32;
                count += 1;
            }
        }
    }
    Ok(put_u32(mem, nevents, count).err().unwrap_or(SUCCESS))
}

/// Adds preview 1 to `linker`: the functions above, the sockets calls
/// (`ENOTSOCK` on stdio), and every other one of the standard set answering
/// `EBADF` (there is no file or directory to name) with its standard
/// signature.
pub(crate) fn add_to_linker<T: WasiView>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    let m = MODULE;
    linker.func_wrap(m, "args_get", args_get)?;
    linker.func_wrap(m, "args_sizes_get", args_sizes_get)?;
    linker.func_wrap(m, "environ_get", environ_get)?;
    linker.func_wrap(m, "environ_sizes_get", environ_sizes_get)?;
    linker.func_wrap(m, "clock_res_get", clock_res_get)?;
    linker.func_wrap(m, "clock_time_get", clock_time_get)?;
    linker.func_wrap(m, "fd_read", fd_read)?;
    linker.func_wrap(m, "fd_write", fd_write)?;
    linker.func_wrap(m, "fd_close", fd_close)?;
    linker.func_wrap(m, "fd_fdstat_get", fd_fdstat_get)?;
    linker.func_wrap(m, "fd_filestat_get", fd_filestat_get)?;
    linker.func_wrap(m, "fd_seek", fd_seek)?;
    linker.func_wrap(m, "fd_tell", fd_tell)?;
    linker.func_wrap(m, "fd_pread", fd_pread)?;
    linker.func_wrap(m, "fd_pwrite", fd_pwrite)?;
    linker.func_wrap(m, "random_get", random_get)?;
    linker.func_wrap(m, "sched_yield", sched_yield)?;
    linker.func_wrap(m, "proc_exit", proc_exit)?;
    linker.func_wrap(m, "proc_raise", proc_raise)?;
    linker.func_wrap(m, "poll_oneoff", poll_oneoff)?;
    linker.func_wrap(
        m,
        "sock_accept",
        |c: Caller<'_, T>, fd: i32, _: i32, _: i32| sock_errno(&c, fd),
    )?;
    linker.func_wrap(
        m,
        "sock_recv",
        |c: Caller<'_, T>, fd: i32, _: i32, _: i32, _: i32, _: i32, _: i32| sock_errno(&c, fd),
    )?;
    linker.func_wrap(
        m,
        "sock_send",
        |c: Caller<'_, T>, fd: i32, _: i32, _: i32, _: i32, _: i32| sock_errno(&c, fd),
    )?;
    linker.func_wrap(m, "sock_shutdown", |c: Caller<'_, T>, fd: i32, _: i32| {
        sock_errno(&c, fd)
    })?;
    // No file, directory or socket exists: EBADF whatever the arguments.
    macro_rules! badf {
        ($($name:literal: ($($t:ty),*);)*) => {$(
            linker.func_wrap(m, $name, |_: Caller<'_, T>, $(_: $t),*| -> i32 { EBADF })?;
        )*};
    }
    badf! {
        "fd_advise": (i32, i64, i64, i32);
        "fd_allocate": (i32, i64, i64);
        "fd_datasync": (i32);
        "fd_fdstat_set_flags": (i32, i32);
        "fd_fdstat_set_rights": (i32, i64, i64);
        "fd_filestat_set_size": (i32, i64);
        "fd_filestat_set_times": (i32, i64, i64, i32);
        "fd_prestat_get": (i32, i32);
        "fd_prestat_dir_name": (i32, i32, i32);
        "fd_readdir": (i32, i32, i32, i64, i32);
        "fd_renumber": (i32, i32);
        "fd_sync": (i32);
        "path_create_directory": (i32, i32, i32);
        "path_filestat_get": (i32, i32, i32, i32, i32);
        "path_filestat_set_times": (i32, i32, i32, i32, i64, i64, i32);
        "path_link": (i32, i32, i32, i32, i32, i32, i32);
        "path_open": (i32, i32, i32, i32, i32, i64, i64, i32, i32);
        "path_readlink": (i32, i32, i32, i32, i32, i32);
        "path_remove_directory": (i32, i32, i32);
        "path_rename": (i32, i32, i32, i32, i32, i32);
        "path_symlink": (i32, i32, i32, i32, i32);
        "path_unlink_file": (i32, i32, i32);
    }
    Ok(())
}
