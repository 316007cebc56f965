//! The series with a `namespace` label, kept so that a scrape costs the same
//! at a thousand namespaces and at a million.
//!
//! Each family ([`NsCounterVec`], [`NsGaugeVec`], [`NsHistogramVec`]) keeps
//! two things, both moved by one call on the hot path:
//!
//! - every namespace's own series, held by the namespace's [`NsEntry`] in the
//!   [`NsIndex`] (what the exported top N, the dashboard and
//!   `GET /v1/namespaces/{namespace}/stats` read);
//! - the node totals of the family without the `namespace` label (one series
//!   per value of the other labels), what the public exposition shows and
//!   what `_other` is derived from: the totals minus the exported series.
//!
//! The exported top N is ranked by cumulative activity, which only grows: a
//! namespace outside the last top N whose activity did not move cannot have
//! entered it. So a scrape ranks the last top N and the namespaces whose
//! activity moved since (each queued once, by its first move after a
//! ranking) instead of every namespace, and the result is the same.

#![deny(clippy::unwrap_used)]

use parking_lot::{Mutex, RwLock};
use prometheus::core::Metric as _;
use prometheus::proto::{self, LabelPair, MetricFamily, MetricType};
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Shards of the namespace map: a series lookup locks one.
const SHARDS: usize = 64;

/// The `namespace` label value every namespace outside the exported top N
/// is summed into.
pub const OTHER_NAMESPACE: &str = "_other";

/// Counters whose per-namespace sum is a namespace's activity, the rank that
/// picks the exported top N.
const ACTIVITY_FAMILIES: &[&str] = &[
    "meshgate_actor_messages_handled_total",
    "meshgate_pubsub_published_total",
    "meshgate_function_invocations_total",
];

/// One metric value of either kind, series or total.
#[derive(Clone)]
enum Handle {
    Counter(IntCounter),
    Gauge(IntGauge),
    Histogram(Histogram),
}

impl Handle {
    fn proto(&self) -> proto::Metric {
        match self {
            Handle::Counter(c) => c.metric(),
            Handle::Gauge(g) => g.metric(),
            Handle::Histogram(h) => h.metric(),
        }
    }
}

/// One family's definition and its node totals.
struct Family {
    /// Position among the index's families (a series names its family by it).
    id: usize,
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    /// Every label name, `namespace` included, in the order callers give values.
    labels: Vec<&'static str>,
    /// Where `namespace` is in `labels`.
    ns_pos: usize,
    /// Whether its counters count toward a namespace's activity (the rank).
    activity: bool,
    /// Histogram buckets.
    buckets: Vec<f64>,
    /// A series never exported, counted into should a series fail to be
    /// made (it cannot: the family's names were checked when it was made).
    spare: Handle,
    /// The node totals, labelled by every label but `namespace`.
    totals: Totals,
    /// How many namespaces hold a series for each value of the other labels:
    /// an `_other` series exists where some are not exported.
    holders: Mutex<HashMap<Box<[String]>, usize>>,
}

/// A family's totals vector.
enum Totals {
    Counter(IntCounterVec),
    Gauge(IntGaugeVec),
    Histogram(HistogramVec),
}

impl Totals {
    fn get(&self, combo: &[String]) -> Handle {
        let vals: Vec<&str> = combo.iter().map(String::as_str).collect();
        // The label count is the family's own, fixed at registration.
        match self {
            Totals::Counter(v) => Handle::Counter(v.with_label_values(&vals)),
            Totals::Gauge(v) => Handle::Gauge(v.with_label_values(&vals)),
            Totals::Histogram(v) => Handle::Histogram(v.with_label_values(&vals)),
        }
    }

    fn collect(&self) -> Vec<MetricFamily> {
        use prometheus::core::Collector;
        match self {
            Totals::Counter(v) => v.collect(),
            Totals::Gauge(v) => v.collect(),
            Totals::Histogram(v) => v.collect(),
        }
    }
}

