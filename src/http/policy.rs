//! Route policies (docs/design.md §2 step 2, §10). Every route is registered through
//! [`RouteTable::add`] with its policy; the policy step puts the matched route's
//! policy on the request, and later steps read the policy, never the path. A
//! resource registered without a policy makes startup fail.

use crate::error::Code;
use actix_web::http::Method;
use actix_web::{HttpResponse, Resource, Scope, web};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// A read of the deployment routes (`deployments:read`): answered by the
    /// node it reaches, never forwarded (the records are in the shared store).
    pub fn reads_deployments(&self) -> bool {
        self.grant() == Some(("deployments", "read"))
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
    /// `[debug] fault_injection`: the fault-injection routes are registered
    /// only when it is on, so a node without it has no such routes at all.
    fault_injection: bool,
    /// `[debug] max_sleep_ms` above 0: the same for `GET /v1/debug/sleep`.
    debug_sleep: bool,
    /// `[metrics] public`: the node's status is public too.
    metrics_public: bool,
}

/// Policies by (method, route pattern), read by the policy middleware.
#[derive(Clone)]
pub struct PolicyMap {
    /// Tells this map's entries of the per-thread pattern cache from another's.
    id: u64,
    routes: HashMap<&'static str, Vec<(Method, Policy)>>,
}

impl Default for PolicyMap {
    fn default() -> Self {
        Self::new(HashMap::new())
    }
}

/// Paths whose route pattern one worker thread remembers; past it the cache
/// starts over (a client sending ever new paths costs the router walk, as
/// without a cache).
const PATTERN_CACHE_ENTRIES: usize = 4096;
/// Longer paths are not remembered.
const PATTERN_CACHE_PATH_BYTES: usize = 256;

thread_local! {
    /// The route pattern of each path this thread saw, for one map (its id).
    static PATTERNS: RefCell<(u64, HashMap<Box<str>, Option<&'static str>>)> =
        RefCell::new((0, HashMap::new()));
}

impl PolicyMap {
    fn new(routes: HashMap<&'static str, Vec<(Method, Policy)>>) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            routes,
        }
    }

    /// The registered pattern `path` matches, found by `find` (the router's
    /// own walk, `HttpRequest::match_pattern`) once per path and worker
    /// thread. Which route a path matches depends only on the path and the
    /// routes, fixed at start, so the answer can be kept: the policy step
    /// no longer walks the router's regexes a second time per request.
    pub fn pattern_of(
        &self,
        path: &str,
        find: impl FnOnce() -> Option<String>,
    ) -> Option<&'static str> {
        if path.len() > PATTERN_CACHE_PATH_BYTES {
            return find().and_then(|p| self.registered(&p));
        }
        PATTERNS.with(|cache| {
            if let Some(hit) = {
                let c = cache.borrow();
                if c.0 == self.id {
                    c.1.get(path).copied()
                } else {
                    None
                }
            } {
                return hit;
            }
            let found = find().and_then(|p| self.registered(&p));
            let mut c = cache.borrow_mut();
            if c.0 != self.id || c.1.len() >= PATTERN_CACHE_ENTRIES {
                c.0 = self.id;
                c.1.clear();
            }
            c.1.insert(path.into(), found);
            found
        })
    }

    /// The map's own copy of `pattern`, if a route has it.
    fn registered(&self, pattern: &str) -> Option<&'static str> {
        self.routes.get_key_value(pattern).map(|(k, _)| *k)
    }

    /// The policy of `method` on the route `pattern` (HEAD looks up GET).
    pub fn get(&self, method: &Method, pattern: &str) -> Option<&Policy> {
        // HEAD is answered by the GET route.
        let method = if method == Method::HEAD {
            &Method::GET
        } else {
            method
        };
        self.routes
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
    /// A table whose routes follow the configuration: the fault-injection
    /// routes with `[debug] fault_injection`, the sleep route with
    /// `[debug] max_sleep_ms`, the status's policy with `[metrics] public`.
    pub fn new(cfg: &crate::config::Config) -> Self {
        Self {
            entries: Vec::new(),
            fault_injection: cfg.debug.fault_injection,
            debug_sleep: cfg.debug.max_sleep_ms > 0,
            metrics_public: cfg.metrics.public,
        }
    }

    /// Whether `[metrics] public` opens what the operator key guards
    /// otherwise (the node's status, without namespace names).
    pub fn metrics_public(&self) -> bool {
        self.metrics_public
    }

    /// Whether the fault-injection routes belong in this table.
    pub fn fault_injection(&self) -> bool {
        self.fault_injection
    }

    /// Whether `GET /v1/debug/sleep` belongs in this table.
    pub fn debug_sleep(&self) -> bool {
        self.debug_sleep
    }

    /// Every route as registered: method, path pattern and policy (None
    /// only for [`RouteTable::add_unguarded`]), what the OpenAPI document
    /// is made from.
    pub fn routes(&self) -> impl Iterator<Item = (&Method, &'static str, Option<&Policy>)> {
        self.entries
            .iter()
            .map(|e| (&e.method, e.path, e.policy.as_ref()))
    }

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

    /// Checks every route has a policy and builds the services and the policy
    /// map: one resource per path (the methods as its routes), the resources
    /// under one scope per static prefix ([`scope_prefix`], `/v1/kv`,
    /// `/v1/functions`, ...). actix's router tries its services in order and
    /// runs a regex search for every dynamic pattern it tries; a scope is a
    /// plain prefix compare, so a request runs the regexes of its own scope's
    /// routes only (BENCHMARKS.md, "Routes under one scope per static prefix").
    pub fn build(self) -> Result<(Vec<Scope>, PolicyMap), MissingPolicy> {
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
        let prefixes = scope_prefixes(by_path.iter().map(|(p, _)| *p));
        let mut groups: Vec<(&str, Vec<Resource>)> =
            prefixes.iter().map(|&p| (p, Vec::new())).collect();
        for (path, routes) in by_path {
            let Some((prefix, group)) = groups.iter_mut().find(|(p, _)| under(path, p)) else {
                continue; // unreachable: the root scope "" is there when no prefix covers a path
            };
            let mut r = web::resource(&path[prefix.len()..]);
            for (method, route) in routes {
                r = r.route(route.method(method));
            }
            group.push(r.default_service(web::to(method_not_allowed)));
        }
        let scopes = groups.into_iter().map(|(prefix, resources)| {
            resources
                .into_iter()
                .fold(web::scope(prefix), Scope::service)
        });
        Ok((scopes.collect(), PolicyMap::new(map)))
    }
}

