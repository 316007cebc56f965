//! The host services a namespace's guests call: KV, publish, and resolving
//! another function of the namespace.

use super::*;
use crate::actors::namespace::{MAX_KV_KEY, NsError, kv_write};

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
            Ok(kv_write(&s, &ns, &limits, &key, value.as_deref()).await)
        });
        match r.map_err(host_err)? {
            Ok(_) => Ok(()),
            Err(NsError::Refused(_)) => Err(HostError::LimitReached),
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
        let Some(publish) = self.inv.st.snapshot.load().publisher.clone() else {
            return Err(HostError::Internal(
                "the namespace supervisor is not attached".into(),
            ));
        };
        // Bounded like any other sender: a full mailbox is LIMIT, never a wait.
        publish(topic.to_string(), Bytes::copy_from_slice(data), self.depth)
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

#[cfg(all(test, feature = "cluster"))]
mod tests {
    use super::*;
    use crate::actors::namespace::import_journal_key;

    /// On etcd, a guest's `kv_put` while an import's journal is in the store
    /// (left by an importer that died past its commit point, here written
    /// by hand): the write waits for the import to be finished (after
    /// `IMPORT_TAKEOVER` it finishes it itself), then lands after it. Once
    /// any later finisher has run, the guest's value is still there (not
    /// lost under the import's) and the import's other keys are whole.
    #[actix_rt::test]
    async fn a_guests_kv_write_waits_for_a_journaled_import_on_etcd() {
        let etcd = crate::storage::etcd_process::EtcdProcess::start();
        let cfg: crate::config::ClusterConfig = toml::from_str(&etcd.cluster_toml()).unwrap();
        let access = crate::storage::EtcdAccess::from_config(&cfg).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_etcd(&[etcd.url()], &access).await.unwrap();
        let (store, inv, _) = super::super::tests::deployed_f_on(&dir, store).await;
        let key = |k: &str| [kv_prefix("ns"), k.as_bytes().to_vec()].concat();
        // More writes than one etcd transaction: a journaled import's KV.
        let steps: Vec<BatchOp> = (0..200)
            .map(|i| BatchOp::Put(key(&format!("k{i:03}")), b"import".to_vec()))
            .collect();
        let journal = import_journal_key("ns");
        store
            .put(&journal, &crate::storage::encode_journal(&steps, &[]))
            .await
            .unwrap();

        let host = NsHost {
            inv: inv.clone(),
            depth: 0,
            _busy: Busy::new(&inv.st),
        };
        tokio::task::spawn_blocking(move || host.kv_put(b"k000", b"guest"))
            .await
            .unwrap()
            .unwrap();
        // Whoever finishes the journal next (any waiting reader, after
        // `IMPORT_TAKEOVER`) must find nothing left to overwrite it with.
        let left = store.roll_forward(&journal).await.unwrap();
        let get = |k: &'static str| {
            let store = store.clone();
            async move { store.get(&key(k)).await.unwrap() }
        };
        assert_eq!(get("k000").await.as_deref(), Some(&b"guest"[..]), "lost");
        assert_eq!(get("k001").await.as_deref(), Some(&b"import"[..]));
        assert_eq!(get("k199").await.as_deref(), Some(&b"import"[..]));
        assert!(!left, "the guest wrote while the journal was there");
    }
}