/// One series of one namespace, with its family's total for the same other
/// labels.
struct Cell {
    family: Arc<Family>,
    /// The values of the labels other than `namespace`, in the family's order.
    combo: Box<[String]>,
    series: Handle,
    total: Handle,
    entry: Arc<NsEntry>,
    /// Serializes `set` on a gauge (read the old value, move the total by
    /// the difference).
    set_lock: Mutex<()>,
}

impl Cell {
    /// Marks the namespace for the next ranking, when this is an activity
    /// counter (once per ranking: a flag read on the hot path).
    fn moved(&self) {
        if self.family.activity {
            self.entry.mark();
        }
    }

    /// The value of label `name` on this series.
    fn label(&self, name: &str) -> Option<&str> {
        let mut others = self.combo.iter();
        for (i, l) in self.family.labels.iter().enumerate() {
            let v = if i == self.family.ns_pos {
                Some(self.entry.name.as_ref())
            } else {
                others.next().map(String::as_str)
            };
            if *l == name {
                return v;
            }
        }
        None
    }
}

/// One namespace (or the node's own series, the empty name) and its series.
pub struct NsEntry {
    name: Box<str>,
    /// Set when queued for the next ranking; cleared by the ranking.
    dirty: AtomicBool,
    series: Mutex<Vec<Arc<Cell>>>,
    index: std::sync::Weak<NsIndex>,
}

impl NsEntry {
    /// The namespace's name (empty: the node's own series).
    pub fn name(&self) -> &str {
        &self.name
    }

    fn mark(self: &Arc<Self>) {
        if self.name.is_empty() || self.dirty.load(Ordering::SeqCst) {
            return;
        }
        if !self.dirty.swap(true, Ordering::SeqCst)
            && let Some(index) = self.index.upgrade()
        {
            index.dirty.lock().push(self.clone());
        }
    }

    /// The sum of its activity counters: the rank.
    fn activity(&self) -> u64 {
        self.series
            .lock()
            .iter()
            .filter(|c| c.family.activity)
            .map(|c| match &c.series {
                Handle::Counter(x) => x.get(),
                _ => 0,
            })
            .sum()
    }
}

/// The last ranking: the exact top `limit` as of then.
#[derive(Default)]
struct Ranking {
    limit: usize,
    top: Vec<Arc<NsEntry>>,
}

/// Every namespace with a series on this node, by name.
pub struct NsIndex {
    shards: Vec<RwLock<HashMap<Box<str>, Arc<NsEntry>>>>,
    hasher: std::collections::hash_map::RandomState,
    families: Mutex<Vec<Arc<Family>>>,
    /// Namespaces whose activity moved (or that appeared) since the last ranking.
    dirty: Mutex<Vec<Arc<NsEntry>>>,
    ranking: Mutex<Ranking>,
    /// How many namespaces the last ranking read.
    last_ranked: AtomicUsize,
}

impl NsIndex {
    pub fn new() -> Arc<NsIndex> {
        Arc::new(NsIndex {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            hasher: Default::default(),
            families: Mutex::default(),
            dirty: Mutex::default(),
            ranking: Mutex::default(),
            last_ranked: AtomicUsize::new(0),
        })
    }

    fn shard(&self, name: &str) -> &RwLock<HashMap<Box<str>, Arc<NsEntry>>> {
        let mut h = self.hasher.build_hasher();
        name.hash(&mut h);
        &self.shards[(h.finish() as usize) % SHARDS]
    }

    /// The namespace's entry, if it has any series.
    fn get(&self, name: &str) -> Option<Arc<NsEntry>> {
        self.shard(name).read().get(name).cloned()
    }

    /// The namespace's entry, created (and queued for ranking) on first use.
    fn entry(self: &Arc<Self>, name: &str) -> Arc<NsEntry> {
        if let Some(e) = self.get(name) {
            return e;
        }
        let mut shard = self.shard(name).write();
        if let Some(e) = shard.get(name) {
            return e.clone();
        }
        let e = Arc::new(NsEntry {
            name: name.into(),
            dirty: AtomicBool::new(false),
            series: Mutex::default(),
            index: Arc::downgrade(self),
        });
        shard.insert(name.into(), e.clone());
        drop(shard);
        // A namespace with series ranks (last, by name) even without activity.
        e.mark();
        e
    }

