//! `GET /v1/namespaces/{namespace}/stats`: one namespace's numbers on this
//! node, for the operator or the namespace's own credential: its actors,
//! pub/sub and functions (`stats`) and its deployments' routes
//! (`deployments`: requests by status class, latency, upstream attempts).
//! `/metrics` exports per-namespace series only for the most active
//! namespaces (`[metrics] namespace_series_limit`) and only to the
//! operator; this route answers for any one, to its own callers.

use crate::error::Code;
use crate::error::{ApiError, ApiResult};
use crate::http::chain::context::Target;
use crate::http::policy::{Policy, RouteTable};
use crate::http::state::Node;
use crate::storage::OrderedKv;
use actix_web::http::Method;
use actix_web::{HttpMessage, HttpRequest, HttpResponse, web};
use serde_json::json;

/// Adds the route and its policy to the node's route table.
pub fn register(t: &mut RouteTable) {
    t.add(
        Method::GET,
        "/v1/namespaces/{namespace}/stats",
        Policy::ns("namespace", "read"),
        web::get().to(stats),
    );
}

/// The namespace's totals since this node started, read from the metrics
/// registry. Reading starts no supervisor and creates no series.
async fn stats(
    req: HttpRequest,
    node: web::Data<Node>,
    name: web::Path<String>,
) -> ApiResult<HttpResponse> {
    // The chain made the path's namespace the target and checked the
    // credential against it; a mismatch here would be a routing defect.
    let target = req.extensions().get::<Target>().map(|t| t.0.clone());
    if target.as_deref() != Some(name.as_str()) {
        return Err(ApiError::new(
            Code::NamespaceMismatch,
            "the credential belongs to another namespace",
        ));
    }
    if node
        .store
        .get(&crate::namespace::ns_key(&name))
        .await?
        .is_none()
    {
        return Err(ApiError::new(
            Code::NamespaceNotFound,
            format!("no namespace {name:?}"),
        ));
    }
    let stats = node.metrics.namespace_stats(&name);
    // Its deployments' routes, from its own series only: a tenant's view
    // of what `/metrics` (the operator's) holds for its routes.
    let deployments = node.metrics.deployment_stats(&name);
    Ok(HttpResponse::Ok().json(json!({
        "namespace": *name,
        "running": node.namespaces.get(&name).is_some(),
        "stats": stats,
        "deployments": deployments,
    })))
}
