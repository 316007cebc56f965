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

use super::error::ApiError;
use super::middleware::policy_of;
use super::policy::Policy;
use crate::config::Config;
use crate::error::Code;
use crate::http::state::Node;
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::Method;
use actix_web::http::header::{self, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{Error, HttpMessage, HttpResponse, web};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

pub use crate::identity::Identity;

/// The namespace a request acts on, set by domain routing or authorization.
#[derive(Debug, Clone)]
pub struct Target(pub String);

/// The client's address after the trusted-proxy rule.
#[derive(Debug, Clone, Copy)]
pub struct ClientIp(pub IpAddr);

mod access;
mod limits;
mod routing;

pub use limits::Limiters;
pub use routing::{RequestHost, Sni, request_host};

/// How a step ends a request before the handler.
pub(super) enum Early {
    /// Refused: the error's envelope answers.
    Refuse(ApiError),
    /// Answered by the step itself (a CORS preflight, the dashboard's sign-in redirect).
    Answer(HttpResponse),
}

impl From<ApiError> for Early {
    fn from(e: ApiError) -> Self {
        Early::Refuse(e)
    }
}

fn early<B>(req: ServiceRequest, e: Early) -> ServiceResponse<EitherBody<B>> {
    match e {
        Early::Refuse(err) => refuse(req, err),
        Early::Answer(resp) => req.into_response(resp).map_into_right_body(),
    }
}

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
        Ok(()) => crate::http::forward::cluster_forward(req, next).await?,
        Err(e) => early(req, e),
    };
    if let Some(origin) = origin {
        routing::cors_headers(res.headers_mut(), origin);
    }
    Ok(res)
}

/// The node, borrowed from the request's app data.
pub(super) fn node_ref(req: &ServiceRequest) -> &Node {
    req.app_data::<web::Data<Node>>()
        .expect("node data")
        .get_ref()
}

pub(super) fn refuse<B>(req: ServiceRequest, err: ApiError) -> ServiceResponse<EitherBody<B>> {
    req.into_response(err.error_response_owned())
        .map_into_right_body()
}

pub(super) type Res<B> = Result<ServiceResponse<EitherBody<B>>, Error>;
