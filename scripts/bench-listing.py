#!/usr/bin/env python3
"""The listing bench: what `GET /v1/namespaces` costs at N namespaces, before
paging and after.

Creates N namespaces with NEW (POST /v1/namespaces over THREADS keep-alive
clients) in a fresh data folder, stops it, then starts each binary in turn
on that same folder and prints one table row per binary:

- one `GET /v1/namespaces` with no parameters: its status, its size in
  bytes, its time (the median of 3), and the node's peak RSS growth over
  the idle node (VmHWM) across those calls;
- NEW only: every namespace through the cursor (`?limit=1000`, then
  `next_cursor` until null): pages, time, and that each namespace came
  exactly once.

OLD answers the whole listing in one document (it ignores `limit`); NEW
answers 100 by default.

Usage: scripts/bench-listing.py OLD_BIN NEW_BIN [N] [THREADS]
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

OLD = sys.argv[1]
NEW = sys.argv[2]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 20_000
THREADS = int(sys.argv[4]) if len(sys.argv) > 4 else 4
PORT = 19_400 + os.getpid() % 500
OP = "mgop_bench_listing_0123456789"


def status_kib(pid, field):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def conn():
    return http.client.HTTPConnection("127.0.0.1", PORT, timeout=600)


def call(c, method, path, body=None):
    headers = {"authorization": f"Bearer {OP}", "content-type": "application/json"}
    c.request(method, path, body=body, headers=headers)
    r = c.getresponse()
    return r.status, r.read()


def start(binary, cfg):
    env = dict(os.environ, MESHGATE_OPERATOR_KEY=OP, RUST_LOG="error")
    node = subprocess.Popen([binary, "serve", "--config", cfg], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1200):
        try:
            c = conn()
            if call(c, "GET", "/readyz")[0] == 200:
                return node
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{binary} never became ready")


def stop(node):
    node.send_signal(signal.SIGTERM)
    node.wait(60)


def create(lo, hi):
    c = conn()
    for i in range(lo, hi):
        s, b = call(c, "POST", "/v1/namespaces", json.dumps({"name": f"n{i:07d}"}))
        assert s == 201, (s, b)


def measure(name, binary, cfg, walk):
    node = start(binary, cfg)
    try:
        c = conn()
        base = status_kib(node.pid, "VmHWM")
        times, size, code = [], 0, 0
        for _ in range(3):
            t = time.monotonic()
            code, body = call(c, "GET", "/v1/namespaces")
            times.append(time.monotonic() - t)
            size = len(body)
            listed = len(json.loads(body)["namespaces"])
        peak = status_kib(node.pid, "VmHWM") - base
        times.sort()
        row = (f"| {name} | {code}, {size:,} B, {listed:,} namespaces | "
               f"{times[1] * 1000:.0f} ms | +{peak / 1024:.0f} MiB |")
        if walk:
            seen, pages, cursor = {}, 0, None
            t = time.monotonic()
            while True:
                q = "/v1/namespaces?limit=1000" + (f"&cursor={cursor}" if cursor else "")
                s, body = call(c, "GET", q)
                assert s == 200, (s, body[:200])
                v = json.loads(body)
                pages += 1
                for ns in v["namespaces"]:
                    seen[ns["name"]] = seen.get(ns["name"], 0) + 1
                cursor = v.get("next_cursor")
                if not cursor:
                    break
            took = time.monotonic() - t
            ours = [k for k in seen if k.startswith("n")]
            assert len(ours) == N and all(seen[k] == 1 for k in ours), "every namespace once"
            row += f" {pages} pages of 1,000, {took * 1000:.0f} ms, each of {N:,} once |"
        else:
            row += " (no cursor) |"
        print(row, flush=True)
    finally:
        stop(node)


def main():
    tmp = tempfile.mkdtemp()
    cfg = os.path.join(tmp, "config.toml")
    with open(cfg, "w") as f:
        f.write(
            f'[server]\nlisten = "127.0.0.1:{PORT}"\ndata_dir = "{tmp}/data"\n'
            "passivate_after_seconds = 5\n"
            "[rate_limit]\ngeneral_per_minute = 100000000\ngeneral_burst = 10000000\n"
            "namespace_per_minute = 100000000\nnamespace_burst = 10000000\n"
        )
    node = start(NEW, cfg)
    try:
        t = time.monotonic()
        step = (N + THREADS - 1) // THREADS
        ts = [threading.Thread(target=create, args=(k * step, min(N, (k + 1) * step)))
              for k in range(THREADS)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        print(f"created {N:,} namespaces in {time.monotonic() - t:.0f} s", file=sys.stderr)
    finally:
        stop(node)
    print(f"| binary | `GET /v1/namespaces` (no parameters) | time (median of 3) | peak RSS growth | every namespace through the cursor |")
    print("|---|---|---|---|---|")
    measure("before (whole list)", OLD, cfg, walk=False)
    measure("after (paged)", NEW, cfg, walk=True)


if __name__ == "__main__":
    main()
