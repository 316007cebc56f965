//! The tests that do not run on the cluster suite (`MESHGATE_TEST_CLUSTER=1`,
//! docs/cluster.md "The suite on a cluster"), each with why, in one list.
//!
//! A test scopes itself with `if single_node_only() { return; }`; the reason
//! is the list's, found by the test's own name, so a call that is not listed
//! panics in either mode. [`the_list_names_every_call_and_nothing_else`]
//! reads the test sources: every call site is listed, and every entry still
//! names a test that calls it. A test that comes to work on a cluster leaves
//! the list with its call.

/// `(test path as libtest names it, why it cannot mean anything on a cluster)`.
pub const SINGLE_NODE_ONLY: &[(&str, &str)] = &[
    (
        "api::namespace_stats_show_its_own_deployment_routes",
        "route figures are counted by the node that routed the request (the test's node), \
         the stats route is answered by the namespace's member, whose figures are its own",
    ),
    (
        "chain::bad_jwts_are_refused",
        "forges tokens with the node's signing key file (data folder jwt.key); a cluster's \
         signing key is sealed in etcd",
    ),
    (
        "chain::bad_api_keys_are_refused",
        "its last part writes an expired key into the node's sled file; a cluster's keys are \
         in etcd (the part before it runs on the cluster)",
    ),
    (
        "deploy::certs::certificate_keys_are_sealed_on_disk",
        "scans the node's sled files; a cluster's records are in etcd (the seal is the \
         same: the store layer never sees the key in the clear)",
    ),
    (
        "deploy::health::checks_stay_within_the_namespace_budget",
        "the budget is per node and every node runs its own checker; the test counts one \
         node's checks",
    ),
    (
        "deploy::health::shared_instances_are_checked_once",
        "every node runs its own checker; the test counts one node's checks",
    ),
    (
        "deploy::health::hanging_checks_do_not_stop_another_namespaces",
        "the check slots are one node's; every node runs its own checkers",
    ),
    (
        "export::whole_namespace_moves_on_sled_and_secrets_stay_in_their_cluster",
        "sled, and two nodes with their own server secrets",
    ),
    (
        "export::failed_imports_change_nothing_and_bad_inputs_are_4xx",
        "sled: the limits and refusals of one node",
    ),
    (
        "functions::functions_public_route_refuses_private_before_compiling",
        "counts the compilations of the one restarted node",
    ),
    (
        "functions::guest_memory_starts_from_a_copy_on_write_image",
        "reads the private memory of the one node that runs the guest",
    ),
    (
        "history::a_publication_and_its_trim_take_one_flush_and_survive_a_crash",
        "counts the embedded store's (sled) flushes; a cluster's history is written to etcd",
    ),
    (
        "history::a_namespace_keeps_at_most_its_history_topics",
        "history_topics counts one node's copy and a stream in use is one a socket on that \
         node holds; the cluster suite's quota reads, publishes and subscriptions reach \
         different nodes' copies (docs/pubsub.md)",
    ),
    (
        "history::a_batch_makes_room_from_streams_it_does_not_publish_to",
        "history_topics counts one node's copy and the idle streams are made by a socket on \
         that node (docs/pubsub.md)",
    ),
    (
        "history::idle_history_streams_are_forgotten_after_the_meta_ttl",
        "a stream is idle when no socket on the node holds it; on the cluster suite the \
         subscriber and the quota read are on different nodes (docs/pubsub.md)",
    ),
    (
        "history::a_woken_namespace_loads_its_history_only_when_needed",
        "it measures the RSS of the node that holds the namespaces",
    ),
    (
        "node::namespace_create_and_delete_are_the_node_supervisors",
        "counts one node's supervisor messages",
    ),
    (
        "observe::route_metrics_count_the_requests_made",
        "counts the series of one node",
    ),
    (
        "observe::activity_holds_the_latest_requests_without_secrets",
        "the activity ring is per node",
    ),
    (
        "observe::activity_entries_keep_a_bounded_path",
        "the activity ring is per node",
    ),
    (
        "observe::trace_context_reaches_the_upstream_and_the_logs",
        "reads the one node's log",
    ),
    (
        "observe::static_routes_are_counted_without_instances",
        "counts the series of one node",
    ),
    (
        "observe::upstream_attempts_are_counted_per_instance_and_outcome",
        "counts the series of one node",
    ),
    (
        "pubsub::slow_consumer_closed_4008_others_unaffected",
        "its last assert bounds one process's RSS; on a cluster the mesh's message cache \
         holds the recent messages (the 4008 and the others' delivery are checked there)",
    ),
    (
        "security::bounds::tarball_bombs_refused_and_normal_site_deployed",
        "reads the node's own data folder",
    ),
    (
        "security::dashboard::sessions_end_when_the_operator_key_changes",
        "restarts one node with another operator key",
    ),
    (
        "security::ledger::concurrent_wat_deploys_are_bounded_and_parsed_in_the_gate",
        "the RSS of the one node that compiles is read",
    ),
    (
        "security::ledger::site_deploy_delete_cycles_keep_the_data_folder_bounded",
        "the data folder of one sled node is measured",
    ),
    (
        "security::ledger::a_swept_module_takes_its_compiled_artifacts_with_it",
        "the compiled-module cache is one node's data folder",
    ),
    (
        "security::metrics::metrics_listener_serves_without_a_key",
        "one node binds the fixed [metrics] listen port",
    ),
    (
        "security::seals::edited_namespace_record_is_refused",
        "the record is edited in the node's sled file",
    ),
    (
        "telemetry::otlp_spans_of_a_proxied_request_link_as_the_traceparents_say",
        "one node's spans to one collector",
    ),
    (
        "telemetry::otlp_span_of_a_function_invocation",
        "one node's spans to one collector",
    ),
    (
        "telemetry::otlp_collector_down_costs_no_request",
        "reads the one node's log",
    ),
    (
        "telemetry::otlp_drain_flushes_the_queued_spans",
        "stops one node",
    ),
];