    /// Every entry: O(namespaces), for the dashboard's full reading and a
    /// ranking with a larger limit than the last.
    fn all(&self) -> Vec<Arc<NsEntry>> {
        let mut out = Vec::new();
        for s in &self.shards {
            out.extend(s.read().values().cloned());
        }
        out
    }

    // Families are made at start-up, from names written in `metrics/mod.rs`:
    // a bad one is a programming error, found before any request.
    #[allow(clippy::unwrap_used)]
    fn family(
        self: &Arc<Self>,
        name: &'static str,
        help: &'static str,
        kind: MetricType,
        labels: &[&'static str],
        buckets: Vec<f64>,
    ) -> Arc<Family> {
        let ns_pos = labels
            .iter()
            .position(|l| *l == "namespace")
            .expect("a namespaced family has a namespace label");
        let others: Vec<&str> = labels
            .iter()
            .copied()
            .filter(|l| *l != "namespace")
            .collect();
        let totals = match kind {
            MetricType::COUNTER => {
                Totals::Counter(IntCounterVec::new(Opts::new(name, help), &others).unwrap())
            }
            MetricType::GAUGE => {
                Totals::Gauge(IntGaugeVec::new(Opts::new(name, help), &others).unwrap())
            }
            _ => Totals::Histogram(
                HistogramVec::new(
                    HistogramOpts::new(name, help).buckets(buckets.clone()),
                    &others,
                )
                .unwrap(),
            ),
        };
        let mut families = self.families.lock();
        let mut f = Family {
            id: families.len(),
            name,
            help,
            kind,
            labels: labels.to_vec(),
            ns_pos,
            activity: ACTIVITY_FAMILIES.contains(&name),
            buckets,
            spare: Handle::Gauge(IntGauge::new("meshgate_spare", "spare").unwrap()),
            totals,
            holders: Mutex::default(),
        };
        // Made once at start-up: its names are the family's, so every
        // series of the family can be made too.
        f.spare = new_series(&f, HashMap::new()).unwrap();
        let f = Arc::new(f);
        families.push(f.clone());
        f
    }

    /// The series of `family` for `values` (the family's labels in order),
    /// created with its total on first use.
    fn cell(self: &Arc<Self>, family: &Arc<Family>, values: &[&str]) -> Arc<Cell> {
        assert_eq!(
            values.len(),
            family.labels.len(),
            "{}: label values",
            family.name
        );
        let ns = values[family.ns_pos];
        let entry = self.entry(ns);
        let same = |c: &Cell| {
            c.family.id == family.id
                && values
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != family.ns_pos)
                    .map(|(_, v)| *v)
                    .eq(c.combo.iter().map(String::as_str))
        };
        let mut series = entry.series.lock();
        if let Some(c) = series.iter().find(|c| same(c)) {
            return c.clone();
        }
        let combo: Box<[String]> = values
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != family.ns_pos)
            .map(|(_, v)| v.to_string())
            .collect();
        let labels: HashMap<String, String> = family
            .labels
            .iter()
            .zip(values)
            .map(|(l, v)| (l.to_string(), v.to_string()))
            .collect();
        // The names and help are the family's, checked when it was made
        // (label values are not checked): this cannot fail, and would count
        // into the family's spare series rather than panic.
        let handle = new_series(family, labels).unwrap_or_else(|e| {
            tracing::warn!(family = family.name, error = %e, "Series not made.");
            family.spare.clone()
        });
        let total = family.totals.get(&combo);
        *family.holders.lock().entry(combo.clone()).or_insert(0) += 1;
        let cell = Arc::new(Cell {
            family: family.clone(),
            combo,
            series: handle,
            total,
            entry: entry.clone(),
            set_lock: Mutex::new(()),
        });
        series.push(cell.clone());
        cell
    }

    /// The `limit` namespaces with the most activity (ties by name), from
    /// the last ranking and the namespaces queued since: O(limit + moved).
    pub fn top(&self, limit: usize) -> Vec<Arc<NsEntry>> {
        let mut ranking = self.ranking.lock();
        let queued = std::mem::take(&mut *self.dirty.lock());
        let mut candidates: Vec<Arc<NsEntry>> = if limit > ranking.limit {
            // The last ranking kept fewer than asked: rank everyone once.
            ranking.limit = limit;
            for e in &queued {
                e.dirty.store(false, Ordering::SeqCst);
            }
            self.all()
        } else {
            // Cleared before reading, so a move after the read queues again.
            for e in &queued {
                e.dirty.store(false, Ordering::SeqCst);
            }
            let mut c = std::mem::take(&mut ranking.top);
            c.extend(queued);
            c.sort_by_key(|e| Arc::as_ptr(e) as usize);
            c.dedup_by_key(|e| Arc::as_ptr(e) as usize);
            c
        };
        candidates.retain(|e| !e.name.is_empty());
        self.last_ranked.store(candidates.len(), Ordering::Relaxed);
        let mut ranked: Vec<(u64, Arc<NsEntry>)> =
            candidates.into_iter().map(|e| (e.activity(), e)).collect();
        let keep = ranking.limit;
        let order = |a: &(u64, Arc<NsEntry>), b: &(u64, Arc<NsEntry>)| {
            b.0.cmp(&a.0).then_with(|| a.1.name.cmp(&b.1.name))
        };
        if ranked.len() > keep && keep > 0 {
            ranked.select_nth_unstable_by(keep - 1, order);
        }
        ranked.truncate(keep);
        ranked.sort_by(order);
        ranking.top = ranked.into_iter().map(|(_, e)| e).collect();
        ranking.top.iter().take(limit).cloned().collect()
    }

    /// How many namespaces the last [`NsIndex::top`] read (the last top N
    /// and the namespaces that moved since).
    pub fn last_ranked(&self) -> usize {
        self.last_ranked.load(Ordering::Relaxed)
    }

    /// The operator's families: for each family, the series of `kept`
    /// namespaces (and of the node's own, the empty name) as they are, and
    /// per value of the other labels one `namespace="_other"` series holding
    /// the totals minus those, where some namespace outside `kept` has one.
    pub fn render(&self, kept: &[Arc<NsEntry>]) -> Vec<MetricFamily> {
        let node = self.get("");
        let kept: Vec<&Arc<NsEntry>> = node.iter().chain(kept).collect();
        let cells: Vec<Arc<Cell>> = kept.iter().flat_map(|e| e.series.lock().clone()).collect();
        let families = self.families.lock().clone();
        let mut out = Vec::new();
        for f in families {
            let mine: Vec<&Arc<Cell>> = cells.iter().filter(|c| c.family.id == f.id).collect();
            let mut metrics: Vec<proto::Metric> = mine.iter().map(|c| c.series.proto()).collect();
            let mut exported: HashMap<&[String], Vec<proto::Metric>> = HashMap::new();
            for (c, m) in mine.iter().zip(&metrics) {
                exported.entry(&c.combo).or_default().push(m.clone());
            }
            let holders = f.holders.lock().clone();
            for (combo, n) in &holders {
                let shown = exported.get(&combo[..]).map(Vec::len).unwrap_or(0);
                if *n <= shown {
                    continue;
                }
                let mut m = f.totals.get(combo).proto();
                for e in exported.get(&combo[..]).into_iter().flatten() {
                    subtract(&mut m, e);
                }
                let mut labels = m.take_label();
                let mut l = LabelPair::default();
                l.set_name("namespace".to_string());
                l.set_value(OTHER_NAMESPACE.to_string());
                labels.push(l);
                labels.sort_by(|a, b| a.name().cmp(b.name()));
                m.set_label(labels);
                metrics.push(m);
            }
            if metrics.is_empty() {
                continue;
            }
            metrics.sort_by(|a, b| {
                let key = |m: &proto::Metric| {
                    m.get_label()
                        .iter()
                        .map(|l| (l.name().to_string(), l.value().to_string()))
                        .collect::<Vec<_>>()
                };
                key(a).cmp(&key(b))
            });
            out.push(family_proto(&f, metrics));
        }
        out
    }

    /// Every family's node totals (no `namespace` label): O(label values).
    pub fn totals(&self) -> Vec<MetricFamily> {
        let families = self.families.lock().clone();
        families
            .iter()
            .flat_map(|f| f.totals.collect())
            .filter(|f| !f.get_metric().is_empty())
            .collect()
    }

    /// One family with every namespace's series: O(namespaces), for the
    /// dashboard's reading.
    fn collect_all(&self, family: &Family) -> Vec<MetricFamily> {
        let mut metrics = Vec::new();
        for e in self.all() {
            for c in e.series.lock().iter().filter(|c| c.family.id == family.id) {
                metrics.push(c.series.proto());
            }
        }
        vec![family_proto(family, metrics)]
    }

    /// Calls `each` with every series of one namespace: (family name, the
    /// series' label lookup, counter or gauge value).
    pub fn each_of(
        &self,
        namespace: &str,
        mut each: impl FnMut(&str, &dyn Fn(&str) -> String, f64),
    ) {
        if let Some(e) = self.get(namespace) {
            each_series(&e, &mut |_, family, label, v| each(family, label, v));
        }
    }

    /// Calls `each` with every series of one namespace whole: (family name,
    /// the series' label lookup, its record: a counter's or gauge's value,
    /// a histogram's count, sum and buckets). Reading creates no series.
    pub fn each_record_of(
        &self,
        namespace: &str,
        mut each: impl FnMut(&str, &dyn Fn(&str) -> String, &proto::Metric),
    ) {
        if let Some(e) = self.get(namespace) {
            let series = e.series.lock().clone();
            for c in series {
                let label = |n: &str| c.label(n).unwrap_or_default().to_string();
                each(c.family.name, &label, &c.series.proto());
            }
        }
    }

    /// Calls `each` with every series of every namespace: (namespace, family
    /// name, label lookup, value). O(namespaces), reading the values without
    /// building the exposition's records: the dashboard's reading.
    pub fn each_series(&self, mut each: impl FnMut(&str, &str, &dyn Fn(&str) -> String, f64)) {
        for e in self.all() {
            each_series(&e, &mut each);
        }
    }
}

