//! Route handlers, one file per capability, and the shared extractors.

mod auth;
mod deployments;
mod functions;
mod kv;
mod namespaces;
mod pubsub;
mod stats;
mod system;

pub use auth::{KeyCache, TokenCache, authenticate};

use super::chain::{Identity, Target};
use super::error::ApiError;
use super::policy::RouteTable;
use crate::actors::NsHandle;
use crate::error::Code;
use crate::http::state::Node;
use actix_web::dev::Payload;
use actix_web::{FromRequest, HttpMessage, HttpRequest, web};
use std::future::Future;
use std::pin::Pin;

/// Registers every capability's routes with their policies.
pub fn register(t: &mut RouteTable) {
    system::register(t);
    namespaces::register(t);
    stats::register(t);
    auth::register(t);
    kv::register(t);
    functions::register(t);
    pubsub::register(t);
    deployments::register(t);
    crate::http::dashboard::routes::register(t);
}

/// Namespace names: 1–63 of `a-z`, `0-9`, `-`, starting with a letter or digit.
pub fn valid_namespace_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
}

pub use crate::util::now;

/// The target namespace of an `ns` route, its running supervisor and the caller.
pub struct NsCtx {
    /// The target namespace, as the routing step chose it (its `Target`); keys every call below.
    pub name: String,
    /// The namespace's supervisor on this node (found or started by `locate`); routes `ask` it.
    pub handle: NsHandle,
    /// The caller's verified credential, if any; `require` checks its grants.
    pub identity: Option<Identity>,
}

impl NsCtx {
    /// Checks the caller's grant on one resource (the scope gate checked the domain and action).
    pub fn require(&self, domain: &str, action: &str, resource: &str) -> Result<(), ApiError> {
        match &self.identity {
            Some(i) if i.allows(domain, action, resource) => Ok(()),
            Some(_) => Err(ApiError::new(
                Code::MissingGrant,
                format!("the credential lacks {domain}:{action}:{resource}"),
            )),
            None => Err(ApiError::new(
                Code::MissingCredential,
                "this route needs a credential",
            )),
        }
    }
}

impl FromRequest for NsCtx {
    type Error = ApiError;
    type Future = Pin<Box<dyn Future<Output = Result<NsCtx, ApiError>>>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let node = req
            .app_data::<web::Data<Node>>()
            .expect("node")
            .get_ref()
            .clone();
        let target = req.extensions().get::<Target>().map(|t| t.0.clone());
        let identity = req.extensions().get::<Identity>().cloned();
        Box::pin(async move {
            let name = target
                .ok_or_else(|| ApiError::new(Code::NamespaceRequired, "no target namespace"))?;
            let handle = node.locate(&name).await?;
            Ok(NsCtx {
                name,
                handle,
                identity,
            })
        })
    }
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
                size < crate::http::SMALL_FUTURE,
                "{what}'s future is {size} bytes: box the rarely-taken await that made it large"
            );
        }
    }
}
