//! The sampler: one task per node that reads every number once per tick, keeps a
//! bounded history for the charts, and hands the same pre-rendered frame to every
//! viewer (one snapshot per tick however many pages are open).
//!
//! It ticks only while someone watches: an open event stream, or a JSON API
//! request in the last [`POLL_KEEPALIVE`]. With nobody watching it waits on a
//! [`Notify`] with no timer armed, so an unwatched dashboard costs no CPU
//! however many namespaces the node holds; a stream being opened or an API
//! request wakes it, and the first tick after a pause is taken at once.

use super::reading::{self, Previous};
use crate::http::state::{Node, NodeInner};
use std::sync::Arc;
use std::time::Duration;

/// How often the sampler reads the registry and the stream sends a frame.
pub const TICK_INTERVAL: Duration = Duration::from_secs(1);
/// Namespaces are re-listed from the store every this many ticks.
pub const NAMESPACE_LIST_TICKS: u64 = 5;
/// Most namespaces listed from the store (counted and searched).
pub const MAX_LISTED_NAMESPACES: usize = 1_000_000;
/// Starts the node's sampler; it stops when the node is dropped. It ticks
/// while [`Dashboard::watched`] holds and otherwise sleeps on the dashboard's
/// [`Notify`] with no timer.
pub fn spawn_sampler(node: &Node) {
    let weak: std::sync::Weak<NodeInner> = Arc::downgrade(&node.0);
    actix_web::rt::spawn(async move {
        let mut prev = Previous::default();
        let mut known: Arc<Vec<String>> = Arc::default();
        loop {
            // Nobody watching: wait for a stream or a request, no timer armed.
            // A wake that comes between the check and the wait is kept by the
            // Notify as a permit, so none is lost.
            let idle = {
                let Some(inner) = weak.upgrade() else { return };
                (!inner.dashboard.watched()).then(|| inner.dashboard.wake.clone())
            };
            if let Some(wake) = idle {
                wake.notified().await;
                continue;
            }
            let mut tick = tokio::time::interval(TICK_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut n: u64 = 0;
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                let node = Node(inner);
                if !node.dashboard.watched() {
                    prev.pause();
                    break;
                }
                if n.is_multiple_of(NAMESPACE_LIST_TICKS) {
                    known = Arc::new(listed_namespaces(&node).await);
                }
                n += 1;
                let top = node.config.dashboard.top_namespaces;
                let snap = reading::take(&node, &mut prev, &known, top);
                node.metrics.dashboard_snapshots.inc();
                node.dashboard.publish(snap);
            }
        }
    });
}

/// Names of the namespaces in the store, so idle ones (no supervisor running yet)
/// are shown too.
async fn listed_namespaces(node: &Node) -> Vec<String> {
    use crate::storage::OrderedKv;
    match node.store.scan_prefix(b"ns/", MAX_LISTED_NAMESPACES).await {
        Ok(rows) => rows
            .into_iter()
            .filter_map(|(k, _)| String::from_utf8(k[3..].to_vec()).ok())
            .filter(|name| !name.contains('/'))
            .collect(),
        Err(e) => {
            tracing::warn!(error = %e, "Dashboard could not list namespaces.");
            Vec::new()
        }
    }
}
