#!/usr/bin/env bash
# The project's test command: installs what the tests need (only what is
# missing), then runs every test target. Used by CI (.ci/run) and by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
command -v node >/dev/null 2>&1 || need_apt+=(nodejs npm)
# Deployment tests (TLS, HTTP/2) drive curl and make certificates with openssl;
# the proxy bench compares against nginx.
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
# The README's tour and scripts/tour.sh (docs::*) read JSON with jq.
command -v jq >/dev/null 2>&1 || need_apt+=(jq)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
# pip, for eth-account below (only when it is missing too).
python3 -c 'import eth_account' >/dev/null 2>&1 || python3 -m pip --version >/dev/null 2>&1 \
  || need_apt+=(python3-pip)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null 2>&1 || need_apt+=(nginx)
# The etcd backend (feature `cluster`): etcd-client needs protoc; its tests start etcd.
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
# ACME tests (tests/it/acme.rs) order certificates from Debian's pebble,
# resolving names through its pebble-challtestsrv (both in package pebble).
{ command -v pebble >/dev/null 2>&1 && command -v pebble-challtestsrv >/dev/null 2>&1; } \
  || need_apt+=(pebble)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "scripts/test.sh: installing ${need_apt[*]} (apt-get)"
  apt-get update -qq
  # RUNLEVEL=1: packages (nginx) must not start their services.
  RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi
# The gRPC tests (tests/it/grpc.rs) and bench drive a Python grpcio upstream
# and client (tests/grpc/grpc_helper.py).
if ! python3 -c 'import grpc' >/dev/null 2>&1; then
  echo "scripts/test.sh: installing grpcio (pip)"
  python3 -m pip install --quiet grpcio || python3 -m pip install --quiet --break-system-packages grpcio
fi
# Sign-In with Ethereum tests (security::siwe) sign with eth-account, an
# implementation independent of the node's.
if ! python3 -c 'import eth_account' >/dev/null 2>&1; then
  echo "scripts/test.sh: installing eth-account (pip)"
  python3 -m pip install -q eth-account 2>/dev/null \
    || python3 -m pip install -q --break-system-packages eth-account
fi
if [ -f tests/e2e/package.json ] && { [ ! -d tests/e2e/node_modules/playwright-core ] || [ ! -d tests/e2e/node_modules/ws ]; }; then
  echo "scripts/test.sh: installing playwright-core and ws (npm)"
  (cd tests/e2e && npm install --no-audit --no-fund --silent)
fi
# The OpenAPI document's test validates it with openapi-spec-validator (PyPI).
python3 -c "import openapi_spec_validator" 2>/dev/null || {
  echo "scripts/test.sh: installing openapi-spec-validator (pip)"
  python3 -m pip install -q openapi-spec-validator 2>/dev/null \
    || python3 -m pip install -q --break-system-packages openapi-spec-validator
}

# One build, no edits between: incremental caches would only double the
# target folder's size on disk (about 5 GB more for this stack).
export CARGO_INCREMENTAL=0
# `cargo test` builds the binary too, with the tests' features (the
# dev-dependencies turn on more of wasmtime): one build of each crate.
cargo test --all-targets --features cluster "$@"
# The TypeScript client (clients/ts) against the binary just
# built: node --test against real nodes, then once in headless Chromium.
# npm ci only when clients/ts/node_modules is missing. About a minute.
MESHGATE_BIN=${MESHGATE_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/debug/meshgate} clients/ts/test.sh
# The integration suite again on a cluster: each test's node is
# one of three on one etcd, and not a member of the test's namespaces, so
# every namespace request is forwarded and what is published crosses the
# mesh (tests/it/common.rs, docs/cluster.md "The suite on a cluster").
# Same build; about 3.5 minutes on 2 cores (security::, export::, docs::
# and cli:: about 1.5 of them; the tests these cannot mean on a cluster
# are listed there with their reasons).
MESHGATE_TEST_CLUSTER=1 cargo test --features cluster --test it -- \
  functions:: pubsub:: deploy:: node:: chain:: passivate:: history:: \
  security:: export:: docs:: cli:: api:: paging:: openapi:: sessions::
# The fault loop (scripts/fault-loop.mjs, docs/cluster.md "Failure and
# recovery"): etcd and three nodes under load through every node while one
# node at a time is SIGKILLed and restarted and one is drained and rejoins;
# fails on any acknowledged KV write, publication or cron slot lost or
# doubled, or a namespace not answering within replace_after_seconds + 10 s
# of its last member's death. Uses the TypeScript client built above. About
# 1.5 minutes.
MESHGATE_BIN=${MESHGATE_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/debug/meshgate} \
  node scripts/fault-loop.mjs --duration 75
# The cluster and etcd tests again on an etcd that requires TLS client
# certificates (a cluster on a locked-down etcd works as on a
# plain one). About a minute.
MESHGATE_TEST_ETCD_TLS=1 cargo test --features cluster --test it -- cluster:: etcd::
# The lints of clippy.toml and what must not come back (docs/architecture.md,
# "Lints"): blocking sleeps outside the audited threads, a RefCell borrow or
# a lock held across an await. Only these are denied; about 2 minutes.
cargo clippy --version >/dev/null 2>&1 || {
  echo "scripts/test.sh: cargo clippy is missing: rustup component add clippy" >&2
  exit 1
}
cargo clippy --features cluster --lib -- -A clippy::all \
  -D clippy::disallowed_methods -D clippy::await_holding_refcell_ref \
  -D clippy::await_holding_lock -D clippy::unwrap_used
