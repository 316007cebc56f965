//! Small facts of the machine every layer may ask for: the wall clock in
//! Unix seconds, secure random bytes, the host name, the number of CPUs.
//! The bottom layer: it imports nothing of the crate.

#![forbid(unsafe_code)]

/// Unix seconds now.
pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// `N` bytes from the operating system's secure random source.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    use ring::rand::SecureRandom;
    let mut b = [0u8; N];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .expect("OS randomness");
    b
}

/// The machine's host name (the default node id).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "meshgate".into())
}

/// The CPUs this process may use (2 when unknown).
pub fn num_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
}

/// HMAC-SHA256.
pub fn hmac(key: &[u8], data: &[u8]) -> [u8; 32] {
    let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    ring::hmac::sign(&k, data)
        .as_ref()
        .try_into()
        .expect("32 bytes")
}

/// The monotonic time now: for a duration measured (metrics, logs), a
/// deadline of one call, or a heartbeat. State that ages and that tests must
/// move (caches, breakers, buffers) takes a [`Clock`] or is handed `now`.
/// The one place the crate reads `Instant::now` (clippy.toml bans it elsewhere).
pub fn mono_now() -> std::time::Instant {
    #[allow(clippy::disallowed_methods)]
    std::time::Instant::now()
}

/// A monotonic clock. State that ages (breakers, caches) reads time through
/// one, so a test moves time forward instead of sleeping.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> std::time::Instant;
}

/// The real clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> std::time::Instant {
        mono_now()
    }
}

/// A clock that moves only when told to (tests).
#[derive(Debug)]
pub struct ManualClock(parking_lot::Mutex<std::time::Instant>);

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock(parking_lot::Mutex::new(mono_now()))
    }
}

impl ManualClock {
    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: std::time::Duration) {
        *self.0.lock() += d;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> std::time::Instant {
        *self.0.lock()
    }
}

/// Year, month (1-12) and day (1-31) of a day counted from 1970-01-01, in
/// the proleptic Gregorian calendar (Howard Hinnant's `civil_from_days`).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month as u32, day as u32)
}

/// How much of a client's value an error message quotes back.
pub const QUOTED_BYTES: usize = 64;

/// A client's value for an error message: quoted and escaped, cut to
/// [`QUOTED_BYTES`] (on a character boundary) with the full length named, so
/// an answer is never a large multiple of what the client sent.
pub fn quoted(v: &str) -> String {
    if v.len() <= QUOTED_BYTES {
        return format!("{v:?}");
    }
    let mut end = QUOTED_BYTES;
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}… ({} bytes)", &v[..end], v.len())
}

#[cfg(test)]
mod quoted_tests {
    use super::*;

    #[test]
    fn a_long_value_is_quoted_cut_with_its_length() {
        assert_eq!(quoted("a\"b"), "\"a\\\"b\"");
        let long = "é".repeat(100);
        let q = quoted(&long);
        assert!(q.ends_with("… (200 bytes)"), "{q}");
        // 32 two-byte characters fit in 64 bytes, plus quotes.
        assert_eq!(q.chars().filter(|c| *c == 'é').count(), 32, "{q}");
        assert!(q.len() < 100, "{q}");
    }
}
