#!/usr/bin/env python3
"""The request path's budget in one run: four ratios, their baselines beside them.

Every part is its own process: the meshgate node (the binary given), an nginx
upstream answering a fixed 61-byte JSON body, an nginx reverse proxy in front
of that upstream (`proxy_pass`, upstream keep-alive, one worker per core), and
`wrk -t1 -c32` as the load generator. Only 2xx answers count: a run with a
non-2xx answer or a socket error stops the bench.

    chain (JWT)      GET /v1/kv/hot with a JWT          / GET /livez
    chain (API key)  GET /v1/kv/hot with an API key     / GET /livez
    invoke           POST /v1/functions/echo/invoke     / the KV read (API key)
                     (the C echo guest, 16-byte body)
    proxy            a deployment, route `auth: none`   / nginx proxy_pass
    proxy (api_key)  the same, route `auth: api_key`    / nginx proxy_pass

Each ratio's two paths run alternated A B B A for ROUNDS rounds of DURATION
seconds each, after one warm-up run of each; a row gives the mean of a
round's two runs of each path and the ratio, and each ratio's table row has
its rounds and their mean. The row's last two columns are the CPU time, in microseconds
per request, of the process serving each path (the node; nginx's workers for
nginx): unlike requests per second, they hold on a machine that is busy with
other work, so they compare two builds where throughput cannot.

With PROFILE_DIR set, each path is then profiled on its own: `perf record -F
299 --call-graph dwarf -p <node>` for PROFILE_SECONDS under the same load;
the node's CPU per request and each part's inclusive share of it are printed
as a table, the whole report written to PROFILE_DIR/<path>.txt.

Usage: scripts/bench-request-path.py <meshgate binary>
Environment: ROUNDS (3), DURATION (4), CONNECTIONS (32), PROFILE_DIR,
PROFILE_SECONDS (5); HOLD=1 sets everything up, prints each path's wrk
command and the node's pid, and waits for Enter (for a profiler). Needs wrk and nginx (scripts/bench-request-path.sh
installs them).
"""

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/meshgate"
ROUNDS = int(os.environ.get("ROUNDS", "3"))
DURATION = int(os.environ.get("DURATION", "4"))
CONNECTIONS = int(os.environ.get("CONNECTIONS", "32"))
PROFILE_DIR = os.environ.get("PROFILE_DIR")
PROFILE_SECONDS = int(os.environ.get("PROFILE_SECONDS", "5"))
OP = "mgop_bench_request_path_0123456789abcdef"
BODY = '{"hello":"world","padding":"0123456789abcdef0123456789abcdef"}'
INVOKE_INPUT = b'{"n":1,"s":"abc"}'[:16]
HERE = os.path.dirname(os.path.abspath(__file__))
ECHO = os.path.join(HERE, "..", "examples", "functions", "echo.wasm")


def need(tool, package):
    path = shutil.which(tool) or next(
        (p for p in (f"/usr/sbin/{tool}", f"/usr/bin/{tool}") if os.path.exists(p)), None
    )
    if not path:
        sys.exit(f"{tool} not found: run scripts/bench-request-path.sh (it installs it) or apt-get install -y {package}")
    return path


