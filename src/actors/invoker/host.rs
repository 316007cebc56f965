//! The host services a namespace's guests call: KV, publish, and resolving
//! another function of the namespace.

use super::*;

/// The host services of one invocation: everything scoped to the invoker's namespace.
pub(super) struct NsHost {
    pub(super) inv: Invoker,
    /// Trigger depth of the running function; its publishes carry it.
    pub(super) depth: u8,
    /// Keeps the namespace busy (no passivation) while the call is queued
    /// or runs: this host goes with the job onto the pool.
    pub(super) _busy: Busy,
}

pub(super) fn host_err(e: impl std::fmt::Display) -> HostError {
    HostError::Internal(e.to_string())
}

impl NsHost {
    fn kv_key(&self, key: &[u8]) -> Result<Vec<u8>, HostError> {
        if key.is_empty() || key.len() > MAX_KV_KEY {
            return Err(HostError::BadArgument);
        }
        let mut k = kv_prefix(&self.inv.ns);
        k.extend_from_slice(key);
        Ok(k)
    }
}

impl NsHost {
    /// A guest's KV write goes the way of every other (`kv_write`): counted
    /// against the namespace's quotas, and never during an import. Past a
    /// quota the host call answers LIMIT (nothing written).
    fn kv_write(&self, key: &[u8], value: Option<Vec<u8>>) -> Result<(), HostError> {
        if key.is_empty() || key.len() > MAX_KV_KEY {
            return Err(HostError::BadArgument);
        }
        let (ns, limits, key) = (self.inv.ns.clone(), self.inv.limits(), key.to_vec());
        let r = self.inv.svc.store_wait(move |s| async move {
            Ok(crate::actors::kv_write(&s, &ns, &limits, &key, value.as_deref()).await)
        });
        match r.map_err(host_err)? {
            Ok(_) => Ok(()),
            Err(crate::actors::NsError::Refused(_)) => Err(HostError::LimitReached),
            Err(e) => Err(host_err(e)),
        }
    }
}

impl HostApi for NsHost {
    fn kv_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, HostError> {
        let k = self.kv_key(key)?;
        self.inv
            .svc
            .store_wait(move |s| async move { s.get(&k).await })
            .map_err(host_err)
    }

    fn kv_put(&self, key: &[u8], value: &[u8]) -> Result<(), HostError> {
        if value.len() > MAX_KV_VALUE {
            return Err(HostError::BadArgument);
        }
        self.kv_write(key, Some(value.to_vec()))
    }

    fn kv_delete(&self, key: &[u8]) -> Result<(), HostError> {
        self.kv_write(key, None)
    }

    fn publish(&self, topic: &str, data: &[u8]) -> Result<(), HostError> {
        crate::pubsub::check_topic(topic).map_err(|_| HostError::BadArgument)?;
        let Some((addr, stats)) = self.inv.st.publisher.lock().clone() else {
            return Err(HostError::Internal(
                "the namespace supervisor is not attached".into(),
            ));
        };
        // Bounded like any other sender: a full mailbox is LIMIT, never a wait.
        if !stats.admit() {
            return Err(HostError::LimitReached);
        }
        let msg = Publish {
            topic: topic.to_string(),
            data: Bytes::copy_from_slice(data),
            depth: self.depth,
        };
        match addr.try_send(msg) {
            Ok(()) => Ok(()),
            Err(_) => {
                stats.cancel();
                Err(HostError::LimitReached)
            }
        }
    }

    fn resolve(&self, name: &str) -> Result<ResolvedFunction, HostError> {
        match self.inv.resolve_sync(name, None) {
            Ok(r) => Ok(ResolvedFunction {
                module: r.module,
                version: r.meta.version,
                env: r.env,
                memory_limit_mb: r.meta.memory_limit_mb,
                timeout: Duration::from_secs(r.meta.timeout_seconds.into()),
            }),
            Err(FnError::NotFound(_)) => Err(HostError::NotFound),
            Err(e) => Err(host_err(e)),
        }
    }
}
