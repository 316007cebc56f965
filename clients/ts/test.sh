#!/usr/bin/env bash
# Tests of the TypeScript client (clients/ts) against a real node, then in
# headless Chromium. Installs the npm dependencies only when node_modules is
# missing (npm ci: package-lock.json), builds dist/ with tsc, runs
# `node --test` on test/*.test.mjs (each file starts its own node; the
# token test waits about a minute for a JWT to expire, beside the others).
#
# MESHGATE_BIN: the node binary (default: the repository's target/debug/meshgate).
# CHROMIUM: the browser (default /usr/bin/chromium).
# Exit codes: 0 passed, 1 failed, 4 node/npm missing, 3 chromium missing,
# 5 npm ci failed, 6 no meshgate binary.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# A relative MESHGATE_BIN or CARGO_TARGET_DIR is the caller's.
case "${MESHGATE_BIN:-/}" in /*) ;; *) MESHGATE_BIN="$PWD/$MESHGATE_BIN" ;; esac
case "${CARGO_TARGET_DIR:-/}" in /*) ;; *) CARGO_TARGET_DIR="$PWD/$CARGO_TARGET_DIR" ;; esac
cd "$HERE"

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "clients/ts: node and npm are missing: INSTALL STEP: apt-get install -y nodejs npm" >&2
  exit 4
fi
export CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
if [ ! -x "$CHROMIUM" ]; then
  echo "clients/ts: chromium is missing ($CHROMIUM): INSTALL STEP: apt-get install -y chromium" >&2
  exit 3
fi
export MESHGATE_BIN=${MESHGATE_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/debug/meshgate}
if [ ! -x "$MESHGATE_BIN" ]; then
  echo "clients/ts: no meshgate binary at $MESHGATE_BIN: build it (cargo build --bin meshgate) or set MESHGATE_BIN" >&2
  exit 6
fi
if [ ! -d node_modules ]; then
  echo "clients/ts: node_modules missing; running: npm ci" >&2
  if ! npm ci --no-audit --no-fund --loglevel=error >&2; then
    echo "clients/ts: INSTALL STEP FAILED: npm ci (in clients/ts)" >&2
    exit 5
  fi
fi
rm -rf dist
npx --no-install tsc -p tsconfig.json
# The .d.ts as a TypeScript consumer sees them (type-checked only).
npx --no-install tsc -p test/tsconfig.json
# The files at once: the minute the token test waits overlaps the others
# (--test-concurrency is node 20's; node 18 runs them as it chooses).
conc=()
[ "$(node -p 'process.versions.node.split(".")[0]')" -ge 20 ] && conc=(--test-concurrency=4)
exec node --test "${conc[@]}" --test-reporter=spec test/*.test.mjs
