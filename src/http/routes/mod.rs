//! Route handlers, one file per capability, and the shared extractors
//! (`ctx.rs`; `form.rs`, a body's parts and fields and the refusals that
//! name them). Handlers read what the chain put on the request
//! (`chain/context.rs`); nothing below imports them.

mod auth;
mod ctx;
mod deployments;
mod form;
mod functions;
mod internal;
mod kv;
mod namespaces;
mod page;
mod pubsub;
mod stats;
mod system;

use crate::http::policy::RouteTable;

/// Registers every capability's routes with their policies.
pub fn register(t: &mut RouteTable) {
    system::register(t);
    namespaces::register(t);
    stats::register(t);
    auth::register(t);
    kv::register(t);
    functions::register(t);
    pubsub::register(t);
    internal::register(t);
    deployments::register(t);
    crate::http::dashboard::routes::register(t);
}

#[cfg(test)]
mod tests {
    /// The size of the future a handler of `N` extractors returns.
    fn size3<A, B, C, F>(_: impl Fn(A, B, C) -> F) -> usize {
        size_of::<F>()
    }
    fn size4<A, B, C, D, F>(_: impl Fn(A, B, C, D) -> F) -> usize {
        size_of::<F>()
    }

    /// The hot handlers' futures hold no rarely-taken kilobyte state inline
    /// (an etcd call's, a hop's): actix moves each one whole into a box on
    /// every request. A store read inline on etcd made `kv::get` 8 KiB.
    #[test]
    fn hot_handler_futures_stay_small() {
        for (what, size) in [
            ("kv::get", size3(super::kv::get)),
            ("functions::invoke", size4(super::functions::invoke)),
        ] {
            assert!(
                size < crate::http::request::SMALL_FUTURE,
                "{what}'s future is {size} bytes: box the rarely-taken await that made it large"
            );
        }
    }
}