/// The reason listed for `test`, if it is listed.
pub fn reason(test: &str) -> Option<&'static str> {
    SINGLE_NODE_ONLY
        .iter()
        .find(|(t, _)| *t == test)
        .map(|(_, r)| *r)
}

/// Every `single_node_only(` call in the test sources, as the path of the
/// test function it is in (`module::…::function`, as libtest names tests).
fn call_sites() -> Vec<String> {
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it"));
    let mut files = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let mut sites = Vec::new();
    for f in files {
        let rel = f.strip_prefix(root).unwrap().with_extension("");
        let mut module: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if module.last().is_some_and(|m| m == "mod") {
            module.pop();
        }
        if matches!(module.as_slice(), [m] if m == "common" || m == "single_node") {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        let mut current: Option<String> = None;
        for line in text.lines() {
            if let Some(i) = line.find("fn ") {
                let rest = &line[i + 3..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let before = line[..i].trim_end();
                let is_item = before.is_empty()
                    || before.ends_with("pub")
                    || before.ends_with("async")
                    || before.ends_with(')');
                if !name.is_empty() && is_item && rest[name.len()..].starts_with(['(', '<']) {
                    current = Some(name);
                }
            }
            if line.contains("single_node_only(") {
                let f = current
                    .clone()
                    .unwrap_or_else(|| panic!("a call outside a function in {}", f.display()));
                sites.push(format!("{}::{f}", module.join("::")));
            }
        }
    }
    sites.sort();
    sites
}

/// The list and the call sites are the same set: no call without its
/// reason, no entry left behind by a test that now runs on a cluster, each
/// test once, and no empty reason.
#[test]
fn the_list_names_every_call_and_nothing_else() {
    let mut sites = call_sites();
    assert!(
        sites.len() >= 10,
        "the source scan found only {sites:?}: it is broken"
    );
    let before = sites.len();
    sites.dedup();
    assert_eq!(sites.len(), before, "a test calls it twice: {sites:?}");
    let mut listed: Vec<String> = SINGLE_NODE_ONLY
        .iter()
        .map(|(t, _)| t.to_string())
        .collect();
    listed.sort();
    let n = listed.len();
    listed.dedup();
    assert_eq!(listed.len(), n, "a test is listed twice");
    let unlisted: Vec<&String> = sites.iter().filter(|s| !listed.contains(s)).collect();
    let unused: Vec<&String> = listed.iter().filter(|l| !sites.contains(l)).collect();
    assert!(
        unlisted.is_empty(),
        "single_node_only() called by tests not in SINGLE_NODE_ONLY: {unlisted:?}"
    );
    assert!(
        unused.is_empty(),
        "listed in SINGLE_NODE_ONLY but no longer calling single_node_only(): {unused:?}"
    );
    for (t, r) in SINGLE_NODE_ONLY {
        assert!(r.trim().len() > 10, "{t}: no real reason");
    }
}