/// `each` over one entry's series (histograms give their count).
fn each_series(e: &NsEntry, each: &mut dyn FnMut(&str, &str, &dyn Fn(&str) -> String, f64)) {
    let series = e.series.lock().clone();
    for c in series {
        let v = match &c.series {
            Handle::Counter(x) => x.get() as f64,
            Handle::Gauge(x) => x.get() as f64,
            Handle::Histogram(x) => x.get_sample_count() as f64,
        };
        let label = |n: &str| c.label(n).unwrap_or_default().to_string();
        each(&e.name, c.family.name, &label, v);
    }
}

/// A new series of `family` with these label values.
fn new_series(family: &Family, labels: HashMap<String, String>) -> prometheus::Result<Handle> {
    Ok(match family.kind {
        MetricType::COUNTER => Handle::Counter(IntCounter::with_opts(
            Opts::new(family.name, family.help).const_labels(labels),
        )?),
        MetricType::GAUGE => Handle::Gauge(IntGauge::with_opts(
            Opts::new(family.name, family.help).const_labels(labels),
        )?),
        _ => Handle::Histogram(Histogram::with_opts(
            HistogramOpts::new(family.name, family.help)
                .const_labels(labels)
                .buckets(family.buckets.clone()),
        )?),
    })
}

fn family_proto(f: &Family, metrics: Vec<proto::Metric>) -> MetricFamily {
    let mut fam = MetricFamily::default();
    fam.set_name(f.name.to_string());
    fam.set_help(f.help.to_string());
    fam.set_field_type(f.kind);
    fam.set_metric(metrics);
    fam
}

