#!/usr/bin/env bash
# End-to-end test of the /__admin dashboard in headless Chromium.
#
# Installs what it needs only when missing: Debian's chromium (apt-get) and
# playwright-core and ws (npm, into tests/e2e/). Then runs tests/e2e/dashboard.mjs
# against the debug binary: it starts a node, creates two namespaces, generates
# traffic, opens the page and checks the live counters; screenshots go to
# target/e2e/ (E2E_OUT overrides; DOCS_SCREENSHOT=path also copies one there).
#
# Exit codes: 0 passed, 1 failed, 3 chromium could not be installed,
# 4 node/npm missing, 5 playwright-core or ws could not be installed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
E2E="$ROOT/tests/e2e"
CHROMIUM=/usr/bin/chromium

if [ ! -x "$CHROMIUM" ]; then
  echo "e2e: chromium missing; running: apt-get install -y chromium" >&2
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >&2; then
    echo "e2e: INSTALL STEP FAILED: apt-get install -y chromium" >&2
    exit 3
  fi
fi
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "e2e: INSTALL STEP MISSING: node and npm (apt-get install -y nodejs npm)" >&2
  exit 4
fi
if [ ! -f "$E2E/node_modules/playwright-core/package.json" ] || [ ! -f "$E2E/node_modules/ws/package.json" ]; then
  echo "e2e: playwright-core or ws missing; running: npm install (in tests/e2e)" >&2
  if ! (cd "$E2E" && npm install --no-audit --no-fund --loglevel=error) >&2; then
    echo "e2e: INSTALL STEP FAILED: npm install playwright-core ws (in tests/e2e)" >&2
    exit 5
  fi
fi

BIN=${MESHGATE_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/debug/meshgate}
if [ ! -x "$BIN" ]; then
  (cd "$ROOT" && cargo build --bin meshgate)
fi
OUT=${E2E_OUT:-$ROOT/target/e2e}
mkdir -p "$OUT"
exec node "$E2E/dashboard.mjs" --bin "$BIN" --out "$OUT" --chromium "$CHROMIUM"
