//! The routing index: host, then path segments in a trie, then method and
//! priority. The deepest matching prefix wins; among routes on the same prefix
//! the highest priority wins, then the deployment name.

use super::model::{RouteSpec, SiteFile};
use super::pool::UpstreamPool;
use super::route_policy::RateLimitPolicy;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// What serves a matched route.
#[derive(Clone)]
pub enum Serve {
    /// A static site's manifest, path to file (the bytes are blobs in the store).
    Static(Arc<BTreeMap<String, SiteFile>>),
    /// The upstream instances, their egress policy and passive health.
    Upstream(Arc<UpstreamPool>),
}

/// One route of one deployment's active version.
pub struct Bound {
    /// The namespace owning the deployment; [`Index::host_namespace`] answers it.
    pub namespace: String,
    /// The deployment's name; breaks priority ties.
    pub deployment: String,
    /// Its active version when the index was built.
    pub version: u64,
    /// What the route takes and how it rewrites the path.
    pub route: RouteSpec,
    /// What answers the matched requests.
    pub serve: Serve,
    /// The route's own rate-limit bucket, when its policy has a
    /// `rate_limit`: a routed request charges it without any lock of the
    /// node's (`http/route_policy.rs`).
    pub bucket: Option<Arc<RouteBucket>>,
    /// Where the route's requests are counted, found on its first request
    /// and kept with the route.
    pub observed: Observed,
}

/// A bound route's records: its metric series and its deployment's activity
/// ring, each looked up once (by label values, by name) and then written
/// without the node's locks.
#[derive(Default)]
pub struct Observed {
    /// The route's series in `/metrics`.
    pub series: crate::metrics::RouteSeries,
    /// The deployment's activity ring, while the node's map holds it.
    pub ring: arc_swap::ArcSwapOption<crate::observe::Ring>,
}

impl Observed {
    /// Adds a request to the deployment's activity ring.
    pub fn push_activity(
        &self,
        activity: &crate::observe::Activity,
        namespace: &str,
        deployment: &str,
        entry: crate::observe::ActivityEntry,
    ) {
        let held = self.ring.load();
        match held.as_deref() {
            Some(ring) if ring.is_live() => activity.push_to(ring, entry),
            _ => {
                let ring = activity.ring(namespace, deployment);
                activity.push_to(&ring, entry);
                self.ring.store(Some(ring));
            }
        }
    }
}

/// One route's rate-limit bucket (its policy's `rate_limit`), one key per
/// client or subject inside. Built with the index, and kept across
/// rebuilds while the same version of the deployment serves
/// (`super::Deployments::reload`): another deployment's change does not
/// refill it; a new version (or a rollback) starts with a full one.
pub struct RouteBucket {
    /// The keyed limiter.
    pub limiter: DefaultKeyedRateLimiter<String>,
    /// How often it was checked (idle keys are dropped every so many checks).
    pub checks: AtomicU64,
}

impl RouteBucket {
    /// A full bucket of `rl`'s rate and burst.
    pub fn new(rl: &RateLimitPolicy) -> RouteBucket {
        let per = Duration::from_nanos(1_000_000_000 / u64::from(rl.requests_per_second.max(1)));
        let q = Quota::with_period(per)
            .expect("non-zero")
            .allow_burst(NonZeroU32::new(rl.burst().max(1)).expect("non-zero"));
        RouteBucket {
            limiter: RateLimiter::keyed(q),
            checks: AtomicU64::new(0),
        }
    }

    /// The buckets of a version's routes, in their order (None: no `rate_limit`).
    pub fn for_routes(routes: &[RouteSpec]) -> Vec<Option<Arc<RouteBucket>>> {
        routes
            .iter()
            .map(|r| {
                r.policy
                    .as_ref()
                    .and_then(|p| p.rate_limit.as_ref())
                    .map(|rl| Arc::new(RouteBucket::new(rl)))
            })
            .collect()
    }
}

