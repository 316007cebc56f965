//! Route policies (docs/design.md §2 step 2, §10). Every route is registered through
//! [`RouteTable::add`] with its policy; the policy step puts the matched route's
//! policy on the request, and later steps read the policy, never the path. A
//! resource registered without a policy makes startup fail.

use crate::error::Code;
use actix_web::http::Method;
use actix_web::{HttpResponse, Resource, web};
use std::collections::HashMap;

/// Who may call a route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Policy {
    /// No credential needed.
    Public,
    /// Credential endpoints: no credential needed, the tight rate bucket applies.
    Credential,
    /// A credential of the target namespace holding a grant for `domain:action`.
    Ns {
        /// The grant's domain (`kv`, `pubsub`, `functions`, ...); empty: any
        /// credential of the namespace will do.
        domain: &'static str,
        /// The grant's action (`read`, `write`, `publish`, ...).
        action: &'static str,
    },
    /// Like `Ns`, but anonymous callers are let through to the handler, which
    /// decides (a public function needs no credential).
    NsOrAnonymous {
        /// As in `Ns`.
        domain: &'static str,
        /// As in `Ns`.
        action: &'static str,
    },
    /// Like `Ns`, but in the tight credential rate bucket (API key creation).
    NsCredential {
        /// As in `Ns`.
        domain: &'static str,
        /// As in `Ns`.
        action: &'static str,
    },
    /// The operator key.
    Operator,
    /// Cluster peers with a valid hop MAC.
    Internal,
    /// The dashboard: the operator key or its session cookie, from every address.
    Admin,
    /// A request to a host routed to a deployment: no credential is read (the
    /// Authorization header belongs to the upstream), the deployment's namespace
    /// bucket applies, and the deployment answers instead of the router.
    Deployment,
}

impl Policy {
    /// [`Policy::Ns`] in one call, for route tables.
    pub const fn ns(domain: &'static str, action: &'static str) -> Policy {
        Policy::Ns { domain, action }
    }
    /// The grant an `ns` route needs (`None` for other policies; an empty domain needs none).
    pub fn grant(&self) -> Option<(&'static str, &'static str)> {
        match *self {
            Policy::Ns { domain, action }
            | Policy::NsOrAnonymous { domain, action }
            | Policy::NsCredential { domain, action } => Some((domain, action)),
            _ => None,
        }
    }
    /// The policy's name as shown in logs and docs.
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Public => "public",
            Policy::Credential => "credential",
            Policy::Ns { .. } | Policy::NsOrAnonymous { .. } | Policy::NsCredential { .. } => "ns",
            Policy::Operator => "operator",
            Policy::Internal => "internal",
            Policy::Admin => "admin",
            Policy::Deployment => "deployment",
        }
    }
}

/// One registered route.
struct Entry {
    /// The method it answers (HEAD is served by GET).
    method: Method,
    /// The actix path pattern (`/v1/kv/{key}`), also the policy map's key.
    path: &'static str,
    /// None only through [`RouteTable::add_unguarded`]: `build` then fails.
    policy: Option<Policy>,
    /// The handler.
    route: actix_web::Route,
}

/// Routes with their policies, turned into actix resources and a policy map.
#[derive(Default)]
pub struct RouteTable {
    /// In registration order.
    entries: Vec<Entry>,
}

