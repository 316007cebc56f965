//! The request log (docs/design.md §2, step 3): one line per request with its
//! method, path, request id, status and duration.
//!
//! Written by hand rather than through `tracing`'s formatter: the formatter
//! costs about 15% of a KV read's CPU (a span per request, entered on every
//! poll, its fields formatted into a fresh string, then the event formatted
//! field by field with a timestamp built from scratch). Here the line is
//! built in one buffer with the timestamp's second cached per thread, and
//! handed to the node's log writer thread. The filter is still `RUST_LOG`'s:
//! the line is written only when `tracing` would write an event of target
//! `meshgate::access` at its level (INFO, WARN for a 5xx). The text and JSON
//! shapes are those of the rest of the log (docs/decisions.md "The request
//! log"). When no writer is installed (the node run inside a test) the line
//! goes through `tracing` like any event.

use actix_web::http::Method;
use std::cell::RefCell;
use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Where finished lines go, and in which shape.
struct Writer {
    json: bool,
    write: Box<dyn Fn(&[u8]) + Send + Sync>,
}

static WRITER: OnceLock<Writer> = OnceLock::new();

/// Installs the log writer (once, at start-up; later calls are ignored).
pub fn install(json: bool, write: impl Fn(&[u8]) + Send + Sync + 'static) {
    let _ = WRITER.set(Writer {
        json,
        write: Box::new(write),
    });
}

/// What the line needs from the request, taken before the request moves on.
pub struct Entry {
    method: Method,
    path: String,
    start: Instant,
    /// The request's W3C trace id, in hex (the line's `trace_id`).
    trace_id: Option<[u8; 32]>,
}

impl Entry {
    /// `start` is when the request came in (the caller has read the clock
    /// already, for the request metrics).
    /// The path is given to [`Entry::finish`] (the request still holds it):
    /// a line the filter drops copies nothing.
    pub fn begin(method: &Method, start: Instant) -> Entry {
        Entry {
            method: method.clone(),
            path: String::new(),
            start,
            trace_id: None,
        }
    }

    /// The request's trace context: its trace id goes on the line.
    pub fn trace(mut self, t: &crate::observe::trace::TraceContext) -> Entry {
        let mut hex = [0u8; 32];
        if hex::encode_to_slice(t.trace_id, &mut hex).is_ok() {
            self.trace_id = Some(hex);
        }
        self
    }

    fn trace_str(&self) -> &str {
        self.trace_id
            .as_ref()
            .and_then(|h| std::str::from_utf8(h).ok())
            .unwrap_or("")
    }

    /// Writes the request's line (for `path`, the request's) if the filter
    /// lets it through.
    pub fn finish(mut self, status: u16, request_id: &str, path: &str) {
        let failed = status >= 500;
        let enabled = if failed {
            tracing::enabled!(target: "meshgate::access", tracing::Level::WARN)
        } else {
            tracing::enabled!(target: "meshgate::access", tracing::Level::INFO)
        };
        if !enabled {
            return;
        }
        let micros = self.start.elapsed().as_micros() as u64;
        path.clone_into(&mut self.path);
        let Some(w) = WRITER.get() else {
            let ms = micros as f64 / 1000.0;
            let (m, p, id) = (self.method.as_str(), self.path.as_str(), request_id);
            let trace_id = self.trace_str();
            if failed {
                tracing::warn!(target: "meshgate::access", method = m, path = p, request_id = id, trace_id, status, duration_ms = ms, "Request failed.");
            } else {
                tracing::info!(target: "meshgate::access", method = m, path = p, request_id = id, trace_id, status, duration_ms = ms, "Request served.");
            }
            return;
        };
        LINE.with_borrow_mut(|line| {
            line.stamp(SystemTime::now());
            let Line { buf, stamp, .. } = line;
            buf.clear();
            if w.json {
                json_line(buf, stamp, &self, request_id, status, micros);
            } else {
                text_line(buf, stamp, &self, request_id, status, micros);
            }
            (w.write)(buf);
        });
    }
}

/// The level and message of a request's line: a 5xx is a failure, at WARN.
fn level(status: u16) -> (&'static str, &'static str) {
    if status >= 500 {
        ("WARN", "Request failed.")
    } else {
        ("INFO", "Request served.")
    }
}

/// A thread's line buffer and its cached timestamp.
struct Line {
    buf: Vec<u8>,
    /// `YYYY-MM-DDTHH:MM:SS.ffffffZ` of the last line.
    stamp: [u8; 27],
    /// The Unix second `stamp`'s first 19 bytes are for.
    second: u64,
}

thread_local! {
    static LINE: RefCell<Line> = const {
        RefCell::new(Line { buf: Vec::new(), stamp: [0; 27], second: u64::MAX })
    };
}