/// One path segment of a host's trie.
#[derive(Default)]
struct TrieNode {
    /// The next segments.
    children: HashMap<String, TrieNode>,
    /// Sorted by priority (highest first), then deployment name.
    routes: Vec<Arc<Bound>>,
}

/// Every host's routes.
#[derive(Default)]
pub struct Index {
    /// Per host: the namespace owning it and the root of its route trie.
    hosts: HashMap<String, (String, TrieNode)>,
    /// The node's own names' generation (`super::hosts::OwnNames`) when the
    /// index was built: every host reserved then was left out.
    pub names_generation: u64,
}

fn segments(path: &str) -> impl Iterator<Item = &str> {
    path.split('/').filter(|s| !s.is_empty())
}

impl Index {
    /// Adds one route under one host.
    pub fn insert(&mut self, host: &str, bound: Arc<Bound>) {
        let (_, root) = self
            .hosts
            .entry(host.to_string())
            .or_insert_with(|| (bound.namespace.clone(), TrieNode::default()));
        let mut node = root;
        for seg in segments(&bound.route.path_prefix) {
            node = node.children.entry(seg.to_string()).or_default();
        }
        node.routes.push(bound);
        node.routes.sort_by(|a, b| {
            b.route
                .priority
                .cmp(&a.route.priority)
                .then_with(|| a.deployment.cmp(&b.deployment))
        });
    }

    /// The namespace a host belongs to, when it is routed.
    pub fn host_namespace(&self, host: &str) -> Option<&str> {
        self.hosts.get(host).map(|(ns, _)| ns.as_str())
    }

