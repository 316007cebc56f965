//! The node's one cron timer: a heap of the next fire times of every cron
//! schedule of the namespaces that have one, kept by the `NodeSupervisor`.
//!
//! No namespace keeps a timer of its own: a namespace supervisor may be
//! passivated (stopped while idle), and a million namespaces without cron
//! should cost the node nothing per second. When a slot is due, the node
//! supervisor wakes the namespace's supervisor (starting it if it sleeps)
//! with one [`CronDue`]; the supervisor's invoker claims each slot in the
//! store (once per cluster) and runs it, as before.
//!
//! The schedules come from two places: at start, [`stored_crons`] reads them
//! from the store for the namespaces this node is a member of; afterwards a
//! member's invoker sends its whole set ([`CronSet`]) whenever its triggers
//! change (deploy, delete, import, a supervisor start).

#![forbid(unsafe_code)]

use chrono::{DateTime, Utc};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use actix::prelude::*;

/// One cron schedule of one function.
#[derive(Clone, Debug)]
pub struct CronEntry {
    /// The function it fires.
    pub function: String,
    /// The expression as deployed (it goes into the event).
    pub expr: String,
    /// The parsed schedule (UTC).
    pub schedule: cron::Schedule,
}

/// Sent by a member namespace's invoker (with `do_send`) to the node
/// supervisor whenever its triggers change, and by the node at start: the
/// namespace's whole set of cron schedules, replacing the one before (empty:
/// none). No reply.
#[derive(Message)]
#[rtype(result = "()")]
pub struct CronSet {
    /// The namespace.
    pub namespace: String,
    /// Its cron schedules now.
    pub entries: Vec<CronEntry>,
}

/// One due slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CronFire {
    /// The function to fire.
    pub function: String,
    /// Its cron expression.
    pub expr: String,
    /// The slot, unix seconds (UTC).
    pub slot: i64,
}

/// Sent by the node supervisor's cron timer to a namespace's supervisor
/// (started for it when it slept), past admission but counted in its depth:
/// these slots of its functions are due. No reply; the slots are claimed and
/// run on the invoker's own time.
#[derive(Message)]
#[rtype(result = "()")]
pub struct CronDue {
    /// The due slots.
    pub fires: Vec<CronFire>,
}

/// The schedules and their heap of next fire times. Entries of a replaced
/// or removed set stay in the heap until they come up (then they are
/// dropped: their generation is gone) or until a compaction.
#[derive(Default)]
pub struct CronTable {
    /// Each namespace's generation and schedules.
    by_ns: HashMap<String, (u64, Vec<CronEntry>)>,
    /// (next fire, unix seconds; generation; namespace; index in its set).
    heap: BinaryHeap<Reverse<(i64, u64, String, usize)>>,
    /// The next set's generation.
    next_gen: u64,
    /// Schedules in `by_ns`, summed (compaction's measure).
    live: usize,
}

impl CronTable {
    /// Replaces the schedules of `ns` (empty removes them); the next fire of
    /// each is its first slot after `now`.
    pub fn set(&mut self, ns: &str, entries: Vec<CronEntry>, now: DateTime<Utc>) {
        self.remove(ns);
        if entries.is_empty() {
            return;
        }
        self.next_gen += 1;
        let generation = self.next_gen;
        for (i, e) in entries.iter().enumerate() {
            if let Some(t) = e.schedule.after(&now).next() {
                self.heap
                    .push(Reverse((t.timestamp(), generation, ns.to_string(), i)));
            }
        }
        self.live += entries.len();
        self.by_ns.insert(ns.to_string(), (generation, entries));
        // Replaced sets leave their entries behind: drop them once they
        // outnumber the live ones.
        if self.heap.len() > 2 * self.live + 64 {
            let by_ns = &self.by_ns;
            self.heap
                .retain(|Reverse((_, g, n, _))| by_ns.get(n).is_some_and(|(cur, _)| cur == g));
        }
    }

    /// Forgets the schedules of `ns` (its namespace was deleted).
    pub fn remove(&mut self, ns: &str) {
        if let Some((_, old)) = self.by_ns.remove(ns) {
            self.live -= old.len();
        }
    }

    /// Namespaces with cron schedules.
    pub fn namespaces(&self) -> usize {
        self.by_ns.len()
    }

    /// The earliest next fire in the heap (unix seconds); it may belong to a
    /// replaced set, which only wakes the timer for nothing.
    pub fn next_due(&self) -> Option<i64> {
        self.heap.peek().map(|Reverse((t, ..))| *t)
    }