/// `into -= m` (counter, gauge, histogram count, sum and buckets).
fn subtract(into: &mut proto::Metric, m: &proto::Metric) {
    let mut c = into.get_counter().clone();
    c.set_value(c.get_value() - m.get_counter().get_value());
    into.set_counter(c);
    let mut g = into.get_gauge().clone();
    g.set_value(g.get_value() - m.get_gauge().get_value());
    into.set_gauge(g);
    let (a, b) = (into.get_histogram(), m.get_histogram());
    let mut h = a.clone();
    h.set_sample_count(a.get_sample_count().saturating_sub(b.get_sample_count()));
    // A float sum: never below zero from rounding.
    h.set_sample_sum((a.get_sample_sum() - b.get_sample_sum()).max(0.0));
    let buckets = a
        .get_bucket()
        .iter()
        .zip(b.get_bucket())
        .map(|(x, y)| {
            let mut z = x.clone();
            z.set_cumulative_count(x.cumulative_count().saturating_sub(y.cumulative_count()));
            z
        })
        .collect();
    h.set_bucket(buckets);
    into.set_histogram(h);
}

macro_rules! ns_vec {
    ($vec:ident, $one:ident, $doc:literal) => {
        #[doc = $doc]
        #[derive(Clone)]
        pub struct $vec {
            family: Arc<Family>,
            index: Arc<NsIndex>,
        }

        impl $vec {
            /// The series for `values` (the family's labels in order, the
            /// namespace's name included), created on first use.
            pub fn with_label_values(&self, values: &[&str]) -> $one {
                $one(self.index.cell(&self.family, values))
            }

            /// Every namespace's series (O(namespaces): the dashboard's
            /// reading, not a scrape's).
            pub fn collect(&self) -> Vec<MetricFamily> {
                self.index.collect_all(&self.family)
            }
        }

        /// One namespace's series of the family and its node total.
        #[derive(Clone)]
        pub struct $one(Arc<Cell>);
    };
}