    /// The route taking `method path` on `host`.
    pub fn lookup(&self, host: &str, method: &str, path: &str) -> Option<Arc<Bound>> {
        let (_, root) = self.hosts.get(host)?;
        // Down the path's segments; the deepest node with a route for the
        // method wins (no list of the nodes passed is built).
        fn at<'t>(n: &'t TrieNode, method: &str) -> Option<&'t Arc<Bound>> {
            n.routes
                .iter()
                .find(|b| b.route.methods.is_empty() || b.route.methods.iter().any(|m| m == method))
        }
        let mut best = at(root, method);
        let mut node = root;
        for seg in segments(path) {
            match node.children.get(seg) {
                Some(n) => {
                    best = at(n, method).or(best);
                    node = n;
                }
                None => break,
            }
        }
        best.cloned()
    }

    /// Hosts routed.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether no host is routed.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(dep: &str, prefix: &str, methods: &[&str], priority: i32) -> Arc<Bound> {
        Arc::new(Bound {
            namespace: "ns".into(),
            deployment: dep.into(),
            version: 1,
            route: RouteSpec {
                path_prefix: prefix.into(),
                methods: methods.iter().map(|m| m.to_string()).collect(),
                strip_prefix: None,
                add_prefix: None,
                priority,
                policy: None,
            },
            serve: Serve::Static(Arc::new(BTreeMap::new())),
            bucket: None,
            observed: Default::default(),
        })
    }

    /// The deepest prefix wins, on segment boundaries; methods filter; no match is None.
    #[test]
    fn deepest_prefix_then_method() {
        let mut ix = Index::default();
        ix.insert("a.test", bound("root", "/", &[], 0));
        ix.insert("a.test", bound("api", "/api", &[], 0));
        ix.insert("a.test", bound("writes", "/api/v1", &["POST"], 0));
        let d = |m: &str, p: &str| ix.lookup("a.test", m, p).map(|b| b.deployment.clone());
        assert_eq!(d("GET", "/"), Some("root".into()));
        assert_eq!(d("GET", "/api"), Some("api".into()));
        assert_eq!(d("GET", "/api/"), Some("api".into()));
        assert_eq!(d("GET", "/apix"), Some("root".into()));
        assert_eq!(d("POST", "/api/v1/x"), Some("writes".into()));
        assert_eq!(d("GET", "/api/v1/x"), Some("api".into()));
        assert!(ix.lookup("b.test", "GET", "/").is_none());
        let mut only = Index::default();
        only.insert("a.test", bound("api", "/api", &["GET"], 0));
        assert!(only.lookup("a.test", "GET", "/other").is_none());
        assert!(only.lookup("a.test", "POST", "/api").is_none());
    }

    /// On the same prefix the higher priority wins, whatever the insertion order.
    #[test]
    fn priority_breaks_ties() {
        let mut ix = Index::default();
        ix.insert("a.test", bound("low", "/x", &[], 1));
        ix.insert("a.test", bound("high", "/x", &[], 5));
        ix.insert("a.test", bound("mid", "/x", &[], 3));
        assert_eq!(
            ix.lookup("a.test", "GET", "/x/y").unwrap().deployment,
            "high"
        );
    }

    /// The canonical path against the routing index (`super::super::canonical`).
    mod canonical_prop {
        use crate::deploy::canonical::{canonical_path, upstream_reading};
        use crate::deploy::index::{Bound, Index, Serve};
        use crate::deploy::model::RouteSpec;
        use proptest::prelude::*;
        use std::borrow::Cow;
        use std::sync::Arc;

        /// The routes of the test host: prefixes an attacker aims between.
        const PREFIXES: &[&str] = &["/", "/admin", "/health", "/api/v1", "/a b", "/x~y"];

        fn index() -> Index {
            let mut ix = Index::default();
            for (i, p) in PREFIXES.iter().enumerate() {
                let mut route = RouteSpec::everything();
                // Prefixes are stored as a deployment spells them: escaped.
                route.path_prefix = p.replace(' ', "%20");
                ix.insert(
                    "h.test",
                    Arc::new(Bound {
                        namespace: "ns".into(),
                        deployment: format!("d{i}"),
                        version: 1,
                        route,
                        serve: Serve::Static(Arc::default()),
                        bucket: None,
                        observed: Default::default(),
                    }),
                );
            }
            ix
        }

        /// The route an upstream picks by its own reading of a path: the
        /// longest prefix (at a segment boundary) of its decoded, resolved form.
        fn upstream_pick(path: &str) -> &'static str {
            let read = upstream_reading(path).unwrap_or_default();
            PREFIXES
                .iter()
                .filter(|p| {
                    let p = p.trim_end_matches('/');
                    p.is_empty()
                        || read
                            .strip_prefix(p)
                            .is_some_and(|r| r.is_empty() || r.starts_with('/'))
                })
                .max_by_key(|p| p.len())
                .copied()
                .unwrap_or("/")
        }

        fn piece() -> impl Strategy<Value = &'static str> {
            prop::sample::select(vec![
                "admin", "health", "api", "v1", "x~y", "a%20b", "a b", ".", "..", "%2e", "%2E",
                ".%2e", "%2e.", "%2e%2e", "%61dmin", "%41dmin", "ad%6din", "%2f", "%2F", "%5c",
                "\\", ";", ";a=b", "%00", "%0a", "%3b", "%25", "%252e", "%", "%4", "%zz", "%c3%a9",
                "", "/", "//", "~", "-", "_",
            ])
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(4000))]

            /// For every generated path: refused, or the route the node picks
            /// for its canonical form is the route an upstream's own reading
            /// of that forwarded form picks; and canonical is a fixed point.
            #[test]
            fn canonical_route_is_the_upstreams_route(
                parts in prop::collection::vec((piece(), any::<bool>()), 0..8)
            ) {
                let mut raw = String::from("/");
                for (p, slash) in &parts {
                    raw.push_str(p);
                    if *slash {
                        raw.push('/');
                    }
                }
                let ix = index();
                if let Ok(c) = canonical_path(&raw) {
                    let node = ix
                        .lookup("h.test", "GET", &c)
                        .map(|b| PREFIXES[b.deployment[1..].parse::<usize>().unwrap()])
                        .unwrap_or("/");
                    prop_assert_eq!(node, upstream_pick(&c), "raw {:?} canonical {:?}", raw, c);
                    let again = canonical_path(&c).map(Cow::into_owned);
                    prop_assert_eq!(again.as_deref(), Ok(&*c));
                }
            }
        }
    }
}