WRK = need("wrk", "wrk")
NGINX = need("nginx", "nginx")
CORES = os.cpu_count() or 1


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, what, proc):
    for _ in range(400):
        if proc.poll() is not None:
            sys.exit(f"{what} exited at start (status {proc.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.025)
    sys.exit(f"{what} did not start on port {port}")


def nginx(dir_, server_block):
    os.makedirs(dir_, exist_ok=True)
    conf = f"""worker_processes {CORES};
daemon off;
error_log {dir_}/error.log warn;
pid {dir_}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir_}/body;
  proxy_temp_path {dir_}/proxy;
  fastcgi_temp_path {dir_}/fastcgi;
  uwsgi_temp_path {dir_}/uwsgi;
  scgi_temp_path {dir_}/scgi;
  {server_block}
}}
"""
    path = os.path.join(dir_, "nginx.conf")
    with open(path, "w") as f:
        f.write(conf)
    return subprocess.Popen([NGINX, "-c", path, "-p", dir_])


def call(port, method, path, headers=None, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def must(status_body, ok, what):
    status, body = status_body
    if status not in ok:
        sys.exit(f"{what}: HTTP {status} {body[:300]!r}")
    return body


def multipart(fields):
    boundary = "benchboundary7f3a"
    out = b""
    for name, value, ctype in fields:
        out += f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"".encode()
        if ctype:
            out += f"; filename=\"{name}\"\r\nContent-Type: {ctype}".encode()
        out += b"\r\n\r\n" + value + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return out, f"multipart/form-data; boundary={boundary}"


class Wrk:
    def __init__(self, name, url, headers=(), body=None, tmp=None):
        self.name, self.url, self.headers = name, url, list(headers)
        self.script = None
        # The processes whose CPU serves this load (the node; nginx's workers).
        self.cpu_pids = lambda: []
        if body is not None:
            self.script = os.path.join(tmp, f"{abs(hash(name))}.lua")
            lua = "".join(f"\\{b}" for b in body)
            with open(self.script, "w") as f:
                f.write(f'wrk.method = "POST"\nwrk.body = "{lua}"\n')

    def args(self, secs):
        a = [WRK, "-t1", f"-c{CONNECTIONS}", f"-d{secs}s"]
        for h in self.headers:
            a += ["-H", h]
        if self.script:
            a += ["-s", self.script]
        return a + [self.url]

    def rps(self, secs=DURATION):
        """Requests per second of one run, and the serving process's CPU
        microseconds per request in it (see `cpu_pids`)."""
        c0 = sum(cpu_seconds(p) for p in self.cpu_pids())
        out = subprocess.run(self.args(secs), capture_output=True, text=True)
        c1 = sum(cpu_seconds(p) for p in self.cpu_pids())
        text = out.stdout
        if out.returncode != 0 or "Non-2xx" in text or "Socket errors" in text:
            sys.exit(f"wrk saw failed requests on {self.name}:\n{text}{out.stderr}")
        for line in text.splitlines():
            if line.startswith("Requests/sec:"):
                rps = float(line.split(":")[1])
                return rps, (c1 - c0) / max(rps * secs, 1) * 1e6
        sys.exit(f"no Requests/sec in wrk's output: {text}")


def ratio(top, bottom):
    """ROUNDS rows of (A req/s, B req/s, A/B, A CPU µs/req, B CPU µs/req)."""
    top.rps(2)
    bottom.rps(2)
    rows = []
    for _ in range(ROUNDS):
        (t1, ct1) = top.rps()
        (b1, cb1) = bottom.rps()
        (b2, cb2) = bottom.rps()
        (t2, ct2) = top.rps()
        t, b = (t1 + t2) / 2, (b1 + b2) / 2
        rows.append((t, b, t / b, (ct1 + ct2) / 2, (cb1 + cb2) / 2))
    return rows


def children(pid):
    """The pids whose parent is `pid` (nginx's workers)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def cpu_seconds(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# What each row of a profile's summary counts: the largest inclusive share
# of any symbol containing one of the patterns (the node's own steps, the
# libraries they call, the kernel's socket calls).
FEATURES = [
    ("HTTP/1 read and parse (actix-http)", ["h1::codec::Codec as tokio_util::codec::decoder::Decoder"]),
    ("canonical request", ["chain::canonical::canonicalize"]),
    ("routed-host lookup (every request)", ["deploy_serve::fast_route"]),
    ("route policy step (host, API policy)", ["chain::front::route_policy"]),
    ("trace context", ["TraceContext::from_headers"]),
    ("request id", ["logger::request_id"]),
    ("client + namespace rate limits", ["limits::client_rate_limit", "limits::charge_client"]),
    ("namespace rate limit", ["limits::namespace_rate_limit", "limits::charge_anonymous"]),
    ("authentication (key or JWT)", ["access::authenticate"]),
    ("authorization + scopes", ["access::authorization"]),
    ("router (actix-router)", ["actix_router::router::Router"]),
    ("KV read: store get + record MAC", ["SledStore as meshgate::storage::OrderedKv>::get"]),
    ("record MAC check", ["Store::verified"]),
    ("route policy (deployment)", ["route_policy::admit"]),
    ("proxy exchange (ours)", ["deploy::proxy::proxy_h1"]),
    ("upstream request head", ["deploy::wire::request_head"]),
    ("upstream answer parse", ["deploy::wire::parse_head"]),
    ("route metrics", ["Metrics::observe_route_series"]),
    ("route activity", ["Observed::push_activity"]),
    ("request metrics", ["admission::record_request"]),
    ("access log", ["access_log::Entry::finish"]),
    ("guest call (wasmtime + ours)", ["WasmEngine::try_here", "wasm::pool"]),
    ("invocation record", ["invoker::run::record", "InvocationRecord"]),
    ("send (kernel, wakes the client)", ["__libc_send"]),
    ("recv (kernel)", ["__libc_recv"]),
    ("allocator (self)", ["_mi_page_malloc", "mi_free", "mi_theap_malloc"]),
]


def node_cpu(pid):
    return cpu_seconds(pid)


def profile(load, pid, out_dir):
    """perf record (call graphs) of the node under `load`: the node's CPU
    per request and each feature's inclusive share of it, as a table."""
    data = os.path.join(out_dir, f"{load.name}.data")
    gen = subprocess.Popen(load.args(PROFILE_SECONDS + 2), stdout=subprocess.PIPE, text=True)
    time.sleep(1)
    c0 = node_cpu(pid)
    subprocess.run(
        ["perf", "record", "-F", "299", "--call-graph", "dwarf,16384", "-o", data, "-p", str(pid),
         "--", "sleep", str(PROFILE_SECONDS)],
        capture_output=True,
    )
    c1 = node_cpu(pid)
    out, _ = gen.communicate()
    rps = next((float(l.split(":")[1]) for l in out.splitlines() if l.startswith("Requests/sec:")), 0.0)
    us_per_req = (c1 - c0) / max(rps * PROFILE_SECONDS, 1) * 1e6
    rep = subprocess.run(
        ["perf", "report", "-i", data, "--children", "--stdio", "-g", "none",
         "--percent-limit", "0.2", "--sort", "symbol"],
        capture_output=True, text=True,
    )
    rows = []
    for line in rep.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].endswith("%") and parts[1].endswith("%"):
            rows.append((float(parts[0][:-1]), float(parts[1][:-1]), " ".join(parts[3:])))
    with open(os.path.join(out_dir, f"{load.name}.txt"), "w") as f:
        f.write(f"# {load.name}: {rps:,.0f} req/s under perf, node CPU {us_per_req:.1f} us per request\n")
        f.write("# children% self% symbol\n")
        for c, sf, sym in rows:
            f.write(f"{c:6.2f} {sf:6.2f} {sym[:160]}\n")
    summary = []
    for label, pats in FEATURES:
        if label.startswith("allocator"):
            share = sum(sf for _, sf, sym in rows if any(p in sym for p in pats))
        else:
            share = max((c for c, _, sym in rows if any(p in sym for p in pats)), default=0.0)
        if share >= 0.5:
            summary.append((label, share, share / 100 * us_per_req))
    os.remove(data)
    return us_per_req, summary


def main():
    tmp = tempfile.mkdtemp(prefix="bench-request-path-")
    procs = []
    try:
        # The upstream: nginx answering a fixed body on every path.
        up_port = free_port()
        upstream = nginx(
            os.path.join(tmp, "upstream"),
            f"server {{ listen 127.0.0.1:{up_port}; location / {{ default_type application/json; "
            f"return 200 '{BODY}'; }} }}",
        )
        procs.append(upstream)
        wait_port(up_port, "the nginx upstream", upstream)
        # nginx as the proxy to beat: proxy_pass with upstream keep-alive.
        px_port = free_port()
        proxy = nginx(
            os.path.join(tmp, "proxy"),
            f"upstream up {{ server 127.0.0.1:{up_port}; keepalive 128; }}\n"
            f"server {{ listen 127.0.0.1:{px_port}; location / {{ proxy_pass http://up; "
            "proxy_http_version 1.1; proxy_set_header Connection \"\"; "
            "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for; "
            "proxy_set_header X-Forwarded-Proto $scheme; proxy_set_header X-Forwarded-Host $host; } }",
        )
        procs.append(proxy)
        wait_port(px_port, "the nginx proxy", proxy)

        # The node: rate limits lifted, loopback upstreams allowed, room for
        # 32 calls in flight in one namespace.
        port = free_port()
        data = os.path.join(tmp, "node")
        big = 10**9
        cfg = os.path.join(tmp, "node.toml")
        with open(cfg, "w") as f:
            f.write(
                f"[rate_limit]\ngeneral_per_minute = {big}\ngeneral_burst = {big}\n"
                f"credential_per_minute = {big}\ncredential_burst = {big}\n"
                f"namespace_per_minute = {big}\nnamespace_burst = {big}\n"
                f"anonymous_per_minute = {big}\nanonymous_burst = {big}\n"
                "[deploy]\nupstream_allow = [\"127.0.0.0/8\"]\n"
                "[functions]\nnamespace_concurrency = 64\n"
            )
        env = dict(os.environ, MESHGATE_OPERATOR_KEY=OP, RUST_LOG=os.environ.get("BENCH_NODE_LOG", "warn"))
        node = subprocess.Popen(
            [BIN, "serve", "--config", cfg, "--listen", f"127.0.0.1:{port}", "--data-dir", data],
            env=env, stdout=subprocess.DEVNULL,
        )
        procs.append(node)
        wait_port(port, "the meshgate node", node)
        for _ in range(400):
            if call(port, "GET", "/readyz")[0] == 200:
                break
            time.sleep(0.05)

        body = must(call(port, "POST", "/v1/namespaces", {"authorization": f"Bearer {OP}",
                    "content-type": "application/json"}, json.dumps({"name": "bench"})), (201,), "namespace")
        key = json.loads(body)["api_key"]
        auth = {"authorization": f"Bearer {key}"}
        body = must(call(port, "POST", "/v1/auth/token", {"content-type": "application/json"},
                         json.dumps({"api_key": key})), (200,), "token")
        jwt = json.loads(body)["access_token"]
        must(call(port, "PUT", "/v1/kv/hot", auth, b"x" * 128), (200, 201), "kv put")
        with open(ECHO, "rb") as f:
            wasm = f.read()
        mp, ctype = multipart([("name", b"echo", None), ("wasm", wasm, "application/wasm")])
        must(call(port, "POST", "/v1/functions", dict(auth, **{"content-type": ctype}), mp), (200, 201), "deploy echo")
        out = must(call(port, "POST", "/v1/functions/echo/invoke", auth, INVOKE_INPUT), (200,), "invoke")
        assert out == INVOKE_INPUT, out
        for name, host, policy in (("open", "open.bench.test", {"auth": "none"}),
                                   ("keyed", "keyed.bench.test", {"auth": "api_key"})):
            dep = {"name": name, "hosts": [host],
                   "upstream": {"instances": [f"http://127.0.0.1:{up_port}"]},
                   "routes": [{"path_prefix": "/", "policy": policy}]}
            must(call(port, "POST", "/v1/deployments", dict(auth, **{"content-type": "application/json"}),
                      json.dumps(dep)), (200, 201), f"deployment {name}")
        must(call(port, "GET", "/hello", {"host": "open.bench.test"}), (200,), "proxy open")
        must(call(port, "GET", "/hello", {"host": "keyed.bench.test", "x-api-key": key}), (200,), "proxy keyed")
        s, _ = call(port, "GET", "/hello", {"host": "keyed.bench.test"})
        assert s == 401, f"the api_key route let a call without a key through ({s})"

        base = f"http://127.0.0.1:{port}"
        livez = Wrk("livez", f"{base}/livez")
        kv_jwt = Wrk("kv_jwt", f"{base}/v1/kv/hot", [f"Authorization: Bearer {jwt}"])
        kv_key = Wrk("kv_api_key", f"{base}/v1/kv/hot", [f"Authorization: Bearer {key}"])
        invoke = Wrk("invoke", f"{base}/v1/functions/echo/invoke", [f"Authorization: Bearer {key}"],
                     INVOKE_INPUT, tmp)
        px_open = Wrk("proxy_none", f"{base}/hello", ["Host: open.bench.test"])
        px_keyed = Wrk("proxy_api_key", f"{base}/hello", ["Host: keyed.bench.test", f"X-API-Key: {key}"])
        ngx = Wrk("nginx", f"http://127.0.0.1:{px_port}/hello", ["Host: open.bench.test"])
        for load in (livez, kv_jwt, kv_key, invoke, px_open, px_keyed):
            load.cpu_pids = lambda: [node.pid]
        ngx_workers = children(proxy.pid)
        ngx.cpu_pids = lambda: ngx_workers

        if os.environ.get("HOLD"):
            # The servers stay up for an outside generator or profiler.
            for load in (livez, kv_jwt, kv_key, invoke, px_open, px_keyed, ngx):
                print(load.name, " ".join(f"'{a}'" for a in load.args(DURATION)))
            print(f"node pid {node.pid}; press Enter to stop", flush=True)
            sys.stdin.readline()
            return
        rev = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        print(f"meshgate {BIN} (commit {rev.stdout.strip() or '?'}), {CORES} cores; wrk -t1 -c{CONNECTIONS}, "
              f"{DURATION} s runs alternated A B B A, {ROUNDS} rounds; every part its own process")
        print()
        print("| ratio | goal | path A req/s | path B req/s | rounds | mean | A CPU µs/req | B CPU µs/req |")
        print("|---|---|---:|---:|---|---:|---:|---:|")
        sets = [
            ("KV read, JWT / `/livez`", "≥ 0.8", kv_jwt, livez),
            ("KV read, API key / `/livez`", "≥ 0.8", kv_key, livez),
            ("invoke (C echo) / KV read, API key", "≥ 0.7", invoke, kv_key),
            ("proxy, route `auth: none` / nginx", "≥ 1.0", px_open, ngx),
            ("proxy, route `auth: api_key` / nginx", "≥ 0.9", px_keyed, ngx),
        ]
        for label, goal, a, b in sets:
            rows = ratio(a, b)
            ra = sum(r[0] for r in rows) / len(rows)
            rb = sum(r[1] for r in rows) / len(rows)
            mean = sum(r[2] for r in rows) / len(rows)
            each = ", ".join(f"{r[2]:.2f}" for r in rows)
            ca = sum(r[3] for r in rows) / len(rows)
            cb = sum(r[4] for r in rows) / len(rows)
            print(f"| {label} | {goal} | {ra:,.0f} | {rb:,.0f} | {each} | **{mean:.2f}** | {ca:.1f} | {cb:.1f} |",
                  flush=True)
        if PROFILE_DIR:
            os.makedirs(PROFILE_DIR, exist_ok=True)
            print(f"\nWhere the node's CPU goes per request (perf record -F 299 --call-graph dwarf, "
                  f"{PROFILE_SECONDS} s under the same load; inclusive shares, so nested rows overlap; "
                  f"full reports in {PROFILE_DIR})")
            for load in (livez, kv_jwt, kv_key, invoke, px_open, px_keyed):
                us, summary = profile(load, node.pid, PROFILE_DIR)
                print(f"\n`{load.name}`: {us:.1f} µs of node CPU per request")
                print("\n| part | share | µs |\n|---|---:|---:|")
                for label, share, part in summary:
                    print(f"| {label} | {share:.1f}% | {part:.2f} |")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
