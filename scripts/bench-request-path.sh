#!/usr/bin/env bash
# Builds the node once and prints the request path's ratios in one run
# (scripts/bench-request-path.py says what each one measures).
#
#   scripts/bench-request-path.sh                  # the release profile
#   CARGO_PROFILE=dist scripts/bench-request-path.sh
#   MESHGATE_BENCH_BIN=path/to/meshgate scripts/bench-request-path.sh   # no build
#   PROFILE_DIR=/tmp/prof scripts/bench-request-path.sh   # and a perf profile per path
#
# Installs wrk and nginx (apt-get) when they are missing, and perf when
# PROFILE_DIR is set.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v wrk >/dev/null || missing+=(wrk)
[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null || missing+=(nginx)
if [ -n "${PROFILE_DIR:-}" ]; then command -v perf >/dev/null || missing+=(linux-perf); fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]} (apt-get)" >&2
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_=sudo
  $sudo_ apt-get update -q && $sudo_ apt-get install -y -q "${missing[@]}"
fi

bin="${MESHGATE_BENCH_BIN:-}"
if [ -z "$bin" ]; then
  profile="${CARGO_PROFILE:-release}"
  cargo build --profile "$profile" --bin meshgate
  dir="$profile"; [ "$profile" = dev ] && dir=debug
  bin="${CARGO_TARGET_DIR:-target}/$dir/meshgate"
fi
exec python3 scripts/bench-request-path.py "$bin"
