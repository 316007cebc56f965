#!/usr/bin/env bash
# tour.sh — the user's happy path through a running meshgate node, step by step,
# against the HTTP API (README "HTTP API"). It checks the API's shape, not its
# limits: each capability's own tests go much further.
#
# usage: scripts/tour.sh BASE_URL OPERATOR_KEY      e.g. http://127.0.0.1:8080 "$(cat data/operator.key)"
# Needs curl, jq, python3 (a throwaway upstream) and the meshgate binary (on PATH,
# or MESHGATE_BIN) for the WebSocket subscriber. Exit status 1 if any step fails.
# The proxy step needs loopback upstreams allowed on the node:
# MESHGATE_DEPLOY_UPSTREAM_ALLOW=127.0.0.0/8 (docs/deployments.md, egress policy);
# without it the tour checks that the egress policy refuses the loopback upstream.
set -u
BASE=${1:?base url}; OP=${2:?operator key}
repo=$(cd "$(dirname "$0")/.." && pwd)
mg=${MESHGATE_BIN:-$(command -v meshgate || echo "$repo/target/release/meshgate")}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"; [ -n "${upid:-}" ] && kill $upid 2>/dev/null' EXIT
ok=0; bad=0
pass() { printf '  ok    %s\n' "$1"; ok=$((ok+1)); }
miss() { printf '  FAIL  %s: %s\n' "$1" "$2"; bad=$((bad+1)); }
field() { jq -er ".$1 // empty" 2>/dev/null; }
code() { curl -s -o "$tmp/body" -w '%{http_code}' "$@"; }

[ "$(code "$BASE/readyz")" = 200 ] && pass "node ready (/readyz)" || miss "node ready" "/readyz not 200"
ns="tour$RANDOM"
c=$(code -X POST -H "Authorization: Bearer $OP" -H 'content-type: application/json' -d "{\"name\":\"$ns\"}" "$BASE/v1/namespaces")
key=$(field api_key < "$tmp/body")
[ -n "$key" ] && pass "namespace $ns created (POST /v1/namespaces -> api_key)" || miss "create namespace" "HTTP $c $(head -c 200 "$tmp/body")"
c=$(code -X POST -H 'content-type: application/json' -d "{\"api_key\":\"$key\"}" "$BASE/v1/auth/token")
tok=$(field access_token < "$tmp/body")
[ -n "$tok" ] && pass "API key exchanged for a JWT (POST /v1/auth/token)" || miss "token exchange" "HTTP $c $(head -c 200 "$tmp/body")"
[ "$(code -H "Authorization: Bearer $tok" "$BASE/v1/auth/whoami")" = 200 ] && pass "whoami with the JWT" || miss "whoami" "not 200"
code -X PUT --data-binary 'hello' -H "Authorization: Bearer $tok" "$BASE/v1/kv/greeting" >/dev/null
[ "$(curl -s -H "Authorization: Bearer $tok" "$BASE/v1/kv/greeting")" = hello ] && pass "KV put and get (/v1/kv/greeting)" || miss "KV" "value did not round-trip"
c=$(code -H "Authorization: Bearer $tok" -F name=echo -F "wasm=@$repo/examples/functions/echo.wasm;type=application/wasm" "$BASE/v1/functions")
case $c in 200|201) pass "function deployed (POST /v1/functions, multipart)";; *) miss "deploy" "HTTP $c $(head -c 200 "$tmp/body")";; esac
out=$(curl -s -H "Authorization: Bearer $tok" --data-binary 'ping' "$BASE/v1/functions/echo/invoke")
[ "$out" = ping ] && pass "function invoked (POST /v1/functions/echo/invoke)" || miss "invoke" "answered: $(echo "$out" | head -c 200)"
"$mg" sub tour --url "$BASE" --key "$tok" > "$tmp/sub" 2>"$tmp/sub.err" & spid=$!
for _ in $(seq 50); do grep -q . "$tmp/sub.err" 2>/dev/null && break; sleep 0.1; done; sleep 0.3
code -X POST -H "Authorization: Bearer $tok" -H 'content-type: application/json' \
  -d '{"topic":"tour","data_base64":"aGk="}' "$BASE/v1/pubsub/publish" >/dev/null
for _ in $(seq 50); do grep -qx hi "$tmp/sub" && break; sleep 0.1; done
kill $spid 2>/dev/null
grep -qx hi "$tmp/sub" && pass "subscribed over /v1/pubsub/ws (meshgate sub) and received an HTTP publish" \
  || miss "pub/sub" "the subscriber printed: $(head -c 200 "$tmp/sub") $(head -c 200 "$tmp/sub.err")"
[ "$(code -H "Authorization: Bearer $OP" "$BASE/__admin")" = 200 ] && pass "dashboard served to the operator (/__admin)" || miss "dashboard" "/__admin with the operator key not 200"
[ "$(code "$BASE/__admin/api/snapshot")" = 401 ] && pass "dashboard refused without the key, from any address" || miss "dashboard" "/__admin/api/snapshot without a key is not 401"
up=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
mkdir -p "$tmp/www"; echo upstream > "$tmp/www/index.html"
(cd "$tmp/www" && exec python3 -m http.server "$up" --bind 127.0.0.1 >/dev/null 2>&1) & upid=$!
# Wait until the upstream answers: a first request to an instance not yet
# listening marks it unhealthy for a while (a busy machine starts python slowly).
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$up/" && break; sleep 0.1; done
c=$(code -X POST -H "Authorization: Bearer $tok" -H 'content-type: application/json' \
  -d "{\"name\":\"site\",\"hosts\":[\"$ns.example.test\"],\"upstream\":{\"instances\":[\"http://127.0.0.1:$up\"]}}" "$BASE/v1/deployments")
case $c in 200|201)
  got=$(curl -s -H "Host: $ns.example.test" "$BASE/index.html")
  [ "$got" = upstream ] && pass "host routed to an upstream deployment" || miss "deployment routing" "proxied body wrong: $(echo "$got" | head -c 200)";;
400) grep -q UPSTREAM_FORBIDDEN "$tmp/body" && pass "loopback upstream refused by the egress policy (start the node with MESHGATE_DEPLOY_UPSTREAM_ALLOW='[\"127.0.0.0/8\"]' to walk the proxy step)" \
     || miss "deployment" "HTTP 400 $(head -c 200 "$tmp/body")";;
*) miss "deployment" "HTTP $c $(head -c 200 "$tmp/body")";; esac
echo "tour: $ok passed, $bad failed"
[ $bad -eq 0 ]