/// Whether `path` is `prefix` or below it (a segment boundary follows).
fn under(path: &str, prefix: &str) -> bool {
    path.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// A path's candidate scope: its leading static segments, at most two
/// (`/v1/kv/{key}` → `/v1/kv`, `/__admin/login` → `/__admin/login`,
/// `/__admin/` → `/__admin`); empty when its first segment is dynamic.
fn scope_prefix(path: &str) -> &str {
    let mut end = 0;
    for seg in path.split('/').skip(1).take(2) {
        if seg.is_empty() || seg.contains('{') {
            break;
        }
        end += 1 + seg.len();
    }
    &path[..end]
}

/// The scopes for `paths`: each path's candidate, merged into a shorter one
/// that covers it (a scope answers every path under its prefix, so
/// `/__admin` takes `/__admin/login` with it), in first-seen order. Paths
/// under no prefix (a dynamic first segment) go to the root scope `""`,
/// listed last so no prefix is shadowed by it.
fn scope_prefixes<'a>(paths: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let candidates: Vec<&str> = paths.map(scope_prefix).collect();
    let mut out: Vec<&str> = Vec::new();
    for &c in &candidates {
        let covered = candidates
            .iter()
            .any(|&o| !o.is_empty() && o != c && under(c, o));
        if !c.is_empty() && !covered && !out.contains(&c) {
            out.push(c);
        }
    }
    if candidates.contains(&"") {
        out.push("");
    }
    out
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
        let map = kv_and_status_map();
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

    /// GET and PUT on `/v1/kv/{key}`, GET on `/v1/status`.
    fn kv_and_status_map() -> PolicyMap {
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
        t.add(
            Method::GET,
            "/v1/status",
            Policy::Public,
            web::get().to(HttpResponse::Ok),
        );
        t.build().unwrap().1
    }

    /// The router is walked once per path and thread; later requests of the
    /// same path get the same pattern without a walk. A path matching no
    /// route is remembered as such.
    #[test]
    fn a_path_is_matched_once_per_thread() {
        let map = kv_and_status_map();
        let walks = std::cell::Cell::new(0);
        let find = |p: &str| {
            walks.set(walks.get() + 1);
            Some(p.to_string())
        };
        for _ in 0..3 {
            assert_eq!(
                map.pattern_of("/v1/kv/a", || find("/v1/kv/{key}")),
                Some("/v1/kv/{key}")
            );
        }
        assert_eq!(walks.get(), 1);
        for _ in 0..2 {
            assert_eq!(
                map.pattern_of("/nowhere", || {
                    walks.set(walks.get() + 1);
                    None
                }),
                None
            );
        }
        assert_eq!(walks.get(), 2);
        // A pattern the map does not register is no pattern.
        assert_eq!(map.pattern_of("/other", || find("/v1/unknown")), None);
    }

    /// Another map (another node's routes in the same thread) never sees the
    /// first map's answers; paths past 256 bytes are never kept; past 4,096
    /// paths the cache starts over, so it stays bounded.
    #[test]
    fn the_pattern_cache_is_per_map_and_bounded() {
        let (a, b) = (kv_and_status_map(), kv_and_status_map());
        assert_eq!(
            a.pattern_of("/v1/status", || Some("/v1/status".into())),
            Some("/v1/status")
        );
        let mut walked = false;
        assert_eq!(
            b.pattern_of("/v1/status", || {
                walked = true;
                None
            }),
            None,
            "b's own walk decides"
        );
        assert!(walked);
        let long = format!("/v1/kv/{}", "x".repeat(300));
        let mut walks = 0;
        for _ in 0..2 {
            a.pattern_of(&long, || {
                walks += 1;
                Some("/v1/kv/{key}".into())
            });
        }
        assert_eq!(walks, 2, "a long path is walked every time");
        for i in 0..=PATTERN_CACHE_ENTRIES {
            a.pattern_of(&format!("/v1/kv/{i}"), || Some("/v1/kv/{key}".into()));
        }
        let kept = PATTERNS.with(|c| c.borrow().1.len());
        assert!(kept <= PATTERN_CACHE_ENTRIES, "{kept} paths kept");
    }

    /// Routes are grouped under scopes by their static prefix, and every path
    /// still reaches its own route: the exact prefix, a dynamic route beside
    /// a static one (registration order kept), a deeper path whose prefix
    /// merges into a shorter one, a trailing slash, a dynamic first segment
    /// (the root scope, last), and a miss under a scope's prefix answered by
    /// the app's default, not by a route of another scope.
    #[actix_rt::test]
    async fn scoped_routes_reach_their_own_handlers() {
        use actix_web::test;
        let paths: [&'static str; 8] = [
            "/v1/kv",
            "/v1/kv/{key:.+}",
            "/v1/fn/secrets",
            "/v1/fn/{name}",
            "/adm",
            "/adm/",
            "/adm/api/x",
            "/{any}/tail",
        ];
        assert_eq!(
            scope_prefixes(paths.iter().copied()),
            vec!["/v1/kv", "/v1/fn", "/adm", ""]
        );
        let mut t = RouteTable::default();
        for p in paths {
            t.add(
                Method::GET,
                p,
                Policy::Public,
                web::get().to(move || async move { HttpResponse::Ok().body(p) }),
            );
        }
        let (scopes, _) = t.build().unwrap();
        let mut app = actix_web::App::new().default_service(web::to(HttpResponse::NotFound));
        for s in scopes {
            app = app.service(s);
        }
        let app = test::init_service(app).await;
        for (uri, want) in [
            ("/v1/kv", Some("/v1/kv")),
            ("/v1/kv/a/b", Some("/v1/kv/{key:.+}")),
            ("/v1/kv/", None),
            ("/v1/kvx", None),
            ("/v1/fn/secrets", Some("/v1/fn/secrets")),
            ("/v1/fn/f", Some("/v1/fn/{name}")),
            ("/adm", Some("/adm")),
            ("/adm/", Some("/adm/")),
            ("/adm/api/x", Some("/adm/api/x")),
            ("/adm/api/y", None),
            ("/x/tail", Some("/{any}/tail")),
            ("/nowhere", None),
        ] {
            let res =
                test::call_service(&app, test::TestRequest::get().uri(uri).to_request()).await;
            match want {
                Some(body) => {
                    assert!(res.status().is_success(), "{uri}: {}", res.status());
                    assert_eq!(test::read_body(res).await, body.as_bytes(), "{uri}");
                }
                None => assert_eq!(res.status(), 404, "{uri}"),
            }
        }
        let res =
            test::call_service(&app, test::TestRequest::post().uri("/v1/kv/a").to_request()).await;
        assert_eq!(res.status(), 405, "a route's other method");
    }
}