impl Line {
    /// Sets `stamp` to `now`, reformatting the date and time only when the
    /// second changed.
    fn stamp(&mut self, now: SystemTime) {
        let d = now.duration_since(UNIX_EPOCH).unwrap_or_default();
        let secs = d.as_secs();
        if secs != self.second {
            self.second = secs;
            self.stamp[..19].copy_from_slice(&civil(secs));
            self.stamp[19] = b'.';
            self.stamp[26] = b'Z';
        }
        let mut us = d.subsec_micros();
        for i in (20..26).rev() {
            self.stamp[i] = b'0' + (us % 10) as u8;
            us /= 10;
        }
    }
}

/// `YYYY-MM-DDTHH:MM:SS` of a Unix second, in UTC.
fn civil(secs: u64) -> [u8; 19] {
    let (year, month, day) = crate::util::civil_from_days((secs / 86_400) as i64);
    let sod = secs % 86_400;
    let mut out = *b"0000-00-00T00:00:00";
    let mut put = |at: usize, width: usize, mut v: u64| {
        for i in (at..at + width).rev() {
            out[i] = b'0' + (v % 10) as u8;
            v /= 10;
        }
    };
    put(0, 4, year.clamp(0, 9999) as u64);
    put(5, 2, u64::from(month));
    put(8, 2, u64::from(day));
    put(11, 2, sod / 3600);
    put(14, 2, sod / 60 % 60);
    put(17, 2, sod % 60);
    out
}

/// `1.234` from microseconds: the duration in milliseconds, three decimals.
fn put_ms(buf: &mut Vec<u8>, micros: u64) {
    use std::io::Write;
    let _ = write!(buf, "{}.{:03}", micros / 1000, micros % 1000);
}

/// The path as the log shows it in text: as sent when it is printable ASCII
/// (nearly always: the parser admits little else), escaped otherwise, so a
/// line cannot be split or forged by what a client sends.
fn put_text(buf: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b.is_ascii_graphic()) {
        buf.extend_from_slice(s.as_bytes());
    } else {
        use std::io::Write;
        let _ = write!(buf, "{}", s.escape_debug());
    }
}

