//! Docs as tests: the README's marked command blocks and `scripts/tour.sh`
//! run as written against a real node, twice, so a README that drifts from
//! the code (a renamed flag, a changed field, a new refusal) fails the build.

use crate::common::{NodeOpts, OPERATOR_AUTH, OPERATOR_KEY, TEST_CONFIG, TestNode, bin, http};
use std::path::Path;
use std::process::Command;

const MARKER: &str = "<!-- doc-test -->";

/// The ```sh blocks that follow a `<!-- doc-test -->` line, in order.
fn marked_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut lines = markdown.lines();
    while let Some(line) = lines.next() {
        if line.trim() != MARKER {
            continue;
        }
        let fence = lines.next().unwrap_or_default();
        assert_eq!(
            fence.trim(),
            "```sh",
            "a doc-test marker must sit right above a ```sh block"
        );
        let body: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "```").collect();
        blocks.push(body.join("\n"));
    }
    blocks
}

/// Runs `script` with bash in `dir`, the node's address and the operator key
/// in the environment and the built binary first on PATH. Returns stdout and
/// stderr, panicking with both on a non-zero exit.
fn run(script: &str, dir: &Path, env: &[(&str, &str)]) -> String {
    let bin_dir = Path::new(bin()).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // A documented step's `mktemp -d` (etcd's and the nodes' folders) lands
    // in a folder of the test's own, removed when it ends: a reader's script
    // need not clean up, and repeated runs do not fill the disk.
    let tmp = tempfile::tempdir().expect("a temporary folder");
    // Bounded: a documented step that waits forever (a node that never
    // gets ready) fails the test with its output instead of hanging the suite.
    let out = Command::new("timeout")
        .args(["180", "bash", "-c", script])
        .current_dir(dir)
        .env("PATH", path)
        .env("TMPDIR", tmp.path())
        .env_remove("MESHGATE_KEY")
        .env_remove("MESHGATE_URL")
        .env_remove("MESHGATE_OPERATOR_KEY")
        .envs(env.iter().copied())
        .output()
        .expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "exit {:?}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status.code()
    );
    stdout + &stderr
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The README's marked blocks (the quick tour, the CLI, pub/sub,
/// functions and the gateway tour), in order, in one shell as a reader
/// would type them, twice on the same node (fresh names each time): every
/// step succeeds and the answers the README promises come back. The node
/// allows loopback upstreams, as the README tells the reader to start it.
#[test]
fn readme_runs_as_written() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    assert!(
        readme.contains("MESHGATE_DEPLOY_UPSTREAM_ALLOW=127.0.0.0/8 cargo run --release -- serve"),
        "the README starts the tour's node with loopback upstreams allowed"
    );
    let blocks = marked_blocks(&readme);
    assert!(
        blocks.len() >= 8,
        "the tour, CLI, pub/sub, functions and the four gateway blocks are marked"
    );
    assert!(
        blocks[0].starts_with("set -euo pipefail"),
        "the tour's first line makes every step stop on an error"
    );
    let mut script = format!("set -euo pipefail\n{}\n", blocks.join("\n"));
    let n = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[deploy]\nupstream_allow = [\"127.0.0.0/8\"]\n"),
        ..Default::default()
    });
    // Cluster mode: the tour's namespace is placed on the member the suite
    // uses ("b"), so every step of it is forwarded by the node the reader
    // talks to ("a"); the README's own request names no members.
    if let Some(m) = n.member_of_namespaces() {
        let create = r#"-d "{\"name\":\"$NS\"}" $BASE/v1/namespaces"#;
        assert!(script.contains(create), "the tour creates $NS as expected");
        script = script.replace(
            create,
            &format!(r#"-d "{{\"name\":\"$NS\",\"members\":[\"{m}\"]}}" $BASE/v1/namespaces"#),
        );
    }
    let work = tempfile::tempdir().unwrap();
    // The reader stands in the repository: its examples are at hand.
    std::os::unix::fs::symlink(repo().join("examples"), work.path().join("examples")).unwrap();
    for round in 1..=2 {
        let out = run(
            &script,
            work.path(),
            &[("BASE", &n.base), ("OP", OPERATOR_KEY)],
        );
        for promised in [
            "hello",
            "ping",
            "hi",
            "<h1>hello from meshgate</h1>",
            "subscribed to chat",
            "subscribed to chat.1",
            r#"{"hi":1}"#,
            "hello\nhello\n",
            // the gateway tour: the policy's refusal, the 3:1 weights,
            // what a reconnecting client missed, the wallet's token and
            // its grants, the quota
            "401\n",
            "3 one\n",
            "1 two\n",
            "offset 3 epoch ",
            "2 second\n3 third\n",
            "hello wallet\n",
            "MISSING_GRANT\n",
            "QUOTA_EXCEEDED\n",
        ] {
            assert!(
                out.contains(promised),
                "round {round}: {promised:?} missing from\n{out}"
            );
        }
    }
    if n.member_of_namespaces().is_some() {
        let (_, _, m) = http("GET", &n.url("/metrics"), &[OPERATOR_AUTH], None);
        let forwarded = String::from_utf8_lossy(&m)
            .lines()
            .find_map(|l| {
                l.strip_prefix("meshgate_forwards_total{outcome=\"ok\"} ")?
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or(0.0);
        assert!(
            forwarded >= 10.0,
            "the tour was forwarded by a: {forwarded}"
        );
    }
}

/// `scripts/tour.sh` passes every step twice against a node that allows
/// loopback upstreams (so the proxy step is walked), and against a default
/// node, where the egress policy's refusal of a loopback upstream is the pass.
#[test]
fn tour_script_passes_twice() {
    let tour = repo().join("scripts/tour.sh");
    for allow in [true, false] {
        let mut config = TEST_CONFIG.to_string();
        if allow {
            config.push_str("[deploy]\nupstream_allow = [\"127.0.0.0/8\"]\n");
        }
        let n = TestNode::start_with(NodeOpts {
            config,
            ..Default::default()
        });
        for round in 1..=2 {
            let script = format!("{} {} {}", tour.display(), n.base, OPERATOR_KEY);
            let out = run(&script, repo(), &[]);
            assert!(
                out.contains(", 0 failed"),
                "allow={allow} round {round}:\n{out}"
            );
            let walked = out.contains("host routed to an upstream deployment");
            assert_eq!(walked, allow, "allow={allow}: the proxy step\n{out}");
        }
    }
}

/// The marker scanner finds marked blocks only.
#[test]
fn marked_blocks_are_found() {
    let md = "text\n```sh\nnot me\n```\n<!-- doc-test -->\n```sh\necho a\necho b\n```\n";
    assert_eq!(marked_blocks(md), vec!["echo a\necho b".to_string()]);
}

/// docs/cluster.md's step-by-step (etcd and three nodes on fresh folders, a
/// namespace placed on b and c, used through a) runs as written: the KV
/// write through a is answered by a member.
#[cfg(feature = "cluster")]
#[test]
fn cluster_step_by_step_runs_as_written() {
    for tool in ["etcd", "openssl", "jq", "curl"] {
        let found = Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {tool} > /dev/null"))
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            found,
            "{tool} is missing: scripts/test.sh installs it (apt-get)"
        );
    }
    let doc = std::fs::read_to_string(repo().join("docs/cluster.md")).unwrap();
    let blocks = marked_blocks(&doc);
    assert_eq!(blocks.len(), 1, "one marked block in docs/cluster.md");
    let script = format!("set -euo pipefail\n{}\n", blocks[0]);
    let out = run(&script, repo(), &[]);
    assert!(out.contains(r#"["a","b","c"]"#), "three live nodes:\n{out}");
    let member = out
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("x-meshgate-member:"))
        .unwrap_or_else(|| panic!("no member header:\n{out}"))
        .to_ascii_lowercase();
    assert!(
        member.contains(" b") || member.contains(" c"),
        "answered by a member, not a: {member}"
    );
}

/// The rows of docs/errors.md's table: code, the status it is listed
/// with (the first number of its status cell) and whether it is retryable.
fn documented_errors(markdown: &str) -> Vec<(String, u16, bool)> {
    markdown
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let code = cells[1].trim_matches('`').to_string();
            let status = cells[2]
                .split(|c: char| !c.is_ascii_digit())
                .find(|d| d.len() == 3)
                .and_then(|d| d.parse().ok())
                .unwrap_or_else(|| panic!("{code}: no status in {:?}", cells[2]));
            let retryable = match cells[3] {
                "yes" => true,
                "no" => false,
                other => panic!("{code}: retryable is yes or no, not {other:?}"),
            };
            (code, status, retryable)
        })
        .collect()
}

