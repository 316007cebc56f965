#!/bin/sh
# Builds the example guests. Debian's wasi-libc lives in the default sysroot
# of `clang --target=wasm32-wasi`, so no --sysroot is needed; elsewhere set
# WASI_SYSROOT (e.g. /opt/wasi-sdk/share/wasi-sysroot).
set -eu
cd "$(dirname "$0")"
SYSROOT=${WASI_SYSROOT:+--sysroot=$WASI_SYSROOT}
for f in echo counter publisher caller; do
  # shellcheck disable=SC2086
  clang --target=wasm32-wasi $SYSROOT -O2 -Wall -Wextra -o "$f.wasm" "$f.c"
  echo "built $f.wasm ($(wc -c < "$f.wasm") bytes)"
done
