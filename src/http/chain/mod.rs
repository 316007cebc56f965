//! Steps 5 to 11 of the request chain (docs/design.md §2), by concern:
//! `limits` (the client and namespace rate limits and their buckets),
//! `routing` (CORS, the request's host, domain routing) and `access`
//! (authentication, authorization, the scope gate).

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

pub use access::{authentication, authorization, scope_gate};
pub use limits::{Limiters, client_rate_limit, namespace_rate_limit};
pub use routing::{RequestHost, Sni, cors, domain_routing, request_host};

pub(super) fn node(req: &ServiceRequest) -> Node {
    req.app_data::<web::Data<Node>>()
        .expect("node data")
        .get_ref()
        .clone()
}

pub(super) fn refuse<B>(req: ServiceRequest, err: ApiError) -> ServiceResponse<EitherBody<B>> {
    req.into_response(err.error_response_owned())
        .map_into_right_body()
}

pub(super) type Res<B> = Result<ServiceResponse<EitherBody<B>>, Error>;
