//! The proxy's side of per-route observability (issue #40): the upstream
//! attempts of the request being served, noted by the proxy's one retry
//! loop through a task-local and counted by `http::deploy_serve`. The label
//! caps, the activity ring and trace context are `crate::observe`.

use crate::observe::Attempt;
use std::cell::RefCell;

/// The `outcome` label of one exchange with an instance.
pub fn outcome<T>(e: &super::h1::Exchange<T>) -> &'static str {
    use super::h1::{ConnectFailure, Exchange};
    match e {
        Exchange::Answered(_) => "answered",
        Exchange::NotConnected(ConnectFailure::Refused(_)) => "refused",
        Exchange::NotConnected(ConnectFailure::Failed(_)) => "connect_failed",
        Exchange::TimedOut => "timeout",
        Exchange::Failed(_) | Exchange::Ended(_) => "failed",
    }
}

/// Notes an attempt of the request being served (called by the proxy's
/// retry loop); nothing outside [`recording`].
pub fn attempted(instance: &str, outcome: &'static str) {
    let _ = ATTEMPTS.try_with(|a| a.borrow_mut().push((instance.to_string(), outcome)));
}

/// Runs `f`, returning its output and the upstream attempts made in it.
pub async fn recording<F: std::future::Future>(f: F) -> (F::Output, Vec<Attempt>) {
    ATTEMPTS
        .scope(RefCell::new(Vec::new()), async {
            let out = f.await;
            let attempts = ATTEMPTS.with(|a| a.take());
            (out, attempts)
        })
        .await
}

tokio::task_local! {
    static ATTEMPTS: RefCell<Vec<Attempt>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attempts noted inside [`recording`] are returned; outside, ignored.
    #[actix_rt::test]
    async fn activity_attempts_are_recorded() {
        attempted("http://x:0", "answered");
        let ((), a) = recording(async {
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
