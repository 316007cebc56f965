//! Circuit breakers, one per (namespace, member) (docs/design.md §6). A breaker
//! opens after `threshold` consecutive failures of the member itself, then
//! admits one probe every `probe_every`; the first success closes it.

use crate::util::{Clock, SystemClock};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a breaker lets through now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Closed: go ahead.
    Yes,
    /// Open, and this request is its probe.
    Probe,
    /// Open: skip this member.
    No,
}

#[derive(Debug, Clone, Copy)]
enum State {
    Closed { failures: u32 },
    Open { since: Instant, last_probe: Instant },
}

/// The breakers of one namespace's members, owned by its supervisor.
#[derive(Debug)]
pub struct Breakers {
    /// Consecutive failures of a member that open its breaker.
    threshold: u32,
    /// How often an open breaker lets one probe through.
    probe_every: Duration,
    /// Each member's state; a member never seen is closed.
    members: Mutex<BTreeMap<String, State>>,
    /// Where time comes from ([`SystemClock`] but in tests).
    clock: Arc<dyn Clock>,
}

/// A breaker as shown in `/v1/status`.
#[derive(Debug, Clone, serde::Serialize, PartialEq, Eq)]
pub struct BreakerView {
    /// The member node (its id) this namespace forwards to that the breaker guards.
    pub member: String,
    /// `closed` or `open`.
    pub state: &'static str,
    /// Failed forwards in a row (the threshold once open); a success resets it.
    pub consecutive_failures: u32,
    /// How long the breaker has been open; None while closed.
    pub open_for_seconds: Option<u64>,
    /// Seconds until an open breaker lets its next probe through (0: the
    /// next forward is one); None while closed.
    pub next_probe_seconds: Option<u64>,
}

impl Breakers {
    pub fn new(threshold: u32, probe_every: Duration) -> Breakers {
        Self::with_clock(threshold, probe_every, Arc::new(SystemClock))
    }

    /// Breakers reading time from `clock`.
    pub fn with_clock(threshold: u32, probe_every: Duration, clock: Arc<dyn Clock>) -> Breakers {
        Breakers {
            threshold: threshold.max(1),
            probe_every,
            members: Mutex::new(BTreeMap::new()),
            clock,
        }
    }

    /// Whether a request may go to `member` now (an open breaker admits one
    /// probe per interval).
    pub fn admit(&self, member: &str) -> Admit {
        let mut m = self.members.lock();
        match m.get_mut(member) {
            None | Some(State::Closed { .. }) => Admit::Yes,
            Some(State::Open { last_probe, .. }) => {
                let now = self.clock.now();
                if now.duration_since(*last_probe) >= self.probe_every {
                    *last_probe = now;
                    Admit::Probe
                } else {
                    Admit::No
                }
            }
        }
    }

    /// A success closes the breaker.
    pub fn success(&self, member: &str) {
        let mut m = self.members.lock();
        if let Some(State::Open { .. }) = m.get(member) {
            tracing::info!(member, "Breaker closed: the member answered.");
        }
        m.insert(member.to_string(), State::Closed { failures: 0 });
    }

    /// A failure of the member itself; returns true when it opened the breaker.
    pub fn failure(&self, member: &str) -> bool {
        let mut m = self.members.lock();
        let now = self.clock.now();
        let next = match m.get(member).copied() {
            None => State::Closed { failures: 1 },
            Some(State::Closed { failures }) => State::Closed {
                failures: failures + 1,
            },
            // A failed probe: stays open, next probe one interval later.
            Some(State::Open { since, .. }) => State::Open {
                since,
                last_probe: now,
            },
        };
        let next = match next {
            State::Closed { failures } if failures >= self.threshold => {
                tracing::warn!(
                    member,
                    failures,
                    "Breaker opened: the member keeps failing."
                );
                State::Open {
                    since: now,
                    last_probe: now,
                }
            }
            s => s,
        };
        let opened = matches!(
            (m.get(member), next),
            (None | Some(State::Closed { .. }), State::Open { .. })
        );
        m.insert(member.to_string(), next);
        opened
    }

    pub fn is_open(&self, member: &str) -> bool {
        matches!(self.members.lock().get(member), Some(State::Open { .. }))
    }

    pub fn snapshot(&self) -> Vec<BreakerView> {
        let now = self.clock.now();
        self.members
            .lock()
            .iter()
            .map(|(member, s)| match s {
                State::Closed { failures } => BreakerView {
                    member: member.clone(),
                    state: "closed",
                    consecutive_failures: *failures,
                    open_for_seconds: None,
                    next_probe_seconds: None,
                },
                State::Open { since, last_probe } => BreakerView {
                    member: member.clone(),
                    state: "open",
                    consecutive_failures: self.threshold,
                    open_for_seconds: Some(now.duration_since(*since).as_secs()),
                    next_probe_seconds: Some(
                        self.probe_every
                            .saturating_sub(now.duration_since(*last_probe))
                            .as_secs_f64()
                            .ceil() as u64,
                    ),
                },
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens on the fifth consecutive failure, not before; a success in between resets.
    #[test]
    fn opens_after_threshold_consecutive_failures() {
        let b = Breakers::new(5, Duration::from_secs(60));
        for _ in 0..4 {
            assert!(!b.failure("m"));
        }
        b.success("m");
        for _ in 0..4 {
            assert!(!b.failure("m"));
            assert_eq!(b.admit("m"), Admit::Yes);
        }
        assert!(b.failure("m"));
        assert!(b.is_open("m"));
        assert_eq!(b.admit("m"), Admit::No);
        assert_eq!(b.admit("other"), Admit::Yes);
        assert_eq!(b.snapshot()[0].state, "open");
    }

    /// An open breaker admits one probe per interval; a failed probe keeps it
    /// open, a successful one closes it.
    #[test]
    fn probes_then_closes() {
        let clock = Arc::new(crate::util::ManualClock::default());
        let b = Breakers::with_clock(1, Duration::from_secs(5), clock.clone());
        assert!(b.failure("m"));
        assert_eq!(b.admit("m"), Admit::No);
        clock.advance(Duration::from_secs(4));
        assert_eq!(b.admit("m"), Admit::No, "not before the interval");
        clock.advance(Duration::from_secs(1));
        assert_eq!(b.admit("m"), Admit::Probe);
        assert_eq!(b.admit("m"), Admit::No, "one probe per interval");
        assert!(!b.failure("m"), "a failed probe does not re-open");
        assert!(b.is_open("m"));
        assert_eq!(b.snapshot()[0].open_for_seconds, Some(5));
        clock.advance(Duration::from_secs(5));
        assert_eq!(b.admit("m"), Admit::Probe);
        b.success("m");
        assert!(!b.is_open("m"));
        assert_eq!(b.admit("m"), Admit::Yes);
    }
}
