#!/usr/bin/env python3
"""Many namespaces on one node: what an operator's reads cost at that size.

Starts `meshgate serve` (the binary given, a release build for the numbers in
BENCHMARKS.md) on 127.0.0.1 with a fresh data folder, `[metrics] public =
true` and a short `passivate_after_seconds`, creates N namespaces (POST
/v1/namespaces, then one PUT /v1/kv/k with the namespace's key, over THREADS
keep-alive clients), then prints one table:

- create rate, and one operator `/metrics` scrape's time and size at every
  progress line (every 50,000 namespaces, and at 1,000);
- the first operator scrape after creation (it ranks every namespace that
  moved since the last scrape), then, once every supervisor passivated, the
  median of 5 scrapes and the size of the operator view (operator key) and
  of the public view (no key);
- `GET /v1/namespaces?limit=100`: time (median of 5) and size of the first
  page (a node without paging answers the whole list: said so);
- RSS while every supervisor is live and after they all passivated, idle CPU
  after passivation (utime + stime over IDLE_SECONDS), and the first request
  of a sleeping namespace (GET /v1/kv/k, p50 / p99, SAMPLE namespaces).

The script keeps only the keys of the sampled namespaces, so its own memory
stays bounded at N = 1,000,000.

Usage: scripts/bench-million.py target/release/meshgate [N] [THREADS] [PASSIVATE_SECONDS]
(PASSIVATE_SECONDS, default 60, must outlast the creation for the "live" RSS
to mean every supervisor; at large N it is the time after the last one.)
"""

import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/meshgate"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 50_000
THREADS = int(sys.argv[3]) if len(sys.argv) > 3 else 4
PASSIVATE = int(sys.argv[4]) if len(sys.argv) > 4 else 60
IDLE_SECONDS = int(os.environ.get("MESHGATE_BENCH_IDLE_SECONDS", "65"))
PROGRESS = 50_000
SAMPLE = 1000
STRIDE = max(1, N // SAMPLE)
PORT = 19_400 + os.getpid() % 500
OP = "mgop_bench_million_0123456789"


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_ticks(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])


class Conn:
    """A keep-alive client that reconnects once when the node closed an idle connection."""

    def __init__(self, timeout=120):
        self.timeout = timeout
        self.c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=timeout)

    def call(self, method, path, body=None, key=OP):
        headers = {"content-type": "application/json"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        for attempt in (0, 1):
            try:
                self.c.request(method, path, body=body, headers=headers)
                r = self.c.getresponse()
                return r.status, r.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.c.close()
                self.c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=self.timeout)
                if attempt:
                    raise


def timed(c, path, key=OP):
    t = time.monotonic()
    s, b = c.call("GET", path, None, key)
    took = time.monotonic() - t
    assert s == 200, (path, s, b[:200])
    return took * 1000, len(b), b


def median_of(c, path, key=OP, times=5):
    runs = [timed(c, path, key) for _ in range(times)]
    return statistics.median(r[0] for r in runs), runs[-1][1], runs[-1][2]


