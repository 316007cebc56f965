//! Pub/sub and cron triggers: which functions a publish or a cron slot
//! fires, and running them with their depth bound.

use super::*;

impl Invoker {
    /// The triggers of `name` at version `meta` (None: no trigger).
    fn trigger_entry(name: &str, meta: &VersionMeta) -> Option<TriggerEntry> {
        let crons: Vec<_> = meta
            .cron
            .iter()
            .filter_map(|c| parse_cron(c).ok().map(|s| (c.clone(), s)))
            .collect();
        (!meta.pubsub_topics.is_empty() || !crons.is_empty()).then(|| TriggerEntry {
            name: name.to_string(),
            topics: meta.pubsub_topics.clone(),
            crons,
        })
    }

    pub(super) fn set_triggers(&self, name: &str, meta: Option<&VersionMeta>) {
        {
            let mut t = self.st.triggers.write();
            t.retain(|e| e.name != name);
            t.extend(meta.and_then(|m| Self::trigger_entry(name, m)));
        }
        self.send_crons();
    }

    /// Loads the triggers of every function (at supervisor start and after an
    /// import), replacing the ones before (a function the import removed
    /// loses its triggers) and forgetting every kept resolution: the
    /// functions may all have changed.
    pub async fn load_triggers(&self) -> FnResult<()> {
        self.forget_resolutions();
        let mut all = Vec::new();
        for rec in self.list().await? {
            let meta: Option<VersionMeta> = self
                .store()
                .get_json(&ver_key(&self.ns, &rec.name, rec.current_version))
                .await?;
            all.extend(meta.and_then(|m| Self::trigger_entry(&rec.name, &m)));
        }
        *self.st.triggers.write() = all;
        self.send_crons();
        Ok(())
    }

    /// Fires the pub/sub triggers matching `topic` (called by the supervisor
    /// for every accepted publish). `depth` is the publisher's trigger depth.
    pub fn on_published(&self, topic: &str, data: &Bytes, depth: u8) {
        if depth >= MAX_TRIGGER_DEPTH {
            return;
        }
        let names: Vec<String> = self
            .st
            .triggers
            .read()
            .iter()
            .filter(|e| e.topics.iter().any(|p| topic_matches(p, topic)))
            .map(|e| e.name.clone())
            .collect();
        if names.is_empty() {
            return;
        }
        use base64::Engine;
        let event = serde_json::to_vec(&serde_json::json!({
            "topic": topic,
            "data_base64": base64::engine::general_purpose::STANDARD.encode(data),
            "namespace": &*self.ns,
            "trigger_depth": depth + 1,
            "timestamp": crate::util::now(),
        }))
        .expect("serializable");
        for name in names {
            self.spawn_trigger(name, event.clone(), Trigger::Pubsub, depth + 1, None);
        }
    }

    /// This namespace's cron schedules now: every (function, expression) of
    /// the functions' current versions, what the node's cron timer holds.
    pub fn crons(&self) -> Vec<crate::actors::CronEntry> {
        self.st
            .triggers
            .read()
            .iter()
            .flat_map(|e| {
                e.crons.iter().map(|(expr, s)| crate::actors::CronEntry {
                    function: e.name.clone(),
                    expr: expr.clone(),
                    schedule: s.clone(),
                })
            })
            .collect()
    }

    /// Sends the cron schedules to the node's cron timer, when one is set.
    pub(super) fn send_crons(&self) {
        let Some(sink) = self.st.cron_sink.lock().clone() else {
            return;
        };
        sink.do_send(crate::actors::CronSet {
            namespace: self.ns.to_string(),
            entries: self.crons(),
        });
    }

    /// Fires one cron slot of `function` (the node's cron timer found it
    /// due), if the function's current version still has `expr`: the slot
    /// is claimed once in the cluster, then run.
    pub fn fire_cron(&self, function: &str, expr: &str, slot: i64) {
        let still = self
            .st
            .triggers
            .read()
            .iter()
            .any(|e| e.name == function && e.crons.iter().any(|(x, _)| x == expr));
        if !still {
            return;
        }
        let event = serde_json::to_vec(&serde_json::json!({
            "cron": expr,
            "scheduled_at": slot,
            "namespace": &*self.ns,
        }))
        .expect("serializable");
        self.spawn_trigger(function.to_string(), event, Trigger::Cron, 1, Some(slot));
    }

    pub(super) fn spawn_trigger(
        &self,
        name: String,
        input: Vec<u8>,
        trigger: Trigger,
        depth: u8,
        slot: Option<i64>,
    ) {
        let inv = self.clone();
        let busy = Busy::new(&self.st);
        actix::spawn(async move {
            let _busy = busy;
            if let Some(slot) = slot {
                // In a cluster every member ticks: the one that claims the slot runs it.
                let claim = cron_claim_key(&inv.ns, &name, slot);
                let claimed = inv
                    .store()
                    .compare_and_swap(&claim, None, Some(b"1"), Some(CRON_CLAIM_TTL))
                    .await;
                let outcome = match &claimed {
                    Ok(true) => "claimed",
                    Ok(false) => "lost",
                    Err(_) => "error",
                };
                inv.svc
                    .0
                    .metrics
                    .cron_slots
                    .with_label_values(&[outcome])
                    .inc();
                match claimed {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(e) => {
                        tracing::warn!(namespace = %inv.ns, function = %name, error = %e, "Cron slot could not be claimed.");
                        return;
                    }
                }
            }
            let caller = CallerInfo {
                subject: None,
                request_id: hex::encode(crate::util::random_bytes::<8>()),
                trace: None,
            };
            let res = match inv
                .prepare(name.clone(), None, input, caller, trigger, depth)
                .await
            {
                Ok(p) => p.run().await.map(|_| ()),
                Err(e) => Err(e),
            };
            if let Err(e) = res {
                tracing::debug!(namespace = %inv.ns, function = %name, trigger = trigger.as_str(), error = %e, "Triggered invocation failed.");
            }
        });
    }
}
