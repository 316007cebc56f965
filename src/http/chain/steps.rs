//! Steps 5 to 11 of the request chain in one function, [`steps`], and the
//! hand-over to step 12 (`forward.rs`).

use super::context::{Early, Res, early, refuse};
use super::{access, limits, routing};
use crate::http::forward::cluster_forward;
use actix_web::body::MessageBody;
use actix_web::dev::ServiceRequest;
use actix_web::middleware::Next;

/// Steps 5 to 11, in order: the client rate limit, CORS, domain routing,
/// authentication, authorization, the scope gate, the namespace rate limit.
/// The first step that refuses or answers ends the request; an allowed
/// origin's CORS headers go on every answer after step 6, refusals included.
pub async fn steps<B: MessageBody + 'static>(req: ServiceRequest, next: Next<B>) -> Res<B> {
    if let Err(e) = limits::client_rate_limit(&req) {
        return Ok(refuse(req, e));
    }
    let origin = match routing::cors(&req) {
        Ok(o) => o,
        Err(e) => return Ok(early(req, e)),
    };
    let passed: Result<(), Early> = async {
        routing::domain_routing(&req)?;
        access::authentication(&req).await?;
        access::authorization(&req)?;
        access::scope_gate(&req)?;
        limits::namespace_rate_limit(&req).await?;
        Ok(())
    }
    .await;
    let mut res = match passed {
        // Step 12 in the same layer (one boxed future and one service hop
        // fewer per request): another member's namespace goes there, a
        // routed host to its deployment, the rest to the router.
        Ok(()) => cluster_forward(req, next).await?,
        Err(e) => early(req, e),
    };
    if let Some(origin) = origin {
        routing::cors_headers(res.headers_mut(), origin);
    }
    Ok(res)
}