/// Policies by (method, route pattern), read by the policy middleware.
#[derive(Default, Clone)]
pub struct PolicyMap(HashMap<&'static str, Vec<(Method, Policy)>>);

impl PolicyMap {
    /// The policy of `method` on the route `pattern` (HEAD looks up GET).
    pub fn get(&self, method: &Method, pattern: &str) -> Option<&Policy> {
        // HEAD is answered by the GET route.
        let method = if method == Method::HEAD {
            &Method::GET
        } else {
            method
        };
        self.0
            .get(pattern)?
            .iter()
            .find(|(m, _)| m == method)
            .map(|(_, p)| p)
    }
}

/// A route registered without a policy.
#[derive(Debug, thiserror::Error)]
#[error("route {method} {path} has no policy")]
pub struct MissingPolicy {
    /// The route's method.
    pub method: Method,
    /// The route's path pattern.
    pub path: &'static str,
}

impl RouteTable {
    /// Registers a route with its policy.
    pub fn add(
        &mut self,
        method: Method,
        path: &'static str,
        policy: Policy,
        route: actix_web::Route,
    ) -> &mut Self {
        self.entries.push(Entry {
            method,
            path,
            policy: Some(policy),
            route,
        });
        self
    }

    /// Registers a route without a policy; only for showing that startup refuses it.
    pub fn add_unguarded(
        &mut self,
        method: Method,
        path: &'static str,
        route: actix_web::Route,
    ) -> &mut Self {
        self.entries.push(Entry {
            method,
            path,
            policy: None,
            route,
        });
        self
    }

    /// Checks every route has a policy and builds the resources (one per path, the
    /// methods as its routes) and the policy map.
    pub fn build(self) -> Result<(Vec<Resource>, PolicyMap), MissingPolicy> {
        let mut map: HashMap<&'static str, Vec<(Method, Policy)>> = HashMap::new();
        let mut by_path: Vec<(&'static str, Vec<(Method, actix_web::Route)>)> = Vec::new();
        for e in self.entries {
            let Some(policy) = e.policy else {
                return Err(MissingPolicy {
                    method: e.method,
                    path: e.path,
                });
            };
            map.entry(e.path)
                .or_default()
                .push((e.method.clone(), policy));
            match by_path.iter_mut().find(|(p, _)| *p == e.path) {
                Some((_, routes)) => routes.push((e.method, e.route)),
                None => by_path.push((e.path, vec![(e.method, e.route)])),
            }
        }
        let resources = by_path
            .into_iter()
            .map(|(path, routes)| {
                let mut r = web::resource(path);
                for (method, route) in routes {
                    r = r.route(route.method(method));
                }
                r.default_service(web::to(method_not_allowed))
            })
            .collect();
        Ok((resources, PolicyMap(map)))
    }
}

async fn method_not_allowed() -> HttpResponse {
    super::error::ApiError::new(
        Code::MethodNotAllowed,
        "this route does not take that method",
    )
    .error_response_owned()
}

impl super::error::ApiError {
    /// The envelope as a response (for places that answer directly).
    pub fn error_response_owned(&self) -> HttpResponse {
        actix_web::ResponseError::error_response(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A route without a policy makes the table refuse to build.
    #[test]
    fn route_without_policy_fails() {
        let mut t = RouteTable::default();
        t.add(
            Method::GET,
            "/a",
            Policy::Public,
            web::get().to(HttpResponse::Ok),
        );
        t.add_unguarded(Method::GET, "/b", web::get().to(HttpResponse::Ok));
        let err = t.build().err().expect("must fail");
        assert_eq!(err.path, "/b");
    }

    /// Policies are found by method and pattern; HEAD uses GET's.
    #[test]
    fn policy_lookup() {
        let mut t = RouteTable::default();
        t.add(
            Method::GET,
            "/v1/kv/{key}",
            Policy::ns("kv", "read"),
            web::get().to(HttpResponse::Ok),
        );
        t.add(
            Method::PUT,
            "/v1/kv/{key}",
            Policy::ns("kv", "write"),
            web::put().to(HttpResponse::Ok),
        );
        let (_, map) = t.build().unwrap();
        assert_eq!(
            map.get(&Method::PUT, "/v1/kv/{key}"),
            Some(&Policy::ns("kv", "write"))
        );
        assert_eq!(
            map.get(&Method::HEAD, "/v1/kv/{key}"),
            Some(&Policy::ns("kv", "read"))
        );
        assert_eq!(map.get(&Method::POST, "/v1/kv/{key}"), None);
    }
}
