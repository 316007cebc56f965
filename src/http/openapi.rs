//! The OpenAPI 3.1 document of the node's HTTP API (`GET /v1/openapi.json`),
//! made from the same route table the node serves: every registered route
//! with its method, path parameters, policy (as the security it takes and
//! `x-meshgate-policy`), the grant it needs (`x-meshgate-grants`), the
//! statuses its policy can answer, and the error envelope with every code of
//! the `codes!` table (`crate::error`). Nothing here is a second list of
//! routes: a route added to the table is in the document.
//!
//! Bodies are described by their media types; their fields are in
//! docs/api.md and in each refusal's message (`routes::form`).

use super::policy::{Policy, RouteTable};
use crate::error::Code;
use serde_json::{Map, Value, json};

/// The node's document as served, made once at start-up from the route
/// table the node registers (`http::serve`).
pub struct Document(pub actix_web::web::Bytes);

/// The OpenAPI path of an actix pattern: `{key:.+}` becomes `{key}`.
pub fn openapi_path(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len());
    let mut rest = pattern;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        let inner = &rest[open + 1..open + close];
        let name = inner.split(':').next().unwrap_or(inner);
        out.push('{');
        out.push_str(name);
        out.push('}');
        rest = &rest[open + close + 1..];
    }
    out.push_str(rest);
    out
}

/// The names of a pattern's path parameters, in order.
fn parameters(pattern: &str) -> Vec<String> {
    let path = openapi_path(pattern);
    path.split('/')
        .filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
        .map(str::to_string)
        .collect()
}

/// The error statuses a route of `policy` answers a request with, besides
/// its handler's own: what the chain and the body extractors refuse.
fn statuses(policy: &Policy, method: &actix_web::http::Method, path: &str) -> Vec<u16> {
    use actix_web::http::Method;
    // Every route: a bad query, path or body (400), a body past the limit
    // (413), the rate limits (429), the node starting or draining (503).
    let mut s = vec![400, 413, 429, 503];
    if matches!(*method, Method::POST | Method::PUT | Method::PATCH) {
        s.push(415);
    }
    match policy {
        Policy::Public => {}
        Policy::Credential => s.extend([401, 403]),
        Policy::Ns { .. } | Policy::NsCredential { .. } | Policy::NsOrAnonymous { .. } => {
            s.extend([401, 403, 404, 409])
        }
        Policy::Operator => s.extend([401, 403, 404, 409]),
        Policy::Internal => s.extend([401, 403]),
        Policy::Admin => s.extend([302, 303, 401, 403]),
        Policy::Deployment => s.extend([401, 403, 404, 502, 504]),
    }
    // The dashboard's pages send a browser on (to its sign-in page, or
    // back to the page after signing in or out).
    if path.starts_with("/__admin") {
        s.extend([302, 303]);
    }
    s.sort_unstable();
    s.dedup();
    s
}

/// The security requirement of a policy: which credentials it takes.
fn security(policy: &Policy) -> Value {
    match policy {
        Policy::Public | Policy::Credential | Policy::Deployment => json!([]),
        Policy::NsOrAnonymous { .. } => json!([{}, {"bearer": []}, {"apiKey": []}]),
        Policy::Ns { .. } | Policy::NsCredential { .. } => {
            json!([{"bearer": []}, {"apiKey": []}])
        }
        Policy::Operator => json!([{"operator": []}, {"operatorApiKey": []}]),
        Policy::Internal => json!([{"hopMac": []}]),
        Policy::Admin => json!([{"operator": []}, {"adminSession": []}]),
    }
}

/// A stable operation id: the method and the path's words.
fn operation_id(method: &str, path: &str) -> String {
    let mut id = method.to_ascii_lowercase();
    for word in path.split(|c: char| !c.is_ascii_alphanumeric()) {
        if word.is_empty() {
            continue;
        }
        id.push('_');
        id.push_str(&word.to_ascii_lowercase());
    }
    id
}

/// The error envelope's schema, with every code.
fn error_schema() -> Value {
    let codes: Vec<&str> = Code::ALL.iter().map(|c| c.as_str()).collect();
    let table: Map<String, Value> = Code::ALL
        .iter()
        .map(|c| {
            (
                c.as_str().to_string(),
                json!({"status": c.status().as_u16(), "retryable": c.retryable()}),
            )
        })
        .collect();
    json!({
        "type": "object",
        "required": ["ok", "error"],
        "properties": {
            "ok": {"const": false},
            "error": {
                "type": "object",
                "required": ["code", "message", "retryable"],
                "properties": {
                    "code": {"type": "string", "enum": codes},
                    "message": {"type": "string", "maxLength": crate::error::MAX_MESSAGE_BYTES + 3},
                    "retryable": {"type": "boolean"}
                }
            }
        },
        "x-meshgate-codes": table
    })
}

