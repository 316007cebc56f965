//! The proxy's side of per-route observability (docs/deployments.md
//! "Observability"): the upstream attempts of the request being served,
//! noted by the proxy's one retry loop through a task-local and counted by `http::deploy_serve`, and, when
//! spans are exported, each attempt's CLIENT span (`crate::telemetry`) and
//! the `traceparent` it sends. The label caps, the activity ring and trace
//! context are `crate::observe`.

use crate::observe::Attempt;
use std::cell::RefCell;

/// Opens the attempt about to be made to the instance at `base`: with
/// spans exported, a CLIENT span under the request's SERVER span, whose id
/// the attempt sends as the `traceparent`'s parent id ([`traceparent`]).
/// Nothing outside [`recording`].
pub fn attempt_begins(base: &str) {
    if !crate::telemetry::enabled() {
        return;
    }
    let _ = RECORDING.try_with(|r| {
        let mut r = r.borrow_mut();
        r.hop = r.span.as_ref().map(|s| s.client_begins(base));
    });
}

/// Notes an attempt of the request being served (called by the proxy's
/// retry loop), and ends its CLIENT span; nothing outside [`recording`].
pub fn attempted(instance: &str, outcome: &'static str) {
    let _ = RECORDING.try_with(|r| {
        let mut r = r.borrow_mut();
        r.attempts.push((instance.to_string(), outcome));
        if r.hop.take().is_some()
            && let Some(s) = &r.span
        {
            s.client_ends(outcome);
        }
    });
}

/// The `traceparent` an attempt sends: the open CLIENT span as the parent
/// when spans are exported, else the node's span for the request.
pub fn traceparent(t: &crate::observe::trace::TraceContext) -> String {
    if !crate::telemetry::enabled() {
        return t.traceparent();
    }
    let hop = RECORDING.try_with(|r| r.borrow().hop).ok().flatten();
    match hop {
        Some(id) => t.traceparent_from(id),
        None => t.traceparent(),
    }
}

/// Runs `f`, returning its output and the upstream attempts made in it;
/// `span`: the request's SERVER span, when spans are exported.
pub async fn recording<F: std::future::Future>(
    span: Option<crate::telemetry::ServerSpan>,
    f: F,
) -> (F::Output, Vec<Attempt>) {
    let state = Recording {
        attempts: Vec::new(),
        span,
        hop: None,
    };
    RECORDING
        .scope(RefCell::new(state), async {
            let out = f.await;
            let attempts = RECORDING.with(|r| std::mem::take(&mut r.borrow_mut().attempts));
            (out, attempts)
        })
        .await
}

/// What [`recording`] keeps while its request is served.
struct Recording {
    attempts: Vec<Attempt>,
    span: Option<crate::telemetry::ServerSpan>,
    /// The open attempt's CLIENT span id.
    hop: Option<[u8; 8]>,
}

tokio::task_local! {
    static RECORDING: RefCell<Recording>;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attempts noted inside [`recording`] are returned; outside, ignored.
    #[actix_rt::test]
    async fn activity_attempts_are_recorded() {
        attempted("http://x:0", "answered");
        let ((), a) = recording(None, async {
            attempted("http://x:1", "connect_failed");
            attempted("http://x:2", "answered");
        })
        .await;
        assert_eq!(
            a,
            vec![
                ("http://x:1".to_string(), "connect_failed"),
                ("http://x:2".to_string(), "answered")
            ]
        );
    }
}
