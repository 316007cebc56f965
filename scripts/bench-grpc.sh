#!/usr/bin/env bash
# gRPC unary calls per second: direct to a Python grpcio upstream, through
# meshgate's gRPC listener, and through nginx `grpc_pass`, in one run, each
# part its own process (the upstream, meshgate, nginx, and one client
# process per measurement: tests/grpc/grpc_helper.py). Prints a table.
#
#   cargo build --release --bin meshgate
#   scripts/bench-grpc.sh [SECONDS] [CONCURRENCY]
#
# Needs python3 with grpcio and nginx (scripts/test.sh installs both).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-10}
CONC=${2:-8}
BIN=${MESHGATE_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/release/meshgate}
HELPER=tests/grpc/grpc_helper.py
[ -x "$BIN" ] || { echo "no release binary at $BIN: cargo build --release --bin meshgate" >&2; exit 1; }
python3 -c 'import grpc' 2>/dev/null || { echo "grpcio is missing: python3 -m pip install grpcio" >&2; exit 1; }
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$NGINX" ] || { echo "nginx is missing: apt-get install nginx" >&2; exit 1; }

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
UP=$(port); API=$(port); GRPC=$(port); NGX=$(port)
WORK=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

python3 "$HELPER" serve "$UP" > "$WORK/up.log" 2>&1 &
pids+=($!)

cat > "$WORK/config.toml" <<EOF
[server]
workers = 1
[rate_limit]
general_per_minute = 100000000
general_burst = 10000000
anonymous_per_minute = 100000000
anonymous_burst = 10000000
[deploy]
upstream_allow = ["127.0.0.0/8"]
[grpc]
listen = "127.0.0.1:$GRPC"
EOF
OP=mgop_bench_operator_key_0123456789abcdef
MESHGATE_OPERATOR_KEY=$OP RUST_LOG=error "$BIN" serve --config "$WORK/config.toml" \
  --listen "127.0.0.1:$API" --data-dir "$WORK/data" > "$WORK/mg.log" 2>&1 &
pids+=($!)

mkdir -p "$WORK/ngx"
cat > "$WORK/nginx.conf" <<EOF
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/ngx/error.log error;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $WORK/ngx;
  proxy_temp_path $WORK/ngx;
  fastcgi_temp_path $WORK/ngx;
  uwsgi_temp_path $WORK/ngx;
  scgi_temp_path $WORK/ngx;
  upstream grpcup { server 127.0.0.1:$UP; keepalive 16; }
  server {
    listen 127.0.0.1:$NGX http2;
    location / { grpc_pass grpc://grpcup; }
  }
}
EOF
"$NGINX" -c "$WORK/nginx.conf" -e "$WORK/ngx/error.log"

for _ in $(seq 100); do
  curl -fs "http://127.0.0.1:$API/readyz" >/dev/null 2>&1 && grep -q ready "$WORK/up.log" && break
  sleep 0.1
done
J='content-type: application/json'
KEY=$(curl -fsS -H "$J" -H "authorization: Bearer $OP" -d '{"name":"bench"}' \
  "http://127.0.0.1:$API/v1/namespaces" | python3 -c 'import json,sys; print(json.load(sys.stdin)["api_key"])')
curl -fsS -H "$J" -H "authorization: Bearer $KEY" \
  -d "{\"name\":\"rpc\",\"hosts\":[\"bench.grpc.test\"],\"upstream\":{\"instances\":[\"http://127.0.0.1:$UP\"]}}" \
  "http://127.0.0.1:$API/v1/deployments" >/dev/null

run() { python3 "$HELPER" bench "$1" bench.grpc.test "$SECONDS_EACH" "$CONC"; }
direct=$(run "127.0.0.1:$UP")
mesh=$(run "127.0.0.1:$GRPC")
ngx=$(run "127.0.0.1:$NGX")
ratio() { python3 -c "print(f'{$1/$2:.2f}')"; }
echo "gRPC unary calls/s, ${SECONDS_EACH} s each, ${CONC} concurrent calls from one grpcio client process"
echo "| path | calls/s | vs direct | vs nginx |"
echo "|---|---|---|---|"
echo "| direct to the upstream | $direct | 1.00 | $(ratio "$direct" "$ngx") |"
echo "| meshgate [grpc] listen (1 worker) | $mesh | $(ratio "$mesh" "$direct") | $(ratio "$mesh" "$ngx") |"
echo "| nginx grpc_pass (1 worker) | $ngx | $(ratio "$ngx" "$direct") | 1.00 |"
