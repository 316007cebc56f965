//! Replacing a namespace member whose node is gone (docs/cluster.md,
//! "Members follow the cluster"). Every node runs one sweep: a member
//! absent from the node registry for `replace_after_seconds` (as this node
//! saw the registry) is replaced in each namespace that names it by the
//! first live node, in the rendezvous order of the namespace's name (the
//! rule of placement at creation), that is not already a member. The
//! change is a compare-and-swap of the namespace record against the bytes
//! the sweep read, so when several nodes decide at once exactly one write
//! lands; the others count a lost race and read the new record next time.
//! At most [`MOVES_PER_SWEEP`] namespaces move per sweep and node, so a
//! failure never rewrites every record in one burst.

use super::{Cluster, rendezvous};
use crate::namespace::NamespaceRecord;
use crate::storage::OrderedKv;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Records rewritten per sweep and node, at most.
pub const MOVES_PER_SWEEP: usize = 32;

/// Time between two sweeps for `replace_after`: a fifth of it, within 1 to 10 s.
pub fn sweep_every(replace_after: Duration) -> Duration {
    (replace_after / 5).clamp(Duration::from_secs(1), Duration::from_secs(10))
}

/// What one replacement attempt did (for `meshgate_member_replacements_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// This node's compare-and-swap wrote the new members.
    Replaced,
    /// Another writer changed the record first: nothing written.
    Lost,
}

impl Outcome {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Replaced => "replaced",
            Outcome::Lost => "lost",
        }
    }
}

/// The members `members` become when the nodes in `dead` are gone and
/// `live` are the live node ids: each dead member swapped for the first
/// live non-member in rendezvous order of `ns`; a dead member with no spare
/// live node stays (forwarding passes over it). None when nothing changes.
pub fn replaced_members(
    ns: &str,
    members: &[String],
    dead: &[String],
    live: &[String],
) -> Option<Vec<String>> {
    let order = rendezvous(live, ns);
    let mut out = members.to_vec();
    let mut changed = false;
    for i in 0..out.len() {
        if !dead.contains(&out[i]) {
            continue;
        }
        let Some(next) = order
            .iter()
            .find(|c| !out.contains(c) && !members.contains(c))
        else {
            continue;
        };
        out[i] = (*next).clone();
        changed = true;
    }
    changed.then_some(out)
}

/// The namespace a record key `ns/<name>` names.
fn record_namespace(key: &[u8]) -> Option<&str> {
    let name = std::str::from_utf8(key.strip_prefix(b"ns/")?).ok()?;
    (!name.is_empty() && !name.contains('/')).then_some(name)
}

/// A node's replacement sweep: when each absent node was first seen absent.
pub struct Replacer {
    cluster: Arc<Cluster>,
    after: Duration,
    missing_since: HashMap<String, Instant>,
}

impl Replacer {
    /// A sweep for `cluster` replacing members gone for `after`.
    pub fn new(cluster: Arc<Cluster>, after: Duration) -> Self {
        Self {
            cluster,
            after,
            missing_since: HashMap::new(),
        }
    }

    /// One sweep at `now`: [`Replacer::plan`], then [`Replacer::apply`].
    pub async fn sweep(
        &mut self,
        now: Instant,
    ) -> Result<Vec<(String, Outcome)>, crate::storage::StoreError> {
        let moves = self.plan(now).await?;
        self.apply(moves).await
    }

    /// Reads the registry and every namespace record at `now`: the records
    /// to rewrite (at most [`MOVES_PER_SWEEP`]), each with the bytes read.
    pub async fn plan(&mut self, now: Instant) -> Result<Vec<Move>, crate::storage::StoreError> {
        let store = self.cluster.store.clone();
        self.cluster.refresh().await?;
        let live: Vec<String> = self.cluster.live().into_iter().map(|n| n.id).collect();
        let mut named: Vec<String> = Vec::new();
        let mut parsed = Vec::new();
        for (k, v) in store.scan_all(b"ns/").await? {
            let Some(name) = record_namespace(&k) else {
                continue;
            };
            let Ok(rec) = serde_json::from_slice::<NamespaceRecord>(&v) else {
                continue;
            };
            for m in &rec.members {
                if !live.contains(m) && !named.contains(m) {
                    named.push(m.clone());
                }
            }
            parsed.push((name.to_string(), rec, v));
        }
        // The clock of an absence starts when this node first sees it.
        self.missing_since.retain(|id, _| named.contains(id));
        for id in &named {
            self.missing_since.entry(id.clone()).or_insert(now);
        }
        let dead: Vec<String> = self
            .missing_since
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= self.after)
            .map(|(id, _)| id.clone())
            .collect();
        let mut moves = Vec::new();
        if dead.is_empty() || live.is_empty() {
            return Ok(moves);
        }
        for (name, rec, bytes) in parsed {
            if moves.len() >= MOVES_PER_SWEEP {
                break;
            }
            let Some(members) = replaced_members(&name, &rec.members, &dead, &live) else {
                continue;
            };
            let new = NamespaceRecord { members, ..rec };
            let Ok(new_bytes) = serde_json::to_vec(&new) else {
                continue;
            };
            moves.push(Move {
                namespace: name,
                members: new.members,
                read: bytes,
                write: new_bytes,
            });
        }
        Ok(moves)
    }

    /// Writes each move by compare-and-swap against the bytes its plan
    /// read: exactly one of several nodes applying the same move wins.
    pub async fn apply(
        &self,
        moves: Vec<Move>,
    ) -> Result<Vec<(String, Outcome)>, crate::storage::StoreError> {
        let store = &self.cluster.store;
        let mut done = Vec::with_capacity(moves.len());
        for m in moves {
            let key = crate::namespace::ns_key(&m.namespace);
            let won = store
                .compare_and_swap(&key, Some(&m.read), Some(&m.write), None)
                .await?;
            if won {
                tracing::warn!(namespace = %m.namespace, members = ?m.members, "Namespace member replaced: its node is gone.");
            }
            done.push((
                m.namespace,
                if won {
                    Outcome::Replaced
                } else {
                    Outcome::Lost
                },
            ));
        }
        Ok(done)
    }
}