def main():
    tmp = tempfile.mkdtemp()
    cfg = os.path.join(tmp, "config.toml")
    with open(cfg, "w") as f:
        f.write(
            f'[server]\nlisten = "127.0.0.1:{PORT}"\ndata_dir = "{tmp}/data"\n'
            f"passivate_after_seconds = {PASSIVATE}\n"
            "[metrics]\npublic = true\n"
            "[rate_limit]\ngeneral_per_minute = 100000000\ngeneral_burst = 10000000\n"
            "namespace_per_minute = 100000000\nnamespace_burst = 10000000\n"
        )
    env = dict(os.environ, MESHGATE_OPERATOR_KEY=OP, RUST_LOG="error")
    node = subprocess.Popen([BIN, "serve", "--config", cfg], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        c = Conn()
        for _ in range(600):
            try:
                if c.call("GET", "/readyz")[0] == 200:
                    break
            except OSError:
                c = Conn()
            time.sleep(0.05)
        base = rss_kib(node.pid)
        sampled = {}
        lock = threading.Lock()
        done = [0]
        next_mark = [min(1000, N)]
        t0 = time.monotonic()

        def progress():
            # One thread at a time reports; the others go on creating.
            ms, size, _ = timed(Conn(), "/metrics")
            line = (f"{done[0]} namespaces, {time.monotonic() - t0:.0f} s, "
                    f"{done[0] / (time.monotonic() - t0):.0f} /s, RSS {rss_kib(node.pid) / 1024:.0f} MiB, "
                    f"scrape {ms:.0f} ms {size} B")
            print(line, file=sys.stderr, flush=True)
            rows.append((done[0], ms, size))

        def create(k):
            c = Conn()
            for i in range(k, N, THREADS):
                name = f"t{i}"
                s, b = c.call("POST", "/v1/namespaces", json.dumps({"name": name}))
                assert s == 201, (s, b)
                key = json.loads(b)["api_key"]
                s, b = c.call("PUT", "/v1/kv/k", b"v", key)
                assert s == 200, (s, b)
                report = False
                with lock:
                    if i % STRIDE == 0:
                        sampled[i] = key
                    done[0] += 1
                    if done[0] >= next_mark[0]:
                        report = True
                        next_mark[0] = (next_mark[0] // PROGRESS + 1) * PROGRESS
                if report:
                    progress()

        ts = [threading.Thread(target=create, args=(k,)) for k in range(THREADS)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        took = time.monotonic() - t0
        live = json.loads(c.call("GET", "/v1/status")[1])["namespaces_running"]
        active = rss_kib(node.pid)
        first_ms, first_size, _ = timed(c, "/metrics")
        while json.loads(c.call("GET", "/v1/status")[1])["namespaces_running"] > 0:
            time.sleep(0.5)
        time.sleep(1)
        asleep = rss_kib(node.pid)
        op_ms, op_size, op_body = median_of(c, "/metrics")
        pub_ms, pub_size, _ = median_of(c, "/metrics", key=None)
        labels = {l.split('namespace="', 1)[1].split('"', 1)[0]
                  for l in op_body.decode().splitlines()
                  if not l.startswith("#") and 'namespace="' in l}
        page_ms, page_size, page = median_of(c, "/v1/namespaces?limit=100")
        listed = len(json.loads(page).get("namespaces", []))
        paged = "paged" if listed <= 100 else "limit ignored: the whole list"
        c0 = cpu_ticks(node.pid)
        time.sleep(IDLE_SECONDS)
        idle_cpu = (cpu_ticks(node.pid) - c0) / os.sysconf("SC_CLK_TCK") / IDLE_SECONDS
        lat = []
        for i in sorted(sampled):
            t = time.monotonic()
            s, b = c.call("GET", "/v1/kv/k", None, sampled[i])
            lat.append(time.monotonic() - t)
            assert (s, b) == (200, b"v"), (s, b)
        lat.sort()
        p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000
        print(f"| namespaces | {N} (live after create: {live}) |")
        print(f"| create + 1 KV write | {N / took:.0f} /s ({took:.1f} s, {THREADS} clients) |")
        for n, ms, size in rows:
            print(f"| operator /metrics during creation, at {n} | {ms:.0f} ms, {size} B |")
        print(f"| operator /metrics, first scrape after creation | {first_ms:.0f} ms, {first_size} B |")
        print(f"| operator /metrics, idle (median of 5) | {op_ms:.1f} ms, {op_size} B, {len(labels)} namespace label values |")
        print(f"| public /metrics, idle (median of 5) | {pub_ms:.1f} ms, {pub_size} B |")
        print(f"| GET /v1/namespaces?limit=100 (median of 5) | {page_ms:.1f} ms, {page_size} B, {listed} namespaces ({paged}) |")
        print(f"| RSS, live | {active / 1024:.0f} MiB ({(active - base) * 1024 / N:.0f} B per namespace; empty node {base / 1024:.0f} MiB) |")
        print(f"| RSS, passivated | {asleep / 1024:.0f} MiB ({(asleep - base) * 1024 / N:.0f} B per namespace) |")
        print(f"| idle CPU after passivation | {idle_cpu * 100:.2f} % of a core over {IDLE_SECONDS} s |")
        print(f"| first request, sleeping namespace | p50 {p(0.5):.2f} ms, p99 {p(0.99):.2f} ms ({len(lat)} namespaces) |")
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(60)


if __name__ == "__main__":
    main()
