#!/usr/bin/env bash
# Fan-out bench: meshgate vs nats-server over WebSockets, same client
# (benches/pubsub_fanout.rs). Installs nats-server (Debian package) if missing,
# starts both on loopback, runs the bench, stops what it started.
# Usage: scripts/bench-pubsub.sh   (env: SUBS MSGS PAYLOAD WINDOW IDLE FORMAT TOPIC)
set -euo pipefail
cd "$(dirname "$0")/.."

ulimit -n 65536 || ulimit -n "$(ulimit -Hn)"

if ! command -v nats-server >/dev/null 2>&1; then
    echo "installing nats-server (Debian package)..."
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get install -y nats-server >/dev/null || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y nats-server >/dev/null; }
fi

TARGET_DIR="${CARGO_TARGET_DIR:-target}"
# BENCH_FEATURES (e.g. "--features cluster") must match the build whose
# artefacts are reused; MESHGATE_BENCH_BIN: a node binary built elsewhere.
# shellcheck disable=SC2086
[ -n "${MESHGATE_BENCH_BIN:-}" ] || cargo build --release ${BENCH_FEATURES:-} --bin meshgate
# shellcheck disable=SC2086
cargo bench ${BENCH_FEATURES:-} --bench pubsub_fanout --no-run

WORK="$(mktemp -d)"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    # The node's log outlives the run when asked (KEEP_LOG=path).
    [ -z "${KEEP_LOG:-}" ] || cp "$WORK/mg.log" "$KEEP_LOG" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

# nats-server with a websocket listener on loopback.
NATS_WS_PORT="$(free_port)"
NATS_PORT="$(free_port)"
cat > "$WORK/nats.conf" <<CONF
listen: "127.0.0.1:$NATS_PORT"
websocket {
  listen: "127.0.0.1:$NATS_WS_PORT"
  no_tls: true
}
CONF
nats-server -c "$WORK/nats.conf" >"$WORK/nats.log" 2>&1 &
NATS_PID=$!
PIDS+=("$NATS_PID")

# meshgate, release build, rate limits raised for one loopback client, and an
# outbound queue as roomy as nats-server's default pending limit per client.
MG_PORT="$(free_port)"
cat > "$WORK/meshgate.toml" <<CONF
[server]
drain_grace_seconds = 1
[rate_limit]
general_per_minute = 100000000
general_burst = 10000000
namespace_per_minute = 100000000
namespace_burst = 10000000
[pubsub]
outbound_queue_messages = 65536
outbound_queue_bytes = 67108864
# One namespace holds every subscriber and idle socket of the run.
[quotas]
sockets = 1000000
subscriptions = 1000000
CONF
export MESHGATE_OPERATOR_KEY="mgop_bench_$(date +%s%N)"
RUST_LOG=warn "${MESHGATE_BENCH_BIN:-$TARGET_DIR/release/meshgate}" serve --config "$WORK/meshgate.toml" \
    --listen "127.0.0.1:$MG_PORT" --data-dir "$WORK/data" >"$WORK/mg.log" 2>&1 &
MG_PID=$!
PIDS+=("$MG_PID")

for _ in $(seq 1 100); do
    curl -sf "http://127.0.0.1:$MG_PORT/readyz" >/dev/null 2>&1 && break
    sleep 0.1
done
MG_KEY="$(curl -sf -X POST "http://127.0.0.1:$MG_PORT/v1/namespaces" \
    -H "authorization: Bearer $MESHGATE_OPERATOR_KEY" -H 'content-type: application/json' \
    -d '{"name":"bench"}' | python3 -c 'import json,sys;print(json.load(sys.stdin)["api_key"])')"
# Topics hist.* keep a history (TOPIC=hist.bench measures history publishes).
curl -sf -X PUT "http://127.0.0.1:$MG_PORT/v1/namespaces/bench/pubsub" \
    -H "authorization: Bearer $MESHGATE_OPERATOR_KEY" -H 'content-type: application/json' \
    -d '{"history":[{"topics":"hist.*","size":10000,"ttl_seconds":3600}]}' >/dev/null

MG_ADDR="127.0.0.1:$MG_PORT" MG_KEY="$MG_KEY" MG_PID="$MG_PID" \
NATS_ADDR="127.0.0.1:$NATS_WS_PORT" NATS_PID="$NATS_PID" \
    timeout 240 cargo bench ${BENCH_FEATURES:-} --bench pubsub_fanout
