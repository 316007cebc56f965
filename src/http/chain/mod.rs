//! Steps 5 to 11 of the request chain (docs/design.md §2), by concern:
//! `limits` (the client and namespace rate limits and their buckets),
//! `routing` (CORS, the request's host, domain routing) and `access`
//! (authentication, authorization, the scope gate).
//!
//! The seven steps run in order in one middleware, [`steps`]: each is a
//! function of the request that lets it on, or ends it with a refusal or an
//! answer. (They were seven nested middlewares; one layer instead of seven
//! saves a boxed future, a service call and their moves per step on every
//! request, with the order and every answer unchanged.)

//!
//! Its files, bottom up: `context` (what the steps put on a request and read
//! from it: the types the route handlers read too), `credentials` (the
//! credential caches the node holds), `admission` and `logger` (steps 0 and
//! 3's parts), `limits`, `routing` and `access` (steps 5 to 11), then this
//! file, which runs them and hands the request to step 12 (`forward.rs`).
//! Steps 0 to 4 run in one layer in `middleware.rs`, which calls [`steps`].
//! Each file imports from the file that defines what it uses, never from
//! this one.

use crate::http::forward::cluster_forward;
use actix_web::body::MessageBody;
use actix_web::dev::ServiceRequest;
use actix_web::middleware::Next;
use context::{Early, Res, early, refuse};

pub(crate) mod access;
pub(crate) mod admission;
pub(crate) mod context;
pub(crate) mod credentials;
pub(crate) mod limits;
pub(crate) mod logger;
pub(crate) mod routing;

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
