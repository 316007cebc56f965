//! The extractor the namespace routes share: the target namespace the chain
//! settled, its running supervisor and the caller.

use crate::actors::NsHandle;
use crate::error::{ApiError, Code};
use crate::http::chain::context::Target;
use crate::http::state::Node;
use crate::identity::Identity;
use actix_web::dev::Payload;
use actix_web::{FromRequest, HttpMessage, HttpRequest};
use std::future::Future;
use std::pin::Pin;

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
    /// Whether the caller holds a grant on one resource: what a listing
    /// checks per item, so a credential scoped to some names lists only those.
    pub fn may(&self, domain: &str, action: &str, resource: &str) -> bool {
        self.identity
            .as_ref()
            .is_some_and(|i| i.allows(domain, action, resource))
    }

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
        let node = Node::of(req).clone();
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
