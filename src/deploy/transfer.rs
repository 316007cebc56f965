//! A namespace's deployments in a namespace export (`GET /v1/db/export`) and
//! their import (`PUT /v1/db/import`): records and versions travel, site files
//! travel as blobs of the export, host claims are taken again on import.
//!
//! An import replaces the namespace's deployments whole. It claims the hosts
//! of the imported active versions under the store-wide deployment lock: a
//! host claimed by any other namespace (the export's source namespace
//! included) fails the import with 409 `HOST_TAKEN` before anything is
//! written; hosts the namespace held and no longer uses are released in the
//! same atomic batch as the rest of the import.

use super::model::{
    DeploymentRecord, DeploymentVersion, HostClaim, MAX_HOSTS, MAX_INSTANCES, TargetSpec, dep_key,
    dep_prefix, host_key, normalize_host, normalize_instance, ns_ver_prefix, valid_name,
    validate_routes, ver_key,
};
use super::{DeployResult, Deployments, GENERATION_KEY, WriteLock};
use crate::error::ApiError;
use crate::error::Code;
use crate::storage::BatchOp;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// A deployment in a namespace export: its head record and every version.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportedDeployment {
    /// The head record; on import its namespace is replaced by the target's.
    pub record: DeploymentRecord,
    /// Every version kept, the active one included (checked on import).
    pub versions: Vec<DeploymentVersion>,
}

impl ExportedDeployment {
    /// The deployments of an export from the namespace's rows: head records
    /// (`dep/<ns>/` rows) and versions (`depv/<ns>/` rows, keyed
    /// `<name>/<version>`). Rows that do not decode are left out.
    pub fn from_rows(
        heads: Vec<(String, Vec<u8>)>,
        versions: Vec<(String, Vec<u8>)>,
    ) -> Vec<ExportedDeployment> {
        let mut by_name: std::collections::BTreeMap<String, Vec<DeploymentVersion>> =
            Default::default();
        for (key, v) in versions {
            let name = key.rsplit_once('/').map_or(key.as_str(), |(n, _)| n);
            if let Ok(ver) = serde_json::from_slice::<DeploymentVersion>(&v) {
                by_name.entry(name.to_string()).or_default().push(ver);
            }
        }
        heads
            .into_iter()
            .filter_map(|(_, v)| serde_json::from_slice::<DeploymentRecord>(&v).ok())
            .map(|record| ExportedDeployment {
                versions: by_name.remove(&record.name).unwrap_or_default(),
                record,
            })
            .collect()
    }

    /// The site files (by SHA-256) every version of it serves.
    pub fn blobs(&self) -> impl Iterator<Item = &str> {
        self.versions.iter().flat_map(|v| match &v.target {
            TargetSpec::Static { files, .. } => files
                .values()
                .map(|f| f.sha256.as_str())
                .collect::<Vec<_>>(),
            TargetSpec::Upstream { .. } => Vec::new(),
        })
    }

    fn active(&self) -> &DeploymentVersion {
        self.versions
            .iter()
            .find(|v| v.version == self.record.active)
            .expect("checked by check_import")
    }
}

/// Holds the store-wide deployment lock for the length of an import.
pub struct ImportLock<'a> {
    /// Held, never read: released when the import's batch is done.
    _lock: WriteLock<'a>,
}

fn invalid(message: String) -> ApiError {
    ApiError::new(Code::InvalidExport, message)
}

impl Deployments {
    /// Checks and normalizes imported deployments for namespace `ns` (names,
    /// hosts, routes, instances, versions), touching nothing.
    pub fn check_import(&self, ns: &str, deps: &mut [ExportedDeployment]) -> DeployResult<()> {
        let mut names = BTreeSet::new();
        for d in deps.iter_mut() {
            let name = d.record.name.clone();
            if !valid_name(&name) || !names.insert(name.clone()) {
                return Err(invalid(format!(
                    "deployment name {name:?} is not valid or appears twice"
                )));
            }
            d.record.namespace = ns.to_string();
            if d.versions.is_empty() {
                return Err(invalid(format!("deployment {name} carries no version")));
            }
            let mut seen = BTreeSet::new();
            for v in &mut d.versions {
                if !seen.insert(v.version) || v.version > d.record.latest {
                    return Err(invalid(format!(
                        "deployment {name}: version {} appears twice or is past latest {}",
                        v.version, d.record.latest
                    )));
                }
                if v.hosts.is_empty() || v.hosts.len() > MAX_HOSTS {
                    return Err(invalid(format!(
                        "deployment {name} version {}: 1 to {MAX_HOSTS} hosts",
                        v.version
                    )));
                }
                v.hosts = v
                    .hosts
                    .iter()
                    .map(|h| normalize_host(h))
                    .collect::<Result<_, _>>()?;
                for h in &v.hosts {
                    if let Some(why) = self.reserved_host(h) {
                        return Err(super::hosts::refusal(h, &why));
                    }
                }
                v.routes = validate_routes(std::mem::take(&mut v.routes))?;
                match &mut v.target {
                    TargetSpec::Upstream {
                        instances,
                        weights,
                        balance,
                        health,
                        ..
                    } => {
                        if instances.is_empty() || instances.len() > MAX_INSTANCES {
                            return Err(invalid(format!(
                                "deployment {name} version {}: 1 to {MAX_INSTANCES} instances",
                                v.version
                            )));
                        }
                        *instances = instances
                            .iter()
                            .map(|i| normalize_instance(i))
                            .collect::<Result<_, _>>()?;
                        super::model::validate_balancing(
                            instances.len(),
                            weights,
                            balance,
                            health.as_ref(),
                        )?;
                    }
                    TargetSpec::Static { files, .. } => {
                        for (path, f) in files.iter() {
                            if f.sha256.len() != 64
                                || !f.sha256.bytes().all(|b| b.is_ascii_hexdigit())
                                || path.is_empty()
                            {
                                return Err(invalid(format!(
                                    "deployment {name} version {}: file {path:?} is not valid",
                                    v.version
                                )));
                            }
                        }
                    }
                }
            }
            if !seen.contains(&d.record.active) {
                return Err(invalid(format!(
                    "deployment {name}: active version {} is not carried",
                    d.record.active
                )));
            }
        }
        Ok(())
    }