/// One namespace record to rewrite with new members.
pub struct Move {
    /// The namespace.
    pub namespace: String,
    /// Its new members.
    pub members: Vec<String>,
    /// The record's bytes as the plan read them (the swap's guard).
    read: Vec<u8>,
    /// The new record's bytes.
    write: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// A dead member is swapped in place for the first live non-member in
    /// the namespace's rendezvous order; live members and order stay; with
    /// no spare node nothing changes; no node is named twice.
    #[test]
    fn dead_members_swapped_by_rendezvous() {
        let live = ids(&["a", "c", "d"]);
        let out = replaced_members("shop", &ids(&["b", "a"]), &ids(&["b"]), &live).unwrap();
        assert_eq!(out[1], "a");
        let expect = rendezvous(&live, "shop")
            .into_iter()
            .find(|c| *c != "a")
            .unwrap()
            .clone();
        assert_eq!(out[0], expect);
        assert!(replaced_members("shop", &ids(&["a"]), &ids(&["b"]), &live).is_none());
        assert!(
            replaced_members("shop", &ids(&["a", "c", "d", "b"]), &ids(&["b"]), &live).is_none()
        );
        let two = replaced_members("x", &ids(&["b", "e"]), &ids(&["b", "e"]), &live).unwrap();
        assert_ne!(two[0], two[1]);
        assert!(two.iter().all(|m| live.contains(m)));
    }

    /// Two nodes that both saw a member gone long enough race to replace
    /// it: both plan the same move, exactly one compare-and-swap writes it,
    /// the other is `Lost`, and the record names the rendezvous choice.
    /// Before `after` has passed nothing is planned.
    #[actix_rt::test]
    async fn two_nodes_racing_replace_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::storage::Store::open_sled(dir.path()).unwrap();
        let rec = NamespaceRecord {
            members: ids(&["gone"]),
            ..NamespaceRecord::new("shop", 1)
        };
        store
            .put(
                &crate::namespace::ns_key("shop"),
                &serde_json::to_vec(&rec).unwrap(),
            )
            .await
            .unwrap();
        let every = Duration::from_secs(60);
        let a = Cluster::start(store.clone(), "a".into(), "http://a".into(), vec![], every)
            .await
            .unwrap();
        let c = Cluster::start(store.clone(), "c".into(), "http://c".into(), vec![], every)
            .await
            .unwrap();
        let after = Duration::from_secs(5);
        let (mut ra, mut rc) = (Replacer::new(a, after), Replacer::new(c, after));
        let t0 = crate::util::mono_now();
        assert!(ra.plan(t0).await.unwrap().is_empty());
        assert!(rc.plan(t0).await.unwrap().is_empty());
        let later = t0 + Duration::from_secs(4);
        assert!(
            ra.plan(later).await.unwrap().is_empty(),
            "replaced before `after`"
        );
        let t1 = t0 + after;
        let (pa, pc) = (ra.plan(t1).await.unwrap(), rc.plan(t1).await.unwrap());
        assert_eq!((pa.len(), pc.len()), (1, 1));
        let chosen = rendezvous(&ids(&["a", "c"]), "shop")[0].clone();
        assert_eq!(pa[0].members, vec![chosen.clone()]);
        assert_eq!(pc[0].members, vec![chosen.clone()]);
        let wa = ra.apply(pa).await.unwrap();
        let wc = rc.apply(pc).await.unwrap();
        assert_eq!(wa, vec![("shop".to_string(), Outcome::Replaced)]);
        assert_eq!(wc, vec![("shop".to_string(), Outcome::Lost)]);
        let now: NamespaceRecord = store
            .get_json(&crate::namespace::ns_key("shop"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(now.members, vec![chosen]);
        // Nothing is left to replace.
        assert!(rc.plan(t1 + after).await.unwrap().is_empty());
    }

    /// The sweep interval is a fifth of the wait, within 1 to 10 s.
    #[test]
    fn sweep_interval_bounds() {
        assert_eq!(sweep_every(Duration::from_secs(5)), Duration::from_secs(1));
        assert_eq!(sweep_every(Duration::from_secs(30)), Duration::from_secs(6));
        assert_eq!(
            sweep_every(Duration::from_secs(300)),
            Duration::from_secs(10)
        );
    }
}