/// The document of `table`'s routes.
pub fn document(table: &RouteTable) -> Value {
    let mut paths: Map<String, Value> = Map::new();
    for (method, pattern, policy) in table.routes() {
        let Some(policy) = policy else { continue };
        let path = openapi_path(pattern);
        let m = method.as_str().to_ascii_lowercase();
        let mut responses = Map::new();
        let ok = match (method.as_str(), policy) {
            (_, Policy::Admin) => "Success (the dashboard's page, asset or data).",
            ("POST", _) => "Success: created or done.",
            _ => "Success.",
        };
        responses.insert(
            "200".into(),
            json!({"description": ok, "content": {"application/json": {"schema": {"type": "object"}}}}),
        );
        if path == "/v1/ws" || path == "/v1/pubsub/ws" {
            responses.insert(
                "101".into(),
                json!({"description": "Switching to the WebSocket protocol."}),
            );
        }
        for status in statuses(policy, method, &path) {
            let description = match status {
                302 | 303 => "To the dashboard's sign-in page.",
                _ => "The error envelope; its code names the refusal.",
            };
            let mut r = json!({"description": description});
            if status >= 400 {
                r["content"] =
                    json!({"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}});
            }
            responses.insert(status.to_string(), r);
        }
        responses.insert(
            "default".into(),
            json!({"description": "The error envelope.",
                   "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}),
        );
        let params: Vec<Value> = parameters(pattern)
            .into_iter()
            .map(|name| json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}}))
            .collect();
        let mut op = json!({
            "operationId": operation_id(&m, &path),
            "security": security(policy),
            "responses": responses,
            "x-meshgate-policy": policy.name(),
        });
        if let Some((domain, action)) = policy.grant() {
            let grants: Vec<String> = if domain.is_empty() {
                Vec::new()
            } else {
                vec![format!("{domain}:{action}")]
            };
            op["x-meshgate-grants"] = json!(grants);
        }
        if !params.is_empty() {
            op["parameters"] = json!(params);
        }
        if matches!(m.as_str(), "post" | "put" | "patch") {
            op["requestBody"] = json!({
                "required": false,
                "description": "JSON unless the route takes a file (multipart/form-data) or raw bytes; docs/api.md names each body's fields, and a refusal names what the route takes.",
                "content": {
                    "application/json": {"schema": {"type": "object"}},
                    "multipart/form-data": {"schema": {"type": "object"}},
                    "application/octet-stream": {"schema": {"type": "string", "contentMediaType": "application/octet-stream"}}
                }
            });
        }
        let item = paths
            .entry(path)
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(item) = item {
            item.insert(m, op);
        }
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "meshgate",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "The HTTP API of a meshgate node: namespaces, keys and tokens, KV, functions, pub/sub, deployments, the dashboard. Every error is the envelope of components.schemas.Error; `x-meshgate-grants` names the grant a credential needs."
        },
        "paths": paths,
        "components": {
            "schemas": {"Error": error_schema()},
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "A namespace's JWT or API key."},
                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key", "description": "A namespace's API key."},
                "operator": {"type": "http", "scheme": "bearer", "description": "The operator key."},
                "operatorApiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key", "description": "The operator key."},
                "adminSession": {"type": "apiKey", "in": "cookie", "name": crate::http::dashboard::session::COOKIE, "description": "The dashboard's session, from its sign-in page."},
                "hopMac": {"type": "apiKey", "in": "header", "name": crate::auth::HOP_MAC_HEADER, "description": "Cluster peers only: the hop MAC over the x-internal-auth-* headers."}
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_become_openapi_paths() {
        assert_eq!(openapi_path("/v1/kv/{key:.+}"), "/v1/kv/{key}");
        assert_eq!(
            openapi_path("/v1/invoke/{namespace}/{name}"),
            "/v1/invoke/{namespace}/{name}"
        );
        assert_eq!(
            parameters("/v1/invoke/{namespace}/{name}"),
            ["namespace", "name"]
        );
        assert_eq!(operation_id("get", "/v1/kv/{key}"), "get_v1_kv_key");
    }
}
