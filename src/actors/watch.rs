//! Follows namespace record changes made anywhere in the cluster and tells
//! the node: the running supervisor reloads, the read copy
//! (`actors/records.rs`) is dropped, a deleted namespace's supervisor stops.

use std::time::Duration;

use super::namespace::ReloadRecord;
use super::node::{Forget, Namespaces, NodeSupervisor, WakeMember};
use super::records::{Records, changed_namespace};
use crate::storage::Store;

/// First wait before a broken record watch is made again.
const WATCH_BACKOFF_MIN: Duration = Duration::from_millis(200);
/// Longest wait between attempts to make the record watch again.
const WATCH_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Follows record changes made anywhere in the cluster (on the embedded
/// store every write is this node's own, and the watch never fires): a
/// changed record is reloaded by its running supervisor or its read copy
/// dropped; a deleted namespace's supervisor is stopped (its sockets closed).
/// After a broken watch is made again, every snapshot is refreshed, since
/// changes may have been missed meanwhile. Ends when the node supervisor does.
pub fn follow(
    store: Store,
    records: Records,
    namespaces: Namespaces,
    supervisor: actix::Addr<NodeSupervisor>,
) {
    actix::spawn(async move {
        let mut backoff = WATCH_BACKOFF_MIN;
        let mut first = true;
        while supervisor.connected() {
            match store.watch_prefix(b"ns/").await {
                Ok(mut watch) => {
                    backoff = WATCH_BACKOFF_MIN;
                    if !first {
                        records.refresh_all();
                        for h in namespaces.handles() {
                            h.addr.do_send(ReloadRecord);
                        }
                    }
                    first = false;
                    loop {
                        let changes = match watch.next().await {
                            Ok(c) => c,
                            Err(e) => {
                                tracing::warn!(error = %e, "Namespace record watch broke; watching again.");
                                break;
                            }
                        };
                        for c in changes {
                            apply(&records, &namespaces, &supervisor, c);
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "Namespace record watch not started; retrying.")
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(WATCH_BACKOFF_MAX);
        }
    });
}

fn apply(
    records: &Records,
    namespaces: &Namespaces,
    supervisor: &actix::Addr<NodeSupervisor>,
    change: crate::storage::Change,
) {
    use crate::storage::Change;
    match change {
        Change::Put(key) => {
            let Some(ns) = changed_namespace(&key) else {
                return;
            };
            records.forget_read(ns);
            match namespaces.get(ns) {
                Some(h) => h.addr.do_send(ReloadRecord),
                // A node the change made a member starts serving now.
                None => supervisor.do_send(WakeMember {
                    name: ns.to_string(),
                }),
            }
        }
        Change::Delete(key) => {
            let Some(ns) = changed_namespace(&key) else {
                return;
            };
            records.forget_read(ns);
            supervisor.do_send(Forget {
                name: ns.to_string(),
            });
        }
    }
}