/// The shape of `tracing`'s full text format:
/// `<time>  INFO request{method=GET path=/x request_id=…}: meshgate::access: Request served. status=200 duration_ms=0.123`
fn text_line(buf: &mut Vec<u8>, stamp: &[u8; 27], e: &Entry, id: &str, status: u16, micros: u64) {
    let (level, message) = level(status);
    buf.extend_from_slice(stamp);
    buf.extend_from_slice(b"  ");
    buf.extend_from_slice(level.as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(b"request{method=");
    buf.extend_from_slice(e.method.as_str().as_bytes());
    buf.extend_from_slice(b" path=");
    put_text(buf, &e.path);
    buf.extend_from_slice(b" request_id=");
    put_text(buf, id);
    if e.trace_id.is_some() {
        buf.extend_from_slice(b" trace_id=");
        buf.extend_from_slice(e.trace_str().as_bytes());
    }
    buf.extend_from_slice(b"}: meshgate::access: ");
    buf.extend_from_slice(message.as_bytes());
    buf.extend_from_slice(b" status=");
    put_u16(buf, status);
    buf.extend_from_slice(b" duration_ms=");
    put_ms(buf, micros);
    buf.push(b'\n');
}

/// The shape of `tracing`'s JSON format, one object per line.
fn json_line(buf: &mut Vec<u8>, stamp: &[u8; 27], e: &Entry, id: &str, status: u16, micros: u64) {
    let (level, message) = level(status);
    let str_ = |buf: &mut Vec<u8>, s: &str| {
        // Writing a string into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *buf, s);
    };
    buf.extend_from_slice(b"{\"timestamp\":\"");
    buf.extend_from_slice(stamp);
    buf.extend_from_slice(b"\",\"level\":\"");
    buf.extend_from_slice(level.as_bytes());
    buf.extend_from_slice(b"\",\"fields\":{\"message\":\"");
    buf.extend_from_slice(message.as_bytes());
    buf.extend_from_slice(b"\",\"status\":");
    put_u16(buf, status);
    buf.extend_from_slice(b",\"duration_ms\":");
    put_ms(buf, micros);
    buf.extend_from_slice(b"},\"target\":\"meshgate::access\",\"span\":{\"method\":");
    str_(buf, e.method.as_str());
    buf.extend_from_slice(b",\"path\":");
    str_(buf, &e.path);
    buf.extend_from_slice(b",\"request_id\":");
    str_(buf, id);
    if e.trace_id.is_some() {
        buf.extend_from_slice(b",\"trace_id\":\"");
        buf.extend_from_slice(e.trace_str().as_bytes());
        buf.push(b'"');
    }
    buf.extend_from_slice(b",\"name\":\"request\"}}\n");
}

fn put_u16(buf: &mut Vec<u8>, n: u16) {
    use std::io::Write;
    let _ = write!(buf, "{n}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn civil_dates_match_known_instants() {
        assert_eq!(&civil(0), b"1970-01-01T00:00:00");
        // 2000-02-29 (a leap day of a century leap year) 12:34:56.
        assert_eq!(&civil(951_827_696), b"2000-02-29T12:34:56");
        assert_eq!(&civil(1_796_299_199), b"2026-12-03T11:59:59");
        assert_eq!(&civil(1_796_299_200), b"2026-12-03T12:00:00");
        // The last second of a non-leap year, then the new year.
        assert_eq!(&civil(1_735_689_599), b"2024-12-31T23:59:59");
        assert_eq!(&civil(1_735_689_600), b"2025-01-01T00:00:00");
    }

    #[test]
    fn the_stamp_carries_microseconds_and_follows_the_second() {
        let mut l = Line {
            buf: Vec::new(),
            stamp: [0; 27],
            second: u64::MAX,
        };
        l.stamp(UNIX_EPOCH + Duration::from_micros(1_796_299_199_000_042));
        assert_eq!(&l.stamp, b"2026-12-03T11:59:59.000042Z");
        l.stamp(UNIX_EPOCH + Duration::from_micros(1_796_299_200_123_456));
        assert_eq!(&l.stamp, b"2026-12-03T12:00:00.123456Z");
    }

    fn entry(path: &str) -> Entry {
        Entry {
            method: Method::GET,
            path: path.into(),
            start: crate::util::mono_now(),
            trace_id: None,
        }
    }

    /// A line of a request with a trace context carries its trace id (text and JSON).
    #[test]
    fn lines_carry_the_trace_id() {
        let stamp = *b"2026-12-03T00:00:00.123456Z";
        let t = crate::observe::trace::TraceContext::fresh();
        let e = entry("/x").trace(&t);
        let mut buf = Vec::new();
        text_line(&mut buf, &stamp, &e, "abc", 200, 1);
        let line = String::from_utf8(buf).unwrap();
        assert!(
            line.contains(&format!("request_id=abc trace_id={}}}", t.trace_id_hex())),
            "{line}"
        );
        let mut buf = Vec::new();
        json_line(&mut buf, &stamp, &e, "abc", 200, 1);
        let v: serde_json::Value = serde_json::from_slice(&buf).unwrap();
        assert_eq!(v["span"]["trace_id"], t.trace_id_hex());
    }

    #[test]
    fn text_lines_have_every_field_and_escape_what_could_forge_a_line() {
        let stamp = *b"2026-12-03T00:00:00.123456Z";
        let mut buf = Vec::new();
        text_line(&mut buf, &stamp, &entry("/v1/kv/k"), "abc", 200, 1234);
        assert_eq!(
            String::from_utf8(buf).unwrap(),
            "2026-12-03T00:00:00.123456Z  INFO request{method=GET path=/v1/kv/k request_id=abc}: meshgate::access: Request served. status=200 duration_ms=1.234\n"
        );
        let mut buf = Vec::new();
        text_line(&mut buf, &stamp, &entry("/a\nb"), "x", 502, 7);
        let s = String::from_utf8(buf).unwrap();
        assert_eq!(s.matches('\n').count(), 1, "{s}");
        assert!(
            s.contains("path=/a\\nb ")
                && s.contains("  WARN ")
                && s.ends_with("duration_ms=0.007\n"),
            "{s}"
        );
    }

    #[test]
    fn json_lines_parse_and_carry_every_field() {
        let stamp = *b"2026-12-03T00:00:00.123456Z";
        let mut buf = Vec::new();
        json_line(&mut buf, &stamp, &entry("/q\"\\\u{1}"), "id1", 404, 12_345);
        assert_eq!(buf.iter().filter(|b| **b == b'\n').count(), 1);
        let v: serde_json::Value = serde_json::from_slice(&buf).unwrap();
        assert_eq!(v["timestamp"], "2026-12-03T00:00:00.123456Z");
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["target"], "meshgate::access");
        assert_eq!(v["fields"]["message"], "Request served.");
        assert_eq!(v["fields"]["status"], 404);
        assert_eq!(v["fields"]["duration_ms"], 12.345);
        assert_eq!(v["span"]["method"], "GET");
        assert_eq!(v["span"]["path"], "/q\"\\\u{1}");
        assert_eq!(v["span"]["request_id"], "id1");
    }
}