    /// Takes every slot due at `now`, grouped by namespace, and schedules
    /// each entry's next slot after `now` (a timer that ran late fires the
    /// slot it missed once, never a burst of them).
    pub fn pop_due(&mut self, now: DateTime<Utc>) -> Vec<(String, Vec<CronFire>)> {
        let now_s = now.timestamp();
        let mut due: HashMap<String, Vec<CronFire>> = HashMap::new();
        while self.heap.peek().is_some_and(|Reverse((t, ..))| *t <= now_s) {
            let Some(Reverse((slot, generation, ns, i))) = self.heap.pop() else {
                break;
            };
            let Some((cur, entries)) = self.by_ns.get(&ns) else {
                continue;
            };
            if *cur != generation {
                continue;
            }
            let Some(e) = entries.get(i) else { continue };
            due.entry(ns.clone()).or_default().push(CronFire {
                function: e.function.clone(),
                expr: e.expr.clone(),
                slot,
            });
            if let Some(next) = e.schedule.after(&now).next() {
                self.heap
                    .push(Reverse((next.timestamp(), generation, ns, i)));
            }
        }
        due.into_iter().collect()
    }
}

/// The cron schedules stored for every namespace (each function's current
/// version), read at start (the caller keeps the namespaces this node is a
/// member of). A record that does not decode is skipped.
pub async fn stored_crons(
    store: &crate::storage::Store,
) -> crate::storage::StoreResult<HashMap<String, Vec<CronEntry>>> {
    crons_under(store, b"fn/").await
}

/// The cron schedules stored for namespace `ns` alone (a node made one of
/// its members schedules them: `NodeSupervisor`'s `WakeMember`).
pub async fn stored_crons_of(
    store: &crate::storage::Store,
    ns: &str,
) -> crate::storage::StoreResult<Vec<CronEntry>> {
    Ok(crons_under(store, format!("fn/{ns}/").as_bytes())
        .await?
        .remove(ns)
        .unwrap_or_default())
}

async fn crons_under(
    store: &crate::storage::Store,
    prefix: &[u8],
) -> crate::storage::StoreResult<HashMap<String, Vec<CronEntry>>> {
    use crate::functions::model::{FunctionRecord, VersionMeta, parse_cron, ver_key};
    let mut out: HashMap<String, Vec<CronEntry>> = HashMap::new();
    for (k, v) in store.scan_all(prefix).await? {
        let Some(ns) = std::str::from_utf8(&k)
            .ok()
            .and_then(|k| k.strip_prefix("fn/")?.split('/').next())
        else {
            continue;
        };
        let Ok(rec) = serde_json::from_slice::<FunctionRecord>(&v) else {
            continue;
        };
        let Some(meta) = store
            .get_json::<VersionMeta>(&ver_key(ns, &rec.name, rec.current_version))
            .await?
        else {
            continue;
        };
        for expr in &meta.cron {
            if let Ok(schedule) = parse_cron(expr) {
                out.entry(ns.to_string()).or_default().push(CronEntry {
                    function: rec.name.clone(),
                    expr: expr.clone(),
                    schedule,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn entry(function: &str, expr: &str) -> CronEntry {
        CronEntry {
            function: function.into(),
            expr: expr.into(),
            schedule: crate::functions::model::parse_cron(expr).unwrap(),
        }
    }

    fn at(s: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(s, 0).unwrap()
    }

    /// A slot is due at its second, not before; each slot fires once; a
    /// late timer fires the missed slot once and moves on.
    #[test]
    fn slots_come_due_in_order_once() {
        let mut t = CronTable::default();
        t.set("a", vec![entry("tick", "*/10 * * * * *")], at(1_000));
        assert_eq!(t.next_due(), Some(1_010));
        assert!(t.pop_due(at(1_009)).is_empty());
        let due = t.pop_due(at(1_010));
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].1[0].slot, 1_010);
        assert!(t.pop_due(at(1_010)).is_empty());
        // Late by 35 s: the slot at 1020 fires once, the next is 1050.
        let due = t.pop_due(at(1_045));
        assert_eq!(due[0].1.len(), 1);
        assert_eq!(t.next_due(), Some(1_050));
    }

    /// A replaced set's old entries never fire; a removed namespace fires
    /// nothing; the heap does not grow without bound under replacements.
    #[test]
    fn replaced_and_removed_sets_do_not_fire() {
        let mut t = CronTable::default();
        t.set("a", vec![entry("old", "* * * * * *")], at(0));
        t.set("a", vec![entry("new", "* * * * * *")], at(0));
        let due = t.pop_due(at(1));
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].1.len(), 1);
        assert_eq!(due[0].1[0].function, "new");
        t.set("b", vec![entry("x", "* * * * * *")], at(1));
        t.remove("b");
        assert!(t.pop_due(at(2)).iter().all(|(ns, _)| ns != "b"));
        assert_eq!(t.namespaces(), 1);
        for _ in 0..1_000 {
            t.set("a", vec![entry("new", "0 0 * * * *")], at(2));
        }
        assert!(t.heap.len() <= 2 * t.live + 65, "{}", t.heap.len());
    }
}
