//! Step 0, admission: refuses new work while the node starts or drains,
//! counts the requests in flight (the drain waits for them) and records
//! the request metrics. The chain (`front.rs`) and the routed fast path
//! (`deploy_serve.rs`) both call these.

use crate::error::{ApiError, Code};
use crate::http::state::{Node, Phase};
use actix_web::HttpResponse;
use actix_web::http::StatusCode;

/// The refusal of a request that arrives while the node is not ready
/// (`None`: ready). Starting and draining are 503 with `Retry-After: 1`; a
/// draining node also closes the connection.
pub fn refusal(node: &Node) -> Option<HttpResponse> {
    match node.phase() {
        Phase::Ready => None,
        Phase::Starting => Some(
            ApiError::new(Code::Starting, "the node is starting")
                .retry_after(1)
                .error_response_owned(),
        ),
        Phase::Draining => {
            let mut res = ApiError::new(Code::Draining, "the node is draining")
                .retry_after(1)
                .error_response_owned();
            res.head_mut()
                .set_connection_type(actix_web::http::ConnectionType::Close);
            Some(res)
        }
    }
}

/// Counts a finished request and its duration by status class (admission's
/// metrics; the routed fast path records the same).
pub fn record_request(node: &Node, status: StatusCode, start: std::time::Instant) {
    let (count, duration) = node.metrics.http_class(status.as_u16());
    count.inc();
    duration.observe(start.elapsed().as_secs_f64());
}

/// One request in flight, counted until dropped (the drain waits for them).
/// It borrows the node's gauge: no reference count is touched per request.
pub struct InFlight<'a>(&'a prometheus::IntGauge);

impl InFlight<'_> {
    pub fn enter(node: &Node) -> InFlight<'_> {
        node.metrics.http_in_flight.inc();
        InFlight(&node.metrics.http_in_flight)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}