ns_vec!(
    NsCounterVec,
    NsCounter,
    "A counter family with a `namespace` label."
);
ns_vec!(
    NsGaugeVec,
    NsGauge,
    "A gauge family with a `namespace` label."
);
ns_vec!(
    NsHistogramVec,
    NsHistogram,
    "A histogram family with a `namespace` label."
);

impl NsIndex {
    /// A counter family (`labels` include `namespace`).
    pub fn counter(
        self: &Arc<Self>,
        name: &'static str,
        help: &'static str,
        labels: &[&'static str],
    ) -> NsCounterVec {
        NsCounterVec {
            family: self.family(name, help, MetricType::COUNTER, labels, Vec::new()),
            index: self.clone(),
        }
    }

    /// A gauge family.
    pub fn gauge(
        self: &Arc<Self>,
        name: &'static str,
        help: &'static str,
        labels: &[&'static str],
    ) -> NsGaugeVec {
        NsGaugeVec {
            family: self.family(name, help, MetricType::GAUGE, labels, Vec::new()),
            index: self.clone(),
        }
    }

    /// A histogram family with `buckets`.
    pub fn histogram(
        self: &Arc<Self>,
        name: &'static str,
        help: &'static str,
        labels: &[&'static str],
        buckets: Vec<f64>,
    ) -> NsHistogramVec {
        NsHistogramVec {
            family: self.family(name, help, MetricType::HISTOGRAM, labels, buckets),
            index: self.clone(),
        }
    }
}

fn counter(h: &Handle) -> Option<&IntCounter> {
    match h {
        Handle::Counter(c) => Some(c),
        _ => None,
    }
}

fn gauge(h: &Handle) -> Option<&IntGauge> {
    match h {
        Handle::Gauge(g) => Some(g),
        _ => None,
    }
}

fn histogram(h: &Handle) -> Option<&Histogram> {
    match h {
        Handle::Histogram(x) => Some(x),
        _ => None,
    }
}

impl NsCounter {
    pub fn inc(&self) {
        self.inc_by(1);
    }

    pub fn inc_by(&self, n: u64) {
        if let (Some(s), Some(t)) = (counter(&self.0.series), counter(&self.0.total)) {
            s.inc_by(n);
            t.inc_by(n);
        }
        self.0.moved();
    }

    /// This namespace's value.
    pub fn get(&self) -> u64 {
        counter(&self.0.series).map(IntCounter::get).unwrap_or(0)
    }
}

impl NsGauge {
    pub fn inc(&self) {
        self.add(1);
    }

    pub fn dec(&self) {
        self.add(-1);
    }

    pub fn add(&self, d: i64) {
        if let (Some(s), Some(t)) = (gauge(&self.0.series), gauge(&self.0.total)) {
            s.add(d);
            t.add(d);
        }
    }

    /// Sets this namespace's value, the total moved by the difference.
    pub fn set(&self, v: i64) {
        if let (Some(s), Some(t)) = (gauge(&self.0.series), gauge(&self.0.total)) {
            let _one = self.0.set_lock.lock();
            let old = s.get();
            s.set(v);
            t.add(v - old);
        }
    }

    /// This namespace's value.
    pub fn get(&self) -> i64 {
        gauge(&self.0.series).map(IntGauge::get).unwrap_or(0)
    }
}

impl NsHistogram {
    pub fn observe(&self, v: f64) {
        if let (Some(s), Some(t)) = (histogram(&self.0.series), histogram(&self.0.total)) {
            s.observe(v);
            t.observe(v);
        }
    }

    /// This namespace's own histogram (its quantiles).
    pub fn histogram(&self) -> &Histogram {
        histogram(&self.0.series).expect("a histogram family's series")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index() -> (Arc<NsIndex>, NsCounterVec, NsGaugeVec) {
        let ix = NsIndex::new();
        let handled = ix.counter(
            "meshgate_actor_messages_handled_total",
            "handled",
            &["kind", "namespace"],
        );
        let subs = ix.gauge("meshgate_ws_subscribers", "subs", &["namespace"]);
        (ix, handled, subs)
    }

    /// Every namespace ranked from scratch: activity down, name up.
    fn full_ranking(ix: &NsIndex, limit: usize) -> Vec<String> {
        let mut all: Vec<(u64, String)> = ix
            .all()
            .iter()
            .filter(|e| !e.name.is_empty())
            .map(|e| (e.activity(), e.name.to_string()))
            .collect();
        all.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        all.into_iter().take(limit).map(|(_, n)| n).collect()
    }

    /// Scrape after scrape, with namespaces overtaking each other, appearing
    /// with a gauge only (no activity) and the node's own series moving,
    /// the ranking from the last top N and the moved namespaces equals a
    /// ranking of every namespace.
    #[test]
    fn incremental_top_matches_a_full_ranking() {
        let (ix, handled, subs) = index();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for round in 0..60 {
            for _ in 0..next(40) {
                let ns = format!("ns{}", next(200));
                handled
                    .with_label_values(&["namespace", &ns])
                    .inc_by(next(5) + 1);
            }
            if round % 7 == 0 {
                subs.with_label_values(&[&format!("quiet{round}")]).inc();
            }
            handled.with_label_values(&["node", ""]).inc_by(1000);
            for limit in [5, 3] {
                let got: Vec<String> = ix.top(limit).iter().map(|e| e.name().to_string()).collect();
                assert_eq!(got, full_ranking(&ix, limit), "round {round}");
            }
        }
    }

    /// Once ranked, a scrape reads the last top N and the namespaces whose
    /// activity moved since, not every namespace.
    #[test]
    fn a_scrape_ranks_the_last_top_and_the_moved_only() {
        let (ix, handled, _) = index();
        for i in 0..1000 {
            handled
                .with_label_values(&["namespace", &format!("ns{i}")])
                .inc_by(i + 1);
        }
        ix.top(10);
        assert_eq!(ix.last_ranked(), 1000);
        ix.top(10);
        assert_eq!(ix.last_ranked(), 10, "nothing moved: the last top only");
        for i in [3, 500, 998] {
            handled
                .with_label_values(&["namespace", &format!("ns{i}")])
                .inc_by(5000);
        }
        let top: Vec<String> = ix.top(10).iter().map(|e| e.name().to_string()).collect();
        // ns998 was in the top already; ns3 and ns500 joined it.
        assert_eq!(ix.last_ranked(), 12);
        assert_eq!(&top[..3], ["ns998", "ns500", "ns3"]);
        assert_eq!(top, full_ranking(&ix, 10));
    }
}