    /// Before any write: the active upstreams pass this node's egress policy
    /// (400 `UPSTREAM_FORBIDDEN`) and no host is another namespace's (409
    /// `HOST_TAKEN`). [`Deployments::import_ops`] checks the hosts again under
    /// the lock.
    pub async fn precheck_import(&self, ns: &str, deps: &[ExportedDeployment]) -> DeployResult<()> {
        for d in deps {
            self.check_egress(&d.active().target).await?;
            self.check_hosts(ns, &d.active().hosts).await?;
        }
        Ok(())
    }

    /// Takes the deployment lock and returns it with the writes that replace
    /// the namespace's deployments by `deps` and its host claims by theirs,
    /// generation included: the caller applies them in its atomic batch,
    /// then calls [`Deployments::reload`], then drops the lock.
    pub async fn import_ops(
        &self,
        ns: &str,
        deps: &[ExportedDeployment],
        limits: &crate::quota::Limits,
    ) -> DeployResult<(ImportLock<'_>, Vec<BatchOp>)> {
        use crate::quota::{Group, Resource, Usage, usage_key};
        let lock = self.write_lock().await?;
        let used: BTreeSet<String> = deps
            .iter()
            .flat_map(|d| d.active().hosts.iter().cloned())
            .collect();
        // The namespace's deployments become exactly `deps`: their usage is
        // theirs, checked whole against the quotas (nothing imported past one).
        let mut usage = Usage::default();
        usage.apply(
            limits,
            &[
                (Resource::Deployments, deps.len() as i64),
                (Resource::Hosts, used.len() as i64),
                (
                    Resource::SiteBytes,
                    deps.iter()
                        .flat_map(|d| d.versions.iter())
                        .map(|v| super::site_bytes(&v.target))
                        .sum::<u64>() as i64,
                ),
            ],
        )?;
        let used_list: Vec<String> = used.iter().cloned().collect();
        self.check_hosts(ns, &used_list).await?;
        let mut owned = BTreeSet::new();
        let mut existing = BTreeSet::new();
        for (k, v) in self.store.scan_all(&dep_prefix(ns)).await? {
            existing.insert(k);
            let Ok(rec) = serde_json::from_slice::<DeploymentRecord>(&v) else {
                continue;
            };
            if let Some(ver) = self
                .store
                .get_json::<DeploymentVersion>(&ver_key(ns, &rec.name, rec.active))
                .await?
            {
                owned.extend(ver.hosts);
            }
        }
        for (k, _) in self.store.scan_all(&ns_ver_prefix(ns)).await? {
            existing.insert(k);
        }
        let mut puts = Vec::new();
        for d in deps {
            puts.push((
                dep_key(ns, &d.record.name),
                serde_json::to_vec(&d.record).expect("json"),
            ));
            for v in &d.versions {
                puts.push((
                    ver_key(ns, &d.record.name, v.version),
                    serde_json::to_vec(v).expect("json"),
                ));
            }
        }
        let written: BTreeSet<&Vec<u8>> = puts.iter().map(|(k, _)| k).collect();
        let mut ops: Vec<BatchOp> = existing
            .iter()
            .filter(|k| !written.contains(k))
            .map(|k| BatchOp::Delete(k.clone()))
            .collect();
        // A deployment the import does not keep takes its certificate with
        // it (certificates are not exported; a kept one keeps its own).
        let kept: BTreeSet<&str> = deps.iter().map(|d| d.record.name.as_str()).collect();
        let cert_prefix = format!("depcert/{ns}/");
        for (k, _) in self.store.scan_all(cert_prefix.as_bytes()).await? {
            let name = String::from_utf8_lossy(&k[cert_prefix.len()..]).into_owned();
            if !kept.contains(name.as_str()) {
                ops.push(BatchOp::Delete(k));
            }
        }
        let claim = serde_json::to_vec(&HostClaim {
            namespace: ns.to_string(),
        })
        .expect("json");
        ops.extend(
            used.iter()
                .filter(|h| !owned.contains(*h))
                .map(|h| BatchOp::Put(host_key(h), claim.clone())),
        );
        ops.extend(
            owned
                .iter()
                .filter(|h| !used.contains(*h))
                .map(|h| BatchOp::Delete(host_key(h))),
        );
        ops.extend(puts.into_iter().map(|(k, v)| BatchOp::Put(k, v)));
        ops.push(BatchOp::Put(
            usage_key(ns, Group::Deployments),
            usage.encode(),
        ));
        ops.push(BatchOp::Put(
            GENERATION_KEY.to_vec(),
            crate::util::random_bytes::<16>().to_vec(),
        ));
        Ok((ImportLock { _lock: lock }, ops))
    }
}
