//! Pub/sub and cron triggers: which functions a publish or a cron slot
//! fires, and running them with their depth bound.

use super::*;

impl Invoker {
    /// The triggers of `name` at version `meta` (None: no trigger).
    pub(super) fn trigger_entry(name: &str, meta: &VersionMeta) -> Option<TriggerEntry> {
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

    /// Reads the triggers of every function (at supervisor start and after an
    /// import): the supervisor applies them in place of the ones before (a
    /// function the import removed loses its triggers), forgetting every
    /// kept resolution: the functions may all have changed.
    pub async fn load_triggers(&self) -> FnResult<Change> {
        let mut all = Vec::new();
        for rec in self.list(None, usize::MAX).await?.0 {
            let meta: Option<VersionMeta> = self
                .store()
                .get_json(&ver_key(&self.ns, &rec.name, rec.current_version))
                .await?;
            all.extend(meta.and_then(|m| Self::trigger_entry(&rec.name, &m)));
        }
        Ok(Change::Reloaded(all))
    }

    /// Fires the pub/sub triggers matching `topic` (called by the supervisor
    /// for every accepted publish). `depth` is the publisher's trigger depth.
    pub fn on_published(&self, topic: &str, data: &Bytes, depth: u8) {
        if depth >= MAX_TRIGGER_DEPTH {
            return;
        }
        let names: Vec<String> = self
            .st
            .snapshot
            .load()
            .triggers
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

    /// Fires one cron slot of `function` (the node's cron timer found it
    /// due), if the function's current version still has `expr`: the slot
    /// is claimed once in the cluster, then run.
    pub fn fire_cron(&self, function: &str, expr: &str, slot: i64) {
        let still = self
            .st
            .snapshot
            .load()
            .triggers
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
