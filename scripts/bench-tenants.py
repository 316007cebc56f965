#!/usr/bin/env python3
"""Issue #42's tenant bench: one node, many namespaces, one KV write each.

Starts `meshgate serve` (the binary given, a release build for the numbers in
BENCHMARKS.md) on 127.0.0.1 with a fresh data folder and a short
`passivate_after_seconds`, then prints one table:

- create rate: namespaces created per second (POST /v1/namespaces, then one
  PUT /v1/kv/k with the namespace's key), over THREADS keep-alive clients;
- RSS per namespace while every supervisor is live, and after they all
  passivated (VmRSS growth over the empty node, divided by N);
- idle CPU after passivation (utime + stime over IDLE_SECONDS);
- first-request latency of a sleeping namespace (GET /v1/kv/k, p50 / p99,
  SAMPLE namespaces, one request each).

Usage: scripts/bench-tenants.py target/release/meshgate [N] [THREADS] [PASSIVATE_SECONDS]
(PASSIVATE_SECONDS, default 60, must outlast the creation so every supervisor is live when the first RSS is read.)
"""

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/meshgate"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
THREADS = int(sys.argv[3]) if len(sys.argv) > 3 else 4
PASSIVATE = int(sys.argv[4]) if len(sys.argv) > 4 else 60
# Long enough for two runs of the store's 30 s expiry sweep (the node's
# slowest periodic work): a shorter window may or may not catch one.
IDLE_SECONDS = int(os.environ.get("MESHGATE_BENCH_IDLE_SECONDS", "65"))
SAMPLE = 1000
PORT = 18_900 + os.getpid() % 500
OP = "mgop_bench_tenants_0123456789"


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_ticks(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])


def thread_ticks(pid):
    """CPU ticks by thread name (threads of one name summed)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            raw = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        f = raw.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0) + int(f[11]) + int(f[12])
    return out


class Conn:
    """A keep-alive client that reconnects once when the node closed an idle connection."""

    def __init__(self):
        self.c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=60)

    def call(self, method, path, body, headers):
        for attempt in (0, 1):
            try:
                self.c.request(method, path, body=body, headers=headers)
                r = self.c.getresponse()
                return r.status, r.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.c.close()
                self.c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=60)
                if attempt:
                    raise


def conn():
    return Conn()


def call(c, method, path, body=None, key=OP):
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    return c.call(method, path, body, headers)


def status(c):
    return json.loads(call(c, "GET", "/v1/status")[1])


def main():
    tmp = tempfile.mkdtemp()
    cfg = os.path.join(tmp, "config.toml")
    with open(cfg, "w") as f:
        f.write(
            f'[server]\nlisten = "127.0.0.1:{PORT}"\ndata_dir = "{tmp}/data"\n'
            f"passivate_after_seconds = {PASSIVATE}\n"
            "[rate_limit]\ngeneral_per_minute = 100000000\ngeneral_burst = 10000000\n"
            "namespace_per_minute = 100000000\nnamespace_burst = 10000000\n"
        )
    env = dict(os.environ, MESHGATE_OPERATOR_KEY=OP, RUST_LOG="error")
    node = subprocess.Popen([BIN, "serve", "--config", cfg], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        c = conn()
        for _ in range(600):
            try:
                if call(c, "GET", "/readyz")[0] == 200:
                    break
            except OSError:
                c = conn()
            time.sleep(0.05)
        base = rss_kib(node.pid)
        keys = [None] * N

        def create(lo, hi):
            c = conn()
            for i in range(lo, hi):
                name = f"t{i}"
                s, b = call(c, "POST", "/v1/namespaces", json.dumps({"name": name}))
                assert s == 201, (s, b)
                keys[i] = json.loads(b)["api_key"]
                s, b = call(c, "PUT", "/v1/kv/k", b"v", keys[i])
                assert s == 200, (s, b)

        t0 = time.monotonic()
        step = (N + THREADS - 1) // THREADS
        ts = [threading.Thread(target=create, args=(k * step, min(N, (k + 1) * step)))
              for k in range(THREADS)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        took = time.monotonic() - t0
        live = status(c)["namespaces_running"]
        active = rss_kib(node.pid)
        while status(c)["namespaces_running"] > 0:
            time.sleep(0.5)
        time.sleep(1)
        asleep = rss_kib(node.pid)
        c0 = cpu_ticks(node.pid)
        t0 = thread_ticks(node.pid)
        if os.environ.get("MESHGATE_BENCH_IDLE_MARK"):
            print(f"IDLE {node.pid}", file=sys.stderr, flush=True)
        time.sleep(IDLE_SECONDS)
        idle_cpu = (cpu_ticks(node.pid) - c0) / os.sysconf("SC_CLK_TCK") / IDLE_SECONDS
        t1 = thread_ticks(node.pid)
        by_thread = sorted(((t1[k] - t0.get(k, 0), k) for k in t1), reverse=True)
        by_thread = ", ".join(f"{k} {v}" for v, k in by_thread[:5] if v > 0) or "none"
        lat = []
        for i in range(0, N, max(1, N // SAMPLE)):
            t = time.monotonic()
            s, b = call(c, "GET", "/v1/kv/k", None, keys[i])
            lat.append(time.monotonic() - t)
            assert (s, b) == (200, b"v"), (s, b)
        lat.sort()
        p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000
        print(f"| namespaces | {N} (live after create: {live}) |")
        print(f"| create + 1 KV write | {N / took:.0f} /s ({took:.1f} s, {THREADS} clients) |")
        print(f"| RSS per namespace, live | {(active - base) * 1024 / N:.0f} B (node {active / 1024:.0f} MiB, empty {base / 1024:.0f} MiB) |")
        print(f"| RSS per namespace, passivated | {(asleep - base) * 1024 / N:.0f} B (node {asleep / 1024:.0f} MiB) |")
        print(f"| idle CPU after passivation | {idle_cpu * 100:.2f} % of a core over {IDLE_SECONDS} s (ticks by thread: {by_thread}) |")
        print(f"| first request, sleeping namespace | p50 {p(0.5):.2f} ms, p99 {p(0.99):.2f} ms ({len(lat)} namespaces) |")
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(30)


if __name__ == "__main__":
    main()