/// docs/errors.md lists every wire code of `src/error.rs`, once, with the
/// table's status and retryable: a new code cannot ship undocumented.
#[test]
fn errors_doc_lists_every_code() {
    use meshgate::error::Code;
    let doc = std::fs::read_to_string(repo().join("docs/errors.md")).unwrap();
    let rows = documented_errors(&doc);
    let mut problems = Vec::new();
    for &code in Code::ALL {
        let wire = code.as_str();
        match rows
            .iter()
            .filter(|(c, _, _)| c == wire)
            .collect::<Vec<_>>()[..]
        {
            [] => problems.push(format!("{wire} is missing")),
            [(_, status, retryable)] => {
                if *status != code.status().as_u16() {
                    problems.push(format!(
                        "{wire}: documented {status}, the table says {}",
                        code.status().as_u16()
                    ));
                }
                if *retryable != code.retryable() {
                    problems.push(format!(
                        "{wire}: documented retryable {retryable}, the table says {}",
                        code.retryable()
                    ));
                }
            }
            _ => problems.push(format!("{wire} is listed twice")),
        }
    }
    for (c, _, _) in &rows {
        if !Code::ALL.iter().any(|k| k.as_str() == c) {
            problems.push(format!("{c} is documented but not a code"));
        }
    }
    assert!(
        problems.is_empty(),
        "docs/errors.md disagrees with src/error.rs:\n{}",
        problems.join("\n")
    );
}

/// The errors table parser reads a row's code, first status and retryable.
#[test]
fn documented_errors_are_parsed() {
    let md = "| code | status | retryable |\n|---|---|---|\n\
              | `QUOTA_EXCEEDED` | 429 (413 for a byte quota) | no | m | d |\n";
    assert_eq!(
        documented_errors(md),
        vec![("QUOTA_EXCEEDED".to_string(), 429, false)]
    );
}
